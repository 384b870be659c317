//! The Latchkey client library: what a workload links to take locks.
//!
//! A lock flows through it like this. [`Client::connect`] opens one gRPC
//! channel to the arbiter's Envoy under the workload's SPIFFE identity (its
//! X.509 SVID over mTLS, or a header in the insecure dev mode).
//! [`Client::lock`]`(key, class).acquire(on_fence)` first finds the session
//! for the class's TTL (ADR-10: one arbiter lease per TTL per client, opened
//! on first use with the ids of this client's live sessions offered for
//! reuse), then consults the session's re-entrancy table (ADR-13): a key
//! already held on the session just gets another [`LockGuard`] of the same
//! hold; otherwise Acquire is sent and the grant, with its
//! [`FencingToken`], becomes the hold. Meanwhile the session's keepalive task
//! renews the lease over one bidirectional stream and keeps ADR-12's two
//! stages: after the first failed keepalive `can_start()` is false, and when
//! the send time of the last successful renewal plus the TTL minus one second
//! passes, every hold's `on_fence` fires once. Releasing (or dropping) the
//! last guard of a hold sends Release. Tokens never appear in `Debug`,
//! `Display`, errors or logs.
//!
//! [`cli`] is latchctl, the shell's way into the same calls; the binaries
//! are thin wrappers around [`cli::main`].

#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod cli;
mod client;
pub mod config;
pub mod dev_certs;
pub mod error;
mod lock;
mod rpc;
mod session;
mod token;

pub use client::{Client, Holder, Inspection};
pub use config::{ClientConfig, TlsFiles};
pub use error::{EDGE_POLICY_NOT_READY, EDGE_POLICY_STALE, Error};
pub use latchkey_proto::lockv1::Reason;
pub use lock::{LockBuilder, LockGuard};
pub use rpc::DEV_IDENTITY_HEADER;
pub use session::{FenceReason, Session};
pub use token::FencingToken;
