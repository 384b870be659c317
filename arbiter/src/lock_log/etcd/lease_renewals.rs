//! Every session's renewals over a few shared etcd LeaseKeepAlive streams
//! ("lanes"), pipelined, as etcd's own client does.
//!
//! A stream per session cost etcd a stream (about five goroutines and
//! ~40 KiB) per live session and the arbiter a stream's buffers each
//! (issue 18). etcd's LeaseKeepAlive takes any lease id on any stream and
//! answers each request with its id, so a lane sends renewals of many leases
//! back to back and matches the answers by id. A lease always goes to the
//! same lane and has at most one renewal in flight there: a second ask for it
//! joins the one in flight (whose answer counts from when *it* was sent).
//!
//! etcd-client opens a keep-alive stream only with a live lease; a lane opens
//! its stream with any lease it has to renew (one etcd no longer has is
//! answered as gone, TTL 0) and then sets the keeper's id per renewal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use latchkey_etcd::lease::{LeaseKeepAliveResponse, LeaseKeepAliveStream, LeaseKeeper};
use latchkey_etcd::{Client, ErrorKind};
use tokio::sync::{mpsc, oneshot};

use crate::lock_log::{Renewal, StoreError};

/// Shared keep-alive streams per arbiter. etcd serves one stream's requests
/// in order; a few lanes keep one slow answer from holding up everyone.
pub const LANES: usize = 4;
/// Asks one lane holds (queued or in flight). Past it the lane stops taking
/// asks, which slows the callers (never a refusal). It also keeps the
/// answers etcd may have to buffer for us (~50 bytes each) well inside the
/// HTTP/2 stream window (2 MiB), so etcd never stops reading our requests
/// while we wait to send one.
const MAX_WAITING: usize = 8192;
/// The queue in front of a lane.
const ASK_QUEUE: usize = 1024;
/// After a lane could not open a stream, asks fail at once for this long.
const REOPEN_PAUSE: Duration = Duration::from_millis(200);

/// An answer from etcd: the TTL left (0 or less: the lease is gone), and when
/// the renewal it answers was sent (the lease lives at least `ttl_seconds`
/// from then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    pub ttl_seconds: i64,
    pub sent: Instant,
}

/// The arbiter's memo of recent renewals ([`crate::bounds`]), consulted and
/// written by the lanes themselves: an answer is noted before the renewal
/// in flight is let go, so asks that come after it are answered from the
/// memo instead of sending the same renewal to etcd again.
pub trait RenewalMemo: Send + Sync + 'static {
    /// A renewal of `lease` recent enough to answer a new ask with.
    fn recent(&self, lease: i64) -> Option<Renewed>;
    /// etcd answered a renewal of `lease`.
    fn note(&self, lease: i64, renewed: Renewed);
    /// A renewal was answered alive `took` after it was first asked of the
    /// lane (the lane's queue and etcd's round trip: what overload slows,
    /// and nothing a caller's own stream does; [`crate::overload`]).
    fn round_trip(&self, _took: Duration) {}
}

/// A memo that remembers nothing: every ask reaches etcd (or joins a
/// renewal in flight). For the entity tier's other shards, whose leases are
/// session shadows with the session's own id: an answer for the session's
/// lease on another cluster must never answer for them.
pub struct NoMemo;

impl RenewalMemo for NoMemo {
    fn recent(&self, _: i64) -> Option<Renewed> {
        None
    }

    fn note(&self, _: i64, _: Renewed) {}
}

/// A lane answers each ask with a [`Renewal`]: `sent_to_store` is set for
/// the one ask that sent the renewal to etcd (others joined it or were
/// answered from the memo).
type Reply = oneshot::Sender<Result<Renewal, StoreError>>;

struct Ask {
    lease: i64,
    reply: Reply,
    asked: Instant,
}

/// The lanes. Their tasks end when this is dropped (the queues close).
pub struct LeaseRenewals {
    lanes: Vec<mpsc::Sender<Ask>>,
}

