//! The grant table a VM decides with, and the last good one, kept in host
//! shared data so that a freshly loaded VM never decides with a table it has
//! not received (issue 19).
//!
//! An ECDS update (a new module or only a new configuration) gives every worker
//! a new root context. Shipped as dev-up ships it, its plugin configuration
//! carries no grants: the table comes only from the arbiter's `GetEdgePolicy`.
//! Before its first refresh answered, such a VM denied every caller
//! `PERMISSION_DENIED`. Shared data is one map per `vm_id`, shared by the
//! workers and kept across VM swaps (the `vm_id` stays the same), so every
//! successful refresh stores the arbiter's answer there ([`LastGood`], one
//! bounded entry written by CAS) and a new VM starts from it
//! ([`GrantTable::start`]).
//!
//! What a decision may use is a [`Table`]: `NotReady` when there is truly no
//! table yet (first start, before any refresh succeeded) and `Stale` when the
//! arbiter has not confirmed the table for `refresh.stale_after_ms`. Both are
//! answered `UNAVAILABLE` (retryable, `POLICY_NOT_READY` / `POLICY_STALE`) where
//! a fresh table would answer `PERMISSION_DENIED`: the caller may have a grant
//! the edge does not know about yet. A stale table still lets through what it
//! covers: the arbiter authorises every call again.

use std::cell::Cell;

use thiserror::Error;

use crate::admission::{SharedStore, StoreError};
use crate::config::FilterConfig;
use crate::policy::EdgePolicy;

/// The shared-data entry of the last good table (one entry: bounded).
pub const LAST_GOOD_ENTRY: &str = "lk/policy/last-good";
/// The largest `EdgePolicy` message kept in shared data (every worker holds a
/// copy of the entry while it reads it).
pub const MAX_STORED_MESSAGE_BYTES: usize = 4 << 20;
/// Format tag of the entry; another tag (an older or newer filter's format)
/// reads as no entry.
const MAGIC: &[u8; 4] = b"LKG1";
const HEADER: usize = 4 + 8 + 8;
const MAX_CAS_ATTEMPTS: usize = 8;

/// The arbiter's last good answer: the encoded `EdgePolicy` message, its
/// version and when a refresh received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastGood {
    /// Milliseconds since the Unix epoch (the host clock).
    pub refreshed_at_ms: u64,
    pub version: u64,
    pub message: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    Written,
    /// The entry already held a refresh at least as recent (another worker's).
    NewerKept,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SaveError {
    #[error("grant table of {size} bytes is over the {max} bytes kept in shared data")]
    TooLarge { size: usize, max: usize },
    #[error("last good grant table: {0}")]
    Store(#[from] StoreError),
}

impl LastGood {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.message.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.refreshed_at_ms.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.message);
        out
    }

    /// `None` for an empty entry, another format, or an oversized message.
    pub fn decode(bytes: &[u8]) -> Option<LastGood> {
        let rest = bytes.strip_prefix(MAGIC)?;
        let (at, rest) = rest.split_first_chunk::<8>()?;
        let (version, message) = rest.split_first_chunk::<8>()?;
        if message.len() > MAX_STORED_MESSAGE_BYTES {
            return None;
        }
        Some(LastGood {
            refreshed_at_ms: u64::from_le_bytes(*at),
            version: u64::from_le_bytes(*version),
            message: message.to_vec(),
        })
    }

    pub fn load(store: &dyn SharedStore) -> Result<Option<LastGood>, StoreError> {
        let (value, _) = store.get(LAST_GOOD_ENTRY)?;
        Ok(value.as_deref().and_then(LastGood::decode))
    }

    /// Stores this table unless the entry already holds a more recent refresh.
    /// The write is a compare-and-swap on the entry, so two workers refreshing
    /// at once never put an older answer over a newer one.
    pub fn save(&self, store: &dyn SharedStore) -> Result<Saved, SaveError> {
        if self.message.len() > MAX_STORED_MESSAGE_BYTES {
            return Err(SaveError::TooLarge {
                size: self.message.len(),
                max: MAX_STORED_MESSAGE_BYTES,
            });
        }
        let encoded = self.encode();
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (value, cas) = store.get(LAST_GOOD_ENTRY)?;
            let Some(cas) = cas else {
                // Envoy creates a missing entry whatever the CAS token: create
                // it empty, then compare-and-swap from its token like any other.
                store.set(LAST_GOOD_ENTRY, &[], None)?;
                continue;
            };
            if let Some(current) = value.as_deref().and_then(LastGood::decode)
                && current.refreshed_at_ms >= self.refreshed_at_ms
            {
                return Ok(Saved::NewerKept);
            }
            match store.set(LAST_GOOD_ENTRY, &encoded, Some(cas)) {
                Ok(()) => return Ok(Saved::Written),
                Err(StoreError::CasMismatch) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::CasMismatch.into())
    }
}

