//! Quota places (`maxHoldsPerSubject`): a grant takes one in its own
//! transaction, compared as free or stale, on the session's lease.

use anyhow::ensure;
use latchkey_arbiter::lock_log::{GrantTxn, Granted, LockLog, PlaceWas, QuotaTake};

use super::{epoch, holder_record, lease, one_write, open, revision, revoke_all, unchanged};

const CLASS: &str = "contract-quota";
const SUBJECT: &str = "spiffe://contract/quota";

fn take(index: u32, was: PlaceWas, key: &str) -> QuotaTake {
    QuotaTake {
        class: CLASS.into(),
        subject: SUBJECT.into(),
        index,
        record: format!("place of {key}").into_bytes(),
        was,
    }
}

async fn grant(
    log: &dyn LockLog,
    key: &str,
    id: i64,
    session_record: &[u8],
    epoch: &[u8],
    quota: QuotaTake,
) -> anyhow::Result<(Granted, i64)> {
    let answer = log
        .grant(GrantTxn {
            key,
            session: id,
            holder_record: holder_record(key, id),
            epoch,
            fence_at: 0,
            session_record,
            queue: Default::default(),
            quota: Some(Box::new(quota)),
        })
        .await?;
    Ok((answer.value, answer.header.revision))
}

/// A place is taken with its hold or not at all: a free place once, a
/// stale one only once its hold has ended; a free of a place at another
/// revision changes nothing; a lease's end takes its places with it.
pub async fn a_grant_takes_a_quota_place_in_its_transaction(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (lease(40, 1), lease(40, 2));
    let sa = open(log, a, SUBJECT).await?;
    let sb = open(log, b, SUBJECT).await?;
    let (k1, k2, k3) = ("quota/k1", "quota/k2", "quota/k3");

    let before = revision(log).await?;
    let (granted, r1) = grant(log, k1, a, &sa, &epoch, take(0, PlaceWas::Free, k1)).await?;
    ensure!(granted == Granted::Yes, "the first grant: {granted:?}");
    ensure!(r1 == one_write(log, before, "a grant with a place").await?);
    let places = log.quota_places(CLASS, SUBJECT).await?.value;
    ensure!(
        places.len() == 1
            && places[0].0 == 0
            && places[0].1.mod_revision == r1
            && places[0].1.lease == a
            && places[0].1.value == b"place of quota/k1",
        "place 0 is at the hold's revision on its lease: {places:?}"
    );

    // The place is taken: a grant of another key compared as free fails,
    // writes nothing, and leaves the key free.
    let before = revision(log).await?;
    let (granted, _) = grant(log, k2, b, &sb, &epoch, take(0, PlaceWas::Free, k2)).await?;
    ensure!(
        matches!(granted, Granted::No { holder: None, .. }),
        "a taken place, compared free: {granted:?}"
    );
    unchanged(log, before, "a grant on a taken place").await?;
    ensure!(log.holder(k2).await?.value.is_none(), "k2 was granted");

    // Another place is free.
    let (granted, r2) = grant(log, k2, b, &sb, &epoch, take(1, PlaceWas::Free, k2)).await?;
    ensure!(granted == Granted::Yes, "place 1: {granted:?}");

    // The holds a full quota's places name, read together, in order.
    let read = log
        .holders_of(&[k2.to_string(), "quota/none".to_string(), k1.to_string()])
        .await?
        .value;
    ensure!(
        read.len() == 3
            && read[0].as_ref().map(|kv| kv.mod_revision) == Some(r2)
            && read[1].is_none()
            && read[2].as_ref().map(|kv| kv.mod_revision) == Some(r1),
        "holders_of: {read:?}"
    );

    // Place 0 compared as stale while its hold is still at its revision.
    let before = revision(log).await?;
    let stale = PlaceWas::Stale {
        revision: r1,
        key: k1.into(),
    };
    let (granted, _) = grant(log, k3, b, &sb, &epoch, take(0, stale.clone(), k3)).await?;
    ensure!(granted != Granted::Yes, "a live place taken as stale");
    unchanged(log, before, "a grant on a live place").await?;

    // Once k1 ends (its release did not free the place), the place is stale.
    let held = log.holder(k1).await?.value;
    ensure!(held.is_some(), "k1 is not held");
    let released = log
        .release(&latchkey_arbiter::lock_log::HeldAt {
            key: k1.into(),
            session: a,
            revision: r1,
            value: holder_record(k1, a),
        })
        .await?;
    ensure!(released.value.is_some(), "k1's release failed");
    let before = revision(log).await?;
    let (granted, r3) = grant(log, k3, b, &sb, &epoch, take(0, stale.clone(), k3)).await?;
    ensure!(granted == Granted::Yes, "a stale place: {granted:?}");
    ensure!(r3 == one_write(log, before, "a grant on a stale place").await?);
    // ... and taken only once.
    let before = revision(log).await?;
    let (granted, _) = grant(log, "quota/k4", a, &sa, &epoch, take(0, stale, "quota/k4")).await?;
    ensure!(granted != Granted::Yes, "a stale place taken twice");
    unchanged(log, before, "a second take of one stale place").await?;

    // A free at another revision changes nothing; at its own, one write.
    let before = revision(log).await?;
    ensure!(
        !log.free_quota_place(CLASS, SUBJECT, 0, r1).await?.value,
        "a place freed at a revision it is no longer at"
    );
    unchanged(log, before, "a free at another revision").await?;
    ensure!(log.free_quota_place(CLASS, SUBJECT, 1, r2).await?.value);
    one_write(log, before, "a free").await?;

    // Two members of one batch never take one place (refused, nothing
    // written), whichever log.
    if log.batch_limit() > 1 {
        let before = revision(log).await?;
        let (k5, k6) = ("quota/k5", "quota/k6");
        let member = |key: &'static str| {
            latchkey_arbiter::lock_log::BatchOp::Grant(GrantTxn {
                key,
                session: a,
                holder_record: holder_record(key, a),
                epoch: &epoch,
                fence_at: 0,
                session_record: &sa,
                queue: Default::default(),
                quota: Some(Box::new(take(2, PlaceWas::Free, key))),
            })
        };
        let refused = log.batch(vec![member(k5), member(k6)]).await;
        ensure!(
            matches!(
                refused,
                Err(latchkey_arbiter::lock_log::StoreError::Refused { .. })
            ),
            "a batch taking one place twice: {refused:?}"
        );
        unchanged(log, before, "a refused batch").await?;
    }

    // A lease's end takes its places.
    revoke_all(log, &[a, b]).await?;
    let places = log.quota_places(CLASS, SUBJECT).await?.value;
    ensure!(
        places.is_empty(),
        "places outlived their leases: {places:?}"
    );
    Ok(())
}
