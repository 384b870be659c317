//! The arbiter's etcd credentials against a real etcd serving clients over TLS
//! with `--client-cert-auth`: the arbiter's client certificate is what lets it
//! in, a missing certificate or a wrong trust bundle keeps it out (the start
//! fails, naming etcd and TLS), and etcd's user/password auth works on top.

use latchkey_arbiter::{EtcdClientCert, EtcdCredentials, EtcdUser};
use latchkey_tests::arbiter::{Arbiter, ArbiterOptions, ArbiterProcess};
use latchkey_tests::etcd::{EtcdOptions, EtcdServer, EtcdTls};

use crate::support::*;

const PASSWORD: &str = "s3cret-etcd-password-never-logged";
const WRONG_PASSWORD: &str = "wrong-etcd-password-never-logged";

async fn mutual_tls_etcd() -> anyhow::Result<EtcdServer> {
    latchkey_tests::init_tracing();
    EtcdServer::start_with(EtcdOptions {
        tls: Some(EtcdTls::mutual()?),
    })
    .await
}

/// The credentials of an arbiter that etcd lets in.
fn arbiter_credentials(etcd: &EtcdServer) -> anyhow::Result<EtcdCredentials> {
    let tls = etcd
        .tls()
        .ok_or_else(|| anyhow::anyhow!("etcd without TLS"))?;
    let cert = tls.arbiter_cert()?;
    Ok(EtcdCredentials {
        ca: Some(tls.ca.clone()),
        client_cert: Some(EtcdClientCert {
            cert: cert.cert,
            key: cert.key,
        }),
        user: None,
    })
}

fn options(etcd_credentials: EtcdCredentials) -> ArbiterOptions {
    ArbiterOptions {
        etcd_credentials,
        ..ArbiterOptions::default()
    }
}

/// Opens a session, takes a key, checks the holder record is in etcd, releases it.
async fn grant_and_release(etcd: &EtcdServer, arbiter: &Arbiter) -> anyhow::Result<()> {
    let mut alice = arbiter.lock("workload/alice").await?;
    let session = open(&mut alice, "demo").await?;
    let g = try_lock(&mut alice, "demo/tls", "demo", session).await?;
    assert!(g.token > 0);
    let mut client = etcd.client().await?;
    let held = client.get(layout().holder("demo/tls"), None).await?;
    assert_eq!(held.kvs().len(), 1, "the grant is in etcd");
    release(&mut alice, &g).await?;
    let held = client.get(layout().holder("demo/tls"), None).await?;
    assert!(held.kvs().is_empty(), "the release is in etcd");
    let again = try_lock(&mut alice, "demo/tls", "demo", session).await?;
    assert!(again.token > g.token, "tokens grow");
    release(&mut alice, &again).await?;
    Ok(())
}

