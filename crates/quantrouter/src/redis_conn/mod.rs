//! The router's Redis, whatever its topology: one server, the master of a Sentinel set, or a
//! Cluster (`--redis-url`, parsed in [`url`]). Every Redis user (the documents, tenant
//! counters, stored Responses' placement, outcome records, KEDA numbers) goes through here:
//!
//! - [`Redis::connect`] gives a connection of its own, a [`Conn`]: commands, pipelines and
//!   Lua scripts on any topology (a cluster routes each by its keys' slot and follows
//!   `MOVED`, `ASK` and a failover inside the cluster itself);
//! - a [`Link`] keeps one connection for a user that calls often, and replaces it after it
//!   failed or after the master changed;
//! - [`Redis::subscribe`] gives a pub/sub connection for update messages (a cluster
//!   forwards every `PUBLISH` to every node, so any node will do), and [`Redis::switches`]
//!   tells subscribers when to move to a new master.
//!
//! With Sentinel the master is asked of the sentinels ([`sentinel`]) and followed through
//! their `+switch-master` messages and through errors (a dropped connection, `READONLY` from
//! a demoted master): either way the next connection goes to the new master.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{
    Cmd, ConnectionAddr, ErrorKind, IntoConnectionInfo, Pipeline, RedisConnectionInfo, RedisError,
    RedisFuture, RedisResult, ServerErrorKind, TlsCertificates, Value,
};
use tokio::sync::watch;

mod sentinel;
pub mod url;

pub use url::{Node, RedisUrl, Topology, UrlError};

/// Longest wait for a TCP (and TLS) connection to a node: a reachable Redis accepts within
/// milliseconds, and a caller bounds the whole call anyway.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for an answer on a connection of its own (the documents, the CLI): the bound
/// every operator command and document read has anyway, so a frozen server fails the call
/// instead of holding it.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait for an answer on a kept connection ([`Link`]: tenant counters, stored
/// Responses, outcome records, KEDA numbers): their calls are single keys or small scripts,
/// and a stored Response's lookup is on a request's path.
const LINK_RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// A cluster's own retries (a redirection, `TRYAGAIN` while a slot moves, a node that is
/// failing over): waits of 20 ms doubling to 500 ms, about 1 s in all, inside the callers'
/// bounds.
const CLUSTER_RETRIES: u32 = 6;

/// What opening the router's Redis takes: `--redis-url`, `--redis-ca-file` and
/// `--redis-sentinel-password`.
#[derive(Clone, Default)]
pub struct RedisSettings {
    pub url: String,
    pub ca_file: Option<PathBuf>,
    /// The sentinels' own password, never the data nodes'.
    pub sentinel_password: Option<String>,
}

/// The router's Redis. Cheap to clone: clones share the Sentinel tracking.
#[derive(Clone)]
pub struct Redis {
    shared: Arc<Shared>,
}

/// A connection to the data: one node's, or a cluster's (which routes each command).
#[derive(Clone)]
pub struct Conn {
    inner: Inner,
    /// The master generation it was made in (see [`Redis::switches`]).
    generation: u64,
    id: u64,
    /// The link that keeps it, told when it breaks.
    link: Option<Weak<Slot>>,
    shared: Arc<Shared>,
}

/// One connection kept for a user that calls often, replaced after it broke.
#[derive(Clone)]
pub struct Link {
    redis: Redis,
    slot: Arc<Slot>,
}

/// Why the router's Redis could not be set up (before any connection is tried).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error(
        "--redis-ca-file needs a TLS URL (rediss://, rediss+sentinel:// or rediss+cluster://)"
    )]
    CaWithoutTls,
    #[error("--redis-ca-file {path}: {source}")]
    ReadCa {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--redis-sentinel-password needs a redis+sentinel:// or rediss+sentinel:// --redis-url"
    )]
    SentinelPasswordWithoutSentinel,
    #[error("--redis-url: {0}")]
    Client(RedisError),
}

struct Shared {
    url: RedisUrl,
    target: Target,
    /// Counts master changes: a connection made in an older generation is to a former
    /// master.
    switches: Arc<watch::Sender<u64>>,
}

enum Target {
    Server(redis::Client),
    Sentinel(sentinel::Tracker),
    Cluster {
        client: Box<ClusterClient>,
        /// Where a subscription goes: any node hears every `PUBLISH` of the cluster.
        seeds: Vec<redis::Client>,
    },
}

#[derive(Clone)]
enum Inner {
    Node(MultiplexedConnection),
    Cluster(ClusterConnection),
}

#[derive(Default)]
struct Slot {
    current: Mutex<Option<Conn>>,
    /// One connection attempt at a time.
    connecting: tokio::sync::Mutex<()>,
}

/// Ids of connections, so a link forgets only the one that broke.
static CONN_IDS: AtomicU64 = AtomicU64::new(1);

