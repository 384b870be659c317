//! Who the caller is: the peer SVID over mTLS, the edge's header only from
//! the edge's own certificate, nothing without a client certificate; and
//! tokens never reach the logs.

use std::time::Duration;

use latchkey_proto::lockv1::lock_client::LockClient;
use latchkey_proto::lockv1::{InspectRequest, ReleaseRequest};
use latchkey_tests::arbiter::{ArbiterOptions, ArbiterProcess, anonymous_channel, channel, spiffe};
use latchkey_tests::etcd::EtcdServer;
use tonic::Code;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;

use crate::support::*;

#[derive(Clone)]
struct Vouch(&'static str);

impl Interceptor for Vouch {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let v: MetadataValue<_> = self
            .0
            .parse()
            .map_err(|_| tonic::Status::internal("bad header value"))?;
        req.metadata_mut().insert("x-latchkey-identity", v);
        Ok(req)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_client_certificate_no_service() -> anyhow::Result<()> {
    let s = stack().await?;
    // The handshake itself fails (TLS 1.3 may report it on the first call).
    let outcome = match anonymous_channel(s.arbiter.addr()).await {
        Err(_) => None,
        Ok(ch) => Some(
            LockClient::new(ch)
                .inspect(InspectRequest {
                    key: "demo/x".into(),
                })
                .await,
        ),
    };
    match outcome {
        None => {}
        Some(Ok(r)) => anyhow::bail!("served without a client certificate: {r:?}"),
        // refused by the TLS layer, never answered by the service
        Some(Err(st)) => {
            assert!(
                matches!(
                    st.code(),
                    Code::Unavailable | Code::Cancelled | Code::Unknown
                ),
                "{st}"
            );
            assert_eq!(refusal(&st).1, "", "the service never saw the call: {st}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn only_the_edge_may_name_the_caller_and_a_forged_header_is_refused() -> anyhow::Result<()> {
    let s = stack_with(ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..Default::default()
    })
    .await?;
    // the edge vouches for alice: the arbiter acts for alice
    let edge = channel(s.arbiter.addr(), "latchkey/edge").await?;
    let mut as_alice =
        LockClient::with_interceptor(edge.clone(), Vouch("spiffe://dev.latchkey/workload/alice"));
    let session = as_alice
        .open_session(latchkey_proto::lockv1::OpenSessionRequest {
            class: "demo".into(),
            reuse_session_ids: vec![],
        })
        .await?
        .into_inner()
        .session_id;
    let g = as_alice
        .acquire(latchkey_proto::lockv1::AcquireRequest {
            key: "demo/edge".into(),
            class: "demo".into(),
            session_id: session,
            wait: 0,
            metadata: Default::default(),
            instance: String::new(),
            mode: 0,
            downgrade_from: None,
        })
        .await?
        .into_inner()
        .grant
        .ok_or_else(|| anyhow::anyhow!("no grant"))?;
    let who = as_alice
        .inspect(InspectRequest {
            key: "demo/edge".into(),
        })
        .await?
        .into_inner();
    assert_eq!(
        who.holder.map(|h| h.identity),
        Some(spiffe("workload/alice"))
    );
    as_alice
        .release(ReleaseRequest {
            key: g.key,
            session_id: session,
            token: g.token,
            slot: None,
            mode: 0,
        })
        .await?;
    // the edge without a header is refused
    let mut bare_edge = LockClient::new(edge);
    let r = bare_edge
        .inspect(InspectRequest {
            key: "demo/edge".into(),
        })
        .await;
    expect_refusal(r, Code::Unauthenticated, "UNAUTHENTICATED")?;
    // a workload forging the header is refused outright (not taken as alice,
    // and not quietly served as mallory either)
    let m = channel(s.arbiter.addr(), "workload/mallory").await?;
    let mut forged = LockClient::with_interceptor(m, Vouch("spiffe://dev.latchkey/workload/alice"));
    let r = forged
        .inspect(InspectRequest {
            key: "demo/edge".into(),
        })
        .await;
    expect_refusal(r, Code::Unauthenticated, "UNAUTHENTICATED")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_never_appear_in_the_logs() -> anyhow::Result<()> {
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let binary = std::path::PathBuf::from(env!("CARGO_BIN_EXE_arbiter-under-test"));
    let mut arbiter =
        ArbiterProcess::start(&binary, &etcd, ArbiterOptions::default(), "debug").await?;
    let mut alice = LockClient::new(channel(arbiter.addr(), "workload/alice").await?);
    let mut bob = LockClient::new(channel(arbiter.addr(), "workload/bob").await?);
    let sa = open(&mut alice, "demo").await?;
    let sb = open(&mut bob, "demo").await?;
    let mut tokens = Vec::new();
    for i in 0..3 {
        let key = format!("demo/log{i}");
        let g = try_lock(&mut alice, &key, "demo", sa).await?;
        tokens.push(g.token);
        let mut b = bob.clone();
        let k = key.clone();
        let waiter = tokio::spawn(async move {
            wait_lock(&mut b, &k, "demo", sb, Duration::from_secs(20)).await
        });
        // let the waiter queue, then exercise every path that touches a token
        latchkey_tests::eventually("bob queued", Duration::from_secs(10), || {
            let mut alice = alice.clone();
            let key = key.clone();
            async move {
                let r = alice.inspect(InspectRequest { key }).await?.into_inner();
                anyhow::ensure!(r.waiters == 1, "{} waiting", r.waiters);
                Ok(())
            }
        })
        .await?;
        let _ = alice
            .release(ReleaseRequest {
                key: key.clone(),
                session_id: sa,
                token: g.token + 7,
                slot: None,
                mode: 0,
            })
            .await;
        let _ = alice.inspect(InspectRequest { key: key.clone() }).await?;
        release(&mut alice, &g).await?;
        let next = waiter.await??;
        tokens.push(next.token);
        tokens.push(g.token + 7);
        release(&mut bob, &next).await?;
    }
    arbiter.terminate()?;
    let log = arbiter.log()?;
    assert!(log.contains("granted"), "the log has content: {log}");
    for t in tokens {
        for form in [t.to_string(), format!("{t:x}"), format!("{t:#x}")] {
            assert!(
                !log.contains(&form),
                "token {form} found in the arbiter log"
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_edge_policy_goes_to_the_edge_and_operators_only() -> anyhow::Result<()> {
    use latchkey_proto::adminv1::GetEdgePolicyRequest;
    use latchkey_proto::adminv1::admin_client::AdminClient;
    let s = stack_with(ArbiterOptions {
        edge_identity: Some(spiffe("latchkey/edge")),
        ..Default::default()
    })
    .await?;
    // the edge asks on its own behalf: no identity header needed
    let mut edge = AdminClient::new(channel(s.arbiter.addr(), "latchkey/edge").await?);
    let policy = edge
        .get_edge_policy(GetEdgePolicyRequest {})
        .await?
        .into_inner();
    assert_ne!(policy.version, 0);
    let alice = policy
        .grants
        .iter()
        .find(|g| g.identity == spiffe("workload/alice"))
        .ok_or_else(|| anyhow::anyhow!("alice's grants missing: {policy:?}"))?;
    assert!(alice.prefixes.iter().any(|p| p == "demo"));
    assert!(
        policy
            .classes
            .iter()
            .any(|c| c.name == "demo" && c.max_waiters_per_key > 0)
    );
    let mut op = s.arbiter.admin("latchkey/operator").await?;
    assert_eq!(
        op.get_edge_policy(GetEdgePolicyRequest {})
            .await?
            .into_inner()
            .version,
        policy.version
    );
    // a workload cannot read who may lock what: not on its own certificate ...
    let m = channel(s.arbiter.addr(), "workload/mallory").await?;
    expect_refusal(
        AdminClient::new(m.clone())
            .get_edge_policy(GetEdgePolicyRequest {})
            .await,
        Code::PermissionDenied,
        "NOT_AUTHORISED",
    )?;
    // ... and forging the header is refused outright
    let mut forged = AdminClient::with_interceptor(m, Vouch("spiffe://dev.latchkey/latchkey/edge"));
    expect_refusal(
        forged.get_edge_policy(GetEdgePolicyRequest {}).await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    )?;
    Ok(())
}

#[test]
fn without_tls_the_arbiter_refuses_to_start_unless_told_it_is_a_laptop() -> anyhow::Result<()> {
    let binary = env!("CARGO_BIN_EXE_arbiter-under-test");
    let out = std::process::Command::new(binary)
        .args(["--listen", "127.0.0.1:0", "--etcd", "http://127.0.0.1:1"])
        .output()?;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("TLS is required"), "{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn insecure_dev_mode_takes_the_caller_from_its_header() -> anyhow::Result<()> {
    use latchkey_proto::lockv1::OpenSessionRequest;
    latchkey_tests::init_tracing();
    let etcd = EtcdServer::start().await?;
    let state = tempfile::tempdir()?;
    let config = latchkey_arbiter::Config::new(
        vec![etcd.endpoint()],
        latchkey_tests::dev_policies()?.to_path_buf(),
        state.path().to_path_buf(),
    ); // tls: None = insecure dev mode
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(latchkey_arbiter::run(listener, config, async {
        let _ = stopped.await;
    }));
    let ch =
        latchkey_tests::eventually("plain h2 arbiter", Duration::from_secs(10), || async move {
            Ok(
                tonic::transport::Channel::from_shared(format!("http://{addr}"))?
                    .connect()
                    .await?,
            )
        })
        .await?;
    #[derive(Clone)]
    struct Dev;
    impl Interceptor for Dev {
        fn call(
            &mut self,
            mut req: tonic::Request<()>,
        ) -> Result<tonic::Request<()>, tonic::Status> {
            req.metadata_mut().insert(
                "x-latchkey-dev-identity",
                MetadataValue::from_static("spiffe://dev.latchkey/workload/alice"),
            );
            Ok(req)
        }
    }
    let mut named = LockClient::with_interceptor(ch.clone(), Dev);
    let open = latchkey_tests::eventually("dev-mode session", Duration::from_secs(10), || {
        let mut named = named.clone();
        async move {
            Ok(named
                .open_session(OpenSessionRequest {
                    class: "demo".into(),
                    reuse_session_ids: vec![],
                })
                .await?
                .into_inner())
        }
    })
    .await?;
    let g = named
        .acquire(latchkey_proto::lockv1::AcquireRequest {
            key: "demo/dev".into(),
            class: "demo".into(),
            session_id: open.session_id,
            wait: 0,
            metadata: Default::default(),
            instance: String::new(),
            mode: 0,
            downgrade_from: None,
        })
        .await?
        .into_inner();
    assert!(g.grant.is_some());
    let mut anonymous = LockClient::new(ch);
    expect_refusal(
        anonymous
            .inspect(InspectRequest {
                key: "demo/dev".into(),
            })
            .await,
        Code::Unauthenticated,
        "UNAUTHENTICATED",
    )?;
    let _ = stop.send(());
    server.await??;
    Ok(())
}

/// An mTLS channel to `addr` with `td`'s CA as the only root and `name`'s
/// SVID of `td` as the client certificate.
async fn channel_in(
    addr: std::net::SocketAddr,
    td: &latchctl::dev_certs::DevTrustDomain,
    name: &str,
) -> anyhow::Result<tonic::transport::Channel> {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let svid = td.svid(name);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(td.ca())?))
        .identity(Identity::from_pem(
            std::fs::read(&svid.cert)?,
            std::fs::read(&svid.key)?,
        ))
        .domain_name("localhost");
    Ok(Channel::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?)
}

/// Whether `name` of `td` gets an answer from the arbiter at `addr` over a
/// fresh connection (any answer but a transport failure).
async fn served(
    addr: std::net::SocketAddr,
    td: &latchctl::dev_certs::DevTrustDomain,
    name: &str,
) -> bool {
    let Ok(ch) = channel_in(addr, td, name).await else {
        return false;
    };
    LockClient::new(ch)
        .inspect(InspectRequest {
            key: "demo/rotated".into(),
        })
        .await
        .is_ok()
}

/// SPIRE rotates the arbiter's SVID and trust bundle on disk: new
/// connections are served with the files as they are now (old ones keep
/// theirs), and a half-written rotation is skipped, not served.
#[tokio::test(flavor = "multi_thread")]
async fn the_arbiter_reloads_its_certificate_and_client_ca_when_they_rotate() -> anyhow::Result<()>
{
    let dir = tempfile::tempdir()?;
    let names = latchkey_tests::arbiter::NAMES;
    // The harness waits for the arbiter with its own dev trust domain's
    // certificates: that is the one served first.
    let old = latchkey_tests::arbiter::certs()?;
    let new = latchctl::dev_certs::generate(&dir.path().join("new"), "dev.latchkey", names)?;
    let served_dir = dir.path().join("served");
    std::fs::create_dir_all(&served_dir)?;
    let files = latchkey_arbiter::TlsFiles {
        cert: served_dir.join("svid.pem"),
        key: served_dir.join("svid_key.pem"),
        client_ca: served_dir.join("bundle.pem"),
    };
    let install = |td: &latchctl::dev_certs::DevTrustDomain| -> anyhow::Result<()> {
        let svid = td.svid("latchkey/arbiter");
        // Written aside and renamed in, as spiffe-helper does.
        for (from, to) in [
            (svid.cert, &files.cert),
            (svid.key, &files.key),
            (td.ca(), &files.client_ca),
        ] {
            let tmp = to.with_extension("tmp");
            std::fs::copy(from, &tmp)?;
            std::fs::rename(&tmp, to)?;
        }
        Ok(())
    };
    install(old)?;
    let etcd = EtcdServer::start().await?;
    let arbiter = latchkey_tests::arbiter::Arbiter::start(
        &etcd,
        ArbiterOptions {
            tls: Some(files.clone()),
            ..ArbiterOptions::default()
        },
    )
    .await?;
    let addr = arbiter.addr();
    anyhow::ensure!(served(addr, old, "workload/alice").await);
    anyhow::ensure!(!served(addr, &new, "workload/alice").await);
    // A connection opened before the rotation keeps working after it.
    let before = LockClient::new(channel_in(addr, old, "workload/alice").await?);

    install(&new)?;
    let rotated = tokio::time::Instant::now();
    while !served(addr, &new, "workload/alice").await {
        anyhow::ensure!(
            rotated.elapsed() < latchkey_arbiter::tls_reload::RECHECK * 4,
            "the rotated certificate and bundle were not picked up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::ensure!(
        !served(addr, old, "workload/alice").await,
        "a client of the old trust bundle is still served after the rotation"
    );
    let mut before = before;
    before
        .inspect(InspectRequest {
            key: "demo/rotated".into(),
        })
        .await?;

    // A rotation caught half-written: the key does not match the
    // certificate. The arbiter keeps serving the last good files.
    std::fs::copy(old.svid("latchkey/arbiter").cert, &files.cert)?;
    tokio::time::sleep(latchkey_arbiter::tls_reload::RECHECK + Duration::from_secs(1)).await;
    anyhow::ensure!(served(addr, &new, "workload/alice").await);
    anyhow::ensure!(served(addr, &new, "workload/alice").await);
    arbiter.stop().await
}
