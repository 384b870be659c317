//! deploy/'s Deployments use only flags the real binaries have (issue 20): the
//! rendered overlays' `--flag`s against `--help` of the arbiter and the audit
//! tailer built here (`arbiter-under-test` and `audit-under-test` are the same
//! CLIs as `latchkey-arbiter` and `latchkey-audit`). Everything else about
//! deploy/ is checked in `latchkey_tests::deploy`.

use std::process::Command;

use anyhow::Context;
use latchkey_tests::deploy::{documents, find, help_flags, long_flags, overlays, render};

fn help(binary: &str) -> anyhow::Result<String> {
    let out = Command::new(binary)
        .arg("--help")
        .output()
        .with_context(|| format!("{binary} --help"))?;
    anyhow::ensure!(out.status.success(), "{binary} --help failed");
    Ok(String::from_utf8(out.stdout)?)
}

#[test]
fn every_flag_in_the_deployments_is_one_the_binaries_have() -> anyhow::Result<()> {
    let arbiter = help_flags(&help(env!("CARGO_BIN_EXE_arbiter-under-test"))?);
    let audit = help_flags(&help(env!("CARGO_BIN_EXE_audit-under-test"))?);
    assert!(arbiter.contains("--edge-identity"), "{arbiter:?}");
    assert!(audit.contains("--compaction-window"), "{audit:?}");
    for overlay in overlays()? {
        let docs = documents(&render(&overlay)?)?;
        for (name, known) in [("latchkey-arbiter", &arbiter), ("latchkey-audit", &audit)] {
            let flags = long_flags(find(&docs, "Deployment", name)?);
            assert!(flags.len() >= 5, "{overlay}: {name}: {flags:?}");
            for flag in flags {
                assert!(
                    known.contains(&flag),
                    "{overlay}: {name} uses {flag}, which `--help` does not list: {known:?}"
                );
            }
        }
    }
    Ok(())
}

/// Issue 31, finding 8: dev-up's OIDC provider is a mock that lets anyone
/// create operator users, so one person can request and approve a
/// force-release there. Nothing in deploy/ may run that way: no overlay
/// ships a mock provider, and an overlay that turns force-release on names
/// an https issuer that is not on loopback, and requires a second factor.
#[test]
fn no_overlay_runs_force_release_against_a_mock_or_loopback_provider() -> anyhow::Result<()> {
    let overlays = overlays()?;
    assert!(!overlays.is_empty());
    for overlay in overlays {
        let rendered = render(&overlay)?;
        let lower = rendered.to_ascii_lowercase();
        for mock in [
            "oidc-provider-mock",
            "oidc_provider_mock",
            "mock-oauth2",
            "mockoidc",
        ] {
            assert!(
                !lower.contains(mock),
                "{overlay}: ships a mock OIDC provider ({mock})"
            );
        }
        for doc in documents(&rendered)? {
            let items: Vec<&str> = doc
                .text
                .lines()
                .filter_map(|l| l.trim().strip_prefix("- "))
                .map(|i| i.trim_matches('"'))
                .collect();
            for (i, item) in items.iter().enumerate() {
                let issuer = match item.strip_prefix("--oidc-issuer") {
                    Some(rest) if rest.starts_with('=') => rest[1..].to_string(),
                    Some("") => items.get(i + 1).map(|s| s.to_string()).unwrap_or_default(),
                    _ => continue,
                };
                assert!(
                    issuer.starts_with("https://")
                        && !["https://127.", "https://localhost", "https://[::1]"]
                            .iter()
                            .any(|p| issuer.starts_with(p)),
                    "{overlay}: {} {}: --oidc-issuer {issuer:?} must be an https provider off this host",
                    doc.kind,
                    doc.name
                );
                assert!(
                    items.contains(&"--oidc-require-mfa"),
                    "{overlay}: {} {}: force-release on without --oidc-require-mfa",
                    doc.kind,
                    doc.name
                );
            }
        }
    }
    Ok(())
}
