//! Clock steps for the nemesis: a worker's or an arbiter's wall clock
//! stepped forward and back with libfaketime, through a control file it
//! re-reads.
//!
//! Every gate worker (with the clock-step fault) and every arbiter (with
//! clock-step-arbiter) runs with `LD_PRELOAD=libfaketime.so.1` and
//! `FAKETIME_TIMESTAMP_FILE` naming its own control file (one per worker or
//! arbiter slot, so later incarnations and restarts keep the stepped clock,
//! as a process on that machine would). The file holds an offset in
//! seconds (`+0`, `+3600`, `-900`); libfaketime re-reads it at most every
//! second (`FAKETIME_CACHE_DURATION=1`).
//!
//! Only `CLOCK_REALTIME` (`SystemTime`) moves: `FAKETIME_DONT_FAKE_MONOTONIC=1`.
//! That is what steps on a real machine (NTP, an operator's `date -s`, a VM
//! migration); Linux never steps `CLOCK_MONOTONIC`, and the client library
//! times leases and the fence deadline on it (ADR-12) precisely so that a
//! wall-clock step cannot stretch a hold; the arbiter likewise times
//! sessions, waits and deadlines on it. libfaketime can move tokio's and
//! std's `Instant` too (checked: without that flag `Instant::now()` in a
//! worker jumps with the file), but a monotonic clock that runs backwards
//! breaks an assumption of the promise rather than the implementation, and
//! it would also move the `expire` times the worker records, which must be
//! on the one machine-wide clock.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// Where Debian's `libfaketime` puts the preload library (scripts/setup
/// installs it); `LATCHKEY_LIBFAKETIME` overrides.
const LIBFAKETIME: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
];

/// The preload library, if this machine has it.
pub fn libfaketime() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LATCHKEY_LIBFAKETIME") {
        return Some(PathBuf::from(p));
    }
    LIBFAKETIME.iter().map(PathBuf::from).find(|p| p.exists())
}

/// One worker slot's clock.
#[derive(Debug, Clone)]
pub struct SteppableClock {
    control: PathBuf,
    library: PathBuf,
}

impl SteppableClock {
    /// A clock at offset zero, controlled by `control`.
    pub fn new(control: &Path) -> anyhow::Result<Self> {
        let library = libfaketime().context(
            "libfaketime not found (the clock-step fault needs it; scripts/setup installs \
             Debian's libfaketime)",
        )?;
        let clock = Self {
            control: control.to_path_buf(),
            library,
        };
        clock.set(0)?;
        Ok(clock)
    }

    /// The environment a process needs for this clock.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LD_PRELOAD", self.library.display().to_string()),
            (
                "FAKETIME_TIMESTAMP_FILE",
                self.control.display().to_string(),
            ),
            ("FAKETIME_CACHE_DURATION", "1".to_owned()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
        ]
    }

    /// Steps the wall clock to `offset_s` seconds from the real time. The
    /// file is replaced atomically, so libfaketime never reads half of it.
    pub fn set(&self, offset_s: i64) -> anyhow::Result<()> {
        let tmp = self.control.with_extension("tmp");
        std::fs::write(&tmp, format!("{offset_s:+}\n"))?;
        std::fs::rename(&tmp, &self.control)?;
        Ok(())
    }
}
