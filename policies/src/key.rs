//! Lock keys: the names callers lock, and the one place their syntax is decided.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The longest lock key accepted, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 512;

/// How many characters of a rejected key an error message repeats.
///
/// Errors travel into logs and RPC statuses; a 512-byte key pasted into every
/// line helps nobody, and an unbounded one would be a log-flooding vector.
pub const ECHO_CHARS: usize = 64;

/// A validated lock key such as `payments/invoice/42`.
///
/// The rules below are the public contract: the arbiter, the Envoy filter and
/// the client libraries all accept exactly the keys [`LockKey::parse`] accepts.
///
/// - not empty, and at most [`MAX_KEY_BYTES`] (512) bytes of UTF-8;
/// - printable text only: no control characters (`\0`, `\t`, `\n`, DEL and
///   the rest of Unicode category Cc), no invisible format characters
///   (category Cf, e.g. zero-width space U+200B, bidi override U+202E, BOM
///   U+FEFF) and no line or paragraph separators (U+2028, U+2029). Spaces
///   and non-ASCII letters are allowed;
/// - `/` separates path segments; the key must not start or end with `/`,
///   and no segment may be empty (`a//b`), `.` or `..`.
///
/// The first segment is the key's namespace ([`LockKey::namespace`]): the
/// unit that grants are usually written against and that metrics are
/// labelled by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LockKey(String);

impl LockKey {
    /// Validates `input` against the rules on [`LockKey`].
    pub fn parse(input: &str) -> Result<LockKey, KeyError> {
        validate(input)?;
        Ok(LockKey(input.to_owned()))
    }

    /// The key as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first path segment, e.g. `payments` for `payments/invoice/42`.
    ///
    /// Bounded in cardinality by the grant table, so it is safe as a metrics
    /// label where the full key is not (ADR-22).
    pub fn namespace(&self) -> &str {
        self.0.split('/').next().unwrap_or(&self.0)
    }

    /// The path segments, in order.
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a key is never empty. Present for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for LockKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for LockKey {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LockKey::parse(s)
    }
}

impl TryFrom<String> for LockKey {
    type Error = KeyError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        validate(&s)?;
        Ok(LockKey(s))
    }
}

impl From<LockKey> for String {
    fn from(key: LockKey) -> String {
        key.0
    }
}

/// Why a string is not a lock key.
///
/// Every message says what is wrong, where, and what a valid key looks like.
/// Echoed keys are cut to [`ECHO_CHARS`] characters and escaped, so a message
/// never carries control characters or a huge input back out.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KeyError {
    #[error("lock key is empty: keys are '/'-separated names like \"payments/invoice/42\"")]
    Empty,

    #[error(
        "lock key is {len} bytes, over the limit of {max} bytes (starts \"{excerpt}\"): \
         use a shorter name, e.g. an id or a hash of the long part"
    )]
    TooLong {
        len: usize,
        max: usize,
        excerpt: String,
    },

    #[error(
        "lock key contains the invisible or control character {codepoint} at byte {at} \
         (\"{excerpt}\"): keys must be printable text"
    )]
    UnprintableChar {
        /// The offending character as `U+XXXX`.
        codepoint: String,
        at: usize,
        excerpt: String,
    },

    #[error(
        "lock key starts with '/' (\"{excerpt}\"): keys are relative, like \"payments/invoice/42\""
    )]
    LeadingSlash { excerpt: String },

    #[error(
        "lock key ends with '/' (\"{excerpt}\"): remove the trailing '/'; keys are \
         '/'-separated names like \"payments/invoice/42\""
    )]
    TrailingSlash { excerpt: String },

    #[error(
        "lock key has an empty path segment at byte {at} (\"{excerpt}\"): keys are \
         '/'-separated names like \"payments/invoice/42\""
    )]
    EmptySegment { at: usize, excerpt: String },

    #[error(
        "lock key has a \"{segment}\" path segment at byte {at} (\"{excerpt}\"): '.' and '..' \
         are not allowed as segments, so a key always names itself"
    )]
    DotSegment {
        segment: &'static str,
        at: usize,
        excerpt: String,
    },
}

