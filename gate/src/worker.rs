//! One gate workload process: acquire a random key through the client
//! library, write to the PostgreSQL reference fence with the grant's token
//! (a shared holder instead reads its key's record through the fence's
//! guarded read), release; every step recorded. The nemesis may SIGSTOP
//! this process at any moment, which is the point: a holder frozen inside
//! its unit of work wakes up with a stale token, and the fence must refuse
//! its write (or its read).
//!
//! Any outcome the worker cannot know (a transport error, a refused release)
//! ends the process with [`EXIT_TAINTED`] after recording what may still
//! linger (an `expire` from its fence deadline); the gate starts a fresh
//! incarnation, so no hidden hold outlives the dead process's lease. After
//! such an outcome the worker records nothing but that `expire`: the
//! checker's search relies on it and refuses a history that breaks it.
//!
//! An acquire whose answer was lost is first asked again on the same
//! session (`reveal`), as part of the same operation: its completion is
//! written only once that is over. A grant the lost answer hid is then
//! answered as "already yours" with its real token, and the operation is
//! recorded `ok` with that token; the worker keeps the grant (never
//! releases it) and records its `expire` at the session's fence deadline,
//! so the history shows the hidden grant for as long as it may live.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use latchkey_client::{Client, ClientConfig, Error, LockGuard, Session, TlsFiles};
use latchkey_fence::{FencedStore, Guarded, guarded_write_retrying};
use latchkey_fence_postgres::{PostgresStore, ReadOutcome};
use latchkey_proto::lockv1::Reason;

use super::record::{Fields, Outcome, Recorder, mono_of};

/// The worker stopped because the stop file appeared.
pub const EXIT_STOPPED: i32 = 0;
/// The worker saw an outcome it cannot know; start a new incarnation.
pub const EXIT_TAINTED: i32 = 3;

#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The arbiter, `https://127.0.0.1:PORT`.
    #[arg(long)]
    pub arbiter: String,
    #[arg(long)]
    pub ca: PathBuf,
    #[arg(long)]
    pub cert: PathBuf,
    #[arg(long)]
    pub key: PathBuf,
    /// Keys to lock, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub keys: Vec<String>,
    #[arg(long)]
    pub class: String,
    /// tokio-postgres connection string of the fenced resource.
    #[arg(long)]
    pub postgres: String,
    /// Fence adapters to rotate the writes through, by URL
    /// (`postgresql://`, `mysql://`, `redis://`, `etcd://`, `s3://`), in
    /// an order every worker shares, separated by spaces (URLs hold
    /// none; a comma may be in a password or a host list); the record of
    /// the i-th key of `--keys`
    /// (plus its slot) goes to store i mod n, but for the readers' keys
    /// (`--shared-every`), whose records stay on the reference fence.
    /// Empty: every write goes to the reference fence at `--postgres`.
    /// From the environment, as URLs may hold passwords.
    #[arg(
        long,
        env = "LATCHKEY_GATE_FENCE_STORES",
        value_delimiter = ' ',
        hide_env_values = true
    )]
    pub fence_stores: Vec<String>,
    /// History file (JSON lines, appended).
    #[arg(long)]
    pub history: PathBuf,
    /// Process name in the history, e.g. `w3.2` (worker 3, incarnation 2).
    #[arg(long)]
    pub process: String,
    #[arg(long)]
    pub seed: u64,
    /// The worker finishes its current operation and exits once this exists.
    #[arg(long)]
    pub stop_file: PathBuf,
    /// Longest unit of work inside a hold, in milliseconds (uniform from 0).
    /// One unit in [`LONG_UNIT_EVERY`] is ten times longer, so the nemesis
    /// finds holders to pause even when units are short.
    #[arg(long, default_value_t = 300)]
    pub unit_ms: u64,
    /// Longest wait for a held key, in milliseconds (uniform from a tenth).
    #[arg(long, default_value_t = 2500)]
    pub wait_ms: u64,
    /// Campaign for the `--keys` as elections (`--class` an election
    /// class) instead of locking them: [`crate::elector`].
    #[arg(long)]
    pub elect: bool,
    /// One acquire in this many asks for a shared hold, of one of the
    /// first [`SHARED_KEYS`] keys, and does no write but one guarded read
    /// of the key's record through the reference fence (0: never). Readers
    /// and writers of those keys are judged together, and those keys'
    /// records stay on the reference fence (the readers' fence).
    #[arg(long, default_value_t = 0)]
    pub shared_every: u64,
    /// `--class` is a semaphore of this many permits: each grant carries
    /// a slot, and the unit of work writes that slot's record.
    #[arg(long)]
    pub permits: Option<u32>,
}

