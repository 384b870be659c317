//! Admission at the edge, counted across every Envoy worker: bounds on
//! concurrent *waiting* Acquire calls per key (the class's limit), per
//! identity on one key (its share of the key, [`identity_share`]) and per
//! identity, and on every identity's concurrent streams (KeepAlive included).
//!
//! Workers run separate Wasm VMs; what they share is the host's shared-data map
//! (one per `vm_id`), which offers get, set and compare-and-swap, but no atomic
//! add and no delete. So counters live in fixed tables of slots
//! (`lk/adm/<table>/<index>`): a slot holds `count: u32 LE` then the owner's
//! fingerprint (`u64 LE`). The number of entries is bounded by the configured
//! slot counts, however many keys pass through.
//!
//! Placement is keyed: an owner's fingerprint is SipHash-2-4 under the
//! admission secret ([`AdmissionSecret`]), its home slot the fingerprint modulo
//! the table size, and it probes up to [`PROBES`] slots from there. A caller who
//! does not know the secret cannot choose keys that crowd another key's window.
//! And crowding never refuses another key's waiter anyway: only the key's own
//! count (in the slot carrying its fingerprint) is held against its bound; a
//! key whose whole window is taken by other keys' waiters *overflows* — the
//! edge lets it wait without a place (counted; the arbiter's own per-key
//! bound still holds). Identity windows that fill up are a distinct refusal
//! ([`Rejection::TableFull`], [`Rejection::StreamTableFull`]).
//!
//! A slot whose count drops to 0 keeps its fingerprint (it is free, but still
//! marks that the window was used), so a lookup stops at the first slot that
//! was never used: an owner is always placed in the first free slot, and slots
//! are never un-used again, so it cannot sit beyond one. Every change is a CAS
//! loop. Two workers may claim two free slots for the same owner at once; the
//! rule "the earliest slot in probe order wins" resolves it: after claiming, a
//! worker that sees the owner in an earlier slot gives its claim back and
//! retries.

use thiserror::Error;

use crate::keyed_hash::AdmissionSecret;

/// How many consecutive slots an owner may use.
pub const PROBES: u32 = 16;
/// CAS retries before giving up (and refusing, fail closed).
const MAX_RETRIES: usize = 64;
/// Where the secret lives when the configuration does not give one.
pub const SECRET_ENTRY: &str = "lk/adm/secret";

/// The waiting places one identity may take on one key whose class allows
/// `max_waiters_per_key`: half of them, rounded up. So one identity never
/// fills a key another identity waits for (whenever the class allows two or
/// more waiters, the other half stays open to everyone else), and a key one
/// identity alone contends for still queues half the class's bound. The
/// arbiter applies the same rule to its own queues
/// (`arbiter/src/table/queues.rs`), so a caller that bypasses the edge gets
/// no more.
pub const fn identity_share(max_waiters_per_key: u32) -> u32 {
    max_waiters_per_key.div_ceil(2)
}

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
    #[error("the identity has its share of the key's waiters")]
    KeyShareFull,
    #[error("the identity has its maximum of waiters")]
    IdentityFull,
    #[error("no free slot for the identity in the waiter table")]
    TableFull,
    #[error("the identity has its maximum of open streams")]
    StreamsFull,
    #[error("no free slot for the identity in the stream table")]
    StreamTableFull,
    #[error("shared data unavailable or contended")]
    Store,
}

/// Which table a slot is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Table {
    Key,
    /// One identity's waiters on one key (its share of the key).
    Pair,
    Identity,
    Stream,
}

impl Table {
    fn name(self) -> &'static str {
        match self {
            Table::Key => "k",
            Table::Pair => "p",
            Table::Identity => "i",
            Table::Stream => "s",
        }
    }
}

/// One counted place: a slot and the fingerprint it was counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    table: Table,
    index: u32,
    owner: u64,
}

/// A waiting Acquire's places: give them back with [`Admission::release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    /// `None`: the key's window was full of other keys (overflow).
    key: Option<Place>,
    /// `None`: the (identity, key) window was full of other pairs (overflow).
    pair: Option<Place>,
    identity: Place,
}

