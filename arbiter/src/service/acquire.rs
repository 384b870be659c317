use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use latchkey_proto::lockv1::{AcquireRequest, AcquireResponse, Grant as WireGrant, Mode, WaitMode};
use tonic::Request;
use tracing::field::Empty;
use tracing::{Instrument as _, debug};

use super::{Arbiter, session_id, truncate};
use crate::error::ArbiterError;
use crate::hook::{HolderSummary, HookDecision, HookInput, monotonic_ns};
use crate::metrics::Scope;
use crate::owner::{Granted, Terms};
use crate::records::now_unix_ms;
use crate::table::{Grant, GrantRequest};
use latchkey_policies::{HookInputKind, OnQuorumLoss};

pub const MAX_METADATA_ENTRIES: usize = 16;
pub const MAX_METADATA_KEY_BYTES: usize = 64;
pub const MAX_METADATA_VALUE_BYTES: usize = 256;

/// Answer a little before the caller's deadline, so it hears WAIT_TIMEOUT
/// from us rather than a bare DEADLINE_EXCEEDED from its own stack.
const DEADLINE_MARGIN: Duration = Duration::from_millis(50);

/// How long an Acquire (an OpenSession) that reaches an arbiter still
/// counting the holds (the sessions) in the lock log waits for the count
/// before it is refused with UNAVAILABLE: the count is a paginated range
/// read, normally milliseconds.
const FIRST_COUNT_WAIT: Duration = Duration::from_secs(5);

/// How long `request` may wait for a count to be in: [`FIRST_COUNT_WAIT`],
/// or less to answer within the caller's deadline.
pub(super) fn count_wait<T>(request: &Request<T>) -> Duration {
    time_left(request).map_or(FIRST_COUNT_WAIT, |d| {
        FIRST_COUNT_WAIT.min(d.saturating_sub(DEADLINE_MARGIN))
    })
}

/// When a call reached the arbiter, before it queued for a place
/// ([`crate::overload`]): put in the request's extensions by the service.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arrived(pub(crate) tokio::time::Instant);

/// The call's deadline as it stands now: its `grpc-timeout` less the time
/// since it arrived (a call that queued for a place under overload has
/// that much less left to wait for its key).
pub(crate) fn time_left<T>(request: &Request<T>) -> Option<Duration> {
    let timeout = grpc_timeout(request)?;
    let spent = request
        .extensions()
        .get::<Arrived>()
        .map_or(Duration::ZERO, |a| a.0.elapsed());
    Some(timeout.saturating_sub(spent))
}

/// The call's deadline from the `grpc-timeout` header ("<digits><unit>").
pub fn grpc_timeout<T>(request: &Request<T>) -> Option<Duration> {
    let raw = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = raw.split_at(raw.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), ArbiterError> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(ArbiterError::BadRequest(format!(
            "at most {MAX_METADATA_ENTRIES} metadata entries are accepted"
        )));
    }
    for (k, v) in metadata {
        // Printable as for any text another person reads (a hook may copy
        // metadata into an annotation that `latchctl inspect` shows).
        let unprintable = |s: &str| !s.chars().all(latchkey_proto::text::printable);
        if k.is_empty() || k.len() > MAX_METADATA_KEY_BYTES || unprintable(k) {
            return Err(ArbiterError::BadRequest(format!(
                "metadata key {:?} must be 1..={MAX_METADATA_KEY_BYTES} bytes of printable text",
                truncate(k, 32)
            )));
        }
        if v.len() > MAX_METADATA_VALUE_BYTES || unprintable(v) {
            return Err(ArbiterError::BadRequest(format!(
                "metadata value for {:?} must be at most {MAX_METADATA_VALUE_BYTES} bytes of printable text",
                truncate(k, 32)
            )));
        }
    }
    Ok(())
}

/// Longest client instance name (`AcquireRequest.instance`): a pod name as
/// Kubernetes makes them for Deployments (a DNS label, 63 bytes) and a
/// process id, with room to spare.
pub const MAX_INSTANCE_BYTES: usize = 128;

