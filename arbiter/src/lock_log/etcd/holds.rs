//! Holder records: the grant and hand-over transactions, the releases, and
//! the reads of who holds what.

use latchkey_etcd::ErrorKind;
use latchkey_etcd::kv::{DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget};
use latchkey_etcd::txn::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use super::{EtcdLog, answer, first_kv, kv, unavailable, unavailable_on};
use crate::lock_log::{
    BatchOp, BatchOutcome, Claimed, DowngradeTxn, GrantTxn, Granted, HandOverFrom, HandOverTxn,
    HeldAt, Kv, LogResult, PlaceWas, QueueTurn, ReleaseTxn, ReleasedIf, StoreError,
};

/// One grant: the holder record on the session's lease if the key is
/// absent, the epoch record is the caller's, there is no seal, the
/// shard-map fence is where the caller last read it and the session record
/// is the caller's. On a compare failure the same transaction reads them
/// all, so the caller learns why at that revision.
pub(super) async fn grant(log: &EtcdLog, txn: GrantTxn<'_>) -> LogResult<Granted> {
    let session = txn.session;
    let read = KindRead::of(log, txn.key);
    let resp = log
        .client
        .kv_client()
        .txn(grant_txn(log, txn))
        .await
        .map_err(|e| unavailable_on("cannot run the grant transaction", session, e))?;
    answer(
        resp.header(),
        granted(resp.succeeded(), resp.op_responses(), &read),
    )
}

fn grant_txn(log: &EtcdLog, txn: GrantTxn<'_>) -> Txn {
    let holder_key = log.layout.holder(txn.key);
    let session_key = log.layout.session(txn.session);
    let epoch_key = log.layout.epoch();
    let seal_key = log.layout.seal();
    let fence_key = log.layout.map_fence();
    // A shared hold defers to its lock's durable queue (found by the
    // hostile review: its own key's queue is always empty).
    let queued_on = crate::records::named_key(txn.key);
    let queue = log.layout.queue_of(queued_on);
    let (mut kind_compares, kind_reads) = kind_and_mode(log, txn.key);
    if let (QueueTurn::Mine { .. }, crate::records::HoldKind::Shared) =
        (txn.queue, crate::records::hold_kind(txn.key).0)
    {
        // A durable reader at its turn: the durable queue orders it behind
        // any writer queued there, and an in-memory writer's intent (a key
        // reached through classes of both kinds) must not block the head
        // of a queue that the writer's own grant waits for (the hostile
        // review: each waited for the other). The intent compare is last.
        kind_compares.pop();
    }
    let mut compares = vec![
        Compare::create_revision(holder_key.clone(), CompareOp::Equal, 0),
        Compare::value(epoch_key.clone(), CompareOp::Equal, txn.epoch),
        Compare::create_revision(seal_key.clone(), CompareOp::Equal, 0),
        fence_unchanged(log, txn.fence_at),
        Compare::value(session_key.clone(), CompareOp::Equal, txn.session_record),
    ];
    compares.extend(kind_compares);
    let mut writes = vec![TxnOp::put(
        holder_key.clone(),
        txn.holder_record,
        Some(PutOptions::new().with_lease(txn.session)),
    )];
    if let (crate::records::HoldKind::Exclusive, name) = crate::records::hold_kind(txn.key) {
        // The writer's own intent, if it put one, ends with its wait
        // (deleting a missing key writes nothing).
        writes.push(TxnOp::delete(log.layout.intent(name, txn.session), None));
    }
    if let Some(take) = txn.quota.map(|take| *take) {
        let place = log
            .layout
            .quota_place(&take.class, &take.subject, take.index);
        match &take.was {
            PlaceWas::Free => {
                compares.push(Compare::create_revision(place.clone(), CompareOp::Equal, 0));
            }
            PlaceWas::Stale { revision, key } => compares.extend([
                Compare::mod_revision(place.clone(), CompareOp::Equal, *revision),
                // a missing hold compares as mod revision 0
                Compare::mod_revision(log.layout.holder(key), CompareOp::NotEqual, *revision),
            ]),
        }
        writes.push(TxnOp::put(
            place,
            take.record,
            Some(PutOptions::new().with_lease(txn.session)),
        ));
    }
    match txn.queue {
        QueueTurn::Empty => compares.push(queue_empty(log, queued_on)),
        QueueTurn::Mine { created } => {
            // No record older than the session's own, and the session's
            // own still the one it queued (a compare on a range holds for
            // every key in it).
            // A shared hold's waiter record is its lock's (`queued_on`).
            let mine = log.layout.waiter(queued_on, txn.session);
            compares.extend([
                Compare::create_revision(queue.clone(), CompareOp::Greater, created - 1)
                    .with_prefix(),
                Compare::create_revision(mine.clone(), CompareOp::Equal, created),
            ]);
            writes.push(TxnOp::delete(mine, None));
        }
    }
    Txn::new().when(compares).and_then(writes).or_else(
        [
            TxnOp::get(holder_key, None),
            TxnOp::get(epoch_key, None),
            TxnOp::get(seal_key, None),
            TxnOp::get(session_key, None),
            TxnOp::get(
                queue,
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                        .with_limit(1),
                ),
            ),
            TxnOp::get(fence_key, None),
        ]
        .into_iter()
        .chain(kind_reads)
        .collect::<Vec<_>>(),
    )
}

