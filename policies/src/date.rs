//! A calendar date, just enough for waiver expiry: parse `YYYY-MM-DD`,
//! compare, and find today's date in UTC. The calendar itself is the `time`
//! crate's; this type keeps policy files' format and messages.

use std::fmt;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;

/// The Julian day number of 1970-01-01.
const UNIX_EPOCH_JULIAN_DAY: i64 = 2_440_588;

/// A proleptic Gregorian date between 0001-01-01 and 9999-12-31.
///
/// Ordering is chronological.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Date(time::Date);

/// Why a string or triple is not a date.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DateError {
    #[error("\"{input}\" is not a date: write it as YYYY-MM-DD, e.g. \"2027-06-30\"")]
    Format { input: String },

    #[error("{year:04}-{month:02}-{day:02} is not a date in the calendar: {reason}")]
    OutOfRange {
        year: u16,
        month: u8,
        day: u8,
        reason: &'static str,
    },
}

impl Date {
    pub fn new(year: u16, month: u8, day: u8) -> Result<Date, DateError> {
        let out_of_range = |reason| DateError::OutOfRange {
            year,
            month,
            day,
            reason,
        };
        if !(1..=9999).contains(&year) {
            return Err(out_of_range("the year must be between 0001 and 9999"));
        }
        let Ok(calendar_month) = time::Month::try_from(month) else {
            return Err(out_of_range("the month must be between 01 and 12"));
        };
        time::Date::from_calendar_date(i32::from(year), calendar_month, day)
            .map(Date)
            .map_err(|_| out_of_range("that month has fewer days"))
    }

    /// Parses exactly `YYYY-MM-DD`.
    pub fn parse(input: &str) -> Result<Date, DateError> {
        let format_error = || DateError::Format {
            input: crate::key::excerpt(input),
        };
        let bytes = input.as_bytes();
        let digits = |range: std::ops::Range<usize>| -> Option<u16> {
            let part = bytes.get(range)?;
            part.iter().try_fold(0u16, |acc, &b| {
                b.is_ascii_digit().then(|| acc * 10 + u16::from(b - b'0'))
            })
        };
        if bytes.len() != 10 || bytes.get(4) != Some(&b'-') || bytes.get(7) != Some(&b'-') {
            return Err(format_error());
        }
        let (Some(year), Some(month), Some(day)) = (digits(0..4), digits(5..7), digits(8..10))
        else {
            return Err(format_error());
        };
        // month and day are two digits, so they fit in u8.
        Date::new(year, month as u8, day as u8)
    }

    /// Today's date in UTC, from the system clock.
    ///
    /// Not available on `wasm32-unknown-unknown`, where `SystemTime::now`
    /// panics; there, take the time from the host and use
    /// [`Date::from_system_time`].
    #[cfg(not(all(target_arch = "wasm32", target_os = "unknown")))]
    pub fn today_utc() -> Date {
        Date::from_system_time(SystemTime::now())
    }

    /// The UTC calendar date containing `time`, clamped to the supported range.
    pub fn from_system_time(time: SystemTime) -> Date {
        let days = match time.duration_since(UNIX_EPOCH) {
            Ok(after) => (after.as_secs() / 86_400) as i64,
            // Before 1970: round towards the earlier day.
            Err(before) => {
                let d = before.duration();
                let whole = (d.as_secs() / 86_400) as i64;
                let partial = d.as_secs() % 86_400 != 0 || d.subsec_nanos() != 0;
                -(whole + i64::from(partial))
            }
        };
        Date::from_unix_days(days)
    }

    /// The date `days` days after 1970-01-01, clamped to 0001-01-01..=9999-12-31.
    pub fn from_unix_days(days: i64) -> Date {
        const MIN: Date = Date(calendar(1, time::Month::January, 1));
        const MAX: Date = Date(calendar(9999, time::Month::December, 31));
        let julian = days.saturating_add(UNIX_EPOCH_JULIAN_DAY);
        if julian <= i64::from(MIN.0.to_julian_day()) {
            return MIN;
        }
        if julian >= i64::from(MAX.0.to_julian_day()) {
            return MAX;
        }
        // In range, so the Julian day fits an i32 and is a valid date.
        i32::try_from(julian)
            .ok()
            .and_then(|j| time::Date::from_julian_day(j).ok())
            .map_or(MAX, Date)
    }

    /// Days since 1970-01-01 (negative before).
    pub const fn unix_days(&self) -> i64 {
        self.0.to_julian_day() as i64 - UNIX_EPOCH_JULIAN_DAY
    }

    pub fn year(&self) -> u16 {
        // 1..=9999 by construction.
        self.0.year() as u16
    }

    pub fn month(&self) -> u8 {
        u8::from(self.0.month())
    }

    pub fn day(&self) -> u8 {
        self.0.day()
    }
}

/// A date known to exist, in a const.
const fn calendar(year: i32, month: time::Month, day: u8) -> time::Date {
    match time::Date::from_calendar_date(year, month, day) {
        Ok(date) => date,
        Err(_) => time::Date::MIN,
    }
}

impl fmt::Display for Date {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02}",
            self.year(),
            self.month(),
            self.day()
        )
    }
}

impl FromStr for Date {
    type Err = DateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Date::parse(s)
    }
}

