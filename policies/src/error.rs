//! The error every public operation of the crate returns.

use std::path::PathBuf;

use thiserror::Error;

use crate::class::ClassError;
use crate::key::KeyError;

/// A policy that cannot be loaded or used, and why.
///
/// Messages are written for the person reviewing a policy change: each names
/// the file (when there is one), the class or identity, and the rule broken.
/// The message of the underlying cause is included in the text, so printing
/// the top-level error with `{}` is enough for a CLI or a CI comment.
#[derive(Debug, Error)]
pub enum PolicyError {
    #[error("{}: {source}", path.display())]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<PolicyError>,
    },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The TOML is malformed or has a field of the wrong type or an unknown
    /// field; the message carries line and column.
    #[error("{source}")]
    Toml {
        #[source]
        source: toml::de::Error,
    },

    #[error("no lock classes defined in {}: add a *.toml file with a [[class]] table", dir.display())]
    NoClasses { dir: PathBuf },

    #[error("file defines no [[class]] tables; each file in classes/ must define at least one")]
    EmptyClassFile,

    #[error(
        "lock class \"{name}\" is defined twice, in {} and in {}: class names are global",
        first.display(),
        second.display()
    )]
    DuplicateClass {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },

    #[error("lock class \"{class}\": {source}")]
    InvalidClass {
        /// The class name, cut and escaped like an echoed key.
        class: String,
        #[source]
        source: ClassError,
    },

    #[error(
        "\"{identity}\" is not a SPIFFE ID ({source}): identities look like \
         \"spiffe://trust-domain/workload/name\""
    )]
    InvalidIdentity {
        /// The identity as written, cut and escaped like an echoed key.
        identity: String,
        #[source]
        source: spiffe::SpiffeIdError,
    },

    #[error(
        "grant subject {subject} covers a whole trust domain: a pattern needs at least one path segment before \"/*\", e.g. \"spiffe://td/ns/payments/sa/ledger/*\""
    )]
    PatternTooWide {
        /// The subject as written, cut and escaped like an echoed key.
        subject: String,
    },

    #[error("grant for {identity} has an invalid prefix: {source}")]
    InvalidPrefix {
        identity: String,
        #[source]
        source: KeyError,
    },

    #[error(
        "grant for {identity} lists no prefixes: give at least one, e.g. prefixes = [\"payments\"]"
    )]
    GrantWithoutPrefixes { identity: String },

    #[error(
        "grant for {identity} lists no classes: remove classes to grant the prefixes for any class, or name at least one, e.g. classes = [\"quota\"]"
    )]
    GrantWithoutClasses { identity: String },

    #[error(
        "prefix {prefix:?} is granted to {identity} for any class in one grant and for some classes only in another: keep one (list every class it is for, or none)"
    )]
    GrantScopesDiffer { identity: String, prefix: String },

    #[error(
        "grant for {identity} names class {class:?}, which no class file defines: define the class or fix the name"
    )]
    GrantUnknownClass { identity: String, class: String },
}

impl PolicyError {
    pub(crate) fn in_file(self, path: impl Into<PathBuf>) -> PolicyError {
        PolicyError::InFile {
            path: path.into(),
            source: Box::new(self),
        }
    }
}
