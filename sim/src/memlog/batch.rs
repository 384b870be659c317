//! The grant transaction, the release that compares its owner, and the
//! batch of both, as etcd 3.4 runs them (measured in the contract suite):
//! a batch is one transaction without compares whose operations are
//! nested transactions. etcd decides every nested transaction's branch on
//! the store as it was before the batch, then applies the branches taken,
//! all writes at one revision; a put on a lease it no longer has refuses
//! the whole transaction before anything is written.

use latchkey_arbiter::lock_log::{
    BatchOp, BatchOutcome, GrantTxn, Granted, Kv, PlaceWas, QueueTurn, ReleaseTxn, ReleasedIf,
    StoreError,
};

use latchkey_records::keys;

use super::LAYOUT;
use super::store::{Compare, NoLease, Op, OpResult, Store};

/// What happened to the batches of more than one member (the simulation
/// checks that its runs meet each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchCounts {
    /// Sent to the store.
    pub batches: u64,
    /// Applied with at least one member's compares failing.
    pub some_failed: u64,
    /// Applied with some members writing and some not.
    pub mixed: u64,
    /// Applied, and the answer lost.
    pub lost: u64,
    /// Failed before the store applied them.
    pub failed_before: u64,
    /// Restores of the store while at least one was on its way to it.
    pub restored_under: u64,
}

impl BatchCounts {
    pub(crate) fn note(&mut self, outcomes: &[BatchOutcome]) {
        if outcomes.len() < 2 {
            return;
        }
        let wrote = outcomes.iter().filter(|o| o.committed()).count();
        self.some_failed += u64::from(wrote < outcomes.len());
        self.mixed += u64::from(wrote > 0 && wrote < outcomes.len());
    }
}

/// The most members a batch takes (as the etcd log's limit).
pub(crate) const BATCH_LIMIT: usize = 64;

/// One member, planned: its compares, the writes of its success branch,
/// and how to read its answer.
pub(crate) struct Planned {
    pub(super) compares: Vec<Compare>,
    writes: Vec<Op>,
    kind: Kind,
}

enum Kind {
    Grant {
        holder: String,
        session: String,
        queue: String,
    },
    Release {
        holder: String,
    },
}

pub(crate) fn plan_grant(txn: &GrantTxn<'_>) -> Planned {
    let holder = LAYOUT.holder(txn.key);
    let session = LAYOUT.session(txn.session);
    // a shared hold defers to its lock's durable queue, as in the etcd log
    let queue = LAYOUT.queue_of(latchkey_records::named_key(txn.key));
    let mut compares = vec![
        Compare::CreateRevision(holder.clone(), 0),
        Compare::Value(LAYOUT.epoch(), txn.epoch.to_vec()),
        Compare::CreateRevision(LAYOUT.seal(), 0),
        // a missing fence compares as mod revision 0, as in etcd
        Compare::ModRevision(LAYOUT.map_fence(), txn.fence_at),
        Compare::Value(session.clone(), txn.session_record.to_vec()),
    ];
    let mut kind = kind_and_mode(txn.key);
    if let (QueueTurn::Mine { .. }, latchkey_records::HoldKind::Shared) =
        (txn.queue, latchkey_records::hold_kind(txn.key).0)
    {
        // a durable reader at its turn compares no intent (as etcd's)
        kind.pop();
    }
    compares.extend(kind);
    let mut writes = vec![Op::Put {
        key: holder.clone(),
        value: txn.holder_record.clone(),
        lease: txn.session,
    }];
    if let (latchkey_records::HoldKind::Exclusive, name) = latchkey_records::hold_kind(txn.key) {
        // the writer's own intent, as etcd's grant deletes it
        writes.push(Op::Delete(LAYOUT.intent(name, txn.session)));
    }
    if let Some(take) = &txn.quota {
        let place = LAYOUT.quota_place(&take.class, &take.subject, take.index);
        match &take.was {
            PlaceWas::Free => compares.push(Compare::CreateRevision(place.clone(), 0)),
            PlaceWas::Stale { revision, key } => compares.extend([
                Compare::ModRevision(place.clone(), *revision),
                Compare::ModRevisionNot(LAYOUT.holder(key), *revision),
            ]),
        }
        writes.push(Op::Put {
            key: place,
            value: take.record.clone(),
            lease: txn.session,
        });
    }
    match txn.queue {
        QueueTurn::Empty => compares.push(Compare::NoneUnder(queue.clone())),
        QueueTurn::Mine { created } => {
            let mine = LAYOUT.waiter(latchkey_records::named_key(txn.key), txn.session);
            compares.extend([
                Compare::AllCreatedAfter(queue.clone(), created - 1),
                Compare::CreateRevision(mine.clone(), created),
            ]);
            writes.push(Op::Delete(mine));
        }
    }
    Planned {
        compares,
        writes,
        kind: Kind::Grant {
            holder,
            session,
            queue,
        },
    }
}

