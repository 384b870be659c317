//! `fsync-delay-fs`: a FUSE passthrough that serves a backing directory on a
//! mountpoint and delays only durability barriers: `fsync`, `fdatasync` and
//! the fsync of a directory. Lookups, reads, writes, renames and everything
//! else go straight through, so a process on the mount sees a disk whose
//! flushes are slow while its writes are not (the release gate's slow-disk
//! faults, ADR-23; see `latchkey_tests::disk`).
//!
//! The delay, in milliseconds, is read from `--delay-file` at every barrier
//! (missing or unparsable: no delay), so the nemesis changes it by replacing
//! that file. A delayed barrier is answered from its own thread: other
//! requests, and other barriers, go on meanwhile.
//!
//! The daemon serves the mount until it is unmounted; it also unmounts it
//! (lazily) and exits as soon as its parent dies, so a SIGKILLed gate run
//! does not leave mounts behind. The mount's source names the daemon and its
//! parent (`latchkey-fsync-delay:<pid>:<parent pid>`), which is how a later
//! run tells a stale mount from another run's live one.
//!
//! Inodes are held as `O_PATH` descriptors (as libfuse's `passthrough_ll`
//! does), so renames of directories, etcd's `wal.tmp` → `wal` among them,
//! need no path bookkeeping. No writeback cache: every write reaches the
//! backing file before it returns, and an fsync on the mount is an fsync of
//! the backing file. Locks are the kernel's own (the filesystem implements
//! none), which is what bbolt's and the WAL's `flock` need on one machine.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirEntryExt, FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use fuse_nix::fcntl::{AtFlags, FallocateFlags, OFlag, openat, readlinkat, renameat2};
use fuse_nix::sys::stat::{FileStat, Mode, fstat, mkdirat};
use fuse_nix::unistd::{UnlinkatFlags, linkat, symlinkat, unlinkat};
use fuser::{
    AccessFlags, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
    WriteFlags,
};
use parking_lot::Mutex;

/// The prefix of every mount's source (`/proc/self/mountinfo`).
const SOURCE_PREFIX: &str = "latchkey-fsync-delay";
/// How long the kernel may cache attributes and names. Everything that
/// changes the backing dir goes through this mount, so the kernel's own
/// cache stays right; short anyway.
const TTL: Duration = Duration::from_secs(1);

#[derive(Parser, Debug)]
#[command(about = "FUSE passthrough that delays only fsync")]
struct Args {
    /// The directory to serve.
    #[arg(long)]
    backing: PathBuf,
    /// Where to mount it (an existing directory).
    #[arg(long)]
    mountpoint: PathBuf,
    /// Holds the delay of every fsync, in milliseconds; read at each fsync.
    #[arg(long)]
    delay_file: PathBuf,
    /// Written after each delayed fsync: `delayed N`, `synced M`.
    #[arg(long)]
    stats_file: Option<PathBuf>,
    /// Threads reading requests from the kernel.
    #[arg(long, default_value_t = 4)]
    threads: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let parent = fuse_nix::unistd::getppid();
    if parent.as_raw() == 1 {
        anyhow::bail!("orphaned before mounting");
    }
    // Modes come from the request, minus the caller's umask, as given.
    fuse_nix::sys::stat::umask(Mode::empty());
    let root = open_path(&args.backing)?;
    let fs = PassthroughFs {
        state: Mutex::new(State::new(root)),
        delay_file: args.delay_file,
        stats_file: args.stats_file,
        stats: Stats::default(),
        stats_lock: Mutex::new(()),
    };
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(format!(
            "{SOURCE_PREFIX}:{}:{}",
            std::process::id(),
            parent.as_raw()
        )),
        MountOption::RW,
        MountOption::NoAtime,
    ];
    config.n_threads = Some(args.threads.max(1));
    config.clone_fd = true;
    let session = fuser::Session::new(fs, &args.mountpoint, &config)?;
    watch_parent(parent, args.mountpoint.clone());
    session.run()?;
    Ok(())
}

/// Unmounts `mountpoint` (lazily: open files keep what they have until
/// closed) and exits as soon as this process is reparented, i.e. its parent
/// died. Polled, not `PR_SET_PDEATHSIG`: that fires when the *thread* that
/// spawned us exits, and the gate spawns from tokio threads that come and go.
fn watch_parent(parent: fuse_nix::unistd::Pid, mountpoint: PathBuf) {
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(100));
            if fuse_nix::unistd::getppid() != parent {
                let _ =
                    fuse_nix::mount::umount2(&mountpoint, fuse_nix::mount::MntFlags::MNT_DETACH);
                std::process::exit(0);
            }
        }
    });
}

