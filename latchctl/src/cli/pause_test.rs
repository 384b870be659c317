//! `latchctl pause-test`: the kit that proves a resource is fenced (ADR-17).
//!
//! It runs the failure the fence exists for, against the real resource:
//!
//! 1. a HOLDER child (this binary, hidden `pause-test-holder`) acquires the
//!    key, writes with its token, says `ready` and waits on stdin;
//! 2. the kit freezes it with SIGSTOP for the class TTL plus a margin, so its
//!    lease expires while it still believes it holds the lock;
//! 3. the kit acquires the key itself (a second holder, its own session),
//!    checks its token is greater, writes and releases;
//! 4. the kit resumes the holder and tells it to write again, as the unit of
//!    work that was in flight when the process froze would: no `can_start`
//!    check. The fence must reject that stale write, and the record must
//!    still hold the second holder's write.
//!
//! The outcome is written as a [`PauseTestResult`], the file a fenced class
//! names in `[class.pauseTest]`. Exit 0 on pass, 1 on fail, 2 when the test
//! could not run (no result is written then). Tokens are compared in-process
//! (the first holder's comes over the child's stdout pipe: Inspect never
//! returns tokens) and never printed.

use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use latchkey_policies::{
    PAUSE_TEST_RESULT_VERSION, PauseTestEvidence, PauseTestOutcome, PauseTestResult,
    PauseTestStore, WriteOutcome as Observed,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};

use latchkey_client::{CampaignOptions, Client, FencingToken, Leadership, LockGuard, Reason};

use super::acquire::grant;
use super::{Failure, Global, Output, chain, connect, duration, parse_meta};

mod target;
use target::{Target, WriteError};

/// How far past the TTL the holder stays frozen: the lease must be gone
/// (etcd expires leases on its own clock, a little late) before we acquire.
const PAUSE_MARGIN: Duration = Duration::from_secs(2);
/// How long the resumed holder gets to report its stale write.
const STALE_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// On top of `--wait`, for the holder's connect and first write.
const HOLDER_START_SLACK: Duration = Duration::from_secs(30);
/// What the holder's stderr is cut to in an error.
const STDERR_TAIL_BYTES: usize = 4000;
/// The environment variable `--postgres` is also read from; the holder child
/// gets the connection string this way, not on its command line (`ps`).
const POSTGRES_ENV: &str = "LATCHKEY_PAUSE_TEST_POSTGRES";
/// The same for `--resource-url` (its URL may hold a password).
const RESOURCE_URL_ENV: &str = "LATCHKEY_PAUSE_TEST_RESOURCE_URL";

const FIRST_HOLDER: &str = "first-holder";
const SECOND_HOLDER: &str = "second-holder";
/// The line that tells the resumed holder to send its stale write.
const GO: &str = "write";

#[derive(Debug, Args)]
pub struct PauseTestArgs {
    /// The lock key to test with (under a prefix this identity may lock).
    pub key: String,
    /// The lock class to prove (its TTL sets the pause).
    #[arg(long)]
    pub class: String,
    /// The guarded resource's name, recorded in the result, e.g.
    /// `postgresql:ledger.postings`. Must match the class's `[class.pauseTest]`.
    #[arg(long)]
    pub resource: String,
    /// The resource's schema version, recorded as `resourceSchemaVersion`.
    #[arg(long, value_name = "VERSION")]
    pub schema_version: Option<String>,
    /// PostgreSQL connection string (libpq URL or key=value; no TLS): the
    /// reference fence's table, or the owner's statements (--write-sql).
    #[arg(
        long,
        env = POSTGRES_ENV,
        hide_env_values = true,
        value_name = "CONNINFO",
        required_unless_present = "resource_url",
        conflicts_with = "resource_url"
    )]
    pub postgres: Option<Secret>,
    /// The guarded store, written through its fence adapter:
    /// `postgresql://…`, `mysql://…` (MariaDB too), `redis://…` or
    /// `etcd://host:port[/prefix]` (no TLS). The holder child gets it from
    /// the environment, never on its command line.
    #[arg(
        long,
        env = RESOURCE_URL_ENV,
        hide_env_values = true,
        value_name = "URL",
        conflicts_with_all = ["write_sql", "read_sql"]
    )]
    pub resource_url: Option<Secret>,
    /// Both holders write with the adapter's plain, unfenced write: a
    /// naive writer, which the kit must FAIL (the kit's own tests).
    #[arg(long, hide = true, conflicts_with = "write_sql")]
    pub naive: bool,
    /// The record both holders write (default: derived from the key).
    #[arg(long)]
    pub row: Option<String>,
    /// Your own guarded write, instead of the reference fence's table:
    /// `$1` id (text), `$2` token (bigint), `$3` payload (text); accepted
    /// when it affects a row, rejected when it affects none.
    #[arg(long, value_name = "SQL", requires = "read_sql")]
    pub write_sql: Option<String>,
    /// With --write-sql: reads the record back, `$1` id (text), one text
    /// column (the payload last written).
    #[arg(long, value_name = "SQL", requires = "write_sql")]
    pub read_sql: Option<String>,
    /// Metadata for the class's hooks, on both acquires.
    #[arg(long = "metadata", alias = "meta", value_name = "K=V", value_parser = parse_meta)]
    pub metadata: Vec<(String, String)>,
    /// How long each holder may queue for the key.
    #[arg(long, value_parser = duration::parse, value_name = "DURATION", default_value = "30s")]
    pub wait: Duration,
    /// Where to write the result JSON (a PauseTestResult).
    #[arg(long, value_name = "PATH")]
    pub out: PathBuf,
    /// The key is an election and the class an election class: the holders
    /// campaign instead of acquiring, and the resumed leader's Proclaim
    /// must be refused (`NOT_LEADER`) as its write is by the fence.
    #[arg(long)]
    pub election: bool,
}

