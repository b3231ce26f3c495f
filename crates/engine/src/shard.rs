//! A shard controller: the single-threaded owner of some offset ranges of one vdisk on one
//! reactor. It owns its oplog, its view of the extent store for its ranges, and uses its
//! reactor's read cache. Requests arrive on a bounded channel; a read of cached blocks is
//! answered on the spot, any other request by a local task. Connections on the same reactor
//! may also read cached blocks directly (`read_cached_now`). All state is touched only from
//! this reactor thread.

use crate::cache::{BlockCache, CacheKey};
use crate::reactor::{ReactorId, ReplyRoute};
use ashlar_core::{BlockStatusRun, Epoch, IoError, VdiskId, BLOCK_SIZE_BYTES, EXTENT_SIZE_BYTES};
use ashlar_storage::disk::{Disk, StdOpener};
use ashlar_storage::extent_store::{ExtentError, ExtentStore, ExtentStoreConfig};
use ashlar_storage::oplog::{LogPiece, Oplog, OplogConfig, OplogError, PieceSource};
use bytes::{Bytes, BytesMut};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch, Notify};

/// What a shard is asked to do. Ranges never cross the shard's range boundaries: the vdisk
/// handle splits requests before sending them.
#[derive(Debug)]
pub enum ShardOp {
    Read {
        offset: u64,
        length: u64,
    },
    Write {
        offset: u64,
        data: Bytes,
    },
    /// Reads back as zeros; `punch_hole` lets storage be freed.
    WriteZeroes {
        offset: u64,
        length: u64,
        punch_hole: bool,
    },
    BlockStatus {
        offset: u64,
        length: u64,
    },
}

#[derive(Debug)]
pub enum ShardReply {
    Data(Bytes),
    Done,
    Status(Vec<BlockStatusRun>),
}

#[derive(Debug)]
pub enum ShardError {
    /// This shard no longer serves the range (the shard map changed): resend on the new map.
    Retired,
    Io(IoError),
}

pub struct ShardRequest {
    pub op: ShardOp,
    pub reply: oneshot::Sender<Result<ShardReply, ShardError>>,
    /// How the reply gets back to the requester's reactor cheaply; `None` off the reactors.
    pub route: Option<ReplyRoute>,
}

pub enum ShardControl {
    /// Stop serving: answer queued requests with `Retired`, finish in-flight ones, then either
    /// drain the oplog into the extent store (`discard == false`) or drop it (vdisk deleted).
    Retire {
        discard: bool,
        done: oneshot::Sender<Result<(), String>>,
    },
}

/// Everything needed to start a shard controller.
#[derive(Clone, Debug)]
pub struct ShardSpec {
    pub vdisk: VdiskId,
    pub epoch: Epoch,
    pub index: u32,
    pub oplog_dir: PathBuf,
    pub oplog_capacity_bytes: u64,
    pub disks: Vec<Disk>,
    pub max_open_egroups: usize,
    pub drain_batch_bytes: u64,
    pub drain_idle: Duration,
    pub request_queue_limit: usize,
}

/// Names one shard controller among those of its reactor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShardKey {
    pub vdisk: VdiskId,
    pub epoch: Epoch,
    pub index: u32,
}

/// How other threads reach a running shard.
#[derive(Clone)]
pub struct ShardLink {
    pub requests: mpsc::Sender<ShardRequest>,
    pub control: mpsc::Sender<ShardControl>,
    pub oplog_usage_bytes: Arc<AtomicU64>,
    pub key: ShardKey,
    /// The reactor the controller runs on; `None` when started off the reactors (tests).
    pub reactor: Option<ReactorId>,
}

thread_local! {
    /// The shard controllers of this reactor, for answering cached reads inline on the
    /// connection's own thread (see [`read_cached_now`]).
    static LOCAL_SHARDS: RefCell<HashMap<ShardKey, Rc<Shard>>> = RefCell::default();
}

/// Removes a controller from its reactor's table when its task ends, however it ends.
struct LocalRegistration(ShardKey);

impl Drop for LocalRegistration {
    fn drop(&mut self) {
        // During thread teardown the table may already be gone; nothing to remove then.
        let _ = LOCAL_SHARDS.try_with(|shards| shards.borrow_mut().remove(&self.0));
    }
}

