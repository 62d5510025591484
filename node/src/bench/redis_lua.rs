//! A Redis + Lua implementation of the fleet-store contract, written here only to
//! have something to compare the fleet with: it is what the contract's own Redis
//! store does, one `EVALSHA` per hit and one per settle.
//!
//! - a hit runs `redis_lua.lua`'s `@@hit` script: the same-hook pending replay,
//!   all-or-nothing GCRA over every bucket (a TAT per bucket key, server time from
//!   `TIME`, `PX` expiry once the bucket would be full again), then the two-phase
//!   claim (`SET ... PX` pending with the hook id; `Duplicate` only for a
//!   committed key; `Pending` with the key's `PTTL` as the retry hint);
//! - a settle runs `@@settle`: owner check, then commit (`SET ... PX ttl` with the
//!   committed marker) or release (`DEL`);
//! - a reset deletes the tenant's bucket keys.
//!
//! Every call is bounded by its `timeout` with `tokio::time::timeout`, whatever
//! the connection's own response timeout. Requests are validated first, as the
//! fleet's edge client does, so both refuse the same requests.
//!
//! There is no persistence, failover or degrade story here: a single
//! `redis-server` on loopback is the baseline's best case.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ankusa_actors::{HitOutcome, HitRequest, Kind, SettleOutcome, SettleRequest, Settlement};
use ankusa_bus::{Store, StoreError};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisError, Script, Value};

/// Both scripts, split on their `-- @@name` marker lines.
const SCRIPTS: &str = include_str!("redis_lua.lua");

/// Connections a store opens unless told otherwise: a multiplexed connection
/// pipelines many calls, and a few of them spread the client's work over cores.
pub const DEFAULT_POOL: usize = 4;

/// Why a [`RedisLuaStore`] could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum RedisLuaError {
    #[error("bad Redis URL `{url}`: {source}")]
    Url { url: String, source: RedisError },
    #[error("cannot connect to Redis at `{url}`: {source}")]
    Connect { url: String, source: RedisError },
    #[error("cannot load the Lua scripts: {0}")]
    Load(RedisError),
    #[error("Redis did not answer SCRIPT LOAD within {0:?}")]
    Stalled(Duration),
    #[error("the embedded Lua file has no `-- @@{0}` section")]
    MissingScript(&'static str),
    #[error("a pool needs at least one connection")]
    EmptyPool,
}

/// How long loading a Lua script may take.
const SCRIPT_LOAD_BOUND: Duration = Duration::from_secs(5);

/// The contract on one `redis-server`, through a small pool of multiplexed
/// connections used round-robin.
pub struct RedisLuaStore {
    pool: Vec<MultiplexedConnection>,
    next: AtomicUsize,
    hit: Script,
    settle: Script,
}

impl std::fmt::Debug for RedisLuaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLuaStore")
            .field("pool", &self.pool.len())
            .field("hit_sha", &self.hit.get_hash())
            .field("settle_sha", &self.settle.get_hash())
            .finish()
    }
}

/// The text of one `-- @@name` section of the embedded Lua file.
fn section(name: &'static str) -> Result<&'static str, RedisLuaError> {
    let marker = format!("-- @@{name}\n");
    let start = SCRIPTS
        .find(&marker)
        .ok_or(RedisLuaError::MissingScript(name))?
        + marker.len();
    let rest = &SCRIPTS[start..];
    let end = rest.find("\n-- @@").map_or(rest.len(), |i| i + 1);
    Ok(&rest[..end])
}

/// `ankusa:{<tenant>}:b:<kind>`: the hash tag keeps a tenant's keys in one slot.
fn bucket_key(tenant: &str, kind: Kind) -> String {
    format!("ankusa:{{{tenant}}}:b:{}", kind.name())
}

/// `ankusa:{<tenant>}:c:<len(source_id)>:<source_id><key>`, unambiguous for any bytes.
fn claim_key(tenant: &str, source_id: &str, key: &str) -> String {
    format!("ankusa:{{{tenant}}}:c:{}:{source_id}{key}", source_id.len())
}

fn store_error(err: RedisError) -> StoreError {
    if err.is_connection_dropped() || err.is_connection_refusal() {
        StoreError::Disconnected
    } else {
        StoreError::Transport(err.to_string())
    }
}

fn bad_reply(what: &str, value: &Value) -> StoreError {
    StoreError::BadReply(format!("unexpected {what} script reply: {value:?}"))
}

/// The `{code, value?}` array the scripts answer with.
fn reply_parts(what: &str, value: &Value) -> Result<(i64, Option<Value>), StoreError> {
    match value {
        Value::Array(items) => match items.as_slice() {
            [Value::Int(code)] => Ok((*code, None)),
            [Value::Int(code), arg] => Ok((*code, Some(arg.clone()))),
            _ => Err(bad_reply(what, value)),
        },
        _ => Err(bad_reply(what, value)),
    }
}

fn text_of(what: &str, value: &Value) -> Result<String, StoreError> {
    match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone())
            .map_err(|_| StoreError::BadReply(format!("{what}: hook id is not UTF-8"))),
        Value::SimpleString(s) => Ok(s.clone()),
        _ => Err(bad_reply(what, value)),
    }
}

