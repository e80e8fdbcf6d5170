//! `quantrouter classifier train|eval|push|get|history|rollback`.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use quantrouter_policy::classifier::{
    complexity_scores, cross_validate_with_scores, evaluate, leave_one_source_out, length_scores,
    paired_bootstrap, parse_labelled, parse_outcomes, random_scores, retrain_outcomes,
    routing_curve, seed_spread, train_with_outcomes, DegenerateHead, LabelledPrompt,
    OutcomeCrossValidation, OutcomeRecord, RoutingCurve, Split, TrainOptions,
};
use quantrouter_policy::{
    Classifier, ClassifierDocument, ComplexityWeights, ProfileSet, TaskClass,
};

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
    #[arg(long)]
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
    /// Outcome JSONL (`{"prompt", "weak_correct", "strong_correct", "source", "category"}`,
    /// or the router's traffic records), or `redis://HOST:PORT[/PREFIX]`: the router's
    /// stream `PREFIX:outcomes` (default prefix `quantrouter`). Also train the outcome head
    /// on them. Several may follow one flag.
    #[arg(long, num_args = 1..)]
    pub outcomes: Vec<PathBuf>,
    /// Also report the outcome head held out (kept in the metrics), and how much of it is
    /// noise.
    #[command(flatten)]
    pub held_out: HeldOutArgs,
    /// Refit only the outcome head of this model (a file, or `builtin`) to `--outcomes`,
    /// keeping its other heads: no `--data` needed. The loop that learns from the router's
    /// own traffic.
    #[arg(long, conflicts_with = "data")]
    pub base: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CrossValidate {
    Category,
}

/// How the outcome head is held out, and how much of its figures is measured as noise.
#[derive(Debug, Clone, Args)]
pub struct HeldOutArgs {
    /// Report an outcome head held out by `category` (one head per category trained
    /// without it; a benchmark of one category by five folds of prompts, drawn by
    /// `--seed`), beside the prompt-length and complexity baselines.
    #[arg(long = "cross-validate", value_enum)]
    pub cross_validate: Option<CrossValidate>,
    /// Resample the prompts of each benchmark N times and print the 95% interval of the
    /// held-out APGR less each baseline's (the same resamples for all three).
    #[arg(long, default_value_t = 0, requires = "cross_validate")]
    pub bootstrap: usize,
    /// Repeat the held-out folds with each of these seeds (`0,1,2`) and print the spread.
    #[arg(
        long = "fold-seeds",
        value_delimiter = ',',
        requires = "cross_validate"
    )]
    pub fold_seeds: Vec<u64>,
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
    /// Outcome JSONL (or `redis://HOST:PORT[/PREFIX]`, the router's stream): rank the
    /// prompts by the outcome head (without one: by the complexity) and print APGR,
    /// CPT(50%), CPT(80%), the curve and the random and prompt-length baselines. Several
    /// may follow one flag.
    #[arg(long, num_args = 1..)]
    pub outcomes: Vec<PathBuf>,
    /// Also fit outcome heads to `--outcomes` held out (the model gives each prompt its
    /// task class and complexity; its own head is not used) and report them.
    #[command(flatten)]
    pub held_out: HeldOutArgs,
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
        ClassifierCommand::Stored(command) => document_command(command, read_model_to_push),
    }
}

fn run_train(args: &TrainArgs) -> Result<(), CliError> {
    if let Some(base) = &args.base {
        return run_retrain(args, base);
    }
    if args.data.data.is_empty() {
        return Err(CliError::Invalid("--data is required".into()));
    }
    let (data, set) = read_data(&args.data)?;
    let outcomes = read_outcomes(&args.outcomes)?;
    if args.held_out.cross_validate.is_some() && outcomes.is_empty() {
        return Err(CliError::Invalid(
            "--cross-validate needs --outcomes".into(),
        ));
    }
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
    eprintln!(
        "training on {trained} prompts and {} outcome records",
        outcomes.len()
    );
    let mut doc = train_with_outcomes(&data, &outcomes, &options);
    let model = doc
        .classifier()
        .map_err(|e| CliError::Invalid(e.to_string()))?;
    doc.metrics.outcome_training_apgr = check_head(&model, &outcomes)?;
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
    write_model(doc, args, &outcomes, options.seed)
}

