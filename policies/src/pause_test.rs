//! Pause-test results: the evidence that lets a class be declared fenced
//! (ADR-01, ADR-17).
//!
//! The kit (`latchctl pause-test`) acquires a lock, writes, freezes the holder
//! past its TTL, lets a second holder acquire and write, resumes the first and
//! records whether its stale write was rejected. It writes one
//! [`PauseTestResult`] as JSON; the class names that file in
//! `[class.pauseTest]` ([`ClassPauseTest`]), and [`PolicySet::load_dir`]
//! refuses a fenced class unless the file is a passing, current result for
//! that class and resource. A claim of mutual exclusion is then backed by an
//! observed rejection, not by assertion.
//!
//! [`PolicySet::load_dir`]: crate::PolicySet::load_dir

use std::fmt;
use std::path::{Component, Path};
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::class::ClassError;
use crate::date::Date;
use crate::key;

/// The result format this release writes and reads.
pub const PAUSE_TEST_RESULT_VERSION: u32 = 1;

/// How long a passing result counts (ADR-17: results expire after a year).
pub const PAUSE_TEST_VALID_DAYS: u64 = 365;

/// How far in the future a result's `finishedAt` may be, for clock skew
/// between the machine that ran the kit and the one loading the policy.
pub const PAUSE_TEST_MAX_CLOCK_SKEW: Duration = Duration::from_secs(86_400);

const PAUSE_TEST_VALIDITY: Duration = Duration::from_secs(PAUSE_TEST_VALID_DAYS * 86_400);

/// `[class.pauseTest]` in a class file: where the class's pause-test result
/// is, and what it must have tested.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassPauseTest {
    /// The guarded resource, e.g. `"postgresql:ledger.postings"`; the result
    /// must name the same one.
    pub resource: String,
    /// Path of the result JSON, relative to the policy directory (the one
    /// holding `classes/` and `grants/`), e.g. `"pause-tests/demo.json"`.
    pub result: String,
    /// The resource's schema version; when given, the result must record the
    /// same `resourceSchemaVersion`, so a schema change asks for a new test.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<String>,
}

/// Whether `resource` (`<kind>:<name>`) names a store of adapter `kind`
/// (`postgres` is `postgresql`, `mariadb` is `mysql`).
pub fn resource_is_kind(resource: &str, kind: &str) -> bool {
    let named = resource
        .split_once(':')
        .map(|(k, _)| k.to_ascii_lowercase());
    let named = match named.as_deref() {
        Some("postgres") => "postgresql",
        Some("mariadb") => "mysql",
        Some(k) => k,
        None => return false,
    };
    named == kind
}

/// One run of the pause-test kit, as written to its result file.
///
/// ```json
/// {"version":1,"class":"payments-ledger","resource":"postgresql:ledger.postings",
///  "resourceSchemaVersion":"1",
///  "startedAt":"2026-11-30T06:10:00Z","finishedAt":"2026-11-30T06:10:21Z","outcome":"pass",
///  "kit":"latchctl 0.1.0 pause-test",
///  "evidence":{"ttlSeconds":10,"pausedForMs":12400,"firstWrite":"accepted",
///              "secondHolderWrite":"accepted","secondTokenGreater":true,
///              "staleWriteAfterResume":"rejected","finalRowFrom":"second-holder"},
///  "failure":null}
/// ```
///
/// Times are RFC 3339 in UTC; whole seconds print without a fraction, and
/// any fraction is kept, so parsing what [`PauseTestResult::to_json_pretty`]
/// wrote gives back an equal value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PauseTestResult {
    /// [`PAUSE_TEST_RESULT_VERSION`].
    pub version: u32,
    /// The lock class the kit locked with.
    pub class: String,
    /// The resource written to, e.g. `"postgresql:ledger.postings"`.
    pub resource: String,
    /// The resource's schema version at the time of the test, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_schema_version: Option<String>,
    #[serde(with = "rfc3339")]
    pub started_at: SystemTime,
    #[serde(with = "rfc3339")]
    pub finished_at: SystemTime,
    pub outcome: PauseTestOutcome,
    /// Which kit wrote this, with its version, e.g. `"latchctl 0.1.0 pause-test"`.
    pub kit: String,
    pub evidence: PauseTestEvidence,
    /// Why the test failed, in words; `None` on a pass.
    pub failure: Option<String>,
    /// The store a fence adapter wrote to (`--resource-url`), when the kit
    /// used one: which adapter, where (without credentials), and what the
    /// store's setup means for the fence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<PauseTestStore>,
}

