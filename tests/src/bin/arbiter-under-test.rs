//! The arbiter binary, built inside this crate so the e2e tests can find it
//! through `CARGO_BIN_EXE_arbiter-under-test` (same code as `latchkey-arbiter`).

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    latchkey_arbiter::cli::main().await
}
