//! The policy directory: every class and grant file, loaded and checked as
//! one set, so a bad change is refused whole and the last good set stays in
//! service (ADR-24).
//!
//! ```text
//! <dir>/classes/*.toml   one or more [[class]] tables per file
//! <dir>/grants/*.toml    [[grant]] and [[operator]] tables
//! <dir>/pause-tests/     pause-test results named by fenced classes (by convention)
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::class::{self, LockClass, ReviewReport, Tier};
use crate::date::Date;
use crate::error::PolicyError;
use crate::fnv::Fnv1a;
use crate::grants::{self, PrefixGrants};
use crate::key::LockKey;

/// Subdirectory holding class files.
pub const CLASSES_DIR: &str = "classes";
/// Subdirectory holding grant files.
pub const GRANTS_DIR: &str = "grants";

/// A validated, complete policy: classes by name, the compiled grant table,
/// the identities with the operator role, and the key namespaces the coord
/// tier serves.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySet {
    classes: BTreeMap<String, LockClass>,
    grants: PrefixGrants,
    operators: BTreeSet<String>,
    /// The union of every coord-tier class's `namespaces` (ADR-07). Two
    /// coord classes may list the same one: both are on the coord cluster.
    coord_namespaces: BTreeSet<String>,
}

/// One policy file's text and the path to name in errors. Lets callers that
/// cannot read files (the Wasm filter gets its policy from plugin
/// configuration) build a [`PolicySet`] the same way [`PolicySet::load_dir`]
/// does.
#[derive(Debug, Clone, Copy)]
pub struct PolicyFile<'a> {
    pub path: &'a Path,
    pub text: &'a str,
}

