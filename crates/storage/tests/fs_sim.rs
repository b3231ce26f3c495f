//! The simulated disk itself: durability, power cuts and injected faults.

use ashlar_storage::fs::sim::{CutPolicy, Times};
use ashlar_storage::fs::{is_no_space, DiskFile, Filesystem, IoMode, SimFile, SimFs};
use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where two byte strings first differ (for messages that do not print megabytes).
fn diff(a: &[u8], b: &[u8]) -> Option<String> {
    if a == b {
        return None;
    }
    let at = a
        .iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()));
    Some(format!(
        "lengths {} and {}, first difference at {at}: {:?} vs {:?}",
        a.len(),
        b.len(),
        a.get(at),
        b.get(at)
    ))
}

fn errno<T>(result: io::Result<T>) -> Option<i32> {
    result.err().and_then(|e| e.raw_os_error())
}

/// A disk with `/d` made and the files named there created and durable.
async fn disk_with(names: &[&str]) -> (SimFs, Vec<SimFile>) {
    let fs = SimFs::new(IoMode::Buffered);
    fs.create_dir_all(Path::new("/d")).await.unwrap();
    let mut files = Vec::new();
    for name in names {
        files.push(fs.open(&Path::new("/d").join(name), true).await.unwrap());
    }
    fs.sync_dir(Path::new("/d")).await.unwrap();
    (fs, files)
}

async fn contents(fs: &SimFs, path: &str) -> Vec<u8> {
    let file = fs.open(Path::new(path), false).await.unwrap();
    let mut buf = vec![0u8; file.len().await.unwrap() as usize];
    file.read_at(&mut buf, 0).await.unwrap();
    buf
}

#[tokio::test]
async fn drop_all_keeps_exactly_the_durable_state() {
    let (fs, files) = disk_with(&["f"]).await;
    let f = &files[0];
    f.write_at(&[1u8; 8192], 0).await.unwrap();
    f.sync_data().await.unwrap();
    f.write_at(&[2u8; 4096], 0).await.unwrap(); // pending
    f.write_at(&[3u8; 4096], 8192).await.unwrap(); // pending, extends
    f.write_durable_at(&[4u8; 100], 4096).await.unwrap(); // durable at once
    f.punch_hole(0, 4096).await.unwrap(); // pending
    assert_eq!(fs.read_live(Path::new("/d/f")).unwrap().len(), 12288);

    let report = fs.power_cut(CutPolicy::DropAll);
    assert_eq!(report.changes_kept, 0);
    assert_eq!(report.changes_dropped, 3, "two sectors and a punched block");
    // The durable write committed the file size too (journaled metadata), not the data.
    let mut expected = vec![1u8; 8192];
    expected[4096..4196].fill(4);
    expected.resize(12288, 0);
    assert_eq!(contents(&fs, "/d/f").await, expected);
}

#[tokio::test]
async fn keep_all_keeps_the_live_state_and_kills_handles() {
    let (fs, files) = disk_with(&["f"]).await;
    files[0].write_at(b"kept", 10).await.unwrap();
    fs.open(Path::new("/d/new"), true).await.unwrap();
    let report = fs.power_cut(CutPolicy::KeepAll);
    assert_eq!(report.changes_dropped, 0);
    assert_eq!(report.handles_killed, 1);
    assert_eq!(&contents(&fs, "/d/f").await[10..], b"kept");
    assert!(fs.exists(Path::new("/d/new")).await.unwrap());
}

#[tokio::test]
async fn write_durable_at_leaves_other_writes_pending() {
    let (fs, files) = disk_with(&["f"]).await;
    let f = &files[0];
    f.write_at(&[1u8; 4096], 0).await.unwrap();
    f.write_durable_at(&[2u8; 4096], 4096).await.unwrap();
    f.write_at(&[3u8; 4096], 8192).await.unwrap();
    assert_eq!(fs.read_durable(Path::new("/d/f")).unwrap().len(), 8192);
    fs.power_cut(CutPolicy::DropAll);
    let mut expected = vec![0u8; 8192];
    expected[4096..].fill(2);
    assert_eq!(contents(&fs, "/d/f").await, expected);
}

