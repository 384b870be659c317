//! The Redis fence (issue 35): one Lua script ([`GUARDED_WRITE_LUA`], run
//! with EVALSHA, EVAL when the server does not have it yet) compares the
//! record's mark with the token and writes the payload and the new mark.
//! Redis runs a script to the end before it serves another command, so the
//! comparison and the write are one atomic step.
//!
//! A record is one hash (the key is the record name) with two fields:
//! - `mark`: the token of the last accepted write, as exactly 16 lower-case
//!   hex digits ([`latchkey_fence::Mark::to_hex`]);
//! - `payload`: the bytes written.
//!
//! The script answers an array: `{1}` written (created, or the mark was
//! strictly below the token); `{0, mark}` fenced out (the mark is at or
//! above the token; nothing changed); `{-1, why}` the key exists but is not
//! a fenced record (another type, no `mark` field, a mark in another
//! encoding): nothing changed, and the adapter answers
//! [`FenceError::Unfenced`] rather than overwrite it. The marks are compared
//! as numbers, in two 32-bit halves (exact in Lua's doubles), not as
//! strings: Lua's string `<` follows the server's collation locale.
//!
//! **Replication caveat.** Redis replicates asynchronously. A write the
//! script accepted on the primary, with its mark, can be lost if the
//! primary fails before a replica has it; the promoted replica then holds
//! the older mark and accepts the older holder's stale write. `WAIT n ms`
//! after the write narrows that window (the write reached n replicas) but
//! does not close it: Redis does not roll back a write that WAIT timed out
//! on, and failover can still promote a replica that missed it. A pause
//! test against one Redis primary proves the script; it says nothing about
//! failover. Use a store with synchronous replication (PostgreSQL with
//! synchronous commit, etcd) where a lost write matters.
//!
//! Tokens are capabilities: they travel only as script arguments, and the
//! driver's error text is scrubbed of them (decimal and hex).

use latchkey_fence::{BoxFuture, FenceError, FencedStore, Guarded, Mark, Record};
use redis::aio::MultiplexedConnection;
use redis::{Script, Value};

/// The store kind, as in `redis://…`.
pub const KIND: &str = "redis";

/// The guarded write. `KEYS[1]` the record, `ARGV[1]` the token as 16
/// lower-case hex digits, `ARGV[2]` the payload.
pub const GUARDED_WRITE_LUA: &str = r#"
local token = ARGV[1]
if string.len(token) ~= 16 or not string.match(token, '^[0-9a-f]+$') then
  return redis.error_reply('ERR latchkey fence: the token argument is not 16 lower-case hex digits')
end
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
  redis.call('HSET', KEYS[1], 'mark', token, 'payload', ARGV[2])
  return {1}
end
if kind ~= 'hash' then
  return {-1, 'the key holds a ' .. kind .. ', not a fenced hash'}
end
local mark = redis.call('HGET', KEYS[1], 'mark')
if not mark then
  return {-1, 'the hash has no mark field'}
end
if string.len(mark) ~= 16 or not string.match(mark, '^[0-9a-f]+$') then
  return {-1, 'its mark field is not 16 lower-case hex digits'}
end
local mh = tonumber(string.sub(mark, 1, 8), 16)
local th = tonumber(string.sub(token, 1, 8), 16)
if mh < th or (mh == th and tonumber(string.sub(mark, 9), 16) < tonumber(string.sub(token, 9), 16)) then
  redis.call('HSET', KEYS[1], 'mark', token, 'payload', ARGV[2])
  return {1}
end
return {0, mark}
"#;

/// Reads a record: `{0}` missing, `{1, mark, payload}` (either may be
/// nil), `{-1, why}` a key of another type.
pub const READ_LUA: &str = r#"
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then
  return {0}
end
if kind ~= 'hash' then
  return {-1, 'the key holds a ' .. kind .. ', not a fenced hash'}
end
local v = redis.call('HMGET', KEYS[1], 'mark', 'payload')
return {1, v[1], v[2]}
"#;

/// What a naive writer does, in one script so it is one step too: sets the
/// payload, and a mark of zero only when the record has none. Never
/// compares. For the pause test's "a naive writer FAILs" run and the
/// benchmark's baseline only.
pub const PLAIN_WRITE_LUA: &str = r#"
redis.call('HSETNX', KEYS[1], 'mark', '0000000000000000')
redis.call('HSET', KEYS[1], 'payload', ARGV[1])
return 1
"#;

/// The fence over one Redis server (or primary), through one multiplexed
/// connection.
pub struct RedisStore {
    conn: MultiplexedConnection,
    guarded: Script,
    read: Script,
    plain: Script,
}

