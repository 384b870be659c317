//! Deliberately broken behaviours, compiled only with the `test-faults` cargo
//! feature, so the release gate can prove that its checker catches a broken
//! arbiter (ADR-23), and timing wideners that make a rare interleaving
//! certain in a regression test. A release build (`cargo build -p
//! latchkey-arbiter`) has only [`TestFault::None`] and no flag to choose
//! anything else.

/// Which deliberate bug the arbiter runs with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TestFault {
    /// The real arbiter.
    #[default]
    None,
    /// Any event on a contended key's watch (a release, an expiry, a
    /// hand-over to another arbiter's waiter) grants the head waiter with a
    /// blind put, without the grant transaction's compares: the event is
    /// taken as the grant instead of a hint to try one. With waiters on two
    /// arbiters this hands out a second grant for a held key.
    #[cfg(feature = "test-faults")]
    GrantOnWatch,
    /// Not a bug: waits [`SLOW_REUSE`] between reading a session's existing
    /// grant and claiming it for the session's new call, so an orphan
    /// release of that grant finishes in between.
    #[cfg(feature = "test-faults")]
    SlowReuse,
}

/// How long [`TestFault::SlowReuse`] waits.
#[cfg(feature = "test-faults")]
pub const SLOW_REUSE: std::time::Duration = std::time::Duration::from_millis(500);

impl TestFault {
    #[cfg(feature = "test-faults")]
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "none" => Ok(Self::None),
            "grant-on-watch" => Ok(Self::GrantOnWatch),
            "slow-reuse" => Ok(Self::SlowReuse),
            other => Err(format!(
                "unknown test fault {other:?}: expected none, grant-on-watch or slow-reuse"
            )),
        }
    }

    /// The flag value [`TestFault::parse`] reads.
    #[cfg(feature = "test-faults")]
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::GrantOnWatch => "grant-on-watch",
            Self::SlowReuse => "slow-reuse",
        }
    }
}
