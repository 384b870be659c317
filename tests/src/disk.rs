//! Disk latency for the nemesis: a directory served through our own FUSE
//! passthrough (`fsync-delay-fs`, src/bin) that delays only durability
//! barriers — `fsync`, `fdatasync` and a directory's fsync — while lookups,
//! reads and writes go straight through.
//!
//! The kernel on this machine kind has no device-mapper (no `delay` target;
//! `dmsetup version` finds no driver and there are no modules to load), but
//! it has `/dev/fuse`. The mount has no writeback cache, so a write on it is
//! a write of the backing file, and an fsync on it is an fsync of the
//! backing file, held back by the delay in a control file the daemon reads
//! at every barrier. That is the slow disk ADR-23 asks for: etcd's WAL
//! `fdatasync`, bbolt's commit and the arbiter's high-water mark wait, while
//! reads (bbolt's mmap among them) and buffered writes do not.
//!
//! Mounts do not outlive their owner: the daemon unmounts and exits as soon
//! as its parent (the process that called [`StallableDir::mount`]) dies, and
//! [`remove_stale_mounts`] (run before the first mount of a process, and by
//! the etcd harness's leftover sweep) unmounts any whose daemon is gone or
//! orphaned, e.g. after both were SIGKILLed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

/// The passthrough daemon (tests/src/bin/fsync-delay-fs.rs).
pub const DAEMON: &str = "fsync-delay-fs";
/// The source of every mount the daemon makes: `PREFIX:<daemon pid>:<owner pid>`.
const SOURCE_PREFIX: &str = "latchkey-fsync-delay:";

/// `mountpoint` showing `backing` through `fsync-delay-fs`; unmounted on drop.
#[derive(Debug)]
pub struct StallableDir {
    mountpoint: PathBuf,
    /// The delay of every fsync on the mount, in milliseconds (outside the mount).
    control: PathBuf,
    /// The daemon's counts (`delayed N`, `synced M`), updated at each delayed fsync.
    stats: PathBuf,
    daemon: Child,
}

