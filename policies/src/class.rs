//! Lock classes: the reviewed decisions that make a lock safe or unsafe
//! (enforcement, posture on quorum loss, TTL, tier), their validation, and
//! the cost report printed beside them in review (ADR-01, -04, -11, -14).

use std::fmt;
use std::path::Path;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::date::Date;
use crate::error::PolicyError;
use crate::hook::ClassHook;
use crate::key::{self, KeyError, LockKey};
use crate::pause_test::{self, ClassPauseTest, PauseTestError};

/// Platform TTL range in seconds (ADR-11).
pub const MIN_TTL_SECONDS: u32 = 5;
pub const MAX_TTL_SECONDS: u32 = 300;
pub const DEFAULT_TTL_SECONDS: u32 = 15;
/// Advisory classes may not go below this: a false expiry there can
/// produce a duplicate write, not just a retry (ADR-11).
pub const ADVISORY_MIN_TTL_SECONDS: u32 = 30;

pub const DEFAULT_MAX_WAITERS_PER_KEY: u32 = 64;
pub const MAX_WAITERS_PER_KEY_LIMIT: u32 = 10_000;
/// The most `maxHoldsPerSubject` a class may set: a refusal at a full quota
/// reads every place's hold (64 per request) first.
pub const MAX_HOLDS_PER_SUBJECT_LIMIT: u32 = 256;

/// The longest `maxHoldSeconds` a class may set (a week).
pub const MAX_HOLD_SECONDS_LIMIT: u32 = 7 * 24 * 3600;

/// The most permits a semaphore class may declare: its slots are read in
/// one answer.
pub const MAX_PERMITS: u32 = 256;

/// Class names are metrics labels and CRD names; keep them short.
pub const MAX_CLASS_NAME_BYTES: usize = 63;

/// How many candidates an election class may allow (`maxWaitersPerKey`).
pub const MAX_ELECTION_CANDIDATES: u32 = 1_024;

/// How many key namespaces one coord-tier class may list.
pub const MAX_CLASS_NAMESPACES: usize = 64;

/// The client fences this long before the TTL measured from the last
/// keepalive's send time (ADR-12).
pub const FENCE_MARGIN_MS: u64 = 1_000;

/// One lock class, as written in a `[[class]]` table.
///
/// Deserializing only checks shapes and types; call [`LockClass::validate`]
/// for the platform rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LockClass {
    pub name: String,
    /// What the class's keys are: locks (Acquire) or elections (Campaign).
    #[serde(default, skip_serializing_if = "ClassKind::is_lock")]
    pub kind: ClassKind,
    pub tier: Tier,
    /// Coord tier only: the key namespaces (first key segments) the coord
    /// tier serves (ADR-07). Keys in them are coord-tier keys, every other
    /// key is an entity-tier key, so no key can be held on both clusters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<String>,
    pub enforcement: Enforcement,
    #[serde(default = "default_ttl_seconds")]
    pub ttl_seconds: u32,
    #[serde(default)]
    pub on_quorum_loss: OnQuorumLoss,
    #[serde(default)]
    pub fairness: Fairness,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub risk_owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiver_expires: Option<Date>,
    #[serde(default = "default_max_waiters_per_key")]
    pub max_waiters_per_key: u32,
    /// The most keys of the class one grant subject (an identity, or the
    /// pattern its per-pod identities fall under) holds at once, enforced
    /// inside every grant transaction: a burst of concurrent Acquires never
    /// passes it. Lock classes only; not with `onQuorumLoss = "open"` (a
    /// memory grant cannot take a place in the log).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_holds_per_subject: Option<u32>,
    /// Semaphore classes only (and required there): how many holds a key of
    /// the class carries at once, each in its own slot `0..permits`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
    /// The longest one hold of the class lasts, from its grant, however it
    /// renews: it then ends as an expiry does (its holder is told, and
    /// fences). Renewing readers then cannot keep a writer out for longer.
    /// At least `ttlSeconds`; not for elections, nor with
    /// `onQuorumLoss = "open"` (a memory grant is not in the log to end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hold_seconds: Option<u32>,
    /// Election classes only: a leader is told (Observe's
    /// `TransferRequested`) when a candidate of a higher priority stands,
    /// and should transfer to it at its next safe point.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub yield_to_higher_priority: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A Wasm hook run before every grant of the class (policies/HOOKS.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hook: Option<ClassHook>,
    /// Where the class's pause-test result is (ADR-17): required for a fenced
    /// class, allowed on an advisory one working towards fencing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_test: Option<ClassPauseTest>,
}

fn default_ttl_seconds() -> u32 {
    DEFAULT_TTL_SECONDS
}

fn default_max_waiters_per_key() -> u32 {
    DEFAULT_MAX_WAITERS_PER_KEY
}

/// What a class's keys are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClassKind {
    /// Exclusive locks: latchkey.lock.v1 Acquire and Release.
    #[default]
    Lock,
    /// Leader elections: latchkey.election.v1 (a key is an election's name).
    Election,
    /// Counting semaphores: latchkey.lock.v1 Acquire and Release, where a
    /// key is a semaphore's name and each grant holds one of its `permits`
    /// numbered slots, with that slot's own fencing token.
    Semaphore,
}

impl ClassKind {
    pub fn is_lock(&self) -> bool {
        *self == ClassKind::Lock
    }
}

impl fmt::Display for ClassKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ClassKind::Lock => "lock",
            ClassKind::Election => "election",
            ClassKind::Semaphore => "semaphore",
        })
    }
}

/// Which etcd cluster tier serves the class (ADR-07).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Coordination: leader election and other low-rate, long-held locks.
    Coord,
    /// Entity: many short locks on individual business objects.
    Entity,
}

/// Whether the guarded resource checks the fencing token (ADR-01).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Enforcement {
    /// The resource rejects stale tokens: mutual exclusion is claimed.
    Fenced,
    /// Grants are ordered and expire, but nothing stops a paused holder:
    /// needs a named risk owner and a waiver date.
    Advisory,
}

/// What the arbiter does when it cannot reach an etcd quorum (ADR-04).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnQuorumLoss {
    /// No grants, no renewals; holders self-fence at their deadlines.
    #[default]
    Closed,
    /// Grant from local memory with token zero, recorded as unprotected.
    Open,
}

/// How waiters are queued (ADR-14).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fairness {
    /// FIFO in the arbiter's memory; order is lost on arbiter restart.
    #[default]
    Memory,
    /// Waiters as etcd keys. Parsed so the field is reserved, but refused
    /// by validation: not implemented in this release.
    Durable,
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Coord => "coord",
            Tier::Entity => "entity",
        })
    }
}

impl fmt::Display for Enforcement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Enforcement::Fenced => "fenced",
            Enforcement::Advisory => "advisory",
        })
    }
}

