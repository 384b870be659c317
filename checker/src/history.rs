//! The recorded history: JSON lines in and out, paired into operations.
//!
//! The gate writes one `invoke` line when an operation starts and one
//! `complete` line when its outcome is known; an invoke with no complete is
//! pending forever (outcome unknown). A `(process, op)` pair names an
//! operation.

use std::collections::HashMap;
use std::fmt;
use std::io::{self, BufRead, Write};

use serde::{Deserialize, Serialize};

/// Bits of a fencing token that hold the etcd revision (ADR-02): the
/// layout's one definition, `latchkey_records::token`.
pub use latchkey_records::token::REVISION_BITS;
use latchkey_records::token::{pack, unpack};

/// Packs a fencing token, `epoch × 2^48 + revision`, as the arbiter does
/// (`latchkey_records::token::pack`). A pair no arbiter could grant (epoch
/// 0 or at least 2^15, revision 0 or at least 2^48) is 0, which no grant
/// carries: never another pair's token.
pub fn token(epoch: u32, revision: u64) -> u64 {
    i64::try_from(revision)
        .ok()
        .and_then(|revision| pack(epoch, revision))
        .unwrap_or(0)
}

/// A token as people read it: `e<epoch>:r<revision>`. Any u64 reads (a
/// history may carry anything): its top 16 bits are the epoch.
pub fn format_token(token: u64) -> String {
    let (epoch, revision) = unpack(token);
    format!("e{epoch}:r{revision}")
}

/// What an operation does (`f` in the history).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Function {
    Acquire,
    Release,
    Expire,
    Write,
    /// A shared holder's guarded read through the reference fence (its
    /// token on the invoke; on an `ok`, `seq` is the record's write count
    /// it saw, 0 before any write; `fail` is the fence's refusal: a write
    /// with a larger token had landed). Histories before fenced reads have
    /// none.
    Read,
    Advance,
    Fault,
}

impl Function {
    /// Whether the operation concerns one key (advance and fault do not).
    pub fn needs_key(self) -> bool {
        matches!(
            self,
            Function::Acquire
                | Function::Release
                | Function::Expire
                | Function::Write
                | Function::Read
        )
    }
}

impl fmt::Display for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Function::Acquire => "acquire",
            Function::Release => "release",
            Function::Expire => "expire",
            Function::Write => "write",
            Function::Read => "read",
            Function::Advance => "advance",
            Function::Fault => "fault",
        })
    }
}

/// How an operation ended, as its client saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Ok,
    Fail,
    Unknown,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Ok => "ok",
            Outcome::Fail => "fail",
            Outcome::Unknown => "unknown",
        })
    }
}

/// What kind of hold an acquire asks for (`mode` in the history; absent
/// means exclusive). A key is used in one family only: exclusive and shared
/// holds of a lock, or the slots of a semaphore.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// One holder, nothing beside it.
    #[default]
    Exclusive,
    /// Many shared holders (one per process), never beside an exclusive.
    Shared,
    /// One of a semaphore's `permits` slots: at most `permits` holders,
    /// one per slot.
    Semaphore,
}

impl Mode {
    fn is_exclusive(&self) -> bool {
        *self == Mode::Exclusive
    }
}

/// One line of the JSONL history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Event {
    Invoke {
        process: String,
        op: u64,
        f: Function,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        time: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
        /// The hold's kind (acquire, release, expire, write).
        #[serde(default, skip_serializing_if = "Mode::is_exclusive")]
        mode: Mode,
        /// A semaphore's permits (its acquires).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        permits: Option<u32>,
        /// The slot a semaphore release, expire or write is about.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slot: Option<u32>,
    },
    Complete {
        process: String,
        op: u64,
        outcome: Outcome,
        time: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        seq: Option<i64>,
        /// The term of a leadership (an election's acquire ok: a Campaign).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        term: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
        /// The slot a semaphore acquire ok was granted.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        slot: Option<u32>,
    },
}

