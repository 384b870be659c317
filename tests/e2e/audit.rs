//! The audit tailer (ADR-21) as a real process, tailing a real etcd that a
//! real arbiter writes, into a real PostgreSQL and a real ClickHouse: a
//! SIGKILL mid-stream and a restart lose and repeat nothing, an expiry
//! (which no application code sees) is recorded, a force-release record is
//! recorded while its lease still runs, and compaction past the checkpoint
//! is an explicit gap. An election's observer is told exactly what the
//! store records for it (issue 33).
//!
//! The store is as sensitive as tokens (issue 31): the hostile tests read
//! every cell of every audit table while a hold is live and find neither
//! its token nor its revision in any form; ClickHouse refuses a connection
//! without credentials and refuses its read-only user every write; a store
//! of schema 1 (raw revisions) is moved to ids and its tables dropped.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use latchkey_audit::force::ForceRecord;
use latchkey_audit::store::StoreOptions;
use latchkey_audit::{AuditKey, AuditStore, Ended, Event, Kind, StoredEvent};
use latchkey_etcd::kv::{DeleteOptions, PutOptions};
use latchkey_etcd::txn::{Compare, CompareOp, Txn, TxnOp};
use latchkey_etcd::{Connection, Login, TlsPem};
use latchkey_proto::lockv1::{
    AcquireRequest, CloseSessionRequest, Grant, InspectRequest, Mode, WaitMode,
};
use latchkey_tests::clickhouse::ClickHouseServer;
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::eventually;
use latchkey_tests::postgres::PostgresServer;
use tempfile::TempDir;

use crate::support::*;

const WAIT: Duration = Duration::from_secs(30);
/// A class with a 60 s TTL: the workload's sessions outlive every test
/// without renewals.
const CLASS: &str = "batch-report";

/// A `latchkey-audit` process (the tests' copy), killed on drop.
pub(crate) struct Tailer {
    child: Child,
    log: PathBuf,
    metrics: std::net::SocketAddr,
    _dir: TempDir,
}

impl Tailer {
    pub(crate) fn start(etcd: &EtcdServer, audit: &Audit, extra: &[&str]) -> anyhow::Result<Self> {
        let dir = TempDir::new()?;
        let log = dir.path().join("audit.log");
        let out = std::fs::File::create(&log)?;
        let metrics = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let mut command = Command::new(env!("CARGO_BIN_EXE_audit-under-test"));
        command
            .args(["--etcd", &etcd.endpoint(), "--prefix", "/latchkey"])
            .args(["--metrics-listen", &metrics.to_string()])
            .arg("--audit-key-file")
            .arg(&audit.key_file)
            .args(extra)
            // The store URL from the environment, as deployed.
            .env("LATCHKEY_AUDIT_STORE", &audit.url)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        if let Some(file) = &audit.password_file {
            command.arg("--store-password-file").arg(file);
        }
        let child = command.spawn().context("starting audit-under-test")?;
        Ok(Self {
            child,
            log,
            metrics,
            _dir: dir,
        })
    }

    /// SIGKILL: no flush, no last checkpoint.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn metrics(&self) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.metrics).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
            .await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        Ok(text)
    }
}

impl Drop for Tailer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The store as the tailer writes it: the writer's URL and password file,
/// and the audit key (the test keeps it too, to name the holds it made).
pub(crate) struct Audit {
    url: String,
    password_file: Option<PathBuf>,
    key: AuditKey,
    key_file: PathBuf,
    _dir: TempDir,
}

impl Audit {
    fn new(url: String, password_file: Option<PathBuf>) -> anyhow::Result<Self> {
        let dir = TempDir::new()?;
        let key_file = dir.path().join("audit.key");
        let secret: String = std::iter::repeat_with(fastrand::alphanumeric)
            .take(48)
            .collect();
        std::fs::write(&key_file, format!("{secret}\n"))?;
        Ok(Self {
            url,
            password_file,
            key: AuditKey::read(&key_file)?,
            key_file,
            _dir: dir,
        })
    }

    pub(crate) fn postgres(pg: &PostgresServer) -> anyhow::Result<Self> {
        Self::new(pg.url(), None)
    }

    fn clickhouse(ch: &ClickHouseServer) -> anyhow::Result<Self> {
        Self::new(ch.writer_url(), Some(ch.writer_password_file()))
    }

    /// The store with the tailer's credentials and key (checkpoints are sealed).
    async fn store(&self) -> anyhow::Result<Box<dyn AuditStore>> {
        let password = match &self.password_file {
            Some(f) => Some(std::fs::read_to_string(f)?),
            None => None,
        };
        let options = StoreOptions {
            password,
            audit_key: Some(self.key.clone()),
        };
        Ok(latchkey_audit::store::open_with(&self.url, options).await?)
    }

    /// The id the store gives the hold `key` granted at `revision`.
    fn hold(&self, cluster: u64, revision: i64, key: &str) -> String {
        latchkey_audit::pseudonym::hold_id(Some(&self.key), cluster, revision, key)
            .unwrap_or_default()
    }
}

/// A grant as the test made it: what the store must show.
#[derive(Debug, Clone)]
struct Made {
    key: String,
    revision: i64,
    identity: String,
}

fn made(g: &latchkey_proto::lockv1::Grant, who: &str) -> Made {
    Made {
        key: g.key.clone(),
        revision: g.revision,
        identity: latchkey_tests::arbiter::spiffe(who),
    }
}

/// The events of one key, by kind.
fn on<'a>(events: &'a [StoredEvent], key: &str, kind: Kind) -> Vec<&'a StoredEvent> {
    events
        .iter()
        .filter(|e| e.event.key == key && e.event.kind == kind)
        .collect()
}

/// No event id twice.
fn ensure_unique(events: &[StoredEvent]) -> anyhow::Result<()> {
    let mut seen = HashSet::new();
    for e in events {
        ensure!(
            seen.insert((e.cluster_id, e.event.event_id.clone())),
            "a duplicate event: {e:?}"
        );
    }
    Ok(())
}

/// The events of the hold `id` on `key`, by kind.
fn of_hold<'a>(events: &'a [StoredEvent], key: &str, kind: Kind, id: &str) -> Vec<&'a StoredEvent> {
    on(events, key, kind)
        .into_iter()
        .filter(|e| e.event.hold_id == id)
        .collect()
}

/// Polls the store until `check` passes on everything in it.
async fn store_shows<F>(
    store: &dyn AuditStore,
    cluster: u64,
    tailer: &Tailer,
    what: &str,
    check: F,
) -> anyhow::Result<Vec<StoredEvent>>
where
    F: Fn(&[StoredEvent]) -> anyhow::Result<()>,
{
    let shown = eventually(what, WAIT, || async {
        let events = store.all(cluster).await?;
        check(&events)?;
        Ok(events)
    })
    .await;
    shown.with_context(|| format!("tailer log:\n{}", tailer.log()))
}

async fn checkpoint_reaches(
    store: &dyn AuditStore,
    cluster: u64,
    revision: i64,
) -> anyhow::Result<()> {
    eventually(
        "the checkpoint to reach the last revision",
        WAIT,
        || async {
            let at = store.checkpoint(cluster).await?.unwrap_or(0);
            ensure!(at >= revision, "checkpoint {at} < {revision}");
            Ok(())
        },
    )
    .await
}

/// `n` grants and releases by `who` on a few keys, recorded in `grants`.
async fn grant_and_release(
    c: &mut Client,
    who: &str,
    session: i64,
    from: usize,
    n: usize,
    grants: &mut Vec<Made>,
) -> anyhow::Result<()> {
    for i in from..from + n {
        let g = try_lock(c, &format!("demo/audit{}", i % 3), CLASS, session).await?;
        grants.push(made(&g, who));
        release(c, &g).await?;
    }
    Ok(())
}

