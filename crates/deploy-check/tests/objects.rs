#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Every object the chart and the manifests render parses strictly into its Kubernetes type
//! (or validates against the vendored CRD schema), and the objects fit together: Services
//! select pods with the named ports, the router follows the flag and shutdown contract, the
//! tiers match the profile set, RBAC is read-only EndpointSlices, KEDA reads queue depth.

#[allow(dead_code)]
mod support;

use serde_json::{json, Value};
use support::{
    all_renders, args, check_object, flag, helm_template, kustomize, pod_spec, read, require,
    CrdSchemas, Rendered, Tool, NAMESPACE,
};

#[test]
fn every_rendered_object_parses_strictly() {
    let Some(renders) = all_renders() else { return };
    let crds = CrdSchemas::load();
    let mut failures = Vec::new();
    let mut count = 0;
    for render in &renders {
        assert!(
            !render.objects.is_empty(),
            "{} rendered nothing",
            render.source
        );
        for object in &render.objects {
            count += 1;
            if let Err(e) = check_object(object, &crds) {
                failures.push(format!(
                    "{}: {} {}: {e}",
                    render.source, object["kind"], object["metadata"]["name"]
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {count} objects failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// --- the checks themselves must bite ---------------------------------------------------------

fn deployment() -> Value {
    json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "x"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "x"}},
            "template": {
                "metadata": {"labels": {"app": "x"}},
                "spec": {"containers": [{"name": "x", "image": "x:1", "ports": [{"name": "http", "containerPort": 8080}]}]}
            }
        }
    })
}

#[test]
fn strict_parse_accepts_a_valid_object_and_rejects_unknown_fields_and_wrong_types() {
    let crds = CrdSchemas::load();
    check_object(&deployment(), &crds).unwrap();

    let mut typo = deployment();
    typo["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = json!({});
    let err = check_object(&typo, &crds).unwrap_err();
    assert!(err.contains("livenessProbes"), "{err}");

    let mut misplaced = deployment();
    misplaced["spec"]["terminationGracePeriodSeconds"] = json!(30);
    let err = check_object(&misplaced, &crds).unwrap_err();
    assert!(err.contains("terminationGracePeriodSeconds"), "{err}");

    let mut wrong_type = deployment();
    wrong_type["spec"]["replicas"] = json!("2");
    assert!(check_object(&wrong_type, &crds).is_err());

    let mut bad_meta = deployment();
    bad_meta["metadata"]["label"] = json!({"a": "b"});
    assert!(check_object(&bad_meta, &crds)
        .unwrap_err()
        .contains("label"));
}

fn scaled_object() -> Value {
    json!({
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "vllm-int4"},
        "spec": {
            "scaleTargetRef": {"name": "vllm-int4"},
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": "http://prometheus:9090",
                "query": "sum(quantrouter_queue_depth{tier=\"int4\"})",
                "threshold": "4"
            }}]
        }
    })
}

#[test]
fn crd_schemas_reject_unknown_fields_unquoted_metadata_and_missing_scaler_settings() {
    let crds = CrdSchemas::load();
    check_object(&scaled_object(), &crds).unwrap();

    let mut unknown = scaled_object();
    unknown["spec"]["minReplicas"] = json!(1);
    assert!(check_object(&unknown, &crds)
        .unwrap_err()
        .contains("minReplicas"));

    let mut number = scaled_object();
    number["spec"]["triggers"][0]["metadata"]["threshold"] = json!(4);
    assert!(
        check_object(&number, &crds).is_err(),
        "trigger metadata values are strings"
    );

    let mut no_query = scaled_object();
    no_query["spec"]["triggers"][0]["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("query");
    assert!(check_object(&no_query, &crds)
        .unwrap_err()
        .contains("query"));

    let mut bad_meta = scaled_object();
    bad_meta["metadata"]["namespcae"] = json!("llm");
    assert!(check_object(&bad_meta, &crds).is_err());

    let monitor = json!({
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "m"},
        "spec": {"selector": {"matchLabels": {"a": "b"}}, "endpoints": [{"port": "admin", "intervall": "15s"}]}
    });
    assert!(check_object(&monitor, &crds)
        .unwrap_err()
        .contains("intervall"));

    let rule = json!({
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "r"},
        "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": "five minutes"}]}]}
    });
    assert!(
        check_object(&rule, &crds).is_err(),
        "for must be a duration"
    );
}

