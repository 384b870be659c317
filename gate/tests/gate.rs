//! The release gate (ADR-23) as CI runs it: a short seeded run with every
//! fault kind on a real 3-member etcd cluster (witnessed by a coord etcd),
//! two real arbiters, twelve worker processes and the PostgreSQL reference
//! fence; the self-tests showing
//! that the same gate fails an arbiter with a deliberate bug (grants on
//! watch events; a grant whose answer was lost taken as not held, with its
//! control run of the real protocol); and the two
//! fault mechanisms that are not plain signals (a stepped clock, a stalled
//! disk) checked on their own.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use latchkey_gate::clock::SteppableClock;
use latchkey_gate::record::mono_ns;
use latchkey_gate::{self as gate, Binaries, Fault, GateConfig};
use latchkey_tests::disk::StallableDir;
use latchkey_tests::faulty_log::TestFault;
use latchkey_tests::{workspace_bins, workspace_root};

/// This package's worker (cargo built it for these tests).
const WORKER: &str = env!("CARGO_BIN_EXE_gate-worker");

/// The gate's binaries. `arbiter-under-test` and the slow-disk faults'
/// `fsync-delay-fs` are `latchkey-tests`' binaries: built here the way
/// `cargo nextest run --workspace` built them (after it, nothing is compiled
/// again), once per test process.
fn binaries() -> anyhow::Result<Binaries> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let arbiter = BUILT.get_or_init(|| {
        build_harness_binaries().map_err(|e| format!("building the gate's binaries: {e:#}"))
    });
    match arbiter {
        Ok(arbiter) => Ok(Binaries {
            arbiter: arbiter.clone(),
            worker: PathBuf::from(WORKER),
        }),
        Err(e) => anyhow::bail!("{e}"),
    }
}

/// Builds `arbiter-under-test` and `fsync-delay-fs`; the arbiter's path.
fn build_harness_binaries() -> anyhow::Result<PathBuf> {
    let daemon = latchkey_tests::disk::DAEMON;
    let built =
        workspace_bins::build_as_tested(env!("CARGO_CRATE_NAME"), &["arbiter-under-test", daemon])?;
    let [arbiter, built_daemon] = &built[..] else {
        anyhow::bail!("cargo reported {built:?}");
    };
    // The slow-disk harness finds the daemon itself: beside this test's
    // directory, unless LATCHKEY_FSYNC_DELAY_FS names another.
    let found = latchkey_tests::disk::daemon_binary()?;
    anyhow::ensure!(
        found == *built_daemon || std::env::var_os("LATCHKEY_FSYNC_DELAY_FS").is_some(),
        "cargo built {} but the slow-disk harness would run {}",
        built_daemon.display(),
        found.display()
    );
    Ok(arbiter.clone())
}

