//! The fencing token (ADR-02): `epoch × 2^48 + revision`, where `revision` is
//! the etcd revision at which the granting transaction committed. Revisions
//! are cluster-wide and never reused within a cluster's life; the epoch moves
//! the whole space up after a restore. The epoch stays below 2^15 so a token
//! is positive in a signed 64-bit column.

/// Bits of the token that hold the revision.
pub const REVISION_BITS: u32 = 48;
/// Epochs are `1..MAX_EPOCH`.
pub const MAX_EPOCH: u32 = 1 << 15;
const REVISION_MASK: u64 = (1 << REVISION_BITS) - 1;

/// Packs a token, or `None` if either half is out of range (refuse, never wrap).
pub fn pack(epoch: u32, revision: i64) -> Option<u64> {
    if epoch == 0 || epoch >= MAX_EPOCH || revision <= 0 {
        return None;
    }
    let revision = u64::try_from(revision).ok()?;
    if revision > REVISION_MASK {
        return None;
    }
    Some((u64::from(epoch) << REVISION_BITS) | revision)
}

/// Splits a token into (epoch, revision).
pub fn unpack(token: u64) -> (u32, i64) {
    let epoch = u32::try_from(token >> REVISION_BITS).unwrap_or(u32::MAX);
    let revision = i64::try_from(token & REVISION_MASK).unwrap_or(i64::MAX);
    (epoch, revision)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_order() {
        let a = pack(1, 10).unwrap_or_default();
        let b = pack(1, 11).unwrap_or_default();
        let c = pack(2, 3).unwrap_or_default();
        assert!(a < b && b < c, "a later epoch dominates any revision");
        assert_eq!(unpack(c), (2, 3));
        assert!(i64::try_from(pack(MAX_EPOCH - 1, (1 << 48) - 1).unwrap_or_default()).is_ok());
    }

    #[test]
    fn refuses_out_of_range() {
        assert_eq!(pack(0, 1), None);
        assert_eq!(pack(MAX_EPOCH, 1), None);
        assert_eq!(pack(1, 0), None);
        assert_eq!(pack(1, 1 << 48), None);
    }
}
