//! What the audit store keeps instead of the lock log's revisions.
//!
//! A grant's fencing token is `epoch × 2^48 + revision` (ADR-02), and the
//! epoch is a small number anyone can guess: a grant's revision IS its
//! token. So the store never holds a revision of the lock log. Each event
//! gets an opaque id, each hold an opaque id its grant and its end share,
//! and the tailer's checkpoint is sealed; all three are HMAC-SHA256 under
//! the audit key, a secret only the tailer reads (`--audit-key-file`):
//!
//! - `event_id` = HMAC(key, "event", cluster, revision, lock key): the same
//!   on every replay, so the stores still ignore copies;
//! - `hold_id` = HMAC(key, "hold", cluster, grant revision, lock key): what a
//!   grant, a hand-over and the hold's end have in common;
//! - the checkpoint: the revision XOR an HMAC pad, with an HMAC tag, so only
//!   the key's holder reads it back and a checkpoint sealed under another key
//!   is refused, not misread.
//!
//! Without the key an id is an unguessable 128 (event) or 64 (hold) bits;
//! revisions are small integers, so an unkeyed hash would be undone by
//! hashing every revision up to etcd's current one.
//!
//! Unprotected grants from quorum-loss spools (ADR-04) have token 0 and no
//! revision; their synthetic negative positions are no secret, so their ids
//! are plain hashes and need no key.

use std::fmt;
use std::path::Path;

use sha2::{Digest, Sha256};

/// The shortest key the tailer accepts (`openssl rand -hex 32` gives 64).
pub const MIN_KEY_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("reading the audit key {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the audit key is {len} bytes; it needs at least {MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)"
    )]
    TooShort { len: usize },
}

/// The secret the store's pseudonyms are keyed by. Its bytes never leave
/// this type: `Debug` prints nothing of them.
#[derive(Clone)]
pub struct AuditKey {
    bytes: Vec<u8>,
}

impl fmt::Debug for AuditKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuditKey(<redacted>)")
    }
}

impl AuditKey {
    /// The key is the file's bytes without trailing whitespace (a hex
    /// string from `openssl rand -hex 32` is fine, and so are raw bytes).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        let bytes = &bytes[..end];
        if bytes.len() < MIN_KEY_BYTES {
            return Err(KeyError::TooShort { len: bytes.len() });
        }
        Ok(Self {
            bytes: bytes.to_vec(),
        })
    }

    pub fn read(path: &Path) -> Result<Self, KeyError> {
        let bytes = std::fs::read(path).map_err(|source| KeyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes(&bytes)
    }

    fn mac(&self, label: &str, parts: &[&[u8]]) -> [u8; 32] {
        hmac_sha256(&self.bytes, &message(label, parts))
    }

    /// A value that tells keys apart without saying anything of them: the
    /// store keeps it, and a tailer started with another key is refused
    /// (its ids would not match the stored ones, nor its checkpoint open).
    pub fn check_value(&self) -> String {
        hex(&self.mac("key-check", &[])[..16])
    }

    /// The checkpoint `revision` of `cluster_id`, sealed for the row written
    /// at `position` (each checkpoint row has its own position, so its own pad).
    pub fn seal_checkpoint(&self, cluster_id: u64, position: i64, revision: i64) -> String {
        let pad = self.mac(
            "checkpoint-pad",
            &[&cluster_id.to_be_bytes(), &position.to_be_bytes()],
        );
        let tag = self.mac(
            "checkpoint-tag",
            &[
                &cluster_id.to_be_bytes(),
                &position.to_be_bytes(),
                &revision.to_be_bytes(),
            ],
        );
        let mut sealed = revision.to_be_bytes();
        for (b, p) in sealed.iter_mut().zip(pad) {
            *b ^= p;
        }
        format!("{}{}", hex(&sealed), hex(&tag[..8]))
    }

    /// The revision a sealed checkpoint holds; `None` if it was sealed under
    /// another key (or for another cluster or row), or is not one at all.
    pub fn open_checkpoint(&self, cluster_id: u64, position: i64, sealed: &str) -> Option<i64> {
        let bytes = unhex(sealed)?;
        let (body, tag) = (bytes.get(..8)?, bytes.get(8..16)?);
        if bytes.len() != 16 {
            return None;
        }
        let pad = self.mac(
            "checkpoint-pad",
            &[&cluster_id.to_be_bytes(), &position.to_be_bytes()],
        );
        let mut plain = [0u8; 8];
        for ((out, b), p) in plain.iter_mut().zip(body).zip(pad) {
            *out = b ^ p;
        }
        let revision = i64::from_be_bytes(plain);
        let expected = self.mac(
            "checkpoint-tag",
            &[
                &cluster_id.to_be_bytes(),
                &position.to_be_bytes(),
                &revision.to_be_bytes(),
            ],
        );
        // Constant time: the tag is the only thing that says the key is right.
        let differ = expected[..8]
            .iter()
            .zip(tag)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        (differ == 0).then_some(revision)
    }
}

/// Asked for a pseudonym of a real revision without the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "writing lock-log events needs the audit key (latchkey-audit --audit-key-file): the store keeps no revision, only ids keyed by it"
)]
pub struct NeedsKey;

