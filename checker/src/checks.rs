//! Direct checks outside the search: token order, fenced writes and
//! shared holders' guarded reads. They
//! are cheap, exact, and name the operations involved in plain words, so a
//! violation the search also finds reads clearly here.

use std::collections::{HashMap, HashSet};

use crate::history::{Function, Mode, Operation, Outcome, format_token};
use crate::report::{OpSummary, Violation, ViolationKind};

/// One key's operations (indices into the history) and every advance.
pub(crate) struct KeyOps<'a> {
    pub(crate) key: &'a str,
    pub(crate) ops: &'a [Operation],
    pub(crate) mine: Vec<usize>,
    pub(crate) advances: &'a [usize],
    pub(crate) start: u64,
    /// Report at most this many violations of one kind on one key.
    pub(crate) cap: usize,
    /// One slot of a semaphore (`S//s/n`): its grants are checked as an
    /// exclusive lock's. Otherwise a key with its shared holds, or a whole
    /// semaphore (whose slots are checked on their own).
    pub(crate) slot_scope: bool,
}

/// Collects violations, keeping at most `cap` per kind and counting the rest.
pub(crate) struct Findings {
    pub(crate) violations: Vec<Violation>,
    pub(crate) notes: Vec<String>,
    suppressed: HashMap<ViolationKind, usize>,
    cap: usize,
}

impl Findings {
    fn new(cap: usize) -> Self {
        Findings {
            violations: Vec::new(),
            notes: Vec::new(),
            suppressed: HashMap::new(),
            cap,
        }
    }

    fn push(&mut self, v: Violation) {
        let same = self.violations.iter().filter(|x| x.kind == v.kind).count();
        if same < self.cap {
            self.violations.push(v);
        } else {
            *self.suppressed.entry(v.kind).or_insert(0) += 1;
        }
    }

    fn finish(mut self, key: &str) -> Self {
        let mut kinds: Vec<_> = self.suppressed.iter().map(|(k, n)| (*k, *n)).collect();
        kinds.sort_by_key(|(k, _)| format!("{k}"));
        for (kind, n) in kinds {
            self.notes
                .push(format!("{n} more {kind} violations on {key} not listed"));
        }
        self
    }
}

