//! End-to-end tests of the powercut filesystem: real mounts through the kernel (root and
//! /dev/fuse needed; a test fails, never skips, when they are missing).

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use ashlar_powercut_fs::{CutPolicy, MountOptions, PowercutFs};

struct Dirs {
    _tmp: tempfile::TempDir,
    backing: PathBuf,
    mnt: PathBuf,
}

fn dirs() -> Dirs {
    let tmp = tempfile::tempdir().expect("temp dir");
    let backing = tmp.path().join("backing");
    let mnt = tmp.path().join("mnt");
    fs::create_dir(&backing).unwrap();
    fs::create_dir(&mnt).unwrap();
    Dirs {
        _tmp: tmp,
        backing,
        mnt,
    }
}

fn mount(d: &Dirs) -> PowercutFs {
    let bin = Path::new(env!("CARGO_BIN_EXE_ashlar-powercut-fs"));
    PowercutFs::mount_with_binary(bin, &d.backing, &d.mnt)
        .unwrap_or_else(|e| panic!("mounting powercut-fs (needs root and /dev/fuse): {e}"))
}

/// Without fsyncs of the backing files (`--no-backing-fsync`): the semantics are the same.
fn mount_without_backing_fsync(d: &Dirs) -> PowercutFs {
    let options = MountOptions {
        binary: Some(PathBuf::from(env!("CARGO_BIN_EXE_ashlar-powercut-fs"))),
        fsync_backing: false,
        ..MountOptions::default()
    };
    PowercutFs::mount_with(&d.backing, &d.mnt, &options)
        .unwrap_or_else(|e| panic!("mounting powercut-fs (needs root and /dev/fuse): {e}"))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
        .collect()
}

fn write_file(path: &Path, data: &[u8]) -> File {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap();
    f.write_all_at(data, 0).unwrap();
    f
}

fn sync_dir(path: &Path) {
    File::open(path).unwrap().sync_all().unwrap();
}

