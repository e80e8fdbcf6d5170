//! The real coding agents through the router: Claude Code (`claude -p`) and Codex
//! (`codex exec`), as pinned by `scripts/install-tools agents`, complete a prompt with a tool
//! call round trip through the demo as shipped, through profiles that translate their APIs to
//! chat and through profiles that serve them natively; a tenant is charged what the client
//! reports, and a wrong key ends the client within seconds.
//!
//! Each client runs with a fresh home, only the variables it is given, and a proxy that
//! refuses every host but loopback: nothing may reach (or wait for) the internet.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quantrouter::tenants::Tenants;
use serde_json::{json, Value};
use support::{client, eventually, send, Tiers};

const TENANT_KEY: &str = "sk-agent-tenant";
/// A prompt whose answer, from vllm-sim, calls the tool named in it: one the client runs
/// without asking (Claude Code's `ListAgents`, Codex's `get_goal`, neither with arguments).
const CLAUDE_PROMPT: &str = "Say hello, then list the agents. [[call:ListAgents]]";
const CODEX_PROMPT: &str = "Say hello, then show the goal. [[call:get_goal]]";
/// Far above the few seconds a client takes here; bounds a hang, not a measurement.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// Where a client is pointed, and with which key.
struct Target {
    /// The router's base URL, without `/v1`.
    url: String,
    key: &'static str,
}

/// What a client run printed and how it ended.
struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
    took: Duration,
}

/// A client binary from `.tools/bin` (or `PATH`), installed by `scripts/install-tools agents`.
fn agent(name: &str) -> PathBuf {
    let local = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../.tools/bin")
        .join(name);
    if local.exists() {
        return local;
    }
    std::env::var_os("PATH")
        .and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(name))
                .find(|p| p.exists())
        })
        .unwrap_or_else(|| panic!("{name} is missing: run scripts/install-tools agents"))
}

/// Runs `program` in an empty home with only `vars` (and a refusing proxy) set.
async fn run(program: &Path, args: &[&str], home: &Path, vars: &[(&str, String)]) -> Run {
    let (_refusing, nowhere) = support::refusing_address();
    let proxy = format!("http://{nowhere}");
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .current_dir(home)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", home)
        // Any host but the router is refused at once, never waited for.
        .env("HTTPS_PROXY", &proxy)
        .env("HTTP_PROXY", &proxy)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    for (name, value) in vars {
        command.env(name, value);
    }
    let started = Instant::now();
    let output = tokio::time::timeout(RUN_LIMIT, command.output())
        .await
        .unwrap_or_else(|_| panic!("{} ran for over {RUN_LIMIT:?}", program.display()))
        .unwrap();
    Run {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        took: started.elapsed(),
    }
}

/// `claude -p`, with the variables the README gives.
async fn claude(target: &Target, prompt: &str) -> Run {
    let home = tempfile::tempdir().unwrap();
    let vars = [
        ("ANTHROPIC_BASE_URL", target.url.clone()),
        ("ANTHROPIC_API_KEY", target.key.to_owned()),
        ("ANTHROPIC_MODEL", "auto".to_owned()),
        ("ANTHROPIC_DEFAULT_HAIKU_MODEL", "auto".to_owned()),
        ("ANTHROPIC_SMALL_FAST_MODEL", "auto".to_owned()),
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
    ];
    let args = ["-p", prompt, "--output-format", "json"];
    run(&agent("claude"), &args, home.path(), &vars).await
}

/// `codex exec`, with a provider whose base URL is the router and `wire_api = "responses"`.
async fn codex(target: &Target, prompt: &str) -> Run {
    let home = tempfile::tempdir().unwrap();
    let codex_home = home.path().join(".codex");
    std::fs::create_dir_all(&codex_home).unwrap();
    let config = format!(
        "model = \"auto\"\nmodel_provider = \"quantrouter\"\n\n\
         [model_providers.quantrouter]\nname = \"quantrouter\"\nbase_url = \"{}/v1\"\n\
         wire_api = \"responses\"\nenv_key = \"QUANTROUTER_KEY\"\n",
        target.url
    );
    std::fs::write(codex_home.join("config.toml"), config).unwrap();
    let vars = [
        ("CODEX_HOME", codex_home.display().to_string()),
        ("QUANTROUTER_KEY", target.key.to_owned()),
    ];
    let args = [
        "exec",
        "--disable",
        "plugins",
        "--skip-git-repo-check",
        "--json",
        prompt,
    ];
    run(&agent("codex"), &args, home.path(), &vars).await
}

