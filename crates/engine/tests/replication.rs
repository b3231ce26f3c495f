//! Replicated writes in-process: one engine owns a vdisk and replicates its records to a
//! second engine's copy through a loopback replicator that applies them the way a node's
//! receiver does (in order, through `VdiskShared::enqueue_replica`). Racing overlapping
//! writes, large writes that would otherwise bypass the oplog, and zeroing all leave the
//! copy equal to the owner; a write is not answered before its replica acknowledged it (nor
//! is a settle); a replica that fails fails the write, and nothing hangs.

mod common;

use ashlar_core::{BlockDevice, IoError, VdiskId};
use ashlar_engine::replication::{
    ChunkResync, ReplicaAck, ReplicaFetch, ReplicaOp, ReplicaRecord, ReplicaResync, Replicator,
};
use ashlar_engine::shard::{ShardOp, ShardReply};
use ashlar_engine::Engine;
use ashlar_meta::EmbeddedMetaStore;
use bytes::Bytes;
use common::{config, pattern};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

type TestEngine = Engine<EmbeddedMetaStore>;

const SIZE: usize = 16 << 20;

async fn start(dir: &Path) -> Arc<TestEngine> {
    std::fs::create_dir_all(dir).unwrap();
    let meta = EmbeddedMetaStore::open(&dir.join("meta.redb")).expect("meta");
    let engine = Engine::start(config(dir, 64 << 20), meta)
        .await
        .expect("engine");
    engine
        .create_replicated_vdisk("v", SIZE as u64, Some(2), 2)
        .await
        .unwrap();
    engine
}

type Pending = (ReplicaRecord, oneshot::Sender<Result<(), IoError>>);

/// Sends records, in the order the controllers hand them over, to a task that applies them
/// to the copy; `fail` makes every record fail instead; `hold` keeps acknowledgements back.
struct Loopback {
    records: mpsc::UnboundedSender<Pending>,
    fail: Arc<AtomicBool>,
}

/// A replicator whose `fetch` reads the copy's shards, as a node's copy read does.
struct Fetching {
    inner: Loopback,
    copy: Arc<TestEngine>,
}

impl Replicator for Fetching {
    fn replicate(&self, record: ReplicaRecord) -> ReplicaAck {
        self.inner.replicate(record)
    }

    fn fetch(&self, vdisk: VdiskId, offset: u64, length: u64) -> ReplicaFetch {
        let copy = self.copy.clone();
        Box::pin(async move {
            let target = copy.replica_target(vdisk).await.expect("copy");
            let replies = target
                .call_split(offset, length, |o, l| ShardOp::Read {
                    offset: o,
                    length: l,
                })
                .await?;
            let mut joined = Vec::with_capacity(length as usize);
            for reply in replies {
                match reply {
                    ShardReply::Data(data) => joined.extend_from_slice(&data),
                    other => return Err(IoError::Io(format!("unexpected {other:?}"))),
                }
            }
            Ok(Bytes::from(joined))
        })
    }
}

impl Replicator for Loopback {
    fn replicate(&self, record: ReplicaRecord) -> ReplicaAck {
        let (ack, acked) = oneshot::channel();
        if self.fail.load(Ordering::Relaxed) {
            let _ = ack.send(Err(IoError::Io("replica refused".into())));
        } else {
            self.records.send((record, ack)).expect("the applier runs");
        }
        Box::pin(async move { acked.await.unwrap_or(Err(IoError::ShuttingDown)) })
    }
}

