//! `latchkey-audit`: the audit trail of ADR-21, tailed from the lock log.
//!
//! The arbiter is the only writer of the lock log, and it writes no audit
//! events (a dual write loses events on a crash, and expiries are
//! committed by etcd itself, where no application code sees them). The
//! tailer, one per etcd cluster, watches the whole prefix from its
//! checkpoint instead, and turns each revision into events:
//!
//! ```text
//! etcd watch ─▶ tailer::etcd (changes grouped by revision)
//!            ─▶ derive::LogState::apply (holds, sessions, elections, epoch → events)
//!            ─▶ store::AuditStore::write (ON CONFLICT DO NOTHING / ReplacingMergeTree),
//!               revisions replaced by ids keyed by the audit key (pseudonym)
//!            ─▶ checkpoint every few seconds, after the events it covers, sealed
//! ```
//!
//! A revision is a fencing token's low half, so none reaches the store, the
//! tailer's log or its metrics: the store is read by more people than hold
//! tokens, and keeps what it has for years.
//!
//! Without the `tailer` feature the crate is the event model and the
//! stores, which `latchctl audit` and `latchctl why` read.

pub mod event;
pub mod force;
pub mod pseudonym;
pub mod spool;
pub mod store;
pub mod text;

#[cfg(feature = "tailer")]
pub mod cli;
#[cfg(feature = "tailer")]
pub mod derive;
#[cfg(feature = "tailer")]
pub mod metrics;
#[cfg(feature = "tailer")]
pub mod records;
#[cfg(feature = "tailer")]
pub mod tailer;

pub use event::{Ended, Event, Kind, RecordedEvent, StoredEvent};
pub use pseudonym::AuditKey;
pub use store::{AuditStore, HistoryQuery, StoreError, StoreOptions};
