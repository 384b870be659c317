//! `latchctl admin`: operator calls.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use latchkey_client::Client;
use latchkey_proto::adminv1::ForceReleaseRequest;
use latchkey_proto::text::Shown;
use serde_json::json;

use super::{Failure, Output};

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// The arbiter's epoch, cluster ids, seal state and witness.
    Status(StatusArgs),
    /// Unseal after a restore: epoch `expected` -> above every epoch known, deleting every hold.
    AdvanceEpoch(AdvanceArgs),
    /// Two-person force-release of a stuck hold or leadership (ADR-20): one
    /// operator requests, a different one approves. Both sign in with OIDC: the ID
    /// token is read from --id-token-file or LATCHKEY_ID_TOKEN, never from
    /// the command line.
    #[command(subcommand)]
    ForceRelease(ForceReleaseCommand),
    /// The entity tier's shards (ADR-09): status, add a shard, pin a
    /// namespace to a shard, step a move.
    #[command(subcommand)]
    Shards(super::shards::ShardsCommand),
}

#[derive(Debug, Subcommand)]
pub enum ForceReleaseCommand {
    /// Ask for a force-release of KEY's current hold (with --election: of
    /// election KEY's current leadership); prints the request id for the
    /// approver.
    Request(ForceRequestArgs),
    /// Approve request ID (you must not be its requester): the hold (or the
    /// leader's term) ends at once.
    Approve(ForceApproveArgs),
    /// Pending requests (with the holder, class and enforcement an approver
    /// must see) and the force-releases of the last 24 h.
    List(IdTokenArgs),
}

#[derive(Debug, Args)]
pub struct IdTokenArgs {
    /// File holding your OIDC ID token (default: the LATCHKEY_ID_TOKEN
    /// environment variable).
    #[arg(long, value_name = "PATH")]
    pub id_token_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Args)]
pub struct ForceRequestArgs {
    /// The lock key whose hold to end (with --election: the election whose
    /// leadership to end).
    pub key: String,
    /// KEY names an election: end its current leader's term (observers see
    /// a FORCED vacancy; the next candidate leads in a new term). A hold on
    /// a lock key of the same name is not touched, nor the other way round.
    #[arg(long)]
    pub election: bool,
    /// KEY names a semaphore: end the hold in this slot (`latchctl inspect`
    /// lists them).
    #[arg(long, conflicts_with = "election")]
    pub slot: Option<u32>,
    /// KEY is held shared: end this session's shared hold (`latchctl
    /// inspect`, run by an operator, lists shared holders with their
    /// sessions).
    #[arg(long, value_name = "SESSION", conflicts_with_all = ["election", "slot"])]
    pub shared_session: Option<i64>,
    /// Why: shown to the approver and kept in the audit trail.
    #[arg(long)]
    pub reason: String,
    /// Also revoke the holder's (the leader's) whole session (every key it
    /// holds, every election it leads).
    #[arg(long)]
    pub revoke_session: bool,
    #[command(flatten)]
    pub token: IdTokenArgs,
}

#[derive(Debug, Args)]
pub struct ForceApproveArgs {
    /// The request id `request` printed.
    pub id: String,
    /// Approve even though the class is advisory (two writers may follow).
    #[arg(long)]
    pub accept_two_writers: bool,
    #[command(flatten)]
    pub token: IdTokenArgs,
}

/// The ID token: from the file, else from LATCHKEY_ID_TOKEN. Never echoed.
fn id_token(args: &IdTokenArgs) -> Result<String, Failure> {
    let token = match &args.id_token_file {
        Some(path) => std::fs::read_to_string(path).map_err(|e| {
            Failure::Plain(format!(
                "cannot read the ID token file {}: {e}",
                path.display()
            ))
        })?,
        None => std::env::var("LATCHKEY_ID_TOKEN").unwrap_or_default(),
    };
    let token = token.trim().to_string();
    if token.is_empty() {
        return Err(Failure::Usage(
            "force-release needs your OIDC ID token: pass --id-token-file PATH or set LATCHKEY_ID_TOKEN".into(),
        ));
    }
    Ok(token)
}