/// Applies records like a node's receiver: per stream in `prev_seq` order, queued on the
/// copy one after another, acknowledged when the copy's shard answered.
async fn apply_in_order(
    copy: Arc<TestEngine>,
    mut records: mpsc::UnboundedReceiver<Pending>,
    hold: Arc<Mutex<Option<Vec<oneshot::Sender<()>>>>>,
    applied: Arc<AtomicU64>,
) {
    let target = copy.replica_target(VdiskId(1)).await.expect("copy");
    let mut last: std::collections::HashMap<(u32, u64), u64> = Default::default();
    while let Some((record, ack)) = records.recv().await {
        let stream = last.entry((record.shard, record.stream)).or_insert(0);
        assert_eq!(
            record.prev_seq, *stream,
            "records of a stream reach the replicator in sequence order"
        );
        *stream = record.seq;
        let (offset, _) = record.op.range();
        let reply = target
            .enqueue_replica(record.op.into_shard_op(), offset)
            .await
            .expect("queued");
        let gate = hold.lock().unwrap().as_mut().map(|held| {
            let (release, released) = oneshot::channel();
            held.push(release);
            released
        });
        let applied = applied.clone();
        tokio::spawn(async move {
            let result = match reply.await {
                Ok(Ok(ShardReply::Done)) => Ok(()),
                other => Err(IoError::Io(format!("copy failed: {other:?}"))),
            };
            if let Some(gate) = gate {
                let _ = gate.await;
            }
            applied.fetch_add(1, Ordering::Relaxed);
            let _ = ack.send(result);
        });
    }
}

async fn read_all(engine: &Arc<TestEngine>) -> Vec<u8> {
    let engine2 = engine.clone();
    engine.reactors().handles()[0]
        .clone()
        .run(move || async move {
            let handle = engine2.open("v").expect("open");
            let mut all = Vec::with_capacity(SIZE);
            for offset in (0..SIZE).step_by(4 << 20) {
                all.extend_from_slice(&handle.read(offset as u64, 4 << 20).await.expect("read"));
            }
            all
        })
        .await
        .expect("reactor")
}

