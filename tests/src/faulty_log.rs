//! Deliberately broken behaviours and timing wideners for the arbiter, as
//! [`LogLayer`]s around its lock log. They live here, in the tests crate, and
//! reach an arbiter only through the tests' own programs: an in-process
//! [`crate::arbiter::Arbiter`] (its `Config::log_layer`) or the
//! `arbiter-under-test` binary (`--test-fault <name>`). The arbiter crate has
//! neither the faults nor a flag to choose one, so no build of
//! `latchkey-arbiter` (with or without `--workspace`, debug or release) can
//! run with one.
//!
//! - [`TestFault::GrantOnWatch`]: a bug the release gate's checker must catch
//!   (ADR-23).
//! - [`TestFault::ForgetHidden`]: a bug the gate must catch through a hidden
//!   grant its worker revealed (issue 14).
//! - [`TestFault::SlowReuse`]: not a bug; makes a rare interleaving certain
//!   in a regression test.
//! - [`TestFault::SlowSessionWrites`]: not a bug; likewise, for the session
//!   counts (the watch shows an open's entry before the open hears it).
//! - [`TestFault::LoseGrantAnswers`]: not a bug; makes hidden grants (a
//!   grant committed, its answer lost) common, as the control for
//!   `ForgetHidden`.
//! - [`TestFault::SlowWithdraw`]: not a bug; a candidate's withdrawal waits
//!   [`SLOW_WITHDRAW`], so a resignation hands the leadership to a
//!   candidate whose Campaign call is ending.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use async_trait::async_trait;
use latchkey_arbiter::LogLayer;
use latchkey_arbiter::lock_log::{
    BatchOp, BatchOutcome, Claimed, Counted, DowngradeTxn, DurableQueueLog, EpochLog, FollowLog,
    ForceEndTxn, ForceEnded, GrantTxn, Granted, HandOverTxn, HeldAt, HoldLog, KeyWatch, Kv,
    LockLog, LogResult, PrefixWatch, Queued, Records, ReleaseTxn, ReleasedIf, Renewal,
    RevokeSessionTxn, SessionLog, SessionRevoked, StoreError, WatchSignal,
};
use tracing::debug;

/// The flag `arbiter-under-test` reads (also as `--test-fault=<name>`).
pub const FLAG: &str = "--test-fault";

/// Which deliberate bug or timing widener an arbiter under test runs with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TestFault {
    /// The real arbiter: no layer.
    #[default]
    None,
    /// A watch event on a key is taken as the grant instead of a hint to try
    /// one: once a watch on a key has reported a release, an expiry or a
    /// change of hands, the next grant transaction on that key first deletes
    /// whatever hold is there (another session's), so the transaction's
    /// "key absent" compare cannot stop it. With waiters on two arbiters this
    /// hands out a second grant for a held key.
    GrantOnWatch,
    /// Not a bug: a grant transaction that finds the key already held by
    /// the caller's own session (the protocol then claims that grant for the
    /// session's new call) answers only after [`SLOW_REUSE`], so an orphan
    /// release of that grant finishes between the read and the claim.
    SlowReuse,
    /// Not a bug: one committed grant transaction in [`LOSE_EVERY`] answers
    /// as if etcd's answer had been lost (`STORE_UNAVAILABLE`, an unknown
    /// outcome) although the hold is written, on the caller's session. The
    /// real protocol keeps such a hidden grant until that session's lease
    /// ends or the session asks again ("already yours"); the gate's worker
    /// asks again on the same session and records what it learns.
    LoseGrantAnswers,
    /// The bug [`TestFault::LoseGrantAnswers`] is the control for: the same
    /// lost answers, and the arbiter then treats a grant whose answer was
    /// lost as not held. The next grant transaction on that key for another
    /// session first deletes that hold (and its claims), while the hidden
    /// grant's lease still lives, so the other session gets a second grant.
    ForgetHidden,
    /// Not a bug: a session's record and count entry are written, and the
    /// answer comes [`SLOW_SESSION_WRITE`] later, as under load: the
    /// arbiter's watch shows the entry while the open is still in flight,
    /// and the open must count once, neither twice (refusing opens under
    /// the bound) nor not at all (passing it: issue 31, finding 9).
    SlowSessionWrites,
    /// Not a bug: a candidate record's withdrawal (a Campaign call that
    /// ended without leading) runs only after [`SLOW_WITHDRAW`], so a
    /// resignation in between hands the leadership to that candidate: the
    /// ending call must answer it (or, cancelled, resign it) rather than
    /// leave a leader nobody knows of.
    SlowWithdraw,
}

/// How long [`TestFault::SlowWithdraw`] holds back a withdrawal.
pub const SLOW_WITHDRAW: Duration = Duration::from_secs(4);

/// How long [`TestFault::SlowSessionWrites`] holds back a session write's answer.
pub const SLOW_SESSION_WRITE: Duration = Duration::from_millis(150);

/// How long [`TestFault::SlowReuse`] holds back its answer.
pub const SLOW_REUSE: Duration = Duration::from_millis(500);

/// [`TestFault::LoseGrantAnswers`] and [`TestFault::ForgetHidden`] lose the
/// answer of one committed grant transaction in this many (per arbiter).
pub const LOSE_EVERY: u64 = 4;

impl TestFault {
    pub const ALL: [Self; 7] = [
        Self::None,
        Self::GrantOnWatch,
        Self::SlowReuse,
        Self::LoseGrantAnswers,
        Self::ForgetHidden,
        Self::SlowSessionWrites,
        Self::SlowWithdraw,
    ];

    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "none" => Ok(Self::None),
            "grant-on-watch" => Ok(Self::GrantOnWatch),
            "slow-reuse" => Ok(Self::SlowReuse),
            "lose-grant-answers" => Ok(Self::LoseGrantAnswers),
            "forget-hidden" => Ok(Self::ForgetHidden),
            "slow-session-writes" => Ok(Self::SlowSessionWrites),
            "slow-withdraw" => Ok(Self::SlowWithdraw),
            other => Err(format!(
                "unknown test fault {other:?}: expected none, grant-on-watch, slow-reuse, \
                 lose-grant-answers, forget-hidden, slow-session-writes or slow-withdraw"
            )),
        }
    }

    /// The flag value [`TestFault::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::GrantOnWatch => "grant-on-watch",
            Self::SlowReuse => "slow-reuse",
            Self::LoseGrantAnswers => "lose-grant-answers",
            Self::ForgetHidden => "forget-hidden",
            Self::SlowSessionWrites => "slow-session-writes",
            Self::SlowWithdraw => "slow-withdraw",
        }
    }
}

