//! The host against hand-written modules (WAT), one test per limit and per
//! load refusal, and against the real example guests when
//! `scripts/build-wasm` has built them (target/wasm/).

// A test binary: a failed unwrap or a panic is how it reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use latchkey_hook_abi::{ABI_VERSION, DenyCode, HookMode, HookRequest};
use latchkey_hook_host::{FailureKind, HookHost, HookOutcome, HostSettings};
use latchkey_policies::{Date, PolicyFile, PolicySet};

const ALLOW: &str = r#"{"version":1,"decision":"allow","annotations":{"by":"wat"}}"#;

/// A module with the ABI exports whose before-grant export runs `body`
/// (which must leave an i64 on the stack). The answer text `ALLOW` sits at 16.
fn abi_module(body: &str) -> Vec<u8> {
    abi_module_with(ALLOW, body)
}

/// A module whose before-grant export always answers `answer`.
fn answering(answer: &str) -> Vec<u8> {
    abi_module_with(
        answer,
        &format!("i64.const {}", (16u64 << 32) | answer.len() as u64),
    )
}

/// [`abi_module`] with `answer` at 16 instead of `ALLOW`.
fn abi_module_with(answer: &str, body: &str) -> Vec<u8> {
    let escaped = answer.replace('"', "\\\"");
    let wat = format!(
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
    {body}))"#
    );
    wat::parse_str(wat).unwrap()
}

fn allow_body() -> String {
    format!("i64.const {}", (16u64 << 32) | ALLOW.len() as u64)
}

struct Fixture {
    dir: tempfile::TempDir,
    host: HookHost,
}

impl Fixture {
    fn new() -> Self {
        Self::with_slots(HostSettings::default().pool_slots)
    }

    /// A host whose pool has `slots` instance slots (with 1, every call
    /// reuses the slot the previous one ran in).
    fn with_slots(slots: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let host = HookHost::new(HostSettings {
            cache_dir: Some(dir.path().join("cache")),
            pool_slots: slots,
            ..Default::default()
        });
        Self { dir, host }
    }

    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    /// Loads classes `(name, module file, extra hook lines)`.
    fn sync(&self, classes: &[(&str, &str, &str)]) -> Vec<String> {
        let mut text = String::new();
        for (name, module, extra) in classes {
            text.push_str(&format!(
                "[[class]]\nname = \"{name}\"\ntier = \"coord\"\nenforcement = \"fenced\"\n[class.hook]\nmodule = \"{module}\"\n{extra}\n"
            ));
        }
        let set = PolicySet::from_files(
            &[PolicyFile {
                path: Path::new("classes/t.toml"),
                text: &text,
            }],
            &[],
            Date::parse("2026-01-15").unwrap(),
        )
        .unwrap();
        self.host
            .sync(&set, self.dir.path())
            .into_iter()
            .map(|r| r.to_string())
            .collect()
    }

    fn call(&self, class: &str) -> HookOutcome {
        self.host.before_grant(request(class, Default::default()))
    }
}

fn request(class: &str, metadata: std::collections::BTreeMap<String, String>) -> HookRequest {
    HookRequest {
        version: ABI_VERSION,
        class: class.into(),
        identity: "spiffe://dev.latchkey/workload/alice".into(),
        key: "demo/a".into(),
        session: 1,
        metadata,
        holder: None,
        waiters: 0,
        now_unix_ms: 1_767_409_200_000,
        now_monotonic_ns: 0,
        hold_count: Some(0),
        mode: None,
        permits: None,
        config: serde_json::Value::Null,
    }
}

fn failure(o: &HookOutcome) -> Option<FailureKind> {
    match o {
        HookOutcome::Deny { failure, .. } => *failure,
        HookOutcome::Allow { .. } => None,
    }
}

#[test]
fn a_well_formed_module_allows_and_annotates() {
    let f = Fixture::new();
    f.write("ok.wasm", &abi_module(&allow_body()));
    assert!(f.sync(&[("ok", "ok.wasm", "")]).is_empty());
    match f.call("ok") {
        HookOutcome::Allow { annotations } => {
            assert_eq!(annotations.get("by").map(String::as_str), Some("wat"))
        }
        other => panic!("{other:?}"),
    }
    let m = f.host.metrics().class("ok").unwrap();
    assert_eq!((m.invocations, m.allowed), (1, 1));
}

