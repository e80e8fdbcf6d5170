#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The monitoring files: the dashboard is well-formed, the dashboard and the alerts use only
//! metric names the router exports, every dashboard query parses as PromQL, the plain rules
//! file (and the chart, which links it) is the PrometheusRule's spec, and every alert has a test.

#[allow(dead_code)]
mod support;

use std::collections::{BTreeSet, HashSet};

use serde_json::Value;
use support::{helm_template, parse_yaml_documents, read, require, run, Tool};

/// The metric names of `docs/metrics.md`'s table: the list a router test keeps equal to what
/// `/metrics` exports, so the dashboard and alerts are checked against the real names.
fn metric_names() -> BTreeSet<String> {
    read("docs/metrics.md")
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .filter(|name| name.starts_with("quantrouter_"))
        .map(str::to_owned)
        .collect()
}

fn dashboard() -> Value {
    serde_json::from_str(&read("manifests/monitoring/dashboard.json"))
        .expect("dashboard.json is JSON")
}

/// Every panel, including those nested in collapsed rows.
fn panels(dashboard: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        all.push(panel);
        all.extend(panel["panels"].as_array().into_iter().flatten());
    }
    all
}

fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    panels(dashboard)
        .into_iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"].as_array().into_iter().flatten().map(move |t| {
                (
                    title.clone(),
                    t["expr"].as_str().expect("target expr").to_owned(),
                )
            })
        })
        .collect()
}

/// The alerting and recording rules of the PrometheusRule (the one source of the rules).
fn prometheus_rule() -> Value {
    let docs = parse_yaml_documents(&read("manifests/monitoring/prometheusrule.yaml")).unwrap();
    assert_eq!(docs.len(), 1);
    docs.into_iter().next().unwrap()
}

fn rules(rule: &Value) -> Vec<&Value> {
    rule["spec"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect()
}

/// Identifiers in a PromQL expression that can be metric names: outside string literals,
/// not followed by `(` (functions), not keywords.
fn metric_identifiers(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            // Skip the string literal (label values, regexes).
            i += 1;
            while i < chars.len() && chars[i] != c {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let preceded_by_digit = start > 0 && chars[start - 1].is_ascii_digit();
            if !preceded_by_digit {
                found.push(word);
            }
        } else {
            i += 1;
        }
    }
    found
}

/// Names in `expr` that start with `quantrouter_` and are not exported metrics. Histograms
/// (names ending in `_seconds` or `_score`) may be used with `_bucket`, `_sum`, `_count`.
fn unknown_metrics(
    expr: &str,
    names: &BTreeSet<String>,
    recorded: &HashSet<String>,
) -> Vec<String> {
    metric_identifiers(expr)
        .into_iter()
        .filter(|word| word.starts_with("quantrouter_") || word.contains(':'))
        .filter(|word| {
            if word.contains(':') {
                return !recorded.contains(word);
            }
            if names.contains(word) {
                return false;
            }
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| word.strip_suffix(s));
            !base.is_some_and(|b| {
                names.contains(b) && (b.ends_with("_seconds") || b.ends_with("_score"))
            })
        })
        .collect()
}

#[test]
fn the_documented_metric_names_are_found_and_well_formed() {
    let names = metric_names();
    assert!(
        names.len() >= 15,
        "docs/metrics.md lists the catalogue: {names:?}"
    );
    for name in &names {
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "{name}"
        );
    }
}

#[test]
fn the_metric_check_catches_unknown_names() {
    let names = metric_names();
    let none = HashSet::new();
    assert!(unknown_metrics("sum(rate(quantrouter_requests_total[5m]))", &names, &none).is_empty());
    assert!(unknown_metrics(
        "histogram_quantile(0.99, sum by (le) (rate(quantrouter_request_duration_seconds_bucket{tier=\"quantrouter_x\"}[5m])))",
        &names,
        &none
    )
    .is_empty());
    assert_eq!(
        unknown_metrics("sum(quantrouter_request_total)", &names, &none),
        ["quantrouter_request_total"]
    );
    // A counter has no _bucket series.
    assert_eq!(
        unknown_metrics("rate(quantrouter_requests_total_bucket[5m])", &names, &none),
        ["quantrouter_requests_total_bucket"]
    );
    assert_eq!(
        unknown_metrics("tier:quantrouter_latency:p99", &names, &none),
        ["tier:quantrouter_latency:p99"]
    );
}

