//! `loadtest suite` and `loadtest ab` end to end, with very short windows: the real
//! `vllm-sim` and `quantrouter` binaries (built next to this one by `cargo test --workspace`;
//! with `-p loadtest` alone, `cargo build -p vllm-sim -p quantrouter` first), a real
//! redis-server for chaos. Checks what was started, driven and written — counts, files,
//! rows — never how fast.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use loadtest::RunReport;
use serde_json::Value;

/// The directory holding this package's `loadtest` and, beside it, the other binaries.
fn bin_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_loadtest"))
        .parent()
        .unwrap()
        .to_path_buf();
    for binary in ["vllm-sim", "quantrouter"] {
        assert!(
            dir.join(binary).is_file(),
            "{} is missing: cargo build -p vllm-sim -p quantrouter",
            dir.join(binary).display()
        );
    }
    dir
}

/// Runs `loadtest COMMAND args...` with short windows, no waiting for a quiet machine, no
/// alternatives, results under `results`.
fn loadtest(command: &str, results: &Path, args: &[&str]) -> Output {
    let output = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .arg(command)
        .args(args)
        .arg("--bin-dir")
        .arg(bin_dir())
        .args(["--settle-max-s", "0", "--no-alternatives", "--results"])
        .arg(results)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "loadtest {command} {args:?} failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn report(path: &Path) -> RunReport {
    RunReport::read_json(path).unwrap()
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn overhead_runs_every_target_and_writes_runs_facts_section_and_doc_block() {
    let temp = tempfile::tempdir().unwrap();
    let doc = temp.path().join("performance.md");
    std::fs::write(
        &doc,
        "hand-written\n<!-- bench:overhead:begin -->\nold table\n<!-- bench:overhead:end -->\n\
         between\n<!-- bench:soak:begin -->\nsoak table\n<!-- bench:soak:end -->\n",
    )
    .unwrap();
    let results = temp.path().join("results");
    let doc_arg = doc.to_str().unwrap();
    loadtest(
        "suite",
        &results,
        &[
            "overhead",
            "--duration-s",
            "0.5",
            "--warmup-s",
            "0",
            "--paired-rounds",
            "1",
            "--doc",
            doc_arg,
        ],
    );
    let dir = results.join("overhead");
    // The tenants-on router answers only with its tenant's key: its runs answering shows
    // the key was sent and its limits checked.
    let targets = [
        "direct",
        "quantrouter",
        "quantrouter-1-worker",
        "quantrouter-tenants",
    ];
    for load in ["rate200", "rate1000", "c32", "rate200-stream"] {
        for target in targets {
            let run = report(&dir.join(format!("{load}-{target}.json")));
            assert_eq!(run.label, target);
            assert!(run.ok > 0, "{load}-{target}: {run:?}");
        }
    }
    // 200 req/s for 0.5 s: the schedule fixes the count. Direct hits the simulator (no tier
    // header), the routed runs go through a router (its tier header on every answer).
    let direct = report(&dir.join("rate200-direct.json"));
    assert_eq!((direct.requests, direct.ok), (100, 100));
    assert!(direct.tiers.is_empty(), "{direct:?}");
    for routed in ["quantrouter", "quantrouter-1-worker", "quantrouter-tenants"] {
        let run = report(&dir.join(format!("rate200-{routed}.json")));
        assert_eq!(run.tiers.get("fp16"), Some(&run.ok), "{run:?}");
        assert_eq!(run.stream_share, 0.0);
    }
    assert_eq!(
        report(&dir.join("rate200-stream-quantrouter.json")).stream_share,
        1.0
    );
    for name in ["ratemax-direct", "ratemax-quantrouter"] {
        assert!(report(&dir.join(format!("{name}.json"))).ok > 0);
    }
    for name in ["quantrouter", "quantrouter-1-worker"] {
        assert!(dir.join(format!("paired-1-{name}.json")).is_file());
        assert!(dir.join(format!("paired-1-{name}-direct.json")).is_file());
    }

    let facts = json(&dir.join("facts.json"));
    assert_eq!(facts["targets"], serde_json::json!(targets));
    assert!(facts["max_rate"].as_u64().unwrap() >= 100, "{facts}");
    assert!(facts["router_rss_start_kib"].as_u64().unwrap() > 0);
    assert!(facts["rss_end_kib"]["quantrouter"].as_u64().unwrap() > 0);
    // CPU was measured for the routers, against their own answers, never for direct.
    let c32 = report(&dir.join("c32-quantrouter.json"));
    assert_eq!(facts["cpu"]["c32"]["quantrouter"]["answered"], c32.ok);
    assert!(facts["cpu"]["c32"].get("direct").is_none(), "{facts}");

    let section = read(&dir.join("section.md"));
    for row in [
        "| direct | 200 req/s | 100 / 100 |",
        "| quantrouter | 32 clients |",
        "| quantrouter-1-worker | 200 req/s, 100% streamed |",
        "| quantrouter | 1 | ",
        "| quantrouter-1-worker | 1 | ",
        "**Tenants on vs off**",
        "| tenants on | ",
        "**CPU per request**",
        "Router RSS:",
    ] {
        assert!(section.contains(row), "no {row:?} in\n{section}");
    }
    let doc = read(&doc);
    assert!(doc.starts_with("hand-written\n<!-- bench:overhead:begin -->\n```sh\n"));
    assert!(doc.contains(section.trim_end()), "{doc}");
    assert!(!doc.contains("old table"), "{doc}");
    assert!(doc.contains("between\n<!-- bench:soak:begin -->\nsoak table\n"));
}

#[test]
fn overload_refuses_past_the_tier_and_mixed_reads_the_routers_cost() {
    let temp = tempfile::tempdir().unwrap();
    let results = temp.path().join("results");
    let output = loadtest(
        "suite",
        &results,
        &[
            "overload",
            "mixed",
            "--duration-s",
            "0.5",
            "--warmup-s",
            "0",
            "--no-doc",
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.find("=== scenario overload") < stdout.find("=== scenario mixed"),
        "{stdout}"
    );

    let overload = results.join("overload");
    let facts = json(&overload.join("facts.json"));
    assert_eq!(
        (facts["capacity"].as_u64(), facts["rate"].as_u64()),
        (Some(95), Some(475))
    );
    assert!(facts["router_rss_peak_kib"].as_u64().unwrap() > 0);
    // 5× capacity: the router refuses the excess with 429 + Retry-After, direct queues it.
    let routed = report(&overload.join("quantrouter.json"));
    let refused = routed.errors.get("http_429").copied().unwrap_or(0);
    assert!(refused > 0, "{routed:?}");
    assert_eq!(routed.retry_after_429, refused);
    assert_eq!(routed.requests, 475);
    let direct = report(&overload.join("direct.json"));
    assert_eq!(direct.errors.get("http_429"), None, "{direct:?}");
    let section = read(&overload.join("section.md"));
    assert!(section.contains("| quantrouter | 475 | "), "{section}");
    assert!(section.contains("≈ 95 req/s"), "{section}");

    let mixed = results.join("mixed");
    let facts = json(&mixed.join("facts.json"));
    let cost = facts["cost_usd"].as_f64().unwrap();
    assert!(cost > 0.0, "{facts}");
    assert!(
        facts["counterfactual_usd"].as_f64().unwrap() >= cost,
        "{facts}"
    );
    assert_eq!(
        facts["targets"],
        serde_json::json!(["direct-fp16", "quantrouter"])
    );
    let routed = report(&mixed.join("quantrouter.json"));
    assert!(
        routed.ok > 0 && routed.tiers.values().sum::<u64>() >= routed.ok,
        "{routed:?}"
    );
    let section = read(&mixed.join("section.md"));
    assert!(
        section.contains("| quantrouter | int4 |") || section.contains("| quantrouter | fp16 |")
    );
    assert!(section.contains("% saved**"), "{section}");
}

#[test]
fn chaos_plays_its_timeline_against_redis_and_checks_every_answer() {
    let temp = tempfile::tempdir().unwrap();
    let results = temp.path().join("results");
    loadtest(
        "suite",
        &results,
        &[
            "chaos",
            "--duration-s",
            "0.5",
            "--warmup-s",
            "0",
            "--no-doc",
        ],
    );
    let dir = results.join("chaos");
    let facts = json(&dir.join("facts.json"));
    assert_eq!(facts["pushed"], 20, "{facts}");
    let events: Vec<String> = read(&dir.join("events.txt"))
        .lines()
        .map(|line| line.split_once(' ').unwrap().1.to_owned())
        .collect();
    assert_eq!(
        events[..10],
        [
            "SIGKILL fp16 endpoint b",
            "restarted fp16 endpoint b",
            "int4: 50% 503",
            "int4: faults cleared",
            "fp16 endpoint a: hang",
            "fp16 endpoint a: faults cleared",
            "pushed 20 profile sets",
            "SIGKILL redis-server",
            "restarted redis-server (empty)",
            "pushed profile set version 100 to the new redis",
        ]
    );
    assert!(events[10].starts_with("router's active profile version after the run: "));
    // 100 req/s for 6 × 0.5 s, every one accounted for.
    let run = report(&dir.join("quantrouter.json"));
    assert_eq!(run.requests, 300);
    let a = run.accounting;
    assert_eq!(a.sent, a.ok + a.well_formed_errors + a.lost, "{a:?}");
    let section = read(&dir.join("section.md"));
    assert!(section.contains("- t="), "{section}");
    assert!(section.contains("| quantrouter | 300 |"), "{section}");
}

#[test]
fn soak_holds_every_stream_open_at_once_over_http2_and_http1() {
    let temp = tempfile::tempdir().unwrap();
    let results = temp.path().join("results");
    // 300 tokens × 10 ms: each stream lasts 3 s, longer than the 0.5 s window, so each of
    // the 40 clients sends exactly one.
    loadtest(
        "suite",
        &results,
        &[
            "soak",
            "--duration-s",
            "0.5",
            "--soak-streams",
            "40",
            "--soak-itl-ms",
            "10",
            "--no-doc",
        ],
    );
    let dir = results.join("soak");
    for phase in ["http2", "http1"] {
        let run = report(&dir.join(format!("{phase}.json")));
        assert_eq!((run.requests, run.ok), (40, 40), "{phase}: {run:?}");
        assert_eq!(run.ttft_us.count, 40);
    }
    let facts = json(&dir.join("facts.json"));
    let phases = facts["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    for phase in phases {
        assert_eq!(phase["streams"], 40);
        let samples = phase["samples"].as_array().unwrap();
        assert!(!samples.is_empty(), "{phase}");
        assert!(samples.iter().all(|s| s["rss_kib"].as_u64().unwrap() > 0));
    }
    let section = read(&dir.join("section.md"));
    assert!(
        section.contains("| HTTP/2, 100 per connection | 40 | "),
        "{section}"
    );
    assert!(section.contains("| HTTP/1.1 | 40 | "), "{section}");
}

#[test]
fn ab_runs_every_build_in_each_round_with_its_flags_and_cpu() {
    let temp = tempfile::tempdir().unwrap();
    let results = temp.path().join("results");
    let router = bin_dir().join("quantrouter");
    let router = router.to_str().unwrap();
    let one_worker = format!("{router} --workers 1");
    let output = loadtest(
        "ab",
        &results,
        &[
            router,
            router,
            &one_worker,
            "--rounds",
            "2",
            "--duration-s",
            "0.3",
            "--warmup-s",
            "0",
            // Every machine has a CPU 0: the targets start through taskset and still answer.
            "--target-cpus",
            "0",
        ],
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(&format!("- C = `{one_worker}`")),
        "{stdout}"
    );
    for round in 1..=2 {
        for name in ["direct", "A", "B", "C"] {
            let run = report(&results.join("ab").join(format!("{name}-{round}.json")));
            assert_eq!(run.requests, 60, "{name}-{round}");
            let row = stdout
                .lines()
                .find(|line| line.starts_with(&format!("| {round} | {name} | ")))
                .unwrap_or_else(|| panic!("no row for {name} in round {round}:\n{stdout}"));
            // Direct has no process of its own; each build's CPU per request is measured.
            let cpu = row.trim_end_matches(" |").rsplit(" | ").next().unwrap();
            match name {
                "direct" => assert_eq!(cpu, "—", "{row}"),
                _ => assert!(cpu.ends_with(" µs"), "{row}"),
            }
        }
    }
}

#[test]
fn a_missing_binary_is_named_before_anything_starts() {
    let temp = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["suite", "overhead", "--bin-dir"])
        .arg(temp.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!(
            "{} is missing",
            temp.path().join("vllm-sim").display()
        )),
        "{stderr}"
    );
}
