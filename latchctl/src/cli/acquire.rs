//! `latchctl acquire` and `latchctl release`.

use std::io::{BufRead, Read};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use latchkey_client::{Client, FenceReason, FencingToken, LockGuard, Session};
use serde_json::json;
use tokio::sync::mpsc;

use super::{Failure, Output, duration, parse_meta};

#[derive(Debug, Args)]
pub struct AcquireArgs {
    /// The lock key, e.g. `payments/ledger/42`.
    pub key: String,
    /// The lock class (fixes the TTL and the rules).
    #[arg(long)]
    pub class: String,
    /// Queue for up to this long instead of failing at once when held.
    #[arg(long, value_parser = duration::parse, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// Exit right after the grant; the hold then ends with the session's TTL.
    /// Without it, latchctl holds the key until Ctrl-C or the end of its
    /// input; a line `downgrade` on its input turns an exclusive hold shared
    /// (one transaction: readers join, no writer comes between).
    #[arg(long)]
    pub detach: bool,
    /// Metadata for the class's hooks.
    #[arg(long = "meta", value_name = "K=V", value_parser = parse_meta)]
    pub meta: Vec<(String, String)>,
    /// A shared hold: held beside other sessions' shared holds, never
    /// beside an exclusive one (a lock class only).
    #[arg(long)]
    pub shared: bool,
}

#[derive(Debug, Args)]
pub struct ReleaseArgs {
    pub key: String,
    /// The session the grant was made on.
    #[arg(long)]
    pub session: i64,
    /// The grant's fencing token.
    #[arg(long)]
    pub token: u64,
    /// The slot of a semaphore's grant (as `acquire` printed it).
    #[arg(long, conflicts_with = "shared")]
    pub slot: Option<u32>,
    /// A shared grant (`acquire --shared`).
    #[arg(long)]
    pub shared: bool,
}

/// Opens a session for the class and acquires on it; fences arrive on the
/// returned channel.
pub async fn grant(
    client: &Client,
    key: &str,
    class: &str,
    wait: Option<Duration>,
    meta: &[(String, String)],
    shared: bool,
) -> Result<(Session, LockGuard, mpsc::UnboundedReceiver<FenceReason>), Failure> {
    let session = client.open_session(class).await?;
    let (fenced, on_fence) = mpsc::unbounded_channel();
    let mut lock = client.lock(key, class).session(&session);
    if shared {
        lock = lock.shared();
    }
    if let Some(wait) = wait {
        lock = lock.wait(wait);
    }
    for (k, v) in meta {
        lock = lock.metadata(k.clone(), v.clone());
    }
    let guard = lock
        .acquire(move |reason| {
            let _ = fenced.send(reason);
        })
        .await?;
    Ok((session, guard, on_fence))
}