/// Where a VM's table came from (a stat label: `grant_table_start.result.<origin>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The plugin configuration's grants.
    Configured,
    /// The last good table in shared data (an earlier VM's or another worker's refresh).
    Carried,
    /// This VM's own refresh.
    Refreshed,
    /// No table: refresh configured, no grants configured, nothing stored yet.
    None,
}

impl Origin {
    pub fn label(self) -> &'static str {
        match self {
            Origin::Configured => "configured",
            Origin::Carried => "carried",
            Origin::Refreshed => "refreshed",
            Origin::None => "none",
        }
    }
}

/// What a decision may use.
#[derive(Debug, Clone, Copy)]
pub enum Table<'a> {
    /// No table received yet: nothing can be authorised or denied.
    NotReady,
    Fresh(&'a EdgePolicy),
    /// Not confirmed by the arbiter for `stale_after_ms`: what it covers
    /// passes (the arbiter checks again), what it does not is not final.
    Stale(&'a EdgePolicy),
}

impl Table<'_> {
    /// The grant subject `identity` is bounded as ([`EdgePolicy::bound_subject`]);
    /// the identity itself before a table is in.
    pub fn bound_subject(&self, identity: &str) -> String {
        match self {
            Table::Fresh(p) | Table::Stale(p) => p.bound_subject(identity).to_string(),
            Table::NotReady => identity.to_string(),
        }
    }
}

/// A VM's grant table with its origin and the time the arbiter last confirmed it.
#[derive(Debug)]
pub struct GrantTable {
    policy: Option<EdgePolicy>,
    origin: Origin,
    /// Milliseconds since the Unix epoch; for a configured table with a
    /// refresh, when the VM started (it was never confirmed).
    confirmed_at_ms: Cell<u64>,
    /// `None`: never stale (no refresh configured, the configuration is the table).
    stale_after_ms: Option<u64>,
}

impl GrantTable {
    /// The table a freshly configured VM starts with.
    ///
    /// Without a refresh the configuration is the table. With one, the last
    /// good table from shared data comes first (it is what the arbiter said
    /// last, whatever grants a configuration carries as a seed), then the
    /// configured grants, else none (`NotReady` until a refresh answers).
    pub fn start(
        config: &FilterConfig,
        configured: EdgePolicy,
        stored: Option<&LastGood>,
        now_ms: u64,
    ) -> GrantTable {
        let Some(refresh) = &config.refresh else {
            return GrantTable {
                policy: Some(configured),
                origin: Origin::Configured,
                confirmed_at_ms: Cell::new(now_ms),
                stale_after_ms: None,
            };
        };
        let stale_after_ms = Some(refresh.stale_after_ms());
        let carried = stored.and_then(|s| {
            EdgePolicy::from_arbiter(&s.message, config.default_max_waiters_per_key)
                .ok()
                .map(|p| (p, s.refreshed_at_ms))
        });
        let (policy, origin, confirmed_at_ms) = match carried {
            Some((policy, at)) => (Some(policy), Origin::Carried, at),
            None if !configured.grants().is_empty() => {
                (Some(configured), Origin::Configured, now_ms)
            }
            None => (None, Origin::None, now_ms),
        };
        GrantTable {
            policy,
            origin,
            confirmed_at_ms: Cell::new(confirmed_at_ms),
            stale_after_ms,
        }
    }

    /// A table from the arbiter (this VM's refresh, or another's from shared data).
    pub fn received(
        config: &FilterConfig,
        policy: EdgePolicy,
        origin: Origin,
        at_ms: u64,
    ) -> GrantTable {
        GrantTable {
            policy: Some(policy),
            origin,
            confirmed_at_ms: Cell::new(at_ms),
            stale_after_ms: config.refresh.as_ref().map(|r| r.stale_after_ms()),
        }
    }

