//! A lock is held shared or exclusively, never both (issue 34): a shared
//! hold's grant (`<key>//r/<session>`) compares the key not held
//! exclusively and no semaphore slot under it; an exclusive grant compares
//! everything under `<key>//` absent; a downgrade ends the exclusive hold
//! and puts the shared one in one transaction.

use anyhow::ensure;
use latchkey_arbiter::lock_log::{BatchOp, DowngradeTxn, GrantTxn, Granted, LockLog};
use latchkey_arbiter::records::{reader_key, slot_key};

use super::{epoch, holder_record, lease, one_write, open, revision, revoke_all, take, unchanged};

fn txn<'a>(key: &'a str, session: i64, epoch: &'a [u8], record: &'a [u8]) -> GrantTxn<'a> {
    super::fence::grant_txn(key, session, epoch, 0, record)
}

/// Readers hold side by side; a writer is refused while any is held (the
/// other mode said, with a shared hold's record), and a reader while a
/// writer holds (with the writer's record); neither refusal writes; a slot
/// of a lock held shared is the other kind, as a shared hold of a
/// semaphore is.
pub async fn a_writer_is_never_beside_a_reader(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/modes";
    let (a, b, c) = (lease(91, 1), lease(91, 2), lease(91, 3));
    let ra = open(log, a, identity).await?;
    let rb = open(log, b, identity).await?;
    let rc = open(log, c, identity).await?;
    let name = "contract/modes/rw";
    let (read_a, read_b) = (reader_key(name, a), reader_key(name, b));

    let granted = log.grant(txn(&read_a, a, &epoch, &ra)).await?.value;
    ensure!(granted == Granted::Yes, "a shared hold: {granted:?}");
    let granted = log.grant(txn(&read_b, b, &epoch, &rb)).await?.value;
    ensure!(granted == Granted::Yes, "a second beside it: {granted:?}");

    let before = revision(log).await?;
    let refused = log.grant(txn(name, c, &epoch, &rc)).await?.value;
    ensure!(
        matches!(
            &refused,
            Granted::No {
                holder: None,
                other_kind: false,
                other_mode: Some(_),
                ..
            }
        ),
        "a writer beside readers: {refused:?}"
    );
    unchanged(log, before, "a writer's grant over readers").await?;
    // A slot under a lock held shared: the other kind.
    let refused = log
        .grant(txn(&slot_key(name, 0), c, &epoch, &rc))
        .await?
        .value;
    ensure!(
        matches!(
            refused,
            Granted::No {
                other_kind: true,
                ..
            }
        ),
        "a slot of a lock held shared: {refused:?}"
    );
    unchanged(log, before, "a slot's grant under readers").await?;

    // Both readers gone: the writer holds, and a reader is refused with
    // the writer's record.
    revoke_all(log, &[a, b]).await?;
    let before = revision(log).await?;
    let granted = log.grant(txn(name, c, &epoch, &rc)).await?.value;
    ensure!(
        granted == Granted::Yes,
        "the writer once no reader holds: {granted:?}"
    );
    one_write(log, before, "the writer's grant").await?;
    let d = lease(91, 4);
    let rd = open(log, d, identity).await?;
    let before = revision(log).await?;
    let read_d = reader_key(name, d);
    let refused = log.grant(txn(&read_d, d, &epoch, &rd)).await?.value;
    let writer = holder_record(name, c);
    ensure!(
        matches!(
            &refused,
            Granted::No {
                holder: None,
                other_kind: false,
                other_mode: Some(kv),
                ..
            } if kv.value == writer && kv.lease == c
        ),
        "a reader beside a writer: {refused:?}"
    );
    unchanged(log, before, "a reader's grant under a writer").await?;

    // A shared hold of a semaphore with a held slot: the other kind.
    let sem = "contract/modes/sem";
    let granted = log
        .grant(txn(&slot_key(sem, 1), c, &epoch, &rc))
        .await?
        .value;
    ensure!(granted == Granted::Yes, "a slot: {granted:?}");
    let refused = log
        .grant(txn(&reader_key(sem, d), d, &epoch, &rd))
        .await?
        .value;
    ensure!(
        matches!(
            refused,
            Granted::No {
                other_kind: true,
                ..
            }
        ),
        "a shared hold of a semaphore: {refused:?}"
    );

    // A batch never carries a writer and a reader of one name; readers of
    // one name go together.
    if log.batch_limit() >= 2 {
        let other = "contract/modes/batch";
        let e = lease(91, 5);
        let re = open(log, e, identity).await?;
        let before = revision(log).await?;
        let (read_d, read_e) = (reader_key(other, d), reader_key(other, e));
        let both = log
            .batch(vec![
                BatchOp::Grant(txn(other, c, &epoch, &rc)),
                BatchOp::Grant(txn(&read_d, d, &epoch, &rd)),
            ])
            .await;
        ensure!(both.is_err(), "a batch of a writer and a reader: {both:?}");
        unchanged(log, before, "a refused batch").await?;
        let both = log
            .batch(vec![
                BatchOp::Grant(txn(&read_d, d, &epoch, &rd)),
                BatchOp::Grant(txn(&read_e, e, &epoch, &re)),
            ])
            .await?
            .value;
        ensure!(
            both.iter().all(|o| o.committed()),
            "two readers in a batch: {both:?}"
        );
        one_write(log, before, "a batch of two readers").await?;
        revoke_all(log, &[e]).await?;
    }
    revoke_all(log, &[c, d]).await?;
    Ok(())
}

