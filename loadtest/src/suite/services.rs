//! Starting what the scenarios drive: simulators, routers, Redis and the alternatives.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::time::Instant;

use super::process::{free_port, which, Proc};
use super::Suite;

/// A vllm-sim process.
#[derive(Debug)]
pub struct Sim {
    /// The process.
    pub proc: Proc,
    /// Its base URL.
    pub url: String,
    /// Its port, to restart it on the same one.
    pub port: u16,
}

/// A server started with its URL: a router or an alternative.
#[derive(Debug)]
pub struct Server {
    /// The process.
    pub proc: Proc,
    /// The OpenAI-compatible base URL.
    pub url: String,
    /// quantrouter's admin URL (`/metrics`, `/readyz`, `/admin/...`); the alternatives have
    /// none.
    pub admin_url: String,
}

/// One tier's profile, as the scenarios write them.
#[derive(Debug, Clone)]
pub struct ProfileSpec<'a> {
    /// Profile id.
    pub id: &'a str,
    /// Model served by its upstream.
    pub model: &'a str,
    /// Quantization and tier name.
    pub tier: &'a str,
    /// Upstream URLs.
    pub urls: Vec<String>,
    /// Dollars per million input and output tokens.
    pub cost: (f64, f64),
    /// Expected TTFT and inter-token latency in ms.
    pub latency_ms: (u64, u64),
    /// `max_concurrency`.
    pub max_concurrency: usize,
    /// `quality`, by task class.
    pub quality: Value,
}

// === impl Suite ===

impl Suite {
    /// Starts a vllm-sim serving `model` with the given latency model, on `port` or on one it
    /// picks itself (and announces).
    pub(super) async fn start_sim(
        &self,
        name: &str,
        model: &str,
        latency_ms: (u64, u64),
        max_num_seqs: usize,
        port: Option<u16>,
    ) -> anyhow::Result<Sim> {
        self.start_sim_with(name, model, latency_ms, max_num_seqs, port, &[])
            .await
    }

    /// [`Suite::start_sim`] with more flags (the prefix cache, say).
    pub(super) async fn start_sim_with(
        &self,
        name: &str,
        model: &str,
        (ttft_ms, itl_ms): (u64, u64),
        max_num_seqs: usize,
        port: Option<u16>,
        extra: &[String],
    ) -> anyhow::Result<Sim> {
        let listen = format!("127.0.0.1:{}", port.unwrap_or(0));
        let mut args = vec![
            "--listen".to_owned(),
            listen,
            "--model".to_owned(),
            model.to_owned(),
            "--ttft-ms".to_owned(),
            ttft_ms.to_string(),
            "--itl-ms".to_owned(),
            itl_ms.to_string(),
            "--max-num-seqs".to_owned(),
            max_num_seqs.to_string(),
        ];
        args.extend_from_slice(extra);
        let timeout = Duration::from_secs(self.options.ready_timeout_s);
        let (mut proc, line) = Proc::spawn_announcing(
            &format!("sim-{name}"),
            &self.sim_bin,
            args,
            self.work(),
            timeout,
        )
        .await?;
        // "vllm-sim listening on http://127.0.0.1:PORT model=NAME"
        let url = line
            .split_whitespace()
            .find(|word| word.starts_with("http://"))
            .with_context(|| format!("vllm-sim announced no URL: {line:?}"))?
            .to_owned();
        let port = url
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .with_context(|| format!("no port in {url}"))?;
        proc.wait_ready(&format!("{url}/health"), timeout).await?;
        Ok(Sim { proc, url, port })
    }

