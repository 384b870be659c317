//! Beside the nemesis's faults: the operators' force-releases (issue 32),
//! and the faults that act on the whole arbiter: the log without a
//! majority, and lease renewals failing.

use std::sync::Arc;
use std::time::Duration;

use latchkey_arbiter::force_release::RevokeRecord;
use latchkey_arbiter::lock_log::{
    ForceEndTxn, ForceEnded, ForceRecords, LockLog, RevokeSessionTxn, SessionRevoked, StoreError,
};
use latchkey_checker::{Function, Outcome};
use tokio::time::Instant;

use super::nemesis::{done, fault, pause};
use super::world::{Arbiter, World, lock};
use crate::rng::Rng;

/// The lock log loses its majority for 2–8 s: every call fails, no lease
/// expires, and once it is back every lease has its whole TTL again. The
/// arbiters' probes call it lost after three failures, and grant the open
/// keys from memory meanwhile. Half the time the watch streams break up to
/// 1.2 s before (the hold counts read again after a second), and a
/// third of the time an arbiter dies in it and cannot start again until
/// the log answers (its spool replayed, or lost with its state dir).
pub(super) async fn quorum_loss(world: &World, rng: &mut Rng) {
    let length = Duration::from_millis(2000 + rng.below(6000));
    let broken = rng.chance(50);
    let restart = rng.chance(33).then(|| {
        let i = usize::try_from(rng.below(world.arbiters.len() as u64)).unwrap_or(0);
        (i, rng.chance(world.cfg.faults.lose_state_percent.max(30)))
    });
    let op = fault(
        world,
        format!(
            "quorum lost for {} ms{}{}",
            length.as_millis(),
            if broken {
                ", watch streams broken first"
            } else {
                ""
            },
            match restart {
                Some((i, true)) => format!(", arbiter-{i} restarted in it (state dir lost)"),
                Some((i, false)) => format!(", arbiter-{i} restarted in it (state dir kept)"),
                None => String::new(),
            }
        ),
    );
    // What every arbiter's hold count must have seen: the holds as the loss
    // begins; with the watches broken first, those of them already held
    // at the break (ADR-04's residue: a hold granted after the break, with
    // no probe answered since, may be unseen).
    let seen = broken.then(|| world.holders_now());
    if broken {
        // The hold counts read again after a second: most losses begin
        // before they have.
        world.memlog.break_watches();
        tokio::time::sleep(Duration::from_millis(rng.below(1200))).await;
    }
    let mut holders = world.holders_now();
    if let Some(seen) = seen {
        holders.retain(|key, session| seen.get(key) == Some(session));
    }
    world.memlog.lose_quorum();
    lock(&world.memory).lost_quorum(holders);
    match restart {
        Some((i, lose)) => {
            let before = length / 2;
            tokio::time::sleep(before).await;
            world.kill_arbiter(i).await;
            tokio::time::sleep(length - before).await;
            world.memlog.regain_quorum();
            world.start_arbiter(i, lose, rng.next_u64()).await;
        }
        None => {
            tokio::time::sleep(length).await;
            world.memlog.regain_quorum();
        }
    }
    done(world, op);
}

