//! Command-line interface: `serve`, `demo`, `route`, `audit`, `profiles`, `classifier`,
//! `tenants`, `profile-tier`.
//!
//! Every `serve` flag can also come from `QUANTROUTER_<FLAG>` and from a JSON config file
//! given with `--config` (keys are the flag names in snake_case or kebab-case, values typed
//! JSON: booleans, numbers, arrays for repeatable flags, strings for the rest).
//! Precedence: command line, environment, config file, built-in default. [`ServeArgs`] is
//! the one typed configuration: clap reads the first two and holds the defaults, serde reads
//! the file into the same struct.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use quantrouter_policy::{
    audit, decide, score, Overrides, ProfileSet, Prompt, Role, RouteRequest, Segment,
};

use crate::profiles;

mod classifier;
pub mod documents;
pub mod error;
pub mod serve;
mod suggest;
mod tenants;

pub(crate) use documents::{block_on, connect_store, document_command, store_error};
pub use documents::{DocumentCommand, RedisArgs};
pub use error::CliError;
use serve::parse_classifier_choice;
pub use serve::{ClassifierChoice, DemoArgs, DiscoveryMode, OptionalListen, ServeArgs};

/// quantrouter: one OpenAI endpoint, the cheapest quantization profile that does the job.
#[derive(Debug, Parser)]
#[command(name = "quantrouter", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the router.
    Serve(Box<ServeArgs>),
    /// Run the router with three simulated vLLM tiers in-process (no cluster, no Redis).
    Demo(DemoArgs),
    /// Explain the routing decision for a prompt against a profile file, offline.
    Route(RouteArgs),
    /// Route a labelled JSONL prompt mix and report where each label lands.
    Audit(AuditArgs),
    /// Validate profile files and manage the profile set in Redis.
    #[command(subcommand)]
    Profiles(ProfilesCommand),
    /// Train, evaluate and publish the prompt classifier.
    #[command(subcommand)]
    Classifier(classifier::ClassifierCommand),
    /// Manage tenants (API keys, limits, budgets) in Redis and read their usage.
    #[command(subcommand)]
    Tenants(tenants::TenantsCommand),
    /// Measure a live OpenAI-compatible endpoint (latency, throughput, accuracy on an eval
    /// set) and print a profile entry; optionally merge it into a file and push it.
    ProfileTier(Box<crate::tier_profile::ProfileTierArgs>),
}

#[derive(Debug, Subcommand)]
pub enum ProfilesCommand {
    /// Check a profile-set file (or a seed-format list) and print every error with its path.
    Validate {
        file: PathBuf,
        /// For seed-format lists: MODEL_ID=URL, once per model.
        #[arg(long = "seed-endpoint")]
        seed_endpoint: Vec<String>,
    },
    /// Show how a file differs from the active set.
    Diff {
        file: PathBuf,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Propose per-class qualities from the agreement the replicas measured against the
    /// calibration reference (`policy.calibration`); prints, never pushes.
    Suggest {
        /// A replica's admin base URL (http://host:9090); repeat for every replica.
        #[arg(long = "from", required = true)]
        from: Vec<String>,
        /// Only profiles and classes with at least this many samples get a suggestion.
        #[arg(long, default_value_t = 30)]
        min_samples: u64,
        /// Print the suggestions as JSON.
        #[arg(long)]
        json: bool,
    },
    #[command(flatten)]
    Stored(DocumentCommand),
}

#[derive(Debug, Args)]
pub struct RouteArgs {
    /// The user prompt to route.
    pub prompt: String,
    /// Profile-set file (default: the embedded set).
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// Classifier: a model file, `builtin` or `off`.
    #[arg(long, default_value = "builtin", value_parser = parse_classifier_choice)]
    pub classifier: ClassifierChoice,
    /// A system prompt sent along.
    #[arg(long)]
    pub system: Option<String>,
    /// The request's max_tokens.
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Ask for JSON output (response_format json_object).
    #[arg(long)]
    pub json_output: bool,
    /// Print the decision as JSON (the `POST /v1/route` shape).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// JSONL file of {"id", "label", "prompt"} lines (optionally "task_class").
    #[arg(long)]
    pub prompts: PathBuf,
    /// Profile-set file (default: the embedded set).
    #[arg(long)]
    pub profiles: Option<PathBuf>,
    /// Classifier: a model file, `builtin` or `off`.
    #[arg(long, default_value = "builtin", value_parser = parse_classifier_choice)]
    pub classifier: ClassifierChoice,
}

/// Parses the process arguments and runs the command.
pub fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let cli = match parse_with_config(argv) {
        Ok(cli) => cli,
        Err(CliError::Invalid(message)) if message.is_empty() => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quantrouter: {e}");
            return ExitCode::from(1);
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quantrouter: {e}");
            ExitCode::from(match e {
                CliError::Invalid(_) => 1,
                CliError::Io(_) => 2,
                CliError::Conflict(_) => 3,
            })
        }
    }
}

