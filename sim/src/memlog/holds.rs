//! The holds of the [`super::MemLog`]: grants, hand-overs, releases,
//! claims, forced ends, reads and key watches, each one call.

use async_trait::async_trait;
use latchkey_arbiter::lock_log::{
    BatchOp, BatchOutcome, Claimed, DowngradeTxn, ForceEndTxn, ForceEnded, GrantTxn, Granted,
    HandOverFrom, HandOverTxn, HeldAt, HoldLog, KeyWatch, Kv, LogResult, ReleaseTxn, ReleasedIf,
    StoreError, fallback,
};

use super::store::{Compare, NoLease, Op, OpResult};
use latchkey_records::keys;

use super::{LAYOUT, MemLog, batch, commit, kv_of, lease_gone, put, watch};

/// The high bits of the leases a forced end puts its records on.
pub(super) const FORCE_LEASES: i64 = 0x3f << 56;

/// The compares that make a release or hand-over act only on `held`: the
/// same record bytes, on the same lease, at the same revision.
fn still_held(held: &HeldAt) -> [Compare; 3] {
    let key = LAYOUT.holder(&held.key);
    [
        Compare::ModRevision(key.clone(), held.revision),
        Compare::Lease(key.clone(), held.session),
        Compare::Value(key, held.value.clone()),
    ]
}

#[async_trait]
impl HoldLog for MemLog {
    async fn holders_of(&self, keys: &[String]) -> LogResult<Vec<Option<Kv>>> {
        fallback::holders_of(self, keys).await
    }

    async fn held_keys_page(&self, after: Option<&str>, limit: usize) -> LogResult<Vec<String>> {
        fallback::held_keys_page(self, after, limit).await
    }

    async fn grant(&self, txn: GrantTxn<'_>) -> LogResult<Granted> {
        let planned = batch::plan_grant(&txn);
        self.call("grant", |inner, _| {
            let outcome = batch::apply(&mut inner.store, vec![planned]).map_err(lease_gone)?;
            match outcome.into_iter().next() {
                Some(BatchOutcome::Grant(granted)) => inner.answer(granted),
                _ => Err(StoreError::Malformed("a grant without its outcome".into())),
            }
        })
        .await
    }

    async fn release_if_owned(&self, txn: &ReleaseTxn) -> LogResult<ReleasedIf> {
        let planned = batch::plan_release(txn)?;
        self.call("release if owned", |inner, _| {
            let outcome = batch::apply(&mut inner.store, vec![planned]).map_err(lease_gone)?;
            match outcome.into_iter().next() {
                Some(BatchOutcome::Release(released)) => inner.answer(released),
                _ => Err(StoreError::Malformed(
                    "a release without its outcome".into(),
                )),
            }
        })
        .await
    }

    fn batch_limit(&self) -> usize {
        batch::BATCH_LIMIT
    }

