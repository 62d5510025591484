//! The wire protocol: what an edge sends to a shard's subject and what it gets
//! back, in MessagePack. Replies are maps with named fields
//! (`rmp_serde::to_vec_named`); requests are either that or the compact form,
//! each record an array of its fields in order (`rmp_serde::to_vec`), which
//! this crate's edge sends: half the bytes, and a third less to decode.
//!
//! `docs/protocol.md` is the language-neutral spec of this module; the test
//! vectors there are checked against it. Decoding never panics: every way a
//! payload can be wrong is a [`DecodeError`].

use ankusa_actors::{
    HitOutcome, HitRequest, InspectRequest, InvalidRequest, SettleOutcome, SettleRequest,
    TenantView,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// Versions a node accepts.
pub const SUPPORTED_VERSIONS: &[u32] = &[VERSION];
/// Largest request payload a node decodes.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// Requests one batch may carry.
pub const MAX_BATCH: usize = 256;
/// Deepest nesting of arrays and maps in any frame, request or reply. A v1
/// request nests at most 8 deep (a charge inside a batched hit) and a reply 8 (a
/// bucket of a tenant view inside a batch reply), so
/// this leaves room for later versions while bounding the decoder's recursion.
pub const MAX_DEPTH: usize = 16;

/// One request: a version, the caller's remaining budget and one operation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub v: u32,
    /// Milliseconds the caller still waits, counted from when it sent this. The node
    /// drops work it cannot start within it; 0 is already expired.
    pub timeout_ms: u64,
    pub op: Op,
}

/// An operation, encoded as a map with exactly one key naming it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Hit(HitRequest),
    Settle(SettleRequest),
    Reset {
        tenant: String,
    },
    /// Read a tenant's state without changing it, for operators. A node that
    /// predates it answers `malformed`.
    Inspect(InspectRequest),
    /// Several requests for one shard in one message, answered in order. A batch
    /// may not contain a batch.
    Batch(Vec<Request>),
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub v: u32,
    pub body: ReplyBody,
    /// The node that answered, on replies to a shard's subject: an edge learns
    /// from it where to send its batches for that shard (the node's subject).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// What came of a request, a map with exactly one key naming it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplyBody {
    Hit(HitOutcome),
    Settle(SettleOutcome),
    Reset,
    Inspect(TenantView),
    Batch(Vec<Reply>),
    Error(ErrorReply),
}

/// A request the node did not carry out. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ErrorReply {
    pub code: ErrorCode,
    pub message: String,
    /// For `invalid`: which rule the request broke.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invalid: Option<InvalidRequest>,
    /// For `unsupported_version`: what the node speaks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub supported_versions: Option<Vec<u32>>,
}

/// Why a node refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not MessagePack, or not the shape of a request.
    Malformed,
    /// A version this node does not speak; see `supported_versions`.
    UnsupportedVersion,
    /// Over [`MAX_REQUEST_BYTES`] or [`MAX_BATCH`].
    TooLarge,
    /// Well-formed but breaks a rule; see `invalid`.
    Invalid,
    /// The budget ran out before the work could start.
    DeadlineExpired,
    /// The tenant's queue is full; retry after a pause.
    Overloaded,
    /// The tenant does not hash to the shard this was sent to.
    WrongShard,
    /// Sent to a node's subject for a shard that node does not serve now.
    /// Nothing was changed: send it to the shard's subject.
    WrongNode,
    /// The node cannot serve the shard now (handoff, persistence failure).
    Unavailable,
    /// A fault in the node.
    Internal,
}

impl ErrorCode {
    /// Every code, in declaration order: `ALL[c as usize] == c`.
    pub const ALL: [ErrorCode; 10] = [
        ErrorCode::Malformed,
        ErrorCode::UnsupportedVersion,
        ErrorCode::TooLarge,
        ErrorCode::Invalid,
        ErrorCode::DeadlineExpired,
        ErrorCode::Overloaded,
        ErrorCode::WrongShard,
        ErrorCode::WrongNode,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ];
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            ErrorCode::Malformed => "malformed",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Invalid => "invalid",
            ErrorCode::DeadlineExpired => "deadline_expired",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::WrongShard => "wrong_shard",
            ErrorCode::WrongNode => "wrong_node",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        };
        f.write_str(name)
    }
}

