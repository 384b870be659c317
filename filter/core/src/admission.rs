//! Key-affine admission: bounds on concurrent *waiting* Acquire calls per key
//! (the class's limit) and per identity, counted across every Envoy worker.
//!
//! Workers run separate Wasm VMs; what they share is the host's shared-data map
//! (one per `vm_id`), which offers get, set and compare-and-swap, but no atomic
//! add and no delete. So counters live in fixed tables of slots
//! (`lk/adm/<table>/<index>`): a slot holds `count: u32 LE` then its owner (the key
//! or identity). An owner is hashed to a home slot and probes [`PROBES`] slots
//! from there; a slot with count 0 is free. The number of entries is therefore
//! bounded by the configured slot counts, however many keys pass through.
//!
//! Every change is a CAS loop. Two workers may claim two free slots for the
//! same owner at once; the rule "the earliest slot in probe order wins" resolves
//! it: after claiming, a worker that sees the owner in an earlier slot gives its
//! claim back and retries.

use thiserror::Error;

/// How many consecutive slots an owner may use.
pub const PROBES: u32 = 8;
/// CAS retries before giving up (and refusing, fail closed).
const MAX_RETRIES: usize = 64;

/// The host's shared data (proxy-wasm `get_shared_data`/`set_shared_data`).
pub trait SharedStore {
    /// The value and its CAS token; `(None, _)` if never set.
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError>;
    /// Sets `value` if the entry's CAS token is still `cas` (no check with `None`).
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError>;
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StoreError {
    #[error("compare-and-swap mismatch")]
    CasMismatch,
    #[error("shared data call failed: {0}")]
    Host(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Rejection {
    #[error("the key has its maximum of waiters")]
    KeyFull,
    #[error("the identity has its maximum of waiters")]
    IdentityFull,
    #[error("no free admission slot")]
    TableFull,
    #[error("shared data unavailable or contended")]
    Store,
}

/// Which table a slot is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Table {
    Key,
    Identity,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Table::Key => "k",
            Table::Identity => "i",
        }
    }
}

/// A held place: give it back with [`Admission::release`] when the stream ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    key: String,
    key_slot: u32,
    identity: String,
    identity_slot: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    key_slots: u32,
    identity_slots: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    count: u32,
    owner: Vec<u8>,
    cas: Option<u32>,
}

fn slot_name(table: Table, index: u32) -> String {
    format!("lk/adm/{}/{index}", table.name())
}

fn encode(count: u32, owner: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + owner.len());
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(owner);
    v
}

fn read_slot(store: &dyn SharedStore, name: &str) -> Result<Slot, Rejection> {
    let (value, cas) = store.get(name).map_err(|_| Rejection::Store)?;
    let value = value.unwrap_or_default();
    let (count, owner) = match value.split_first_chunk::<4>() {
        Some((c, owner)) => (u32::from_le_bytes(*c), owner.to_vec()),
        None => (0, Vec::new()),
    };
    Ok(Slot { count, owner, cas })
}

/// FNV-1a: a stable home slot for an owner (not a security boundary; owners
/// are compared in full).
fn home(owner: &str, slots: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in owner.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(slots.max(1))) as u32
}

impl Admission {
    pub fn new(key_slots: u32, identity_slots: u32) -> Self {
        Self {
            key_slots: key_slots.max(1),
            identity_slots: identity_slots.max(1),
        }
    }

    fn slots(&self, table: Table) -> u32 {
        match table {
            Table::Key => self.key_slots,
            Table::Identity => self.identity_slots,
        }
    }

    fn probe_order(&self, table: Table, owner: &str) -> impl Iterator<Item = u32> {
        let n = self.slots(table);
        let start = home(owner, n);
        (0..PROBES.min(n)).map(move |i| (start + i) % n)
    }

    /// Takes one place for a waiting Acquire, or says which bound refused it.
    pub fn admit(
        &self,
        store: &dyn SharedStore,
        key: &str,
        key_limit: u32,
        identity: &str,
        identity_limit: u32,
    ) -> Result<Ticket, Rejection> {
        let identity_slot = self
            .take(store, Table::Identity, identity, identity_limit)
            .map_err(|r| {
                if r == Rejection::KeyFull {
                    Rejection::IdentityFull
                } else {
                    r
                }
            })?;
        match self.take(store, Table::Key, key, key_limit) {
            Ok(key_slot) => Ok(Ticket {
                key: key.to_owned(),
                key_slot,
                identity: identity.to_owned(),
                identity_slot,
            }),
            Err(r) => {
                self.give_back(store, Table::Identity, identity_slot, identity);
                Err(r)
            }
        }
    }