fn read(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn fallocate(f: &File, mode: i32, off: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: fallocate on an open fd.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as libc::off_t, len as libc::off_t) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn drop_all_keeps_exactly_what_was_made_durable() {
    let d = dirs();
    let old = pattern(1, 8192);
    fs::write(d.backing.join("old.bin"), &old).unwrap();
    fs::write(d.backing.join("old-synced.bin"), &old).unwrap();
    fs::write(d.backing.join("truncated.bin"), &old).unwrap();
    fs::write(d.backing.join("victim.bin"), &old).unwrap();
    fs::write(d.backing.join("victim-synced.bin"), &old).unwrap();
    fs::write(d.backing.join("ren-src"), &old).unwrap();
    fs::create_dir(d.backing.join("existing")).unwrap();
    fs::write(d.backing.join("existing/inner"), &old).unwrap();

    let mut fs1 = mount(&d);
    let m = &d.mnt;
    let new = pattern(2, 5000);

    // A new file, fsynced, and its directory fsynced: durable.
    let f = write_file(&m.join("synced.bin"), &new);
    f.sync_all().unwrap();
    drop(f);
    // A new directory, made durable by the root fsync below.
    fs::create_dir(m.join("dir")).unwrap();
    // An existing file overwritten without fsync: old content after the cut.
    write_file(&m.join("old.bin"), &new);
    // An existing file overwritten with fsync: new content (its entry was already durable).
    write_file(&m.join("old-synced.bin"), &new)
        .sync_data()
        .unwrap();
    // A truncate without fsync is lost.
    OpenOptions::new()
        .write(true)
        .open(m.join("truncated.bin"))
        .unwrap()
        .set_len(10)
        .unwrap();
    // An unlink without fsyncdir is lost; with it, durable.
    fs::remove_file(m.join("victim.bin")).unwrap();
    // A rename without fsyncdir is lost.
    fs::rename(m.join("ren-src"), m.join("ren-dst")).unwrap();
    // Make root's entries durable now: synced.bin, dir, the unlink of victim.bin, the rename.
    sync_dir(m);
    // ... and then change root again without syncing it.
    fs::remove_file(m.join("victim-synced.bin")).unwrap();
    let f = write_file(&m.join("unsynced-entry.bin"), &new);
    f.sync_all().unwrap(); // data durable, but the name is not
    drop(f);
    // In the durable subdirectory: one entry made durable, one not.
    let f = write_file(&m.join("dir/kept"), &new);
    f.sync_all().unwrap();
    drop(f);
    sync_dir(&m.join("dir"));
    write_file(&m.join("dir/lost"), &new).sync_all().unwrap();
    // A new subdirectory whose parent entry is never made durable, with durable contents.
    fs::create_dir(m.join("existing/newdir")).unwrap();
    write_file(&m.join("existing/newdir/f"), &new)
        .sync_all()
        .unwrap();
    sync_dir(&m.join("existing/newdir"));
    // Unsynced overwrite of a file in an existing dir.
    write_file(&m.join("existing/inner"), &new);

    // Before the cut, reads show the live state.
    assert_eq!(read(&m.join("old.bin"))[..new.len()], new[..]);
    assert_eq!(read(&m.join("truncated.bin")), old[..10]);
    assert!(!m.join("victim.bin").exists());
    assert!(m.join("ren-dst").exists() && !m.join("ren-src").exists());
    assert_eq!(read(&m.join("dir/lost")), new);
    assert_eq!(read(&m.join("existing/newdir/f")), new);
    let p = fs1.pending().unwrap();
    assert!(p.writes >= 3, "pending writes: {p:?}");
    assert!(p.namespace >= 4, "pending names: {p:?}");
    let report = fs1.cut(CutPolicy::DropAll).unwrap();
    assert_eq!(report.writes_kept + report.writes_torn, 0, "{report:?}");
    assert_eq!(report.writes_dropped, p.writes, "{report:?}");
    assert_eq!(report.namespace_kept, 0, "{report:?}");
    assert_eq!(report.namespace_dropped, p.namespace, "{report:?}");
    assert!(!ashlar_powercut_fs::is_mounted(m), "the cut unmounts");
    assert!(
        !d.backing.join(ashlar_powercut_fs::STAGING).exists(),
        "the cut removes staging"
    );

    let _fs2 = mount(&d);
    assert_eq!(
        read(&m.join("synced.bin")),
        new,
        "fsynced file in fsynced dir"
    );
    assert_eq!(read(&m.join("old.bin")), old, "unsynced overwrite is lost");
    let mut expect = new.clone();
    expect.extend_from_slice(&old[new.len()..]);
    assert_eq!(
        read(&m.join("old-synced.bin")),
        expect,
        "fsynced overwrite of a durable file"
    );
    assert_eq!(
        read(&m.join("truncated.bin")),
        old,
        "unsynced truncate is lost"
    );
    assert!(
        !m.join("victim.bin").exists(),
        "unlink followed by fsyncdir is durable"
    );
    assert_eq!(
        read(&m.join("victim-synced.bin")),
        old,
        "unlink without fsyncdir is lost"
    );
    assert!(
        !m.join("ren-src").exists() && m.join("ren-dst").exists(),
        "rename made durable by fsyncdir"
    );
    assert!(
        !m.join("unsynced-entry.bin").exists(),
        "a file fsynced but whose directory was not is gone"
    );
    assert_eq!(read(&m.join("dir/kept")), new);
    assert!(!m.join("dir/lost").exists());
    assert!(
        !m.join("existing/newdir").exists(),
        "a directory whose parent was not fsynced is gone"
    );
    assert_eq!(read(&m.join("existing/inner")), old);
    assert_eq!(
        names(m),
        [
            "dir",
            "existing",
            "old-synced.bin",
            "old.bin",
            "ren-dst",
            "synced.bin",
            "truncated.bin",
            "victim-synced.bin"
        ]
    );
    assert_eq!(names(&m.join("dir")), ["kept"]);
    assert_eq!(names(&m.join("existing")), ["inner"]);
}

#[test]
fn data_of_a_file_created_meanwhile_lands_when_its_directory_is_synced() {
    let d = dirs();
    let fs1 = mount(&d);
    let m = &d.mnt;
    let a = pattern(3, 3000);
    // fsync the data first, the directory later: both durable.
    let f = write_file(&m.join("a"), &a);
    f.sync_data().unwrap();
    drop(f);
    // Directory synced but the data never: the name survives, empty.
    write_file(&m.join("b"), &a);
    // Renamed before the directory sync: durable under the new name only.
    let f = write_file(&m.join("c.tmp"), &a);
    f.sync_all().unwrap();
    drop(f);
    fs::rename(m.join("c.tmp"), m.join("c")).unwrap();
    // Created and unlinked before any sync: never anywhere.
    write_file(&m.join("gone"), &a).sync_all().unwrap();
    fs::remove_file(m.join("gone")).unwrap();
    sync_dir(m);
    // Written again after the directory sync, synced: durable.
    let f = OpenOptions::new().write(true).open(m.join("a")).unwrap();
    f.write_all_at(b"XYZ", 10).unwrap();
    f.sync_data().unwrap();
    fs1.cut(CutPolicy::DropAll).unwrap();

    let _fs2 = mount(&d);
    let mut want_a = a.clone();
    want_a[10..13].copy_from_slice(b"XYZ");
    assert_eq!(read(&m.join("a")), want_a);
    assert_eq!(
        read(&m.join("b")),
        b"",
        "the name is durable, the unsynced data is not"
    );
    assert_eq!(read(&m.join("c")), a);
    assert_eq!(names(m), ["a", "b", "c"]);
}

#[test]
fn reads_see_pending_writes_truncates_and_holes() {
    let d = dirs();
    let old = pattern(4, 20000);
    fs::write(d.backing.join("f"), &old).unwrap();
    let fs1 = mount(&d);
    let path = d.mnt.join("f");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    let mut model = old.clone();
    let apply = |model: &mut Vec<u8>, off: usize, data: &[u8]| {
        if model.len() < off + data.len() {
            model.resize(off + data.len(), 0);
        }
        model[off..off + data.len()].copy_from_slice(data);
    };
    let w1 = pattern(5, 3000);
    f.write_all_at(&w1, 1000).unwrap();
    apply(&mut model, 1000, &w1);
    let w2 = pattern(6, 500);
    f.write_all_at(&w2, 2500).unwrap(); // overlaps w1
    apply(&mut model, 2500, &w2);
    assert_eq!(read(&path), model);
    // Shrink, then grow: the cut-off bytes read as zeros, not as the old durable bytes.
    f.set_len(2000).unwrap();
    model.truncate(2000);
    f.set_len(6000).unwrap();
    model.resize(6000, 0);
    assert_eq!(read(&path), model);
    // Write past the end leaves a zero gap.
    f.write_all_at(b"tail", 9000).unwrap();
    apply(&mut model, 9000, b"tail");
    assert_eq!(read(&path), model);
    assert_eq!(fs::metadata(&path).unwrap().len(), 9004);
    // Punch a hole over pending and durable bytes.
    fallocate(
        &f,
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        1500,
        1000,
    )
    .unwrap();
    model[1500..2500].fill(0);
    assert_eq!(read(&path), model);
    // Reads at odd offsets and sizes.
    let mut buf = vec![0u8; 777];
    let n = f.read_at(&mut buf, 1234).unwrap();
    assert_eq!(&buf[..n], &model[1234..1234 + n]);
    // Survives a sync exactly.
    f.sync_all().unwrap();
    drop(f);
    fs1.cut(CutPolicy::DropAll).unwrap();
    assert_eq!(
        read(&d.backing.join("f")),
        model,
        "backing holds the synced state"
    );
    let _fs2 = mount(&d);
    assert_eq!(read(&path), model);
}

#[test]
fn punch_hole_and_preallocation() {
    let d = dirs();
    let old = pattern(7, 1 << 20);
    fs::write(d.backing.join("f"), &old).unwrap();
    fs::write(d.backing.join("g"), &old).unwrap();
    let fs1 = mount(&d);
    let m = &d.mnt;
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("f"))
        .unwrap();
    let g = OpenOptions::new()
        .read(true)
        .write(true)
        .open(m.join("g"))
        .unwrap();
    let keep = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // Durable punch in f, pending punch in g.
    fallocate(&f, keep, 65536, 262144).unwrap();
    fallocate(&g, keep, 65536, 262144).unwrap();
    let mut punched = old.clone();
    punched[65536..65536 + 262144].fill(0);
    assert_eq!(read(&m.join("f")), punched);
    assert_eq!(read(&m.join("g")), punched);
    assert_eq!(
        fs::metadata(m.join("f")).unwrap().len(),
        old.len() as u64,
        "KEEP_SIZE keeps the size"
    );
    f.sync_data().unwrap();
    // Punching without KEEP_SIZE is refused, as on every Linux filesystem.
    let err = fallocate(&f, libc::FALLOC_FL_PUNCH_HOLE, 0, 4096).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EOPNOTSUPP), "{err}");
    // Plain preallocation extends; KEEP_SIZE preallocation does not.
    let h = File::create(m.join("h")).unwrap();
    fallocate(&h, 0, 0, 100_000).unwrap();
    assert_eq!(fs::metadata(m.join("h")).unwrap().len(), 100_000);
    fallocate(&h, libc::FALLOC_FL_KEEP_SIZE, 0, 200_000).unwrap();
    assert_eq!(fs::metadata(m.join("h")).unwrap().len(), 100_000);
    assert_eq!(read(&m.join("h")), vec![0u8; 100_000]);
    h.sync_all().unwrap();
    sync_dir(m);
    // A pending preallocation is lost at the cut.
    fallocate(&g, 0, 0, 3 << 20).unwrap();
    assert_eq!(fs::metadata(m.join("g")).unwrap().len(), 3 << 20);
    // Unsupported modes fail cleanly.
    let err = fallocate(&f, libc::FALLOC_FL_COLLAPSE_RANGE, 0, 4096).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EOPNOTSUPP), "{err}");
    drop((f, g, h));
    fs1.cut(CutPolicy::DropAll).unwrap();

    let backing_f = fs::metadata(d.backing.join("f")).unwrap();
    assert!(
        backing_f.blocks() * 512 < old.len() as u64,
        "the durable punch freed space in the backing file ({} blocks)",
        backing_f.blocks()
    );
    let _fs2 = mount(&d);
    assert_eq!(read(&m.join("f")), punched, "durable punch");
    assert_eq!(
        read(&m.join("g")),
        old,
        "pending punch and preallocation are lost"
    );
    assert_eq!(fs::metadata(m.join("h")).unwrap().len(), 100_000);
}

