//! The lock log's contract: what the grant protocol may rely on from any
//! [`LockLog`], written as etcd behaves. Run against `latchkey_sim::MemLog`
//! (so the simulation explores etcd's behaviour, not an idea of it) and
//! against `EtcdLog` on a real etcd (so the contract is etcd's), both from
//! `tests/e2e/log_contract.rs`.
//!
//! Every case is one function on a shared log. Cases run one after the
//! other and nothing else writes meanwhile, so a write is checked to land
//! at exactly one revision above the read before it; no case depends on
//! absolute revision numbers or on wall-clock timing (expiry is revoke,
//! except in [`lease_expires_by_ttl`], which waits on tokio's clock only
//! when the caller asks). Each case has its own keys, identities and lease
//! ids and revokes its leases at the end; the epoch record and the seal
//! are the log's own, so the cases that seal also advance to lift it.

mod batch;
mod election;
mod fence;
mod follow;
mod force;
mod kinds;
mod modes;
mod queue;
mod quota;

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use batch::{
    a_batch_answers_each_member, a_batch_commits_at_one_revision,
    a_batch_on_one_key_twice_is_refused, hand_over_if_owned_compares_the_owner,
    release_if_owned_compares_the_owner,
};
use election::{
    a_forced_end_of_a_term_ends_only_the_named_term,
    a_hand_over_and_a_resignation_move_the_lead_in_one_revision,
    a_lead_refuses_on_any_stale_compare, a_lead_to_a_candidate_whose_lease_ended_fails,
    a_vacancy_is_led_by_one_of_two_racing_lead_txns, an_advance_deletes_every_election_record,
    an_election_watch_reports_every_change_from_a_revision,
    candidates_come_back_by_rank_then_session, proclaim_keeps_the_leadership,
    the_seal_refuses_lead_and_proclaim,
};
use fence::{
    a_batch_member_with_a_stale_fence_is_refused, a_grant_compares_the_map_fence,
    a_hand_over_compares_the_map_fence, raising_the_map_fence_never_lowers_it,
};
use follow::a_follow_reads_then_reports_every_change;
use force::{
    a_forced_end_ends_only_the_named_hold, an_operators_revocation_ends_the_session_record_first,
};
use kinds::a_key_is_one_kind_at_a_time;
use latchkey_arbiter::lock_log::{
    Claimed, GrantTxn, Granted, HandOverFrom, HandOverTxn, HeldAt, KeyWatch, Kv, LockLog,
    StoreError, WatchSignal,
};
use modes::{
    a_downgrade_is_one_transaction, a_writer_is_never_beside_a_reader,
    a_writers_intent_keeps_readers_out,
};
use queue::{
    a_durable_queue_stops_hand_overs_and_ends_with_its_session,
    durable_waiters_go_in_create_revision_order,
};
use quota::a_grant_takes_a_quota_place_in_its_transaction;

/// A session TTL no case outlives.
const TTL: u32 = 60;
/// The longest a watch may take to report an event that happened.
pub(crate) const WATCH_WAIT: Duration = Duration::from_secs(10);

/// How the suite may wait for a lease's TTL to run out.
#[derive(Debug, Clone, Copy)]
pub enum TtlClock {
    /// Skip [`lease_expires_by_ttl`]; expiry is still covered by revoke.
    Skip,
    /// Wait on tokio's clock, at most `within`: instant for a MemLog on a
    /// paused runtime, real seconds on a real etcd.
    Tokio { within: Duration },
}

/// Runs every case, in an order that keeps the shared records sane (the
/// epoch record first; cases that seal lift the seal again; the shard-map
/// fence cases last, as a raised fence stays and the other cases' grants
/// name none), and reports every failing case, not just the first.
pub async fn run_all(log: std::sync::Arc<dyn LockLog>, ttl: TtlClock) -> anyhow::Result<()> {
    let log = log.as_ref();
    let mut failed = Vec::new();
    macro_rules! case {
        ($name:ident $(, $arg:expr)?) => {
            if let Err(e) = $name(log $(, $arg)?).await {
                failed.push(format!("{}: {e:#}", stringify!($name)));
            }
        };
    }
    case!(create_epoch_only_once);
    case!(answers_carry_one_cluster_id);
    case!(grant_on_a_free_key);
    case!(grant_on_a_held_key);
    case!(grant_with_the_wrong_epoch);
    case!(grant_with_a_wrong_or_missing_session_record);
    case!(grant_on_a_revoked_lease);
    case!(release_of_the_hold_found);
    case!(release_of_a_stale_hold);
    case!(hand_over_replaces_the_holder);
    case!(a_grant_takes_a_quota_place_in_its_transaction);
    case!(a_key_is_one_kind_at_a_time);
    case!(a_writer_is_never_beside_a_reader);
    case!(a_downgrade_is_one_transaction);
    case!(a_writers_intent_keeps_readers_out);
    case!(a_forced_end_ends_only_the_named_hold);
    case!(an_operators_revocation_ends_the_session_record_first);
    case!(release_orphan_is_conditional);
    case!(a_claim_stops_the_orphan_release);
    case!(release_if_owned_compares_the_owner);
    case!(hand_over_if_owned_compares_the_owner);
    case!(a_batch_commits_at_one_revision);
    case!(a_batch_answers_each_member);
    case!(a_batch_on_one_key_twice_is_refused);
    case!(durable_waiters_go_in_create_revision_order);
    case!(a_durable_queue_stops_hand_overs_and_ends_with_its_session);
    case!(holders_under_a_prefix_and_count);
    case!(held_keys_come_in_bounded_pages);
    case!(sessions_and_their_count);
    case!(a_sessions_shadow_marks_end_with_its_lease);
    case!(revoke_deletes_every_key_in_one_revision);
    case!(renewals);
    case!(watch_from_a_revision);
    case!(a_follow_reads_then_reports_every_change);
    case!(a_vacancy_is_led_by_one_of_two_racing_lead_txns);
    case!(a_lead_refuses_on_any_stale_compare);
    case!(a_hand_over_and_a_resignation_move_the_lead_in_one_revision);
    case!(proclaim_keeps_the_leadership);
    case!(candidates_come_back_by_rank_then_session);
    case!(a_lead_to_a_candidate_whose_lease_ended_fails);
    case!(a_forced_end_of_a_term_ends_only_the_named_term);
    case!(an_election_watch_reports_every_change_from_a_revision);
    case!(an_advance_deletes_every_election_record);
    case!(the_seal_refuses_lead_and_proclaim);
    case!(revisions_are_never_reused);
    case!(put_seal_is_conditional);
    case!(put_coord_seen_is_conditional);
    case!(grant_while_sealed);
    case!(advance_deletes_holds_and_the_seal);
    case!(lease_expires_by_ttl, ttl);
    case!(a_grant_compares_the_map_fence);
    case!(raising_the_map_fence_never_lowers_it);
    case!(a_batch_member_with_a_stale_fence_is_refused);
    case!(a_hand_over_compares_the_map_fence);
    if failed.is_empty() {
        Ok(())
    } else {
        bail!(
            "{} contract case(s) failed:\n{}",
            failed.len(),
            failed.join("\n")
        )
    }
}

