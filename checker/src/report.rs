//! What the checker found, for people (`Display`) and for the gate (serde).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::history::{Function, Mode, Operation, Outcome, format_token};

/// One operation as a violation names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpSummary {
    pub process: String,
    pub op: u64,
    pub f: Function,
    pub key: Option<String>,
    /// `None`: never completed.
    pub outcome: Option<Outcome>,
    pub token: Option<u64>,
    pub seq: Option<i64>,
    /// Milliseconds after the first event of the history.
    pub invoke_ms: f64,
    pub complete_ms: Option<f64>,
    /// The hold's kind (exclusive unless said).
    #[serde(default)]
    pub mode: Mode,
    /// A semaphore operation's slot.
    #[serde(default)]
    pub slot: Option<u32>,
}

impl OpSummary {
    pub(crate) fn new(o: &Operation, start: u64) -> Self {
        let ms = |t: u64| t.saturating_sub(start) as f64 / 1e6;
        OpSummary {
            process: o.process.clone(),
            op: o.op,
            f: o.f,
            key: o.key.clone(),
            outcome: o.outcome(),
            token: o.subject_token(),
            seq: o.seq(),
            invoke_ms: ms(o.invoke_time),
            complete_ms: o.complete_time().map(ms),
            mode: o.mode,
            slot: o.slot,
        }
    }
}

impl fmt::Display for OpSummary {
    /// `w2#17 acquire ok e1:r5512 [1203.4 ms, 1210.0 ms]`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{} {}", self.process, self.op, self.f)?;
        match (self.mode, self.slot) {
            (Mode::Shared, _) => f.write_str(" shared")?,
            (Mode::Semaphore, Some(n)) => write!(f, " slot {n}")?,
            (Mode::Semaphore, None) => f.write_str(" slot ?")?,
            (Mode::Exclusive, _) => {}
        }
        match self.outcome {
            Some(o) => write!(f, " {o}")?,
            None => f.write_str(" pending")?,
        }
        if let Some(t) = self.token {
            write!(f, " {}", format_token(t))?;
        }
        if let Some(s) = self.seq {
            write!(f, " seq {s}")?;
        }
        match self.complete_ms {
            Some(c) => write!(f, " [{:.1} ms, {:.1} ms]", self.invoke_ms, c),
            None => write!(f, " [{:.1} ms, never completed]", self.invoke_ms),
        }
    }
}

/// What kind of safety property failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ViolationKind {
    /// No order of the key's operations is legal for the lock model.
    NotLinearizable,
    /// A grant while another grant still held the key.
    DoubleGrant,
    /// Two grants on a key with one token.
    DuplicateToken,
    /// A later grant with a smaller token.
    TokenRegression,
    /// Accepted writes whose tokens do not go strictly up in the resource's
    /// commit order (a token accepted twice included), or an accepted write
    /// with an older or equal token after another one finished.
    StaleWriteAccepted,
    /// A refused write whose token was above every token the record could
    /// have been written with: the fence refused what it must accept.
    FreshWriteRefused,
    /// An accepted write whose token that process was never granted.
    UngrantedWriteToken,
    /// Two leaderships of an election whose terms do not rise with their
    /// tokens: one term given twice, or a later leadership (larger token)
    /// with a term not above an earlier one's.
    TermOrder,
    /// A semaphore grant named a slot outside `0..permits`.
    SlotOutOfRange,
    /// A guarded read accepted with token `t` although a write with a
    /// larger token had landed before it (committed earlier by the record's
    /// write count, or completed before the read was invoked): a reader
    /// whose hold a later writer had ended was told its read was current.
    StaleReadAccepted,
    /// A write with a token at or below an accepted guarded read's token
    /// landed after that read (by the record's write count, or invoked
    /// after the read completed): a stale writer changed the record under
    /// a reader the fence had told its read was current.
    StaleWriteAfterRead,
    /// A refused guarded read with no write above its token that could have
    /// landed before the refusal: the fence refused a read it must accept.
    FreshReadRefused,
    /// An accepted guarded read whose token that process was never granted.
    UngrantedReadToken,
}