/// Each write gets its own byte value so any byte of the result says which write (or the old
/// content) it came from.
#[test]
fn random_cuts_leave_every_sector_old_or_new() {
    let mut totals = ashlar_powercut_fs::CutReport::default();
    for seed in 1..=6u64 {
        let d = dirs();
        let size = 256 * 1024;
        let old: Vec<u8> = vec![0xAA; size];
        fs::write(d.backing.join("disjoint"), &old).unwrap();
        fs::write(d.backing.join("overlap"), &old).unwrap();
        fs::write(d.backing.join("synced"), &old).unwrap();
        for k in 0..4 {
            fs::write(d.backing.join(format!("victim{k}")), b"old victim").unwrap();
        }
        fs::write(d.backing.join("ren-a"), b"renamed").unwrap();
        fs::write(d.backing.join("replace"), b"old version").unwrap();
        let fs1 = mount_without_backing_fsync(&d);
        let m = &d.mnt;
        // Disjoint writes of assorted sizes and alignments.
        let dj = OpenOptions::new()
            .write(true)
            .open(m.join("disjoint"))
            .unwrap();
        let mut writes = Vec::new();
        let mut off = 100usize;
        for k in 0..40usize {
            let len = 1 + (k * 977 + seed as usize * 131) % 5000;
            if off + len > size {
                break;
            }
            let value = (k + 1) as u8;
            dj.write_all_at(&vec![value; len], off as u64).unwrap();
            writes.push((off, len, value));
            off += len + (k % 3) * 300;
        }
        // Overlapping writes: the result of each byte is old or one of the writes covering it.
        let ov = OpenOptions::new()
            .write(true)
            .open(m.join("overlap"))
            .unwrap();
        let mut ov_writes = Vec::new();
        for k in 0..30usize {
            let off = (k * 7919 + seed as usize * 1237) % (size - 8192);
            let len = 512 + (k * 1499) % 7000;
            let value = (k + 100) as u8;
            ov.write_all_at(&vec![value; len], off as u64).unwrap();
            ov_writes.push((off, len, value));
        }
        // A synced file: intact whatever the cut does.
        let sy = OpenOptions::new()
            .write(true)
            .open(m.join("synced"))
            .unwrap();
        let synced_data = pattern(seed as u8, size);
        sy.write_all_at(&synced_data, 0).unwrap();
        sy.sync_data().unwrap();
        // A file created without a directory sync: if its name survives, its bytes are zero or
        // its single write's, and never past its written size.
        write_file(&m.join("newfile"), &vec![0x55; 10_000]);
        // Namespace changes, none made durable: each survives whole or not at all.
        for k in 0..4 {
            fs::remove_file(m.join(format!("victim{k}"))).unwrap();
            write_file(
                &m.join(format!("created{k}")),
                format!("created {k}").as_bytes(),
            )
            .sync_all()
            .unwrap();
        }
        fs::rename(m.join("ren-a"), m.join("ren-b")).unwrap();
        write_file(&m.join("replace.tmp"), b"new version")
            .sync_all()
            .unwrap();
        fs::rename(m.join("replace.tmp"), m.join("replace")).unwrap();
        drop((dj, ov, sy));
        let report = fs1.cut(CutPolicy::RandomSubset { seed }).unwrap();
        eprintln!("seed {seed}: {report}");
        assert_eq!(
            report.writes_kept + report.writes_torn + report.writes_dropped,
            report.writes_pending
        );
        totals.writes_kept += report.writes_kept;
        totals.writes_torn += report.writes_torn;
        totals.writes_dropped += report.writes_dropped;
        totals.namespace_kept += report.namespace_kept;
        totals.namespace_dropped += report.namespace_dropped;

        let _fs2 = mount(&d);
        let got = read(&m.join("disjoint"));
        assert_eq!(got.len(), size, "seed {seed}: no write extended the file");
        let mut owner = vec![0u8; size];
        for &(off, len, value) in &writes {
            owner[off..off + len].fill(value);
        }
        for (i, (&g, &o)) in got.iter().zip(&owner).enumerate() {
            assert!(
                g == 0xAA || (o != 0 && g == o),
                "seed {seed}: disjoint byte {i} is {g:#x}, want 0xaa or {o:#x}"
            );
        }
        // Sector atomicity: within one write, one 512-byte sector is all old or all new.
        for &(off, len, value) in &writes {
            let mut s = off / 512 * 512;
            while s < off + len {
                let (a, b) = (s.max(off), (s + 512).min(off + len));
                let sector = &got[a..b];
                assert!(
                    sector.iter().all(|&x| x == value) || sector.iter().all(|&x| x == 0xAA),
                    "seed {seed}: sector at {s} of the write at {off}+{len} is torn inside"
                );
                s += 512;
            }
        }
        let got = read(&m.join("overlap"));
        assert_eq!(got.len(), size);
        for (i, &g) in got.iter().enumerate() {
            let ok = g == 0xAA
                || ov_writes
                    .iter()
                    .any(|&(off, len, v)| v == g && i >= off && i < off + len);
            assert!(
                ok,
                "seed {seed}: overlap byte {i} is {g:#x}: neither old nor written there"
            );
        }
        assert_eq!(
            read(&m.join("synced")),
            synced_data,
            "seed {seed}: fsynced data"
        );
        if m.join("newfile").exists() {
            let got = read(&m.join("newfile"));
            assert!(
                got.len() <= 10_000 && got.iter().all(|&x| x == 0 || x == 0x55),
                "seed {seed}: newfile"
            );
        }
        for k in 0..4 {
            let victim = m.join(format!("victim{k}"));
            assert!(
                !victim.exists() || read(&victim) == b"old victim",
                "seed {seed}: victim{k}"
            );
            let created = m.join(format!("created{k}"));
            assert!(
                !created.exists() || read(&created) == format!("created {k}").as_bytes(),
                "seed {seed}: created{k}"
            );
        }
        let (a, b) = (m.join("ren-a"), m.join("ren-b"));
        assert!(
            a.exists() != b.exists(),
            "seed {seed}: a rename is kept or lost whole"
        );
        assert_eq!(read(if a.exists() { &a } else { &b }), b"renamed");
        let replaced = read(&m.join("replace"));
        assert!(
            replaced == b"old version" || replaced == b"new version",
            "seed {seed}: replace is {replaced:?}"
        );
        assert!(
            !m.join("replace.tmp").exists(),
            "seed {seed}: replace.tmp was never durable"
        );
        for name in names(m) {
            let known = [
                "disjoint", "overlap", "synced", "newfile", "ren-a", "ren-b", "replace",
            ]
            .contains(&name.as_str())
                || name.starts_with("victim")
                || name.starts_with("created");
            assert!(known, "seed {seed}: unexpected name {name:?} after the cut");
        }
    }
    eprintln!("totals: {totals:?}");
    assert!(
        totals.writes_kept > 0 && totals.writes_torn > 0 && totals.writes_dropped > 0,
        "{totals:?}"
    );
    assert!(
        totals.namespace_kept > 0 && totals.namespace_dropped > 0,
        "{totals:?}"
    );
}

