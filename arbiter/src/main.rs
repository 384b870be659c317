//! `latchkey-arbiter`: see `latchkey_arbiter::cli` for the flags.

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    latchkey_arbiter::cli::main().await
}
