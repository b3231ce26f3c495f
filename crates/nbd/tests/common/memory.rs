//! A sparse in-memory `BlockDevice` (4 KiB blocks in a HashMap, absent blocks are holes)
//! and a registry of named memory exports. Shared by the tests and the example server.

use ashlar_core::{check_range, BlockDevice, BlockStatusRun, IoError, IoResult};
use ashlar_nbd::{ExportInfo, ExportRegistry};
use bytes::Bytes;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::Duration;

pub const BLOCK: u64 = 4096;

#[derive(Default)]
struct Inner {
    size: u64,
    blocks: RefCell<HashMap<u64, Box<[u8]>>>,
    /// Device calls that reached the data (range checks included).
    calls: Cell<u64>,
    /// When set, every call fails with this error (fault injection).
    fail: RefCell<Option<IoError>>,
    /// Reads starting at this offset wait this long first (to reorder replies).
    read_delay: Cell<Option<(u64, Duration)>>,
}

/// Cloning shares the data, like two handles of one vdisk.
#[derive(Clone)]
pub struct MemoryDevice {
    inner: Rc<Inner>,
}

impl MemoryDevice {
    pub fn new(size: u64) -> Self {
        Self {
            inner: Rc::new(Inner {
                size,
                ..Inner::default()
            }),
        }
    }

    pub fn calls(&self) -> u64 {
        self.inner.calls.get()
    }

    pub fn fail_with(&self, error: Option<IoError>) {
        *self.inner.fail.borrow_mut() = error;
    }

    pub fn delay_reads_at(&self, offset: u64, delay: Duration) {
        self.inner.read_delay.set(Some((offset, delay)));
    }

    pub fn allocated_blocks(&self) -> usize {
        self.inner.blocks.borrow().len()
    }

    /// Synchronous read for test assertions (no range check, no call counting).
    pub fn contents(&self, offset: u64, length: usize) -> Vec<u8> {
        let mut out = vec![0u8; length];
        let blocks = self.inner.blocks.borrow();
        for (index, start, range) in pieces(offset, length) {
            if let Some(block) = blocks.get(&index) {
                out[range.clone()].copy_from_slice(&block[start..start + range.len()]);
            }
        }
        out
    }

    /// Synchronous write for test setup.
    pub fn fill(&self, offset: u64, data: &[u8]) {
        let mut blocks = self.inner.blocks.borrow_mut();
        for (index, start, range) in pieces(offset, data.len()) {
            let block = blocks
                .entry(index)
                .or_insert_with(|| vec![0u8; BLOCK as usize].into());
            block[start..start + range.len()].copy_from_slice(&data[range]);
        }
    }

    fn enter(&self, offset: u64, length: u64) -> IoResult<()> {
        self.inner.calls.set(self.inner.calls.get() + 1);
        if let Some(error) = self.inner.fail.borrow().clone() {
            return Err(error);
        }
        check_range(offset, length, self.inner.size)
    }

    /// Zeroes `[offset, offset+length)`; whole blocks become holes when `punch`.
    fn zero(&self, offset: u64, length: u64, punch: bool) {
        let mut blocks = self.inner.blocks.borrow_mut();
        let end = offset + length;
        let mut at = offset;
        while at < end {
            let index = at / BLOCK;
            let start = (at % BLOCK) as usize;
            let stop = ((end - index * BLOCK).min(BLOCK)) as usize;
            if start == 0 && stop == BLOCK as usize && punch {
                blocks.remove(&index);
            } else if let Some(block) = blocks.get_mut(&index) {
                block[start..stop].fill(0);
            } else if !punch {
                blocks.insert(index, vec![0u8; BLOCK as usize].into());
            }
            at = index * BLOCK + stop as u64;
        }
    }
}

impl BlockDevice for MemoryDevice {
    fn size_bytes(&self) -> u64 {
        self.inner.size
    }

    async fn read(&self, offset: u64, length: u32) -> IoResult<Bytes> {
        self.enter(offset, u64::from(length))?;
        if let Some((at, delay)) = self.inner.read_delay.get() {
            if at == offset {
                tokio::time::sleep(delay).await;
            }
        }
        Ok(Bytes::from(self.contents(offset, length as usize)))
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> IoResult<()> {
        self.enter(offset, data.len() as u64)?;
        self.fill(offset, &data);
        Ok(())
    }

    async fn flush(&self) -> IoResult<()> {
        self.enter(0, 0)
    }

    async fn trim(&self, offset: u64, length: u32) -> IoResult<()> {
        self.enter(offset, u64::from(length))?;
        self.zero(offset, u64::from(length), true);
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, length: u32, may_punch_hole: bool) -> IoResult<()> {
        self.enter(offset, u64::from(length))?;
        self.zero(offset, u64::from(length), may_punch_hole);
        Ok(())
    }

    async fn block_status(&self, offset: u64, length: u32) -> IoResult<Vec<BlockStatusRun>> {
        self.enter(offset, u64::from(length))?;
        let blocks = self.inner.blocks.borrow();
        let end = offset + u64::from(length);
        let mut runs: Vec<BlockStatusRun> = Vec::new();
        let mut at = offset;
        while at < end {
            let index = at / BLOCK;
            let next = ((index + 1) * BLOCK).min(end);
            let (hole, zero) = match blocks.get(&index) {
                None => (true, true),
                Some(block) => (false, block.iter().all(|b| *b == 0)),
            };
            match runs.last_mut() {
                Some(last) if last.hole == hole && last.zero == zero => last.length += next - at,
                _ => runs.push(BlockStatusRun {
                    length: next - at,
                    hole,
                    zero,
                }),
            }
            at = next;
        }
        Ok(runs)
    }
}

/// Splits `[offset, offset+length)` at block boundaries: (block index, offset in the
/// block, range in the caller's buffer).
fn pieces(
    offset: u64,
    length: usize,
) -> impl Iterator<Item = (u64, usize, std::ops::Range<usize>)> {
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= length {
            return None;
        }
        let at = offset + done as u64;
        let start = (at % BLOCK) as usize;
        let take = (BLOCK as usize - start).min(length - done);
        let piece = (at / BLOCK, start, done..done + take);
        done += take;
        Some(piece)
    })
}

/// Named memory exports.
#[derive(Default)]
pub struct MemoryRegistry {
    exports: Vec<(ExportInfo, MemoryDevice)>,
}

impl MemoryRegistry {
    pub fn add(&mut self, name: &str, description: &str, device: MemoryDevice) {
        let info = ExportInfo {
            name: name.to_string(),
            description: description.to_string(),
        };
        self.exports.push((info, device));
    }

    pub fn device(&self, name: &str) -> MemoryDevice {
        self.find(name).expect("test export exists")
    }

    fn find(&self, name: &str) -> Result<MemoryDevice, String> {
        self.exports
            .iter()
            .find(|(info, _)| info.name == name)
            .map(|(_, device)| device.clone())
            .ok_or_else(|| format!("no export named {name:?}"))
    }
}

impl ExportRegistry for MemoryRegistry {
    type Device = MemoryDevice;

    fn list_exports(&self) -> Vec<ExportInfo> {
        self.exports.iter().map(|(info, _)| info.clone()).collect()
    }

    async fn open_export(&self, name: &str) -> Result<MemoryDevice, String> {
        self.find(name)
    }
}