#[tokio::test]
async fn an_older_pending_write_never_lands_over_a_durable_one() {
    for seed in 0..50 {
        let (fs, files) = disk_with(&["f"]).await;
        files[0].write_at(&[1u8; 4096], 0).await.unwrap();
        files[0].write_durable_at(&[2u8; 4096], 0).await.unwrap();
        fs.power_cut(CutPolicy::Random { seed });
        assert_eq!(contents(&fs, "/d/f").await, vec![2u8; 4096], "seed {seed}");
    }
}

#[tokio::test]
async fn unsynced_create_disappears_even_with_synced_data() {
    let (fs, _) = disk_with(&[]).await;
    let f = fs.open(Path::new("/d/new"), true).await.unwrap();
    f.write_at(b"data", 0).await.unwrap();
    f.sync_data().await.unwrap();
    assert_eq!(fs.durable_files(), Vec::<PathBuf>::new());
    let report = fs.power_cut(CutPolicy::DropAll);
    assert_eq!(report.files_lost, 1);
    assert!(!fs.exists(Path::new("/d/new")).await.unwrap());
    assert!(
        fs.exists(Path::new("/d")).await.unwrap(),
        "create_dir_all is durable"
    );
}

#[tokio::test]
async fn synced_dir_keeps_its_entries() {
    let (fs, _) = disk_with(&[]).await;
    fs.create_dir_all(Path::new("/d/sub")).await.unwrap();
    fs.open(Path::new("/d/sub/a"), true).await.unwrap();
    fs.open(Path::new("/d/sub/b"), true).await.unwrap();
    fs.sync_dir(Path::new("/d/sub")).await.unwrap();
    fs.open(Path::new("/d/sub/c"), true).await.unwrap();
    let info = fs.files();
    assert_eq!(info.len(), 3);
    assert!(info[0].entry_durable && info[1].entry_durable && !info[2].entry_durable);
    fs.power_cut(CutPolicy::DropAll);
    let names: Vec<String> = fs
        .list_dir(Path::new("/d/sub"))
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["a", "b"]);
}

#[tokio::test]
async fn removal_is_durable_only_after_sync_dir() {
    let (fs, files) = disk_with(&["a", "b"]).await;
    files[0].write_at(b"A", 0).await.unwrap();
    files[0].sync_data().await.unwrap();
    fs.remove_file(Path::new("/d/a")).await.unwrap();
    fs.remove_file(Path::new("/d/b")).await.unwrap();
    fs.power_cut(CutPolicy::DropAll);
    assert_eq!(contents(&fs, "/d/a").await, b"A", "unsynced unlink undone");
    fs.remove_file(Path::new("/d/a")).await.unwrap();
    fs.sync_dir(Path::new("/d")).await.unwrap();
    fs.power_cut(CutPolicy::DropAll);
    assert_eq!(fs.list_dir(Path::new("/d")).await.unwrap().len(), 1);
    assert!(fs.exists(Path::new("/d/b")).await.unwrap());
}

/// A file created, written, closed and removed, none of it synced: a cut may keep the
/// creation and drop the removal (a directory keeps a prefix of its entry changes). The file
/// is then there like any other, never a name without a file behind it.
#[tokio::test]
async fn an_unsynced_create_kept_without_its_removal_leaves_a_whole_file() {
    let path = Path::new("/d/f");
    let mut survived = 0;
    for seed in 0..64 {
        let fs = SimFs::new(IoMode::Buffered);
        fs.create_dir_all(Path::new("/d")).await.unwrap();
        let file = fs.open(path, true).await.unwrap();
        file.write_at(b"data", 0).await.unwrap();
        drop(file);
        fs.remove_file(path).await.unwrap();
        fs.power_cut(CutPolicy::Random { seed });
        if !fs.exists(path).await.unwrap() {
            continue;
        }
        survived += 1;
        let file = fs.open(path, false).await.unwrap();
        let len = file
            .len()
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: len of a kept file: {e}"));
        let mut buf = vec![0u8; len as usize];
        file.read_at(&mut buf, 0)
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: read of a kept file: {e}"));
        for (i, &byte) in buf.iter().enumerate() {
            assert!(
                byte == 0 || b"data".get(i) == Some(&byte),
                "seed {seed}: byte {i} is {byte}"
            );
        }
    }
    assert!(survived > 0, "no cut kept the creation without the removal");
}

