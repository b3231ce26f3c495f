//! A flipped byte in an extent group file: the read of that block fails with EIO (the bad data
//! is never returned), other blocks of the same extent still read correctly, and the node logs
//! the vdisk, offset and file. The same for damaged oplog records and batch headers,
//! extent-store checksum blocks and egroup headers, with a second vdisk that must be untouched.

mod common;

use common::nbd::{NbdConn, EIO};
use common::{describe, run_bounded, CmdOut, Node, Rng, MIB};
use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const BLOCK: u64 = 4096;
/// The egroup header: one header block and four checksum blocks before the data.
const DATA_START: u64 = 5 * BLOCK;

#[test]
fn flipped_byte_in_extent_file_gives_eio_and_a_log_line() {
    let mut node = Node::start();
    node.create_vdisk("corrupt", "64M");
    let data = Rng::new(99).bytes(MIB as usize);
    {
        // 1 MiB at offset 0, aligned: it bypasses the oplog into the extent store.
        let mut conn = NbdConn::connect(node.nbd_addr(), "corrupt").unwrap();
        conn.write_ok(0, &data);
        assert_eq!(conn.read_ok(0, MIB as u32), data);
        conn.disconnect();
    }
    let dir_name = node.vdisk_dir_name("corrupt");
    // Stop cleanly so nothing is cached or pending.
    let status = node.sigterm_and_wait();
    assert!(status.success(), "SIGTERM: {}", describe(&status));

    let egroup = node.egroup_path(&dir_name, 0);
    let file = node.open_egroup(&dir_name, 0);
    // The documented layout: extent 0's data starts after the 20 KiB header.
    let mut on_disk = vec![0u8; MIB as usize];
    file.read_exact_at(&mut on_disk, DATA_START).unwrap();
    assert!(
        on_disk == data,
        "extent 0 of {} does not hold the written data at file offset {DATA_START}",
        egroup.display()
    );
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, DATA_START + 100).unwrap();
    file.write_all_at(&[byte[0] ^ 0x5a], DATA_START + 100)
        .unwrap();
    file.sync_all().unwrap();
    drop(file);

    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "corrupt").unwrap();
    // The corrupted block: EIO, every time (the bad data must not have been cached).
    for _ in 0..2 {
        assert_eq!(
            conn.read(0, BLOCK as u32).unwrap(),
            Err(EIO),
            "reading the corrupted block must fail with EIO"
        );
    }
    // A read covering it fails too; a sub-block read inside it as well.
    assert_eq!(conn.read(0, MIB as u32).unwrap(), Err(EIO));
    assert_eq!(conn.read(96, 16).unwrap(), Err(EIO));
    // Other blocks of the same extent are fine.
    for block in [1u64, 7, 255] {
        let offset = block * BLOCK;
        assert_eq!(
            conn.read_ok(offset, BLOCK as u32),
            &data[offset as usize..(offset + BLOCK) as usize],
            "block {block} of the corrupted extent"
        );
    }
    assert_eq!(
        conn.read_ok(BLOCK, (MIB - BLOCK) as u32),
        &data[BLOCK as usize..],
        "the rest of the extent"
    );
    conn.disconnect();

    // A real client sees an I/O error too.
    let qemu = CmdOut::from_output(run_bounded(
        "qemu-io",
        &["-f", "raw", "-c", "read 0 4k", &node.uri("corrupt")],
        60,
    ));
    assert!(
        qemu.stderr.contains("Input/output error") || qemu.stdout.contains("Input/output error"),
        "qemu-io read of the corrupted block: {qemu:?}"
    );
    let qemu = CmdOut::from_output(run_bounded(
        "qemu-io",
        &["-f", "raw", "-c", "read 4k 4k", &node.uri("corrupt")],
        60,
    ));
    qemu.assert_ok("qemu-io read of a good block");

    node.assert_alive();
    let stats = node.vdisk_stats("corrupt");
    assert!(
        stats["errors"].as_u64().unwrap() >= 4,
        "failed reads are counted: {stats}"
    );
    // The log names the vdisk, the offset and the file.
    let log = node.log();
    let line = log
        .lines()
        .find(|l| l.contains(egroup.to_str().unwrap()))
        .unwrap_or_else(|| panic!("no log line names {}:\n{log}", egroup.display()));
    assert!(
        line.contains(&dir_name) || line.contains("corrupt"),
        "the line names the vdisk: {line}"
    );
    assert!(
        line.contains("offset=0") || line.contains("offset 0"),
        "{line}"
    );
    assert!(line.to_lowercase().contains("checksum"), "{line}");
}

