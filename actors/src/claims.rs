//! The two-phase claim table of one tenant.
//!
//! A key is claimed *pending* by the hook that met it first, and only a settle
//! makes it *committed*. Expiry is checked on every read, so a claim is free the
//! moment it expires; a sweep only gives the memory back, driven by the owner's
//! tick rather than a timer per claim. A large table is swept in steps
//! ([`ClaimTable::sweep_step`]) so that its owner can answer requests between
//! them: a tenant holding a hundred thousand claims is not stalled for the
//! milliseconds one pass over them takes.
//!
//! A claim costs one allocation: its `source_id`, `key` and `hook_id` share one
//! buffer, and the node of a pending claim is interned per table (a tenant's
//! claims come from a handful of edge nodes).

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;

// Event keys come from senders, so the table's hasher must be keyed: aHash with
// keys from the OS at process start (and a fresh one per table) costs a fifth of
// SipHash on a ~55-byte key and, unlike an unkeyed hash, gives a flooder no
// collisions to precompute.
use ahash::RandomState;
use hashbrown::hash_table::{Entry, HashTable};
use serde::{Deserialize, Serialize};

/// `(source_id, key)` packed into one allocation as
/// `"<len(source_id)>:<source_id><key>"`, which is unambiguous for any bytes. The
/// table does not store it; it names a claim to [`ClaimTable::live`].
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

/// A claim's `source_id`, `key` and `hook_id` in one shared allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ClaimText {
    text: Arc<str>,
    source_len: u32,
    key_len: u32,
}

thread_local! {
    /// Where a claim's text is put together before its one allocation is made.
    static SCRATCH: RefCell<String> = const { RefCell::new(String::new()) };
}

impl ClaimText {
    fn new(source_id: &str, key: &str, hook_id: &str) -> Self {
        let join = |buf: &mut String| {
            buf.clear();
            buf.push_str(source_id);
            buf.push_str(key);
            buf.push_str(hook_id);
            Arc::<str>::from(buf.as_str())
        };
        let text = SCRATCH
            .try_with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                let text = join(&mut scratch);
                // Records read back from storage are not bounded like requests are.
                if scratch.capacity() > 4096 {
                    *scratch = String::new();
                }
                text
            })
            // Only while the thread's locals are being torn down.
            .unwrap_or_else(|_| join(&mut String::new()));
        // Strings past 4 GiB cannot reach a table (frames are far smaller); were
        // one to, the parts would read empty rather than panic.
        Self {
            text,
            source_len: u32::try_from(source_id.len()).unwrap_or(u32::MAX),
            key_len: u32::try_from(key.len()).unwrap_or(u32::MAX),
        }
    }

    fn key_end(&self) -> usize {
        (self.source_len as usize).saturating_add(self.key_len as usize)
    }

    fn source_id(&self) -> &str {
        self.text
            .get(..self.source_len as usize)
            .unwrap_or_default()
    }

    fn key(&self) -> &str {
        self.text
            .get(self.source_len as usize..self.key_end())
            .unwrap_or_default()
    }

    fn hook_id(&self) -> &str {
        self.text.get(self.key_end()..).unwrap_or_default()
    }

    fn names(&self, source_id: &str, key: &str) -> bool {
        let bytes = self.text.as_bytes();
        self.source_len as usize == source_id.len()
            && self.key_len as usize == key.len()
            && bytes.get(..source_id.len()) == Some(source_id.as_bytes())
            && bytes.get(source_id.len()..self.key_end()) == Some(key.as_bytes())
    }
}

/// Where a claim stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// In flight on `node`; nobody may answer Duplicate for it.
    Pending { node: Arc<str> },
    /// The hook is durable; the key answers Duplicate until it expires.
    Committed,
}

/// One claim: which key, who holds it, in which phase, until when (unix µs).
#[derive(Clone, PartialEq, Eq)]
pub struct ClaimEntry {
    text: ClaimText,
    pub phase: Phase,
    pub expires_us: u64,
}

