//! `ankusa hit`, `settle`, `reset` and `inspect`: one call each through the
//! edge client ([`FleetStore`], no local degrade: a person asking wants the
//! fleet's answer or the error), printed for people or as JSON.

use std::time::{Duration, Instant};

use ankusa_actors::{
    Charge, Claim, ClaimView, EventKey, HitOutcome, HitRequest, InspectRequest, Kind,
    SettleOutcome, SettleRequest, Settlement, TenantView,
};
use ankusa_bus::{FleetStore, Store};
use clap::Args;
use serde_json::json;

use super::{fmt_latency, fmt_retry, CliError, Global};

const CALL_TIMEOUT: Duration = Duration::from_millis(1000);

/// An edge client once connected, and what is left of the call's budget: the
/// connection comes up in the background, and waiting for it is part of the call.
async fn connected(global: &Global) -> Result<(FleetStore, Duration), CliError> {
    let store = global.fleet(false).await?;
    let timeout = global.timeout(CALL_TIMEOUT);
    let start = Instant::now();
    super::wait_connected(store.nats(), timeout).await?;
    Ok((store, timeout.saturating_sub(start.elapsed())))
}

/// The claim a hit makes or a settle settles.
#[derive(Debug, Clone, Args)]
pub struct ClaimArgs {
    /// Provider (source) of the webhook, scoping its event keys
    #[arg(long = "source")]
    pub source: Option<String>,
    /// The provider's event key to claim
    #[arg(long)]
    pub key: Option<String>,
    /// This delivery's hook id (who holds the claim)
    #[arg(long)]
    pub hook: Option<String>,
    /// How long a committed claim is kept, ms
    #[arg(long, default_value_t = 86_400_000)]
    pub ttl_ms: u64,
    /// How long an unsettled claim stays pending, ms
    #[arg(long, default_value_t = 30_000)]
    pub pending_ttl_ms: u64,
    /// The edge node name the claim is made on
    #[arg(long, default_value = "ankusa-cli")]
    pub node: String,
}

