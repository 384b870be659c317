//! Where a hook call's time goes, phase by phase, for the shipped guests and
//! a minimal hand-written module, in one run:
//!
//! ```text
//! scripts/build-wasm latchkey-hook-change-ticket latchkey-hook-quota latchkey-hook-maintenance-window
//! cargo run --release -p latchkey-hook-host --example call-profile [-- <calls>]
//! ```
//!
//! Two views: the whole call through [`HookHost::before_grant`] (what the
//! arbiter pays, next to an unhooked class's zero), and the same call taken
//! apart on an engine configured like the host's (store, instantiate, input
//! in, the guest's run, answer out, drop), p50 per phase.

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use latchkey_hook_abi::{ABI_VERSION, HookRequest, HookResponse, unpack};
use latchkey_hook_host::{HookHost, HookOutcome, HostSettings};
use latchkey_policies::{Date, PolicyFile, PolicySet};

struct Guest {
    class: &'static str,
    file: &'static str,
    hook_lines: &'static str,
}

const GUESTS: &[Guest] = &[
    Guest {
        class: "minimal",
        file: "",
        hook_lines: "",
    },
    Guest {
        class: "ticket",
        file: "latchkey_hook_change_ticket",
        hook_lines: "[class.hook.config]\npattern = \"^CHG-[0-9]{4,10}$\"\n",
    },
    Guest {
        class: "quota",
        file: "latchkey_hook_quota",
        hook_lines: "inputs = [\"holdCount\", \"holder\"]\n[class.hook.config]\nmaxHolds = 1000000\n",
    },
    Guest {
        class: "window",
        file: "latchkey_hook_maintenance_window",
        hook_lines: "[[class.hook.config.windows]]\nstart = \"00:00\"\nend = \"12:00\"\n[[class.hook.config.windows]]\nstart = \"12:00\"\nend = \"00:00\"\n",
    },
];

const ALLOW: &str = r#"{"version":1,"decision":"allow","annotations":{"by":"wat"}}"#;

fn minimal_module() -> Vec<u8> {
    let escaped = ALLOW.replace('"', "\\\"");
    let packed = (16u64 << 32) | ALLOW.len() as u64;
    wat::parse_str(format!(
        r#"(module
  (memory (export "memory") 1)
  (global $next (mut i32) (i32.const 4096))
  (data (i32.const 16) "{escaped}")
  (func (export "latchkey_abi_version") (result i32) i32.const 1)
  (func (export "latchkey_alloc") (param $n i32) (result i32) (local $p i32)
    global.get $next local.set $p
    global.get $next local.get $n i32.add global.set $next
    local.get $p)
  (func (export "latchkey_free") (param i32 i32))
  (func (export "latchkey_before_grant") (param i32 i32) (result i64)
    i64.const {packed}))"#
    ))
    .expect("wat")
}