// --- helpers ---

/// A lease id of case `case`: distinct per case, positive, below 2^53.
fn lease(case: i64, n: i64) -> i64 {
    0x4C4B_0000_0000 + case * 0x100 + n
}

fn session_record(identity: &str) -> Vec<u8> {
    format!("session of {identity}").into_bytes()
}

fn holder_record(key: &str, session: i64) -> Vec<u8> {
    format!("{key} held by {session:x}").into_bytes()
}

/// The current revision, by a read (which must not move it).
async fn revision(log: &dyn LockLog) -> anyhow::Result<i64> {
    Ok(log.count_holds().await?.header.revision)
}

/// The epoch record's bytes, creating a record if the log has none.
async fn epoch(log: &dyn LockLog) -> anyhow::Result<Vec<u8>> {
    let records = log.records().await?.value;
    ensure!(
        records.seal.is_none(),
        "the log is sealed (an earlier case left its seal)"
    );
    if let Some(epoch) = records.epoch {
        return Ok(epoch.value);
    }
    log.create_epoch(b"contract epoch 1".to_vec()).await?;
    log.records()
        .await?
        .value
        .epoch
        .map(|e| e.value)
        .context("no epoch record after creating one")
}

/// Grants lease `id` and puts `identity`'s session record on it.
async fn open(log: &dyn LockLog, id: i64, identity: &str) -> anyhow::Result<Vec<u8>> {
    log.grant_lease(id, TTL).await?;
    let record = session_record(identity);
    log.put_session(id, identity, record.clone()).await?;
    Ok(record)
}