#[test]
fn unknown_kinds_are_rejected() {
    let crds = CrdSchemas::load();
    let object = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {}});
    assert!(check_object(&object, &crds)
        .unwrap_err()
        .contains("unexpected kind"));
}

// --- the objects fit together -----------------------------------------------------------------

fn selector_matches(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|sel| !sel.is_empty() && sel.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

fn workloads(render: &Rendered) -> impl Iterator<Item = &Value> {
    render
        .objects
        .iter()
        .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
}

fn all_containers(pod: &Value) -> impl Iterator<Item = &Value> {
    let containers = pod["containers"].as_array().into_iter().flatten();
    let init = pod["initContainers"].as_array().into_iter().flatten();
    containers.chain(init)
}

#[test]
fn services_select_pods_that_have_their_named_ports_and_workload_selectors_match_templates() {
    let Some(renders) = all_renders() else { return };
    for render in &renders {
        for workload in workloads(render) {
            let name = &workload["metadata"]["name"];
            assert!(
                selector_matches(
                    &workload["spec"]["selector"]["matchLabels"],
                    &workload["spec"]["template"]["metadata"]["labels"]
                ),
                "{}: {name}: selector does not match its pod template",
                render.source
            );
        }
        for service in render.of_kind("Service") {
            let name = &service["metadata"]["name"];
            let pods: Vec<&Value> = workloads(render)
                .filter(|w| w["metadata"]["namespace"] == service["metadata"]["namespace"])
                .filter(|w| {
                    selector_matches(
                        &service["spec"]["selector"],
                        &w["spec"]["template"]["metadata"]["labels"],
                    )
                })
                .map(pod_spec)
                .collect();
            assert!(
                !pods.is_empty(),
                "{}: Service {name} selects no pod",
                render.source
            );
            for port in service["spec"]["ports"].as_array().unwrap() {
                let Some(target) = port["targetPort"].as_str() else {
                    continue;
                };
                for pod in &pods {
                    let found = all_containers(pod)
                        .flat_map(|c| c["ports"].as_array().into_iter().flatten())
                        .any(|p| p["name"] == target);
                    assert!(
                        found,
                        "{}: Service {name} targets port {target} no container has",
                        render.source
                    );
                }
            }
        }
        for monitor in render.of_kind("ServiceMonitor") {
            // Only checkable where the router Service is in the same render.
            let services: Vec<&Value> = render
                .of_kind("Service")
                .filter(|s| {
                    selector_matches(
                        &monitor["spec"]["selector"]["matchLabels"],
                        &s["metadata"]["labels"],
                    )
                })
                .collect();
            if render.of_kind("Service").next().is_some() {
                assert_eq!(
                    services.len(),
                    1,
                    "{}: ServiceMonitor must select the router Service",
                    render.source
                );
                let port = &monitor["spec"]["endpoints"][0]["port"];
                assert!(
                    services[0]["spec"]["ports"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|p| &p["name"] == port),
                    "{}: ServiceMonitor port {port} is not a Service port",
                    render.source
                );
            }
        }
    }
}

/// The router containers of a render: the gateway Deployment's, the sidecar patch's (as an
/// init container of the application's Deployment) and the chart's sidecar snippet.
fn router_containers(render: &Rendered) -> Vec<(Value, Value)> {
    let mut found = Vec::new();
    for workload in workloads(render) {
        let pod = pod_spec(workload);
        for container in all_containers(pod) {
            if container["name"] == "quantrouter" {
                found.push((pod.clone(), container.clone()));
            }
        }
    }
    for config_map in render.of_kind("ConfigMap") {
        if let Some(text) = config_map["data"]["pod-spec-patch.yaml"].as_str() {
            let pod: Value = serde_yaml_ng::from_str(text).unwrap();
            let container = pod["initContainers"][0].clone();
            found.push((pod, container));
        }
    }
    found
}

fn millis_to_seconds_ceil(ms: &str) -> i64 {
    (ms.parse::<i64>().unwrap() + 999) / 1000
}

/// The router container's args and `QUANTROUTER_*` variables are ones the router's own CLI
/// accepts: a renamed or misspelt flag in the chart fails here, not at pod start.
#[test]
fn router_args_and_env_parse_with_the_router_cli() {
    use clap::CommandFactory;
    let Some(renders) = all_renders() else { return };
    let command = quantrouter::cli::Cli::command();
    let serve = command.find_subcommand("serve").unwrap();
    let known_env: Vec<String> = serve
        .get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect();
    let mut checked = 0;
    for render in &renders {
        for (_, container) in router_containers(render) {
            checked += 1;
            let src = &render.source;
            let mut argv: Vec<std::ffi::OsString> = vec!["quantrouter".into(), "serve".into()];
            argv.extend(args(&container).into_iter().map(Into::into));
            if let Err(e) = quantrouter::cli::parse_with_config(argv) {
                panic!("{src}: the router CLI rejects the chart's args: {e}");
            }
            for env in container["env"].as_array().into_iter().flatten() {
                let name = env["name"].as_str().unwrap();
                if name.starts_with("QUANTROUTER_") {
                    assert!(known_env.iter().any(|k| k == name), "{src}: unknown {name}");
                }
            }
        }
    }
    assert!(checked > 0, "no router container found");
}

#[test]
fn router_follows_the_flag_probe_shutdown_and_security_contract() {
    let Some(renders) = all_renders() else { return };
    let mut checked = 0;
    for render in &renders {
        for (pod, container) in router_containers(render) {
            checked += 1;
            let src = &render.source;
            let a = args(&container);
            for required in [
                "--listen",
                "--admin-listen",
                "--profiles",
                "--redis-prefix",
                "--log-format",
                "--discovery",
                // Without it a pod with no CPU limit starts a thread per node core.
                "--workers",
            ] {
                assert!(
                    flag(&a, required).is_some(),
                    "{src}: router lacks {required}=...: {a:?}"
                );
            }
            assert_eq!(
                flag(&a, "--profiles"),
                Some("/etc/quantrouter/profiles.json"),
                "{src}"
            );
            assert!(
                flag(&a, "--admin-listen").unwrap().ends_with(":9090"),
                "{src}"
            );
            for file_flag in ["--api-keys-file", "--tenants"] {
                let Some(file) = flag(&a, file_flag) else {
                    continue;
                };
                let dir = file.rsplit_once('/').unwrap().0;
                assert!(
                    container["volumeMounts"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|m| m["mountPath"] == dir),
                    "{src}: {file_flag} {file} is not on a mounted volume"
                );
            }
            let mounts_profiles = container["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["mountPath"] == "/etc/quantrouter" && m.get("subPath").is_none());
            assert!(
                mounts_profiles,
                "{src}: profiles must be mounted as a directory (no subPath) at /etc/quantrouter"
            );

            // Probes on the admin port.
            let admin_port = container["ports"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["containerPort"] == 9090)
                .unwrap_or_else(|| panic!("{src}: no container port 9090"))["name"]
                .clone();
            assert_eq!(
                container["livenessProbe"]["httpGet"]["path"], "/healthz",
                "{src}"
            );
            assert_eq!(
                container["readinessProbe"]["httpGet"]["path"], "/readyz",
                "{src}"
            );
            assert_eq!(
                container["livenessProbe"]["httpGet"]["port"], admin_port,
                "{src}"
            );
            assert_eq!(
                container["readinessProbe"]["httpGet"]["port"], admin_port,
                "{src}"
            );

            // The kubelet must not kill the router before it may finish: preStop sleep, then
            // the router's delay and grace.
            let pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
                .as_i64()
                .unwrap_or(0);
            let delay = millis_to_seconds_ceil(
                flag(&a, "--shutdown-delay-ms").expect("--shutdown-delay-ms"),
            );
            let grace = millis_to_seconds_ceil(
                flag(&a, "--shutdown-grace-ms").expect("--shutdown-grace-ms"),
            );
            let period = pod["terminationGracePeriodSeconds"].as_i64().unwrap_or(30);
            assert!(
                period > pre_stop + delay + grace,
                "{src}: terminationGracePeriodSeconds {period} <= preStop {pre_stop} + delay {delay} + grace {grace}"
            );

            let sc = &container["securityContext"];
            assert_eq!(sc["runAsNonRoot"], true, "{src}");
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{src}");
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{src}");
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{src}");
            assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault", "{src}");
            assert!(
                container["resources"]["requests"].is_object(),
                "{src}: router without resource requests"
            );
        }
    }
    // gateway: default, all-on, 2 keda variants, overlay; sidecar: chart snippet + overlay.
    assert!(checked >= 7, "only {checked} router containers found");
}

#[test]
fn redis_url_password_comes_from_a_secret() {
    let Some(renders) = all_renders() else { return };
    for render in &renders {
        for (_, container) in router_containers(render) {
            let env = container["env"].as_array().cloned().unwrap_or_default();
            let Some(url) = env.iter().find(|e| e["name"] == "QUANTROUTER_REDIS_URL") else {
                continue;
            };
            if let Some(value) = url["value"].as_str() {
                let has_password = value.contains('@');
                if has_password {
                    assert!(
                        value.contains(":$(REDIS_PASSWORD)@"),
                        "{}: literal password in {value}",
                        render.source
                    );
                    let position = |name: &str| env.iter().position(|e| e["name"] == name);
                    let password = position("REDIS_PASSWORD")
                        .unwrap_or_else(|| panic!("{}: no REDIS_PASSWORD", render.source));
                    assert!(
                        password < position("QUANTROUTER_REDIS_URL").unwrap(),
                        "{}: $(REDIS_PASSWORD) must be defined before use",
                        render.source
                    );
                    assert!(
                        env[password]["valueFrom"]["secretKeyRef"].is_object(),
                        "{}",
                        render.source
                    );
                }
            } else {
                assert!(
                    url["valueFrom"]["secretKeyRef"].is_object(),
                    "{}",
                    render.source
                );
            }
        }
    }
}

/// `redis.sentinelPasswordSecret` gives the router the sentinels' own password from its
/// Secret, beside the URL's data password, never in its place.
#[test]
fn the_sentinels_password_comes_from_its_own_secret() {
    let Some(renders) = all_renders() else { return };
    let mut seen = 0;
    for render in &renders {
        for (_, container) in router_containers(render) {
            let env = container["env"].as_array().cloned().unwrap_or_default();
            let named = |name: &str| env.iter().find(|e| e["name"] == name).cloned();
            let Some(password) = named("QUANTROUTER_REDIS_SENTINEL_PASSWORD") else {
                continue;
            };
            seen += 1;
            let src = &render.source;
            assert!(password.get("value").is_none(), "{src}: a literal");
            assert_eq!(
                password["valueFrom"]["secretKeyRef"]["name"], "redis-sentinel",
                "{src}"
            );
            let url = named("QUANTROUTER_REDIS_URL").unwrap();
            let url = url["value"].as_str().unwrap_or_default();
            assert!(
                url.starts_with("redis+sentinel://:$(REDIS_PASSWORD)@"),
                "{src}: {url}"
            );
        }
    }
    assert!(seen > 0, "no render gives the sentinels their password");
}

/// `router.upstreamApiKeys` and `tierDefaults.apiKeySecret` put the upstream key into the
/// router and the vLLM tiers only through `secretKeyRef`, never as a literal.
#[test]
fn upstream_api_keys_come_from_secrets_in_router_and_tiers() {
    let Some(renders) = all_renders() else { return };
    let mut router_keys = 0;
    let mut tier_keys = 0;
    for render in &renders {
        let from_secret = |env: &Value, name: &str, secret: &str| {
            assert!(
                env.get("value").is_none(),
                "{}: {name} is a literal",
                render.source
            );
            assert_eq!(
                env["valueFrom"]["secretKeyRef"]["name"], secret,
                "{}: {name}",
                render.source
            );
            assert_eq!(env["valueFrom"]["secretKeyRef"]["key"], "api-key");
        };
        for (_, container) in router_containers(render) {
            for env in container["env"].as_array().into_iter().flatten() {
                match env["name"].as_str().unwrap() {
                    name @ "VLLM_API_KEY" => from_secret(env, name, "vllm-api-key"),
                    name @ "LLAMA_API_KEY" => from_secret(env, name, "llama-api-key"),
                    _ => continue,
                }
                router_keys += 1;
            }
        }
        for workload in render
            .of_kind("Deployment")
            .filter(|d| d["metadata"]["name"].as_str().unwrap().starts_with("vllm-"))
        {
            let vllm = &pod_spec(workload)["containers"][0];
            for env in vllm["env"].as_array().into_iter().flatten() {
                if env["name"] == "VLLM_API_KEY" {
                    from_secret(env, "VLLM_API_KEY", "vllm-api-key");
                    tier_keys += 1;
                }
            }
        }
    }
    assert!(
        router_keys >= 2,
        "all-on values give the router two upstream keys"
    );
    assert!(
        tier_keys >= 3,
        "all-on values give every managed tier its key"
    );
}

#[test]
fn discovery_rbac_grants_only_endpointslice_reads_to_the_router() {
    let Some(renders) = all_renders() else { return };
    for render in &renders {
        for role in render.of_kind("Role") {
            // mode=epp: what a Gateway's inference extension expects its picker may read.
            let epp = role["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-epp"));
            let expected = match epp {
                true => json!([
                    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["get", "list", "watch"]}
                ]),
                false => {
                    json!([{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}])
                }
            };
            assert_eq!(
                role["rules"], expected,
                "{}: {}",
                render.source, role["metadata"]["name"]
            );
            let bindings: Vec<&Value> = render
                .of_kind("RoleBinding")
                .filter(|b| {
                    b["roleRef"]["name"] == role["metadata"]["name"]
                        && b["metadata"]["namespace"] == role["metadata"]["namespace"]
                })
                .collect();
            assert_eq!(
                bindings.len(),
                1,
                "{}: Role {} needs one RoleBinding",
                render.source,
                role["metadata"]["name"]
            );
            let subject = &bindings[0]["subjects"][0];
            // The subject is the ServiceAccount the router pods run as.
            let runs_as: Vec<Value> = router_containers(render)
                .iter()
                .map(|(pod, _)| pod["serviceAccountName"].clone())
                .collect();
            if !runs_as.is_empty()
                && render
                    .of_kind("ConfigMap")
                    .all(|c| c["data"]["pod-spec-patch.yaml"].is_null())
            {
                assert!(
                    runs_as.contains(&subject["name"]),
                    "{}: RoleBinding subject {} runs no router",
                    render.source,
                    subject["name"]
                );
            }
        }
    }
}

