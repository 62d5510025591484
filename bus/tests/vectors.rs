//! The test vectors of `docs/protocol.md`, checked against the code by parsing the
//! document itself, so the spec other languages implement from cannot drift from
//! what the Rust nodes and edges put on the wire.
//!
//! The document holds three kinds of machine-read blocks:
//!
//! - ```` ```hex name=N ```` with a ```` ```json name=N ```` view of the same frame:
//!   the bytes must decode to the value [`expected`] gives for `N`, that value must
//!   encode to exactly those bytes, and the JSON view must be what the bytes say;
//! - ```` ```hex name=N refused=CODE ````: a request a node must refuse with the
//!   error code `CODE`, at decode or at validation;
//! - the shard table between `<!-- shard-vectors:begin -->` and `:end -->`.
//!
//! After a deliberate protocol change, regenerate the blocks with
//! `cargo test -p ankusa-bus --test vectors -- --ignored --nocapture` and paste them.

use std::collections::BTreeMap;

use ankusa_actors::{
    BucketView, Charge, Claim, ClaimView, EventKey, HitOutcome, HitRequest, InspectRequest,
    InvalidRequest, Kind, SettleOutcome, SettleRequest, Settlement, TenantView,
};
use ankusa_bus::protocol::{
    DecodeError, ErrorCode, ErrorReply, Op, Reply, ReplyBody, Request, MAX_REQUEST_BYTES,
};
use ankusa_bus::shard::{fnv1a_32, shard_of};

const DOC: &str = include_str!("../../docs/protocol.md");

/// A frame of either direction.
#[derive(Debug, Clone, PartialEq)]
enum Frame {
    Request(Request),
    /// A request in the compact form (its records as arrays).
    CompactRequest(Request),
    Reply(Reply),
}

impl Frame {
    fn encode(&self) -> Vec<u8> {
        match self {
            Frame::Request(r) => r.encode(),
            Frame::CompactRequest(r) => r.encode_compact(),
            Frame::Reply(r) => r.encode(),
        }
    }

    /// Decodes `bytes` as the same direction as `self`.
    fn decode_like(&self, bytes: &[u8]) -> Result<Frame, DecodeError> {
        match self {
            Frame::Request(_) => Request::decode(bytes).map(Frame::Request),
            Frame::CompactRequest(_) => Request::decode(bytes).map(Frame::CompactRequest),
            Frame::Reply(_) => Reply::decode(bytes).map(Frame::Reply),
        }
    }
}

fn charges() -> Vec<Charge> {
    vec![
        Charge {
            kind: Kind::Hooks,
            tenant: "acme".into(),
            increment_us: 100_000,
            capacity_us: 2_000_000,
        },
        Charge {
            kind: Kind::Bytes,
            tenant: "acme".into(),
            increment_us: 1_024,
            capacity_us: 10_000_000,
        },
    ]
}

fn claim() -> Claim {
    Claim {
        tenant: "acme".into(),
        source_id: "stripe".into(),
        key: "evt_1NqX".into(),
        hook_id: "hk_01".into(),
        node: "edge-a".into(),
        ttl_ms: 86_400_000,
        pending_ttl_ms: 30_000,
    }
}

fn hit_claim(timeout_ms: u64) -> Request {
    Request::new(
        timeout_ms,
        Op::Hit(HitRequest {
            charges: charges(),
            claim: Some(claim()),
        }),
    )
}

fn hit_no_claim(timeout_ms: u64) -> Request {
    Request::new(
        timeout_ms,
        Op::Hit(HitRequest {
            charges: charges()[..1].to_vec(),
            claim: None,
        }),
    )
}

fn batch() -> Request {
    Request::new(250, Op::Batch(vec![hit_no_claim(240), reset(240)]))
}

fn reset(timeout_ms: u64) -> Request {
    Request::new(
        timeout_ms,
        Op::Reset {
            tenant: "acme".into(),
        },
    )
}