/// The client instance a call names, checked: empty, or one line of at most
/// [`MAX_INSTANCE_BYTES`] printable bytes (it is stored in the holder record
/// and shown by `why`, the console and the audit trail).
pub(super) fn checked_instance(instance: &str) -> Result<String, ArbiterError> {
    if instance.is_empty() {
        return Ok(String::new());
    }
    latchkey_proto::text::checked(instance, "the client instance", MAX_INSTANCE_BYTES)
        .map(str::to_string)
        .map_err(ArbiterError::BadRequest)
}

pub(crate) fn wire_grant(grant: &Grant) -> Result<WireGrant, ArbiterError> {
    let token = grant.token().ok_or_else(|| {
        ArbiterError::internal("the epoch or revision is outside the token range")
    })?;
    // A semaphore's grant is held on a slot's own key, a shared hold on
    // the session's reader key: the caller hears the name it asked for,
    // and the slot or the mode.
    let (key, slot, mode) = match crate::records::hold_kind(&grant.key) {
        (crate::records::HoldKind::Slot, name) => (
            name.to_string(),
            crate::records::split_slot(&grant.key).map(|(_, slot)| slot),
            Mode::Exclusive,
        ),
        (crate::records::HoldKind::Shared, name) => (name.to_string(), None, Mode::Shared),
        (crate::records::HoldKind::Exclusive, _) => (grant.key.clone(), None, Mode::Exclusive),
    };
    Ok(WireGrant {
        key,
        token,
        epoch: grant.epoch,
        revision: grant.revision,
        session_id: grant.session,
        unprotected: false,
        slot,
        mode: mode.into(),
        // The class's, set by the handler that knows it.
        permits: None,
    })
}

/// A grant from the arbiter's memory during quorum loss (ADR-04): token 0,
/// no epoch or revision, marked unprotected.
fn wire_memory_grant(grant: &crate::owner::MemoryGrant) -> WireGrant {
    WireGrant {
        key: grant.key.clone(),
        token: 0,
        epoch: 0,
        revision: 0,
        session_id: grant.session,
        unprotected: true,
        slot: None,
        mode: Mode::Exclusive.into(),
        permits: None,
    }
}

impl Arbiter {
    /// Holds of `identity` counted on the other clusters than `cluster`:
    /// the per-identity bound on holds is over every cluster.
    pub(crate) fn holds_elsewhere(&self, cluster: &crate::tiers::Cluster, identity: &str) -> u32 {
        self.tiers
            .all()
            .into_iter()
            .filter(|c| !std::ptr::eq(c.as_ref(), cluster))
            .map(|c| c.holds.held(identity).unwrap_or(0))
            .sum()
    }

