//! Shared state through highly available Redis, all real servers on loopback: a Sentinel
//! set (master, replica, three sentinels) whose master is killed under traffic, a Redis
//! Cluster (three masters, a replica of the first) that fails over and reshards a tenant's
//! slot under traffic, and the faults that must end in a clear error or the documented
//! degraded mode: an unknown master name, no sentinel up, a bad URL, a slot uncovered.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::StatusCode;
use quantrouter::apis::stored::{ResponseStore, Stored};
use quantrouter::calibration::outcomes::{read_stream, stream_key, OutcomeLog};
use quantrouter::documents::RedisStore;
use quantrouter::keda::publish::{ClusterReader, RedisTarget};
use quantrouter::profiles::redis_source::{RedisSource, RedisSourceConfig};
use quantrouter::profiles::{self, Embedded, ProfileSource};
use quantrouter::redis_conn::Redis;
use quantrouter::server::{Server, ServerConfig};
use quantrouter::tenants::limiter::{unix_ms, CounterKeys, CounterSource, Limiter, LimiterConfig};
use quantrouter::tenants::{usage, Clock, TenantSource, TenantStore, Tenants, TenantsConfig};
use quantrouter_policy::limits::{Outcome, Windows};
use quantrouter_policy::{ProfileSet, TenantDocument};
use support::redis_server::{cluster_info, RedisCluster, RedisServer, Sentinel, SentinelSet};
use support::{
    chat, cli, client, eventually, future_noon, loopback, send, sim_tiers, RouterProcess, SIMPLE,
};

/// Tenants of 20 requests a minute, for the checks that the limit is shared again.
const AFTER: [&str; 3] = ["after-1", "after-2", "after-3"];
const DATA_PASSWORD: &str = "data-secret";
const SENTINEL_PASSWORD: &str = "sentinel-secret";
/// The routers' key prefix (the default).
const PREFIX: &str = "quantrouter";

fn key_of(tenant: &str) -> String {
    format!("sk-{tenant}-7fQ2")
}

/// A tenant document in the push format: each tenant with its key and a requests limit.
fn tenants_doc(tenants: &[(&str, u64)]) -> String {
    let tenants: Vec<serde_json::Value> = tenants
        .iter()
        .map(|(id, rpm)| {
            serde_json::json!({"id": id, "keys": [key_of(id)],
                "limits": {"requests_per_minute": rpm}})
        })
        .collect();
    serde_json::json!({"version": 1, "tenants": tenants}).to_string()
}

/// `quantrouter KIND push FILE` of `text` through `url` (and the sentinels' password).
fn push(kind: &str, text: &str, url: &str, sentinel_password: Option<&str>) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("doc.json");
    std::fs::write(&file, text).unwrap();
    let mut args = vec![kind, "push", file.to_str().unwrap(), "--redis-url", url];
    if let Some(p) = sentinel_password {
        args.extend(["--redis-sentinel-password", p]);
    }
    let (code, out, err) = cli(&args);
    (code, format!("{out}{err}"))
}

fn push_ok(kind: &str, text: &str, url: &str, sentinel_password: Option<&str>) {
    let (code, out) = push(kind, text, url, sentinel_password);
    assert_eq!(code, 0, "{kind} push: {out}");
}

fn versioned(set: &ProfileSet, version: u64) -> String {
    let mut set = set.clone();
    set.version = version;
    serde_json::to_string(&set).unwrap()
}

async fn post(addr: std::net::SocketAddr, tenant: &str) -> http::StatusCode {
    let auth = format!("Bearer {}", key_of(tenant));
    let headers = [
        ("content-type", "application/json"),
        ("authorization", auth.as_str()),
    ];
    let url = format!("http://{addr}/v1/chat/completions");
    send(&client(), "POST", &url, &chat("auto", SIMPLE), &headers)
        .await
        .status
}

