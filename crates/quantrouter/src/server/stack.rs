//! The public port's request path: one tower stack, built in [`public_service`].
//!
//! Each concern is a layer written as one async function of the request and the rest of the
//! stack ([`from_fn`]), so the path reads top-down, a layer at a time; the leaf is
//! [`super::proxy::endpoints`].

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{header, HeaderValue, Request, Response, Version};
use http_body::Body as _;
use http_body_util::Either;
use hyper::body::Incoming;
use hyper_util::service::TowerToHyperService;
use tower::{Layer, Service, ServiceBuilder, ServiceExt as _};
use tracing::Instrument as _;

use super::connections::Conn;
use super::delivery::{self, Delivered};
use super::{proxy, App, ResponseBody};
use crate::openai::{ApiError, Endpoint};
use crate::pipeline::{RequestId, REQUEST_ID};
use crate::traces::RequestTrace;

/// The public port's service for one client connection. Layers, outermost first:
///
/// 1. **delivery** — counts the request in flight on its connection until the response is
///    sent, and watches the client's side of an upstream body (deadline, idle, end of the
///    shutdown grace); boxes the request's state, freed once the response head is out.
/// 2. **request id** — takes the client's `x-request-id` (1 to 128 bytes) or makes one; puts
///    [`RequestId`] in the request's extensions and the header on every response.
/// 3. **rescue** — the one map from [`ApiError`] to the OpenAI error shape, with
///    `Connection: close` when an HTTP/1.1 body was left unread.
/// 4. **trace** — the request's debug log span and, with tracing on, the OpenTelemetry span
///    of a generation request (a [`RequestTrace`] extension); failures are recorded there
///    without prompt text.
/// 5. **endpoints** (leaf) — `/v1/models` and `/v1/route` answered here; a generation
///    request goes through [`proxy::proxy`]'s phases: auth → body limit and parse → tenant
///    limits → route (policy decision) → cold-tier wait → forward (per-tier admission,
///    attempts, fallbacks) → respond (the answer's body books the request when it ends).
pub fn public_service(
    app: Arc<App>,
    conn: Arc<Conn>,
) -> TowerToHyperService<
    impl Service<
            Request<Incoming>,
            Response = Response<Delivered>,
            Error = Infallible,
            Future = impl Future<Output = Result<Response<Delivered>, Infallible>> + Send,
        > + Clone,
> {
    let (a, b, c, d) = (
        Arc::clone(&app),
        Arc::clone(&app),
        Arc::clone(&app),
        Arc::clone(&app),
    );
    let stack = ServiceBuilder::new()
        .layer(from_fn(move |req, next| {
            deliver(Arc::clone(&a), &conn, req, next)
        }))
        .layer(from_fn(move |req, next| {
            request_id(Arc::clone(&b), req, next)
        }))
        .layer(from_fn(move |req, next| rescue(Arc::clone(&c), req, next)))
        .layer(from_fn(move |req, next| trace(Arc::clone(&d), req, next)))
        .service(tower::service_fn(move |req| {
            proxy::endpoints(Arc::clone(&app), req)
        }));
    TowerToHyperService::new(stack)
}

type BoxedResponse = Pin<Box<dyn Future<Output = Result<Response<Delivered>, Infallible>> + Send>>;

/// Layer 1: in flight on the connection until sent; the client's side of the body watched.
fn deliver<S>(app: Arc<App>, conn: &Arc<Conn>, req: Request<Incoming>, next: S) -> BoxedResponse
where
    S: Service<Request<Incoming>, Response = Response<ResponseBody>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send,
{
    let request = conn.request(req.version());
    let http1 = req.version() < Version::HTTP_2;
    // Boxed: inline, an HTTP/2 stream's task would hold the request's whole state for as long
    // as its body streams — minutes for a long generation.
    Box::pin(async move {
        let Ok(response) = next.oneshot(req).await;
        Ok(delivery::deliver(response, request, http1, |deadline| {
            delivery::Watch {
                deadline,
                idle: app.config.resilience.idle_timeout,
                grace_over: app.grace_over.subscribe(),
            }
        }))
    })
}

