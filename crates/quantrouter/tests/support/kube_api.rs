//! A stand-in Kubernetes API server over real HTTP: just enough of `discovery.k8s.io/v1`
//! EndpointSlices (list and watch by `kubernetes.io/service-name` label) for the real kube
//! client, plus scripted trouble: bookmarks, 410 Gone (as a watch ERROR event or as an HTTP
//! 410 for a stale resourceVersion), dropped watch connections, and an API that answers 503.
//!
//! Every change gets the next resourceVersion and goes into a log, so a watch resuming from a
//! resourceVersion is replayed what it missed, unless the log was compacted past it.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};

const SLICES_PREFIX: &str = "/apis/discovery.k8s.io/v1/namespaces/";
const SERVICE_LABEL: &str = "kubernetes.io/service-name";

/// The stand-in server; dropping it closes every connection.
pub struct KubeApi {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

/// How one pod's endpoint reports itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodState {
    Ready,
    /// No conditions at all: the API says that means ready.
    Unset,
    NotReady,
    /// Shutting down: ready false, serving true, terminating true.
    Terminating,
}

#[derive(Default)]
struct State {
    resource_version: u64,
    /// (namespace, name) → slice, with its service name.
    slices: BTreeMap<(String, String), (String, Value)>,
    log: Vec<Change>,
    /// A watch from a resourceVersion below this is answered 410 Gone.
    oldest: u64,
    gone_as_http: bool,
    down: bool,
    watches: Vec<OpenWatch>,
    next_watch: u64,
    counts: HashMap<(String, &'static str), u64>,
}

struct Change {
    resource_version: u64,
    namespace: String,
    service: String,
    kind: &'static str,
    object: Value,
}

struct OpenWatch {
    id: u64,
    namespace: String,
    service: String,
    tx: mpsc::UnboundedSender<Msg>,
}

enum Msg {
    Line(Bytes),
    End,
    Abort,
}

/// A watch response body: lines pushed by the server state; removes its watch when dropped
/// (the client went away or the connection was aborted).
struct WatchBody {
    rx: mpsc::UnboundedReceiver<Msg>,
    id: u64,
    state: Arc<Mutex<State>>,
}

type ApiBody = Either<Full<Bytes>, WatchBody>;

// === impl KubeApi ===

impl KubeApi {
    pub async fn start() -> Self {
        let listener = TcpListener::bind(super::loopback()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State {
            resource_version: 100,
            ..State::default()
        }));
        let task = tokio::spawn(serve(listener, Arc::clone(&state)));
        Self { addr, state, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The real kube client, talking plain HTTP to this server without credentials.
    pub fn client(&self) -> kube::Client {
        quantrouter::tls::install_crypto_provider();
        let config = kube::Config::new(self.url().parse().unwrap());
        kube::Client::try_from(config).unwrap()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    /// Creates or updates the EndpointSlice of one pod (one slice per pod, since pods on
    /// loopback differ by port): `name` in `namespace`, labelled for `service`.
    pub fn put_pod(
        &self,
        namespace: &str,
        service: &str,
        name: &str,
        addr: SocketAddr,
        pod: PodState,
    ) {
        let conditions = match pod {
            PodState::Ready => json!({"ready": true, "serving": true, "terminating": false}),
            PodState::Unset => Value::Null,
            PodState::NotReady => json!({"ready": false, "serving": false, "terminating": false}),
            PodState::Terminating => json!({"ready": false, "serving": true, "terminating": true}),
        };
        let mut endpoint = json!({"addresses": [addr.ip().to_string()], "targetRef": {"kind": "Pod", "name": name}});
        if !conditions.is_null() {
            endpoint["conditions"] = conditions;
        }
        let slice = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {SERVICE_LABEL: service},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": addr.port(), "protocol": "TCP"}],
            "endpoints": [endpoint],
        });
        self.state().change(namespace, service, name, Some(slice));
    }

    /// Deletes a pod's EndpointSlice.
    pub fn delete_pod(&self, namespace: &str, name: &str) {
        let mut state = self.state();
        let key = (namespace.to_owned(), name.to_owned());
        let service = state.slices.get(&key).map(|(s, _)| s.clone()).unwrap();
        state.change(namespace, &service, name, None);
    }