impl ErrorReply {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            invalid: None,
            supported_versions: None,
        }
    }

    pub fn invalid(why: InvalidRequest) -> Self {
        Self {
            message: why.to_string(),
            invalid: Some(why),
            ..Self::new(ErrorCode::Invalid, "")
        }
    }
}

impl From<DecodeError> for ErrorReply {
    fn from(err: DecodeError) -> Self {
        let message = err.to_string();
        match err {
            DecodeError::TooLarge { .. } => ErrorReply::new(ErrorCode::TooLarge, message),
            DecodeError::UnsupportedVersion { .. } => ErrorReply {
                supported_versions: Some(SUPPORTED_VERSIONS.to_vec()),
                ..ErrorReply::new(ErrorCode::UnsupportedVersion, message)
            },
            DecodeError::Malformed(_) => ErrorReply::new(ErrorCode::Malformed, message),
        }
    }
}

/// The borrowed twins of a [`Request`] and of a batch of them: the same bytes.
#[derive(Serialize)]
struct RequestRef<'a> {
    v: u32,
    timeout_ms: u64,
    op: &'a Op,
}

#[derive(Serialize)]
struct BatchRef<'a> {
    v: u32,
    timeout_ms: u64,
    op: BatchOpRef<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "snake_case")]
enum BatchOpRef<'a> {
    Batch(Vec<RequestRef<'a>>),
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload of {len} bytes exceeds the limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("protocol version {got} is not supported (supported: {SUPPORTED_VERSIONS:?})")]
    UnsupportedVersion { got: u64 },
    #[error("malformed payload: {0}")]
    Malformed(String),
}

/// The part of a request that every version shares, read first so that an
/// unknown version is told apart from garbage.
#[derive(Deserialize)]
struct Envelope {
    v: u64,
}

/// The `v` of a frame that did not decode: its `v` key in the named form, or
/// its first element in the compact one.
fn frame_version(payload: &[u8]) -> Option<u64> {
    if let Ok(env) = rmp_serde::from_slice::<Envelope>(payload) {
        return Some(env.v);
    }
    let mut rest = payload;
    rmp::decode::read_array_len(&mut rest).ok()?;
    rmp::decode::read_int(&mut rest).ok()
}

impl Op {
    /// Every operation's wire name, in declaration order: `NAMES[op.index()]`
    /// is `op.name()`.
    pub const NAMES: [&'static str; 5] = ["hit", "settle", "reset", "inspect", "batch"];

    /// The operation's wire name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        Self::NAMES[self.index()]
    }

    /// The operation's place in [`Op::NAMES`], for tables indexed by it.
    pub fn index(&self) -> usize {
        match self {
            Op::Hit(_) => 0,
            Op::Settle(_) => 1,
            Op::Reset { .. } => 2,
            Op::Inspect(_) => 3,
            Op::Batch(_) => 4,
        }
    }
}

impl Request {
    pub fn new(timeout_ms: u64, op: Op) -> Self {
        Self {
            v: VERSION,
            timeout_ms,
            op,
        }
    }

    /// The request with its records as named maps, the canonical form.
    pub fn encode(&self) -> Vec<u8> {
        encode_named(self, MESSAGE_ROOM)
    }

    /// The request with its records as arrays of their fields in order.
    pub fn encode_compact(&self) -> Vec<u8> {
        encode_compact(self, MESSAGE_ROOM)
    }

    /// The bytes of `Request::new(timeout_ms, op.clone()).encode_compact()`,
    /// without the clone.
    pub fn encode_op(timeout_ms: u64, op: &Op) -> Vec<u8> {
        encode_compact(
            &RequestRef {
                v: VERSION,
                timeout_ms,
                op,
            },
            MESSAGE_ROOM,
        )
    }

    /// The bytes of a batch of `(timeout_ms, op)` items, as
    /// `Request::new(timeout_ms, Op::Batch(..)).encode_compact()` would write
    /// them, without cloning the operations: an edge keeps each call's own to
    /// send it again.
    pub fn encode_batch<'a>(
        timeout_ms: u64,
        items: impl IntoIterator<Item = (u64, &'a Op)>,
    ) -> Vec<u8> {
        let items = items
            .into_iter()
            .map(|(timeout_ms, op)| RequestRef {
                v: VERSION,
                timeout_ms,
                op,
            })
            .collect::<Vec<_>>();
        let room = items.len() * MESSAGE_ROOM;
        encode_compact(
            &BatchRef {
                v: VERSION,
                timeout_ms,
                op: BatchOpRef::Batch(items),
            },
            room,
        )
    }

