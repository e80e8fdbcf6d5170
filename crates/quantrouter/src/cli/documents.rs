//! Operators' commands on a kind of versioned document in Redis (`push`, `get`, `history`,
//! `rollback`), shared by `profiles`, `classifier`, `tenants` and `profile-tier`, and the
//! Redis flags and exit codes they share.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

use super::error::CliError;
use crate::documents::{Document, RedisStore, StoreError};
use crate::redis_conn::{check_prefix, Redis, RedisSettings};

/// Where the documents live in Redis.
#[derive(Debug, Clone, Args)]
pub struct RedisArgs {
    /// `redis://[user:password@]host:port[/db]`,
    /// `redis+sentinel://[user:password@]host:port[,host:port...]/MASTER[/db]` or
    /// `redis+cluster://[user:password@]host:port[,host:port...]`; `rediss…` for TLS.
    #[arg(long, env = "QUANTROUTER_REDIS_URL")]
    pub redis_url: String,
    /// Key prefix.
    #[arg(long, env = "QUANTROUTER_REDIS_PREFIX", default_value = "quantrouter")]
    pub redis_prefix: String,
    /// PEM CA certificate to verify a TLS (`rediss…`) Redis with (default: system roots).
    #[arg(long, env = "QUANTROUTER_REDIS_CA_FILE")]
    pub redis_ca_file: Option<PathBuf>,
    /// The sentinels' own password (`requirepass` of a Sentinel set); the URL's password
    /// is the master's.
    #[arg(
        long,
        env = "QUANTROUTER_REDIS_SENTINEL_PASSWORD",
        hide_env_values = true
    )]
    pub redis_sentinel_password: Option<String>,
}

// === impl RedisArgs ===

impl RedisArgs {
    /// The Redis these flags name: exit 1 for a bad URL or prefix (nothing connects yet).
    pub fn open(&self) -> Result<Redis, CliError> {
        open_redis(
            &self.redis_url,
            &self.redis_prefix,
            self.redis_ca_file.clone(),
            self.redis_sentinel_password.clone(),
        )
    }
}

/// The Redis of `--redis-url` and its companion flags, checked (nothing connects yet).
pub(crate) fn open_redis(
    url: &str,
    prefix: &str,
    ca_file: Option<PathBuf>,
    sentinel_password: Option<String>,
) -> Result<Redis, CliError> {
    check_prefix(prefix).map_err(CliError::Invalid)?;
    let settings = RedisSettings {
        url: url.to_owned(),
        ca_file,
        sentinel_password,
    };
    Redis::open(&settings).map_err(|e| CliError::Invalid(e.to_string()))
}

/// What operators do with a kind of versioned document in Redis.
#[derive(Debug, Subcommand)]
pub enum DocumentCommand {
    /// Validate a file and make it the active document (version = active + 1), atomically.
    Push {
        file: PathBuf,
        /// Only push if the active version is still this one (for pipelines that diffed
        /// against it); otherwise exit 3 and write nothing.
        #[arg(long)]
        expect_version: Option<u64>,
        /// Largest document pushed, in bytes (the routers' own limit should be as large).
        #[arg(
            long,
            env = "QUANTROUTER_MAX_DOCUMENT_BYTES",
            default_value_t = crate::documents::DEFAULT_MAX_BYTES,
            value_parser = clap::value_parser!(u64).range(1..)
        )]
        max_document_bytes: u64,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Print the active document.
    Get {
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// List previous versions, newest first.
    History {
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Re-publish a previous version (default: the newest in history) as a new version.
    Rollback {
        #[arg(long)]
        to: Option<u64>,
        #[command(flatten)]
        redis: RedisArgs,
    },
}

/// Runs `push`, `get`, `history` or `rollback` on documents of kind `D`; `read` reads and
/// validates a file to push.
pub(crate) fn document_command<D: Document>(
    command: DocumentCommand,
    read: impl FnOnce(&Path) -> Result<D, CliError>,
) -> Result<(), CliError> {
    let (redis, operation) = match command {
        DocumentCommand::Push {
            file,
            expect_version,
            max_document_bytes,
            redis,
        } => {
            crate::documents::set_max_bytes(max_document_bytes);
            (redis, StoreCommand::Push(read(&file)?, expect_version))
        }
        DocumentCommand::Get { redis } => (redis, StoreCommand::Get),
        DocumentCommand::History { redis } => (redis, StoreCommand::History),
        DocumentCommand::Rollback { to, redis } => (redis, StoreCommand::Rollback(to)),
    };
    block_on(run_store_command(&redis, operation))
}

/// What an operator does with a kind of document in Redis.
pub(crate) enum StoreCommand<D> {
    /// Push a validated document, optionally only over the given active version.
    Push(D, Option<u64>),
    Get,
    History,
    Rollback(Option<u64>),
}

/// Runs a command's Redis work on a small runtime of its own.
pub(crate) fn block_on<T>(
    work: impl std::future::Future<Output = Result<T, CliError>>,
) -> Result<T, CliError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Io(e.to_string()))?
        .block_on(work)
}

async fn run_store_command<D: Document>(
    redis: &RedisArgs,
    command: StoreCommand<D>,
) -> Result<(), CliError> {
    let store = connect_store::<D>(redis).await?;
    match command {
        StoreCommand::Push(mut doc, expect_version) => {
            let version = match expect_version {
                None => store.push(doc).await,
                Some(expected) => {
                    let too_large = || {
                        CliError::Invalid(format!(
                            "--expect-version {expected}: versions are at most {}",
                            quantrouter_policy::MAX_VERSION
                        ))
                    };
                    let expected = i64::try_from(expected).map_err(|_| too_large())?;
                    doc.set_version((expected as u64).saturating_add(1));
                    store.push_expecting(&doc, expected).await
                }
            }
            .map_err(store_error)?;
            println!("pushed version {version}");
        }
        StoreCommand::Get => match store.active_raw().await.map_err(store_error)? {
            Some(text) => println!("{text}"),
            None => {
                return Err(CliError::Invalid(format!(
                    "nothing at {}",
                    store.keys().active
                )))
            }
        },
        StoreCommand::History => {
            for entry in store.history().await.map_err(store_error)? {
                println!(
                    "version {:>5}  {:<25} {}",
                    entry.version,
                    entry.updated_at.as_deref().unwrap_or("-"),
                    entry.summary
                );
            }
        }
        StoreCommand::Rollback(to) => {
            let version = store.rollback(to).await.map_err(store_error)?;
            println!("rolled back: published as version {version}");
        }
    }
    Ok(())
}

/// Connects to one kind of document in Redis: exit 1 for a bad URL, 2 when unreachable.
pub(crate) async fn connect_store<D: Document>(
    redis: &RedisArgs,
) -> Result<RedisStore<D>, CliError> {
    RedisStore::connect(&redis.open()?, &redis.redis_prefix)
        .await
        .map_err(store_error)
}

/// A Redis store error as the CLI's exit code: 3 conflict, 2 unreachable, 1 bad data.
pub(crate) fn store_error(e: StoreError) -> CliError {
    match e {
        StoreError::Conflict { .. } => CliError::Conflict(e.to_string()),
        StoreError::Redis(_) | StoreError::Timeout(_) | StoreError::Unconfirmed(_) => {
            CliError::Io(e.to_string())
        }
        StoreError::Invalid(_)
        | StoreError::NotADocument { .. }
        | StoreError::TooLarge { .. }
        | StoreError::NotInHistory(_)
        | StoreError::EmptyHistory => CliError::Invalid(e.to_string()),
    }
}
