//! `serve --profiles FILE`: edits are applied live, invalid edits are ignored.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::Duration;

use quantrouter::profiles::{self, FileSource, SourceKind};
use quantrouter_policy::{ProfileSet, DEFAULT_PROFILE_SET};
use support::{eventually, rejected_since, reloads};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_edits_apply_live_and_invalid_edits_keep_the_last_good_set() {
    quantrouter::telemetry::metrics_handle();
    let dir = tempfile::Builder::new()
        .prefix("qr-profiles-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("profiles.json");
    std::fs::write(&path, DEFAULT_PROFILE_SET).unwrap();

    let source = FileSource {
        path: path.clone(),
        interval: Duration::from_millis(20),
    };
    let started = profiles::start(vec![Arc::new(source)]).await.unwrap();
    let store = started.store;
    assert_eq!(store.load().source, SourceKind::File);

    // A valid edit: disable the int4 profile and bump the version.
    let mut edited = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    edited.version = 2;
    edited.profiles[2].enabled = false;
    std::fs::write(&path, serde_json::to_string_pretty(&edited).unwrap()).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            store.load().set.version == 2
        })
        .await
    );
    assert!(!store.load().set.profiles[2].enabled);

    // An invalid edit (quality out of range) is rejected; version 2 stays active.
    let broken = serde_json::to_string(&edited)
        .unwrap()
        .replace("0.97", "1.97");
    let before = reloads("file", "rejected");
    std::fs::write(&path, &broken).unwrap();
    assert!(
        rejected_since("file", before, 1).await,
        "the invalid edit is seen and refused"
    );
    assert_eq!(
        store.load().set.version,
        2,
        "an invalid document never replaces the active set"
    );
    // A valid edit after it proves the watcher kept going.
    let mut next = edited.clone();
    next.version = 3;
    std::fs::write(&path, serde_json::to_string(&next).unwrap()).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            store.load().set.version == 3
        })
        .await
    );

    // An older version is refused.
    let mut old = next.clone();
    old.version = 1;
    old.profiles[0].quality.default = 0.5;
    let before = reloads("file", "rejected");
    std::fs::write(&path, serde_json::to_string(&old).unwrap()).unwrap();
    assert!(
        rejected_since("file", before, 1).await,
        "the older version is seen and refused"
    );
    assert_eq!(
        store.load().set.version,
        3,
        "an older version never replaces a newer one"
    );
    for task in started.tasks {
        task.abort();
    }
}
