//! The pure domain of ankusa-fleet: GCRA buckets, two-phase claim tables and the
//! actors that own them. Nothing in this crate knows about NATS.
//!
//! - [`types`]: the contract's requests, outcomes and limits;
//! - [`gcra`]: the rate algorithm on one bucket;
//! - [`claims`]: the two-phase claim table;
//! - [`tenant`]: every rule applied to one tenant's state, as pure functions;
//! - [`actor`]: the tenant and shard actors that schedule them;
//! - [`clock`]: injected time.

pub mod actor;
pub mod claims;
pub mod clock;
pub mod gcra;
pub mod tenant;
pub mod types;

pub use actor::{
    spawn_shard, InOrder, Refused, ShardConfig, ShardHandle, ShardMsg, ShardStats, TenantFailure,
    TenantRequest, DEFAULT_MAX_TENANT_CLAIMS, SWEEP_STEP_BUCKETS,
};
pub use claims::ClaimRecord;
pub use clock::{AnchoredClock, Clock, ManualClock, SystemClock};
pub use tenant::{
    Applied, BucketRecord, Buckets, Changes, ClaimChange, ClaimsFull, TenantSnapshot, TenantState,
};
pub use types::{
    BucketView, Charge, Claim, ClaimView, EventKey, HitOutcome, HitRequest, InspectRequest,
    InvalidRequest, Kind, ResetRequest, SettleOutcome, SettleRequest, Settlement, TenantView,
};