#[tokio::test]
async fn rename_is_durable_only_after_sync_dir() {
    let (fs, files) = disk_with(&["a", "b"]).await;
    files[0].write_durable_at(b"A", 0).await.unwrap();
    files[1].write_durable_at(b"B", 0).await.unwrap();
    fs.rename(Path::new("/d/a"), Path::new("/d/b"))
        .await
        .unwrap();
    assert_eq!(contents(&fs, "/d/b").await, b"A");
    fs.power_cut(CutPolicy::DropAll);
    assert_eq!(contents(&fs, "/d/a").await, b"A", "rename undone");
    assert_eq!(contents(&fs, "/d/b").await, b"B", "replaced file back");

    fs.rename(Path::new("/d/a"), Path::new("/d/b"))
        .await
        .unwrap();
    fs.sync_dir(Path::new("/d")).await.unwrap();
    fs.power_cut(CutPolicy::DropAll);
    assert!(!fs.exists(Path::new("/d/a")).await.unwrap());
    assert_eq!(contents(&fs, "/d/b").await, b"A");
}

#[tokio::test]
async fn rename_within_a_directory_is_atomic_under_random_cuts() {
    for seed in 0..100 {
        let (fs, files) = disk_with(&["a"]).await;
        files[0].write_durable_at(b"A", 0).await.unwrap();
        fs.rename(Path::new("/d/a"), Path::new("/d/b"))
            .await
            .unwrap();
        fs.power_cut(CutPolicy::Random { seed });
        let a = fs.exists(Path::new("/d/a")).await.unwrap();
        let b = fs.exists(Path::new("/d/b")).await.unwrap();
        assert!(a != b, "seed {seed}: exactly one name ({a}, {b})");
    }
}

#[tokio::test]
async fn cross_directory_rename_needs_both_parents_synced() {
    let (fs, files) = disk_with(&["a"]).await;
    files[0].write_durable_at(b"A", 0).await.unwrap();
    fs.create_dir_all(Path::new("/e")).await.unwrap();
    fs.rename(Path::new("/d/a"), Path::new("/e/a"))
        .await
        .unwrap();
    fs.sync_dir(Path::new("/e")).await.unwrap();
    fs.power_cut(CutPolicy::DropAll);
    // The source entry was not synced: the file has both names now.
    assert_eq!(contents(&fs, "/d/a").await, b"A");
    assert_eq!(contents(&fs, "/e/a").await, b"A");
}

#[tokio::test]
async fn full_disk_fails_with_enospc_until_space_is_freed_or_added() {
    let (fs, files) = disk_with(&["f"]).await;
    let f = &files[0];
    fs.set_capacity(4 * 4096);
    f.write_at(&[1u8; 3 * 4096], 0).await.unwrap();
    f.write_at(b"x", 1 << 30).await.unwrap(); // holes are free
    assert_eq!(fs.used_bytes(), 4 * 4096);
    assert_eq!(fs.free_bytes(Path::new("/d")).await.unwrap(), 0);
    let err = f.write_at(b"y", 1 << 20).await.unwrap_err();
    assert!(is_no_space(&err), "{err}");
    assert!(is_no_space(&f.allocate(1 << 21, 10).await.unwrap_err()));
    f.write_at(b"overwrite", 10).await.unwrap(); // no new block needed
    assert_eq!(
        fs.read_live(Path::new("/d/f")).unwrap()[1 << 20],
        0,
        "nothing written"
    );

    f.punch_hole(0, 4096).await.unwrap();
    assert_eq!(fs.free_bytes(Path::new("/d")).await.unwrap(), 4096);
    f.write_at(b"y", 1 << 20).await.unwrap();
    assert!(is_no_space(&f.write_at(b"z", 1 << 21).await.unwrap_err()));

    fs.set_capacity(1 << 20);
    f.write_at(b"z", 1 << 21).await.unwrap();
    assert_eq!(
        fs.free_bytes(Path::new("/")).await.unwrap(),
        (1 << 20) - fs.used_bytes()
    );
    fs.remove_file(Path::new("/d/f")).await.unwrap();
    assert_ne!(fs.used_bytes(), 0, "an open unlinked file keeps its space");
    drop(files);
    assert_eq!(fs.used_bytes(), 0);
}

