//! The leaderships of one session, kept like its holds (`holds.rs`): per
//! election, one campaign in flight or one leadership with its guard
//! count. Only the outermost campaign and the final resignation reach the
//! arbiter; while either is in flight, other campaigners of the election on
//! this session wait for it to settle, so a resignation on its way cannot
//! be undone by a campaign that "gets its leadership back" just before it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;

use crate::election::LeadershipLost;
use crate::token::FencingToken;

/// One leadership of an election, shared by every guard of it.
pub(crate) struct Lead {
    pub(crate) election: String,
    pub(crate) session_id: i64,
    pub(crate) term: u64,
    pub(crate) token: FencingToken,
    /// The value observers see; a proclamation replaces it.
    value: Mutex<String>,
    /// Changed only under the session's state lock; read anywhere.
    count: AtomicU32,
    /// Why it ended, once it has (set once).
    lost: Mutex<Option<LeadershipLost>>,
    /// Cancelled when `lost` is set.
    cancel: CancellationToken,
    /// The observer that tells a replaced or vacated leadership (aborted
    /// when it is lost, which the last guard's going also counts as), and
    /// the session's fence registration (removed with the last guard).
    watcher: Mutex<Option<AbortHandle>>,
    fence_id: Mutex<Option<u64>>,
    /// A higher-priority candidate stands and the class asks this
    /// leadership to yield (its observer saw `TransferRequested`).
    transfer_requested: std::sync::atomic::AtomicBool,
    transfer_notify: Notify,
}

impl Lead {
    pub(crate) fn new(
        election: String,
        session_id: i64,
        term: u64,
        token: FencingToken,
        value: String,
    ) -> Self {
        Self {
            election,
            session_id,
            term,
            token,
            value: Mutex::new(value),
            count: AtomicU32::new(0),
            lost: Mutex::new(None),
            cancel: CancellationToken::new(),
            watcher: Mutex::new(None),
            fence_id: Mutex::new(None),
            transfer_requested: std::sync::atomic::AtomicBool::new(false),
            transfer_notify: Notify::new(),
        }
    }

    /// Its observer saw a transfer request for this term.
    pub(crate) fn request_transfer(&self) {
        self.transfer_requested.store(true, Ordering::Release);
        self.transfer_notify.notify_waiters();
    }

    /// The request turned out empty (nobody above this leadership stands).
    pub(crate) fn clear_transfer(&self) {
        self.transfer_requested.store(false, Ordering::Release);
    }

    pub(crate) fn transfer_requested(&self) -> bool {
        self.transfer_requested.load(Ordering::Acquire)
    }

    /// Resolves once a transfer is requested (at once if it was).
    pub(crate) async fn transfer_requested_wait(&self) {
        loop {
            let notified = self.transfer_notify.notified();
            if self.transfer_requested() {
                return;
            }
            notified.await;
        }
    }

    pub(crate) fn count(&self) -> u32 {
        self.count.load(Ordering::Acquire)
    }

    pub(crate) fn value(&self) -> String {
        self.value.lock().clone()
    }

    pub(crate) fn set_value(&self, value: String) {
        *self.value.lock() = value;
    }

    pub(crate) fn lost_reason(&self) -> Option<LeadershipLost> {
        *self.lost.lock()
    }

    pub(crate) fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Marks the leadership ended and cancels its token; true only the
    /// first time. The table entry, if still there, is skipped by the next
    /// campaign (see [`Leaderships::begin`]).
    pub(crate) fn lose(&self, reason: LeadershipLost) -> bool {
        {
            let mut lost = self.lost.lock();
            if lost.is_some() {
                return false;
            }
            *lost = Some(reason);
        }
        self.cancel.cancel();
        if let Some(watcher) = self.watcher.lock().take() {
            watcher.abort();
        }
        true
    }

    pub(crate) fn set_watcher(&self, watcher: AbortHandle) {
        if self.lost_reason().is_some() {
            watcher.abort();
        } else {
            *self.watcher.lock() = Some(watcher);
        }
    }

    pub(crate) fn set_fence_id(&self, id: u64) {
        *self.fence_id.lock() = Some(id);
    }

    pub(crate) fn take_fence_id(&self) -> Option<u64> {
        self.fence_id.lock().take()
    }
}

pub(crate) enum BeginCampaign {
    /// This session leads the election already: the count went up.
    Reentered(Arc<Lead>),
    /// A campaign or a final resignation of the election is in flight on
    /// this session; try again when the future resolves.
    Wait(OwnedNotified),
    /// The caller sends Campaign, then calls `led` or `failed`.
    Outermost,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Stepdown {
    Remaining(u32),
    /// The count reached zero on a current leadership: the caller sends
    /// Resign (or not), then calls `resigned`.
    Last,
    /// The guard's leadership is not the election's current one here (it
    /// was lost, or already settled): nothing to send.
    NotCurrent,
}

enum Entry {
    Campaigning(Arc<Notify>),
    Leading(Arc<Lead>),
    Resigning(Arc<Notify>),
}

#[derive(Default)]
pub(crate) struct Leaderships {
    elections: HashMap<String, Entry>,
}

impl Leaderships {
    pub(crate) fn begin(&mut self, election: &str) -> BeginCampaign {
        match self.elections.get(election) {
            Some(Entry::Leading(lead)) if lead.lost_reason().is_none() => {
                lead.count.fetch_add(1, Ordering::AcqRel);
                BeginCampaign::Reentered(Arc::clone(lead))
            }
            // The Notified is made under the caller's lock, so a wake-up
            // between unlock and await is not lost.
            Some(Entry::Campaigning(settled)) | Some(Entry::Resigning(settled)) => {
                BeginCampaign::Wait(Arc::clone(settled).notified_owned())
            }
            // Nothing, or a leadership that was lost: campaign anew.
            Some(Entry::Leading(_)) | None => {
                self.elections.insert(
                    election.to_owned(),
                    Entry::Campaigning(Arc::new(Notify::new())),
                );
                BeginCampaign::Outermost
            }
        }
    }

