//! Elections on the [`super::MemLog`] ([`ElectionLog`]): the leader, term
//! and candidate records of `e/<name>//`, each operation one call with the
//! etcd log's compares and writes (`arbiter/src/lock_log/etcd/elections.rs`).

use async_trait::async_trait;
use latchkey_arbiter::lock_log::{
    ElectionLog, ElectionRead, ForceEnded, ForceTermTxn, LeadFrom, LeadTxn, LogResult, PrefixWatch,
    ProclaimTxn, Queued, StoreError,
};

use super::store::{Compare, Op};
use super::{LAYOUT, MemLog, commit, kv_of, put, watch};

#[async_trait]
impl ElectionLog for MemLog {
    async fn election(&self, election: &str, limit: usize) -> LogResult<ElectionRead> {
        let lead = LAYOUT.election_lead(election);
        let term = LAYOUT.election_term(election);
        let candidates = LAYOUT.candidates(election);
        self.call("election", |inner, _| {
            let read = ElectionRead {
                lead: kv_of(&inner.store, &lead),
                term: kv_of(&inner.store, &term),
                candidates: inner
                    .store
                    .range(&candidates)
                    .take(limit)
                    .map(|(key, kv)| {
                        let below = key.strip_prefix(candidates.as_str()).unwrap_or(key);
                        (below.to_string(), kv.kv())
                    })
                    .collect(),
            };
            inner.answer(read)
        })
        .await
    }

    async fn stand(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        let candidate = LAYOUT.candidate(election, priority, session);
        let own = Compare::Value(LAYOUT.session(session), session_record.to_vec());
        self.call("stand", |inner, _| {
            if !inner.store.all(&[own]) {
                return inner.answer(None);
            }
            // over an existing record the put keeps its create revision
            commit(
                &mut inner.store,
                vec![put(candidate.clone(), record, session)],
            )?;
            let stood = inner.store.get(&candidate).map(|kv| Queued {
                created: kv.create_revision,
                modified: kv.mod_revision,
            });
            let stood = stood.ok_or_else(|| StoreError::Malformed("a put not stored".into()))?;
            inner.answer(Some(stood))
        })
        .await
    }

    async fn withdraw(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        modified: i64,
    ) -> LogResult<bool> {
        let candidate = LAYOUT.candidate(election, priority, session);
        self.call("withdraw", |inner, _| {
            let ok = inner
                .store
                .all(&[Compare::ModRevision(candidate.clone(), modified)]);
            if ok {
                commit(&mut inner.store, vec![Op::Delete(candidate)])?;
            }
            inner.answer(ok)
        })
        .await
    }

    async fn lead(&self, txn: LeadTxn<'_>) -> LogResult<bool> {
        let lead = LAYOUT.election_lead(txn.election);
        let term = LAYOUT.election_term(txn.election);
        let mut compares = vec![
            Compare::Value(LAYOUT.epoch(), txn.epoch.to_vec()),
            Compare::CreateRevision(LAYOUT.seal(), 0),
            // a missing key compares as mod revision 0, as in etcd
            Compare::ModRevision(LAYOUT.map_fence(), txn.fence_at),
            Compare::ModRevision(term.clone(), txn.term_at),
        ];
        let mut ending = None;
        compares.push(match txn.from {
            LeadFrom::Vacant => Compare::CreateRevision(lead.clone(), 0),
            LeadFrom::Leader { session, subject } => {
                ending = Some(LAYOUT.leadership_entry(subject, txn.election));
                Compare::Lease(lead.clone(), session)
            }
        });
        // The term record first (on no lease), as the etcd log writes it.
        let mut writes = vec![put(term, txn.term_record, 0)];
        match txn.to {
            Some(to) => {
                let candidate = LAYOUT.candidate(txn.election, to.priority, to.session);
                compares.push(Compare::CreateRevision(candidate.clone(), to.created));
                compares.push(Compare::Lease(candidate.clone(), to.session));
                if let Some(record) = to.session_record {
                    compares.push(Compare::Value(LAYOUT.session(to.session), record.to_vec()));
                }
                let entry = LAYOUT.leadership_entry(to.subject, txn.election);
                if ending.as_ref() == Some(&entry) {
                    ending = None;
                }
                writes.push(put(lead, to.lead_record, to.session));
                writes.push(put(entry, Vec::new(), to.session));
                writes.push(Op::Delete(candidate));
            }
            None => writes.push(Op::Delete(lead)),
        }
        if let Some(entry) = ending {
            writes.push(Op::Delete(entry));
        }
        if let Some(subject) = txn.creates_for {
            writes.push(put(
                LAYOUT.election_entry(subject, txn.election),
                Vec::new(),
                0,
            ));
        }
        self.call("lead", |inner, _| {
            let ok = inner.store.all(&compares);
            if ok {
                commit(&mut inner.store, writes)?;
            }
            inner.answer(ok)
        })
        .await
    }