/// Shared acquires pick among this many keys, so readers meet each other
/// and the writers of those keys.
pub const SHARED_KEYS: usize = 4;

/// What one hold is: its mode, and a semaphore's slot once granted.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hold {
    pub(crate) shared: bool,
    pub(crate) permits: Option<u32>,
    pub(crate) slot: Option<u32>,
}

impl Hold {
    /// An exclusive hold (an elector's leadership).
    pub(crate) const EXCLUSIVE: Hold = Hold {
        shared: false,
        permits: None,
        slot: None,
    };

    /// The history fields of an operation on this hold (`key` set).
    pub(crate) fn fields(&self, key: &str) -> Fields {
        let mode = if self.shared {
            Some("shared")
        } else if self.permits.is_some() {
            Some("semaphore")
        } else {
            None
        };
        Fields {
            key: Some(key.to_owned()),
            mode,
            ..Fields::default()
        }
    }

    /// The record a holder of `key` writes: a semaphore slot's own.
    pub(crate) fn record(&self, key: &str) -> String {
        match self.slot {
            Some(n) => latchkey_checker::slot_record(key, n),
            None => key.to_owned(),
        }
    }
}

/// Rounds of a guarded write the store answered `Retry` (a conditional
/// request lost a race; nothing changed) before it is recorded unknown.
const WRITE_ATTEMPTS: usize = 4;

/// The stores a worker writes its records to: the reference fence alone, or
/// every adapter of `--fence-stores` in rotation by key. The records of the
/// keys readers take (the first [`SHARED_KEYS`] with `--shared-every`) stay
/// on the reference fence in either case: a reader's guarded read goes
/// through it (the other adapters have none), so the writes it is judged
/// against must land there too, on the same record.
pub struct Fences {
    reference: PostgresStore,
    /// `--fence-stores`, in order; empty: every record on `reference`.
    rotation: Vec<Box<dyn FencedStore>>,
    keys: Vec<String>,
    /// The first this many of `keys` are the readers' keys.
    reader_keys: usize,
}

impl Fences {
    async fn open(args: &WorkerArgs) -> anyhow::Result<Self> {
        let reference = PostgresStore::connect(&args.postgres)
            .await
            .context("connecting to the fenced resource")?;
        let mut stores: Vec<Box<dyn FencedStore>> = Vec::new();
        for url in &args.fence_stores {
            stores.push(latchkey_fence_open::open(url).await.with_context(|| {
                format!(
                    "opening the fence store {}",
                    latchkey_fence_open::locator(url)
                )
            })?);
        }
        Ok(Self {
            reference,
            rotation: stores,
            keys: args.keys.clone(),
            reader_keys: match args.shared_every {
                0 => 0,
                _ => SHARED_KEYS,
            },
        })
    }

    /// The store of `key`'s record (of its `slot`'s, for a semaphore).
    pub(crate) fn store_for(&self, key: &str, slot: Option<u32>) -> &dyn FencedStore {
        let position = self.keys.iter().position(|k| k == key).unwrap_or(0);
        if position < self.reader_keys && slot.is_none() {
            return &self.reference;
        }
        let index = (position + slot.unwrap_or(0) as usize) % self.rotation.len().max(1);
        match self.rotation.get(index) {
            Some(store) => store.as_ref(),
            None => &self.reference,
        }
    }

    /// The fence a reader's guarded read of `key`'s record goes through.
    pub(crate) fn readers_fence(&self) -> &PostgresStore {
        &self.reference
    }
}

/// One unit of work in this many is ten times longer than `--unit-ms`.
pub const LONG_UNIT_EVERY: u64 = 16;

