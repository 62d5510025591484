//! The two-phase claim table of one tenant.
//!
//! A key is claimed *pending* by the hook that met it first, and only a settle
//! makes it *committed*. Expiry is checked on every read, so a claim is free the
//! moment it expires; [`ClaimTable::sweep`] only gives the memory back, in one
//! pass driven by the owner's tick rather than a timer per claim.

use std::collections::hash_map::{Entry, HashMap};

// Event keys come from senders, so the table's hasher must be keyed: aHash with
// keys from the OS at process start (and a fresh one per table) costs a fifth of
// SipHash on a ~55-byte key and, unlike an unkeyed hash, gives a flooder no
// collisions to precompute.
use ahash::RandomState;

use serde::{Deserialize, Serialize};

/// A claim's place in the table: `(source_id, key)` packed into one allocation as
/// `"<len(source_id)>:<source_id><key>"`, which is unambiguous for any bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClaimKey(Box<str>);

impl ClaimKey {
    pub fn new(source_id: &str, key: &str) -> Self {
        // The length in decimal without `fmt`, which costs more than the rest of a
        // hit's key handling; u64::MAX has 20 digits.
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut len = source_id.len();
        loop {
            at -= 1;
            digits[at] = b'0' + (len % 10) as u8;
            len /= 10;
            if len == 0 {
                break;
            }
        }
        let digits = std::str::from_utf8(&digits[at..]).unwrap_or("0");
        let mut packed = String::with_capacity(digits.len() + 1 + source_id.len() + key.len());
        packed.push_str(digits);
        packed.push(':');
        packed.push_str(source_id);
        packed.push_str(key);
        Self(packed.into_boxed_str())
    }

    /// `(source_id, key)` back out of the packed form.
    pub fn parts(&self) -> (&str, &str) {
        let (len, rest) = self.0.split_once(':').unwrap_or(("0", &self.0));
        let len = len.parse::<usize>().unwrap_or(0).min(rest.len());
        // `new` only ever splits on a char boundary of the original source_id.
        if rest.is_char_boundary(len) {
            rest.split_at(len)
        } else {
            ("", rest)
        }
    }
}

/// Where a claim stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// In flight on `node`; nobody may answer Duplicate for it.
    Pending { node: Box<str> },
    /// The hook is durable; the key answers Duplicate until it expires.
    Committed,
}

/// One claim: who holds the key, in which phase, until when (unix µs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimEntry {
    pub hook_id: Box<str>,
    pub phase: Phase,
    pub expires_us: u64,
}

impl ClaimEntry {
    pub fn is_live(&self, now_us: u64) -> bool {
        self.expires_us > now_us
    }
}

/// A claim as it is persisted and exported: the serde form of one table entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRecord {
    pub source_id: String,
    pub key: String,
    pub hook_id: String,
    /// The node holding a pending claim; `None` once committed.
    pub node: Option<String>,
    pub committed: bool,
    pub expires_us: u64,
}

impl ClaimRecord {
    pub fn new(
        source_id: &str,
        key: &str,
        hook_id: &str,
        node: Option<&str>,
        committed: bool,
        expires_us: u64,
    ) -> Self {
        Self {
            source_id: source_id.into(),
            key: key.into(),
            hook_id: hook_id.into(),
            node: node.map(Into::into),
            committed,
            expires_us,
        }
    }

    pub fn source_id(&self) -> &str {
        &self.source_id
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn hook_id(&self) -> &str {
        &self.hook_id
    }

    /// The node holding a pending claim; `None` once committed.
    pub fn node(&self) -> Option<&str> {
        self.node.as_deref()
    }

    pub fn committed(&self) -> bool {
        self.committed
    }

    /// Unix µs.
    pub fn expires_us(&self) -> u64 {
        self.expires_us
    }

    pub fn from_entry(key: &ClaimKey, entry: &ClaimEntry) -> Self {
        let (source_id, key) = key.parts();
        let (node, committed) = match &entry.phase {
            Phase::Pending { node } => (Some(node.to_string()), false),
            Phase::Committed => (None, true),
        };
        Self {
            source_id: source_id.into(),
            key: key.into(),
            hook_id: entry.hook_id.to_string(),
            node,
            committed,
            expires_us: entry.expires_us,
        }
    }

    pub fn into_entry(self) -> (ClaimKey, ClaimEntry) {
        let key = ClaimKey::new(&self.source_id, &self.key);
        let phase = if self.committed {
            Phase::Committed
        } else {
            Phase::Pending {
                node: self.node.unwrap_or_default().into_boxed_str(),
            }
        };
        let entry = ClaimEntry {
            hook_id: self.hook_id.into_boxed_str(),
            phase,
            expires_us: self.expires_us,
        };
        (key, entry)
    }
}

/// Every claim of one tenant.
#[derive(Debug, Clone, Default)]
pub struct ClaimTable {
    /// Made on the first claim and dropped when a sweep empties it: most tenant
    /// states (every parked one that only holds TATs) have no claim, and an
    /// empty inline `HashMap` costs 48 bytes in each of them; `None` costs 8.
    /// The box is the point (a small inline size), hence the allow.
    #[allow(clippy::box_collection)]
    entries: Option<Box<HashMap<ClaimKey, ClaimEntry, RandomState>>>,
}

impl ClaimTable {
    /// The live claim on `key`, if any.
    pub fn live(&self, key: &ClaimKey, now_us: u64) -> Option<&ClaimEntry> {
        self.entries
            .as_ref()?
            .get(key)
            .filter(|e| e.is_live(now_us))
    }

