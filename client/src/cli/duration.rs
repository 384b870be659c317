//! Durations as people type them: `500ms`, `30s`, `2m`, `1h`, `1m30s`.

use std::time::Duration;

pub fn parse(input: &str) -> Result<Duration, String> {
    let text = input.trim();
    if text.is_empty() {
        return Err("empty duration; use e.g. 500ms, 30s or 2m".into());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("{input:?}: expected a number at {rest:?}"));
        }
        let (number, after) = rest.split_at(digits);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let value: u64 = number
            .parse()
            .map_err(|_| format!("{input:?}: {number} is too large"))?;
        let part = match unit {
            "ms" => Duration::from_millis(value),
            "s" => Duration::from_secs(value),
            "m" => Duration::from_secs(value.saturating_mul(60)),
            "h" => Duration::from_secs(value.saturating_mul(3600)),
            "" => return Err(format!("{input:?}: missing unit (ms, s, m or h)")),
            other => return Err(format!("{input:?}: unknown unit {other:?} (ms, s, m or h)")),
        };
        total = total.saturating_add(part);
        rest = after;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse(" 0s "), Ok(Duration::ZERO));
    }

    #[test]
    fn rejects() {
        for bad in ["", "30", "s", "3x", "1.5s", "-1s", "99999999999999999999s"] {
            assert!(parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
