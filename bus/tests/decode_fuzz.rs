//! Hostile payloads against the decoders: `Request::decode`, `Request::validate`
//! and `Reply::decode` must answer every byte string with a value or a
//! `DecodeError` — never a panic, a stack overflow, a hang or a huge allocation —
//! and valid frames must round-trip.
//!
//! A node decodes whatever arrives on its shard's subject and an edge whatever
//! comes back, so either crashing on input is an outage anyone on the bus can
//! cause. Allocation is measured by a counting global allocator (per thread, so
//! the harness's parallel tests do not disturb each other).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

use ankusa_actors::{
    Charge, Claim, HitOutcome, HitRequest, InvalidRequest, Kind, SettleOutcome, SettleRequest,
    Settlement,
};
use ankusa_bus::protocol::{
    DecodeError, ErrorCode, ErrorReply, Op, Reply, ReplyBody, Request, MAX_BATCH, MAX_DEPTH,
    MAX_REQUEST_BYTES,
};
use proptest::prelude::*;
use serde::Serialize;

// ---------------------------------------------------------------------------
// Allocation accounting

struct Counting;

thread_local! {
    // `const` initialisers without destructors: touching them never allocates,
    // which an allocator's bookkeeping must not.
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn track(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; the
// wrapper only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            track(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        track(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            track(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the most memory it held at once.
fn peak_bytes<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let peak = PEAK.with(Cell::get) - start;
    (out, peak.max(0) as usize)
}

/// Every decoder on `bytes`, as a node and an edge would run them, with the
/// memory and time they took. Panics propagate and fail the test.
fn decode_all(bytes: &[u8]) -> (Result<Request, DecodeError>, usize, Duration) {
    let started = Instant::now();
    let (req, peak) = peak_bytes(|| {
        let req = Request::decode(bytes);
        if let Ok(req) = &req {
            let _ = req.validate();
            let _ = req.tenant();
        }
        let _ = Reply::decode(bytes);
        req
    });
    (req, peak, started.elapsed())
}

/// What decoding `len` hostile bytes may cost: the decoded value itself, which
/// serde may preallocate for each declared element present (a `Request` is a
/// couple of hundred bytes), plus a constant.
fn memory_budget(len: usize) -> usize {
    64 * 1024 + 256 * len
}

fn assert_cheap(bytes: &[u8]) -> Result<Request, DecodeError> {
    let (req, peak, took) = decode_all(bytes);
    assert!(
        peak <= memory_budget(bytes.len()),
        "{peak} bytes to decode {} bytes: {:02x?}",
        bytes.len(),
        &bytes[..bytes.len().min(64)]
    );
    assert!(took < Duration::from_millis(500), "{took:?} to decode");
    req
}

// ---------------------------------------------------------------------------
// Valid frames

fn text(max: usize) -> impl Strategy<Value = String> {
    // Any chars, including NUL, `.`, `>` and multi-byte ones, cut to `max` bytes.
    proptest::collection::vec(any::<char>(), 1..12).prop_map(move |chars| {
        let mut s = String::new();
        for c in chars {
            if s.len() + c.len_utf8() > max {
                break;
            }
            s.push(c);
        }
        if s.is_empty() {
            s.push('t');
        }
        s
    })
}

fn claim(tenant: String) -> impl Strategy<Value = Claim> {
    (
        text(256),
        text(1024),
        text(256),
        text(256),
        1..=90 * 24 * 3600 * 1000u64,
        1..=3600 * 1000u64,
    )
        .prop_map(
            move |(source_id, key, hook_id, node, ttl_ms, pending_ttl_ms)| Claim {
                tenant: tenant.clone(),
                source_id,
                key,
                hook_id,
                node,
                ttl_ms,
                pending_ttl_ms,
            },
        )
}

/// A valid operation that is not a batch.
fn single_op() -> impl Strategy<Value = Op> {
    text(256).prop_flat_map(|tenant| {
        let charge = |kind, tenant: String| {
            (1..=365 * 24 * 3600 * 1_000_000u64).prop_flat_map(move |capacity_us| {
                let tenant = tenant.clone();
                (1..=capacity_us).prop_map(move |increment_us| Charge {
                    kind,
                    tenant: tenant.clone(),
                    increment_us,
                    capacity_us,
                })
            })
        };
        let hit = (
            proptest::option::of(charge(Kind::Hooks, tenant.clone())),
            proptest::option::of(charge(Kind::Bytes, tenant.clone())),
            proptest::option::of(claim(tenant.clone())),
        )
            .prop_filter("a hit needs something to do", |(h, b, c)| {
                h.is_some() || b.is_some() || c.is_some()
            })
            .prop_map(|(h, b, claim)| {
                Op::Hit(HitRequest {
                    charges: h.into_iter().chain(b).collect(),
                    claim,
                })
            });
        let settle = (claim(tenant.clone()), any::<bool>()).prop_map(|(claim, commit)| {
            Op::Settle(SettleRequest {
                claim,
                settlement: if commit {
                    Settlement::Commit
                } else {
                    Settlement::Release
                },
            })
        });
        prop_oneof![hit, settle, Just(Op::Reset { tenant })]
    })
}

fn single_request() -> impl Strategy<Value = Request> {
    (1..u64::MAX, single_op()).prop_map(|(t, op)| Request::new(t, op))
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        3 => single_request(),
        1 => (1..u64::MAX, proptest::collection::vec(single_request(), 0..6))
            .prop_map(|(t, items)| Request::new(t, Op::Batch(items))),
    ]
}