impl KeyOps<'_> {
    fn op(&self, i: usize) -> &Operation {
        &self.ops[i]
    }

    fn summary(&self, i: usize) -> OpSummary {
        OpSummary::new(self.op(i), self.start)
    }

    fn violation(&self, kind: ViolationKind, message: String, ops: &[usize]) -> Violation {
        Violation {
            kind,
            key: self.key.to_string(),
            message,
            ops: ops.iter().map(|&i| self.summary(i)).collect(),
            partial_linearization: Vec::new(),
        }
    }

    /// Short form for messages: `w2#17 acquire ok e1:r5512 [1203.4 ms, 1210.0 ms]`.
    fn name(&self, i: usize) -> String {
        self.summary(i).to_string()
    }

    /// Runs every direct check on this key.
    pub(crate) fn check(&self) -> Findings {
        let mut found = Findings::new(self.cap);
        self.check_grants(&mut found);
        self.check_slots(&mut found);
        self.check_terms(&mut found);
        self.check_writes(&mut found);
        self.check_refusals(&mut found);
        self.check_reads(&mut found);
        self.check_read_refusals(&mut found);
        found.finish(self.key)
    }

    fn grants(&self) -> Vec<(usize, u64)> {
        self.mine
            .iter()
            .filter_map(|&i| {
                let o = self.op(i);
                (o.f == Function::Acquire && o.is_ok())
                    .then_some(())
                    .and_then(|()| o.subject_token().map(|t| (i, t)))
            })
            .collect()
    }

    /// The kind of hold an operation is about; in a slot's scope every
    /// grant is that slot's exclusive one.
    fn kind_of(&self, i: usize) -> Mode {
        if self.slot_scope {
            Mode::Exclusive
        } else {
            self.op(i).mode
        }
    }

    /// Whether two grants may carry one token: holds one transaction made
    /// together (readers of this key, or two slots of this semaphore),
    /// whose acquires overlapped in time.
    fn granted_together(&self, a: usize, b: usize) -> bool {
        let (oa, ob) = (self.op(a), self.op(b));
        let kinds = match (self.kind_of(a), self.kind_of(b)) {
            (Mode::Shared, Mode::Shared) => true,
            (Mode::Semaphore, Mode::Semaphore) => oa.slot != ob.slot,
            _ => false,
        };
        let overlap = |x: &Operation, y: &Operation| {
            x.invoke_time <= y.complete_time().unwrap_or(u64::MAX)
                && y.invoke_time <= x.complete_time().unwrap_or(u64::MAX)
        };
        kinds && overlap(oa, ob)
    }

    fn check_grants(&self, found: &mut Findings) {
        let grants = self.grants();

        // Distinct tokens, but for holds granted together in one
        // transaction: shared holds of the key, or different slots of one
        // semaphore, and only when their acquires overlapped in time.
        let mut first: HashMap<u64, Vec<usize>> = HashMap::new();
        for &(i, t) in &grants {
            // Against every earlier grant of the token: overlapping is not
            // transitive (the review's r1 [0,10], r2 [5,100], r3 [50,60]).
            let group = first.entry(t).or_default();
            if let Some(&a) = group.iter().find(|&&a| !self.granted_together(a, i)) {
                found.push(self.violation(
                    ViolationKind::DuplicateToken,
                    format!(
                        "duplicate token on {}: {} and {} were both granted {}",
                        self.key,
                        self.name(a),
                        self.name(i),
                        format_token(t)
                    ),
                    &[a, i],
                ));
            } else {
                group.push(i);
            }
        }

        // Grant order: a grant that completed before another was invoked
        // must have the smaller token.
        let mut by_ret: Vec<(u64, u64, usize)> = grants
            .iter()
            .filter_map(|&(i, t)| self.op(i).complete_time().map(|r| (r, t, i)))
            .collect();
        by_ret.sort_unstable();
        let mut best: Vec<(u64, usize)> = Vec::with_capacity(by_ret.len());
        for &(_, t, i) in &by_ret {
            let prev = best.last().copied();
            best.push(match prev {
                Some((bt, bi)) if bt >= t => (bt, bi),
                _ => (t, i),
            });
        }
        for &(b, tb) in &grants {
            let call = self.op(b).invoke_time;
            let before = by_ret.partition_point(|&(r, _, _)| r < call);
            if before == 0 {
                continue;
            }
            let (ta, a) = best[before - 1];
            if ta > tb {
                found.push(self.violation(
                    ViolationKind::TokenRegression,
                    format!(
                        "token regression on {}: {} was granted a smaller token than {}, \
                         which completed before it was invoked",
                        self.key,
                        self.name(b),
                        self.name(a)
                    ),
                    &[a, b],
                ));
            }
        }

        // Conflicting grants in token order (the model's grant order) need
        // something that could free the first one between them: each
        // exclusive grant and the grants since the previous exclusive one,
        // and each shared grant and the exclusive one before it.
        let mut by_token = grants.clone();
        by_token.sort_by_key(|&(i, t)| (t, i));
        let mut pairs: Vec<(usize, u64, usize, u64)> = Vec::new();
        let mut last_exclusive: Option<(usize, u64)> = None;
        let mut shared_since: Vec<(usize, u64)> = Vec::new();
        for &(b, tb) in &by_token {
            match self.kind_of(b) {
                Mode::Semaphore => continue, // each slot is checked on its own
                Mode::Shared => {
                    match last_exclusive {
                        // A downgrade: the writer's own hold became shared,
                        // which ends its exclusive one.
                        Some((a, _)) if self.op(a).process == self.op(b).process => {
                            last_exclusive = None;
                        }
                        Some((a, ta)) => pairs.push((a, ta, b, tb)),
                        None => {}
                    }
                    shared_since.push((b, tb));
                }
                Mode::Exclusive => {
                    if shared_since.is_empty() {
                        pairs.extend(last_exclusive.map(|(a, ta)| (a, ta, b, tb)));
                    }
                    pairs.extend(shared_since.drain(..).map(|(a, ta)| (a, ta, b, tb)));
                    last_exclusive = Some((b, tb));
                }
            }
        }
        for (a, ta, b, tb) in pairs {
            if ta == tb {
                continue;
            }
            let (oa, ob) = (self.op(a), self.op(b));
            let b_ret = ob.complete_time().unwrap_or(u64::MAX);
            if b_ret < oa.invoke_time {
                continue; // reported as a token regression
            }
            let frees = |x: usize| {
                let ox = self.op(x);
                // A refusal (release NOT_HELD, a failed advance) frees nothing.
                let x_ret = match ox.outcome() {
                    Some(Outcome::Ok) => ox.complete_time().unwrap_or(u64::MAX),
                    Some(Outcome::Fail) => return false,
                    _ => u64::MAX,
                };
                let applies = match ox.f {
                    Function::Advance => true,
                    Function::Release | Function::Expire => {
                        ox.process == oa.process && ox.token.is_none_or(|t| t == ta)
                    }
                    _ => false,
                };
                applies && oa.invoke_time <= x_ret && ox.invoke_time <= b_ret
            };
            let freed = self.mine.iter().chain(self.advances).any(|&x| frees(x));
            if !freed {
                found.push(self.violation(
                    ViolationKind::DoubleGrant,
                    format!(
                        "double grant on {}: {} while {} held it and no release/expire/advance \
                         could come between",
                        self.key,
                        self.name(b),
                        self.name(a)
                    ),
                    &[b, a],
                ));
            }
        }
    }

    /// A semaphore's grants name slots in `0..permits`.
    fn check_slots(&self, found: &mut Findings) {
        if self.slot_scope {
            return;
        }
        for (i, _) in self.grants() {
            let o = self.op(i);
            if let (Mode::Semaphore, Some(slot), Some(permits)) = (o.mode, o.slot, o.permits)
                && slot >= permits
            {
                found.push(self.violation(
                    ViolationKind::SlotOutOfRange,
                    format!(
                        "semaphore slot out of range on {}: {} was granted slot {slot} of a \
                         semaphore with {permits} permits (slots 0..{})",
                        self.key,
                        self.name(i),
                        permits - 1
                    ),
                    &[i],
                ));
            }
        }
    }

    /// An election's leaderships (acquires with a term): ordered by token,
    /// their terms rise strictly, so no term is led twice and no later
    /// leadership has an older term. Acquires without a term (locks) are
    /// not looked at.
    fn check_terms(&self, found: &mut Findings) {
        let mut led: Vec<(u64, u64, usize)> = self
            .grants()
            .into_iter()
            .filter_map(|(i, t)| {
                let term = self.op(i).completion.as_ref()?.term?;
                Some((t, term, i))
            })
            .collect();
        led.sort_unstable();
        for pair in led.windows(2) {
            let [(ta, term_a, a), (tb, term_b, b)] = [pair[0], pair[1]];
            if ta == tb || term_b > term_a {
                continue;
            }
            found.push(self.violation(
                ViolationKind::TermOrder,
                format!(
                    "election terms out of order on {}: {} led term {term_b} with a larger token \
                     than {}, which led term {term_a}",
                    self.key,
                    self.name(b),
                    self.name(a)
                ),
                &[a, b],
            ));
        }
    }

    fn check_writes(&self, found: &mut Findings) {
        let accepted: Vec<usize> = self
            .mine
            .iter()
            .copied()
            .filter(|&i| self.op(i).f == Function::Write && self.op(i).is_ok())
            .collect();
        if accepted.is_empty() {
            return;
        }
        let granted: HashSet<(&str, u64)> = self
            .grants()
            .into_iter()
            .map(|(i, t)| (self.op(i).process.as_str(), t))
            .collect();
        let mut tokenless = 0usize;
        let mut seqless = 0usize;
        let mut stale: HashSet<usize> = HashSet::new();
        for &w in &accepted {
            let o = self.op(w);
            match o.token {
                None => tokenless += 1,
                Some(t) if !granted.contains(&(o.process.as_str(), t)) => {
                    found.push(self.violation(
                        ViolationKind::UngrantedWriteToken,
                        format!(
                            "write with a token never granted to that process on {}: {} \
                             was accepted, but {} never acquired {} there",
                            self.key,
                            self.name(w),
                            o.process,
                            format_token(t)
                        ),
                        &[w],
                    ));
                }
                Some(_) => {}
            }
            if o.seq().is_none() {
                seqless += 1;
            }
        }

        // The resource's commit order: each accepted token strictly above
        // every one committed before it (the fence's `WHERE t.fence < $2`).
        let mut by_seq: Vec<(i64, u64, usize)> = accepted
            .iter()
            .filter_map(|&w| {
                let o = self.op(w);
                Some((o.seq()?, o.token?, w))
            })
            .collect();
        by_seq.sort_unstable();
        let mut newest: Option<(u64, usize)> = None;
        for &(_, t, w) in &by_seq {
            match newest {
                Some((nt, n)) if t <= nt => {
                    stale.insert(w);
                    found.push(self.violation(
                        ViolationKind::StaleWriteAccepted,
                        format!(
                            "stale fenced write accepted on {}: {} was committed after {}, \
                             which carried {} (the fence accepts only a token strictly above \
                             the record's mark)",
                            self.key,
                            self.name(w),
                            self.name(n),
                            if t == nt {
                                "the same token"
                            } else {
                                "a newer token"
                            }
                        ),
                        &[w, n],
                    ));
                }
                _ => newest = Some((t, w)),
            }
        }

        // Real time: once a write with the same or a newer token was
        // accepted and had completed, the fence must refuse this one.
        let mut by_ret: Vec<(u64, u64, usize)> = accepted
            .iter()
            .filter_map(|&w| {
                let o = self.op(w);
                Some((o.complete_time()?, o.token?, w))
            })
            .collect();
        by_ret.sort_unstable();
        let mut best: Vec<(u64, usize)> = Vec::with_capacity(by_ret.len());
        for &(_, t, w) in &by_ret {
            let prev = best.last().copied();
            best.push(match prev {
                Some((bt, bw)) if bt >= t => (bt, bw),
                _ => (t, w),
            });
        }
        for &w in &accepted {
            let o = self.op(w);
            let Some(t) = o.token else { continue };
            if stale.contains(&w) {
                continue;
            }
            let before = by_ret.partition_point(|&(r, _, _)| r < o.invoke_time);
            if before == 0 {
                continue;
            }
            let (nt, n) = best[before - 1];
            if nt >= t && n != w {
                stale.insert(w);
                found.push(self.violation(
                    ViolationKind::StaleWriteAccepted,
                    format!(
                        "stale fenced write accepted on {}: {} was accepted although {} \
                         with {} had completed before it was invoked",
                        self.key,
                        self.name(w),
                        self.name(n),
                        if t == nt {
                            "the same token"
                        } else {
                            "a newer token"
                        }
                    ),
                    &[w, n],
                ));
            }
        }

        // One token, two accepted writes, neither ordered by the checks
        // above (no seq, overlapping in time): one of them came second and
        // met its own token as the mark.
        let mut first_with: HashMap<u64, usize> = HashMap::new();
        for &w in &accepted {
            let Some(t) = self.op(w).token else { continue };
            match first_with.get(&t) {
                Some(&a) if !stale.contains(&w) && !stale.contains(&a) => {
                    stale.insert(w);
                    found.push(self.violation(
                        ViolationKind::StaleWriteAccepted,
                        format!(
                            "token accepted twice on {}: {} and {} carry the same token; \
                             the fence accepts a token only strictly above the record's mark",
                            self.key,
                            self.name(w),
                            self.name(a)
                        ),
                        &[w, a],
                    ));
                }
                Some(_) => {}
                None => {
                    first_with.insert(t, w);
                }
            }
        }

        if tokenless > 0 {
            found.notes.push(format!(
                "{tokenless} accepted writes on {} carry no token; they were not checked against grants",
                self.key
            ));
        }
        if seqless > 0 {
            found.notes.push(format!(
                "{seqless} accepted writes on {} carry no seq; they were left out of the commit-order check",
                self.key
            ));
        }
    }
    /// A refused write is legal only if the record's mark (or read mark) was
    /// already at or above its token: some other write, or a guarded read,
    /// with such a token (accepted, or with an unknown outcome, so perhaps
    /// committed) was invoked before the refusal came back. Otherwise the fence said no to a write the
    /// reference statement accepts.
    fn check_refusals(&self, found: &mut Findings) {
        // Writes that may have reached the record (accepted or unknown), by
        // invoke time, with running maxima of their tokens: over all of them
        // (could the mark be at or above t?) and over the accepted ones
        // (which write to name as the mark).
        // A guarded read (accepted or unknown) raised the record's read mark
        // to its token, which fences out writes at or below it: it covers a
        // refusal like a write does, but is never named as the mark a write
        // met (`false`: not an accepted write).
        let mut reach: Vec<(u64, u64, usize, bool)> = self
            .mine
            .iter()
            .filter_map(|&x| {
                let o = self.op(x);
                if !matches!(o.f, Function::Write | Function::Read)
                    || o.outcome() == Some(Outcome::Fail)
                {
                    return None;
                }
                Some((
                    o.invoke_time,
                    o.token?,
                    x,
                    o.f == Function::Write && o.is_ok(),
                ))
            })
            .collect();
        reach.sort_unstable();
        let mut any_max: Vec<u64> = Vec::with_capacity(reach.len());
        let mut ok_max: Vec<Option<(u64, usize)>> = Vec::with_capacity(reach.len());
        for &(_, t, x, ok) in &reach {
            let a = any_max.last().copied().unwrap_or(0).max(t);
            let prev = ok_max.last().copied().flatten();
            let b = match prev {
                Some((bt, _)) if !ok || bt >= t => prev,
                _ if ok => Some((t, x)),
                _ => prev,
            };
            any_max.push(a);
            ok_max.push(b);
        }
        for &w in &self.mine {
            let o = self.op(w);
            if o.f != Function::Write || o.outcome() != Some(Outcome::Fail) {
                continue;
            }
            let (Some(t), Some(ret)) = (o.token, o.complete_time()) else {
                continue;
            };
            let before = reach.partition_point(|&(call, _, _, _)| call <= ret);
            let covered = before > 0 && any_max[before - 1] >= t;
            let mark = if before > 0 { ok_max[before - 1] } else { None };
            if covered {
                continue;
            }
            let (text, ops) = match mark {
                Some((_, m)) => (
                    format!(
                        "the newest token that could have written the record first is \
                         that of {}",
                        self.name(m)
                    ),
                    vec![w, m],
                ),
                None => (
                    "no write could have reached the record before it".to_string(),
                    vec![w],
                ),
            };
            found.push(self.violation(
                ViolationKind::FreshWriteRefused,
                format!(
                    "fenced write refused with a token above the record's mark on {}: {} was \
                     refused, but {text}",
                    self.key,
                    self.name(w)
                ),
                &ops,
            ));
        }
    }

    /// Guarded reads held to the reference fence's rule for readers
    /// (docs/fencing.md, "Fenced reads"): a read with token `t` is accepted
    /// only if no write with a larger token has landed, and raises the read
    /// mark to `t`, after which no write with a token at or below `t` lands.
    /// So, for an accepted read `r` with token `t` and an accepted write `w`:
    /// - `w`'s token is above `t` and `w` landed before `r` (its seq is at or
    ///   below the write count `r` saw, or it completed before `r` was
    ///   invoked): [`ViolationKind::StaleReadAccepted`];
    /// - `w`'s token is at or below `t` and `w` landed after `r` (its seq is
    ///   above the write count `r` saw, or it was invoked after `r`
    ///   completed): [`ViolationKind::StaleWriteAfterRead`].
    ///
    /// A read that came after a writer's *grant* but before that writer's
    /// first write is accepted, rightly: the fence sees writes, not grants,
    /// and the read returned the state no writer had changed yet.
    fn check_reads(&self, found: &mut Findings) {
        let reads: Vec<usize> = self
            .mine
            .iter()
            .copied()
            .filter(|&i| self.op(i).f == Function::Read && self.op(i).is_ok())
            .collect();
        if reads.is_empty() {
            return;
        }
        let writes: Vec<usize> = self
            .mine
            .iter()
            .copied()
            .filter(|&i| self.op(i).f == Function::Write && self.op(i).is_ok())
            .collect();
        let granted: HashSet<(&str, u64)> = self
            .grants()
            .into_iter()
            .map(|(i, t)| (self.op(i).process.as_str(), t))
            .collect();
        let mut tokenless = 0usize;
        for &r in &reads {
            let o = self.op(r);
            match o.token {
                None => tokenless += 1,
                Some(t) if !granted.contains(&(o.process.as_str(), t)) => {
                    found.push(self.violation(
                        ViolationKind::UngrantedReadToken,
                        format!(
                            "guarded read with a token never granted to that process on {}: {} \
                             was accepted, but {} never acquired {} there",
                            self.key,
                            self.name(r),
                            o.process,
                            format_token(t)
                        ),
                        &[r],
                    ));
                }
                Some(_) => {}
            }
        }
        if tokenless > 0 {
            found.notes.push(format!(
                "{tokenless} accepted guarded reads on {} carry no token; they were not checked",
                self.key
            ));
        }

        // Running maxima of the writes' tokens, in commit order (seq) and in
        // order of completion: the newest token that had landed by a point.
        let newest = |mut points: Vec<(u64, u64, usize)>| {
            points.sort_unstable();
            let mut best: Vec<(u64, usize)> = Vec::with_capacity(points.len());
            for &(_, t, x) in &points {
                let prev = best.last().copied();
                best.push(match prev {
                    Some((bt, bx)) if bt >= t => (bt, bx),
                    _ => (t, x),
                });
            }
            (points, best)
        };
        let seq_key = |s: i64| u64::try_from(s).unwrap_or(0);
        let (w_by_seq, w_best_seq) = newest(
            writes
                .iter()
                .filter_map(|&w| {
                    let o = self.op(w);
                    Some((seq_key(o.seq()?), o.token?, w))
                })
                .collect(),
        );
        let (w_by_ret, w_best_ret) = newest(
            writes
                .iter()
                .filter_map(|&w| {
                    let o = self.op(w);
                    Some((o.complete_time()?, o.token?, w))
                })
                .collect(),
        );
        for &r in &reads {
            let o = self.op(r);
            let Some(t) = o.token else { continue };
            // Landed before the read by the record's write count...
            let by_seq = o.seq().and_then(|v| {
                let upto = w_by_seq.partition_point(|&(s, _, _)| s <= seq_key(v));
                upto.checked_sub(1)
                    .map(|i| (w_best_seq[i], "by the record's write count"))
            });
            // ...or by real time.
            let by_time = {
                let before = w_by_ret.partition_point(|&(ret, _, _)| ret < o.invoke_time);
                before
                    .checked_sub(1)
                    .map(|i| (w_best_ret[i], "in real time"))
            };
            let Some(((_, w), how)) = [by_seq, by_time]
                .into_iter()
                .flatten()
                .find(|((nt, _), _)| *nt > t)
            else {
                continue;
            };
            found.push(self.violation(
                ViolationKind::StaleReadAccepted,
                format!(
                    "stale fenced read accepted on {}: {} was accepted after {} had landed \
                     ({how}) with a newer token: a writer granted after this reader had written, \
                     so the reader's hold was over",
                    self.key,
                    self.name(r),
                    self.name(w)
                ),
                &[r, w],
            ));
        }

        // The reads' tokens, by the write count they saw and by completion:
        // the greatest read mark set by a point.
        let (r_by_seq, r_best_seq) = newest(
            reads
                .iter()
                .filter_map(|&r| {
                    let o = self.op(r);
                    Some((seq_key(o.seq()?), o.token?, r))
                })
                .collect(),
        );
        let (r_by_ret, r_best_ret) = newest(
            reads
                .iter()
                .filter_map(|&r| {
                    let o = self.op(r);
                    Some((o.complete_time()?, o.token?, r))
                })
                .collect(),
        );
        for &w in &writes {
            let o = self.op(w);
            let Some(t) = o.token else { continue };
            // Reads that saw fewer writes than this one's count came first.
            let by_seq = o.seq().and_then(|s| {
                let before = r_by_seq.partition_point(|&(v, _, _)| v < seq_key(s));
                before
                    .checked_sub(1)
                    .map(|i| (r_best_seq[i], "by the record's write count"))
            });
            let by_time = {
                let before = r_by_ret.partition_point(|&(ret, _, _)| ret < o.invoke_time);
                before
                    .checked_sub(1)
                    .map(|i| (r_best_ret[i], "in real time"))
            };
            let Some(((_, r), how)) = [by_seq, by_time]
                .into_iter()
                .flatten()
                .find(|((rt, _), _)| *rt >= t)
            else {
                continue;
            };
            found.push(self.violation(
                ViolationKind::StaleWriteAfterRead,
                format!(
                    "stale fenced write accepted after a read on {}: {} landed after {} ({how}), \
                     whose token is {}: the read mark must fence out a write at or below it",
                    self.key,
                    self.name(w),
                    self.name(r),
                    if self.op(r).token == Some(t) {
                        "the same"
                    } else {
                        "newer"
                    }
                ),
                &[w, r],
            ));
        }
    }

    /// A refused guarded read is legal only if a write with a larger token
    /// (accepted, or unknown, so perhaps committed) was invoked before the
    /// refusal came back. Otherwise the fence refused a current read.
    fn check_read_refusals(&self, found: &mut Findings) {
        let mut reach: Vec<(u64, u64)> = self
            .mine
            .iter()
            .filter_map(|&x| {
                let o = self.op(x);
                if o.f != Function::Write || o.outcome() == Some(Outcome::Fail) {
                    return None;
                }
                Some((o.invoke_time, o.token?))
            })
            .collect();
        reach.sort_unstable();
        let mut any_max: Vec<u64> = Vec::with_capacity(reach.len());
        for &(_, t) in &reach {
            any_max.push(any_max.last().copied().unwrap_or(0).max(t));
        }
        for &r in &self.mine {
            let o = self.op(r);
            if o.f != Function::Read || o.outcome() != Some(Outcome::Fail) {
                continue;
            }
            let (Some(t), Some(ret)) = (o.token, o.complete_time()) else {
                continue;
            };
            let before = reach.partition_point(|&(call, _)| call <= ret);
            if before > 0 && any_max[before - 1] > t {
                continue;
            }
            found.push(self.violation(
                ViolationKind::FreshReadRefused,
                format!(
                    "fenced read refused on {}: {} was refused, but no write with a newer token \
                     could have reached the record before the refusal",
                    self.key,
                    self.name(r)
                ),
                &[r],
            ));
        }
    }
}