#[derive(Default)]
struct Stats {
    delayed: AtomicU64,
    synced: AtomicU64,
}

struct Node {
    /// `O_PATH` descriptor of the backing inode.
    fd: Arc<OwnedFd>,
    key: (u64, u64),
    lookups: u64,
}

enum Handle {
    File(Arc<File>),
    Dir {
        entries: Arc<Vec<(u64, FileType, OsString)>>,
        /// Opened for `fsyncdir`.
        dir: Arc<File>,
    },
}

struct State {
    nodes: HashMap<u64, Node>,
    by_key: HashMap<(u64, u64), u64>,
    next_ino: u64,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
}

impl State {
    fn new(root: OwnedFd) -> Self {
        let key = fstat(&root).map_or((0, 0), |s| key_of(&s));
        let mut nodes = HashMap::new();
        nodes.insert(
            INodeNo::ROOT.0,
            Node {
                fd: Arc::new(root),
                key,
                // Never forgotten.
                lookups: u64::MAX / 2,
            },
        );
        let mut by_key = HashMap::new();
        by_key.insert(key, INodeNo::ROOT.0);
        Self {
            nodes,
            by_key,
            next_ino: 2,
            handles: HashMap::new(),
            next_fh: 1,
        }
    }

    fn fd(&self, ino: INodeNo) -> Result<Arc<OwnedFd>, Errno> {
        self.nodes
            .get(&ino.0)
            .map(|n| Arc::clone(&n.fd))
            .ok_or(Errno::ESTALE)
    }

    /// Counts a lookup of the inode behind `fd`; its inode number.
    fn remember(&mut self, fd: OwnedFd, stat: &FileStat) -> u64 {
        let key = key_of(stat);
        if let Some(&ino) = self.by_key.get(&key)
            && let Some(node) = self.nodes.get_mut(&ino)
        {
            node.lookups += 1;
            return ino;
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(
            ino,
            Node {
                fd: Arc::new(fd),
                key,
                lookups: 1,
            },
        );
        self.by_key.insert(key, ino);
        ino
    }

    fn add_handle(&mut self, handle: Handle) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, handle);
        fh
    }

    fn file(&self, fh: FileHandle) -> Result<Arc<File>, Errno> {
        match self.handles.get(&fh.0) {
            Some(Handle::File(f)) => Ok(Arc::clone(f)),
            Some(Handle::Dir { dir, .. }) => Ok(Arc::clone(dir)),
            None => Err(Errno::EBADF),
        }
    }
}

struct PassthroughFs {
    state: Mutex<State>,
    delay_file: PathBuf,
    stats_file: Option<PathBuf>,
    stats: Stats,
    /// Serialises writes of `stats_file`.
    stats_lock: Mutex<()>,
}

fn key_of(s: &FileStat) -> (u64, u64) {
    (s.st_dev, s.st_ino)
}

fn errno(e: fuse_nix::Error) -> Errno {
    Errno::from_i32(e as i32)
}

fn open_path(path: &Path) -> anyhow::Result<OwnedFd> {
    Ok(fuse_nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?)
}

/// `/proc/self/fd/N`: opens (with real access modes) the inode an `O_PATH`
/// descriptor holds.
fn proc_path(fd: &OwnedFd) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    let nanos = u32::try_from(nsecs).unwrap_or(0);
    match u64::try_from(secs) {
        Ok(s) => UNIX_EPOCH + Duration::new(s, nanos),
        Err(_) => UNIX_EPOCH - Duration::new(secs.unsigned_abs(), 0) + Duration::new(0, nanos),
    }
}

fn kind_of(mode: u32) -> FileType {
    match mode & fuse_nix::libc::S_IFMT {
        fuse_nix::libc::S_IFDIR => FileType::Directory,
        fuse_nix::libc::S_IFLNK => FileType::Symlink,
        fuse_nix::libc::S_IFCHR => FileType::CharDevice,
        fuse_nix::libc::S_IFBLK => FileType::BlockDevice,
        fuse_nix::libc::S_IFIFO => FileType::NamedPipe,
        fuse_nix::libc::S_IFSOCK => FileType::Socket,
        _ => FileType::RegularFile,
    }
}

