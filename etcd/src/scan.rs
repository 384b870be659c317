//! Every key under a prefix, read in pages at one revision: what a reader
//! that rebuilds its state from scratch does (the arbiter's hold and session
//! counts before they watch, the audit tailer at its checkpoint). One
//! request for a large prefix could pass gRPC's message limit and hold etcd
//! up; pages read at the first page's revision (or a given one) are one
//! consistent view all the same.

use etcd_client::{Client, GetOptions, KeyValue};

use crate::Error;

/// Every key under `prefix`, `page` keys per request, all read at revision
/// `at` (`None`: at the first page's, etcd's current revision then).
/// `each` sees every key in key order; the answer is the revision read at.
/// A compacted `at` fails with [`crate::ErrorKind::Compacted`].
pub async fn scan_prefix(
    client: &Client,
    prefix: &str,
    page: i64,
    at: Option<i64>,
    mut each: impl FnMut(&KeyValue),
) -> Result<i64, Error> {
    let mut kv_client = client.kv_client();
    let range_end = prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = at.unwrap_or(0);
    loop {
        let mut options = GetOptions::new()
            .with_range(range_end.clone())
            .with_limit(page);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let resp = kv_client.get(from.clone(), Some(options)).await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        for kv in resp.kvs() {
            each(kv);
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok(revision),
        }
    }
}

/// The least key above every key that starts with `prefix` (etcd's range
/// end for a prefix); `[0]` (every key) when there is none.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
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
    fn prefix_end_is_etcds() {
        assert_eq!(prefix_end(b"/latchkey/l/"), b"/latchkey/l0".to_vec());
        assert_eq!(prefix_end(b"/latchkey/"), b"/latchkey0".to_vec());
        assert_eq!(prefix_end("a\u{7f}".as_bytes()), b"a\x80".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
