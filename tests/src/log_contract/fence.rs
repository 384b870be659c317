//! The contract's shard-map fence cases (ADR-09 moves): every grant and
//! hand-over compares the fence record's mod revision, a missing record
//! comparing as 0 (measured on a real etcd here, not assumed); the fence is
//! raised only, never lowered; releases, claims and the advance ignore it.
//!
//! These cases run last: once raised, the fence stays, and every grant the
//! other cases make names no fence (`fence_at` 0).

use anyhow::{Context, bail, ensure};
use latchkey_arbiter::lock_log::{
    BatchOp, BatchOutcome, GrantTxn, Granted, HandOverFrom, HandOverTxn, HeldAt, LockLog,
    ReleaseTxn, ReleasedIf,
};
use latchkey_records::{decode_map_fence, encode_map_fence};

use super::{epoch, holder_record, lease, one_write, open, revision, revoke_all, unchanged};

/// The fence record's mod revision now (0: absent), as a grantor reads it.
async fn fence_at(log: &dyn LockLog) -> anyhow::Result<i64> {
    Ok(log.map_fence().await?.value.map_or(0, |kv| kv.mod_revision))
}

/// The fence's version now (0: absent).
async fn fence_version(log: &dyn LockLog) -> anyhow::Result<u64> {
    match log.map_fence().await?.value {
        None => Ok(0),
        Some(kv) => {
            decode_map_fence(&kv.value).with_context(|| format!("a fence record of {:?}", kv.value))
        }
    }
}

pub(super) fn grant_txn<'a>(
    key: &'a str,
    session: i64,
    epoch: &'a [u8],
    fence_at: i64,
    record: &'a [u8],
) -> GrantTxn<'a> {
    GrantTxn {
        key,
        session,
        holder_record: holder_record(key, session),
        epoch,
        fence_at,
        session_record: record,
        queue: Default::default(),
        quota: None,
    }
}

/// Grants `key` to `id` comparing the fence at `fence_at`; the hold.
async fn take_fenced(
    log: &dyn LockLog,
    key: &str,
    id: i64,
    epoch: &[u8],
    fence_at: i64,
    record: &[u8],
) -> anyhow::Result<HeldAt> {
    let answer = log
        .grant(grant_txn(key, id, epoch, fence_at, record))
        .await?;
    ensure!(
        answer.value == Granted::Yes,
        "grant of {key} at fence {fence_at}: {:?}",
        answer.value
    );
    Ok(HeldAt {
        key: key.to_string(),
        session: id,
        revision: answer.header.revision,
        value: holder_record(key, id),
    })
}

/// Raises the fence to `version`, which must write: one revision, the
/// record's value the 20-digit version; its mod revision.
async fn raise(log: &dyn LockLog, version: u64) -> anyhow::Result<i64> {
    let before = revision(log).await?;
    let raised = log.raise_map_fence(version).await?;
    ensure!(raised.value, "raise_map_fence({version}) did not write");
    let at = one_write(log, before, "a raise of the fence").await?;
    ensure!(raised.header.revision == at);
    let kv = log.map_fence().await?.value.context("no fence record")?;
    ensure!(
        kv.value == encode_map_fence(version),
        "{:?}",
        String::from_utf8_lossy(&kv.value)
    );
    ensure!(kv.mod_revision == at && kv.lease == 0, "{kv:?}");
    let records = log.records().await?.value;
    ensure!(
        records.map_fence.as_ref() == Some(&kv),
        "the records read shows {:?}",
        records.map_fence
    );
    Ok(at)
}