#[tokio::test]
async fn failing_syncs_and_what_they_leave_behind() {
    let (fs, files) = disk_with(&["f", "g"]).await;
    let (f, g) = (&files[0], &files[1]);
    fs.fail_syncs(Some(Path::new("/d/f")), Times::Next(1));
    f.write_at(&[1u8; 4096], 0).await.unwrap();
    assert_eq!(errno(f.sync_data().await), Some(libc::EIO));
    g.write_at(b"g", 0).await.unwrap();
    g.sync_data().await.unwrap(); // another path: unaffected
    f.write_at(&[2u8; 4096], 4096).await.unwrap();
    f.sync_data().await.unwrap(); // the rule is spent
    assert_eq!(
        fs.read_live(Path::new("/d/f")).unwrap()[0],
        1,
        "still visible"
    );
    fs.power_cut(CutPolicy::DropAll);
    let after = contents(&fs, "/d/f").await;
    assert_eq!(
        after[..4096],
        [0u8; 4096],
        "a failed sync's data never became durable"
    );
    assert_eq!(after[4096..], [2u8; 4096]);
    assert_eq!(contents(&fs, "/d/g").await, b"g");

    let f = fs.open(Path::new("/d/f"), false).await.unwrap();
    fs.fail_syncs(None, Times::Always);
    assert_eq!(errno(f.sync_data().await), Some(libc::EIO));
    assert_eq!(errno(f.write_durable_at(b"x", 0).await), Some(libc::EIO));
    assert_eq!(errno(fs.sync_dir(Path::new("/d")).await), Some(libc::EIO));
    fs.clear_failures();
    f.write_at(&[3u8; 4096], 0).await.unwrap(); // rewriting supersedes the failed write
    f.sync_data().await.unwrap();
    fs.power_cut(CutPolicy::DropAll);
    assert_eq!(contents(&fs, "/d/f").await[..4096], [3u8; 4096]);
}

#[tokio::test]
async fn failing_reads_and_writes() {
    let (fs, files) = disk_with(&["f"]).await;
    let f = &files[0];
    f.write_at(b"abc", 0).await.unwrap();
    fs.fail_writes(None, Times::Next(2));
    assert_eq!(errno(f.write_at(b"x", 0).await), Some(libc::EIO));
    assert_eq!(errno(f.set_len(0).await), Some(libc::EIO));
    f.write_at(b"A", 0).await.unwrap();
    fs.fail_reads(Some(Path::new("/d")), Times::Always);
    let mut buf = [0u8; 3];
    assert_eq!(errno(f.read_at(&mut buf, 0).await), Some(libc::EIO));
    assert_eq!(errno(f.read_at(&mut buf, 0).await), Some(libc::EIO));
    fs.clear_failures();
    f.read_at(&mut buf, 0).await.unwrap();
    assert_eq!(&buf, b"Abc");
}

#[tokio::test]
async fn bit_flips_and_corruption_show_on_read_and_survive_cuts() {
    let (fs, files) = disk_with(&["f"]).await;
    let f = &files[0];
    f.write_durable_at(&[0xF0u8; 4096], 0).await.unwrap();
    fs.flip_bits(Path::new("/d/f"), 7, 0x01).unwrap();
    fs.corrupt(Path::new("/d/f"), 100, b"rot").unwrap();
    let mut buf = [0u8; 4096];
    f.read_at(&mut buf, 0).await.unwrap();
    assert_eq!(buf[7], 0xF1);
    assert_eq!(&buf[100..103], b"rot");
    fs.power_cut(CutPolicy::DropAll);
    let after = contents(&fs, "/d/f").await;
    assert_eq!(after[7], 0xF1);
    assert_eq!(&after[100..103], b"rot");
    assert_eq!(
        errno(fs.flip_bits(Path::new("/d/f"), 5000, 1)),
        Some(libc::EINVAL)
    );
    assert_eq!(
        errno(fs.corrupt(Path::new("/d/nope"), 0, b"x")),
        Some(libc::ENOENT)
    );
}

#[tokio::test]
async fn handles_from_before_a_cut_fail_with_eio() {
    let (fs, files) = disk_with(&["f"]).await;
    let old = files[0].clone();
    fs.power_cut(CutPolicy::Random { seed: 7 });
    let mut buf = [0u8; 1];
    assert_eq!(errno(old.read_at(&mut buf, 0).await), Some(libc::EIO));
    assert_eq!(errno(old.write_at(b"x", 0).await), Some(libc::EIO));
    assert_eq!(errno(old.sync_data().await), Some(libc::EIO));
    assert_eq!(errno(old.len().await), Some(libc::EIO));
    drop(files);
    drop(old);
    let new = fs.open(Path::new("/d/f"), false).await.unwrap();
    new.write_at(b"x", 0).await.unwrap();
}

