//! The filesystem's state: the durable state lives in the backing dir, everything not yet made
//! durable lives here in memory. No FUSE types in this module; `crate::fuse` adapts it.
//!
//! Inodes are ours (numbers never reused in one daemon's life). Every regular file or symlink
//! inode holds an open fd to its backing inode; a directory is reached by its backing path.
//!
//! Backing layout invariant: the backing dir holds exactly the durable namespace (every
//! directory's `durable` map), plus the hidden staging dir [`STAGING`] in the backing root.
//! A live file whose name is not durable anywhere keeps a name `STAGING/<ino>` so that it can be
//! linked into place when its directory is fsynced; a live directory whose entry is not durable
//! lives at `STAGING/<ino>` (with its own durable contents under it) until its parent is
//! fsynced. Staging is removed at every start and after a cut: what is only there was never
//! durable.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::protocol::{CutPolicy, CutReport, PendingStatus};
use crate::rng::Rng;

/// Name of the staging dir in the backing root; hidden from the mounted view.
pub const STAGING: &str = ".powercut-staging";
pub const ROOT: u64 = 1;
/// The unit a cut tears writes at (bytes): a write is kept or dropped whole within each
/// aligned sector. 512 by default (`--sector-bytes` changes it for the daemon process).
static SECTOR_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(512);

/// Sets the tear unit of this process's cuts; a power of two from 512 to 65536.
pub fn set_sector_bytes(bytes: u64) -> Result<(), String> {
    if !bytes.is_power_of_two() || !(512..=65536).contains(&bytes) {
        return Err(format!(
            "sector size {bytes} must be a power of two from 512 to 65536"
        ));
    }
    SECTOR_BYTES.store(bytes, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

fn sector_bytes() -> u64 {
    SECTOR_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// An errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub i32);

impl From<io::Error> for Errno {
    fn from(e: io::Error) -> Errno {
        Errno(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

pub type Res<T> = Result<T, Errno>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    /// Symlinks and anything else found in the backing dir (fifos, sockets): no data, but
    /// names that follow the same durability rules as files'.
    Other,
}

/// One data operation not yet durable, in program order.
#[derive(Clone, Debug)]
enum Pending {
    Write {
        off: u64,
        data: Vec<u8>,
    },
    /// truncate / ftruncate / O_TRUNC.
    SetSize(u64),
    /// fallocate with a mode: PUNCH_HOLE|KEEP_SIZE, ZERO_RANGE[|KEEP_SIZE], 0 or KEEP_SIZE.
    Fallocate {
        mode: i32,
        off: u64,
        len: u64,
    },
}

impl Pending {
    fn payload(&self) -> u64 {
        match self {
            Pending::Write { data, .. } => data.len() as u64,
            _ => 0,
        }
    }
}

#[derive(Default)]
struct Dir {
    loaded: bool,
    live: BTreeMap<OsString, u64>,
    durable: BTreeMap<OsString, u64>,
}

struct Inode {
    kind: Kind,
    /// Regular files: read-write; Other: O_PATH. Directories: none (reached by path).
    fd: Option<File>,
    backing_id: (u64, u64),
    live_size: u64,
    pending: Vec<Pending>,
    dir: Option<Dir>,
    /// Directories: where the live tree has it (for `..`).
    live_parent: Option<(u64, OsString)>,
    live_links: u32,
    durable_names: Vec<(u64, OsString)>,
    /// Has a name (file) or lives (directory) under the staging dir.
    staged: bool,
    lookups: u64,
    open_handles: u32,
}

impl Inode {
    fn new(kind: Kind, fd: Option<File>, backing_id: (u64, u64), size: u64) -> Inode {
        Inode {
            kind,
            fd,
            backing_id,
            live_size: size,
            pending: Vec::new(),
            dir: (kind == Kind::Dir).then(Dir::default),
            live_parent: None,
            live_links: 0,
            durable_names: Vec::new(),
            staged: false,
            lookups: 0,
            open_handles: 0,
        }
    }
}

/// Attributes as the kernel sees them.
#[derive(Clone, Debug)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    /// `S_IFMT` bits of the backing inode (tells symlinks from fifos for `Kind::Other`).
    pub file_type: u32,
    pub size: u64,
    pub blocks: u64,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
}

/// One directory entry as `readdir` lists it.
#[derive(Clone, Debug)]
pub struct DirEntry {
    pub ino: u64,
    pub file_type: u32,
    pub name: OsString,
}

/// Changes to apply with `setattr`.
#[derive(Default, Debug)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    /// `None`: leave; `Some(None)`: now; `Some(Some(t))`: t.
    pub atime: Option<Option<SystemTime>>,
    pub mtime: Option<Option<SystemTime>>,
}

pub struct State {
    backing: PathBuf,
    staging: PathBuf,
    fsync_backing: bool,
    inodes: HashMap<u64, Inode>,
    by_backing: HashMap<(u64, u64), u64>,
    next_ino: u64,
    next_fh: u64,
    dir_handles: HashMap<u64, Vec<DirEntry>>,
    /// Set by a cut or a clean unmount: every later request fails with EIO.
    pub dead: bool,
}

fn cpath(path: &Path) -> Res<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno(libc::EINVAL))
}

fn cvt(ret: libc::c_int) -> Res<()> {
    if ret < 0 {
        Err(io::Error::last_os_error().into())
    } else {
        Ok(())
    }
}

fn system_time(secs: i64, nsecs: i64) -> SystemTime {
    let nanos = Duration::from_nanos(nsecs.clamp(0, 999_999_999) as u64);
    let t = if secs >= 0 {
        UNIX_EPOCH.checked_add(Duration::from_secs(secs as u64))
    } else {
        UNIX_EPOCH.checked_sub(Duration::from_secs(secs.unsigned_abs()))
    };
    t.and_then(|t| t.checked_add(nanos)).unwrap_or(UNIX_EPOCH)
}

fn timespec(t: Option<Option<SystemTime>>) -> libc::timespec {
    match t {
        None => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        Some(None) => libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
        Some(Some(t)) => match t.duration_since(UNIX_EPOCH) {
            Ok(d) => libc::timespec {
                tv_sec: d.as_secs() as libc::time_t,
                tv_nsec: d.subsec_nanos() as _,
            },
            Err(_) => libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
        },
    }
}

fn kind_of(mode: u32) -> Kind {
    match mode & libc::S_IFMT {
        libc::S_IFREG => Kind::File,
        libc::S_IFDIR => Kind::Dir,
        _ => Kind::Other,
    }
}

/// `fallocate` on the backing fd, falling back to plain writes where the backing filesystem
/// does not support the mode (so the result reads the same).
fn backing_fallocate(file: &File, mode: i32, off: u64, len: u64) -> Res<()> {
    // SAFETY: fallocate on an open fd with integer arguments.
    let ret = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            mode,
            off as libc::off_t,
            len as libc::off_t,
        )
    };
    if ret == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
        return Err(err.into());
    }
    let size = file.metadata()?.len();
    let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
    let zero = mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0;
    let end = off.saturating_add(len);
    if zero {
        let zero_end = if keep { end.min(size) } else { end };
        let mut pos = off;
        let zeros = vec![0u8; 1 << 20];
        while pos < zero_end {
            let n = (zero_end - pos).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], pos)?;
            pos += n as u64;
        }
    }
    if !keep && end > size {
        file.set_len(end)?;
    }
    Ok(())
}