fn ms_of(what: &str, value: &Value) -> Result<u64, StoreError> {
    match value {
        // The scripts never answer a hint below 1; keep that even if one did.
        Value::Int(ms) => Ok(u64::try_from(*ms).unwrap_or(0).max(1)),
        _ => Err(bad_reply(what, value)),
    }
}

fn decode_hit(value: &Value) -> Result<HitOutcome, StoreError> {
    match reply_parts("hit", value)? {
        (0, None) => Ok(HitOutcome::Ok),
        (1, Some(hook)) => Ok(HitOutcome::Duplicate {
            hook_id: text_of("hit", &hook)?,
        }),
        (2, Some(ms)) => Ok(HitOutcome::Pending {
            retry_after_ms: ms_of("hit", &ms)?,
        }),
        (3, Some(ms)) => Ok(HitOutcome::RateLimited {
            retry_after_ms: ms_of("hit", &ms)?,
        }),
        _ => Err(bad_reply("hit", value)),
    }
}

fn decode_settle(value: &Value) -> Result<SettleOutcome, StoreError> {
    match reply_parts("settle", value)? {
        (0, None) => Ok(SettleOutcome::Ok),
        (1, None) => Ok(SettleOutcome::NotFound),
        (2, Some(hook)) => Ok(SettleOutcome::NotOwner {
            hook_id: text_of("settle", &hook)?,
        }),
        (3, None) => Ok(SettleOutcome::AlreadyCommitted),
        _ => Err(bad_reply("settle", value)),
    }
}

impl RedisLuaStore {
    /// Opens `pool` connections to `url` (e.g. `redis://127.0.0.1:6379/`) and
    /// loads both scripts, so the first hit is already an `EVALSHA` hit.
    pub async fn connect(url: &str, pool: usize) -> Result<Self, RedisLuaError> {
        if pool == 0 {
            return Err(RedisLuaError::EmptyPool);
        }
        let client = redis::Client::open(url).map_err(|source| RedisLuaError::Url {
            url: url.to_string(),
            source,
        })?;
        // Per-call budgets are enforced around each call; the connection's own
        // response timeout is left off so it never races them with another error.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(None);
        let mut conns = Vec::with_capacity(pool);
        for _ in 0..pool {
            let conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(|source| RedisLuaError::Connect {
                    url: url.to_string(),
                    source,
                })?;
            conns.push(conn);
        }
        let store = Self {
            pool: conns,
            next: AtomicUsize::new(0),
            hit: Script::new(section("hit")?),
            settle: Script::new(section("settle")?),
        };
        // The connection has no response timeout (see above): a Redis that
        // took the connection and then stalled would hold this for good.
        let mut conn = store.conn();
        for script in [&store.hit, &store.settle] {
            let invocation = script.prepare_invoke();
            tokio::time::timeout(SCRIPT_LOAD_BOUND, invocation.load_async(&mut conn))
                .await
                .map_err(|_| RedisLuaError::Stalled(SCRIPT_LOAD_BOUND))?
                .map_err(RedisLuaError::Load)?;
        }
        Ok(store)
    }

    /// The next connection of the pool (a clone is a cheap handle to it).
    fn conn(&self) -> MultiplexedConnection {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.pool.len();
        self.pool[i].clone()
    }

    /// The SHA1s the scripts are called by.
    pub fn script_hashes(&self) -> (&str, &str) {
        (self.hit.get_hash(), self.settle.get_hash())
    }