/// The error an arbiter start ended with.
async fn start_error(etcd: &EtcdServer, credentials: EtcdCredentials) -> anyhow::Result<String> {
    match Arbiter::start(etcd, options(credentials)).await {
        Ok(_) => anyhow::bail!("the arbiter started"),
        Err(e) => Ok(format!("{e:#}")),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_arbiter_with_its_client_certificate_grants_and_releases() -> anyhow::Result<()> {
    let etcd = mutual_tls_etcd().await?;
    assert!(etcd.endpoint().starts_with("https://"));
    let arbiter = Arbiter::start(&etcd, options(arbiter_credentials(&etcd)?)).await?;
    grant_and_release(&etcd, &arbiter).await?;
    arbiter.stop().await
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_client_certificate_the_arbiter_cannot_reach_etcd() -> anyhow::Result<()> {
    let etcd = mutual_tls_etcd().await?;
    let credentials = EtcdCredentials {
        client_cert: None,
        ..arbiter_credentials(&etcd)?
    };
    let msg = start_error(&etcd, credentials).await?;
    eprintln!("no client certificate: {msg}");
    assert!(msg.contains("cannot reach etcd at https://"), "{msg}");
    assert!(
        msg.contains("TLS") && msg.contains("no client certificate"),
        "{msg}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trust_bundle_that_did_not_sign_etcds_certificate_is_refused() -> anyhow::Result<()> {
    let etcd = mutual_tls_etcd().await?;
    // The callers' dev CA: a real CA, but not etcd's.
    let wrong_ca = latchkey_tests::arbiter::certs()?.ca();
    let credentials = EtcdCredentials {
        ca: Some(wrong_ca.clone()),
        ..arbiter_credentials(&etcd)?
    };
    let msg = start_error(&etcd, credentials).await?;
    eprintln!("wrong CA: {msg}");
    assert!(msg.contains("cannot reach etcd at https://"), "{msg}");
    assert!(msg.contains(&wrong_ca.display().to_string()), "{msg}");
    assert!(msg.contains("UnknownIssuer"), "{msg}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn plain_http_to_a_tls_etcd_is_refused_before_connecting() -> anyhow::Result<()> {
    let etcd = mutual_tls_etcd().await?;
    let opts = options(arbiter_credentials(&etcd)?);
    let http = etcd.endpoint().replace("https://", "http://");
    let dir = tempfile::tempdir()?;
    let mut config = latchkey_arbiter::Config::new(
        vec![http],
        opts.policies_dir.clone(),
        dir.path().to_path_buf(),
    );
    config.etcd_credentials = opts.etcd_credentials;
    let msg = match latchkey_arbiter::build(&config).await {
        Ok(_) => anyhow::bail!("the arbiter started"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains("need https:// etcd endpoints"), "{msg}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_and_password_over_mutual_tls() -> anyhow::Result<()> {
    let mut etcd = mutual_tls_etcd().await?;
    etcd.enable_auth("root-password").await?;
    etcd.add_user("latchkey-arbiter", PASSWORD, "/latchkey")
        .await?;
    let dir = tempfile::tempdir()?;
    let password_file = dir.path().join("etcd-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n"))?;
    let wrong_file = dir.path().join("wrong-password");
    std::fs::write(&wrong_file, WRONG_PASSWORD)?;
    let with_user = |password_file: &std::path::Path| -> anyhow::Result<EtcdCredentials> {
        Ok(EtcdCredentials {
            user: Some(EtcdUser {
                name: "latchkey-arbiter".into(),
                password_file: password_file.to_path_buf(),
            }),
            ..arbiter_credentials(&etcd)?
        })
    };

    // In-process: grants and releases as the user.
    let arbiter = Arbiter::start(&etcd, options(with_user(&password_file)?)).await?;
    grant_and_release(&etcd, &arbiter).await?;
    arbiter.stop().await?;

    // A wrong password: etcd refuses, the message says so and quotes no password.
    let msg = start_error(&etcd, with_user(&wrong_file)?).await?;
    eprintln!("wrong password: {msg}");
    assert!(msg.contains("authentication failed"), "{msg}");
    assert!(msg.contains("user \"latchkey-arbiter\""), "{msg}");
    assert!(
        !msg.contains(WRONG_PASSWORD) && !msg.contains(PASSWORD),
        "{msg}"
    );

    // The binary, through its flags; its debug log never shows the password.
    let binary = std::path::PathBuf::from(env!("CARGO_BIN_EXE_arbiter-under-test"));
    let process =
        ArbiterProcess::start(&binary, &etcd, options(with_user(&password_file)?), "debug").await?;
    let mut alice = latchkey_proto::lockv1::lock_client::LockClient::new(
        latchkey_tests::arbiter::channel(process.addr(), "workload/alice").await?,
    );
    let session = open(&mut alice, "demo").await?;
    let g = try_lock(&mut alice, "demo/process", "demo", session).await?;
    release(&mut alice, &g).await?;
    let log = process.log()?;
    assert!(log.contains("connected to etcd"), "{log}");
    assert!(!log.contains(PASSWORD), "the password is in the log");
    Ok(())
}
