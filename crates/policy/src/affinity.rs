//! Keeping a conversation where its KV cache is.
//!
//! Model servers reuse the KV cache of a prompt prefix they computed before (vLLM's and
//! SGLang's prefix caching), so a follow-up turn sent where the earlier turns ran starts
//! its first token after prefilling only the new part. Two rules follow:
//! - within a tier, send a prompt where its first token comes soonest: the prefill queued
//!   there plus the part of the prompt that endpoint does not hold ([`PrefixTable`],
//!   [`choose_endpoint`]), but never to one loaded more than `max_load_factor` times the
//!   least loaded (bounded load), so a hot prefix spreads;
//! - across tiers, keep a conversation ([`conversation_key`]) on the profile its earlier
//!   turns used while that profile still meets the new turn's constraints
//!   ([`prefer_session`]).
//!
//! Both are keyed within a [`KeyScope`], the tenant's: one tenant's prompts and session ids
//! never match another's, so what the router says about earlier traffic (the
//! `x-quantrouter-affinity` header) is only ever about the tenant's own.
//!
//! The router cannot see the server's tokens, so a prompt is cut into blocks of
//! [`PREFIX_BLOCK_BYTES`] bytes (about a 16-token KV block) whose hashes chain: a block
//! matches only behind the same prefix, as in vLLM's block hashes. Which endpoint holds
//! which blocks is estimated from where the router sent them (the approximate scorer of
//! llm-d and vllm-router's `cache_aware` policy), not read from the servers.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;
use sha2::{Digest as _, Sha256};

use crate::features::{Prompt, Role};
use crate::profile::{Affinity, ProfileIndex};
use crate::select::{Reason, RoutingDecision};

/// Prompt bytes per prefix block: 16 tokens (vLLM's default block size) at the usual four
/// bytes per token.
pub const PREFIX_BLOCK_BYTES: usize = 64;

/// Bytes of a prompt hashed into blocks at most. Conversations part ways in their first
/// messages, so 32 KiB tells them apart while bounding the work for huge prompts.
pub const MAX_PREFIX_BYTES: usize = 32 * 1024;

/// Blocks one endpoint's [`PrefixTable`] remembers: 16384 blocks are 256K tokens, about
/// what one 80 GB GPU's KV cache holds for an 8B model. Remembering more than the server
/// can hold would promise hits it has evicted.
pub const DEFAULT_TABLE_BLOCKS: usize = 16 * 1024;

/// What the router knows of one endpoint when choosing where a prompt goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndpointLoad {
    /// Requests running or waiting there (the router's own in flight, plus those of others
    /// the last scrape saw).
    pub load: u64,
    /// Prompt blocks the router sent there whose prefill has not answered yet, counting
    /// only the blocks the endpoint was not estimated to hold: the compute queued ahead.
    pub queued_blocks: u64,
    /// The server's KV-cache usage in [0, 1], when it exports one.
    pub kv_usage: Option<f64>,
    /// Leading blocks of the prompt the endpoint is estimated to hold.
    pub matched_blocks: usize,
}

/// The endpoint [`choose_endpoint`] picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointChoice {
    /// Position in the slice given.
    pub index: usize,
    /// Blocks of the prompt the endpoint is not estimated to hold: the prefill it adds
    /// to that endpoint's queue.
    pub uncached_blocks: u64,
    /// The cached prefix decided: an endpoint within the load bound held less of it.
    pub by_prefix: bool,
}

/// Which rule decided where a request went, for `x-quantrouter-affinity` and explain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AffinityUse {
    /// Utility and load alone.
    #[default]
    None,
    /// The conversation stayed on the profile of its earlier turns.
    Session,
    /// The endpoint was chosen for its cached prefix.
    Prefix,
}

/// Whose traffic a key belongs to: block hashes and conversation keys start from the scope,
/// so keys of different scopes never match. [`KeyScope::NONE`] is a router without tenants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct KeyScope(u64);

/// A conversation's key, and whether this request may follow its earlier turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conversation {
    pub key: u64,
    /// The client named the conversation (a session id, OpenAI's `user`), or the request
    /// continues one: an assistant turn or a tool's result is in its history. A first turn
    /// keyed by its messages has no conversation to keep yet: it is remembered for its next
    /// turn, but the same opening sent again is routed on its own.
    pub recall: bool,
}