#[test]
fn all_on_values_bind_discovery_in_every_tier_namespace() {
    let Some(helm) = require(Tool::Helm) else {
        return;
    };
    let render = helm_template(&helm, Some("charts/quantrouter/ci/all-on-values.yaml"));
    let mut namespaces: Vec<&str> = render
        .of_kind("Role")
        .map(|r| r["metadata"]["namespace"].as_str().unwrap())
        .collect();
    namespaces.sort_unstable();
    assert_eq!(namespaces, ["llm-extra", "llm-tiers"]);
    for binding in render.of_kind("RoleBinding") {
        assert_eq!(
            binding["subjects"][0]["namespace"], NAMESPACE,
            "the router's ServiceAccount lives in the release namespace"
        );
    }
    // The vLLM NetworkPolicy sits with the tiers and admits routers from the release namespace.
    let policy = render.named("NetworkPolicy", "quantrouter-vllm");
    assert_eq!(policy["metadata"]["namespace"], "llm-tiers");
    assert_eq!(
        policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"]
            ["kubernetes.io/metadata.name"],
        NAMESPACE
    );
}

#[test]
fn a_tenants_config_map_is_mounted_and_passed_to_the_router() {
    let Some(helm) = require(Tool::Helm) else {
        return;
    };
    let render = helm_template(&helm, Some("charts/quantrouter/ci/all-on-values.yaml"));
    let (pod, container) = router_containers(&render)
        .into_iter()
        .next()
        .expect("a router container");
    let a = args(&container);
    assert_eq!(
        flag(&a, "--tenants"),
        Some("/etc/quantrouter-tenants/tenants.json")
    );
    assert_eq!(flag(&a, "--tenant-metrics-top"), Some("20"));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "quantrouter-tenants")
        .expect("a tenants volume");
    assert_eq!(volume["configMap"]["name"], "quantrouter-tenants");
}

