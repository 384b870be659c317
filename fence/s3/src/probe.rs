//! The certification probe: a store that accepts a `PUT` whose precondition
//! does not hold ignores conditional writes, and nothing written to it can be
//! declared fenced. Many S3-compatible servers (and older releases of the
//! real ones) answer `200` to `If-Match` and `If-None-Match` on `PutObject`
//! without checking them; the fence must refuse those stores up front rather
//! than report `Applied` for writes that were never guarded.

use latchkey_fence::{FenceError, Mark};

use crate::{MARK_HEADER, Precondition, PutReply, S3Store};

/// Why a store cannot be certified for fencing. The text says what was seen
/// and what to do; it holds no token, mark or credential.
#[derive(Debug, thiserror::Error)]
pub enum NotHonoured {
    #[error(
        "{endpoint} accepted a PUT whose If-Match named a stale ETag: it ignores If-Match, \
         so writes to it can never be declared fenced. Use a store that enforces conditional \
         writes on PutObject (docs/fencing-s3.md), or fence through another store"
    )]
    IgnoresIfMatch { endpoint: String },
    #[error(
        "{endpoint} accepted a PUT with If-None-Match: * over an existing object: it ignores \
         If-None-Match, so writes to it can never be declared fenced (two holders could both \
         create a record). Use a store that enforces conditional writes on PutObject \
         (docs/fencing-s3.md), or fence through another store"
    )]
    IgnoresIfNoneMatch { endpoint: String },
    #[error(
        "{endpoint} kept the same ETag after the object's bytes changed: If-Match cannot tell \
         two versions apart, so it cannot be fenced"
    )]
    EtagUnchanged { endpoint: String },
    #[error(
        "{endpoint} refused a conditional PUT whose precondition held ({step}: {reply}): it \
         does not implement conditional writes, so it cannot be fenced"
    )]
    RefusesConditionalWrites {
        endpoint: String,
        step: &'static str,
        reply: String,
    },
    #[error(
        "{endpoint} did not return the {header} metadata it was given: the mark cannot live \
         there, so it cannot be fenced"
    )]
    DropsMetadata {
        endpoint: String,
        header: &'static str,
    },
    #[error("the probe could not complete: {0}")]
    Store(#[from] FenceError),
}

/// Certifies `store` for fencing: on a scratch object under the store's
/// prefix, a create with `If-None-Match: *` must land, an unconditional
/// overwrite must change the ETag, a PUT with the stale ETag in `If-Match`
/// and a PUT with `If-None-Match: *` over the existing object must both be
/// refused (`412`), a PUT with the current ETag must land, and the mark
/// metadata must come back on `HEAD`. The scratch object is deleted after.
pub async fn probe_conditional_writes(store: &S3Store) -> Result<(), NotHonoured> {
    let record = format!(".latchkey-probe-{:016x}", fastrand::u64(..));
    let outcome = run(store, &record).await;
    // Best effort: a leftover probe object is harmless.
    let _ = store.delete(&record).await;
    outcome
}

async fn run(store: &S3Store, record: &str) -> Result<(), NotHonoured> {
    let endpoint = store.config().endpoint.clone();
    let mark = Mark::new(0);
    let refused = |step: &'static str, reply: PutReply| NotHonoured::RefusesConditionalWrites {
        endpoint: endpoint.clone(),
        step,
        reply: format!("{reply:?}"),
    };

    let first = match store
        .put(record, Precondition::IfNoneMatch, mark, 1, b"probe 1")
        .await?
    {
        PutReply::Written { etag } => etag,
        other => return Err(refused("create with If-None-Match: *", other)),
    };
    let second = match store
        .put(record, Precondition::None, mark, 1, b"probe 2")
        .await?
    {
        PutReply::Written { etag } => etag,
        other => return Err(refused("unconditional overwrite", other)),
    };
    let (Some(first), Some(second)) = (first, second) else {
        return Err(NotHonoured::Store(FenceError::store(
            "s3",
            "probe",
            "a PUT answered without an ETag",
            false,
            &[],
        )));
    };
    if first == second {
        return Err(NotHonoured::EtagUnchanged { endpoint });
    }
    match store
        .put(record, Precondition::IfMatch(&first), mark, 1, b"probe 3")
        .await?
    {
        PutReply::PreconditionFailed => {}
        PutReply::Written { .. } => return Err(NotHonoured::IgnoresIfMatch { endpoint }),
        other => return Err(refused("If-Match with a stale ETag", other)),
    }
    match store
        .put(record, Precondition::IfNoneMatch, mark, 1, b"probe 4")
        .await?
    {
        PutReply::PreconditionFailed => {}
        PutReply::Written { .. } => return Err(NotHonoured::IgnoresIfNoneMatch { endpoint }),
        other => return Err(refused("If-None-Match: * over an existing object", other)),
    }
    match store
        .put(record, Precondition::IfMatch(&second), mark, 1, b"probe 5")
        .await?
    {
        PutReply::Written { .. } => {}
        other => return Err(refused("If-Match with the current ETag", other)),
    }
    match store.head(record).await? {
        Some(head) if head.mark == Some(mark) => Ok(()),
        _ => Err(NotHonoured::DropsMetadata {
            endpoint,
            header: MARK_HEADER,
        }),
    }
}
