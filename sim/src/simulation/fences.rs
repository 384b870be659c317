//! The shard-map fence in the simulation (ADR-09 moves): the nemesis
//! raises the lock log's fence to a shard map version some arbiters do not
//! route by yet, for a while, then lets them catch up
//! ([`FaultKnobs::map_fences`](super::FaultKnobs::map_fences)). The
//! checker knows nothing of shard maps, so the fence's own rule is judged
//! here: no grant made through an arbiter still behind the fence commits
//! after the raise did, while the arbiters that load the map go on
//! granting, and the ones behind grant again once they catch up.

use latchkey_arbiter::table::Grant;

/// One raise of the fence, from its commit until the arbiters behind it
/// caught up.
#[derive(Debug, Clone)]
pub(crate) struct Window {
    pub(crate) version: u64,
    /// The epoch the raise committed in: revisions are compared within it
    /// (a restore and advance reuse revisions in a new epoch).
    pub(crate) epoch: u32,
    /// The raise's commit revision.
    pub(crate) raised: i64,
    /// The arbiters routing by an older map meanwhile.
    pub(crate) behind: Vec<usize>,
    /// The log's revision when they caught up (`None`: still behind when
    /// the run ended): their grants after it are theirs to make.
    pub(crate) caught_up: Option<i64>,
}

/// The fences of one run and the grants to judge against them.
#[derive(Debug, Default)]
pub(crate) struct Fences {
    /// The newest shard map version (0: never sharded).
    pub(crate) version: u64,
    pub(crate) windows: Vec<Window>,
    /// Every acquire answered OK: through which arbiter, in which epoch,
    /// at which revision.
    grants: Vec<(usize, u32, i64)>,
    /// Acquires refused because the arbiter was behind the fence.
    pub(crate) refused: u64,
}

/// What the fences did in a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FenceReport {
    /// Raises of the fence.
    pub raised: usize,
    /// Acquires refused because their arbiter was behind the fence.
    pub refused: u64,
    /// Raises after which an arbiter that was behind granted again.
    pub granted_again: usize,
    /// Grants through an arbiter behind the fence that committed after the
    /// raise: each one breaks the fence's rule.
    pub violations: Vec<String>,
}

impl Fences {
    /// Notes an acquire answered OK through `arbiter`.
    pub(crate) fn granted(&mut self, arbiter: usize, grant: &Grant) {
        self.grants.push((arbiter, grant.epoch, grant.revision));
    }

    pub(crate) fn report(&self) -> FenceReport {
        let mut violations = Vec::new();
        let mut granted_again = 0;
        for w in &self.windows {
            let behind = |(arbiter, ..): &&(usize, u32, i64)| w.behind.contains(arbiter);
            for (arbiter, _, revision) in self.grants.iter().filter(behind).filter(|(_, e, r)| {
                *e == w.epoch && *r > w.raised && w.caught_up.is_none_or(|c| *r <= c)
            }) {
                violations.push(format!(
                    "arbiter-{arbiter} granted at r{revision} (epoch {}), after the fence was raised to version {} at r{} and before it caught up{}",
                    w.epoch,
                    w.version,
                    w.raised,
                    w.caught_up
                        .map_or_else(|| " (it never did)".into(), |c| format!(" at r{c}")),
                ));
            }
            let again = self.grants.iter().filter(behind).any(|(_, e, r)| {
                *e > w.epoch || (*e == w.epoch && w.caught_up.is_some_and(|c| *r > c))
            });
            granted_again += usize::from(again);
        }
        FenceReport {
            raised: self.windows.len(),
            refused: self.refused,
            granted_again,
            violations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(epoch: u32, revision: i64) -> Grant {
        Grant {
            key: "k".into(),
            session: 1,
            epoch,
            revision,
        }
    }

    #[test]
    fn only_grants_behind_the_fence_inside_its_window_break_it() {
        let mut f = Fences::default();
        f.windows.push(Window {
            version: 1,
            epoch: 2,
            raised: 100,
            behind: vec![1],
            caught_up: Some(200),
        });
        // before the raise, by the arbiter that kept up, in another epoch,
        // and after the catch-up: all fine
        for (arbiter, epoch, revision) in [(1, 2, 99), (0, 2, 150), (1, 1, 150), (1, 2, 201)] {
            f.granted(arbiter, &grant(epoch, revision));
        }
        let clean = f.report();
        assert!(clean.violations.is_empty(), "{clean:?}");
        assert_eq!(clean.granted_again, 1);
        f.granted(1, &grant(2, 101));
        f.granted(1, &grant(2, 200));
        assert_eq!(f.report().violations.len(), 2);
    }
}
