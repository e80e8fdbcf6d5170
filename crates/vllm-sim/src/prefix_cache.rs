//! vLLM's automatic prefix caching, reduced to what a router can see from outside: a prompt
//! is cut into blocks of `block_size` tokens, each block's hash chains the hash of the block
//! before it (so a block matches only behind the same prefix), and a fixed number of blocks
//! is kept, the least recently used evicted first. A request's `cache_salt` goes into its
//! first block's hash, as in vLLM, so prompts with different salts share no block.
//!
//! Tokens are counted as [`crate::generate::PromptDigest`] counts them: four bytes each.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// Bytes per simulated token, the same rule of thumb as the prompt token count.
const BYTES_PER_TOKEN: usize = 4;

/// The cached blocks of one simulated server.
#[derive(Debug)]
pub(crate) struct PrefixCache {
    block_size: usize,
    capacity: usize,
    lru: Mutex<Lru>,
}

/// Block hash to last use, and last use to block hash, so the oldest is found in log time.
#[derive(Debug, Default)]
struct Lru {
    used: HashMap<u64, u64>,
    by_age: BTreeMap<u64, u64>,
    clock: u64,
}

// === impl PrefixCache ===

impl PrefixCache {
    /// A cache of `capacity` blocks of `block_size` tokens; `None` when either is zero.
    pub(crate) fn new(capacity: usize, block_size: usize) -> Option<Self> {
        (capacity > 0 && block_size > 0).then(|| Self {
            block_size,
            capacity,
            lru: Mutex::default(),
        })
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The chained hashes of `text`'s full blocks under `salt`; a partial last block is
    /// never cached.
    pub(crate) fn block_hashes(&self, salt: Option<&str>, text: &str) -> Vec<u64> {
        let block_bytes = self.block_size * BYTES_PER_TOKEN;
        let mut parent = match salt {
            Some(salt) => {
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                salt.hash(&mut hasher);
                hasher.finish()
            }
            None => 0,
        };
        text.as_bytes()
            .chunks_exact(block_bytes)
            .map(|block| {
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                parent.hash(&mut hasher);
                block.hash(&mut hasher);
                parent = hasher.finish();
                parent
            })
            .collect()
    }

    /// How many leading blocks of `blocks` are cached; those are marked used.
    pub(crate) fn lookup(&self, blocks: &[u64]) -> usize {
        let mut lru = self.lock();
        let hits = blocks
            .iter()
            .take_while(|b| lru.used.contains_key(b))
            .count();
        // Touch the tail first so the prefix ends up the most recently used.
        for &block in blocks[..hits].iter().rev() {
            lru.touch(block);
        }
        hits
    }

    /// Records `blocks` as computed, evicting the least recently used beyond capacity. The
    /// last blocks are stored first, so a sequence is evicted from its tail, as vLLM does:
    /// a prefix is worth more than what follows it.
    pub(crate) fn insert(&self, blocks: &[u64]) {
        let mut lru = self.lock();
        for &block in blocks.iter().rev() {
            lru.touch(block);
        }
        while lru.used.len() > self.capacity {
            lru.evict_oldest();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        // Nothing panics while holding the lock; a poisoned cache is still consistent.
        self.lru
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

// === impl Lru ===

impl Lru {
    fn touch(&mut self, block: u64) {
        self.clock += 1;
        if let Some(old) = self.used.insert(block, self.clock) {
            self.by_age.remove(&old);
        }
        self.by_age.insert(self.clock, block);
    }

    fn evict_oldest(&mut self) {
        if let Some((_, block)) = self.by_age.pop_first() {
            self.used.remove(&block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_chain_so_a_block_matches_only_behind_its_prefix() {
        let cache = PrefixCache::new(100, 2).unwrap();
        // Two tokens of four bytes per block.
        let a = cache.block_hashes(None, "aaaaaaaabbbbbbbbcccc");
        assert_eq!(a.len(), 2, "the partial last block is not hashed");
        let b = cache.block_hashes(None, "xxxxxxxxbbbbbbbb");
        assert_ne!(a[1], b[1], "same text after another prefix");
        cache.insert(&a);
        assert_eq!(
            cache.lookup(&cache.block_hashes(None, "aaaaaaaabbbbbbbbdddddddd")),
            2
        );
        assert_eq!(cache.lookup(&b), 0);
    }

    #[test]
    fn different_salts_never_share_a_block() {
        let cache = PrefixCache::new(100, 2).unwrap();
        let text = "aaaaaaaabbbbbbbbcccccccc";
        let a = cache.block_hashes(Some("tenant-a"), text);
        cache.insert(&a);
        assert_eq!(cache.lookup(&cache.block_hashes(Some("tenant-a"), text)), 3);
        for other in [Some("tenant-b"), None] {
            let blocks = cache.block_hashes(other, text);
            assert!(blocks.iter().all(|b| !a.contains(b)), "{other:?}");
            assert_eq!(cache.lookup(&blocks), 0, "{other:?}");
        }
    }

    #[test]
    fn evicts_least_recently_used_tails_first() {
        let cache = PrefixCache::new(3, 1).unwrap();
        let first = cache.block_hashes(None, "aaaabbbbcccc");
        cache.insert(&first);
        let other = cache.block_hashes(None, "zzzz");
        cache.insert(&other);
        assert_eq!(cache.lock().used.len(), 3);
        // The tail of the older sequence went; its prefix stays.
        assert_eq!(cache.lookup(&first), 2);
        assert_eq!(cache.lookup(&other), 1);
    }
}
