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
/// The writers' intents on lock `name` (`//` cannot occur in a key).
pub const INTENTS: &str = "w/";
pub fn intents_of(name: &str) -> String {
    format!("{INTENTS}{name}//")
}
pub fn intent(name: &str, session: i64) -> String {
    format!("{}{session:016x}", intents_of(name))
}
/// Every quota place (what an epoch advance deletes).
pub const QUOTA_PLACES: &str = "p/";
/// Every place of `subject`'s quota in `class` (hex subject, as etcd's layout).
pub fn quota_places(class: &str, subject: &str) -> String {
    let hex: String = subject.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{QUOTA_PLACES}{class}/{hex}/")
}
pub fn quota_place(class: &str, subject: &str, index: u32) -> String {
    format!("{}{index:04x}", quota_places(class, subject))
}
/// Every election's records (what an epoch advance deletes).
pub const ELECTIONS: &str = "e/";
/// Every record of election `name` (`//` cannot occur in a name).
pub fn election(name: &str) -> String {
    format!("{ELECTIONS}{name}//")
}
pub fn election_lead(name: &str) -> String {
    format!("{}lead", election(name))
}
pub fn election_term(name: &str) -> String {
    format!("{}term", election(name))
}
/// Election `name`'s candidates, by rank (highest priority first), then
/// session.
pub fn candidates(name: &str) -> String {
    format!("{}c/", election(name))
}
pub fn candidate(name: &str, priority: u32, session: i64) -> String {
    format!(
        "{}{:08x}/{session:016x}",
        candidates(name),
        latchkey_records::candidate_rank(priority)
    )
}
fn hex(subject: &str) -> String {
    subject.bytes().map(|b| format!("{b:02x}")).collect()
}
/// `subject`'s leadership entries (on the leaders' leases).
pub fn leaderships_of(subject: &str) -> String {
    format!("e//i/{}/", hex(subject))
}
pub fn leadership_entry(subject: &str, name: &str) -> String {
    format!("{}{name}", leaderships_of(subject))
}
/// `subject`'s term record entries (on no lease).
pub fn elections_of(subject: &str) -> String {
    format!("e//t/{}/", hex(subject))
}
pub fn election_entry(subject: &str, name: &str) -> String {
    format!("{}{name}", elections_of(subject))
}
/// An operator's revocation marker of `session` (`sys/revoked/`).
pub fn revoked(session: i64) -> String {
    format!("sys/revoked/{session:016x}")
}
