//! `soak`: many long streams opened at once, from HTTP/2 clients and from HTTP/1.1 clients;
//! the router's memory, CPU and descriptors sampled from `/proc` while they flow.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::time::Instant;

use super::process::{clock_ticks, raise_open_file_limit};
use super::services::single_profile;
use super::{write_json, write_section, Load, Suite, Target};
use crate::client::Transport;
use crate::markdown::runs_table;
use crate::report::RunReport;
use crate::run::LoadMode;
use crate::scenario::{Scenario, SOAK_TOKENS};

/// Client connections of the HTTP/2 phase (100 streams each at 10,000 streams, as from an
/// ingress or a sidecar).
const H2_CONNECTIONS: u32 = 100;
/// Descriptors kept back for everything but the streams' sockets.
const FD_RESERVE: u64 = 200;
/// How often the router is sampled.
const SAMPLE: Duration = Duration::from_secs(1);
/// The closed loop's window: shorter than a stream, so each client starts exactly one.
const WINDOW_MAX: Duration = Duration::from_secs(10);

/// One phase's facts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    /// `http2` or `http1`.
    pub name: String,
    /// Streams opened at once.
    pub streams: u64,
    /// Router RSS before the streams, KiB.
    pub router_rss_idle_kib: u64,
    /// Samples: seconds since the start, RSS KiB, CPU seconds, open descriptors.
    pub samples: Vec<Sample>,
}

/// One look at the router.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the streams started opening.
    pub t_s: f64,
    /// Resident memory, KiB.
    pub rss_kib: u64,
    /// CPU time so far, seconds.
    pub cpu_s: f64,
    /// Open descriptors.
    pub fds: u64,
}

/// What the soak scenario measured besides the run files.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SoakFacts {
    /// The open-file limit the phases ran under.
    pub nofile: u64,
    /// Kernel clock ticks per second (the resolution of the CPU samples).
    pub clock_ticks: u64,
    /// The phases, HTTP/2 first.
    pub phases: Vec<Phase>,
}

/// What a phase's samples come to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Highest RSS, KiB.
    pub peak_rss_kib: u64,
    /// Most descriptors open at once.
    pub peak_fds: u64,
    /// Cores used from the first sample to the first with the most descriptors open
    /// (streams opening and flowing).
    pub cores: f64,
}

/// Runs the scenario and returns its section.
pub async fn run(suite: &Suite) -> anyhow::Result<String> {
    let dir = suite.scenario_dir("soak")?;
    let nofile = raise_open_file_limit();
    let wanted = suite.options.soak_streams as u64;
    let mut facts = SoakFacts {
        nofile,
        clock_ticks: clock_ticks(),
        phases: Vec::new(),
    };
    // HTTP/2 clients: the router holds one upstream socket per stream and one per client
    // connection.
    let streams = nofile
        .saturating_sub(FD_RESERVE + u64::from(H2_CONNECTIONS))
        .min(wanted);
    let connections = u32::try_from(streams.clamp(1, u64::from(H2_CONNECTIONS)))?;
    facts.phases.push(
        phase(
            suite,
            &dir,
            "http2",
            streams,
            Transport::Http2 {
                connections: connections as usize,
            },
        )
        .await?,
    );
    // HTTP/1.1 clients: a client socket and an upstream socket per stream.
    let streams = (nofile.saturating_sub(FD_RESERVE) / 2).min(wanted);
    if streams < wanted {
        eprintln!(
            "suite: open-file limit is {nofile}: with HTTP/1.1 clients the router needs 2 per \
             stream, so {streams} streams instead of {wanted}"
        );
    }
    facts
        .phases
        .push(phase(suite, &dir, "http1", streams, Transport::Http1).await?);
    write_json(&dir.join("facts.json"), &facts)?;
    write_section(&dir, render(suite, &dir, &facts)?)
}

/// `streams` streams opened at once through a fresh router and simulator.
async fn phase(
    suite: &Suite,
    dir: &Path,
    name: &str,
    streams: u64,
    transport: Transport,
) -> anyhow::Result<Phase> {
    let streams_usize = usize::try_from(streams)?;
    let itl = suite.options.soak_itl_ms;
    // Every stream stays open across the sampling: it lasts SOAK_TOKENS × ITL (60 s at the
    // default pace, which is a reader's; at 100 tokens a second 10,000 streams would be a
    // million SSE events a second, more than a small machine moves while also running the
    // simulator and the load generator).
    let sim = suite
        .start_sim("sim", "sim-model", (50, itl), streams_usize + 1000, None)
        .await?;
    let profiles = suite.write_profiles(
        "soak-profiles.json",
        1,
        "sim",
        json!({}),
        &[single_profile(&sim.url, (50, itl), streams_usize * 2)],
    )?;
    let router = suite
        .start_router("quantrouter", &profiles, &[], &[])
        .await?;
    let stream_length = Duration::from_millis(itl * u64::from(SOAK_TOKENS));
    let window = suite.duration().min(WINDOW_MAX).min(stream_length / 2);
    let mut load = Load::new(Scenario::Soak, LoadMode::Concurrency(streams_usize), window)
        .timeout(stream_length * 4);
    load.connect_timeout = Duration::from_secs(30);
    load.transport = transport;
    let label = format!("quantrouter, {name} clients");
    let target = Target::new(&label, &router.url, "auto");
    let mut result = Phase {
        name: name.to_owned(),
        streams,
        router_rss_idle_kib: router.proc.rss_kib(),
        samples: Vec::new(),
    };
    let t0 = Instant::now();
    let out = dir.join(format!("{name}.json"));
    let run = suite.run_load(&label, &target, &load, &out);
    tokio::pin!(run);
    let mut ticks = tokio::time::interval(SAMPLE);
    loop {
        tokio::select! {
            report = &mut run => { report?; break; }
            _ = ticks.tick() => result.samples.push(Sample {
                t_s: t0.elapsed().as_secs_f64(),
                rss_kib: router.proc.rss_kib(),
                cpu_s: router.proc.cpu().seconds,
                fds: router.proc.open_fds(),
            }),
        }
    }
    router.proc.kill().await;
    sim.proc.kill().await;
    Ok(result)
}