/// Claude Code's result: its answer and the tokens it reports (input, output).
fn claude_result(run: &Run) -> (String, u64) {
    assert!(run.ok, "claude failed:\n{}\n{}", run.stdout, run.stderr);
    let result: Value = serde_json::from_str(run.stdout.trim()).unwrap_or_else(|e| {
        panic!("claude printed no JSON result ({e}):\n{}", run.stdout);
    });
    assert_eq!(result["is_error"], false, "{result}");
    assert!(
        result["num_turns"].as_u64().unwrap() >= 2,
        "no tool round trip: {result}"
    );
    let usage = &result["usage"];
    let tokens = ["input_tokens", "output_tokens"]
        .iter()
        .map(|k| usage[k].as_u64().unwrap())
        .sum();
    (result["result"].as_str().unwrap().to_owned(), tokens)
}

/// Codex's events: its last answer and the tokens of the turn (input, output), checked to
/// include the tool call's round trip.
fn codex_result(run: &Run) -> (String, u64) {
    assert!(run.ok, "codex failed:\n{}\n{}", run.stdout, run.stderr);
    let events: Vec<Value> = run
        .stdout
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    let answer = events
        .iter()
        .rev()
        .find(|e| e["item"]["type"] == "agent_message")
        .unwrap_or_else(|| panic!("no answer: {}", run.stdout));
    let done = events
        .iter()
        .find(|e| e["type"] == "turn.completed")
        .unwrap_or_else(|| panic!("no completed turn: {}", run.stdout));
    let tokens = done["usage"]["input_tokens"].as_u64().unwrap()
        + done["usage"]["output_tokens"].as_u64().unwrap();
    (answer["item"]["text"].as_str().unwrap().to_owned(), tokens)
}

/// Both clients complete a prompt with a tool round trip through `target`: the answers and
/// the tokens each reports, and the generation requests the router answered.
async fn both_complete(target: &Target, requests: impl Fn() -> u64) -> [(String, u64); 2] {
    let before = requests();
    let claude = claude_result(&claude(target, CLAUDE_PROMPT).await);
    let after_claude = requests();
    assert!(
        after_claude >= before + 2,
        "claude's tool call and its result"
    );
    let codex = codex_result(&codex(target, CODEX_PROMPT).await);
    assert!(
        requests() >= after_claude + 2,
        "codex's tool call and its result"
    );
    for (answer, tokens) in [&claude, &codex] {
        assert!(!answer.is_empty() && *tokens > 0);
    }
    [claude, codex]
}

/// `quantrouter_requests_total` by reason, from an admin port's metrics.
async fn requests_by_reason(admin: &str) -> Vec<(String, u64)> {
    let metrics = send(
        &client(),
        "GET",
        &format!("http://{admin}/metrics"),
        "",
        &[],
    )
    .await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    text.lines()
        .filter(|l| l.starts_with("quantrouter_requests_total{"))
        .map(|l| {
            let reason = l.split("reason=\"").nth(1).unwrap().split('"').next();
            let count = l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
            (reason.unwrap().to_owned(), count as u64)
        })
        .collect()
}

/// Every answered request was routed by the policy's utility, none by `constraints_unmet`.
async fn routed_by_utility(admin: &str) {
    let reasons = requests_by_reason(admin).await;
    assert!(
        reasons.iter().any(|(r, n)| r == "utility" && *n > 0)
            && reasons.iter().all(|(r, _)| r == "utility"),
        "{reasons:?}"
    );
}

/// `quantrouter demo` as shipped, on free ports: its URLs from what it prints.
struct Demo {
    child: tokio::process::Child,
    public: String,
    admin: String,
}

