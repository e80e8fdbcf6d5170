//! The endpoint picker (EPP) of the Gateway API Inference Extension: Envoy's external
//! processing service (`envoy.service.ext_proc.v3.ExternalProcessor`, gRPC), served on its
//! own port (`--epp-listen`).
//!
//! A Gateway (Envoy) sends each request's headers and body here; the picker runs them
//! through the same request pipeline as the HTTP port ([`crate::pipeline`]), rewrites
//! `model` in the body, and answers with the chosen endpoint in the
//! `x-gateway-destination-endpoint` header and in the `envoy.lb` dynamic metadata, the next
//! tier's endpoints in `x-gateway-destination-endpoint-fallback`. Envoy then sends the
//! request to that endpoint itself and streams the answer back through here, where the
//! pipeline books it. This module speaks Envoy's protocol and nothing else; what a picker
//! cannot do that the HTTP port does is in `docs/operations.md` ("Endpoint picker").

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
    pub use envoy::extensions::filters::http::ext_proc::v3::processing_mode::{
        BodySendMode, HeaderSendMode,
    };
    pub use envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
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
        // A buffered request body comes in one message: the body limit, with room for the
        // headers and metadata beside it.
        let largest = self.app.config.body_limit.saturating_add(1024 * 1024);
        ExternalProcessorServer::new(self).max_decoding_message_size(largest)
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    /// One gRPC stream is one HTTP request and its response, served in order by
    /// [`exchange::serve`]; its answers go out as it makes them. The exchange's state (the
    /// endpoint's in-flight count, the tier's slot, the tenant's grant) lives as long as the
    /// stream.
    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (out, mut answers) = tokio::sync::mpsc::unbounded_channel();
        let exchange = exchange::serve(Arc::clone(&self.app), inbound, out);
        // Driven by the response stream itself, beside the answers it sends: no task.
        let exchange = futures_util::stream::once(exchange).filter_map(|()| async { None });
        let answers = futures_util::stream::poll_fn(move |cx| answers.poll_recv(cx)).map(Ok);
        Ok(Response::new(Box::pin(futures_util::stream::select(
            answers, exchange,
        ))))
    }
}