/// Every call starts from the module's initial memory, however the slot is
/// reset (with PAGEMAP_SCAN, written pages stay mapped and are copied back;
/// past the part kept resident they are given back): a call that finds
/// anything a previous call wrote traps. The pool has one slot, so every
/// call runs in the slot the previous call scribbled over.
#[test]
fn nothing_one_call_writes_is_seen_by_the_next() {
    let f = Fixture::with_slots(1);
    let escaped = ALLOW.replace('"', "\\\"");
    let wat = format!(
        r#"(module
  (memory (export "memory") 1)
  (global $next (mut i32) (i32.const 4096))
  (data (i32.const 16) "{escaped}")
  (data (i32.const 200) "\01")
  (func (export "latchkey_abi_version") (result i32) i32.const 1)
  (func (export "latchkey_alloc") (param $n i32) (result i32) (local $p i32)
    global.get $next local.set $p
    global.get $next local.get $n i32.add global.set $next
    local.get $p)
  (func (export "latchkey_free") (param i32 i32))
  (func (export "latchkey_before_grant") (param i32 i32) (result i64)
    ;; As the module starts: an untouched zero page, the data byte, the
    ;; memory size, the allocator's global, and this call's own input.
    (if (i32.load8_u (i32.const 8192)) (then unreachable))
    (if (i32.ne (i32.load8_u (i32.const 200)) (i32.const 1)) (then unreachable))
    (if (i32.ne (memory.size) (i32.const 1)) (then unreachable))
    (if (i32.ne (local.get 0) (i32.const 4096)) (then unreachable))
    (if (i32.ne (i32.load8_u (local.get 0)) (i32.const 123)) (then unreachable))
    ;; Scribble over all of it, and over a grown page.
    (i32.store8 (i32.const 8192) (i32.const 7))
    (i32.store8 (i32.const 200) (i32.const 9))
    (i32.store8 (i32.const 4096) (i32.const 0))
    (global.set $next (i32.const 9000))
    (drop (memory.grow (i32.const 1)))
    (if (i32.load8_u (i32.const 70000)) (then unreachable))
    (i32.store8 (i32.const 70000) (i32.const 5))
    ;; And past the first MiB (more than a slot keeps resident): page 39.
    (drop (memory.grow (i32.const 38)))
    (if (i32.load8_u (i32.const 2600000)) (then unreachable))
    (i32.store8 (i32.const 2600000) (i32.const 3))
    {}))"#,
        allow_body()
    );
    f.write("scribble.wasm", &wat::parse_str(wat).unwrap());
    assert!(f.sync(&[("s", "scribble.wasm", "")]).is_empty());
    for i in 0..50 {
        let t = Instant::now();
        match f.call("s") {
            HookOutcome::Allow { .. } => {}
            other => panic!("call {i} after {:?}: {other:?}", t.elapsed()),
        }
    }
}

