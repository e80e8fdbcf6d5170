//! Push-to-applied latency: how long after `profiles push` returns every router replica is
//! routing with the new version. Starts its own redis-server on a free loopback port.
//!
//! `cargo bench -p quantrouter --bench reload` (PUSHES=200 REPLICAS=3 by default)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use quantrouter::profiles::redis_source::{self, RedisSourceConfig};
use quantrouter::profiles::{ProfileStore, SourceKind};
use quantrouter_policy::{ProfileSet, DEFAULT_PROFILE_SET};

#[path = "../tests/support/redis_server.rs"]
mod redis_server;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pushes = env_or("PUSHES", 200);
    let replicas = env_or("REPLICAS", 3);
    let server = redis_server::RedisServer::start(None);
    let client = server.handle();
    let ops = server.store().await;
    let set = ProfileSet::from_json(DEFAULT_PROFILE_SET).unwrap();
    let routers: Vec<Arc<ProfileStore>> = (0..replicas)
        .map(|_| {
            let store = Arc::new(ProfileStore::new(set.clone(), SourceKind::Embedded));
            let config = RedisSourceConfig {
                prefix: "qr".into(),
                // Long poll so the numbers measure pub/sub, not the safety net.
                poll: Duration::from_secs(60),
                seed_endpoints: Default::default(),
            };
            redis_source::spawn(Arc::clone(&store), client.clone(), config);
            store
        })
        .collect();

    let mut samples = Vec::with_capacity(pushes);
    for _ in 0..pushes {
        let version = ops.push(set.clone()).await.unwrap();
        let pushed = Instant::now();
        // Spin (yielding) until every replica has applied: no timer granularity in the number.
        while !routers
            .iter()
            .all(|r| r.load().set.version == version && r.load().source == SourceKind::Redis)
        {
            assert!(
                pushed.elapsed() < Duration::from_secs(10),
                "version {version} never applied"
            );
            tokio::task::yield_now().await;
        }
        samples.push(pushed.elapsed());
    }
    samples.sort();
    let pct = |p: f64| {
        samples[((samples.len() as f64 * p).ceil() as usize)
            .saturating_sub(1)
            .min(samples.len() - 1)]
    };
    println!(
        "push-to-applied on {replicas} replicas over {pushes} pushes: p50 {:?}  p90 {:?}  p99 {:?}  max {:?}",
        pct(0.50),
        pct(0.90),
        pct(0.99),
        samples[samples.len() - 1]
    );
    drop(server);
}
