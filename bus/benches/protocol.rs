//! The cost of the wire protocol on a node: decoding an edge's batch of hits
//! (or settles) as `ankusa bench` sends them, and encoding the batch's reply;
//! and what an unbatched call costs to encode: the edge's request, the node's
//! reply and the claim-log change it writes.
//!
//! Run: `cargo bench -p ankusa-bus --bench protocol`.

use std::hint::black_box;

use ankusa_actors::{
    Charge, Claim, ClaimChange, ClaimRecord, HitOutcome, HitRequest, Kind, SettleOutcome,
    SettleRequest, Settlement,
};
use ankusa_bus::claimlog::EncodedChange;
use ankusa_bus::protocol::{Op, Reply, ReplyBody, Request};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

/// Calls in a batch at the benchmark's peak (256 in flight, two nodes).
const BATCH: usize = 28;

fn claim(i: usize) -> Claim {
    Claim {
        tenant: format!("bench-{:04}", i * 37 % 1000),
        source_id: "bench".into(),
        key: format!("k-{:016x}", i * 7919),
        hook_id: format!("h-0000beef-{i}"),
        node: "bench-edge".into(),
        ttl_ms: 30_000,
        pending_ttl_ms: 5_000,
    }
}

fn hit(i: usize) -> Op {
    let claim = claim(i);
    let charge = |kind, increment_us| Charge {
        kind,
        tenant: claim.tenant.clone(),
        increment_us,
        capacity_us: 1_000_000,
    };
    Op::Hit(HitRequest {
        charges: vec![charge(Kind::Hooks, 10), charge(Kind::Bytes, 2_048)],
        claim: Some(claim),
    })
}

fn settle(i: usize) -> Op {
    Op::Settle(SettleRequest {
        claim: claim(i),
        settlement: Settlement::Commit,
    })
}

fn batch(op: fn(usize) -> Op) -> Vec<u8> {
    let ops: Vec<Op> = (0..BATCH).map(op).collect();
    Request::encode_batch(250, ops.iter().map(|op| (250, op)))
}

fn protocol(c: &mut Criterion) {
    let mut group = c.benchmark_group("protocol");
    group.throughput(Throughput::Elements(BATCH as u64));
    for (name, payload) in [("hits", batch(hit)), ("settles", batch(settle))] {
        group.bench_function(format!("decode_batch_of_{BATCH}_{name}"), |b| {
            b.iter(|| black_box(Request::decode(black_box(&payload))))
        });
    }
    let reply = Reply::new(ReplyBody::Batch(
        (0..BATCH)
            .map(|_| Reply::new(ReplyBody::Hit(HitOutcome::Ok)))
            .collect(),
    ));
    group.bench_function(format!("encode_reply_of_{BATCH}"), |b| {
        b.iter(|| black_box(black_box(&reply).encode()))
    });
    // What an edge reads back at the peak: hits' and settles' answers mixed.
    let mixed = Reply::new(ReplyBody::Batch(
        (0..BATCH)
            .map(|i| match i % 2 {
                0 => Reply::new(ReplyBody::Hit(HitOutcome::Ok)),
                _ => Reply::new(ReplyBody::Settle(SettleOutcome::Ok)),
            })
            .collect(),
    ))
    .encode();
    group.bench_function(format!("decode_reply_of_{BATCH}"), |b| {
        b.iter(|| black_box(Reply::decode(black_box(&mixed))))
    });
    group.finish();

    let mut lone = c.benchmark_group("lone");
    let one_hit = hit(1);
    lone.bench_function("encode_hit", |b| {
        b.iter(|| black_box(Request::encode_op(250, black_box(&one_hit))))
    });
    let ok = Reply::new(ReplyBody::Hit(HitOutcome::Ok));
    lone.bench_function("encode_reply", |b| {
        b.iter(|| black_box(black_box(&ok).encode()))
    });
    let Op::Hit(HitRequest {
        claim: Some(claimed),
        ..
    }) = &one_hit
    else {
        unreachable!("hit() always claims")
    };
    let change = ClaimChange::Put(ClaimRecord::new(
        &claimed.source_id,
        &claimed.key,
        &claimed.hook_id,
        Some(&claimed.node),
        false,
        1_700_000_000_000_000,
    ));
    lone.bench_function("encode_claim_change", |b| {
        b.iter(|| black_box(EncodedChange::claim(3, &claimed.tenant, black_box(&change))))
    });
    lone.finish();
}

criterion_group!(benches, protocol);
criterion_main!(benches);