/// A connection string or URL that may hold a password: parsed from the
/// command line or the environment like a string, but its `Debug` never
/// shows it (the argument structs derive `Debug`).
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

impl std::ops::Deref for Secret {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

/// The first holder, run by the kit as a child process.
#[derive(Debug, Args)]
pub struct HolderArgs {
    pub key: String,
    #[arg(long)]
    pub class: String,
    #[arg(long, env = POSTGRES_ENV, hide_env_values = true)]
    pub postgres: Option<Secret>,
    #[arg(long, env = RESOURCE_URL_ENV, hide_env_values = true)]
    pub resource_url: Option<Secret>,
    #[arg(long)]
    pub naive: bool,
    #[arg(long)]
    pub row: String,
    #[arg(long)]
    pub write_sql: Option<String>,
    #[arg(long = "metadata", value_parser = parse_meta)]
    pub metadata: Vec<(String, String)>,
    #[arg(long, value_parser = duration::parse)]
    pub wait: Duration,
    /// The payload of the first write; the stale write appends `-stale`.
    #[arg(long)]
    pub payload: String,
    /// Campaign for the key as an election instead of acquiring it.
    #[arg(long)]
    pub election: bool,
}

/// What the holder tells the kit, one JSON object per stdout line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "camelCase")]
enum HolderEvent {
    /// Holding, first write done; now waiting for a line on stdin.
    #[serde(rename_all = "camelCase")]
    Ready {
        first_write: Observed,
        ttl_seconds: u32,
        session_id: i64,
        /// The first holder's token, for the kit's order check (Inspect
        /// never returns tokens). Only on this pipe; never printed.
        token: PipedToken,
    },
    /// The write after resume.
    #[serde(rename_all = "camelCase")]
    StaleWrite {
        outcome: Observed,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        /// An election's holder: what the arbiter did with its Proclaim.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        proclaim: Option<Observed>,
    },
}

/// A token on the pipe between the kit and its holder child: `Debug` never
/// shows it, so no error message about an unexpected event carries it.
#[derive(Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
struct PipedToken(u64);

impl std::fmt::Debug for PipedToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<token>")
    }
}

/// Opens what the record is written to: `--resource-url`'s adapter, the
/// reference fence on `--postgres`, or the owner's statements there.
async fn open_target(
    postgres: Option<&str>,
    resource_url: Option<&str>,
    owner: Option<(String, String)>,
    naive: bool,
) -> anyhow::Result<Target> {
    match (resource_url, postgres, owner) {
        (Some(url), _, _) => Ok(Target::Store {
            store: target::open(url).await?,
            naive,
        }),
        (None, Some(conninfo), Some((write, read))) => Ok(Target::Owner {
            pg: connect_postgres(conninfo).await?,
            write,
            read,
        }),
        (None, Some(conninfo), None) => {
            let pg = connect_postgres(conninfo).await?;
            latchkey_fence_postgres::ensure_schema(&pg).await?;
            Ok(Target::Store {
                store: Box::new(latchkey_fence_postgres::PostgresStore::new(pg)),
                naive,
            })
        }
        (None, None, _) => anyhow::bail!("give the resource with --resource-url or --postgres"),
    }
}

async fn connect_postgres(conninfo: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .map_err(|e| anyhow::Error::new(e).context("cannot connect to PostgreSQL"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "PostgreSQL connection ended");
        }
    });
    Ok(client)
}

fn observed(result: &Result<bool, WriteError>) -> Observed {
    match result {
        Ok(true) => Observed::Accepted,
        Ok(false) => Observed::Rejected,
        Err(_) => Observed::Error,
    }
}

// --- the holder ---------------------------------------------------------------