    /// Writes a profile set to the working directory and returns its path.
    pub(super) fn write_profiles(
        &self,
        file: &str,
        version: u64,
        default_profile: &str,
        policy: Value,
        profiles: &[ProfileSpec<'_>],
    ) -> anyhow::Result<PathBuf> {
        let path = self.work().join(file);
        let set = profile_set(version, default_profile, policy, profiles);
        std::fs::write(&path, serde_json::to_string_pretty(&set)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(path)
    }

    /// Starts the router under test on free loopback ports with `profiles` and no KEDA port
    /// (two routers in one scenario would collide on its fixed default).
    pub(super) async fn start_router(
        &self,
        name: &str,
        profiles: &Path,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Server> {
        self.start_router_binary(name, &self.router_bin, profiles, extra, envs)
            .await
    }

    /// [`Suite::start_router`] with another binary (an A/B, a wrapper such as valgrind).
    pub(super) async fn start_router_binary(
        &self,
        name: &str,
        binary: &Path,
        profiles: &Path,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Server> {
        self.start_router_command(name, binary, &[], profiles, extra, envs, None)
            .await
    }

    /// Starts `program prefix... serve ...` (the router, or a tool wrapping it) and waits
    /// `ready` (default the ready timeout) for its `/readyz`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start_router_command(
        &self,
        name: &str,
        program: &Path,
        prefix: &[&str],
        profiles: &Path,
        extra: &[&str],
        envs: &[(&str, &str)],
        ready: Option<Duration>,
    ) -> anyhow::Result<Server> {
        let (port, admin) = (free_port()?, free_port()?);
        let listen = format!("127.0.0.1:{port}");
        let admin_listen = format!("127.0.0.1:{admin}");
        let profiles = profiles.to_string_lossy().into_owned();
        let mut args: Vec<&str> = prefix.to_vec();
        args.extend([
            "serve",
            "--listen",
            &listen,
            "--admin-listen",
            &admin_listen,
            "--profiles",
            &profiles,
            "--log-format",
            "text",
            "--keda-scaler-listen",
            "off",
        ]);
        args.extend_from_slice(extra);
        let mut proc = self.spawn_target(name, program, &args, envs)?;
        let admin_url = format!("http://127.0.0.1:{admin}");
        let timeout = ready.unwrap_or(Duration::from_secs(self.options.ready_timeout_s));
        proc.wait_ready(&format!("{admin_url}/readyz"), timeout)
            .await?;
        Ok(Server {
            proc,
            url: format!("http://127.0.0.1:{port}"),
            admin_url,
        })
    }

    /// A zero-work TCP relay to `upstream_port`, when socat is installed.
    pub(super) async fn start_socat(&self, upstream_port: u16) -> anyhow::Result<Option<Server>> {
        if self.options.no_alternatives {
            return Ok(None);
        }
        let Some(socat) = which("socat") else {
            eprintln!("suite: socat is not installed (apt-get install socat); no relay reference");
            return Ok(None);
        };
        let port = free_port()?;
        let args = [
            format!("TCP-LISTEN:{port},fork,reuseaddr,nodelay,bind=127.0.0.1"),
            format!("TCP:127.0.0.1:{upstream_port},nodelay"),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut proc = self.spawn_target("socat", &socat, &args, &[])?;
        let url = format!("http://127.0.0.1:{port}");
        proc.wait_ready(
            &format!("{url}/health"),
            Duration::from_secs(self.options.ready_timeout_s),
        )
        .await?;
        Ok(Some(Server {
            proc,
            url,
            admin_url: String::new(),
        }))
    }

    /// vllm-router (round robin) in front of `upstream`, from its pinned venv.
    pub(super) async fn start_vllm_router(&self, upstream: &str) -> Option<Server> {
        self.start_vllm_router_policy(&[upstream.to_owned()], "round_robin")
            .await
    }

    /// vllm-router with `policy` in front of the `workers`, from its pinned venv.
    pub(super) async fn start_vllm_router_policy(
        &self,
        workers: &[String],
        policy: &str,
    ) -> Option<Server> {
        let program = self.alternative("vllm-router", "vllm-router")?;
        let port = free_port().ok()?;
        let port_text = port.to_string();
        let mut args = vec!["--host", "127.0.0.1", "--port", &port_text, "--worker-urls"];
        args.extend(workers.iter().map(String::as_str));
        args.extend(["--policy", policy, "--log-level", "warning"]);
        let url = format!("http://127.0.0.1:{port}");
        self.start_alternative("vllm-router", &program, &args, &[], &url, "/v1/models")
            .await
    }

    /// LiteLLM proxy (one worker, no database, telemetry off) in front of `upstream`.
    pub(super) async fn start_litellm(&self, upstream: &str, model: &str) -> Option<Server> {
        let program = self.alternative("LiteLLM", "litellm")?;
        let config = self.work().join("litellm.yaml");
        let yaml = format!(
            "model_list:\n  - model_name: {model}\n    litellm_params:\n      model: openai/{model}\n      \
             api_base: {upstream}/v1\n      api_key: none\nlitellm_settings:\n  telemetry: false\n  \
             drop_params: true\n"
        );
        std::fs::write(&config, yaml).ok()?;
        let port = free_port().ok()?;
        let port_text = port.to_string();
        let config_text = config.to_string_lossy().into_owned();
        let args = [
            "--config",
            &config_text,
            "--host",
            "127.0.0.1",
            "--port",
            &port_text,
            "--num_workers",
            "1",
        ];
        // Loopback only, so no master key; the cost map ships with the package (no fetch).
        let envs = [
            ("LITELLM_TELEMETRY", "False"),
            ("DISABLE_ADMIN_UI", "True"),
            ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
            (
                "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY",
                "true",
            ),
        ];
        let url = format!("http://127.0.0.1:{port}");
        self.start_alternative(
            "litellm",
            &program,
            &args,
            &envs,
            &url,
            "/health/liveliness",
        )
        .await
    }

    /// Starts a target (a router or an alternative), on `--target-cpus` when given.
    pub(super) fn spawn_target(
        &self,
        name: &str,
        program: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> anyhow::Result<Proc> {
        let Some(cpus) = &self.options.target_cpus else {
            return Proc::spawn(name, program, args, envs, self.work());
        };
        // taskset execs the program: the process, its pid and its CPU time stay the target's.
        let taskset = which("taskset").context("--target-cpus needs taskset (util-linux)")?;
        let program = program.as_os_str();
        let pinned = [OsStr::new("-c"), OsStr::new(cpus), program]
            .into_iter()
            .chain(args.iter().map(OsStr::new));
        Proc::spawn(name, &taskset, pinned, envs, self.work())
    }

    /// The executable `bin/NAME` of the venv `<alternatives_dir>/venv-NAME`, if installed.
    fn alternative(&self, title: &str, name: &str) -> Option<PathBuf> {
        if self.options.no_alternatives {
            return None;
        }
        let program = self
            .options
            .alternatives_dir
            .join(format!("venv-{name}"))
            .join("bin")
            .join(name);
        if program.is_file() {
            Some(program)
        } else {
            eprintln!(
                "suite: {title} is not installed ({} missing; scripts/install-alternatives \
                 installs it); carrying on without it",
                program.display()
            );
            None
        }
    }

    async fn start_alternative(
        &self,
        name: &str,
        program: &Path,
        args: &[&str],
        envs: &[(&str, &str)],
        url: &str,
        health: &str,
    ) -> Option<Server> {
        let started = async {
            let mut proc = self.spawn_target(name, program, args, envs)?;
            let timeout = Duration::from_secs(self.options.alternative_ready_timeout_s);
            proc.wait_ready(&format!("{url}{health}"), timeout).await?;
            anyhow::Ok(proc)
        };
        match started.await {
            Ok(proc) => Some(Server {
                proc,
                url: url.to_owned(),
                admin_url: String::new(),
            }),
            Err(error) => {
                eprintln!("suite: {name} did not start ({error:#}); carrying on without it");
                None
            }
        }
    }

    /// A redis-server on `port` without persistence, once it answers PING.
    pub(super) async fn start_redis(&self, port: u16) -> anyhow::Result<Proc> {
        let redis = which("redis-server")
            .context("redis-server is not installed (scripts/install-tools redis)")?;
        let port_text = port.to_string();
        let args = [
            "--port",
            &port_text,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ];
        let proc = Proc::spawn("redis", &redis, args, &[], self.work())?;
        let deadline = Instant::now() + Duration::from_secs(self.options.ready_timeout_s);
        while !redis_ping(port).await {
            anyhow::ensure!(Instant::now() < deadline, "redis-server did not start");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(proc)
    }

    /// `quantrouter profiles push FILE --redis-url URL`; whether it succeeded.
    pub(super) async fn push_profiles(&self, file: &Path, redis_url: &str) -> bool {
        self.push_document("profiles", file, redis_url).await
    }

    /// A Redis on a free port holding the tenant document `tenants` (written as `name`), and
    /// its URL.
    pub(super) async fn redis_with_tenants(
        &self,
        name: &str,
        tenants: &str,
    ) -> anyhow::Result<(Proc, String)> {
        let port = free_port()?;
        let redis = self.start_redis(port).await?;
        let url = format!("redis://127.0.0.1:{port}");
        let file = self.work().join(name);
        std::fs::write(&file, tenants)?;
        anyhow::ensure!(
            self.push_tenants(&file, &url).await,
            "cannot push the tenants of {name} to {url}"
        );
        Ok((redis, url))
    }

    /// `quantrouter tenants push FILE --redis-url URL`; whether it succeeded.
    pub(super) async fn push_tenants(&self, file: &Path, redis_url: &str) -> bool {
        self.push_document("tenants", file, redis_url).await
    }

    async fn push_document(&self, kind: &str, file: &Path, redis_url: &str) -> bool {
        tokio::process::Command::new(&self.cli_bin)
            .args([kind, "push"])
            .arg(file)
            .args(["--redis-url", redis_url])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .await
            .is_ok_and(|status| status.success())
    }
}

/// Does a Redis on loopback `port` answer PING?
async fn redis_ping(port: u16) -> bool {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream.write_all(b"PING\r\n").await?;
        let mut reply = [0u8; 7];
        stream.read_exact(&mut reply).await?;
        std::io::Result::Ok(&reply == b"+PONG\r\n")
    };
    tokio::time::timeout(Duration::from_secs(1), exchange)
        .await
        .is_ok_and(|result| result.unwrap_or(false))
}

/// A profile set document.
pub fn profile_set(
    version: u64,
    default_profile: &str,
    policy: Value,
    profiles: &[ProfileSpec<'_>],
) -> Value {
    let profiles: Vec<Value> = profiles
        .iter()
        .map(|p| {
            json!({
                "id": p.id,
                "model": p.model,
                "quantization": p.tier,
                "tier": p.tier,
                "upstream": {"urls": p.urls},
                "cost_per_1m_input_tokens": p.cost.0,
                "cost_per_1m_output_tokens": p.cost.1,
                "latency": {"ttft_ms": p.latency_ms.0, "itl_ms": p.latency_ms.1},
                "quality": p.quality,
                "max_context_tokens": 16384,
                "max_concurrency": p.max_concurrency,
                "chars_per_token": 4.0,
            })
        })
        .collect();
    json!({
        "version": version,
        "default_profile": default_profile,
        "policy": policy,
        "profiles": profiles,
    })
}

/// The one-profile set of the single-tier scenarios: everything to `url`.
pub fn single_profile<'a>(
    url: &str,
    latency_ms: (u64, u64),
    max_concurrency: usize,
) -> ProfileSpec<'a> {
    ProfileSpec {
        id: "sim",
        model: "sim-model",
        tier: "fp16",
        urls: vec![url.to_owned()],
        cost: (0.1, 0.2),
        latency_ms,
        max_concurrency,
        quality: json!({"default": 0.99}),
    }
}
