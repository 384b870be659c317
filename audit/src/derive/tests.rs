//! Each of the arbiter's transactions, as the watch delivers it, and the
//! events it must yield.

use serde_json::json;

use super::*;
use crate::force::ForceRecord;

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
                &record.relative_key(),
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
    let events = state.apply(11, &[put(&record.relative_key(), b"not json".to_vec(), 99)]);
    assert_eq!(
        kinds(&events),
        [("gone", Kind::ForceRelease, Ended::ForceReleased)]
    );
    assert_eq!(events[0].hold_revision, 5);
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
