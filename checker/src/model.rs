//! The sequential lock model for one key, and how history operations map
//! onto it.
//!
//! Operations whose outcome is unknown (unknown or never completed) are
//! *optional*: the search may linearize them anywhere after their invoke,
//! where they take their effect, or never, which is the same as "no
//! effect". So each model operation has at most one effect and the state
//! machine stays deterministic. A `fail` is a definite refusal (the arbiter
//! said no before writing anything: NOT_HELD, TOKEN_MISMATCH, HELD, ...), so
//! a failed acquire, release or advance changes nothing and is left out; only
//! unknown outcomes fork.

use std::collections::{BTreeMap, HashMap};

use crate::history::{Function, History, Outcome};

/// Sentinel for "no return": optional operations may happen at any time.
pub(crate) const NEVER: u64 = u64::MAX;

/// Who holds the key: a process, and the grant's token when it is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Holder {
    pub(crate) process: u32,
    pub(crate) token: Option<u64>,
}

/// The model's state for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct LockState {
    pub(crate) holder: Option<Holder>,
    /// The greatest token granted on this key.
    pub(crate) last_token: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Acquire ok: a grant with this token (`None` only in hand-built
    /// histories that omit it).
    Grant { token: Option<u64> },
    /// Acquire with unknown outcome: perhaps granted, token unknown.
    MaybeGrant,
    /// Release of the grant with this token (`None`: whatever is held).
    Release { token: Option<u64> },
    /// The lease of this grant (`None`: whatever the process holds) ran out.
    Expire { token: Option<u64> },
    /// Epoch advance: every hold dropped.
    Advance,
}

/// One operation as the search sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ModelOp {
    /// Index into [`History::ops`].
    pub(crate) index: usize,
    /// Interned process id.
    pub(crate) process: u32,
    pub(crate) effect: Effect,
    /// Required operations must be linearized inside [call, ret]; optional
    /// ones have `ret == NEVER` and may be left out.
    pub(crate) required: bool,
    pub(crate) call: u64,
    pub(crate) ret: u64,
}

impl ModelOp {
    /// The token of a release/expire naming one grant, for pruning.
    pub(crate) fn named_token(&self) -> Option<u64> {
        match self.effect {
            Effect::Release { token } | Effect::Expire { token } => token,
            _ => None,
        }
    }
}

impl LockState {
    /// Applies `op`; `None` if it cannot happen here. An optional operation
    /// that would change nothing also returns `None`: linearizing it is the
    /// same as leaving it out, and leaving it out keeps the search small.
    pub(crate) fn step(&self, op: &ModelOp) -> Option<LockState> {
        let next = match op.effect {
            Effect::Grant { token } => {
                if self.holder.is_some() {
                    return None;
                }
                match token {
                    Some(t) if t <= self.last_token => return None,
                    Some(t) => LockState {
                        holder: Some(Holder {
                            process: op.process,
                            token: Some(t),
                        }),
                        last_token: t,
                    },
                    None => LockState {
                        holder: Some(Holder {
                            process: op.process,
                            token: None,
                        }),
                        last_token: self.last_token,
                    },
                }
            }
            Effect::MaybeGrant => {
                if self.holder.is_some() {
                    return None;
                }
                LockState {
                    holder: Some(Holder {
                        process: op.process,
                        token: None,
                    }),
                    last_token: self.last_token,
                }
            }
            Effect::Release { token } => {
                let h = self.holder?;
                // A holder whose token is unknown matches any release by
                // its process.
                let matches = h.process == op.process
                    && (h.token.is_none() || token.is_none() || h.token == token);
                if !matches {
                    return None;
                }
                LockState {
                    holder: None,
                    last_token: self.last_token,
                }
            }
            Effect::Expire { token } => {
                let h = self.holder?;
                // An expire that names a token is about that grant only.
                let matches = h.process == op.process && (token.is_none() || h.token == token);
                if !matches {
                    return None;
                }
                LockState {
                    holder: None,
                    last_token: self.last_token,
                }
            }
            Effect::Advance => LockState {
                holder: None,
                last_token: self.last_token,
            },
        };
        if !op.required && next == *self {
            return None;
        }
        Some(next)
    }

    /// Whether an optional release/expire naming `token` can never apply
    /// again from this state on: its grant is in the past (tokens only grow,
    /// so that grant is never made again) and is not the current holder.
    pub(crate) fn outlived(&self, op: &ModelOp) -> bool {
        let Some(t) = op.named_token() else {
            return false;
        };
        if t > self.last_token {
            return false;
        }
        match self.holder {
            None => true,
            Some(h) => {
                let still_applies = h.process == op.process
                    && (h.token == Some(t)
                        || (h.token.is_none() && matches!(op.effect, Effect::Release { .. })));
                !still_applies
            }
        }
    }
}

