//! `gateway`: quantrouter as the endpoint picker of a real Envoy (ext_proc, the repository's
//! `manifests/envoy/envoy.yaml`) — without tenants, and with a tenant whose limits are
//! counted in Redis — against quantrouter as the proxy and a plain Envoy relay, all in one
//! run, in front of one zero-latency simulator.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::overhead::{CpuUse, TENANTS, TENANT_KEY};
use super::process::{free_port, which, Proc};
use super::services::{single_profile, Server};
use super::{write_json, write_section, Load, Suite, Target};
use crate::markdown::{runs_table, signed_ms};
use crate::report::RunReport;
use crate::run::LoadMode;
use crate::scenario::Scenario;

/// The Envoy configuration the picker is measured with: the one users start from.
const EXAMPLE: &str = "manifests/envoy/envoy.yaml";

/// The targets, in table order.
const TARGETS: [&str; 5] = [
    "direct",
    "quantrouter",
    "envoy",
    "envoy+quantrouter-epp",
    "envoy+quantrouter-epp-tenants",
];

/// The plain relay every picker run is held against.
const RELAY: &str = "envoy";

/// The facts besides the run files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GatewayFacts {
    /// Envoy's version line.
    pub envoy: String,
    /// Per load (`rate200`, `c32`) and target: CPU of every process serving it.
    pub cpu: BTreeMap<String, BTreeMap<String, CpuUse>>,
    /// Rounds of paired runs at 200 req/s.
    pub paired_rounds: u32,
}

/// Envoy: `envoy` on the PATH, else the repository's `.tools/bin/envoy`
/// (`scripts/install-tools envoy`).
fn envoy_binary() -> Option<PathBuf> {
    which("envoy").or_else(|| {
        let installed = PathBuf::from(".tools/bin/envoy");
        installed.is_file().then_some(installed)
    })
}

/// A plain relay: one listener, one static cluster, the router filter only.
fn relay_config(listen: u16, admin: u16, upstream: u16) -> String {
    format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
    - name: relay
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: relay
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: "/" }}
                          route: {{ cluster: sim, timeout: 600s }}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: sim
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: sim
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {upstream} }} }}
"#
    )
}

/// The example configuration on free ports, its picker at `epp`.
fn picker_config(listen: u16, admin: u16, epp: u16) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(EXAMPLE)
        .with_context(|| format!("cannot read {EXAMPLE} (run from the repository's root)"))?;
    let edits = [
        ("port_value: 8081", format!("port_value: {listen}")),
        ("port_value: 9901", format!("port_value: {admin}")),
        ("port_value: 9002", format!("port_value: {epp}")),
        ("address: 0.0.0.0", "address: 127.0.0.1".to_owned()),
    ];
    edits.into_iter().try_fold(text, |text, (from, to)| {
        anyhow::ensure!(text.contains(from), "{EXAMPLE} has no `{from}`");
        Ok(text.replace(from, &to))
    })
}

impl Suite {
    /// Envoy with `config`, ready when its admin port says so.
    async fn start_envoy(
        &self,
        name: &str,
        envoy: &Path,
        config: &str,
        listen: u16,
        admin: u16,
    ) -> anyhow::Result<Server> {
        let file = self.work().join(format!("{name}.yaml"));
        std::fs::write(&file, config)?;
        let file = file.to_string_lossy().into_owned();
        // Envoy's default worker count is one per CPU, as the router's.
        let args = ["-c", &file, "--disable-hot-restart", "-l", "warning"];
        let mut proc = self.spawn_target(name, envoy, &args, &[])?;
        let timeout = Duration::from_secs(self.options.ready_timeout_s);
        proc.wait_ready(&format!("http://127.0.0.1:{admin}/ready"), timeout)
            .await?;
        Ok(Server {
            proc,
            url: format!("http://127.0.0.1:{listen}"),
            admin_url: format!("http://127.0.0.1:{admin}"),
        })
    }
}