impl Demo {
    async fn start() -> Self {
        use tokio::io::AsyncBufReadExt;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_quantrouter"))
            .args([
                "demo",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let (mut public, mut admin) = (None, None);
        while public.is_none() || admin.is_none() {
            let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
                .await
                .expect("the demo prints its URLs")
                .unwrap()
                .expect("the demo exited");
            let url = |prefix: &str| {
                let rest = line.trim().strip_prefix(prefix)?.trim_start();
                let rest = rest.strip_prefix("http://")?;
                Some(rest.split('/').next()?.to_owned())
            };
            public = public.or_else(|| url("OpenAI endpoint:"));
            admin = admin.or_else(|| url("admin:"));
        }
        // The rest of what it prints is not read: let it go nowhere.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            public: public.unwrap(),
            admin: admin.unwrap(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_and_codex_complete_through_the_demo_as_shipped() {
    let mut demo = Demo::start().await;
    let target = Target {
        url: format!("http://{}", demo.public),
        key: "unused",
    };
    let admin = demo.admin.clone();
    let answered = || {
        let admin = admin.clone();
        async move {
            requests_by_reason(&admin)
                .await
                .iter()
                .map(|(_, n)| n)
                .sum::<u64>()
        }
    };
    let before = answered().await;
    let claude = claude_result(&claude(&target, CLAUDE_PROMPT).await);
    let codex = codex_result(&codex(&target, CODEX_PROMPT).await);
    assert!(!claude.0.is_empty() && !codex.0.is_empty());
    assert!(answered().await >= before + 4, "two round trips");
    routed_by_utility(&demo.admin).await;
    demo.child.kill().await.unwrap();
}

/// A tenant with one key, its tokens counted (a limit far above the test's use).
async fn tenants(dir: &Path) -> Arc<Tenants> {
    let doc = json!({"version": 1, "tenants": [{"id": "agents",
        "key_sha256": [quantrouter_policy::hash_key(TENANT_KEY)],
        "limits": {"tokens_per_minute": 100_000_000}}]});
    support::file_tenants(dir, &doc).await
}

/// The tenant's tokens counted this minute, from `/admin/tenants`.
async fn charged(t: &Tiers) -> u64 {
    let url = format!("http://{}/admin/tenants", t.router.admin_addr());
    let report = send(&client(), "GET", &url, "", &[]).await.json();
    report["tenants"][0]["usage"]["tokens_this_minute"]
        .as_u64()
        .unwrap_or_else(|| panic!("{report}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_and_codex_complete_translated_and_natively_charged_as_they_report() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = tenants(dir.path()).await;
    for native in [false, true] {
        let t = support::agent_tiers(native, |c| c.tenants = Some(Arc::clone(&tenants))).await;
        let target = Target {
            url: format!("http://{}", t.router.public_addr()),
            key: TENANT_KEY,
        };
        let requests = || (0..3).map(|p| t.requests(p)).sum::<u64>();
        let start = charged(&t).await;
        let [by_claude, by_codex] = both_complete(&target, requests).await;
        // Settled when each answer's body ended: what both clients reported, exactly.
        let reported = by_claude.1 + by_codex.1;
        let settled = eventually(Duration::from_secs(10), || async {
            charged(&t).await == start + reported
        })
        .await;
        assert!(
            settled,
            "native={native}: charged {} for the {reported} tokens the clients reported",
            charged(&t).await - start
        );
        routed_by_utility(&t.router.admin_addr().to_string()).await;

        if native {
            continue;
        }
        // A wrong key: refused with `x-should-retry: false`, so neither client retries.
        let wrong = Target {
            url: target.url.clone(),
            key: "sk-wrong",
        };
        let before = requests();
        for (name, run) in [
            ("claude", claude(&wrong, "Say hello").await),
            ("codex", codex(&wrong, "Say hello").await),
        ] {
            assert!(!run.ok, "{name} succeeded with a wrong key: {}", run.stdout);
            assert!(
                run.took < Duration::from_secs(15),
                "{name} took {:?} to give up",
                run.took
            );
        }
        assert_eq!(requests(), before, "a refused key reaches no upstream");
    }
}