// === impl RedisSettings ===

impl std::fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let url = RedisUrl::parse(&self.url).map_or_else(|_| "(invalid)".into(), |u| u.to_string());
        f.debug_struct("RedisSettings")
            .field("url", &url)
            .field("ca_file", &self.ca_file)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "***"),
            )
            .finish()
    }
}

// === impl Redis ===

impl Redis {
    /// Parses and checks the settings; nothing connects until first use.
    pub fn open(settings: &RedisSettings) -> Result<Self, OpenError> {
        let url = RedisUrl::parse(&settings.url)?;
        if settings.sentinel_password.is_some() && !url.is_sentinel() {
            return Err(OpenError::SentinelPasswordWithoutSentinel);
        }
        if url.tls {
            crate::tls::install_crypto_provider();
        }
        let certs = match &settings.ca_file {
            None => None,
            Some(_) if !url.tls => return Err(OpenError::CaWithoutTls),
            Some(path) => Some(TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(path).map_err(|source| OpenError::ReadCa {
                    path: path.clone(),
                    source,
                })?),
            }),
        };
        let switches = Arc::new(watch::Sender::new(0));
        let target = match &url.topology {
            Topology::Server(node) => Target::Server(node_client(&url, node, certs.as_ref())?),
            Topology::Sentinel { sentinels, master } => {
                let sentinel = sentinel::Settings {
                    url: &url,
                    sentinels,
                    master,
                    certs,
                    password: settings.sentinel_password.as_deref(),
                };
                Target::Sentinel(
                    sentinel::Tracker::new(sentinel, Arc::clone(&switches))
                        .map_err(OpenError::Client)?,
                )
            }
            Topology::Cluster { seeds } => cluster_target(&url, seeds, certs)?,
        };
        Ok(Self {
            shared: Arc::new(Shared {
                url,
                target,
                switches,
            }),
        })
    }

    /// The URL, as logs may show it (no password).
    pub fn url(&self) -> &RedisUrl {
        &self.shared.url
    }

    /// A new connection of its own. With Sentinel, to the master as last known, else as
    /// the sentinels name it.
    pub async fn connect(&self) -> RedisResult<Conn> {
        self.open_conn(None).await
    }

    /// A pub/sub connection subscribed to `channel`: to the server, the master, or the first
    /// cluster node that answers.
    pub async fn subscribe(&self, channel: &str) -> RedisResult<redis::aio::PubSub> {
        let mut pubsub = match &self.shared.target {
            Target::Server(client) => pubsub(client).await?,
            Target::Sentinel(tracker) => pubsub(&tracker.master_client().await?.0).await?,
            Target::Cluster { seeds, .. } => {
                let mut last = None;
                let mut found = None;
                for seed in seeds {
                    match pubsub(seed).await {
                        Ok(pubsub) => {
                            found = Some(pubsub);
                            break;
                        }
                        Err(error) => last = Some(error),
                    }
                }
                match (found, last) {
                    (Some(pubsub), _) => pubsub,
                    (None, Some(error)) => return Err(error),
                    (None, None) => return Err(no_nodes()),
                }
            }
        };
        pubsub.subscribe(channel).await?;
        Ok(pubsub)
    }

    /// Changes each time the master changes (Sentinel only): a subscriber to updates moves
    /// to the new master, whose `PUBLISH`es the old one will not see.
    pub fn switches(&self) -> watch::Receiver<u64> {
        self.shared.switches.subscribe()
    }

    fn generation(&self) -> u64 {
        *self.shared.switches.borrow()
    }

    async fn open_conn(&self, link: Option<Weak<Slot>>) -> RedisResult<Conn> {
        let config = node_config(match link {
            Some(_) => LINK_RESPONSE_TIMEOUT,
            None => RESPONSE_TIMEOUT,
        });
        let (inner, generation) = match &self.shared.target {
            Target::Server(client) => {
                let conn = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                (Inner::Node(conn), self.generation())
            }
            Target::Sentinel(tracker) => {
                let (conn, generation) = tracker.connect(&config).await?;
                (Inner::Node(conn), generation)
            }
            Target::Cluster { client, .. } => {
                let conn = client.get_async_connection().await.map_err(|error| {
                    RedisError::from((
                        error.kind(),
                        "connecting to the cluster failed",
                        format!("{}: {error}", self.shared.url),
                    ))
                })?;
                (Inner::Cluster(conn), 0)
            }
        };
        Ok(Conn {
            inner,
            generation,
            id: CONN_IDS.fetch_add(1, Ordering::Relaxed),
            link,
            shared: Arc::clone(&self.shared),
        })
    }
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Redis").field(&self.shared.url).finish()
    }
}

