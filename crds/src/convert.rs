//! Policy files ⇄ LockClass/LockGrant manifests, and checking manifests with
//! the loader's own rules.
//!
//! Both directions go through the policies crate's model: policy files are
//! loaded with [`PolicySet::load_dir`] before they become manifests, and each
//! manifest object becomes a one-table policy file that [`PolicySet::from_files`]
//! and [`LockClass::check_pause_test`] check, so a manifest is refused with
//! the loader's message, prefixed with the manifest file, document and object.
//!
//! [`LockClass::check_pause_test`]: latchkey_policies::LockClass::check_pause_test

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use kube::core::ObjectMeta;
use latchkey_policies::{Date, PolicyError, PolicyFile, PolicySet};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::resources::{API_VERSION, LockClass, LockClassSpec, LockGrant, LockGrantSpec};

/// Namespace given to objects converted from policy files when none is asked for.
pub const DEFAULT_NAMESPACE: &str = "latchkey";

/// One manifest file's text and the path to name in errors.
#[derive(Debug, Clone, Copy)]
pub struct ManifestFile<'a> {
    pub path: &'a Path,
    pub text: &'a str,
}

/// One object from a manifest, with where it came from.
// A few objects per policy load, moved into a Vec once: boxing the larger
// variant would only add an allocation and a deref to every match.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Resource {
    Class(LockClass),
    Grant(LockGrant),
}

/// A manifest or policy that cannot be converted or loaded, and why.
/// Printing it with `{}` names the file, the document and the object.
#[derive(Debug, Error)]
pub enum CrdError {
    /// A policy rule, as the loader words it, for one manifest object.
    #[error("{at}: {source}")]
    Policy {
        at: String,
        #[source]
        source: PolicyError,
    },

    /// A policy directory that does not load.
    #[error(transparent)]
    Load(#[from] PolicyError),

    #[error("{at}: {message}")]
    Manifest { at: String, message: String },

    /// Converting between two of our own plain-data types failed (a bug):
    /// the serializer's error stays the source.
    #[error("{at}: internal conversion error: {source}")]
    Internal {
        at: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    #[error(
        "{at}: {kind} \"{name}\" is also defined at {first}: an object is defined once per namespace"
    )]
    Duplicate {
        at: String,
        kind: &'static str,
        name: String,
        first: String,
    },

    #[error(
        "lock class \"{class}\" cannot be a Kubernetes object name: a LockClass is named by its \
         class, and object names are lowercase letters, digits, '-' and '.', starting and ending \
         with a letter or digit; rename the class"
    )]
    ClassName { class: String },

    #[error(
        "lock class \"{class}\": hook.config holds a TOML date or time ({value}), which JSON and \
         Kubernetes cannot carry; write it as a string"
    )]
    HookConfigDatetime { class: String, value: String },

    #[error(
        "grants of {first} and {second} would both be the LockGrant object \"{name}\": \
         converting one over the other would lose a grant; rename one identity"
    )]
    GrantNameCollision {
        name: String,
        first: String,
        second: String,
    },

    #[error("no LockClass in {what}: add at least one LockClass manifest")]
    NoClasses { what: String },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The policy files a set of manifests converts to: `classes/<namespace>.toml`
/// and `grants/<namespace>.toml` texts, by namespace.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyTexts {
    pub classes: BTreeMap<String, String>,
    pub grants: BTreeMap<String, String>,
}

impl PolicyTexts {
    /// Writes `classes/*.toml` and `grants/*.toml` under `dir`, creating both.
    pub fn write_to(&self, dir: &Path) -> Result<Vec<PathBuf>, CrdError> {
        let mut written = Vec::new();
        for (sub, files) in [
            (latchkey_policies::CLASSES_DIR, &self.classes),
            (latchkey_policies::GRANTS_DIR, &self.grants),
        ] {
            let sub_dir = dir.join(sub);
            fs::create_dir_all(&sub_dir).map_err(|source| CrdError::Io {
                path: sub_dir.clone(),
                source,
            })?;
            for (namespace, text) in files {
                let path = sub_dir.join(format!("{namespace}.toml"));
                fs::write(&path, text).map_err(|source| CrdError::Io {
                    path: path.clone(),
                    source,
                })?;
                written.push(path);
            }
        }
        Ok(written)
    }
}

/// Where an object came from, for messages: `file, document N (Kind ns/name)`.
#[derive(Debug, Clone)]
struct Origin {
    at: String,
}

// ---------------------------------------------------------------------------
// Policy files -> manifests