impl fmt::Display for ViolationKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ViolationKind::NotLinearizable => "not linearizable",
            ViolationKind::DoubleGrant => "double grant",
            ViolationKind::DuplicateToken => "duplicate token",
            ViolationKind::TokenRegression => "token regression",
            ViolationKind::StaleWriteAccepted => "stale fenced write accepted",
            ViolationKind::FreshWriteRefused => "fenced write refused above the mark",
            ViolationKind::UngrantedWriteToken => "write with an ungranted token",
            ViolationKind::TermOrder => "election terms out of order",
            ViolationKind::SlotOutOfRange => "semaphore slot out of range",
            ViolationKind::StaleReadAccepted => "stale fenced read accepted",
            ViolationKind::StaleWriteAfterRead => "stale fenced write accepted after a read",
            ViolationKind::FreshReadRefused => "fenced read refused at or above the mark",
            ViolationKind::UngrantedReadToken => "read with an ungranted token",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Violation {
    pub kind: ViolationKind,
    pub key: String,
    /// Plain words: what is wrong.
    pub message: String,
    /// The operations involved.
    pub ops: Vec<OpSummary>,
    /// For `NotLinearizable`: the last operations of the longest legal
    /// prefix found for this key.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partial_linearization: Vec<OpSummary>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[{}] {}", self.kind, self.message)?;
        for o in &self.ops {
            writeln!(f, "    {o}")?;
        }
        if !self.partial_linearization.is_empty() {
            writeln!(f, "    longest linearizable prefix ends with:")?;
            for o in &self.partial_linearization {
                writeln!(f, "      {o}")?;
            }
        }
        Ok(())
    }
}

/// A key's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Linearizable,
    Violation,
    /// The search ran out of budget: neither pass nor fail.
    Inconclusive,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Linearizable => "linearizable",
            Verdict::Violation => "VIOLATION",
            Verdict::Inconclusive => "INCONCLUSIVE",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyReport {
    pub key: String,
    pub verdict: Verdict,
    /// Operations in this key's lock-model search (advances included).
    pub ops: usize,
    pub states_explored: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fault {
    pub name: String,
    pub at_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Every operation in the history.
    pub ops_checked: usize,
    pub keys_checked: usize,
    pub fault_count: usize,
    pub faults: Vec<Fault>,
    pub keys: Vec<KeyReport>,
    pub violations: Vec<Violation>,
    /// Things worth knowing that are not violations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

impl Report {
    /// True only when every key is linearizable and no check failed.
    /// An inconclusive key is not a pass.
    pub fn ok(&self) -> bool {
        self.violations.is_empty() && self.keys.iter().all(|k| k.verdict == Verdict::Linearizable)
    }

    pub fn inconclusive(&self) -> bool {
        self.violations.is_empty() && self.keys.iter().any(|k| k.verdict == Verdict::Inconclusive)
    }

    pub fn verdict_of(&self, key: &str) -> Option<Verdict> {
        self.keys.iter().find(|k| k.key == key).map(|k| k.verdict)
    }

    pub fn violations_of(&self, kind: ViolationKind) -> impl Iterator<Item = &Violation> {
        self.violations.iter().filter(move |v| v.kind == kind)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let headline = if self.ok() {
            "PASS"
        } else if self.inconclusive() {
            "INCONCLUSIVE"
        } else {
            "FAIL"
        };
        writeln!(
            f,
            "lock history check: {headline} ({} ops, {} keys, {} faults, {} violations)",
            self.ops_checked,
            self.keys_checked,
            self.fault_count,
            self.violations.len()
        )?;
        if !self.faults.is_empty() {
            // Grouped by name, in order of first occurrence.
            let mut grouped: Vec<(&str, usize)> = Vec::new();
            for x in &self.faults {
                match grouped.iter_mut().find(|(name, _)| *name == x.name) {
                    Some((_, n)) => *n += 1,
                    None => grouped.push((&x.name, 1)),
                }
            }
            let names: Vec<String> = grouped
                .iter()
                .map(|(name, n)| {
                    if *n == 1 {
                        (*name).to_string()
                    } else {
                        format!("{name} ×{n}")
                    }
                })
                .collect();
            writeln!(f, "  faults: {}", names.join(", "))?;
        }
        for k in &self.keys {
            writeln!(
                f,
                "  {}: {} ({} ops, {} states)",
                k.key, k.verdict, k.ops, k.states_explored
            )?;
        }
        for (n, v) in self.violations.iter().enumerate() {
            write!(f, "{}. {v}", n + 1)?;
        }
        for note in &self.notes {
            writeln!(f, "  note: {note}")?;
        }
        Ok(())
    }
}
