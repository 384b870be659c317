//! The contract's batch cases: the release that compares its owner in its
//! own transaction, and batches of grants and releases as one transaction
//! of nested transactions (etcd 3.4: each member its own compares and
//! branch, every write at one revision; a batch with two members on one
//! key never leaves the log).

use anyhow::{Context, ensure};
use latchkey_arbiter::lock_log::{
    BatchOp, BatchOutcome, GrantTxn, Granted, HandOverFrom, HandOverTxn, HeldAt, Kv, LockLog,
    ReleaseTxn, ReleasedIf, StoreError,
};

use super::{epoch, holder_record, lease, one_write, open, revision, revoke_all, take, unchanged};

/// The first bytes of `session`'s holder records of `key` in this suite
/// (`"{key} held by {session:x}"` without its last byte): the owner a
/// release compares.
fn owner(key: &str, session: i64) -> Vec<u8> {
    let mut record = holder_record(key, session);
    record.pop();
    record
}

fn grant<'a>(key: &'a str, session: i64, epoch: &'a [u8], record: &'a [u8]) -> BatchOp<'a> {
    BatchOp::Grant(GrantTxn {
        key,
        session,
        holder_record: holder_record(key, session),
        epoch,
        fence_at: 0,
        session_record: record,
        queue: Default::default(),
        quota: None,
    })
}

/// A release compares the hold's lease, revision and first bytes in one
/// transaction: refused (nothing written, the hold read back) when any
/// differs, the record returned when all match.
pub async fn release_if_owned_compares_the_owner(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (identity, id, other) = (
        "spiffe://contract/release-owned",
        lease(23, 0),
        lease(23, 1),
    );
    open(log, id, identity).await?;
    open(log, other, identity).await?;
    let key = "contract/release-owned/k";
    let held = take(log, key, id, identity, &epoch).await?;
    let kv = Kv {
        value: held.value.clone(),
        create_revision: held.revision,
        mod_revision: held.revision,
        lease: id,
    };
    let right = ReleaseTxn {
        key: key.to_string(),
        session: id,
        revision: held.revision,
        owner: owner(key, id),
    };
    let wrong = [
        ReleaseTxn {
            revision: held.revision - 1,
            ..right.clone()
        },
        ReleaseTxn {
            session: other,
            ..right.clone()
        },
        // another owner's first bytes
        ReleaseTxn {
            owner: format!("{key} held by x").into_bytes(),
            ..right.clone()
        },
        // the owner's bytes plus one more than the record has
        ReleaseTxn {
            owner: [held.value.as_slice(), b"!"].concat(),
            ..right.clone()
        },
        // the whole record is no owner prefix: a value equal to it fails
        ReleaseTxn {
            owner: held.value.clone(),
            ..right.clone()
        },
    ];
    for txn in &wrong {
        let answer = log.release_if_owned(txn).await?;
        ensure!(
            answer.value
                == ReleasedIf::No {
                    holder: Some(kv.clone())
                },
            "released with {txn:?}: {:?}",
            answer.value
        );
        ensure!(answer.header.revision == held.revision);
    }
    unchanged(log, held.revision, "refused releases").await?;
    let released = log.release_if_owned(&right).await?;
    ensure!(
        released.value == ReleasedIf::Yes(held.value.clone()),
        "{:?}",
        released.value
    );
    let at = one_write(log, held.revision, "the release").await?;
    ensure!(released.header.revision == at);
    ensure!(log.holder(key).await?.value.is_none());
    let again = log.release_if_owned(&right).await?;
    ensure!(again.value == ReleasedIf::No { holder: None });
    unchanged(log, at, "a second release").await?;
    revoke_all(log, &[id, other]).await
}

