//! `latchctl classes to-crd | from-crd | check` on a copy of the repository's
//! dev policies: files -> LockClass/LockGrant manifests -> files, each form
//! checked with the loader's rules and reviewed the same way.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_policies::{Date, PolicySet};
use tokio::process::Command;
use tokio::time::timeout;

async fn latchctl<I, S>(args: I) -> anyhow::Result<Output>
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    // No endpoint or certificates needed: these never dial.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_latchctl-under-test"));
    cmd.env_clear().args(args).kill_on_drop(true);
    timeout(Duration::from_secs(30), cmd.output())
        .await
        .context("latchctl did not finish in 30 s")?
        .context("latchctl did not run")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        std::fs::copy(entry.path(), to.join(entry.file_name()))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_classes_converts_policies_to_crds_and_back_and_checks_both() -> anyhow::Result<()>
{
    let policies = latchkey_tests::dev_policies()?;
    let expected = PolicySet::load_dir(policies, Date::today_utc())?;
    let work = tempfile::tempdir()?;
    let manifests = work.path().join("manifests");
    std::fs::create_dir(&manifests)?;
    // Pause-test results sit beside the manifests, as in a class repository.
    copy_dir(
        &policies.join("pause-tests"),
        &manifests.join("pause-tests"),
    )?;

    let reviewed = latchctl(["classes".as_ref(), "check".as_ref(), policies.as_os_str()]).await?;
    ensure!(
        reviewed.status.success(),
        "check files: {}",
        text(&reviewed.stderr)
    );

    // Files -> manifests, to stdout and to a file: the same YAML.
    let yaml = latchctl(["classes".as_ref(), "to-crd".as_ref(), policies.as_os_str()]).await?;
    ensure!(yaml.status.success(), "to-crd: {}", text(&yaml.stderr));
    let manifest = manifests.join("policy.yaml");
    let written = latchctl([
        "classes".as_ref(),
        "to-crd".as_ref(),
        policies.as_os_str(),
        "--out".as_ref(),
        manifest.as_os_str(),
    ])
    .await?;
    ensure!(
        written.status.success(),
        "to-crd --out: {}",
        text(&written.stderr)
    );
    assert_eq!(std::fs::read(&manifest)?, yaml.stdout);
    let stdout = text(&yaml.stdout);
    assert_eq!(
        stdout.matches("\nkind: LockClass\n").count(),
        expected.classes().len(),
        "{stdout}"
    );
    assert!(stdout.contains("\nkind: LockGrant\n"), "{stdout}");

    // Manifests (a file, or their directory) review exactly like the files.
    for path in [&manifest, &manifests] {
        let out = latchctl(["classes".as_ref(), "check".as_ref(), path.as_os_str()]).await?;
        ensure!(
            out.status.success(),
            "check manifests: {}",
            text(&out.stderr)
        );
        assert_eq!(text(&out.stdout), text(&reviewed.stdout));
    }

    // Manifests -> files: the loader reads the same policy back.
    let converted = work.path().join("converted");
    let out = latchctl([
        "classes".as_ref(),
        "from-crd".as_ref(),
        manifest.as_os_str(),
        "--out".as_ref(),
        converted.as_os_str(),
    ])
    .await?;
    ensure!(out.status.success(), "from-crd: {}", text(&out.stderr));
    copy_dir(
        &policies.join("pause-tests"),
        &converted.join("pause-tests"),
    )?;
    assert_eq!(
        PolicySet::load_dir(&converted, Date::today_utc())?,
        expected
    );
    let out = latchctl(["classes".as_ref(), "check".as_ref(), converted.as_os_str()]).await?;
    ensure!(
        out.status.success(),
        "check converted: {}",
        text(&out.stderr)
    );
    assert_eq!(text(&out.stdout), text(&reviewed.stdout));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn latchctl_classes_refuses_a_bad_manifest_with_the_loaders_message() -> anyhow::Result<()> {
    let policies = latchkey_tests::dev_policies()?;
    let work = tempfile::tempdir()?;
    let yaml = latchctl(["classes".as_ref(), "to-crd".as_ref(), policies.as_os_str()]).await?;
    ensure!(yaml.status.success(), "to-crd: {}", text(&yaml.stderr));
    // payments-ledger is the only class with ttlSeconds 10.
    let bad = text(&yaml.stdout).replace("ttlSeconds: 10\n", "ttlSeconds: 400\n");
    let manifest = work.path().join("bad.yaml");
    std::fs::write(&manifest, bad)?;

    let root = ["--policy-root".as_ref(), policies.as_os_str()];
    let out = latchctl(
        ["classes".as_ref(), "check".as_ref(), manifest.as_os_str()]
            .into_iter()
            .chain(root),
    )
    .await?;
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains(
            "(LockClass latchkey/payments-ledger): lock class \"payments-ledger\": ttlSeconds = 400 \
             is outside the platform range 5..=300"
        ),
        "{stderr}"
    );
    let out = latchctl(
        [
            "--json".as_ref(),
            "classes".as_ref(),
            "check".as_ref(),
            manifest.as_os_str(),
        ]
        .into_iter()
        .chain(root),
    )
    .await?;
    assert_eq!(out.status.code(), Some(1));
    let value: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(value["ok"], false);
    assert!(
        value["error"]
            .as_str()
            .unwrap_or_default()
            .contains("ttlSeconds = 400")
    );

    // from-crd writes nothing for a refused manifest.
    let converted = work.path().join("converted");
    let out = latchctl([
        "classes".as_ref(),
        "from-crd".as_ref(),
        manifest.as_os_str(),
        "--out".as_ref(),
        converted.as_os_str(),
    ])
    .await?;
    assert_eq!(out.status.code(), Some(1));
    assert!(!converted.exists());
    Ok(())
}

