//! The grant table refresh: `on_tick` asks the arbiter (`GetEdgePolicy`),
//! first adopting a newer table another worker stored; the answer
//! (`on_grpc_call_response`) is installed, confirmed or refused, and kept in
//! shared data for the next VM.

use std::time::Duration;

use latchkey_filter_core::grant_table::{GrantTable, LastGood, Origin, SaveError, Saved};
use latchkey_filter_core::metrics;
use latchkey_filter_core::policy::{EDGE_POLICY_METHOD, EDGE_POLICY_SERVICE, EdgePolicy};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel};

use crate::host_store::HostStore;
use crate::root::EdgeRoot;
use crate::vm::{Active, load_last_good, log, now_ms};
use std::rc::Rc;

/// Delay before the first grant-table refresh after a (re)configure.
pub(crate) const FIRST_REFRESH_MS: u64 = 200;
/// Refresh period while a VM has no grant table at all (first start, arbiter
/// not answering): it refuses keyed calls until then, so try more often.
pub(crate) const NOT_READY_REFRESH_MS: u64 = 1_000;

impl EdgeRoot {
    pub(crate) fn publish_table(&self, table: &GrantTable) {
        let mut st = self.state.borrow_mut();
        if let Some(policy) = table.policy() {
            st.metrics
                .gauge_set(metrics::GRANT_TABLE_VERSION, policy.version());
            st.metrics
                .gauge_set(metrics::GRANT_TABLE_SIZE, policy.grants().len() as u64);
        }
        st.metrics.gauge_set(
            metrics::GRANT_TABLE_CONFIRMED_AT_S,
            table.confirmed_at_ms() / 1000,
        );
    }

    /// Replaces the VM's table (same configuration and admission).
    fn install(&self, active: &Active, table: GrantTable) {
        self.publish_table(&table);
        let next = Active {
            config: active.config.clone(),
            table,
            admission: active.admission,
        };
        self.state.borrow_mut().active = Some(Rc::new(next));
    }

    /// Keeps the arbiter's answer for the next VM (and the other workers).
    fn store_last_good(&self, last_good: &LastGood) {
        let result = match last_good.save(&HostStore) {
            Ok(Saved::Written) => "written",
            Ok(Saved::NewerKept) => "newer_kept",
            Err(e) => {
                let level = match e {
                    SaveError::TooLarge { .. } => LogLevel::Error,
                    SaveError::Store(_) => LogLevel::Warn,
                };
                log(
                    level,
                    &format!(
                        "latchkey edge: the grant table is not kept for the next filter version: {e}"
                    ),
                );
                "failed"
            }
        };
        self.state
            .borrow_mut()
            .metrics
            .add(&metrics::grant_table_store(result), 1);
    }

    /// Takes a table another worker (or an earlier VM) stored if it is newer
    /// than this VM's: workers converge, and a table stays fresh while any
    /// worker's refresh succeeds.
    fn adopt_last_good(&self, active: &Active) {
        let Some(stored) = load_last_good() else {
            return;
        };
        if stored.refreshed_at_ms <= active.table.confirmed_at_ms() {
            return;
        }
        if active
            .table
            .policy()
            .is_some_and(|p| p.version() == stored.version)
        {
            active.table.confirm(stored.refreshed_at_ms);
            self.publish_table(&active.table);
            return;
        }
        let Ok(policy) =
            EdgePolicy::from_arbiter(&stored.message, active.config.default_max_waiters_per_key)
        else {
            return;
        };
        let table = GrantTable::received(
            &active.config,
            policy,
            Origin::Carried,
            stored.refreshed_at_ms,
        );
        self.install(active, table);
        self.state
            .borrow_mut()
            .metrics
            .add(metrics::GRANT_TABLE_ADOPTED, 1);
    }
}

impl EdgeRoot {
    pub(crate) fn refresh_answered(
        &mut self,
        token_id: u32,
        status_code: u32,
        response_size: usize,
    ) {
        if self.refresh_in_flight != Some(token_id) {
            return;
        }
        self.refresh_in_flight = None;
        let Some(active) = self.state.borrow().active.clone() else {
            return;
        };
        let body = if status_code == 0 {
            hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, response_size)
                .ok()
                .flatten()
                .unwrap_or_default()
        } else {
            let (_, message) = hostcalls::get_grpc_status().unwrap_or((status_code, None));
            log(
                LogLevel::Warn,
                &format!(
                    "latchkey edge: grant table refresh failed (grpc status {status_code}: {}); keeping version {:016x}",
                    message.unwrap_or_default(),
                    active.table.policy().map(EdgePolicy::version).unwrap_or(0)
                ),
            );
            self.state
                .borrow_mut()
                .metrics
                .add(metrics::REFRESH_FAILED, 1);
            return;
        };
        let now = now_ms();
        match EdgePolicy::from_arbiter(&body, active.config.default_max_waiters_per_key) {
            Ok(policy) => {
                self.store_last_good(&LastGood {
                    refreshed_at_ms: now,
                    version: policy.version(),
                    message: body,
                });
                if active.table.policy().is_some_and(|p| policy.same_as(p)) {
                    active.table.confirm(now);
                    self.publish_table(&active.table);
                    self.state
                        .borrow_mut()
                        .metrics
                        .add(metrics::REFRESH_UNCHANGED, 1);
                } else {
                    let table =
                        GrantTable::received(&active.config, policy, Origin::Refreshed, now);
                    self.install(&active, table);
                    self.state.borrow_mut().metrics.add(metrics::REFRESH_OK, 1);
                }
            }
            Err(e) => {
                log(
                    LogLevel::Warn,
                    &format!(
                        "latchkey edge: refused the arbiter's grant table ({e}); keeping the last good one"
                    ),
                );
                self.state
                    .borrow_mut()
                    .metrics
                    .add(metrics::REFRESH_FAILED, 1);
            }
        }
    }

    pub(crate) fn tick(&mut self) {
        if self.refresh_in_flight.is_some() {
            return;
        }
        let Some(active) = self.state.borrow().active.clone() else {
            return;
        };
        let Some(refresh) = &active.config.refresh else {
            return;
        };
        self.adopt_last_good(&active);
        let ready = self
            .state
            .borrow()
            .active
            .as_ref()
            .is_some_and(|a| a.table.policy().is_some());
        let period = if ready {
            refresh.period_ms
        } else {
            refresh.period_ms.min(NOT_READY_REFRESH_MS)
        };
        let _ = hostcalls::set_tick_period(Duration::from_millis(period));
        match hostcalls::dispatch_grpc_call(
            &refresh.cluster,
            EDGE_POLICY_SERVICE,
            EDGE_POLICY_METHOD,
            Vec::new(),
            Some(&[]),
            Duration::from_millis(refresh.timeout_ms),
        ) {
            Ok(token) => self.refresh_in_flight = Some(token),
            Err(e) => {
                log(
                    LogLevel::Warn,
                    &format!("latchkey edge: cannot dispatch the grant table refresh: {e:?}"),
                );
                self.state
                    .borrow_mut()
                    .metrics
                    .add(metrics::REFRESH_FAILED, 1);
            }
        }
    }
}