impl std::fmt::Display for TestFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The layer that puts `fault` around an arbiter's lock log; none for
/// [`TestFault::None`].
pub fn layer(fault: TestFault) -> Option<LogLayer> {
    if fault == TestFault::None {
        return None;
    }
    Some(LogLayer {
        name: format!("test fault {}", fault.name()),
        wrap: Arc::new(move |inner| Arc::new(FaultyLog::new(inner, fault)) as Arc<dyn LockLog>),
    })
}

/// Takes `--test-fault <name>` (or `--test-fault=<name>`) out of a command
/// line (`argv[0]` first), for `arbiter-under-test`: the fault, and the
/// arguments left for the arbiter's own parser. Nothing after `--` is looked
/// at; the flag may be given once.
pub fn split_test_fault_arg(argv: Vec<OsString>) -> Result<(TestFault, Vec<OsString>), String> {
    let mut rest = Vec::with_capacity(argv.len());
    let mut fault: Option<TestFault> = None;
    let mut args = argv.into_iter();
    if let Some(program) = args.next() {
        rest.push(program);
    }
    while let Some(arg) = args.next() {
        let text = arg.to_str();
        let name = if text == Some("--") {
            rest.push(arg);
            rest.extend(args);
            break;
        } else if text == Some(FLAG) {
            match args.next() {
                Some(value) => value
                    .into_string()
                    .map_err(|v| format!("{FLAG}: not UTF-8: {v:?}"))?,
                None => return Err(format!("{FLAG} needs a value")),
            }
        } else if let Some(value) = text.and_then(flag_value) {
            value.to_owned()
        } else {
            rest.push(arg);
            continue;
        };
        if fault.is_some() {
            return Err(format!("{FLAG} given more than once"));
        }
        fault = Some(TestFault::parse(&name)?);
    }
    Ok((fault.unwrap_or_default(), rest))
}

/// `<name>` of `--test-fault=<name>`.
fn flag_value(arg: &str) -> Option<&str> {
    arg.strip_prefix(FLAG)?.strip_prefix('=')
}

/// A [`LockLog`] that passes every call to the real one, except where its
/// [`TestFault`] changes it.
pub struct FaultyLog {
    inner: Arc<dyn LockLog>,
    fault: TestFault,
    /// [`TestFault::GrantOnWatch`]: keys whose watch reported `Freed` or
    /// `Changed` since their last grant transaction.
    signalled: Arc<Mutex<BTreeSet<String>>>,
    /// [`TestFault::LoseGrantAnswers`], [`TestFault::ForgetHidden`]: grant
    /// transactions that committed.
    committed: AtomicU64,
    /// [`TestFault::ForgetHidden`]: per key, the hold whose answer was lost,
    /// until another session's grant transaction on that key takes it away.
    forgotten: Mutex<BTreeMap<String, HeldAt>>,
}

impl FaultyLog {
    pub fn new(inner: Arc<dyn LockLog>, fault: TestFault) -> Self {
        Self {
            inner,
            fault,
            signalled: Arc::default(),
            committed: AtomicU64::new(0),
            forgotten: Mutex::default(),
        }
    }

    /// Whether `key`'s watch signalled since the last call for `key`.
    fn take_signal(&self, key: &str) -> bool {
        self.signalled.lock().remove(key)
    }

    /// [`TestFault::GrantOnWatch`]: the grant transaction after a watch
    /// event. The event is taken as the grant: whatever hold another session
    /// has on the key is deleted first (as if released), then the real
    /// transaction runs and finds the key free.
    async fn grant_on_watch(&self, txn: GrantTxn<'_>) -> LogResult<Granted> {
        self.take_as_released(txn.key, txn.session).await?;
        self.inner.grant(txn).await
    }

    /// [`TestFault::GrantOnWatch`]'s first step: another session's hold on
    /// `key` is deleted as if released.
    async fn take_as_released(&self, key: &str, session: i64) -> Result<(), StoreError> {
        let held = self.inner.holder(key).await?;
        if let Some(kv) = held.value
            && kv.lease != session
        {
            // Whether it deleted it or not (gone already, or changed again),
            // the grant transaction decides now.
            let deleted = self
                .inner
                .release_orphan(key, kv.lease, kv.mod_revision)
                .await?
                .value;
            debug!(
                key,
                holder = kv.lease,
                deleted,
                "test fault grant-on-watch: a watch event, so the hold goes before the grant"
            );
        }
        Ok(())
    }

    /// [`TestFault::ForgetHidden`]'s first step: another session's grant
    /// transaction on a key whose hold's answer was lost first deletes that
    /// hold, as if it had never been granted.
    async fn forget_hidden(&self, key: &str, session: i64) -> Result<(), StoreError> {
        if self.fault != TestFault::ForgetHidden {
            return Ok(());
        }
        let stale = {
            let mut forgotten = self.forgotten.lock();
            match forgotten.get(key) {
                Some(held) if held.session != session => forgotten.remove(key),
                _ => None,
            }
        };
        if let Some(held) = stale {
            // Deleted if it is still exactly that hold; either way the
            // grant transaction decides now.
            let deleted = self.inner.release(&held).await?.value.is_some();
            debug!(
                key,
                holder = held.session,
                session,
                deleted,
                "test fault forget-hidden: a grant whose answer was lost counts as not held"
            );
        }
        Ok(())
    }

    /// Counts a committed grant: whether its answer is the one in
    /// [`LOSE_EVERY`] that is lost.
    fn loses_answer(&self) -> bool {
        self.committed.fetch_add(1, Ordering::Relaxed) % LOSE_EVERY == LOSE_EVERY - 1
    }

    /// The error a lost answer is, after [`TestFault::ForgetHidden`] noted
    /// `lost` (the holds granted in it) as forgotten.
    fn lost_answer(&self, lost: Vec<HeldAt>) -> StoreError {
        for held in lost {
            debug!(
                key = %held.key,
                session = held.session,
                revision = held.revision,
                "test fault {}: the grant committed; its answer is lost",
                self.fault
            );
            if self.fault == TestFault::ForgetHidden {
                self.forgotten.lock().insert(held.key.clone(), held);
            }
        }
        StoreError::unavailable(format!(
            "test fault {}: the grant transaction's answer was lost",
            self.fault
        ))
    }

