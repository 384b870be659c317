//! latchctl's command line: take, hold and inspect Latchkey locks from a
//! shell, run a command as an election's leader and watch elections, check
//! lock classes, make dev certificates, and run the operator calls. It lives in the library so that the `latchctl` binary and the e2e
//! tests' copy of it (`latchctl-under-test`) are the same code.
//!
//! Errors print as `latchctl: <gRPC code>: <REASON>: <message>` on stderr,
//! followed by a line saying to retry when the refusal is temporary (e.g.
//! the edge's `POLICY_NOT_READY`), or what to check when the TLS setup is
//! wrong; with `--json`, as one JSON object on stderr. The exit status says
//! which kind of failure it was ([`status`], docs/operations.md).

mod acquire;
mod admin;
mod audit;
mod certs;
mod classes;
mod duration;
mod elect;
mod hold;
mod inspect;
mod pause_test;
mod shards;

use std::fmt;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use latchkey_client::{Client, ClientConfig, TlsFiles};
use latchkey_proto::text::Shown;

#[derive(Debug, Parser)]
#[command(
    name = "latchctl",
    version,
    about = "Latchkey distributed locks and leader elections from the command line"
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
struct Global {
    /// The edge: the Envoy sidecar in front of the arbiter (workloads and
    /// operators call through it; dev-up's listens on 127.0.0.1:8443).
    #[arg(
        long,
        global = true,
        env = "LATCHKEY_ENDPOINT",
        default_value = "https://127.0.0.1:8443"
    )]
    endpoint: String,
    /// Trust bundle (PEM).
    #[arg(long, global = true, env = "LATCHKEY_CA")]
    ca: Option<PathBuf>,
    /// This workload's X.509 SVID (PEM chain).
    #[arg(long, global = true, env = "LATCHKEY_CERT")]
    cert: Option<PathBuf>,
    /// The SVID's private key (PEM).
    #[arg(long = "key", id = "tls_key", global = true, env = "LATCHKEY_KEY")]
    key: Option<PathBuf>,
    /// Name to check the server certificate against (default: localhost).
    #[arg(long, global = true, env = "LATCHKEY_TLS_DOMAIN")]
    tls_domain: Option<String>,
    /// Dev mode: plain HTTP/2 (an http:// endpoint) and this SPIFFE ID in a
    /// header. Only an arbiter started with --insecure-dev honours it.
    #[arg(
        long,
        global = true,
        env = "LATCHKEY_INSECURE_DEV_IDENTITY",
        value_name = "SPIFFE_ID"
    )]
    insecure_dev_identity: Option<String>,
    /// Machine-readable output (one JSON object per line).
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Acquire a key and keep it until Ctrl-C or end of input (or --detach).
    Acquire(acquire::AcquireArgs),
    /// Release a grant by its session and token (e.g. after acquire --detach).
    Release(acquire::ReleaseArgs),
    /// Run a command while holding a key; it gets LATCHKEY_TOKEN in its env.
    Hold(hold::HoldArgs),
    /// Show who holds a key.
    Inspect(inspect::InspectArgs),
    /// Run a command while leading an election (like etcdctl elect); it
    /// gets LATCHKEY_TOKEN and LATCHKEY_TERM in its env and is stopped if
    /// the leadership is lost.
    #[command(after_help = elect::elect_after_help())]
    Elect(elect::ElectArgs),
    /// Print an election's term starts, proclamations and vacancies as they
    /// happen, one line each (never a token).
    Observe(elect::ObserveArgs),
    /// Show who leads an election, with its value and term.
    Leader(elect::LeaderArgs),
    /// List an election's candidates in the order they would lead.
    Candidates(elect::CandidatesArgs),
    /// A key's or an election's history from the audit store (grants,
    /// releases, expiries, hand-overs, force-releases, epoch changes; an
    /// election's term starts, proclamations and vacancies).
    Audit(audit::AuditArgs),
    /// Who holds a key, how many wait, and its last audit events.
    Why(audit::WhyArgs),
    /// Lock class policy files.
    #[command(subcommand)]
    Classes(classes::ClassesCommand),
    /// Write a dev CA and SVIDs for a trust domain.
    DevCerts(certs::DevCertsArgs),
    /// Operator calls.
    #[command(subcommand)]
    Admin(admin::AdminCommand),
    /// Prove a resource is fenced: freeze a holder past its TTL, let a second
    /// holder write, resume the first and check its write is rejected.
    PauseTest(pause_test::PauseTestArgs),
    /// pause-test's first holder (run by pause-test itself).
    #[command(hide = true)]
    PauseTestHolder(pause_test::HolderArgs),
}