/// A hand-over that compares its owner as [`release_if_owned_compares_the_owner`]
/// does, with no read before it: refused (nothing written) for the wrong
/// revision, lease or first bytes; with the right ones the next session's
/// record replaces the hold at a new revision and the replaced bytes return.
pub async fn hand_over_if_owned_compares_the_owner(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/hand-over-owned/a",
        "spiffe://contract/hand-over-owned/b",
    );
    let (ia, ib, other) = (lease(27, 0), lease(27, 1), lease(27, 2));
    open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    open(log, other, a).await?;
    let key = "contract/hand-over-owned/k";
    let held = take(log, key, ia, a, &epoch).await?;
    let right = ReleaseTxn {
        key: key.to_string(),
        session: ia,
        revision: held.revision,
        owner: owner(key, ia),
    };
    let wrong = [
        ReleaseTxn {
            revision: held.revision - 1,
            ..right.clone()
        },
        ReleaseTxn {
            session: other,
            ..right.clone()
        },
        ReleaseTxn {
            owner: format!("{key} held by x").into_bytes(),
            ..right.clone()
        },
        ReleaseTxn {
            owner: held.value.clone(),
            ..right.clone()
        },
    ];
    let next = holder_record(key, ib);
    let hand_over = |from: &ReleaseTxn| {
        let from = from.clone();
        let (next, rb, epoch) = (next.clone(), rb.clone(), epoch.clone());
        async move {
            log.hand_over(HandOverTxn {
                from: HandOverFrom::Owned(&from),
                next_session: ib,
                holder_record: next,
                epoch: &epoch,
                fence_at: 0,
                next_session_record: &rb,
            })
            .await
        }
    };
    for txn in &wrong {
        let answer = hand_over(txn).await?;
        ensure!(answer.value.is_none(), "handed over with {txn:?}");
        ensure!(answer.header.revision == held.revision);
    }
    unchanged(log, held.revision, "refused hand-overs").await?;
    let handed = hand_over(&right).await?;
    ensure!(
        handed.value == Some(Some(held.value.clone())),
        "{:?}",
        handed.value
    );
    let at = one_write(log, held.revision, "the hand-over").await?;
    ensure!(handed.header.revision == at);
    let kv = log
        .holder(key)
        .await?
        .value
        .context("no holder after the hand-over")?;
    ensure!(
        kv.lease == ib && kv.mod_revision == at && kv.value == next,
        "{kv:?}"
    );
    // the replaced hold's owner no longer hands over
    ensure!(hand_over(&right).await?.value.is_none());
    unchanged(log, at, "a second hand-over").await?;
    revoke_all(log, &[ia, ib, other]).await
}

/// Grants and releases on distinct keys in one batch: every member that
/// commits does so at the answer's revision, one revision above the read
/// before, each outcome as its own transaction's.
pub async fn a_batch_commits_at_one_revision(log: &dyn LockLog) -> anyhow::Result<()> {
    if log.batch_limit() < 3 {
        return Ok(()); // a log that does not batch: its batches of one are its transactions
    }
    let epoch = epoch(log).await?;
    let ids = [lease(24, 0), lease(24, 1), lease(24, 2)];
    let identity = "spiffe://contract/batch";
    let mut records = Vec::new();
    for id in ids {
        records.push(open(log, id, identity).await?);
    }
    let keys = ["contract/batch/a", "contract/batch/b", "contract/batch/c"];
    let held = take(log, keys[0], ids[0], identity, &epoch).await?;
    let release = ReleaseTxn {
        key: keys[0].to_string(),
        session: ids[0],
        revision: held.revision,
        owner: owner(keys[0], ids[0]),
    };
    let before = revision(log).await?;
    let answer = log
        .batch(vec![
            grant(keys[1], ids[1], &epoch, &records[1]),
            BatchOp::Release(&release),
            grant(keys[2], ids[2], &epoch, &records[2]),
        ])
        .await?;
    let at = one_write(log, before, "a batch of three").await?;
    ensure!(
        answer.header.revision == at,
        "answered at {}",
        answer.header.revision
    );
    ensure!(
        answer.value
            == vec![
                BatchOutcome::Grant(Granted::Yes),
                BatchOutcome::Release(ReleasedIf::Yes(held.value.clone())),
                BatchOutcome::Grant(Granted::Yes),
            ],
        "{:?}",
        answer.value
    );
    ensure!(log.holder(keys[0]).await?.value.is_none());
    for (key, id) in [(keys[1], ids[1]), (keys[2], ids[2])] {
        let kv = log.holder(key).await?.value.context("no hold")?;
        ensure!(
            kv.mod_revision == at && kv.create_revision == at && kv.lease == id,
            "{key}: {kv:?}"
        );
    }
    revoke_all(log, &ids).await
}