/// Counts wake-ups of a hand-polled call.
#[derive(Default)]
struct Wakes(AtomicBool);

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A call awaited on an async worker gives the thread back at every epoch
/// tick it runs past (a slow hook holds a worker for a tick at a time, never
/// for its whole deadline), wakes itself so an executor polls it again, and
/// still ends at its deadline; a call dropped part-way (the Acquire went
/// away) leaves its pool slot free for the next.
#[test]
fn a_slow_call_gives_its_thread_back_at_every_tick_and_a_dropped_one_frees_its_slot() {
    let f = Fixture::with_slots(1);
    f.write("loop.wasm", &abi_module("(loop $l (br $l)) i64.const 0"));
    f.write("ok.wasm", &abi_module(&allow_body()));
    assert!(
        f.sync(&[
            ("slow", "loop.wasm", "deadlineMs = 50"),
            ("ok", "ok.wasm", "")
        ])
        .is_empty()
    );
    let wakes = Arc::new(Wakes::default());
    let waker = Waker::from(wakes.clone());
    let mut cx = Context::from_waker(&waker);
    let mut call = pin!(
        f.host
            .before_grant_async(request("slow", Default::default()))
    );
    let mut yields = 0u32;
    let out = loop {
        match call.as_mut().poll(&mut cx) {
            Poll::Ready(out) => break out,
            Poll::Pending => {
                yields += 1;
                assert!(
                    wakes.0.swap(false, Ordering::SeqCst),
                    "pending without a wake-up: an executor would never poll it again"
                );
            }
        }
    };
    assert_eq!(failure(&out), Some(FailureKind::Timeout), "{out:?}");
    assert!(yields >= 1, "the call held its thread until its deadline");
    // Dropped after it yielded once: the pool's one slot is free again.
    let mut dropped = false;
    for _ in 0..10 {
        let mut call = pin!(
            f.host
                .before_grant_async(request("slow", Default::default()))
        );
        if call.as_mut().poll(&mut cx).is_pending() {
            dropped = true;
            break;
        }
    }
    assert!(dropped, "no call yielded before its deadline");
    assert!(matches!(f.call("ok"), HookOutcome::Allow { .. }));
}

#[test]
fn an_infinite_loop_is_cut_off_at_the_deadline_and_other_classes_still_run() {
    let f = Fixture::new();
    f.write("loop.wasm", &abi_module("(loop $l (br $l)) i64.const 0"));
    f.write("ok.wasm", &abi_module(&allow_body()));
    assert!(
        f.sync(&[
            ("spin", "loop.wasm", "deadlineMs = 2"),
            ("ok", "ok.wasm", "")
        ])
        .is_empty()
    );
    let t = Instant::now();
    let out = f.call("spin");
    let took = t.elapsed();
    assert_eq!(failure(&out), Some(FailureKind::Timeout), "{out:?}");
    assert!(took >= Duration::from_millis(2), "{took:?}");
    assert!(took < Duration::from_millis(50), "cut off late: {took:?}");
    match &out {
        HookOutcome::Deny {
            code,
            reason,
            message,
            ..
        } => {
            assert_eq!(*code, DenyCode::FailedPrecondition);
            assert_eq!(reason, "HOOK_TIMEOUT");
            assert!(
                message.contains("\"spin\"") && message.contains("deadline"),
                "{message}"
            );
        }
        HookOutcome::Allow { .. } => unreachable!(),
    }
    assert!(matches!(f.call("ok"), HookOutcome::Allow { .. }));
    let m = f.host.metrics().class("spin").unwrap();
    assert_eq!(m.failures.get(&FailureKind::Timeout), Some(&1));
}

/// The tick is a tenth of the smallest deadline among the hooked classes,
/// no finer than the host's floor (200 µs by default).
#[test]
fn the_epoch_tick_follows_the_smallest_deadline() {
    let f = Fixture::new();
    assert_eq!(f.host.epoch_tick(), None, "no engine before any hook");
    f.write("ok.wasm", &abi_module(&allow_body()));
    assert!(f.sync(&[("a", "ok.wasm", "")]).is_empty());
    assert_eq!(f.host.epoch_tick(), Some(Duration::from_millis(1)));
    assert!(
        f.sync(&[("a", "ok.wasm", ""), ("b", "ok.wasm", "deadlineMs = 2")])
            .is_empty()
    );
    assert_eq!(f.host.epoch_tick(), Some(Duration::from_micros(200)));
    assert!(f.sync(&[("c", "ok.wasm", "deadlineMs = 50")]).is_empty());
    assert_eq!(f.host.epoch_tick(), Some(Duration::from_millis(5)));
}