/// The store behind a pause test run through a fence adapter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PauseTestStore {
    /// The adapter's kind: `postgresql`, `mysql`, `redis`, `etcd`, `s3`.
    pub kind: String,
    /// Where it is, e.g. `redis://10.0.0.5:6379/0`: the URL without its
    /// user, password or query (an S3 URL keeps its endpoint).
    pub locator: String,
    /// What the store's setup means for the fence (e.g. Redis's
    /// asynchronous replication), in words.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caveats: Vec<String>,
}

/// What the kit observed, step by step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PauseTestEvidence {
    /// The TTL of the lock the kit held.
    pub ttl_seconds: u32,
    /// How long the first holder was frozen (must exceed the TTL).
    pub paused_for_ms: u64,
    /// The first holder's write before it was frozen.
    pub first_write: WriteOutcome,
    /// The second holder's write, after the first holder's lease expired.
    pub second_holder_write: WriteOutcome,
    /// Whether the second holder's fencing token was greater than the first's.
    pub second_token_greater: bool,
    /// The first holder's write after it was resumed: the fence must reject it.
    pub stale_write_after_resume: WriteOutcome,
    /// Whose write the resource holds at the end, e.g. `"second-holder"`.
    pub final_row_from: String,
    /// An election class's kit only: what the arbiter did with the frozen
    /// leader's Proclaim after it resumed (`rejected`: `NOT_LEADER`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stale_proclaim_after_resume: Option<WriteOutcome>,
}

/// Whether the kit's assertions held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseTestOutcome {
    Pass,
    Fail,
}

/// What the resource did with one write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteOutcome {
    Accepted,
    /// Refused by the fence (the only answer that proves a stale write is stopped).
    Rejected,
    /// Failed for another reason (connection, syntax, ...).
    Error,
}

impl fmt::Display for PauseTestOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PauseTestOutcome::Pass => "pass",
            PauseTestOutcome::Fail => "fail",
        })
    }
}

impl fmt::Display for WriteOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WriteOutcome::Accepted => "accepted",
            WriteOutcome::Rejected => "rejected",
            WriteOutcome::Error => "error",
        })
    }
}

