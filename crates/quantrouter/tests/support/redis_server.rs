//! A real redis-server for tests and benchmarks: free loopback port, no persistence,
//! stopped on drop. Shared by `tests/` (through `support`) and `benches/reload.rs`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use quantrouter::profiles::redis_store::RedisStore;

/// A redis-server on a free loopback port, stopped on drop.
pub struct RedisServer {
    pub port: u16,
    password: Option<String>,
    child: Child,
}

impl RedisServer {
    pub fn start(password: Option<&str>) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self::start_on(port, password)
    }

    pub fn start_on(port: u16, password: Option<&str>) -> Self {
        let mut cmd = Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
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
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url()).unwrap()
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

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