fn error_reply() -> impl Strategy<Value = ErrorReply> {
    let code = prop_oneof![
        Just(ErrorCode::Malformed),
        Just(ErrorCode::TooLarge),
        Just(ErrorCode::DeadlineExpired),
        Just(ErrorCode::Overloaded),
        Just(ErrorCode::WrongShard),
        Just(ErrorCode::Unavailable),
        Just(ErrorCode::Internal),
    ];
    let invalid = prop_oneof![
        text(32).prop_map(|field| InvalidRequest::Empty { field }),
        (text(32), any::<usize>(), any::<usize>())
            .prop_map(|(field, len, max)| InvalidRequest::TooLong { field, len, max }),
        Just(InvalidRequest::NothingToDo),
        Just(InvalidRequest::MixedTenants),
        Just(InvalidRequest::DuplicateBucket { kind: Kind::Bytes }),
        (any::<u64>(), any::<u64>()).prop_map(|(increment_us, capacity_us)| {
            InvalidRequest::IncrementExceedsCapacity {
                increment_us,
                capacity_us,
            }
        }),
    ];
    prop_oneof![
        (code, text(64)).prop_map(|(code, m)| ErrorReply::new(code, m)),
        invalid.prop_map(ErrorReply::invalid),
        any::<u64>().prop_map(|got| DecodeError::UnsupportedVersion { got }.into()),
    ]
}

fn single_body() -> impl Strategy<Value = ReplyBody> {
    prop_oneof![
        Just(ReplyBody::Hit(HitOutcome::Ok)),
        text(256).prop_map(|hook_id| ReplyBody::Hit(HitOutcome::Duplicate { hook_id })),
        any::<u64>().prop_map(|ms| ReplyBody::Hit(HitOutcome::Pending { retry_after_ms: ms })),
        any::<u64>().prop_map(|ms| ReplyBody::Hit(HitOutcome::RateLimited { retry_after_ms: ms })),
        Just(ReplyBody::Settle(SettleOutcome::Ok)),
        Just(ReplyBody::Settle(SettleOutcome::NotFound)),
        Just(ReplyBody::Settle(SettleOutcome::AlreadyCommitted)),
        text(256).prop_map(|hook_id| ReplyBody::Settle(SettleOutcome::NotOwner { hook_id })),
        Just(ReplyBody::Reset),
        error_reply().prop_map(ReplyBody::Error),
    ]
}

fn reply() -> impl Strategy<Value = Reply> {
    prop_oneof![
        3 => single_body().prop_map(Reply::new),
        1 => proptest::collection::vec(single_body().prop_map(Reply::new), 0..6)
            .prop_map(|items| Reply::new(ReplyBody::Batch(items))),
    ]
}

