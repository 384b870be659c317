//! `latchkey-arbiter`: see `latchkey_arbiter::cli` for the flags.

#[global_allocator]
static ALLOCATOR: latchkey_arbiter::Allocator = latchkey_arbiter::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    latchkey_arbiter::cli::main().await
}