fn request_json(r: &ForceReleaseRequest) -> serde_json::Value {
    json!({
        "request_id": r.request_id,
        "key": r.key,
        "holder_identity": r.holder_identity,
        "holder_session": r.holder_session,
        "hold_revision": r.hold_revision,
        "class": r.class,
        "enforcement": r.enforcement,
        "warning": r.warning,
        "reason": r.reason,
        "revoke_session": r.revoke_session,
        "requester": r.requester,
        "requester_identity": r.requester_identity,
        "requested_at_unix_ms": r.requested_at_unix_ms,
        "expires_at_unix_ms": r.expires_at_unix_ms,
        "election": r.election,
        "term": r.term,
        "slot": r.slot,
        "shared": r.shared,
    })
}

fn print_request(r: &ForceReleaseRequest) {
    println!("request      {}", Shown(&r.request_id));
    // Everything here but the numbers came from someone else: shown with
    // control and format characters escaped, so no field can redraw the
    // lines the approver reads (latchkey_proto::text).
    if r.election {
        // What ends is a term, not a hold: no revision (a term's is its
        // leader's token's).
        println!("election     {}", Shown(&r.key));
        println!(
            "leader       {} (session {:#x}, term {})",
            Shown(&r.holder_identity),
            r.holder_session,
            r.term
        );
    } else {
        match (r.slot, r.shared) {
            (Some(slot), _) => println!("key          {} (slot {slot})", Shown(&r.key)),
            (None, true) => println!("key          {} (a shared hold)", Shown(&r.key)),
            (None, false) => println!("key          {}", Shown(&r.key)),
        }
        println!(
            "holder       {} (session {:#x}, granted at revision {})",
            Shown(&r.holder_identity),
            r.holder_session,
            r.hold_revision
        );
    }
    println!(
        "class        {} ({})",
        Shown(&r.class),
        Shown(&r.enforcement.to_uppercase())
    );
    println!("reason       {}", Shown(&r.reason));
    println!(
        "requested by {} via {}",
        Shown(&r.requester),
        Shown(&r.requester_identity)
    );
    if r.revoke_session {
        println!("also         revokes the holder's whole session");
    }
    if r.election {
        println!(
            "ends         term {}: observers see it vacated (FORCED) and the next candidate leads",
            r.term
        );
    }
    if !r.warning.is_empty() {
        println!("WARNING      {}", Shown(&r.warning));
    }
}

