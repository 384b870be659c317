//! The audit tailer, built inside this crate so the e2e tests can find it
//! through `CARGO_BIN_EXE_audit-under-test` (and kill it mid-stream): the
//! same code as `latchkey-audit`.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    match latchkey_audit::cli::main_with(std::env::args_os().collect()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("audit-under-test: {e:#}");
            ExitCode::FAILURE
        }
    }
}
