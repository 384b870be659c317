//! The fence adapter contract (issue 35): one guarded write, the same three
//! answers from every store a platform team writes to.
//!
//! A fencing token protects nothing until the resource checks it. Every
//! adapter (PostgreSQL, MySQL/MariaDB, Redis, etcd, S3-compatible object
//! stores) stores a *mark* with each record: the greatest token that wrote
//! it. A write carrying token `t` lands if and only if the record is missing
//! or its mark is strictly below `t`, and the mark becomes `t` in the same
//! atomic step (one statement, one script, one transaction or one
//! conditional request). Strictly below: a replayed token is refused.
//!
//! [`FencedStore::guarded_write`] answers:
//! - [`Guarded::Applied`]: the write landed and the record's mark is `t`;
//! - [`Guarded::FencedOut`]: the record's mark is at or above `t` (a later
//!   holder wrote); nothing changed. The [`Mark`] it carries is the store's,
//!   redacted in every `Debug`/`Display`;
//! - [`Guarded::Retry`]: the store could not decide atomically this time (an
//!   object store's conditional request lost a race, a transaction conflict);
//!   nothing changed and the same write may be tried again.
//!
//! Errors ([`FenceError`]) are for everything else: the store is unreachable,
//! refused the request, or the token cannot be represented. Their text never
//! contains a token or a mark: adapters scrub driver messages with
//! [`redact`] before keeping them.

use std::fmt;
use std::future::Future;
use std::pin::Pin;

/// A record's fencing mark: the token of the last write it accepted. It is
/// a token (a capability), so it never prints.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mark(u64);

impl Mark {
    pub fn new(value: u64) -> Self {
        Mark(value)
    }

    /// The raw value, for comparisons and for storing it back.
    pub fn get(self) -> u64 {
        self.0
    }

    /// Fixed-width big-endian bytes: byte order is numeric order, so stores
    /// that compare bytes (etcd's `Compare::value`) compare marks correctly.
    pub fn to_be_bytes(self) -> [u8; 8] {
        self.0.to_be_bytes()
    }

    pub fn from_be_bytes(bytes: [u8; 8]) -> Self {
        Mark(u64::from_be_bytes(bytes))
    }

    /// Fixed-width hex (16 lower-case digits): string order is numeric order,
    /// for stores that keep the mark as text (object metadata).
    pub fn to_hex(self) -> String {
        format!("{:016x}", self.0)
    }

    /// Parses [`Mark::to_hex`]'s form; anything else is `None`.
    pub fn from_hex(text: &str) -> Option<Self> {
        if text.len() != 16 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(text, 16).ok().map(Mark)
    }
}

impl fmt::Debug for Mark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Mark(<redacted>)")
    }
}

impl fmt::Display for Mark {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// What a guarded write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guarded {
    /// The write landed; the record's mark is now the token. `version`
    /// is the record's version after this write: the versions of one
    /// record strictly increase in the order its writes committed (a
    /// per-record write count, 1 for the write that created it, in the SQL
    /// stores, Redis and S3; the revision of the transaction in etcd). Two
    /// applied writes of one record are ordered by it, which is how the
    /// release gate's checker orders a store's commits.
    Applied { version: u64 },
    /// The record's mark is at or above the token: a later (or the same)
    /// grant already wrote. Nothing changed.
    FencedOut { mark: Mark },
    /// The store could not decide atomically this time (a conditional
    /// request lost a race with another writer, a transaction conflict).
    /// Nothing changed; the same write may be tried again.
    Retry,
}

impl Guarded {
    pub fn is_applied(self) -> bool {
        matches!(self, Guarded::Applied { .. })
    }
}

impl fmt::Display for Guarded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Guarded::Applied { .. } => f.write_str("applied"),
            Guarded::FencedOut { .. } => {
                f.write_str("fenced out: a later holder wrote this record")
            }
            Guarded::Retry => f.write_str("not decided: retry the same write"),
        }
    }
}

/// A record as a store holds it: its mark and payload.
#[derive(Clone, PartialEq, Eq)]
pub struct Record {
    pub mark: Mark,
    pub payload: Vec<u8>,
}

impl fmt::Debug for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Record")
            .field("mark", &self.mark)
            .field("payload_bytes", &self.payload.len())
            .finish()
    }
}

/// Why a guarded write (or read) could not be attempted or did not complete.
/// The text never contains a token or a mark.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// The store cannot represent this token as a mark (e.g. a signed
    /// 64-bit column and a token above 2^63-1): refused rather than stored
    /// wrapped, which would compare below every real mark.
    #[error("the fencing token does not fit this store's mark ({store}); refusing to write")]
    TokenOutOfRange { store: &'static str },
    /// The record exists but was not written by a fence (no mark, or a
    /// mark this adapter cannot read): refused rather than overwritten.
    #[error("{store}: record {record:?} carries no readable fencing mark: {why}")]
    Unfenced {
        store: &'static str,
        record: String,
        why: String,
    },
    /// The store refused the request or could not be reached; `message` is
    /// scrubbed of the token.
    #[error("{store}: {op}: {message}")]
    Store {
        store: &'static str,
        op: &'static str,
        message: String,
        /// Whether the same write may succeed if retried (connection
        /// trouble, a server shutting down, throttling).
        transient: bool,
    },
}

