//! llama.cpp's `llama-server`, a real OpenAI-compatible server: its binary (built by
//! `scripts/install-tools llama-server`, which `scripts/test` starts in the background before
//! cargo builds), a tiny model the test writes with PyPI's `gguf`
//! (`tests/python/tiny_gguf.py`), and the server running it on a free loopback port.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};

/// Set by `scripts/test`: the file the background build writes its exit status to (its
/// output is in the file of the same name ending in `.log`).
const BUILD_STATUS: &str = "QUANTROUTER_LLAMA_SERVER_BUILD";

/// How long a test waits for the background build: it takes about ten minutes on two
/// cores while cargo builds beside it, and a machine shared with other builds is slower.
const BUILD_DEADLINE: Duration = Duration::from_secs(45 * 60);

/// A running `llama-server` with the tiny model, killed when dropped.
pub struct LlamaServer {
    _child: Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl LlamaServer {
    /// Writes the model and starts the server; returns once it listens.
    pub async fn start() -> Self {
        let binary = binary().await;
        let dir = tempfile::Builder::new()
            .prefix("qr-llama-")
            .tempdir()
            .unwrap();
        let model = dir.path().join("tiny.gguf");
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/tiny_gguf.py");
        let written = Command::new(super::python())
            .arg(script)
            .arg(&model)
            .status()
            .await
            .unwrap();
        assert!(
            written.success(),
            "tiny_gguf.py failed (scripts/install-tools gguf?)"
        );
        let mut child = Command::new(&binary)
            .arg("-m")
            .arg(&model)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "-c",
                "2048",
                "-np",
                "2",
                "-t",
                "1",
            ])
            .args(["--jinja", "--no-warmup"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let output = child.stderr.take().unwrap();
        let url = super::announced(output, "listening on http://", Duration::from_secs(60)).await;
        let addr = url.trim_end_matches('/').parse().unwrap();
        Self {
            _child: child,
            addr,
            _dir: dir,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// The `llama-server` binary, once the background build (if one runs) is done.
async fn binary() -> PathBuf {
    if let Some(status) = std::env::var_os(BUILD_STATUS).map(PathBuf::from) {
        let built = super::eventually(BUILD_DEADLINE, || {
            let status = status.clone();
            async move { status.exists() }
        })
        .await;
        assert!(
            built,
            "the llama-server build did not end within {BUILD_DEADLINE:?}"
        );
        let code = std::fs::read_to_string(&status).unwrap();
        let log = status.with_extension("log");
        assert_eq!(
            code.trim(),
            "0",
            "the llama-server build failed:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/bin/llama-server");
    assert!(
        path.exists(),
        "{} not found: run `scripts/install-tools llama-server` (scripts/test does)",
        path.display()
    );
    path
}
