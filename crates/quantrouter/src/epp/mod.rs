//! The endpoint picker (EPP) of the Gateway API Inference Extension: Envoy's external
//! processing service (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC), served on its
//! own port (`--epp-listen`).
//!
//! A Gateway (Envoy) sends each request's headers and body here; the picker routes it with
//! the same snapshot, classifier, breakers and tenants as the HTTP port, rewrites `model` in
//! the body, and answers with the chosen endpoint in the `x-gateway-destination-endpoint`
//! header and in the `envoy.lb` dynamic metadata, the next tier's endpoints in
//! `x-gateway-destination-endpoint-fallback`. Envoy then sends the request to that endpoint
//! itself and streams the answer back through here, where usage, cost, tenant spend and
//! metrics are counted as in proxy mode. What a picker cannot do that the proxy does is in
//! `docs/operations.md` ("Endpoint picker").

mod exchange;

use std::pin::Pin;
use std::sync::Arc;

use futures_util::{Stream, StreamExt as _};
use tonic::{Request, Response, Status, Streaming};

use crate::app::App;
use proto::ext_proc::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use proto::ext_proc::{ProcessingRequest, ProcessingResponse};

pub use exchange::{
    DESTINATION_ENDPOINT, DESTINATION_FALLBACK, DESTINATION_SERVED, DESTINATION_SUBSET,
    LB_NAMESPACE, SUBSET_NAMESPACE,
};

/// Envoy's ext_proc interface, generated from the subset in `proto/envoy/`.
#[allow(
    missing_debug_implementations,
    missing_docs,
    clippy::all,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]
pub mod proto {
    pub mod envoy {
        pub mod config {
            pub mod core {
                pub mod v3 {
                    tonic::include_proto!("envoy.config.core.v3");
                }
            }
        }
        pub mod r#type {
            pub mod v3 {
                tonic::include_proto!("envoy.r#type.v3");
            }
        }
        pub mod extensions {
            pub mod filters {
                pub mod http {
                    pub mod ext_proc {
                        pub mod v3 {
                            tonic::include_proto!("envoy.extensions.filters.http.ext_proc.v3");
                        }
                    }
                }
            }
        }
        pub mod service {
            pub mod ext_proc {
                pub mod v3 {
                    tonic::include_proto!("envoy.service.ext_proc.v3");
                }
            }
        }
    }
    pub use envoy::config::core::v3 as core;
    pub use envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    pub use envoy::service::ext_proc::v3 as ext_proc;
}

/// The ext_proc service over the router's shared state.
#[derive(Debug, Clone)]
pub struct Picker {
    app: Arc<App>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

impl Picker {
    pub fn new(app: Arc<App>) -> Self {
        Self { app }
    }

    /// The tonic service, ready to serve over HTTP/2.
    pub fn into_service(self) -> ExternalProcessorServer<Self> {
        ExternalProcessorServer::new(self)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    /// One gRPC stream is one HTTP request and its response: each message from Envoy gets
    /// the answers it calls for, in order. The exchange's state (the endpoint's in-flight
    /// count, the tier's slot, the tenant's grant) lives as long as the stream.
    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let exchange = exchange::Exchange::new(Arc::clone(&self.app));
        let answers = futures_util::stream::unfold(
            (inbound, exchange),
            |(mut inbound, mut exchange)| async move {
                match inbound.next().await {
                    Some(Ok(message)) => {
                        let answers = exchange.handle(message).await;
                        Some((answers, (inbound, exchange)))
                    }
                    Some(Err(status)) => {
                        tracing::debug!(%status, "ext_proc stream ended with an error");
                        exchange.abandon();
                        None
                    }
                    None => {
                        exchange.abandon();
                        None
                    }
                }
            },
        )
        .flat_map(|answers| futures_util::stream::iter(answers.into_iter().map(Ok)));
        Ok(Response::new(Box::pin(answers)))
    }
}