    async fn batch(&self, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>> {
        // refused before it is sent, as the etcd log does: no call
        batch::check(&ops)?;
        let planned = ops.iter().map(batch::plan).collect::<Result<Vec<_>, _>>()?;
        self.batch_call(planned.len(), |inner, _| {
            let outcomes = batch::apply(&mut inner.store, planned).map_err(|NoLease(lease)| {
                StoreError::Refused {
                    context: format!("a batch put on lease {lease:#x}, which is gone"),
                }
            })?;
            inner.batches.note(&outcomes);
            inner.answer(outcomes)
        })
        .await
    }

    async fn hand_over(&self, txn: HandOverTxn<'_>) -> LogResult<Option<Option<Vec<u8>>>> {
        let mut compares = match txn.from {
            HandOverFrom::Exact(held) => still_held(held).to_vec(),
            HandOverFrom::Owned(owned) => batch::plan_release(owned)?.compares,
        };
        compares.extend([
            Compare::Value(LAYOUT.epoch(), txn.epoch.to_vec()),
            Compare::CreateRevision(LAYOUT.seal(), 0),
            Compare::ModRevision(LAYOUT.map_fence(), txn.fence_at),
            Compare::Value(
                LAYOUT.session(txn.next_session),
                txn.next_session_record.to_vec(),
            ),
            Compare::NoneUnder(LAYOUT.queue_of(txn.from.key())),
        ]);
        let key = txn.from.key().to_string();
        let holder = LAYOUT.holder(&key);
        self.call("hand over", |inner, _| {
            if !inner.store.all(&compares) {
                return inner.answer(None);
            }
            let results = commit(
                &mut inner.store,
                vec![
                    put(holder, txn.holder_record, txn.next_session),
                    Op::DeletePrefix(LAYOUT.claims_of(&key)),
                    Op::Delete(LAYOUT.intent(latchkey_records::named_key(&key), txn.next_session)),
                ],
            )?;
            let previous = match results.first() {
                Some(OpResult::Put(prev)) => prev.as_ref().map(|kv| kv.value.clone()),
                _ => None,
            };
            inner.answer(Some(previous))
        })
        .await
    }

    async fn downgrade(&self, txn: DowngradeTxn<'_>) -> LogResult<bool> {
        let reader = LAYOUT.holder(txn.reader_key);
        let mut compares = still_held(txn.held).to_vec();
        compares.extend([
            Compare::CreateRevision(reader.clone(), 0),
            Compare::Value(LAYOUT.epoch(), txn.epoch.to_vec()),
            Compare::CreateRevision(LAYOUT.seal(), 0),
            Compare::ModRevision(LAYOUT.map_fence(), txn.fence_at),
            Compare::Value(
                LAYOUT.session(txn.held.session),
                txn.session_record.to_vec(),
            ),
        ]);
        // no slot under the name; not the exclusive hold's absence (this
        // transaction ends it), the durable queue or a writer's intent:
        // converting the session's own hold lets nobody else in (as etcd's)
        let slots = latchkey_records::slots_of(&txn.held.key);
        compares.push(Compare::NoneUnder(LAYOUT.holder(&slots)));
        let key = txn.held.key.clone();
        let session = txn.held.session;
        self.call("downgrade", |inner, _| {
            if !inner.store.all(&compares) {
                return inner.answer(false);
            }
            commit(
                &mut inner.store,
                vec![
                    Op::Delete(LAYOUT.holder(&key)),
                    Op::DeletePrefix(LAYOUT.claims_of(&key)),
                    put(reader, txn.holder_record, session),
                ],
            )?;
            inner.answer(true)
        })
        .await
    }

    async fn release(&self, held: &HeldAt) -> LogResult<Option<Vec<u8>>> {
        let compares = still_held(held);
        let holder = LAYOUT.holder(&held.key);
        self.call("release", |inner, _| {
            if !inner.store.all(&compares) {
                return inner.answer(None);
            }
            let results = commit(
                &mut inner.store,
                vec![
                    Op::Delete(holder),
                    Op::DeletePrefix(LAYOUT.claims_of(&held.key)),
                ],
            )?;
            let previous = match results.first() {
                Some(OpResult::Deleted(prev)) => prev.first().map(|(_, kv)| kv.value.clone()),
                _ => None,
            };
            // the compares found the key, so the delete returned it
            inner.answer(Some(previous.unwrap_or_default()))
        })
        .await
    }

    async fn claim(&self, key: &str, session: i64, revision: i64) -> LogResult<Claimed> {
        let holder = LAYOUT.holder(key);
        let claim = LAYOUT.claim(key, revision);
        self.call("claim", |inner, _| {
            let held = inner.store.all(&[
                Compare::ModRevision(holder.clone(), revision),
                Compare::Lease(holder.clone(), session),
            ]);
            let recorded = !inner
                .store
                .all(&[Compare::CreateRevision(claim.clone(), 0)]);
            let claimed = match (held, recorded) {
                (true, false) => {
                    commit(&mut inner.store, vec![put(claim, Vec::new(), session)])?;
                    Claimed::Now
                }
                (true, true) => Claimed::Already,
                (false, _) => Claimed::Gone,
            };
            inner.answer(claimed)
        })
        .await
    }

    async fn release_orphan(&self, key: &str, session: i64, revision: i64) -> LogResult<bool> {
        let holder = LAYOUT.holder(key);
        let claim = LAYOUT.claim(key, revision);
        self.call("release orphan", |inner, _| {
            let ok = inner.store.all(&[
                Compare::ModRevision(holder.clone(), revision),
                Compare::Lease(holder.clone(), session),
                Compare::CreateRevision(claim, 0),
            ]);
            if ok {
                commit(&mut inner.store, vec![Op::Delete(holder)])?;
            }
            inner.answer(ok)
        })
        .await
    }

    async fn force_end(&self, txn: ForceEndTxn<'_>) -> LogResult<ForceEnded> {
        let holder = LAYOUT.holder(txn.key);
        let records = txn.records.clone();
        let (key, lease, revision) = (txn.key.to_string(), txn.lease, txn.revision);
        self.call("force end", move |inner, now| {
            let held = inner.store.all(&[
                Compare::ModRevision(holder.clone(), revision),
                Compare::Lease(holder.clone(), lease),
            ]);
            let records_moved = !records.unchanged.iter().all(|(name, rev)| {
                inner
                    .store
                    .get(name)
                    .is_some_and(|kv| kv.mod_revision == *rev)
            });
            if records_moved {
                return inner.answer(ForceEnded::RecordsChanged);
            }
            if !held {
                let now = kv_of(&inner.store, &holder);
                return inner.answer(ForceEnded::HoldChanged { now });
            }
            let mut ops = vec![Op::Delete(holder), Op::DeletePrefix(LAYOUT.claims_of(&key))];
            if !records.put.is_empty() {
                // A lease of its own, as etcd grants one (ids far above
                // any session's, one per revision, so never taken).
                let record_lease = FORCE_LEASES | (inner.store.revision() + 1);
                inner
                    .store
                    .grant_lease(record_lease, records.ttl_seconds, now);
                ops.extend(
                    records
                        .put
                        .iter()
                        .map(|(name, value)| put(name.clone(), value.clone(), record_lease)),
                );
            }
            ops.extend(records.delete.iter().map(|name| Op::Delete(name.clone())));
            commit(&mut inner.store, ops)?;
            inner.answer(ForceEnded::Ended)
        })
        .await
    }

    async fn holder(&self, key: &str) -> LogResult<Option<Kv>> {
        let holder = LAYOUT.holder(key);
        self.call("holder", |inner, _| {
            let kv = kv_of(&inner.store, &holder);
            inner.answer(kv)
        })
        .await
    }

    async fn quota_places(&self, class: &str, subject: &str) -> LogResult<Vec<(u32, Kv)>> {
        let under = LAYOUT.quota_places(class, subject);
        self.call("quota places", |inner, _| {
            let places = inner
                .store
                .range(&under)
                .map(|(k, kv)| {
                    latchkey_records::quota_place_index(k)
                        .map(|index| (index, kv.kv()))
                        .ok_or_else(|| {
                            StoreError::Malformed(format!("a quota place no arbiter names: {k:?}"))
                        })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            inner.answer(places)
        })
        .await
    }

    async fn free_quota_place(
        &self,
        class: &str,
        subject: &str,
        index: u32,
        revision: i64,
    ) -> LogResult<bool> {
        let place = LAYOUT.quota_place(class, subject, index);
        self.call("free quota place", |inner, _| {
            let freed = inner
                .store
                .all(&[Compare::ModRevision(place.clone(), revision)]);
            if freed {
                commit(&mut inner.store, vec![Op::Delete(place.clone())])?;
            }
            inner.answer(freed)
        })
        .await
    }

    async fn holders_under(&self, prefix: &str) -> LogResult<Vec<(String, Kv)>> {
        let under = LAYOUT.holder(prefix);
        self.call("holders under", |inner, _| {
            let holds = inner
                .store
                .range(&under)
                .map(|(k, kv)| {
                    let key = k.strip_prefix(keys::HOLDERS).unwrap_or(k);
                    (key.to_string(), kv.kv())
                })
                .collect();
            inner.answer(holds)
        })
        .await
    }

    async fn count_holds(&self) -> LogResult<i64> {
        self.call("count holds", |inner, _| {
            let n = inner.store.count(keys::HOLDERS);
            inner.answer(n)
        })
        .await
    }

    async fn watch(&self, key: &str, from_revision: i64) -> Result<Box<dyn KeyWatch>, StoreError> {
        let holder = LAYOUT.holder(key);
        let rx = self.shared.changed.subscribe();
        let id = self
            .call("watch", |inner, _| {
                Ok(inner.store.open_watch(&holder, from_revision))
            })
            .await?;
        Ok(Box::new(watch::MemWatch::new(self.shared.clone(), id, rx)))
    }
}
