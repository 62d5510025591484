//! The contract's vocabulary: charges, claims, requests and their outcomes, and the
//! limits every request is validated against.
//!
//! These types are also the wire and persistence format (see `docs/protocol.md`),
//! so every serde name here is part of the protocol and must not change.

use serde::{Deserialize, Serialize};

/// Limits on what a request may carry. A request past any of them is refused with
/// an [`InvalidRequest`] by the edge client and again by the node.
pub mod limits {
    /// Bytes of a tenant name.
    pub const MAX_TENANT: usize = 256;
    /// Bytes of a claim's `source_id`.
    pub const MAX_SOURCE_ID: usize = 256;
    /// Bytes of a claim's provider event `key`.
    pub const MAX_KEY: usize = 1024;
    /// Bytes of a `hook_id`.
    pub const MAX_HOOK_ID: usize = 256;
    /// Bytes of a node name.
    pub const MAX_NODE: usize = 256;
    /// Charges in one hit: one per bucket kind.
    pub const MAX_CHARGES: usize = 2;
    /// A bucket's capacity (and so its increment): one year, in µs.
    pub const MAX_CAPACITY_US: u64 = 365 * 24 * 3600 * 1_000_000;
    /// How long a committed claim may be kept: 90 days.
    pub const MAX_TTL_MS: u64 = 90 * 24 * 3600 * 1000;
    /// How long a claim may stay pending: one hour.
    pub const MAX_PENDING_TTL_MS: u64 = 3600 * 1000;
}

/// The two bucket kinds a tenant has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Hooks,
    Bytes,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Hooks, Kind::Bytes];

    /// The kind's name on the wire, in logs and in keys.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hooks => "hooks",
            Kind::Bytes => "bytes",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Kind::Hooks => 0,
            Kind::Bytes => 1,
        }
    }
}

/// One bucket to charge: GCRA `increment_us` against `capacity_us`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    pub kind: Kind,
    pub tenant: String,
    pub increment_us: u64,
    pub capacity_us: u64,
}

/// A provider event key to claim, scoped by `tenant` and `source_id`, claimed by
/// `hook_id` on `node`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub tenant: String,
    pub source_id: String,
    pub key: String,
    pub hook_id: String,
    pub node: String,
    pub ttl_ms: u64,
    pub pending_ttl_ms: u64,
}

/// Charge every bucket and, when `claim` is set, claim its key, all or nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HitRequest {
    pub charges: Vec<Charge>,
    pub claim: Option<Claim>,
}

/// What a hit answers (the contract's `result()` less `{:error, _}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum HitOutcome {
    /// Every charge taken; the claim, if any, is this hook's and pending.
    Ok,
    /// The key is committed by `hook_id`: the hook was already stored.
    Duplicate { hook_id: String },
    /// The key is claimed by a hook still in flight; retry later.
    Pending { retry_after_ms: u64 },
    /// A charge was denied; nothing was written.
    RateLimited { retry_after_ms: u64 },
}

/// How a claim is settled once its node knows the hook's fate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Settlement {
    /// The hook is durable: keep the key committed for the claim's `ttl_ms`.
    Commit,
    /// The hook was not stored: free the key.
    Release,
}

/// Settle the claim `claim.hook_id` holds on its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettleRequest {
    pub claim: Claim,
    pub settlement: Settlement,
}

/// What a settle answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum SettleOutcome {
    /// Done (also for a repeated commit of a committed claim).
    Ok,
    /// No live claim on the key: never made, released, or expired.
    NotFound,
    /// Another hook holds the key; nothing changed.
    NotOwner { hook_id: String },
    /// A release of a claim that is already committed; nothing changed.
    AlreadyCommitted,
}

/// A provider event key, as a claim names it: `key` within `source_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventKey {
    pub source_id: String,
    pub key: String,
}

/// Forget one tenant's buckets (its claims stay): the contract's `reset`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetRequest {
    pub tenant: String,
}

/// Read one tenant's state without changing anything: its buckets and, when
/// `claim` names an event key, the claim on it. Not part of the contract: it
/// answers an operator's "why is this tenant limited?" and "who holds this key?".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InspectRequest {
    pub tenant: String,
    pub claim: Option<EventKey>,
}

/// What a node holds for one tenant, read at one instant of its clock.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantView {
    /// The buckets that are not full; a kind not listed is full.
    pub buckets: Vec<BucketView>,
    /// Claims the tenant holds, counting expired ones not yet swept.
    pub claims_held: u64,
    /// The live claim on the key asked about, if any.
    pub claim: Option<ClaimView>,
}

/// One bucket that is not full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketView {
    pub kind: Kind,
    /// How far the bucket's TAT is ahead of now, µs: a charge of
    /// `increment_us` against `capacity_us` passes while
    /// `ahead_us + increment_us <= capacity_us`.
    pub ahead_us: u64,
}

/// A live claim on one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ClaimView {
    /// `hook_id` on `node` is in flight: hits on the key answer `Pending`.
    Pending {
        hook_id: String,
        node: String,
        expires_in_ms: u64,
    },
    /// `hook_id` is stored: hits on the key answer `Duplicate`.
    Committed { hook_id: String, expires_in_ms: u64 },
}

