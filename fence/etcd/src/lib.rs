//! The etcd fence (issue 35), for a user's own etcd (a resource, not
//! Latchkey's lock log): one transaction compares the record's mark and
//! puts the mark and the payload.
//!
//! A record is two keys under `<prefix>/<record>/`:
//! - `mark`: the token of the last accepted write, exactly 8 bytes
//!   big-endian ([`latchkey_fence::Mark::to_be_bytes`]), so that etcd's
//!   byte-wise value comparison is the numeric one;
//! - `payload`: the bytes written.
//!
//! The guarded write is a compare-and-swap on the mark key's
//! `mod_revision`, one `Txn` per attempt ([`guarded_txn`]):
//!
//! ```text
//! record not seen yet:   IF version(mark) = 0 AND version(payload) = 0
//! mark seen at rev r:    IF mod_revision(mark) = r AND value(mark) < token_bytes
//! THEN put(mark, token_bytes), put(payload, payload)
//! ELSE get(mark), get(payload)
//! ```
//!
//! etcd applies a transaction atomically at one revision. When the compare
//! fails, the gets show the record as it is: a mark at or above the token is
//! [`Guarded::FencedOut`] (strictly `<`: a replayed token is refused); a
//! payload without a mark, or a mark that is not exactly 8 bytes, is
//! [`FenceError::Unfenced`] (never overwritten); an 8-byte mark below the
//! token is tried again at the revision just read. A write is applied only
//! over a mark this adapter read and validated (8 bytes, below the token)
//! and that has not changed since: etcd's byte-wise `Less` alone would pass
//! a mark of another width that sorts below the token (4 zero bytes), which
//! the mod_revision compare rules out. The store remembers the revision its
//! own last write of a record left, so a holder writing one record again
//! pays one transaction; a record someone else wrote since costs two.
//!
//! An applied write's version ([`Guarded::Applied`]) is the revision of its
//! transaction: etcd's revisions grow with every write, so one record's
//! versions follow the order its writes committed.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use latchkey_etcd::txn::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse, TxnResponse};
use latchkey_etcd::{Client, Connection, Login};
use latchkey_fence::{BoxFuture, FenceError, FencedStore, Guarded, Mark, Record};

/// The store kind, as in `etcd://…`.
pub const KIND: &str = "etcd";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Compare-and-swap attempts of one guarded write before it answers
/// [`Guarded::Retry`] (other writers kept changing the record).
const ATTEMPTS: usize = 4;
/// Records whose last-written revision the store remembers; past this the
/// memory starts again (a forgotten record costs one more transaction).
const REMEMBERED: usize = 4096;

/// The fence over a user's etcd cluster.
pub struct EtcdStore {
    client: Client,
    prefix: String,
    /// Record → the mark key's mod_revision after this store's last write.
    written: Mutex<HashMap<String, i64>>,
}

/// What an `etcd://` URL says: `etcd://[user:password@]host:port[,host:port…][/prefix]`.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    pub endpoints: Vec<String>,
    pub login: Option<(String, String)>,
    pub prefix: String,
}

/// The password never prints.
impl std::fmt::Debug for EtcdUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUrl")
            .field("endpoints", &self.endpoints)
            .field("user", &self.login.as_ref().map(|(u, _)| u))
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl EtcdUrl {
    /// Parses the URL; errors never repeat it (it may hold a password).
    pub fn parse(url: &str) -> Result<Self, FenceError> {
        let bad = |why: &str| {
            FenceError::store(
                KIND,
                "reading the URL",
                format!(
                    "not a usable etcd:// URL: {why} (etcd://[user:password@]host:port[,host:port][/prefix])"
                ),
                false,
                &[],
            )
        };
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| bad("it does not start with etcd:// (TLS is not supported here)"))?;
        let (authority, prefix) = match rest.split_once('/') {
            Some((a, p)) => (a, p.trim_end_matches('/')),
            None => (rest, ""),
        };
        let (login, hosts) = match authority.rsplit_once('@') {
            Some((userinfo, hosts)) => {
                let (user, password) = userinfo
                    .split_once(':')
                    .ok_or_else(|| bad("the user has no password"))?;
                if user.is_empty() {
                    return Err(bad("the user name is empty"));
                }
                (Some((user.to_owned(), password.to_owned())), hosts)
            }
            None => (None, authority),
        };
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let (name, port) = host
                .rsplit_once(':')
                .ok_or_else(|| bad("an endpoint has no port"))?;
            if name.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad("an endpoint is not host:port"));
            }
            endpoints.push(format!("http://{host}"));
        }
        Ok(Self {
            endpoints,
            login,
            prefix: prefix.to_owned(),
        })
    }
}

