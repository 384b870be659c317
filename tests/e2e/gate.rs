//! The release gate (ADR-23) as CI runs it: a short seeded run with every
//! fault kind on a real 3-member etcd cluster (witnessed by a coord etcd),
//! two real arbiters, twelve worker processes and the PostgreSQL reference
//! fence; the self-test showing
//! that the same gate fails an arbiter with a deliberate bug; and the two
//! fault mechanisms that are not plain signals (a stepped clock, a stalled
//! disk) checked on their own.

use std::path::PathBuf;
use std::time::Duration;

use latchkey_tests::faulty_log::TestFault;
use latchkey_tests::gate::clock::SteppableClock;
use latchkey_tests::gate::disk::StallableDir;
use latchkey_tests::gate::record::mono_ns;
use latchkey_tests::gate::{self, Binaries, Fault, GateConfig};
use latchkey_tests::workspace_root;

fn binaries() -> Binaries {
    Binaries {
        arbiter: PathBuf::from(env!("CARGO_BIN_EXE_arbiter-under-test")),
        worker: PathBuf::from(env!("CARGO_BIN_EXE_gate-worker")),
    }
}

fn seed() -> u64 {
    std::env::var("LATCHKEY_GATE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..))
}

fn out_dir() -> PathBuf {
    workspace_root().join("target/gate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_gate_every_fault_kind_history_checks_out() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let seed = seed();
    println!("gate seed {seed} (LATCHKEY_GATE_SEED={seed} to re-run)");
    let outcome = gate::run(GateConfig::short(seed, binaries(), out_dir())).await?;
    println!("{outcome}");
    assert!(
        outcome.report.ok(),
        "the release gate found a violation (seed {seed}):\n{outcome}"
    );
    assert!(
        outcome.recovered_after.is_some(),
        "the history is safe but the service did not recover after the faults (seed {seed}):\n{outcome}"
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gate_catches_an_arbiter_that_grants_on_watch_events() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let seed = seed();
    println!("gate seed {seed}");
    let config = GateConfig {
        duration: Duration::from_secs(25),
        workers: 6,
        keys: 1,
        arbiters: 2,
        faults: Vec::new(),
        arbiter_test_fault: TestFault::GrantOnWatch,
        ..GateConfig::short(seed, binaries(), out_dir())
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

/// The self-test's bug is the tests' own: `cargo build --workspace` (the
/// build that once turned a `test-faults` feature on in the shipped arbiter)
/// gives a `latchkey-arbiter` that refuses `--test-fault` as an unknown flag,
/// while `arbiter-under-test` takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_arbiter_has_no_test_faults() -> anyhow::Result<()> {
    let shipped = build_shipped_arbiter().await?;
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

    let out = tokio::process::Command::new(binaries().arbiter)
        .args(["--test-fault", "grant-on-wach"])
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unknown test fault"), "{stderr}");
    Ok(())
}

/// Builds `latchkey-arbiter` as `cargo build --workspace` does (features
/// unified over every workspace member, the tests crate included) in this
/// test's profile, and returns the executable cargo reports.
async fn build_shipped_arbiter() -> anyhow::Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = tokio::process::Command::new(cargo);
    // Without what cargo set for this test process: build scripts that
    // watch these (ring's does) would otherwise rebuild for every build in
    // and out of this test.
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_for_a_crate) {
            cmd.env_remove(name);
        }
    }
    cmd.current_dir(workspace_root())
        .args([
            "build",
            "--workspace",
            "--bin",
            "latchkey-arbiter",
            "--message-format=json-render-diagnostics",
        ])
        .stdin(std::process::Stdio::null());
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let out = cmd.output().await?;
    anyhow::ensure!(
        out.status.success(),
        "cargo build --workspace --bin latchkey-arbiter failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let executable = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == "latchkey-arbiter")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from));
    executable.ok_or_else(|| anyhow::anyhow!("cargo reported no latchkey-arbiter executable"))
}

/// The variables cargo sets for a crate it runs (a test, a build script),
/// as opposed to ones that configure cargo (`CARGO_HOME`, `CARGO_TARGET_DIR`).
fn set_by_cargo_for_a_crate(name: &str) -> bool {
    const PREFIXES: [&str; 3] = ["CARGO_PKG_", "CARGO_BIN_", "CARGO_CFG_"];
    const NAMES: [&str; 8] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p)) || NAMES.contains(&name)
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
    let mut probe = tokio::process::Command::new(binaries().worker)
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

/// The slow-disk faults' mechanism: while the FUSE passthrough's daemon is
/// stalled, an fsync on the mount waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_disk_delays_fsync() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let disk = StallableDir::mount(&dir.path().join("backing"), &dir.path().join("mnt"))?;
    let file = disk.path().join("wal");
    let write_and_sync = move || -> anyhow::Result<Duration> {
        use std::io::Write;
        let started = std::time::Instant::now();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&file)?;
        f.write_all(b"record\n")?;
        f.sync_data()?;
        Ok(started.elapsed())
    };
    let normal = tokio::task::spawn_blocking(write_and_sync.clone()).await??;
    assert!(normal < Duration::from_millis(300), "{normal:?}");
    // The disk stops before the write starts (no sleep to order them), and
    // stays stopped for the stall's 800 ms.
    disk.stop()?;
    let synced = tokio::task::spawn_blocking(write_and_sync);
    tokio::time::sleep(Duration::from_millis(800)).await;
    disk.resume()?;
    let slow = synced.await??;
    assert!(
        slow >= Duration::from_millis(500),
        "an fsync during an 800 ms stall took only {slow:?}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("backing/wal"))?,
        "record\nrecord\n"
    );
    Ok(())
}
