//! Maintenance-window hook: the class may be locked only inside configured
//! UTC windows, e.g. a database failover lock that may only be taken during
//! the weekend change window. Time comes from the request (`nowUnixMs`);
//! hooks have no clock.
//!
//! ```toml
//! [[class.hook.config.windows]]
//! days = ["sat", "sun"]   # optional; every day when absent
//! start = "02:00"         # UTC, inclusive
//! end = "04:30"           # UTC, exclusive; end < start crosses midnight
//! ```

// On the Wasm path a panic takes the VM down; the workspace lints
// (Cargo.toml) deny unwrap/expect/panic, this crate indexing too.
#![deny(clippy::indexing_slicing)]

use latchkey_hook_sdk::{DenyCode, HookRequest, HookResponse};
use serde::Deserialize;

const DAY_MS: i64 = 86_400_000;
const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    windows: Vec<Window>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Window {
    #[serde(default)]
    days: Vec<String>,
    start: String,
    end: String,
}

/// Minutes since midnight from "HH:MM".
fn minutes(s: &str) -> Option<i64> {
    let (h, m) = s.split_once(':')?;
    let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
    ((0..24).contains(&h) && (0..60).contains(&m)).then_some(h * 60 + m)
}

/// Monday = 0.
fn weekday(days_since_epoch: i64) -> usize {
    // 1970-01-01 was a Thursday.
    (days_since_epoch + 3).rem_euclid(7) as usize
}

struct Parsed {
    days: [bool; 7],
    start: i64,
    end: i64,
}

impl Parsed {
    fn from(w: &Window) -> Result<Self, String> {
        let start = minutes(&w.start).ok_or_else(|| format!("start {:?} is not HH:MM", w.start))?;
        let end = minutes(&w.end).ok_or_else(|| format!("end {:?} is not HH:MM", w.end))?;
        let mut days = [w.days.is_empty(); 7];
        for d in &w.days {
            let i = DAYS
                .iter()
                .position(|x| x.eq_ignore_ascii_case(d))
                .ok_or_else(|| format!("day {d:?} is not one of {DAYS:?}"))?;
            if let Some(slot) = days.get_mut(i) {
                *slot = true;
            }
        }
        Ok(Self { days, start, end })
    }

    fn on(&self, day: i64) -> bool {
        self.days.get(weekday(day)).copied().unwrap_or(false)
    }

    /// Whether minute `m` of day `day` is inside the window.
    fn contains(&self, day: i64, m: i64) -> bool {
        if self.start <= self.end {
            self.on(day) && (self.start..self.end).contains(&m)
        } else {
            // Crosses midnight: the days name the day the window opens.
            (self.on(day) && m >= self.start) || (self.on(day - 1) && m < self.end)
        }
    }
}

pub fn before_grant(req: &HookRequest) -> HookResponse {
    let windows = match req
        .config::<Config>()
        .map_err(|e| e.to_string())
        .and_then(|c| {
            c.windows
                .iter()
                .map(Parsed::from)
                .collect::<Result<Vec<_>, _>>()
        }) {
        Ok(w) if !w.is_empty() => w,
        Ok(_) => return misconfigured("no windows configured".into()),
        Err(e) => return misconfigured(e),
    };
    let day = req.now_unix_ms.div_euclid(DAY_MS);
    let minute = req.now_unix_ms.rem_euclid(DAY_MS) / 60_000;
    if windows.iter().any(|w| w.contains(day, minute)) {
        return HookResponse::allow().annotate("window", "open");
    }
    let next = next_opening(&windows, day, minute)
        .map(|(d, m)| {
            format!(
                "; the next window opens {} {:02}:{:02} UTC",
                day_name(d),
                m / 60,
                m % 60
            )
        })
        .unwrap_or_default();
    HookResponse::deny(
        DenyCode::FailedPrecondition,
        "OUTSIDE_WINDOW",
        format!(
            "class {:?} may only be locked inside its maintenance windows; it is {} {:02}:{:02} UTC now{next}",
            req.class,
            day_name(day),
            minute / 60,
            minute % 60
        ),
    )
}