impl ClaimEntry {
    pub fn new(source_id: &str, key: &str, hook_id: &str, phase: Phase, expires_us: u64) -> Self {
        Self {
            text: ClaimText::new(source_id, key, hook_id),
            phase,
            expires_us,
        }
    }

    pub fn source_id(&self) -> &str {
        self.text.source_id()
    }

    pub fn key(&self) -> &str {
        self.text.key()
    }

    pub fn hook_id(&self) -> &str {
        self.text.hook_id()
    }

    pub fn is_live(&self, now_us: u64) -> bool {
        self.expires_us > now_us
    }
}

impl std::fmt::Debug for ClaimEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimEntry")
            .field("source_id", &self.source_id())
            .field("key", &self.key())
            .field("hook_id", &self.hook_id())
            .field("phase", &self.phase)
            .field("expires_us", &self.expires_us)
            .finish()
    }
}

/// A claim as it is persisted and exported: the serde form of one table entry.
///
/// It shares its text and node with the table entry it was made from, so a hit
/// reports the claim it made with two reference-count increments, not four string
/// copies. Its serde form is the one of the plain struct of `String`s it used to
/// be (`docs/protocol.md`; pinned by `tests/wire.rs`).
#[derive(Clone, PartialEq, Eq)]
pub struct ClaimRecord {
    text: ClaimText,
    /// The node holding a pending claim; `None` once committed.
    node: Option<Arc<str>>,
    pub committed: bool,
    pub expires_us: u64,
}

/// [`ClaimRecord`] as it is written.
#[derive(Serialize)]
#[serde(rename = "ClaimRecord")]
struct WireOut<'a> {
    source_id: &'a str,
    key: &'a str,
    hook_id: &'a str,
    node: Option<&'a str>,
    committed: bool,
    expires_us: u64,
}

/// [`ClaimRecord`] as it is read: borrowed where the input allows.
#[derive(Deserialize)]
#[serde(rename = "ClaimRecord")]
struct WireIn<'a> {
    #[serde(borrow)]
    source_id: Cow<'a, str>,
    #[serde(borrow)]
    key: Cow<'a, str>,
    #[serde(borrow)]
    hook_id: Cow<'a, str>,
    #[serde(borrow)]
    node: Option<Cow<'a, str>>,
    committed: bool,
    expires_us: u64,
}

impl Serialize for ClaimRecord {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        WireOut {
            source_id: self.source_id(),
            key: self.key(),
            hook_id: self.hook_id(),
            node: self.node(),
            committed: self.committed,
            expires_us: self.expires_us,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for ClaimRecord {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = WireIn::deserialize(deserializer)?;
        Ok(Self::new(
            &wire.source_id,
            &wire.key,
            &wire.hook_id,
            wire.node.as_deref(),
            wire.committed,
            wire.expires_us,
        ))
    }
}

impl std::fmt::Debug for ClaimRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClaimRecord")
            .field("source_id", &self.source_id())
            .field("key", &self.key())
            .field("hook_id", &self.hook_id())
            .field("node", &self.node())
            .field("committed", &self.committed)
            .field("expires_us", &self.expires_us)
            .finish()
    }
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
            text: ClaimText::new(source_id, key, hook_id),
            node: node.map(Into::into),
            committed,
            expires_us,
        }
    }

    pub fn source_id(&self) -> &str {
        self.text.source_id()
    }

    pub fn key(&self) -> &str {
        self.text.key()
    }

    pub fn hook_id(&self) -> &str {
        self.text.hook_id()
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

    pub fn from_entry(entry: &ClaimEntry) -> Self {
        let (node, committed) = match &entry.phase {
            Phase::Pending { node } => (Some(node.clone()), false),
            Phase::Committed => (None, true),
        };
        Self {
            text: entry.text.clone(),
            node,
            committed,
            expires_us: entry.expires_us,
        }
    }

    pub fn into_entry(self) -> ClaimEntry {
        let phase = if self.committed {
            Phase::Committed
        } else {
            Phase::Pending {
                node: self.node.unwrap_or_else(|| "".into()),
            }
        };
        ClaimEntry {
            text: self.text,
            phase,
            expires_us: self.expires_us,
        }
    }
}