fn inspect() -> Request {
    Request::new(
        1000,
        Op::Inspect(InspectRequest {
            tenant: "acme".into(),
            claim: Some(EventKey {
                source_id: "stripe".into(),
                key: "evt_1NqX".into(),
            }),
        }),
    )
}

fn reply(body: ReplyBody) -> Frame {
    Frame::Reply(Reply::new(body))
}

/// The value every documented vector stands for, by name.
fn expected() -> BTreeMap<&'static str, Frame> {
    let settle = |settlement| {
        Frame::Request(Request::new(
            250,
            Op::Settle(SettleRequest {
                claim: claim(),
                settlement,
            }),
        ))
    };
    BTreeMap::from([
        ("request-hit-claim", Frame::Request(hit_claim(250))),
        (
            "request-hit-claim-compact",
            Frame::CompactRequest(hit_claim(250)),
        ),
        ("request-hit-no-claim", Frame::Request(hit_no_claim(250))),
        ("request-settle-commit", settle(Settlement::Commit)),
        ("request-settle-release", settle(Settlement::Release)),
        ("request-reset", Frame::Request(reset(1000))),
        ("request-batch", Frame::Request(batch())),
        ("request-batch-compact", Frame::CompactRequest(batch())),
        ("request-inspect", Frame::Request(inspect())),
        ("request-inspect-compact", Frame::CompactRequest(inspect())),
        ("reply-hit-ok", reply(ReplyBody::Hit(HitOutcome::Ok))),
        (
            "reply-hit-duplicate",
            reply(ReplyBody::Hit(HitOutcome::Duplicate {
                hook_id: "hk_00".into(),
            })),
        ),
        (
            "reply-hit-pending",
            reply(ReplyBody::Hit(HitOutcome::Pending {
                retry_after_ms: 1_200,
            })),
        ),
        (
            "reply-hit-rate-limited",
            reply(ReplyBody::Hit(HitOutcome::RateLimited {
                retry_after_ms: 100,
            })),
        ),
        (
            "reply-settle-ok",
            reply(ReplyBody::Settle(SettleOutcome::Ok)),
        ),
        (
            "reply-settle-not-found",
            reply(ReplyBody::Settle(SettleOutcome::NotFound)),
        ),
        (
            "reply-settle-not-owner",
            reply(ReplyBody::Settle(SettleOutcome::NotOwner {
                hook_id: "hk_00".into(),
            })),
        ),
        (
            "reply-settle-already-committed",
            reply(ReplyBody::Settle(SettleOutcome::AlreadyCommitted)),
        ),
        ("reply-reset", reply(ReplyBody::Reset)),
        (
            "reply-inspect",
            reply(ReplyBody::Inspect(TenantView {
                buckets: vec![BucketView {
                    kind: Kind::Hooks,
                    ahead_us: 150_000,
                }],
                claims_held: 3,
                claim: Some(ClaimView::Pending {
                    hook_id: "hk_01".into(),
                    node: "edge-a".into(),
                    expires_in_ms: 29_500,
                }),
            })),
        ),
        (
            "reply-inspect-committed",
            reply(ReplyBody::Inspect(TenantView {
                buckets: vec![],
                claims_held: 1,
                claim: Some(ClaimView::Committed {
                    hook_id: "hk_01".into(),
                    expires_in_ms: 86_399_000,
                }),
            })),
        ),
        (
            "reply-batch",
            reply(ReplyBody::Batch(vec![
                Reply::new(ReplyBody::Hit(HitOutcome::Ok)),
                Reply::new(ReplyBody::Reset),
            ])),
        ),
        (
            "reply-error-invalid",
            reply(ReplyBody::Error(ErrorReply::invalid(
                InvalidRequest::TooLong {
                    field: "key".into(),
                    len: 1500,
                    max: 1024,
                },
            ))),
        ),
        (
            "reply-error-unsupported-version",
            reply(ReplyBody::Error(
                DecodeError::UnsupportedVersion { got: 2 }.into(),
            )),
        ),
        (
            "reply-error-overloaded",
            reply(ReplyBody::Error(ErrorReply::new(
                ErrorCode::Overloaded,
                "tenant queue is full; retry after a pause",
            ))),
        ),
    ])
}