/// Validates without allocating unless the input is rejected.
///
/// Also used for grant prefixes and, with the extra `/` check, class names.
pub(crate) fn validate(input: &str) -> Result<(), KeyError> {
    if input.is_empty() {
        return Err(KeyError::Empty);
    }
    // Length first, so an oversized input is never scanned further.
    if input.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong {
            len: input.len(),
            max: MAX_KEY_BYTES,
            excerpt: excerpt(input),
        });
    }
    if let Some((at, c)) = input.char_indices().find(|&(_, c)| !is_printable(c)) {
        return Err(KeyError::UnprintableChar {
            codepoint: format!("U+{:04X}", u32::from(c)),
            at,
            excerpt: excerpt(input),
        });
    }
    if input.starts_with('/') {
        return Err(KeyError::LeadingSlash {
            excerpt: excerpt(input),
        });
    }
    if input.ends_with('/') {
        return Err(KeyError::TrailingSlash {
            excerpt: excerpt(input),
        });
    }
    let mut at = 0;
    for segment in input.split('/') {
        match segment {
            "" => {
                return Err(KeyError::EmptySegment {
                    at,
                    excerpt: excerpt(input),
                });
            }
            "." | ".." => {
                return Err(KeyError::DotSegment {
                    segment: if segment == "." { "." } else { ".." },
                    at,
                    excerpt: excerpt(input),
                });
            }
            _ => {}
        }
        at += segment.len() + 1;
    }
    Ok(())
}

/// True for characters a person can see (or a plain space).
///
/// Rejects Unicode categories Cc (control), Cf (format: invisible characters
/// that can make two different keys look identical, or reorder text in a
/// terminal) and Zl/Zp (line and paragraph separators). The Cf table is
/// written out because the crate carries no Unicode tables; it is the full
/// Cf list as of Unicode 15.1.
pub(crate) fn is_printable(c: char) -> bool {
    if c.is_control() {
        return false;
    }
    if c.is_ascii() {
        return true;
    }
    !matches!(
        u32::from(c),
        0x00AD
            | 0x0600..=0x0605
            | 0x061C
            | 0x06DD
            | 0x070F
            | 0x0890..=0x0891
            | 0x08E2
            | 0x180E
            | 0x200B..=0x200F
            | 0x2028..=0x202E
            | 0x2060..=0x2064
            | 0x2066..=0x206F
            | 0xFEFF
            | 0xFFF9..=0xFFFB
            | 0x110BD
            | 0x110CD
            | 0x13430..=0x1343F
            | 0x1BCA0..=0x1BCA3
            | 0x1D173..=0x1D17A
            | 0xE0001
            | 0xE0020..=0xE007F
    )
}