/// Grants `key` to session `id` of `identity`; the hold as a release
/// compares it.
async fn take(
    log: &dyn LockLog,
    key: &str,
    id: i64,
    identity: &str,
    epoch: &[u8],
) -> anyhow::Result<HeldAt> {
    let value = holder_record(key, id);
    let answer = log
        .grant(GrantTxn {
            key,
            session: id,
            holder_record: value.clone(),
            epoch,
            fence_at: 0,
            session_record: &session_record(identity),
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(
        answer.value == Granted::Yes,
        "grant of {key} to {id:x}: {:?}",
        answer.value
    );
    Ok(HeldAt {
        key: key.to_string(),
        session: id,
        revision: answer.header.revision,
        value,
    })
}

async fn revoke_all(log: &dyn LockLog, ids: &[i64]) -> anyhow::Result<()> {
    for id in ids {
        log.revoke(*id).await?;
    }
    Ok(())
}

/// Checks that nothing was written since `before`.
async fn unchanged(log: &dyn LockLog, before: i64, what: &str) -> anyhow::Result<()> {
    let now = revision(log).await?;
    ensure!(
        now == before,
        "{what} wrote: revision {before} became {now}"
    );
    Ok(())
}

/// Checks that exactly one revision was written since `before`; returns it.
async fn one_write(log: &dyn LockLog, before: i64, what: &str) -> anyhow::Result<i64> {
    let now = revision(log).await?;
    ensure!(
        now == before + 1,
        "{what}: revision {before} became {now}, not {}",
        before + 1
    );
    Ok(now)
}

async fn next_signal(watch: &mut Box<dyn KeyWatch>, what: &str) -> anyhow::Result<WatchSignal> {
    tokio::time::timeout(WATCH_WAIT, watch.next())
        .await
        .with_context(|| format!("no watch response within {WATCH_WAIT:?}: {what}"))
}

async fn seal_at(log: &dyn LockLog) -> anyhow::Result<Option<i64>> {
    Ok(log.records().await?.value.seal.map(|s| s.mod_revision))
}

/// The epoch record's mod revision.
async fn records_epoch_at(log: &dyn LockLog) -> anyhow::Result<i64> {
    Ok(log
        .records()
        .await?
        .value
        .epoch
        .context("no epoch record")?
        .mod_revision)
}

/// Lifts the seal by an advance to a new record; the new epoch bytes.
async fn lift_seal(log: &dyn LockLog, case: &str) -> anyhow::Result<Vec<u8>> {
    let records = log.records().await?.value;
    let epoch = records.epoch.context("no epoch record")?;
    let record = format!("contract epoch after {case} at {}", epoch.mod_revision).into_bytes();
    let advanced = log
        .advance(
            epoch.value,
            records.seal.map(|s| s.mod_revision),
            record.clone(),
        )
        .await?;
    ensure!(
        advanced.value.is_some(),
        "the advance to lift the seal failed"
    );
    Ok(record)
}

// --- epoch record ---

/// The epoch record is created once; a second create changes nothing.
pub async fn create_epoch_only_once(log: &dyn LockLog) -> anyhow::Result<()> {
    let before = log.records().await?;
    let first = log.create_epoch(b"contract epoch 1".to_vec()).await?;
    match &before.value.epoch {
        None => {
            ensure!(
                first.value,
                "the first create_epoch on an empty log did not create"
            );
            ensure!(first.header.revision == before.header.revision + 1);
            let epoch = log
                .records()
                .await?
                .value
                .epoch
                .context("no epoch record")?;
            ensure!(epoch.value == b"contract epoch 1");
            ensure!(epoch.create_revision == first.header.revision);
            ensure!(epoch.mod_revision == first.header.revision);
            ensure!(epoch.lease == 0, "the epoch record is on no lease");
        }
        Some(_) => {
            ensure!(!first.value, "create_epoch replaced an existing record");
            ensure!(first.header.revision == before.header.revision);
        }
    }
    let existing = log.records().await?;
    let second = log.create_epoch(b"contract epoch again".to_vec()).await?;
    ensure!(!second.value, "a second create_epoch created");
    ensure!(second.header.revision == existing.header.revision);
    ensure!(log.records().await?.value.epoch == existing.value.epoch);
    Ok(())
}

/// Every answer carries the cluster id, and it does not change.
pub async fn answers_carry_one_cluster_id(log: &dyn LockLog) -> anyhow::Result<()> {
    let id = lease(2, 0);
    let a = log.records().await?.header;
    let b = log.grant_lease(id, TTL).await?.header;
    let c = log
        .put_session(id, "spiffe://contract/cluster-id", b"s".to_vec())
        .await?
        .header;
    let d = log
        .count_sessions_of("spiffe://contract/cluster-id")
        .await?
        .header;
    ensure!(a.cluster_id != 0, "cluster id 0");
    for h in [b, c, d] {
        ensure!(h.cluster_id == a.cluster_id, "{h:?} vs {a:?}");
    }
    ensure!(b.revision == a.revision, "a lease grant writes no key");
    ensure!(c.revision == a.revision + 1);
    ensure!(d.revision == c.revision);
    revoke_all(log, &[id]).await
}

// --- grants ---

/// A grant on a free key commits at a new revision; the holder read shows
/// it there, on the session's lease.
pub async fn grant_on_a_free_key(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/grant-free", lease(3, 0));
    open(log, id, identity).await?;
    let key = "contract/grant-free/k";
    let before = revision(log).await?;
    let held = take(log, key, id, identity, &epoch).await?;
    ensure!(held.revision == before + 1, "granted at {}", held.revision);
    let read = log.holder(key).await?;
    ensure!(
        read.header.revision == held.revision,
        "a read moved the revision"
    );
    let kv = read.value.context("no holder after the grant")?;
    ensure!(
        kv == Kv {
            value: held.value.clone(),
            create_revision: held.revision,
            mod_revision: held.revision,
            lease: id,
        },
        "{kv:?}"
    );
    revoke_all(log, &[id]).await
}

/// A grant on a held key fails, and the failure branch read the holder.
pub async fn grant_on_a_held_key(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/grant-held/a",
        "spiffe://contract/grant-held/b",
    );
    let (ia, ib) = (lease(4, 0), lease(4, 1));
    open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let key = "contract/grant-held/k";
    let held = take(log, key, ia, a, &epoch).await?;
    let answer = log
        .grant(GrantTxn {
            key,
            session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            fence_at: 0,
            session_record: &rb,
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(
        answer.header.revision == held.revision,
        "a failed grant wrote"
    );
    let expected = Granted::No {
        holder: Some(Kv {
            value: held.value.clone(),
            create_revision: held.revision,
            mod_revision: held.revision,
            lease: ia,
        }),
        epoch: Some(epoch.clone()),
        sealed: false,
        session: Some(rb),
        queue_head: None,
        fence_at: 0,
        other_kind: false,
        other_mode: None,
        intent: None,
    };
    ensure!(answer.value == expected, "{:?}", answer.value);
    // the holder's own session again: refused the same way
    let again = log
        .grant(GrantTxn {
            key,
            session: ia,
            holder_record: holder_record(key, ia),
            epoch: &epoch,
            fence_at: 0,
            session_record: &session_record(a),
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(matches!(
        again.value,
        Granted::No {
            holder: Some(_),
            ..
        }
    ));
    unchanged(log, held.revision, "the refused grants").await?;
    revoke_all(log, &[ia, ib]).await
}

/// A grant with epoch bytes that are not the record's fails and reports
/// the record's bytes.
pub async fn grant_with_the_wrong_epoch(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/grant-epoch", lease(5, 0));
    let record = open(log, id, identity).await?;
    let key = "contract/grant-epoch/k";
    let before = revision(log).await?;
    let answer = log
        .grant(GrantTxn {
            key,
            session: id,
            holder_record: holder_record(key, id),
            epoch: b"not the epoch record",
            fence_at: 0,
            session_record: &record,
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(
        answer.value
            == Granted::No {
                holder: None,
                epoch: Some(epoch),
                sealed: false,
                session: Some(record),
                queue_head: None,
                fence_at: 0,
                other_kind: false,
                other_mode: None,
                intent: None,
            },
        "{:?}",
        answer.value
    );
    ensure!(answer.header.revision == before);
    ensure!(log.holder(key).await?.value.is_none());
    unchanged(log, before, "the refused grant").await?;
    revoke_all(log, &[id]).await
}

/// A grant whose session record is not the stored one, or whose session
/// has no record, fails and reports what is stored.
pub async fn grant_with_a_wrong_or_missing_session_record(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/grant-session";
    let (with_record, bare) = (lease(6, 0), lease(6, 1));
    let record = open(log, with_record, identity).await?;
    log.grant_lease(bare, TTL).await?;
    let key = "contract/grant-session/k";
    let before = revision(log).await?;
    let wrong = log
        .grant(GrantTxn {
            key,
            session: with_record,
            holder_record: holder_record(key, with_record),
            epoch: &epoch,
            fence_at: 0,
            session_record: &session_record("spiffe://contract/someone-else"),
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(
        wrong.value
            == Granted::No {
                holder: None,
                epoch: Some(epoch.clone()),
                sealed: false,
                session: Some(record.clone()),
                queue_head: None,
                fence_at: 0,
                other_kind: false,
                other_mode: None,
                intent: None,
            },
        "wrong record: {:?}",
        wrong.value
    );
    let missing = log
        .grant(GrantTxn {
            key,
            session: bare,
            holder_record: holder_record(key, bare),
            epoch: &epoch,
            fence_at: 0,
            session_record: &record,
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(
        missing.value
            == Granted::No {
                holder: None,
                epoch: Some(epoch),
                sealed: false,
                session: None,
                queue_head: None,
                fence_at: 0,
                other_kind: false,
                other_mode: None,
                intent: None,
            },
        "no record: {:?}",
        missing.value
    );
    unchanged(log, before, "the refused grants").await?;
    revoke_all(log, &[with_record, bare]).await
}

/// After a revoke the session's record is gone with its lease, so a grant
/// on it fails its session compare (etcd checks a put's lease only on the
/// branch taken); a put on the lease is `LeaseGone`. Nothing is written.
pub async fn grant_on_a_revoked_lease(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/grant-revoked", lease(7, 0));
    let record = open(log, id, identity).await?;
    log.revoke(id).await?;
    let key = "contract/grant-revoked/k";
    let before = revision(log).await?;
    let answer = log
        .grant(GrantTxn {
            key,
            session: id,
            holder_record: holder_record(key, id),
            epoch: &epoch,
            fence_at: 0,
            session_record: &record,
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(
        answer.value
            == Granted::No {
                holder: None,
                epoch: Some(epoch),
                sealed: false,
                session: None,
                queue_head: None,
                fence_at: 0,
                other_kind: false,
                other_mode: None,
                intent: None,
            },
        "{:?}",
        answer.value
    );
    match log.put_session(id, identity, record.clone()).await {
        Err(StoreError::LeaseGone { lease }) => ensure!(lease == id, "LeaseGone names {lease:x}"),
        other => bail!("put_session on a revoked lease: {other:?}"),
    }
    let never = lease(7, 1);
    match log.put_session(never, identity, record).await {
        Err(StoreError::LeaseGone { lease }) => ensure!(lease == never),
        other => bail!("put_session on a lease never granted: {other:?}"),
    }
    ensure!(log.holder(key).await?.value.is_none());
    ensure!(log.session(id).await?.value.is_none());
    ensure!(log.count_sessions_of(identity).await?.value == 0);
    unchanged(log, before, "grant and puts on a revoked lease").await
}

// --- releases and hand-overs ---

/// A release of the hold as found deletes it and returns its bytes; a
/// second release finds nothing.
pub async fn release_of_the_hold_found(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/release", lease(8, 0));
    open(log, id, identity).await?;
    let held = take(log, "contract/release/k", id, identity, &epoch).await?;
    let released = log.release(&held).await?;
    ensure!(
        released.value.as_deref() == Some(held.value.as_slice()),
        "{:?}",
        released.value
    );
    ensure!(released.header.revision == held.revision + 1);
    ensure!(log.holder(&held.key).await?.value.is_none());
    let again = log.release(&held).await?;
    ensure!(again.value.is_none(), "released twice");
    unchanged(log, released.header.revision, "a second release").await?;
    revoke_all(log, &[id]).await
}

/// A release whose revision, lease or bytes are not the hold's deletes
/// nothing, and neither does one of an earlier hold of the same key.
pub async fn release_of_a_stale_hold(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id, other) = ("spiffe://contract/release-stale", lease(9, 0), lease(9, 1));
    open(log, id, identity).await?;
    open(log, other, identity).await?;
    let held = take(log, "contract/release-stale/k", id, identity, &epoch).await?;
    let stale = [
        HeldAt {
            revision: held.revision - 1,
            ..held.clone()
        },
        HeldAt {
            session: other,
            ..held.clone()
        },
        HeldAt {
            value: b"someone else's record".to_vec(),
            ..held.clone()
        },
    ];
    for s in &stale {
        let answer = log.release(s).await?;
        ensure!(answer.value.is_none(), "released with {s:?}");
        ensure!(answer.header.revision == held.revision);
    }
    let kv = log
        .holder(&held.key)
        .await?
        .value
        .context("the hold went")?;
    ensure!(kv.mod_revision == held.revision && kv.lease == id);
    // released and granted again: the first hold's HeldAt is stale
    log.release(&held).await?;
    let again = take(log, &held.key, id, identity, &epoch).await?;
    let answer = log.release(&held).await?;
    ensure!(
        answer.value.is_none(),
        "an earlier hold released a later one"
    );
    unchanged(log, again.revision, "stale releases").await?;
    let kv = log
        .holder(&held.key)
        .await?
        .value
        .context("the new hold went")?;
    ensure!(kv.mod_revision == again.revision);
    revoke_all(log, &[id, other]).await
}

/// A hand-over puts the next session's record on its lease over the hold,
/// at a new revision, and returns the replaced bytes; compared as a
/// release, and refused when the next session's record is not as given.
pub async fn hand_over_replaces_the_holder(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b, c) = (
        "spiffe://contract/hand-over/a",
        "spiffe://contract/hand-over/b",
        "spiffe://contract/hand-over/c",
    );
    let (ia, ib, ic) = (lease(10, 0), lease(10, 1), lease(10, 2));
    open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let rc = open(log, ic, c).await?;
    let key = "contract/hand-over/k";
    let held = take(log, key, ia, a, &epoch).await?;

    // the next session's record is not what the hand-over says
    let refused = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &rc,
        })
        .await?;
    ensure!(refused.value.is_none(), "{:?}", refused.value);
    unchanged(log, held.revision, "a refused hand-over").await?;

    let next = holder_record(key, ib);
    let handed = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ib,
            holder_record: next.clone(),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &rb,
        })
        .await?;
    ensure!(
        handed.value == Some(Some(held.value.clone())),
        "{:?}",
        handed.value
    );
    ensure!(handed.header.revision == held.revision + 1);
    let kv = log
        .holder(key)
        .await?
        .value
        .context("no holder after the hand-over")?;
    ensure!(
        kv == Kv {
            value: next.clone(),
            // a put over a key keeps its create revision
            create_revision: held.revision,
            mod_revision: handed.header.revision,
            lease: ib,
        },
        "{kv:?}"
    );
    // the replaced hold no longer hands over or releases
    let stale = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ic,
            holder_record: holder_record(key, ic),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &rc,
        })
        .await?;
    ensure!(stale.value.is_none());
    ensure!(log.release(&held).await?.value.is_none());
    unchanged(log, handed.header.revision, "stale hand-over and release").await?;

    // onto a revoked session: its record is gone, so the compare fails
    log.revoke(ic).await?;
    let before = revision(log).await?;
    let b_holds = HeldAt {
        key: key.to_string(),
        session: ib,
        revision: handed.header.revision,
        value: next,
    };
    let onto_gone = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&b_holds),
            next_session: ic,
            holder_record: holder_record(key, ic),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &rc,
        })
        .await?;
    ensure!(onto_gone.value.is_none(), "{:?}", onto_gone.value);
    unchanged(log, before, "a hand-over onto a revoked session").await?;
    revoke_all(log, &[ia, ib, ic]).await
}

/// The orphan release deletes only the hold on that lease at that revision.
pub async fn release_orphan_is_conditional(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/orphan", lease(11, 0));
    open(log, id, identity).await?;
    let key = "contract/orphan/k";
    let held = take(log, key, id, identity, &epoch).await?;
    for (session, rev) in [(id, held.revision - 1), (lease(11, 1), held.revision)] {
        let answer = log.release_orphan(key, session, rev).await?;
        ensure!(!answer.value, "released as orphan of {session:x} at {rev}");
        ensure!(answer.header.revision == held.revision);
    }
    let answer = log.release_orphan(key, id, held.revision).await?;
    ensure!(answer.value, "the orphan release failed");
    ensure!(answer.header.revision == held.revision + 1);
    ensure!(log.holder(key).await?.value.is_none());
    let again = log.release_orphan(key, id, held.revision).await?;
    ensure!(!again.value, "released twice");
    unchanged(log, answer.header.revision, "a second orphan release").await?;
    revoke_all(log, &[id]).await
}

/// A claim writes once (and never again for the same hold), only on the
/// hold as found; an orphan release of a claimed hold deletes nothing; a
/// release deletes the hold's claims with it, so a new hold of the key starts
/// unclaimed.
pub async fn a_claim_stops_the_orphan_release(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/claim", lease(22, 0));
    open(log, id, identity).await?;
    let key = "contract/claim/k";
    let held = take(log, key, id, identity, &epoch).await?;
    for (session, rev) in [(id, held.revision - 1), (lease(22, 1), held.revision)] {
        let answer = log.claim(key, session, rev).await?;
        ensure!(
            answer.value == Claimed::Gone,
            "claimed {session:x} at {rev}: {:?}",
            answer.value
        );
        unchanged(log, held.revision, "a claim of another hold").await?;
    }
    let claimed = log.claim(key, id, held.revision).await?;
    ensure!(
        claimed.value == Claimed::Now,
        "first claim: {:?}",
        claimed.value
    );
    let claimed_at = one_write(log, held.revision, "the first claim").await?;
    let again = log.claim(key, id, held.revision).await?;
    ensure!(
        again.value == Claimed::Already,
        "second claim: {:?}",
        again.value
    );
    unchanged(log, claimed_at, "a second claim").await?;

    let orphan = log.release_orphan(key, id, held.revision).await?;
    ensure!(!orphan.value, "a claimed hold was released as an orphan");
    unchanged(log, claimed_at, "an orphan release of a claimed hold").await?;
    ensure!(
        log.holder(key).await?.value.is_some(),
        "the claimed hold went"
    );

    // released with its claims: the next hold of the key is unclaimed
    let released = log.release(&held).await?;
    ensure!(released.value.is_some(), "the release failed");
    let next = take(log, key, id, identity, &epoch).await?;
    let orphan = log.release_orphan(key, id, next.revision).await?;
    ensure!(
        orphan.value,
        "an unclaimed hold was not released as an orphan"
    );
    revoke_all(log, &[id]).await
}

/// Held keys come in key order, a page at a time, keys only: the pages
/// of a scan neither overlap nor skip a key.
pub async fn held_keys_come_in_bounded_pages(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/pages", lease(13, 0));
    open(log, id, identity).await?;
    let mine = [
        "contract/pages/a",
        "contract/pages/b/1",
        "contract/pages/b/2",
        "contract/pages/c",
        "contract/pages/d",
    ];
    for key in mine {
        take(log, key, id, identity, &epoch).await?;
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = log.held_keys_page(after.as_deref(), 2).await?.value;
        ensure!(page.len() <= 2, "{page:?}");
        if let (Some(a), Some(first)) = (&after, page.first()) {
            ensure!(first > a, "page starts at {first:?}, not after {a:?}");
        }
        let Some(last) = page.last().cloned() else {
            break;
        };
        seen.extend(page);
        after = Some(last);
    }
    let ours: Vec<&str> = seen
        .iter()
        .map(String::as_str)
        .filter(|k| k.starts_with("contract/pages/"))
        .collect();
    ensure!(ours == mine, "{ours:?}");
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    ensure!(
        sorted == seen,
        "pages overlap or come out of order: {seen:?}"
    );
    revoke_all(log, &[id]).await
}

/// Holds under a prefix come in key order, exactly those under it; the
/// count covers every hold.
pub async fn holders_under_a_prefix_and_count(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/under", lease(12, 0));
    open(log, id, identity).await?;
    let count_before = log.count_holds().await?.value;
    let mut held = Vec::new();
    for key in [
        "contract/under/a/2",
        "contract/under/a/10",
        "contract/under/a/1",
        "contract/under/a",
        "contract/under/b/1",
    ] {
        held.push(take(log, key, id, identity, &epoch).await?);
    }
    let under = log.holders_under("contract/under/a/").await?.value;
    let keys: Vec<&str> = under.iter().map(|(k, _)| k.as_str()).collect();
    ensure!(
        keys == [
            "contract/under/a/1",
            "contract/under/a/10",
            "contract/under/a/2"
        ],
        "{keys:?}"
    );
    for (key, kv) in &under {
        let h = held.iter().find(|h| &h.key == key).context("unknown key")?;
        ensure!(kv.value == h.value && kv.mod_revision == h.revision && kv.lease == id);
    }
    ensure!(
        log.holders_under("contract/under/none/")
            .await?
            .value
            .is_empty()
    );
    ensure!(log.count_holds().await?.value == count_before + 5);
    revoke_all(log, &[id]).await?;
    ensure!(log.count_holds().await?.value == count_before);
    Ok(())
}

// --- sessions ---

/// Leases are granted once per id; a session record and its count entry
/// are put in one revision on the lease, counted per identity, and
/// deleted together only with the record's own bytes.
pub async fn sessions_and_their_count(log: &dyn LockLog) -> anyhow::Result<()> {
    let (a, a_b) = (
        "spiffe://contract/sessions/a",
        "spiffe://contract/sessions/a/b",
    );
    let (i1, i2, i3) = (lease(13, 0), lease(13, 1), lease(13, 2));
    log.grant_lease(i1, TTL).await?;
    match log.grant_lease(i1, TTL).await {
        Err(StoreError::LeaseExists { lease }) => ensure!(lease == i1),
        other => bail!("a second grant of lease {i1:x}: {other:?}"),
    }
    let before = revision(log).await?;
    let record = session_record(a);
    let put = log.put_session(i1, a, record.clone()).await?;
    ensure!(
        put.header.revision == before + 1,
        "the record and its entry: one revision"
    );
    let kv = log.session(i1).await?.value.context("no session record")?;
    ensure!(
        kv == Kv {
            value: record.clone(),
            create_revision: put.header.revision,
            mod_revision: put.header.revision,
            lease: i1,
        },
        "{kv:?}"
    );
    ensure!(log.count_sessions_of(a).await?.value == 1);
    open(log, i2, a).await?;
    // an identity that extends another's name is counted apart
    open(log, i3, a_b).await?;
    ensure!(log.count_sessions_of(a).await?.value == 2);
    ensure!(log.count_sessions_of(a_b).await?.value == 1);
    ensure!(
        log.count_sessions_of("spiffe://contract/sessions/none")
            .await?
            .value
            == 0
    );

    let before = revision(log).await?;
    let wrong = log
        .delete_session(i1, a, b"not the record".to_vec())
        .await?;
    ensure!(!wrong.value, "deleted with the wrong bytes");
    unchanged(log, before, "a refused session delete").await?;
    let deleted = log.delete_session(i1, a, record.clone()).await?;
    ensure!(deleted.value, "the session delete failed");
    ensure!(deleted.header.revision == before + 1);
    ensure!(log.session(i1).await?.value.is_none());
    ensure!(log.count_sessions_of(a).await?.value == 1);
    let again = log.delete_session(i1, a, record).await?;
    ensure!(!again.value, "deleted twice");
    // the lease outlives its record until revoked
    let renewed = log.renew(i1).await?;
    ensure!(renewed.ttl_seconds > 0, "{renewed:?}");
    revoke_all(log, &[i1, i2, i3]).await?;
    ensure!(log.count_sessions_of(a).await?.value == 0);
    ensure!(log.count_sessions_of(a_b).await?.value == 0);
    Ok(())
}

/// A session's shadow marks (ADR-09: the shards it has shadows on) are on
/// its lease: listed in name order, a mark put twice is one, and they end
/// with the lease; a mark for a session gone is `LeaseGone`, nothing written.
/// They are complete while the session opened, or they were vouched for,
/// after the epoch record's last write: an advance (every restore of the
/// lock cluster is followed by one) makes them incomplete until a vouch;
/// the vouch is on the lease too and is never read as a mark.
pub async fn a_sessions_shadow_marks_end_with_its_lease(log: &dyn LockLog) -> anyhow::Result<()> {
    let (identity, id, other) = ("spiffe://contract/shadows", lease(41, 0), lease(41, 1));
    epoch(log).await?;
    open(log, id, identity).await?;
    open(log, other, identity).await?;
    let fresh = log.shadow_marks(id).await?.value;
    ensure!(fresh.shards.is_empty(), "{fresh:?}");
    ensure!(
        fresh.complete(),
        "a session opened after the advance: {fresh:?}"
    );
    log.mark_shadow(id, "s2").await?;
    log.mark_shadow(id, "s1").await?;
    log.mark_shadow(id, "s1").await?;
    log.mark_shadow(other, "s3").await?;
    let marks = log.shadow_marks(id).await?.value;
    ensure!(
        marks.shards == ["s1", "s2"],
        "the marks of one session: {marks:?}"
    );
    ensure!(marks.complete());

    // An advance: every session opened before it has marks a restore may
    // have taken back, until they are vouched for.
    let before_advance = log.shadow_marks(id).await?.value;
    lift_seal(log, "the shadow marks").await?;
    let after = log.shadow_marks(id).await?.value;
    ensure!(!after.complete(), "marks from before an advance: {after:?}");
    ensure!(after.shards == ["s1", "s2"], "{after:?}");
    // A vouch on a read from before the advance does not count.
    ensure!(
        !log.vouch_shadows(id, before_advance.epoch_at).await?.value,
        "a vouch on marks read before an advance"
    );
    ensure!(!log.shadow_marks(id).await?.value.complete());
    ensure!(log.vouch_shadows(id, after.epoch_at).await?.value);
    ensure!(log.vouch_shadows(id, after.epoch_at).await?.value);
    let vouched = log.shadow_marks(id).await?.value;
    ensure!(vouched.complete(), "vouched after the advance: {vouched:?}");
    ensure!(
        vouched.shards == ["s1", "s2"],
        "the vouch read as a mark: {vouched:?}"
    );
    ensure!(!log.shadow_marks(other).await?.value.complete());

    // A seal (a restore noticed, the advance to come): not complete, and
    // no vouch, until the advance; then a vouch again.
    let epoch_at = records_epoch_at(log).await?;
    ensure!(
        log.put_seal(
            b"contract seal: shadow marks".to_vec(),
            None,
            Some(epoch_at)
        )
        .await?
        .value
    );
    let sealed = log.shadow_marks(id).await?.value;
    ensure!(sealed.sealed && !sealed.complete(), "{sealed:?}");
    ensure!(!log.vouch_shadows(id, sealed.epoch_at).await?.value);
    lift_seal(log, "the shadow marks' seal").await?;
    let lifted = log.shadow_marks(id).await?.value;
    ensure!(!lifted.sealed && !lifted.complete(), "{lifted:?}");
    ensure!(log.vouch_shadows(id, lifted.epoch_at).await?.value);
    ensure!(log.shadow_marks(id).await?.value.complete());

    log.revoke(id).await?;
    let gone = log.shadow_marks(id).await?.value;
    ensure!(
        gone.shards.is_empty() && !gone.complete(),
        "the marks or the vouch outlived their lease: {gone:?}"
    );
    ensure!(log.shadow_marks(other).await?.value.shards == ["s3"]);
    let before = revision(log).await?;
    match log.mark_shadow(id, "s4").await {
        Err(StoreError::LeaseGone { lease }) => ensure!(lease == id, "LeaseGone names {lease:x}"),
        other => bail!("a mark for a session gone: {other:?}"),
    }
    match log.vouch_shadows(id, records_epoch_at(log).await?).await {
        Err(StoreError::LeaseGone { lease }) => ensure!(lease == id, "LeaseGone names {lease:x}"),
        other => bail!("a vouch for a session gone: {other:?}"),
    }
    unchanged(log, before, "a mark or a vouch for a session gone").await?;
    revoke_all(log, &[other]).await?;
    Ok(())
}

/// A revoke deletes every key on the lease (holds, record, count entry) in
/// one revision; a revoke of a lease that is gone is no error and no write.
pub async fn revoke_deletes_every_key_in_one_revision(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/revoke", lease(14, 0));
    open(log, id, identity).await?;
    let (k1, k2) = ("contract/revoke/1", "contract/revoke/2");
    take(log, k1, id, identity, &epoch).await?;
    take(log, k2, id, identity, &epoch).await?;
    let before = revision(log).await?;
    let mut w1 = log.watch(k1, before + 1).await?;
    let mut w2 = log.watch(k2, before + 1).await?;
    log.revoke(id).await?;
    let after = one_write(log, before, "revoke").await?;
    ensure!(log.holder(k1).await?.value.is_none());
    ensure!(log.holder(k2).await?.value.is_none());
    ensure!(log.session(id).await?.value.is_none());
    ensure!(log.count_sessions_of(identity).await?.value == 0);
    ensure!(next_signal(&mut w1, "k1 revoked").await? == WatchSignal::Freed);
    ensure!(next_signal(&mut w2, "k2 revoked").await? == WatchSignal::Freed);
    log.revoke(id).await?;
    unchanged(log, after, "a revoke of a revoked lease").await?;
    // a lease with no keys goes without a write
    let empty = lease(14, 1);
    log.grant_lease(empty, TTL).await?;
    log.revoke(empty).await?;
    unchanged(log, after, "a revoke of a lease with no keys").await
}

/// A renewal of a live lease reports a positive TTL (at most the granted
/// one); of a revoked or unknown lease, 0 or less.
pub async fn renewals(log: &dyn LockLog) -> anyhow::Result<()> {
    let (live, revoked, unknown) = (lease(15, 0), lease(15, 1), lease(15, 2));
    log.grant_lease(live, TTL).await?;
    log.grant_lease(revoked, TTL).await?;
    let before = revision(log).await?;
    let renewal = log.renew(live).await?;
    ensure!(
        renewal.ttl_seconds > 0 && renewal.ttl_seconds <= i64::from(TTL),
        "{renewal:?}"
    );
    log.revoke(revoked).await?;
    let gone = log.renew(revoked).await?;
    ensure!(gone.ttl_seconds <= 0, "a revoked lease renewed: {gone:?}");
    let never = log.renew(unknown).await?;
    ensure!(
        never.ttl_seconds <= 0,
        "an unknown lease renewed: {never:?}"
    );
    unchanged(log, before, "renewals").await?;
    revoke_all(log, &[live]).await
}

// --- watches ---

/// A watch from a revision first reports what happened from there (a
/// delete: `Freed`; a put: `Changed`), then what happens next.
pub async fn watch_from_a_revision(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/watch", lease(16, 0));
    open(log, id, identity).await?;
    let key = "contract/watch/k";
    let held = take(log, key, id, identity, &epoch).await?;
    let released = log.release(&held).await?.header.revision;

    // an earlier delete, then a later put
    let mut watch = log.watch(key, released).await?;
    ensure!(next_signal(&mut watch, "the earlier release").await? == WatchSignal::Freed);
    let again = take(log, key, id, identity, &epoch).await?;
    ensure!(next_signal(&mut watch, "the later grant").await? == WatchSignal::Changed);

    // an earlier put, then a later delete
    let mut watch = log.watch(key, again.revision).await?;
    ensure!(next_signal(&mut watch, "the earlier grant").await? == WatchSignal::Changed);
    log.release(&again).await?;
    ensure!(next_signal(&mut watch, "the later release").await? == WatchSignal::Freed);

    // from the next revision: only what comes after
    let from = revision(log).await? + 1;
    let mut watch = log.watch(key, from).await?;
    take(log, key, id, identity, &epoch).await?;
    ensure!(next_signal(&mut watch, "a grant after the watch").await? == WatchSignal::Changed);
    // writes to other keys are not this watch's
    let other = take(log, "contract/watch/other", id, identity, &epoch).await?;
    log.release(&other).await?;
    log.revoke(id).await?;
    ensure!(next_signal(&mut watch, "the revoke").await? == WatchSignal::Freed);
    Ok(())
}

/// Every write lands one revision above the last; reads and refused
/// writes leave the revision where it was, so no revision is used twice.
pub async fn revisions_are_never_reused(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id, next) = ("spiffe://contract/revisions", lease(17, 0), lease(17, 1));
    let key = "contract/revisions/k";
    let mut seen = vec![revision(log).await?];
    log.grant_lease(id, TTL).await?;
    log.grant_lease(next, TTL).await?;
    let record = session_record(identity);
    let rev = log
        .put_session(id, identity, record.clone())
        .await?
        .header
        .revision;
    wrote("put_session", rev, &mut seen)?;
    let rev = log
        .put_session(next, identity, record.clone())
        .await?
        .header
        .revision;
    wrote("put_session", rev, &mut seen)?;
    let held = take(log, key, id, identity, &epoch).await?;
    wrote("grant", held.revision, &mut seen)?;
    let refused = take(log, key, next, identity, &epoch).await;
    ensure!(refused.is_err(), "a second grant of a held key");
    unchanged(log, held.revision, "a refused grant").await?;
    let next_value = holder_record(key, next);
    let handed = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: next,
            holder_record: next_value.clone(),
            epoch: &epoch,
            fence_at: 0,
            next_session_record: &record,
        })
        .await?;
    wrote("hand_over", handed.header.revision, &mut seen)?;
    let released = log
        .release(&HeldAt {
            key: key.to_string(),
            session: next,
            revision: handed.header.revision,
            value: next_value,
        })
        .await?;
    ensure!(released.value.is_some());
    wrote("release", released.header.revision, &mut seen)?;
    let deleted = log.delete_session(id, identity, record).await?;
    ensure!(deleted.value);
    wrote("delete_session", deleted.header.revision, &mut seen)?;
    log.revoke(next).await?;
    wrote("revoke", revision(log).await?, &mut seen)?;
    // a lease whose keys are gone: nothing to delete
    log.revoke(id).await?;
    let last = seen.last().copied().unwrap_or_default();
    unchanged(log, last, "a revoke of a lease with no keys").await
}

