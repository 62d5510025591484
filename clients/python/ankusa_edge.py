"""ankusa_edge: a Python edge client of an ankusa-fleet store.

An edge asks the fleet, over NATS request-reply with MessagePack payloads,
whether a webhook may pass: a *hit* charges the tenant's rate-limit buckets and
claims the provider's event key (dedupe), a *settle* commits or releases that
claim once the hook's fate is known, and a *reset* forgets a tenant's buckets.
An *inspect* reads a tenant's state for an operator, changing nothing.

The specification is ``docs/protocol.md`` (wire protocol, version 1) in the
ankusa-fleet repository; this module is written from it alone, section numbers
(§) below refer to it, and ``tests/tests/python_edge.rs`` keeps the two in
agreement (test vectors, shard function, and a live fleet).

What it implements:

- ``shard_of``: the shard function (§2).
- Dataclasses for the request records (``Charge``, ``Claim``, ``Hit``,
  ``Settle``, ``Reset``, ``Inspect`` with its ``EventKey``) and
  ``encode_request``, which writes the map form by default and the compact
  form on request (§3, §5); ``EdgeClient`` sends the map form unless built
  with ``compact=True``.
- ``decode_reply``: replies (§6) to dataclasses (``HitOk``, ``Duplicate``,
  ``Pending``, ``RateLimited``, ``SettleOk``, ``NotFound``, ``NotOwner``,
  ``AlreadyCommitted``, ``ResetDone``, ``TenantView``, ``ErrorReply``),
  ignoring unknown keys.
- ``StoreError`` and its subclasses: every way a call can fail, grouped as §9
  groups them: ``RequestError`` (the request is at fault: report it, do not
  resend or degrade) and ``FleetError`` (the fleet could not answer: degrade).
- ``EdgeClient``: ``hit``, ``settle``, ``reset`` and ``inspect`` over a connected nats-py
  client, each within a hard budget, resending on NATS "no responders" as §9
  says; hits and settles made while others are in flight to the same node
  leave together as one ``batch`` message (§5.5), and ``batch`` sends many at
  once: one message per node whose shards it has learned from their
  replies, or per shard whose node is not known yet.
- ``DegradingEdge``: the local degrade of §9 over an ``EdgeClient``: on an
  outage a hit is answered from this process's ``LocalStore`` (the same
  rules, this process's buckets and claims), a ``CircuitBreaker`` stops
  trying a fleet that keeps failing, and each ``Answer`` says who gave it.

Run as a program, it checks itself against the spec (``vectors``), prints
shards (``shard``), runs a scripted sequence against a live fleet
(``scenario``), replays timed requests on a ``LocalStore``
(``local-replay``, which the Rust tests compare with the node's rules) and
checks its breaker and local store on fake clocks (``self-test``); see
``--help``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import re
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import msgpack
import nats.errors

__all__ = [
    "BYTES",
    "COMMIT",
    "HOOKS",
    "MAX_BATCH",
    "MAX_REQUEST_BYTES",
    "MAX_SHARDS",
    "PROTOCOL_VERSION",
    "RELEASE",
    "AlreadyCommitted",
    "Answer",
    "Batch",
    "Charge",
    "CircuitBreaker",
    "Claim",
    "DegradingEdge",
    "Disconnected",
    "Duplicate",
    "EdgeClient",
    "ErrorReply",
    "EventKey",
    "FleetError",
    "FleetRefused",
    "Hit",
    "HitOk",
    "Inspect",
    "InvalidRequest",
    "LocalStore",
    "MalformedRequest",
    "NoResponders",
    "NotFound",
    "NotOwner",
    "Pending",
    "Permit",
    "RateLimited",
    "Reply",
    "RequestError",
    "RequestTooLarge",
    "Reset",
    "ResetDone",
    "Settle",
    "SettleOk",
    "StoreError",
    "TenantView",
    "Timeout",
    "UndecodableReply",
    "UnsupportedVersion",
    "WrongShard",
    "decode_reply",
    "encode_request",
    "fnv1a_32",
    "shard_of",
    "validate",
]

PROTOCOL_VERSION = 1
"""The one protocol version this client speaks (§4)."""
MAX_REQUEST_BYTES = 65_536
"""Largest request payload a node takes (§8)."""
MAX_BATCH = 256
"""Most items in one batch (§5.5)."""
MAX_SHARDS = 4096
"""Most shards an instance may have (§1)."""

# Bucket kinds (§5.2) and settlements (§5.3): names travel as strings.
HOOKS = "hooks"
BYTES = "bytes"
COMMIT = "commit"
RELEASE = "release"

_U64_MAX = 2**64 - 1
# §8: string limits in UTF-8 bytes, numeric maxima.
_MAX_TENANT = 256
_MAX_SOURCE_ID = 256
_MAX_KEY = 1024
_MAX_HOOK_ID = 256
_MAX_NODE = 256
_MAX_CHARGES = 2
_MAX_CAPACITY_US = 31_536_000_000_000
_MAX_TTL_MS = 7_776_000_000
_MAX_PENDING_TTL_MS = 3_600_000
_INSTANCE = re.compile(r"[a-z0-9_-]{1,64}")
# A node_id as nodes take it: a subject token of its own (§1).
_NODE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

# §9: after "no responders", resend after a pause doubling from 2 ms to 50 ms;
# a resend keeps this much of the budget for its own round trip.
_FIRST_PAUSE_S = 0.002
_MAX_PAUSE_S = 0.050
_RETRY_ROUND_TRIP_S = 0.010
# A timer fires at or after its instant (the loop's waits are whole
# milliseconds, rounded up) and the woken task needs a moment more: a call's
# alarm is set this much early, at most a fifth of its budget, so that its
# caller resumes by the deadline rather than just after it, as the Rust
# edge's calls do.
_EARLY_S = 0.002

_log = logging.getLogger("ankusa_edge")


# ---------------------------------------------------------------------------
# §2 The shard function
# ---------------------------------------------------------------------------


def fnv1a_32(data: bytes) -> int:
    """The 32-bit FNV-1a hash of ``data``."""
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def shard_of(tenant: str, shards: int) -> int:
    """The shard of ``tenant`` among ``shards``: FNV-1a 32 of its UTF-8 bytes, mod S."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be 1 to {MAX_SHARDS}, not {shards!r}")
    return fnv1a_32(tenant.encode("utf-8")) % shards


# ---------------------------------------------------------------------------
# §5 Requests
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Charge:
    """One bucket to charge (§5.2): GCRA ``increment_us`` against ``capacity_us``."""

    kind: str  # HOOKS or BYTES
    tenant: str
    increment_us: int
    capacity_us: int


@dataclass(frozen=True)
class Claim:
    """A provider event key claimed by ``hook_id`` on edge node ``node`` (§5.2)."""

    tenant: str
    source_id: str
    key: str
    hook_id: str
    node: str
    ttl_ms: int
    pending_ttl_ms: int


@dataclass(frozen=True)
class Hit:
    """Charge 0 to 2 buckets and claim a key, all or nothing (§5.2)."""

    charges: Sequence[Charge] = ()
    claim: Claim | None = None

    @property
    def tenant(self) -> str:
        """The tenant the hit is routed by: the claim's, else the first charge's."""
        if self.claim is not None:
            return self.claim.tenant
        return self.charges[0].tenant if self.charges else ""


@dataclass(frozen=True)
class Settle:
    """Commit or release a claim (§5.3)."""

    claim: Claim
    settlement: str  # COMMIT or RELEASE

    @property
    def tenant(self) -> str:
        return self.claim.tenant


@dataclass(frozen=True)
class Reset:
    """Forget a tenant's buckets (§5.4)."""

    tenant: str


@dataclass(frozen=True)
class EventKey:
    """A provider event key as a claim names it: ``key`` within ``source_id`` (§5.6)."""

    source_id: str
    key: str


@dataclass(frozen=True)
class Inspect:
    """Read a tenant's state and, with ``claim``, the claim on that key (§5.6)."""

    tenant: str
    claim: EventKey | None = None


Op = Hit | Settle | Reset | Inspect


@dataclass(frozen=True)
class Batch:
    """Several requests for one shard's tenants, each with its own budget
    (§5.5): ``items`` are ``(op, timeout_ms)`` pairs, at most ``MAX_BATCH``."""

    items: Sequence[tuple[Op, int]]


def _charge_record(c: Charge, compact: bool) -> Any:
    if compact:
        return [c.kind, c.tenant, c.increment_us, c.capacity_us]
    return {
        "kind": c.kind,
        "tenant": c.tenant,
        "increment_us": c.increment_us,
        "capacity_us": c.capacity_us,
    }


def _claim_record(c: Claim | None, compact: bool) -> Any:
    if c is None:
        return None
    if compact:
        return [c.tenant, c.source_id, c.key, c.hook_id, c.node, c.ttl_ms, c.pending_ttl_ms]
    return {
        "tenant": c.tenant,
        "source_id": c.source_id,
        "key": c.key,
        "hook_id": c.hook_id,
        "node": c.node,
        "ttl_ms": c.ttl_ms,
        "pending_ttl_ms": c.pending_ttl_ms,
    }


def _op_record(op: Op, compact: bool) -> dict:
    if isinstance(op, Hit):
        charges = [_charge_record(c, compact) for c in op.charges]
        claim = _claim_record(op.claim, compact)
        return {"hit": [charges, claim] if compact else {"charges": charges, "claim": claim}}
    if isinstance(op, Settle):
        claim = _claim_record(op.claim, compact)
        return {
            "settle": [claim, op.settlement]
            if compact
            else {"claim": claim, "settlement": op.settlement}
        }
    if isinstance(op, Reset):
        return {"reset": [op.tenant] if compact else {"tenant": op.tenant}}
    if isinstance(op, Inspect):
        event = op.claim
        if event is None:
            key = None
        elif compact:
            key = [event.source_id, event.key]
        else:
            key = {"source_id": event.source_id, "key": event.key}
        return {"inspect": [op.tenant, key] if compact else {"tenant": op.tenant, "claim": key}}
    raise TypeError(f"not a request operation: {op!r}")


def _request_record(op: Op | Batch, timeout_ms: int, compact: bool) -> Any:
    if isinstance(op, Batch):
        ops: dict = {"batch": [_request_record(o, t, compact) for o, t in op.items]}
    else:
        ops = _op_record(op, compact)
    if compact:
        return [PROTOCOL_VERSION, timeout_ms, ops]
    return {"v": PROTOCOL_VERSION, "timeout_ms": timeout_ms, "op": ops}


def encode_request(op: Op | Batch, timeout_ms: int, *, compact: bool = False) -> bytes:
    """The request frame for ``op`` with budget ``timeout_ms`` (§3, §5.1).

    The map form (keys in the order of the spec's tables) unless ``compact``,
    which writes every record as an array of its fields. Integers take their
    shortest MessagePack form, strings are ``str``. Raises ``MalformedRequest``
    for a value the wire cannot carry (see ``_check_shape``).
    """
    _check_u64("timeout_ms", timeout_ms)
    if isinstance(op, Batch):
        if not isinstance(op.items, (list, tuple)) or len(op.items) > MAX_BATCH:
            raise MalformedRequest(f"a batch is a list of at most {MAX_BATCH} (op, timeout_ms)")
        for item in op.items:
            if not isinstance(item, tuple) or len(item) != 2 or isinstance(item[0], Batch):
                raise MalformedRequest("a batch item is an (op, timeout_ms) pair, not a batch")
            _check_shape(item[0])
            _check_u64("timeout_ms", item[1])
    else:
        _check_shape(op)
    return _pack(op, timeout_ms, compact)


def _pack(op: Op | Batch, timeout_ms: int, compact: bool) -> bytes:
    """``encode_request`` without its checks, for requests already checked."""
    return msgpack.packb(_request_record(op, timeout_ms, compact), use_bin_type=True)


