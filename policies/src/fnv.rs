//! FNV-1a, 64-bit (the `fnv` crate): a tiny, stable content hash for
//! version numbers and change detection. Not collision-resistant against an
//! adversary, which is fine: the inputs are reviewed files, and the hashes
//! only say "changed".

use std::hash::Hasher;

use fnv::FnvHasher;

#[derive(Default)]
pub(crate) struct Fnv1a(FnvHasher);

impl Fnv1a {
    pub(crate) fn new() -> Fnv1a {
        Fnv1a::default()
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// Writes a length-prefixed field, so ("ab", "c") and ("a", "bc") differ.
    pub(crate) fn write_field(&mut self, bytes: &[u8]) {
        self.write_u64(bytes.len() as u64);
        self.write(bytes);
    }

    /// Little-endian on every target (std's `Hasher::write_u64` is native).
    pub(crate) fn write_u64(&mut self, n: u64) {
        self.write(&n.to_le_bytes());
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_reference_vectors() {
        let hash = |s: &str| {
            let mut h = Fnv1a::new();
            h.write(s.as_bytes());
            h.finish()
        };
        assert_eq!(hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn fields_are_delimited() {
        let pair = |a: &str, b: &str| {
            let mut h = Fnv1a::new();
            h.write_field(a.as_bytes());
            h.write_field(b.as_bytes());
            h.finish()
        };
        assert_ne!(pair("ab", "c"), pair("a", "bc"));
    }
}
