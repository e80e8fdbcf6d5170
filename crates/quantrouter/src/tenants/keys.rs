//! From a presented API key to its tenant, in constant time: the key is checked for shape,
//! hashed with SHA-256, and its digest compared with every stored digest with `subtle`'s
//! constant-time equality, without stopping at a match. How long a check takes says nothing
//! about which stored key (if any) a guess came close to.

use sha2::{Digest as _, Sha256};
use subtle::{ConditionallySelectable as _, ConstantTimeEq as _};

use quantrouter_policy::is_valid_api_key;

/// Every stored key digest with the tenant it belongs to.
#[derive(Debug, Clone, Default)]
pub struct KeyIndex {
    entries: Vec<([u8; 32], u32)>,
}

/// Why a request's key was refused (all of them answer 401 `invalid_api_key`); the label
/// of the refusal in metrics and logs, which never carry the key itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KeyRejected {
    #[error("no API key was sent")]
    Missing,
    /// Empty, whitespace, control or non-ASCII characters, or longer than 256 bytes: refused
    /// before it is hashed.
    #[error("the API key is malformed")]
    Malformed,
    #[error("the API key is unknown")]
    Unknown,
}

// === impl KeyIndex ===

impl KeyIndex {
    /// Adds a digest; a later entry wins over an earlier one for the same digest.
    pub fn insert(&mut self, digest: [u8; 32], tenant: usize) {
        let tenant = u32::try_from(tenant).unwrap_or(u32::MAX);
        self.entries.push((digest, tenant));
    }

    /// Appends `other`'s entries, which then win over this index's for the same digest.
    pub fn extend(&mut self, other: KeyIndex) {
        self.entries.extend(other.entries);
    }

    /// Stored digests.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The tenant of `key`, comparing its digest with every stored one.
    pub fn find(&self, key: &str) -> Result<usize, KeyRejected> {
        if !is_valid_api_key(key) {
            return Err(KeyRejected::Malformed);
        }
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        // Index + 1 of the matching tenant, 0 for none, chosen without a branch on a byte.
        let mut found = 0u32;
        for (stored, tenant) in &self.entries {
            let matches = stored[..].ct_eq(&digest[..]);
            found.conditional_assign(&tenant.saturating_add(1), matches);
        }
        match found {
            0 => Err(KeyRejected::Unknown),
            n => Ok(n as usize - 1),
        }
    }
}

// === impl KeyRejected ===

impl KeyRejected {
    /// The label in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            KeyRejected::Missing => "missing",
            KeyRejected::Malformed => "malformed",
            KeyRejected::Unknown => "unknown",
        }
    }
}

/// The key of an `Authorization: Bearer <key>` value (the scheme in any case, as RFC 9110
/// says), `None` when the value is not of that form.
pub fn bearer(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?;
    let (scheme, key) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quantrouter_policy::{hash_key, parse_key_hash};

    fn index() -> KeyIndex {
        let mut index = KeyIndex::default();
        for (key, tenant) in [("sk-a-1", 0), ("sk-b-1", 1), ("sk-a-2", 0)] {
            index.insert(parse_key_hash(&hash_key(key)).unwrap(), tenant);
        }
        index
    }

    #[test]
    fn finds_each_key_s_tenant_and_refuses_the_rest() {
        let index = index();
        assert_eq!(index.find("sk-a-1"), Ok(0));
        assert_eq!(index.find("sk-a-2"), Ok(0));
        assert_eq!(index.find("sk-b-1"), Ok(1));
        assert_eq!(index.find("sk-a-3"), Err(KeyRejected::Unknown));
        assert_eq!(index.find("sk-a-1x"), Err(KeyRejected::Unknown));
        assert_eq!(
            KeyIndex::default().find("sk-a-1"),
            Err(KeyRejected::Unknown)
        );
    }

    #[test]
    fn malformed_keys_are_refused_before_hashing() {
        let index = index();
        let long = "k".repeat(257);
        for key in [
            "",
            " ",
            "\t",
            "sk-a-1 ",
            "sk a",
            "sk-\u{e9}",
            "sk-\u{1F511}",
            &long,
        ] {
            assert_eq!(index.find(key), Err(KeyRejected::Malformed), "{key:?}");
        }
    }

    #[test]
    fn a_later_entry_wins_for_the_same_digest() {
        let mut index = index();
        index.insert(parse_key_hash(&hash_key("sk-b-1")).unwrap(), 7);
        assert_eq!(index.find("sk-b-1"), Ok(7));
    }

    #[test]
    fn bearer_takes_the_key_after_the_scheme() {
        assert_eq!(bearer(b"Bearer sk-1"), Some("sk-1"));
        assert_eq!(bearer(b"bearer sk-1"), Some("sk-1"));
        assert_eq!(bearer(b"Bearer "), Some(""));
        assert_eq!(bearer(b"Bearer  sk-1"), Some(" sk-1"));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearer"), None);
        assert_eq!(bearer(b"Bearer \xff"), None);
    }
}
