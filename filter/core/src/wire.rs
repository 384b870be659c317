//! A minimal protobuf wire-format reader and writer.
//!
//! The filter reads a handful of fields from lock.v1 and election.v1 requests
//! and the arbiter's `EdgePolicy`, and writes one `google.rpc.Status`. A
//! hand-written reader keeps
//! the Wasm module small and, more to the point, total: every input, however
//! hostile, ends in `Ok` or a [`WireError`], never a panic (the decoder is fuzzed
//! in `request.rs`).

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("truncated message")]
    Truncated,
    #[error("varint longer than 10 bytes")]
    VarintTooLong,
    #[error("invalid wire type {0}")]
    WireType(u8),
    #[error("field number 0")]
    FieldZero,
    #[error("field {field} has the wrong wire type")]
    FieldType { field: u32 },
    #[error("field {field} is not valid UTF-8")]
    Utf8 { field: u32 },
    #[error("field {field} is out of range")]
    Range { field: u32 },
}

/// One field's value as it sits on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

impl<'a> Value<'a> {
    pub fn string(self, field: u32) -> Result<&'a str, WireError> {
        match self {
            Value::Bytes(b) => std::str::from_utf8(b).map_err(|_| WireError::Utf8 { field }),
            _ => Err(WireError::FieldType { field }),
        }
    }

    pub fn bytes(self, field: u32) -> Result<&'a [u8], WireError> {
        match self {
            Value::Bytes(b) => Ok(b),
            _ => Err(WireError::FieldType { field }),
        }
    }

    pub fn varint(self, field: u32) -> Result<u64, WireError> {
        match self {
            Value::Varint(v) => Ok(v),
            _ => Err(WireError::FieldType { field }),
        }
    }

    pub fn u32(self, field: u32) -> Result<u32, WireError> {
        u32::try_from(self.varint(field)?).map_err(|_| WireError::Range { field })
    }
}

/// Iterates the fields of one message.
pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut value = 0u64;
        for i in 0..10 {
            let (&byte, rest) = self.buf.split_first().ok_or(WireError::Truncated)?;
            self.buf = rest;
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(WireError::VarintTooLong)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.buf.len() {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    /// The next `(field number, value)`, or `None` at the end.
    pub fn next_field(&mut self) -> Result<Option<(u32, Value<'a>)>, WireError> {
        if self.buf.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let field = u32::try_from(tag >> 3).map_err(|_| WireError::Range { field: 0 })?;
        if field == 0 {
            return Err(WireError::FieldZero);
        }
        let value = match (tag & 7) as u8 {
            0 => Value::Varint(self.varint()?),
            1 => {
                let b = self.take(8)?;
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                Value::Fixed64(u64::from_le_bytes(a))
            }
            2 => {
                let len = usize::try_from(self.varint()?).map_err(|_| WireError::Truncated)?;
                Value::Bytes(self.take(len)?)
            }
            5 => {
                let b = self.take(4)?;
                let mut a = [0u8; 4];
                a.copy_from_slice(b);
                Value::Fixed32(u32::from_le_bytes(a))
            }
            other => return Err(WireError::WireType(other)),
        };
        Ok(Some((field, value)))
    }
}

/// Appends fields to a buffer.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Self {
        Self::default()
    }

    fn raw_varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.buf.push(v as u8);
    }

    pub fn varint(&mut self, field: u32, v: u64) -> &mut Self {
        self.raw_varint(u64::from(field) << 3);
        self.raw_varint(v);
        self
    }

    pub fn bytes(&mut self, field: u32, b: &[u8]) -> &mut Self {
        self.raw_varint((u64::from(field) << 3) | 2);
        self.raw_varint(b.len() as u64);
        self.buf.extend_from_slice(b);
        self
    }

    pub fn string(&mut self, field: u32, s: &str) -> &mut Self {
        self.bytes(field, s.as_bytes())
    }

    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_the_written_fields() {
        let mut w = Writer::new();
        w.string(1, "a/b").varint(4, 300).bytes(7, &[]);
        let buf = w.finish();
        let mut r = Reader::new(&buf);
        assert_eq!(r.next_field(), Ok(Some((1, Value::Bytes(b"a/b")))));
        assert_eq!(r.next_field(), Ok(Some((4, Value::Varint(300)))));
        assert_eq!(r.next_field(), Ok(Some((7, Value::Bytes(b"")))));
        assert_eq!(r.next_field(), Ok(None));
    }

    #[test]
    fn refuses_truncation_and_bad_wire_types() {
        assert_eq!(
            Reader::new(&[0x0a, 5, b'a']).next_field(),
            Err(WireError::Truncated)
        );
        assert_eq!(
            Reader::new(&[0x0b]).next_field(),
            Err(WireError::WireType(3))
        );
        assert_eq!(Reader::new(&[0x02]).next_field(), Err(WireError::FieldZero));
        assert_eq!(
            Reader::new(&[
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff
            ])
            .next_field(),
            Err(WireError::VarintTooLong)
        );
    }
}