impl EtcdStore {
    /// Connects with an `etcd://` URL ([`EtcdUrl`]), plain HTTP.
    pub async fn connect(url: &str) -> Result<Self, FenceError> {
        let url = EtcdUrl::parse(url)?;
        let mut connection = Connection::new(url.endpoints.clone());
        connection.connect_timeout = Some(CONNECT_TIMEOUT);
        connection.request_timeout = Some(REQUEST_TIMEOUT);
        connection.login = url.login.map(|(user, password)| Login::new(user, password));
        let client = latchkey_etcd::connect(&connection)
            .await
            .map_err(|e| store_error("connecting", &e, &[]))?;
        Ok(Self::new(client, url.prefix))
    }

    /// Wraps a client; records live under `prefix` (`""`: at the top).
    pub fn new(client: Client, prefix: impl Into<String>) -> Self {
        Self {
            client,
            prefix: prefix.into(),
            written: Mutex::new(HashMap::new()),
        }
    }

    fn remembered(&self, record: &str) -> Option<i64> {
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(record)
            .copied()
    }

    fn remember(&self, record: &str, revision: Option<i64>) {
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        match revision {
            Some(rev) => {
                if written.len() >= REMEMBERED && !written.contains_key(record) {
                    written.clear();
                }
                written.insert(record.to_owned(), rev);
            }
            None => {
                written.remove(record);
            }
        }
    }

    /// The mark's and the payload's keys for `record`.
    pub fn keys(&self, record: &str) -> (String, String) {
        let base = if self.prefix.is_empty() {
            record.to_owned()
        } else {
            format!("{}/{record}", self.prefix)
        };
        (format!("{base}/mark"), format!("{base}/payload"))
    }

    async fn run(
        &self,
        op: &'static str,
        txn: Txn,
        token: &[u64],
    ) -> Result<TxnResponse, FenceError> {
        latchkey_etcd::txn::run(&self.client, txn)
            .await
            .map_err(|e| store_error(op, &e, token))
    }
}

/// One attempt of the guarded write (see the crate docs): create the
/// record when `seen` is `None`, else overwrite it if its mark key is still
/// at revision `seen` and below the token. The else branch reads the record.
pub fn guarded_txn(
    mark_key: &str,
    payload_key: &str,
    seen: Option<i64>,
    token: u64,
    payload: &[u8],
) -> Txn {
    let token_bytes = Mark::new(token).to_be_bytes().to_vec();
    let when = match seen {
        None => vec![
            Compare::version(mark_key, CompareOp::Equal, 0),
            Compare::version(payload_key, CompareOp::Equal, 0),
        ],
        Some(rev) => vec![
            Compare::mod_revision(mark_key, CompareOp::Equal, rev),
            Compare::value(mark_key, CompareOp::Less, token_bytes.clone()),
        ],
    };
    Txn::new()
        .when(when)
        .and_then(vec![
            TxnOp::put(mark_key, token_bytes, None),
            TxnOp::put(payload_key, payload.to_vec(), None),
        ])
        .or_else(vec![
            TxnOp::get(mark_key, None),
            TxnOp::get(payload_key, None),
        ])
}

/// A driver error as a [`FenceError`], scrubbed of `secrets`.
pub fn store_error(op: &'static str, err: &latchkey_etcd::Error, secrets: &[u64]) -> FenceError {
    let message = err
        .grpc_message()
        .map(str::to_owned)
        .unwrap_or_else(|| err.to_string());
    FenceError::store(KIND, op, message, err.is_transient(), secrets)
}

/// The value of a get's first key, `None` when it found nothing.
fn got(op: Option<&TxnOpResponse>) -> Option<Vec<u8>> {
    match op {
        Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| kv.value().to_vec()),
        _ => None,
    }
}

fn mark_of(record: &str, bytes: &[u8]) -> Result<Mark, FenceError> {
    <[u8; 8]>::try_from(bytes)
        .map(Mark::from_be_bytes)
        .map_err(|_| FenceError::Unfenced {
            store: KIND,
            record: record.to_owned(),
            why: "its mark key does not hold 8 bytes".into(),
        })
}

fn no_mark(record: &str) -> FenceError {
    FenceError::Unfenced {
        store: KIND,
        record: record.to_owned(),
        why: "it has a payload key but no mark key".into(),
    }
}