/// One kind, and one mode, at a time under a name, as the etcd log
/// compares it: an exclusive grant finds nothing under `<name>//`; a shared
/// hold's grant no exclusive hold, no slot and no writer's intent; a slot's
/// grant no exclusive hold and no shared one.
pub(crate) fn kind_and_mode(key: &str) -> Vec<Compare> {
    use latchkey_records::{HoldKind, hold_kind, readers_of, slots_of, under_name};
    match hold_kind(key) {
        (HoldKind::Exclusive, name) => vec![Compare::NoneUnder(LAYOUT.holder(&under_name(name)))],
        (HoldKind::Shared, name) => vec![
            Compare::CreateRevision(LAYOUT.holder(name), 0),
            Compare::NoneUnder(LAYOUT.holder(&slots_of(name))),
            Compare::NoneUnder(LAYOUT.intents_of(name)),
        ],
        (HoldKind::Slot, name) => vec![
            Compare::CreateRevision(LAYOUT.holder(name), 0),
            Compare::NoneUnder(LAYOUT.holder(&readers_of(name))),
        ],
    }
}

/// etcd compares whole values, byte-wise: "begins with `owner`" is
/// `owner < value < owner⁺`, which is what the etcd log sends.
pub(crate) fn plan_release(txn: &ReleaseTxn) -> Result<Planned, StoreError> {
    let holder = LAYOUT.holder(&txn.key);
    let above = owner_bound(&txn.owner).ok_or_else(|| StoreError::Refused {
        context: "an owner prefix that ends in 0xff, or is empty, cannot be compared".into(),
    })?;
    Ok(Planned {
        compares: vec![
            Compare::ModRevision(holder.clone(), txn.revision),
            Compare::Lease(holder.clone(), txn.session),
            Compare::ValueGreater(holder.clone(), txn.owner.clone()),
            Compare::ValueLess(holder.clone(), above),
        ],
        writes: vec![
            Op::Delete(holder.clone()),
            Op::DeletePrefix(LAYOUT.claims_of(&txn.key)),
        ],
        kind: Kind::Release { holder },
    })
}

pub(crate) fn plan(op: &BatchOp<'_>) -> Result<Planned, StoreError> {
    match op {
        BatchOp::Grant(txn) => Ok(plan_grant(txn)),
        BatchOp::Release(txn) => plan_release(txn),
    }
}

fn owner_bound(owner: &[u8]) -> Option<Vec<u8>> {
    let (last, rest) = owner.split_last()?;
    let mut above = rest.to_vec();
    above.push(last.checked_add(1)?);
    Some(above)
}