impl LeaseRenewals {
    pub fn start(client: &Client, memo: Arc<dyn RenewalMemo>) -> Self {
        let lanes = (0..LANES)
            .map(|_| {
                let (tx, rx) = mpsc::channel(ASK_QUEUE);
                tokio::spawn(Lane::new(client.clone(), Arc::clone(&memo)).run(rx));
                tx
            })
            .collect();
        Self { lanes }
    }

    /// Renews `lease` once, joins its renewal in flight, or answers with a
    /// recent one from the memo (then `sent` is that renewal's).
    pub async fn renew(&self, lease: i64) -> Result<Renewal, StoreError> {
        let index = usize::try_from(lease.unsigned_abs() % LANES as u64).unwrap_or(0);
        let lane = self
            .lanes
            .get(index)
            .ok_or_else(|| StoreError::unavailable("no lease renewal lane"))?;
        let (reply, answer) = oneshot::channel();
        lane.send(Ask {
            lease,
            reply,
            asked: Instant::now(),
        })
        .await
        .map_err(|_| StoreError::unavailable("lease renewals stopped"))?;
        answer
            .await
            .map_err(|_| StoreError::unavailable("lease keep-alive stream closed"))?
    }
}

struct Pending {
    sent: Instant,
    /// When its first ask was made (for the overload signal).
    asked: Instant,
    waiters: Vec<Reply>,
}

struct Lane {
    client: Client,
    memo: Arc<dyn RenewalMemo>,
    conn: Option<(LeaseKeeper, LeaseKeepAliveStream)>,
    /// Leases with a renewal in flight on `conn` (or waiting for it to open).
    pending: HashMap<i64, Pending>,
    /// Asks in `pending`, joiners included; at most [`MAX_WAITING`].
    waiting: usize,
    /// No stream could be opened; asks fail at once until then.
    paused_until: Option<Instant>,
}

enum Event {
    Ask(Option<Ask>),
    Answer(Result<Option<LeaseKeepAliveResponse>, latchkey_etcd::Error>),
    /// Time to say how long the oldest renewal in flight has waited.
    Tick,
}

/// How often a lane with renewals in flight reports the oldest one's wait
/// (the overload signal must see a stalled etcd, which answers nothing).
const STALL_TICK: Duration = Duration::from_millis(100);
/// A renewal in flight this long is reported as it waits.
const STALL_REPORT: Duration = Duration::from_millis(500);

async fn next_answer(
    conn: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
) -> Result<Option<LeaseKeepAliveResponse>, latchkey_etcd::Error> {
    match conn {
        Some((_, stream)) => Ok(stream.message().await?),
        None => std::future::pending().await,
    }
}

/// The stream could not open because etcd no longer has the lease.
fn gone(err: &latchkey_etcd::Error) -> bool {
    err.kind() == ErrorKind::LeaseNotFound
}

impl Lane {
    fn new(client: Client, memo: Arc<dyn RenewalMemo>) -> Self {
        Self {
            client,
            memo,
            conn: None,
            pending: HashMap::new(),
            waiting: 0,
            paused_until: None,
        }
    }

    async fn run(mut self, mut asks: mpsc::Receiver<Ask>) {
        let mut tick = tokio::time::interval(STALL_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            let room = self.waiting < MAX_WAITING;
            let event = tokio::select! {
                ask = asks.recv(), if room => Event::Ask(ask),
                answer = next_answer(&mut self.conn), if self.conn.is_some() => Event::Answer(answer),
                _ = tick.tick(), if !self.pending.is_empty() => Event::Tick,
            };
            match event {
                Event::Tick => {
                    if let Some(oldest) = self.pending.values().map(|p| p.asked).min() {
                        let waited = oldest.elapsed();
                        if waited >= STALL_REPORT {
                            self.memo.round_trip(waited);
                        }
                    }
                }
                Event::Ask(None) => return,
                Event::Ask(Some(ask)) => self.ask(ask).await,
                Event::Answer(Ok(Some(resp))) => self.answered(resp.id(), resp.ttl()),
                Event::Answer(Ok(None)) | Event::Answer(Err(_)) => {
                    // The stream broke: renewals in flight on it go again on a new one.
                    self.conn = None;
                    self.open().await;
                }
            }
        }
    }