/// A partial (sub-block) write acknowledged into a block whose old data is corrupt: the oplog
/// must still drain (no wedged writers, re-sharding and restarts keep working) and the block
/// must keep failing reads rather than serve a guessed remainder.
#[test]
fn partial_write_into_a_corrupt_block_does_not_wedge_the_oplog() {
    let mut node = Node::start();
    node.create_vdisk("c", "64M");
    {
        let mut conn = NbdConn::connect(node.nbd_addr(), "c").unwrap();
        conn.write_ok(0, &vec![0x11u8; MIB as usize]);
        conn.disconnect();
    }
    let dir_name = node.vdisk_dir_name("c");
    assert!(node.sigterm_and_wait().success());
    let egroup = node
        .data_dir
        .join("disk0/extents")
        .join(dir_name)
        .join(format!("{:016x}.egroup", 0));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&egroup)
        .unwrap();
    file.write_all_at(&[0xee], DATA_START + 100).unwrap();
    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "c").unwrap();
    assert_eq!(
        conn.write(100, &[0x22u8; 512]).unwrap(),
        0,
        "the write itself is acknowledged"
    );
    // The drain runs when writes pause; the oplog must empty.
    let drained = common::wait_until(std::time::Duration::from_secs(20), || {
        node.vdisk_stats("c")["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(drained, "oplog never drained: {}", node.vdisk_stats("c"));
    assert_eq!(
        conn.read(0, BLOCK as u32).unwrap(),
        Err(EIO),
        "the damaged block stays unreadable"
    );
    assert_eq!(
        conn.read(BLOCK, BLOCK as u32).unwrap(),
        Ok(vec![0x11u8; BLOCK as usize])
    );
    conn.disconnect();
    node.cli(&["vdisk", "set", "c", "--shards", "1"])
        .assert_ok("re-shard after the drain");
    node.kill9();
    node.restart();
    let mut conn = NbdConn::connect(node.nbd_addr(), "c").unwrap();
    conn.write_ok(0, &vec![0x33u8; BLOCK as usize]);
    assert_eq!(
        conn.read_ok(0, BLOCK as u32),
        vec![0x33u8; BLOCK as usize],
        "a full overwrite heals the block"
    );
}

// ----- damage to the oplog and to extent-store metadata, with a bystander vdisk -----

/// Size of the two vdisks of the damage tests.
const VDISK_BYTES: u64 = 32 * MIB;
const VDISK_BLOCKS: u64 = VDISK_BYTES / BLOCK;

/// What a vdisk should hold: its whole content, kept in memory.
struct Image(Vec<u8>);

impl Image {
    fn new() -> Image {
        Image(vec![0u8; VDISK_BYTES as usize])
    }

    fn put(&mut self, offset: u64, data: &[u8]) {
        self.0[offset as usize..offset as usize + data.len()].copy_from_slice(data);
    }

    fn block(&self, index: u64) -> &[u8] {
        &self.0[(index * BLOCK) as usize..((index + 1) * BLOCK) as usize]
    }
}

/// Writes all of `writes` (pipelined) through our client; every one must succeed.
fn write_all(node: &Node, vdisk: &str, writes: &[(u64, Vec<u8>)], image: &mut Image) {
    let mut conn = NbdConn::connect(node.nbd_addr(), vdisk).unwrap();
    let errors = conn.write_many(writes).expect("writing");
    for ((offset, data), error) in writes.iter().zip(errors) {
        assert_eq!(error, 0, "write [{offset}, +{}) of {vdisk}", data.len());
        image.put(*offset, data);
    }
    conn.disconnect();
}

/// `count` 4 KiB writes of random data at distinct blocks spread over the vdisk (both
/// shards' ranges).
fn scattered_4k_writes(rng: &mut Rng, count: u64, stride: u64, first: u64) -> Vec<(u64, Vec<u8>)> {
    (0..count)
        .map(|i| {
            let block = (first + i * stride) % VDISK_BLOCKS;
            (block * BLOCK, rng.bytes(BLOCK as usize))
        })
        .collect()
}

/// Aligned 1 MiB writes (they bypass the oplog into the extent store) over `[start, end)`.
fn whole_extent_writes(rng: &mut Rng, start: u64, end: u64) -> Vec<(u64, Vec<u8>)> {
    (start / MIB..end / MIB)
        .map(|extent| (extent * MIB, rng.bytes(MIB as usize)))
        .collect()
}

/// Reads every block of `vdisk` (one 4 KiB request each) and checks it against `image`:
/// the blocks in `broken` (block indices) must fail with EIO, every other block must hold
/// exactly what was written. Returns how many blocks failed.
fn check_blocks(node: &Node, vdisk: &str, image: &Image, broken: &BTreeSet<u64>) -> usize {
    let mut conn = NbdConn::connect(node.nbd_addr(), vdisk).unwrap();
    let blocks = conn
        .read_blocks(0, VDISK_BYTES, BLOCK as u32)
        .expect("reading every block");
    conn.disconnect();
    let mut problems = Vec::new();
    let mut failed = 0;
    for (index, got) in blocks.iter().enumerate() {
        let offset = index as u64 * BLOCK;
        let is_broken = broken.contains(&(index as u64));
        match (is_broken, got) {
            (true, Err(EIO)) => failed += 1,
            (true, other) => problems.push(format!(
                "block at {offset} is damaged and must read as EIO, got {}",
                match other {
                    Ok(data) if data == image.block(index as u64) =>
                        "the written data (the damage went unnoticed)".to_string(),
                    Ok(_) => "OTHER DATA".to_string(),
                    Err(errno) => format!("errno {errno}"),
                }
            )),
            (false, Ok(data)) if data == image.block(index as u64) => {}
            (false, Ok(_)) => problems.push(format!("block at {offset} holds wrong data")),
            (false, Err(errno)) => {
                problems.push(format!("block at {offset} failed with errno {errno}"))
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{vdisk}: {} of {VDISK_BLOCKS} blocks wrong; first ones:\n{}",
        problems.len(),
        problems
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    failed
}

/// Real clients: `nbdcopy` and `qemu-img convert` of the damaged vdisk must fail (never hand
/// out a copy with wrong data), and `nbdcopy` of the healthy vdisk must copy it exactly.
fn check_with_real_clients(node: &Node, damaged: &str, healthy: &str, healthy_image: &Image) {
    let out = node.root.path().join("copy.raw");
    let nbdcopy = CmdOut::from_output(run_bounded(
        "nbdcopy",
        &[node.uri(damaged).as_str(), out.to_str().unwrap()],
        120,
    ));
    assert!(
        !nbdcopy.status.success() && nbdcopy.code() != Some(124),
        "nbdcopy of the damaged vdisk must fail promptly: {nbdcopy:?}"
    );
    let qemu = CmdOut::from_output(run_bounded(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            node.uri(damaged).as_str(),
            out.to_str().unwrap(),
        ],
        120,
    ));
    assert!(
        !qemu.status.success() && qemu.code() != Some(124),
        "qemu-img convert of the damaged vdisk must fail promptly: {qemu:?}"
    );
    assert!(
        format!("{}{}", qemu.stdout, qemu.stderr).contains("Input/output error"),
        "qemu-img names the I/O error: {qemu:?}"
    );
    std::fs::remove_file(&out).ok();
    CmdOut::from_output(run_bounded(
        "nbdcopy",
        &[node.uri(healthy).as_str(), out.to_str().unwrap()],
        120,
    ))
    .assert_ok("nbdcopy of the healthy vdisk");
    let copied = std::fs::read(&out).unwrap();
    assert!(
        copied == healthy_image.0,
        "nbdcopy of {healthy} does not match what was written"
    );
    std::fs::remove_file(&out).ok();
}

/// The indices of the blocks that overlap the byte ranges `(start, length)`.
fn blocks_of(ranges: &[(u64, u64)]) -> BTreeSet<u64> {
    ranges
        .iter()
        .flat_map(|&(start, len)| start / BLOCK..(start + len).div_ceil(BLOCK))
        .collect()
}

fn flip_byte(path: &Path, at: u64) {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut byte = [0u8; 1];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
    file.sync_all().unwrap();
}

/// A record of an oplog batch, as found on disk (docs/oplog-format.md, version 3).
#[derive(Debug, Clone)]
struct OplogRecord {
    kind: u8,
    offset: u64,
    length: u64,
    chunks: u64,
    /// File offset of the record header.
    at: u64,
}

#[derive(Debug, Clone)]
struct OplogBatch {
    path: PathBuf,
    /// File offset of the batch header.
    at: u64,
    number: u64,
    window: u64,
    records: Vec<OplogRecord>,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// Every batch of the current incarnation of every active segment in the oplog directory
/// `dir`, in batch-number order. Written from the format document, not from the code.
fn oplog_batches(dir: &Path) -> Vec<OplogBatch> {
    let mut batches = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("oplog") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        // Header slot 0: magic "AOPS", version 3, state 1 = active.
        if bytes.len() < 8192 || &bytes[0..4] != b"AOPS" || bytes[4] != 3 || bytes[5] != 1 {
            continue;
        }
        let segment_id = le64(&bytes, 24);
        let mut pos = 8192usize;
        while pos + 4096 <= bytes.len() {
            let b = &bytes[pos..];
            if &b[0..4] != b"AOPB" || b[4] != 3 || le64(b, 16) != segment_id {
                pos += 4096;
                continue;
            }
            let seal = b[5] & 1 != 0;
            let count = le32(b, 56) as usize;
            let size = le32(b, 60) as usize;
            let mut records = Vec::new();
            let mut record_at = 72 + 24 * count;
            for i in 0..count {
                let entry = 72 + 24 * i;
                let record = OplogRecord {
                    offset: le64(b, entry),
                    length: le64(b, entry + 8),
                    kind: b[entry + 16],
                    chunks: le32(b, record_at + 32) as u64,
                    at: (pos + record_at) as u64,
                };
                assert_eq!(&b[record_at..record_at + 4], b"AOPR", "{record:?}");
                record_at += 40 + 4 * record.chunks as usize;
                if record.kind == 1 {
                    record_at += record.length as usize;
                }
                records.push(record);
            }
            batches.push(OplogBatch {
                path: path.clone(),
                at: pos as u64,
                number: le64(b, 32),
                window: le32(b, 64) as u64,
                records,
            });
            if seal {
                break;
            }
            pos += size.max(4096);
        }
    }
    batches.sort_by_key(|b| b.number);
    batches
}

/// The oplog directories (one per shard) of the vdisk with directory name `dir_name`.
fn oplog_dirs(node: &Node, dir_name: &str) -> Vec<PathBuf> {
    let root = node.data_dir.join("disk0/oplog").join(dir_name);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum OplogDamage {
    /// A byte of a record's payload (its chunk CRC no longer matches).
    Payload,
    /// A byte of a record's header (its header CRC no longer matches).
    RecordHeader,
    /// A byte of a batch header (the batch is recovered from its records' own headers).
    BatchHeader,
}

/// Hundreds of acknowledged 4 KiB writes sit in the oplog when the node is killed; one byte
/// of one record (or of one batch header) in the middle of them is flipped. After the restart
/// the node serves both vdisks; exactly the damaged record's blocks read as EIO (none for a
/// batch header, which replay recovers from the record headers), every other block of both
/// vdisks reads back exactly, and the log names the file and offset.
fn oplog_damage(damage: OplogDamage) {
    let mut node = Node::start();
    node.create_vdisk("victim", "32M");
    node.create_vdisk("bystander", "32M");
    let mut rng = Rng::new(damage as u64 + 1000);
    let (mut victim, mut bystander) = (Image::new(), Image::new());
    // The bystander: whole extents in the extent store and small writes in its oplog.
    let writes = whole_extent_writes(&mut rng, 0, 4 * MIB);
    write_all(&node, "bystander", &writes, &mut bystander);
    let writes = scattered_4k_writes(&mut rng, 100, 53, 7);
    write_all(&node, "bystander", &writes, &mut bystander);
    // The victim: 400 blocks over the whole vdisk (both shards), pipelined, then a few more
    // writes to the bystander, then kill -9 at once: the drain starts only after writes pause
    // for 500 ms, so every record is still in the oplogs.
    let writes = scattered_4k_writes(&mut rng, 400, 37, 0);
    write_all(&node, "victim", &writes, &mut victim);
    let writes = scattered_4k_writes(&mut rng, 20, 101, 3);
    write_all(&node, "bystander", &writes, &mut bystander);
    let dir_name = node.vdisk_dir_name("victim");
    node.kill9();

    // The damaged batch: one in the middle of the longest log, with later batches that vouch
    // for it (number - window >= its number), so replay can tell rot from a torn tail.
    let logs: Vec<Vec<OplogBatch>> = oplog_dirs(&node, &dir_name)
        .iter()
        .map(|dir| oplog_batches(dir))
        .collect();
    let log = logs.iter().max_by_key(|l| l.len()).unwrap();
    let records: usize = logs.iter().flatten().map(|b| b.records.len()).sum();
    assert!(
        records >= 400,
        "the victim's oplogs hold {records} records, expected all 400 writes: did a drain run \
         before the kill?"
    );
    let batch = log[log.len() / 2].clone();
    assert!(
        log.iter()
            .any(|b| b.number - b.window.min(b.number) >= batch.number),
        "no batch vouches for batch {}: {:?}",
        batch.number,
        log.iter().map(|b| (b.number, b.window)).collect::<Vec<_>>()
    );
    let record = batch.records[0].clone();
    assert!(
        record.kind == 1 && record.length == BLOCK && record.offset % BLOCK == 0,
        "expected a 4 KiB write record: {record:?}"
    );
    let (flip_at, expect_offset, lost) = match damage {
        OplogDamage::Payload => {
            let payload = record.at + 40 + 4 * record.chunks;
            (payload + 100, payload, vec![(record.offset, BLOCK)])
        }
        OplogDamage::RecordHeader => (record.at + 17, record.at, vec![(record.offset, BLOCK)]),
        OplogDamage::BatchHeader => (batch.at + 20, batch.at, vec![]),
    };
    eprintln!(
        "damaging {:?} of batch {} ({} records) at {}:{flip_at}, record {record:?}",
        damage,
        batch.number,
        batch.records.len(),
        batch.path.display()
    );
    flip_byte(&batch.path, flip_at);

    node.restart();
    assert_eq!(node.show("victim")["state"], "online");
    assert_eq!(node.show("bystander")["state"], "online");
    let failed = check_blocks(&node, "victim", &victim, &blocks_of(&lost));
    assert_eq!(failed, lost.len(), "blocks failing with EIO");
    check_blocks(&node, "bystander", &bystander, &BTreeSet::new());
    // Once more: the failure is not a one-off, and nothing bad was cached.
    check_blocks(&node, "victim", &victim, &blocks_of(&lost));

    let stats = node.vdisk_stats("victim");
    assert_eq!(
        stats["oplog_lost_ranges"].as_u64(),
        Some(lost.len() as u64),
        "oplog_lost_ranges of the victim: {stats}"
    );
    assert_eq!(
        node.vdisk_stats("bystander")["oplog_lost_ranges"].as_u64(),
        Some(0)
    );
    let node_log = node.log();
    let path = batch.path.to_str().unwrap();
    // The engine's line about it names the file, the file offset and (for a loss) the
    // vdisk offset.
    let says = if lost.is_empty() {
        "no data lost".to_string()
    } else {
        format!("offset={} length={BLOCK}", record.offset)
    };
    assert!(
        node_log.lines().any(|l| l.contains("ashlar_engine")
            && l.contains(&format!("file={path}"))
            && l.contains(&format!("file_offset={expect_offset}"))
            && l.contains(&says)),
        "no log line of the engine names {path} at file_offset={expect_offset} and says \
         {says:?}:\n{node_log}"
    );

    if !lost.is_empty() {
        check_with_real_clients(&node, "victim", "bystander", &bystander);
        // Rewriting the lost block heals it.
        let fresh = rng.bytes(BLOCK as usize);
        write_all(&node, "victim", &[(record.offset, fresh)], &mut victim);
        check_blocks(&node, "victim", &victim, &BTreeSet::new());
    }
    node.assert_alive();
}

#[test]
fn flipped_byte_in_an_oplog_record_payload_loses_only_that_record() {
    oplog_damage(OplogDamage::Payload);
}

#[test]
fn flipped_byte_in_an_oplog_record_header_loses_only_that_record() {
    oplog_damage(OplogDamage::RecordHeader);
}

#[test]
fn flipped_byte_in_an_oplog_batch_header_is_recovered_from_the_record_headers() {
    oplog_damage(OplogDamage::BatchHeader);
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum ExtentDamage {
    /// A byte of the checksum block of extent 1 of egroup 0.
    ChecksumBlock,
    /// A byte of the header of egroup 1.
    EgroupHeader,
}

/// Data written to the extent store (whole extents, and small writes drained from the oplog);
/// the node is stopped, one byte of egroup metadata flipped. After the restart the blocks it
/// describes read as EIO (an extent for a checksum block, the whole egroup for a header),
/// everything else of both vdisks reads back exactly, and the log names the file and offset.
fn extent_damage(damage: ExtentDamage) {
    let mut node = Node::start();
    node.create_vdisk("victim", "32M");
    node.create_vdisk("bystander", "32M");
    let mut rng = Rng::new(damage as u64 + 2000);
    let (mut victim, mut bystander) = (Image::new(), Image::new());
    for (vdisk, image) in [("victim", &mut victim), ("bystander", &mut bystander)] {
        let writes = whole_extent_writes(&mut rng, 0, 8 * MIB);
        write_all(&node, vdisk, &writes, image);
        let writes = scattered_4k_writes(&mut rng, 300, 37, 1);
        write_all(&node, vdisk, &writes, image);
    }
    // Everything drained into the extent store before the stop.
    for vdisk in ["victim", "bystander"] {
        let drained = common::wait_until(std::time::Duration::from_secs(30), || {
            node.vdisk_stats(vdisk)["oplog_live_bytes"].as_u64() == Some(0)
        });
        assert!(
            drained,
            "{vdisk}'s oplog never drained: {}",
            node.vdisk_stats(vdisk)
        );
    }
    let dir_name = node.vdisk_dir_name("victim");
    assert!(node.sigterm_and_wait().success());

    // The stop leaves the drained records in the oplog's tail segment (it is freed once it
    // fills): replay applies them again at the restart and drains them into the extent store,
    // which heals the blocks they cover, damaged or not (their data is what was acknowledged).
    let redrained: BTreeSet<u64> = oplog_dirs(&node, &dir_name)
        .iter()
        .flat_map(|dir| oplog_batches(dir))
        .flat_map(|batch| batch.records)
        .filter(|r| r.kind == 1)
        .flat_map(|r| blocks_of(&[(r.offset, r.length)]))
        .collect();
    let extents = node.data_dir.join("disk0/extents").join(&dir_name);
    let (path, flip_at, damaged, says) = match damage {
        ExtentDamage::ChecksumBlock => (
            // The checksum block of extent 1 (file offset 8192): a byte of block 5's slot 0.
            extents.join(format!("{:016x}.egroup", 0)),
            2 * BLOCK + 12 * 5 + 4,
            (MIB, MIB),
            format!("file_offset={} ", 2 * BLOCK),
        ),
        ExtentDamage::EgroupHeader => (
            // The vdisk id in the header of egroup 1 (vdisk bytes 4 MiB..8 MiB).
            extents.join(format!("{:016x}.egroup", 1)),
            24,
            (4 * MIB, 4 * MIB),
            "bad extent group header".to_string(),
        ),
    };
    let broken: BTreeSet<u64> = blocks_of(&[damaged])
        .difference(&redrained)
        .copied()
        .collect();
    eprintln!(
        "{damage:?}: {} blocks of the damaged range are re-drained from the oplog",
        blocks_of(&[damaged]).len() - broken.len()
    );
    assert!(
        broken.len() > 200,
        "too few damaged blocks: {}",
        broken.len()
    );
    flip_byte(&path, flip_at);

    node.restart();
    let failed = check_blocks(&node, "victim", &victim, &broken);
    assert_eq!(failed, broken.len(), "blocks failing with EIO");
    check_blocks(&node, "bystander", &bystander, &BTreeSet::new());
    check_blocks(&node, "victim", &victim, &broken);
    check_with_real_clients(&node, "victim", "bystander", &bystander);

    let node_log = node.log();
    let path_text = path.to_str().unwrap();
    assert!(
        node_log
            .lines()
            .any(|l| l.contains(&format!("path={path_text}")) && l.contains(&says)),
        "no log line names {path_text} and says {says:?}:\n{node_log}"
    );
    assert_eq!(
        node.vdisk_stats("victim")["oplog_lost_ranges"].as_u64(),
        Some(0)
    );

    // Writing into the damage does not wedge the oplog: a small write drains, the blocks it
    // did not cover stay unreadable, and whole-extent overwrites make everything readable.
    let (start, len) = damaged;
    let small = (start + 3 * BLOCK, rng.bytes(BLOCK as usize));
    write_all(&node, "victim", &[small], &mut victim);
    let drained = common::wait_until(std::time::Duration::from_secs(30), || {
        node.vdisk_stats("victim")["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(
        drained,
        "oplog never drained: {}",
        node.vdisk_stats("victim")
    );
    let mut still_broken = broken.clone();
    still_broken.remove(&(start / BLOCK + 3));
    check_blocks(&node, "victim", &victim, &still_broken);
    let writes = whole_extent_writes(&mut rng, start, start + len);
    write_all(&node, "victim", &writes, &mut victim);
    check_blocks(&node, "victim", &victim, &BTreeSet::new());
    node.assert_alive();
}

#[test]
fn flipped_byte_in_a_checksum_block_fails_that_extent_only() {
    extent_damage(ExtentDamage::ChecksumBlock);
}

#[test]
fn flipped_byte_in_an_egroup_header_fails_that_egroup_only() {
    extent_damage(ExtentDamage::EgroupHeader);
}