/// The compares that keep a name one kind, and one mode, at a time, and
/// the reads of their failure branch (what [`granted`] reads back):
/// - an exclusive grant of a lock compares everything under its name
///   (`l/<key>//`: its shared holds, or a semaphore's slots) empty — etcd
///   compares an empty range as one missing key, version 0 — and reads the
///   first record there;
/// - a shared hold's grant compares the lock's name not held exclusively,
///   no slot under it and no writer's intent on it (issue 34: a writer
///   waiting on any arbiter keeps later readers out), and reads the
///   exclusive hold and the oldest intent;
/// - a slot's grant compares its semaphore's name not held as a lock,
///   exclusively or shared.
///
/// Hand-overs need none: the key handed over is held already, so nothing
/// of another kind or mode could be granted meanwhile.
fn kind_and_mode(log: &EtcdLog, key: &str) -> (Vec<Compare>, Vec<TxnOp>) {
    use crate::records::{HoldKind, hold_kind, readers_of, slots_of, under_name};
    let absent =
        |name: &str| Compare::create_revision(log.layout.holder(name), CompareOp::Equal, 0);
    let none_under = |prefix: &str| {
        Compare::version(log.layout.holder(prefix), CompareOp::Equal, 0).with_prefix()
    };
    let first_under = |prefix: &str, keys_only: bool| {
        let options = GetOptions::new().with_prefix().with_limit(1);
        let options = match keys_only {
            true => options.with_keys_only(),
            false => options,
        };
        TxnOp::get(log.layout.holder(prefix), Some(options))
    };
    match hold_kind(key) {
        (HoldKind::Exclusive, name) => (
            vec![none_under(&under_name(name))],
            vec![first_under(&under_name(name), false)],
        ),
        (HoldKind::Shared, name) => (
            vec![
                absent(name),
                none_under(&slots_of(name)),
                Compare::version(log.layout.intents_of(name), CompareOp::Equal, 0).with_prefix(),
            ],
            vec![
                TxnOp::get(log.layout.holder(name), None),
                first_under(&slots_of(name), true),
                TxnOp::get(
                    log.layout.intents_of(name),
                    Some(
                        GetOptions::new()
                            .with_prefix()
                            .with_sort(SortTarget::Create, SortOrder::Ascend)
                            .with_limit(1),
                    ),
                ),
            ],
        ),
        (HoldKind::Slot, name) => (
            vec![absent(name), none_under(&readers_of(name))],
            vec![
                TxnOp::get(
                    log.layout.holder(name),
                    Some(GetOptions::new().with_keys_only()),
                ),
                first_under(&readers_of(name), true),
            ],
        ),
    }
}

