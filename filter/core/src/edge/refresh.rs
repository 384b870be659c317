//! The grant-table refresh, on the root context's timer: `on_tick` first
//! adopts a newer table another worker (or an earlier VM) kept in shared
//! data, then asks the arbiter (`GetEdgePolicy`); its answer
//! (`on_grpc_call_response`) is installed, confirmed or refused, and kept in
//! shared data for the next VM. A failed refresh keeps the last good table.

use std::rc::Rc;
use std::time::Duration;

use crate::edge::root::Root;
use crate::edge::vm::Active;
use crate::grant_table::{GrantTable, LastGood, Origin, SaveError, Saved};
use crate::host::{Buffer, Host, LogLevel, now_ms};
use crate::metrics;
use crate::policy::{EDGE_POLICY_METHOD, EDGE_POLICY_SERVICE, EdgePolicy};

/// Delay before the first grant-table refresh after a (re)configure.
pub const FIRST_REFRESH_MS: u64 = 200;
/// Refresh period while a VM has no grant table at all (first start, arbiter
/// not answering): it refuses keyed calls until then, so try more often.
pub const NOT_READY_REFRESH_MS: u64 = 1_000;

/// The last good table in shared data; a store error reads as none (logged).
pub(crate) fn load_last_good(host: &impl Host) -> Option<LastGood> {
    match LastGood::load(host) {
        Ok(stored) => stored,
        Err(e) => {
            host.log(
                LogLevel::Warn,
                &format!("latchkey edge: cannot read the last good grant table: {e}"),
            );
            None
        }
    }
}

impl Root {
    /// The timer: ask the arbiter for the grant table (one call at a time).
    pub fn on_tick(&mut self, host: &impl Host) {
        if self.refresh_in_flight.is_some() {
            return;
        }
        let Some(active) = self.vm.borrow().active.clone() else {
            return;
        };
        let Some(refresh) = &active.config.refresh else {
            return;
        };
        self.adopt_last_good(host, &active);
        let ready = self
            .vm
            .borrow()
            .active
            .as_ref()
            .is_some_and(|a| a.table.policy().is_some());
        let period = if ready {
            refresh.period_ms
        } else {
            refresh.period_ms.min(NOT_READY_REFRESH_MS)
        };
        host.set_tick_period(Duration::from_millis(period));
        match host.dispatch_grpc_call(
            &refresh.cluster,
            EDGE_POLICY_SERVICE,
            EDGE_POLICY_METHOD,
            &[],
            Duration::from_millis(refresh.timeout_ms),
        ) {
            Ok(token) => self.refresh_in_flight = Some(token),
            Err(e) => {
                host.log(
                    LogLevel::Warn,
                    &format!("latchkey edge: cannot dispatch the grant table refresh: {e}"),
                );
                self.count(host, metrics::REFRESH_FAILED);
            }
        }
    }

    /// The arbiter's answer to a refresh (`status_code` 0: `response_size`
    /// bytes of `EdgePolicy` in the gRPC receive buffer).
    pub fn on_grpc_call_response(
        &mut self,
        host: &impl Host,
        token_id: u32,
        status_code: u32,
        response_size: usize,
    ) {
        if self.refresh_in_flight != Some(token_id) {
            return;
        }
        self.refresh_in_flight = None;
        let Some(active) = self.vm.borrow().active.clone() else {
            return;
        };
        let body = if status_code == 0 {
            host.buffer(Buffer::GrpcReceive, 0, response_size)
                .unwrap_or_default()
        } else {
            let (_, message) = host.grpc_status().unwrap_or((status_code, None));
            host.log(
                LogLevel::Warn,
                &format!(
                    "latchkey edge: grant table refresh failed (grpc status {status_code}: {}); keeping version {:016x}",
                    message.unwrap_or_default(),
                    active.table.policy().map(EdgePolicy::version).unwrap_or(0)
                ),
            );
            self.count(host, metrics::REFRESH_FAILED);
            return;
        };
        let now = now_ms(host);
        match EdgePolicy::from_arbiter(&body, active.config.default_max_waiters_per_key) {
            Ok(policy) => {
                self.store_last_good(
                    host,
                    &LastGood {
                        refreshed_at_ms: now,
                        version: policy.version(),
                        message: body,
                    },
                );
                if active.table.policy().is_some_and(|p| policy.same_as(p)) {
                    active.table.confirm(now);
                    self.publish_table(host, &active.table);
                    self.count(host, metrics::REFRESH_UNCHANGED);
                } else {
                    let table =
                        GrantTable::received(&active.config, policy, Origin::Refreshed, now);
                    self.install(host, &active, table);
                    self.count(host, metrics::REFRESH_OK);
                }
            }
            Err(e) => {
                host.log(
                    LogLevel::Warn,
                    &format!(
                        "latchkey edge: refused the arbiter's grant table ({e}); keeping the last good one"
                    ),
                );
                self.count(host, metrics::REFRESH_FAILED);
            }
        }
    }

