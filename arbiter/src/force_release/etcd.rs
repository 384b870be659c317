//! The force-release path's etcd requests (through [`latchkey_etcd`], like
//! the lock log and the holds' watch): reads of a hold or of an election's
//! leadership, the request records and their listing. The transaction that ends the hold is the lock log's
//! (`HoldLog::force_end`), run by the key's owner; a leadership's is
//! `ElectionLog::force_end_term`, run by the election's owner.
//!
//! One client, `force`: logged in as the restricted force-release user
//! when one is configured. The holder's session revocation is not here:
//! it is the lock log's (`SessionLog::revoke_session`, run by the key's
//! owner with the arbiter's own client, as etcd lets a user revoke a lease
//! only with write permission on every key attached to it).

use std::time::Duration;

use latchkey_etcd::kv::{GetOptions, PutOptions};
use latchkey_etcd::txn::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use latchkey_etcd::{Client, ErrorKind};
use tracing::warn;

use super::{ForceError, ForceRecord, RequestRecord};
use crate::lock_log::Kv;
use crate::records::{HolderRecord, Layout, decode, encode};
use latchkey_records::LeadRecord;

/// A holder record as read: what it says, its lease, its mod revision.
#[derive(Debug, Clone)]
pub struct Hold {
    pub record: HolderRecord,
    pub lease: i64,
    pub mod_revision: i64,
}

/// An election's leadership as read: the leader record, its lease, and
/// the term record's mod revision (0: absent).
#[derive(Debug, Clone)]
pub struct Led {
    pub record: LeadRecord,
    pub lease: i64,
    pub term_revision: i64,
}

#[derive(Clone)]
pub struct ForceStore {
    force: Client,
    prefix: String,
    layout: Layout,
}

impl std::fmt::Debug for ForceStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForceStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn store_error(context: &str, e: impl Into<latchkey_etcd::Error>) -> ForceError {
    let e = e.into();
    if e.kind() == ErrorKind::PermissionDenied {
        let message = e.grpc_message().unwrap_or_default();
        return ForceError::StorePermission(format!("{context}: {message}"));
    }
    ForceError::Store {
        detail: format!("{context}: {e}"),
        source: Some(std::sync::Arc::new(e)),
    }
}

fn ttl_seconds(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX)
}

impl ForceStore {
    pub fn new(force: Client, prefix: &str) -> Self {
        Self {
            force,
            prefix: prefix.trim_end_matches('/').to_string(),
            layout: Layout::new(prefix),
        }
    }

    /// `{prefix}/sys/force-req/`: pending requests.
    pub fn requests_dir(&self) -> String {
        self.layout.force_requests()
    }

    /// `{prefix}/sys/force/`: force records.
    pub fn records_dir(&self) -> String {
        self.layout.force_records()
    }

    /// The hold on `key` now, if any.
    pub async fn hold(&self, key: &str) -> Result<Option<Hold>, ForceError> {
        let resp = self
            .force
            .kv_client()
            .get(self.layout.holder(key), None)
            .await
            .map_err(|e| store_error("reading the hold", e))?;
        Ok(resp.kvs().first().map(|kv| Hold {
            // A record nobody can read is still a hold to release.
            record: decode(kv.value()).unwrap_or_else(|| HolderRecord {
                identity: "(unreadable holder record)".into(),
                session: kv.lease(),
                class: String::new(),
                acquired_at_unix_ms: 0,
                annotations: Default::default(),
                instance: String::new(),
                bound: String::new(),
                quota_place: None,
                downgraded_from: None,
            }),
            lease: kv.lease(),
            mod_revision: kv.mod_revision(),
        }))
    }

    /// Election `name`'s leadership now, if it is led: the leader record
    /// and the term record, in one read.
    pub async fn leadership(&self, name: &str) -> Result<Option<Led>, ForceError> {
        let txn = Txn::new().and_then(vec![
            TxnOp::get(self.layout.election_lead(name), None),
            TxnOp::get(self.layout.election_term(name), None),
        ]);
        let resp = self
            .force
            .kv_client()
            .txn(txn)
            .await
            .map_err(|e| store_error("reading the election", e))?;
        let answers = resp.op_responses();
        let first = |i: usize| match answers.get(i) {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
            _ => None,
        };
        let Some(lead) = first(0) else {
            return Ok(None);
        };
        let term_revision = first(1).map_or(0, |kv| kv.mod_revision());
        Ok(Some(Led {
            // A record nobody can read is still a leadership to end.
            record: decode(lead.value()).unwrap_or_else(|| LeadRecord {
                identity: "(unreadable leader record)".into(),
                session: lead.lease(),
                class: String::new(),
                epoch: 0,
                count: 0,
                value: String::new(),
                priority: 0,
                since_unix_ms: 0,
                instance: String::new(),
                bound: String::new(),
                yields: false,
            }),
            lease: lead.lease(),
            term_revision,
        }))
    }

