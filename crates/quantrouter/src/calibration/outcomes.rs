//! Outcome records of the router's own traffic (`policy.calibration.outcomes`): each finished
//! comparison of a sampled answer with the reference's, as the outcome head's inputs, to a
//! Redis stream `<prefix>:outcomes` and/or a JSON-lines file. `classifier train --outcomes`
//! reads both back ([`read_stream`]).
//!
//! Writes happen in the comparison's own task, after the client had its answer; at most
//! [`MAX_IN_FLIGHT`] at once (more are dropped and counted), each within [`WRITE_TIMEOUT`],
//! never retried: a lost record costs a sliver of training data, a backlog would cost memory.
//! A record is at most [`MAX_RECORD_BYTES`] (a logged prompt is cut to fit), so `max_len`
//! bounds the stream and the file in bytes too.
//!
//! The file's path comes from the profile set, which anyone who can write to Redis can push:
//! the router appends only to a file that holds nothing but its own records, and moves aside
//! or replaces only such files ([`FileLog`]).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead as _, BufReader, ErrorKind, Read as _, Write as _};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quantrouter_policy::classifier::{outcome_from_value, OutcomeRecord, TrafficOutcome};
use quantrouter_policy::{OutcomeSink, TaskClass};
use serde::Deserialize;
use tokio::sync::{watch, Semaphore};

use super::Calibrator;
use crate::profiles::ProfileStore;
use crate::redis_conn::{Conn, Link, Redis};
use crate::telemetry;

/// Writes in flight at once, per replica.
pub const MAX_IN_FLIGHT: usize = 64;
/// The longest one write may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest record, as its JSON line; a stream entry's field names and values add up to
/// less. Room for the features and a logged prompt's whole window (`OUTCOME_WINDOW`), unless
/// the prompt is mostly characters JSON escapes (docs/routing.md has the figures).
pub const MAX_RECORD_BYTES: usize = 4096;
/// The longest line read when checking a file: far above any record a router ever wrote,
/// including those of routers that logged whole prompts.
const MAX_CHECKED_LINE: u64 = 16 * 1024 * 1024;
/// Entries read per `XRANGE` call.
const PAGE: usize = 1000;

/// Where this replica's outcome records go.
#[derive(Debug)]
pub struct OutcomeLog {
    redis: Option<Shared>,
    /// Whether records carry the prompt's text (`serve --log-prompts`).
    log_prompts: bool,
    in_flight: Arc<Semaphore>,
    /// The file the active policy names, as far as it has been checked.
    file: Arc<Mutex<Option<FileLog>>>,
}

#[derive(Debug)]
struct Shared {
    link: Link,
    key: String,
}

/// One outcome file and `FILE.1` beside it, as this replica last checked them. A file is
/// written, moved to `FILE.1` or replaced by one only when every line of it is a record as
/// the router writes it; a file the router creates is its own (mode 0600: records may hold
/// prompts). Anything else at either path is refused, logged once, and left untouched.
#[derive(Debug)]
struct FileLog {
    path: PathBuf,
    current: Option<Checked>,
    rotated: Option<Checked>,
}

/// What a check found in one file: its records, or why the router may not touch it.
#[derive(Debug, Clone)]
struct Checked {
    id: FileId,
    verdict: Result<u64, String>,
}

/// A file's device and inode: a path that names another file is checked again.
type FileId = (u64, u64);