/// Many writes at once, overlapping on purpose, of every kind; returns their results.
async fn racing_writes(engine: &Arc<TestEngine>, seed: u64) -> Vec<Result<(), IoError>> {
    let engine2 = engine.clone();
    engine.reactors().handles()[1]
        .clone()
        .run(move || async move {
            let handle = std::rc::Rc::new(engine2.open("v").expect("open"));
            let mut tasks = Vec::new();
            for i in 0..48u64 {
                let handle = handle.clone();
                let (offset, length) = match i % 6 {
                    0 => ((i * 4096) % (1 << 20), 4096),
                    1 => ((i * 5000) % (2 << 20) + 17, 9000),
                    2 => ((i % 3) << 20, 1 << 20), // whole extents: would bypass the oplog
                    3 => ((4 << 20) - 512, 1024),  // crosses a shard range
                    4 => ((i % 4) << 20, 2 << 20),
                    _ => ((i % 5) * 65536, 100_000),
                };
                tasks.push(tokio::task::spawn_local(async move {
                    if i % 7 == 6 {
                        handle.write_zeroes(offset, length as u32, true).await
                    } else {
                        let data = Bytes::from(pattern(seed + i, length as usize));
                        handle.write(offset, data, false).await
                    }
                }));
            }
            let mut results = Vec::new();
            for task in tasks {
                results.push(task.await.expect("write task"));
            }
            results
        })
        .await
        .expect("reactor")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copy_ends_equal_to_the_owner_and_writes_wait_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let owner = start(&dir.path().join("owner")).await;
    let copy = start(&dir.path().join("copy")).await;
    let (records, incoming) = mpsc::unbounded_channel();
    let fail = Arc::new(AtomicBool::new(false));
    let hold = Arc::new(Mutex::new(None));
    let applied = Arc::new(AtomicU64::new(0));
    tokio::spawn(apply_in_order(
        copy.clone(),
        incoming,
        hold.clone(),
        applied.clone(),
    ));
    let replicator = Loopback {
        records,
        fail: fail.clone(),
    };
    owner
        .set_replicator("v", Some(Box::new(replicator)))
        .unwrap();

    for round in 0..3 {
        for result in racing_writes(&owner, round * 1000).await {
            result.expect("replicated write");
        }
        assert!(
            read_all(&owner).await == read_all(&copy).await,
            "round {round}: the copy differs from the owner"
        );
    }
    assert!(applied.load(Ordering::Relaxed) > 0);

    // An acknowledgement held back holds the write back.
    *hold.lock().unwrap() = Some(Vec::new());
    let pending = tokio::spawn({
        let owner = owner.clone();
        async move { racing_writes(&owner, 77).await }
    });
    // Until a record is held, the writes may not have reached the shards yet (slow in debug
    // builds), and settling would rightly find nothing to wait for.
    let mut waited = 0;
    while hold.lock().unwrap().as_ref().is_some_and(Vec::is_empty) {
        assert!(waited < 3000, "no record reached the replica within 30 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !pending.is_finished(),
        "writes answered before their replica acknowledged"
    );
    // Settling waits for those writes too.
    let shared = owner.vdisk_shared("v").unwrap();
    let settled = tokio::spawn(async move { shared.settle().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!settled.is_finished(), "settled with writes in flight");
    let held = hold.lock().unwrap().take().unwrap();
    assert!(!held.is_empty());
    drop(held); // releases every held acknowledgement
    for result in pending.await.unwrap() {
        result.expect("replicated write");
    }
    settled.await.unwrap().expect("settled");
    assert!(read_all(&owner).await == read_all(&copy).await);

    // A replica that fails fails the write, promptly.
    fail.store(true, Ordering::Relaxed);
    let results = tokio::time::timeout(Duration::from_secs(30), racing_writes(&owner, 5))
        .await
        .expect("writes with a failing replica do not hang");
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");

    // Without a replicator the vdisk is a local one again.
    owner.set_replicator("v", None).unwrap();
    for result in racing_writes(&owner, 9).await {
        result.expect("local write");
    }
}

async fn wait_drained(engine: &Arc<TestEngine>) {
    let shared = engine.vdisk_shared("v").unwrap();
    for _ in 0..600 {
        if shared.oplog_live_bytes() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the oplog never drained");
}

async fn write_all(engine: &Arc<TestEngine>, data: Vec<u8>) {
    let engine2 = engine.clone();
    engine.reactors().handles()[0]
        .clone()
        .run(move || async move {
            let handle = engine2.open("v").expect("open");
            for (i, chunk) in data.chunks(1 << 20).enumerate() {
                let data = Bytes::copy_from_slice(chunk);
                handle
                    .write((i as u64) << 20, data, false)
                    .await
                    .expect("write");
            }
        })
        .await
        .expect("reactor");
}

/// Flips one byte of data block `block` of egroup 0 on the owner's disk.
fn damage(dir: &Path, block: u64) {
    use std::os::unix::fs::FileExt;
    let path = egroup0_path(dir);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let at = 4096 * (5 + block) + 333;
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[!byte[0]], at).unwrap();
    file.sync_all().unwrap();
}

/// An owner and a copy in `dir`, and a loopback replicator that applies the owner's
/// records to the copy.
async fn owner_and_copy(dir: &Path) -> (Arc<TestEngine>, Arc<TestEngine>, Loopback) {
    let owner = start(&dir.join("owner")).await;
    let copy = start(&dir.join("copy")).await;
    let (records, incoming) = mpsc::unbounded_channel();
    tokio::spawn(apply_in_order(
        copy.clone(),
        incoming,
        Arc::new(Mutex::new(None)),
        Arc::new(AtomicU64::new(0)),
    ));
    let loopback = Loopback {
        records,
        fail: Arc::new(AtomicBool::new(false)),
    };
    (owner, copy, loopback)
}

/// Waits until `blocks` of egroup 0 on the owner's disk hold `image` again.
async fn wait_repaired(owner_dir: &Path, blocks: &[usize], image: &[u8]) {
    let repaired = |on_disk: &[u8]| {
        blocks
            .iter()
            .all(|block| on_disk[block * 4096..][..4096] == image[block * 4096..][..4096])
    };
    let mut tries = 0;
    while !repaired(&egroup0_blocks(owner_dir)) {
        tries += 1;
        assert!(tries < 200, "the damage stays on the owner's disk");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_owner_block_is_served_and_repaired_from_the_copy() {
    let dir = tempfile::tempdir().unwrap();
    let owner_dir = dir.path().join("owner");
    let (owner, copy, loopback) = owner_and_copy(dir.path()).await;
    let replicator = Fetching {
        inner: loopback,
        copy: copy.clone(),
    };
    owner
        .set_replicator("v", Some(Box::new(replicator)))
        .unwrap();
    let image = pattern(31, SIZE);
    write_all(&owner, image.clone()).await;
    wait_drained(&owner).await;
    // Blocks 2, 300 and 700 of egroup 0 (extents 0, 1 and 2) rot on the owner's disk.
    for block in [2, 300, 700] {
        damage(&owner_dir, block);
    }
    assert!(
        read_all(&owner).await == image,
        "damaged blocks served wrong"
    );
    // The rewrite drains into the owner's extent store: the damage is gone from its disk.
    wait_repaired(&owner_dir, &[2, 300, 700], &image).await;
    wait_drained(&owner).await;
    assert!(read_all(&copy).await == image);
}

fn egroup0_path(dir: &Path) -> std::path::PathBuf {
    dir.join("disk0/extents")
        .join(VdiskId(1).to_string())
        .join(format!("{:016x}.egroup", 0))
}

/// The data blocks of egroup 0 (4 MiB) as the owner's disk holds them.
fn egroup0_blocks(dir: &Path) -> Vec<u8> {
    let bytes = std::fs::read(egroup0_path(dir)).unwrap();
    bytes[5 * 4096..5 * 4096 + (4 << 20)].to_vec()
}

/// A replicator whose `resync` hands the chunk to the test and waits for its word.
struct Resyncing {
    inner: Loopback,
    chunks: mpsc::UnboundedSender<(ReplicaOp, oneshot::Sender<()>)>,
}

impl Replicator for Resyncing {
    fn replicate(&self, record: ReplicaRecord) -> ReplicaAck {
        self.inner.replicate(record)
    }

    fn resync(&self, _vdisk: VdiskId, content: ReplicaOp) -> ReplicaResync {
        let (done, proceed) = oneshot::channel();
        self.chunks.send((content, done)).expect("the test listens");
        Box::pin(async move {
            let _ = proceed.await;
            Ok(ChunkResync {
                copies_sent: 1,
                copies_same: 0,
                data_bytes: 0,
            })
        })
    }
}

/// One write of `data` at `offset` through a connection on reactor 0.
fn write_on_reactor(
    engine: &Arc<TestEngine>,
    offset: u64,
    data: Vec<u8>,
) -> tokio::task::JoinHandle<Result<(), IoError>> {
    let engine2 = engine.clone();
    let reactor = engine.reactors().handles()[0].clone();
    tokio::spawn(async move {
        reactor
            .run(move || async move {
                let handle = engine2.open("v").expect("open");
                handle.write(offset, Bytes::from(data), false).await
            })
            .await
            .expect("reactor")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_being_resynced_holds_back_its_writes_until_its_copies_have_it() {
    let dir = tempfile::tempdir().unwrap();
    let (owner, copy, loopback) = owner_and_copy(dir.path()).await;
    let (chunks, mut resyncing) = mpsc::unbounded_channel();
    let replicator = Resyncing {
        inner: loopback,
        chunks,
    };
    owner
        .set_replicator("v", Some(Box::new(replicator)))
        .unwrap();

    let before = pattern(1, 4096);
    write_on_reactor(&owner, 0, before.clone())
        .await
        .unwrap()
        .expect("write before the resync");
    let shared = owner.vdisk_shared("v").unwrap();
    let resync = tokio::spawn(async move {
        shared
            .call_split(0, 1 << 20, |offset, length| ShardOp::ResyncChunk {
                offset,
                length,
            })
            .await
    });
    // The replicator gets the chunk as it is after every acknowledged write.
    let (content, proceed) = resyncing
        .recv()
        .await
        .expect("the chunk reaches the replicator");
    let ReplicaOp::Write { offset: 0, data } = content else {
        panic!("chunk 0 with data expected, got {content:?}");
    };
    assert_eq!(data.len(), 1 << 20);
    assert!(
        data[..4096] == before[..],
        "the chunk misses a write acknowledged before it"
    );

    // A write into the chunk waits; one elsewhere goes on.
    let inside = write_on_reactor(&owner, 8192, pattern(2, 4096));
    write_on_reactor(&owner, 2 << 20, pattern(3, 4096))
        .await
        .unwrap()
        .expect("a write outside the held chunk");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !inside.is_finished(),
        "a write into a chunk being resynced went on before its copies had the chunk"
    );

    proceed.send(()).unwrap();
    let replies = resync.await.unwrap().expect("resync answered");
    assert!(matches!(
        replies.as_slice(),
        [ShardReply::Resynced(ChunkResync { copies_sent: 1, .. })]
    ));
    inside
        .await
        .unwrap()
        .expect("the held write goes on after the resync");
    assert!(read_all(&owner).await == read_all(&copy).await);
}

/// Reads from the copy like `Fetching`; its `resync` hands the chunk to the test.
struct FetchingResyncing {
    fetching: Fetching,
    chunks: mpsc::UnboundedSender<ReplicaOp>,
}

impl Replicator for FetchingResyncing {
    fn replicate(&self, record: ReplicaRecord) -> ReplicaAck {
        self.fetching.replicate(record)
    }

    fn fetch(&self, vdisk: VdiskId, offset: u64, length: u64) -> ReplicaFetch {
        self.fetching.fetch(vdisk, offset, length)
    }

    fn resync(&self, _vdisk: VdiskId, content: ReplicaOp) -> ReplicaResync {
        self.chunks.send(content).expect("the test listens");
        Box::pin(async move { Ok(ChunkResync::default()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_the_owner_cannot_read_is_resynced_from_another_copy_and_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let owner_dir = dir.path().join("owner");
    let (owner, copy, loopback) = owner_and_copy(dir.path()).await;
    let (chunks, mut resynced) = mpsc::unbounded_channel();
    let replicator = FetchingResyncing {
        fetching: Fetching {
            inner: loopback,
            copy: copy.clone(),
        },
        chunks,
    };
    owner
        .set_replicator("v", Some(Box::new(replicator)))
        .unwrap();
    let image = pattern(47, SIZE);
    write_all(&owner, image.clone()).await;
    wait_drained(&owner).await;
    // Blocks 2 and 200 of chunk 0 rot on the owner's disk.
    for block in [2, 200] {
        damage(&owner_dir, block);
    }
    let shared = owner.vdisk_shared("v").unwrap();
    let replies = shared
        .call_split(0, 1 << 20, |offset, length| ShardOp::ResyncChunk {
            offset,
            length,
        })
        .await
        .expect("the resync of a damaged chunk succeeds");
    assert!(matches!(replies.as_slice(), [ShardReply::Resynced(_)]));
    // The other copies get the chunk as written: the damaged blocks from the copy, never
    // the rotted bytes.
    let content = resynced
        .recv()
        .await
        .expect("the chunk reaches the replicator");
    let ReplicaOp::Write { offset: 0, data } = content else {
        panic!("chunk 0 with data expected, got {content:?}");
    };
    assert!(
        data[..] == image[..1 << 20],
        "the chunk sent is not what was written"
    );
    // And the owner's own blocks are repaired on its disk.
    wait_repaired(&owner_dir, &[2, 200], &image).await;
    assert!(read_all(&owner).await == image);
}