impl fmt::Display for OnQuorumLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OnQuorumLoss::Closed => "closed",
            OnQuorumLoss::Open => "open",
        })
    }
}

impl fmt::Display for Fairness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fairness::Memory => "memory",
            Fairness::Durable => "durable",
        })
    }
}

/// A platform rule a class breaks. Wrapped in [`PolicyError::InvalidClass`],
/// which adds the class name.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ClassError {
    #[error("invalid name: {0}")]
    Name(NameError),

    #[error(
        "ttlSeconds = {ttl} is outside the platform range {min}..={max}: \
         choose a value in range (the default is {default})",
        min = MIN_TTL_SECONDS,
        max = MAX_TTL_SECONDS,
        default = DEFAULT_TTL_SECONDS
    )]
    TtlOutOfRange { ttl: u32 },

    #[error(
        "ttlSeconds = {ttl} is below the advisory floor of {floor}: a false expiry on an \
         unfenced resource can cause a duplicate write; raise ttlSeconds or fence the resource",
        floor = ADVISORY_MIN_TTL_SECONDS
    )]
    AdvisoryTtlBelowFloor { ttl: u32 },

    #[error(
        "onQuorumLoss = \"open\" is not allowed for a fenced class: fenced classes claim \
         mutual exclusion, which an ungoverned grant breaks; use onQuorumLoss = \"closed\""
    )]
    OpenOnQuorumLossFenced,

    #[error("an election class takes no {field}: {why}; remove {field}")]
    NotForElections {
        field: &'static str,
        why: &'static str,
    },

    #[error(
        "maxHoldsPerSubject = {value} is outside 1..={max}",
        max = MAX_HOLDS_PER_SUBJECT_LIMIT
    )]
    MaxHoldsOutOfRange { value: u32 },

    #[error(
        "maxHoldsPerSubject is not allowed with onQuorumLoss = \"open\": a memory grant \
         made without the lock log cannot take a quota place in it, so the quota would not \
         hold; use onQuorumLoss = \"closed\" or remove maxHoldsPerSubject"
    )]
    QuotaOpenOnQuorumLoss,

    #[error(
        "maxHoldSeconds = {value} is outside ttlSeconds..={max} (ttlSeconds = {ttl}): a hold \
         cannot be ended sooner than its session could expire",
        max = MAX_HOLD_SECONDS_LIMIT
    )]
    MaxHoldSecondsOutOfRange { value: u32, ttl: u32 },

    #[error(
        "maxHoldSeconds is not allowed with onQuorumLoss = \"open\": a memory grant made \
         without the lock log cannot be ended by it; use onQuorumLoss = \"closed\" or remove \
         maxHoldSeconds"
    )]
    MaxHoldOpenOnQuorumLoss,

    #[error(
        "permits = {value} is outside 1..={max}",
        max = MAX_PERMITS
    )]
    PermitsOutOfRange { value: u32 },

    #[error(
        "a semaphore class (kind = \"semaphore\") needs permits, the number of holds a key \
         carries at once, e.g. permits = 8"
    )]
    SemaphoreWithoutPermits,

    #[error("permits is for semaphore classes: set kind = \"semaphore\" or remove permits")]
    PermitsOnLock,

    #[error("a semaphore class takes no {field} (yet): {why}; remove {field}")]
    NotForSemaphores {
        field: &'static str,
        why: &'static str,
    },

    #[error(
        "yieldToHigherPriority is for election classes (kind = \"election\"): a lock has no \
         priority to yield to; remove it or set kind = \"election\""
    )]
    YieldOnLock,

    #[error(
        "advisory classes need riskOwner (who accepts the risk of an unfenced lock, e.g. \
         \"team-reporting@example.com\") and waiverExpires (\"YYYY-MM-DD\"); missing: {missing}"
    )]
    AdvisoryWithoutWaiver { missing: &'static str },

    #[error(
        "fenced classes take no {field}: a waiver is only for advisory classes; \
         remove {field} or set enforcement = \"advisory\""
    )]
    WaiverOnFenced { field: &'static str },

    #[error(
        "riskOwner must name a person or team in printable text, e.g. \"team-reporting@example.com\""
    )]
    BadRiskOwner,

    #[error(
        "waiverExpires = {expired} has passed (today is {today}): renew the waiver on the \
         record with a new date, or fence the resource and set enforcement = \"fenced\""
    )]
    WaiverExpired { expired: Date, today: Date },

    #[error(
        "maxWaitersPerKey = {value} is outside 1..={max}",
        max = MAX_WAITERS_PER_KEY_LIMIT
    )]
    MaxWaitersOutOfRange { value: u32 },

    #[error(
        "namespaces is only for coord-tier classes: an entity-tier class serves every \
         namespace no coord-tier class names; remove namespaces or set tier = \"coord\""
    )]
    NamespacesOnEntity,

    #[error(
        "namespaces lists {count} entries, over the limit of {max}: group the class's keys \
         under fewer namespaces",
        max = MAX_CLASS_NAMESPACES
    )]
    TooManyNamespaces { count: usize },

    #[error(
        "namespaces has an entry that is not a key namespace: {source}; a namespace is the \
         first segment of a key, e.g. \"leader\" for \"leader/scheduler\""
    )]
    NamespaceNotAKey { source: KeyError },

    #[error(
        "namespaces entry \"{namespace}\" has a '/': a namespace is one key segment, the \
         first of a key; list \"{first}\" instead"
    )]
    NamespaceNotOneSegment {
        /// The entry, cut and escaped like an echoed key.
        namespace: String,
        /// Its first segment, cut and escaped likewise.
        first: String,
    },

    #[error("namespaces lists \"{namespace}\" twice: list each namespace once")]
    DuplicateNamespace {
        /// The entry, cut and escaped like an echoed key.
        namespace: String,
    },

    #[error("hook.module must name a .wasm file (a path relative to the policy directory)")]
    HookModule,

    #[error("hook.{field} = {value} is outside the platform range 1..={max}")]
    HookLimit {
        field: &'static str,
        value: u32,
        max: u32,
    },

    #[error("pauseTest.{field} {rule}")]
    PauseTestField {
        field: &'static str,
        rule: &'static str,
    },

    #[error(
        "enforcement = \"fenced\" but no passing pause test: there is no [class.pauseTest]. \
         Run `{command}` against the real resource and add [class.pauseTest] with its resource \
         and result, or declare the class advisory with riskOwner and waiverExpires"
    )]
    FencedWithoutPauseTest { command: String },

    #[error(
        "enforcement = \"fenced\" but no passing pause test: {reason}. Run `{command}` against \
         the real resource, or declare the class advisory with riskOwner and waiverExpires"
    )]
    NoPassingPauseTest {
        reason: Box<PauseTestError>,
        command: String,
    },
}