/// Serves a read from the cache of a controller on this reactor, if the controller is
/// serving and every block of the range is cached with nothing newer in its oplog. Runs
/// synchronously, so it cannot interleave with the controller's own tasks.
pub fn read_cached_now(key: ShardKey, offset: u64, length: u64) -> Option<Bytes> {
    let shard = LOCAL_SHARDS.with(|shards| shards.borrow().get(&key).cloned())?;
    if !shard.serving.get() {
        return None;
    }
    shard.read_cached(offset, length)
}

/// Longest read answered from the cache without a task (larger reads are rarely all cached
/// and would hold the reactor while they are copied).
const MAX_INLINE_READ_BYTES: u64 = 128 * 1024;

/// Buckets of the write-generation table that keeps stale reads out of the cache.
const WRITE_GENERATION_BUCKETS: usize = 4096;

struct Shard {
    spec: ShardSpec,
    oplog: Oplog<StdOpener>,
    store: ExtentStore<StdOpener>,
    cache: Rc<RefCell<BlockCache>>,
    /// Serializes extent-store writers (drain and bypass writes) so a drain of older oplog
    /// data never interleaves with a newer direct write of the same blocks.
    store_writer: tokio::sync::Mutex<()>,
    /// Bumped for every block a write touches, before and after the write. A read inserts a
    /// block into the cache only if its bucket did not change while the read ran.
    write_generations: Vec<Cell<u64>>,
    in_flight: Cell<usize>,
    /// True from the gate opening until retirement starts: only then may reads be answered
    /// inline, outside the request queue.
    serving: Cell<bool>,
    idle: Notify,
    wrote: Notify,
    stop_drain: Cell<bool>,
    oplog_usage_bytes: Arc<AtomicU64>,
}

/// Starts a shard controller on the current reactor. It serves nothing until `gate` is true,
/// so a new shard map can be published before the old shards have handed over.
pub async fn start_shard(
    spec: ShardSpec,
    cache: Rc<RefCell<BlockCache>>,
    gate: watch::Receiver<bool>,
) -> Result<ShardLink, String> {
    let oplog_config = OplogConfig {
        dir: spec.oplog_dir.clone(),
        capacity_bytes: spec.oplog_capacity_bytes,
        segment_bytes: (spec.oplog_capacity_bytes / 8).max(1 << 20),
        max_commit_batch_bytes: 4 << 20,
    };
    let oplog = Oplog::open(StdOpener, oplog_config)
        .await
        .map_err(|e| format!("cannot open oplog {}: {e}", spec.oplog_dir.display()))?;
    let store = ExtentStore::new(
        StdOpener,
        ExtentStoreConfig {
            vdisk: spec.vdisk,
            disks: spec.disks.clone(),
            max_open_egroups: spec.max_open_egroups,
        },
    );
    let (request_tx, request_rx) = mpsc::channel(spec.request_queue_limit);
    let (control_tx, control_rx) = mpsc::channel(4);
    let oplog_usage_bytes = Arc::new(AtomicU64::new(oplog.usage_bytes()));
    let shard = Rc::new(Shard {
        spec,
        oplog,
        store,
        cache,
        store_writer: tokio::sync::Mutex::new(()),
        write_generations: (0..WRITE_GENERATION_BUCKETS)
            .map(|_| Cell::new(0))
            .collect(),
        in_flight: Cell::new(0),
        serving: Cell::new(false),
        idle: Notify::new(),
        wrote: Notify::new(),
        stop_drain: Cell::new(false),
        oplog_usage_bytes: oplog_usage_bytes.clone(),
    });
    let key = ShardKey {
        vdisk: shard.spec.vdisk,
        epoch: shard.spec.epoch,
        index: shard.spec.index,
    };
    let reactor = crate::reactor::current_reactor();
    LOCAL_SHARDS.with(|shards| shards.borrow_mut().insert(key, shard.clone()));
    let registration = LocalRegistration(key);
    tokio::task::spawn_local(async move {
        let _registration = registration;
        run(shard, request_rx, control_rx, gate).await
    });
    Ok(ShardLink {
        requests: request_tx,
        control: control_tx,
        oplog_usage_bytes,
        key,
        reactor,
    })
}