    /// The places `subject`'s pending requests take now.
    pub async fn taken_places(&self, subject: &str) -> Result<Vec<u32>, ForceError> {
        let dir = self.layout.operator_places(subject);
        let resp = self
            .force
            .kv_client()
            .get(
                dir.as_str(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .map_err(|e| store_error("reading the operator's pending requests", e))?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| kv.key_str().ok()?.strip_prefix(dir.as_str())?.parse().ok())
            .collect())
    }

    /// Puts `request` on a lease of `ttl`, only if the hold is still the one
    /// the request names, in ONE transaction with the two places that bound
    /// pending requests: the hold's (one per hold) and one of the
    /// requester's (at most [`super::MAX_PENDING_PER_OPERATOR`]), each
    /// created only if absent, all on the request's lease (they end with it,
    /// and an approval deletes them with it). Requests racing on any number
    /// of arbiters cannot pass either bound: a place is taken by exactly one
    /// put. A place taken meanwhile moves the request to another free one.
    pub async fn put_request(
        &self,
        mut request: RequestRecord,
        ttl: Duration,
    ) -> Result<RequestRecord, ForceError> {
        let lease = self
            .force
            .lease_client()
            .grant(ttl_seconds(ttl), None)
            .await
            .map_err(|e| store_error("granting the request's lease", e))?
            .id();
        let outcome = self.put_request_on(&mut request, lease).await;
        if outcome.is_err() {
            self.drop_lease(lease).await;
        }
        outcome.map(|()| request)
    }

    async fn put_request_on(
        &self,
        request: &mut RequestRecord,
        lease: i64,
    ) -> Result<(), ForceError> {
        // What the request names: the holder record, or the leader record
        // with the term record.
        let (target, term) = match request.election {
            false => (self.layout.holder(&request.key), None),
            true => (
                self.layout.election_lead(&request.key),
                Some(self.layout.election_term(&request.key)),
            ),
        };
        let hold_place = self.layout.force_target_place(request);
        let on_lease = || Some(PutOptions::new().with_lease(lease));
        // Each retry follows a place another request took meanwhile: more
        // than the places there are means the store keeps changing under us.
        for _ in 0..=super::MAX_PENDING_PER_OPERATOR {
            let place = self.layout.operator_place(
                &request.requester_subject,
                request.place.unwrap_or_default(),
            );
            let mut when = match &term {
                None => self.same_hold(&target, request),
                Some(term) => vec![
                    Compare::lease(target.as_str(), CompareOp::Equal, request.hold_lease),
                    Compare::mod_revision(term.as_str(), CompareOp::Equal, request.hold_revision),
                ],
            };
            when.push(Compare::version(hold_place.as_str(), CompareOp::Equal, 0));
            when.push(Compare::version(place.as_str(), CompareOp::Equal, 0));
            let txn = Txn::new()
                .when(when)
                .and_then(vec![
                    TxnOp::put(
                        self.layout.force_request(&request.id),
                        encode(&*request),
                        on_lease(),
                    ),
                    TxnOp::put(hold_place.as_str(), request.id.as_str(), on_lease()),
                    TxnOp::put(place.as_str(), request.id.as_str(), on_lease()),
                ])
                .or_else(vec![
                    TxnOp::get(target.as_str(), None),
                    TxnOp::get(hold_place.as_str(), None),
                    TxnOp::get(place.as_str(), Some(GetOptions::new().with_count_only())),
                    // The term record (a hold's request reads its holder
                    // record again: unused).
                    TxnOp::get(
                        term.as_deref().unwrap_or(target.as_str()),
                        Some(GetOptions::new().with_keys_only()),
                    ),
                ]);
            let resp = self
                .force
                .kv_client()
                .txn(txn)
                .await
                .map_err(|e| store_error("writing the request", e))?;
            if resp.succeeded() {
                return Ok(());
            }
            let answers = resp.op_responses();
            let got = |i: usize| match answers.get(i) {
                Some(TxnOpResponse::Get(g)) => g.kvs().first().cloned(),
                _ => None,
            };
            let same = match request.election {
                false => got(0).is_some_and(|kv| {
                    kv.mod_revision() == request.hold_revision && kv.lease() == request.hold_lease
                }),
                true => {
                    got(0).is_some_and(|kv| kv.lease() == request.hold_lease)
                        && got(3).map_or(0, |kv| kv.mod_revision()) == request.hold_revision
                }
            };
            if !same && request.election {
                return Err(ForceError::TermChanged {
                    election: request.key.clone(),
                    now: describe_leader_now(hold_of(&answers).as_ref(), request.term),
                });
            }
            if !same {
                return Err(ForceError::HoldChanged {
                    key: request.key.clone(),
                    now: describe_now(hold_of(&answers).as_ref()),
                });
            }
            if let Some(kv) = got(1) {
                let what = match request.election {
                    true => format!("the leadership of election {:?}", request.key),
                    false => format!("the hold on {:?}", request.key),
                };
                return Err(ForceError::AlreadyRequested {
                    what,
                    id: crate::service::truncate(&String::from_utf8_lossy(kv.value()), 64),
                });
            }
            // Our place was taken by a request racing with this one.
            let taken = self.taken_places(&request.requester_subject).await?;
            match (0..super::MAX_PENDING_PER_OPERATOR as u32).find(|p| !taken.contains(p)) {
                Some(free) => request.place = Some(free),
                None => {
                    return Err(ForceError::TooManyPending {
                        subject: request.requester_subject.clone(),
                        limit: super::MAX_PENDING_PER_OPERATOR,
                    });
                }
            }
        }
        Err(ForceError::store(
            "the requester's pending requests kept changing while this one was written; try again",
        ))
    }