/// Why a class name is unusable.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NameError {
    #[error("the name is empty")]
    Empty,

    #[error("class names are at most {max} bytes; this one is {len}", max = MAX_CLASS_NAME_BYTES)]
    TooLong { len: usize },

    #[error("the name contains the invisible or control character {codepoint} at byte {at}")]
    Unprintable { codepoint: String, at: usize },

    #[error("class names are a single segment; \"/\" is not allowed")]
    Slash,

    #[error("\".\" and \"..\" are not class names")]
    Dot,
}

impl LockClass {
    /// Checks the platform rules; `today` decides whether a waiver has expired.
    ///
    /// Reports the first rule broken. A fenced class's pause-test result is a
    /// file beside the policy, so it is checked apart, by
    /// [`LockClass::check_pause_test`]; [`crate::PolicySet::load_dir`] does both.
    pub fn validate(&self, today: Date) -> Result<(), PolicyError> {
        self.check(today)
            .map_err(|source| PolicyError::InvalidClass {
                class: key::excerpt(&self.name),
                source,
            })
    }

    /// What an election class may not set: leadership is only ever in the
    /// lock log (no memory grants on quorum loss), candidates are always
    /// queued there (no fairness setting), and hooks run on Acquire only.
    fn check_election(&self) -> Result<(), ClassError> {
        if self.kind != ClassKind::Election {
            if self.yield_to_higher_priority {
                return Err(ClassError::YieldOnLock);
            }
            return Ok(());
        }
        if self.max_hold_seconds.is_some() {
            return Err(ClassError::NotForElections {
                field: "maxHoldSeconds",
                why: "a leadership ends by resigning, a transfer, a force-release or its session",
            });
        }
        if self.max_holds_per_subject.is_some() {
            return Err(ClassError::NotForElections {
                field: "maxHoldsPerSubject",
                why: "a subject's leaderships are bounded by the arbiter's per-subject bounds, not by a class quota",
            });
        }
        if self.on_quorum_loss == OnQuorumLoss::Open {
            return Err(ClassError::NotForElections {
                field: "onQuorumLoss = \"open\"",
                why: "a leadership is only ever granted by the lock log, never from an arbiter's memory",
            });
        }
        if self.fairness != Fairness::Memory {
            return Err(ClassError::NotForElections {
                field: "fairness",
                why: "candidates always wait in the lock log, ordered by priority and then arrival",
            });
        }
        if self.tier != Tier::Coord {
            return Err(ClassError::NotForElections {
                field: "tier = \"entity\"",
                why: "elections run on the coord tier, whose keys never move between shards (a leader on a moving range would be followed by a second one)",
            });
        }
        if self.max_waiters_per_key > MAX_ELECTION_CANDIDATES {
            return Err(ClassError::NotForElections {
                field: "a maxWaitersPerKey above 1024",
                why: "an election's candidates are read in one answer of at most 1024",
            });
        }
        if self.hook.is_some() {
            return Err(ClassError::NotForElections {
                field: "hook",
                why: "class hooks run before lock grants only, not before a leadership",
            });
        }
        Ok(())
    }

    /// What a semaphore class must and may not set. Each refusal is a path
    /// that would decide a slot outside the grant transaction, or a queue
    /// that does not know slots yet.
    fn check_semaphore(&self) -> Result<(), ClassError> {
        if self.kind != ClassKind::Semaphore {
            return match self.permits {
                Some(_) => Err(ClassError::PermitsOnLock),
                None => Ok(()),
            };
        }
        let Some(value) = self.permits else {
            return Err(ClassError::SemaphoreWithoutPermits);
        };
        if !(1..=MAX_PERMITS).contains(&value) {
            return Err(ClassError::PermitsOutOfRange { value });
        }
        if self.on_quorum_loss == OnQuorumLoss::Open {
            return Err(ClassError::NotForSemaphores {
                field: "onQuorumLoss = \"open\"",
                why: "a slot is only ever granted by the lock log, which counts the permits",
            });
        }
        if self.fairness != Fairness::Memory {
            return Err(ClassError::NotForSemaphores {
                field: "fairness = \"durable\"",
                why: "a semaphore's waiters queue on the arbiter they called (FIFO per arbiter)",
            });
        }
        if self.max_holds_per_subject.is_some() {
            return Err(ClassError::NotForSemaphores {
                field: "maxHoldsPerSubject",
                why: "a quota place and a slot are not yet taken in one transaction",
            });
        }
        if self.hook.is_some() {
            return Err(ClassError::NotForSemaphores {
                field: "hook",
                why: "a hook's holder input is a lock's holder, and a semaphore's slot holders are not shown to hooks",
            });
        }
        Ok(())
    }

    fn check(&self, today: Date) -> Result<(), ClassError> {
        validate_name(&self.name).map_err(ClassError::Name)?;

        let ttl = self.ttl_seconds;
        if !(MIN_TTL_SECONDS..=MAX_TTL_SECONDS).contains(&ttl) {
            return Err(ClassError::TtlOutOfRange { ttl });
        }
        if !(1..=MAX_WAITERS_PER_KEY_LIMIT).contains(&self.max_waiters_per_key) {
            return Err(ClassError::MaxWaitersOutOfRange {
                value: self.max_waiters_per_key,
            });
        }
        if let Some(value) = self.max_holds_per_subject {
            if !(1..=MAX_HOLDS_PER_SUBJECT_LIMIT).contains(&value) {
                return Err(ClassError::MaxHoldsOutOfRange { value });
            }
            if self.on_quorum_loss == OnQuorumLoss::Open {
                return Err(ClassError::QuotaOpenOnQuorumLoss);
            }
        }
        if let Some(value) = self.max_hold_seconds {
            if !(ttl..=MAX_HOLD_SECONDS_LIMIT).contains(&value) {
                return Err(ClassError::MaxHoldSecondsOutOfRange { value, ttl });
            }
            if self.on_quorum_loss == OnQuorumLoss::Open {
                return Err(ClassError::MaxHoldOpenOnQuorumLoss);
            }
        }
        self.check_namespaces()?;
        self.check_election()?;
        self.check_semaphore()?;
        if let Some(hook) = &self.hook {
            hook.check()?;
        }
        if let Some(pause_test) = &self.pause_test {
            pause_test.check()?;
        }

        match self.enforcement {
            Enforcement::Fenced => {
                if self.on_quorum_loss == OnQuorumLoss::Open {
                    return Err(ClassError::OpenOnQuorumLossFenced);
                }
                if self.risk_owner.is_some() {
                    return Err(ClassError::WaiverOnFenced { field: "riskOwner" });
                }
                if self.waiver_expires.is_some() {
                    return Err(ClassError::WaiverOnFenced {
                        field: "waiverExpires",
                    });
                }
            }
            Enforcement::Advisory => {
                let (owner, expires) = match (&self.risk_owner, self.waiver_expires) {
                    (Some(owner), Some(expires)) => (owner, expires),
                    (None, None) => {
                        return Err(ClassError::AdvisoryWithoutWaiver {
                            missing: "riskOwner and waiverExpires",
                        });
                    }
                    (None, Some(_)) => {
                        return Err(ClassError::AdvisoryWithoutWaiver {
                            missing: "riskOwner",
                        });
                    }
                    (Some(_), None) => {
                        return Err(ClassError::AdvisoryWithoutWaiver {
                            missing: "waiverExpires",
                        });
                    }
                };
                if owner.trim().is_empty() || !owner.chars().all(key::is_printable) {
                    return Err(ClassError::BadRiskOwner);
                }
                if ttl < ADVISORY_MIN_TTL_SECONDS {
                    return Err(ClassError::AdvisoryTtlBelowFloor { ttl });
                }
                // The waiver is good through the whole of its last day.
                if expires < today {
                    return Err(ClassError::WaiverExpired {
                        expired: expires,
                        today,
                    });
                }
            }
        }
        Ok(())
    }

