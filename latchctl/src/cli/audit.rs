//! `latchctl audit` and `latchctl why`: a key's (or an election's) history
//! from the audit store (ADR-21), and who holds it now with its last events.
//!
//! The history comes from the store the audit tailer writes, read with the
//! store's read-only user (`--store` or `LATCHKEY_AUDIT_STORE`, the password
//! in `--store-password-file`): whoever can read the store sees every
//! holder and session in it, so give that credential to operators only.
//! The store keeps no revision (a revision with the epoch is a fencing
//! token): a hold is named by its id, which its grant and its end share.
//! The current holder comes from the arbiter's Inspect, with Inspect's
//! rules: callers with a grant on the key's prefix see the holder, only
//! the holder and operators its session.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use latchkey_audit::event::now_unix_ms;
use latchkey_audit::text::{describe, utc};
use latchkey_audit::{AuditStore, HistoryQuery, StoreOptions, StoredEvent};
use latchkey_proto::text::Shown;
use serde_json::json;

use super::{Failure, Output};
use latchkey_client::Client;

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// A lock key, or an election's name (its term starts, proclamations
    /// and vacancies are recorded under it).
    pub key: String,
    /// Only events from this long ago on (e.g. 30m, 2h, 7d).
    #[arg(long, value_parser = parse_since)]
    pub since: Option<Duration>,
    /// At most this many events (the newest).
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
    /// The audit store: postgresql://… or clickhouse://READER@host:8123/database.
    #[arg(long, env = "LATCHKEY_AUDIT_STORE", hide_env_values = true)]
    pub store: String,
    /// The store user's password, from this file (a password in a URL on
    /// the command line is refused: `ps` shows it).
    #[arg(long, value_name = "PATH", env = "LATCHKEY_AUDIT_STORE_PASSWORD_FILE")]
    pub store_password_file: Option<PathBuf>,
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
    /// The store user's password, from this file.
    #[arg(long, value_name = "PATH", env = "LATCHKEY_AUDIT_STORE_PASSWORD_FILE")]
    pub store_password_file: Option<PathBuf>,
}

/// `7d`, `1h`, `30m`: `duration::parse`, which takes days too.
fn parse_since(text: &str) -> Result<Duration, String> {
    super::duration::parse(text)
}

