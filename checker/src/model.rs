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

use crate::history::{Function, History, Mode, Outcome};

/// Sentinel for "no return": optional operations may happen at any time.
pub(crate) const NEVER: u64 = u64::MAX;

/// What kind of hold a grant makes (the history's [`Mode`], with a
/// semaphore's slot and permits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Exclusive,
    Shared,
    /// A semaphore slot: `slot` when known (a granted acquire, a release),
    /// `permits` on acquires (0 elsewhere: it only bounds grants).
    Slot {
        slot: Option<u32>,
        permits: u32,
    },
}

impl Kind {
    fn of(mode: Mode, slot: Option<u32>, permits: Option<u32>) -> Kind {
        match mode {
            Mode::Exclusive => Kind::Exclusive,
            Mode::Shared => Kind::Shared,
            Mode::Semaphore => Kind::Slot {
                slot,
                permits: permits.unwrap_or(0),
            },
        }
    }

    /// Whether a hold of kind `held` is the one a release/expire of this
    /// kind names (same family; the same slot when both are known).
    fn names(self, held: HoldKind) -> bool {
        match (self, held) {
            (Kind::Exclusive, HoldKind::Exclusive) | (Kind::Shared, HoldKind::Shared) => true,
            // Strict when the release names its slot: a slot-less hold (an
            // unknown acquire) is not silently taken to be that slot.
            (Kind::Slot { slot: a, .. }, HoldKind::Slot(b)) => a.is_none() || a == b,
            _ => false,
        }
    }
}

/// The kind of a hold in the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum HoldKind {
    Exclusive,
    Shared,
    /// A semaphore slot (`None`: an acquire of unknown outcome took one).
    Slot(Option<u32>),
}

/// One hold of the key: a process, its grant's token when it is known, and
/// what kind of hold it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Holder {
    pub(crate) process: u32,
    pub(crate) token: Option<u64>,
    pub(crate) kind: HoldKind,
}

/// The model's state for one key: who holds it, and the token floor.
///
/// A key has one exclusive holder, or any number of shared holders, or at
/// most `permits` semaphore slots (one holder per slot). Tokens: an
/// exclusive grant's is above every earlier grant's; a shared grant's or a
/// slot's is at least the greatest granted so far (readers granted together
/// share one transaction, so one token) and above the last exclusive one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub(crate) struct LockState {
    /// Sorted, so equal states compare (and hash) equal.
    pub(crate) holders: Vec<Holder>,
    /// The greatest token granted on this key.
    pub(crate) last_token: u64,
    /// The greatest token of an exclusive grant.
    pub(crate) last_exclusive: u64,
    /// Whether a shared or slot grant may still join the transaction that
    /// made the last grant (carry `last_token` again): only until a hold
    /// ends. A transaction's grants happen at one instant, so a release,
    /// expire or advance between two of them is not a legal order (the
    /// review found a history that split one transaction's slot grants
    /// around the release of a slot the second one took).
    pub(crate) joinable: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// Acquire ok: a grant with this token (`None` only in hand-built
    /// histories that omit it).
    Grant { token: Option<u64>, kind: Kind },
    /// Acquire with unknown outcome: perhaps granted, token unknown.
    MaybeGrant { kind: Kind },
    /// Release of the grant with this token (`None`: whatever is held).
    Release { token: Option<u64>, kind: Kind },
    /// The lease of this grant (`None`: whatever the process holds) ran out.
    Expire { token: Option<u64>, kind: Kind },
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
            Effect::Release { token, .. } | Effect::Expire { token, .. } => token,
            _ => None,
        }
    }

    /// Whether this is a release/expire of a hold whose grants may share
    /// a token (shared holds and semaphore slots).
    fn names_a_sharing_kind(&self) -> bool {
        matches!(
            self.effect,
            Effect::Release {
                kind: Kind::Shared | Kind::Slot { .. },
                ..
            } | Effect::Expire {
                kind: Kind::Shared | Kind::Slot { .. },
                ..
            }
        )
    }
}

impl LockState {
    /// The first holder (for explanations): the one a blocked grant met.
    pub(crate) fn holder(&self) -> Option<Holder> {
        self.holders.first().copied()
    }