impl RedisStore {
    /// Connects with a `redis://[:password@]host:port[/db]` URL (no TLS).
    /// Errors name neither the URL nor its password.
    pub async fn connect(url: &str) -> Result<Self, FenceError> {
        let client = redis::Client::open(url).map_err(|e| {
            FenceError::store(
                KIND,
                "reading the URL",
                format!("not a usable redis:// URL ({:?})", e.kind()),
                false,
                &[],
            )
        })?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| store_error("connecting", &e, &[]))?;
        Ok(Self::new(conn))
    }

    /// Wraps a connection.
    pub fn new(conn: MultiplexedConnection) -> Self {
        Self {
            conn,
            guarded: Script::new(GUARDED_WRITE_LUA),
            read: Script::new(READ_LUA),
            plain: Script::new(PLAIN_WRITE_LUA),
        }
    }

    fn unfenced(record: &str, why: impl Into<String>) -> FenceError {
        FenceError::Unfenced {
            store: KIND,
            record: record.to_owned(),
            why: why.into(),
        }
    }
}

/// A driver error as a [`FenceError`], scrubbed of `secrets`.
pub fn store_error(op: &'static str, err: &redis::RedisError, secrets: &[u64]) -> FenceError {
    let transient = err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || matches!(
            err.code(),
            Some("LOADING" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "READONLY" | "BUSY")
        );
    FenceError::store(KIND, op, err, transient, secrets)
}

fn unexpected(op: &'static str, what: &str, secrets: &[u64]) -> FenceError {
    FenceError::store(
        KIND,
        op,
        format!("the script answered {what}, which this adapter does not know"),
        false,
        secrets,
    )
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(i)) => Some(*i),
        _ => None,
    }
}

fn text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
        Some(Value::SimpleString(s)) => Some(s.clone()),
        _ => None,
    }
}

impl FencedStore for RedisStore {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn guarded_write<'a>(
        &'a self,
        record: &'a str,
        token: u64,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<Guarded, FenceError>> {
        Box::pin(async move {
            const OP: &str = "guarded write";
            let mut conn = self.conn.clone();
            let answer: Vec<Value> = self
                .guarded
                .key(record)
                .arg(Mark::new(token).to_hex())
                .arg(payload)
                .invoke_async(&mut conn)
                .await
                .map_err(|e| store_error(OP, &e, &[token]))?;
            match int(answer.first()) {
                Some(1) => Ok(Guarded::Applied),
                Some(0) => {
                    let mark = text(answer.get(1))
                        .and_then(|m| Mark::from_hex(&m))
                        .ok_or_else(|| {
                            unexpected(OP, "fenced out without a readable mark", &[token])
                        })?;
                    Ok(Guarded::FencedOut { mark })
                }
                Some(-1) => Err(Self::unfenced(
                    record,
                    text(answer.get(1)).unwrap_or_default(),
                )),
                _ => Err(unexpected(OP, "something else", &[token])),
            }
        })
    }

    fn read<'a>(&'a self, record: &'a str) -> BoxFuture<'a, Result<Option<Record>, FenceError>> {
        Box::pin(async move {
            const OP: &str = "reading a record";
            let mut conn = self.conn.clone();
            let answer: Vec<Value> = self
                .read
                .key(record)
                .invoke_async(&mut conn)
                .await
                .map_err(|e| store_error(OP, &e, &[]))?;
            match int(answer.first()) {
                Some(0) => Ok(None),
                Some(-1) => Err(Self::unfenced(
                    record,
                    text(answer.get(1)).unwrap_or_default(),
                )),
                Some(1) => {
                    let mark = match text(answer.get(1)) {
                        None => return Err(Self::unfenced(record, "the hash has no mark field")),
                        Some(m) => Mark::from_hex(&m).ok_or_else(|| {
                            Self::unfenced(record, "its mark field is not 16 lower-case hex digits")
                        })?,
                    };
                    let payload = match answer.get(2) {
                        Some(Value::BulkString(b)) => b.clone(),
                        _ => Vec::new(),
                    };
                    Ok(Some(Record { mark, payload }))
                }
                _ => Err(unexpected(OP, "something else", &[])),
            }
        })
    }

    fn plain_write<'a>(
        &'a self,
        record: &'a str,
        payload: &'a [u8],
    ) -> BoxFuture<'a, Result<(), FenceError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let _: Value = self
                .plain
                .key(record)
                .arg(payload)
                .invoke_async(&mut conn)
                .await
                .map_err(|e| store_error("plain write", &e, &[]))?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_compares_strictly_and_numerically() {
        // strictly below: equal halves fall through to the refusal
        assert!(GUARDED_WRITE_LUA.contains("mh < th or (mh == th and"));
        assert!(!GUARDED_WRITE_LUA.contains("<="));
        // never a string comparison of the marks (locale collation)
        assert!(!GUARDED_WRITE_LUA.contains("mark < token"));
    }

    #[test]
    fn connection_errors_hide_the_url() {
        let err = match redis::Client::open("redis://:hunter2@[::1") {
            Ok(_) => panic!("parsed a broken URL"),
            Err(e) => FenceError::store(
                KIND,
                "reading the URL",
                format!("not a usable redis:// URL ({:?})", e.kind()),
                false,
                &[],
            ),
        };
        assert!(!format!("{err} {err:?}").contains("hunter2"));
    }
}
