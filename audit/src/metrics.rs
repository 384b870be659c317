//! The tailer's Prometheus metrics, served on `--metrics-listen` as the
//! arbiter serves its own (OpenMetrics text on `GET /metrics`). The only
//! label is `kind`, one of the event kinds: never a key, an identity or a
//! revision of a grant (ADR-22). No value is a revision either: etcd's
//! head, the written revision and the checkpoint are each, at times, a
//! live grant's revision (its token's low half), so only their difference,
//! the lag, is exported.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::event::Kind;

/// Every label name any metric here may carry.
pub const ALLOWED_LABELS: &[&str] = &["kind"];

/// The exposition's content type.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

pub struct Metrics {
    registry: Registry,
    events: Family<KindLabels, Counter>,
    pub gaps: Counter,
    pub store_errors: Counter,
    pub etcd_errors: Counter,
    /// The last revision whose events are all written: for the lag only,
    /// never exported.
    written_revision: AtomicI64,
    pub lag_revisions: Gauge,
    pub lag_seconds: Gauge<f64, AtomicU64>,
    pub lag_alarm: Gauge,
    pub restore_detected: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("latchkey_audit");
        let events = Family::<KindLabels, Counter>::default();
        registry.register(
            "events_written",
            "Events written to the store, by kind (replays of events already there included)",
            events.clone(),
        );
        // Every kind from the start, so a rate over a kind never starts undefined.
        for kind in Kind::ALL {
            events
                .get_or_create(&KindLabels {
                    kind: kind.as_str().into(),
                })
                .inc_by(0);
        }
        let gaps = Counter::default();
        registry.register(
            "gaps",
            "Gaps recorded: revisions etcd compacted before the tailer read them",
            gaps.clone(),
        );
        let store_errors = Counter::default();
        registry.register(
            "store_errors",
            "Failed writes or reads of the audit store (each retried from the checkpoint)",
            store_errors.clone(),
        );
        let etcd_errors = Counter::default();
        registry.register(
            "etcd_errors",
            "Failed etcd reads or watches (each retried from the checkpoint)",
            etcd_errors.clone(),
        );
        let lag_revisions = Gauge::default();
        registry.register(
            "lag_revisions",
            "Revisions etcd has that the tailer has not written",
            lag_revisions.clone(),
        );
        let lag_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "lag_seconds",
            "How long the oldest revision not yet written has existed (by the tailer's polls)",
            lag_seconds.clone(),
        );
        let lag_alarm = Gauge::default();
        registry.register(
            "lag_alarm",
            "1 while the lag exceeds half the configured compaction window: events will be lost to compaction unless the tailer catches up",
            lag_alarm.clone(),
        );
        let restore_detected = Gauge::default();
        registry.register(
            "restore_detected",
            "1 while etcd's revision is below the checkpoint (the lock log was restored from a snapshot); the tailer writes nothing until an operator acts",
            restore_detected.clone(),
        );
        Self {
            registry,
            events,
            gaps,
            store_errors,
            etcd_errors,
            written_revision: AtomicI64::new(0),
            lag_revisions,
            lag_seconds,
            lag_alarm,
            restore_detected,
        }
    }

    pub fn set_written_revision(&self, revision: i64) {
        self.written_revision.store(revision, Ordering::SeqCst);
    }

    pub fn written_revision(&self) -> i64 {
        self.written_revision.load(Ordering::SeqCst)
    }

    pub fn written(&self, kind: Kind) {
        self.events
            .get_or_create(&KindLabels {
                kind: kind.as_str().into(),
            })
            .inc();
    }

    pub fn text(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// When the lag means events are about to be lost: past half of either
/// compaction window (time, as etcd's periodic auto-compaction; revisions,
/// as its revision mode).
#[derive(Debug, Clone, Copy, Default)]
pub struct AlarmAt {
    pub window: Option<Duration>,
    pub window_revisions: Option<i64>,
}

impl AlarmAt {
    pub fn alarmed(&self, lag_revisions: i64, lag: Duration) -> bool {
        self.window.is_some_and(|w| lag > w / 2)
            || self.window_revisions.is_some_and(|w| lag_revisions > w / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alarms_at_half_of_either_window() {
        let at = AlarmAt {
            window: Some(Duration::from_secs(600)),
            window_revisions: Some(1000),
        };
        assert!(!at.alarmed(500, Duration::from_secs(300)));
        assert!(at.alarmed(501, Duration::ZERO));
        assert!(at.alarmed(0, Duration::from_secs(301)));
        assert!(!AlarmAt::default().alarmed(i64::MAX, Duration::MAX));
    }

    #[test]
    fn only_kind_labels_and_every_kind_from_the_start() {
        let m = Metrics::new();
        m.written(Kind::Expiry);
        let text = m.text().unwrap();
        assert!(
            text.contains("latchkey_audit_events_written_total{kind=\"expiry\"} 1"),
            "{text}"
        );
        assert!(text.contains("kind=\"force-release\""), "{text}");
        assert!(text.contains("latchkey_audit_lag_alarm 0"), "{text}");
        m.set_written_revision(123_456);
        let text = m.text().unwrap();
        assert!(!text.contains("123456"), "a revision exported: {text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            if let Some(labels) = line.split_once('{').map(|(_, r)| r) {
                for pair in labels.trim_end_matches(|c| c != '}').split(',') {
                    let name = pair.split('=').next().unwrap_or("").trim_matches('}');
                    assert!(ALLOWED_LABELS.contains(&name), "label {name} in {line}");
                }
            }
        }
    }
}