fn apply_to_backing(file: &File, op: &Pending) -> Res<()> {
    match op {
        Pending::Write { off, data } => file.write_all_at(data, *off)?,
        Pending::SetSize(size) => file.set_len(*size)?,
        Pending::Fallocate { mode, off, len } => backing_fallocate(file, *mode, *off, *len)?,
    }
    Ok(())
}

/// Overlays one pending operation on `buf`, which holds bytes `[start, start + buf.len())`.
fn overlay(buf: &mut [u8], start: u64, op: &Pending) {
    let end = start + buf.len() as u64;
    let zero = |buf: &mut [u8], from: u64, to: u64| {
        let (a, b) = (from.max(start), to.min(end));
        if a < b {
            buf[(a - start) as usize..(b - start) as usize].fill(0);
        }
    };
    match op {
        Pending::Write { off, data } => {
            let (a, b) = ((*off).max(start), (off + data.len() as u64).min(end));
            if a < b {
                buf[(a - start) as usize..(b - start) as usize]
                    .copy_from_slice(&data[(a - off) as usize..(b - off) as usize]);
            }
        }
        Pending::SetSize(size) => zero(buf, *size, u64::MAX),
        Pending::Fallocate { mode, off, len } => {
            if mode & (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE) != 0 {
                zero(buf, *off, off.saturating_add(*len));
            }
        }
    }
}

impl State {
    /// Opens the backing dir: removes a staging dir left by an earlier cut (nothing in it was
    /// durable) and creates an empty one.
    pub fn load(backing: &Path, fsync_backing: bool) -> io::Result<State> {
        let backing = backing.canonicalize()?;
        let meta = std::fs::metadata(&backing)?;
        if !meta.is_dir() {
            return Err(io::Error::other(format!(
                "{} is not a directory",
                backing.display()
            )));
        }
        let staging = backing.join(STAGING);
        if staging.symlink_metadata().is_ok() {
            std::fs::remove_dir_all(&staging)?;
        }
        std::fs::create_dir(&staging)?;
        let mut root = Inode::new(Kind::Dir, None, (meta.dev(), meta.ino()), 0);
        root.live_links = 1;
        let mut state = State {
            backing,
            staging,
            fsync_backing,
            inodes: HashMap::new(),
            by_backing: HashMap::new(),
            next_ino: ROOT + 1,
            next_fh: 1,
            dir_handles: HashMap::new(),
            dead: false,
        };
        state.by_backing.insert(root.backing_id, ROOT);
        state.inodes.insert(ROOT, root);
        Ok(state)
    }

    fn node(&self, ino: u64) -> Res<&Inode> {
        self.inodes.get(&ino).ok_or(Errno(libc::ENOENT))
    }

    fn node_mut(&mut self, ino: u64) -> Res<&mut Inode> {
        self.inodes.get_mut(&ino).ok_or(Errno(libc::ENOENT))
    }

    fn dir(&self, ino: u64) -> Res<&Dir> {
        self.node(ino)?.dir.as_ref().ok_or(Errno(libc::ENOTDIR))
    }

    fn dir_mut(&mut self, ino: u64) -> Res<&mut Dir> {
        self.node_mut(ino)?.dir.as_mut().ok_or(Errno(libc::ENOTDIR))
    }

    fn staging_path(&self, ino: u64) -> PathBuf {
        self.staging.join(ino.to_string())
    }

    /// Where a directory is in the backing dir now.
    fn dir_path(&self, ino: u64) -> Res<PathBuf> {
        if ino == ROOT {
            return Ok(self.backing.clone());
        }
        let node = self.node(ino)?;
        match node.durable_names.first() {
            Some((parent, name)) => Ok(self.dir_path(*parent)?.join(name)),
            None if node.staged => Ok(self.staging_path(ino)),
            None => Err(Errno(libc::ENOENT)),
        }
    }

    fn alloc_ino(&mut self) -> u64 {
        let ino = self.next_ino;
        self.next_ino += 1;
        ino
    }

    fn check_name(&self, parent: u64, name: &OsStr) -> Res<()> {
        if name.is_empty() || name == "." || name == ".." || name.as_bytes().contains(&b'/') {
            return Err(Errno(libc::EINVAL));
        }
        if name.len() > 255 {
            return Err(Errno(libc::ENAMETOOLONG));
        }
        if parent == ROOT && name == STAGING {
            return Err(Errno(libc::EPERM));
        }
        Ok(())
    }

