//! Wing–Gong / Lowe linearizability search for one key, as in Porcupine.
//!
//! Every operation contributes a *call* entry and (if required) a *return*
//! entry to one doubly linked list in time order (calls first at equal
//! times, since an operation precedes another only if it returned strictly
//! before the other was invoked). Walking the list from the head, a call
//! entry is a candidate to linearize next; meeting a return entry means that
//! operation should already have been linearized, so the search backtracks.
//! Linearizing an operation "lifts" both its entries out of the list
//! (dancing links), and backtracking puts them back.
//!
//! The cache holds `(linearized set, state)` pairs already explored, as a
//! 128-bit fingerprint: a Zobrist hash of the set (updated by one XOR per
//! step) mixed with a hash of the state. It is bounded; when full, the
//! search goes on without caching (slower, never wrong).
//!
//! Optional operations (unknown outcomes, expiries) would multiply the
//! search, so ones that can no longer apply are *resolved* (marked as done
//! and lifted) as soon as that is certain:
//! - a release/expire naming a grant older than the newest one granted,
//!   when that grant is not the holder (tokens only grow, so it never is
//!   again);
//! - any optional operation of a process once a definite (required)
//!   operation of that process on this key, invoked after it, has been
//!   linearized: the process has moved on, and its expiry or unknown call
//!   concerned the grant it had then.
//!
//! Resolving is part of the step, so it is undone on backtracking.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

#[cfg(test)]
use crate::model::Kind;
use crate::model::{Effect, HoldKind, LockState, ModelOp};

const NIL: usize = usize::MAX;
const HEAD: usize = 0;

/// Bounds on one key's search.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_states: u64,
    pub(crate) max_cache_entries: usize,
}

/// The deepest point a failed search reached (Porcupine's partial
/// linearization).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Failure {
    /// Indices into the partition's ops, in linearization order.
    pub(crate) longest: Vec<usize>,
    /// The operation that could not be linearized after `longest`.
    pub(crate) stuck: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SearchResult {
    Linearizable { states: u64 },
    NotLinearizable { states: u64, failure: Failure },
    Inconclusive { states: u64 },
}

struct Frame {
    node: usize,
    op: usize,
    prev: LockState,
    kills_from: usize,
    watermark: Option<(usize, usize)>,
}

/// The entry list: node 0 is the head sentinel.
struct Entries {
    next: Vec<usize>,
    prev: Vec<usize>,
    op: Vec<usize>,
    is_call: Vec<bool>,
    call_node: Vec<usize>,
    ret_node: Vec<usize>,
}

impl Entries {
    fn new(ops: &[ModelOp]) -> Self {
        let mut timed: Vec<(u64, u8, usize)> = Vec::with_capacity(ops.len() * 2);
        for (i, o) in ops.iter().enumerate() {
            timed.push((o.call, 0, i));
            if o.required {
                timed.push((o.ret, 1, i));
            }
        }
        timed.sort_unstable();
        let m = timed.len();
        let mut e = Entries {
            next: (0..=m).map(|k| if k < m { k + 1 } else { NIL }).collect(),
            prev: (0..=m).map(|k| if k > 0 { k - 1 } else { NIL }).collect(),
            op: vec![NIL; m + 1],
            is_call: vec![false; m + 1],
            call_node: vec![NIL; ops.len()],
            ret_node: vec![NIL; ops.len()],
        };
        for (k, (_, kind, i)) in timed.into_iter().enumerate() {
            let node = k + 1;
            e.op[node] = i;
            if kind == 0 {
                e.is_call[node] = true;
                e.call_node[i] = node;
            } else {
                e.ret_node[i] = node;
            }
        }
        e
    }

    fn unlink(&mut self, x: usize) {
        let (p, n) = (self.prev[x], self.next[x]);
        self.next[p] = n;
        if n != NIL {
            self.prev[n] = p;
        }
    }

    fn relink(&mut self, x: usize) {
        let (p, n) = (self.prev[x], self.next[x]);
        self.next[p] = x;
        if n != NIL {
            self.prev[n] = x;
        }
    }