fn seed() -> u64 {
    std::env::var("LATCHKEY_GATE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
}

/// Both elections of the electors were judged, with operations.
fn assert_elections_exercised(outcome: &gate::GateOutcome) {
    let elections: Vec<_> = outcome
        .report
        .keys
        .iter()
        .filter(|k| k.key.starts_with(&format!("{}/", gate::ELECTION_NAMESPACE)))
        .collect();
    assert!(
        elections.len() == 2 && elections.iter().all(|k| k.ops > 0),
        "the elections were not exercised: {elections:?}"
    );
}

fn out_dir() -> PathBuf {
    workspace_root().join("target/gate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_gate_every_fault_kind_history_checks_out() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let seed = seed();
    println!("gate seed {seed} (LATCHKEY_GATE_SEED={seed} to re-run)");
    let outcome = gate::run(GateConfig::short(seed, binaries()?, out_dir())).await?;
    println!("{outcome}");
    assert!(
        outcome.report.ok(),
        "the release gate found a violation (seed {seed}):\n{outcome}"
    );
    assert!(
        outcome.recovered_after.is_some(),
        "the history is safe but the service did not recover after the faults (seed {seed}):\n{outcome}"
    );
    // ADR-04: every unprotected grant (token 0) the open class's workers got
    // during the quorum loss is in an arbiter's spool.
    assert!(
        outcome.unspooled.is_empty(),
        "an unprotected grant is in no quorum-loss spool (seed {seed}):\n{outcome}"
    );
    // Durable waiters (ADR-14) met every fault too: their keys were
    // judged with the rest, and each was granted again after the faults.
    let durable: Vec<_> = outcome
        .report
        .keys
        .iter()
        .filter(|k| k.key.starts_with("bench/gate/durable/"))
        .collect();
    assert!(
        !durable.is_empty() && durable.iter().all(|k| k.ops > 0),
        "the durable class's keys were not exercised: {durable:?}"
    );
    // The coord tier (ADR-07, the tiers split) met every fault too: its
    // keys, on the coord cluster, were judged with the rest.
    let coord: Vec<_> = outcome
        .report
        .keys
        .iter()
        .filter(|k| k.key.starts_with(&format!("{}/", gate::COORD_NAMESPACE)))
        .collect();
    assert!(
        !coord.is_empty() && coord.iter().all(|k| k.ops > 0),
        "the coord tier's keys were not exercised: {coord:?}"
    );
    // Elections (issue 33) met every fault too: each election's
    // leaderships were judged as grants, with their terms.
    assert_elections_exercised(&outcome);
    // Shared holds and a semaphore (issue 34) met every fault too, judged
    // by the checker's rules for them: no writer beside a reader, no more
    // holders than permits, one per slot, and the token rule.
    assert!(
        outcome.modes.shared_grants > 0 && outcome.modes.shared_overlaps > 0,
        "no shared holds were granted, or none were held at once: {:?}",
        outcome.modes
    );
    // The readers read through the reference fence's guarded read, and
    // the checker judged those reads against the writes of their keys.
    assert!(
        outcome.modes.reads_accepted > 0,
        "no reader's guarded read was accepted: {:?}",
        outcome.modes
    );
    assert_eq!(
        outcome.modes.slots,
        (0..gate::SEMAPHORE_PERMITS).collect(),
        "the semaphore's slots were not all granted: {:?}",
        outcome.modes
    );
    // The fenced writes went through every adapter (issue 35), each judged
    // in its store's own commit order, and each store accepted some.
    for kind in ["postgresql", "mysql", "redis", "etcd", "s3"] {
        assert!(
            outcome.stores.get(kind).is_some_and(|w| w.accepted > 0),
            "no fenced write was accepted by the {kind} store: {:?}",
            outcome.stores
        );
    }
    for fault in Fault::ALL {
        assert!(
            // By the first word: "restore-forget ..." is not a "restore".
            outcome
                .faults
                .iter()
                .any(|f| f.split_whitespace().next() == Some(fault.name())),
            "fault {} was never injected: {:?}",
            fault.name(),
            outcome.faults
        );
    }
    // Throughput is printed above ("throughput: N ops checked ... ops/s"),
    // not asserted: a count reached in a fixed time is a timed assertion.
    // This floor only catches a workload that stopped working (on this
    // machine kind the run checks 14,000-24,000 operations).
    assert!(
        outcome.report.ops_checked >= 1_000,
        "too few checked operations to mean anything: {}",
        outcome.report.ops_checked
    );
    Ok(())
}

/// Issue 33: elections (and the coord tier's locks) through faults of the
/// coord cluster they live on: its etcd killed and restarted, and restored
/// from a snapshot with the coord tier's epoch advanced, beside arbiter
/// kills and paused leaders. One leader at a time, terms rising with
/// tokens across the advance, every stale write refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn election_gate_through_coord_cluster_faults_checks_out() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let seed = seed();
    println!("gate seed {seed}");
    let config = GateConfig {
        duration: Duration::from_secs(40),
        workers: 6,
        electors: 3,
        keys: 4,
        faults: vec![
            Fault::KillCoord,
            Fault::PauseCoordLeader,
            Fault::PartitionCoord,
            Fault::RestoreCoord,
            Fault::KillArbiter,
            Fault::PauseHolder,
        ],
        ..GateConfig::short(seed, binaries()?, out_dir())
    };
    let outcome = gate::run(config).await?;
    println!("{outcome}");
    assert!(
        outcome.report.ok(),
        "the election gate failed (seed {seed}):\n{outcome}"
    );
    assert!(
        outcome.recovered_after.is_some(),
        "some key or election was not granted again after the faults (seed {seed}):\n{outcome}"
    );
    for fault in Fault::COORD {
        assert!(
            outcome
                .faults
                .iter()
                .any(|f| f.split_whitespace().next() == Some(fault.name())),
            "{} was not injected: {:?}",
            fault.name(),
            outcome.faults
        );
    }
    assert_elections_exercised(&outcome);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_catches_an_arbiter_that_grants_on_watch_events() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let seed = seed();
    println!("gate seed {seed}");
    let config = GateConfig {
        duration: Duration::from_secs(25),
        workers: 6,
        electors: 0,
        keys: 1,
        arbiters: 2,
        faults: Vec::new(),
        arbiter_test_fault: TestFault::GrantOnWatch,
        fence_rotation: false,
        ..GateConfig::short(seed, binaries()?, out_dir())
    };
    let outcome = gate::run(config).await?;
    println!("{outcome}");
    assert!(
        !outcome.report.ok(),
        "the checker passed a history from an arbiter that grants without a transaction:\n{outcome}"
    );
    let text = outcome.report.to_string();
    assert!(
        text.contains("double grant") || text.contains("not linearizable"),
        "the report should name the double grant:\n{text}"
    );
    let saved = outcome
        .saved
        .as_ref()
        .expect("a failing run keeps its history");
    assert!(saved.join("history.jsonl").exists());
    assert!(saved.join("report.txt").exists());
    std::fs::remove_dir_all(saved)?;
    Ok(())
}

/// The gate for a single fault of the arbiter's lock log and no nemesis:
/// two arbiters, six workers contending on two keys.
fn lock_log_fault_config(fault: TestFault, seed: u64) -> anyhow::Result<GateConfig> {
    Ok(GateConfig {
        duration: Duration::from_secs(30),
        workers: 6,
        electors: 0,
        keys: 2,
        arbiters: 2,
        faults: Vec::new(),
        arbiter_test_fault: fault,
        fence_rotation: false,
        ..GateConfig::short(seed, binaries()?, out_dir())
    })
}

/// Acquires recorded `ok` after their answer was lost and the worker asked
/// again on the same session (see `gate::worker`).
fn revealed_grants(history: &latchkey_checker::History) -> Vec<String> {
    history
        .ops()
        .iter()
        .filter(|o| o.f == latchkey_checker::Function::Acquire && o.is_ok())
        .filter(|o| {
            o.completion
                .as_ref()
                .and_then(|c| c.detail.as_deref())
                .is_some_and(|d| d.starts_with("revealed"))
        })
        .map(|o| format!("{}#{}", o.process, o.op))
        .collect()
}

fn saved_history(saved: &std::path::Path) -> anyhow::Result<latchkey_checker::History> {
    let file = std::fs::File::open(saved.join("history.jsonl"))?;
    Ok(latchkey_checker::History::from_jsonl(
        std::io::BufReader::new(file),
    )?)
}

/// Issue 14: a grant whose answer was lost (a hidden grant) lives on its
/// session until the lease ends. An arbiter that takes such a grant as not
/// held (`--test-fault forget-hidden`) grants the key again while it lives.
/// The worker asks again on the same session after the lost answer, is told
/// "already yours" with the grant's token, records it and its expire at the
/// fence deadline, so the second grant is a double grant in the history.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_catches_an_arbiter_that_forgets_a_grant_whose_answer_was_lost() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let seed = seed();
    println!("gate seed {seed}");
    let outcome = gate::run(lock_log_fault_config(TestFault::ForgetHidden, seed)?).await?;
    println!("{outcome}");
    assert!(
        !outcome.report.ok(),
        "the checker passed a history from an arbiter that forgets hidden grants:\n{outcome}"
    );
    let saved = outcome
        .saved
        .as_ref()
        .expect("a failing run keeps its history");
    let history = saved_history(saved)?;
    let revealed = revealed_grants(&history);
    // The double grant is against a grant the history shows only because
    // the worker asked again.
    let against_revealed = outcome
        .report
        .violations_of(latchkey_checker::ViolationKind::DoubleGrant)
        .any(|v| {
            v.ops
                .iter()
                .any(|o| revealed.contains(&format!("{}#{}", o.process, o.op)))
        });
    assert!(
        against_revealed,
        "no double grant names a revealed grant ({revealed:?}):\n{outcome}"
    );
    std::fs::remove_dir_all(saved)?;
    Ok(())
}

