//! The checker's rules for shared holds and semaphores (issue 34): never a
//! writer beside any other holder, never more holders than permits, one
//! holder per slot, and the token rule (an exclusive token above every
//! earlier grant's; a shared token above the last exclusive one; readers
//! granted together share one).

use latchkey_checker::{
    CheckOptions, History, HistoryBuilder, Verdict, ViolationKind, check, token,
};

const K: &str = "bench/gate/k1";
const S: &str = "bench/gate/sem";

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

#[test]
fn readers_share_a_key_and_one_token_when_granted_together() {
    let mut b = History::builder();
    // Two readers whose acquires overlap, granted in one transaction.
    let a = b.acquire("r1", K);
    let c = b.acquire("r2", K);
    b.shared(a).shared(c).granted(a, t(10)).granted(c, t(10));
    shared_acquired(&mut b, "r3", t(12));
    shared_released(&mut b, "r1", t(10));
    shared_released(&mut b, "r2", t(10));
    shared_released(&mut b, "r3", t(12));
    b.acquired("w", K, t(15));
    b.released("w", K, t(15));
    shared_acquired(&mut b, "r1", t(17));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
}

#[test]
fn a_writer_beside_a_reader_is_a_violation() {
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    b.acquired("w", K, t(11));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation);
    assert!(kinds.contains(&ViolationKind::NotLinearizable), "{kinds:?}");
    assert!(kinds.contains(&ViolationKind::DoubleGrant), "{kinds:?}");
}

#[test]
fn a_reader_beside_a_writer_is_a_violation() {
    let mut b = History::builder();
    b.acquired("w", K, t(10));
    shared_acquired(&mut b, "r1", t(11));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation);
    assert!(kinds.contains(&ViolationKind::DoubleGrant), "{kinds:?}");
}

#[test]
fn a_writer_after_several_readers_needs_every_one_gone() {
    // r1 is released, r2 is not: the writer is beside r2 (the check must
    // not look only at the reader just before the writer in token order).
    let mut b = History::builder();
    shared_acquired(&mut b, "r2", t(9));
    shared_acquired(&mut b, "r1", t(10));
    shared_released(&mut b, "r1", t(10));
    b.acquired("w", K, t(11));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation);
    assert!(kinds.contains(&ViolationKind::DoubleGrant), "{kinds:?}");
}

#[test]
fn a_reader_token_must_be_above_the_last_writer() {
    let mut b = History::builder();
    b.acquired("w", K, t(10));
    b.released("w", K, t(10));
    shared_acquired(&mut b, "r1", t(10));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation, "{kinds:?}");
}

#[test]
fn equal_tokens_need_overlapping_shared_acquires() {
    // Two readers with one token but one finished before the other began:
    // two transactions cannot share a revision.
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    shared_acquired(&mut b, "r2", t(10));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation);
    assert!(kinds.contains(&ViolationKind::DuplicateToken), "{kinds:?}");
}

#[test]
fn an_expired_reader_that_shares_a_token_frees_the_writer() {
    // r1 and r2 granted together (one token); r2's hold ends only by its
    // lease (an optional expire naming that token). The writer after both
    // is legal: the search must not prune r2's expire as outlived when
    // r1's grant raised the floor to the same token.
    let mut b = History::builder();
    let a = b.acquire("r1", K);
    let c = b.acquire("r2", K);
    b.shared(a).shared(c).granted(a, t(10)).granted(c, t(10));
    let e = b.expire("r2", K, Some(t(10)));
    b.shared(e);
    shared_released(&mut b, "r1", t(10));
    b.acquired("w", K, t(20));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
}

fn slot_acquired(b: &mut HistoryBuilder, p: &str, tok: u64, slot: u32) {
    let op = b.acquire(p, S);
    b.semaphore(op, 2, None).granted_slot(op, tok, slot);
}

fn slot_released(b: &mut HistoryBuilder, p: &str, tok: u64, slot: u32) {
    let op = b.release(p, S, tok);
    b.semaphore(op, 2, Some(slot)).ok(op);
}

#[test]
fn a_semaphore_holds_its_permits_one_per_slot() {
    let mut b = History::builder();
    slot_acquired(&mut b, "p1", t(10), 0);
    slot_acquired(&mut b, "p2", t(11), 1);
    slot_released(&mut b, "p1", t(10), 0);
    slot_acquired(&mut b, "p3", t(12), 0);
    let w = b.write("p3", S, t(12));
    b.semaphore(w, 2, Some(0)).accepted(w, 1);
    let w = b.write("p2", S, t(11));
    b.semaphore(w, 2, Some(1)).accepted(w, 1);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
}

