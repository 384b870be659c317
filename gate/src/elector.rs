//! The gate's election workload (issue 33): a worker that campaigns for
//! one of a few elections instead of locking keys, through the client
//! library, and records each leadership as the checker reads a grant: a
//! Campaign is an `acquire` of the election's name whose ok carries the
//! token and the **term**; a Resign is its `release`. So the checker judges
//! an election as it judges a lock (one leader at a time, tokens that only
//! rise, the fence refusing a frozen leader's stale write) and, from the
//! terms, that terms rise with tokens and no term is led twice.
//!
//! A leader writes to the PostgreSQL reference fence with its token, as a
//! lock holder does, so a leader the nemesis freezes past its TTL wakes up
//! to a refused write. A Resign with candidates waiting hands the
//! leadership over in its own transaction: the next elector's Campaign
//! answers after this one's release, and the history shows both.
//!
//! An outcome the elector cannot know (a transport error on a Campaign or
//! a Resign) ends the incarnation like the lock worker's: the leadership
//! may live until its session's lease ends, which the `expire` at the fence
//! deadline says.

use std::time::Duration;

use latchkey_client::{CampaignOptions, Client, Error, Session};
use latchkey_proto::lockv1::Reason;

use super::record::{Fields, Outcome, Recorder, mono_of};
use super::worker::{
    EXIT_STOPPED, EXIT_TAINTED, Hold, WorkerArgs, detail, is_definite_refusal, key_field,
    unit_of_work,
};

/// Campaign, lead (write with the token), resign, until the stop file.
pub async fn run(
    args: &WorkerArgs,
    client: &Client,
    session: &Session,
    fences: &crate::worker::Fences,
    rec: &mut Recorder,
    rng: &mut fastrand::Rng,
) -> anyhow::Result<i32> {
    while !args.stop_file.exists() {
        if session.is_fenced() {
            return Ok(EXIT_TAINTED);
        }
        let election = args.keys[rng.usize(..args.keys.len())].clone();
        let op = rec.invoke("acquire", key_field(&election))?;
        let options = CampaignOptions {
            priority: 0,
            wait: Some(Duration::from_millis(
                rng.u64(args.wait_ms / 10..=args.wait_ms),
            )),
            session: Some(session.clone()),
        };
        let leadership = match client
            .campaign(&election, &args.class, rec.process().to_string(), options)
            .await
        {
            Ok(leadership) => {
                rec.complete(
                    op,
                    Outcome::Ok,
                    Fields {
                        token: Some(leadership.token().get()),
                        term: Some(leadership.term()),
                        ..Fields::default()
                    },
                )?;
                leadership
            }
            Err(e) if is_definite_refusal(&e) => {
                rec.complete(op, Outcome::Fail, detail(&e))?;
                if !matches!(e.reason(), Reason::Held | Reason::WaitTimeout) {
                    tokio::time::sleep(Duration::from_millis(rng.u64(50..250))).await;
                }
                if e.reason() == Reason::SessionExpired {
                    return Ok(EXIT_TAINTED);
                }
                continue;
            }
            Err(e) => {
                // The answer is lost: a leadership may have started on this
                // session, and lives at most until its lease ends.
                rec.complete(op, Outcome::Unknown, detail(&e))?;
                let deadline = mono_of(session.fence_deadline().into_std());
                rec.invoke_at("expire", key_field(&election), deadline)?;
                return Ok(EXIT_TAINTED);
            }
        };
        let token = leadership.token().get();

        if leadership.can_start() {
            // One round of the leader's work. A SIGSTOP inside it wakes up
            // past the lease: the write then carries a stale token.
            let op =
                unit_of_work(args, rng, rec, fences, &election, Hold::EXCLUSIVE, token).await?;
            // Proclaim now and then: not judged (no history line), but it
            // runs under the same faults; a leader that lost its term is
            // refused, which the resign below then finds too.
            if rng.u8(..4) == 0 {
                let _ = leadership.proclaim(format!("{}#{op}", args.process)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(0..=args.unit_ms / 3))).await;

        let deadline = leadership.fence_deadline();
        let op = rec.invoke(
            "release",
            Fields {
                key: Some(election.clone()),
                token: Some(token),
                ..Fields::default()
            },
        )?;
        match leadership.resign().await {
            Ok(_) => rec.complete(op, Outcome::Ok, Fields::default())?,
            Err(e) => {
                // Lost before the resignation (its session, a later term, a
                // vacancy, NOT_LEADER): it ended, but when is not known
                // here; or the answer is lost. Either way the leadership
                // may have lasted until its lease ended.
                let outcome = if is_definite_refusal(&e)
                    || matches!(e, Error::Fenced { .. } | Error::LeadershipLost { .. })
                    || e.reason() == Reason::NotLeader
                {
                    Outcome::Fail
                } else {
                    Outcome::Unknown
                };
                rec.complete(op, outcome, detail(&e))?;
                let from = mono_of(deadline.min(tokio::time::Instant::now()).into_std());
                rec.invoke_at(
                    "expire",
                    Fields {
                        key: Some(election.clone()),
                        token: Some(token),
                        ..Fields::default()
                    },
                    from,
                )?;
                return Ok(EXIT_TAINTED);
            }
        }
    }
    Ok(EXIT_STOPPED)
}
