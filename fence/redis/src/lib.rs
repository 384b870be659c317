//! The Redis fence (issue 35): one Lua script ([`GUARDED_WRITE_LUA`], run
//! with EVALSHA, EVAL when the server does not have it yet) compares the
//! record's mark with the token and writes the payload and the new mark.
//! Redis runs a script to the end before it serves another command, so the
//! comparison and the write are one atomic step.
//!
//! A record is one hash (the key is the record name) with three fields:
//! - `mark`: the token of the last accepted write, as exactly 16 lower-case
//!   hex digits ([`latchkey_fence::Mark::to_hex`]);
//! - `payload`: the bytes written;
//! - `writes`: how many writes the record has accepted (`HINCRBY`), the
//!   applied write's version ([`Guarded::Applied`]).
//!
//! The script answers an array: `{1, writes}` written (created, or the
//! mark was strictly below the token); `{0, mark}` fenced out (the mark is at or
//! above the token; nothing changed); `{-1, why}` the key exists but is not
//! a fenced record (another type, no `mark` field, a mark in another
//! encoding): nothing changed, and the adapter answers
//! [`FenceError::Unfenced`] rather than overwrite it. The marks are compared
//! as numbers, in two 32-bit halves (exact in Lua's doubles), not as
//! strings: Lua's string `<` follows the server's collation locale.
//!
//! **Marks must not vanish.** A record whose key expires or is evicted
//! takes its mark along, and the next write, a stale one too, creates it
//! anew. The script refuses to write a key that has an expiry (`{-1, …}`:
//! remove it with `PERSIST`), and [`RedisStore::connect`] refuses a server
//! that may evict any key (`maxmemory` set with an `allkeys-*` policy;
//! `volatile-*` policies evict only keys with an expiry, which fenced
//! records never have). A server without persistence (no AOF) loses marks
//! on restart: its [`FencedStore::caveats`] say so for the pause-test result.
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
  redis.call('HSET', KEYS[1], 'mark', token, 'payload', ARGV[2], 'writes', 1)
  return {1, 1}
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
if redis.call('PTTL', KEYS[1]) >= 0 then
  return {-1, 'the key has an expiry, and its mark would expire with it (a stale write would then land): remove it with PERSIST'}
end
local writes = redis.call('HGET', KEYS[1], 'writes')
if writes and (not string.match(writes, '^[0-9]+$') or string.len(writes) > 18 or (string.len(writes) > 1 and string.sub(writes, 1, 1) == '0')) then
  return {-1, 'its writes field is not a count'}
end
local mh = tonumber(string.sub(mark, 1, 8), 16)
local th = tonumber(string.sub(token, 1, 8), 16)
if mh < th or (mh == th and tonumber(string.sub(mark, 9), 16) < tonumber(string.sub(token, 9), 16)) then
  redis.call('HSET', KEYS[1], 'mark', token, 'payload', ARGV[2])
  return {1, redis.call('HINCRBY', KEYS[1], 'writes', 1)}
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
redis.call('HINCRBY', KEYS[1], 'writes', 1)
return 1
"#;

/// The fence over one Redis server (or primary), through one multiplexed
/// connection.
pub struct RedisStore {
    conn: MultiplexedConnection,
    /// What the server's configuration means for the fence (persistence).
    caveats: Vec<String>,
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
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| store_error("connecting", &e, &[]))?;
        let caveats = check_server(&mut conn).await?;
        let mut store = Self::new(conn);
        store.caveats = caveats;
        Ok(store)
    }

    /// Wraps a connection.
    pub fn new(conn: MultiplexedConnection) -> Self {
        Self {
            conn,
            caveats: vec![REPLICATION_CAVEAT.to_owned()],
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

/// Redis replicates asynchronously: said in every pause-test result.
pub const REPLICATION_CAVEAT: &str = "Redis replicates asynchronously: a write the fence \
     accepted on the primary can be lost in a failover, and the promoted replica then \
     accepts the older holder's stale write. This test proves the script on one server, \
     not failover";

/// The `name:value` lines of an `INFO` section.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|line| {
        line.strip_prefix(name)
            .and_then(|rest| rest.strip_prefix(':'))
            .map(str::trim)
    })
}

