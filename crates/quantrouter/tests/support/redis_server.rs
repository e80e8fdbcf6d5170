//! A real redis-server for tests and benchmarks: free loopback port, no persistence,
//! stopped on drop. Shared by `tests/` (through `support`) and `benches/reload.rs`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quantrouter::documents::RedisStore;
use quantrouter::redis_conn::{Redis, RedisSettings};
use quantrouter_policy::ProfileSet;
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
    /// A server on a free port. A port found free can be taken by another test before
    /// redis-server binds it; then redis-server exits and the next free port is tried.
    /// A server on a free port. A port found free can be taken by another test before
    /// redis-server binds it; then redis-server exits and the next free port is tried.
    pub fn start(password: Option<&str>) -> Self {
        Self::start_retrying(password, None)
    }

    pub fn start_on(port: u16, password: Option<&str>) -> Self {
        Self::launch(port, password, None).expect("redis-server could not listen")
    }

    /// A TLS-only server (`rediss://`) with a certificate for 127.0.0.1 from a private CA
    /// made with the `openssl` command for this server alone.
    pub fn start_tls(password: Option<&str>) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("qr-redis-tls-")
            .tempdir()
            .unwrap();
        make_certificates(dir.path());
        Self::start_retrying(password, Some(dir))
    }

    fn start_retrying(password: Option<&str>, mut tls_dir: Option<TempDir>) -> Self {
        for _ in 0..LAUNCH_ATTEMPTS {
            match Self::launch(free_port(), password, tls_dir) {
                Ok(server) => return server,
                Err(returned) => tls_dir = returned,
            }
        }
        panic!("redis-server could not listen on {LAUNCH_ATTEMPTS} free ports");
    }

    /// Starts redis-server on `port` and waits until it answers there; when it exits
    /// instead (the port was taken), gives the certificate directory back.
    fn launch(
        port: u16,
        password: Option<&str>,
        tls_dir: Option<TempDir>,
    ) -> Result<Self, Option<TempDir>> {
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
        let mut server = Self {
            port,
            password: password.map(str::to_owned),
            tls_dir,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Exited: it could not bind (`Drop` has nothing left to kill).
            if server.child.try_wait().ok().flatten().is_some() {
                return Err(server.tls_dir.take());
            }
            if server.answers() {
                return Ok(server);
            }
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Whether redis-server itself listens on the port: it answers `PING` through the same
    /// client the tests use (TLS and password included), which another test's listener that
    /// happens to hold the port would not.
    fn answers(&self) -> bool {
        let Ok(mut conn) = self
            .client()
            .get_connection_with_timeout(Duration::from_secs(2))
        else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut conn).is_ok()
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers, as with a
    /// Redis stuck in a long command or behind a dead network path.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} redis-server");
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

    /// A plain client, for a test to read and write keys itself.
    pub fn client(&self) -> redis::Client {
        let url = self.url();
        match self.ca_file() {
            Some(ca) => {
                quantrouter::tls::install_crypto_provider();
                let certificates = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(std::fs::read(ca).unwrap()),
                };
                redis::Client::build_with_tls(url.as_str(), certificates).unwrap()
            }
            None => redis::Client::open(url).unwrap(),
        }
    }

    /// The router's handle on this server, as `--redis-url` and `--redis-ca-file` make it.
    pub fn handle(&self) -> Redis {
        Redis::open(&RedisSettings {
            url: self.url(),
            ca_file: self.ca_file(),
            sentinel_password: None,
        })
        .unwrap()
    }

    /// The keys matching `pattern` (Redis `KEYS`: fine for a test's small database).
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut conn = self
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut conn)
            .await
            .unwrap()
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

    pub async fn store(&self) -> RedisStore<ProfileSet> {
        RedisStore::connect(&self.handle(), "qr").await.unwrap()
    }
}

/// Free ports tried before a test gives up on starting redis-server.
const LAUNCH_ATTEMPTS: usize = 5;

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

/// The router's handle on whatever `url` names (a dead port, a Sentinel set, a cluster).
pub fn handle_at(url: &str) -> Redis {
    Redis::open(&RedisSettings {
        url: url.to_owned(),
        ..RedisSettings::default()
    })
    .unwrap()
}