impl FenceError {
    /// Whether the same write may succeed if retried.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            FenceError::Store {
                transient: true,
                ..
            }
        )
    }

    /// A store error whose text is scrubbed of `token` (and `mark`).
    pub fn store(
        store: &'static str,
        op: &'static str,
        message: impl fmt::Display,
        transient: bool,
        secrets: &[u64],
    ) -> Self {
        let mut message = message.to_string();
        for s in secrets {
            message = redact(&message, *s);
        }
        FenceError::Store {
            store,
            op,
            message,
            transient,
        }
    }
}

/// `text` with every occurrence of `secret`'s decimal digits, and of its
/// fixed-width hex form ([`Mark::to_hex`]), replaced.
pub fn redact(text: &str, secret: u64) -> String {
    // Every real token is at least 2^48 (its epoch is at least 1); a value
    // this small is no capability (a probe's mark 0, an unprotected grant's
    // token 0), and replacing its few digits would garble the message
    // ("HTTP 4<redacted>3") and hint at the value.
    if secret < 1 << 20 {
        return text.to_string();
    }
    text.replace(&secret.to_string(), "<redacted>")
        .replace(&format!("{secret:016x}"), "<redacted>")
}

/// A boxed future, so that [`FencedStore`] is object safe
/// (`latchctl pause-test --resource kind://…` picks an adapter at run time).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One store that fences writes by token. Implementations keep the mark
/// beside the payload of every record and decide each write in one atomic
/// step of the store.
pub trait FencedStore: Send + Sync {
    /// The store kind, as in `--resource <kind>://…` (`postgresql`,
    /// `mysql`, `redis`, `etcd`, `s3`).
    fn kind(&self) -> &'static str;

    /// What this store's setup means for the fence, in words a pause-test
    /// result records beside its verdict (asynchronous replication, a
    /// server that forgets on restart). Empty when there is nothing to say.
    fn caveats(&self) -> Vec<String> {
        Vec::new()
    }

    /// Writes `payload` to `record` if and only if the record is missing or
    /// its mark is strictly below `token`, raising the mark to `token` in
    /// the same atomic step.
    fn guarded_write<'a>(
        &'a self,
        record: &'a str,
        token: u64,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<Guarded, FenceError>>;

    /// The record's mark and payload, or `None` when it does not exist.
    fn read<'a>(&'a self, record: &'a str) -> BoxFuture<'a, Result<Option<Record>, FenceError>>;

    /// A write with no fence at all (what a naive writer does): for the
    /// pause test's "naive writer FAILs" half and the benchmark's baseline.
    /// It keeps the record's mark as it is (a record it creates gets mark 0).
    fn plain_write<'a>(
        &'a self,
        record: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), FenceError>>;
}

/// [`FencedStore::guarded_write`], retried while the store answers
/// [`Guarded::Retry`] (up to `attempts` times in all). A caller that gets
/// `Retry` back from this still knows nothing changed.
pub async fn guarded_write_retrying(
    store: &dyn FencedStore,
    record: &str,
    token: u64,
    payload: &[u8],
    attempts: usize,
) -> Result<Guarded, FenceError> {
    let mut last = Guarded::Retry;
    for _ in 0..attempts.max(1) {
        last = store.guarded_write(record, token, payload).await?;
        if last != Guarded::Retry {
            break;
        }
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_never_print() {
        let m = Mark::new(281_474_976_710_699);
        for text in [
            format!("{m:?}"),
            format!("{m}"),
            format!("{:?}", Guarded::FencedOut { mark: m }),
            Guarded::FencedOut { mark: m }.to_string(),
            format!(
                "{:?}",
                Record {
                    mark: m,
                    payload: b"x".to_vec()
                }
            ),
        ] {
            assert!(!text.contains("281474976710699"), "{text}");
            assert!(!text.contains(&m.to_hex()), "{text}");
        }
    }

    #[test]
    fn encodings_keep_numeric_order() {
        let a = Mark::new(255);
        let b = Mark::new(256);
        assert!(a.to_be_bytes() < b.to_be_bytes());
        assert!(a.to_hex() < b.to_hex());
        assert_eq!(Mark::from_hex(&b.to_hex()), Some(b));
        assert_eq!(Mark::from_be_bytes(b.to_be_bytes()), b);
        assert_eq!(Mark::from_hex("ff"), None);
        assert_eq!(Mark::from_hex("zzzzzzzzzzzzzzzz"), None);
    }

    #[test]
    fn store_errors_are_scrubbed() {
        let token = 281_474_976_710_699u64;
        let e = FenceError::store(
            "redis",
            "guarded write",
            format!("ERR bad value {token} ({token:016x})"),
            false,
            &[token],
        );
        let text = e.to_string();
        assert!(!text.contains(&token.to_string()), "{text}");
        assert!(!text.contains(&format!("{token:016x}")), "{text}");
        assert!(!e.is_transient());
        // A value far below any real token is left alone.
        assert_eq!(redact("HTTP 403 (a 0 here)", 0), "HTTP 403 (a 0 here)");
        assert_eq!(redact("HTTP 403", 3), "HTTP 403");
    }
}
