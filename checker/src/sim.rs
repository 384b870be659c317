//! A reference simulation of the lock service, for tests. It runs the lock
//! service's rules one step at a time (each step is an operation's
//! linearization point), with real tokens, unknown outcomes, crashed
//! holders whose leases expire, epoch advances and a fenced resource; then
//! it widens every operation into an interval around its point, keeping
//! each process sequential. The result is valid by construction.

use std::collections::{BTreeMap, HashMap};

use crate::history::{Completion, Function, History, Mode, Operation, Outcome, token};

const STEP: u64 = 1_000_000;
const BASE: u64 = 1_000_000_000;

/// A small deterministic generator (splitmix64), so a seed is a history.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct SimConfig {
    pub(crate) keys: usize,
    pub(crate) processes: usize,
    /// Stop once at least this many operations were recorded.
    pub(crate) min_ops: usize,
    /// How far (in steps of one operation) an interval may reach either
    /// side of its point: more spread, more overlap.
    pub(crate) spread: u64,
    pub(crate) seed: u64,
}

struct Planned {
    process: usize,
    f: Function,
    key: Option<usize>,
    token: Option<u64>,
    /// `None`: no complete line.
    outcome: Option<Outcome>,
    granted: Option<u64>,
    seq: Option<i64>,
    detail: Option<String>,
    lin: u64,
    /// Expiries and faults are written by the gate, not by the process:
    /// they sit at their point and are not part of the process's sequence.
    asynchronous: bool,
}

/// A grant the service still holds but nobody will release.
struct Abandoned {
    key: usize,
    process: usize,
    /// What the history knows of its token.
    known: Option<u64>,
    real: u64,
}

pub(crate) fn simulate(cfg: SimConfig) -> History {
    let mut rng = Rng::new(cfg.seed);
    let processes = cfg.processes.max(1);
    let keys = cfg.keys.max(1);
    let nemesis = processes;
    let mut holder: Vec<Option<(usize, u64)>> = vec![None; keys];
    let mut resource_max: Vec<u64> = vec![0; keys];
    let mut seq: Vec<i64> = vec![0; keys];
    let mut belief: Vec<Option<(usize, u64)>> = vec![None; processes];
    let mut abandoned: Vec<Abandoned> = Vec::new();
    let mut late_expiries: Vec<(usize, usize, u64)> = Vec::new();
    let mut revision: u64 = 0;
    let mut epoch: u32 = 1;
    let mut plan: Vec<Planned> = Vec::new();
    let mut step: u64 = 0;

    let unknown = |rng: &mut Rng| {
        if rng.chance(50) {
            Some(Outcome::Unknown)
        } else {
            None
        }
    };

    while plan.len() < cfg.min_ops {
        step += 1;
        let lin = BASE + step * STEP;
        let op = |process: usize,
                  f: Function,
                  key: Option<usize>,
                  tok: Option<u64>,
                  outcome: Option<Outcome>,
                  lin: u64| Planned {
            process,
            f,
            key,
            token: tok,
            outcome,
            granted: None,
            seq: None,
            detail: None,
            lin,
            asynchronous: false,
        };
        let dice = rng.below(100);
        if dice < 1 {
            let (outcome, effect) = match rng.below(20) {
                0..=16 => (Some(Outcome::Ok), true),
                17 | 18 => (unknown(&mut rng), true),
                _ => (unknown(&mut rng), false),
            };
            if effect {
                epoch += 1;
                holder.iter_mut().for_each(|h| *h = None);
            }
            plan.push(op(nemesis, Function::Advance, None, None, outcome, lin));
        } else if dice < 2 {
            let mut fault = op(nemesis, Function::Fault, None, None, None, lin);
            fault.detail = Some(format!("kill etcd-{}", rng.below(3) + 1));
            fault.asynchronous = true;
            plan.push(fault);
        } else if dice < 12 && !abandoned.is_empty() {
            let a = abandoned.swap_remove(rng.below(abandoned.len() as u64) as usize);
            if holder[a.key] == Some((a.process, a.real)) {
                holder[a.key] = None;
            }
            let outcome = if rng.chance(20) {
                Some(Outcome::Unknown)
            } else {
                None
            };
            let mut e = op(
                a.process,
                Function::Expire,
                Some(a.key),
                a.known,
                outcome,
                lin,
            );
            e.asynchronous = true;
            plan.push(e);
        } else if dice < 20 && !late_expiries.is_empty() {
            let (k, p, t) =
                late_expiries.swap_remove(rng.below(late_expiries.len() as u64) as usize);
            let mut e = op(p, Function::Expire, Some(k), Some(t), None, lin);
            e.asynchronous = true;
            plan.push(e);
        } else {
            let p = rng.below(processes as u64) as usize;
            match belief[p] {
                Some((k, t)) if holder[k] == Some((p, t)) => match rng.below(100) {
                    0..=44 => {
                        let mut w = op(p, Function::Write, Some(k), Some(t), None, lin);
                        // The reference fence: strictly above the mark, so a
                        // grant's second write to its record is refused.
                        let accepts = t > resource_max[k];
                        let landed = if rng.chance(90) {
                            w.outcome = Some(if accepts { Outcome::Ok } else { Outcome::Fail });
                            accepts
                        } else {
                            w.outcome = unknown(&mut rng);
                            accepts && rng.chance(50)
                        };
                        if landed {
                            seq[k] += 1;
                            resource_max[k] = resource_max[k].max(t);
                            if w.outcome == Some(Outcome::Ok) {
                                w.seq = Some(seq[k]);
                            }
                        }
                        plan.push(w);
                    }
                    45..=79 => {
                        let mut r = op(p, Function::Release, Some(k), Some(t), None, lin);
                        let effect = if rng.chance(85) {
                            r.outcome = Some(Outcome::Ok);
                            true
                        } else {
                            r.outcome = unknown(&mut rng);
                            rng.chance(50)
                        };
                        if effect {
                            holder[k] = None;
                            if rng.chance(50) {
                                late_expiries.push((k, p, t));
                            }
                        } else {
                            abandoned.push(Abandoned {
                                key: k,
                                process: p,
                                known: Some(t),
                                real: t,
                            });
                        }
                        belief[p] = None;
                        plan.push(r);
                    }
                    80..=87 => {
                        // The holder crashes: nobody releases, the lease runs out.
                        belief[p] = None;
                        abandoned.push(Abandoned {
                            key: k,
                            process: p,
                            known: Some(t),
                            real: t,
                        });
                    }
                    _ => {}
                },
                Some((k, t)) => {
                    // A zombie: its grant is gone (an epoch advance dropped it).
                    if rng.chance(50) {
                        let mut w = op(p, Function::Write, Some(k), Some(t), None, lin);
                        if t > resource_max[k] {
                            seq[k] += 1;
                            resource_max[k] = t;
                            w.outcome = Some(Outcome::Ok);
                            w.seq = Some(seq[k]);
                        } else {
                            w.outcome = Some(Outcome::Fail);
                        }
                        plan.push(w);
                    } else {
                        belief[p] = None;
                        plan.push(op(
                            p,
                            Function::Release,
                            Some(k),
                            Some(t),
                            Some(Outcome::Fail),
                            lin,
                        ));
                    }
                }
                None => {
                    let k = rng.below(keys as u64) as usize;
                    let mut a = op(p, Function::Acquire, Some(k), None, None, lin);
                    if holder[k].is_none() {
                        let roll = rng.below(100);
                        if roll < 90 {
                            revision += 2 + rng.below(3);
                            let t = token(epoch, revision);
                            holder[k] = Some((p, t));
                            if roll < 80 {
                                a.outcome = Some(Outcome::Ok);
                                a.granted = Some(t);
                                belief[p] = Some((k, t));
                            } else {
                                a.outcome = unknown(&mut rng);
                                abandoned.push(Abandoned {
                                    key: k,
                                    process: p,
                                    known: None,
                                    real: t,
                                });
                            }
                        } else {
                            a.outcome = unknown(&mut rng);
                        }
                    } else if rng.chance(90) {
                        a.outcome = Some(Outcome::Fail);
                    } else {
                        a.outcome = unknown(&mut rng);
                    }
                    plan.push(a);
                }
            }
        }
    }
    widen(&plan, processes, cfg.spread.max(1) * STEP, &mut rng)
}

