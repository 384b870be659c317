//! The contract's elections (latchkey.election.v1): candidate records in
//! key order, the leadership transaction and its compares, proclaim, the
//! election's watch from a revision, and the epoch advance and the seal
//! over them. The leadership is the term record's mod revision: every
//! case checks it against the answer of the transaction that wrote it.

use anyhow::{Context, bail, ensure};
use latchkey_arbiter::lock_log::{
    ElectionRead, FollowEvent, FollowSignal, Kv, LeadFrom, LeadTo, LeadTxn, LockLog, PrefixWatch,
    ProclaimTxn, Queued,
};
use latchkey_records::{candidate_entry, election_candidate};

use super::{
    WATCH_WAIT, epoch, lease, lift_seal, one_write, open, revision, revoke_all, unchanged,
};

/// Enough for every candidate of a case.
const ALL: usize = 16;

fn candidate_record(election: &str, session: i64) -> Vec<u8> {
    format!("{election}: candidate {session:x}").into_bytes()
}

fn lead_record(election: &str, session: i64, note: &str) -> Vec<u8> {
    format!("{election}: led by {session:x} ({note})").into_bytes()
}

fn term_record(count: u32) -> Vec<u8> {
    format!("term {count}").into_bytes()
}

/// The shard-map fence's mod revision now (0: absent), as a grantor reads it.
async fn fence_at(log: &dyn LockLog) -> anyhow::Result<i64> {
    Ok(log
        .records()
        .await?
        .value
        .map_fence
        .map_or(0, |kv| kv.mod_revision))
}

async fn read(log: &dyn LockLog, election: &str) -> anyhow::Result<ElectionRead> {
    Ok(log.election(election, ALL).await?.value)
}

/// Stands `session` (whose record is `own`) in `election`; refused is an
/// error.
async fn stand(
    log: &dyn LockLog,
    election: &str,
    session: i64,
    priority: u32,
    own: &[u8],
) -> anyhow::Result<Queued> {
    log.stand(
        election,
        session,
        priority,
        own,
        candidate_record(election, session),
    )
    .await?
    .value
    .with_context(|| format!("the stand of {session:x} in {election} was refused"))
}

/// What one case's leadership transactions share.
/// The grant subject the cases' leaderships count against.
const SUBJECT: &str = "spiffe://contract.test/elections";

struct Election<'a> {
    name: &'a str,
    epoch: &'a [u8],
    fence_at: i64,
}

impl<'a> Election<'a> {
    /// A transaction from `from` at `term_at` to the candidate `to` stood
    /// as (`created` at `priority`), comparing its session record when
    /// given.
    fn txn(
        &self,
        term_at: i64,
        count: u32,
        from: LeadFrom<'a>,
        to: Option<(i64, u32, i64, Option<&'a [u8]>)>,
    ) -> LeadTxn<'a> {
        LeadTxn {
            election: self.name,
            epoch: self.epoch,
            fence_at: self.fence_at,
            term_at,
            term_record: term_record(count),
            creates_for: None,
            from,
            to: to.map(|(session, priority, created, session_record)| LeadTo {
                session,
                priority,
                created,
                lead_record: lead_record(self.name, session, "elected"),
                session_record,
                subject: SUBJECT,
            }),
        }
    }

    fn proclaim(&self, session: i64, term_at: i64, note: &str) -> ProclaimTxn<'a> {
        ProclaimTxn {
            election: self.name,
            session,
            term_at,
            epoch: self.epoch,
            lead_record: lead_record(self.name, session, note),
        }
    }
}

/// Runs `txn`, which must commit: at exactly one revision above the log's
/// before it, which is the term record's mod revision after it.
async fn lead(log: &dyn LockLog, txn: LeadTxn<'_>, what: &str) -> anyhow::Result<i64> {
    let election = txn.election;
    let before = revision(log).await?;
    let answer = log.lead(txn).await?;
    ensure!(answer.value, "{what}: refused");
    let at = one_write(log, before, what).await?;
    ensure!(
        answer.header.revision == at,
        "{what}: answered at {}, committed at {at}",
        answer.header.revision
    );
    let term = read(log, election).await?.term.context("no term record")?;
    ensure!(
        term.mod_revision == at && term.lease == 0,
        "{what}: the term record {term:?}, the commit at {at}"
    );
    Ok(at)
}

/// Runs `txn`, which must be refused and write nothing.
async fn refused(log: &dyn LockLog, txn: LeadTxn<'_>, why: &str) -> anyhow::Result<()> {
    let before = revision(log).await?;
    let answer = log.lead(txn).await?;
    ensure!(!answer.value, "led despite {why}");
    unchanged(log, before, why).await
}