impl Ticket {
    /// Admitted without a key or a share place (the window was full of
    /// others; the arbiter's own bounds still hold).
    pub fn overflowed(&self) -> bool {
        self.key.is_none() || self.pair.is_none()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    key_slots: u32,
    identity_slots: u32,
    secret: AdmissionSecret,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    count: u32,
    /// `None`: never used.
    owner: Option<u64>,
    cas: Option<u32>,
}

/// `lk/adm/<table>/<index>`, built without the formatting machinery (it runs
/// twice per stream, and `format!` is slow in Wasm).
fn slot_name(table: Table, index: u32) -> String {
    let mut name = String::with_capacity(18);
    name.push_str("lk/adm/");
    name.push_str(table.name());
    name.push('/');
    let mut digits = [0u8; 10];
    let mut n = index;
    let mut len = 0;
    for d in digits.iter_mut() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
        len += 1;
        if n == 0 {
            break;
        }
    }
    for d in digits.iter().take(len).rev() {
        name.push(char::from(*d));
    }
    name
}

fn encode(count: u32, owner: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(12);
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(&owner.to_le_bytes());
    v
}

fn read_slot(store: &dyn SharedStore, name: &str) -> Result<Slot, Rejection> {
    let (value, cas) = store.get(name).map_err(|_| Rejection::Store)?;
    let value = value.unwrap_or_default();
    let slot = match value.split_first_chunk::<4>() {
        Some((c, rest)) => match rest.split_first_chunk::<8>() {
            Some((o, _)) => Slot {
                count: u32::from_le_bytes(*c),
                owner: Some(u64::from_le_bytes(*o)),
                cas,
            },
            None => Slot {
                count: 0,
                owner: None,
                cas,
            },
        },
        None => Slot {
            count: 0,
            owner: None,
            cas,
        },
    };
    Ok(slot)
}

/// The owner name of `identity`'s waiters on `key` in the pair table. NUL
/// separates them: neither a SPIFFE ID nor a key can contain one.
fn pair_owner(identity: &str, key: &str) -> String {
    let mut owner = String::with_capacity(identity.len() + 1 + key.len());
    owner.push_str(identity);
    owner.push('\0');
    owner.push_str(key);
    owner
}

/// Why a table refused a place.
enum Refused {
    AtLimit,
    WindowFull,
    Store,
}

impl Admission {
    pub fn new(key_slots: u32, identity_slots: u32, secret: AdmissionSecret) -> Self {
        Self {
            key_slots: key_slots.max(1),
            identity_slots: identity_slots.max(1),
            secret,
        }
    }

    fn slots(&self, table: Table) -> u32 {
        match table {
            // A pair with waiters has a key with waiters: as many at most.
            Table::Key | Table::Pair => self.key_slots,
            Table::Identity | Table::Stream => self.identity_slots,
        }
    }

    /// The owner's fingerprint in `table` (the table's name is hashed in, so
    /// one identity lands independently in the waiter and stream tables).
    fn fingerprint(&self, table: Table, owner: &str) -> u64 {
        let mut data = Vec::with_capacity(2 + owner.len());
        data.extend_from_slice(table.name().as_bytes());
        data.push(0);
        data.extend_from_slice(owner.as_bytes());
        self.secret.hash(&data)
    }

    fn probe_order(&self, table: Table, owner: u64) -> impl Iterator<Item = u32> {
        let n = self.slots(table);
        let start = (owner % u64::from(n)) as u32;
        (0..PROBES.min(n)).map(move |i| (start + i) % n)
    }

