//! Hostile traffic on a node's subjects, against a real nats-server and a real
//! `ankusa-node`: a bounded flood of malformed, truncated, mistyped, oversized,
//! deeply nested, unknown-version, expired, reply-less and wrong-shard messages,
//! while a well-behaved edge keeps being answered correctly within its deadline.
//! The node must stay up, answer every request that has a reply subject with the
//! error its protocol names, and count what it refused in `/metrics`.
//!
//! Also: tenants and keys holding any bytes (dots, wildcards, spaces, unicode,
//! NUL) work end to end through a fleet-mode node, claims included, across a
//! restart of that node (the KV keys are hashed, so no byte can break a subject).
//!
//! The tests of this file share the two cores of a small box, and the flood tests
//! check that the edge is not starved, so they run one at a time (see [`SERIAL`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ankusa_actors::{
    Charge, EventKey, HitOutcome, HitRequest, InspectRequest, Kind, SettleOutcome, Settlement,
};
use ankusa_bus::protocol::{ErrorCode, Op, Reply, ReplyBody, Request, MAX_BATCH};
use ankusa_bus::{shard_of, FleetConfig, FleetStore, NatsOptions, Store, StoreError, Subjects};
use ankusa_tests::requests::{claim, hit, settle};
use ankusa_tests::{connected_edge, NatsServer, NodeProcess, NodeSpec};
use bytes::Bytes;
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

const SHARDS: u32 = 16;
const INSTANCE: &str = "test";
/// The well-behaved edge's deadline per call: roomy, so that a call the node
/// answers at all is answered within it, however loaded the host; a timeout
/// then says the edge was starved, not that the host was slow.
const EDGE_DEADLINE: Duration = Duration::from_secs(5);

/// One test at a time in this binary: parallel floods would measure each other.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn subjects() -> Subjects {
    Subjects::new(INSTANCE).expect("valid instance")
}

/// The first `n` tenants named `<prefix><i>` that live on `shard`.
fn tenants_of_shard(prefix: &str, shard: u32, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .filter(|t| shard_of(t, SHARDS) == shard)
        .take(n)
        .collect()
}

async fn connected_store(url: &str) -> FleetStore {
    let mut config = FleetConfig::new(NatsOptions::with_servers([url]), INSTANCE);
    config.shards = SHARDS;
    connected_edge(config).await
}

async fn start_node(spec: NodeSpec) -> NodeProcess {
    let node = NodeProcess::start(spec).expect("node starts");
    node.wait_ready(Duration::from_secs(20))
        .await
        .expect("node ready");
    node
}

// ---------------------------------------------------------------------------------
// The hostile corpus
// ---------------------------------------------------------------------------------

/// What the node must answer to one hostile message.
#[derive(Debug, Clone)]
enum Expect {
    /// No reply subject: nothing may come back.
    Silence,
    /// An error reply with this code.
    Code(ErrorCode),
    /// A hit answered normally or refused for its budget (a 1 ms deadline may or
    /// may not pass before the work starts).
    HitOrExpired,
    /// A batch reply of hit outcomes or per-item refusals.
    Batch,
    /// The flood tenant's state, read in its actor while the flood runs.
    Inspect,
}

/// One message of the flood.
struct Shot {
    subject: String,
    payload: Vec<u8>,
    expect: Expect,
}

/// A charge the flood tenant can pay thousands of times a second.
fn roomy(tenant: &str) -> Charge {
    Charge {
        kind: Kind::Hooks,
        tenant: tenant.into(),
        increment_us: 1,
        capacity_us: 1_000_000_000,
    }
}

fn roomy_hit(tenant: &str) -> HitRequest {
    HitRequest {
        charges: vec![roomy(tenant)],
        claim: None,
    }
}

/// Builds the hostile messages for `target` (a shard the well-behaved edge also
/// uses), `flood` being a tenant of that shard. Every variety the protocol names a
/// refusal for is here; `pick` chooses among them per message.
struct Corpus {
    target: String,
    other: String,
    flood: String,
    valid_hit: Vec<u8>,
}

#[derive(Serialize)]
struct Mistyped<V, T, O> {
    v: V,
    timeout_ms: T,
    op: O,
}

#[derive(Serialize)]
struct FutureShape {
    v: u64,
    shiny: bool,
}

impl Corpus {
    fn new(target_shard: u32, flood: String) -> Self {
        let subjects = subjects();
        let valid_hit = Request::new(100, Op::Hit(roomy_hit(&flood))).encode();
        Self {
            target: subjects.shard(target_shard),
            other: subjects.shard((target_shard + 1) % SHARDS),
            flood,
            valid_hit,
        }
    }

    fn shot(&self, payload: Vec<u8>, expect: Expect) -> Shot {
        Shot {
            subject: self.target.clone(),
            payload,
            expect,
        }
    }

    fn named(value: &impl Serialize) -> Vec<u8> {
        rmp_serde::to_vec_named(value).expect("test value encodes")
    }