/// Two operators' force-releases, every 0.1–0.5 s beside the nemesis's
/// faults: each hold is read through the log (its lease and revision: what
/// the request names), then, a moment later (the key may have been
/// released, handed over or granted again meanwhile), ended through an
/// arbiter's table. A forced end is recorded as an `expire` of the hold it
/// named, for the process the hold was granted to: `ok` when it ended that
/// hold, `fail` when the hold had changed (nothing ended), `unknown` when
/// the log did not answer. Only holds whose grant was answered with a
/// token, on the session it was granted to, are named (the history knows
/// whose they are).
///
/// [`FaultKnobs::force_releases_reread`](super::FaultKnobs::force_releases_reread)
/// names the hold as it is right before the end instead, while the history
/// records the one approved: a forced end of whatever holds the key now,
/// the bug the request's lease and revision guard against.
pub(crate) async fn operators(world: Arc<World>, mut rng: Rng) {
    let world = world.as_ref();
    let rng = &mut rng;
    // Warm up, as the nemesis does.
    if !pause(world, Duration::from_secs(2)).await {
        return;
    }
    loop {
        if !pause(world, Duration::from_millis(100 + rng.below(400))).await {
            return;
        }
        let Some(arbiter) = world.any(rng) else {
            return;
        };
        let key = world.cfg.key(rng.below(world.cfg.keys.max(1) as u64));
        // The key's cluster as this arbiter routes it (its shard's, with
        // shards), and the log that cluster is.
        let table = match &arbiter.owner {
            Some(owner) => match owner.cluster_of(&key).await {
                Ok(cluster) => cluster.table().clone(),
                Err(_) => continue,
            },
            None => arbiter.table.clone(),
        };
        let Some(epoch) = table.seal().guard().state().map(|s| s.epoch()) else {
            continue;
        };
        // The lock cluster's epoch as this arbiter knows it (the key's,
        // without shards): what the revocation packs the holds there with.
        let home_epoch = arbiter.table.seal().guard().state().map(|s| s.epoch());
        let log: Arc<dyn LockLog> = world.idlog_of(&key).clone();
        let read = tokio::select! {
            biased;
            () = arbiter.killed.cancelled() => None,
            r = log.holder(&key) => r.ok().and_then(|a| a.value),
        };
        let Some(hold) = read else {
            continue;
        };
        let Some(token) = latchkey_arbiter::token::pack(epoch, hold.mod_revision) else {
            continue;
        };
        let Some((process, session)) = lock(&world.granted_to).get(&(key.clone(), token)).cloned()
        else {
            continue;
        };
        if session != hold.lease {
            continue;
        }
        let op = world.invoke(
            &process,
            Function::Expire,
            Some(&key),
            Some(token),
            Some("force-release".into()),
            Instant::now(),
        );
        // The second operator approves a moment after the request.
        if !pause(world, Duration::from_millis(rng.below(60))).await {
            world.complete(op, Outcome::Unknown, None, None, None);
            return;
        }
        let Some(ender) = world.any(rng) else {
            world.complete(op, Outcome::Unknown, None, None, None);
            return;
        };
        let (mut lease, mut revision) = (hold.lease, hold.mod_revision);
        if world.cfg.faults.force_releases_reread
            && let Ok(answer) = log.holder(&key).await
            && let Some(now) = answer.value
        {
            (lease, revision) = (now.lease, now.mod_revision);
        }
        let records = ForceRecords {
            unchanged: Vec::new(),
            put: vec![(format!("sys/force/sim-{token}"), b"forced".to_vec())],
            ttl_seconds: 60,
            delete: Vec::new(),
        };
        let txn = ForceEndTxn {
            key: &key,
            lease,
            revision,
            records: &records,
        };
        // Through the key's owner, as the approval does, when the run has
        // the whole arbiter.
        let end = async {
            match &ender.owner {
                Some(owner) => match owner.cluster_of(&key).await {
                    Ok(cluster) => cluster.owner().force_end(txn).await,
                    Err(e) => Err(e),
                },
                None => ender.table.force_end(txn).await,
            }
        };
        let ended = tokio::select! {
            biased;
            () = ender.killed.cancelled() => None,
            r = end => Some(r),
        };
        let (outcome, detail) = match ended {
            Some(Ok((ForceEnded::Ended, _))) => (Outcome::Ok, "ended"),
            Some(Ok((ForceEnded::HoldChanged { .. }, _))) => (Outcome::Fail, "hold changed"),
            Some(Ok((ForceEnded::RecordsChanged, _))) => (Outcome::Fail, "records changed"),
            Some(Err(_)) | None => (Outcome::Unknown, "no answer"),
        };
        world.complete(op, outcome, None, None, Some(detail.into()));
        if outcome == Outcome::Ok {
            lock(&world.forced).ended += 1;
        } else if outcome == Outcome::Fail {
            lock(&world.forced).changed += 1;
        }
        if outcome == Outcome::Ok && rng.chance(world.cfg.faults.force_revokes_percent) {
            // a separate call, a moment after the forced end
            if !pause(world, Duration::from_millis(rng.below(100))).await {
                return;
            }
            let mut session = lease;
            if world.cfg.faults.force_revokes_reread
                && let Ok(answer) = log.holder(&key).await
                && let Some(now) = answer.value
            {
                session = now.lease;
            }
            revoke_session(world, &ender, lease, session, home_epoch, &key, &process).await;
        }
    }
}