    /// Takes one place for a waiting Acquire, or says which bound refused it:
    /// the identity's bound, then its share of the key
    /// ([`identity_share`] of `key_limit`), then the key's bound.
    pub fn admit(
        &self,
        store: &dyn SharedStore,
        key: &str,
        key_limit: u32,
        identity: &str,
        identity_limit: u32,
    ) -> Result<Ticket, Rejection> {
        let identity_place = self
            .take(store, Table::Identity, identity, identity_limit)
            .map_err(|r| match r {
                Refused::AtLimit => Rejection::IdentityFull,
                Refused::WindowFull => Rejection::TableFull,
                Refused::Store => Rejection::Store,
            })?;
        let pair = match self.take(
            store,
            Table::Pair,
            &pair_owner(identity, key),
            identity_share(key_limit),
        ) {
            Ok(place) => Some(place),
            // Other pairs fill this one's window: never a reason to refuse it.
            Err(Refused::WindowFull) => None,
            Err(r) => {
                self.give_back(store, &identity_place);
                return Err(match r {
                    Refused::AtLimit => Rejection::KeyShareFull,
                    _ => Rejection::Store,
                });
            }
        };
        match self.take(store, Table::Key, key, key_limit) {
            Ok(place) => Ok(Ticket {
                key: Some(place),
                pair,
                identity: identity_place,
            }),
            // Other keys fill this key's window: never a reason to refuse it.
            Err(Refused::WindowFull) => Ok(Ticket {
                key: None,
                pair,
                identity: identity_place,
            }),
            Err(r) => {
                if let Some(pair) = &pair {
                    self.give_back(store, pair);
                }
                self.give_back(store, &identity_place);
                Err(match r {
                    Refused::AtLimit => Rejection::KeyFull,
                    _ => Rejection::Store,
                })
            }
        }
    }

    /// Gives a waiter's places back. Idempotence is the caller's job.
    pub fn release(&self, store: &dyn SharedStore, ticket: &Ticket) {
        if let Some(key) = &ticket.key {
            self.give_back(store, key);
        }
        if let Some(pair) = &ticket.pair {
            self.give_back(store, pair);
        }
        self.give_back(store, &ticket.identity);
    }

    /// Counts one more open stream for `identity`, up to `limit`.
    pub fn open_stream(
        &self,
        store: &dyn SharedStore,
        identity: &str,
        limit: u32,
    ) -> Result<Place, Rejection> {
        self.take(store, Table::Stream, identity, limit)
            .map_err(|r| match r {
                Refused::AtLimit => Rejection::StreamsFull,
                Refused::WindowFull => Rejection::StreamTableFull,
                Refused::Store => Rejection::Store,
            })
    }

    /// Gives a stream's place back. Idempotence is the caller's job.
    pub fn close_stream(&self, store: &dyn SharedStore, place: &Place) {
        self.give_back(store, place);
    }

    /// Creates every missing slot entry, empty. Run from `on_configure`: the
    /// main thread's configure precedes every worker's, so on the request path
    /// slots already exist and every claim is a real compare-and-swap.
    /// Idempotent: an existing entry is never written.
    pub fn create_slots(&self, store: &dyn SharedStore) -> Result<(), StoreError> {
        for table in [Table::Key, Table::Pair, Table::Identity, Table::Stream] {
            for i in 0..self.slots(table) {
                let name = slot_name(table, i);
                if store.get(&name)?.1.is_none() {
                    store.set(&name, &[], None)?;
                }
            }
        }
        Ok(())
    }

    /// The current count of waiters on `key` (tests and diagnostics).
    pub fn count(&self, store: &dyn SharedStore, key: &str) -> u32 {
        self.count_in(store, Table::Key, key)
    }

    /// The current count of `identity`'s waiters on `key` (tests and diagnostics).
    pub fn count_of(&self, store: &dyn SharedStore, key: &str, identity: &str) -> u32 {
        self.count_in(store, Table::Pair, &pair_owner(identity, key))
    }

    /// The current count of `identity`'s open streams (tests and diagnostics).
    pub fn streams(&self, store: &dyn SharedStore, identity: &str) -> u32 {
        self.count_in(store, Table::Stream, identity)
    }

    fn count_in(&self, store: &dyn SharedStore, table: Table, owner: &str) -> u32 {
        let fp = self.fingerprint(table, owner);
        self.probe_order(table, fp)
            .filter_map(|i| read_slot(store, &slot_name(table, i)).ok())
            .filter(|s| s.owner == Some(fp))
            .map(|s| s.count)
            .sum()
    }

