//! FNV-1a, 64-bit: a tiny, stable content hash for version numbers and
//! change detection. Not collision-resistant against an adversary, which is
//! fine: the inputs are reviewed files, and the hashes only say "changed".

const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Fnv1a(u64);

impl Fnv1a {
    pub(crate) fn new() -> Fnv1a {
        Fnv1a(OFFSET_BASIS)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(PRIME);
        }
    }

    /// Writes a length-prefixed field, so ("ab", "c") and ("a", "bc") differ.
    pub(crate) fn write_field(&mut self, bytes: &[u8]) {
        self.write_u64(bytes.len() as u64);
        self.write(bytes);
    }

    pub(crate) fn write_u64(&mut self, n: u64) {
        self.write(&n.to_le_bytes());
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0
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
