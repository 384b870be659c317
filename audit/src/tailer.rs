//! The tailer's loop: from the store's checkpoint, read the state of the
//! prefix at that revision, watch from the next one, derive each
//! revision's events, write them, and checkpoint every few seconds.
//!
//! Every failure (etcd, the store, a watch cancelled by compaction) ends
//! one attempt; the next starts again from the checkpoint, which is only
//! ever written after the events it covers, so a crash or a retry replays
//! events (the stores ignore copies) and never skips one. Where etcd has
//! compacted past the checkpoint, the attempt writes a gap event for the
//! revisions it can no longer read and goes on from the compact revision.
//!
//! Nothing here logs a revision or exports one as a metric (a revision
//! with the epoch is a fencing token): the lag is a difference, the
//! written revision is kept for it unexported.

mod etcd;
mod lag;

use std::sync::Arc;
use std::time::Duration;

use latchkey_etcd::Connection;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{info, warn};

use self::etcd::LoadError;
use self::lag::Lag;
use crate::event::Event;
use crate::metrics::{AlarmAt, Metrics};
use crate::store::{AuditStore, StoreError};

#[derive(Debug, Clone)]
pub struct TailerConfig {
    /// How to reach etcd (no request timeout: it would end the watch).
    pub etcd: Connection,
    /// How long one of the tailer's own reads (the revision, the compact
    /// revision) may take.
    pub request_timeout: Duration,
    /// The arbiter's key prefix (`/latchkey`).
    pub prefix: String,
    /// How often the checkpoint is written.
    pub checkpoint_every: Duration,
    /// How long derived events may wait to be written.
    pub flush_every: Duration,
    /// Events per write at most.
    pub batch_max: usize,
    /// How often etcd's current revision is read (for the lag).
    pub head_poll_every: Duration,
    pub alarm: AlarmAt,
    /// Between attempts after a failure.
    pub retry_every: Duration,
}

