//! Outcome records of the router's own traffic (`policy.calibration.outcomes`): each finished
//! comparison of a sampled answer with the reference's, as the outcome head's inputs, to a
//! Redis stream `<prefix>:outcomes` and/or a JSON-lines file. `classifier train --outcomes`
//! reads both back ([`read_stream`]).
//!
//! Writes happen in the comparison's own task, after the client had its answer; at most
//! [`MAX_IN_FLIGHT`] at once (more are dropped and counted), each within [`WRITE_TIMEOUT`],
//! never retried: a lost record costs a sliver of training data, a backlog would cost memory.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use quantrouter_policy::classifier::{outcome_from_value, OutcomeRecord, TrafficOutcome};
use quantrouter_policy::OutcomeSink;
use redis::aio::MultiplexedConnection;
use tokio::sync::Semaphore;

use crate::telemetry;

/// Writes in flight at once, per replica.
pub const MAX_IN_FLIGHT: usize = 64;
/// The longest one write may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// Entries read per `XRANGE` call.
const PAGE: usize = 1000;

/// Where this replica's outcome records go.
#[derive(Debug)]
pub struct OutcomeLog {
    redis: Option<Shared>,
    /// Whether records carry the prompt's text (`serve --log-prompts`).
    log_prompts: bool,
    in_flight: Arc<Semaphore>,
    /// Lines in the current file, and which file (a new path starts a new count).
    file: std::sync::Mutex<(Option<PathBuf>, u64)>,
}

#[derive(Debug)]
struct Shared {
    client: redis::Client,
    key: String,
    conn: tokio::sync::Mutex<Option<MultiplexedConnection>>,
}

/// The stream's key for a key prefix.
pub fn stream_key(prefix: &str) -> String {
    format!("{prefix}:outcomes")
}

impl Default for OutcomeLog {
    fn default() -> Self {
        Self::new(None, false)
    }
}

impl OutcomeLog {
    /// A log to the router's Redis (client and key prefix), if it has one.
    pub fn new(redis: Option<(redis::Client, String)>, log_prompts: bool) -> Self {
        Self {
            redis: redis.map(|(client, prefix)| Shared {
                client,
                key: stream_key(&prefix),
                conn: tokio::sync::Mutex::new(None),
            }),
            log_prompts,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            file: std::sync::Mutex::new((None, 0)),
        }
    }

    /// Whether records may carry the prompt's text.
    pub fn log_prompts(&self) -> bool {
        self.log_prompts
    }

    /// Writes one record where `sink` says; errors are counted and logged, not returned.
    pub async fn write(&self, sink: &OutcomeSink, record: &TrafficOutcome) {
        let Ok(_permit) = self.in_flight.clone().try_acquire_owned() else {
            if sink.redis {
                telemetry::outcome_record("redis", "dropped");
            }
            if sink.file.is_some() {
                telemetry::outcome_record("file", "dropped");
            }
            return;
        };
        if sink.redis {
            let result = match &self.redis {
                Some(shared) => {
                    match tokio::time::timeout(WRITE_TIMEOUT, shared.append(sink, record)).await {
                        Ok(Ok(())) => Ok(()),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err(format!("no answer within {WRITE_TIMEOUT:?}")),
                    }
                }
                None => Err("the router has no Redis (--redis-url)".into()),
            };
            match result {
                Ok(()) => telemetry::outcome_record("redis", "written"),
                Err(error) => {
                    // Without Redis every record fails alike: the metric says so, the log
                    // would only repeat it.
                    match &self.redis {
                        Some(shared) => {
                            *shared.conn.lock().await = None;
                            tracing::warn!(%error, "outcome record not written to Redis");
                        }
                        None => tracing::debug!(%error, "outcome record not written to Redis"),
                    }
                    telemetry::outcome_record("redis", "error");
                }
            }
        }
        if let Some(path) = &sink.file {
            let line = serde_json::to_string(record).unwrap_or_default();
            match self.append_line(Path::new(path), &line, sink.max_len) {
                Ok(()) => telemetry::outcome_record("file", "written"),
                Err(error) => {
                    tracing::warn!(%error, path, "outcome record not written to the file");
                    telemetry::outcome_record("file", "error");
                }
            }
        }
    }