/// A router serving the endpoint picker (`--epp-listen`, with `args`), and an Envoy with the
/// example configuration in front of it.
async fn start_picker(
    suite: &Suite,
    envoy: &Path,
    profiles: &Path,
    args: &[&str],
) -> anyhow::Result<(Server, Server)> {
    let tenants = !args.is_empty();
    let epp_port = free_port()?;
    let epp_listen = format!("127.0.0.1:{epp_port}");
    let mut all = vec!["--epp-listen", epp_listen.as_str()];
    all.extend_from_slice(args);
    let name = if tenants {
        "quantrouter-epp-tenants"
    } else {
        "quantrouter-epp"
    };
    let picker = suite.start_router(name, profiles, &all, &[]).await?;
    let (port, admin) = (free_port()?, free_port()?);
    let config = picker_config(port, admin, epp_port)?;
    let name = if tenants {
        "envoy-epp-tenants"
    } else {
        "envoy-epp"
    };
    let gateway = suite.start_envoy(name, envoy, &config, port, admin).await?;
    Ok((picker, gateway))
}

/// CPU of each of `procs` while `run` goes on, from the end of its warm-up.
async fn with_cpu<F: std::future::Future<Output = anyhow::Result<RunReport>>>(
    run: F,
    warmup: Duration,
    procs: &[&Proc],
) -> anyhow::Result<(RunReport, Vec<f64>)> {
    let each = |procs: &[&Proc]| procs.iter().map(|p| p.cpu().seconds).collect::<Vec<_>>();
    let start = async {
        tokio::time::sleep(warmup).await;
        each(procs)
    };
    let (report, start) = tokio::join!(run, start);
    let used = each(procs)
        .into_iter()
        .zip(start)
        .map(|(end, start)| end - start)
        .collect();
    Ok((report?, used))
}