/// Two lead transactions race for a vacancy: exactly one commits, its term
/// record's mod revision is its commit's revision, the leader record is on
/// its lease and its candidate record is gone in that revision; the
/// other's candidacy stays, and a vacancy compare on the taken lead fails.
pub async fn a_vacancy_is_led_by_one_of_two_racing_lead_txns(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-race/a",
        "spiffe://contract/election-race/b",
    );
    let (ia, ib) = (lease(80, 0), lease(80, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let name = "contract/election-race";
    let e = Election {
        name,
        epoch: &epoch,
        fence_at: fence_at(log).await?,
    };
    let qa = stand(log, name, ia, 5, &ra).await?;
    let qb = stand(log, name, ib, 5, &rb).await?;
    let found = read(log, name).await?;
    ensure!(
        found.lead.is_none() && found.term.is_none() && found.candidates.len() == 2,
        "{found:?}"
    );

    let before = revision(log).await?;
    let (led_a, led_b) = tokio::join!(
        log.lead(e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 5, qa.created, Some(ra.as_slice())))
        )),
        log.lead(e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ib, 5, qb.created, Some(rb.as_slice())))
        )),
    );
    let (led_a, led_b) = (led_a?, led_b?);
    let (winner, loser, won, lost_q) = match (led_a.value, led_b.value) {
        (true, false) => (ia, ib, &led_a, qb),
        (false, true) => (ib, ia, &led_b, qa),
        (x, y) => bail!("two racing lead transactions answered {x} and {y}"),
    };
    let at = one_write(log, before, "the race").await?;
    ensure!(won.header.revision == at, "the winner answered at {won:?}");
    let found = read(log, name).await?;
    let term = found.term.context("no term record")?;
    ensure!(
        term.mod_revision == at && term.create_revision == at && term.lease == 0,
        "{term:?}"
    );
    ensure!(term.value == term_record(1), "{term:?}");
    let led = found.lead.context("no leader record")?;
    ensure!(
        led == Kv {
            value: lead_record(name, winner, "elected"),
            create_revision: at,
            mod_revision: at,
            lease: winner,
        },
        "{led:?}"
    );
    ensure!(
        found.candidates.len() == 1
            && found.candidates[0].0 == candidate_entry(5, loser)
            && found.candidates[0].1.create_revision == lost_q.created,
        "{:?}",
        found.candidates
    );

    // the loser again, at the term it now sees: the vacancy is gone
    let loser_record = if loser == ia { &ra } else { &rb };
    refused(
        log,
        e.txn(
            at,
            2,
            LeadFrom::Vacant,
            Some((loser, 5, lost_q.created, Some(loser_record.as_slice()))),
        ),
        "a vacancy compare on a taken lead",
    )
    .await?;
    revoke_all(log, &[ia, ib]).await
}

/// Every compare of the leadership transaction refuses on its own: a
/// stale term, another session named the leader, a vacancy claimed while
/// led, a candidate's place or session record that is not its own, the
/// wrong epoch, a raised shard-map fence. Then the right one commits.
pub async fn a_lead_refuses_on_any_stale_compare(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b, c) = (
        "spiffe://contract/election-stale/a",
        "spiffe://contract/election-stale/b",
        "spiffe://contract/election-stale/c",
    );
    let (ia, ib, ic) = (lease(81, 0), lease(81, 1), lease(81, 2));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let rc = open(log, ic, c).await?;
    let name = "contract/election-stale";
    let fence = fence_at(log).await?;
    let e = Election {
        name,
        epoch: &epoch,
        fence_at: fence,
    };
    let qa = stand(log, name, ia, 3, &ra).await?;
    // a term that is not there yet (0 is "absent")
    refused(
        log,
        e.txn(
            qa.created,
            1,
            LeadFrom::Vacant,
            Some((ia, 3, qa.created, Some(ra.as_slice()))),
        ),
        "a term said present on a first election",
    )
    .await?;
    let t1 = lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 3, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;
    let qb = stand(log, name, ib, 3, &rb).await?;
    let to_b = Some((ib, 3, qb.created, None));
    let leader = LeadFrom::Leader {
        session: ia,
        subject: SUBJECT,
    };

    refused(log, e.txn(t1 - 1, 2, leader, to_b), "a stale term_at").await?;
    refused(log, e.txn(0, 2, leader, to_b), "a term said absent").await?;
    refused(
        log,
        e.txn(
            t1,
            2,
            LeadFrom::Leader {
                session: ic,
                subject: SUBJECT,
            },
            to_b,
        ),
        "another session named the leader",
    )
    .await?;
    refused(
        log,
        e.txn(t1, 2, LeadFrom::Vacant, to_b),
        "a vacancy claimed while led",
    )
    .await?;
    refused(
        log,
        e.txn(t1, 2, leader, Some((ib, 3, qb.created + 1000, None))),
        "a candidate's place that is not its record's",
    )
    .await?;
    refused(
        log,
        e.txn(t1, 2, leader, Some((ib, 4, qb.created, None))),
        "a candidate at a priority it did not stand at",
    )
    .await?;
    refused(
        log,
        e.txn(
            t1,
            2,
            leader,
            Some((ib, 3, qb.created, Some(rc.as_slice()))),
        ),
        "another's session record",
    )
    .await?;
    refused(
        log,
        e.txn(
            t1,
            2,
            leader,
            Some((ic, 3, qb.created, Some(rc.as_slice()))),
        ),
        "a session that never stood",
    )
    .await?;
    let wrong_epoch = Election {
        name,
        epoch: b"contract epoch that is not",
        fence_at: fence,
    };
    refused(log, wrong_epoch.txn(t1, 2, leader, to_b), "the wrong epoch").await?;
    let raised = Election {
        name,
        epoch: &epoch,
        fence_at: fence + 1000,
    };
    refused(
        log,
        raised.txn(t1, 2, leader, to_b),
        "a fence said elsewhere",
    )
    .await?;
    let still = read(log, name).await?;
    ensure!(
        still
            .lead
            .as_ref()
            .is_some_and(|kv| kv.lease == ia && kv.mod_revision == t1)
            && still.candidates.len() == 1,
        "{still:?}"
    );
    lead(log, e.txn(t1, 2, leader, to_b), "the hand-over to b").await?;
    revoke_all(log, &[ia, ib, ic]).await
}