/// The first holder: acquire, write, `ready`, wait for a line, write again
/// with the same (by then stale) token, report, exit.
pub async fn holder(global: &Global, args: HolderArgs) -> Result<ExitCode, Failure> {
    let client = connect(global).await?;
    // The holder only writes; the kit reads the record back.
    let owner = args.write_sql.clone().map(|write| (write, String::new()));
    let open = || {
        open_target(
            args.postgres.as_deref(),
            args.resource_url.as_deref(),
            owner.clone(),
            args.naive,
        )
    };
    let target = open().await?;
    let (session, held) = if args.election {
        let session = client.open_session(&args.class).await?;
        let options = CampaignOptions {
            wait: Some(args.wait),
            session: Some(session.clone()),
            ..CampaignOptions::default()
        };
        let leadership = client
            .campaign(&args.key, &args.class, &args.payload, options)
            .await?;
        (session, Held::Leads(leadership))
    } else {
        let (session, guard, _fenced) = grant(
            &client,
            &args.key,
            &args.class,
            Some(args.wait),
            &args.metadata,
            false,
        )
        .await?;
        (session, Held::Holds(guard))
    };
    let token = held.token();
    let first = target.write(&args.row, token.get(), &args.payload).await;
    if let Err(e) = &first {
        return Err(Failure::Plain(format!("first write failed: {e}")));
    }
    let ttl_seconds = u32::try_from(session.ttl().as_secs()).unwrap_or(u32::MAX);
    emit(&HolderEvent::Ready {
        first_write: observed(&first),
        ttl_seconds,
        session_id: session.id(),
        token: PipedToken(token.get()),
    })
    .await?;

    // Frozen here by the kit; resumed, it is told to go on.
    let mut line = String::new();
    BufReader::new(tokio::io::stdin())
        .read_line(&mut line)
        .await
        .map_err(anyhow::Error::from)?;
    if line.trim() != GO {
        // End of input: the kit is gone. Write nothing nobody will check.
        held.detach();
        return Err(Failure::Plain(
            "pause-test holder: the kit went away; not writing".into(),
        ));
    }

    // Deliberately no can_start(): this write was already under way.
    let stale_payload = format!("{}-stale", args.payload);
    let mut stale = target.write(&args.row, token.get(), &stale_payload).await;
    if stale.as_ref().is_err_and(|e| e.transient) {
        // A real workload's pool would reconnect and send the write anyway.
        let target = open().await?;
        stale = target.write(&args.row, token.get(), &stale_payload).await;
    }
    // A leader also proclaims, as the round it was in would have: asked of
    // the arbiter with the leadership's session and token, not of the
    // guard (which may know it is lost by now).
    let proclaim = match &held {
        Held::Leads(_) => Some(
            match client
                .proclaim_as(
                    &args.key,
                    session.id(),
                    token,
                    &format!("{}-stale", args.payload),
                )
                .await
            {
                Ok(()) => Observed::Accepted,
                Err(e) if e.reason() == Reason::NotLeader => Observed::Rejected,
                Err(_) => Observed::Error,
            },
        ),
        Held::Holds(_) => None,
    };
    emit(&HolderEvent::StaleWrite {
        outcome: observed(&stale),
        error: stale.err().map(|e| e.to_string()),
        proclaim,
    })
    .await?;
    // The session is long gone; nothing to release.
    held.detach();
    Ok(ExitCode::SUCCESS)
}

/// What the first holder holds: a lock or a leadership.
enum Held {
    Holds(LockGuard),
    Leads(Leadership),
}

impl Held {
    fn token(&self) -> FencingToken {
        match self {
            Held::Holds(guard) => guard.token(),
            Held::Leads(leadership) => leadership.token(),
        }
    }

    /// Nothing to end: the session is gone (or the kit is).
    fn detach(self) {
        match self {
            Held::Holds(guard) => guard.detach(),
            // Its drop would send a Resign on a session that is gone.
            Held::Leads(leadership) => std::mem::forget(leadership),
        }
    }
}

async fn emit(event: &HolderEvent) -> Result<(), Failure> {
    let mut line = serde_json::to_string(event).map_err(anyhow::Error::from)?;
    line.push('\n');
    let mut stdout = tokio::io::stdout();
    stdout
        .write_all(line.as_bytes())
        .await
        .map_err(anyhow::Error::from)?;
    stdout.flush().await.map_err(anyhow::Error::from)?;
    Ok(())
}

// --- the kit ------------------------------------------------------------------

/// Why the kit could not run the test (exit 2).
struct CannotRun(String);

impl<E: std::fmt::Display> From<E> for CannotRun {
    fn from(err: E) -> Self {
        // `{:#}`: an anyhow error with its causes, as `Failure::Other` prints.
        CannotRun(format!("{err:#}"))
    }
}

macro_rules! cannot_run {
    ($($arg:tt)*) => { CannotRun(format!($($arg)*)) };
}