/// Runs the scenario and returns its section.
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let envoy = envoy_binary().context(
        "the gateway scenario needs Envoy: `scripts/install-tools envoy` (into .tools/bin)",
    )?;
    let dir = suite.scenario_dir("gateway")?;
    let sim = suite
        .start_sim("sim", "sim-model", (0, 0), 1024, None)
        .await?;
    let profiles = suite.write_profiles(
        "gateway-profiles.json",
        1,
        "sim",
        json!({}),
        &[single_profile(&sim.url, (10, 1), 4096)],
    )?;
    let router = suite
        .start_router("quantrouter", &profiles, &[], &[])
        .await?;
    let (picker, gateway) = start_picker(suite, &envoy, &profiles, &[]).await?;
    // The same with a tenant whose limits are counted in Redis: every answer's body then
    // streams through the picker, for the usage its limits count.
    let (redis, redis_url) = suite
        .redis_with_tenants("gateway-tenants.json", TENANTS)
        .await?;
    let (picker_tenants, gateway_tenants) =
        start_picker(suite, &envoy, &profiles, &["--redis-url", &redis_url]).await?;
    let (relay_port, relay_admin) = (free_port()?, free_port()?);
    let relay = suite
        .start_envoy(
            "envoy",
            &envoy,
            &relay_config(relay_port, relay_admin, sim.port),
            relay_port,
            relay_admin,
        )
        .await?;
    let version = tokio::process::Command::new(&envoy)
        .arg("--version")
        .output()
        .await?;
    let mut facts = GatewayFacts {
        // `<path>  version: <commit>/<version>/<status>/<build>/<TLS>`: the part after the path.
        envoy: String::from_utf8_lossy(&version.stdout)
            .rsplit("version: ")
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned(),
        paired_rounds: suite.options.paired_rounds,
        ..GatewayFacts::default()
    };
    let targets: Vec<(Target, Vec<&Proc>)> = vec![
        (Target::new(TARGETS[0], &sim.url, "sim-model"), vec![]),
        (
            Target::new(TARGETS[1], &router.url, "auto"),
            vec![&router.proc],
        ),
        (
            Target::new(TARGETS[2], &relay.url, "sim-model"),
            vec![&relay.proc],
        ),
        (
            Target::new(TARGETS[3], &gateway.url, "auto"),
            vec![&gateway.proc, &picker.proc],
        ),
        (
            Target::new(TARGETS[4], &gateway_tenants.url, "auto").with_api_key(TENANT_KEY),
            vec![&gateway_tenants.proc, &picker_tenants.proc],
        ),
    ];
    let common = |mode: LoadMode| {
        Load::new(Scenario::Overhead, mode, suite.duration())
            .warmup(suite.warmup())
            .max_outstanding(2000)
    };
    for (prefix, mode) in [
        ("rate200", LoadMode::Rate(200.0)),
        ("c32", LoadMode::Concurrency(32)),
    ] {
        for (target, procs) in &targets {
            suite.settle().await;
            let load = common(mode);
            let out = dir.join(format!("{prefix}-{}.json", target.name));
            let (report, seconds) = with_cpu(
                suite.run_load(&target.name, target, &load, &out),
                load.warmup,
                procs,
            )
            .await?;
            if !procs.is_empty() {
                let by_target = facts.cpu.entry(prefix.to_owned()).or_default();
                let answered = report.ok;
                let total = seconds.iter().sum();
                by_target.insert(
                    target.name.clone(),
                    CpuUse {
                        seconds: total,
                        answered,
                    },
                );
                // A picker run's Envoy on its own: what ext_proc costs Envoy, whatever the
                // picker does.
                if let [envoy, _picker] = seconds[..] {
                    let key = format!("{}/envoy", target.name);
                    by_target.insert(
                        key,
                        CpuUse {
                            seconds: envoy,
                            answered,
                        },
                    );
                }
            }
        }
    }
    // Paired, as in `overhead`: each target beside a direct run of its own in one window, so
    // the machine's drift between runs cancels out of the added latency.
    let direct = targets[0].0.clone();
    for round in 1..=suite.options.paired_rounds {
        for (target, _) in &targets[1..] {
            suite.settle().await;
            let load = common(LoadMode::Rate(200.0));
            let beside = dir.join(format!("paired-{round}-{}-direct.json", target.name));
            let out = dir.join(format!("paired-{round}-{}.json", target.name));
            let (direct_report, report) = tokio::join!(
                suite.run_load("direct", &direct, &load, &beside),
                suite.run_load(&target.name, target, &load, &out),
            );
            direct_report?;
            report?;
        }
    }
    write_json(&dir.join("facts.json"), &facts)?;
    drop(targets);
    for server in [
        gateway,
        gateway_tenants,
        relay,
        picker,
        picker_tenants,
        router,
    ] {
        server.proc.kill().await;
    }
    redis.kill().await;
    sim.proc.kill().await;
    write_section(&dir, render(suite, &dir, &facts)?)
}

/// A paired target's added p50 and p99, median of the rounds (the lower middle).
fn paired_medians(dir: &Path, name: &str, rounds: u32) -> anyhow::Result<Option<(i64, i64)>> {
    let mut p50 = Vec::new();
    let mut p99 = Vec::new();
    for round in 1..=rounds {
        let run = RunReport::read_json(&dir.join(format!("paired-{round}-{name}.json")))?;
        let beside = RunReport::read_json(&dir.join(format!("paired-{round}-{name}-direct.json")))?;
        let added = crate::compare::compare(&beside, &run).added_latency_us;
        p50.push(added.p50);
        p99.push(added.p99);
    }
    p50.sort_unstable();
    p99.sort_unstable();
    let median = |v: &[i64]| v.get(v.len().saturating_sub(1) / 2).copied();
    Ok(median(&p50).zip(median(&p99)))
}