/// Peak RSS and descriptors, and the cores used while the streams open and flow.
pub fn summarize(samples: &[Sample]) -> Summary {
    let mut peak_rss_kib = 0;
    let mut peak: Option<&Sample> = None;
    for sample in samples {
        peak_rss_kib = peak_rss_kib.max(sample.rss_kib);
        if peak.is_none_or(|p| sample.fds > p.fds) {
            peak = Some(sample);
        }
    }
    let cores = match (samples.first(), peak) {
        (Some(first), Some(peak)) if peak.t_s > first.t_s => {
            (peak.cpu_s - first.cpu_s) / (peak.t_s - first.t_s)
        }
        _ => 0.0,
    };
    Summary {
        peak_rss_kib,
        peak_fds: peak.map_or(0, |p| p.fds),
        cores,
    }
}

fn render(suite: &Suite, dir: &Path, facts: &SoakFacts) -> anyhow::Result<String> {
    let mut out = format!("```sh\nscripts/bench soak\n```\n\n{}", suite.machine());
    let _ = write!(
        out,
        "Streams opened all at once, max_tokens {SOAK_TOKENS} at {} ms/token from one vllm-sim: \
         once with\nHTTP/2 clients (h2c, {H2_CONNECTIONS} streams per connection, as from an \
         ingress or a sidecar), once\nwith HTTP/1.1 clients (a connection per stream; the \
         open-file limit of {} caps\nthose, as the router holds two descriptors per stream). \
         Router RSS, CPU and open\ndescriptors sampled once a second from `/proc`; CPU is \
         averaged from the first sample\nto the one with the most descriptors open (streams \
         opening and flowing).\n\n\
         | clients | streams | peak descriptors | router RSS idle | router RSS peak | per stream | router CPU (cores) | CPU per stream |\n\
         |---|---|---|---|---|---|---|---|\n",
        suite.options.soak_itl_ms, facts.nofile
    );
    for phase in &facts.phases {
        let summary = summarize(&phase.samples);
        let label = if phase.name == "http2" {
            format!("HTTP/2, {H2_CONNECTIONS} per connection")
        } else {
            "HTTP/1.1".to_owned()
        };
        let streams = phase.streams.max(1) as f64;
        let _ = writeln!(
            out,
            "| {label} | {} | {} | {:.1} MiB | **{:.1} MiB** | {:.1} KiB | {:.3} | {:.1} µs/s |",
            phase.streams,
            summary.peak_fds,
            phase.router_rss_idle_kib as f64 / 1024.0,
            summary.peak_rss_kib as f64 / 1024.0,
            summary
                .peak_rss_kib
                .saturating_sub(phase.router_rss_idle_kib) as f64
                / streams,
            summary.cores,
            summary.cores / streams * 1e6
        );
    }
    // One table per run: neither is the other's baseline.
    for phase in &facts.phases {
        let report = RunReport::read_json(&dir.join(format!("{}.json", phase.name)))?;
        let _ = write!(out, "\n{}", runs_table(&[report]));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, rss_kib: u64, cpu_s: f64, fds: u64) -> Sample {
        Sample {
            t_s,
            rss_kib,
            cpu_s,
            fds,
        }
    }

    #[test]
    fn cpu_is_averaged_up_to_the_first_sample_with_the_most_descriptors() {
        let samples = [
            sample(0.0, 9_000, 1.0, 20),
            sample(1.0, 50_000, 1.5, 5_000),
            sample(2.0, 90_000, 2.0, 10_100),
            sample(3.0, 95_000, 4.0, 10_100),
            sample(4.0, 40_000, 9.0, 300),
        ];
        let summary = summarize(&samples);
        assert_eq!(summary.peak_rss_kib, 95_000);
        assert_eq!(summary.peak_fds, 10_100);
        // (2.0 − 1.0) CPU seconds over 2 s, not up to the later tie or the drain.
        assert!((summary.cores - 0.5).abs() < 1e-9, "{summary:?}");
        assert_eq!(summarize(&[]).cores, 0.0);
    }
}
