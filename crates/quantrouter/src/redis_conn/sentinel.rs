//! The master of a Sentinel set: asked of the sentinels (the redis crate's
//! `SentinelClient`, which checks with `ROLE` that the node it names is a master), then
//! followed. The crate does not follow a failover by itself, so the tracker subscribes to
//! `+switch-master` on every sentinel and moves to the master a message names; a
//! connection that breaks or finds its master demoted (`READONLY`) makes the next one ask
//! the sentinels again ([`Tracker::suspect`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo,
    RedisConnectionInfo, RedisError, RedisResult, TlsCertificates, TlsMode,
};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::url::{Node, RedisUrl};
use crate::resilience::backoff::Backoff;

/// Longest a search for the master may take: every sentinel is asked (three at once) and the
/// master it names is checked.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest a sentinel takes to say where a master is, when a failed search is explained.
const DIAGNOSIS_TIMEOUT: Duration = Duration::from_millis(500);
/// Resubscription waits after a sentinel went away: 100 ms doubling to 5 s, as the
/// document followers reconnect.
const RESUBSCRIBE: Backoff = Backoff {
    base: Duration::from_millis(100),
    cap: Duration::from_secs(5),
    retry_after_cap: Duration::ZERO,
};
/// The channel every sentinel announces a new master on: `NAME OLD_IP OLD_PORT NEW_IP
/// NEW_PORT`.
const SWITCH_CHANNEL: &str = "+switch-master";

/// What following a Sentinel set's master takes.
pub(super) struct Settings<'a> {
    pub url: &'a RedisUrl,
    pub sentinels: &'a [Node],
    pub master: &'a str,
    pub certs: Option<TlsCertificates>,
    /// The sentinels' password (`--redis-sentinel-password`), never the master's.
    pub password: Option<&'a str>,
}

/// Where the master is, and the subscriptions that hear when it moves.
pub(super) struct Tracker {
    state: Arc<State>,
    /// `+switch-master` subscriptions, one per sentinel: started with the first connection
    /// (they need the runtime), stopped when the last handle goes.
    watchers: Mutex<Vec<JoinHandle<()>>>,
}

struct State {
    name: String,
    /// The sentinels, as errors name them.
    described: String,
    discovery: tokio::sync::Mutex<SentinelClient>,
    sentinels: Vec<redis::Client>,
    known: Mutex<Known>,
    switches: Arc<watch::Sender<u64>>,
}

#[derive(Default)]
struct Known {
    /// The master to connect to, unless suspected since.
    master: Option<ConnectionInfo>,
    /// The last master's address, suspected or not: a discovery that finds another one is
    /// a switch.
    last: Option<ConnectionAddr>,
    /// The last master found, suspected or not: tried when no sentinel answers.
    fallback: Option<ConnectionInfo>,
}

// === impl Tracker ===

impl Tracker {
    pub(super) fn new(
        settings: Settings<'_>,
        switches: Arc<watch::Sender<u64>>,
    ) -> RedisResult<Self> {
        let url = settings.url;
        let addresses: Vec<ConnectionAddr> = settings
            .sentinels
            .iter()
            .map(|node| super::address(node, url.tls))
            .collect();
        let mut builder = SentinelClientBuilder::new(
            addresses.clone(),
            settings.master,
            SentinelServerType::Master,
        )?
        .set_client_to_redis_db(url.db);
        if let Some(user) = &url.username {
            builder = builder.set_client_to_redis_username(user);
        }
        if let Some(password) = &url.password {
            builder = builder.set_client_to_redis_password(password);
        }
        if let Some(password) = settings.password {
            builder = builder.set_client_to_sentinel_password(password);
        }
        if url.tls {
            builder = builder.set_client_to_redis_tls_mode(TlsMode::Secure);
        }
        if let Some(certs) = &settings.certs {
            builder = builder
                .set_client_to_redis_certificates(certs.clone())
                .set_client_to_sentinel_certificates(certs.clone());
        }
        let discovery = builder.build()?;
        let mut sentinel_settings = RedisConnectionInfo::default();
        if let Some(password) = settings.password {
            sentinel_settings = sentinel_settings.set_password(password);
        }
        let sentinels = addresses
            .into_iter()
            .map(|address| {
                let info = address
                    .into_connection_info()?
                    .set_redis_settings(sentinel_settings.clone());
                match &settings.certs {
                    Some(certs) => redis::Client::build_with_tls(info, certs.clone()),
                    None => redis::Client::open(info),
                }
            })
            .collect::<RedisResult<_>>()?;
        let described: Vec<String> = settings.sentinels.iter().map(Node::to_string).collect();
        Ok(Self {
            state: Arc::new(State {
                name: settings.master.to_owned(),
                described: described.join(", "),
                discovery: tokio::sync::Mutex::new(discovery),
                sentinels,
                known: Mutex::default(),
                switches,
            }),
            watchers: Mutex::default(),
        })
    }

