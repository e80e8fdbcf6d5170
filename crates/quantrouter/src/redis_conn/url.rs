//! `--redis-url`: which Redis topology, where, and the data nodes' credentials.
//!
//! ```text
//! redis://[user:password@]host[:port][/db]                                    one server
//! redis+sentinel://[user:password@]host[:port][,host[:port]...]/MASTER[/db]   a Sentinel set
//! redis+cluster://[user:password@]host[:port][,host[:port]...]                a Cluster
//! ```
//!
//! `rediss` in place of `redis` means TLS. The credentials are the data nodes' (the master's,
//! the cluster's); a Sentinel set's own password is a setting of its own, never taken from
//! the URL. Credentials are percent-encoded; a host is a name, an IPv4 address or a bracketed
//! IPv6 address. A bad URL is refused with the part at fault named.

use std::fmt;

use percent_encoding::percent_decode_str;

/// Which Redis a URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// One server.
    Server(Node),
    /// The master named `master` of a Sentinel set, found through any of `sentinels`.
    Sentinel {
        sentinels: Vec<Node>,
        master: String,
    },
    /// A Cluster, discovered from any of `seeds`.
    Cluster { seeds: Vec<Node> },
}

/// A host and port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub host: String,
    pub port: u16,
}

/// A parsed `--redis-url`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    pub topology: Topology,
    pub tls: bool,
    pub username: Option<String>,
    pub password: Option<String>,
    /// The database of a server or Sentinel master (a cluster has only 0).
    pub db: i64,
}

/// Why a `--redis-url` was refused: the part at fault and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--redis-url: {part}: {problem}")]
pub struct UrlError {
    pub part: String,
    pub problem: String,
}

/// The schemes, for error messages.
const SCHEMES: &str =
    "redis, rediss, redis+sentinel, rediss+sentinel, redis+cluster or rediss+cluster";
/// The ports Redis and Sentinel listen on unless told otherwise.
const REDIS_PORT: u16 = 6379;
const SENTINEL_PORT: u16 = 26379;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Server,
    Sentinel,
    Cluster,
}

// === impl RedisUrl ===

impl RedisUrl {
    /// Parses a `--redis-url`, naming the part at fault when it is not one.
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            fault(
                "scheme",
                format!("expected SCHEME://…, SCHEME one of {SCHEMES}"),
            )
        })?;
        let (tls, kind) = scheme_of(scheme)?;
        if let Some((_, query)) = rest.split_once('?') {
            return Err(fault(
                format!("query `?{query}`"),
                "the URL takes no parameters; TLS and passwords have flags of their own",
            ));
        }
        if rest.contains('#') {
            return Err(fault("fragment", "a URL for Redis has no `#…` part"));
        }
        let (authority, path) = match rest.split_once('/') {
            Some((authority, path)) => (authority, Some(path)),
            None => (rest, None),
        };
        let (credentials, hosts) = match authority.rsplit_once('@') {
            Some((credentials, hosts)) => (Some(credentials), hosts),
            None => (None, authority),
        };
        let (username, password) = credentials.map_or(Ok((None, None)), parse_credentials)?;
        let default_port = match kind {
            Kind::Sentinel => SENTINEL_PORT,
            Kind::Server | Kind::Cluster => REDIS_PORT,
        };
        let nodes = parse_hosts(hosts, default_port)?;
        let (topology, db) = topology(scheme, kind, nodes, path)?;
        Ok(Self {
            topology,
            tls,
            username,
            password,
            db,
        })
    }

    /// Whether the URL names a Sentinel set.
    pub fn is_sentinel(&self) -> bool {
        matches!(self.topology, Topology::Sentinel { .. })
    }

    /// Whether the URL names a Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.topology, Topology::Cluster { .. })
    }
}

/// The URL without its password, as logs and errors may show it.
impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tls = if self.tls { "s" } else { "" };
        let (kind, nodes, path) = match &self.topology {
            Topology::Server(node) => ("", std::slice::from_ref(node), String::new()),
            Topology::Sentinel { sentinels, master } => {
                ("+sentinel", sentinels.as_slice(), format!("/{master}"))
            }
            Topology::Cluster { seeds } => ("+cluster", seeds.as_slice(), String::new()),
        };
        write!(f, "redis{tls}{kind}://")?;
        match (&self.username, &self.password) {
            (Some(user), Some(_)) => write!(f, "{user}:***@")?,
            (Some(user), None) => write!(f, "{user}@")?,
            (None, Some(_)) => write!(f, ":***@")?,
            (None, None) => {}
        }
        let hosts: Vec<String> = nodes.iter().map(Node::to_string).collect();
        write!(f, "{}{path}", hosts.join(","))?;
        if self.db != 0 {
            write!(f, "/{}", self.db)?;
        }
        Ok(())
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RedisUrl({self})")
    }
}

