//! `renew-dev-pause-tests`: produces the pause-test results the fenced classes in
//! `policies/dev` name (ADR-17), by running the real kit against a real resource.
//!
//! The dev policy directory does not load without a passing, current result for
//! every fenced class, and a result is evidence only if the kit produced it. So this
//! program starts real etcd, a real PostgreSQL (the dev table
//! `dev.latchkey_fenced_rows`, the resource the classes name) and the real
//! `latchkey-arbiter` binary over mTLS, then runs the real `latchctl pause-test`
//! once per fenced class it finds in `policies/dev/classes/*.toml`, with the
//! reference fence. The arbiter loads a temporary copy of `policies/dev` with
//! fixture results ([`copy_dev_policies`]); that only lets it serve the classes. What
//! is committed is the kit's own output, copied verbatim, and only when it passed,
//! checks against the class's `[class.pauseTest]` and PostgreSQL confirms the row
//! holds the second holder's write. One summary line per class on stdout; exit 1 if
//! any class did not pass (its old result, if any, is left as it was).
//!
//! Run through `scripts/renew-pause-tests`, which builds the Wasm hooks and the
//! binaries first.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail, ensure};
use clap::Parser;
use latchkey_policies::{
    CLASSES_DIR, ClassPauseTest, Date, Enforcement, GRANTS_DIR, LockClass, LockKey,
    PauseTestResult, PolicyFile, PolicySet,
};
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, certs, spiffe, svid_flags};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::postgres::PostgresServer;
use latchkey_tests::{PAUSE_TEST_FIXTURE_KIT, copy_dev_policies, workspace_root};
use tempfile::TempDir;
use tokio::process::Command;
use tokio::time::timeout;

/// The schema of the dev resource: the classes name `postgresql:dev.latchkey_fenced_rows`.
const DEV_SCHEMA: &str = "dev";
/// On top of the class TTL and the kit's 2 s margin: startup, both acquires, the writes.
const KIT_SLACK: Duration = Duration::from_secs(120);
/// The change-ticket hook's module; its classes need a ticket on both acquires.
const CHANGE_TICKET_MODULE: &str = "latchkey_hook_change_ticket";
/// The metadata key the change-ticket hook reads unless its config says `metadataKey`.
const DEFAULT_TICKET_KEY: &str = "ticket";
const LOG_TAIL_LINES: usize = 20;

#[derive(Debug, Parser)]
#[command(about = "Renew policies/dev's pause-test results by running the real kit")]
struct Args {
    /// Only these fenced classes (repeatable); all fenced classes by default.
    #[arg(long = "class", value_name = "CLASS")]
    classes: Vec<String>,
    /// The dev identity the kit runs as; it needs a grant on --key-prefix.
    #[arg(long, default_value = "workload/demo")]
    identity: String,
    /// Each class is tested on the key `<prefix>/<class>`.
    #[arg(long, default_value = "demo/pause-test")]
    key_prefix: String,
    /// The change ticket sent to classes with the change-ticket hook.
    #[arg(long, default_value = "CHG-0000001")]
    ticket: String,
    /// The latchctl binary (the kit); default: `latchctl` next to this program.
    #[arg(long, value_name = "PATH")]
    latchctl: Option<PathBuf>,
    /// The arbiter binary; default: `latchkey-arbiter` next to this program.
    #[arg(long, value_name = "PATH")]
    arbiter: Option<PathBuf>,
}

