//! Everything the tailer asks etcd: the only module that names
//! `etcd_client`. Only reads: a range at a revision, the current revision,
//! and a watch, so a credential with read permission on the prefix (and
//! nothing else) is all the tailer needs.

use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, Identity, TlsOptions, WatchOptions,
    WatchStream,
};

use super::TailError;
use crate::derive::{Change, LogState, Op};

/// Keys per page of the state read.
const PAGE: i64 = 1000;

/// How to reach etcd: endpoints, TLS and an optional user.
#[derive(Clone, Default)]
pub struct EtcdConnection {
    pub endpoints: Vec<String>,
    /// Trust bundle for etcd's certificate (PEM), for `https://` endpoints.
    pub ca: Option<Vec<u8>>,
    /// The tailer's client certificate chain and key (PEM).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// An etcd user and password (a read-only role).
    pub login: Option<(String, String)>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
}

/// Presence only: never a key or a password in a log.
impl std::fmt::Debug for EtcdConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConnection")
            .field("endpoints", &self.endpoints)
            .field("ca", &self.ca.is_some())
            .field("client_certificate", &self.identity.is_some())
            .field("user", &self.login.as_ref().map(|(u, _)| u))
            .finish()
    }
}

pub(super) async fn connect(c: &EtcdConnection) -> Result<Client, TailError> {
    let mut options = ConnectOptions::new()
        .with_require_leader(true)
        .with_connect_timeout(c.connect_timeout)
        .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3));
    if let Some(ca) = &c.ca {
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
        if let Some((cert, key)) = &c.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        options = options.with_tls(tls);
    }
    if let Some((user, password)) = &c.login {
        options = options
            .with_user(user.clone(), password.clone())
            .with_auto_token_refresh(true);
    }
    // No request timeout on the client: it would end the watch stream too.
    Client::connect(&c.endpoints, Some(options))
        .await
        .map_err(etcd("connecting"))
}

pub(super) fn etcd(context: &'static str) -> impl FnOnce(etcd_client::Error) -> TailError {
    move |source| TailError::Etcd { context, source }
}

/// etcd's cluster id and current revision (a count-only read of one key).
pub(super) async fn head(
    client: &mut Client,
    prefix: &str,
    timeout: Duration,
) -> Result<(u64, i64), TailError> {
    let mut kv = client.kv_client();
    let read = kv.get(prefix, Some(GetOptions::new().with_count_only()));
    let resp = tokio::time::timeout(timeout, read)
        .await
        .map_err(|_| TailError::Timeout("reading etcd's revision"))?
        .map_err(etcd("reading etcd's revision"))?;
    let header = resp.header().ok_or(TailError::NoHeader)?;
    Ok((header.cluster_id(), header.revision()))
}

/// Why a state read failed.
pub(super) enum LoadError {
    Compacted,
    Other(TailError),
}

/// The state under `prefix` at `revision` (empty at 0), read in pages.
pub(super) async fn load(
    client: &mut Client,
    prefix: &str,
    revision: i64,
) -> Result<LogState, LoadError> {
    if revision == 0 {
        return Ok(LogState::default());
    }
    let end = prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut kvs: Vec<(String, Vec<u8>, i64, i64)> = Vec::new();
    loop {
        let options = GetOptions::new()
            .with_range(end.clone())
            .with_revision(revision)
            .with_limit(PAGE);
        let resp = match client.kv_client().get(from.clone(), Some(options)).await {
            Ok(resp) => resp,
            Err(e) if compacted(&e) => return Err(LoadError::Compacted),
            Err(e) => return Err(LoadError::Other(etcd("reading the prefix")(e))),
        };
        for kv in resp.kvs() {
            if let Ok(key) = std::str::from_utf8(kv.key())
                && let Some(relative) = key.strip_prefix(prefix)
            {
                kvs.push((
                    relative.to_string(),
                    kv.value().to_vec(),
                    kv.lease(),
                    kv.mod_revision(),
                ));
            }
        }
        match (resp.more(), resp.kvs().last()) {
            (true, Some(last)) => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => break,
        }
    }
    Ok(LogState::load(kvs.iter().map(|(k, v, lease, rev)| {
        (k.as_str(), v.as_slice(), *lease, *rev)
    })))
}

