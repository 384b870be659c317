//! A small deterministic generator (splitmix64), the same as the checker's
//! reference simulation uses: a seed is a run, on every platform, with no
//! dependency whose stream could change under us.

/// splitmix64: fast, tiny, and good enough to pick faults and delays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        let draw = self.next_u64();
        if n == 0 { 0 } else { draw % n }
    }

    /// True with `percent` percent probability (100 or more: always).
    pub fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < u64::from(percent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_is_a_stream() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        let first: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let second: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        assert_eq!(first, second);
        let mut c = Rng::new(43);
        assert_ne!(first[0], c.next_u64());
    }

    #[test]
    fn below_and_chance_stay_in_range() {
        let mut rng = Rng::new(1);
        for _ in 0..1000 {
            assert!(rng.below(7) < 7);
        }
        assert_eq!(rng.below(0), 0);
        assert!((0..100).all(|_| rng.chance(100)));
        assert!((0..100).all(|_| !rng.chance(0)));
    }
}