/// Checks that a write landed one revision above the last one in `seen`.
fn wrote(what: &str, rev: i64, seen: &mut Vec<i64>) -> anyhow::Result<()> {
    let last = seen.last().copied().unwrap_or_default();
    ensure!(rev == last + 1, "{what} at {rev}, after {last}");
    seen.push(rev);
    Ok(())
}

// --- the seal and the advance ---

/// The seal is put only when the seal and the epoch record are where the
/// caller saw them.
pub async fn put_seal_is_conditional(log: &dyn LockLog) -> anyhow::Result<()> {
    epoch(log).await?;
    let epoch = log
        .records()
        .await?
        .value
        .epoch
        .context("no epoch record")?;
    let at = epoch.mod_revision;
    let before = revision(log).await?;
    for (seal_at, epoch_at, why) in [
        (
            None,
            Some(at + 1000),
            "the epoch record at another revision",
        ),
        (Some(before), Some(at), "a seal that is not there"),
        (None, None, "an epoch record said absent"),
    ] {
        let answer = log.put_seal(b"seal 1".to_vec(), seal_at, epoch_at).await?;
        ensure!(!answer.value, "sealed despite {why}");
        ensure!(answer.header.revision == before);
    }
    let first = log.put_seal(b"seal 1".to_vec(), None, Some(at)).await?;
    ensure!(first.value, "the seal was not put");
    ensure!(first.header.revision == before + 1);
    let seal = log.records().await?.value.seal.context("no seal")?;
    ensure!(
        seal == Kv {
            value: b"seal 1".to_vec(),
            create_revision: first.header.revision,
            mod_revision: first.header.revision,
            lease: 0,
        },
        "{seal:?}"
    );
    let over = log.put_seal(b"seal 2".to_vec(), None, Some(at)).await?;
    ensure!(!over.value, "a seal said absent was overwritten");
    let raised = log
        .put_seal(b"seal 2".to_vec(), Some(seal.mod_revision), Some(at))
        .await?;
    ensure!(raised.value, "the seal at its revision was not replaced");
    ensure!(raised.header.revision == first.header.revision + 1);
    let seal = log.records().await?.value.seal.context("no seal")?;
    ensure!(seal.value == b"seal 2" && seal.create_revision == first.header.revision);
    lift_seal(log, "put_seal_is_conditional").await?;
    Ok(())
}

