//! Where each record lives in the store (the same shape as the arbiter's
//! etcd layout, without a prefix).

pub const HOLDERS: &str = "l/";
pub const WAITERS: &str = "q/";
pub const CLAIMS: &str = "c/";
pub const SESSION_INDEX: &str = "si/";

pub fn epoch() -> String {
    "sys/epoch".into()
}
pub fn seal() -> String {
    "sys/seal".into()
}
pub fn coord_seen() -> String {
    "sys/coord-seen".into()
}
pub fn map_fence() -> String {
    "sys/shardmap".into()
}
pub fn session(lease: i64) -> String {
    format!("s/{lease:016x}")
}
/// Hex, so no identity's entries are a prefix of another's.
pub fn identity_sessions(identity: &str) -> String {
    let hex: String = identity.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{SESSION_INDEX}{hex}/")
}
pub fn identity_session(identity: &str, lease: i64) -> String {
    format!("{}{lease:016x}", identity_sessions(identity))
}
pub fn holder(key: &str) -> String {
    format!("{HOLDERS}{key}")
}
/// `//` cannot occur in a key: no key's claims are a prefix of another's.
pub fn claims_of(key: &str) -> String {
    format!("{CLAIMS}{key}//")
}
pub fn claim(key: &str, revision: i64) -> String {
    format!("{}{revision:016x}", claims_of(key))
}
/// `key`'s durable queue (`//` cannot occur in a key).
pub fn queue_of(key: &str) -> String {
    format!("{WAITERS}{key}//")
}
pub fn waiter(key: &str, session: i64) -> String {
    format!("{}{session:016x}", queue_of(key))
}
