//! `on_configure`: the plugin configuration (from the ECDS resource), the
//! admission secret and slots, and the grant table a new VM starts with.

use std::rc::Rc;
use std::time::Duration;

use crate::admission::{Admission, shared_secret};
use crate::config::FilterConfig;
use crate::edge::refresh::{FIRST_REFRESH_MS, load_last_good};
use crate::edge::root::Root;
use crate::edge::vm::Active;
use crate::grant_table::{GrantTable, Origin};
use crate::host::{Buffer, Host, LogLevel, now_ms};
use crate::keyed_hash::AdmissionSecret;
use crate::metrics;
use crate::status::DenyReason;

impl Root {
    /// Takes the plugin configuration, or refuses it (`false`: Envoy keeps
    /// the filter it had, or has none).
    pub fn on_configure(&mut self, host: &impl Host) -> bool {
        let raw = host
            .buffer(Buffer::PluginConfiguration, 0, usize::MAX)
            .unwrap_or_default();
        let (config, policy) = match FilterConfig::parse_reporting_deprecated(&raw) {
            Ok((config, policy, deprecated)) => {
                if !deprecated.is_empty() {
                    host.log(
                        LogLevel::Warn,
                        &format!(
                            "latchkey edge: deprecated snake_case configuration names {}: \
                             write them in camelCase (e.g. trustDomain, refresh.periodMs)",
                            deprecated.join(", ")
                        ),
                    );
                }
                (config, policy)
            }
            Err(e) => {
                host.log(
                    LogLevel::Error,
                    &format!("latchkey edge: configuration refused: {e}"),
                );
                self.config_error(host);
                return false;
            }
        };
        let secret = match config.admission_secret {
            Some(secret) => secret,
            None => match shared_secret(host, clock_secret(host)) {
                Ok(secret) => {
                    host.log(
                        LogLevel::Warn,
                        "latchkey edge: no admission_secret configured; admission placement is keyed by a value derived from the clock (set admission_secret in production)",
                    );
                    secret
                }
                Err(e) => {
                    host.log(
                        LogLevel::Error,
                        &format!("latchkey edge: admission secret: {e}"),
                    );
                    self.config_error(host);
                    return false;
                }
            },
        };
        let admission = Admission::new(config.key_slots, config.identity_slots, secret);
        if let Err(e) = admission.create_slots(host) {
            host.log(
                LogLevel::Error,
                &format!("latchkey edge: admission slots: {e}"),
            );
            self.config_error(host);
            return false;
        }
        // A new VM (a new module or only a new configuration) starts from the
        // last good table in shared data rather than an empty one (issue 19).
        let stored = config.refresh.as_ref().and_then(|_| load_last_good(host));
        let table = GrantTable::start(&config, policy, stored.as_ref(), now_ms(host));
        if config.refresh.is_some() {
            // The first refresh soon; on_tick then sets the configured period.
            host.set_tick_period(Duration::from_millis(FIRST_REFRESH_MS));
        }
        if table.origin() == Origin::None {
            host.log(
                LogLevel::Warn,
                "latchkey edge: no grant table yet (none configured, none kept from an earlier filter); keyed calls are answered UNAVAILABLE POLICY_NOT_READY until the first refresh",
            );
        }
        self.publish_table(host, &table);
        let mut vm = self.vm.borrow_mut();
        let stats = &mut vm.metrics;
        stats.add(host, &metrics::grant_table_start(table.origin()), 1);
        stats.gauge_set(host, metrics::FILTER_VERSION, config.filter_version);
        stats.gauge_set(
            host,
            metrics::ADMISSION_SECRET_CONFIGURED,
            u64::from(config.admission_secret.is_some()),
        );
        stats.add(host, metrics::ADMISSION_OVERFLOW, 0);
        stats.gauge_add(host, metrics::STREAMS_OPEN, 0);
        // Define the denial counters up front so they show (at 0) on /stats.
        for r in DenyReason::ALL {
            stats.add(host, &metrics::denied(r), 0);
        }
        vm.identities.clear();
        vm.active = Some(Rc::new(Active {
            config,
            table,
            admission,
        }));
        true
    }

    fn config_error(&self, host: &impl Host) {
        self.vm
            .borrow_mut()
            .metrics
            .add(host, metrics::CONFIG_ERRORS, 1);
    }
}