    /// A connection to the master, and the generation it belongs to.
    pub(super) async fn connect(
        &self,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<(redis::aio::MultiplexedConnection, u64)> {
        let (client, generation) = self.master_client().await?;
        match client
            .get_multiplexed_async_connection_with_config(config)
            .await
        {
            Ok(conn) => Ok((conn, generation)),
            Err(error) => {
                self.suspect(generation);
                Err(error)
            }
        }
    }

    /// A client of the master as last known, else as the sentinels name it now.
    pub(super) async fn master_client(&self) -> RedisResult<(redis::Client, u64)> {
        self.watch();
        if let Some(known) = self.state.known_client()? {
            return Ok(known);
        }
        let mut discovery = self.state.discovery.lock().await;
        // Another caller may have found it while this one waited.
        if let Some(known) = self.state.known_client()? {
            return Ok(known);
        }
        let found =
            match tokio::time::timeout(DISCOVERY_TIMEOUT, discovery.async_get_client()).await {
                Ok(Ok(found)) => found,
                Ok(Err(error)) => return self.state.unfound(error).await,
                Err(_) => {
                    let error = RedisError::from((
                        ErrorKind::Io,
                        "no sentinel named the master in time",
                        format!("{} within {DISCOVERY_TIMEOUT:?}", self.state.described),
                    ));
                    return self.state.unfound(error).await;
                }
            };
        let generation = self.state.found(found.get_connection_info().clone());
        Ok((found, generation))
    }

    /// A connection of `generation` broke or found its master demoted: the next one asks
    /// the sentinels (unless a switch already moved on).
    pub(super) fn suspect(&self, generation: u64) {
        if *self.state.switches.borrow() == generation {
            self.state.lock().master = None;
        }
    }

    /// Subscribes to every sentinel's `+switch-master`, once.
    fn watch(&self) {
        let mut watchers = self.watchers.lock().unwrap_or_else(|e| e.into_inner());
        if !watchers.is_empty() {
            return;
        }
        for sentinel in &self.state.sentinels {
            let state = Arc::clone(&self.state);
            watchers.push(tokio::spawn(follow_switches(state, sentinel.clone())));
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        for watcher in self
            .watchers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            watcher.abort();
        }
    }
}

/// Listens to one sentinel's `+switch-master` for as long as the tracker lives,
/// resubscribing after the sentinel went away.
async fn follow_switches(state: Arc<State>, sentinel: redis::Client) {
    let mut backoff = RESUBSCRIBE.schedule();
    loop {
        match super::pubsub(&sentinel).await {
            Ok(mut pubsub) => {
                if pubsub.subscribe(SWITCH_CHANNEL).await.is_ok() {
                    backoff.reset();
                    let mut messages = pubsub.on_message();
                    while let Some(message) = messages.next().await {
                        if let Ok(text) = message.get_payload::<String>() {
                            state.switched(&text);
                        }
                    }
                }
            }
            Err(error) => {
                tracing::debug!(%error, sentinel = ?sentinel.get_connection_info().addr(), "sentinel subscription failed")
            }
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

// === impl State ===

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn known_client(&self) -> RedisResult<Option<(redis::Client, u64)>> {
        let known = self.lock();
        let generation = *self.switches.borrow();
        match &known.master {
            Some(info) => Ok(Some((redis::Client::open(info.clone())?, generation))),
            None => Ok(None),
        }
    }

    /// The sentinels named `info`; a master at another address than the last is a switch.
    fn found(&self, info: ConnectionInfo) -> u64 {
        let mut known = self.lock();
        let moved = known
            .last
            .as_ref()
            .is_some_and(|last| !same_node(last, info.addr()));
        known.last = Some(info.addr().clone());
        known.fallback = Some(info.clone());
        known.master = Some(info);
        if moved {
            self.switches.send_modify(|generation| *generation += 1);
            tracing::warn!(master = %self.name, "redis master moved; following it");
        }
        *self.switches.borrow()
    }

    /// A `+switch-master` message: follows it if it is about this master.
    fn switched(&self, message: &str) {
        let fields: Vec<&str> = message.split_whitespace().collect();
        let [name, _, _, host, port] = fields.as_slice() else {
            return;
        };
        let Ok(port) = port.parse::<u16>() else {
            return;
        };
        if *name != self.name {
            return;
        }
        let mut known = self.lock();
        if known
            .last
            .as_ref()
            .is_some_and(|last| same_node(last, &at(last, host, port)))
        {
            return;
        }
        // The new master's connection is the old one's with another address (TLS settings
        // and credentials stay); without an old one the sentinels are asked.
        known.master = known.master.take().map(|info| {
            let address = at(info.addr(), host, port);
            info.set_addr(address)
        });
        known.fallback = known.fallback.take().map(|info| {
            let address = at(info.addr(), host, port);
            info.set_addr(address)
        });
        known.last = known.last.as_ref().map(|last| at(last, host, port));
        self.switches.send_modify(|generation| *generation += 1);
        tracing::warn!(master = %self.name, %host, port, "sentinels switched the redis master; following it");
    }

    /// A discovery failed. With no sentinel answering at all, the master last found is tried
    /// rather than none: it is still the master unless a failover came first, and a demoted
    /// one answers `READONLY`, which makes the next connection ask the sentinels again.
    /// Otherwise the error says why, naming the master and the sentinels.
    async fn unfound(&self, error: RedisError) -> RedisResult<(redis::Client, u64)> {
        let asked = self.ask_sentinels().await;
        let fallback = self.lock().fallback.clone();
        match (asked.answered, fallback) {
            (0, Some(info)) => {
                tracing::warn!(master = %self.name, "no sentinel answers; connecting to the redis master last found");
                let client = redis::Client::open(info.clone())?;
                self.lock().master = Some(info);
                Ok((client, *self.switches.borrow()))
            }
            _ => Err(self.explain(error, asked)),
        }
    }

    /// Each sentinel asked for the master's address: how many answered, and the addresses
    /// they named.
    async fn ask_sentinels(&self) -> Asked {
        let name = &self.name;
        let mut answered = 0;
        let mut named = Vec::new();
        for sentinel in &self.sentinels {
            let asked = async {
                let mut conn = sentinel.get_multiplexed_async_connection().await?;
                redis::cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(name)
                    .query_async::<Option<(String, u16)>>(&mut conn)
                    .await
            };
            if let Ok(Ok(address)) = tokio::time::timeout(DIAGNOSIS_TIMEOUT, asked).await {
                answered += 1;
                named.extend(address.map(|(host, port)| format!("{host}:{port}")));
            }
        }
        named.dedup();
        Asked { answered, named }
    }

    /// Says what a failed discovery means, from what the sentinels `asked` said: a sentinel
    /// set out of reach, an unknown master name, or a master that does not answer (a
    /// failover under way).
    fn explain(&self, error: RedisError, asked: Asked) -> RedisError {
        let (name, sentinels) = (&self.name, &self.described);
        let Asked { answered, named } = asked;
        if answered == 0 {
            return RedisError::from((
                ErrorKind::Io,
                "no sentinel answered",
                format!("{sentinels} (master `{name}`): {error}"),
            ));
        }
        if named.is_empty() {
            return RedisError::from((
                ErrorKind::MasterNameNotFoundBySentinel,
                "no sentinel knows the master",
                format!("`{name}` is unknown to the sentinels at {sentinels}"),
            ));
        }
        RedisError::from((
            ErrorKind::Io,
            "the master the sentinels name does not answer as one",
            format!(
                "`{name}` at {}: {error} (a failover may be under way)",
                named.join(", ")
            ),
        ))
    }
}

/// What the sentinels said when asked for the master's address.
struct Asked {
    answered: usize,
    named: Vec<String>,
}

/// `address` moved to `host:port`, keeping its TLS settings.
fn at(address: &ConnectionAddr, host: &str, port: u16) -> ConnectionAddr {
    match address {
        ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => ConnectionAddr::Tcp(host.to_owned(), port),
    }
}

fn same_node(a: &ConnectionAddr, b: &ConnectionAddr) -> bool {
    match (a, b) {
        (ConnectionAddr::Tcp(h1, p1), ConnectionAddr::Tcp(h2, p2))
        | (
            ConnectionAddr::TcpTls {
                host: h1, port: p1, ..
            },
            ConnectionAddr::TcpTls {
                host: h2, port: p2, ..
            },
        ) => h1 == h2 && p1 == p2,
        _ => a == b,
    }
}
