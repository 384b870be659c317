//! `latchctl elect`, `observe`, `leader` and `candidates`: leader elections
//! from a shell, like `etcdctl elect`. `elect` runs a command while this
//! process leads, with the token and the term in its environment; the
//! human output never shows a token, and no command here prints one.

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use latchkey_client::{CampaignOptions, Client, ElectionEvent, Leader, Reason};
use latchkey_proto::text::Shown;
use serde_json::json;
use tokio::process::Command;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;

use super::hold::{exit_code, forward, stop};
use super::inspect::utc;
use super::{Failure, Output, duration};
use nix::sys::signal::Signal;

/// What `latchctl elect --help` says after the options.
const ELECT_AFTER_HELP: &str = "\
The command runs only while this process leads NAME, with LATCHKEY_ELECTION,
LATCHKEY_TERM, LATCHKEY_TOKEN (the fencing token: present it at every
resource the leader writes to) and LATCHKEY_SESSION in its environment.
Ctrl-C and SIGTERM are forwarded to it.

When the command exits, latchctl resigns (the next candidate leads at once)
and exits with the command's status.

When the leadership is lost while the command runs (the session's fence
deadline passes without a successful keepalive, the arbiter expires the
session, or another term starts or the election is vacated), latchctl sends
the command SIGTERM, then SIGKILL 2 s later, and exits 7 (LOST). Like etcdctl
elect, it does not campaign again: run it under a supervisor (or use the
client library's Client::lead, which re-campaigns) to stand again.

Until it leads, latchctl stands as a candidate; without --wait it waits for
as long as it takes.";

#[derive(Debug, Args)]
pub struct ElectArgs {
    /// The election, e.g. `jobs/scheduler` (authorised like a lock key).
    pub name: String,
    /// The election class (kind = "election"): fixes the TTL and the rules.
    #[arg(long, default_value = "election")]
    pub class: String,
    /// What observers see while this process leads (an address, a pod name).
    #[arg(long, default_value = "")]
    pub value: String,
    /// Higher leads first on a vacancy; first come first served within a
    /// priority.
    #[arg(long, default_value_t = 0)]
    pub priority: u32,
    /// Give up (exit 4, WAIT_TIMEOUT) unless leading within this long.
    #[arg(long, value_parser = duration::parse, value_name = "DURATION")]
    pub wait: Option<Duration>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, num_args = 1.., value_name = "COMMAND")]
    pub command: Vec<String>,
}

pub fn elect_after_help() -> &'static str {
    ELECT_AFTER_HELP
}

#[derive(Debug, Args)]
pub struct ObserveArgs {
    /// The election.
    pub name: String,
    /// Replay from this term's start where the arbiter still can (what it
    /// cannot is one gap line first); 0: from the current state on.
    #[arg(long, default_value_t = 0, value_name = "TERM")]
    pub from_term: u64,
}

#[derive(Debug, Args)]
pub struct LeaderArgs {
    /// The election.
    pub name: String,
}

#[derive(Debug, Args)]
pub struct CandidatesArgs {
    /// The election.
    pub name: String,
}