/// What the etcd log refuses before sending: too many members, none, or
/// two on one lock key.
pub(crate) fn check(ops: &[BatchOp<'_>]) -> Result<(), StoreError> {
    if ops.is_empty() || ops.len() > BATCH_LIMIT {
        return Err(StoreError::Refused {
            context: format!("a batch of {} members", ops.len()),
        });
    }
    latchkey_arbiter::lock_log::batch_is_distinct(ops)
}

/// Runs `members` as one transaction: every branch decided on the store
/// before it, the taken branches' writes at one revision; a failed member
/// reads what its own transaction's failure branch reads.
pub(crate) fn apply(
    store: &mut Store,
    members: Vec<Planned>,
) -> Result<Vec<BatchOutcome>, NoLease> {
    let passed: Vec<bool> = members.iter().map(|m| store.all(&m.compares)).collect();
    // Failure branches only read keys no member writes (every member has
    // its own lock key; the epoch, seal, fence and session records are
    // nobody's write here), so reading them first is reading them in order.
    let failed: Vec<Option<BatchOutcome>> = members
        .iter()
        .zip(&passed)
        .map(|(m, ok)| (!ok).then(|| failure(store, &m.kind)))
        .collect();
    let mut writes = Vec::new();
    let mut spans = Vec::with_capacity(members.len());
    for (m, ok) in members.iter().zip(&passed) {
        let at = writes.len();
        if *ok {
            writes.extend(m.writes.iter().cloned());
        }
        spans.push(at);
    }
    let results = store.commit(writes)?;
    Ok(members
        .iter()
        .zip(failed)
        .zip(spans)
        .map(|((m, failed), at)| match failed {
            Some(outcome) => outcome,
            None => success(&m.kind, results.get(at)),
        })
        .collect())
}

fn failure(store: &Store, kind: &Kind) -> BatchOutcome {
    let kv = |key: &str| store.get(key).map(|s| s.kv());
    match kind {
        Kind::Grant {
            holder,
            session,
            queue,
        } => BatchOutcome::Grant(Granted::No {
            holder: kv(holder),
            epoch: kv(&LAYOUT.epoch()).map(|k: Kv| k.value),
            sealed: store.get(&LAYOUT.seal()).is_some(),
            session: kv(session).map(|k| k.value),
            queue_head: store.oldest_under(queue),
            fence_at: store.get(&LAYOUT.map_fence()).map_or(0, |s| s.mod_revision),
            other_kind: other_kind(store, holder),
            other_mode: other_mode(store, holder),
            intent: intent(store, holder),
        }),
        Kind::Release { holder } => BatchOutcome::Release(ReleasedIf::No { holder: kv(holder) }),
    }
}

/// What a grant's failure branch reads of the other kinds under its name
/// (as the etcd log's does).
fn other_kind(store: &Store, holder: &str) -> bool {
    use latchkey_records::{HoldKind, hold_kind, readers_of, slots_of, under_name};
    let key = holder.strip_prefix(keys::HOLDERS).unwrap_or(holder);
    let held = |k: &str| store.get(&LAYOUT.holder(k)).is_some();
    let any_under = |p: &str| store.oldest_under(&LAYOUT.holder(p)).is_some();
    match hold_kind(key) {
        (HoldKind::Exclusive, name) => {
            any_under(&under_name(name)) && !any_under(&readers_of(name))
        }
        (HoldKind::Shared, name) => any_under(&slots_of(name)),
        (HoldKind::Slot, name) => held(name) || any_under(&readers_of(name)),
    }
}

/// The hold in the other mode a grant's failure branch reads: the
/// exclusive hold for a shared hold's grant, a shared hold for an
/// exclusive grant (the first in key order, as etcd's limit-1 read).
fn other_mode(store: &Store, holder: &str) -> Option<Kv> {
    use latchkey_records::{HoldKind, hold_kind, readers_of};
    let key = holder.strip_prefix(keys::HOLDERS).unwrap_or(holder);
    match hold_kind(key) {
        (HoldKind::Exclusive, name) => store.first_under(&LAYOUT.holder(&readers_of(name))),
        (HoldKind::Shared, name) => store.get(&LAYOUT.holder(name)).map(|s| s.kv()),
        (HoldKind::Slot, _) => None,
    }
}

/// The oldest writer's intent a shared hold's grant reads on failure.
fn intent(store: &Store, holder: &str) -> Option<Kv> {
    use latchkey_records::{HoldKind, hold_kind};
    let key = holder.strip_prefix(keys::HOLDERS).unwrap_or(holder);
    match hold_kind(key) {
        (HoldKind::Shared, name) => store.oldest_under(&LAYOUT.intents_of(name)),
        _ => None,
    }
}

fn success(kind: &Kind, first: Option<&OpResult>) -> BatchOutcome {
    match kind {
        Kind::Grant { .. } => BatchOutcome::Grant(Granted::Yes),
        Kind::Release { .. } => {
            // the compares found the key, so the delete returned it
            let previous = match first {
                Some(OpResult::Deleted(prev)) => prev.first().map(|(_, kv)| kv.value.clone()),
                _ => None,
            };
            BatchOutcome::Release(ReleasedIf::Yes(previous.unwrap_or_default()))
        }
    }
}