/// Either direction's frame, encoded.
fn frame() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        request().prop_map(|r| r.encode()),
        request().prop_map(|r| r.encode_compact()),
        reply().prop_map(|r| r.encode()),
    ]
}

// ---------------------------------------------------------------------------
// Where the values of a valid frame are, to break them one at a time

/// The byte range of every value in a well-formed frame (keys included), in
/// document order.
fn spans(bytes: &[u8]) -> Vec<(usize, usize)> {
    fn walk(b: &[u8], pos: usize, out: &mut Vec<(usize, usize)>) -> usize {
        let slot = out.len();
        out.push((pos, pos));
        let m = b[pos];
        let be = |at: usize, n: usize| {
            b[at..at + n]
                .iter()
                .fold(0usize, |a, &x| a << 8 | usize::from(x))
        };
        let (header, data, values) = match m {
            0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => (1, 0, 0),
            0x80..=0x8f => (1, 0, 2 * usize::from(m & 0x0f)),
            0x90..=0x9f => (1, 0, usize::from(m & 0x0f)),
            0xa0..=0xbf => (1, usize::from(m & 0x1f), 0),
            0xd9 => (2, be(pos + 1, 1), 0),
            0xda => (3, be(pos + 1, 2), 0),
            0xdb => (5, be(pos + 1, 4), 0),
            0xcc => (2, 0, 0),
            0xcd => (3, 0, 0),
            0xce => (5, 0, 0),
            0xcf => (9, 0, 0),
            0xdc => (3, 0, be(pos + 1, 2)),
            0xdd => (5, 0, be(pos + 1, 4)),
            0xde => (3, 0, 2 * be(pos + 1, 2)),
            other => panic!("the encoder does not write {other:#04x}"),
        };
        let mut end = pos + header + data;
        for _ in 0..values {
            end = walk(b, end, out);
        }
        out[slot].1 = end;
        end
    }
    let mut out = Vec::new();
    let end = walk(bytes, 0, &mut out);
    assert_eq!(end, bytes.len());
    out
}

/// Values of every MessagePack type, and of the lying kinds: each is put in place
/// of a field of a valid frame.
fn replacement() -> impl Strategy<Value = Vec<u8>> {
    let deep = |open: u8, n: usize| std::iter::repeat_n(open, n).collect::<Vec<u8>>();
    prop_oneof![
        Just(vec![0xc0]),                                                 // nil
        Just(vec![0xc3]),                                                 // true
        Just(vec![0xff]),                                                 // -1
        Just(vec![0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]),                      // i64::MIN
        Just(vec![0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]), // u64::MAX
        Just(vec![0xcb, 0x40, 0x59, 0, 0, 0, 0, 0, 0]),                   // 100.0
        Just(vec![0xa1, b'x']),                                           // "x"
        Just(vec![0xa0]),                                                 // ""
        Just(vec![0xa2, 0xff, 0xfe]),                                     // not UTF-8
        Just(b"\xa5reset".to_vec()),
        Just(vec![0xc4, 0x01, 0x00]),                       // bin
        Just(vec![0xd4, 0x01, 0x00]),                       // fixext 1
        Just(vec![0x90]),                                   // []
        Just(vec![0x80]),                                   // {}
        Just(vec![0x91, 0xc0]),                             // [nil]
        Just(vec![0x81, 0xa1, b'x', 0xc0]),                 // {"x": nil}
        Just(vec![0xc1]),                                   // reserved
        Just(vec![0xdd, 0x80, 0, 0, 0]),                    // array of 2^31, no data
        Just(vec![0xdf, 0xff, 0xff, 0xff, 0xff]),           // map of 2^32-1, no data
        Just(vec![0xdb, 0x7f, 0xff, 0xff, 0xff]),           // str of 2^31-1 bytes, none
        Just(vec![0xc6, 0xff, 0xff, 0xff, 0xff]),           // bin of 2^32-1 bytes, none
        Just(vec![0xc9, 0xff, 0xff, 0xff, 0xff, 0x01]),     // ext of 2^32-1 bytes, none
        Just(deep(0x91, 40)),                               // [[[[...  cut off
        Just([deep(0x91, MAX_DEPTH), vec![0x90]].concat()), // nested past the limit
        proptest::collection::vec(any::<u8>(), 0..8),
    ]
}