/// The complete line of an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub outcome: Outcome,
    pub time: u64,
    /// The grant's token on an acquire ok.
    pub token: Option<u64>,
    /// The resource's commit sequence number of an accepted write; of an
    /// accepted guarded read, the record's write count it saw.
    pub seq: Option<i64>,
    /// An election's acquire ok (a Campaign's leadership): its term.
    #[serde(default)]
    pub term: Option<u64>,
    pub detail: Option<String>,
}

/// An invoke paired with its complete (if any).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Operation {
    pub process: String,
    pub op: u64,
    pub f: Function,
    pub key: Option<String>,
    /// The token on the invoke (release, expire, write).
    pub token: Option<u64>,
    pub detail: Option<String>,
    pub invoke_time: u64,
    /// `None`: pending forever, which counts as outcome unknown.
    pub completion: Option<Completion>,
    /// The hold's kind.
    #[serde(default)]
    pub mode: Mode,
    /// A semaphore acquire's permits.
    #[serde(default)]
    pub permits: Option<u32>,
    /// The semaphore slot: granted (acquire ok) or named (release, expire,
    /// write).
    #[serde(default)]
    pub slot: Option<u32>,
}

impl Operation {
    /// The outcome; `None` when the operation never completed.
    pub fn outcome(&self) -> Option<Outcome> {
        self.completion.as_ref().map(|c| c.outcome)
    }

    pub fn is_ok(&self) -> bool {
        self.outcome() == Some(Outcome::Ok)
    }

    pub fn complete_time(&self) -> Option<u64> {
        self.completion.as_ref().map(|c| c.time)
    }

    /// The token this operation is about: the granted token for an acquire,
    /// the invoke's token otherwise.
    pub fn subject_token(&self) -> Option<u64> {
        match self.f {
            Function::Acquire => self.completion.as_ref().and_then(|c| c.token),
            _ => self.token,
        }
    }

    pub fn seq(&self) -> Option<i64> {
        self.completion.as_ref().and_then(|c| c.seq)
    }
}

/// A whole run: every operation, in the order of their invoke lines.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    ops: Vec<Operation>,
}

/// Why a history could not be read. Every variant names the 1-based line.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("line {line}: cannot read the history: {source}")]
    Read {
        line: usize,
        #[source]
        source: io::Error,
    },
    #[error("line {line}, column {column}: {message}")]
    Malformed {
        line: usize,
        column: usize,
        /// serde_json's message without its position within the line.
        message: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("line {line}: complete for {process}#{op} without its invoke")]
    CompleteWithoutInvoke {
        line: usize,
        process: String,
        op: u64,
    },
    #[error("line {line}: {process}#{op} invoked again (first invoked on line {first_line})")]
    DuplicateInvoke {
        line: usize,
        first_line: usize,
        process: String,
        op: u64,
    },
    #[error("line {line}: {process}#{op} completed again (first completed on line {first_line})")]
    DuplicateComplete {
        line: usize,
        first_line: usize,
        process: String,
        op: u64,
    },
    #[error(
        "line {line}: {process}#{op} ({f}) was invoked after {process}#{unknown_op} \
         (line {unknown_line}, {unknown_f}) ended with an unknown outcome; a gate worker \
         records only an expire after an unknown acquire or release and exits, and the \
         checker's search relies on that (docs/release-gate.md, \"The history\"): refusing \
         to judge this history"
    )]
    ActedAfterUnknown {
        line: usize,
        process: String,
        op: u64,
        f: Function,
        unknown_line: usize,
        unknown_op: u64,
        unknown_f: Function,
    },
    #[error("line {line}: {process}#{op}: {problem}")]
    Invalid {
        line: usize,
        process: String,
        op: u64,
        problem: String,
    },
}

impl ParseError {
    /// The 1-based line the error is about.
    pub fn line(&self) -> usize {
        match self {
            ParseError::Read { line, .. }
            | ParseError::Malformed { line, .. }
            | ParseError::CompleteWithoutInvoke { line, .. }
            | ParseError::DuplicateInvoke { line, .. }
            | ParseError::DuplicateComplete { line, .. }
            | ParseError::ActedAfterUnknown { line, .. }
            | ParseError::Invalid { line, .. } => *line,
        }
    }
}