pub async fn elect(client: Client, args: ElectArgs, out: Output) -> Result<ExitCode, Failure> {
    let Some((program, program_args)) = args.command.split_first() else {
        return Err(Failure::Usage("elect needs a command after --".into()));
    };
    let session = client.open_session(&args.class).await?;
    out.note(
        json!({ "event": "campaigning", "election": args.name, "session_id": session.id() }),
        format_args!(
            "latchctl: campaigning for {} (session {})",
            Shown(&args.name),
            session.id()
        ),
    );
    let give_up = args.wait.map(|wait| Instant::now() + wait);
    let campaigning = async {
        loop {
            let options = CampaignOptions {
                priority: args.priority,
                wait: give_up.map(|at| at.saturating_duration_since(Instant::now())),
                session: Some(session.clone()),
            };
            match client
                .campaign(
                    args.name.as_str(),
                    args.class.as_str(),
                    args.value.as_str(),
                    options,
                )
                .await
            {
                // The arbiter's longest wait ran out: stand again.
                Err(err) if err.reason() == Reason::WaitTimeout && give_up.is_none() => {}
                result => return result,
            }
        }
    };
    let mut interrupt = signal(SignalKind::interrupt()).map_err(anyhow::Error::from)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(anyhow::Error::from)?;
    let leadership = tokio::select! {
        led = campaigning => match led {
            Ok(leadership) => leadership,
            Err(err) => {
                let _ = session.close().await;
                return Err(err.into());
            }
        },
        // Closing the session ends the candidacy with it.
        _ = interrupt.recv() => {
            let _ = session.close().await;
            return Ok(ExitCode::from(130));
        }
        _ = terminate.recv() => {
            let _ = session.close().await;
            return Ok(ExitCode::from(143));
        }
    };
    let term = leadership.term();
    // stdout belongs to the command: our messages go to stderr.
    out.note(
        json!({ "event": "leading", "election": args.name, "term": term, "session_id": session.id() }),
        format_args!(
            "latchctl: leading {} (term {term}, session {}); running {program}",
            Shown(&args.name),
            session.id()
        ),
    );

    let mut child = Command::new(program)
        .args(program_args)
        .env("LATCHKEY_ELECTION", &args.name)
        .env("LATCHKEY_TERM", term.to_string())
        .env("LATCHKEY_TOKEN", leadership.token().get().to_string())
        .env("LATCHKEY_SESSION", leadership.session_id().to_string())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| Failure::Other(anyhow::anyhow!("cannot run {program}: {e}")))?;

    let lost = leadership.lost();
    tokio::pin!(lost);
    let outcome = loop {
        tokio::select! {
            status = child.wait() => break Ok(status.map_err(anyhow::Error::from)?),
            reason = &mut lost => break Err(reason),
            // The command decides how to stop; we resign when it has.
            _ = interrupt.recv() => forward(&child, Signal::SIGINT),
            _ = terminate.recv() => forward(&child, Signal::SIGTERM),
        }
    };

    match outcome {
        Ok(status) => {
            let code = exit_code(status);
            match leadership.resign().await {
                Ok(next) => out.note(
                    json!({
                        "event": "resigned",
                        "election": args.name,
                        "term": term,
                        "status": code,
                        "next": next.as_ref().map(leader_json),
                    }),
                    format_args!(
                        "latchctl: resigned {} (term {term}){}",
                        Shown(&args.name),
                        match &next {
                            Some(next) => format!("; term {} is {}'s", next.term, Shown(&next.identity)),
                            None => String::new(),
                        }
                    ),
                ),
                Err(e) => out.note(
                    json!({ "event": "resign_failed", "election": args.name, "term": term, "error": e.to_string() }),
                    format_args!(
                        "latchctl: resigning {} failed ({}); it ends with the session",
                        Shown(&args.name),
                        Shown(&e.to_string())
                    ),
                ),
            }
            let _ = session.close().await;
            Ok(ExitCode::from(code))
        }
        Err(reason) => {
            out.note(
                json!({ "event": "lost", "election": args.name, "term": term, "reason": reason.to_string() }),
                format_args!(
                    "latchctl: leadership of {} lost ({reason}); stopping {program}",
                    Shown(&args.name)
                ),
            );
            stop(&mut child).await;
            let _ = session.close().await;
            Err(Failure::Lost(format!(
                "leadership of {} (term {term}) lost: {reason}; {program} was stopped",
                args.name
            )))
        }
    }
}

fn leader_json(leader: &Leader) -> serde_json::Value {
    json!({
        "identity": leader.identity,
        "value": leader.value,
        "term": leader.term,
        "since_unix_ms": leader.since_unix_ms,
        "priority": leader.priority,
    })
}

/// One event as a JSON line (never a token or a revision).
fn event_json(election: &str, event: &ElectionEvent) -> serde_json::Value {
    match event {
        ElectionEvent::TermStarted { leader } => json!({
            "event": "term_started",
            "election": election,
            "term": leader.term,
            "identity": leader.identity,
            "value": leader.value,
            "priority": leader.priority,
            "since_unix_ms": leader.since_unix_ms,
        }),
        ElectionEvent::Proclaimed { term, value } => json!({
            "event": "proclaimed",
            "election": election,
            "term": term,
            "value": value,
        }),
        ElectionEvent::Vacant { term, reason } => json!({
            "event": "vacant",
            "election": election,
            "term": term,
            "reason": reason.as_str(),
        }),
        ElectionEvent::Gap { from_term, to_term } => json!({
            "event": "gap",
            "election": election,
            "from_term": from_term,
            "to_term": to_term,
        }),
        ElectionEvent::TransferRequested { term, priority } => json!({
            "event": "transfer_requested",
            "election": election,
            "term": term,
            "priority": priority,
        }),
        _ => json!({ "event": "unknown", "election": election }),
    }
}