/// Each picker run against the plain relay of the same run: CPU per request and throughput
/// at 32 clients as ratios, and the added p50 at 200 req/s as a difference.
fn against_relay(dir: &Path, facts: &GatewayFacts) -> anyhow::Result<String> {
    let cpu = |name: &str| {
        let c = facts.cpu.get("c32")?.get(name)?;
        (c.answered > 0).then(|| c.seconds / c.answered as f64)
    };
    let throughput = |name: &str| -> anyhow::Result<f64> {
        Ok(RunReport::read_json(&dir.join(format!("c32-{name}.json")))?.throughput_rps)
    };
    let p50 = |name: &str| -> anyhow::Result<Option<i64>> {
        Ok(paired_medians(dir, name, facts.paired_rounds)?.map(|(p50, _)| p50))
    };
    let mut out = String::from(
        "\n**Envoy plus the picker against Envoy alone, same run** (the second column: the\n\
         picker run's Envoy process alone)\n\n\
         | run | CPU per request, 32 clients | of which Envoy's | throughput, 32 clients | added p50 at 200 req/s |\n\
         |---|---|---|---|---|\n",
    );
    let (relay_cpu, relay_rps, relay_p50) = (cpu(RELAY), throughput(RELAY)?, p50(RELAY)?);
    for name in &TARGETS[3..] {
        let ratio = |a: Option<f64>, b: Option<f64>| match a.zip(b) {
            Some((a, b)) if b > 0.0 => format!("{:.2}×", a / b),
            _ => "n/a".to_owned(),
        };
        let more = match p50(name)?.zip(relay_p50) {
            Some((p50, relay)) => signed_ms(p50 - relay),
            None => "n/a".to_owned(),
        };
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {more} |",
            ratio(cpu(name), relay_cpu),
            ratio(cpu(&format!("{name}/envoy")), relay_cpu),
            ratio(Some(throughput(name)?), Some(relay_rps))
        );
    }
    Ok(out)
}

fn render(suite: &Suite, dir: &Path, facts: &GatewayFacts) -> anyhow::Result<String> {
    let mut out = suite.command("gateway");
    out.push_str(&suite.machine());
    let _ = writeln!(
        out,
        "Envoy: {}. Zero-latency vllm-sim, max_tokens 16, non-streamed. `envoy` is a plain\n\
         relay (router filter, one static cluster); `envoy+quantrouter-epp` is Envoy with\n\
         `{EXAMPLE}` (the request body buffered, the answer's head only unless its books\n\
         need its body, ORIGINAL_DST on the picker's header) and `quantrouter serve\n\
         --epp-listen`; `-tenants` is the same with a tenant whose limits are counted in Redis\n\
         (every answer's body then streams through the picker). A picker run's CPU is Envoy's\n\
         and the router's together (not Redis').",
        facts.envoy
    );
    let mut summary = String::from(
        "\n| run | added p50 at 200 req/s | added p99 at 200 req/s | req/s, 32 clients | CPU per request, 200 req/s | CPU per request, 32 clients |\n\
         |---|---|---|---|---|---|\n",
    );
    for name in &TARGETS[1..] {
        let (p50, p99) = paired_medians(dir, name, facts.paired_rounds)?
            .map_or(("n/a".to_owned(), "n/a".to_owned()), |(p50, p99)| {
                (signed_ms(p50), signed_ms(p99))
            });
        let saturation = RunReport::read_json(&dir.join(format!("c32-{name}.json")))?;
        let cpu = |load: &str| {
            facts
                .cpu
                .get(load)
                .and_then(|by| by.get(*name))
                .filter(|c| c.answered > 0)
                .map_or("n/a".to_owned(), |c| {
                    format!("{:.0} µs", c.seconds * 1e6 / c.answered as f64)
                })
        };
        let _ = writeln!(
            summary,
            "| {name} | {p50} | {p99} | {:.0} | {} | {} |",
            saturation.throughput_rps,
            cpu("rate200"),
            cpu("c32")
        );
    }
    let _ = write!(
        out,
        "\n**Added latency (paired with direct in the same window, median of {} rounds),\n\
         saturation throughput and CPU per answered request**\n{summary}",
        facts.paired_rounds
    );
    out.push_str(&against_relay(dir, facts)?);
    for (prefix, heading) in [
        ("rate200", "**200 req/s, open loop**"),
        ("c32", "**32 concurrent clients, closed loop (saturation)**"),
    ] {
        let runs = TARGETS
            .iter()
            .map(|name| RunReport::read_json(&dir.join(format!("{prefix}-{name}.json"))))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let _ = write!(out, "\n{heading}\n\n{}", runs_table(&runs));
    }
    Ok(out)
}
