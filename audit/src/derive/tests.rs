//! Each of the arbiter's transactions, as the watch delivers it, and the
//! events it must yield.

use serde_json::json;

use super::*;
use crate::force::{ForceRecord, record_name};

const ALICE: &str = "spiffe://td/alice";
const BOB: &str = "spiffe://td/bob";

fn put(key: &str, value: Vec<u8>, lease: i64) -> Change {
    Change {
        op: Op::Put,
        key: key.into(),
        value,
        lease,
    }
}

fn del(key: &str) -> Change {
    Change {
        op: Op::Delete,
        key: key.into(),
        value: Vec::new(),
        lease: 0,
    }
}

/// The arbiter's records as it writes them (`latchkey_arbiter::records`).
fn holder(identity: &str, session: i64) -> Vec<u8> {
    let record = json!({
        "identity": identity,
        "session": session,
        "class": "ledger",
        "acquiredAtUnixMs": 1,
        "annotations": {},
    });
    record.to_string().into_bytes()
}

fn session_key(lease: i64) -> String {
    format!("s/{lease:016x}")
}

fn epoch(n: u32) -> Vec<u8> {
    let record = json!({
        "epoch": n,
        "clusterId": "42",
        "advancedAtUnixMs": 1,
        "reason": format!("to {n}"),
    });
    record.to_string().into_bytes()
}

/// An epoch and sessions 7 (alice) and 8 (bob), opened as the arbiter does.
fn started() -> LogState {
    let mut state = LogState::default();
    let created = state.apply(1, &[put("sys/epoch", epoch(1), 0)]);
    assert_eq!(created[0].kind, Kind::EpochCreate);
    for (revision, lease, identity) in [(2, 7, ALICE), (3, 8, BOB)] {
        let record = json!({ "identity": identity, "ttlSeconds": 5 })
            .to_string()
            .into_bytes();
        let events = state.apply(
            revision,
            &[
                put(&session_key(lease), record, lease),
                put(&format!("si/00/{lease:016x}"), Vec::new(), lease),
            ],
        );
        assert!(events.is_empty(), "opening a session is no audit event");
    }
    state
}

fn kinds(events: &[Event]) -> Vec<(&str, Kind, Ended)> {
    events
        .iter()
        .map(|e| (e.key.as_str(), e.kind, e.ended))
        .collect()
}

#[test]
fn a_grant_and_its_release() {
    let mut state = started();
    let g = state.apply(10, &[put("l/ledger/inv-1", holder(ALICE, 7), 7)]);
    assert_eq!(kinds(&g), [("ledger/inv-1", Kind::Grant, Ended::No)]);
    assert_eq!(g[0].identity, ALICE);
    assert_eq!(g[0].session, 7);
    assert_eq!(g[0].class, "ledger");
    assert_eq!((g[0].epoch, g[0].hold_revision), (1, 10));
    assert_eq!(g[0].detail["acquiredAtUnixMs"], 1, "the arbiter's clock");
    // the release deletes the hold and its claims
    let r = state.apply(
        11,
        &[
            del("l/ledger/inv-1"),
            del("c/ledger/inv-1//000000000000000a"),
        ],
    );
    assert_eq!(
        kinds(&r),
        [("ledger/inv-1", Kind::Release, Ended::Released)]
    );
    assert_eq!((r[0].identity.as_str(), r[0].hold_revision), (ALICE, 10));
    assert_eq!(state.holds(), 0);
}

#[test]
fn a_semaphores_slots_are_its_events_under_its_name() {
    let mut state = started();
    let g = state.apply(
        10,
        &[
            put("l/jobs/pool//s/0000", holder(ALICE, 7), 7),
            put("l/jobs/pool//s/0001", holder(BOB, 8), 8),
        ],
    );
    assert_eq!(
        kinds(&g),
        [
            ("jobs/pool", Kind::Grant, Ended::No),
            ("jobs/pool", Kind::Grant, Ended::No)
        ]
    );
    assert_eq!(
        (g[0].detail["slot"].as_u64(), g[1].detail["slot"].as_u64()),
        (Some(0), Some(1))
    );
    assert_eq!(g[0].detail["acquiredAtUnixMs"], 1);
    let r = state.apply(11, &[del("l/jobs/pool//s/0001")]);
    assert_eq!(kinds(&r), [("jobs/pool", Kind::Release, Ended::Released)]);
    assert_eq!((r[0].identity.as_str(), r[0].hold_revision), (BOB, 10));
    assert_eq!(r[0].detail["slot"], 1);
    // Two slots at one revision are two events and two holds to the stores
    // (their ids are keyed by the slot's own key), and a slot's end is its
    // grant's hold.
    assert_ne!(g[0].id_key(), g[1].id_key());
    assert_eq!(r[0].id_key(), g[1].id_key());
}