/// One event as a line for a person; other people's text is [`Shown`].
fn event_line(event: &ElectionEvent) -> String {
    match event {
        ElectionEvent::TermStarted { leader } => format!(
            "term {} started: {} leads with \"{}\" (priority {}, since {})",
            leader.term,
            Shown(&leader.identity),
            Shown(&leader.value),
            leader.priority,
            utc(leader.since_unix_ms)
        ),
        ElectionEvent::Proclaimed { term, value } => {
            format!("term {term} proclaimed \"{}\"", Shown(value))
        }
        ElectionEvent::Vacant { term: 0, reason } => format!("vacant ({reason})"),
        ElectionEvent::Vacant { term, reason } => format!("vacant after term {term}: {reason}"),
        ElectionEvent::Gap { from_term, to_term } => {
            format!("gap: the events of terms {from_term} to {to_term} were missed")
        }
        ElectionEvent::TransferRequested { term, priority } => {
            format!("term {term} asked to yield: a candidate of priority {priority} stands")
        }
        _ => "an event of a kind this latchctl does not know".to_owned(),
    }
}

pub async fn observe(client: Client, args: ObserveArgs, out: Output) -> Result<ExitCode, Failure> {
    let mut events = client.observe(&args.name, args.from_term).await?;
    loop {
        let next = tokio::select! {
            next = events.next_event() => next,
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
        };
        match next {
            Some(Ok(event)) => {
                if out.json {
                    out.line(event_json(&args.name, &event));
                } else {
                    println!("{}", event_line(&event));
                }
            }
            Some(Err(err)) => return Err(err.into()),
            None => {
                return Err(Failure::Plain(format!(
                    "the arbiter ended the observation of {}; observe again with --from-term {}",
                    args.name,
                    events.last_term()
                )));
            }
        }
    }
}

pub async fn leader(client: Client, args: LeaderArgs, out: Output) -> Result<ExitCode, Failure> {
    let leader = client.leader(&args.name).await?;
    if out.json {
        out.line(json!({ "election": args.name, "leader": leader.as_ref().map(leader_json) }));
        return Ok(ExitCode::SUCCESS);
    }
    match leader {
        None => println!("{} has no leader", Shown(&args.name)),
        Some(l) => {
            println!("election  {}", Shown(&args.name));
            println!("leader    {}", Shown(&l.identity));
            println!("value     {}", Shown(&l.value));
            println!("term      {}", l.term);
            println!("priority  {}", l.priority);
            println!("since     {}", utc(l.since_unix_ms));
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn candidates(
    client: Client,
    args: CandidatesArgs,
    out: Output,
) -> Result<ExitCode, Failure> {
    let candidates = client.candidates(&args.name).await?;
    if out.json {
        out.line(json!({
            "election": args.name,
            "candidates": candidates.iter().map(|c| json!({
                "candidate_id": c.id,
                "identity": c.identity,
                "value": c.value,
                "priority": c.priority,
                "since_unix_ms": c.since_unix_ms,
            })).collect::<Vec<_>>(),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    if candidates.is_empty() {
        println!("{} has no candidates", Shown(&args.name));
        return Ok(ExitCode::SUCCESS);
    }
    // In the order they would lead.
    for c in &candidates {
        println!(
            "{}  priority {}  {}  \"{}\"  since {}",
            c.id,
            c.priority,
            Shown(&c.identity),
            Shown(&c.value),
            utc(c.since_unix_ms)
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_client::VacancyReason;

    fn leader() -> Leader {
        Leader {
            identity: "spiffe://t/a".into(),
            value: "pod\u{1b}[2J".into(),
            term: 9,
            since_unix_ms: 0,
            priority: 1,
        }
    }

    #[test]
    fn event_lines_escape_other_peoples_text() {
        let line = event_line(&ElectionEvent::TermStarted { leader: leader() });
        assert!(!line.contains('\u{1b}'), "{line}");
        assert!(
            line.starts_with("term 9 started: spiffe://t/a leads"),
            "{line}"
        );
        let vacant = event_line(&ElectionEvent::Vacant {
            term: 9,
            reason: VacancyReason::Resigned,
        });
        assert_eq!(vacant, "vacant after term 9: the leader resigned");
    }

    #[test]
    fn event_json_names_the_event_and_never_a_token() {
        let started = event_json("e", &ElectionEvent::TermStarted { leader: leader() });
        assert_eq!(started["event"], "term_started");
        assert_eq!(started["term"], 9);
        assert!(started.get("token").is_none() && started.get("revision").is_none());
        let vacant = event_json(
            "e",
            &ElectionEvent::Vacant {
                term: 9,
                reason: VacancyReason::SessionEnded,
            },
        );
        assert_eq!(vacant["reason"], "session_ended");
    }
}