    fn lift(&mut self, op: usize) {
        self.unlink(self.call_node[op]);
        let r = self.ret_node[op];
        if r != NIL {
            self.unlink(r);
        }
    }

    fn unlift(&mut self, op: usize) {
        let r = self.ret_node[op];
        if r != NIL {
            self.relink(r);
        }
        self.relink(self.call_node[op]);
    }
}

/// Searches for a linearization of one key's operations.
pub(crate) fn search(ops: &[ModelOp], limits: Limits) -> SearchResult {
    let n = ops.len();
    let mut list = Entries::new(ops);
    let zobrist: Vec<u128> = (0..n).map(zobrist_key).collect();

    // Optional operations per process, by invoke time (pruning rule 2).
    let processes = ops
        .iter()
        .map(|o| o.process as usize + 1)
        .max()
        .unwrap_or(0);
    let mut by_process: Vec<Vec<usize>> = vec![Vec::new(); processes];
    // Optional releases/expires naming a token, by token (pruning rule 1).
    let mut by_token: Vec<(u64, usize)> = Vec::new();
    for (i, o) in ops.iter().enumerate() {
        if o.required || o.effect == Effect::Advance {
            continue;
        }
        if let Some(list) = by_process.get_mut(o.process as usize) {
            list.push(i);
        }
        if let Some(t) = o.named_token() {
            by_token.push((t, i));
        }
    }
    for list in &mut by_process {
        list.sort_by_key(|&i| (ops[i].call, i));
    }
    by_token.sort_unstable();

    let mut done = vec![false; n];
    let mut hash: u128 = 0;
    let mut state = LockState::default();
    let mut remaining = ops.iter().filter(|o| o.required).count();
    let mut stack: Vec<Frame> = Vec::new();
    let mut kills: Vec<usize> = Vec::new();
    let mut scratch: Vec<usize> = Vec::new();
    let mut watermark = vec![0usize; processes];
    let mut cache: HashSet<u128, BuildHasherDefault<Fingerprint>> = HashSet::default();
    let mut states: u64 = 0;
    let mut failure = Failure::default();
    // Computed on demand for the current node; reset on every step.
    let mut blocked: Option<Blocked> = None;

    let mut entry = list.next[HEAD];
    loop {
        if remaining == 0 {
            return SearchResult::Linearizable { states };
        }
        if entry == NIL || !list.is_call[entry] {
            // This operation's return came before it was linearized.
            if failure.stuck.is_none() && stack.len() == failure.longest.len() && entry != NIL {
                failure.stuck = Some(list.op[entry]);
            }
            let Some(frame) = stack.pop() else {
                return SearchResult::NotLinearizable { states, failure };
            };
            while kills.len() > frame.kills_from {
                let Some(k) = kills.pop() else { break };
                list.unlift(k);
                done[k] = false;
                hash ^= zobrist[k];
            }
            if let Some((p, old)) = frame.watermark {
                watermark[p] = old;
            }
            list.unlift(frame.op);
            done[frame.op] = false;
            hash ^= zobrist[frame.op];
            state = frame.prev;
            if ops[frame.op].required {
                remaining += 1;
            }
            entry = list.next[frame.node];
            blocked = None;
            continue;
        }

        let i = list.op[entry];
        let op = &ops[i];
        let Some(next_state) = state.step(op) else {
            entry = list.next[entry];
            continue;
        };
        if !op.required {
            let useful = blocked.get_or_insert_with(|| Blocked::scan(&list, ops, &state));
            if !useful.admits(op) {
                entry = list.next[entry];
                continue;
            }
        }

        // What this step resolves.
        scratch.clear();
        let mut new_watermark = None;
        if op.required && op.effect != Effect::Advance {
            let p = op.process as usize;
            if let Some(mine) = by_process.get(p) {
                let upto = mine.partition_point(|&j| ops[j].call < op.call);
                let from = watermark[p];
                if upto > from {
                    scratch.extend(mine[from..upto].iter().copied().filter(|&j| !done[j]));
                    new_watermark = Some((p, upto));
                }
            }
        }
        let outlived = |j: usize, scratch: &[usize]| {
            j != i && !done[j] && !scratch.contains(&j) && next_state.outlived(&ops[j])
        };
        if next_state.last_token > state.last_token {
            // From the old floor itself: a shared or slot grant's token
            // equal to the floor could still come until the floor rose.
            let lo = by_token.partition_point(|&(t, _)| t < state.last_token);
            let hi = by_token.partition_point(|&(t, _)| t <= next_state.last_token);
            for &(_, j) in &by_token[lo..hi] {
                if outlived(j, &scratch) {
                    scratch.push(j);
                }
            }
        }
        // A hold that left: what names its token may be outlived now.
        for t in state
            .holders
            .iter()
            .filter(|h| !next_state.holders.contains(h))
            .filter_map(|h| h.token)
        {
            let lo = by_token.partition_point(|&(u, _)| u < t);
            let hi = by_token.partition_point(|&(u, _)| u <= t);
            for &(_, j) in &by_token[lo..hi] {
                if outlived(j, &scratch) {
                    scratch.push(j);
                }
            }
        }

        let mut next_hash = hash ^ zobrist[i];
        for &k in &scratch {
            next_hash ^= zobrist[k];
        }
        let key = next_hash ^ state_hash(&next_state);
        if cache.contains(&key) {
            entry = list.next[entry];
            continue;
        }
        if cache.len() < limits.max_cache_entries {
            cache.insert(key);
        }
        states += 1;
        if states > limits.max_states {
            return SearchResult::Inconclusive { states };
        }

        stack.push(Frame {
            node: entry,
            op: i,
            prev: std::mem::take(&mut state),
            kills_from: kills.len(),
            watermark: new_watermark.map(|(p, _)| (p, watermark[p])),
        });
        if let Some((p, upto)) = new_watermark {
            watermark[p] = upto;
        }
        list.lift(i);
        done[i] = true;
        for &k in &scratch {
            list.lift(k);
            done[k] = true;
            kills.push(k);
        }
        state = next_state;
        hash = next_hash;
        if op.required {
            remaining -= 1;
        }
        if stack.len() > failure.longest.len() {
            failure.longest = stack.iter().map(|f| f.op).collect();
            failure.stuck = None;
        }
        entry = list.next[HEAD];
        blocked = None;
    }
}

