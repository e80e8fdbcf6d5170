//! A vllm-sim in a process of its own, for tests that kill an upstream the way a node
//! that is gone does (SIGKILL). The simulator is this test binary run again: started by
//! [`SimProcess::spawn`] with the name of a test that calls [`serve_when_spawned`] first,
//! that test serves as the simulator instead of running.

use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};
use vllm_sim::{SimConfig, SimServer};

/// Holds the served model and inter-token latency of a spawned simulator.
const SPAWNED: &str = "QUANTROUTER_TEST_SIM_PROCESS";

/// A simulator process, killed when dropped.
pub struct SimProcess {
    child: Child,
    url: String,
}

impl SimProcess {
    /// Runs `test` of this binary as a simulator serving `model` with `itl` per token.
    pub async fn spawn(test: &str, model: &str, itl: Duration) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads", "1"])
            .env(SPAWNED, format!("{} {model}", itl.as_millis()))
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // The test harness names the test first, on the same line.
        let output = child.stdout.take().unwrap();
        let url = super::announced(output, "vllm-sim listening on ", Duration::from_secs(30)).await;
        Self { child, url }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// SIGKILL: the process dies at once, and its sockets with it.
    pub async fn kill(&mut self) {
        self.child.kill().await.unwrap();
    }

    /// A counter of the simulator's `/metrics`, e.g. `vllm:generation_tokens_total`.
    pub async fn metric(&self, name: &str) -> f64 {
        let page = super::send(
            &super::client(),
            "GET",
            &format!("{}/metrics", self.url),
            "",
            &[],
        )
        .await;
        let page = String::from_utf8_lossy(&page.body).into_owned();
        page.lines()
            .find(|line| line.starts_with(name))
            .and_then(|line| line.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    }
}

/// In a test started by [`SimProcess::spawn`]: serves as the simulator until killed, and
/// never returns. Anywhere else: returns at once.
pub async fn serve_when_spawned() {
    let Ok(spec) = std::env::var(SPAWNED) else {
        return;
    };
    let (itl_ms, model) = spec.split_once(' ').unwrap();
    let config = SimConfig {
        model: model.to_owned(),
        itl: Duration::from_millis(itl_ms.parse().unwrap()),
        ..SimConfig::default()
    };
    let sim = SimServer::bind(super::loopback(), config).await.unwrap();
    println!("vllm-sim listening on {}", sim.url());
    std::future::pending::<()>().await;
}