#[test]
fn more_holders_than_permits_is_a_violation() {
    let mut b = History::builder();
    slot_acquired(&mut b, "p1", t(10), 0);
    slot_acquired(&mut b, "p2", t(11), 1);
    // A third holder: whatever slot it names, the semaphore is full.
    let op = b.acquire("p3", S);
    b.semaphore(op, 2, None).granted_slot(op, t(12), 2);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation);
    assert!(kinds.contains(&ViolationKind::NotLinearizable), "{kinds:?}");
    assert!(kinds.contains(&ViolationKind::SlotOutOfRange), "{kinds:?}");
}

#[test]
fn two_holders_of_one_slot_is_a_violation() {
    let mut b = History::builder();
    slot_acquired(&mut b, "p1", t(10), 0);
    slot_acquired(&mut b, "p2", t(11), 0);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation);
    assert!(kinds.contains(&ViolationKind::DoubleGrant), "{kinds:?}");
}

#[test]
fn an_unknown_acquire_takes_a_permit_it_may_hold() {
    // p3's acquire never answered: it may hold a permit until its expire.
    // p1 and p2 fill the semaphore afterwards only once that expire may
    // have happened; before it, a second known grant beside p1 and a
    // possible p3 is still within 2 permits, so the history is legal.
    let mut b = History::builder();
    let u = b.acquire("p3", S);
    b.semaphore(u, 2, None).unknown(u);
    let e = b.expire("p3", S, None);
    b.semaphore(e, 2, None);
    slot_acquired(&mut b, "p1", t(10), 0);
    slot_acquired(&mut b, "p2", t(11), 1);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
}

#[test]
fn a_slot_write_is_fenced_by_its_slot() {
    // The slot-0 record takes tokens in order; a stale slot-0 write after
    // a newer one was accepted is flagged on the slot's key.
    let mut b = History::builder();
    slot_acquired(&mut b, "p1", t(10), 0);
    slot_released(&mut b, "p1", t(10), 0);
    slot_acquired(&mut b, "p2", t(12), 0);
    let w = b.write("p2", S, t(12));
    b.semaphore(w, 2, Some(0)).accepted(w, 1);
    let w = b.write("p1", S, t(10));
    b.semaphore(w, 2, Some(0)).accepted(w, 2);
    let report = check(&b.build(), &CheckOptions::default());
    let stale: Vec<_> = report
        .violations
        .iter()
        .filter(|v| v.kind == ViolationKind::StaleWriteAccepted)
        .collect();
    assert!(!stale.is_empty(), "{:?}", report.violations);
    assert_eq!(stale[0].key, format!("{S}//s/0"));
}