    /// One hostile message of variety `kind` (0..VARIETIES).
    fn pick(&self, kind: usize, rng: &mut StdRng) -> Shot {
        use ErrorCode::*;
        let hit_op = Op::Hit(roomy_hit(&self.flood));
        match kind {
            // Not MessagePack at all, or nothing.
            0 => self.shot(b"\xc1\xff not msgpack".to_vec(), Expect::Code(Malformed)),
            1 => self.shot(Vec::new(), Expect::Code(Malformed)),
            // A valid frame cut short at a random byte: MessagePack is prefix-free,
            // so every proper prefix is an incomplete value.
            2 => {
                let cut = rng.random_range(1..self.valid_hit.len());
                self.shot(self.valid_hit[..cut].to_vec(), Expect::Code(Malformed))
            }
            3 => {
                let mut p = self.valid_hit.clone();
                p.push(0xc0);
                self.shot(p, Expect::Code(Malformed))
            }
            // Wrong types in the right places.
            4 => self.shot(
                Self::named(&Mistyped {
                    v: "1",
                    timeout_ms: 100,
                    op: &hit_op,
                }),
                Expect::Code(Malformed),
            ),
            5 => self.shot(
                Self::named(&Mistyped {
                    v: 1,
                    timeout_ms: "soon",
                    op: &hit_op,
                }),
                Expect::Code(Malformed),
            ),
            6 => self.shot(
                Self::named(&Mistyped {
                    v: 1,
                    timeout_ms: -5i64,
                    op: &hit_op,
                }),
                Expect::Code(Malformed),
            ),
            7 => self.shot(
                Self::named(&Mistyped {
                    v: 1,
                    timeout_ms: 1.5f64,
                    op: &hit_op,
                }),
                Expect::Code(Malformed),
            ),
            8 => {
                let mut op = BTreeMap::new();
                op.insert("explode", BTreeMap::<String, u8>::new());
                self.shot(
                    Self::named(&Mistyped {
                        v: 1,
                        timeout_ms: 100,
                        op,
                    }),
                    Expect::Code(Malformed),
                )
            }
            9 => {
                let mut charges = BTreeMap::new();
                charges.insert("hit", BTreeMap::from([("charges", "all of them")]));
                self.shot(
                    Self::named(&Mistyped {
                        v: 1,
                        timeout_ms: 100,
                        op: charges,
                    }),
                    Expect::Code(Malformed),
                )
            }
            // Huge declared lengths: array32, str32, map32, bin32 of 2^32-1.
            10 => self.shot(
                vec![0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0],
                Expect::Code(Malformed),
            ),
            11 => self.shot(
                vec![0xdb, 0xff, 0xff, 0xff, 0xff, b'x'],
                Expect::Code(Malformed),
            ),
            12 => self.shot(vec![0xdf, 0xff, 0xff, 0xff, 0xff], Expect::Code(Malformed)),
            13 => {
                // A plausible request head, then a key claiming 4 GiB.
                let mut p = vec![0x83, 0xa1, b'v', 0x01, 0xdb, 0xff, 0xff, 0xff, 0xff];
                p.extend_from_slice(b"timeout_ms");
                self.shot(p, Expect::Code(Malformed))
            }
            // Deep nesting: 40 000 levels (the frame check must not recurse), and
            // just one level past the limit.
            14 => {
                let mut p = vec![0x91u8; 40_000];
                p.push(0xc0);
                self.shot(p, Expect::Code(Malformed))
            }
            15 => {
                let mut p = vec![0x81u8, 0xa1, b'v'];
                p.extend(std::iter::repeat_n(0x91u8, 16));
                p.push(0x01);
                self.shot(p, Expect::Code(Malformed))
            }
            // Unknown versions, also of a shape nothing like version 1.
            16 => {
                let mut req = Request::new(100, hit_op);
                req.v = 2;
                self.shot(req.encode(), Expect::Code(UnsupportedVersion))
            }
            // The same in the compact form, where `v` is the first element.
            17 => {
                let mut req = Request::new(100, hit_op);
                req.v = u32::MAX;
                self.shot(req.encode_compact(), Expect::Code(UnsupportedVersion))
            }
            18 => self.shot(
                Self::named(&FutureShape {
                    v: u64::MAX,
                    shiny: true,
                }),
                Expect::Code(UnsupportedVersion),
            ),
            19 => {
                let mut item = Request::new(100, Op::Hit(roomy_hit(&self.flood)));
                item.v = 7;
                let batch = Request::new(100, Op::Batch(vec![item]));
                self.shot(batch.encode(), Expect::Code(UnsupportedVersion))
            }
            // Budgets: already expired, and 1 ms that may run out in the queue.
            20 => self.shot(
                Request::new(0, hit_op).encode(),
                Expect::Code(DeadlineExpired),
            ),
            21 => self.shot(
                Request::new(1, hit_op).encode_compact(),
                Expect::HitOrExpired,
            ),
            22 => {
                // A batch of 1 ms items for one tenant: the later items wait behind
                // the earlier ones, so some may expire before they start; and every
                // `SPENT_EVERY`th item comes with its budget already spent, which
                // is refused `deadline_expired` however fast the host. (Not a full
                // batch of 256: every item costs the shard actor a message, so full
                // batches at this rate are past what a debug-build node drains,
                // and the test is about survival and fairness, not capacity.)
                let items = (0..EXPIRING_BATCH)
                    .map(|n| {
                        let budget_ms = if n % SPENT_EVERY == SPENT_EVERY - 1 {
                            0
                        } else {
                            1
                        };
                        Request::new(budget_ms, Op::Hit(roomy_hit(&self.flood)))
                    })
                    .collect();
                self.shot(Request::new(1000, Op::Batch(items)).encode(), Expect::Batch)
            }
            // The largest budget there is: must not overflow the node's clock.
            31 if rng.random_bool(0.5) => self.shot(
                Request::new(u64::MAX, hit_op).encode(),
                Expect::HitOrExpired,
            ),
            // No reply subject: must be ignored (and counted).
            23 => Shot {
                subject: self.target.clone(),
                payload: self.valid_hit.clone(),
                expect: Expect::Silence,
            },
            24 => Shot {
                subject: self.target.clone(),
                payload: b"\xc1 garbage, no reply".to_vec(),
                expect: Expect::Silence,
            },
            // The flood tenant sent to a shard it does not live on.
            25 => Shot {
                subject: self.other.clone(),
                payload: Request::new(100, hit_op).encode(),
                expect: Expect::Code(WrongShard),
            },
            // Too large: the payload, and a batch of one request too many.
            26 => self.shot(vec![0x90; 70 * 1024], Expect::Code(TooLarge)),
            27 => {
                let items = (0..=MAX_BATCH)
                    .map(|_| {
                        Request::new(
                            100,
                            Op::Reset {
                                tenant: self.flood.clone(),
                            },
                        )
                    })
                    .collect();
                self.shot(
                    Request::new(100, Op::Batch(items)).encode(),
                    Expect::Code(TooLarge),
                )
            }
            // Well-formed but against the rules.
            28 => {
                let mut bad = roomy_hit(&self.flood);
                bad.charges[0].increment_us = bad.charges[0].capacity_us + 1;
                self.shot(
                    Request::new(100, Op::Hit(bad)).encode(),
                    Expect::Code(Invalid),
                )
            }
            29 => {
                let mut c = claim(&self.flood, "k", "h");
                c.key = "k".repeat(2000);
                let bad = HitRequest {
                    charges: vec![],
                    claim: Some(c),
                };
                self.shot(
                    Request::new(100, Op::Hit(bad)).encode(),
                    Expect::Code(Invalid),
                )
            }
            // An operator's read of the tenant being flooded.
            33 => {
                let read = InspectRequest {
                    tenant: self.flood.clone(),
                    claim: Some(EventKey {
                        source_id: "src".into(),
                        key: "k".into(),
                    }),
                };
                self.shot(
                    Request::new(100, Op::Inspect(read)).encode_compact(),
                    Expect::Inspect,
                )
            }
            // An operator's read against the rules too: an empty source.
            32 => {
                let bad = InspectRequest {
                    tenant: self.flood.clone(),
                    claim: Some(EventKey {
                        source_id: String::new(),
                        key: "k".into(),
                    }),
                };
                self.shot(
                    Request::new(100, Op::Inspect(bad)).encode_compact(),
                    Expect::Code(Invalid),
                )
            }
            // A batch inside a batch.
            30 => {
                let inner = Request::new(100, Op::Batch(vec![]));
                self.shot(
                    Request::new(100, Op::Batch(vec![inner])).encode(),
                    Expect::Code(Malformed),
                )
            }
            // Random bytes: never a valid request, but may happen to read as a map
            // with some `v`.
            _ => {
                let len = rng.random_range(1..64);
                let p: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                self.shot(p, Expect::Code(Malformed))
            }
        }
    }
}