#[test]
fn keep_all_and_clean_unmount_make_everything_durable() {
    let d = dirs();
    let fs1 = mount(&d);
    let m = &d.mnt;
    fs::create_dir_all(m.join("a/b")).unwrap();
    fs::write(m.join("a/b/f"), b"one").unwrap();
    fs::write(m.join("g"), b"two").unwrap();
    fs::rename(m.join("g"), m.join("a/g")).unwrap();
    let report = fs1.cut(CutPolicy::KeepAll).unwrap();
    assert_eq!(
        report.writes_dropped + report.namespace_dropped,
        0,
        "{report:?}"
    );
    let fs2 = mount(&d);
    assert_eq!(read(&m.join("a/b/f")), b"one");
    assert_eq!(read(&m.join("a/g")), b"two");
    fs::write(m.join("a/b/h"), b"three").unwrap();
    fs::rename(m.join("a/b"), m.join("c")).unwrap();
    fs2.unmount().unwrap();
    assert_eq!(read(&d.backing.join("c/h")), b"three");
    assert_eq!(read(&d.backing.join("c/f")), b"one");
    assert!(!d.backing.join("a/b").exists());
    // Dropping the handle unmounts cleanly too.
    let fs3 = mount(&d);
    fs::write(m.join("dropped"), b"four").unwrap();
    drop(fs3);
    assert!(!ashlar_powercut_fs::is_mounted(m));
    assert_eq!(read(&d.backing.join("dropped")), b"four");
}

