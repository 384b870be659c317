//! Semaphores (issue 34): a class `kind = "semaphore", permits = N` through
//! real arbiters on real etcd. A grant names its slot and carries that
//! slot's token; a session asking again gets its own slot back; a full
//! semaphore queues and a freed slot (release, session end) goes to the
//! waiter, on another arbiter too; Inspect lists slot holders; a key is one
//! kind at a time. Then the issue's load: 200 contenders on 8 permits
//! through an arbiter SIGKILL and an etcd leader SIGKILL, while a watch on
//! the slots (every revision of the lock log) checks that no revision ever
//! has more than 8 slots held.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use latchkey_etcd::watch::{EventType, WatchOptions, watch_from};
use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{CloseSessionRequest, Grant, InspectRequest, ReleaseRequest};
use latchkey_records::{Layout, slots_of, under_name};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, ArbiterProcess, channel};
use latchkey_tests::cluster::{ClusterOptions, EtcdCluster};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::{copy_dev_policies, init_tracing};
use tempfile::TempDir;
use tonic::Code;

use crate::support::{Client, expect_refusal, open, release, try_lock, wait_lock};

const SEMAPHORE: &str = "slots";
const PREFIX: &str = "/latchkey";

/// A copy of the dev policies with a fenced semaphore class of `permits`.
fn policies(permits: u32) -> anyhow::Result<TempDir> {
    let dir = tempfile::tempdir()?;
    copy_dev_policies(dir.path())?;
    write_class(dir.path(), permits)?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    Ok(dir)
}

fn write_class(dir: &Path, permits: u32) -> anyhow::Result<()> {
    std::fs::write(
        dir.join("classes").join("semaphores.toml"),
        format!(
            r#"[[class]]
name = "{SEMAPHORE}"
kind = "semaphore"
permits = {permits}
description = "A fenced counting semaphore for the e2e tests"
tier = "entity"
enforcement = "fenced"
ttlSeconds = 5
maxWaitersPerKey = 256
[class.pauseTest]
resource = "postgresql:dev.latchkey_fenced_rows"
result = "pause-tests/{SEMAPHORE}.json"
"#
        ),
    )?;
    Ok(())
}

/// Waits until `key` has a waiter queued on the arbiter `c` calls (its
/// Inspect's count), failing after 5 s.
async fn queued(c: &Client, key: &str) -> anyhow::Result<()> {
    latchkey_tests::eventually("the waiter to queue", Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let seen = c
                .inspect(InspectRequest { key: key.into() })
                .await?
                .into_inner();
            ensure!(seen.waiters == 1, "{} waiters", seen.waiters);
            Ok(())
        }
    })
    .await
}