/// The objects for a loaded policy set: one LockClass per class (named by the
/// class) and one LockGrant per identity with grants or the operator role,
/// all in `namespace`, classes first, each sorted by name.
pub fn from_policy(set: &PolicySet, namespace: &str) -> Result<Vec<Resource>, CrdError> {
    let mut out = Vec::new();
    for class in set.classes().values() {
        if !is_object_name(&class.name) {
            return Err(CrdError::ClassName {
                class: class.name.clone(),
            });
        }
        let mut value = serde_json::to_value(class).map_err(|e| internal(&class.name, e))?;
        if let Some(found) = value.pointer("/hook/config").and_then(find_datetime) {
            return Err(CrdError::HookConfigDatetime {
                class: class.name.clone(),
                value: found,
            });
        }
        if let Some(map) = value.as_object_mut() {
            map.remove("name");
        }
        let spec: LockClassSpec =
            serde_json::from_value(value).map_err(|e| internal(&class.name, e))?;
        let mut object = LockClass::new(&class.name, spec);
        object.metadata.namespace = Some(namespace.to_owned());
        out.push(Resource::Class(object));
    }

    let grants = set.grants();
    let identities: BTreeSet<&str> = grants
        .identities()
        .chain(set.operators().iter().map(String::as_str))
        .collect();
    let mut grant_objects: BTreeMap<String, LockGrant> = BTreeMap::new();
    for identity in identities {
        // Prefixes granted for some classes only go in objects of their
        // own, one per set of classes (a LockGrant's classes cover all of
        // its prefixes).
        let mut scoped: BTreeMap<Vec<String>, Vec<String>> = BTreeMap::new();
        for (prefix, classes) in grants.scoped(identity) {
            scoped
                .entry(classes.iter().cloned().collect())
                .or_default()
                .push(prefix.to_owned());
        }
        let any: Vec<String> = grants
            .prefixes(identity)
            .filter(|p| !scoped.values().any(|ps| ps.iter().any(|s| s == p)))
            .map(str::to_owned)
            .collect();
        let spec = LockGrantSpec {
            identity: identity.to_owned(),
            prefixes: any,
            classes: None,
            operator: set.is_operator(identity),
        };
        let mut objects = Vec::new();
        if !spec.prefixes.is_empty() || spec.operator || scoped.is_empty() {
            objects.push(LockGrant::new(&grant_name(identity), spec));
        }
        for (classes, prefixes) in scoped {
            let name = scoped_grant_name(identity, &classes);
            objects.push(LockGrant::new(
                &name,
                LockGrantSpec {
                    identity: identity.to_owned(),
                    prefixes,
                    classes: Some(classes),
                    operator: false,
                },
            ));
        }
        for mut object in objects {
            object.metadata.namespace = Some(namespace.to_owned());
            let name = object.metadata.name.clone().unwrap_or_default();
            let second = object.spec.identity.clone();
            if let Some(was) = grant_objects.insert(name.clone(), object) {
                return Err(CrdError::GrantNameCollision {
                    name,
                    first: was.spec.identity,
                    second,
                });
            }
        }
    }
    out.extend(grant_objects.into_values().map(Resource::Grant));
    Ok(out)
}

/// Loads the policy directory with every loader rule (pause tests included,
/// at `now`) and converts it: what `latchctl classes to-crd` prints.
pub fn policy_dir_to_yaml(
    dir: &Path,
    namespace: &str,
    now: SystemTime,
) -> Result<String, CrdError> {
    let set = PolicySet::load_dir_at(dir, now)?;
    Ok(to_yaml(&from_policy(&set, namespace)?))
}

/// A multi-document YAML stream, one object per document.
pub fn to_yaml(resources: &[Resource]) -> String {
    let docs: Vec<String> = resources
        .iter()
        .map(|r| {
            let value = match r {
                Resource::Class(c) => serde_json::to_value(c),
                Resource::Grant(g) => serde_json::to_value(g),
            };
            // Plain data: neither step can fail.
            value
                .ok()
                .and_then(|v| serde_norway::to_string(&v).ok())
                .unwrap_or_default()
        })
        .collect();
    docs.iter()
        .map(|d| format!("---\n{}", quote_waiver_dates(d)))
        .collect::<Vec<_>>()
        .concat()
}