fn day_name(day: i64) -> &'static str {
    DAYS.get(weekday(day)).copied().unwrap_or("?")
}

/// The first window start within the next 8 days.
fn next_opening(windows: &[Parsed], day: i64, minute: i64) -> Option<(i64, i64)> {
    (0..8)
        .flat_map(|d| windows.iter().map(move |w| (day + d, w)))
        .filter(|(d, w)| w.on(*d) && (*d > day || w.start > minute))
        .map(|(d, w)| (d, w.start))
        .min()
}

fn misconfigured(why: String) -> HookResponse {
    HookResponse::deny(
        DenyCode::FailedPrecondition,
        "HOOK_MISCONFIGURED",
        format!("the class's maintenance windows are invalid: {why}"),
    )
}

latchkey_hook_sdk::hook!(before_grant);

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_hook_sdk::ABI_VERSION;

    // 2026-01-03 is a Saturday.
    const SAT_0300: i64 = 1_767_409_200_000;

    fn req(now: i64, config: serde_json::Value) -> HookRequest {
        HookRequest {
            version: ABI_VERSION,
            class: "windowed".into(),
            identity: "spiffe://td/w".into(),
            key: "demo/a".into(),
            session: 1,
            metadata: Default::default(),
            holder: None,
            waiters: 0,
            now_unix_ms: now,
            now_monotonic_ns: 0,
            hold_count: None,
            mode: None,
            permits: None,
            config,
        }
    }

    fn weekend() -> serde_json::Value {
        serde_json::json!({"windows": [{"days": ["sat", "sun"], "start": "02:00", "end": "04:30"}]})
    }

    #[test]
    fn the_test_clock_is_a_saturday() {
        assert_eq!(day_name(SAT_0300.div_euclid(DAY_MS)), "sat");
    }

    #[test]
    fn inside_the_window_is_allowed() {
        assert_eq!(
            before_grant(&req(SAT_0300, weekend())).decision,
            HookResponse::allow().decision
        );
    }

    #[test]
    fn outside_the_window_names_the_next_opening() {
        let r = before_grant(&req(SAT_0300 + 2 * 3_600_000, weekend()));
        assert_eq!(r.reason.as_deref(), Some("OUTSIDE_WINDOW"));
        let msg = r.message.unwrap();
        assert!(msg.contains("sat 05:00 UTC now"), "{msg}");
        assert!(msg.contains("next window opens sun 02:00 UTC"), "{msg}");
        // Monday: not a listed day.
        let r = before_grant(&req(SAT_0300 + 2 * DAY_MS, weekend()));
        assert_eq!(r.reason.as_deref(), Some("OUTSIDE_WINDOW"));
    }

    #[test]
    fn windows_may_cross_midnight() {
        let night =
            serde_json::json!({"windows": [{"days": ["fri"], "start": "22:00", "end": "04:00"}]});
        // Saturday 03:00 is inside Friday's window.
        assert_eq!(
            before_grant(&req(SAT_0300, night.clone())).decision,
            HookResponse::allow().decision
        );
        assert_eq!(
            before_grant(&req(SAT_0300 + DAY_MS, night))
                .reason
                .as_deref(),
            Some("OUTSIDE_WINDOW")
        );
    }

    #[test]
    fn bad_windows_fail_closed() {
        let bad = serde_json::json!({"windows": [{"start": "25:00", "end": "01:00"}]});
        assert_eq!(
            before_grant(&req(SAT_0300, bad)).reason.as_deref(),
            Some("HOOK_MISCONFIGURED")
        );
        let none = serde_json::json!({"windows": []});
        assert_eq!(
            before_grant(&req(SAT_0300, none)).reason.as_deref(),
            Some("HOOK_MISCONFIGURED")
        );
    }
}
