//! One release-gate workload process (see `latchkey_gate::worker`).
//! Started by the gate, never by hand.
//!
//! `gate-worker clock-probe` prints this process's clocks every 200 ms for
//! 4 s, as JSON lines (wall clock in Unix nanoseconds, tokio's
//! `Instant::now()` on the shared monotonic clock): the gate's tests run it
//! under the clock-step fault's libfaketime environment and step its
//! control file meanwhile, to see which clocks a step moves and that a
//! running process follows the file.

use clap::Parser;
use latchkey_gate::worker::{self, WorkerArgs};

#[derive(Parser)]
#[command(about = "Latchkey release gate: one workload process")]
struct Args {
    #[command(flatten)]
    worker: WorkerArgs,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if std::env::args().nth(1).as_deref() == Some("clock-probe") {
        clock_probe().await;
        return;
    }
    let args = Args::parse();
    let code = match worker::run(args.worker).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gate-worker: {e:#}");
            2
        }
    };
    std::process::exit(code);
}

async fn clock_probe() {
    for _ in 0..20 {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let instant = latchkey_gate::record::mono_of(tokio::time::Instant::now().into_std());
        println!("{{\"wall_ns\":{wall},\"instant_mono_ns\":{instant}}}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