#[test]
fn directory_moves_follow_the_synced_parent() {
    let d = dirs();
    fs::create_dir_all(d.backing.join("src/sub")).unwrap();
    fs::write(d.backing.join("src/sub/f"), b"data").unwrap();
    fs::create_dir(d.backing.join("dst")).unwrap();
    fs::create_dir_all(d.backing.join("src2/sub2")).unwrap();
    let fs1 = mount(&d);
    let m = &d.mnt;
    // Move synced via the target directory: durable at the new place only.
    fs::rename(m.join("src/sub"), m.join("dst/sub")).unwrap();
    sync_dir(&m.join("dst"));
    // Move synced only in the source: gone from both (sync both to be safe).
    fs::rename(m.join("src2/sub2"), m.join("dst/sub2")).unwrap();
    sync_dir(&m.join("src2"));
    // rmdir made durable.
    fs::create_dir(m.join("tmpdir")).unwrap();
    sync_dir(m);
    fs::remove_dir(m.join("tmpdir")).unwrap();
    sync_dir(m);
    fs1.cut(CutPolicy::DropAll).unwrap();
    let _fs2 = mount(&d);
    assert_eq!(read(&m.join("dst/sub/f")), b"data");
    assert!(!m.join("src/sub").exists());
    assert!(!m.join("src2/sub2").exists() && !m.join("dst/sub2").exists());
    assert!(!m.join("tmpdir").exists());
}

