//! An etcd lease kept alive the way etcd's own clients keep a session's: the
//! baseline side of the benchmarks that compare Latchkey's sessions with
//! etcd's Lock and election APIs.

use std::time::Duration;

use latchkey_etcd::Client;
use tokio::task::JoinHandle;

/// An etcd lease with a keepalive task renewing it every TTL/3, as a
/// Latchkey client renews its session (aborted on drop; the lease then
/// expires one TTL after its last renewal).
pub struct EtcdLease {
    pub id: i64,
    keepalive: JoinHandle<()>,
}

impl EtcdLease {
    /// Grants a lease of `ttl_secs` on `client` and starts renewing it.
    pub async fn grant(client: &mut Client, ttl_secs: i64) -> anyhow::Result<Self> {
        let id = client.lease_grant(ttl_secs, None).await?.id();
        let (mut keeper, mut responses) = client.lease_keep_alive(id).await?;
        let every = Duration::from_millis(ttl_secs.unsigned_abs() * 1000 / 3);
        let keepalive = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if keeper.keep_alive().await.is_err()
                    || !matches!(responses.message().await, Ok(Some(_)))
                {
                    tracing::warn!(lease = id, "etcd lease keepalive ended");
                    return;
                }
            }
        });
        Ok(Self { id, keepalive })
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        self.keepalive.abort();
    }
}
