//! Shared by the deploy-check tests: finding (or installing) helm, kubectl and promtool,
//! rendering the chart and the kustomize overlays, and parsing every object strictly.

pub mod gateway_api;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, PodSpec, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The namespace every render uses: the default profile set's upstreams live in `llm`.
pub const NAMESPACE: &str = "llm";
/// The Kubernetes version the chart is rendered for (its minimum is 1.30).
pub const KUBE_VERSION: &str = "1.32.0";

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn read(path: impl AsRef<Path>) -> String {
    let path = repo_root().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

// === tools ===

/// A tool the checks run. `helm` brings `kubectl` with it (scripts/install-tools helm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    Helm,
    Kubectl,
    Promtool,
}

impl Tool {
    fn name(self) -> &'static str {
        match self {
            Tool::Helm => "helm",
            Tool::Kubectl => "kubectl",
            Tool::Promtool => "promtool",
        }
    }

    fn install_name(self) -> &'static str {
        match self {
            Tool::Helm | Tool::Kubectl => "helm",
            Tool::Promtool => "promtool",
        }
    }

    fn find(self) -> Option<PathBuf> {
        // helm and kubectl are the pinned ones in .tools/bin, never whatever is on PATH.
        let local = repo_root().join(".tools/bin").join(self.name());
        if local.is_file() {
            return Some(local);
        }
        if self == Tool::Promtool {
            let path = std::env::var_os("PATH")?;
            return std::env::split_paths(&path)
                .map(|dir| dir.join("promtool"))
                .find(|candidate| candidate.is_file());
        }
        None
    }
}

fn install(tool: Tool) -> bool {
    static HELM: OnceLock<bool> = OnceLock::new();
    static PROMTOOL: OnceLock<bool> = OnceLock::new();
    let once = match tool.install_name() {
        "helm" => &HELM,
        _ => &PROMTOOL,
    };
    *once.get_or_init(|| {
        eprintln!(
            "{} is missing: running scripts/install-tools {}",
            tool.name(),
            tool.install_name()
        );
        Command::new(repo_root().join("scripts/install-tools"))
            .arg(tool.install_name())
            .status()
            .map(|status| status.success())
            .unwrap_or(false)
    })
}

/// The tool's path, installing it with scripts/install-tools when missing. In CI
/// (`CI=true`) a tool that cannot be had fails the test; elsewhere the test is skipped with
/// the reason printed.
pub fn require(tool: Tool) -> Option<PathBuf> {
    if let Some(path) = tool.find() {
        return Some(path);
    }
    if install(tool) {
        if let Some(path) = tool.find() {
            return Some(path);
        }
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!(
            "{} is not available and CI=true: scripts/install-tools {} failed",
            tool.name(),
            tool.install_name()
        );
    }
    eprintln!(
        "SKIPPED: {} is not installed and scripts/install-tools {} could not install it (CI is not set, so this is not a failure)",
        tool.name(),
        tool.install_name()
    );
    None
}

