//! The `vllm-sim` binary: banner, serving (HTTPS too), and a clean exit on SIGTERM.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_announces_its_url_serves_and_exits_on_sigterm() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--model",
            "bin-model",
            "--ttft-ms",
            "1",
            "--prefix-cache-blocks",
            "64",
            "--block-size",
            "1",
            "--prefill-us-per-token",
            "10",
        ])
        .env("VLLM_SIM_ITL_MS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let url = line
        .strip_prefix("vllm-sim listening on ")
        .and_then(|rest| rest.trim_end().strip_suffix(" model=bin-model"))
        .unwrap_or_else(|| panic!("unexpected banner {line:?}"))
        .to_owned();
    let addr = url.strip_prefix("http://").unwrap().parse().unwrap();
    let mut stream = raw_post(
        addr,
        "/v1/chat/completions",
        &serde_json::json!({"model": "bin-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    )
    .await;
    let reply = read_until_contains(&mut stream, "\"finish_reason\":\"length\"").await;
    assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
    // One-token blocks: "user\nhi\n" fills two, so the cache was on and queried.
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(
        &mut stream,
        b"GET /metrics HTTP/1.1\r\nhost: sim\r\nconnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    let page = read_until_closed(&mut stream).await;
    assert!(
        page.contains("vllm:prefix_cache_queries_total{model_name=\"bin-model\"} 1\n"),
        "{page}"
    );

    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::task::spawn_blocking(move || child.wait()),
    )
    .await
    .expect("vllm-sim did not exit on SIGTERM")
    .unwrap()
    .unwrap();
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_takes_a_metrics_flavor_and_an_api_key() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--metrics-flavor",
            "sglang",
            "--api-key",
            "sk-bin",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let url = line
        .strip_prefix("vllm-sim listening on ")
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("unexpected banner {line:?}"))
        .to_owned();
    let addr: std::net::SocketAddr = url.strip_prefix("http://").unwrap().parse().unwrap();
    let scrape = |key: Option<&'static str>| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
        let request =
            format!("GET /metrics HTTP/1.1\r\nhost: sim\r\n{auth}connection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.unwrap();
        reply
    };
    assert!(scrape(None).await.starts_with("HTTP/1.1 401"));
    let page = scrape(Some("sk-bin")).await;
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("sglang:num_queue_reqs"), "{page}");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_https_with_a_certificate_and_key_and_refuses_a_bad_key() {
    use std::sync::Arc;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
    let cert = leaf.signed_by(&key, &ca, &ca_key).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();

    let bad_key = dir.path().join("bad.pem");
    std::fs::write(&bad_key, "not a key").unwrap();
    let refused = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args(["--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&cert_path)
        .arg("--tls-key")
        .arg(&bad_key)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!refused.success());

    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args(["--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&cert_path)
        .arg("--tls-key")
        .arg(&key_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        line
    })
    .await
    .unwrap();
    let addr: std::net::SocketAddr = line
        .strip_prefix("vllm-sim listening on https://")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected banner {line:?}"))
        .parse()
        .unwrap();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::from(addr.ip());
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    tls.write_all(b"GET /health HTTP/1.1\r\nhost: sim\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut reply = Vec::new();
    let _ = tls.read_to_end(&mut reply).await;
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
    child.kill().unwrap();
    let _ = child.wait();
}