/// A call measures its own deadline in wall-clock time: a finer tick coming
/// in while it runs (another class with a shorter deadline) does not cut it
/// short, and a coarse tick still stops it within one tick of its deadline.
#[test]
fn a_tick_change_mid_call_keeps_the_deadline() {
    let f = Fixture::new();
    f.write("loop.wasm", &abi_module("(loop $l (br $l)) i64.const 0"));
    f.write("ok.wasm", &abi_module(&allow_body()));
    assert!(
        f.sync(&[("slow", "loop.wasm", "deadlineMs = 40")])
            .is_empty()
    );
    assert_eq!(f.host.epoch_tick(), Some(Duration::from_millis(4)));
    std::thread::scope(|s| {
        let call = s.spawn(|| {
            let t = Instant::now();
            (f.call("slow"), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(5));
        let refused = f.sync(&[
            ("slow", "loop.wasm", "deadlineMs = 40"),
            ("fast", "ok.wasm", "deadlineMs = 2"),
        ]);
        assert!(refused.is_empty(), "{refused:?}");
        assert_eq!(f.host.epoch_tick(), Some(Duration::from_micros(200)));
        let (out, took) = call.join().unwrap();
        assert_eq!(failure(&out), Some(FailureKind::Timeout), "{out:?}");
        assert!(took >= Duration::from_millis(40), "cut short: {took:?}");
        assert!(took < Duration::from_millis(200), "cut off late: {took:?}");
    });
}

/// A module with an after-release export that loops: the release's call is
/// built without running anything, once per granted key, and running it ends
/// at the class's deadline.
#[test]
fn after_release_calls_are_built_cheaply_and_run_under_the_deadline() {
    let escaped = ALLOW.replace('"', "\\\"");
    let wat = format!(
        r#"(module
  (memory (export "memory") 1)
  (data (i32.const 16) "{escaped}")
  (func (export "latchkey_abi_version") (result i32) i32.const 1)
  (func (export "latchkey_alloc") (param i32) (result i32) i32.const 4096)
  (func (export "latchkey_free") (param i32 i32))
  (func (export "latchkey_before_grant") (param i32 i32) (result i64) {})
  (func (export "latchkey_after_release") (param i32 i32) (loop $l (br $l))))"#,
        allow_body()
    );
    let f = Fixture::new();
    f.write("rel.wasm", &wat::parse_str(wat).unwrap());
    assert!(f.sync(&[("r", "rel.wasm", "deadlineMs = 5")]).is_empty());
    let who = "spiffe://dev.latchkey/workload/alice";
    assert!(
        f.host.release_call(who, "demo/a", 1, 2).is_none(),
        "not granted yet"
    );
    assert!(matches!(f.call("r"), HookOutcome::Allow { .. }));
    let call = f.host.release_call(who, "demo/a", 1, 2).unwrap();
    assert_eq!(call.class(), "r");
    assert!(
        f.host.release_call(who, "demo/a", 1, 2).is_none(),
        "forgotten at release"
    );
    let t = Instant::now();
    f.host.run_release_call(call);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(5) && took < Duration::from_millis(100),
        "{took:?}"
    );

    assert!(matches!(f.call("r"), HookOutcome::Allow { .. }));
    let call = f.host.release_call(who, "demo/a", 1, 2).unwrap();
    f.host.release_call_dropped(call);
    assert_eq!(
        f.host.metrics().class("r").unwrap().after_release_dropped,
        1
    );
}

