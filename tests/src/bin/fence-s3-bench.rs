//! `fence-s3-bench`: what the S3 fence's guarded write costs next to a plain
//! PUT, on the same S3-compatible server (moto, tests/src/s3.rs), in the
//! same run.
//!
//! Three writes, alternating call by call on one caller so drift hits all
//! alike, each to its own record:
//! - **plain PUT**: one unconditional `PUT` (what a writer without a fence
//!   sends);
//! - **plain write** ([`FencedStore::plain_write`]): `HEAD` + unconditional
//!   `PUT` (keeps the mark);
//! - **guarded write** ([`FencedStore::guarded_write`]): `HEAD` +
//!   `PUT If-Match` with a fresh, larger token each time.
//!
//! Printed: p50/p99/mean of each and guarded ÷ plain PUT (the ratio the
//! issue asks for), and guarded ÷ plain write (what the condition itself adds
//! to the same two round trips). Uncontended: a lost race costs a further
//! HEAD + PUT per round.

use std::time::{Duration, Instant};

use anyhow::ensure;
use clap::Parser;
use hdrhistogram::Histogram;
use latchkey_fence::{FencedStore, Mark};
use latchkey_fence_s3::Precondition;
use latchkey_tests::s3::S3Server;

#[derive(Parser, Debug)]
#[command(about = "S3 fence: guarded write vs plain PUT on a real S3-compatible server")]
struct Args {
    /// Timed writes of each kind.
    #[arg(long, default_value_t = 500)]
    ops: u32,
    /// Untimed writes of each kind first.
    #[arg(long, default_value_t = 50)]
    warmup: u32,
    /// Payload size in bytes.
    #[arg(long, default_value_t = 1024)]
    payload: usize,
}

struct Series {
    name: &'static str,
    hist: Histogram<u64>,
}

impl Series {
    fn new(name: &'static str) -> anyhow::Result<Self> {
        Ok(Self {
            name,
            hist: Histogram::new_with_bounds(1, 60_000_000, 3)?,
        })
    }

    fn record(&mut self, d: Duration) -> anyhow::Result<()> {
        self.hist.record(u64::try_from(d.as_micros())?.max(1))?;
        Ok(())
    }

    fn print(&self) {
        println!(
            "{:<14} p50 {:>7} µs  p99 {:>7} µs  mean {:>9.1} µs  ({} writes)",
            self.name,
            self.hist.value_at_quantile(0.5),
            self.hist.value_at_quantile(0.99),
            self.hist.mean(),
            self.hist.len()
        );
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let server = S3Server::start().await?;
    let store = server.store("bench", "fence-s3-bench/").await?;
    let payload = vec![b'x'; args.payload];

    let mut put = Series::new("plain PUT")?;
    let mut plain = Series::new("plain write")?;
    let mut guarded = Series::new("guarded write")?;
    let mut token = 1u64 << 48;
    // The records exist before timing starts (no create in the loop).
    store.guarded_write("guarded", token, &payload).await?;
    store.plain_write("plain", &payload).await?;
    store
        .put("put", Precondition::None, Mark::new(0), 0, &payload)
        .await?;

    for i in 0..args.warmup + args.ops {
        let timed = i >= args.warmup;
        let t = Instant::now();
        store
            .put("put", Precondition::None, Mark::new(0), 0, &payload)
            .await?;
        let d = t.elapsed();
        if timed {
            put.record(d)?;
        }

        let t = Instant::now();
        store.plain_write("plain", &payload).await?;
        let d = t.elapsed();
        if timed {
            plain.record(d)?;
        }

        token += 1;
        let t = Instant::now();
        let g = store.guarded_write("guarded", token, &payload).await?;
        let d = t.elapsed();
        ensure!(g.is_applied(), "an uncontended guarded write was {g}");
        if timed {
            guarded.record(d)?;
        }
    }

    println!(
        "fence-s3-bench: moto {} (single-threaded, loopback), {} B payload, {} writes each",
        latchkey_tests::s3::MOTO_VERSION,
        args.payload,
        args.ops
    );
    for s in [&put, &plain, &guarded] {
        s.print();
    }
    let ratio = |a: &Series, b: &Series| a.hist.mean() / b.hist.mean().max(1.0);
    let p50 = |a: &Series, b: &Series| {
        a.hist.value_at_quantile(0.5) as f64 / b.hist.value_at_quantile(0.5).max(1) as f64
    };
    println!(
        "guarded write / plain PUT:   {:.2}× mean, {:.2}× p50",
        ratio(&guarded, &put),
        p50(&guarded, &put)
    );
    println!(
        "guarded write / plain write: {:.2}× mean, {:.2}× p50",
        ratio(&guarded, &plain),
        p50(&guarded, &plain)
    );
    Ok(())
}