#[tokio::test]
async fn direct_mode_refuses_unaligned_writes() {
    let fs = SimFs::new(IoMode::Direct);
    assert_eq!(fs.mode(), IoMode::Direct);
    let f = fs.open(Path::new("/f"), true).await.unwrap();
    assert_eq!(f.mode(), IoMode::Direct);
    assert_eq!(
        errno(f.write_at(&[0u8; 4096], 512).await),
        Some(libc::EINVAL)
    );
    assert_eq!(
        errno(f.write_durable_at(&[0u8; 100], 0).await),
        Some(libc::EINVAL)
    );
    f.write_at(&[9u8; 8192], 4096).await.unwrap();
    let mut buf = [0u8; 3];
    f.read_at(&mut buf, 4095).await.unwrap();
    assert_eq!(buf, [0, 9, 9], "reads need no alignment");
}

#[tokio::test]
async fn operation_counts_by_path() {
    let (fs, files) = disk_with(&["f"]).await;
    fs.create_dir_all(Path::new("/e")).await.unwrap();
    let g = fs.open(Path::new("/e/g"), true).await.unwrap();
    fs.reset_op_counts();
    files[0].write_at(b"x", 0).await.unwrap();
    files[0].write_durable_at(b"y", 0).await.unwrap();
    g.write_at(b"z", 0).await.unwrap();
    g.sync_data().await.unwrap();
    fs.sync_dir(Path::new("/e")).await.unwrap();
    let d = fs.op_counts(Some(Path::new("/d")));
    assert_eq!(
        (d.writes, d.durable_writes, d.syncs, d.dir_syncs),
        (1, 1, 0, 0)
    );
    let e = fs.op_counts(Some(Path::new("/e")));
    assert_eq!(
        (e.writes, e.durable_writes, e.syncs, e.dir_syncs),
        (1, 0, 1, 1)
    );
    assert_eq!(fs.op_counts(None).writes, 2);
    assert_eq!(fs.op_counts(Some(Path::new("/d/f/.."))).writes, 1);
}

#[tokio::test]
async fn delays_slow_down_matching_paths_only() {
    let (fs, files) = disk_with(&["f"]).await;
    let g = fs.open(Path::new("/g"), true).await.unwrap();
    fs.set_delay(Some(Path::new("/d")), Duration::from_millis(40));
    let start = Instant::now();
    g.write_at(b"fast", 0).await.unwrap();
    assert!(start.elapsed() < Duration::from_millis(40));
    let start = Instant::now();
    files[0].write_at(b"slow", 0).await.unwrap();
    assert!(start.elapsed() >= Duration::from_millis(40));
    fs.clear_delays();
    let start = Instant::now();
    files[0].write_at(b"fast", 0).await.unwrap();
    assert!(start.elapsed() < Duration::from_millis(40));
}

#[tokio::test]
async fn bad_arguments_are_errors_not_panics() {
    let (fs, files) = disk_with(&["f"]).await;
    let f = &files[0];
    assert_eq!(errno(f.write_at(b"x", u64::MAX).await), Some(libc::EFBIG));
    assert_eq!(errno(f.punch_hole(u64::MAX, 2).await), Some(libc::EFBIG));
    assert_eq!(errno(f.allocate(1, u64::MAX).await), Some(libc::EFBIG));
    assert_eq!(errno(f.set_len(u64::MAX).await), Some(libc::EFBIG));
    let mut buf = [0u8; 2];
    assert_eq!(
        errno(f.read_at(&mut buf, u64::MAX).await),
        Some(libc::EINVAL)
    );
    assert_eq!(errno(fs.set_sector_bytes(1000)), Some(libc::EINVAL));
    assert_eq!(
        errno(fs.remove_dir(Path::new("/")).await),
        Some(libc::EBUSY)
    );
    assert_eq!(
        errno(fs.rename(Path::new("/"), Path::new("/x")).await),
        Some(libc::EBUSY)
    );
    f.read_at(&mut buf, 1 << 40).await.unwrap();
    f.punch_hole(1 << 40, 1 << 40).await.unwrap(); // past the end: nothing to do
    f.write_at(b"x", 1 << 40).await.unwrap(); // sparse
    f.punch_hole(0, (1 << 40) + 1).await.unwrap(); // cheap: holes need no change
    assert_eq!(
        fs.files()[0].pending_changes,
        3,
        "a sector, the size, a freed block"
    );
    assert_eq!(errno(fs.read_live(Path::new("/d/f"))), Some(libc::EFBIG));
}

