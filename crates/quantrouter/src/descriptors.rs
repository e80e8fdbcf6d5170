//! The process's file-descriptor budget: every client connection, upstream connection,
//! listener and Redis or Kubernetes connection is one descriptor, and a process out of them
//! accepts nothing more — not even a readiness probe.
//!
//! At start the soft limit is raised to the hard one (the soft default, often 1024, is a
//! relic of `select()`; the hard limit is what the operator granted). The public port's
//! connection cap is then derived from it, leaving room for what else the router opens.

/// Descriptors kept for everything but client connections and their upstream connections:
/// the admin and scaler ports' own capped connections (32 each), listening sockets, the
/// runtime's own (epoll, wake-ups), Redis
/// (profiles, pub/sub, KEDA numbers), Kubernetes watches, trace export, the profile file,
/// and slack.
const RESERVED: u64 = 128;
/// The kernel's per-process ceiling by default (`fs.nr_open`), for an unlimited soft limit.
const UNLIMITED: u64 = 1 << 20;

/// Raises the soft limit on open descriptors to the hard limit; returns the soft limit in
/// force afterwards (`None`: unlimited).
pub fn raise_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => {
                tracing::info!(from = ?limit.current, to = ?limit.maximum, "raised the open-file limit");
            }
            Err(error) => {
                tracing::warn!(%error, soft = ?limit.current, "cannot raise the open-file limit");
            }
        }
    }
    self::limit()
}

/// The soft limit on open descriptors now (`None`: unlimited).
pub fn limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// The public port's default connection cap under a descriptor limit: half of what is left
/// after [`RESERVED`], because each client connection may hold an upstream connection while
/// its request runs.
pub fn default_max_connections(limit: Option<u64>) -> usize {
    let limit = limit.unwrap_or(UNLIMITED);
    let cap = limit.saturating_sub(RESERVED) / 2;
    usize::try_from(cap).unwrap_or(usize::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_room_for_upstreams_and_the_rest() {
        // A container's usual hard limit, and the old soft default.
        assert_eq!(default_max_connections(Some(1_048_576)), 524_224);
        assert_eq!(default_max_connections(Some(1024)), 448);
        assert_eq!(default_max_connections(Some(256)), 64);
        assert_eq!(default_max_connections(None), 524_224);
        // Too few descriptors for anything: still one connection, never zero.
        assert_eq!(default_max_connections(Some(64)), 1);
    }

    #[test]
    fn raising_leaves_the_soft_limit_at_the_hard_one() {
        let soft = raise_limit();
        let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
        assert_eq!(soft, hard);
    }
}