impl StallableDir {
    /// Mounts `backing` (created if missing) on `mountpoint` (likewise) and
    /// waits until the mount is there; fsyncs are not delayed until
    /// [`Self::set_fsync_delay`].
    pub fn mount(backing: &Path, mountpoint: &Path) -> anyhow::Result<Self> {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(|| {
            for m in remove_stale_mounts() {
                tracing::warn!(mount = %m, "unmounted a stale fsync-delay mount");
            }
        });
        std::fs::create_dir_all(backing)?;
        std::fs::create_dir_all(mountpoint)?;
        let name = mountpoint
            .file_name()
            .context("a mountpoint without a name")?
            .to_string_lossy()
            .into_owned();
        let beside = |suffix: &str| mountpoint.with_file_name(format!(".{name}.{suffix}"));
        let control = beside("fsync-delay-ms");
        let stats = beside("fsync-stats");
        write_atomically(&control, "0\n")?;
        let binary = daemon_binary()?;
        let log = std::fs::File::create(beside("fsync-delay-fs.log"))?;
        let daemon = Command::new(&binary)
            .arg("--backing")
            .arg(backing)
            .arg("--mountpoint")
            .arg(mountpoint)
            .arg("--delay-file")
            .arg(&control)
            .arg("--stats-file")
            .arg(&stats)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut dir = Self {
            mountpoint: mountpoint.to_path_buf(),
            control,
            stats,
            daemon,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !is_mounted(mountpoint)? {
            if let Some(status) = dir.daemon.try_wait()? {
                bail!(
                    "{DAEMON} exited ({status}) before mounting {} (needs root and /dev/fuse; \
                     its stderr is in {})",
                    mountpoint.display(),
                    mountpoint
                        .with_file_name(format!(".{name}.fsync-delay-fs.log"))
                        .display()
                );
            }
            if std::time::Instant::now() > deadline {
                bail!("{} was not mounted within 10 s", mountpoint.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(dir)
    }

    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The daemon's pid.
    pub fn daemon_pid(&self) -> u32 {
        self.daemon.id()
    }

    /// Every fsync, fdatasync or directory fsync that starts from now on
    /// takes `d` longer (zero: none). The file is replaced atomically, so
    /// the daemon never reads half of it.
    pub fn set_fsync_delay(&self, d: Duration) -> anyhow::Result<()> {
        write_atomically(&self.control, &format!("{}\n", d.as_millis()))
    }

    /// How many fsyncs the daemon has delayed so far.
    pub fn fsyncs_delayed(&self) -> u64 {
        std::fs::read_to_string(&self.stats)
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("delayed ")?.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Makes the disk's fsyncs slow again and again for about `total`:
    /// periods with every fsync delayed by a value uniform in `delay` (each
    /// period as long as its delay), with short runs of normal service
    /// (20–200 ms) between them. The number of fsyncs delayed.
    pub async fn slow_for(
        &self,
        total: Duration,
        delay: (Duration, Duration),
        rng: &mut fastrand::Rng,
    ) -> anyhow::Result<u64> {
        let before = self.fsyncs_delayed();
        let end = tokio::time::Instant::now() + total;
        let result = async {
            while tokio::time::Instant::now() < end {
                let d = rng
                    .u64(u64::try_from(delay.0.as_millis())?..=u64::try_from(delay.1.as_millis())?);
                self.set_fsync_delay(Duration::from_millis(d))?;
                tokio::time::sleep(Duration::from_millis(d)).await;
                self.set_fsync_delay(Duration::ZERO)?;
                tokio::time::sleep(Duration::from_millis(rng.u64(20..200))).await;
            }
            anyhow::Ok(())
        }
        .await;
        self.set_fsync_delay(Duration::ZERO)?;
        result?;
        // A barrier that arrived just before the last reset is counted when
        // it arrives, so this is already complete.
        Ok(self.fsyncs_delayed().saturating_sub(before))
    }
}

impl Drop for StallableDir {
    fn drop(&mut self) {
        let _ = self.set_fsync_delay(Duration::ZERO);
        // Lazy unmount: a process that still has a file open there (a
        // member being killed) does not keep the mount.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mountpoint)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// The daemon: `LATCHKEY_FSYNC_DELAY_FS`, else beside the running
/// executable (`latchkey-gate`), else one level up (an integration test runs
/// from `target/<profile>/deps`; cargo builds this package's binaries before
/// its tests, and the gate's tests build it with [`crate::workspace_bins`]).
pub fn daemon_binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("LATCHKEY_FSYNC_DELAY_FS") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable without a directory")?;
    let candidates = [Some(dir.join(DAEMON)), dir.parent().map(|d| d.join(DAEMON))];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
        .with_context(|| {
            format!(
                "{DAEMON} not found beside {} (cargo build -p latchkey-tests --bin {DAEMON}, \
                 or set LATCHKEY_FSYNC_DELAY_FS)",
                exe.display()
            )
        })
}

/// Whether `path` is a mount point (listed in /proc/self/mountinfo). Only
/// its parent is resolved: a mount whose daemon died cannot be stat'ed.
pub fn is_mounted(path: &Path) -> anyhow::Result<bool> {
    let parent = path
        .parent()
        .context("a mountpoint without a parent")?
        .canonicalize()?;
    let path = parent.join(path.file_name().context("a mountpoint without a name")?);
    let wanted = path.to_string_lossy();
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| unescape(m) == wanted))
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && let Some(octal) = field.get(i + 1..i + 4)
            && let Ok(b) = u8::from_str_radix(octal, 8)
        {
            out.push(b);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A FUSE mount left behind by an earlier run.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FuseMount {
    mountpoint: String,
    source: String,
}

/// The FUSE mounts in `mountinfo` (fields: ... mountpoint ... `-` fstype source ...).
fn fuse_mounts(mountinfo: &str) -> Vec<FuseMount> {
    mountinfo
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            let dash = fields.iter().position(|f| *f == "-")?;
            let fstype = fields.get(dash + 1)?;
            if *fstype != "fuse" && !fstype.starts_with("fuse.") {
                return None;
            }
            Some(FuseMount {
                mountpoint: unescape(fields.get(4)?),
                source: unescape(fields.get(dash + 2)?),
            })
        })
        .collect()
}

/// `pid`'s parent, if `pid` is a live process (not a zombie).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    let mut after = stat.rsplit_once(')')?.1.split_whitespace();
    let state = after.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    after.next()?.parse().ok()
}

/// Whether `m` is a mount of ours nobody serves for a live owner any more.
fn is_stale(m: &FuseMount) -> bool {
    if let Some(ids) = m.source.strip_prefix(SOURCE_PREFIX) {
        // fsync-delay-fs: stale unless its daemon is alive and still the
        // child of the process that mounted it.
        let mut ids = ids.split(':').map(str::parse::<u32>);
        let (Some(Ok(daemon)), Some(Ok(owner))) = (ids.next(), ids.next()) else {
            return false;
        };
        return parent_of(daemon) != Some(owner);
    }
    // The bindfs mounts of earlier gate versions, under the harness's temp
    // dirs: stale when nothing answers on them (their daemon died) or their
    // daemon was orphaned (its gate was SIGKILLed).
    let tmp = std::env::temp_dir();
    let ours = Path::new(&m.mountpoint)
        .strip_prefix(&tmp)
        .ok()
        .and_then(|rest| rest.components().next())
        .is_some_and(|first| {
            let first = first.as_os_str().to_string_lossy();
            first.starts_with("latchkey-gate-") || first.starts_with("latchkey-cluster-")
        });
    if !ours {
        return false;
    }
    if let Err(e) = std::fs::metadata(&m.mountpoint)
        && e.raw_os_error() == Some(107)
    {
        // ENOTCONN: the daemon is gone.
        return true;
    }
    bindfs_daemon_of(&m.mountpoint).is_none_or(|pid| parent_of(pid).is_none_or(|p| p == 1))
}

/// The pid of the `bindfs` whose command line ends with `mountpoint`.
fn bindfs_daemon_of(mountpoint: &str) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_bindfs = args
            .first()
            .is_some_and(|a| Path::new(a).file_name().is_some_and(|n| n == "bindfs"));
        (is_bindfs && args.last().is_some_and(|a| a == mountpoint)).then_some(pid)
    })
}