/// Parses arguments; for `serve --config FILE`, the file's settings then fill what neither
/// the command line nor the environment set.
pub fn parse_with_config(argv: Vec<OsString>) -> Result<Cli, CliError> {
    let matches = match Cli::command().try_get_matches_from(&argv) {
        Ok(m) => m,
        Err(e) if !e.use_stderr() => {
            // --help / --version: clap prints them.
            let _ = e.print();
            return Err(CliError::Invalid(String::new()));
        }
        Err(e) => return Err(CliError::Invalid(e.render().to_string())),
    };
    let mut cli = Cli::from_arg_matches(&matches).map_err(|e| CliError::Invalid(e.to_string()))?;
    if let (Command::Serve(args), Some(("serve", serve))) = (&mut cli.command, matches.subcommand())
    {
        if let Some(path) = args.config.clone() {
            let text = read_config_file(&path).map_err(|e| {
                CliError::Invalid(format!("reading config {}: {e}", path.display()))
            })?;
            **args = layer_config_file(args, serve, &text)
                .map_err(|e| CliError::Invalid(format!("config {}: {e}", path.display())))?;
        }
    }
    Ok(cli)
}

/// Largest config file read: a file of every setting is a few kilobytes.
const MAX_CONFIG_BYTES: u64 = 1024 * 1024;

/// The `--config` file's text. Only a regular file: reading a FIFO or a device would wait
/// for a writer, or never end, and start-up with it.
fn read_config_file(path: &Path) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(format!(
            "{} bytes, more than a config file's limit of {MAX_CONFIG_BYTES}",
            meta.len()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| e.to_string())
}

/// `args` (flags, environment and defaults, as clap parsed them) with the settings of a
/// config file laid under the flags and the environment: a file value replaces only a
/// default. The settings travel as a JSON object of `ServeArgs`' fields, so serde types
/// every file value and the one struct is the only list of settings.
fn layer_config_file(
    args: &ServeArgs,
    matches: &clap::ArgMatches,
    text: &str,
) -> Result<ServeArgs, String> {
    let file: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(text).map_err(|e| e.to_string())?;
    let serde_json::Value::Object(mut settings) =
        serde_json::to_value(args).map_err(|e| e.to_string())?
    else {
        return Err("the settings are not a JSON object".into());
    };
    let mut numbers = Vec::new();
    for (key, value) in file {
        // Keys as the flags spell them (`admin-listen`) or as the fields do (`admin_listen`).
        let id = key.replace('-', "_");
        if !settings.contains_key(&id) {
            return Err(format!("unknown setting `{key}`"));
        }
        // The file is already chosen; a `config` inside it names nothing more to read.
        if id == "config" {
            continue;
        }
        if matches!(
            matches.value_source(&id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        if value.is_number() {
            numbers.push(format!("--{}={value}", id.replace('_', "-")));
        }
        settings.insert(id, value);
    }
    check_ranges(numbers)?;
    serde_path_to_error::deserialize(serde_json::Value::Object(settings))
        .map_err(|e| format!("`{}`: {}", e.path(), e.inner()))
}

/// File numbers pass the flags' own parsers too: serde checks the integer type, but the
/// ranges some flags allow (`--max-connections` at least 1) live in clap.
fn check_ranges(flags: Vec<String>) -> Result<(), String> {
    if flags.is_empty() {
        return Ok(());
    }
    let argv = ["quantrouter", "serve"]
        .into_iter()
        .map(String::from)
        .chain(flags);
    Cli::command()
        .try_get_matches_from(argv)
        .map(drop)
        .map_err(|e| {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            first.trim_start_matches("error: ").to_owned()
        })
}

/// Runs a parsed command.
pub fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Serve(args) => runtime(args.workers)?.block_on(crate::bootstrap::serve(*args)),
        Command::Demo(args) => runtime(None)?.block_on(crate::bootstrap::demo(args)),
        Command::Route(args) => route(&args),
        Command::Audit(args) => run_audit(&args),
        Command::Profiles(command) => profiles_command(command),
        Command::ProfileTier(args) => crate::tier_profile::run(*args),
        Command::Classifier(command) => classifier::run(command),
        Command::Tenants(command) => tenants::run(command),
    }
}