/// Runs a tool; Ok(stdout) on success, Err(stderr) on failure.
pub fn run(tool: &Path, args: &[&str]) -> Result<String, String> {
    let output = Command::new(tool)
        .args(args)
        .current_dir(repo_root())
        .output()
        .map_err(|e| format!("run {}: {e}", tool.display()))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

// === rendering ===

/// The objects of one render (a helm values file, an overlay, a manifest file).
#[derive(Debug)]
pub struct Rendered {
    pub source: String,
    pub objects: Vec<Value>,
}

impl Rendered {
    pub fn of_kind<'a>(&'a self, kind: &str) -> impl Iterator<Item = &'a Value> + 'a {
        let kind = kind.to_owned();
        self.objects
            .iter()
            .filter(move |o| o["kind"] == kind.as_str())
    }

    pub fn named(&self, kind: &str, name: &str) -> &Value {
        self.of_kind(kind)
            .find(|o| o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{}: no {kind} {name}", self.source))
    }
}

/// Splits a multi-document YAML stream into JSON values, skipping empty documents.
pub fn parse_yaml_documents(text: &str) -> Result<Vec<Value>, String> {
    let mut objects = Vec::new();
    for document in serde_yaml_ng::Deserializer::from_str(text) {
        let value = Value::deserialize(document).map_err(|e| e.to_string())?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
}

pub fn parse_yaml_file(path: &str) -> Rendered {
    let objects = parse_yaml_documents(&read(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    Rendered {
        source: path.to_owned(),
        objects,
    }
}

/// `helm template` of the chart with one values file (None: the defaults).
pub fn helm_template(helm: &Path, values: Option<&str>) -> Rendered {
    let mut args = vec![
        "template",
        "quantrouter",
        "charts/quantrouter",
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        "--api-versions",
        "keda.sh/v1alpha1",
        "--api-versions",
        "monitoring.coreos.com/v1",
    ];
    if let Some(values) = values {
        args.extend(["--values", values]);
    }
    let source = format!("helm template ({})", values.unwrap_or("default values"));
    let out = run(helm, &args).unwrap_or_else(|e| panic!("{source}: {e}"));
    let objects = parse_yaml_documents(&out).unwrap_or_else(|e| panic!("{source}: {e}"));
    Rendered { source, objects }
}

pub fn kustomize(kubectl: &Path, dir: &str) -> Rendered {
    let source = format!("kubectl kustomize {dir}");
    let out = run(kubectl, &["kustomize", dir]).unwrap_or_else(|e| panic!("{source}: {e}"));
    let objects = parse_yaml_documents(&out).unwrap_or_else(|e| panic!("{source}: {e}"));
    Rendered { source, objects }
}

/// The chart's CI values files (charts/quantrouter/ci/*-values.yaml), sorted.
pub fn ci_values_files() -> Vec<String> {
    let dir = repo_root().join("charts/quantrouter/ci");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with("-values.yaml"))
        .map(|name| format!("charts/quantrouter/ci/{name}"))
        .collect();
    files.sort();
    files
}

/// Every render the project ships: the chart with default and CI values, both overlays,
/// the monitoring kustomization and the plain files under manifests/keda and
/// manifests/monitoring. None when helm/kubectl are unavailable outside CI.
pub fn all_renders() -> Option<Vec<Rendered>> {
    let helm = require(Tool::Helm)?;
    let kubectl = require(Tool::Kubectl)?;
    let mut renders = vec![helm_template(&helm, None)];
    for values in ci_values_files() {
        renders.push(helm_template(&helm, Some(&values)));
    }
    for dir in [
        "manifests/overlays/gateway",
        "manifests/overlays/sidecar",
        "manifests/monitoring",
    ] {
        renders.push(kustomize(&kubectl, dir));
    }
    for file in [
        "manifests/keda/prometheus.yaml",
        "manifests/keda/metrics-api.yaml",
        "manifests/keda/external.yaml",
        "manifests/monitoring/podmonitor-sidecar.yaml",
    ] {
        renders.push(parse_yaml_file(file));
    }
    Some(renders)
}

// === strict parsing ===

/// Deserializes `value` into `T`, failing on any field `T` does not know (reported by
/// serde_ignored with its path) and on anything that does not survive a round trip
/// unchanged (a value coerced, dropped or defaulted on the way).
pub fn strict<T: DeserializeOwned + Serialize>(value: &Value) -> Result<T, String> {
    let mut unknown = Vec::new();
    let parsed: T =
        serde_ignored::deserialize(value.clone(), |path| unknown.push(path.to_string()))
            .map_err(|e| e.to_string())?;
    if !unknown.is_empty() {
        return Err(format!("unknown field(s): {}", unknown.join(", ")));
    }
    let back = serde_json::to_value(&parsed).map_err(|e| e.to_string())?;
    match first_difference(&without_nulls(value), &back, "") {
        None => Ok(parsed),
        Some(path) => Err(format!("does not round-trip unchanged at {path}")),
    }
}

fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for key in x.keys().chain(y.keys()) {
                let (Some(xv), Some(yv)) = (x.get(key), y.get(key)) else {
                    // k8s-openapi writes apiVersion and kind of embedded resources (a
                    // StatefulSet's volumeClaimTemplates) that manifests usually leave out.
                    if x.get(key).is_none() && (key == "apiVersion" || key == "kind") {
                        continue;
                    }
                    return Some(format!("{path}/{key}"));
                };
                if let Some(found) = first_difference(xv, yv, &format!("{path}/{key}")) {
                    return Some(found);
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (xv, yv))| first_difference(xv, yv, &format!("{path}/{i}"))),
        _ if a == b => None,
        _ => Some(if path.is_empty() {
            "/".to_owned()
        } else {
            path.to_owned()
        }),
    }
}

/// The vendored CRD schemas (crates/deploy-check/schemas), compiled once.
pub struct CrdSchemas {
    validators: BTreeMap<&'static str, jsonschema::Validator>,
}

impl std::fmt::Debug for CrdSchemas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrdSchemas")
            .field("kinds", &self.validators.keys())
            .finish()
    }
}