fn attr(ino: u64, s: &FileStat) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size: u64::try_from(s.st_size).unwrap_or(0),
        blocks: u64::try_from(s.st_blocks).unwrap_or(0),
        atime: time(s.st_atime, s.st_atime_nsec),
        mtime: time(s.st_mtime, s.st_mtime_nsec),
        ctime: time(s.st_ctime, s.st_ctime_nsec),
        crtime: UNIX_EPOCH,
        kind: kind_of(s.st_mode),
        perm: u16::try_from(s.st_mode & 0o7777).unwrap_or(0),
        nlink: u32::try_from(s.st_nlink).unwrap_or(u32::MAX),
        uid: s.st_uid,
        gid: s.st_gid,
        rdev: u32::try_from(s.st_rdev).unwrap_or(0),
        blksize: u32::try_from(s.st_blksize).unwrap_or(4096),
        flags: 0,
    }
}

impl PassthroughFs {
    fn parent_fd(&self, parent: INodeNo) -> Result<Arc<OwnedFd>, Errno> {
        self.state.lock().fd(parent)
    }

    /// Looks `name` up in `parent` and counts the lookup.
    fn do_lookup(&self, parent: INodeNo, name: &OsStr) -> Result<FileAttr, Errno> {
        let dir = self.parent_fd(parent)?;
        let fd = openat(
            dir.as_fd(),
            name,
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(errno)?;
        let stat = fstat(&fd).map_err(errno)?;
        let ino = self.state.lock().remember(fd, &stat);
        Ok(attr(ino, &stat))
    }

    fn do_getattr(&self, ino: INodeNo) -> Result<FileAttr, Errno> {
        let fd = self.state.lock().fd(ino)?;
        let stat = fstat(fd.as_fd()).map_err(errno)?;
        Ok(attr(ino.0, &stat))
    }

    /// The delay the control file asks for now.
    fn delay(&self) -> Duration {
        std::fs::read_to_string(&self.delay_file)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map_or(Duration::ZERO, Duration::from_millis)
    }

    /// Syncs `file` after the current delay; answers from its own thread
    /// when there is a delay, so other requests go on meanwhile.
    fn barrier(&self, file: Arc<File>, datasync: bool, reply: ReplyEmpty) {
        let delay = self.delay();
        let sync = move || {
            let result = if datasync {
                file.sync_data()
            } else {
                file.sync_all()
            };
            match result {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(e.into()),
            }
        };
        self.stats.synced.fetch_add(1, Ordering::Relaxed);
        if delay.is_zero() {
            sync();
            return;
        }
        self.stats.delayed.fetch_add(1, Ordering::Relaxed);
        self.write_stats();
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            sync();
        });
    }

    fn write_stats(&self) {
        let Some(path) = &self.stats_file else {
            return;
        };
        // Counts read under the lock, so a later file never has smaller ones.
        let _serial = self.stats_lock.lock();
        let text = format!(
            "delayed {}\nsynced {}\n",
            self.stats.delayed.load(Ordering::Relaxed),
            self.stats.synced.load(Ordering::Relaxed)
        );
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
}