    /// Whether a grant of `kind` can be made beside the current holders
    /// (tokens aside).
    fn admits(&self, kind: Kind) -> bool {
        match kind {
            Kind::Exclusive => self.holders.is_empty(),
            Kind::Shared => self.holders.iter().all(|h| h.kind == HoldKind::Shared),
            Kind::Slot { slot, permits } => {
                let slots = self
                    .holders
                    .iter()
                    .all(|h| matches!(h.kind, HoldKind::Slot(_)));
                let room = self.holders.len() < permits as usize;
                let free = match slot {
                    None => true,
                    Some(s) => {
                        s < permits
                            && !self
                                .holders
                                .iter()
                                .any(|h| h.kind == HoldKind::Slot(Some(s)))
                    }
                };
                slots && room && free
            }
        }
    }

    /// Whether a grant of `kind` may carry token `t` here.
    fn token_fits(&self, kind: Kind, t: u64) -> bool {
        let joins = t > self.last_token || (t == self.last_token && self.joinable);
        match kind {
            Kind::Exclusive => t > self.last_token,
            Kind::Shared => joins && t > self.last_exclusive,
            Kind::Slot { .. } => joins,
        }
    }

    fn with_holder(&self, h: Holder) -> LockState {
        let mut next = self.clone();
        let at = next.holders.partition_point(|x| *x < h);
        next.holders.insert(at, h);
        next
    }

    /// A hold ends: no later grant joins the transaction before it.
    fn without(&self, at: usize) -> LockState {
        let mut next = self.clone();
        next.holders.remove(at);
        next.joinable = false;
        next
    }

    /// Whether a shared grant to `process` converts its exclusive hold.
    fn is_downgrade(&self, process: u32) -> bool {
        matches!(
            self.holders.as_slice(),
            [h] if h.process == process && h.kind == HoldKind::Exclusive
        )
    }

    /// Applies `op`; `None` if it cannot happen here. An optional operation
    /// that would change nothing also returns `None`: linearizing it is the
    /// same as leaving it out, and leaving it out keeps the search small.
    pub(crate) fn step(&self, op: &ModelOp) -> Option<LockState> {
        let next = match op.effect {
            Effect::Grant {
                token: Some(t),
                kind: Kind::Shared,
            } if self.is_downgrade(op.process) => {
                // A downgrade: the process's exclusive hold becomes a shared
                // one in one transaction, with a new token.
                if t <= self.last_token {
                    return None;
                }
                LockState {
                    holders: vec![Holder {
                        process: op.process,
                        token: Some(t),
                        kind: HoldKind::Shared,
                    }],
                    last_token: t,
                    last_exclusive: self.last_exclusive,
                    joinable: true,
                }
            }
            Effect::Grant { token, kind } => {
                if !self.admits(kind) {
                    return None;
                }
                let held = HoldKind::from(kind);
                let mut next = self.with_holder(Holder {
                    process: op.process,
                    token,
                    kind: held,
                });
                if let Some(t) = token {
                    if !self.token_fits(kind, t) {
                        return None;
                    }
                    next.last_token = self.last_token.max(t);
                    next.joinable = true;
                    if kind == Kind::Exclusive {
                        next.last_exclusive = t;
                    }
                }
                next
            }
            Effect::MaybeGrant { kind } => {
                if !self.admits(kind) {
                    return None;
                }
                self.with_holder(Holder {
                    process: op.process,
                    token: None,
                    kind: HoldKind::from(kind),
                })
            }
            Effect::Release { token, kind } => {
                // A holder whose token is unknown matches any release by
                // its process.
                let at = self.holders.iter().position(|h| {
                    h.process == op.process
                        && kind.names(h.kind)
                        && (h.token.is_none() || token.is_none() || h.token == token)
                })?;
                self.without(at)
            }
            Effect::Expire { token, kind } => {
                // An expire that names a token is about that grant only.
                let at = self.holders.iter().position(|h| {
                    h.process == op.process
                        && kind.names(h.kind)
                        && (token.is_none() || h.token == token)
                })?;
                self.without(at)
            }
            Effect::Advance => LockState {
                holders: Vec::new(),
                last_token: self.last_token,
                last_exclusive: self.last_exclusive,
                joinable: false,
            },
        };
        if !op.required && next == *self {
            return None;
        }
        Some(next)
    }

