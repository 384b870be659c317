//! A scripted [`Host`] for the callbacks' unit tests: what Envoy would say is
//! set on it (peer SAN, headers, body, configuration, the arbiter's answer,
//! the clock, faults), and what the filter did is recorded on it (replies,
//! headers, filter state, stats, logs, ticks, gRPC calls).

use std::cell::{Cell, RefCell};
use std::time::Duration;

use serde_json::Value;

use crate::admission::{MemoryStore, SharedStore, StoreError};
use crate::edge::{Root, Stream};
use crate::host::{Action, Buffer, HeaderMap, Host, HostError, LogLevel, MetricKind};
use crate::status::GrpcCode;

pub const ALICE: &str = "spiffe://dev.latchkey/workload/alice";
pub const BOB: &str = "spiffe://dev.latchkey/workload/bob";
pub const ACQUIRE: &str = "/latchkey.lock.v1.Lock/Acquire";
pub const INSPECT: &str = "/latchkey.lock.v1.Lock/Inspect";
pub const OPEN_SESSION: &str = "/latchkey.lock.v1.Lock/OpenSession";
pub const CAMPAIGN: &str = "/latchkey.election.v1.ElectionService/Campaign";
pub const PROCLAIM: &str = "/latchkey.election.v1.ElectionService/Proclaim";
pub const OBSERVE: &str = "/latchkey.election.v1.ElectionService/Observe";
/// Every election.v1 method's path.
pub const ELECTION_PATHS: [&str; 7] = [
    CAMPAIGN,
    PROCLAIM,
    "/latchkey.election.v1.ElectionService/Leader",
    OBSERVE,
    "/latchkey.election.v1.ElectionService/Resign",
    "/latchkey.election.v1.ElectionService/Transfer",
    "/latchkey.election.v1.ElectionService/Candidates",
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    pub name: String,
    pub kind: MetricKind,
    pub value: i64,
    pub samples: Vec<u64>,
}

/// A local reply: the gRPC code, message and `grpc-status-details-bin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub code: GrpcCode,
    pub message: String,
    pub details_bin: String,
}

#[derive(Default)]
pub struct FakeHost {
    pub shared: MemoryStore,
    pub now: Cell<Duration>,
    pub plugin_configuration: RefCell<Vec<u8>>,
    pub grpc_receive: RefCell<Vec<u8>>,
    pub grpc_status: RefCell<Option<(u32, Option<String>)>>,
    /// `connection.uri_san_peer_certificate`.
    pub peer_san: RefCell<Option<Vec<u8>>>,
    pub request_headers: RefCell<Vec<(String, Vec<u8>)>>,
    pub request_trailers: RefCell<Vec<(String, Vec<u8>)>>,
    pub body: RefCell<Vec<u8>>,

    pub logs: RefCell<Vec<(LogLevel, String)>>,
    pub stats: RefCell<Vec<Stat>>,
    pub replies: RefCell<Vec<Reply>>,
    pub resets: Cell<u32>,
    pub foreign_calls: RefCell<Vec<(String, Vec<u8>)>>,
    pub tick_period: Cell<Option<Duration>>,
    /// `(cluster, service, method, timeout)` of each dispatched call.
    pub grpc_calls: RefCell<Vec<(String, String, String, Duration)>>,
    pub property_reads: Cell<u32>,

    pub refuse_metrics: Cell<bool>,
    pub fail_reply: Cell<bool>,
    pub fail_foreign_call: Cell<bool>,
    pub fail_remove_header: Cell<bool>,
    pub fail_dispatch: Cell<bool>,
    pub fail_shared_data: Cell<bool>,
}

