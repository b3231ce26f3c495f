//! [`UringFile`]: reads and writes through bounce buffers, in pieces of at most
//! `max_op_bytes`, continuing short transfers.

use super::op::{acquire, Op, OwnedGrant};
use super::ring::Urgency;
use super::UringConfig;
use crate::fs::std_fs::blocking;
use crate::fs::{DiskBuf, DiskFile, IoMode, DIRECT_IO_ALIGNMENT_BYTES};
use bytes::Bytes;
use io_uring::{opcode, types};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A file opened by [`super::UringFs`]. It may be sent between threads; each operation runs on the
/// ring of the thread that awaits it (its future cannot move to another thread).
#[derive(Clone, Debug)]
pub struct UringFile {
    file: Arc<File>,
    path: PathBuf,
    mode: IoMode,
    config: UringConfig,
}

impl UringFile {
    pub(super) fn new(file: File, path: PathBuf, mode: IoMode, config: UringConfig) -> UringFile {
        UringFile {
            file: Arc::new(file),
            path,
            mode,
            config,
        }
    }
}

const ALIGN: u64 = DIRECT_IO_ALIGNMENT_BYTES;

/// A write with `RWF_DSYNC` is a commit a client waits on: it goes to the kernel at once.
fn urgency_of(rw_flags: i32) -> Urgency {
    if rw_flags & libc::RWF_DSYNC != 0 {
        Urgency::Now
    } else {
        Urgency::Batched
    }
}

fn bounce_ptr_at(grant: &mut OwnedGrant, at: usize) -> *const u8 {
    grant.ptr_at(at)
}

