//! The policy directory: every class and grant file, loaded and checked as
//! one set, so a bad change is refused whole and the last good set stays in
//! service (ADR-24).
//!
//! ```text
//! <dir>/classes/*.toml   one or more [[class]] tables per file
//! <dir>/grants/*.toml    [[grant]] and [[operator]] tables
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use serde::Deserialize;

use crate::class::{self, LockClass, ReviewReport};
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
/// and the identities with the operator role.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySet {
    classes: BTreeMap<String, LockClass>,
    grants: PrefixGrants,
    operators: BTreeSet<String>,
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
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OperatorTable {
    identity: String,
}

impl PolicySet {
    /// Loads `dir/classes/*.toml` and `dir/grants/*.toml`, in file-name
    /// order, and validates everything against `today`.
    ///
    /// Files whose names start with `.` are skipped (editor swap files,
    /// Kubernetes' `..data` links); symlinks are followed. Both
    /// subdirectories must exist; `grants/` may be empty, `classes/` may not.
    pub fn load_dir(dir: &Path, today: Date) -> Result<PolicySet, PolicyError> {
        let classes_dir = dir.join(CLASSES_DIR);
        let grants_dir = dir.join(GRANTS_DIR);
        let class_texts = read_all(&classes_dir)?;
        let grant_texts = read_all(&grants_dir)?;
        let set = PolicySet::build(
            &classes_dir,
            &as_files(&class_texts),
            &as_files(&grant_texts),
            today,
        )?;
        tracing::debug!(
            dir = %dir.display(),
            classes = set.classes.len(),
            grants = set.grants.len(),
            grants_version = set.grants.version(),
            operators = set.operators.len(),
            "loaded policy directory"
        );
        Ok(set)
    }

    /// Builds a set from file texts already in memory, with the same rules
    /// as [`PolicySet::load_dir`]. `classes` must not be empty.
    pub fn from_files(
        classes: &[PolicyFile<'_>],
        grants: &[PolicyFile<'_>],
        today: Date,
    ) -> Result<PolicySet, PolicyError> {
        PolicySet::build(Path::new(CLASSES_DIR), classes, grants, today)
    }

    fn build(
        classes_dir: &Path,
        class_files: &[PolicyFile<'_>],
        grant_files: &[PolicyFile<'_>],
        today: Date,
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
                grants
                    .grant(&grant.identity, &grant.prefixes)
                    .map_err(|e| e.in_file(file.path))?;
            }
            for operator in &parsed.operator {
                let identity = grants::canonical_identity(&operator.identity)
                    .map_err(|e| e.in_file(file.path))?;
                operators.insert(identity);
            }
        }

        Ok(PolicySet {
            classes: classes
                .into_iter()
                .map(|(name, (class, _))| (name, class))
                .collect(),
            grants: grants.build(),
            operators,
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
/// modification time and contents, in name order. Poll it and reload when
/// it changes; take it *before* loading, so a change during the load is
/// seen on the next poll.
pub fn fingerprint(dir: &Path) -> io::Result<u64> {
    let mut hash = Fnv1a::new();
    for sub in [CLASSES_DIR, GRANTS_DIR] {
        let sub_dir = dir.join(sub);
        for path in toml_files(&sub_dir).map_err(|e| with_path(e, &sub_dir))? {
            let meta = fs::metadata(&path).map_err(|e| with_path(e, &path))?;
            let mtime_nanos = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            let contents = fs::read(&path).map_err(|e| with_path(e, &path))?;
            let mut contents_hash = Fnv1a::new();
            contents_hash.write(&contents);

            let relative = path.strip_prefix(dir).unwrap_or(&path);
            hash.write_field(relative.to_string_lossy().as_bytes());
            hash.write_u64(meta.len());
            hash.write(&mtime_nanos.to_le_bytes());
            hash.write_u64(contents_hash.finish());
        }
    }
    Ok(hash.finish())
}

fn with_path(e: io::Error, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
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

    fn today() -> Date {
        Date::parse("2026-01-15").unwrap()
    }

    const DEMO_CLASS: &str = r#"
[[class]]
name = "demo"
tier = "coord"
enforcement = "fenced"
"#;

    const ALICE_GRANT: &str = r#"
[[grant]]
identity = "spiffe://td/workload/alice"
prefixes = ["demo", "shared/"]

[[operator]]
identity = "spiffe://td/latchkey/operator"
"#;

    /// A policy directory in a temp dir, from (relative path, text) pairs.
    fn policy_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join(CLASSES_DIR)).unwrap();
        fs::create_dir(dir.path().join(GRANTS_DIR)).unwrap();
        for (path, text) in files {
            fs::write(dir.path().join(path), text).unwrap();
        }
        dir
    }

    fn load_err(files: &[(&str, &str)]) -> String {
        let dir = policy_dir(files);
        PolicySet::load_dir(dir.path(), today())
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn loads_the_dev_policies() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("dev");
        let set = PolicySet::load_dir(&dir, Date::today_utc()).unwrap_or_else(|e| panic!("{e}"));

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

        assert_eq!(set.review(100).len(), set.classes().len());
        fingerprint(&dir).unwrap();
    }

    #[test]
    fn loads_and_merges_across_files() {
        let dir = policy_dir(&[
            ("classes/a.toml", DEMO_CLASS),
            (
                "classes/b.toml",
                "[[class]]\nname = \"x\"\ntier = \"entity\"\nenforcement = \"fenced\"\n\
                 [[class]]\nname = \"y\"\ntier = \"entity\"\nenforcement = \"fenced\"\n",
            ),
            ("grants/a.toml", ALICE_GRANT),
            (
                "grants/b.toml",
                "[[grant]]\nidentity = \"spiffe://td/workload/alice\"\nprefixes = [\"more\"]\n",
            ),
            ("classes/notes.md", "not policy"),
            ("classes/.swap.toml", "garbage ["),
        ]);
        let set = PolicySet::load_dir(dir.path(), today()).unwrap();
        assert_eq!(set.classes().keys().collect::<Vec<_>>(), ["demo", "x", "y"]);
        assert_eq!(
            set.grants()
                .prefixes("spiffe://td/workload/alice")
                .collect::<Vec<_>>(),
            ["demo", "more", "shared"]
        );
        assert_eq!(set.operators().len(), 1);
    }

    #[test]
    fn from_files_matches_load_dir() {
        let dir = policy_dir(&[
            ("classes/a.toml", DEMO_CLASS),
            ("grants/a.toml", ALICE_GRANT),
        ]);
        let loaded = PolicySet::load_dir(dir.path(), today()).unwrap();
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
        let err = PolicySet::load_dir(dir.path(), today())
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
        let err = PolicySet::load_dir(dir.path(), today())
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
            "[[class]]\nname = \"ledger\"\ntier = \"entity\"\nenforcement = \"fenced\"\nfairness = \"durable\"\n",
        )]);
        assert!(
            err.ends_with(
                "pay.toml: lock class \"ledger\": durable fairness is not implemented in this \
                 release; use fairness = \"memory\""
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
        let err = PolicySet::load_dir(dir.path(), today()).unwrap_err();
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
    }
}