impl FakeHost {
    pub fn stat(&self, name: &str) -> Option<i64> {
        self.stats
            .borrow()
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.value)
    }

    pub fn samples(&self, name: &str) -> Vec<u64> {
        self.stats
            .borrow()
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.samples.clone())
            .unwrap_or_default()
    }

    pub fn defined(&self) -> usize {
        self.stats.borrow().len()
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.request_headers
            .borrow()
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    pub fn last_reply(&self) -> Option<Reply> {
        self.replies.borrow().last().cloned()
    }

    pub fn logged(&self, level: LogLevel, part: &str) -> bool {
        self.logs
            .borrow()
            .iter()
            .any(|(l, m)| *l == level && m.contains(part))
    }

    /// The next request: from a peer with URI SAN `peer`, with `headers`
    /// (`:method POST` and `:path` first) and `body`. Replies so far are kept.
    pub fn request(&self, peer: Option<&str>, path: &str, extra: &[(&str, &str)], body: &[u8]) {
        *self.peer_san.borrow_mut() = peer.map(|p| p.as_bytes().to_vec());
        let mut headers = vec![
            (":method".to_owned(), b"POST".to_vec()),
            (":path".to_owned(), path.as_bytes().to_vec()),
            ("content-type".to_owned(), b"application/grpc".to_vec()),
        ];
        headers.extend(
            extra
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec())),
        );
        *self.request_headers.borrow_mut() = headers;
        self.request_trailers.borrow_mut().clear();
        *self.body.borrow_mut() = body.to_vec();
    }
}

impl SharedStore for FakeHost {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        if self.fail_shared_data.get() {
            return Err(StoreError::Host("InternalFailure".into()));
        }
        self.shared.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if self.fail_shared_data.get() {
            return Err(StoreError::Host("InternalFailure".into()));
        }
        self.shared.set(key, value, cas)
    }
}

fn failed() -> HostError {
    HostError {
        status: "InternalFailure".into(),
    }
}

impl Host for FakeHost {
    fn now(&self) -> Option<Duration> {
        Some(self.now.get())
    }

    fn log(&self, level: LogLevel, message: &str) {
        self.logs.borrow_mut().push((level, message.to_owned()));
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32> {
        if self.refuse_metrics.get() {
            return None;
        }
        let mut stats = self.stats.borrow_mut();
        let id = match stats.iter().position(|s| s.name == name) {
            Some(i) => i,
            None => {
                stats.push(Stat {
                    name: name.to_owned(),
                    kind,
                    value: 0,
                    samples: Vec::new(),
                });
                stats.len() - 1
            }
        };
        u32::try_from(id).ok()
    }

    fn increment_metric(&self, id: u32, delta: i64) {
        if let Some(s) = self.stats.borrow_mut().get_mut(id as usize) {
            s.value += delta;
        }
    }

    fn record_metric(&self, id: u32, value: u64) {
        if let Some(s) = self.stats.borrow_mut().get_mut(id as usize) {
            match s.kind {
                MetricKind::Histogram => s.samples.push(value),
                _ => s.value = value as i64,
            }
        }
    }

    fn buffer(&self, buffer: Buffer, start: usize, max: usize) -> Option<Vec<u8>> {
        let whole = match buffer {
            Buffer::RequestBody => self.body.borrow().clone(),
            Buffer::PluginConfiguration => self.plugin_configuration.borrow().clone(),
            Buffer::GrpcReceive => self.grpc_receive.borrow().clone(),
        };
        let part: Vec<u8> = whole.into_iter().skip(start).take(max).collect();
        (!part.is_empty()).then_some(part)
    }

    fn set_tick_period(&self, period: Duration) {
        self.tick_period.set(Some(period));
    }

    fn dispatch_grpc_call(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        _message: &[u8],
        timeout: Duration,
    ) -> Result<u32, HostError> {
        if self.fail_dispatch.get() {
            return Err(HostError {
                status: "BadArgument".into(),
            });
        }
        let mut calls = self.grpc_calls.borrow_mut();
        calls.push((cluster.into(), service.into(), method.into(), timeout));
        Ok(calls.len() as u32)
    }

    fn grpc_status(&self) -> Option<(u32, Option<String>)> {
        self.grpc_status.borrow().clone()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.property_reads.set(self.property_reads.get() + 1);
        match path {
            ["connection", "uri_san_peer_certificate"] => self.peer_san.borrow().clone(),
            _ => None,
        }
    }

    fn header_map(&self, map: HeaderMap) -> Vec<(String, Vec<u8>)> {
        match map {
            HeaderMap::RequestHeaders => self.request_headers.borrow().clone(),
            HeaderMap::RequestTrailers => self.request_trailers.borrow().clone(),
        }
    }

    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostError> {
        let mut headers = self.request_headers.borrow_mut();
        headers.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        headers.push((name.to_owned(), value.as_bytes().to_vec()));
        Ok(())
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        if self.fail_remove_header.get() {
            return Err(failed());
        }
        self.request_headers
            .borrow_mut()
            .retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        Ok(())
    }

    fn send_grpc_reply(
        &self,
        code: GrpcCode,
        message: &str,
        details_bin: &str,
    ) -> Result<(), HostError> {
        if self.fail_reply.get() {
            return Err(failed());
        }
        self.replies.borrow_mut().push(Reply {
            code,
            message: message.to_owned(),
            details_bin: details_bin.to_owned(),
        });
        Ok(())
    }

    fn reset_request(&self) {
        self.resets.set(self.resets.get() + 1);
    }

    fn call_foreign_function(&self, name: &str, arguments: &[u8]) -> Result<(), HostError> {
        if self.fail_foreign_call.get() {
            return Err(failed());
        }
        self.foreign_calls
            .borrow_mut()
            .push((name.to_owned(), arguments.to_vec()));
        Ok(())
    }
}

/// A plugin configuration: Alice may lock under `demo` (class `demo`, 4
/// waiters per key), a fixed admission secret, `overrides` on top.
pub fn config(overrides: Value) -> Vec<u8> {
    let mut config = serde_json::json!({
        "trustDomain": "dev.latchkey",
        "admissionSecret": "000102030405060708090a0b0c0d0e0f",
        "keySlots": 64,
        "identitySlots": 32,
        "grants": [{"identity": ALICE, "prefixes": ["demo"]}],
        "classes": [{"name": "demo", "maxWaitersPerKey": 4}],
    });
    if let (Some(base), Value::Object(extra)) = (config.as_object_mut(), overrides) {
        base.extend(extra);
    }
    serde_json::to_vec(&config).unwrap_or_default()
}

/// A host and a root context configured with [`config`]`(overrides)`.
pub fn configured(overrides: Value) -> (FakeHost, Root) {
    let host = FakeHost::default();
    *host.plugin_configuration.borrow_mut() = config(overrides);
    let mut root = Root::default();
    assert!(root.on_configure(&host), "{:?}", host.logs.borrow());
    (host, root)
}

/// A gRPC frame around `message`.
pub fn frame(message: &[u8]) -> Vec<u8> {
    let mut body = vec![0];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message);
    body
}