/// A data node's client: the URL's credentials and database, TLS with the CA if given.
fn node_client(
    url: &RedisUrl,
    node: &Node,
    certs: Option<&TlsCertificates>,
) -> Result<redis::Client, OpenError> {
    let info = address(node, url.tls)
        .into_connection_info()
        .map_err(OpenError::Client)?
        .set_redis_settings(data_settings(url));
    match certs {
        Some(certs) => redis::Client::build_with_tls(info, certs.clone()),
        None => redis::Client::open(info),
    }
    .map_err(OpenError::Client)
}

fn cluster_target(
    url: &RedisUrl,
    seeds: &[Node],
    certs: Option<TlsCertificates>,
) -> Result<Target, OpenError> {
    let infos = seeds
        .iter()
        .map(|node| {
            address(node, url.tls)
                .into_connection_info()
                .map(|info| info.set_redis_settings(data_settings(url)))
        })
        .collect::<RedisResult<Vec<_>>>()
        .map_err(OpenError::Client)?;
    let mut builder = ClusterClientBuilder::new(infos)
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(LINK_RESPONSE_TIMEOUT)
        .overall_response_timeout(Some(RESPONSE_TIMEOUT))
        .retries(CLUSTER_RETRIES)
        .retry_wait_formula(10, 2)
        .min_retry_wait(10)
        .max_retry_wait(500);
    if let Some(certs) = &certs {
        builder = builder.certs(certs.clone());
    }
    let client = builder.build().map_err(OpenError::Client)?;
    let seeds = seeds
        .iter()
        .map(|node| node_client(url, node, certs.as_ref()))
        .collect::<Result<_, _>>()?;
    Ok(Target::Cluster {
        client: Box::new(client),
        seeds,
    })
}

fn address(node: &Node, tls: bool) -> ConnectionAddr {
    match tls {
        true => ConnectionAddr::TcpTls {
            host: node.host.clone(),
            port: node.port,
            insecure: false,
            tls_params: None,
        },
        false => ConnectionAddr::Tcp(node.host.clone(), node.port),
    }
}

fn data_settings(url: &RedisUrl) -> RedisConnectionInfo {
    let mut settings = RedisConnectionInfo::default().set_db(url.db);
    if let Some(user) = &url.username {
        settings = settings.set_username(user);
    }
    if let Some(password) = &url.password {
        settings = settings.set_password(password);
    }
    settings
}

fn node_config(response_timeout: Duration) -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(response_timeout))
}

async fn pubsub(client: &redis::Client) -> RedisResult<redis::aio::PubSub> {
    tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_pubsub())
        .await
        .map_err(|_| {
            RedisError::from((
                ErrorKind::Io,
                "no answer to a subscription",
                format!("within {CONNECT_TIMEOUT:?}"),
            ))
        })?
}

fn no_nodes() -> RedisError {
    RedisError::from((ErrorKind::InvalidClientConfig, "no node to connect to"))
}

// === impl Conn ===

