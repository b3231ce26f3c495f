//! The owner's side of replicated writes, as the engine sees it: a [`Replicator`] that the
//! node installs on a vdisk it owns with RF > 1, and the records the shard controllers hand it.
//!
//! The engine knows nothing of peers, epochs or the network. A shard controller that finds a
//! replicator installed sends every record it appends to its oplog (in the log's sequence
//! order, each naming the previous one of its stream) and answers a write only when its
//! records are durable in the local oplog **and** the replicator said every replica has them.
//! While a replicator is installed, writes never bypass the oplog: the replicated oplog is the
//! only path by which data reaches the replicas.

use crate::shard::ShardOp;
use arc_swap::ArcSwapOption;
use ashlar_core::{IoError, VdiskId};
use bytes::Bytes;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// What a replicated record does to the vdisk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaOp {
    Write {
        offset: u64,
        data: Bytes,
    },
    /// The range reads as zeros (and may be unallocated).
    Zero {
        offset: u64,
        length: u64,
    },
}

impl ReplicaOp {
    /// Vdisk offset and length the record covers.
    pub fn range(&self) -> (u64, u64) {
        match self {
            ReplicaOp::Write { offset, data } => (*offset, data.len() as u64),
            ReplicaOp::Zero { offset, length } => (*offset, *length),
        }
    }

    /// The shard request that applies the record to a copy.
    pub fn into_shard_op(self) -> ShardOp {
        match self {
            ReplicaOp::Write { offset, data } => ShardOp::Write { offset, data },
            ReplicaOp::Zero { offset, length } => ShardOp::WriteZeroes {
                offset,
                length,
                punch_hole: true,
            },
        }
    }
}

/// One oplog record of a shard, as its replicas must apply it.
///
/// A *stream* is one run of one shard controller (`stream` = its shard-map epoch): records
/// of a stream are applied by every replica in `seq` order, which `prev_seq` (the stream's
/// previous record, 0 for its first) lets a replica check and restore after the network
/// reordered them. So overlapping writes end up in the same order on every copy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaRecord {
    pub vdisk: VdiskId,
    pub shard: u32,
    pub stream: u64,
    pub seq: u64,
    pub prev_seq: u64,
    pub op: ReplicaOp,
}

/// The future of one record's replication: `Ok` once every replica holds it durably.
pub type ReplicaAck = Pin<Box<dyn Future<Output = Result<(), IoError>> + Send>>;

/// The future of a read from another copy: the bytes, checked by that copy's checksums.
pub type ReplicaFetch = Pin<Box<dyn Future<Output = Result<Bytes, IoError>> + Send>>;

/// What one chunk's online resync did: how many copies were sent the chunk (they differed)
/// and how many already held it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChunkResync {
    pub copies_sent: u32,
    pub copies_same: u32,
    /// Bytes of data (not zeros) sent, over every copy.
    pub data_bytes: u64,
}

/// The future of one chunk's resync.
pub type ReplicaResync = Pin<Box<dyn Future<Output = Result<ChunkResync, IoError>> + Send>>;

/// Sends records to the replicas of one vdisk. Called on the shard's reactor, in sequence
/// order per stream; the returned futures may complete in any order.
pub trait Replicator: Send + Sync + 'static {
    fn replicate(&self, record: ReplicaRecord) -> ReplicaAck;

    /// Reads `[offset, offset + length)` of the vdisk from another copy (the owner's own
    /// copy failed its checksums there: the shard repairs it with what this returns).
    fn fetch(&self, vdisk: VdiskId, offset: u64, length: u64) -> ReplicaFetch {
        let _ = (offset, length);
        Box::pin(async move {
            Err(IoError::Io(format!(
                "vdisk {vdisk}: no other copy can be read"
            )))
        })
    }

    /// Makes every other copy hold `content` (the whole chunk as this copy holds it, zeros
    /// as [`ReplicaOp::Zero`]) where it differs. The shard calls it during an online resync
    /// (`ShardOp::ResyncChunk`) with no write in flight on the chunk and new ones held back
    /// until it completes, so what a copy gets is never older than a write it took.
    fn resync(&self, vdisk: VdiskId, content: ReplicaOp) -> ReplicaResync {
        let _ = content;
        Box::pin(async move {
            Err(IoError::Io(format!(
                "vdisk {vdisk}: this replicator cannot resync copies"
            )))
        })
    }
}

/// Where a vdisk's replicator is installed: shared by the vdisk's shared state (the node
/// installs and removes it) and its shard controllers (which load it once per write).
pub struct ReplicationSlot {
    replicator: ArcSwapOption<Box<dyn Replicator>>,
    /// The vdisk keeps more than one copy: on every copy, owner or not, all writes go
    /// through the oplog. A bypass write's barrier may land after a later overlapping write
    /// (either order is one a client may see), so bypasses would let copies apply the same
    /// records in different orders.
    oplog_only: bool,
}

impl ReplicationSlot {
    /// The slot of a vdisk with `replication_factor` copies.
    pub fn new(replication_factor: u8) -> Arc<ReplicationSlot> {
        Arc::new(ReplicationSlot {
            replicator: ArcSwapOption::empty(),
            oplog_only: replication_factor > 1,
        })
    }

    /// Writes must not bypass the oplog (the vdisk is replicated).
    pub fn oplog_only(&self) -> bool {
        self.oplog_only || self.is_set()
    }

    /// Installs (or with `None` removes) the replicator; writes accepted from now on use it.
    pub fn set(&self, replicator: Option<Box<dyn Replicator>>) {
        self.replicator.store(replicator.map(Arc::new));
    }

    pub fn current(&self) -> Option<Arc<Box<dyn Replicator>>> {
        self.replicator.load_full()
    }

    pub fn is_set(&self) -> bool {
        self.replicator.load().is_some()
    }
}

impl fmt::Debug for ReplicationSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicationSlot")
            .field("installed", &self.is_set())
            .field("oplog_only", &self.oplog_only)
            .finish()
    }
}
