//! One release-gate workload process (see `latchkey_tests::gate::worker`).
//! Started by the gate, never by hand.

use clap::Parser;
use latchkey_tests::gate::worker::{self, WorkerArgs};

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