/// Every claim of one tenant.
#[derive(Debug, Clone, Default)]
pub struct ClaimTable {
    /// Made on the first claim and dropped when a sweep empties it: most tenant
    /// states (every parked one that only holds TATs) have no claim, and an
    /// inline table costs bytes in each of them; `None` costs 8.
    entries: Option<Box<Claims>>,
}

/// Nodes interned per table. Past this many distinct nodes in use at once, a
/// claim gets a node string of its own.
const MAX_NODES: usize = 16;

#[derive(Clone, Default)]
struct Claims {
    table: HashTable<ClaimEntry>,
    hasher: RandomState,
    nodes: Vec<Arc<str>>,
    /// The bucket the next sweep step starts at; 0 between passes.
    sweep_from: usize,
}

/// What one [`ClaimTable::sweep_step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepStep {
    /// Expired claims dropped.
    pub swept: usize,
    /// Places of the table looked at.
    pub visited: usize,
    /// The pass reached the end of the table; the next step starts a new one.
    pub finished: bool,
}

impl std::fmt::Debug for Claims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.table.iter()).finish()
    }
}

impl Claims {
    fn hash(&self, source_id: &str, key: &str) -> u64 {
        self.hasher.hash_one((source_id, key))
    }
}

/// The node `node` as an `Arc` shared with the table's other claims from it.
fn intern(nodes: &mut Vec<Arc<str>>, node: &str) -> Arc<str> {
    if let Some(known) = nodes.iter().find(|n| ***n == *node) {
        return known.clone();
    }
    let fresh: Arc<str> = node.into();
    // Reuse the place of a node no claim holds any more.
    if let Some(unused) = nodes.iter_mut().find(|n| Arc::strong_count(n) == 1) {
        *unused = fresh.clone();
    } else if nodes.len() < MAX_NODES {
        nodes.push(fresh.clone());
    }
    fresh
}

/// The table's place for one `(source_id, key)`, live, expired or vacant: what a
/// hit reads and then may claim, with one hash.
pub(crate) struct Slot<'a> {
    entry: Entry<'a, ClaimEntry>,
    nodes: &'a mut Vec<Arc<str>>,
}

impl<'a> Slot<'a> {
    /// The claim here, live or expired.
    pub(crate) fn get(&self) -> Option<&ClaimEntry> {
        match &self.entry {
            Entry::Occupied(occupied) => Some(occupied.get()),
            Entry::Vacant(_) => None,
        }
    }

    /// Makes the key `hook_id`'s, pending on `node` (an expired claim is
    /// replaced where it lies).
    pub(crate) fn claim(
        self,
        source_id: &str,
        key: &str,
        hook_id: &str,
        node: &str,
        expires_us: u64,
    ) -> &'a ClaimEntry {
        let entry = ClaimEntry::new(
            source_id,
            key,
            hook_id,
            Phase::Pending {
                node: intern(self.nodes, node),
            },
            expires_us,
        );
        match self.entry {
            Entry::Occupied(occupied) => {
                let slot = occupied.into_mut();
                *slot = entry;
                slot
            }
            Entry::Vacant(vacant) => vacant.insert(entry).into_mut(),
        }
    }
}

impl ClaimTable {
    /// The live claim named by a packed key, if any.
    pub fn live(&self, key: &ClaimKey, now_us: u64) -> Option<&ClaimEntry> {
        let (source_id, key) = key.parts();
        self.find(source_id, key, now_us)
    }

