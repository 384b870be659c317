//! The arbiter's Prometheus metrics (ADR-22), served on `--metrics-listen`.
//!
//! Labels are `namespace`, `class`, `outcome` and `kind` only, each from a
//! bounded set: the namespace is the first segment of the granted prefix that
//! let the call in (`_` before authorisation), the class a known class name
//! (`_` before it is known), the outcome `granted`, `granted_after_wait`,
//! `released`, `handed_over` or an error reason (`held`, `wait_timeout`, ...).
//! Never a key, an identity, a session or a token: per-key questions go to
//! `Inspect`. [`ALLOWED_LABELS`] is checked against the whole exposition by a
//! test, so a new metric cannot add a key label unnoticed.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use latchkey_hook_host::HookHost;
use latchkey_policies::{metric_label, metric_namespace};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::epoch::EpochGuard;
use crate::error::{ArbiterError, reason_name};

/// Reports (keys with a queue, waiters over all keys).
pub type WaiterTotals = Arc<dyn Fn() -> (usize, usize) + Send + Sync>;

/// Reports the quorum-loss posture ([`crate::quorum_loss::QuorumLoss::snapshot`]).
pub type QuorumStatus = Arc<dyn Fn() -> crate::quorum_loss::QuorumSnapshot + Send + Sync>;

/// Reports the open sessions as this arbiter counts them, all subjects and
/// tiers; `None` while a session cluster has no count.
pub type SessionTotals = Arc<dyn Fn() -> Option<u64> + Send + Sync>;

/// Every label name any arbiter metric may carry.
pub const ALLOWED_LABELS: &[&str] = &["namespace", "class", "outcome", "kind"];

/// The exposition's content type (OpenMetrics text, which Prometheus scrapes).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The label value before the namespace or class is known.
const UNKNOWN: &str = "_";

/// What a call has established about itself so far: filled in as it passes
/// authorisation and class lookup, read when it ends.
#[derive(Debug, Default, Clone)]
pub struct Scope {
    namespace: Option<String>,
    class: Option<String>,
    /// The call queued before its grant.
    pub waited: bool,
}

impl Scope {
    pub fn authorised(&mut self, granted_prefix: &str) {
        self.namespace = Some(metric_namespace(granted_prefix));
    }

    pub fn class(&mut self, class: &str) {
        self.class = Some(metric_label(class));
    }

    /// The namespace and class labels so far (`_` for one not known), for
    /// the trace spans' attributes (telemetry.rs): the same bounded values.
    pub fn labels(&self) -> (&str, &str) {
        (
            self.namespace.as_deref().unwrap_or(UNKNOWN),
            self.class.as_deref().unwrap_or(UNKNOWN),
        )
    }

    fn namespace_label(&self) -> String {
        self.namespace.clone().unwrap_or_else(|| UNKNOWN.into())
    }