impl Serialize for Date {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Accepts a `"YYYY-MM-DD"` string, and also a bare TOML date
/// (`waiverExpires = 2027-06-30`), since both read naturally in a policy file.
impl<'de> Deserialize<'de> for Date {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DateVisitor;

        impl<'de> Visitor<'de> for DateVisitor {
            type Value = Date;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a date written as \"YYYY-MM-DD\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Date, E> {
                Date::parse(v).map_err(E::custom)
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Date, A::Error> {
                let datetime =
                    toml::value::Datetime::deserialize(de::value::MapAccessDeserializer::new(map))?;
                match datetime {
                    toml::value::Datetime {
                        date: Some(d),
                        time: None,
                        offset: None,
                    } => Date::new(d.year, d.month, d.day).map_err(de::Error::custom),
                    other => Err(de::Error::custom(format!(
                        "{other} is a date-time; write just the date, e.g. \"2027-06-30\""
                    ))),
                }
            }
        }

        deserializer.deserialize_any(DateVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_and_displays() {
        let d = Date::parse("2027-06-30").unwrap();
        assert_eq!((d.year(), d.month(), d.day()), (2027, 6, 30));
        assert_eq!(d.to_string(), "2027-06-30");
        assert_eq!(
            "0001-01-01".parse::<Date>().unwrap().to_string(),
            "0001-01-01"
        );
    }

    #[test]
    fn rejects_bad_formats() {
        for bad in [
            "",
            "2027-6-30",
            "2027/06/30",
            "27-06-30",
            "2027-06-30 ",
            "+027-06-30",
            "2027-0a-30",
            "２０２７-06-30",
            "2027-06-30T00:00:00",
        ] {
            assert!(
                matches!(Date::parse(bad), Err(DateError::Format { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn rejects_impossible_dates() {
        for bad in [
            "2027-02-29",
            "2027-13-01",
            "2027-00-10",
            "2027-04-31",
            "0000-01-01",
            "2027-01-00",
        ] {
            assert!(
                matches!(Date::parse(bad), Err(DateError::OutOfRange { .. })),
                "{bad:?}"
            );
        }
        assert!(Date::parse("2028-02-29").is_ok());
        assert!(Date::parse("2000-02-29").is_ok());
        assert!(Date::parse("1900-02-29").is_err());
    }

    #[test]
    fn orders_chronologically() {
        let a = Date::parse("2026-12-31").unwrap();
        let b = Date::parse("2027-01-01").unwrap();
        assert!(a < b);
    }

    #[test]
    fn civil_from_days_matches_known_dates() {
        assert_eq!(Date::from_unix_days(0).to_string(), "1970-01-01");
        assert_eq!(Date::from_unix_days(-1).to_string(), "1969-12-31");
        assert_eq!(Date::from_unix_days(11_016).to_string(), "2000-02-29");
        assert_eq!(Date::from_unix_days(19_723).to_string(), "2024-01-01");
        assert_eq!(Date::from_unix_days(20_634).to_string(), "2026-06-30");
        assert_eq!(Date::from_unix_days(i64::MIN).to_string(), "0001-01-01");
        assert_eq!(Date::from_unix_days(i64::MAX).to_string(), "9999-12-31");
    }

    #[test]
    fn days_round_trip_over_four_centuries() {
        let start = Date::parse("1900-01-01").unwrap().unix_days();
        let mut prev = Date::from_unix_days(start - 1);
        for days in start..start + 146_097 {
            let d = Date::from_unix_days(days);
            assert_eq!(d.unix_days(), days);
            assert!(prev < d);
            assert_eq!(Date::parse(&d.to_string()).unwrap(), d);
            prev = d;
        }
    }

    #[test]
    fn from_system_time_uses_utc_day_boundaries() {
        let at = |secs: u64| Date::from_system_time(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(86_399).to_string(), "1970-01-01");
        assert_eq!(at(86_400).to_string(), "1970-01-02");
        let before = |secs: u64| Date::from_system_time(UNIX_EPOCH - Duration::from_secs(secs));
        assert_eq!(before(1).to_string(), "1969-12-31");
        assert_eq!(before(86_400).to_string(), "1969-12-31");
        assert_eq!(before(86_401).to_string(), "1969-12-30");
        assert!(Date::today_utc() > Date::parse("2024-01-01").unwrap());
    }

    #[test]
    fn deserializes_quoted_and_bare_toml_dates() {
        #[derive(Debug, Deserialize)]
        struct Doc {
            d: Date,
        }
        let quoted: Doc = toml::from_str("d = \"2027-06-30\"").unwrap();
        let bare: Doc = toml::from_str("d = 2027-06-30").unwrap();
        assert_eq!(quoted.d, bare.d);
        let err = toml::from_str::<Doc>("d = 2027-06-30T10:00:00Z")
            .unwrap_err()
            .to_string();
        assert!(err.contains("write just the date"), "{err}");
        let err = toml::from_str::<Doc>("d = \"30/06/2027\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("YYYY-MM-DD"), "{err}");
        let err = toml::from_str::<Doc>("d = 20270630")
            .unwrap_err()
            .to_string();
        assert!(err.contains("YYYY-MM-DD"), "{err}");
    }
}
