//! A real redis-server for tests and benchmarks: free loopback port, no persistence,
//! stopped on drop. Shared by `tests/` (through `support`) and `benches/reload.rs`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quantrouter::profiles::redis_store::RedisStore;
use tempfile::TempDir;

/// A redis-server on a free loopback port, stopped on drop.
pub struct RedisServer {
    pub port: u16,
    password: Option<String>,
    /// For a TLS-only server: the directory holding its private CA (`ca.crt`), removed on drop.
    tls_dir: Option<TempDir>,
    child: Child,
}

impl RedisServer {
    pub fn start(password: Option<&str>) -> Self {
        Self::start_on(free_port(), password)
    }

    pub fn start_on(port: u16, password: Option<&str>) -> Self {
        Self::launch(port, password, None)
    }

    /// A TLS-only server (`rediss://`) with a certificate for 127.0.0.1 from a private CA
    /// made with the `openssl` command for this server alone.
    pub fn start_tls(password: Option<&str>) -> Self {
        let port = free_port();
        let dir = tempfile::Builder::new()
            .prefix("qr-redis-tls-")
            .tempdir()
            .unwrap();
        make_certificates(dir.path());
        Self::launch(port, password, Some(dir))
    }

    fn launch(port: u16, password: Option<&str>, tls_dir: Option<TempDir>) -> Self {
        let mut cmd = Command::new("redis-server");
        let plain_port = if tls_dir.is_some() { 0 } else { port };
        if let Some(dir) = &tls_dir {
            let file = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
            cmd.args(["--tls-port", &port.to_string()])
                .args(["--tls-cert-file", &file("server.crt")])
                .args(["--tls-key-file", &file("server.key")])
                .args(["--tls-ca-cert-file", &file("ca.crt")])
                .args(["--tls-auth-clients", "no"]);
        }
        cmd.args([
            "--port",
            &plain_port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]);
        if let Some(p) = password {
            cmd.args(["--requirepass", p]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server not found: run scripts/install-tools redis (scripts/test does)");
        let server = Self {
            port,
            password: password.map(str::to_owned),
            tls_dir,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::yield_now();
        }
        server
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls_dir.is_some() {
            "rediss"
        } else {
            "redis"
        };
        match &self.password {
            Some(p) => format!("{scheme}://:{p}@127.0.0.1:{}", self.port),
            None => format!("{scheme}://127.0.0.1:{}", self.port),
        }
    }

    /// The private CA a TLS server's certificate chains to.
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.tls_dir.as_ref().map(|dir| dir.path().join("ca.crt"))
    }

    pub fn client(&self) -> redis::Client {
        quantrouter::profiles::redis_store::client(&self.url(), self.ca_file().as_deref()).unwrap()
    }

    /// Writes a key directly, bypassing the operator CLI (and optionally announces it).
    pub async fn raw_set(&self, key: &str, value: &str, publish: Option<(&str, &str)>) {
        let mut conn = self
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
        if let Some((channel, message)) = publish {
            redis::cmd("PUBLISH")
                .arg(channel)
                .arg(message)
                .query_async::<()>(&mut conn)
                .await
                .unwrap();
        }
    }

    pub async fn store(&self) -> RedisStore {
        RedisStore::connect(&self.client(), "qr").await.unwrap()
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `ca.crt`/`ca.key` and a `server.crt`/`server.key` for 127.0.0.1 signed by it.
fn make_certificates(dir: &Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl not found: run scripts/install-tools redis (scripts/test does)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").unwrap();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=quantrouter-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    ]);
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `tls_dir` (a TempDir) removes itself when dropped after this.
    }
}