// === impl Node ===

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host.contains(':') {
            true => write!(f, "[{}]:{}", self.host, self.port),
            false => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

fn fault(part: impl Into<String>, problem: impl Into<String>) -> UrlError {
    UrlError {
        part: part.into(),
        problem: problem.into(),
    }
}

fn scheme_of(scheme: &str) -> Result<(bool, Kind), UrlError> {
    Ok(match scheme {
        "redis" => (false, Kind::Server),
        "rediss" => (true, Kind::Server),
        "redis+sentinel" => (false, Kind::Sentinel),
        "rediss+sentinel" => (true, Kind::Sentinel),
        "redis+cluster" => (false, Kind::Cluster),
        "rediss+cluster" => (true, Kind::Cluster),
        other => {
            return Err(fault(
                format!("scheme `{other}`"),
                format!("expected {SCHEMES}"),
            ))
        }
    })
}

/// The topology a scheme's kind, its hosts and the URL's path (after the hosts) name, and the
/// database.
fn topology(
    scheme: &str,
    kind: Kind,
    nodes: Vec<Node>,
    path: Option<&str>,
) -> Result<(Topology, i64), UrlError> {
    Ok(match kind {
        Kind::Server => {
            let [node] = <[Node; 1]>::try_from(nodes).map_err(|nodes| {
                fault(
                    "hosts",
                    format!(
                        "{scheme}:// takes one server, not {}: use {scheme}+sentinel:// or {scheme}+cluster:// for several",
                        nodes.len()
                    ),
                )
            })?;
            (Topology::Server(node), parse_db(path.unwrap_or(""))?)
        }
        Kind::Sentinel => {
            let (master, db) = parse_master(path)?;
            let topology = Topology::Sentinel {
                sentinels: nodes,
                master,
            };
            (topology, db)
        }
        Kind::Cluster => {
            if !matches!(path, None | Some("") | Some("0")) {
                return Err(fault(
                    format!("path `/{}`", path.unwrap_or_default()),
                    "a cluster takes no master name and has only database 0",
                ));
            }
            (Topology::Cluster { seeds: nodes }, 0)
        }
    })
}

/// `user:password`, `:password` or `user`, percent-decoded.
fn parse_credentials(text: &str) -> Result<(Option<String>, Option<String>), UrlError> {
    let decode = |part: &str, what: &str| {
        percent_decode_str(part)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|_| fault(what, "its percent-encoding does not decode to UTF-8 text"))
    };
    let (user, password) = match text.split_once(':') {
        Some((user, password)) => (user, Some(password)),
        None => (text, None),
    };
    let user = Some(decode(user, "user name")?).filter(|u| !u.is_empty());
    let password = match password {
        Some(p) => Some(decode(p, "password")?).filter(|p| !p.is_empty()),
        None => None,
    };
    Ok((user, password))
}

/// `host[:port][,host[:port]...]`.
fn parse_hosts(text: &str, default_port: u16) -> Result<Vec<Node>, UrlError> {
    if text.is_empty() {
        return Err(fault("hosts", "no host given"));
    }
    text.split(',')
        .enumerate()
        .map(|(i, entry)| {
            parse_node(entry, default_port)
                .map_err(|problem| fault(format!("host {} `{entry}`", i + 1), problem))
        })
        .collect()
}

fn parse_node(entry: &str, default_port: u16) -> Result<Node, String> {
    let (host, port) = if let Some(bracketed) = entry.strip_prefix('[') {
        let (host, after) = bracketed
            .split_once(']')
            .ok_or("an IPv6 address needs its closing `]`")?;
        let port = match after {
            "" => None,
            _ => Some(
                after
                    .strip_prefix(':')
                    .ok_or("expected `:PORT` after `]`")?,
            ),
        };
        (host, port)
    } else {
        match entry.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (entry, None),
        }
    };
    if host.is_empty() {
        return Err("the host name is empty".into());
    }
    if host
        .chars()
        .any(|c| c.is_whitespace() || matches!(c, '@' | '/' | '[' | ']'))
    {
        return Err("not a host name or address".into());
    }
    let port = match port {
        None => default_port,
        Some(port) => port
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("the port `{port}` is not a number from 1 to 65535"))?,
    };
    Ok(Node {
        host: host.to_owned(),
        port,
    })
}

/// `""` or `"N"`: the database number.
fn parse_db(path: &str) -> Result<i64, UrlError> {
    let path = path.strip_suffix('/').unwrap_or(path);
    if path.is_empty() {
        return Ok(0);
    }
    path.parse::<i64>()
        .ok()
        .filter(|db| *db >= 0)
        .ok_or_else(|| {
            fault(
                format!("database `{path}`"),
                "expected a database number (0, 1, …) after the host",
            )
        })
}

/// `MASTER[/db]`, after the sentinels.
fn parse_master(path: Option<&str>) -> Result<(String, i64), UrlError> {
    let missing = || {
        fault(
            "master name",
            "missing: redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/db]",
        )
    };
    let path = path.ok_or_else(missing)?;
    let (master, db) = match path.split_once('/') {
        Some((master, db)) => (master, parse_db(db)?),
        None => (path, 0),
    };
    if master.is_empty() {
        return Err(missing());
    }
    if master.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(fault(
            format!("master name `{master}`"),
            "a master name has no spaces",
        ));
    }
    Ok((master.to_owned(), db))
}

#[cfg(test)]
mod tests;
