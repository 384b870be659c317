//! The arbiter binary, built inside this crate so the e2e tests can find it
//! through `CARGO_BIN_EXE_arbiter-under-test`: the same code as
//! `latchkey-arbiter`, plus one flag the shipped binary does not have,
//! `--test-fault <name>` (`grant-on-watch`, `slow-reuse`; also
//! `--test-fault=<name>`), which puts one of the tests' deliberate bugs
//! around the lock log ([`latchkey_tests::faulty_log`]).

use std::process::ExitCode;

use latchkey_tests::faulty_log;

/// The shipped binary's allocator, so memory is measured as it ships.
#[global_allocator]
static ALLOCATOR: latchkey_arbiter::Allocator = latchkey_arbiter::Allocator;

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let (fault, argv) = match faulty_log::split_test_fault_arg(std::env::args_os().collect()) {
        Ok(split) => split,
        Err(e) => {
            eprintln!("arbiter-under-test: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    latchkey_arbiter::cli::main_with(argv, faulty_log::layer(fault)).await?;
    Ok(ExitCode::SUCCESS)
}