#[test]
fn modes_survive_the_jsonl_round_trip() {
    let mut b = History::builder();
    shared_acquired(&mut b, "r1", t(10));
    slot_acquired(&mut b, "p1", t(11), 1);
    let h = b.build();
    let text = h.to_jsonl_string();
    assert!(text.contains(r#""mode":"shared""#), "{text}");
    assert!(text.contains(r#""permits":2"#), "{text}");
    assert!(text.contains(r#""slot":1"#), "{text}");
    let back = History::from_jsonl(text.as_bytes()).unwrap();
    assert_eq!(back, h);
}

#[test]
fn a_semaphore_grant_without_its_slot_or_permits_is_refused() {
    let no_permits = r#"{"type":"invoke","process":"p","op":1,"f":"acquire","key":"s","mode":"semaphore","time":1}"#;
    assert!(History::from_jsonl(no_permits.as_bytes()).is_err());
    let no_slot = r#"{"type":"invoke","process":"p","op":1,"f":"acquire","key":"s","mode":"semaphore","permits":2,"time":1}
{"type":"complete","process":"p","op":1,"outcome":"ok","token":5,"time":2}"#;
    let err = History::from_jsonl(no_slot.as_bytes()).unwrap_err();
    assert!(err.to_string().contains("without a slot"), "{err}");
}

// Found by the hostile review of the first version of these rules.

#[test]
fn one_transaction_is_not_split_around_a_release() {
    // p1 and p2 carry one token (one transaction), p1's answer came before
    // pH's release was asked for, so the transaction ran while pH held
    // slot 0: p2's slot 0 is a second holder of it.
    for expire in [false, true] {
        let mut b = History::builder();
        b.at_ms(0);
        let h = b.acquire("pH", S);
        b.semaphore(h, 2, None).granted_slot(h, t(3), 0);
        b.at_ms(2);
        let a1 = b.acquire("p1", S);
        let a2 = b.acquire("p2", S);
        b.semaphore(a1, 2, None).semaphore(a2, 2, None);
        b.at_ms(5);
        b.granted_slot(a1, t(5), 1);
        b.at_ms(6);
        if expire {
            let e = b.expire("pH", S, Some(t(3)));
            b.semaphore(e, 2, Some(0));
        } else {
            let r = b.release("pH", S, t(3));
            b.semaphore(r, 2, Some(0)).ok(r);
        }
        b.at_ms(10);
        b.granted_slot(a2, t(5), 0);
        let (v, kinds) = verdict(&b.build());
        assert_eq!(v, Verdict::Violation, "expire {expire}: {kinds:?}");
    }
}

#[test]
fn slots_granted_together_after_a_release_are_legal() {
    let mut b = History::builder();
    b.at_ms(0);
    let h = b.acquire("pH", S);
    b.semaphore(h, 2, None).granted_slot(h, t(3), 0);
    b.at_ms(1);
    let r = b.release("pH", S, t(3));
    b.semaphore(r, 2, Some(0)).ok(r);
    b.at_ms(3);
    let a1 = b.acquire("p1", S);
    let a2 = b.acquire("p2", S);
    b.semaphore(a1, 2, None).semaphore(a2, 2, None);
    b.at_ms(5);
    b.granted_slot(a1, t(5), 1);
    b.at_ms(10);
    b.granted_slot(a2, t(5), 0);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
}

#[test]
fn one_token_needs_every_pair_to_overlap() {
    // r1 [0,10], r2 [5,100], r3 [50,60]: r3 overlaps r2 but began after
    // r1 was answered, so r1 and r3 cannot share a transaction.
    let mut b = History::builder();
    b.at_ms(0);
    let r1 = b.acquire("r1", K);
    b.shared(r1);
    b.at_ms(5);
    let r2 = b.acquire("r2", K);
    b.shared(r2);
    b.at_ms(10);
    b.granted(r1, t(5));
    b.at_ms(50);
    let r3 = b.acquire("r3", K);
    b.shared(r3);
    b.at_ms(60);
    b.granted(r3, t(5));
    b.at_ms(100);
    b.granted(r2, t(5));
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation);
    assert!(kinds.contains(&ViolationKind::DuplicateToken), "{kinds:?}");
}

#[test]
fn a_release_of_a_slot_does_not_match_an_unknown_acquire() {
    // p's release names slot 0, which q holds: p's unknown acquire cannot
    // have taken slot 0 beside q.
    let mut b = History::builder();
    b.at_ms(0);
    let u = b.acquire("p", S);
    b.semaphore(u, 2, None);
    b.at_ms(1);
    let q = b.acquire("q", S);
    b.semaphore(q, 2, None).granted_slot(q, t(7), 0);
    b.at_ms(3);
    b.unknown(u);
    b.at_ms(5);
    let r = b.release("p", S, t(4));
    b.semaphore(r, 2, Some(0)).ok(r);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Violation, "{kinds:?}");
}

#[test]
fn a_downgrade_is_legal() {
    // p's exclusive hold becomes shared in one transaction (a new token);
    // q's shared grant joins after it.
    let mut b = History::builder();
    b.acquired("p", K, t(5));
    let d = b.acquire("p", K);
    b.shared(d).granted(d, t(8));
    let r = b.acquire("q", K);
    b.shared(r).granted(r, t(9));
    let rel = b.release("p", K, t(8));
    b.shared(rel).ok(rel);
    let (v, kinds) = verdict(&b.build());
    assert_eq!(v, Verdict::Linearizable, "{kinds:?}");
}

#[test]
fn an_acquire_naming_its_slot_up_front_is_refused() {
    let text = r#"{"type":"invoke","process":"p","op":1,"f":"acquire","key":"s","mode":"semaphore","permits":2,"slot":1,"time":1}"#;
    let err = History::from_jsonl(text.as_bytes()).unwrap_err();
    assert!(err.to_string().contains("slot"), "{err}");
}
