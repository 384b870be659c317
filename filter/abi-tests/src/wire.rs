//! The byte formats the ABI and the filter's answers use: proxy-wasm header
//! maps, a protobuf field reader (filter-state arguments, the refusal's
//! `google.rpc.Status`) and base64 (`grpc-status-details-bin`).

/// A header map as proxy-wasm 0.2.1 serialises it: the pair count, each
/// name's and value's length (u32 LE), then each name and value followed by
/// a NUL.
pub fn serialize_map(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&len32(pairs.len()).to_le_bytes());
    for (name, value) in pairs {
        out.extend_from_slice(&len32(name.len()).to_le_bytes());
        out.extend_from_slice(&len32(value.len()).to_le_bytes());
    }
    for (name, value) in pairs {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
    out
}

/// The inverse of [`serialize_map`]; `None` if the bytes are not a map.
pub fn deserialize_map(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let count = u32_at(bytes, 0)? as usize;
    let mut data = 4usize.checked_add(count.checked_mul(8)?)?;
    let mut pairs = Vec::with_capacity(count.min(1024));
    for i in 0..count {
        let name_len = u32_at(bytes, 4 + i * 8)? as usize;
        let value_len = u32_at(bytes, 8 + i * 8)? as usize;
        let name = bytes.get(data..data.checked_add(name_len)?)?;
        data = data.checked_add(name_len + 1)?;
        let value = bytes.get(data..data.checked_add(value_len)?)?;
        data = data.checked_add(value_len + 1)?;
        pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    Some(pairs)
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(b.try_into().ok()?))
}

fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The length-delimited fields of a protobuf message, in order, as
/// `(field number, bytes)`; varint fields as `(field number, empty)`.
/// `None` if the message is malformed or uses a wire type this reader skips
/// nothing of (fixed32/64 are skipped correctly).
pub fn proto_fields(mut msg: &[u8]) -> Option<Vec<(u64, Vec<u8>)>> {
    let mut out = Vec::new();
    while !msg.is_empty() {
        let (tag, rest) = varint(msg)?;
        msg = rest;
        let field = tag >> 3;
        match tag & 7 {
            0 => {
                let (_, rest) = varint(msg)?;
                msg = rest;
                out.push((field, Vec::new()));
            }
            1 => msg = msg.get(8..)?,
            2 => {
                let (len, rest) = varint(msg)?;
                let len = usize::try_from(len).ok()?;
                out.push((field, rest.get(..len)?.to_vec()));
                msg = rest.get(len..)?;
            }
            5 => msg = msg.get(4..)?,
            _ => return None,
        }
    }
    Some(out)
}

fn varint(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let mut value = 0u64;
    for (i, b) in bytes.iter().enumerate().take(10) {
        value |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((value, bytes.get(i + 1..)?));
        }
    }
    None
}

/// The first length-delimited field `number` of `msg`, as UTF-8.
pub fn proto_string(msg: &[u8], number: u64) -> Option<String> {
    proto_fields(msg)?
        .into_iter()
        .find(|(f, _)| *f == number)
        .and_then(|(_, v)| String::from_utf8(v).ok())
}

/// Standard base64 (padding optional), as gRPC's `-bin` metadata uses it.
pub fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for &c in text.iter().filter(|&&c| c != b'=') {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_round_trip_in_the_sdk_layout() {
        let pairs = vec![
            (":method".to_owned(), b"GET".to_vec()),
            ("x".to_owned(), vec![0xff, 0]),
        ];
        let bytes = serialize_map(&pairs);
        // Count, two length pairs, then NUL-terminated names and values.
        assert_eq!(&bytes[..4], &2u32.to_le_bytes());
        assert_eq!(&bytes[4..8], &7u32.to_le_bytes());
        assert_eq!(deserialize_map(&bytes).unwrap(), pairs);
        assert_eq!(deserialize_map(&[]).unwrap(), vec![]);
        assert!(deserialize_map(&[9, 0, 0, 0]).is_none());
    }

    #[test]
    fn base64_and_proto_fields() {
        assert_eq!(base64_decode(b"aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode(b"aGVsbG8").unwrap(), b"hello");
        // {1: "ab", 2: varint 5}
        let msg = [0x0a, 2, b'a', b'b', 0x10, 5];
        assert_eq!(proto_string(&msg, 1).as_deref(), Some("ab"));
        assert_eq!(proto_fields(&msg).unwrap().len(), 2);
        assert!(proto_fields(&[0x0a, 9]).is_none());
    }
}