    /// Validate, authorise, ask the class hook, then grant (one transaction)
    /// or queue FIFO behind this key's other waiters until the deadline.
    pub async fn acquire(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<AcquireResponse, ArbiterError> {
        let started = Instant::now();
        let mut scope = Scope::default();
        // ADR-22: namespace and class only (telemetry.rs).
        let span = tracing::trace_span!(
            target: crate::telemetry::TARGET,
            "lock.acquire",
            namespace = Empty,
            class = Empty,
            waited = Empty,
            granted = Empty,
        );
        crate::telemetry::adopt_parent(&span, request.metadata());
        let result = self
            .acquire_in(request, &mut scope)
            .instrument(span.clone())
            .await;
        if !span.is_disabled() {
            let (namespace, class) = scope.labels();
            span.record("namespace", namespace);
            span.record("class", class);
            span.record("waited", scope.waited);
            span.record("granted", result.is_ok());
        }
        self.metrics.acquire(&scope, &result, started.elapsed());
        result
    }

    async fn acquire_in(
        &self,
        request: Request<AcquireRequest>,
        scope: &mut Scope,
    ) -> Result<AcquireResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let deadline = time_left(&request);
        let count_wait = count_wait(&request);
        let req = request.into_inner();
        let policies = self.policies.current();
        let key = self.authorised_key_in(&policies, &caller, &req.key, scope)?;
        // The grant subject the caller is bounded as: itself, or the
        // pattern its per-pod identity falls under (issue 30).
        let subject = policies
            .grants()
            .subject(&caller.identity)
            .unwrap_or(&caller.identity)
            .to_string();
        let class = self.granted_class(&policies, &caller, &key, &req.class)?;
        scope.class(&class.name);
        if class.kind == latchkey_policies::ClassKind::Election {
            return Err(ArbiterError::WrongKind {
                class: super::truncate(&class.name, 64),
                kind: "election",
                wanted: "lock",
                call: "Acquire",
            });
        }
        let session = session_id(req.session_id)?;
        let Modes {
            wait,
            shared,
            downgrade_from,
        } = modes(&req, class)?;
        let metadata: BTreeMap<String, String> = req.metadata.into_iter().collect();
        check_metadata(&metadata)?;
        let instance = checked_instance(&req.instance)?;
        // ADR-07: the key's tier decides the cluster; a class or a session
        // of the other tier is refused.
        let route = self
            .tiers
            .for_acquire(&policies, &key, class, session)
            .await?;
        let cluster = &route.cluster;
        let terms = Terms {
            class: &class.name,
            open_on_loss: class.on_quorum_loss == OnQuorumLoss::Open,
            durable: class.fairness == latchkey_policies::Fairness::Durable,
            max_waiters_per_key: class.max_waiters_per_key,
            shared,
            max_hold: class
                .max_hold_seconds
                .map(|max| Duration::from_secs(u64::from(max))),
        };
        // Bounded before anything else is spent on the call (a hook, a
        // queue place); refused if the class cannot be served now. A
        // downgrade adds no hold (it turns one into another): not counted.
        let admission = match downgrade_from {
            Some(_) => None,
            None => Some(
                cluster
                    .owner
                    .admit(
                        &subject,
                        key.as_str(),
                        self.holds_elsewhere(cluster, &subject),
                        count_wait,
                        &terms,
                    )
                    .await
                    .inspect_err(|e| {
                        if matches!(e, ArbiterError::IdentityLimit { .. }) {
                            self.metrics.identity_bound_refused("holds");
                        }
                    })?,
            ),
        };
        // A downgrade asked again after it landed (its answer lost) is
        // answered with the hold it made, before the hooks: the hold is the
        // session's already, and a hook that says no now (or cannot be
        // reached) must not leave the client unable to learn of it.
        // Neither a repeat nor the session's exclusive hold at that token:
        // NOT_HELD before the hooks, with nothing written (a client's
        // clean-up asks again after its hold ended; no hook decides that).
        let repeated = match downgrade_from {
            Some(token) => {
                cluster
                    .owner
                    .downgrade_asked(&caller.identity, key.as_str(), session, token, &terms)
                    .await?
            }
            None => None,
        };

        // A repeat asks no hook at all (the hold is the session's already).
        let annotations = match repeated {
            Some(_) => Default::default(),
            None => {
                self.before_grant(
                    HookCall {
                        cluster,
                        policies: &policies,
                        identity: &caller.identity,
                        subject: &subject,
                        key: key.as_str(),
                        class,
                        session,
                        metadata: &metadata,
                        shared,
                    },
                    scope,
                )
                .await?
            }
        };
        let grant_req = GrantRequest {
            key: key.as_str().to_string(),
            identity: caller.identity.clone(),
            session,
            class: class.name.clone(),
            ttl_seconds: class.ttl_seconds,
            annotations,
            instance,
            bound: match subject == caller.identity {
                true => String::new(),
                false => subject,
            },
            routed_by: route.map_version,
            quota: class.max_holds_per_subject,
            permits: match class.kind {
                latchkey_policies::ClassKind::Semaphore => class.permits,
                _ => None,
            },
            shared,
        };

        let wait = match wait {
            WaitMode::WaitNone => None,
            _ => Some(
                deadline
                    .map(|d| d.saturating_sub(DEADLINE_MARGIN.min(d / 20)))
                    .unwrap_or(self.max_wait)
                    .min(self.max_wait),
            ),
        };
        // ADR-09: a key homed on another shard than the session's cluster
        // is held on the session's shadow there, made once every check has
        // passed (a refused Acquire writes no shadow; a memory grant none).
        let shadow = async {
            match &route.other_shard {
                Some(shard) => {
                    self.ensure_shadow(cluster, shard, &caller.identity, session)
                        .await
                }
                None => Ok(()),
            }
        };
        let granted = match (repeated, downgrade_from, admission) {
            (Some(grant), ..) => Ok(crate::owner::Granted::Log {
                grant,
                waited: false,
            }),
            (None, Some(token), _) => cluster.owner.downgrade(grant_req, token, &terms).await,
            (None, None, Some(admission)) => {
                cluster
                    .owner
                    .acquire(admission, grant_req, wait, &terms, shadow)
                    .await
            }
            (None, None, None) => Err(ArbiterError::internal(
                "an Acquire that is no downgrade was not admitted",
            )),
        };
        let granted = granted.inspect_err(|e| match e {
            ArbiterError::TooManyWaiters { .. } => {
                self.metrics.identity_bound_refused("waiters");
            }
            ArbiterError::WaitTimeout { .. } => scope.waited = true,
            _ => {}
        })?;
        let (grant, waited) = match granted {
            Granted::Memory(memory) => {
                return Ok(AcquireResponse {
                    grant: Some(wire_memory_grant(&memory)),
                });
            }
            Granted::Log { grant, waited } => (grant, waited),
        };
        scope.waited = waited;
        // Per call: DEBUG (issue 31: INFO is for what an operator acts on;
        // the metrics count grants).
        debug!(identity = %caller.identity, key = %grant.key, class = %class.name, waited, "granted");
        let mut wire = wire_grant(&grant)?;
        if wire.slot.is_some() {
            wire.permits = class.permits;
        }
        Ok(AcquireResponse { grant: Some(wire) })
    }