/// The id of the event at (`revision`, `key`) of `cluster_id`: 32 hex digits.
pub fn event_id(
    audit_key: Option<&AuditKey>,
    cluster_id: u64,
    revision: i64,
    key: &str,
) -> Result<String, NeedsKey> {
    let parts: [&[u8]; 3] = [
        &cluster_id.to_be_bytes(),
        &revision.to_be_bytes(),
        key.as_bytes(),
    ];
    if revision < 0 {
        return Ok(hex(&unkeyed("unprotected-event", &parts)[..16]));
    }
    let audit_key = audit_key.ok_or(NeedsKey)?;
    Ok(hex(&audit_key.mac("event", &parts)[..16]))
}

/// The id of the hold `key` granted at `grant_revision` of `cluster_id`:
/// 16 hex digits, or empty for 0 (a hold the tailer never saw granted).
pub fn hold_id(
    audit_key: Option<&AuditKey>,
    cluster_id: u64,
    grant_revision: i64,
    key: &str,
) -> Result<String, NeedsKey> {
    let parts: [&[u8]; 3] = [
        &cluster_id.to_be_bytes(),
        &grant_revision.to_be_bytes(),
        key.as_bytes(),
    ];
    match grant_revision {
        0 => Ok(String::new()),
        r if r < 0 => Ok(hex(&unkeyed("unprotected-hold", &parts)[..8])),
        _ => Ok(hex(&audit_key.ok_or(NeedsKey)?.mac("hold", &parts)[..8])),
    }
}

/// SHA-256 as lowercase hex (ClickHouse's `password_sha256_hex`).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// `label`, then each part with its length: no two inputs share a message.
fn message(label: &str, parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(b"latchkey-audit/");
    out.extend_from_slice(label.as_bytes());
    for part in parts {
        out.extend_from_slice(&(part.len() as u64).to_be_bytes());
        out.extend_from_slice(part);
    }
    out
}

fn unkeyed(label: &str, parts: &[&[u8]]) -> [u8; 32] {
    Sha256::digest(message(label, parts)).into()
}

/// HMAC-SHA256 (RFC 2104) over the workspace's `sha2`, checked against
/// RFC 4231's vectors below.
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut block = [0u8; BLOCK];
    if key.len() > BLOCK {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    inner.update(message);
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> AuditKey {
        AuditKey::from_bytes(b"0123456789abcdef0123456789abcdef\n").unwrap()
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2: a short key.
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block.
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn short_keys_are_refused_and_keys_never_print() {
        assert!(matches!(
            AuditKey::from_bytes(b"short\n"),
            Err(KeyError::TooShort { len: 5 })
        ));
        assert_eq!(format!("{:?}", key()), "AuditKey(<redacted>)");
    }

    #[test]
    fn ids_are_stable_keyed_and_never_the_revision() {
        let k = key();
        let other = AuditKey::from_bytes(&[7u8; 32]).unwrap();
        let a = event_id(Some(&k), 9, 1234, "ledger/a").unwrap();
        assert_eq!(a, event_id(Some(&k), 9, 1234, "ledger/a").unwrap());
        assert_eq!(a.len(), 32);
        assert_ne!(a, event_id(Some(&k), 9, 1234, "ledger/b").unwrap());
        assert_ne!(a, event_id(Some(&other), 9, 1234, "ledger/a").unwrap());
        let h = hold_id(Some(&k), 9, 1234, "ledger/a").unwrap();
        assert_eq!(h.len(), 16);
        assert_ne!(h, hold_id(Some(&k), 9, 1235, "ledger/a").unwrap());
        for id in [&a, &h] {
            assert!(!id.contains("1234") && !id.contains("4d2"), "{id}");
        }
        assert_eq!(hold_id(Some(&k), 9, 0, "ledger/a").unwrap(), "");
        assert_eq!(event_id(None, 9, 1234, "ledger/a"), Err(NeedsKey));
        assert_eq!(hold_id(None, 9, 1234, "ledger/a"), Err(NeedsKey));
        // Unprotected grants have no revision to hide.
        assert_eq!(
            event_id(None, 9, -5, "a").unwrap(),
            event_id(Some(&k), 9, -5, "a").unwrap()
        );
        assert_eq!(hold_id(None, 9, -6, "a").unwrap().len(), 16);
    }

    #[test]
    fn checkpoints_open_only_under_their_key_and_row() {
        let k = key();
        let sealed = k.seal_checkpoint(9, 1_000_000, 4242);
        assert_eq!(sealed.len(), 32);
        assert!(!sealed.contains("4242") && !sealed.contains("1092"));
        assert_eq!(k.open_checkpoint(9, 1_000_000, &sealed), Some(4242));
        let other = AuditKey::from_bytes(&[7u8; 32]).unwrap();
        assert_eq!(other.open_checkpoint(9, 1_000_000, &sealed), None);
        assert_eq!(k.open_checkpoint(9, 1_000_001, &sealed), None);
        assert_eq!(k.open_checkpoint(8, 1_000_000, &sealed), None);
        assert_eq!(k.open_checkpoint(9, 1_000_000, "zz"), None);
        assert_ne!(k.check_value(), other.check_value());
    }

    #[test]
    fn sha256_hex_is_what_clickhouse_expects() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