fn request(class: &str) -> HookRequest {
    HookRequest {
        version: ABI_VERSION,
        class: class.into(),
        identity: "spiffe://dev.latchkey/workload/bench".into(),
        key: "bench/ticket/0".into(),
        session: 7_587_883_651_466_297_346,
        metadata: BTreeMap::from([("ticket".to_string(), "CHG-424242".to_string())]),
        holder: None,
        waiters: 0,
        now_unix_ms: 1_767_409_200_000,
        now_monotonic_ns: 81_234_567,
        hold_count: Some(0),
        mode: None,
        permits: None,
        config: serde_json::Value::Null,
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram")
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

fn main() {
    let calls: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20_000);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // PROFILE_WASM_DIR: guests built elsewhere (e.g. an older revision).
    let wasm_dir = std::env::var_os("PROFILE_WASM_DIR")
        .map_or_else(|| root.join("target/wasm"), PathBuf::from);
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("minimal.wasm"), minimal_module()).expect("write");
    let mut text = String::new();
    let mut paths = Vec::new();
    for g in GUESTS {
        let path: PathBuf = if g.file.is_empty() {
            dir.path().join("minimal.wasm")
        } else {
            wasm_dir.join(format!("{}.wasm", g.file))
        };
        assert!(
            path.is_file(),
            "{} missing: run scripts/build-wasm",
            path.display()
        );
        text.push_str(&format!(
            "[[class]]\nname = \"{}\"\ntier = \"coord\"\nenforcement = \"fenced\"\n[class.hook]\nmodule = \"{}\"\n{}\n",
            g.class,
            path.display(),
            g.hook_lines
        ));
        paths.push(path);
    }
    let set = PolicySet::from_files(
        &[PolicyFile {
            path: Path::new("classes/profile.toml"),
            text: &text,
        }],
        &[],
        Date::parse("2026-01-15").expect("date"),
    )
    .expect("policy");
    let host = HookHost::new(HostSettings::default());
    let refused = host.sync(&set, dir.path());
    assert!(refused.is_empty(), "{refused:?}");

    println!("whole calls through HookHost::before_grant, {calls} per hook, one thread");
    println!(
        "{:<10} {:>9} {:>9} {:>9}   (an unhooked class costs the host nothing: it is never called)",
        "hook", "p50 us", "p99 us", "mean us"
    );
    for g in GUESTS {
        for _ in 0..500 {
            let _ = host.before_grant(request(g.class));
        }
        let mut h = hist();
        for _ in 0..calls {
            let t = Instant::now();
            let out = host.before_grant(request(g.class));
            h.saturating_record(t.elapsed().as_nanos() as u64);
            assert!(
                matches!(out, HookOutcome::Allow { .. }),
                "{}: {out:?}",
                g.class
            );
        }
        println!(
            "{:<10} {:>9.1} {:>9.1} {:>9.1}",
            g.class,
            us(&h, 0.5),
            us(&h, 0.99),
            h.mean() / 1000.0
        );
    }
    println!();
    phases(&GUESTS.iter().zip(paths).collect::<Vec<_>>(), calls, &text);
}

/// The engine the host builds (call.rs), rebuilt here to time the phases.
fn engine() -> wasmtime::Engine {
    use wasmtime::{Config, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig};
    let mut pool = PoolingAllocationConfig::default();
    pool.total_core_instances(32)
        .total_memories(32)
        .total_tables(32)
        .max_memories_per_module(1)
        .max_tables_per_module(2)
        .max_memory_size(64 << 20)
        .table_elements(100_000);
    if PoolingAllocationConfig::is_pagemap_scan_available()
        && std::env::var_os("PROFILE_NO_PAGEMAP").is_none()
    {
        let table_keep = std::env::var("PROFILE_TABLE_KEEP")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4096);
        pool.pagemap_scan(wasmtime::Enabled::Yes)
            .linear_memory_keep_resident(1 << 20)
            .table_keep_resident(table_keep);
    } else {
        pool.linear_memory_keep_resident(64 * 1024)
            .table_keep_resident(64 * 1024);
    }
    let mut config = Config::new();
    if std::env::var_os("PROFILE_EAGER_TABLE").is_some() {
        config.table_lazy_init(false);
    }
    config
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
        .epoch_interruption(true)
        .cranelift_opt_level(OptLevel::Speed);
    Engine::new(&config).expect("engine")
}

/// Which 4 KiB pages of memory a call left different from a fresh
/// instance's: what the slot's reset has to put back.
fn changed_pages(
    pre: &wasmtime::InstancePre<()>,
    memory: &wasmtime::Memory,
    store: &wasmtime::Store<()>,
    class: &str,
) {
    let engine = store.engine();
    let mut fresh = wasmtime::Store::new(engine, ());
    fresh.set_epoch_deadline(1_000_000);
    let instance = pre.instantiate(&mut fresh).expect("instantiate");
    let initial = instance.get_memory(&mut fresh, "memory").expect("memory");
    let (a, b) = (initial.data(&fresh), memory.data(store));
    let pages: Vec<usize> = (0..b.len() / 4096)
        .filter(|p| a.get(p * 4096..(p + 1) * 4096) != b.get(p * 4096..(p + 1) * 4096))
        .collect();
    println!(
        "{class}: memory {} KiB at start, {} KiB after the call; pages changed: {pages:?}",
        a.len() / 1024,
        b.len() / 1024
    );
}