#[test]
fn shared_by_two_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<SimFs>();
    assert_send_sync::<SimFile>();
    let fs = SimFs::new(IoMode::Buffered);
    let threads: Vec<_> = (0..2u8)
        .map(|i| {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                runtime.block_on(async {
                    let dir = PathBuf::from(format!("/t{i}"));
                    fs.create_dir_all(&dir).await.unwrap();
                    let f = fs.open(&dir.join("f"), true).await.unwrap();
                    for n in 0..100u64 {
                        f.write_at(&[i; 512], n * 512).await.unwrap();
                    }
                    f.sync_data().await.unwrap();
                    fs.sync_dir(&dir).await.unwrap();
                })
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    fs.power_cut(CutPolicy::DropAll);
    for i in 0..2u8 {
        let data = fs.read_live(Path::new(&format!("/t{i}/f"))).unwrap();
        assert_eq!(data, vec![i; 51_200]);
    }
}

/// What each sector of a file may hold after a power cut.
struct Model {
    sector: u64,
    live: Vec<u8>,
    durable: Vec<u8>,
    /// Values each sector had since it was last durable, the durable one first.
    allowed: HashMap<u64, Vec<Vec<u8>>>,
    /// Sizes the file had since the last `sync_data`.
    lens: Vec<u64>,
}

fn sector_of(bytes: &[u8], index: u64, sector: u64) -> Vec<u8> {
    let mut out = vec![0u8; sector as usize];
    let start = (index * sector) as usize;
    if start < bytes.len() {
        let n = (bytes.len() - start).min(sector as usize);
        out[..n].copy_from_slice(&bytes[start..start + n]);
    }
    out
}

impl Model {
    fn new(sector: u64) -> Model {
        Model {
            sector,
            live: Vec::new(),
            durable: Vec::new(),
            allowed: HashMap::new(),
            lens: vec![0],
        }
    }

    fn sectors(&self, start: u64, end: u64) -> std::ops::Range<u64> {
        start / self.sector..end.div_ceil(self.sector)
    }

    /// Applies a change of `[start, end)` to the live copy and records the new values.
    fn change(&mut self, start: u64, end: u64, apply: impl FnOnce(&mut Vec<u8>)) {
        for s in self.sectors(start, end) {
            let durable = sector_of(&self.durable, s, self.sector);
            self.allowed.entry(s).or_insert_with(|| vec![durable]);
        }
        apply(&mut self.live);
        for s in self.sectors(start, end) {
            let now = sector_of(&self.live, s, self.sector);
            self.allowed.get_mut(&s).unwrap().push(now);
        }
        self.lens.push(self.live.len() as u64);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset + data.len() as u64;
        self.change(offset, end, |live| {
            if live.len() < end as usize {
                live.resize(end as usize, 0);
            }
            live[offset as usize..end as usize].copy_from_slice(data);
        });
    }

    fn write_durable(&mut self, offset: u64, data: &[u8]) {
        self.write(offset, data);
        let end = offset + data.len() as u64;
        for s in self.sectors(offset, end) {
            let now = sector_of(&self.live, s, self.sector);
            let start = (s * self.sector) as usize;
            if self.durable.len() < start + now.len() {
                self.durable.resize(start + now.len(), 0);
            }
            self.durable[start..start + now.len()].copy_from_slice(&now);
            self.allowed.insert(s, vec![now]);
        }
    }

    fn punch(&mut self, offset: u64, length: u64) {
        let end = (offset + length).min(self.live.len() as u64);
        if offset >= end {
            return;
        }
        self.change(offset, end, |live| {
            live[offset as usize..end as usize].fill(0);
        });
    }

    fn set_len(&mut self, len: u64) {
        let old = self.live.len() as u64;
        self.change(len.min(old), len.max(old), |live| {
            live.resize(len as usize, 0)
        });
    }

    /// fallocate up to `end`: the size grows, the bytes stay.
    fn allocate(&mut self, end: u64) {
        let old = self.live.len() as u64;
        if end > old {
            self.set_len(end);
        }
    }

    fn sync(&mut self) {
        self.durable = self.live.clone();
        self.allowed.clear();
        self.lens = vec![self.live.len() as u64];
    }

    /// Checks a file's contents after a power cut.
    fn check(&self, got: &[u8], seed: u64, name: &str) {
        let len = got.len() as u64;
        assert!(self.lens.contains(&len), "seed {seed} {name}: size {len}");
        for s in 0..len.div_ceil(self.sector) {
            let visible = (len - s * self.sector).min(self.sector) as usize;
            let value = sector_of(got, s, self.sector);
            let durable = vec![sector_of(&self.durable, s, self.sector)];
            let allowed = self.allowed.get(&s).unwrap_or(&durable);
            assert!(
                allowed.iter().any(|a| a[..visible] == value[..visible]),
                "seed {seed} {name}: sector {s} holds bytes it never had"
            );
        }
    }
}

/// Deterministic pseudo-random numbers for the workload (not the disk's).
struct Dice(u64);

impl Dice {
    fn roll(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }
}

async fn random_step(dice: &mut Dice, fs: &SimFs, file: &SimFile, model: &mut Model, path: &Path) {
    const SPAN: u64 = 48 * 1024;
    let offset = dice.roll(SPAN);
    let length = 1 + dice.roll(9000);
    let fill = dice.roll(255) as u8 + 1;
    match dice.roll(20) {
        0..=9 => {
            file.write_at(&vec![fill; length as usize], offset)
                .await
                .unwrap();
            model.write(offset, &vec![fill; length as usize]);
        }
        10..=12 => {
            file.write_durable_at(&vec![fill; length as usize], offset)
                .await
                .unwrap();
            model.write_durable(offset, &vec![fill; length as usize]);
        }
        13..=15 => {
            file.punch_hole(offset, length).await.unwrap();
            model.punch(offset, length);
        }
        16..=17 => {
            let len = match dice.roll(2) {
                0 => dice.roll(SPAN / model.sector) * model.sector,
                _ => dice.roll(SPAN),
            };
            file.set_len(len).await.unwrap();
            model.set_len(len);
        }
        18 => {
            file.allocate(offset, length).await.unwrap();
            model.allocate(offset + length);
        }
        _ => {
            file.sync_data().await.unwrap();
            model.sync();
            let live = fs.read_live(path).unwrap();
            assert_eq!(diff(&live, &model.live), None, "live copy");
            let durable = fs.read_durable(path).unwrap();
            assert_eq!(diff(&durable, &model.live), None, "sync made live durable");
        }
    }
}

#[tokio::test]
async fn random_cuts_leave_every_sector_old_or_new() {
    let names = ["a", "b", "c"];
    let (mut kept, mut dropped) = (0, 0);
    for seed in 0..500u64 {
        let (fs, files) = disk_with(&names).await;
        let sector = if seed.is_multiple_of(4) { 512 } else { 4096 };
        fs.set_sector_bytes(sector).unwrap();
        let mut models: Vec<Model> = names.iter().map(|_| Model::new(sector)).collect();
        let mut dice = Dice(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        for _ in 0..60 {
            let i = dice.roll(names.len() as u64) as usize;
            let path = Path::new("/d").join(names[i]);
            random_step(&mut dice, &fs, &files[i], &mut models[i], &path).await;
        }
        for (i, name) in names.iter().enumerate() {
            let live = fs.read_live(&Path::new("/d").join(name)).unwrap();
            assert_eq!(
                diff(&live, &models[i].live),
                None,
                "seed {seed} {name} live"
            );
        }
        let report = fs.power_cut(CutPolicy::Random { seed });
        kept += report.changes_kept;
        dropped += report.changes_dropped;
        for (i, name) in names.iter().enumerate() {
            let got = contents(&fs, &format!("/d/{name}")).await;
            models[i].check(&got, seed, name);
        }
    }
    assert!(
        kept > 1000 && dropped > 1000,
        "kept {kept}, dropped {dropped}"
    );
}