def _check_u64(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise MalformedRequest(f"`{field}` must be an integer from 0 to 2^64-1, not {value!r}")


def _check_str(field: str, value: Any) -> bytes:
    if not isinstance(value, str):
        raise MalformedRequest(f"`{field}` must be a str, not {type(value).__name__}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedRequest(f"`{field}` is not encodable as UTF-8") from None


def _check_claim_shape(claim: Any) -> None:
    if not isinstance(claim, Claim):
        raise MalformedRequest(f"a claim must be a Claim, not {type(claim).__name__}")
    for field in ("tenant", "source_id", "key", "hook_id", "node"):
        _check_str(field, getattr(claim, field))
    _check_u64("ttl_ms", claim.ttl_ms)
    _check_u64("pending_ttl_ms", claim.pending_ttl_ms)


def _check_shape(op: Op) -> None:
    """What a node would answer ``malformed``: wrong types, negative numbers,
    unknown names. Checked before sending, whatever the client's settings."""
    if isinstance(op, Hit):
        if not isinstance(op.charges, (list, tuple)):
            raise MalformedRequest("`charges` must be a list of Charge")
        for c in op.charges:
            if not isinstance(c, Charge):
                raise MalformedRequest(f"a charge must be a Charge, not {type(c).__name__}")
            if c.kind not in (HOOKS, BYTES):
                raise MalformedRequest(f"`kind` must be {HOOKS!r} or {BYTES!r}, not {c.kind!r}")
            _check_str("tenant", c.tenant)
            _check_u64("increment_us", c.increment_us)
            _check_u64("capacity_us", c.capacity_us)
        if op.claim is not None:
            _check_claim_shape(op.claim)
    elif isinstance(op, Settle):
        _check_claim_shape(op.claim)
        if op.settlement not in (COMMIT, RELEASE):
            raise MalformedRequest(
                f"`settlement` must be {COMMIT!r} or {RELEASE!r}, not {op.settlement!r}"
            )
    elif isinstance(op, Reset):
        _check_str("tenant", op.tenant)
    elif isinstance(op, Inspect):
        _check_str("tenant", op.tenant)
        if op.claim is not None:
            if not isinstance(op.claim, EventKey):
                raise MalformedRequest(
                    f"an inspected key must be an EventKey, not {type(op.claim).__name__}"
                )
            _check_str("source_id", op.claim.source_id)
            _check_str("key", op.claim.key)
    else:
        raise TypeError(f"not a request operation: {op!r}")


# §8 rules, in the order a node checks them, so that the reason reported is the
# one the node would report.


def _text_rule(field: str, value: str, limit: int) -> dict | None:
    # Limits are in UTF-8 bytes; an ASCII string has one a character.
    n = len(value) if value.isascii() else len(value.encode("utf-8"))
    if n == 0:
        return {"reason": "empty", "field": field}
    if n > limit:
        return {"reason": "too_long", "field": field, "len": n, "max": limit}
    return None


def _range_rule(field: str, value: int, limit: int) -> dict | None:
    if value == 0:
        return {"reason": "zero", "field": field}
    if value > limit:
        return {"reason": "out_of_range", "field": field, "value": value, "max": limit}
    return None


def _first(rule: Callable, *fields: tuple) -> dict | None:
    """The reason of the first ``(field, value, limit)`` that breaks ``rule``."""
    for field, value, limit in fields:
        reason = rule(field, value, limit)
        if reason is not None:
            return reason
    return None


def _charge_rules(c: Charge) -> dict | None:
    # The spec gives increment_us the range 1 to capacity_us; a node reports a
    # value over a year as out_of_range against that year, and anything else
    # over the capacity as increment_exceeds_capacity. Reasons are non-empty
    # dicts, so `or` takes the first.
    return (
        _text_rule("tenant", c.tenant, _MAX_TENANT)
        or _first(
            _range_rule,
            ("capacity_us", c.capacity_us, _MAX_CAPACITY_US),
            ("increment_us", c.increment_us, _MAX_CAPACITY_US),
        )
        or (
            {
                "reason": "increment_exceeds_capacity",
                "increment_us": c.increment_us,
                "capacity_us": c.capacity_us,
            }
            if c.increment_us > c.capacity_us
            else None
        )
    )


def _claim_rules(c: Claim) -> dict | None:
    return _first(
        _text_rule,
        ("tenant", c.tenant, _MAX_TENANT),
        ("source_id", c.source_id, _MAX_SOURCE_ID),
        ("key", c.key, _MAX_KEY),
        ("hook_id", c.hook_id, _MAX_HOOK_ID),
        ("node", c.node, _MAX_NODE),
    ) or _first(
        _range_rule,
        ("ttl_ms", c.ttl_ms, _MAX_TTL_MS),
        ("pending_ttl_ms", c.pending_ttl_ms, _MAX_PENDING_TTL_MS),
    )


def _hit_rules(h: Hit) -> dict | None:
    if not h.charges and h.claim is None:
        return {"reason": "nothing_to_do"}
    if len(h.charges) > _MAX_CHARGES:
        return {"reason": "too_many_charges", "count": len(h.charges), "max": _MAX_CHARGES}
    seen = set()
    for c in h.charges:
        reason = _charge_rules(c)
        if reason is not None:
            return reason
        if c.kind in seen:
            return {"reason": "duplicate_bucket", "kind": c.kind}
        seen.add(c.kind)
    if h.claim is not None:
        reason = _claim_rules(h.claim)
        if reason is not None:
            return reason
    if any(c.tenant != h.tenant for c in h.charges):
        return {"reason": "mixed_tenants"}
    return None


def validate(op: Op) -> None:
    """Raises ``InvalidRequest`` with the reason a node would give (§6.4, §8),
    or ``MalformedRequest`` for a value the wire cannot carry."""
    _check_shape(op)
    if isinstance(op, Hit):
        reason = _hit_rules(op)
    elif isinstance(op, Settle):
        reason = _claim_rules(op.claim)
    elif isinstance(op, Inspect) and op.claim is not None:
        event = op.claim
        reason = _first(
            _text_rule,
            ("tenant", op.tenant, _MAX_TENANT),
            ("source_id", event.source_id, _MAX_SOURCE_ID),
            ("key", event.key, _MAX_KEY),
        )
    else:
        reason = _text_rule("tenant", op.tenant, _MAX_TENANT)
    if reason is not None:
        raise InvalidRequest(_describe(reason), invalid=reason)


def _describe(reason: dict) -> str:
    """A sentence for people about an invalid reason (never parsed)."""
    r = reason["reason"]
    templates = {
        "empty": "field `{field}` is empty",
        "too_long": "field `{field}` is {len} bytes, over the limit of {max}",
        "nothing_to_do": "a hit needs at least one charge or a claim",
        "too_many_charges": "{count} charges, over the limit of {max}",
        "duplicate_bucket": "bucket `{kind}` is charged twice in one hit",
        "mixed_tenants": "every charge and the claim must name the same tenant",
        "zero": "`{field}` must be at least 1",
        "increment_exceeds_capacity": "increment {increment_us} µs exceeds capacity {capacity_us} µs",
        "out_of_range": "`{field}` is {value}, over the limit of {max}",
    }
    return templates[r].format(**reason)


# ---------------------------------------------------------------------------
# §6 Replies
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HitOk:
    """Every charge taken; the claim, if any, is now this hook's, pending (§6.2).
    Settle it: commit once the hook is durable, release if storing failed."""

    result: ClassVar[str] = "ok"


@dataclass(frozen=True)
class Duplicate:
    """The key is committed by ``hook_id``: the hook was already stored."""

    hook_id: str
    result: ClassVar[str] = "duplicate"


@dataclass(frozen=True)
class Pending:
    """Another hook holds the key and is in flight: tell the sender to retry
    after ``retry_after_ms``; never a success (§9)."""

    retry_after_ms: int
    result: ClassVar[str] = "pending"


@dataclass(frozen=True)
class RateLimited:
    """A charge was denied; nothing was charged or claimed."""

    retry_after_ms: int
    result: ClassVar[str] = "rate_limited"


@dataclass(frozen=True)
class SettleOk:
    """The claim was committed or released (or committed again) (§6.3)."""

    result: ClassVar[str] = "ok"


@dataclass(frozen=True)
class NotFound:
    """No live claim on the key: never made, released, or expired."""

    result: ClassVar[str] = "not_found"


@dataclass(frozen=True)
class NotOwner:
    """Another hook, ``hook_id``, holds the key; nothing changed."""

    hook_id: str
    result: ClassVar[str] = "not_owner"


@dataclass(frozen=True)
class AlreadyCommitted:
    """A release of a claim that is already committed; nothing changed."""

    result: ClassVar[str] = "already_committed"


@dataclass(frozen=True)
class ResetDone:
    """The tenant's buckets are forgotten (the bare ``"reset"`` body)."""

    result: ClassVar[str] = "reset"


@dataclass(frozen=True)
class BucketView:
    """A bucket that is not full: its TAT is ``ahead_us`` past the node's now,
    so a charge passes while ``ahead_us + increment_us <= capacity_us`` (§6.5)."""

    kind: str  # HOOKS or BYTES
    ahead_us: int


@dataclass(frozen=True)
class ClaimView:
    """The live claim on an inspected key: ``state`` is ``"pending"`` (``node``
    holds it in flight) or ``"committed"``; it expires in ``expires_in_ms`` (§6.5)."""

    state: str
    hook_id: str
    expires_in_ms: int
    node: str | None = None


@dataclass(frozen=True)
class TenantView:
    """What a node holds for a tenant (the ``inspect`` body, §6.5): its buckets
    that are not full, the claims it holds, and the claim on the key asked about."""

    buckets: tuple
    claims_held: int
    claim: ClaimView | None = None
    result: ClassVar[str] = "inspect"


@dataclass(frozen=True)
class ErrorReply:
    """A request the node did not carry out; nothing was changed, except
    after ``unavailable``, whose request may have taken effect (§6.4)."""

    code: str
    message: str
    invalid: dict | None = None
    supported_versions: list | None = None


HitOutcome = HitOk | Duplicate | Pending | RateLimited
SettleOutcome = SettleOk | NotFound | NotOwner | AlreadyCommitted


@dataclass(frozen=True)
class Reply:
    """A reply record: its ``body`` is an outcome, ``ResetDone``, an
    ``ErrorReply`` or (for a batch) a list of ``Reply``; ``node`` is the node
    that answered, when it says."""

    body: Any
    node: str | None = None
    v: int = PROTOCOL_VERSION


def outcome_view(outcome: Any) -> Any:
    """An outcome in its wire shape: ``{"result": ..., <fields>}``."""
    if isinstance(outcome, ResetDone):
        return "reset"
    if isinstance(outcome, TenantView):
        return _tenant_view_record(outcome)
    view = {"result": outcome.result}
    view.update(outcome.__dict__)
    return view


def reply_view(reply: Reply) -> dict:
    """A decoded reply back in the wire's shape, as §10 shows it in JSON."""
    body = reply.body
    if isinstance(body, ResetDone):
        body_view: Any = "reset"
    elif isinstance(body, list):
        body_view = {"batch": [reply_view(r) for r in body]}
    elif isinstance(body, TenantView):
        body_view = {"inspect": _tenant_view_record(body)}
    elif isinstance(body, ErrorReply):
        error = {"code": body.code, "message": body.message}
        if body.invalid is not None:
            error["invalid"] = body.invalid
        if body.supported_versions is not None:
            error["supported_versions"] = body.supported_versions
        body_view = {"error": error}
    else:
        name = "hit" if isinstance(body, (HitOk, Duplicate, Pending, RateLimited)) else "settle"
        body_view = {name: outcome_view(body)}
    view = {"v": reply.v, "body": body_view}
    if reply.node is not None:
        view["node"] = reply.node
    return view


def _tenant_view_record(view: TenantView) -> dict:
    claim = None
    if view.claim is not None:
        c = view.claim
        claim = {"state": c.state, "hook_id": c.hook_id}
        if c.node is not None:
            claim["node"] = c.node
        claim["expires_in_ms"] = c.expires_in_ms
    return {
        "buckets": [{"kind": b.kind, "ahead_us": b.ahead_us} for b in view.buckets],
        "claims_held": view.claims_held,
        "claim": claim,
    }


def _typed(value: Any, kind: str, what: str) -> Any:
    ok = {
        "str": isinstance(value, str),
        "u64": isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U64_MAX,
        "map": isinstance(value, dict),
        "array": isinstance(value, list),
    }[kind]
    if not ok:
        raise UndecodableReply(f"{what} is {value!r}, not a {kind}")
    return value


def _field(record: dict, key: str, kind: str, optional: bool = False) -> Any:
    """``record[key]`` checked to be of ``kind``; absent or nil is None when
    ``optional``."""
    value = record.get(key)
    if value is None and optional:
        return None
    return _typed(value, kind, f"`{key}`")


def _hit_outcome(rec: Any) -> HitOutcome:
    if not isinstance(rec, dict):
        raise UndecodableReply("a hit outcome is not a map")
    result = _field(rec, "result", "str")
    if result == "ok":
        return HitOk()
    if result == "duplicate":
        return Duplicate(_field(rec, "hook_id", "str"))
    if result == "pending":
        return Pending(_field(rec, "retry_after_ms", "u64"))
    if result == "rate_limited":
        return RateLimited(_field(rec, "retry_after_ms", "u64"))
    raise UndecodableReply(f"unknown hit result {result!r}")


def _settle_outcome(rec: Any) -> SettleOutcome:
    if not isinstance(rec, dict):
        raise UndecodableReply("a settle outcome is not a map")
    result = _field(rec, "result", "str")
    if result == "ok":
        return SettleOk()
    if result == "not_found":
        return NotFound()
    if result == "not_owner":
        return NotOwner(_field(rec, "hook_id", "str"))
    if result == "already_committed":
        return AlreadyCommitted()
    raise UndecodableReply(f"unknown settle result {result!r}")


def _tenant_view(rec: Any) -> TenantView:
    if not isinstance(rec, dict):
        raise UndecodableReply("a tenant view is not a map")
    buckets = []
    for b in _field(rec, "buckets", "array"):
        if not isinstance(b, dict):
            raise UndecodableReply("a bucket view is not a map")
        buckets.append(BucketView(_field(b, "kind", "str"), _field(b, "ahead_us", "u64")))
    claim = _field(rec, "claim", "map", optional=True)
    if claim is not None:
        state = _field(claim, "state", "str")
        if state not in ("pending", "committed"):
            raise UndecodableReply(f"unknown claim state {state!r}")
        claim = ClaimView(
            state=state,
            hook_id=_field(claim, "hook_id", "str"),
            expires_in_ms=_field(claim, "expires_in_ms", "u64"),
            node=_field(claim, "node", "str", optional=state == "committed"),
        )
    return TenantView(tuple(buckets), _field(rec, "claims_held", "u64"), claim)


def _error_reply(rec: Any) -> ErrorReply:
    if not isinstance(rec, dict):
        raise UndecodableReply("an error is not a map")
    invalid = _field(rec, "invalid", "map", optional=True)
    if invalid is not None and not isinstance(invalid.get("reason"), str):
        raise UndecodableReply("an invalid reason without a `reason`")
    versions = _field(rec, "supported_versions", "array", optional=True)
    if versions is not None:
        versions = [_typed(x, "u64", "a supported version") for x in versions]
    message = rec.get("message")
    return ErrorReply(
        code=_field(rec, "code", "str"),
        # A message is for people only; an error without one still counts.
        message=message if isinstance(message, str) else "",
        invalid=invalid,
        supported_versions=versions,
    )


def _reply(value: Any) -> Reply:
    if not isinstance(value, dict):
        raise UndecodableReply("a reply is not a map")
    v = _field(value, "v", "u64")
    if v != PROTOCOL_VERSION:
        # §4: a reply of a version the edge does not speak is like no reply.
        raise UndecodableReply(f"a reply of version {v}, this client speaks {PROTOCOL_VERSION}")
    body = value.get("body")
    if body == "reset":
        parsed: Any = ResetDone()
    elif isinstance(body, dict) and len(body) == 1:
        ((name, rec),) = body.items()
        if name == "hit":
            parsed = _hit_outcome(rec)
        elif name == "settle":
            parsed = _settle_outcome(rec)
        elif name == "error":
            parsed = _error_reply(rec)
        elif name == "inspect":
            parsed = _tenant_view(rec)
        elif name == "batch":
            if not isinstance(rec, list):
                raise UndecodableReply("a batch reply is not an array")
            parsed = [_reply(item) for item in rec]
        else:
            raise UndecodableReply(f"unknown reply body {name!r}")
    else:
        raise UndecodableReply(f"a reply body is {body!r}")
    return Reply(body=parsed, node=_field(value, "node", "str", optional=True), v=v)


def decode_reply(payload: bytes) -> Reply:
    """Reads a reply frame (§6). Keys it does not know are ignored; anything
    else it cannot read raises ``UndecodableReply``."""
    try:
        value = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:  # what msgpack raises for a bad frame
        raise UndecodableReply(f"not one MessagePack value ({type(e).__name__}: {e})") from None
    return _reply(value)


# ---------------------------------------------------------------------------
# Errors, grouped as §9 groups them
# ---------------------------------------------------------------------------


class StoreError(Exception):
    """A call that got no outcome. ``code`` is the error reply's code (or what
    the node would have answered, for a request refused before sending);
    ``reply`` is the node's ``ErrorReply`` when the node answered one."""

    code: str | None = None

    def __init__(self, message: str, *, reply: ErrorReply | None = None):
        super().__init__(message)
        self.reply = reply
        if reply is not None:
            self.code = reply.code


class RequestError(StoreError):
    """The request is at fault and would fail anywhere: report it to the
    caller; do not resend and do not degrade (§9)."""


class InvalidRequest(RequestError):
    """Well-formed, but breaks a rule of §8. ``invalid`` is the reason as the
    node gives it: ``{"reason": "too_long", "field": "key", ...}``. Raised by
    the client before sending (``reply`` is None) or from the node's answer."""

    code = "invalid"

    def __init__(
        self, message: str, *, invalid: dict | None = None, reply: ErrorReply | None = None
    ):
        super().__init__(message, reply=reply)
        self.invalid = invalid


class MalformedRequest(RequestError):
    """Not the shape of a request: a wrong type, a negative number, an unknown name."""

    code = "malformed"


class RequestTooLarge(RequestError):
    """Over 65 536 bytes encoded (§8)."""

    code = "too_large"


class FleetError(StoreError):
    """The fleet, not the request, could not answer: degrade to local state (§9)."""


class FleetRefused(FleetError):
    """An error reply that puts the fault on the fleet (``unavailable``,
    ``overloaded``, ``internal``, ``deadline_expired``, or a code this client
    does not know); ``code`` says which."""


class WrongShard(FleetRefused):
    """The node says the tenant is not on this shard: this client's shard count
    differs from the fleet's. A configuration error: degrade and alert."""

    code = "wrong_shard"


class UnsupportedVersion(FleetRefused):
    """The node does not speak version 1; ``supported_versions`` says what it
    speaks. This client speaks nothing else: degrade and alert."""

    code = "unsupported_version"

    @property
    def supported_versions(self) -> list:
        return list(self.reply.supported_versions or []) if self.reply else []


class NoResponders(FleetError):
    """No node took the shard's requests (a shard moving, or no node up), and
    resending did not help within the budget; ``attempts`` were made."""

    def __init__(self, message: str, *, attempts: int):
        super().__init__(message)
        self.attempts = attempts


class Timeout(FleetError):
    """No reply within the call's budget."""


class Disconnected(FleetError):
    """The NATS connection cannot carry the request now (closed, draining,
    reconnecting, or its buffer full)."""


class UndecodableReply(FleetError):
    """A reply this client cannot read, or of a version it does not speak:
    like no reply (§9)."""


def _error_for(error: ErrorReply) -> StoreError:
    text = f"{error.code}: {error.message}"
    if error.code == "invalid":
        return InvalidRequest(text, invalid=error.invalid, reply=error)
    request_at_fault = {"malformed": MalformedRequest, "too_large": RequestTooLarge}
    if error.code in request_at_fault:
        return request_at_fault[error.code](text, reply=error)
    fleet_at_fault = {"wrong_shard": WrongShard, "unsupported_version": UnsupportedVersion}
    return fleet_at_fault.get(error.code, FleetRefused)(text, reply=error)


# ---------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------


_OUTCOMES = {
    "hit": (HitOk, Duplicate, Pending, RateLimited),
    "settle": (SettleOk, NotFound, NotOwner, AlreadyCommitted),
    "reset": (ResetDone,),
    "inspect": (TenantView,),
}


def _name(op: Op) -> str:
    # isinstance, not type(op): a caller's subclass of Hit is a hit.
    for cls, name in ((Hit, "hit"), (Settle, "settle"), (Reset, "reset"), (Inspect, "inspect")):
        if isinstance(op, cls):
            return name
    raise TypeError(f"not a request operation: {op!r}")


def _alarm(loop: asyncio.AbstractEventLoop, timeout_ms: int) -> float:
    """The loop time a call of ``timeout_ms`` ends by: its deadline less
    ``_EARLY_S`` or a fifth of the budget, whichever is less. Its requests
    carry the budget left until then, so that no node works for a caller
    that has stopped waiting."""
    budget_s = timeout_ms / 1000
    return loop.time() + budget_s - min(_EARLY_S, budget_s / 5)


def _check_budget(timeout_ms: Any) -> None:
    """The contract's ``timeout_ms``, a positive integer the wire can carry.
    Anything else is the caller's error, never a fleet outage: a degrading
    edge would otherwise answer it locally and count it against the breaker."""
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int):
        raise TypeError("timeout_ms must be an int")
    if not 1 <= timeout_ms < 2**64:
        raise ValueError(f"timeout_ms must be 1 to 2**64 - 1, not {timeout_ms}")


@dataclass
class _Waiting:
    """A call queued in a lane, and where its caller waits for the result."""

    op: Op
    timeout_ms: int
    deadline: float
    future: asyncio.Future


class _Lane:
    """Calls waiting for one node (or one shard whose node is not known), and
    how many messages to it are in flight."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.queue: list[_Waiting] = []
        self.in_flight = 0


def _expire(future: asyncio.Future, timeout_ms: int) -> None:
    if not future.done():
        future.set_result(Timeout(f"no reply within {timeout_ms} ms"))


def _is_wrong_node(body: Any) -> bool:
    """An item a node did not apply because it does not serve its shard (§5.5)."""
    return isinstance(body, ErrorReply) and body.code == "wrong_node"


def _outcome(body: Any, name: str) -> Any:
    """A reply body to a ``name`` request as its outcome; raises the
    ``StoreError`` of an error reply, or ``UndecodableReply``."""
    if isinstance(body, ErrorReply):
        raise _error_for(body)
    if not isinstance(body, _OUTCOMES[name]):
        raise UndecodableReply(f"a reply to a {name} that is not a {name} outcome: {body!r}")
    return body


class EdgeClient:
    """Calls an ankusa-fleet store over ``nc``, a connected ``nats.aio.client.Client``.

    ``instance`` and ``shards`` must be the fleet's. Every call takes
    ``timeout_ms``, a hard budget: it returns an outcome or raises a
    ``StoreError`` by then. Timers fire late, so a call's own is set early
    (by 2 ms, or a fifth of a smaller budget) and each request carries the
    budget left until that alarm; a loop too busy to wake the caller in that
    margin still makes it late. With ``validate`` (the default) a request that
    breaks a rule of §8 is refused here with the ``InvalidRequest`` a node would
    answer, without sending it. ``compact`` sends requests in the compact form.

    With ``batching`` (the default), hits and settles made while another is
    in flight to the same node wait and leave together as one ``batch``
    (§5.5): a lone call leaves at once, alone, and while up to
    ``max_in_flight`` messages are out, the calls gathering behind them leave
    when an answer comes back or ``max_batch`` of them have gathered. Each
    call keeps its own budget, on the wire and in waiting for its answer.
    Resets and inspects always go alone, as the Rust edge sends them.

    With ``node_batches`` (the default), batches go to the subject of the node
    that serves their shards, learned from the shards' replies (§1, §5.5),
    and may mix shards. An edge whose NATS permissions do not let it publish
    to ``ankusa.<instance>.node.*`` has such a publish refused by the server,
    and that batch times out; the client then sees the refusal in the
    connection's ``last_error``, warns once (logger ``ankusa_edge``) and sends
    every later batch to its shards' subjects. ``node_batches=False`` spares
    it that first batch.
    """

    def __init__(
        self,
        nc: Any,
        instance: str,
        shards: int,
        *,
        validate: bool = True,
        compact: bool = False,
        batching: bool = True,
        node_batches: bool = True,
        max_batch: int = 64,
        max_in_flight: int = 4,
    ):
        if not isinstance(instance, str) or not _INSTANCE.fullmatch(instance):
            raise ValueError(f"instance must be 1 to 64 of a-z, 0-9, _ and -, not {instance!r}")
        shard_of("", shards)  # checks the range
        self._nc = nc
        self.instance = instance
        self.shards = shards
        self._validate = validate
        self._compact = compact
        if not 1 <= max_batch <= MAX_BATCH or max_in_flight < 1:
            raise ValueError(f"max_batch must be 1 to {MAX_BATCH} and max_in_flight at least 1")
        self._batching = batching
        self._node_batches = node_batches
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        # The node that last answered on each shard's subject.
        self._owners: dict[int, str] = {}
        self._lanes: dict[str, _Lane] = {}
        self._flushing: set = set()

    def subject(self, tenant: str) -> str:
        """The subject of ``tenant``'s shard (§1)."""
        return self._shard_subject(shard_of(tenant, self.shards))

    def _shard_subject(self, shard: int) -> str:
        return f"ankusa.{self.instance}.shard.{shard}"

    def node_subject(self, node: str) -> str:
        """The subject of the node ``node`` (§1)."""
        return f"ankusa.{self.instance}.node.{node}"

    def known_nodes(self) -> dict:
        """The node each shard was last answered by, where ``batch`` sends
        that shard's calls: shard -> node_id."""
        return dict(self._owners)

    def _learn(self, shard: int, reply: Reply) -> None:
        """Remembers the node a reply on ``shard``'s subject names."""
        node = reply.node
        if self._node_batches and isinstance(node, str) and _NODE_ID.fullmatch(node):
            self._owners[shard] = node

    def _forget(self, node: str, tenant: str | None = None) -> None:
        """Forgets ``node`` as the server of ``tenant``'s shard, or of every
        shard with ``tenant`` None."""
        if tenant is None:
            self._owners = {s: n for s, n in self._owners.items() if n != node}
            return
        shard = shard_of(tenant, self.shards)
        if self._owners.get(shard) == node:
            del self._owners[shard]

    def _node_subjects_refused(self) -> bool:
        """Whether the server has refused this connection a publish to a node
        subject (nats-py keeps a connection's last error). The first time,
        turns node batches off for good, as the Rust edge does."""
        error = str(getattr(self._nc, "last_error", None) or "").lower()
        if "permissions violation for publish" not in error or self.node_subject("") not in error:
            return False
        if self._node_batches:
            self._node_batches = False
            self._owners.clear()
            _log.warning(
                "this edge may not publish to %s*: batches go shard by shard from now on "
                "(grant the subjects, see docs/security.md, or pass node_batches=False)",
                self.node_subject(""),
            )
        return True

    async def hit(
        self, charges: Sequence[Charge], claim: Claim | None = None, *, timeout_ms: int
    ) -> HitOutcome:
        """Charges ``charges`` and claims ``claim``'s key, all or nothing (§7.1).
        With neither, the contract's answer is ``HitOk`` at once: such a hit
        names no tenant whose shard could take it (§9.1)."""
        if not charges and claim is None:
            _check_budget(timeout_ms)
            return HitOk()
        return await self._call(Hit(tuple(charges), claim), "hit", timeout_ms)

    async def settle(self, claim: Claim, settlement: str, *, timeout_ms: int) -> SettleOutcome:
        """Commits (``COMMIT``) or releases (``RELEASE``) ``claim`` (§7.2)."""
        return await self._call(Settle(claim, settlement), "settle", timeout_ms)

    async def reset(self, tenant: str, *, timeout_ms: int) -> ResetDone:
        """Forgets ``tenant``'s buckets (§7.3)."""
        return await self._call(Reset(tenant), "reset", timeout_ms)

    async def inspect(
        self, tenant: str, claim: EventKey | None = None, *, timeout_ms: int
    ) -> TenantView:
        """Reads ``tenant``'s state and the claim on ``claim``'s key, changing
        nothing (§7.4). For operators: it has no local answer to degrade to."""
        return await self._call(Inspect(tenant, claim), "inspect", timeout_ms)

    async def _call(self, op: Op, name: str, timeout_ms: int) -> Any:
        # Only hits and settles share messages, as the Rust edge's calls do:
        # resets and inspects are rare, and a node from before `inspect`
        # answers a whole batch holding one `malformed`, failing the hits in
        # it with the inspect.
        if not self._batching or not isinstance(op, (Hit, Settle)):
            reply = await self.request(op, timeout_ms=timeout_ms)
            return _outcome(reply.body, name)
        _check_budget(timeout_ms)
        self._check(op)
        loop = asyncio.get_running_loop()
        deadline = _alarm(loop, timeout_ms)
        waiting = _Waiting(op, timeout_ms, deadline, loop.create_future())
        shard = shard_of(op.tenant, self.shards)
        node = self._owners.get(shard)
        # A lane per node, or per shard whose node is not known yet.
        key = f"node.{node}" if node else f"shard.{shard}"
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key)
        lane.queue.append(waiting)
        self._pump(lane)
        # The alarm ends the wait, answer or not: a timer on the call's own
        # future (cheaper than wait_for, and the lane sends no call whose
        # future is done).
        expiry = loop.call_at(deadline, _expire, waiting.future, timeout_ms)
        try:
            result = await waiting.future
        finally:
            expiry.cancel()
        if isinstance(result, StoreError):
            raise result
        return result

    def _pump(self, lane: _Lane) -> None:
        """Sends what ``lane`` holds while it may: everything waiting when
        nothing is in flight; beyond that, only full batches, up to
        ``max_in_flight`` messages at once. The rest waits for an answer,
        gathering into the next message."""
        while lane.queue and (
            lane.in_flight == 0
            or (lane.in_flight < self._max_in_flight and len(lane.queue) >= self._max_batch)
        ):
            # Calls whose deadline passed while they waited are answered
            # already: the node would do their work for nobody.
            taken = [w for w in lane.queue[: self._max_batch] if not w.future.done()]
            del lane.queue[: self._max_batch]
            if not taken:
                continue
            lane.in_flight += 1
            task = asyncio.ensure_future(self._flush(lane, taken))
            # The loop keeps only a weak reference to a task.
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)

    async def _flush(self, lane: _Lane, taken: list) -> None:
        """Sends one lane's calls (alone, or as a batch) and hands each caller
        its outcome or error."""
        ops = [w.op for w in taken]
        results: list = [None] * len(taken)
        try:
            if len(taken) == 1:
                # A lone call goes to its shard's subject, whose reply names
                # the node serving the shard: how the lanes learn nodes.
                try:
                    lone = taken[0]
                    reply = await self._request_until(lone.op, lone.deadline, lone.timeout_ms)
                    results[0] = _outcome(reply.body, _name(ops[0]))
                except StoreError as e:
                    results[0] = e
            else:
                deadlines = [w.deadline for w in taken]
                await self._carry_out(ops, deadlines, list(range(len(taken))), results)
        except Exception as e:  # a bug here must not leave callers waiting
            results = [Disconnected(f"the call could not be sent: {e!r}")] * len(taken)
        finally:
            lane.in_flight -= 1
            for w, result in zip(taken, results):
                if not w.future.done():
                    # None only when this task was cancelled (the loop closing).
                    w.future.set_result(result or Disconnected("the call was cancelled"))
            self._pump(lane)
            # An idle lane goes, so that the lanes of nodes gone in rollouts
            # do not pile up; the next call makes it again.
            if lane.in_flight == 0 and not lane.queue and self._lanes.get(lane.key) is lane:
                del self._lanes[lane.key]

    async def batch(self, ops: Sequence[Op], *, timeout_ms: int) -> list:
        """Carries out ``ops`` (hits, settles, resets, inspects) in as few
        messages as §5.5 allows, all within one hard budget: one ``batch`` to
        each known node for the shards it serves, one to each other shard's
        subject, all at once. More than ``MAX_BATCH`` items, or more than one
        message holds, get several batches, sent one after another so that a
        tenant's items are applied in the order given. Items a node answers
        ``wrong_node``, and every item of a node that has gone (no
        responders), are sent again to their shards' subjects, as §9 says.

        Returns, in the order of ``ops``, each one's outcome or the
        ``StoreError`` it met, returned rather than raised: one item's error
        does not touch the others. An op this client refuses (its checks of
        §8) is not sent; a hit with nothing to charge or claim is ``HitOk``,
        sent nowhere, as ``hit`` answers it (§9.1).

        A node from before ``inspect`` refuses a whole batch holding one as
        ``malformed``: every item in that message, not only the inspect, then
        gets ``MalformedRequest``. Inspect through ``inspect``, or in batches
        of inspects only, where nodes may be older."""
        _check_budget(timeout_ms)
        deadline = _alarm(asyncio.get_running_loop(), timeout_ms)
        results: list = [None] * len(ops)
        checked = []
        for i, op in enumerate(ops):
            if (
                isinstance(op, Hit)
                and isinstance(op.charges, (list, tuple))
                and not op.charges
                and op.claim is None
            ):
                # The contract's answer, which names no shard to send it to.
                results[i] = HitOk()
                continue
            try:
                self._check(op)
            except RequestError as e:
                results[i] = e
                continue
            checked.append(i)
        await self._carry_out(list(ops), [deadline] * len(ops), checked, results)
        return results

    async def _carry_out(
        self, ops: list, deadlines: list, indexes: list, results: list
    ) -> None:
        """Sends ``ops[i]`` for each ``i`` of ``indexes`` in batches (node
        subjects where known), each item with the budget its own deadline
        leaves, and sets ``results[i]`` to its outcome or ``StoreError``."""
        loop = asyncio.get_running_loop()
        # Each subject's items, and the node it is the subject of (None for a
        # shard's subject).
        groups: dict[str, tuple[str | None, list[int]]] = {}
        for i in indexes:
            shard = shard_of(ops[i].tenant, self.shards)
            node = self._owners.get(shard)
            subject = self.node_subject(node) if node else self._shard_subject(shard)
            groups.setdefault(subject, (node, []))[1].append(i)

        async def send(subject: str, node: str | None, indexes: list) -> None:
            if node is not None and self._node_subjects_refused():
                await by_shard(indexes)
                return
            # §5.1: an item whose budget rounds down to 0 ms has nothing left
            # to send; it times out here and stays out of the message. (A
            # resend after no responders may still carry one at 0, which the
            # node answers `deadline_expired`.)
            now = loop.time()
            timely = []
            for i in indexes:
                if deadlines[i] - now < 0.001:
                    results[i] = Timeout("its budget ran out before it could be sent")
                else:
                    timely.append(i)
            if not timely:
                return
            indexes = timely
            deadline = max(deadlines[i] for i in indexes)

            def encode(budget_ms: int) -> bytes:
                now = loop.time()
                items = tuple(
                    (ops[i], max(0, min(budget_ms, int((deadlines[i] - now) * 1000))))
                    for i in indexes
                )
                return _pack(Batch(items), budget_ms, self._compact)

            error: StoreError
            try:
                reply = await self._send(
                    subject,
                    encode,
                    deadline,
                    round((deadline - loop.time()) * 1000),
                    resend_no_responders=node is None,
                )
            except NoResponders as e:
                if node is None:
                    error = e
                else:
                    # §9: the node is gone and applied nothing.
                    self._forget(node)
                    await by_shard(indexes)
                    return
            except RequestTooLarge as e:
                if len(indexes) > 1:
                    half = len(indexes) // 2
                    await send(subject, node, indexes[:half])
                    await send(subject, node, indexes[half:])
                    return
                error = e
            except StoreError as e:
                if node is not None:
                    if isinstance(e, Timeout):
                        # Perhaps refused by the server: if so, not again.
                        self._node_subjects_refused()
                    # A node that does not answer may have lost its shards:
                    # their calls go to the shards' subjects until a reply
                    # names a node again, as the Rust edge does.
                    self._forget(node)
                error = e
            else:
                body = reply.body
                if isinstance(body, ErrorReply):
                    # An error to the batch as a whole: no item was carried out.
                    error = _error_for(body)
                elif not isinstance(body, list) or len(body) != len(indexes):
                    error = UndecodableReply(f"not a batch reply of {len(indexes)} items: {body!r}")
                else:
                    if node is None:
                        self._learn(shard_of(ops[indexes[0]].tenant, self.shards), reply)
                    moved = []
                    for i, item in zip(indexes, body):
                        if node is not None and _is_wrong_node(item.body):
                            # Not applied: the node no longer serves the shard.
                            self._forget(node, ops[i].tenant)
                            moved.append(i)
                            continue
                        try:
                            results[i] = _outcome(item.body, _name(ops[i]))
                        except StoreError as e:
                            results[i] = e
                    if moved:
                        await by_shard(moved)
                    return
            for i in indexes:
                results[i] = error

        async def send_all(subject: str, node: str | None, indexes: list) -> None:
            for k in range(0, len(indexes), MAX_BATCH):
                await send(subject, node, indexes[k : k + MAX_BATCH])

        async def by_shard(indexes: list) -> None:
            shards: dict[str, list[int]] = {}
            for i in indexes:
                shards.setdefault(self.subject(ops[i].tenant), []).append(i)
            await asyncio.gather(*(send_all(s, None, ix) for s, ix in shards.items()))

        await asyncio.gather(*(send_all(s, n, ix) for s, (n, ix) in groups.items()))

    async def request(self, op: Op, *, timeout_ms: int) -> Reply:
        """Sends one request and returns the node's reply as it came, error
        replies included (the typed calls above raise those). Raises a
        ``RequestError`` for a request refused before sending and a
        ``FleetError`` when no readable reply came in time."""
        _check_budget(timeout_ms)
        deadline = _alarm(asyncio.get_running_loop(), timeout_ms)
        self._check(op)
        return await self._request_until(op, deadline, timeout_ms)

    async def _request_until(self, op: Op, deadline: float, timeout_ms: int) -> Reply:
        """Sends a checked ``op`` alone to its shard's subject until
        ``deadline``, and learns the node its reply names."""

        def encode(budget_ms: int) -> bytes:
            return _pack(op, budget_ms, self._compact)

        shard = shard_of(op.tenant, self.shards)
        reply = await self._send(self._shard_subject(shard), encode, deadline, timeout_ms)
        self._learn(shard, reply)
        return reply

    def _check(self, op: Op) -> None:
        if self._validate:
            validate(op)
        else:
            _check_shape(op)

    async def _send(
        self,
        subject: str,
        encode: Callable[[int], bytes],
        deadline: float,
        timeout_ms: int,
        *,
        resend_no_responders: bool = True,
    ) -> Reply:
        """Sends ``encode(budget left)`` to ``subject`` until ``deadline``,
        resending on no responders (§9) unless told not to."""
        loop = asyncio.get_running_loop()
        pause = _FIRST_PAUSE_S
        attempts = 0
        while True:
            left = deadline - loop.time()
            budget_ms = min(int(left * 1000), _U64_MAX)
            if budget_ms <= 0:
                raise Timeout(f"no reply within {timeout_ms} ms")
            # Each send carries the budget left now (§5.1).
            payload = encode(budget_ms)
            if len(payload) > MAX_REQUEST_BYTES:
                raise RequestTooLarge(
                    f"the request is {len(payload)} bytes, over the limit of {MAX_REQUEST_BYTES}"
                )
            if not self._nc.is_connected:
                raise Disconnected("not connected to NATS")
            attempts += 1
            try:
                msg = await asyncio.wait_for(
                    self._nc.request(subject, payload, timeout=left), timeout=left
                )
            except nats.errors.NoRespondersError:
                # §9: no node serves the shard right now. Resend after a pause
                # while the budget leaves room for another round trip.
                left = deadline - loop.time()
                if not resend_no_responders or left <= _RETRY_ROUND_TRIP_S:
                    raise NoResponders(
                        f"no responders on {subject} within {timeout_ms} ms ({attempts} attempts)",
                        attempts=attempts,
                    ) from None
                await asyncio.sleep(min(pause, left - _RETRY_ROUND_TRIP_S))
                pause = min(pause * 2, _MAX_PAUSE_S)
                continue
            # nats-py's TimeoutError is one too; on Python 3.10 it is not the
            # builtin TimeoutError.
            except asyncio.TimeoutError:  # noqa: UP041
                raise Timeout(f"no reply within {timeout_ms} ms") from None
            except nats.errors.Error as e:
                raise Disconnected(f"NATS could not carry the request: {e}") from None
            return decode_reply(msg.data)