/// The control for the test above: the same lost answers with the real
/// protocol (`--test-fault lose-grant-answers`, not a bug). Hidden grants
/// are revealed and recorded with their tokens and expires, and the history
/// checks out: nothing else is granted while they may live.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_passes_revealed_grants_of_lost_answers_with_the_real_protocol() -> anyhow::Result<()>
{
    latchkey_tests::init_tracing();
    let seed = seed();
    println!("gate seed {seed}");
    let config = GateConfig {
        keep: true,
        ..lock_log_fault_config(TestFault::LoseGrantAnswers, seed)?
    };
    let outcome = gate::run(config).await?;
    println!("{outcome}");
    let saved = outcome.saved.clone().expect("kept");
    assert!(
        outcome.report.ok(),
        "lost grant answers with the real protocol failed the gate (seed {seed}; kept in {}):\n{outcome}",
        saved.display()
    );
    let revealed = revealed_grants(&saved_history(&saved)?);
    println!("revealed grants: {}", revealed.len());
    assert!(
        !revealed.is_empty(),
        "no lost answer was revealed: the control shows nothing (kept in {})",
        saved.display()
    );
    std::fs::remove_dir_all(&saved)?;
    Ok(())
}

/// The self-test's bug is the tests' own: `cargo build --workspace` (the
/// build that once turned a `test-faults` feature on in the shipped arbiter)
/// gives a `latchkey-arbiter` that refuses `--test-fault` as an unknown flag,
/// while `arbiter-under-test` takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_arbiter_has_no_test_faults() -> anyhow::Result<()> {
    let shipped = tokio::task::spawn_blocking(|| {
        workspace_bins::build_as_shipped(&["latchkey-arbiter"])?
            .pop()
            .ok_or_else(|| anyhow::anyhow!("cargo reported no latchkey-arbiter"))
    })
    .await??;
    let out = tokio::process::Command::new(&shipped)
        .args(["--test-fault", "grant-on-watch"])
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{} took --test-fault: {stderr}",
        shipped.display()
    );
    assert!(
        stderr.contains("unexpected argument '--test-fault'"),
        "{stderr}"
    );

    let out = tokio::process::Command::new(binaries()?.arbiter)
        .args(["--test-fault", "grant-on-wach"])
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unknown test fault"), "{stderr}");
    Ok(())
}

