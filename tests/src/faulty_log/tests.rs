//! The fault layer's own tests, over a scripted log and the simulation's.

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

    let (fault, rest) = split_test_fault_arg(os(&["a", "--test-fault=slow-reuse", "--x"])).unwrap();
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
    async fn proclaim(&self, txn: latchkey_arbiter::lock_log::ProclaimTxn<'_>) -> LogResult<bool> {
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

    async fn held_keys_page(&self, after: Option<&str>, limit: usize) -> LogResult<Vec<String>> {
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
            kv.lease == held.session && kv.mod_revision == held.revision && kv.value == held.value
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

    async fn enqueue(&self, _: &str, _: i64, _: &[u8], _: Vec<u8>) -> LogResult<Option<Queued>> {
        unused()
    }

    async fn dequeue(&self, _: &str, _: i64, _: i64) -> LogResult<bool> {
        unused()
    }

    async fn put_intent(&self, _: &str, _: i64, _: &[u8], _: Vec<u8>) -> LogResult<Option<Queued>> {
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
    async fn revoke_session(&self, _: RevokeSessionTxn<'_>) -> Result<SessionRevoked, StoreError> {
        unused()
    }

    async fn mark_shadow(&self, _: i64, _: &str) -> LogResult<()> {
        Err(fallback::no_shadow_marks())
    }

    async fn shadow_marks(&self, _: i64) -> LogResult<ShadowMarks> {
        Err(fallback::no_shadow_marks())
    }

    async fn vouch_shadows(&self, _: i64, _: i64) -> LogResult<bool> {
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
    let log =
        (layer(TestFault::LoseGrantAnswers).unwrap().wrap)(Arc::clone(&mem) as Arc<dyn LockLog>);
    let first = batch_grants(&log, &["a", "b", "c"], 1).await.unwrap();
    assert!(first.iter().all(BatchOutcome::committed), "{first:?}");
    assert_eq!(batch_grants(&log, &["d", "e"], 2).await, None);
    assert_eq!(holder_lease(&log, "d").await, Some(2));
    assert_eq!(holder_lease(&log, "e").await, Some(2));

    // forget-hidden: a grant in a lost batch is taken from its session
    // by another session's batched grant
    let mem = batching_log(3).await;
    let log = (layer(TestFault::ForgetHidden).unwrap().wrap)(Arc::clone(&mem) as Arc<dyn LockLog>);
    batch_grants(&log, &["a", "b", "c"], 1).await.unwrap();
    assert_eq!(batch_grants(&log, &["d"], 2).await, None);
    assert_eq!(holder_lease(&log, "d").await, Some(2));
    let taken = batch_grants(&log, &["d", "x"], 3).await.unwrap();
    assert!(taken.iter().all(BatchOutcome::committed), "{taken:?}");
    assert_eq!(holder_lease(&log, "d").await, Some(3));

    // grant-on-watch: a watch event lets a batched grant take a held key
    let mem = batching_log(2).await;
    let log = (layer(TestFault::GrantOnWatch).unwrap().wrap)(Arc::clone(&mem) as Arc<dyn LockLog>);
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
