//! A minimal ElectionService beside the fake Lock service: Campaign (leads
//! over a vacancy, else waits), Proclaim, Resign, Leader and Observe, with
//! terms and tokens that rise. It trusts session ids; a test ends a
//! session's leaderships with [`FakeElections::session_ended`] when it
//! expires the session, and forces a new term with
//! [`FakeElections::replace_leader`].

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures::Stream;
use latchkey_proto::electionv1::election_service_server::{ElectionService, ElectionServiceServer};
use latchkey_proto::electionv1::{
    CampaignRequest, CampaignResponse, CandidatesRequest, CandidatesResponse, LeaderInfo,
    LeaderRequest, LeaderResponse, Leadership, ObserveRequest, ObserveResponse, ProclaimRequest,
    ProclaimResponse, Proclaimed, ResignRequest, ResignResponse, TermStarted, TransferRequest,
    TransferResponse, VacancyReason, Vacant, observe_response::Event,
};
use latchkey_proto::lockv1::lock_server::LockServer;
use parking_lot::{Mutex, MutexGuard};
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Code, Request, Response, Status};

use crate::fake_arbiter::{EPOCH, FakeArbiter, refusal};

pub const IDENTITY: &str = "spiffe://latchkey.test/workload/demo";

#[derive(Default)]
pub struct ElectionCounters {
    pub campaign: AtomicU32,
    pub resign: AtomicU32,
}

#[derive(Clone)]
struct Led {
    session: i64,
    term: u64,
    token: u64,
    value: String,
}

#[derive(Default)]
struct State {
    revision: i64,
    terms: u64,
    leaders: HashMap<String, Led>,
    /// Sessions a test ended: their campaigns are refused.
    ended: HashSet<i64>,
}

#[derive(Clone)]
pub struct FakeElections {
    state: Arc<Mutex<State>>,
    events: broadcast::Sender<(String, ObserveResponse)>,
    pub counters: Arc<ElectionCounters>,
}

impl FakeElections {
    pub fn new() -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                revision: 50_000,
                terms: 1 << 32,
                ..State::default()
            })),
            events: broadcast::channel(64).0,
            counters: Arc::new(ElectionCounters::default()),
        }
    }

    /// Serves `lock` and these elections on one fresh loopback port.
    pub async fn serve_with(&self, lock: &FakeArbiter) -> SocketAddr {
        let listener = match TcpListener::bind("127.0.0.1:0").await {
            Ok(l) => l,
            Err(e) => panic!("bind: {e}"),
        };
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => panic!("local_addr: {e}"),
        };
        let router = tonic::transport::Server::builder()
            .add_service(LockServer::new(lock.clone()))
            .add_service(ElectionServiceServer::new(self.clone()));
        tokio::spawn(async move {
            let _ = router
                .serve_with_incoming(TcpListenerStream::new(listener))
                .await;
        });
        addr
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    fn send(&self, election: &str, event: Event, _revision: i64) {
        let _ = self
            .events
            .send((election.to_string(), ObserveResponse { event: Some(event) }));
    }

    /// Another session leads `election` from now on, in a new term.
    /// How many Observe streams are subscribed now.
    pub fn observers(&self) -> usize {
        self.events.receiver_count()
    }

    pub fn replace_leader(&self, election: &str) {
        let (info, revision) = {
            let mut state = self.lock();
            let led = start(&mut state, 999, "usurper");
            state.leaders.insert(election.to_string(), led.clone());
            (info(&led), state.revision)
        };
        self.send(
            election,
            Event::TermStarted(TermStarted { leader: Some(info) }),
            revision,
        );
    }

    /// What the arbiter does when a session's lease ends.
    pub fn session_ended(&self, session: i64) {
        let ended: Vec<(String, u64, i64)> = {
            let mut state = self.lock();
            state.ended.insert(session);
            let gone: Vec<String> = state
                .leaders
                .iter()
                .filter(|(_, l)| l.session == session)
                .map(|(e, _)| e.clone())
                .collect();
            gone.into_iter()
                .filter_map(|e| {
                    let led = state.leaders.remove(&e)?;
                    state.revision += 1;
                    Some((e, led.term, state.revision))
                })
                .collect()
        };
        for (election, term, revision) in ended {
            self.send(
                &election,
                Event::Vacant(Vacant {
                    term,
                    reason: VacancyReason::SessionEnded as i32,
                }),
                revision,
            );
        }
    }

    pub fn leader_term(&self, election: &str) -> Option<u64> {
        self.lock().leaders.get(election).map(|l| l.term)
    }

    pub fn count(counter: &AtomicU32) -> u32 {
        counter.load(Ordering::SeqCst)
    }
}

fn start(state: &mut State, session: i64, value: &str) -> Led {
    state.revision += 1;
    state.terms += 1;
    Led {
        session,
        term: state.terms,
        token: (u64::from(EPOCH) << 48) + state.revision as u64,
        value: value.to_string(),
    }
}