/// A downgrade ends the exclusive hold and puts the session's shared hold
/// at one revision; a stale one (the hold changed since) writes nothing.
pub async fn a_downgrade_is_one_transaction(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/modes";
    let a = lease(92, 1);
    let ra = open(log, a, identity).await?;
    let name = "contract/modes/down";
    let held = take(log, name, a, identity, &epoch).await?;
    let reader = reader_key(name, a);
    let before = revision(log).await?;
    let done = log
        .downgrade(DowngradeTxn {
            held: &held,
            reader_key: &reader,
            holder_record: holder_record(&reader, a),
            epoch: &epoch,
            fence_at: 0,
            session_record: &ra,
        })
        .await?;
    ensure!(done.value, "the downgrade committed");
    one_write(log, before, "a downgrade").await?;
    ensure!(
        log.holder(name).await?.value.is_none(),
        "the exclusive hold ended"
    );
    let shared = log.holder(&reader).await?.value;
    ensure!(
        shared
            .as_ref()
            .is_some_and(|kv| kv.lease == a && kv.mod_revision == done.header.revision),
        "the shared hold at the downgrade's revision: {shared:?}"
    );
    // Again: the exclusive hold is gone, so nothing happens.
    let before = revision(log).await?;
    let again = log
        .downgrade(DowngradeTxn {
            held: &held,
            reader_key: &reader,
            holder_record: holder_record(&reader, a),
            epoch: &epoch,
            fence_at: 0,
            session_record: &ra,
        })
        .await?;
    ensure!(!again.value, "a stale downgrade is refused");
    unchanged(log, before, "a stale downgrade").await?;
    revoke_all(log, &[a]).await?;
    Ok(())
}