/// Requests a node must refuse, with the code it must refuse them with; only the
/// generator uses these, the test reads them back from the document.
fn refused() -> Vec<(&'static str, Vec<u8>, ErrorCode)> {
    let mut v2 = hit_no_claim(250);
    v2.v = 2;
    let mut trailing = reset(1000).encode();
    trailing.push(0xc0);
    let nested = Request::new(250, Op::Batch(vec![Request::new(250, Op::Batch(vec![]))]));
    let empty_tenant = Request::new(
        250,
        Op::Reset {
            tenant: String::new(),
        },
    );
    let mut truncated = reset(1000).encode();
    truncated.truncate(truncated.len() - 1);
    vec![
        (
            "refused-version-2",
            v2.encode(),
            ErrorCode::UnsupportedVersion,
        ),
        // A later version's frame need not look like a v1 request at all.
        (
            "refused-version-3-other-shape",
            b"\x82\xa1v\x03\xa5shiny\xc3".to_vec(),
            ErrorCode::UnsupportedVersion,
        ),
        ("refused-truncated", truncated, ErrorCode::Malformed),
        ("refused-trailing-byte", trailing, ErrorCode::Malformed),
        (
            "refused-no-op",
            b"\x82\xa1v\x01\xaatimeout_ms\x05".to_vec(),
            ErrorCode::Malformed,
        ),
        (
            "refused-nested-batch",
            nested.encode(),
            ErrorCode::Malformed,
        ),
        (
            "refused-empty-tenant",
            empty_tenant.encode(),
            ErrorCode::Invalid,
        ),
    ]
}

// ---------------------------------------------------------------------------
// Reading the document

/// One fenced block: its info string's first word, its `key=value` attributes and
/// its text.
#[derive(Debug)]
struct Block {
    lang: String,
    attrs: BTreeMap<String, String>,
    text: String,
}

fn blocks(doc: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut lines = doc.lines();
    while let Some(line) = lines.next() {
        let Some(info) = line.trim_start().strip_prefix("```") else {
            continue;
        };
        let mut words = info.split_whitespace();
        let lang = words.next().unwrap_or("").to_string();
        let attrs = words
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut text = String::new();
        for body in lines.by_ref() {
            if body.trim_start().starts_with("```") {
                break;
            }
            text.push_str(body);
            text.push('\n');
        }
        out.push(Block { lang, attrs, text });
    }
    out
}

/// The named blocks of one language, refusing duplicate names.
fn named<'a>(all: &'a [Block], lang: &str) -> BTreeMap<&'a str, &'a Block> {
    let mut out = BTreeMap::new();
    for block in all.iter().filter(|b| b.lang == lang) {
        if let Some(name) = block.attrs.get("name") {
            assert!(
                out.insert(name.as_str(), block).is_none(),
                "two ```{lang} blocks named {name}"
            );
        }
    }
    out
}

fn parse_hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text
        .bytes()
        .filter(|b| !b.is_ascii_whitespace())
        .map(|b| match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => panic!("not a hex digit: {:?} in {text:?}", b as char),
        })
        .collect();
    assert!(
        digits.len() % 2 == 0,
        "odd number of hex digits in {text:?}"
    );
    digits.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
}

fn to_hex(bytes: &[u8]) -> String {
    let mut out = String::new();
    for (i, chunk) in bytes.chunks(16).enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let line: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
        out.push_str(&line.join(" "));
    }
    out
}

/// JSON text with the whitespace outside string literals removed, so the
/// document may lay a frame out however reads best.
fn squeeze(json: &str) -> String {
    let (mut out, mut in_str, mut escaped) = (String::new(), false, false);
    for c in json.chars() {
        if in_str {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_str = false,
                _ => {}
            }
        } else if !c.is_whitespace() {
            out.push(c);
            in_str = c == '"';
        }
    }
    out
}