    /// Gives a place back. Idempotence is the caller's job (release once).
    pub fn release(&self, store: &dyn SharedStore, ticket: &Ticket) {
        self.give_back(store, Table::Key, ticket.key_slot, &ticket.key);
        self.give_back(
            store,
            Table::Identity,
            ticket.identity_slot,
            &ticket.identity,
        );
    }

    /// Creates every missing slot entry, empty. Run from `on_configure`: the
    /// main thread's configure precedes every worker's, so on the request path
    /// slots already exist and every claim is a real compare-and-swap.
    /// Idempotent: an existing entry is never written.
    pub fn create_slots(&self, store: &dyn SharedStore) -> Result<(), StoreError> {
        for (table, n) in [
            (Table::Key, self.key_slots),
            (Table::Identity, self.identity_slots),
        ] {
            for i in 0..n {
                let name = slot_name(table, i);
                if store.get(&name)?.1.is_none() {
                    store.set(&name, &encode(0, &[]), None)?;
                }
            }
        }
        Ok(())
    }

    /// The current count for `owner` (tests and diagnostics).
    pub fn count(&self, store: &dyn SharedStore, key: &str) -> u32 {
        self.probe_order(Table::Key, key)
            .filter_map(|i| read_slot(store, &slot_name(Table::Key, i)).ok())
            .filter(|s| s.count > 0 && s.owner == key.as_bytes())
            .map(|s| s.count)
            .sum()
    }

    /// Increments `owner`'s count (claiming a slot if needed); `KeyFull` at the limit.
    fn take(
        &self,
        store: &dyn SharedStore,
        table: Table,
        owner: &str,
        limit: u32,
    ) -> Result<u32, Rejection> {
        let order: Vec<u32> = self.probe_order(table, owner).collect();
        for _ in 0..MAX_RETRIES {
            let mut slots = Vec::with_capacity(order.len());
            let mut created = false;
            for &i in &order {
                let slot = read_slot(store, &slot_name(table, i))?;
                if slot.cas.is_none() {
                    // Never claim a missing entry directly: Envoy skips the CAS
                    // check on creation. Create it empty, then claim it by CAS.
                    store
                        .set(&slot_name(table, i), &encode(0, &[]), None)
                        .map_err(|_| Rejection::Store)?;
                    created = true;
                }
                slots.push((i, slot));
            }
            if created {
                continue;
            }
            let mine = slots
                .iter()
                .find(|(_, s)| s.count > 0 && s.owner == owner.as_bytes());
            if let Some((i, s)) = mine {
                if s.count >= limit {
                    return Err(Rejection::KeyFull);
                }
                match store.set(
                    &slot_name(table, *i),
                    &encode(s.count + 1, owner.as_bytes()),
                    s.cas,
                ) {
                    Ok(()) => return Ok(*i),
                    Err(StoreError::CasMismatch) => continue,
                    Err(StoreError::Host(_)) => return Err(Rejection::Store),
                }
            }
            if limit == 0 {
                return Err(Rejection::KeyFull);
            }
            let Some((pos, (i, s))) = slots.iter().enumerate().find(|(_, (_, s))| s.count == 0)
            else {
                return Err(Rejection::TableFull);
            };
            match store.set(&slot_name(table, *i), &encode(1, owner.as_bytes()), s.cas) {
                Ok(()) => {}
                Err(StoreError::CasMismatch) => continue,
                Err(StoreError::Host(_)) => return Err(Rejection::Store),
            }
            // Did another worker claim an earlier slot for the same owner meanwhile?
            let mut earlier = false;
            for &j in order.iter().take(pos) {
                let s = read_slot(store, &slot_name(table, j))?;
                if s.count > 0 && s.owner == owner.as_bytes() {
                    earlier = true;
                    break;
                }
            }
            if !earlier {
                return Ok(*i);
            }
            self.give_back(store, table, *i, owner);
        }
        Err(Rejection::Store)
    }

    fn give_back(&self, store: &dyn SharedStore, table: Table, index: u32, owner: &str) {
        let name = slot_name(table, index);
        for _ in 0..MAX_RETRIES {
            let Ok(s) = read_slot(store, &name) else {
                return;
            };
            if s.count == 0 || s.owner != owner.as_bytes() {
                return;
            }
            match store.set(&name, &encode(s.count - 1, owner.as_bytes()), s.cas) {
                Err(StoreError::CasMismatch) => continue,
                _ => return,
            }
        }
    }
}

