use std::time::Duration;

use latchkey_proto::lockv1::{ReleaseRequest, ReleaseResponse};
use tonic::Request;
use tracing::field::Empty;
use tracing::{Instrument as _, debug};

use super::{Arbiter, session_id};
use crate::error::ArbiterError;
use crate::metrics::Scope;
use crate::records::now_unix_ms;
use crate::table::Released;

impl Arbiter {
    /// Releases a hold of the caller's: its record must name the caller's
    /// identity and session, on that session's lease, at the token's
    /// revision (checked on a read, then compared again in the transaction
    /// that writes). With a waiter queued here, the key is handed to it in
    /// the same transaction (one etcd commit per contended handoff).
    /// Another identity's hold is `NOT_HELD`, as if there were none.
    pub async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<ReleaseResponse, ArbiterError> {
        let mut scope = Scope::default();
        // ADR-22: namespace and class only (telemetry.rs).
        let span = tracing::trace_span!(
            target: crate::telemetry::TARGET,
            "lock.release",
            namespace = Empty,
            class = Empty,
            handed_over = Empty,
            released = Empty,
        );
        crate::telemetry::adopt_parent(&span, request.metadata());
        let result = self
            .release_in(request, &mut scope)
            .instrument(span.clone())
            .await;
        let (handed_over, held_for) = match &result {
            Ok(released) => {
                let previous = released.previous.as_ref();
                if let Some(record) = previous {
                    scope.class(&record.class);
                }
                (
                    released.handed_over,
                    previous.map(|r| held_for(r.acquired_at_unix_ms, now_unix_ms())),
                )
            }
            Err(_) => (false, None),
        };
        if !span.is_disabled() {
            let (namespace, class) = scope.labels();
            span.record("namespace", namespace);
            span.record("class", class);
            span.record("handed_over", handed_over);
            span.record("released", result.is_ok());
        }
        self.metrics.release(&scope, &result, handed_over, held_for);
        result.map(|_| ReleaseResponse {})
    }

    async fn release_in(
        &self,
        request: Request<ReleaseRequest>,
        scope: &mut Scope,
    ) -> Result<Released, ArbiterError> {
        let caller = self.caller(&request)?;
        let req = request.into_inner();
        let policies = self.policies.current();
        let key = self.authorised_key_in(&policies, &caller, &req.key, scope)?;
        let session = session_id(req.session_id)?;
        let shared = match latchkey_proto::lockv1::Mode::try_from(req.mode) {
            Ok(latchkey_proto::lockv1::Mode::Exclusive) => false,
            Ok(latchkey_proto::lockv1::Mode::Shared) => true,
            Err(_) => {
                return Err(ArbiterError::BadRequest(format!(
                    "unknown mode {}: release with the mode the grant returned",
                    req.mode
                )));
            }
        };
        if shared && req.slot.is_some() {
            return Err(ArbiterError::BadRequest(
                "a shared hold has no slot: release it with mode MODE_SHARED alone".into(),
            ));
        }
        // A semaphore's grant is held on its slot's key, a shared hold on
        // the session's reader key.
        let held = match req.slot {
            None if shared => crate::records::reader_key(key.as_str(), session),
            None => key.as_str().to_string(),
            Some(slot) if slot < latchkey_policies::MAX_PERMITS => {
                crate::records::slot_key(key.as_str(), slot)
            }
            Some(slot) => {
                return Err(ArbiterError::BadSlot(format!(
                    "slot {slot} is above every semaphore's permits (at most {}): release with the slot the grant returned",
                    latchkey_policies::MAX_PERMITS
                )));
            }
        };
        // The key's cluster (ADR-07): a hold is only ever there.
        let cluster = self.tiers.for_key(&key).await?;
        let released = cluster
            .owner
            .release(&caller.identity, &held, session, req.token)
            .await;
        let ended = match released {
            Err(not_held @ ArbiterError::NotHeld { .. })
                if req.slot.is_none() && !shared && any_semaphore(&policies) =>
            {
                let slot = cluster
                    .table
                    .own_slot(key.as_str(), &caller.identity, session, req.token)
                    .await;
                // Found nothing, or could not look: the answer is the one
                // any hold not the caller's gets.
                let Ok(Some(slot)) = slot else {
                    return Err(not_held);
                };
                // A semaphore's grant released without its slot (a client
                // from before slots, `latchctl release` without --slot): the
                // token names the caller's slot (its revision is the slot's
                // grant), so that slot is released rather than left held for
                // the session's life.
                cluster
                    .owner
                    .release(&caller.identity, &slot, session, req.token)
                    .await?
            }
            // A refusal names the key as the caller did, never a shared
            // hold's own key (the hostile review).
            Err(ArbiterError::NotHeld { session, .. }) if shared => {
                return Err(ArbiterError::NotHeld {
                    key: key.as_str().to_string(),
                    session,
                });
            }
            Err(ArbiterError::TokenMismatch { .. }) if shared => {
                return Err(ArbiterError::TokenMismatch {
                    key: key.as_str().to_string(),
                });
            }
            other => other?,
        };
        let released = ended.released;
        if ended.from_memory {
            return Ok(released);
        }
        debug!(identity = %caller.identity, key = %key.as_str(), handed_over = released.handed_over, "released");
        self.hooks
            .after_release(&caller.identity, key.as_str())
            .instrument(tracing::trace_span!(
                target: crate::telemetry::TARGET,
                "hook.after_release"
            ))
            .await;
        Ok(released)
    }
}

/// Whether the policies have a semaphore class (else a release naming no
/// slot never looks for one).
fn any_semaphore(policies: &latchkey_policies::PolicySet) -> bool {
    policies
        .classes()
        .values()
        .any(|c| c.kind == latchkey_policies::ClassKind::Semaphore)
}

/// How long a hold lasted, by wall clocks (the granting arbiter's and ours):
/// zero if they disagree the wrong way.
fn held_for(acquired_at_unix_ms: i64, now_unix_ms: i64) -> Duration {
    let ms = now_unix_ms.saturating_sub(acquired_at_unix_ms).max(0);
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