fn profiles_command(command: ProfilesCommand) -> Result<(), CliError> {
    match command {
        ProfilesCommand::Validate {
            file,
            seed_endpoint,
        } => {
            let set = read_profile_file(&file, &seed_endpoint)?;
            println!(
                "{}: valid, version {}, {} profiles, default {}",
                file.display(),
                set.version,
                set.profiles.len(),
                set.default_profile
            );
            Ok(())
        }
        ProfilesCommand::Diff { file, redis } => {
            // Validate input before touching the network.
            let new = read_profile_file(&file, &[])?;
            block_on(async {
                let store = connect_store::<ProfileSet>(&redis).await?;
                match store.active().await.map_err(store_error)? {
                    None => println!("no active set: every profile would be added"),
                    Some(old) => {
                        let lines = crate::profiles::diff::diff(&old, &new);
                        if lines.is_empty() {
                            println!("no changes (active version {})", old.version);
                        }
                        for line in lines {
                            println!("{line}");
                        }
                    }
                }
                Ok(())
            })
        }
        ProfilesCommand::Suggest {
            from,
            min_samples,
            json,
        } => suggest::run(&from, min_samples, json),
        ProfilesCommand::Stored(command) => {
            document_command(command, |file| read_profile_file(file, &[]))
        }
    }
}

/// A profile-set file, or a seed-format list with `MODEL_ID=URL` endpoints.
pub(crate) fn read_profile_file(
    path: &Path,
    seed_endpoints: &[String],
) -> Result<ProfileSet, CliError> {
    let seed_endpoints = serve::parse_seed_endpoints(seed_endpoints)?;
    profiles::read_set_or_seed_list(path, &seed_endpoints).map_err(CliError::Invalid)
}

/// The one runtime: the public port's requests, the admin and scaler ports and the
/// background work (profile sources, discovery, scraping, KEDA) share its `workers` threads,
/// by default one per CPU the process may use (`available_parallelism` honours a cgroup CPU
/// limit and the affinity mask).
fn runtime(workers: Option<u16>) -> Result<tokio::runtime::Runtime, CliError> {
    let workers = workers.map_or_else(
        || std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        usize::from,
    );
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .map_err(|e| CliError::Io(format!("starting the runtime: {e}")))
}

/// The model a command scores with: none for `off`.
fn offline_classifier(
    choice: &ClassifierChoice,
) -> Result<Option<quantrouter_policy::Classifier>, CliError> {
    let model = match choice {
        ClassifierChoice::Off => return Ok(None),
        ClassifierChoice::Builtin => quantrouter_policy::Classifier::builtin(),
        ClassifierChoice::File(path) => classifier::read_model(path)?.classifier(),
    };
    model
        .map(Some)
        .map_err(|e| CliError::Invalid(e.to_string()))
}

fn load_set(path: Option<&Path>) -> Result<ProfileSet, CliError> {
    profiles::initial_set(path)
        .map(|(set, _)| set)
        .map_err(|e| CliError::Invalid(e.to_string()))
}

