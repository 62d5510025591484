//! Request-reply with a reply inbox of our own: one per connection, and a
//! request's place in it released when the request ends, answered or not. The
//! edge client's calls and the node's KV writes (claim log, leases and
//! heartbeats, whose JetStream ack is the reply) go through an [`Inbox`].
//!
//! Why not `async_nats::Client::request`: it keeps each request's reply slot
//! until a reply comes, and drops it only then (nats-io/nats.rs#1617). A reply
//! that never comes (a node that crashed with the request, or woke from a
//! pause to a lapsed lease and stays silent, as it must) left its slot for the
//! connection's life: 353 bytes of an edge's memory per call (200,000
//! unanswered requests grew a client by 69 MB), thousands a second while a
//! paused node holds its shards. Here a [`Waiting`] call takes its slot back
//! when it is dropped, whatever ended it (800,000 unanswered calls left an
//! edge at 15 MB). A node's JetStream publishes had the same slot for each
//! ack that was lost (a server restart, a stream without quorum): with a
//! renewal of every lease each second, 71 MB per 200,000 unacknowledged.
//!
//! The inbox is one wildcard subscription, `<inbox prefix>.<id>.*`, read by a
//! task of its own that hands each reply to the call waiting for its token and
//! drops those nobody waits for any more (they came too late).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_nats::{Client, HeaderMap, Message, StatusCode, Subject};
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{oneshot, OnceCell};
use tokio::task::JoinHandle;

use crate::lock;
use crate::store::StoreError;

/// A connection's reply inbox, subscribed at its first request (and again at
/// the next one if that failed).
pub(crate) struct Inbox {
    client: Client,
    replies: OnceCell<Replies>,
}

impl Inbox {
    pub(crate) fn new(client: Client) -> Self {
        Self {
            client,
            replies: OnceCell::new(),
        }
    }

    /// Publishes `payload` (with `headers`, if any) to `subject`, with a reply
    /// subject of this inbox. The reply is the returned request's to await;
    /// dropping it releases its slot.
    pub(crate) async fn request(
        &self,
        subject: Subject,
        headers: Option<HeaderMap>,
        payload: Bytes,
    ) -> Result<Waiting, StoreError> {
        let replies = self
            .replies
            .get_or_try_init(|| Replies::start(&self.client))
            .await?;
        replies.send(&self.client, subject, headers, payload).await
    }

    /// Requests waiting for a reply now.
    pub(crate) fn waiting(&self) -> usize {
        self.replies.get().map_or(0, Replies::waiting)
    }
}

/// The subscribed inbox and the requests waiting on it.
struct Replies {
    shared: Arc<Shared>,
    reader: JoinHandle<()>,
}

struct Shared {
    /// `<inbox prefix>.<id>.`: a call's reply subject is this and its token.
    prefix: String,
    next_token: AtomicU64,
    waiting: Mutex<HashMap<u64, oneshot::Sender<Message>>>,
}

impl Replies {
    /// Subscribes to a new inbox on `client` and starts reading it.
    async fn start(client: &Client) -> Result<Self, StoreError> {
        let prefix = format!("{}.", client.new_inbox());
        let mut inbox = client
            .subscribe(format!("{prefix}*"))
            .await
            .map_err(|err| StoreError::Transport(format!("cannot subscribe the inbox: {err}")))?;
        let shared = Arc::new(Shared {
            prefix,
            next_token: AtomicU64::new(0),
            waiting: Mutex::default(),
        });
        let reader = tokio::spawn({
            let shared = shared.clone();
            async move {
                while let Some(reply) = inbox.next().await {
                    shared.deliver(reply);
                }
                // The connection is gone: every call still waiting hears so now.
                lock(&shared.waiting).clear();
            }
        });
        Ok(Self { shared, reader })
    }

    async fn send(
        &self,
        client: &Client,
        subject: Subject,
        headers: Option<HeaderMap>,
        payload: Bytes,
    ) -> Result<Waiting, StoreError> {
        let token = self.shared.next_token.fetch_add(1, Ordering::Relaxed);
        let (sender, reply) = oneshot::channel();
        lock(&self.shared.waiting).insert(token, sender);
        // From here on, the slot is released however the call ends.
        let waiting = Waiting {
            shared: self.shared.clone(),
            token,
            reply,
        };
        let reply_to = format!("{}{token}", self.shared.prefix);
        let published = match headers {
            Some(headers) => {
                client
                    .publish_with_reply_and_headers(subject, reply_to, headers, payload)
                    .await
            }
            None => client.publish_with_reply(subject, reply_to, payload).await,
        };
        published.map_err(|err| StoreError::Transport(err.to_string()))?;
        Ok(waiting)
    }

    fn waiting(&self) -> usize {
        lock(&self.shared.waiting).len()
    }
}

impl Drop for Replies {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Shared {
    /// Hands `reply` to the call waiting for its token, if one still does.
    fn deliver(&self, reply: Message) {
        let token = reply
            .subject
            .strip_prefix(self.prefix.as_str())
            .and_then(|token| token.parse::<u64>().ok());
        let Some(token) = token else { return };
        if let Some(sender) = lock(&self.waiting).remove(&token) {
            let _ = sender.send(reply);
        }
    }
}

/// A request sent, waiting for its reply; its slot is released on drop.
pub(crate) struct Waiting {
    shared: Arc<Shared>,
    token: u64,
    reply: oneshot::Receiver<Message>,
}

impl Waiting {
    /// The reply, or `NoResponders` when the server says nobody serves the
    /// subject. Never ends by itself if no reply comes: the caller's deadline
    /// bounds it.
    pub(crate) async fn reply(mut self) -> Result<Message, StoreError> {
        let reply = (&mut self.reply)
            .await
            .map_err(|_| StoreError::Transport("the inbox closed".into()))?;
        if reply.status == Some(StatusCode::NO_RESPONDERS) {
            return Err(StoreError::NoResponders);
        }
        Ok(reply)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        lock(&self.shared.waiting).remove(&self.token);
    }
}
