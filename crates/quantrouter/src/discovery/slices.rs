//! From a service's EndpointSlices to the base URLs the router may send new requests to.
//! Pure: no I/O, so every rule is unit-tested here.

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort, EndpointSlice};

/// The port name [`resolve_port`] falls back to.
pub const HTTP_PORT_NAME: &str = "http";

/// Base URLs (`http://address:port`) of every endpoint that accepts new requests, sorted and
/// without duplicates.
///
/// An endpoint accepts new requests when its `ready` condition is true or unset (the
/// EndpointSlice API says unset means ready) and it is not `terminating`. Each slice's port
/// comes from [`resolve_port`]; a slice without a usable port contributes nothing.
pub fn ready_urls<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    service_port: u16,
) -> Vec<String> {
    let mut urls: Vec<String> = slices
        .into_iter()
        .flat_map(|slice| slice_urls(slice, service_port))
        .collect();
    urls.sort_unstable();
    urls.dedup();
    urls
}

/// The port of a slice that serves the profile's `service_port`. A slice lists target
/// (container) ports, which need not equal the service port, so in order:
/// 1. the TCP port whose number is `service_port` (targetPort = port, the common case);
/// 2. else the slice's only TCP port (a one-port service mapping e.g. 80 → 8000);
/// 3. else the TCP port named `http`.
///
/// `None` when none fits (the slice is skipped).
pub fn resolve_port(ports: &[EndpointPort], service_port: u16) -> Option<u16> {
    let tcp: Vec<(&EndpointPort, u16)> = ports
        .iter()
        .filter(|p| p.protocol.as_deref().is_none_or(|proto| proto == "TCP"))
        .filter_map(|p| Some((p, u16::try_from(p.port?).ok()?)))
        .collect();
    if let Some((_, port)) = tcp.iter().find(|(_, n)| *n == service_port) {
        return Some(*port);
    }
    if let [(_, only)] = tcp.as_slice() {
        return Some(*only);
    }
    tcp.iter()
        .find(|(p, _)| p.name.as_deref() == Some(HTTP_PORT_NAME))
        .map(|(_, n)| *n)
}

fn slice_urls(slice: &EndpointSlice, service_port: u16) -> Vec<String> {
    let Some(port) = resolve_port(slice.ports.as_deref().unwrap_or_default(), service_port) else {
        tracing::debug!(
            slice = slice.metadata.name.as_deref().unwrap_or_default(),
            service_port,
            "EndpointSlice has no port for the service port; skipped"
        );
        return Vec::new();
    };
    let ipv6 = slice.address_type == "IPv6";
    slice
        .endpoints
        .iter()
        .filter(|e| accepts_new_requests(e))
        .flat_map(|e| &e.addresses)
        .map(|address| {
            if ipv6 {
                format!("http://[{address}]:{port}")
            } else {
                format!("http://{address}:{port}")
            }
        })
        .collect()
}

fn accepts_new_requests(endpoint: &Endpoint) -> bool {
    endpoint
        .conditions
        .as_ref()
        .is_none_or(|c| c.ready != Some(false) && c.terminating != Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(value: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(value).unwrap()
    }

    fn port(name: Option<&str>, number: i32, protocol: Option<&str>) -> EndpointPort {
        EndpointPort {
            name: name.map(str::to_owned),
            port: Some(number),
            protocol: protocol.map(str::to_owned),
            app_protocol: None,
        }
    }

    #[test]
    fn keeps_ready_and_unset_endpoints_and_drops_not_ready_and_terminating_ones() {
        let s = slice(serde_json::json!({
            "metadata": {"name": "vllm-abc"},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["10.0.0.3"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.1"]},
                {"addresses": ["10.0.0.2"], "conditions": {}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.5"], "conditions": {"ready": true, "terminating": true}},
                {"addresses": ["10.0.0.6"], "conditions": {"ready": false, "serving": true, "terminating": true}}
            ]
        }));
        assert_eq!(
            ready_urls([&s], 8000),
            [
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://10.0.0.3:8000"
            ]
        );
    }

    #[test]
    fn merges_slices_sorted_without_duplicates_and_brackets_ipv6() {
        let a = slice(serde_json::json!({
            "metadata": {"name": "a"}, "addressType": "IPv4",
            "ports": [{"port": 9001}],
            "endpoints": [{"addresses": ["127.0.0.1"]}]
        }));
        let b = slice(serde_json::json!({
            "metadata": {"name": "b"}, "addressType": "IPv4",
            "ports": [{"port": 9000}],
            "endpoints": [{"addresses": ["127.0.0.1"]}, {"addresses": ["127.0.0.1"]}]
        }));
        let v6 = slice(serde_json::json!({
            "metadata": {"name": "c"}, "addressType": "IPv6",
            "ports": [{"port": 8000}],
            "endpoints": [{"addresses": ["fd00::1"]}]
        }));
        assert_eq!(
            ready_urls([&a, &b, &v6], 80),
            [
                "http://127.0.0.1:9000",
                "http://127.0.0.1:9001",
                "http://[fd00::1]:8000"
            ]
        );
        assert!(ready_urls([], 80).is_empty());
    }

    #[test]
    fn port_prefers_the_service_port_then_the_only_port_then_http() {
        let metrics = port(Some("metrics"), 9090, None);
        let http = port(Some("http"), 8000, Some("TCP"));
        let grpc = port(Some("grpc"), 50051, None);
        assert_eq!(
            resolve_port(&[metrics.clone(), http.clone()], 9090),
            Some(9090)
        );
        assert_eq!(resolve_port(std::slice::from_ref(&http), 80), Some(8000));
        assert_eq!(resolve_port(&[metrics.clone(), http], 80), Some(8000));
        assert_eq!(resolve_port(&[metrics, grpc], 80), None);
        assert_eq!(resolve_port(&[], 80), None);
    }

    #[test]
    fn port_ignores_udp_and_portless_entries() {
        let udp = port(Some("http"), 8000, Some("UDP"));
        let all_ports = EndpointPort {
            port: None,
            ..port(Some("http"), 0, None)
        };
        assert_eq!(resolve_port(&[udp.clone(), all_ports.clone()], 8000), None);
        let tcp = port(None, 8001, None);
        assert_eq!(resolve_port(&[udp, all_ports, tcp], 80), Some(8001));
    }

    #[test]
    fn a_slice_without_a_usable_port_contributes_nothing() {
        let s = slice(serde_json::json!({
            "metadata": {"name": "a"}, "addressType": "IPv4",
            "ports": [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 50051}],
            "endpoints": [{"addresses": ["10.0.0.1"]}]
        }));
        assert!(ready_urls([&s], 8000).is_empty());
    }
}