/// Holds while the shard-map fence is where the grantor last read it:
/// etcd compares a missing key's mod revision as 0, so `fence_at` 0 holds
/// exactly while there is no fence (measured in the contract suite).
pub(super) fn fence_unchanged(log: &EtcdLog, fence_at: i64) -> Compare {
    Compare::mod_revision(log.layout.map_fence(), CompareOp::Equal, fence_at)
}

/// Holds while `key` has no durable waiter: etcd compares an empty range
/// as one missing key (version 0), and any record has version 1 or more.
pub(super) fn queue_empty(log: &EtcdLog, key: &str) -> Compare {
    Compare::version(log.layout.queue_of(key), CompareOp::Equal, 0).with_prefix()
}

/// How to read a grant's failure branch for its key's kind
/// ([`kind_and_mode`]'s reads, after the six common ones).
pub(super) struct KindRead {
    kind: crate::records::HoldKind,
    /// Where the name's shared holds are, as etcd spells their keys.
    readers: String,
}

impl KindRead {
    pub(super) fn of(log: &EtcdLog, key: &str) -> Self {
        let (kind, name) = crate::records::hold_kind(key);
        Self {
            kind,
            readers: log.layout.holder(&crate::records::readers_of(name)),
        }
    }

    /// (other kind, other mode, intent) from the kind's reads.
    fn read(&self, reads: &[TxnOpResponse]) -> (bool, Option<Kv>, Option<Kv>) {
        use crate::records::HoldKind;
        let first = |at: usize| reads.get(at).and_then(first_kv);
        match self.kind {
            HoldKind::Exclusive => {
                let under = reads.first().and_then(latchkey_etcd::txn::first_kv);
                match under {
                    Some(found) if found.key().starts_with(self.readers.as_bytes()) => {
                        (false, Some(super::kv(found)), None)
                    }
                    Some(_) => (true, None, None),
                    None => (false, None, None),
                }
            }
            HoldKind::Shared => (first(1).is_some(), first(0), first(2)),
            HoldKind::Slot => (first(0).is_some() || first(1).is_some(), None, None),
        }
    }
}

/// A grant transaction's outcome from its branch and its responses.
fn granted(succeeded: bool, ops: Vec<TxnOpResponse>, read: &KindRead) -> Granted {
    if succeeded {
        return Granted::Yes;
    }
    let (other_kind, other_mode, intent) = read.read(ops.get(6..).unwrap_or_default());
    Granted::No {
        holder: ops.first().and_then(first_kv),
        epoch: ops.get(1).and_then(first_kv).map(|kv| kv.value),
        sealed: ops.get(2).and_then(first_kv).is_some(),
        session: ops.get(3).and_then(first_kv).map(|kv| kv.value),
        queue_head: ops.get(4).and_then(first_kv),
        fence_at: ops
            .get(5)
            .and_then(first_kv)
            .map_or(0, |kv| kv.mod_revision),
        other_kind,
        other_mode,
        intent,
    }
}

/// A release whose compares are the ownership check: the hold on the
/// session's lease at the token's revision, its record beginning with the
/// owner's bytes. etcd compares whole values only, but byte-wise and in
/// order, so "begins with `owner`" is `owner < value < owner⁺` (`owner⁺`:
/// its last byte plus one; a value equal to `owner` alone is no record and
/// fails too). On a failure the same transaction reads the hold.
fn release_txn(log: &EtcdLog, txn: &ReleaseTxn) -> Result<Txn, StoreError> {
    let holder_key = log.layout.holder(&txn.key);
    Ok(Txn::new()
        .when(owned_by(log, txn)?)
        .and_then([
            TxnOp::delete(
                holder_key.clone(),
                Some(DeleteOptions::new().with_prev_key()),
            ),
            TxnOp::delete(
                log.layout.claims_of(&txn.key),
                Some(DeleteOptions::new().with_prefix()),
            ),
        ])
        .or_else([TxnOp::get(holder_key, None)]))
}

