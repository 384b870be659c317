//! The one crate that names `etcd_client`: how Latchkey connects to etcd,
//! and the few things every caller of etcd does the same way. The arbiter's
//! lock log, its coord-cluster records (witness, shard map, tier bindings),
//! force-release, the audit tailer and the tests' harnesses all go through
//! it, so a change of etcd client, of TLS or of failover is made here once.
//!
//! A request flows like this: a caller describes the cluster once
//! ([`Connection`]: endpoints, TLS, login, deadlines) and [`connect`]s,
//! getting etcd-client's [`Client`]. It builds requests with etcd-client's
//! own vocabulary, re-exported here by kind ([`kv`], [`txn`], [`watch`],
//! [`lease`], [`auth`], [`lock`], [`election`]) rather than wrapped in a
//! second one, and sends them through the client, or through the helper
//! for a pattern every caller repeats ([`kv::get_one`], [`kv::head`],
//! [`kv::count_prefix`], [`txn::run`], [`watch::watch_from`],
//! [`scan::scan_prefix`]). A failure comes back as an [`Error`] whose
//! [`Error::kind`] says what it was (unreachable, compacted, permission, a
//! lease gone...), with etcd-client's message and cause kept. What the
//! keys and answers mean is the caller's: nothing here knows the key layout
//! or the grant protocol.

mod connect;
mod error;
pub mod failover;
pub mod kv;
pub mod scan;
pub mod txn;
pub mod watch;

pub use connect::{Connection, KeepAlive, Login, TlsPem, connect};
pub use error::{Error, ErrorKind};
pub use etcd_client::{Client, KeyValue, ResponseHeader};

/// Leases: grants, revokes and keep-alive streams.
pub mod lease {
    pub use etcd_client::{
        LeaseClient, LeaseGrantOptions, LeaseGrantResponse, LeaseKeepAliveResponse,
        LeaseKeepAliveStream, LeaseKeeper, LeaseTimeToLiveOptions,
    };
}

/// Users, roles and their permissions (the tests set up restricted roles).
pub mod auth {
    pub use etcd_client::{Permission, PermissionType};
}

/// etcd's own lock API (the benchmarks compare Latchkey with it).
pub mod lock {
    pub use etcd_client::LockOptions;
}

/// etcd's own election API (`election-bench` compares Latchkey's with it).
pub mod election {
    pub use etcd_client::{LeaderKey, ResignOptions};
}