fn route(args: &RouteArgs) -> Result<(), CliError> {
    let set = load_set(args.profiles.as_deref())?;
    let mut segments = Vec::new();
    if let Some(system) = &args.system {
        segments.push(Segment {
            role: Role::System,
            text: system,
        });
    }
    segments.push(Segment {
        role: Role::User,
        text: &args.prompt,
    });
    let prompt = Prompt {
        segments,
        wants_json: args.json_output,
    };
    let model = offline_classifier(&args.classifier)?;
    let started = std::time::Instant::now();
    let (features, classification) = score(&prompt, &set.policy.complexity, model.as_ref());
    let request = RouteRequest {
        features: &features,
        max_tokens: args.max_tokens,
        overrides: Overrides::default(),
        routing_key: "cli",
    };
    let decision = decide(&set, &request, &[]).map_err(|e| CliError::Invalid(e.to_string()))?;
    let decision_us = started.elapsed().as_secs_f64() * 1e6;
    let top = model
        .as_ref()
        .map_or_else(Vec::new, |m| crate::routing::top_features(&set, m, &prompt));
    if args.json {
        let classification = classification.as_ref();
        let mut explain = crate::routing::explain(&set, &decision, classification, &top);
        explain["decision_us"] = decision_us.into();
        println!("{explain}");
        return Ok(());
    }
    let chosen = &set.profiles[decision.profile];
    println!(
        "profile {} (tier {}), reason {}\ncomplexity {:.3}, task {:?}, required quality {:.3}\n",
        chosen.id,
        chosen.tier,
        decision.reason.as_str(),
        decision.complexity,
        decision.task_class,
        decision.required_quality
    );
    println!(
        "{:<20} {:>8} {:>8} {:>12} {:>12} {:>9}  rejected because",
        "candidate", "feasible", "quality", "latency_ms", "cost_usd", "utility"
    );
    for c in &decision.candidates {
        println!(
            "{:<20} {:>8} {:>8.3} {:>12.1} {:>12.8} {:>9.4}  {}",
            set.profiles[c.profile].id,
            c.feasible,
            c.quality,
            c.predicted_latency_ms,
            c.cost,
            c.utility,
            c.rejected_because.map_or("", |r| r.as_str())
        );
    }
    if let Some(c) = &classification {
        let classes: Vec<String> = quantrouter_policy::classifier::TASK_CLASSES
            .iter()
            .zip(c.class_probabilities)
            .map(|(class, p)| format!("{} {:.2}", class.as_str(), p))
            .collect();
        let [heavy, medium, light] = c.difficulty_probabilities;
        println!("\nclassifier: {}", classes.join(", "));
        println!("difficulty: heavy {heavy:.2}, medium {medium:.2}, light {light:.2}");
        println!(
            "\n{:<28} {:>10} {:>11}",
            "top feature", "difficulty", "task class"
        );
        for f in &top {
            println!(
                "{:<28} {:>+10.3} {:>+11.3}",
                f.feature, f.difficulty, f.task_class
            );
        }
    }
    Ok(())
}

