//! `latchctl`: see `latchkey_client::cli` for the commands.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    latchkey_client::cli::main().await
}