/// Items in each batch of 1 ms requests.
const EXPIRING_BATCH: usize = 32;

/// One item in this many of such a batch has its budget spent already.
const SPENT_EVERY: usize = 8;

/// Varieties `Corpus::pick` knows, the last being random bytes.
const VARIETIES: usize = 35;

/// The variety of message `i`: each in turn, except that the two big ones (a
/// 70 KiB payload, a 40 000-deep nesting) come only every fourth round and random
/// bytes take their place otherwise. At full share they are 110 MB over a few
/// seconds into the one subscription the edge's shard shares, which measures the
/// debug-build client's copying, not the node's defences.
fn variety(i: usize) -> usize {
    let kind = i % VARIETIES;
    let big = kind == 14 || kind == 26;
    if big && (i / VARIETIES) % 4 != 0 {
        VARIETIES - 1
    } else {
        kind
    }
}

/// What a flood sent and what came back.
#[derive(Debug, Default)]
struct FloodReport {
    sent: usize,
    with_reply: usize,
    silent: usize,
    replies: usize,
    /// Refusals seen per code (batch items included).
    codes: HashMap<String, usize>,
    /// Batch items refused `deadline_expired`, and batch items answered at all.
    batch_items_expired: usize,
    batch_items: usize,
    /// Reads of the flood tenant answered with its state.
    inspected: usize,
    /// Wrong answers: (message index, what was expected, what came).
    wrong: Vec<String>,
    elapsed: Duration,
}

fn note_code(report: &mut FloodReport, code: ErrorCode) {
    *report.codes.entry(code.to_string()).or_default() += 1;
}

