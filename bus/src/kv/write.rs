//! One write to a KV key, and JetStream's answers to it.
//!
//! Every write of an instance (claim-log messages, leases, heartbeats) is a
//! plain publish whose answer comes back through the [`FleetKv`]'s inbox, not
//! through `async_nats`'s JetStream context, which keeps a slot for every
//! answer that never comes. So the answers are read here, once, for the
//! leases and heartbeats of [`FleetKv`] and the group commit of [`KvWriter`]
//! alike: the sequence a write was stored at, the reason it was refused (a
//! compare-and-set on a revision that lost), or when a message was stored.
//!
//! [`FleetKv`]: super::FleetKv
//! [`KvWriter`]: super::KvWriter

use std::time::Duration;

use async_nats::header::{self, HeaderMap, HeaderValue};
use bytes::Bytes;
use serde::Deserialize;

use super::KvError;
use crate::replies::{self, Inbox};
use crate::store::StoreError;

/// One write to a KV key: a put (with TTL) or a purge.
#[derive(Debug, Clone)]
pub(super) struct Write {
    subject: String,
    headers: HeaderMap,
    payload: Bytes,
}

impl Write {
    pub(super) fn put(bucket: &str, key: &str, payload: Bytes, ttl_secs: u64) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(header::NATS_MESSAGE_TTL, HeaderValue::from(ttl_secs));
        Self {
            subject: format!("$KV.{bucket}.{key}"),
            headers,
            payload,
        }
    }

    /// Drops every revision of the key, leaving a marker that expires by itself.
    pub(super) fn purge(bucket: &str, key: &str) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert("KV-Operation", "PURGE");
        headers.insert(header::NATS_ROLLUP, "sub");
        headers.insert(header::NATS_MESSAGE_TTL, HeaderValue::from(1u64));
        Self {
            subject: format!("$KV.{bucket}.{key}"),
            headers,
            payload: Bytes::new(),
        }
    }

    /// Publishes the write with a reply subject in `inbox`, where its ack comes.
    pub(super) async fn send(self, inbox: &Inbox) -> Result<replies::Waiting, StoreError> {
        inbox
            .request(self.subject.into(), Some(self.headers), self.payload)
            .await
    }

    pub(super) fn expect_revision(mut self, revision: u64) -> Self {
        self.headers.insert(
            header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            HeaderValue::from(revision),
        );
        self
    }
}

/// Why a write to a KV key was not stored, or is not known to be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum WriteError {
    #[error("{description} (code {code}, error code {err_code})")]
    Refused {
        code: u16,
        err_code: u64,
        description: String,
    },
    #[error("not a publish ack: {0}")]
    NotAnAck(String),
    #[error("no stream takes the subject (no responders)")]
    NoStream,
    #[error("no answer within {0:?}")]
    NoAck(Duration),
    #[error("{0}")]
    Transport(String),
}

impl WriteError {
    /// JetStream's "wrong last sequence": a compare-and-set on a key's
    /// revision that lost.
    pub(super) fn is_wrong_revision(&self) -> bool {
        const STREAM_WRONG_LAST_SEQUENCE: u64 = 10071;
        matches!(self, Self::Refused { err_code, .. } if *err_code == STREAM_WRONG_LAST_SEQUENCE)
    }
}

/// Awaits a published write's ack within `bound`: the sequence it was stored at.
pub(super) async fn acked(
    published: Result<replies::Waiting, StoreError>,
    bound: Duration,
) -> Result<u64, WriteError> {
    read_ack(&replied(published, bound).await?.payload)
}

/// Awaits the JetStream answer to a request sent through the inbox, within
/// `bound`.
pub(super) async fn replied(
    published: Result<replies::Waiting, StoreError>,
    bound: Duration,
) -> Result<async_nats::Message, WriteError> {
    let waiting = published.map_err(|err| WriteError::Transport(err.to_string()))?;
    match tokio::time::timeout(bound, waiting.reply()).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(StoreError::NoResponders)) => Err(WriteError::NoStream),
        Ok(Err(err)) => Err(WriteError::Transport(err.to_string())),
        Err(_) => Err(WriteError::NoAck(bound)),
    }
}

/// What JetStream answers a stream message get: the message, or why not.
#[derive(Deserialize)]
struct MessageAnswer {
    #[serde(default)]
    message: Option<StoredMessage>,
    #[serde(default)]
    error: Option<ApiError>,
}

#[derive(Deserialize)]
struct StoredMessage {
    seq: u64,
    /// When the stream stored it (RFC 3339, the leader's clock).
    time: String,
}

/// When message `revision` was stored, in unix µs, from a stream message
/// get's answer.
pub(super) fn stored_at(answer: &[u8], revision: u64) -> Result<u64, KvError> {
    let unreadable = |what: String| KvError::Request(format!("message get: {what}"));
    let message = match serde_json::from_slice::<MessageAnswer>(answer) {
        Ok(MessageAnswer {
            message: Some(message),
            ..
        }) => message,
        Ok(MessageAnswer {
            error: Some(err), ..
        }) => return Err(unreadable(format!("{} ({})", err.description, err.code))),
        Ok(_) | Err(_) => return Err(unreadable("not a message".into())),
    };
    if message.seq != revision {
        return Err(unreadable(format!(
            "revision {} found, {revision} asked",
            message.seq
        )));
    }
    let at = time::OffsetDateTime::parse(
        &message.time,
        &time::format_description::well_known::Rfc3339,
    )
    .map_err(|err| unreadable(format!("time {:?}: {err}", message.time)))?;
    u64::try_from(at.unix_timestamp_nanos() / 1000)
        .map_err(|_| unreadable(format!("time {:?} before 1970", message.time)))
}