    /// Increments `owner`'s count (claiming a slot if needed).
    fn take(
        &self,
        store: &dyn SharedStore,
        table: Table,
        owner: &str,
        limit: u32,
    ) -> Result<Place, Refused> {
        let fp = self.fingerprint(table, owner);
        let order: Vec<u32> = self.probe_order(table, fp).collect();
        let place = |index| Place {
            table,
            index,
            owner: fp,
        };
        let read = |i: u32| read_slot(store, &slot_name(table, i)).map_err(|_| Refused::Store);
        let set = |i: u32, count: u32, cas| match store.set(
            &slot_name(table, i),
            &encode(count, fp),
            cas,
        ) {
            Ok(()) => Ok(true),
            Err(StoreError::CasMismatch) => Ok(false),
            Err(StoreError::Host(_)) => Err(Refused::Store),
        };
        'retry: for _ in 0..MAX_RETRIES {
            let mut mine = None;
            let mut free = None;
            for (pos, &i) in order.iter().enumerate() {
                let slot = read(i)?;
                if slot.cas.is_none() {
                    // Never claim a missing entry directly: Envoy skips the CAS
                    // check on creation. Create it empty, then claim it by CAS.
                    store
                        .set(&slot_name(table, i), &[], None)
                        .map_err(|_| Refused::Store)?;
                    continue 'retry;
                }
                if slot.owner == Some(fp) {
                    mine = Some((i, slot));
                    break;
                }
                if slot.count == 0 && free.is_none() {
                    free = Some((pos, i, slot.clone()));
                }
                if slot.owner.is_none() {
                    // Never used: the owner cannot be placed beyond it.
                    break;
                }
            }
            if let Some((i, s)) = mine {
                if s.count >= limit {
                    return Err(Refused::AtLimit);
                }
                if set(i, s.count + 1, s.cas)? {
                    return Ok(place(i));
                }
                continue;
            }
            if limit == 0 {
                return Err(Refused::AtLimit);
            }
            let Some((pos, i, s)) = free else {
                return Err(Refused::WindowFull);
            };
            if !set(i, 1, s.cas)? {
                continue;
            }
            // Did another worker claim an earlier slot for the same owner meanwhile?
            for &j in order.iter().take(pos) {
                if read(j)?.owner == Some(fp) {
                    self.give_back(store, &place(i));
                    continue 'retry;
                }
            }
            return Ok(place(i));
        }
        Err(Refused::Store)
    }

    fn give_back(&self, store: &dyn SharedStore, place: &Place) {
        let name = slot_name(place.table, place.index);
        for _ in 0..MAX_RETRIES {
            let Ok(s) = read_slot(store, &name) else {
                return;
            };
            if s.count == 0 || s.owner != Some(place.owner) {
                return;
            }
            match store.set(&name, &encode(s.count - 1, place.owner), s.cas) {
                Err(StoreError::CasMismatch) => continue,
                _ => return,
            }
        }
    }
}

