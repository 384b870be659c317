//! Per-class Wasm hooks through the real arbiter on real etcd: the three
//! example hooks' allow and deny paths, a hook that loops or exhausts its
//! memory is cut off and denied while other classes are served, bad modules
//! are refused at load with the previous one kept, and a hot reload under
//! concurrent Acquires loses no request. Guests are built by the project's
//! Wasm build step (`latchkey_tests::hooks::hook_wasm`).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use latchkey_hook_host::FailureKind;
use latchkey_proto::lockv1::{AcquireRequest, Grant, InspectRequest, WaitMode};
use latchkey_tests::etcd::EtcdServer;
use latchkey_tests::eventually;
use latchkey_tests::hooks::{HookedArbiter, dev_policies_copy, hook_wasm};
use tonic::{Code, Status};
use tonic_types::StatusExt;

use crate::support::{Client, open, release};

async fn hooked(policies: &Path) -> anyhow::Result<(EtcdServer, HookedArbiter)> {
    latchkey_tests::init_tracing();
    latchkey_tests::write_pause_test_fixtures(policies)?;
    let etcd = EtcdServer::start().await?;
    let arbiter = HookedArbiter::start(&etcd, policies).await?;
    Ok((etcd, arbiter))
}

async fn acquire(
    c: &mut Client,
    key: &str,
    class: &str,
    session: i64,
    metadata: &[(&str, &str)],
) -> Result<Grant, Status> {
    let resp = c
        .acquire(AcquireRequest {
            key: key.into(),
            class: class.into(),
            session_id: session,
            wait: WaitMode::WaitNone.into(),
            metadata: metadata
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>(),
            instance: String::new(),
            mode: 0,
            downgrade_from: None,
        })
        .await?;
    resp.into_inner()
        .grant
        .ok_or_else(|| Status::internal("no grant in an OK response"))
}

/// (code, ErrorInfo reason, hookReason) of a refusal.
fn hook_refusal<T: std::fmt::Debug>(
    r: Result<T, Status>,
) -> anyhow::Result<(Code, String, String, String)> {
    match r {
        Ok(v) => anyhow::bail!("expected a hook denial, got OK {v:?}"),
        Err(s) => {
            let details = s.get_error_details();
            let info = details.error_info();
            let reason = info.map(|i| i.reason.clone()).unwrap_or_default();
            let hook_reason = info
                .and_then(|i| i.metadata.get("hookReason").cloned())
                .unwrap_or_default();
            Ok((s.code(), reason, hook_reason, s.message().to_string()))
        }
    }
}