    pub(crate) fn led(&mut self, lead: Arc<Lead>) {
        lead.count.store(1, Ordering::Release);
        let previous = self
            .elections
            .insert(lead.election.clone(), Entry::Leading(lead));
        wake(previous);
    }

    pub(crate) fn failed(&mut self, election: &str) {
        if matches!(self.elections.get(election), Some(Entry::Campaigning(_))) {
            wake(self.elections.remove(election));
        }
    }

    pub(crate) fn step_down(&mut self, lead: &Arc<Lead>) -> Stepdown {
        let before = lead.count.fetch_sub(1, Ordering::AcqRel);
        let current = matches!(
            self.elections.get(&lead.election),
            Some(Entry::Leading(l)) if Arc::ptr_eq(l, lead)
        );
        if before > 1 {
            return Stepdown::Remaining(before - 1);
        }
        if !current {
            return Stepdown::NotCurrent;
        }
        if lead.lost_reason().is_some() {
            self.elections.remove(&lead.election);
            return Stepdown::NotCurrent;
        }
        self.elections.insert(
            lead.election.clone(),
            Entry::Resigning(Arc::new(Notify::new())),
        );
        Stepdown::Last
    }

    /// A leadership ended by a hand-over (transfer) or was lost: a later
    /// campaign starts anew; its remaining guards count down to nothing.
    pub(crate) fn ended(&mut self, lead: &Arc<Lead>) {
        if matches!(
            self.elections.get(&lead.election),
            Some(Entry::Leading(l)) if Arc::ptr_eq(l, lead)
        ) {
            self.elections.remove(&lead.election);
        }
    }

    pub(crate) fn resigned(&mut self, election: &str) {
        if matches!(self.elections.get(election), Some(Entry::Resigning(_))) {
            wake(self.elections.remove(election));
        }
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.elections.is_empty()
    }
}

fn wake(entry: Option<Entry>) {
    if let Some(Entry::Campaigning(settled) | Entry::Resigning(settled)) = entry {
        settled.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    fn lead(election: &str) -> Arc<Lead> {
        Arc::new(Lead::new(
            election.into(),
            7,
            (1 << 32) + 1,
            FencingToken::new((1 << 48) + 42),
            "pod-a".into(),
        ))
    }

    #[test]
    fn only_the_outermost_campaign_and_the_final_resignation_reach_the_arbiter() {
        let mut table = Leaderships::default();
        assert!(matches!(table.begin("e"), BeginCampaign::Outermost));
        let l = lead("e");
        table.led(Arc::clone(&l));
        assert_eq!(l.count(), 1);
        let BeginCampaign::Reentered(again) = table.begin("e") else {
            panic!("a second campaign of a led election must not go to the arbiter");
        };
        assert!(Arc::ptr_eq(&again, &l));
        assert_eq!(l.count(), 2);
        assert_eq!(table.step_down(&l), Stepdown::Remaining(1));
        assert_eq!(table.step_down(&l), Stepdown::Last);
        // While the resignation is in flight, a campaign waits for it.
        let BeginCampaign::Wait(settled) = table.begin("e") else {
            panic!("a campaign during a resignation must wait");
        };
        let mut settled = Box::pin(settled);
        assert!((&mut settled).now_or_never().is_none());
        table.resigned("e");
        assert!(settled.now_or_never().is_some());
        assert!(table.is_empty());
    }

    #[test]
    fn a_lost_leadership_sends_nothing_and_does_not_block_a_new_campaign() {
        let mut table = Leaderships::default();
        assert!(matches!(table.begin("e"), BeginCampaign::Outermost));
        let old = lead("e");
        table.led(Arc::clone(&old));
        assert!(old.lose(LeadershipLost::Replaced { term: 9 }));
        assert!(!old.lose(LeadershipLost::Resigned), "lost once");
        assert!(old.cancel_token().is_cancelled());
        // The next campaign goes to the arbiter though the entry is there.
        assert!(matches!(table.begin("e"), BeginCampaign::Outermost));
        let new = lead("e");
        table.led(Arc::clone(&new));
        assert_eq!(table.step_down(&old), Stepdown::NotCurrent);
        assert_eq!(new.count(), 1);
        assert_eq!(table.step_down(&new), Stepdown::Last);
    }

    #[test]
    fn a_failed_campaign_wakes_the_waiters() {
        let mut table = Leaderships::default();
        assert!(matches!(table.begin("e"), BeginCampaign::Outermost));
        let BeginCampaign::Wait(settled) = table.begin("e") else {
            panic!("a concurrent campaign must wait");
        };
        table.failed("e");
        assert!(settled.now_or_never().is_some());
        assert!(table.is_empty());
    }

    #[test]
    fn a_transferred_leadership_leaves_the_table() {
        let mut table = Leaderships::default();
        assert!(matches!(table.begin("e"), BeginCampaign::Outermost));
        let l = lead("e");
        table.led(Arc::clone(&l));
        l.lose(LeadershipLost::Transferred);
        table.ended(&l);
        assert!(table.is_empty());
        assert_eq!(table.step_down(&l), Stepdown::NotCurrent);
    }
}