/// Why a request was refused before it touched any state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum InvalidRequest {
    #[error("field `{field}` is empty")]
    Empty { field: String },
    #[error("field `{field}` is {len} bytes, over the limit of {max}")]
    TooLong {
        field: String,
        len: usize,
        max: usize,
    },
    #[error("a hit needs at least one charge or a claim")]
    NothingToDo,
    #[error("{count} charges, over the limit of {max}")]
    TooManyCharges { count: usize, max: usize },
    #[error("bucket `{kind:?}` is charged twice in one hit")]
    DuplicateBucket { kind: Kind },
    #[error("every charge and the claim must name the same tenant")]
    MixedTenants,
    #[error("`{field}` must be at least 1")]
    Zero { field: String },
    #[error("increment {increment_us} µs exceeds capacity {capacity_us} µs: the charge could never pass")]
    IncrementExceedsCapacity { increment_us: u64, capacity_us: u64 },
    #[error("`{field}` is {value}, over the limit of {max}")]
    OutOfRange { field: String, value: u64, max: u64 },
}

fn check_text(field: &str, value: &str, max: usize) -> Result<(), InvalidRequest> {
    if value.is_empty() {
        return Err(InvalidRequest::Empty {
            field: field.into(),
        });
    }
    if value.len() > max {
        return Err(InvalidRequest::TooLong {
            field: field.into(),
            len: value.len(),
            max,
        });
    }
    Ok(())
}

fn check_range(field: &str, value: u64, max: u64) -> Result<(), InvalidRequest> {
    if value == 0 {
        return Err(InvalidRequest::Zero {
            field: field.into(),
        });
    }
    if value > max {
        return Err(InvalidRequest::OutOfRange {
            field: field.into(),
            value,
            max,
        });
    }
    Ok(())
}

/// Checks a tenant name on its own (as `reset` takes it).
pub fn validate_tenant(tenant: &str) -> Result<(), InvalidRequest> {
    check_text("tenant", tenant, limits::MAX_TENANT)
}

impl Charge {
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        validate_tenant(&self.tenant)?;
        check_range("capacity_us", self.capacity_us, limits::MAX_CAPACITY_US)?;
        check_range("increment_us", self.increment_us, limits::MAX_CAPACITY_US)?;
        if self.increment_us > self.capacity_us {
            return Err(InvalidRequest::IncrementExceedsCapacity {
                increment_us: self.increment_us,
                capacity_us: self.capacity_us,
            });
        }
        Ok(())
    }
}

impl Claim {
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        validate_tenant(&self.tenant)?;
        check_text("source_id", &self.source_id, limits::MAX_SOURCE_ID)?;
        check_text("key", &self.key, limits::MAX_KEY)?;
        check_text("hook_id", &self.hook_id, limits::MAX_HOOK_ID)?;
        check_text("node", &self.node, limits::MAX_NODE)?;
        check_range("ttl_ms", self.ttl_ms, limits::MAX_TTL_MS)?;
        check_range(
            "pending_ttl_ms",
            self.pending_ttl_ms,
            limits::MAX_PENDING_TTL_MS,
        )?;
        Ok(())
    }
}

impl HitRequest {
    /// The tenant this hit is for (the routing key), once validated.
    pub fn tenant(&self) -> &str {
        self.claim
            .as_ref()
            .map(|c| c.tenant.as_str())
            .or_else(|| self.charges.first().map(|c| c.tenant.as_str()))
            .unwrap_or("")
    }

    /// No charge and no claim. The contract answers such a hit `:ok`; on the
    /// wire it is `nothing_to_do`, since it names no tenant to route it by,
    /// so the edge clients answer it themselves without sending it.
    pub fn is_empty(&self) -> bool {
        self.charges.is_empty() && self.claim.is_none()
    }

    pub fn validate(&self) -> Result<(), InvalidRequest> {
        if self.is_empty() {
            return Err(InvalidRequest::NothingToDo);
        }
        if self.charges.len() > limits::MAX_CHARGES {
            return Err(InvalidRequest::TooManyCharges {
                count: self.charges.len(),
                max: limits::MAX_CHARGES,
            });
        }
        let mut seen = [false; 2];
        for charge in &self.charges {
            charge.validate()?;
            if std::mem::replace(&mut seen[charge.kind.index()], true) {
                return Err(InvalidRequest::DuplicateBucket { kind: charge.kind });
            }
        }
        if let Some(claim) = &self.claim {
            claim.validate()?;
        }
        let tenant = self.tenant();
        if self.charges.iter().any(|c| c.tenant != tenant) {
            return Err(InvalidRequest::MixedTenants);
        }
        Ok(())
    }
}

impl ResetRequest {
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        validate_tenant(&self.tenant)
    }
}

impl InspectRequest {
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        validate_tenant(&self.tenant)?;
        if let Some(event) = &self.claim {
            check_text("source_id", &event.source_id, limits::MAX_SOURCE_ID)?;
            check_text("key", &event.key, limits::MAX_KEY)?;
        }
        Ok(())
    }
}

impl SettleRequest {
    pub fn validate(&self) -> Result<(), InvalidRequest> {
        self.claim.validate()
    }
}