/// Layer 2: every request has an id, and every response says it.
async fn request_id<S>(
    app: Arc<App>,
    req: Request<Incoming>,
    next: S,
) -> Result<Response<ResponseBody>, Infallible>
where
    S: Service<Request<Incoming>, Response = Response<ResponseBody>, Error = Infallible>,
{
    let (mut parts, body) = req.into_parts();
    let id = RequestId::assign(&mut parts, || app.next_request_id());
    let req = Request::from_parts(parts, body);
    let Ok(mut response) = next.oneshot(req).await;
    response.headers_mut().insert(REQUEST_ID, id);
    Ok(response)
}

/// Layer 3: an error anywhere below becomes the OpenAI error response.
async fn rescue<S>(
    app: Arc<App>,
    req: Request<Incoming>,
    next: S,
) -> Result<Response<ResponseBody>, Infallible>
where
    S: Service<Request<Incoming>, Response = Response<ResponseBody>, Error = ApiError>,
{
    // An HTTP/1.1 request whose body an early rejection may leave unread.
    let unread_body = req.version() < Version::HTTP_2 && !req.body().is_end_stream();
    // Anthropic's clients read errors in Anthropic's shape.
    let endpoint = match req.uri().path() {
        "/v1/messages/count_tokens" => Some(Endpoint::Messages),
        path => Endpoint::of_path(path),
    };
    let error = match next.oneshot(req).await {
        Ok(response) => return Ok(response),
        Err(error) => error,
    };
    let close = unread_body && error.before_body();
    let response = crate::pipeline::refusal(&app, error, endpoint);
    let mut response = response.map(Either::Left);
    if close {
        // The body was not read, so the connection cannot carry another request. Say so:
        // left to hyper, the close can come after the head went out without it, and a
        // client that reuses the connection sees it drop without an answer.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    Ok(response)
}

/// Layer 4: the log span of the request and, for generation requests, its trace span.
async fn trace<S>(
    app: Arc<App>,
    mut req: Request<Incoming>,
    next: S,
) -> Result<Response<ResponseBody>, ApiError>
where
    S: Service<Request<Incoming>, Response = Response<ResponseBody>, Error = ApiError>,
{
    // A debug span: at the default level an enabled span per request costs throughput for
    // nothing, so a request's few info and warn lines name `request_id` themselves.
    let id = req.extensions().get::<RequestId>().map(|id| id.0.clone());
    let span = tracing::debug_span!(
        "request",
        id = id
            .as_ref()
            .and_then(|id| id.to_str().ok())
            .unwrap_or_default()
    );
    let generation = Endpoint::of_path(req.uri().path());
    let otel = app
        .config
        .traces
        .as_ref()
        .zip(generation)
        .map(|(traces, endpoint)| RequestTrace::start(traces, req.headers(), endpoint.path()));
    if let Some(otel) = &otel {
        req.extensions_mut().insert(otel.clone());
    }
    let result = next.oneshot(req).instrument(span).await;
    if let (Err(error), Some(otel)) = (&result, &otel) {
        // Spans leave the process like logs: no quoted request there either.
        let message = match error.quotes_request() && !app.config.log_prompts {
            true => error.kind().1.to_owned(),
            false => error.to_string(),
        };
        otel.fail(error.status().as_u16(), message);
    }
    result
}

/// A layer made of a function of the request and the rest of the stack, like axum's
/// `middleware::from_fn`: the function gets the request and `next`, and calls `next` (or
/// not) with the request it passes on.
fn from_fn<F>(f: F) -> FnLayer<F> {
    FnLayer { f }
}

#[derive(Debug, Clone)]
struct FnLayer<F> {
    f: F,
}

impl<F: Clone, S> Layer<S> for FnLayer<F> {
    type Service = FnService<F, S>;

    fn layer(&self, next: S) -> Self::Service {
        FnService {
            f: self.f.clone(),
            next,
        }
    }
}

#[derive(Debug, Clone)]
struct FnService<F, S> {
    f: F,
    next: S,
}

impl<F, S, Req, Fut, T, E> Service<Req> for FnService<F, S>
where
    F: Fn(Req, S) -> Fut,
    S: Clone,
    Fut: Future<Output = Result<T, E>>,
{
    type Response = T;
    type Error = E;
    type Future = Fut;

    /// Always ready: each function readies `next` itself when it calls it (`oneshot`).
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), E>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Fut {
        (self.f)(req, self.next.clone())
    }
}
