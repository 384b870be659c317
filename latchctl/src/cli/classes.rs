//! `latchctl classes`: checks a policy in either form, policy files or
//! LockClass/LockGrant manifests, printing each class's review line (ADR-11:
//! the cost of the TTL next to the TTL), and converts between the two forms
//! (ADR-24). The rules are the policy loader's and the conversion is
//! latchkey-crds'; this file only parses arguments and prints.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::SystemTime;

use clap::{Args, Subcommand};
use latchkey_crds::{
    DEFAULT_NAMESPACE, ManifestFile, load_either, policy_dir_to_yaml, read_manifest_paths,
    to_policy_texts,
};
use latchkey_policies::{Date, review};
use serde_json::json;

use super::{Failure, Output};

#[derive(Debug, Subcommand)]
pub enum ClassesCommand {
    /// Load and validate a policy directory (classes/ and grants/), or
    /// LockClass/LockGrant manifests (a YAML file or a directory of them).
    Check(CheckArgs),
    /// Convert a policy directory to LockClass/LockGrant manifests
    /// (multi-document YAML), after checking it.
    ToCrd(ToCrdArgs),
    /// Convert LockClass/LockGrant manifests to policy files
    /// (classes/<namespace>.toml, grants/<namespace>.toml), after checking
    /// them with every rule but the pause-test results (see `check`).
    FromCrd(FromCrdArgs),
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// A policy directory, a manifest file, or a directory of manifests.
    #[arg(value_name = "PATH")]
    pub dir: PathBuf,
    /// Expected concurrent sessions, for the keepalive load estimate.
    #[arg(long, default_value_t = 1000)]
    pub sessions: u64,
    /// For manifests: where pause-test results (pauseTest.result) and hook
    /// modules are relative to [default: the manifests' directory].
    #[arg(long, value_name = "DIR")]
    pub policy_root: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ToCrdArgs {
    /// The policy directory (classes/ and grants/).
    pub dir: PathBuf,
    /// Namespace of the objects.
    #[arg(long, default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Write the manifests here instead of to stdout.
    #[arg(long, short)]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct FromCrdArgs {
    /// Manifest files, or directories of *.yaml manifests.
    #[arg(required = true, value_name = "MANIFESTS")]
    pub manifests: Vec<PathBuf>,
    /// The policy directory to write classes/ and grants/ into.
    #[arg(long, short)]
    pub out: PathBuf,
}

pub fn run(command: ClassesCommand, out: Output) -> Result<ExitCode, Failure> {
    match command {
        ClassesCommand::Check(args) => check(args, out),
        ClassesCommand::ToCrd(args) => to_crd(args, out),
        ClassesCommand::FromCrd(args) => from_crd(args, out),
    }
}

/// A refused policy: the error already names the file and the problem.
fn refused(out: Output, message: String) -> Result<ExitCode, Failure> {
    if out.json {
        out.line(json!({ "ok": false, "error": message }));
        return Ok(ExitCode::FAILURE);
    }
    Err(Failure::Plain(message))
}

fn check(args: CheckArgs, out: Output) -> Result<ExitCode, Failure> {
    let set = match load_either(&args.dir, args.policy_root.as_deref(), SystemTime::now()) {
        Ok(set) => set,
        Err(err) => return refused(out, err.to_string()),
    };
    let reports: Vec<_> = set
        .classes()
        .values()
        .map(|class| review(class, args.sessions))
        .collect();
    if out.json {
        out.line(json!({
            "ok": true,
            "classes": reports.iter().map(|r| json!({
                "class": r.class,
                "tier": r.tier.to_string(),
                "namespaces": r.namespaces,
                "enforcement": r.enforcement.to_string(),
                "on_quorum_loss": r.on_quorum_loss.to_string(),
                "ttl_seconds": r.ttl_seconds,
                "expected_sessions": r.expected_sessions,
                "keepalive_interval_ms": r.keepalive_interval_ms,
                "keepalives_per_second": r.keepalives_per_second,
                "liveness_bound_seconds": r.liveness_bound_seconds,
                "fence_deadline_ms": r.fence_deadline_ms,
                "review": r.to_string(),
            })).collect::<Vec<_>>(),
        }));
    } else {
        for report in &reports {
            println!("{report}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn to_crd(args: ToCrdArgs, out: Output) -> Result<ExitCode, Failure> {
    let yaml = match policy_dir_to_yaml(&args.dir, &args.namespace, SystemTime::now()) {
        Ok(yaml) => yaml,
        Err(err) => return refused(out, err.to_string()),
    };
    match &args.out {
        None if out.json => out.line(json!({ "ok": true, "manifests": yaml })),
        None => print!("{yaml}"),
        Some(path) => {
            std::fs::write(path, &yaml)
                .map_err(|e| Failure::Plain(format!("cannot write {}: {e}", path.display())))?;
            out.note(
                json!({ "ok": true, "wrote": path }),
                format_args!("wrote {}", path.display()),
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn from_crd(args: FromCrdArgs, out: Output) -> Result<ExitCode, Failure> {
    let converted = read_manifest_paths(&args.manifests).and_then(|texts| {
        let files: Vec<ManifestFile<'_>> = texts
            .iter()
            .map(|(path, text)| ManifestFile { path, text })
            .collect();
        to_policy_texts(&files, Date::today_utc())?.write_to(&args.out)
    });
    match converted {
        Ok(written) => {
            if out.json {
                out.line(json!({ "ok": true, "wrote": written }));
            } else {
                for path in &written {
                    println!("wrote {}", path.display());
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(err) => refused(out, err.to_string()),
    }
}