    fn count(&self, host: &impl Host, name: &str) {
        self.vm.borrow_mut().metrics.add(host, name, 1);
    }

    pub(crate) fn publish_table(&self, host: &impl Host, table: &GrantTable) {
        let stats = &mut self.vm.borrow_mut().metrics;
        if let Some(policy) = table.policy() {
            stats.gauge_set(host, metrics::GRANT_TABLE_VERSION, policy.version());
            stats.gauge_set(
                host,
                metrics::GRANT_TABLE_SIZE,
                policy.grants().len() as u64,
            );
        }
        stats.gauge_set(
            host,
            metrics::GRANT_TABLE_CONFIRMED_AT_S,
            table.confirmed_at_ms() / 1000,
        );
    }

    /// Replaces the VM's table (same configuration and admission).
    fn install(&self, host: &impl Host, active: &Active, table: GrantTable) {
        self.publish_table(host, &table);
        let next = Active {
            config: active.config.clone(),
            table,
            admission: active.admission,
        };
        self.vm.borrow_mut().active = Some(Rc::new(next));
    }

    /// Keeps the arbiter's answer for the next VM (and the other workers).
    fn store_last_good(&self, host: &impl Host, last_good: &LastGood) {
        let result = match last_good.save(host) {
            Ok(Saved::Written) => "written",
            Ok(Saved::NewerKept) => "newer_kept",
            Err(e) => {
                let level = match e {
                    SaveError::TooLarge { .. } => LogLevel::Error,
                    SaveError::Store(_) => LogLevel::Warn,
                };
                host.log(
                    level,
                    &format!(
                        "latchkey edge: the grant table is not kept for the next filter version: {e}"
                    ),
                );
                "failed"
            }
        };
        self.count(host, &metrics::grant_table_store(result));
    }

    /// Takes a table another worker (or an earlier VM) stored if it is newer
    /// than this VM's: workers converge, and a table stays fresh while any
    /// worker's refresh succeeds.
    fn adopt_last_good(&self, host: &impl Host, active: &Active) {
        let Some(stored) = load_last_good(host) else {
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
            self.publish_table(host, &active.table);
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
        self.install(host, active, table);
        self.count(host, metrics::GRANT_TABLE_ADOPTED);
    }
}

#[cfg(test)]
mod tests {
    use latchkey_proto::adminv1::{EdgeClass, EdgeGrant};
    use prost::Message;
    use serde_json::json;

    use super::*;
    use crate::admission::SharedStore;
    use crate::edge::fake::{
        ALICE, BOB, FakeHost, INSPECT, config, configured, inspect, keyed_call,
    };
    use crate::grant_table::LAST_GOOD_ENTRY;
    use crate::host::Action;

    fn arbiter_only() -> serde_json::Value {
        json!({
            "grants": [],
            "refresh": {"cluster": "arbiter_policy", "periodMs": 2000, "timeoutMs": 1000},
        })
    }

    fn answer(version: u64, identity: &str) -> Vec<u8> {
        latchkey_proto::adminv1::EdgePolicy {
            version,
            grants: vec![EdgeGrant {
                identity: identity.into(),
                prefixes: vec!["demo".into()],
            }],
            classes: vec![EdgeClass {
                name: "demo".into(),
                max_waiters_per_key: 4,
            }],
        }
        .encode_to_vec()
    }

    /// Ticks and answers with `message`; the token answered.
    fn refresh(host: &FakeHost, root: &mut Root, message: &[u8]) -> u32 {
        root.on_tick(host);
        let token = host.grpc_calls.borrow().len() as u32;
        *host.grpc_receive.borrow_mut() = message.to_vec();
        root.on_grpc_call_response(host, token, 0, message.len());
        token
    }

    fn decides(host: &FakeHost, root: &Root, peer: &str) -> Option<Action> {
        keyed_call(host, root, peer, INSPECT, &inspect("demo/a")).2
    }

    #[test]
    fn the_timer_asks_the_arbiter_one_call_at_a_time() {
        let (host, mut root) = configured(arbiter_only());
        root.on_tick(&host);
        assert_eq!(
            *host.grpc_calls.borrow(),
            vec![(
                "arbiter_policy".to_owned(),
                EDGE_POLICY_SERVICE.to_owned(),
                EDGE_POLICY_METHOD.to_owned(),
                Duration::from_millis(1000)
            )]
        );
        // No table yet: the next try within a second, not a whole period.
        assert_eq!(
            host.tick_period.get(),
            Some(Duration::from_millis(NOT_READY_REFRESH_MS))
        );
        root.on_tick(&host);
        assert_eq!(host.grpc_calls.borrow().len(), 1);
        // An answer to something else is not the refresh's.
        root.on_grpc_call_response(&host, 99, 0, 0);
        assert_eq!(root.refresh_in_flight, Some(1));
    }

    #[test]
    fn without_a_refresh_the_timer_does_nothing() {
        let (host, mut root) = configured(json!({}));
        root.on_tick(&host);
        assert!(host.grpc_calls.borrow().is_empty());
    }