/// The coord-seen record is put only where the caller saw it, and read
/// back with the epoch record and the seal.
pub async fn put_coord_seen_is_conditional(log: &dyn LockLog) -> anyhow::Result<()> {
    epoch(log).await?;
    let found = log.records().await?.value.coord_seen;
    let at = found.as_ref().map(|kv| kv.mod_revision);
    let before = revision(log).await?;
    let stale = match at {
        Some(rev) => vec![
            (None, "a record said absent"),
            (Some(rev + 1000), "another revision"),
        ],
        None => vec![(Some(before), "a record that is not there")],
    };
    for (wrong, why) in stale {
        let answer = log.put_coord_seen(b"seen 0".to_vec(), wrong).await?;
        ensure!(!answer.value, "written despite {why}");
        ensure!(answer.header.revision == before, "a refused put wrote");
    }
    let first = log.put_coord_seen(b"seen 1".to_vec(), at).await?;
    ensure!(first.value, "the record was not put at {at:?}");
    ensure!(first.header.revision == before + 1);
    let kv = log
        .records()
        .await?
        .value
        .coord_seen
        .context("no coord-seen record")?;
    ensure!(
        kv.value == b"seen 1" && kv.mod_revision == first.header.revision && kv.lease == 0,
        "{kv:?}"
    );
    let again = log.put_coord_seen(b"seen 2".to_vec(), at).await?;
    ensure!(
        !again.value,
        "a put at the old revision overwrote the new record"
    );
    let next = log
        .put_coord_seen(b"seen 2".to_vec(), Some(kv.mod_revision))
        .await?;
    ensure!(next.value, "the record at its revision was not replaced");
    Ok(())
}

