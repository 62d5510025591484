//! The bare NATS transport baseline: what a hit costs when the node does nothing.
//!
//! [`EchoStore`] sends exactly the bytes the fleet's edge client sends (a
//! [`Request`] encoded in MessagePack, with the call's budget) by NATS
//! request-reply and decodes the [`Reply`] the same way; [`EchoResponder`]
//! answers every request at once with a fixed, pre-encoded reply and never
//! decodes anything. The difference between the fleet and this is what the
//! node's work (routing, actors, persistence) costs above the transport.
//!
//! The responder serves one wildcard subscription, `<base>.*`, and picks its
//! reply by the subject's last token (`hit`, `settle`, `reset`), so that a
//! settle gets a settle answer without the responder reading the payload.
//!
//! [`NodeEchoResponder`] is the same floor for edge batching: it answers an
//! instance's subjects as a node would, batches included, but does nothing
//! besides decoding a request and answering each call in it `ok`. The fleet's
//! own edge client, batching, talks to it unchanged; what that reaches against
//! the bare echo is all that batching can gain on the host, whatever a node
//! does.

use std::time::Duration;

use ankusa_actors::{HitOutcome, HitRequest, SettleOutcome, SettleRequest};
use ankusa_bus::{server_caught_up, Op, Reply, ReplyBody, Request, Store, StoreError, Subjects};
use async_nats::{Client, RequestErrorKind};
use bytes::Bytes;
use futures::StreamExt;
use tokio::task::JoinHandle;

/// Why an [`EchoResponder`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum EchoError {
    #[error("cannot subscribe to `{subject}`: {message}")]
    Subscribe { subject: String, message: String },
    #[error("the server did not confirm the subscription: {0}")]
    NotConfirmed(String),
    #[error("`{0}` is not a valid base subject (empty, or has a wildcard or whitespace)")]
    BadSubject(String),
}

fn check_base(base: &str) -> Result<(), EchoError> {
    let bad = base.is_empty()
        || base.starts_with('.')
        || base.ends_with('.')
        || base
            .chars()
            .any(|c| c.is_whitespace() || c == '*' || c == '>');
    if bad {
        Err(EchoError::BadSubject(base.to_string()))
    } else {
        Ok(())
    }
}

/// Answers every request on `<base>.*` with a fixed reply, until dropped.
#[derive(Debug)]
pub struct EchoResponder {
    base: String,
    task: JoinHandle<()>,
}

impl EchoResponder {
    /// Subscribes to `<base>.*` and starts answering. Returns once the server
    /// has the subscription, so a request sent right after finds a responder.
    pub async fn start(client: Client, base: impl Into<String>) -> Result<Self, EchoError> {
        let base = base.into();
        check_base(&base)?;
        let mut sub = subscribe(&client, format!("{base}.*")).await?;

        // Encoded once: the responder's work per request is one publish.
        let hit = Bytes::from(Reply::new(ReplyBody::Hit(HitOutcome::Ok)).encode());
        let settle = Bytes::from(Reply::new(ReplyBody::Settle(SettleOutcome::Ok)).encode());
        let reset = Bytes::from(Reply::new(ReplyBody::Reset).encode());
        let task = tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                // A message without a reply subject is a publish, not a request.
                let Some(reply_to) = msg.reply else { continue };
                let payload = match msg.subject.rsplit('.').next() {
                    Some("settle") => settle.clone(),
                    Some("reset") => reset.clone(),
                    _ => hit.clone(),
                };
                if let Err(err) = client.publish(reply_to, payload).await {
                    // The client is closed or its buffer is gone: nothing more
                    // can be answered, so stop rather than spin.
                    tracing::debug!(%err, "echo responder cannot publish; stopping");
                    break;
                }
            }
        });
        Ok(Self { base, task })
    }

    /// The base subject; requests go to `<base>.hit`, `<base>.settle`, `<base>.reset`.
    pub fn base(&self) -> &str {
        &self.base
    }
}

impl Drop for EchoResponder {
    fn drop(&mut self) {
        // Dropping the task drops its subscriber, which unsubscribes.
        self.task.abort();
    }
}

/// How long the server may take to confirm a responder's subscription.
const CONFIRM_WAIT: Duration = Duration::from_secs(5);

/// Subscribes to `subject` and returns once the server has the subscription,
/// so a request sent right after finds a responder.
async fn subscribe(client: &Client, subject: String) -> Result<async_nats::Subscriber, EchoError> {
    let sub = client
        .subscribe(subject.clone())
        .await
        .map_err(|e| EchoError::Subscribe {
            subject,
            message: e.to_string(),
        })?;
    match tokio::time::timeout(CONFIRM_WAIT, server_caught_up(client)).await {
        Ok(Ok(())) => Ok(sub),
        Ok(Err(e)) => Err(EchoError::NotConfirmed(e.to_string())),
        Err(_) => Err(EchoError::NotConfirmed(format!(
            "no word within {CONFIRM_WAIT:?}"
        ))),
    }
}

