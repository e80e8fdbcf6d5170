use super::*;

fn node(host: &str, port: u16) -> Node {
    Node {
        host: host.into(),
        port,
    }
}

/// A URL, and the topology, TLS, user, password and database it names.
type Case = (
    &'static str,
    Topology,
    bool,
    Option<&'static str>,
    Option<&'static str>,
    i64,
);

#[test]
fn good_urls_parse_into_their_topology_tls_credentials_and_database() {
    let server = |host, port| Topology::Server(node(host, port));
    let table: Vec<Case> = vec![
        ("redis://h", server("h", 6379), false, None, None, 0),
        ("redis://h:6380/", server("h", 6380), false, None, None, 0),
        (
            "redis://127.0.0.1:1/3",
            server("127.0.0.1", 1),
            false,
            None,
            None,
            3,
        ),
        (
            "rediss://:pw@h:6380/0",
            server("h", 6380),
            true,
            None,
            Some("pw"),
            0,
        ),
        (
            "redis://app:s%40cr%3At@h",
            server("h", 6379),
            false,
            Some("app"),
            Some("s@cr:t"),
            0,
        ),
        (
            "redis://u:p:q@h",
            server("h", 6379),
            false,
            Some("u"),
            Some("p:q"),
            0,
        ),
        (
            "redis://[::1]:7000",
            server("::1", 7000),
            false,
            None,
            None,
            0,
        ),
        (
            "redis+sentinel://s1,s2:26380,[::1]/mymaster",
            Topology::Sentinel {
                sentinels: vec![node("s1", 26379), node("s2", 26380), node("::1", 26379)],
                master: "mymaster".into(),
            },
            false,
            None,
            None,
            0,
        ),
        (
            "rediss+sentinel://app:pw@s1:26379/mymaster/2",
            Topology::Sentinel {
                sentinels: vec![node("s1", 26379)],
                master: "mymaster".into(),
            },
            true,
            Some("app"),
            Some("pw"),
            2,
        ),
        (
            "redis+cluster://n1:7000,n2:7001",
            Topology::Cluster {
                seeds: vec![node("n1", 7000), node("n2", 7001)],
            },
            false,
            None,
            None,
            0,
        ),
        (
            "rediss+cluster://:pw@n1/",
            Topology::Cluster {
                seeds: vec![node("n1", 6379)],
            },
            true,
            None,
            Some("pw"),
            0,
        ),
    ];
    for (text, topology, tls, user, password, db) in table {
        let url = RedisUrl::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(url.topology, topology, "{text}");
        assert_eq!(
            (
                url.tls,
                url.username.as_deref(),
                url.password.as_deref(),
                url.db
            ),
            (tls, user, password, db),
            "{text}"
        );
    }
}

#[test]
fn bad_urls_are_refused_naming_the_part_at_fault() {
    let table = [
        ("localhost:6379", "scheme"),
        ("http://h:6379", "scheme `http`"),
        ("redis+sentinels://h/m", "scheme `redis+sentinels`"),
        ("redis://", "hosts"),
        ("redis://h:port", "host 1 `h:port`"),
        ("redis://h:0", "host 1 `h:0`"),
        ("redis://h:70000", "host 1 `h:70000`"),
        ("redis://:pw@:6379", "host 1 `:6379`"),
        ("redis://h1,h2", "hosts"),
        ("redis://h/db1", "database `db1`"),
        ("redis://h/-1", "database `-1`"),
        ("redis://h?protocol=3", "query `?protocol=3`"),
        ("redis://h#x", "fragment"),
        ("redis://u:%ff@h", "password"),
        ("redis+sentinel://s1,s2", "master name"),
        ("redis+sentinel://s1/", "master name"),
        ("redis+sentinel://s1,,s2/m", "host 2 ``"),
        ("redis+sentinel://s1:1,s2:x/m", "host 2 `s2:x`"),
        ("redis+sentinel://s1/m/x", "database `x`"),
        ("redis+sentinel://s1/m n", "master name `m n`"),
        ("redis+sentinel://[::1/m", "host 1 `[::1`"),
        ("redis+cluster://n1:7000/mymaster", "path `/mymaster`"),
        ("rediss+cluster://n1:7000,n2:x", "host 2 `n2:x`"),
    ];
    for (text, part) in table {
        let error = RedisUrl::parse(text).expect_err(text);
        assert_eq!(error.part, part, "{text}: {error}");
        assert!(error.to_string().starts_with("--redis-url: "), "{error}");
    }
}

#[test]
fn the_displayed_url_never_shows_the_password() {
    let url = RedisUrl::parse("rediss+sentinel://app:hunter2@s1:26379,s2:26379/m/1").unwrap();
    let shown = url.to_string();
    assert_eq!(shown, "rediss+sentinel://app:***@s1:26379,s2:26379/m/1");
    assert!(!format!("{url:?}").contains("hunter2"));
}