#[test]
fn dashboard_and_alerts_use_only_exported_metric_names() {
    let names = metric_names();
    let rule = prometheus_rule();
    let recorded: HashSet<String> = rules(&rule)
        .iter()
        .filter_map(|r| r["record"].as_str().map(str::to_owned))
        .collect();
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    let exprs = dashboard_queries(&dashboard())
        .into_iter()
        .chain(rules(&rule).into_iter().map(|r| {
            let name = r["alert"]
                .as_str()
                .or(r["record"].as_str())
                .unwrap()
                .to_owned();
            (name, r["expr"].as_str().unwrap().to_owned())
        }));
    for (origin, expr) in exprs {
        for bad in unknown_metrics(&expr, &names, &recorded) {
            problems.push(format!("{origin}: {bad}"));
        }
        used.extend(
            metric_identifiers(&expr)
                .into_iter()
                .filter(|w| w.starts_with("quantrouter_")),
        );
    }
    assert!(
        problems.is_empty(),
        "names not in docs/metrics.md:\n{}",
        problems.join("\n")
    );
    // The dashboard and alerts together show the metrics that matter for operating the router.
    for needed in [
        "quantrouter_requests_total",
        "quantrouter_fallbacks_total",
        "quantrouter_queue_depth",
        "quantrouter_counterfactual_cost_usd_total",
        "quantrouter_profile_reloads_total",
        "quantrouter_redis_up",
        "quantrouter_circuit_state",
    ] {
        assert!(
            used.contains(needed),
            "{needed} is used by neither the dashboard nor the alerts"
        );
    }
}

#[test]
fn dashboard_panels_have_unique_ids_and_sane_grid_positions() {
    let dashboard = dashboard();
    assert!(dashboard["uid"].is_string() && dashboard["title"].is_string());
    let mut ids = HashSet::new();
    let mut cells: HashSet<(i64, i64)> = HashSet::new();
    for panel in panels(&dashboard) {
        let id = panel["id"].as_i64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        let grid = &panel["gridPos"];
        let (x, y, w, h) = (
            grid["x"].as_i64().expect("gridPos.x"),
            grid["y"].as_i64().expect("gridPos.y"),
            grid["w"].as_i64().expect("gridPos.w"),
            grid["h"].as_i64().expect("gridPos.h"),
        );
        assert!(
            x >= 0 && w > 0 && h > 0 && x + w <= 24,
            "panel {id}: gridPos {grid}"
        );
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(
                    cells.insert((cx, cy)),
                    "panel {id} overlaps another at ({cx}, {cy})"
                );
            }
        }
        if panel["type"] != "row" {
            let targets = panel["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "panel {id} has no query");
            let refs: HashSet<&str> = targets
                .iter()
                .map(|t| t["refId"].as_str().unwrap())
                .collect();
            assert_eq!(refs.len(), targets.len(), "panel {id}: duplicate refId");
        }
    }
}

/// Grafana's variables, replaced by values Prometheus accepts.
fn substitute_dashboard_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$namespace", ".*")
}

#[test]
fn dashboard_queries_parse_as_promql() {
    let Some(promtool) = require(Tool::Promtool) else {
        return;
    };
    let queries = dashboard_queries(&dashboard());
    assert!(queries.len() > 20);
    // Each query becomes a recording rule; `promtool check rules` parses every expression.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (title, expr)) in queries.iter().enumerate() {
        let expr = substitute_dashboard_variables(expr);
        assert!(
            !expr.contains('$'),
            "{title}: unsubstituted variable in {expr}"
        );
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    let dir = tempfile::Builder::new()
        .prefix("quantrouter-dashboard-")
        .tempdir()
        .unwrap();
    let file = dir.path().join("dashboard-rules.yaml");
    std::fs::write(&file, rules).unwrap();
    let result = run(&promtool, &["check", "rules", file.to_str().unwrap()]);
    result.unwrap_or_else(|e| panic!("a dashboard query does not parse:\n{e}"));
}

/// Labels a ServiceMonitor's scrape sets on every series, as the Prometheus Operator does.
const OPERATOR_TARGET_LABELS: &str = "container=\"quantrouter\",endpoint=\"admin\",\
    instance=\"10.1.0.5:9090\",job=\"quantrouter\",namespace=\"llm\",\
    pod=\"quantrouter-6c9f7-x2k4p\",service=\"quantrouter\"";