/// [`release_txn`]'s compares: the hold on `txn.key` is on the session's
/// lease at the token's revision and its record begins with `txn.owner`.
fn owned_by(log: &EtcdLog, txn: &ReleaseTxn) -> Result<[Compare; 4], StoreError> {
    let holder_key = log.layout.holder(&txn.key);
    let above = owner_bound(&txn.owner).ok_or_else(|| StoreError::Refused {
        context: "an owner prefix that ends in 0xff, or is empty, cannot be compared".into(),
    })?;
    Ok([
        Compare::mod_revision(holder_key.clone(), CompareOp::Equal, txn.revision),
        Compare::lease(holder_key.clone(), CompareOp::Equal, txn.session),
        Compare::value(holder_key.clone(), CompareOp::Greater, txn.owner.clone()),
        Compare::value(holder_key, CompareOp::Less, above),
    ])
}

/// The least byte string above every string that begins with `owner`.
fn owner_bound(owner: &[u8]) -> Option<Vec<u8>> {
    let (last, rest) = owner.split_last()?;
    let mut above = rest.to_vec();
    above.push(last.checked_add(1)?);
    Some(above)
}

fn released_if(succeeded: bool, ops: Vec<TxnOpResponse>) -> ReleasedIf {
    if !succeeded {
        return ReleasedIf::No {
            holder: ops.first().and_then(first_kv),
        };
    }
    ReleasedIf::Yes(match ops.first() {
        Some(TxnOpResponse::Delete(d)) => d
            .prev_kvs()
            .first()
            .map(|kv| kv.value().to_vec())
            .unwrap_or_default(),
        _ => Vec::new(),
    })
}

pub(super) async fn release_if_owned(log: &EtcdLog, txn: &ReleaseTxn) -> LogResult<ReleasedIf> {
    let resp = log
        .client
        .kv_client()
        .txn(release_txn(log, txn)?)
        .await
        .map_err(|e| unavailable("cannot run the release transaction", e))?;
    answer(
        resp.header(),
        released_if(resp.succeeded(), resp.op_responses()),
    )
}

/// How many members one batch transaction may have: well inside etcd's
/// `--max-txn-ops` (128 by default, counted per level of nesting).
pub(super) const BATCH_LIMIT: usize = 64;

