//! The Gateway API objects the chart renders in `mode: epp`, as typed structs written from
//! the published APIs, since `k8s-openapi` has neither: `InferencePool`
//! (`inference.networking.k8s.io/v1`, Gateway API Inference Extension) and `HTTPRoute`
//! (`gateway.networking.k8s.io/v1`). Field names, optionality and the enum values follow the
//! published Go types; [`InferencePool::validate`] and [`HttpRoute::validate`] add the
//! constraints their CRDs state as validation markers.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePool {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: InferencePoolSpec,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Pods of the pool's namespace, by label only (a Service-like selector).
    pub selector: LabelSelector,
    /// One to eight distinct ports; each `podIP:number` is an endpoint.
    pub target_ports: Vec<PoolPort>,
    /// `http` (the default) or `kubernetes.io/h2c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct PoolPort {
    pub number: i32,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// `""` (the core group, the default) for a Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Defaults to `Service`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    /// Required for a Service: the Service's port, not the target port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PoolPort>,
    /// `FailClose` (the default) or `FailOpen`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRoute {
    pub api_version: String,
    pub kind: String,
    pub metadata: ObjectMeta,
    pub spec: HttpRouteSpec,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parent_refs: Vec<ParentReference>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hostnames: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<HttpRouteRule>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ParentReference {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<HttpRouteMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backend_refs: Vec<HttpBackendRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeouts: Option<HttpRouteTimeouts>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteMatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<HttpPathMatch>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HttpHeaderMatch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct HttpPathMatch {
    /// `Exact`, `PathPrefix` (the default) or `RegularExpression`.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct HttpHeaderMatch {
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpBackendRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<i32>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HttpRouteTimeouts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_request: Option<String>,
}

fn port_number(n: i32, what: &str) -> Result<(), String> {
    match (1..=65535).contains(&n) {
        true => Ok(()),
        false => Err(format!("{what} {n} is not a port number (1 to 65535)")),
    }
}

/// Gateway API's `Duration`: 1 to 4 parts of up to 5 digits and a unit (h, m, s, ms).
fn duration(text: &str) -> bool {
    let mut parts = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if !(1..=5).contains(&digits) {
            return false;
        }
        rest = &rest[digits..];
        let unit = ["ms", "h", "m", "s"]
            .into_iter()
            .find(|u| rest.starts_with(u));
        let Some(unit) = unit else { return false };
        rest = &rest[unit.len()..];
        parts += 1;
    }
    (1..=4).contains(&parts)
}

impl InferencePool {
    /// The CRD's validation markers.
    pub fn validate(&self) -> Result<(), String> {
        let spec = &self.spec;
        if spec.selector.match_labels.is_empty() {
            return Err("spec.selector.matchLabels is empty: the pool would select no pods".into());
        }
        if !(1..=8).contains(&spec.target_ports.len()) {
            return Err("spec.targetPorts needs 1 to 8 ports".into());
        }
        for (i, port) in spec.target_ports.iter().enumerate() {
            port_number(port.number, "spec.targetPorts[].number")?;
            if spec.target_ports[..i]
                .iter()
                .any(|p| p.number == port.number)
            {
                return Err(format!("spec.targetPorts repeats {}", port.number));
            }
        }
        if let Some(protocol) = &spec.app_protocol {
            if !["http", "kubernetes.io/h2c"].contains(&protocol.as_str()) {
                return Err(format!(
                    "spec.appProtocol {protocol} is not http or kubernetes.io/h2c"
                ));
            }
        }
        if let Some(picker) = &spec.endpoint_picker_ref {
            if picker.name.is_empty() {
                return Err("spec.endpointPickerRef.name is empty".into());
            }
            let service = picker.kind.as_deref().is_none_or(|k| k == "Service");
            match (&picker.port, service) {
                (Some(port), _) => port_number(port.number, "spec.endpointPickerRef.port.number")?,
                (None, true) => {
                    return Err("spec.endpointPickerRef.port is required for a Service".into())
                }
                (None, false) => {}
            }
            if let Some(mode) = &picker.failure_mode {
                if !["FailOpen", "FailClose"].contains(&mode.as_str()) {
                    return Err(format!(
                        "spec.endpointPickerRef.failureMode {mode} is not FailOpen or FailClose"
                    ));
                }
            }
        }
        Ok(())
    }
}

impl HttpRoute {
    /// The CRD's validation markers for the fields above.
    pub fn validate(&self) -> Result<(), String> {
        let spec = &self.spec;
        if spec.parent_refs.len() > 32 || spec.rules.len() > 16 {
            return Err("at most 32 parentRefs and 16 rules".into());
        }
        for parent in &spec.parent_refs {
            if parent.name.is_empty() {
                return Err("spec.parentRefs[].name is empty".into());
            }
            if let Some(port) = parent.port {
                port_number(port, "spec.parentRefs[].port")?;
            }
        }
        for rule in &spec.rules {
            for m in &rule.matches {
                let Some(path) = &m.path else { continue };
                let kind = path.kind.as_deref().unwrap_or("PathPrefix");
                if !["Exact", "PathPrefix", "RegularExpression"].contains(&kind) {
                    return Err(format!(
                        "spec.rules[].matches[].path.type {kind} is unknown"
                    ));
                }
                let value = path.value.as_deref().unwrap_or("/");
                if kind != "RegularExpression" && !value.starts_with('/') {
                    return Err(format!("path {value} must start with /"));
                }
            }
            for backend in &rule.backend_refs {
                if backend.name.is_empty() {
                    return Err("spec.rules[].backendRefs[].name is empty".into());
                }
                // A Service backend needs a port; other kinds (an InferencePool) do not.
                let service = backend.kind.as_deref().is_none_or(|k| k == "Service")
                    && backend.group.as_deref().is_none_or(str::is_empty);
                if service && backend.port.is_none() {
                    return Err(format!(
                        "backendRef {} (a Service) needs a port",
                        backend.name
                    ));
                }
                if let Some(weight) = backend.weight {
                    if !(0..=1_000_000).contains(&weight) {
                        return Err(format!("backendRef weight {weight} is out of 0..=1000000"));
                    }
                }
            }
            if let Some(timeouts) = &rule.timeouts {
                for value in [&timeouts.request, &timeouts.backend_request]
                    .into_iter()
                    .flatten()
                {
                    if !duration(value) {
                        return Err(format!("timeout {value} is not a Gateway API duration"));
                    }
                }
            }
        }
        Ok(())
    }
}