    /// The class's hook on an Acquire: its annotations for the hold, or
    /// its refusal. Inputs that cost an etcd read are fetched only for a
    /// hook that asks for them.
    async fn before_grant(
        &self,
        call: HookCall<'_>,
        scope: &Scope,
    ) -> Result<BTreeMap<String, String>, ArbiterError> {
        let HookCall {
            cluster,
            policies,
            identity,
            subject,
            key,
            class,
            session,
            metadata,
            shared,
        } = call;
        let waiting = cluster.owner.waiting(key);
        let hook = class.hook.as_ref();
        let holder = match hook.filter(|h| h.needs(HookInputKind::Holder)) {
            Some(_) => cluster.owner.holder(key).await?.map(|h| HolderSummary {
                identity: h.record.identity,
                session: h.record.session,
                class: h.record.class,
                acquired_at_unix_ms: h.record.acquired_at_unix_ms,
            }),
            None => None,
        };
        let hold_count = match hook.filter(|h| h.needs(HookInputKind::HoldCount)) {
            Some(_) => {
                let prefixes: Vec<&str> = policies.grants().prefixes(identity).collect();
                Some(
                    cluster
                        .owner
                        .count_holds_of(subject, &class.name, &prefixes)
                        .await?,
                )
            }
            None => None,
        };
        let decision = self
            .hooks
            .before_grant(&HookInput {
                identity,
                key,
                class: &class.name,
                session,
                metadata,
                waiters: waiting,
                now_unix_ms: now_unix_ms(),
                now_monotonic_ns: monotonic_ns(),
                hook,
                holder,
                hold_count,
                shared,
                permits: match class.kind {
                    latchkey_policies::ClassKind::Semaphore => class.permits,
                    _ => None,
                },
            })
            .instrument(tracing::trace_span!(
                target: crate::telemetry::TARGET,
                "hook.before_grant",
                class = %scope.labels().1,
            ))
            .await;
        match decision {
            HookDecision::Allow { annotations } => Ok(annotations),
            HookDecision::Deny {
                code,
                reason,
                message,
            } => Err(ArbiterError::HookDenied {
                code,
                reason_code: reason,
                message,
            }),
        }
    }
}