/// `train --base`: the base model with its outcome head refitted to the records.
fn run_retrain(args: &TrainArgs, base: &Path) -> Result<(), CliError> {
    if args.outcomes.is_empty() {
        return Err(CliError::Invalid("--base needs --outcomes".into()));
    }
    let base = match base.to_str() {
        Some("builtin") => ClassifierDocument::from_json(quantrouter_policy::DEFAULT_CLASSIFIER)
            .map_err(|e| CliError::Invalid(e.to_string()))?,
        _ => read_model(base)?,
    };
    let outcomes = read_outcomes(&args.outcomes)?;
    eprintln!(
        "refitting the outcome head on {} outcome records",
        outcomes.len()
    );
    let mut doc =
        retrain_outcomes(&base, &outcomes).map_err(|e| CliError::Invalid(e.to_string()))?;
    let model = doc
        .classifier()
        .map_err(|e| CliError::Invalid(e.to_string()))?;
    doc.metrics.outcome_training_apgr = check_head(&model, &outcomes)?;
    write_model(doc, args, &outcomes, args.data.seed)
}

/// The trained outcome head against its own records: its APGR on them, or an error when it
/// is degenerate (constant, not finite, or no better than random), so that no such model
/// is written.
fn check_head(model: &Classifier, outcomes: &[OutcomeRecord]) -> Result<Option<f64>, CliError> {
    let window = ComplexityWeights::default().scoring_window_chars;
    model
        .check_outcome_fit(outcomes, window)
        .map_err(|e| CliError::Invalid(format!("not writing the model: {e}")))
}

/// Writes a trained model, with the outcome head's held-out figures when they were asked for.
fn write_model(
    mut doc: ClassifierDocument,
    args: &TrainArgs,
    outcomes: &[OutcomeRecord],
    seed: u64,
) -> Result<(), CliError> {
    if args.held_out.cross_validate.is_some() {
        let model = doc
            .classifier()
            .map_err(|e| CliError::Invalid(e.to_string()))?;
        let (cv, report) = held_out_report(outcomes, &model, seed, &args.held_out);
        print!("{report}");
        doc.metrics.outcomes = Some(cv);
    }
    std::fs::write(&args.out, doc.to_json() + "\n")
        .map_err(|e| CliError::Io(format!("writing {}: {e}", args.out.display())))?;
    println!("wrote {} (sha256 {})", args.out.display(), doc.sha256);
    Ok(())
}

/// The outcome head held out ([`cross_validate_with_scores`]) and, as asked, the paired
/// bootstrap of its lead over the baselines and its spread over fold seeds.
fn held_out_report(
    outcomes: &[OutcomeRecord],
    model: &Classifier,
    seed: u64,
    args: &HeldOutArgs,
) -> (OutcomeCrossValidation, String) {
    use std::fmt::Write as _;
    let window = ComplexityWeights::default().scoring_window_chars;
    let (cv, scores) = cross_validate_with_scores(outcomes, window, seed, model);
    let mut out = format!("outcome head, held out by category or by prompt:\n{cv}");
    if args.bootstrap > 0 {
        let _ = writeln!(
            out,
            "\nheld-out APGR less the baselines', {} resamples of the prompts (seed {seed}):",
            args.bootstrap
        );
        for (source, scores) in cv.sources.iter().zip(&scores) {
            match paired_bootstrap(scores, args.bootstrap, seed) {
                Some(b) => {
                    let _ = writeln!(
                        out,
                        "{}:\n  less prompt length: {}\n  less complexity:    {}",
                        source.source, b.length, b.complexity
                    );
                }
                None => {
                    let _ = writeln!(out, "{}: no gap to recover", source.source);
                }
            }
        }
    }
    if !args.fold_seeds.is_empty() {
        let _ = writeln!(out, "\nheld out under other fold seeds:");
        for spread in seed_spread(outcomes, window, &args.fold_seeds, model) {
            let _ = write!(out, "{spread}");
        }
    }
    (cv, out)
}