    /// [`TestFault::LoseGrantAnswers`] and [`TestFault::ForgetHidden`]: the
    /// real grant transaction, whose answer is lost once in [`LOSE_EVERY`]
    /// commits (with `ForgetHidden`, see [`Self::forget_hidden`]).
    async fn grant_losing_answers(&self, txn: GrantTxn<'_>) -> LogResult<Granted> {
        let (key, session) = (txn.key.to_owned(), txn.session);
        self.forget_hidden(&key, session).await?;
        let record = txn.holder_record.clone();
        let answer = self.inner.grant(txn).await?;
        if answer.value != Granted::Yes || !self.loses_answer() {
            return Ok(answer);
        }
        Err(self.lost_answer(vec![HeldAt {
            key,
            session,
            revision: answer.header.revision,
            value: record,
        }]))
    }

    /// A batch under a fault of grant transactions: each grant member meets
    /// the fault as a lone grant would (the whole batch's answer is lost
    /// when one of its committed grants' is, as a lost answer is).
    async fn faulty_batch(&self, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>> {
        let grants: Vec<Option<(String, i64, Vec<u8>)>> = ops
            .iter()
            .map(|op| match op {
                BatchOp::Grant(txn) => {
                    Some((txn.key.to_owned(), txn.session, txn.holder_record.clone()))
                }
                BatchOp::Release(_) => None,
            })
            .collect();
        for (key, session, _) in grants.iter().flatten() {
            match self.fault {
                TestFault::GrantOnWatch if self.take_signal(key) => {
                    self.take_as_released(key, *session).await?
                }
                TestFault::ForgetHidden => self.forget_hidden(key, *session).await?,
                _ => {}
            }
        }
        let answer = self.inner.batch(ops).await?;
        let members = answer.value.iter().zip(&grants);
        match self.fault {
            TestFault::SlowReuse => {
                let own = members
                    .into_iter()
                    .any(|(outcome, grant)| match (outcome, grant) {
                        (
                            BatchOutcome::Grant(Granted::No { holder, .. }),
                            Some((_, session, _)),
                        ) => own_hold(holder.as_ref(), *session),
                        _ => false,
                    });
                if own {
                    debug!(
                        "test fault slow-reuse: holding back a batch with a session's own grant"
                    );
                    tokio::time::sleep(SLOW_REUSE).await;
                }
                Ok(answer)
            }
            TestFault::LoseGrantAnswers | TestFault::ForgetHidden => {
                let committed: Vec<HeldAt> = members
                    .filter_map(|(outcome, grant)| match (outcome, grant) {
                        (BatchOutcome::Grant(Granted::Yes), Some((key, session, record))) => {
                            Some(HeldAt {
                                key: key.clone(),
                                session: *session,
                                revision: answer.header.revision,
                                value: record.clone(),
                            })
                        }
                        _ => None,
                    })
                    .collect();
                // every committed grant counts, as each would alone
                let lose = committed
                    .iter()
                    .fold(false, |lose, _| self.loses_answer() || lose);
                if lose {
                    Err(self.lost_answer(committed))
                } else {
                    Ok(answer)
                }
            }
            TestFault::None
            | TestFault::GrantOnWatch
            | TestFault::SlowSessionWrites
            | TestFault::SlowWithdraw => Ok(answer),
        }
    }
}

/// Whether `holder` is `session`'s: the protocol then claims it for the
/// session's new call.
fn own_hold(holder: Option<&Kv>, session: i64) -> bool {
    holder.is_some_and(|kv| kv.lease == session)
}

/// A key watch that notes its `Freed` and `Changed` signals for
/// [`TestFault::GrantOnWatch`].
struct NotingWatch {
    inner: Box<dyn KeyWatch>,
    key: String,
    signalled: Arc<Mutex<BTreeSet<String>>>,
}

#[async_trait]
impl KeyWatch for NotingWatch {
    async fn next(&mut self) -> WatchSignal {
        let signal = self.inner.next().await;
        if matches!(signal, WatchSignal::Freed | WatchSignal::Changed) {
            self.signalled.lock().insert(self.key.clone());
        }
        signal
    }
}

#[async_trait]
impl FollowLog for FaultyLog {
    async fn follow(
        &self,
        counted: Counted,
        prev_kv: bool,
        each: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
    ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
        self.inner.follow(counted, prev_kv, each).await
    }
}

#[async_trait]
impl HoldLog for FaultyLog {
    async fn grant(&self, txn: GrantTxn<'_>) -> LogResult<Granted> {
        match self.fault {
            TestFault::GrantOnWatch if self.take_signal(txn.key) => self.grant_on_watch(txn).await,
            TestFault::SlowReuse => {
                let (session, txn_key) = (txn.session, txn.key);
                let answer = self.inner.grant(txn).await?;
                if let Granted::No { holder, .. } = &answer.value
                    && own_hold(holder.as_ref(), session)
                {
                    debug!(
                        key = txn_key,
                        session, "test fault slow-reuse: holding back the session's own grant"
                    );
                    tokio::time::sleep(SLOW_REUSE).await;
                }
                Ok(answer)
            }
            TestFault::LoseGrantAnswers | TestFault::ForgetHidden => {
                self.grant_losing_answers(txn).await
            }
            TestFault::None
            | TestFault::GrantOnWatch
            | TestFault::SlowSessionWrites
            | TestFault::SlowWithdraw => self.inner.grant(txn).await,
        }
    }

    async fn hand_over(&self, txn: HandOverTxn<'_>) -> LogResult<Option<Option<Vec<u8>>>> {
        self.inner.hand_over(txn).await
    }

    async fn downgrade(&self, txn: DowngradeTxn<'_>) -> LogResult<bool> {
        self.inner.downgrade(txn).await
    }

    async fn release(&self, held: &HeldAt) -> LogResult<Option<Vec<u8>>> {
        self.inner.release(held).await
    }

    async fn release_if_owned(&self, txn: &ReleaseTxn) -> LogResult<ReleasedIf> {
        self.inner.release_if_owned(txn).await
    }

    fn batch_limit(&self) -> usize {
        self.inner.batch_limit()
    }