    /// ADR-07: only a coord-tier class lists namespaces, each one key
    /// segment, at most [`MAX_CLASS_NAMESPACES`], none twice. A coord class
    /// with none is allowed: once tiers are split it serves no keys.
    fn check_namespaces(&self) -> Result<(), ClassError> {
        if self.namespaces.is_empty() {
            return Ok(());
        }
        if self.tier != Tier::Coord {
            return Err(ClassError::NamespacesOnEntity);
        }
        if self.namespaces.len() > MAX_CLASS_NAMESPACES {
            return Err(ClassError::TooManyNamespaces {
                count: self.namespaces.len(),
            });
        }
        let mut seen = std::collections::BTreeSet::new();
        for namespace in &self.namespaces {
            let parsed = LockKey::parse(namespace)
                .map_err(|source| ClassError::NamespaceNotAKey { source })?;
            if parsed.namespace() != namespace {
                return Err(ClassError::NamespaceNotOneSegment {
                    namespace: key::excerpt(namespace),
                    first: key::excerpt(parsed.namespace()),
                });
            }
            if !seen.insert(namespace.as_str()) {
                return Err(ClassError::DuplicateNamespace {
                    namespace: key::excerpt(namespace),
                });
            }
        }
        Ok(())
    }

    /// ADR-17: a fenced class must name a passing pause-test result that is
    /// under a year old at `now`, for this class and its resource (and schema
    /// version, when declared). Reads the result file, relative to
    /// `policy_dir`; advisory classes pass without reading anything.
    ///
    /// Separate from [`LockClass::validate`], which needs no files.
    pub fn check_pause_test(&self, policy_dir: &Path, now: SystemTime) -> Result<(), PolicyError> {
        if self.enforcement != Enforcement::Fenced {
            return Ok(());
        }
        let source = match &self.pause_test {
            None => ClassError::FencedWithoutPauseTest {
                command: pause_test::kit_command(
                    &self.name,
                    self.kind == ClassKind::Election,
                    None,
                    &policy_dir
                        .join("pause-tests")
                        .join(format!("{}.json", self.name)),
                ),
            },
            Some(spec) => match pause_test::verify(&self.name, spec, policy_dir, now) {
                Ok(()) => return Ok(()),
                Err(reason) => ClassError::NoPassingPauseTest {
                    reason: Box::new(reason),
                    command: pause_test::kit_command(
                        &self.name,
                        self.kind == ClassKind::Election,
                        Some(&spec.resource),
                        &policy_dir.join(&spec.result),
                    ),
                },
            },
        };
        Err(PolicyError::InvalidClass {
            class: key::excerpt(&self.name),
            source,
        })
    }

    /// How often the client sends a keepalive: a third of the TTL, so two
    /// can be lost before the lease expires.
    pub fn keepalive_interval_ms(&self) -> u64 {
        u64::from(self.ttl_seconds) * 1000 / 3
    }

    /// How long after the send time of its last successful keepalive a
    /// holder calls onFence: TTL minus a one-second margin (ADR-12).
    pub fn fence_deadline_ms(&self) -> u64 {
        (u64::from(self.ttl_seconds) * 1000).saturating_sub(FENCE_MARGIN_MS)
    }
}

/// A class name is one key segment: printable, no `/`, not `.` or `..`,
/// at most [`MAX_CLASS_NAME_BYTES`].
fn validate_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_CLASS_NAME_BYTES {
        return Err(NameError::TooLong { len: name.len() });
    }
    if let Some((at, c)) = name.char_indices().find(|&(_, c)| !key::is_printable(c)) {
        return Err(NameError::Unprintable {
            codepoint: format!("U+{:04X}", u32::from(c)),
            at,
        });
    }
    if name.contains('/') {
        return Err(NameError::Slash);
    }
    if name == "." || name == ".." {
        return Err(NameError::Dot);
    }
    Ok(())
}

/// The cost of a class's TTL next to the TTL (ADR-11): what
/// `latchctl classes check` prints for a pull request.
#[derive(Debug, Clone, PartialEq)]
pub struct ReviewReport {
    pub class: String,
    pub tier: Tier,
    /// For a coord-tier class: the key namespaces it serves (ADR-07).
    pub namespaces: Vec<String>,
    pub enforcement: Enforcement,
    pub on_quorum_loss: OnQuorumLoss,
    pub fairness: Fairness,
    pub ttl_seconds: u32,
    pub expected_sessions: u64,
    /// Each session sends one keepalive this often.
    pub keepalive_interval_ms: u64,
    /// Keepalive load on the tier: sessions / (ttl / 3).
    pub keepalives_per_second: f64,
    /// Worst case a dead holder blocks its key: the lease must expire.
    pub liveness_bound_seconds: u32,
    /// A live holder that cannot renew fences this long after the send
    /// time of its last successful keepalive (ttl - 1 s).
    pub fence_deadline_ms: u64,
    /// For advisory classes: who owns the risk, and until when.
    pub waiver: Option<(String, Date)>,
    /// For a semaphore class: how many holds a key carries at once.
    pub permits: Option<u32>,
}

