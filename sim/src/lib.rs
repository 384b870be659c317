//! Deterministic simulation of the grant protocol.
//!
//! - [`memlog`]: [`MemLog`], an in-memory lock log with etcd's semantics
//!   (one revision counter, leases on tokio's clock, watches, compaction,
//!   snapshot and restore) and faults drawn from a seed.
//! - [`rng`]: the seeded generator every random choice comes from.
//! - [`simulation`]: seeded runs of the arbiters' lock tables over a [`MemLog`] under faults, judged by `latchkey-checker`.
//! - [`witness`]: [`MemWitness`], the coord cluster's witness in memory
//!   (issue 15), with faults and snapshot and restore.

pub mod memlog;
pub mod rng;
pub mod simulation;
pub mod witness;

pub use memlog::{
    BatchCounts, ClusterId, CompactError, FaultCounts, FaultRates, MemLog, MemLogConfig, Snapshot,
};
pub use rng::Rng;
pub use witness::{MemWitness, WitnessCalls, WitnessSnapshot};
