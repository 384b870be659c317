use latchkey_proto::lockv1::{Holder, InspectRequest, InspectResponse, Mode};
use tonic::Request;

use super::Arbiter;
use crate::error::ArbiterError;

/// The most shared holders one Inspect answer lists (the count says how
/// many there are).
pub const MAX_SHARED_HOLDERS_SHOWN: usize = 256;

impl Arbiter {
    /// Who holds a key, for callers with a grant on its prefix only. Never
    /// the token (a capability: the holder has it from its grant); the
    /// holder's session id only to the holder's identity and to operators.
    pub async fn inspect(
        &self,
        request: Request<InspectRequest>,
    ) -> Result<InspectResponse, ArbiterError> {
        let caller = self.caller(&request)?;
        let policies = self.policies.current();
        let key = self.authorised_key(&policies, &caller, &request.get_ref().key)?;
        let operator = policies.is_operator(&caller.identity);
        let table = &self.tiers.for_key(&key).await?.table;
        // Four reads side by side: the holder, a semaphore's slot holders,
        // a lock's shared holders, and the durable queue's length.
        let (holder, slots, readers, durable_waiters) = tokio::join!(
            table.holder(key.as_str()),
            table.slot_holders(key.as_str()),
            table.reader_holders(key.as_str()),
            table.durable_waiting(key.as_str())
        );
        let durable_waiters = durable_waiters?;
        let shown = |h: crate::table::HolderView, slot: Option<u32>, mode: Mode| {
            let shown = session_shown(&h.record.identity, &caller.identity, operator);
            let session_id = if shown { h.record.session } else { 0 };
            Holder {
                identity: h.record.identity,
                session_id,
                class: h.record.class,
                acquired_at_unix_ms: h.record.acquired_at_unix_ms,
                annotations: h.record.annotations.into_iter().collect(),
                slot,
                mode: mode.into(),
                ..Holder::default()
            }
        };
        let holder = holder?.map(|h| shown(h, None, Mode::Exclusive));
        let slot_holders = slots?
            .into_iter()
            .map(|(slot, h)| shown(h, Some(slot), Mode::Exclusive))
            .collect();
        let readers = readers?;
        let shared_holder_count = u32::try_from(readers.len()).unwrap_or(u32::MAX);
        let shared_holders = readers
            .into_iter()
            .take(MAX_SHARED_HOLDERS_SHOWN)
            .map(|h| shown(h, None, Mode::Shared))
            .collect();
        Ok(InspectResponse {
            key: key.as_str().to_string(),
            holder,
            waiters: u32::try_from(table.waiting(key.as_str())).unwrap_or(u32::MAX),
            durable_waiters,
            slot_holders,
            shared_holders,
            shared_holder_count,
        })
    }
}

/// Whether a holder's session id is shown to `caller`: to the holder's own
/// identity and to operators only (a session id is not a capability, but
/// nobody else needs it).
fn session_shown(holder: &str, caller: &str, operator: bool) -> bool {
    operator || holder == caller
}

#[cfg(test)]
mod tests {
    use super::session_shown;

    #[test]
    fn only_the_holder_and_operators_see_the_session() {
        assert!(session_shown(
            "spiffe://td/alice",
            "spiffe://td/alice",
            false
        ));
        assert!(!session_shown(
            "spiffe://td/alice",
            "spiffe://td/bob",
            false
        ));
        assert!(session_shown("spiffe://td/alice", "spiffe://td/op", true));
    }
}
