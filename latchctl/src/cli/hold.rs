//! `latchctl hold`: run a command under a lock, like `flock` or
//! `etcdctl lock`. The command gets the token in its environment; the
//! human output never shows it.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use clap::Args;
use latchkey_client::{Client, FenceReason};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tokio::process::{Child, Command};
use tokio::signal::unix::{SignalKind, signal};

use super::acquire::grant;
use super::{Failure, Output, duration, parse_meta};

/// How long a command gets between SIGTERM and SIGKILL once the lock is lost.
const KILL_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, Args)]
pub struct HoldArgs {
    pub key: String,
    #[arg(long)]
    pub class: String,
    /// Queue for up to this long instead of failing at once when held.
    #[arg(long, value_parser = duration::parse, value_name = "DURATION")]
    pub wait: Option<Duration>,
    #[arg(long = "meta", value_name = "K=V", value_parser = parse_meta)]
    pub meta: Vec<(String, String)>,
    /// Hold it shared (beside other shared holders, never beside an
    /// exclusive one): the command only reads what the lock guards.
    #[arg(long)]
    pub shared: bool,
    /// Hold one of a semaphore's N permits, and check it has N: refused
    /// (the permit released before the command runs) unless the class is
    /// a semaphore whose `permits` are N. The command gets
    /// `LATCHKEY_PERMITS` (and `LATCHKEY_SLOT`) either way for a semaphore.
    #[arg(long, value_name = "N", conflicts_with = "shared")]
    pub permits: Option<u32>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, num_args = 1.., value_name = "COMMAND")]
    pub command: Vec<String>,
}

pub async fn hold(client: Client, args: HoldArgs, out: Output) -> Result<ExitCode, Failure> {
    let Some((program, program_args)) = args.command.split_first() else {
        return Err(Failure::Usage("hold needs a command after --".into()));
    };
    let (session, guard, mut fenced) = grant(
        &client,
        &args.key,
        &args.class,
        args.wait,
        &args.meta,
        args.shared,
    )
    .await?;
    if let Some(expected) = args.permits {
        let has = guard.permits();
        if has != Some(expected) {
            let what = match has {
                Some(n) => format!("a semaphore of {n} permits"),
                None if guard.slot().is_some() => {
                    "a semaphore whose arbiter does not say its permits".to_string()
                }
                None => "a lock, not a semaphore".to_string(),
            };
            let key = guard.key().to_string();
            guard.release().await?;
            return Err(Failure::Other(anyhow::anyhow!(
                "--permits {expected}: class {:?} makes {key:?} {what}; released it without running the command (fix --permits, or the class in the policies)",
                args.class
            )));
        }
    }
    // stdout belongs to the command: our messages go to stderr.
    let slot = match (guard.slot(), guard.is_shared()) {
        (Some(s), _) => format!(", slot {s}"),
        (None, true) => ", shared".to_string(),
        (None, false) => String::new(),
    };
    out.note(
        json!({ "event": "acquired", "key": guard.key(), "epoch": guard.epoch(), "session_id": guard.session_id(), "slot": guard.slot(), "permits": guard.permits() }),
        format_args!(
            "latchctl: holding {}{slot} (epoch {}, session {}); running {program}",
            guard.key(),
            guard.epoch(),
            guard.session_id()
        ),
    );

    let mut command = Command::new(program);
    command.env(
        "LATCHKEY_MODE",
        if guard.is_shared() {
            "shared"
        } else {
            "exclusive"
        },
    );
    if let Some(slot) = guard.slot() {
        // A semaphore's grant: the command partitions its work by slot,
        // and fences each slot's resource with that slot's token.
        command.env("LATCHKEY_SLOT", slot.to_string());
    }
    if let Some(permits) = guard.permits() {
        command.env("LATCHKEY_PERMITS", permits.to_string());
    }
    let mut child = command
        .args(program_args)
        .env("LATCHKEY_TOKEN", guard.token().get().to_string())
        .env("LATCHKEY_KEY", guard.key())
        .env("LATCHKEY_EPOCH", guard.epoch().to_string())
        .env("LATCHKEY_SESSION", guard.session_id().to_string())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Failure::Other(anyhow::anyhow!("cannot run {program}: {e}")))?;

    let mut interrupt = signal(SignalKind::interrupt()).map_err(anyhow::Error::from)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(anyhow::Error::from)?;
    let outcome = loop {
        tokio::select! {
            status = child.wait() => break Ok(status.map_err(anyhow::Error::from)?),
            reason = fenced.recv() => break Err(reason.unwrap_or(FenceReason::Expired)),
            // The command decides how to stop; we release when it has.
            _ = interrupt.recv() => forward(&child, Signal::SIGINT),
            _ = terminate.recv() => forward(&child, Signal::SIGTERM),
        }
    };

    match outcome {
        Ok(status) => {
            let key = guard.key().to_owned();
            if let Err(e) = guard.release().await {
                out.note(
                    json!({ "event": "release_failed", "key": key, "error": e.to_string() }),
                    format_args!(
                        "latchctl: release of {key} failed ({e}); it ends with the session"
                    ),
                );
            }
            let _ = session.close().await;
            out.note(
                json!({ "event": "released", "key": key, "status": exit_code(status) }),
                format_args!("latchctl: released {key}"),
            );
            Ok(ExitCode::from(exit_code(status)))
        }
        Err(reason) => {
            out.note(
                json!({ "event": "fenced", "key": guard.key(), "reason": reason.to_string() }),
                format_args!(
                    "latchctl: lock on {} lost ({reason}); stopping {program}",
                    guard.key()
                ),
            );
            stop(&mut child).await;
            Err(Failure::Lost(format!(
                "lock on {} lost: {reason}; {program} was stopped",
                guard.key()
            )))
        }
    }
}

pub(super) fn forward(child: &Child, signal: Signal) {
    if let Some(pid) = child.id().and_then(|id| i32::try_from(id).ok()) {
        let _ = kill(Pid::from_raw(pid), signal);
    }
}

/// SIGTERM, then SIGKILL after the grace period.
pub(super) async fn stop(child: &mut Child) {
    forward(child, Signal::SIGTERM);
    if tokio::time::timeout(KILL_GRACE, child.wait())
        .await
        .is_err()
    {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

/// The shell's convention: the exit code, or 128 + the signal.
pub(super) fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(signal)) => u8::try_from(128 + signal).unwrap_or(1),
        (None, None) => 1,
    }
}