/// The first [`ECHO_CHARS`] characters of `input`, escaped for a log line,
/// with `…` when cut.
pub(crate) fn excerpt(input: &str) -> String {
    let mut out = String::new();
    let mut chars = input.chars();
    for c in chars.by_ref().take(ECHO_CHARS) {
        out.extend(c.escape_debug());
    }
    if chars.next().is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_keys() {
        for ok in [
            "a",
            "payments/invoice/42",
            "shared/cron/nightly report",
            "zürich/ledger",
            "a.b/..c/.d.",
            "日本/注文/7",
        ] {
            let key = LockKey::parse(ok).unwrap();
            assert_eq!(key.as_str(), ok);
        }
    }

    #[test]
    fn namespace_is_first_segment() {
        assert_eq!(
            LockKey::parse("payments/invoice/42").unwrap().namespace(),
            "payments"
        );
        assert_eq!(LockKey::parse("solo").unwrap().namespace(), "solo");
        let key = LockKey::parse("a/b/c").unwrap();
        assert_eq!(key.segments().collect::<Vec<_>>(), ["a", "b", "c"]);
    }

    #[test]
    fn rejects_empty() {
        assert_eq!(LockKey::parse(""), Err(KeyError::Empty));
    }

    #[test]
    fn length_limit_is_in_bytes() {
        assert!(LockKey::parse(&"a".repeat(MAX_KEY_BYTES)).is_ok());
        let err = LockKey::parse(&"a".repeat(MAX_KEY_BYTES + 1)).unwrap_err();
        assert!(matches!(
            err,
            KeyError::TooLong {
                len: 513,
                max: 512,
                ..
            }
        ));
        // 171 three-byte characters is 513 bytes but only 171 chars.
        let wide = "€".repeat(171);
        assert!(matches!(
            LockKey::parse(&wide),
            Err(KeyError::TooLong { len: 513, .. })
        ));
    }

    #[test]
    fn rejects_control_and_format_characters() {
        for (bad, at, cp) in [
            ("a\0b", 1, "U+0000"),
            ("a\tb", 1, "U+0009"),
            ("a\nb", 1, "U+000A"),
            ("a\u{7f}", 1, "U+007F"),
            ("a\u{85}", 1, "U+0085"),
            ("ab\u{200b}c", 2, "U+200B"),
            ("\u{202e}abc", 0, "U+202E"),
            ("a\u{feff}", 1, "U+FEFF"),
            ("a\u{2028}", 1, "U+2028"),
            ("a\u{e0041}", 1, "U+E0041"),
        ] {
            match LockKey::parse(bad) {
                Err(KeyError::UnprintableChar {
                    at: got_at,
                    codepoint,
                    ..
                }) => {
                    assert_eq!((got_at, codepoint.as_str()), (at, cp), "{bad:?}");
                }
                other => panic!("{bad:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn rejects_bad_slashes() {
        assert!(matches!(
            LockKey::parse("/a"),
            Err(KeyError::LeadingSlash { .. })
        ));
        assert!(matches!(
            LockKey::parse("a/"),
            Err(KeyError::TrailingSlash { .. })
        ));
        assert!(matches!(
            LockKey::parse("/"),
            Err(KeyError::LeadingSlash { .. })
        ));
        assert_eq!(
            LockKey::parse("ab//c"),
            Err(KeyError::EmptySegment {
                at: 3,
                excerpt: "ab//c".into()
            })
        );
    }

    #[test]
    fn rejects_dot_segments() {
        assert_eq!(
            LockKey::parse("."),
            Err(KeyError::DotSegment {
                segment: ".",
                at: 0,
                excerpt: ".".into()
            })
        );
        assert_eq!(
            LockKey::parse("a/../b"),
            Err(KeyError::DotSegment {
                segment: "..",
                at: 2,
                excerpt: "a/../b".into()
            })
        );
        assert!(matches!(
            LockKey::parse("a/."),
            Err(KeyError::DotSegment { at: 2, .. })
        ));
    }

    #[test]
    fn messages_are_actionable() {
        let msg = LockKey::parse("ab//c").unwrap_err().to_string();
        assert_eq!(
            msg,
            "lock key has an empty path segment at byte 3 (\"ab//c\"): keys are \
             '/'-separated names like \"payments/invoice/42\""
        );
    }

    #[test]
    fn messages_never_echo_huge_or_raw_input() {
        let huge = format!("{}/", "x".repeat(400));
        let msg = LockKey::parse(&huge).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("\"{}…\"", "x".repeat(ECHO_CHARS))),
            "{msg}"
        );
        assert!(msg.len() < 300, "{msg}");

        let over = "y".repeat(100_000);
        let msg = LockKey::parse(&over).unwrap_err().to_string();
        assert!(msg.len() < 300, "{msg}");

        let msg = LockKey::parse("a\nb").unwrap_err().to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("a\\nb"), "{msg}");

        // Truncation is by character, so a multi-byte character at the cut is safe.
        let msg = LockKey::parse(&format!("{}/", "é".repeat(300)))
            .unwrap_err()
            .to_string();
        assert!(msg.contains('…'));
    }

    #[test]
    fn serde_round_trip_validates() {
        #[derive(Debug, Deserialize)]
        struct Doc {
            key: LockKey,
        }
        let doc: Doc = toml::from_str("key = \"a/b\"").unwrap();
        assert_eq!(doc.key.as_str(), "a/b");
        let err = toml::from_str::<Doc>("key = \"a//b\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty path segment"), "{err}");
    }
}