/// Which required operations among the current candidates cannot happen
/// in the current state. An optional operation is only worth linearizing
/// when it could unblock one of them: any linearization can be rewritten so
/// that each optional operation it uses comes right before the required
/// operation it enables (moving an optional operation later never breaks
/// real-time order, as it has no return), and between two required
/// operations at most a drop (release/expire/advance) and then an unknown
/// acquire matter. So a drop is worth it only for a blocked grant or
/// release, and an unknown acquire by `p` only for a blocked release by `p`.
struct Blocked {
    grant_or_release: bool,
    releasers: Vec<u32>,
}

impl Blocked {
    fn scan(list: &Entries, ops: &[ModelOp], state: &LockState) -> Self {
        let mut b = Blocked {
            grant_or_release: false,
            releasers: Vec::new(),
        };
        let mut node = list.next[HEAD];
        while node != NIL && list.is_call[node] {
            let op = &ops[list.op[node]];
            if op.required && state.step(op).is_none() {
                match op.effect {
                    Effect::Grant { .. } => b.grant_or_release = true,
                    Effect::Release { .. } => {
                        b.grant_or_release = true;
                        b.releasers.push(op.process);
                    }
                    _ => {}
                }
            }
            node = list.next[node];
        }
        b
    }

    fn admits(&self, op: &ModelOp) -> bool {
        match op.effect {
            Effect::MaybeGrant { .. } => self.releasers.contains(&op.process),
            _ => self.grant_or_release,
        }
    }
}