fn run_eval(args: &EvalArgs) -> Result<(), CliError> {
    if args.data.data.is_empty() && args.outcomes.is_empty() {
        return Err(CliError::Invalid("--data or --outcomes is required".into()));
    }
    if args.held_out.cross_validate.is_some() && args.outcomes.is_empty() {
        return Err(CliError::Invalid(
            "--cross-validate needs --outcomes".into(),
        ));
    }
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
    if !chosen.is_empty() {
        let report = evaluate(&set, model.as_ref(), &chosen)
            .map_err(|e| CliError::Invalid(e.to_string()))?;
        println!("{} prompts:\n{report}", chosen.len());
    }
    if !args.outcomes.is_empty() {
        let outcomes = read_outcomes(&args.outcomes)?;
        print!(
            "{}",
            outcome_report(&set, model.as_ref(), &outcomes, args.data.seed)
        );
        if args.held_out.cross_validate.is_some() {
            let model = model.as_ref().ok_or_else(|| {
                CliError::Invalid("--cross-validate needs a model (not `--model off`)".into())
            })?;
            let (_, report) = held_out_report(&outcomes, model, args.data.seed, &args.held_out);
            print!("\n{report}");
        }
    }
    Ok(())
}

/// Outcome records from files and router streams, in the order given.
fn read_outcomes(paths: &[PathBuf]) -> Result<Vec<OutcomeRecord>, CliError> {
    let mut records = Vec::new();
    for path in paths {
        if let Some((url, prefix)) = path.to_str().and_then(redis_source) {
            let settings = crate::redis_conn::RedisSettings {
                url,
                ..Default::default()
            };
            let client = crate::redis_conn::Redis::open(&settings)
                .map_err(|e| CliError::Invalid(format!("{}: {e}", path.display())))?;
            let key = crate::calibration::outcomes::stream_key(&prefix);
            let read = super::block_on(async {
                crate::calibration::outcomes::read_stream(&client, &key)
                    .await
                    .map_err(CliError::Invalid)
            })?;
            if read.is_empty() {
                return Err(CliError::Invalid(format!(
                    "{}: the stream {key} holds no outcome records",
                    path.display()
                )));
            }
            eprintln!("{} outcome records from the stream {key}", read.len());
            records.extend(read);
            continue;
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::Invalid(format!("reading {}: {e}", path.display())))?;
        records.extend(
            parse_outcomes(&text)
                .map_err(|e| CliError::Invalid(format!("{}: {e}", path.display())))?,
        );
    }
    Ok(records)
}

/// `redis://HOST:PORT[/PREFIX]` (or `rediss://`, `redis+cluster://HOSTS[/PREFIX]`,
/// `redis+sentinel://HOSTS/MASTER[/PREFIX]`) as the Redis URL and the key prefix; the path
/// is the router's key prefix, not a database number.
fn redis_source(source: &str) -> Option<(String, String)> {
    let (scheme, rest) = source.split_once("://")?;
    // A Sentinel URL's path starts with the master's name.
    let server_parts = match scheme {
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => 1,
        "redis+sentinel" | "rediss+sentinel" => 2,
        _ => return None,
    };
    let parts: Vec<&str> = rest.splitn(server_parts + 1, '/').collect();
    let host = parts[..server_parts.min(parts.len())].join("/");
    let prefix = parts.get(server_parts).copied().unwrap_or("");
    let prefix = match prefix.trim_matches('/') {
        "" => "quantrouter",
        prefix => prefix,
    };
    Some((format!("{scheme}://{host}"), prefix.to_owned()))
}