pub(crate) fn is_definite_refusal(err: &Error) -> bool {
    // The arbiter answered and said no before anything was written; every
    // other failure (transport, store unavailable, cancelled) may hide a grant.
    matches!(
        err.reason(),
        Reason::Held
            | Reason::Leak
            | Reason::WaitTimeout
            | Reason::Sealed
            | Reason::QueueFull
            | Reason::NotHeld
            | Reason::TokenMismatch
            | Reason::SessionExpired
            // ADR-09: refused before the grant transaction, or by its
            // compare of the shard-map fence: nothing written.
            | Reason::RangeMoving
            | Reason::ShardMapChanged
            // Refused by the overload admission, before any work.
            | Reason::Overloaded
            // Every quota place live: refused before the grant transaction.
            | Reason::QuotaExceeded
    )
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<i32> {
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let mut rec = Recorder::create(&args.history, &args.process)?;
    let fences = Fences::open(&args).await?;
    let mut config = ClientConfig::tls(
        &args.arbiter,
        TlsFiles {
            ca: args.ca.clone(),
            cert: args.cert.clone(),
            key: args.key.clone(),
        },
    );
    config.connect_timeout = Duration::from_secs(2);
    config.request_timeout = Duration::from_secs(3);
    // The arbiter may be down (the nemesis kills it): wait for it, recording
    // nothing, since nothing was asked yet.
    let client = loop {
        if args.stop_file.exists() {
            return Ok(EXIT_STOPPED);
        }
        match Client::connect(config.clone()).await {
            Ok(c) => break c,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    // One session for the whole incarnation, named on every acquire: a
    // grant whose answer is lost lives on it, so its fence deadline bounds
    // that hidden grant (the expire below).
    let session = loop {
        if args.stop_file.exists() {
            return Ok(EXIT_STOPPED);
        }
        match client.open_session(&args.class).await {
            Ok(s) => break s,
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };

    if args.elect {
        return crate::elector::run(&args, &client, &session, &fences, &mut rec, &mut rng).await;
    }
    while !args.stop_file.exists() {
        if session.is_fenced() {
            // Its lease is gone or going (a pause past the TTL): nothing was
            // asked on it since, so nothing to record; a new incarnation
            // opens a new session.
            return Ok(EXIT_TAINTED);
        }
        let shared = args.shared_every > 0 && rng.u64(..args.shared_every) == 0;
        let key = if shared {
            args.keys[rng.usize(..args.keys.len().min(SHARED_KEYS))].clone()
        } else {
            args.keys[rng.usize(..args.keys.len())].clone()
        };
        let mut hold = Hold {
            shared,
            permits: args.permits,
            slot: None,
        };
        let op = rec.invoke(
            "acquire",
            Fields {
                permits: args.permits,
                ..hold.fields(&key)
            },
        )?;
        let wait = Duration::from_millis(rng.u64(args.wait_ms / 10..=args.wait_ms));
        let mut builder = client.lock(&key, &args.class).session(&session).wait(wait);
        if shared {
            builder = builder.shared();
        }
        let guard = match builder.acquire(|_| {}).await {
            Ok(guard) => {
                hold.slot = guard.slot();
                rec.complete(
                    op,
                    Outcome::Ok,
                    Fields {
                        token: Some(guard.token().get()),
                        slot: hold.slot,
                        ..Fields::default()
                    },
                )?;
                guard
            }
            Err(e) if is_definite_refusal(&e) => {
                rec.complete(op, Outcome::Fail, detail(&e))?;
                if !matches!(e.reason(), Reason::Held | Reason::WaitTimeout) {
                    // Sealed, or the session is gone: do not spin.
                    tokio::time::sleep(Duration::from_millis(rng.u64(50..250))).await;
                }
                if e.reason() == Reason::SessionExpired {
                    return Ok(EXIT_TAINTED);
                }
                continue;
            }
            Err(e) => {
                // The answer is lost. Ask again on the same session before
                // recording the outcome: a grant the lost answer hid comes
                // back as "already yours", with its token.
                let revealed = reveal(&client, &session, &key, shared, &args, &e).await;
                // Whatever was granted lives on this session until its
                // lease runs out, which is no earlier than the session's
                // fence deadline (last successful keepalive send + TTL -
                // 1 s). From the completion on, no await: on this
                // current-thread runtime no keepalive can move the deadline
                // after it is read, last.
                let token = match revealed {
                    Revealed::Granted { guard, detail } => {
                        let token = guard.token().get();
                        hold.slot = guard.slot();
                        rec.complete(
                            op,
                            Outcome::Ok,
                            Fields {
                                token: Some(token),
                                detail: Some(detail),
                                slot: hold.slot,
                                ..Fields::default()
                            },
                        )?;
                        // Kept, not released: the grant lives until its
                        // lease ends, and the expire below says from when.
                        guard.detach();
                        Some(token)
                    }
                    Revealed::Unknown { detail } => {
                        rec.complete(
                            op,
                            Outcome::Unknown,
                            Fields {
                                detail: Some(detail),
                                ..Fields::default()
                            },
                        )?;
                        None
                    }
                };
                let deadline = mono_of(session.fence_deadline().into_std());
                rec.invoke_at(
                    "expire",
                    Fields {
                        token,
                        slot: hold.slot,
                        ..hold.fields(&key)
                    },
                    deadline,
                )?;
                return Ok(EXIT_TAINTED);
            }
        };
        let token = guard.token().get();

        if shared {
            // A reader does no fenced write; it holds for up to five units
            // of work, so readers of a key meet each other, and reads its
            // key's record once through the reference fence's guarded read
            // somewhere in that hold (a SIGSTOP before it wakes up past the
            // lease: the fence must refuse it once a writer has written).
            // Whether to read is decided at the start, as a writer decides
            // its unit of work: a reader frozen since reads all the same.
            let hold_ms = rng.u64(0..=args.unit_ms * 5);
            let read_at = rng.u64(0..=hold_ms);
            let reads = guard.can_start();
            tokio::time::sleep(Duration::from_millis(read_at)).await;
            if reads {
                guarded_read(&mut rec, &fences, &key, hold, token).await?;
            }
            tokio::time::sleep(Duration::from_millis(hold_ms - read_at)).await;
        } else if guard.can_start() {
            // A SIGSTOP inside the unit of work wakes up past the lease: the
            // write then carries a stale token.
            unit_of_work(&args, &mut rng, &mut rec, &fences, &key, hold, token).await?;
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(0..=args.unit_ms / 3))).await;

        let deadline = guard.fence_deadline();
        let op = rec.invoke(
            "release",
            Fields {
                token: Some(token),
                slot: hold.slot,
                ..hold.fields(&key)
            },
        )?;
        match guard.release().await {
            Ok(()) => rec.complete(op, Outcome::Ok, Fields::default())?,
            Err(e) => {
                let outcome = if is_definite_refusal(&e) || matches!(e, Error::Fenced { .. }) {
                    Outcome::Fail
                } else {
                    Outcome::Unknown
                };
                rec.complete(op, outcome, detail(&e))?;
                // The hold may linger until the lease ends, which is no
                // earlier than the fence deadline (ADR-12).
                let from = mono_of(deadline.min(tokio::time::Instant::now()).into_std());
                rec.invoke_at(
                    "expire",
                    Fields {
                        token: Some(token),
                        slot: hold.slot,
                        ..hold.fields(&key)
                    },
                    from,
                )?;
                return Ok(EXIT_TAINTED);
            }
        }
    }
    Ok(EXIT_STOPPED)
}

/// One unit of work of a holder (or leader) whose token is `token`: a
/// random pause (one in [`LONG_UNIT_EVERY`] ten times longer, so the
/// nemesis finds holders to pause), then the recorded write to the
/// reference fence under `key`. The op's number, for a payload of the
/// caller's own.
pub(crate) async fn unit_of_work(
    args: &WorkerArgs,
    rng: &mut fastrand::Rng,
    rec: &mut Recorder,
    fences: &Fences,
    key: &str,
    hold: Hold,
    token: u64,
) -> anyhow::Result<u64> {
    let longest = if rng.u64(..LONG_UNIT_EVERY) == 0 {
        args.unit_ms * 10
    } else {
        args.unit_ms
    };
    tokio::time::sleep(Duration::from_millis(rng.u64(0..=longest))).await;
    let store = fences.store_for(key, hold.slot);
    let op = rec.invoke(
        "write",
        Fields {
            token: Some(token),
            slot: hold.slot,
            // Which adapter wrote it, for the gate's count per store.
            detail: Some(store.kind().to_owned()),
            ..hold.fields(key)
        },
    )?;
    let payload = format!("{}#{op}", args.process);
    let answer = guarded_write_retrying(
        store,
        &hold.record(key),
        token,
        payload.as_bytes(),
        WRITE_ATTEMPTS,
    )
    .await;
    match answer {
        // The record's version orders its writes as the store committed
        // them: the checker's commit order.
        Ok(Guarded::Applied { version }) => rec.complete(
            op,
            Outcome::Ok,
            Fields {
                seq: i64::try_from(version).ok(),
                ..Fields::default()
            },
        )?,
        Ok(Guarded::FencedOut { .. }) => rec.complete(op, Outcome::Fail, Fields::default())?,
        // Nothing changed, but say only what is known: the checker counts an
        // unknown write as one that may have landed, never as a refusal.
        Ok(Guarded::Retry) => rec.complete(
            op,
            Outcome::Unknown,
            Fields {
                detail: Some("the store could not decide the write".to_owned()),
                ..Fields::default()
            },
        )?,
        Err(e) => rec.complete(
            op,
            Outcome::Unknown,
            Fields {
                detail: Some(e.to_string()),
                ..Fields::default()
            },
        )?,
    }
    Ok(op)
}

/// A reader's guarded read of `key`'s record through the reference fence
/// with its shared grant's `token`, recorded: `ok` with the record's write
/// count it saw as `seq` (the writes' own numbering, so the checker orders
/// it among them), `fail` when the fence refused it (a write with a larger
/// token had landed), `unknown` on an error (it may have raised the read
/// mark). The payload is not kept: the checker judges the fence's answer.
async fn guarded_read(
    rec: &mut Recorder,
    fences: &Fences,
    key: &str,
    hold: Hold,
    token: u64,
) -> anyhow::Result<()> {
    let op = rec.invoke(
        "read",
        Fields {
            token: Some(token),
            ..hold.fields(key)
        },
    )?;
    match fences
        .readers_fence()
        .guarded_read(&hold.record(key), token)
        .await
    {
        Ok(ReadOutcome::Current { write_seq, .. }) => rec.complete(
            op,
            Outcome::Ok,
            Fields {
                seq: Some(write_seq),
                ..Fields::default()
            },
        ),
        Ok(ReadOutcome::WrittenSince) => rec.complete(
            op,
            Outcome::Fail,
            Fields {
                detail: Some(ReadOutcome::WrittenSince.to_string()),
                ..Fields::default()
            },
        ),
        Err(e) => rec.complete(
            op,
            Outcome::Unknown,
            Fields {
                detail: Some(e.to_string()),
                ..Fields::default()
            },
        ),
    }
}

/// What asking again on the same session showed.
enum Revealed {
    /// The session holds the key: the grant the lost answer hid ("already
    /// yours", same token) or, if there was none, a fresh one. Either way a
    /// grant with this token was made within the operation and is held at
    /// its completion.
    Granted { guard: LockGuard, detail: String },
    /// Still unknown: the session does not hold the key now (another does,
    /// or the arbiter is not answering), which does not say whether the lost
    /// answer hid a grant (released since, or still to commit).
    Unknown { detail: String },
}

/// How long [`reveal`] keeps asking while the arbiter does not answer.
const REVEAL_FOR: Duration = Duration::from_secs(3);

/// After an acquire of `key` on `session` whose answer was lost (`lost`):
/// asks again on the same session, without waiting, until an answer says
/// whether the session holds the key (a grant or a refusal), the session is
/// fenced, or [`REVEAL_FOR`] has passed. The arbiter answers a session that
/// already holds the key with that grant ("already yours"), and claims it
/// for this call, so no orphan release can take it after.
async fn reveal(
    client: &Client,
    session: &Session,
    key: &str,
    shared: bool,
    args: &WorkerArgs,
    lost: &Error,
) -> Revealed {
    let until = tokio::time::Instant::now() + REVEAL_FOR;
    let mut last = String::from("not asked again");
    let mut asked = 0u32;
    while !session.is_fenced() && tokio::time::Instant::now() < until {
        asked += 1;
        let mut builder = client.lock(key, &args.class).session(session);
        if shared {
            builder = builder.shared();
        }
        match builder.acquire(|_| {}).await {
            Ok(guard) => {
                return Revealed::Granted {
                    guard,
                    detail: format!(
                        "revealed: the answer was lost ({lost}); asked again on the same \
                         session ({asked}x), it holds the key"
                    ),
                };
            }
            Err(e) if is_definite_refusal(&e) || matches!(e, Error::Fenced { .. }) => {
                last = e.to_string();
                break;
            }
            Err(e) => {
                last = e.to_string();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    Revealed::Unknown {
        detail: format!(
            "{lost}; asked again on the same session ({asked}x), it does not hold the key: {last}"
        ),
    }
}

pub(crate) fn key_field(key: &str) -> Fields {
    Fields {
        key: Some(key.to_owned()),
        ..Fields::default()
    }
}

pub(crate) fn detail(e: &Error) -> Fields {
    Fields {
        detail: Some(e.to_string()),
        ..Fields::default()
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        worker: WorkerArgs,
    }

    /// The gate passes the stores space-separated (a comma may be in a
    /// password or an etcd host list): each URL arrives whole.
    #[test]
    fn fence_stores_split_on_spaces_only() {
        let cli = Cli::try_parse_from([
            "gate-worker",
            "--arbiter=https://127.0.0.1:1",
            "--ca=ca",
            "--cert=c",
            "--key=k",
            "--keys=a,b",
            "--class=gate",
            "--postgres=postgresql://u@h/db",
            "--history=h",
            "--process=w1.0",
            "--seed=1",
            "--stop-file=s",
            "--fence-stores",
            "redis://:p,w@127.0.0.1:1/0 etcd://h1:1,h2:2/fenced",
        ])
        .unwrap();
        assert_eq!(
            cli.worker.fence_stores,
            ["redis://:p,w@127.0.0.1:1/0", "etcd://h1:1,h2:2/fenced"]
        );
        assert_eq!(cli.worker.keys, ["a", "b"]);
    }
}