/// Unmounts (lazily) every FUSE mount an earlier run left behind: an
/// `fsync-delay-fs` mount whose daemon is dead or whose owner died, or an
/// older run's `bindfs` mount under the harness's temp dirs nobody serves
/// for a live gate. Another run's live mounts are left alone. Best effort;
/// the mountpoints unmounted.
pub fn remove_stale_mounts() -> Vec<String> {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for m in fuse_mounts(&info) {
        if !is_stale(&m) {
            continue;
        }
        let unmounted = Command::new("umount")
            .arg("-l")
            .arg(&m.mountpoint)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if unmounted {
            removed.push(m.mountpoint);
        }
    }
    removed
}

/// Whether this machine can run the slow-disk faults: `/dev/fuse` and the
/// daemon.
pub fn available() -> bool {
    Path::new("/dev/fuse").exists() && daemon_binary().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_give_fuse_mounts_with_escapes_undone() {
        let info = "36 25 0:32 / /tmp/a\\040b rw,nosuid - fuse latchkey-fsync-delay:12:7 rw\n\
                    37 25 0:33 / /proc rw - proc proc rw\n\
                    38 25 0:34 / /tmp/latchkey-gate-x/arbiter-0 rw shared:1 - fuse /tmp/latchkey-gate-x/arbiter-0.disk rw\n";
        assert_eq!(
            fuse_mounts(info),
            vec![
                FuseMount {
                    mountpoint: "/tmp/a b".into(),
                    source: "latchkey-fsync-delay:12:7".into()
                },
                FuseMount {
                    mountpoint: "/tmp/latchkey-gate-x/arbiter-0".into(),
                    source: "/tmp/latchkey-gate-x/arbiter-0.disk".into()
                },
            ]
        );
    }

    #[test]
    fn a_mount_whose_daemon_is_not_its_owners_child_is_stale() {
        let me = std::process::id();
        let parent = parent_of(me).expect("this process has a parent");
        let live = FuseMount {
            mountpoint: "/nowhere".into(),
            source: format!("{SOURCE_PREFIX}{me}:{parent}"),
        };
        assert!(!is_stale(&live));
        let orphaned = FuseMount {
            source: format!("{SOURCE_PREFIX}{me}:{}", parent + 1),
            ..live.clone()
        };
        assert!(is_stale(&orphaned));
        let unparsable = FuseMount {
            source: format!("{SOURCE_PREFIX}x"),
            ..live
        };
        assert!(!is_stale(&unparsable));
    }
}