/// etcd's "required revision has been compacted".
fn compacted(err: &etcd_client::Error) -> bool {
    matches!(err, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::OutOfRange && s.message().contains("compacted"))
}

/// The revision etcd has compacted to, given that `below` is compacted:
/// a watch from `below` is cancelled with it.
pub(super) async fn compact_revision(
    client: &mut Client,
    prefix: &str,
    below: i64,
    timeout: Duration,
) -> Result<i64, TailError> {
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(below.max(1));
    let ask = async {
        let mut stream = client
            .watch_client()
            .watch(prefix, Some(options))
            .await
            .map_err(etcd("watching for the compact revision"))?;
        loop {
            let Some(resp) = stream
                .message()
                .await
                .map_err(etcd("watching for the compact revision"))?
            else {
                return Err(TailError::WatchEnded);
            };
            if resp.compact_revision() > 0 {
                return Ok(resp.compact_revision());
            }
            if !resp.events().is_empty() || resp.canceled() {
                // Not compacted after all (the read raced a restart):
                // nothing is missing.
                return Ok(below);
            }
        }
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| TailError::Timeout("asking for the compact revision"))?
}

/// A watch of everything under `prefix` from `revision` (inclusive).
///
/// No progress notifications: etcd 3.4.23 may send one ahead of events
/// still in flight (fixed in 3.4.24), and a checkpoint moved by it could
/// skip them. The checkpoint moves only with events.
pub(super) async fn watch(
    client: &mut Client,
    prefix: &str,
    revision: i64,
) -> Result<WatchStream, TailError> {
    let options = WatchOptions::new()
        .with_prefix()
        .with_start_revision(revision);
    client
        .watch_client()
        .watch(prefix, Some(options))
        .await
        .map_err(etcd("watching the prefix"))
}

/// A watch response's events as changes, grouped by revision in order.
/// etcd never splits a revision over responses unless asked to.
pub(super) fn revisions(prefix: &str, events: &[etcd_client::Event]) -> Vec<(i64, Vec<Change>)> {
    let mut out: Vec<(i64, Vec<Change>)> = Vec::new();
    for event in events {
        let Some(kv) = event.kv() else { continue };
        let revision = kv.mod_revision();
        let Some(key) = std::str::from_utf8(kv.key())
            .ok()
            .and_then(|k| k.strip_prefix(prefix))
        else {
            continue;
        };
        let change = Change {
            op: match event.event_type() {
                EventType::Put => Op::Put,
                EventType::Delete => Op::Delete,
            },
            key: key.to_string(),
            value: kv.value().to_vec(),
            lease: kv.lease(),
        };
        match out.last_mut() {
            Some((r, changes)) if *r == revision => changes.push(change),
            _ => out.push((revision, vec![change])),
        }
    }
    out
}

/// The least key above every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/latchkey/"), b"/latchkey0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
    }

    #[test]
    fn compaction_is_told_from_other_errors() {
        let status =
            |code, msg: &str| etcd_client::Error::GRpcStatus(tonic::Status::new(code, msg));
        assert!(compacted(&status(
            tonic::Code::OutOfRange,
            "etcdserver: mvcc: required revision has been compacted"
        )));
        assert!(!compacted(&status(
            tonic::Code::OutOfRange,
            "etcdserver: mvcc: required revision is a future revision"
        )));
        assert!(!compacted(&status(tonic::Code::Unavailable, "compacted")));
    }

    #[test]
    fn connection_debug_shows_no_secrets() {
        let c = EtcdConnection {
            identity: Some((b"cert".to_vec(), b"PRIVATE KEY".to_vec())),
            login: Some(("audit".into(), "hunter2".into())),
            ..EtcdConnection::default()
        };
        let shown = format!("{c:?}");
        assert!(
            shown.contains("audit") && !shown.contains("hunter2") && !shown.contains("PRIVATE")
        );
    }
}