// ---------------------------------------------------------------------------
// Properties

/// Few enough cases to finish in seconds in a debug build, enough to have
/// covered every replacement at many places.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn arbitrary_bytes_are_answered_cheaply(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        assert_cheap(&bytes).ok();
    }

    #[test]
    fn valid_requests_round_trip_and_validate(req in request()) {
        let bytes = req.encode();
        prop_assert_eq!(Request::decode(&bytes), Ok(req.clone()));
        // The compact form is the same request in fewer bytes.
        let compact = req.encode_compact();
        prop_assert_eq!(Request::decode(&compact), Ok(req.clone()));
        prop_assert!(compact.len() < bytes.len());
        if let Op::Batch(items) = &req.op {
            let edge = Request::encode_batch(req.timeout_ms, items.iter().map(|r| (r.timeout_ms, &r.op)));
            prop_assert_eq!(&edge, &compact);
        } else {
            prop_assert_eq!(&Request::encode_op(req.timeout_ms, &req.op), &compact);
        }
        // The strategy stays within every limit, so the rules must accept it.
        prop_assert_eq!(req.validate(), Ok(()));
        prop_assert_eq!(&req.tenant().is_some(), &!matches!(req.op, Op::Batch(_)));
    }

    #[test]
    fn valid_replies_round_trip(reply in reply()) {
        prop_assert_eq!(Reply::decode(&reply.encode()), Ok(reply));
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn every_truncation_is_malformed(bytes in frame()) {
        // No proper prefix of one MessagePack value is a complete value.
        for len in 0..bytes.len() {
            let cut = &bytes[..len];
            let got = assert_cheap(cut);
            prop_assert!(matches!(got, Err(DecodeError::Malformed(_))), "{} of {}: {:?}", len, bytes.len(), got);
            prop_assert!(matches!(Reply::decode(cut), Err(DecodeError::Malformed(_))));
        }
    }

    #[test]
    fn flipped_bytes_never_panic(
        bytes in frame(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1..=255u8), 1..4),
    ) {
        let mut bytes = bytes;
        for (at, mask) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
        }
        if let Ok(req) = assert_cheap(&bytes) {
            // Whatever survived decoding is a value the encoder reproduces.
            prop_assert_eq!(Request::decode(&req.encode()), Ok(req));
        }
    }

    #[test]
    fn a_wrong_value_in_any_field_never_panics(
        bytes in frame(),
        at in any::<prop::sample::Index>(),
        with in replacement(),
    ) {
        let spans = spans(&bytes);
        let (start, end) = spans[at.index(spans.len())];
        let broken = [&bytes[..start], &with[..], &bytes[end..]].concat();
        if let Ok(req) = assert_cheap(&broken) {
            prop_assert_eq!(Request::decode(&req.encode()), Ok(req));
        }
    }

    #[test]
    fn unknown_versions_are_told_apart(req in request(), v in any::<u64>()) {
        prop_assume!(v != 1);
        // `v` of any width, ahead of a v1 body...
        #[derive(Serialize)]
        struct AnyVersion<'a> { v: u64, timeout_ms: u64, op: &'a Op }
        let bytes = rmp_serde::to_vec_named(&AnyVersion { v, timeout_ms: req.timeout_ms, op: &req.op }).unwrap();
        prop_assert_eq!(Request::decode(&bytes), Err(DecodeError::UnsupportedVersion { got: v }));
        // ...or of a body that looks nothing like one.
        #[derive(Serialize)]
        struct Future { v: u64, shiny: Vec<u8> }
        let bytes = rmp_serde::to_vec_named(&Future { v, shiny: vec![1, 2] }).unwrap();
        prop_assert_eq!(Request::decode(&bytes), Err(DecodeError::UnsupportedVersion { got: v }));
        // The same in the compact form, where `v` is the first element.
        let bytes = rmp_serde::to_vec(&AnyVersion { v, timeout_ms: req.timeout_ms, op: &req.op }).unwrap();
        prop_assert_eq!(Request::decode(&bytes), Err(DecodeError::UnsupportedVersion { got: v }));
        let bytes = rmp_serde::to_vec(&Future { v, shiny: vec![1, 2] }).unwrap();
        prop_assert_eq!(Request::decode(&bytes), Err(DecodeError::UnsupportedVersion { got: v }));
        let refused = ErrorReply::from(DecodeError::UnsupportedVersion { got: v });
        prop_assert_eq!(refused.code, ErrorCode::UnsupportedVersion);
        prop_assert_eq!(refused.supported_versions, Some(vec![1]));
        // And a reply of another version is not taken for a v1 one.
        if let Ok(v32) = u32::try_from(v) {
            let mut reply = Reply::new(ReplyBody::Reset);
            reply.v = v32;
            prop_assert_eq!(Reply::decode(&reply.encode()), Err(DecodeError::UnsupportedVersion { got: v }));
        }
    }
}

