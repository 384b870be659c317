//! Per-class hook metrics, kept in process: invocations, allows, denials by
//! reason, failures by kind and a latency histogram. There is no metrics
//! endpoint yet; [`Metrics::snapshot`] is read by tests and the benchmark and
//! logged by the arbiter. Labels are class names, reasons and failure kinds
//! only (ADR-22): never a key or an identity.

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use hdrhistogram::Histogram;

use crate::call::FailureKind;

/// One class's numbers.
#[derive(Debug, Clone)]
pub struct ClassMetrics {
    pub invocations: u64,
    pub allowed: u64,
    /// Denials the hook decided, by its reason code.
    pub denials: BTreeMap<String, u64>,
    /// Calls that failed (and were denied, fail closed), by kind.
    pub failures: BTreeMap<FailureKind, u64>,
    /// Module loads refused for this class (unreadable, invalid, refusing its
    /// config): every refusal counts, though each is logged once per change.
    pub module_refusals: u64,
    /// After-release calls not run because too many were already pending
    /// (the arbiter bounds them rather than let them pile up).
    pub after_release_dropped: u64,
    /// Latency of whole calls (instantiate, copy in, run, read out), in ns.
    /// `None` only if the histogram could not be made (it always can).
    pub latency_ns: Option<Histogram<u64>>,
}

impl ClassMetrics {
    fn new() -> Self {
        Self {
            invocations: 0,
            allowed: 0,
            denials: BTreeMap::new(),
            failures: BTreeMap::new(),
            module_refusals: 0,
            after_release_dropped: 0,
            // 1 ns .. 60 s, two significant digits: a few KiB per class.
            latency_ns: Histogram::new_with_bounds(1, 60_000_000_000, 2).ok(),
        }
    }

    pub fn failures_total(&self) -> u64 {
        self.failures.values().sum()
    }

    pub fn denials_total(&self) -> u64 {
        self.denials.values().sum()
    }

    /// The latency at quantile `q` (0..=1).
    pub fn latency(&self, q: f64) -> Duration {
        Duration::from_nanos(
            self.latency_ns
                .as_ref()
                .map_or(0, |h| h.value_at_quantile(q)),
        )
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    classes: Mutex<HashMap<String, ClassMetrics>>,
}

pub(crate) enum Recorded<'a> {
    Allowed,
    Denied(&'a str),
    Failed(FailureKind),
}

impl Metrics {
    pub(crate) fn record(&self, class: &str, took: Duration, what: Recorded<'_>) {
        let mut classes = self.classes.lock();
        let m = match classes.get_mut(class) {
            Some(m) => m,
            None => classes
                .entry(class.to_string())
                .or_insert_with(ClassMetrics::new),
        };
        m.invocations += 1;
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX).max(1);
        if let Some(h) = &mut m.latency_ns {
            h.saturating_record(ns);
        }
        match what {
            Recorded::Allowed => m.allowed += 1,
            Recorded::Denied(reason) => match m.denials.get_mut(reason) {
                Some(n) => *n += 1,
                None => {
                    m.denials.insert(reason.to_string(), 1);
                }
            },
            Recorded::Failed(kind) => *m.failures.entry(kind).or_insert(0) += 1,
        }
    }

    /// Counts one refused module load for `class`.
    pub(crate) fn record_refusal(&self, class: &str) {
        let mut classes = self.classes.lock();
        match classes.get_mut(class) {
            Some(m) => m.module_refusals += 1,
            None => {
                let mut m = ClassMetrics::new();
                m.module_refusals = 1;
                classes.insert(class.to_string(), m);
            }
        }
    }

    /// Counts one after-release call for `class` dropped unrun.
    pub(crate) fn record_release_dropped(&self, class: &str) {
        let mut classes = self.classes.lock();
        match classes.get_mut(class) {
            Some(m) => m.after_release_dropped += 1,
            None => {
                let mut m = ClassMetrics::new();
                m.after_release_dropped = 1;
                classes.insert(class.to_string(), m);
            }
        }
    }

    /// Every class's numbers now.
    pub fn snapshot(&self) -> BTreeMap<String, ClassMetrics> {
        let classes = self.classes.lock();
        classes
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    pub fn class(&self, class: &str) -> Option<ClassMetrics> {
        self.classes.lock().get(class).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_outcome() {
        let m = Metrics::default();
        m.record("a", Duration::from_micros(5), Recorded::Allowed);
        m.record("a", Duration::from_micros(7), Recorded::Denied("NO"));
        m.record(
            "a",
            Duration::from_micros(9),
            Recorded::Failed(FailureKind::Timeout),
        );
        let a = m.class("a").unwrap();
        assert_eq!(
            (
                a.invocations,
                a.allowed,
                a.denials_total(),
                a.failures_total()
            ),
            (3, 1, 1, 1)
        );
        assert_eq!(a.failures.get(&FailureKind::Timeout), Some(&1));
        assert!(a.latency(1.0) >= Duration::from_micros(9));
        assert!(m.class("b").is_none());
    }
}