/// The clock-step fault's environment moves a running worker's wall clock
/// when the control file changes, and leaves its monotonic clock (tokio's
/// `Instant`, the history's clock) alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_step_moves_a_running_workers_wall_clock_only() -> anyhow::Result<()> {
    const STEP_S: i64 = 3600;
    let dir = tempfile::tempdir()?;
    let clock = SteppableClock::new(&dir.path().join("clock"))?;
    let started = mono_ns();
    let mut probe = tokio::process::Command::new(WORKER)
        .arg("clock-probe")
        .envs(clock.env())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    // Step the clock once the probe has taken its first sample (it takes 20,
    // 200 ms apart, and re-reads the control file at least once a second).
    let stdout = probe
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("the probe's stdout is not piped"))?;
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let mut printed = Vec::new();
    let first = lines
        .next_line()
        .await?
        .ok_or_else(|| anyhow::anyhow!("the probe printed nothing"))?;
    printed.push(first);
    clock.set(STEP_S)?;
    while let Some(line) = lines.next_line().await? {
        printed.push(line);
    }
    let status = probe.wait().await?;
    let finished = mono_ns();
    assert!(status.success());
    let samples: Vec<(i128, u64)> = printed
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)?;
            let wall = i128::from(v["wall_ns"].as_u64().unwrap_or(0));
            Ok((wall, v["instant_mono_ns"].as_u64().unwrap_or(0)))
        })
        .collect::<anyhow::Result<_>>()?;
    assert_eq!(samples.len(), 20, "{samples:?}");
    let offset_s = |wall: i128, mono: u64| -> f64 {
        // The probe's wall clock against ours at the same monotonic moment.
        let ours_now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let ours_then = ours_now - i128::from(mono_ns().saturating_sub(mono));
        (wall - ours_then) as f64 / 1e9
    };
    let (first_wall, first_mono) = samples[0];
    let (last_wall, last_mono) = samples[samples.len() - 1];
    assert!(
        offset_s(first_wall, first_mono).abs() < 1.0,
        "before the step the wall clock is the real one: {samples:?}"
    );
    assert!(
        (offset_s(last_wall, last_mono) - STEP_S as f64).abs() < 1.0,
        "after the step a running worker's wall clock is {STEP_S} s ahead: {samples:?}"
    );
    for (_, mono) in &samples {
        assert!(
            (started..=finished).contains(mono),
            "the monotonic clock (tokio's Instant, the history's clock) never moves: {samples:?}"
        );
    }
    Ok(())
}

