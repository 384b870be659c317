//! The S3 fence (`latchkey-fence-s3`) against a real S3-compatible server
//! (moto, tests/src/s3.rs), and its certification probe against that server
//! and against a store that ignores conditional headers (a tiny in-test HTTP
//! server: the one fake here, because it is the thing being refused).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use latchkey_fence::{FenceError, FencedStore, Guarded, Mark, guarded_write_retrying};
use latchkey_fence_s3::{
    Credentials, NotHonoured, Precondition, PutReply, S3Config, S3Store, config_from_url,
    probe_conditional_writes,
};
use latchkey_tests::s3::S3Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Tokens as the arbiter mints them (`latchkey_records::token::pack`):
/// every pair here is one it mints (0, no token, for one it refuses).
fn token(epoch: u32, revision: u64) -> u64 {
    i64::try_from(revision)
        .ok()
        .and_then(|revision| latchkey_records::token::pack(epoch, revision))
        .unwrap_or_default()
}

/// `text` holds neither `secret`'s decimal digits nor its 16-digit hex.
fn leaks(text: &str, secret: u64) -> bool {
    text.contains(&secret.to_string()) || text.contains(&Mark::new(secret).to_hex())
}

#[tokio::test(flavor = "multi_thread")]
async fn guarded_writes_create_overwrite_and_fence_out() -> anyhow::Result<()> {
    let server = S3Server::start().await?;
    let store = server.store("fences", "basic/").await?;
    let (t1, t2) = (token(1, 40), token(1, 41));

    assert_eq!(
        store.guarded_write("orders", t1, b"a").await?,
        Guarded::Applied { version: 1 }
    );
    let r = store.read("orders").await?.context("record missing")?;
    ensure!(
        r.mark == Mark::new(t1) && r.payload == b"a",
        "after create: {r:?}"
    );

    assert_eq!(
        store.guarded_write("orders", t2, b"bb").await?,
        Guarded::Applied { version: 2 }
    );
    let r = store.read("orders").await?.context("record missing")?;
    ensure!(
        r.mark == Mark::new(t2) && r.payload == b"bb",
        "after overwrite: {r:?}"
    );

    // The same token again (a replay) and an older one are both refused.
    for stale in [t2, t1, 0] {
        match store.guarded_write("orders", stale, b"stale").await? {
            Guarded::FencedOut { mark } => ensure!(mark == Mark::new(t2), "wrong mark reported"),
            other => anyhow::bail!("a stale token was {other}"),
        }
    }
    let r = store.read("orders").await?.context("record missing")?;
    ensure!(
        r.mark == Mark::new(t2) && r.payload == b"bb",
        "record changed: {r:?}"
    );
    ensure!(store.read("never-written").await?.is_none());

    // The naive writer keeps the mark and overwrites the payload.
    store.plain_write("orders", b"naive").await?;
    let r = store.read("orders").await?.context("record missing")?;
    ensure!(
        r.mark == Mark::new(t2) && r.payload == b"naive",
        "after plain write: {r:?}"
    );
    Ok(())
}

