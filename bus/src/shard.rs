//! Where a tenant lives: the shard function, the subjects a shard answers on,
//! and shard lists as people read them.
//!
//! `shard = fnv1a_32(utf8(tenant)) mod shards`. FNV-1a is specified in a few lines
//! (see `docs/protocol.md`), so an edge in any language computes the same shard.
//! Tenants never appear in a subject, so any bytes in a tenant are safe.

/// Shards an instance may be configured with.
pub const MAX_SHARDS: u32 = 4096;

/// 32-bit FNV-1a of `bytes`.
pub fn fnv1a_32(bytes: &[u8]) -> u32 {
    const OFFSET_BASIS: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    bytes.iter().fold(OFFSET_BASIS, |hash, &b| {
        (hash ^ u32::from(b)).wrapping_mul(PRIME)
    })
}

/// The shard owning `tenant` among `shards` (which must be at least 1).
pub fn shard_of(tenant: &str, shards: u32) -> u32 {
    fnv1a_32(tenant.as_bytes()) % shards.max(1)
}

/// Shard numbers as people read them, runs folded: `0-15,17,20-31` (`-` for
/// none). Expects them in ascending order, as nodes and leases keep them.
pub fn ranges(shards: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut shards = shards.iter().copied().peekable();
    while let Some(start) = shards.next() {
        let mut end = start;
        while shards
            .next_if(|&next| Some(next) == end.checked_add(1))
            .is_some()
        {
            end += 1;
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

/// Why an instance name cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstanceError {
    #[error("instance name is empty")]
    Empty,
    #[error("instance name `{0}` may only hold a-z, 0-9, `_` and `-` (at most 64 bytes)")]
    BadChars(String),
}

/// Whether `node_id` can name a node: 1 to 128 of A-Z, a-z, 0-9, `-` and
/// `_`, so that it is one token of its node subject ([`Subjects::node`]).
pub fn is_node_id(node_id: &str) -> bool {
    (1..=128).contains(&node_id.len())
        && node_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The subject space of one instance: `ankusa.<instance>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subjects {
    prefix: String,
}

impl Subjects {
    pub fn new(instance: &str) -> Result<Self, InstanceError> {
        if instance.is_empty() {
            return Err(InstanceError::Empty);
        }
        let ok = instance.len() <= 64
            && instance
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !ok {
            return Err(InstanceError::BadChars(instance.to_string()));
        }
        Ok(Self {
            prefix: format!("ankusa.{instance}"),
        })
    }

    /// `ankusa.<instance>`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The subject shard `n` answers on: `ankusa.<instance>.shard.<n>`.
    pub fn shard(&self, n: u32) -> String {
        format!("{}.shard.{n}", self.prefix)
    }

    /// The subject a node takes batches on for every shard it serves:
    /// `ankusa.<instance>.node.<node_id>`.
    pub fn node(&self, node_id: &str) -> String {
        format!("{}.node.{node_id}", self.prefix)
    }

    /// Every shard subject: `ankusa.<instance>.shard.*`.
    pub fn all_shards(&self) -> String {
        format!("{}.shard.*", self.prefix)
    }

    /// The instance name, for naming KV buckets and streams.
    pub fn instance(&self) -> &str {
        &self.prefix["ankusa.".len()..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_one_subject_token() {
        for good in ["a", "node-1", "Pod_7", &"n".repeat(128)] {
            assert!(is_node_id(good), "{good:?}");
        }
        for bad in ["", "a.b", "a b", "node.>", "*", "é", &"n".repeat(129)] {
            assert!(!is_node_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn shard_lists_fold_runs() {
        assert_eq!(ranges(&[]), "-");
        assert_eq!(ranges(&[7]), "7");
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(ranges(&[u32::MAX - 1, u32::MAX]), "4294967294-4294967295");
    }

    #[test]
    fn fnv1a_reference_values() {
        // Published FNV-1a 32-bit test values.
        assert_eq!(fnv1a_32(b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(b"foobar"), 0xbf9c_f968);
    }

    #[test]
    fn instance_names() {
        assert_eq!(
            Subjects::new("prod-eu").unwrap().shard(7),
            "ankusa.prod-eu.shard.7"
        );
        assert_eq!(Subjects::new("x").unwrap().instance(), "x");
        assert!(Subjects::new("").is_err());
        assert!(Subjects::new("a.b").is_err());
        assert!(Subjects::new("A").is_err());
        assert!(Subjects::new("a*").is_err());
    }
}
