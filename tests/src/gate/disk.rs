//! Disk latency for the nemesis: a directory served through a FUSE
//! passthrough (`bindfs`) whose daemon the nemesis can stall.
//!
//! The kernel on this machine kind has no device-mapper (no `delay` target;
//! `dmsetup version` finds no driver and there are no modules to load), but
//! it has `/dev/fuse`. Every write and fsync on a FUSE mount is a request to
//! the daemon (no writeback cache), so a SIGSTOPped daemon is a disk whose
//! writes and fsyncs hang until SIGCONT; reads already in the page cache
//! (bbolt's mmap) still answer. That is the slow disk ADR-23 asks for:
//! stalls of a few hundred milliseconds, one after another.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The FUSE passthrough the gate uses; scripts/setup installs it.
pub const BINDFS: &str = "bindfs";

/// `mountpoint` showing `backing` through a FUSE daemon; unmounted on drop.
#[derive(Debug)]
pub struct StallableDir {
    mountpoint: PathBuf,
    daemon: Child,
}

impl StallableDir {
    /// Mounts `backing` (created if missing) on `mountpoint` (likewise) and
    /// waits until the mount is there.
    pub fn mount(backing: &Path, mountpoint: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(backing)?;
        std::fs::create_dir_all(mountpoint)?;
        // -f: stay in the foreground, so the daemon is our child and its pid
        // the one to stall.
        let daemon = Command::new(BINDFS)
            .args(["-f", "--no-allow-other"])
            .arg(backing)
            .arg(mountpoint)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                format!("starting {BINDFS} (the FUSE passthrough for disk stalls; scripts/setup installs it)")
            })?;
        let mut dir = Self {
            mountpoint: mountpoint.to_path_buf(),
            daemon,
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !is_mounted(mountpoint)? {
            if let Some(status) = dir.daemon.try_wait()? {
                bail!(
                    "{BINDFS} exited ({status}) before mounting {} (needs root and /dev/fuse)",
                    mountpoint.display()
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

    /// Stalls every write and fsync on the mount for `d`.
    pub async fn stall(&self, d: Duration) -> anyhow::Result<()> {
        self.stop()?;
        tokio::time::sleep(d).await;
        self.resume()
    }

    /// Stops serving the mount (writes and fsyncs block) until [`Self::resume`].
    pub fn stop(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGSTOP)
    }

    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal(Signal::SIGCONT)
    }

    fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        kill(Pid::from_raw(i32::try_from(self.daemon.id())?), signal)?;
        Ok(())
    }

    /// Stalls the disk again and again for about `total`: stalls uniform in
    /// `stall`, with short runs of normal service (20–200 ms) between them.
    pub async fn slow_for(
        &self,
        total: Duration,
        stall: (Duration, Duration),
        rng: &mut fastrand::Rng,
    ) -> anyhow::Result<usize> {
        let end = tokio::time::Instant::now() + total;
        let mut stalls = 0;
        while tokio::time::Instant::now() < end {
            let d =
                rng.u64(u64::try_from(stall.0.as_millis())?..=u64::try_from(stall.1.as_millis())?);
            self.stall(Duration::from_millis(d)).await?;
            stalls += 1;
            tokio::time::sleep(Duration::from_millis(rng.u64(20..200))).await;
        }
        Ok(stalls)
    }
}

impl Drop for StallableDir {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.daemon.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
        }
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

/// Whether `path` is a mount point (listed in /proc/self/mountinfo).
fn is_mounted(path: &Path) -> anyhow::Result<bool> {
    let path = path.canonicalize()?;
    let wanted = path.to_string_lossy();
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(info
        .lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| m == wanted)))
}

/// Whether this machine can run the disk-stall fault: `bindfs` on PATH and
/// `/dev/fuse` present.
pub fn available() -> bool {
    Path::new("/dev/fuse").exists()
        && Command::new(BINDFS)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}