impl PauseTestResult {
    /// Parses a result file's text.
    pub fn from_json(text: &str) -> Result<PauseTestResult, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Parses a result from bytes (a file read without decoding it first).
    pub fn from_json_slice(bytes: &[u8]) -> Result<PauseTestResult, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// The result as indented JSON, as the kit writes it (no trailing newline).
    ///
    /// Fails only for a time before 1970 or after 9999.
    pub fn to_json_pretty(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    pub fn passed(&self) -> bool {
        self.outcome == PauseTestOutcome::Pass
    }

    /// When the result stops counting: [`PAUSE_TEST_VALID_DAYS`] after `finishedAt`.
    pub fn expires_at(&self) -> SystemTime {
        self.finished_at
            .checked_add(PAUSE_TEST_VALIDITY)
            .unwrap_or(self.finished_at)
    }

    /// Whether this result lets `class` be declared fenced with `spec` at
    /// `now`; the first rule broken otherwise. `result` is the file's path as
    /// written in `spec`, for the message. The file must exist and parse
    /// before this question arises; [`PolicySet::load_dir`] checks that too.
    ///
    /// [`PolicySet::load_dir`]: crate::PolicySet::load_dir
    pub fn check(
        &self,
        class: &str,
        spec: &ClassPauseTest,
        now: SystemTime,
    ) -> Result<(), PauseTestError> {
        let result = || spec.result.clone();
        if self.version != PAUSE_TEST_RESULT_VERSION {
            return Err(PauseTestError::Version {
                result: result(),
                found: self.version,
            });
        }
        if self.class != class {
            return Err(PauseTestError::WrongClass {
                result: result(),
                found: key::excerpt(&self.class),
            });
        }
        if self.resource != spec.resource {
            return Err(PauseTestError::WrongResource {
                result: result(),
                found: key::excerpt(&self.resource),
                declared: key::excerpt(&spec.resource),
            });
        }
        // A result that names the store it proved must have proved a store
        // of the resource's kind (`redis:ledger` from a Redis fence).
        if let Some(store) = &self.store
            && !resource_is_kind(&self.resource, &store.kind)
        {
            return Err(PauseTestError::WrongStore {
                result: result(),
                kind: key::excerpt(&store.kind),
                resource: key::excerpt(&self.resource),
            });
        }
        if self.outcome != PauseTestOutcome::Pass {
            return Err(PauseTestError::Failed {
                result: result(),
                finished: timestamp(self.finished_at),
                failure: self
                    .failure
                    .as_deref()
                    .map_or_else(|| "no reason recorded".to_string(), key::excerpt),
            });
        }
        // A pass is an observed rejection (ADR-17); anything else is a kit bug.
        if self.evidence.stale_write_after_resume != WriteOutcome::Rejected {
            return Err(PauseTestError::PassWithoutRejection {
                result: result(),
                stale: self.evidence.stale_write_after_resume,
            });
        }
        if let Some(declared) = &spec.schema_version
            && self.resource_schema_version.as_ref() != Some(declared)
        {
            return Err(PauseTestError::SchemaMismatch {
                result: result(),
                declared: key::excerpt(declared),
                found: self.resource_schema_version.as_deref().map(key::excerpt),
            });
        }
        let latest = now.checked_add(PAUSE_TEST_MAX_CLOCK_SKEW);
        if latest.is_some_and(|latest| self.finished_at > latest) {
            return Err(PauseTestError::FromTheFuture {
                result: result(),
                finished: timestamp(self.finished_at),
                now: timestamp(now),
            });
        }
        let expires = self.expires_at();
        if expires < now {
            return Err(PauseTestError::Expired {
                passed: Date::from_system_time(self.finished_at),
                expired: Date::from_system_time(expires),
            });
        }
        Ok(())
    }
}

impl FromStr for PauseTestResult {
    type Err = serde_json::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        PauseTestResult::from_json(s)
    }
}

/// Why a fenced class's pause-test result does not count. Wrapped in
/// [`ClassError::NoPassingPauseTest`], which adds the class, the kit command
/// to run and the alternative.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PauseTestError {
    #[error("{result} does not exist")]
    Missing { result: String },

    #[error("{result} proved a {kind} store, but its resource \"{resource}\" is not one")]
    WrongStore {
        result: String,
        kind: String,
        resource: String,
    },

    #[error("cannot read {result}: {reason}")]
    Unreadable { result: String, reason: String },

    #[error("{result} is not a pause-test result ({reason})")]
    Unparsable { result: String, reason: String },

    #[error(
        "{result} has result version {found}; this release reads version {current}",
        current = PAUSE_TEST_RESULT_VERSION
    )]
    Version { result: String, found: u32 },

    #[error("{result} is the result for class \"{found}\", not this one")]
    WrongClass { result: String, found: String },

    #[error("{result} tested resource \"{found}\", but [class.pauseTest] names \"{declared}\"")]
    WrongResource {
        result: String,
        found: String,
        declared: String,
    },

    #[error("the pause test in {result} failed at {finished}: {failure}")]
    Failed {
        result: String,
        finished: String,
        failure: String,
    },

    #[error(
        "{result} says pass, but the stale write after resume was {stale}: a pass needs the \
         fence to have rejected it"
    )]
    PassWithoutRejection { result: String, stale: WriteOutcome },

    #[error(
        "{result} was run against resource schema version {}, but [class.pauseTest] declares \
         schemaVersion = \"{declared}\": the schema changed since the test",
        found.as_ref().map_or_else(|| "(none recorded)".to_string(), |v| format!("\"{v}\""))
    )]
    SchemaMismatch {
        result: String,
        declared: String,
        found: Option<String>,
    },

    #[error(
        "the pause test passed on {passed} and expired on {expired} (results last {days} days), \
         so it must be run again",
        days = PAUSE_TEST_VALID_DAYS
    )]
    Expired { passed: Date, expired: Date },

    #[error(
        "{result} finished at {finished}, more than a day after now ({now}): check the clock \
         of the machine that ran the kit"
    )]
    FromTheFuture {
        result: String,
        finished: String,
        now: String,
    },
}

