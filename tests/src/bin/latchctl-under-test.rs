//! latchctl, built inside this crate so the e2e tests can find it through
//! `CARGO_BIN_EXE_latchctl-under-test` (same code as `latchctl`).

#[tokio::main]
async fn main() -> std::process::ExitCode {
    latchctl::cli::main().await
}