    /// Whether an optional release/expire naming `token` can never apply
    /// again from this state on: its grant is in the past (an exclusive
    /// grant's token is never granted again once a token as large was; a
    /// shared or slot grant's, once a larger one was) and is not held now.
    pub(crate) fn outlived(&self, op: &ModelOp) -> bool {
        let Some(t) = op.named_token() else {
            return false;
        };
        if t > self.last_token || (t == self.last_token && op.names_a_sharing_kind()) {
            return false;
        }
        let still_applies = self.holders.iter().any(|h| {
            h.process == op.process
                && (h.token == Some(t)
                    || (h.token.is_none() && matches!(op.effect, Effect::Release { .. })))
        });
        !still_applies
    }
}

impl From<Kind> for HoldKind {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Exclusive => HoldKind::Exclusive,
            Kind::Shared => HoldKind::Shared,
            Kind::Slot { slot, .. } => HoldKind::Slot(slot),
        }
    }
}

/// The operations of one key (plus every advance), ready for the search.
#[derive(Debug, Clone, Default)]
pub(crate) struct Partition {
    pub(crate) ops: Vec<ModelOp>,
}

/// Splits the history per key. Writes, guarded reads and faults are not
/// part of the lock model; failed acquires, releases and advances change nothing and are left
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
        let kind = Kind::of(o.mode, o.slot, o.permits);
        let (effect, required) = match (o.f, outcome) {
            (Function::Acquire, Some(Outcome::Ok)) => (
                Effect::Grant {
                    token: o.subject_token(),
                    kind,
                },
                true,
            ),
            (Function::Acquire, Some(Outcome::Fail)) => continue,
            (Function::Acquire, _) => (Effect::MaybeGrant { kind }, false),
            (Function::Release, Some(Outcome::Fail)) => continue,
            (Function::Release, _) => (
                Effect::Release {
                    token: o.token,
                    kind,
                },
                definite,
            ),
            (Function::Expire, Some(Outcome::Fail)) => continue,
            (Function::Expire, _) => (
                Effect::Expire {
                    token: o.token,
                    kind,
                },
                false,
            ),
            (Function::Advance, Some(Outcome::Fail)) => continue,
            (Function::Advance, _) => (Effect::Advance, definite),
            (Function::Write | Function::Read | Function::Fault, _) => continue,
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
        let g = op(
            1,
            Effect::Grant {
                token: Some(5),
                kind: Kind::Exclusive,
            },
            true,
        );
        let held = s.step(&g).unwrap();
        assert_eq!(held.last_token, 5);
        assert_eq!(
            held.step(&op(
                2,
                Effect::Grant {
                    token: Some(6),
                    kind: Kind::Exclusive
                },
                true
            )),
            None
        );
        let freed = held
            .step(&op(
                1,
                Effect::Release {
                    token: Some(5),
                    kind: Kind::Exclusive,
                },
                true,
            ))
            .unwrap();
        assert_eq!(
            freed.step(&op(
                2,
                Effect::Grant {
                    token: Some(5),
                    kind: Kind::Exclusive
                },
                true
            )),
            None
        );
        assert!(
            freed
                .step(&op(
                    2,
                    Effect::Grant {
                        token: Some(6),
                        kind: Kind::Exclusive
                    },
                    true
                ))
                .is_some()
        );
    }

    #[test]
    fn optional_no_ops_are_not_steps() {
        let s = LockState::default();
        assert_eq!(
            s.step(&op(
                1,
                Effect::Expire {
                    token: None,
                    kind: Kind::Exclusive
                },
                false
            )),
            None
        );
        assert_eq!(s.step(&op(0, Effect::Advance, false)), None);
        assert!(s.step(&op(0, Effect::Advance, true)).is_some());
    }

    #[test]
    fn unknown_token_holder_matches_releases_but_not_named_expires() {
        let s = LockState::default()
            .step(&op(
                1,
                Effect::MaybeGrant {
                    kind: Kind::Exclusive,
                },
                false,
            ))
            .unwrap();
        assert!(
            s.step(&op(
                1,
                Effect::Release {
                    token: Some(9),
                    kind: Kind::Exclusive
                },
                true
            ))
            .is_some()
        );
        assert!(
            s.step(&op(
                1,
                Effect::Expire {
                    token: None,
                    kind: Kind::Exclusive
                },
                false
            ))
            .is_some()
        );
        assert_eq!(
            s.step(&op(
                1,
                Effect::Expire {
                    token: Some(9),
                    kind: Kind::Exclusive
                },
                false
            )),
            None
        );
        assert_eq!(
            s.step(&op(
                2,
                Effect::Release {
                    token: None,
                    kind: Kind::Exclusive
                },
                true
            )),
            None
        );
    }
}