/// One fenced class to test, as its policy file declares it.
struct Target {
    class: LockClass,
    spec: ClassPauseTest,
    key: String,
    metadata: Vec<(String, String)>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // Interrupted, `run` is dropped, and with it the kit, the arbiter, etcd and
    // PostgreSQL; results already installed stay, the one in progress is not written.
    let outcome = tokio::select! {
        outcome = run(args) => outcome,
        why = stop_signal() => Err(anyhow::anyhow!("{why}")),
    };
    // certs() keeps its temp dir for the whole process (a static is never dropped):
    // remove the throwaway CA and its keys now that nothing uses them.
    if let Ok(td) = certs() {
        let _ = std::fs::remove_dir_all(&td.dir);
    }
    match outcome {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(e) => {
            eprintln!("renew-dev-pause-tests: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM, with what happened; never if neither can be watched.
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate()).ok();
    tokio::select! {
        Ok(()) = tokio::signal::ctrl_c() => "interrupted",
        Some(_) = async { terminate.as_mut()?.recv().await } => "terminated",
        else => std::future::pending().await,
    }
}

/// `Ok(true)` when every class passed and `policies/dev` loads afterwards.
async fn run(args: Args) -> anyhow::Result<bool> {
    let policies = workspace_root().join("policies/dev");
    let latchctl = binary(args.latchctl.as_deref(), "latchctl", "--latchctl")?;
    let arbiter_bin = binary(args.arbiter.as_deref(), "latchkey-arbiter", "--arbiter")?;
    let targets = targets(&policies, &args)?;
    eprintln!(
        "renew-dev-pause-tests: fenced classes in {}: {}",
        policies.display(),
        targets
            .iter()
            .map(|t| t.class.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );

    let etcd = EtcdServer::start().await.context("starting etcd")?;
    let pg = PostgresServer::start()
        .await
        .context("starting PostgreSQL")?;
    let db = pg.client().await?;
    // Every later connection (the kit's, its holder's) resolves the unqualified
    // reference table to dev.latchkey_fenced_rows, the resource the classes name.
    db.batch_execute(&format!(
        "CREATE SCHEMA {DEV_SCHEMA}; ALTER DATABASE {} SET search_path TO {DEV_SCHEMA}",
        latchkey_tests::postgres::DATABASE
    ))
    .await
    .context("creating the dev schema")?;
    let arbiter_policies = tempfile::Builder::new()
        .prefix("latchkey-renew-policies-")
        .tempdir()?;
    copy_dev_policies(arbiter_policies.path())?;
    let arbiter = ArbiterProcess::start(
        &arbiter_bin,
        &etcd,
        ArbiterOptions {
            policies_dir: arbiter_policies.path().to_path_buf(),
            ..ArbiterOptions::default()
        },
        "info",
    )
    .await
    .context("starting the arbiter")?;
    eprintln!(
        "renew-dev-pause-tests: etcd {}, PostgreSQL 127.0.0.1:{}, arbiter https://{} ({})",
        etcd.endpoint(),
        pg.port(),
        arbiter.addr(),
        arbiter_bin.display()
    );

    let work = TempDir::new()?;
    let mut all_passed = true;
    for target in &targets {
        let kit = Kit {
            latchctl: &latchctl,
            arbiter: &arbiter,
            pg: &pg,
            identity: &args.identity,
        };
        match renew(&kit, &db, &policies, work.path(), target).await {
            Ok(line) => println!("{line}"),
            Err(e) => {
                all_passed = false;
                println!("{}: NOT RENEWED: {e:#}", target.class.name);
                eprintln!(
                    "--- arbiter log (last {LOG_TAIL_LINES} lines)\n{}",
                    tail(&arbiter.log().unwrap_or_default(), LOG_TAIL_LINES)
                );
            }
        }
    }

    match PolicySet::load_dir(&policies, Date::today_utc()) {
        Ok(set) => eprintln!(
            "renew-dev-pause-tests: {} loads ({} classes)",
            policies.display(),
            set.classes().len()
        ),
        Err(e) => {
            all_passed = false;
            eprintln!(
                "renew-dev-pause-tests: {} still does not load: {e}",
                policies.display()
            );
        }
    }
    Ok(all_passed)
}

/// `explicit` (given with `flag`), or `name` next to this program, where cargo
/// puts the workspace's other binaries.
fn binary(explicit: Option<&Path>, name: &str, flag: &str) -> anyhow::Result<PathBuf> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()?
            .parent()
            .context("this program's directory")?
            .join(name),
    };
    ensure!(
        path.is_file(),
        "{} not found: build it (scripts/renew-pause-tests does) or pass {flag}",
        path.display()
    );
    Ok(path)
}

/// The fenced classes of `policies` (all, or those in `--class`), read from its
/// policy files without reading any result, each with its key and hook metadata.
fn targets(policies: &Path, args: &Args) -> anyhow::Result<Vec<Target>> {
    let classes = read_toml_dir(&policies.join(CLASSES_DIR))?;
    let grants = read_toml_dir(&policies.join(GRANTS_DIR))?;
    let class_files: Vec<PolicyFile<'_>> = classes
        .iter()
        .map(|(path, text)| PolicyFile { path, text })
        .collect();
    let grant_files: Vec<PolicyFile<'_>> = grants
        .iter()
        .map(|(path, text)| PolicyFile { path, text })
        .collect();
    let set = PolicySet::from_files(&class_files, &grant_files, Date::today_utc())
        .with_context(|| format!("reading {}", policies.display()))?;
    for wanted in &args.classes {
        match set.classes().get(wanted) {
            Some(c) if c.enforcement == Enforcement::Fenced => {}
            Some(_) => bail!("class {wanted:?} is not fenced; only fenced classes need a result"),
            None => bail!("no class {wanted:?} in {}", policies.display()),
        }
    }
    let identity = spiffe(&args.identity);
    let mut targets = Vec::new();
    for class in set.classes().values() {
        if class.enforcement != Enforcement::Fenced
            || (!args.classes.is_empty() && !args.classes.contains(&class.name))
        {
            continue;
        }
        let spec = class
            .pause_test
            .clone()
            .with_context(|| format!("fenced class {:?} has no [class.pauseTest]", class.name))?;
        let key = format!("{}/{}", args.key_prefix, class.name);
        let parsed = LockKey::parse(&key).with_context(|| format!("key {key:?}"))?;
        ensure!(
            set.grants().allows(&identity, &parsed),
            "{identity} has no grant on {key:?} in {}/grants; pass --identity or --key-prefix",
            policies.display()
        );
        targets.push(Target {
            metadata: hook_metadata(class, &args.ticket),
            class: class.clone(),
            spec,
            key,
        });
    }
    ensure!(
        !targets.is_empty(),
        "no fenced classes in {}",
        policies.display()
    );
    Ok(targets)
}

fn read_toml_dir(dir: &Path) -> anyhow::Result<Vec<(PathBuf, String)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') || path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        files.push((path, text));
    }
    files.sort();
    Ok(files)
}