impl History {
    /// A history from operations already paired (kept in the given order).
    pub fn from_ops(ops: Vec<Operation>) -> Self {
        History { ops }
    }

    pub fn ops(&self) -> &[Operation] {
        &self.ops
    }

    /// Mutable access, for tests that corrupt a valid history.
    pub fn ops_mut(&mut self) -> &mut Vec<Operation> {
        &mut self.ops
    }

    pub fn builder() -> HistoryBuilder {
        HistoryBuilder::default()
    }

    /// The earliest time in the history (reports show times relative to it).
    pub fn start_time(&self) -> u64 {
        self.ops.iter().map(|o| o.invoke_time).min().unwrap_or(0)
    }

    /// Reads JSON lines. Blank lines are skipped; unknown fields are ignored
    /// so the gate can add fields without breaking older checkers. A history
    /// whose process goes on after an unknown acquire or release (anything
    /// but an `expire`) is refused: the search assumes it never does.
    /// Histories made with [`HistoryBuilder`] are not held to that; their
    /// author is.
    pub fn from_jsonl<R: BufRead>(reader: R) -> Result<History, ParseError> {
        let mut ops: Vec<Operation> = Vec::new();
        // (process, op) -> (index into ops, invoke line, complete line)
        let mut index: HashMap<(String, u64), (usize, usize, Option<usize>)> = HashMap::new();
        let mut invoke_lines: Vec<usize> = Vec::new();
        for (i, line) in reader.lines().enumerate() {
            let line_no = i + 1;
            let text = line.map_err(|source| ParseError::Read {
                line: line_no,
                source,
            })?;
            if text.trim().is_empty() {
                continue;
            }
            let event: Event = serde_json::from_str(&text).map_err(|e| malformed(line_no, e))?;
            match event {
                Event::Invoke {
                    process,
                    op,
                    f,
                    key,
                    time,
                    token,
                    detail,
                    mode,
                    permits,
                    slot,
                } => {
                    if let Some((_, first_line, _)) = index.get(&(process.clone(), op)) {
                        return Err(ParseError::DuplicateInvoke {
                            line: line_no,
                            first_line: *first_line,
                            process,
                            op,
                        });
                    }
                    if f == Function::Acquire && slot.is_some() {
                        return Err(ParseError::Invalid {
                            line: line_no,
                            process,
                            op,
                            problem: "an acquire names its slot on the invoke line; the slot \
                                      comes with the grant (the complete line)"
                                .to_string(),
                        });
                    }
                    if mode == Mode::Semaphore
                        && f == Function::Acquire
                        && permits.is_none_or(|n| n == 0)
                    {
                        return Err(ParseError::Invalid {
                            line: line_no,
                            process,
                            op,
                            problem: "a semaphore acquire without its permits".to_string(),
                        });
                    }
                    if f.needs_key() && key.is_none() {
                        return Err(ParseError::Invalid {
                            line: line_no,
                            process,
                            op,
                            problem: format!("{f} without a key"),
                        });
                    }
                    index.insert((process.clone(), op), (ops.len(), line_no, None));
                    invoke_lines.push(line_no);
                    ops.push(Operation {
                        process,
                        op,
                        f,
                        key,
                        token,
                        detail,
                        invoke_time: time,
                        completion: None,
                        mode,
                        permits,
                        slot,
                    });
                }
                Event::Complete {
                    process,
                    op,
                    outcome,
                    time,
                    token,
                    seq,
                    term,
                    detail,
                    slot,
                } => {
                    let Some(entry) = index.get_mut(&(process.clone(), op)) else {
                        return Err(ParseError::CompleteWithoutInvoke {
                            line: line_no,
                            process,
                            op,
                        });
                    };
                    if let Some(first_line) = entry.2 {
                        return Err(ParseError::DuplicateComplete {
                            line: line_no,
                            first_line,
                            process,
                            op,
                        });
                    }
                    entry.2 = Some(line_no);
                    let invalid = |problem: String| ParseError::Invalid {
                        line: line_no,
                        process: process.clone(),
                        op,
                        problem,
                    };
                    let Some(operation) = ops.get_mut(entry.0) else {
                        return Err(invalid("internal: lost its invoke".to_string()));
                    };
                    if time < operation.invoke_time {
                        return Err(invalid(format!(
                            "completes at {time}, before its invoke at {}",
                            operation.invoke_time
                        )));
                    }
                    if operation.f == Function::Acquire && outcome == Outcome::Ok && token.is_none()
                    {
                        return Err(invalid("acquire ok without a token".to_string()));
                    }
                    // A slot out of range is a violation the checker
                    // reports; a grant that names no slot is a history the
                    // gate should not have written.
                    if operation.mode == Mode::Semaphore
                        && operation.f == Function::Acquire
                        && outcome == Outcome::Ok
                        && slot.is_none()
                    {
                        return Err(invalid("semaphore acquire ok without a slot".to_string()));
                    }
                    if let Some(slot) = slot {
                        if operation.f != Function::Acquire || operation.mode != Mode::Semaphore {
                            return Err(invalid(
                                "a slot on the completion of something other than a semaphore \
                                 acquire"
                                    .to_string(),
                            ));
                        }
                        operation.slot = Some(slot);
                    }
                    operation.completion = Some(Completion {
                        outcome,
                        time,
                        token,
                        seq,
                        term,
                        detail,
                    });
                }
            }
        }
        check_discipline(&ops, &invoke_lines)?;
        Ok(History { ops })
    }