/// Sends `count` hostile messages spread over `over`, waits for the replies and
/// checks each against what the protocol says it must be.
async fn flood(
    client: &async_nats::Client,
    corpus: &Corpus,
    count: usize,
    over: Duration,
) -> FloodReport {
    let mut rng = StdRng::seed_from_u64(0x5eed_0008);
    let mut inbox = client
        .subscribe("_INBOX.hostile.>")
        .await
        .expect("subscribe to the hostile inbox");
    let mut expected: HashMap<usize, Expect> = HashMap::new();
    let mut report = FloodReport::default();
    let started = Instant::now();
    const CHUNK: usize = 250;
    let chunks = count.div_ceil(CHUNK);
    for chunk in 0..chunks {
        for i in chunk * CHUNK..((chunk + 1) * CHUNK).min(count) {
            let shot = corpus.pick(variety(i), &mut rng);
            let payload = Bytes::from(shot.payload);
            match shot.expect {
                Expect::Silence => {
                    client
                        .publish(shot.subject, payload)
                        .await
                        .expect("publish");
                    report.silent += 1;
                }
                expect => {
                    client
                        .publish_with_reply(shot.subject, format!("_INBOX.hostile.{i}"), payload)
                        .await
                        .expect("publish");
                    expected.insert(i, expect);
                    report.with_reply += 1;
                }
            }
            report.sent += 1;
        }
        client.flush().await.expect("flush");
        // Keep to the schedule: `count` messages over `over`, not as fast as
        // the socket takes them.
        let due = over.mul_f64((chunk + 1) as f64 / chunks as f64);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
    report.elapsed = started.elapsed();

    let mut seen = std::collections::HashSet::new();
    let collect_until = Instant::now() + Duration::from_secs(15);
    while report.replies < report.with_reply {
        let left = collect_until.saturating_duration_since(Instant::now());
        let Ok(Some(message)) = tokio::time::timeout(left, inbox.next()).await else {
            break;
        };
        report.replies += 1;
        let index: usize = message
            .subject
            .as_str()
            .rsplit('.')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("reply on an inbox of ours");
        if !seen.insert(index) {
            report.wrong.push(format!("#{index}: answered twice"));
            continue;
        }
        let reply = match Reply::decode(&message.payload) {
            Ok(reply) => reply,
            Err(err) => {
                report
                    .wrong
                    .push(format!("#{index}: undecodable reply: {err}"));
                continue;
            }
        };
        let expect = expected.get(&index).cloned();
        match (&expect, &reply.body) {
            (Some(Expect::Code(want)), ReplyBody::Error(err)) if err.code == *want => {
                note_code(&mut report, err.code)
            }
            // Random bytes may read as a map with a `v` we do not speak.
            (Some(Expect::Code(ErrorCode::Malformed)), ReplyBody::Error(err))
                if variety(index) == VARIETIES - 1 && err.code == ErrorCode::UnsupportedVersion =>
            {
                note_code(&mut report, err.code)
            }
            (Some(Expect::HitOrExpired), ReplyBody::Hit(_)) => {}
            (Some(Expect::Inspect), ReplyBody::Inspect(_)) => report.inspected += 1,
            (Some(Expect::HitOrExpired), ReplyBody::Error(err))
                if err.code == ErrorCode::DeadlineExpired =>
            {
                note_code(&mut report, err.code)
            }
            (Some(Expect::Batch), ReplyBody::Batch(items)) if items.len() == EXPIRING_BATCH => {
                for item in items {
                    report.batch_items += 1;
                    match &item.body {
                        ReplyBody::Hit(_) => {}
                        ReplyBody::Error(err)
                            if matches!(
                                err.code,
                                ErrorCode::DeadlineExpired | ErrorCode::Overloaded
                            ) =>
                        {
                            if err.code == ErrorCode::DeadlineExpired {
                                report.batch_items_expired += 1;
                            }
                            note_code(&mut report, err.code);
                        }
                        other => report
                            .wrong
                            .push(format!("#{index}: batch item answered {other:?}")),
                    }
                }
            }
            _ => report.wrong.push(format!(
                "#{index} (variety {}): expected {expect:?}, got {:?}",
                variety(index),
                reply.body
            )),
        }
    }
    report
}

// ---------------------------------------------------------------------------------
// The well-behaved edge
// ---------------------------------------------------------------------------------

/// What the well-behaved edge saw.
#[derive(Debug, Default)]
struct EdgeReport {
    calls: usize,
    correct: usize,
    /// Calls that timed out or were shed (`overloaded`): starved.
    starved: usize,
    /// Every wrong or failed answer, for the assertion message.
    failures: Vec<String>,
    latencies: Vec<Duration>,
}

/// Whether a call's answer says its caller was starved: no answer within the
/// deadline, or shed for a full queue.
fn starved<T>(got: &Result<T, StoreError>) -> bool {
    match got {
        Err(StoreError::Timeout(_)) => true,
        Err(StoreError::Refused(refusal)) => refusal.code == ErrorCode::Overloaded,
        _ => false,
    }
}

impl EdgeReport {
    fn success_rate(&self) -> f64 {
        self.correct as f64 / self.calls.max(1) as f64
    }

    fn percentile(&mut self, p: f64) -> Duration {
        self.latencies.sort();
        let at = ((self.latencies.len() as f64 * p).ceil() as usize).saturating_sub(1);
        self.latencies.get(at).copied().unwrap_or_default()
    }
}

/// Runs `workers` loops of hit (Ok), commit (Ok), hit by another hook
/// (Duplicate) on fresh keys of `tenants` until `stop` is set.
async fn well_behaved(
    store: FleetStore,
    tenants: Vec<String>,
    stop: Arc<AtomicBool>,
) -> EdgeReport {
    let report = Arc::new(Mutex::new(EdgeReport::default()));
    let tasks = tenants.into_iter().enumerate().map(|(w, tenant)| {
        let store = store.clone();
        let stop = stop.clone();
        let report = report.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let key = format!("evt-{w}-{n}");
                let hook = format!("hook-{w}-{n}");
                let record =
                    |what: &str, started: Instant, ok: bool, starved: bool, got: String| {
                        let mut r = report.lock().unwrap();
                        r.calls += 1;
                        r.latencies.push(started.elapsed());
                        if ok {
                            r.correct += 1;
                        } else if r.failures.len() < 20 {
                            r.failures.push(format!("{what} {key}: {got}"));
                        }
                        if starved {
                            r.starved += 1;
                        }
                    };
                let t = Instant::now();
                let got = store.hit(hit(&tenant, &key, &hook), EDGE_DEADLINE).await;
                record(
                    "hit",
                    t,
                    got == Ok(HitOutcome::Ok),
                    starved(&got),
                    format!("{got:?}"),
                );
                if got != Ok(HitOutcome::Ok) {
                    continue;
                }
                let t = Instant::now();
                let got = store
                    .settle(
                        settle(&tenant, &key, &hook, Settlement::Commit),
                        EDGE_DEADLINE,
                    )
                    .await;
                record(
                    "commit",
                    t,
                    got == Ok(SettleOutcome::Ok),
                    starved(&got),
                    format!("{got:?}"),
                );
                let t = Instant::now();
                let got = store.hit(hit(&tenant, &key, "late"), EDGE_DEADLINE).await;
                let want = Ok(HitOutcome::Duplicate {
                    hook_id: hook.clone(),
                });
                record("re-hit", t, got == want, starved(&got), format!("{got:?}"));
            }
        })
    });
    for task in futures::future::join_all(tasks).await {
        task.expect("edge worker");
    }
    // Every worker has finished, so this is the last handle.
    let done = std::mem::take(&mut *report.lock().unwrap());
    done
}

/// Scrapes `ankusa_requests_refused_total{code="<code>"}`, 0 when absent.
async fn refused(node: &NodeProcess, code: &str) -> f64 {
    node.metric(&format!("ankusa_requests_refused_total{{code=\"{code}\"}}"))
        .await
        .unwrap_or(0.0)
}

/// Floods `node`'s busiest shard while a well-behaved edge works on it, then
/// checks the node, the edge and the counters. Returns the two reports.
async fn flood_while_serving(
    nats: &NatsServer,
    node: &mut NodeProcess,
    count: usize,
    over: Duration,
) -> (FloodReport, EdgeReport) {
    // The edge's tenants and the flood share shard 3.
    let shard = 3;
    let good = tenants_of_shard("good-", shard, 3);
    let flood_tenant = tenants_of_shard("flood-", shard, 1).remove(0);
    let corpus = Corpus::new(shard, flood_tenant);

    let store = connected_store(&nats.url()).await;
    let hostile = nats.connect().await.expect("hostile client connects");
    let stop = Arc::new(AtomicBool::new(false));
    let edge = tokio::spawn(well_behaved(store.clone(), good, stop.clone()));
    let flood_report = flood(&hostile, &corpus, count, over).await;
    stop.store(true, Ordering::Relaxed);
    let edge_report = edge.await.expect("edge task");

    assert!(
        node.process().is_running(),
        "the node died under the flood; log tail:\n{}",
        node.log_tail(40)
    );
    assert_eq!(node.http("/healthz").await.map(|r| r.0).ok(), Some(200));
    assert!(
        flood_report.wrong.is_empty(),
        "wrong answers to hostile messages ({}): {:#?}",
        flood_report.wrong.len(),
        &flood_report.wrong[..flood_report.wrong.len().min(20)]
    );
    assert_eq!(
        flood_report.replies, flood_report.with_reply,
        "every request with a reply subject gets exactly one answer: {flood_report:?}"
    );
    // And after all that, a fresh call still gets a correct answer.
    assert_eq!(
        store
            .hit(hit("after-the-flood", "k", "h"), EDGE_DEADLINE)
            .await,
        Ok(HitOutcome::Ok)
    );
    (flood_report, edge_report)
}

