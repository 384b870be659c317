//! Lock-loss push (issue 13): the KeepAlive streams that renew a session
//! here hear at once when one of its holds ends by anything but its own
//! release, from the same watch that keeps the hold counts
//! ([`super::HoldCounts`]). Ended holds of sessions no stream watches yet
//! wait a little, bounded in all and per identity.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use latchkey_proto::lockv1::{EndedHold, Mode};
use parking_lot::MutexGuard;
use tokio::sync::mpsc;

use super::{Ended, HoldCounts};

/// Ended holds kept for sessions no stream watches yet, at most, and for
/// how long (a client's first renewal follows its OpenSession at once).
const MAX_UNCLAIMED: usize = 4096;
const MAX_UNCLAIMED_PER_IDENTITY: usize = 256;
const UNCLAIMED_FOR: Duration = Duration::from_secs(30);

/// Ended holds of sessions no stream here watches yet, oldest first:
/// at most [`MAX_UNCLAIMED`] in all and [`MAX_UNCLAIMED_PER_IDENTITY`] of
/// one identity's, so one workload churning its own holds cannot push
/// everyone else's notices out (they would then fence at their deadline).
#[derive(Default)]
pub(super) struct Unclaimed {
    entries: std::collections::VecDeque<(tokio::time::Instant, i64, String, EndedHold)>,
    per_identity: HashMap<String, usize>,
}

impl Unclaimed {
    fn push(&mut self, identity: &str, session: i64, hold: EndedHold) {
        let mine = self.per_identity.get(identity).copied().unwrap_or(0);
        let evict = if mine >= MAX_UNCLAIMED_PER_IDENTITY {
            Some(identity.to_string())
        } else if self.entries.len() >= MAX_UNCLAIMED {
            // The identity with the most entries gives its oldest up.
            self.per_identity
                .iter()
                .max_by_key(|(_, n)| **n)
                .map(|(i, _)| i.clone())
        } else {
            None
        };
        if let Some(victim) = evict
            && let Some(at) = self.entries.iter().position(|e| e.2 == victim)
        {
            self.entries.remove(at);
            self.count(&victim, -1);
        }
        self.entries.push_back((
            tokio::time::Instant::now(),
            session,
            identity.to_string(),
            hold,
        ));
        self.count(identity, 1);
    }