/// Kill the tailer mid-stream, before it ever checkpoints, go on without
/// it, restart it: every grant, release and hand-over is in the store
/// exactly once, each end naming its grant's hold, in the log's order.
async fn killed_mid_stream_then_replayed(audit: &Audit) -> anyhow::Result<Vec<StoredEvent>> {
    let s = stack().await?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut bob = s.arbiter.lock("workload/bob").await?;
    let sa = open(&mut alice, CLASS).await?;
    let sb = open(&mut bob, CLASS).await?;

    // No checkpoint before the kill: the restart must replay all of it.
    let mut tailer = Tailer::start(&s.etcd, audit, &["--checkpoint-every", "1h"])?;
    let mut grants = Vec::new();
    grant_and_release(&mut alice, "workload/alice", sa, 0, 10, &mut grants).await?;
    // A hand-over: bob queues behind alice, her release hands the key to him.
    let first = try_lock(&mut alice, "demo/audit-h", CLASS, sa).await?;
    let mut waiter = s.arbiter.lock("workload/bob").await?;
    let queued = tokio::spawn(async move {
        wait_lock(
            &mut waiter,
            "demo/audit-h",
            CLASS,
            sb,
            Duration::from_secs(20),
        )
        .await
    });
    eventually("bob to queue", WAIT, || {
        let mut alice = alice.clone();
        async move {
            let view = alice
                .inspect(InspectRequest {
                    key: "demo/audit-h".into(),
                })
                .await?
                .into_inner();
            ensure!(view.waiters == 1, "{} waiting", view.waiters);
            Ok(())
        }
    })
    .await?;
    release(&mut alice, &first).await?;
    let second = queued.await??;
    let written = grants.len();
    store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the first events",
        |events| {
            ensure!(events.len() > written, "{} events so far", events.len());
            Ok(())
        },
    )
    .await?;
    tailer.kill();
    assert_eq!(store.checkpoint(cluster).await?, None, "no checkpoint yet");

    // Meanwhile, with no tailer running.
    grant_and_release(&mut alice, "workload/alice", sa, 10, 10, &mut grants).await?;
    release(&mut bob, &second).await?;
    let last = s.etcd.revision().await?;

    let tailer = Tailer::start(&s.etcd, audit, &["--checkpoint-every", "1s"])?;
    checkpoint_reaches(store.as_ref(), cluster, last)
        .await
        .with_context(|| format!("tailer log:\n{}", tailer.log()))?;
    let events = store.all(cluster).await?;
    ensure_unique(&events)?;
    for g in &grants {
        let id = audit.hold(cluster, g.revision, &g.key);
        let at = of_hold(&events, &g.key, Kind::Grant, &id);
        ensure!(at.len() == 1, "grant {g:?}: {at:?}");
        ensure!(at[0].event.identity == g.identity, "{at:?}");
        let ends = of_hold(&events, &g.key, Kind::Release, &id);
        ensure!(ends.len() == 1, "release of {g:?}: {ends:?}");
        ensure!(ends[0].event.ended == Ended::Released);
        ensure!(
            at[0].position < ends[0].position,
            "the release before its grant: {at:?} {ends:?}"
        );
    }
    let handed = on(&events, "demo/audit-h", Kind::HandOver);
    ensure!(handed.len() == 1, "{handed:?}");
    let h = &handed[0].event;
    ensure!(h.hold_id == audit.hold(cluster, second.revision, "demo/audit-h"));
    ensure!(h.prev_hold_id == audit.hold(cluster, first.revision, "demo/audit-h"));
    ensure!(h.identity.ends_with("/workload/bob") && h.prev_identity.ends_with("/workload/alice"));
    let bobs_end = of_hold(&events, "demo/audit-h", Kind::Release, &h.hold_id);
    ensure!(
        bobs_end.len() == 1,
        "bob's release names his hold: {events:#?}"
    );
    let hold_events = events.iter().filter(|e| e.event.key.starts_with("demo/"));
    // 20 grants and releases, alice's grant, the hand-over, bob's release
    ensure!(hold_events.count() == 2 * 20 + 3, "{events:#?}");
    ensure!(
        !on(&events, latchkey_audit::event::EPOCH_KEY, Kind::EpochCreate).is_empty(),
        "the first epoch record is recorded"
    );
    Ok(events)
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_killed_tailer_replays_without_duplicates_or_losses() -> anyhow::Result<()> {
    let pg = PostgresServer::start().await?;
    killed_mid_stream_then_replayed(&Audit::postgres(&pg)?).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn clickhouse_killed_tailer_replays_without_duplicates_or_losses() -> anyhow::Result<()> {
    let ch = ClickHouseServer::start().await?;
    let events = killed_mid_stream_then_replayed(&Audit::clickhouse(&ch)?).await?;
    // The replay inserted copies; once merged, each event is one row.
    ch.query("OPTIMIZE TABLE latchkey_audit.latchkey_audit_events_v2 FINAL")
        .await?;
    let rows = ch
        .query("SELECT count() FROM latchkey_audit.latchkey_audit_events_v2")
        .await?;
    assert_eq!(rows.trim(), events.len().to_string());
    Ok(())
}

/// Expiry, CloseSession and a force-release, each recorded with its cause.
#[tokio::test(flavor = "multi_thread")]
async fn expiries_closed_sessions_and_force_releases_are_recorded() -> anyhow::Result<()> {
    let s = stack().await?;
    let pg = PostgresServer::start().await?;
    let audit = Audit::postgres(&pg)?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let tailer = Tailer::start(&s.etcd, &audit, &["--checkpoint-every", "1s"])?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut bob = s.arbiter.lock("workload/bob").await?;

    // A 5 s session that is never renewed.
    let short = open(&mut alice, "short").await?;
    let expiring = try_lock(&mut alice, "demo/audit-exp", "short", short).await?;
    // A session closed while it holds a key.
    let closing = open(&mut bob, CLASS).await?;
    let closed = try_lock(&mut bob, "demo/audit-closed", CLASS, closing).await?;
    bob.close_session(CloseSessionRequest {
        session_id: closing,
    })
    .await?;
    // A force-release in the shape ADR-20's transaction writes (force.rs).
    let session = open(&mut alice, CLASS).await?;
    let stuck = try_lock(&mut alice, "demo/audit-forced", CLASS, session).await?;
    let record = ForceRecord {
        key: stuck.key.clone(),
        hold_revision: stuck.revision,
        request_id: "fr-e2e".into(),
        requested_by: "op-one".into(),
        approved_by: "op-two".into(),
        reason: "renewing, never releasing".into(),
        enforcement: "fenced".into(),
        holder_identity: latchkey_tests::arbiter::spiffe("workload/alice"),
        holder_session: session,
        class: CLASS.into(),
        revoke_session: false,
        requested_at_unix_ms: 1,
        approved_at_unix_ms: 2,
        revoked_session: false,
        issuer: "https://sso.example".into(),
        requester_identity: latchkey_tests::arbiter::spiffe("operator/one"),
        approver_identity: latchkey_tests::arbiter::spiffe("operator/two"),
        election: false,
        term: 0,
    };
    let mut etcd = s.etcd.client().await?;
    let lease = etcd.lease_grant(24 * 3600, None).await?.id();
    let holder = format!("/latchkey/l/{}", stuck.key);
    let txn = Txn::new()
        .when([Compare::mod_revision(
            holder.clone(),
            CompareOp::Equal,
            stuck.revision,
        )])
        .and_then([
            TxnOp::delete(holder, None),
            TxnOp::delete(
                format!("/latchkey/c/{}//", stuck.key),
                Some(DeleteOptions::new().with_prefix()),
            ),
            TxnOp::put(
                latchkey_records::Layout::new("/latchkey").force_record(&record.request_id),
                serde_json::to_vec(&record)?,
                Some(PutOptions::new().with_lease(lease)),
            ),
        ]);
    let forced = etcd.txn(txn).await?;
    ensure!(forced.succeeded(), "the force transaction did not apply");

    let events = store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the three endings",
        |events| {
            let find = |key: &str, kind| on(events, key, kind).into_iter().next().cloned();
            let Some(exp) = find("demo/audit-exp", Kind::Expiry) else {
                bail!("no expiry yet")
            };
            ensure!(exp.event.ended == Ended::ExpiredOrRevoked, "{exp:?}");
            ensure!(
                exp.event.hold_id == audit.hold(cluster, expiring.revision, &expiring.key),
                "{exp:?}"
            );
            ensure!(exp.event.identity.ends_with("/workload/alice"), "{exp:?}");
            let Some(closed_event) = find("demo/audit-closed", Kind::Release) else {
                bail!("no close yet")
            };
            ensure!(
                closed_event.event.ended == Ended::SessionClosed,
                "{closed_event:?}"
            );
            ensure!(
                closed_event.event.hold_id == audit.hold(cluster, closed.revision, &closed.key)
            );
            let Some(force) = find("demo/audit-forced", Kind::ForceRelease) else {
                bail!("no force-release yet")
            };
            ensure!(force.event.hold_id == audit.hold(cluster, stuck.revision, &stuck.key));
            ensure!(force.event.detail["requestedBy"] == "op-one");
            ensure!(force.event.detail["approvedBy"] == "op-two");
            ensure!(force.event.detail["reason"] == "renewing, never releasing");
            Ok(())
        },
    )
    .await?;
    ensure_unique(&events)?;
    // Recorded while the record's lease still runs (ADR-20: before it expires).
    let ttl = etcd.lease_time_to_live(lease, None).await?.ttl();
    ensure!(ttl > 0, "the force record's lease ended first");
    // The tokens are in nothing the tailer wrote to its log.
    let log = tailer.log();
    for g in [&expiring, &closed, &stuck] {
        ensure!(!log.contains(&g.token.to_string()), "a token in the log");
    }

    // latchctl audit: the key's history, oldest first.
    let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
        .args(["--json", "audit", "demo/audit-forced", "--since", "1h"])
        .args(["--store", &pg.url()])
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kinds: Vec<String> = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).map(|v| v["kind"].to_string()))
        .collect::<Result<_, _>>()?;
    ensure!(kinds == ["\"grant\"", "\"force-release\""], "{stdout}");
    ensure!(
        !stdout.contains(&stuck.token.to_string()),
        "a token in latchctl audit"
    );

    // latchctl why: the holder (her own session shown to her), the waiters,
    // the last events.
    let held = try_lock(&mut alice, "demo/audit-why", CLASS, session).await?;
    let shown = eventually("latchctl why to show the grant", WAIT, || async {
        let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
            .args(["why", "demo/audit-why", "--store", &pg.url()])
            .output()
            .await?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        ensure!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        ensure!(stdout.contains(" grant "), "{stdout}");
        Ok(stdout)
    })
    .await?;
    ensure!(
        shown.contains("demo/audit-why is held by spiffe://dev.latchkey/workload/alice (session"),
        "{shown}"
    );
    ensure!(shown.contains("0 waiting"), "{shown}");
    ensure!(
        !shown.contains(&held.token.to_string()),
        "a token in latchctl why"
    );
    Ok(())
}

