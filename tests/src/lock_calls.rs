//! lock.v1 calls with short names, for scenarios that speak the protocol
//! directly (no client library between the test and the arbiter): the e2e
//! scenarios and the release gate's tests.

use std::time::Duration;

use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{AcquireRequest, Grant, OpenSessionRequest, ReleaseRequest, WaitMode};
use tonic::Status;
use tonic::transport::Channel;

pub type Client = LockClient<Channel>;

/// Opens a session for `class`; the refusal as a `Status` for tests that check it.
pub async fn open_class(c: &mut Client, class: &str) -> Result<i64, Status> {
    Ok(c.open_session(OpenSessionRequest {
        class: class.into(),
        reuse_session_ids: vec![],
    })
    .await?
    .into_inner()
    .session_id)
}

pub async fn open(c: &mut Client, class: &str) -> anyhow::Result<i64> {
    Ok(open_class(c, class).await?)
}

/// The client instance the raw calls below name (`AcquireRequest.instance`):
/// one for the whole test process, as the client libraries name one per
/// process, so the same identity under another session is a LEAK here as it
/// is for one process that forgot a hold. Replica tests name their own.
pub const TEST_INSTANCE: &str = "e2e-test-process";

pub async fn try_lock(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
) -> Result<Grant, Status> {
    acquire_as(c, key, class, session, TEST_INSTANCE, None).await
}

pub async fn wait_lock(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
    timeout: Duration,
) -> Result<Grant, Status> {
    acquire_as(c, key, class, session, TEST_INSTANCE, Some(timeout)).await
}

/// An Acquire naming client instance `instance`; `wait`: how long a held key
/// is waited for (none: a try-lock).
pub async fn acquire_as(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
    instance: &str,
    wait: Option<Duration>,
) -> Result<Grant, Status> {
    acquire_in_mode(c, key, class, session, instance, wait, 0).await
}

/// [`acquire_as`] in `mode` (`Mode::Shared as i32` for a shared hold).
pub async fn acquire_in_mode(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
    instance: &str,
    wait: Option<Duration>,
    mode: i32,
) -> Result<Grant, Status> {
    let mut req = tonic::Request::new(AcquireRequest {
        key: key.into(),
        class: class.into(),
        session_id: session,
        wait: match wait {
            Some(_) => WaitMode::WaitUntilDeadline.into(),
            None => WaitMode::WaitNone.into(),
        },
        metadata: Default::default(),
        instance: instance.into(),
        mode,
        downgrade_from: None,
    });
    if let Some(timeout) = wait {
        req.set_timeout(timeout);
    }
    let resp = c.acquire(req).await?;
    resp.into_inner()
        .grant
        .ok_or_else(|| Status::internal("no grant in an OK response"))
}

/// A downgrade as the clients send it: a shared Acquire of `key` that names
/// the session's exclusive hold by its token (`downgrade_from`), in `mode`
/// (MODE_SHARED unless a test checks the refusal of another).
pub async fn downgrade_from(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
    token: u64,
    mode: i32,
) -> Result<Grant, Status> {
    let resp = c
        .acquire(AcquireRequest {
            key: key.into(),
            class: class.into(),
            session_id: session,
            wait: WaitMode::WaitNone.into(),
            metadata: Default::default(),
            instance: String::new(),
            mode,
            downgrade_from: Some(token),
        })
        .await?;
    resp.into_inner()
        .grant
        .ok_or_else(|| Status::internal("no grant in an OK response"))
}

pub async fn release(c: &mut Client, g: &Grant) -> Result<(), Status> {
    c.release(ReleaseRequest {
        key: g.key.clone(),
        session_id: g.session_id,
        token: g.token,
        slot: g.slot,
        mode: g.mode,
    })
    .await?;
    Ok(())
}
