//! Elections on etcd ([`ElectionLog`]): the leader, term and candidate
//! records of `e/<name>//` (`latchkey_records::Layout::election`), each
//! operation one etcd request.

use async_trait::async_trait;
use latchkey_etcd::kv::{GetOptions, PutOptions, SortOrder, SortTarget, count_prefix};
use latchkey_etcd::txn::{self, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use latchkey_etcd::watch::{WatchOptions, watch_from};

use super::follow::EtcdPrefixWatch;
use super::holds::fence_unchanged;
use super::{EtcdLog, answer, first_kv, kv, unavailable, unavailable_on};
use crate::lock_log::{
    ElectionLog, ElectionRead, ForceEnded, ForceTermTxn, LeadFrom, LeadTxn, LogResult, PrefixWatch,
    ProclaimTxn, Queued, StoreError,
};

#[async_trait]
impl ElectionLog for EtcdLog {
    async fn election(&self, election: &str, limit: usize) -> LogResult<ElectionRead> {
        let candidates = self.layout.candidates(election);
        let by_key = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        // etcd reads a limit of 0 as no limit at all: asked for none, the
        // read only counts them (no candidate comes back).
        let by_key = match limit {
            0 => by_key.with_count_only(),
            limit => by_key.with_limit(i64::try_from(limit).unwrap_or(i64::MAX)),
        };
        let txn = Txn::new().and_then([
            TxnOp::get(self.layout.election_lead(election), None),
            TxnOp::get(self.layout.election_term(election), None),
            TxnOp::get(candidates.clone(), Some(by_key)),
        ]);
        let resp = txn::run(&self.client, txn)
            .await
            .map_err(|e| unavailable("cannot read an election", e))?;
        let ops = resp.op_responses();
        let read = ElectionRead {
            lead: ops.first().and_then(first_kv),
            term: ops.get(1).and_then(first_kv),
            candidates: match ops.get(2) {
                Some(TxnOpResponse::Get(get)) => get
                    .kvs()
                    .iter()
                    .filter_map(|entry| {
                        let key = entry.key_str().ok()?.strip_prefix(candidates.as_str())?;
                        Some((key.to_string(), kv(entry)))
                    })
                    .collect(),
                _ => Vec::new(),
            },
        };
        answer(resp.header(), read)
    }

    async fn stand(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        let txn = Txn::new()
            .when([Compare::value(
                self.layout.session(session),
                CompareOp::Equal,
                session_record,
            )])
            .and_then([TxnOp::put(
                self.layout.candidate(election, priority, session),
                record,
                Some(PutOptions::new().with_lease(session).with_prev_key()),
            )]);
        let resp = txn::run(&self.client, txn)
            .await
            .map_err(|e| unavailable_on("cannot add a candidate", session, e))?;
        let modified = txn::revision(&resp)
            .ok_or_else(|| StoreError::Malformed("etcd answered a txn without a header".into()))?;
        let stood = match (resp.succeeded(), resp.op_responses().first()) {
            (false, _) => None,
            (true, Some(TxnOpResponse::Put(put))) => Some(Queued {
                created: put.prev_key().map_or(modified, |kv| kv.create_revision()),
                modified,
            }),
            (true, _) => {
                return Err(StoreError::Malformed(
                    "etcd answered a candidate without its put".into(),
                ));
            }
        };
        answer(resp.header(), stood)
    }

    async fn withdraw(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        modified: i64,
    ) -> LogResult<bool> {
        let record = self.layout.candidate(election, priority, session);
        let txn = Txn::new()
            .when([Compare::mod_revision(
                record.clone(),
                CompareOp::Equal,
                modified,
            )])
            .and_then([TxnOp::delete(record, None)]);
        let resp = txn::run(&self.client, txn)
            .await
            .map_err(|e| unavailable("cannot remove a candidate", e))?;
        answer(resp.header(), resp.succeeded())
    }

    async fn lead(&self, txn: LeadTxn<'_>) -> LogResult<bool> {
        let lead_key = self.layout.election_lead(txn.election);
        let term_key = self.layout.election_term(txn.election);
        let mut compares = vec![
            Compare::value(self.layout.epoch(), CompareOp::Equal, txn.epoch),
            Compare::create_revision(self.layout.seal(), CompareOp::Equal, 0),
            fence_unchanged(self, txn.fence_at),
            // A missing key compares as mod revision 0.
            Compare::mod_revision(term_key.clone(), CompareOp::Equal, txn.term_at),
        ];
        let mut writes = Vec::new();
        let mut ending = None;
        match txn.from {
            LeadFrom::Vacant => {
                compares.push(Compare::create_revision(
                    lead_key.clone(),
                    CompareOp::Equal,
                    0,
                ));
            }
            LeadFrom::Leader { session, subject } => {
                compares.push(Compare::lease(lead_key.clone(), CompareOp::Equal, session));
                ending = Some(self.layout.leadership_entry(subject, txn.election));
            }
        }
        let lease = match &txn.to {
            Some(to) => {
                let candidate = self.layout.candidate(txn.election, to.priority, to.session);
                compares.push(Compare::create_revision(
                    candidate.clone(),
                    CompareOp::Equal,
                    to.created,
                ));
                // On the candidate's own session lease: a record another
                // writer of the prefix put without it (the force-release
                // role may write `e/`) never becomes a leadership.
                compares.push(Compare::lease(
                    candidate.clone(),
                    CompareOp::Equal,
                    to.session,
                ));
                if let Some(record) = to.session_record {
                    compares.push(Compare::value(
                        self.layout.session(to.session),
                        CompareOp::Equal,
                        record,
                    ));
                }
                let on_lease = || Some(PutOptions::new().with_lease(to.session));
                let entry = self.layout.leadership_entry(to.subject, txn.election);
                // The ending leader's entry and the next one's are one key
                // when both count against one subject: put, not deleted.
                if ending.as_ref() == Some(&entry) {
                    ending = None;
                }
                writes.extend([
                    TxnOp::put(lead_key, to.lead_record.clone(), on_lease()),
                    TxnOp::put(entry, Vec::new(), on_lease()),
                    TxnOp::delete(candidate, None),
                ]);
                to.session
            }
            None => {
                writes.push(TxnOp::delete(lead_key, None));
                0
            }
        };
        // The term record first: an observer reads a batch in this order.
        writes.insert(0, TxnOp::put(term_key, txn.term_record, None));
        if let Some(subject) = txn.creates_for {
            writes.push(TxnOp::put(
                self.layout.election_entry(subject, txn.election),
                Vec::new(),
                None,
            ));
        }
        if let Some(entry) = ending {
            writes.push(TxnOp::delete(entry, None));
        }
        let resp = txn::run(&self.client, Txn::new().when(compares).and_then(writes))
            .await
            .map_err(|e| unavailable_on("cannot run the leadership transaction", lease, e))?;
        answer(resp.header(), resp.succeeded())
    }

    async fn proclaim(&self, txn: ProclaimTxn<'_>) -> LogResult<bool> {
        let lead_key = self.layout.election_lead(txn.election);
        let compares = [
            Compare::value(self.layout.epoch(), CompareOp::Equal, txn.epoch),
            Compare::create_revision(self.layout.seal(), CompareOp::Equal, 0),
            Compare::mod_revision(
                self.layout.election_term(txn.election),
                CompareOp::Equal,
                txn.term_at,
            ),
            Compare::lease(lead_key.clone(), CompareOp::Equal, txn.session),
        ];
        let put = TxnOp::put(
            lead_key,
            txn.lead_record,
            Some(PutOptions::new().with_lease(txn.session)),
        );
        let resp = txn::run(&self.client, Txn::new().when(compares).and_then([put]))
            .await
            .map_err(|e| unavailable_on("cannot run the proclamation", txn.session, e))?;
        answer(resp.header(), resp.succeeded())
    }

    async fn force_end_term(&self, txn: ForceTermTxn<'_>) -> LogResult<ForceEnded> {
        // On the force-release path's own client, as a hold's forced end.
        super::force::force_end_term(self, txn).await
    }

    async fn count_leaderships(&self, subject: &str) -> LogResult<i64> {
        let count = count_prefix(&self.client, self.layout.leaderships_of(subject))
            .await
            .map_err(|e| unavailable("cannot count leaderships", e))?;
        answer(count.header.as_ref(), count.value)
    }

    async fn count_elections(&self, subject: &str) -> LogResult<i64> {
        let count = count_prefix(&self.client, self.layout.elections_of(subject))
            .await
            .map_err(|e| unavailable("cannot count elections", e))?;
        answer(count.header.as_ref(), count.value)
    }

    async fn watch_election(
        &self,
        election: &str,
        from_revision: i64,
    ) -> Result<Box<dyn PrefixWatch>, StoreError> {
        let prefix = self.layout.election(election);
        let options = WatchOptions::new().with_prefix().with_prev_key();
        let stream = watch_from(&self.client, prefix.as_str(), from_revision, options)
            .await
            .map_err(|e| unavailable("cannot watch an election", e))?;
        Ok(Box::new(EtcdPrefixWatch { stream, prefix }))
    }
}
