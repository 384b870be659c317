//! Deliberately broken behaviours, compiled only with the `test-faults` cargo
//! feature, so the release gate can prove that its checker catches a broken
//! arbiter (ADR-23). A release build (`cargo build -p latchkey-arbiter`) has
//! only [`TestFault::None`] and no flag to choose anything else.

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
}

impl TestFault {
    #[cfg(feature = "test-faults")]
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "none" => Ok(Self::None),
            "grant-on-watch" => Ok(Self::GrantOnWatch),
            other => Err(format!(
                "unknown test fault {other:?}: expected none or grant-on-watch"
            )),
        }
    }
}