#[test]
fn an_internal_failure_denies_like_a_trap() {
    let f = Fixture::new();
    match f
        .host
        .internal_failure("c", Instant::now(), "the thread panicked")
    {
        HookOutcome::Deny {
            code,
            reason,
            message,
            failure,
        } => {
            assert_eq!(code, DenyCode::FailedPrecondition);
            assert_eq!(reason, "HOOK_INTERNAL_ERROR");
            assert_eq!(failure, Some(FailureKind::Internal));
            assert!(
                message.contains("\"c\"") && message.contains("panicked"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    let m = f.host.metrics().class("c").unwrap();
    assert_eq!(m.failures.get(&FailureKind::Internal), Some(&1));
}

#[test]
fn a_memory_bomb_hits_the_cap() {
    let f = Fixture::new();
    let bomb =
        "(loop $l (br_if $l (i32.ne (memory.grow (i32.const 16)) (i32.const -1)))) unreachable";
    f.write("bomb.wasm", &abi_module(bomb));
    assert!(
        f.sync(&[("bomb", "bomb.wasm", "memoryMib = 4\ndeadlineMs = 50")])
            .is_empty()
    );
    let out = f.call("bomb");
    assert_eq!(failure(&out), Some(FailureKind::OutOfMemory), "{out:?}");
    assert!(format!("{out:?}").contains("4 MiB cap"), "{out:?}");
}

#[test]
fn malformed_answers_are_denied() {
    let f = Fixture::new();
    // 10 bytes of the module's data that are not JSON ("{\"version\"" cut short).
    f.write(
        "cut.wasm",
        &abi_module(&format!("i64.const {}", (16u64 << 32) | 10)),
    );
    f.write(
        "huge.wasm",
        &abi_module(&format!("i64.const {}", (16u64 << 32) | 1_000_000)),
    );
    f.write(
        "wild.wasm",
        &abi_module(&format!("i64.const {}", (0xffff_0000u64 << 32) | 10)),
    );
    f.write("trap.wasm", &abi_module("unreachable"));
    assert!(
        f.sync(&[
            ("cut", "cut.wasm", ""),
            ("huge", "huge.wasm", ""),
            ("wild", "wild.wasm", ""),
            ("trap", "trap.wasm", ""),
        ])
        .is_empty()
    );
    assert_eq!(failure(&f.call("cut")), Some(FailureKind::MalformedOutput));
    let huge = f.call("huge");
    assert_eq!(failure(&huge), Some(FailureKind::MalformedOutput));
    assert!(
        format!("{huge:?}").contains("more than the class's cap"),
        "{huge:?}"
    );
    assert_eq!(failure(&f.call("wild")), Some(FailureKind::MalformedOutput));
    assert_eq!(failure(&f.call("trap")), Some(FailureKind::Trap));
}

/// A module that answers HOOK_MISCONFIGURED to the host's trial call does
/// not accept its class's config: the pair is refused and the previous one
/// stays in service (a module rebuilt under an unchanged config, or written
/// before its new class file, would otherwise fail every request).
#[test]
fn a_module_that_rejects_its_config_is_refused_and_the_previous_pair_stays() {
    let f = Fixture::new();
    f.write("h.wasm", &abi_module(&allow_body()));
    assert!(f.sync(&[("c", "h.wasm", "")]).is_empty());
    let good = f.host.loaded_digest("c").unwrap();

    f.write(
        "h.wasm",
        &answering(
            r#"{"version":1,"decision":"deny","code":"FAILED_PRECONDITION","reason":"HOOK_MISCONFIGURED","message":"unknown field `behavior`"}"#,
        ),
    );
    let refused = f.sync(&[("c", "h.wasm", "")]);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].contains("does not accept the class's hook config")
            && refused[0].contains("unknown field `behavior`"),
        "{refused:?}"
    );
    assert_eq!(f.host.loaded_digest("c").as_deref(), Some(good.as_str()));
    assert!(matches!(f.call("c"), HookOutcome::Allow { .. }));

    // Any other denial says nothing about the config: that module loads.
    f.write(
        "h.wasm",
        &answering(
            r#"{"version":1,"decision":"deny","code":"PERMISSION_DENIED","reason":"TICKET_MISSING","message":"no ticket"}"#,
        ),
    );
    assert!(f.sync(&[("c", "h.wasm", "")]).is_empty());
    assert_ne!(f.host.loaded_digest("c").as_deref(), Some(good.as_str()));
    assert!(f.host.refusals().is_empty());
}

#[test]
fn a_refused_module_is_logged_once_per_change_and_counted_every_time() {
    use parking_lot::Mutex;
    use std::sync::Arc;
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let log = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let log = log.clone();
            move || log.clone()
        })
        .with_ansi(false)
        .finish();
    let refusals_logged = || {
        String::from_utf8_lossy(&log.0.lock())
            .matches("hook module refused")
            .count()
    };
    tracing::subscriber::with_default(subscriber, || {
        let f = Fixture::new();
        // Missing: refused at every poll, logged once.
        for _ in 0..5 {
            assert_eq!(f.sync(&[("c", "gone.wasm", "")]).len(), 1);
        }
        assert_eq!(refusals_logged(), 1);
        assert_eq!(f.host.metrics().class("c").unwrap().module_refusals, 5);
        // The file appears but is not Wasm: another outcome, logged once more.
        f.write("gone.wasm", b"not wasm");
        f.sync(&[("c", "gone.wasm", "")]);
        f.sync(&[("c", "gone.wasm", "")]);
        assert_eq!(refusals_logged(), 2);
        // Loaded, then missing again: news again.
        f.write("gone.wasm", &abi_module(&allow_body()));
        let r = f.sync(&[("c", "gone.wasm", "")]);
        assert!(r.is_empty(), "{r:?}");
        std::fs::remove_file(f.dir.path().join("gone.wasm")).unwrap();
        f.sync(&[("c", "gone.wasm", "")]);
        f.sync(&[("c", "gone.wasm", "")]);
        assert_eq!(refusals_logged(), 3);
    });
}