/// A stand-in secret when none is configured: wasm32-unknown-unknown has no
/// entropy source, so the host clock's nanoseconds, mixed. Weak by design
/// (see `FilterConfig::admission_secret`); only the first VM's value is used.
fn clock_secret(host: &impl Host) -> AdmissionSecret {
    let nanos = host.now().map(|d| d.as_nanos()).unwrap_or(0);
    let mix = AdmissionSecret::from_bytes(*b"latchkey-edge-v1");
    let mut seed = nanos.to_le_bytes().to_vec();
    seed.push(0);
    let a = mix.hash(&seed);
    seed.push(1);
    let b = mix.hash(&seed);
    let mut bytes = [0u8; 16];
    for (dst, src) in bytes
        .iter_mut()
        .zip(a.to_le_bytes().into_iter().chain(b.to_le_bytes()))
    {
        *dst = src;
    }
    AdmissionSecret::from_bytes(bytes)
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::admission::{SECRET_ENTRY, SharedStore};
    use crate::edge::fake::{FakeHost, config, configured};

    fn configure(host: &FakeHost, raw: &[u8]) -> (Root, bool) {
        *host.plugin_configuration.borrow_mut() = raw.to_vec();
        let mut root = Root::default();
        let ok = root.on_configure(host);
        (root, ok)
    }

    #[test]
    fn a_malformed_configuration_is_refused_and_counted() {
        for raw in [
            b"".to_vec(),
            b"not json".to_vec(),
            config(json!({"trustDomain": "no such domain!"})),
            config(json!({"maxStreamsPerIdentity": 0})),
            config(json!({"noSuchField": true})),
            config(json!({"trustDomain": "dev.latchkey", "trust_domain": "dev.latchkey"})),
        ] {
            let host = FakeHost::default();
            let (root, ok) = configure(&host, &raw);
            assert!(!ok, "{}", String::from_utf8_lossy(&raw));
            assert!(root.vm().borrow().active.is_none());
            assert_eq!(host.stat(metrics::CONFIG_ERRORS), Some(1));
            assert!(host.logged(LogLevel::Error, "latchkey edge: configuration refused: "));
            // Nothing else happened: no timer, no admission slots.
            assert_eq!(host.tick_period.get(), None);
            assert_eq!(host.shared.entries(), 0);
        }
    }

    #[test]
    fn a_bad_update_keeps_the_configuration_in_force() {
        let (host, mut root) = configured(json!({}));
        let before = root.vm().borrow().active.clone().unwrap();
        *host.plugin_configuration.borrow_mut() = b"{}".to_vec();
        assert!(!root.on_configure(&host));
        let after = root.vm().borrow().active.clone().unwrap();
        assert!(Rc::ptr_eq(&before, &after));
    }

    #[test]
    fn deprecated_names_are_accepted_and_logged() {
        let host = FakeHost::default();
        let raw = serde_json::to_vec(&json!({
            "trust_domain": "dev.latchkey",
            "admission_secret": "000102030405060708090a0b0c0d0e0f",
            "key_slots": 8, "identity_slots": 8,
        }))
        .unwrap();
        let (_, ok) = configure(&host, &raw);
        assert!(ok);
        let logs = host.logs.borrow();
        let (level, line) = logs.first().unwrap();
        assert_eq!(*level, LogLevel::Warn);
        assert!(
            line.contains("deprecated snake_case configuration names"),
            "{line}"
        );
        assert!(line.contains("trust_domain"), "{line}");
    }

    #[test]
    fn without_a_secret_every_vm_takes_the_first_ones_clock_derived_secret() {
        let host = FakeHost::default();
        let raw = serde_json::to_vec(&json!({
            "trustDomain": "dev.latchkey", "keySlots": 8, "identitySlots": 8,
        }))
        .unwrap();
        host.now.set(Duration::from_nanos(1_234_567));
        assert!(configure(&host, &raw).1);
        assert!(host.logged(LogLevel::Warn, "no admission_secret configured"));
        assert_eq!(host.stat(metrics::ADMISSION_SECRET_CONFIGURED), Some(0));
        let first = host.shared.get(SECRET_ENTRY).unwrap().0.unwrap();
        assert_eq!(first.len(), 16);
        // Another VM (another worker, later clock) uses the stored one.
        host.now.set(Duration::from_nanos(9_999_999));
        assert!(configure(&host, &raw).1);
        assert_eq!(host.shared.get(SECRET_ENTRY).unwrap().0.unwrap(), first);
        // A configured secret is reported as such.
        let (host, _) = configured(json!({}));
        assert_eq!(host.stat(metrics::ADMISSION_SECRET_CONFIGURED), Some(1));
    }

    #[test]
    fn without_shared_data_the_configuration_is_refused() {
        let host = FakeHost::default();
        host.fail_shared_data.set(true);
        assert!(!configure(&host, &config(json!({}))).1);
        assert!(host.logged(LogLevel::Error, "latchkey edge: admission slots: "));
        assert_eq!(host.stat(metrics::CONFIG_ERRORS), Some(1));
    }

    #[test]
    fn a_refresh_starts_the_timer_and_a_vm_without_a_table_says_so() {
        let (host, root) = configured(json!({
            "grants": [],
            "refresh": {"cluster": "arbiter_policy"},
        }));
        assert_eq!(
            host.tick_period.get(),
            Some(Duration::from_millis(FIRST_REFRESH_MS))
        );
        assert!(host.logged(LogLevel::Warn, "no grant table yet"));
        assert_eq!(
            host.stat("latchkey_edge.grant_table_start.result.none"),
            Some(1)
        );
        let vm = root.vm().borrow();
        assert_eq!(vm.active.as_ref().unwrap().table.origin(), Origin::None);
        // Every denial counter shows on /stats from the start, at 0.
        for r in DenyReason::ALL {
            assert_eq!(host.stat(&metrics::denied(r)), Some(0), "{r:?}");
        }
        assert_eq!(host.stat(metrics::STREAMS_OPEN), Some(0));
    }

    #[test]
    fn without_a_refresh_the_configured_table_is_the_table_and_no_timer_runs() {
        let (host, _) = configured(json!({"filterVersion": 3}));
        assert_eq!(host.tick_period.get(), None);
        assert_eq!(
            host.stat("latchkey_edge.grant_table_start.result.configured"),
            Some(1)
        );
        assert_eq!(host.stat(metrics::FILTER_VERSION), Some(3));
        assert_eq!(host.stat(metrics::GRANT_TABLE_SIZE), Some(1));
        assert!(host.logs.borrow().is_empty(), "{:?}", host.logs.borrow());
    }
}