    /// Decodes a request, checking size, version and shape (not the rules: see
    /// [`Request::validate`]).
    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        if payload.len() > MAX_REQUEST_BYTES {
            return Err(DecodeError::TooLarge {
                len: payload.len(),
                max: MAX_REQUEST_BYTES,
            });
        }
        check_frame(payload)?;
        match rmp_serde::from_slice::<Request>(payload) {
            Ok(req) if SUPPORTED_VERSIONS.contains(&req.v) => {
                // A batch is one frame of one version: an item of another version
                // would be read with the wrong rules.
                if let Op::Batch(items) = &req.op {
                    if let Some(item) = items.iter().find(|r| !SUPPORTED_VERSIONS.contains(&r.v)) {
                        return Err(DecodeError::UnsupportedVersion { got: item.v.into() });
                    }
                }
                Ok(req)
            }
            Ok(req) => Err(DecodeError::UnsupportedVersion { got: req.v.into() }),
            Err(err) => match frame_version(payload) {
                Some(v) if !SUPPORTED_VERSIONS.iter().any(|&s| u64::from(s) == v) => {
                    Err(DecodeError::UnsupportedVersion { got: v })
                }
                _ => Err(DecodeError::Malformed(err.to_string())),
            },
        }
    }

    /// Checks the request's contents against the limits of `ankusa_actors::types::limits`.
    pub fn validate(&self) -> Result<(), ErrorReply> {
        match &self.op {
            Op::Hit(hit) => hit.validate().map_err(ErrorReply::invalid),
            Op::Settle(settle) => settle.validate().map_err(ErrorReply::invalid),
            Op::Reset { tenant } => {
                ankusa_actors::types::validate_tenant(tenant).map_err(ErrorReply::invalid)
            }
            Op::Inspect(inspect) => inspect.validate().map_err(ErrorReply::invalid),
            Op::Batch(items) => Self::validate_batch(items),
        }
    }

    /// Checks a batch's items as a whole: their number, and no batch among
    /// them (each item's own rules are its own `validate`).
    pub fn validate_batch(items: &[Request]) -> Result<(), ErrorReply> {
        if items.len() > MAX_BATCH {
            return Err(ErrorReply::new(
                ErrorCode::TooLarge,
                format!("batch of {} requests exceeds {MAX_BATCH}", items.len()),
            ));
        }
        if items.iter().any(|r| matches!(r.op, Op::Batch(_))) {
            return Err(ErrorReply::new(
                ErrorCode::Malformed,
                "a batch may not contain a batch",
            ));
        }
        Ok(())
    }

    /// The tenant this request is for, when it names exactly one.
    pub fn tenant(&self) -> Option<&str> {
        match &self.op {
            Op::Hit(hit) => Some(hit.tenant()),
            Op::Settle(settle) => Some(&settle.claim.tenant),
            Op::Reset { tenant } => Some(tenant),
            Op::Inspect(inspect) => Some(&inspect.tenant),
            Op::Batch(_) => None,
        }
    }
}

impl Reply {
    pub fn new(body: ReplyBody) -> Self {
        Self {
            v: VERSION,
            body,
            node: None,
        }
    }

    /// Names the node that answered.
    pub fn from_node(mut self, node: Option<&str>) -> Self {
        self.node = node.map(str::to_owned);
        self
    }

    pub fn error(err: ErrorReply) -> Self {
        Self::new(ReplyBody::Error(err))
    }

    pub fn encode(&self) -> Vec<u8> {
        encode_named(self, MESSAGE_ROOM)
    }

    /// Decodes a reply, checking its shape and version (and those of a batch's
    /// items). There is no size limit: replies come from nodes, and the frame
    /// check below already bounds what a hostile one could cost.
    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        let reply: Reply = decode_frame(payload)?;
        let items = match &reply.body {
            ReplyBody::Batch(items) => items.as_slice(),
            _ => &[],
        };
        for v in std::iter::once(reply.v).chain(items.iter().map(|r| r.v)) {
            if !SUPPORTED_VERSIONS.contains(&v) {
                return Err(DecodeError::UnsupportedVersion { got: v.into() });
            }
        }
        Ok(reply)
    }
}

/// Decodes one MessagePack value once [`check_frame`] has let it through: the
/// way to read any frame another process wrote (replies, and every KV value a
/// node reads: heartbeats, leases, claim-log messages).
pub(crate) fn decode_frame<T: DeserializeOwned>(payload: &[u8]) -> Result<T, DecodeError> {
    check_frame(payload)?;
    rmp_serde::from_slice(payload).map_err(|e| DecodeError::Malformed(e.to_string()))
}

