//! The persisted and exported serde forms, pinned byte for byte.
//!
//! `ClaimRecord`, `ClaimChange`, `BucketRecord` and `TenantSnapshot` are written to
//! JetStream KV and documented in `docs/protocol.md`; their Rust representation may
//! change, their MessagePack bytes may not. The expected bytes were captured from
//! the plain derived structs of String fields these types started as.

use ankusa_actors::{BucketRecord, ClaimChange, ClaimRecord, Kind, TenantSnapshot};
use serde::de::DeserializeOwned;
use serde::Serialize;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("test hex"))
        .collect()
}

/// `value` encodes (named, as persisted) to exactly `expected`, and those bytes
/// decode to `value` again.
fn pinned<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(
    value: &T,
    expected: &str,
) {
    let named = rmp_serde::to_vec_named(value).expect("encodes");
    assert_eq!(hex(&named), expected);
    let back: T = rmp_serde::from_slice(&unhex(expected)).expect("decodes");
    assert_eq!(&back, value);
}

fn pending() -> ClaimRecord {
    ClaimRecord::new(
        "src_stripe_live",
        "evt_1Nq8xY",
        "0190c3e2-7b1a",
        Some("edge-3"),
        false,
        1_700_000_000_000_000,
    )
}

fn committed() -> ClaimRecord {
    ClaimRecord::new("stripe", "evt-9", "hook-9", None, true, 42)
}

/// Not something `hit` makes, but a record read back from storage must be
/// written back as it was: empty strings, a node on a committed claim.
fn odd() -> ClaimRecord {
    ClaimRecord::new("", "ünï:cødé\0", "", Some(""), true, u64::MAX)
}

fn snapshot() -> TenantSnapshot {
    TenantSnapshot {
        tenant: "tenant-0042".into(),
        buckets: vec![
            BucketRecord {
                kind: Kind::Hooks,
                tat_us: 5,
            },
            BucketRecord {
                kind: Kind::Bytes,
                tat_us: 1_700_000_000_000_123,
            },
        ],
        claims: vec![pending(), committed(), odd()],
    }
}

#[test]
fn claim_records_keep_their_bytes() {
    pinned(&pending(), PENDING_HEX);
    pinned(&committed(), COMMITTED_HEX);
    pinned(&odd(), ODD_HEX);
}

#[test]
fn claim_changes_keep_their_bytes() {
    pinned(&ClaimChange::Put(pending()), PUT_HEX);
    pinned(
        &ClaimChange::Delete {
            source_id: "src".into(),
            key: "k".into(),
            hook_id: "h".into(),
            expires_us: 7,
        },
        DELETE_HEX,
    );
}

#[test]
fn buckets_and_snapshots_keep_their_bytes() {
    pinned(
        &BucketRecord {
            kind: Kind::Bytes,
            tat_us: 1_700_000_000_000_123,
        },
        BUCKET_HEX,
    );
    pinned(&snapshot(), SNAPSHOT_HEX);
}

#[test]
fn compact_encoding_keeps_its_bytes_too() {
    // Not what is persisted, but a positional (array) form must not drift either.
    assert_eq!(
        hex(&rmp_serde::to_vec(&pending()).expect("encodes")),
        PENDING_COMPACT_HEX,
    );
    assert_eq!(
        hex(&rmp_serde::to_vec(&snapshot()).expect("encodes")),
        SNAPSHOT_COMPACT_HEX,
    );
    let back: TenantSnapshot =
        rmp_serde::from_slice(&unhex(SNAPSHOT_COMPACT_HEX)).expect("decodes");
    assert_eq!(back, snapshot());
}