/// On a cluster never fenced a grant naming no fence (0) commits, and one
/// naming a fence fails (a missing key's mod revision compares as 0). Once
/// raised, a grant naming no fence is refused, writes nothing, and its
/// failure branch reads the fence's revision; one naming that revision
/// commits. Holds granted before the raise still release and are claimed,
/// with no fence compared.
pub async fn a_grant_compares_the_map_fence(log: &dyn LockLog) -> anyhow::Result<()> {
    if log.map_fence().await?.value.is_some() {
        bail!("the fence is raised already: this case must run before any raise");
    }
    ensure!(log.records().await?.value.map_fence.is_none());
    let epoch = epoch(log).await?;
    let (identity, id) = ("spiffe://contract/fence-grant", lease(70, 0));
    let record = open(log, id, identity).await?;
    let keys = ["contract/fence-grant/1", "contract/fence-grant/2"];

    let before = revision(log).await?;
    let named = log
        .grant(grant_txn(keys[0], id, &epoch, before, &record))
        .await?;
    ensure!(
        named.value
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
        "a grant naming a fence on a cluster with none: {:?}",
        named.value
    );
    unchanged(log, before, "a grant naming a fence that is not there").await?;
    let first = take_fenced(log, keys[0], id, &epoch, 0, &record).await?;
    let second = take_fenced(log, keys[1], id, &epoch, 0, &record).await?;

    let at = raise(log, 3).await?;
    let stale = log
        .grant(grant_txn("contract/fence-grant/3", id, &epoch, 0, &record))
        .await?;
    ensure!(
        stale.value
            == Granted::No {
                holder: None,
                epoch: Some(epoch.clone()),
                sealed: false,
                session: Some(record.clone()),
                queue_head: None,
                fence_at: at,
                other_kind: false,
                other_mode: None,
                intent: None,
            },
        "a grant naming no fence after a raise: {:?}",
        stale.value
    );
    ensure!(stale.header.revision == at);
    unchanged(log, at, "a grant with a stale fence").await?;
    let third = take_fenced(log, "contract/fence-grant/3", id, &epoch, at, &record).await?;
    ensure!(third.revision == at + 1);

    // releasing and claiming never compare the fence
    let released = log.release(&first).await?;
    ensure!(released.value.is_some(), "a release after the raise failed");
    let claimed = log.claim(keys[1], id, second.revision).await?;
    ensure!(
        claimed.value == latchkey_arbiter::lock_log::Claimed::Now,
        "{:?}",
        claimed.value
    );
    let mut owner = holder_record(keys[1], id);
    owner.pop();
    let owned = log
        .release_if_owned(&ReleaseTxn {
            key: keys[1].to_string(),
            session: id,
            revision: second.revision,
            owner,
        })
        .await?;
    ensure!(
        matches!(owned.value, ReleasedIf::Yes(_)),
        "{:?}",
        owned.value
    );
    ensure!(
        log.release_orphan(&third.key, id, third.revision)
            .await?
            .value,
        "the orphan release after the raise failed"
    );
    ensure!(log.count_holds().await?.value == 0);
    revoke_all(log, &[id]).await
}

/// A raise to the version the fence has, or a lower one, writes nothing
/// and answers false; a higher one writes. The advance neither compares
/// nor changes the fence.
pub async fn raising_the_map_fence_never_lowers_it(log: &dyn LockLog) -> anyhow::Result<()> {
    let version = fence_version(log).await?;
    ensure!(
        version >= 3,
        "the fence is at {version}: an earlier case raises it"
    );
    let at = fence_at(log).await?;
    let before = revision(log).await?;
    for lower in [version, version - 1, 2, 0] {
        let answer = log.raise_map_fence(lower).await?;
        ensure!(!answer.value, "raise_map_fence({lower}) at {version} wrote");
        ensure!(answer.header.revision == before);
    }
    unchanged(log, before, "raises to the version or below").await?;
    ensure!(fence_at(log).await? == at);
    ensure!(fence_version(log).await? == version);
    let raised = raise(log, version + 1).await?;

    let epoch = epoch(log).await?;
    let record = format!("contract epoch advanced over the fence at {raised}").into_bytes();
    let advanced = log.advance(epoch, None, record).await?;
    ensure!(advanced.value.is_some(), "the advance failed");
    let kv = log
        .map_fence()
        .await?
        .value
        .context("the advance took the fence")?;
    ensure!(
        kv.mod_revision == raised && kv.value == encode_map_fence(version + 1),
        "the advance changed the fence: {kv:?}"
    );
    Ok(())
}