fn align_down(x: u64) -> u64 {
    x / ALIGN * ALIGN
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

/// The end of `[offset, offset + len)`, if the kernel can address it (offsets are signed).
fn checked_end(offset: u64, len: u64) -> io::Result<u64> {
    offset
        .checked_add(len)
        .filter(|&end| end <= i64::MAX as u64)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Times an operation is resubmitted after `EINTR` or `EAGAIN` before the error is returned.
const MAX_RETRIES: u32 = 64;

impl UringFile {
    fn raw_fd(&self) -> types::Fd {
        types::Fd(self.file.as_raw_fd())
    }

    fn direct(&self) -> bool {
        self.mode == IoMode::Direct
    }

    /// Runs one operation built by `build` (given the grant, to point into its buffer),
    /// retrying on `EINTR`/`EAGAIN`; returns the non-negative result and the grant.
    async fn run(
        &self,
        mut grant: OwnedGrant,
        urgency: Urgency,
        build: impl Fn(&mut OwnedGrant) -> io_uring::squeue::Entry,
    ) -> io::Result<(u32, OwnedGrant)> {
        let mut retries = 0;
        loop {
            let entry = build(&mut grant);
            // SAFETY: `build` points the entry only into `grant`'s memory (its bounce buffer,
            // read target or write source), and the entry's fd is `self.file`'s, both handed
            // to the ring with the entry.
            let op = unsafe { Op::start(entry, grant, self.file.clone(), urgency)? };
            let (result, back) = op.await?;
            grant = back;
            if result >= 0 {
                return Ok((result as u32, grant));
            }
            let errno = -result;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && retries < MAX_RETRIES {
                retries += 1;
                continue;
            }
            return Err(io::Error::from_raw_os_error(errno));
        }
    }

    /// Reads `len` bytes at `pos` (aligned in Direct mode) into a bounce buffer; returns it
    /// with the number of bytes read (fewer only at the end of the file).
    async fn read_piece(&self, pos: u64, len: usize) -> io::Result<(OwnedGrant, usize)> {
        let grant = acquire(&self.config, len).await?;
        self.read_into(grant, OwnedGrant::ptr_at, pos, len).await
    }

    /// Reads `len` bytes at `pos` into the grant's memory that `ptr_at` points the kernel to
    /// (its bounce buffer or its read target), in operations of at most `max_op_bytes`,
    /// continuing short reads; returns the grant with the number of bytes read (fewer only at
    /// the end of the file).
    async fn read_into(
        &self,
        mut grant: OwnedGrant,
        ptr_at: fn(&mut OwnedGrant, usize) -> *mut u8,
        pos: u64,
        len: usize,
    ) -> io::Result<(OwnedGrant, usize)> {
        let mut have = 0usize;
        while have < len {
            // In Direct mode a short read can end unaligned (at the end of the file): go on
            // from the aligned offset below it; a read that brings nothing new is the end.
            let at = if self.direct() {
                align_down(have as u64) as usize
            } else {
                have
            };
            let piece = (len - at).min(self.config.max_op_bytes);
            let (n, back) = self
                .run(grant, Urgency::Batched, |g| {
                    opcode::Read::new(self.raw_fd(), ptr_at(g, at), piece as u32)
                        .offset(pos + at as u64)
                        .build()
                })
                .await?;
            grant = back;
            let reached = at + n as usize;
            if reached <= have {
                break;
            }
            have = reached;
        }
        Ok((grant, have))
    }

    /// Writes `data` (at most `max_op_bytes`) at `pos` with `rw_flags`, continuing short writes.
    async fn write_piece(&self, data: &[u8], pos: u64, rw_flags: i32) -> io::Result<()> {
        let mut grant = acquire(&self.config, data.len()).await?;
        grant.buf_mut()[..data.len()].copy_from_slice(data);
        self.write_from_grant(grant, bounce_ptr_at, pos, data.len(), rw_flags)
            .await
    }

    /// Writes `len` bytes from the grant's memory (`ptr_at`) at `pos`, resuming after short
    /// writes.
    async fn write_from_grant(
        &self,
        mut grant: OwnedGrant,
        ptr_at: fn(&mut OwnedGrant, usize) -> *const u8,
        pos: u64,
        len: usize,
        rw_flags: i32,
    ) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let piece = (len - done).min(self.config.max_op_bytes);
            let (n, back) = self
                .run(grant, urgency_of(rw_flags), |g| {
                    opcode::Write::new(self.raw_fd(), ptr_at(g, done), piece as u32)
                        .offset(pos + done as u64)
                        .rw_flags(rw_flags)
                        .build()
                })
                .await?;
            grant = back;
            let mut reached = done + n as usize;
            if self.direct() {
                // Rewrite from the aligned offset below a short, unaligned end.
                reached = align_down(reached as u64) as usize;
            }
            if reached <= done {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    format!("write at {} made no progress", pos + done as u64),
                ));
            }
            done = reached;
        }
        Ok(())
    }

    async fn write_with_flags(&self, buf: &[u8], offset: u64, rw_flags: i32) -> io::Result<()> {
        checked_end(offset, buf.len() as u64)?;
        if self.direct()
            && !(offset.is_multiple_of(ALIGN) && (buf.len() as u64).is_multiple_of(ALIGN))
        {
            // The kernel's own answer to a misaligned O_DIRECT write.
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let mut pos = offset;
        for piece in buf.chunks(self.config.max_op_bytes) {
            self.write_piece(piece, pos, rw_flags).await?;
            pos += piece.len() as u64;
        }
        Ok(())
    }

    async fn fallocate(&self, mode: i32, offset: u64, length: u64) -> io::Result<()> {
        checked_end(offset, length)?;
        let grant = acquire(&self.config, 0).await?;
        self.run(grant, Urgency::Batched, |_| {
            opcode::Fallocate::new(self.raw_fd(), length)
                .offset(offset)
                .mode(mode)
                .build()
        })
        .await?;
        Ok(())
    }

    /// Makes `[offset, offset + length)` read as zeros by writing zeros, without growing the
    /// file: the last resort of `punch_hole` where fallocate cannot. In Direct mode, partial
    /// blocks at the edges are read, zeroed in part and written back.
    async fn write_zeros(&self, offset: u64, length: u64) -> io::Result<()> {
        let size = self.len().await?;
        let end = checked_end(offset, length)?.min(size);
        let max_piece = self.config.max_op_bytes as u64;
        let mut pos = offset;
        while pos < end {
            let block = align_down(pos);
            let whole_blocks = align_down(end).saturating_sub(pos).min(max_piece);
            if self.direct() && (pos != block || whole_blocks == 0) {
                let piece_end = (block + ALIGN).min(end);
                let mut data = vec![0u8; ALIGN as usize];
                self.read_at(&mut data, block).await?;
                data[(pos - block) as usize..(piece_end - block) as usize].fill(0);
                self.write_at(&data, block).await?;
                if block + ALIGN > size {
                    // The block went past the end of the file: give the file its size back.
                    self.set_len(size).await?;
                }
                pos = piece_end;
            } else {
                let piece = if self.direct() {
                    whole_blocks
                } else {
                    (end - pos).min(max_piece)
                };
                self.write_at(&vec![0u8; piece as usize], pos).await?;
                pos += piece;
            }
        }
        Ok(())
    }
}

impl DiskFile for UringFile {
    async fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = checked_end(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut pos = align_down(offset);
        let last = align_up(end);
        while pos < end {
            let piece = (last - pos).min(self.config.max_op_bytes as u64);
            let (grant, got) = self.read_piece(pos, piece as usize).await?;
            // Copy out the part of [pos, pos + piece) that the caller asked for.
            let want_start = pos.max(offset);
            let want_end = (pos + piece).min(end);
            let valid_end = want_end.min(pos + got as u64);
            if valid_end > want_start {
                let from = &grant.buf()[(want_start - pos) as usize..(valid_end - pos) as usize];
                buf[(want_start - offset) as usize..(valid_end - offset) as usize]
                    .copy_from_slice(from);
            }
            if valid_end < want_end {
                // The file ends here: the rest reads as zeros.
                buf[(valid_end.max(want_start) - offset) as usize..].fill(0);
                return Ok(());
            }
            pos += piece;
        }
        Ok(())
    }

