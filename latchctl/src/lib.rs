//! latchctl: Latchkey locks from the shell, dev certificates and the
//! pause-test kit.
//!
//! The `latchctl` binary is a thin wrapper around [`cli::main`]; the tests
//! crate builds the same code as `latchctl-under-test` and uses
//! [`dev_certs`] for its harnesses' certificates. A service that only takes
//! locks links `latchkey-client`, not this crate.

pub mod cli;
pub mod dev_certs;