#[test]
fn the_cut_cuts_off_open_files_and_o_direct_works() {
    let d = dirs();
    fs::write(d.backing.join("f"), vec![1u8; 8192]).unwrap();
    let fs1 = mount(&d);
    let m = &d.mnt;
    // O_DIRECT opens succeed; aligned I/O works (FUSE direct I/O does not need alignment,
    // but engines that try O_DIRECT use aligned buffers).
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(m.join("f"))
        .expect("O_DIRECT open on the powercut mount");
    let layout = std::alloc::Layout::from_size_align(4096, 4096).unwrap();
    // SAFETY: a 4096-byte, 4096-aligned allocation, freed below.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    let buf = unsafe { std::slice::from_raw_parts_mut(ptr, 4096) };
    buf.fill(7);
    f.write_all_at(buf, 4096).unwrap();
    buf.fill(0);
    f.read_exact_at(buf, 4096).unwrap();
    assert!(buf.iter().all(|&b| b == 7));
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(ptr, layout) };

    let mut keep_open = File::open(m.join("f")).unwrap();
    fs1.cut(CutPolicy::DropAll).unwrap();
    let mut buf = [0u8; 16];
    let err = keep_open
        .read(&mut buf)
        .expect_err("reading through the cut mount must fail");
    assert!(
        matches!(err.raw_os_error(), Some(libc::ENOTCONN) | Some(libc::EIO))
            || err.kind() == ErrorKind::NotConnected,
        "{err}"
    );
    drop((f, keep_open));
    let _fs2 = mount(&d);
    assert_eq!(read(&m.join("f")), vec![1u8; 8192]);
}

