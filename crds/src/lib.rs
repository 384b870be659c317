//! The LockClass and LockGrant custom resources of Latchkey (ADR-24), and
//! their conversion to and from the reviewed policy files the arbiter loads.
//!
//! A class change flows like this: a team edits a LockClass manifest in the
//! class repository; CI runs `latchctl classes check` on it (the loader's
//! rules, pause-test results included, via [`check_manifests`]); Argo CD
//! applies it, and the API server checks the schema and CEL rules of the
//! CRDs generated from [`resources`] (committed under deploy/crds/); the
//! arbiter loads the same manifests with [`load_manifest_dir`], which turns
//! each object into a one-table policy file and builds the
//! [`latchkey_policies::PolicySet`] with the loader itself, so the two forms
//! can never be checked by different rules. [`from_policy`] and
//! [`to_policy_texts`] convert existing policy directories either way.
//!
//! Only kube's derive and core types are used: no client, no runtime.

mod convert;
pub mod resources;

pub use convert::{
    CrdError, DEFAULT_NAMESPACE, ManifestFile, PolicyTexts, Resource, check_manifests, from_policy,
    grant_name, is_object_name, load_either, load_manifest_dir, manifest_fingerprint,
    parse_manifests, policy_dir_to_yaml, read_manifest_dir, read_manifest_paths, to_policy_texts,
    to_yaml,
};
pub use resources::{
    API_VERSION, Enforcement, Fairness, GROUP, HookInput, HookSpec, LockClass, LockClassSpec,
    LockGrant, LockGrantSpec, OnQuorumLoss, PauseTestSpec, Tier, VERSION, crd_files,
};