fn check_edge(edge: &mut EdgeReport, min_calls: usize) {
    let p50 = edge.percentile(0.50);
    let p99 = edge.percentile(0.99);
    let max = edge.percentile(1.0);
    eprintln!(
        "well-behaved edge: {} calls, {:.2}% correct, p50 {p50:?}, p99 {p99:?}, max {max:?}",
        edge.calls,
        100.0 * edge.success_rate()
    );
    assert!(
        edge.calls >= min_calls,
        "the edge made only {} calls during the flood",
        edge.calls
    );
    assert!(
        edge.success_rate() >= 0.99,
        "success rate {:.4} under the flood; failures: {:#?}",
        edge.success_rate(),
        edge.failures
    );
    // With a roomy deadline, no call of the edge may time out or be shed: the
    // flood, on the same shard, must not starve its neighbours.
    assert_eq!(
        edge.starved, 0,
        "edge calls timed out or were shed under the flood: {:#?}",
        edge.failures
    );
    // Latencies are printed above, not held to a speed target (a loaded
    // 2-vCPU host sets those). The bound here only catches an edge kept
    // waiting behind the flood for most of its deadline: answered, but late.
    assert!(
        p99 < EDGE_DEADLINE / 2,
        "p99 {p99:?} against a {EDGE_DEADLINE:?} deadline"
    );
}

// ---------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_node_survives_a_hostile_flood_and_counts_what_it_refused() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let mut node = start_node(NodeSpec::standalone("hostile", vec![nats.url()])).await;

    let (flood, mut edge) =
        flood_while_serving(&nats, &mut node, 20_000, Duration::from_secs(6)).await;
    eprintln!(
        "flood: {} sent in {:?} ({} with a reply subject, {} without), {} replies, codes {:?}, {}/{} batch items expired",
        flood.sent,
        flood.elapsed,
        flood.with_reply,
        flood.silent,
        flood.replies,
        flood.codes,
        flood.batch_items_expired,
        flood.batch_items
    );
    check_edge(&mut edge, 300);

    // Every refusal the flood provoked shows in the node's counters, at least as
    // often as we saw it (the edge's own traffic refuses nothing).
    for code in [
        "malformed",
        "unsupported_version",
        "too_large",
        "invalid",
        "deadline_expired",
        "wrong_shard",
    ] {
        let seen = flood.codes.get(code).copied().unwrap_or(0);
        assert!(
            seen > 0,
            "the flood provoked no `{code}`: {:?}",
            flood.codes
        );
        let counted = refused(&node, code).await;
        assert!(
            counted >= seen as f64,
            "`{code}`: {seen} refusals answered, {counted} counted"
        );
    }
    // Requests without a reply subject are dropped, each one counted.
    assert_eq!(
        refused(&node, "no_reply_subject").await,
        flood.silent as f64,
        "reply-less messages counted"
    );
    // Batch items are refused one by one for their budgets: at least those
    // sent with theirs already spent (more if 1 ms items ran out waiting
    // behind their batch-mates, which depends on the host's speed).
    assert!(flood.batch_items > 0, "no batch of 1 ms items was answered");
    assert!(
        flood.batch_items_expired >= flood.batch_items / SPENT_EVERY,
        "{} of {} batch items refused for their budgets, though every {SPENT_EVERY}th was sent spent",
        flood.batch_items_expired,
        flood.batch_items
    );
    // The flooded tenant could be read all along (every reply was checked
    // against what it had to be; these are the reads among them).
    assert!(
        flood.inspected > 0,
        "no read of the flooded tenant answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_node_survives_a_hostile_flood() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let mut node = start_node(NodeSpec::fleet("hostile-fleet", vec![nats.url()])).await;

    let (flood, mut edge) =
        flood_while_serving(&nats, &mut node, 6_000, Duration::from_secs(3)).await;
    eprintln!(
        "fleet flood: {} sent in {:?}, {} replies, codes {:?}",
        flood.sent, flood.elapsed, flood.replies, flood.codes
    );
    check_edge(&mut edge, 100);
    for code in [
        "malformed",
        "unsupported_version",
        "wrong_shard",
        "deadline_expired",
    ] {
        assert!(refused(&node, code).await > 0.0, "`{code}` not counted");
    }
    // Still the owner of every shard: the flood cost it no lease.
    assert!(node.is_ready().await, "{}", node.log_tail(30));
}

/// A NATS client that writes raw protocol frames: an attacker's client, which
/// sends header blocks as they are, where a library may clean them up first.
struct RawPublisher {
    stream: tokio::io::BufReader<tokio::net::TcpStream>,
    payload: Vec<u8>,
}

impl RawPublisher {
    async fn connect(port: u16) -> Self {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("raw connection to nats-server");
        let mut stream = tokio::io::BufReader::new(stream);
        let mut line = String::new();
        stream.read_line(&mut line).await.expect("server INFO");
        assert!(line.starts_with("INFO "), "expected INFO, got {line:?}");
        stream
            .get_mut()
            .write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n")
            .await
            .expect("CONNECT sent");
        let payload = Request::new(1_000, Op::Hit(roomy_hit("broken-headers"))).encode();
        Self { stream, payload }
    }

    /// Sends each header block in `blocks` to each of `subjects` as an
    /// `HPUB` (a hit with a reply subject), and waits for the server's
    /// `PONG`: it took every frame (no `-ERR`), so each went on.
    async fn send(&mut self, subjects: &[String], blocks: &[&[u8]]) {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let mut frames = Vec::new();
        for subject in subjects {
            for block in blocks {
                let sizes = format!("{} {}", block.len(), block.len() + self.payload.len());
                frames.extend_from_slice(
                    format!("HPUB {subject} _INBOX.hostile {sizes}\r\n").as_bytes(),
                );
                frames.extend_from_slice(block);
                frames.extend_from_slice(&self.payload);
                frames.extend_from_slice(b"\r\n");
            }
        }
        frames.extend_from_slice(b"PING\r\n");
        self.stream
            .get_mut()
            .write_all(&frames)
            .await
            .expect("frames sent");
        let mut line = String::new();
        loop {
            line.clear();
            let read =
                tokio::time::timeout(Duration::from_secs(5), self.stream.read_line(&mut line))
                    .await
                    .expect("server answers PING within 5 s")
                    .expect("read from nats-server");
            assert!(read > 0, "nats-server closed the raw connection");
            assert!(
                !line.starts_with("-ERR"),
                "nats-server refused a frame: {line:?}"
            );
            if line.starts_with("PONG") {
                break;
            }
        }
    }
}

/// Sends `blocks` to `subjects` over a fresh raw connection.
async fn publish_headers(port: u16, subjects: &[String], blocks: &[&[u8]]) {
    RawPublisher::connect(port)
        .await
        .send(subjects, blocks)
        .await;
}

