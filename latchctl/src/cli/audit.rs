//! `latchctl audit` and `latchctl why`: a key's history from the audit
//! store (ADR-21), and who holds it now with its last events.
//!
//! The history comes from the store the audit tailer writes, read with the
//! store's own credentials (`--store` or `LATCHKEY_AUDIT_STORE`): whoever
//! can read the store sees every holder and session in it, so give its
//! read credential to operators only. The current holder comes from the
//! arbiter's Inspect, with Inspect's rules: callers with a grant on the
//! key's prefix see the holder, only the holder and operators its session.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use latchkey_audit::event::now_unix_ms;
use latchkey_audit::{AuditStore, Ended, HistoryQuery, Kind, StoredEvent};
use serde_json::json;

use super::inspect::utc;
use super::{Failure, Output};
use latchkey_client::Client;

#[derive(Debug, Args)]
pub struct AuditArgs {
    pub key: String,
    /// Only events from this long ago on (e.g. 30m, 2h, 7d).
    #[arg(long, value_parser = parse_since)]
    pub since: Option<Duration>,
    /// At most this many events (the newest).
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    /// The audit store: postgresql://… or clickhouse://host:8123/database.
    #[arg(long, env = "LATCHKEY_AUDIT_STORE", hide_env_values = true)]
    pub store: String,
}

#[derive(Debug, Args)]
pub struct WhyArgs {
    pub key: String,
    /// How many of the key's last events to show.
    #[arg(long, default_value_t = 5)]
    pub last: u32,
    /// The audit store (without one, only the arbiter's answer is shown).
    #[arg(long, env = "LATCHKEY_AUDIT_STORE", hide_env_values = true)]
    pub store: Option<String>,
}

/// `7d`, `1h`, `30m`: `duration::parse`, which takes days too.
fn parse_since(text: &str) -> Result<Duration, String> {
    super::duration::parse(text)
}

async fn open_store(url: &str) -> Result<Box<dyn AuditStore>, Failure> {
    latchkey_audit::store::open(url).await.map_err(|e| {
        Failure::Plain(format!(
            "cannot open the audit store {}: {e}",
            latchkey_audit::store::redact(url)
        ))
    })
}

async fn history(
    store: &dyn AuditStore,
    key: &str,
    since: Option<Duration>,
    limit: u32,
) -> Result<Vec<StoredEvent>, Failure> {
    let since_unix_ms = since
        .map(|d| now_unix_ms().saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX)));
    let query = HistoryQuery {
        key: key.to_string(),
        since_unix_ms,
        limit,
        cluster_id: None,
    };
    store
        .history(&query)
        .await
        .map_err(|e| Failure::Plain(format!("cannot read the audit store: {e}")))
}

