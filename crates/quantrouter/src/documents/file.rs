//! Watching a document file for edits: polled by modification time and size (no inotify
//! needed, and it sees Kubernetes ConfigMap symlink swaps).

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;

/// Calls `changed` after every edit of `path` until the task is aborted.
pub fn watch(
    path: PathBuf,
    interval: Duration,
    mut changed: impl FnMut(&Path) + Send + 'static,
) -> JoinHandle<()> {
    // Stamp now, not when the task first runs: an edit made in between must count.
    let mut last = stamp(&path);
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let now = stamp(&path);
            if now == last || now.is_none() {
                continue;
            }
            last = now;
            changed(&path);
        }
    })
}

fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}