impl Filesystem for PassthroughFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.do_lookup(parent, name) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut state = self.state.lock();
        let gone = match state.nodes.get_mut(&ino.0) {
            Some(node) => {
                node.lookups = node.lookups.saturating_sub(nlookup);
                (node.lookups == 0).then_some(node.key)
            }
            None => None,
        };
        if let Some(key) = gone {
            state.nodes.remove(&ino.0);
            if state.by_key.get(&key) == Some(&ino.0) {
                state.by_key.remove(&key);
            }
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.do_getattr(ino) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let result = (|| -> Result<FileAttr, Errno> {
            let (fd, open) = {
                let state = self.state.lock();
                (state.fd(ino)?, fh.and_then(|fh| state.file(fh).ok()))
            };
            let path = proc_path(&fd);
            if let Some(mode) = mode {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o7777))?;
            }
            if uid.is_some() || gid.is_some() {
                std::os::unix::fs::chown(&path, uid, gid)?;
            }
            if let Some(size) = size {
                match &open {
                    Some(f) => f.set_len(size)?,
                    None => std::fs::OpenOptions::new()
                        .write(true)
                        .open(&path)?
                        .set_len(size)?,
                }
            }
            if atime.is_some() || mtime.is_some() {
                let to_time = |t: TimeOrNow| match t {
                    TimeOrNow::SpecificTime(t) => t,
                    TimeOrNow::Now => SystemTime::now(),
                };
                let mut times = std::fs::FileTimes::new();
                if let Some(t) = atime {
                    times = times.set_accessed(to_time(t));
                }
                if let Some(t) = mtime {
                    times = times.set_modified(to_time(t));
                }
                File::open(&path)?.set_times(times)?;
            }
            let stat = fstat(fd.as_fd()).map_err(errno)?;
            Ok(attr(ino.0, &stat))
        })();
        match result {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let fd = self.state.lock().fd(ino);
        let result = fd.and_then(|fd| readlinkat(fd.as_fd(), "").map_err(errno));
        match result {
            Ok(target) => reply.data(target.as_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let result = self.parent_fd(parent).and_then(|dir| {
            mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(mode & !umask)).map_err(errno)?;
            self.do_lookup(parent, name)
        });
        match result {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let result = self
            .parent_fd(parent)
            .and_then(|dir| unlinkat(dir.as_fd(), name, UnlinkatFlags::NoRemoveDir).map_err(errno));
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let result = self
            .parent_fd(parent)
            .and_then(|dir| unlinkat(dir.as_fd(), name, UnlinkatFlags::RemoveDir).map_err(errno));
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn symlink(
        &self,
        _req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let result = self.parent_fd(parent).and_then(|dir| {
            symlinkat(target, dir.as_fd(), link_name).map_err(errno)?;
            self.do_lookup(parent, link_name)
        });
        match result {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let result = (|| -> Result<(), Errno> {
            let (from, to) = {
                let state = self.state.lock();
                (state.fd(parent)?, state.fd(newparent)?)
            };
            renameat2(
                from.as_fd(),
                name,
                to.as_fd(),
                newname,
                fuse_nix::fcntl::RenameFlags::from_bits_truncate(flags.bits()),
            )
            .map_err(errno)
        })();
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let result = (|| -> Result<FileAttr, Errno> {
            let (fd, dir) = {
                let state = self.state.lock();
                (state.fd(ino)?, state.fd(newparent)?)
            };
            // The O_PATH descriptor itself, through its /proc link.
            linkat(
                fuse_nix::fcntl::AT_FDCWD,
                &proc_path(&fd),
                dir.as_fd(),
                newname,
                AtFlags::AT_SYMLINK_FOLLOW,
            )
            .map_err(errno)?;
            self.do_lookup(newparent, newname)
        })();
        match result {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let result = (|| -> Result<u64, Errno> {
            let fd = self.state.lock().fd(ino)?;
            let file = open_backing(&fd, flags.0)?;
            Ok(self.state.lock().add_handle(Handle::File(Arc::new(file))))
        })();
        match result {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let result = (|| -> Result<Vec<u8>, Errno> {
            let file = self.state.lock().file(fh)?;
            let mut buf = vec![0u8; size as usize];
            let mut filled = 0;
            while filled < buf.len() {
                match file.read_at(&mut buf[filled..], offset + filled as u64) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e.into()),
                }
            }
            buf.truncate(filled);
            Ok(buf)
        })();
        match result {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let result = (|| -> Result<u32, Errno> {
            let file = self.state.lock().file(fh)?;
            file.write_all_at(data, offset)?;
            u32::try_from(data.len()).map_err(|_| Errno::EINVAL)
        })();
        match result {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close() is no durability barrier: nothing to delay, nothing to do
        // (the backing descriptor stays open until release).
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.state.lock().handles.remove(&fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Bound first, so the state lock is released before the barrier.
        let file = self.state.lock().file(fh);
        match file {
            Ok(file) => self.barrier(file, datasync, reply),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let result = (|| -> Result<u64, Errno> {
            let fd = self.state.lock().fd(ino)?;
            let dir = open_backing(&fd, fuse_nix::libc::O_RDONLY | fuse_nix::libc::O_DIRECTORY)?;
            // A snapshot, so offsets stay meaningful across readdir calls.
            let mut entries = vec![
                (ino.0, FileType::Directory, OsString::from(".")),
                (ino.0, FileType::Directory, OsString::from("..")),
            ];
            for entry in std::fs::read_dir(proc_path(&fd))? {
                let entry = entry?;
                let t = entry.file_type()?;
                let kind = if t.is_dir() {
                    FileType::Directory
                } else if t.is_symlink() {
                    FileType::Symlink
                } else if t.is_fifo() {
                    FileType::NamedPipe
                } else if t.is_socket() {
                    FileType::Socket
                } else if t.is_char_device() {
                    FileType::CharDevice
                } else if t.is_block_device() {
                    FileType::BlockDevice
                } else {
                    FileType::RegularFile
                };
                entries.push((entry.ino(), kind, entry.file_name()));
            }
            Ok(self.state.lock().add_handle(Handle::Dir {
                entries: Arc::new(entries),
                dir: Arc::new(dir),
            }))
        })();
        match result {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match self.state.lock().handles.get(&fh.0) {
            Some(Handle::Dir { entries, .. }) => Some(Arc::clone(entries)),
            _ => None,
        };
        let entries = match entries {
            Some(e) => e,
            None => {
                reply.error(Errno::EBADF);
                return;
            }
        };
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(start) {
            // The offset of an entry is where the next readdir starts.
            if reply.add(INodeNo(*ino), (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.state.lock().handles.remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Bound first, so the state lock is released before the barrier.
        let dir = self.state.lock().file(fh);
        match dir {
            Ok(dir) => self.barrier(dir, datasync, reply),
            Err(e) => reply.error(e),
        }
    }

    fn statfs(&self, _req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let fd = self.state.lock().fd(ino);
        let result = fd.and_then(|fd| fuse_nix::sys::statvfs::fstatvfs(fd.as_fd()).map_err(errno));
        match result {
            Ok(s) => reply.statfs(
                s.blocks(),
                s.blocks_free(),
                s.blocks_available(),
                s.files(),
                s.files_free(),
                u32::try_from(s.block_size()).unwrap_or(4096),
                u32::try_from(s.name_max()).unwrap_or(255),
                u32::try_from(s.fragment_size()).unwrap_or(4096),
            ),
            Err(e) => reply.error(e),
        }
    }

    fn access(&self, _req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let fd = self.state.lock().fd(ino);
        let result = fd.and_then(|fd| {
            fuse_nix::unistd::access(
                &proc_path(&fd),
                fuse_nix::unistd::AccessFlags::from_bits_truncate(mask.bits()),
            )
            .map_err(errno)
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let result = (|| -> Result<(FileAttr, u64), Errno> {
            let dir = self.parent_fd(parent)?;
            let fd = openat(
                dir.as_fd(),
                name,
                backing_flags(flags) | OFlag::O_CREAT,
                Mode::from_bits_truncate(mode & !umask),
            )
            .map_err(errno)?;
            let attr = self.do_lookup(parent, name)?;
            let fh = self
                .state
                .lock()
                .add_handle(Handle::File(Arc::new(File::from(fd))));
            Ok((attr, fh))
        })();
        match result {
            Ok((a, fh)) => {
                reply.created(&TTL, &a, Generation(0), FileHandle(fh), FopenFlags::empty())
            }
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let result = (|| -> Result<(), Errno> {
            let file = self.state.lock().file(fh)?;
            fuse_nix::fcntl::fallocate(
                file.as_fd(),
                FallocateFlags::from_bits_truncate(mode),
                i64::try_from(offset).map_err(|_| Errno::EINVAL)?,
                i64::try_from(length).map_err(|_| Errno::EINVAL)?,
            )
            .map_err(errno)
        })();
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }
}

/// The flags to open a backing file with, from a request's: no
/// `O_NOFOLLOW` (the inode is already resolved) and no `O_DIRECT` (the
/// kernel's page cache sits above us and may send unaligned writes).
fn backing_flags(flags: i32) -> OFlag {
    OFlag::from_bits_truncate(flags) & !(OFlag::O_NOFOLLOW | OFlag::O_DIRECT) | OFlag::O_CLOEXEC
}

/// Opens the inode an `O_PATH` descriptor holds with `flags`.
fn open_backing(fd: &OwnedFd, flags: i32) -> Result<File, Errno> {
    let flags = backing_flags(flags) & !(OFlag::O_CREAT | OFlag::O_EXCL);
    fuse_nix::fcntl::open(&proc_path(fd), flags, Mode::empty())
        .map(File::from)
        .map_err(errno)
}
