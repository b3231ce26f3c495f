//! A full disk. The node's data directory (metadata store, oplogs and extent groups) sits on a
//! small filesystem of its own (a loop-mounted ext4 image, or tmpfs), which the test fills
//! through NBD: writes must then fail with ENOSPC within a bounded time (never hang), the node
//! stays up and serves every acknowledged block; deleting another vdisk frees space, writes
//! succeed again within a bounded time, and every acknowledged write is intact, also after a
//! restart.
//!
//! Mounting needs root: without it (or without loop devices for ext4) the tests fail and say
//! why, they never skip.

mod common;

use common::nbd::{NbdConn, ENOSPC};
use common::writes::{describe_block, pattern};
use common::{describe, run_bounded, CmdOut, Node, MIB};
use std::path::PathBuf;
use std::time::{Duration, Instant};

const BLOCK: u64 = 4096;

/// Size of the vdisk that is filled: far more than the filesystem holds.
const MAIN_BYTES: u64 = 256 * MIB;
/// Where the 4 KiB writes go: never touched by the 1 MiB writes (which fill from offset 0
/// and stop at the first ENOSPC, long before).
const SMALL_AREA: u64 = 192 * MIB;

/// How long one write may take to be answered, even on a full disk.
const WRITE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq)]
enum FsKind {
    /// A 128 MiB ext4 image mounted through a loop device.
    Ext4,
    /// A 96 MiB tmpfs.
    Tmpfs,
}

/// A small filesystem mounted for one test; unmounted (and its image removed) on drop.
struct SmallFs {
    mountpoint: PathBuf,
    /// Holds the mount point and the ext4 image.
    _dir: tempfile::TempDir,
}

fn run_ok(program: &str, args: &[&str], what: &str) {
    CmdOut::from_output(run_bounded(program, args, 60)).assert_ok(what);
}

impl SmallFs {
    fn mount(kind: FsKind) -> SmallFs {
        assert!(
            unsafe { libc::geteuid() } == 0,
            "the full-disk tests mount a small filesystem and need root (run the suite as root, \
             as CI does)"
        );
        let dir = tempfile::Builder::new()
            .prefix("ashlar-full-")
            .tempdir()
            .unwrap();
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint).unwrap();
        let target = mountpoint.to_str().unwrap();
        match kind {
            FsKind::Ext4 => {
                let image = dir.path().join("fs.img");
                std::fs::File::create(&image)
                    .unwrap()
                    .set_len(128 * MIB)
                    .unwrap();
                let image = image.to_str().unwrap();
                // No blocks reserved for root: the node runs as root and would use them.
                run_ok("mkfs.ext4", &["-q", "-F", "-m", "0", image], "mkfs.ext4");
                let out =
                    CmdOut::from_output(run_bounded("mount", &["-o", "loop", image, target], 60));
                assert!(
                    out.status.success(),
                    "mounting an ext4 image through a loop device failed (are loop devices \
                     available? /dev/loop-control): {out:?}"
                );
            }
            FsKind::Tmpfs => {
                run_ok(
                    "mount",
                    &["-t", "tmpfs", "-o", "size=96m", "tmpfs", target],
                    "mounting a tmpfs",
                );
            }
        }
        SmallFs {
            mountpoint,
            _dir: dir,
        }
    }

    fn free_bytes(&self) -> u64 {
        let path = std::ffi::CString::new(self.mountpoint.to_str().unwrap()).unwrap();
        let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), &mut stat) }, 0);
        stat.f_bavail as u64 * stat.f_frsize as u64
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let target = self.mountpoint.to_str().unwrap().to_string();
        for _ in 0..10 {
            if run_bounded("umount", &[target.as_str()], 30)
                .status
                .success()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        // Still busy: detach it so nothing is left mounted.
        let _ = run_bounded("umount", &["-l", target.as_str()], 30);
    }
}