/// A try-lock of `key` in `mode = SHARED`.
async fn try_shared(c: &mut Client, key: &str, session: i64) -> anyhow::Result<Grant> {
    let grant = c
        .acquire(AcquireRequest {
            key: key.into(),
            class: CLASS.into(),
            session_id: session,
            wait: WaitMode::WaitNone.into(),
            metadata: Default::default(),
            instance: String::new(),
            mode: Mode::Shared.into(),
            downgrade_from: None,
        })
        .await?
        .into_inner()
        .grant;
    grant.context("no grant")
}

/// Shared holds (issue 34) are lock keys of their own (`K//r/<session>`),
/// recorded under the lock's name `K` with `detail.mode` and the session,
/// each reader its own hold; a downgrade is the exclusive hold's release
/// and a shared grant at one revision, both marked. `latchctl audit K` and
/// `latchctl why K` (the store read by the name) show them all.
#[tokio::test(flavor = "multi_thread")]
async fn shared_holds_and_a_downgrade_are_recorded_under_the_locks_name() -> anyhow::Result<()> {
    let s = stack().await?;
    let pg = PostgresServer::start().await?;
    let audit = Audit::postgres(&pg)?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let tailer = Tailer::start(&s.etcd, &audit, &["--checkpoint-every", "1s"])?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut bob = s.arbiter.lock("workload/bob").await?;
    let key = "demo/audit-rw";
    let reader = |session| latchkey_records::reader_key(key, session);

    let (sa, sb) = (open(&mut alice, CLASS).await?, open(&mut bob, CLASS).await?);
    let ra = try_shared(&mut alice, key, sa).await?;
    let rb = try_shared(&mut bob, key, sb).await?;
    release(&mut bob, &rb).await?;
    release(&mut alice, &ra).await?;
    // alice's exclusive hold, then her shared request of it: a downgrade
    let w = try_lock(&mut alice, key, CLASS, sa).await?;
    let d = try_shared(&mut alice, key, sa).await?;
    ensure!(
        d.mode == i32::from(Mode::Shared) && d.revision > w.revision,
        "{d:?}"
    );

    let shared = |e: &StoredEvent, session: i64| {
        e.event.detail["mode"] == "shared" && e.event.detail["session"] == session
    };
    let events = store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the readers and the downgrade",
        |events| {
            let mine: Vec<&StoredEvent> = events.iter().filter(|e| e.event.key == key).collect();
            ensure!(mine.len() == 7, "{} events of {key} so far", mine.len());
            let is = |i: usize, kind: Kind, hold: &str| {
                let e = mine[i];
                e.event.kind == kind && e.event.hold_id == hold
            };
            let (ha, hb) = (
                audit.hold(cluster, ra.revision, &reader(sa)),
                audit.hold(cluster, rb.revision, &reader(sb)),
            );
            let (hw, hd) = (
                audit.hold(cluster, w.revision, key),
                audit.hold(cluster, d.revision, &reader(sa)),
            );
            ensure!(ha != hb && hw != hd, "each hold its own id");
            ensure!(is(0, Kind::Grant, &ha) && shared(mine[0], sa), "{mine:?}");
            ensure!(is(1, Kind::Grant, &hb) && shared(mine[1], sb), "{mine:?}");
            ensure!(is(2, Kind::Release, &hb) && shared(mine[2], sb), "{mine:?}");
            ensure!(is(3, Kind::Release, &ha) && shared(mine[3], sa), "{mine:?}");
            ensure!(is(4, Kind::Grant, &hw) && mine[4].event.detail.get("mode").is_none());
            ensure!(
                is(5, Kind::Release, &hw)
                    && mine[5].event.ended == Ended::Released
                    && mine[5].event.detail["downgrade"] == true
                    && mine[5].event.detail.get("mode").is_none(),
                "{mine:?}"
            );
            ensure!(
                is(6, Kind::Grant, &hd)
                    && shared(mine[6], sa)
                    && mine[6].event.detail["downgrade"] == true,
                "{mine:?}"
            );
            ensure!(
                mine.iter().all(|e| e.event.session != 0),
                "every holder known"
            );
            Ok(())
        },
    )
    .await?;
    ensure_unique(&events)?;
    ensure!(
        events.iter().all(|e| !e.event.key.contains("//")),
        "no event under a reader's own key: {events:?}"
    );

    // latchctl audit: the store read by the lock's name
    let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
        .args(["--json", "audit", key, "--since", "1h"])
        .args(["--store", &pg.url()])
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let modes: Vec<(&str, Option<&str>)> = lines
        .iter()
        .map(|l| {
            (
                l["kind"].as_str().unwrap_or_default(),
                l["detail"]["mode"].as_str(),
            )
        })
        .collect();
    let shared_mode = Some("shared");
    ensure!(
        modes
            == [
                ("grant", shared_mode),
                ("grant", shared_mode),
                ("release", shared_mode),
                ("release", shared_mode),
                ("grant", None),
                ("release", None),
                ("grant", shared_mode),
            ],
        "{stdout}"
    );
    for g in [&ra, &rb, &w, &d] {
        ensure!(
            !stdout.contains(&g.token.to_string()),
            "a token in latchctl audit"
        );
    }

    // latchctl why: held shared, and the last events say which holds
    let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
        .args(["why", key, "--store", &pg.url()])
        .output()
        .await?;
    let why = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{why}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(why.contains(&format!("{key} is held shared")), "{why}");
    ensure!(why.contains(" [downgrade] hold "), "{why}");
    ensure!(why.contains(" [shared, downgrade] class "), "{why}");
    ensure!(
        !why.contains(&d.token.to_string()),
        "a token in latchctl why"
    );
    Ok(())
}

