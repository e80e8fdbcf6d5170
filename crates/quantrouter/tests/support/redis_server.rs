//! A real redis-server for tests and benchmarks: free loopback port, no persistence,
//! stopped on drop. Shared by `tests/` (through `support`) and `benches/reload.rs`.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
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
    /// For a replica: where it keeps the copy it syncs from its master.
    data_dir: Option<TempDir>,
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
        Self::launch(port, password, None, &[]).expect("redis-server could not listen")
    }

    /// A replica of `master` (same password) on a free port.
    pub fn start_replica(master: &RedisServer) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("qr-replica-")
            .tempdir()
            .unwrap();
        let mut args = vec![
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            master.port.to_string(),
            "--dir".to_owned(),
            dir.path().to_str().unwrap().to_owned(),
        ];
        if let Some(password) = &master.password {
            args.extend(["--masterauth".to_owned(), password.clone()]);
        }
        for _ in 0..LAUNCH_ATTEMPTS {
            if let Ok(mut server) =
                Self::launch(free_port(), master.password.as_deref(), None, &args)
            {
                server.data_dir = Some(dir);
                return server;
            }
        }
        panic!("redis-server could not listen on {LAUNCH_ATTEMPTS} free ports");
    }

    /// A replica stops receiving its master's writes (its link cut, its password to the
    /// master made wrong so it cannot come back) until [`RedisServer::rejoin`]: what it
    /// would be promoted with lags, as a replica's does under load or a partition.
    pub fn lag(&self) {
        let mut conn = self.client().get_connection().unwrap();
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("masterauth")
            .arg("not-the-password")
            .query::<()>(&mut conn)
            .unwrap();
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("master")
            .query::<u64>(&mut conn)
            .unwrap();
        let cut = wait_until(Duration::from_secs(10), || {
            info(&self.client(), "replication").contains("master_link_status:down")
        });
        assert!(cut, "the replica's link to its master stayed up");
    }

    /// Lets a lagging replica reach its master again.
    pub fn rejoin(&self) {
        let mut conn = self.client().get_connection().unwrap();
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("masterauth")
            .arg(self.password.as_deref().unwrap())
            .query::<()>(&mut conn)
            .unwrap();
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
            match Self::launch(free_port(), password, tls_dir, &[]) {
                Ok(server) => return server,
                Err(returned) => tls_dir = returned,
            }
        }
        panic!("redis-server could not listen on {LAUNCH_ATTEMPTS} free ports");
    }

    /// Starts redis-server on `port` (with `extra` arguments) and waits until it answers
    /// there; when it exits instead (the port was taken), gives the certificate directory
    /// back.
    fn launch(
        port: u16,
        password: Option<&str>,
        tls_dir: Option<TempDir>,
        extra: &[String],
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
        cmd.args(extra);
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server not found: run scripts/install-tools redis (scripts/test does)");
        let mut server = Self {
            port,
            password: password.map(str::to_owned),
            tls_dir,
            data_dir: None,
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

    /// Kills the server at once (SIGKILL), as a crashed node or a lost machine.
    pub fn kill(&self) {
        self.signal("-KILL");
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

/// A Sentinel set on loopback: a master, its replica and three sentinels (quorum 2) with
/// short timeouts, so a killed master is replaced within seconds. Stopped on drop.
pub struct SentinelSet {
    /// The master's name the sentinels know.
    pub name: String,
    /// The first master, then its replica.
    pub nodes: Vec<RedisServer>,
    sentinels: Vec<Sentinel>,
    data_password: Option<String>,
    sentinel_password: Option<String>,
}

/// One sentinel process, stopped on drop.
pub struct Sentinel {
    port: u16,
    child: Child,
    /// The sentinel's configuration file, which it rewrites, and its log.
    dir: TempDir,
}

impl SentinelSet {
    /// Starts the set and waits until every sentinel knows the replica and the other two
    /// sentinels (only then can they agree on a failover). The master and replica take
    /// `data_password`; the sentinels `sentinel_password`.
    pub fn start(name: &str, data_password: Option<&str>, sentinel_password: Option<&str>) -> Self {
        let master = RedisServer::start(data_password);
        let replica = RedisServer::start_replica(&master);
        let synced = wait_until(Duration::from_secs(10), || {
            info(&replica.client(), "replication").contains("master_link_status:up")
        });
        assert!(synced, "the replica did not sync with its master");
        let sentinels = (0..3)
            .map(|_| Sentinel::start(name, &master, sentinel_password))
            .collect();
        let set = Self {
            name: name.to_owned(),
            nodes: vec![master, replica],
            sentinels,
            data_password: data_password.map(str::to_owned),
            sentinel_password: sentinel_password.map(str::to_owned),
        };
        let agreed = wait_until(Duration::from_secs(20), || {
            set.sentinel_clients().iter().all(|client| {
                let Some(state) = sentinel_master(client, name) else {
                    return false;
                };
                state.get("num-slaves").map(String::as_str) == Some("1")
                    && state.get("num-other-sentinels").map(String::as_str) == Some("2")
            })
        });
        assert!(
            agreed,
            "the sentinels did not find the replica and each other"
        );
        set
    }

    /// `redis+sentinel://[:DATA_PASSWORD@]127.0.0.1:A,127.0.0.1:B,127.0.0.1:C/NAME`.
    pub fn url(&self) -> String {
        let credentials = self
            .data_password
            .as_ref()
            .map_or_else(String::new, |p| format!(":{p}@"));
        format!(
            "redis+sentinel://{credentials}{}/{}",
            self.sentinel_hosts(),
            self.name
        )
    }

    /// `127.0.0.1:A,127.0.0.1:B,127.0.0.1:C`.
    pub fn sentinel_hosts(&self) -> String {
        loopback_hosts(self.sentinels.iter().map(|s| s.port))
    }

    pub fn sentinel_password(&self) -> Option<&str> {
        self.sentinel_password.as_deref()
    }

    /// The router's handle on the set.
    pub fn handle(&self) -> Redis {
        Redis::open(&RedisSettings {
            url: self.url(),
            ca_file: None,
            sentinel_password: self.sentinel_password.clone(),
        })
        .unwrap()
    }

    /// Stops every sentinel: the set goes on without anyone to name its master.
    pub fn stop_sentinels(&mut self) {
        self.sentinels.clear();
    }

    /// The master's port as the first sentinel that answers names it.
    pub fn master_port(&self) -> Option<u16> {
        self.sentinel_clients().iter().find_map(|client| {
            let mut conn = client
                .get_connection_with_timeout(Duration::from_secs(1))
                .ok()?;
            let (_, port): (String, u16) = redis::cmd("SENTINEL")
                .arg("GET-MASTER-ADDR-BY-NAME")
                .arg(&self.name)
                .query(&mut conn)
                .ok()?;
            Some(port)
        })
    }

    /// The node listening on `port`.
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes.iter().find(|n| n.port == port).unwrap()
    }

    /// Waits until the sentinels name another master than the one on `old_port`.
    pub fn wait_for_new_master(&self, old_port: u16, deadline: Duration) -> Option<u16> {
        let mut found = None;
        wait_until(deadline, || {
            found = self.master_port().filter(|p| *p != old_port);
            found.is_some()
        });
        found
    }

    /// What the sentinels logged, for a failure's message.
    pub fn logs(&self) -> String {
        self.sentinels
            .iter()
            .map(|s| {
                let log = std::fs::read_to_string(s.dir.path().join("sentinel.log"));
                format!("--- sentinel {}\n{}", s.port, log.unwrap_or_default())
            })
            .collect()
    }

    fn sentinel_clients(&self) -> Vec<redis::Client> {
        self.sentinels
            .iter()
            .map(|s| sentinel_client(s.port, self.sentinel_password.as_deref()))
            .collect()
    }
}

impl Sentinel {
    /// A sentinel that monitors no master: it knows no master name at all.
    pub fn alone() -> Self {
        Self::launch(None, None)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    fn start(name: &str, master: &RedisServer, password: Option<&str>) -> Self {
        Self::launch(Some((name, master)), password)
    }

    fn launch(monitor: Option<(&str, &RedisServer)>, password: Option<&str>) -> Self {
        for _ in 0..LAUNCH_ATTEMPTS {
            let dir = tempfile::Builder::new()
                .prefix("qr-sentinel-")
                .tempdir()
                .unwrap();
            let port = free_port();
            let mut conf = format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 sentinel resolve-hostnames no\n",
                dir = dir.path().display(),
            );
            if let Some((name, master)) = monitor {
                conf.push_str(&format!(
                    "sentinel monitor {name} 127.0.0.1 {port} 2\n\
                     sentinel down-after-milliseconds {name} 1000\n\
                     sentinel failover-timeout {name} 5000\n",
                    port = master.port,
                ));
                if let Some(p) = &master.password {
                    conf.push_str(&format!("sentinel auth-pass {name} {p}\n"));
                }
            }
            if let Some(p) = password {
                conf.push_str(&format!("requirepass {p}\nsentinel sentinel-pass {p}\n"));
            }
            let path = dir.path().join("sentinel.conf");
            std::fs::write(&path, conf).unwrap();
            let child = Command::new("redis-server")
                .arg(&path)
                .arg("--sentinel")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server not found: run scripts/install-tools redis");
            let mut sentinel = Self { port, child, dir };
            let client = sentinel_client(port, password);
            let up = wait_until(Duration::from_secs(10), || {
                sentinel.child.try_wait().ok().flatten().is_some()
                    || client
                        .get_connection_with_timeout(Duration::from_secs(1))
                        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                        .is_ok()
            });
            if up && sentinel.child.try_wait().ok().flatten().is_none() {
                return sentinel;
            }
        }
        panic!("redis sentinel could not listen on {LAUNCH_ATTEMPTS} free ports");
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sentinel_client(port: u16, password: Option<&str>) -> redis::Client {
    let url = match password {
        Some(p) => format!("redis://:{p}@127.0.0.1:{port}"),
        None => format!("redis://127.0.0.1:{port}"),
    };
    redis::Client::open(url).unwrap()
}

/// `SENTINEL MASTER name` as a map, if the sentinel answers.
fn sentinel_master(client: &redis::Client, name: &str) -> Option<HashMap<String, String>> {
    let mut conn = client
        .get_connection_with_timeout(Duration::from_secs(1))
        .ok()?;
    redis::cmd("SENTINEL")
        .arg("MASTER")
        .arg(name)
        .query(&mut conn)
        .ok()
}

/// `INFO section` of a node, or "" when it does not answer.
pub fn info(client: &redis::Client, section: &str) -> String {
    client
        .get_connection_with_timeout(Duration::from_secs(1))
        .and_then(|mut c| redis::cmd("INFO").arg(section).query::<String>(&mut c))
        .unwrap_or_default()
}

/// Polls `check` (blocking) until it holds or `deadline` passes.
pub fn wait_until(deadline: Duration, mut check: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + deadline;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A Redis Cluster on loopback: masters over all 16384 slots and replicas of the first,
/// with a one-second node timeout so a failover takes seconds. Stopped on drop.
pub struct RedisCluster {
    /// The masters, then the replicas.
    pub nodes: Vec<RedisServer>,
    _dir: TempDir,
}

impl RedisCluster {
    /// `masters` masters (`redis-cli --cluster create`) and `replicas` replicas of the
    /// first; waits until every node reports `cluster_state:ok`.
    pub fn start(masters: usize, replicas: usize) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("qr-cluster-")
            .tempdir()
            .unwrap();
        let nodes: Vec<RedisServer> = (0..masters + replicas)
            .map(|_| cluster_node(dir.path()))
            .collect();
        let hosts = loopback_hosts(nodes[..masters].iter().map(|n| n.port));
        let mut create = vec!["--cluster", "create"];
        create.extend(hosts.split(','));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        redis_cli(&create);
        let cluster = Self { nodes, _dir: dir };
        let first = format!("127.0.0.1:{}", cluster.nodes[0].port);
        let first_id = cluster.node_id(cluster.nodes[0].port);
        for replica in &cluster.nodes[masters..] {
            let host = format!("127.0.0.1:{}", replica.port);
            redis_cli(&[
                "--cluster",
                "add-node",
                &host,
                &first,
                "--cluster-slave",
                "--cluster-master-id",
                &first_id,
            ]);
        }
        let ready = wait_until(Duration::from_secs(20), || {
            cluster
                .nodes
                .iter()
                .all(|n| cluster_info(&n.client()).contains("cluster_state:ok"))
                && cluster.nodes[masters..]
                    .iter()
                    .all(|r| info(&r.client(), "replication").contains("master_link_status:up"))
        });
        assert!(ready, "the cluster did not come up");
        // Formed with a patient handshake (nodes that miss it on a loaded machine never
        // join); from now on a second, so a failover takes seconds.
        for node in &cluster.nodes {
            let mut conn = node.client().get_connection().unwrap();
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("cluster-node-timeout")
                .arg(1000)
                .query::<()>(&mut conn)
                .unwrap();
        }
        cluster
    }

    /// `redis+cluster://127.0.0.1:A,127.0.0.1:B,...` (every node as a seed).
    pub fn url(&self) -> String {
        let hosts = loopback_hosts(self.nodes.iter().map(|n| n.port));
        format!("redis+cluster://{hosts}")
    }

    pub fn handle(&self) -> Redis {
        handle_at(&self.url())
    }

    /// A node's id (`CLUSTER MYID`).
    pub fn node_id(&self, port: u16) -> String {
        let mut conn = self.node(port).client().get_connection().unwrap();
        redis::cmd("CLUSTER").arg("MYID").query(&mut conn).unwrap()
    }

    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes.iter().find(|n| n.port == port).unwrap()
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`, asked of the first node that answers).
    pub fn slot_of(&self, key: &str) -> u16 {
        self.nodes
            .iter()
            .find_map(|node| {
                let mut conn = node.client().get_connection().ok()?;
                redis::cmd("CLUSTER")
                    .arg("KEYSLOT")
                    .arg(key)
                    .query(&mut conn)
                    .ok()
            })
            .unwrap()
    }

    /// The port of the master serving `slot`, as the live node on `asked` sees it.
    pub fn owner(&self, asked: u16, slot: u16) -> Option<u16> {
        let mut conn = self.node(asked).client().get_connection().ok()?;
        let ranges: Vec<redis::Value> = redis::cmd("CLUSTER").arg("SLOTS").query(&mut conn).ok()?;
        ranges.into_iter().find_map(|range| {
            let redis::Value::Array(fields) = range else {
                return None;
            };
            let start: u16 = redis::from_redis_value_ref(fields.first()?).ok()?;
            let end: u16 = redis::from_redis_value_ref(fields.get(1)?).ok()?;
            let redis::Value::Array(master) = fields.get(2)? else {
                return None;
            };
            let port: u16 = redis::from_redis_value_ref(master.get(1)?).ok()?;
            (start..=end).contains(&slot).then_some(port)
        })
    }

    /// Moves the lowest `slots` slots of the master on `from` to the one on `to`
    /// (`redis-cli --cluster reshard`), keys and all, once every node agrees on the slots
    /// (as it checks first, and refuses otherwise: right after a failover some may not).
    pub fn reshard(&self, from: u16, to: u16, slots: u16) {
        let entry = format!("127.0.0.1:{to}");
        let agreed = wait_until(Duration::from_secs(20), || {
            Command::new("redis-cli")
                .args(["--cluster", "check", &entry])
                .stdin(Stdio::null())
                .output()
                .is_ok_and(|out| out.status.success())
        });
        assert!(agreed, "the cluster's nodes did not agree on its slots");
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        redis_cli(&[
            "--cluster",
            "reshard",
            &format!("127.0.0.1:{to}"),
            "--cluster-from",
            &from_id,
            "--cluster-to",
            &to_id,
            "--cluster-slots",
            &slots.to_string(),
            "--cluster-yes",
        ]);
    }
}

/// `127.0.0.1:A,127.0.0.1:B,…`.
fn loopback_hosts(ports: impl Iterator<Item = u16>) -> String {
    let hosts: Vec<String> = ports.map(|port| format!("127.0.0.1:{port}")).collect();
    hosts.join(",")
}

/// `CLUSTER INFO` of a node, or "" when it does not answer.
pub fn cluster_info(client: &redis::Client) -> String {
    client
        .get_connection_with_timeout(Duration::from_secs(1))
        .and_then(|mut c| redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c))
        .unwrap_or_default()
}

/// A cluster-enabled node on a port whose bus port (+10000) is free too.
fn cluster_node(dir: &Path) -> RedisServer {
    for _ in 0..LAUNCH_ATTEMPTS * 4 {
        // The cluster bus listens on port + 10000, which must be a port too.
        let port = fastrand::u16(20_000..=55_535);
        let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
        if !free(port) || !free(port + 10_000) {
            continue;
        }
        let args: Vec<String> = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            &format!("nodes-{port}.conf"),
            "--cluster-node-timeout",
            "5000",
            "--dir",
            dir.to_str().unwrap(),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        if let Ok(node) = RedisServer::launch(port, None, None, &args) {
            return node;
        }
    }
    panic!("no cluster node could listen");
}

/// Runs `redis-cli` with `args`; it must succeed within a minute (`--cluster create` waits
/// for the nodes to join for as long as it takes).
pub fn redis_cli(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out");
    let mut child = Command::new("redis-cli")
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-cli not found: run scripts/install-tools redis");
    let mut status = None;
    wait_until(Duration::from_secs(60), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let text = std::fs::read_to_string(&out_path).unwrap_or_default();
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        panic!("redis-cli {args:?} did not finish within a minute: {text}");
    };
    assert!(status.success(), "redis-cli {args:?}: {text}");
    text
}
