//! `latchctl inspect`: who holds a key. The arbiter answers only callers
//! with a grant on the key's prefix, and never with a token; the holder's
//! session id only to the holder's own identity and to operators.

use std::process::ExitCode;

use clap::Args;
use latchkey_client::{Client, Holder};
use latchkey_proto::text::Shown;
use serde_json::json;

use super::{Failure, Output};

#[derive(Debug, Args)]
pub struct InspectArgs {
    pub key: String,
}

pub async fn inspect(client: Client, args: InspectArgs, out: Output) -> Result<ExitCode, Failure> {
    let view = client.inspect(&args.key).await?;
    if out.json {
        out.line(json!({
            "key": view.key,
            "waiters": view.waiters,
            "durable_waiters": view.durable_waiters,
            "holder": view.holder.as_ref().map(|h| json!({
                "identity": h.identity,
                "session_id": (h.session_id != 0).then_some(h.session_id),
                "class": h.class,
                "acquired_at_unix_ms": h.acquired_at_unix_ms,
                "annotations": h.annotations,
            })),
            "slot_holders": slots_json(&view.slot_holders),
            "shared_holders": slots_json(&view.shared_holders),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    if !view.shared_holders.is_empty() {
        println!("key       {} (held shared)", Shown(&view.key));
        print_shared(&view.shared_holders);
        println!("waiters   {}", view.waiters);
        return Ok(ExitCode::SUCCESS);
    }
    if !view.slot_holders.is_empty() {
        println!("key       {} (a semaphore)", Shown(&view.key));
        print_slots(&view.slot_holders);
        println!("waiters   {}", view.waiters);
        return Ok(ExitCode::SUCCESS);
    }
    match &view.holder {
        None => println!(
            "{} is free ({} waiting here, {} durably)",
            Shown(&view.key),
            view.waiters,
            view.durable_waiters
        ),
        Some(h) => {
            // Shown: a key, an identity, a class and annotations are
            // other people's text (latchkey_proto::text).
            println!("key       {}", Shown(&view.key));
            println!("holder    {}", Shown(&h.identity));
            if h.session_id != 0 {
                println!("session   {}", h.session_id);
            }
            println!("class     {}", Shown(&h.class));
            println!("acquired  {}", utc(h.acquired_at_unix_ms));
            println!("waiters   {}", view.waiters);
            if view.durable_waiters > 0 {
                println!(
                    "durable   {} (queued in the lock log)",
                    view.durable_waiters
                );
            }
            for (k, v) in &h.annotations {
                println!("  {} = {}", Shown(k), Shown(v));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A semaphore's slot holders as JSON (no token: Inspect has none).
pub fn slots_json(holders: &[Holder]) -> serde_json::Value {
    holders
        .iter()
        .map(|h| {
            json!({
                "slot": h.slot,
                "identity": h.identity,
                "session_id": (h.session_id != 0).then_some(h.session_id),
                "class": h.class,
                "acquired_at_unix_ms": h.acquired_at_unix_ms,
            })
        })
        .collect()
}

/// A semaphore's slot holders, one line each, in slot order.
pub fn print_slots(holders: &[Holder]) {
    println!("slots     {} held", holders.len());
    for h in holders {
        let session = match h.session_id {
            0 => String::new(),
            s => format!(" session {s}"),
        };
        println!(
            "  slot {:<4} {}{session}, class {}, since {}",
            h.slot.unwrap_or_default(),
            Shown(&h.identity),
            Shown(&h.class),
            utc(h.acquired_at_unix_ms)
        );
    }
}

/// A lock's shared holders, one line each.
pub fn print_shared(holders: &[Holder]) {
    println!("shared    {} holders", holders.len());
    for h in holders {
        let session = match h.session_id {
            0 => String::new(),
            s => format!(" session {s}"),
        };
        println!(
            "  {}{session}, class {}, since {}",
            Shown(&h.identity),
            Shown(&h.class),
            utc(h.acquired_at_unix_ms)
        );
    }
}

/// RFC 3339 in UTC (shared with the audit lines and the console).
pub use latchkey_audit::text::utc;

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn formats_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(utc(1_735_689_599_999), "2024-12-31T23:59:59.999Z");
    }
}