#[test]
fn mounting_twice_on_one_mountpoint_is_refused() {
    let d = dirs();
    let _fs1 = mount(&d);
    let bin = Path::new(env!("CARGO_BIN_EXE_ashlar-powercut-fs"));
    let err = PowercutFs::mount_with_binary(bin, &d.backing, &d.mnt)
        .err()
        .expect("second mount refused");
    assert!(err.to_string().contains("already a mount point"), "{err}");
}

/// The command-line daemon without the library: SIGUSR1 cuts with the `--seed` policy (here
/// none: drop-all), SIGTERM unmounts cleanly.
#[test]
fn signals_cut_and_unmount() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let d = dirs();
    fs::write(d.backing.join("f"), b"old").unwrap();
    let start = || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ashlar-powercut-fs"))
            .arg(&d.backing)
            .arg(&d.mnt)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(
            lines.next().unwrap().unwrap(),
            "ready",
            "stdin at EOF must not end the daemon"
        );
        (child, lines)
    };
    let signal = |child: &std::process::Child, sig| {
        // SAFETY: kill on the pid of our own child.
        assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
    };

    let (mut child, mut lines) = start();
    fs::write(d.mnt.join("f"), b"new").unwrap();
    assert_eq!(read(&d.mnt.join("f")), b"new");
    signal(&child, libc::SIGUSR1);
    let line = lines.next().unwrap().unwrap();
    assert!(line.starts_with("cut writes_pending="), "{line}");
    assert!(child.wait().unwrap().success());
    assert!(!ashlar_powercut_fs::is_mounted(&d.mnt));
    assert_eq!(read(&d.backing.join("f")), b"old");

    let (mut child, mut lines) = start();
    fs::write(d.mnt.join("f"), b"newer").unwrap();
    signal(&child, libc::SIGTERM);
    assert_eq!(lines.next().unwrap().unwrap(), "unmounted");
    assert!(child.wait().unwrap().success());
    assert!(!ashlar_powercut_fs::is_mounted(&d.mnt));
    assert_eq!(read(&d.backing.join("f")), b"newer");
}

/// Directories with more entries than one readdir reply holds list completely.
#[test]
fn large_directories_list_completely() {
    let d = dirs();
    for i in 0..300 {
        fs::write(
            d.backing
                .join(format!("durable-{i:04}-with-a-longish-name")),
            b"x",
        )
        .unwrap();
    }
    let _fs1 = mount(&d);
    for i in 0..300 {
        fs::write(
            d.mnt.join(format!("pending-{i:04}-with-a-longish-name")),
            b"y",
        )
        .unwrap();
    }
    let listed = names(&d.mnt);
    assert_eq!(listed.len(), 600);
    assert!(listed.iter().all(|n| n != ashlar_powercut_fs::STAGING));
}

/// O_DSYNC opens and RWF_DSYNC writes are durable when they return; plain writes on the same
/// file that came later are not.
#[test]
fn o_dsync_writes_are_durable() {
    let d = dirs();
    fs::write(d.backing.join("f"), vec![b'.'; 4096]).unwrap();
    fs::write(d.backing.join("g"), vec![b'.'; 4096]).unwrap();
    let fs1 = mount(&d);
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DSYNC)
        .open(d.mnt.join("f"))
        .unwrap();
    f.write_all_at(b"dsync", 0).unwrap();
    let g = OpenOptions::new()
        .write(true)
        .open(d.mnt.join("g"))
        .unwrap();
    let data = b"rwf-dsync";
    let iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: pwritev2 with one valid iovec on an open fd.
    let n = unsafe { libc::pwritev2(g.as_raw_fd(), &iov, 1, 0, libc::RWF_DSYNC) };
    assert_eq!(
        n,
        data.len() as isize,
        "{}",
        std::io::Error::last_os_error()
    );
    g.write_all_at(b"plain", 100).unwrap();
    drop((f, g));
    fs1.cut(CutPolicy::DropAll).unwrap();
    let _fs2 = mount(&d);
    assert_eq!(&read(&d.mnt.join("f"))[..6], b"dsync.");
    let g = read(&d.mnt.join("g"));
    assert_eq!(&g[..10], b"rwf-dsync.");
    assert_eq!(&g[100..105], b".....", "a later plain write is not durable");
}
