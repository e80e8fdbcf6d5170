//! Profile sets in a real Redis: pushes reach every router, bad documents never replace a
//! good one, routers survive Redis restarts, and the operator CLI's contract holds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use quantrouter::documents::{Document, StoreError};
use quantrouter::profiles::{redis_source, ProfileStore, SourceKind};
use quantrouter_policy::{ProfileSet, DEFAULT_PROFILE_SET, MAX_VERSION};
use support::redis_server::RedisServer;
use support::{eventually, rejected_since, reloads};

fn default_set() -> ProfileSet {
    ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap()
}

fn router(redis: &RedisServer) -> Arc<ProfileStore> {
    let store = Arc::new(ProfileStore::new(default_set(), SourceKind::Embedded));
    redis_source::spawn(Arc::clone(&store), redis.handle(), source_config());
    store
}

fn source_config() -> redis_source::RedisSourceConfig {
    redis_source::RedisSourceConfig {
        prefix: "qr".into(),
        poll: Duration::from_millis(50),
        seed_endpoints: [
            ("llama-3.1-8b-awq", "http://127.0.0.1:1"),
            ("llama-3.1-8b-fp8", "http://127.0.0.1:2"),
            ("llama-3.1-70b-fp8", "http://127.0.0.1:3"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
    }
}

async fn applied(store: &ProfileStore, version: u64) -> bool {
    eventually(Duration::from_secs(5), || async {
        store.load().set.version == version && store.load().source == SourceKind::Redis
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_reaches_every_router() {
    let redis = RedisServer::start(None);
    let routers: Vec<_> = (0..3).map(|_| router(&redis)).collect();
    let ops = redis.store().await;
    let mut set = default_set();
    set.profiles[2].enabled = false;
    let pushed_at = Instant::now();
    let version = ops.push(set).await.unwrap();
    for r in &routers {
        assert!(
            applied(r, version).await,
            "a router missed version {version}"
        );
        assert!(!r.load().set.profiles[2].enabled);
    }
    println!("push to applied on 3 routers: {:?}", pushed_at.elapsed());
    // The next push is one more than the active version, whatever the file says.
    assert_eq!(ops.push(default_set()).await.unwrap(), version + 1);
    for r in &routers {
        assert!(applied(r, version + 1).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_document_written_directly_is_rejected_by_every_router() {
    quantrouter::telemetry::metrics_handle();
    let redis = RedisServer::start(None);
    let routers: Vec<_> = (0..2).map(|_| router(&redis)).collect();
    let ops = redis.store().await;
    let version = ops.push(default_set()).await.unwrap();
    for r in &routers {
        assert!(applied(r, version).await);
    }
    let bad = serde_json::to_string(&default_set())
        .unwrap()
        .replace("\"version\":1", "\"version\":7")
        .replace("0.97", "1.97");
    let before = reloads("redis", "rejected");
    redis
        .raw_set("qr:{profiles}", &bad, Some(("qr:{profiles}:updates", "7")))
        .await;
    assert!(
        rejected_since("redis", before, 2).await,
        "both routers saw and refused it"
    );
    assert!(
        routers.iter().all(|r| r.load().set.version == version),
        "an invalid document replaced the active set"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routers_keep_serving_through_a_redis_restart_and_resubscribe() {
    let redis = RedisServer::start(None);
    let port = redis.port;
    let r = router(&redis);
    let version = redis.store().await.push(default_set()).await.unwrap();
    assert!(applied(&r, version).await);
    // Down: the last good set stays (requests_keep_succeeding_while_redis_is_down covers
    // serving through it).
    drop(redis);
    let redis = RedisServer::start_on(port, None);
    // A fresh Redis is empty; pushing to it is picked up after the router reconnects.
    let mut set = default_set();
    set.version = 40;
    let pushed = redis.store().await.push(set).await.unwrap();
    assert_eq!(
        pushed, 40,
        "an empty Redis takes the document's own version"
    );
    assert!(
        applied(&r, 40).await,
        "the router reconnected and applied the new version"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_and_set_refuses_a_stale_writer() {
    let redis = RedisServer::start(None);
    let ops = redis.store().await;
    let v1 = ops.push(default_set()).await.unwrap();
    let mut mine = default_set();
    mine.version = v1 + 1;
    // Someone else pushes first.
    let theirs = ops.push(default_set()).await.unwrap();
    match ops.push_expecting(&mine, v1 as i64).await {
        Err(StoreError::Conflict { active }) => assert_eq!(active, theirs as i64),
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(
        ops.active().await.unwrap().unwrap().version,
        theirs,
        "nothing was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_past_what_json_numbers_hold_are_refused_by_push_and_by_routers() {
    quantrouter::telemetry::metrics_handle();
    let redis = RedisServer::start(None);
    let ops = redis.store().await;
    // A push of 2^64 - 1 is refused before anything is written.
    let mut huge = default_set();
    huge.version = u64::MAX;
    match ops.push_expecting(&huge, -1).await {
        Err(StoreError::Invalid(e)) => assert!(e.to_string().contains("version: "), "{e}"),
        other => panic!("expected a validation error naming `version`, got {other:?}"),
    }
    assert!(
        ops.active_raw().await.unwrap().is_none(),
        "nothing was written"
    );

    // At the largest version, the next push is refused instead of rounding.
    let mut top = default_set();
    top.version = MAX_VERSION;
    assert_eq!(ops.push(top).await.unwrap(), MAX_VERSION);
    match ops.push(default_set()).await {
        Err(StoreError::Invalid(e)) => assert!(e.to_string().contains("version: "), "{e}"),
        other => panic!("expected a validation error naming `version`, got {other:?}"),
    }
    assert_eq!(ops.active().await.unwrap().unwrap().version, MAX_VERSION);

    // Written past the CLI, such a document is rejected by every router.
    let r = router(&redis);
    assert!(applied(&r, MAX_VERSION).await);
    let text = serde_json::to_string(&default_set())
        .unwrap()
        .replace("\"version\":1,", &format!("\"version\":{},", u64::MAX));
    assert!(text.contains(&u64::MAX.to_string()));
    let before = reloads("redis", "rejected");
    redis
        .raw_set("qr:{profiles}", &text, Some(("qr:{profiles}:updates", "x")))
        .await;
    assert!(rejected_since("redis", before, 1).await);
    assert_eq!(r.load().set.version, MAX_VERSION);
}

/// `INFO` fields of a Redis server, as numbers.
async fn info(conn: &mut redis::aio::MultiplexedConnection, section: &str, field: &str) -> u64 {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .unwrap();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_default();
    // `cmdstat_get:calls=N,...` or `total_connections_received:N`.
    let value = line.strip_prefix("calls=").unwrap_or(line);
    value.split(',').next().unwrap().trim().parse().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_cannot_hold_a_document_is_rejected_without_reconnecting() {
    let redis = RedisServer::start(None);
    let admin = redis
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let connections = || {
        let mut admin = admin.clone();
        async move { info(&mut admin, "stats", "total_connections_received").await }
    };
    let gets = || {
        let mut admin = admin.clone();
        async move { info(&mut admin, "commandstats", "cmdstat_getrange").await }
    };
    let command = |args: &[&[u8]]| {
        let mut admin = admin.clone();
        let mut cmd = redis::cmd(std::str::from_utf8(args[0]).unwrap());
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        async move { cmd.query_async::<()>(&mut admin).await.unwrap() }
    };
    command(&[b"RPUSH", b"qr:{profiles}", b"not a document"]).await;
    let r = router(&redis);
    for round in ["a list", "invalid UTF-8"] {
        if round == "invalid UTF-8" {
            command(&[b"DEL", b"qr:{profiles}"]).await;
            command(&[b"SET", b"qr:{profiles}", b"{\"version\": \xff\xfe}"]).await;
        }
        // The source polls every 50 ms: let it read the key a few times, then count the
        // connections opened over ten more reads (one on reconnect with the old code).
        let start = gets().await;
        let polled = eventually(Duration::from_secs(5), || async {
            gets().await >= start + 3
        })
        .await;
        assert!(polled, "{round}: the source never read the key");
        let (c0, g0) = (connections().await, gets().await);
        let read_ten = eventually(Duration::from_secs(10), || async {
            gets().await >= g0 + 10
        })
        .await;
        assert!(read_ten, "{round}: the source stopped reading the key");
        let opened = connections().await - c0;
        assert!(
            opened <= 1,
            "{round}: {opened} connections over ten reads: a bad document made the source reconnect"
        );
        assert_eq!(
            r.load().source,
            SourceKind::Embedded,
            "{round}: nothing applied"
        );
    }
    // A good document replaces it without a reconnect.
    command(&[b"DEL", b"qr:{profiles}"]).await;
    let version = redis.store().await.push(default_set()).await.unwrap();
    assert!(applied(&r, version).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_restores_an_earlier_set_and_history_is_capped() {
    let redis = RedisServer::start(None);
    let ops = redis.store().await;
    let original = default_set();
    ops.push(original.clone()).await.unwrap();
    let mut changed = original.clone();
    changed.profiles[2].enabled = false;
    for _ in 0..(ProfileSet::HISTORY_CAP + 5) {
        ops.push(changed.clone()).await.unwrap();
    }
    let history = ops.history().await.unwrap();
    assert_eq!(history.len(), ProfileSet::HISTORY_CAP);
    assert!(
        history.windows(2).all(|w| w[0].version > w[1].version),
        "newest first"
    );
    let active = ops.active().await.unwrap().unwrap();
    let target = history.last().unwrap().version;
    let new_version = ops.rollback(Some(target)).await.unwrap();
    assert_eq!(new_version, active.version + 1);
    let restored = ops.active().await.unwrap().unwrap();
    assert_eq!(restored.profiles, changed.profiles);
    assert!(
        matches!(
            ops.rollback(Some(1)).await,
            Err(StoreError::NotInHistory(1))
        ),
        "version 1 fell off the capped history"
    );
}

fn repo_file(path: &str) -> String {
    format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn cli_push_get_history_and_exit_codes() {
    let redis = RedisServer::start(Some("s3cret"));
    let url = redis.url();
    let default = repo_file("profiles/default.json");
    let (code, out, err) = support::cli(&["profiles", "push", &default, "--redis-url", &url]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out.trim(), "pushed version 1");
    let (code, out, _) = support::cli(&["profiles", "push", &default, "--redis-url", &url]);
    assert_eq!((code, out.trim()), (0, "pushed version 2"));
    let (code, out, _) = support::cli(&["profiles", "get", "--redis-url", &url]);
    assert_eq!(code, 0);
    assert_eq!(ProfileSet::from_json(&out).unwrap().version, 2);
    let (code, out, _) = support::cli(&["profiles", "history", "--redis-url", &url]);
    assert_eq!(code, 0);
    assert!(out.trim_start().starts_with("version     1"), "{out}");

    // A pipeline that diffed against version 1 must not overwrite version 2: exit 3.
    let (code, _, err) = support::cli(&[
        "profiles",
        "push",
        &default,
        "--expect-version",
        "1",
        "--redis-url",
        &url,
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("changed"), "{err}");
    let (code, out, _) = support::cli(&[
        "profiles",
        "push",
        &default,
        "--expect-version",
        "2",
        "--redis-url",
        &url,
    ]);
    assert_eq!((code, out.trim()), (0, "pushed version 3"));

    // Invalid input: exit 1 with the JSON path, before any network call.
    let dir = tempfile::Builder::new()
        .prefix("qr-cli-redis-")
        .tempdir()
        .unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        DEFAULT_PROFILE_SET.replace("\"itl_ms\": 7", "\"itl_ms\": 0"),
    )
    .unwrap();
    let (code, _, err) = support::cli(&[
        "profiles",
        "push",
        bad.to_str().unwrap(),
        "--redis-url",
        &url,
    ]);
    assert_eq!(code, 1);
    assert!(
        err.contains("profiles[2].latency.itl_ms: must be > 0"),
        "{err}"
    );

    // Wrong password and unreachable Redis: exit 2, promptly.
    let wrong = format!("redis://:nope@127.0.0.1:{}", redis.port);
    let started = Instant::now();
    let (code, _, err) = support::cli(&["profiles", "get", "--redis-url", &wrong]);
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = support::cli(&["profiles", "get", "--redis-url", "redis://127.0.0.1:1"]);
    assert_eq!(code, 2);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "connection errors must not hang"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_in_flight_during_twenty_pushes_all_succeed() {
    let redis = RedisServer::start(None);
    let h = support::Harness::start_with(Duration::from_millis(2), |_| {}).await;
    let store = Arc::clone(&h.router.app.store);
    redis_source::spawn(Arc::clone(&store), redis.handle(), source_config());
    let ops = redis.store().await;
    // Two sets over the same simulated tiers that route differently.
    let base = store.load().set.clone();
    let mut alternate = base.clone();
    alternate.profiles[2].enabled = false;

    let workers = support::steady_requests(&h.url("/v1/chat/completions"), 8, 30, support::SIMPLE);
    // Spread the pushes over the load.
    let mut pace = tokio::time::interval(Duration::from_millis(15));
    let mut last = 0;
    for i in 0..20 {
        pace.tick().await;
        let set = if i % 2 == 0 {
            alternate.clone()
        } else {
            base.clone()
        };
        last = ops.push(set).await.unwrap();
    }
    let failures = support::failures(workers).await;
    assert!(
        failures.is_empty(),
        "{} failed requests: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
    assert!(applied(&store, last).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_format_list_is_used_when_the_document_is_absent() {
    let redis = RedisServer::start(None);
    let r = router(&redis);
    let seeds = std::fs::read_to_string(repo_file("profiles/examples/seed-list.json")).unwrap();
    redis.raw_set(redis_source::SEED_KEY, &seeds, None).await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            r.load().set.profile("llama-3.1-8b-awq").is_some()
        })
        .await,
        "the seed list was not applied"
    );
    let set = &r.load().set;
    assert_eq!(
        set.profile("llama-3.1-70b-fp8")
            .unwrap()
            .upstream
            .base_urls(),
        vec!["http://127.0.0.1:3"]
    );
    // The real document wins as soon as it exists.
    let version = redis.store().await.push(default_set()).await.unwrap();
    assert!(applied(&r, version).await);
    assert!(r.load().set.profile("llama8b-fp16").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_keep_succeeding_while_redis_is_down() {
    let redis = RedisServer::start(None);
    let h = support::Harness::start().await;
    let store = Arc::clone(&h.router.app.store);
    redis_source::spawn(Arc::clone(&store), redis.handle(), source_config());
    let version = redis
        .store()
        .await
        .push(store.load().set.clone())
        .await
        .unwrap();
    assert!(applied(&store, version).await);
    drop(redis);
    for _ in 0..20 {
        let r = h
            .post(
                "/v1/chat/completions",
                &support::chat("auto", support::SIMPLE),
            )
            .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    }
    assert_eq!(store.load().set.version, version);
    assert_eq!(
        h.get(&h.admin_url("/readyz")).await.status,
        200,
        "still ready on the last good set"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_and_a_password_works_end_to_end() {
    let redis = RedisServer::start_tls(Some("tls-pass"));
    let url = redis.url();
    assert!(url.starts_with("rediss://"));
    let ca = redis.ca_file().unwrap();
    let ca = ca.to_str().unwrap();

    // The operator CLI pushes over TLS, verifying the server against the private CA.
    let default = repo_file("profiles/default.json");
    let args = [
        "--redis-url",
        url.as_str(),
        "--redis-ca-file",
        ca,
        "--redis-prefix",
        "qr",
    ];
    let (code, _, err) = support::cli(&[&["profiles", "push", &default][..], &args].concat());
    assert_eq!(code, 0, "{err}");
    // A router follows the document over TLS.
    let r = router(&redis);
    assert!(applied(&r, 1).await);

    // Without the CA the server's certificate is untrusted: a clear connection error.
    let (code, _, err) = support::cli(&["profiles", "get", "--redis-url", &url]);
    assert_eq!(code, 2, "{err}");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    // A CA file only makes sense with TLS.
    let plain = url.replace("rediss://", "redis://");
    let (code, _, err) = support::cli(&[
        "profiles",
        "get",
        "--redis-url",
        &plain,
        "--redis-ca-file",
        ca,
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("rediss://"), "{err}");
}

/// Start-up prefers Redis, else the file; Redis takes over the moment it is reachable, and a
/// file edit never overrides Redis's set afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_order_redis_then_file_and_redis_takes_over_when_reachable() {
    use quantrouter::profiles::{self, FileSource, ProfileSource};
    use quantrouter::telemetry::metrics_handle;
    metrics_handle();
    let dir = tempfile::Builder::new()
        .prefix("qr-start-order-")
        .tempdir()
        .unwrap();
    let path = dir.path().join("profiles.json");
    let mut file_set = default_set();
    file_set.version = 7;
    std::fs::write(&path, serde_json::to_string(&file_set).unwrap()).unwrap();
    let sources = |redis: &RedisServer| -> Vec<Arc<dyn ProfileSource>> {
        vec![
            Arc::new(redis_source::RedisSource {
                redis: redis.handle(),
                config: source_config(),
            }),
            Arc::new(FileSource {
                path: path.clone(),
                interval: Duration::from_millis(20),
            }),
        ]
    };

    // Redis reachable and holding a document: it wins over the file at start-up.
    let redis = RedisServer::start(None);
    redis.store().await.push(default_set()).await.unwrap();
    let started = profiles::start(sources(&redis)).await.unwrap();
    assert_eq!(started.store.load().source, SourceKind::Redis);
    started.tasks.iter().for_each(|t| t.abort());

    // Redis down at start-up: the file serves, then Redis takes over once it is back.
    let port = redis.port;
    drop(redis);
    let down = RedisServer::start(None);
    let down_sources = {
        let mut s = sources(&down);
        s[0] = Arc::new(redis_source::RedisSource {
            redis: support::redis_server::handle_at(&format!("redis://127.0.0.1:{port}")),
            config: source_config(),
        });
        s
    };
    drop(down);
    let started = profiles::start(down_sources).await.unwrap();
    let store = Arc::clone(&started.store);
    assert_eq!(store.load().source, SourceKind::File);
    assert_eq!(store.load().set.version, 7);
    let redis = RedisServer::start_on(port, None);
    let mut set = default_set();
    set.version = 3;
    redis.store().await.push(set).await.unwrap();
    assert!(
        applied(&store, 3).await,
        "Redis's set replaces the file's, even with a lower version"
    );

    // A later file edit is seen but does not override Redis.
    let before = reloads("file", "ignored");
    file_set.version = 8;
    std::fs::write(&path, serde_json::to_string(&file_set).unwrap()).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            reloads("file", "ignored") > before
        })
        .await
    );
    assert_eq!(store.load().source, SourceKind::Redis);
    assert_eq!(store.load().set.version, 3);
    started.tasks.iter().for_each(|t| t.abort());
}