/// `waiverExpires: 2027-06-30` is a string in YAML 1.2, but YAML 1.1 readers
/// (PyYAML, so `kubernetes-validate`) take it for a date; quote it.
fn quote_waiver_dates(doc: &str) -> String {
    const KEY: &str = "  waiverExpires: ";
    doc.lines()
        .map(|line| match line.strip_prefix(KEY) {
            Some(value) if !value.starts_with(['\'', '"']) => format!("{KEY}'{value}'\n"),
            _ => format!("{line}\n"),
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Manifests -> objects -> policy files

/// Parses every document of every file. Empty documents are skipped; any
/// other kind is refused, so a typo in `kind` is not silently dropped.
pub fn parse_manifests(files: &[ManifestFile<'_>]) -> Result<Vec<Resource>, CrdError> {
    Ok(parse_located(files)?.into_iter().map(|(r, _)| r).collect())
}

fn parse_located(files: &[ManifestFile<'_>]) -> Result<Vec<(Resource, Origin)>, CrdError> {
    let mut out: Vec<(Resource, Origin)> = Vec::new();
    let mut seen: BTreeMap<(&'static str, String, String), String> = BTreeMap::new();
    for file in files {
        for (index, document) in serde_norway::Deserializer::from_str(file.text).enumerate() {
            let at = format!("{}, document {}", file.path.display(), index + 1);
            let manifest_err = |message: String| CrdError::Manifest {
                at: at.clone(),
                message,
            };
            let value = serde_norway::Value::deserialize(document)
                .map_err(|e| manifest_err(format!("not valid YAML ({e})")))?;
            if value.is_null() {
                continue;
            }
            let value = serde_json::to_value(&value)
                .map_err(|e| manifest_err(format!("not a plain YAML object ({e})")))?;
            let api_version = value.get("apiVersion").and_then(|v| v.as_str());
            let kind = value.get("kind").and_then(|v| v.as_str());
            let (resource, kind, meta) = match (api_version, kind) {
                (Some(API_VERSION), Some("LockClass")) => {
                    let object: LockClass = serde_json::from_value(value)
                        .map_err(|e| manifest_err(format!("LockClass: {e}")))?;
                    let meta = object.metadata.clone();
                    (Resource::Class(object), "LockClass", meta)
                }
                (Some(API_VERSION), Some("LockGrant")) => {
                    let object: LockGrant = serde_json::from_value(value)
                        .map_err(|e| manifest_err(format!("LockGrant: {e}")))?;
                    let meta = object.metadata.clone();
                    (Resource::Grant(object), "LockGrant", meta)
                }
                (found_version, found_kind) => {
                    return Err(manifest_err(format!(
                        "not a LockClass or LockGrant: found apiVersion {}, kind {}; expected \
                         apiVersion {API_VERSION} and kind LockClass or LockGrant",
                        found_version.unwrap_or("(none)"),
                        found_kind.unwrap_or("(none)")
                    )));
                }
            };
            let (namespace, name) = check_meta(&meta).map_err(&manifest_err)?;
            let at = format!("{at} ({kind} {namespace}/{name})");
            let key = (kind, namespace, name.clone());
            if let Some(first) = seen.get(&key) {
                return Err(CrdError::Duplicate {
                    at,
                    kind,
                    name,
                    first: first.clone(),
                });
            }
            seen.insert(key, at.clone());
            out.push((resource, Origin { at }));
        }
    }
    Ok(out)
}

/// The object's namespace (default `default`, as `kubectl apply` would use
/// with no namespace set) and name, both checked as the API server would.
fn check_meta(meta: &ObjectMeta) -> Result<(String, String), String> {
    let name = meta
        .name
        .clone()
        .ok_or_else(|| "metadata.name is missing".to_string())?;
    if !is_object_name(&name) {
        return Err(format!(
            "metadata.name \"{}\" is not a Kubernetes object name (lowercase letters, digits, \
             '-' and '.', at most 253, starting and ending with a letter or digit)",
            name.escape_debug()
        ));
    }
    let namespace = meta.namespace.clone().unwrap_or_else(|| "default".into());
    let label = namespace.len() <= 63 && !namespace.contains('.') && is_object_name(&namespace);
    if !label {
        return Err(format!(
            "metadata.namespace \"{}\" is not a namespace name (a DNS label)",
            namespace.escape_debug()
        ));
    }
    Ok((namespace, name))
}

/// The class tables and grant tables the objects stand for, as policy-file
/// TOML, one file per namespace (`latchctl classes from-crd`). Objects are
/// checked first, with the loader's rules except the pause-test results
/// (see [`check_manifests`] for those).
pub fn to_policy_texts(files: &[ManifestFile<'_>], today: Date) -> Result<PolicyTexts, CrdError> {
    let located = parse_located(files)?;
    check_located(&located, today, None)?;
    let mut classes: BTreeMap<String, Vec<latchkey_policies::LockClass>> = BTreeMap::new();
    let mut grants: BTreeMap<String, GrantFileOut> = BTreeMap::new();
    for (resource, origin) in &located {
        match resource {
            Resource::Class(object) => {
                let class = policy_class(object, origin)?;
                classes
                    .entry(namespace_of(&object.metadata))
                    .or_default()
                    .push(class);
            }
            Resource::Grant(object) => {
                let file = grants.entry(namespace_of(&object.metadata)).or_default();
                if !object.spec.prefixes.is_empty() {
                    file.grant.push(GrantOut {
                        identity: object.spec.identity.clone(),
                        prefixes: object.spec.prefixes.clone(),
                        classes: object.spec.classes.clone(),
                    });
                }
                if object.spec.operator {
                    file.operator.push(OperatorOut {
                        identity: object.spec.identity.clone(),
                    });
                }
            }
        }
    }
    let mut texts = PolicyTexts::default();
    for (namespace, class) in classes {
        let text = toml::to_string(&ClassFileOut { class }).map_err(|e| internal(&namespace, e))?;
        texts
            .classes
            .insert(namespace, format!("{GENERATED}{text}"));
    }
    for (namespace, file) in grants {
        let text = toml::to_string(&file).map_err(|e| internal(&namespace, e))?;
        texts.grants.insert(namespace, format!("{GENERATED}{text}"));
    }
    Ok(texts)
}

const GENERATED: &str =
    "# Converted from LockClass/LockGrant manifests by `latchctl classes from-crd`.\n\n";

/// Checks manifests with the loader's rules and returns the policy set they
/// make: every class and grant rule, duplicates across files and
/// namespaces, and, when `policy_root` is given, each fenced class's
/// pause-test result read relative to it at `now` (as [`PolicySet::load_dir`]
/// does relative to the policy directory).
pub fn check_manifests(
    files: &[ManifestFile<'_>],
    policy_root: Option<&Path>,
    now: SystemTime,
) -> Result<PolicySet, CrdError> {
    let located = parse_located(files)?;
    check_located(
        &located,
        Date::from_system_time(now),
        policy_root.map(|r| (r, now)),
    )
}

/// Reads every `*.yaml`/`*.yml` file directly in `dir` (sorted, dotfiles
/// skipped, symlinks followed as mounted ConfigMaps need) and checks them
/// with [`check_manifests`], pause-test results relative to `dir`: a
/// directory of manifests loaded like a policy directory.
pub fn load_manifest_dir(dir: &Path, now: SystemTime) -> Result<PolicySet, CrdError> {
    let texts = read_manifest_dir(dir)?;
    let files: Vec<ManifestFile<'_>> = texts
        .iter()
        .map(|(path, text)| ManifestFile { path, text })
        .collect();
    if files.is_empty() {
        return Err(CrdError::NoClasses {
            what: format!("{} (no *.yaml files)", dir.display()),
        });
    }
    check_manifests(&files, Some(dir), now)
}

/// A change detector for a manifest directory, as
/// [`latchkey_policies::fingerprint`] is for a policy directory: a hash over
/// each manifest file's name and contents, in name order, and over each
/// pause-test result the LockClasses name (or its absence). Poll it, and
/// call [`load_manifest_dir`] when it changes; take it before loading.
pub fn manifest_fingerprint(dir: &Path) -> Result<u64, CrdError> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    // Fixed keys: equal directories hash equal within and across processes.
    let mut hash = DefaultHasher::new();
    let texts = read_manifest_dir(dir)?;
    let mut results = BTreeSet::new();
    for (path, text) in &texts {
        path.strip_prefix(dir).unwrap_or(path).hash(&mut hash);
        text.hash(&mut hash);
        // Read leniently: a file that does not parse names nothing here,
        // and the load reports it.
        for document in serde_norway::Deserializer::from_str(text) {
            let Ok(value) = serde_norway::Value::deserialize(document) else {
                break;
            };
            if let Some(result) = value
                .get("spec")
                .and_then(|spec| spec.get("pauseTest"))
                .and_then(|p| p.get("result"))
                .and_then(|r| r.as_str())
            {
                results.insert(result.to_owned());
            }
        }
    }
    for result in results {
        result.hash(&mut hash);
        let inside = Path::new(&result).components().all(|c| {
            matches!(
                c,
                std::path::Component::Normal(_) | std::path::Component::CurDir
            )
        });
        match fs::read(dir.join(&result)) {
            Ok(contents) if inside => contents.hash(&mut hash),
            _ => "(absent)".hash(&mut hash),
        }
    }
    Ok(hash.finish())
}

/// What `latchctl classes check PATH` loads: a policy directory (one with a
/// `classes/` subdirectory) with [`PolicySet::load_dir_at`]; otherwise a
/// manifest file or a directory of manifests with [`check_manifests`],
/// pause-test results read relative to `policy_root`, by default the
/// directory the manifests are in.
pub fn load_either(
    path: &Path,
    policy_root: Option<&Path>,
    now: SystemTime,
) -> Result<PolicySet, CrdError> {
    if path.join(latchkey_policies::CLASSES_DIR).is_dir() {
        return Ok(PolicySet::load_dir_at(path, now)?);
    }
    let texts = read_manifest_paths(&[path.to_path_buf()])?;
    let files: Vec<ManifestFile<'_>> = texts
        .iter()
        .map(|(path, text)| ManifestFile { path, text })
        .collect();
    let default_root = if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(Path::new("."))
    };
    check_manifests(&files, Some(policy_root.unwrap_or(default_root)), now)
}

/// The texts of manifest files named directly, and of the `*.yaml`/`*.yml`
/// files in directories named, in the order given (directories sorted).
pub fn read_manifest_paths(paths: &[PathBuf]) -> Result<Vec<(PathBuf, String)>, CrdError> {
    let mut out = Vec::new();
    for path in paths {
        if path.is_dir() {
            let texts = read_manifest_dir(path)?;
            if texts.is_empty() {
                return Err(CrdError::NoClasses {
                    what: format!("{} (no *.yaml files)", path.display()),
                });
            }
            out.extend(texts);
        } else {
            let text = fs::read_to_string(path).map_err(|source| CrdError::Io {
                path: path.clone(),
                source,
            })?;
            out.push((path.clone(), text));
        }
    }
    Ok(out)
}

/// The `*.yaml` and `*.yml` files directly in `dir` with their texts, sorted.
pub fn read_manifest_dir(dir: &Path) -> Result<Vec<(PathBuf, String)>, CrdError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CrdError::Io { path, source }
    };
    let mut paths = Vec::new();
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        let yaml = path
            .extension()
            .is_some_and(|ext| ext == "yaml" || ext == "yml");
        if !hidden && yaml && fs::metadata(&path).map_err(io(&path))?.is_file() {
            paths.push(path);
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = fs::read_to_string(&path).map_err(io(&path))?;
            Ok((path, text))
        })
        .collect()
}

fn check_located(
    located: &[(Resource, Origin)],
    today: Date,
    pause_tests: Option<(&Path, SystemTime)>,
) -> Result<PolicySet, CrdError> {
    // One policy file per object, named by its origin, so the loader's own
    // messages (and its duplicate-class check) name the manifest.
    let mut class_texts = Vec::new();
    let mut grant_texts = Vec::new();
    for (resource, origin) in located {
        match resource {
            Resource::Class(object) => {
                let class = policy_class(object, origin)?;
                if let Some((root, now)) = pause_tests {
                    class
                        .validate(today)
                        .and_then(|()| class.check_pause_test(root, now))
                        .map_err(|source| CrdError::Policy {
                            at: origin.at.clone(),
                            source,
                        })?;
                }
                let text = toml::to_string(&ClassFileOut { class: vec![class] })
                    .map_err(|e| internal(&origin.at, e))?;
                class_texts.push((PathBuf::from(&origin.at), text));
            }
            Resource::Grant(object) => {
                let mut file = GrantFileOut::default();
                if !object.spec.prefixes.is_empty() || !object.spec.operator {
                    file.grant.push(GrantOut {
                        identity: object.spec.identity.clone(),
                        prefixes: object.spec.prefixes.clone(),
                        classes: object.spec.classes.clone(),
                    });
                }
                if object.spec.operator {
                    file.operator.push(OperatorOut {
                        identity: object.spec.identity.clone(),
                    });
                }
                let text = toml::to_string(&file).map_err(|e| internal(&origin.at, e))?;
                grant_texts.push((PathBuf::from(&origin.at), text));
            }
        }
    }
    if class_texts.is_empty() {
        return Err(CrdError::NoClasses {
            what: "the manifests".into(),
        });
    }
    let class_files: Vec<PolicyFile<'_>> = class_texts
        .iter()
        .map(|(path, text)| PolicyFile { path, text })
        .collect();
    let grant_files: Vec<PolicyFile<'_>> = grant_texts
        .iter()
        .map(|(path, text)| PolicyFile { path, text })
        .collect();
    Ok(PolicySet::from_files(&class_files, &grant_files, today)?)
}

/// The policies crate's class for a LockClass object: the spec's fields plus
/// `name` from metadata, through the class table's own deserializer.
fn policy_class(
    object: &LockClass,
    origin: &Origin,
) -> Result<latchkey_policies::LockClass, CrdError> {
    let mut value = serde_json::to_value(&object.spec).map_err(|e| internal(&origin.at, e))?;
    if let Some(map) = value.as_object_mut() {
        map.insert(
            "name".into(),
            serde_json::Value::String(object.metadata.name.clone().unwrap_or_default()),
        );
    }
    serde_json::from_value(value).map_err(|e| CrdError::Manifest {
        at: origin.at.clone(),
        message: format!("LockClass spec: {e}"),
    })
}

fn namespace_of(meta: &ObjectMeta) -> String {
    meta.namespace.clone().unwrap_or_else(|| "default".into())
}

#[derive(Serialize)]
struct ClassFileOut {
    class: Vec<latchkey_policies::LockClass>,
}

#[derive(Serialize, Default)]
struct GrantFileOut {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    grant: Vec<GrantOut>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    operator: Vec<OperatorOut>,
}

#[derive(Serialize)]
struct GrantOut {
    identity: String,
    prefixes: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    classes: Option<Vec<String>>,
}

#[derive(Serialize)]
struct OperatorOut {
    identity: String,
}

/// A conversion step between two of our own plain-data types failed: a bug,
/// reported rather than panicked on.
fn internal(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> CrdError {
    CrdError::Internal {
        at: what.to_owned(),
        source: Box::new(e),
    }
}

/// The object name of `identity`'s grants for `classes` only: its grant
/// name, cut to leave room, and a hash of the identity and the classes (so
/// no other identity's plain name, nor another set of classes, is it).
fn scoped_grant_name(identity: &str, classes: &[String]) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for part in std::iter::once(identity).chain(classes.iter().map(String::as_str)) {
        for b in part.bytes().chain([0]) {
            hash ^= u32::from(b);
            hash = hash.wrapping_mul(0x0100_0193);
        }
    }
    let mut base = grant_name(identity);
    base.truncate(240);
    let base = base.trim_end_matches(['-', '.']);
    format!("{base}-c{hash:08x}")
}

/// A DNS-1123 subdomain, as Kubernetes requires of most object names.
pub fn is_object_name(name: &str) -> bool {
    let label_ok = |label: &str| {
        let bytes = label.as_bytes();
        !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
            && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
    };
    name.len() <= 253 && name.split('.').all(label_ok)
}

/// A readable object name for a SPIFFE ID: trust domain and path joined by
/// dots (`spiffe://td/workload/a` -> `td.workload.a`); when that is not a
/// valid name or loses information (case, `_`), a short hash of the
/// identity is appended, so distinct identities get distinct names.
pub fn grant_name(identity: &str) -> String {
    let rest = identity.strip_prefix("spiffe://").unwrap_or(identity);
    let mut name: String = rest
        .chars()
        .map(|c| match c {
            '/' => '.',
            'a'..='z' | '0'..='9' | '-' | '.' => c,
            _ => '-',
        })
        .collect();
    let lossless = rest
        .chars()
        .all(|c| matches!(c, 'a'..='z' | '0'..='9' | '-' | '.' | '/'));
    if lossless && is_object_name(&name) {
        return name;
    }
    name.truncate(200);
    let trimmed: String = name
        .split('.')
        .map(|label| label.trim_matches('-'))
        .filter(|label| !label.is_empty())
        .collect::<Vec<_>>()
        .join(".");
    let mut hash: u32 = 0x811c_9dc5;
    for b in identity.bytes() {
        hash = (hash ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    if trimmed.is_empty() {
        format!("grant-{hash:08x}")
    } else {
        format!("{trimmed}-{hash:08x}")
    }
}

/// The first TOML date-time in a hook config as JSON (toml serialises one
/// as a private single-key object), if any.
fn find_datetime(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::Object(map) => {
            if let (1, Some(v)) = (map.len(), map.get("$__toml_private_datetime")) {
                return Some(v.as_str().unwrap_or_default().to_owned());
            }
            map.values().find_map(find_datetime)
        }
        serde_json::Value::Array(items) => items.iter().find_map(find_datetime),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32: a conversion of our own data that fails keeps the
    /// serializer's error as the source, under the message it had.
    #[test]
    fn an_internal_conversion_error_keeps_its_source() {
        let e = serde_json::from_str::<u8>("x").unwrap_err();
        let text = e.to_string();
        let err = internal("f.yaml, document 1", e);
        assert_eq!(
            err.to_string(),
            format!("f.yaml, document 1: internal conversion error: {text}")
        );
        let source =
            std::error::Error::source(&err).and_then(|s| s.downcast_ref::<serde_json::Error>());
        assert!(source.is_some(), "{err:?}");
    }

    const CLASS: &str = "apiVersion: latchkey.dev/v1alpha1\nkind: LockClass\nmetadata:\n  \
        name: demo\n  namespace: team-a\nspec:\n  tier: coord\n  enforcement: advisory\n  \
        ttlSeconds: 30\n  riskOwner: t@example.com\n  waiverExpires: \"2099-01-01\"\n";

    fn today() -> Date {
        Date::parse("2026-01-15").unwrap()
    }

    fn check(text: &str) -> Result<PolicySet, String> {
        let path = Path::new("m.yaml");
        to_policy_texts(&[ManifestFile { path, text }], today()).map_err(|e| e.to_string())?;
        check_manifests(&[ManifestFile { path, text }], None, SystemTime::now())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_class_manifest_loads() {
        let set = check(CLASS).unwrap();
        assert_eq!(set.class("demo").unwrap().ttl_seconds, 30);
    }

    #[test]
    fn other_kinds_and_versions_are_refused_by_name() {
        let err = check(&CLASS.replace("kind: LockClass", "kind: LockClas")).unwrap_err();
        assert_eq!(
            err,
            "m.yaml, document 1: not a LockClass or LockGrant: found apiVersion \
             latchkey.dev/v1alpha1, kind LockClas; expected apiVersion latchkey.dev/v1alpha1 and \
             kind LockClass or LockGrant"
        );
        let err = check(&CLASS.replace("v1alpha1", "v1")).unwrap_err();
        assert!(
            err.contains("found apiVersion latchkey.dev/v1, kind LockClass"),
            "{err}"
        );
        // Empty documents are nothing, not an error.
        check(&format!("---\n---\n{CLASS}---\n")).unwrap();
    }

    #[test]
    fn unknown_spec_fields_are_refused() {
        let err = check(&CLASS.replace("ttlSeconds", "ttl")).unwrap_err();
        assert!(
            err.starts_with("m.yaml, document 1: LockClass: unknown field `ttl`"),
            "{err}"
        );
    }

    #[test]
    fn names_must_be_object_names() {
        let err = check(&CLASS.replace("name: demo", "name: Demo")).unwrap_err();
        assert!(
            err.contains("metadata.name \"Demo\" is not a Kubernetes object name"),
            "{err}"
        );
        let err = check(&CLASS.replace("namespace: team-a", "namespace: a.b")).unwrap_err();
        assert!(
            err.contains("metadata.namespace \"a.b\" is not a namespace name"),
            "{err}"
        );
        let err = check(&CLASS.replace("  name: demo\n", "")).unwrap_err();
        assert!(err.ends_with("metadata.name is missing"), "{err}");
    }

    #[test]
    fn a_class_defined_in_two_namespaces_is_refused_as_the_loader_would() {
        let twice = format!("{CLASS}---\n{}", CLASS.replace("team-a", "team-b"));
        let err = check(&twice).unwrap_err();
        assert_eq!(
            err,
            "lock class \"demo\" is defined twice, in m.yaml, document 1 (LockClass team-a/demo) \
             and in m.yaml, document 2 (LockClass team-b/demo): class names are global"
        );
        // The same object twice in one namespace is a duplicate object.
        let err = check(&format!("{CLASS}---\n{CLASS}")).unwrap_err();
        assert!(
            err.contains("LockClass \"demo\" is also defined at m.yaml, document 1"),
            "{err}"
        );
    }

    #[test]
    fn manifests_without_classes_are_refused() {
        let grant = "apiVersion: latchkey.dev/v1alpha1\nkind: LockGrant\nmetadata:\n  name: g\n\
                     spec:\n  identity: spiffe://td/a\n  prefixes: [p]\n";
        assert_eq!(
            check(grant).unwrap_err(),
            "no LockClass in the manifests: add at least one LockClass manifest"
        );
        let set = check(&format!("{CLASS}---\n{grant}")).unwrap();
        assert!(set.grants().allows(
            "spiffe://td/a",
            &latchkey_policies::LockKey::parse("p/q").unwrap()
        ));
    }

    #[test]
    fn invalid_yaml_is_refused_with_its_position() {
        let err = check("kind: [").unwrap_err();
        assert!(
            err.starts_with("m.yaml, document 1: not valid YAML"),
            "{err}"
        );
    }

    #[test]
    fn grant_names_are_object_names_and_distinct() {
        assert_eq!(
            grant_name("spiffe://dev.latchkey/workload/demo"),
            "dev.latchkey.workload.demo"
        );
        let a = grant_name("spiffe://td/Work_load/A");
        let b = grant_name("spiffe://td/work-load/a");
        assert!(is_object_name(&a), "{a}");
        assert_ne!(a, b);
        assert!(is_object_name(&grant_name("spiffe://td/-x-/.y")));
        assert!(is_object_name(&grant_name(&format!(
            "spiffe://td/{}",
            "x".repeat(400)
        ))));
    }

    #[test]
    fn the_fingerprint_sees_manifests_and_pause_test_results() {
        let dir = tempfile::tempdir().unwrap();
        let fenced = "apiVersion: latchkey.dev/v1alpha1\nkind: LockClass\nmetadata:\n  name: f\n\
                      spec:\n  tier: coord\n  enforcement: fenced\n  pauseTest:\n    \
                      resource: postgresql:t.rows\n    result: pause-tests/f.json\n";
        std::fs::write(dir.path().join("a.yaml"), CLASS).unwrap();
        let first = manifest_fingerprint(dir.path()).unwrap();
        assert_eq!(first, manifest_fingerprint(dir.path()).unwrap());
        std::fs::write(dir.path().join("b.yml"), fenced).unwrap();
        let second = manifest_fingerprint(dir.path()).unwrap();
        assert_ne!(first, second);
        std::fs::create_dir(dir.path().join("pause-tests")).unwrap();
        std::fs::write(dir.path().join("pause-tests/f.json"), "{}").unwrap();
        let third = manifest_fingerprint(dir.path()).unwrap();
        assert_ne!(second, third);
        // Other files do not count.
        std::fs::write(dir.path().join("README.md"), "x").unwrap();
        std::fs::write(dir.path().join(".a.yaml.swp"), "x").unwrap();
        assert_eq!(third, manifest_fingerprint(dir.path()).unwrap());
        // And the directory loads, with the fenced class's result read
        // relative to it: "{}" is not a result, so it is refused.
        let err = load_manifest_dir(dir.path(), SystemTime::now())
            .unwrap_err()
            .to_string();
        assert!(err.contains("(LockClass default/f): lock class \"f\": enforcement = \"fenced\" but no passing pause test"), "{err}");
    }

    #[test]
    fn waiver_dates_are_quoted_for_yaml_1_1_readers() {
        let path = Path::new("m.yaml");
        let resources = parse_manifests(&[ManifestFile { path, text: CLASS }]).unwrap();
        let text = to_yaml(&resources);
        assert!(text.contains("\n  waiverExpires: '2099-01-01'\n"), "{text}");
        assert_eq!(
            parse_manifests(&[ManifestFile { path, text: &text }]).unwrap(),
            resources
        );
    }

    #[test]
    fn load_either_takes_both_forms() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("m.yaml"), CLASS).unwrap();
        let from_dir = load_either(dir.path(), None, SystemTime::now()).unwrap();
        let from_file = load_either(&dir.path().join("m.yaml"), None, SystemTime::now()).unwrap();
        assert_eq!(from_dir, from_file);
        let texts = to_policy_texts(
            &[ManifestFile {
                path: Path::new("m.yaml"),
                text: CLASS,
            }],
            today(),
        )
        .unwrap();
        let policy = tempfile::tempdir().unwrap();
        texts.write_to(policy.path()).unwrap();
        assert_eq!(
            load_either(policy.path(), None, SystemTime::now()).unwrap(),
            from_dir
        );
        let empty = tempfile::tempdir().unwrap();
        let err = load_either(empty.path(), None, SystemTime::now()).unwrap_err();
        assert!(err.to_string().contains("(no *.yaml files)"), "{err}");
        let err = load_either(&dir.path().join("none.yaml"), None, SystemTime::now()).unwrap_err();
        assert!(err.to_string().starts_with("cannot read "), "{err}");
    }

    #[test]
    fn object_names() {
        for ok in ["a", "demo", "payments-ledger.v2", "0"] {
            assert!(is_object_name(ok), "{ok}");
        }
        for bad in [
            "",
            "A",
            "-a",
            "a-",
            "a..b",
            ".a",
            "a_b",
            "a/b",
            &"a".repeat(254),
        ] {
            assert!(!is_object_name(bad), "{bad}");
        }
    }

    #[test]
    fn hook_config_datetimes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("classes")).unwrap();
        std::fs::create_dir_all(dir.path().join("grants")).unwrap();
        std::fs::write(
            dir.path().join("classes/c.toml"),
            "[[class]]\nname = \"c\"\ntier = \"coord\"\nenforcement = \"advisory\"\n\
             ttlSeconds = 30\nriskOwner = \"t@example.com\"\nwaiverExpires = \"2099-01-01\"\n\
             [class.hook]\nmodule = \"h.wasm\"\n[class.hook.config]\nfrom = 2026-01-01T00:00:00Z\n",
        )
        .unwrap();
        let set = PolicySet::load_dir(dir.path(), today()).unwrap();
        let err = from_policy(&set, DEFAULT_NAMESPACE)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "lock class \"c\": hook.config holds a TOML date or time (2026-01-01T00:00:00Z), \
             which JSON and Kubernetes cannot carry; write it as a string"
        );
    }

    #[test]
    fn grants_that_would_share_an_object_name_are_refused_not_merged() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("classes")).unwrap();
        std::fs::create_dir_all(dir.path().join("grants")).unwrap();
        std::fs::write(
            dir.path().join("classes/c.toml"),
            "[[class]]\nname = \"c\"\ntier = \"coord\"\nenforcement = \"advisory\"\n\
             ttlSeconds = 30\nriskOwner = \"t@example.com\"\nwaiverExpires = \"2099-01-01\"\n",
        )
        .unwrap();
        // Two identities (two trust domains) with one readable name.
        std::fs::write(
            dir.path().join("grants/g.toml"),
            "[[grant]]\nidentity = \"spiffe://a.b/c\"\nprefixes = [\"x\"]\n\
             [[grant]]\nidentity = \"spiffe://a/b/c\"\nprefixes = [\"y\"]\nclasses = [\"c\"]\n",
        )
        .unwrap();
        let set = PolicySet::load_dir(dir.path(), today()).unwrap();
        // The scoped grant has a name of its own: no collision.
        let objects = from_policy(&set, DEFAULT_NAMESPACE).unwrap();
        let names: Vec<String> = objects
            .iter()
            .filter_map(|r| match r {
                Resource::Grant(g) => g.metadata.name.clone(),
                _ => None,
            })
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.iter().all(|n| is_object_name(n)), "{names:?}");
        // Unscoped, the two collide: an error, never one over the other.
        std::fs::write(
            dir.path().join("grants/g.toml"),
            "[[grant]]\nidentity = \"spiffe://a.b/c\"\nprefixes = [\"x\"]\n\
             [[grant]]\nidentity = \"spiffe://a/b/c\"\nprefixes = [\"y\"]\n",
        )
        .unwrap();
        let set = PolicySet::load_dir(dir.path(), today()).unwrap();
        let err = from_policy(&set, DEFAULT_NAMESPACE).unwrap_err();
        assert!(matches!(err, CrdError::GrantNameCollision { .. }), "{err}");
    }

    #[test]
    fn class_names_that_are_not_object_names_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("classes")).unwrap();
        std::fs::create_dir_all(dir.path().join("grants")).unwrap();
        std::fs::write(
            dir.path().join("classes/c.toml"),
            "[[class]]\nname = \"Batch Report\"\ntier = \"coord\"\nenforcement = \"advisory\"\n\
             ttlSeconds = 30\nriskOwner = \"t@example.com\"\nwaiverExpires = \"2099-01-01\"\n",
        )
        .unwrap();
        let set = PolicySet::load_dir(dir.path(), today()).unwrap();
        let err = from_policy(&set, DEFAULT_NAMESPACE)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("lock class \"Batch Report\" cannot be a Kubernetes object name"),
            "{err}"
        );
    }
}
