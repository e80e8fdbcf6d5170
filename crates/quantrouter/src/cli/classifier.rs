//! `quantrouter classifier train|eval|push|get|history|rollback`.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use quantrouter_policy::classifier::{
    evaluate, leave_one_source_out, parse_labelled, train, LabelledPrompt, Split, TrainOptions,
};
use quantrouter_policy::{ClassifierDocument, ProfileSet, TaskClass};

use super::{document_command, load_set, CliError, DocumentCommand};

#[derive(Debug, Subcommand)]
pub enum ClassifierCommand {
    /// Train a model on the `train` split of labelled JSONL and write its document.
    Train(TrainArgs),
    /// Route labelled JSONL with a model and report accuracy and where each label lands.
    Eval(EvalArgs),
    #[command(flatten)]
    Stored(DocumentCommand),
}

/// Labelled data and how to read it.
#[derive(Debug, Clone, Args)]
pub struct DataArgs {
    /// Labelled JSONL: `{"prompt", "label": "heavy|medium|light"}`, optionally `task_class`,
    /// `source`, `id`, `split`. Repeat to combine files.
    #[arg(long, required = true)]
    pub data: Vec<PathBuf>,
    /// SOURCE=CLASS: the task class of a source's prompts that carry none (labels come by
    /// source, e.g. `alpaca=general`). Repeatable.
    #[arg(long = "source-class")]
    pub source_class: Vec<String>,
    /// ALIAS=SOURCE: count prompts of ALIAS as SOURCE (two files drawn from one data set,
    /// which leave-one-source-out must hold out together). Repeatable.
    #[arg(long = "same-source")]
    pub same_source: Vec<String>,
    /// Decides which prompts without a `split` are held out for dev.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Profile-set file the routing shares are measured against (default: the embedded set).
    #[arg(long)]
    pub profiles: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub data: DataArgs,
    /// Where to write the model document.
    #[arg(long)]
    pub out: PathBuf,
    /// Hash table size: 2^bits rows of weights.
    #[arg(long, default_value_t = TrainOptions::default().bits)]
    pub bits: u32,
    /// Inverse regularisation strength.
    #[arg(long, default_value_t = TrainOptions::default().c)]
    pub regularization: f64,
    /// Share of the model's difficulty in the complexity (the rest: the structural score).
    #[arg(long, default_value_t = TrainOptions::default().blend)]
    pub blend: f64,
    /// What a medium prompt counts towards the difficulty (heavy 1, light 0).
    #[arg(long, default_value_t = TrainOptions::default().medium_weight)]
    pub medium_weight: f64,
    /// Also train one model per source without it and measure it on that source, and keep
    /// the result in the model's metrics.
    #[arg(long)]
    pub leave_one_source_out: bool,
    /// A source leave-one-source-out never holds out: always trained on (repeatable).
    #[arg(long = "keep-in-training")]
    pub keep_in_training: Vec<String>,
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(flatten)]
    pub data: DataArgs,
    /// Model file (default: the built-in model; `off` for the structural score alone).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Which prompts to measure on.
    #[arg(long, value_enum, default_value = "all")]
    pub split: SplitChoice,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SplitChoice {
    Train,
    Dev,
    All,
}

/// Runs a classifier command.
pub fn run(command: ClassifierCommand) -> Result<(), CliError> {
    match command {
        ClassifierCommand::Train(args) => run_train(&args),
        ClassifierCommand::Eval(args) => run_eval(&args),
        ClassifierCommand::Stored(command) => document_command(command, read_model),
    }
}

