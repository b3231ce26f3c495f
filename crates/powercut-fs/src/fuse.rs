//! The FUSE adapter: every kernel request locks the [`State`], and is answered EIO once a cut or
//! an unmount has started. Every reply carries a zero TTL and every open uses direct I/O, so
//! the kernel caches neither data nor names: every read and write reaches the daemon.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    Errno as FErrno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow,
    WriteFlags,
};

use crate::model::{Attr, Errno, Kind, SetAttr, State};

const TTL: Duration = Duration::ZERO;

pub struct PowercutFilesystem {
    state: Arc<Mutex<State>>,
}

impl PowercutFilesystem {
    pub fn new(state: Arc<Mutex<State>>) -> PowercutFilesystem {
        PowercutFilesystem { state }
    }

    /// The state, or EIO once the power is gone.
    fn live(&self) -> Result<MutexGuard<'_, State>, FErrno> {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if guard.dead {
            return Err(FErrno::EIO);
        }
        Ok(guard)
    }
}

fn errno(e: Errno) -> FErrno {
    FErrno::from_i32(e.0)
}

fn file_type(mode_type: u32) -> FileType {
    match mode_type {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

fn fuse_attr(a: &Attr) -> FileAttr {
    let kind = match a.kind {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
        Kind::Other => file_type(a.file_type),
    };
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.blocks,
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.ctime,
        kind,
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: 4096,
        flags: 0,
    }
}

fn time_or_now(t: Option<TimeOrNow>) -> Option<Option<SystemTime>> {
    t.map(|t| match t {
        TimeOrNow::SpecificTime(t) => Some(t),
        TimeOrNow::Now => None,
    })
}

fn entry(reply: ReplyEntry, result: Result<Attr, Errno>) {
    match result {
        Ok(a) => reply.entry(&TTL, &fuse_attr(&a), Generation(0)),
        Err(e) => reply.error(errno(e)),
    }
}

fn empty(reply: ReplyEmpty, result: Result<(), Errno>) {
    match result {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    }
}

macro_rules! live_or_reply {
    ($self:ident, $reply:ident) => {
        match $self.live() {
            Ok(state) => state,
            Err(e) => return $reply.error(e),
        }
    };
}

impl Filesystem for PowercutFilesystem {
    fn init(&mut self, _req: &Request, _config: &mut KernelConfig) -> std::io::Result<()> {
        // No FUSE_WRITEBACK_CACHE is requested (fuser does not by default): writes are never
        // held in the kernel.
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut st = live_or_reply!(self, reply);
        entry(reply, st.lookup(parent.0, name));
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        if let Ok(mut st) = self.live() {
            st.forget(ino.0, nlookup);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let st = live_or_reply!(self, reply);
        match st.attr(ino.0) {
            Ok(a) => reply.attr(&TTL, &fuse_attr(&a)),
            Err(e) => reply.error(errno(e)),
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
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut st = live_or_reply!(self, reply);
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: time_or_now(atime),
            mtime: time_or_now(mtime),
        };
        match st.setattr(ino.0, &set) {
            Ok(a) => reply.attr(&TTL, &fuse_attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let st = live_or_reply!(self, reply);
        match st.readlink(ino.0) {
            Ok(target) => reply.data(&target),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        let mut st = live_or_reply!(self, reply);
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(FErrno::from_i32(libc::EOPNOTSUPP));
        }
        entry(
            reply,
            st.create(parent.0, name, mode & !umask, req.uid(), req.gid(), None),
        );
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut st = live_or_reply!(self, reply);
        entry(
            reply,
            st.mkdir(parent.0, name, mode & !umask, req.uid(), req.gid()),
        );
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut st = live_or_reply!(self, reply);
        empty(reply, st.unlink(parent.0, name));
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let mut st = live_or_reply!(self, reply);
        empty(reply, st.rmdir(parent.0, name));
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let mut st = live_or_reply!(self, reply);
        entry(
            reply,
            st.create(
                parent.0,
                link_name,
                0o777,
                req.uid(),
                req.gid(),
                Some(target),
            ),
        );
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
        let mut st = live_or_reply!(self, reply);
        empty(
            reply,
            st.rename(parent.0, name, newparent.0, newname, flags.bits()),
        );
    }

    fn link(
        &self,
        _req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut st = live_or_reply!(self, reply);
        entry(reply, st.link(ino.0, newparent.0, newname));
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut st = live_or_reply!(self, reply);
        match st.open(ino.0) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let st = live_or_reply!(self, reply);
        match st.read(ino.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut st = live_or_reply!(self, reply);
        // O_SYNC/O_DSYNC opens and RWF_DSYNC/RWF_SYNC writes arrive with O_DSYNC set: such a
        // write is durable when it returns (with everything written to the file before it,
        // as a real flush would do).
        let sync = flags.0 & libc::O_DSYNC != 0;
        match st.write(ino.0, offset, data) {
            Ok(n) if sync => match st.fsync(ino.0) {
                Ok(()) => reply.written(n),
                Err(e) => reply.error(errno(e)),
            },
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno(e)),
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
        // close() makes nothing durable.
        let _st = live_or_reply!(self, reply);
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut st = live_or_reply!(self, reply);
        st.release(ino.0);
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut st = live_or_reply!(self, reply);
        empty(reply, st.fsync(ino.0));
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let mut st = live_or_reply!(self, reply);
        match st.opendir(ino.0) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut st = live_or_reply!(self, reply);
        match st.readdir(ino.0, fh.0, offset) {
            Ok(entries) => {
                for (i, e) in entries.iter().enumerate() {
                    if reply.add(
                        INodeNo(e.ino),
                        offset + i as u64 + 1,
                        file_type(e.file_type),
                        &e.name,
                    ) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let mut st = live_or_reply!(self, reply);
        st.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut st = live_or_reply!(self, reply);
        empty(reply, st.fsyncdir(ino.0));
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let st = live_or_reply!(self, reply);
        match st.statfs() {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut st = live_or_reply!(self, reply);
        let attr = match st.create(parent.0, name, mode & !umask, req.uid(), req.gid(), None) {
            Ok(a) => a,
            Err(Errno(libc::EEXIST)) if flags & libc::O_EXCL == 0 => {
                match st.lookup(parent.0, name) {
                    Ok(a) => a,
                    Err(e) => return reply.error(errno(e)),
                }
            }
            Err(e) => return reply.error(errno(e)),
        };
        match st.open(attr.ino) {
            Ok(fh) => reply.created(
                &TTL,
                &fuse_attr(&attr),
                Generation(0),
                FileHandle(fh),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut st = live_or_reply!(self, reply);
        empty(reply, st.fallocate(ino.0, offset, length, mode));
    }
}
