//! The proxy-wasm contexts.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::Hasher;
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use crate::profile::{Profile, Section};
use latchkey_filter_core::admission::{
    Admission, Place, SharedStore, StoreError, Ticket, shared_secret,
};
use latchkey_filter_core::config::FilterConfig;
use latchkey_filter_core::decision::{self, KEY_HEADER};
use latchkey_filter_core::grant_table::{GrantTable, LastGood, Origin, SaveError, Saved};
use latchkey_filter_core::headers::{check_request_headers, check_trailers};
use latchkey_filter_core::identity::{IDENTITY_HEADER, identity_from_san};
use latchkey_filter_core::keyed_hash::AdmissionSecret;
use latchkey_filter_core::metrics;
use latchkey_filter_core::policy::{EDGE_POLICY_METHOD, EDGE_POLICY_SERVICE, EdgePolicy};
use latchkey_filter_core::request::{Call, Method};
use latchkey_filter_core::status::{DenyReason, GrpcCode, Refusal};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{
    Action, BufferType, ContextType, GrpcStatusCode, LogLevel, MapType, MetricType, Status,
};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(EdgeRoot::default()) });
}}

/// Shared data through the host: one map per `vm_id`, across workers.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        hostcalls::get_shared_data(key).map_err(|s| StoreError::Host(format!("{s:?}")))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(s) => Err(StoreError::Host(format!("{s:?}"))),
        }
    }
}

/// FNV-1a for the VM's own maps (metric names, SAN strings, stat scopes):
/// far cheaper than SipHash in Wasm, and every key comes from a bounded set
/// (stat names, certificates the listener accepted, the grant table), so
/// hash flooding is not a concern; each map is capped anyway.
type FnvMap<K, V> = HashMap<K, V, fnv::FnvBuildHasher>;

fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h = fnv::FnvHasher::default();
    for p in parts {
        h.write(p);
        h.write(&[0]);
    }
    h.finish()
}

/// Metric ids by name, defined on first use. Names come from bounded sets
/// (see `metrics`), and the map is capped anyway.
#[derive(Default)]
struct Metrics {
    ids: FnvMap<String, u32>,
}

const MAX_METRICS: usize = 4096;

/// Delay before the first grant-table refresh after a (re)configure.
const FIRST_REFRESH_MS: u64 = 200;
/// Refresh period while a VM has no grant table at all (first start, arbiter
/// not answering): it refuses keyed calls until then, so try more often.
const NOT_READY_REFRESH_MS: u64 = 1_000;