    /// The history as events in time order (an invoke before its complete).
    pub fn events(&self) -> Vec<Event> {
        let mut timed: Vec<(u64, Event)> = Vec::with_capacity(self.ops.len() * 2);
        for o in &self.ops {
            timed.push((
                o.invoke_time,
                Event::Invoke {
                    process: o.process.clone(),
                    op: o.op,
                    f: o.f,
                    key: o.key.clone(),
                    time: o.invoke_time,
                    token: o.token,
                    detail: o.detail.clone(),
                    mode: o.mode,
                    permits: o.permits,
                    slot: if o.f == Function::Acquire {
                        None
                    } else {
                        o.slot
                    },
                },
            ));
            if let Some(c) = &o.completion {
                timed.push((
                    c.time.max(o.invoke_time),
                    Event::Complete {
                        process: o.process.clone(),
                        op: o.op,
                        outcome: c.outcome,
                        time: c.time,
                        token: c.token,
                        seq: c.seq,
                        term: c.term,
                        detail: c.detail.clone(),
                        slot: if o.f == Function::Acquire {
                            o.slot
                        } else {
                            None
                        },
                    },
                ));
            }
        }
        // Stable: ties keep push order, so an invoke stays before its complete.
        timed.sort_by_key(|(t, _)| *t);
        timed.into_iter().map(|(_, e)| e).collect()
    }

    /// Writes JSON lines in time order. Reading them back gives the same
    /// history when its operations are in invoke-time order (as the parser
    /// and the builder make them).
    pub fn to_jsonl<W: Write>(&self, mut writer: W) -> io::Result<()> {
        for event in self.events() {
            serde_json::to_writer(&mut writer, &event)?;
            writer.write_all(b"\n")?;
        }
        Ok(())
    }