// ---------------------------------------------------------------------------
// The hostile frames by hand

/// `{"v": 1, "timeout_ms": 5, "op": {"batch": <rest>}}`.
fn batch_of(rest: &[u8]) -> Vec<u8> {
    [b"\x83\xa1v\x01\xaatimeout_ms\x05\xa2op\x81\xa5batch", rest].concat()
}

#[test]
fn huge_declared_lengths_are_refused_without_allocating() {
    let frames: Vec<Vec<u8>> = vec![
        vec![0xdd, 0x80, 0, 0, 0],
        vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0],
        vec![0xdf, 0xff, 0xff, 0xff, 0xff],
        vec![0xdb, 0x7f, 0xff, 0xff, 0xff, b'a'],
        vec![0xc6, 0xff, 0xff, 0xff, 0xff],
        vec![0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
        batch_of(&[0xdd, 0x80, 0, 0, 0]),
        // An array of 2^31 requests whose first item is complete.
        batch_of(
            &[
                &[0xdd, 0x80, 0, 0, 0][..],
                &Request::new(1, Op::Reset { tenant: "t".into() }).encode(),
            ]
            .concat(),
        ),
        // A tenant claiming 2^31 bytes.
        b"\x83\xa1v\x01\xaatimeout_ms\x05\xa2op\x81\xa5reset\x81\xa6tenant\xdb\x7f\xff\xff\xff"
            .to_vec(),
        // A reply batch claiming 2^32-1 replies.
        b"\x82\xa1v\x01\xa4body\x81\xa5batch\xdd\xff\xff\xff\xff".to_vec(),
    ];
    for bytes in frames {
        let (got, peak, took) = decode_all(&bytes);
        assert!(
            matches!(got, Err(DecodeError::Malformed(_))),
            "{bytes:02x?}: {got:?}"
        );
        assert!(peak < 16 * 1024, "{peak} bytes for {bytes:02x?}");
        assert!(
            took < Duration::from_millis(50),
            "{took:?} for {bytes:02x?}"
        );
    }
    // One level of lying per nested batch, as deep as a payload can go: each
    // level used to preallocate for the elements it claimed.
    let mut nested = Vec::new();
    while nested.len() + 64 < MAX_REQUEST_BYTES {
        nested.extend_from_slice(&batch_of(&[0xdd, 0x7f, 0xff, 0xff, 0xff]));
    }
    let (got, peak, _) = decode_all(&nested);
    assert!(matches!(got, Err(DecodeError::Malformed(_))), "{got:?}");
    assert!(peak < 64 * 1024, "{peak} bytes");
}