/// An `AcquireRequest` body for `key` in class `demo`.
pub fn acquire(key: &str, wait: bool) -> Vec<u8> {
    let mut m = crate::wire::Writer::new();
    m.string(1, key)
        .string(2, "demo")
        .varint(3, 1)
        .varint(4, u64::from(wait));
    frame(&m.finish())
}

/// A `CampaignRequest` body for the election `name` in class `demo`.
pub fn campaign(name: &str) -> Vec<u8> {
    let mut m = crate::wire::Writer::new();
    m.string(1, name)
        .string(2, "demo")
        .varint(3, 1)
        .string(4, "10.0.0.1:8080");
    frame(&m.finish())
}

/// An election.v1 request body that names only the election `name` (field
/// 1): a whole `LeaderRequest`, `ObserveRequest` or `CandidatesRequest`, and
/// enough of any other for the edge (the arbiter checks the rest).
pub fn election(name: &str) -> Vec<u8> {
    inspect(name)
}

/// An `InspectRequest` body for `key`.
pub fn inspect(key: &str) -> Vec<u8> {
    let mut m = crate::wire::Writer::new();
    m.string(1, key);
    frame(&m.finish())
}

/// A keyed call through the header and body phases: the stream and what
/// each phase answered (`None`: refused at the headers).
pub fn keyed_call(
    host: &FakeHost,
    root: &Root,
    peer: &str,
    path: &str,
    body: &[u8],
) -> (Stream, Action, Option<Action>) {
    host.request(Some(peer), path, &[], body);
    let mut stream = root.new_stream();
    let replies = host.replies.borrow().len();
    let at_headers = stream.on_request_headers(host, false);
    if host.replies.borrow().len() > replies {
        return (stream, at_headers, None);
    }
    let at_body = stream.on_request_body(host, body.len(), true);
    (stream, at_headers, Some(at_body))
}