    async fn batch(&self, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>> {
        self.faulty_batch(ops).await
    }

    async fn claim(&self, key: &str, session: i64, revision: i64) -> LogResult<Claimed> {
        self.inner.claim(key, session, revision).await
    }

    async fn release_orphan(&self, key: &str, session: i64, revision: i64) -> LogResult<bool> {
        self.inner.release_orphan(key, session, revision).await
    }

    async fn force_end(&self, txn: ForceEndTxn<'_>) -> LogResult<ForceEnded> {
        self.inner.force_end(txn).await
    }

    async fn holder(&self, key: &str) -> LogResult<Option<Kv>> {
        self.inner.holder(key).await
    }

    async fn holders_of(&self, keys: &[String]) -> LogResult<Vec<Option<Kv>>> {
        self.inner.holders_of(keys).await
    }

    async fn held_keys_page(&self, after: Option<&str>, limit: usize) -> LogResult<Vec<String>> {
        self.inner.held_keys_page(after, limit).await
    }

    async fn quota_places(&self, class: &str, subject: &str) -> LogResult<Vec<(u32, Kv)>> {
        self.inner.quota_places(class, subject).await
    }

    async fn free_quota_place(
        &self,
        class: &str,
        subject: &str,
        index: u32,
        revision: i64,
    ) -> LogResult<bool> {
        self.inner
            .free_quota_place(class, subject, index, revision)
            .await
    }

    async fn holders_under(&self, prefix: &str) -> LogResult<Vec<(String, Kv)>> {
        self.inner.holders_under(prefix).await
    }

    async fn count_holds(&self) -> LogResult<i64> {
        self.inner.count_holds().await
    }

    async fn watch(&self, key: &str, from_revision: i64) -> Result<Box<dyn KeyWatch>, StoreError> {
        let watch = self.inner.watch(key, from_revision).await?;
        Ok(match self.fault {
            TestFault::GrantOnWatch => Box::new(NotingWatch {
                inner: watch,
                key: key.to_owned(),
                signalled: Arc::clone(&self.signalled),
            }),
            TestFault::None
            | TestFault::SlowReuse
            | TestFault::LoseGrantAnswers
            | TestFault::ForgetHidden
            | TestFault::SlowSessionWrites
            | TestFault::SlowWithdraw => watch,
        })
    }
}

#[async_trait]
impl EpochLog for FaultyLog {
    async fn records(&self) -> LogResult<Records> {
        self.inner.records().await
    }

    async fn create_epoch(&self, record: Vec<u8>) -> LogResult<bool> {
        self.inner.create_epoch(record).await
    }

    async fn put_seal(
        &self,
        record: Vec<u8>,
        seal_at: Option<i64>,
        epoch_at: Option<i64>,
    ) -> LogResult<bool> {
        self.inner.put_seal(record, seal_at, epoch_at).await
    }

    async fn put_coord_seen(&self, record: Vec<u8>, at: Option<i64>) -> LogResult<bool> {
        self.inner.put_coord_seen(record, at).await
    }

    async fn advance(
        &self,
        expected: Vec<u8>,
        seal_at: Option<i64>,
        record: Vec<u8>,
    ) -> LogResult<Option<i64>> {
        self.inner.advance(expected, seal_at, record).await
    }

    async fn raise_map_fence(&self, version: u64) -> LogResult<bool> {
        self.inner.raise_map_fence(version).await
    }

    async fn map_fence(&self) -> LogResult<Option<Kv>> {
        self.inner.map_fence().await
    }
}

#[async_trait]
impl DurableQueueLog for FaultyLog {
    async fn enqueue(
        &self,
        key: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        self.inner
            .enqueue(key, session, session_record, record)
            .await
    }

    async fn dequeue(&self, key: &str, session: i64, modified: i64) -> LogResult<bool> {
        self.inner.dequeue(key, session, modified).await
    }

    async fn put_intent(
        &self,
        name: &str,
        session: i64,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        self.inner
            .put_intent(name, session, session_record, record)
            .await
    }

    async fn drop_intent(&self, name: &str, session: i64, modified: i64) -> LogResult<bool> {
        self.inner.drop_intent(name, session, modified).await
    }

    async fn watch_intents(
        &self,
        name: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        self.inner.watch_intents(name, from_revision).await
    }

    async fn count_queued(&self, key: &str) -> LogResult<i64> {
        self.inner.count_queued(key).await
    }

    async fn queue_head(&self, key: &str) -> LogResult<Option<Kv>> {
        self.inner.queue_head(key).await
    }

    async fn watch_queue(
        &self,
        key: &str,
        from_revision: i64,
    ) -> Result<Box<dyn KeyWatch>, StoreError> {
        self.inner.watch_queue(key, from_revision).await
    }
}

#[async_trait]
impl SessionLog for FaultyLog {
    async fn revoke_session(
        &self,
        txn: RevokeSessionTxn<'_>,
    ) -> Result<SessionRevoked, StoreError> {
        self.inner.revoke_session(txn).await
    }

    async fn mark_shadow(&self, session: i64, shard: &str) -> LogResult<()> {
        self.inner.mark_shadow(session, shard).await
    }

    async fn shadow_marks(&self, session: i64) -> LogResult<Vec<String>> {
        self.inner.shadow_marks(session).await
    }

    async fn grant_lease(&self, id: i64, ttl_seconds: u32) -> LogResult<()> {
        self.inner.grant_lease(id, ttl_seconds).await
    }

    async fn put_session(&self, session: i64, identity: &str, record: Vec<u8>) -> LogResult<()> {
        let answer = self.inner.put_session(session, identity, record).await;
        if self.fault == TestFault::SlowSessionWrites {
            tokio::time::sleep(SLOW_SESSION_WRITE).await;
        }
        answer
    }

    async fn session(&self, session: i64) -> LogResult<Option<Kv>> {
        self.inner.session(session).await
    }

    async fn count_sessions_of(&self, identity: &str) -> LogResult<u32> {
        self.inner.count_sessions_of(identity).await
    }

    async fn delete_session(
        &self,
        session: i64,
        identity: &str,
        record: Vec<u8>,
    ) -> LogResult<bool> {
        self.inner.delete_session(session, identity, record).await
    }

    async fn revoke(&self, lease: i64) -> Result<(), StoreError> {
        self.inner.revoke(lease).await
    }