    pub fn live_mut(&mut self, key: &ClaimKey, now_us: u64) -> Option<&mut ClaimEntry> {
        self.entries
            .as_mut()?
            .get_mut(key)
            .filter(|e| e.is_live(now_us))
    }

    fn map(&mut self) -> &mut HashMap<ClaimKey, ClaimEntry, RandomState> {
        self.entries.get_or_insert_with(Box::default)
    }

    /// The table's slot for `key`, live, expired or vacant: one hash for a hit that
    /// reads the key and then may claim it.
    pub(crate) fn entry(&mut self, key: ClaimKey) -> Entry<'_, ClaimKey, ClaimEntry> {
        self.map().entry(key)
    }

    pub fn insert(&mut self, key: ClaimKey, entry: ClaimEntry) {
        self.map().insert(key, entry);
    }

    pub fn remove(&mut self, key: &ClaimKey) -> Option<ClaimEntry> {
        self.entries.as_mut()?.remove(key)
    }

    /// Drops every expired claim; returns how many went.
    pub fn sweep(&mut self, now_us: u64) -> usize {
        let Some(entries) = self.entries.as_mut() else {
            return 0;
        };
        let before = entries.len();
        entries.retain(|_, e| e.is_live(now_us));
        let swept = before - entries.len();
        if entries.is_empty() {
            self.entries = None;
        } else if entries.capacity() > 4 * entries.len().max(8) {
            entries.shrink_to_fit();
        }
        swept
    }

    /// Claims held, live or not yet swept.
    pub fn len(&self) -> usize {
        self.entries.as_ref().map_or(0, |e| e.len())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.as_ref().is_none_or(|e| e.is_empty())
    }

    pub fn iter(&self) -> impl Iterator<Item = (&ClaimKey, &ClaimEntry)> {
        self.entries.iter().flat_map(|e| e.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_key_round_trips_any_bytes() {
        for (s, k) in [
            ("src", "key"),
            ("", "k"),
            ("a:b", ":c"),
            ("12", "3"),
            ("ünï", "cødé\0*>. "),
            ("1:x", ""),
            ("0123456789", "k"),
        ] {
            let packed = ClaimKey::new(s, k);
            assert_eq!(packed.parts(), (s, k), "{packed:?}");
        }
        assert_ne!(ClaimKey::new("ab", "c"), ClaimKey::new("a", "bc"));
        // The packed form is persisted by other crates' keys: it must not change.
        assert_eq!(ClaimKey::new("src", "k").0.as_ref(), "3:srck");
        assert_eq!(ClaimKey::new("", "k").0.as_ref(), "0:k");
        let long = "s".repeat(1234);
        assert_eq!(&ClaimKey::new(&long, "k").0[..5], "1234:");
        assert_eq!(ClaimKey::new(&long, "k").parts(), (long.as_str(), "k"));
    }

    #[test]
    fn an_empty_table_is_one_pointer() {
        // Kept in every tenant's state, parked ones included (docs/benchmarks.md).
        assert_eq!(std::mem::size_of::<ClaimTable>(), 8);
        let mut table = ClaimTable::default();
        assert!(table.is_empty() && table.iter().next().is_none());
        assert_eq!(table.len(), 0);
        assert_eq!(table.sweep(0), 0);
        assert!(table.remove(&ClaimKey::new("s", "k")).is_none());
    }

    #[test]
    fn expired_claims_are_invisible_then_swept() {
        let mut table = ClaimTable::default();
        let key = ClaimKey::new("s", "k");
        table.insert(
            key.clone(),
            ClaimEntry {
                hook_id: "h".into(),
                phase: Phase::Committed,
                expires_us: 100,
            },
        );
        assert!(table.live(&key, 99).is_some());
        assert!(table.live(&key, 100).is_none());
        assert_eq!(table.sweep(99), 0);
        assert_eq!(table.sweep(100), 1);
        assert!(table.is_empty());
    }

    #[test]
    fn record_round_trip() {
        let key = ClaimKey::new("s", "k");
        let entry = ClaimEntry {
            hook_id: "h".into(),
            phase: Phase::Pending { node: "n1".into() },
            expires_us: 5,
        };
        let record = ClaimRecord::from_entry(&key, &entry);
        assert_eq!(record.node.as_deref(), Some("n1"));
        assert!(!record.committed);
        assert_eq!(record.into_entry(), (key, entry));
    }
}