/// Opens the store to read: no audit key (readers never need it).
async fn open_store(
    url: &str,
    password_file: Option<&std::path::Path>,
) -> Result<Box<dyn AuditStore>, Failure> {
    if let Some(password) = latchkey_audit::store::url_password(url)
        && std::env::args_os().any(|a| {
            let a = a.to_string_lossy();
            a.contains("://") && a.contains(password)
        })
    {
        return Err(Failure::Plain(
            "the store URL on the command line has a password, which `ps` shows to every user: \
             pass the URL in LATCHKEY_AUDIT_STORE, or the password in --store-password-file"
                .into(),
        ));
    }
    let password = match password_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Failure::Plain(format!(
                    "cannot read the store password {}: {e}",
                    path.display()
                ))
            })?;
            Some(text.strip_suffix('\n').unwrap_or(&text).to_string())
        }
        None => None,
    };
    let options = StoreOptions {
        password,
        audit_key: None,
    };
    latchkey_audit::store::open_with(url, options)
        .await
        .map_err(|e| {
            Failure::Plain(format!(
                "cannot open the audit store {}: {}",
                latchkey_audit::store::redact(url),
                super::chain(&e)
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
        .map_err(|e| Failure::Plain(format!("cannot read the audit store: {}", super::chain(&e))))
}

pub async fn audit(args: AuditArgs, out: Output) -> Result<ExitCode, Failure> {
    let store = open_store(&args.store, args.store_password_file.as_deref()).await?;
    let events = history(store.as_ref(), &args.key, args.since, args.limit).await?;
    if out.json {
        for e in &events {
            out.line(event_json(e));
        }
    } else if events.is_empty() {
        println!("no events for {} in the audit store", args.key);
    } else {
        for e in &events {
            println!("{}", Shown(&describe(e)));
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn why(client: Client, args: WhyArgs, out: Output) -> Result<ExitCode, Failure> {
    let view = client.inspect(&args.key).await?;
    let events = match &args.store {
        Some(url) => {
            let store = open_store(url, args.store_password_file.as_deref()).await?;
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
            "slot_holders": super::inspect::slots_json(&view.slot_holders),
            "shared_holders": super::inspect::slots_json(&view.shared_holders),
            "last_events": events.as_ref().map(|es| es.iter().map(event_json).collect::<Vec<_>>()),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    match &view.holder {
        None if !view.slot_holders.is_empty() => {
            println!("{} is a semaphore", Shown(&view.key));
            super::inspect::print_slots(&view.slot_holders);
        }
        None if !view.shared_holders.is_empty() => {
            println!("{} is held shared", Shown(&view.key));
            super::inspect::print_shared(&view.shared_holders);
        }
        None => println!("{} is free", Shown(&view.key)),
        Some(h) => {
            let session = match h.session_id {
                0 => String::new(),
                s => format!(" (session {s:#x})"),
            };
            println!(
                "{} is held by {}{session}, class {}, since {}",
                Shown(&view.key),
                Shown(&h.identity),
                Shown(&h.class),
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
                println!("  {}", Shown(&describe(e)));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn event_json(stored: &StoredEvent) -> serde_json::Value {
    let e = &stored.event;
    json!({
        "cluster_id": stored.cluster_id.to_string(),
        "event_id": e.event_id,
        "position": stored.position,
        "key": e.key,
        "kind": e.kind.as_str(),
        "ended": e.ended.as_str(),
        "epoch": e.epoch,
        "identity": e.identity,
        "session": e.session,
        "class": e.class,
        "hold_id": e.hold_id,
        "prev_hold_id": e.prev_hold_id,
        "prev_identity": e.prev_identity,
        "prev_session": e.prev_session,
        "detail": e.detail,
        "observed_at_unix_ms": stored.observed_at_unix_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_audit::{Ended, Kind, RecordedEvent};

    fn stored(kind: Kind, ended: Ended) -> StoredEvent {
        StoredEvent {
            cluster_id: 1,
            position: 0,
            observed_at_unix_ms: 0,
            event: RecordedEvent {
                event_id: "0f".repeat(16),
                key: "ledger/inv-1".into(),
                kind,
                ended,
                epoch: 3,
                identity: "spiffe://td/w".into(),
                session: 255,
                class: "c".into(),
                hold_id: "9a3c5e7f00112233".into(),
                prev_hold_id: String::new(),
                prev_identity: String::new(),
                prev_session: 0,
                detail: json!({}),
            },
        }
    }

    #[test]
    fn a_shared_holds_and_a_slots_events_say_which_hold_they_are() {
        let mut grant = stored(Kind::Grant, Ended::No);
        grant.event.detail = json!({"mode": "shared", "session": 255, "acquiredAtUnixMs": 1});
        let line = describe(&grant);
        assert!(
            line.contains("spiffe://td/w session 0xff [shared] class c, hold 9a3c5e7f00112233"),
            "{line}"
        );
        // a downgrade: the exclusive hold's release and the shared grant
        let mut release = stored(Kind::Release, Ended::Released);
        release.event.detail = json!({"downgrade": true});
        let line = describe(&release);
        assert!(
            line.contains("session 0xff [downgrade] hold 9a3c5e7f00112233: released"),
            "{line}"
        );
        grant.event.detail["downgrade"] = json!(true);
        let line = describe(&grant);
        assert!(line.contains("[shared, downgrade]"), "{line}");
        // the tailer never saw the grant: the detail still names the session
        let mut unknown = stored(Kind::Release, Ended::Unknown);
        unknown.event.identity = String::new();
        unknown.event.session = 0;
        unknown.event.hold_id = String::new();
        unknown.event.detail = json!({"mode": "shared", "session": 0x1a2b});
        let line = describe(&unknown);
        assert!(
            line.contains("(holder unknown) [shared, session 0x1a2b] hold (not seen granted)"),
            "{line}"
        );
        let mut slot = stored(Kind::Expiry, Ended::ExpiredOrRevoked);
        slot.event.detail = json!({"slot": 3});
        let line = describe(&slot);
        assert!(line.contains("session 0xff [slot 3] hold"), "{line}");
    }

    #[test]
    fn since_takes_days_too() {
        assert_eq!(parse_since("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_since("90m"), Ok(Duration::from_secs(5400)));
        assert!(parse_since("d").is_err());
    }

    #[test]
    fn lines_say_what_happened_and_name_the_hold() {
        let line = describe(&stored(Kind::Expiry, Ended::ExpiredOrRevoked));
        assert!(line.contains("expiry"), "{line}");
        assert!(line.contains("spiffe://td/w session 0xff"), "{line}");
        assert!(line.contains("hold 9a3c5e7f00112233"), "{line}");
        assert!(line.contains("expired (or was revoked by hand)"), "{line}");
        let mut gap = stored(Kind::Gap, Ended::No);
        gap.event.key = "/gap".into();
        gap.event.detail = json!({"revisions": 5});
        let gap = describe(&gap);
        assert!(gap.contains("5 revisions were compacted"), "{gap}");
        let mut start = stored(Kind::TermStart, Ended::No);
        start.event.hold_id = String::new();
        start.event.session = 0;
        start.event.prev_identity = "spiffe://td/v".into();
        start.event.detail = json!({"term": 4294967298u64, "value": "pod-b", "priority": 2, "previousTerm": 4294967297u64});
        let start = describe(&start);
        assert!(
            start.contains(
                "spiffe://td/w leads term 4294967298, class c, priority 2, value \"pod-b\", \
                 taking over term 4294967297 from spiffe://td/v"
            ),
            "{start}"
        );
        assert!(!start.contains("session"), "{start}");
        let mut vacancy = stored(Kind::Vacancy, Ended::SessionEnded);
        vacancy.event.detail = json!({"term": 4294967298u64});
        let vacancy = describe(&vacancy);
        assert!(
            vacancy.contains("spiffe://td/w's term 4294967298 ended: its session ended"),
            "{vacancy}"
        );
        let plain = describe(&stored(Kind::Grant, Ended::No));
        assert!(
            !plain.contains('['),
            "an exclusive hold has no tag: {plain}"
        );
        let json = event_json(&stored(Kind::Grant, Ended::No));
        assert!(json.get("revision").is_none() && json.get("hold_revision").is_none());
        assert_eq!(json["hold_id"], "9a3c5e7f00112233");
    }
}