/// What each 4 KiB block of the filled vdisk may hold: the newest acknowledged write, or one
/// of the writes that failed after it (a failed write may leave old or new data).
#[derive(Clone, Default)]
struct Slot {
    acked: Option<u64>,
    failed: Vec<u64>,
}

struct Model {
    slots: Vec<Slot>,
    seq: u64,
}

impl Model {
    fn new(bytes: u64) -> Model {
        Model {
            slots: vec![Slot::default(); (bytes / BLOCK) as usize],
            seq: 0,
        }
    }

    fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn record(&mut self, offset: u64, len: u64, seq: u64, error: u32) {
        for slot in &mut self.slots[(offset / BLOCK) as usize..((offset + len) / BLOCK) as usize] {
            if error == 0 {
                *slot = Slot {
                    acked: Some(seq),
                    failed: Vec::new(),
                };
            } else {
                slot.failed.push(seq);
            }
        }
    }

    /// Reads the whole vdisk back and checks every block.
    fn check(&self, node: &Node, vdisk: &str, when: &str) {
        let mut conn = NbdConn::connect(node.nbd_addr(), vdisk).expect("connecting");
        let data = conn
            .read_range(0, self.slots.len() as u64 * BLOCK, MIB as u32)
            .unwrap_or_else(|e| panic!("{when}: reading {vdisk} back: {e}"));
        conn.disconnect();
        let zeros = vec![0u8; BLOCK as usize];
        let mut bad = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            let offset = i as u64 * BLOCK;
            let got = &data[offset as usize..(offset + BLOCK) as usize];
            let ok = match slot.acked {
                Some(seq) => got == pattern(offset, seq, BLOCK as usize).as_slice(),
                None => got == zeros.as_slice(),
            } || slot
                .failed
                .iter()
                .any(|&seq| got == pattern(offset, seq, BLOCK as usize).as_slice());
            if !ok {
                bad.push(format!(
                    "block at {offset}: expected {} (or failed writes {:?}), found {}",
                    slot.acked.map_or("zeros".into(), |s| format!("seq {s}")),
                    slot.failed,
                    describe_block(got)
                ));
            }
        }
        assert!(
            bad.is_empty(),
            "{when}: {} blocks of {vdisk} lost acknowledged data or hold garbage; first ones:\n{}",
            bad.len(),
            bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
        );
    }
}

/// One write, answered within `WRITE_LIMIT`; returns the NBD error.
fn timed_write(conn: &mut NbdConn, offset: u64, data: &[u8]) -> u32 {
    let started = Instant::now();
    let error = conn
        .write(offset, data)
        .unwrap_or_else(|e| panic!("write [{offset}, +{}): no answer: {e}", data.len()));
    let took = started.elapsed();
    assert!(
        took < WRITE_LIMIT,
        "write [{offset}, +{}) took {took:?} (error {error}): writes to a full disk must be \
         answered promptly",
        data.len()
    );
    error
}

