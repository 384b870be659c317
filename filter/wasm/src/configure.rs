//! `on_configure`: the plugin configuration (ECDS), the admission secret and
//! slots, and the grant table a new VM starts with.

use std::rc::Rc;
use std::time::Duration;

use latchkey_filter_core::admission::{Admission, shared_secret};
use latchkey_filter_core::config::FilterConfig;
use latchkey_filter_core::grant_table::{GrantTable, Origin};
use latchkey_filter_core::keyed_hash::AdmissionSecret;
use latchkey_filter_core::metrics;
use latchkey_filter_core::status::DenyReason;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, LogLevel};

use crate::host_store::HostStore;
use crate::refresh::FIRST_REFRESH_MS;
use crate::root::EdgeRoot;
use crate::vm::{Active, load_last_good, log, now_ms};

impl EdgeRoot {
    pub(crate) fn configure(&mut self) -> bool {
        let raw = hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .ok()
            .flatten()
            .unwrap_or_default();
        let (config, policy) = match FilterConfig::parse_reporting_deprecated(&raw) {
            Ok((config, policy, deprecated)) => {
                if !deprecated.is_empty() {
                    log(
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
                log(
                    LogLevel::Error,
                    &format!("latchkey edge: configuration refused: {e}"),
                );
                self.state
                    .borrow_mut()
                    .metrics
                    .add(metrics::CONFIG_ERRORS, 1);
                return false;
            }
        };
        let secret = match config.admission_secret {
            Some(secret) => secret,
            None => match shared_secret(&HostStore, clock_secret()) {
                Ok(secret) => {
                    log(
                        LogLevel::Warn,
                        "latchkey edge: no admission_secret configured; admission placement is keyed by a value derived from the clock (set admission_secret in production)",
                    );
                    secret
                }
                Err(e) => {
                    log(
                        LogLevel::Error,
                        &format!("latchkey edge: admission secret: {e}"),
                    );
                    self.state
                        .borrow_mut()
                        .metrics
                        .add(metrics::CONFIG_ERRORS, 1);
                    return false;
                }
            },
        };
        let admission = Admission::new(config.key_slots, config.identity_slots, secret);
        if let Err(e) = admission.create_slots(&HostStore) {
            log(
                LogLevel::Error,
                &format!("latchkey edge: admission slots: {e}"),
            );
            self.state
                .borrow_mut()
                .metrics
                .add(metrics::CONFIG_ERRORS, 1);
            return false;
        }
        // A new VM (a new module or only a new configuration) starts from the
        // last good table in shared data rather than an empty one (issue 19).
        let stored = config.refresh.as_ref().and_then(|_| load_last_good());
        let table = GrantTable::start(&config, policy, stored.as_ref(), now_ms());
        if config.refresh.is_some() {
            // The first refresh soon; on_tick then sets the configured period.
            let _ = hostcalls::set_tick_period(Duration::from_millis(FIRST_REFRESH_MS));
        }
        if table.origin() == Origin::None {
            log(
                LogLevel::Warn,
                "latchkey edge: no grant table yet (none configured, none kept from an earlier filter); keyed calls are answered UNAVAILABLE POLICY_NOT_READY until the first refresh",
            );
        }
        self.publish_table(&table);
        let mut st = self.state.borrow_mut();
        st.metrics
            .add(&metrics::grant_table_start(table.origin()), 1);
        st.metrics
            .gauge_set(metrics::FILTER_VERSION, config.filter_version);
        st.metrics.gauge_set(
            metrics::ADMISSION_SECRET_CONFIGURED,
            u64::from(config.admission_secret.is_some()),
        );
        st.metrics.add(metrics::ADMISSION_OVERFLOW, 0);
        st.metrics.gauge_add(metrics::STREAMS_OPEN, 0);
        // Define the denial counters up front so they show (at 0) on /stats.
        for r in DenyReason::ALL {
            st.metrics.add(&metrics::denied(r), 0);
        }
        st.identities.clear();
        st.active = Some(Rc::new(Active {
            config,
            table,
            admission,
        }));
        true
    }
}

/// A stand-in secret when none is configured: wasm32-unknown-unknown has no
/// entropy source, so the host clock's nanoseconds, mixed. Weak by design
/// (see `FilterConfig::admission_secret`); only the first VM's value is used.
fn clock_secret() -> AdmissionSecret {
    let nanos = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
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
