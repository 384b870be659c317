//! The reference PostgreSQL fence and `latchctl pause-test` (ADR-16, ADR-17)
//! against real etcd, the real arbiter and a real PostgreSQL server.
//!
//! The kit runs as the `latchctl-under-test` binary, which re-runs itself as
//! the holder child; the holder is frozen for the class TTL (5 s) plus 2 s.

use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{Context, ensure};
use latchkey_fence_postgres::{self as fence, FenceError, UpdateOutcome, WriteOutcome};
use latchkey_policies::{
    PAUSE_TEST_RESULT_VERSION, PauseTestEvidence, PauseTestOutcome, PauseTestResult,
    WriteOutcome as Observed,
};
use latchkey_tests::arbiter::{ArbiterOptions, svid_flags};
use latchkey_tests::postgres::PostgresServer;
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::timeout;

use crate::support::{Stack, stack_with};

pub(crate) const CLASS: &str = "pause-kit";
/// An election class of the same TTL, for the kit's `--election`.
const ELECTION_CLASS: &str = "pause-kit-elect";
pub(crate) const RESOURCE: &str = "postgresql:latchkey_fenced_rows";
pub(crate) const IDENTITY: &str = "workload/alice";
/// A generous bound on one kit run (about TTL 5 s + 2 s + startup).
pub(crate) const KIT_TIMEOUT: Duration = Duration::from_secs(120);

// --- the reference fence -----------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn the_reference_fence_accepts_only_strictly_greater_tokens() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let pg = PostgresServer::start().await?;
    let db = pg.client().await?;
    fence::ensure_schema(&db).await?;
    fence::ensure_schema(&db).await?; // idempotent

    let base: u64 = 1 << 48;
    // a new record is created by the first write
    assert_eq!(
        fence::guarded_write(&db, "r1", base + 10, "ten").await?,
        WriteOutcome::Accepted { write_seq: 1 }
    );
    // a later grant overwrites and the write count goes up
    assert_eq!(
        fence::guarded_write(&db, "r1", base + 20, "twenty").await?,
        WriteOutcome::Accepted { write_seq: 2 }
    );
    // the same token again (reused or replayed) is refused: strictly <
    assert_eq!(
        fence::guarded_write(&db, "r1", base + 20, "twenty again").await?,
        WriteOutcome::FencedOut
    );
    // an older grant is refused
    assert_eq!(
        fence::guarded_write(&db, "r1", base + 15, "fifteen").await?,
        WriteOutcome::FencedOut
    );
    assert_eq!(
        row(&db, "r1").await?,
        (i64::try_from(base + 20)?, "twenty".into(), 2)
    );
    // the mark is per record: another record takes a lower token
    assert_eq!(
        fence::guarded_write(&db, "r2", base + 1, "r2 one").await?,
        WriteOutcome::Accepted { write_seq: 1 }
    );
    assert_eq!(
        fence::guarded_write(&db, "r1", base + 21, "twenty-one").await?,
        WriteOutcome::Accepted { write_seq: 3 }
    );

    // the plain UPDATE form: row count 1 = written, 0 = fenced out or missing
    assert_eq!(
        fence::guarded_update(&db, "r1", base + 30, "thirty").await?,
        UpdateOutcome::Updated
    );
    assert_eq!(
        fence::guarded_update(&db, "r1", base + 30, "thirty again").await?,
        UpdateOutcome::FencedOutOrMissing
    );
    assert_eq!(
        fence::guarded_update(&db, "r1", base + 29, "older").await?,
        UpdateOutcome::FencedOutOrMissing
    );
    assert_eq!(
        fence::guarded_update(&db, "nope", base + 99, "x").await?,
        UpdateOutcome::FencedOutOrMissing
    );
    assert_eq!(
        row(&db, "r1").await?,
        (i64::try_from(base + 30)?, "thirty".into(), 4)
    );
    let missing = db
        .query_opt("SELECT 1 FROM latchkey_fenced_rows WHERE id = 'nope'", &[])
        .await?;
    assert!(missing.is_none(), "the UPDATE form must not create records");

    // a token above bigint is refused before PostgreSQL sees it, without printing it
    let huge = u64::MAX - 3;
    for err in [
        fence::guarded_write(&db, "r1", huge, "huge")
            .await
            .unwrap_err(),
        fence::guarded_update(&db, "r1", huge, "huge")
            .await
            .unwrap_err(),
    ] {
        assert!(matches!(err, FenceError::TokenOutOfRange), "{err:?}");
        assert!(!err.to_string().contains(&huge.to_string()), "{err}");
    }
    assert_eq!(row(&db, "r1").await?.1, "thirty");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_writers_leave_the_highest_token_and_errors_hide_the_token() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let pg = PostgresServer::start().await?;
    let db = pg.client().await?;
    fence::ensure_schema(&db).await?;
    let base: u64 = 3 << 48;

    // 24 writers race on one record in shuffled order; one statement each,
    // so whatever the interleaving the highest token's payload is what stays.
    let mut tokens: Vec<u64> = (1..=24).map(|i| base + i).collect();
    fastrand::shuffle(&mut tokens);
    let mut tasks = Vec::new();
    for token in tokens {
        let db = pg.client().await?;
        tasks.push(tokio::spawn(async move {
            fence::guarded_write(&db, "race", token, &format!("w{}", token - base)).await
        }));
    }
    let mut accepted = 0;
    for task in tasks {
        if task.await??.is_accepted() {
            accepted += 1;
        }
    }
    let (mark, payload, writes) = row(&db, "race").await?;
    assert_eq!(mark, i64::try_from(base + 24)?);
    assert_eq!(payload, "w24");
    assert_eq!(writes, accepted);

    // PostgreSQL's DETAIL would echo the row (and the token); the error must not.
    db.batch_execute(
        "ALTER TABLE latchkey_fenced_rows ADD CONSTRAINT no_boom CHECK (payload <> 'boom')",
    )
    .await?;
    let token = base + 100;
    let err = fence::guarded_write(&db, "race", token, "boom")
        .await
        .unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(text.contains("no_boom"), "{text}");
    assert!(!text.contains(&token.to_string()), "token leaked: {text}");
    assert!(!err.is_transient());
    Ok(())
}