/// Gives every planned operation an interval around its point, keeping
/// each process's operations one after another.
fn widen(plan: &[Planned], processes: usize, spread: u64, rng: &mut Rng) -> History {
    let name = |p: usize| {
        if p >= processes {
            "nemesis".to_string()
        } else {
            format!("w{p}")
        }
    };
    // Ordered: the rng is drawn per process in this order, so a seed gives
    // one history (a HashMap's order differs from run to run).
    let mut sequences: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, p) in plan.iter().enumerate() {
        if !p.asynchronous {
            sequences.entry(p.process).or_default().push(i);
        }
    }
    let mut times: Vec<(u64, u64)> = plan
        .iter()
        .map(|p| (p.lin, p.lin + rng.below(STEP)))
        .collect();
    for list in sequences.values() {
        let mut prev_end = 0u64;
        for (n, &i) in list.iter().enumerate() {
            let lin = plan[i].lin;
            let lo = (prev_end + 1).max(lin.saturating_sub(spread));
            let hi = list
                .get(n + 1)
                .map_or(lin + spread, |&j| (plan[j].lin - 1).min(lin + spread));
            let invoke = lo + rng.below(lin - lo + 1);
            let complete = lin + rng.below(hi - lin + 1);
            times[i] = (invoke, complete);
            prev_end = complete;
        }
    }
    let mut order: Vec<usize> = (0..plan.len()).collect();
    order.sort_by_key(|&i| (times[i].0, i));
    let mut counters: HashMap<usize, u64> = HashMap::new();
    let ops = order
        .into_iter()
        .map(|i| {
            let p = &plan[i];
            let counter = counters.entry(p.process).or_insert(0);
            *counter += 1;
            let (invoke, complete) = times[i];
            Operation {
                process: name(p.process),
                op: *counter,
                f: p.f,
                key: p.key.map(|k| format!("bench/gate/k{k}")),
                token: p.token,
                detail: p.detail.clone(),
                invoke_time: invoke,
                completion: p.outcome.map(|outcome| Completion {
                    outcome,
                    time: complete,
                    token: p.granted,
                    seq: p.seq,
                    term: None,
                    detail: None,
                }),
                mode: Mode::Exclusive,
                permits: None,
                slot: None,
            }
        })
        .collect();
    History::from_ops(ops)
}
