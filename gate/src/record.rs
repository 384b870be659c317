//! Writing the gate's history: one JSON line per invoke and per completion,
//! in the format `latchkey_checker` reads, stamped with `CLOCK_MONOTONIC` so
//! every process of a run shares one clock.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use nix::time::{ClockId, clock_gettime};
use serde_json::{Map, Value, json};

/// Nanoseconds on the machine-wide monotonic clock.
#[allow(clippy::expect_used)] // CLOCK_MONOTONIC cannot fail on Linux
pub fn mono_ns() -> u64 {
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC is always there");
    u64::try_from(ts.tv_sec()).unwrap_or(0) * 1_000_000_000
        + u64::try_from(ts.tv_nsec()).unwrap_or(0)
}

/// `instant` (a `std::time::Instant`, which is `CLOCK_MONOTONIC` on Linux) in
/// [`mono_ns`] terms.
pub fn mono_of(instant: Instant) -> u64 {
    let (now_ns, now) = (mono_ns(), Instant::now());
    if instant <= now {
        now_ns.saturating_sub(u64::try_from((now - instant).as_nanos()).unwrap_or(u64::MAX))
    } else {
        now_ns.saturating_add(u64::try_from((instant - now).as_nanos()).unwrap_or(u64::MAX))
    }
}

/// How an operation ended, as the checker reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Fail,
    Unknown,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Fail => "fail",
            Outcome::Unknown => "unknown",
        }
    }
}

/// Extra fields of an invoke or complete line.
#[derive(Debug, Default, Clone)]
pub struct Fields {
    pub key: Option<String>,
    pub token: Option<u64>,
    pub seq: Option<i64>,
    /// A leadership's term (an election's acquire ok).
    pub term: Option<u64>,
    pub detail: Option<String>,
    /// `shared` or `semaphore` (absent: exclusive).
    pub mode: Option<&'static str>,
    /// A semaphore acquire's permits.
    pub permits: Option<u32>,
    /// A semaphore slot (granted, or the one released, expired or written).
    pub slot: Option<u32>,
}

/// One process's history file. Every line is flushed as it is written, so a
/// SIGKILL loses at most the completion of the operation in flight, which
/// the checker then treats as unknown.
pub struct Recorder {
    process: String,
    next_op: u64,
    out: File,
}

impl Recorder {
    pub fn create(path: &Path, process: impl Into<String>) -> anyhow::Result<Self> {
        let out = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            process: process.into(),
            next_op: 1,
            out,
        })
    }

    pub fn process(&self) -> &str {
        &self.process
    }

    /// Records the invocation of `f`, stamped now; returns its op id.
    pub fn invoke(&mut self, f: &str, fields: Fields) -> anyhow::Result<u64> {
        self.invoke_at(f, fields, mono_ns())
    }

    /// Records an invocation with an explicit time (an `expire` is invoked at
    /// the holder's fence deadline, which may lie in the past).
    pub fn invoke_at(&mut self, f: &str, fields: Fields, time: u64) -> anyhow::Result<u64> {
        let op = self.next_op;
        self.next_op += 1;
        let mut line = json!({
            "type": "invoke",
            "process": self.process,
            "op": op,
            "f": f,
            "time": time,
        });
        add(&mut line, fields);
        self.write(&line)?;
        Ok(op)
    }

    pub fn complete(&mut self, op: u64, outcome: Outcome, fields: Fields) -> anyhow::Result<()> {
        let mut line = json!({
            "type": "complete",
            "process": self.process,
            "op": op,
            "outcome": outcome.as_str(),
            "time": mono_ns(),
        });
        add(&mut line, fields);
        self.write(&line)
    }

    fn write(&mut self, line: &Value) -> anyhow::Result<()> {
        let mut bytes = serde_json::to_vec(line)?;
        bytes.push(b'\n');
        self.out.write_all(&bytes)?;
        self.out.flush()?;
        Ok(())
    }
}

fn add(line: &mut Value, fields: Fields) {
    let Some(obj) = line.as_object_mut() else {
        return;
    };
    let mut extra = Map::new();
    if let Some(key) = fields.key {
        extra.insert("key".into(), key.into());
    }
    if let Some(token) = fields.token {
        extra.insert("token".into(), token.into());
    }
    if let Some(seq) = fields.seq {
        extra.insert("seq".into(), seq.into());
    }
    if let Some(term) = fields.term {
        extra.insert("term".into(), term.into());
    }
    if let Some(detail) = fields.detail {
        extra.insert("detail".into(), detail.into());
    }
    if let Some(mode) = fields.mode {
        extra.insert("mode".into(), mode.into());
    }
    if let Some(permits) = fields.permits {
        extra.insert("permits".into(), permits.into());
    }
    if let Some(slot) = fields.slot {
        extra.insert("slot".into(), slot.into());
    }
    obj.extend(extra);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_map_onto_the_monotonic_clock() {
        let now = Instant::now();
        let a = mono_of(now);
        let b = mono_ns();
        assert!(b >= a && b - a < 50_000_000, "{a} {b}");
        let later = mono_of(now + std::time::Duration::from_secs(3));
        assert!(later > b + 2_900_000_000);
    }

    #[test]
    fn lines_are_the_checker_format() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("h.jsonl");
        let mut r = Recorder::create(&path, "w1")?;
        let op = r.invoke(
            "acquire",
            Fields {
                key: Some("bench/gate/k0".into()),
                ..Fields::default()
            },
        )?;
        r.complete(
            op,
            Outcome::Ok,
            Fields {
                token: Some(7),
                ..Fields::default()
            },
        )?;
        let text = std::fs::read_to_string(&path)?;
        let lines: Vec<Value> = text
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        assert_eq!(lines[0]["type"], "invoke");
        assert_eq!(lines[0]["f"], "acquire");
        assert_eq!(lines[0]["key"], "bench/gate/k0");
        assert_eq!(lines[1]["type"], "complete");
        assert_eq!(lines[1]["op"], 1);
        assert_eq!(lines[1]["outcome"], "ok");
        assert_eq!(lines[1]["token"], 7);
        Ok(())
    }
}