/// A batch whose members' compares fail answers each failure as its own
/// transaction would (what its failure branch read) while the others
/// commit; a batch where every member fails writes nothing.
pub async fn a_batch_answers_each_member(log: &dyn LockLog) -> anyhow::Result<()> {
    if log.batch_limit() < 5 {
        return Ok(());
    }
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/batch-mixed";
    let ids = [lease(25, 0), lease(25, 1), lease(25, 2)];
    let mut records = Vec::new();
    for id in ids {
        records.push(open(log, id, identity).await?);
    }
    let k = |s: &str| format!("contract/batch-mixed/{s}");
    let (held_key, taken_key, free_key, stale_key) = (k("held"), k("taken"), k("free"), k("stale"));
    let held = take(log, &held_key, ids[0], identity, &epoch).await?;
    let stale = take(log, &stale_key, ids[0], identity, &epoch).await?;
    let wrong_revision = ReleaseTxn {
        key: stale_key.clone(),
        session: ids[0],
        revision: stale.revision - 1,
        owner: owner(&stale_key, ids[0]),
    };
    let before = revision(log).await?;
    let answer = log
        .batch(vec![
            // on a held key: refused, the holder read back
            grant(&held_key, ids[1], &epoch, &records[1]),
            grant(&free_key, ids[1], &epoch, &records[1]),
            BatchOp::Release(&wrong_revision),
            // with the wrong epoch bytes
            grant(&taken_key, ids[2], b"not the epoch record", &records[2]),
        ])
        .await?;
    let at = one_write(log, before, "a batch with one member writing").await?;
    ensure!(answer.header.revision == at);
    let kv = |h: &HeldAt, id| Kv {
        value: h.value.clone(),
        create_revision: h.revision,
        mod_revision: h.revision,
        lease: id,
    };
    let expected = vec![
        BatchOutcome::Grant(Granted::No {
            holder: Some(kv(&held, ids[0])),
            epoch: Some(epoch.clone()),
            sealed: false,
            session: Some(records[1].clone()),
            queue_head: None,
            fence_at: 0,
            other_kind: false,
            other_mode: None,
            intent: None,
        }),
        BatchOutcome::Grant(Granted::Yes),
        BatchOutcome::Release(ReleasedIf::No {
            holder: Some(kv(&stale, ids[0])),
        }),
        BatchOutcome::Grant(Granted::No {
            holder: None,
            epoch: Some(epoch.clone()),
            sealed: false,
            session: Some(records[2].clone()),
            queue_head: None,
            fence_at: 0,
            other_kind: false,
            other_mode: None,
            intent: None,
        }),
    ];
    ensure!(answer.value == expected, "{:?}", answer.value);
    let granted = log.holder(&free_key).await?.value.context("no hold")?;
    ensure!(granted.mod_revision == at && granted.lease == ids[1]);
    ensure!(log.holder(&taken_key).await?.value.is_none());

    // every member refused: no write at all
    let failing = log
        .batch(vec![
            grant(&held_key, ids[1], &epoch, &records[1]),
            BatchOp::Release(&wrong_revision),
        ])
        .await?;
    ensure!(failing.value.iter().all(|o| !o.committed()));
    ensure!(failing.header.revision == at);
    unchanged(log, at, "a batch of refusals").await?;
    revoke_all(log, &ids).await
}

/// Two members on one key, no member, or more than the log's limit: the
/// batch is refused whole and nothing is written.
pub async fn a_batch_on_one_key_twice_is_refused(log: &dyn LockLog) -> anyhow::Result<()> {
    if log.batch_limit() < 2 {
        return Ok(());
    }
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/batch-twice";
    let ids = [lease(26, 0), lease(26, 1)];
    let mut records = Vec::new();
    for id in ids {
        records.push(open(log, id, identity).await?);
    }
    let key = "contract/batch-twice/k";
    let held = take(log, key, ids[0], identity, &epoch).await?;
    let release = ReleaseTxn {
        key: key.to_string(),
        session: ids[0],
        revision: held.revision,
        owner: owner(key, ids[0]),
    };
    let free = "contract/batch-twice/free";
    let too_many: Vec<String> = (0..=log.batch_limit())
        .map(|i| format!("contract/batch-twice/{i}"))
        .collect();
    let batches = [
        vec![
            grant(free, ids[0], &epoch, &records[0]),
            grant(free, ids[1], &epoch, &records[1]),
        ],
        vec![
            BatchOp::Release(&release),
            grant(key, ids[1], &epoch, &records[1]),
        ],
        vec![
            grant(key, ids[1], &epoch, &records[1]),
            BatchOp::Release(&release),
        ],
        vec![],
        too_many
            .iter()
            .map(|k| grant(k, ids[1], &epoch, &records[1]))
            .collect(),
    ];
    for (i, ops) in batches.into_iter().enumerate() {
        match log.batch(ops).await {
            Err(StoreError::Refused { .. }) => {}
            other => anyhow::bail!("batch {i} was not refused: {other:?}"),
        }
        unchanged(log, held.revision, "a refused batch").await?;
    }
    revoke_all(log, &ids).await
}