    pub fn to_jsonl_string(&self) -> String {
        let mut buf = Vec::new();
        // Writing to a Vec cannot fail; serialization of these types cannot either.
        let _ = self.to_jsonl(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// The worker discipline the search's "process moved on" pruning relies on:
/// once an acquire or release of a process ends unknown (or never
/// completes), that process invokes nothing more but `expire`s. Then no
/// unknown operation can take effect after a later confirmed operation of
/// its own process, which is what lets the search drop it once that later
/// operation is linearized. Expires are exempt: they are markers placed at a
/// fence deadline, not requests.
fn check_discipline(ops: &[Operation], lines: &[usize]) -> Result<(), ParseError> {
    // process -> (index of its first unknown acquire/release)
    let mut first_unknown: HashMap<&str, usize> = HashMap::new();
    let mut order: Vec<usize> = (0..ops.len()).collect();
    order.sort_by_key(|&i| (ops[i].invoke_time, lines.get(i).copied().unwrap_or(0)));
    for &i in &order {
        let o = &ops[i];
        if o.f == Function::Expire {
            continue;
        }
        if let Some(&u) = first_unknown.get(o.process.as_str()) {
            let before = &ops[u];
            return Err(ParseError::ActedAfterUnknown {
                line: lines.get(i).copied().unwrap_or(0),
                process: o.process.clone(),
                op: o.op,
                f: o.f,
                unknown_line: lines.get(u).copied().unwrap_or(0),
                unknown_op: before.op,
                unknown_f: before.f,
            });
        }
        let unknown = !matches!(o.outcome(), Some(Outcome::Ok | Outcome::Fail));
        if unknown && matches!(o.f, Function::Acquire | Function::Release) {
            first_unknown.insert(o.process.as_str(), i);
        }
    }
    Ok(())
}

fn malformed(line: usize, e: serde_json::Error) -> ParseError {
    // serde_json appends " at line 1 column N" (the line within this one
    // JSON text); the line that matters is the file's, reported separately.
    let mut message = e.to_string();
    if let Some(at) = message.rfind(" at line ") {
        message.truncate(at);
    }
    ParseError::Malformed {
        line,
        column: e.column(),
        message,
        source: e,
    }
}

/// Names an operation made by [`HistoryBuilder`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpRef(usize);

/// Writes histories by hand. Every event advances a clock by one
/// millisecond (or set it with [`HistoryBuilder::at_ms`]); op ids count up
/// per process.
#[derive(Debug, Clone, Default)]
pub struct HistoryBuilder {
    ops: Vec<Operation>,
    next_op: HashMap<String, u64>,
    clock: u64,
}

const MS: u64 = 1_000_000;

impl HistoryBuilder {
    /// Sets the clock so the next event happens at `ms` milliseconds.
    pub fn at_ms(&mut self, ms: u64) -> &mut Self {
        self.clock = ms * MS;
        self
    }

    fn tick(&mut self) -> u64 {
        let now = self.clock;
        self.clock += MS;
        now
    }

    /// Invokes any operation.
    pub fn invoke(
        &mut self,
        process: &str,
        f: Function,
        key: Option<&str>,
        token: Option<u64>,
    ) -> OpRef {
        let counter = self.next_op.entry(process.to_string()).or_insert(0);
        *counter += 1;
        let op = *counter;
        let invoke_time = self.tick();
        self.ops.push(Operation {
            process: process.to_string(),
            op,
            f,
            key: key.map(str::to_string),
            token,
            detail: None,
            invoke_time,
            completion: None,
            mode: Mode::Exclusive,
            permits: None,
            slot: None,
        });
        OpRef(self.ops.len() - 1)
    }

    /// Makes `op` a shared hold's operation.
    pub fn shared(&mut self, op: OpRef) -> &mut Self {
        if let Some(o) = self.ops.get_mut(op.0) {
            o.mode = Mode::Shared;
        }
        self
    }

    /// Makes `op` an operation on a semaphore of `permits` (an acquire's
    /// slot comes with [`HistoryBuilder::granted_slot`]; a release's,
    /// expire's or write's is `slot`).
    pub fn semaphore(&mut self, op: OpRef, permits: u32, slot: Option<u32>) -> &mut Self {
        if let Some(o) = self.ops.get_mut(op.0) {
            o.mode = Mode::Semaphore;
            o.permits = Some(permits);
            o.slot = slot;
        }
        self
    }

    /// A semaphore acquire ok: its token and slot.
    pub fn granted_slot(&mut self, op: OpRef, token: u64, slot: u32) -> &mut Self {
        self.granted(op, token);
        if let Some(o) = self.ops.get_mut(op.0) {
            o.slot = Some(slot);
        }
        self
    }

    pub fn acquire(&mut self, process: &str, key: &str) -> OpRef {
        self.invoke(process, Function::Acquire, Some(key), None)
    }

    pub fn release(&mut self, process: &str, key: &str, token: u64) -> OpRef {
        self.invoke(process, Function::Release, Some(key), Some(token))
    }

    /// A lease-expiry marker (never completed).
    pub fn expire(&mut self, process: &str, key: &str, token: Option<u64>) -> OpRef {
        self.invoke(process, Function::Expire, Some(key), token)
    }

    pub fn write(&mut self, process: &str, key: &str, token: u64) -> OpRef {
        self.invoke(process, Function::Write, Some(key), Some(token))
    }

    /// A shared holder's guarded read of `key`'s record with `token`
    /// (complete it with [`HistoryBuilder::accepted`] and the write count it
    /// saw, or [`HistoryBuilder::fail`] for the fence's refusal).
    pub fn read(&mut self, process: &str, key: &str, token: u64) -> OpRef {
        let op = self.invoke(process, Function::Read, Some(key), Some(token));
        self.shared(op);
        op
    }

    /// A sequential guarded read the fence accepted, after `seq` writes.
    pub fn read_current(&mut self, process: &str, key: &str, token: u64, seq: i64) -> OpRef {
        let op = self.read(process, key, token);
        self.accepted(op, seq);
        op
    }

    pub fn advance(&mut self) -> OpRef {
        self.invoke("nemesis", Function::Advance, None, None)
    }

    /// An advance of the cluster holding the keys under `prefix` only.
    pub fn advance_under(&mut self, prefix: &str) -> OpRef {
        self.invoke("nemesis", Function::Advance, Some(prefix), None)
    }

    pub fn fault(&mut self, detail: &str) -> OpRef {
        let op = self.invoke("nemesis", Function::Fault, None, None);
        if let Some(o) = self.ops.get_mut(op.0) {
            o.detail = Some(detail.to_string());
        }
        op
    }

    /// Completes an operation.
    pub fn complete(
        &mut self,
        op: OpRef,
        outcome: Outcome,
        token: Option<u64>,
        seq: Option<i64>,
    ) -> &mut Self {
        let time = self.tick();
        if let Some(o) = self.ops.get_mut(op.0) {
            o.completion = Some(Completion {
                outcome,
                time,
                token,
                seq,
                term: None,
                detail: None,
            });
        }
        self
    }

    pub fn ok(&mut self, op: OpRef) -> &mut Self {
        self.complete(op, Outcome::Ok, None, None)
    }

    /// Acquire ok with its token.
    pub fn granted(&mut self, op: OpRef, token: u64) -> &mut Self {
        self.complete(op, Outcome::Ok, Some(token), None)
    }

    /// Write ok with the resource's sequence number.
    pub fn accepted(&mut self, op: OpRef, seq: i64) -> &mut Self {
        self.complete(op, Outcome::Ok, None, Some(seq))
    }

    pub fn fail(&mut self, op: OpRef) -> &mut Self {
        self.complete(op, Outcome::Fail, None, None)
    }

    pub fn unknown(&mut self, op: OpRef) -> &mut Self {
        self.complete(op, Outcome::Unknown, None, None)
    }

    /// A Campaign's leadership (an election's acquire ok): its token and
    /// its term.
    pub fn led(&mut self, process: &str, election: &str, token: u64, term: u64) -> OpRef {
        let op = self.acquire(process, election);
        self.granted(op, token);
        if let Some(Some(c)) = self.ops.get_mut(op.0).map(|o| o.completion.as_mut()) {
            c.term = Some(term);
        }
        op
    }

    /// A sequential acquire that succeeded.
    pub fn acquired(&mut self, process: &str, key: &str, token: u64) -> OpRef {
        let op = self.acquire(process, key);
        self.granted(op, token);
        op
    }

    /// A sequential release that succeeded.
    pub fn released(&mut self, process: &str, key: &str, token: u64) -> OpRef {
        let op = self.release(process, key, token);
        self.ok(op);
        op
    }

    /// A sequential write the resource accepted.
    pub fn wrote(&mut self, process: &str, key: &str, token: u64, seq: i64) -> OpRef {
        let op = self.write(process, key, token);
        self.accepted(op, seq);
        op
    }

    pub fn build(&self) -> History {
        History {
            ops: self.ops.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<History, ParseError> {
        History::from_jsonl(text.as_bytes())
    }

    #[test]
    fn reads_the_gate_format() {
        let text = r#"{"type":"invoke","process":"w3","op":17,"f":"acquire","key":"bench/gate/k1","time":123456789}
{"type":"invoke","process":"nemesis","op":1,"f":"fault","time":123456800,"detail":"kill etcd-1"}
{"type":"complete","process":"w3","op":17,"outcome":"ok","token":281474976710699,"time":123456999}

{"type":"invoke","process":"w3","op":18,"f":"expire","key":"bench/gate/k1","token":null,"time":123457000,"extra":"ignored"}
"#;
        let h = parse(text).unwrap();
        assert_eq!(h.ops().len(), 3);
        let acquire = &h.ops()[0];
        assert_eq!(acquire.subject_token(), Some(token(1, 43)));
        assert_eq!(acquire.complete_time(), Some(123456999));
        assert_eq!(h.ops()[1].detail.as_deref(), Some("kill etcd-1"));
        assert_eq!(h.ops()[2].outcome(), None);
        assert_eq!(h.ops()[2].token, None);
    }

    #[test]
    fn round_trips_through_jsonl() {
        let mut b = History::builder();
        let a = b.acquire("w1", "k");
        b.fault("kill etcd-1");
        b.granted(a, token(1, 5));
        b.wrote("w1", "k", token(1, 5), 3);
        b.expire("w1", "k", Some(token(1, 5)));
        let r = b.release("w1", "k", token(1, 5));
        b.unknown(r);
        let adv = b.advance();
        b.ok(adv);
        let h = b.build();
        let text = h.to_jsonl_string();
        assert_eq!(text.lines().count(), 10);
        let back = parse(&text).unwrap();
        assert_eq!(back, h);
    }

    #[test]
    fn unknown_type_is_an_error_naming_the_line() {
        let text = r#"{"type":"invoke","process":"w1","op":1,"f":"acquire","key":"k","time":1}
{"type":"teleport","process":"w1","op":1,"time":2}"#;
        let err = parse(text).unwrap_err();
        assert_eq!(err.line(), 2);
        let msg = err.to_string();
        assert!(msg.starts_with("line 2"), "{msg}");
        assert!(msg.contains("teleport"), "{msg}");
    }

    /// Issue 32: the parser's own error stays the source.
    #[test]
    fn a_malformed_line_keeps_the_parsers_error() {
        let err = parse(r#"{"type":"invoke","#).unwrap_err();
        let source = std::error::Error::source(&err)
            .and_then(|s| s.downcast_ref::<serde_json::Error>())
            .unwrap_or_else(|| panic!("no serde_json source: {err:?}"));
        assert!(source.is_eof(), "{source}");
        assert!(err.to_string().starts_with("line 1, column "), "{err}");
    }

    #[test]
    fn unknown_function_is_an_error_naming_the_line() {
        let text = r#"{"type":"invoke","process":"w1","op":1,"f":"steal","key":"k","time":1}"#;
        let err = parse(text).unwrap_err();
        assert_eq!(err.line(), 1);
        assert!(err.to_string().contains("steal"), "{err}");
    }

    #[test]
    fn malformed_json_names_the_line() {
        let text = "{\"type\":\"invoke\",\"process\":\"w1\",\"op\":1,\"f\":\"acquire\",\"key\":\"k\",\"time\":1}\n\n{not json";
        let err = parse(text).unwrap_err();
        assert_eq!(err.line(), 3);
    }

    #[test]
    fn complete_without_invoke_is_an_error() {
        let text = r#"{"type":"complete","process":"w1","op":4,"outcome":"ok","time":2}"#;
        let err = parse(text).unwrap_err();
        assert!(matches!(
            err,
            ParseError::CompleteWithoutInvoke { line: 1, .. }
        ));
        assert!(err.to_string().contains("w1#4"), "{err}");
    }

    #[test]
    fn duplicate_lines_and_bad_fields_are_errors() {
        let inv = r#"{"type":"invoke","process":"w1","op":1,"f":"acquire","key":"k","time":5}"#;
        let err = parse(&format!("{inv}\n{inv}")).unwrap_err();
        assert!(matches!(
            err,
            ParseError::DuplicateInvoke {
                line: 2,
                first_line: 1,
                ..
            }
        ));

        let ok = r#"{"type":"complete","process":"w1","op":1,"outcome":"ok","token":7,"time":6}"#;
        let err = parse(&format!("{inv}\n{ok}\n{ok}")).unwrap_err();
        assert!(matches!(err, ParseError::DuplicateComplete { line: 3, .. }));

        let no_token = r#"{"type":"complete","process":"w1","op":1,"outcome":"ok","time":6}"#;
        let err = parse(&format!("{inv}\n{no_token}")).unwrap_err();
        assert_eq!(err.line(), 2);
        assert!(err.to_string().contains("without a token"), "{err}");

        let early = r#"{"type":"complete","process":"w1","op":1,"outcome":"fail","time":4}"#;
        assert_eq!(parse(&format!("{inv}\n{early}")).unwrap_err().line(), 2);

        let keyless = r#"{"type":"invoke","process":"w1","op":2,"f":"release","time":5}"#;
        assert_eq!(parse(keyless).unwrap_err().line(), 1);

        let bad_outcome = r#"{"type":"complete","process":"w1","op":1,"outcome":"maybe","time":6}"#;
        let err = parse(&format!("{inv}\n{bad_outcome}")).unwrap_err();
        assert_eq!(err.line(), 2);
        assert!(err.to_string().contains("maybe"), "{err}");
    }

    /// Issue 14 (4). A worker exits after an unknown outcome; the search
    /// relies on it. A process that goes on acquiring after an acquire it
    /// could not judge breaks that, and the history is refused.
    #[test]
    fn a_process_that_goes_on_after_an_unknown_outcome_is_refused() {
        let text = r#"{"type":"invoke","process":"w1.1","op":1,"f":"acquire","key":"k","time":10}
{"type":"complete","process":"w1.1","op":1,"outcome":"unknown","time":20}
{"type":"invoke","process":"w1.1","op":2,"f":"expire","key":"k","time":30}
{"type":"invoke","process":"w1.1","op":3,"f":"acquire","key":"k","time":40}
{"type":"complete","process":"w1.1","op":3,"outcome":"ok","token":7,"time":50}
"#;
        let err = parse(text).unwrap_err();
        assert_eq!(err.line(), 4, "{err}");
        let msg = err.to_string();
        assert!(msg.contains("w1.1#3"), "{msg}");
        assert!(msg.contains("w1.1#1"), "{msg}");

        // The expire alone after the unknown acquire is the discipline.
        let upto: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert!(parse(&upto).is_ok());
    }

    #[test]
    fn tokens_print_as_epoch_and_revision() {
        assert_eq!(format_token(token(1, 5512)), "e1:r5512");
        assert_eq!(format_token(281474976710699), "e1:r43");
        // anything a history carries reads, bits as they are
        assert_eq!(format_token(0), "e0:r0");
        assert_eq!(format_token(u64::MAX), "e65535:r281474976710655");
    }

    /// The arbiter's packing: what it refuses to pack is 0 here, never a
    /// wrapped revision that would be another pair's token.
    #[test]
    fn tokens_pack_as_the_arbiter_packs() {
        assert_eq!(token(1, 43), 281474976710699);
        assert_eq!(token(2, 3), latchkey_records::token::pack(2, 3).unwrap());
        assert!(token(1, (1 << 48) - 1) < token(2, 1));
        for (epoch, revision) in [(0, 5), (1 << 15, 5), (1, 0), (1, 1 << 48), (1, u64::MAX)] {
            assert_eq!(token(epoch, revision), 0, "({epoch}, {revision})");
        }
    }
}
