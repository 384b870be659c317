//! The probe that decides quorum loss, and the spool's shipping when
//! quorum returns.

use std::sync::Arc;

use tokio::time::Instant;
use tracing::{info, warn};

use super::QuorumLoss;
use crate::lock_log::LockLog;

impl QuorumLoss {
    /// Starts the probe; it ends when the handle drops.
    pub fn spawn_probe(self: &Arc<Self>, log: Arc<dyn LockLog>) -> tokio_util::task::AbortOnDrop {
        let this = Arc::clone(self);
        let task = tokio::spawn(async move {
            loop {
                let outcome =
                    match tokio::time::timeout(this.config.probe_timeout, log.records()).await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err(format!(
                            "no answer in {} ms",
                            this.config.probe_timeout.as_millis()
                        )),
                    };
                this.observe(outcome).await;
                tokio::time::sleep(this.config.probe_every).await;
            }
        });
        tokio_util::task::AbortOnDrop::new(task.abort_handle())
    }

    /// One probe's outcome.
    async fn observe(&self, outcome: Result<(), String>) {
        match outcome {
            Ok(()) => {
                let was = {
                    let mut probe = self.probe.lock();
                    probe.failures = 0;
                    probe.answered = Some(Instant::now());
                    probe.lost_since.take()
                };
                if let Some(since) = was {
                    info!(
                        lost_for_ms = since.elapsed().as_millis() as u64,
                        "the lock cluster has quorum again: grants go through etcd"
                    );
                }
                if self.spool.open_bytes() > 0 {
                    self.ship().await;
                }
            }
            Err(error) => {
                let mut probe = self.probe.lock();
                probe.failures = probe.failures.saturating_add(1);
                probe.last_error = error;
                if probe.lost_since.is_none() && probe.failures >= self.config.failures_to_lose {
                    probe.lost_since = Some(Instant::now());
                    warn!(
                        failures = probe.failures,
                        error = %probe.last_error,
                        "the lock cluster has LOST QUORUM: closed classes refuse, open classes grant unprotected from memory"
                    );
                }
            }
        }
    }

    /// Closes the open spool into `ready/` (for the audit tailer).
    async fn ship(&self) {
        match self.on_spool(|spool| spool.ship()).await {
            Ok(Ok(Some(path))) => info!(
                path = %path.display(),
                "shipped the quorum-loss spool (unprotected grants) for the audit tailer"
            ),
            Ok(Ok(None)) => {}
            Ok(Err(e)) => warn!(error = %e, "cannot ship the quorum-loss spool; will retry"),
            Err(e) => warn!(error = %e, "the spool shipping task failed; will retry"),
        }
    }

    #[cfg(test)]
    pub(super) async fn observe_for_test(&self, outcome: Result<(), String>) {
        self.observe(outcome).await;
    }

    #[cfg(test)]
    pub(super) fn lose_for_test(&self) {
        self.probe.lock().lost_since = Some(Instant::now());
    }
}