    async fn read_new(&self, offset: u64, len: usize) -> io::Result<DiskBuf> {
        checked_end(offset, len as u64)?;
        let aligned = offset.is_multiple_of(ALIGN) && (len as u64).is_multiple_of(ALIGN);
        if !self.direct() || !aligned || len == 0 {
            let mut buf = DiskBuf::zeroed(len);
            self.read_at(buf.as_mut_slice(), offset).await?;
            return Ok(buf);
        }
        let mut grant = acquire(&self.config, 0).await?;
        // SAFETY: nothing reads the buffer before every byte of it is written, below: by the
        // kernel's reads, then zeros past the end of the file.
        grant.set_target(unsafe { DiskBuf::uninit(len) });
        let (mut grant, have) = self
            .read_into(grant, OwnedGrant::target_ptr_at, offset, len)
            .await?;
        let mut buf = grant
            .take_target()
            .expect("a read target comes back with its grant");
        // SAFETY: `[have, len)` lies within the buffer; writing zeros there initialises it.
        unsafe { std::ptr::write_bytes(buf.as_mut_ptr_at(have), 0, len - have) };
        Ok(buf)
    }

    async fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_with_flags(buf, offset, 0).await
    }

    async fn write_durable_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_with_flags(buf, offset, libc::RWF_DSYNC).await
    }

    async fn write_from(&self, data: Bytes, offset: u64, durable: bool) -> io::Result<()> {
        let rw_flags = if durable { libc::RWF_DSYNC } else { 0 };
        let len = data.len();
        let aligned = offset.is_multiple_of(ALIGN)
            && (len as u64).is_multiple_of(ALIGN)
            && (data.as_ptr() as u64).is_multiple_of(ALIGN);
        if !self.direct() || !aligned || len == 0 {
            return self.write_with_flags(&data, offset, rw_flags).await;
        }
        checked_end(offset, len as u64)?;
        let mut grant = acquire(&self.config, 0).await?;
        grant.set_source(data);
        self.write_from_grant(grant, OwnedGrant::source_ptr_at, offset, len, rw_flags)
            .await
    }

    async fn sync_data(&self) -> io::Result<()> {
        let grant = acquire(&self.config, 0).await?;
        self.run(grant, Urgency::Batched, |_| {
            opcode::Fsync::new(self.raw_fd())
                .flags(types::FsyncFlags::DATASYNC)
                .build()
        })
        .await?;
        Ok(())
    }

    async fn punch_hole(&self, offset: u64, length: u64) -> io::Result<()> {
        let keep = libc::FALLOC_FL_KEEP_SIZE;
        let not_supported = |e: &io::Error| e.raw_os_error() == Some(libc::EOPNOTSUPP);
        match self
            .fallocate(libc::FALLOC_FL_PUNCH_HOLE | keep, offset, length)
            .await
        {
            Err(e) if not_supported(&e) => {}
            other => return other,
        }
        match self
            .fallocate(libc::FALLOC_FL_ZERO_RANGE | keep, offset, length)
            .await
        {
            Err(e) if not_supported(&e) => self.write_zeros(offset, length).await,
            other => other,
        }
    }

    async fn allocate(&self, offset: u64, length: u64) -> io::Result<()> {
        self.fallocate(0, offset, length).await
    }

    async fn len(&self) -> io::Result<u64> {
        // fstat of an open file reads the in-memory inode; it does not wait for the disk.
        Ok(self.file.metadata()?.len())
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        let file = self.file.clone();
        blocking(move || file.set_len(len)).await
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn mode(&self) -> IoMode {
        self.mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::uring::UringFs;
    use crate::fs::Filesystem;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// The last-resort zeroing of `punch_hole`, in both modes, with unaligned edges.
    #[test]
    fn write_zeros_zeroes_without_growing_the_file() {
        let dir = tempfile::tempdir().unwrap();
        runtime().block_on(async {
            for prefer_direct in [true, false] {
                let fs = UringFs::new(UringConfig {
                    prefer_direct,
                    max_op_bytes: 8192,
                    bounce_pool_bytes: 64 << 10,
                    ..Default::default()
                })
                .unwrap();
                let path = dir.path().join(format!("z{prefer_direct}"));
                let file = fs.open(&path, true).await.unwrap();
                let size = 40960u64;
                let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8 + 1).collect();
                file.write_at(&data, 0).await.unwrap();
                // Make the size unaligned.
                file.set_len(size - 100).await.unwrap();
                let (start, length) = (1000u64, 50_000u64);
                file.write_zeros(start, length).await.unwrap();
                assert_eq!(file.len().await.unwrap(), size - 100);
                let mut back = vec![0u8; (size - 100) as usize];
                file.read_at(&mut back, 0).await.unwrap();
                assert_eq!(&back[..1000], &data[..1000]);
                assert!(back[1000..].iter().all(|&b| b == 0));
                let (start, length) = (5000u64, 10_000u64);
                file.write_at(&data[..32768], 0).await.unwrap();
                file.write_zeros(start, length).await.unwrap();
                file.read_at(&mut back[..32768], 0).await.unwrap();
                assert_eq!(&back[..5000], &data[..5000]);
                assert!(back[5000..15000].iter().all(|&b| b == 0));
                assert_eq!(&back[15000..32768], &data[15000..32768]);
            }
        });
    }
}