# ---------------------------------------------------------------------------
# §9 Degrade: the edge's own buckets and claims
# ---------------------------------------------------------------------------


def _retry_ms(us: int) -> int:
    """A wait in µs as a retry hint: whole ms, rounded up, at least 1 (§7.1)."""
    return max(1, -(-us // 1000))


def wall_clock_us() -> Callable[[], int]:
    """Unix µs read from the wall clock once and carried by the monotonic one,
    so that a step of the host's clock neither empties nor refills buckets."""
    anchor_us = time.time_ns() // 1000
    start_ns = time.monotonic_ns()
    return lambda: anchor_us + (time.monotonic_ns() - start_ns) // 1000


# Every _SWEEP_EVERY operations, a LocalStore sweeps the next _SWEEP_BATCH
# tenants in turn: a bounded step, where a full pass over 100,000 tenants in
# Python would hold up the answer it was made in (the Rust store sweeps a
# lock shard every 1,024 operations on it). A full store looks at its
# _ROOM_SCAN least recently used tenants for ones that hold nothing.
_SWEEP_EVERY = 16
_SWEEP_BATCH = 32
_ROOM_SCAN = 64
# A tenant's claims are swept this many at a visit, resuming where the last
# visit stopped (as the Rust store sweeps 4,096 places a step): a tenant of a
# million claims would otherwise hold up the answer its visit was made in.
_SWEEP_STEP = 4_096
# What a hit on a new key of a tenant at its claim cap is told to wait.
_CLAIMS_FULL_RETRY_MS = 1_000


@dataclass
class _LocalClaim:
    hook_id: str
    node: str
    committed: bool
    expires_us: int


@dataclass
class _LocalTenant:
    tats: dict
    claims: dict  # (source_id, key) -> _LocalClaim
    # The claims' keys the sweep has yet to look at in its current pass,
    # oldest last (taken from the end).
    to_sweep: list = field(default_factory=list)

    def live(self, source_id: str, key: str, now_us: int) -> _LocalClaim | None:
        entry = self.claims.get((source_id, key))
        return entry if entry is not None and entry.expires_us > now_us else None

    def is_empty(self, now_us: int) -> bool:
        return all(t <= now_us for t in self.tats.values()) and not any(
            c.expires_us > now_us for c in self.claims.values()
        )


class LocalStore:
    """This process's own buckets and claims, which a ``DegradingEdge`` answers
    from when the fleet cannot (§9). The rules are §7's, applied by this
    process alone, so local answers are safe in one direction only: a tenant
    may get its quota once per edge during an outage, and a hook committed on
    the fleet before it may be accepted again (a duplicate delivery).
    ``Duplicate`` is only answered for a claim committed here.

    ``clock`` returns unix µs. Every 16 hits and settles, the store sweeps
    the next 32 of its tenants in turn, each a step of 4,096 of its claims
    (expired claims go, and tenants that hold nothing once a pass over
    their claims is done); ``sweep`` does them all, for a periodic tick. At most
    ``max_tenants`` are kept: a new tenant past that drops those of the 64
    least recently used that hold nothing or, if none of them does, the
    eighth of those 64 used least recently, live claims and all. That can
    only admit more, never answer ``Duplicate``. A tenant holds at most
    ``max_tenant_claims`` claims (expired ones count until swept): a hit on a
    new key past that is answered ``Pending`` (retry after a second) and claims
    nothing, as the Rust edge's local store does, so a fleet refusing the
    tenant's claims (``overloaded``) does not move them all here. Requests
    must have passed ``validate``. Not thread-safe: use it from one event
    loop, as ``DegradingEdge`` does."""

    def __init__(
        self,
        *,
        max_tenants: int = 100_000,
        max_tenant_claims: int = 1_000_000,
        clock: Callable[[], int] | None = None,
    ):
        self._clock = clock or wall_clock_us()
        self._max_tenants = max(1, max_tenants)
        self._max_tenant_claims = max(1, max_tenant_claims)
        self._tenants: dict[str, _LocalTenant] = {}
        # Every tenant made, in the order the incremental sweep visits them,
        # and where it stopped. An entry whose tenant has gone is dropped
        # when visited, so the list stays within about twice the tenants.
        self._ring: list[tuple[str, _LocalTenant]] = []
        self._ring_at = 0
        self._ops = 0

    def __len__(self) -> int:
        return len(self._tenants)

    def _tenant(self, name: str, now: int) -> _LocalTenant:
        tenant = self._tenants.pop(name, None)  # re-inserted last: most recently used
        if tenant is None:
            if len(self._tenants) >= self._max_tenants:
                self._make_room(now)
            tenant = _LocalTenant({HOOKS: 0, BYTES: 0}, {})
            self._ring.append((name, tenant))
        self._tenants[name] = tenant
        return tenant

    def _make_room(self, now: int) -> None:
        """Frees a place in a full store, looking at no more than
        ``_ROOM_SCAN`` tenants: the answer it is made in waits for it."""
        oldest = list(itertools.islice(self._tenants.items(), _ROOM_SCAN))
        empty = [name for name, tenant in oldest if tenant.is_empty(now)]
        # Failing those, room for an eighth of the scan at once, as the Rust
        # store makes room for an eighth of a shard: a stream of new tenants
        # then pays for a scan every few inserts, not on each.
        room = max(1, len(oldest) // 8)
        for name in empty or [name for name, _ in oldest[:room]]:
            del self._tenants[name]

    def _tick(self, now: int) -> None:
        """Counts an operation, and sweeps a few tenants every ``_SWEEP_EVERY``:
        without it, an active tenant's expired claims would pile up."""
        self._ops += 1
        if self._ops >= _SWEEP_EVERY:
            self._ops = 0
            self._sweep_some(now, _SWEEP_BATCH)

    def _sweep_some(self, now: int, count: int) -> None:
        """Sweeps the next ``count`` tenants of the ring (fewer if it holds
        fewer), resuming where the last call stopped."""
        ring = self._ring
        for _ in range(min(count, len(ring))):
            if self._ring_at >= len(ring):
                self._ring_at = 0
            name, tenant = ring[self._ring_at]
            if self._tenants.get(name) is tenant:
                self._drop_expired_step(tenant, now)
                if tenant.to_sweep or not tenant.is_empty(now):
                    self._ring_at += 1
                    continue
                del self._tenants[name]
            # Gone: the last entry takes its place, and is visited next.
            ring[self._ring_at] = ring[-1]
            ring.pop()

    @staticmethod
    def _drop_expired_step(tenant: _LocalTenant, now: int) -> int:
        """Looks at the next ``_SWEEP_STEP`` claims of the tenant's current
        pass (a new pass, oldest first, when the last one is done) and drops
        the expired ones."""
        if not tenant.to_sweep:
            tenant.to_sweep = list(reversed(tenant.claims))
        dropped = 0
        for _ in range(min(_SWEEP_STEP, len(tenant.to_sweep))):
            key = tenant.to_sweep.pop()
            entry = tenant.claims.get(key)
            if entry is not None and entry.expires_us <= now:
                del tenant.claims[key]
                dropped += 1
        return dropped

    @staticmethod
    def _drop_expired(tenant: _LocalTenant, now: int) -> int:
        expired = [k for k, c in tenant.claims.items() if c.expires_us <= now]
        for k in expired:
            del tenant.claims[k]
        return len(expired)

    def hit(self, op: Hit) -> HitOutcome:
        """§7.1, in its order: a replay of an own pending claim, the charges
        all or nothing, a taken key, then the charges and the claim."""
        now = self._clock()
        self._tick(now)
        tenant = self._tenant(op.tenant, now)
        claim = op.claim
        held = tenant.live(claim.source_id, claim.key, now) if claim else None
        if held and not held.committed and held.hook_id == claim.hook_id:
            return HitOk()
        new_tats = dict(tenant.tats)
        wait_us = None
        for c in op.charges:
            tat = max(tenant.tats[c.kind], now) + c.increment_us
            if tat <= now + c.capacity_us:
                new_tats[c.kind] = tat
            else:
                wait_us = max(wait_us or 0, tat - (now + c.capacity_us))
        if wait_us is not None:
            return RateLimited(_retry_ms(wait_us))
        if held:
            if held.committed:
                return Duplicate(held.hook_id)
            return Pending(_retry_ms(held.expires_us - now))
        if claim:
            key = (claim.source_id, claim.key)
            # An expired claim is replaced where it lies; only a new key grows the table.
            if key not in tenant.claims and len(tenant.claims) >= self._max_tenant_claims:
                return Pending(_CLAIMS_FULL_RETRY_MS)
            tenant.claims[key] = _LocalClaim(
                claim.hook_id, claim.node, False, now + claim.pending_ttl_ms * 1000
            )
        tenant.tats = new_tats
        return HitOk()

    def settle(self, op: Settle) -> SettleOutcome:
        """§7.2: only the hook holding the key settles it."""
        now = self._clock()
        self._tick(now)
        claim = op.claim
        tenant = self._tenants.get(claim.tenant)
        held = tenant.live(claim.source_id, claim.key, now) if tenant else None
        if held is None:
            return NotFound()
        if held.hook_id != claim.hook_id:
            return NotOwner(held.hook_id)
        if op.settlement == RELEASE:
            if held.committed:
                return AlreadyCommitted()
            del tenant.claims[(claim.source_id, claim.key)]
        elif not held.committed:
            held.committed = True
            held.expires_us = now + claim.ttl_ms * 1000
        return SettleOk()

    def reset(self, tenant: str) -> ResetDone:
        """§7.3: both buckets full again; claims stay."""
        state = self._tenants.get(tenant)
        if state is not None:
            state.tats = {HOOKS: 0, BYTES: 0}
        return ResetDone()

    def holds_claim(
        self, tenant: str, source_id: str, key: str, hook_id: str | None = None
    ) -> bool:
        """Whether a live claim on the key was made here (by ``hook_id``, if
        given): such a claim lives here until it expires (or its tenant is
        evicted from a full store), since the fleet never saw it."""
        state = self._tenants.get(tenant)
        held = state.live(source_id, key, self._clock()) if state else None
        return held is not None and hook_id in (None, held.hook_id)

    def sweep(self) -> int:
        """Drops expired claims and tenants that hold nothing; returns the
        claims dropped."""
        now = self._clock()
        dropped = 0
        for name in list(self._tenants):
            tenant = self._tenants[name]
            dropped += self._drop_expired(tenant, now)
            if tenant.is_empty(now):
                del self._tenants[name]
        return dropped


@dataclass(frozen=True)
class Permit:
    """A call ``CircuitBreaker.admit`` let through to the fleet; ``probe``
    when it is the one call trying a breaker that was open. Its result goes
    back with ``record(up, permit.probe)``, or ``abandon(permit.probe)``."""

    probe: bool


_CALL = Permit(probe=False)
_PROBE = Permit(probe=True)


class CircuitBreaker:
    """Whether to try the fleet at all. Closed, every call goes; after
    ``failure_threshold`` outages in a row it opens for ``base_backoff_s``,
    refusing every call at once; then one call probes, which closes it on
    success or reopens it with the backoff doubled, up to ``max_backoff_s``.
    Only the probe's result closes or reopens it: a call let through before
    it opened may report late, and its success only starts the count of
    outages again, as in the Rust breaker. ``clock`` is monotonic seconds."""

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._threshold = max(1, failure_threshold)
        self._base = base_backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._failures = 0
        self._backoff = base_backoff_s
        self._open_until: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        if self._probing:
            return "half_open"
        return "closed" if self._open_until is None else "open"

    def admit(self) -> Permit | None:
        """A ``Permit`` if this call may go to the fleet (its result must be
        ``record``-ed, or the call ``abandon``-ed), None if not."""
        if self._open_until is None:
            return _CALL
        if self._probing or self._clock() < self._open_until:
            return None
        self._probing = True
        return _PROBE

    def abandon(self, probe: bool) -> None:
        """An admitted call that ended with no result (cancelled, or failed
        before it reached the fleet): it says nothing of the fleet, and if it
        was the probe, the probe's turn goes to the next call."""
        if probe:
            self._probing = False

    def record(self, up: bool, probe: bool) -> None:
        """An admitted call's result, ``up`` unless it met an outage;
        ``probe`` as its permit says."""
        if probe:
            self._probing = False
            if up:
                self._failures, self._backoff, self._open_until = 0, self._base, None
            else:
                self._backoff = min(self._backoff * 2, self._max)
                self._open_until = self._clock() + self._backoff
            return
        if up:
            self._failures = 0
            return
        self._failures += 1
        if self._failures >= self._threshold and self._open_until is None:
            self._open_until = self._clock() + self._backoff


@dataclass(frozen=True)
class Answer:
    """An outcome and who gave it: ``source`` is ``"fleet"`` or ``"local"``,
    and for a local one ``reason`` says why (``breaker_open``, ``timeout``,
    ``no_responders``, ``disconnected``, ``node_error``, ``bad_reply``,
    ``local_claim``)."""

    outcome: Any
    source: str = "fleet"
    reason: str | None = None


def _outage_reason(e: FleetError) -> str:
    for cls, reason in (
        (Timeout, "timeout"),
        (NoResponders, "no_responders"),
        (Disconnected, "disconnected"),
        (FleetRefused, "node_error"),
        (UndecodableReply, "bad_reply"),
    ):
        if isinstance(e, cls):
            return reason
    return "transport"


class DegradingEdge:
    """An ``EdgeClient`` that degrades as §9 says: on an outage (any
    ``FleetError``) a hit is answered from this process's ``LocalStore``,
    within the same budget, and the ``Answer`` says so. A request the node
    refuses as the request's fault (``RequestError``) is raised, never
    degraded. A claim made locally stays local until it expires, or until a
    full ``LocalStore`` evicts its tenant: later hits on its key and its
    settle are answered here, and after an eviction go to the fleet, which
    never saw the claim (its key may be admitted again: a duplicate
    delivery). A settle of a fleet claim goes to the fleet only, even while
    the breaker is open; during an outage its ``FleetError`` is raised
    (committing locally a claim the fleet holds could answer ``Duplicate``
    for a hook nobody stored). A
    reset is applied locally always and sent to the fleet best effort.

    ``reserve_ms`` of each budget, at most a tenth of it, is kept for the
    local answer, rounded up to a whole millisecond as budgets travel. A
    budget that leaves the fleet less than 2 ms (a request of 1 ms has
    nothing left to send once its alarm is set) is the caller's, not an
    outage: the fleet is not tried, the breaker not told, and the answer is
    local with reason ``timeout``. Call ``sweep`` from a periodic tick to
    drop expired local claims of tenants no call touches."""

    def __init__(
        self,
        edge: EdgeClient,
        *,
        local: LocalStore | None = None,
        breaker: CircuitBreaker | None = None,
        reserve_ms: int = 1,
    ):
        self.edge = edge
        # `is None`, not `or`: a LocalStore is as long as its tenants, so a
        # new one is falsy.
        self.local = local if local is not None else LocalStore()
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._reserve_ms = reserve_ms

    async def hit(
        self, charges: Sequence[Charge], claim: Claim | None = None, *, timeout_ms: int
    ) -> Answer:
        _check_budget(timeout_ms)
        if not charges and claim is None:
            # The fleet's answer, which needs no round trip (§9.1).
            return Answer(HitOk(), "fleet")
        op = Hit(tuple(charges), claim)
        validate(op)
        if claim and self.local.holds_claim(claim.tenant, claim.source_id, claim.key):
            return Answer(self.local.hit(op), "local", "local_claim")
        fleet = await self._fleet(
            lambda budget: self.edge.hit(op.charges, claim, timeout_ms=budget), timeout_ms
        )
        if isinstance(fleet, Answer):
            return fleet
        return Answer(self.local.hit(op), "local", fleet)

    async def settle(self, claim: Claim, settlement: str, *, timeout_ms: int) -> Answer:
        op = Settle(claim, settlement)
        validate(op)
        _check_budget(timeout_ms)
        if self.local.holds_claim(claim.tenant, claim.source_id, claim.key, claim.hook_id):
            return Answer(self.local.settle(op), "local", "local_claim")
        # Tried whatever the breaker says: a commit not made leaves its hook to
        # be delivered again, and the breaker may back off long after the
        # fleet is back.
        fleet = await self._fleet(
            lambda budget: self.edge.settle(claim, settlement, timeout_ms=budget),
            timeout_ms,
            raise_outage=True,
            always=True,
        )
        if isinstance(fleet, Answer):
            return fleet
        raise Timeout(f"{timeout_ms} ms leaves the fleet no time: it was not tried")

    async def reset(self, tenant: str, *, timeout_ms: int) -> Answer:
        validate(Reset(tenant))
        _check_budget(timeout_ms)
        self.local.reset(tenant)
        fleet = await self._fleet(
            lambda budget: self.edge.reset(tenant, timeout_ms=budget), timeout_ms
        )
        return fleet if isinstance(fleet, Answer) else Answer(ResetDone(), "local", fleet)

    def sweep(self) -> int:
        """Sweeps the local store (for a periodic tick); returns the claims dropped."""
        return self.local.sweep()

    def _budget(self, timeout_ms: int) -> int:
        """The fleet's part of a call's budget: less the reserve, which is
        at most a tenth, as the Rust edge keeps, but counted in whole ms, as
        the wire counts budgets; 0 when too little is left to send."""
        reserve = math.ceil(min(self._reserve_ms, timeout_ms / 10))
        fleet_ms = timeout_ms - reserve
        return fleet_ms if fleet_ms >= 2 else 0

    async def _fleet(
        self,
        call: Callable[[int], Any],
        timeout_ms: int,
        *,
        raise_outage: bool = False,
        always: bool = False,
    ) -> Answer | str:
        """The fleet's ``Answer`` to ``call(its budget)``, or the reason to
        answer locally. ``always``: tried while the breaker is open too, and
        then its result is not told to the breaker (its own probe decides)."""
        budget = self._budget(timeout_ms)
        if budget == 0:
            # The caller's budget, not the fleet's failure: as the Rust edge
            # does, answered locally at once and the breaker not told.
            return "timeout"
        permit = self.breaker.admit()
        if permit is None and not always:
            return "breaker_open"

        def tell(ok: bool) -> None:
            if permit is not None:
                self.breaker.record(ok, permit.probe)

        try:
            outcome = await call(budget)
        except FleetError as e:
            tell(False)
            if raise_outage:
                raise
            return _outage_reason(e)
        except RequestError:
            tell(True)  # the fleet answered: it is up
            raise
        except BaseException:
            if permit is not None:
                self.breaker.abandon(permit.probe)
            raise
        tell(True)
        return Answer(outcome)


# ---------------------------------------------------------------------------
# Command line: vectors, shard, scenario
# ---------------------------------------------------------------------------

# A vector check that parses nothing must not pass.
_MIN_REQUESTS = 5
_MIN_REPLIES = 10
_MIN_SHARD_ROWS = 10

_FENCE = re.compile(r"^```(hex|json)((?:\s+\w+=\S+)+)\s*$")


def _doc_blocks(text: str) -> tuple:
    """The ```hex name=...``` and ```json name=...``` blocks of the doc:
    ({name: bytes}, {name: json value}, {name: tags})."""
    hexes, views, tags = {}, {}, {}
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        i += 1
        if not m:
            continue
        attrs = dict(token.split("=", 1) for token in m.group(2).split())
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        i += 1
        name = attrs["name"]
        if m.group(1) == "hex":
            if name in hexes:
                raise ValueError(f"two hex blocks named {name}")
            hexes[name] = bytes.fromhex(" ".join(body))
            tags[name] = attrs
        else:
            if name in views:
                raise ValueError(f"two json blocks named {name}")
            views[name] = json.loads("\n".join(body))
    return hexes, views, tags


def _shard_rows(text: str) -> tuple:
    """The §2 table: (shard counts of its columns, [(tenant, bytes, hash, shards)])."""
    begin = text.index("<!-- shard-vectors:begin -->")
    end = text.index("<!-- shard-vectors:end -->")
    rows = [line.strip() for line in text[begin:end].split("\n") if line.strip().startswith("|")]
    cells = [[c.strip().strip("`") for c in row.strip("|").split("|")] for row in rows]
    header, body = cells[0], cells[2:]
    counts = [int(h.split("=", 1)[1]) for h in header[3:]]
    out = []
    for c in body:
        raw = b"" if c[1] == "(none)" else bytes.fromhex(c[1])
        out.append((json.loads(c[0]), raw, int(c[2], 16), [int(x) for x in c[3:]]))
    return counts, out


def _request_from_view(view: Any) -> tuple:
    """A request's JSON view (§10) as (op, timeout_ms, compact). Raises
    ValueError for anything not v1."""
    compact = isinstance(view, list)
    v, timeout_ms, ops = view if compact else (view["v"], view["timeout_ms"], view["op"])
    if v != PROTOCOL_VERSION or not isinstance(ops, dict) or len(ops) != 1:
        raise ValueError(f"not a version {PROTOCOL_VERSION} request: {view!r}")
    ((name, rec),) = ops.items()

    def record(cls, value):
        return cls(*value) if compact else cls(**value)

    def claim(value):
        return None if value is None else record(Claim, value)

    if name == "batch":
        items = []
        for item in rec:
            op, item_timeout_ms, item_compact = _request_from_view(item)
            if item_compact != compact:
                raise ValueError(f"a batch mixing the forms: {view!r}")
            items.append((op, item_timeout_ms))
        return Batch(tuple(items)), timeout_ms, compact
    if name == "hit":
        charges, c = rec if compact else (rec["charges"], rec.get("claim"))
        return Hit(tuple(record(Charge, x) for x in charges), claim(c)), timeout_ms, compact
    if name == "settle":
        c, settlement = rec if compact else (rec["claim"], rec["settlement"])
        return Settle(claim(c), settlement), timeout_ms, compact
    if name == "reset":
        return record(Reset, rec), timeout_ms, compact
    if name == "inspect":
        tenant, event = rec if compact else (rec["tenant"], rec.get("claim"))
        event = None if event is None else record(EventKey, event)
        return Inspect(tenant, event), timeout_ms, compact
    raise ValueError(f"unknown operation {name!r}")


def _with_unknown_keys(view: dict) -> dict:
    """A reply view with keys a later version might add, where records may get them."""
    out = dict(view, later_field={"nested": [1, "x", None]})
    body = out["body"]
    if isinstance(body, dict):
        ((name, rec),) = body.items()
        if name == "batch":
            rec = [_with_unknown_keys(item) for item in rec]
        else:
            rec = dict(rec, later_field=7)
        out["body"] = {name: rec}
    return out


def cmd_vectors(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    hexes, views, tags = _doc_blocks(text)
    checked = {"request": 0, "reply": 0, "shard": 0}
    failed = 0

    def report(ok: bool, name: str, what: str) -> None:
        nonlocal failed
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {what}")

    for name in sorted(set(views) - set(hexes)):
        report(False, name, "a json view without its hex block")
    for name, raw in hexes.items():
        if name not in views:
            refused = tags[name].get("refused")
            print(
                f"skip {name}: a request a node refuses ({refused}); nothing for an edge to check"
            )
            continue
        view = views[name]
        try:
            as_sent = msgpack.unpackb(raw, raw=False)
        except (ValueError, msgpack.UnpackException) as e:
            report(False, name, f"the hex is not one MessagePack value: {e}")
            continue
        if as_sent != view:
            report(False, name, "the json view is not what the hex says")
            continue
        if name.startswith("request-"):
            op, timeout_ms, compact = _request_from_view(view)
            mine = encode_request(op, timeout_ms, compact=compact)
            form = "compact" if compact else "map"
            if mine == raw:
                report(True, name, f"encoded to the same {len(raw)} bytes ({form} form)")
            else:
                report(
                    False,
                    name,
                    f"encoded ({form} form) to\n  {mine.hex(' ')}\nnot\n  {raw.hex(' ')}",
                )
            checked["request"] += 1
        elif name.startswith("reply-"):
            try:
                got = reply_view(decode_reply(raw))
                extended = msgpack.packb(_with_unknown_keys(view), use_bin_type=True)
                got_extended = reply_view(decode_reply(extended))
            except StoreError as e:
                report(False, name, f"not decoded: {e!r}")
            else:
                if got != view:
                    report(False, name, f"decoded to {got!r}")
                elif got_extended != view:
                    report(False, name, f"with unknown keys, decoded to {got_extended!r}")
                else:
                    report(True, name, "decoded to the json view (also with unknown keys added)")
            checked["reply"] += 1
        else:
            report(False, name, "neither request- nor reply-: unknown kind of vector")
    counts, rows = _shard_rows(text)
    for tenant, raw, want_hash, want_shards in rows:
        got = [shard_of(tenant, s) for s in counts]
        ok = tenant.encode("utf-8") == raw and fnv1a_32(raw) == want_hash and got == want_shards
        report(
            ok,
            f"shard {json.dumps(tenant)}",
            f"fnv1a_32 {fnv1a_32(raw):#010x}, shards {got} for S={counts}",
        )
        checked["shard"] += 1
    total = sum(checked.values())
    print(
        f"vectors: {total} checked ({checked['request']} requests, {checked['reply']} replies, "
        f"{checked['shard']} shard rows), {failed} failed"
    )
    minimum = {"request": _MIN_REQUESTS, "reply": _MIN_REPLIES, "shard": _MIN_SHARD_ROWS}
    short = [f"{k} {checked[k]} < {m}" for k, m in minimum.items() if checked[k] < m]
    if short:
        print(f"vectors: too few checked, the doc was not parsed as expected: {', '.join(short)}")
        return 1
    return 1 if failed else 0


def cmd_shard(counts: list, tenants: list) -> int:
    """One line per tenant (JSON string literals, from the arguments or one a
    line on stdin): its shard for each count, space-separated."""
    if not tenants:
        # Split on "\n" only: str.splitlines() also splits on U+0085, U+2028
        # and others, which JSON leaves unescaped inside a string.
        text = sys.stdin.buffer.read().decode("utf-8")
        tenants = [json.loads(line) for line in text.split("\n") if line.strip()]
    for tenant in tenants:
        print(" ".join(str(shard_of(tenant, s)) for s in counts))
    return 0


def _error_view(e: StoreError) -> dict:
    view = {
        "type": type(e).__name__,
        "code": e.code,
        "message": str(e),
        "from_node": e.reply is not None,
    }
    for group in (RequestError, FleetError):
        if isinstance(e, group):
            view["group"] = group.__name__
    if isinstance(e, InvalidRequest):
        view["invalid"] = e.invalid
    if isinstance(e, NoResponders):
        view["attempts"] = e.attempts
    if isinstance(e, UnsupportedVersion):
        view["supported_versions"] = e.supported_versions
    return view


async def cmd_scenario(args: argparse.Namespace) -> int:
    import nats  # the connection is this program's; the client takes any

    nc = await nats.connect(
        args.nats, connect_timeout=5, max_reconnect_attempts=2, name="ankusa-edge-py scenario"
    )
    try:
        await _scenario(nc, args)
    finally:
        await nc.close()
    return 0


async def cmd_bench(args: argparse.Namespace) -> int:
    """Drives a live fleet from this process: ``--calls`` hits, each claiming
    a fresh key of one of ``--tenants`` tenants and committed once answered,
    ``--concurrency`` at a time; prints calls/s and latency percentiles."""
    import nats

    nc = await nats.connect(args.nats, connect_timeout=5, name="ankusa-edge-py bench")
    edge = EdgeClient(nc, args.instance, args.shards, batching=not args.no_batching)
    run_id = f"{time.time_ns():x}"
    latencies: list = []
    outcomes: dict = {}
    next_call = iter(range(args.calls))

    async def timed(call: Any) -> Any:
        start = time.perf_counter()
        try:
            result = await call
        except StoreError as e:
            result = e
        latencies.append(time.perf_counter() - start)
        name = type(result).__name__
        outcomes[name] = outcomes.get(name, 0) + 1
        return result

    async def worker() -> None:
        for i in next_call:
            tenant = f"bench-{i % args.tenants}"
            charges = [Charge(HOOKS, tenant, 1_000, 1_000_000_000)]
            claim = Claim(tenant, "bench", f"{run_id}-{i}", f"h{i}", "py-bench", 60_000, 30_000)
            if isinstance(await timed(edge.hit(charges, claim, timeout_ms=args.timeout_ms)), HitOk):
                await timed(edge.settle(claim, COMMIT, timeout_ms=args.timeout_ms))

    try:
        start = time.perf_counter()
        cpu = time.process_time()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        await nc.close()
    latencies.sort()

    def percentile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    print(
        json.dumps(
            {
                "batching": not args.no_batching,
                "calls": len(latencies),
                "seconds": round(elapsed, 3),
                "calls_per_s": round(len(latencies) / elapsed),
                "cpu_us_per_call": round(cpu / len(latencies) * 1e6, 1),
                "p50_ms": round(percentile(0.50), 2),
                "p99_ms": round(percentile(0.99), 2),
                "outcomes": outcomes,
            }
        )
    )
    return 0


async def _scenario(nc: Any, args: argparse.Namespace) -> None:
    p = args.prefix
    tenant = args.tenant or f"{p}-acme"
    budget = args.timeout_ms
    edge = EdgeClient(nc, args.instance, args.shards, compact=args.compact)

    def emit(step: str, **fields: Any) -> None:
        print(json.dumps({"step": step, **fields}), flush=True)

    def views(results: list) -> list:
        """A batch's results as JSON: each an outcome's view or an error's."""
        return [_error_view(r) if isinstance(r, StoreError) else outcome_view(r) for r in results]

    async def run(step: str, call, **context: Any) -> Any:
        start = time.monotonic()
        try:
            result = await call
        except StoreError as e:
            emit(
                step,
                error=_error_view(e),
                elapsed_ms=round((time.monotonic() - start) * 1000),
                **context,
            )
            return e
        emit(step, outcome=outcome_view(result), **context)
        return result

    def claim(key: str, hook: str) -> Claim:
        return Claim(tenant, args.source, key, hook, f"{p}-edge", 600_000, 30_000)

    roomy = [Charge(HOOKS, tenant, 1_000, 1_000_000), Charge(BYTES, tenant, 10, 10_000_000)]
    k1, k2 = f"{p}-evt-1", f"{p}-evt-2"
    h1, h2, h3, h4 = (f"{p}-h{i}" for i in range(1, 5))

    # A fresh key: ok; the reply names the node that answered.
    async def hit_naming_node() -> Any:
        reply = await edge.request(Hit(tuple(roomy), claim(k1, h1)), timeout_ms=budget)
        if isinstance(reply.body, ErrorReply):
            raise _error_for(reply.body)
        emit("answered-by", node=reply.node)
        return reply.body

    await run("hit-fresh", hit_naming_node(), tenant=tenant, key=k1, hook_id=h1)
    await run("settle-commit", edge.settle(claim(k1, h1), COMMIT, timeout_ms=budget))
    await run("settle-commit-again", edge.settle(claim(k1, h1), COMMIT, timeout_ms=budget))
    await run("hit-duplicate", edge.hit(roomy, claim(k1, h2), timeout_ms=budget), hook_id=h2)
    await run("settle-not-owner", edge.settle(claim(k1, h2), RELEASE, timeout_ms=budget))
    await run("release-committed", edge.settle(claim(k1, h1), RELEASE, timeout_ms=budget))
    await run("settle-not-found", edge.settle(claim(f"{p}-never", h1), COMMIT, timeout_ms=budget))
    event_1 = EventKey(args.source, k1)
    await run("inspect-committed", edge.inspect(tenant, event_1, timeout_ms=budget))

    # A claim left pending blocks its key for other hooks, not for itself.
    await run("hit-claim-pending", edge.hit(roomy, claim(k2, h3), timeout_ms=budget))
    await run("hit-pending", edge.hit(roomy, claim(k2, h4), timeout_ms=budget), hook_id=h4)
    await run("hit-replay", edge.hit(roomy, claim(k2, h3), timeout_ms=budget), hook_id=h3)
    event_2 = EventKey(args.source, k2)
    await run("inspect-pending", edge.inspect(tenant, event_2, timeout_ms=budget))
    await run("release-pending", edge.settle(claim(k2, h3), RELEASE, timeout_ms=budget))
    await run("hit-after-release", edge.hit(roomy, claim(k2, h4), timeout_ms=budget))

    # A bucket of one hook a minute: the second hit waits about a minute.
    tight_tenant = f"{p}-tight"
    tight = [Charge(HOOKS, tight_tenant, 60_000_000, 60_000_000)]
    await run("tight-1", edge.hit(tight, timeout_ms=budget), tenant=tight_tenant)
    await run("tight-2", edge.hit(tight, timeout_ms=budget), tenant=tight_tenant)
    await run("inspect-tight", edge.inspect(tight_tenant, timeout_ms=budget))
    await run("reset", edge.reset(tight_tenant, timeout_ms=budget), tenant=tight_tenant)
    await run("tight-after-reset", edge.hit(tight, timeout_ms=budget), tenant=tight_tenant)
    # Nothing to charge or claim: the contract's ok, sent nowhere (§9.1).
    await run("hit-nothing", edge.hit([], timeout_ms=budget))

    # A tenant over 256 bytes: refused by this client before sending, and by
    # the node when sent anyway; both with the same reason.
    long_tenant = "t" * 257
    long_hit = [Charge(HOOKS, long_tenant, 1_000, 1_000_000)]
    await run("too-long-tenant-local", edge.hit(long_hit, timeout_ms=budget))
    unchecked = EdgeClient(nc, args.instance, args.shards, validate=False, compact=args.compact)
    await run("too-long-tenant-node", unchecked.hit(long_hit, timeout_ms=budget))

    # Several calls at once, one batch message per shard (§5.5): a fresh
    # claim, a commit made before, a reset, one this client refuses, and a hit
    # for a tenant of another shard. Each answered in its own slot.
    if args.shards > 1:
        k3, h5 = f"{p}-evt-3", f"{p}-h5"
        home = shard_of(tenant, args.shards)
        elsewhere = next(
            f"{p}-b{i}" for i in range(10_000) if shard_of(f"{p}-b{i}", args.shards) != home
        )
        batch = [
            Hit(tuple(roomy), claim(k3, h5)),
            Settle(claim(k1, h1), COMMIT),
            Reset(tight_tenant),
            Hit(tuple(long_hit)),
            Hit((Charge(HOOKS, elsewhere, 1_000, 1_000_000),)),
        ]
        # The calls before it named the tenant's node: the batch goes there.
        via_node = edge.known_nodes().get(home)
        results = await edge.batch(batch, timeout_ms=budget)
        emit(
            "batch",
            key=k3,
            hook_id=h5,
            via_node=via_node,
            results=views(results),
        )

    # This client's checks give the reason a node gives, rule by rule of §8.
    ok_claim = claim(f"{p}-evt-v", f"{p}-hv")
    t = tenant
    cases = {
        "reset-empty-tenant": Reset(""),
        "key-too-long": Hit((), replace(ok_claim, key="k" * 1025)),
        "source-id-too-long-in-bytes": Hit((), replace(ok_claim, source_id="é" * 129)),
        "nothing-to-do": Hit((), None),
        "too-many-charges": Hit(
            (Charge(HOOKS, t, 1, 1), Charge(BYTES, t, 1, 1), Charge(HOOKS, t, 1, 1))
        ),
        "duplicate-bucket": Hit((Charge(BYTES, t, 1, 1), Charge(BYTES, t, 1, 1))),
        "mixed-tenants": Hit((Charge(HOOKS, f"{p}-other", 1, 1),), ok_claim),
        "zero-capacity": Hit((Charge(HOOKS, t, 1, 0),)),
        "zero-increment": Hit((Charge(HOOKS, t, 0, 1),)),
        "increment-over-capacity": Hit((Charge(HOOKS, t, 2, 1),)),
        "increment-over-a-year": Hit((Charge(HOOKS, t, _MAX_CAPACITY_US + 1, _MAX_CAPACITY_US),)),
        "capacity-over-a-year": Hit((Charge(HOOKS, t, 1, _MAX_CAPACITY_US + 1),)),
        "ttl-over-90-days": Hit((), replace(ok_claim, ttl_ms=_MAX_TTL_MS + 1)),
        "pending-ttl-zero": Hit((), replace(ok_claim, pending_ttl_ms=0)),
        "pending-ttl-over-an-hour": Hit(
            (), replace(ok_claim, pending_ttl_ms=_MAX_PENDING_TTL_MS + 1)
        ),
        "settle-empty-hook-id": Settle(replace(ok_claim, hook_id=""), COMMIT),
        "settle-node-too-long": Settle(replace(ok_claim, node="n" * 257), RELEASE),
    }
    for name, op in cases.items():
        try:
            validate(op)
            local = None
        except InvalidRequest as e:
            local = e.invalid
        reply = await unchecked.request(op, timeout_ms=budget)
        body = reply.body
        node = body.invalid if isinstance(body, ErrorReply) else reply_view(reply)
        emit(f"agree-{name}", local=local, node=node)

    # An edge configured with another shard count: the node says wrong_shard.
    if args.shards > 1:
        other = args.shards // 2
        n = next(
            i
            for i in range(10_000)
            if shard_of(f"{p}-ws-{i}", other) != shard_of(f"{p}-ws-{i}", args.shards)
        )
        wrong = EdgeClient(nc, args.instance, other, compact=args.compact)
        ws_tenant = f"{p}-ws-{n}"
        await run("wrong-shard", wrong.reset(ws_tenant, timeout_ms=budget), tenant=ws_tenant)

    # A key the other edge (the Rust one, in the test) committed.
    if args.foreign_key:
        await run(
            "foreign-duplicate",
            edge.hit(roomy, claim(args.foreign_key, f"{p}-h9"), timeout_ms=budget),
            key=args.foreign_key,
        )

    # No node on the subject: resent with a doubling pause until the budget is
    # spent, then NoResponders, within the budget.
    void_instance = f"{args.instance}-void"[:64]
    void = EdgeClient(nc, void_instance, args.shards, compact=args.compact)
    await run("no-responders", void.reset("acme", timeout_ms=300), budget_ms=300)

    # §9, degrading: the fleet answers while it can; on an instance nobody
    # serves, this process's own state does, and the breaker stops trying.
    async def answered(step: str, call) -> None:
        try:
            answer = await call
        except StoreError as e:
            emit(step, error=_error_view(e))
        else:
            outcome = outcome_view(answer.outcome)
            emit(step, outcome=outcome, source=answer.source, reason=answer.reason)

    kd, kl = f"{p}-evt-d", f"{p}-evt-l"
    live = DegradingEdge(edge)
    await answered("degrade-fleet-hit", live.hit(roomy, claim(kd, h1), timeout_ms=budget))
    await answered("degrade-fleet-commit", live.settle(claim(kd, h1), COMMIT, timeout_ms=budget))
    # A budget the contract does not allow is the caller's error, raised,
    # never an outage answered locally and counted against the breaker: five
    # such failures would open it.
    refused = 0
    for bad in (0, -1, -5, -1000, 2**64):
        try:
            await live.hit(roomy, timeout_ms=bad)
        except ValueError:
            refused += 1
    emit("degrade-bad-budget", refused=refused, breaker=live.breaker.state)
    out = DegradingEdge(void, breaker=CircuitBreaker(failure_threshold=2, base_backoff_s=60))
    await answered("degrade-out-hit", out.hit(roomy, claim(kl, h1), timeout_ms=100))
    # The key the fleet committed is unknown here: accepted again (a
    # duplicate delivery, never a lost one).
    await answered("degrade-out-fleet-key", out.hit(roomy, claim(kd, h2), timeout_ms=100))
    await answered("degrade-out-breaker", out.hit(roomy, timeout_ms=100))
    await answered("degrade-out-commit", out.settle(claim(kl, h1), COMMIT, timeout_ms=100))
    await answered("degrade-out-duplicate", out.hit(roomy, claim(kl, h3), timeout_ms=100))
    await answered("degrade-out-fleet-settle", out.settle(claim(kd, h1), COMMIT, timeout_ms=100))
    await answered("degrade-out-nothing", out.hit([], timeout_ms=100))
    emit("degrade-out-state", breaker=out.breaker.state, tenants=len(out.local))

    # A shard nobody serves at first, then a stand-in responder that answers
    # ok: the resends find it, each with the budget left at its sending.
    moving = EdgeClient(nc, f"{args.instance}-moving"[:64], args.shards, compact=args.compact)
    seen: list = []

    async def answer(msg: Any) -> None:
        seen.append(msgpack.unpackb(msg.data, raw=False))
        reply = {"v": 1, "body": {"hit": {"result": "ok"}}, "node": "stand-in"}
        await nc.publish(msg.reply, msgpack.packb(reply, use_bin_type=True))

    async def subscribe_later() -> Any:
        await asyncio.sleep(0.1)
        sub = await nc.subscribe(moving.subject("acme"), cb=answer)
        await nc.flush()
        return sub

    later = asyncio.ensure_future(subscribe_later())
    await run(
        "no-responders-then-answer",
        moving.hit([Charge(HOOKS, "acme", 1, 1)], timeout_ms=1_000),
        budget_ms=1_000,
    )
    await (await later).unsubscribe()
    # Compact requests are arrays: [v, timeout_ms, op].
    sent_budgets = [m[1] if isinstance(m, list) else m["timeout_ms"] for m in seen]
    emit("no-responders-then-answer-sent", budgets_ms=sent_budgets)

    # What a batch is on the wire: three calls for one shard leave as one
    # message of three items, and each item's answer (here a stand-in's) is
    # given back in its own slot.
    wire = EdgeClient(nc, f"{args.instance}-wire"[:64], args.shards, compact=args.compact)
    messages: list = []
    answers = [
        {"v": 1, "body": {"hit": {"result": "ok"}}},
        {"v": 1, "body": {"hit": {"result": "duplicate", "hook_id": "stand-in-h"}}},
        {"v": 1, "body": {"error": {"code": "unavailable", "message": "stand-in"}}},
    ]

    async def answer_batch(msg: Any) -> None:
        request = msgpack.unpackb(msg.data, raw=False)
        messages.append((request, len(msg.data)))
        op = request[2] if isinstance(request, list) else request["op"]
        items = len(op["batch"])
        body = answers if items == len(answers) else [answers[0]] * items
        reply = {"v": 1, "body": {"batch": body}}
        await nc.publish(msg.reply, msgpack.packb(reply, use_bin_type=True))

    stand_in = await nc.subscribe(wire.subject(tenant), cb=answer_batch)
    await nc.flush()
    three = [Hit((Charge(HOOKS, tenant, 1, 1),), claim(f"{p}-w{i}", h1)) for i in range(3)]
    results = await wire.batch(three, timeout_ms=budget)

    def sent() -> dict:
        # Compact requests are arrays: [v, timeout_ms, op].
        ops = [m[2] if isinstance(m, list) else m["op"] for m, _ in messages]
        return {
            "messages": len(messages),
            "items": [len(op["batch"]) if "batch" in op else 0 for op in ops],
            "bytes": [size for _, size in messages],
        }

    emit(
        "batch-wire",
        **sent(),
        results=views(results),
    )
    # More than one message holds (70 keys of 1,000 bytes): split, every
    # part within MAX_REQUEST_BYTES, every item answered.
    messages.clear()
    big = [Hit((), claim(f"{p}-{i:03}-" + "k" * 990, h1)) for i in range(70)]
    results = await wire.batch(big, timeout_ms=budget)
    await stand_in.unsubscribe()
    emit(
        "batch-split",
        **sent(),
        results=views(results),
    )

    # Batches to nodes (§5.5), against stand-ins: node n1 serves the home
    # shard; the other shard's subject answers naming its node of the moment.
    nodes = EdgeClient(nc, f"{args.instance}-nodes"[:64], args.shards, compact=args.compact)
    if args.shards > 1:
        home = shard_of(tenant, args.shards)
        away = next(
            f"{p}-n{i}" for i in range(10_000) if shard_of(f"{p}-n{i}", args.shards) != home
        )
        serving = {"away": "n1"}
        routed: list = []
        ok = {"hit": {"result": "ok"}}
        wrong_node = {"error": {"code": "wrong_node", "message": "stand-in"}}

        def ops_of(msg: Any) -> tuple:
            """A request's ops, and whether it is a batch."""
            op, _, _ = _request_from_view(msgpack.unpackb(msg.data, raw=False))
            if isinstance(op, Batch):
                return [item for item, _ in op.items], True
            return [op], False

        def at_home(op: Op) -> bool:
            return shard_of(op.tenant, args.shards) == home

        async def shard_stand_in(msg: Any) -> None:
            ops, is_batch = ops_of(msg)
            routed.append(f"shard:{len(ops)}")
            body = {"batch": [{"v": 1, "body": ok} for _ in ops]} if is_batch else ok
            node = "n1" if at_home(ops[0]) else serving["away"]
            reply = {"v": 1, "node": node, "body": body}
            await nc.publish(msg.reply, msgpack.packb(reply, use_bin_type=True))

        async def node_stand_in(msg: Any) -> None:
            ops, _ = ops_of(msg)
            routed.append(f"node:{len(ops)}")
            body = [{"v": 1, "body": ok if at_home(op) else wrong_node} for op in ops]
            await nc.publish(msg.reply, msgpack.packb({"v": 1, "body": {"batch": body}}))

        shard_subs = await nc.subscribe(f"ankusa.{nodes.instance}.shard.*", cb=shard_stand_in)
        node_sub = await nc.subscribe(nodes.node_subject("n1"), cb=node_stand_in)
        await nc.flush()
        one = (Charge(HOOKS, tenant, 1, 1),)
        one_away = (Charge(HOOKS, away, 1, 1),)

        # Both shards learned as n1's; then the away shard moves to n3. One
        # message to n1, whose item for the shard it no longer serves goes
        # again to that shard's subject, whose reply names n3.
        await nodes.hit(one, timeout_ms=budget)
        await nodes.hit(one_away, timeout_ms=budget)
        learned = sorted(nodes.known_nodes().values())
        serving["away"] = "n3"
        routed.clear()
        results = await nodes.batch([Hit(one), Hit(one_away), Hit(one)], timeout_ms=budget)
        emit(
            "batch-nodes-wrong-node",
            learned=learned,
            routed=list(routed),
            known_after=sorted(nodes.known_nodes().values()),
            results=views(results),
        )
        # n3 has gone (no responders on its subject) and n4 took the shard:
        # the item goes to its shard's subject, and n4 is learned.
        serving["away"] = "n4"
        routed.clear()
        results = await nodes.batch([Hit(one), Hit(one_away)], timeout_ms=budget)
        emit(
            "batch-nodes-gone",
            routed=sorted(routed),
            known_after=sorted(nodes.known_nodes().values()),
            results=views(results),
        )
        await shard_subs.unsubscribe()
        await node_sub.unsubscribe()

    # Concurrent hits and settles share messages (the client's batching), each
    # answered as if sent alone: 150 fresh claims over 5 tenants, their
    # commits, then the same keys again. A watcher counts the requests.
    sent_requests: list = []

    async def watch(msg: Any) -> None:
        sent_requests.append(msg.subject)

    watcher = await nc.subscribe(f"ankusa.{args.instance}.*.*", cb=watch)
    await nc.flush()
    auto = EdgeClient(nc, args.instance, args.shards, compact=args.compact)

    def auto_claim(i: int) -> Claim:
        return Claim(f"{p}-auto{i % 5}", args.source, f"{p}-auto-{i}", f"{p}-ha{i}",
                     f"{p}-edge", 600_000, 30_000)

    def auto_charges(i: int) -> list:
        return [Charge(HOOKS, f"{p}-auto{i % 5}", 1_000, 1_000_000_000)]

    rounds = {
        "hits": lambda i: auto.hit(auto_charges(i), auto_claim(i), timeout_ms=budget),
        "commits": lambda i: auto.settle(auto_claim(i), COMMIT, timeout_ms=budget),
        "again": lambda i: auto.hit(auto_charges(i), auto_claim(i), timeout_ms=budget),
    }
    for name, call in rounds.items():
        sent_requests.clear()
        results = await asyncio.gather(*(call(i) for i in range(150)), return_exceptions=True)
        await nc.flush()
        views_seen: dict = {}
        for r in results:
            view = json.dumps(_error_view(r) if isinstance(r, StoreError) else outcome_view(r))
            views_seen[view] = views_seen.get(view, 0) + 1
        emit(f"auto-batch-{name}", calls=150, messages=len(sent_requests),
             outcomes=views_seen, key=f"{p}-auto-7", tenant=f"{p}-auto2")
    await watcher.unsubscribe()

    # A subscriber that never answers: Timeout at the budget.
    silent = EdgeClient(nc, f"{args.instance}-silent"[:64], args.shards, compact=args.compact)
    mute = await nc.subscribe(silent.subject("acme"))
    await nc.flush()
    await run("timeout", silent.reset("acme", timeout_ms=200), budget_ms=200)
    # A call queued behind one in flight keeps its own, shorter budget (hits:
    # resets are never queued, they go alone).
    acme = [Charge(HOOKS, "acme", 1, 1)]
    first = asyncio.ensure_future(
        run("timeout-in-flight", silent.hit(acme, timeout_ms=300), budget_ms=300)
    )
    await asyncio.sleep(0)
    await run("timeout-queued", silent.hit(acme, timeout_ms=100), budget_ms=100)
    await first
    await mute.unsubscribe()


def cmd_local_replay() -> int:
    """Applies requests to a ``LocalStore`` at given times: each stdin line
    is ``{"at_us": unix µs, "request": a request's JSON view (§10)}``, each
    stdout line the outcome's view, or ``{"invalid": reason}``."""
    now = [0]
    store = LocalStore(clock=lambda: now[0])
    for line in sys.stdin.read().split("\n"):
        if not line.strip():
            continue
        entry = json.loads(line)
        now[0] = entry["at_us"]
        op, _, _ = _request_from_view(entry["request"])
        try:
            validate(op)
        except InvalidRequest as e:
            print(json.dumps({"invalid": e.invalid}))
            continue
        if isinstance(op, Hit):
            outcome = store.hit(op)
        elif isinstance(op, Settle):
            outcome = store.settle(op)
        else:
            outcome = store.reset(op.tenant)
        print(json.dumps(outcome_view(outcome)))
    return 0


class _FakeNats:
    """A NATS connection with no server, for the self-test: ``answer(subject,
    request)`` gives each request's reply record, an exception to raise, or
    None for no reply (the request then waits until its caller gives up).
    Requests wait while ``gate`` is clear; ``sent`` keeps each one's
    (subject, decoded request, timeout)."""

    def __init__(self, answer: Callable[[str, Any], Any]):
        self.answer = answer
        self.sent: list = []
        self.is_connected = True
        self.last_error = None
        self.gate = asyncio.Event()
        self.gate.set()

    async def request(self, subject: str, payload: bytes, timeout: float) -> Any:
        request = msgpack.unpackb(payload, raw=False)
        self.sent.append((subject, request, timeout))
        await self.gate.wait()
        reply = self.answer(subject, request)
        if reply is None:
            await asyncio.get_running_loop().create_future()  # never set
        if isinstance(reply, BaseException):
            raise reply
        return types.SimpleNamespace(data=msgpack.packb(reply, use_bin_type=True))


def _op_names(request: dict) -> list:
    """The operations a map-form request carries: its own, or its items'."""
    op = request["op"]
    ops = [item["op"] for item in op["batch"]] if "batch" in op else [op]
    return [name for o in ops for name in o]


def _ok_reply(request: dict, node: str | None = None) -> dict:
    """A stand-in node's reply to a map-form ``request`` when all goes well."""
    op = request["op"]
    if "batch" in op:
        body: Any = {"batch": [_ok_reply(item) for item in op["batch"]]}
    elif "reset" in op:
        body = "reset"
    elif "inspect" in op:
        body = {"inspect": {"buckets": [], "claims_held": 0, "claim": None}}
    else:
        body = {name: {"result": "ok"} for name in op}
    reply = {"v": PROTOCOL_VERSION, "body": body}
    if node is not None:
        reply["node"] = node
    return reply


def _before_inspect(subject: str, request: dict) -> dict:
    """A node from before ``inspect``: any request holding one is malformed."""
    if "inspect" in _op_names(request):
        error = {"code": "malformed", "message": "unknown variant `inspect`"}
        return {"v": PROTOCOL_VERSION, "body": {"error": error}}
    return _ok_reply(request)


async def _settled(call: Any) -> Any:
    """A call's outcome, or the ``StoreError`` it raised."""
    try:
        return await call
    except StoreError as e:
        return e


_ONE = (Charge(HOOKS, "selftest", 1, 1_000_000),)


async def _check_inspect_and_reset_alone() -> bool:
    """a reset and an inspect go alone, never in a batch a node before inspect refuses"""
    nc = _FakeNats(_before_inspect)
    client = EdgeClient(nc, "selftest", 4)
    nc.gate.clear()
    first = asyncio.ensure_future(client.hit(_ONE, timeout_ms=1_000))
    await asyncio.sleep(0)  # in flight: the calls below queue behind it
    later = [
        asyncio.ensure_future(_settled(call))
        for call in (
            client.hit(_ONE, timeout_ms=1_000),
            client.inspect("selftest", timeout_ms=1_000),
            client.reset("selftest", timeout_ms=1_000),
        )
    ]
    await asyncio.sleep(0)
    nc.gate.set()
    await first
    hit, inspect, reset = await asyncio.gather(*later)
    batched = [n for _, r, _ in nc.sent if "batch" in r["op"] for n in _op_names(r)]
    return (
        hit == HitOk()
        and isinstance(inspect, MalformedRequest)
        and reset == ResetDone()
        and "inspect" not in batched
        and "reset" not in batched
    )


async def _check_forgets_silent_node() -> bool:
    """a node that does not answer a batch is forgotten for every shard"""
    def answer(subject: str, request: dict) -> Any:
        if ".node." in subject:
            return nats.errors.TimeoutError()
        return _ok_reply(request, node="n1")

    client = EdgeClient(_FakeNats(answer), "selftest", 4)
    await client.hit(_ONE, timeout_ms=1_000)
    learned = client.known_nodes()
    results = await client.batch([Hit(_ONE), Hit(_ONE)], timeout_ms=1_000)
    timed_out = all(isinstance(r, Timeout) for r in results)
    return learned == {shard_of("selftest", 4): "n1"} and timed_out and not client.known_nodes()


async def _check_early_alarm() -> bool:
    """a call's timers, and the budget it sends, end 2 ms before its deadline"""
    loop = asyncio.get_running_loop()
    nc = _FakeNats(lambda subject, request: None)
    client = EdgeClient(nc, "selftest", 4)
    whens: list = []
    call_at = loop.call_at

    def recording(when: float, *args: Any, **kwargs: Any) -> Any:
        whens.append(when)
        return call_at(when, *args, **kwargs)

    loop.call_at = recording  # type: ignore[method-assign]
    spans = []
    try:
        # A hit (batched, a timer on its future) and a reset (alone, wait_for).
        for call in (
            lambda: client.hit(_ONE, timeout_ms=100),
            lambda: client.reset("selftest", timeout_ms=100),
        ):
            whens.clear()
            start = loop.time()
            result = await _settled(call())
            spans.append(isinstance(result, Timeout) and max(whens) - start <= 0.0985)
    finally:
        del loop.call_at
    sent = [(r["timeout_ms"], timeout) for _, r, timeout in nc.sent]
    return all(spans) and len(sent) == 2 and all(ms <= 98 and t <= 0.0985 for ms, t in sent)


async def _check_budget_too_small_for_fleet() -> bool:
    """DegradingEdge keeps a reserve under 10 ms, and a budget with no room
    for the fleet is not an outage"""
    nc = _FakeNats(lambda subject, request: _ok_reply(request))
    edge = DegradingEdge(
        EdgeClient(nc, "selftest", 4), breaker=CircuitBreaker(failure_threshold=1)
    )
    budgets = [edge._budget(t) for t in (1, 2, 3, 5, 10, 11, 100)]
    answer = await edge.hit(_ONE, timeout_ms=1)
    return (
        budgets == [0, 0, 2, 4, 9, 10, 99]
        and (answer.source, answer.reason) == ("local", "timeout")
        and edge.breaker.state == "closed"
        and not nc.sent
    )


async def _check_item_out_of_time() -> bool:
    """a batch item with under 1 ms left times out here, left out of the message"""
    nc = _FakeNats(lambda subject, request: _ok_reply(request))
    client = EdgeClient(nc, "selftest", 4)
    now = asyncio.get_running_loop().time()
    results: list = [None, None]
    await client._carry_out([Hit(_ONE), Hit(_ONE)], [now + 0.0005, now + 1.0], [0, 1], results)
    sent = [item["timeout_ms"] for _, r, _ in nc.sent for item in r["op"]["batch"]]
    return isinstance(results[0], Timeout) and results[1] == HitOk() and len(sent) == 1


async def _check_empty_hit_in_batch() -> bool:
    """an empty hit in a batch is HitOk, sent nowhere, as hit() answers it"""
    nc = _FakeNats(lambda subject, request: _ok_reply(request))
    client = EdgeClient(nc, "selftest", 4)
    results = await client.batch([Hit()], timeout_ms=100)
    return results == [HitOk()] and not nc.sent


class _OwnHit(Hit):
    """A caller's own kind of hit."""


async def _check_subclass_in_batch() -> bool:
    """a subclass of Hit in a batch is a hit"""
    client = EdgeClient(_FakeNats(lambda subject, request: _ok_reply(request)), "selftest", 4)
    return await client.batch([_OwnHit(_ONE)], timeout_ms=1_000) == [HitOk()]


def cmd_self_test() -> int:
    """Checks of the parts no fleet is needed for: the breaker's transitions
    on a clock that moves when told, the local store's bounds, and the
    client's routing, batching and budgets over a stand-in NATS connection.
    One line per check; exit 1 if any failed."""
    failed = 0

    def check(ok: bool, what: str) -> None:
        nonlocal failed
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {what}")

    def attempt(what: str, run: Callable[[], bool]) -> None:
        """A check that a bug could make raise: raising is failing."""
        try:
            ok = run()
        except Exception as e:
            ok, what = False, f"{what} (raised {e!r})"
        check(ok, what)

    now = [0.0]
    b = CircuitBreaker(
        failure_threshold=3, base_backoff_s=1.0, max_backoff_s=4.0, clock=lambda: now[0]
    )

    def calls(*up: bool) -> None:
        for result in up:
            permit = b.admit()
            if permit is not None:
                b.record(result, permit.probe)

    calls(False, False)
    check(b.state == "closed", "two outages of three keep the breaker closed")
    calls(True, False, False)
    check(b.state == "closed", "a success starts the count again")
    calls(False)
    check(b.state == "open" and b.admit() is None, "the third outage in a row opens it")
    now[0] = 0.999
    check(b.admit() is None, "it stays open for the backoff")
    now[0] = 1.0
    probe = b.admit()
    check(probe is not None and probe.probe and b.state == "half_open", "then one call probes")
    check(b.admit() is None, "and only one")
    b.abandon(probe.probe)
    probe = b.admit()
    check(probe is not None and probe.probe, "a probe that ended with no result passes its turn on")
    b.record(False, probe.probe)
    now[0] = 2.999
    check(b.admit() is None, "a failed probe reopens it for twice the backoff")
    now[0] = 3.0
    calls(False)
    now[0] = 6.999
    check(b.admit() is None, "doubling again")
    now[0] = 7.0
    calls(False)
    now[0] = 10.999
    check(b.admit() is None, "open for the longest backoff after a third failed probe")
    now[0] = 11.0
    probe = b.admit()
    check(probe is not None, "and no longer: the backoff stops doubling at its longest")
    b.record(True, probe.probe)
    check(b.state == "closed" and b.admit() is not None, "a good probe closes it")
    calls(True, False, False, False)
    now[0] = 12.0
    check(b.admit() is not None, "and the backoff starts again from the first")

    # Results of calls let through before the breaker opened come in late.
    late = CircuitBreaker(failure_threshold=2, base_backoff_s=1.0, clock=lambda: now[0])
    early = [late.admit() for _ in range(5)]
    late.record(False, early[0].probe)
    late.record(False, early[1].probe)
    late.record(True, early[2].probe)
    check(
        late.state == "open" and late.admit() is None,
        "a late success of a call let through before it opened does not close it",
    )
    now[0] += 1.0
    probe = late.admit()
    late.record(False, early[3].probe)
    late.record(True, early[4].probe)
    check(
        probe is not None and probe.probe and late.state == "half_open" and late.admit() is None,
        "nor do late results take the probe's place",
    )
    late.record(True, probe.probe)
    check(late.state == "closed", "the probe's own success closes it")

    clock = [1_000_000]
    store = LocalStore(max_tenants=8, clock=lambda: clock[0])
    tight = [Charge(HOOKS, "t0", 1_000_000, 1_000_000)]
    store.hit(Hit(tuple(tight)))
    for i in range(1, 20):
        store.hit(Hit((Charge(HOOKS, f"t{i}", 1, 1_000_000),)))
        if i % 4 == 0:  # t0 stays the most recently used
            store.hit(Hit(tuple(tight)))
    check(len(store) <= 8, f"at most 8 tenants kept ({len(store)})")
    check(isinstance(store.hit(Hit(tuple(tight))), RateLimited), "a recently used tenant is kept")
    claim = Claim("t0", "s", "k", "h", "e", 1, 1)
    store.hit(Hit((), claim))
    clock[0] += 1_000
    check(store.sweep() == 1 and not store.holds_claim("t0", "s", "k"), "expired claims are swept")

    capped = LocalStore(max_tenant_claims=2, clock=lambda: clock[0])
    for key in ("a", "b"):
        capped.hit(Hit((), Claim("t", "s", key, "h1", "e", 60_000, 60_000)))
    capped.settle(Settle(Claim("t", "s", "a", "h1", "e", 60_000, 60_000), COMMIT))
    check(
        capped.hit(Hit((), Claim("t", "s", "c", "h1", "e", 1, 1))) == Pending(_CLAIMS_FULL_RETRY_MS)
        and not capped.holds_claim("t", "s", "c"),
        "a tenant at its claim cap is told pending for a new key, and nothing is claimed",
    )
    check(
        capped.hit(Hit((), Claim("t", "s", "a", "h2", "e", 1, 1))) == Duplicate("h1")
        and capped.hit(Hit((), Claim("u", "s", "c", "h1", "e", 1, 1))) == HitOk(),
        "a key held at the cap is answered as always, and another tenant has its own room",
    )

    # One busy tenant, a claim of 1 ms a millisecond: swept as it goes.
    busy = LocalStore(clock=lambda: clock[0])
    for i in range(2_000):
        clock[0] += 1_000
        busy.hit(Hit((), Claim("busy", "s", f"k{i}", "h", "e", 1, 1)))
    left = busy.sweep()
    check(left < 2 * _SWEEP_EVERY, f"a busy tenant's expired claims go as it works ({left} left)")

    # A tenant of many expired claims is swept a step at a time.
    big = LocalStore(clock=lambda: clock[0])
    for i in range(3 * _SWEEP_STEP):
        big.hit(Hit((), Claim("big", "s", f"k{i}", "h", "e", 1, 1)))
    clock[0] += 10_000
    tenant = big._tenants["big"]
    tenant.to_sweep = []  # a pass begun while the claims were live is not this one
    dropped = [LocalStore._drop_expired_step(tenant, clock[0]) for _ in range(4)]
    check(
        dropped == [_SWEEP_STEP] * 3 + [0] and not tenant.claims,
        f"a large claim table is swept a step at a time ({dropped})",
    )

    # A full store makes room looking at a few tenants, not at them all.
    full = LocalStore(max_tenants=4_096, clock=lambda: clock[0])
    for i in range(4_096):
        full.hit(Hit((Charge(HOOKS, f"f{i}", 1_000_000, 1_000_000),)))
    visits = [0]
    is_empty = _LocalTenant.is_empty

    def counted(tenant: _LocalTenant, now_us: int) -> bool:
        visits[0] += 1
        return is_empty(tenant, now_us)

    _LocalTenant.is_empty = counted  # type: ignore[method-assign]
    try:
        full.hit(Hit((Charge(HOOKS, "newcomer", 1, 1_000_000),)))
    finally:
        _LocalTenant.is_empty = is_empty  # type: ignore[method-assign]
    check(
        visits[0] <= _ROOM_SCAN + _SWEEP_BATCH and len(full) <= 4_096,
        f"a full store of 4,096 makes room looking at {visits[0]} of them",
    )

    def degrading_sweep() -> bool:
        nc = _FakeNats(lambda subject, request: None)
        local = LocalStore(clock=lambda: clock[0])
        edge = DegradingEdge(EdgeClient(nc, "selftest", 4), local=local)
        edge.local.hit(Hit((), claim))
        clock[0] += 1_000
        return edge.sweep() == 1

    attempt("DegradingEdge.sweep sweeps its local store", degrading_sweep)

    # The client over a stand-in connection: each check's docstring says
    # what it checks.
    client_checks = (
        _check_inspect_and_reset_alone,
        _check_forgets_silent_node,
        _check_early_alarm,
        _check_budget_too_small_for_fleet,
        _check_item_out_of_time,
        _check_empty_hit_in_batch,
        _check_subclass_in_batch,
    )

    async def run_client_checks() -> None:
        for run in client_checks:
            what = " ".join(run.__doc__.split())
            try:
                ok = await run()
            except Exception as e:
                ok, what = False, f"{what} (raised {e!r})"
            check(ok, what)

    asyncio.run(run_client_checks())
    print(f"self-test: {failed} failed")
    return 1 if failed else 0


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    vectors = sub.add_parser(
        "vectors", help="check the encoder and decoder against the test vectors of docs/protocol.md"
    )
    vectors.add_argument("protocol_md")
    shard = sub.add_parser("shard", help="print tenants' shards")
    shard.add_argument(
        "--shards", required=True, help="shard counts, comma-separated: one column each"
    )
    shard.add_argument("tenants", nargs="*", help="JSON string literals; none: one a line on stdin")
    scenario = sub.add_parser(
        "scenario", help="run a scripted sequence against a live fleet, one JSON line per step"
    )
    scenario.add_argument("--nats", required=True, help="NATS server URL")
    scenario.add_argument("--instance", required=True)
    scenario.add_argument("--shards", type=int, required=True)
    scenario.add_argument("--prefix", default="py", help="prefix of every tenant, key and hook")
    scenario.add_argument("--tenant", help="the main tenant (default PREFIX-acme)")
    scenario.add_argument("--source", default="src", help="source_id of every claim")
    scenario.add_argument(
        "--foreign-key",
        help="a key another edge committed under the main tenant and source: expected duplicate",
    )
    scenario.add_argument("--timeout-ms", type=int, default=2_000, help="budget of each call")
    scenario.add_argument("--compact", action="store_true", help="send the compact form")
    bench = sub.add_parser(
        "bench", help="drive a live fleet with hits and commits; print calls/s and latencies"
    )
    bench.add_argument("--nats", required=True, help="NATS server URL")
    bench.add_argument("--instance", default="default")
    bench.add_argument("--shards", type=int, required=True)
    bench.add_argument("--calls", type=int, default=20_000, help="hits to send (at most)")
    bench.add_argument("--concurrency", type=int, default=256, help="calls in flight")
    bench.add_argument("--tenants", type=int, default=100)
    bench.add_argument("--timeout-ms", type=int, default=1_000, help="budget of each call")
    bench.add_argument("--no-batching", action="store_true", help="send every call alone")
    sub.add_parser(
        "self-test",
        help="check the breaker, the local store and the client on fake clocks and connections",
    )
    sub.add_parser(
        "local-replay",
        help="apply timed requests (JSON lines on stdin) to a LocalStore, one outcome a line",
    )
    args = parser.parse_args(argv)
    if args.command == "vectors":
        return cmd_vectors(args.protocol_md)
    if args.command == "shard":
        counts = [int(s) for s in args.shards.split(",")]
        return cmd_shard(counts, [json.loads(t) for t in args.tenants])
    if args.command == "local-replay":
        return cmd_local_replay()
    if args.command == "self-test":
        return cmd_self_test()
    if args.command == "bench":
        return asyncio.run(cmd_bench(args))
    return asyncio.run(cmd_scenario(args))


if __name__ == "__main__":
    sys.exit(main())