impl TailerConfig {
    pub fn new(etcd: Connection) -> Self {
        Self {
            etcd,
            request_timeout: Duration::from_secs(10),
            prefix: "/latchkey".into(),
            checkpoint_every: Duration::from_secs(5),
            flush_every: Duration::from_millis(200),
            batch_max: 1000,
            head_poll_every: Duration::from_secs(1),
            alarm: AlarmAt::default(),
            retry_every: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TailError {
    #[error("etcd: {context}: {source}")]
    Etcd {
        context: &'static str,
        #[source]
        source: latchkey_etcd::Error,
    },
    #[error("etcd: {0}: no answer in time")]
    Timeout(&'static str),
    #[error("etcd answered without a header")]
    NoHeader,
    #[error(transparent)]
    Store(#[from] StoreError),
    // No revision in a message: they are logged, and a revision is a
    // token's low half.
    #[error("etcd compacted revisions the tailer had not written while it watched")]
    Compacted,
    #[error("the watch ended")]
    WatchEnded,
    #[error("etcd cancelled the watch: {0}")]
    WatchCancelled(String),
    #[error(
        "etcd cluster {cluster_id:#x} is {behind} revisions below the checkpoint: \
         the lock log was restored from a snapshot, and its new revisions would reuse audited \
         ones; nothing is written until an operator decides (see audit/README.md)"
    )]
    Restored { cluster_id: u64, behind: i64 },
    #[error("etcd's cluster id changed from {was:#x} to {now:#x}")]
    ClusterChanged { was: u64, now: u64 },
}

/// Tails until `stop` turns true; then writes what it has, checkpoints
/// and returns. Failures are logged, counted and retried.
pub async fn run(
    config: TailerConfig,
    store: Arc<dyn AuditStore>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let prefix = format!("{}/", config.prefix.trim_end_matches('/'));
    // The lag is watched apart from the attempts: it matters most while
    // they fail (the store down, the tailer falling behind compaction).
    let monitor = tokio::spawn(watch_lag(
        config.clone(),
        prefix.clone(),
        metrics.clone(),
        stop.clone(),
    ));
    tail_until_stopped(&config, &prefix, store.as_ref(), &metrics, &mut stop).await;
    let _ = monitor.await;
}

async fn tail_until_stopped(
    config: &TailerConfig,
    prefix: &str,
    store: &dyn AuditStore,
    metrics: &Metrics,
    stop: &mut watch::Receiver<bool>,
) {
    loop {
        let attempt = Attempt {
            config,
            prefix,
            store,
            metrics,
        };
        let delay = match attempt.run(stop).await {
            Ok(()) => return,
            // Straight on: the next attempt records the gap.
            Err(e @ TailError::Compacted) => {
                warn!(error = %e, "resuming from the checkpoint");
                Duration::ZERO
            }
            Err(e) => {
                match &e {
                    TailError::Store(_) => {
                        metrics.store_errors.inc();
                    }
                    TailError::Restored { .. } => {
                        metrics.restore_detected.set(1);
                    }
                    _ => {
                        metrics.etcd_errors.inc();
                    }
                }
                warn!(error = %e, "the tailer stopped; retrying from the checkpoint");
                match &e {
                    TailError::Restored { .. } => config.retry_every.max(Duration::from_secs(30)),
                    _ => config.retry_every,
                }
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Polls etcd's revision and reports how far behind the written revision
/// is, until `stop`.
async fn watch_lag(
    config: TailerConfig,
    prefix: String,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut lag = Lag::default();
    let mut client = None;
    let mut tick = interval(config.head_poll_every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if client.is_none() {
            client = etcd::connect(&config.etcd).await.ok();
        }
        let Some(c) = client.as_ref() else { continue };
        match etcd::head(c, &prefix, config.request_timeout).await {
            Ok((_, head)) => lag.observe(head, Instant::now()),
            // Reconnect next time; the lag keeps growing meanwhile.
            Err(_) => client = None,
        }
        // Until an attempt has started there is nothing to measure from (and
        // "behind 0" would publish etcd's head: maybe a live grant's revision).
        let written = metrics.written_revision();
        if written <= 0 {
            continue;
        }
        let (revisions, behind) = lag.behind(written, Instant::now());
        metrics.lag_revisions.set(revisions);
        metrics.lag_seconds.set(behind.as_secs_f64());
        metrics
            .lag_alarm
            .set(i64::from(config.alarm.alarmed(revisions, behind)));
    }
}

/// One attempt: from the checkpoint until a failure or the stop.
struct Attempt<'a> {
    config: &'a TailerConfig,
    prefix: &'a str,
    store: &'a dyn AuditStore,
    metrics: &'a Metrics,
}

/// What the attempt has done so far.
struct Progress {
    cluster_id: u64,
    /// Events derived and not yet written.
    buffer: Vec<Event>,
    /// The last revision derived (its events are in the buffer or written).
    derived: i64,
    /// The last revision whose events are all written.
    written: i64,
    checkpointed: i64,
}

impl Attempt<'_> {
    async fn run(&self, stop: &mut watch::Receiver<bool>) -> Result<(), TailError> {
        let timeout = self.config.request_timeout;
        let client = etcd::connect(&self.config.etcd).await?;
        let (cluster_id, head) = etcd::head(&client, self.prefix, timeout).await?;
        let checkpoint = self.store.checkpoint(cluster_id).await?.unwrap_or(0);
        if head < checkpoint {
            return Err(TailError::Restored {
                cluster_id,
                behind: checkpoint - head,
            });
        }
        self.metrics.restore_detected.set(0);

        // The state at the checkpoint, or past a gap.
        let mut from = checkpoint;
        let mut gap_from = None;
        let mut state = loop {
            match etcd::load(&client, self.prefix, from).await {
                Ok(state) => break state,
                Err(LoadError::Compacted) => {
                    let to = etcd::compact_revision(&client, self.prefix, from, timeout).await?;
                    if to > from {
                        gap_from.get_or_insert(from + 1);
                        from = to;
                    }
                }
                Err(LoadError::Other(e)) => return Err(e),
            }
        };
        if let Some(gap_from) = gap_from {
            warn!(
                cluster_id,
                revisions = from - gap_from + 1,
                "etcd compacted revisions the tailer had not read: recording a gap"
            );
            let gap = Event::gap(gap_from, from, state.epoch());
            self.store
                .write(cluster_id, std::slice::from_ref(&gap))
                .await?;
            self.metrics.written(gap.kind);
            self.metrics.gaps.inc();
            self.store.put_checkpoint(cluster_id, from).await?;
        }
        self.metrics.set_written_revision(from);
        info!(cluster_id, holds = state.holds(), "tailing the lock log");

        let mut stream = etcd::watch(&client, self.prefix, from + 1).await?;
        let mut p = Progress {
            cluster_id,
            buffer: Vec::new(),
            derived: from,
            written: from,
            checkpointed: from,
        };
        let mut flush_tick = interval(self.config.flush_every);
        let mut checkpoint_tick = interval(self.config.checkpoint_every);
        let mut head_tick = interval(self.config.head_poll_every);
        loop {
            tokio::select! {
                message = stream.message() => {
                    let resp = message
                        .map_err(etcd::etcd("watching the prefix"))?
                        .ok_or(TailError::WatchEnded)?;
                    if resp.canceled() {
                        self.flush(&mut p).await?;
                        self.checkpoint(&mut p).await?;
                        return Err(match resp.compact_revision() {
                            0 => TailError::WatchCancelled(resp.cancel_reason().to_string()),
                            _ => TailError::Compacted,
                        });
                    }
                    for (revision, changes) in etcd::revisions(self.prefix, resp.events()) {
                        p.buffer.extend(state.apply(revision, &changes));
                        p.derived = revision;
                    }
                    if p.buffer.len() >= self.config.batch_max {
                        self.flush(&mut p).await?;
                    }
                }
                _ = flush_tick.tick() => self.flush(&mut p).await?,
                _ = checkpoint_tick.tick() => self.checkpoint(&mut p).await?,
                _ = head_tick.tick() => {
                    let (now_cluster, head) = etcd::head(&client, self.prefix, timeout).await?;
                    if now_cluster != cluster_id {
                        return Err(TailError::ClusterChanged { was: cluster_id, now: now_cluster });
                    }
                    if head < p.written {
                        return Err(TailError::Restored { cluster_id, behind: p.written - head });
                    }
                }
                _ = stop.wait_for(|s| *s) => {
                    self.flush(&mut p).await?;
                    self.checkpoint(&mut p).await?;
                    info!(cluster_id, "the tailer stopped");
                    return Ok(());
                }
            }
        }
    }

    /// Writes the buffer; then everything derived is written.
    async fn flush(&self, p: &mut Progress) -> Result<(), TailError> {
        if !p.buffer.is_empty() {
            for chunk in p.buffer.chunks(self.config.batch_max.max(1)) {
                self.store.write(p.cluster_id, chunk).await?;
            }
            for event in p.buffer.drain(..) {
                self.metrics.written(event.kind);
            }
        }
        p.written = p.derived;
        self.metrics.set_written_revision(p.written);
        Ok(())
    }

    /// Records that everything up to `written` is in the store.
    async fn checkpoint(&self, p: &mut Progress) -> Result<(), TailError> {
        if p.written > p.checkpointed {
            self.store.put_checkpoint(p.cluster_id, p.written).await?;
            p.checkpointed = p.written;
        }
        Ok(())
    }
}

fn interval(every: Duration) -> tokio::time::Interval {
    let every = every.max(Duration::from_millis(10));
    let mut i = tokio::time::interval_at(Instant::now() + every, every);
    i.set_missed_tick_behavior(MissedTickBehavior::Delay);
    i
}