/// The prompt blocks recently sent to one endpoint, least recently used forgotten first.
///
/// A hit on block `k` means the endpoint saw the whole prefix up to `k` (hashes chain);
/// blocks of one prompt are recorded tail first, so a prefix outlives what follows it, as
/// in vLLM's eviction order.
#[derive(Debug, Clone)]
pub struct PrefixTable {
    capacity: usize,
    /// Block hash to the clock of its last use.
    last_use: HashMap<u64, u64, BuildHasherDefault<Prehashed>>,
    /// Uses in order; an entry whose clock is no longer the block's last use is stale.
    uses: VecDeque<(u64, u64)>,
    clock: u64,
}

/// Block hashes are already mixed: hashing them again would only cost time.
#[derive(Debug, Default, Clone, Copy)]
struct Prehashed(u64);

/// Cuts a byte stream into chained block hashes.
#[derive(Debug)]
struct BlockHasher {
    word: u64,
    word_len: u32,
    block: u64,
    block_len: usize,
    chain: u64,
    room: usize,
    blocks: Vec<u64>,
}

/// FxHash's multiplier: one multiply per word mixes well enough for table keys.
const MIX: u64 = 0x517c_c1b7_2722_0a95;

// === impl KeyScope ===

impl KeyScope {
    /// Everyone's: a router without tenants.
    pub const NONE: Self = Self(0);

    /// A scope from a secret digest (a tenant's: [`crate::TenantKeys`]).
    pub fn from_digest(digest: &[u8; 32]) -> Self {
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        Self(u64::from_le_bytes(first))
    }

    /// The part of this scope whose requests carry `salt` as vLLM's `cache_salt`: the model
    /// server shares KV blocks only between equal salts, so the router's table must not
    /// either. A cryptographic hash, because a client chooses its salt and must not be able
    /// to choose its way into another scope.
    pub fn salted(self, salt: &str) -> Self {
        let digest = Sha256::new()
            .chain_update(b"quantrouter prefix scope\0")
            .chain_update(self.0.to_le_bytes())
            .chain_update(salt.as_bytes())
            .finalize();
        Self::from_digest(&digest.into())
    }
}

// === impl AffinityUse ===

impl AffinityUse {
    /// The `x-quantrouter-affinity` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Session => "session",
            Self::Prefix => "prefix",
        }
    }
}

/// The chained hashes of the prompt's full blocks (of its first [`MAX_PREFIX_BYTES`]),
/// each message framed by its role so the same text in another role differs, within
/// `scope`.
pub fn prefix_blocks(scope: KeyScope, prompt: &Prompt<'_>) -> Vec<u64> {
    let mut hasher = BlockHasher::new(MAX_PREFIX_BYTES, scope);
    for segment in &prompt.segments {
        hasher.feed(&[role_byte(segment.role), 0x1e]);
        hasher.feed(segment.text.as_bytes());
        hasher.feed(&[0x1f]);
        if hasher.room == 0 {
            break;
        }
    }
    hasher.blocks
}

/// The key a conversation's turns share within `scope`: the client's session id, else
/// OpenAI's `user`, else a hash of the messages up to the first user message (the system
/// prompt and the opening question, which every later turn repeats). `None` for an empty
/// prompt.
pub fn conversation_key(
    scope: KeyScope,
    session_id: Option<&str>,
    user: Option<&str>,
    prompt: &Prompt<'_>,
) -> Option<Conversation> {
    let named = |tag: u8, value: &str| {
        let mut hasher = BlockHasher::new(usize::MAX, scope);
        hasher.feed(&[tag]);
        hasher.feed(value.as_bytes());
        Conversation {
            key: hasher.digest(),
            recall: true,
        }
    };
    if let Some(id) = session_id.filter(|s| !s.is_empty()) {
        return Some(named(b's', id));
    }
    if let Some(user) = user.filter(|s| !s.is_empty()) {
        return Some(named(b'u', user));
    }
    let opening = match prompt.segments.iter().position(|s| s.role == Role::User) {
        Some(i) => &prompt.segments[..=i],
        None => &prompt.segments[..],
    };
    if opening.is_empty() {
        return None;
    }
    let mut hasher = BlockHasher::new(MAX_PREFIX_BYTES, scope);
    hasher.feed(b"m");
    for segment in opening {
        hasher.feed(&[role_byte(segment.role), 0x1e]);
        hasher.feed(segment.text.as_bytes());
    }
    let continues = prompt
        .segments
        .iter()
        .any(|s| matches!(s.role, Role::Assistant | Role::Other));
    Some(Conversation {
        key: hasher.digest(),
        recall: continues,
    })
}