/// Session `session`'s shared hold of `name`, under the prefix.
fn reader(name: &str, session: i64) -> String {
    format!("l/{}", latchkey_records::reader_key(name, session))
}

/// The stored rows of `events` (ids keyed as the tailer keys them).
fn rows(events: &[Event]) -> Vec<crate::event::Row> {
    let key = crate::AuditKey::from_bytes(&[5u8; 32]).unwrap();
    events
        .iter()
        .map(|e| crate::event::Row::new(9, e, Some(&key), 1, 0).unwrap())
        .collect()
}

#[test]
fn a_locks_shared_holds_are_its_events_under_its_name() {
    let mut state = started();
    // readers at the head of a queue are granted in one batch: one revision
    let g = state.apply(
        10,
        &[
            put(&reader("jobs/batch", 7), holder(ALICE, 7), 7),
            put(&reader("jobs/batch", 8), holder(BOB, 8), 8),
        ],
    );
    assert_eq!(
        kinds(&g),
        [
            ("jobs/batch", Kind::Grant, Ended::No),
            ("jobs/batch", Kind::Grant, Ended::No)
        ]
    );
    for (e, (identity, session)) in g.iter().zip([(ALICE, 7), (BOB, 8)]) {
        assert_eq!(e.detail["mode"], "shared", "{e:?}");
        assert_eq!(e.detail["session"], session, "{e:?}");
        assert_eq!((e.identity.as_str(), e.session), (identity, session));
        assert_eq!(
            (e.hold_revision, e.detail["acquiredAtUnixMs"].as_i64()),
            (10, Some(1))
        );
        assert!(e.detail.get("slot").is_none() && e.detail.get("downgrade").is_none());
    }
    // Two readers at one revision are two events and two holds to the
    // stores: their ids are keyed by each reader's own key.
    assert_eq!(g[0].id_key(), "jobs/batch//r/0000000000000007");
    assert_ne!(g[0].id_key(), g[1].id_key());
    let granted = rows(&g);
    assert_ne!(granted[0].event_id, granted[1].event_id);
    assert_ne!(granted[0].hold_id, granted[1].hold_id);
    assert!(granted.iter().all(|r| r.key == "jobs/batch"));

    // bob releases; alice's lease lapses: each end is its grant's hold
    let r = state.apply(11, &[del(&reader("jobs/batch", 8))]);
    assert_eq!(kinds(&r), [("jobs/batch", Kind::Release, Ended::Released)]);
    assert_eq!((r[0].identity.as_str(), r[0].hold_revision), (BOB, 10));
    assert_eq!(
        (
            r[0].detail["mode"].as_str(),
            r[0].detail["session"].as_i64()
        ),
        (Some("shared"), Some(8))
    );
    assert_eq!(r[0].id_key(), g[1].id_key());
    assert_eq!(rows(&r)[0].hold_id, granted[1].hold_id);
    let x = state.apply(12, &[del(&reader("jobs/batch", 7)), del(&session_key(7))]);
    assert_eq!(
        kinds(&x),
        [("jobs/batch", Kind::Expiry, Ended::ExpiredOrRevoked)]
    );
    assert_eq!(
        (
            x[0].detail["mode"].as_str(),
            x[0].detail["session"].as_i64()
        ),
        (Some("shared"), Some(7))
    );
    assert_eq!(rows(&x)[0].hold_id, granted[0].hold_id);
    assert_eq!(state.holds(), 0);
}

#[test]
fn a_shared_hold_the_tailer_never_saw_still_names_its_session() {
    let mut state = started();
    // a session id is a lease id: all 64 bits of it
    let session = 0x694d_7a1b_2c3d_4e5f;
    let r = state.apply(10, &[del(&reader("jobs/batch", session))]);
    assert_eq!(kinds(&r), [("jobs/batch", Kind::Release, Ended::Unknown)]);
    assert_eq!(r[0].session, 0, "the holder is not known");
    assert_eq!(
        (
            r[0].detail["mode"].as_str(),
            r[0].detail["session"].as_i64()
        ),
        (Some("shared"), Some(session))
    );
    assert_eq!(
        r[0].id_key(),
        latchkey_records::reader_key("jobs/batch", session)
    );
}