impl CrdSchemas {
    pub fn load() -> Self {
        let mut validators = BTreeMap::new();
        for (kind, file) in [
            ("ScaledObject", "scaledobject.json"),
            ("ServiceMonitor", "servicemonitor.json"),
            ("PodMonitor", "podmonitor.json"),
            ("PrometheusRule", "prometheusrule.json"),
        ] {
            let schema: Value =
                serde_json::from_str(&read(format!("crates/deploy-check/schemas/{file}")))
                    .unwrap_or_else(|e| panic!("{file}: {e}"));
            let validator =
                jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("{file}: {e}"));
            validators.insert(kind, validator);
        }
        Self { validators }
    }

    fn validate(&self, kind: &str, object: &Value) -> Result<(), String> {
        let validator = self
            .validators
            .get(kind)
            .ok_or_else(|| format!("no schema for {kind}"))?;
        let errors: Vec<String> = validator
            .iter_errors(object)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

/// Checks one rendered object: built-in kinds through their k8s-openapi type, custom
/// resources against the vendored CRD schema (and their metadata as ObjectMeta). Unknown
/// kinds fail, so a new kind in the chart needs a line here.
pub fn check_object(object: &Value, crds: &CrdSchemas) -> Result<(), String> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let kind = object["kind"].as_str().unwrap_or_default();
    match (api_version, kind) {
        ("v1", "ConfigMap") => {
            let config_map: ConfigMap = strict(object)?;
            check_pod_spec_patch(&config_map)
        }
        ("v1", "Namespace") => strict::<Namespace>(object).map(drop),
        ("v1", "Secret") => strict::<Secret>(object).map(drop),
        ("v1", "Service") => strict::<Service>(object).map(drop),
        ("v1", "ServiceAccount") => strict::<ServiceAccount>(object).map(drop),
        ("apps/v1", "Deployment") => strict::<Deployment>(object).map(drop),
        ("apps/v1", "StatefulSet") => strict::<StatefulSet>(object).map(drop),
        ("autoscaling/v2", "HorizontalPodAutoscaler") => {
            strict::<HorizontalPodAutoscaler>(object).map(drop)
        }
        ("networking.k8s.io/v1", "NetworkPolicy") => strict::<NetworkPolicy>(object).map(drop),
        ("policy/v1", "PodDisruptionBudget") => strict::<PodDisruptionBudget>(object).map(drop),
        ("rbac.authorization.k8s.io/v1", "Role") => strict::<Role>(object).map(drop),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => strict::<RoleBinding>(object).map(drop),
        ("inference.networking.k8s.io/v1", "InferencePool") => {
            strict::<gateway_api::InferencePool>(object)?.validate()
        }
        ("gateway.networking.k8s.io/v1", "HTTPRoute") => {
            strict::<gateway_api::HttpRoute>(object)?.validate()
        }
        ("keda.sh/v1alpha1", "ScaledObject")
        | ("monitoring.coreos.com/v1", "ServiceMonitor" | "PodMonitor" | "PrometheusRule") => {
            strict::<ObjectMeta>(&object["metadata"]).map_err(|e| format!("metadata: {e}"))?;
            crds.validate(kind, object)
        }
        _ => Err(format!(
            "unexpected kind {api_version}/{kind}: add it to check_object"
        )),
    }
}

/// The sidecar-mode ConfigMap carries a pod-spec fragment: it must be a valid PodSpec once
/// the (application's) containers are added.
fn check_pod_spec_patch(config_map: &ConfigMap) -> Result<(), String> {
    let Some(text) = config_map
        .data
        .as_ref()
        .and_then(|d| d.get("pod-spec-patch.yaml"))
    else {
        return Ok(());
    };
    let mut fragment: Value =
        serde_yaml_ng::from_str(text).map_err(|e| format!("pod-spec-patch.yaml: {e}"))?;
    fragment["containers"] = Value::Array(Vec::new());
    strict::<PodSpec>(&fragment)
        .map(drop)
        .map_err(|e| format!("pod-spec-patch.yaml: {e}"))
}

/// The pod spec of a Deployment or StatefulSet value.
pub fn pod_spec(workload: &Value) -> &Value {
    &workload["spec"]["template"]["spec"]
}

/// A container's args as strings.
pub fn args(container: &Value) -> Vec<&str> {
    container["args"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The value of `--flag=value` in args.
pub fn flag<'a>(args: &[&'a str], flag: &str) -> Option<&'a str> {
    let prefix = format!("{flag}=");
    args.iter().find_map(|a| a.strip_prefix(prefix.as_str()))
}