fn info(led: &Led) -> LeaderInfo {
    LeaderInfo {
        identity: IDENTITY.into(),
        value: led.value.clone(),
        term: led.term,
        since_unix_ms: 1,
        priority: 0,
    }
}

fn not_leader() -> Status {
    refusal(
        Code::FailedPrecondition,
        "NOT_LEADER",
        "not the current leadership",
    )
}

type ObserveStream = Pin<Box<dyn Stream<Item = Result<ObserveResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ElectionService for FakeElections {
    async fn campaign(
        &self,
        request: Request<CampaignRequest>,
    ) -> Result<Response<CampaignResponse>, Status> {
        self.counters.campaign.fetch_add(1, Ordering::SeqCst);
        let req = request.into_inner();
        loop {
            let started = {
                let mut state = self.lock();
                if state.ended.contains(&req.session_id) {
                    return Err(refusal(
                        Code::FailedPrecondition,
                        "SESSION_EXPIRED",
                        "no such session",
                    ));
                }
                match state.leaders.get(&req.election) {
                    Some(led) if led.session == req.session_id => Some((led.clone(), None)),
                    Some(_) => None,
                    None => {
                        let led = start(&mut state, req.session_id, &req.value);
                        state.leaders.insert(req.election.clone(), led.clone());
                        let revision = state.revision;
                        Some((led, Some(revision)))
                    }
                }
            };
            if let Some((led, new_term)) = started {
                if let Some(revision) = new_term {
                    self.send(
                        &req.election,
                        Event::TermStarted(TermStarted {
                            leader: Some(info(&led)),
                        }),
                        revision,
                    );
                }
                return Ok(Response::new(CampaignResponse {
                    leadership: Some(Leadership {
                        election: req.election,
                        term: led.term,
                        token: led.token,
                        session_id: led.session,
                        value: led.value,
                    }),
                }));
            }
            // The client's deadline ends the wait.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn proclaim(
        &self,
        request: Request<ProclaimRequest>,
    ) -> Result<Response<ProclaimResponse>, Status> {
        let req = request.into_inner();
        let (term, revision) = {
            let mut state = self.lock();
            state.revision += 1;
            let revision = state.revision;
            match state.leaders.get_mut(&req.election) {
                Some(led) if led.session == req.session_id && led.token == req.token => {
                    led.value = req.value.clone();
                    (led.term, revision)
                }
                _ => return Err(not_leader()),
            }
        };
        self.send(
            &req.election,
            Event::Proclaimed(Proclaimed {
                term,
                value: req.value,
            }),
            revision,
        );
        Ok(Response::new(ProclaimResponse {}))
    }

    async fn leader(
        &self,
        request: Request<LeaderRequest>,
    ) -> Result<Response<LeaderResponse>, Status> {
        let election = request.into_inner().election;
        let leader = self.lock().leaders.get(&election).map(info);
        Ok(Response::new(LeaderResponse { election, leader }))
    }

    type ObserveStream = ObserveStream;

    async fn observe(
        &self,
        request: Request<ObserveRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        let election = request.into_inner().election;
        let (mut rx, first) = {
            let state = self.lock();
            let first = match state.leaders.get(&election) {
                Some(led) => Event::TermStarted(TermStarted {
                    leader: Some(info(led)),
                }),
                None => Event::Vacant(Vacant {
                    term: 0,
                    reason: VacancyReason::Unspecified as i32,
                }),
            };
            (
                self.events.subscribe(),
                ObserveResponse { event: Some(first) },
            )
        };
        let (tx, out) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            while let Ok((e, event)) = rx.recv().await {
                if e == election && tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    async fn resign(
        &self,
        request: Request<ResignRequest>,
    ) -> Result<Response<ResignResponse>, Status> {
        self.counters.resign.fetch_add(1, Ordering::SeqCst);
        let req = request.into_inner();
        let (term, revision) = {
            let mut state = self.lock();
            match state.leaders.get(&req.election) {
                Some(led) if led.session == req.session_id && led.token == req.token => {
                    let term = led.term;
                    state.leaders.remove(&req.election);
                    state.revision += 1;
                    (term, state.revision)
                }
                _ => return Err(not_leader()),
            }
        };
        self.send(
            &req.election,
            Event::Vacant(Vacant {
                term,
                reason: VacancyReason::Resigned as i32,
            }),
            revision,
        );
        Ok(Response::new(ResignResponse { next: None }))
    }

    async fn transfer(
        &self,
        _request: Request<TransferRequest>,
    ) -> Result<Response<TransferResponse>, Status> {
        Err(refusal(
            Code::FailedPrecondition,
            "NO_CANDIDATE",
            "the fake has no candidates",
        ))
    }

    async fn candidates(
        &self,
        request: Request<CandidatesRequest>,
    ) -> Result<Response<CandidatesResponse>, Status> {
        Ok(Response::new(CandidatesResponse {
            election: request.into_inner().election,
            candidates: Vec::new(),
        }))
    }
}