/// Whether a turn's profile becomes its conversation's: only when the router chose it. A
/// request pinned to a profile (by model name or header), or sent to the default profile
/// as a shadow or canary control, says nothing about what the later turns need.
pub fn remembers(decision: &RoutingDecision) -> bool {
    !matches!(
        decision.reason,
        Reason::Pinned | Reason::Shadow | Reason::CanaryControl
    )
}

/// Keeps the conversation on `session`, the profile its earlier turns used, when adaptive
/// routing chose another and `session` is feasible for this turn (quality, context,
/// latency, availability). Pins and the shadow and canary control groups are left alone.
/// Returns whether the session changed the decision.
pub fn prefer_session(decision: &mut RoutingDecision, session: ProfileIndex) -> bool {
    let adaptive = matches!(decision.reason, Reason::Utility | Reason::BudgetDowngrade);
    if !adaptive || decision.profile == session {
        return false;
    }
    if !decision.candidate(session).is_some_and(|c| c.feasible) {
        return false;
    }
    decision.profile = session;
    decision.adaptive_profile = session;
    true
}

/// Picks the endpoint for a prompt of `prompt_blocks` blocks: among endpoints whose load
/// is within the bound (at most `max_load_factor` times the least loaded, or one request
/// more than it), the one where its first token comes soonest — the least prefill queued
/// there plus `recompute_weight` times the blocks of the prompt it does not hold; then the
/// longest cached prefix, the least loaded, the emptiest KV cache; `tie` (random) splits
/// what is still equal. `None` when `endpoints` is empty.
///
/// Load in requests alone cannot tell a replica with cold prompts queued from one with
/// warm turns queued; the queued blocks can, so a warm turn leaves its cache only when
/// the prefill ahead of it there outweighs computing its whole prompt elsewhere.
pub fn choose_endpoint(
    endpoints: &[EndpointLoad],
    prompt_blocks: u64,
    affinity: &Affinity,
    tie: u64,
) -> Option<EndpointChoice> {
    let least = endpoints.iter().map(|e| e.load).min()?;
    let factor = affinity.max_load_factor.max(1.0);
    let bound = ((least as f64 * factor).floor() as u64).max(least + 1);
    let weight = affinity.recompute_weight.max(1.0);
    let within = || endpoints.iter().filter(move |e| e.load <= bound);
    let shortest = within().map(|e| e.matched_blocks).min()?;
    let uncached = |e: &EndpointLoad| prompt_blocks.saturating_sub(e.matched_blocks as u64);
    // Whole blocks of expected wait, then the cache, load and KV usage (in thousandths so
    // the order is total; unknown counts as empty), smaller first.
    let rank = |e: &EndpointLoad| {
        let wait = e.queued_blocks as f64 + weight * uncached(e) as f64;
        (
            wait.min(u64::MAX as f64) as u64,
            usize::MAX - e.matched_blocks,
            e.load,
            (e.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0) * 1e3) as u64,
        )
    };
    let best = within().map(rank).min()?;
    let tied = |e: &&EndpointLoad| e.load <= bound && rank(e) == best;
    let count = endpoints.iter().filter(tied).count() as u64;
    let nth = usize::try_from(tie % count.max(1)).unwrap_or(0);
    let (index, chosen) = endpoints
        .iter()
        .enumerate()
        .filter(|(_, e)| tied(e))
        .nth(nth)?;
    Some(EndpointChoice {
        index,
        uncached_blocks: uncached(chosen),
        by_prefix: chosen.matched_blocks > shortest,
    })
}

