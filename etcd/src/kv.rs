//! Reads and writes of keys: etcd-client's types, and the reads every
//! caller repeats (one key with its header, the header alone, a count).

pub use etcd_client::{
    DeleteOptions, DeleteResponse, GetOptions, GetResponse, KeyValue, KvClient, PutOptions,
    PutResponse, SortOrder, SortTarget,
};

use etcd_client::{Client, ResponseHeader};

use crate::Error;

/// What a read found, with the header of the answer it came in (etcd always
/// sends one; what its absence means is the caller's to say).
#[derive(Debug, Clone)]
pub struct Read<T> {
    pub value: T,
    pub header: Option<ResponseHeader>,
}

/// `key` (`None`: absent), read linearizably.
pub async fn get_one(
    client: &Client,
    key: impl Into<Vec<u8>>,
) -> Result<Read<Option<KeyValue>>, Error> {
    let mut resp = client.kv_client().get(key, None).await?;
    Ok(Read {
        header: resp.take_header(),
        value: resp.take_kvs().into_iter().next(),
    })
}

/// The header of a count-only read of `key`: etcd's cluster id and current
/// revision, with nothing else transferred.
pub async fn head(
    client: &Client,
    key: impl Into<Vec<u8>>,
) -> Result<Option<ResponseHeader>, Error> {
    let options = GetOptions::new().with_count_only();
    let mut resp = client.kv_client().get(key, Some(options)).await?;
    Ok(resp.take_header())
}

/// How many keys start with `prefix` (count only: nothing but the count
/// is transferred).
pub async fn count_prefix(client: &Client, prefix: impl Into<Vec<u8>>) -> Result<Read<i64>, Error> {
    let options = GetOptions::new().with_prefix().with_count_only();
    let mut resp = client.kv_client().get(prefix, Some(options)).await?;
    Ok(Read {
        value: resp.count(),
        header: resp.take_header(),
    })
}
