//! Hostile callers against the arbiter's identity channel (docs/security.md):
//! an identity header is honoured only from the edge's SVID and only from the
//! initial request headers; the edge's own privilege (reading the grant table)
//! never extends to a call it forwards; in the production setting workloads
//! reach the arbiter only through the edge.

use latchkey_proto::adminv1::admin_client::AdminClient;
use latchkey_proto::adminv1::{GetEdgePolicyRequest, GetStatusRequest, GetStatusResponse};
use latchkey_proto::lockv1::{
    CloseSessionRequest, CloseSessionResponse, InspectRequest, InspectResponse,
};
use latchkey_tests::arbiter::{ArbiterOptions, channel, spiffe};
use latchkey_tests::raw_grpc;
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;

use crate::support::*;

const IDENTITY: &str = "x-latchkey-identity";
const GET_STATUS: &str = "/latchkey.admin.v1.Admin/GetStatus";
const CLOSE_SESSION: &str = "/latchkey.lock.v1.Lock/CloseSession";
const INSPECT: &str = "/latchkey.lock.v1.Lock/Inspect";

fn behind_edge() -> ArbiterOptions {
    ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..Default::default()
    }
}

/// The edge naming a caller, as the filter does on every forwarded call.
#[derive(Clone)]
struct Names(String);

impl Interceptor for Names {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let v: MetadataValue<_> = self
            .0
            .parse()
            .map_err(|_| tonic::Status::internal("bad header value"))?;
        req.metadata_mut().insert(IDENTITY, v);
        Ok(req)
    }
}

/// Finding 1 of the trust-boundary review: Envoy forwards request trailers,
/// tonic merged a unary request's trailers into its metadata, and the arbiter
/// read the caller from there. mallory, forwarded by the edge as herself,
/// put the operator's SPIFFE ID in a trailer and was answered as operator.
#[tokio::test(flavor = "multi_thread")]
async fn an_identity_in_request_trailers_names_nobody() -> anyhow::Result<()> {
    let s = stack_with(behind_edge()).await?;
    let edge = channel(s.arbiter.addr(), "latchkey/edge").await?;
    let mallory = spiffe("workload/mallory");
    let operator = spiffe("latchkey/operator");

    // As the edge forwards it: mallory in the initial headers, the operator in a trailer.
    let reply: raw_grpc::RawReply<GetStatusResponse> = raw_grpc::unary(
        edge.clone(),
        GET_STATUS,
        &GetStatusRequest::default(),
        &[(IDENTITY, &mallory)],
        &[(IDENTITY, &operator)],
    )
    .await?;
    assert!(
        reply.message.is_none(),
        "GetStatus answered for a trailer naming the operator"
    );
    assert_eq!(
        reply.status.code(),
        Code::InvalidArgument,
        "{}",
        reply.status
    );
    assert!(
        reply.status.message().contains("trailers"),
        "the refusal says where the header was: {}",
        reply.status
    );

    // Straight from mallory's own certificate: the same.
    let m = channel(s.arbiter.addr(), "workload/mallory").await?;
    let reply: raw_grpc::RawReply<GetStatusResponse> = raw_grpc::unary(
        m.clone(),
        GET_STATUS,
        &GetStatusRequest::default(),
        &[],
        &[(IDENTITY, &operator)],
    )
    .await?;
    assert!(reply.message.is_none(), "answered: {}", reply.status);
    assert_eq!(
        reply.status.code(),
        Code::InvalidArgument,
        "{}",
        reply.status
    );

    // alice's session cannot be closed by mallory naming alice in a trailer.
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let reply: raw_grpc::RawReply<CloseSessionResponse> = raw_grpc::unary(
        edge.clone(),
        CLOSE_SESSION,
        &CloseSessionRequest {
            session_id: session,
        },
        &[(IDENTITY, &mallory)],
        &[(IDENTITY, &spiffe("workload/alice"))],
    )
    .await?;
    assert!(
        reply.message.is_none(),
        "closed alice's session: {}",
        reply.status
    );
    // ... and her session still works.
    try_lock(&mut alice, "demo/trailer", "demo", session).await?;

    // The dev header is no channel either: not from trailers, not over TLS at all.
    let reply: raw_grpc::RawReply<InspectResponse> = raw_grpc::unary(
        m,
        INSPECT,
        &InspectRequest {
            key: "demo/trailer".into(),
        },
        &[],
        &[("x-latchkey-dev-identity", &spiffe("workload/alice"))],
    )
    .await?;
    assert_eq!(
        reply.status.code(),
        Code::InvalidArgument,
        "{}",
        reply.status
    );

    // Ordinary trailers are fine: the channel refuses only reserved names.
    let reply: raw_grpc::RawReply<InspectResponse> = raw_grpc::unary(
        edge,
        INSPECT,
        &InspectRequest {
            key: "demo/trailer".into(),
        },
        &[(IDENTITY, &spiffe("workload/alice"))],
        &[("x-request-note", "harmless")],
    )
    .await?;
    assert_eq!(reply.status.code(), Code::Ok, "{}", reply.status);
    Ok(())
}