    /// The live claim on `(source_id, key)`, if any.
    pub fn find(&self, source_id: &str, key: &str, now_us: u64) -> Option<&ClaimEntry> {
        let claims = self.entries.as_ref()?;
        claims
            .table
            .find(claims.hash(source_id, key), |e| {
                e.text.names(source_id, key)
            })
            .filter(|e| e.is_live(now_us))
    }

    pub fn find_mut(&mut self, source_id: &str, key: &str, now_us: u64) -> Option<&mut ClaimEntry> {
        let claims = self.entries.as_mut()?;
        let hash = claims.hash(source_id, key);
        claims
            .table
            .find_mut(hash, |e| e.text.names(source_id, key))
            .filter(|e| e.is_live(now_us))
    }

    pub(crate) fn slot(&mut self, source_id: &str, key: &str) -> Slot<'_> {
        let claims = &mut **self.entries.get_or_insert_with(Box::default);
        let hash = claims.hash(source_id, key);
        let Claims {
            table,
            hasher,
            nodes,
            ..
        } = claims;
        let entry = table.entry(
            hash,
            |e| e.text.names(source_id, key),
            |e| hasher.hash_one((e.source_id(), e.key())),
        );
        Slot { entry, nodes }
    }

    /// Puts `entry` in, over any claim on its key.
    pub fn insert(&mut self, mut entry: ClaimEntry) {
        let claims = &mut **self.entries.get_or_insert_with(Box::default);
        if let Phase::Pending { node } = &mut entry.phase {
            *node = intern(&mut claims.nodes, node);
        }
        let hash = claims.hash(entry.source_id(), entry.key());
        let Claims { table, hasher, .. } = claims;
        match table.entry(
            hash,
            |e| e.text.names(entry.source_id(), entry.key()),
            |e| hasher.hash_one((e.source_id(), e.key())),
        ) {
            Entry::Occupied(mut occupied) => *occupied.get_mut() = entry,
            Entry::Vacant(vacant) => {
                vacant.insert(entry);
            }
        }
    }

    pub fn remove(&mut self, source_id: &str, key: &str) -> Option<ClaimEntry> {
        let claims = self.entries.as_mut()?;
        let hash = claims.hash(source_id, key);
        let occupied = claims
            .table
            .find_entry(hash, |e| e.text.names(source_id, key))
            .ok()?;
        Some(occupied.remove().0)
    }

    /// Drops every expired claim; returns how many went.
    pub fn sweep(&mut self, now_us: u64) -> usize {
        if let Some(claims) = self.entries.as_mut() {
            claims.sweep_from = 0;
        }
        self.sweep_step(now_us, usize::MAX).swept
    }

    /// Drops the expired claims among the next `buckets` places of the table,
    /// from where the last step stopped. The table may grow or be rehashed
    /// between steps; a claim that moves behind the step is then swept by the
    /// next pass, and until then it is invisible like every expired claim.
    pub fn sweep_step(&mut self, now_us: u64, buckets: usize) -> SweepStep {
        let Some(claims) = self.entries.as_mut() else {
            return SweepStep {
                swept: 0,
                visited: 0,
                finished: true,
            };
        };
        let before = claims.table.len();
        // Only a finished pass shrinks the table, so the cursor is always in it.
        let start = claims.sweep_from.min(claims.table.num_buckets());
        let end = start
            .saturating_add(buckets)
            .min(claims.table.num_buckets());
        for index in start..end {
            // Removing a claim leaves every other one in its bucket.
            if let Ok(entry) = claims.table.get_bucket_entry(index) {
                if !entry.get().is_live(now_us) {
                    entry.remove();
                }
            }
        }
        let swept = before - claims.table.len();
        let visited = end - start;
        let finished = end >= claims.table.num_buckets() || claims.table.is_empty();
        claims.sweep_from = if finished { 0 } else { end };
        if claims.table.is_empty() {
            self.entries = None;
        } else if finished {
            claims.nodes.retain(|n| Arc::strong_count(n) > 1);
            // A rehash moves every claim in one go, so it is kept rare: only a
            // table left under a quarter full shrinks, and to half full, not
            // to fit, which the next few claims would grow out of again.
            let len = claims.table.len().max(8);
            if claims.table.capacity() > 4 * len {
                let Claims { table, hasher, .. } = &mut **claims;
                table.shrink_to(2 * len, |e| hasher.hash_one((e.source_id(), e.key())));
            }
        }
        SweepStep {
            swept,
            visited,
            finished,
        }
    }

    /// Claims held, live or not yet swept.
    pub fn len(&self) -> usize {
        self.entries.as_ref().map_or(0, |c| c.table.len())
    }

    pub fn is_empty(&self) -> bool {
        self.entries.as_ref().is_none_or(|c| c.table.is_empty())
    }

    /// Every claim held with its `(source_id, key)`, live or not yet swept.
    pub fn iter(&self) -> impl Iterator<Item = ((&str, &str), &ClaimEntry)> {
        self.entries
            .iter()
            .flat_map(|c| c.table.iter())
            .map(|e| ((e.source_id(), e.key()), e))
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
    fn claim_text_splits_where_it_was_joined() {
        for (s, k, h) in [
            ("src", "key", "hook"),
            ("", "", ""),
            ("ab", "c", ""),
            ("a", "bc", "d"),
            ("ünï", "cødé\0", "hø"),
        ] {
            let text = ClaimText::new(s, k, h);
            assert_eq!((text.source_id(), text.key(), text.hook_id()), (s, k, h));
            assert!(text.names(s, k));
        }
        // The same bytes split elsewhere name another claim.
        assert!(!ClaimText::new("ab", "c", "").names("a", "bc"));
        assert!(!ClaimText::new("a", "bc", "").names("ab", "c"));
        assert_ne!(
            ClaimText::new("ab", "c", "h"),
            ClaimText::new("a", "bc", "h")
        );
    }

    #[test]
    fn an_empty_table_is_one_pointer() {
        // Kept in every tenant's state, parked ones included (docs/benchmarks.md).
        assert_eq!(std::mem::size_of::<ClaimTable>(), 8);
        let mut table = ClaimTable::default();
        assert!(table.is_empty() && table.iter().next().is_none());
        assert_eq!(table.len(), 0);
        assert_eq!(table.sweep(0), 0);
        assert!(table.remove("s", "k").is_none());
        assert!(table.find("s", "k", 0).is_none());
        assert!(table.live(&ClaimKey::new("s", "k"), 0).is_none());
    }

    #[test]
    fn expired_claims_are_invisible_then_swept() {
        let mut table = ClaimTable::default();
        table.insert(ClaimEntry::new("s", "k", "h", Phase::Committed, 100));
        assert!(table.find("s", "k", 99).is_some());
        assert!(table.live(&ClaimKey::new("s", "k"), 99).is_some());
        assert!(table.find("s", "k", 100).is_none());
        assert_eq!(table.sweep(99), 0);
        assert_eq!(table.sweep(100), 1);
        assert!(table.is_empty());
    }

    #[test]
    fn a_sweep_in_steps_drops_what_one_pass_would() {
        let mut table = ClaimTable::default();
        let claim = |table: &mut ClaimTable, i: usize, expires_us: u64| {
            let key = format!("k{i}");
            table.insert(ClaimEntry::new(
                "s",
                &key,
                "h",
                Phase::Committed,
                expires_us,
            ));
        };
        for i in 0..10_000 {
            claim(&mut table, i, if i % 2 == 0 { 100 } else { 1_000 });
        }
        let (mut steps, mut swept) = (0, 0);
        loop {
            let step = table.sweep_step(100, 1_000);
            steps += 1;
            swept += step.swept;
            if step.finished {
                break;
            }
            // Claims made between steps, enough to grow the table under the
            // pass: the live ones stay, the expired ones go now or next pass.
            if steps == 3 {
                for i in 10_000..30_000 {
                    claim(&mut table, i, if i % 2 == 0 { 100 } else { 1_000 });
                }
            }
        }
        assert!(steps > 10, "{steps} steps");
        assert!(swept >= 5_000, "{swept} swept");
        assert_eq!(table.sweep(100) + swept, 15_000);
        assert_eq!(table.len(), 15_000);
        for i in (1..30_000).step_by(2) {
            assert!(table.find("s", &format!("k{i}"), 100).is_some(), "k{i}");
        }
        // A pass ends with the table it empties.
        let mut swept = 0;
        for _ in 0..table.entries.as_ref().map_or(0, |c| c.table.num_buckets()) {
            let step = table.sweep_step(1_000, 1_000);
            swept += step.swept;
            if step.finished {
                break;
            }
        }
        assert_eq!(swept, 15_000);
        assert!(table.is_empty() && table.entries.is_none());
        let step = table.sweep_step(1_000, 1);
        assert_eq!((step.swept, step.finished), (0, true));
    }

    #[test]
    fn a_slot_claims_vacant_and_expired_keys_in_place() {
        let mut table = ClaimTable::default();
        assert!(table.slot("s", "k").get().is_none());
        let claimed = table.slot("s", "k").claim("s", "k", "h1", "n1", 10);
        assert_eq!((claimed.hook_id(), claimed.expires_us), ("h1", 10));
        assert_eq!(table.slot("s", "k").get().map(|e| e.hook_id()), Some("h1"));
        table.slot("s", "k").claim("s", "k", "h2", "n1", 20);
        assert_eq!(table.len(), 1);
        let entry = table.find("s", "k", 15).expect("replaced");
        assert_eq!(entry.hook_id(), "h2");
        assert!(table.find("s", "other", 15).is_none());
    }

    #[test]
    fn pending_claims_share_their_node() {
        let mut table = ClaimTable::default();
        let node_of = |e: &ClaimEntry| match &e.phase {
            Phase::Pending { node } => node.clone(),
            Phase::Committed => panic!("pending expected"),
        };
        let a = node_of(table.slot("s", "a").claim("s", "a", "h", "edge-1", 10));
        let b = node_of(table.slot("s", "b").claim("s", "b", "h", "edge-1", 10));
        let c = node_of(table.slot("s", "c").claim("s", "c", "h", "edge-2", 10));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        table.insert(ClaimEntry::new(
            "s",
            "d",
            "h",
            Phase::Pending {
                node: "edge-2".into(),
            },
            10,
        ));
        let d = node_of(table.find("s", "d", 0).expect("inserted"));
        assert!(Arc::ptr_eq(&c, &d));
        drop((a, b, c, d));
        // Once their claims are swept, unused nodes are let go.
        table.insert(ClaimEntry::new("s", "e", "h", Phase::Committed, 20));
        assert_eq!(table.sweep(10), 4);
        assert!(table.entries.as_ref().is_some_and(|c| c.nodes.is_empty()));
    }

    #[test]
    fn record_round_trip() {
        let entry = ClaimEntry::new("s", "k", "h", Phase::Pending { node: "n1".into() }, 5);
        let record = ClaimRecord::from_entry(&entry);
        assert_eq!(record.node(), Some("n1"));
        assert!(!record.committed);
        assert_eq!(record.clone().into_entry(), entry);
        assert_eq!(
            record,
            ClaimRecord::new("s", "k", "h", Some("n1"), false, 5)
        );
        // A record shares the entry's text rather than copying it.
        assert!(Arc::ptr_eq(&record.text.text, &entry.text.text));
        assert_eq!(record.into_entry(), entry);
        let committed = ClaimEntry::new("s", "k", "h", Phase::Committed, 5);
        let record = ClaimRecord::from_entry(&committed);
        assert_eq!((record.node(), record.committed), (None, true));
        assert_eq!(record.into_entry(), committed);
    }
}
