//! The Latchkey client library: what a workload links to take locks and to
//! lead elections.
//!
//! It speaks `latchkey.lock.v1`, `latchkey.election.v1` (and the operator
//! calls of `admin.v1`) to the arbiter through its Envoy, under the workload's SPIFFE identity, and keeps
//! the fencing semantics on this side of the wire: a grant comes with a
//! [`FencingToken`] to present at the resource, and a hold this process can
//! no longer vouch for is *fenced* before anyone else can be granted the key.
//! The CLI, `latchctl`, is a separate crate built on this one.
//!
//! # Quick start
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use latchkey_client::{Client, ClientConfig, TlsFiles};
//!
//! # async fn run() -> Result<(), latchkey_client::Error> {
//! // The workload's X.509 SVID is its identity at the arbiter.
//! let client = Client::connect(ClientConfig::tls(
//!     "https://latchkey.example:7443",
//!     TlsFiles {
//!         ca: "/run/spiffe/bundle.pem".into(),
//!         cert: "/run/spiffe/svid.pem".into(),
//!         key: "/run/spiffe/svid.key".into(),
//!     },
//! ))
//! .await?;
//!
//! // Take `jobs/nightly` under the `jobs` class, queueing up to 30 s.
//! let guard = client
//!     .lock("jobs/nightly", "jobs")
//!     .wait(Duration::from_secs(30))
//!     .acquire(|reason| eprintln!("lock lost: {reason}; stop writing"))
//!     .await?;
//!
//! // Hand the token to the resource with every write it must fence.
//! let token: u64 = guard.token().get();
//! # let _ = token;
//! while guard.can_start() {
//!     // ... one unit of work, its writes conditional on `token` ...
//! #   break;
//! }
//! guard.release().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # How a lock flows through the library
//!
//! [`Client::connect`] opens one gRPC channel to the arbiter's Envoy under
//! the workload's SPIFFE identity (its X.509 SVID over mTLS, or a header in
//! the insecure dev mode). [`Client::lock`]`(key, class)` starts a
//! [`LockBuilder`]; its [`acquire`](LockBuilder::acquire)`(on_fence)` first
//! finds the [`Session`] for the class's TTL (one arbiter lease per TTL per
//! client, opened on first use with the ids of this client's live sessions
//! offered for reuse), then consults the session's re-entrancy table: a key
//! already held on the session just gets another [`LockGuard`] of the same
//! hold; otherwise Acquire is sent and the grant, with its [`FencingToken`],
//! becomes the hold.
//!
//! Meanwhile the session's keepalive task renews the lease over one
//! bidirectional stream and keeps two stages: after the first failed
//! keepalive [`LockGuard::can_start`] is false (finish, do not start new
//! work), and when the send time of the last successful renewal plus the TTL
//! minus one second passes, every hold's `on_fence` fires once with a
//! [`FenceReason`]. Releasing (or dropping) the last guard of a hold sends
//! Release.
//!
//! The SVID files are looked at again, at most once a second, from the
//! calls themselves: SPIRE rotates an SVID every hour, and a client lives
//! longer. Once changed files have stayed as they are for one look, later
//! calls and streams present the new certificate on a new channel; calls and
//! streams already open keep theirs, and no hold is fenced for it
//! ([`Client::svid_reloads`] counts the rotations taken up). latchctl, built
//! on this library, does the same.
//!
//! # How a leadership flows through the library
//!
//! [`Client::campaign`]`(election, class, value, options)` runs on the same
//! sessions as locks (an election class's TTL; one lease per TTL per
//! client). A session that already leads the election gets another guard of
//! its [`Leadership`]; otherwise Campaign stands the session as a candidate
//! and waits until it leads (or [`CampaignOptions::wait`] runs out). The
//! leadership then has two watchers: the session's fence (the same deadline
//! as a hold's, its expiry, its close) and an Observe stream of the
//! election that reports a later term or a vacancy (operators forcing it
//! out, the lease revoked). The first to fire resolves
//! [`Leadership::lost`] and cancels [`Leadership::cancellation_token`],
//! once. [`Leadership::resign`] (or dropping the last guard) hands the
//! election to the next candidate; [`Leadership::transfer`] to a named one.
//!
//! [`Client::lead`] is the loop most services want: it campaigns, runs a
//! body while leading, drops the body at the loss, and campaigns again by
//! itself, until the body returns or the caller drops the future.
//!
//! ```no_run
//! use latchkey_client::CampaignOptions;
//!
//! # async fn run(client: latchkey_client::Client) -> Result<(), latchkey_client::Error> {
//! client
//!     .lead("jobs/scheduler", "election", "pod-a:8080", CampaignOptions::default(), |leadership| async move {
//!         // Runs only while this process leads; dropped at the fence deadline.
//!         let token: u64 = leadership.token().get(); // fence every write with it
//! #       let _ = token;
//!         loop {
//!             // ... schedule ...
//!             tokio::time::sleep(std::time::Duration::from_secs(1)).await;
//!         }
//!     })
//!     .await
//! # }
//! ```
//!
//! Errors are one type, [`Error`]: a refusal carries the gRPC code and a
//! [`Reason`], and [`Error::is_transient`] says whether retrying as is can
//! help. Tokens never appear in `Debug`, `Display`, errors or logs.
//!
//! # Entry points
//!
//! | to | call |
//! |---|---|
//! | connect | [`Client::connect`] with [`ClientConfig::tls`] (or [`ClientConfig::insecure_dev`]) |
//! | take a key | [`Client::lock`] → [`LockBuilder::acquire`] → [`LockGuard`] |
//! | give it back | [`LockGuard::release`] (or drop the guard), [`LockGuard::detach`] to keep it |
//! | read beside others | [`LockBuilder::shared`]; [`LockGuard::downgrade`] turns a held exclusive lock shared |
//! | check before work | [`LockGuard::can_start`], [`LockGuard::fence_deadline`] |
//! | group holds on one lease | [`Client::open_session`], [`LockBuilder::session`], [`Session::close`] |
//! | see who holds a key | [`Client::inspect`] |
//! | lead an election | [`Client::campaign`] → [`Leadership`] ([`Leadership::proclaim`], [`Leadership::resign`], [`Leadership::transfer`]) |
//! | lead, and stand again after losing | [`Client::lead`] |
//! | watch an election | [`Client::observe`] → [`ElectionEvents`], [`Client::leader`], [`Client::candidates`] |
//! | release a grant by its token | [`Client::release_grant`] |
//! | operator calls | [`Client::admin_status`], [`Client::advance_epoch`], [`Client::request_force_release`] |

#![warn(missing_docs)]

mod client;
mod config;
mod election;
mod error;
mod lock;
mod rpc;
mod session;
mod token;

pub use client::{Client, Holder, Inspection};
pub use config::{ClientConfig, TlsFiles, default_instance};
pub use election::{
    CampaignOptions, Candidate, ElectionEvent, ElectionEvents, Leader, Leadership, LeadershipLost,
    TransferTo, VacancyReason,
};
pub use error::{EDGE_POLICY_NOT_READY, EDGE_POLICY_STALE, Error, StatusSource};
/// Why the arbiter refused a call: the `google.rpc.ErrorInfo` reason of a
/// refusal in the `latchkey.dev` domain (see [`Error::reason`]).
pub use latchkey_proto::lockv1::Reason;
pub use lock::{LockBuilder, LockGuard};
pub use rpc::DEV_IDENTITY_HEADER;
pub use session::{FenceReason, Session};
pub use token::FencingToken;
/// The gRPC status code of a refusal ([`Error::Refused`]'s `code`).
pub use tonic::Code;

/// The README's client example, compiled by `cargo test --doc` so it stays
/// true to this crate's API.
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeExample;