/// Blocks of a prompt of `bytes` bytes, the part past [`MAX_PREFIX_BYTES`] included.
pub fn prompt_blocks(bytes: usize) -> u64 {
    bytes.div_ceil(PREFIX_BLOCK_BYTES) as u64
}

fn role_byte(role: Role) -> u8 {
    match role {
        Role::System => b'S',
        Role::User => b'U',
        Role::Assistant => b'A',
        Role::Other => b'O',
    }
}

// === impl PrefixTable ===

impl PrefixTable {
    /// A table remembering at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            last_use: HashMap::default(),
            uses: VecDeque::new(),
            clock: 0,
        }
    }

    /// Leading blocks of `blocks` this endpoint was sent.
    pub fn matched(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.last_use.contains_key(b))
            .count()
    }

    /// The prompt of `blocks` went to this endpoint.
    pub fn record(&mut self, blocks: &[u64]) {
        for &block in blocks.iter().rev() {
            self.clock += 1;
            self.last_use.insert(block, self.clock);
            self.uses.push_back((block, self.clock));
        }
        while self.last_use.len() > self.capacity {
            let Some((block, used)) = self.uses.pop_front() else {
                break;
            };
            if self.last_use.get(&block) == Some(&used) {
                self.last_use.remove(&block);
            }
        }
        // Repeated blocks leave stale uses behind; drop them before they outnumber the live.
        if self.uses.len() > 2 * self.capacity {
            let last_use = &self.last_use;
            self.uses
                .retain(|(block, used)| last_use.get(block) == Some(used));
        }
    }

    /// Blocks remembered now.
    pub fn len(&self) -> usize {
        self.last_use.len()
    }

    /// Nothing remembered.
    pub fn is_empty(&self) -> bool {
        self.last_use.is_empty()
    }
}

impl Default for PrefixTable {
    fn default() -> Self {
        Self::new(DEFAULT_TABLE_BLOCKS)
    }
}

// === impl Prehashed ===

impl Hasher for Prehashed {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

// === impl BlockHasher ===

impl BlockHasher {
    /// A hasher of at most `limit` bytes whose chain starts from `scope`.
    fn new(limit: usize, scope: KeyScope) -> Self {
        Self {
            word: 0,
            word_len: 0,
            block: 0,
            block_len: 0,
            chain: scope.0,
            room: limit,
            blocks: Vec::new(),
        }
    }

    fn feed(&mut self, bytes: &[u8]) {
        let bytes = &bytes[..bytes.len().min(self.room)];
        self.room -= bytes.len();
        let mut rest = bytes;
        while self.word_len != 0 {
            let Some((&b, tail)) = rest.split_first() else {
                return;
            };
            self.push_byte(b);
            rest = tail;
        }
        let mut words = rest.chunks_exact(8);
        for word in &mut words {
            self.push_word(u64::from_le_bytes(word.try_into().unwrap_or_default()));
        }
        for &b in words.remainder() {
            self.push_byte(b);
        }
    }

    fn push_byte(&mut self, b: u8) {
        self.word |= u64::from(b) << (8 * self.word_len);
        self.word_len += 1;
        if self.word_len == 8 {
            let word = std::mem::take(&mut self.word);
            self.word_len = 0;
            self.push_word(word);
        }
    }

    fn push_word(&mut self, word: u64) {
        self.block = (self.block.rotate_left(5) ^ word).wrapping_mul(MIX);
        self.block_len += 8;
        if self.block_len == PREFIX_BLOCK_BYTES {
            self.chain = fmix64(self.chain ^ fmix64(self.block));
            self.blocks.push(self.chain);
            self.block = 0;
            self.block_len = 0;
        }
    }

    /// One hash of everything fed, partial words and blocks included.
    fn digest(mut self) -> u64 {
        let partial =
            (self.block.rotate_left(5) ^ self.word ^ u64::from(self.word_len)).wrapping_mul(MIX);
        self.chain = fmix64(self.chain ^ fmix64(partial) ^ self.blocks.len() as u64);
        self.chain
    }
}

/// MurmurHash3's finalizer: every input bit reaches every output bit.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

#[cfg(test)]
mod tests;