#[test]
fn bad_modules_are_refused_at_load_and_the_previous_one_stays() {
    let f = Fixture::new();
    f.write("h.wasm", &abi_module(&allow_body()));
    assert!(f.sync(&[("c", "h.wasm", "")]).is_empty());
    let good = f.host.loaded_digest("c").unwrap();

    // Not Wasm at all.
    f.write("h.wasm", b"#!/bin/sh\necho hi\n");
    let refused = f.sync(&[("c", "h.wasm", "")]);
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].contains("class \"c\"") && refused[0].contains("not a valid Wasm module"),
        "{refused:?}"
    );
    assert_eq!(f.host.loaded_digest("c").as_deref(), Some(good.as_str()));
    assert!(matches!(f.call("c"), HookOutcome::Allow { .. }));
    // Unchanged since the refusal: not compiled or reported again.
    assert!(f.sync(&[("c", "h.wasm", "")]).is_empty());
    assert_eq!(f.host.refusals().len(), 1);

    // Valid Wasm without the before-grant export.
    let missing = wat::parse_str(
        r#"(module (memory (export "memory") 1)
            (func (export "latchkey_abi_version") (result i32) i32.const 1)
            (func (export "latchkey_alloc") (param i32) (result i32) i32.const 8)
            (func (export "latchkey_free") (param i32 i32)))"#,
    )
    .unwrap();
    f.write("h.wasm", &missing);
    let refused = f.sync(&[("c", "h.wasm", "")]);
    assert!(
        refused[0].contains("lacks the hook ABI v1 export latchkey_before_grant"),
        "{refused:?}"
    );
    assert_eq!(f.host.loaded_digest("c").as_deref(), Some(good.as_str()));

    // Importing anything but latchkey.log (a clock, say).
    let clock = wat::parse_str(format!(
        r#"(module (import "wasi_snapshot_preview1" "clock_time_get" (func (param i32 i64 i32) (result i32)))
            (memory (export "memory") 1)
            (func (export "latchkey_abi_version") (result i32) i32.const 1)
            (func (export "latchkey_alloc") (param i32) (result i32) i32.const 8)
            (func (export "latchkey_free") (param i32 i32))
            (func (export "latchkey_before_grant") (param i32 i32) (result i64) {}))"#,
        allow_body()
    ))
    .unwrap();
    f.write("h.wasm", &clock);
    let refused = f.sync(&[("c", "h.wasm", "")]);
    assert!(
        refused[0].contains("imports something other than latchkey.log"),
        "{refused:?}"
    );

    // Another ABI version.
    f.write("h.wasm", &wat::parse_str(v2_module()).unwrap());
    let refused = f.sync(&[("c", "h.wasm", "")]);
    assert!(refused[0].contains("ABI version 2"), "{refused:?}");

    // A good module again (other bytes: a trapping one loads fine): swapped
    // in, refusal cleared.
    f.write("h.wasm", &abi_module("unreachable"));
    assert!(f.sync(&[("c", "h.wasm", "")]).is_empty());
    assert_ne!(f.host.loaded_digest("c").as_deref(), Some(good.as_str()));
    assert!(f.host.refusals().is_empty());
}