    async fn proclaim(&self, txn: ProclaimTxn<'_>) -> LogResult<bool> {
        let lead = LAYOUT.election_lead(txn.election);
        let compares = [
            Compare::Value(LAYOUT.epoch(), txn.epoch.to_vec()),
            Compare::CreateRevision(LAYOUT.seal(), 0),
            Compare::ModRevision(LAYOUT.election_term(txn.election), txn.term_at),
            Compare::Lease(lead.clone(), txn.session),
        ];
        self.call("proclaim", |inner, _| {
            let ok = inner.store.all(&compares);
            if ok {
                commit(
                    &mut inner.store,
                    vec![put(lead, txn.lead_record, txn.session)],
                )?;
            }
            inner.answer(ok)
        })
        .await
    }

    async fn force_end_term(&self, txn: ForceTermTxn<'_>) -> LogResult<ForceEnded> {
        let lead = LAYOUT.election_lead(txn.election);
        let term = LAYOUT.election_term(txn.election);
        let entry = LAYOUT.leadership_entry(txn.subject, txn.election);
        let records = txn.records.clone();
        let (session, term_at, term_record) = (txn.session, txn.term_at, txn.term_record);
        self.call("force end term", move |inner, now| {
            let led = inner.store.all(&[
                Compare::Lease(lead.clone(), session),
                Compare::ModRevision(term.clone(), term_at),
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
            if !led {
                let now = kv_of(&inner.store, &lead);
                return inner.answer(ForceEnded::HoldChanged { now });
            }
            // The term record first, as the etcd log writes it.
            let mut ops = vec![
                put(term, term_record, 0),
                Op::Delete(lead),
                Op::Delete(entry),
            ];
            if !records.put.is_empty() {
                // A lease of its own, as a hold's forced end takes one.
                let record_lease = super::holds::FORCE_LEASES | (inner.store.revision() + 1);
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

    async fn count_leaderships(&self, subject: &str) -> LogResult<i64> {
        let prefix = LAYOUT.leaderships_of(subject);
        self.call("count leaderships", |inner, _| {
            let n = inner.store.count(&prefix);
            inner.answer(n)
        })
        .await
    }

    async fn count_elections(&self, subject: &str) -> LogResult<i64> {
        let prefix = LAYOUT.elections_of(subject);
        self.call("count elections", |inner, _| {
            let n = inner.store.count(&prefix);
            inner.answer(n)
        })
        .await
    }

    async fn watch_election(
        &self,
        election: &str,
        from_revision: i64,
    ) -> Result<Box<dyn PrefixWatch>, StoreError> {
        let prefix = LAYOUT.election(election);
        // The call's fate first; then the watch, so a lost answer cannot
        // leave a watch open that nobody reads (as `follow`).
        self.call("watch election", |_, _| Ok(())).await?;
        let rx = self.shared.changed.subscribe();
        let id = self
            .shared
            .with(|inner, _| inner.store.open_prefix_watch(&prefix, from_revision));
        Ok(Box::new(watch::MemPrefixWatch::new(
            self.shared.clone(),
            id,
            rx,
        )))
    }
}