/// Members as nested transactions of one transaction without compares, so
/// etcd runs every member's own compares and branch and commits all their
/// writes at one revision. etcd refuses (InvalidArgument) a transaction
/// that puts a key twice or puts one another member deletes; the table never
/// batches two members on one key, and the check here keeps such a batch
/// from leaving the arbiter.
pub(super) async fn batch(log: &EtcdLog, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>> {
    if ops.is_empty() || ops.len() > BATCH_LIMIT {
        return Err(StoreError::Refused {
            context: format!("a batch of {} members", ops.len()),
        });
    }
    crate::lock_log::batch_is_distinct(&ops)?;
    let kinds: Vec<Option<KindRead>> = ops
        .iter()
        .map(|op| match op {
            BatchOp::Grant(txn) => Some(KindRead::of(log, txn.key)),
            BatchOp::Release(_) => None,
        })
        .collect();
    let mut nested = Vec::with_capacity(ops.len());
    for op in ops {
        nested.push(TxnOp::txn(match op {
            BatchOp::Grant(txn) => grant_txn(log, txn),
            BatchOp::Release(txn) => release_txn(log, txn)?,
        }));
    }
    let resp = log
        .client
        .kv_client()
        .txn(Txn::new().and_then(nested))
        .await
        .map_err(|e| refused_or_unavailable("cannot run the batch transaction", e))?;
    let mut outcomes = Vec::with_capacity(kinds.len());
    for (grant, op) in kinds.iter().zip(resp.op_responses()) {
        let TxnOpResponse::Txn(member) = op else {
            return Err(StoreError::Malformed(
                "etcd answered a nested transaction with something else".into(),
            ));
        };
        let (succeeded, ops) = (member.succeeded(), member.op_responses());
        outcomes.push(match grant {
            Some(read) => BatchOutcome::Grant(granted(succeeded, ops, read)),
            None => BatchOutcome::Release(released_if(succeeded, ops)),
        });
    }
    if outcomes.len() != kinds.len() || !resp.succeeded() {
        return Err(StoreError::Malformed(format!(
            "etcd answered {} of a batch's {} members",
            outcomes.len(),
            kinds.len()
        )));
    }
    answer(resp.header(), outcomes)
}

/// A batch etcd refused before applying it (a put on a lease it no longer
/// has, a duplicate key, too many operations: FailedPrecondition, NotFound
/// or InvalidArgument) is [`StoreError::Refused`]: nothing was written, and
/// the table runs its members one by one. Anything else leaves the outcome
/// unknown.
fn refused_or_unavailable(context: &str, err: impl Into<latchkey_etcd::Error>) -> StoreError {
    let err = err.into();
    match (err.kind(), err.grpc_message()) {
        (ErrorKind::LeaseNotFound | ErrorKind::InvalidArgument, Some(message)) => {
            StoreError::Refused {
                context: format!("{context}: {message}"),
            }
        }
        _ => unavailable(context, err),
    }
}

/// Compares that make a write act only on the hold `held` found: the same
/// record bytes (the caller's identity and session), on the same lease, at
/// the same revision.
fn still_held(log: &EtcdLog, held: &HeldAt) -> [Compare; 3] {
    let holder_key = log.layout.holder(&held.key);
    [
        Compare::mod_revision(holder_key.clone(), CompareOp::Equal, held.revision),
        Compare::lease(holder_key.clone(), CompareOp::Equal, held.session),
        Compare::value(holder_key, CompareOp::Equal, held.value.clone()),
    ]
}

/// Hands the hold straight to the next session in one transaction: the
/// release's compares, plus the grant's (epoch, no seal, the shard-map
/// fence, the next session's record). The put returns the record it
/// replaced.
pub(super) async fn hand_over(
    log: &EtcdLog,
    txn: HandOverTxn<'_>,
) -> LogResult<Option<Option<Vec<u8>>>> {
    let mut compares = match txn.from {
        HandOverFrom::Exact(held) => still_held(log, held).to_vec(),
        HandOverFrom::Owned(owned) => owned_by(log, owned)?.to_vec(),
    };
    compares.extend([
        Compare::value(log.layout.epoch(), CompareOp::Equal, txn.epoch),
        Compare::create_revision(log.layout.seal(), CompareOp::Equal, 0),
        fence_unchanged(log, txn.fence_at),
        Compare::value(
            log.layout.session(txn.next_session),
            CompareOp::Equal,
            txn.next_session_record,
        ),
        // An in-memory waiter never overtakes a durable one.
        queue_empty(log, txn.from.key()),
    ]);
    let etcd_txn = Txn::new().when(compares).and_then([
        TxnOp::put(
            log.layout.holder(txn.from.key()),
            txn.holder_record,
            Some(
                PutOptions::new()
                    .with_lease(txn.next_session)
                    .with_prev_key(),
            ),
        ),
        TxnOp::delete(
            log.layout.claims_of(txn.from.key()),
            Some(DeleteOptions::new().with_prefix()),
        ),
        // The next holder's intent, as its grant would.
        TxnOp::delete(
            log.layout
                .intent(crate::records::named_key(txn.from.key()), txn.next_session),
            None,
        ),
    ]);
    let resp =
        log.client.kv_client().txn(etcd_txn).await.map_err(|e| {
            unavailable_on("cannot run the hand-over transaction", txn.next_session, e)
        })?;
    let replaced = resp.succeeded().then(|| match resp.op_responses().first() {
        Some(TxnOpResponse::Put(p)) => p.prev_key().map(|kv| kv.value().to_vec()),
        _ => None,
    });
    answer(resp.header(), replaced)
}

/// A downgrade ([`DowngradeTxn`]): the exclusive hold, still exactly as
/// found, deleted with its claims and the session's shared hold put in the
/// same transaction, under a grant's compares (epoch, no seal, the
/// shard-map fence, the session's record) and the shared hold's own (its
/// key absent; no slot under the name).
pub(super) async fn downgrade(log: &EtcdLog, txn: DowngradeTxn<'_>) -> LogResult<bool> {
    let reader = log.layout.holder(txn.reader_key);
    let mut compares = still_held(log, txn.held).to_vec();
    compares.extend([
        Compare::create_revision(reader.clone(), CompareOp::Equal, 0),
        Compare::value(log.layout.epoch(), CompareOp::Equal, txn.epoch),
        Compare::create_revision(log.layout.seal(), CompareOp::Equal, 0),
        fence_unchanged(log, txn.fence_at),
        Compare::value(
            log.layout.session(txn.held.session),
            CompareOp::Equal,
            txn.session_record,
        ),
    ]);
    // No slot under the name (a key is one kind at a time). Not the
    // exclusive hold's absence, which this transaction ends, nor the
    // durable queue or a writer's intent: the session holds the lock
    // already, so converting its hold lets nobody else in, and a waiting
    // writer waits for the shared hold as it did for the exclusive one.
    let slots = crate::records::slots_of(&txn.held.key);
    compares.push(Compare::version(log.layout.holder(&slots), CompareOp::Equal, 0).with_prefix());
    let etcd_txn = Txn::new().when(compares).and_then([
        TxnOp::delete(log.layout.holder(&txn.held.key), None),
        TxnOp::delete(
            log.layout.claims_of(&txn.held.key),
            Some(DeleteOptions::new().with_prefix()),
        ),
        TxnOp::put(
            reader,
            txn.holder_record,
            Some(PutOptions::new().with_lease(txn.held.session)),
        ),
    ]);
    let resp =
        log.client.kv_client().txn(etcd_txn).await.map_err(|e| {
            unavailable_on("cannot run the downgrade transaction", txn.held.session, e)
        })?;
    answer(resp.header(), resp.succeeded())
}

/// Deletes the hold if it is still exactly `held`; the deleted record's
/// bytes (empty if etcd did not return them).
pub(super) async fn release(log: &EtcdLog, held: &HeldAt) -> LogResult<Option<Vec<u8>>> {
    let txn = Txn::new().when(still_held(log, held)).and_then([
        TxnOp::delete(
            log.layout.holder(&held.key),
            Some(DeleteOptions::new().with_prev_key()),
        ),
        TxnOp::delete(
            log.layout.claims_of(&held.key),
            Some(DeleteOptions::new().with_prefix()),
        ),
    ]);
    let resp = log
        .client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| unavailable("cannot run the release transaction", e))?;
    let released = resp.succeeded().then(|| match resp.op_responses().first() {
        Some(TxnOpResponse::Delete(d)) => d
            .prev_kvs()
            .first()
            .map(|kv| kv.value().to_vec())
            .unwrap_or_default(),
        _ => Vec::new(),
    });
    answer(resp.header(), released)
}