    async fn renew(&self, lease: i64) -> Result<Renewal, StoreError> {
        self.inner.renew(lease).await
    }
}

#[async_trait]
impl latchkey_arbiter::lock_log::ElectionLog for FaultyLog {
    async fn election(
        &self,
        election: &str,
        limit: usize,
    ) -> LogResult<latchkey_arbiter::lock_log::ElectionRead> {
        self.inner.election(election, limit).await
    }
    async fn stand(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        session_record: &[u8],
        record: Vec<u8>,
    ) -> LogResult<Option<Queued>> {
        self.inner
            .stand(election, session, priority, session_record, record)
            .await
    }
    async fn withdraw(
        &self,
        election: &str,
        session: i64,
        priority: u32,
        modified: i64,
    ) -> LogResult<bool> {
        if self.fault == TestFault::SlowWithdraw {
            tokio::time::sleep(SLOW_WITHDRAW).await;
        }
        self.inner
            .withdraw(election, session, priority, modified)
            .await
    }
    async fn lead(&self, txn: latchkey_arbiter::lock_log::LeadTxn<'_>) -> LogResult<bool> {
        self.inner.lead(txn).await
    }
    async fn proclaim(&self, txn: latchkey_arbiter::lock_log::ProclaimTxn<'_>) -> LogResult<bool> {
        self.inner.proclaim(txn).await
    }
    async fn force_end_term(
        &self,
        txn: latchkey_arbiter::lock_log::ForceTermTxn<'_>,
    ) -> LogResult<latchkey_arbiter::lock_log::ForceEnded> {
        self.inner.force_end_term(txn).await
    }
    async fn count_leaderships(&self, subject: &str) -> LogResult<i64> {
        self.inner.count_leaderships(subject).await
    }
    async fn count_elections(&self, subject: &str) -> LogResult<i64> {
        self.inner.count_elections(subject).await
    }
    async fn watch_election(
        &self,
        election: &str,
        from_revision: i64,
    ) -> Result<Box<dyn PrefixWatch>, StoreError> {
        self.inner.watch_election(election, from_revision).await
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, VecDeque};

    use latchkey_arbiter::lock_log::{Answer, Header, fallback};

    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn names_parse_back() {
        for fault in TestFault::ALL {
            assert_eq!(TestFault::parse(fault.name()), Ok(fault));
        }
        let err = TestFault::parse("grant-on-wach").unwrap_err();
        assert!(err.contains("grant-on-watch"), "{err}");
        assert!(layer(TestFault::None).is_none());
        assert!(layer(TestFault::GrantOnWatch).is_some());
    }

    #[test]
    fn the_flag_is_taken_out_of_the_command_line_in_both_forms() {
        let (fault, rest) = split_test_fault_arg(os(&[
            "arbiter-under-test",
            "--listen",
            "127.0.0.1:1",
            "--test-fault",
            "grant-on-watch",
            "--log-json",
        ]))
        .unwrap();
        assert_eq!(fault, TestFault::GrantOnWatch);
        assert_eq!(
            rest,
            os(&[
                "arbiter-under-test",
                "--listen",
                "127.0.0.1:1",
                "--log-json"
            ])
        );

        let (fault, rest) =
            split_test_fault_arg(os(&["a", "--test-fault=slow-reuse", "--x"])).unwrap();
        assert_eq!(fault, TestFault::SlowReuse);
        assert_eq!(rest, os(&["a", "--x"]));

        let (fault, rest) = split_test_fault_arg(os(&["a", "--x", "1"])).unwrap();
        assert_eq!(fault, TestFault::None);
        assert_eq!(rest, os(&["a", "--x", "1"]));

        // after `--` everything is the arbiter's; a look-alike flag too
        let (fault, rest) =
            split_test_fault_arg(os(&["a", "--", "--test-fault", "slow-reuse"])).unwrap();
        assert_eq!(fault, TestFault::None);
        assert_eq!(rest, os(&["a", "--", "--test-fault", "slow-reuse"]));
        let (_, rest) = split_test_fault_arg(os(&["a", "--test-faults"])).unwrap();
        assert_eq!(rest, os(&["a", "--test-faults"]));
    }

    #[test]
    fn a_bad_flag_is_refused() {
        for argv in [
            &["a", "--test-fault"][..],
            &["a", "--test-fault", "nope"],
            &["a", "--test-fault=nope"],
            &["a", "--test-fault=none", "--test-fault", "slow-reuse"],
        ] {
            assert!(split_test_fault_arg(os(argv)).is_err(), "{argv:?}");
        }
    }

    /// Holds and scripted watch signals: just enough log for the layer.
    #[derive(Default)]
    struct FakeLog {
        state: Mutex<FakeState>,
    }

    #[derive(Default)]
    struct FakeState {
        revision: i64,
        holds: BTreeMap<String, Kv>,
        signals: VecDeque<WatchSignal>,
    }

    impl FakeLog {
        fn answer<T>(state: &FakeState, value: T) -> LogResult<T> {
            Ok(Answer {
                header: Header {
                    cluster_id: 1,
                    revision: state.revision,
                },
                value,
            })
        }

        fn signal_next(&self, signal: WatchSignal) {
            self.state.lock().signals.push_back(signal);
        }
    }

    struct FakeWatch(Option<WatchSignal>);

    #[async_trait]
    impl KeyWatch for FakeWatch {
        async fn next(&mut self) -> WatchSignal {
            self.0.take().unwrap_or(WatchSignal::Lost)
        }
    }

    fn unused<T>() -> Result<T, StoreError> {
        Err(StoreError::unavailable("not in this fake"))
    }

