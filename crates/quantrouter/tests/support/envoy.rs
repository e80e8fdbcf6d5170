//! A real Envoy (`scripts/install-tools envoy`) started from the repository's example
//! configuration, `manifests/envoy/envoy.yaml`, with quantrouter's endpoint picker at `epp`
//! and the listener and admin ports chosen by the kernel.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use super::{client, eventually, send};

/// A running Envoy; killed when dropped.
pub struct Envoy {
    child: tokio::process::Child,
    pub listener: SocketAddr,
    pub admin: SocketAddr,
    _dir: tempfile::TempDir,
}

/// The Envoy binary: `envoy` on the PATH (scripts/test puts `.tools/bin` there), else the
/// repository's `.tools/bin/envoy`.
fn binary() -> PathBuf {
    let installed = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.tools/bin/envoy");
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("envoy"))
            .find(|p| p.is_file())
    });
    let path = on_path.unwrap_or(installed);
    assert!(
        path.exists(),
        "envoy not found: run `scripts/install-tools envoy` (scripts/test does)"
    );
    path
}

impl Envoy {
    /// Envoy from the example configuration, its picker at `epp`.
    pub async fn start(epp: SocketAddr) -> Self {
        Self::start_with(epp, &[]).await
    }

    /// Envoy from the example configuration with each `(from, to)` of `edits` replaced.
    pub async fn start_with(epp: SocketAddr, edits: &[(&str, &str)]) -> Self {
        let example =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../manifests/envoy/envoy.yaml");
        let config = std::fs::read_to_string(example).unwrap();
        let ports = [
            ("port_value: 8081", "port_value: 0".to_owned()),
            ("port_value: 9901", "port_value: 0".to_owned()),
            ("address: 0.0.0.0", "address: 127.0.0.1".to_owned()),
            ("port_value: 9002", format!("port_value: {}", epp.port())),
        ];
        let edits = edits.iter().map(|(from, to)| (*from, (*to).to_owned()));
        let config = ports
            .into_iter()
            .chain(edits)
            .fold(config, |config, (from, to)| {
                assert!(config.contains(from), "the example config has no `{from}`");
                config.replace(from, &to)
            });
        let dir = tempfile::Builder::new()
            .prefix("qr-envoy-")
            .tempdir()
            .unwrap();
        let file = dir.path().join("envoy.yaml");
        std::fs::write(&file, config).unwrap();
        let admin_path = dir.path().join("admin-address");
        let child = tokio::process::Command::new(binary())
            .arg("-c")
            .arg(&file)
            .args([
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "-l",
                "warning",
            ])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let started = eventually(Duration::from_secs(20), || async {
            std::fs::read_to_string(&admin_path)
                .is_ok_and(|a| a.trim().parse::<SocketAddr>().is_ok())
        })
        .await;
        assert!(started, "envoy did not write its admin address");
        let admin: SocketAddr = std::fs::read_to_string(&admin_path)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let http = client();
        let ready = eventually(Duration::from_secs(20), || async {
            let url = format!("http://{admin}/ready");
            send(&http, "GET", &url, "", &[]).await.status == http::StatusCode::OK
        })
        .await;
        assert!(ready, "envoy did not become ready");
        let listeners = send(
            &http,
            "GET",
            &format!("http://{admin}/listeners?format=json"),
            "",
            &[],
        )
        .await
        .json();
        let socket = &listeners["listener_statuses"][0]["local_address"]["socket_address"];
        let listener = SocketAddr::new(
            socket["address"].as_str().unwrap().parse().unwrap(),
            u16::try_from(socket["port_value"].as_u64().unwrap()).unwrap(),
        );
        Self {
            child,
            listener,
            admin,
            _dir: dir,
        }
    }

    /// The OpenAI base URL through the gateway.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.listener)
    }

    /// One of Envoy's counters, from its admin port.
    pub async fn stat(&self, name: &str) -> u64 {
        let url = format!("http://{}/stats?filter=^{name}$", self.admin);
        let text = send(&client(), "GET", &url, "", &[]).await.body;
        let text = String::from_utf8_lossy(&text);
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}