fn run_train(args: &TrainArgs) -> Result<(), CliError> {
    let (data, set) = read_data(&args.data)?;
    let options = TrainOptions {
        seed: args.data.seed,
        bits: args.bits,
        c: args.regularization,
        max_iterations: TrainOptions::default().max_iterations,
        blend: args.blend,
        medium_weight: args.medium_weight,
    };
    if !(8..=16).contains(&options.bits) {
        return Err(CliError::Invalid("--bits must be in 8..=16".into()));
    }
    if !(options.c > 0.0 && options.c.is_finite()) {
        return Err(CliError::Invalid(
            "--regularization must be a positive number".into(),
        ));
    }
    for (flag, v) in [
        ("--blend", options.blend),
        ("--medium-weight", options.medium_weight),
    ] {
        if !(0.0..=1.0).contains(&v) {
            return Err(CliError::Invalid(format!("{flag} must be in [0, 1]")));
        }
    }
    let trained = data.iter().filter(|p| p.split == Split::Train).count();
    if trained == 0 {
        return Err(CliError::Invalid("no prompts in the train split".into()));
    }
    eprintln!("training on {trained} prompts");
    let mut doc = train(&data, &options);
    let model = doc
        .classifier()
        .map_err(|e| CliError::Invalid(e.to_string()))?;
    let dev: Vec<&LabelledPrompt> = data.iter().filter(|p| p.split == Split::Dev).collect();
    if !dev.is_empty() {
        let report =
            evaluate(&set, Some(&model), &dev).map_err(|e| CliError::Invalid(e.to_string()))?;
        println!("dev split ({} prompts):\n{report}", dev.len());
        doc.metrics.dev = Some(report.summary());
    }
    if args.leave_one_source_out {
        eprintln!("leave-one-source-out: one model per source");
        let loso = leave_one_source_out(&set, &data, &options, &args.keep_in_training)
            .map_err(|e| CliError::Invalid(e.to_string()))?;
        println!("leave-one-source-out:\n{loso}");
        doc.metrics.leave_one_source_out = Some(loso);
    }
    std::fs::write(&args.out, doc.to_json() + "\n")
        .map_err(|e| CliError::Io(format!("writing {}: {e}", args.out.display())))?;
    println!("wrote {} (sha256 {})", args.out.display(), doc.sha256);
    Ok(())
}

fn run_eval(args: &EvalArgs) -> Result<(), CliError> {
    let (data, set) = read_data(&args.data)?;
    let model = match args.model.as_deref() {
        Some(path) if path == Path::new("off") => None,
        Some(path) => Some(
            read_model(path)?
                .classifier()
                .map_err(|e| CliError::Invalid(e.to_string()))?,
        ),
        None => Some(
            quantrouter_policy::Classifier::builtin()
                .map_err(|e| CliError::Invalid(e.to_string()))?,
        ),
    };
    let chosen: Vec<&LabelledPrompt> = data
        .iter()
        .filter(|p| match args.split {
            SplitChoice::All => true,
            SplitChoice::Train => p.split == Split::Train,
            SplitChoice::Dev => p.split == Split::Dev,
        })
        .collect();
    let report =
        evaluate(&set, model.as_ref(), &chosen).map_err(|e| CliError::Invalid(e.to_string()))?;
    println!("{} prompts:\n{report}", chosen.len());
    Ok(())
}

/// Reads, relabels and combines the data files, and the profile set to measure against.
fn read_data(args: &DataArgs) -> Result<(Vec<LabelledPrompt>, ProfileSet), CliError> {
    let classes = pairs(&args.source_class, "--source-class")?
        .into_iter()
        .map(|(source, class)| {
            let class: TaskClass = serde_json::from_value(class.clone().into()).map_err(|_| {
                CliError::Invalid(format!(
                    "--source-class {source}={class}: unknown task class"
                ))
            })?;
            Ok((source, class))
        })
        .collect::<Result<Vec<_>, CliError>>()?;
    let aliases = pairs(&args.same_source, "--same-source")?;
    let mut data = Vec::new();
    for path in &args.data {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::Invalid(format!("reading {}: {e}", path.display())))?;
        let mut rows = parse_labelled(&text, args.seed)
            .map_err(|e| CliError::Invalid(format!("{}: {e}", path.display())))?;
        for row in &mut rows {
            // Both flags name sources as the files do.
            if row.task_class.is_none() {
                row.task_class = classes
                    .iter()
                    .find(|(s, _)| *s == row.source)
                    .map(|(_, c)| *c);
            }
            if let Some((_, to)) = aliases.iter().find(|(from, _)| *from == row.source) {
                row.source = to.clone();
            }
        }
        data.extend(rows);
    }
    Ok((data, load_set(args.profiles.as_deref())?))
}

fn pairs(values: &[String], flag: &str) -> Result<Vec<(String, String)>, CliError> {
    values
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| CliError::Invalid(format!("{flag} {pair}: expected A=B")))
        })
        .collect()
}

/// A model file, validated.
pub fn read_model(path: &Path) -> Result<ClassifierDocument, CliError> {
    crate::classifier::read_file(path).map_err(|e| CliError::Invalid(e.to_string()))
}