async fn row(db: &tokio_postgres::Client, id: &str) -> anyhow::Result<(i64, String, i64)> {
    let r = db
        .query_one(
            "SELECT fence, payload, writes FROM latchkey_fenced_rows WHERE id = $1",
            &[&id],
        )
        .await?;
    Ok((r.get(0), r.get(1), r.get(2)))
}

// --- the pause test kit --------------------------------------------------------

/// Real etcd, the arbiter on a policy dir with the fenced `pause-kit` class
/// (TTL 5 s), and PostgreSQL with the reference table plus an audit trigger
/// that records every mark written (so the test knows the tokens).
struct Rig {
    stack: Stack,
    pg: PostgresServer,
    db: tokio_postgres::Client,
    _policies: TempDir,
    work: TempDir,
}

async fn rig() -> anyhow::Result<Rig> {
    let policies = policy_dir()?;
    let stack = stack_with(ArbiterOptions {
        policies_dir: policies.path().to_path_buf(),
        ..Default::default()
    })
    .await?;
    let pg = PostgresServer::start().await?;
    let db = pg.client().await?;
    fence::ensure_schema(&db).await?;
    db.batch_execute(
        "CREATE TABLE marks_seen (fence bigint NOT NULL);
         CREATE FUNCTION record_mark() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO marks_seen VALUES (NEW.fence); RETURN NEW; END $$;
         CREATE TRIGGER record_mark AFTER INSERT OR UPDATE ON latchkey_fenced_rows
           FOR EACH ROW EXECUTE FUNCTION record_mark();",
    )
    .await?;
    Ok(Rig {
        stack,
        pg,
        db,
        _policies: policies,
        work: TempDir::new()?,
    })
}