/// Why a record did not reach the file.
#[derive(Debug, thiserror::Error)]
enum FileError {
    /// Something other than the router's records is there (logged when it was found).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A line as routers write it ([`TrafficOutcome`]), with any version's feature list.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // Deserialized to check a line's shape; never read.
struct WrittenRecord {
    features: BTreeMap<String, f64>,
    inputs: usize,
    task_class: TaskClass,
    cheap_profile: String,
    reference_profile: String,
    agreed: bool,
    #[serde(default)]
    prompt: Option<String>,
}

/// The stream's key for a key prefix.
pub fn stream_key(prefix: &str) -> String {
    format!("{prefix}:outcomes")
}

/// Checks the outcome file of every profile set that becomes active, so that a path the
/// router must not write is reported when the set is applied; ends at `stop`.
pub async fn check_files(
    store: Arc<ProfileStore>,
    calibrator: Arc<Calibrator>,
    mut stop: watch::Receiver<bool>,
) {
    let mut changes = store.subscribe();
    loop {
        let active = store.load();
        let sink = active.set.policy.calibration.as_ref();
        if let Some(path) = sink.and_then(|c| c.outcomes.as_ref()?.file.clone()) {
            calibrator.outcomes.check_file(PathBuf::from(path)).await;
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
    }
}

impl Default for OutcomeLog {
    fn default() -> Self {
        Self::new(None, false)
    }
}

impl OutcomeLog {
    /// A log to the router's Redis (client and key prefix), if it has one.
    pub fn new(redis: Option<(Redis, String)>, log_prompts: bool) -> Self {
        Self {
            redis: redis.map(|(redis, prefix)| Shared {
                link: Link::new(redis),
                key: stream_key(&prefix),
            }),
            log_prompts,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            file: Arc::new(Mutex::new(None)),
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
        let (fitted, line) = match fit(record) {
            Ok(fitted) => fitted,
            Err(bytes) => {
                // Only profile ids of kilobytes make the record's fixed part that long.
                tracing::warn!(
                    bytes,
                    "outcome record longer than {MAX_RECORD_BYTES} bytes; not written"
                );
                if sink.redis {
                    telemetry::outcome_record("redis", "error");
                }
                if sink.file.is_some() {
                    telemetry::outcome_record("file", "error");
                }
                return;
            }
        };
        let record = &fitted;
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
                            shared.link.reset();
                            tracing::warn!(%error, "outcome record not written to Redis");
                        }
                        None => tracing::debug!(%error, "outcome record not written to Redis"),
                    }
                    telemetry::outcome_record("redis", "error");
                }
            }
        }
        if let Some(path) = &sink.file {
            self.write_file(PathBuf::from(path), line, sink.max_len)
                .await;
        }
    }

    /// Appends `line` to the file off the async workers (a first check reads the file).
    async fn write_file(&self, path: PathBuf, line: String, max_len: u64) {
        let file = Arc::clone(&self.file);
        let shown = path.display().to_string();
        let appended = tokio::task::spawn_blocking(move || {
            with_log(&file, path, |log| log.append(&line, max_len))
        })
        .await;
        match appended {
            Ok(Ok(())) => telemetry::outcome_record("file", "written"),
            Ok(Err(FileError::Refused(error))) => {
                tracing::debug!(%error, "outcome record not written to the file");
                telemetry::outcome_record("file", "error");
            }
            Ok(Err(FileError::Io(error))) => {
                tracing::warn!(%error, path = shown, "outcome record not written to the file");
                telemetry::outcome_record("file", "error");
            }
            Err(error) => {
                tracing::warn!(%error, path = shown, "outcome record not written to the file");
                telemetry::outcome_record("file", "error");
            }
        }
    }

    /// Checks `path` and `FILE.1` as a write would, without writing: what is refused is
    /// logged now rather than at the first sampled request.
    async fn check_file(&self, path: PathBuf) {
        let file = Arc::clone(&self.file);
        let shown = path.display().to_string();
        let checked =
            tokio::task::spawn_blocking(move || with_log(&file, path, FileLog::inspect)).await;
        if let Ok(Err(error)) = checked {
            tracing::warn!(%error, path = shown, "outcome file could not be checked");
        }
    }
}

/// Runs `f` on the file log of `path`, a new one when the policy names another path.
fn with_log<T>(
    file: &Mutex<Option<FileLog>>,
    path: PathBuf,
    f: impl FnOnce(&mut FileLog) -> T,
) -> T {
    let mut guard = file.lock().unwrap_or_else(|e| e.into_inner());
    let log = match &mut *guard {
        Some(log) if log.path == path => log,
        slot => slot.insert(FileLog::new(path)),
    };
    f(log)
}

/// The record and its JSON line, with a logged prompt cut at a character boundary so that
/// the line is at most [`MAX_RECORD_BYTES`]; `Err(length)` when even the rest is longer.
fn fit(record: &TrafficOutcome) -> Result<(TrafficOutcome, String), usize> {
    let mut record = record.clone();
    let prompt = record.prompt.take();
    let bare = serde_json::to_string(&record).map_err(|_| usize::MAX)?;
    if bare.len() > MAX_RECORD_BYTES {
        return Err(bare.len());
    }
    let Some(mut prompt) = prompt else {
        return Ok((record, bare));
    };
    // `,"prompt":""` and the escaped text, inside the closing brace.
    let room = MAX_RECORD_BYTES.saturating_sub(bare.len() + 12);
    let (mut used, mut end) = (0, 0);
    for (at, c) in prompt.char_indices() {
        // As serde_json writes it: escapes take two or six bytes.
        used += serde_json::to_string(&c).map_or(room + 1, |s| s.len() - 2);
        if used > room {
            break;
        }
        end = at + c.len_utf8();
    }
    prompt.truncate(end);
    record.prompt = Some(prompt);
    let line = serde_json::to_string(&record).map_err(|_| usize::MAX)?;
    Ok((record, line))
}