impl Conn {
    /// An id unique among the process's connections: a new one after every reconnect.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The replication ids of the masters holding the data (`master_replid`): a new one
    /// means a master lost what it held (restarted empty) or a replica took over with what
    /// it had (a failover). One for a server or a Sentinel master, one per master of a
    /// cluster, sorted.
    pub async fn replication_ids(&mut self) -> RedisResult<Vec<String>> {
        let answer: Value = redis::cmd("INFO")
            .arg("replication")
            .query_async(self)
            .await?;
        let mut infos = Vec::new();
        match answer {
            Value::Map(nodes) => infos.extend(nodes.into_iter().map(|(_, info)| info)),
            info => infos.push(info),
        }
        let mut ids = Vec::new();
        for info in infos {
            let text: String = redis::from_redis_value(info)?;
            let id = text
                .lines()
                .find_map(|line| line.trim().strip_prefix("master_replid:"))
                .ok_or_else(|| {
                    RedisError::from((
                        ErrorKind::UnexpectedReturnType,
                        "INFO without master_replid",
                    ))
                })?;
            ids.push(id.to_owned());
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// Every key matching `pattern` (a `SCAN` of each master: a cluster's keys are spread
    /// over its masters). A key may show up twice while its slot moves.
    pub async fn scan(&mut self, pattern: &str, count: u64) -> RedisResult<Vec<String>> {
        let masters = match &mut self.inner {
            Inner::Node(_) => vec![None],
            Inner::Cluster(conn) => cluster_masters(conn).await?.into_iter().map(Some).collect(),
        };
        let mut keys = Vec::new();
        for master in masters {
            let mut cursor: u64 = 0;
            loop {
                let mut scan = redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(count);
                let answer: Value = match &master {
                    Some((host, port)) => self.on_node(host, *port, scan).await?,
                    None => scan.query_async(&mut *self).await?,
                };
                let (next, batch): (u64, Vec<String>) = redis::from_redis_value(answer)?;
                keys.extend(batch);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(keys)
    }

    /// `cmd` on one node of a cluster.
    async fn on_node(&mut self, host: &str, port: u16, cmd: Cmd) -> RedisResult<Value> {
        let Inner::Cluster(conn) = &mut self.inner else {
            return cmd.query_async(&mut *self).await;
        };
        let node = SingleNodeRoutingInfo::ByAddress {
            host: host.to_owned(),
            port,
        };
        let answer = conn.route_command(cmd, RoutingInfo::SingleNode(node)).await;
        if let Err(error) = &answer {
            self.observe(error);
        }
        answer
    }

    /// After an error: a connection that broke is dropped from its link, and with Sentinel
    /// a broken or demoted master is asked of the sentinels again.
    fn observe(&self, error: &RedisError) {
        let broken = error.is_io_error() || error.is_unrecoverable_error() || error.is_timeout();
        let demoted = matches!(
            error.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        );
        if !broken && !demoted {
            return;
        }
        if let Some(slot) = self.link.as_ref().and_then(Weak::upgrade) {
            slot.forget(self.id);
        }
        if let Target::Sentinel(tracker) = &self.shared.target {
            tracker.suspect(self.generation);
        }
    }
}

/// The (host, port) of every master in the cluster's slot table.
async fn cluster_masters(conn: &mut ClusterConnection) -> RedisResult<Vec<(String, u16)>> {
    let slots: Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
    let mut masters = Vec::new();
    let Value::Array(ranges) = slots else {
        return Err(RedisError::from((
            ErrorKind::UnexpectedReturnType,
            "CLUSTER SLOTS is not a list",
        )));
    };
    for range in ranges {
        let Value::Array(fields) = range else {
            continue;
        };
        // [start, end, [host, port, id, ...] (the master), replicas...]
        let Some(Value::Array(master)) = fields.get(2) else {
            continue;
        };
        if let (Some(host), Some(port)) = (master.first(), master.get(1)) {
            let host: String = redis::from_redis_value_ref(host)?;
            let port: u16 = redis::from_redis_value_ref(port)?;
            if !masters.contains(&(host.clone(), port)) {
                masters.push((host, port));
            }
        }
    }
    Ok(masters)
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let answer = match &mut self.inner {
                Inner::Node(conn) => conn.req_packed_command(cmd).await,
                Inner::Cluster(conn) => conn.req_packed_command(cmd).await,
            };
            if let Err(error) = &answer {
                self.observe(error);
            }
            answer
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let answer = match &mut self.inner {
                Inner::Node(conn) => conn.req_packed_commands(pipeline, offset, count).await,
                Inner::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count).await,
            };
            if let Err(error) = &answer {
                self.observe(error);
            }
            answer
        })
    }

    fn get_db(&self) -> i64 {
        match &self.inner {
            Inner::Node(conn) => conn.get_db(),
            Inner::Cluster(conn) => conn.get_db(),
        }
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("id", &self.id)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

// === impl Link ===

impl Link {
    pub fn new(redis: Redis) -> Self {
        Self {
            redis,
            slot: Arc::default(),
        }
    }

    pub fn redis(&self) -> &Redis {
        &self.redis
    }

    /// The connection kept, if any and not to a former master; never connects (for the
    /// request path, which must not wait for a connection).
    pub fn current(&self) -> Option<Conn> {
        let mut current = self.slot.lock();
        match current.as_ref() {
            Some(conn) if conn.generation == self.redis.generation() => Some(conn.clone()),
            Some(_) => {
                *current = None;
                None
            }
            None => None,
        }
    }

    /// The connection kept, or a new one.
    pub async fn get(&self) -> RedisResult<Conn> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _one_at_a_time = self.slot.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let conn = self
            .redis
            .open_conn(Some(Arc::downgrade(&self.slot)))
            .await?;
        *self.slot.lock() = Some(conn.clone());
        Ok(conn)
    }

    /// Drops the connection kept (a call on it timed out), so the next [`Link::get`]
    /// connects afresh.
    pub fn reset(&self) {
        *self.slot.lock() = None;
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("redis", &self.redis)
            .field("connected", &self.slot.lock().is_some())
            .finish()
    }
}

// === impl Slot ===

impl Slot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Conn>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forget(&self, id: u64) {
        let mut current = self.lock();
        if current.as_ref().is_some_and(|conn| conn.id == id) {
            *current = None;
        }
    }
}

/// Braces in `--redis-prefix` would make a hash tag of their own and break the layout's
/// (each tenant's and each document kind's keys share one cluster slot through theirs).
pub fn check_prefix(prefix: &str) -> Result<(), String> {
    match prefix.contains(['{', '}']) {
        true => Err(format!(
            "--redis-prefix `{prefix}`: no braces (`{{`, `}}`): they mark Redis Cluster hash tags, which the key layout sets itself"
        )),
        false => Ok(()),
    }
}