/// The slow-disk faults' mechanism (`fsync-delay-fs`): with a delay set,
/// an fsync, an fdatasync and a directory's fsync on the mount each take at
/// least the delay, while a write does not, and another thread's writes and
/// reads go on while an fsync is held back. Everything reaches the backing
/// dir.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_disk_delays_fsync_but_not_writes() -> anyhow::Result<()> {
    use std::io::{Read, Write};
    use std::time::Instant;
    const DELAY: Duration = Duration::from_millis(400);
    const RECORD: &[u8] = &[b'r'; 4096];
    binaries()?; // builds fsync-delay-fs, which the mount runs
    let dir = tempfile::tempdir()?;
    let disk = StallableDir::mount(&dir.path().join("backing"), &dir.path().join("mnt"))?;
    let mnt = disk.path().to_path_buf();
    let wal = mnt.join("wal");
    let open = {
        let wal = wal.clone();
        move || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&wal)
        }
    };
    // (write, fsync, fdatasync, directory fsync) of one record.
    let timed_record = {
        let open = open.clone();
        let mnt = mnt.clone();
        move || -> anyhow::Result<[Duration; 4]> {
            let mut f = open()?;
            let t = Instant::now();
            f.write_all(RECORD)?;
            let write = t.elapsed();
            let t = Instant::now();
            f.sync_all()?;
            let fsync = t.elapsed();
            let t = Instant::now();
            f.sync_data()?;
            let fdatasync = t.elapsed();
            let d = std::fs::File::open(&mnt)?;
            let t = Instant::now();
            d.sync_all()?;
            Ok([write, fsync, fdatasync, t.elapsed()])
        }
    };
    let fast = tokio::task::spawn_blocking(timed_record.clone()).await??;
    disk.set_fsync_delay(DELAY)?;
    let slow = tokio::task::spawn_blocking(timed_record.clone()).await??;
    let [write, fsync, fdatasync, dir_fsync] = slow;
    println!(
        "delay {DELAY:?}: without it {fast:?}; with it write {write:?}, fsync {fsync:?}, fdatasync {fdatasync:?}, directory fsync {dir_fsync:?}"
    );
    for (what, took) in [
        ("fsync", fsync),
        ("fdatasync", fdatasync),
        ("directory fsync", dir_fsync),
    ] {
        assert!(took >= DELAY, "{what} took {took:?} with a {DELAY:?} delay");
    }
    assert!(
        write < fdatasync / 2 && write < DELAY / 2,
        "a write took {write:?}, not much less than a delayed fdatasync ({fdatasync:?})"
    );
    assert!(
        fast[2] < fdatasync / 2,
        "an fdatasync took {:?} without the delay and {fdatasync:?} with it",
        fast[2]
    );

    // An fsync held back does not hold back another thread's write and read.
    let delayed_before = disk.fsyncs_delayed();
    let synced = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let syncing = tokio::task::spawn_blocking({
        let open = open.clone();
        let synced = std::sync::Arc::clone(&synced);
        move || -> anyhow::Result<Duration> {
            let f = open()?;
            let t = Instant::now();
            f.sync_data()?;
            synced.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok(t.elapsed())
        }
    });
    latchkey_tests::eventually(
        "the fsync to reach the daemon",
        Duration::from_secs(5),
        || async {
            anyhow::ensure!(disk.fsyncs_delayed() > delayed_before, "not yet");
            Ok(())
        },
    )
    .await?;
    let (side_write, side_read) = tokio::task::spawn_blocking({
        let mnt = mnt.clone();
        move || -> anyhow::Result<(Duration, Duration)> {
            let t = Instant::now();
            std::fs::write(mnt.join("side"), RECORD)?;
            let write = t.elapsed();
            let t = Instant::now();
            let mut back = Vec::new();
            std::fs::File::open(mnt.join("wal"))?.read_to_end(&mut back)?;
            anyhow::ensure!(back.len() == 2 * RECORD.len(), "read {} bytes", back.len());
            Ok((write, t.elapsed()))
        }
    })
    .await??;
    let still_syncing = !synced.load(std::sync::atomic::Ordering::SeqCst);
    let held = syncing.await??;
    println!("while an fsync was held back ({held:?}): write {side_write:?}, read {side_read:?}");
    assert!(
        still_syncing,
        "a write ({side_write:?}) and a read ({side_read:?}) waited for an fsync held back {held:?}"
    );
    assert!(held >= DELAY, "the held-back fsync took {held:?}");

    disk.set_fsync_delay(Duration::ZERO)?;
    assert_eq!(
        std::fs::read(dir.path().join("backing/wal"))?.len(),
        2 * RECORD.len()
    );
    assert_eq!(std::fs::read(dir.path().join("backing/side"))?, RECORD);
    Ok(())
}