// ---------------------------------------------------------------------------
// A small MessagePack reader, independent of rmp-serde, for the JSON views: it
// shows what the bytes say rather than what serde makes of them.

#[derive(Debug)]
enum Value {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bin(Vec<u8>),
    Array(Vec<Value>),
    Map(Vec<(Value, Value)>),
}

fn read_value(bytes: &[u8], pos: &mut usize) -> Value {
    let take = |pos: &mut usize, n: usize| -> &[u8] {
        let s = &bytes[*pos..*pos + n];
        *pos += n;
        s
    };
    let uint = |s: &[u8]| s.iter().fold(0u64, |a, &b| a << 8 | u64::from(b));
    let marker = take(pos, 1)[0];
    let len = |pos: &mut usize, n: usize| uint(take(pos, n)) as usize;
    match marker {
        0x00..=0x7f => Value::Int(marker.into()),
        0xe0..=0xff => Value::Int((marker as i8).into()),
        0xc0 => Value::Nil,
        0xc2 => Value::Bool(false),
        0xc3 => Value::Bool(true),
        0xcc => Value::Int(uint(take(pos, 1)).into()),
        0xcd => Value::Int(uint(take(pos, 2)).into()),
        0xce => Value::Int(uint(take(pos, 4)).into()),
        0xcf => Value::Int(uint(take(pos, 8)).into()),
        0xd0 => Value::Int((uint(take(pos, 1)) as u8 as i8).into()),
        0xd1 => Value::Int((uint(take(pos, 2)) as u16 as i16).into()),
        0xd2 => Value::Int((uint(take(pos, 4)) as u32 as i32).into()),
        0xd3 => Value::Int((uint(take(pos, 8)) as i64).into()),
        0xca => Value::Float(f32::from_bits(uint(take(pos, 4)) as u32).into()),
        0xcb => Value::Float(f64::from_bits(uint(take(pos, 8)))),
        0xa0..=0xbf | 0xd9..=0xdb => {
            let n = match marker {
                0xd9 => len(pos, 1),
                0xda => len(pos, 2),
                0xdb => len(pos, 4),
                _ => usize::from(marker & 0x1f),
            };
            Value::Str(String::from_utf8(take(pos, n).to_vec()).expect("utf-8 string"))
        }
        0xc4..=0xc6 => {
            let n = len(pos, 1 << (marker - 0xc4));
            Value::Bin(take(pos, n).to_vec())
        }
        0x90..=0x9f | 0xdc | 0xdd => {
            let n = match marker {
                0xdc => len(pos, 2),
                0xdd => len(pos, 4),
                _ => usize::from(marker & 0x0f),
            };
            Value::Array((0..n).map(|_| read_value(bytes, pos)).collect())
        }
        0x80..=0x8f | 0xde | 0xdf => {
            let n = match marker {
                0xde => len(pos, 2),
                0xdf => len(pos, 4),
                _ => usize::from(marker & 0x0f),
            };
            Value::Map(
                (0..n)
                    .map(|_| (read_value(bytes, pos), read_value(bytes, pos)))
                    .collect(),
            )
        }
        other => panic!("marker {other:#04x} does not occur in a protocol vector"),
    }
}

fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// JSON of a value: containers that fit in `width` columns on one line, others
/// one member a line.
fn json(value: &Value, indent: usize, width: usize) -> String {
    let flat = |v: &Value| json(v, 0, usize::MAX);
    let (open, close, items): (char, char, Vec<String>) = match value {
        Value::Nil => return "null".into(),
        Value::Bool(b) => return b.to_string(),
        Value::Int(i) => return i.to_string(),
        Value::Float(f) => return f.to_string(),
        Value::Str(s) => return json_str(s),
        Value::Bin(b) => return format!("\"<bin {}>\"", to_hex(b)),
        Value::Array(items) => ('[', ']', items.iter().map(flat).collect()),
        Value::Map(entries) => (
            '{',
            '}',
            entries
                .iter()
                .map(|(k, v)| format!("{}: {}", flat(k), flat(v)))
                .collect(),
        ),
    };
    let one_line = format!("{open}{}{close}", items.join(", "));
    if indent + one_line.len() <= width {
        return one_line;
    }
    let pad = " ".repeat(indent + 2);
    let items: Vec<String> = match value {
        Value::Array(items) => items.iter().map(|v| json(v, indent + 2, width)).collect(),
        Value::Map(entries) => entries
            .iter()
            .map(|(k, v)| {
                let key = flat(k);
                format!("{key}: {}", json(v, indent + 2, width))
            })
            .collect(),
        _ => unreachable!("scalars returned above"),
    };
    format!(
        "{open}\n{pad}{}\n{}{close}",
        items.join(&format!(",\n{pad}")),
        " ".repeat(indent)
    )
}

fn render(bytes: &[u8]) -> String {
    let mut pos = 0;
    let value = read_value(bytes, &mut pos);
    assert_eq!(pos, bytes.len(), "trailing bytes after the value");
    json(&value, 0, 78)
}

// ---------------------------------------------------------------------------
// The checks

#[test]
fn every_documented_frame_decodes_to_its_value_and_back() {
    let all = blocks(DOC);
    let hex = named(&all, "hex");
    let views = named(&all, "json");
    let expected = expected();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (name, block) in hex.iter().filter(|(_, b)| !b.attrs.contains_key("refused")) {
        let Some(value) = expected.get(name) else {
            failures.push(format!("{name}: no expected value in bus/tests/vectors.rs"));
            continue;
        };
        let bytes = parse_hex(&block.text);
        let encoded = value.encode();
        if encoded != bytes {
            failures.push(format!(
                "{name}: the code encodes\n{}\nnot the documented\n{}",
                to_hex(&encoded),
                to_hex(&bytes)
            ));
        }
        match value.decode_like(&bytes) {
            Ok(decoded) if decoded == *value => {}
            other => failures.push(format!("{name}: decodes to {other:?}, not {value:?}")),
        }
        if let Frame::Request(req) = value {
            if let Err(err) = req.validate() {
                failures.push(format!("{name}: a documented request must be valid: {err}"));
            }
        }
        match views.get(name) {
            None => failures.push(format!("{name}: no ```json name={name} view")),
            Some(view) if squeeze(&view.text) != squeeze(&render(&encoded)) => failures.push(
                format!("{name}: the JSON view should read\n{}", render(&encoded)),
            ),
            Some(_) => {}
        }
        checked += 1;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // Every value the test knows is in the document, so none can silently go.
    let missing: Vec<_> = expected.keys().filter(|n| !hex.contains_key(*n)).collect();
    assert!(missing.is_empty(), "undocumented vectors: {missing:?}");
    assert_eq!(checked, expected.len());
}

fn code_of(name: &str) -> ErrorCode {
    // An error code is encoded as its name, so the name decodes to it.
    let encoded = rmp_serde::to_vec(name).expect("a string encodes");
    rmp_serde::from_slice(&encoded).unwrap_or_else(|e| panic!("`{name}` is no error code: {e}"))
}

#[test]
fn documented_bad_requests_are_refused_with_their_code() {
    let all = blocks(DOC);
    let mut seen = 0;
    for (name, block) in named(&all, "hex") {
        let Some(code) = block.attrs.get("refused") else {
            continue;
        };
        let want = code_of(code);
        let bytes = parse_hex(&block.text);
        let got = match Request::decode(&bytes) {
            Err(err) => ErrorReply::from(err),
            Ok(req) => req
                .validate()
                .expect_err(&format!("{name} decodes and validates: {req:?}")),
        };
        assert_eq!(got.code, want, "{name}: {got}");
        if want == ErrorCode::UnsupportedVersion {
            assert_eq!(got.supported_versions, Some(vec![1]), "{name}");
        }
        seen += 1;
    }
    assert_eq!(seen, refused().len(), "refused vectors in the document");
}

/// Reads a JSON string literal (the tenant column of the shard table).
fn unquote(lit: &str) -> String {
    let inner = lit
        .strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or_else(|| panic!("not a JSON string: {lit}"));
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                let code = u32::from_str_radix(&hex, 16).expect("\\u escape");
                out.push(char::from_u32(code).expect("a scalar value"));
            }
            Some(c @ ('"' | '\\' | '/')) => out.push(c),
            other => panic!("unsupported escape \\{other:?} in {lit}"),
        }
    }
    out
}