#[test]
fn a_force_release_or_an_advance_of_a_shared_hold_is_under_the_locks_name() {
    let mut state = started();
    state.apply(
        10,
        &[
            put(&reader("k", 7), holder(ALICE, 7), 7),
            put(&reader("k", 8), holder(BOB, 8), 8),
        ],
    );
    let record = force(&latchkey_records::reader_key("k", 7), 10);
    let f = state.apply(
        11,
        &[
            del(&reader("k", 7)),
            put(
                &record_name(&record.request_id),
                serde_json::to_vec(&record).unwrap(),
                99,
            ),
        ],
    );
    assert_eq!(kinds(&f), [("k", Kind::ForceRelease, Ended::ForceReleased)]);
    let e = &f[0];
    assert_eq!((e.identity.as_str(), e.hold_revision), (ALICE, 10));
    assert_eq!(e.detail["requestedBy"], "op-alice");
    assert_eq!(e.detail["holdDeleted"], true);
    assert_eq!(
        (e.detail["mode"].as_str(), e.detail["session"].as_i64()),
        (Some("shared"), Some(7))
    );
    let a = state.apply(12, &[put("sys/epoch", epoch(2), 0), del(&reader("k", 8))]);
    assert_eq!(
        kinds(&a),
        [
            ("k", Kind::EpochAdvance, Ended::EpochAdvance),
            (EPOCH_KEY, Kind::EpochAdvance, Ended::No),
        ]
    );
    assert_eq!(
        (
            a[0].detail["mode"].as_str(),
            a[0].detail["session"].as_i64()
        ),
        (Some("shared"), Some(8))
    );
    assert_eq!(a[0].id_key(), latchkey_records::reader_key("k", 8));
}

#[test]
fn a_downgrade_is_the_release_of_the_key_and_a_shared_grant_at_one_revision() {
    let mut state = started();
    let g = state.apply(10, &[put("l/k", holder(ALICE, 7), 7)]);
    // one transaction: the exclusive hold and its claims go, the shared hold
    // comes, on the session's lease
    let d = state.apply(
        11,
        &[
            del("l/k"),
            del("c/k//000000000000000a"),
            put(&reader("k", 7), holder(ALICE, 7), 7),
        ],
    );
    assert_eq!(
        kinds(&d),
        [
            ("k", Kind::Release, Ended::Released),
            ("k", Kind::Grant, Ended::No)
        ]
    );
    assert_eq!(
        d[0].detail,
        json!({ "downgrade": true }),
        "the exclusive hold"
    );
    assert_eq!((d[0].identity.as_str(), d[0].hold_revision), (ALICE, 10));
    assert_eq!(d[1].detail["downgrade"], true);
    assert_eq!(
        (
            d[1].detail["mode"].as_str(),
            d[1].detail["session"].as_i64()
        ),
        (Some("shared"), Some(7))
    );
    assert_eq!((d[1].identity.as_str(), d[1].hold_revision), (ALICE, 11));
    // one key, one revision, two events: their ids differ, and the release
    // ends the exclusive grant's hold
    assert_ne!(d[0].id_key(), d[1].id_key());
    let (granted, downgraded) = (rows(&g), rows(&d));
    assert_ne!(downgraded[0].event_id, downgraded[1].event_id);
    assert_eq!(downgraded[0].hold_id, granted[0].hold_id);
    assert_ne!(downgraded[1].hold_id, granted[0].hold_id);
    // another session's release beside a shared grant is no downgrade (the
    // arbiter writes no such revision; the session is what tells)
    state.apply(12, &[put("l/other", holder(BOB, 8), 8)]);
    let n = state.apply(
        13,
        &[
            del("l/other"),
            put(&reader("other", 7), holder(ALICE, 7), 7),
        ],
    );
    assert_eq!(n.len(), 2);
    assert!(
        n.iter().all(|e| e.detail.get("downgrade").is_none()),
        "{n:?}"
    );
}

#[test]
fn a_lapsed_lease_ends_every_hold_on_it_in_one_revision() {
    let mut state = started();
    state.apply(10, &[put("l/a", holder(ALICE, 7), 7)]);
    state.apply(11, &[put("l/b", holder(ALICE, 7), 7)]);
    state.apply(12, &[put("l/c", holder(BOB, 8), 8)]);
    let events = state.apply(
        20,
        &[
            del(&session_key(7)),
            del("si/00/0000000000000007"),
            del("l/a"),
            del("l/b"),
            del("c/a//000000000000000a"),
        ],
    );
    assert_eq!(
        kinds(&events),
        [
            ("a", Kind::Expiry, Ended::ExpiredOrRevoked),
            ("b", Kind::Expiry, Ended::ExpiredOrRevoked),
        ]
    );
    assert_eq!(events[1].hold_revision, 11);
    // bob's hold is untouched, and his release is still a release
    let r = state.apply(21, &[del("l/c")]);
    assert_eq!(kinds(&r), [("c", Kind::Release, Ended::Released)]);
}

#[test]
fn close_session_deletes_the_record_first_so_its_holds_end_as_closed() {
    let mut state = started();
    state.apply(10, &[put("l/a", holder(ALICE, 7), 7)]);
    // CloseSession: the record and the count entry, then the revoke
    let first = state.apply(11, &[del(&session_key(7)), del("si/00/0000000000000007")]);
    assert!(first.is_empty());
    let revoked = state.apply(12, &[del("l/a")]);
    assert_eq!(
        kinds(&revoked),
        [("a", Kind::Release, Ended::SessionClosed)]
    );
    assert_eq!(revoked[0].identity, ALICE);
}