    /// Reads a directory's entries from the backing dir the first time it is used. Until then
    /// it can have no pending changes.
    fn ensure_loaded(&mut self, dir: u64) -> Res<()> {
        if self.dir(dir)?.loaded {
            return Ok(());
        }
        let path = self.dir_path(dir)?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&path)? {
            let entry = entry?;
            let name = entry.file_name();
            if dir == ROOT && name == STAGING {
                continue;
            }
            found.push(name);
        }
        found.sort();
        for name in found {
            let full = path.join(&name);
            let meta = full.symlink_metadata()?;
            let id = (meta.dev(), meta.ino());
            let ino = match self.by_backing.get(&id) {
                Some(&ino) => ino,
                None => {
                    let kind = kind_of(meta.mode());
                    let fd = match kind {
                        Kind::File => Some(
                            OpenOptions::new()
                                .read(true)
                                .write(true)
                                .custom_flags(libc::O_NOFOLLOW)
                                .open(&full)?,
                        ),
                        Kind::Other => Some(
                            OpenOptions::new()
                                .read(true)
                                .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
                                .open(&full)?,
                        ),
                        Kind::Dir => None,
                    };
                    let ino = self.alloc_ino();
                    self.inodes
                        .insert(ino, Inode::new(kind, fd, id, meta.len()));
                    self.by_backing.insert(id, ino);
                    ino
                }
            };
            let node = self.node_mut(ino)?;
            node.durable_names.push((dir, name.clone()));
            node.live_links += 1;
            if node.kind == Kind::Dir {
                node.live_parent = Some((dir, name.clone()));
            }
            let d = self.dir_mut(dir)?;
            d.live.insert(name.clone(), ino);
            d.durable.insert(name, ino);
        }
        self.dir_mut(dir)?.loaded = true;
        Ok(())
    }

    // ---------------------------------------------------------------- attributes and lookup

    pub fn attr(&self, ino: u64) -> Res<Attr> {
        let node = self.node(ino)?;
        let meta = match &node.fd {
            Some(fd) => fd.metadata()?,
            None => self.dir_path(ino)?.symlink_metadata()?,
        };
        let size = if node.kind == Kind::File {
            node.live_size
        } else {
            meta.len()
        };
        Ok(Attr {
            ino,
            kind: node.kind,
            file_type: meta.mode() & libc::S_IFMT,
            size,
            blocks: meta.blocks(),
            atime: system_time(meta.atime(), meta.atime_nsec()),
            mtime: system_time(meta.mtime(), meta.mtime_nsec()),
            ctime: system_time(meta.ctime(), meta.ctime_nsec()),
            perm: (meta.mode() & 0o7777) as u16,
            nlink: if node.kind == Kind::Dir {
                2
            } else {
                node.live_links
            },
            uid: meta.uid(),
            gid: meta.gid(),
            rdev: meta.rdev() as u32,
        })
    }

    /// Looks a name up and counts the kernel's reference.
    pub fn lookup(&mut self, parent: u64, name: &OsStr) -> Res<Attr> {
        self.ensure_loaded(parent)?;
        let ino = *self
            .dir(parent)?
            .live
            .get(name)
            .ok_or(Errno(libc::ENOENT))?;
        let attr = self.attr(ino)?;
        self.node_mut(ino)?.lookups += 1;
        Ok(attr)
    }

    pub fn forget(&mut self, ino: u64, n: u64) {
        if let Some(node) = self.inodes.get_mut(&ino) {
            node.lookups = node.lookups.saturating_sub(n);
            self.maybe_drop(ino);
        }
    }

    pub fn setattr(&mut self, ino: u64, set: &SetAttr) -> Res<Attr> {
        let node = self.node(ino)?;
        let path = if node.fd.is_none() {
            Some(cpath(&self.dir_path(ino)?)?)
        } else {
            None
        };
        let fd = node.fd.as_ref().map(|f| f.as_raw_fd());
        let kind = node.kind;
        if set.size.is_some_and(|s| s > i64::MAX as u64) {
            return Err(Errno(libc::EFBIG));
        }
        if set.size.is_some() {
            match kind {
                Kind::File => {}
                Kind::Dir => return Err(Errno(libc::EISDIR)),
                Kind::Other => return Err(Errno(libc::EINVAL)),
            }
        }
        // Ownership, permissions and times are written through to the backing inode at once:
        // they are not modelled.
        if kind != Kind::Other {
            if let Some(mode) = set.mode {
                // SAFETY: plain syscalls on a valid fd or NUL-terminated path.
                cvt(unsafe {
                    match (fd, &path) {
                        (Some(fd), _) => libc::fchmod(fd, mode & 0o7777),
                        (None, Some(p)) => libc::chmod(p.as_ptr(), mode & 0o7777),
                        _ => 0,
                    }
                })?;
            }
            if set.uid.is_some() || set.gid.is_some() {
                let uid = set.uid.unwrap_or(u32::MAX);
                let gid = set.gid.unwrap_or(u32::MAX);
                // SAFETY: as above; -1 leaves an id unchanged.
                cvt(unsafe {
                    match (fd, &path) {
                        (Some(fd), _) => libc::fchown(fd, uid, gid),
                        (None, Some(p)) => libc::chown(p.as_ptr(), uid, gid),
                        _ => 0,
                    }
                })?;
            }
            if set.atime.is_some() || set.mtime.is_some() {
                let times = [timespec(set.atime), timespec(set.mtime)];
                // SAFETY: as above, with a two-element timespec array.
                cvt(unsafe {
                    match (fd, &path) {
                        (Some(fd), _) => libc::futimens(fd, times.as_ptr()),
                        (None, Some(p)) => {
                            libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0)
                        }
                        _ => 0,
                    }
                })?;
            }
        }
        if let Some(size) = set.size {
            let node = self.node_mut(ino)?;
            node.pending.push(Pending::SetSize(size));
            node.live_size = size;
        }
        self.attr(ino)
    }

    pub fn readlink(&self, ino: u64) -> Res<Vec<u8>> {
        let node = self.node(ino)?;
        let fd = match (&node.fd, node.kind) {
            (Some(fd), Kind::Other) => fd.as_raw_fd(),
            _ => return Err(Errno(libc::EINVAL)),
        };
        let mut buf = vec![0u8; libc::PATH_MAX as usize];
        // SAFETY: readlinkat with an empty path reads the link an O_PATH fd refers to.
        let n = unsafe { libc::readlinkat(fd, c"".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error().into());
        }
        buf.truncate(n as usize);
        Ok(buf)
    }

    pub fn statfs(&self) -> Res<libc::statvfs> {
        let path = cpath(&self.backing)?;
        // SAFETY: statvfs fills a zeroed struct for a NUL-terminated path.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        cvt(unsafe { libc::statvfs(path.as_ptr(), &mut st) })?;
        Ok(st)
    }

    // ---------------------------------------------------------------- namespace (live)

    /// Creates a regular file (or a symlink when `link_target` is set) whose name is pending in
    /// `parent`; its backing inode gets a staging name.
    pub fn create(
        &mut self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        uid: u32,
        gid: u32,
        link_target: Option<&Path>,
    ) -> Res<Attr> {
        self.check_name(parent, name)?;
        self.ensure_loaded(parent)?;
        if self.dir(parent)?.live.contains_key(name) {
            return Err(Errno(libc::EEXIST));
        }
        let ino = self.alloc_ino();
        let path = self.staging_path(ino);
        let (kind, file) = match link_target {
            None => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(mode & 0o7777)
                    .open(&path)?;
                // The umask of the daemon must not narrow the requested mode.
                file.set_permissions(std::fs::Permissions::from_mode(mode & 0o7777))?;
                (Kind::File, file)
            }
            Some(target) => {
                std::os::unix::fs::symlink(target, &path)?;
                let file = OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_PATH | libc::O_NOFOLLOW)
                    .open(&path)?;
                (Kind::Other, file)
            }
        };
        let c = cpath(&path)?;
        // SAFETY: lchown on a NUL-terminated path.
        if let Err(e) = cvt(unsafe { libc::lchown(c.as_ptr(), uid, gid) }) {
            let _ = std::fs::remove_file(&path);
            return Err(e);
        }
        let meta = file.metadata()?;
        let id = (meta.dev(), meta.ino());
        let mut node = Inode::new(kind, Some(file), id, 0);
        node.staged = true;
        node.live_links = 1;
        node.lookups = 1;
        self.inodes.insert(ino, node);
        self.by_backing.insert(id, ino);
        self.dir_mut(parent)?.live.insert(name.to_owned(), ino);
        self.attr(ino)
    }

    pub fn mkdir(&mut self, parent: u64, name: &OsStr, mode: u32, uid: u32, gid: u32) -> Res<Attr> {
        self.check_name(parent, name)?;
        self.ensure_loaded(parent)?;
        if self.dir(parent)?.live.contains_key(name) {
            return Err(Errno(libc::EEXIST));
        }
        let ino = self.alloc_ino();
        let path = self.staging_path(ino);
        std::fs::create_dir(&path)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o7777))?;
        let c = cpath(&path)?;
        // SAFETY: chown on a NUL-terminated path.
        cvt(unsafe { libc::chown(c.as_ptr(), uid, gid) })?;
        let meta = path.symlink_metadata()?;
        let id = (meta.dev(), meta.ino());
        let mut node = Inode::new(Kind::Dir, None, id, 0);
        node.staged = true;
        node.live_links = 1;
        node.lookups = 1;
        node.live_parent = Some((parent, name.to_owned()));
        node.dir.as_mut().expect("a directory").loaded = true;
        self.inodes.insert(ino, node);
        self.by_backing.insert(id, ino);
        self.dir_mut(parent)?.live.insert(name.to_owned(), ino);
        self.attr(ino)
    }

    pub fn link(&mut self, ino: u64, parent: u64, name: &OsStr) -> Res<Attr> {
        self.check_name(parent, name)?;
        self.ensure_loaded(parent)?;
        let node = self.node(ino)?;
        if node.kind == Kind::Dir {
            return Err(Errno(libc::EPERM));
        }
        if node.live_links == 0 {
            return Err(Errno(libc::ENOENT));
        }
        if self.dir(parent)?.live.contains_key(name) {
            return Err(Errno(libc::EEXIST));
        }
        self.dir_mut(parent)?.live.insert(name.to_owned(), ino);
        let node = self.node_mut(ino)?;
        node.live_links += 1;
        node.lookups += 1;
        self.attr(ino)
    }

    pub fn unlink(&mut self, parent: u64, name: &OsStr) -> Res<()> {
        self.ensure_loaded(parent)?;
        let ino = *self
            .dir(parent)?
            .live
            .get(name)
            .ok_or(Errno(libc::ENOENT))?;
        if self.node(ino)?.kind == Kind::Dir {
            return Err(Errno(libc::EISDIR));
        }
        self.dir_mut(parent)?.live.remove(name);
        self.node_mut(ino)?.live_links -= 1;
        self.unlinked(ino)
    }

    pub fn rmdir(&mut self, parent: u64, name: &OsStr) -> Res<()> {
        self.ensure_loaded(parent)?;
        let ino = *self
            .dir(parent)?
            .live
            .get(name)
            .ok_or(Errno(libc::ENOENT))?;
        if self.node(ino)?.kind != Kind::Dir {
            return Err(Errno(libc::ENOTDIR));
        }
        self.ensure_loaded(ino)?;
        if !self.dir(ino)?.live.is_empty() {
            return Err(Errno(libc::ENOTEMPTY));
        }
        self.dir_mut(parent)?.live.remove(name);
        let node = self.node_mut(ino)?;
        node.live_links = 0;
        node.live_parent = None;
        self.unlinked(ino)
    }

    /// Is `ino` the directory `ancestor` or below it in the live tree?
    fn live_descendant(&self, mut ino: u64, ancestor: u64) -> bool {
        loop {
            if ino == ancestor {
                return true;
            }
            match self.inodes.get(&ino).and_then(|n| n.live_parent.as_ref()) {
                Some((parent, _)) => ino = *parent,
                None => return false,
            }
        }
    }

    pub fn rename(&mut self, p1: u64, n1: &OsStr, p2: u64, n2: &OsStr, flags: u32) -> Res<()> {
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        let noreplace = flags & libc::RENAME_NOREPLACE != 0;
        if flags & !(libc::RENAME_EXCHANGE | libc::RENAME_NOREPLACE) != 0 || (exchange && noreplace)
        {
            return Err(Errno(libc::EINVAL));
        }
        self.check_name(p2, n2)?;
        self.ensure_loaded(p1)?;
        self.ensure_loaded(p2)?;
        let src = *self.dir(p1)?.live.get(n1).ok_or(Errno(libc::ENOENT))?;
        let dst = self.dir(p2)?.live.get(n2).copied();
        if dst == Some(src) {
            return Ok(());
        }
        let src_dir = self.node(src)?.kind == Kind::Dir;
        if src_dir && self.live_descendant(p2, src) {
            return Err(Errno(libc::EINVAL));
        }
        if exchange {
            let dst = dst.ok_or(Errno(libc::ENOENT))?;
            if self.node(dst)?.kind == Kind::Dir && self.live_descendant(p1, dst) {
                return Err(Errno(libc::EINVAL));
            }
            self.dir_mut(p1)?.live.insert(n1.to_owned(), dst);
            self.dir_mut(p2)?.live.insert(n2.to_owned(), src);
            for (ino, parent, name) in [(src, p2, n2), (dst, p1, n1)] {
                let node = self.node_mut(ino)?;
                if node.kind == Kind::Dir {
                    node.live_parent = Some((parent, name.to_owned()));
                }
            }
            return Ok(());
        }
        if let Some(dst) = dst {
            if noreplace {
                return Err(Errno(libc::EEXIST));
            }
            let dst_dir = self.node(dst)?.kind == Kind::Dir;
            match (src_dir, dst_dir) {
                (false, true) => return Err(Errno(libc::EISDIR)),
                (true, false) => return Err(Errno(libc::ENOTDIR)),
                (true, true) => {
                    self.ensure_loaded(dst)?;
                    if !self.dir(dst)?.live.is_empty() {
                        return Err(Errno(libc::ENOTEMPTY));
                    }
                }
                (false, false) => {}
            }
        }
        self.dir_mut(p1)?.live.remove(n1);
        self.dir_mut(p2)?.live.insert(n2.to_owned(), src);
        if src_dir {
            self.node_mut(src)?.live_parent = Some((p2, n2.to_owned()));
        }
        if let Some(dst) = dst {
            let node = self.node_mut(dst)?;
            node.live_links -= 1;
            if node.kind == Kind::Dir {
                node.live_parent = None;
            }
            self.unlinked(dst)?;
        }
        Ok(())
    }

    /// An inode lost a live name: tidy its staging state and drop it if nothing refers to it.
    fn unlinked(&mut self, ino: u64) -> Res<()> {
        let node = self.node(ino)?;
        if node.live_links == 0 && node.staged {
            // It needs no staging name any more: nothing can give it a durable name again.
            match node.kind {
                Kind::Dir => {
                    self.ensure_loaded(ino)?;
                    self.sync_dir(ino)?;
                    std::fs::remove_dir(self.staging_path(ino))?;
                }
                _ => std::fs::remove_file(self.staging_path(ino))?,
            }
            self.node_mut(ino)?.staged = false;
        }
        self.maybe_drop(ino);
        Ok(())
    }

    fn maybe_drop(&mut self, ino: u64) {
        let Some(node) = self.inodes.get(&ino) else {
            return;
        };
        if ino == ROOT
            || node.live_links > 0
            || node.lookups > 0
            || node.open_handles > 0
            || !node.durable_names.is_empty()
            || node.staged
        {
            return;
        }
        let node = self.inodes.remove(&ino).expect("present");
        self.by_backing.remove(&node.backing_id);
    }

    // ---------------------------------------------------------------- directories

    pub fn opendir(&mut self, ino: u64) -> Res<u64> {
        let entries = self.dir_snapshot(ino)?;
        let fh = self.next_fh;
        self.next_fh += 1;
        self.dir_handles.insert(fh, entries);
        Ok(fh)
    }

    fn dir_snapshot(&mut self, ino: u64) -> Res<Vec<DirEntry>> {
        self.ensure_loaded(ino)?;
        let node = self.node(ino)?;
        let parent = node.live_parent.as_ref().map(|(p, _)| *p).unwrap_or(ROOT);
        let mut entries = vec![
            DirEntry {
                ino,
                file_type: libc::S_IFDIR,
                name: ".".into(),
            },
            DirEntry {
                ino: parent,
                file_type: libc::S_IFDIR,
                name: "..".into(),
            },
        ];
        for (name, &child) in &self.dir(ino)?.live {
            let file_type = match self.node(child)?.kind {
                Kind::File => libc::S_IFREG,
                Kind::Dir => libc::S_IFDIR,
                Kind::Other => self
                    .attr(child)
                    .map(|a| a.file_type)
                    .unwrap_or(libc::S_IFREG),
            };
            entries.push(DirEntry {
                ino: child,
                file_type,
                name: name.clone(),
            });
        }
        Ok(entries)
    }

    /// Entries of an open directory from `offset` on (offset 0 takes a fresh snapshot, as
    /// rewinddir would).
    pub fn readdir(&mut self, ino: u64, fh: u64, offset: u64) -> Res<Vec<DirEntry>> {
        if offset == 0 || !self.dir_handles.contains_key(&fh) {
            let entries = self.dir_snapshot(ino)?;
            self.dir_handles.insert(fh, entries);
        }
        let entries = &self.dir_handles[&fh];
        Ok(entries.iter().skip(offset as usize).cloned().collect())
    }

    pub fn releasedir(&mut self, fh: u64) {
        self.dir_handles.remove(&fh);
    }

    // ---------------------------------------------------------------- file data

    pub fn open(&mut self, ino: u64) -> Res<u64> {
        let node = self.node_mut(ino)?;
        match node.kind {
            Kind::File => {}
            Kind::Dir => return Err(Errno(libc::EISDIR)),
            Kind::Other => return Err(Errno(libc::ENXIO)),
        }
        node.open_handles += 1;
        let fh = self.next_fh;
        self.next_fh += 1;
        Ok(fh)
    }

    pub fn release(&mut self, ino: u64) {
        if let Some(node) = self.inodes.get_mut(&ino) {
            node.open_handles = node.open_handles.saturating_sub(1);
            self.maybe_drop(ino);
        }
    }

    fn file(&self, ino: u64) -> Res<(&Inode, &File)> {
        let node = self.node(ino)?;
        match (&node.fd, node.kind) {
            (Some(fd), Kind::File) => Ok((node, fd)),
            (_, Kind::Dir) => Err(Errno(libc::EISDIR)),
            _ => Err(Errno(libc::EINVAL)),
        }
    }

    /// The live bytes: the backing file overlaid with every pending operation, in order.
    pub fn read(&self, ino: u64, off: u64, size: u32) -> Res<Vec<u8>> {
        let (node, fd) = self.file(ino)?;
        if off >= node.live_size {
            return Ok(Vec::new());
        }
        let len = (node.live_size - off).min(size as u64) as usize;
        let mut buf = vec![0u8; len];
        let mut done = 0;
        while done < len {
            match fd.read_at(&mut buf[done..], off + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        for op in &node.pending {
            overlay(&mut buf, off, op);
        }
        Ok(buf)
    }

    pub fn write(&mut self, ino: u64, off: u64, data: &[u8]) -> Res<u32> {
        self.file(ino)?;
        let end = off
            .checked_add(data.len() as u64)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or(Errno(libc::EFBIG))?;
        let node = self.node_mut(ino)?;
        node.pending.push(Pending::Write {
            off,
            data: data.to_vec(),
        });
        node.live_size = node.live_size.max(end);
        Ok(data.len() as u32)
    }

    pub fn fallocate(&mut self, ino: u64, off: u64, len: u64, mode: i32) -> Res<()> {
        self.file(ino)?;
        let keep = mode & libc::FALLOC_FL_KEEP_SIZE != 0;
        let rest = mode & !libc::FALLOC_FL_KEEP_SIZE;
        match rest {
            0 | libc::FALLOC_FL_ZERO_RANGE => {}
            libc::FALLOC_FL_PUNCH_HOLE if keep => {}
            libc::FALLOC_FL_PUNCH_HOLE => return Err(Errno(libc::EINVAL)),
            _ => return Err(Errno(libc::EOPNOTSUPP)),
        }
        if len == 0 {
            return Err(Errno(libc::EINVAL));
        }
        let end = off
            .checked_add(len)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or(Errno(libc::EFBIG))?;
        let node = self.node_mut(ino)?;
        node.pending.push(Pending::Fallocate { mode, off, len });
        if !keep {
            node.live_size = node.live_size.max(end);
        }
        Ok(())
    }

    /// fsync/fdatasync: the file's data and size become durable (not its names).
    pub fn fsync(&mut self, ino: u64) -> Res<()> {
        let node = self.node(ino)?;
        if node.kind != Kind::File {
            return Ok(());
        }
        let fd = node.fd.as_ref().expect("a file has an fd");
        for op in &node.pending {
            apply_to_backing(fd, op)?;
        }
        let live = node.live_size;
        if fd.metadata()?.len() != live {
            // Cannot happen if the ops were applied as recorded; be sure the sizes agree.
            fd.set_len(live)?;
        }
        if self.fsync_backing {
            fd.sync_data()?;
        }
        self.node_mut(ino)?.pending.clear();
        Ok(())
    }

    // ---------------------------------------------------------------- durability of names

    /// fsyncdir: every entry of `dir` becomes durable as the live tree has it.
    pub fn fsyncdir(&mut self, dir: u64) -> Res<()> {
        self.ensure_loaded(dir)?;
        self.sync_dir(dir)?;
        if self.fsync_backing {
            File::open(self.dir_path(dir)?)?.sync_all()?;
        }
        Ok(())
    }

    fn changed_names(&self, dir: u64) -> Res<Vec<OsString>> {
        let d = self.dir(dir)?;
        let mut names: Vec<OsString> = d
            .live
            .iter()
            .filter(|(n, i)| d.durable.get(*n) != Some(i))
            .map(|(n, _)| n.clone())
            .collect();
        names.extend(
            d.durable
                .keys()
                .filter(|n| !d.live.contains_key(*n))
                .cloned(),
        );
        names.sort();
        Ok(names)
    }

    fn sync_dir(&mut self, dir: u64) -> Res<()> {
        if !self.dir(dir)?.loaded {
            return Ok(());
        }
        for name in self.changed_names(dir)? {
            let new = self.dir(dir)?.live.get(&name).copied();
            self.apply_entry(dir, &name, new)?;
        }
        Ok(())
    }

    /// Is `ino` the directory `ancestor` or below it in the backing tree?
    fn durable_descendant(&self, mut ino: u64, ancestor: u64) -> bool {
        loop {
            if ino == ancestor {
                return true;
            }
            match self.inodes.get(&ino).and_then(|n| n.durable_names.first()) {
                Some((parent, _)) => ino = *parent,
                None => return false,
            }
        }
    }

    /// Makes `dir/name -> new` durable.
    fn apply_entry(&mut self, dir: u64, name: &OsStr, new: Option<u64>) -> Res<()> {
        let old = self.dir(dir)?.durable.get(name).copied();
        if old == new {
            return Ok(());
        }
        if let Some(n) = new {
            if self.node(n)?.kind == Kind::Dir && self.durable_descendant(dir, n) {
                eprintln!(
                    "powercut-fs: cannot make {name:?} durable in directory {dir}: the backing tree would get a cycle (sync the directories in another order)"
                );
                return Err(Errno(libc::EIO));
            }
        }
        let path = self.dir_path(dir)?.join(name);
        if let Some(o) = old {
            self.durable_unlink(dir, name, o, &path)?;
        }
        if let Some(n) = new {
            self.durable_link(dir, name, n, &path)?;
        }
        Ok(())
    }

    fn durable_unlink(&mut self, dir: u64, name: &OsStr, o: u64, path: &Path) -> Res<()> {
        let node = self.node(o)?;
        if node.kind == Kind::Dir {
            if node.live_links > 0 {
                // Alive elsewhere in the live tree: it leaves the durable tree until its new
                // parent is synced.
                std::fs::rename(path, self.staging_path(o))?;
                let node = self.node_mut(o)?;
                node.staged = true;
                node.durable_names.clear();
            } else {
                // Removed: its durable contents go with it.
                self.ensure_loaded(o)?;
                self.sync_dir(o)?;
                std::fs::remove_dir(path)?;
                self.node_mut(o)?.durable_names.clear();
            }
        } else {
            let last = node.durable_names.len() == 1;
            if last && node.live_links > 0 && !node.staged {
                let fd = node
                    .fd
                    .as_ref()
                    .expect("files and others have fds")
                    .as_raw_fd();
                link_fd(fd, &self.staging_path(o))?;
                self.node_mut(o)?.staged = true;
            }
            std::fs::remove_file(path)?;
            self.node_mut(o)?
                .durable_names
                .retain(|(p, n)| !(*p == dir && n == name));
        }
        self.dir_mut(dir)?.durable.remove(name);
        self.maybe_drop(o);
        Ok(())
    }

    fn durable_link(&mut self, dir: u64, name: &OsStr, n: u64, path: &Path) -> Res<()> {
        let node = self.node(n)?;
        if node.kind == Kind::Dir {
            let from = self.dir_path(n)?;
            std::fs::rename(&from, path)?;
            let node = self.node_mut(n)?;
            let previous = node.durable_names.pop();
            node.durable_names = vec![(dir, name.to_owned())];
            node.staged = false;
            if let Some((p2, n2)) = previous {
                self.dir_mut(p2)?.durable.remove(&n2);
            }
        } else {
            let fd = node
                .fd
                .as_ref()
                .expect("files and others have fds")
                .as_raw_fd();
            link_fd(fd, path)?;
            let staged = node.staged;
            if staged {
                std::fs::remove_file(self.staging_path(n))?;
            }
            let node = self.node_mut(n)?;
            node.staged = false;
            node.durable_names.push((dir, name.to_owned()));
        }
        self.dir_mut(dir)?.durable.insert(name.to_owned(), n);
        Ok(())
    }

    // ---------------------------------------------------------------- status, sync, cut

    /// A directory's path in the live tree, for messages.
    fn live_path(&self, dir: u64) -> String {
        let mut parts = Vec::new();
        let mut ino = dir;
        while ino != ROOT {
            match self.inodes.get(&ino).and_then(|n| n.live_parent.as_ref()) {
                Some((parent, name)) => {
                    parts.push(name.to_string_lossy().into_owned());
                    ino = *parent;
                }
                None => {
                    parts.push(format!("<removed directory {ino}>"));
                    break;
                }
            }
        }
        parts.reverse();
        parts.join("/")
    }

    /// Every pending entry change, described for a person.
    fn describe_changes(&self) -> Vec<(u64, OsString, String)> {
        let mut out = Vec::new();
        for dir in self.sorted_inos() {
            let Some(d) = self.inodes.get(&dir).and_then(|n| n.dir.as_ref()) else {
                continue;
            };
            if !d.loaded {
                continue;
            }
            let Ok(names) = self.changed_names(dir) else {
                continue;
            };
            for name in names {
                let kind = |ino: Option<&u64>| match ino
                    .and_then(|i| self.inodes.get(i))
                    .map(|n| n.kind)
                {
                    Some(Kind::Dir) => "directory",
                    Some(Kind::File) => "file",
                    _ => "entry",
                };
                let what = match (d.durable.get(&name), d.live.get(&name)) {
                    (None, new) => format!("new {}", kind(new)),
                    (old, None) => format!("removed {}", kind(old)),
                    (_, new) => format!("replaced by another {}", kind(new)),
                };
                let path = self.live_path(dir);
                let full = if path.is_empty() {
                    name.to_string_lossy().into_owned()
                } else {
                    format!("{path}/{}", name.to_string_lossy())
                };
                out.push((dir, name, format!("{full} ({what})")));
            }
        }
        out
    }

    pub fn status(&self) -> PendingStatus {
        let mut s = PendingStatus::default();
        for (ino, node) in &self.inodes {
            if !node.pending.is_empty() {
                s.files += 1;
                s.writes += node.pending.len() as u64;
                s.bytes += node.pending.iter().map(Pending::payload).sum::<u64>();
            }
            if node.dir.as_ref().is_some_and(|d| d.loaded) {
                s.namespace += self
                    .changed_names(*ino)
                    .map(|n| n.len() as u64)
                    .unwrap_or(0);
            }
        }
        s
    }

    fn sorted_inos(&self) -> Vec<u64> {
        let mut inos: Vec<u64> = self.inodes.keys().copied().collect();
        inos.sort_unstable();
        inos
    }

    /// Makes everything durable (a clean unmount).
    pub fn sync_all(&mut self) -> Res<()> {
        for ino in self.sorted_inos() {
            if self.inodes.get(&ino).is_some_and(|n| !n.pending.is_empty()) {
                self.fsync(ino)?;
            }
        }
        self.sync_all_dirs()
    }

    /// Syncs every loaded directory. Directory moves may need the target synced before the
    /// source, so this repeats while it makes progress.
    fn sync_all_dirs(&mut self) -> Res<()> {
        let mut last_err = None;
        for _ in 0..8 {
            last_err = None;
            for ino in self.sorted_inos() {
                if self
                    .inodes
                    .get(&ino)
                    .and_then(|n| n.dir.as_ref())
                    .is_some_and(|d| d.loaded)
                {
                    if let Err(e) = self.sync_dir(ino) {
                        last_err = Some(e);
                    }
                }
            }
            if last_err.is_none() {
                break;
            }
        }
        match last_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The power goes: applies what `policy` keeps of the pending state to the backing dir and
    /// removes the staging dir. The state must not be used afterwards (`dead` is set).
    pub fn cut(&mut self, policy: CutPolicy) -> CutReport {
        self.dead = true;
        let mut report = CutReport::default();
        let (mut rng, random_data, random_names) = match policy {
            CutPolicy::DropAll => (Rng::new(0), false, false),
            CutPolicy::KeepAll => (Rng::new(0), false, false),
            CutPolicy::RandomSubset { seed } => (Rng::new(seed), true, true),
            CutPolicy::RandomWrites { seed } => (Rng::new(seed), true, false),
        };
        let keep_all = policy == CutPolicy::KeepAll;
        let mut status = self.status();
        let changes_before = self.describe_changes();
        report.writes_pending = status.writes;
        report.bytes_pending = status.bytes;
        report.namespace_pending = status.namespace;

        for ino in self.sorted_inos() {
            let node = &self.inodes[&ino];
            if node.pending.is_empty() {
                continue;
            }
            let fd = node.fd.as_ref().expect("files have fds");
            // Units to apply: (op, byte range of a write to keep, or None for the whole op).
            let mut units: Vec<(usize, Option<(u64, u64)>)> = Vec::new();
            for (i, op) in node.pending.iter().enumerate() {
                if keep_all {
                    units.push((i, None));
                    report.writes_kept += 1;
                    report.bytes_kept += op.payload();
                    continue;
                }
                if !random_data {
                    report.writes_dropped += 1;
                    continue;
                }
                match rng.below(3) {
                    0 => report.writes_dropped += 1,
                    1 => {
                        units.push((i, None));
                        report.writes_kept += 1;
                        report.bytes_kept += op.payload();
                    }
                    _ => match op {
                        Pending::Write { off, data } => {
                            let end = off + data.len() as u64;
                            let sectors = sectors(*off, end);
                            let kept: Vec<(u64, u64)> =
                                sectors.iter().copied().filter(|_| rng.coin()).collect();
                            if kept.is_empty() {
                                report.writes_dropped += 1;
                            } else {
                                if kept.len() == sectors.len() {
                                    report.writes_kept += 1;
                                } else {
                                    report.writes_torn += 1;
                                }
                                for r in kept {
                                    report.bytes_kept += r.1 - r.0;
                                    units.push((i, Some(r)));
                                }
                            }
                        }
                        // Not a write: cannot tear; a coin decides.
                        _ if rng.coin() => {
                            units.push((i, None));
                            report.writes_kept += 1;
                        }
                        _ => report.writes_dropped += 1,
                    },
                }
            }
            if random_data {
                rng.shuffle(&mut units);
            }
            for (i, range) in units {
                let op = &node.pending[i];
                let result = match (op, range) {
                    (Pending::Write { off, data }, Some((a, b))) => fd
                        .write_all_at(&data[(a - off) as usize..(b - off) as usize], a)
                        .map_err(Errno::from),
                    _ => apply_to_backing(fd, op),
                };
                if let Err(e) = result {
                    eprintln!(
                        "powercut-fs: cut: applying a kept write to inode {ino} failed: errno {}",
                        e.0
                    );
                }
            }
            if self.fsync_backing {
                let _ = fd.sync_data();
            }
        }
        for node in self.inodes.values_mut() {
            node.pending.clear();
        }

        if keep_all {
            if let Err(e) = self.sync_all_dirs() {
                eprintln!(
                    "powercut-fs: cut: keep-all could not apply every directory entry: errno {}",
                    e.0
                );
            }
            status = self.status();
            report.namespace_kept = report.namespace_pending - status.namespace;
            report.namespace_dropped = status.namespace;
        } else if random_names {
            // Entry changes that share an inode (the two names of a rename, a rename over an
            // existing name) form one operation: kept or lost together, as a journaling
            // filesystem commits a rename whole.
            let mut changes: Vec<(u64, OsString, Option<u64>, Option<u64>)> = Vec::new();
            for dir in self.sorted_inos() {
                if !self
                    .inodes
                    .get(&dir)
                    .and_then(|n| n.dir.as_ref())
                    .is_some_and(|d| d.loaded)
                {
                    continue;
                }
                let Ok(names) = self.changed_names(dir) else {
                    continue;
                };
                let Ok(d) = self.dir(dir) else { continue };
                for name in names {
                    let (old, new) = (d.durable.get(&name).copied(), d.live.get(&name).copied());
                    changes.push((dir, name, old, new));
                }
            }
            let mut group: Vec<usize> = (0..changes.len()).collect();
            fn root(group: &mut [usize], mut i: usize) -> usize {
                while group[i] != i {
                    group[i] = group[group[i]];
                    i = group[i];
                }
                i
            }
            let mut by_inode: HashMap<u64, usize> = HashMap::new();
            for (i, (_, _, old, new)) in changes.iter().enumerate() {
                for ino in [old, new].into_iter().flatten() {
                    match by_inode.get(ino) {
                        Some(&j) => {
                            let (a, b) = (root(&mut group, i), root(&mut group, j));
                            group[a] = b;
                        }
                        None => {
                            by_inode.insert(*ino, i);
                        }
                    }
                }
            }
            let mut keep_group: HashMap<usize, bool> = HashMap::new();
            for (i, (dir, name, _, _)) in changes.iter().enumerate() {
                let g = root(&mut group, i);
                let keep = *keep_group.entry(g).or_insert_with(|| rng.coin());
                if !keep {
                    continue;
                }
                // An earlier change (a directory removed with its contents, a directory moved)
                // may have settled this one already.
                let Ok(d) = self.dir(*dir) else { continue };
                let new = d.live.get(name).copied();
                if d.durable.get(name).copied() == new {
                    continue;
                }
                if let Err(e) = self.apply_entry(*dir, name, new) {
                    eprintln!(
                        "powercut-fs: cut: keeping entry {name:?} failed: errno {}",
                        e.0
                    );
                }
            }
            let left = self.status().namespace;
            report.namespace_dropped = left.min(report.namespace_pending);
            report.namespace_kept = report.namespace_pending - report.namespace_dropped;
        } else {
            report.namespace_dropped = report.namespace_pending;
        }
        // Name what was lost: the first thing to look at when a test finds a file missing.
        let lost: Vec<&String> = changes_before
            .iter()
            .filter(|(dir, name, _)| {
                self.dir(*dir)
                    .map(|d| d.durable.get(name) != d.live.get(name))
                    .unwrap_or(true)
            })
            .map(|(_, _, what)| what)
            .collect();
        for what in lost.iter().take(50) {
            eprintln!("powercut-fs: cut: lost directory entry change: {what}");
        }
        if lost.len() > 50 {
            eprintln!(
                "powercut-fs: cut: ... and {} more lost directory entry changes",
                lost.len() - 50
            );
        }
        if let Err(e) = std::fs::remove_dir_all(&self.staging) {
            eprintln!("powercut-fs: cut: removing {}: {e}", self.staging.display());
        }
        report
    }

    /// Clean shutdown: everything becomes durable, staging is removed.
    pub fn shutdown(&mut self) -> Res<()> {
        let result = self.sync_all();
        self.dead = true;
        if let Err(e) = std::fs::remove_dir_all(&self.staging) {
            eprintln!("powercut-fs: removing {}: {e}", self.staging.display());
        }
        result
    }
}

/// Sector pieces of `[off, end)`, cut at absolute sector boundaries.
fn sectors(off: u64, end: u64) -> Vec<(u64, u64)> {
    let sector = sector_bytes();
    let mut out = Vec::new();
    let mut a = off;
    while a < end {
        let b = ((a / sector + 1) * sector).min(end);
        out.push((a, b));
        a = b;
    }
    out
}

/// Gives the inode behind `fd` the name `path` (the inode must have a link count above zero).
fn link_fd(fd: libc::c_int, path: &Path) -> Res<()> {
    let to = cpath(path)?;
    // SAFETY: linkat with valid fds and NUL-terminated paths.
    let ret = unsafe {
        libc::linkat(
            fd,
            c"".as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    if ret == 0 {
        return Ok(());
    }
    // Without CAP_DAC_READ_SEARCH, AT_EMPTY_PATH fails: go through /proc instead.
    let from = CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
    // SAFETY: as above.
    cvt(unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sectors_cut_at_absolute_boundaries() {
        assert_eq!(sectors(0, 1024), vec![(0, 512), (512, 1024)]);
        assert_eq!(
            sectors(100, 1100),
            vec![(100, 512), (512, 1024), (1024, 1100)]
        );
        assert_eq!(sectors(5, 6), vec![(5, 6)]);
    }

    #[test]
    fn overlay_applies_in_order() {
        let mut buf = vec![1u8; 8];
        overlay(
            &mut buf,
            4,
            &Pending::Write {
                off: 2,
                data: vec![9; 4],
            },
        );
        assert_eq!(buf, [9, 9, 1, 1, 1, 1, 1, 1]);
        overlay(&mut buf, 4, &Pending::SetSize(10));
        assert_eq!(buf, [9, 9, 1, 1, 1, 1, 0, 0]);
        overlay(
            &mut buf,
            4,
            &Pending::Fallocate {
                mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off: 5,
                len: 2,
            },
        );
        assert_eq!(buf, [9, 0, 0, 1, 1, 1, 0, 0]);
        overlay(
            &mut buf,
            4,
            &Pending::Fallocate {
                mode: 0,
                off: 0,
                len: 100,
            },
        );
        assert_eq!(buf, [9, 0, 0, 1, 1, 1, 0, 0]);
    }
}
