//! Every policy directory in the repository converts to manifests and back
//! to an equal policy model, in both directions and through files.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use latchkey_crds::{
    ManifestFile, Resource, check_manifests, from_policy, load_manifest_dir, parse_manifests,
    policy_dir_to_yaml, to_policy_texts, to_yaml,
};
use latchkey_policies::{Date, PauseTestResult, PolicySet};

/// The repository's policy directories: every directory with a classes/
/// subdirectory under policies/.
fn policy_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("classes").is_dir())
        .collect();
    dirs.sort();
    assert!(
        !dirs.is_empty(),
        "no policy directories under {}",
        root.display()
    );
    dirs
}

fn copy_pause_tests(from: &Path, to: &Path) {
    let src = from.join("pause-tests");
    if let Ok(entries) = std::fs::read_dir(&src) {
        std::fs::create_dir_all(to.join("pause-tests")).unwrap();
        for entry in entries {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), to.join("pause-tests").join(entry.file_name())).unwrap();
        }
    }
}

/// A clock at which the directory's pause-test results are current: the
/// latest result's finish time (or now, without results). The committed
/// results expire after a year (`latchctl classes check policies/dev` in CI
/// says so); this test is about conversion, not about their age.
fn clock_for(dir: &Path) -> SystemTime {
    std::fs::read_dir(dir.join("pause-tests"))
        .into_iter()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path()).ok())
        .filter_map(|text| serde_json::from_str::<PauseTestResult>(&text).ok())
        .map(|result| result.finished_at)
        .max()
        .unwrap_or_else(SystemTime::now)
}

#[test]
fn repo_policies_convert_to_crds_and_back() {
    for dir in policy_dirs() {
        let now = clock_for(&dir);
        let set = PolicySet::load_dir_at(&dir, now).unwrap();
        let resources = from_policy(&set, "latchkey").unwrap();
        assert_eq!(
            resources
                .iter()
                .filter(|r| matches!(r, Resource::Class(_)))
                .count(),
            set.classes().len()
        );
        let text = to_yaml(&resources);
        assert_eq!(policy_dir_to_yaml(&dir, "latchkey", now).unwrap(), text);

        // Manifests parse back to the same objects...
        let path = dir.join("converted.yaml");
        let file = ManifestFile {
            path: &path,
            text: &text,
        };
        assert_eq!(parse_manifests(&[file]).unwrap(), resources);
        // ...and check, pause tests included, to the same model.
        assert_eq!(check_manifests(&[file], Some(&dir), now).unwrap(), set);

        // Manifests -> policy files -> the loader: the same model again.
        let out = tempfile::tempdir().unwrap();
        let texts = to_policy_texts(&[file], Date::from_system_time(now)).unwrap();
        assert_eq!(texts.classes.keys().collect::<Vec<_>>(), ["latchkey"]);
        texts.write_to(out.path()).unwrap();
        copy_pause_tests(&dir, out.path());
        assert_eq!(
            PolicySet::load_dir_at(out.path(), now).unwrap(),
            set,
            "{}",
            dir.display()
        );

        // A directory of manifests loads like a policy directory.
        let manifests = tempfile::tempdir().unwrap();
        std::fs::write(manifests.path().join("policy.yaml"), &text).unwrap();
        copy_pause_tests(&dir, manifests.path());
        assert_eq!(load_manifest_dir(manifests.path(), now).unwrap(), set);
    }
}
