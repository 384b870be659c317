//! Durations as people type them: `500ms`, `30s`, `2m`, `1h`, `1m30s`
//! (humantime's syntax, which also takes `1h 30m`, `2min` and `7d`).

use std::time::Duration;

pub fn parse(input: &str) -> Result<Duration, String> {
    let text = input.trim();
    if text.is_empty() {
        return Err("empty duration; use e.g. 500ms, 30s or 2m".into());
    }
    // Whole numbers only: humantime would take `1.5s`, which reads as a
    // precision the arbiter's seconds do not have.
    if let Some(c) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == ' '))
    {
        return Err(format!(
            "{input:?}: unexpected {c:?}; use whole numbers with units, e.g. 500ms, 30s or 1m30s"
        ));
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("{input:?}: {e}; use e.g. 500ms, 30s, 2m or 1m30s"))
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