/// A writer's intent (issue 34) keeps shared grants out, and only them: a
/// reader is refused with the oldest intent read in the same transaction
/// (nothing written), in a batch as alone; an exclusive grant ignores
/// others' intents and deletes its own;
/// the intent is put only on the caller's own session, keeps its create
/// revision when put again, is deleted only at its last write, and goes
/// with its session's lease. A watch on the intents sees each change.
pub async fn a_writers_intent_keeps_readers_out(log: &dyn LockLog) -> anyhow::Result<()> {
    use latchkey_arbiter::lock_log::{BatchOutcome, WatchSignal};
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/intent";
    let (w, v, r, x) = (lease(93, 1), lease(93, 2), lease(93, 3), lease(93, 4));
    let rw = open(log, w, identity).await?;
    // Another identity: its session record differs from the writer's.
    let rv = open(log, v, "spiffe://contract/intent-2").await?;
    let rr = open(log, r, identity).await?;
    open(log, x, identity).await?;
    let name = "contract/intent/rw";
    let read_r = reader_key(name, r);
    let from = revision(log).await? + 1;
    let mut watch = log.watch_intents(name, from).await?;

    // Not the caller's session: nothing is put.
    let before = revision(log).await?;
    let refused = log
        .put_intent(name, w, &rv, b"intent".to_vec())
        .await?
        .value;
    ensure!(
        refused.is_none(),
        "an intent on another's session: {refused:?}"
    );
    unchanged(log, before, "an intent on another's session").await?;

    let put = log.put_intent(name, w, &rw, b"first".to_vec()).await?;
    let Some(first) = put.value else {
        anyhow::bail!("the writer's own intent was not put");
    };
    ensure!(
        first.created == put.header.revision && first.modified == put.header.revision,
        "a new intent is created at its put: {first:?} at {}",
        put.header.revision
    );
    let signal = super::next_signal(&mut watch, "the intent's put").await?;
    ensure!(
        signal == WatchSignal::Changed,
        "the intent's put: {signal:?}"
    );
    let again = log.put_intent(name, w, &rw, b"again".to_vec()).await?;
    let Some(again) = again.value else {
        anyhow::bail!("the intent was not put again");
    };
    ensure!(
        again.created == first.created && again.modified > first.modified,
        "put again keeps its create revision: {again:?} after {first:?}"
    );
    let signal = super::next_signal(&mut watch, "the intent put again").await?;
    ensure!(
        signal == WatchSignal::Changed,
        "the intent put again: {signal:?}"
    );
    // A second writer's intent, younger.
    let Some(_) = log
        .put_intent(name, v, &rv, b"second".to_vec())
        .await?
        .value
    else {
        anyhow::bail!("the second writer's intent was not put");
    };
    let signal = super::next_signal(&mut watch, "the second intent").await?;
    ensure!(
        signal == WatchSignal::Changed,
        "the second intent: {signal:?}"
    );

    let before = revision(log).await?;
    let refused = log.grant(txn(&read_r, r, &epoch, &rr)).await?.value;
    let Granted::No {
        holder: None,
        other_mode: None,
        intent: Some(oldest),
        ..
    } = &refused
    else {
        anyhow::bail!("a reader beside a writer's intent: {refused:?}");
    };
    ensure!(
        oldest.lease == w && oldest.value == b"again" && oldest.create_revision == first.created,
        "the oldest intent is read back: {oldest:?}"
    );
    let batch = log
        .batch(vec![BatchOp::Grant(txn(&read_r, r, &epoch, &rr))])
        .await?
        .value;
    ensure!(
        matches!(
            batch.as_slice(),
            [BatchOutcome::Grant(Granted::No {
                intent: Some(_),
                ..
            })]
        ),
        "a reader in a batch beside a writer's intent: {batch:?}"
    );
    unchanged(log, before, "a reader's grant beside an intent").await?;

    // An exclusive grant does not compare intents (a writer's own grant
    // must pass its intent), and its refusal reads none.
    let held = take(log, name, x, identity, &epoch).await?;
    let refused = log.grant(txn(name, w, &epoch, &rw)).await?.value;
    ensure!(
        matches!(
            &refused,
            Granted::No {
                holder: Some(_),
                intent: None,
                ..
            }
        ),
        "a writer's grant over a writer: {refused:?}"
    );
    let released = log.release(&held).await?.value;
    ensure!(released.is_some(), "the writer's hold was not released");

    // Deleted only at its last write.
    let before = revision(log).await?;
    let stale = log.drop_intent(name, w, first.modified).await?.value;
    ensure!(!stale, "an intent deleted at an older write");
    unchanged(log, before, "a stale intent delete").await?;
    ensure!(
        log.drop_intent(name, w, again.modified).await?.value,
        "the intent was not deleted"
    );
    let signal = super::next_signal(&mut watch, "the intent deleted").await?;
    ensure!(
        signal == WatchSignal::Freed,
        "the intent deleted: {signal:?}"
    );
    // The second writer's session ends: its intent with it.
    revoke_all(log, &[v]).await?;
    let signal = super::next_signal(&mut watch, "the second intent's lease").await?;
    ensure!(
        signal == WatchSignal::Freed,
        "the second intent's lease: {signal:?}"
    );
    let granted = log.grant(txn(&read_r, r, &epoch, &rr)).await?.value;
    ensure!(
        granted == Granted::Yes,
        "a reader once no intent is left: {granted:?}"
    );

    // A writer's exclusive grant deletes its own intent in the same
    // transaction (one left by a wait that ended elsewhere goes too).
    let own = "contract/intent/own";
    ensure!(
        log.put_intent(own, w, &rw, b"own".to_vec())
            .await?
            .value
            .is_some(),
        "the intent on the second lock was not put"
    );
    let held = take(log, own, w, identity, &epoch).await?;
    ensure!(log.release(&held).await?.value.is_some(), "not released");
    let granted = log
        .grant(txn(&reader_key(own, r), r, &epoch, &rr))
        .await?
        .value;
    ensure!(
        granted == Granted::Yes,
        "a reader after the writer's grant took its intent: {granted:?}"
    );
    revoke_all(log, &[w, r, x]).await
}