#[test]
fn a_force_revoked_session_ends_its_holds_as_force_revoked() {
    let mut state = started();
    state.apply(10, &[put("l/a", holder(ALICE, 7), 7)]);
    state.apply(11, &[put("l/b", holder(ALICE, 7), 7)]);
    state.apply(12, &[put("l/c", holder(BOB, 8), 8)]);
    // the force-release of a (its own event), then the arbiter's marker
    // transaction and the revoke
    let marker = json!({
        "session": 7, "key": "a", "requestId": "r1", "requestedBy": "ana",
        "approvedBy": "ben", "reason": "wedged", "holderIdentity": ALICE,
        "revokedAtUnixMs": 5,
    });
    let marked = state.apply(
        13,
        &[
            del(&session_key(7)),
            del("si/00/0000000000000007"),
            put(
                "sys/revoked/0000000000000007",
                marker.to_string().into_bytes(),
                99,
            ),
        ],
    );
    assert!(marked.is_empty(), "{marked:?}");
    // a tailer restarted between the marker and the revoke knows it too
    let mut reloaded = LogState::load([
        ("l/b", holder(ALICE, 7).as_slice(), 7, 11),
        ("s/0000000000000008", b"{}".as_slice(), 8, 3),
        (
            "sys/revoked/0000000000000007",
            marker.to_string().as_bytes(),
            99,
            13,
        ),
    ]);
    for state in [&mut state, &mut reloaded] {
        let mut s = state.clone();
        let revoked = s.apply(14, &[del("l/b")]);
        assert_eq!(kinds(&revoked), [("b", Kind::Release, Ended::ForceRevoked)]);
        assert_eq!(revoked[0].identity, ALICE);
        assert_eq!(revoked[0].detail["approvedBy"], "ben");
        assert_eq!(revoked[0].detail["revokedWith"], "a");
    }
    // bob's session was not revoked: his lease lapsing is still an expiry
    let lapsed = state.apply(15, &[del("l/c"), del(&session_key(8))]);
    assert_eq!(
        kinds(&lapsed),
        [("c", Kind::Expiry, Ended::ExpiredOrRevoked)]
    );
    // and the marker's own lease ending forgets it
    state.apply(16, &[del("sys/revoked/0000000000000007")]);
    assert!(state.revoked.is_empty());
}

#[test]
fn a_hand_over_names_both_holders() {
    let mut state = started();
    state.apply(10, &[put("l/k", holder(ALICE, 7), 7)]);
    let events = state.apply(
        11,
        &[put("l/k", holder(BOB, 8), 8), del("c/k//000000000000000a")],
    );
    assert_eq!(kinds(&events), [("k", Kind::HandOver, Ended::No)]);
    let e = &events[0];
    assert_eq!((e.identity.as_str(), e.session), (BOB, 8));
    assert_eq!((e.prev_identity.as_str(), e.prev_session), (ALICE, 7));
    assert_eq!(e.hold_revision, 10, "the handed-over hold's grant");
    // bob's hold is the one that expires with his lease
    let expired = state.apply(12, &[del(&session_key(8)), del("l/k")]);
    assert_eq!(expired[0].identity, BOB);
    assert_eq!(expired[0].hold_revision, 11);
}

#[test]
fn a_group_commit_grants_several_keys_in_one_revision() {
    let mut state = started();
    let events = state.apply(
        10,
        &[
            put("l/a", holder(ALICE, 7), 7),
            put("l/b", holder(BOB, 8), 8),
        ],
    );
    assert_eq!(
        kinds(&events),
        [("a", Kind::Grant, Ended::No), ("b", Kind::Grant, Ended::No)]
    );
    assert!(events.iter().all(|e| e.revision == 10));
}

#[test]
fn an_advance_drops_every_hold_and_moves_the_epoch() {
    let mut state = started();
    state.apply(10, &[put("l/a", holder(ALICE, 7), 7)]);
    let seal = json!({
        "reason": "etcd revision 10 is below a grant of epoch 1",
        "sealedAtUnixMs": 1,
        "nextEpochAtLeast": 3,
    })
    .to_string()
    .into_bytes();
    let sealed = state.apply(11, &[put("sys/seal", seal, 0)]);
    assert_eq!(kinds(&sealed), [(SEAL_KEY, Kind::EpochSeal, Ended::No)]);
    // The seal's reason names revisions (tokens' low halves): kept without numbers.
    assert_eq!(
        sealed[0].detail["reason"],
        "etcd revision N is below a grant of epoch N"
    );
    let events = state.apply(
        12,
        &[
            put("sys/epoch", epoch(3), 0),
            del("l/a"),
            del("sys/seal"),
            del("c/a//000000000000000a"),
        ],
    );
    assert_eq!(
        kinds(&events),
        [
            ("a", Kind::EpochAdvance, Ended::EpochAdvance),
            (EPOCH_KEY, Kind::EpochAdvance, Ended::No),
        ]
    );
    assert_eq!(
        events[0].epoch, 1,
        "the dropped hold was granted in epoch 1"
    );
    assert_eq!(events[1].epoch, 3);
    assert_eq!(events[1].detail["previousEpoch"], 1);
    assert_eq!(events[1].detail["reason"], "to 3");
    let g = state.apply(13, &[put("l/a", holder(BOB, 8), 8)]);
    assert_eq!(g[0].epoch, 3);
}