async fn admin_json(addr: std::net::SocketAddr, path: &str) -> serde_json::Value {
    let r = send(&client(), "GET", &format!("http://{addr}{path}"), "", &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    r.json()
}

/// Requests of `tenant` sent round-robin to `routers` until stopped; every status kept.
struct Traffic {
    stop: Arc<AtomicBool>,
    statuses: Arc<Mutex<Vec<StatusCode>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    fn start(routers: &[std::net::SocketAddr], tenant: &'static str, workers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let statuses = Arc::new(Mutex::new(Vec::new()));
        let workers = (0..workers)
            .map(|w| {
                let (stop, statuses) = (Arc::clone(&stop), Arc::clone(&statuses));
                let routers = routers.to_vec();
                tokio::spawn(async move {
                    let mut i = w;
                    while !stop.load(Ordering::Relaxed) {
                        let status = post(routers[i % routers.len()], tenant).await;
                        statuses.lock().unwrap().push(status);
                        i += 1;
                    }
                })
            })
            .collect();
        Self {
            stop,
            statuses,
            workers,
        }
    }

    fn answered(&self) -> usize {
        self.statuses.lock().unwrap().len()
    }

    /// Waits until `more` further requests were answered.
    async fn flows(&self, more: usize) -> bool {
        let target = self.answered() + more;
        eventually(Duration::from_secs(20), || async {
            self.answered() >= target
        })
        .await
    }

    async fn stop(self) -> Vec<StatusCode> {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers {
            w.await.unwrap();
        }
        Arc::try_unwrap(self.statuses)
            .unwrap()
            .into_inner()
            .unwrap()
    }
}

/// Every status is an answer (200) or a tenant's refusal (429): none failed.
fn all_answered(statuses: &[StatusCode]) -> usize {
    let failed: Vec<_> = statuses
        .iter()
        .filter(|s| **s != StatusCode::OK && **s != StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert!(failed.is_empty(), "requests failed: {failed:?}");
    statuses.iter().filter(|s| **s == StatusCode::OK).count()
}

// --- Sentinel --------------------------------------------------------------------------

/// A `quantrouter serve` on the Sentinel set, logging to `log`.
async fn sentinel_router(
    set: &SentinelSet,
    profiles: &ProfileSet,
    id: &str,
    log: &std::path::Path,
) -> RouterProcess {
    let url = set.url();
    let args = [
        "--redis-url",
        url.as_str(),
        "--redis-sentinel-password",
        set.sentinel_password().unwrap(),
        // Long: a push must reach the routers through pub/sub, not the poll.
        "--redis-poll-ms",
        "60000",
        "--replica-id",
        id,
    ];
    let log = std::fs::File::create(log).unwrap();
    RouterProcess::spawn(profiles, &args, log.into()).await
}

async fn profile_version(admin: std::net::SocketAddr) -> Option<u64> {
    let answer = admin_json(admin, "/admin/profiles").await;
    (answer["source"] == "redis").then(|| answer["version"].as_u64().unwrap())
}

async fn counting_in_redis(admin: std::net::SocketAddr) -> bool {
    let report = admin_json(admin, "/admin/tenants").await;
    report["version"] == 1 && report["counters"] == "redis"
}

/// Limiters of three more replicas on the set, with a clock of their own, for a tenant of
/// 60 requests a minute: they measure the admission bound across the failover.
struct BoundProbe {
    limiters: Vec<Arc<Limiter>>,
    snapshot: Arc<quantrouter::tenants::TenantSnapshot>,
    now: u64,
}

impl BoundProbe {
    async fn start(set: &SentinelSet) -> Self {
        let now = future_noon();
        let mut limiters = Vec::new();
        for i in 0..3 {
            let mut config = LimiterConfig::new(
                Some((set.handle(), "qr-bound".to_owned())),
                format!("bound-{i}"),
            );
            config.heartbeat = Duration::from_millis(100);
            // Patient admission calls: a burst on a busy test machine must not look like an
            // outage (a dead master fails its calls at once anyway).
            config.redis_timeout = Duration::from_secs(2);
            config.clock = Clock::manual(now);
            limiters.push(Arc::new(Limiter::start(config).await));
        }
        let doc = TenantDocument::from_push_json(&tenants_doc(&[("bound", 60)])).unwrap();
        let store = TenantStore::new(None, 50);
        store.apply(&doc, TenantSource::Redis, false).unwrap();
        let probe = Self {
            limiters,
            snapshot: store.load(),
            now,
        };
        assert!(
            probe.all_up(3).await,
            "the probe's limiters did not count in redis"
        );
        probe
    }

    async fn all_up(&self, n: u64) -> bool {
        eventually(Duration::from_secs(30), || async {
            self.limiters
                .iter()
                .all(|l| l.stats().redis_up && l.stats().replicas == n)
        })
        .await
    }

    /// `n` requests at `offset_ms` into the minute, spread over the limiters at once;
    /// returns how many were admitted and where they were decided.
    async fn burst(&self, n: usize, offset_ms: u64) -> (usize, Vec<CounterSource>) {
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let limiter = Arc::clone(&self.limiters[i % 3]);
                let snapshot = Arc::clone(&self.snapshot);
                let at = self.now + offset_ms;
                tokio::spawn(async move {
                    let tenant = snapshot.tenant("bound").unwrap();
                    limiter.admit(tenant, 0, at).await
                })
            })
            .collect();
        let mut admitted = 0;
        let mut sources = Vec::new();
        for task in tasks {
            let a = task.await.unwrap();
            admitted += usize::from(!matches!(a.decision.outcome, Outcome::Refuse { .. }));
            sources.push(a.source);
        }
        (admitted, sources)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sentinel_failover_under_traffic_answers_every_request_and_limits_stay_shared() {
    let set = Arc::new(
        tokio::task::spawn_blocking(|| {
            SentinelSet::start("qr-main", Some(DATA_PASSWORD), Some(SENTINEL_PASSWORD))
        })
        .await
        .unwrap(),
    );
    let (url, sentinel_password) = (set.url(), set.sentinel_password());
    let (profiles, _sims) = sim_tiers(Duration::ZERO).await;
    // Pushed over the Sentinel URL: the URL's password is the master's, the sentinels get
    // their own (a mix-up fails authentication on one side or the other).
    push_ok(
        "profiles",
        &versioned(&profiles, 1),
        &url,
        sentinel_password,
    );
    let mut tenants = vec![("busy", 400)];
    tenants.extend(AFTER.map(|tenant| (tenant, 20)));
    push_ok("tenants", &tenants_doc(&tenants), &url, sentinel_password);
    let logs = tempfile::tempdir().unwrap();
    let log = |i: usize| logs.path().join(format!("r{i}.log"));
    let routers = [
        sentinel_router(&set, &profiles, "r1", &log(1)).await,
        sentinel_router(&set, &profiles, "r2", &log(2)).await,
    ];
    let (publics, admins) = (
        [routers[0].public, routers[1].public],
        [routers[0].admin, routers[1].admin],
    );
    for admin in admins {
        let ready = eventually(Duration::from_secs(20), || async {
            profile_version(admin).await == Some(1) && counting_in_redis(admin).await
        })
        .await;
        assert!(ready, "router {admin} did not load from the Sentinel set");
    }
    let probe = BoundProbe::start(&set).await;

    // Traffic on both routers; the replica stops replicating, so the counters it will be
    // promoted with miss the next burst, as a lagging replica's do.
    let traffic = Traffic::start(&publics, "busy", 4);
    assert!(traffic.flows(40).await, "no traffic before the failover");
    let old = set.master_port().unwrap();
    let replica = set.nodes.iter().find(|n| n.port != old).unwrap();
    tokio::task::block_in_place(|| replica.lag());
    let (before, sources) = probe.burst(200, 0).await;
    assert!(sources.iter().all(|s| *s == CounterSource::Redis));
    let killed = tokio::time::Instant::now();
    set.node(old).kill();
    tokio::task::block_in_place(|| replica.rejoin());
    let answered_at_kill = traffic.answered();
    let (during, _) = probe.burst(90, 1).await;

    let watched = Arc::clone(&set);
    let promoted = tokio::task::spawn_blocking(move || {
        watched.wait_for_new_master(old, Duration::from_secs(60))
    })
    .await
    .unwrap();
    assert!(
        promoted.is_some(),
        "the sentinels promoted no replica:\n{}",
        set.logs()
    );
    let switched = killed.elapsed();
    let shared_again = eventually(Duration::from_secs(30), || async {
        counting_in_redis(admins[0]).await && counting_in_redis(admins[1]).await
    })
    .await;
    assert!(shared_again, "the routers did not count in redis again");
    let recovered = killed.elapsed();
    // They followed the sentinels' announcement, not only their own errors.
    for i in [1, 2] {
        let text = std::fs::read_to_string(log(i)).unwrap();
        assert!(
            text.contains("sentinels switched the redis master"),
            "router r{i} did not hear +switch-master"
        );
    }
    assert!(probe.all_up(3).await);
    let (after, sources) = probe.burst(60, 2).await;
    assert!(sources.iter().all(|s| *s == CounterSource::Redis));
    assert!(traffic.flows(40).await, "no traffic after the failover");
    let statuses = traffic.stop().await;
    let served = all_answered(&statuses);
    let served_after_kill = all_answered(&statuses[answered_at_kill..]);
    assert!(served_after_kill > 0, "nothing was served after the kill");
    // The promoted replica missed the first burst; the re-seed from what the limiters last
    // read keeps the minute within its bound.
    let admitted = before + during + after;
    eprintln!(
        "sentinel failover: master replaced after {switched:?}, shared counting back after \
         {recovered:?}; {} requests answered ({served} served, none failed); tenant at 60/min: \
         {before} admitted before the kill, {during} during, {after} after = {admitted}",
        statuses.len()
    );
    assert!(
        admitted <= 60 * 11 / 10 + 3,
        "{before} + {during} + {after} admitted in a minute of 60"
    );

    // A push after the failover reaches both routers, through their new subscriptions.
    push_ok(
        "profiles",
        &versioned(&profiles, 2),
        &url,
        sentinel_password,
    );
    for admin in admins {
        let reloaded = eventually(Duration::from_secs(10), || async {
            profile_version(admin).await == Some(2)
        })
        .await;
        assert!(
            reloaded,
            "router {admin} missed the push after the failover"
        );
    }
    assert_limit_shared(&publics, &admins).await;
}

/// One router admits a tenant's whole minute (20 requests) and the other then refuses: the
/// limit is counted in one place. A check through which a router did not count in Redis
/// all along (a heartbeat timed out on a loaded test machine: the documented outage), or
/// across which the minute ended, is made again with the next tenant.
/// Clients of `node` other than the one asking.
fn other_clients(node: &support::redis_server::RedisServer) -> usize {
    let mut conn = node.client().get_connection().unwrap();
    let list: String = redis::cmd("CLIENT").arg("LIST").query(&mut conn).unwrap();
    list.lines().count().saturating_sub(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_sentinel_gone_a_broken_connection_finds_the_master_last_found() {
    let mut set = tokio::task::spawn_blocking(|| {
        SentinelSet::start("qr-alone", Some(DATA_PASSWORD), Some(SENTINEL_PASSWORD))
    })
    .await
    .unwrap();
    let (url, sentinel_password) = (set.url(), set.sentinel_password());
    let (profiles, _sims) = sim_tiers(Duration::ZERO).await;
    push_ok(
        "profiles",
        &versioned(&profiles, 1),
        &url,
        sentinel_password,
    );
    push_ok(
        "tenants",
        &tenants_doc(&[("busy", 400)]),
        &url,
        sentinel_password,
    );
    let logs = tempfile::tempdir().unwrap();
    let router = sentinel_router(&set, &profiles, "r1", &logs.path().join("r1.log")).await;
    let ready = eventually(Duration::from_secs(20), || async {
        profile_version(router.admin).await == Some(1) && counting_in_redis(router.admin).await
    })
    .await;
    assert!(ready, "the router did not load from the Sentinel set");
    let master = set.master_port().unwrap();
    set.stop_sentinels();
    // Every connection the router holds breaks; a new one has no sentinel to ask.
    let mut conn = set.node(master).client().get_connection().unwrap();
    for kind in ["normal", "pubsub"] {
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg(kind)
            .query::<u64>(&mut conn)
            .unwrap();
    }
    drop(conn);
    // Requests need the counters: the limiter reconnects, or counts on local shares.
    let back = eventually(Duration::from_secs(20), || async {
        post(router.public, "busy").await;
        other_clients(set.node(master)) > 0 && counting_in_redis(router.admin).await
    })
    .await;
    assert!(
        back,
        "the router did not reconnect to the master it last found"
    );
    assert_eq!(post(router.public, "busy").await, StatusCode::OK);
}

async fn assert_limit_shared(
    publics: &[std::net::SocketAddr; 2],
    admins: &[std::net::SocketAddr; 2],
) {
    let both_count =
        || async { counting_in_redis(admins[0]).await && counting_in_redis(admins[1]).await };
    for tenant in AFTER {
        let ready = eventually(Duration::from_secs(20), both_count).await;
        assert!(ready, "the routers do not count in redis");
        let minute = Windows::at(unix_ms(SystemTime::now())).minute_label();
        let mut first = Vec::new();
        for _ in 0..20 {
            first.push(post(publics[0], tenant).await);
        }
        let second = [
            post(publics[1], tenant).await,
            post(publics[1], tenant).await,
        ];
        let same_minute = Windows::at(unix_ms(SystemTime::now())).minute_label() == minute;
        if !same_minute || !both_count().await {
            continue;
        }
        assert!(first.iter().all(|s| *s == StatusCode::OK), "{first:?}");
        assert_eq!(second, [StatusCode::TOO_MANY_REQUESTS; 2]);
        return;
    }
    panic!("no check of the shared limit ran with both routers counting in redis");
}

// --- Cluster ---------------------------------------------------------------------------

/// A tenant whose keys' hash tag (`{team-208}`) is slot 1: among the lowest of the first
/// master's range, so moving that master's lowest two slots moves its keys.
const SHARD_TENANT: &str = "team-208";

/// A router replica in-process on the cluster, with a clock the test sets.
async fn cluster_router(redis: &Redis, id: &str, clock: &Clock) -> Server {
    let sources: Vec<Arc<dyn ProfileSource>> = vec![
        Arc::new(RedisSource {
            redis: redis.clone(),
            config: RedisSourceConfig {
                prefix: PREFIX.into(),
                poll: Duration::from_secs(60),
                seed_endpoints: Default::default(),
            },
        }),
        Arc::new(Embedded),
    ];
    let store = profiles::start(sources).await.unwrap().store;
    let tenants = TenantsConfig {
        file: None,
        file_interval: Duration::from_secs(1),
        redis: Some((redis.clone(), PREFIX.into())),
        redis_poll: Duration::from_secs(60),
        api_keys: None,
        metrics_top: 50,
    };
    let mut limiter = LimiterConfig::new(Some((redis.clone(), PREFIX.into())), id.into());
    // Quick heartbeats; a patient admission call: a failover or a moving slot is waited
    // through by the cluster's own retries rather than decided locally.
    limiter.heartbeat = Duration::from_millis(100);
    limiter.redis_timeout = Duration::from_secs(2);
    let tenants = Tenants::start(tenants, limiter, clock.clone())
        .await
        .unwrap();
    let mut config = ServerConfig {
        listen: loopback(),
        admin_listen: loopback(),
        shutdown_grace: Duration::from_secs(5),
        ..ServerConfig::default()
    };
    config.tenants = Some(Arc::new(tenants));
    config.stored_responses.redis = Some((redis.clone(), PREFIX.into()));
    Server::start(config, store).await.unwrap()
}

fn limiter_up(router: &Server, replicas: u64) -> bool {
    let stats = router.app.tenants.as_ref().unwrap().limiter.stats();
    stats.redis_up && stats.replicas == replicas
}

/// The shard tenant's requests counted in the cluster for the routers' minute.
async fn shard_requests(redis: &Redis, now: u64) -> u64 {
    let mut conn = redis.connect().await.unwrap();
    let counters = usage::read_counters(&mut conn, PREFIX, &[SHARD_TENANT], now)
        .await
        .unwrap();
    counters[0].requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_shares_state_through_a_failover_and_a_resharding_under_traffic() {
    let cluster = tokio::task::spawn_blocking(|| RedisCluster::start(3, 1))
        .await
        .unwrap();
    let (first, second, replica) = (
        cluster.nodes[0].port,
        cluster.nodes[1].port,
        cluster.nodes[3].port,
    );
    let shard_slot = cluster.slot_of(&format!("{{{SHARD_TENANT}}}"));
    assert_eq!(cluster.owner(second, shard_slot), Some(first));
    let url = cluster.url();
    let redis = cluster.handle();
    let (profiles, _sims) = sim_tiers(Duration::ZERO).await;
    push_ok("profiles", &versioned(&profiles, 1), &url, None);
    let tenants = [(SHARD_TENANT, 1_000_000), ("team-a", 10)];
    push_ok("tenants", &tenants_doc(&tenants), &url, None);
    let now = future_noon();
    let clock = Clock::manual(now);
    let routers = [
        cluster_router(&redis, "c1", &clock).await,
        cluster_router(&redis, "c2", &clock).await,
    ];
    let publics = [routers[0].public_addr(), routers[1].public_addr()];
    let both_up = eventually(Duration::from_secs(20), || async {
        routers.iter().all(|r| limiter_up(r, 2))
    })
    .await;
    assert!(both_up, "the routers did not count in the cluster");
    assert_reloads(&routers, &profiles, &url, 2).await;

    // One router admits team-a's 10 requests of the minute; the other refuses.
    for _ in 0..10 {
        assert_eq!(post(publics[0], "team-a").await, StatusCode::OK);
    }
    assert_eq!(
        post(publics[1], "team-a").await,
        StatusCode::TOO_MANY_REQUESTS
    );

    assert_responses_and_outcomes_are_shared(&routers, &redis).await;
    assert_keda_reads_every_master(&redis).await;

    // The first master (the shard tenant's slot) is killed under traffic; its replica
    // takes over and the routers count in the cluster again.
    let traffic = Traffic::start(&publics, SHARD_TENANT, 4);
    assert!(traffic.flows(40).await);
    cluster.node(first).kill();
    let promoted = eventually(Duration::from_secs(30), || async {
        cluster.owner(second, shard_slot) == Some(replica)
            && cluster_info(&cluster.node(second).client()).contains("cluster_state:ok")
    })
    .await;
    assert!(
        promoted,
        "the replica did not take over the first master's slots"
    );
    let back = eventually(Duration::from_secs(30), || async {
        routers.iter().all(|r| limiter_up(r, 2))
    })
    .await;
    assert!(
        back,
        "the routers did not count in the cluster after its failover"
    );
    assert!(traffic.flows(40).await);
    let failover = traffic.stop().await;
    let served_in_failover = all_answered(&failover);
    let counted = shard_requests(&redis, now).await;
    assert!(
        counted >= served_in_failover as u64 && counted <= served_in_failover as u64 + 4,
        "{counted} counted for {served_in_failover} served through the failover"
    );
    assert_reloads(&routers, &profiles, &url, 3).await;

    // The shard tenant's slot moves to the second master under traffic: nothing is lost.
    let traffic = Traffic::start(&publics, SHARD_TENANT, 4);
    assert!(traffic.flows(40).await);
    let cluster = Arc::new(cluster);
    let resharding = Arc::clone(&cluster);
    // The lowest slots of the promoted replica, up to and with the shard tenant's.
    tokio::task::spawn_blocking(move || resharding.reshard(replica, second, shard_slot + 1))
        .await
        .unwrap();
    assert_eq!(cluster.owner(second, shard_slot), Some(second));
    assert!(traffic.flows(40).await);
    let resharded = traffic.stop().await;
    let served_in_reshard = all_answered(&resharded);
    let counted_after = shard_requests(&redis, now).await;
    assert_eq!(
        counted_after - counted,
        served_in_reshard as u64,
        "requests counted while the slot moved"
    );
    eprintln!(
        "cluster: {served_in_failover} served through the failover ({counted} counted), \
         {served_in_reshard} through the resharding ({} counted)",
        counted_after - counted
    );

    assert_an_uncovered_slot_is_a_clear_error(&cluster, &routers, &url).await;
}

/// A push through the CLI reaches both routers (pub/sub, the poll is a minute).
async fn assert_reloads(routers: &[Server; 2], profiles: &ProfileSet, url: &str, version: u64) {
    push_ok("profiles", &versioned(profiles, version), url, None);
    let reloaded = eventually(Duration::from_secs(10), || async {
        routers
            .iter()
            .all(|r| r.app.store.load().set.version == version)
    })
    .await;
    assert!(reloaded, "a push of version {version} missed a router");
}

async fn assert_responses_and_outcomes_are_shared(routers: &[Server; 2], redis: &Redis) {
    // A response stored through one replica is found through the other.
    let stored: &Arc<ResponseStore> = &routers[0].app.responses;
    let owned = Stored {
        profile: "p-int4".into(),
        tenant: Some("team-a".into()),
    };
    stored.remember("resp_cluster_1".into(), owned);
    let found = eventually(Duration::from_secs(5), || async {
        let responses = &routers[1].app.responses;
        responses.profile_of("resp_cluster_1", Some("team-a")).await == Some("p-int4".into())
            && responses
                .profile_of("resp_cluster_1", Some("team-b"))
                .await
                .is_none()
    })
    .await;
    assert!(
        found,
        "a stored response's placement did not reach the other replica"
    );

    // An outcome record written to the stream reads back.
    let log = OutcomeLog::new(Some((redis.clone(), PREFIX.into())), false);
    let sink: quantrouter_policy::OutcomeSink =
        serde_json::from_value(serde_json::json!({"redis": true})).unwrap();
    let inputs = quantrouter_policy::classifier::OutcomeInputs::of_text("What is 2 + 2?", 4096);
    let record = quantrouter_policy::classifier::TrafficOutcome {
        features: inputs.named(),
        inputs: quantrouter_policy::classifier::OUTCOME_INPUTS,
        task_class: quantrouter_policy::TaskClass::Math,
        cheap_profile: "cheap".into(),
        reference_profile: "reference".into(),
        agreed: true,
        prompt: None,
    };
    log.write(&sink, &record).await;
    let read = read_stream(redis, &stream_key(PREFIX)).await.unwrap();
    assert_eq!(read.len(), 1, "{read:?}");
    assert_eq!(
        read[0].task_class,
        Some(quantrouter_policy::TaskClass::Math)
    );
}

/// Tier numbers written under keys in many slots are all found (a SCAN of every master).
async fn assert_keda_reads_every_master(redis: &Redis) {
    let mut conn = redis.connect().await.unwrap();
    for replica in ["r-a", "r-b", "r-c", "r-d", "r-e", "r-f"] {
        let record = serde_json::json!({"tier": "int4", "replica": replica,
            "admission_waiting": 1, "inflight": 2, "endpoints": {}});
        redis::cmd("SET")
            .arg(quantrouter::keda::publish::key(PREFIX, "int4", replica))
            .arg(record.to_string())
            .arg("PX")
            .arg(60_000)
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
    }
    let target = RedisTarget {
        redis: redis.clone(),
        prefix: PREFIX.into(),
    };
    let reader = ClusterReader::new(target, "r-a".into());
    let others = reader.others("int4", Duration::from_secs(3)).await.unwrap();
    assert_eq!(others.len(), 5);
}

/// Every node drops one slot: the cluster is down. A push is refused with the cluster's
/// own error (exit 2, no hang); the routers go on answering, on local shares of the limits.
async fn assert_an_uncovered_slot_is_a_clear_error(
    cluster: &RedisCluster,
    routers: &[Server; 2],
    url: &str,
) {
    let unused = cluster.slot_of("a key of no tenant");
    let live: Vec<u16> = cluster.nodes[1..].iter().map(|n| n.port).collect();
    for port in &live {
        let mut conn = cluster.node(*port).client().get_connection().unwrap();
        let _: Result<(), _> = redis::cmd("CLUSTER")
            .arg("DELSLOTS")
            .arg(unused)
            .query(&mut conn);
    }
    let down = eventually(Duration::from_secs(10), || async {
        let documents = cluster.slot_of("{profiles}");
        let holder = cluster.owner(live[0], documents).unwrap_or(live[0]);
        cluster_info(&cluster.node(holder).client()).contains("cluster_state:fail")
    })
    .await;
    assert!(down, "the cluster did not go down with a slot uncovered");
    let started = std::time::Instant::now();
    let profiles = routers[0].app.store.load().set.clone();
    let (code, out) = push("profiles", &versioned(&profiles, 9), url, None);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("ClusterDown"), "{out}");
    assert!(started.elapsed() < Duration::from_secs(15));
    let publics = [routers[0].public_addr(), routers[1].public_addr()];
    for public in publics {
        let status = post(public, SHARD_TENANT).await;
        assert_eq!(status, StatusCode::OK);
    }
}

// --- Faults ----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_unknown_masters_and_absent_sentinels_are_clear_errors_never_hangs() {
    let (profiles, _sims) = sim_tiers(Duration::ZERO).await;
    let started = std::time::Instant::now();

    // A bad URL is refused at start-up, naming the part at fault.
    let (code, _, err) = cli(&["serve", "--redis-url", "redis+sentinel://127.0.0.1:26379"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--redis-url: master name"), "{err}");
    let (code, _, err) = cli(&[
        "profiles",
        "get",
        "--redis-url",
        "redis://127.0.0.1:6379",
        "--redis-sentinel-password",
        "x",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--redis-sentinel-password needs"), "{err}");

    // A sentinel that knows no master of that name.
    let lone = Sentinel::alone();
    let unknown = format!("redis+sentinel://127.0.0.1:{}/no-such-master", lone.port());
    let (code, _, err) = cli(&["profiles", "get", "--redis-url", &unknown]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("no sentinel knows the master") && err.contains("no-such-master"),
        "{err}"
    );

    // No sentinel up at all.
    let (_socket_a, a) = support::refusing_address();
    let (_socket_b, b) = support::refusing_address();
    let absent = format!("redis+sentinel://{a},{b}/mymaster");
    let (code, _, err) = cli(&["tenants", "usage", "--redis-url", &absent]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no sentinel answered"), "{err}");

    // A router started on either serves from its file and keeps trying (degraded mode).
    for url in [&unknown, &absent] {
        let router = RouterProcess::spawn(
            &profiles,
            &["--redis-url", url.as_str()],
            std::process::Stdio::null(),
        )
        .await;
        let answer = admin_json(router.admin, "/admin/profiles").await;
        assert_eq!(answer["source"], "file");
        let r = send(
            &client(),
            "POST",
            &router.url("/v1/chat/completions"),
            &chat("auto", SIMPLE),
            &[("content-type", "application/json")],
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the faults took {:?}",
        started.elapsed()
    );
}

// --- Upgrade ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_finds_the_documents_and_counters_of_the_former_key_layout() {
    let redis = RedisServer::start(None);
    let now = future_noon();
    // What routers of the layout before hash tags left: a profile set and its history, a
    // tenant document, the counters' epoch and a tenant's counters of the minute.
    let (profiles, _sims) = sim_tiers(Duration::ZERO).await;
    let mut tenants = TenantDocument::from_push_json(&tenants_doc(&[("team-a", 60)])).unwrap();
    tenants.version = 3;
    let former = CounterKeys::former("qr", "team-a", Windows::at(now));
    let mut conn = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut pipe = redis::pipe();
    pipe.set("qr:profiles", versioned(&profiles, 5))
        .rpush("qr:profiles:history", versioned(&profiles, 4))
        .set("qr:tenants", serde_json::to_string(&tenants).unwrap())
        .set(
            "qr:tenants:epoch",
            "old-replica-1700000000000:1700000000000",
        )
        .set(&former.requests, 40)
        .set(&former.tokens, 900);
    pipe.query_async::<()>(&mut conn).await.unwrap();

    // The documents are copied to the current keys the first time a router or operator
    // connects, history and all.
    let store = RedisStore::<ProfileSet>::connect(&redis.handle(), "qr")
        .await
        .unwrap();
    assert_eq!(store.keys().active, "qr:{profiles}");
    assert_eq!(store.active().await.unwrap().unwrap().version, 5);
    let history = store.history().await.unwrap();
    assert_eq!(history.iter().map(|h| h.version).collect::<Vec<_>>(), [4]);

    // A router of this version starts on the tenant document, and carries the minute's
    // counters over before it counts in Redis: the tenant does not get its minute again.
    let config = TenantsConfig {
        file: None,
        file_interval: Duration::from_secs(1),
        redis: Some((redis.handle(), "qr".into())),
        redis_poll: Duration::from_secs(60),
        api_keys: None,
        metrics_top: 50,
    };
    let mut limiter = LimiterConfig::new(Some((redis.handle(), "qr".into())), "new-1".into());
    limiter.heartbeat = Duration::from_millis(50);
    let clock = Clock::manual(now);
    let tenants = Tenants::start(config, limiter, clock).await.unwrap();
    assert_eq!(tenants.store.load().version, 3);
    let up = eventually(Duration::from_secs(10), || async {
        tenants.limiter.stats().redis_up
    })
    .await;
    assert!(up, "the limiter did not count in redis");
    let (counters, source) = tenants.limiter.counters("team-a", now).await;
    assert_eq!(source, CounterSource::Redis);
    assert_eq!((counters.requests, counters.tokens), (40, 900));
}