async fn run(
    shard: Rc<Shard>,
    mut requests: mpsc::Receiver<ShardRequest>,
    mut control: mpsc::Receiver<ShardControl>,
    mut gate: watch::Receiver<bool>,
) {
    while !*gate.borrow_and_update() {
        if gate.changed().await.is_err() {
            break;
        }
    }
    let drainer = tokio::task::spawn_local(drain_loop(shard.clone()));
    shard.serving.set(true);
    loop {
        tokio::select! {
            request = requests.recv() => match request {
                Some(request) => {
                    if let Some(request) = answer_from_cache(&shard, request) {
                        shard.in_flight.set(shard.in_flight.get() + 1);
                        tokio::task::spawn_local(serve(shard.clone(), request));
                    }
                }
                None => break,
            },
            command = control.recv() => match command {
                Some(ShardControl::Retire { discard, done }) => {
                    shard.serving.set(false);
                    requests.close();
                    while let Some(request) = requests.recv().await {
                        let _ = request.reply.send(Err(ShardError::Retired));
                    }
                    while shard.in_flight.get() > 0 {
                        shard.idle.notified().await;
                    }
                    shard.stop_drain.set(true);
                    shard.wrote.notify_one();
                    let _ = drainer.await;
                    let result = hand_over(&shard, discard).await;
                    let _ = done.send(result);
                    return;
                }
                None => break,
            },
        }
    }
    shard.serving.set(false);
    shard.stop_drain.set(true);
    shard.wrote.notify_one();
}

/// Final act of a retiring shard: leave nothing behind that a successor must know about.
/// The drained log holds no live record, so removing it moves ownership with no data copied.
async fn hand_over(shard: &Shard, discard: bool) -> Result<(), String> {
    if !discard {
        drain_all(&shard.oplog, &shard.store).await?;
    }
    shard.store.sync().await.map_err(|e| e.to_string())?;
    shard.store.close_all();
    remove_oplog_dir(&shard.spec.oplog_dir)
}

pub fn remove_oplog_dir(dir: &std::path::Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot remove {}: {e}", dir.display())),
    }
}

