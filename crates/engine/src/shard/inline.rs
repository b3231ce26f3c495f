//! Cached reads answered by the connection's own code, with no message to the controller.
//!
//! A read of whole cached blocks owned by a controller on the connection's reactor costs no
//! task, no message and no wakeup: the connection looks the range up in the controller's
//! oplog index (anything newer than the cache lives there) and copies the blocks from the
//! reactor's cache. It runs synchronously between two of the controller's events, so it sees
//! the controller's state as of its last applied event.

use super::{ShardKey, Storage};
use crate::cache::{BlockCache, CacheKey};
use ashlar_core::BLOCK_SIZE_BYTES;
use bytes::{Bytes, BytesMut};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

/// Longest read answered from the cache without the controller (larger reads are rarely all
/// cached and would hold the reactor while they are copied).
pub const MAX_INLINE_READ_BYTES: u64 = 128 * 1024;

/// What an inline read needs of a controller.
pub(super) struct InlineReader {
    key: ShardKey,
    storage: Rc<Storage>,
    cache: Rc<RefCell<BlockCache>>,
    /// True from the gate opening until retirement starts.
    serving: Cell<bool>,
}

thread_local! {
    /// The shard controllers of this reactor that may answer inline reads.
    static LOCAL_SHARDS: RefCell<HashMap<ShardKey, Rc<InlineReader>>> = RefCell::default();
}

/// A controller's entry in its reactor's table; removes it when dropped, however the
/// controller ends.
pub(super) struct Registration(Rc<InlineReader>);

impl Registration {
    pub(super) fn set_serving(&self, serving: bool) {
        self.0.serving.set(serving);
    }

    /// The same lookup the inline path makes, for the controller's own cached answers.
    pub(super) fn read_cached(&self, offset: u64, length: u64) -> Option<Bytes> {
        self.0.read_cached(offset, length)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // During thread teardown the table may already be gone; nothing to remove then.
        let key = self.0.key;
        let _ = LOCAL_SHARDS.try_with(|shards| shards.borrow_mut().remove(&key));
    }
}

pub(super) fn register(
    key: ShardKey,
    storage: Rc<Storage>,
    cache: Rc<RefCell<BlockCache>>,
) -> Registration {
    let reader = Rc::new(InlineReader {
        key,
        storage,
        cache,
        serving: Cell::new(false),
    });
    LOCAL_SHARDS.with(|shards| shards.borrow_mut().insert(key, reader.clone()));
    Registration(reader)
}

/// Serves a read from the cache of a controller on this reactor, if the controller is
/// serving and every block of the range is cached with nothing newer in its oplog.
pub fn read_cached_now(key: ShardKey, offset: u64, length: u64) -> Option<Bytes> {
    let reader = LOCAL_SHARDS.with(|shards| shards.borrow().get(&key).cloned())?;
    if !reader.serving.get() {
        return None;
    }
    reader.read_cached(offset, length)
}

pub(super) fn block_range(offset: u64, length: u64) -> std::ops::Range<u64> {
    let first = offset / BLOCK_SIZE_BYTES;
    let end = (offset + length).div_ceil(BLOCK_SIZE_BYTES);
    first..end
}

pub(super) fn cache_key(key: ShardKey, block: u64) -> CacheKey {
    CacheKey {
        vdisk: key.vdisk,
        epoch: key.epoch,
        block,
    }
}

impl InlineReader {
    /// The range, if it is whole blocks that are all cached with nothing newer in the oplog.
    fn read_cached(&self, offset: u64, length: u64) -> Option<Bytes> {
        if length == 0
            || !offset.is_multiple_of(BLOCK_SIZE_BYTES)
            || !length.is_multiple_of(BLOCK_SIZE_BYTES)
            || length > MAX_INLINE_READ_BYTES
        {
            return None;
        }
        if self.storage.oplog.holds_any_of(offset, length) {
            return None;
        }
        let mut cache = self.cache.borrow_mut();
        let mut blocks = block_range(offset, length);
        let first = cache.get(&cache_key(self.key, blocks.next()?))?;
        if blocks.is_empty() {
            return Some(first);
        }
        let mut joined = BytesMut::with_capacity(length as usize);
        joined.extend_from_slice(&first);
        for block in blocks {
            joined.extend_from_slice(&cache.get(&cache_key(self.key, block))?);
        }
        Some(joined.freeze())
    }
}