    fn count(&mut self, identity: &str, delta: isize) {
        let n = self.per_identity.entry(identity.to_string()).or_insert(0);
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            self.per_identity.remove(identity);
        }
    }

    /// Keeps the entries `keep` says yes to.
    fn retain(&mut self, mut keep: impl FnMut(tokio::time::Instant, i64, &EndedHold) -> bool) {
        let mut dropped = Vec::new();
        self.entries.retain(|(at, session, identity, hold)| {
            let kept = keep(*at, *session, hold);
            if !kept {
                dropped.push(identity.clone());
            }
            kept
        });
        for identity in dropped {
            self.count(&identity, -1);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Where a KeepAlive stream hears of its sessions' ended holds: (session,
/// hold). Bounded: a stream that does not keep up misses notices, and its
/// client still fences at its deadline.
pub type Notices = mpsc::Sender<(i64, EndedHold)>;

impl HoldCounts {
    /// An id for one KeepAlive stream's [`Self::watch_session`] calls.
    pub fn stream_id(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    fn watchers(&self) -> MutexGuard<'_, HashMap<i64, Vec<(u64, Notices)>>> {
        self.watchers.lock()
    }

    /// Stream `stream` renews `session` (owned by its caller: checked before
    /// this is called) and hears of the session's ended holds on `notices`.
    pub fn watch_session(&self, session: i64, stream: u64, notices: &Notices) {
        let mut watchers = self.watchers();
        let streams = watchers.entry(session).or_default();
        if streams.iter().any(|(id, _)| *id == stream) {
            return;
        }
        streams.push((stream, notices.clone()));
        // Holds of the session that ended before any stream watched it.
        let mut unclaimed = self.unclaimed();
        let now = tokio::time::Instant::now();
        unclaimed.retain(|at, s, hold| {
            if now.duration_since(at) > UNCLAIMED_FOR {
                return false;
            }
            if s != session {
                return true;
            }
            let _ = notices.try_send((session, hold.clone()));
            false
        });
    }

    fn unclaimed(&self) -> MutexGuard<'_, Unclaimed> {
        self.unclaimed.lock()
    }

    /// Stream `stream` no longer renews `session` (gone, or the stream ended).
    pub fn unwatch_session(&self, session: i64, stream: u64) {
        let mut watchers = self.watchers();
        if let Some(streams) = watchers.get_mut(&session) {
            streams.retain(|(id, _)| *id != stream);
            if streams.is_empty() {
                watchers.remove(&session);
            }
        }
    }

    /// Tells the streams renewing each hold's session that it ended.
    pub(super) fn notify<'a>(&self, ended: impl IntoIterator<Item = &'a Ended>) {
        let watchers = self.watchers();
        for ended in ended {
            let (kind, name) = crate::records::hold_kind(&ended.key);
            let hold = EndedHold {
                key: name.to_string(),
                revision: ended.revision,
                slot: crate::records::split_slot(&ended.key).map(|(_, slot)| slot),
                mode: match kind {
                    crate::records::HoldKind::Shared => Mode::Shared,
                    _ => Mode::Exclusive,
                }
                .into(),
            };
            match watchers.get(&ended.session) {
                Some(streams) => {
                    for (_, notices) in streams {
                        // Never wait on a slow client: its deadline still fences it.
                        let _ = notices.try_send((ended.session, hold.clone()));
                    }
                }
                None => {
                    self.unclaimed().push(&ended.owner, ended.session, hold);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hold_counts::Ended;
    use crate::hold_counts::tests::counted;

    #[tokio::test]
    async fn a_stream_hears_of_its_sessions_ended_holds_only() {
        let c = counted(&[], 1);
        let (tx, mut rx) = mpsc::channel(8);
        let stream = c.stream_id();
        c.watch_session(7, stream, &tx);
        c.watch_session(7, stream, &tx);
        let ended = |session, key: &str| Ended {
            session,
            key: key.to_string(),
            revision: 42,
            owner: String::new(),
        };
        c.notify(&[ended(7, "a/b"), ended(8, "a/c")]);
        let (session, hold) = rx.try_recv().map_err(|e| e.to_string()).unwrap_or_default();
        assert_eq!((session, hold.key.as_str(), hold.revision), (7, "a/b", 42));
        // once per stream, and nothing for another session
        assert!(rx.try_recv().is_err());
        c.unwatch_session(7, stream);
        c.notify(&[ended(7, "a/b")]);
        assert!(rx.try_recv().is_err());
        assert!(c.watchers().is_empty());
        // ...but a stream that starts watching session 7 soon after hears it
        // (and only session 7's)
        let (tx2, mut rx2) = mpsc::channel(8);
        c.watch_session(7, c.stream_id(), &tx2);
        let (session, hold) = rx2
            .try_recv()
            .map_err(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!((session, hold.key.as_str()), (7, "a/b"));
        assert!(rx2.try_recv().is_err());
        assert_eq!(c.unclaimed().len(), 1, "session 8's stays");
    }

    #[test]
    fn one_identity_cannot_push_the_others_notices_out() {
        let mut u = Unclaimed::default();
        let hold = |i: i64| EndedHold {
            slot: None,
            key: format!("k/{i}"),
            revision: i,
            mode: 0,
        };
        u.push("victim", 1, hold(0));
        for i in 0..(MAX_UNCLAIMED as i64 * 2) {
            u.push("churner", 2, hold(i));
        }
        assert_eq!(
            u.per_identity.get("churner"),
            Some(&MAX_UNCLAIMED_PER_IDENTITY)
        );
        assert_eq!(u.len(), MAX_UNCLAIMED_PER_IDENTITY + 1);
        assert!(
            u.entries.iter().any(|e| e.2 == "victim"),
            "the victim's notice stays"
        );
        // the churner keeps its newest
        assert_eq!(
            u.entries.back().map(|e| e.3.revision),
            Some(MAX_UNCLAIMED as i64 * 2 - 1)
        );
        // many identities: the global bound holds, the biggest gives way
        for n in 0..40 {
            for i in 0..200 {
                u.push(&format!("id-{n}"), 3, hold(i));
            }
        }
        assert!(u.len() <= MAX_UNCLAIMED);
        assert!(u.entries.iter().any(|e| e.2 == "victim"));
        u.retain(|_, session, _| session != 1);
        assert!(!u.per_identity.contains_key("victim"));
        assert_eq!(u.per_identity.values().sum::<usize>(), u.len());
    }
}
