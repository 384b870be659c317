//! A key is one kind at a time: a lock's grant compares its semaphore
//! slots' range (`<key>//`) empty, a slot's grant compares its semaphore's
//! name not held as a lock, each in its own transaction and in a batch.

use anyhow::ensure;
use latchkey_arbiter::lock_log::{BatchOp, GrantTxn, Granted, LockLog};
use latchkey_arbiter::records::slot_key;

use super::{epoch, lease, one_write, open, revision, revoke_all, unchanged};

/// A grant of `key` with no fence, no queue and no quota (the suite's).
fn txn<'a>(key: &'a str, session: i64, epoch: &'a [u8], record: &'a [u8]) -> GrantTxn<'a> {
    super::fence::grant_txn(key, session, epoch, 0, record)
}

/// Slots of one semaphore are granted side by side; a lock of its name is
/// refused while any is held (and said to be the other kind), and a slot of
/// a held lock likewise; neither refusal writes; each grants once the other
/// kind has gone.
pub async fn a_key_is_one_kind_at_a_time(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/kinds";
    let (a, b) = (lease(90, 1), lease(90, 2));
    let ra = open(log, a, identity).await?;
    let rb = open(log, b, identity).await?;
    let name = "contract/kinds/sem";
    let (s0, s1) = (slot_key(name, 0), slot_key(name, 1));

    let granted = log.grant(txn(&s0, a, &epoch, &ra)).await?.value;
    ensure!(granted == Granted::Yes, "slot 0: {granted:?}");
    let granted = log.grant(txn(&s1, b, &epoch, &rb)).await?.value;
    ensure!(granted == Granted::Yes, "slot 1 beside slot 0: {granted:?}");
    let refused = log.grant(txn(&s1, a, &epoch, &ra)).await?.value;
    ensure!(
        matches!(
            refused,
            Granted::No {
                holder: Some(_),
                other_kind: false,
                other_mode: None,
                ..
            }
        ),
        "a held slot is held: {refused:?}"
    );

    // The name as a lock: refused, the other kind said, nothing written.
    let before = revision(log).await?;
    let refused = log.grant(txn(name, a, &epoch, &ra)).await?.value;
    ensure!(
        matches!(
            refused,
            Granted::No {
                holder: None,
                other_kind: true,
                other_mode: None,
                ..
            }
        ),
        "a lock of a semaphore with held slots: {refused:?}"
    );
    unchanged(log, before, "a lock's grant over held slots").await?;
    // A key that merely begins like the name is another key.
    let beside = format!("{name}x");
    let granted = log.grant(txn(&beside, a, &epoch, &ra)).await?.value;
    ensure!(granted == Granted::Yes, "a neighbouring key: {granted:?}");

    // Both slots gone (one by its lease's end): the name is a lock again.
    log.revoke(b).await?;
    let held = log.holders_under(&format!("{name}//")).await?.value;
    ensure!(held.len() == 1, "slot 1 ended with its lease: {held:?}");
    let refused = log.grant(txn(name, a, &epoch, &ra)).await?.value;
    ensure!(
        matches!(
            refused,
            Granted::No {
                other_kind: true,
                other_mode: None,
                ..
            }
        ),
        "slot 0 is still held: {refused:?}"
    );
    log.revoke(a).await?;
    let (c, d) = (lease(90, 3), lease(90, 4));
    let rc = open(log, c, identity).await?;
    let rd = open(log, d, identity).await?;
    let before = revision(log).await?;
    let granted = log.grant(txn(name, c, &epoch, &rc)).await?.value;
    ensure!(
        granted == Granted::Yes,
        "the name as a lock once no slot is held: {granted:?}"
    );
    one_write(log, before, "the lock's grant").await?;

    // Now a slot of the held lock: refused as the other kind.
    let before = revision(log).await?;
    let refused = log.grant(txn(&s0, d, &epoch, &rd)).await?.value;
    ensure!(
        matches!(
            refused,
            Granted::No {
                holder: None,
                other_kind: true,
                other_mode: None,
                ..
            }
        ),
        "a slot of a held lock: {refused:?}"
    );
    unchanged(log, before, "a slot's grant under a held lock").await?;

    // A batch never carries a lock and a slot of it: both would pass their
    // compares on the store before the batch.
    if log.batch_limit() >= 2 {
        let other = "contract/kinds/other";
        let s_other = slot_key(other, 0);
        let before = revision(log).await?;
        let both = log
            .batch(vec![
                BatchOp::Grant(txn(other, c, &epoch, &rc)),
                BatchOp::Grant(txn(&s_other, d, &epoch, &rd)),
            ])
            .await;
        ensure!(both.is_err(), "a batch of a lock and its slot: {both:?}");
        unchanged(log, before, "a refused batch").await?;
        // Two slots of one semaphore go together, at one revision.
        let (s1, s2) = (slot_key(other, 1), slot_key(other, 2));
        let before = revision(log).await?;
        let both = log
            .batch(vec![
                BatchOp::Grant(txn(&s1, c, &epoch, &rc)),
                BatchOp::Grant(txn(&s2, d, &epoch, &rd)),
            ])
            .await?
            .value;
        ensure!(
            both.iter().all(|o| o.committed()),
            "two slots of one semaphore in a batch: {both:?}"
        );
        one_write(log, before, "a batch of two slots").await?;
    }
    revoke_all(log, &[c, d]).await?;
    Ok(())
}