    /// Sends every open watch a BOOKMARK at the current resourceVersion.
    pub fn bookmark(&self) {
        let mut state = self.state();
        let line = event_line(
            "BOOKMARK",
            &json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"resourceVersion": state.resource_version.to_string()},
            }),
        );
        state.send_all(|_| Some(Msg::Line(line.clone())));
    }

    /// Forgets the change log: from now on a watch can resume only from the current
    /// resourceVersion; older ones are 410 Gone.
    pub fn compact(&self) {
        let mut state = self.state();
        state.log.clear();
        state.oldest = state.resource_version;
    }

    /// Compacts and tells every open watch so with an ERROR event (code 410), then ends it,
    /// the way the API server expires a watch that fell too far behind.
    pub fn expire_watches(&self) {
        self.compact();
        let line = event_line("ERROR", &gone_status());
        self.state().end_all(Some(line));
    }

    /// Answer a watch from a stale resourceVersion with HTTP 410 instead of an ERROR event.
    pub fn set_gone_as_http(&self, yes: bool) {
        self.state().gone_as_http = yes;
    }

    /// Ends every open watch cleanly, as the API server does when a watch's timeout is up.
    pub fn end_watches(&self) {
        self.state().end_all(None);
    }

    /// Aborts every open watch connection mid-stream (no final chunk).
    pub fn drop_watches(&self) {
        self.state().send_all(|_| Some(Msg::Abort));
        self.state().watches.clear();
    }

    /// While down, every request is answered 503 (open watches are not touched).
    pub fn set_down(&self, down: bool) {
        self.state().down = down;
    }

    /// Requests of `kind` (`list`, `watch`, `refused`) for `service` so far.
    pub fn count(&self, service: &str, kind: &'static str) -> u64 {
        let state = self.state();
        state
            .counts
            .get(&(service.to_owned(), kind))
            .copied()
            .unwrap_or(0)
    }

    /// Watches of `service` whose connection is open now.
    pub fn open_watches(&self, service: &str) -> usize {
        self.state()
            .watches
            .iter()
            .filter(|w| w.service == service)
            .count()
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(listener: TcpListener, state: Arc<Mutex<State>>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let state = Arc::clone(&state);
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = handle(&state, &req);
                async move { Ok::<_, Infallible>(response) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
        while connections.try_join_next().is_some() {}
    }
}

fn handle(state: &Arc<Mutex<State>>, req: &Request<Incoming>) -> Response<ApiBody> {
    let Some(namespace) = req
        .uri()
        .path()
        .strip_prefix(SLICES_PREFIX)
        .and_then(|rest| rest.strip_suffix("/endpointslices"))
    else {
        return status(StatusCode::NOT_FOUND, "NotFound");
    };
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_owned(), percent_decode(v)))
        .collect();
    let service = query
        .get("labelSelector")
        .and_then(|s| s.strip_prefix(SERVICE_LABEL))
        .and_then(|s| s.strip_prefix('='))
        .unwrap_or_default()
        .to_owned();
    let mut guard = state.lock().unwrap();
    if guard.down {
        guard.count(&service, "refused");
        return status(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable");
    }
    if query.get("watch").map(String::as_str) == Some("true") {
        let from = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(guard.resource_version);
        guard.watch(state, namespace, &service, from)
    } else {
        guard.count(&service, "list");
        json_response(StatusCode::OK, &guard.list(namespace, &service))
    }
}

// === impl State ===

impl State {
    fn count(&mut self, service: &str, kind: &'static str) {
        *self.counts.entry((service.to_owned(), kind)).or_default() += 1;
    }

