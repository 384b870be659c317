//! gRPC health checking (`grpc.health.v1`) and server reflection on the
//! arbiter's port, for Envoy's active health checks and for `grpcurl`.
//!
//! - `latchkey.lock.v1.Lock` is SERVING while the arbiter may grant and
//!   NOT_SERVING while it is sealed (a sealed arbiter refuses every grant
//!   until an operator advances the epoch): Envoy's health check on the
//!   `arbiter` cluster names this service.
//! - `latchkey.admin.v1.Admin` and the server as a whole (`""`) stay SERVING
//!   while the process runs: the admin API is how a seal is lifted.
//!
//! Both services answer any caller that completed the mTLS handshake; they
//! carry no lock state beyond "sealed or not", and the edge forwards neither
//! (the filter passes lock.v1 methods only).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::service::Arbiter;

/// The lock service's name as health checks and reflection know it.
pub const LOCK_SERVICE: &str = "latchkey.lock.v1.Lock";
/// The admin service's name.
pub const ADMIN_SERVICE: &str = "latchkey.admin.v1.Admin";
/// How often the seal is looked at (a seal comes from etcd or a check, both
/// slower than this).
const EVERY: Duration = Duration::from_millis(500);

/// The lock service's status for a seal reason (or none).
pub fn lock_status(seal_reason: Option<&str>) -> ServingStatus {
    match seal_reason {
        Some(_) => ServingStatus::NotServing,
        None => ServingStatus::Serving,
    }
}

/// Keeps the lock service's health in step with the seal until `stop`.
pub(crate) fn spawn(
    arbiter: Arc<Arbiter>,
    reporter: HealthReporter,
    stop: CancellationToken,
    tasks: &TaskTracker,
) {
    tasks.spawn(async move {
        reporter
            .set_service_status("", ServingStatus::Serving)
            .await;
        reporter
            .set_service_status(ADMIN_SERVICE, ServingStatus::Serving)
            .await;
        let mut tick = tokio::time::interval(EVERY);
        loop {
            // Sealed if any tier's cluster is: its locks cannot be served.
            let reason = arbiter
                .tiers
                .all()
                .into_iter()
                .find_map(|c| c.table.seal().guard().seal_reason());
            reporter
                .set_service_status(LOCK_SERVICE, lock_status(reason.as_deref()))
                .await;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_arbiter_is_not_serving_locks() {
        assert_eq!(lock_status(None), ServingStatus::Serving);
        assert_eq!(
            lock_status(Some("restored lock log")),
            ServingStatus::NotServing
        );
    }

    #[test]
    fn the_names_are_the_protos() {
        use latchkey_proto::adminv1::admin_server::SERVICE_NAME as ADMIN;
        use latchkey_proto::lockv1::lock_server::SERVICE_NAME as LOCK;
        assert_eq!((LOCK_SERVICE, ADMIN_SERVICE), (LOCK, ADMIN));
    }
}