/// A force-release that revokes the holder's session, made through the
/// arbiter's Admin API with real operators' ID tokens: the released key is
/// a force-release, the session's other hold ends `force-revoked` (not the
/// `expired-or-revoked` a lapse or a hand-made revoke reads as, shown on
/// bob's session), and `latchctl audit` says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_force_release_that_revokes_the_session_reads_as_a_revocation() -> anyhow::Result<()> {
    use latchkey_proto::adminv1::{ApproveForceReleaseRequest, RequestForceReleaseRequest};
    use latchkey_tests::arbiter::ArbiterOptions;

    let oidc = crate::force_release::provider(None).await?;
    let s = stack_with(ArbiterOptions {
        force_release: crate::force_release::config(&oidc, false),
        ..ArbiterOptions::default()
    })
    .await?;
    let pg = PostgresServer::start().await?;
    let audit = Audit::postgres(&pg)?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let tailer = Tailer::start(&s.etcd, &audit, &["--checkpoint-every", "1s"])?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut bob = s.arbiter.lock("workload/bob").await?;

    let session = open(&mut alice, CLASS).await?;
    let forced = try_lock(&mut alice, "demo/audit-rv-forced", CLASS, session).await?;
    let other = try_lock(&mut alice, "demo/audit-rv-other", CLASS, session).await?;
    // bob's session revoked by hand: etcd cannot tell that from a lapse
    let bobs = open(&mut bob, CLASS).await?;
    let by_hand = try_lock(&mut bob, "demo/audit-rv-hand", CLASS, bobs).await?;
    s.etcd.client().await?.lease_revoke(bobs).await?;

    let mut admin = s.arbiter.admin("latchkey/operator").await?;
    let req = admin
        .request_force_release(RequestForceReleaseRequest {
            key: forced.key.clone(),
            reason: "the whole worker is wedged".into(),
            revoke_session: true,
            id_token: oidc.id_token("alice-op", "latchctl").await?,
            election: false,
            slot: None,
            shared_session: None,
        })
        .await?
        .into_inner();
    let done = admin
        .approve_force_release(ApproveForceReleaseRequest {
            request_id: req.request_id.clone(),
            id_token: oidc.id_token("bob-op", "latchctl").await?,
        })
        .await?
        .into_inner();
    ensure!(done.session_revoked, "{}", done.session_revoke_error);
    // the marker outlives the session, on a lease of its own
    let marker = s
        .etcd
        .client()
        .await?
        .get(layout().revoked_session(session), None)
        .await?;
    let kv = marker.kvs().first().context("no sys/revoked marker")?;
    ensure!(kv.lease() != 0 && kv.lease() != session, "{kv:?}");
    let marker: serde_json::Value = serde_json::from_slice(kv.value())?;
    ensure!(marker["requestId"] == req.request_id.as_str(), "{marker}");
    // no grant on the revoked session
    ensure!(
        try_lock(&mut alice, "demo/audit-rv-after", CLASS, session)
            .await
            .is_err(),
        "granted on a revoked session"
    );

    let events = store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the force-release, the revocation and the hand-made revoke",
        |events| {
            let ended = |key: &str| {
                events
                    .iter()
                    .find(|e| e.event.key == key && e.event.ended != Ended::No)
            };
            let (Some(f), Some(o), Some(h)) =
                (ended(&forced.key), ended(&other.key), ended(&by_hand.key))
            else {
                bail!("not all ended yet: {events:?}")
            };
            ensure!(f.event.kind == Kind::ForceRelease, "{f:?}");
            ensure!(
                (o.event.kind, o.event.ended) == (Kind::Release, Ended::ForceRevoked),
                "{o:?}"
            );
            ensure!(
                o.event.hold_id == audit.hold(cluster, other.revision, &other.key),
                "{o:?}"
            );
            ensure!(o.event.detail["approvedBy"] == "bob-op", "{o:?}");
            ensure!(o.event.detail["requestedBy"] == "alice-op", "{o:?}");
            ensure!(
                o.event.detail["revokedWith"] == forced.key.as_str(),
                "{o:?}"
            );
            ensure!(
                (h.event.kind, h.event.ended) == (Kind::Expiry, Ended::ExpiredOrRevoked),
                "{h:?}"
            );
            Ok(())
        },
    )
    .await?;
    ensure_unique(&events)?;

    let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
        .args(["audit", "demo/audit-rv-other", "--since", "1h"])
        .args(["--store", &pg.url()])
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(out.status.success(), "{stdout}{out:?}");
    ensure!(
        stdout.contains("its session was revoked by an operator's force-release"),
        "{stdout}"
    );
    Ok(())
}

/// etcd compacts past the checkpoint while the tailer is down: the restart
/// records the lost revisions as one gap (how many, not which) and carries
/// on after them.
#[tokio::test(flavor = "multi_thread")]
async fn compaction_past_the_checkpoint_is_an_explicit_gap() -> anyhow::Result<()> {
    let s = stack().await?;
    let pg = PostgresServer::start().await?;
    let audit = Audit::postgres(&pg)?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let sa = open(&mut alice, CLASS).await?;
    let mut grants = Vec::new();

    let mut tailer = Tailer::start(&s.etcd, &audit, &["--checkpoint-every", "1s"])?;
    grant_and_release(&mut alice, "workload/alice", sa, 0, 3, &mut grants).await?;
    let checkpointed = s.etcd.revision().await?;
    checkpoint_reaches(store.as_ref(), cluster, checkpointed).await?;
    tailer.kill();

    let mut lost = Vec::new();
    grant_and_release(&mut alice, "workload/alice", sa, 3, 3, &mut lost).await?;
    let compacted = s.etcd.revision().await?;
    s.etcd.client().await?.compact(compacted, None).await?;

    let tailer = Tailer::start(&s.etcd, &audit, &["--checkpoint-every", "1s"])?;
    let g = try_lock(&mut alice, "demo/audit-after", CLASS, sa).await?;
    let after = audit.hold(cluster, g.revision, &g.key);
    let events = store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the gap and later events",
        |events| {
            ensure!(
                events.iter().any(|e| e.event.hold_id == after),
                "not past the gap yet"
            );
            Ok(())
        },
    )
    .await?;
    let gaps: Vec<_> = events
        .iter()
        .filter(|e| e.event.kind == Kind::Gap)
        .collect();
    ensure!(gaps.len() == 1, "{gaps:?}");
    ensure!(
        gaps[0].event.detail["revisions"] == compacted - checkpointed,
        "{gaps:?}"
    );
    let ids = |ms: &[Made]| -> HashSet<String> {
        ms.iter()
            .map(|m| audit.hold(cluster, m.revision, &m.key))
            .collect()
    };
    let (kept, gone) = (ids(&grants), ids(&lost));
    ensure!(
        events.iter().all(|e| !gone.contains(&e.event.hold_id)),
        "events inside the gap: {events:#?}"
    );
    let shown: HashSet<&str> = events.iter().map(|e| e.event.hold_id.as_str()).collect();
    ensure!(kept.iter().all(|id| shown.contains(id.as_str())));
    // In the log's order: the earlier grants, the gap, the grant after it.
    let position = |id: &str| {
        events
            .iter()
            .find(|e| e.event.hold_id == id)
            .map(|e| e.position)
    };
    ensure!(kept.iter().all(|id| position(id) < Some(gaps[0].position)));
    ensure!(position(&after) > Some(gaps[0].position));
    let metrics = tailer.metrics().await?;
    ensure!(metrics.contains("latchkey_audit_gaps_total 1"), "{metrics}");
    ensure!(metrics.contains("latchkey_audit_lag_alarm 0"), "{metrics}");
    Ok(())
}

/// The tailer needs only READ on the prefix: with etcd's auth on, a user
/// whose one role reads `/latchkey` tails the arbiter's grants, and the
/// same credential cannot write a hold.
#[tokio::test(flavor = "multi_thread")]
async fn a_read_only_etcd_role_is_all_the_tailer_needs() -> anyhow::Result<()> {
    use latchkey_arbiter::{EtcdClientCert, EtcdCredentials, EtcdUser};
    use latchkey_tests::arbiter::{Arbiter, ArbiterOptions};
    use latchkey_tests::etcd::{EtcdOptions, EtcdTls};

    latchkey_tests::init_tracing();
    let mut etcd = EtcdServer::start_with(EtcdOptions {
        tls: Some(EtcdTls::mutual()?),
    })
    .await?;
    etcd.enable_auth("root-password").await?;
    etcd.add_user("latchkey-arbiter", "arbiter-password", "/latchkey")
        .await?;
    let mut root = etcd.client().await?;
    root.role_add("latchkey-audit-ro").await?;
    root.role_grant_permission(
        "latchkey-audit-ro",
        latchkey_etcd::auth::Permission::read("/latchkey/").with_prefix(),
    )
    .await?;
    root.user_add("latchkey-audit", "audit-password", None)
        .await?;
    root.user_grant_role("latchkey-audit", "latchkey-audit-ro")
        .await?;

    let tls = etcd
        .tls()
        .ok_or_else(|| anyhow::anyhow!("etcd without TLS"))?
        .clone();
    let cert = tls.arbiter_cert()?;
    let dir = TempDir::new()?;
    let arbiter_password = dir.path().join("arbiter-password");
    std::fs::write(&arbiter_password, "arbiter-password")?;
    let audit_password = dir.path().join("audit-password");
    std::fs::write(&audit_password, "audit-password\n")?;
    let arbiter = Arbiter::start(
        &etcd,
        ArbiterOptions {
            etcd_credentials: EtcdCredentials {
                ca: Some(tls.ca.clone()),
                client_cert: Some(EtcdClientCert {
                    cert: cert.cert.clone(),
                    key: cert.key.clone(),
                }),
                user: Some(EtcdUser {
                    name: "latchkey-arbiter".into(),
                    password_file: arbiter_password,
                }),
            },
            ..ArbiterOptions::default()
        },
    )
    .await?;
    let pg = PostgresServer::start().await?;
    let audit = Audit::postgres(&pg)?;
    let cluster = etcd.cluster_id().await?;
    let store = audit.store().await?;
    let path = |p: &std::path::Path| p.display().to_string();
    let tailer = Tailer::start(
        &etcd,
        &audit,
        &[
            "--etcd-ca",
            &path(&tls.ca),
            "--etcd-cert",
            &path(&cert.cert),
            "--etcd-key",
            &path(&cert.key),
            "--etcd-user",
            "latchkey-audit",
            "--etcd-password-file",
            &path(&audit_password),
        ],
    )?;
    let mut alice = arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, CLASS).await?;
    let g = try_lock(&mut alice, "demo/audit-ro", CLASS, session).await?;
    let id = audit.hold(cluster, g.revision, &g.key);
    store_shows(store.as_ref(), cluster, &tailer, "the grant", |events| {
        ensure!(
            !of_hold(events, &g.key, Kind::Grant, &id).is_empty(),
            "not yet"
        );
        Ok(())
    })
    .await?;
    ensure!(
        !tailer.log().contains("audit-password"),
        "the password is in the log"
    );

    // The tailer's credential reads, and cannot write a grant.
    let connection = Connection {
        tls: Some(TlsPem {
            ca: std::fs::read(&tls.ca)?,
            identity: Some((std::fs::read(&cert.cert)?, std::fs::read(&cert.key)?)),
        }),
        login: Some(Login::new("latchkey-audit", "audit-password")),
        ..Connection::new([etcd.endpoint()])
    };
    let mut reader = latchkey_etcd::connect(&connection).await?;
    let held = reader.get("/latchkey/l/demo/audit-ro", None).await?;
    ensure!(held.kvs().len() == 1, "the reader reads the hold");
    let write = reader.put("/latchkey/l/demo/forged", "{}", None).await;
    let err = match write {
        Ok(_) => bail!("the read-only credential wrote a hold"),
        Err(e) => e.to_string(),
    };
    ensure!(err.contains("permission denied"), "{err}");
    Ok(())
}