    /// Appends a line; past `max_len` lines the file becomes `FILE.1` (replacing the last
    /// one) and a new file starts, so a replica keeps at most twice `max_len` records.
    fn append_line(&self, path: &Path, line: &str, max_len: u64) -> std::io::Result<()> {
        let mut state = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if state.0.as_deref() != Some(path) {
            let existing = std::fs::read(path).map_or(0, |b| bytecount(&b));
            *state = (Some(path.to_owned()), existing);
        }
        if state.1 >= max_len {
            let mut rotated = path.as_os_str().to_owned();
            rotated.push(".1");
            std::fs::rename(path, rotated)?;
            state.1 = 0;
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        file.write_all(format!("{line}\n").as_bytes())?;
        state.1 += 1;
        Ok(())
    }
}

fn bytecount(bytes: &[u8]) -> u64 {
    bytes.iter().filter(|&&b| b == b'\n').count() as u64
}

// === impl Shared ===

impl Shared {
    async fn append(&self, sink: &OutcomeSink, record: &TrafficOutcome) -> redis::RedisResult<()> {
        let mut conn = self.connection().await?;
        let features = serde_json::to_string(&record.features).unwrap_or_default();
        let mut xadd = redis::cmd("XADD");
        xadd.arg(&self.key)
            .arg("MAXLEN")
            .arg("~")
            .arg(sink.max_len)
            .arg("*")
            .arg("features")
            .arg(features)
            .arg("inputs")
            .arg(record.inputs)
            .arg("task_class")
            .arg(record.task_class.as_str())
            .arg("cheap_profile")
            .arg(&record.cheap_profile)
            .arg("reference_profile")
            .arg(&record.reference_profile)
            .arg("agreed")
            .arg(if record.agreed { "true" } else { "false" });
        if let Some(prompt) = &record.prompt {
            xadd.arg("prompt").arg(prompt);
        }
        redis::pipe()
            .add_command(xadd)
            .ignore()
            .cmd("EXPIRE")
            .arg(&self.key)
            .arg(sink.ttl_s)
            .ignore()
            .query_async::<()>(&mut conn)
            .await
    }

    async fn connection(&self) -> redis::RedisResult<MultiplexedConnection> {
        let mut conn = self.conn.lock().await;
        if let Some(conn) = conn.as_ref() {
            return Ok(conn.clone());
        }
        let opened = self.client.get_multiplexed_async_connection().await?;
        *conn = Some(opened.clone());
        Ok(opened)
    }
}

/// Every record of the stream `key`, oldest first. An entry that is not a valid record
/// (another router version's features, a field missing) fails the whole read, naming it.
pub async fn read_stream(client: &redis::Client, key: &str) -> Result<Vec<OutcomeRecord>, String> {
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("connecting to Redis: {e}"))?;
    let mut out = Vec::new();
    let mut start = "-".to_owned();
    loop {
        let page: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(key)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(PAGE)
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("reading the stream {key}: {e}"))?;
        let Some((last, _)) = page.last() else {
            break;
        };
        start = format!("({last}");
        let full = page.len() == PAGE;
        for (id, fields) in page {
            let record = outcome_from_value(entry_json(&fields), &id)
                .map_err(|e| format!("{key} entry {id}: {e}"))?;
            out.push(record);
        }
        if !full {
            break;
        }
    }
    Ok(out)
}

/// A stream entry's fields as the JSON of a record line.
fn entry_json(fields: &[(String, String)]) -> serde_json::Value {
    let mut object = serde_json::Map::new();
    for (name, value) in fields {
        let value = match name.as_str() {
            "features" | "inputs" | "agreed" => serde_json::from_str(value)
                .unwrap_or_else(|_| serde_json::Value::String(value.clone())),
            _ => serde_json::Value::String(value.clone()),
        };
        object.insert(name.clone(), value);
    }
    serde_json::Value::Object(object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quantrouter_policy::classifier::OutcomeInputs;
    use quantrouter_policy::TaskClass;

    fn record(agreed: bool) -> TrafficOutcome {
        let inputs = OutcomeInputs::of_text("Ann has 3 apples and buys 4 more. How many?", 4096);
        TrafficOutcome {
            features: inputs.named(),
            inputs: quantrouter_policy::classifier::OUTCOME_INPUTS,
            task_class: TaskClass::Math,
            cheap_profile: "cheap".into(),
            reference_profile: "reference".into(),
            agreed,
            prompt: None,
        }
    }

    #[test]
    fn a_stream_entry_reads_back_as_the_record_it_was() {
        let r = record(false);
        let fields = vec![
            (
                "features".into(),
                serde_json::to_string(&r.features).unwrap(),
            ),
            ("inputs".into(), r.inputs.to_string()),
            ("task_class".into(), "math".into()),
            ("cheap_profile".into(), "cheap".into()),
            ("reference_profile".into(), "reference".into()),
            ("agreed".into(), "false".into()),
        ];
        let back = outcome_from_value(entry_json(&fields), "1-0").unwrap();
        assert_eq!(back.id, "1-0");
        assert_eq!(back.source, "traffic");
        assert_eq!(back.category, "math");
        assert_eq!(back.task_class, Some(TaskClass::Math));
        assert_eq!(back.verdicts.scores(), (0.0, 1.0));
        let inputs = OutcomeInputs::of_text("Ann has 3 apples and buys 4 more. How many?", 4096);
        assert_eq!(back.inputs, Some(inputs));
        assert!(back.prompt.is_empty());
    }

    #[test]
    fn the_file_moves_aside_past_its_length() {
        let dir = std::env::temp_dir().join(format!("qr-outcomes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("outcomes.jsonl");
        let _ = std::fs::remove_file(&path);
        let log = OutcomeLog::default();
        for i in 0..5 {
            log.append_line(&path, &format!("{{\"n\": {i}}}"), 3)
                .unwrap();
        }
        let current = std::fs::read_to_string(&path).unwrap();
        let rotated = std::fs::read_to_string(dir.join("outcomes.jsonl.1")).unwrap();
        assert_eq!(rotated.lines().count(), 3);
        assert_eq!(current.lines().count(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