fn run_audit(args: &AuditArgs) -> Result<(), CliError> {
    let set = load_set(args.profiles.as_deref())?;
    let text = std::fs::read_to_string(&args.prompts)
        .map_err(|e| CliError::Invalid(format!("reading {}: {e}", args.prompts.display())))?;
    let model = offline_classifier(&args.classifier)?;
    let report =
        audit(&set, model.as_ref(), &text).map_err(|e| CliError::Invalid(e.to_string()))?;
    print!("{report}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::serve::replica_id;
    use super::*;
    use crate::bootstrap::read_api_keys;
    use crate::telemetry::LogFormat;

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("quantrouter")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect()
    }

    fn serve_args(cli: Cli) -> ServeArgs {
        match cli.command {
            Command::Serve(args) => *args,
            other => panic!("expected serve, got {other:?}"),
        }
    }

    /// `serve --config <a file holding json> flags...`, parsed.
    fn parse_with_config_file(json: &str, flags: &[&str]) -> Result<Cli, CliError> {
        let dir = tempfile::Builder::new()
            .prefix("qr-cli-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, json).unwrap();
        let mut args = vec!["serve", "--config", path.to_str().unwrap()];
        args.extend_from_slice(flags);
        parse_with_config(argv(&args))
    }

    #[test]
    fn config_file_fills_unset_flags_and_the_command_line_wins() {
        let cli = parse_with_config_file(
            r#"{"listen": "127.0.0.1:18080", "admin-listen": "127.0.0.1:19090",
                "model_alias": ["gpt-4o", "smart"], "header_timeout_ms": 1234}"#,
            &["--listen", "127.0.0.1:28080"],
        )
        .unwrap();
        let args = serve_args(cli);
        assert_eq!(args.listen, "127.0.0.1:28080".parse().unwrap());
        assert_eq!(args.admin_listen, "127.0.0.1:19090".parse().unwrap());
        assert_eq!(args.model_alias, vec!["gpt-4o", "smart"]);
        assert_eq!(args.header_timeout_ms, 1234);
        assert_eq!(args.log_format, LogFormat::Json);
        assert_eq!(args.discovery, DiscoveryMode::Dns);
    }

    #[test]
    fn discovery_mode_comes_from_the_flag_or_the_config_file() {
        let args =
            serve_args(parse_with_config(argv(&["serve", "--discovery", "kubernetes"])).unwrap());
        assert_eq!(args.discovery, DiscoveryMode::Kubernetes);
        let cli = parse_with_config_file(r#"{"discovery": "kubernetes"}"#, &[]).unwrap();
        assert_eq!(serve_args(cli).discovery, DiscoveryMode::Kubernetes);
        assert!(parse_with_config(argv(&["serve", "--discovery", "consul"])).is_err());
    }

    #[test]
    fn the_keda_scaler_listens_on_9091_unless_switched_off() {
        let args = serve_args(parse_with_config(argv(&["serve"])).unwrap());
        assert_eq!(
            args.keda_scaler_listen,
            OptionalListen(Some("0.0.0.0:9091".parse().unwrap()))
        );
        for off in ["off", ""] {
            let cli = parse_with_config(argv(&["serve", "--keda-scaler-listen", off])).unwrap();
            assert_eq!(serve_args(cli).keda_scaler_listen, OptionalListen(None));
        }
        let cli = parse_with_config(argv(&["serve", "--keda-scaler-listen", "127.0.0.1:7"]));
        assert_eq!(
            serve_args(cli.unwrap()).keda_scaler_listen,
            OptionalListen(Some("127.0.0.1:7".parse().unwrap()))
        );
        assert!(parse_with_config(argv(&["serve", "--keda-scaler-listen", "nope"])).is_err());
    }

    #[test]
    fn the_endpoint_picker_is_off_unless_given_an_address() {
        let args = serve_args(parse_with_config(argv(&["serve"])).unwrap());
        assert_eq!(args.epp_listen, OptionalListen(None));
        let cli = parse_with_config(argv(&["serve", "--epp-listen", "127.0.0.1:9002"]));
        assert_eq!(
            serve_args(cli.unwrap()).epp_listen,
            OptionalListen(Some("127.0.0.1:9002".parse().unwrap()))
        );
        assert!(parse_with_config(argv(&["serve", "--epp-listen", "nope"])).is_err());
    }

    #[test]
    fn workers_are_one_per_cpu_unless_set_and_never_zero() {
        let args = serve_args(parse_with_config(argv(&["serve"])).unwrap());
        assert_eq!(args.workers, None);
        let args = serve_args(parse_with_config(argv(&["serve", "--workers", "3"])).unwrap());
        assert_eq!(args.workers, Some(3));
        assert!(parse_with_config(argv(&["serve", "--workers", "0"])).is_err());
    }

    #[test]
    fn the_replica_id_is_the_flag_else_the_host_name_else_random() {
        let host = || Some("router-7f9c-abcde".to_owned());
        assert_eq!(replica_id(Some("pod-a".into()), host()), "pod-a");
        assert_eq!(replica_id(None, host()), "router-7f9c-abcde");
        let random = replica_id(None, Some(" ".into()));
        assert!(random.starts_with("qr-"), "{random}");
        assert_ne!(random, replica_id(None, None));
    }

    #[test]
    fn unknown_config_setting_is_an_error_naming_the_file_and_key() {
        let err = parse_with_config_file(r#"{"lisen": "127.0.0.1:1"}"#, &[]).unwrap_err();
        let err = err.to_string();
        assert!(err.contains("unknown setting `lisen`"), "{err}");
        assert!(err.contains("config.json"), "{err}");
    }

    #[test]
    fn a_config_file_with_every_flag_type_parses_as_the_flags_do() {
        let file = serve_args(
            parse_with_config_file(
                r#"{
                    "listen": "127.0.0.1:18080",
                    "admin-listen": "[::1]:19090",
                    "keda_scaler_listen": "off",
                    "log_prompts": true,
                    "header_timeout_ms": 1234,
                    "body_limit_bytes": 65536,
                    "max_attempts": 2,
                    "max_connections": 300,
                    "model_alias": ["gpt-4o", "smart"],
                    "seed_endpoint": ["m=http://a:8000", "n=http://b:8000"],
                    "redis_url": "redis+sentinel://s1:26379,s2:26379/mymaster",
                    "redis_sentinel_password": "sentinel-secret",
                    "profiles": "/etc/quantrouter/profiles.json",
                    "classifier": "off",
                    "discovery": "kubernetes",
                    "log_format": "text"
                }"#,
                &[],
            )
            .unwrap(),
        );
        let flags = serve_args(
            parse_with_config(argv(&[
                "serve",
                "--listen=127.0.0.1:18080",
                "--admin-listen=[::1]:19090",
                "--keda-scaler-listen=off",
                "--log-prompts",
                "--header-timeout-ms=1234",
                "--body-limit-bytes=65536",
                "--max-attempts=2",
                "--max-connections=300",
                "--model-alias=gpt-4o",
                "--model-alias=smart",
                "--seed-endpoint=m=http://a:8000",
                "--seed-endpoint=n=http://b:8000",
                "--redis-url=redis+sentinel://s1:26379,s2:26379/mymaster",
                "--redis-sentinel-password=sentinel-secret",
                "--profiles=/etc/quantrouter/profiles.json",
                "--classifier=off",
                "--discovery=kubernetes",
                "--log-format=text",
            ]))
            .unwrap(),
        );
        assert!(file.config.is_some());
        assert_eq!(
            ServeArgs {
                config: None,
                ..file
            },
            flags
        );
    }

    #[test]
    fn a_json_boolean_in_the_config_file_sets_a_switch() {
        let on = serve_args(parse_with_config_file(r#"{"log_prompts": true}"#, &[]).unwrap());
        assert!(on.log_prompts);
        let off = serve_args(parse_with_config_file(r#"{"log-prompts": false}"#, &[]).unwrap());
        assert!(!off.log_prompts);
        // The flag wins over the file.
        let cli = parse_with_config_file(r#"{"log_prompts": false}"#, &["--log-prompts"]);
        assert!(serve_args(cli.unwrap()).log_prompts);
    }

    #[test]
    fn a_config_value_the_flag_would_reject_is_an_error_naming_the_key() {
        for (json, key) in [
            (r#"{"listen": 8080}"#, "listen"),
            (r#"{"log_prompts": "yes"}"#, "log_prompts"),
            (r#"{"model_alias": "smart"}"#, "model_alias"),
            (r#"{"discovery": "consul"}"#, "discovery"),
            (r#"{"max_connections": 0}"#, "max-connections"),
            (r#"{"header_timeout_ms": -1}"#, "header-timeout-ms"),
        ] {
            let err = parse_with_config_file(json, &[]).unwrap_err().to_string();
            assert!(err.contains(key), "{json}: {err}");
            assert!(err.contains("config.json"), "{json}: {err}");
        }
    }

    #[test]
    fn api_keys_file_skips_comments_and_rejects_empty_files() {
        let dir = tempfile::Builder::new()
            .prefix("qr-keys-")
            .tempdir()
            .unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "# team a\nkey-1\n\n  key-2  \n").unwrap();
        let keys = read_api_keys(&path).unwrap();
        assert_eq!(
            keys,
            HashSet::from(["key-1".to_owned(), "key-2".to_owned()])
        );
        std::fs::write(&path, "# nothing\n").unwrap();
        assert!(read_api_keys(&path).is_err());
    }
}
