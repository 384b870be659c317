//! The audit tailer (ADR-21) as a real process, tailing a real etcd that a
//! real arbiter writes, into a real PostgreSQL and a real ClickHouse: a
//! SIGKILL mid-stream and a restart lose and repeat nothing, an expiry
//! (which no application code sees) is recorded, a force-release record is
//! recorded while its lease still runs, and compaction past the checkpoint
//! is an explicit gap.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use etcd_client::{Compare, CompareOp, DeleteOptions, PutOptions, Txn, TxnOp};
use latchkey_audit::force::ForceRecord;
use latchkey_audit::{AuditStore, Ended, Kind, StoredEvent};
use latchkey_proto::lockv1::{CloseSessionRequest, InspectRequest};
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
struct Tailer {
    child: Child,
    log: PathBuf,
    metrics: std::net::SocketAddr,
    _dir: TempDir,
}

impl Tailer {
    fn start(etcd: &EtcdServer, store: &str, extra: &[&str]) -> anyhow::Result<Self> {
        let dir = TempDir::new()?;
        let log = dir.path().join("audit.log");
        let out = std::fs::File::create(&log)?;
        let metrics = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let child = Command::new(env!("CARGO_BIN_EXE_audit-under-test"))
            .args(["--etcd", &etcd.endpoint(), "--prefix", "/latchkey"])
            .args(["--metrics-listen", &metrics.to_string()])
            .args(extra)
            // The store URL from the environment, as deployed.
            .env("LATCHKEY_AUDIT_STORE", store)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting audit-under-test")?;
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

/// No (revision, key) twice.
fn ensure_unique(events: &[StoredEvent]) -> anyhow::Result<()> {
    let mut seen = HashSet::new();
    for e in events {
        ensure!(
            seen.insert((e.cluster_id, e.event.revision, e.event.key.clone())),
            "a duplicate event: {e:?}"
        );
    }
    Ok(())
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
/// exactly once.
async fn killed_mid_stream_then_replayed(store_url: &str) -> anyhow::Result<Vec<StoredEvent>> {
    let s = stack().await?;
    let cluster = s.etcd.cluster_id().await?;
    let store = latchkey_audit::store::open(store_url).await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let mut bob = s.arbiter.lock("workload/bob").await?;
    let sa = open(&mut alice, CLASS).await?;
    let sb = open(&mut bob, CLASS).await?;

    // No checkpoint before the kill: the restart must replay all of it.
    let mut tailer = Tailer::start(&s.etcd, store_url, &["--checkpoint-every", "1h"])?;
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

    let tailer = Tailer::start(&s.etcd, store_url, &["--checkpoint-every", "1s"])?;
    checkpoint_reaches(store.as_ref(), cluster, last)
        .await
        .with_context(|| format!("tailer log:\n{}", tailer.log()))?;
    let events = store.all(cluster).await?;
    ensure_unique(&events)?;
    for g in &grants {
        let at: Vec<_> = events
            .iter()
            .filter(|e| e.event.revision == g.revision && e.event.key == g.key)
            .collect();
        ensure!(at.len() == 1, "grant {g:?}: {at:?}");
        ensure!(at[0].event.kind == Kind::Grant && at[0].event.identity == g.identity);
        let ends: Vec<_> = on(&events, &g.key, Kind::Release)
            .into_iter()
            .filter(|e| e.event.hold_revision == g.revision)
            .collect();
        ensure!(ends.len() == 1, "release of {g:?}: {ends:?}");
        ensure!(ends[0].event.ended == Ended::Released);
    }
    let handed = on(&events, "demo/audit-h", Kind::HandOver);
    ensure!(handed.len() == 1, "{handed:?}");
    let h = &handed[0].event;
    ensure!(h.revision == second.revision && h.hold_revision == first.revision);
    ensure!(h.identity.ends_with("/workload/bob") && h.prev_identity.ends_with("/workload/alice"));
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
    killed_mid_stream_then_replayed(&pg.url()).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn clickhouse_killed_tailer_replays_without_duplicates_or_losses() -> anyhow::Result<()> {
    let ch = ClickHouseServer::start().await?;
    let events = killed_mid_stream_then_replayed(&ch.url("audit")).await?;
    // The replay inserted copies; once merged, each event is one row.
    ch.query("OPTIMIZE TABLE audit.latchkey_audit_events FINAL")
        .await?;
    let rows = ch
        .query("SELECT count() FROM audit.latchkey_audit_events")
        .await?;
    assert_eq!(rows.trim(), events.len().to_string());
    Ok(())
}

/// Expiry, CloseSession and a force-release, each recorded with its cause.
#[tokio::test(flavor = "multi_thread")]
async fn expiries_closed_sessions_and_force_releases_are_recorded() -> anyhow::Result<()> {
    let s = stack().await?;
    let pg = PostgresServer::start().await?;
    let cluster = s.etcd.cluster_id().await?;
    let store = latchkey_audit::store::open(&pg.url()).await?;
    let tailer = Tailer::start(&s.etcd, &pg.url(), &["--checkpoint-every", "1s"])?;
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
                format!("/latchkey/{}", record.relative_key()),
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
            ensure!(exp.event.hold_revision == expiring.revision, "{exp:?}");
            ensure!(exp.event.identity.ends_with("/workload/alice"), "{exp:?}");
            let Some(closed_event) = find("demo/audit-closed", Kind::Release) else {
                bail!("no close yet")
            };
            ensure!(
                closed_event.event.ended == Ended::SessionClosed,
                "{closed_event:?}"
            );
            ensure!(closed_event.event.hold_revision == closed.revision);
            let Some(force) = find("demo/audit-forced", Kind::ForceRelease) else {
                bail!("no force-release yet")
            };
            ensure!(force.event.hold_revision == stuck.revision);
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
    let cluster = s.etcd.cluster_id().await?;
    let store = latchkey_audit::store::open(&pg.url()).await?;
    let tailer = Tailer::start(&s.etcd, &pg.url(), &["--checkpoint-every", "1s"])?;
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
        .get(format!("/latchkey/sys/revoked/{session:016x}"), None)
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
            ensure!(o.event.hold_revision == other.revision, "{o:?}");
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
/// records the lost revisions as one gap and carries on after them.
#[tokio::test(flavor = "multi_thread")]
async fn compaction_past_the_checkpoint_is_an_explicit_gap() -> anyhow::Result<()> {
    let s = stack().await?;
    let pg = PostgresServer::start().await?;
    let cluster = s.etcd.cluster_id().await?;
    let store = latchkey_audit::store::open(&pg.url()).await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let sa = open(&mut alice, CLASS).await?;
    let mut grants = Vec::new();

    let mut tailer = Tailer::start(&s.etcd, &pg.url(), &["--checkpoint-every", "1s"])?;
    grant_and_release(&mut alice, "workload/alice", sa, 0, 3, &mut grants).await?;
    let checkpointed = s.etcd.revision().await?;
    checkpoint_reaches(store.as_ref(), cluster, checkpointed).await?;
    tailer.kill();

    let mut lost = Vec::new();
    grant_and_release(&mut alice, "workload/alice", sa, 3, 3, &mut lost).await?;
    let compacted = s.etcd.revision().await?;
    s.etcd.client().await?.compact(compacted, None).await?;

    let tailer = Tailer::start(&s.etcd, &pg.url(), &["--checkpoint-every", "1s"])?;
    let g = try_lock(&mut alice, "demo/audit-after", CLASS, sa).await?;
    let events = store_shows(
        store.as_ref(),
        cluster,
        &tailer,
        "the gap and later events",
        |events| {
            ensure!(
                events.iter().any(|e| e.event.revision == g.revision),
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
    ensure!(gaps[0].event.revision == checkpointed + 1, "{gaps:?}");
    ensure!(gaps[0].event.detail["toRevision"] == compacted, "{gaps:?}");
    let inside: Vec<_> = events
        .iter()
        .filter(|e| e.event.kind != Kind::Gap)
        .filter(|e| e.event.revision > checkpointed && e.event.revision <= compacted)
        .collect();
    ensure!(inside.is_empty(), "events inside the gap: {inside:?}");
    let by_revision: HashMap<i64, &StoredEvent> =
        events.iter().map(|e| (e.event.revision, e)).collect();
    ensure!(grants.iter().all(|m| by_revision.contains_key(&m.revision)));
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
        etcd_client::Permission::read("/latchkey/").with_prefix(),
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
    let cluster = etcd.cluster_id().await?;
    let store = latchkey_audit::store::open(&pg.url()).await?;
    let path = |p: &std::path::Path| p.display().to_string();
    let tailer = Tailer::start(
        &etcd,
        &pg.url(),
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
    store_shows(store.as_ref(), cluster, &tailer, "the grant", |events| {
        ensure!(
            events
                .iter()
                .any(|e| e.event.revision == g.revision && e.event.kind == Kind::Grant),
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
    let options = etcd_client::ConnectOptions::new()
        .with_user("latchkey-audit", "audit-password")
        .with_tls(
            etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(std::fs::read(&tls.ca)?))
                .identity(etcd_client::Identity::from_pem(
                    std::fs::read(&cert.cert)?,
                    std::fs::read(&cert.key)?,
                )),
        );
    let mut reader = etcd_client::Client::connect([etcd.endpoint()], Some(options)).await?;
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
    let url = pg.url();
    let cluster = s.etcd.cluster_id().await?;
    let store = latchkey_audit::store::open(&url).await?;
    let tailer = Tailer::start(
        &s.etcd,
        &url,
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