// === impl FileLog ===

impl FileLog {
    fn new(path: PathBuf) -> Self {
        Self {
            path,
            current: None,
            rotated: None,
        }
    }

    /// Appends a line; once the file holds `max_len` records it becomes `FILE.1` (replacing
    /// the previous one) and a new file starts, so a replica keeps at most twice `max_len`.
    fn append(&mut self, line: &str, max_len: u64) -> Result<(), FileError> {
        let (mut file, mut lines) = self.open()?;
        if lines >= max_len {
            self.rotate()?;
            (file, lines) = self.open()?;
        }
        file.write_all(format!("{line}\n").as_bytes())?;
        if let Some(current) = &mut self.current {
            current.verdict = Ok(lines + 1);
        }
        Ok(())
    }

    /// Both paths checked, nothing written (a missing file is not created).
    fn inspect(&mut self) -> std::io::Result<()> {
        examine(&self.path, &mut self.current)?;
        examine(&rotated_path(&self.path), &mut self.rotated)?;
        Ok(())
    }

    /// The file to append to and its records: created when absent, checked when new here.
    fn open(&mut self) -> Result<(File, u64), FileError> {
        let (id, lines) = match examine(&self.path, &mut self.current)? {
            None => return self.create(),
            Some(Checked {
                verdict: Err(why), ..
            }) => return Err(FileError::Refused(why.clone())),
            Some(Checked {
                id,
                verdict: Ok(lines),
            }) => (*id, *lines),
        };
        let file = OpenOptions::new().append(true).open(&self.path)?;
        if file_id(&file.metadata()?) != id {
            self.current = None;
            return Err(std::io::Error::other("the file was replaced while it was checked").into());
        }
        Ok((file, lines))
    }

    fn create(&mut self) -> Result<(File, u64), FileError> {
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .mode(0o600)
            .open(&self.path)?;
        self.current = Some(Checked {
            id: file_id(&file.metadata()?),
            verdict: Ok(0),
        });
        Ok((file, 0))
    }

    /// Moves the file to `FILE.1`, unless something other than the router's records is there.
    fn rotate(&mut self) -> Result<(), FileError> {
        let target = rotated_path(&self.path);
        if let Some(Checked {
            verdict: Err(why), ..
        }) = examine(&target, &mut self.rotated)?
        {
            return Err(FileError::Refused(why.clone()));
        }
        std::fs::rename(&self.path, &target)?;
        self.rotated = self.current.take();
        Ok(())
    }
}

fn rotated_path(path: &Path) -> PathBuf {
    let mut rotated = path.as_os_str().to_owned();
    rotated.push(".1");
    PathBuf::from(rotated)
}

fn file_id(meta: &std::fs::Metadata) -> FileId {
    (meta.dev(), meta.ino())
}

/// What is at `path` now: nothing, or the file last checked there, checked again (and
/// reported when refused) if it is another file than last time.
fn examine<'a>(path: &Path, slot: &'a mut Option<Checked>) -> std::io::Result<Option<&'a Checked>> {
    let found = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            *slot = None;
            return Ok(None);
        }
        found => found?,
    };
    if slot.as_ref().is_none_or(|c| c.id != file_id(&found)) {
        let checked = check(path, &found)?;
        if let Err(reason) = &checked.verdict {
            tracing::error!(path = %path.display(), reason,
                "outcome file refused: the router writes, moves and removes nothing there");
        }
        *slot = Some(checked);
    }
    Ok(slot.as_ref())
}

/// Reads the file at `path` (found as `found`, not followed if a link) to the first line
/// that is not a record as the router writes it.
fn check(path: &Path, found: &std::fs::Metadata) -> std::io::Result<Checked> {
    let id = file_id(found);
    let refused = |why: String| Checked {
        id,
        verdict: Err(format!("{}: {why}", path.display())),
    };
    if !found.file_type().is_file() {
        return Ok(refused(
            "not a regular file (a link, directory or device)".into(),
        ));
    }
    let file = File::open(path)?;
    if file_id(&file.metadata()?) != id {
        return Err(std::io::Error::other(
            "the file was replaced while it was checked",
        ));
    }
    let mut reader = BufReader::new(file);
    let mut line = Vec::new();
    let mut records = 0;
    loop {
        line.clear();
        if (&mut reader)
            .take(MAX_CHECKED_LINE)
            .read_until(b'\n', &mut line)?
            == 0
        {
            return Ok(Checked {
                id,
                verdict: Ok(records),
            });
        }
        records += 1;
        let whole = line.last() == Some(&b'\n');
        if !whole || serde_json::from_slice::<WrittenRecord>(&line).is_err() {
            return Ok(refused(format!(
                "line {records} is not an outcome record as the router writes them"
            )));
        }
    }
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

    async fn connection(&self) -> redis::RedisResult<Conn> {
        self.link.get().await
    }
}

