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
    RevokeSessionTxn, SessionLog, SessionRevoked, ShadowMarks, StoreError, WatchSignal,
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

    async fn shadow_marks(&self, session: i64) -> LogResult<ShadowMarks> {
        self.inner.shadow_marks(session).await
    }

    async fn vouch_shadows(&self, session: i64, epoch_at: i64) -> LogResult<bool> {
        self.inner.vouch_shadows(session, epoch_at).await
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
mod tests;
