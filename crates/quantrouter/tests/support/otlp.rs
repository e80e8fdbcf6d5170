//! An OTLP/HTTP trace receiver in the test: it decodes what the router exports.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use super::loopback;

/// Collects the spans of every OTLP/HTTP export it receives; the URL to export to.
pub async fn otlp_receiver() -> (String, Arc<Mutex<Vec<Span>>>) {
    let listener = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let store = Arc::clone(&spans);
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                    let store = Arc::clone(&store);
                    async move {
                        assert_eq!(req.uri().path(), "/v1/traces");
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let export = ExportTraceServiceRequest::decode(body).unwrap();
                        let mut store = store.lock().unwrap();
                        for resource in export.resource_spans {
                            for scope in resource.scope_spans {
                                store.extend(scope.spans);
                            }
                        }
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::new(),
                        )))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, spans)
}

/// The value of a span's attribute `key`.
pub fn attribute(span: &Span, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone())
        .and_then(|v| v.value)
}

/// An id (trace or span) in the lowercase hex of `traceparent`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