/// `direct_io`: `--direct-io` of the node; `None` leaves it to the suite (O_DIRECT, or the
/// page cache in the suite's second run with `ASHLAR_TEST_DIRECT_IO=off`).
fn full_disk(kind: FsKind, direct_io: Option<&str>) {
    let fs = SmallFs::mount(kind);
    let args = match direct_io {
        Some(mode) => vec!["--direct-io", mode],
        None => vec![],
    };
    let mut node = Node::start_in(Some(fs.mountpoint.join("data")), &args);
    node.create_vdisk("filler", "64M");
    node.create_vdisk("main", &format!("{}M", MAIN_BYTES / MIB));
    eprintln!(
        "{kind:?}, --direct-io {direct_io:?}: {} MiB free at the start",
        fs.free_bytes() / MIB
    );

    // 1. Another vdisk takes 24 MiB (whole extents, straight to the extent store).
    let mut filler = Model::new(64 * MIB);
    {
        let mut conn = NbdConn::connect(node.nbd_addr(), "filler").unwrap();
        for extent in 0..24u64 {
            let seq = filler.next();
            let offset = extent * MIB;
            let error = timed_write(&mut conn, offset, &pattern(offset, seq, MIB as usize));
            assert_eq!(
                error,
                0,
                "filling the other vdisk at {offset} (free space left: {} MiB)",
                fs.free_bytes() / MIB
            );
            filler.record(offset, MIB, seq, error);
        }
        conn.disconnect();
    }
    eprintln!(
        "{} MiB free after filling the other vdisk",
        fs.free_bytes() / MIB
    );

    // 2. Whole extents into the main vdisk until the disk is full.
    let mut main = Model::new(MAIN_BYTES);
    let mut conn = NbdConn::connect(node.nbd_addr(), "main").unwrap();
    let fill_started = Instant::now();
    let mut next_extent = 0u64;
    let first_error = loop {
        assert!(
            next_extent * MIB < SMALL_AREA,
            "{} MiB written to a filesystem of at most 128 MiB and no write failed",
            next_extent
        );
        assert!(
            fill_started.elapsed() < Duration::from_secs(120),
            "filling took over 120 s"
        );
        let seq = main.next();
        let offset = next_extent * MIB;
        let error = timed_write(&mut conn, offset, &pattern(offset, seq, MIB as usize));
        main.record(offset, MIB, seq, error);
        next_extent += 1;
        if error != 0 {
            break error;
        }
    };
    assert_eq!(
        first_error, ENOSPC,
        "a write to a full disk must fail with ENOSPC"
    );
    eprintln!(
        "the 1 MiB write at {} MiB failed with ENOSPC after {:?}; {} MiB free",
        next_extent - 1,
        fill_started.elapsed(),
        fs.free_bytes() / MIB
    );
    // More whole-extent writes into unallocated space fail the same way, promptly.
    for _ in 0..3 {
        let seq = main.next();
        let offset = next_extent * MIB;
        let error = timed_write(&mut conn, offset, &pattern(offset, seq, MIB as usize));
        main.record(offset, MIB, seq, error);
        next_extent += 1;
        assert_eq!(error, ENOSPC, "another 1 MiB write to the full disk");
    }

    // 3. Small writes (through the oplog) to unallocated space: the oplog may take some while
    // it has room, then they must fail with ENOSPC too (its drain cannot place them).
    let small_started = Instant::now();
    let mut small_acked = 0u64;
    let mut small_failed = 0u64;
    let mut block = 0u64;
    while small_failed < 20 {
        assert!(
            small_started.elapsed() < Duration::from_secs(120),
            "4 KiB writes to a full disk still succeeded after 120 s ({small_acked} acknowledged)"
        );
        // Spread over the area: each write in a different 1 MiB extent, many egroups.
        let offset = SMALL_AREA + (block * 257 % ((MAIN_BYTES - SMALL_AREA) / BLOCK)) * BLOCK;
        block += 1;
        let seq = main.next();
        let error = timed_write(&mut conn, offset, &pattern(offset, seq, BLOCK as usize));
        main.record(offset, BLOCK, seq, error);
        match error {
            0 => small_acked += 1,
            ENOSPC => small_failed += 1,
            other => panic!("a 4 KiB write to the full disk failed with errno {other}, not ENOSPC"),
        }
    }
    eprintln!(
        "4 KiB writes: {small_acked} acknowledged (in the oplog), then ENOSPC; {:?}",
        small_started.elapsed()
    );

    // 4. Overwriting allocated data needs no space.
    {
        let seq = main.next();
        let error = timed_write(&mut conn, 0, &pattern(0, seq, MIB as usize));
        main.record(0, MIB, seq, error);
        assert_eq!(error, 0, "overwriting an allocated extent of the full disk");
    }
    conn.disconnect();
    node.assert_alive();

    // 5. Everything acknowledged reads back, from both vdisks, while the disk is full.
    main.check(&node, "main", "on the full disk");
    filler.check(&node, "filler", "on the full disk");

    // A real client sees the error too (the other vdisk, about to be deleted, is written).
    let qemu = CmdOut::from_output(run_bounded(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            "write -P 0xab 40M 1M",
            node.uri("filler").as_str(),
        ],
        60,
    ));
    assert!(
        format!("{}{}", qemu.stdout, qemu.stderr).contains("No space left on device"),
        "qemu-io writing to the full disk must report ENOSPC: {qemu:?}"
    );
    node.assert_alive();

    // 6. Deleting the other vdisk frees space; writes succeed again within 30 s.
    let before = fs.free_bytes();
    let deleted = Instant::now();
    node.cli(&["vdisk", "delete", "filler"])
        .assert_ok("deleting a vdisk on a full disk");
    eprintln!(
        "deleted the other vdisk in {:?}: {} MiB free (was {} MiB)",
        deleted.elapsed(),
        fs.free_bytes() / MIB,
        before / MIB
    );
    let mut conn = NbdConn::connect(node.nbd_addr(), "main").unwrap();
    let recovered = loop {
        let seq = main.next();
        let offset = next_extent * MIB;
        let error = timed_write(&mut conn, offset, &pattern(offset, seq, MIB as usize));
        main.record(offset, MIB, seq, error);
        if error == 0 {
            break deleted.elapsed();
        }
        assert_eq!(error, ENOSPC, "a write after the delete");
        assert!(
            deleted.elapsed() < Duration::from_secs(30),
            "writes still fail with ENOSPC 30 s after space was freed"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    next_extent += 1;
    // Small writes to unallocated space work again too.
    let small_recovered = loop {
        let offset = SMALL_AREA + (block * 257 % ((MAIN_BYTES - SMALL_AREA) / BLOCK)) * BLOCK;
        block += 1;
        let seq = main.next();
        let error = timed_write(&mut conn, offset, &pattern(offset, seq, BLOCK as usize));
        main.record(offset, BLOCK, seq, error);
        if error == 0 {
            break deleted.elapsed();
        }
        assert_eq!(error, ENOSPC, "a 4 KiB write after the delete");
        assert!(
            deleted.elapsed() < Duration::from_secs(30),
            "4 KiB writes still fail with ENOSPC 30 s after space was freed"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "writes succeed again {recovered:?} (1 MiB) and {small_recovered:?} (4 KiB) after the \
         delete"
    );
    for _ in 0..4 {
        let seq = main.next();
        let offset = next_extent * MIB;
        let error = timed_write(&mut conn, offset, &pattern(offset, seq, MIB as usize));
        main.record(offset, MIB, seq, error);
        assert_eq!(error, 0, "1 MiB writes after space was freed");
        next_extent += 1;
    }
    conn.disconnect();
    // The oplog drains what it took while the disk was full.
    let drained = common::wait_until(Duration::from_secs(30), || {
        node.vdisk_stats("main")["oplog_live_bytes"].as_u64() == Some(0)
    });
    assert!(
        drained,
        "the oplog did not drain within 30 s of space being freed: {}",
        node.vdisk_stats("main")
    );
    main.check(&node, "main", "after space was freed");

    // 7. And after a clean restart.
    let status = node.sigterm_and_wait();
    assert!(status.success(), "SIGTERM: {}", describe(&status));
    node.restart();
    main.check(&node, "main", "after a restart");
    let listed = node.cli(&["vdisk", "list"]);
    listed.assert_ok("vdisk list");
    assert!(
        !listed.stdout.contains("filler"),
        "the deleted vdisk stays deleted: {}",
        listed.stdout
    );
    drop(node);
    drop(fs);
}

#[test]
fn full_ext4_disk_fails_writes_with_enospc_and_recovers_when_space_is_freed() {
    full_disk(FsKind::Ext4, Some("on"));
}

#[test]
fn full_ext4_disk_through_the_page_cache_fails_writes_with_enospc_and_recovers() {
    full_disk(FsKind::Ext4, Some("off"));
}

#[test]
fn full_tmpfs_fails_writes_with_enospc_and_recovers_when_space_is_freed() {
    full_disk(FsKind::Tmpfs, None);
}
