//! A minimal Lock service: enough of OpenSession, KeepAlive, Acquire,
//! Release, CloseSession and Inspect to drive the client. Sessions never
//! expire on their own; a test expires one explicitly.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use futures::Stream;
use latchkey_proto::lockv1::lock_server::{Lock, LockServer};
use latchkey_proto::lockv1::{
    AcquireRequest, AcquireResponse, CloseSessionRequest, CloseSessionResponse, Grant, Holder,
    InspectRequest, InspectResponse, KeepAliveRequest, KeepAliveResponse, OpenSessionRequest,
    OpenSessionResponse, ReleaseRequest, ReleaseResponse,
};
use parking_lot::{Mutex, MutexGuard};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt};

pub const EPOCH: u32 = 3;

#[derive(Default)]
pub struct Counters {
    pub open_session: AtomicU32,
    pub keepalive: AtomicU32,
    pub acquire: AtomicU32,
    pub release: AtomicU32,
    pub close_session: AtomicU32,
}

#[derive(Default)]
struct State {
    next_session: i64,
    revision: i64,
    /// session id -> TTL seconds
    sessions: HashMap<i64, u32>,
    /// key -> (session, token)
    holds: HashMap<String, (i64, u64)>,
}

#[derive(Clone)]
pub struct FakeArbiter {
    /// class -> TTL seconds
    classes: Arc<HashMap<String, u32>>,
    state: Arc<Mutex<State>>,
    pub counters: Arc<Counters>,
}

pub fn refusal(code: Code, reason: &str, message: &str) -> Status {
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(reason, "latchkey.dev", HashMap::new()),
    )
}

impl FakeArbiter {
    pub fn new(classes: &[(&str, u32)]) -> Self {
        Self {
            classes: Arc::new(classes.iter().map(|(c, t)| (c.to_string(), *t)).collect()),
            state: Arc::new(Mutex::new(State {
                next_session: 100,
                revision: 12_345,
                ..State::default()
            })),
            counters: Arc::new(Counters::default()),
        }
    }

    /// Serves on a fresh loopback port until the runtime ends.
    pub async fn serve(&self) -> SocketAddr {
        let listener = match TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => l,
            Err(e) => panic!("bind: {e}"),
        };
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => panic!("local_addr: {e}"),
        };
        let service = LockServer::new(self.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        addr
    }

    /// Forgets a session, as the arbiter does when its lease expires.
    pub fn expire(&self, session_id: i64) {
        let mut state = self.lock();
        state.sessions.remove(&session_id);
        state.holds.retain(|_, (s, _)| *s != session_id);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    pub fn count(counter: &AtomicU32) -> u32 {
        counter.load(Ordering::SeqCst)
    }
}

fn bump(counter: &AtomicU32) {
    counter.fetch_add(1, Ordering::SeqCst);
}