/// Request metadata the class's hook needs before it lets the kit acquire: a change
/// ticket for the change-ticket hook (policies/HOOKS.md), nothing for the others.
fn hook_metadata(class: &LockClass, ticket: &str) -> Vec<(String, String)> {
    let Some(hook) = &class.hook else {
        return Vec::new();
    };
    let module = Path::new(&hook.module)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("");
    if module != CHANGE_TICKET_MODULE {
        return Vec::new();
    }
    let key = hook
        .config
        .get("metadataKey")
        .and_then(|v| v.as_str())
        .unwrap_or(DEFAULT_TICKET_KEY);
    vec![(key.to_owned(), ticket.to_owned())]
}

/// What every kit run shares: the binary, the stack and the identity.
struct Kit<'a> {
    latchctl: &'a Path,
    arbiter: &'a ArbiterProcess,
    pg: &'a PostgresServer,
    identity: &'a str,
}

impl Kit<'_> {
    /// `latchctl <identity's mTLS flags> pause-test KEY --class --resource --postgres --out`.
    async fn run(&self, target: &Target, out: &Path) -> anyhow::Result<Output> {
        let mut cmd = Command::new(self.latchctl);
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .arg("--endpoint")
            .arg(format!("https://{}", self.arbiter.addr()))
            .args(svid_flags(self.identity)?)
            .arg("pause-test")
            .arg(&target.key)
            .arg("--class")
            .arg(&target.class.name)
            .arg("--resource")
            .arg(&target.spec.resource)
            .arg("--postgres")
            .arg(self.pg.url())
            .arg("--out")
            .arg(out);
        if let Some(version) = &target.spec.schema_version {
            cmd.arg("--schema-version").arg(version);
        }
        for (k, v) in &target.metadata {
            cmd.arg("--metadata").arg(format!("{k}={v}"));
        }
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        let limit = Duration::from_secs(u64::from(target.class.ttl_seconds)) + KIT_SLACK;
        timeout(limit, cmd.output())
            .await
            .with_context(|| format!("the kit did not finish within {limit:?}"))?
            .with_context(|| format!("running {}", self.latchctl.display()))
    }
}