/// A policy dir of its own: the fenced class needs a passing pause-test
/// result to load, so it ships a fixture (written with the shared type).
pub(crate) fn policy_dir() -> anyhow::Result<TempDir> {
    let dir = TempDir::new()?;
    std::fs::create_dir_all(dir.path().join("classes"))?;
    std::fs::create_dir_all(dir.path().join("grants"))?;
    std::fs::create_dir_all(dir.path().join("pause-tests"))?;
    std::fs::write(
        dir.path().join("classes/pause.toml"),
        format!(
            "[[class]]\nname = \"{CLASS}\"\ndescription = \"The pause-test kit's e2e class.\"\n\
             tier = \"coord\"\nenforcement = \"fenced\"\nttlSeconds = 5\n\
             [class.pauseTest]\nresource = \"{RESOURCE}\"\nresult = \"pause-tests/{CLASS}.json\"\n\n\
             [[class]]\nname = \"{ELECTION_CLASS}\"\ndescription = \"The pause-test kit's e2e election class.\"\n\
             kind = \"election\"\ntier = \"coord\"\nenforcement = \"fenced\"\nttlSeconds = 5\n\
             [class.pauseTest]\nresource = \"{RESOURCE}\"\nresult = \"pause-tests/{ELECTION_CLASS}.json\"\n"
        ),
    )?;
    std::fs::write(
        dir.path().join("grants/pause.toml"),
        "[[grant]]\nidentity = \"spiffe://dev.latchkey/workload/alice\"\nprefixes = [\"pausetest\"]\n",
    )?;
    let now = SystemTime::now();
    for class in [CLASS, ELECTION_CLASS] {
        let fixture = PauseTestResult {
            version: PAUSE_TEST_RESULT_VERSION,
            class: class.into(),
            resource: RESOURCE.into(),
            resource_schema_version: None,
            started_at: now - Duration::from_secs(20),
            finished_at: now,
            outcome: PauseTestOutcome::Pass,
            kit: "latchctl 0.1.0 pause-test".into(),
            evidence: PauseTestEvidence {
                ttl_seconds: 5,
                paused_for_ms: 7_000,
                first_write: Observed::Accepted,
                second_holder_write: Observed::Accepted,
                second_token_greater: true,
                stale_write_after_resume: Observed::Rejected,
                final_row_from: "second-holder".into(),
                stale_proclaim_after_resume: None,
            },
            failure: None,
            store: None,
        };
        std::fs::write(
            dir.path().join(format!("pause-tests/{class}.json")),
            fixture.to_json_pretty()?,
        )?;
    }
    Ok(dir)
}

impl Rig {
    /// `latchctl pause-test KEY` with alice's SVID, the class, the resource,
    /// this rig's PostgreSQL and `--out`, plus `extra`.
    async fn kit(&self, key: &str, out: &Path, extra: &[&str]) -> anyhow::Result<Output> {
        self.kit_for(CLASS, key, out, extra).await
    }

    /// [`Rig::kit`] with another class.
    async fn kit_for(
        &self,
        class: &str,
        key: &str,
        out: &Path,
        extra: &[&str],
    ) -> anyhow::Result<Output> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .arg("--endpoint")
            .arg(format!("https://{}", self.stack.arbiter.addr()))
            .args(svid_flags(IDENTITY)?)
            .args(["pause-test", key, "--class", class, "--resource", RESOURCE])
            .arg("--postgres")
            .arg(self.pg.url())
            .arg("--out")
            .arg(out)
            .args(extra)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let output = timeout(KIT_TIMEOUT, cmd.output())
            .await
            .context("pause-test did not finish in time")?
            .context("pause-test did not run")?;
        eprintln!(
            "pause-test exited {:?}\n--- stdout\n{}\n--- stderr\n{}",
            output.status.code(),
            text(&output.stdout),
            text(&output.stderr)
        );
        Ok(output)
    }

    /// Every mark written to the reference table during the test.
    async fn marks_seen(&self) -> anyhow::Result<Vec<i64>> {
        let rows = self.db.query("SELECT fence FROM marks_seen", &[]).await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// (d): no token the run used appears in its output or result file.
    async fn assert_no_token_leaked(&self, output: &Output, result: &Path) -> anyhow::Result<()> {
        let tokens: Vec<i64> = self
            .marks_seen()
            .await?
            .into_iter()
            .filter(|m| *m > 0)
            .collect();
        ensure!(
            tokens.len() >= 2,
            "expected both holders' marks, saw {tokens:?}"
        );
        let file = std::fs::read_to_string(result)?;
        for token in tokens {
            // epoch 1 and up: at least 2^48, fifteen digits, no accidental match
            ensure!(token >= 1 << 48, "token {token} below 2^48");
            let digits = token.to_string();
            for (what, haystack) in [
                ("stdout", text(&output.stdout)),
                ("stderr", text(&output.stderr)),
                ("the result file", file.clone()),
            ] {
                ensure!(!haystack.contains(&digits), "a token leaked into {what}");
            }
        }
        Ok(())
    }
}