/// The operations of one key (plus every advance), ready for the search.
#[derive(Debug, Clone, Default)]
pub(crate) struct Partition {
    pub(crate) ops: Vec<ModelOp>,
}

/// Splits the history per key. Writes and faults are not part of the lock
/// model; failed acquires, releases and advances change nothing and are left
/// out (dropping a no-op cannot change whether a history linearizes: real
/// time order is an interval order, so it stays transitive without it).
pub(crate) fn partitions(history: &History) -> BTreeMap<String, Partition> {
    let mut ids: HashMap<&str, u32> = HashMap::new();
    let mut process_ids: Vec<u32> = Vec::with_capacity(history.ops().len());
    for o in history.ops() {
        let next = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        let id = *ids.entry(o.process.as_str()).or_insert(next);
        process_ids.push(id);
    }
    let mut by_key: BTreeMap<String, Vec<ModelOp>> = BTreeMap::new();
    let mut advances: Vec<(ModelOp, Option<&str>)> = Vec::new();
    for (index, o) in history.ops().iter().enumerate() {
        let process = process_ids.get(index).copied().unwrap_or(u32::MAX);
        let outcome = o.outcome();
        let definite = outcome == Some(Outcome::Ok);
        let (effect, required) = match (o.f, outcome) {
            (Function::Acquire, Some(Outcome::Ok)) => (
                Effect::Grant {
                    token: o.subject_token(),
                },
                true,
            ),
            (Function::Acquire, Some(Outcome::Fail)) => continue,
            (Function::Acquire, _) => (Effect::MaybeGrant, false),
            (Function::Release, Some(Outcome::Fail)) => continue,
            (Function::Release, _) => (Effect::Release { token: o.token }, definite),
            (Function::Expire, Some(Outcome::Fail)) => continue,
            (Function::Expire, _) => (Effect::Expire { token: o.token }, false),
            (Function::Advance, Some(Outcome::Fail)) => continue,
            (Function::Advance, _) => (Effect::Advance, definite),
            (Function::Write | Function::Fault, _) => continue,
        };
        let call = o.invoke_time;
        let ret = if required {
            o.complete_time().unwrap_or(NEVER).max(call)
        } else {
            NEVER
        };
        let op = ModelOp {
            index,
            process,
            effect,
            required,
            call,
            ret,
        };
        if o.f == Function::Advance {
            advances.push((op, o.key.as_deref()));
        } else if let Some(key) = &o.key {
            by_key.entry(key.clone()).or_default().push(op);
        }
    }
    by_key
        .into_iter()
        .map(|(key, mut ops)| {
            ops.extend(
                advances
                    .iter()
                    .filter(|(_, scope)| crate::advance_applies(*scope, &key))
                    .map(|(op, _)| *op),
            );
            ops.sort_by_key(|o| (o.call, o.index));
            (key, Partition { ops })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(process: u32, effect: Effect, required: bool) -> ModelOp {
        ModelOp {
            index: 0,
            process,
            effect,
            required,
            call: 0,
            ret: if required { 1 } else { NEVER },
        }
    }

    #[test]
    fn grants_need_a_free_key_and_a_bigger_token() {
        let s = LockState::default();
        let g = op(1, Effect::Grant { token: Some(5) }, true);
        let held = s.step(&g).unwrap();
        assert_eq!(held.last_token, 5);
        assert_eq!(
            held.step(&op(2, Effect::Grant { token: Some(6) }, true)),
            None
        );
        let freed = held
            .step(&op(1, Effect::Release { token: Some(5) }, true))
            .unwrap();
        assert_eq!(
            freed.step(&op(2, Effect::Grant { token: Some(5) }, true)),
            None
        );
        assert!(
            freed
                .step(&op(2, Effect::Grant { token: Some(6) }, true))
                .is_some()
        );
    }

    #[test]
    fn optional_no_ops_are_not_steps() {
        let s = LockState::default();
        assert_eq!(s.step(&op(1, Effect::Expire { token: None }, false)), None);
        assert_eq!(s.step(&op(0, Effect::Advance, false)), None);
        assert!(s.step(&op(0, Effect::Advance, true)).is_some());
    }

    #[test]
    fn unknown_token_holder_matches_releases_but_not_named_expires() {
        let s = LockState::default()
            .step(&op(1, Effect::MaybeGrant, false))
            .unwrap();
        assert!(
            s.step(&op(1, Effect::Release { token: Some(9) }, true))
                .is_some()
        );
        assert!(
            s.step(&op(1, Effect::Expire { token: None }, false))
                .is_some()
        );
        assert_eq!(
            s.step(&op(1, Effect::Expire { token: Some(9) }, false)),
            None
        );
        assert_eq!(s.step(&op(2, Effect::Release { token: None }, true)), None);
    }
}
