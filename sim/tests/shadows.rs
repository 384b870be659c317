//! Shadow sessions on entity shards across a restore of the lock cluster
//! (docs/tiers-and-shards.md, "Open"): the `shards` presets with 3 % long
//! holds, which keep a key past a session's TTL while the nemesis restores
//! the lock cluster. A restore to a snapshot taken after a session opened
//! and before it marked a shard loses the mark; the shadow is then no
//! longer renewed and expires under a session KeepAlive still answers
//! alive, and the write judge finds the holder writing with its hold gone.
//!
//! Ignored until the fix lands (run them with `--ignored`): they fail as
//! built, and renewing every connected shard makes them pass.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use latchkey_sim::simulation::{SimConfig, run};

fn with_long_holds(seed: u64, preset: &str) {
    let mut cfg = SimConfig::preset(preset, seed).expect("preset");
    cfg.min_ops = 5000;
    cfg.long_hold_percent = 3;
    let result = run(&cfg);
    println!("{} [{preset}, 3 % long holds]", result.summary());
    assert!(result.ok(), "{}", result.failure());
}

#[test]
#[ignore = "open: a restore of the lock cluster loses shadow marks (docs/tiers-and-shards.md)"]
fn a_shadow_whose_mark_a_restore_lost_is_still_renewed() {
    with_long_holds(6, "shards");
}

#[test]
#[ignore = "open: a restore of the lock cluster loses shadow marks (docs/tiers-and-shards.md)"]
fn a_shadow_whose_mark_a_restore_lost_is_still_renewed_three_arbiters() {
    with_long_holds(7, "shards-three-arbiters");
    with_long_holds(20, "shards-three-arbiters");
}