    /// Records a change (`None` deletes) and sends it to the watches of its service.
    fn change(&mut self, namespace: &str, service: &str, name: &str, slice: Option<Value>) {
        self.resource_version += 1;
        let rv = self.resource_version.to_string();
        let key = (namespace.to_owned(), name.to_owned());
        let (kind, mut object) = match slice {
            Some(slice) => {
                let kind = if self.slices.contains_key(&key) {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                (kind, slice)
            }
            None => ("DELETED", self.slices.get(&key).unwrap().1.clone()),
        };
        object["metadata"]["resourceVersion"] = Value::String(rv);
        if kind == "DELETED" {
            self.slices.remove(&key);
        } else {
            self.slices
                .insert(key, (service.to_owned(), object.clone()));
        }
        let line = event_line(kind, &object);
        self.send_all(|w| {
            (w.namespace == namespace && w.service == service).then(|| Msg::Line(line.clone()))
        });
        self.log.push(Change {
            resource_version: self.resource_version,
            namespace: namespace.to_owned(),
            service: service.to_owned(),
            kind,
            object,
        });
    }

    fn list(&self, namespace: &str, service: &str) -> Value {
        let items: Vec<&Value> = self
            .slices
            .iter()
            .filter(|((ns, _), (svc, _))| ns == namespace && svc == service)
            .map(|(_, (_, slice))| slice)
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSliceList",
            "metadata": {"resourceVersion": self.resource_version.to_string()},
            "items": items,
        })
    }

    fn watch(
        &mut self,
        shared: &Arc<Mutex<State>>,
        namespace: &str,
        service: &str,
        from: u64,
    ) -> Response<ApiBody> {
        self.count(service, "watch");
        if from < self.oldest {
            if self.gone_as_http {
                return json_response(StatusCode::GONE, &gone_status());
            }
            let body = Full::new(event_line("ERROR", &gone_status()));
            return Response::new(Either::Left(body));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        for change in self.log.iter().filter(|c| {
            c.resource_version > from && c.namespace == namespace && c.service == service
        }) {
            let _ = tx.send(Msg::Line(event_line(change.kind, &change.object)));
        }
        self.next_watch += 1;
        let id = self.next_watch;
        self.watches.push(OpenWatch {
            id,
            namespace: namespace.to_owned(),
            service: service.to_owned(),
            tx,
        });
        let body = WatchBody {
            rx,
            id,
            state: Arc::clone(shared),
        };
        let mut response = Response::new(Either::Right(body));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            "application/json".parse().unwrap(),
        );
        response
    }

    /// Sends what `msg` picks to each open watch, forgetting watches whose client is gone.
    fn send_all(&mut self, msg: impl Fn(&OpenWatch) -> Option<Msg>) {
        self.watches
            .retain(|w| msg(w).is_none_or(|m| w.tx.send(m).is_ok()));
    }

    /// Sends `last` (if any) to every open watch and ends it cleanly.
    fn end_all(&mut self, last: Option<Bytes>) {
        for w in self.watches.drain(..) {
            if let Some(line) = &last {
                let _ = w.tx.send(Msg::Line(line.clone()));
            }
            let _ = w.tx.send(Msg::End);
        }
    }
}

// === impl WatchBody ===

impl Body for WatchBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        match self.get_mut().rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Msg::Line(line))) => Poll::Ready(Some(Ok(Frame::data(line)))),
            Poll::Ready(Some(Msg::Abort)) => Poll::Ready(Some(Err(std::io::Error::other(
                "connection dropped by the test",
            )))),
            Poll::Ready(Some(Msg::End) | None) => Poll::Ready(None),
        }
    }
}

impl Drop for WatchBody {
    fn drop(&mut self) {
        if let Ok(mut state) = self.state.lock() {
            state.watches.retain(|w| w.id != self.id);
        }
    }
}

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn gone_status() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": "too old resource version",
        "reason": "Expired",
        "code": 410,
    })
}

fn status(code: StatusCode, reason: &str) -> Response<ApiBody> {
    let body = json!({
        "apiVersion": "v1",
        "kind": "Status",
        "metadata": {},
        "status": "Failure",
        "message": reason,
        "reason": reason,
        "code": code.as_u16(),
    });
    json_response(code, &body)
}

fn json_response(code: StatusCode, body: &Value) -> Response<ApiBody> {
    let mut response = Response::new(Either::Left(Full::new(Bytes::from(body.to_string()))));
    *response.status_mut() = code;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        "application/json".parse().unwrap(),
    );
    response
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap();
                out.push(u8::from_str_radix(hex, 16).unwrap());
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap()
}
