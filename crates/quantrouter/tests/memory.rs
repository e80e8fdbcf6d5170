//! The router's memory per stream stays bounded when tokens arrive faster than it forwards
//! them: the real binary, its RSS read from `/proc`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::cell::Cell;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use support::{eventually, sim_tiers, RouterProcess};

const STREAMS: usize = 48;
const TOKENS: u32 = 4000;

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Sends a streamed request and leaves the answer unread until `drain` is signalled (the
/// upstream keeps producing tokens meanwhile), then reads it to the end.
async fn lagging_stream(addr: std::net::SocketAddr, drain: std::sync::Arc<Notify>) -> Vec<u8> {
    let body = serde_json::json!({
        "model": "auto",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": TOKENS,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string();
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    drain.notified().await;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_back_up_keep_memory_per_stream_bounded() {
    let (set, sims) = sim_tiers(Duration::ZERO).await;
    let router = RouterProcess::spawn(&set, &["--log-format", "json"], Stdio::null()).await;
    let pid = router.child.id().unwrap();
    let before = rss_kib(pid);

    let drain = std::sync::Arc::new(Notify::new());
    let mut streams = JoinSet::new();
    for _ in 0..STREAMS {
        streams.spawn(lagging_stream(router.public, std::sync::Arc::clone(&drain)));
    }
    // The backlog is as large as it gets once the simulators' token count stops growing:
    // every stream is either done upstream or blocked on full sockets, and what it produced
    // waits in the kernel's buffers between the simulators, the router and the clients.
    let generated = || sims.iter().map(|sim| sim.generated_tokens()).sum::<u64>();
    let seen = Cell::new((0, 0));
    let stalled = eventually(Duration::from_secs(30), || {
        let (last, unchanged) = seen.get();
        let now = generated();
        let unchanged = if now == last && now > 0 {
            unchanged + 1
        } else {
            0
        };
        seen.set((now, unchanged));
        async move { unchanged >= 10 }
    })
    .await;
    assert!(
        stalled,
        "the upstream never backed up ({} tokens)",
        generated()
    );

    // Drain, sampling the router's RSS until every stream has ended.
    drain.notify_waiters();
    let mut peak = before;
    let mut answers = Vec::new();
    while !streams.is_empty() {
        peak = peak.max(rss_kib(pid));
        if let Ok(Some(answer)) =
            tokio::time::timeout(Duration::from_millis(20), streams.join_next()).await
        {
            answers.push(answer.unwrap());
        }
    }
    for answer in answers {
        let answer = String::from_utf8(answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{}", &answer[..80]);
        assert!(
            answer.contains("data: [DONE]"),
            "every stream ran to its end"
        );
        assert!(answer.matches("\"content\"").count() >= TOKENS as usize);
    }

    // Each stream's backlog is up to ~600 KB. With hyper's growing read buffers (and queued
    // frames pinning them) the router held several times the bound per stream while draining
    // it; a client and an upstream connection with fixed buffers stay well under it
    // (measurements in docs/performance.md, *Memory per request and per stream*).
    let per_stream = (peak - before) / STREAMS as u64;
    eprintln!("router RSS {before} → {peak} KiB: {per_stream} KiB per stream");
    assert!(
        per_stream < 160,
        "router RSS grew by {per_stream} KiB per stream ({before} → {peak} KiB)"
    );
}