/// RouteLLM's figures for each source of the records and for all of them: the model's
/// ranking (its outcome head, or without one its complexity), then the baselines.
fn outcome_report(
    set: &ProfileSet,
    model: Option<&quantrouter_policy::Classifier>,
    records: &[OutcomeRecord],
    seed: u64,
) -> String {
    use std::fmt::Write as _;
    let weights = &set.policy.complexity;
    let window = weights.scoring_window_chars.max(1);
    let scorer = match model {
        Some(m) if m.outcome().is_some() => "outcome head",
        Some(_) => "complexity (the model has no outcome head)",
        None => "structural complexity",
    };
    let head = model.and_then(|m| Some((m, m.outcome()?)));
    let scores: Vec<f64> = match head {
        // A traffic record has the head's inputs and task class, not the prompt.
        Some((model, head)) => model
            .outcome_examples(records, window)
            .iter()
            .map(|e| head.logit(&e.inputs, e.task_class))
            .collect(),
        None => {
            let all: Vec<&OutcomeRecord> = records.iter().collect();
            complexity_scores(model, &all, weights)
        }
    };
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, r) in records.iter().enumerate() {
        match groups.iter_mut().find(|(s, _)| *s == r.source) {
            Some((_, members)) => members.push(i),
            None => groups.push((r.source.clone(), vec![i])),
        }
    }
    if groups.len() > 1 {
        groups.push(("all".into(), (0..records.len()).collect()));
    }
    let mut out = String::new();
    let _ = writeln!(out, "ranked by: {scorer}");
    for (source, members) in &groups {
        let chosen: Vec<&OutcomeRecord> = members.iter().map(|&i| &records[i]).collect();
        let own: Vec<f64> = members.iter().map(|&i| scores[i]).collect();
        let curve = routing_curve(&own, &chosen);
        let _ = writeln!(
            out,
            "\n{source}: {} prompts, cheap score {:.3}, reference score {:.3} (share right, or grade / 10)",
            curve.prompts, curve.cheap_accuracy, curve.reference_accuracy
        );
        let mut baselines = vec![
            (
                "random",
                routing_curve(&random_scores(&chosen, seed), &chosen),
            ),
            (
                "prompt length",
                routing_curve(&length_scores(&chosen), &chosen),
            ),
        ];
        if let Some((model, _)) = head {
            let complexity = complexity_scores(Some(model), &chosen, weights);
            baselines.push(("complexity", routing_curve(&complexity, &chosen)));
        }
        let _ = writeln!(out, "  {:<14} {curve}", "router");
        for (name, c) in &baselines {
            let _ = writeln!(out, "  {name:<14} {c}");
        }
        let _ = write!(out, "{}", curve_table(&curve));
    }
    out
}

/// The accuracy-vs-reference-share curve, one row per decile threshold.
fn curve_table(curve: &RoutingCurve) -> String {
    use std::fmt::Write as _;
    let gap = curve.reference_accuracy - curve.cheap_accuracy;
    let mut out = String::from("  reference share  accuracy  PGR\n");
    for &(share, accuracy) in &curve.points {
        let pgr = if gap > 0.0 {
            format!("{:.3}", (accuracy - curve.cheap_accuracy) / gap)
        } else {
            "-".into()
        };
        let _ = writeln!(out, "  {:>14.1}%  {:>8.3}  {pgr}", 100.0 * share, accuracy);
    }
    out
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

/// A model file to push: valid, and with an outcome head fit to route by — not constant,
/// and not one its training figures say ranks no better than random.
fn read_model_to_push(path: &Path) -> Result<ClassifierDocument, CliError> {
    let doc = read_model(path)?;
    let refuse = |e: &dyn std::fmt::Display| {
        CliError::Invalid(format!("{}: not pushing it: {e}", path.display()))
    };
    if let Some(degenerate) = doc.weights.outcome.as_ref().and_then(|h| h.degenerate()) {
        return Err(refuse(&degenerate));
    }
    match doc.metrics.outcome_training_apgr {
        Some(apgr) if apgr.is_nan() || apgr <= 0.5 => {
            Err(refuse(&DegenerateHead::WorseThanRandom(apgr)))
        }
        _ => Ok(doc),
    }
}

#[cfg(test)]
mod tests {
    use super::redis_source;

    #[test]
    fn a_redis_source_names_the_server_and_the_key_prefix() {
        assert_eq!(
            redis_source("redis://127.0.0.1:6379"),
            Some(("redis://127.0.0.1:6379".into(), "quantrouter".into()))
        );
        assert_eq!(
            redis_source("rediss://h:1/team:a/"),
            Some(("rediss://h:1".into(), "team:a".into()))
        );
        assert_eq!(
            redis_source("redis+sentinel://s1:26379,s2:26379/mymaster/team"),
            Some((
                "redis+sentinel://s1:26379,s2:26379/mymaster".into(),
                "team".into()
            ))
        );
        assert_eq!(
            redis_source("redis+cluster://n1:7000,n2:7001"),
            Some((
                "redis+cluster://n1:7000,n2:7001".into(),
                "quantrouter".into()
            ))
        );
        assert_eq!(redis_source("outcomes.jsonl"), None);
        assert_eq!(redis_source("http://h/x"), None);
    }
}