fn slot_of(g: &Grant) -> anyhow::Result<u32> {
    g.slot
        .with_context(|| format!("a semaphore grant without a slot: {g:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_semaphore_grants_its_permits_one_slot_each() -> anyhow::Result<()> {
    init_tracing();
    let etcd = EtcdServer::start().await?;
    let dir = policies(3)?;
    let opts = ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let a = Arbiter::start(&etcd, opts.clone()).await?;
    let b = Arbiter::start(&etcd, opts).await?;
    let mut alice = a.lock("workload/alice").await?;
    let mut bob = b.lock("workload/bob").await?;
    let key = "demo/sem";

    // Three sessions, three slots, each its own token.
    let mut sessions = Vec::new();
    let mut grants = Vec::new();
    for _ in 0..3 {
        let s = open(&mut alice, SEMAPHORE).await?;
        let g = try_lock(&mut alice, key, SEMAPHORE, s).await?;
        ensure!(g.key == key, "the grant names the semaphore: {g:?}");
        sessions.push(s);
        grants.push(g);
    }
    let slots: BTreeSet<u32> = grants.iter().map(slot_of).collect::<Result<_, _>>()?;
    ensure!(slots == BTreeSet::from([0, 1, 2]), "slots {slots:?}");
    // Asked again, a session gets its own slot and token back.
    let again = try_lock(&mut alice, key, SEMAPHORE, sessions[0]).await?;
    ensure!(
        again.slot == grants[0].slot && again.token == grants[0].token,
        "{again:?} vs {:?}",
        grants[0]
    );
    // Full: a try-lock is HELD, through the other arbiter too.
    let sb = open(&mut bob, SEMAPHORE).await?;
    expect_refusal(
        try_lock(&mut bob, key, SEMAPHORE, sb).await,
        Code::Aborted,
        "HELD",
    )?;

    // Inspect lists the holders by slot; no token anywhere in it.
    let seen = bob
        .inspect(InspectRequest { key: key.into() })
        .await?
        .into_inner();
    ensure!(seen.holder.is_none(), "{seen:?}");
    let listed: Vec<u32> = seen.slot_holders.iter().filter_map(|h| h.slot).collect();
    ensure!(listed == vec![0, 1, 2], "slot holders {listed:?}");
    ensure!(
        seen.slot_holders
            .iter()
            .all(|h| h.identity.ends_with("workload/alice") && h.class == SEMAPHORE),
        "{seen:?}"
    );
    ensure!(
        seen.slot_holders.iter().all(|h| h.session_id == 0),
        "bob is shown alice's sessions: {seen:?}"
    );

    // A waiter on the other arbiter gets the slot a release frees, with a
    // token above that slot's last.
    let waiter = {
        let mut bob = bob.clone();
        tokio::spawn(async move {
            wait_lock(&mut bob, key, SEMAPHORE, sb, Duration::from_secs(10)).await
        })
    };
    queued(&bob, key).await?;
    let freed = grants.remove(1);
    // A release naming another slot releases nothing.
    let wrong = |slot: Option<u32>| ReleaseRequest {
        key: key.into(),
        session_id: freed.session_id,
        token: freed.token,
        slot,
        mode: 0,
    };
    let other = (slot_of(&freed)? + 1) % 3;
    expect_refusal(
        alice.release(wrong(Some(other))).await,
        Code::FailedPrecondition,
        "NOT_HELD",
    )?;
    expect_refusal(
        alice.release(wrong(Some(4096))).await,
        Code::InvalidArgument,
        "BAD_SLOT",
    )?;
    // Without a slot (a client from before slots), the token names the
    // caller's slot: that one is released.
    alice.release(wrong(None)).await?;
    let got = waiter.await??;
    ensure!(got.slot == freed.slot, "{got:?} after {freed:?}");
    ensure!(got.token > freed.token, "{got:?} after {freed:?}");

    // A session's end frees its slot as an expiry does.
    let sc = open(&mut bob, SEMAPHORE).await?;
    let waiter = {
        let mut bob = bob.clone();
        tokio::spawn(async move {
            wait_lock(&mut bob, key, SEMAPHORE, sc, Duration::from_secs(10)).await
        })
    };
    queued(&bob, key).await?;
    alice
        .close_session(CloseSessionRequest {
            session_id: sessions[0],
        })
        .await?;
    let got = waiter.await??;
    ensure!(got.slot == grants[0].slot, "{got:?} after {:?}", grants[0]);
    ensure!(got.token > grants[0].token, "{got:?}");

    // One kind at a time: a lock of a semaphore with held slots, and a
    // semaphore of a held lock, are refused and write nothing.
    // One class per semaphore: its permits are its class's, so a class of
    // other permits is refused while the slots are held under this one.
    let other_class = open(&mut bob, "builds").await?;
    expect_refusal(
        try_lock(&mut bob, key, "builds", other_class).await,
        Code::FailedPrecondition,
        "KIND_IN_USE",
    )?;
    let lock_session = open(&mut bob, "demo").await?;
    expect_refusal(
        try_lock(&mut bob, key, "demo", lock_session).await,
        Code::FailedPrecondition,
        "KIND_IN_USE",
    )?;
    let held = try_lock(&mut bob, "demo/plain", "demo", lock_session).await?;
    ensure!(held.slot.is_none(), "a lock's grant has no slot: {held:?}");
    let s = open(&mut alice, SEMAPHORE).await?;
    expect_refusal(
        try_lock(&mut alice, "demo/plain", SEMAPHORE, s).await,
        Code::FailedPrecondition,
        "KIND_IN_USE",
    )?;
    let mut etcd_client = etcd.client().await?;
    let under = etcd_client
        .get(
            Layout::new(PREFIX).holder(&under_name("demo/plain")),
            Some(latchkey_etcd::kv::GetOptions::new().with_prefix()),
        )
        .await?;
    ensure!(under.kvs().is_empty(), "a refused slot grant wrote");
    // Once the lock is released, the key may be a semaphore.
    release(&mut bob, &held).await?;
    let g = try_lock(&mut alice, "demo/plain", SEMAPHORE, s).await?;
    ensure!(
        g.slot.is_some_and(|s| s < 3) && g.permits == Some(3),
        "a semaphore's grant names its slot and its class's permits: {g:?}"
    );
    latchctl_speaks_slots(a.addr()).await
}

/// `latchctl acquire` prints the slot and `release --slot` releases it;
/// `inspect` and `why` list slot holders; `hold` gives its command the slot
/// and the permits, and `hold --permits N` refuses a class of other than N.
async fn latchctl_speaks_slots(addr: SocketAddr) -> anyhow::Result<()> {
    use crate::latchctl::{latchctl, run};
    let as_alice = || latchctl(addr, "workload/alice");
    let out = run(as_alice()?.args([
        "--json",
        "acquire",
        "demo/cli-sem",
        "--class",
        SEMAPHORE,
        "--detach",
    ]))
    .await?;
    ensure!(out.status.success(), "acquire: {out:?}");
    let grant: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    // A free slot is picked at random (a burst spreads over them).
    let slot = grant["slot"].as_u64().context("slot")?;
    ensure!(slot < 3, "{grant}");
    let (session, token) = (
        grant["session_id"].as_i64().context("session")?,
        grant["token"].as_u64().context("token")?,
    );
    let out = run(as_alice()?.args(["--json", "inspect", "demo/cli-sem"])).await?;
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        seen["slot_holders"][0]["slot"] == slot && seen["holder"].is_null(),
        "{seen}"
    );
    let out = run(as_alice()?.args(["why", "demo/cli-sem"])).await?;
    let why = String::from_utf8_lossy(&out.stdout);
    ensure!(
        why.contains("is a semaphore") && why.contains(&format!("slot {slot}")),
        "why: {why}"
    );
    ensure!(!why.contains(&token.to_string()), "why printed the token");
    let out = run(as_alice()?.args([
        "release",
        "demo/cli-sem",
        "--session",
        &session.to_string(),
        "--token",
        &token.to_string(),
        "--slot",
        &slot.to_string(),
    ]))
    .await?;
    ensure!(out.status.success(), "release --slot: {out:?}");
    let out = run(as_alice()?.args(["--json", "inspect", "demo/cli-sem"])).await?;
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        seen["slot_holders"].as_array().is_some_and(Vec::is_empty),
        "released: {seen}"
    );
    let out = run(as_alice()?.args([
        "hold",
        "demo/cli-sem",
        "--class",
        SEMAPHORE,
        "--",
        "sh",
        "-c",
        "echo slot=$LATCHKEY_SLOT",
    ]))
    .await?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    ensure!(
        out.status.success() && ["slot=0", "slot=1", "slot=2"].contains(&said.as_str()),
        "hold: {out:?}"
    );
    // `--permits N`: the grant says the class's permits (3 here), which the
    // command sees; any other N is refused before the command runs, the
    // permit released.
    let out = run(as_alice()?.args([
        "hold",
        "demo/cli-sem",
        "--class",
        SEMAPHORE,
        "--permits",
        "3",
        "--",
        "sh",
        "-c",
        "echo permits=$LATCHKEY_PERMITS",
    ]))
    .await?;
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    ensure!(
        out.status.success() && said == "permits=3",
        "hold --permits 3: {out:?}"
    );
    for (class, permits, says) in [
        (SEMAPHORE, "4", "a semaphore of 3 permits"),
        ("demo", "3", "a lock, not a semaphore"),
    ] {
        let key = if class == SEMAPHORE {
            "demo/cli-sem"
        } else {
            "demo/cli-not-sem"
        };
        let out = run(as_alice()?.args([
            "hold",
            key,
            "--class",
            class,
            "--permits",
            permits,
            "--",
            "sh",
            "-c",
            "echo ran",
        ]))
        .await?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success()
                && err.contains(says)
                && !String::from_utf8_lossy(&out.stdout).contains("ran"),
            "hold {key} --permits {permits}: {out:?}"
        );
    }
    let out = run(as_alice()?.args(["--json", "inspect", "demo/cli-sem"])).await?;
    let seen: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        seen["slot_holders"].as_array().is_some_and(Vec::is_empty),
        "a refused --permits released its permit: {seen}"
    );
    Ok(())
}