/// An in-memory [`SharedStore`] with Envoy's semantics (CAS token bumps on every set).
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: std::sync::Mutex<std::collections::HashMap<String, (Vec<u8>, u32)>>,
}

impl SharedStore for MemoryStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        let map = self
            .map
            .lock()
            .map_err(|e| StoreError::Host(e.to_string()))?;
        Ok(match map.get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        let mut map = self
            .map
            .lock()
            .map_err(|e| StoreError::Host(e.to_string()))?;
        let is_new = !map.contains_key(key);
        let entry = map.entry(key.to_owned()).or_insert((Vec::new(), 0));
        // Envoy: the CAS is checked only on an existing entry (a missing one is
        // created whatever the token), and the token changes on every set.
        if let Some(c) = cas
            && c != 0
            && !is_new
            && c != entry.1
        {
            return Err(StoreError::CasMismatch);
        }
        entry.0 = value.to_vec();
        entry.1 = entry.1.wrapping_add(1).max(1);
        Ok(())
    }
}

impl MemoryStore {
    pub fn entries(&self) -> usize {
        self.map.lock().map(|m| m.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const ID: &str = "spiffe://dev.latchkey/workload/a";

    #[test]
    fn the_key_bound_holds_and_slots_come_back() {
        let store = MemoryStore::default();
        let adm = Admission::new(64, 16);
        let t1 = adm.admit(&store, "a/k", 2, ID, 10).unwrap();
        let t2 = adm.admit(&store, "a/k", 2, ID, 10).unwrap();
        assert_eq!(adm.admit(&store, "a/k", 2, ID, 10), Err(Rejection::KeyFull));
        // Another key is unaffected.
        let t3 = adm.admit(&store, "a/other", 2, ID, 10).unwrap();
        adm.release(&store, &t1);
        let t4 = adm.admit(&store, "a/k", 2, ID, 10).unwrap();
        for t in [t2, t3, t4] {
            adm.release(&store, &t);
        }
        assert_eq!(adm.count(&store, "a/k"), 0);
    }

    #[test]
    fn the_identity_bound_holds_across_keys() {
        let store = MemoryStore::default();
        let adm = Admission::new(64, 16);
        let t1 = adm.admit(&store, "a/1", 5, ID, 2).unwrap();
        let _t2 = adm.admit(&store, "a/2", 5, ID, 2).unwrap();
        assert_eq!(
            adm.admit(&store, "a/3", 5, ID, 2),
            Err(Rejection::IdentityFull)
        );
        // A refused key does not leak an identity place.
        let other = "spiffe://dev.latchkey/workload/b";
        let _k = adm.admit(&store, "b/1", 1, other, 5).unwrap();
        assert_eq!(
            adm.admit(&store, "b/1", 1, other, 5),
            Err(Rejection::KeyFull)
        );
        adm.release(&store, &t1);
        assert!(adm.admit(&store, "a/3", 5, ID, 2).is_ok());
    }

    #[test]
    fn the_number_of_entries_is_bounded() {
        let store = MemoryStore::default();
        let adm = Admission::new(8, 4);
        let mut held = Vec::new();
        for i in 0..8 {
            held.push(adm.admit(&store, &format!("k/{i}"), 1, ID, 100).unwrap());
        }
        assert_eq!(
            adm.admit(&store, "k/8", 1, ID, 100),
            Err(Rejection::TableFull)
        );
        for t in &held {
            adm.release(&store, t);
        }
        for i in 100..200 {
            let t = adm.admit(&store, &format!("k/{i}"), 1, ID, 100).unwrap();
            adm.release(&store, &t);
        }
        assert!(store.entries() <= 8 + 4);
    }

    #[test]
    fn concurrent_workers_never_exceed_the_bound() {
        let store = Arc::new(MemoryStore::default());
        let adm = Admission::new(4, 4);
        let limit = 3;
        let peak = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                let peak = peak.clone();
                std::thread::spawn(move || {
                    for _ in 0..300 {
                        if let Ok(t) = adm.admit(&*store, "hot/key", limit, ID, 1000) {
                            let now = adm.count(&*store, "hot/key");
                            peak.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                            adm.release(&*store, &t);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(std::sync::atomic::Ordering::SeqCst) <= limit);
        assert_eq!(adm.count(&*store, "hot/key"), 0);
    }
}
