//! The release gate (ADR-23) as CI runs it: a short seeded run with every
//! fault kind on a real 3-member etcd cluster, two real arbiters, six worker
//! processes and the PostgreSQL reference fence; and the self-test showing
//! that the same gate fails an arbiter with a deliberate bug.

use std::path::PathBuf;
use std::time::Duration;

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
            outcome.faults.iter().any(|f| f.starts_with(fault.name())),
            "fault {} was never injected: {:?}",
            fault.name(),
            outcome.faults
        );
    }
    assert!(
        outcome.operations >= 2000,
        "too few operations to mean anything: {}",
        outcome.operations
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
        arbiter_test_fault: Some("grant-on-watch".into()),
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