    #[test]
    fn the_arbiters_table_is_installed_and_kept_for_the_next_vm() {
        let (host, mut root) = configured(arbiter_only());
        assert_eq!(decides(&host, &root, ALICE), Some(Action::Pause));
        refresh(&host, &mut root, &answer(7, ALICE));
        assert_eq!(host.stat(metrics::REFRESH_OK), Some(1));
        assert_eq!(host.stat(metrics::GRANT_TABLE_VERSION), Some(7));
        assert_eq!(
            host.stat("latchkey_edge.grant_table_store.result.written"),
            Some(1)
        );
        assert_eq!(decides(&host, &root, ALICE), Some(Action::Continue));
        assert_eq!(decides(&host, &root, BOB), Some(Action::Pause));
        // The next tick runs at the configured period.
        root.on_tick(&host);
        assert_eq!(host.tick_period.get(), Some(Duration::from_millis(2000)));
        // A VM configured later (an ECDS update) starts from the kept table.
        let stored = LastGood::load(&host).unwrap().unwrap();
        assert_eq!(stored.version, 7);
        *host.plugin_configuration.borrow_mut() = config(arbiter_only());
        let mut next = Root::default();
        assert!(next.on_configure(&host));
        assert_eq!(
            host.stat("latchkey_edge.grant_table_start.result.carried"),
            Some(1)
        );
        assert_eq!(decides(&host, &next, ALICE), Some(Action::Continue));
    }

    #[test]
    fn the_same_table_again_confirms_it() {
        let (host, mut root) = configured(arbiter_only());
        refresh(&host, &mut root, &answer(7, ALICE));
        let before = root.vm().borrow().active.clone().unwrap();
        host.now.set(Duration::from_secs(60));
        refresh(&host, &mut root, &answer(7, ALICE));
        assert_eq!(host.stat(metrics::REFRESH_UNCHANGED), Some(1));
        let after = root.vm().borrow().active.clone().unwrap();
        assert!(Rc::ptr_eq(&before, &after));
        assert_eq!(after.table.confirmed_at_ms(), 60_000);
        assert_eq!(host.stat(metrics::GRANT_TABLE_CONFIRMED_AT_S), Some(60));
    }

    #[test]
    fn a_failed_or_refused_answer_keeps_the_last_good_table() {
        let (host, mut root) = configured(arbiter_only());
        refresh(&host, &mut root, &answer(7, ALICE));
        root.on_tick(&host);
        *host.grpc_status.borrow_mut() = Some((14, Some("no healthy upstream".into())));
        root.on_grpc_call_response(&host, 2, 14, 0);
        assert!(host.logged(
            LogLevel::Warn,
            "grant table refresh failed (grpc status 14: no healthy upstream); keeping version 0000000000000007"
        ));
        refresh(&host, &mut root, b"\xff\xff not a message");
        assert!(host.logged(LogLevel::Warn, "refused the arbiter's grant table"));
        assert_eq!(host.stat(metrics::REFRESH_FAILED), Some(2));
        assert_eq!(host.stat(metrics::GRANT_TABLE_VERSION), Some(7));
        assert_eq!(decides(&host, &root, ALICE), Some(Action::Continue));
    }

    #[test]
    fn a_refresh_that_cannot_be_dispatched_is_counted() {
        let (host, mut root) = configured(arbiter_only());
        host.fail_dispatch.set(true);
        root.on_tick(&host);
        assert_eq!(host.stat(metrics::REFRESH_FAILED), Some(1));
        assert!(host.logged(
            LogLevel::Warn,
            "cannot dispatch the grant table refresh: BadArgument"
        ));
        assert_eq!(root.refresh_in_flight, None);
    }

    #[test]
    fn a_worker_adopts_a_newer_table_another_worker_kept() {
        // Two workers of one Envoy: one host (shared data), two VMs.
        let (host, mut first) = configured(arbiter_only());
        *host.plugin_configuration.borrow_mut() = config(arbiter_only());
        let mut second = Root::default();
        assert!(second.on_configure(&host));
        host.now.set(Duration::from_secs(10));
        refresh(&host, &mut first, &answer(7, ALICE));
        assert_eq!(decides(&host, &second, ALICE), Some(Action::Pause));
        second.on_tick(&host);
        assert_eq!(host.stat(metrics::GRANT_TABLE_ADOPTED), Some(1));
        assert_eq!(decides(&host, &second, ALICE), Some(Action::Continue));
        // Kept again later by the first worker, same version: a confirmation.
        host.now.set(Duration::from_secs(20));
        refresh(&host, &mut first, &answer(7, ALICE));
        second.refresh_in_flight = None;
        second.on_tick(&host);
        assert_eq!(host.stat(metrics::GRANT_TABLE_ADOPTED), Some(1));
        let vm = second.vm().borrow();
        assert_eq!(vm.active.as_ref().unwrap().table.confirmed_at_ms(), 20_000);
        assert!(host.shared.get(LAST_GOOD_ENTRY).unwrap().0.is_some());
    }
}
