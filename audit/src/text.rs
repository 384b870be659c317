//! Events as one line of text each: what `latchctl audit` prints and the
//! console shows, from one function, so the two never disagree.

use crate::{Ended, Kind, RecordedEvent, StoredEvent};

/// One event as a line: when the tailer saw it, what happened and to
/// whom, and which hold (its id: a grant and its end share it). Never a
/// token, nor a revision (with the epoch, it is one): the store has none.
pub fn describe(stored: &StoredEvent) -> String {
    let e = &stored.event;
    let at = utc(stored.observed_at_unix_ms);
    let head = format!("{at}  e{:<3} {:<13}", e.epoch, e.kind.as_str());
    let detail = |name: &str| e.detail[name].as_str().unwrap_or("").to_string();
    let who = if e.identity.is_empty() {
        "(holder unknown)".to_string()
    } else {
        format!("{} session {:#x}", e.identity, e.session)
    };
    let who = format!("{who}{}", held_as(e));
    let hold = |id: &str| {
        if id.is_empty() {
            "hold (not seen granted)".to_string()
        } else {
            format!("hold {id}")
        }
    };
    match e.kind {
        Kind::Grant => format!("{head} {who} class {}, {}", e.class, hold(&e.hold_id)),
        Kind::HandOver => format!(
            "{head} {who} class {}, {}, handed over from {} session {:#x} ({} ended)",
            e.class,
            hold(&e.hold_id),
            e.prev_identity,
            e.prev_session,
            hold(&e.prev_hold_id)
        ),
        Kind::Release | Kind::Expiry | Kind::EpochAdvance if !e.key.starts_with('/') => {
            format!("{head} {who} {}: {}", hold(&e.hold_id), ended(e.ended))
        }
        Kind::ForceRelease => format!(
            "{head} {who} {}: by {}, approved by {} ({}): {}",
            hold(&e.hold_id),
            detail("requestedBy"),
            detail("approvedBy"),
            detail("enforcement"),
            detail("reason")
        ),
        Kind::Gap => format!(
            "{head} {} revisions were compacted before the tailer read them",
            e.detail["revisions"]
        ),
        // An election's events name its leader and term, never a session.
        Kind::TermStart => {
            let over = match e.detail["previousTerm"].as_u64() {
                Some(previous) => format!(", taking over term {previous} from {}", e.prev_identity),
                None => String::new(),
            };
            format!(
                "{head} {} leads term {}, class {}, priority {}, value {:?}{over}",
                e.identity,
                e.detail["term"],
                e.class,
                e.detail["priority"],
                detail("value")
            )
        }
        Kind::Proclaim => format!(
            "{head} {} proclaimed {:?} in term {}",
            e.identity,
            detail("value"),
            e.detail["term"]
        ),
        Kind::Vacancy => format!(
            "{head} {}'s term {} ended: {}",
            e.identity,
            e.detail["term"],
            ended(e.ended)
        ),
        _ => format!("{head} {}", detail("reason")),
    }
}

/// Which hold of the key an event is about, from its detail: a semaphore's
/// slot, or a shared hold (with its session, which the detail names even
/// where the tailer never saw the holder); a downgrade's two events say so.
/// Empty for an exclusive hold.
fn held_as(e: &RecordedEvent) -> String {
    let mut tags = Vec::new();
    if let Some(slot) = e.detail["slot"].as_u64() {
        tags.push(format!("slot {slot}"));
    }
    if e.detail["mode"].as_str() == Some(crate::event::MODE_SHARED) {
        match e.detail["session"].as_i64() {
            Some(session) if e.session == 0 => tags.push(format!("shared, session {session:#x}")),
            _ => tags.push("shared".into()),
        }
    }
    if e.detail["downgrade"].as_bool() == Some(true) {
        tags.push("downgrade".into());
    }
    match tags.is_empty() {
        true => String::new(),
        false => format!(" [{}]", tags.join(", ")),
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
        Ended::Resigned => "resigned",
        Ended::SessionEnded => "its session ended (closed, expired or revoked)",
        Ended::No => "",
    }
}

/// A Unix time in milliseconds as RFC 3339 UTC (`2026-12-07T20:44:36.000Z`).
pub fn utc(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let ms = unix_ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let day_secs = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        day_secs / 3600,
        day_secs % 3600 / 60,
        day_secs % 60
    )
}
