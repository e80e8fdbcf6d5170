//! Configuration the router refuses at start, with a message naming the setting: values
//! that would make it unusable, and a `--config` that is not a regular file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Stdio;
use std::time::Duration;

/// Runs `quantrouter serve` with `args` (on ports nothing listens on) and returns its exit
/// code and stderr; a router that is still running after a few seconds failed the test.
async fn serve_refused(args: &[&str]) -> (i32, String) {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(["--keda-scaler-listen", "off"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("`serve {}` did not stop", args.join(" ")))
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_that_make_the_router_unusable_are_refused_naming_the_setting() {
    for (flag, value) in [
        ("--request-timeout-ms", "0"),
        ("--idle-timeout-ms", "0"),
        ("--idle-timeout-ms", "2"),
        ("--body-limit-bytes", "0"),
    ] {
        let (code, stderr) = serve_refused(&[flag, value]).await;
        assert_eq!(code, 1, "{flag} {value}: {stderr}");
        assert!(stderr.contains(flag), "{flag} {value}: {stderr}");
    }
    // The same from a config file, named with the file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("router.json");
    std::fs::write(&path, r#"{"idle_timeout_ms": 0}"#).unwrap();
    let (code, stderr) = serve_refused(&["--config", path.to_str().unwrap()]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(
        stderr.contains("router.json") && stderr.contains("idle-timeout-ms"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_that_is_not_a_regular_file_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("router.json");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    // Reading it would wait for a writer, and start-up with it.
    let (code, stderr) = serve_refused(&["--config", fifo.to_str().unwrap()]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("not a regular file"), "{stderr}");
    let (code, stderr) = serve_refused(&["--config", dir.path().to_str().unwrap()]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("not a regular file"), "{stderr}");
}