/// Where fenced classes' pause-test results are read from, and when.
#[derive(Clone, Copy)]
struct PauseTests<'a> {
    dir: &'a Path,
    now: SystemTime,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClassFile {
    #[serde(default)]
    class: Vec<LockClass>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantFile {
    #[serde(default)]
    grant: Vec<GrantTable>,
    #[serde(default)]
    operator: Vec<OperatorTable>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantTable {
    identity: String,
    prefixes: Vec<String>,
    /// The classes the prefixes are granted for (absent: any class).
    #[serde(default)]
    classes: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OperatorTable {
    identity: String,
}

impl PolicySet {
    /// Loads `dir/classes/*.toml` and `dir/grants/*.toml`, in file-name
    /// order, and validates everything: waivers against `today`, and each
    /// fenced class's pause-test result (ADR-17, read relative to `dir`)
    /// against the system clock. [`PolicySet::load_dir_at`] takes one clock
    /// for both.
    ///
    /// Files whose names start with `.` are skipped (editor swap files,
    /// Kubernetes' `..data` links); symlinks are followed. Both
    /// subdirectories must exist; `grants/` may be empty, `classes/` may not.
    #[cfg(not(all(target_arch = "wasm32", target_os = "unknown")))]
    pub fn load_dir(dir: &Path, today: Date) -> Result<PolicySet, PolicyError> {
        PolicySet::load(dir, today, SystemTime::now())
    }

    /// [`PolicySet::load_dir`] at `now`: waivers are checked against its UTC
    /// date, pause-test results against the instant.
    pub fn load_dir_at(dir: &Path, now: SystemTime) -> Result<PolicySet, PolicyError> {
        PolicySet::load(dir, Date::from_system_time(now), now)
    }

    fn load(dir: &Path, today: Date, now: SystemTime) -> Result<PolicySet, PolicyError> {
        let classes_dir = dir.join(CLASSES_DIR);
        let grants_dir = dir.join(GRANTS_DIR);
        let class_texts = read_all(&classes_dir)?;
        let grant_texts = read_all(&grants_dir)?;
        let set = PolicySet::build(
            &classes_dir,
            &as_files(&class_texts),
            &as_files(&grant_texts),
            today,
            Some(PauseTests { dir, now }),
        )?;
        tracing::debug!(
            dir = %dir.display(),
            classes = set.classes.len(),
            grants = set.grants.len(),
            grants_version = set.grants.version(),
            operators = set.operators.len(),
            coord_namespaces = set.coord_namespaces.len(),
            "loaded policy directory"
        );
        Ok(set)
    }

    /// Builds a set from file texts already in memory, with the same rules
    /// as [`PolicySet::load_dir`] except one: pause-test results are files
    /// beside the policy, so they are not read, and a fenced class is taken
    /// as the policy directory's loader (the arbiter) already checked it.
    /// For callers that receive a reviewed set rather than review one (the
    /// Envoy filter); never the place a class becomes fenced. `classes` must
    /// not be empty.
    pub fn from_files(
        classes: &[PolicyFile<'_>],
        grants: &[PolicyFile<'_>],
        today: Date,
    ) -> Result<PolicySet, PolicyError> {
        PolicySet::build(Path::new(CLASSES_DIR), classes, grants, today, None)
    }

    fn build(
        classes_dir: &Path,
        class_files: &[PolicyFile<'_>],
        grant_files: &[PolicyFile<'_>],
        today: Date,
        pause_tests: Option<PauseTests<'_>>,
    ) -> Result<PolicySet, PolicyError> {
        if class_files.is_empty() {
            return Err(PolicyError::NoClasses {
                dir: classes_dir.to_path_buf(),
            });
        }

        // Name -> (class, file it came from), to name both files on a clash.
        let mut classes: BTreeMap<String, (LockClass, &Path)> = BTreeMap::new();
        for file in class_files {
            let parsed: ClassFile = toml::from_str(file.text)
                .map_err(|source| PolicyError::Toml { source }.in_file(file.path))?;
            if parsed.class.is_empty() {
                return Err(PolicyError::EmptyClassFile.in_file(file.path));
            }
            for class in parsed.class {
                class.validate(today).map_err(|e| e.in_file(file.path))?;
                if let Some(PauseTests { dir, now }) = pause_tests {
                    class
                        .check_pause_test(dir, now)
                        .map_err(|e| e.in_file(file.path))?;
                }
                if let Some((_, first)) = classes.get(&class.name) {
                    return Err(PolicyError::DuplicateClass {
                        name: class.name,
                        first: first.to_path_buf(),
                        second: file.path.to_path_buf(),
                    });
                }
                classes.insert(class.name.clone(), (class, file.path));
            }
        }

        let mut grants = PrefixGrants::builder();
        let mut operators = BTreeSet::new();
        for file in grant_files {
            let parsed: GrantFile = toml::from_str(file.text)
                .map_err(|source| PolicyError::Toml { source }.in_file(file.path))?;
            for grant in &parsed.grant {
                for class in grant.classes.iter().flatten() {
                    if !classes.contains_key(class) {
                        return Err(PolicyError::GrantUnknownClass {
                            identity: crate::key::excerpt(&grant.identity),
                            class: crate::key::excerpt(class),
                        }
                        .in_file(file.path));
                    }
                }
                grants
                    .grant_for(&grant.identity, &grant.prefixes, grant.classes.as_deref())
                    .map_err(|e| e.in_file(file.path))?;
            }
            for operator in &parsed.operator {
                let identity = grants::canonical_identity(&operator.identity)
                    .map_err(|e| e.in_file(file.path))?;
                operators.insert(identity);
            }
        }

        // Validation keeps namespaces to coord-tier classes; the filter is
        // there so this union never depends on it.
        let coord_namespaces = classes
            .values()
            .filter(|(class, _)| class.tier == Tier::Coord)
            .flat_map(|(class, _)| class.namespaces.iter().cloned())
            .collect();

        Ok(PolicySet {
            classes: classes
                .into_iter()
                .map(|(name, (class, _))| (name, class))
                .collect(),
            grants: grants.build(),
            operators,
            coord_namespaces,
        })
    }

    pub fn class(&self, name: &str) -> Option<&LockClass> {
        self.classes.get(name)
    }

    /// All classes, by name.
    pub fn classes(&self) -> &BTreeMap<String, LockClass> {
        &self.classes
    }

    pub fn grants(&self) -> &PrefixGrants {
        &self.grants
    }

    /// Shorthand for [`PrefixGrants::authorise`].
    pub fn authorise(&self, identity: &str, key: &LockKey) -> Option<&str> {
        self.grants.authorise(identity, key)
    }

    /// Which tier serves `key` (ADR-07): [`Tier::Coord`] when its namespace
    /// (first segment) is listed by a coord-tier class, [`Tier::Entity`]
    /// otherwise. The key decides, not the class: a caller picks the class
    /// per call, and the same key on both clusters would be a double grant.
    pub fn tier_of_key(&self, key: &LockKey) -> Tier {
        if self.coord_namespaces.contains(key.namespace()) {
            Tier::Coord
        } else {
            Tier::Entity
        }
    }

    /// The key namespaces the coord tier serves: the union of every
    /// coord-tier class's `namespaces`, sorted, each once.
    pub fn coord_namespaces(&self) -> impl Iterator<Item = &str> {
        self.coord_namespaces.iter().map(String::as_str)
    }

    /// Whether `identity` (canonical SPIFFE ID text) has the operator role
    /// for the admin API.
    pub fn is_operator(&self, identity: &str) -> bool {
        self.operators.contains(identity)
    }

    /// Operator identities, canonical, sorted.
    pub fn operators(&self) -> &BTreeSet<String> {
        &self.operators
    }

    /// The review line for every class, in name order, at
    /// `expected_sessions` sessions each.
    pub fn review(&self, expected_sessions: u64) -> Vec<ReviewReport> {
        self.classes
            .values()
            .map(|c| class::review(c, expected_sessions))
            .collect()
    }
}

/// A cheap change detector for a policy directory: a hash over each
/// `classes/*.toml` and `grants/*.toml` file's relative path, size,
/// modification time and contents, in name order, and over each pause-test
/// result those classes name (or its absence), so a result that appears,
/// is renewed or goes bad is a change too. Poll it and reload when it
/// changes; take it *before* loading, so a change during the load is seen
/// on the next poll.
pub fn fingerprint(dir: &Path) -> io::Result<u64> {
    let mut hash = Fnv1a::new();
    let mut results = BTreeSet::new();
    for sub in [CLASSES_DIR, GRANTS_DIR] {
        let sub_dir = dir.join(sub);
        for path in toml_files(&sub_dir).map_err(|e| with_path(e, &sub_dir))? {
            let contents = fs::read(&path).map_err(|e| with_path(e, &path))?;
            if sub == CLASSES_DIR {
                results.extend(named_results(&contents));
            }
            hash_file(&mut hash, dir, &path, &contents)?;
        }
    }
    // Only paths the load would accept: the fingerprint reads nothing else.
    let inside = |r: &String| {
        Path::new(r)
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
    };
    for result in results.into_iter().filter(inside) {
        let path = dir.join(&result);
        match fs::read(&path) {
            Ok(contents) => hash_file(&mut hash, dir, &path, &contents)?,
            Err(_) => {
                hash.write_field(result.as_bytes());
                hash.write_field(b"(absent)");
            }
        }
    }
    Ok(hash.finish())
}

fn hash_file(hash: &mut Fnv1a, dir: &Path, path: &Path, contents: &[u8]) -> io::Result<()> {
    let meta = fs::metadata(path).map_err(|e| with_path(e, path))?;
    let mtime_nanos = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let mut contents_hash = Fnv1a::new();
    contents_hash.write(contents);

    let relative = path.strip_prefix(dir).unwrap_or(path);
    hash.write_field(relative.to_string_lossy().as_bytes());
    hash.write_u64(meta.len());
    hash.write(&mtime_nanos.to_le_bytes());
    hash.write_u64(contents_hash.finish());
    Ok(())
}

/// The `pauseTest.result` paths a class file names, read leniently: a file
/// that does not parse names none here, and the load reports it.
fn named_results(contents: &[u8]) -> Vec<String> {
    #[derive(Deserialize)]
    struct Classes {
        #[serde(default)]
        class: Vec<Class>,
    }
    #[derive(Deserialize)]
    struct Class {
        #[serde(default, rename = "pauseTest")]
        pause_test: Option<Spec>,
    }
    #[derive(Deserialize)]
    struct Spec {
        result: String,
    }
    std::str::from_utf8(contents)
        .ok()
        .and_then(|text| toml::from_str::<Classes>(text).ok())
        .map(|file| {
            file.class
                .into_iter()
                .filter_map(|c| c.pause_test.map(|p| p.result))
                .collect()
        })
        .unwrap_or_default()
}

/// `e` with the path it is about in its message; `e` stays its source.
fn with_path(e: io::Error, path: &Path) -> io::Error {
    let kind = e.kind();
    io::Error::new(
        kind,
        AtPath {
            path: path.to_path_buf(),
            source: e,
        },
    )
}

#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
struct AtPath {
    path: PathBuf,
    source: io::Error,
}

/// The `*.toml` regular files directly in `dir`, sorted, skipping dotfiles.
fn toml_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        let is_toml = path.extension().is_some_and(|ext| ext == "toml");
        // fs::metadata follows symlinks, as mounted ConfigMaps need.
        if !hidden && is_toml && fs::metadata(&path)?.is_file() {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

fn as_files(texts: &[(PathBuf, String)]) -> Vec<PolicyFile<'_>> {
    texts
        .iter()
        .map(|(path, text)| PolicyFile { path, text })
        .collect()
}

fn read_all(dir: &Path) -> Result<Vec<(PathBuf, String)>, PolicyError> {
    let files = toml_files(dir).map_err(|source| PolicyError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    files
        .into_iter()
        .map(|path| match fs::read_to_string(&path) {
            Ok(text) => Ok((path, text)),
            Err(source) => Err(PolicyError::Io { path, source }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::class::{Enforcement, Tier};
    use crate::pause_test::{PauseTestEvidence, PauseTestOutcome, PauseTestResult, WriteOutcome};
    use std::time::Duration;

    const DAY: Duration = Duration::from_secs(86_400);
    const RESOURCE: &str = "postgresql:test.rows";

    fn today() -> Date {
        Date::parse("2026-01-15").unwrap()
    }

    /// Noon on `today()`: the clock the loads in these tests run at.
    fn now() -> SystemTime {
        humantime::parse_rfc3339("2026-01-15T12:00:00Z").unwrap()
    }

    const DEMO_CLASS: &str = r#"
[[class]]
name = "demo"
tier = "coord"
enforcement = "fenced"
[class.pauseTest]
resource = "postgresql:test.rows"
result = "pause-tests/demo.json"
"#;

    const ALICE_GRANT: &str = r#"
[[grant]]
identity = "spiffe://td/workload/alice"
prefixes = ["demo", "shared/"]

[[operator]]
identity = "spiffe://td/latchkey/operator"
"#;

    /// A fenced class whose pause test is at `pause-tests/<name>.json`.
    fn fenced_class(name: &str) -> String {
        format!(
            "[[class]]\nname = \"{name}\"\ntier = \"entity\"\nenforcement = \"fenced\"\n\
             [class.pauseTest]\nresource = \"{RESOURCE}\"\nresult = \"pause-tests/{name}.json\"\n"
        )
    }

    /// A passing result for `class` against [`RESOURCE`], finished a day before `now()`.
    fn passing(class: &str) -> PauseTestResult {
        let finished = now() - DAY;
        PauseTestResult {
            version: 1,
            class: class.into(),
            resource: RESOURCE.into(),
            resource_schema_version: None,
            started_at: finished - Duration::from_secs(21),
            finished_at: finished,
            outcome: PauseTestOutcome::Pass,
            kit: "unit test fixture (not evidence)".into(),
            evidence: PauseTestEvidence {
                ttl_seconds: 10,
                paused_for_ms: 12_400,
                first_write: WriteOutcome::Accepted,
                second_holder_write: WriteOutcome::Accepted,
                second_token_greater: true,
                stale_write_after_resume: WriteOutcome::Rejected,
                final_row_from: "second-holder".into(),
                stale_proclaim_after_resume: None,
            },
            failure: None,
            store: None,
        }
    }

    fn json(result: &PauseTestResult) -> String {
        result.to_json_pretty().unwrap()
    }

    /// A policy directory in a temp dir, from (relative path, text) pairs;
    /// `demo`'s passing pause test is always there.
    fn policy_dir<S: AsRef<str>>(files: &[(&str, S)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join(CLASSES_DIR)).unwrap();
        fs::create_dir(dir.path().join(GRANTS_DIR)).unwrap();
        fs::create_dir(dir.path().join("pause-tests")).unwrap();
        fs::write(
            dir.path().join("pause-tests/demo.json"),
            json(&passing("demo")),
        )
        .unwrap();
        for (path, text) in files {
            let path = dir.path().join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text.as_ref()).unwrap();
        }
        dir
    }

    fn load_err<S: AsRef<str>>(files: &[(&str, S)]) -> String {
        let dir = policy_dir(files);
        PolicySet::load_dir_at(dir.path(), now())
            .unwrap_err()
            .to_string()
    }

    /// A copy of `dev/` with a fixture result for each fenced class, since
    /// the real results are produced by the kit against a real resource.
    fn dev_copy_with_fixtures() -> tempfile::TempDir {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("dev");
        let dir = policy_dir::<&str>(&[]);
        for sub in [CLASSES_DIR, GRANTS_DIR] {
            for path in toml_files(&src.join(sub)).unwrap() {
                fs::copy(&path, dir.path().join(sub).join(path.file_name().unwrap())).unwrap();
            }
        }
        let classes = read_all(&dir.path().join(CLASSES_DIR)).unwrap();
        let set = PolicySet::from_files(&as_files(&classes), &[], Date::today_utc()).unwrap();
        for class in set.classes().values() {
            if let Some(spec) = &class.pause_test {
                let result = PauseTestResult {
                    class: class.name.clone(),
                    resource: spec.resource.clone(),
                    resource_schema_version: spec.schema_version.clone(),
                    finished_at: SystemTime::now() - DAY,
                    started_at: SystemTime::now() - DAY,
                    ..passing("")
                };
                fs::write(dir.path().join(&spec.result), json(&result)).unwrap();
            }
        }
        dir
    }

    /// ADR-04 at load: a fenced class may not stay open on quorum loss; the
    /// refusal names the file and the fix, and the set is refused whole.
    #[test]
    fn the_loader_refuses_open_on_quorum_loss_for_a_fenced_class() {
        let fenced_open = "[[class]]\nname = \"demo\"\ntier = \"coord\"\nenforcement = \"fenced\"\n\
            onQuorumLoss = \"open\"\n[class.pauseTest]\nresource = \"postgresql:t.rows\"\n\
            result = \"pause-tests/demo.json\"\n";
        let err = load_err(&[("classes/a.toml", fenced_open)]);
        assert!(err.contains("a.toml"), "{err}");
        assert!(
            err.contains("onQuorumLoss = \"open\" is not allowed for a fenced class")
                && err.contains("use onQuorumLoss = \"closed\""),
            "{err}"
        );
        // Open on an advisory class loads; a class that does not say is closed.
        let advisory_open = "[[class]]\nname = \"warm\"\ntier = \"entity\"\nenforcement = \"advisory\"\n\
            ttlSeconds = 60\nonQuorumLoss = \"open\"\nriskOwner = \"t@example.com\"\n\
            waiverExpires = \"2099-12-31\"\n[[class]]\nname = \"plain\"\ntier = \"entity\"\n\
            enforcement = \"advisory\"\nttlSeconds = 60\nriskOwner = \"t@example.com\"\n\
            waiverExpires = \"2099-12-31\"\n";
        let dir = policy_dir(&[("classes/a.toml", advisory_open)]);
        let set = PolicySet::load_dir_at(dir.path(), now()).unwrap_or_else(|e| panic!("{e}"));
        let posture = |name: &str| set.class(name).map(|c| c.on_quorum_loss);
        assert_eq!(posture("warm"), Some(crate::OnQuorumLoss::Open));
        assert_eq!(posture("plain"), Some(crate::OnQuorumLoss::Closed));
    }

    #[test]
    fn loads_the_dev_policies() {
        let dir = dev_copy_with_fixtures();
        let dir = dir.path();
        let set = PolicySet::load_dir(dir, Date::today_utc()).unwrap_or_else(|e| panic!("{e}"));

        for name in ["demo", "payments-ledger", "batch-report", "short"] {
            assert!(set.class(name).is_some(), "missing class {name}");
        }
        let short = set.class("short").unwrap();
        assert_eq!(
            (short.tier, short.enforcement, short.ttl_seconds),
            (Tier::Coord, Enforcement::Fenced, 5)
        );
        let ledger = set.class("payments-ledger").unwrap();
        assert_eq!((ledger.tier, ledger.ttl_seconds), (Tier::Entity, 10));
        let batch = set.class("batch-report").unwrap();
        assert_eq!(batch.enforcement, Enforcement::Advisory);
        assert_eq!(batch.ttl_seconds, 60);

        let key = |s: &str| LockKey::parse(s).unwrap();
        let id = |name: &str| format!("spiffe://dev.latchkey/workload/{name}");
        assert_eq!(
            set.authorise(&id("demo"), &key("payments/invoice/42")),
            Some("payments")
        );
        assert_eq!(set.authorise(&id("demo"), &key("demo/x")), Some("demo"));
        assert_eq!(
            set.authorise(&id("alice"), &key("shared/cron")),
            Some("shared")
        );
        assert_eq!(
            set.authorise(&id("bob"), &key("shared/cron")),
            Some("shared")
        );
        assert_eq!(set.authorise(&id("alice"), &key("payments/1")), None);
        assert_eq!(set.authorise(&id("mallory"), &key("shared/cron")), None);
        assert_eq!(
            set.authorise(&id("mallory"), &key("mallory/1")),
            Some("mallory")
        );
        assert_eq!(
            set.authorise(&id("bench"), &key("bench/k/1")),
            Some("bench")
        );
        assert!(set.is_operator("spiffe://dev.latchkey/latchkey/operator"));
        assert!(!set.is_operator(&id("alice")));

        // ADR-07: `leader` is the one dev class that names namespaces.
        let leader = set.class("leader").unwrap();
        assert_eq!(
            (leader.tier, leader.enforcement, leader.ttl_seconds),
            (Tier::Coord, Enforcement::Advisory, 30)
        );
        assert_eq!(set.coord_namespaces().collect::<Vec<_>>(), ["leader"]);
        assert_eq!(set.tier_of_key(&key("leader/sched")), Tier::Coord);
        assert_eq!(set.tier_of_key(&key("demo/x")), Tier::Entity);
        assert_eq!(
            set.authorise(&id("demo"), &key("leader/sched")),
            Some("leader")
        );

        assert_eq!(set.review(100).len(), set.classes().len());
        fingerprint(dir).unwrap();
    }

    /// ADR-17 in the dev policies: every fenced class names its pause test
    /// against the dev table, at `pause-tests/<class>.json`; `windowed`,
    /// which cannot be pause-tested on a weekday, is advisory.
    #[test]
    fn dev_fenced_classes_name_their_pause_tests() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("dev");
        let classes = read_all(&src.join(CLASSES_DIR)).unwrap();
        let set = PolicySet::from_files(&as_files(&classes), &[], Date::today_utc()).unwrap();
        let mut fenced = Vec::new();
        for class in set.classes().values() {
            if class.enforcement != Enforcement::Fenced {
                continue;
            }
            fenced.push(class.name.as_str());
            let spec = class
                .pause_test
                .as_ref()
                .unwrap_or_else(|| panic!("{} has no [class.pauseTest]", class.name));
            assert_eq!(spec.resource, "postgresql:dev.latchkey_fenced_rows");
            assert_eq!(spec.result, format!("pause-tests/{}.json", class.name));
        }
        fenced.sort_unstable();
        assert_eq!(
            fenced,
            ["demo", "payments-ledger", "quota", "short", "ticketed"]
        );
        let windowed = set.class("windowed").unwrap();
        assert_eq!(windowed.enforcement, Enforcement::Advisory);
        assert_eq!(
            windowed.risk_owner.as_deref(),
            Some("team-platform@example.com")
        );
    }

    #[test]
    fn loads_and_merges_across_files() {
        let dir = policy_dir(&[
            ("classes/a.toml", DEMO_CLASS),
            ("classes/b.toml", &(fenced_class("x") + &fenced_class("y"))),
            ("pause-tests/x.json", &json(&passing("x"))),
            ("pause-tests/y.json", &json(&passing("y"))),
            ("grants/a.toml", ALICE_GRANT),
            (
                "grants/b.toml",
                "[[grant]]\nidentity = \"spiffe://td/workload/alice\"\nprefixes = [\"more\"]\n",
            ),
            ("classes/notes.md", "not policy"),
            ("classes/.swap.toml", "garbage ["),
        ]);
        let set = PolicySet::load_dir_at(dir.path(), now()).unwrap();
        assert_eq!(set.classes().keys().collect::<Vec<_>>(), ["demo", "x", "y"]);
        assert_eq!(
            set.grants()
                .prefixes("spiffe://td/workload/alice")
                .collect::<Vec<_>>(),
            ["demo", "more", "shared"]
        );
        assert_eq!(set.operators().len(), 1);
    }

    /// Two coord classes (a.toml) and an entity class (b.toml).
    const TIER_CLASSES: [(&str, &str); 2] = [
        (
            "classes/a.toml",
            "[[class]]\nname = \"leader\"\ntier = \"coord\"\nnamespaces = [\"leader\", \"sched\"]\n\
             enforcement = \"advisory\"\nttlSeconds = 30\nriskOwner = \"t@example.com\"\n\
             waiverExpires = \"2099-12-31\"\n\
             [[class]]\nname = \"election\"\ntier = \"coord\"\nnamespaces = [\"sched\", \"config\"]\n\
             enforcement = \"advisory\"\nttlSeconds = 30\nriskOwner = \"t@example.com\"\n\
             waiverExpires = \"2099-12-31\"\n",
        ),
        (
            "classes/b.toml",
            "[[class]]\nname = \"rows\"\ntier = \"entity\"\nenforcement = \"advisory\"\n\
             ttlSeconds = 30\nriskOwner = \"t@example.com\"\nwaiverExpires = \"2099-12-31\"\n",
        ),
    ];

    /// ADR-07: the key's namespace decides its tier, through the union of
    /// every coord class's namespaces; a namespace two coord classes list
    /// is allowed (both are on the coord cluster).
    #[test]
    fn the_coord_namespaces_are_the_union_of_the_coord_classes() {
        let dir = policy_dir(&TIER_CLASSES);
        let loaded = PolicySet::load_dir_at(dir.path(), now()).unwrap_or_else(|e| panic!("{e}"));
        let files: Vec<PolicyFile<'_>> = TIER_CLASSES
            .iter()
            .map(|(path, text)| PolicyFile {
                path: Path::new(path),
                text,
            })
            .collect();
        let built = PolicySet::from_files(&files, &[], today()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loaded, built);
        for set in [&loaded, &built] {
            assert_eq!(
                set.coord_namespaces().collect::<Vec<_>>(),
                ["config", "leader", "sched"]
            );
            let tier = |k: &str| set.tier_of_key(&LockKey::parse(k).unwrap());
            assert_eq!(tier("leader"), Tier::Coord);
            assert_eq!(tier("leader/scheduler/primary"), Tier::Coord);
            assert_eq!(tier("sched/x"), Tier::Coord);
            assert_eq!(tier("config/a/b"), Tier::Coord);
            // Whole segments only, and only the first one.
            assert_eq!(tier("leaders/x"), Tier::Entity);
            assert_eq!(tier("lead"), Tier::Entity);
            assert_eq!(tier("rows/leader"), Tier::Entity);
            assert_eq!(tier("payments/invoice/42"), Tier::Entity);
        }

        // Without any coord namespaces every key is an entity-tier key,
        // even under a coord class (`demo` lists none).
        let dir = policy_dir(&[("classes/a.toml", DEMO_CLASS)]);
        let set = PolicySet::load_dir_at(dir.path(), now()).unwrap();
        assert_eq!(set.coord_namespaces().count(), 0);
        assert_eq!(
            set.tier_of_key(&LockKey::parse("demo/x").unwrap()),
            Tier::Entity
        );
    }

    #[test]
    fn the_loader_refuses_namespaces_on_an_entity_class() {
        let entity = "[[class]]\nname = \"rows\"\ntier = \"entity\"\nnamespaces = [\"rows\"]\n\
            enforcement = \"advisory\"\nttlSeconds = 30\nriskOwner = \"t@example.com\"\n\
            waiverExpires = \"2099-12-31\"\n";
        let err = load_err(&[("classes/a.toml", entity)]);
        assert!(
            err.ends_with(
                "a.toml: lock class \"rows\": namespaces is only for coord-tier classes: an \
                 entity-tier class serves every namespace no coord-tier class names; remove \
                 namespaces or set tier = \"coord\""
            ),
            "{err}"
        );
        let err = PolicySet::from_files(
            &[PolicyFile {
                path: Path::new("classes/a.toml"),
                text: &entity
                    .replace("tier = \"entity\"", "tier = \"coord\"")
                    .replace("[\"rows\"]", "[\"rows\", \"rows\"]"),
            }],
            &[],
            today(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "classes/a.toml: lock class \"rows\": namespaces lists \"rows\" twice: list each \
             namespace once"
        );
    }

    #[test]
    fn from_files_matches_load_dir() {
        let dir = policy_dir(&[
            ("classes/a.toml", DEMO_CLASS),
            ("grants/a.toml", ALICE_GRANT),
        ]);
        let loaded = PolicySet::load_dir_at(dir.path(), now()).unwrap();
        let built = PolicySet::from_files(
            &[PolicyFile {
                path: Path::new("classes/a.toml"),
                text: DEMO_CLASS,
            }],
            &[PolicyFile {
                path: Path::new("grants/a.toml"),
                text: ALICE_GRANT,
            }],
            today(),
        )
        .unwrap();
        assert_eq!(loaded, built);
    }

    #[test]
    fn empty_classes_dir_is_refused() {
        let dir = policy_dir(&[("grants/a.toml", ALICE_GRANT)]);
        let err = PolicySet::load_dir_at(dir.path(), now())
            .unwrap_err()
            .to_string();
        let expected = format!(
            "no lock classes defined in {}",
            dir.path().join("classes").display()
        );
        assert!(err.starts_with(&expected), "{err}");
    }

    #[test]
    fn missing_subdirectory_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = PolicySet::load_dir_at(dir.path(), now())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "cannot read {}",
                dir.path().join("classes").display()
            )),
            "{err}"
        );
    }

    #[test]
    fn toml_errors_name_file_line_and_column() {
        let err = load_err(&[(
            "classes/bad.toml",
            "[[class]]\nname = \"x\"\ntier = coord\n",
        )]);
        assert!(err.contains("bad.toml: "), "{err}");
        assert!(err.contains("line 3, column"), "{err}");

        let err = load_err(&[(
            "classes/typo.toml",
            "[[class]]\nname = \"x\"\ntier = \"coord\"\nenforcement = \"fenced\"\nttl_seconds = 10\n",
        )]);
        assert!(err.contains("typo.toml: "), "{err}");
        assert!(err.contains("unknown field `ttl_seconds`"), "{err}");
        assert!(err.contains("line 5"), "{err}");

        let err = load_err(&[
            ("classes/a.toml", DEMO_CLASS),
            (
                "grants/g.toml",
                "[[grants]]\nidentity = \"spiffe://td/a\"\nprefixes = [\"a\"]\n",
            ),
        ]);
        assert!(
            err.contains("g.toml: ") && err.contains("unknown field `grants`"),
            "{err}"
        );
    }

    #[test]
    fn class_rule_errors_name_file_and_class() {
        let err = load_err(&[(
            "classes/pay.toml",
            "[[class]]\nname = \"ledger\"\ntier = \"entity\"\nenforcement = \"fenced\"\nonQuorumLoss = \"open\"\n",
        )]);
        assert!(
            err.ends_with(
                "pay.toml: lock class \"ledger\": onQuorumLoss = \"open\" is not allowed for a \
                 fenced class: fenced classes claim mutual exclusion, which an ungoverned grant \
                 breaks; use onQuorumLoss = \"closed\""
            ),
            "{err}"
        );
    }

    #[test]
    fn duplicate_class_names_both_files() {
        let dir = policy_dir(&[
            ("classes/a.toml", DEMO_CLASS),
            ("classes/b.toml", DEMO_CLASS),
        ]);
        let err = PolicySet::load_dir_at(dir.path(), now()).unwrap_err();
        match &err {
            PolicyError::DuplicateClass {
                name,
                first,
                second,
            } => {
                assert_eq!(name, "demo");
                assert!(first.ends_with("classes/a.toml"));
                assert!(second.ends_with("classes/b.toml"));
            }
            other => panic!("{other:?}"),
        }
        assert!(err.to_string().contains("is defined twice"), "{err}");
    }

    #[test]
    fn empty_class_file_is_refused() {
        let err = load_err(&[
            ("classes/a.toml", DEMO_CLASS),
            ("classes/empty.toml", "# nothing\n"),
        ]);
        assert!(
            err.contains("empty.toml: file defines no [[class]] tables"),
            "{err}"
        );
    }

    #[test]
    fn bad_identities_and_prefixes_name_the_file() {
        let err = load_err(&[
            ("classes/a.toml", DEMO_CLASS),
            (
                "grants/g.toml",
                "[[grant]]\nidentity = \"https://td/a\"\nprefixes = [\"a\"]\n",
            ),
        ]);
        assert!(
            err.contains("g.toml: \"https://td/a\" is not a SPIFFE ID"),
            "{err}"
        );

        let err = load_err(&[
            ("classes/a.toml", DEMO_CLASS),
            (
                "grants/g.toml",
                "[[operator]]\nidentity = \"spiffe://td/a/\"\n",
            ),
        ]);
        assert!(
            err.contains("g.toml: \"spiffe://td/a/\" is not a SPIFFE ID"),
            "{err}"
        );

        let err = load_err(&[
            ("classes/a.toml", DEMO_CLASS),
            (
                "grants/g.toml",
                "[[grant]]\nidentity = \"spiffe://td/a\"\nprefixes = [\"a//b\"]\n",
            ),
        ]);
        assert!(err.contains("g.toml: grant for spiffe://td/a has an invalid prefix: lock key has an empty path segment"), "{err}");
    }

    /// The load error for a fenced class "ledger" whose result is `result`
    /// (None: no file), after "<dir>/classes/l.toml: ".
    fn ledger_err(class_toml: &str, result: Option<&str>) -> String {
        let mut files = vec![("classes/l.toml", class_toml)];
        if let Some(result) = result {
            files.push(("pause-tests/ledger.json", result));
        }
        let dir = policy_dir(&files);
        let err = PolicySet::load_dir_at(dir.path(), now())
            .unwrap_err()
            .to_string();
        let prefix = format!("{}: ", dir.path().join("classes/l.toml").display());
        let rest = err.strip_prefix(&prefix).unwrap_or_else(|| panic!("{err}"));
        rest.replace(&dir.path().display().to_string(), "<dir>")
    }

    const RUN_LEDGER: &str = "Run `latchctl pause-test <KEY> --class ledger --resource \
        postgresql:test.rows --postgres <CONNINFO> --out <dir>/pause-tests/ledger.json` against the real resource, \
        or declare the class advisory with riskOwner and waiverExpires";

    fn refused(reason: &str) -> String {
        format!(
            "lock class \"ledger\": enforcement = \"fenced\" but no passing pause test: \
             {reason}. {RUN_LEDGER}"
        )
    }

    #[test]
    fn a_fenced_class_loads_with_a_passing_pause_test() {
        let dir = policy_dir(&[
            ("classes/l.toml", fenced_class("ledger").as_str()),
            ("pause-tests/ledger.json", &json(&passing("ledger"))),
        ]);
        let set = PolicySet::load_dir_at(dir.path(), now()).unwrap();
        let ledger = set.class("ledger").unwrap();
        assert_eq!(ledger.enforcement, Enforcement::Fenced);
        assert_eq!(
            ledger.pause_test.as_ref().map(|p| p.result.as_str()),
            Some("pause-tests/ledger.json")
        );
        // A declared schema version that the result records.
        let with_schema = fenced_class("ledger") + "schemaVersion = \"7\"\n";
        let result = PauseTestResult {
            resource_schema_version: Some("7".into()),
            ..passing("ledger")
        };
        let dir = policy_dir(&[
            ("classes/l.toml", with_schema.as_str()),
            ("pause-tests/ledger.json", &json(&result)),
        ]);
        PolicySet::load_dir_at(dir.path(), now()).unwrap();
        // load_dir, on the system clock, agrees about a fresh result.
        let fresh = PauseTestResult {
            finished_at: SystemTime::now(),
            ..passing("ledger")
        };
        let dir = policy_dir(&[
            ("classes/l.toml", fenced_class("ledger").as_str()),
            ("pause-tests/ledger.json", &json(&fresh)),
        ]);
        PolicySet::load_dir(dir.path(), Date::today_utc()).unwrap();
    }

    #[test]
    fn a_fenced_class_without_its_result_file_is_refused() {
        assert_eq!(
            ledger_err(&fenced_class("ledger"), None),
            refused("pause-tests/ledger.json does not exist")
        );
    }

    #[test]
    fn a_fenced_class_without_a_pause_test_block_is_refused() {
        assert_eq!(
            ledger_err(
                "[[class]]\nname = \"ledger\"\ntier = \"entity\"\nenforcement = \"fenced\"\n",
                None
            ),
            "lock class \"ledger\": enforcement = \"fenced\" but no passing pause test: there \
             is no [class.pauseTest]. Run `latchctl pause-test <KEY> --class ledger --resource \
             <kind>:<name> --postgres <CONNINFO> --out <dir>/pause-tests/ledger.json` against the real resource and \
             add [class.pauseTest] with its resource and result, or declare the class advisory \
             with riskOwner and waiverExpires"
        );
    }

    #[test]
    fn an_unparsable_result_is_refused() {
        let err = ledger_err(&fenced_class("ledger"), Some("{\"version\": 1,"));
        assert_eq!(
            err,
            refused(
                "pause-tests/ledger.json is not a pause-test result (EOF while parsing a value \
                 at line 1 column 14)"
            )
        );

        let err = ledger_err(
            &fenced_class("ledger"),
            Some(&json(&passing("ledger")).replace("\"kit\"", "\"kitt\"")),
        );
        assert!(err.contains("unknown field `kitt`"), "{err}");
        let err = ledger_err(
            &fenced_class("ledger"),
            Some(&json(&passing("ledger")).replace("2026-01-14T12:00:00Z", "yesterday")),
        );
        assert!(
            err.contains(
                "is not a pause-test result (\"yesterday\" is not an RFC 3339 UTC timestamp"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_result_for_another_class_or_resource_is_refused() {
        assert_eq!(
            ledger_err(&fenced_class("ledger"), Some(&json(&passing("demo")))),
            refused("pause-tests/ledger.json is the result for class \"demo\", not this one")
        );
        let elsewhere = PauseTestResult {
            resource: "postgresql:staging.rows".into(),
            ..passing("ledger")
        };
        assert_eq!(
            ledger_err(&fenced_class("ledger"), Some(&json(&elsewhere))),
            refused(
                "pause-tests/ledger.json tested resource \"postgresql:staging.rows\", but \
                 [class.pauseTest] names \"postgresql:test.rows\""
            )
        );
        let old = PauseTestResult {
            version: 2,
            ..passing("ledger")
        };
        assert_eq!(
            ledger_err(&fenced_class("ledger"), Some(&json(&old))),
            refused("pause-tests/ledger.json has result version 2; this release reads version 1")
        );
    }

    #[test]
    fn a_failed_pause_test_is_refused() {
        let failed = PauseTestResult {
            outcome: PauseTestOutcome::Fail,
            failure: Some("the stale write after resume was accepted".into()),
            store: None,
            evidence: PauseTestEvidence {
                stale_write_after_resume: WriteOutcome::Accepted,
                final_row_from: "first-holder".into(),
                stale_proclaim_after_resume: None,
                ..passing("ledger").evidence
            },
            ..passing("ledger")
        };
        assert_eq!(
            ledger_err(&fenced_class("ledger"), Some(&json(&failed))),
            refused(
                "the pause test in pause-tests/ledger.json failed at 2026-01-14T12:00:00Z: the \
                 stale write after resume was accepted"
            )
        );
    }

    #[test]
    fn a_schema_version_mismatch_is_refused() {
        let class = fenced_class("ledger") + "schemaVersion = \"8\"\n";
        let result = PauseTestResult {
            resource_schema_version: Some("7".into()),
            ..passing("ledger")
        };
        assert_eq!(
            ledger_err(&class, Some(&json(&result))),
            refused(
                "pause-tests/ledger.json was run against resource schema version \"7\", but \
                 [class.pauseTest] declares schemaVersion = \"8\": the schema changed since the \
                 test"
            )
        );
        assert_eq!(
            ledger_err(&class, Some(&json(&passing("ledger")))),
            refused(
                "pause-tests/ledger.json was run against resource schema version (none \
                 recorded), but [class.pauseTest] declares schemaVersion = \"8\": the schema \
                 changed since the test"
            )
        );
    }

    #[test]
    fn a_result_older_than_a_year_is_refused() {
        let old = PauseTestResult {
            finished_at: now() - 366 * DAY,
            ..passing("ledger")
        };
        assert_eq!(
            ledger_err(&fenced_class("ledger"), Some(&json(&old))),
            refused(
                "the pause test passed on 2025-01-14 and expired on 2026-01-14 (results last \
                 365 days), so it must be run again"
            )
        );
        let year_old = PauseTestResult {
            finished_at: now() - 365 * DAY,
            ..passing("ledger")
        };
        let dir = policy_dir(&[
            ("classes/l.toml", fenced_class("ledger").as_str()),
            ("pause-tests/ledger.json", &json(&year_old)),
        ]);
        PolicySet::load_dir_at(dir.path(), now()).unwrap();
    }

    #[test]
    fn a_result_from_the_future_is_refused() {
        let ahead = PauseTestResult {
            finished_at: now() + DAY + Duration::from_secs(1),
            ..passing("ledger")
        };
        assert_eq!(
            ledger_err(&fenced_class("ledger"), Some(&json(&ahead))),
            refused(
                "pause-tests/ledger.json finished at 2026-01-16T12:00:01Z, more than a day after \
                 now (2026-01-15T12:00:00Z): check the clock of the machine that ran the kit"
            )
        );
        // Within a day ahead is clock skew, and fine.
        let skewed = PauseTestResult {
            finished_at: now() + DAY,
            ..passing("ledger")
        };
        let dir = policy_dir(&[
            ("classes/l.toml", fenced_class("ledger").as_str()),
            ("pause-tests/ledger.json", &json(&skewed)),
        ]);
        PolicySet::load_dir_at(dir.path(), now()).unwrap();
    }

    #[test]
    fn an_advisory_class_may_name_a_pause_test_it_does_not_have_yet() {
        let advisory = "[[class]]\nname = \"ledger\"\ntier = \"entity\"\nenforcement = \"advisory\"\n\
            ttlSeconds = 30\nriskOwner = \"team@example.com\"\nwaiverExpires = \"2027-06-30\"\n\
            [class.pauseTest]\nresource = \"postgresql:test.rows\"\nresult = \"pause-tests/ledger.json\"\n";
        let dir = policy_dir(&[("classes/l.toml", advisory)]);
        let set = PolicySet::load_dir_at(dir.path(), now()).unwrap();
        assert!(set.class("ledger").unwrap().pause_test.is_some());

        // Syntax is still checked.
        let bad = advisory.replace("pause-tests/ledger.json", "../ledger.json");
        let err = load_err(&[("classes/l.toml", bad.as_str())]);
        assert!(
            err.ends_with(
                "l.toml: lock class \"ledger\": pauseTest.result must be a .json path inside the \
                 policy directory, relative to it, e.g. \"pause-tests/payments-ledger.json\""
            ),
            "{err}"
        );
        let typo = advisory.replace("result =", "results =");
        let err = load_err(&[("classes/l.toml", typo.as_str())]);
        assert!(err.contains("unknown field `results`"), "{err}");
    }

    #[test]
    fn from_files_does_not_read_pause_tests() {
        let text = fenced_class("ledger");
        PolicySet::from_files(
            &[PolicyFile {
                path: Path::new("classes/l.toml"),
                text: &text,
            }],
            &[],
            today(),
        )
        .unwrap();
    }

    #[test]
    fn fingerprint_sees_pause_test_results() {
        let dir = policy_dir(&[("classes/l.toml", fenced_class("ledger").as_str())]);
        let absent = fingerprint(dir.path()).unwrap();
        assert_eq!(absent, fingerprint(dir.path()).unwrap());
        let result = dir.path().join("pause-tests/ledger.json");
        fs::write(&result, json(&passing("ledger"))).unwrap();
        let present = fingerprint(dir.path()).unwrap();
        assert_ne!(absent, present);
        fs::write(&result, json(&passing("other"))).unwrap();
        assert_ne!(present, fingerprint(dir.path()).unwrap());
        // Results no class names do not count.
        let named = fingerprint(dir.path()).unwrap();
        fs::write(dir.path().join("pause-tests/unused.json"), "{}").unwrap();
        assert_eq!(named, fingerprint(dir.path()).unwrap());
    }

    #[test]
    fn fingerprint_changes_with_content_and_files() {
        let dir = policy_dir(&[
            ("classes/a.toml", DEMO_CLASS),
            ("grants/a.toml", ALICE_GRANT),
        ]);
        let first = fingerprint(dir.path()).unwrap();
        assert_eq!(first, fingerprint(dir.path()).unwrap());

        // Same size, different bytes: caught by the contents hash even if
        // the mtime does not move within the filesystem's resolution.
        let path = dir.path().join("classes/a.toml");
        fs::write(&path, DEMO_CLASS.replace("demo", "dema")).unwrap();
        let second = fingerprint(dir.path()).unwrap();
        assert_ne!(first, second);

        fs::write(dir.path().join("grants/b.toml"), "").unwrap();
        assert_ne!(second, fingerprint(dir.path()).unwrap());

        // Non-policy files do not count.
        let third = fingerprint(dir.path()).unwrap();
        fs::write(dir.path().join("grants/README"), "x").unwrap();
        assert_eq!(third, fingerprint(dir.path()).unwrap());

        let err = fingerprint(&dir.path().join("nope")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(err.to_string().contains("nope"), "{err}");
        // Issue 32: the error from the filesystem stays the source.
        let source = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<io::Error>());
        assert_eq!(source.map(io::Error::kind), Some(io::ErrorKind::NotFound));
    }
}
