//! The checker's rules for shared holders' guarded reads (issue 34), held
//! to the reference fence's rule (docs/fencing.md, "Fenced reads"): a read
//! with token `t` is accepted only if no write with a larger token has
//! landed, and raises the record's read mark to `t`, after which no write
//! with a token at or below `t` lands. A read's `seq` is the record's write
//! count it saw (0 before any write), in the writes' own numbering.

use latchkey_checker::{
    CheckOptions, Function, History, HistoryBuilder, Outcome, Verdict, ViolationKind, check, token,
};

const K: &str = "bench/gate/k0";

fn t(rev: u64) -> u64 {
    token(1, rev)
}

fn verdict(h: &History) -> (Verdict, Vec<ViolationKind>) {
    let report = check(h, &CheckOptions::default());
    let v = report
        .keys
        .iter()
        .map(|k| k.verdict)
        .max_by_key(|v| match v {
            Verdict::Linearizable => 0,
            Verdict::Inconclusive => 1,
            Verdict::Violation => 2,
        })
        .unwrap_or(Verdict::Linearizable);
    (v, report.violations.iter().map(|v| v.kind).collect())
}

fn shared_acquired(b: &mut HistoryBuilder, p: &str, tok: u64) {
    let op = b.acquire(p, K);
    b.shared(op).granted(op, tok);
}

fn shared_released(b: &mut HistoryBuilder, p: &str, tok: u64) {
    let op = b.release(p, K, tok);
    b.shared(op).ok(op);
}

/// A reader's lease ran out (it was paused past its TTL): the marker that
/// lets a writer be granted while the paused reader still thinks it holds.
fn shared_expired(b: &mut HistoryBuilder, p: &str, tok: u64) {
    let op = b.expire(p, K, Some(tok));
    b.shared(op);
}

/// A writer's lease ran out (it was paused inside its unit of work).
fn expired(b: &mut HistoryBuilder, p: &str, tok: u64) {
    b.expire(p, K, Some(tok));
}

/// An accepted guarded read whose seq was not recorded: judged by real
/// time only.
fn read_without_seq(b: &mut HistoryBuilder, p: &str, tok: u64) {
    let op = b.read(p, K, tok);
    b.ok(op);
}

#[test]
fn readers_of_current_records_pass() {
    let mut b = History::builder();
    b.acquired("w1", K, t(10));
    b.wrote("w1", K, t(10), 1);
    b.released("w1", K, t(10));
    // Two readers granted together read after the first write; a third,
    // granted later with a larger shared token, beside them.
    let a = b.acquire("r1", K);
    let c = b.acquire("r2", K);
    b.shared(a).shared(c).granted(a, t(12)).granted(c, t(12));
    shared_acquired(&mut b, "r3", t(13));
    b.read_current("r3", K, t(13), 1);
    b.read_current("r1", K, t(12), 1);
    b.read_current("r2", K, t(12), 1);
    shared_released(&mut b, "r1", t(12));
    shared_released(&mut b, "r2", t(12));
    shared_released(&mut b, "r3", t(13));
    b.acquired("w2", K, t(15));
    b.wrote("w2", K, t(15), 2);
    b.released("w2", K, t(15));
    shared_acquired(&mut b, "r1", t(17));
    b.read_current("r1", K, t(17), 2);
    shared_released(&mut b, "r1", t(17));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
    assert!(kinds.is_empty(), "{kinds:?}");
}