/// With the store gone, the tailer falls behind; past half the compaction
/// window its alarm metric says so (before etcd compacts what it has not
/// written).
#[tokio::test(flavor = "multi_thread")]
async fn the_lag_alarm_fires_at_half_the_compaction_window() -> anyhow::Result<()> {
    let s = stack().await?;
    let pg = PostgresServer::start().await?;
    let audit = Audit::postgres(&pg)?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let tailer = Tailer::start(
        &s.etcd,
        &audit,
        &[
            "--checkpoint-every",
            "1s",
            "--compaction-window-revisions",
            "8",
        ],
    )?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let sa = open(&mut alice, CLASS).await?;
    let mut grants = Vec::new();
    grant_and_release(&mut alice, "workload/alice", sa, 0, 1, &mut grants).await?;
    checkpoint_reaches(store.as_ref(), cluster, s.etcd.revision().await?).await?;
    let metric = |line: &'static str| {
        let tailer = &tailer;
        move || async move {
            let text = tailer.metrics().await?;
            ensure!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
            Ok(())
        }
    };
    eventually(
        "no alarm while caught up",
        WAIT,
        metric("latchkey_audit_lag_alarm 0"),
    )
    .await?;

    drop(store);
    drop(pg);
    // Ten revisions the tailer cannot write: more than half of eight.
    grant_and_release(&mut alice, "workload/alice", sa, 1, 5, &mut grants).await?;
    eventually("the lag alarm", WAIT, metric("latchkey_audit_lag_alarm 1"))
        .await
        .with_context(|| format!("tailer log:\n{}", tailer.log()))?;
    Ok(())
}

/// Every spelling of the numbers a reader must not find: the token and
/// its revision, in decimal and hex (bare, `0x`, zero-padded, either
/// case), and `epoch:revision` as operators' tools print a grant.
struct Secrets {
    numbers: Vec<u64>,
    words: HashSet<String>,
    decimals: HashSet<String>,
    pairs: Vec<String>,
}

impl Secrets {
    fn of(numbers: &[u64], pairs: Vec<String>) -> Self {
        let mut words = HashSet::new();
        let mut decimals = HashSet::new();
        for n in numbers {
            decimals.insert(n.to_string());
            for w in [
                n.to_string(),
                format!("{n:x}"),
                format!("0x{n:x}"),
                format!("{n:016x}"),
                format!("0x{n:016x}"),
            ] {
                words.insert(w);
            }
        }
        Self {
            numbers: numbers.to_vec(),
            words,
            decimals,
            pairs,
        }
    }

    fn of_grant(g: &latchkey_proto::lockv1::Grant) -> Self {
        let revision = u64::try_from(g.revision).unwrap_or_default();
        Self::of(
            &[g.token, revision],
            vec![
                format!("{}:{}", g.epoch, g.revision),
                format!("e{}:r{}", g.epoch, g.revision),
            ],
        )
    }

    /// Fails naming `place` if `value` (a cell, or JSON inside one) holds a secret.
    fn check(&self, place: &str, value: &serde_json::Value) -> anyhow::Result<()> {
        use serde_json::Value;
        match value {
            Value::Number(n) => {
                let hit = self.numbers.iter().any(|s| {
                    n.as_u64() == Some(*s)
                        || n.as_i64().and_then(|i| u64::try_from(i).ok()) == Some(*s)
                });
                ensure!(!hit, "{place}: the number {n}");
            }
            Value::String(text) => {
                if let Ok(inner) = serde_json::from_str::<Value>(text)
                    && !inner.is_string()
                {
                    self.check(place, &inner)?;
                }
                self.check_text(place, text)?;
            }
            Value::Array(items) => {
                for item in items {
                    self.check(place, item)?;
                }
            }
            Value::Object(map) => {
                for (name, item) in map {
                    self.check(&format!("{place}.{name}"), item)?;
                }
            }
            Value::Bool(_) | Value::Null => {}
        }
        Ok(())
    }

    fn check_text(&self, place: &str, text: &str) -> anyhow::Result<()> {
        for pair in &self.pairs {
            ensure!(
                !text.contains(pair.as_str()),
                "{place}: {pair:?} in {text:?}"
            );
        }
        for word in text.split(|c: char| !c.is_ascii_alphanumeric()) {
            let lower = word.to_ascii_lowercase();
            ensure!(
                !self.words.contains(&lower),
                "{place}: {word:?} in {text:?}"
            );
            // "r1234" and the like; not inside hex ids, whose digit runs are chance.
            if !word.chars().all(|c| c.is_ascii_hexdigit()) {
                for run in word.split(|c: char| !c.is_ascii_digit()) {
                    ensure!(
                        !self.decimals.contains(run),
                        "{place}: {word:?} in {text:?}"
                    );
                }
            }
        }
        Ok(())
    }
}

/// The audit database as a reader sees it: every row of every table.
enum Tables<'a> {
    ClickHouse(&'a ClickHouseServer),
    Postgres(&'a PostgresServer),
}

impl Tables<'_> {
    async fn rows(&self) -> anyhow::Result<Vec<(String, serde_json::Value)>> {
        use latchkey_tests::clickhouse::{DATABASE, READER};
        let mut out = Vec::new();
        match self {
            Tables::ClickHouse(ch) => {
                let reader = Some((READER, ch.reader_password()));
                let names = ch
                    .query_as(
                        reader,
                        &format!(
                            "SELECT name FROM system.tables WHERE database = '{DATABASE}' FORMAT TSV"
                        ),
                    )
                    .await?;
                for table in names.lines().filter(|l| !l.is_empty()) {
                    let rows = ch
                        .query_as(
                            reader,
                            &format!("SELECT * FROM {DATABASE}.{table} FORMAT JSONEachRow"),
                        )
                        .await?;
                    for line in rows.lines().filter(|l| !l.is_empty()) {
                        out.push((table.to_string(), serde_json::from_str(line)?));
                    }
                }
            }
            Tables::Postgres(pg) => {
                let client = pg.client().await?;
                let names = client
                    .query(
                        "SELECT table_name::text FROM information_schema.tables \
                         WHERE table_schema = 'public' AND table_name LIKE 'latchkey_audit%'",
                        &[],
                    )
                    .await?;
                for name in names {
                    let table: String = name.get(0);
                    let rows = client
                        .query(
                            &format!("SELECT row_to_json(t)::text FROM \"{table}\" t"),
                            &[],
                        )
                        .await?;
                    for row in rows {
                        let text: String = row.get(0);
                        out.push((table.clone(), serde_json::from_str(&text)?));
                    }
                }
            }
        }
        Ok(out)
    }

    async fn ensure_none_holds(&self, secrets: &Secrets) -> anyhow::Result<usize> {
        let rows = self.rows().await?;
        for (table, row) in &rows {
            secrets
                .check(table, row)
                .with_context(|| format!("in the row {row}"))?;
        }
        Ok(rows.len())
    }
}