pub async fn run(global: &Global, args: PauseTestArgs, out: Output) -> Result<ExitCode, Failure> {
    let started_at = SystemTime::now();
    let steps = kit(global, &args, out);
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(anyhow::Error::from)?;
    // Interrupted, the steps future is dropped, and with it the holder (killed).
    let evidence = tokio::select! {
        result = steps => result,
        _ = tokio::signal::ctrl_c() => Err(cannot_run!("interrupted")),
        _ = terminate.recv() => Err(cannot_run!("terminated")),
    };
    let (evidence, store) = match evidence {
        Ok(found) => found,
        Err(CannotRun(why)) => {
            out.note(
                json!({ "event": "error", "error": why }),
                format_args!("latchctl: pause-test could not run: {why}"),
            );
            return Ok(ExitCode::from(2));
        }
    };
    let failure = judge(&evidence).or_else(|| {
        (args.election && evidence.stale_proclaim_after_resume.is_none()).then(|| {
            "the frozen leader's Proclaim after resume was not observed (an election's kit must \
             see it refused NOT_LEADER)"
                .to_owned()
        })
    });
    let result = PauseTestResult {
        version: PAUSE_TEST_RESULT_VERSION,
        class: args.class.clone(),
        resource: args.resource.clone(),
        resource_schema_version: args.schema_version.clone(),
        started_at,
        finished_at: SystemTime::now(),
        outcome: if failure.is_none() {
            PauseTestOutcome::Pass
        } else {
            PauseTestOutcome::Fail
        },
        kit: format!("latchctl {} pause-test", env!("CARGO_PKG_VERSION")),
        evidence,
        failure,
        store,
    };
    if let Err(e) = write_result(&args.out, &result) {
        out.note(
            json!({ "event": "error", "error": e.to_string() }),
            format_args!(
                "latchctl: pause-test ran ({}) but could not write {}: {e}",
                result.outcome,
                args.out.display()
            ),
        );
        return Ok(ExitCode::from(2));
    }
    summarise(&result, &args.out, out);
    Ok(if result.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The steps; the holder child is killed if this returns early or is dropped.
async fn kit(
    global: &Global,
    args: &PauseTestArgs,
    out: Output,
) -> Result<(PauseTestEvidence, Option<PauseTestStore>), CannotRun> {
    let owner = args.write_sql.clone().zip(args.read_sql.clone());
    let row = args.row.clone().unwrap_or_else(|| default_row(&args.key));
    let run_id = run_id();
    let first_payload = format!("latchkey-pause-test {run_id} {FIRST_HOLDER}");
    let second_payload = format!("latchkey-pause-test {run_id} {SECOND_HOLDER}");

    let client = match connect(global).await {
        Ok(client) => client,
        Err(Failure::Lock(e)) => {
            return Err(cannot_run!("cannot reach the arbiter: {}", chain(&e)));
        }
        Err(Failure::Usage(m) | Failure::Plain(m) | Failure::Lost(m)) => return Err(CannotRun(m)),
        Err(Failure::Other(e)) => return Err(cannot_run!("{e:#}")),
    };
    // The result must say what was proven: a `redis:…` resource from a
    // Redis fence; `--postgres` (and `--write-sql`) prove PostgreSQL.
    let url = args
        .resource_url
        .as_ref()
        .map_or("postgresql://", |url| url.expose());
    target::check_resource_kind(&args.resource, url).map_err(|why| {
        CannotRun(if args.resource_url.is_some() {
            why
        } else {
            format!(
                "--resource {:?} does not name a postgresql resource, but --postgres tests \
                 PostgreSQL: name it postgresql:<name> (the result must say which store was \
                 proven)",
                args.resource
            )
        })
    })?;
    let target = open_target(
        args.postgres.as_deref(),
        args.resource_url.as_deref(),
        owner,
        args.naive,
    )
    .await?;
    let store = target.store_info().and_then(|(kind, caveats)| {
        args.resource_url.as_ref().map(|url| PauseTestStore {
            kind: kind.to_owned(),
            locator: target::locator(url),
            caveats,
        })
    });

    // 1. The first holder acquires and writes.
    let mut holder = Holder::spawn(global, args, &row, &first_payload)?;
    let ready = timeout(args.wait + HOLDER_START_SLACK, holder.next_event())
        .await
        .map_err(|_| cannot_run!("the holder did not acquire and write in time"))?;
    let (first_write, ttl_seconds, holder_session, first_token) = match ready {
        Ok(HolderEvent::Ready {
            first_write,
            ttl_seconds,
            session_id,
            token,
        }) => (
            first_write,
            ttl_seconds,
            session_id,
            FencingToken::new(token.0),
        ),
        Ok(other) => return Err(cannot_run!("the holder said {other:?} before ready")),
        Err(()) => return Err(cannot_run!("the holder failed: {}", holder.stderr().await)),
    };
    if first_write != Observed::Accepted {
        return Err(cannot_run!(
            "the first holder's write was {first_write}, so there is nothing to fence: the \
             record {row:?} must accept a fresh grant's write (it may carry a mark from another \
             lock service, or --write-sql updates only an existing record)"
        ));
    }
    if args.election {
        holder_leads(&client, &args.key, &first_payload).await?;
    } else {
        holder_holds(&client, &args.key, holder_session).await?;
    }

    // 2. Freeze it past its TTL.
    let ttl = Duration::from_secs(u64::from(ttl_seconds));
    let pause = ttl + PAUSE_MARGIN;
    out.note(
        json!({ "event": "paused", "ttl_seconds": ttl_seconds, "pause_ms": millis(pause) }),
        format_args!(
            "latchctl: pause-test: holder holds {} and wrote; freezing it for {}s (TTL {ttl_seconds}s + {}s)",
            args.key,
            pause.as_secs(),
            PAUSE_MARGIN.as_secs()
        ),
    );
    holder.signal(Signal::SIGSTOP)?;
    let paused_at = Instant::now();
    sleep_until(paused_at + pause).await;

    // 3. The second holder: its own session, queued until the lease is gone.
    let session = client
        .open_session(&args.class)
        .await
        .map_err(|e| cannot_run!("second holder: {}", chain(&e)))?;
    let second = if args.election {
        let options = CampaignOptions {
            wait: Some(args.wait),
            session: Some(session.clone()),
            ..CampaignOptions::default()
        };
        let leadership = client
            .campaign(&args.key, &args.class, &second_payload, options)
            .await
            .map_err(|e| cannot_run!("second holder could not lead {}: {}", args.key, chain(&e)))?;
        Held::Leads(leadership)
    } else {
        let mut lock = client
            .lock(args.key.clone(), args.class.clone())
            .session(&session)
            .wait(args.wait);
        for (k, v) in &args.metadata {
            lock = lock.metadata(k.clone(), v.clone());
        }
        Held::Holds(lock.acquire(|_| {}).await.map_err(|e| {
            cannot_run!(
                "second holder could not acquire {}: {}",
                args.key,
                chain(&e)
            )
        })?)
    };
    let second_token_greater = second.token() > first_token;
    let second_write = target
        .write(&row, second.token().get(), &second_payload)
        .await;
    let second_write_error = second_write.as_ref().err().map(ToString::to_string);
    let ended = match second {
        Held::Holds(guard) => guard.release().await,
        Held::Leads(leadership) => leadership.resign().await.map(|_| ()),
    };
    if let Err(e) = ended {
        tracing::warn!(error = %e, "second holder's release failed; it ends with the session");
    }
    let _ = session.close().await;

    // 4. Resume the first holder; its in-flight write goes out now.
    holder.signal(Signal::SIGCONT)?;
    let paused_for = paused_at.elapsed();
    holder.go().await?;
    let stale = timeout(STALE_WRITE_TIMEOUT, holder.next_event())
        .await
        .map_err(|_| cannot_run!("the resumed holder did not report its write in time"))?;
    let (stale_write, stale_error, stale_proclaim) = match stale {
        Ok(HolderEvent::StaleWrite {
            outcome,
            error,
            proclaim,
        }) => (outcome, error, proclaim),
        Ok(other) => return Err(cannot_run!("the holder said {other:?} after resume")),
        Err(()) => return Err(cannot_run!("the holder failed: {}", holder.stderr().await)),
    };
    holder.finish().await;

    let final_payload = target.read(&row).await?;
    let final_row_from = match final_payload.as_deref() {
        Some(p) if p == second_payload => SECOND_HOLDER.to_owned(),
        Some(p) if p.starts_with(&first_payload) => FIRST_HOLDER.to_owned(),
        Some(_) => "other".to_owned(),
        None => "missing".to_owned(),
    };
    if let Some(e) = second_write_error {
        tracing::warn!(error = %e, "second holder's write failed");
    }
    if let Some(e) = stale_error {
        out.note(
            json!({ "event": "stale_write_error", "error": e }),
            format_args!("latchctl: pause-test: the stale write failed: {e}"),
        );
    }
    let evidence = PauseTestEvidence {
        ttl_seconds,
        paused_for_ms: millis(paused_for),
        first_write,
        second_holder_write: observed(&second_write),
        second_token_greater,
        stale_write_after_resume: stale_write,
        final_row_from,
        stale_proclaim_after_resume: stale_proclaim,
    };
    Ok((evidence, store))
}

/// `None` on a pass; otherwise the first assertion that failed, in words.
fn judge(e: &PauseTestEvidence) -> Option<String> {
    if e.paused_for_ms <= u64::from(e.ttl_seconds) * 1000 {
        return Some(format!(
            "the holder was frozen for only {} ms, not past its {} s TTL",
            e.paused_for_ms, e.ttl_seconds
        ));
    }
    if !e.second_token_greater {
        return Some(
            "the second holder's fencing token was not greater than the first holder's".into(),
        );
    }
    if e.second_holder_write != Observed::Accepted {
        return Some(format!(
            "the second holder's write (the newer token) was {}: the fence must accept a later grant",
            e.second_holder_write
        ));
    }
    match e.stale_write_after_resume {
        Observed::Rejected => {}
        Observed::Accepted => {
            return Some(
                "the frozen holder's stale write was ACCEPTED after a later holder wrote: the \
                 resource is not fenced (compare the record's mark with the token and write in \
                 ONE atomic step — one statement, script or transaction — that refuses unless \
                 mark < token, and check its answer, e.g. the affected row count)"
                    .into(),
            );
        }
        Observed::Error => {
            return Some(
                "the frozen holder's stale write failed with an error instead of being rejected \
                 by the fence (0 rows affected, fenced out)"
                    .into(),
            );
        }
    }
    if e.final_row_from != SECOND_HOLDER {
        return Some(format!(
            "the record holds the {} write at the end, not the second holder's",
            e.final_row_from
        ));
    }
    match e.stale_proclaim_after_resume {
        None | Some(Observed::Rejected) => {}
        Some(Observed::Accepted) => {
            return Some(
                "the frozen leader's Proclaim was ACCEPTED after another leader's term began"
                    .into(),
            );
        }
        Some(Observed::Error) => {
            return Some(
                "the frozen leader's Proclaim failed with an error instead of NOT_LEADER".into(),
            );
        }
    }
    None
}

fn summarise(result: &PauseTestResult, path: &Path, out: Output) {
    if out.json {
        match serde_json::to_value(result) {
            Ok(value) => out.line(value),
            Err(e) => eprintln!("latchctl: cannot print the result: {e}"),
        }
        return;
    }
    let e = &result.evidence;
    let verdict = if result.passed() { "PASS" } else { "FAIL" };
    println!(
        "pause-test {verdict}: class {}, resource {}",
        result.class, result.resource
    );
    println!("  first holder's write         {}", e.first_write);
    println!(
        "  frozen for                   {:.1}s (TTL {}s)",
        Duration::from_millis(e.paused_for_ms).as_secs_f64(),
        e.ttl_seconds
    );
    println!(
        "  second holder's token        {}",
        if e.second_token_greater {
            "greater"
        } else {
            "NOT greater"
        }
    );
    println!("  second holder's write        {}", e.second_holder_write);
    println!(
        "  stale write after resume     {}",
        e.stale_write_after_resume
    );
    println!("  record holds the write of    {}", e.final_row_from);
    if let Some(proclaim) = e.stale_proclaim_after_resume {
        println!("  stale Proclaim after resume  {proclaim}");
    }
    if let Some(failure) = &result.failure {
        println!("  why: {failure}");
    }
    if let Some(store) = &result.store {
        println!(
            "  store                        {} at {}",
            store.kind, store.locator
        );
        for caveat in &store.caveats {
            println!("  caveat: {caveat}");
        }
    }
    println!("result written to {}", path.display());
}

/// Written next to its final name, then renamed: a reader sees all or nothing.
fn write_result(path: &Path, result: &PauseTestResult) -> anyhow::Result<()> {
    let mut text = result.to_json_pretty()?;
    text.push('\n');
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Checks with Inspect that the first holder's session holds the key (the
/// kit runs as the same identity, so it sees the session id).
async fn holder_holds(client: &Client, key: &str, session_id: i64) -> Result<(), CannotRun> {
    let view = client
        .inspect(key)
        .await
        .map_err(|e| cannot_run!("inspecting {key}: {}", chain(&e)))?;
    match view.holder {
        Some(h) if h.session_id == session_id => Ok(()),
        Some(h) => Err(cannot_run!(
            "{key} is held by session {}, not the holder's session {session_id}",
            h.session_id
        )),
        None => Err(cannot_run!(
            "{key} is free: the holder lost it before the pause"
        )),
    }
}

/// Checks with Leader that the first holder leads the election (its value
/// is its payload, unique to this run).
async fn holder_leads(client: &Client, election: &str, value: &str) -> Result<(), CannotRun> {
    let leader = client
        .leader(election)
        .await
        .map_err(|e| cannot_run!("asking who leads {election}: {}", chain(&e)))?;
    match leader {
        Some(l) if l.value == value => Ok(()),
        Some(l) => Err(cannot_run!(
            "{election} is led by {} (term {}), not the holder",
            l.identity,
            l.term
        )),
        None => Err(cannot_run!(
            "{election} is vacant: the holder lost it before the pause"
        )),
    }
}

/// The record id when `--row` is not given: a name every store takes (S3
/// keeps record names to letters, digits and `-_.~/`), so characters of
/// the key outside those become `-`.
fn default_row(key: &str) -> String {
    let key: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~' | '/') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let key = key
        .split('/')
        .map(|seg| if seg == "." || seg == ".." { "-" } else { seg })
        .collect::<Vec<_>>()
        .join("/");
    format!("latchkey-pause-test/{key}")
}

/// Unique per run, so payloads say which run and which holder wrote them.
fn run_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The holder child. Dropping it kills it (SIGKILL also ends a stopped process).
struct Holder {
    child: Child,
    stdin: Option<ChildStdin>,
    events: Lines<BufReader<ChildStdout>>,
    stderr: Option<JoinHandle<String>>,
}

impl Holder {
    fn spawn(
        global: &Global,
        args: &PauseTestArgs,
        row: &str,
        payload: &str,
    ) -> Result<Self, CannotRun> {
        let exe = std::env::current_exe()
            .map_err(|e| cannot_run!("cannot find this executable to run the holder: {e}"))?;
        let mut cmd = Command::new(exe);
        cmd.args(connection_args(global))
            .arg("pause-test-holder")
            .arg(&args.key)
            .arg("--class")
            .arg(&args.class)
            .arg("--row")
            .arg(row)
            .arg("--payload")
            .arg(payload)
            .arg("--wait")
            .arg(format!("{}ms", args.wait.as_millis()))
            .args(args.election.then_some("--election"))
            .args(args.naive.then_some("--naive"))
            // Connection strings by environment only (`ps` shows argv), and
            // only the one this run uses.
            .env_remove(POSTGRES_ENV)
            .env_remove(RESOURCE_URL_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(url) = &args.resource_url {
            cmd.env(RESOURCE_URL_ENV, url.expose());
        } else if let Some(conninfo) = &args.postgres {
            cmd.env(POSTGRES_ENV, conninfo.expose());
        }
        if let Some(sql) = &args.write_sql {
            cmd.arg("--write-sql").arg(sql);
        }
        for (k, v) in &args.metadata {
            cmd.arg("--metadata").arg(format!("{k}={v}"));
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| cannot_run!("cannot start the holder: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| cannot_run!("the holder has no stdout"))?;
        let stderr = child.stderr.take().map(|mut err| {
            tokio::spawn(async move {
                let mut text = String::new();
                let _ = err.read_to_string(&mut text).await;
                text
            })
        });
        Ok(Self {
            child,
            stdin,
            events: BufReader::new(stdout).lines(),
            stderr,
        })
    }

    /// The next event; `Err` when the holder exited or said something else.
    async fn next_event(&mut self) -> Result<HolderEvent, ()> {
        loop {
            match self.events.next_line().await {
                Ok(Some(line)) if line.trim().is_empty() => continue,
                Ok(Some(line)) => return serde_json::from_str(&line).map_err(|_| ()),
                Ok(None) | Err(_) => return Err(()),
            }
        }
    }

    fn signal(&self, signal: Signal) -> Result<(), CannotRun> {
        let pid = self
            .child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .ok_or_else(|| cannot_run!("the holder has exited"))?;
        kill(Pid::from_raw(pid), signal)
            .map_err(|e| cannot_run!("cannot send {signal} to the holder: {e}"))
    }

    async fn go(&mut self) -> Result<(), CannotRun> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| cannot_run!("the holder's stdin is closed"))?;
        stdin
            .write_all(format!("{GO}\n").as_bytes())
            .await
            .map_err(|e| cannot_run!("cannot tell the holder to write: {e}"))?;
        stdin
            .flush()
            .await
            .map_err(|e| cannot_run!("cannot tell the holder to write: {e}"))?;
        Ok(())
    }

    /// The holder's stderr once it has exited (its last part), for errors.
    async fn stderr(&mut self) -> String {
        let _ = timeout(Duration::from_secs(5), self.child.wait()).await;
        let text = match self.stderr.take() {
            Some(task) => timeout(Duration::from_secs(5), task)
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default(),
            None => String::new(),
        };
        let text = text.trim();
        if text.is_empty() {
            return "it exited without a message".into();
        }
        let mut start = text.len().saturating_sub(STDERR_TAIL_BYTES);
        while !text.is_char_boundary(start) {
            start += 1;
        }
        text[start..].to_owned()
    }

    /// Lets the holder exit on its own (it has reported), then reaps it.
    async fn finish(mut self) {
        self.stdin = None;
        if timeout(Duration::from_secs(5), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }
}

/// latchctl's own connection flags, for the holder.
fn connection_args(global: &Global) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> =
        vec!["--endpoint".into(), global.endpoint.clone().into()];
    let mut path = |flag: &str, value: &Option<PathBuf>| {
        if let Some(v) = value {
            args.push(flag.into());
            args.push(v.clone().into_os_string());
        }
    };
    path("--ca", &global.ca);
    path("--cert", &global.cert);
    path("--key", &global.key);
    if let Some(domain) = &global.tls_domain {
        args.push("--tls-domain".into());
        args.push(domain.into());
    }
    if let Some(identity) = &global.insecure_dev_identity {
        args.push("--insecure-dev-identity".into());
        args.push(identity.into());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32: the driver says only "error connecting to server"; why
    /// (here a refused connection) is in its source, and the kit prints it.
    #[tokio::test]
    async fn a_postgres_that_cannot_be_reached_says_why() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let err = match connect_postgres(&format!("host=127.0.0.1 port={port} user=x")).await {
            Ok(_) => panic!("connected to a closed port"),
            Err(e) => e,
        };
        let CannotRun(why) = CannotRun::from(err);
        assert!(
            why.starts_with("cannot connect to PostgreSQL: error connecting to server: "),
            "{why}"
        );
        assert!(why.contains("refused"), "{why}");
    }

    fn passing() -> PauseTestEvidence {
        PauseTestEvidence {
            ttl_seconds: 5,
            paused_for_ms: 7_100,
            first_write: Observed::Accepted,
            second_holder_write: Observed::Accepted,
            second_token_greater: true,
            stale_write_after_resume: Observed::Rejected,
            final_row_from: SECOND_HOLDER.into(),
            stale_proclaim_after_resume: None,
        }
    }

    #[test]
    fn a_rejected_stale_write_with_the_second_write_in_place_passes() {
        assert_eq!(judge(&passing()), None);
    }

    #[test]
    fn a_frozen_leaders_accepted_proclaim_fails() {
        let mut e = passing();
        e.stale_proclaim_after_resume = Some(Observed::Rejected);
        assert_eq!(judge(&e), None);
        e.stale_proclaim_after_resume = Some(Observed::Accepted);
        assert!(judge(&e).is_some_and(|why| why.contains("Proclaim was ACCEPTED")));
        e.stale_proclaim_after_resume = Some(Observed::Error);
        assert!(judge(&e).is_some_and(|why| why.contains("NOT_LEADER")));
    }

    #[test]
    fn each_broken_assertion_fails_with_its_reason() {
        let fails = |f: fn(&mut PauseTestEvidence)| {
            let mut e = passing();
            f(&mut e);
            judge(&e).unwrap()
        };
        assert!(fails(|e| e.stale_write_after_resume = Observed::Accepted).contains("ACCEPTED"));
        assert!(fails(|e| e.stale_write_after_resume = Observed::Error).contains("error"));
        assert!(fails(|e| e.second_token_greater = false).contains("not greater"));
        assert!(fails(|e| e.second_holder_write = Observed::Rejected).contains("second holder"));
        assert!(fails(|e| e.final_row_from = FIRST_HOLDER.into()).contains("first-holder"));
        assert!(fails(|e| e.paused_for_ms = 4_000).contains("TTL"));
    }

    #[test]
    fn holder_events_are_json_lines() {
        let ready = HolderEvent::Ready {
            first_write: Observed::Accepted,
            ttl_seconds: 5,
            session_id: 7,
            token: PipedToken(281_474_976_710_699),
        };
        let line = serde_json::to_string(&ready).unwrap();
        assert_eq!(
            line,
            r#"{"event":"ready","firstWrite":"accepted","ttlSeconds":5,"sessionId":7,"token":281474976710699}"#
        );
        assert!(!format!("{ready:?}").contains("281474976710699"));
        assert_eq!(serde_json::from_str::<HolderEvent>(&line).unwrap(), ready);
        let stale = HolderEvent::StaleWrite {
            outcome: Observed::Rejected,
            error: None,
            proclaim: None,
        };
        let line = serde_json::to_string(&stale).unwrap();
        assert_eq!(line, r#"{"event":"staleWrite","outcome":"rejected"}"#);
        let leader = HolderEvent::StaleWrite {
            outcome: Observed::Rejected,
            error: None,
            proclaim: Some(Observed::Rejected),
        };
        let line = serde_json::to_string(&leader).unwrap();
        assert_eq!(
            line,
            r#"{"event":"staleWrite","outcome":"rejected","proclaim":"rejected"}"#
        );
        assert_eq!(serde_json::from_str::<HolderEvent>(&line).unwrap(), leader);
    }

    #[test]
    fn the_default_row_comes_from_the_key_and_run_ids_differ() {
        assert_eq!(default_row("payments/a"), "latchkey-pause-test/payments/a");
        assert_eq!(
            default_row("payments/../a:b=c"),
            "latchkey-pause-test/payments/-/a-b-c"
        );
        assert_ne!(run_id(), run_id());
    }

    #[test]
    fn the_holder_gets_the_same_connection_flags() {
        let global = Global {
            endpoint: "https://a:1".into(),
            ca: Some("ca.pem".into()),
            cert: Some("c.pem".into()),
            key: Some("k.pem".into()),
            tls_domain: None,
            insecure_dev_identity: None,
            json: true,
        };
        let args: Vec<String> = connection_args(&global)
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--endpoint",
                "https://a:1",
                "--ca",
                "ca.pem",
                "--cert",
                "c.pem",
                "--key",
                "k.pem"
            ]
        );
    }
}