/// What the contenders saw.
#[derive(Default)]
struct Tally {
    grants: AtomicU64,
    refusals: AtomicU64,
    bad_slots: AtomicU64,
    /// Refusals by code and reason, for the report.
    why: parking_lot::Mutex<BTreeMap<String, u64>>,
}

impl Tally {
    fn refused(&self, s: &tonic::Status) {
        self.refusals.fetch_add(1, Ordering::Relaxed);
        let (code, reason) = crate::support::refusal(s);
        *self
            .why
            .lock()
            .entry(format!("{code:?}/{reason}"))
            .or_insert(0) += 1;
    }
}

/// One contender: sessions of about three seconds each, in which it waits
/// for a permit, holds it for a moment and releases it; it moves to the
/// surviving arbiter when its own stops answering.
async fn contend(
    name: &'static str,
    mut addr: SocketAddr,
    fallback: SocketAddr,
    permits: u32,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) {
    let mut client: Option<Client> = None;
    while !stop.load(Ordering::Relaxed) {
        let c = match &mut client {
            Some(c) => c,
            None => match channel(addr, name).await {
                Ok(ch) => client.insert(LockClient::new(ch)),
                Err(_) => {
                    addr = fallback;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let session = match crate::support::open_class(c, SEMAPHORE).await {
            Ok(s) => s,
            Err(s) => {
                tally.refused(&s);
                client = None;
                addr = fallback;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let opened = Instant::now();
        while !stop.load(Ordering::Relaxed) && opened.elapsed() < Duration::from_secs(3) {
            match wait_lock(c, "demo/pool", SEMAPHORE, session, Duration::from_secs(2)).await {
                Ok(g) => {
                    tally.grants.fetch_add(1, Ordering::Relaxed);
                    if g.slot.is_none_or(|s| s >= permits) {
                        tally.bad_slots.fetch_add(1, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(5..40))).await;
                    let _ = release(c, &g).await;
                }
                Err(s) if s.code() == Code::Unavailable || s.code() == Code::Unknown => {
                    tally.refused(&s);
                    client = None;
                    addr = fallback;
                    break;
                }
                Err(s) => {
                    // a timeout, a bound, an expired session: a new one,
                    // after a pause (a full queue is not retried at once)
                    tally.refused(&s);
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(50..150))).await;
                    break;
                }
            }
        }
        if let Some(c) = &mut client {
            let _ = c
                .close_session(CloseSessionRequest {
                    session_id: session,
                })
                .await;
        }
    }
}

/// Follows every change of the semaphore's slots from `from` on, over any
/// live member (a watch whose member died is reopened on the next one from
/// the revision after the last it saw), and records the most slots held
/// after any revision.
struct Census {
    held: BTreeSet<Vec<u8>>,
    most: usize,
    /// Revisions at which more than `permits` slots were held.
    over: Vec<(i64, usize)>,
    through: i64,
    slot_keys: BTreeSet<String>,
}

async fn census(
    clients: Vec<latchkey_etcd::Client>,
    from: i64,
    permits: usize,
    until: Arc<tokio::sync::watch::Sender<i64>>,
) -> anyhow::Result<Census> {
    let prefix = Layout::new(PREFIX).holder(&slots_of("demo/pool"));
    let mut c = Census {
        held: BTreeSet::new(),
        most: 0,
        over: Vec::new(),
        through: from - 1,
        slot_keys: BTreeSet::new(),
    };
    let mut target = until.subscribe();
    let mut member = 0usize;
    let give_up = Instant::now() + Duration::from_secs(120);
    'members: loop {
        ensure!(
            Instant::now() < give_up,
            "the census could not follow the slots"
        );
        let client = &clients[member % clients.len()];
        member += 1;
        let mut stream = match watch_from(
            client,
            prefix.clone(),
            c.through + 1,
            WatchOptions::new().with_prefix().with_progress_notify(),
        )
        .await
        {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        loop {
            let wanted = *target.borrow();
            if wanted > 0 && c.through >= wanted {
                return Ok(c);
            }
            let msg = tokio::select! {
                m = stream.message() => m,
                _ = target.changed() => continue,
                _ = tokio::time::sleep(Duration::from_secs(2)) => continue 'members,
            };
            let resp = match msg {
                Ok(Some(resp)) => resp,
                _ => continue 'members,
            };
            ensure!(
                !resp.canceled(),
                "the census watch was cancelled (compacted?)"
            );
            let mut at = None;
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                let rev = kv.mod_revision();
                if at.is_some_and(|r| r != rev) {
                    c.judge(at.unwrap_or(rev), permits);
                }
                at = Some(rev);
                c.slot_keys
                    .insert(String::from_utf8_lossy(kv.key()).to_string());
                match event.event_type() {
                    EventType::Put => c.held.insert(kv.key().to_vec()),
                    EventType::Delete => c.held.remove(kv.key()),
                };
            }
            if let Some(rev) = at {
                c.judge(rev, permits);
            }
            if let Some(header) = resp.header() {
                c.through = c.through.max(header.revision());
            }
        }
    }
}

impl Census {
    fn judge(&mut self, revision: i64, permits: usize) {
        self.most = self.most.max(self.held.len());
        if self.held.len() > permits {
            self.over.push((revision, self.held.len()));
        }
        self.through = self.through.max(revision);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_contenders_never_exceed_eight_permits_through_kills() -> anyhow::Result<()> {
    const PERMITS: u32 = 8;
    const CONTENDERS: usize = 200;
    init_tracing();
    let mut cluster = EtcdCluster::start(ClusterOptions {
        members: 3,
        netns: false,
    })
    .await?;
    let dir = policies(PERMITS)?;
    let opts = ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..ArbiterOptions::default()
    };
    let binary = std::path::PathBuf::from(env!("CARGO_BIN_EXE_arbiter-under-test"));
    let endpoints = cluster.endpoints();
    let a =
        ArbiterProcess::start_with(&binary, &endpoints, None, opts.clone(), "info", &[]).await?;
    let mut b = ArbiterProcess::start_with(&binary, &endpoints, None, opts, "info", &[]).await?;

    let mut members = Vec::new();
    for i in 0..cluster.members() {
        members.push(cluster.member_client(i).await?);
    }
    let start = members[0]
        .clone()
        .get("x", None)
        .await?
        .header()
        .context("no header")?
        .revision();
    let until = Arc::new(tokio::sync::watch::channel(0i64).0);
    let watcher = tokio::spawn(census(
        members.clone(),
        start + 1,
        PERMITS as usize,
        until.clone(),
    ));

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let names = ["workload/alice", "workload/bob", "workload/demo"];
    let mut tasks = Vec::new();
    for i in 0..CONTENDERS {
        let (own, other) = match i % 2 {
            0 => (a.addr(), a.addr()),
            _ => (b.addr(), a.addr()),
        };
        tasks.push(tokio::spawn(contend(
            names[i % names.len()],
            own,
            other,
            PERMITS,
            stop.clone(),
            tally.clone(),
        )));
    }
    let mut at = BTreeMap::new();
    tokio::time::sleep(Duration::from_secs(6)).await;
    at.insert(
        "before the arbiter kill",
        tally.grants.load(Ordering::Relaxed),
    );
    b.kill();
    tokio::time::sleep(Duration::from_secs(6)).await;
    at.insert(
        "before the leader kill",
        tally.grants.load(Ordering::Relaxed),
    );
    let leader = cluster.leader().await?;
    cluster.kill(leader)?;
    tokio::time::sleep(Duration::from_secs(8)).await;
    at.insert("at the end", tally.grants.load(Ordering::Relaxed));
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    // The census reads the log up to now.
    let mut now = 0;
    for (i, m) in members.iter().enumerate() {
        if i == leader {
            continue;
        }
        let mut m = m.clone();
        if let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), m.get("x", None)).await {
            now = resp.header().map_or(0, |h| h.revision());
            break;
        }
    }
    ensure!(now > start, "no live member answered");
    until.send_replace(now);
    let census = tokio::time::timeout(Duration::from_secs(60), watcher).await???;
    let grants = tally.grants.load(Ordering::Relaxed);
    eprintln!(
        "{CONTENDERS} contenders on {PERMITS} permits: {grants} grants, {} refusals or retries ({:?}); \
         grants by phase {at:?}; most slots held at once {} over revisions {start}..={now}; \
         slot keys {:?}",
        tally.refusals.load(Ordering::Relaxed),
        tally.why.lock(),
        census.most,
        census.slot_keys,
    );
    ensure!(
        census.over.is_empty(),
        "more slots held than permits at {:?}",
        census.over
    );
    ensure!(census.most <= PERMITS as usize);
    ensure!(
        census.slot_keys.len() <= PERMITS as usize,
        "slots outside 0..{PERMITS}: {:?}",
        census.slot_keys
    );
    ensure!(
        tally.bad_slots.load(Ordering::Relaxed) == 0,
        "a grant without a slot in range"
    );
    let before_b = at["before the arbiter kill"];
    let before_leader = at["before the leader kill"];
    ensure!(before_b > 0, "no grant before the kills");
    ensure!(
        before_leader > before_b && grants > before_leader,
        "no progress after a kill: {at:?}"
    );
    Ok(())
}