fn force(key: &str, hold_revision: i64) -> ForceRecord {
    ForceRecord {
        key: key.into(),
        hold_revision,
        request_id: "fr-1".into(),
        requested_by: "op-alice".into(),
        approved_by: "op-bob".into(),
        reason: "renewing but never releasing".into(),
        enforcement: "advisory".into(),
        holder_identity: ALICE.into(),
        holder_session: 7,
        class: "ledger".into(),
        revoke_session: false,
        requested_at_unix_ms: 1,
        approved_at_unix_ms: 2,
        revoked_session: false,
        issuer: "https://sso".into(),
        requester_identity: "spiffe://td/op-alice".into(),
        approver_identity: "spiffe://td/op-bob".into(),
        election: false,
        term: 0,
    }
}

#[test]
fn a_force_release_is_the_hold_deleted_with_a_force_record() {
    let mut state = started();
    state.apply(10, &[put("l/k", holder(ALICE, 7), 7)]);
    let record = force("k", 10);
    let events = state.apply(
        11,
        &[
            del("l/k"),
            put(
                &record_name(&record.request_id),
                serde_json::to_vec(&record).unwrap(),
                99,
            ),
        ],
    );
    assert_eq!(
        kinds(&events),
        [("k", Kind::ForceRelease, Ended::ForceReleased)]
    );
    let e = &events[0];
    assert_eq!((e.identity.as_str(), e.hold_revision), (ALICE, 10));
    assert_eq!(e.detail["requestedBy"], "op-alice");
    assert_eq!(e.detail["approvedBy"], "op-bob");
    assert_eq!(e.detail["enforcement"], "advisory");
    assert_eq!(e.detail["holdDeleted"], true);
    // the session lives on: its next hold is an ordinary grant
    let g = state.apply(12, &[put("l/k", holder(ALICE, 7), 7)]);
    assert_eq!(g[0].kind, Kind::Grant);
}

#[test]
fn a_force_record_alone_is_still_recorded() {
    let mut state = started();
    let record = force("gone", 5);
    let events = state.apply(
        11,
        &[put(
            &record_name(&record.request_id),
            serde_json::to_vec(&record).unwrap(),
            99,
        )],
    );
    assert_eq!(
        kinds(&events),
        [("gone", Kind::ForceRelease, Ended::ForceReleased)]
    );
    assert_eq!(events[0].hold_revision, 5);
    assert_eq!(events[0].detail["holdDeleted"], false);
    assert_eq!(events[0].detail["requestId"], "fr-1");
}

/// A force record that does not decode is still the operators' act: its
/// key, as the arbiter spells it (`sys/force/<request id>`), names the
/// request, and nothing names the hold (issue 32: the tailer once parsed
/// a key no arbiter wrote, `sys/force/<key>//<revision>`).
#[test]
fn an_undecodable_force_record_is_recorded_by_its_request() {
    let mut state = started();
    let name = record_name("0123456789abcdef0123456789abcdef");
    let events = state.apply(11, &[put(&name, b"not json".to_vec(), 99)]);
    assert_eq!(
        kinds(&events),
        [(name.as_str(), Kind::ForceRelease, Ended::ForceReleased)]
    );
    assert_eq!(events[0].hold_revision, 0);
    assert_eq!(
        events[0].detail["requestId"],
        "0123456789abcdef0123456789abcdef"
    );
    assert_eq!(events[0].detail["reason"], "(undecodable force record)");
    assert_eq!(events[0].detail["holdDeleted"], false);
}

#[test]
fn a_hold_the_tailer_never_saw_ends_as_unknown() {
    let mut state = started();
    let events = state.apply(10, &[del("l/old")]);
    assert_eq!(kinds(&events), [("old", Kind::Release, Ended::Unknown)]);
}

#[test]
fn a_loaded_state_knows_holds_sessions_and_the_epoch() {
    let hold = holder(ALICE, 7);
    let e = epoch(4);
    let kvs: Vec<(&str, &[u8], i64, i64)> = vec![
        ("sys/epoch", &e, 0, 1),
        ("s/0000000000000007", b"{}", 7, 2),
        ("l/k", &hold, 7, 9),
        ("c/k//0000000000000009", b"", 7, 9),
    ];
    let mut state = LogState::load(kvs);
    assert_eq!((state.epoch(), state.holds()), (4, 1));
    let events = state.apply(10, &[del("l/k")]);
    assert_eq!(kinds(&events), [("k", Kind::Release, Ended::Released)]);
    assert_eq!((events[0].hold_revision, events[0].epoch), (9, 4));
}