/// Computes the review numbers for `class` at `expected_sessions`
/// concurrent sessions (one session per identity and TTL, ADR-10).
pub fn review(class: &LockClass, expected_sessions: u64) -> ReviewReport {
    let ttl = class.ttl_seconds;
    let keepalives_per_second = if ttl == 0 {
        f64::INFINITY
    } else {
        expected_sessions as f64 * 3.0 / f64::from(ttl)
    };
    ReviewReport {
        class: class.name.clone(),
        tier: class.tier,
        namespaces: class.namespaces.clone(),
        enforcement: class.enforcement,
        on_quorum_loss: class.on_quorum_loss,
        fairness: class.fairness,
        ttl_seconds: ttl,
        expected_sessions,
        keepalive_interval_ms: class.keepalive_interval_ms(),
        keepalives_per_second,
        liveness_bound_seconds: ttl,
        fence_deadline_ms: class.fence_deadline_ms(),
        waiver: match (&class.risk_owner, class.waiver_expires) {
            (Some(owner), Some(expires)) => Some((owner.clone(), expires)),
            _ => None,
        },
        permits: match class.kind {
            ClassKind::Semaphore => class.permits,
            _ => None,
        },
    }
}

/// One line per class, e.g.
///
/// `leader: coord (namespaces leader, sched), fenced, closed on quorum loss, ttl 15s: 200.0 keepalives/s for 1000 sessions (one per session every 5000 ms); a dead holder blocks its key for up to 15 s; a holder that cannot renew fences 14.0 s after its last keepalive send`
///
/// A coord-tier class shows the key namespaces it serves (ADR-07), or that
/// it serves none.
impl fmt::Display for ReviewReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", key::excerpt(&self.class), self.tier)?;
        if self.tier == Tier::Coord {
            if self.namespaces.is_empty() {
                f.write_str(" (no namespaces: with split tiers it serves no keys)")?;
            } else {
                f.write_str(" (namespaces ")?;
                for (i, namespace) in self.namespaces.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    f.write_str(&key::excerpt(namespace))?;
                }
                f.write_str(")")?;
            }
        }
        if let Some(permits) = self.permits {
            write!(
                f,
                ", a semaphore of {permits} permits (one slot per holder)"
            )?;
        }
        let blocks = match self.permits {
            Some(_) => "its slot",
            None => "its key",
        };
        write!(
            f,
            ", {}, {} on quorum loss, ttl {}s: {:.1} keepalives/s for {} sessions (one per \
             session every {} ms); a dead holder blocks {blocks} for up to {} s; a holder that cannot \
             renew fences {:.1} s after its last keepalive send",
            self.enforcement,
            self.on_quorum_loss,
            self.ttl_seconds,
            self.keepalives_per_second,
            self.expected_sessions,
            self.keepalive_interval_ms,
            self.liveness_bound_seconds,
            self.fence_deadline_ms as f64 / 1000.0,
        )?;
        if self.fairness == Fairness::Durable {
            f.write_str(
                "; durable waiters: 2 more consensus writes per waiting call (its queue record \
                 and its removal), order kept across arbiter restarts",
            )?;
        }
        if self.on_quorum_loss == OnQuorumLoss::Open {
            f.write_str(
                "; during quorum loss grants continue UNPROTECTED from one arbiter's memory \
                 (token 0, spooled for the audit trail)",
            )?;
        }
        if let Some((owner, expires)) = &self.waiver {
            write!(
                f,
                "; ADVISORY: no mutual exclusion, risk owned by {} until {expires}",
                key::excerpt(owner)
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn today() -> Date {
        Date::parse("2026-01-15").unwrap()
    }

    fn parse(toml_text: &str) -> LockClass {
        toml::from_str(toml_text).unwrap_or_else(|e| panic!("{e}"))
    }

    fn fenced() -> LockClass {
        parse("name = \"demo\"\ntier = \"coord\"\nenforcement = \"fenced\"")
    }

    fn advisory() -> LockClass {
        parse(
            "name = \"batch\"\ntier = \"entity\"\nenforcement = \"advisory\"\nttlSeconds = 60\n\
             riskOwner = \"team@example.com\"\nwaiverExpires = \"2027-06-30\"",
        )
    }

    fn rule(class: &LockClass) -> ClassError {
        match class.validate(today()) {
            Err(PolicyError::InvalidClass { source, .. }) => source,
            other => panic!("expected InvalidClass, got {other:?}"),
        }
    }

    #[test]
    fn defaults_apply() {
        let c = fenced();
        assert_eq!(c.ttl_seconds, 15);
        assert_eq!(c.on_quorum_loss, OnQuorumLoss::Closed);
        assert_eq!(c.fairness, Fairness::Memory);
        assert_eq!(c.max_waiters_per_key, 64);
        assert_eq!(c.risk_owner, None);
        assert_eq!(c.description, None);
        c.validate(today()).unwrap();
        advisory().validate(today()).unwrap();
    }

    #[test]
    fn unknown_fields_and_values_are_refused() {
        let err = toml::from_str::<LockClass>(
            "name = \"x\"\ntier = \"coord\"\nenforcement = \"fenced\"\nttl = 10",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("unknown field `ttl`"), "{err}");
        let err =
            toml::from_str::<LockClass>("name = \"x\"\ntier = \"edge\"\nenforcement = \"fenced\"")
                .unwrap_err()
                .to_string();
        assert!(err.contains("unknown variant `edge`"), "{err}");
        let err = toml::from_str::<LockClass>("name = \"x\"\ntier = \"coord\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `enforcement`"), "{err}");
    }

    #[test]
    fn ttl_range_and_advisory_floor() {
        for ttl in [5, 15, 300] {
            let c = LockClass {
                kind: ClassKind::Lock,
                ttl_seconds: ttl,
                ..fenced()
            };
            c.validate(today()).unwrap();
        }
        for ttl in [0, 4, 301] {
            let c = LockClass {
                kind: ClassKind::Lock,
                ttl_seconds: ttl,
                ..fenced()
            };
            assert_eq!(rule(&c), ClassError::TtlOutOfRange { ttl });
        }
        let c = LockClass {
            kind: ClassKind::Lock,
            ttl_seconds: 29,
            ..advisory()
        };
        assert_eq!(rule(&c), ClassError::AdvisoryTtlBelowFloor { ttl: 29 });
        LockClass {
            kind: ClassKind::Lock,
            ttl_seconds: 30,
            ..advisory()
        }
        .validate(today())
        .unwrap();
    }

    #[test]
    fn open_on_quorum_loss_only_for_advisory() {
        let c = LockClass {
            kind: ClassKind::Lock,
            on_quorum_loss: OnQuorumLoss::Open,
            ..fenced()
        };
        assert_eq!(rule(&c), ClassError::OpenOnQuorumLossFenced);
        LockClass {
            kind: ClassKind::Lock,
            on_quorum_loss: OnQuorumLoss::Open,
            ..advisory()
        }
        .validate(today())
        .unwrap();
    }

    #[test]
    fn durable_fairness_is_accepted_and_its_cost_is_printed_for_review() {
        let c = parse(
            "name = \"d\"\ntier = \"entity\"\nenforcement = \"fenced\"\nfairness = \"durable\"",
        );
        assert_eq!(c.fairness, Fairness::Durable);
        c.validate(today()).unwrap();
        let line = review(&c, 10).to_string();
        assert!(
            line.contains("durable waiters: 2 more consensus writes per waiting call"),
            "{line}"
        );
        let memory = parse("name = \"m\"\ntier = \"entity\"\nenforcement = \"fenced\"");
        assert!(!review(&memory, 10).to_string().contains("durable"));
    }

    #[test]
    fn advisory_needs_owner_and_unexpired_waiver() {
        let c = LockClass {
            kind: ClassKind::Lock,
            risk_owner: None,
            waiver_expires: None,
            ..advisory()
        };
        assert_eq!(
            rule(&c),
            ClassError::AdvisoryWithoutWaiver {
                missing: "riskOwner and waiverExpires"
            }
        );
        let c = LockClass {
            kind: ClassKind::Lock,
            risk_owner: None,
            ..advisory()
        };
        assert_eq!(
            rule(&c),
            ClassError::AdvisoryWithoutWaiver {
                missing: "riskOwner"
            }
        );
        let c = LockClass {
            kind: ClassKind::Lock,
            waiver_expires: None,
            ..advisory()
        };
        assert_eq!(
            rule(&c),
            ClassError::AdvisoryWithoutWaiver {
                missing: "waiverExpires"
            }
        );
        let c = LockClass {
            kind: ClassKind::Lock,
            risk_owner: Some("  ".into()),
            ..advisory()
        };
        assert_eq!(rule(&c), ClassError::BadRiskOwner);

        let expires = Date::parse("2026-01-14").unwrap();
        let c = LockClass {
            kind: ClassKind::Lock,
            waiver_expires: Some(expires),
            ..advisory()
        };
        assert_eq!(
            rule(&c),
            ClassError::WaiverExpired {
                expired: expires,
                today: today()
            }
        );
        // Good through its last day.
        LockClass {
            kind: ClassKind::Lock,
            waiver_expires: Some(today()),
            ..advisory()
        }
        .validate(today())
        .unwrap();
    }

    #[test]
    fn fenced_takes_no_waiver() {
        let c = LockClass {
            kind: ClassKind::Lock,
            risk_owner: Some("x@example.com".into()),
            ..fenced()
        };
        assert_eq!(rule(&c), ClassError::WaiverOnFenced { field: "riskOwner" });
        let c = LockClass {
            kind: ClassKind::Lock,
            waiver_expires: Some(today()),
            ..fenced()
        };
        assert_eq!(
            rule(&c),
            ClassError::WaiverOnFenced {
                field: "waiverExpires"
            }
        );
    }

    #[test]
    fn names_are_single_printable_segments() {
        for bad in ["", "a/b", ".", "..", "a\tb", &"n".repeat(64)] {
            let c = LockClass {
                kind: ClassKind::Lock,
                name: bad.to_string(),
                ..fenced()
            };
            assert!(matches!(rule(&c), ClassError::Name(_)), "{bad:?}");
        }
        let c = LockClass {
            kind: ClassKind::Lock,
            name: "a/b".into(),
            ..fenced()
        };
        assert_eq!(
            c.validate(today()).unwrap_err().to_string(),
            "lock class \"a/b\": invalid name: class names are a single segment; \"/\" is not allowed"
        );
        LockClass {
            kind: ClassKind::Lock,
            name: "payments-ledger.v2".into(),
            ..fenced()
        }
        .validate(today())
        .unwrap();
    }

    #[test]
    fn pause_test_block_is_syntax_checked_here_and_read_elsewhere() {
        let with_block = |class: &str, result: &str| {
            parse(&format!(
                "{class}\n[pauseTest]\nresource = \"postgresql:t.rows\"\nresult = \"{result}\""
            ))
        };
        // No file is read by validate, for either enforcement.
        with_block(
            "name = \"demo\"\ntier = \"coord\"\nenforcement = \"fenced\"",
            "p/demo.json",
        )
        .validate(today())
        .unwrap();
        fenced().validate(today()).unwrap();
        let c = LockClass {
            kind: ClassKind::Lock,
            pause_test: with_block(
                "name = \"x\"\ntier = \"coord\"\nenforcement = \"fenced\"",
                "/abs.json",
            )
            .pause_test,
            ..advisory()
        };
        assert!(matches!(
            rule(&c),
            ClassError::PauseTestField {
                field: "result",
                ..
            }
        ));
        // An advisory class reads nothing even through check_pause_test.
        let c = LockClass {
            kind: ClassKind::Lock,
            pause_test: with_block(
                "name = \"x\"\ntier = \"coord\"\nenforcement = \"fenced\"",
                "p/none.json",
            )
            .pause_test,
            ..advisory()
        };
        c.check_pause_test(Path::new("/nonexistent"), SystemTime::now())
            .unwrap();
    }

    #[test]
    fn max_waiters_range() {
        for value in [0, 10_001] {
            let c = LockClass {
                kind: ClassKind::Lock,
                max_waiters_per_key: value,
                ..fenced()
            };
            assert_eq!(rule(&c), ClassError::MaxWaitersOutOfRange { value });
        }
        LockClass {
            kind: ClassKind::Lock,
            max_waiters_per_key: 10_000,
            ..fenced()
        }
        .validate(today())
        .unwrap();
    }

    #[test]
    fn timing_follows_ttl() {
        let c = LockClass {
            kind: ClassKind::Lock,
            ttl_seconds: 15,
            ..fenced()
        };
        assert_eq!(c.keepalive_interval_ms(), 5_000);
        assert_eq!(c.fence_deadline_ms(), 14_000);
        let c = LockClass {
            kind: ClassKind::Lock,
            ttl_seconds: 10,
            ..fenced()
        };
        assert_eq!(c.keepalive_interval_ms(), 3_333);
        assert_eq!(c.fence_deadline_ms(), 9_000);
    }

    #[test]
    fn review_prints_cost_next_to_knob() {
        let report = review(&fenced(), 1000);
        assert_eq!(report.keepalives_per_second, 200.0);
        assert_eq!(report.liveness_bound_seconds, 15);
        assert_eq!(report.fence_deadline_ms, 14_000);
        assert_eq!(
            report.to_string(),
            "demo: coord (no namespaces: with split tiers it serves no keys), fenced, closed on \
             quorum loss, ttl 15s: 200.0 keepalives/s for 1000 \
             sessions (one per session every 5000 ms); a dead holder blocks its key for up to 15 s; \
             a holder that cannot renew fences 14.0 s after its last keepalive send"
        );
        let short = review(
            &LockClass {
                kind: ClassKind::Lock,
                ttl_seconds: 5,
                ..fenced()
            },
            1000,
        );
        assert_eq!(short.keepalives_per_second, 600.0);

        let line = review(&advisory(), 10).to_string();
        assert!(line.contains("0.5 keepalives/s for 10 sessions"), "{line}");
        assert!(
            line.ends_with(
                "ADVISORY: no mutual exclusion, risk owned by team@example.com until 2027-06-30"
            ),
            "{line}"
        );
        assert!(!line.contains('\n'));
    }

    fn with_namespaces(class: LockClass, namespaces: &[&str]) -> LockClass {
        LockClass {
            kind: ClassKind::Lock,
            namespaces: namespaces.iter().map(|n| n.to_string()).collect(),
            ..class
        }
    }

    /// ADR-07: only a coord-tier class lists namespaces, and the loader says
    /// how to fix a class that breaks a rule.
    #[test]
    fn namespaces_are_for_coord_classes_only() {
        let c = parse(
            "name = \"leader\"\ntier = \"coord\"\nnamespaces = [\"leader\", \"sched\"]\n\
             enforcement = \"fenced\"",
        );
        assert_eq!(c.namespaces, ["leader", "sched"]);
        c.validate(today()).unwrap();
        // A coord class with none is allowed (it serves no keys once split).
        fenced().validate(today()).unwrap();
        assert!(fenced().namespaces.is_empty());

        let entity = with_namespaces(advisory(), &["batch"]);
        assert_eq!(rule(&entity), ClassError::NamespacesOnEntity);
        assert_eq!(
            entity.validate(today()).unwrap_err().to_string(),
            "lock class \"batch\": namespaces is only for coord-tier classes: an entity-tier \
             class serves every namespace no coord-tier class names; remove namespaces or set \
             tier = \"coord\""
        );
        // An empty list on an entity class is the same as none.
        with_namespaces(advisory(), &[]).validate(today()).unwrap();
    }

    #[test]
    fn namespaces_are_single_key_segments() {
        for bad in ["", ".", "..", "a\tb", "a\u{200b}", &"n".repeat(513)] {
            let c = with_namespaces(fenced(), &["ok", bad]);
            assert!(
                matches!(rule(&c), ClassError::NamespaceNotAKey { .. }),
                "{bad:?}: {:?}",
                rule(&c)
            );
        }
        let msg = with_namespaces(fenced(), &["a\tb"])
            .validate(today())
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("lock class \"demo\": namespaces has an entry that is not a key namespace: lock key contains the invisible or control character U+0009")
                && msg.ends_with("a namespace is the first segment of a key, e.g. \"leader\" for \"leader/scheduler\""),
            "{msg}"
        );
        assert!(!msg.contains('\t'), "{msg}");

        for (bad, first) in [("leader/x", "leader"), ("a/b/c", "a")] {
            let c = with_namespaces(fenced(), &[bad]);
            assert_eq!(
                rule(&c),
                ClassError::NamespaceNotOneSegment {
                    namespace: bad.into(),
                    first: first.into()
                }
            );
        }
        assert_eq!(
            rule(&with_namespaces(fenced(), &["leader/x"])).to_string(),
            "namespaces entry \"leader/x\" has a '/': a namespace is one key segment, the first \
             of a key; list \"leader\" instead"
        );
        // A slash-bearing entry that is not even a key is refused as a key.
        assert!(matches!(
            rule(&with_namespaces(fenced(), &["a//b"])),
            ClassError::NamespaceNotAKey { .. }
        ));
        // Whatever a key segment may hold is fine: spaces, dots, non-ASCII.
        with_namespaces(
            fenced(),
            &["zürich", "a.b", "nightly report", &"n".repeat(512)],
        )
        .validate(today())
        .unwrap();
    }

    #[test]
    fn namespaces_are_bounded_and_listed_once() {
        let names: Vec<String> = (0..=MAX_CLASS_NAMESPACES)
            .map(|i| format!("ns{i}"))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        with_namespaces(fenced(), &refs[..MAX_CLASS_NAMESPACES])
            .validate(today())
            .unwrap();
        let c = with_namespaces(fenced(), &refs);
        assert_eq!(rule(&c), ClassError::TooManyNamespaces { count: 65 });
        assert_eq!(
            rule(&c).to_string(),
            "namespaces lists 65 entries, over the limit of 64: group the class's keys under \
             fewer namespaces"
        );

        let c = with_namespaces(fenced(), &["leader", "sched", "leader"]);
        assert_eq!(
            rule(&c),
            ClassError::DuplicateNamespace {
                namespace: "leader".into()
            }
        );
        assert_eq!(
            rule(&c).to_string(),
            "namespaces lists \"leader\" twice: list each namespace once"
        );
    }

    #[test]
    fn namespaces_serialize_only_when_listed() {
        let json = serde_json::to_value(fenced()).unwrap();
        assert!(json.get("namespaces").is_none(), "{json}");
        let json = serde_json::to_value(with_namespaces(fenced(), &["leader"])).unwrap();
        assert_eq!(json["namespaces"], serde_json::json!(["leader"]));
    }

    #[test]
    fn review_shows_the_namespaces_of_a_coord_class() {
        let line = review(&with_namespaces(fenced(), &["leader", "sched"]), 1000).to_string();
        assert!(
            line.starts_with(
                "demo: coord (namespaces leader, sched), fenced, closed on quorum loss, ttl 15s:"
            ),
            "{line}"
        );
        let line = review(&fenced(), 1000).to_string();
        assert!(
            line.starts_with(
                "demo: coord (no namespaces: with split tiers it serves no keys), fenced, closed \
                 on quorum loss,"
            ),
            "{line}"
        );
        // Entity lines are unchanged.
        let line = review(&advisory(), 10).to_string();
        assert!(
            line.starts_with("batch: entity, advisory, closed on quorum loss, ttl 60s:"),
            "{line}"
        );
    }

    /// ADR-04: a class that does not say is closed (the safe posture, and
    /// every policy file written before the field existed keeps loading);
    /// open must be written down, is refused on a fenced class with a
    /// message naming the fix, and shows in the review line.
    #[test]
    fn quorum_loss_posture_defaults_closed_and_open_is_reviewed() {
        assert_eq!(fenced().on_quorum_loss, OnQuorumLoss::Closed);
        let open = parse(
            "name = \"warm\"\ntier = \"entity\"\nenforcement = \"advisory\"\nttlSeconds = 60\n\
             onQuorumLoss = \"open\"\nriskOwner = \"team@example.com\"\nwaiverExpires = \"2027-06-30\"",
        );
        assert_eq!(open.on_quorum_loss, OnQuorumLoss::Open);
        open.validate(today()).unwrap();
        let line = review(&open, 10).to_string();
        assert!(line.contains("advisory, open on quorum loss"), "{line}");
        assert!(line.contains("UNPROTECTED"), "{line}");
        let closed = review(&advisory(), 10).to_string();
        assert!(closed.contains("closed on quorum loss"), "{closed}");
        assert!(!closed.contains("UNPROTECTED"), "{closed}");

        let fenced_open = parse(
            "name = \"ledger\"\ntier = \"entity\"\nenforcement = \"fenced\"\nonQuorumLoss = \"open\"",
        );
        let msg = fenced_open.validate(today()).unwrap_err().to_string();
        assert!(
            msg.starts_with(
                "lock class \"ledger\": onQuorumLoss = \"open\" is not allowed for a fenced class"
            ) && msg.ends_with("use onQuorumLoss = \"closed\""),
            "{msg}"
        );
        let err = toml::from_str::<LockClass>(
            "name = \"x\"\ntier = \"coord\"\nenforcement = \"fenced\"\nonQuorumLoss = \"ajar\"",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("unknown variant `ajar`"), "{err}");
    }

    #[test]
    fn a_hold_lasts_at_most_max_hold_seconds_of_at_least_a_ttl() {
        let class = |extra: &str| {
            parse(&format!(
                "name = \"reports\"\ntier = \"entity\"\nenforcement = \"advisory\"\n\
                 ttlSeconds = 30\nriskOwner = \"team@example.com\"\nwaiverExpires = \"2027-06-30\"\n{extra}"
            ))
        };
        let ok = class("maxHoldSeconds = 600");
        assert_eq!(ok.max_hold_seconds, Some(600));
        ok.validate(today()).unwrap();
        class("maxHoldSeconds = 30").validate(today()).unwrap();
        assert_eq!(
            rule(&class("maxHoldSeconds = 29")),
            ClassError::MaxHoldSecondsOutOfRange { value: 29, ttl: 30 }
        );
        assert_eq!(
            rule(&class("maxHoldSeconds = 604801")),
            ClassError::MaxHoldSecondsOutOfRange {
                value: 604_801,
                ttl: 30
            }
        );
        assert_eq!(
            rule(&class("maxHoldSeconds = 60\nonQuorumLoss = \"open\"")),
            ClassError::MaxHoldOpenOnQuorumLoss
        );
        let message = rule(&class("maxHoldSeconds = 5")).to_string();
        assert!(message.contains("ttlSeconds"), "{message}");
    }

    #[test]
    fn a_semaphore_class_needs_permits_and_refuses_what_it_cannot_keep() {
        let sem = |extra: &str| {
            parse(&format!(
                "name = \"pool\"\nkind = \"semaphore\"\ntier = \"entity\"\nenforcement = \"advisory\"\n\
                 ttlSeconds = 30\nriskOwner = \"team@example.com\"\nwaiverExpires = \"2027-06-30\"\n{extra}"
            ))
        };
        let ok = sem("permits = 8");
        assert_eq!((ok.kind, ok.permits), (ClassKind::Semaphore, Some(8)));
        ok.validate(today()).unwrap();
        sem("permits = 256").validate(today()).unwrap();
        assert_eq!(rule(&sem("")), ClassError::SemaphoreWithoutPermits);
        assert_eq!(
            rule(&sem("permits = 0")),
            ClassError::PermitsOutOfRange { value: 0 }
        );
        assert_eq!(
            rule(&sem("permits = 257")),
            ClassError::PermitsOutOfRange { value: 257 }
        );
        for (extra, field) in [
            (
                "permits = 2\nonQuorumLoss = \"open\"",
                "onQuorumLoss = \"open\"",
            ),
            (
                "permits = 2\nfairness = \"durable\"",
                "fairness = \"durable\"",
            ),
            ("permits = 2\nmaxHoldsPerSubject = 1", "maxHoldsPerSubject"),
        ] {
            match rule(&sem(extra)) {
                ClassError::NotForSemaphores { field: f, .. } => assert_eq!(f, field),
                other => panic!("{extra}: {other:?}"),
            }
        }
        let mut hooked = sem("permits = 2");
        hooked.hook = Some(toml::from_str("module = \"h.wasm\"").unwrap());
        assert!(matches!(
            rule(&hooked),
            ClassError::NotForSemaphores { field: "hook", .. }
        ));
        let mut lock = advisory();
        lock.permits = Some(2);
        assert_eq!(rule(&lock), ClassError::PermitsOnLock);
        let msg = sem("").validate(today()).unwrap_err().to_string();
        assert!(msg.contains("needs permits"), "{msg}");
    }

    #[test]
    fn an_election_class_parses_and_refuses_what_elections_do_not_have() {
        let c = parse(
            r#"
name = "controller"
kind = "election"
tier = "coord"
namespaces = ["leader"]
enforcement = "fenced"
ttlSeconds = 10
[pauseTest]
resource = "postgresql:dev.latchkey_fenced_rows"
result = "pause-tests/demo.json"
"#,
        );
        assert_eq!(c.kind, ClassKind::Election);
        assert_eq!(c.check_election(), Ok(()));
        let open = LockClass {
            on_quorum_loss: OnQuorumLoss::Open,
            ..c.clone()
        };
        assert!(matches!(
            open.check_election(),
            Err(ClassError::NotForElections { field, .. }) if field.starts_with("onQuorumLoss")
        ));
        let durable = LockClass {
            fairness: Fairness::Durable,
            ..c.clone()
        };
        assert!(durable.check_election().is_err());
        let lock = parse(
            r#"
name = "plain"
tier = "coord"
enforcement = "fenced"
[pauseTest]
resource = "postgresql:dev.latchkey_fenced_rows"
result = "pause-tests/demo.json"
"#,
        );
        assert_eq!(lock.kind, ClassKind::Lock);
        // The default is not written back (reviewed files stay as they were).
        assert!(!toml::to_string(&lock).unwrap_or_default().contains("kind"));
        assert!(!toml::to_string(&lock).unwrap_or_default().contains("yield"));
        // yieldToHigherPriority: an election class's setting only.
        let yields = LockClass {
            yield_to_higher_priority: true,
            ..c.clone()
        };
        assert_eq!(yields.check_election(), Ok(()));
        let lock_yields = LockClass {
            yield_to_higher_priority: true,
            ..lock
        };
        assert_eq!(lock_yields.check_election(), Err(ClassError::YieldOnLock));
        let parsed = parse(
            r#"
name = "controller"
kind = "election"
tier = "coord"
enforcement = "advisory"
riskOwner = "team@example.com"
waiverExpires = "2027-06-30"
yieldToHigherPriority = true
"#,
        );
        assert!(parsed.yield_to_higher_priority);
    }
}