#[test]
fn a_read_before_any_write_sees_write_count_zero() {
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    b.read_current("r1", K, t(10), 0);
    shared_released(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    b.wrote("w1", K, t(12), 1);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
}

/// The fence sees writes, not grants: a paused reader that reads after a
/// writer was granted but before that writer wrote is accepted, and rightly
/// (it read the state no writer had changed yet).
#[test]
fn a_read_after_a_writers_grant_but_before_its_write_is_legal() {
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    shared_expired(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    b.read_current("r1", K, t(10), 0);
    b.wrote("w1", K, t(12), 1);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
    assert!(kinds.is_empty(), "{kinds:?}");
}

#[test]
fn a_read_accepted_after_a_newer_write_completed_is_a_violation() -> Result<(), String> {
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    shared_expired(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    b.wrote("w1", K, t(12), 1);
    // The paused reader wakes up and reads: the record's mark is above its
    // token, so the fence must refuse. No seq: real time alone decides.
    read_without_seq(&mut b, "r1", t(10));
    let report = check(&b.build(), &CheckOptions::default());
    assert!(!report.ok(), "{report}");
    let Some(v) = report
        .violations_of(ViolationKind::StaleReadAccepted)
        .next()
    else {
        return Err(format!("no stale read reported:\n{report}"));
    };
    assert!(v.message.contains("r1#3 read shared ok"), "{}", v.message);
    assert!(v.message.contains("w1#2 write ok"), "{}", v.message);
    assert!(v.message.contains("in real time"), "{}", v.message);
    Ok(())
}

#[test]
fn a_read_that_saw_a_newer_write_by_the_write_count_is_a_violation() {
    // The read and the write overlap in time; the write count the read
    // saw (1) says the newer write had landed first.
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    shared_expired(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    let w = b.write("w1", K, t(12));
    let r = b.read("r1", K, t(10));
    b.accepted(w, 1).accepted(r, 1);
    let report = check(&b.build(), &CheckOptions::default());
    let found: Vec<_> = report
        .violations_of(ViolationKind::StaleReadAccepted)
        .collect();
    assert_eq!(found.len(), 1, "{report}");
    assert!(
        found
            .iter()
            .all(|v| v.message.contains("by the record's write count")),
        "{report}"
    );
    // The same overlap with the read before the write (count 0) is legal.
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    shared_expired(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    let w = b.write("w1", K, t(12));
    let r = b.read("r1", K, t(10));
    b.accepted(w, 1).accepted(r, 0);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
    assert!(kinds.is_empty(), "{kinds:?}");
}

#[test]
fn a_stale_write_after_an_accepted_read_is_a_violation() {
    // w1 is paused inside its unit of work past its lease; a reader is
    // granted (a larger token), reads; w1 wakes and its write lands.
    let mut b = History::builder();
    b.acquired("w1", K, t(10));
    expired(&mut b, "w1", t(10));
    shared_acquired(&mut b, "r1", t(12));
    b.read_current("r1", K, t(12), 0);
    b.wrote("w1", K, t(10), 1);
    let report = check(&b.build(), &CheckOptions::default());
    assert!(!report.ok(), "{report}");
    let found: Vec<_> = report
        .violations_of(ViolationKind::StaleWriteAfterRead)
        .collect();
    assert_eq!(found.len(), 1, "{report}");
    assert!(
        found[..1]
            .iter()
            .all(|v| v.message.contains("w1#3 write ok") && v.message.contains("r1#2 read")),
        "{report}"
    );
}

#[test]
fn a_write_with_the_readers_own_token_after_its_read_is_a_violation() {
    // The read mark is compared strictly: a write carrying the reader's
    // token (a reader writing through the write fence) must not land after
    // the read. Judged by the write count alone (the two overlap).
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(12));
    let r = b.read("r1", K, t(12));
    let w = b.write("r1", K, t(12));
    b.accepted(r, 0).accepted(w, 1);
    let report = check(&b.build(), &CheckOptions::default());
    let found: Vec<_> = report
        .violations_of(ViolationKind::StaleWriteAfterRead)
        .collect();
    assert_eq!(found.len(), 1, "{report}");
    assert!(
        found
            .iter()
            .all(|v| v.message.contains("the same") && v.message.contains("write count")),
        "{report}"
    );
}

#[test]
fn a_write_refused_by_a_readers_mark_is_legal() {
    // The stale writer's write is refused by the read mark alone (no write
    // above its token ever landed): not a fresh write refused.
    let mut b = History::builder();
    b.acquired("w1", K, t(10));
    expired(&mut b, "w1", t(10));
    shared_acquired(&mut b, "r1", t(12));
    b.read_current("r1", K, t(12), 0);
    let w = b.write("w1", K, t(10));
    b.fail(w);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
    assert!(kinds.is_empty(), "{kinds:?}");

    // A read whose outcome is unknown may have raised the mark too.
    let mut b = History::builder();
    b.acquired("w1", K, t(10));
    expired(&mut b, "w1", t(10));
    shared_acquired(&mut b, "r1", t(12));
    let r = b.read("r1", K, t(12));
    b.unknown(r);
    let w = b.write("w1", K, t(10));
    b.fail(w);
    let (_, kinds) = verdict(&b.build());
    assert!(kinds.is_empty(), "{kinds:?}");

    // Without the read, the same refusal is the fence refusing a fresh
    // write (the existing rule, unchanged).
    let mut b = History::builder();
    b.acquired("w1", K, t(10));
    let w = b.write("w1", K, t(10));
    b.fail(w);
    let (_, kinds) = verdict(&b.build());
    assert_eq!(kinds, [ViolationKind::FreshWriteRefused]);

    // A read with a smaller token than the write's does not cover it.
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    b.read_current("r1", K, t(10), 0);
    shared_released(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    let w = b.write("w1", K, t(12));
    b.fail(w);
    let (_, kinds) = verdict(&b.build());
    assert_eq!(kinds, [ViolationKind::FreshWriteRefused]);
}

#[test]
fn a_refused_read_needs_a_newer_write_that_could_have_landed() {
    // Refused after a newer writer wrote: the fence doing its job.
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    shared_expired(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    b.wrote("w1", K, t(12), 1);
    let r = b.read("r1", K, t(10));
    b.fail(r);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
    assert!(kinds.is_empty(), "{kinds:?}");

    // A write with an unknown outcome may have landed: it covers too.
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    shared_expired(&mut b, "r1", t(10));
    b.acquired("w1", K, t(12));
    let w = b.write("w1", K, t(12));
    b.unknown(w);
    let r = b.read("r1", K, t(10));
    b.fail(r);
    let (_, kinds) = verdict(&b.build());
    assert!(kinds.is_empty(), "{kinds:?}");

    // Refused with only older writes (and the reader's own token's) about:
    // the fence refused a current read.
    let mut b = History::builder();
    b.acquired("w1", K, t(10));
    b.wrote("w1", K, t(10), 1);
    b.released("w1", K, t(10));
    shared_acquired(&mut b, "r1", t(12));
    let r = b.read("r1", K, t(12));
    b.fail(r);
    let report = check(&b.build(), &CheckOptions::default());
    let kinds: Vec<_> = report.violations.iter().map(|v| v.kind).collect();
    assert_eq!(kinds, [ViolationKind::FreshReadRefused], "{report}");
}

#[test]
fn a_read_with_a_token_never_granted_is_a_violation() {
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    b.read_current("r1", K, t(11), 0);
    let (_, kinds) = verdict(&b.build());
    assert_eq!(kinds, [ViolationKind::UngrantedReadToken]);
}

/// Histories from before fenced reads (no `read` lines) read and judge as
/// before; a `read` line reads back as a shared guarded read with its seq.
#[test]
fn old_histories_stay_readable_and_reads_round_trip() -> Result<(), String> {
    let old = r#"{"type":"invoke","process":"w1","op":1,"f":"acquire","key":"bench/gate/k0","time":10}
{"type":"complete","process":"w1","op":1,"outcome":"ok","token":281474976710666,"time":20}
{"type":"invoke","process":"w1","op":2,"f":"write","key":"bench/gate/k0","token":281474976710666,"time":30}
{"type":"complete","process":"w1","op":2,"outcome":"ok","seq":1,"time":40}
{"type":"invoke","process":"w1","op":3,"f":"release","key":"bench/gate/k0","token":281474976710666,"time":50}
{"type":"complete","process":"w1","op":3,"outcome":"ok","time":60}
"#;
    let h = History::from_jsonl(old.as_bytes()).map_err(|e| e.to_string())?;
    assert_eq!(h.ops().len(), 3);
    let report = check(&h, &CheckOptions::default());
    assert!(report.ok(), "{report}");

    let with_read = format!(
        "{old}{}\n{}\n",
        r#"{"type":"invoke","process":"r1","op":1,"f":"acquire","key":"bench/gate/k0","mode":"shared","time":70}
{"type":"complete","process":"r1","op":1,"outcome":"ok","token":281474976710668,"time":80}"#,
        r#"{"type":"invoke","process":"r1","op":2,"f":"read","key":"bench/gate/k0","mode":"shared","token":281474976710668,"time":90}
{"type":"complete","process":"r1","op":2,"outcome":"ok","seq":1,"time":100}"#
    );
    let h = History::from_jsonl(with_read.as_bytes()).map_err(|e| e.to_string())?;
    let Some(read) = h.ops().iter().find(|o| o.f == Function::Read) else {
        return Err("no read in the history".into());
    };
    assert_eq!(read.outcome(), Some(Outcome::Ok));
    assert_eq!(read.seq(), Some(1));
    assert_eq!(read.token, Some(t(12)));
    let report = check(&h, &CheckOptions::default());
    assert!(report.ok(), "{report}");
    let back = History::from_jsonl(h.to_jsonl_string().as_bytes()).map_err(|e| e.to_string())?;
    assert_eq!(back, h);

    // A read names its key like every per-key operation.
    let keyless = r#"{"type":"invoke","process":"r1","op":1,"f":"read","token":5,"time":1}"#;
    assert!(History::from_jsonl(keyless.as_bytes()).is_err());
    Ok(())
}