/// Claims the hold at `revision` for a call of `session`: the claim record,
/// on the session's lease, if the hold is still exactly that.
pub(super) async fn claim(
    log: &EtcdLog,
    key: &str,
    session: i64,
    revision: i64,
) -> LogResult<Claimed> {
    let holder_key = log.layout.holder(key);
    let claim_key = log.layout.claim(key, revision);
    let txn = Txn::new()
        .when([
            Compare::mod_revision(holder_key.clone(), CompareOp::Equal, revision),
            Compare::lease(holder_key.clone(), CompareOp::Equal, session),
            Compare::create_revision(claim_key.clone(), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::put(
            claim_key.clone(),
            "",
            Some(PutOptions::new().with_lease(session)),
        )])
        .or_else([TxnOp::get(holder_key, None), TxnOp::get(claim_key, None)]);
    let resp = log
        .client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| unavailable_on("cannot claim a hold", session, e))?;
    let claimed = if resp.succeeded() {
        Claimed::Now
    } else {
        let ops = resp.op_responses();
        let held = ops
            .first()
            .and_then(first_kv)
            .is_some_and(|kv| kv.mod_revision == revision && kv.lease == session);
        let recorded = ops.get(1).and_then(first_kv).is_some();
        if held && recorded {
            Claimed::Already
        } else {
            Claimed::Gone
        }
    };
    answer(resp.header(), claimed)
}