impl ClassPauseTest {
    /// Syntax only: any class may carry the block (an advisory class whose
    /// owner is working towards fencing); only a fenced class's result is read.
    pub(crate) fn check(&self) -> Result<(), ClassError> {
        let printable = |s: &str| !s.trim().is_empty() && s.chars().all(key::is_printable);
        if !printable(&self.resource) {
            return Err(ClassError::PauseTestField {
                field: "resource",
                rule: "must name the guarded resource in printable text, e.g. \
                       \"postgresql:ledger.postings\"",
            });
        }
        let path = Path::new(&self.result);
        let inside = path
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        if !printable(&self.result) || !inside || !self.result.ends_with(".json") {
            return Err(ClassError::PauseTestField {
                field: "result",
                rule: "must be a .json path inside the policy directory, relative to it, e.g. \
                       \"pause-tests/payments-ledger.json\"",
            });
        }
        if let Some(version) = &self.schema_version
            && !printable(version)
        {
            return Err(ClassError::PauseTestField {
                field: "schemaVersion",
                rule: "must be printable text, e.g. \"1\"",
            });
        }
        Ok(())
    }
}

/// The kit command that produces `class`'s result, for refusal messages.
/// `out` is where the result should go.
/// An election class's kit campaigns (`--election`, the key an election).
pub(crate) fn kit_command(
    class: &str,
    election: bool,
    resource: Option<&str>,
    out: &Path,
) -> String {
    format!(
        "latchctl pause-test <{}> --class {}{} --resource {} --postgres <CONNINFO> --out {}",
        if election { "ELECTION" } else { "KEY" },
        key::excerpt(class),
        if election { " --election" } else { "" },
        resource.map_or_else(|| "<kind>:<name>".to_string(), key::excerpt),
        out.display()
    )
}

/// Reads and checks `class`'s result under `policy_dir`.
pub(crate) fn verify(
    class: &str,
    spec: &ClassPauseTest,
    policy_dir: &Path,
    now: SystemTime,
) -> Result<(), PauseTestError> {
    let path = policy_dir.join(&spec.result);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(PauseTestError::Missing {
                result: spec.result.clone(),
            });
        }
        Err(e) => {
            return Err(PauseTestError::Unreadable {
                result: spec.result.clone(),
                reason: e.to_string(),
            });
        }
    };
    let parsed =
        PauseTestResult::from_json_slice(&bytes).map_err(|e| PauseTestError::Unparsable {
            result: spec.result.clone(),
            reason: e.to_string(),
        })?;
    parsed.check(class, spec, now)
}

/// RFC 3339 UTC with whole seconds, for messages.
fn timestamp(time: SystemTime) -> String {
    use fmt::Write;
    let mut out = String::new();
    match write!(out, "{}", humantime::format_rfc3339_seconds(time)) {
        Ok(()) => out,
        Err(_) => "(a time outside 1970..9999)".to_string(),
    }
}

/// Serde helpers for `SystemTime` as an RFC 3339 UTC string (`...Z`).
pub mod rfc3339 {
    use std::fmt::Write;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use serde::{Deserialize, Deserializer, Serializer, de, ser};

    /// 10000-01-01T00:00:00Z: humantime cannot format from here on.
    const END_OF_9999: Duration = Duration::from_secs(253_402_300_800);