#[test]
fn other_keys_make_no_events() {
    let mut state = started();
    let events = state.apply(
        10,
        &[
            put("sys/coord-seen", b"{}".to_vec(), 0),
            put("q/x", Vec::new(), 0),
            put("c/k//0000000000000001", Vec::new(), 7),
        ],
    );
    assert!(events.is_empty());
}

// Elections (issue 33): the arbiter's leadership transactions
// (`arbiter/src/lock_log/etcd/elections.rs`), in their order of operations.

use latchkey_records::{LeadRecord, TermEnd, TermRecord, encode};

const ELECTION: &str = "demo/leader";

/// The leader record the arbiter puts on `session`'s lease.
fn lead(identity: &str, session: i64, count: u32, value: &str, priority: u32) -> Vec<u8> {
    encode(&LeadRecord {
        identity: identity.into(),
        session,
        class: "elect".into(),
        epoch: 1,
        count,
        value: value.into(),
        priority,
        since_unix_ms: 1_700_000_000_000,
        instance: String::new(),
        bound: String::new(),
        yields: false,
    })
}

fn term_record(count: u32, ended: Option<TermEnd>) -> Vec<u8> {
    encode(&TermRecord {
        count,
        ended,
        subject: ALICE.into(),
    })
}

fn e(rest: &str) -> String {
    format!("e/{ELECTION}//{rest}")
}

fn candidate(priority: u32, session: i64) -> String {
    e(&format!(
        "c/{:08x}/{session:016x}",
        latchkey_records::candidate_rank(priority)
    ))
}

/// A subject's leadership entry (on the leader's lease) or term entry.
fn entry(kind: &str, subject: &str) -> String {
    let hex: String = subject.bytes().map(|b| format!("{b:02x}")).collect();
    format!("e//{kind}/{hex}/{ELECTION}")
}

/// Alice's campaign over a vacancy, as term `count` (its first: the term
/// entry is made too).
fn campaign(state: &mut LogState, revision: i64, count: u32, value: &str) -> Vec<Event> {
    state.apply(
        revision,
        &[
            put(&e("term"), term_record(count, None), 0),
            put(&e("lead"), lead(ALICE, 7, count, value, 5), 7),
            put(&entry("i", ALICE), Vec::new(), 7),
            del(&candidate(5, 7)),
            put(&entry("t", ALICE), Vec::new(), 0),
        ],
    )
}

fn term(count: u32) -> u64 {
    latchkey_records::term_of(1, count)
}

#[test]
fn a_campaign_starts_a_term_and_a_proclamation_names_it() {
    let mut state = started();
    // Standing first: a candidate record is no event.
    let stood = state.apply(9, &[put(&candidate(5, 7), b"{}".to_vec(), 7)]);
    assert!(stood.is_empty(), "{stood:?}");
    let started = campaign(&mut state, 10, 1, "pod-a");
    assert_eq!(kinds(&started), [(ELECTION, Kind::TermStart, Ended::No)]);
    let s = &started[0];
    assert_eq!((s.identity.as_str(), s.class.as_str()), (ALICE, "elect"));
    assert_eq!(s.session, 0, "no session id: Observe tells none");
    assert_eq!(s.epoch, 1);
    assert_eq!(
        s.detail,
        json!({"term": term(1), "value": "pod-a", "priority": 5, "sinceUnixMs": 1_700_000_000_000i64})
    );
    assert!(s.prev_identity.is_empty());
    assert_eq!(state.leaders(), 1);

    let p = state.apply(11, &[put(&e("lead"), lead(ALICE, 7, 1, "pod-a2", 5), 7)]);
    assert_eq!(kinds(&p), [(ELECTION, Kind::Proclaim, Ended::No)]);
    assert_eq!(p[0].identity, ALICE);
    assert_eq!(p[0].session, 0);
    assert_eq!(p[0].detail, json!({"term": term(1), "value": "pod-a2"}));
}