/// latchctl's exit statuses: what a script can tell apart without reading
/// stderr (docs/operations.md, "latchctl's exit statuses"). `hold` and
/// `elect` exit with their command's status when it ran to its end.
pub mod status {
    /// Anything not below (an unexpected answer, a local error).
    pub const FAILURE: u8 = 1;
    /// The command line or the configuration it names is wrong.
    pub const USAGE: u8 = 2;
    /// The key is held (a try-lock, or LEAK: held by this identity's
    /// other session).
    pub const HELD: u8 = 3;
    /// The wait (`--wait`) or the call's deadline ran out.
    pub const TIMED_OUT: u8 = 4;
    /// Refused for good: not authorised, a bad key or class, a hook said
    /// no, a session or hold that is not the caller's or not there.
    pub const REFUSED: u8 = 5;
    /// Temporary: the arbiter, the edge or etcd could not serve it now;
    /// retrying later may work.
    pub const UNAVAILABLE: u8 = 6;
    /// The lock or leadership was lost while the command ran (it was
    /// stopped), or the session was fenced.
    pub const LOST: u8 = 7;
    /// The TLS setup cannot work (the CA, the server name, the SVID or its
    /// key): fix it, retrying will not help.
    pub const TLS: u8 = 8;
}

/// Why latchctl stops with a non-zero status.
pub(crate) enum Failure {
    /// Exit 2.
    Usage(String),
    /// A Latchkey call failed; refusals print as `CODE: REASON: message`.
    Lock(latchkey_client::Error),
    /// The lock or leadership was lost while its command ran: printed as
    /// is, exit [`status::LOST`].
    Lost(String),
    /// Printed as is.
    Plain(String),
    Other(anyhow::Error),
}

/// The exit status for a failed Latchkey call.
fn status_of(err: &latchkey_client::Error) -> u8 {
    use latchkey_client::{Code, Error, Reason};
    if err.tls_problem().is_some() {
        return status::TLS;
    }
    match err {
        Error::Config { .. } | Error::ReadFile { .. } => status::USAGE,
        Error::Fenced { .. } | Error::LeadershipLost { .. } => status::LOST,
        Error::Protocol { .. } => status::FAILURE,
        Error::Refused { code, reason, .. } => match (reason, code) {
            (Reason::Held | Reason::Leak, _) => status::HELD,
            (Reason::WaitTimeout, _) | (_, Code::DeadlineExceeded) => status::TIMED_OUT,
            _ if err.retry_hint().is_some() => status::UNAVAILABLE,
            _ => status::REFUSED,
        },
        Error::Transport { .. } => status::UNAVAILABLE,
    }
}

impl From<latchkey_client::Error> for Failure {
    fn from(err: latchkey_client::Error) -> Self {
        Failure::Lock(err)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(err: anyhow::Error) -> Self {
        Failure::Other(err)
    }
}

/// Human or JSON output; JSON goes one object per line.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Output {
    pub json: bool,
}

impl Output {
    pub fn line(&self, value: serde_json::Value) {
        println!("{value}");
    }

    /// A status message on stderr (stdout may belong to someone else).
    pub fn note(&self, value: serde_json::Value, human: fmt::Arguments<'_>) {
        if self.json {
            eprintln!("{value}");
        } else {
            eprintln!("{human}");
        }
    }
}

pub(crate) fn parse_meta(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("{text:?} is not K=V")),
    }
}

