//! Shadow sessions on entity shards across a restore of the lock cluster
//! (docs/tiers-and-shards.md, "marks after a restore"): the `shards`
//! presets with 3 % long holds, which keep a key past a session's TTL while
//! the nemesis restores the lock cluster.
//!
//! - A restore to a snapshot taken after a session opened and before it
//!   marked a shard takes the mark back. Trusted anyway, the shadow it named
//!   is no longer renewed and expires under a session KeepAlive still
//!   answers alive, and the write judge finds the holder writing with its
//!   hold gone (`FaultKnobs::shadow_marks_trusted`, seed 28 of
//!   `shards`). As built, the marks are known incomplete after the epoch
//!   advance, renewed on every shard, marked again and vouched for.
//! - A restore to before a session opened loses the session. Its shadows
//!   were revoked when a renewal found it gone, freeing keys on other
//!   shards while the holder's fence deadline still ran: seeds 14 and 24 of
//!   `shards-three-arbiters` showed a double grant. They are left to expire.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use latchkey_sim::simulation::{SimConfig, SimRun, run};

fn with_long_holds(seed: u64, preset: &str, trusted: bool) -> SimRun {
    let mut cfg = SimConfig::preset(preset, seed).expect("preset");
    cfg.min_ops = 5000;
    cfg.long_hold_percent = 3;
    cfg.faults.shadow_marks_trusted = trusted;
    let result = run(&cfg);
    let how = if trusted { ", marks trusted" } else { "" };
    println!("{} [{preset}, 3 % long holds{how}]", result.summary());
    result
}

#[test]
fn a_shadow_whose_mark_a_restore_took_back_is_still_renewed() {
    let result = with_long_holds(28, "shards", false);
    assert!(result.ok(), "{}", result.failure());
}

/// The judge has teeth: the same seed with the marks trusted after a
/// restore fails.
#[test]
fn trusting_the_marks_after_a_restore_is_found() {
    let result = with_long_holds(28, "shards", true);
    assert!(
        !result.ok(),
        "seed 28: no violation found with the shadow marks trusted after a restore"
    );
}

#[test]
fn a_session_lost_to_a_restore_keeps_its_shard_holds_to_the_end_of_its_shadows() {
    for seed in [14, 24] {
        let result = with_long_holds(seed, "shards-three-arbiters", false);
        assert!(result.ok(), "{}", result.failure());
    }
}