impl Metrics {
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return Some(*id);
        }
        if self.ids.len() >= MAX_METRICS {
            return None;
        }
        let id = hostcalls::define_metric(kind, name).ok()?;
        self.ids.insert(name.to_owned(), id);
        Some(id)
    }

    fn add(&mut self, name: &str, delta: i64) {
        if let Some(id) = self.id(MetricType::Counter, name) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    fn gauge_add(&mut self, name: &str, delta: i64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::increment_metric(id, delta);
        }
    }

    fn gauge_set(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

/// What the root context shares with the stream contexts of the same VM.
struct Active {
    config: FilterConfig,
    table: GrantTable,
    admission: Admission,
}

#[derive(Default)]
struct State {
    active: Option<Rc<Active>>,
    metrics: Metrics,
    /// Peer URI SAN (the exact bytes of the property Envoy gives for this
    /// request's connection) -> the SPIFFE ID it validated to in
    /// `identities_domain`: the SAN is read on every request, the parse need
    /// not be (`identity_from_san` depends on the SAN and the trust domain
    /// only, so an entry can only ever answer for a certificate with the
    /// same SAN). Only valid SANs are kept; at most `MAX_CACHED`.
    identities: FnvMap<Box<[u8]>, Rc<str>>,
    /// The trust domain the cached identities were validated in; a stream
    /// of another configuration empties the cache first.
    identities_domain: String,
    /// `(method, granted prefix, class label)` -> the stat scope and the id
    /// of its `allowed` counter (the same for every table: a scope depends
    /// on the granted prefix and class label only).
    scopes: FnvMap<u64, ScopeEntry>,
}

/// Bound on each per-VM cache; a full cache is emptied and refilled.
const MAX_CACHED: usize = 4096;

struct ScopeEntry {
    method: Method,
    granted: Box<str>,
    class_label: Box<str>,
    scope: Rc<str>,
    allowed: Option<u32>,
}

impl State {
    /// The caller's SPIFFE ID for a peer URI SAN (cached), or the refusal.
    fn identity(&mut self, san: &[u8], trust_domain: &str) -> Option<Rc<str>> {
        if self.identities_domain != trust_domain {
            self.identities.clear();
            trust_domain.clone_into(&mut self.identities_domain);
        }
        if let Some(id) = self.identities.get(san) {
            return Some(id.clone());
        }
        let id: Rc<str> = identity_from_san(Some(san), trust_domain).ok()?.into();
        if self.identities.len() >= MAX_CACHED {
            self.identities.clear();
        }
        self.identities.insert(san.into(), id.clone());
        Some(id)
    }

    /// The stat scope of an authorised call and the id of its `allowed`
    /// counter (cached: formatting and looking up stat names is slow in Wasm).
    fn scope(
        &mut self,
        method: Method,
        authorised: &decision::Authorised<'_>,
    ) -> (Rc<str>, Option<u32>) {
        let key = fnv(&[
            method.label().as_bytes(),
            authorised.granted.as_bytes(),
            authorised.class_label.as_bytes(),
        ]);
        if let Some(e) = self.scopes.get(&key)
            && e.method == method
            && *e.granted == *authorised.granted
            && *e.class_label == *authorised.class_label
        {
            return (e.scope.clone(), e.allowed);
        }
        let scope: Rc<str> = authorised.scope().into();
        let allowed = self.metrics.id(
            MetricType::Counter,
            &metrics::allowed(method.label(), &scope),
        );
        if self.scopes.len() >= MAX_CACHED {
            self.scopes.clear();
        }
        // A colliding entry is simply replaced.
        self.scopes.insert(
            key,
            ScopeEntry {
                method,
                granted: authorised.granted.into(),
                class_label: authorised.class_label.into(),
                scope: scope.clone(),
                allowed,
            },
        );
        (scope, allowed)
    }
}

type SharedState = Rc<RefCell<State>>;

fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// The host clock in milliseconds since the Unix epoch (0 if unreadable).
fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The last good table in shared data; a store error reads as none (logged).
fn load_last_good() -> Option<LastGood> {
    match LastGood::load(&HostStore) {
        Ok(stored) => stored,
        Err(e) => {
            log(
                LogLevel::Warn,
                &format!("latchkey edge: cannot read the last good grant table: {e}"),
            );
            None
        }
    }
}

#[derive(Default)]
struct EdgeRoot {
    state: SharedState,
    refresh_in_flight: Option<u32>,
}

impl EdgeRoot {
    fn publish_table(&self, table: &GrantTable) {
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

impl Context for EdgeRoot {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
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
}

impl RootContext for EdgeRoot {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
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

    fn on_tick(&mut self) {
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

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(EdgeStream {
            state: self.state.clone(),
            active: self.state.borrow().active.clone(),
            method: Method::Session,
            identity: Rc::from(""),
            bound: Rc::from(""),
            key_header: None,
            decided: false,
            held: None,
            stream: None,
            started: None,
            prof: Profile::default(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct EdgeStream {
    state: SharedState,
    /// The configuration and grant table this stream started with.
    active: Option<Rc<Active>>,
    method: Method,
    identity: Rc<str>,
    /// The grant subject the identity's streams and waiters count against:
    /// itself, or the pattern its per-pod identity falls under (issue 30),
    /// as the arbiter counts them.
    bound: Rc<str>,
    /// The client's `x-lock-key`, if it sent one (must equal the body's key).
    key_header: Option<String>,
    decided: bool,
    /// A waiter's admission places and the stat scope of its waiters gauge:
    /// given back when the arbiter answers or the stream ends.
    held: Option<(Ticket, Rc<str>)>,
    /// The identity's open-stream place: given back when the stream ends.
    stream: Option<Place>,
    started: Option<SystemTime>,
    /// Section times (empty unless built with the `profile` feature).
    prof: Profile,
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

/// The filter state key the route's ring hash reads (`hash_policy.filter_state`):
/// Envoy's well-known hashable string object.
const ROUTE_KEY_STATE: &str = "envoy.hashable_string";

/// Sets `envoy.hashable_string` in the request's filter state through Envoy's
/// `set_envoy_filter_state` foreign function (argument: the
/// `SetEnvoyFilterStateArguments` message, `{path = 1, value = 2, span = 3}`).
fn set_route_key(key: &str) -> Result<(), Status> {
    let mut args = latchkey_filter_core::wire::Writer::new();
    args.string(1, ROUTE_KEY_STATE).string(2, key);
    hostcalls::call_foreign_function("set_envoy_filter_state", Some(&args.finish())).map(|_| ())
}

fn grpc_code(code: GrpcCode) -> GrpcStatusCode {
    match code {
        GrpcCode::InvalidArgument => GrpcStatusCode::InvalidArgument,
        GrpcCode::PermissionDenied => GrpcStatusCode::PermissionDenied,
        GrpcCode::ResourceExhausted => GrpcStatusCode::ResourceExhausted,
        GrpcCode::Unimplemented => GrpcStatusCode::Unimplemented,
        GrpcCode::Internal => GrpcStatusCode::Internal,
        GrpcCode::Unavailable => GrpcStatusCode::Unavailable,
        GrpcCode::Unauthenticated => GrpcStatusCode::Unauthenticated,
    }
}

impl EdgeStream {
    fn refuse(&mut self, refusal: Refusal) -> Action {
        self.decided = true;
        self.state
            .borrow_mut()
            .metrics
            .add(&metrics::denied(refusal.why), 1);
        let details = refusal.status_details_bin();
        let sent = hostcalls::send_grpc_response(
            grpc_code(refusal.code),
            Some(refusal.message),
            vec![("grpc-status-details-bin", details.as_bytes())],
        );
        if sent.is_err() {
            let _ = hostcalls::reset_http_request();
        }
        Action::Pause
    }

    fn set_header(&self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
    }

    /// Decides a keyed call on its whole body.
    fn decide(&mut self, body_size: usize) -> Action {
        self.decided = true;
        self.prof.lap(Section::WaitBody);
        let Some(active) = self.active.clone() else {
            return self.refuse(Refusal::of(DenyReason::PolicyNotReady));
        };
        let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.prof.lap(Section::BodyGet);
        let now = self
            .started
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or_else(now_ms);
        let authorised = match decision::check_keyed(
            active.table.view(now),
            &self.identity,
            self.method,
            &body,
            self.key_header.as_deref(),
            active.config.max_message_bytes,
        ) {
            Ok(a) => a,
            Err(refusal) => return self.refuse(refusal),
        };
        self.prof.lap(Section::Check);
        // Routing affinity follows the authorised key, from the body: the
        // ring hash reads filter state, set here (request headers can no
        // longer be changed in the body phase). The client's x-lock-key was
        // removed in the header phase, whatever it said.
        if let Err(e) = set_route_key(authorised.key.as_str()) {
            log(
                LogLevel::Error,
                &format!("latchkey edge: cannot set the routing key: {e:?}"),
            );
            return self.refuse(Refusal::of(DenyReason::NoRouteKey));
        }
        self.prof.lap(Section::RouteKey);
        let (scope, allowed) = self.state.borrow_mut().scope(self.method, &authorised);
        if authorised.waits {
            match active.admission.admit(
                &HostStore,
                authorised.key.as_str(),
                authorised.max_waiters_per_key,
                &self.bound,
                active.config.max_waiters_per_identity,
            ) {
                Ok(ticket) => {
                    let mut st = self.state.borrow_mut();
                    st.metrics.gauge_add(&metrics::waiters(&scope), 1);
                    if ticket.overflowed() {
                        st.metrics.add(metrics::ADMISSION_OVERFLOW, 1);
                    }
                    drop(st);
                    self.held = Some((ticket, scope));
                }
                Err(rejection) => {
                    let refusal = decision::admission_refusal(rejection);
                    let which = match refusal.why {
                        DenyReason::QueueFullKey => "key",
                        DenyReason::QueueFullKeyShare => "key_share",
                        DenyReason::QueueFullIdentity => "identity",
                        DenyReason::AdmissionUnavailable => "store",
                        _ => "table",
                    };
                    self.state
                        .borrow_mut()
                        .metrics
                        .add(&metrics::admission_rejected(which, &scope), 1);
                    return self.refuse(refusal);
                }
            }
            self.prof.lap(Section::Admit);
        }
        if let Some(id) = allowed {
            let _ = hostcalls::increment_metric(id, 1);
        }
        if let (Some(start), Ok(now)) = (self.started, hostcalls::get_current_time())
            && let Ok(spent) = now.duration_since(start)
        {
            self.state
                .borrow_mut()
                .metrics
                .histogram(metrics::DECISION_US, spent.as_micros() as u64);
        }
        self.prof.lap(Section::BodyStats);
        Action::Continue
    }

    /// Gives the waiter's places back (once): the wait is over.
    fn release_waiter(&mut self) {
        if let (Some((ticket, scope)), Some(active)) = (self.held.take(), self.active.as_ref()) {
            active.admission.release(&HostStore, &ticket);
            self.state
                .borrow_mut()
                .metrics
                .gauge_add(&metrics::waiters(&scope), -1);
        }
    }

    /// Gives every place back (once): the stream is over.
    fn release(&mut self) {
        let holding = self.held.is_some() || self.stream.is_some();
        self.prof.start();
        self.release_waiter();
        if let (Some(place), Some(active)) = (self.stream.take(), self.active.as_ref()) {
            active.admission.close_stream(&HostStore, &place);
            self.state
                .borrow_mut()
                .metrics
                .gauge_add(metrics::STREAMS_OPEN, -1);
        }
        if holding {
            self.prof.lap(Section::Release);
        }
        let state = &self.state;
        self.prof.flush(
            |name, ns| state.borrow_mut().metrics.histogram(name, ns),
            |name, delta| state.borrow_mut().metrics.add(name, delta),
        );
    }
}

impl Context for EdgeStream {}

impl HttpContext for EdgeStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.started = hostcalls::get_current_time().ok();
        self.prof.start();
        let Some(active) = self.active.clone() else {
            return self.refuse(Refusal::of(DenyReason::PolicyNotReady));
        };
        // The peer certificate's URI SAN alone: Envoy has it only when the
        // client presented a certificate, which the listener verified against
        // the trust bundle (see `identity_from_san`). One property read per
        // request; the SPIFFE parse is cached per SAN.
        let san = hostcalls::get_property(vec!["connection", "uri_san_peer_certificate"])
            .ok()
            .flatten()
            .unwrap_or_default();
        let identity = self
            .state
            .borrow_mut()
            .identity(&san, &active.config.trust_domain);
        self.identity = match identity {
            Some(id) => id,
            None => return self.refuse(Refusal::of(DenyReason::Unauthenticated)),
        };
        self.bound = active
            .table
            .view(now_ms())
            .bound_subject(&self.identity)
            .into();
        self.prof.lap(Section::Identity);
        // Request headers are readable only in this phase: refuse any
        // x-latchkey-* the client sent (the edge names the caller, nobody
        // else), and keep what the body decision needs.
        // Bytes, not `get_map`: that unwraps UTF-8, and a header value need
        // not be UTF-8 (a panic would take the VM down).
        // Values are borrowed, and copied (lossily) only if not UTF-8.
        let raw = hostcalls::get_map_bytes(MapType::HttpRequestHeaders).unwrap_or_default();
        let headers: Vec<(&str, Cow<'_, str>)> = raw
            .iter()
            .map(|(k, v)| (k.as_str(), String::from_utf8_lossy(v)))
            .collect();
        let checked = match check_request_headers(headers.iter().map(|(k, v)| (*k, v.as_ref()))) {
            Ok(checked) => checked,
            Err(refusal) => return self.refuse(refusal),
        };
        let pseudo = |name: &str| {
            headers
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.as_ref())
                .unwrap_or_default()
        };
        self.method = match Call::of(pseudo(":method"), pseudo(":path")) {
            Call::Forward(method) => method,
            Call::EdgePolicy => return self.refuse(Refusal::of(DenyReason::EdgePolicyForbidden)),
            Call::Unknown => return self.refuse(Refusal::of(DenyReason::UnknownMethod)),
        };
        // The client's x-lock-key is never forwarded, on any call: routing
        // uses the key the filter authorised from the body (filter state),
        // and a keyed call's header must equal that key (checked on the
        // body, before anything is forwarded: the buffer filter holds the
        // headers until then).
        if checked.key_repeated {
            return self.refuse(Refusal::of(DenyReason::KeyMismatch));
        }
        self.prof.lap(Section::HeaderMap);
        if checked.key.is_some()
            && hostcalls::set_map_value(MapType::HttpRequestHeaders, KEY_HEADER, None).is_err()
        {
            return self.refuse(Refusal::of(DenyReason::NoRouteKey));
        }
        self.key_header = checked.key;
        // Every forwarded call names its verified caller, admin calls included.
        let identity = self.identity.clone();
        self.set_header(IDENTITY_HEADER, &identity);
        self.prof.lap(Section::HeaderSet);
        // Every stream counts against its identity's bound until it ends:
        // exactly, in shared data (a place kept back by one worker would
        // refuse the identity below its bound on another).
        match active.admission.open_stream(
            &HostStore,
            &self.bound,
            active.config.max_streams_per_identity,
        ) {
            Ok(place) => {
                self.stream = Some(place);
                self.prof.lap(Section::StreamPlace);
                self.state
                    .borrow_mut()
                    .metrics
                    .gauge_add(metrics::STREAMS_OPEN, 1);
            }
            Err(rejection) => return self.refuse(decision::admission_refusal(rejection)),
        }
        if !self.method.is_keyed() {
            self.state
                .borrow_mut()
                .metrics
                .add(&metrics::allowed(self.method.label(), "ns._.class._"), 1);
            self.decided = true;
            self.prof.lap(Section::HeaderStats);
            return Action::Continue;
        }
        self.prof.lap(Section::HeaderStats);
        if end_of_stream {
            return self.refuse(Refusal::of(DenyReason::BadRequest));
        }
        // Not Pause: the host turns a paused header phase into "stop all", and
        // the body would never reach this filter. The headers go on to Envoy's
        // buffer filter, which holds them (and so the router, its host choice
        // and the arbiter) until this filter lets the body through.
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.decided {
            return Action::Continue;
        }
        let max = self
            .active
            .as_ref()
            .map(|a| a.config.max_message_bytes)
            .unwrap_or(0);
        if decision::body_too_large(body_size, max) {
            return self.refuse(Refusal::of(DenyReason::Oversized));
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.decide(body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        // Reserved names are refused here too, whatever the method: tonic
        // merges a unary request's trailers into its metadata. Pausing keeps
        // the trailers from the router, and the local reply ends the stream,
        // which resets the upstream request (for a call passed on at header
        // time) before the arbiter has seen its end: it never completes.
        let trailers = hostcalls::get_map_bytes(MapType::HttpRequestTrailers).unwrap_or_default();
        if let Err(refusal) = check_trailers(trailers.iter().map(|(k, _)| k.as_str())) {
            return self.refuse(refusal);
        }
        if self.decided {
            return Action::Continue;
        }
        let size = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, usize::MAX)
            .ok()
            .flatten()
            .map(|b| b.len())
            .unwrap_or(0);
        self.decide(size)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        // The arbiter has answered: the wait is over, whether or not the
        // client ever reads the answer (a zero receive window must not keep
        // the place).
        self.prof.start();
        self.release_waiter();
        self.prof.lap(Section::ResponseHeaders);
        Action::Continue
    }

    fn on_log(&mut self) {
        self.release();
    }
}

impl Drop for EdgeStream {
    fn drop(&mut self) {
        // on_log runs on every stream end; this covers a host that skips it.
        self.release();
    }
}