/// A grant while sealed fails and reports the seal.
pub async fn grant_while_sealed(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch_bytes = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/sealed", lease(18, 0));
    let record = open(log, id, identity).await?;
    let at = log
        .records()
        .await?
        .value
        .epoch
        .context("no epoch")?
        .mod_revision;
    ensure!(
        log.put_seal(b"contract seal".to_vec(), None, Some(at))
            .await?
            .value
    );
    let before = revision(log).await?;
    let key = "contract/sealed/k";
    let answer = log
        .grant(GrantTxn {
            key,
            session: id,
            holder_record: holder_record(key, id),
            epoch: &epoch_bytes,
            fence_at: 0,
            session_record: &record,
            queue: Default::default(),
            quota: None,
        })
        .await?;
    ensure!(
        answer.value
            == Granted::No {
                holder: None,
                epoch: Some(epoch_bytes),
                sealed: true,
                session: Some(record),
                queue_head: None,
                fence_at: 0,
                other_kind: false,
                other_mode: None,
                intent: None,
            },
        "{:?}",
        answer.value
    );
    unchanged(log, before, "a grant while sealed").await?;
    lift_seal(log, "grant_while_sealed").await?;
    revoke_all(log, &[id]).await
}

/// The advance compares the epoch record's bytes and the seal, then puts
/// the new record and deletes every hold and the seal in one revision;
/// sessions stay.
pub async fn advance_deletes_holds_and_the_seal(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch_bytes = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/advance", lease(19, 0));
    open(log, id, identity).await?;
    take(log, "contract/advance/1", id, identity, &epoch_bytes).await?;
    take(log, "contract/advance/2", id, identity, &epoch_bytes).await?;

    // without a seal, seal_at None
    let holds = log.count_holds().await?;
    let record = format!("contract epoch advanced at {}", holds.header.revision).into_bytes();
    let advanced = log
        .advance(epoch_bytes.clone(), None, record.clone())
        .await?;
    ensure!(
        advanced.value == Some(holds.value),
        "{:?} vs {} holds",
        advanced.value,
        holds.value
    );
    ensure!(advanced.header.revision == holds.header.revision + 1);
    ensure!(log.count_holds().await?.value == 0);
    ensure!(
        log.session(id).await?.value.is_some(),
        "the advance deleted a session"
    );

    // with a seal
    take(log, "contract/advance/3", id, identity, &record).await?;
    let at = log
        .records()
        .await?
        .value
        .epoch
        .context("no epoch")?
        .mod_revision;
    ensure!(
        log.put_seal(b"contract seal".to_vec(), None, Some(at))
            .await?
            .value
    );
    let seal = seal_at(log).await?.context("no seal")?;
    let before = revision(log).await?;
    let next = format!("contract epoch advanced at {before}").into_bytes();
    for (expected, seal_at, why) in [
        (epoch_bytes.clone(), Some(seal), "the old epoch bytes"),
        (record.clone(), None, "a seal said absent"),
        (
            record.clone(),
            Some(seal + 1000),
            "the seal at another revision",
        ),
    ] {
        let answer = log.advance(expected, seal_at, next.clone()).await?;
        ensure!(answer.value.is_none(), "advanced despite {why}");
    }
    unchanged(log, before, "refused advances").await?;
    let advanced = log.advance(record, Some(seal), next.clone()).await?;
    ensure!(advanced.value == Some(1), "{:?}", advanced.value);
    ensure!(
        advanced.header.revision == before + 1,
        "one revision for the advance"
    );
    let records = log.records().await?.value;
    ensure!(records.seal.is_none(), "the seal outlived the advance");
    let epoch = records.epoch.context("no epoch record")?;
    ensure!(epoch.value == next && epoch.mod_revision == advanced.header.revision);
    ensure!(log.count_holds().await?.value == 0);
    ensure!(log.session(id).await?.value.is_some());
    revoke_all(log, &[id]).await
}

// --- expiry by TTL ---

/// A lease left alone expires: its keys go in one revision and a watch
/// blocked on its hold wakes with `Freed`, with no other call made.
pub async fn lease_expires_by_ttl(log: &dyn LockLog, clock: TtlClock) -> anyhow::Result<()> {
    let TtlClock::Tokio { within } = clock else {
        return Ok(());
    };
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/expiry", lease(20, 0));
    // etcd's shortest TTL with its default election timeout
    log.grant_lease(id, 2).await?;
    log.put_session(id, identity, session_record(identity))
        .await?;
    let key = "contract/expiry/k";
    let held = take(log, key, id, identity, &epoch).await?;
    let mut watch = log.watch(key, held.revision + 1).await?;
    let signal = tokio::time::timeout(within, watch.next())
        .await
        .with_context(|| format!("the lease did not expire within {within:?}"))?;
    ensure!(signal == WatchSignal::Freed, "{signal:?}");
    one_write(log, held.revision, "the expiry").await?;
    ensure!(log.holder(key).await?.value.is_none());
    ensure!(log.session(id).await?.value.is_none());
    ensure!(log.count_sessions_of(identity).await?.value == 0);
    ensure!(log.renew(id).await?.ttl_seconds <= 0);
    Ok(())
}