/// Like `abi_module(allow)`, but its version export returns 2.
fn v2_module() -> String {
    let escaped = ALLOW.replace('"', "\\\"");
    format!(
        r#"(module (memory (export "memory") 1)
            (data (i32.const 16) "{escaped}")
            (func (export "latchkey_abi_version") (result i32) i32.const 2)
            (func (export "latchkey_alloc") (param i32) (result i32) i32.const 4096)
            (func (export "latchkey_free") (param i32 i32))
            (func (export "latchkey_before_grant") (param i32 i32) (result i64) {}))"#,
        allow_body()
    )
}

#[test]
fn a_missing_module_file_fails_closed_for_that_class_only() {
    let f = Fixture::new();
    f.write("ok.wasm", &abi_module(&allow_body()));
    let refused = f.sync(&[("gone", "nope.wasm", ""), ("ok", "ok.wasm", "")]);
    assert_eq!(refused.len(), 1);
    let out = f.call("gone");
    assert_eq!(failure(&out), Some(FailureKind::NotLoaded));
    assert!(
        format!("{out:?}").contains("cannot read the module"),
        "{out:?}"
    );
    assert!(matches!(f.call("ok"), HookOutcome::Allow { .. }));
}

#[test]
fn a_memory_that_starts_above_the_cap_is_refused() {
    let f = Fixture::new();
    let wat = format!(
        r#"(module (memory (export "memory") 80)
            (func (export "latchkey_abi_version") (result i32) i32.const 1)
            (func (export "latchkey_alloc") (param i32) (result i32) i32.const 8)
            (func (export "latchkey_free") (param i32 i32))
            (func (export "latchkey_before_grant") (param i32 i32) (result i64) {}))"#,
        allow_body()
    );
    f.write("big.wasm", &wat::parse_str(wat).unwrap());
    let refused = f.sync(&[("big", "big.wasm", "memoryMib = 4")]);
    assert!(
        refused[0].contains("above the class's cap of 4 MiB"),
        "{refused:?}"
    );
}

/// The real guests, when built (scripts/build-wasm; the e2e tests build them).
/// A guest built by the project's Wasm build step (`scripts/build-wasm`), which
/// this runs when the artifact is missing: these tests never pass vacuously.
fn guest(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = root.join("target/wasm").join(format!("{name}.wasm"));
    if !p.is_file() {
        let status = std::process::Command::new(root.join("scripts/build-wasm"))
            .arg(name.replace('_', "-"))
            .status();
        assert!(
            matches!(status, Ok(s) if s.success()),
            "scripts/build-wasm {name} failed: {status:?}"
        );
    }
    assert!(
        p.is_file(),
        "{} missing after scripts/build-wasm",
        p.display()
    );
    p
}

#[test]
fn the_change_ticket_guest_runs_in_the_host() {
    let module = guest("latchkey_hook_change_ticket");
    let f = Fixture::new();
    let module = module.display().to_string();
    assert!(
        f.sync(&[(
            "t",
            &module,
            "[class.hook.config]\npattern = \"^CHG-[0-9]{4,}$\""
        )])
        .is_empty()
    );
    let ok = f.host.before_grant(request(
        "t",
        [("ticket".to_string(), "CHG-1234".to_string())].into(),
    ));
    assert_eq!(
        ok,
        HookOutcome::Allow {
            annotations: [("ticket".to_string(), "CHG-1234".to_string())].into()
        }
    );
    match f.host.before_grant(request("t", Default::default())) {
        HookOutcome::Deny {
            reason,
            failure: None,
            ..
        } => assert_eq!(reason, "TICKET_MISSING"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_misbehaving_guest_is_contained() {
    let module = guest("latchkey_hook_misbehave");
    let f = Fixture::new();
    let m = module.display().to_string();
    assert!(
        f.sync(&[
            ("loop", &m, "[class.hook.config]\nbehavior = \"loop\""),
            (
                "bomb",
                &m,
                "deadlineMs = 50\n[class.hook.config]\nbehavior = \"bomb\""
            ),
            ("panic", &m, "[class.hook.config]\nbehavior = \"panic\""),
            ("fine", &m, "[class.hook.config]\nbehavior = \"allow\""),
        ])
        .is_empty()
    );
    assert_eq!(failure(&f.call("loop")), Some(FailureKind::Timeout));
    assert_eq!(failure(&f.call("bomb")), Some(FailureKind::OutOfMemory));
    assert_eq!(failure(&f.call("panic")), Some(FailureKind::Trap));
    assert!(matches!(f.call("fine"), HookOutcome::Allow { .. }));
}

/// The load-time trial call (the ABI version) checks what a module is, not
/// how fast it is: a host busy enough to delay it past the class's 5 ms
/// deadline must not refuse the module (the refusal would stand until the
/// file changed, and the class would deny every Acquire). Here the version
/// export itself spins for tens of milliseconds; calls still get 5 ms.
#[test]
fn a_slow_version_trial_does_not_refuse_the_module_but_calls_keep_their_deadline() {
    let escaped = ALLOW.replace('"', "\\\"");
    let wat = format!(
        r#"(module
  (memory (export "memory") 1)
  (data (i32.const 16) "{escaped}")
  (func (export "latchkey_abi_version") (result i32) (local $i i32)
    (loop $l (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 30000000))))
    i32.const 1)
  (func (export "latchkey_alloc") (param i32) (result i32) i32.const 4096)
  (func (export "latchkey_free") (param i32 i32))
  (func (export "latchkey_before_grant") (param i32 i32) (result i64) (loop $l (br $l)) {}))"#,
        allow_body()
    );
    let f = Fixture::new();
    f.write("slow.wasm", &wat::parse_str(wat).unwrap());
    let refused = f.sync(&[("s", "slow.wasm", "deadlineMs = 5")]);
    assert!(refused.is_empty(), "{refused:?}");
    let t = Instant::now();
    assert!(matches!(f.call("s"), HookOutcome::Deny { .. }));
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
}