    #[async_trait]
    impl latchkey_arbiter::lock_log::ElectionLog for FakeLog {
        async fn election(
            &self,
            election: &str,
            limit: usize,
        ) -> LogResult<latchkey_arbiter::lock_log::ElectionRead> {
            let _ = (election, limit);
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn stand(
            &self,
            election: &str,
            session: i64,
            priority: u32,
            session_record: &[u8],
            record: Vec<u8>,
        ) -> LogResult<Option<Queued>> {
            let _ = (election, session, priority, session_record, record);
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn withdraw(
            &self,
            election: &str,
            session: i64,
            priority: u32,
            modified: i64,
        ) -> LogResult<bool> {
            let _ = (election, session, priority, modified);
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn lead(&self, txn: latchkey_arbiter::lock_log::LeadTxn<'_>) -> LogResult<bool> {
            let _ = txn;
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn proclaim(
            &self,
            txn: latchkey_arbiter::lock_log::ProclaimTxn<'_>,
        ) -> LogResult<bool> {
            let _ = txn;
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn force_end_term(
            &self,
            txn: latchkey_arbiter::lock_log::ForceTermTxn<'_>,
        ) -> LogResult<latchkey_arbiter::lock_log::ForceEnded> {
            let _ = txn;
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn count_leaderships(&self, subject: &str) -> LogResult<i64> {
            let _ = subject;
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn count_elections(&self, subject: &str) -> LogResult<i64> {
            let _ = subject;
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
        async fn watch_election(
            &self,
            election: &str,
            from_revision: i64,
        ) -> Result<Box<dyn PrefixWatch>, StoreError> {
            let _ = (election, from_revision);
            Err(StoreError::unavailable("elections are not in this log yet"))
        }
    }

    #[async_trait]
    impl FollowLog for FakeLog {
        async fn follow(
            &self,
            _: Counted,
            _: bool,
            _: &mut (dyn for<'k> FnMut(&'k str, &'k Kv) + Send),
        ) -> Result<(i64, Result<Box<dyn PrefixWatch>, StoreError>), StoreError> {
            unused()
        }
    }

    #[async_trait]
    impl HoldLog for FakeLog {
        async fn release_if_owned(&self, txn: &ReleaseTxn) -> LogResult<ReleasedIf> {
            fallback::release_if_owned(self, txn).await
        }

        fn batch_limit(&self) -> usize {
            1
        }

        async fn batch(&self, ops: Vec<BatchOp<'_>>) -> LogResult<Vec<BatchOutcome>> {
            fallback::batch(self, ops).await
        }

        async fn holders_of(&self, keys: &[String]) -> LogResult<Vec<Option<Kv>>> {
            fallback::holders_of(self, keys).await
        }

        async fn held_keys_page(
            &self,
            after: Option<&str>,
            limit: usize,
        ) -> LogResult<Vec<String>> {
            fallback::held_keys_page(self, after, limit).await
        }

        async fn grant(&self, txn: GrantTxn<'_>) -> LogResult<Granted> {
            let mut s = self.state.lock();
            if let Some(kv) = s.holds.get(txn.key) {
                let holder = Some(kv.clone());
                return Self::answer(
                    &s,
                    Granted::No {
                        holder,
                        epoch: Some(txn.epoch.to_vec()),
                        sealed: false,
                        session: Some(txn.session_record.to_vec()),
                        queue_head: None,
                        fence_at: 0,
                        other_kind: false,
                        other_mode: None,
                        intent: None,
                    },
                );
            }
            s.revision += 1;
            let kv = Kv {
                value: txn.holder_record,
                create_revision: s.revision,
                mod_revision: s.revision,
                lease: txn.session,
            };
            s.holds.insert(txn.key.to_owned(), kv);
            Self::answer(&s, Granted::Yes)
        }

        async fn hand_over(&self, _: HandOverTxn<'_>) -> LogResult<Option<Option<Vec<u8>>>> {
            unused()
        }

        async fn downgrade(&self, _: DowngradeTxn<'_>) -> LogResult<bool> {
            unused()
        }

        async fn force_end(&self, _: ForceEndTxn<'_>) -> LogResult<ForceEnded> {
            unused()
        }

        async fn release(&self, held: &HeldAt) -> LogResult<Option<Vec<u8>>> {
            let mut s = self.state.lock();
            let matches = s.holds.get(&held.key).is_some_and(|kv| {
                kv.lease == held.session
                    && kv.mod_revision == held.revision
                    && kv.value == held.value
            });
            let deleted = if matches {
                s.revision += 1;
                s.holds.remove(&held.key).map(|kv| kv.value)
            } else {
                None
            };
            Self::answer(&s, deleted)
        }

        async fn claim(&self, key: &str, session: i64, revision: i64) -> LogResult<Claimed> {
            let s = self.state.lock();
            let matches = s
                .holds
                .get(key)
                .is_some_and(|kv| kv.lease == session && kv.mod_revision == revision);
            Self::answer(
                &s,
                if matches {
                    Claimed::Already
                } else {
                    Claimed::Gone
                },
            )
        }

        async fn release_orphan(&self, key: &str, session: i64, revision: i64) -> LogResult<bool> {
            let mut s = self.state.lock();
            let matches = s
                .holds
                .get(key)
                .is_some_and(|kv| kv.lease == session && kv.mod_revision == revision);
            if matches {
                s.revision += 1;
                s.holds.remove(key);
            }
            Self::answer(&s, matches)
        }

        async fn quota_places(&self, _: &str, _: &str) -> LogResult<Vec<(u32, Kv)>> {
            unused()
        }
        async fn free_quota_place(&self, _: &str, _: &str, _: u32, _: i64) -> LogResult<bool> {
            unused()
        }
        async fn holder(&self, key: &str) -> LogResult<Option<Kv>> {
            let s = self.state.lock();
            let kv = s.holds.get(key).cloned();
            Self::answer(&s, kv)
        }

        async fn holders_under(&self, _: &str) -> LogResult<Vec<(String, Kv)>> {
            unused()
        }

        async fn count_holds(&self) -> LogResult<i64> {
            unused()
        }

        async fn watch(&self, _: &str, _: i64) -> Result<Box<dyn KeyWatch>, StoreError> {
            let signal = self.state.lock().signals.pop_front();
            Ok(Box::new(FakeWatch(signal)))
        }
    }

    #[async_trait]
    impl EpochLog for FakeLog {
        async fn records(&self) -> LogResult<Records> {
            unused()
        }

        async fn create_epoch(&self, _: Vec<u8>) -> LogResult<bool> {
            unused()
        }

        async fn put_seal(&self, _: Vec<u8>, _: Option<i64>, _: Option<i64>) -> LogResult<bool> {
            unused()
        }

        async fn put_coord_seen(&self, _: Vec<u8>, _: Option<i64>) -> LogResult<bool> {
            unused()
        }

        async fn advance(&self, _: Vec<u8>, _: Option<i64>, _: Vec<u8>) -> LogResult<Option<i64>> {
            unused()
        }

        async fn raise_map_fence(&self, _: u64) -> LogResult<bool> {
            unused()
        }

        async fn map_fence(&self) -> LogResult<Option<Kv>> {
            unused()
        }
    }

    #[async_trait]
    impl DurableQueueLog for FakeLog {
        async fn watch_intents(&self, _: &str, _: i64) -> Result<Box<dyn KeyWatch>, StoreError> {
            fallback::no_intent_watch()
        }

        async fn watch_queue(&self, _: &str, _: i64) -> Result<Box<dyn KeyWatch>, StoreError> {
            fallback::no_queue_watch()
        }

        async fn enqueue(
            &self,
            _: &str,
            _: i64,
            _: &[u8],
            _: Vec<u8>,
        ) -> LogResult<Option<Queued>> {
            unused()
        }

        async fn dequeue(&self, _: &str, _: i64, _: i64) -> LogResult<bool> {
            unused()
        }

        async fn put_intent(
            &self,
            _: &str,
            _: i64,
            _: &[u8],
            _: Vec<u8>,
        ) -> LogResult<Option<Queued>> {
            unused()
        }

        async fn drop_intent(&self, _: &str, _: i64, _: i64) -> LogResult<bool> {
            unused()
        }

        async fn count_queued(&self, _: &str) -> LogResult<i64> {
            unused()
        }

        async fn queue_head(&self, _: &str) -> LogResult<Option<Kv>> {
            unused()
        }
    }

    #[async_trait]
    impl SessionLog for FakeLog {
        async fn revoke_session(
            &self,
            _: RevokeSessionTxn<'_>,
        ) -> Result<SessionRevoked, StoreError> {
            unused()
        }

        async fn mark_shadow(&self, _: i64, _: &str) -> LogResult<()> {
            Err(fallback::no_shadow_marks())
        }

        async fn shadow_marks(&self, _: i64) -> LogResult<Vec<String>> {
            Err(fallback::no_shadow_marks())
        }

        async fn grant_lease(&self, _: i64, _: u32) -> LogResult<()> {
            unused()
        }

        async fn put_session(&self, _: i64, _: &str, _: Vec<u8>) -> LogResult<()> {
            unused()
        }

        async fn session(&self, _: i64) -> LogResult<Option<Kv>> {
            unused()
        }

        async fn count_sessions_of(&self, _: &str) -> LogResult<u32> {
            unused()
        }

        async fn delete_session(&self, _: i64, _: &str, _: Vec<u8>) -> LogResult<bool> {
            unused()
        }

        async fn revoke(&self, _: i64) -> Result<(), StoreError> {
            unused()
        }

        async fn renew(&self, _: i64) -> Result<Renewal, StoreError> {
            unused()
        }
    }

    fn txn(key: &str, session: i64) -> GrantTxn<'_> {
        GrantTxn {
            key,
            session,
            holder_record: format!("holder {session}").into_bytes(),
            epoch: b"epoch",
            fence_at: 0,
            session_record: b"session",
            queue: Default::default(),
            quota: None,
        }
    }

    fn wrapped(fault: TestFault) -> (Arc<FakeLog>, Arc<dyn LockLog>) {
        let fake = Arc::new(FakeLog::default());
        let layer = layer(fault).unwrap();
        let log = (layer.wrap)(Arc::clone(&fake) as Arc<dyn LockLog>);
        (fake, log)
    }

    async fn holder_lease(log: &Arc<dyn LockLog>, key: &str) -> Option<i64> {
        log.holder(key).await.unwrap().value.map(|kv| kv.lease)
    }

    #[tokio::test]
    async fn grant_on_watch_grants_a_held_key_after_a_watch_event_only() {
        let (fake, log) = wrapped(TestFault::GrantOnWatch);
        assert_eq!(log.grant(txn("k", 1)).await.unwrap().value, Granted::Yes);
        // no watch event yet: the real transaction refuses session 2
        let refused = log.grant(txn("k", 2)).await.unwrap().value;
        assert!(matches!(refused, Granted::No { .. }), "{refused:?}");

        // a Lost watch is not an event
        fake.signal_next(WatchSignal::Lost);
        let mut w = log.watch("k", 1).await.unwrap();
        assert_eq!(w.next().await, WatchSignal::Lost);
        assert!(matches!(
            log.grant(txn("k", 2)).await.unwrap().value,
            Granted::No { .. }
        ));

        // a Changed on another key does nothing for "k"
        fake.signal_next(WatchSignal::Changed);
        let mut other = log.watch("other", 1).await.unwrap();
        assert_eq!(other.next().await, WatchSignal::Changed);
        assert!(matches!(
            log.grant(txn("k", 2)).await.unwrap().value,
            Granted::No { .. }
        ));

        // a Changed on "k": session 1 still holds it, yet session 2 gets it
        fake.signal_next(WatchSignal::Changed);
        let mut w = log.watch("k", 1).await.unwrap();
        assert_eq!(w.next().await, WatchSignal::Changed);
        assert_eq!(log.grant(txn("k", 2)).await.unwrap().value, Granted::Yes);
        assert_eq!(holder_lease(&log, "k").await, Some(2));

        // once per event
        assert!(matches!(
            log.grant(txn("k", 3)).await.unwrap().value,
            Granted::No { .. }
        ));
        assert_eq!(holder_lease(&log, "k").await, Some(2));

        // an event followed by the holder's own call leaves its hold alone
        fake.signal_next(WatchSignal::Freed);
        let mut w = log.watch("k", 1).await.unwrap();
        assert_eq!(w.next().await, WatchSignal::Freed);
        let own = log.grant(txn("k", 2)).await.unwrap().value;
        assert!(
            matches!(&own, Granted::No { holder: Some(kv), .. } if kv.lease == 2),
            "{own:?}"
        );
    }

    /// The grant answers of `fault`'s layer for sessions 1, 2, ...: lost
    /// (`None`) or the answer.
    async fn grants_on_keys(log: &Arc<dyn LockLog>, n: i64) -> Vec<Option<Granted>> {
        let mut answers = Vec::new();
        for session in 1..=n {
            let key = format!("k{session}");
            answers.push(log.grant(txn(&key, session)).await.ok().map(|a| a.value));
        }
        answers
    }

    #[tokio::test]
    async fn lose_grant_answers_loses_every_fourth_commit_and_keeps_the_hold() {
        let (_fake, log) = wrapped(TestFault::LoseGrantAnswers);
        let answers = grants_on_keys(&log, 8).await;
        let lost: Vec<usize> = (0..answers.len())
            .filter(|&i| answers[i].is_none())
            .collect();
        assert_eq!(lost, vec![3, 7], "{answers:?}");
        // The lost grant is written: its session finds it ("already yours")
        // and another session is refused.
        assert_eq!(holder_lease(&log, "k4").await, Some(4));
        let own = log.grant(txn("k4", 4)).await.unwrap().value;
        assert!(
            matches!(&own, Granted::No { holder: Some(kv), .. } if kv.lease == 4),
            "{own:?}"
        );
        let other = log.grant(txn("k4", 9)).await.unwrap().value;
        assert!(matches!(other, Granted::No { .. }), "{other:?}");
        assert_eq!(holder_lease(&log, "k4").await, Some(4));
        // Refusals are not commits: they never lose an answer.
        for _ in 0..8 {
            let refused = log.grant(txn("k4", 9)).await.unwrap().value;
            assert!(matches!(refused, Granted::No { .. }), "{refused:?}");
        }
    }

    #[tokio::test]
    async fn forget_hidden_grants_a_key_whose_grant_answer_was_lost_to_another_session() {
        let (_fake, log) = wrapped(TestFault::ForgetHidden);
        let answers = grants_on_keys(&log, 4).await;
        assert!(answers[3].is_none(), "{answers:?}");
        assert_eq!(holder_lease(&log, "k4").await, Some(4));
        // Its own session still finds it ("already yours") and keeps it.
        let own = log.grant(txn("k4", 4)).await.unwrap().value;
        assert!(
            matches!(&own, Granted::No { holder: Some(kv), .. } if kv.lease == 4),
            "{own:?}"
        );
        assert_eq!(holder_lease(&log, "k4").await, Some(4));
        // Another session: the hidden grant is deleted under it and the key
        // granted again, while session 4's lease lives.
        assert_eq!(log.grant(txn("k4", 9)).await.unwrap().value, Granted::Yes);
        assert_eq!(holder_lease(&log, "k4").await, Some(9));
        // Once: session 9's grant was answered, so it is not taken away.
        let refused = log.grant(txn("k4", 10)).await.unwrap().value;
        assert!(matches!(refused, Granted::No { .. }), "{refused:?}");
        assert_eq!(holder_lease(&log, "k4").await, Some(9));
        // A grant whose answer arrived is never forgotten (k1..k3).
        let refused = log.grant(txn("k1", 10)).await.unwrap().value;
        assert!(matches!(refused, Granted::No { .. }), "{refused:?}");
        assert_eq!(holder_lease(&log, "k1").await, Some(1));
    }

    #[tokio::test]
    async fn slow_reuse_holds_back_only_a_sessions_own_grant() {
        let (_fake, log) = wrapped(TestFault::SlowReuse);
        let timed = |session: i64| {
            let log = Arc::clone(&log);
            async move {
                let started = tokio::time::Instant::now();
                let answer = log.grant(txn("k", session)).await.unwrap().value;
                (answer, started.elapsed())
            }
        };
        let (answer, took) = timed(1).await;
        assert_eq!(answer, Granted::Yes);
        assert!(took < SLOW_REUSE, "{took:?}");
        // another session's refusal: at once
        let (answer, took) = timed(2).await;
        assert!(matches!(answer, Granted::No { .. }));
        assert!(took < SLOW_REUSE, "{took:?}");
        // the session's own grant: after SLOW_REUSE
        let (answer, took) = timed(1).await;
        assert!(matches!(answer, Granted::No { holder: Some(ref kv), .. } if kv.lease == 1));
        assert!(took >= SLOW_REUSE, "{took:?}");
    }

    /// A MemLog (the simulation's, which batches) with an epoch and
    /// sessions 1..=n, each with the session record [`txn`] compares.
    async fn batching_log(n: i64) -> Arc<latchkey_sim::memlog::MemLog> {
        let mem = Arc::new(latchkey_sim::memlog::MemLog::new(7));
        mem.create_epoch(b"epoch".to_vec()).await.unwrap();
        for session in 1..=n {
            mem.grant_lease(session, 60).await.unwrap();
            mem.put_session(session, "spiffe://t/w", b"session".to_vec())
                .await
                .unwrap();
        }
        mem
    }

    /// One batch of grants of `keys` to `session`: the outcomes, or `None`
    /// when the answer was lost.
    async fn batch_grants(
        log: &Arc<dyn LockLog>,
        keys: &[&str],
        session: i64,
    ) -> Option<Vec<BatchOutcome>> {
        let ops = keys
            .iter()
            .map(|k| BatchOp::Grant(txn(k, session)))
            .collect();
        log.batch(ops).await.ok().map(|a| a.value)
    }

    /// A layer that batched less than its log (the old defaults) ran every
    /// faulted arbiter on a path production never takes: every layer now
    /// batches as its inner log does, and a fault of grant transactions
    /// meets a batch's grant members as it meets lone grants.
    #[tokio::test(start_paused = true)]
    async fn every_fault_batches_as_its_log_does_and_meets_batched_grants() {
        for fault in TestFault::ALL {
            if let Some(layer) = layer(fault) {
                let mem = batching_log(0).await;
                let log = (layer.wrap)(Arc::clone(&mem) as Arc<dyn LockLog>);
                assert!(mem.batch_limit() > 1);
                assert_eq!(log.batch_limit(), mem.batch_limit(), "{fault}");
            }
        }

        // lose-grant-answers: the batch carrying the fourth committed grant
        // loses its answer, and its grants are written
        let mem = batching_log(3).await;
        let log = (layer(TestFault::LoseGrantAnswers).unwrap().wrap)(
            Arc::clone(&mem) as Arc<dyn LockLog>
        );
        let first = batch_grants(&log, &["a", "b", "c"], 1).await.unwrap();
        assert!(first.iter().all(BatchOutcome::committed), "{first:?}");
        assert_eq!(batch_grants(&log, &["d", "e"], 2).await, None);
        assert_eq!(holder_lease(&log, "d").await, Some(2));
        assert_eq!(holder_lease(&log, "e").await, Some(2));

        // forget-hidden: a grant in a lost batch is taken from its session
        // by another session's batched grant
        let mem = batching_log(3).await;
        let log =
            (layer(TestFault::ForgetHidden).unwrap().wrap)(Arc::clone(&mem) as Arc<dyn LockLog>);
        batch_grants(&log, &["a", "b", "c"], 1).await.unwrap();
        assert_eq!(batch_grants(&log, &["d"], 2).await, None);
        assert_eq!(holder_lease(&log, "d").await, Some(2));
        let taken = batch_grants(&log, &["d", "x"], 3).await.unwrap();
        assert!(taken.iter().all(BatchOutcome::committed), "{taken:?}");
        assert_eq!(holder_lease(&log, "d").await, Some(3));

        // grant-on-watch: a watch event lets a batched grant take a held key
        let mem = batching_log(2).await;
        let log =
            (layer(TestFault::GrantOnWatch).unwrap().wrap)(Arc::clone(&mem) as Arc<dyn LockLog>);
        batch_grants(&log, &["k"], 1).await.unwrap();
        let refused = batch_grants(&log, &["k"], 2).await.unwrap();
        assert!(!refused[0].committed(), "{refused:?}");
        // session 1 lets go and takes it again: a watch event, and held
        let from = mem.records().await.unwrap().header.revision + 1;
        let mut w = log.watch("k", from).await.unwrap();
        let kv = mem.holder("k").await.unwrap().value.unwrap();
        assert!(
            mem.release_orphan("k", 1, kv.mod_revision)
                .await
                .unwrap()
                .value
        );
        assert_eq!(mem.grant(txn("k", 1)).await.unwrap().value, Granted::Yes);
        assert!(matches!(
            w.next().await,
            WatchSignal::Freed | WatchSignal::Changed
        ));
        assert_eq!(holder_lease(&log, "k").await, Some(1));
        let taken = batch_grants(&log, &["k"], 2).await.unwrap();
        assert!(taken[0].committed(), "{taken:?}");
        assert_eq!(holder_lease(&log, "k").await, Some(2));
    }
}