/// Hits every shard of `store`, each answered from the fleet, once and then
/// again until `over` has passed.
async fn every_shard_answers(store: &FleetStore, node: &NodeProcess, label: &str, over: Duration) {
    let until = Instant::now() + over;
    let mut round = 0;
    loop {
        for shard in 0..SHARDS {
            let tenant = tenants_of_shard(&format!("{label}-{round}-"), shard, 1).remove(0);
            assert_eq!(
                store
                    .hit(hit(&tenant, "k", "h"), Duration::from_secs(1))
                    .await,
                Ok(HitOutcome::Ok),
                "{label}: shard {shard}, round {round}; node log:\n{}",
                node.log_tail(30)
            );
        }
        round += 1;
        if Instant::now() >= until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Headers are read by the node's NATS library before the node sees a
/// message. A `\r` in a header value panicked async-nats's connection task
/// before 0.52, which cut the node off NATS for good with one message; 0.52
/// reads it. Header blocks the library cannot parse at all (a line without a
/// colon, a bare `\n` in a value, a bad name, bytes that are not UTF-8) still
/// end its connection: the node reconnects and serves on, shards and process
/// kept. `docs/security.md` ("Hostile payloads") says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_the_nats_library_chokes_on_do_not_cut_a_node_off() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let node_id = "broken-headers";
    let mut node = start_node(NodeSpec::fleet(node_id, vec![nats.url()])).await;
    let store = connected_store(&nats.url()).await;
    every_shard_answers(&store, &node, "before", Duration::ZERO).await;
    let subjects = subjects();
    let targets: Vec<String> = (0..SHARDS)
        .map(|n| subjects.shard(n))
        .chain([subjects.node(node_id)])
        .collect();
    // Read from the node's connection when `/metrics` is scraped, so a
    // reconnect shows at once. Each read below follows calls that were
    // answered on the node's connection after the hostile frames had
    // reached it (the server had them before it answered the raw client's
    // PING): a block that cut the connection was read by then, and the
    // connection that answered is counted.
    let connects = || async { node.metric("ankusa_nats_connects_total").await };
    assert_eq!(connects().await, Some(1.0));

    // Carriage returns inside values: read, and the connection stays.
    let carriage_returns: [&[u8]; 3] = [
        b"NATS/1.0\r\nX-Hostile: a\rb\r\n\r\n",
        b"NATS/1.0\r\nX-Hostile: \r\r\n\r\n",
        b"NATS/1.0\r\nX-Hostile: a\r\rb\r\n\r\n",
    ];
    publish_headers(nats.port(), &targets, &carriage_returns).await;
    every_shard_answers(&store, &node, "after-cr", Duration::from_secs(2)).await;
    assert_eq!(
        connects().await,
        Some(1.0),
        "a `\\r` in a header value cost the node its connection; log:\n{}",
        node.log_tail(30)
    );

    // Blocks the library cannot parse: each set ends the connection once.
    let unreadable: [&[u8]; 5] = [
        b"NATS/1.0\r\nX-Hostile: a\nb\r\n\r\n",
        b"NATS/1.0\r\nno colon on this line\r\n\r\n",
        b"NATS/1.0\r\nBad Name: v\r\n\r\n",
        b"NATS/1.0\r\nX-Hostile: \xff\xfe\r\n\r\n",
        b"NATS/1.0 abc\r\n\r\n",
    ];
    let mut before = 1.0;
    for (i, block) in unreadable.iter().enumerate() {
        publish_headers(nats.port(), &targets, &[block]).await;
        // Edge calls sent while the node reconnects are lost; it is back
        // within a moment.
        let back = ankusa_tests::wait_until(Duration::from_secs(5), || async {
            store
                .hit(
                    hit(&format!("back-{i}"), "k", "h"),
                    Duration::from_millis(200),
                )
                .await
                .is_ok()
        })
        .await;
        assert!(
            back.is_ok(),
            "block {i}: no answer for 5 s; log:\n{}",
            node.log_tail(30)
        );
        every_shard_answers(&store, &node, &format!("after-{i}"), Duration::from_secs(1)).await;
        let after = connects().await.unwrap_or(0.0);
        eprintln!("block {i}: answered again after {back:?}, connects {before} -> {after}");
        assert!(
            after > before,
            "block {i} no longer ends the node's connection: async-nats reads it now; \
             update docs/security.md (\"Hostile payloads\")"
        );
        before = after;
    }
    assert!(node.process().is_running(), "{}", node.log_tail(30));
    assert!(node.is_ready().await, "{}", node.log_tail(30));
    assert_eq!(
        node.metric("ankusa_shards_owned").await,
        Some(f64::from(SHARDS)),
        "the node kept every shard"
    );
}

/// A header block the NATS library cannot read ends the node's connection;
/// sent just as the node renews its leases or heartbeats, it takes with it
/// the acks of the writes in flight. The node must keep its leases all the
/// same: a renewal or heartbeat gives up in time for the next round, which
/// takes over the lease at its own unacknowledged write. Waiting a lease TTL
/// for a lost ack let every lease of the node lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_in_the_middle_of_a_round_loses_no_lease() {
    const ROUNDS: usize = 10;
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let node_id = "renewing";
    let node = start_node(NodeSpec::fleet(node_id, vec![nats.url()])).await;
    let store = connected_store(&nats.url()).await;
    let watcher = nats.connect().await.expect("watcher connects");
    let mut attacker = RawPublisher::connect(nats.port()).await;
    let node_subject = [subjects().node(node_id)];
    let unreadable: &[u8] = b"NATS/1.0\r\nno colon on this line\r\n\r\n";

    for round in 0..ROUNDS {
        // Even rounds fire at a lease renewal, odd ones at a heartbeat.
        let (what, bucket) = if round % 2 == 0 {
            ("renewal", "leases")
        } else {
            ("heartbeat", "nodes")
        };
        let mut writes = watcher
            .subscribe(format!("$KV.ankusa_{INSTANCE}_{bucket}.>"))
            .await
            .expect("subscribed to the node's writes");
        ankusa_bus::server_caught_up(&watcher)
            .await
            .expect("subscribed");
        tokio::time::timeout(Duration::from_secs(5), writes.next())
            .await
            .expect("the node writes within 5 s")
            .expect("writes");
        attacker.send(&node_subject, &[unreadable]).await;
        eprintln!("round {round}: cut the node's connection at a {what}");
        drop(writes);
        // Long enough for the node to renew again before the next cut.
        tokio::time::sleep(Duration::from_millis(900)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let reconnects = node
        .metric("ankusa_nats_connects_total")
        .await
        .unwrap_or(0.0)
        - 1.0;
    let lost = node.metric("ankusa_leases_lost_total").await.unwrap_or(0.0);
    let adopted = node
        .metric("ankusa_leases_adopted_total")
        .await
        .unwrap_or(0.0);
    let failed = node
        .metric("ankusa_lease_renew_failures_total")
        .await
        .unwrap_or(0.0);
    eprintln!("{reconnects} reconnects: {failed} renewals failed, {adopted} leases taken over, {lost} lost");
    assert_eq!(
        reconnects, ROUNDS as f64,
        "each round cut the connection once"
    );
    assert_eq!(lost, 0.0, "leases lost; node log:\n{}", node.log_tail(40));
    assert_eq!(
        node.metric("ankusa_shards_owned").await,
        Some(f64::from(SHARDS))
    );
    every_shard_answers(&store, &node, "renewed", Duration::ZERO).await;
}

/// The same cut, at a lease take: a node taking the shards of a node that
/// died loses its connection, and the take's ack with it. The take gives up
/// in time for the next renewal of the leases the node already holds; waiting
/// a lease TTL for that ack let every one of them lapse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_at_a_lease_take_loses_no_held_lease() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let taker = start_node(NodeSpec::fleet("taker", vec![nats.url()])).await;
    let mut dying = start_node(NodeSpec::fleet("dying", vec![nats.url()])).await;
    let watcher = nats.connect().await.expect("watcher connects");
    let kv = ankusa_bus::kv::FleetKv::bind(watcher.clone(), INSTANCE)
        .await
        .expect("the instance's buckets");
    let split = ankusa_tests::wait_until(Duration::from_secs(20), || async {
        let holders = kv.lease_holders().await.unwrap_or_default();
        holders.len() == SHARDS as usize
            && holders.values().any(|n| n == "dying")
            && holders.values().any(|n| n == "taker")
    })
    .await;
    assert!(split.is_ok(), "the shards were never split between the two");
    let holders = kv.lease_holders().await.expect("lease holders");
    let orphaned: Vec<u32> = holders
        .iter()
        .filter(|(_, node)| *node == "dying")
        .map(|(shard, _)| *shard)
        .collect();
    let mut takes = futures::stream::select_all(
        futures::future::join_all(
            orphaned
                .iter()
                .map(|shard| watcher.subscribe(format!("$KV.ankusa_{INSTANCE}_leases.s.{shard}"))),
        )
        .await
        .into_iter()
        .map(|sub| sub.expect("subscribed")),
    );
    ankusa_bus::server_caught_up(&watcher)
        .await
        .expect("subscribed");
    let mut attacker = RawPublisher::connect(nats.port()).await;
    dying.kill().await.expect("kill -9");

    // The first write to an orphaned shard's lease is the taker's take.
    tokio::time::timeout(Duration::from_secs(10), takes.next())
        .await
        .expect("the taker takes an orphaned shard within 10 s")
        .expect("writes");
    let unreadable: &[u8] = b"NATS/1.0\r\nno colon on this line\r\n\r\n";
    attacker
        .send(&[subjects().node("taker")], &[unreadable])
        .await;
    let all_taken = ankusa_tests::wait_until(Duration::from_secs(15), || async {
        taker.metric("ankusa_shards_owned").await == Some(f64::from(SHARDS))
    })
    .await;
    let lost = taker.metric("ankusa_leases_lost_total").await;
    let reconnects = taker.metric("ankusa_nats_connects_total").await;
    assert_eq!(reconnects, Some(2.0), "the cut reconnected the taker once");
    assert_eq!(
        lost,
        Some(0.0),
        "the taker lost held leases; its log:\n{}",
        taker.log_tail(40)
    );
    assert!(all_taken.is_ok(), "{}", taker.log_tail(40));
}

/// What a node watches so that it never lingers with a dead NATS connection
/// (a connection task that panicked, say): a client that only lost its server
/// is left alone, however long it takes to reconnect; one whose task ended is
/// noticed within a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_ended_for_good_is_told_from_one_reconnecting() {
    let _serial = SERIAL.lock().await;
    let mut nats = NatsServer::start().await.expect("nats-server starts");
    let client = NatsOptions::with_servers([nats.url()])
        .connect()
        .await
        .expect("client");
    let watch = {
        let client = client.clone();
        tokio::spawn(async move { ankusa_bus::connection_ended(&client).await })
    };

    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(!watch.is_finished(), "ended while connected");
    nats.stop().await.expect("nats-server stops");
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    assert!(!watch.is_finished(), "ended while reconnecting");
    nats.start_again().await.expect("nats-server starts again");
    let connected = ankusa_tests::wait_until(Duration::from_secs(10), || async {
        client.connection_state() == async_nats::connection::State::Connected
    })
    .await;
    assert!(connected.is_ok(), "no reconnect within 10 s");
    assert!(!watch.is_finished(), "ended after the reconnect");

    client.drain().await.expect("drain");
    tokio::time::timeout(Duration::from_secs(5), watch)
        .await
        .expect("the end of the connection is noticed within 5 s")
        .expect("watch task");
}