#[test]
fn shard_table_matches_the_code() {
    let begin = DOC
        .find("<!-- shard-vectors:begin -->")
        .expect("shard table start marker");
    let end = DOC
        .find("<!-- shard-vectors:end -->")
        .expect("shard table end marker");
    let rows: Vec<Vec<&str>> = DOC[begin..end]
        .lines()
        .filter(|l| l.trim_start().starts_with('|'))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().trim_matches('`'))
                .collect()
        })
        .collect();
    let header = &rows[0];
    assert_eq!(
        header,
        &["tenant", "UTF-8 bytes", "fnv1a_32", "S=16", "S=64", "S=256"],
        "shard table header"
    );
    let mut checked = 0;
    for row in rows.iter().skip(2) {
        let tenant = unquote(row[0]);
        let bytes = if row[1] == "(none)" {
            Vec::new()
        } else {
            parse_hex(row[1])
        };
        assert_eq!(tenant.as_bytes(), bytes, "row {row:?}: bytes column");
        let hash = u32::from_str_radix(row[2].trim_start_matches("0x"), 16).expect("hash");
        assert_eq!(fnv1a_32(&bytes), hash, "row {row:?}: hash");
        for (col, shards) in [(3, 16), (4, 64), (5, 256)] {
            let shard: u32 = row[col].parse().expect("shard number");
            assert_eq!(shard_of(&tenant, shards), shard, "row {row:?}: S={shards}");
        }
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} shard vectors");
}

/// The document's blocks, regenerated from the code: run with `--ignored
/// --nocapture` after a deliberate change and paste the output.
#[test]
#[ignore = "prints the vectors for docs/protocol.md"]
fn print_vectors() {
    for (name, value) in expected() {
        let bytes = value.encode();
        println!("```json name={name}\n{}\n```\n", render(&bytes));
        println!("```hex name={name}\n{}\n```\n", to_hex(&bytes));
    }
    for (name, bytes, code) in refused() {
        assert!(bytes.len() <= MAX_REQUEST_BYTES);
        println!(
            "```hex name={name} refused={code}\n{}\n```\n",
            to_hex(&bytes)
        );
    }
    println!("| tenant | UTF-8 bytes | fnv1a_32 | S=16 | S=64 | S=256 |");
    println!("|---|---|---|---|---|---|");
    for tenant in SHARD_TENANTS {
        let bytes = if tenant.is_empty() {
            "(none)".to_string()
        } else {
            to_hex(tenant.as_bytes())
        };
        println!(
            "| `{}` | `{bytes}` | `0x{:08x}` | {} | {} | {} |",
            json_str(tenant),
            fnv1a_32(tenant.as_bytes()),
            shard_of(tenant, 16),
            shard_of(tenant, 64),
            shard_of(tenant, 256)
        );
    }
}

/// Tenants of the shard table: the edge cases of a string an edge might hash.
const SHARD_TENANTS: &[&str] = &[
    "",
    "a",
    "foobar",
    "acme",
    "tenant-42",
    "Acme",
    ".",
    "*",
    ">",
    " ",
    "\0",
    "a.b",
    "acme corp",
    "tenant\0x",
    "ünïcødé",
    "日本",
    "🦀",
];