#[test]
fn a_resignation_to_a_successor_is_one_term_start_naming_the_term_it_ended() {
    let mut state = started();
    campaign(&mut state, 10, 1, "pod-a");
    state.apply(11, &[put(&candidate(0, 8), b"{}".to_vec(), 8)]);
    // Resign (or Transfer) to bob's candidacy: deletes nothing but the
    // candidate and alice's leadership entry.
    let events = state.apply(
        12,
        &[
            put(&e("term"), term_record(2, None), 0),
            put(&e("lead"), lead(BOB, 8, 2, "pod-b", 0), 8),
            put(&entry("i", BOB), Vec::new(), 8),
            del(&candidate(0, 8)),
            del(&entry("i", ALICE)),
        ],
    );
    assert_eq!(kinds(&events), [(ELECTION, Kind::TermStart, Ended::No)]);
    let s = &events[0];
    assert_eq!(
        (s.identity.as_str(), s.prev_identity.as_str()),
        (BOB, ALICE)
    );
    assert_eq!(s.detail["term"], term(2));
    assert_eq!(s.detail["previousTerm"], term(1));
    assert_eq!(s.detail["value"], "pod-b");
    assert_eq!((s.session, s.prev_session), (0, 0));
    // bob's session ends later: his term's vacancy names him.
    let gone = state.apply(20, &[del(&session_key(8)), del(&e("lead"))]);
    assert_eq!(
        kinds(&gone),
        [(ELECTION, Kind::Vacancy, Ended::SessionEnded)]
    );
    assert_eq!(gone[0].identity, BOB);
}

#[test]
fn a_resignation_with_no_successor_is_a_resigned_vacancy() {
    let mut state = started();
    campaign(&mut state, 10, 3, "pod-a");
    let events = state.apply(
        11,
        &[
            put(&e("term"), term_record(3, Some(TermEnd::Resigned)), 0),
            del(&e("lead")),
            del(&entry("i", ALICE)),
        ],
    );
    assert_eq!(kinds(&events), [(ELECTION, Kind::Vacancy, Ended::Resigned)]);
    let v = &events[0];
    assert_eq!((v.identity.as_str(), v.session), (ALICE, 0));
    assert_eq!(v.detail, json!({"term": term(3)}));
    assert_eq!(state.leaders(), 0);
    // A campaign over the vacancy is a term start again, over no one.
    let again = campaign(&mut state, 12, 4, "pod-a");
    assert_eq!(kinds(&again), [(ELECTION, Kind::TermStart, Ended::No)]);
    assert!(again[0].prev_identity.is_empty());
}

#[test]
fn a_lapsed_leader_session_is_a_session_ended_vacancy() {
    let mut state = started();
    campaign(&mut state, 10, 1, "pod-a");
    state.apply(11, &[put(&candidate(0, 8), b"{}".to_vec(), 8)]);
    // alice's lease lapses: etcd deletes every key on it in one revision,
    // her leader record and leadership entry among them; no term write.
    let events = state.apply(
        20,
        &[
            del(&session_key(7)),
            del("si/00/0000000000000007"),
            del(&e("lead")),
            del(&entry("i", ALICE)),
        ],
    );
    assert_eq!(
        kinds(&events),
        [(ELECTION, Kind::Vacancy, Ended::SessionEnded)]
    );
    assert_eq!(events[0].detail["term"], term(1));
    // bob's candidate record going with his session is no event.
    let withdrawn = state.apply(21, &[del(&session_key(8)), del(&candidate(0, 8))]);
    assert!(withdrawn.is_empty(), "{withdrawn:?}");
}

#[test]
fn a_forced_end_is_a_force_released_vacancy() {
    // The approved force-release of a leadership: the term record marked
    // forced and the leader record deleted in one transaction, the
    // leader's session left running.
    let mut state = started();
    campaign(&mut state, 10, 1, "pod-a");
    let events = state.apply(
        11,
        &[
            put(&e("term"), term_record(1, Some(TermEnd::Forced)), 0),
            del(&e("lead")),
            del(&entry("i", ALICE)),
        ],
    );
    assert_eq!(
        kinds(&events),
        [(ELECTION, Kind::Vacancy, Ended::ForceReleased)]
    );
    assert_eq!(events[0].identity, ALICE);
    assert_eq!(events[0].detail["term"], term(1));
}

#[test]
fn an_elections_force_record_goes_with_its_vacancy_not_a_hold_of_its_name() {
    // The approval's transaction also puts the force record (election =
    // true): the operators' detail is on the vacancy, with no session, and
    // a lock key of the election's name shows nothing.
    let mut state = started();
    campaign(&mut state, 10, 1, "pod-a");
    state.apply(11, &[put(&format!("l/{ELECTION}"), holder(BOB, 8), 8)]);
    let record = ForceRecord {
        key: ELECTION.into(),
        hold_revision: 0,
        holder_session: 7,
        election: true,
        term: term(1),
        ..force(ELECTION, 0)
    };
    let events = state.apply(
        12,
        &[
            put(&e("term"), term_record(1, Some(TermEnd::Forced)), 0),
            del(&e("lead")),
            del(&entry("i", ALICE)),
            put(
                &format!("{}fr-1", latchkey_records::keys::FORCE),
                serde_json::to_vec(&record).expect("encodes"),
                0,
            ),
        ],
    );
    assert_eq!(
        kinds(&events),
        [(ELECTION, Kind::Vacancy, Ended::ForceReleased)]
    );
    let v = &events[0];
    assert_eq!(v.session, 0);
    assert_eq!(v.detail["requestId"], "fr-1");
    assert_eq!(v.detail["approvedBy"], "op-bob");
    assert_eq!(v.detail["election"], true);
    assert_eq!(v.detail["term"], term(1));
}