/// Tenants and keys a subject-based design would choke on.
fn odd_names() -> Vec<(&'static str, &'static str)> {
    vec![
        ("a.b", "evt.with.dots"),
        ("*", "*"),
        (">", ">"),
        ("tenant with spaces", "key with spaces"),
        ("ünïcødé 日本 🦀", "ключ-🔑"),
        ("nul\0tenant", "nul\0key"),
        ("$KV.ankusa_test_state.>", "c.3.*"),
        ("\t\r\n", "\u{7f}\u{1}"),
        ("ankusa.test.shard.0", "_INBOX.x"),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_bytes_in_tenants_and_keys_work_in_fleet_mode_across_a_restart() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let spec = NodeSpec::fleet("odd-bytes", vec![nats.url()]);
    let mut node = start_node(spec.clone()).await;
    let store = connected_store(&nats.url()).await;
    let t = Duration::from_secs(1);

    for (tenant, key) in odd_names() {
        // Committed, pending and rate-limited state for each odd tenant.
        assert_eq!(
            store.hit(hit(tenant, key, "h1"), t).await,
            Ok(HitOutcome::Ok),
            "hit {tenant:?}/{key:?}"
        );
        assert_eq!(
            store
                .settle(settle(tenant, key, "h1", Settlement::Commit), t)
                .await,
            Ok(SettleOutcome::Ok),
            "commit {tenant:?}/{key:?}"
        );
        let pending_key = format!("{key}\0pending");
        assert_eq!(
            store.hit(hit(tenant, &pending_key, "p1"), t).await,
            Ok(HitOutcome::Ok)
        );
        // The same key under another odd tenant is another claim.
        let twin = format!("{tenant}.");
        assert_eq!(
            store.hit(hit(&twin, key, "twin"), t).await,
            Ok(HitOutcome::Ok),
            "the same key under tenant {twin:?} is free"
        );
        assert_eq!(
            store.hit(hit(tenant, key, "h2"), t).await,
            Ok(HitOutcome::Duplicate {
                hook_id: "h1".into()
            })
        );
    }

    // A graceful restart: the new process loads every shard back from KV.
    node.stop().await.expect("node stops");
    let node = start_node(spec).await;
    for (tenant, key) in odd_names() {
        // Until the new node holds the shard the edge may see no responders.
        let retry_until = Instant::now() + Duration::from_secs(10);
        let mut last = Err(StoreError::NoResponders);
        while Instant::now() < retry_until {
            last = store.hit(hit(tenant, key, "h3"), t).await;
            if last.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            last,
            Ok(HitOutcome::Duplicate {
                hook_id: "h1".into()
            }),
            "committed claim of {tenant:?}/{key:?} after the restart"
        );
        let pending_key = format!("{key}\0pending");
        assert!(
            matches!(
                store.hit(hit(tenant, &pending_key, "p2"), t).await,
                Ok(HitOutcome::Pending { .. })
            ),
            "pending claim of {tenant:?} after the restart"
        );
        // Settling the pending claim still works by its odd key.
        assert_eq!(
            store
                .settle(settle(tenant, &pending_key, "p1", Settlement::Release), t)
                .await,
            Ok(SettleOutcome::Ok)
        );
    }
    // Rate limits hold for odd tenants as well: a two-hook burst is spent.
    let tight = |tenant: &str, n: &str| HitRequest {
        charges: vec![ankusa_tests::requests::hooks(tenant, 2, 60_000)],
        claim: Some(claim(tenant, n, n)),
    };
    for (tenant, _) in odd_names() {
        // A tenant of its own, so the roomy hits above have not moved its bucket.
        let tenant = format!("{tenant}\0rate");
        assert_eq!(store.hit(tight(&tenant, "r1"), t).await, Ok(HitOutcome::Ok));
        assert_eq!(store.hit(tight(&tenant, "r2"), t).await, Ok(HitOutcome::Ok));
        assert!(matches!(
            store.hit(tight(&tenant, "r3"), t).await,
            Ok(HitOutcome::RateLimited { .. })
        ));
    }
    assert!(node.is_ready().await);
}

/// Anyone with write permission on the state bucket (or a bug) can store a
/// value no node can read. A load reads every message of the bucket whatever
/// its shard, so such a value used to fail every shard load of the fleet until
/// its TTL ran out; the load now skips it, says so and counts it, and serves
/// what the readable messages hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_state_message_is_skipped_and_the_shards_load_around_it() {
    let _serial = SERIAL.lock().await;
    let nats = NatsServer::start().await.expect("nats-server starts");
    let mut first = start_node(NodeSpec::fleet("unreadable-a", vec![nats.url()])).await;
    let store = connected_store(&nats.url()).await;
    let t = Duration::from_secs(1);
    let tenant = "survives-garbage";
    assert_eq!(
        store.hit(hit(tenant, "k", "h1"), t).await,
        Ok(HitOutcome::Ok)
    );
    assert_eq!(
        store
            .settle(settle(tenant, "k", "h1", Settlement::Commit), t)
            .await,
        Ok(SettleOutcome::Ok)
    );

    // A value that is not MessagePack, one nested far deeper than any record
    // (a change whose unknown field holds ~60 KiB of one-element arrays: a
    // decoder that recursed into it would run out of stack), and a legacy
    // per-claim key holding garbage.
    let mut nested = b"\x91\x81\xa1x".to_vec();
    nested.resize(60 * 1024, 0x91);
    nested.push(0xc0);
    let shard = shard_of(tenant, SHARDS);
    let unreadable: [(String, Vec<u8>); 3] = [
        ("m.intruder.1".into(), b"\xc1 garbage".to_vec()),
        ("m.intruder.2".into(), nested),
        (format!("c.{shard}.{:032x}", 7), b"\xc1".to_vec()),
    ];
    let js = async_nats::jetstream::new(nats.connect().await.expect("connect"));
    for (key, value) in &unreadable {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_TTL, "3600");
        js.publish_with_headers(
            format!("$KV.ankusa_{INSTANCE}_state.{key}"),
            headers,
            value.clone().into(),
        )
        .await
        .expect("publish")
        .await
        .expect("stored");
    }

    first.kill().await.expect("first node killed");
    let second = NodeProcess::start(NodeSpec::fleet("unreadable-b", vec![nats.url()]))
        .expect("second node starts");
    // The first node's heartbeat and leases lapse (2 s) before the second takes
    // its shards.
    second
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("the second node loads every shard despite the unreadable messages");
    assert_eq!(
        store.hit(hit(tenant, "k", "h2"), t).await,
        Ok(HitOutcome::Duplicate {
            hook_id: "h1".into()
        }),
        "the committed claim was replayed; log:\n{}",
        second.log_tail(30)
    );
    let skipped = second
        .metric("ankusa_state_unreadable_total")
        .await
        .unwrap_or(0.0);
    assert!(
        skipped >= unreadable.len() as f64,
        "ankusa_state_unreadable_total is {skipped}; log:\n{}",
        second.log_tail(30)
    );
    let log = second.log();
    for (key, _) in &unreadable {
        let said = log
            .lines()
            .find(|line| line.contains("ERROR") && line.contains(key.as_str()));
        match said {
            Some(line) => eprintln!("{line}"),
            None => panic!("no error names {key}; log:\n{}", second.log_tail(30)),
        }
    }
    eprintln!("skipped {skipped} unreadable messages; the committed claim answered Duplicate");
}
