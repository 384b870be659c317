//! The coord tier on a cluster of its own in the simulation (ADR-07,
//! `SimConfig::coord_keys`, the `tiers` presets): 5 of 12 keys in the
//! `simc` namespace, which a coord-tier class names, routed between the
//! tiers by the namespace bindings (docs/tiers-and-shards.md).
//!
//! - A policy change half rolled out (`SimConfig::coord_rollout`): the
//!   odd-numbered arbiters read files in which no coord-tier class names
//!   `simc`. The binding written first decides for every arbiter; the
//!   others refuse the keys. The runs pass.
//! - The judge has teeth: with each arbiter keeping the bindings in a store
//!   of its own (`FaultKnobs::tier_bindings_unshared`), each routes `simc`
//!   by the policies it read, one grants a key on the coord tier while
//!   another grants it on the lock cluster, and the checker finds it
//!   (seeds 1–10 of `tiers` all fail this way, 141 and 142 below too).

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use latchkey_checker::{Function, Outcome};
use latchkey_sim::simulation::{SimConfig, SimRun, run};

fn with_rollout(seed: u64, preset: &str, unshared: bool) -> SimRun {
    let mut cfg = SimConfig::preset(preset, seed).expect("preset");
    cfg.min_ops = 4000;
    cfg.coord_rollout = true;
    cfg.faults.tier_bindings_unshared = unshared;
    let result = run(&cfg);
    let how = if unshared { ", bindings unshared" } else { "" };
    println!("{} [{preset}, policy rollout{how}]", result.summary());
    result
}

/// Acquires of keys in the coord namespace that were granted.
fn coord_grants(result: &SimRun) -> usize {
    result
        .history
        .ops()
        .iter()
        .filter(|op| op.f == Function::Acquire)
        .filter(|op| op.key.as_deref().is_some_and(|k| k.starts_with("simc/")))
        .filter(|op| {
            op.completion
                .as_ref()
                .is_some_and(|c| c.outcome == Outcome::Ok)
        })
        .count()
}

#[test]
fn a_policy_rollout_is_held_to_the_namespaces_binding() {
    for (seed, preset) in [(141, "tiers"), (142, "tiers-three-arbiters")] {
        let result = with_rollout(seed, preset, false);
        assert!(result.ok(), "{}", result.failure());
        assert!(
            coord_grants(&result) > 0,
            "seed {seed}: no key of the coord namespace was granted"
        );
    }
}

#[test]
fn bindings_kept_per_arbiter_are_found() {
    for (seed, preset) in [(141, "tiers"), (142, "tiers-three-arbiters")] {
        let result = with_rollout(seed, preset, true);
        assert!(
            !result.ok(),
            "seed {seed} ({preset}): no violation found with each arbiter routing the coord namespace by its own policies"
        );
    }
}