pub(crate) fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

pub(crate) fn read_result(path: &Path) -> anyhow::Result<PauseTestResult> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    PauseTestResult::from_json(&text).with_context(|| format!("parsing {text}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_passes_against_the_reference_fence() -> anyhow::Result<()> {
    let rig = rig().await?;
    let out = rig.work.path().join("results/ref.json");
    let started = SystemTime::now();
    let output = rig
        .kit("pausetest/ledger-1", &out, &["--schema-version", "7"])
        .await?;
    ensure!(output.status.code() == Some(0), "expected exit 0 (pass)");

    let result = read_result(&out)?;
    assert_eq!(result.version, PAUSE_TEST_RESULT_VERSION);
    assert_eq!(result.class, CLASS);
    assert_eq!(result.resource, RESOURCE);
    assert_eq!(result.resource_schema_version.as_deref(), Some("7"));
    assert_eq!(result.outcome, PauseTestOutcome::Pass);
    assert_eq!(result.failure, None);
    assert!(result.kit.starts_with("latchctl ") && result.kit.ends_with(" pause-test"));
    assert!(result.started_at >= started - Duration::from_secs(1));
    assert!(result.finished_at >= result.started_at);
    let e = &result.evidence;
    assert_eq!(e.ttl_seconds, 5);
    assert!(e.paused_for_ms >= 7_000, "paused {} ms", e.paused_for_ms);
    assert_eq!(e.first_write, Observed::Accepted);
    assert_eq!(e.second_holder_write, Observed::Accepted);
    assert!(e.second_token_greater);
    assert_eq!(e.stale_write_after_resume, Observed::Rejected);
    assert_eq!(e.final_row_from, "second-holder");
    assert!(text(&output.stdout).contains("pause-test PASS"));

    // the record: created by the first holder, then the second holder's write
    let (mark, payload, writes) = row(&rig.db, "latchkey-pause-test/pausetest/ledger-1").await?;
    assert!(payload.ends_with("second-holder"), "{payload}");
    assert_eq!(writes, 2);
    let marks = rig.marks_seen().await?;
    assert_eq!(marks.len(), 2, "{marks:?}");
    assert!(marks[1] > marks[0] && marks[1] == mark);
    rig.assert_no_token_leaked(&output, &out).await?;

    // the key was released by the kit: free for the next run
    let mut alice = rig.stack.arbiter.lock(IDENTITY).await?;
    let view = alice
        .inspect(latchkey_proto::lockv1::InspectRequest {
            key: "pausetest/ledger-1".into(),
        })
        .await?
        .into_inner();
    assert!(view.holder.is_none(), "{view:?}");
    Ok(())
}

/// Issue 33: a leader frozen past its TTL (SIGSTOP) wakes up to a refused
/// fenced write and a refused Proclaim. The kit's holder campaigns, writes
/// with its leadership's token and is frozen; the kit leads the next term
/// and writes; resumed, the old leader's write is rejected by the fence and
/// its Proclaim (sent with its session and token, asked of the arbiter)
/// by the arbiter with NOT_LEADER.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_leader_is_refused_by_the_fence_and_the_arbiter() -> anyhow::Result<()> {
    let rig = rig().await?;
    let out = rig.work.path().join("results/elect.json");
    let output = rig
        .kit_for(
            ELECTION_CLASS,
            "pausetest/elect/controller",
            &out,
            &["--election"],
        )
        .await?;
    ensure!(output.status.code() == Some(0), "expected exit 0 (pass)");
    let result = read_result(&out)?;
    assert_eq!(result.class, ELECTION_CLASS);
    assert_eq!(result.outcome, PauseTestOutcome::Pass);
    let e = &result.evidence;
    assert!(e.paused_for_ms >= 7_000, "paused {} ms", e.paused_for_ms);
    assert_eq!(e.first_write, Observed::Accepted);
    assert!(e.second_token_greater);
    assert_eq!(e.second_holder_write, Observed::Accepted);
    assert_eq!(e.stale_write_after_resume, Observed::Rejected);
    assert_eq!(e.stale_proclaim_after_resume, Some(Observed::Rejected));
    assert_eq!(e.final_row_from, "second-holder");
    assert!(text(&output.stdout).contains("stale Proclaim after resume  rejected"));
    rig.assert_no_token_leaked(&output, &out).await?;
    // The kit's second leader resigned: the election is vacant again.
    let mut elect = rig.stack.arbiter.election(IDENTITY).await?;
    let leader = elect
        .leader(latchkey_proto::electionv1::LeaderRequest {
            election: "pausetest/elect/controller".into(),
        })
        .await?
        .into_inner();
    assert!(leader.leader.is_none(), "{leader:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_passes_with_the_owners_correct_statement_and_prints_json() -> anyhow::Result<()> {
    let rig = rig().await?;
    rig.db
        .batch_execute("INSERT INTO latchkey_fenced_rows VALUES ('ledger/owner', 0, 'initial', 0)")
        .await?;
    let out = rig.work.path().join("owner.json");
    let output = rig
        .kit(
            "pausetest/ledger-2",
            &out,
            &[
                "--row",
                "ledger/owner",
                "--write-sql",
                "UPDATE latchkey_fenced_rows SET payload = $3, fence = $2, writes = writes + 1 \
                 WHERE id = $1 AND fence < $2",
                "--read-sql",
                "SELECT payload FROM latchkey_fenced_rows WHERE id = $1",
                "--json",
            ],
        )
        .await?;
    ensure!(output.status.code() == Some(0), "expected exit 0 (pass)");
    let printed: PauseTestResult = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("--json stdout: {}", text(&output.stdout)))?;
    let written = read_result(&out)?;
    assert_eq!(printed, written);
    assert_eq!(written.outcome, PauseTestOutcome::Pass);
    assert_eq!(
        written.evidence.stale_write_after_resume,
        Observed::Rejected
    );
    assert_eq!(written.resource_schema_version, None);
    rig.assert_no_token_leaked(&output, &out).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_fails_a_statement_that_ignores_the_fence() -> anyhow::Result<()> {
    let rig = rig().await?;
    rig.db
        .batch_execute("INSERT INTO latchkey_fenced_rows VALUES ('ledger/broken', 0, 'initial', 0)")
        .await?;
    let out = rig.work.path().join("broken.json");
    let output = rig
        .kit(
            "pausetest/ledger-3",
            &out,
            &[
                "--row",
                "ledger/broken",
                // the mistake: the mark is set but never compared
                "--write-sql",
                "UPDATE latchkey_fenced_rows SET payload = $3, fence = $2, writes = writes + 1 \
                 WHERE id = $1",
                "--read-sql",
                "SELECT payload FROM latchkey_fenced_rows WHERE id = $1",
            ],
        )
        .await?;
    ensure!(output.status.code() == Some(1), "expected exit 1 (fail)");
    let result = read_result(&out)?;
    assert_eq!(result.outcome, PauseTestOutcome::Fail);
    assert_eq!(result.evidence.stale_write_after_resume, Observed::Accepted);
    assert_eq!(result.evidence.second_holder_write, Observed::Accepted);
    assert!(result.evidence.second_token_greater);
    assert_eq!(result.evidence.final_row_from, "first-holder");
    let failure = result.failure.clone().context("a failure reason")?;
    assert!(failure.contains("ACCEPTED"), "{failure}");
    assert!(text(&output.stdout).contains("pause-test FAIL"));
    // the stale write went through: the row went back to the older mark
    let marks: Vec<i64> = rig
        .marks_seen()
        .await?
        .into_iter()
        .filter(|m| *m > 0)
        .collect();
    assert_eq!(marks.len(), 3, "{marks:?}");
    assert!(marks[2] < marks[1] && marks[2] == marks[0]);
    rig.assert_no_token_leaked(&output, &out).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_kit_exits_2_and_writes_nothing_when_it_cannot_run() -> anyhow::Result<()> {
    let rig = rig().await?;
    let out = rig.work.path().join("never.json");
    // a key outside alice's grants: the holder is refused
    let output = rig.kit("elsewhere/ledger", &out, &[]).await?;
    ensure!(
        output.status.code() == Some(2),
        "expected exit 2 (could not run)"
    );
    assert!(!out.exists());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("could not run"), "{stderr}");
    assert!(stderr.contains("NOT_AUTHORISED"), "{stderr}");
    Ok(())
}