/// ADR-24's delivery: the arbiter's policy directory is a directory of
/// LockClass/LockGrant manifests (what Argo CD syncs into a ConfigMap). The
/// arbiter serves them, picks up a reviewed change, and refuses a change
/// that breaks a loader rule whole, keeping the last good set.
#[tokio::test(flavor = "multi_thread")]
async fn the_arbiter_serves_a_directory_of_manifests_and_reloads_it() -> anyhow::Result<()> {
    use latchkey_tests::arbiter::ArbiterOptions;
    use tonic::Code;

    use crate::support::{open, release, stack_with, try_lock};

    let policies = latchkey_tests::dev_policies()?;
    let work = tempfile::tempdir()?;
    let manifests = work.path().join("manifests");
    std::fs::create_dir(&manifests)?;
    copy_dir(
        &policies.join("pause-tests"),
        &manifests.join("pause-tests"),
    )?;
    let yaml =
        latchkey_crds::policy_dir_to_yaml(policies, "latchkey", std::time::SystemTime::now())?;
    let file = manifests.join("policies.yaml");
    std::fs::write(&file, &yaml)?;

    let s = stack_with(ArbiterOptions {
        policies_dir: manifests.clone(),
        ..ArbiterOptions::default()
    })
    .await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let grant = try_lock(&mut alice, "demo/crd", "demo", session).await?;
    release(&mut alice, &grant).await?;
    let mut mallory = s.arbiter.lock("workload/mallory").await?;
    let hers = open(&mut mallory, "demo").await?;
    let refused = try_lock(&mut mallory, "demo/crd/1", "demo", hers)
        .await
        .err()
        .context("mallory has no grant on demo/crd yet")?;
    ensure!(refused.code() == Code::PermissionDenied, "{refused:?}");

    // A reviewed change: mallory's LockGrant gains demo/crd.
    let granted = yaml.replacen(
        "  identity: spiffe://dev.latchkey/workload/mallory\n  operator: false\n  prefixes:\n  - mallory\n",
        "  identity: spiffe://dev.latchkey/workload/mallory\n  operator: false\n  prefixes:\n  - mallory\n  - demo/crd\n",
        1,
    );
    ensure!(granted != yaml, "mallory's LockGrant not found in:\n{yaml}");
    std::fs::write(&file, &granted)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let theirs = loop {
        match try_lock(&mut mallory, "demo/crd/1", "demo", hers).await {
            Ok(g) => break g,
            Err(e) if e.code() == Code::PermissionDenied => {
                ensure!(
                    tokio::time::Instant::now() < deadline,
                    "the changed LockGrant did not take effect"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    release(&mut mallory, &theirs).await?;

    // A change that breaks a loader rule (a TTL below the platform's floor)
    // is refused whole: mallory keeps her new grant, nothing else moves.
    let broken = format!(
        "{granted}---\napiVersion: latchkey.dev/v1alpha1\nkind: LockClass\nmetadata:\n  name: too-short\n  namespace: latchkey\nspec:\n  ttlSeconds: 1\n  enforcement: advisory\n  riskOwner: team-a\n  waiverExpires: \"2099-01-01\"\n"
    );
    std::fs::write(&file, broken)?;
    // Wait until the arbiter has read the change and refused it (its admin
    // status reports why), then check nothing moved.
    let mut operator = s.arbiter.admin("latchkey/operator").await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = operator
            .get_status(latchkey_proto::adminv1::GetStatusRequest::default())
            .await?
            .into_inner();
        if !status.policy_error.is_empty() {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the broken change was not refused"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let still = try_lock(&mut mallory, "demo/crd/2", "demo", hers).await?;
    release(&mut mallory, &still).await?;
    let unknown = open(&mut alice, "too-short").await.err();
    ensure!(
        unknown.is_some(),
        "a class from a refused change was served"
    );
    s.arbiter.stop().await
}
