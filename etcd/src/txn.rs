//! Transactions: etcd-client's compares, operations and answers, and the
//! two things every caller does with them.

pub use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse, TxnResponse};

use etcd_client::{Client, KeyValue};

use crate::Error;

/// Runs `txn`: which branch ran ([`TxnResponse::succeeded`]), its
/// operations' answers and the header ([`revision`]).
pub async fn run(client: &Client, txn: Txn) -> Result<TxnResponse, Error> {
    Ok(client.kv_client().txn(txn).await?)
}

/// The revision in a transaction's header: the one its writes were made
/// at, when it wrote; `None` for an answer without a header.
pub fn revision(resp: &TxnResponse) -> Option<i64> {
    resp.header().map(|h| h.revision())
}

/// The first key a transaction's get operation found (`None` for another
/// operation's answer, or a get that found nothing).
pub fn first_kv(op: &TxnOpResponse) -> Option<&KeyValue> {
    match op {
        TxnOpResponse::Get(get) => get.kvs().first(),
        _ => None,
    }
}
