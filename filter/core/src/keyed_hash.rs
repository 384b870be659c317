//! SipHash-2-4 with a secret: where an owner (a key or an identity) lands in
//! the admission tables, and the fingerprint a slot stores for it.
//!
//! The placement must not be computable by a caller: with a public hash a
//! tenant could pick keys of its own namespace whose slots crowd another
//! tenant's key (issue 10). SipHash is a keyed PRF built for exactly this
//! (hash-flooding resistance); proxy-wasm on `wasm32-unknown-unknown` has no
//! `getrandom`, so the secret comes from whoever deploys the filter (the
//! plugin configuration's `admission_secret`), see [`AdmissionSecret`].

use std::fmt;

use serde::{Deserialize, Deserializer};

/// 128 bits of secret. `Debug` never shows it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct AdmissionSecret {
    k0: u64,
    k1: u64,
}

impl fmt::Debug for AdmissionSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdmissionSecret(<redacted>)")
    }
}

/// Why a configured secret was refused (never echoes the value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("admission_secret must be exactly 32 hex digits (16 random bytes)")]
pub struct BadSecret;

impl AdmissionSecret {
    pub const BYTES: usize = 16;

    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        let (a, b) = bytes.split_at(8);
        let word = |s: &[u8]| {
            let mut w = [0u8; 8];
            w.copy_from_slice(s);
            u64::from_le_bytes(w)
        };
        Self {
            k0: word(a),
            k1: word(b),
        }
    }

    pub fn to_bytes(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        for (dst, src) in out.iter_mut().zip(
            self.k0
                .to_le_bytes()
                .into_iter()
                .chain(self.k1.to_le_bytes()),
        ) {
            *dst = src;
        }
        out
    }

    /// 32 hex digits.
    pub fn from_hex(hex: &str) -> Result<Self, BadSecret> {
        let hex = hex.as_bytes();
        if hex.len() != 2 * Self::BYTES {
            return Err(BadSecret);
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(BadSecret),
        };
        let mut bytes = [0u8; 16];
        for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
            let [hi, lo] = [pair.first(), pair.get(1)].map(|c| c.copied().unwrap_or(b'x'));
            *byte = (nibble(hi)? << 4) | nibble(lo)?;
        }
        Ok(Self::from_bytes(bytes))
    }

    /// SipHash-2-4 of `data` under this secret.
    pub fn hash(&self, data: &[u8]) -> u64 {
        siphash24(self.k0, self.k1, data)
    }
}

impl<'de> Deserialize<'de> for AdmissionSecret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        AdmissionSecret::from_hex(&s).map_err(serde::de::Error::custom)
    }
}

fn siphash24(k0: u64, k1: u64, data: &[u8]) -> u64 {
    let mut v = [
        0x736f_6d65_7073_6575 ^ k0,
        0x646f_7261_6e64_6f6d ^ k1,
        0x6c79_6765_6e65_7261 ^ k0,
        0x7465_6462_7974_6573 ^ k1,
    ];
    fn round(v: &mut [u64; 4]) {
        let [v0, v1, v2, v3] = v;
        *v0 = v0.wrapping_add(*v1);
        *v1 = v1.rotate_left(13) ^ *v0;
        *v0 = v0.rotate_left(32);
        *v2 = v2.wrapping_add(*v3);
        *v3 = v3.rotate_left(16) ^ *v2;
        *v0 = v0.wrapping_add(*v3);
        *v3 = v3.rotate_left(21) ^ *v0;
        *v2 = v2.wrapping_add(*v1);
        *v1 = v1.rotate_left(17) ^ *v2;
        *v2 = v2.rotate_left(32);
    }
    fn compress(v: &mut [u64; 4], m: u64) {
        v[3] ^= m;
        round(v);
        round(v);
        v[0] ^= m;
    }
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        compress(&mut v, u64::from_le_bytes(w));
    }
    let mut last = (data.len() as u64) << 56;
    for (i, b) in chunks.remainder().iter().enumerate() {
        last |= u64::from(*b) << (8 * i);
    }
    compress(&mut v, last);
    v[2] ^= 0xff;
    for _ in 0..4 {
        round(&mut v);
    }
    v[0] ^ v[1] ^ v[2] ^ v[3]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_key() -> AdmissionSecret {
        let mut k = [0u8; 16];
        for (i, b) in k.iter_mut().enumerate() {
            *b = i as u8;
        }
        AdmissionSecret::from_bytes(k)
    }

    #[test]
    fn matches_the_siphash_reference_vectors() {
        // From the SipHash paper's reference implementation (vectors.h):
        // key 00..0f, message 00..(n-1).
        let k = reference_key();
        let msg: Vec<u8> = (0u8..64).collect();
        assert_eq!(k.hash(&msg[..0]), 0x726f_db47_dd0e_0e31);
        assert_eq!(k.hash(&msg[..1]), 0x74f8_39c5_93dc_67fd);
        assert_eq!(k.hash(&msg[..8]), 0x93f5_f579_9a93_2462);
        assert_eq!(k.hash(&msg[..15]), 0xa129_ca61_49be_45e5);
        assert_eq!(k.hash(&msg[..63]), 0x958a_324c_eb06_4572);
    }

    #[test]
    fn hex_round_trips_and_is_never_shown() {
        let k = reference_key();
        let hex = "000102030405060708090a0b0c0d0e0f";
        assert_eq!(AdmissionSecret::from_hex(hex), Ok(k));
        assert_eq!(AdmissionSecret::from_hex(&hex.to_uppercase()), Ok(k));
        assert_eq!(k.to_bytes()[15], 15);
        for bad in [
            "",
            "00",
            &hex[1..],
            &format!("{hex}00"),
            &hex.replace('0', "g"),
        ] {
            assert_eq!(AdmissionSecret::from_hex(bad), Err(BadSecret), "{bad}");
        }
        assert!(!format!("{k:?}").contains("0a0b"));
    }

    #[test]
    fn different_secrets_place_differently() {
        let a = reference_key();
        let b = AdmissionSecret::from_bytes([7; 16]);
        let differ = (0..100)
            .filter(|i| {
                let key = format!("demo/{i}");
                a.hash(key.as_bytes()) % 16_384 != b.hash(key.as_bytes()) % 16_384
            })
            .count();
        assert!(differ > 95);
    }
}
