use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    match latchkey_audit::cli::main_with(std::env::args_os().collect()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("latchkey-audit: {e:#}");
            ExitCode::FAILURE
        }
    }
}
