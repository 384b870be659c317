//! The fence adapter contract (`latchkey_fence::FencedStore`) checked the
//! same way against every store: the e2e tests run these against a real
//! PostgreSQL, MariaDB, Redis and etcd. Marks are compared in-process;
//! failure messages never print one (a mark is a token).

use std::sync::Arc;

use anyhow::ensure;
use latchkey_fence::{FenceError, FencedStore, Guarded, Mark, Record};

/// Tokens in epoch 1 and up: at least 2^48, so a leaked one is fifteen
/// digits and never an accidental match.
pub const EPOCH: u64 = 1 << 48;

fn is_fenced_out_at(g: Guarded, mark: u64) -> bool {
    matches!(g, Guarded::FencedOut { mark: m } if m == Mark::new(mark))
}

async fn read(store: &dyn FencedStore, record: &str) -> anyhow::Result<Option<Record>> {
    Ok(store.read(record).await?)
}

/// Create, overwrite with a greater token, refuse the same and a lower one,
/// one mark per record, and `plain_write` keeping (or starting at 0) the
/// mark. Records are named `<prefix>/…`.
pub async fn check_contract(store: &dyn FencedStore, prefix: &str) -> anyhow::Result<()> {
    let r1 = format!("{prefix}/r1");
    let r2 = format!("{prefix}/r2");
    let r3 = format!("{prefix}/r3");
    let base = EPOCH;
    ensure!(
        read(store, &r1).await?.is_none(),
        "a missing record reads as None"
    );

    let g = store.guarded_write(&r1, base + 10, b"ten").await?;
    let Guarded::Applied { version: v1 } = g else {
        anyhow::bail!("a new record is created: {g}");
    };
    let rec = read(store, &r1).await?;
    ensure!(
        rec.as_ref().map(|r| (r.mark, r.payload.as_slice()))
            == Some((Mark::new(base + 10), b"ten".as_slice())),
        "the record holds the first write and its mark: {rec:?}"
    );

    let g = store.guarded_write(&r1, base + 20, b"twenty").await?;
    let Guarded::Applied { version: v2 } = g else {
        anyhow::bail!("a greater token overwrites: {g}");
    };
    ensure!(
        v2 > v1,
        "the record's version grows with each applied write: {v1} then {v2}"
    );
    let g = store.guarded_write(&r1, base + 20, b"twenty again").await?;
    ensure!(
        is_fenced_out_at(g, base + 20),
        "the same token again is fenced out (strictly <), reporting the mark: {g}"
    );
    let g = store.guarded_write(&r1, base + 15, b"fifteen").await?;
    ensure!(
        is_fenced_out_at(g, base + 20),
        "an older token is fenced out: {g}"
    );
    let rec = read(store, &r1).await?;
    ensure!(
        rec.as_ref().map(|r| (r.mark, r.payload.as_slice()))
            == Some((Mark::new(base + 20), b"twenty".as_slice())),
        "fenced-out writes changed nothing: {rec:?}"
    );

    // One mark per record: another record takes a lower token.
    let g = store.guarded_write(&r2, base + 1, b"r2").await?;
    ensure!(g.is_applied(), "the mark is per record: {g}");
    // Across the 32-bit halves of a token (Redis compares in halves).
    let g = store
        .guarded_write(&r2, base + (1 << 32), b"r2 high")
        .await?;
    ensure!(g.is_applied(), "a token greater in its high half: {g}");
    let g = store
        .guarded_write(&r2, base + (1 << 32) - 1, b"r2 low")
        .await?;
    ensure!(
        is_fenced_out_at(g, base + (1 << 32)),
        "a token lower in its high half but greater in its low half: {g}"
    );

    // The naive writer overwrites and keeps the mark as it is...
    store.plain_write(&r1, b"plain").await?;
    let rec = read(store, &r1).await?;
    ensure!(
        rec.as_ref().map(|r| (r.mark, r.payload.as_slice()))
            == Some((Mark::new(base + 20), b"plain".as_slice())),
        "plain_write keeps the mark: {rec:?}"
    );
    // ...and a record it creates starts at mark 0, which any token passes.
    store.plain_write(&r3, b"plain new").await?;
    let rec = read(store, &r3).await?;
    ensure!(
        rec.as_ref().map(|r| (r.mark, r.payload.as_slice()))
            == Some((Mark::new(0), b"plain new".as_slice())),
        "plain_write creates with mark 0: {rec:?}"
    );
    let g = store.guarded_write(&r3, base + 1, b"fenced now").await?;
    ensure!(g.is_applied(), "a guarded write over mark 0: {g}");
    Ok(())
}

/// 24 writers race on one record with shuffled tokens; whatever the
/// interleaving, the highest token's payload and mark are what stays, and
/// every answer is Applied or FencedOut at a mark at or above the token
/// (or Retry, then nothing changed), and the applied writes' tokens rise in
/// the order of their versions (the store's commit order, as the release
/// gate's checker reads it).
pub async fn check_race(store: Arc<dyn FencedStore>, record: &str) -> anyhow::Result<()> {
    let base = 3 * EPOCH;
    let mut tokens: Vec<u64> = (1..=24).map(|i| base + i).collect();
    fastrand::shuffle(&mut tokens);
    let mut tasks = Vec::new();
    for token in tokens {
        let store = store.clone();
        let record = record.to_owned();
        tasks.push(tokio::spawn(async move {
            let payload = format!("w{}", token - base);
            let answer = latchkey_fence::guarded_write_retrying(
                store.as_ref(),
                &record,
                token,
                payload.as_bytes(),
                10,
            )
            .await;
            (token, answer)
        }));
    }
    let mut applied = Vec::new();
    for task in tasks {
        let (token, answer) = task.await?;
        match answer? {
            Guarded::Applied { version } => applied.push((version, token)),
            Guarded::FencedOut { mark } => {
                ensure!(
                    mark >= Mark::new(token),
                    "fenced out by a mark below its token"
                );
            }
            Guarded::Retry => {}
        }
    }
    ensure!(!applied.is_empty(), "no writer was applied");
    applied.sort_unstable();
    for pair in applied.windows(2) {
        ensure!(
            pair[0].0 < pair[1].0,
            "two applied writes share version {}",
            pair[0].0
        );
        ensure!(
            pair[0].1 < pair[1].1,
            "a write committed after (version {} > {}) carried a lower token",
            pair[1].0,
            pair[0].0
        );
    }
    let rec = read(store.as_ref(), record).await?;
    ensure!(
        rec.as_ref().map(|r| (r.mark, r.payload.as_slice()))
            == Some((Mark::new(base + 24), b"w24".as_slice())),
        "the highest token's write stays: {rec:?}"
    );
    Ok(())
}

/// The error's text, `Display` and `Debug`, holds neither `token`'s digits
/// nor its hex form.
pub fn ensure_scrubbed(err: &FenceError, token: u64) -> anyhow::Result<()> {
    let text = format!("{err} {err:?}");
    ensure!(
        !text.contains(&token.to_string()) && !text.contains(&format!("{token:016x}")),
        "a token leaked into an error ({} chars, kind {})",
        text.len(),
        err.is_transient()
    );
    Ok(())
}