/// Grants a hold that stays live, after etcd's revision has passed 300
/// (so its spellings are no small numbers), and waits until the store has
/// its grant and a checkpoint at or past it; then no cell of any table,
/// no metric and no line of the tailer's log spells its token or revision.
async fn no_trace_of_a_live_token(audit: &Audit, tables: Tables<'_>) -> anyhow::Result<()> {
    let s = stack().await?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let tailer = Tailer::start(&s.etcd, audit, &["--checkpoint-every", "1s"])?;
    let mut etcd = s.etcd.client().await?;
    while s.etcd.revision().await? < 300 {
        etcd.put("/elsewhere/padding", "x", None).await?;
    }
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, CLASS).await?;
    let mut done = Vec::new();
    grant_and_release(&mut alice, "workload/alice", session, 0, 2, &mut done).await?;
    let live = try_lock(&mut alice, "demo/audit-live", CLASS, session).await?;
    ensure!(
        Some(live.token) == latchkey_records::token::pack(live.epoch, live.revision),
        "{live:?}"
    );
    let id = audit.hold(cluster, live.revision, &live.key);
    store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the live grant",
        |events| {
            ensure!(!of_hold(events, &live.key, Kind::Grant, &id).is_empty());
            Ok(())
        },
    )
    .await?;
    checkpoint_reaches(store.as_ref(), cluster, live.revision).await?;

    let view = alice
        .inspect(InspectRequest {
            key: live.key.clone(),
        })
        .await?
        .into_inner();
    ensure!(view.holder.is_some(), "the hold is still live");
    let secrets = Secrets::of_grant(&live);
    let rows = tables.ensure_none_holds(&secrets).await?;
    ensure!(rows >= 6, "{rows} rows: the dump read nothing?");
    let metrics = tailer.metrics().await?;
    for line in metrics.lines().filter(|l| !l.starts_with('#')) {
        secrets.check_text("the tailer's metrics", line)?;
    }
    for line in tailer.log().lines() {
        // Past the timestamp: its digit runs are the clock's.
        let rest = line.split_once(' ').map_or(line, |(_, r)| r);
        secrets.check_text("the tailer's log", rest)?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn no_clickhouse_cell_rebuilds_a_live_token() -> anyhow::Result<()> {
    let ch = ClickHouseServer::start().await?;
    no_trace_of_a_live_token(&Audit::clickhouse(&ch)?, Tables::ClickHouse(&ch)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn no_postgres_cell_rebuilds_a_live_token() -> anyhow::Result<()> {
    let pg = PostgresServer::start().await?;
    no_trace_of_a_live_token(&Audit::postgres(&pg)?, Tables::Postgres(&pg)).await
}

/// ClickHouse as dev-up and the tests run it: no connection without a
/// password, no wrong one, and the readers' user (`readonly = 1`) reads
/// the history and can change nothing, by SQL or through the library.
#[tokio::test(flavor = "multi_thread")]
async fn clickhouse_refuses_strangers_and_its_reader_every_write() -> anyhow::Result<()> {
    use latchkey_tests::clickhouse::{DATABASE, READER, WRITER};
    let ch = ClickHouseServer::start().await?;
    let audit = Audit::clickhouse(&ch)?;
    let s = stack().await?;
    let cluster = s.etcd.cluster_id().await?;
    let tailer = Tailer::start(&s.etcd, &audit, &["--checkpoint-every", "1s"])?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, CLASS).await?;
    let g = try_lock(&mut alice, "demo/audit-ro-ch", CLASS, session).await?;
    let reader = latchkey_audit::store::open_with(
        &ch.reader_url(),
        StoreOptions {
            password: Some(ch.reader_password().to_string()),
            audit_key: None,
        },
    )
    .await?;
    let id = audit.hold(cluster, g.revision, &g.key);
    let before = store_shows(
        reader.as_ref(),
        cluster,
        &tailer,
        "the grant, as the reader",
        |events| {
            ensure!(!of_hold(events, &g.key, Kind::Grant, &id).is_empty());
            Ok(())
        },
    )
    .await?;

    // Strangers: no credentials (ClickHouse's `default` user), wrong passwords.
    let refused = |r: anyhow::Result<String>, what: &str| match r {
        Ok(answer) => bail!("{what} was answered: {answer:?}"),
        Err(e) => Ok(e.to_string()),
    };
    let e = refused(ch.query_as(None, "SELECT 1").await, "no credentials")?;
    ensure!(e.contains("401") || e.contains("Unknown user"), "{e}");
    refused(
        ch.query_as(Some(("default", "")), "SELECT 1").await,
        "default, no password",
    )?;
    for (user, password) in [
        (READER, "wrong"),
        (READER, ch.writer_password()),
        (WRITER, ch.reader_password()),
        (WRITER, ""),
    ] {
        let e = refused(
            ch.query_as(Some((user, password)), "SELECT 1").await,
            &format!("{user} with a wrong password"),
        )?;
        ensure!(!e.contains(ch.writer_password()) && !e.contains(ch.reader_password()));
    }
    let anonymous = latchkey_audit::store::open(&format!(
        "clickhouse://127.0.0.1:{}/{DATABASE}",
        ch.http_port()
    ))
    .await?;
    ensure!(
        anonymous.all(cluster).await.is_err(),
        "read without credentials"
    );

    // The reader: every kind of write refused by the readonly profile.
    let rows = |table: &'static str| {
        let ch = &ch;
        async move {
            ch.query(&format!("SELECT count() FROM {DATABASE}.{table}"))
                .await
        }
    };
    let (events_before, checkpoints_before) = (
        rows("latchkey_audit_events_v2").await?,
        rows("latchkey_audit_checkpoints_v2").await?,
    );
    let as_reader = Some((READER, ch.reader_password()));
    for sql in [
        format!(
            "INSERT INTO {DATABASE}.latchkey_audit_events_v2 (cluster_id, event_id, `key`, kind) \
             VALUES ({cluster}, 'forged', 'demo/forged', 'grant')"
        ),
        format!(
            "INSERT INTO {DATABASE}.latchkey_audit_checkpoints_v2 (cluster_id, position, sealed) \
             VALUES ({cluster}, 1, 'forged')"
        ),
        format!("ALTER TABLE {DATABASE}.latchkey_audit_events_v2 DELETE WHERE 1"),
        format!("ALTER TABLE {DATABASE}.latchkey_audit_events_v2 UPDATE identity = 'x' WHERE 1"),
        format!("ALTER TABLE {DATABASE}.latchkey_audit_events_v2 ADD COLUMN forged String"),
        format!("ALTER TABLE {DATABASE}.latchkey_audit_events_v2 DROP COLUMN identity"),
        format!("DROP TABLE {DATABASE}.latchkey_audit_events_v2"),
        format!("DROP DATABASE {DATABASE}"),
        format!("TRUNCATE TABLE {DATABASE}.latchkey_audit_checkpoints_v2"),
        format!("RENAME TABLE {DATABASE}.latchkey_audit_events_v2 TO {DATABASE}.gone"),
        format!("CREATE TABLE {DATABASE}.forged (a UInt8) ENGINE = Memory"),
        "CREATE DATABASE forged".to_string(),
        format!("OPTIMIZE TABLE {DATABASE}.latchkey_audit_events_v2 FINAL"),
        "SET readonly = 0".to_string(),
        format!("SELECT count() FROM {DATABASE}.latchkey_audit_events_v2 SETTINGS readonly = 0"),
    ] {
        let e = refused(ch.query_as(as_reader, &sql).await, &sql)?;
        ensure!(e.contains("readonly mode"), "{sql}: {e}");
    }
    ensure!(rows("latchkey_audit_events_v2").await? == events_before);
    ensure!(rows("latchkey_audit_checkpoints_v2").await? == checkpoints_before);
    // Through the library too: a write that needs no key, and the DDL.
    let forged = Event::new(-7, "demo/forged", Kind::Grant, 1);
    let e = reader
        .write(cluster, &[forged])
        .await
        .err()
        .map(|e| e.to_string());
    ensure!(
        e.as_deref().is_some_and(|e| e.contains("readonly mode")),
        "{e:?}"
    );
    ensure!(reader.migrate().await.is_err(), "the reader ran DDL");
    ensure!(
        reader.all(cluster).await? == before,
        "the reader changed the history"
    );

    // A password in the URL on latchctl's command line is refused (ps shows it).
    let with_password = ch.reader_url().replacen(
        &format!("{READER}@"),
        &format!("{READER}:{}@", ch.reader_password()),
        1,
    );
    let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
        .args(["audit", &g.key, "--store", &with_password])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success() && stderr.contains("ps"), "{stderr}");
    ensure!(!stderr.contains(ch.reader_password()), "{stderr}");
    // With the password in a file it reads, as the reader.
    let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
        .args(["audit", &g.key, "--store", &ch.reader_url()])
        .arg("--store-password-file")
        .arg(ch.reader_password_file())
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{stdout}{out:?}");
    ensure!(stdout.contains(&format!("hold {id}")), "{stdout}");
    Ok(())
}

