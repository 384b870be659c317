//! A line of the quorum-loss spool (ADR-04): the arbiter appends one for
//! every grant an open class gets from its memory while etcd has no quorum
//! (and one for its release); the audit tailer copies the closed spools
//! into the audit store. One JSON object a line, camelCase.

use serde::{Deserialize, Serialize};

/// What a spool line records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpoolKind {
    /// A grant from memory (token 0).
    Grant,
    /// The holder released it.
    Release,
}

impl SpoolKind {
    /// The kind as a line spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            SpoolKind::Grant => "grant",
            SpoolKind::Release => "release",
        }
    }
}

/// One line of the spool. Never a real token: memory grants have token 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SpoolRecord {
    /// Unique per arbiter: `unix_ms << 12 | seq & 0xfff` of the grant; a
    /// release carries its grant's id.
    pub id: i64,
    pub kind: SpoolKind,
    pub key: String,
    pub identity: String,
    /// The grant subject the grant counts against, when it is not
    /// `identity` itself (a pattern grant's per-pod identity, issue 30):
    /// the spool share and, after a restart, the restored hold's bounds
    /// are the subject's. Absent in spools written before it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub bound: String,
    /// The client instance it was granted to (a restored hold then tells a
    /// LEAK from a replica's contention as before the restart).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instance: String,
    pub session: i64,
    pub class: String,
    pub ttl_seconds: u32,
    pub at_unix_ms: i64,
    /// Always 0: an unprotected grant has no fencing token.
    pub token: u64,
    /// Always true: nothing but the arbiter's memory kept it exclusive.
    pub unprotected: bool,
    /// The arbiter that granted it (its state directory's name for it).
    pub arbiter: String,
    /// The lock cluster whose quorum was lost (etcd's cluster id); 0 in
    /// spools written before it was kept.
    #[serde(default)]
    pub cluster_id: u64,
}

impl SpoolRecord {
    /// The grant subject the record counts against.
    pub fn bounded_as(&self) -> &str {
        match self.bound.is_empty() {
            true => &self.identity,
            false => &self.bound,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, encode};

    /// Lines as arbiters wrote them: before `bound` and `instance`, before
    /// `clusterId`, and now; each decodes, and today's bytes are as before.
    #[test]
    fn old_and_new_lines_decode() {
        let old = br#"{"id":4096,"kind":"grant","key":"shared/a","identity":"spiffe://td/alice","session":7,"class":"spare","ttlSeconds":30,"atUnixMs":1,"token":0,"unprotected":true,"arbiter":"a1","clusterId":9}"#;
        let r: SpoolRecord = decode(old).unwrap();
        assert_eq!((r.kind, r.cluster_id), (SpoolKind::Grant, 9));
        assert_eq!(r.bounded_as(), "spiffe://td/alice");
        assert_eq!(encode(&r), old.to_vec());
        let older = br#"{"id":4096,"kind":"release","key":"shared/a","identity":"spiffe://td/alice","session":7,"class":"spare","ttlSeconds":30,"atUnixMs":2,"token":0,"unprotected":true,"arbiter":"a1"}"#;
        let r: SpoolRecord = decode(older).unwrap();
        assert_eq!((r.kind, r.cluster_id), (SpoolKind::Release, 0));
        let new = br#"{"id":4097,"kind":"grant","key":"shared/b","identity":"spiffe://td/p/1","bound":"spiffe://td/p/*","instance":"pod-1","session":8,"class":"spare","ttlSeconds":30,"atUnixMs":3,"token":0,"unprotected":true,"arbiter":"a1","clusterId":9}"#;
        let r: SpoolRecord = decode(new).unwrap();
        assert_eq!(r.bounded_as(), "spiffe://td/p/*");
        assert_eq!(r.instance, "pod-1");
        assert_eq!(encode(&r), new.to_vec());
        assert_eq!(r.kind.as_str(), "grant");
        assert_eq!(SpoolKind::Release.as_str(), "release");
    }
}