const PHASES: [&str; 8] = [
    "encode",
    "store",
    "instantiate",
    "exports",
    "alloc+copy",
    "run",
    "answer",
    "drop",
];

fn phases(guests: &[(&Guest, PathBuf)], calls: u32, _text: &str) {
    use wasmtime::{Linker, Module, Store};
    let engine = engine();
    let mut linker: Linker<()> = Linker::new(&engine);
    linker
        .func_wrap("latchkey", "log", |_: i32, _: i32, _: i32| {})
        .expect("log");
    println!(
        "the same calls taken apart (p50 us per phase; as the host: PAGEMAP_SCAN where available, PROFILE_NO_PAGEMAP=1 without)"
    );
    print!("{:<10}", "hook");
    for p in PHASES {
        print!(" {p:>11}");
    }
    println!(" {:>9}", "sum p50");
    for (g, path) in guests {
        let module = Module::from_file(&engine, path).expect("module");
        let pre = linker.instantiate_pre(&module).expect("pre");
        let config = match g.class {
            "minimal" => serde_json::Value::Null,
            "ticket" => serde_json::json!({"pattern": "^CHG-[0-9]{4,10}$"}),
            "quota" => serde_json::json!({"maxHolds": 1_000_000}),
            _ => {
                serde_json::json!({"windows": [{"start": "00:00", "end": "12:00"}, {"start": "12:00", "end": "00:00"}]})
            }
        };
        let mut hs: Vec<Histogram<u64>> = PHASES.iter().map(|_| hist()).collect();
        for i in 0..calls + 500 {
            let mut t = Instant::now();
            let mut lap = |hs: &mut Vec<Histogram<u64>>, n: usize| {
                let now = Instant::now();
                if i >= 500 {
                    hs[n].saturating_record((now - t).as_nanos() as u64);
                }
                t = now;
            };
            let mut req = request(g.class);
            req.config = config.clone();
            let input = serde_json::to_vec(&req).expect("encode");
            lap(&mut hs, 0);
            let mut store = Store::new(&engine, ());
            store.set_epoch_deadline(1_000_000);
            lap(&mut hs, 1);
            let instance = pre.instantiate(&mut store).expect("instantiate");
            lap(&mut hs, 2);
            let memory = instance.get_memory(&mut store, "memory").expect("memory");
            let alloc = instance
                .get_typed_func::<u32, u32>(&mut store, "latchkey_alloc")
                .expect("alloc");
            let before = instance
                .get_typed_func::<(u32, u32), u64>(&mut store, "latchkey_before_grant")
                .expect("before");
            lap(&mut hs, 3);
            let ptr = alloc
                .call(&mut store, input.len() as u32)
                .expect("alloc call");
            memory
                .write(&mut store, ptr as usize, &input)
                .expect("write");
            lap(&mut hs, 4);
            let packed = before
                .call(&mut store, (ptr, input.len() as u32))
                .expect("call");
            lap(&mut hs, 5);
            let (p, l) = unpack(packed);
            let out = &memory.data(&store)[p as usize..(p + l) as usize];
            let resp: HookResponse = serde_json::from_slice(out).expect("answer");
            assert_eq!(resp.decision, HookResponse::allow().decision, "{}", g.class);
            lap(&mut hs, 6);
            if i == 0 && std::env::var_os("PROFILE_PAGES").is_some() {
                changed_pages(&pre, &memory, &store, g.class);
            }
            drop(store);
            lap(&mut hs, 7);
        }
        print!("{:<10}", g.class);
        let mut sum = 0.0;
        for h in &hs {
            print!(" {:>11.2}", us(h, 0.5));
            sum += us(h, 0.5);
        }
        println!(" {sum:>9.1}");
    }
    let _ = Duration::ZERO;
}