type KeepAliveStream = Pin<Box<dyn Stream<Item = Result<KeepAliveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Lock for FakeArbiter {
    async fn open_session(
        &self,
        request: Request<OpenSessionRequest>,
    ) -> Result<Response<OpenSessionResponse>, Status> {
        bump(&self.counters.open_session);
        let req = request.into_inner();
        let Some(&ttl) = self.classes.get(&req.class) else {
            return Err(refusal(
                Code::InvalidArgument,
                "UNKNOWN_CLASS",
                "no such class",
            ));
        };
        let mut state = self.lock();
        let reusable = req
            .reuse_session_ids
            .iter()
            .find(|id| state.sessions.get(id) == Some(&ttl))
            .copied();
        let (session_id, reused) = match reusable {
            Some(id) => (id, true),
            None => {
                state.next_session += 1;
                let id = state.next_session;
                state.sessions.insert(id, ttl);
                (id, false)
            }
        };
        Ok(Response::new(OpenSessionResponse {
            session_id,
            ttl_seconds: ttl,
            keepalive_interval_ms: ttl * 1000 / 3,
            reused,
        }))
    }

    type KeepAliveStream = KeepAliveStream;

    async fn keep_alive(
        &self,
        request: Request<tonic::Streaming<KeepAliveRequest>>,
    ) -> Result<Response<Self::KeepAliveStream>, Status> {
        let mut requests = request.into_inner();
        let this = self.clone();
        let replies = async_stream(move |tx| async move {
            while let Some(Ok(req)) = requests.next().await {
                bump(&this.counters.keepalive);
                let ttl = this.lock().sessions.get(&req.session_id).copied();
                let reply = match ttl {
                    Some(ttl) => Ok(KeepAliveResponse {
                        session_id: req.session_id,
                        remaining_ttl_seconds: i64::from(ttl),
                        ended_holds: Vec::new(),
                    }),
                    None => Err(refusal(
                        Code::FailedPrecondition,
                        "SESSION_EXPIRED",
                        "no such session",
                    )),
                };
                let stop = reply.is_err();
                if tx.send(reply).await.is_err() || stop {
                    return;
                }
            }
        });
        Ok(Response::new(replies))
    }

    async fn close_session(
        &self,
        request: Request<CloseSessionRequest>,
    ) -> Result<Response<CloseSessionResponse>, Status> {
        bump(&self.counters.close_session);
        self.expire(request.into_inner().session_id);
        Ok(Response::new(CloseSessionResponse {}))
    }

    async fn acquire(
        &self,
        request: Request<AcquireRequest>,
    ) -> Result<Response<AcquireResponse>, Status> {
        bump(&self.counters.acquire);
        let req = request.into_inner();
        let mut state = self.lock();
        if !state.sessions.contains_key(&req.session_id) {
            return Err(refusal(
                Code::FailedPrecondition,
                "SESSION_EXPIRED",
                "no such session",
            ));
        }
        if state.holds.contains_key(&req.key) {
            return Err(refusal(Code::Aborted, "HELD", "the key is held"));
        }
        state.revision += 1;
        let revision = state.revision;
        let token = (u64::from(EPOCH) << 48) + revision as u64;
        state.holds.insert(req.key.clone(), (req.session_id, token));
        Ok(Response::new(AcquireResponse {
            grant: Some(Grant {
                key: req.key,
                token,
                epoch: EPOCH,
                revision,
                session_id: req.session_id,
                ..Grant::default()
            }),
        }))
    }

    async fn release(
        &self,
        request: Request<ReleaseRequest>,
    ) -> Result<Response<ReleaseResponse>, Status> {
        bump(&self.counters.release);
        let req = request.into_inner();
        let mut state = self.lock();
        match state.holds.get(&req.key) {
            Some(&(session, token)) if session == req.session_id && token == req.token => {
                state.holds.remove(&req.key);
                Ok(Response::new(ReleaseResponse {}))
            }
            Some(_) => Err(refusal(
                Code::FailedPrecondition,
                "TOKEN_MISMATCH",
                "not the current grant",
            )),
            None => Err(refusal(Code::FailedPrecondition, "NOT_HELD", "not held")),
        }
    }

    async fn inspect(
        &self,
        request: Request<InspectRequest>,
    ) -> Result<Response<InspectResponse>, Status> {
        let key = request.into_inner().key;
        let state = self.lock();
        // Like the real arbiter: never a token in Inspect.
        let holder = state.holds.get(&key).map(|&(session_id, _)| Holder {
            identity: "spiffe://latchkey.test/workload/demo".into(),
            session_id,
            class: "test".into(),
            acquired_at_unix_ms: 0,
            annotations: HashMap::new(),
            ..Holder::default()
        });
        Ok(Response::new(InspectResponse {
            key,
            holder,
            waiters: 0,
            durable_waiters: 0,
            slot_holders: Vec::new(),
            shared_holders: Vec::new(),
            shared_holder_count: 0,
        }))
    }
}

/// A stream fed by a task, without pulling in async-stream.
fn async_stream<F, Fut>(body: F) -> KeepAliveStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<KeepAliveResponse, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(body(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}