/// S3's ETag is the MD5 of the bytes, not of the metadata: were the body the
/// bare payload, a later holder writing the same bytes would keep the ETag,
/// and an earlier holder's If-Match on it would still land (ABA). The fence
/// line in the body makes every guarded write change the ETag.
#[tokio::test(flavor = "multi_thread")]
async fn rewriting_the_same_payload_still_changes_the_etag() -> anyhow::Result<()> {
    let server = S3Server::start().await?;
    let store = server.store("fences", "aba/").await?;
    let (early, late) = (token(2, 10), token(2, 11));

    store.guarded_write("state", token(2, 9), b"same").await?;
    // The earlier holder reads the ETag it will make its PUT conditional on…
    let seen = store.head("state").await?.context("missing")?;
    // …the later holder writes the very same payload…
    assert!(
        store
            .guarded_write("state", late, b"same")
            .await?
            .is_applied()
    );
    let now = store.head("state").await?.context("missing")?;
    ensure!(
        now.etag != seen.etag,
        "the ETag did not change on a same-payload write"
    );
    // …and the earlier holder's conditional PUT is refused.
    let reply = store
        .put(
            "state",
            Precondition::IfMatch(&seen.etag),
            Mark::new(early),
            1,
            b"other",
        )
        .await?;
    ensure!(
        reply == PutReply::PreconditionFailed,
        "stale If-Match answered {reply:?}"
    );
    let r = store.read("state").await?.context("missing")?;
    ensure!(
        r.mark == Mark::new(late) && r.payload == b"same",
        "record changed: {r:?}"
    );

    // The server itself: the same bytes under other metadata keep the ETag.
    store.put_unfenced("bare", b"x").await?;
    let a = store.head("bare").await?.context("missing")?;
    store.put_unfenced("bare", b"x").await?;
    let b = store.head("bare").await?.context("missing")?;
    ensure!(
        a.etag == b.etag,
        "this server's ETags are not content hashes"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn objects_without_a_mark_are_never_overwritten() -> anyhow::Result<()> {
    let server = S3Server::start().await?;
    let store = server.store("fences", "unmarked/").await?;
    store
        .put_unfenced("legacy", b"written by another client")
        .await?;
    let before = store.head("legacy").await?.context("missing")?;

    let err = store
        .guarded_write("legacy", token(3, 1), b"mine")
        .await
        .err()
        .context("a guarded write overwrote an unmarked object")?;
    ensure!(matches!(err, FenceError::Unfenced { .. }), "{err}");
    ensure!(err.to_string().contains("legacy"), "{err}");
    let err = store
        .read("legacy")
        .await
        .err()
        .context("read an unmarked object")?;
    ensure!(matches!(err, FenceError::Unfenced { .. }), "{err}");
    let after = store.head("legacy").await?.context("missing")?;
    ensure!(before == after, "the unmarked object changed");
    Ok(())
}

/// Writers with distinct tokens race on one record, each writing several
/// times. Every applied write that finished before another began must carry
/// a smaller token than it (the mark never goes back), and the record ends
/// with the greatest applied token and that writer's payload.
#[tokio::test(flavor = "multi_thread")]
async fn racing_writers_leave_the_greatest_token() -> anyhow::Result<()> {
    const WRITERS: u64 = 8;
    const ROUNDS: u64 = 5;
    let server = S3Server::start().await?;
    let store = Arc::new(server.store("fences", "race/").await?);
    let clock = Arc::new(AtomicU64::new(0));
    let mut tokens: Vec<u64> = (1..=WRITERS * ROUNDS).map(|r| token(4, r)).collect();
    fastrand::shuffle(&mut tokens);
    let barrier = Arc::new(tokio::sync::Barrier::new(WRITERS as usize));
    let mut tasks = Vec::new();
    for chunk in tokens.chunks(ROUNDS as usize) {
        let (store, clock, barrier) = (store.clone(), clock.clone(), barrier.clone());
        let chunk = chunk.to_vec();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut seen = Vec::new();
            for t in chunk {
                let start = clock.fetch_add(1, Ordering::SeqCst);
                let payload = format!("from writer of {t}");
                let g = guarded_write_retrying(store.as_ref(), "hot", t, payload.as_bytes(), 64)
                    .await?;
                let end = clock.fetch_add(1, Ordering::SeqCst);
                seen.push((start, end, t, g));
            }
            anyhow::Ok(seen)
        }));
    }
    let mut applied = Vec::new();
    let mut fenced = 0;
    for task in tasks {
        for (start, end, t, g) in task.await?? {
            match g {
                Guarded::Applied { .. } => applied.push((start, end, t)),
                Guarded::FencedOut { mark } => {
                    fenced += 1;
                    // Not `{mark}`: marks never print; compare instead.
                    ensure!(mark >= Mark::new(t), "fenced out by a lower mark");
                }
                Guarded::Retry => anyhow::bail!("a write was still undecided after 64 rounds"),
            }
        }
    }
    for a in &applied {
        for b in &applied {
            ensure!(
                !(a.1 < b.0 && b.2 <= a.2),
                "an applied write finished before another applied write with a lower token began"
            );
        }
    }
    let max = applied
        .iter()
        .map(|a| a.2)
        .max()
        .context("nothing applied")?;
    ensure!(
        max == *tokens.iter().max().context("no tokens")?,
        "the greatest token was not applied"
    );
    let r = store.read("hot").await?.context("missing")?;
    ensure!(
        r.mark == Mark::new(max),
        "the final mark is not the greatest applied token"
    );
    ensure!(
        r.payload == format!("from writer of {max}").as_bytes(),
        "wrong final payload"
    );
    // Seen with --nocapture: how often the loop re-read after a lost race.
    println!(
        "{} applied, {fenced} fenced out, {} PUTs refused with 412",
        applied.len(),
        server.answers_with(412)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_probe_certifies_the_real_server_and_urls_reach_it() -> anyhow::Result<()> {
    let server = S3Server::start().await?;
    let store = server.store("fences", "probe/").await?;
    probe_conditional_writes(&store)
        .await
        .map_err(|e| anyhow::anyhow!("the probe refused moto: {e}"))?;

    // The same store, configured from a URL (credentials from "the environment").
    let from_url = S3Store::new(config_from_url(&server.url("fences", "probe"), |name| {
        server.env(name)
    })?)?;
    assert_eq!(from_url.kind(), "s3");
    assert!(
        from_url
            .guarded_write("via-url", 7, b"u")
            .await?
            .is_applied()
    );
    let r = store
        .read("via-url")
        .await?
        .context("the URL's prefix is not probe/")?;
    ensure!(r.payload == b"u");
    probe_conditional_writes(&from_url)
        .await
        .map_err(|e| anyhow::anyhow!("the probe refused moto through a URL: {e}"))?;

    // Another region: the bucket is created with its LocationConstraint and
    // requests are signed for that region.
    let url = format!(
        "s3://fences-eu/x?endpoint={}&region=eu-west-1",
        server.endpoint()
    );
    let eu = S3Store::new(config_from_url(&url, |name| server.env(name))?)?;
    eu.create_bucket().await?;
    assert!(eu.guarded_write("r", 9, b"eu").await?.is_applied());
    ensure!(eu.read("r").await?.context("missing")?.payload == b"eu");
    Ok(())
}

/// How the fake store answers.
#[derive(Clone, Copy, PartialEq)]
enum Fake {
    /// 200 and a fresh ETag to everything: conditional headers ignored.
    AcceptsEverything,
    /// 412 to every If-Match, 200 to the rest: If-None-Match ignored.
    IgnoresIfNoneMatch,
    /// 404 to HEAD; 500 to the rest, its message echoing the mark header it
    /// was sent (hex and decimal).
    EchoesTheMark,
    /// 404 to HEAD; `409 ConditionalRequestConflict` to the first two PUTs
    /// (AWS's answer to conditional writes racing), 200 after.
    ConflictsTwice,
    /// 404 to HEAD; 409 to every PUT.
    AlwaysConflicts,
}

/// A one-request-per-connection HTTP/1.1 server on a free loopback port.
async fn fake_store(mode: Fake) -> anyhow::Result<(S3Store, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let etags = Arc::new(AtomicU64::new(1));
    let puts = Arc::new(AtomicU64::new(0));
    let task = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let etags = etags.clone();
            let puts = puts.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // The head, then as much body as Content-Length says.
                let head_end = loop {
                    let Ok(n) = conn.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                let header = |name: &str| {
                    head.lines()
                        .find_map(|l| l.strip_prefix(&format!("{name}: ")).map(str::to_string))
                };
                let length: usize = header("content-length")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + length {
                    let Ok(n) = conn.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        break;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let etag = format!("\"{:032x}\"", etags.fetch_add(1, Ordering::SeqCst));
                let (status, body) = match mode {
                    // Missing, so that a guarded write goes on to its PUT.
                    Fake::EchoesTheMark if head.starts_with("head ") => {
                        ("404 Not Found", String::new())
                    }
                    Fake::IgnoresIfNoneMatch if header("if-match").is_some() => {
                        ("412 Precondition Failed", String::new())
                    }
                    Fake::ConflictsTwice | Fake::AlwaysConflicts if head.starts_with("head ") => {
                        ("404 Not Found", String::new())
                    }
                    Fake::ConflictsTwice | Fake::AlwaysConflicts
                        if mode == Fake::AlwaysConflicts
                            || puts.fetch_add(1, Ordering::SeqCst) < 2 =>
                    {
                        (
                            "409 Conflict",
                            "<Error><Code>ConditionalRequestConflict</Code></Error>".to_owned(),
                        )
                    }
                    Fake::EchoesTheMark => {
                        let hex = header("x-amz-meta-latchkey-fence").unwrap_or_default();
                        let dec = u64::from_str_radix(&hex, 16).unwrap_or_default();
                        (
                            "500 Internal Server Error",
                            format!(
                                "<Error><Code>InternalError</Code><Message>bad mark {hex} ({dec})</Message></Error>"
                            ),
                        )
                    }
                    _ => ("200 OK", String::new()),
                };
                let reply = format!(
                    "HTTP/1.1 {status}\r\nETag: {etag}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    let store = S3Store::new(S3Config {
        endpoint: format!("http://127.0.0.1:{port}"),
        bucket: "fences".into(),
        prefix: String::new(),
        region: "us-east-1".into(),
        credentials: Credentials::new("AKIDFAKE", "fake-secret"),
        path_style: true,
        attempts: 4,
        timeout: Duration::from_secs(10),
    })?;
    Ok((store, task))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_probe_refuses_stores_that_ignore_conditional_headers() -> anyhow::Result<()> {
    let (store, task) = fake_store(Fake::AcceptsEverything).await?;
    let err = probe_conditional_writes(&store)
        .await
        .err()
        .context("certified a store that ignores If-Match")?;
    ensure!(matches!(err, NotHonoured::IgnoresIfMatch { .. }), "{err}");
    let text = err.to_string();
    ensure!(
        text.contains("never be declared fenced") && text.contains("docs/fencing-s3.md"),
        "not actionable: {text}"
    );
    task.abort();

    let (store, task) = fake_store(Fake::IgnoresIfNoneMatch).await?;
    let err = probe_conditional_writes(&store)
        .await
        .err()
        .context("certified a store that ignores If-None-Match")?;
    ensure!(
        matches!(err, NotHonoured::IgnoresIfNoneMatch { .. }),
        "{err}"
    );
    task.abort();
    Ok(())
}

/// AWS answers 409 when conditional writes race: nothing was written, so
/// the loop waits a little and decides again; a store that keeps answering
/// 409 gets `Retry`, never `Applied` (moto never answers 409: a fake).
#[tokio::test(flavor = "multi_thread")]
async fn conflicts_are_decided_again_and_never_read_as_written() -> anyhow::Result<()> {
    let (store, task) = fake_store(Fake::ConflictsTwice).await?;
    let answer = store.guarded_write("r", token(1, 5), b"p").await?;
    ensure!(
        answer == Guarded::Applied { version: 1 },
        "after two 409s: {answer:?}"
    );
    task.abort();

    let (store, task) = fake_store(Fake::AlwaysConflicts).await?;
    let answer = store.guarded_write("r", token(1, 6), b"p").await?;
    ensure!(answer == Guarded::Retry, "409 every time: {answer:?}");
    task.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_never_show_the_token() -> anyhow::Result<()> {
    let secret = token(7, 123_456);

    // A store whose error text echoes the mark it was sent.
    let (store, task) = fake_store(Fake::EchoesTheMark).await?;
    let probe_store = store
        .put("r", Precondition::None, Mark::new(secret), 1, b"p")
        .await;
    let err = probe_store
        .err()
        .context("the echoing store accepted a PUT")?;
    let guarded = store
        .guarded_write("r", secret, b"p")
        .await
        .err()
        .context("the echoing store accepted a guarded write")?;
    task.abort();
    for e in [&err, &guarded] {
        let text = format!("{e} / {e:?}");
        ensure!(
            text.contains("bad mark"),
            "the store's message was dropped: {text}"
        );
        ensure!(!leaks(&text, secret), "a token leaked into an error");
    }
    ensure!(err.is_transient(), "a 500 should be worth retrying");

    // The real server: a bucket that does not exist, an unmarked object.
    let server = S3Server::start().await?;
    let missing = S3Store::new(server.config("no-such-bucket", ""))?;
    let e = missing
        .guarded_write("r", secret, b"p")
        .await
        .err()
        .context("wrote to a missing bucket")?;
    let text = format!("{e} / {e:?}");
    ensure!(text.contains("NoSuchBucket"), "{text}");
    ensure!(!leaks(&text, secret), "a token leaked into an error");

    // moto verifies signatures: a wrong secret is refused, not retried.
    let mut config = server.config("fences", "errors/");
    config.credentials = Credentials::new(server.credentials().access_key(), "not-the-secret");
    let e = S3Store::new(config)?
        .guarded_write("r", secret, b"p")
        .await
        .err()
        .context("a request signed with the wrong secret was accepted")?;
    let text = format!("{e} / {e:?}");
    ensure!(text.contains("403"), "{text}");
    ensure!(
        !e.is_transient(),
        "a refused signature should not be retried"
    );
    ensure!(
        !leaks(&text, secret) && !text.contains("not-the-secret"),
        "{text}"
    );

    let store = server.store("fences", "errors/").await?;
    store.guarded_write("r", secret, b"p").await?;
    let fenced = store.guarded_write("r", secret - 1, b"q").await?;
    for text in [
        format!("{fenced}"),
        format!("{fenced:?}"),
        format!("{:?}", store.head("r").await?),
    ] {
        ensure!(!leaks(&text, secret), "a mark leaked into output");
    }
    Ok(())
}

/// Record names: letters, digits, `-_.~/` and spaces are written; other
/// characters (which S3-compatible servers canonicalise differently when
/// they check a signature: moto refused `:`, `=` and `&` with 403) are
/// refused before any request, with a message naming the character.
#[tokio::test(flavor = "multi_thread")]
async fn record_names_are_written_or_refused_before_any_request() -> anyhow::Result<()> {
    let server = S3Server::start().await?;
    let store = server.store("names", "p").await?;
    for record in ["plain/name-1", "a b/c", "v1.2_x~y"] {
        let applied = store.guarded_write(record, token(2, 5), b"v").await?;
        ensure!(applied.is_applied(), "{record}: {applied:?}");
        let back = store.read(record).await?.context("read back")?;
        ensure!(back.payload == b"v", "{record}");
    }
    for record in ["latchkey-pause-test:pausetest/s3-1", "x=y&z"] {
        let err = store
            .guarded_write(record, token(2, 6), b"w")
            .await
            .err()
            .context("a refusal")?;
        let text = err.to_string();
        ensure!(text.contains("record names are limited"), "{text}");
        ensure!(!err.is_transient(), "{text}");
    }
    Ok(())
}