impl ClaimArgs {
    /// The claim, if `--source`, `--key` and `--hook` are all given; an error
    /// if only some are.
    fn claim(&self, tenant: &str) -> Result<Option<Claim>, CliError> {
        match (&self.source, &self.key, &self.hook) {
            (None, None, None) => Ok(None),
            (Some(source), Some(key), Some(hook)) => Ok(Some(Claim {
                tenant: tenant.to_string(),
                source_id: source.clone(),
                key: key.clone(),
                hook_id: hook.clone(),
                node: self.node.clone(),
                ttl_ms: self.ttl_ms,
                pending_ttl_ms: self.pending_ttl_ms,
            })),
            _ => Err(CliError::Usage(
                "a claim needs --source, --key and --hook together".into(),
            )),
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct HitArgs {
    /// The tenant to charge
    #[arg(long)]
    pub tenant: String,
    /// Sustained hooks per second of the tenant's `hooks` bucket
    #[arg(long, default_value_t = 10.0)]
    pub hooks_per_sec: f64,
    /// Hooks allowed in a burst (the bucket's capacity)
    #[arg(long, default_value_t = 10)]
    pub burst: u64,
    /// Also charge the `bytes` bucket with this payload size
    #[arg(long)]
    pub bytes: Option<u64>,
    /// Sustained bytes per second of the `bytes` bucket
    #[arg(long, default_value_t = 1_000_000.0)]
    pub bytes_per_sec: f64,
    /// Capacity of the `bytes` bucket, in bytes [default: one second's worth]
    #[arg(long)]
    pub bytes_burst: Option<u64>,
    #[command(flatten)]
    pub claim: ClaimArgs,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
}

fn rate_us(per_sec: f64, what: &str) -> Result<f64, CliError> {
    if per_sec.is_finite() && per_sec > 0.0 {
        Ok(1e6 / per_sec)
    } else {
        Err(CliError::Usage(format!("{what} must be a rate above 0")))
    }
}

impl HitArgs {
    fn request(&self) -> Result<HitRequest, CliError> {
        let hook_us = rate_us(self.hooks_per_sec, "--hooks-per-sec")?;
        let increment_us = hook_us.round().max(1.0) as u64;
        let mut charges = vec![Charge {
            kind: Kind::Hooks,
            tenant: self.tenant.clone(),
            increment_us,
            capacity_us: increment_us.saturating_mul(self.burst.max(1)),
        }];
        if let Some(bytes) = self.bytes {
            let byte_us = rate_us(self.bytes_per_sec, "--bytes-per-sec")?;
            let burst = self
                .bytes_burst
                .unwrap_or(self.bytes_per_sec.round() as u64);
            charges.push(Charge {
                kind: Kind::Bytes,
                tenant: self.tenant.clone(),
                increment_us: (bytes as f64 * byte_us).round().max(1.0) as u64,
                capacity_us: (burst as f64 * byte_us).round().max(1.0) as u64,
            });
        }
        let req = HitRequest {
            charges,
            claim: self.claim.claim(&self.tenant)?,
        };
        req.validate()
            .map_err(|e| CliError::Usage(format!("the request would be refused: {e}")))?;
        Ok(req)
    }
}

/// The line a person reads for a hit's outcome.
pub fn describe_hit(outcome: &HitOutcome, latency: Duration) -> String {
    match outcome {
        HitOutcome::Ok => format!("ok (fleet, {})", fmt_latency(latency)),
        HitOutcome::Duplicate { hook_id } => format!("duplicate of hook {hook_id}"),
        HitOutcome::Pending { retry_after_ms } => {
            format!("pending: retry after {}", fmt_retry(*retry_after_ms))
        }
        HitOutcome::RateLimited { retry_after_ms } => {
            format!("rate limited: retry after {}", fmt_retry(*retry_after_ms))
        }
    }
}

pub async fn hit(global: &Global, args: HitArgs) -> Result<(), CliError> {
    let req = args.request()?;
    let (store, left) = connected(global).await?;
    let sent = Instant::now();
    let outcome = store.hit(req, left).await?;
    let latency = sent.elapsed();
    if args.json {
        let mut value = serde_json::to_value(&outcome).unwrap_or_default();
        value["latency_us"] = json!(latency.as_micros() as u64);
        value["source"] = json!("fleet");
        println!("{value}");
    } else {
        println!("{}", describe_hit(&outcome, latency));
    }
    Ok(())
}

#[derive(Debug, Clone, Args)]
pub struct SettleArgs {
    /// The tenant whose claim this is
    #[arg(long)]
    pub tenant: String,
    #[command(flatten)]
    pub claim: ClaimArgs,
    /// The hook is stored: keep the key committed for --ttl-ms
    #[arg(long, conflicts_with = "release", required_unless_present = "release")]
    pub commit: bool,
    /// The hook was not stored: free the key
    #[arg(long)]
    pub release: bool,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
}

pub fn describe_settle(outcome: &SettleOutcome, latency: Duration) -> String {
    match outcome {
        SettleOutcome::Ok => format!("ok (fleet, {})", fmt_latency(latency)),
        SettleOutcome::NotFound => "not found: no live claim on the key".into(),
        SettleOutcome::NotOwner { hook_id } => format!("not owner: hook {hook_id} holds the key"),
        SettleOutcome::AlreadyCommitted => "already committed: nothing changed".into(),
    }
}

pub async fn settle(global: &Global, args: SettleArgs) -> Result<(), CliError> {
    let claim = args
        .claim
        .claim(&args.tenant)?
        .ok_or_else(|| CliError::Usage("settle needs --source, --key and --hook".into()))?;
    let req = SettleRequest {
        claim,
        settlement: if args.commit {
            Settlement::Commit
        } else {
            Settlement::Release
        },
    };
    req.validate()
        .map_err(|e| CliError::Usage(format!("the request would be refused: {e}")))?;
    let (store, left) = connected(global).await?;
    let sent = Instant::now();
    let outcome = store.settle(req, left).await?;
    let latency = sent.elapsed();
    if args.json {
        let mut value = serde_json::to_value(&outcome).unwrap_or_default();
        value["latency_us"] = json!(latency.as_micros() as u64);
        println!("{value}");
    } else {
        println!("{}", describe_settle(&outcome, latency));
    }
    Ok(())
}

#[derive(Debug, Clone, Args)]
pub struct ResetArgs {
    /// The tenant whose buckets to forget
    #[arg(long)]
    pub tenant: String,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
}

pub async fn reset(global: &Global, args: ResetArgs) -> Result<(), CliError> {
    ankusa_actors::types::validate_tenant(&args.tenant)
        .map_err(|e| CliError::Usage(e.to_string()))?;
    let (store, left) = connected(global).await?;
    let sent = Instant::now();
    store.reset(args.tenant, left).await?;
    let latency = sent.elapsed();
    if args.json {
        println!(
            "{}",
            json!({"result": "ok", "latency_us": latency.as_micros() as u64})
        );
    } else {
        println!("ok (fleet, {})", fmt_latency(latency));
    }
    Ok(())
}

#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// The tenant to read
    #[arg(long)]
    pub tenant: String,
    /// Also show the claim on this provider's --key
    #[arg(long = "source", requires = "key")]
    pub source: Option<String>,
    /// The provider's event key whose claim to show
    #[arg(long, requires = "source")]
    pub key: Option<String>,
    /// Print the answer as JSON
    #[arg(long)]
    pub json: bool,
}

/// The lines a person reads for a tenant's state.
pub fn describe_view(view: &TenantView, asked: Option<&EventKey>) -> Vec<String> {
    let mut lines = Vec::new();
    for kind in Kind::ALL {
        let name = kind.name();
        lines.push(match view.buckets.iter().find(|b| b.kind == kind) {
            Some(b) => format!(
                "{name}: {} ahead of now (a charge passes while ahead + increment <= capacity)",
                // Whole seconds past 10 s, as retry hints are.
                match b.ahead_us {
                    us if us < 10_000_000 => fmt_latency(Duration::from_micros(us)),
                    us => fmt_retry(us.div_ceil(1000)),
                }
            ),
            None => format!("{name}: full"),
        });
    }
    lines.push(format!(
        "claims held: {} (expired ones count until swept)",
        view.claims_held
    ));
    if let Some(event) = asked {
        let what = format!("claim {}/{}", event.source_id, event.key);
        lines.push(match &view.claim {
            None => format!("{what}: none live"),
            Some(ClaimView::Pending {
                hook_id,
                node,
                expires_in_ms,
            }) => format!(
                "{what}: pending, hook {hook_id} on {node}, expires in {}",
                fmt_retry(*expires_in_ms)
            ),
            Some(ClaimView::Committed {
                hook_id,
                expires_in_ms,
            }) => format!(
                "{what}: committed by hook {hook_id}, kept {} more",
                fmt_retry(*expires_in_ms)
            ),
        });
    }
    lines
}

pub async fn inspect(global: &Global, args: InspectArgs) -> Result<(), CliError> {
    let claim = match (args.source, args.key) {
        (Some(source_id), Some(key)) => Some(EventKey { source_id, key }),
        _ => None,
    };
    let req = InspectRequest {
        tenant: args.tenant,
        claim,
    };
    req.validate()
        .map_err(|e| CliError::Usage(format!("the request would be refused: {e}")))?;
    let (store, left) = connected(global).await?;
    let view = store.inspect(req.clone(), left).await?;
    if args.json {
        println!("{}", serde_json::to_value(&view).unwrap_or_default());
    } else {
        for line in describe_view(&view, req.claim.as_ref()) {
            println!("{line}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_view_reads_well() {
        let view = TenantView {
            buckets: vec![ankusa_actors::BucketView {
                kind: Kind::Bytes,
                ahead_us: 2_500,
            }],
            claims_held: 4,
            claim: Some(ClaimView::Pending {
                hook_id: "h1".into(),
                node: "edge-a".into(),
                expires_in_ms: 28_100,
            }),
        };
        let event = EventKey {
            source_id: "stripe".into(),
            key: "evt_1".into(),
        };
        assert_eq!(
            describe_view(&view, Some(&event)),
            [
                "hooks: full",
                "bytes: 2.5 ms ahead of now (a charge passes while ahead + increment <= capacity)",
                "claims held: 4 (expired ones count until swept)",
                "claim stripe/evt_1: pending, hook h1 on edge-a, expires in 29 s",
            ]
        );
        let minute = TenantView {
            buckets: vec![ankusa_actors::BucketView {
                kind: Kind::Hooks,
                ahead_us: 59_999_001,
            }],
            ..TenantView::default()
        };
        assert!(describe_view(&minute, None)[0].starts_with("hooks: 60 s ahead of now"));
        let none = describe_view(&TenantView::default(), Some(&event));
        assert_eq!(
            none.last().map(String::as_str),
            Some("claim stripe/evt_1: none live")
        );
        assert_eq!(describe_view(&TenantView::default(), None).len(), 3);
    }

    #[test]
    fn outcomes_read_well() {
        let ms = Duration::from_micros(1200);
        assert_eq!(describe_hit(&HitOutcome::Ok, ms), "ok (fleet, 1.2 ms)");
        assert_eq!(
            describe_hit(
                &HitOutcome::Duplicate {
                    hook_id: "h1".into()
                },
                ms
            ),
            "duplicate of hook h1"
        );
        assert_eq!(
            describe_hit(
                &HitOutcome::Pending {
                    retry_after_ms: 28_100
                },
                ms
            ),
            "pending: retry after 29 s"
        );
        assert_eq!(
            describe_hit(
                &HitOutcome::RateLimited {
                    retry_after_ms: 600
                },
                ms
            ),
            "rate limited: retry after 600 ms"
        );
    }
}