#[test]
fn the_open_circuit_panel_counts_every_open_upstream_under_the_operator() {
    let Some(promtool) = require(Tool::Promtool) else {
        return;
    };
    let queries = dashboard_queries(&dashboard());
    let (_, expr) = queries
        .iter()
        .find(|(_, expr)| expr.contains("quantrouter_circuit_state"))
        .expect("a panel of open circuits");
    let series = |upstream: &str, state: u8| {
        format!(
            "      - series: 'quantrouter_circuit_state{{{OPERATOR_TARGET_LABELS},\
             profile=\"llama8b-fp8\",upstream=\"{upstream}\"}}'\n        values: '{state}x5'\n"
        )
    };
    let test = format!(
        "rule_files: []\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n\
         {}{}{}    promql_expr_test:\n      - expr: {}\n        eval_time: 2m\n\
         \x20       exp_samples:\n          - labels: '{{profile=\"llama8b-fp8\"}}'\n\
         \x20           value: 2\n",
        series("http://10.0.0.7:8000", 2),
        series("http://10.0.0.8:8000", 2),
        series("http://10.0.0.9:8000", 0),
        serde_json::to_string(&substitute_dashboard_variables(expr)).unwrap(),
    );
    let dir = tempfile::Builder::new()
        .prefix("quantrouter-circuits-")
        .tempdir()
        .unwrap();
    let file = dir.path().join("circuits.test.yaml");
    std::fs::write(&file, &test).unwrap();
    let result = run(&promtool, &["test", "rules", file.to_str().unwrap()]);
    result.unwrap_or_else(|e| panic!("two open upstreams of one profile:\n{e}\n{test}"));
}

#[test]
fn promql_parse_check_rejects_a_broken_query() {
    let Some(promtool) = require(Tool::Promtool) else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("quantrouter-broken-")
        .tempdir()
        .unwrap();
    let file = dir.path().join("broken.yaml");
    std::fs::write(
        &file,
        "groups:\n  - name: g\n    rules:\n      - record: r:x\n        expr: sum(rate(x[5m])\n",
    )
    .unwrap();
    let result = run(&promtool, &["check", "rules", file.to_str().unwrap()]);
    assert!(
        result.is_err(),
        "promtool accepted an unbalanced parenthesis"
    );
}

#[test]
fn plain_rules_file_and_chart_copy_are_the_prometheusrule_spec() {
    let spec = prometheus_rule()["spec"].clone();
    for copy in [
        "manifests/monitoring/rules/quantrouter.rules.yaml",
        "charts/quantrouter/files/quantrouter.rules.yaml",
    ] {
        let docs = parse_yaml_documents(&read(copy)).unwrap();
        assert_eq!(
            docs,
            vec![spec.clone()],
            "{copy} is stale: run scripts/sync-deploy-files"
        );
    }
    let Some(helm) = require(Tool::Helm) else {
        return;
    };
    let render = helm_template(&helm, Some("charts/quantrouter/ci/all-on-values.yaml"));
    let rendered = render
        .of_kind("PrometheusRule")
        .next()
        .expect("all-on renders a PrometheusRule");
    assert_eq!(rendered["spec"], spec);
    let dashboard_cm = render
        .of_kind("ConfigMap")
        .find(|c| c["data"]["quantrouter.json"].is_string())
        .expect("all-on renders the dashboard ConfigMap");
    let embedded: Value =
        serde_json::from_str(dashboard_cm["data"]["quantrouter.json"].as_str().unwrap()).unwrap();
    assert_eq!(embedded, dashboard());
}

#[test]
fn every_alert_has_promtool_test_cases() {
    let tests = read("manifests/monitoring/tests/alerts.test.yaml");
    let tests: Value = serde_yaml_ng::from_str(&tests).unwrap();
    let tested: HashSet<&str> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .filter(|case| case["exp_alerts"].as_array().is_some_and(|a| !a.is_empty()))
        .filter_map(|case| case["alertname"].as_str())
        .collect();
    let rule = prometheus_rule();
    for alert in rules(&rule).iter().filter_map(|r| r["alert"].as_str()) {
        assert!(
            tested.contains(alert),
            "{alert} has no promtool test that expects it to fire"
        );
    }
}

#[test]
fn alerts_named_by_the_spec_exist() {
    let rule = prometheus_rule();
    let alerts: HashSet<&str> = rules(&rule)
        .iter()
        .filter_map(|r| r["alert"].as_str())
        .collect();
    for alert in [
        "FP16Overload",
        "QuantrouterFallbackRateHigh",
        "QuantrouterTierLatencyHigh",
        "QuantrouterLowTierLatencyHigh",
        "QuantrouterProfileDrift",
        "QuantrouterCircuitOpen",
        "QuantrouterProfileReloadRejected",
        "QuantrouterRedisDown",
    ] {
        assert!(alerts.contains(alert), "{alert} missing");
    }
}