    /// The arbiter answered the same table again at `at_ms`.
    pub fn confirm(&self, at_ms: u64) {
        if at_ms > self.confirmed_at_ms.get() {
            self.confirmed_at_ms.set(at_ms);
        }
    }

    pub fn view(&self, now_ms: u64) -> Table<'_> {
        let Some(policy) = &self.policy else {
            return Table::NotReady;
        };
        match self.stale_after_ms {
            Some(after) if now_ms.saturating_sub(self.confirmed_at_ms.get()) > after => {
                Table::Stale(policy)
            }
            _ => Table::Fresh(policy),
        }
    }

    pub fn policy(&self) -> Option<&EdgePolicy> {
        self.policy.as_ref()
    }

    pub fn origin(&self) -> Origin {
        self.origin
    }

    pub fn confirmed_at_ms(&self) -> u64 {
        self.confirmed_at_ms.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::MemoryStore;
    use crate::policy::tests::edge_policy_message;
    use latchkey_policies::LockKey;

    const ALICE: &str = "spiffe://dev.latchkey/workload/alice";

    fn config(json: &str) -> (FilterConfig, EdgePolicy) {
        FilterConfig::parse(json.as_bytes()).unwrap()
    }

    /// As dev-up ships it: no grants, refresh from the arbiter.
    fn arbiter_only() -> (FilterConfig, EdgePolicy) {
        config(
            r#"{"trust_domain":"dev.latchkey",
                "refresh":{"cluster":"arbiter_policy","period_ms":1000,"timeout_ms":500}}"#,
        )
    }

    fn stored(at: u64, version: u64) -> LastGood {
        LastGood {
            refreshed_at_ms: at,
            version,
            message: edge_policy_message(version, &[(ALICE, &["demo"])], &[("demo", 3)]),
        }
    }

    fn covers(table: &GrantTable, key: &str) -> bool {
        let key = LockKey::parse(key).unwrap();
        table
            .policy()
            .is_some_and(|p| p.authorise(ALICE, &key).is_some())
    }

    #[test]
    fn the_entry_round_trips_and_foreign_bytes_read_as_none() {
        let s = stored(1_700_000_000_000, 42);
        assert_eq!(LastGood::decode(&s.encode()), Some(s.clone()));
        assert_eq!(LastGood::decode(&[]), None);
        assert_eq!(LastGood::decode(b"LKG1short"), None);
        let mut other = s.encode();
        other[3] = b'9';
        assert_eq!(LastGood::decode(&other), None);
    }

    #[test]
    fn a_new_vm_starts_from_the_stored_table_when_its_configuration_has_none() {
        let (c, configured) = arbiter_only();
        let store = MemoryStore::default();
        // First start ever: nothing stored, nothing configured.
        let t = GrantTable::start(&c, configured.clone(), None, 10_000);
        assert_eq!(t.origin(), Origin::None);
        assert!(matches!(t.view(10_000), Table::NotReady));
        // A refresh stores the arbiter's answer; the next VM starts from it.
        assert_eq!(stored(9_000, 7).save(&store), Ok(Saved::Written));
        let loaded = LastGood::load(&store).unwrap();
        let t = GrantTable::start(&c, configured, loaded.as_ref(), 10_000);
        assert_eq!(t.origin(), Origin::Carried);
        assert_eq!(t.confirmed_at_ms(), 9_000);
        assert!(matches!(t.view(10_000), Table::Fresh(p) if p.version() == 7));
        assert!(covers(&t, "demo/x"));
        assert_eq!(t.policy().unwrap().max_waiters_per_key("demo"), 3);
    }

    #[test]
    fn the_stored_table_wins_over_configured_grants_only_with_a_refresh() {
        let with_refresh = r#"{"trust_domain":"dev.latchkey",
            "grants":[{"identity":"spiffe://dev.latchkey/workload/alice","prefixes":["seed"]}],
            "refresh":{"cluster":"a"}}"#;
        let (c, configured) = config(with_refresh);
        let s = stored(5, 7);
        let t = GrantTable::start(&c, configured.clone(), Some(&s), 10);
        assert_eq!(t.origin(), Origin::Carried);
        assert!(covers(&t, "demo/x") && !covers(&t, "seed/x"));
        // Nothing stored: the configured seed.
        let t = GrantTable::start(&c, configured, None, 10);
        assert_eq!(t.origin(), Origin::Configured);
        assert!(covers(&t, "seed/x"));
        // Without a refresh the configuration is the table, and never stale.
        let (c, configured) = config(
            r#"{"trust_domain":"dev.latchkey",
                "grants":[{"identity":"spiffe://dev.latchkey/workload/alice","prefixes":["seed"]}]}"#,
        );
        let t = GrantTable::start(&c, configured, Some(&s), 10);
        assert_eq!(t.origin(), Origin::Configured);
        assert!(covers(&t, "seed/x") && !covers(&t, "demo/x"));
        assert!(matches!(t.view(u64::MAX), Table::Fresh(_)));
    }

    #[test]
    fn an_unreadable_stored_table_is_not_used() {
        let (c, configured) = arbiter_only();
        let bad = LastGood {
            refreshed_at_ms: 5,
            version: 1,
            message: vec![0x12, 0x05, 0x0a],
        };
        let t = GrantTable::start(&c, configured, Some(&bad), 10);
        assert_eq!(t.origin(), Origin::None);
        assert!(matches!(t.view(10), Table::NotReady));
    }

    #[test]
    fn a_table_goes_stale_without_confirmation_and_fresh_again_with_it() {
        let (c, configured) = arbiter_only();
        // period 1000 + timeout 500: stale after 3500 ms.
        let s = stored(1_000, 7);
        let t = GrantTable::start(&c, configured, Some(&s), 1_000);
        assert!(matches!(t.view(4_500), Table::Fresh(_)));
        assert!(matches!(t.view(4_501), Table::Stale(_)));
        t.confirm(4_600);
        assert!(matches!(t.view(4_700), Table::Fresh(_)));
        // An older confirmation never moves it back.
        t.confirm(10);
        assert_eq!(t.confirmed_at_ms(), 4_600);
        // A carried table that was already old is stale from the start.
        let (c, configured) = arbiter_only();
        let t = GrantTable::start(&c, configured, Some(&s), 60_000);
        assert!(matches!(t.view(60_000), Table::Stale(_)));
    }

    #[test]
    fn saves_never_put_an_older_refresh_over_a_newer_one() {
        let store = MemoryStore::default();
        assert_eq!(stored(200, 2).save(&store), Ok(Saved::Written));
        assert_eq!(stored(100, 1).save(&store), Ok(Saved::NewerKept));
        assert_eq!(stored(200, 1).save(&store), Ok(Saved::NewerKept));
        assert_eq!(LastGood::load(&store).unwrap().unwrap().version, 2);
        assert_eq!(stored(300, 3).save(&store), Ok(Saved::Written));
        assert_eq!(LastGood::load(&store).unwrap().unwrap().version, 3);
    }

    /// A store whose entry another worker rewrites between our read and our
    /// write: the CAS refuses the stale write and the retry sees the newer one.
    struct Contended {
        inner: MemoryStore,
        newer: LastGood,
        raced: Cell<bool>,
    }

    impl SharedStore for Contended {
        fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
            if cas.is_some() && !self.raced.replace(true) {
                self.inner.set(key, &self.newer.encode(), None)?;
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn a_concurrent_newer_write_wins_the_race() {
        let store = Contended {
            inner: MemoryStore::default(),
            newer: stored(500, 5),
            raced: Cell::new(false),
        };
        assert_eq!(stored(100, 1).save(&store), Ok(Saved::NewerKept));
        assert_eq!(LastGood::load(&store).unwrap().unwrap().version, 5);
    }

    #[test]
    fn an_oversized_table_is_not_stored() {
        let store = MemoryStore::default();
        let big = LastGood {
            refreshed_at_ms: 1,
            version: 1,
            message: vec![0; MAX_STORED_MESSAGE_BYTES + 1],
        };
        assert!(matches!(big.save(&store), Err(SaveError::TooLarge { .. })));
        assert_eq!(LastGood::load(&store).unwrap(), None);
    }
}