/// Deletes a grant whose caller went away, if `session` still holds `key`
/// at `revision` and no call has claimed that hold (never on a caller's
/// say-so, so no record compare).
pub(super) async fn release_orphan(
    log: &EtcdLog,
    key: &str,
    session: i64,
    revision: i64,
) -> LogResult<bool> {
    let holder_key = log.layout.holder(key);
    let txn = Txn::new()
        .when([
            Compare::mod_revision(holder_key.clone(), CompareOp::Equal, revision),
            Compare::lease(holder_key.clone(), CompareOp::Equal, session),
            Compare::create_revision(log.layout.claim(key, revision), CompareOp::Equal, 0),
        ])
        .and_then([TxnOp::delete(holder_key, None)]);
    let resp = log
        .client
        .kv_client()
        .txn(txn)
        .await
        .map_err(|e| unavailable("cannot release an orphaned grant", e))?;
    answer(resp.header(), resp.succeeded())
}

/// The hold on `key`; etcd reads are linearizable unless asked otherwise.
pub(super) async fn holder(log: &EtcdLog, key: &str) -> LogResult<Option<Kv>> {
    let resp = log
        .client
        .kv_client()
        .get(log.layout.holder(key), None)
        .await
        .map_err(|e| unavailable("cannot read a holder record", e))?;
    answer(resp.header(), resp.kvs().first().map(kv))
}