#[test]
fn an_advance_ends_every_term_as_an_epoch_advance() {
    let mut state = started();
    campaign(&mut state, 10, 1, "pod-a");
    // A lock key of the election's name, held too: one revision ends both.
    state.apply(11, &[put(&format!("l/{ELECTION}"), holder(BOB, 8), 8)]);
    let events = state.apply(
        12,
        &[
            put("sys/epoch", epoch(2), 0),
            del(&format!("l/{ELECTION}")),
            del(&e("lead")),
            del(&e("term")),
            del(&entry("i", ALICE)),
            del(&entry("t", ALICE)),
        ],
    );
    assert_eq!(
        kinds(&events),
        [
            (ELECTION, Kind::EpochAdvance, Ended::EpochAdvance),
            (ELECTION, Kind::Vacancy, Ended::EpochAdvance),
            (EPOCH_KEY, Kind::EpochAdvance, Ended::No),
        ]
    );
    let vacancy = &events[1];
    assert_eq!((vacancy.identity.as_str(), vacancy.epoch), (ALICE, 1));
    assert_eq!(vacancy.detail["term"], term(1));
    // The hold's end and the term's share a revision and a key, never an id.
    let key = crate::AuditKey::from_bytes(&[5u8; 32]).unwrap();
    let rows: Vec<_> = events
        .iter()
        .map(|e| crate::event::Row::new(9, e, Some(&key), 1, 0).unwrap())
        .collect();
    assert_ne!(rows[0].event_id, rows[1].event_id);
    assert_eq!(rows[1].key, ELECTION, "found by the election's name");
    assert!(rows[1].hold_id.is_empty() && rows[1].session == 0);
    // Terms go on in the new epoch.
    let next = state.apply(
        13,
        &[
            put(&e("term"), term_record(1, None), 0),
            put(
                &e("lead"),
                {
                    let mut r: LeadRecord =
                        latchkey_records::decode(&lead(BOB, 8, 1, "b", 0)).unwrap();
                    r.epoch = 2;
                    encode(&r)
                },
                8,
            ),
        ],
    );
    assert_eq!(kinds(&next), [(ELECTION, Kind::TermStart, Ended::No)]);
    assert_eq!(next[0].epoch, 2);
    assert_eq!(next[0].detail["term"], latchkey_records::term_of(2, 1));
}

#[test]
fn a_loaded_state_knows_its_leaders_and_ends_only_known_terms() {
    let lead_bytes = lead(ALICE, 7, 2, "pod-a", 0);
    let term_bytes = term_record(2, None);
    let subject = entry("i", ALICE);
    let mut state = LogState::load([
        ("sys/epoch", &epoch(1)[..], 0, 1),
        (e("term").as_str(), &term_bytes[..], 0, 10),
        (e("lead").as_str(), &lead_bytes[..], 7, 10),
        (subject.as_str(), &[][..], 7, 10),
    ]);
    assert_eq!(state.leaders(), 1);
    let events = state.apply(
        20,
        &[
            put(&e("term"), term_record(2, Some(TermEnd::Resigned)), 0),
            del(&e("lead")),
        ],
    );
    assert_eq!(kinds(&events), [(ELECTION, Kind::Vacancy, Ended::Resigned)]);
    assert_eq!(events[0].detail["term"], term(2));
    // A leader record the tailer never saw goes: Observe tells no vacancy
    // of a leader it did not know, nor does the audit.
    let unknown = state.apply(21, &[del("e/other//lead")]);
    assert!(unknown.is_empty(), "{unknown:?}");
}

#[test]
fn no_election_row_keeps_a_revision() {
    let mut state = started();
    let revision = 987_654_321;
    let mut events = campaign(&mut state, revision, 1, "pod-a");
    events.extend(state.apply(
        revision + 1,
        &[put(&e("lead"), lead(ALICE, 7, 1, "pod-a2", 5), 7)],
    ));
    events.extend(state.apply(revision + 2, &[del(&e("lead"))]));
    assert_eq!(events.len(), 3);
    let key = crate::AuditKey::from_bytes(&[5u8; 32]).unwrap();
    for e in &events {
        let row = crate::event::Row::new(9, e, Some(&key), 1, 0).unwrap();
        let json = serde_json::to_string(&row).unwrap();
        assert!(!json.contains("98765432"), "{json}");
        // nor alice's session (lease 7 would read as "session":7)
        assert!(json.contains("\"session\":0"), "{json}");
    }
}