/// A store the tailer wrote before issue 31 (schema 1: events keyed by the
/// raw revision, a plain checkpoint): the first `migrate` with the key
/// moves every event to ids, keeps the history's order and the grant/end
/// pairs, seals the checkpoint, drops the old tables, and leaves no
/// revision anywhere; a second is a no-op; another key is refused.
async fn schema_1_moves_to_ids(audit: &Audit, tables: Tables<'_>) -> anyhow::Result<()> {
    const CLUSTER: u64 = 77;
    let k = "demo/audit-v1";
    let grant = (
        123_457,
        k,
        "grant",
        "",
        123_457,
        "{\"acquiredAtUnixMs\":1}",
        1_000,
    );
    let release = (123_459, k, "release", "released", 123_457, "{}", 2_000);
    let gap = (
        123_460,
        "/gap",
        "gap",
        "",
        0,
        "{\"toRevision\":123470,\"cause\":\"compacted\"}",
        3_000,
    );
    let seal_reason =
        "{\"reason\":\"etcd revision 123471 is below a grant of epoch 1\",\"nextEpochAtLeast\":2}";
    let seal = (
        123_471,
        "/sys/seal",
        "epoch-seal",
        "",
        0,
        seal_reason,
        4_000,
    );
    let old = [grant, release, gap, seal];
    match &tables {
        Tables::ClickHouse(ch) => {
            ch.query("CREATE DATABASE IF NOT EXISTS latchkey_audit")
                .await?;
            ch.query(
                "CREATE TABLE latchkey_audit.latchkey_audit_events (\
                 cluster_id UInt64, revision Int64, `key` String, kind String, ended String, \
                 epoch UInt32, identity String, `session` Int64, class String, \
                 hold_revision Int64, prev_identity String, prev_session Int64, detail String, \
                 observed_at_unix_ms Int64\
                 ) ENGINE = ReplacingMergeTree() ORDER BY (cluster_id, revision, `key`)",
            )
            .await?;
            ch.query(
                "CREATE TABLE latchkey_audit.latchkey_audit_checkpoints (\
                 cluster_id UInt64, revision Int64, written_at_unix_ms Int64\
                 ) ENGINE = MergeTree() ORDER BY (cluster_id, revision)",
            )
            .await?;
            for (revision, key, kind, ended, hold, detail, at) in old {
                ch.query(&format!(
                    "INSERT INTO latchkey_audit.latchkey_audit_events VALUES ({CLUSTER}, \
                     {revision}, '{key}', '{kind}', '{ended}', 1, 'spiffe://dev.latchkey/workload/alice', \
                     4242, 'batch-report', {hold}, '', 0, '{detail}', {at})"
                ))
                .await?;
            }
            ch.query(&format!(
                "INSERT INTO latchkey_audit.latchkey_audit_checkpoints VALUES ({CLUSTER}, 123471, 5000)"
            ))
            .await?;
        }
        Tables::Postgres(pg) => {
            let client = pg.client().await?;
            client
                .batch_execute(
                    "CREATE TABLE latchkey_audit_events (\
                     cluster_id TEXT NOT NULL, revision BIGINT NOT NULL, key TEXT NOT NULL, \
                     kind TEXT NOT NULL, ended TEXT NOT NULL, epoch BIGINT NOT NULL, \
                     identity TEXT NOT NULL, session BIGINT NOT NULL, class TEXT NOT NULL, \
                     hold_revision BIGINT NOT NULL, prev_identity TEXT NOT NULL, \
                     prev_session BIGINT NOT NULL, detail TEXT NOT NULL, \
                     observed_at_unix_ms BIGINT NOT NULL, PRIMARY KEY (cluster_id, revision, key));
                     CREATE TABLE latchkey_audit_checkpoints (cluster_id TEXT PRIMARY KEY, \
                     revision BIGINT NOT NULL, written_at_unix_ms BIGINT NOT NULL);",
                )
                .await?;
            for (revision, key, kind, ended, hold, detail, at) in old {
                client
                    .execute(
                        "INSERT INTO latchkey_audit_events VALUES ($1, $2, $3, $4, $5, 1, \
                         'spiffe://dev.latchkey/workload/alice', 4242, 'batch-report', $6, '', 0, $7, $8)",
                        &[
                            &CLUSTER.to_string(),
                            &(revision as i64),
                            &key,
                            &kind,
                            &ended,
                            &(hold as i64),
                            &detail,
                            &(at as i64),
                        ],
                    )
                    .await?;
            }
            client
                .execute(
                    "INSERT INTO latchkey_audit_checkpoints VALUES ($1, 123471, 5000)",
                    &[&CLUSTER.to_string()],
                )
                .await?;
        }
    }

    // The detector bites: schema 1's rows spell the revisions (what every
    // store written before issue 31 holds).
    let secrets = Secrets::of(&[123_457, 123_459, 123_460, 123_470, 123_471], Vec::new());
    ensure!(
        tables.ensure_none_holds(&secrets).await.is_err(),
        "schema 1's revisions went unnoticed"
    );

    let store = audit.store().await?;
    store.migrate().await?;
    let names: Vec<String> = tables.rows().await?.into_iter().map(|(t, _)| t).collect();
    ensure!(
        !names
            .iter()
            .any(|t| t == "latchkey_audit_events" || t == "latchkey_audit_checkpoints"),
        "schema 1's tables are still there: {names:?}"
    );
    let events = store.all(CLUSTER).await?;
    let kinds: Vec<Kind> = events.iter().map(|e| e.event.kind).collect();
    ensure!(
        kinds == [Kind::Grant, Kind::Release, Kind::Gap, Kind::EpochSeal],
        "in the old order: {events:#?}"
    );
    let id = audit.hold(CLUSTER, 123_457, k);
    ensure!(
        events[0].event.hold_id == id && events[1].event.hold_id == id,
        "{events:#?}"
    );
    ensure!(events[2].event.detail["revisions"] == 11, "{events:#?}");
    ensure!(
        events[3].event.detail["reason"] == "etcd revision N is below a grant of epoch N",
        "{events:#?}"
    );
    ensure!(store.checkpoint(CLUSTER).await? == Some(123_471));
    tables.ensure_none_holds(&secrets).await?;

    store.migrate().await?;
    ensure!(
        store.all(CLUSTER).await? == events,
        "a second migrate changed the events"
    );
    let stranger = Audit::new(audit.url.clone(), audit.password_file.clone())?;
    let e = stranger
        .store()
        .await?
        .migrate()
        .await
        .err()
        .map(|e| e.to_string());
    ensure!(
        e.as_deref()
            .is_some_and(|e| e.contains("another audit key")),
        "{e:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clickhouse_store_of_schema_1_moves_to_ids_and_drops_its_revisions() -> anyhow::Result<()>
{
    let ch = ClickHouseServer::start().await?;
    schema_1_moves_to_ids(&Audit::clickhouse(&ch)?, Tables::ClickHouse(&ch)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_store_of_schema_1_moves_to_ids_and_drops_its_revisions() -> anyhow::Result<()> {
    let pg = PostgresServer::start().await?;
    schema_1_moves_to_ids(&Audit::postgres(&pg)?, Tables::Postgres(&pg)).await
}

/// One change an election's observers are told of, as both Observe and the
/// audit store say it: (kind, term, leader identity, value, vacancy reason).
/// Observe names the leader only at a term's start; its proclamations and
/// vacancies are of the term it started, whose leader the store names.
type Told = (&'static str, u64, String, String, String);

/// The next change on an Observe stream (15 s at most).
async fn observed(
    stream: &mut tonic::Streaming<latchkey_proto::electionv1::ObserveResponse>,
    leaders: &mut std::collections::HashMap<u64, String>,
) -> anyhow::Result<Told> {
    use latchkey_proto::electionv1::VacancyReason;
    use latchkey_proto::electionv1::observe_response::Event as Observed;
    let message = tokio::time::timeout(Duration::from_secs(15), stream.message())
        .await
        .context("no Observe event within 15 s")??
        .context("the Observe stream ended")?;
    let leader_of = |term: u64, leaders: &std::collections::HashMap<u64, String>| {
        leaders.get(&term).cloned().unwrap_or_default()
    };
    Ok(
        match message
            .event
            .context("an Observe message without an event")?
        {
            Observed::TermStarted(t) => {
                let l = t.leader.unwrap_or_default();
                leaders.insert(l.term, l.identity.clone());
                ("term-start", l.term, l.identity, l.value, String::new())
            }
            Observed::Proclaimed(p) => (
                "proclaim",
                p.term,
                leader_of(p.term, leaders),
                p.value,
                String::new(),
            ),
            Observed::Vacant(v) => {
                let reason = match VacancyReason::try_from(v.reason) {
                    Ok(VacancyReason::Resigned) => Ended::Resigned,
                    Ok(VacancyReason::SessionEnded) => Ended::SessionEnded,
                    Ok(VacancyReason::Forced) => Ended::ForceReleased,
                    Ok(VacancyReason::EpochAdvanced) => Ended::EpochAdvance,
                    other => bail!("a vacancy with no reason the audit records: {other:?}"),
                };
                let leader = leader_of(v.term, leaders);
                ("vacancy", v.term, leader, String::new(), reason.to_string())
            }
            Observed::Gap(g) => bail!("the observer was told of a gap: {g:?}"),
            // Not a record of its own (the dev class does not yield).
            Observed::TransferRequested(t) => bail!("a transfer request: {t:?}"),
        },
    )
}

/// The store's events of `election`, as observers are told them.
fn recorded(events: &[StoredEvent], election: &str) -> anyhow::Result<Vec<Told>> {
    events
        .iter()
        .filter(|e| e.event.key == election && e.event.kind.is_election())
        .map(|e| {
            let e = &e.event;
            let term = e.detail["term"]
                .as_u64()
                .context("an election event's term")?;
            let value = e.detail["value"].as_str().unwrap_or_default().to_string();
            Ok(match e.kind {
                Kind::TermStart => ("term-start", term, e.identity.clone(), value, String::new()),
                Kind::Proclaim => ("proclaim", term, e.identity.clone(), value, String::new()),
                _ => (
                    "vacancy",
                    term,
                    e.identity.clone(),
                    String::new(),
                    e.ended.to_string(),
                ),
            })
        })
        .collect()
}

/// Issue 33: an observer watching an election from before its first
/// campaign, through a proclamation, a resignation to a successor, a
/// resignation with none, a closed session, a revoked lease and an epoch
/// advance, is told exactly the sequence the audit store records for that
/// election: the same kinds, terms, leaders, values and reasons, in order;
/// and the store keeps no session and no token of them.
#[tokio::test(flavor = "multi_thread")]
async fn an_observers_sequence_is_the_audit_stores_for_its_election() -> anyhow::Result<()> {
    let pg = PostgresServer::start().await?;
    observed_as_recorded(&Audit::postgres(&pg)?, Some(&pg.url())).await
}

/// The same in ClickHouse (`latchctl audit` is shown on PostgreSQL only).
#[tokio::test(flavor = "multi_thread")]
async fn an_observers_sequence_is_the_clickhouse_stores_for_its_election() -> anyhow::Result<()> {
    let ch = ClickHouseServer::start().await?;
    observed_as_recorded(&Audit::clickhouse(&ch)?, None).await
}

/// The scenario of the two tests above; with `reader`, also `latchctl
/// audit` on that store URL.
async fn observed_as_recorded(audit: &Audit, reader: Option<&str>) -> anyhow::Result<()> {
    use crate::elections::{Replica, until_standing};
    use latchkey_proto::adminv1::AdvanceEpochRequest;
    use latchkey_proto::electionv1::{ObserveRequest, ProclaimRequest, ResignRequest};

    let dir = crate::elections::policies()?;
    let s = crate::elections::stack(&dir).await?;
    let cluster = s.etcd.cluster_id().await?;
    let store = audit.store().await?;
    let tailer = Tailer::start(&s.etcd, audit, &["--checkpoint-every", "1s"])?;
    let election = "demo/elect/audited";
    let mut leaders = std::collections::HashMap::new();
    let mut told = Vec::new();
    let mut tokens = Vec::new();

    let mut observer = s.arbiter.election("workload/bob").await?;
    let mut stream = observer
        .observe(ObserveRequest {
            election: election.into(),
            from_term: 0,
            transfer_requests: false,
        })
        .await?
        .into_inner();
    // The first message is the state (never led): no change, so no event.
    let state = tokio::time::timeout(Duration::from_secs(15), stream.message())
        .await
        .context("no state within 15 s")??
        .context("the Observe stream ended")?;
    ensure!(
        matches!(
            state.event,
            Some(latchkey_proto::electionv1::observe_response::Event::Vacant(ref v)) if v.term == 0
        ),
        "{state:?}"
    );

    // A campaign, a proclamation, a resignation to a waiting successor.
    let mut a = Replica::start(&s, "workload/alice").await?;
    let mut b = Replica::start(&s, "workload/alice").await?;
    let a_led = a.campaign(election, "a", Duration::from_secs(5)).await?;
    tokens.push(a_led.token);
    told.push(observed(&mut stream, &mut leaders).await?);
    a.elect
        .proclaim(ProclaimRequest {
            election: election.into(),
            session_id: a.session,
            token: a_led.token,
            value: "a2".into(),
        })
        .await?;
    told.push(observed(&mut stream, &mut leaders).await?);
    let waiting = b.campaign_later(election, "b", 7, Duration::from_secs(20));
    until_standing(&mut a.elect, election, 1).await?;
    a.elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: a.session,
            token: a_led.token,
        })
        .await?;
    let b_led = waiting.await??;
    tokens.push(b_led.token);
    told.push(observed(&mut stream, &mut leaders).await?);
    // A resignation with no one standing.
    b.elect
        .resign(ResignRequest {
            election: election.into(),
            session_id: b.session,
            token: b_led.token,
        })
        .await?;
    told.push(observed(&mut stream, &mut leaders).await?);
    // A leader's session closed.
    let a3 = a.campaign(election, "a3", Duration::from_secs(5)).await?;
    tokens.push(a3.token);
    told.push(observed(&mut stream, &mut leaders).await?);
    a.lock
        .close_session(CloseSessionRequest {
            session_id: a.session,
        })
        .await?;
    told.push(observed(&mut stream, &mut leaders).await?);
    // A leader's lease revoked by hand (what its lapse also writes).
    let b2 = b.campaign(election, "b2", Duration::from_secs(5)).await?;
    tokens.push(b2.token);
    told.push(observed(&mut stream, &mut leaders).await?);
    s.etcd.client().await?.lease_revoke(b.session).await?;
    told.push(observed(&mut stream, &mut leaders).await?);
    // An epoch advance ends the term of the leader it finds; terms go on
    // in the new epoch.
    let mut c = Replica::start(&s, "workload/alice").await?;
    let c_led = c.campaign(election, "c", Duration::from_secs(5)).await?;
    tokens.push(c_led.token);
    told.push(observed(&mut stream, &mut leaders).await?);
    let epoch = u32::try_from(c_led.term >> 32)?;
    s.arbiter
        .admin("latchkey/operator")
        .await?
        .advance_epoch(AdvanceEpochRequest {
            expected_epoch: epoch,
            reason: "audit elections e2e".into(),
            ..Default::default()
        })
        .await?;
    told.push(observed(&mut stream, &mut leaders).await?);
    let c2 = c.campaign(election, "c2", Duration::from_secs(5)).await?;
    ensure!(
        c2.term >> 32 > u64::from(epoch),
        "{c2:?} after epoch {epoch}"
    );
    tokens.push(c2.token);
    told.push(observed(&mut stream, &mut leaders).await?);

    let kinds: Vec<_> = told.iter().map(|t| (t.0, t.4.as_str())).collect();
    ensure!(
        kinds
            == [
                ("term-start", ""),
                ("proclaim", ""),
                ("term-start", ""),
                ("vacancy", "resigned"),
                ("term-start", ""),
                ("vacancy", "session-ended"),
                ("term-start", ""),
                ("vacancy", "session-ended"),
                ("term-start", ""),
                ("vacancy", "epoch-advance"),
                ("term-start", ""),
            ],
        "the observer was told {told:#?}"
    );

    let events = store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the election's events",
        |events| {
            let n = recorded(events, election)?.len();
            ensure!(n >= told.len(), "{n} of {} events recorded", told.len());
            Ok(())
        },
    )
    .await?;
    ensure_unique(&events)?;
    let in_store = recorded(&events, election)?;
    ensure!(
        in_store == told,
        "the audit store recorded\n{in_store:#?}\nthe observer was told\n{told:#?}"
    );
    // A hand-over is one term start that names the term it ended.
    let handed = events
        .iter()
        .filter(|e| e.event.key == election && e.event.kind == Kind::TermStart)
        .nth(1)
        .context("the hand-over's term start")?;
    ensure!(
        handed.event.detail["previousTerm"] == a_led.term,
        "{handed:?}"
    );
    // No session and no token (nor its revision) in any of them: not in a
    // column, not in a number of the text they keep.
    let mut secrets: Vec<String> = [a.session, b.session, c.session]
        .iter()
        .map(i64::to_string)
        .collect();
    for token in &tokens {
        let (_, revision) = latchkey_records::token::unpack(*token);
        secrets.extend([token.to_string(), revision.to_string()]);
    }
    for e in events.iter().filter(|e| e.event.kind.is_election()) {
        let r = &e.event;
        ensure!(r.session == 0 && r.prev_session == 0, "{e:?}");
        ensure!(r.hold_id.is_empty() && r.prev_hold_id.is_empty(), "{e:?}");
        let text = format!(
            "{} {} {} {} {}",
            r.key, r.identity, r.prev_identity, r.class, r.detail
        );
        let numbers: Vec<&str> = text
            .split(|ch: char| !ch.is_ascii_digit())
            .filter(|n| !n.is_empty())
            .collect();
        for secret in &secrets {
            ensure!(
                !numbers.contains(&secret.as_str()),
                "a session, token or revision in {e:?}"
            );
        }
    }

    // latchctl audit finds them by the election's name.
    let Some(reader) = reader else {
        return Ok(());
    };
    let out = crate::latchctl::latchctl(s.arbiter.addr(), "workload/alice")?
        .args(["--json", "audit", election, "--since", "1h"])
        .args(["--store", reader])
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Vec<String> = stdout
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .map(|v| v["kind"].as_str().unwrap_or_default().to_string())
        })
        .collect::<Result<_, _>>()?;
    ensure!(
        listed == told.iter().map(|t| t.0).collect::<Vec<_>>(),
        "{stdout}"
    );
    Ok(())
}