/// JetStream's error code for a message get that found no message.
const NO_MESSAGE_FOUND: u64 = 10037;

/// The sequence of the message a stream message get found (one asked for
/// with `next_by_subj`: the first at or after a sequence), or `None` when the
/// stream holds none there.
pub(super) fn found_seq(answer: &[u8]) -> Result<Option<u64>, KvError> {
    match serde_json::from_slice::<MessageAnswer>(answer) {
        Ok(MessageAnswer {
            message: Some(message),
            ..
        }) => Ok(Some(message.seq)),
        Ok(MessageAnswer {
            error: Some(err), ..
        }) if err.err_code == NO_MESSAGE_FOUND => Ok(None),
        Ok(MessageAnswer {
            error: Some(err), ..
        }) => Err(KvError::Request(format!(
            "message get: {} ({})",
            err.description, err.code
        ))),
        Ok(_) | Err(_) => Err(KvError::Request("message get: not a message".into())),
    }
}

/// What JetStream answers a publish: the stored message's sequence, or why
/// it was not stored.
#[derive(Deserialize)]
struct PublishAnswer {
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    error: Option<ApiError>,
}

#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

/// Reads a publish's ack: the sequence it was stored at, or the server's
/// reason it was not stored.
fn read_ack(payload: &[u8]) -> Result<u64, WriteError> {
    match serde_json::from_slice::<PublishAnswer>(payload) {
        Ok(PublishAnswer {
            error: Some(err), ..
        }) => Err(WriteError::Refused {
            code: err.code,
            err_code: err.err_code,
            description: err.description,
        }),
        Ok(PublishAnswer { seq: Some(seq), .. }) => Ok(seq),
        Ok(PublishAnswer { seq: None, .. }) | Err(_) => Err(WriteError::NotAnAck(
            String::from_utf8_lossy(&payload[..payload.len().min(200)]).into_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_messages_time_is_read_for_the_revision_asked_only() {
        let answer = br#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":{"subject":"$KV.b.n","seq":42,"data":"","time":"2026-12-06T02:03:26.123456789Z"}}"#;
        assert_eq!(stored_at(answer, 42), Ok(1_796_522_606_123_456));
        let other = stored_at(answer, 41).unwrap_err();
        assert!(
            other.to_string().contains("revision 42 found, 41 asked"),
            "{other}"
        );
        let missing =
            br#"{"error":{"code":404,"err_code":10037,"description":"no message found"}}"#;
        let err = stored_at(missing, 42).unwrap_err();
        assert!(err.to_string().contains("no message found (404)"), "{err}");
        let garbled = br#"{"message":{"seq":42,"time":"noon"}}"#;
        assert!(stored_at(garbled, 42).is_err());
        assert!(stored_at(b"not json", 42).is_err());
    }

    #[test]
    fn a_next_message_get_is_read_as_found_or_none() {
        let found = br#"{"type":"io.nats.jetstream.api.v1.stream_msg_get_response","message":{"subject":"$KV.b.m.x","seq":9,"data":"","time":"2026-12-07T06:00:00Z"}}"#;
        assert_eq!(found_seq(found), Ok(Some(9)));
        let none = br#"{"error":{"code":404,"err_code":10037,"description":"no message found"}}"#;
        assert_eq!(found_seq(none), Ok(None));
        let refused = br#"{"error":{"code":503,"err_code":10008,"description":"JetStream system temporarily unavailable"}}"#;
        assert!(
            found_seq(refused).is_err(),
            "an error other than none found"
        );
        assert!(found_seq(b"not json").is_err());
    }

    #[test]
    fn a_publish_ack_is_read_as_stored_or_refused() {
        assert_eq!(read_ack(br#"{"stream":"KV_x","seq":42}"#), Ok(42));
        assert_eq!(
            read_ack(br#"{"stream":"KV_x","seq":7,"duplicate":true}"#),
            Ok(7)
        );
        let refused = read_ack(
            br#"{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"}}"#,
        )
        .expect_err("refused");
        assert!(refused.is_wrong_revision());
        assert_eq!(
            refused.to_string(),
            "wrong last sequence: 3 (code 400, error code 10071)"
        );
        let full = read_ack(
            br#"{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}"#,
        )
        .expect_err("refused");
        assert!(!full.is_wrong_revision(), "{full}");
        for not_an_ack in [&b"{}"[..], b"", b"nonsense", br#"{"stream":"KV_x"}"#] {
            let err = read_ack(not_an_ack).expect_err("not an ack");
            assert!(
                matches!(err, WriteError::NotAnAck(_)),
                "{not_an_ack:?}: {err}"
            );
        }
    }
}