/// A hand-over from the leader to another candidate puts the leader
/// record on that candidate's lease and deletes its candidate record, in
/// the revision that is the new term's; the old leader's proclaim is
/// refused after it. A resignation without a successor deletes the leader
/// record, and the next vacancy compares the term it left.
pub async fn a_hand_over_and_a_resignation_move_the_lead_in_one_revision(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-hand/a",
        "spiffe://contract/election-hand/b",
    );
    let (ia, ib) = (lease(82, 0), lease(82, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let name = "contract/election-hand";
    let e = Election {
        name,
        epoch: &epoch,
        fence_at: fence_at(log).await?,
    };
    let qa = stand(log, name, ia, 7, &ra).await?;
    let t1 = lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 7, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;
    let qb = stand(log, name, ib, 2, &rb).await?;

    let t2 = lead(
        log,
        e.txn(
            t1,
            2,
            LeadFrom::Leader {
                session: ia,
                subject: SUBJECT,
            },
            Some((ib, 2, qb.created, None)),
        ),
        "the hand-over from a to b",
    )
    .await?;
    let found = read(log, name).await?;
    let led = found.lead.context("no leader after the hand-over")?;
    // a put over the leader record: its create revision stays a's (etcd
    // keeps a key's create revision over puts); the term is the term
    // record's mod revision
    ensure!(
        led == Kv {
            value: lead_record(name, ib, "elected"),
            create_revision: t1,
            mod_revision: t2,
            lease: ib,
        },
        "{led:?}"
    );
    ensure!(found.candidates.is_empty(), "{:?}", found.candidates);
    ensure!(found.term.is_some_and(|t| t.value == term_record(2)));

    let before = revision(log).await?;
    let stale = log.proclaim(e.proclaim(ia, t1, "a after its term")).await?;
    ensure!(!stale.value, "a proclaimed after handing over");
    let wrong = log.proclaim(e.proclaim(ia, t2, "a in b's term")).await?;
    ensure!(!wrong.value, "a proclaimed in b's term");
    unchanged(log, before, "proclamations of a past leader").await?;

    // b resigns without a successor
    let t3 = lead(
        log,
        e.txn(
            t2,
            3,
            LeadFrom::Leader {
                session: ib,
                subject: SUBJECT,
            },
            None,
        ),
        "b's resignation",
    )
    .await?;
    let found = read(log, name).await?;
    ensure!(found.lead.is_none(), "{:?}", found.lead);
    ensure!(found.term.is_some_and(|t| t.value == term_record(3)));
    let stale = log.proclaim(e.proclaim(ib, t3, "b resigned")).await?;
    ensure!(!stale.value, "b proclaimed after resigning");
    unchanged(log, t3, "a proclamation with no leader").await?;

    // the vacancy: at the term the resignation left, not at the one before
    let qa = stand(log, name, ia, 7, &ra).await?;
    let to_a = Some((ia, 7, qa.created, Some(ra.as_slice())));
    refused(
        log,
        e.txn(t2, 4, LeadFrom::Vacant, to_a),
        "the term before the resignation",
    )
    .await?;
    lead(
        log,
        e.txn(t3, 4, LeadFrom::Vacant, to_a),
        "a's second election",
    )
    .await?;
    revoke_all(log, &[ia, ib]).await
}

/// A proclamation rewrites the leader record on the leader's lease and
/// leaves the term record (the leadership) where it was; a stale term or
/// another session is refused; once the leader's lease is revoked its
/// leader record is gone, proclaim is refused (not a lease error) and the
/// vacancy is led at the term the leader left.
pub async fn proclaim_keeps_the_leadership(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-proclaim/a",
        "spiffe://contract/election-proclaim/b",
    );
    let (ia, ib) = (lease(83, 0), lease(83, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let name = "contract/election-proclaim";
    let e = Election {
        name,
        epoch: &epoch,
        fence_at: fence_at(log).await?,
    };
    let qa = stand(log, name, ia, 1, &ra).await?;
    let t1 = lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 1, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;

    let answer = log.proclaim(e.proclaim(ia, t1, "a's news")).await?;
    ensure!(answer.value, "a's proclamation was refused");
    let at = one_write(log, t1, "a's proclamation").await?;
    ensure!(answer.header.revision == at);
    let found = read(log, name).await?;
    ensure!(
        found.lead
            == Some(Kv {
                value: lead_record(name, ia, "a's news"),
                create_revision: t1,
                mod_revision: at,
                lease: ia,
            }),
        "{:?}",
        found.lead
    );
    ensure!(
        found.term.as_ref().is_some_and(|t| t.mod_revision == t1),
        "a proclamation moved the term: {:?}",
        found.term
    );

    for (txn, why) in [
        (e.proclaim(ia, t1 - 1, "stale"), "a stale term"),
        (
            e.proclaim(ia, at, "at the proclamation"),
            "the leader record's revision as the term",
        ),
        (e.proclaim(ib, t1, "b's"), "another session"),
    ] {
        let answer = log.proclaim(txn).await?;
        ensure!(!answer.value, "proclaimed despite {why}");
    }
    unchanged(log, at, "refused proclamations").await?;

    // the leader's session ends: the leader record goes, the term stays
    log.revoke(ia).await?;
    let ended = one_write(log, at, "the leader's lease revoked").await?;
    let found = read(log, name).await?;
    ensure!(found.lead.is_none(), "{:?}", found.lead);
    ensure!(found.term.is_some_and(|t| t.mod_revision == t1));
    let answer = log.proclaim(e.proclaim(ia, t1, "after its end")).await?;
    ensure!(!answer.value, "proclaimed on a revoked lease");
    unchanged(log, ended, "a proclamation on a revoked lease").await?;
    let qb = stand(log, name, ib, 1, &rb).await?;
    lead(
        log,
        e.txn(
            t1,
            2,
            LeadFrom::Vacant,
            Some((ib, 1, qb.created, Some(rb.as_slice()))),
        ),
        "b's election after a's end",
    )
    .await?;
    revoke_all(log, &[ib]).await
}

/// Candidates come back by key: rank (highest priority first), then
/// session; at most the limit asked for (none for a limit of 0). A
/// re-stand keeps the create revision; a stand with another's session
/// record is refused and writes nothing; a withdraw compares the last
/// write; a revoked lease takes its candidacy with it.
pub async fn candidates_come_back_by_rank_then_session(log: &dyn LockLog) -> anyhow::Result<()> {
    epoch(log).await?;
    let identities = [
        "spiffe://contract/election-ranks/0",
        "spiffe://contract/election-ranks/1",
        "spiffe://contract/election-ranks/2",
        "spiffe://contract/election-ranks/3",
    ];
    let ids: Vec<i64> = (0..4).map(|n| lease(84, n)).collect();
    let mut records = Vec::new();
    for (id, identity) in ids.iter().zip(identities) {
        records.push(open(log, *id, identity).await?);
    }
    let name = "contract/election-ranks";
    // stood in an order that is neither the rank's nor the sessions'
    let stood = [(2, 1), (0, 1), (3, 9), (1, 5)];
    let mut queued = Vec::new();
    for (n, priority) in stood {
        let q = stand(log, name, ids[n], priority, &records[n]).await?;
        queued.push((n, priority, q));
    }
    let expected = [(3, 9), (1, 5), (0, 1), (2, 1)];
    let found = read(log, name).await?;
    let keys: Vec<&str> = found.candidates.iter().map(|(k, _)| k.as_str()).collect();
    let want: Vec<String> = expected
        .iter()
        .map(|(n, p)| candidate_entry(*p, ids[*n]))
        .collect();
    ensure!(keys == want, "{keys:?}, not {want:?}");
    for (key, kv) in &found.candidates {
        let (n, _, q) = queued
            .iter()
            .find(|(n, p, _)| candidate_entry(*p, ids[*n]) == *key)
            .context("a candidate nobody stood")?;
        ensure!(
            *kv == Kv {
                value: candidate_record(name, ids[*n]),
                create_revision: q.created,
                mod_revision: q.modified,
                lease: ids[*n],
            },
            "{key}: {kv:?}"
        );
    }
    let two = log.election(name, 2).await?.value.candidates;
    ensure!(
        two.iter()
            .map(|(k, _)| k.as_str())
            .eq(want.iter().take(2).map(String::as_str)),
        "limit 2: {two:?}"
    );
    let none = log.election(name, 0).await?.value;
    ensure!(
        none.candidates.is_empty(),
        "a limit of 0 read {} candidates",
        none.candidates.len()
    );

    // a re-stand: same place, a new write
    let (_, _, first) = queued[1];
    let before = revision(log).await?;
    let again = log
        .stand(name, ids[0], 1, &records[0], b"candidate 0 again".to_vec())
        .await?
        .value
        .context("the re-stand was refused")?;
    let at = one_write(log, before, "a re-stand").await?;
    ensure!(
        again
            == Queued {
                created: first.created,
                modified: at,
            },
        "{again:?} after {first:?}"
    );

    // another's session record: refused, nothing written
    let forged = log
        .stand(name, ids[0], 1, &records[1], b"0 as 1".to_vec())
        .await?;
    ensure!(forged.value.is_none(), "{:?}", forged.value);
    unchanged(log, at, "a stand with another's session record").await?;

    // a withdraw compares the last write
    let stale = log.withdraw(name, ids[0], 1, first.modified).await?;
    ensure!(!stale.value, "a withdraw of an overwritten record");
    unchanged(log, at, "a refused withdraw").await?;
    let gone = log.withdraw(name, ids[0], 1, at).await?;
    ensure!(gone.value, "the withdraw was refused");
    one_write(log, at, "a withdraw").await?;

    // a revoked lease takes its candidacy
    log.revoke(ids[3]).await?;
    let left: Vec<String> = read(log, name)
        .await?
        .candidates
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    ensure!(
        left == [candidate_entry(5, ids[1]), candidate_entry(1, ids[2])],
        "{left:?}"
    );
    revoke_all(log, &ids).await
}

/// A lead to a candidate whose lease was revoked is refused: its
/// candidate record went with the lease, so its place compares false and
/// nothing is written. Only a place of 0 (a missing record compares as
/// created at 0) passes the compares, and then the put on the lease the
/// store no longer has refuses the whole transaction: `LeaseGone`.
pub async fn a_lead_to_a_candidate_whose_lease_ended_fails(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-gone/a",
        "spiffe://contract/election-gone/b",
    );
    let (ia, ib) = (lease(85, 0), lease(85, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let name = "contract/election-gone";
    let e = Election {
        name,
        epoch: &epoch,
        fence_at: fence_at(log).await?,
    };
    let qa = stand(log, name, ia, 4, &ra).await?;
    let qb = stand(log, name, ib, 4, &rb).await?;
    let t1 = lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 4, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;
    log.revoke(ib).await?;
    let found = read(log, name).await?;
    ensure!(found.candidates.is_empty(), "{:?}", found.candidates);

    let leader = LeadFrom::Leader {
        session: ia,
        subject: SUBJECT,
    };
    refused(
        log,
        e.txn(t1, 2, leader, Some((ib, 4, qb.created, None))),
        "a hand-over to a candidate whose lease was revoked",
    )
    .await?;
    refused(
        log,
        e.txn(
            t1,
            2,
            leader,
            Some((ib, 4, qb.created, Some(rb.as_slice()))),
        ),
        "a hand-over to a revoked session, its record compared",
    )
    .await?;
    // Naming no record (created 0) does not get past the candidate's lease
    // compare: a hand-over goes only to a record on the candidate's own,
    // live lease (a record on a revoked lease is gone with it).
    refused(
        log,
        e.txn(t1, 2, leader, Some((ib, 4, 0, None))),
        "a hand-over to no record on a revoked lease",
    )
    .await?;
    ensure!(
        read(log, name)
            .await?
            .lead
            .is_some_and(|kv| kv.lease == ia && kv.mod_revision == t1),
        "the leader changed"
    );
    revoke_all(log, &[ia, ib]).await
}

async fn next(watch: &mut Box<dyn PrefixWatch>, what: &str) -> anyhow::Result<FollowSignal> {
    tokio::time::timeout(WATCH_WAIT, watch.next())
        .await
        .with_context(|| format!("no change reported within {WATCH_WAIT:?}: {what}"))
}

/// One change as the case expects it: the key below the election's
/// prefix, the value put at `at` (`None`: a delete) and the value before.
struct Expected {
    key: String,
    put: Option<(Vec<u8>, i64)>,
    prev: Option<Vec<u8>>,
}

fn put(key: &str, value: Vec<u8>, at: i64, prev: Option<Vec<u8>>) -> Expected {
    Expected {
        key: key.to_string(),
        put: Some((value, at)),
        prev,
    }
}

fn delete(key: &str, prev: Vec<u8>) -> Expected {
    Expected {
        key: key.to_string(),
        put: None,
        prev: Some(prev),
    }
}

fn check(seen: &FollowEvent, want: &Expected, n: usize) -> anyhow::Result<()> {
    ensure!(
        seen.key == want.key,
        "change {n}: {seen:?}, not key {}",
        want.key
    );
    match (&seen.put, &want.put) {
        (Some(kv), Some((value, at))) => ensure!(
            kv.value == *value && kv.mod_revision == *at,
            "change {n}: {seen:?}, not a put at {at}"
        ),
        (None, None) => {}
        _ => bail!(
            "change {n}: {seen:?}, not a {}",
            if want.put.is_some() { "put" } else { "delete" }
        ),
    }
    ensure!(
        seen.prev.as_ref().map(|kv| &kv.value) == want.prev.as_ref(),
        "change {n}: {seen:?}, not after {:?}",
        want.prev.as_ref().map(|v| String::from_utf8_lossy(v))
    );
    Ok(())
}

/// A watch of an election from a past revision reports every change of
/// its records since, then the later ones, in revision order and in each
/// revision in the transaction's order, keys below the election's prefix,
/// every change with the value before it (a delete's included); nothing of
/// another election; `through` never behind the changes it carries.
pub async fn an_election_watch_reports_every_change_from_a_revision(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-watch/a",
        "spiffe://contract/election-watch/b",
    );
    let (ia, ib) = (lease(86, 0), lease(86, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let name = "contract/election-watch";
    // a name whose prefix the watched one's is not, nor the other way
    let other = "contract/election-watch/2";
    let e = Election {
        name,
        epoch: &epoch,
        fence_at: fence_at(log).await?,
    };
    let (ka, kb) = (election_candidate(6, ia), election_candidate(6, ib));

    let qa = stand(log, name, ia, 6, &ra).await?;
    stand(log, other, ib, 6, &rb).await?;
    let t1 = lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 6, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;
    let qb = stand(log, name, ib, 6, &rb).await?;
    // from a past revision: the stand of a and everything after it
    let mut watch = log.watch_election(name, qa.created).await?;

    ensure!(log.proclaim(e.proclaim(ia, t1, "news")).await?.value);
    let p1 = one_write(log, qb.modified, "a's proclamation").await?;
    let t2 = lead(
        log,
        e.txn(
            t1,
            2,
            LeadFrom::Leader {
                session: ia,
                subject: SUBJECT,
            },
            Some((ib, 6, qb.created, None)),
        ),
        "the hand-over to b",
    )
    .await?;
    stand(log, other, ia, 6, &ra).await?;
    log.revoke(ib).await?;
    let end = revision(log).await?;

    let elected = |s| lead_record(name, s, "elected");
    let expected = [
        put(&ka, candidate_record(name, ia), qa.created, None),
        put("term", term_record(1), t1, None),
        put("lead", elected(ia), t1, None),
        delete(&ka, candidate_record(name, ia)),
        put(&kb, candidate_record(name, ib), qb.created, None),
        put("lead", lead_record(name, ia, "news"), p1, Some(elected(ia))),
        put("term", term_record(2), t2, Some(term_record(1))),
        put("lead", elected(ib), t2, Some(lead_record(name, ia, "news"))),
        delete(&kb, candidate_record(name, ib)),
        // b's session ends: its leader record with it (the term stays)
        delete("lead", elected(ib)),
    ];
    let mut seen: Vec<FollowEvent> = Vec::new();
    let mut through = 0;
    while through < end {
        match next(&mut watch, "the election's changes").await? {
            FollowSignal::Events { events, through: t } => {
                ensure!(t >= through, "through went back from {through} to {t}");
                for e in &events {
                    if let Some(kv) = &e.put {
                        ensure!(kv.mod_revision <= t, "{e:?} beyond through {t}");
                    }
                }
                through = t;
                seen.extend(events);
            }
            FollowSignal::Lost => bail!("the watch was lost after {} changes", seen.len()),
        }
    }
    ensure!(through == end, "through {through}, the log at {end}");
    ensure!(
        seen.len() == expected.len(),
        "{} changes, not {}: {seen:?}",
        seen.len(),
        expected.len()
    );
    for (n, (s, w)) in seen.iter().zip(&expected).enumerate() {
        check(s, w, n)?;
    }
    let lead_deleted = seen.last().map(|e| e.prev.as_ref().map(|kv| kv.lease));
    ensure!(lead_deleted == Some(Some(ib)), "{lead_deleted:?}");
    revoke_all(log, &[ia, ib]).await
}

/// The epoch advance ends every election in its revision: leader, term
/// and candidate records all deleted (sessions stay), so the next
/// election starts from a vacancy with no term record.
pub async fn an_advance_deletes_every_election_record(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch_bytes = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-advance/a",
        "spiffe://contract/election-advance/b",
    );
    let (ia, ib) = (lease(87, 0), lease(87, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let (name, second) = ("contract/election-advance", "contract/election-advance-2");
    let e = Election {
        name,
        epoch: &epoch_bytes,
        fence_at: fence_at(log).await?,
    };
    let qa = stand(log, name, ia, 2, &ra).await?;
    lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 2, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;
    stand(log, name, ib, 2, &rb).await?;
    // a term with no leader, and a candidate, in another election
    let q2 = stand(log, second, ia, 2, &ra).await?;
    let e2 = Election { name: second, ..e };
    let t2 = lead(
        log,
        e2.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 2, q2.created, Some(ra.as_slice()))),
        ),
        "a's election in the second",
    )
    .await?;
    lead(
        log,
        e2.txn(
            t2,
            2,
            LeadFrom::Leader {
                session: ia,
                subject: SUBJECT,
            },
            None,
        ),
        "a's resignation",
    )
    .await?;
    stand(log, second, ib, 2, &rb).await?;

    let before = revision(log).await?;
    let record = format!("contract epoch advanced at {before} (elections)").into_bytes();
    let advanced = log
        .advance(epoch_bytes.clone(), None, record.clone())
        .await?;
    ensure!(advanced.value.is_some(), "the advance was refused");
    one_write(log, before, "the advance").await?;
    for election in [name, second] {
        let found = read(log, election).await?;
        ensure!(found == ElectionRead::default(), "{election}: {found:?}");
    }
    ensure!(
        log.session(ia).await?.value.is_some(),
        "the advance deleted a session"
    );

    // the new epoch's first election: a vacancy, no term
    let qb = stand(log, name, ib, 2, &rb).await?;
    let e = Election {
        name,
        epoch: &record,
        fence_at: e.fence_at,
    };
    lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ib, 2, qb.created, Some(rb.as_slice()))),
        ),
        "b's election in the new epoch",
    )
    .await?;
    revoke_all(log, &[ia, ib]).await
}