/// (service, namespace, port) of every service upstream in profiles/default.json.
fn profile_upstreams() -> Vec<(String, String, u64)> {
    let set: Value = serde_json::from_str(&read("profiles/default.json")).unwrap();
    set["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["upstream"]["service"].is_string())
        .map(|p| {
            let u = &p["upstream"];
            (
                u["service"].as_str().unwrap().to_owned(),
                u["namespace"].as_str().unwrap().to_owned(),
                u["port"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn tier_services_match_the_default_profile_set() {
    let Some(helm) = require(Tool::Helm) else {
        return;
    };
    let Some(kubectl) = require(Tool::Kubectl) else {
        return;
    };
    let upstreams = profile_upstreams();
    assert_eq!(upstreams.len(), 3);
    for render in [
        helm_template(&helm, None),
        kustomize(&kubectl, "manifests/overlays/gateway"),
        kustomize(&kubectl, "manifests/overlays/sidecar"),
    ] {
        for (service, namespace, port) in &upstreams {
            let svc = render.named("Service", service);
            assert_eq!(
                &svc["metadata"]["namespace"], namespace,
                "{}: {service}",
                render.source
            );
            assert!(
                svc["spec"]["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["port"] == *port),
                "{}: {service} has no port {port}",
                render.source
            );
        }
    }
}

#[test]
fn profile_configmaps_hold_profiles_default_json_byte_for_byte() {
    let source = read("profiles/default.json");
    assert_eq!(
        read("charts/quantrouter/files/profiles.json"),
        source,
        "run scripts/sync-deploy-files"
    );
    assert_eq!(
        read("manifests/base/profiles.json"),
        source,
        "run scripts/sync-deploy-files"
    );
    let Some(helm) = require(Tool::Helm) else {
        return;
    };
    let Some(kubectl) = require(Tool::Kubectl) else {
        return;
    };
    for (render, name) in [
        (helm_template(&helm, None), "quantrouter-profiles"),
        (
            kustomize(&kubectl, "manifests/overlays/gateway"),
            "quantrouter-profiles",
        ),
    ] {
        let data = render.named("ConfigMap", name)["data"]["profiles.json"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(data, source, "{}", render.source);
    }
}

#[test]
fn scaled_objects_scale_tier_deployments_on_cluster_wide_queue_depth() {
    let Some(renders) = all_renders() else { return };
    let mut seen = std::collections::BTreeSet::new();
    for render in &renders {
        for scaled in render.of_kind("ScaledObject") {
            let target = scaled["spec"]["scaleTargetRef"]["name"].as_str().unwrap();
            let tier = scaled["metadata"]["labels"]["quantrouter.io/tier"]
                .as_str()
                .unwrap();
            assert!(
                target.starts_with("vllm-"),
                "{}: scales {target}",
                render.source
            );
            if render.of_kind("Deployment").next().is_some() {
                let deployment = render.named("Deployment", target);
                assert_eq!(
                    deployment["metadata"]["namespace"], scaled["metadata"]["namespace"],
                    "{}",
                    render.source
                );
                assert!(
                    deployment["spec"]["replicas"].is_null(),
                    "{}: KEDA owns {target}'s replicas",
                    render.source
                );
            }
            let trigger = &scaled["spec"]["triggers"][0];
            let metadata = &trigger["metadata"];
            let kind = trigger["type"].as_str().unwrap();
            seen.insert(kind.to_owned());
            match kind {
                "prometheus" => {
                    let query = metadata["query"].as_str().unwrap();
                    assert!(
                        query.starts_with("sum(quantrouter_queue_depth{"),
                        "{}: {query}",
                        render.source
                    );
                    assert!(
                        query.contains(&format!("tier=\"{tier}\"")),
                        "{}: {query}",
                        render.source
                    );
                }
                "metrics-api" => {
                    let url = metadata["url"].as_str().unwrap();
                    assert!(
                        url.ends_with(&format!(":9090/keda/tiers/{tier}")),
                        "{}: {url}",
                        render.source
                    );
                    assert_eq!(metadata["valueLocation"], "queue_depth");
                }
                "external" => {
                    assert!(
                        metadata["scalerAddress"]
                            .as_str()
                            .unwrap()
                            .ends_with(":9091"),
                        "{}",
                        render.source
                    );
                    assert_eq!(metadata["tier"], tier);
                }
                other => panic!("{}: unexpected trigger {other}", render.source),
            }
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["external", "metrics-api", "prometheus"]
    );
}

#[test]
fn external_scaler_port_is_served_and_exposed_when_used() {
    let Some(helm) = require(Tool::Helm) else {
        return;
    };
    let render = helm_template(
        &helm,
        Some("charts/quantrouter/ci/keda-external-values.yaml"),
    );
    let service = render.named("Service", "quantrouter");
    assert!(service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["port"] == 9091));
    let (_, container) = router_containers(&render).remove(0);
    assert!(container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["containerPort"] == 9091));
    let default = helm_template(&helm, None);
    let service = default.named("Service", "quantrouter");
    assert!(!service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|p| p["port"] == 9091));
    // Unused, the unauthenticated port is not served at all (the binary's default is on).
    let (_, container) = router_containers(&default).remove(0);
    let listen = container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "QUANTROUTER_KEDA_SCALER_LISTEN")
        .map(|e| e["value"].clone());
    assert_eq!(listen, Some(json!("off")));
}

#[test]
fn vllm_tiers_get_gpus_shared_memory_and_health_probes() {
    let Some(renders) = all_renders() else { return };
    for render in &renders {
        for workload in render
            .of_kind("Deployment")
            .filter(|d| d["metadata"]["name"].as_str().unwrap().starts_with("vllm-"))
        {
            let src = format!("{}: {}", render.source, workload["metadata"]["name"]);
            let pod = pod_spec(workload);
            let vllm = &pod["containers"][0];
            assert!(
                vllm["image"]
                    .as_str()
                    .unwrap()
                    .starts_with("vllm/vllm-openai:"),
                "{src}"
            );
            assert!(
                vllm["resources"]["limits"]["nvidia.com/gpu"].is_string(),
                "{src}"
            );
            for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
                assert_eq!(vllm[probe]["httpGet"]["path"], "/health", "{src}: {probe}");
            }
            assert!(
                vllm["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["containerPort"] == 8000),
                "{src}"
            );
            let shm = pod["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|v| v["emptyDir"]["medium"] == "Memory");
            let shm = shm.unwrap_or_else(|| panic!("{src}: no Memory emptyDir"));
            assert!(
                vllm["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|m| m["name"] == shm["name"] && m["mountPath"] == "/dev/shm"),
                "{src}: /dev/shm not mounted"
            );
            let model = flag(&args(vllm), "--model").unwrap_or_else(|| panic!("{src}: no --model"));
            assert!(!model.is_empty(), "{src}");
        }
    }
}

// --- mode=epp: the Gateway API Inference Extension objects ----------------------------------

fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)?["value"]
        .as_str()
}

#[test]
fn epp_mode_renders_a_pool_of_the_tiers_whose_picker_is_the_router_and_a_route_to_it() {
    let Some(helm) = require(Tool::Helm) else {
        return;
    };
    let render = helm_template(&helm, Some("charts/quantrouter/ci/epp-values.yaml"));
    let pools: Vec<&Value> = render.of_kind("InferencePool").collect();
    assert_eq!(pools.len(), 1, "one InferencePool");
    let pool: support::gateway_api::InferencePool = support::strict(pools[0]).unwrap();
    pool.validate().unwrap();
    // The pool holds every vLLM tier's pods, on the port their containers serve.
    let selector = serde_json::to_value(&pool.spec.selector.match_labels).unwrap();
    let target = pool.spec.target_ports[0].number;
    let tiers: Vec<&Value> = workloads(&render)
        .filter(|w| w["metadata"]["labels"]["app.kubernetes.io/component"] == "vllm")
        .collect();
    assert!(!tiers.is_empty());
    for tier in &tiers {
        let labels = &tier["spec"]["template"]["metadata"]["labels"];
        assert!(
            selector_matches(&selector, labels),
            "{} is not in the pool",
            tier["metadata"]["name"]
        );
        let serves = all_containers(pod_spec(tier))
            .flat_map(|c| c["ports"].as_array().into_iter().flatten())
            .any(|p| p["containerPort"] == target);
        assert!(
            serves,
            "{} serves no port {target}",
            tier["metadata"]["name"]
        );
    }
    let selected = workloads(&render)
        .filter(|w| selector_matches(&selector, &w["spec"]["template"]["metadata"]["labels"]))
        .count();
    assert_eq!(selected, tiers.len(), "the pool selects only vLLM pods");
    // Its picker is the router's Service port, which reaches the port the router serves the
    // picker on.
    let picker = pool.spec.endpoint_picker_ref.as_ref().unwrap();
    let service = render.named("Service", &picker.name);
    let port = picker.port.as_ref().unwrap().number;
    let service_port = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"] == port)
        .unwrap_or_else(|| panic!("Service {} has no port {port}", picker.name));
    assert_eq!(service_port["appProtocol"], "kubernetes.io/h2c");
    let (_, router) = router_containers(&render).remove(0);
    let container_port = router["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == service_port["targetPort"])
        .unwrap()["containerPort"]
        .as_i64()
        .unwrap();
    let listen = env_value(&router, "QUANTROUTER_EPP_LISTEN").unwrap();
    assert_eq!(listen, format!("0.0.0.0:{container_port}"));
    // The example route sends the Gateway's path to the pool.
    let route: support::gateway_api::HttpRoute =
        support::strict(render.named("HTTPRoute", "quantrouter")).unwrap();
    route.validate().unwrap();
    let backend = &route.spec.rules[0].backend_refs[0];
    assert_eq!(
        backend.group.as_deref(),
        Some("inference.networking.k8s.io")
    );
    assert_eq!(backend.kind.as_deref(), Some("InferencePool"));
    assert_eq!(backend.name, pool.metadata.name.clone().unwrap());
    assert_eq!(route.spec.parent_refs[0].name, "inference-gateway");
    // Without mode=epp there is no picker and none of these objects.
    let default = helm_template(&helm, None);
    assert_eq!(default.of_kind("InferencePool").count(), 0);
    assert_eq!(default.of_kind("HTTPRoute").count(), 0);
    let (_, router) = router_containers(&default).remove(0);
    assert_eq!(env_value(&router, "QUANTROUTER_EPP_LISTEN"), None);
}

#[test]
fn gateway_api_checks_reject_what_the_published_crds_reject() {
    let pool = json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "FailClose"}
        }
    });
    let crds = CrdSchemas::load();
    check_object(&pool, &crds).unwrap();
    let edits = [
        ("/spec/endpointPickerRef/port", Value::Null),
        ("/spec/endpointPickerRef/failureMode", json!("FailSoft")),
        (
            "/spec/targetPorts",
            json!([{"number": 8000}, {"number": 8000}]),
        ),
        ("/spec/targetPorts", json!([])),
        ("/spec/selector/matchLabels", json!({})),
        ("/spec/selector/matchExpressions", json!([])),
    ];
    for (path, value) in edits {
        let mut bad = pool.clone();
        match value {
            Value::Null => {
                let (parent, key) = path.rsplit_once('/').unwrap();
                bad.pointer_mut(parent)
                    .unwrap()
                    .as_object_mut()
                    .unwrap()
                    .remove(key);
            }
            value => {
                let (parent, key) = path.rsplit_once('/').unwrap();
                bad.pointer_mut(parent).unwrap()[key] = value;
            }
        }
        assert!(check_object(&bad, &crds).is_err(), "{path} accepted");
    }
    let route = json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "r"},
        "spec": {
            "parentRefs": [{"name": "gw"}],
            "rules": [{
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "p"}],
                "timeouts": {"request": "300s"}
            }]
        }
    });
    check_object(&route, &crds).unwrap();
    for (pointer, value) in [
        ("/spec/rules/0/timeouts/request", json!("5 minutes")),
        ("/spec/rules/0/matches/0/path/value", json!("v1")),
        ("/spec/rules/0/backendRefs/0", json!({"name": "svc"})),
        ("/spec/rules/0/backendRefs/0/weight", json!(-1)),
    ] {
        let mut bad = route.clone();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        let parent = bad.pointer_mut(parent).unwrap();
        match key.parse::<usize>() {
            Ok(i) => parent[i] = value,
            Err(_) => parent[key] = value,
        }
        assert!(check_object(&bad, &crds).is_err(), "{pointer} accepted");
    }
}