    async fn ask(&mut self, ask: Ask) {
        if self.conn.is_none() && self.paused_until.is_some_and(|t| Instant::now() < t) {
            let _ = ask.reply.send(Err(StoreError::unavailable(
                "cannot open a lease keep-alive stream to etcd",
            )));
            return;
        }
        if let Some(recent) = self.memo.recent(ask.lease) {
            let _ = ask.reply.send(Ok(Renewal {
                ttl_seconds: recent.ttl_seconds,
                sent: recent.sent,
                sent_to_store: false,
            }));
            return;
        }
        self.waiting += 1;
        if let Some(p) = self.pending.get_mut(&ask.lease) {
            p.waiters.push(ask.reply);
            return;
        }
        self.pending.insert(
            ask.lease,
            Pending {
                sent: Instant::now(),
                asked: ask.asked,
                waiters: vec![ask.reply],
            },
        );
        if self.conn.is_none() {
            self.open().await;
        } else {
            self.send(ask.lease).await;
        }
    }

    /// Sends one renewal on the open stream.
    async fn send(&mut self, lease: i64) {
        let Some((keeper, _)) = &mut self.conn else {
            return;
        };
        keeper.id = lease;
        if keeper.keep_alive().await.is_err() {
            self.conn = None;
            self.open().await;
        }
    }

    /// Opens a stream with one of the pending leases and sends every pending
    /// renewal on it (again, if they were in flight on a broken stream).
    async fn open(&mut self) {
        loop {
            let Some(&lease) = self.pending.keys().next() else {
                return;
            };
            let opened = self.client.lease_client().keep_alive(lease).await;
            match opened.map_err(latchkey_etcd::Error::from) {
                Ok(conn) => {
                    self.conn = Some(conn);
                    break;
                }
                Err(e) if gone(&e) => self.answered(lease, 0),
                Err(e) => {
                    // Every waiter gets the whole story as text (a source
                    // cannot be shared between them).
                    let detail =
                        super::unavailable("cannot open a lease keep-alive stream to etcd", e)
                            .detail();
                    self.fail_all(&detail);
                    self.paused_until = Some(Instant::now() + REOPEN_PAUSE);
                    return;
                }
            }
        }
        self.paused_until = None;
        let leases: Vec<i64> = self.pending.keys().copied().collect();
        let now = Instant::now();
        for lease in leases {
            if let Some(p) = self.pending.get_mut(&lease) {
                p.sent = now;
            }
            let Some((keeper, _)) = &mut self.conn else {
                return;
            };
            keeper.id = lease;
            if keeper.keep_alive().await.is_err() {
                self.conn = None;
                self.fail_all("lease keep-alive stream closed");
                return;
            }
        }
    }

    fn answered(&mut self, lease: i64, ttl_seconds: i64) {
        let Some(p) = self.pending.remove(&lease) else {
            return;
        };
        self.waiting = self.waiting.saturating_sub(p.waiters.len());
        let renewed = Renewed {
            ttl_seconds,
            sent: p.sent,
        };
        self.memo.note(lease, renewed);
        if ttl_seconds > 0 {
            self.memo.round_trip(p.asked.elapsed());
        }
        for (i, waiter) in p.waiters.into_iter().enumerate() {
            let _ = waiter.send(Ok(Renewal {
                ttl_seconds,
                sent: renewed.sent,
                sent_to_store: i == 0,
            }));
        }
        self.shrink();
    }

    fn fail_all(&mut self, detail: &str) {
        for (_, p) in self.pending.drain() {
            for waiter in p.waiters {
                let _ = waiter.send(Err(StoreError::unavailable(detail)));
            }
        }
        self.waiting = 0;
        self.shrink();
    }

    /// Gives memory back after a burst.
    fn shrink(&mut self) {
        if self.pending.is_empty() && self.pending.capacity() > 1024 {
            self.pending.shrink_to_fit();
        }
    }
}