    /// The request `id` and its record's mod revision, if it is pending.
    pub async fn request(&self, id: &str) -> Result<Option<(RequestRecord, i64)>, ForceError> {
        let resp = self
            .force
            .kv_client()
            .get(self.layout.force_request(id), None)
            .await
            .map_err(|e| store_error("reading the request", e))?;
        Ok(resp
            .kvs()
            .first()
            .and_then(|kv| decode(kv.value()).map(|r| (r, kv.mod_revision()))))
    }

    /// Pending requests and force records.
    /// Every request record (pending until approved or expired).
    pub async fn pending_requests(&self) -> Result<Vec<RequestRecord>, ForceError> {
        let resp = self
            .force
            .kv_client()
            .get(self.requests_dir(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| store_error("listing requests", e))?;
        Ok(resp
            .kvs()
            .iter()
            .filter_map(|kv| decode(kv.value()))
            .collect())
    }

    pub async fn list(&self) -> Result<(Vec<RequestRecord>, Vec<ForceRecord>), ForceError> {
        let requests = self.pending_requests().await?;
        let records = self
            .force
            .kv_client()
            .get(self.records_dir(), Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| store_error("listing force records", e))?;
        Ok((
            requests,
            records
                .kvs()
                .iter()
                .filter_map(|kv| decode(kv.value()))
                .collect(),
        ))
    }

    /// The hold is the request's: same lease, same mod revision (a hold
    /// re-granted since, even to the same session, has another revision).
    fn same_hold(&self, holder: &str, request: &RequestRecord) -> Vec<Compare> {
        vec![
            Compare::mod_revision(holder, CompareOp::Equal, request.hold_revision),
            Compare::lease(holder, CompareOp::Equal, request.hold_lease),
        ]
    }

    /// Best effort: a lease granted for a write that did not happen.
    async fn drop_lease(&self, lease: i64) {
        if let Err(e) = self.force.lease_client().revoke(lease).await {
            warn!(lease, error = %e, "could not revoke an unused force-release lease (it expires by itself)");
        }
    }
}

/// The hold a failed transaction's first `get` read.
fn hold_of(answers: &[TxnOpResponse]) -> Option<Kv> {
    match answers.first() {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| Kv {
            value: kv.value().to_vec(),
            create_revision: kv.create_revision(),
            mod_revision: kv.mod_revision(),
            lease: kv.lease(),
        }),
        _ => None,
    }
}

/// The leadership now, as a failed transaction read the leader record, for
/// the refusal of a request for term `term`. Never a revision (the term's
/// is its leader's token's).
pub fn describe_leader_now(now: Option<&Kv>, term: u64) -> String {
    match now {
        None => "it is vacant now".into(),
        Some(kv) => match decode::<LeadRecord>(&kv.value) {
            Some(r) if r.term() == term => format!(
                "term {term} is still led by {}, but its records moved (an epoch advance, or another request's approval)",
                r.identity
            ),
            Some(r) => format!(
                "now led by {} through session {:#x} in term {} (the request named term {term})",
                r.identity,
                kv.lease,
                r.term(),
            ),
            None => format!("now led by another leadership than term {term}"),
        },
    }
}

/// The hold now, as a failed transaction read it, for the refusal.
pub fn describe_now(now: Option<&Kv>) -> String {
    match now {
        None => "it is not held any more".into(),
        Some(kv) => match decode::<HolderRecord>(&kv.value) {
            // Never the hold's revision: with the epoch it is the holder's
            // fencing token.
            Some(r) => format!(
                "now held by {} through session {:#x} (a newer grant than the request named)",
                r.identity, kv.lease,
            ),
            None => "now held by a newer grant than the request named".into(),
        },
    }
}