/// A batch member with a stale fence is refused as its own transaction
/// would be, beside members that commit: a grant at the fence as it is
/// now, and a release of a hold granted before the raise.
pub async fn a_batch_member_with_a_stale_fence_is_refused(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let identity = "spiffe://contract/fence-batch";
    let id = lease(71, 0);
    let record = open(log, id, identity).await?;
    let keys = [
        "contract/fence-batch/held",
        "contract/fence-batch/now",
        "contract/fence-batch/stale",
    ];
    let old = fence_at(log).await?;
    let held = take_fenced(log, keys[0], id, &epoch, old, &record).await?;
    let now = raise(log, fence_version(log).await? + 1).await?;
    let mut owner = holder_record(keys[0], id);
    owner.pop();
    let release = ReleaseTxn {
        key: keys[0].to_string(),
        session: id,
        revision: held.revision,
        owner,
    };
    let before = revision(log).await?;
    let answer = log
        .batch(vec![
            BatchOp::Grant(grant_txn(keys[1], id, &epoch, now, &record)),
            BatchOp::Grant(grant_txn(keys[2], id, &epoch, old, &record)),
            BatchOp::Release(&release),
        ])
        .await?;
    let at = one_write(log, before, "a batch with a stale member").await?;
    ensure!(answer.header.revision == at);
    let expected = vec![
        BatchOutcome::Grant(Granted::Yes),
        BatchOutcome::Grant(Granted::No {
            holder: None,
            epoch: Some(epoch.clone()),
            sealed: false,
            session: Some(record.clone()),
            queue_head: None,
            fence_at: now,
            other_kind: false,
            other_mode: None,
            intent: None,
        }),
        BatchOutcome::Release(ReleasedIf::Yes(holder_record(keys[0], id))),
    ];
    ensure!(answer.value == expected, "{:?}", answer.value);
    ensure!(log.holder(keys[2]).await?.value.is_none());
    ensure!(log.holder(keys[0]).await?.value.is_none());

    // the stale member alone: refused the same way, nothing written
    let alone = log
        .batch(vec![BatchOp::Grant(grant_txn(
            keys[2], id, &epoch, old, &record,
        ))])
        .await?;
    ensure!(
        alone.value == expected[1..2],
        "a batch of the stale member alone: {:?}",
        alone.value
    );
    unchanged(log, at, "a batch of a stale member").await?;
    revoke_all(log, &[id]).await
}

/// A hand-over compares the fence as a grant does: refused (nothing
/// written) with a stale one, whether the hold is compared exactly or as
/// the owner's; committed with the fence as it is now.
pub async fn a_hand_over_compares_the_map_fence(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/fence-hand-over/a",
        "spiffe://contract/fence-hand-over/b",
    );
    let (ia, ib) = (lease(72, 0), lease(72, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let key = "contract/fence-hand-over/k";
    let old = fence_at(log).await?;
    let held = take_fenced(log, key, ia, &epoch, old, &ra).await?;
    let now = raise(log, fence_version(log).await? + 1).await?;
    let mut owner = holder_record(key, ia);
    owner.pop();
    let owned = ReleaseTxn {
        key: key.to_string(),
        session: ia,
        revision: held.revision,
        owner,
    };
    for from in [HandOverFrom::Exact(&held), HandOverFrom::Owned(&owned)] {
        let refused = log
            .hand_over(HandOverTxn {
                from,
                next_session: ib,
                holder_record: holder_record(key, ib),
                epoch: &epoch,
                fence_at: old,
                next_session_record: &rb,
            })
            .await?;
        ensure!(refused.value.is_none(), "{from:?}: {:?}", refused.value);
    }
    unchanged(log, now, "hand-overs with a stale fence").await?;
    let handed = log
        .hand_over(HandOverTxn {
            from: HandOverFrom::Exact(&held),
            next_session: ib,
            holder_record: holder_record(key, ib),
            epoch: &epoch,
            fence_at: now,
            next_session_record: &rb,
        })
        .await?;
    ensure!(
        handed.value == Some(Some(held.value.clone())),
        "{:?}",
        handed.value
    );
    ensure!(handed.header.revision == now + 1);
    let kv = log.holder(key).await?.value.context("no holder")?;
    ensure!(kv.lease == ib && kv.value == holder_record(key, ib));
    revoke_all(log, &[ia, ib]).await
}