/// Runs the kit for one class and, if it passed, installs its result; the summary line.
async fn renew(
    kit: &Kit<'_>,
    db: &tokio_postgres::Client,
    policies: &Path,
    work: &Path,
    target: &Target,
) -> anyhow::Result<String> {
    let name = &target.class.name;
    let out = work.join(format!("{name}.json"));
    let output = kit.run(target, &out).await?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.success(),
        "the kit exited {:?}: {}{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).trim(),
        if stderr.trim().is_empty() {
            String::new()
        } else {
            format!("\n{}", tail(&stderr, LOG_TAIL_LINES))
        }
    );
    let bytes = std::fs::read(&out).with_context(|| format!("the kit's {}", out.display()))?;
    let result = PauseTestResult::from_json_slice(&bytes)
        .with_context(|| format!("the kit's {} is not a result", out.display()))?;

    // What the policy loader will ask, and that it came from the kit, not a fixture.
    result
        .check(name, &target.spec, SystemTime::now())
        .context("the kit's result would not let the class load")?;
    ensure!(
        result.kit != PAUSE_TEST_FIXTURE_KIT && result.kit.starts_with("latchctl "),
        "the result was not written by latchctl's kit: {:?}",
        result.kit
    );
    // And what the resource itself says: the second holder's write stayed, and the
    // stale one did not count (the first write and the second, nothing more).
    let row = format!("latchkey-pause-test/{}", target.key);
    let stored = db
        .query_opt(
            &format!("SELECT payload, writes FROM {DEV_SCHEMA}.latchkey_fenced_rows WHERE id = $1"),
            &[&row],
        )
        .await
        .with_context(|| format!("reading back {row:?}"))?
        .with_context(|| format!("no row {row:?} in {DEV_SCHEMA}.latchkey_fenced_rows"))?;
    let (payload, writes): (String, i64) = (stored.try_get(0)?, stored.try_get(1)?);
    ensure!(
        payload.ends_with(" second-holder") && writes == 2,
        "PostgreSQL disagrees with the result: row {row:?} holds {payload:?} after {writes} writes"
    );

    let dest = policies.join(&target.spec.result);
    install(&dest, &bytes)?;
    let e = &result.evidence;
    Ok(format!(
        "{name}: PASS ({key}, {resource}): ttl {ttl}s, holder frozen {paused} ms, second token \
         greater, stale write {stale}, row holds the second holder's write; wrote {dest}, valid \
         until {expires}",
        key = target.key,
        resource = result.resource,
        ttl = e.ttl_seconds,
        paused = e.paused_for_ms,
        stale = e.stale_write_after_resume,
        dest = dest
            .strip_prefix(workspace_root())
            .unwrap_or(&dest)
            .display(),
        expires = Date::from_system_time(result.expires_at()),
    ))
}

/// Writes `bytes` to `dest` atomically (a temp file beside it, then rename).
fn install(dest: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = dest.parent().context("the result's directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tmp = dest.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", dest.display()))?;
    std::fs::rename(&tmp, dest).with_context(|| format!("writing {}", dest.display()))?;
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