/// Every taken place of `subject`'s quota in `class`, by index.
pub(super) async fn quota_places(
    log: &EtcdLog,
    class: &str,
    subject: &str,
) -> LogResult<Vec<(u32, Kv)>> {
    let resp = log
        .client
        .kv_client()
        .get(
            log.layout.quota_places(class, subject),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .map_err(|e| unavailable("cannot read the quota places", e))?;
    let places = resp
        .kvs()
        .iter()
        .map(|found| {
            let name = String::from_utf8_lossy(found.key());
            let index = crate::records::quota_place_index(&name).ok_or_else(|| {
                StoreError::Malformed(format!("a quota place no arbiter names: {name:?}"))
            })?;
            Ok((index, kv(found)))
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    answer(resp.header(), places)
}

/// The holds on `keys`, in order: one transaction of gets per
/// [`crate::lock_log::HOLDERS_OF_AT_ONCE`] keys.
pub(super) async fn holders_of(log: &EtcdLog, keys: &[String]) -> LogResult<Vec<Option<Kv>>> {
    let mut out = Vec::with_capacity(keys.len());
    let mut last = None;
    for chunk in keys.chunks(crate::lock_log::HOLDERS_OF_AT_ONCE) {
        let gets: Vec<TxnOp> = chunk
            .iter()
            .map(|key| TxnOp::get(log.layout.holder(key), None))
            .collect();
        let resp = log
            .client
            .kv_client()
            .txn(Txn::new().and_then(gets))
            .await
            .map_err(|e| unavailable("cannot read the holder records", e))?;
        out.extend(resp.op_responses().iter().map(first_kv));
        last = Some(answer(resp.header(), ())?.header);
    }
    match last {
        Some(header) => Ok(crate::lock_log::Answer { header, value: out }),
        None => Ok(count_holds(log).await?.map(|_| out)),
    }
}

/// Deletes a quota place if it is still at `revision`.
pub(super) async fn free_quota_place(
    log: &EtcdLog,
    class: &str,
    subject: &str,
    index: u32,
    revision: i64,
) -> LogResult<bool> {
    let place = log.layout.quota_place(class, subject, index);
    let resp = log
        .client
        .kv_client()
        .txn(
            Txn::new()
                .when([Compare::mod_revision(
                    place.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::delete(place, None)]),
        )
        .await
        .map_err(|e| unavailable("cannot free a quota place", e))?;
    answer(resp.header(), resp.succeeded())
}

/// Every hold under `prefix`, keyed by lock key, in etcd's (key) order.
pub(super) async fn holders_under(log: &EtcdLog, prefix: &str) -> LogResult<Vec<(String, Kv)>> {
    let resp = log
        .client
        .kv_client()
        .get(
            log.layout.holder(prefix),
            Some(GetOptions::new().with_prefix()),
        )
        .await
        .map_err(|e| unavailable("cannot read the holder records", e))?;
    let holders = log.layout.holders();
    let held = resp
        .kvs()
        .iter()
        .map(|found| Ok((strip_holders(&holders, found.key())?, kv(found))))
        .collect::<Result<Vec<_>, StoreError>>()?;
    answer(resp.header(), held)
}

/// Up to `limit` held lock keys after `after`, keys only, in key order.
pub(super) async fn held_keys_page(
    log: &EtcdLog,
    after: Option<&str>,
    limit: usize,
) -> LogResult<Vec<String>> {
    let holders = log.layout.holders();
    // From just past `after` (or the first holder) to the prefix's end.
    let from = match after {
        Some(key) => {
            let mut k = log.layout.holder(key).into_bytes();
            k.push(0);
            k
        }
        None => holders.clone().into_bytes(),
    };
    let mut end = holders.clone().into_bytes();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    let resp = log
        .client
        .kv_client()
        .get(
            from,
            Some(
                GetOptions::new()
                    .with_range(end)
                    .with_keys_only()
                    .with_limit(i64::try_from(limit).unwrap_or(i64::MAX)),
            ),
        )
        .await
        .map_err(|e| unavailable("cannot read the held keys", e))?;
    let keys = resp
        .kvs()
        .iter()
        .map(|found| strip_holders(&holders, found.key()))
        .collect::<Result<Vec<_>, StoreError>>()?;
    answer(resp.header(), keys)
}

/// The lock key of a holder record's etcd `key`, found under `holders`
/// (the layout's holder prefix).
fn strip_holders(holders: &str, key: &[u8]) -> Result<String, StoreError> {
    std::str::from_utf8(key)
        .ok()
        .and_then(|k| k.strip_prefix(holders))
        .map(str::to_string)
        .ok_or_else(|| {
            StoreError::Malformed(format!(
                "etcd returned {} under the holder prefix {holders}",
                String::from_utf8_lossy(key)
            ))
        })
}

/// How many keys are held (count only: nothing but the count is sent).
pub(super) async fn count_holds(log: &EtcdLog) -> LogResult<i64> {
    let resp = log
        .client
        .kv_client()
        .get(
            log.layout.holders(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .map_err(|e| unavailable("cannot count the holds", e))?;
    answer(resp.header(), resp.count())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::Layout;

    #[test]
    fn lock_keys_lose_the_layout_prefix() {
        let holders = Layout::new("/latchkey/").holders();
        let key = Layout::new("/latchkey").holder("ledger/inv-1");
        assert!(matches!(
            strip_holders(&holders, key.as_bytes()).as_deref(),
            Ok("ledger/inv-1")
        ));
    }

    #[test]
    fn a_key_outside_the_prefix_or_not_utf8_is_malformed() {
        let holders = Layout::new("/latchkey").holders();
        assert!(matches!(
            strip_holders(&holders, b"/other/l/x"),
            Err(StoreError::Malformed(_))
        ));
        let mut key = holders.clone().into_bytes();
        key.push(0xff);
        assert!(matches!(
            strip_holders(&holders, &key),
            Err(StoreError::Malformed(_))
        ));
    }
}