/// The elements of a frame that is one array, each as its own bytes, once
/// [`check_frame`] has let the whole frame through: a reader that decodes
/// them one by one can skip one it cannot read (of a later release, say) and
/// keep the others.
pub(crate) fn array_elements(payload: &[u8]) -> Result<Vec<&[u8]>, DecodeError> {
    check_frame(payload)?;
    let mut rest = payload;
    let len = rmp::decode::read_array_len(&mut rest)
        .map_err(|e| DecodeError::Malformed(format!("not an array: {e}")))?;
    // The frame check backed every declared element by bytes present.
    let mut elements = Vec::with_capacity(len as usize);
    for _ in 0..len {
        let start = rest;
        serde::de::IgnoredAny::deserialize(&mut rmp_serde::Deserializer::new(&mut rest))
            .map_err(|e| DecodeError::Malformed(e.to_string()))?;
        elements.push(&start[..start.len() - rest.len()]);
    }
    Ok(elements)
}

/// Walks one MessagePack value without building anything, so that serde only
/// ever sees a frame that is exactly one complete value nested at most
/// [`MAX_DEPTH`] deep.
///
/// Why: serde's derived decoders recurse once per level, and rmp-serde's own
/// limit (1024 levels) is far more than a thread's stack holds, so a 60 KiB frame
/// of nested arrays used to abort the process with a stack overflow. And every
/// declared length is now backed by bytes actually present, so a header that
/// claims 2^32 elements costs a rejected scan, not a preallocation per level.
/// Trailing bytes are refused too: a frame is one value.
fn check_frame(payload: &[u8]) -> Result<(), DecodeError> {
    /// What follows a marker.
    enum Then {
        /// This many bytes of data (`None`: the length itself is cut off).
        Bytes(Option<u64>),
        /// This many values (a map entry counts two).
        Values(Option<u64>),
    }
    let malformed = |what: String| Err(DecodeError::Malformed(what));
    // Reads the big-endian unsigned integer of `n` bytes at `pos`.
    let read_uint = |pos: &mut usize, n: usize| -> Option<u64> {
        let bytes = payload.get(*pos..pos.checked_add(n)?)?;
        *pos += n;
        Some(bytes.iter().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    };
    // Values still to read in each open array or map; the bottom entry is the
    // frame's one top-level value.
    let mut open: Vec<u64> = Vec::with_capacity(MAX_DEPTH + 1);
    open.push(1);
    let mut pos = 0usize;
    while let Some(left) = open.last_mut() {
        if *left == 0 {
            open.pop();
            continue;
        }
        *left -= 1;
        let at = pos;
        let Some(&marker) = payload.get(pos) else {
            return malformed(format!("truncated: a value is missing at byte {at}"));
        };
        pos += 1;
        let then = match marker {
            0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => Then::Bytes(Some(0)),
            0x80..=0x8f => Then::Values(Some(2 * u64::from(marker & 0x0f))),
            0x90..=0x9f => Then::Values(Some(u64::from(marker & 0x0f))),
            0xa0..=0xbf => Then::Bytes(Some(u64::from(marker & 0x1f))),
            0xc1 => return malformed(format!("reserved marker 0xc1 at byte {at}")),
            // bin and str: a length, then the data
            0xc4 | 0xd9 => Then::Bytes(read_uint(&mut pos, 1)),
            0xc5 | 0xda => Then::Bytes(read_uint(&mut pos, 2)),
            0xc6 | 0xdb => Then::Bytes(read_uint(&mut pos, 4)),
            // ext: a length, then a type byte, then the data
            0xc7 => Then::Bytes(read_uint(&mut pos, 1).map(|n| n + 1)),
            0xc8 => Then::Bytes(read_uint(&mut pos, 2).map(|n| n + 1)),
            0xc9 => Then::Bytes(read_uint(&mut pos, 4).map(|n| n + 1)),
            0xcc | 0xd0 => Then::Bytes(Some(1)),
            0xcd | 0xd1 => Then::Bytes(Some(2)),
            0xca | 0xce | 0xd2 => Then::Bytes(Some(4)),
            0xcb | 0xcf | 0xd3 => Then::Bytes(Some(8)),
            // fixext: a type byte, then 1, 2, 4, 8 or 16 bytes
            0xd4 => Then::Bytes(Some(2)),
            0xd5 => Then::Bytes(Some(3)),
            0xd6 => Then::Bytes(Some(5)),
            0xd7 => Then::Bytes(Some(9)),
            0xd8 => Then::Bytes(Some(17)),
            0xdc => Then::Values(read_uint(&mut pos, 2)),
            0xdd => Then::Values(read_uint(&mut pos, 4)),
            0xde => Then::Values(read_uint(&mut pos, 2).map(|n| 2 * n)),
            0xdf => Then::Values(read_uint(&mut pos, 4).map(|n| 2 * n)),
        };
        let rest = (payload.len() - pos) as u64;
        match then {
            Then::Bytes(Some(n)) if n <= rest => pos += n as usize,
            Then::Values(Some(n)) if n <= rest => {
                // `open` holds one entry per open container plus the bottom one.
                if open.len() > MAX_DEPTH {
                    return malformed(format!("nested deeper than {MAX_DEPTH} at byte {at}"));
                }
                open.push(n);
            }
            // Every value takes at least a byte, so a count past the bytes left
            // is a lie whatever follows; refusing it here keeps the scan short.
            Then::Bytes(Some(n)) | Then::Values(Some(n)) => {
                return malformed(format!(
                    "truncated: the value at byte {at} declares {n} more bytes or values, {rest} bytes follow"
                ))
            }
            Then::Bytes(None) | Then::Values(None) => {
                return malformed(format!("truncated: the length at byte {at} is cut off"))
            }
        }
    }
    if pos != payload.len() {
        return malformed(format!(
            "{} trailing bytes after the value",
            payload.len() - pos
        ));
    }
    Ok(())
}

/// The bytes a message is written into to start with. An empty buffer would
/// grow, copying what it holds, five or six times on the way to a hit's 200
/// or so, which cost three quarters of encoding one (`bus/benches/protocol.rs`).
pub(crate) const MESSAGE_ROOM: usize = 256;

/// `value` with its records as named maps, in a buffer of `room` bytes to
/// start with.
pub(crate) fn encode_named<T: Serialize>(value: &T, room: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(room);
    // Serializing these plain data types into a Vec cannot fail (no maps with
    // non-string keys, no sequences of unknown length); were it to, no bytes
    // rather than half a value.
    if rmp_serde::encode::write_named(&mut bytes, value).is_err() {
        bytes.clear();
    }
    bytes
}

/// `value` with its records as arrays of their fields in order: only for
/// records with no field that may be left out (requests, claim-log changes),
/// so that a field's place says which it is.
pub(crate) fn encode_compact<T: Serialize>(value: &T, room: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(room);
    if rmp_serde::encode::write(&mut bytes, value).is_err() {
        bytes.clear();
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use ankusa_actors::{Charge, Claim, Kind};

    fn hit() -> Request {
        Request::new(
            250,
            Op::Hit(HitRequest {
                charges: vec![Charge {
                    kind: Kind::Hooks,
                    tenant: "t".into(),
                    increment_us: 1000,
                    capacity_us: 10_000,
                }],
                claim: Some(Claim {
                    tenant: "t".into(),
                    source_id: "s".into(),
                    key: "k".into(),
                    hook_id: "h".into(),
                    node: "n".into(),
                    ttl_ms: 60_000,
                    pending_ttl_ms: 5_000,
                }),
            }),
        )
    }

    #[test]
    fn every_error_code_is_listed_in_order() {
        for (i, code) in ErrorCode::ALL.iter().enumerate() {
            assert_eq!(*code as usize, i, "{code}");
        }
        // A new code stops this match compiling: add it to `ALL` as well.
        let count = |code: ErrorCode| match code {
            ErrorCode::Malformed
            | ErrorCode::UnsupportedVersion
            | ErrorCode::TooLarge
            | ErrorCode::Invalid
            | ErrorCode::DeadlineExpired
            | ErrorCode::Overloaded
            | ErrorCode::WrongShard
            | ErrorCode::WrongNode
            | ErrorCode::Unavailable
            | ErrorCode::Internal => 1,
        };
        assert_eq!(ErrorCode::ALL.map(count).iter().sum::<usize>(), 10);
    }

    #[test]
    fn each_op_is_named_as_on_the_wire() {
        let Op::Hit(hit_op) = hit().op else {
            unreachable!("hit() is a hit")
        };
        let claim = hit_op.claim.clone().expect("hit() claims");
        let ops = [
            Op::Hit(hit_op),
            Op::Settle(SettleRequest {
                claim,
                settlement: ankusa_actors::Settlement::Commit,
            }),
            Op::Reset { tenant: "t".into() },
            Op::Inspect(InspectRequest {
                tenant: "t".into(),
                claim: None,
            }),
            Op::Batch(vec![hit()]),
        ];
        assert_eq!(ops.len(), Op::NAMES.len());
        for (index, op) in ops.iter().enumerate() {
            assert_eq!(op.index(), index);
            assert_eq!(op.name(), Op::NAMES[index]);
            // An op is a map of one entry keyed by its name (a fixstr).
            let name = op.name().as_bytes();
            let mut key = vec![0x81, 0xa0 | name.len() as u8];
            key.extend_from_slice(name);
            let bytes = Request::encode_op(1, op);
            assert!(
                bytes.windows(key.len()).any(|w| w == key.as_slice()),
                "{} not keyed as such in {bytes:x?}",
                op.name()
            );
        }
    }

    #[test]
    fn every_shape_round_trips() {
        let batch = Request::new(
            100,
            Op::Batch(vec![
                hit(),
                Request::new(5, Op::Reset { tenant: "t".into() }),
            ]),
        );
        for req in [hit(), batch] {
            assert_eq!(Request::decode(&req.encode()), Ok(req));
        }
        for body in [
            ReplyBody::Hit(HitOutcome::Ok),
            ReplyBody::Hit(HitOutcome::Duplicate {
                hook_id: "h".into(),
            }),
            ReplyBody::Hit(HitOutcome::Pending { retry_after_ms: 3 }),
            ReplyBody::Settle(SettleOutcome::NotOwner {
                hook_id: "x".into(),
            }),
            ReplyBody::Reset,
            ReplyBody::Batch(vec![Reply::new(ReplyBody::Settle(SettleOutcome::Ok))]),
            ReplyBody::Error(ErrorReply::invalid(InvalidRequest::NothingToDo)),
            ReplyBody::Error(DecodeError::UnsupportedVersion { got: 9 }.into()),
        ] {
            let reply = Reply::new(body);
            assert_eq!(Reply::decode(&reply.encode()), Ok(reply));
        }
    }

    #[test]
    fn borrowed_encodings_are_the_owned_bytes() {
        let reset = Op::Reset { tenant: "t".into() };
        let hit = hit().op;
        assert_eq!(
            Request::encode_op(7, &hit),
            Request::new(7, hit.clone()).encode_compact()
        );
        let owned = Request::new(
            100,
            Op::Batch(vec![
                Request::new(250, hit.clone()),
                Request::new(5, reset.clone()),
            ]),
        );
        assert_eq!(
            Request::encode_batch(100, [(250, &hit), (5, &reset)]),
            owned.encode_compact()
        );
    }

    #[test]
    fn a_reply_names_its_node_only_when_told() {
        let plain = Reply::new(ReplyBody::Reset);
        let named = plain.clone().from_node(Some("node-1"));
        // Absent when not set, so replies without it keep their bytes: the
        // name adds its key and value (fixstr 1 + 4, fixstr 1 + 6) and nothing else.
        assert_eq!(plain.encode().len() + 12, named.encode().len());
        assert_eq!(Reply::decode(&named.encode()), Ok(named));
        assert_eq!(Reply::decode(&plain.encode()).map(|r| r.node), Ok(None));
    }

    #[test]
    fn unknown_version_is_told_apart_from_garbage() {
        let mut req = hit();
        req.v = 2;
        assert_eq!(
            Request::decode(&req.encode()),
            Err(DecodeError::UnsupportedVersion { got: 2 })
        );
        #[derive(Serialize)]
        struct Future {
            v: u32,
            shiny: bool,
        }
        let future = rmp_serde::to_vec_named(&Future { v: 7, shiny: true }).unwrap();
        assert_eq!(
            Request::decode(&future),
            Err(DecodeError::UnsupportedVersion { got: 7 })
        );
        assert!(matches!(
            Request::decode(b"\xc1garbage"),
            Err(DecodeError::Malformed(_))
        ));
        assert!(matches!(
            Request::decode(&[]),
            Err(DecodeError::Malformed(_))
        ));
        let big = vec![0u8; MAX_REQUEST_BYTES + 1];
        assert!(matches!(
            Request::decode(&big),
            Err(DecodeError::TooLarge { .. })
        ));
    }
}