impl FencedStore for EtcdStore {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn guarded_write<'a>(
        &'a self,
        record: &'a str,
        token: u64,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<Guarded, FenceError>> {
        Box::pin(async move {
            const OP: &str = "guarded write";
            let (mark_key, payload_key) = self.keys(record);
            let mut seen = self.remembered(record);
            for _ in 0..ATTEMPTS {
                let txn = guarded_txn(&mark_key, &payload_key, seen, token, payload);
                let resp = self.run(OP, txn, &[token]).await?;
                if resp.succeeded() {
                    let revision = latchkey_etcd::txn::revision(&resp);
                    self.remember(record, revision);
                    return match revision.and_then(|r| u64::try_from(r).ok()) {
                        Some(version) => Ok(Guarded::Applied { version }),
                        None => Err(FenceError::store(
                            KIND,
                            OP,
                            "the write was applied but etcd's answer carries no revision",
                            false,
                            &[token],
                        )),
                    };
                }
                let ops = resp.op_responses();
                let mark_kv = ops.first().and_then(latchkey_etcd::txn::first_kv);
                let has_payload = got(ops.get(1)).is_some();
                match mark_kv {
                    None if has_payload => return Err(no_mark(record)),
                    // Missing now: create it.
                    None => seen = None,
                    Some(kv) => {
                        let mark = mark_of(record, kv.value())?;
                        if mark >= Mark::new(token) {
                            self.remember(record, None);
                            return Ok(Guarded::FencedOut { mark });
                        }
                        seen = Some(kv.mod_revision());
                    }
                }
            }
            Ok(Guarded::Retry)
        })
    }

    fn read<'a>(&'a self, record: &'a str) -> BoxFuture<'a, Result<Option<Record>, FenceError>> {
        Box::pin(async move {
            let (mark_key, payload_key) = self.keys(record);
            // One revision for both keys.
            let txn = Txn::new().and_then(vec![
                TxnOp::get(mark_key, None),
                TxnOp::get(payload_key, None),
            ]);
            let resp = self.run("reading a record", txn, &[]).await?;
            let ops = resp.op_responses();
            match (got(ops.first()), got(ops.get(1))) {
                (None, None) => Ok(None),
                (None, Some(_)) => Err(no_mark(record)),
                (Some(mark), payload) => Ok(Some(Record {
                    mark: mark_of(record, &mark)?,
                    payload: payload.unwrap_or_default(),
                })),
            }
        })
    }

    fn plain_write<'a>(
        &'a self,
        record: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), FenceError>> {
        Box::pin(async move {
            let (mark_key, payload_key) = self.keys(record);
            let put_payload = TxnOp::put(payload_key, payload.to_vec(), None);
            let txn = Txn::new()
                .when(vec![Compare::version(
                    mark_key.clone(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then(vec![
                    TxnOp::put(mark_key, Mark::new(0).to_be_bytes().to_vec(), None),
                    put_payload.clone(),
                ])
                .or_else(vec![put_payload]);
            self.run("plain write", txn, &[]).await?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_never_print_the_password() {
        let url =
            EtcdUrl::parse("etcd://app:hunter2@10.0.0.1:2379,10.0.0.2:2379/fenced/app").unwrap();
        assert_eq!(
            url.endpoints,
            ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
        );
        assert_eq!(url.prefix, "fenced/app");
        assert_eq!(url.login, Some(("app".into(), "hunter2".into())));
        assert!(!format!("{url:?}").contains("hunter2"));

        let plain = EtcdUrl::parse("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(plain.prefix, "");
        assert_eq!(plain.login, None);

        for bad in [
            "http://127.0.0.1:2379",
            "etcd://127.0.0.1",
            "etcd://u@127.0.0.1:2379",
            "etcd://:hunter2@127.0.0.1:2379",
            "etcd://u:hunter2@127.0.0.1:port",
        ] {
            let err = EtcdUrl::parse(bad).unwrap_err();
            let text = format!("{err} {err:?}");
            assert!(text.contains("etcd:// URL"), "{text}");
            assert!(!text.contains("hunter2"), "{text}");
        }
    }

    #[test]
    fn big_endian_bytes_order_like_the_numbers() {
        let below = Mark::new((1 << 48) + 255).to_be_bytes();
        let above = Mark::new((1 << 48) + 256).to_be_bytes();
        assert!(below < above);
        assert!(Mark::new(u64::MAX - 1).to_be_bytes() < Mark::new(u64::MAX).to_be_bytes());
    }
}