pub async fn acquire(client: Client, args: AcquireArgs, out: Output) -> Result<ExitCode, Failure> {
    let (session, guard, mut fenced) = grant(
        &client,
        &args.key,
        &args.class,
        args.wait,
        &args.meta,
        args.shared,
    )
    .await?;
    let ttl = session.ttl().as_secs();
    if out.json {
        out.line(json!({
            "key": guard.key(),
            "token": guard.token().get(),
            "epoch": guard.epoch(),
            "revision": guard.revision(),
            "session_id": guard.session_id(),
            "slot": guard.slot(),
            "permits": guard.permits(),
            "mode": if guard.is_shared() { "shared" } else { "exclusive" },
            "ttl_seconds": ttl,
            "detached": args.detach,
        }));
    } else {
        println!("acquired {}", guard.key());
        if let Some(slot) = guard.slot() {
            println!("  slot      {slot} (the token is this slot's)");
        }
        if guard.is_shared() {
            println!("  mode      shared (fence reads: no writer since this token)");
        }
        println!("  token     {}", guard.token().get());
        println!("  epoch     {}", guard.epoch());
        println!("  revision  {}", guard.revision());
        println!("  session   {} (ttl {ttl}s)", guard.session_id());
    }

    if args.detach {
        let session_id = guard.session_id();
        let slot = match (guard.slot(), guard.is_shared()) {
            (Some(s), _) => format!(" --slot {s}"),
            (None, true) => " --shared".to_string(),
            (None, false) => String::new(),
        };
        guard.detach();
        if !out.json {
            println!(
                "detached: the hold ends when session {session_id} expires, about {ttl}s after this \
                 process exits (or: latchctl release {} --session {session_id}{slot} --token <token>)",
                args.key
            );
        }
        return Ok(ExitCode::SUCCESS);
    }

    if !out.json {
        if guard.is_shared() {
            println!("holding; Ctrl-C or end of input releases");
        } else {
            println!(
                "holding; Ctrl-C or end of input releases, a line `downgrade` holds it shared"
            );
        }
    }
    let mut guard = guard;
    let mut input = stdin_lines();
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            line = input.recv() => match line {
                None => break,
                Some(line) if line.trim() == "downgrade" => downgrade(&mut guard, &out).await?,
                Some(_) => {}
            },
            reason = fenced.recv() => {
                let reason = reason.map_or_else(|| "unknown".to_owned(), |r| r.to_string());
                return Err(Failure::Other(anyhow::anyhow!("lock on {} lost: {reason}", args.key)));
            }
        }
    }
    let key = guard.key().to_owned();
    guard.release().await?;
    session.close().await?;
    if out.json {
        out.line(json!({ "key": key, "released": true }));
    } else {
        println!("released {key}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `latchctl acquire`'s `downgrade` line: the hold turns shared, or the
/// refusal is shown and the hold goes on as it was — unless it is lost
/// (fenced before the call, refused NOT_HELD, or of unknown outcome).
async fn downgrade(guard: &mut LockGuard, out: &Output) -> Result<(), Failure> {
    match guard.downgrade().await {
        Ok(()) => {
            // Not the token (nor the revision, which with the epoch spells
            // it): this process releases the hold itself.
            if out.json {
                out.line(json!({ "key": guard.key(), "downgraded": true, "mode": "shared" }));
            } else {
                println!(
                    "downgraded {}: held shared now (a new grant, its token above the exclusive one; fence reads with it)",
                    guard.key()
                );
            }
            Ok(())
        }
        // Fenced before the call, or by it: NOT_HELD (the exclusive hold had
        // ended at the arbiter) or an outcome that stayed unknown.
        Err(e) if matches!(e, latchkey_client::Error::Fenced { .. }) || guard.is_fenced() => Err(
            Failure::Other(anyhow::anyhow!("lock on {} lost: {e}", guard.key())),
        ),
        Err(e) => {
            out.note(
                json!({ "event": "downgrade_refused", "key": guard.key(), "error": e.to_string() }),
                format_args!(
                    "latchctl: downgrade of {} refused ({e}); still holding it {}",
                    guard.key(),
                    if guard.is_shared() {
                        "shared"
                    } else {
                        "exclusively"
                    }
                ),
            );
            Ok(())
        }
    }
}

/// The lines of stdin, until its end of input (then the channel closes). A
/// plain thread, not Tokio's blocking pool, so a pending read never holds
/// up the exit.
fn stdin_lines() -> mpsc::Receiver<String> {
    // A line is at most this long (a longer one is dropped whole, never
    // read as a command in pieces), and few wait to be read: input without
    // newlines, or faster than it is read, never grows this process's
    // memory.
    const LINE_LIMIT: u64 = 1024;
    let (tx, rx) = mpsc::channel(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut line = Vec::new();
        let mut overlong = false;
        // Bytes, not `lines()`: input that is not UTF-8 is ignored as
        // before, never taken for the end of input.
        while let Ok(n) = (&mut stdin).take(LINE_LIMIT).read_until(b'\n', &mut line) {
            if n == 0 {
                break;
            }
            let ended = line.ends_with(b"\n");
            // The limit reached without the line's end: over the limit.
            let cut = !ended && n as u64 == LINE_LIMIT;
            if overlong || cut {
                // Part of a line over the limit: dropped to its end.
                overlong = !ended;
                line.clear();
                continue;
            }
            if tx
                .blocking_send(String::from_utf8_lossy(&line).into_owned())
                .is_err()
            {
                break;
            }
            line.clear();
        }
    });
    rx
}

pub async fn release(client: Client, args: ReleaseArgs, out: Output) -> Result<ExitCode, Failure> {
    let token = FencingToken::new(args.token);
    match args.shared {
        true => {
            client
                .release_shared_grant(&args.key, args.session, token)
                .await?
        }
        false => {
            client
                .release_grant_in(&args.key, args.slot, args.session, token)
                .await?
        }
    }
    if out.json {
        out.line(json!({ "key": args.key, "released": true }));
    } else {
        println!("released {}", args.key);
    }
    Ok(ExitCode::SUCCESS)
}