/// The mount of the slow-disk faults does not outlive the process that made
/// it: SIGKILL the owner and the daemon unmounts; SIGKILL the daemon too
/// (first, so it cannot) and the next run's sweep unmounts what is left,
/// and leaves a live mount alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_disk_mount_goes_away_with_its_owner() -> anyhow::Result<()> {
    use latchkey_tests::disk::{daemon_binary, is_mounted, remove_stale_mounts};
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    binaries()?; // builds fsync-delay-fs
    let dir = tempfile::tempdir()?;
    let daemon = daemon_binary()?;
    // An owner other than this test process: a shell that starts the daemon
    // and waits for it.
    let start_owner = |name: &str| -> anyhow::Result<(std::process::Child, PathBuf)> {
        let backing = dir.path().join(format!("{name}.disk"));
        let mnt = dir.path().join(name);
        std::fs::create_dir_all(&backing)?;
        std::fs::create_dir_all(&mnt)?;
        let owner = std::process::Command::new("bash")
            .arg("-c")
            .arg(r#""$0" --backing "$1" --mountpoint "$2" --delay-file "$3" & wait"#)
            .arg(&daemon)
            .arg(&backing)
            .arg(&mnt)
            .arg(dir.path().join(format!("{name}.delay")))
            .spawn()?;
        Ok((owner, mnt))
    };
    let mounted = |mnt: PathBuf| async move {
        latchkey_tests::eventually("the owner's mount", Duration::from_secs(10), || async {
            anyhow::ensure!(is_mounted(&mnt)?, "not mounted yet");
            Ok(())
        })
        .await
    };

    let (mut owner, mnt) = start_owner("owned")?;
    mounted(mnt.clone()).await?;
    owner.kill()?;
    owner.wait()?;
    latchkey_tests::eventually(
        "the mount to go with its owner",
        Duration::from_secs(10),
        || async {
            anyhow::ensure!(!is_mounted(&mnt)?, "still mounted");
            Ok(())
        },
    )
    .await?;

    // A live mount (made first: a process's first mount runs the sweep too).
    let live = StallableDir::mount(&dir.path().join("live.disk"), &dir.path().join("live"))?;
    let (mut owner, mnt) = start_owner("stale")?;
    mounted(mnt.clone()).await?;
    let daemon_pid = mount_daemon_pid(&mnt)?;
    kill(Pid::from_raw(i32::try_from(daemon_pid)?), Signal::SIGKILL)?;
    owner.kill()?;
    owner.wait()?;
    assert!(
        is_mounted(&mnt)?,
        "a mount whose daemon was SIGKILLed stays"
    );
    let removed = remove_stale_mounts();
    println!("the sweep unmounted {removed:?}");
    assert!(
        removed.contains(&mnt.display().to_string()),
        "the sweep left {} mounted: {removed:?}",
        mnt.display()
    );
    assert!(!is_mounted(&mnt)?);
    assert!(is_mounted(live.path())?, "the sweep unmounted a live mount");
    Ok(())
}

