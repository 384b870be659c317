//! The fencing token as a value that cannot leak by accident.

use std::fmt;

/// The fencing token of a grant: `epoch * 2^48 + revision`.
///
/// A token is a capability at the resource, so `Debug` and `Display` print
/// `FencingToken(<redacted>)`; call [`FencingToken::get`] at the one place
/// that hands it to the resource (a conditional write, a header).
///
/// ```
/// use latchkey_client::FencingToken;
///
/// let token = FencingToken::new((1 << 48) + 42);
/// assert_eq!(format!("{token:?}"), "FencingToken(<redacted>)");
/// assert_eq!(token.get() >> 48, 1); // the epoch
/// assert!(FencingToken::new((2 << 48) + 1) > token); // a later epoch wins
/// ```
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// A token as the arbiter sent it (e.g. read back from `latchctl`'s
    /// output to release a detached grant).
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The integer to compare at the resource. A larger token is a later grant.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FencingToken(<redacted>)")
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FencingToken(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_and_display_redact() {
        let token = FencingToken::new(281_474_976_710_699);
        assert_eq!(format!("{token:?}"), "FencingToken(<redacted>)");
        assert_eq!(format!("{token}"), "FencingToken(<redacted>)");
        assert_eq!(format!("{token:#?}"), "FencingToken(<redacted>)");
        assert_eq!(token.get(), 281_474_976_710_699);
    }
}
