//! Giving the C library's free memory back to the kernel.
//!
//! glibc keeps what a burst of connections freed on its arenas' free lists, so a router that
//! once held 2,000 client connections stayed at 79 MiB after they had gone, and came down to
//! 18 MiB once trimmed (docs/performance.md, *Memory after a burst*). musl, which the image
//! links, gives free memory back by itself; there this is a no-op.

use std::time::Duration;

/// How often [`spawn_trim`] trims.
pub const TRIM_INTERVAL: Duration = Duration::from_secs(10);

/// Every [`TRIM_INTERVAL`], [`release_free_memory`] on a blocking thread: the trim walks and
/// locks glibc's arenas, which must not stall a runtime thread.
pub fn spawn_trim() -> tokio::task::JoinHandle<()> {
    tokio::spawn(async {
        let mut tick = tokio::time::interval(TRIM_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is immediate; nothing has been freed yet.
        tick.tick().await;
        loop {
            tick.tick().await;
            if let Ok(released) = tokio::task::spawn_blocking(release_free_memory).await {
                tracing::trace!(released, "trimmed the heap");
            }
        }
    })
}

/// Returns the free pages of glibc's heap to the kernel (`malloc_trim(0)`); whether any were.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn release_free_memory() -> bool {
    // SAFETY: malloc_trim takes no pointers and has no preconditions; it only locks and
    // walks glibc's own arenas, which any thread may do at any time.
    unsafe { libc::malloc_trim(0) == 1 }
}

/// Returns the free pages of glibc's heap to the kernel; elsewhere there is nothing to do.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() -> bool {
    false
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    fn rss_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    }

    /// What a burst of connections leaves: many 8 KiB buffers freed between small blocks
    /// that stay, so no free memory is at the top of the heap for `free` to give back.
    #[test]
    fn a_burst_freed_between_live_blocks_is_given_back() {
        const BUFFERS: usize = 16 * 1024; // 128 MiB of 8 KiB buffers
        let mut kept = Vec::with_capacity(BUFFERS);
        let mut buffers = Vec::with_capacity(BUFFERS);
        for i in 0..BUFFERS {
            buffers.push(vec![(i as u8) | 1; 8 * 1024]);
            kept.push(Box::new(i));
        }
        drop(buffers);
        let before = rss_kib();
        assert!(release_free_memory(), "malloc_trim released nothing");
        let after = rss_kib();
        // Only the pages wholly inside a free buffer can go: about half of 128 MiB here.
        assert!(
            before.saturating_sub(after) > 32 * 1024,
            "RSS went from {before} KiB to {after} KiB"
        );
        assert_eq!(kept.len(), BUFFERS);
    }
}