/// The cache keys are already uniform hashes: use them as they are.
#[derive(Default)]
struct Fingerprint(u64);

impl Hasher for Fingerprint {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64);
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn zobrist_key(i: usize) -> u128 {
    let lo = splitmix((i as u64).wrapping_mul(2));
    let hi = splitmix((i as u64).wrapping_mul(2) | 1);
    (u128::from(hi) << 64) | u128::from(lo)
}

fn state_hash(s: &LockState) -> u128 {
    let mix = |seed: u64| {
        let mut h = splitmix(seed);
        for v in [
            s.last_token,
            s.last_exclusive,
            s.holders.len() as u64,
            u64::from(s.joinable),
        ] {
            h = splitmix(h ^ v);
        }
        for holder in &s.holders {
            let (tag, slot) = match holder.kind {
                HoldKind::Exclusive => (1, 0),
                HoldKind::Shared => (2, 0),
                HoldKind::Slot(None) => (3, 0),
                HoldKind::Slot(Some(n)) => (4, u64::from(n)),
            };
            let token_tag = if holder.token.is_some() { 2 } else { 1 };
            for v in [
                u64::from(holder.process) + 1,
                tag,
                slot,
                token_tag,
                holder.token.unwrap_or(0),
            ] {
                h = splitmix(h ^ v);
            }
        }
        h
    };
    (u128::from(mix(0x5EED_0001)) << 64) | u128::from(mix(0x5EED_0002))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::NEVER;

    const LIMITS: Limits = Limits {
        max_states: 100_000,
        max_cache_entries: 100_000,
    };

    fn op(index: usize, process: u32, effect: Effect, call: u64, ret: Option<u64>) -> ModelOp {
        ModelOp {
            index,
            process,
            effect,
            required: ret.is_some(),
            call,
            ret: ret.unwrap_or(NEVER),
        }
    }

    #[test]
    fn concurrent_grants_linearize_in_token_order() {
        // p1's grant (token 5) and p2's (token 7) overlap; p1 releases
        // while p2's acquire is still in flight.
        let ops = [
            op(
                0,
                1,
                Effect::Grant {
                    token: Some(5),
                    kind: Kind::Exclusive,
                },
                0,
                Some(10),
            ),
            op(
                1,
                2,
                Effect::Grant {
                    token: Some(7),
                    kind: Kind::Exclusive,
                },
                1,
                Some(30),
            ),
            op(
                2,
                1,
                Effect::Release {
                    token: Some(5),
                    kind: Kind::Exclusive,
                },
                11,
                Some(20),
            ),
        ];
        assert!(matches!(
            search(&ops, LIMITS),
            SearchResult::Linearizable { .. }
        ));
    }

    #[test]
    fn reports_the_stuck_operation_and_prefix() {
        let ops = [
            op(
                0,
                1,
                Effect::Grant {
                    token: Some(5),
                    kind: Kind::Exclusive,
                },
                0,
                Some(10),
            ),
            op(
                1,
                2,
                Effect::Grant {
                    token: Some(7),
                    kind: Kind::Exclusive,
                },
                20,
                Some(30),
            ),
        ];
        let SearchResult::NotLinearizable { failure, .. } = search(&ops, LIMITS) else {
            panic!("expected a failure");
        };
        assert_eq!(failure.longest, vec![0]);
        assert_eq!(failure.stuck, Some(1));
    }

    #[test]
    fn budget_makes_it_inconclusive() {
        let ops = [
            op(
                0,
                1,
                Effect::Grant {
                    token: Some(5),
                    kind: Kind::Exclusive,
                },
                0,
                Some(10),
            ),
            op(
                1,
                1,
                Effect::Release {
                    token: Some(5),
                    kind: Kind::Exclusive,
                },
                11,
                Some(12),
            ),
        ];
        let tight = Limits {
            max_states: 1,
            max_cache_entries: 10,
        };
        assert!(matches!(
            search(&ops, tight),
            SearchResult::Inconclusive { .. }
        ));
    }
}