/// A class file with one hooked class (fenced: `hooked` writes its pause-test fixture).
fn class(name: &str, module: &Path, hook_extra: &str) -> String {
    format!(
        "[[class]]\nname = \"{name}\"\ntier = \"coord\"\nenforcement = \"fenced\"\n\
         [class.pauseTest]\nresource = \"postgresql:test.{name}\"\nresult = \"pause-tests/{name}.json\"\n\
         [class.hook]\nmodule = \"{}\"\n{hook_extra}\n",
        module.display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn change_ticket_denies_without_a_ticket_and_annotates_the_holder_with_it()
-> anyhow::Result<()> {
    let dir = dev_policies_copy()?;
    let (_etcd, a) = hooked(dir.path()).await?;
    let mut alice = a.lock("workload/alice").await?;
    let s = open(&mut alice, "ticketed").await?;

    let (code, reason, hook_reason, message) =
        hook_refusal(acquire(&mut alice, "demo/db", "ticketed", s, &[]).await)?;
    assert_eq!(
        (code, reason.as_str(), hook_reason.as_str()),
        (Code::PermissionDenied, "HOOK_DENIED", "TICKET_MISSING")
    );
    assert!(
        message.contains("ticket=<ticket>"),
        "the message says what is missing: {message}"
    );
    let (_, _, hook_reason, _) = hook_refusal(
        acquire(
            &mut alice,
            "demo/db",
            "ticketed",
            s,
            &[("ticket", "JIRA-1")],
        )
        .await,
    )?;
    assert_eq!(hook_reason, "TICKET_MALFORMED");
    // Nothing was written by the denials.
    let held = alice
        .inspect(InspectRequest {
            key: "demo/db".into(),
        })
        .await?
        .into_inner();
    assert!(held.holder.is_none());

    let g = acquire(
        &mut alice,
        "demo/db",
        "ticketed",
        s,
        &[("ticket", "CHG-20417")],
    )
    .await?;
    let held = alice
        .inspect(InspectRequest {
            key: "demo/db".into(),
        })
        .await?
        .into_inner();
    let holder = held.holder.ok_or_else(|| anyhow::anyhow!("no holder"))?;
    assert_eq!(
        holder.annotations.get("ticket").map(String::as_str),
        Some("CHG-20417")
    );
    release(&mut alice, &g).await?;

    // A class without a hook is untouched by it.
    let sd = open(&mut alice, "demo").await?;
    let g = acquire(&mut alice, "demo/db", "demo", sd, &[]).await?;
    release(&mut alice, &g).await?;

    let m = a
        .hooks()
        .metrics()
        .class("ticketed")
        .ok_or_else(|| anyhow::anyhow!("no metrics"))?;
    assert_eq!((m.invocations, m.allowed), (3, 1));
    assert_eq!(m.denials.get("TICKET_MISSING"), Some(&1));
    assert_eq!(m.failures_total(), 0);
    Ok(())
}

/// "HH:MM" of now + `minutes` (UTC, wrapping at midnight).
fn hhmm(minutes: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let m = (now / 60 + minutes).rem_euclid(24 * 60);
    format!("{:02}:{:02}", m / 60, m % 60)
}

#[tokio::test(flavor = "multi_thread")]
async fn maintenance_window_allows_inside_and_denies_outside_with_the_next_opening()
-> anyhow::Result<()> {
    let module = hook_wasm("latchkey-hook-maintenance-window")?;
    let dir = dev_policies_copy()?;
    let window = |start: &str, end: &str| {
        format!("[[class.hook.config.windows]]\nstart = \"{start}\"\nend = \"{end}\"")
    };
    // Read the clock once: the assertion below names the same minute even if
    // the test runs across a minute boundary.
    let closed_opens = hhmm(120);
    std::fs::write(
        dir.path().join("classes/windows.toml"),
        class("open-now", &module, &window(&hhmm(-60), &hhmm(60)))
            + &class("closed-now", &module, &window(&closed_opens, &hhmm(180))),
    )?;
    let (_etcd, a) = hooked(dir.path()).await?;
    let mut alice = a.lock("workload/alice").await?;
    let s = open(&mut alice, "open-now").await?;
    let g = acquire(&mut alice, "demo/failover", "open-now", s, &[]).await?;
    release(&mut alice, &g).await?;
    let s = open(&mut alice, "closed-now").await?;
    let (code, _, hook_reason, message) =
        hook_refusal(acquire(&mut alice, "demo/failover", "closed-now", s, &[]).await)?;
    assert_eq!(
        (code, hook_reason.as_str()),
        (Code::FailedPrecondition, "OUTSIDE_WINDOW")
    );
    assert!(
        message.contains("next window opens") && message.contains(&closed_opens),
        "{message}"
    );
    // The dev class (weekend 02:00-04:00) answers one way or the other, never fails.
    let s = open(&mut alice, "windowed").await?;
    match acquire(&mut alice, "demo/drill", "windowed", s, &[]).await {
        Ok(g) => release(&mut alice, &g).await?,
        Err(e) => assert_eq!(hook_refusal::<()>(Err(e))?.2, "OUTSIDE_WINDOW"),
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_looping_hook_is_cut_off_and_denied_while_other_classes_are_served() -> anyhow::Result<()>
{
    let misbehave = hook_wasm("latchkey-hook-misbehave")?;
    let dir = dev_policies_copy()?;
    std::fs::write(
        dir.path().join("classes/bad.toml"),
        class(
            "spin",
            &misbehave,
            "deadlineMs = 1\n[class.hook.config]\nbehavior = \"loop\"",
        ) + &class(
            "bomb",
            &misbehave,
            "memoryMib = 8\ndeadlineMs = 20\n[class.hook.config]\nbehavior = \"bomb\"",
        ),
    )?;
    let (_etcd, a) = hooked(dir.path()).await?;
    let mut alice = a.lock("workload/alice").await?;
    let s = open(&mut alice, "spin").await?;
    let started = Instant::now();
    let (code, _, hook_reason, message) =
        hook_refusal(acquire(&mut alice, "demo/x", "spin", s, &[]).await)?;
    let took = started.elapsed();
    assert_eq!(
        (code, hook_reason.as_str()),
        (Code::FailedPrecondition, "HOOK_TIMEOUT")
    );
    assert!(
        message.contains("\"spin\"") && message.contains("deadline"),
        "{message}"
    );
    assert!(
        took < Duration::from_millis(500),
        "the denial took {took:?}"
    );
    let m = a
        .hooks()
        .metrics()
        .class("spin")
        .ok_or_else(|| anyhow::anyhow!("no metrics"))?;
    assert_eq!(m.failures.get(&FailureKind::Timeout), Some(&1));
    assert!(
        m.latency(1.0) < Duration::from_millis(20),
        "cut off late: {:?}",
        m.latency(1.0)
    );

    // The next requests, of other classes (hooked or not), are served.
    let st = open(&mut alice, "ticketed").await?;
    let g = acquire(
        &mut alice,
        "demo/x",
        "ticketed",
        st,
        &[("ticket", "CHG-1234")],
    )
    .await?;
    release(&mut alice, &g).await?;
    let sd = open(&mut alice, "demo").await?;
    let g = acquire(&mut alice, "demo/x", "demo", sd, &[]).await?;
    release(&mut alice, &g).await?;

    // The memory bomb hits its cap.
    let sb = open(&mut alice, "bomb").await?;
    let (code, _, hook_reason, message) =
        hook_refusal(acquire(&mut alice, "demo/y", "bomb", sb, &[]).await)?;
    assert_eq!(
        (code, hook_reason.as_str()),
        (Code::FailedPrecondition, "HOOK_OUT_OF_MEMORY")
    );
    assert!(message.contains("8 MiB cap"), "{message}");
    let m = a
        .hooks()
        .metrics()
        .class("bomb")
        .ok_or_else(|| anyhow::anyhow!("no metrics"))?;
    assert_eq!(m.failures.get(&FailureKind::OutOfMemory), Some(&1));
    let held = alice
        .inspect(InspectRequest {
            key: "demo/y".into(),
        })
        .await?
        .into_inner();
    assert!(held.holder.is_none(), "a failed hook grants nothing");
    Ok(())
}

/// Writes `bytes` to `path` by rename, as a deploy would.
fn replace(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_modules_are_refused_at_load_and_the_previous_one_stays_in_service()
-> anyhow::Result<()> {
    let ticket = std::fs::read(hook_wasm("latchkey-hook-change-ticket")?)?;
    let dir = dev_policies_copy()?;
    let module = dir.path().join("reloadable.wasm");
    std::fs::write(&module, &ticket)?;
    std::fs::write(
        dir.path().join("classes/reloadable.toml"),
        class(
            "reloadable",
            &module,
            "[class.hook.config]\npattern = \"^CHG-[0-9]+$\"",
        ),
    )?;
    let (_etcd, a) = hooked(dir.path()).await?;
    let good = a
        .hooks()
        .loaded_digest("reloadable")
        .ok_or_else(|| anyhow::anyhow!("not loaded"))?;
    let mut alice = a.lock("workload/alice").await?;
    let s = open(&mut alice, "reloadable").await?;

    // A Wasm module with none of the ABI exports (the empty module).
    replace(&module, b"\0asm\x01\0\0\0")?;
    let why = eventually(
        "the refusal of the module without exports",
        Duration::from_secs(10),
        || async {
            match a.hooks().refusals().get("reloadable") {
                Some(r) if r.reason.contains("lacks the hook ABI v1 export") => Ok(r.to_string()),
                other => anyhow::bail!("not yet: {other:?}"),
            }
        },
    )
    .await?;
    assert!(why.contains("class \"reloadable\""), "{why}");
    assert_eq!(
        a.hooks().loaded_digest("reloadable").as_deref(),
        Some(good.as_str())
    );
    let g = acquire(
        &mut alice,
        "demo/r",
        "reloadable",
        s,
        &[("ticket", "CHG-1")],
    )
    .await?;
    release(&mut alice, &g).await?;

    // Not Wasm at all.
    replace(&module, b"#!/bin/sh\nrm -rf /\n")?;
    eventually(
        "the refusal of the non-Wasm file",
        Duration::from_secs(10),
        || async {
            match a.hooks().refusals().get("reloadable") {
                Some(r) if r.reason.contains("not a valid Wasm module") => Ok(()),
                other => anyhow::bail!("not yet: {other:?}"),
            }
        },
    )
    .await?;
    let (_, _, hook_reason, _) =
        hook_refusal(acquire(&mut alice, "demo/r", "reloadable", s, &[]).await)?;
    assert_eq!(
        hook_reason, "TICKET_MISSING",
        "the previous module still answers"
    );
    let g = acquire(
        &mut alice,
        "demo/r",
        "reloadable",
        s,
        &[("ticket", "CHG-2")],
    )
    .await?;
    release(&mut alice, &g).await?;

    // The good module again: loaded, refusal cleared.
    replace(&module, &ticket)?;
    eventually("the refusal to clear", Duration::from_secs(10), || async {
        anyhow::ensure!(
            a.hooks().refusals().is_empty(),
            "{:?}",
            a.hooks().refusals()
        );
        Ok(())
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hot_reload_under_concurrent_acquires_loses_no_request() -> anyhow::Result<()> {
    let ticket = std::fs::read(hook_wasm("latchkey-hook-change-ticket")?)?;
    let allow = std::fs::read(hook_wasm("latchkey-hook-misbehave")?)?;
    let dir = dev_policies_copy()?;
    let module = dir.path().join("live.wasm");
    std::fs::write(&module, &ticket)?;
    let class_file = dir.path().join("classes/live.toml");
    // The deadline is wall-clock time (epoch interruption): with Cranelift
    // compiling the swapped modules on this 2-core machine, a 1 ms hook call
    // can be preempted past 1 ms. This test is about swaps, not deadlines, so
    // it takes the platform's longest (MAX_HOOK_DEADLINE_MS).
    const LIVE: &str = "deadlineMs = 50\n";
    std::fs::write(
        &class_file,
        class(
            "live",
            &module,
            &format!("{LIVE}[class.hook.config]\npattern = \"^CHG-[0-9]+$\""),
        ),
    )?;
    let (_etcd, a) = hooked(dir.path()).await?;
    let first = a
        .hooks()
        .loaded_digest("live")
        .ok_or_else(|| anyhow::anyhow!("not loaded"))?;

    let stop = tokio_util::sync::CancellationToken::new();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut workers = Vec::new();
    for w in 0..4 {
        let mut c = a
            .lock(if w % 2 == 0 {
                "workload/alice"
            } else {
                "workload/bob"
            })
            .await?;
        let (stop, done) = (stop.clone(), done.clone());
        workers.push(tokio::spawn(async move {
            let s = open(&mut c, "live").await?;
            let (mut ok, key) = (0u32, format!("shared/live-{w}"));
            while !stop.is_cancelled() {
                // Both modules allow this request: the ticket hook (a valid
                // ticket) and the allow-everything one.
                let g = acquire(&mut c, &key, "live", s, &[("ticket", "CHG-77")])
                    .await
                    .map_err(|e| {
                        anyhow::anyhow!("request {ok} of worker {w} failed during reload: {e}")
                    })?;
                release(&mut c, &g).await?;
                ok += 1;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            anyhow::Ok(ok)
        }));
    }
    // Swap modules and the class's config back and forth under load.
    let mut swaps = 0;
    for round in 0..6 {
        let (bytes, config) = if round % 2 == 0 {
            (&allow, "[class.hook.config]\nbehavior = \"allow\"")
        } else {
            (&ticket, "[class.hook.config]\npattern = \"^CHG-[0-9]+$\"")
        };
        let tmp = class_file.with_extension("tmp");
        replace(&module, bytes)?;
        std::fs::write(&tmp, class("live", &module, &format!("{LIVE}{config}")))?;
        std::fs::rename(&tmp, &class_file)?;
        let want = latchkey_hook_host::cache::digest(bytes);
        eventually("the swap", Duration::from_secs(15), || async {
            anyhow::ensure!(
                a.hooks().loaded_digest("live").as_deref() == Some(want.as_str()),
                "old module"
            );
            Ok(())
        })
        .await?;
        // Requests run on each module before the next swap, however slow the
        // machine is today: 8 more than now, of which at most 4 were in
        // flight on the old module.
        let before = done.load(std::sync::atomic::Ordering::Relaxed);
        let progressed = eventually(
            "requests on the new module",
            Duration::from_secs(15),
            || {
                let now = done.load(std::sync::atomic::Ordering::Relaxed);
                let stopped = workers.iter().any(tokio::task::JoinHandle::is_finished);
                async move {
                    anyhow::ensure!(!stopped, "a worker stopped");
                    anyhow::ensure!(now >= before + 8, "{} since the swap", now - before);
                    Ok(())
                }
            },
        )
        .await;
        if let Err(e) = progressed {
            // A worker's own error says more than the stall does.
            stop.cancel();
            for w in workers {
                w.await??;
            }
            return Err(e);
        }
        swaps += 1;
    }
    stop.cancel();
    let mut total = 0;
    for w in workers {
        total += w.await??;
    }
    assert_eq!(swaps, 6);
    assert!(total >= 48, "only {total} requests ran during the reloads");
    assert!(a.hooks().refusals().is_empty());
    let m = a
        .hooks()
        .metrics()
        .class("live")
        .ok_or_else(|| anyhow::anyhow!("no metrics"))?;
    assert_eq!(m.failures_total(), 0, "{:?}", m.failures);
    assert_eq!(m.denials_total(), 0, "{:?}", m.denials);
    // Six swaps end where they started, on the ticket module.
    assert_eq!(a.hooks().loaded_digest("live"), Some(first));
    Ok(())
}

/// A hook that lists `"mode"` in its inputs is told each Acquire's mode:
/// the misbehave fixture's
/// `exclusive-only` refuses shared acquires — a session's downgrade of its
/// exclusive hold among them, which leaves that hold as it was — and
/// allows exclusive ones. A class that does not ask sees no mode (a hook
/// built before the field existed would refuse it).
#[tokio::test(flavor = "multi_thread")]
async fn a_hook_that_asks_for_the_mode_refuses_shared_acquires_only() -> anyhow::Result<()> {
    use latchkey_proto::lockv1::Mode;

    let misbehave = hook_wasm("latchkey-hook-misbehave")?;
    let dir = dev_policies_copy()?;
    std::fs::write(
        dir.path().join("classes/modes.toml"),
        class(
            "writers-only",
            &misbehave,
            "inputs = [\"mode\"]\n[class.hook.config]\nbehavior = \"exclusive-only\"",
        ) + &class(
            "blind",
            &misbehave,
            "[class.hook.config]\nbehavior = \"show-mode\"",
        ),
    )?;
    let (_etcd, a) = hooked(dir.path()).await?;
    let mut alice = a.lock("workload/alice").await?;
    let annotations = |c: &mut Client, key: &'static str| {
        let mut c = c.clone();
        async move {
            let seen = c
                .inspect(InspectRequest { key: key.into() })
                .await?
                .into_inner();
            let holder = seen
                .holder
                .or_else(|| seen.shared_holders.into_iter().next())
                .ok_or_else(|| anyhow::anyhow!("{key} is not held"))?;
            Ok::<_, anyhow::Error>(holder.annotations)
        }
    };
    let mode = |a: &HashMap<String, String>| a.get("mode").cloned().unwrap_or_default();

    let s = open(&mut alice, "writers-only").await?;
    let shared = |c: &mut Client, key: &str, session: i64| {
        let mut c = c.clone();
        let key = key.to_string();
        async move {
            latchkey_tests::lock_calls::acquire_in_mode(
                &mut c,
                &key,
                "writers-only",
                session,
                "",
                None,
                Mode::Shared.into(),
            )
            .await
        }
    };
    let (code, reason, hook_reason, message) =
        hook_refusal(shared(&mut alice, "demo/modes", s).await)?;
    assert_eq!(
        (code, reason.as_str(), hook_reason.as_str()),
        (Code::PermissionDenied, "HOOK_DENIED", "SHARED_REFUSED")
    );
    assert!(message.contains("exclusive acquires only"), "{message}");
    let held = alice
        .inspect(InspectRequest {
            key: "demo/modes".into(),
        })
        .await?
        .into_inner();
    assert!(
        held.holder.is_none() && held.shared_holders.is_empty(),
        "a denied shared acquire wrote nothing: {held:?}"
    );

    let g = acquire(&mut alice, "demo/modes", "writers-only", s, &[]).await?;
    assert_eq!(g.mode, i32::from(Mode::Exclusive));
    assert_eq!(
        mode(&annotations(&mut alice, "demo/modes").await?),
        "exclusive"
    );
    // The session's downgrade is a shared Acquire too: refused, and the
    // exclusive hold stays exactly as it was.
    let (_, _, hook_reason, _) = hook_refusal(shared(&mut alice, "demo/modes", s).await)?;
    assert_eq!(hook_reason, "SHARED_REFUSED");
    let held = alice
        .inspect(InspectRequest {
            key: "demo/modes".into(),
        })
        .await?
        .into_inner();
    assert!(
        held.holder.is_some() && held.shared_holders.is_empty(),
        "the refused downgrade left the exclusive hold: {held:?}"
    );
    release(&mut alice, &g).await?;

    // Not asked for: the hook sees no mode, whichever was asked.
    let sb = open(&mut alice, "blind").await?;
    let g = latchkey_tests::lock_calls::acquire_in_mode(
        &mut alice,
        "demo/blind",
        "blind",
        sb,
        "",
        None,
        Mode::Shared.into(),
    )
    .await?;
    assert_eq!(
        mode(&annotations(&mut alice, "demo/blind").await?),
        "absent"
    );
    release(&mut alice, &g).await?;

    Ok(())
}