/// The approval's revocation of the holder's session (`approved`), right
/// after its forced end of `key`: every hold still on that session whose
/// grant the history knows (on every shard) is recorded as an `expire`
/// first (`ok` once the session ended, `fail` when it had ended before,
/// `unknown` without an answer), then the session is revoked as the
/// approval revokes it: with the whole arbiter by its admin path (the
/// session's home cluster, its count, its shadows on other shards ended),
/// else through the table's log. `session` is the one revoked: the approved
/// one, but for [`FaultKnobs::force_revokes_reread`].
///
/// [`FaultKnobs::force_revokes_reread`]: super::FaultKnobs::force_revokes_reread
async fn revoke_session(
    world: &World,
    ender: &Arbiter,
    approved: i64,
    session: i64,
    home_epoch: Option<u32>,
    key: &str,
    process: &str,
) {
    let mut ops = Vec::new();
    for (n, idlog) in world.idlogs().into_iter().enumerate() {
        // The lock cluster's holds at the epoch the operator saw; another
        // shard's at its own (the nemesis never advances one).
        let epoch = match n {
            0 => home_epoch,
            _ => world.shards.get(n - 1).and_then(|s| s.epoch()),
        };
        let Some(epoch) = epoch else { continue };
        let log: Arc<dyn LockLog> = idlog.clone();
        let holds = tokio::select! {
            biased;
            () = ender.killed.cancelled() => return,
            r = log.holders_under("") => match r {
                Ok(answer) => answer.value,
                Err(_) => return,
            },
        };
        for (key, kv) in holds.iter().filter(|(_, kv)| kv.lease == approved) {
            let Some(token) = latchkey_arbiter::token::pack(epoch, kv.mod_revision) else {
                continue;
            };
            let Some((process, granted)) =
                lock(&world.granted_to).get(&(key.clone(), token)).cloned()
            else {
                continue;
            };
            if granted != approved {
                continue;
            }
            ops.push(world.invoke(
                &process,
                Function::Expire,
                Some(key),
                Some(token),
                Some("session revoked".into()),
                Instant::now(),
            ));
        }
    }
    lock(&world.memory).revoking(session);
    let marker = format!("revoked by the sim's operators: {session}");
    let record = RevokeRecord {
        session,
        key: key.to_string(),
        request_id: format!("sim-{session}"),
        requested_by: "sim-operator-a".into(),
        approved_by: "sim-operator-b".into(),
        reason: marker.clone(),
        holder_identity: holder_identity(process),
        revoked_at_unix_ms: 0,
    };
    let txn = RevokeSessionTxn {
        session,
        counted_as: "",
        marker: marker.as_bytes(),
        marker_ttl_seconds: 60,
    };
    let revoke = async {
        match &ender.service {
            Some(service) => match service.revoke_approved_session(&record).await {
                Ok(revoked) => revoked,
                Err(e) => Err(StoreError::unavailable(e.to_string())),
            },
            None => ender.table.log().revoke_session(txn).await,
        }
    };
    let revoked = tokio::select! {
        biased;
        () = ender.killed.cancelled() => None,
        r = revoke => Some(r),
    };
    let outcome = match revoked {
        Some(Ok(SessionRevoked::Revoked | SessionRevoked::RecordGone)) => {
            lock(&world.forced).revoked += 1;
            Outcome::Ok
        }
        Some(Ok(SessionRevoked::Ended)) => Outcome::Fail,
        // no answer: the lease still there says nothing was revoked
        Some(Err(_)) | None if world.session_log(session).lease_alive(session) => Outcome::Fail,
        Some(Err(_)) | None => Outcome::Unknown,
    };
    if outcome == Outcome::Fail {
        // Not this revocation's doing: a lease that ends early from now on
        // is the renewal bug the write judge looks for.
        lock(&world.memory).not_revoked(session);
    }
    for op in ops {
        world.complete(op, outcome, None, None, Some("session revoked".into()));
    }
}

/// The SPIFFE ID of the worker a history process (`w{index}.{incarnation}`)
/// is: what the approval records as the holder (the session count's
/// subject is the one it revokes as).
fn holder_identity(process: &str) -> String {
    let index = process
        .strip_prefix('w')
        .and_then(|p| p.split('.').next())
        .and_then(|i| i.parse().ok())
        .unwrap_or(0);
    super::policies::identity(index)
}

/// Every lease renewal fails for one TTL and 1–5 s more, the rest of the
/// log answering: every session expires unless its client fenced first
/// (the renewals' answers must not outlive the lease).
pub(super) async fn renewal_outage(world: &World, rng: &mut Rng) {
    let length = Duration::from_secs(u64::from(world.cfg.ttl_seconds))
        + Duration::from_millis(1000 + rng.below(4000));
    let op = fault(
        world,
        format!("lease renewals fail for {} ms", length.as_millis()),
    );
    world.memlog.fail_renewals(true);
    tokio::time::sleep(length).await;
    world.memlog.fail_renewals(false);
    done(world, op);
}