/// What the class's hook is asked about an Acquire.
struct HookCall<'a> {
    cluster: &'a crate::tiers::Cluster,
    policies: &'a latchkey_policies::PolicySet,
    identity: &'a str,
    /// The grant subject the caller is bounded as.
    subject: &'a str,
    key: &'a str,
    class: &'a latchkey_policies::LockClass,
    session: i64,
    metadata: &'a BTreeMap<String, String>,
    shared: bool,
}

/// How an Acquire asks: its wait mode, whether it asks a shared hold, and
/// the exclusive hold a downgrade names.
struct Modes {
    wait: WaitMode,
    shared: bool,
    downgrade_from: Option<u64>,
}

/// The request's modes, checked against each other and the class.
fn modes(
    req: &AcquireRequest,
    class: &latchkey_policies::LockClass,
) -> Result<Modes, ArbiterError> {
    let wait = WaitMode::try_from(req.wait)
        .map_err(|_| ArbiterError::BadRequest(format!("unknown wait mode {}", req.wait)))?;
    let shared = match Mode::try_from(req.mode) {
        Ok(Mode::Exclusive) => false,
        Ok(Mode::Shared) => true,
        Err(_) => {
            return Err(ArbiterError::BadRequest(format!(
                "unknown mode {}: MODE_EXCLUSIVE (0) or MODE_SHARED (1)",
                req.mode
            )));
        }
    };
    // A downgrade turns the session's exclusive hold shared: it names
    // that hold's token and asks for the shared mode.
    let downgrade_from = req.downgrade_from;
    if downgrade_from.is_some() && !shared {
        return Err(ArbiterError::BadRequest(
            "downgrade_from names the exclusive hold a downgrade turns shared: send it with mode MODE_SHARED".to_string(),
        ));
    }
    if shared && class.kind == latchkey_policies::ClassKind::Semaphore {
        return Err(ArbiterError::BadRequest(format!(
            "class {:?} is a semaphore, whose permits are held one per slot: acquire it in mode MODE_EXCLUSIVE",
            super::truncate(&class.name, 64)
        )));
    }
    Ok(Modes {
        wait,
        shared,
        downgrade_from,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_grpc_timeout() {
        let mut r = Request::new(());
        assert_eq!(grpc_timeout(&r), None);
        r.metadata_mut().insert(
            "grpc-timeout",
            "1500m".parse().unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(grpc_timeout(&r), Some(Duration::from_millis(1500)));
        r.metadata_mut().insert(
            "grpc-timeout",
            "2S".parse().unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(grpc_timeout(&r), Some(Duration::from_secs(2)));
    }

    #[tokio::test(start_paused = true)]
    async fn the_time_spent_queueing_is_taken_from_the_wait() {
        let mut r = Request::new(());
        r.metadata_mut().insert(
            "grpc-timeout",
            "1000m".parse().unwrap_or_else(|_| unreachable!()),
        );
        assert_eq!(time_left(&r), Some(Duration::from_millis(1000)));
        r.extensions_mut()
            .insert(Arrived(tokio::time::Instant::now()));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(time_left(&r), Some(Duration::from_millis(700)));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(time_left(&r), Some(Duration::ZERO));
        assert_eq!(count_wait(&r), Duration::ZERO);
    }

    #[test]
    fn metadata_is_bounded() {
        let mut m = BTreeMap::new();
        m.insert("ticket".to_string(), "CHG-1".to_string());
        assert!(check_metadata(&m).is_ok());
        m.insert("x".into(), "a\nb".into());
        assert!(check_metadata(&m).is_err());
    }
}