async fn force_release(
    client: Client,
    command: ForceReleaseCommand,
    out: Output,
) -> Result<ExitCode, Failure> {
    match command {
        ForceReleaseCommand::Request(args) => {
            let token = id_token(&args.token)?;
            let r = match args.election {
                true => {
                    client
                        .request_election_force_release(
                            &args.key,
                            &args.reason,
                            args.revoke_session,
                            &token,
                        )
                        .await?
                }
                false => match args.shared_session {
                    Some(session) => {
                        client
                            .request_force_release_shared(
                                &args.key,
                                session,
                                &args.reason,
                                args.revoke_session,
                                &token,
                            )
                            .await?
                    }
                    None => {
                        client
                            .request_force_release_in(
                                &args.key,
                                args.slot,
                                &args.reason,
                                args.revoke_session,
                                &token,
                            )
                            .await?
                    }
                },
            };
            if out.json {
                out.line(request_json(&r));
            } else {
                print_request(&r);
                println!(
                    "a different operator approves it with: latchctl admin force-release approve {}",
                    r.request_id
                );
            }
        }
        ForceReleaseCommand::Approve(args) => {
            let token = id_token(&args.token)?;
            // Show the approver what they approve, and stop on an advisory
            // class unless they said they accept two writers.
            let listed = client.list_force_releases(&token).await?;
            let Some(pending) = listed
                .pending
                .iter()
                .find(|r| r.request_id == args.id.trim())
            else {
                return Err(Failure::Plain(format!(
                    "no pending force-release request {:?} (approved already, expired, or never made); see `latchctl admin force-release list`",
                    args.id
                )));
            };
            if !out.json {
                print_request(pending);
            }
            if pending.enforcement != "fenced" && !args.accept_two_writers {
                return Err(Failure::Plain(format!(
                    "not approved: {} Pass --accept-two-writers to approve anyway.",
                    Shown(&pending.warning)
                )));
            }
            let r = client.approve_force_release(args.id.trim(), &token).await?;
            if out.json {
                out.line(json!({
                    "request": r.request.as_ref().map(request_json),
                    "approver": r.approver,
                    "approved_at_unix_ms": r.approved_at_unix_ms,
                    "revision": r.revision,
                    "session_revoked": r.session_revoked,
                    "session_revoke_error": r.session_revoke_error,
                }));
            } else {
                println!(
                    "force-released at revision {} (approved by {})",
                    r.revision,
                    Shown(&r.approver)
                );
                if r.session_revoked {
                    println!("the holder's session was revoked");
                } else if !r.session_revoke_error.is_empty() {
                    println!(
                        "the holder's session was NOT revoked: {}",
                        Shown(&r.session_revoke_error)
                    );
                }
            }
        }
        ForceReleaseCommand::List(args) => {
            let token = id_token(&args)?;
            let r = client.list_force_releases(&token).await?;
            if out.json {
                for p in &r.pending {
                    out.line(json!({"pending": request_json(p)}));
                }
                for d in &r.done {
                    out.line(json!({"done": {
                        "id": d.id,
                        "key": d.key,
                        "holder_identity": d.holder_identity,
                        "holder_session": d.holder_session,
                        "hold_revision": d.hold_revision,
                        "class": d.class,
                        "enforcement": d.enforcement,
                        "reason": d.reason,
                        "requester": d.requester,
                        "approver": d.approver,
                        "requested_at_unix_ms": d.requested_at_unix_ms,
                        "approved_at_unix_ms": d.approved_at_unix_ms,
                        "revoke_session": d.revoke_session,
                        "election": d.election,
                        "term": d.term,
                    }}));
                }
            } else {
                if r.pending.is_empty() {
                    println!("no pending force-release requests");
                }
                for p in &r.pending {
                    print_request(p);
                    println!();
                }
                for d in &r.done {
                    let what = match d.election {
                        true => format!("election {} term {} led by", Shown(&d.key), d.term),
                        false => format!("{} held by", Shown(&d.key)),
                    };
                    println!(
                        "done {} {what} {} ({}): requested by {}, approved by {}: {}",
                        Shown(&d.id),
                        Shown(&d.holder_identity),
                        Shown(&d.enforcement),
                        Shown(&d.requester),
                        Shown(&d.approver),
                        Shown(&d.reason)
                    );
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Which tier's cluster (ADR-07): entity (the default) or coord, when
    /// the arbiter runs with --split-tiers.
    #[arg(long, value_name = "TIER")]
    pub tier: Option<String>,
}

#[derive(Debug, Args)]
pub struct AdvanceArgs {
    /// Which tier's cluster to advance: entity (the default) or coord, when
    /// the arbiter runs with --split-tiers.
    #[arg(long, value_name = "TIER")]
    pub tier: Option<String>,
    /// The epoch the arbiter is at now (see `admin status`).
    #[arg(long)]
    pub expected: u32,
    /// Why; stored with the new epoch record.
    #[arg(long)]
    pub reason: String,
    /// The new epoch is at least this. Only needed after restoring BOTH the
    /// lock and the coord cluster from backups older than the serving epoch:
    /// pass one above the highest epoch in any token your fenced resources
    /// stored (token >> 48).
    #[arg(long, default_value_t = 0)]
    pub at_least: u32,
}

pub async fn run(client: Client, command: AdminCommand, out: Output) -> Result<ExitCode, Failure> {
    match command {
        AdminCommand::ForceRelease(command) => return force_release(client, command, out).await,
        AdminCommand::Status(args) => {
            let s = client
                .admin_status_of(args.tier.as_deref().unwrap_or(""))
                .await?;
            if out.json {
                out.line(json!({
                    "tier": s.tier,
                    "tiers_split": s.tiers_split,
                    "epoch": s.epoch,
                    "epoch_cluster_id": s.epoch_cluster_id,
                    "current_cluster_id": s.current_cluster_id,
                    "sealed": s.sealed,
                    "seal_reason": s.seal_reason,
                    "revision_high_water_mark": s.revision_high_water_mark,
                    "witness": s.witness,
                    "witnessed_revision": s.witnessed_revision,
                    "witnessed_mark_epoch": s.witnessed_mark_epoch,
                    "witnessed_epoch": s.witnessed_epoch,
                    "coord_seen_revision": s.coord_seen_revision,
                    "coord_seen_mark_epoch": s.coord_seen_mark_epoch,
                    "coord_seen_epoch": s.coord_seen_epoch,
                    "quorum_lost": s.quorum_lost,
                    "quorum_lost_for_ms": s.quorum_lost_for_ms,
                    "quorum_last_error": s.quorum_last_error,
                    "unprotected_memory_grants": s.unprotected_memory_grants,
                    "quorum_loss_spool_bytes": s.quorum_loss_spool_bytes,
                    "quorum_loss_spool_limit_bytes": s.quorum_loss_spool_limit_bytes,
                }));
            } else {
                if s.tiers_split {
                    println!("tier                 {} (tiers split)", s.tier);
                }
                println!("epoch                {}", s.epoch);
                println!("epoch cluster id     {:#018x}", s.epoch_cluster_id);
                println!("current cluster id   {:#018x}", s.current_cluster_id);
                println!("revision high-water  {}", s.revision_high_water_mark);
                // An arbiter from before issue 15 sends no witness.
                let witness = if s.witness.is_empty() {
                    "unknown (the arbiter does not say)"
                } else {
                    s.witness.as_str()
                };
                println!("witness              {witness}");
                if s.witnessed_revision != 0 || s.witnessed_epoch != 0 {
                    println!(
                        "witnessed grant      e{}:r{}",
                        s.witnessed_mark_epoch, s.witnessed_revision
                    );
                    println!("witnessed epoch      {}", s.witnessed_epoch);
                }
                // The other direction: the lock cluster's record of the
                // coord cluster, which reveals a restore of the coord cluster.
                if s.coord_seen_revision != 0 || s.coord_seen_epoch != 0 {
                    println!(
                        "coord cluster, as the lock cluster recorded it: grant e{}:r{}, epoch {}",
                        s.coord_seen_mark_epoch, s.coord_seen_revision, s.coord_seen_epoch
                    );
                }
                if s.sealed {
                    println!("sealed               YES: {}", Shown(&s.seal_reason));
                } else {
                    println!("sealed               no");
                }
                if s.quorum_lost {
                    println!(
                        "quorum               LOST for {} s ({}): closed classes refuse, open classes grant unprotected",
                        s.quorum_lost_for_ms / 1000,
                        Shown(&s.quorum_last_error)
                    );
                } else {
                    println!("quorum               yes");
                }
                if s.unprotected_memory_grants > 0 || s.quorum_loss_spool_bytes > 0 {
                    println!(
                        "unprotected grants   {} live; spool {} of {} bytes (for the audit tailer)",
                        s.unprotected_memory_grants,
                        s.quorum_loss_spool_bytes,
                        s.quorum_loss_spool_limit_bytes
                    );
                }
            }
        }
        AdminCommand::Shards(command) => super::shards::run(client, command, &out).await?,
        AdminCommand::AdvanceEpoch(args) => {
            let tier = args.tier.as_deref().unwrap_or("");
            let r = client
                .advance_epoch_in(tier, args.expected, &args.reason, args.at_least)
                .await?;
            if out.json {
                out.line(json!({
                    "epoch": r.epoch,
                    "cluster_id": r.cluster_id,
                    "holds_deleted": r.holds_deleted,
                }));
            } else {
                println!(
                    "epoch advanced to {} (cluster {:#018x}); {} holds deleted",
                    r.epoch, r.cluster_id, r.holds_deleted
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