/// `"mode"` in `inputs`: the guest is told the Acquire's mode (and a
/// semaphore's permits) and can refuse shared acquires only. A class that
/// does not list it gets neither field, whatever the arbiter filled in: a
/// hook built before they existed refuses unknown fields.
#[test]
fn a_hook_that_asks_for_the_mode_can_refuse_shared_acquires_only() {
    let module = guest("latchkey_hook_misbehave");
    let f = Fixture::new();
    let m = module.display().to_string();
    let refused = f.sync(&[
        (
            "readers-refused",
            &m,
            "inputs = [\"mode\"]\n[class.hook.config]\nbehavior = \"exclusive-only\"",
        ),
        ("blind", &m, "[class.hook.config]\nbehavior = \"show-mode\""),
        (
            "misconfigured",
            &m,
            "[class.hook.config]\nbehavior = \"exclusive-only\"",
        ),
    ]);
    // exclusive-only without the input cannot tell the modes apart: its
    // trial call says HOOK_MISCONFIGURED and the module is refused at load.
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].contains("misconfigured") && refused[0].contains("HOOK_MISCONFIGURED"),
        "{refused:?}"
    );

    let asking = |class: &str, mode: HookMode, permits: Option<u32>| {
        let mut r = request(class, Default::default());
        r.mode = Some(mode);
        r.permits = permits;
        f.host.before_grant(r)
    };
    match asking("readers-refused", HookMode::Shared, None) {
        HookOutcome::Deny {
            code,
            reason,
            failure: None,
            ..
        } => {
            assert_eq!(code, DenyCode::PermissionDenied);
            assert_eq!(reason, "SHARED_REFUSED");
        }
        other => panic!("a shared acquire must be refused: {other:?}"),
    }
    assert_eq!(
        asking("readers-refused", HookMode::Exclusive, None),
        HookOutcome::Allow {
            annotations: [("mode".to_string(), "exclusive".to_string())].into()
        }
    );
    // A semaphore class's acquire: exclusive, with the class's permits.
    assert_eq!(
        asking("readers-refused", HookMode::Exclusive, Some(8)),
        HookOutcome::Allow {
            annotations: [
                ("mode".to_string(), "exclusive".to_string()),
                ("permits".to_string(), "8".to_string())
            ]
            .into()
        }
    );
    // Not asked for: left out by the host, even when the request has it.
    assert_eq!(
        asking("blind", HookMode::Shared, Some(8)),
        HookOutcome::Allow {
            annotations: [("mode".to_string(), "absent".to_string())].into()
        }
    );
}