/// While the log is sealed neither a leadership transaction nor a
/// proclamation commits; the advance that lifts the seal ends the
/// election.
pub async fn the_seal_refuses_lead_and_proclaim(log: &dyn LockLog) -> anyhow::Result<()> {
    let epoch_bytes = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-sealed/a",
        "spiffe://contract/election-sealed/b",
    );
    let (ia, ib) = (lease(88, 0), lease(88, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let name = "contract/election-sealed";
    let e = Election {
        name,
        epoch: &epoch_bytes,
        fence_at: fence_at(log).await?,
    };
    let qa = stand(log, name, ia, 8, &ra).await?;
    let t1 = lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 8, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;
    let qb = stand(log, name, ib, 8, &rb).await?;
    let at = log
        .records()
        .await?
        .value
        .epoch
        .context("no epoch record")?
        .mod_revision;
    ensure!(
        log.put_seal(b"contract seal (elections)".to_vec(), None, Some(at))
            .await?
            .value,
        "the seal was not put"
    );
    // the seal is lifted whatever the checks find, so no later case
    // meets it
    let sealed = async {
        let before = revision(log).await?;
        let leader = LeadFrom::Leader {
            session: ia,
            subject: SUBJECT,
        };
        refused(
            log,
            e.txn(t1, 2, leader, Some((ib, 8, qb.created, None))),
            "a hand-over while sealed",
        )
        .await?;
        refused(
            log,
            e.txn(t1, 2, leader, None),
            "a resignation while sealed",
        )
        .await?;
        let answer = log.proclaim(e.proclaim(ia, t1, "sealed")).await?;
        ensure!(!answer.value, "proclaimed while sealed");
        unchanged(log, before, "election writes while sealed").await
    }
    .await;
    lift_seal(log, "the_seal_refuses_lead_and_proclaim").await?;
    sealed?;
    let found = read(log, name).await?;
    ensure!(found == ElectionRead::default(), "{found:?}");
    revoke_all(log, &[ia, ib]).await
}

/// A forced end of a term (an election's force-release) ends exactly the
/// leadership it names — the leader record on that lease, the term record
/// at that revision — with the approval's records, at one revision: the
/// leader record and the leadership's entry go, the term record keeps its
/// place and says how the term ended. A stale term, another session named,
/// or a record that moved writes nothing, and the failed transaction says
/// who leads now. A hold on a lock key of the election's name is not
/// touched. The next leader leads over the vacancy at the forced term
/// record's revision, and a forced end of the old term then ends nothing.
pub async fn a_forced_end_of_a_term_ends_only_the_named_term(
    log: &dyn LockLog,
) -> anyhow::Result<()> {
    use latchkey_arbiter::lock_log::{ForceEnded, ForceRecords, ForceTermTxn};

    let epoch = epoch(log).await?;
    let (a, b) = (
        "spiffe://contract/election-force/a",
        "spiffe://contract/election-force/b",
    );
    let (ia, ib) = (lease(89, 0), lease(89, 1));
    let ra = open(log, ia, a).await?;
    let rb = open(log, ib, b).await?;
    let name = "contract/election-force";
    let record = "sys/force/contract-89";
    let e = Election {
        name,
        epoch: &epoch,
        fence_at: fence_at(log).await?,
    };
    // A lock key of the same name, held by b: never the forced end's.
    let held = super::take(log, name, ib, b, &epoch).await?;
    let entries_before = log.count_leaderships(SUBJECT).await?.value;
    let qa = stand(log, name, ia, 0, &ra).await?;
    let t1 = lead(
        log,
        e.txn(
            0,
            1,
            LeadFrom::Vacant,
            Some((ia, 0, qa.created, Some(ra.as_slice()))),
        ),
        "a's election",
    )
    .await?;
    ensure!(
        log.count_leaderships(SUBJECT).await?.value == entries_before + 1,
        "a's leadership has no entry"
    );
    let forced = |session: i64, term_at: i64, records: &'static ForceRecords| ForceTermTxn {
        election: name,
        session,
        subject: SUBJECT,
        term_at,
        term_record: b"term 1, forced".to_vec(),
        records,
    };
    static NONE: ForceRecords = ForceRecords {
        unchanged: Vec::new(),
        put: Vec::new(),
        ttl_seconds: 0,
        delete: Vec::new(),
    };
    let a_leads = |ended: &ForceEnded| {
        matches!(ended, ForceEnded::HoldChanged { now: Some(kv) }
            if kv.lease == ia && kv.value == lead_record(name, ia, "elected"))
    };

    // Stale compares: nothing written, the leader as it is now.
    let before = revision(log).await?;
    for (txn, why) in [
        (forced(ia, t1 - 1, &NONE), "a stale term_at"),
        (forced(ia, 0, &NONE), "a term said absent"),
        (forced(ib, t1, &NONE), "another session named the leader"),
    ] {
        let ended = log.force_end_term(txn).await?.value;
        ensure!(a_leads(&ended), "{why}: {ended:?}");
        unchanged(log, before, why).await?;
    }
    // A record that must not have moved, moved: nothing written.
    let moved = ForceRecords {
        unchanged: vec![(record.into(), 1)],
        ..ForceRecords::default()
    };
    let ended = log
        .force_end_term(ForceTermTxn {
            records: &moved,
            ..forced(ia, t1, &NONE)
        })
        .await?
        .value;
    ensure!(ended == ForceEnded::RecordsChanged, "{ended:?}");
    unchanged(log, before, "a forced end whose record moved").await?;

    // Named right: ended, with the record on a lease of its own, at one
    // revision.
    let written = ForceRecords {
        unchanged: Vec::new(),
        put: vec![(record.into(), b"approved".to_vec())],
        ttl_seconds: 600,
        delete: Vec::new(),
    };
    let answer = log
        .force_end_term(ForceTermTxn {
            records: &written,
            ..forced(ia, t1, &NONE)
        })
        .await?;
    ensure!(answer.value == ForceEnded::Ended, "{:?}", answer.value);
    let at = one_write(log, before, "a forced end of a term").await?;
    ensure!(
        answer.header.revision == at,
        "answered at {answer:?}, written at {at}"
    );
    let found = read(log, name).await?;
    ensure!(found.lead.is_none(), "still led: {:?}", found.lead);
    let term = found.term.context("the term record is gone")?;
    ensure!(
        term.value == b"term 1, forced"
            && term.mod_revision == at
            && term.create_revision == t1
            && term.lease == 0,
        "{term:?}"
    );
    ensure!(
        log.count_leaderships(SUBJECT).await?.value == entries_before,
        "the forced leadership's entry is still counted"
    );
    let kv = log
        .holder(name)
        .await?
        .value
        .context("the same-named hold is gone")?;
    ensure!(
        kv.lease == ib && kv.mod_revision == held.revision,
        "the same-named hold changed: {kv:?}"
    );
    // The same request again: the term record moved, the leader is gone.
    let ended = log.force_end_term(forced(ia, t1, &NONE)).await?.value;
    ensure!(ended == ForceEnded::HoldChanged { now: None }, "{ended:?}");
    unchanged(log, at, "a forced end of a vacancy").await?;

    // b leads over the vacancy at the forced term record's revision.
    let qb = stand(log, name, ib, 0, &rb).await?;
    let t2 = lead(
        log,
        e.txn(
            at,
            2,
            LeadFrom::Vacant,
            Some((ib, 0, qb.created, Some(rb.as_slice()))),
        ),
        "b's election over the forced vacancy",
    )
    .await?;
    let before = revision(log).await?;
    let ended = log.force_end_term(forced(ia, t1, &NONE)).await?.value;
    ensure!(
        matches!(&ended, ForceEnded::HoldChanged { now: Some(kv) } if kv.lease == ib && kv.mod_revision == t2),
        "a forced end of the old term: {ended:?}"
    );
    unchanged(log, before, "a forced end of the old term").await?;
    revoke_all(log, &[ia, ib]).await
}