/// Answers every request on an instance's subjects (`ankusa.<instance>.>`) as a
/// node that does no work would, until dropped.
#[derive(Debug)]
pub struct NodeEchoResponder {
    task: JoinHandle<()>,
}

impl NodeEchoResponder {
    /// The node name its answers carry, so that an edge batches to it.
    pub const NODE: &'static str = "echo";

    /// Subscribes to the instance's subjects and starts answering: each
    /// request decoded, each call in it answered `ok` (a lone one naming
    /// [`Self::NODE`]), and what does not decode answered with its error.
    pub async fn start(client: Client, instance: &str) -> Result<Self, EchoError> {
        let subjects =
            Subjects::new(instance).map_err(|_| EchoError::BadSubject(instance.to_string()))?;
        let mut sub = subscribe(&client, format!("{}.>", subjects.prefix())).await?;
        let task = tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let Some(reply_to) = msg.reply else { continue };
                let reply = match Request::decode(&msg.payload) {
                    Ok(request) => Reply::new(ok_body(&request.op)).from_node(Some(Self::NODE)),
                    Err(err) => Reply::new(ReplyBody::Error(err.into())),
                };
                if let Err(err) = client.publish(reply_to, reply.encode().into()).await {
                    tracing::debug!(%err, "node echo cannot publish; stopping");
                    break;
                }
            }
        });
        Ok(Self { task })
    }
}

impl Drop for NodeEchoResponder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The answer of a node that grants everything and keeps nothing.
fn ok_body(op: &Op) -> ReplyBody {
    match op {
        Op::Hit(_) => ReplyBody::Hit(HitOutcome::Ok),
        Op::Settle(_) => ReplyBody::Settle(SettleOutcome::Ok),
        Op::Reset { .. } => ReplyBody::Reset,
        Op::Inspect(_) => ReplyBody::Inspect(Default::default()),
        Op::Batch(items) => ReplyBody::Batch(
            items
                .iter()
                .map(|item| Reply::new(ok_body(&item.op)))
                .collect(),
        ),
    }
}

/// A [`Store`] that talks to an [`EchoResponder`] exactly as the fleet client
/// talks to a node: same encoded request, same reply decoding, same budget.
#[derive(Debug, Clone)]
pub struct EchoStore {
    client: Client,
    hit_subject: String,
    settle_subject: String,
    reset_subject: String,
}

impl EchoStore {
    /// A store sending to the responder on `base` over `client`.
    pub fn new(client: Client, base: &str) -> Self {
        Self {
            client,
            hit_subject: format!("{base}.hit"),
            settle_subject: format!("{base}.settle"),
            reset_subject: format!("{base}.reset"),
        }
    }

    async fn call(&self, subject: &str, op: Op, timeout: Duration) -> Result<Reply, StoreError> {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return Err(StoreError::Disconnected);
        }
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // The bytes the fleet's edge client sends for the same call.
        let payload = Bytes::from(Request::encode_op(timeout_ms, &op));
        let sent = self.client.request(subject.to_string(), payload);
        let msg = match tokio::time::timeout(timeout, sent).await {
            Err(_) => return Err(StoreError::Timeout(timeout)),
            Ok(Err(err)) => {
                return Err(match err.kind() {
                    RequestErrorKind::TimedOut => StoreError::Timeout(timeout),
                    RequestErrorKind::NoResponders => StoreError::NoResponders,
                    _ => StoreError::Transport(err.to_string()),
                })
            }
            Ok(Ok(msg)) => msg,
        };
        Reply::decode(&msg.payload).map_err(|e| StoreError::BadReply(e.to_string()))
    }
}

impl Store for EchoStore {
    async fn hit(&self, req: HitRequest, timeout: Duration) -> Result<HitOutcome, StoreError> {
        if req.is_empty() {
            return Ok(HitOutcome::Ok);
        }
        req.validate()?;
        let subject = self.hit_subject.as_str();
        match self.call(subject, Op::Hit(req), timeout).await?.body {
            ReplyBody::Hit(outcome) => Ok(outcome),
            other => Err(StoreError::unexpected("hit", other)),
        }
    }

    async fn settle(
        &self,
        req: SettleRequest,
        timeout: Duration,
    ) -> Result<SettleOutcome, StoreError> {
        req.validate()?;
        let subject = self.settle_subject.as_str();
        match self.call(subject, Op::Settle(req), timeout).await?.body {
            ReplyBody::Settle(outcome) => Ok(outcome),
            other => Err(StoreError::unexpected("settle", other)),
        }
    }

    async fn reset(&self, tenant: String, timeout: Duration) -> Result<(), StoreError> {
        ankusa_actors::types::validate_tenant(&tenant)?;
        let subject = self.reset_subject.as_str();
        match self
            .call(subject, Op::Reset { tenant }, timeout)
            .await?
            .body
        {
            ReplyBody::Reset => Ok(()),
            other => Err(StoreError::unexpected("reset", other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_subjects_are_checked() {
        assert!(check_base("bench.echo").is_ok());
        for bad in ["", ".x", "x.", "a.*", "a.>", "a b"] {
            assert!(check_base(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