#[test]
fn deep_nesting_is_refused_not_recursed_into() {
    // Plain arrays, as deep as a request may be long: this used to overflow the
    // decoder's stack and abort the process.
    let arrays = vec![0x91; MAX_REQUEST_BYTES];
    assert!(matches!(
        assert_cheap(&arrays),
        Err(DecodeError::Malformed(m)) if m.contains("nested deeper")
    ));
    // The same under a batch, where serde recursed into the items.
    let under_batch = batch_of(&vec![0x91; MAX_REQUEST_BYTES - 64]);
    assert!(matches!(
        assert_cheap(&under_batch),
        Err(DecodeError::Malformed(m)) if m.contains("nested deeper")
    ));
    // Replies have no size limit; a megabyte of nesting is refused as fast.
    let started = Instant::now();
    let mut deep_reply = b"\x82\xa1v\x01\xa4body\x81\xa3hit".to_vec();
    deep_reply.extend(std::iter::repeat_n(0x81, 1 << 20));
    assert!(matches!(
        Reply::decode(&deep_reply),
        Err(DecodeError::Malformed(_))
    ));
    assert!(started.elapsed() < Duration::from_secs(1));

    // Batches in batches: as deep as the limit allows they decode (and are then
    // refused by the rules); deeper, the frame is malformed.
    let reset = Request::new(5, Op::Reset { tenant: "t".into() });
    let mut req = reset.clone();
    let mut levels = 0;
    loop {
        req = Request::new(5, Op::Batch(vec![req]));
        levels += 1;
        match assert_cheap(&req.encode()) {
            Ok(decoded) => {
                assert_eq!(decoded, req);
                if levels == 1 {
                    assert_eq!(decoded.validate(), Ok(()));
                } else {
                    let err = decoded.validate().expect_err("a batch in a batch");
                    assert_eq!(err.code, ErrorCode::Malformed);
                }
            }
            Err(DecodeError::Malformed(m)) => {
                assert!(m.contains("nested deeper"), "{m}");
                break;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    // The innermost reset nests 3 deep (request, op, reset maps) and each batch
    // around it adds 3 (request map, op map, array).
    assert_eq!(
        levels - 1,
        (MAX_DEPTH - 3) / 3,
        "levels of batches that decode"
    );

    // The nesting limit is exact: MAX_DEPTH arrays scan, one more does not.
    let at_limit = [vec![0x91; MAX_DEPTH - 1], vec![0x90]].concat();
    let over = [vec![0x91; MAX_DEPTH], vec![0x90]].concat();
    assert!(
        matches!(Request::decode(&at_limit), Err(DecodeError::Malformed(m)) if !m.contains("nested"))
    );
    assert!(
        matches!(Request::decode(&over), Err(DecodeError::Malformed(m)) if m.contains("nested"))
    );
}

#[test]
fn batch_limits_and_item_versions() {
    let reset = Request::new(5, Op::Reset { tenant: "t".into() });
    let full = Request::new(5, Op::Batch(vec![reset.clone(); MAX_BATCH]));
    assert_eq!(
        Request::decode(&full.encode()).map(|r| r.validate()),
        Ok(Ok(()))
    );
    let over = Request::new(5, Op::Batch(vec![reset.clone(); MAX_BATCH + 1]));
    let err = Request::decode(&over.encode())
        .unwrap()
        .validate()
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::TooLarge);
    // An item of another version spoils the batch, whatever the batch says.
    let mut odd = reset.clone();
    odd.v = 9;
    let mixed = Request::new(5, Op::Batch(vec![reset.clone(), odd]));
    assert_eq!(
        Request::decode(&mixed.encode()),
        Err(DecodeError::UnsupportedVersion { got: 9 })
    );
    let mut odd_reply = Reply::new(ReplyBody::Reset);
    odd_reply.v = 9;
    let replies = Reply::new(ReplyBody::Batch(vec![odd_reply]));
    assert_eq!(
        Reply::decode(&replies.encode()),
        Err(DecodeError::UnsupportedVersion { got: 9 })
    );
    // A frame is one value: a second one after it is refused, not ignored.
    let twice = [reset.encode(), reset.encode()].concat();
    assert!(
        matches!(Request::decode(&twice), Err(DecodeError::Malformed(m)) if m.contains("trailing"))
    );
}