    fn class_label(&self) -> String {
        self.class.clone().unwrap_or_else(|| UNKNOWN.into())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    namespace: String,
    class: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScopeLabels {
    namespace: String,
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

/// The outcome label of a failed call: its reason, in lower case.
fn failure(err: &ArbiterError) -> String {
    reason_name(err.reason()).to_ascii_lowercase()
}

/// Counters and histograms the handlers update, plus the state read at
/// scrape time (queues, seal, hooks).
pub struct Metrics {
    registry: Registry,
    acquires: Family<CallLabels, Counter>,
    releases: Family<CallLabels, Counter>,
    grant_wait: Family<ScopeLabels, Histogram>,
    hold: Family<ScopeLabels, Histogram>,
    renewals_refused: Family<OutcomeLabels, Counter>,
    renewals: Family<OutcomeLabels, Counter>,
    identity_bounds: Family<KindLabels, Counter>,
    ownership_lookups: Counter,
    session_count_missing: Counter,
    keepalive_paced: Family<KindLabels, Counter>,
    overload_refusals: Family<OverloadLabels, Counter>,
    /// The coord tier's seal and quorum, with the tiers split.
    coord_tier: CoordTier,
    /// New work's admission, for its gauges (set once the arbiter is built).
    admission: AdmissionGauges,
    sessions: Arc<std::sync::OnceLock<SessionTotals>>,
}

type AdmissionGauges = Arc<std::sync::OnceLock<Arc<crate::overload::Admission>>>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OverloadLabels {
    /// The work refused: open_session or acquire.
    kind: String,
    /// Why: renewals_late, queue_full or waited.
    outcome: String,
}

/// Set once, when the arbiter has a coord tier of its own.
type CoordTier = Arc<std::sync::OnceLock<(Arc<EpochGuard>, QuorumStatus)>>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

impl Metrics {
    /// Adds the coord tier's gauges (`coord_tier_sealed`, `_epoch`,
    /// `_quorum_lost`); the others are the entity cluster's.
    pub fn set_coord_tier(&self, guard: Arc<EpochGuard>, quorum: QuorumStatus) {
        let _ = self.coord_tier.set((guard, quorum));
    }

    /// Adds the new-work admission's gauges (`new_work_limit`,
    /// `new_work_in_flight`, `new_work_queued`, `renewals_late`).
    pub fn set_admission(&self, admission: Arc<crate::overload::Admission>) {
        let _ = self.admission.set(admission);
    }

    /// Records new work refused for load ([`crate::overload`]).
    pub fn overload_refused(&self, work: crate::overload::Work, why: crate::overload::Refusal) {
        self.overload_refusals
            .get_or_create(&OverloadLabels {
                kind: work.name().to_string(),
                outcome: why.name().to_string(),
            })
            .inc();
    }

    /// Adds the session count's gauges (`open_sessions`, `session_count_ready`).
    pub fn set_session_totals(&self, totals: SessionTotals) {
        let _ = self.sessions.set(totals);
    }
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// `waiters` reports (keys with a queue, waiters over all keys) at scrape time.
    pub fn new(
        waiters: WaiterTotals,
        guard: Arc<EpochGuard>,
        hooks: Arc<HookHost>,
        quorum: QuorumStatus,
    ) -> Self {
        let mut registry = Registry::with_prefix("latchkey_arbiter");
        let acquires = Family::<CallLabels, Counter>::default();
        registry.register(
            "acquires",
            "Acquire calls by namespace, class and outcome (granted, granted_after_wait, or the refusal reason)",
            acquires.clone(),
        );
        let releases = Family::<CallLabels, Counter>::default();
        registry.register(
            "releases",
            "Release calls by namespace, class (_ when refused) and outcome (released, handed_over to the next waiter, or the refusal reason)",
            releases.clone(),
        );
        let hold = Family::<ScopeLabels, Histogram>::new_with_constructor(|| {
            // 10 ms .. ~5.8 days
            Histogram::new(exponential_buckets(0.01, 4.0, 15))
        });
        registry.register(
            "hold_seconds",
            "How long released holds lasted (grant to release, by the arbiters' wall clocks)",
            hold.clone(),
        );
        let grant_wait = Family::<ScopeLabels, Histogram>::new_with_constructor(|| {
            // 0.5 ms .. ~65 s
            Histogram::new(exponential_buckets(0.0005, 2.0, 18))
        });
        registry.register(
            "grant_wait_seconds",
            "Time from an Acquire call's arrival to its grant, queueing included",
            grant_wait.clone(),
        );
        let renewals_refused = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "session_renewals_refused",
            "Keepalives refused (the stream ends; the holder fences), by reason: session_expired above all",
            renewals_refused.clone(),
        );
        let renewals = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "session_renewals",
            "Keepalives answered, by outcome: renewed in etcd, or coalesced (the session was renewed in etcd within a quarter of its TTL, so the answer came from memory)",
            renewals.clone(),
        );
        let identity_bounds = Family::<KindLabels, Counter>::default();
        registry.register(
            "identity_bound_refusals",
            "Calls refused because their identity reached a per-identity bound, by kind: sessions or waiters",
            identity_bounds.clone(),
        );
        let ownership_lookups = Counter::default();
        registry.register(
            "session_ownership_lookups",
            "KeepAlive ownership lookups sent to etcd (a read of a session's record, for a session named on a stream for the first time, whoever's it turns out to be); paced per identity",
            ownership_lookups.clone(),
        );
        let session_count_missing = Counter::default();
        registry.register(
            "session_opens_uncounted",
            "OpenSession calls refused UNAVAILABLE because this arbiter had no count of the open sessions within the call's wait (it had just started, or its watch on the session index was being set up again)",
            session_count_missing.clone(),
        );
        let keepalive_paced = Family::<KindLabels, Counter>::default();
        registry.register(
            "keepalive_paced",
            "Times a KeepAlive stream stopped being read because its identity had spent its budget, by kind: ownership_lookups or renewals (nothing is refused; HTTP/2 flow control slows the sender)",
            keepalive_paced.clone(),
        );
        let overload_refusals = Family::<OverloadLabels, Counter>::default();
        registry.register(
            "overload_refusals",
            "New work refused UNAVAILABLE / OVERLOADED so that established sessions keep renewing, by kind (open_session, acquire) and outcome (renewals_late; queue_full; waited: its longest, or to its deadline)",
            overload_refusals.clone(),
        );
        let coord_tier = CoordTier::default();
        let admission = AdmissionGauges::default();
        let sessions = Arc::new(std::sync::OnceLock::new());
        registry.register_collector(Box::new(StateCollector {
            waiters,
            guard,
            hooks,
            quorum,
            coord_tier: coord_tier.clone(),
            admission: admission.clone(),
            sessions: sessions.clone(),
        }));
        Self {
            registry,
            acquires,
            releases,
            grant_wait,
            hold,
            renewals_refused,
            renewals,
            identity_bounds,
            ownership_lookups,
            session_count_missing,
            keepalive_paced,
            overload_refusals,
            coord_tier,
            admission,
            sessions,
        }
    }

    /// Records one KeepAlive ownership lookup, as it is sent to etcd.
    pub fn ownership_lookup(&self) {
        self.ownership_lookups.inc();
    }

    /// Records an OpenSession refused for want of a session count.
    pub fn session_count_missing(&self) {
        self.session_count_missing.inc();
    }

    /// Records a KeepAlive stream that stopped being read for its
    /// identity's budget (`kind`: ownership_lookups or renewals).
    pub fn keepalive_paced(&self, kind: &'static str) {
        self.keepalive_paced
            .get_or_create(&KindLabels {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Records a call refused by a per-identity bound (`kind`: sessions or
    /// waiters; never the identity).
    pub fn identity_bound_refused(&self, kind: &'static str) {
        self.identity_bounds
            .get_or_create(&KindLabels {
                kind: kind.to_string(),
            })
            .inc();
    }

    /// Records one Acquire call's end.
    pub fn acquire<T>(&self, scope: &Scope, result: &Result<T, ArbiterError>, elapsed: Duration) {
        let outcome = match result {
            Ok(_) if scope.waited => "granted_after_wait".to_string(),
            Ok(_) => "granted".to_string(),
            Err(e) => failure(e),
        };
        if result.is_ok() {
            self.grant_wait
                .get_or_create(&ScopeLabels {
                    namespace: scope.namespace_label(),
                    class: scope.class_label(),
                })
                .observe(elapsed.as_secs_f64());
        }
        self.acquires
            .get_or_create(&CallLabels {
                namespace: scope.namespace_label(),
                class: scope.class_label(),
                outcome,
            })
            .inc();
    }

    /// Records one Release call's end; `handed_over` when the key went
    /// straight to the next waiter in the same transaction, `held_for` the
    /// hold's length when its record was read.
    pub fn release<T>(
        &self,
        scope: &Scope,
        result: &Result<T, ArbiterError>,
        handed_over: bool,
        held_for: Option<Duration>,
    ) {
        let outcome = match result {
            Ok(_) if handed_over => "handed_over".to_string(),
            Ok(_) => "released".to_string(),
            Err(e) => failure(e),
        };
        if let (Ok(_), Some(held)) = (result, held_for) {
            self.hold
                .get_or_create(&ScopeLabels {
                    namespace: scope.namespace_label(),
                    class: scope.class_label(),
                })
                .observe(held.as_secs_f64());
        }
        self.releases
            .get_or_create(&CallLabels {
                namespace: scope.namespace_label(),
                class: scope.class_label(),
                outcome,
            })
            .inc();
    }

    /// Records one keepalive answered: `renewed` in etcd or `coalesced`.
    pub fn renewal(&self, outcome: &'static str) {
        self.renewals
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Records a keepalive stream ended by a refusal (an expired session above all).
    pub fn renewal_refused(&self, err: &ArbiterError) {
        self.renewals_refused
            .get_or_create(&OutcomeLabels {
                outcome: failure(err),
            })
            .inc();
    }

    /// The text exposition (OpenMetrics).
    pub fn encode(&self) -> Result<String, fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Gauges and hook counters read at scrape time.
struct StateCollector {
    waiters: WaiterTotals,
    guard: Arc<EpochGuard>,
    hooks: Arc<HookHost>,
    quorum: QuorumStatus,
    coord_tier: CoordTier,
    admission: AdmissionGauges,
    sessions: Arc<std::sync::OnceLock<SessionTotals>>,
}

impl fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateCollector").finish_non_exhaustive()
    }
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> fmt::Result {
    let g = ConstGauge::new(v);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        if let Some(admission) = self.admission.get()
            && admission.enabled()
        {
            let g = admission.gauges();
            gauge(
                &mut encoder,
                "new_work_limit",
                "New work (OpenSession, Acquire) this arbiter runs at once now: it falls while renewals run late and rises while they are on time",
                i64::from(g.limit),
            )?;
            gauge(
                &mut encoder,
                "new_work_in_flight",
                "New work running now (under new_work_limit)",
                i64::from(g.in_flight),
            )?;
            gauge(
                &mut encoder,
                "new_work_queued",
                "New work waiting for a place under new_work_limit",
                i64::from(g.queued),
            )?;
            gauge(
                &mut encoder,
                "renewals_late",
                "1 while the last window's renewals ran later than --renewal-latency-target-ms: new work that finds the limit full is refused at once",
                i64::from(g.shedding),
            )?;
        }
        let (keys, waiters) = (self.waiters)();
        gauge(
            &mut encoder,
            "waiters",
            "Acquire calls queued in this arbiter, all keys",
            i64::try_from(waiters).unwrap_or(i64::MAX),
        )?;
        gauge(
            &mut encoder,
            "contended_keys",
            "Keys with at least one queued waiter in this arbiter",
            i64::try_from(keys).unwrap_or(i64::MAX),
        )?;
        gauge(
            &mut encoder,
            "sealed",
            "1 while the arbiter refuses every grant (a restored or foreign lock log; see admin status)",
            i64::from(self.guard.seal_reason().is_some()),
        )?;
        gauge(
            &mut encoder,
            "epoch",
            "The epoch this arbiter serves (0 before the first etcd read)",
            self.guard.state().map_or(0, |s| i64::from(s.epoch())),
        )?;
        let quorum = (self.quorum)();
        gauge(
            &mut encoder,
            "quorum_lost",
            "1 while the lock cluster has no etcd majority as this arbiter's probe sees it: closed classes refuse, open classes grant unprotected from memory (ADR-04)",
            i64::from(quorum.lost),
        )?;
        gauge(
            &mut encoder,
            "unprotected_memory_grants",
            "Live unprotected grants from this arbiter's memory (token 0), made during a quorum loss",
            i64::try_from(quorum.memory_grants).unwrap_or(i64::MAX),
        )?;
        gauge(
            &mut encoder,
            "quorum_loss_spool_bytes",
            "Bytes of unprotected grants spooled and not yet collected by the audit tailer (bounded by --quorum-loss-spool-bytes)",
            i64::try_from(quorum.spool_bytes).unwrap_or(i64::MAX),
        )?;
        if let Some((guard, quorum)) = self.coord_tier.get() {
            gauge(
                &mut encoder,
                "coord_tier_sealed",
                "1 while the coord tier (its own cluster, --split-tiers) refuses every grant",
                i64::from(guard.seal_reason().is_some()),
            )?;
            gauge(
                &mut encoder,
                "coord_tier_epoch",
                "The epoch the coord tier serves",
                guard.state().map_or(0, |s| i64::from(s.epoch())),
            )?;
            gauge(
                &mut encoder,
                "coord_tier_quorum_lost",
                "1 while the coord tier's cluster has no etcd majority as this arbiter's probe sees it",
                i64::from(quorum().lost),
            )?;
        }
        if let Some(sessions) = self.sessions.get() {
            let counted = sessions();
            gauge(
                &mut encoder,
                "session_count_ready",
                "1 while this arbiter counts the open sessions from etcd (read at start, then followed by a watch); 0 before the first count and while the watch is set up again, when OpenSession waits and then refuses UNAVAILABLE",
                i64::from(counted.is_some()),
            )?;
            gauge(
                &mut encoder,
                "open_sessions",
                "Open sessions in etcd as this arbiter's watch counts them, every identity and tier (0 while the count is not ready)",
                counted.map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX)),
            )?;
        }
        {
            let c = ConstCounter::new(quorum.unprotected_grants_total);
            c.encode(encoder.encode_descriptor(
                "unprotected_grants",
                "Unprotected grants made from memory during quorum losses since the start",
                None,
                c.metric_type(),
            )?)?;
        }

        let snapshot = self.hooks.metrics().snapshot();
        let classes = || snapshot.iter().map(|(c, m)| (metric_label(c), m));
        let mut family = |name: &str, help: &str, rows: Vec<(Vec<(&str, String)>, u64)>| {
            let mut m = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (labels, v) in rows {
                ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
            }
            Ok::<(), fmt::Error>(())
        };
        family(
            "hook_invocations",
            "Class hook calls, by class",
            classes()
                .map(|(c, m)| (vec![("class", c)], m.invocations))
                .collect(),
        )?;
        family(
            "hook_denials",
            "Class hook calls that denied the grant, by class",
            classes()
                .map(|(c, m)| (vec![("class", c)], m.denials.values().sum()))
                .collect(),
        )?;
        family(
            "hook_module_refusals",
            "Class hook module loads refused (missing, invalid, refusing its config), by class; logged once per change, counted every time",
            classes()
                .map(|(c, m)| (vec![("class", c)], m.module_refusals))
                .collect(),
        )?;
        family(
            "hook_after_release_dropped",
            "after_release hook calls dropped because too many were pending (the release itself went through), by class",
            classes()
                .map(|(c, m)| (vec![("class", c)], m.after_release_dropped))
                .collect(),
        )?;
        family(
            "hook_failures",
            "Class hook calls that failed (and denied, fail closed), by class and kind",
            classes()
                .flat_map(|(c, m)| {
                    m.failures.iter().map(move |(kind, v)| {
                        (
                            vec![("class", c.clone()), ("kind", metric_label(kind.as_str()))],
                            *v,
                        )
                    })
                })
                .collect(),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use latchkey_hook_host::HostSettings;

    use super::*;

    fn metrics(waiters: (usize, usize)) -> Metrics {
        Metrics::new(
            Arc::new(move || waiters),
            Arc::new(EpochGuard::default()),
            Arc::new(HookHost::new(HostSettings::default())),
            Arc::new(crate::quorum_loss::QuorumSnapshot::default),
        )
    }

    fn scope(prefix: &str, class: &str) -> Scope {
        let mut s = Scope::default();
        s.authorised(prefix);
        s.class(class);
        s
    }

    /// Every label name used by a sample line of the exposition.
    fn label_names(text: &str) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((_, rest)) = line.split_once('{') else {
                continue;
            };
            let Some((labels, _)) = rest.rsplit_once('}') else {
                continue;
            };
            for pair in labels.split(',') {
                if let Some((name, _)) = pair.split_once('=') {
                    names.insert(name.to_string());
                }
            }
        }
        names
    }

    #[test]
    fn calls_are_counted_by_namespace_class_and_outcome() -> Result<(), fmt::Error> {
        let m = metrics((2, 5));
        let granted = scope("payments/ledger", "short");
        m.acquire(&granted, &Ok(()), Duration::from_millis(3));
        let mut waited = scope("payments/ledger", "short");
        waited.waited = true;
        m.acquire(&waited, &Ok(()), Duration::from_secs(2));
        m.acquire::<()>(
            &granted,
            &Err(ArbiterError::Held { key: "x".into() }),
            Duration::ZERO,
        );
        m.acquire::<()>(
            &Scope::default(),
            &Err(ArbiterError::NotAuthorised),
            Duration::ZERO,
        );
        m.release(&granted, &Ok(()), true, Some(Duration::from_secs(4)));
        m.release(&granted, &Ok(()), false, None);
        m.renewal_refused(&ArbiterError::SessionExpired { session: 7 });
        let text = m.encode()?;
        for line in [
            r#"latchkey_arbiter_acquires_total{namespace="payments",class="short",outcome="granted"} 1"#,
            r#"latchkey_arbiter_acquires_total{namespace="payments",class="short",outcome="granted_after_wait"} 1"#,
            r#"latchkey_arbiter_acquires_total{namespace="payments",class="short",outcome="held"} 1"#,
            r#"latchkey_arbiter_acquires_total{namespace="_",class="_",outcome="not_authorised"} 1"#,
            r#"latchkey_arbiter_releases_total{namespace="payments",class="short",outcome="handed_over"} 1"#,
            r#"latchkey_arbiter_releases_total{namespace="payments",class="short",outcome="released"} 1"#,
            r#"latchkey_arbiter_hold_seconds_count{namespace="payments",class="short"} 1"#,
            r#"latchkey_arbiter_hold_seconds_sum{namespace="payments",class="short"} 4.0"#,
            r#"latchkey_arbiter_session_renewals_refused_total{outcome="session_expired"} 1"#,
            r#"latchkey_arbiter_grant_wait_seconds_count{namespace="payments",class="short"} 2"#,
            "latchkey_arbiter_waiters 5",
            "latchkey_arbiter_contended_keys 2",
            "latchkey_arbiter_sealed 0",
            "latchkey_arbiter_epoch 0",
            "latchkey_arbiter_quorum_lost 0",
            "latchkey_arbiter_unprotected_memory_grants 0",
            "latchkey_arbiter_quorum_loss_spool_bytes 0",
            "latchkey_arbiter_unprotected_grants_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        Ok(())
    }

    /// ADR-22's lint: no metric may carry a label outside the bounded set
    /// (a key, identity, session or token label would fail here).
    #[test]
    fn only_bounded_labels_are_ever_used() -> Result<(), fmt::Error> {
        let m = metrics((1, 1));
        let s = scope("demo", "demo");
        m.acquire(&s, &Ok(()), Duration::from_millis(1));
        m.acquire::<()>(
            &s,
            &Err(ArbiterError::WaitTimeout { key: "k".into() }),
            Duration::ZERO,
        );
        m.release(&s, &Ok(()), false, Some(Duration::from_millis(40)));
        m.renewal_refused(&ArbiterError::SessionExpired { session: 1 });
        m.overload_refused(
            crate::overload::Work::Acquire,
            crate::overload::Refusal::RenewalsLate,
        );
        let text = m.encode()?;
        let names = label_names(&text);
        // `le` is the histogram's bucket bound, part of every histogram.
        let allowed: BTreeSet<String> = ALLOWED_LABELS
            .iter()
            .chain(&["le"])
            .map(|s| s.to_string())
            .collect();
        assert!(!names.is_empty(), "no labels parsed from:\n{text}");
        assert!(names.is_subset(&allowed), "labels {names:?} in:\n{text}");
        assert!(!text.contains("\"k\""), "{text}");
        Ok(())
    }

    #[test]
    fn keepalive_lookups_and_pacing_are_counted_with_bounded_labels() -> Result<(), fmt::Error> {
        let m = metrics((0, 0));
        m.ownership_lookup();
        m.ownership_lookup();
        m.keepalive_paced("ownership_lookups");
        m.keepalive_paced("renewals");
        let text = m.encode()?;
        for line in [
            "latchkey_arbiter_session_ownership_lookups_total 2",
            r#"latchkey_arbiter_keepalive_paced_total{kind="ownership_lookups"} 1"#,
            r#"latchkey_arbiter_keepalive_paced_total{kind="renewals"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in:\n{text}");
        }
        let allowed: BTreeSet<String> = ALLOWED_LABELS.iter().map(|s| s.to_string()).collect();
        assert!(label_names(&text).is_subset(&allowed), "{text}");
        Ok(())
    }

    #[test]
    fn label_values_are_sanitised() {
        let s = scope("we ird.ns/x", "cla\"ss");
        assert_eq!(s.namespace_label(), "we_ird_ns");
        assert_eq!(s.class_label(), "cla_ss");
        assert_eq!(Scope::default().namespace_label(), "_");
    }
}
