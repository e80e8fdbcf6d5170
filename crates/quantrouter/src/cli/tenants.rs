//! `quantrouter tenants push|get|diff|history|rollback|usage|hash-key`.
//!
//! `push` reads the push format: besides `key_sha256`, a tenant may list plain `keys`, which
//! are hashed and dropped before anything is sent, so a key never reaches Redis. No command
//! prints a key.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use clap::Subcommand;
use quantrouter_policy::{hash_key, is_valid_api_key, TenantDocument};

use super::{
    block_on, connect_store, document_command, store_error, CliError, DocumentCommand, RedisArgs,
};
use crate::tenants::limiter::{unix_ms, CounterSource};
use crate::tenants::{usage, TenantSnapshot, TenantSource};

/// Reading counters never waits longer than this (the document store's bound).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Debug, Subcommand)]
pub enum TenantsCommand {
    /// Show how a file differs from the active document (keys as hash prefixes).
    Diff {
        file: PathBuf,
        #[command(flatten)]
        redis: RedisArgs,
    },
    /// Every tenant's limits and usage in the current windows, from the shared counters.
    Usage {
        #[command(flatten)]
        redis: RedisArgs,
        /// Print the `/admin/tenants` JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Read API keys from standard input, one per line, and print the SHA-256 of each as
    /// `key_sha256` holds it.
    HashKey,
    #[command(flatten)]
    Stored(DocumentCommand),
}

/// Runs a tenants command.
pub fn run(command: TenantsCommand) -> Result<(), CliError> {
    match command {
        TenantsCommand::Diff { file, redis } => {
            // Validate input before touching the network.
            let new = read_push_file(&file)?;
            block_on(async {
                let store = connect_store::<TenantDocument>(&redis).await?;
                match store.active().await.map_err(store_error)? {
                    None => println!("no active document: every tenant would be added"),
                    Some(old) => {
                        let lines = crate::tenants::diff::diff(&old, &new);
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
        TenantsCommand::Usage { redis, json } => block_on(print_usage(&redis, json)),
        TenantsCommand::HashKey => hash_keys(),
        TenantsCommand::Stored(command) => document_command(command, read_push_file),
    }
}

/// A tenant file in the push format, validated, its plain keys hashed.
fn read_push_file(path: &Path) -> Result<TenantDocument, CliError> {
    let text = crate::documents::read_file(path)
        .map_err(|e| CliError::Invalid(format!("reading {}: {e}", path.display())))?;
    TenantDocument::from_push_json(&text)
        .map_err(|e| CliError::Invalid(format!("{}:\n{e}", path.display())))
}

async fn print_usage(redis: &RedisArgs, json: bool) -> Result<(), CliError> {
    let store = connect_store::<TenantDocument>(redis).await?;
    let Some(doc) = store.active().await.map_err(store_error)? else {
        return Err(CliError::Invalid(format!(
            "no tenant document at {}",
            store.keys().active
        )));
    };
    let snapshot = TenantSnapshot::build(
        Some(&doc),
        None,
        TenantSource::Redis,
        crate::tenants::labels::DEFAULT_TOP,
    );
    let client = redis.open()?;
    let now_ms = unix_ms(SystemTime::now());
    let ids: Vec<&str> = snapshot.tenants.iter().map(|t| &*t.id).collect();
    let read = async {
        let mut conn = client.connect().await?;
        usage::read_counters(&mut conn, &redis.redis_prefix, &ids, now_ms).await
    };
    let counters = match tokio::time::timeout(CALL_TIMEOUT, read).await {
        Ok(Ok(counters)) => counters,
        Ok(Err(e)) => return Err(CliError::Io(format!("redis: {e}"))),
        Err(_) => {
            return Err(CliError::Io(format!(
                "redis did not answer within {CALL_TIMEOUT:?}"
            )))
        }
    };
    let report = usage::report(&snapshot, &counters, CounterSource::Redis, now_ms);
    if json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| CliError::Io(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", usage::table(&report));
    }
    Ok(())
}

/// One key per line on standard input (line ends removed, nothing else): one hash per line.
fn hash_keys() -> Result<(), CliError> {
    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .map_err(|e| CliError::Io(format!("reading standard input: {e}")))?;
    let text = String::from_utf8(input)
        .map_err(|_| CliError::Invalid("a key must be visible ASCII characters".into()))?;
    let lines: Vec<&str> = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .collect();
    // A final line end does not start another key.
    let lines = match lines.split_last() {
        Some((&"", rest)) => rest,
        _ => &lines[..],
    };
    if lines.is_empty() {
        return Err(CliError::Invalid(
            "no key on standard input (one per line)".into(),
        ));
    }
    let mut hashes = Vec::with_capacity(lines.len());
    for (n, key) in lines.iter().enumerate() {
        if !is_valid_api_key(key) {
            return Err(CliError::Invalid(format!(
                "key on line {} is not 1 to 256 visible ASCII characters (no spaces)",
                n + 1
            )));
        }
        hashes.push(hash_key(key));
    }
    for hash in hashes {
        println!("{hash}");
    }
    Ok(())
}
