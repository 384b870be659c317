//! Classes and grants are reloaded from their files while the arbiter runs;
//! a bad change is refused whole and the last good set stays in force.

use std::path::Path;
use std::time::Duration;

use latchkey_proto::adminv1::GetStatusRequest;
use latchkey_tests::arbiter::ArbiterOptions;
use latchkey_tests::{eventually, workspace_root};
use tonic::Code;

use crate::support::*;

fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn policy_files_reload_and_a_bad_change_keeps_the_last_good_set() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    copy_dir(&workspace_root().join("policies/dev"), dir.path())?;
    latchkey_tests::write_pause_test_fixtures(dir.path())?;
    let s = stack_with(ArbiterOptions {
        policies_dir: dir.path().to_path_buf(),
        ..Default::default()
    })
    .await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    expect_refusal(
        open_class(&mut alice, "reports").await,
        Code::InvalidArgument,
        "UNKNOWN_CLASS",
    )?;
    let sa = open(&mut alice, "demo").await?;
    expect_refusal(
        try_lock(&mut alice, "reports/daily", "demo", sa).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;

    // a reviewed change lands: a new class (with its pause test) and a new grant
    let fixture = latchkey_tests::pause_test_fixture("reports", "postgresql:test.reports");
    std::fs::write(
        dir.path().join("pause-tests/reports.json"),
        fixture.to_json_pretty()?,
    )?;
    std::fs::write(
        dir.path().join("classes/reports.toml"),
        "[[class]]\nname = \"reports\"\ntier = \"entity\"\nenforcement = \"fenced\"\nttlSeconds = 20\n\
         [class.pauseTest]\nresource = \"postgresql:test.reports\"\nresult = \"pause-tests/reports.json\"\n",
    )?;
    std::fs::write(
        dir.path().join("grants/reports.toml"),
        "[[grant]]\nidentity = \"spiffe://dev.latchkey/workload/alice\"\nprefixes = [\"reports\"]\n",
    )?;
    eventually("the new class", Duration::from_secs(10), || {
        let mut alice = alice.clone();
        async move { Ok(open_class(&mut alice, "reports").await?) }
    })
    .await?;
    let g = try_lock(&mut alice, "reports/daily", "demo", sa).await?;
    release(&mut alice, &g).await?;

    // a broken change (an advisory class without its risk owner) is refused whole
    std::fs::write(
        dir.path().join("classes/reports.toml"),
        "[[class]]\nname = \"reports\"\ntier = \"entity\"\nenforcement = \"advisory\"\nttlSeconds = 60\n",
    )?;
    std::fs::write(dir.path().join("grants/reports.toml"), "this is not toml")?;
    let mut op = s.arbiter.admin("latchkey/operator").await?;
    let why = eventually(
        "the refusal to be reported",
        Duration::from_secs(10),
        || {
            let mut op = op.clone();
            async move {
                let st = op
                    .get_status(GetStatusRequest::default())
                    .await?
                    .into_inner();
                anyhow::ensure!(!st.policy_error.is_empty(), "no policy error yet");
                Ok(st.policy_error)
            }
        },
    )
    .await?;
    assert!(why.contains("reports"), "the reason names the file: {why}");
    let _ = op.get_status(GetStatusRequest::default()).await?;
    let again = open_class(&mut alice, "reports").await?;
    assert!(again > 0);
    let g = try_lock(&mut alice, "reports/daily", "demo", sa).await?;
    release(&mut alice, &g).await?;
    Ok(())
}