/// Every record of the stream `key`, oldest first. An entry that is not a valid record
/// (another router version's features, a field missing) fails the whole read, naming it.
pub async fn read_stream(redis: &Redis, key: &str) -> Result<Vec<OutcomeRecord>, String> {
    let mut conn = redis
        .connect()
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

    fn sink(path: &Path, max_len: u64) -> OutcomeSink {
        OutcomeSink {
            redis: false,
            file: Some(path.to_str().unwrap().into()),
            max_len,
            ttl_s: 60,
        }
    }

    fn lines(path: &Path) -> Vec<String> {
        let text = std::fs::read_to_string(path).unwrap();
        text.lines().map(str::to_owned).collect()
    }

    #[tokio::test]
    async fn a_path_holding_anything_else_is_never_written_moved_or_removed() {
        let dir = tempfile::tempdir().unwrap();
        let own = dir.path().join("own.jsonl");
        let log = OutcomeLog::default();
        log.write(&sink(&own, 100), &record(true)).await;
        let link = dir.path().join("link.jsonl");
        std::os::unix::fs::symlink(&own, &link).unwrap();
        let foreign = [
            ("notes.txt", "one\ntwo\nthree\n"),
            ("other.jsonl", "{\"a\": 1}\n{\"a\": 2}\n"),
            ("cut.jsonl", &serde_json::to_string(&record(false)).unwrap()),
        ];
        for (name, text) in foreign {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        for _ in 0..3 {
            for name in ["notes.txt", "other.jsonl", "cut.jsonl", "link.jsonl", "."] {
                log.write(&sink(&dir.path().join(name), 1), &record(true))
                    .await;
            }
        }
        for (name, text) in foreign {
            let path = dir.path().join(name);
            assert_eq!(std::fs::read_to_string(&path).unwrap(), text, "{name}");
            assert!(!rotated_path(&path).exists(), "{name} moved aside");
        }
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(lines(&own).len(), 1, "nothing through the link");
        assert!(!rotated_path(&link).exists());
    }

    #[tokio::test]
    async fn only_the_routers_own_file_is_moved_over_another() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outcomes.jsonl");
        let rotated = rotated_path(&path);
        std::fs::write(&rotated, "keep me\n").unwrap();
        let log = OutcomeLog::default();
        for _ in 0..3 {
            log.write(&sink(&path, 2), &record(true)).await;
        }
        assert_eq!(std::fs::read_to_string(&rotated).unwrap(), "keep me\n");
        assert_eq!(lines(&path).len(), 2, "the third record waits for room");

        // Once the stranger is gone, the file rotates; a restarted router checks what it
        // finds and moves its own file over its own.
        std::fs::remove_file(&rotated).unwrap();
        log.write(&sink(&path, 2), &record(false)).await;
        assert_eq!((lines(&rotated).len(), lines(&path).len()), (2, 1));
        let restarted = OutcomeLog::default();
        restarted.write(&sink(&path, 1), &record(true)).await;
        assert_eq!((lines(&rotated).len(), lines(&path).len()), (1, 1));
        assert!(lines(&rotated)[0].contains("\"agreed\":false"));
    }

    #[tokio::test]
    async fn a_new_file_is_readable_by_the_router_alone() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outcomes.jsonl");
        let log = OutcomeLog::default();
        log.check_file(path.clone()).await;
        assert!(!path.exists(), "a check creates nothing");
        log.write(&sink(&path, 10), &record(true)).await;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[tokio::test]
    async fn a_logged_prompt_is_cut_to_the_record_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("outcomes.jsonl");
        let log = OutcomeLog::new(None, true);
        let mut long = record(true);
        // Quotes and control characters take more room escaped than raw.
        long.prompt = Some("Ann has \"3\" apples.\u{1}\n".repeat(20_000));
        log.write(&sink(&path, 10), &long).await;
        let mut odd = record(true);
        odd.cheap_profile = "p".repeat(MAX_RECORD_BYTES);
        log.write(&sink(&path, 10), &odd).await;
        let lines = lines(&path);
        assert_eq!(
            lines.len(),
            1,
            "a record too long without its prompt is not written"
        );
        assert!(lines[0].len() <= MAX_RECORD_BYTES, "{}", lines[0].len());
        let back: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
        let prompt = back["prompt"].as_str().unwrap();
        assert!(prompt.len() > MAX_RECORD_BYTES / 4, "{}", prompt.len());
        assert!(long.prompt.unwrap().starts_with(prompt));
    }
}
