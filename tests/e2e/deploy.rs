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