async fn connect(global: &Global) -> Result<Client, Failure> {
    let mut config = match (
        &global.insecure_dev_identity,
        &global.ca,
        &global.cert,
        &global.key,
    ) {
        (Some(identity), _, _, _) => ClientConfig::insecure_dev(&global.endpoint, identity),
        (None, Some(ca), Some(cert), Some(key)) => ClientConfig::tls(
            &global.endpoint,
            TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            },
        ),
        (None, ..) => {
            return Err(Failure::Usage(
                "mTLS needs --ca, --cert and --key (or LATCHKEY_CA, LATCHKEY_CERT, LATCHKEY_KEY); \
                 for a dev arbiter use --insecure-dev-identity SPIFFE_ID with an http:// endpoint"
                    .into(),
            ));
        }
    };
    config.tls_domain = global.tls_domain.clone();
    Ok(Client::connect(config).await?)
}

async fn run(cli: Cli) -> Result<ExitCode, Failure> {
    let out = Output {
        json: cli.global.json,
    };
    match cli.command {
        Command::Classes(command) => classes::run(command, out),
        Command::DevCerts(args) => certs::run(args, out),
        Command::Acquire(args) => acquire::acquire(connect(&cli.global).await?, args, out).await,
        Command::Release(args) => acquire::release(connect(&cli.global).await?, args, out).await,
        Command::Hold(args) => hold::hold(connect(&cli.global).await?, args, out).await,
        Command::Inspect(args) => inspect::inspect(connect(&cli.global).await?, args, out).await,
        Command::Elect(args) => elect::elect(connect(&cli.global).await?, args, out).await,
        Command::Observe(args) => elect::observe(connect(&cli.global).await?, args, out).await,
        Command::Leader(args) => elect::leader(connect(&cli.global).await?, args, out).await,
        Command::Candidates(args) => {
            elect::candidates(connect(&cli.global).await?, args, out).await
        }
        Command::Audit(args) => audit::audit(args, out).await,
        Command::Why(args) => audit::why(connect(&cli.global).await?, args, out).await,
        Command::Admin(command) => admin::run(connect(&cli.global).await?, command, out).await,
        Command::PauseTest(args) => pause_test::run(&cli.global, args, out).await,
        Command::PauseTestHolder(args) => pause_test::holder(&cli.global, args).await,
    }
}

/// `a: b: c` down the source chain.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// latchctl with the process's arguments: parses them (exiting 2 on a usage
/// error, as clap does), runs the command and returns its exit code. Needs a
/// Tokio runtime.
pub async fn main() -> ExitCode {
    let cli = Cli::parse();
    // A host process may already have a subscriber; then that one stays.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .try_init();
    let json = cli.global.json;
    match run(cli).await {
        Ok(code) => code,
        Err(failure) => {
            let (status, lines, fields) = described(&failure);
            if json {
                let mut error = serde_json::json!({ "exit": status });
                if let (Some(obj), serde_json::Value::Object(more)) =
                    (error.as_object_mut(), fields)
                {
                    obj.extend(more);
                }
                eprintln!("{}", serde_json::json!({ "error": error }));
            } else {
                for line in lines {
                    eprintln!("latchctl: {line}");
                }
            }
            ExitCode::from(status)
        }
    }
}

