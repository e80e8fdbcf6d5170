//! `docs/metrics.md` lists exactly the metrics `/metrics` exports: traffic here touches every
//! documented metric, then the two name sets must be equal.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use quantrouter::profiles::{self, FileSource};
use support::{chat, eventually, Tiers, SIMPLE};
use vllm_sim::{Faults, SimConfig};

const INT4: usize = 2;
const FP16: usize = 0;

/// Documented names: all of them, or only those that need no optional feature.
fn documented(include_optional: bool) -> BTreeSet<String> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/metrics.md"
    ))
    .unwrap();
    doc.lines()
        .filter(|l| include_optional || !l.contains("| Only with"))
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|name| name.starts_with("quantrouter_"))
        .map(str::to_owned)
        .collect()
}

fn exported(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .filter(|name| name.starts_with("quantrouter_"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_list_exactly_the_exported_metrics() {
    let t = Tiers::start(
        [1, 1, 2],
        |i| SimConfig {
            itl: Duration::from_millis(if i == FP16 { 30 } else { 0 }),
            ..SimConfig::default()
        },
        |set| {
            set.profiles[FP16].max_concurrency = 1;
            // By load alone, the failing int4 endpoint gets the first attempt: a retry.
            if let quantrouter_policy::Upstream::Static(upstream) = &mut set.profiles[INT4].upstream
            {
                upstream.balance = Some(quantrouter_policy::Balance::LeastLoad);
            }
        },
        |c| {
            c.resilience.scrape_interval = Duration::from_millis(50);
            c.resilience.admission.queue_timeout = Duration::from_millis(50);
        },
    )
    .await;
    // Retries and upstream errors: one int4 endpoint fails; quality fallback: the other
    // answers degenerately.
    t.sims[INT4][0].set_faults(Faults {
        error_rate: 1.0,
        ..Faults::default()
    });
    t.sims[INT4][1].set_faults(Faults {
        degenerate: true,
        ..Faults::default()
    });
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.header("x-quantrouter-reason"), "fallback_quality");
    // A router error.
    let r = t.post("{\"model\": 1}", &[]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    // A stream whose upstream breaks after three events: resumed.
    t.sims[INT4][1].set_faults(Faults {
        reset_after_chunks: Some(3),
        ..Faults::default()
    });
    let r = t.post(&support::simple_stream(8), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    // Admission: one slot on fp16, concurrent pinned requests.
    let t = Arc::new(t);
    let pinned = chat("llama8b-fp16", SIMPLE).replace("\"max_tokens\":8", "\"max_tokens\":20");
    let burst: Vec<_> = (0..6)
        .map(|_| {
            let (t, body) = (Arc::clone(&t), pinned.clone());
            tokio::spawn(async move { t.post(&body, &[]).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in burst {
        statuses.push(task.await.unwrap());
    }
    assert!(
        statuses.contains(&StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
    // A profile reload (rejected) from a watched file.
    let dir = tempfile::Builder::new()
        .prefix("qr-metrics-doc-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("profiles.json");
    std::fs::write(&path, quantrouter_policy::DEFAULT_PROFILE_SET).unwrap();
    let watched = profiles::start(vec![Arc::new(FileSource {
        path: path.clone(),
        interval: Duration::from_millis(20),
    })])
    .await
    .unwrap();
    std::fs::write(&path, "{\"version\": 2}").unwrap();
    // A classifier reload (rejected) from a watched file.
    let model = dir.path().join("classifier.json");
    std::fs::write(&model, quantrouter_policy::DEFAULT_CLASSIFIER).unwrap();
    let classifier = quantrouter::classifier::start(quantrouter::classifier::ClassifierConfig {
        file: Some(model.clone()),
        off: false,
        file_interval: Duration::from_millis(20),
        redis: None,
        redis_poll: Duration::from_secs(1),
    })
    .await
    .unwrap();
    std::fs::write(&model, "{}").unwrap();

    let url = format!("http://{}/metrics", t.router.admin_addr());
    let want = documented(false);
    let all = documented(true);
    let page = || async {
        let reply = support::send(&support::client(), "GET", &url, "", &[]).await;
        String::from_utf8_lossy(&reply.body).into_owned()
    };
    let complete = eventually(Duration::from_secs(5), || async {
        want.is_subset(&exported(&page().await))
    })
    .await;
    let page = page().await;
    let got = exported(&page);
    assert!(
        complete,
        "documented but never exported: {:?}",
        want.difference(&got).collect::<Vec<_>>()
    );
    assert!(
        got.is_subset(&all),
        "exported but not documented: {:?}",
        got.difference(&all).collect::<Vec<_>>()
    );
    let clashing: BTreeSet<&str> = page
        .lines()
        .filter(|l| l.starts_with("quantrouter_"))
        .flat_map(label_names)
        .filter(|name| SCRAPE_TARGET_LABELS.contains(name))
        .collect();
    assert!(
        clashing.is_empty(),
        "labels a ServiceMonitor or PodMonitor overwrites: {clashing:?}"
    );
    for task in watched.tasks.into_iter().chain(classifier.tasks) {
        task.abort();
    }
}

/// Labels the Prometheus Operator's monitors set on every scraped series; a series' own label
/// of that name would arrive renamed `exported_<name>` (the chart does not honor labels).
const SCRAPE_TARGET_LABELS: [&str; 7] = [
    "endpoint",
    "namespace",
    "pod",
    "service",
    "job",
    "instance",
    "container",
];

/// The label names of one sample line.
fn label_names(line: &str) -> Vec<&str> {
    let Some((_, mut labels)) = line.split_once('{') else {
        return Vec::new();
    };
    let mut names = Vec::new();
    while let Some((name, value)) = labels.split_once("=\"") {
        names.push(name);
        let Some(len) = label_value_len(value) else {
            break;
        };
        labels = value[len + 1..].trim_start_matches(',');
    }
    names
}

/// Profile ids are free text: a quote or backslash in one reaches label values of the cost,
/// circuit and request series, and the exporter must escape every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_id_with_quotes_and_backslashes_keeps_the_page_parseable() {
    const ODD: &str = "odd \"quoted\" \\ id";
    let t = Tiers::start(
        [1, 1, 1],
        |_| SimConfig::default(),
        |set| {
            for profile in &mut set.profiles {
                profile.id = format!("{}-{ODD}", profile.id);
            }
            set.default_profile = format!("{}-{ODD}", set.default_profile);
            set.policy.calibration = None;
        },
        |_| {},
    )
    .await;
    let r = t.post(&chat("auto", SIMPLE), &[]).await;
    assert_eq!(r.status, StatusCode::OK);

    let url = format!("http://{}/metrics", t.router.admin_addr());
    let page = || async {
        let reply = support::send(&support::client(), "GET", &url, "", &[]).await;
        String::from_utf8_lossy(&reply.body).into_owned()
    };
    // The escaped id in a cost series: the usage was counted through the exporter.
    let escaped = "odd \\\"quoted\\\" \\\\ id";
    let counted = eventually(Duration::from_secs(5), || async {
        page()
            .await
            .lines()
            .any(|l| l.starts_with("quantrouter_cost_usd_total{") && l.contains(escaped))
    })
    .await;
    let page = page().await;
    assert!(counted, "no cost series for the odd profile id:\n{page}");
    for line in page.lines() {
        assert!(is_exposition_line(line), "not exposition format: {line:?}");
    }
}

/// One line of the Prometheus text format (0.0.4): blank, a comment, or
/// `name{label="value",...} number [timestamp]`, with `\\`, `\"` and `\n` the only escapes
/// in a value.
fn is_exposition_line(line: &str) -> bool {
    if line.is_empty() || line.starts_with('#') {
        return true;
    }
    let name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let name_end = line.find(|c| !name_char(c)).unwrap_or(line.len());
    if name_end == 0 || line.starts_with(|c: char| c.is_ascii_digit()) {
        return false;
    }
    let mut rest = &line[name_end..];
    if let Some(mut labels) = rest.strip_prefix('{') {
        loop {
            let Some((key, value)) = labels.split_once("=\"") else {
                return false;
            };
            if key.is_empty() || !key.chars().all(name_char) {
                return false;
            }
            let Some(len) = label_value_len(value) else {
                return false;
            };
            let after = &value[len + 1..];
            if let Some(next) = after.strip_prefix(',') {
                labels = next;
            } else if let Some(end) = after.strip_prefix('}') {
                rest = end;
                break;
            } else {
                return false;
            }
        }
    }
    let Some(sample) = rest.strip_prefix(' ') else {
        return false;
    };
    let mut parts = sample.split(' ');
    let value_ok = parts.next().is_some_and(|v| v.parse::<f64>().is_ok());
    let timestamp_ok = parts.next().is_none_or(|t| t.parse::<i64>().is_ok());
    value_ok && timestamp_ok && parts.next().is_none()
}

/// The length of a label value up to its closing quote; `None` if an escape is invalid or
/// the quote never comes.
fn label_value_len(value: &str) -> Option<usize> {
    let mut chars = value.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some(i),
            '\\' => match chars.next() {
                Some((_, '\\' | '"' | 'n')) => {}
                _ => return None,
            },
            '\n' => return None,
            _ => {}
        }
    }
    None
}