/// Finding 2: GetEdgePolicy through the edge answered any workload with the
/// whole grant table, because the arbiter judged the edge's SVID rather than
/// the caller the edge named. A forwarded call is judged as its caller.
#[tokio::test(flavor = "multi_thread")]
async fn the_grant_table_is_not_served_to_a_caller_the_edge_forwards() -> anyhow::Result<()> {
    let s = stack_with(behind_edge()).await?;
    let edge = channel(s.arbiter.addr(), "latchkey/edge").await?;
    // the edge on its own behalf (the filter's refresh): served
    let mut own = AdminClient::new(edge.clone());
    assert_ne!(
        own.get_edge_policy(GetEdgePolicyRequest {})
            .await?
            .into_inner()
            .version,
        0
    );
    // a workload forwarded by the edge: refused, as that workload
    let mut for_mallory =
        AdminClient::with_interceptor(edge.clone(), Names(spiffe("workload/mallory")));
    expect_refusal(
        for_mallory.get_edge_policy(GetEdgePolicyRequest {}).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    let mut for_alice =
        AdminClient::with_interceptor(edge.clone(), Names(spiffe("workload/alice")));
    expect_refusal(
        for_alice.get_status(GetStatusRequest::default()).await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    // an operator forwarded by the edge is still an operator
    let mut for_operator = AdminClient::with_interceptor(edge, Names(spiffe("latchkey/operator")));
    for_operator
        .get_edge_policy(GetEdgePolicyRequest {})
        .await?;
    for_operator.get_status(GetStatusRequest::default()).await?;
    Ok(())
}

/// The edge's identity is not a caller: the edge naming itself, or naming
/// the caller twice, is refused.
#[tokio::test(flavor = "multi_thread")]
async fn the_edge_cannot_name_itself_or_two_callers() -> anyhow::Result<()> {
    let s = stack_with(behind_edge()).await?;
    let edge = channel(s.arbiter.addr(), "latchkey/edge").await?;
    let mut as_edge = AdminClient::with_interceptor(edge.clone(), Names(spiffe("latchkey/edge")));
    expect_refusal(
        as_edge.get_status(GetStatusRequest::default()).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    )?;
    let reply: raw_grpc::RawReply<GetStatusResponse> = raw_grpc::unary(
        edge,
        GET_STATUS,
        &GetStatusRequest::default(),
        &[
            (IDENTITY, &spiffe("workload/mallory")),
            (IDENTITY, &spiffe("latchkey/operator")),
        ],
        &[],
    )
    .await?;
    assert!(reply.message.is_none(), "answered: {}", reply.status);
    assert_eq!(
        reply.status.code(),
        Code::Unauthenticated,
        "{}",
        reply.status
    );
    Ok(())
}

/// The production setting: with an edge configured, the arbiter serves the
/// edge and operators only, so no workload walks around the edge's
/// admission bounds by calling the arbiter's port directly.
#[tokio::test(flavor = "multi_thread")]
async fn in_production_workloads_come_through_the_edge() -> anyhow::Result<()> {
    let s = stack_with(ArbiterOptions {
        allow_direct_workloads: false,
        ..behind_edge()
    })
    .await?;
    let mut alice = s.arbiter.lock("workload/alice").await?;
    let refused = alice
        .open_session(latchkey_proto::lockv1::OpenSessionRequest {
            class: "demo".into(),
            reuse_session_ids: vec![],
        })
        .await;
    let (code, reason) = match &refused {
        Ok(r) => anyhow::bail!("a direct workload was served: {r:?}"),
        Err(st) => {
            assert!(st.message().contains("through the edge"), "{st}");
            refusal(st)
        }
    };
    assert_eq!(
        (code, reason.as_str()),
        (Code::PermissionDenied, "NOT_AUTHORISED")
    );
    // operators may call directly
    s.arbiter
        .admin("latchkey/operator")
        .await?
        .get_status(GetStatusRequest::default())
        .await?;
    // and alice through the edge is served
    let edge = channel(s.arbiter.addr(), "latchkey/edge").await?;
    let mut via_edge = latchkey_proto::lockv1::lock_client::LockClient::with_interceptor(
        edge,
        Names(spiffe("workload/alice")),
    );
    via_edge
        .open_session(latchkey_proto::lockv1::OpenSessionRequest {
            class: "demo".into(),
            reuse_session_ids: vec![],
        })
        .await?;
    Ok(())
}