#[test]
fn accessors_read_what_was_built() {
    let record = pending();
    assert_eq!(record.source_id(), "src_stripe_live");
    assert_eq!(record.key(), "evt_1Nq8xY");
    assert_eq!(record.hook_id(), "0190c3e2-7b1a");
    assert_eq!(record.node(), Some("edge-3"));
    assert!(!record.committed());
    assert_eq!(record.expires_us(), 1_700_000_000_000_000);
    let odd = odd();
    assert_eq!(
        (odd.source_id(), odd.key(), odd.hook_id()),
        ("", "ünï:cødé\0", "")
    );
    assert_eq!(odd.node(), Some(""));
    assert_eq!(committed().node(), None);
}

const PENDING_HEX: &str = concat!(
    "86a9736f757263655f6964af7372635f7374726970655f6c697665a36b6579aa6576745f314e7138",
    "7859a7686f6f6b5f6964ad30313930633365322d37623161a46e6f6465a6656467652d33a9636f6d",
    "6d6974746564c2aa657870697265735f7573cf00060a24181e4000",
);

const COMMITTED_HEX: &str = concat!(
    "86a9736f757263655f6964a6737472697065a36b6579a56576742d39a7686f6f6b5f6964a6686f6f",
    "6b2d39a46e6f6465c0a9636f6d6d6974746564c3aa657870697265735f75732a",
);

const ODD_HEX: &str = concat!(
    "86a9736f757263655f6964a0a36b6579adc3bc6ec3af3a63c3b864c3a900a7686f6f6b5f6964a0a4",
    "6e6f6465a0a9636f6d6d6974746564c3aa657870697265735f7573cfffffffffffffffff",
);

const PUT_HEX: &str = concat!(
    "81a350757486a9736f757263655f6964af7372635f7374726970655f6c697665a36b6579aa657674",
    "5f314e71387859a7686f6f6b5f6964ad30313930633365322d37623161a46e6f6465a6656467652d",
    "33a9636f6d6d6974746564c2aa657870697265735f7573cf00060a24181e4000",
);

const DELETE_HEX: &str = concat!(
    "81a644656c65746584a9736f757263655f6964a3737263a36b6579a16ba7686f6f6b5f6964a168aa",
    "657870697265735f757307",
);

const BUCKET_HEX: &str = "82a46b696e64a56279746573a67461745f7573cf00060a24181e407b";

const SNAPSHOT_HEX: &str = concat!(
    "83a674656e616e74ab74656e616e742d30303432a76275636b6574739282a46b696e64a5686f6f6b",
    "73a67461745f75730582a46b696e64a56279746573a67461745f7573cf00060a24181e407ba6636c",
    "61696d739386a9736f757263655f6964af7372635f7374726970655f6c697665a36b6579aa657674",
    "5f314e71387859a7686f6f6b5f6964ad30313930633365322d37623161a46e6f6465a6656467652d",
    "33a9636f6d6d6974746564c2aa657870697265735f7573cf00060a24181e400086a9736f75726365",
    "5f6964a6737472697065a36b6579a56576742d39a7686f6f6b5f6964a6686f6f6b2d39a46e6f6465",
    "c0a9636f6d6d6974746564c3aa657870697265735f75732a86a9736f757263655f6964a0a36b6579",
    "adc3bc6ec3af3a63c3b864c3a900a7686f6f6b5f6964a0a46e6f6465a0a9636f6d6d6974746564c3",
    "aa657870697265735f7573cfffffffffffffffff",
);

const PENDING_COMPACT_HEX: &str = concat!(
    "96af7372635f7374726970655f6c697665aa6576745f314e71387859ad30313930633365322d3762",
    "3161a6656467652d33c2cf00060a24181e4000",
);

const SNAPSHOT_COMPACT_HEX: &str = concat!(
    "93ab74656e616e742d303034329292a5686f6f6b730592a56279746573cf00060a24181e407b9396",
    "af7372635f7374726970655f6c697665aa6576745f314e71387859ad30313930633365322d376231",
    "61a6656467652d33c2cf00060a24181e400096a6737472697065a56576742d39a6686f6f6b2d39c0",
    "c32a96a0adc3bc6ec3af3a63c3b864c3a900a0a0c3cfffffffffffffffff",
);