    pub fn serialize<S: Serializer>(time: &SystemTime, serializer: S) -> Result<S::Ok, S::Error> {
        let in_range = time
            .duration_since(UNIX_EPOCH)
            .is_ok_and(|since| since < END_OF_9999);
        if !in_range {
            return Err(ser::Error::custom(
                "a timestamp must be between 1970 and 9999 to be written in RFC 3339",
            ));
        }
        let mut text = String::new();
        write!(text, "{}", humantime::format_rfc3339(*time)).map_err(ser::Error::custom)?;
        serializer.serialize_str(&text)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<SystemTime, D::Error> {
        let text = String::deserialize(deserializer)?;
        humantime::parse_rfc3339(&text).map_err(|e| {
            de::Error::custom(format!(
                "{:?} is not an RFC 3339 UTC timestamp like \"2026-11-30T06:10:21Z\" ({e})",
                crate::key::excerpt(&text)
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{"version":1,"class":"payments-ledger","resource":"postgresql:ledger.postings","resourceSchemaVersion":"1",
 "startedAt":"2026-11-30T06:10:00Z","finishedAt":"2026-11-30T06:10:21Z","outcome":"pass",
 "kit":"latchctl 0.1.0 pause-test",
 "evidence":{"ttlSeconds":10,"pausedForMs":12400,"firstWrite":"accepted","secondHolderWrite":"accepted","secondTokenGreater":true,"staleWriteAfterResume":"rejected","finalRowFrom":"second-holder"},
 "failure":null}"#;

    fn at(text: &str) -> SystemTime {
        humantime::parse_rfc3339(text).unwrap()
    }

    fn spec() -> ClassPauseTest {
        ClassPauseTest {
            resource: "postgresql:ledger.postings".into(),
            result: "pause-tests/payments-ledger.json".into(),
            schema_version: None,
        }
    }

    #[test]
    fn the_fixed_shape_parses_and_round_trips() {
        let r = PauseTestResult::from_json(EXAMPLE).unwrap();
        assert_eq!(r.version, 1);
        assert_eq!(r.class, "payments-ledger");
        assert_eq!(r.resource_schema_version.as_deref(), Some("1"));
        assert_eq!(r.started_at, at("2026-11-30T06:10:00Z"));
        assert_eq!(r.finished_at, at("2026-11-30T06:10:21Z"));
        assert_eq!(r.outcome, PauseTestOutcome::Pass);
        assert_eq!(r.evidence.paused_for_ms, 12_400);
        assert_eq!(r.evidence.stale_write_after_resume, WriteOutcome::Rejected);
        assert_eq!(r.evidence.final_row_from, "second-holder");
        assert_eq!(r.failure, None);

        let json = r.to_json_pretty().unwrap();
        assert!(
            json.contains("\"finishedAt\": \"2026-11-30T06:10:21Z\""),
            "{json}"
        );
        assert!(json.contains("\"failure\": null"), "{json}");
        assert!(
            json.contains("\"staleWriteAfterResume\": \"rejected\""),
            "{json}"
        );
        assert_eq!(json.parse::<PauseTestResult>().unwrap(), r);

        let compact: serde_json::Value = serde_json::to_value(&r).unwrap();
        let original: serde_json::Value = serde_json::from_str(EXAMPLE).unwrap();
        assert_eq!(compact, original);
    }

    #[test]
    fn optional_fields_and_sub_second_times() {
        let mut r = PauseTestResult::from_json(EXAMPLE).unwrap();
        r.resource_schema_version = None;
        r.finished_at += Duration::from_nanos(123_456_789);
        r.outcome = PauseTestOutcome::Fail;
        r.failure = Some("stale write accepted".into());
        let json = r.to_json_pretty().unwrap();
        assert!(!json.contains("resourceSchemaVersion"), "{json}");
        assert!(json.contains("06:10:21.123456789Z"), "{json}");
        assert!(json.contains("\"outcome\": \"fail\""), "{json}");
        assert_eq!(PauseTestResult::from_json(&json).unwrap(), r);
    }

    #[test]
    fn unknown_fields_bad_times_and_values_are_refused() {
        let err = PauseTestResult::from_json(&EXAMPLE.replace("\"kit\"", "\"kitt\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `kitt`"), "{err}");
        let err = PauseTestResult::from_json(
            &EXAMPLE.replace("2026-11-30T06:10:21Z", "2026-11-30 06:10:21+01:00"),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("is not an RFC 3339 UTC timestamp"), "{err}");
        let err = PauseTestResult::from_json(&EXAMPLE.replace("\"pass\"", "\"PASS\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown variant `PASS`"), "{err}");
        let err = PauseTestResult::from_json(&EXAMPLE.replace("\"rejected\"", "\"refused\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown variant `refused`"), "{err}");

        let mut r = PauseTestResult::from_json(EXAMPLE).unwrap();
        r.started_at = SystemTime::UNIX_EPOCH - Duration::from_secs(1);
        assert!(r.to_json_pretty().is_err());
    }

    #[test]
    fn check_accepts_a_current_pass_and_times_out_after_a_year() {
        let r = PauseTestResult::from_json(EXAMPLE).unwrap();
        let finished = r.finished_at;
        let day = Duration::from_secs(86_400);
        r.check("payments-ledger", &spec(), finished).unwrap();
        r.check("payments-ledger", &spec(), finished + 365 * day)
            .unwrap();
        r.check("payments-ledger", &spec(), finished - day).unwrap();
        assert_eq!(
            r.check("payments-ledger", &spec(), finished + 366 * day),
            Err(PauseTestError::Expired {
                passed: Date::parse("2026-11-30").unwrap(),
                expired: Date::parse("2027-11-30").unwrap(),
            })
        );
        assert!(matches!(
            r.check(
                "payments-ledger",
                &spec(),
                finished - day - Duration::from_secs(1)
            ),
            Err(PauseTestError::FromTheFuture { .. })
        ));
        assert_eq!(r.expires_at(), finished + 365 * day);
    }

    #[test]
    fn a_result_must_have_proved_a_store_of_its_resources_kind() {
        let mut r = PauseTestResult::from_json(EXAMPLE).unwrap();
        r.store = Some(PauseTestStore {
            kind: "postgresql".into(),
            locator: "postgresql://db/ledger".into(),
            caveats: vec![],
        });
        r.check("payments-ledger", &spec(), r.finished_at).unwrap();
        r.store.as_mut().unwrap().kind = "redis".into();
        let err = r
            .check("payments-ledger", &spec(), r.finished_at)
            .unwrap_err();
        assert!(matches!(err, PauseTestError::WrongStore { .. }), "{err}");
        assert!(resource_is_kind("mariadb:ledger.t", "mysql"));
        assert!(resource_is_kind("postgres:x", "postgresql"));
        assert!(!resource_is_kind("ledger", "postgresql"));
    }

    #[test]
    fn a_pass_must_show_the_rejection() {
        let mut r = PauseTestResult::from_json(EXAMPLE).unwrap();
        r.evidence.stale_write_after_resume = WriteOutcome::Accepted;
        let err = r
            .check("payments-ledger", &spec(), r.finished_at)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "pause-tests/payments-ledger.json says pass, but the stale write after resume was \
             accepted: a pass needs the fence to have rejected it"
        );
    }

    #[test]
    fn block_syntax() {
        spec().check().unwrap();
        let bad = |f: fn(&mut ClassPauseTest)| {
            let mut s = spec();
            f(&mut s);
            match s.check() {
                Err(ClassError::PauseTestField { field, .. }) => field,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(bad(|s| s.resource = " ".into()), "resource");
        assert_eq!(bad(|s| s.result = "/etc/result.json".into()), "result");
        assert_eq!(bad(|s| s.result = "../other/result.json".into()), "result");
        assert_eq!(bad(|s| s.result = "pause-tests/x.toml".into()), "result");
        assert_eq!(bad(|s| s.schema_version = Some("".into())), "schemaVersion");
        let err = toml::from_str::<ClassPauseTest>("resource = \"a:b\"\nresults = \"x.json\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `results`"), "{err}");
    }
}