/// Drains every live oplog entry into the extent store and syncs it. Used when a shard
/// retires and when a node recovers oplogs left by a crash.
pub async fn drain_all(
    oplog: &Oplog<StdOpener>,
    store: &ExtentStore<StdOpener>,
) -> Result<(), String> {
    while !oplog.is_empty() {
        drain_batch(oplog, store, u64::MAX)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
enum DrainError {
    #[error(transparent)]
    Oplog(#[from] OplogError),
    #[error(transparent)]
    Store(#[from] ExtentError),
}

async fn drain_batch(
    oplog: &Oplog<StdOpener>,
    store: &ExtentStore<StdOpener>,
    max_bytes: u64,
) -> Result<usize, DrainError> {
    let items = oplog.drain_batch(max_bytes);
    if items.is_empty() {
        return Ok(0);
    }
    for item in &items {
        if item.zero {
            store.write_zeroes(item.offset, item.length).await?;
        } else {
            let data = oplog.read_drain_item(item).await?;
            store.write(item.offset, &data).await?;
        }
    }
    store.sync().await?;
    oplog.complete_drain(&items).await?;
    Ok(items.len())
}

async fn drain_loop(shard: Rc<Shard>) {
    loop {
        if shard.stop_drain.get() {
            return;
        }
        if shard.oplog.is_empty() {
            tokio::select! {
                _ = shard.wrote.notified() => {}
                _ = shard.oplog.drain_wanted() => {}
            }
            continue;
        }
        if !shard.oplog.needs_drain() {
            // Drain in the background when writes pause, so the log stays short and
            // restarts replay little; under load only drain when space is needed.
            tokio::select! {
                _ = shard.oplog.drain_wanted() => {}
                _ = tokio::time::sleep(shard.spec.drain_idle) => {}
                _ = shard.wrote.notified() => continue,
            }
        }
        if shard.stop_drain.get() {
            return;
        }
        let guard = shard.store_writer.lock().await;
        let result = drain_batch(&shard.oplog, &shard.store, shard.spec.drain_batch_bytes).await;
        drop(guard);
        shard.publish_usage();
        if let Err(error) = result {
            tracing::error!(vdisk = %shard.spec.vdisk, shard = shard.spec.index, %error,
                "oplog drain failed; retrying in 1 s");
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

struct InFlight<'a>(&'a Shard);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let left = self.0.in_flight.get() - 1;
        self.0.in_flight.set(left);
        if left == 0 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Answers a read of cached blocks on the spot; gives back any other request.
fn answer_from_cache(shard: &Shard, request: ShardRequest) -> Option<ShardRequest> {
    let ShardOp::Read { offset, length } = request.op else {
        return Some(request);
    };
    match shard.read_cached(offset, length) {
        Some(data) => {
            send_reply(request.reply, request.route, Ok(ShardReply::Data(data)));
            None
        }
        None => Some(request),
    }
}

fn send_reply(
    reply: oneshot::Sender<Result<ShardReply, ShardError>>,
    route: Option<ReplyRoute>,
    result: Result<ShardReply, ShardError>,
) {
    match route {
        Some(route) => route.deliver(move || {
            let _ = reply.send(result);
        }),
        None => {
            let _ = reply.send(result);
        }
    }
}

async fn serve(shard: Rc<Shard>, request: ShardRequest) {
    let _in_flight = InFlight(&shard);
    let result = match request.op {
        ShardOp::Read { offset, length } => shard.read(offset, length).await.map(ShardReply::Data),
        ShardOp::Write { offset, data } => {
            shard.write(offset, data).await.map(|()| ShardReply::Done)
        }
        ShardOp::WriteZeroes {
            offset,
            length,
            punch_hole,
        } => shard
            .write_zeroes(offset, length, punch_hole)
            .await
            .map(|()| ShardReply::Done),
        ShardOp::BlockStatus { offset, length } => shard
            .block_status(offset, length)
            .await
            .map(ShardReply::Status),
    };
    send_reply(request.reply, request.route, result.map_err(ShardError::Io));
}

fn block_range(offset: u64, length: u64) -> std::ops::Range<u64> {
    let first = offset / BLOCK_SIZE_BYTES;
    let end = (offset + length).div_ceil(BLOCK_SIZE_BYTES);
    first..end
}

impl Shard {
    fn cache_key(&self, block: u64) -> CacheKey {
        CacheKey {
            vdisk: self.spec.vdisk,
            epoch: self.spec.epoch,
            block,
        }
    }

    fn generation_cell(&self, block: u64) -> &Cell<u64> {
        &self.write_generations[(block as usize) % WRITE_GENERATION_BUCKETS]
    }

    /// Marks blocks as changing and drops them from the cache.
    fn invalidate(&self, offset: u64, length: u64) {
        let mut cache = self.cache.borrow_mut();
        for block in block_range(offset, length) {
            let cell = self.generation_cell(block);
            cell.set(cell.get() + 1);
            cache.invalidate(&self.cache_key(block));
        }
    }

    fn publish_usage(&self) {
        self.oplog_usage_bytes
            .store(self.oplog.usage_bytes(), Ordering::Relaxed);
    }

    fn vdisk_io_error(&self, what: &str, offset: u64, error: impl std::fmt::Display) -> IoError {
        tracing::error!(vdisk = %self.spec.vdisk, offset, %error, "{what} failed");
        IoError::Io(format!("{what} at offset {offset}: {error}"))
    }

    async fn write(&self, offset: u64, data: Bytes) -> Result<(), IoError> {
        let length = data.len() as u64;
        self.invalidate(offset, length);
        let bypass = offset.is_multiple_of(EXTENT_SIZE_BYTES)
            && length.is_multiple_of(EXTENT_SIZE_BYTES)
            && length > 0
            && self
                .oplog
                .lookup(offset, length)
                .iter()
                .all(|p| matches!(p.source, PieceSource::Absent));
        let result = if bypass {
            self.write_direct(offset, &data).await
        } else {
            self.oplog
                .write(offset, data)
                .await
                .map_err(|e| self.oplog_error(offset, e))
        };
        self.invalidate(offset, length);
        self.publish_usage();
        self.wrote.notify_one();
        result
    }

    /// Large, extent-aligned writes skip the oplog: written in place, synced, then a barrier
    /// record tells replay that older log records for the range are superseded.
    async fn write_direct(&self, offset: u64, data: &[u8]) -> Result<(), IoError> {
        {
            let _guard = self.store_writer.lock().await;
            self.store
                .write(offset, data)
                .await
                .map_err(|e| self.store_error(offset, e))?;
            self.store
                .sync()
                .await
                .map_err(|e| self.store_error(offset, e))?;
        }
        self.oplog
            .barrier(offset, data.len() as u64)
            .await
            .map_err(|e| self.oplog_error(offset, e))
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        punch_hole: bool,
    ) -> Result<(), IoError> {
        if !punch_hole {
            // The client asked for allocated zeros: store real zero bytes.
            let zeros = Bytes::from(vec![0u8; length as usize]);
            return self.write(offset, zeros).await;
        }
        self.invalidate(offset, length);
        let result = self
            .oplog
            .write_zeroes(offset, length)
            .await
            .map_err(|e| self.oplog_error(offset, e));
        self.invalidate(offset, length);
        self.publish_usage();
        self.wrote.notify_one();
        result
    }

    fn oplog_error(&self, offset: u64, error: OplogError) -> IoError {
        match error {
            OplogError::NoSpace { .. } => IoError::NoSpace,
            other => self.vdisk_io_error("oplog", offset, other),
        }
    }

    fn store_error(&self, offset: u64, error: ExtentError) -> IoError {
        match error {
            ExtentError::NoSpace { .. } => IoError::NoSpace,
            other => self.vdisk_io_error("extent store", offset, other),
        }
    }

    /// The range, if it is whole blocks that are all cached with nothing newer in the oplog.
    fn read_cached(&self, offset: u64, length: u64) -> Option<Bytes> {
        if length == 0
            || !offset.is_multiple_of(BLOCK_SIZE_BYTES)
            || !length.is_multiple_of(BLOCK_SIZE_BYTES)
            || length > MAX_INLINE_READ_BYTES
        {
            return None;
        }
        let pieces = self.oplog.lookup(offset, length);
        if pieces.len() != 1 || !matches!(pieces[0].source, PieceSource::Absent) {
            return None;
        }
        let mut cache = self.cache.borrow_mut();
        let mut blocks = block_range(offset, length);
        let first = cache.get(&self.cache_key(blocks.next()?))?;
        if blocks.is_empty() {
            return Some(first);
        }
        let mut joined = BytesMut::with_capacity(length as usize);
        joined.extend_from_slice(&first);
        for block in blocks {
            joined.extend_from_slice(&cache.get(&self.cache_key(block))?);
        }
        Some(joined.freeze())
    }

    async fn read(&self, offset: u64, length: u64) -> Result<Bytes, IoError> {
        if let Some(data) = self.read_cached(offset, length) {
            return Ok(data);
        }
        let mut buffer = BytesMut::zeroed(length as usize);
        let mut attempts = 0;
        loop {
            match self.read_into(offset, &mut buffer).await {
                Ok(()) => return Ok(buffer.freeze()),
                // A drain may have freed the log segment between lookup and read: look again.
                Err(ReadError::LogMoved) if attempts < 3 => attempts += 1,
                Err(ReadError::LogMoved) => {
                    return Err(IoError::Io(format!(
                        "oplog kept changing under a read at {offset}"
                    )))
                }
                Err(ReadError::Io(error)) => return Err(error),
            }
        }
    }

    async fn read_into(&self, offset: u64, buffer: &mut [u8]) -> Result<(), ReadError> {
        let pieces = self.oplog.lookup(offset, buffer.len() as u64);
        for piece in &pieces {
            let start = (piece.offset - offset) as usize;
            let slice = &mut buffer[start..start + piece.length as usize];
            match piece.source {
                PieceSource::Absent => self.read_store(piece.offset, slice).await?,
                _ => self.read_log(piece, slice).await?,
            }
        }
        Ok(())
    }

    async fn read_log(&self, piece: &LogPiece, slice: &mut [u8]) -> Result<(), ReadError> {
        match self.oplog.read_piece(piece, slice).await {
            Ok(()) => Ok(()),
            Err(OplogError::Corrupt {
                path,
                file_offset,
                reason,
            }) => {
                tracing::error!(vdisk = %self.spec.vdisk, offset = piece.offset, path = %path.display(),
                    file_offset, %reason, "checksum mismatch in the oplog");
                Err(ReadError::Io(IoError::Io(format!(
                    "checksum mismatch in oplog {} at {file_offset}",
                    path.display()
                ))))
            }
            Err(_) => Err(ReadError::LogMoved),
        }
    }

    /// Reads from the cache or the extent store, filling the cache with whole blocks.
    async fn read_store(&self, offset: u64, slice: &mut [u8]) -> Result<(), ReadError> {
        let blocks = block_range(offset, slice.len() as u64);
        let first_byte = blocks.start * BLOCK_SIZE_BYTES;
        let generations: Vec<u64> = blocks
            .clone()
            .map(|b| self.generation_cell(b).get())
            .collect();
        let mut whole = vec![0u8; ((blocks.end - blocks.start) * BLOCK_SIZE_BYTES) as usize];
        let mut missing_from: Option<u64> = None;
        for block in blocks.clone().chain(std::iter::once(blocks.end)) {
            let cached = if block < blocks.end {
                self.cache.borrow_mut().get(&self.cache_key(block))
            } else {
                None
            };
            let at = ((block - blocks.start) * BLOCK_SIZE_BYTES) as usize;
            match cached {
                Some(data) => {
                    if let Some(from) = missing_from.take() {
                        self.fill_from_store(from, block, first_byte, &mut whole)
                            .await?;
                    }
                    whole[at..at + BLOCK_SIZE_BYTES as usize].copy_from_slice(&data);
                }
                None if block < blocks.end => {
                    missing_from.get_or_insert(block);
                }
                None => {
                    if let Some(from) = missing_from.take() {
                        self.fill_from_store(from, block, first_byte, &mut whole)
                            .await?;
                    }
                }
            }
        }
        self.cache_blocks(blocks.start, &generations, &whole);
        let skip = (offset - first_byte) as usize;
        slice.copy_from_slice(&whole[skip..skip + slice.len()]);
        Ok(())
    }

    async fn fill_from_store(
        &self,
        from: u64,
        to: u64,
        first_byte: u64,
        whole: &mut [u8],
    ) -> Result<(), ReadError> {
        let start = (from * BLOCK_SIZE_BYTES - first_byte) as usize;
        let end = (to * BLOCK_SIZE_BYTES - first_byte) as usize;
        let offset = from * BLOCK_SIZE_BYTES;
        match self.store.read(offset, &mut whole[start..end]).await {
            Ok(()) => Ok(()),
            Err(ExtentError::Corrupt { .. }) => {
                // A concurrent read-modify-write of a partial block can be seen half done;
                // a real corruption is still there once writers are held off.
                let _guard = self.store_writer.lock().await;
                self.store
                    .read(offset, &mut whole[start..end])
                    .await
                    .map_err(|e| ReadError::Io(self.corrupt_or_io(offset, e)))
            }
            Err(other) => Err(ReadError::Io(self.store_error(offset, other))),
        }
    }

    fn corrupt_or_io(&self, offset: u64, error: ExtentError) -> IoError {
        if let ExtentError::Corrupt {
            vdisk,
            offset: bad,
            path,
            ..
        } = &error
        {
            tracing::error!(vdisk = %vdisk, offset = bad, disk_file = %path.display(),
                "checksum mismatch in the extent store; returning EIO");
        }
        self.store_error(offset, error)
    }

    fn cache_blocks(&self, first: u64, generations: &[u64], whole: &[u8]) {
        let mut cache = self.cache.borrow_mut();
        for (index, generation) in generations.iter().enumerate() {
            let block = first + index as u64;
            if self.generation_cell(block).get() != *generation {
                continue;
            }
            let at = index * BLOCK_SIZE_BYTES as usize;
            let data = Bytes::copy_from_slice(&whole[at..at + BLOCK_SIZE_BYTES as usize]);
            cache.insert(self.cache_key(block), data);
        }
    }

    async fn block_status(&self, offset: u64, length: u64) -> Result<Vec<BlockStatusRun>, IoError> {
        let mut runs: Vec<BlockStatusRun> = Vec::new();
        for piece in self.oplog.lookup(offset, length) {
            match piece.source {
                PieceSource::Data { .. } => push_run(&mut runs, piece.length, false),
                PieceSource::Zero => push_run(&mut runs, piece.length, true),
                PieceSource::Absent => {
                    let allocation = self
                        .store
                        .allocation(piece.offset, piece.length)
                        .await
                        .map_err(|e| self.store_error(piece.offset, e))?;
                    for (run_length, allocated) in allocation {
                        push_run(&mut runs, run_length, !allocated);
                    }
                }
            }
        }
        Ok(runs)
    }
}

fn push_run(runs: &mut Vec<BlockStatusRun>, length: u64, hole: bool) {
    if length == 0 {
        return;
    }
    if let Some(last) = runs.last_mut() {
        if last.hole == hole {
            last.length += length;
            return;
        }
    }
    runs.push(BlockStatusRun {
        length,
        hole,
        zero: hole,
    });
}

enum ReadError {
    LogMoved,
    Io(IoError),
}

impl From<IoError> for ReadError {
    fn from(error: IoError) -> Self {
        ReadError::Io(error)
    }
}