/// The daemon pid in the source of the `fsync-delay-fs` mount on `mnt`.
fn mount_daemon_pid(mnt: &std::path::Path) -> anyhow::Result<u32> {
    let wanted = mnt.canonicalize()?.display().to_string();
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    info.lines()
        .find_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            if fields.get(4) != Some(&wanted.as_str()) {
                return None;
            }
            let dash = fields.iter().position(|f| *f == "-")?;
            let source = fields.get(dash + 2)?;
            source
                .strip_prefix("latchkey-fsync-delay:")?
                .split(':')
                .next()?
                .parse()
                .ok()
        })
        .ok_or_else(|| anyhow::anyhow!("no fsync-delay-fs mount on {wanted}"))
}

/// The clock-step-arbiter fault's environment moves a running arbiter's
/// wall clock (the grant time it records and reports) when the control file
/// changes, forward and back, and leaves its monotonic clock alone: a wait
/// it times on tokio's clock runs its full length across a step of an hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_step_moves_an_arbiters_wall_clock_only() -> anyhow::Result<()> {
    use latchkey_proto::lockv1::InspectRequest;
    use latchkey_proto::lockv1::lock_client::LockClient;
    use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, channel};
    use latchkey_tests::etcd::EtcdServer;
    const STEP_S: i64 = 3600;
    const WAIT: Duration = Duration::from_secs(4);
    latchkey_tests::init_tracing();
    let dir = tempfile::tempdir()?;
    let clock = SteppableClock::new(&dir.path().join("clock"))?;
    let etcd = EtcdServer::start().await?;
    let arbiter = ArbiterProcess::start_with_env(
        &binaries()?.arbiter,
        &[etcd.endpoint()],
        None,
        ArbiterOptions::default(),
        "info",
        &[],
        &clock.env(),
    )
    .await?;
    let mut alice = LockClient::new(channel(arbiter.addr(), "workload/alice").await?);
    let mut bob = LockClient::new(channel(arbiter.addr(), "workload/bob").await?);
    let alice_session = latchkey_tests::lock_calls::open(&mut alice, "demo").await?;
    let bob_session = latchkey_tests::lock_calls::open(&mut bob, "demo").await?;
    // The arbiter's wall clock against ours, in seconds, from the grant time
    // it records for a fresh key (ours read right after the answer).
    let mut n = 0;
    let mut offset_s = || {
        n += 1;
        let key = format!("demo/clock-step-{n}");
        let mut alice = alice.clone();
        async move {
            latchkey_tests::lock_calls::try_lock(&mut alice, &key, "demo", alice_session).await?;
            let holder = alice
                .inspect(InspectRequest { key: key.clone() })
                .await?
                .into_inner()
                .holder
                .ok_or_else(|| anyhow::anyhow!("{key} has no holder"))?;
            let ours_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_millis() as i64;
            anyhow::Ok((holder.acquired_at_unix_ms - ours_ms) as f64 / 1e3)
        }
    };
    let before = offset_s().await?;
    assert!(
        before.abs() < 60.0,
        "before the step the arbiter's wall clock is the real one: {before} s off"
    );

    // Bob waits for alice's first key; the step comes during his wait.
    let waited = tokio::spawn({
        let mut bob = bob.clone();
        async move {
            let t = std::time::Instant::now();
            let r = latchkey_tests::lock_calls::wait_lock(
                &mut bob,
                "demo/clock-step-1",
                "demo",
                bob_session,
                WAIT,
            )
            .await;
            (r, t.elapsed())
        }
    });
    // The step must come during his wait: once the arbiter has him queued.
    latchkey_tests::eventually("bob to be queued", Duration::from_secs(10), || {
        let mut alice = alice.clone();
        async move {
            let waiters = alice
                .inspect(InspectRequest {
                    key: "demo/clock-step-1".into(),
                })
                .await?
                .into_inner()
                .waiters;
            anyhow::ensure!(waiters == 1, "{waiters} waiters");
            Ok(())
        }
    })
    .await?;
    clock.set(STEP_S)?;
    let ahead = latchkey_tests::eventually(
        "the arbiter's clock to step forward",
        Duration::from_secs(10),
        || {
            let f = offset_s();
            async move {
                let off = f.await?;
                anyhow::ensure!((off - STEP_S as f64).abs() < 60.0, "{off} s off");
                Ok(off)
            }
        },
    )
    .await?;
    let (bob_got, bob_waited) = waited.await?;
    println!(
        "arbiter's wall clock: {before:.1} s off, then {ahead:.1} s; bob waited {bob_waited:?} of {WAIT:?} across the step ({:?})",
        bob_got.as_ref().map(|_| ()).map_err(|s| s.code())
    );
    assert!(
        bob_got.is_err(),
        "alice's key was granted to bob while she held it"
    );
    // The arbiter answers up to WAIT/20 early, so the caller hears its
    // WAIT_TIMEOUT; a stepped monotonic clock would end the wait about a
    // second after the step.
    assert!(
        bob_waited >= WAIT - WAIT / 20,
        "a {WAIT:?} wait ended after {bob_waited:?}: the arbiter's monotonic clock stepped with its wall clock"
    );

    clock.set(-STEP_S)?;
    let behind = latchkey_tests::eventually(
        "the arbiter's clock to step back",
        Duration::from_secs(10),
        || {
            let f = offset_s();
            async move {
                let off = f.await?;
                anyhow::ensure!((off + STEP_S as f64).abs() < 60.0, "{off} s off");
                Ok(off)
            }
        },
    )
    .await?;
    println!("then {behind:.1} s");
    clock.set(0)?;
    drop(bob);
    drop(arbiter);
    Ok(())
}