/// A failure's exit status, its lines for a person, and its fields for
/// `--json` (`kind`, `message`, and for a call's failure `code`, `reason`,
/// `temporary`, `hint`).
fn described(failure: &Failure) -> (u8, Vec<String>, serde_json::Value) {
    use serde_json::json;
    match failure {
        Failure::Usage(message) => (
            status::USAGE,
            vec![message.clone()],
            json!({ "kind": "usage", "message": message }),
        ),
        // A server's message may quote what someone else wrote: shown with
        // control and format characters escaped (latchkey_proto::text).
        Failure::Lock(err) => {
            let text = Shown(&chain(err)).to_string();
            let tls = err.tls_problem();
            let hint = match (&tls, err.retry_hint()) {
                (Some(_), _) => Some(
                    "the TLS setup is wrong, and retrying will not help: check --ca (it must sign the server's certificate), --tls-domain (a name the server's certificate has), and that --cert and --key are one SVID".to_string(),
                ),
                (None, hint) => hint.map(str::to_string),
            };
            let (code, reason) = match err {
                latchkey_client::Error::Refused {
                    code, wire_reason, ..
                } => (format!("{code:?}"), wire_reason.clone()),
                _ => (String::new(), String::new()),
            };
            let mut lines = vec![text.clone()];
            lines.extend(hint.clone());
            (
                status_of(err),
                lines,
                json!({
                    "kind": "call",
                    "code": code_name(&code),
                    "reason": reason,
                    "message": text,
                    "temporary": err.is_transient(),
                    "hint": hint,
                }),
            )
        }
        Failure::Lost(message) => {
            let text = Shown(message).to_string();
            (
                status::LOST,
                vec![text.clone()],
                json!({ "kind": "lost", "message": text }),
            )
        }
        Failure::Plain(message) => {
            let text = Shown(message).to_string();
            (
                status::FAILURE,
                vec![text.clone()],
                json!({ "kind": "failure", "message": text }),
            )
        }
        Failure::Other(err) => {
            let text = format!("{err:#}");
            (
                status::FAILURE,
                vec![text.clone()],
                json!({ "kind": "failure", "message": text }),
            )
        }
    }
}

/// tonic's `Code` as gRPC spells it (`Unavailable` -> `UNAVAILABLE`).
fn code_name(debug: &str) -> String {
    let mut out = String::new();
    for (i, c) in debug.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_well_formed() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn hold_takes_the_command_after_the_separator() {
        let cli = Cli::try_parse_from([
            "latchctl",
            "hold",
            "jobs/a",
            "--class",
            "jobs",
            "--wait",
            "30s",
            "--",
            "sh",
            "-c",
            "echo $LATCHKEY_TOKEN",
        ]);
        let Ok(Cli {
            command: Command::Hold(args),
            ..
        }) = cli
        else {
            panic!("hold did not parse");
        };
        assert_eq!(args.command, ["sh", "-c", "echo $LATCHKEY_TOKEN"]);
        assert_eq!(args.wait, Some(std::time::Duration::from_secs(30)));
    }

    #[test]
    fn elect_takes_the_command_after_the_separator_and_defaults_its_class() {
        let cli = Cli::try_parse_from([
            "latchctl",
            "elect",
            "jobs/scheduler",
            "--value",
            "pod-a",
            "--priority",
            "3",
            "--",
            "sh",
            "-c",
            "echo $LATCHKEY_TERM",
        ]);
        let Ok(Cli {
            command: Command::Elect(args),
            ..
        }) = cli
        else {
            panic!("elect did not parse");
        };
        assert_eq!(args.class, "election");
        assert_eq!(args.value, "pod-a");
        assert_eq!(args.priority, 3);
        assert_eq!(args.command, ["sh", "-c", "echo $LATCHKEY_TERM"]);
        assert!(
            Cli::try_parse_from(["latchctl", "elect", "jobs/scheduler"]).is_err(),
            "elect needs a command"
        );
    }

    #[test]
    fn elect_help_says_what_happens_on_loss() {
        use clap::CommandFactory;
        let mut cli = Cli::command();
        let help = cli
            .find_subcommand_mut("elect")
            .map(|c| c.render_long_help().to_string())
            .unwrap_or_default();
        assert!(help.contains("SIGTERM"), "{help}");
        assert!(help.contains("does not campaign again"), "{help}");
        assert!(help.contains("LATCHKEY_TERM"), "{help}");
    }

    #[test]
    fn meta_is_k_equals_v() {
        assert_eq!(
            parse_meta("ticket=CHG-1=x"),
            Ok(("ticket".into(), "CHG-1=x".into()))
        );
        assert!(parse_meta("=x").is_err());
        assert!(parse_meta("novalue").is_err());
    }
}