/// Reads `INFO memory` and `INFO persistence`: refuses a server that may
/// evict fenced records, and says what a restart would lose.
async fn check_server(conn: &mut MultiplexedConnection) -> Result<Vec<String>, FenceError> {
    const OP: &str = "checking the server's eviction policy";
    let info = |section: &'static str| {
        let mut conn = conn.clone();
        async move {
            redis::cmd("INFO")
                .arg(section)
                .query_async::<String>(&mut conn)
                .await
                .map_err(|e| {
                    let mut err = store_error(OP, &e, &[]);
                    if let FenceError::Store { message, .. } = &mut err {
                        message.push_str(
                            " (the fence reads INFO memory and INFO persistence to know whether \
                             the server may evict or forget a record's mark; allow INFO for this \
                             user)",
                        );
                    }
                    err
                })
        }
    };
    let memory = info("memory").await?;
    if let Some(why) = eviction_refusal(&memory) {
        return Err(FenceError::store(KIND, OP, why, false, &[]));
    }
    let persistence = info("persistence").await?;
    Ok(caveats_of(&persistence))
}

/// Why a server with this `INFO memory` may not hold fenced records.
fn eviction_refusal(memory: &str) -> Option<String> {
    // Fields missing (a proxy, a fork that renamed them): refuse, never
    // assume no eviction.
    let (Some(limit), Some(policy)) = (
        info_field(memory, "maxmemory").and_then(|v| v.parse::<u64>().ok()),
        info_field(memory, "maxmemory_policy"),
    ) else {
        return Some(
            "INFO memory does not say maxmemory and maxmemory_policy, so whether the server \
             may evict a fenced record cannot be known"
                .to_owned(),
        );
    };
    (limit > 0 && policy.starts_with("allkeys-")).then(|| {
        format!(
            "maxmemory is set and maxmemory-policy is {policy}: the server may evict a fenced \
             record, and its mark with it (a stale write would then land); use noeviction, or a \
             volatile-* policy"
        )
    })
}

/// The caveats a server with this `INFO persistence` gets.
fn caveats_of(persistence: &str) -> Vec<String> {
    let mut caveats = vec![REPLICATION_CAVEAT.to_owned()];
    if info_field(persistence, "aof_enabled") != Some("1") {
        caveats.push(
            "the server has no append-only file: a restart loses the marks written since its \
             last snapshot (all of them without one), and a stale write to a lost record lands"
                .to_owned(),
        );
    } else {
        caveats.push(
            "unless appendfsync is always, a crash of the server loses up to about a second of \
             marks (everysec), and a stale write to a lost record lands"
                .to_owned(),
        );
    }
    caveats
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

    fn caveats(&self) -> Vec<String> {
        self.caveats.clone()
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
                Some(1) => match int(answer.get(1)).and_then(|w| u64::try_from(w).ok()) {
                    Some(version) => Ok(Guarded::Applied { version }),
                    None => Err(unexpected(OP, "written without a write count", &[token])),
                },
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
    fn servers_that_may_evict_any_key_are_refused() {
        let memory = |limit: &str, policy: &str| {
            format!(
                "# Memory\r\nused_memory:1024\r\nmaxmemory:{limit}\r\nmaxmemory_policy:{policy}\r\n"
            )
        };
        assert!(eviction_refusal(&memory("0", "allkeys-lru")).is_none());
        assert!(eviction_refusal("# Memory\r\nused_memory:1024\r\n").is_some());
        assert!(eviction_refusal(&memory("1048576", "noeviction")).is_none());
        assert!(eviction_refusal(&memory("1048576", "volatile-lru")).is_none());
        let why = eviction_refusal(&memory("1048576", "allkeys-lfu")).unwrap();
        assert!(
            why.contains("allkeys-lfu") && why.contains("noeviction"),
            "{why}"
        );
    }

    #[test]
    fn a_server_without_aof_says_so() {
        assert_eq!(caveats_of("aof_enabled:1\r\n").len(), 2);
        let caveats = caveats_of("# Persistence\r\naof_enabled:0\r\n");
        assert_eq!(caveats.len(), 2);
        assert!(caveats[1].contains("append-only"), "{caveats:?}");
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