pub async fn audit(args: AuditArgs, out: Output) -> Result<ExitCode, Failure> {
    let store = open_store(&args.store).await?;
    let events = history(store.as_ref(), &args.key, args.since, args.limit).await?;
    if out.json {
        for e in &events {
            out.line(event_json(e));
        }
    } else if events.is_empty() {
        println!("no events for {} in the audit store", args.key);
    } else {
        for e in &events {
            println!("{}", describe(e));
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn why(client: Client, args: WhyArgs, out: Output) -> Result<ExitCode, Failure> {
    let view = client.inspect(&args.key).await?;
    let events = match &args.store {
        Some(url) => {
            let store = open_store(url).await?;
            Some(history(store.as_ref(), &args.key, None, args.last).await?)
        }
        None => None,
    };
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
            })),
            "last_events": events.as_ref().map(|es| es.iter().map(event_json).collect::<Vec<_>>()),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    match &view.holder {
        None => println!("{} is free", view.key),
        Some(h) => {
            let session = match h.session_id {
                0 => String::new(),
                s => format!(" (session {s:#x})"),
            };
            println!(
                "{} is held by {}{session}, class {}, since {}",
                view.key,
                h.identity,
                h.class,
                utc(h.acquired_at_unix_ms)
            );
        }
    }
    println!("{} waiting (on the arbiter that answered)", view.waiters);
    if view.durable_waiters > 0 {
        println!(
            "{} waiting in the lock log (durable: served in order by every arbiter)",
            view.durable_waiters
        );
    }
    match events {
        None => println!("last events: no audit store given (--store or LATCHKEY_AUDIT_STORE)"),
        Some(events) if events.is_empty() => println!("last events: none recorded"),
        Some(events) => {
            println!("last events:");
            for e in &events {
                println!("  {}", describe(e));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One event as a line: when the tailer saw it, where it is in the log,
/// what happened and to whom. Never a token: epoch and revision are the
/// log's position, not something to present to a resource.
fn describe(stored: &StoredEvent) -> String {
    let e = &stored.event;
    let at = utc(stored.observed_at_unix_ms);
    let head = format!(
        "{at}  r{:<8} e{:<3} {:<13}",
        e.revision,
        e.epoch,
        e.kind.as_str()
    );
    let detail = |name: &str| e.detail[name].as_str().unwrap_or("").to_string();
    let who = if e.identity.is_empty() {
        "(holder unknown)".to_string()
    } else {
        format!("{} session {:#x}", e.identity, e.session)
    };
    match e.kind {
        Kind::Grant => format!("{head} {who} class {}", e.class),
        Kind::HandOver => format!(
            "{head} {who} from {} session {:#x} (held since r{})",
            e.prev_identity, e.prev_session, e.hold_revision
        ),
        Kind::Release | Kind::Expiry | Kind::EpochAdvance if !e.key.starts_with('/') => {
            format!(
                "{head} {who} held since r{}: {}",
                e.hold_revision,
                ended(e.ended)
            )
        }
        Kind::ForceRelease => format!(
            "{head} {who} held since r{}: by {}, approved by {} ({}): {}",
            e.hold_revision,
            detail("requestedBy"),
            detail("approvedBy"),
            detail("enforcement"),
            detail("reason")
        ),
        Kind::Gap => format!(
            "{head} revisions r{}..=r{} were compacted before the tailer read them",
            e.revision, e.detail["toRevision"]
        ),
        _ => format!("{head} {}", detail("reason")),
    }
}

fn ended(ended: Ended) -> &'static str {
    match ended {
        Ended::Released => "released by its holder",
        Ended::SessionClosed => "its session was closed",
        Ended::ExpiredOrRevoked => "its session's lease expired (or was revoked by hand)",
        Ended::ForceReleased => "force-released",
        Ended::ForceRevoked => "its session was revoked by an operator's force-release",
        Ended::EpochAdvance => "dropped by an epoch advance",
        Ended::HandedOver => "handed over",
        Ended::Unknown => "ended (the tailer had not seen it granted)",
        Ended::No => "",
    }
}

fn event_json(stored: &StoredEvent) -> serde_json::Value {
    let e = &stored.event;
    json!({
        "cluster_id": stored.cluster_id.to_string(),
        "revision": e.revision,
        "key": e.key,
        "kind": e.kind.as_str(),
        "ended": e.ended.as_str(),
        "epoch": e.epoch,
        "identity": e.identity,
        "session": e.session,
        "class": e.class,
        "hold_revision": e.hold_revision,
        "prev_identity": e.prev_identity,
        "prev_session": e.prev_session,
        "detail": e.detail,
        "observed_at_unix_ms": stored.observed_at_unix_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_audit::Event;

    fn stored(event: Event) -> StoredEvent {
        StoredEvent {
            cluster_id: 1,
            event,
            observed_at_unix_ms: 0,
        }
    }

    #[test]
    fn since_takes_days_too() {
        assert_eq!(parse_since("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_since("90m"), Ok(Duration::from_secs(5400)));
        assert!(parse_since("d").is_err());
    }

    #[test]
    fn lines_say_what_happened_and_never_a_token() {
        let mut e = Event::new(42, "ledger/inv-1", Kind::Expiry, 3);
        e.ended = Ended::ExpiredOrRevoked;
        e.identity = "spiffe://td/w".into();
        e.session = 255;
        e.hold_revision = 40;
        let line = describe(&stored(e));
        assert!(line.contains("expiry"), "{line}");
        assert!(line.contains("spiffe://td/w session 0xff"), "{line}");
        assert!(line.contains("held since r40"), "{line}");
        assert!(line.contains("expired (or was revoked by hand)"), "{line}");
        let token = (3u64 << 48) + 40;
        assert!(!line.contains(&token.to_string()), "{line}");
        let gap = describe(&stored(Event::gap(5, 9, 1)));
        assert!(gap.contains("r5..=r9"), "{gap}");
    }
}
