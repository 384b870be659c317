//! `latchctl`: see `latchctl::cli` for the commands.

#[tokio::main]
async fn main() -> std::process::ExitCode {
    latchctl::cli::main().await
}