/// The secret every worker uses when the configuration gives none: the first
/// configure stores `candidate` in shared data (create empty, then claim by
/// CAS, so concurrent creators agree), and everyone reads what is stored. It
/// survives filter updates for the life of the Envoy process (same `vm_id`).
pub fn shared_secret(
    store: &dyn SharedStore,
    candidate: AdmissionSecret,
) -> Result<AdmissionSecret, StoreError> {
    for _ in 0..MAX_RETRIES {
        let (value, cas) = store.get(SECRET_ENTRY)?;
        if let Some(bytes) = value.as_deref().and_then(|v| <[u8; 16]>::try_from(v).ok()) {
            return Ok(AdmissionSecret::from_bytes(bytes));
        }
        match cas {
            None => store.set(SECRET_ENTRY, &[], None)?,
            Some(cas) => match store.set(SECRET_ENTRY, &candidate.to_bytes(), Some(cas)) {
                Ok(()) | Err(StoreError::CasMismatch) => {}
                Err(e) => return Err(e),
            },
        }
    }
    Err(StoreError::CasMismatch)
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

    #[test]
    fn slot_names_are_what_they_always_were() {
        for (table, index) in [
            (Table::Key, 0),
            (Table::Identity, 7),
            (Table::Stream, 4_095),
            (Table::Key, 16_383),
            (Table::Key, u32::MAX),
        ] {
            assert_eq!(
                slot_name(table, index),
                format!("lk/adm/{}/{index}", table.name())
            );
        }
    }

    const ID: &str = "spiffe://dev.latchkey/workload/a";

    fn secret() -> AdmissionSecret {
        AdmissionSecret::from_bytes(*b"0123456789abcdef")
    }

    fn adm(key_slots: u32, identity_slots: u32) -> Admission {
        Admission::new(key_slots, identity_slots, secret())
    }

    #[test]
    fn the_key_bound_holds_and_slots_come_back() {
        let store = MemoryStore::default();
        let adm = adm(64, 16);
        let b = "spiffe://dev.latchkey/workload/b";
        let c = "spiffe://dev.latchkey/workload/c";
        let t1 = adm.admit(&store, "a/k", 2, ID, 10).unwrap();
        let t2 = adm.admit(&store, "a/k", 2, b, 10).unwrap();
        assert_eq!(adm.admit(&store, "a/k", 2, c, 10), Err(Rejection::KeyFull));
        // Another key is unaffected.
        let t3 = adm.admit(&store, "a/other", 2, ID, 10).unwrap();
        adm.release(&store, &t1);
        let t4 = adm.admit(&store, "a/k", 2, c, 10).unwrap();
        for t in [t2, t3, t4] {
            adm.release(&store, &t);
        }
        assert_eq!(adm.count(&store, "a/k"), 0);
        for id in [ID, b, c] {
            assert_eq!(adm.count_of(&store, "a/k", id), 0);
        }
    }

    #[test]
    fn the_identity_bound_holds_across_keys() {
        let store = MemoryStore::default();
        let adm = adm(64, 16);
        let t1 = adm.admit(&store, "a/1", 5, ID, 2).unwrap();
        let _t2 = adm.admit(&store, "a/2", 5, ID, 2).unwrap();
        assert_eq!(
            adm.admit(&store, "a/3", 5, ID, 2),
            Err(Rejection::IdentityFull)
        );
        // A refused key does not leak an identity place.
        let other = "spiffe://dev.latchkey/workload/b";
        let third = "spiffe://dev.latchkey/workload/c";
        let _k = adm.admit(&store, "b/1", 1, third, 5).unwrap();
        for _ in 0..10 {
            assert_eq!(
                adm.admit(&store, "b/1", 1, other, 1),
                Err(Rejection::KeyFull)
            );
        }
        assert!(adm.admit(&store, "b/2", 1, other, 1).is_ok());
        adm.release(&store, &t1);
        assert!(adm.admit(&store, "a/3", 5, ID, 2).is_ok());
    }

    #[test]
    fn the_number_of_entries_is_bounded() {
        let store = MemoryStore::default();
        let adm = adm(8, 4);
        let mut held = Vec::new();
        for i in 0..8 {
            held.push(adm.admit(&store, &format!("k/{i}"), 1, ID, 100).unwrap());
        }
        assert!(held.iter().all(|t| !t.overflowed()));
        for t in &held {
            adm.release(&store, t);
        }
        for i in 100..200 {
            let t = adm.admit(&store, &format!("k/{i}"), 1, ID, 100).unwrap();
            adm.release(&store, &t);
        }
        // Key and pair tables (8 each), the identity table (4).
        assert!(store.entries() <= 8 + 8 + 4, "{}", store.entries());
    }

    /// Keys whose home slot (under `secret`) is `want`.
    fn keys_homed_at(adm: &Admission, want: u32, n: usize, prefix: &str) -> Vec<String> {
        (0u64..)
            .map(|i| format!("{prefix}/{i}"))
            .filter(|k| {
                let fp = adm.fingerprint(Table::Key, k);
                adm.probe_order(Table::Key, fp).next() == Some(want)
            })
            .take(n)
            .collect()
    }

    #[test]
    fn a_window_crowded_by_other_keys_never_refuses_a_key() {
        // Even an attacker who knows the secret and fills the victim's whole
        // window with waiters of her own keys does not get the victim refused.
        let store = MemoryStore::default();
        let adm = adm(1024, 64);
        let victim = "demo/report";
        let home = adm
            .probe_order(Table::Key, adm.fingerprint(Table::Key, victim))
            .next()
            .unwrap();
        let mallory = "spiffe://dev.latchkey/workload/mallory";
        let mut aimed = Vec::new();
        for i in 0..PROBES {
            let key = keys_homed_at(&adm, (home + i) % 1024, 1, "mallory/aim").remove(0);
            aimed.push(adm.admit(&store, &key, 1, mallory, 1000).unwrap());
        }
        let alice = "spiffe://dev.latchkey/workload/alice";
        let t = adm.admit(&store, victim, 1, alice, 10).unwrap();
        assert!(t.overflowed(), "admitted without a place");
        // Overflow holds the identity's place all the same.
        assert_eq!(
            adm.admit(&store, "demo/other", 1, alice, 1),
            Err(Rejection::IdentityFull)
        );
        adm.release(&store, &t);
        // Once a place frees up in the window, the key counts there again.
        adm.release(&store, &aimed[3]);
        let t1 = adm.admit(&store, victim, 1, alice, 10).unwrap();
        assert!(!t1.overflowed());
        assert_eq!(
            adm.admit(&store, victim, 1, "spiffe://dev.latchkey/workload/bob", 10),
            Err(Rejection::KeyFull)
        );
    }

    #[test]
    fn only_a_keys_own_waiters_count_against_its_bound() {
        let store = MemoryStore::default();
        let adm = adm(1024, 64);
        // Many keys homed at the same slot: each has its own count.
        let keys = keys_homed_at(&adm, 7, 6, "k");
        let tickets: Vec<_> = keys
            .iter()
            .map(|k| adm.admit(&store, k, 1, ID, 100).unwrap())
            .collect();
        let other = "spiffe://dev.latchkey/workload/b";
        for k in &keys {
            assert_eq!(adm.count(&store, k), 1);
            assert_eq!(adm.admit(&store, k, 1, other, 100), Err(Rejection::KeyFull));
        }
        // A freed slot in the middle of the run: the keys behind it are still
        // found (lookups pass freed slots), and no key gets a second slot.
        adm.release(&store, &tickets[1]);
        for k in keys.iter().skip(2) {
            assert_eq!(adm.admit(&store, k, 1, other, 100), Err(Rejection::KeyFull));
        }
        assert!(adm.admit(&store, &keys[1], 1, other, 100).is_ok());
    }

    #[test]
    fn the_placement_depends_on_the_secret() {
        let a = Admission::new(16_384, 16, secret());
        let b = Admission::new(16_384, 16, AdmissionSecret::from_bytes([9; 16]));
        let moved = (0..64)
            .filter(|i| {
                let k = format!("demo/{i}");
                a.fingerprint(Table::Key, &k) % 16_384 != b.fingerprint(Table::Key, &k) % 16_384
            })
            .count();
        assert!(moved > 60, "{moved}");
    }

    #[test]
    fn identity_windows_that_fill_up_are_a_named_refusal() {
        let store = MemoryStore::default();
        let adm = adm(64, 4);
        for i in 0..4 {
            adm.admit(
                &store,
                &format!("k/{i}"),
                5,
                &format!("spiffe://td/w/{i}"),
                5,
            )
            .unwrap();
            adm.open_stream(&store, &format!("spiffe://td/w/{i}"), 5)
                .unwrap();
        }
        assert_eq!(
            adm.admit(&store, "k/x", 5, "spiffe://td/w/x", 5),
            Err(Rejection::TableFull)
        );
        assert_eq!(
            adm.open_stream(&store, "spiffe://td/w/x", 5),
            Err(Rejection::StreamTableFull)
        );
    }

    #[test]
    fn streams_are_bounded_per_identity_and_come_back() {
        let store = MemoryStore::default();
        let adm = adm(64, 64);
        let places: Vec<_> = (0..3)
            .map(|_| adm.open_stream(&store, ID, 3).unwrap())
            .collect();
        assert_eq!(adm.open_stream(&store, ID, 3), Err(Rejection::StreamsFull));
        // Another identity is unaffected, and streams are not waiters.
        let other = "spiffe://dev.latchkey/workload/b";
        assert!(adm.open_stream(&store, other, 3).is_ok());
        assert!(adm.admit(&store, "a/k", 1, ID, 1).is_ok());
        adm.close_stream(&store, &places[0]);
        assert_eq!(adm.streams(&store, ID), 2);
        assert!(adm.open_stream(&store, ID, 3).is_ok());
    }

    /// Admission is exact for streams whatever the workers' interleaving:
    /// an open is refused exactly when the identity already has its bound
    /// of streams open (on any worker), and the shared count is always the
    /// number open. Each worker has its own `Admission` over the one shared
    /// store, as each Envoy worker's VM does.
    #[test]
    fn stream_admission_is_exact_across_workers() {
        let store = MemoryStore::default();
        let workers: Vec<Admission> = (0..3).map(|_| adm(64, 64)).collect();
        workers[0].create_slots(&store).unwrap();
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: usize| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        };
        for limit in [1u32, 2, 3, 16, 20] {
            let mut open: Vec<(usize, Place)> = Vec::new();
            let (mut refused, mut at_bound) = (0, 0);
            for step in 0..4000 {
                let w = next(workers.len());
                // Lean towards opening, so the bound is reached often.
                if open.is_empty() || next(5) < 3 {
                    let full = open.len() as u32 >= limit;
                    match workers[w].open_stream(&store, ID, limit) {
                        Ok(p) => {
                            assert!(
                                !full,
                                "limit {limit}, step {step}: admitted above the bound"
                            );
                            open.push((w, p));
                        }
                        Err(r) => {
                            assert_eq!(r, Rejection::StreamsFull);
                            assert!(
                                full,
                                "limit {limit}, step {step}: refused with {} of {limit} open",
                                open.len()
                            );
                            refused += 1;
                        }
                    }
                    at_bound += usize::from(full);
                } else {
                    let (_, p) = open.swap_remove(next(open.len()));
                    workers[w].close_stream(&store, &p);
                }
                assert_eq!(workers[w].streams(&store, ID), open.len() as u32);
            }
            assert!(refused > 0 && at_bound > 0, "limit {limit} never reached");
            for (w, p) in open.drain(..) {
                workers[w].close_stream(&store, &p);
            }
            assert_eq!(workers[0].streams(&store, ID), 0);
        }
    }

    #[test]
    fn without_a_configured_secret_every_worker_shares_the_first_one() {
        let store = MemoryStore::default();
        let first = shared_secret(&store, AdmissionSecret::from_bytes([1; 16])).unwrap();
        let second = shared_secret(&store, AdmissionSecret::from_bytes([2; 16])).unwrap();
        assert_eq!(first, AdmissionSecret::from_bytes([1; 16]));
        assert_eq!(second, first);
        // Concurrent creators agree too.
        let store = Arc::new(MemoryStore::default());
        let threads: Vec<_> = (0..4u8)
            .map(|n| {
                let store = store.clone();
                std::thread::spawn(move || {
                    shared_secret(&*store, AdmissionSecret::from_bytes([n; 16])).unwrap()
                })
            })
            .collect();
        let seen: std::collections::HashSet<_> = threads
            .into_iter()
            .map(|t| t.join().unwrap().to_bytes())
            .collect();
        assert_eq!(seen.len(), 1);
    }

    #[test]
    fn concurrent_workers_never_exceed_the_bound() {
        let store = Arc::new(MemoryStore::default());
        let adm = adm(4, 4);
        let limit = 3;
        let peak = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let threads: Vec<_> = (0..4)
            .map(|n| {
                let store = store.clone();
                let peak = peak.clone();
                std::thread::spawn(move || {
                    let id = format!("{ID}/{n}");
                    for _ in 0..300 {
                        if let Ok(t) = adm.admit(&*store, "hot/key", limit, &id, 1000) {
                            let now = adm.count(&*store, "hot/key");
                            peak.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                            adm.release(&*store, &t);
                        }
                        if let Ok(p) = adm.open_stream(&*store, ID, limit) {
                            let now = adm.streams(&*store, ID);
                            peak.fetch_max(now, std::sync::atomic::Ordering::SeqCst);
                            adm.close_stream(&*store, &p);
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
        assert_eq!(adm.streams(&*store, ID), 0);
    }
    #[test]
    fn an_identitys_share_is_half_the_keys_places_rounded_up() {
        assert_eq!(
            [1, 2, 3, 4, 64, 10_000].map(identity_share),
            [1, 1, 2, 2, 32, 5_000]
        );
        // Whenever a key has two places or more, a full share leaves one.
        for max in 2..=10_000 {
            assert!(identity_share(max) >= 1 && identity_share(max) < max);
        }
    }

    /// Issue 31, finding 5: bob cannot fill a shared key's queue; demo still
    /// gets a place on it, and the key's own bound still holds for everyone.
    #[test]
    fn one_identity_takes_at_most_its_share_of_a_key() {
        let store = MemoryStore::default();
        let adm = adm(64, 16);
        let bob = "spiffe://dev.latchkey/workload/bob";
        let demo = "spiffe://dev.latchkey/workload/demo";
        let alice = "spiffe://dev.latchkey/workload/alice";
        let key = "demo/report";
        let mut bobs: Vec<_> = (0..2)
            .map(|_| adm.admit(&store, key, 4, bob, 100).unwrap())
            .collect();
        for _ in 0..10 {
            assert_eq!(
                adm.admit(&store, key, 4, bob, 100),
                Err(Rejection::KeyShareFull)
            );
        }
        assert_eq!(adm.count_of(&store, key, bob), 2);
        assert_eq!(adm.count(&store, key), 2);
        // A refused share leaks no identity place: bob still waits elsewhere
        // up to his identity bound.
        let elsewhere = adm.admit(&store, "demo/other", 4, bob, 3).unwrap();
        assert_eq!(
            adm.admit(&store, "demo/third", 4, bob, 3),
            Err(Rejection::IdentityFull)
        );
        adm.release(&store, &elsewhere);
        // demo gets the rest of the key ...
        let demos: Vec<_> = (0..2)
            .map(|_| adm.admit(&store, key, 4, demo, 100).unwrap())
            .collect();
        // ... and then the key is full for a third identity with no waiter
        // on it, while bob hears about his share first.
        assert_eq!(
            adm.admit(&store, key, 4, alice, 100),
            Err(Rejection::KeyFull)
        );
        assert_eq!(
            adm.admit(&store, key, 4, bob, 100),
            Err(Rejection::KeyShareFull)
        );
        assert_eq!(adm.count(&store, key), 4);
        // A place bob gives back is his to take again.
        adm.release(&store, &bobs.remove(0));
        bobs.push(adm.admit(&store, key, 4, bob, 100).unwrap());
        for t in bobs.iter().chain(&demos) {
            adm.release(&store, t);
        }
        assert_eq!(adm.count(&store, key), 0);
        assert_eq!(adm.count_of(&store, key, bob), 0);
        assert_eq!(adm.count_of(&store, key, demo), 0);
    }

    #[test]
    fn a_share_window_crowded_by_other_pairs_never_refuses() {
        // 16 pair slots, all taken by other identities' waiters on one key:
        // a new identity on it is let through without a share place, and the
        // key's bound still counts it.
        let store = MemoryStore::default();
        let adm = adm(PROBES, 64);
        let ids: Vec<String> = (0..PROBES).map(|i| format!("{ID}/{i}")).collect();
        let held: Vec<_> = ids
            .iter()
            .map(|id| adm.admit(&store, "k", 100, id, 10).unwrap())
            .collect();
        assert!(held.iter().all(|t| !t.overflowed()));
        let t = adm.admit(&store, "k", 100, "spiffe://td/late", 10).unwrap();
        assert!(t.overflowed());
        assert_eq!(adm.count(&store, "k"), PROBES + 1);
        adm.release(&store, &t);
        assert_eq!(adm.count(&store, "k"), PROBES);
    }

    #[test]
    fn concurrent_workers_never_exceed_the_share() {
        let store = Arc::new(MemoryStore::default());
        let adm = adm(64, 64);
        let limit = 6;
        let peak = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = store.clone();
                let peak = peak.clone();
                std::thread::spawn(move || {
                    for _ in 0..300 {
                        if let Ok(t) = adm.admit(&*store, "hot/key", limit, ID, 1000) {
                            let now = adm.count_of(&*store, "hot/key", ID);
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
        assert!(peak.load(std::sync::atomic::Ordering::SeqCst) <= identity_share(limit));
        assert_eq!(adm.count(&*store, "hot/key"), 0);
        assert_eq!(adm.count_of(&*store, "hot/key", ID), 0);
    }
}