    async fn bounded<T>(
        timeout: Duration,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(timeout, call)
            .await
            .unwrap_or(Err(StoreError::Timeout(timeout)))
    }
}

impl Store for RedisLuaStore {
    async fn hit(&self, req: HitRequest, timeout: Duration) -> Result<HitOutcome, StoreError> {
        if req.is_empty() {
            return Ok(HitOutcome::Ok);
        }
        req.validate()?;
        let tenant = req.tenant().to_string();
        let mut invocation = self.hit.prepare_invoke();
        for charge in &req.charges {
            invocation.key(bucket_key(&tenant, charge.kind));
        }
        invocation.arg(req.charges.len());
        match &req.claim {
            Some(claim) => {
                invocation
                    .key(claim_key(&tenant, &claim.source_id, &claim.key))
                    .arg("1")
                    .arg(claim.hook_id.as_str())
                    .arg(claim.pending_ttl_ms);
            }
            None => {
                invocation.arg("0").arg("").arg(0);
            }
        }
        for charge in &req.charges {
            invocation.arg(charge.increment_us).arg(charge.capacity_us);
        }
        let mut conn = self.conn();
        Self::bounded(timeout, async {
            let value: Value = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            decode_hit(&value)
        })
        .await
    }

    async fn settle(
        &self,
        req: SettleRequest,
        timeout: Duration,
    ) -> Result<SettleOutcome, StoreError> {
        req.validate()?;
        let claim = &req.claim;
        let settlement = match req.settlement {
            Settlement::Commit => "commit",
            Settlement::Release => "release",
        };
        let mut invocation = self.settle.prepare_invoke();
        invocation
            .key(claim_key(&claim.tenant, &claim.source_id, &claim.key))
            .arg(settlement)
            .arg(claim.hook_id.as_str())
            .arg(claim.ttl_ms);
        let mut conn = self.conn();
        Self::bounded(timeout, async {
            let value: Value = invocation
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
            decode_settle(&value)
        })
        .await
    }

    async fn reset(&self, tenant: String, timeout: Duration) -> Result<(), StoreError> {
        ankusa_actors::types::validate_tenant(&tenant)?;
        let mut cmd = redis::cmd("DEL");
        for kind in Kind::ALL {
            cmd.arg(bucket_key(&tenant, kind));
        }
        let mut conn = self.conn();
        Self::bounded(timeout, async {
            let _: Value = cmd.query_async(&mut conn).await.map_err(store_error)?;
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_scripts_are_found_and_split() {
        let hit = section("hit").expect("hit section");
        let settle = section("settle").expect("settle section");
        assert!(hit.contains("redis.call('TIME')"));
        assert!(!hit.contains("@@settle"));
        assert!(settle.contains("'DEL'"));
        assert!(!settle.contains("TIME"));
    }

    #[test]
    fn keys_share_the_tenant_hash_tag() {
        assert_eq!(bucket_key("t1", Kind::Bytes), "ankusa:{t1}:b:bytes");
        assert_eq!(claim_key("t1", "src", "k"), "ankusa:{t1}:c:3:srck");
        // The length prefix keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(claim_key("t", "ab", "c"), claim_key("t", "a", "bc"));
    }

    #[test]
    fn replies_decode_or_are_bad() {
        let ok = Value::Array(vec![Value::Int(0)]);
        assert_eq!(decode_hit(&ok), Ok(HitOutcome::Ok));
        let dup = Value::Array(vec![Value::Int(1), Value::BulkString(b"h".to_vec())]);
        assert_eq!(
            decode_hit(&dup),
            Ok(HitOutcome::Duplicate {
                hook_id: "h".into()
            })
        );
        let zero_wait = Value::Array(vec![Value::Int(2), Value::Int(0)]);
        assert_eq!(
            decode_hit(&zero_wait),
            Ok(HitOutcome::Pending { retry_after_ms: 1 })
        );
        assert!(matches!(
            decode_hit(&Value::Nil),
            Err(StoreError::BadReply(_))
        ));
        assert!(matches!(
            decode_settle(&Value::Array(vec![Value::Int(9)])),
            Err(StoreError::BadReply(_))
        ));
        assert_eq!(
            decode_settle(&Value::Array(vec![Value::Int(3)])),
            Ok(SettleOutcome::AlreadyCommitted)
        );
    }
}
