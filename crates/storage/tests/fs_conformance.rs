//! One conformance test run against every `Filesystem`: the simulated disk must behave like
//! the real one wherever no fault is injected, down to the errno of each failure.

use ashlar_storage::fs::{remove_tree, DirEntry, DiskFile, Filesystem, IoMode, SimFs, StdFs};
use std::io;
use std::path::Path;

fn assert_errno<T>(result: io::Result<T>, code: i32, what: &str) {
    match result {
        Err(e) => assert_eq!(e.raw_os_error(), Some(code), "{what}: {e}"),
        Ok(_) => panic!("{what}: expected errno {code}, got Ok"),
    }
}

fn entry(name: &str, is_dir: bool) -> DirEntry {
    DirEntry {
        name: name.into(),
        is_dir,
    }
}

async fn read<F: DiskFile>(file: &F, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xAAu8; len];
    file.read_at(&mut buf, offset).await.unwrap();
    buf
}

async fn data_semantics<F: Filesystem>(fs: &F, root: &Path) {
    let path = root.join("data");
    let file = fs.open(&path, true).await.unwrap();
    assert_eq!(file.path(), path);
    assert_eq!(file.mode(), IoMode::Buffered);
    assert_eq!(file.len().await.unwrap(), 0);
    assert_eq!(
        read(&file, 0, 100).await,
        vec![0u8; 100],
        "empty file reads zeros"
    );

    file.write_at(b"hello", 8190).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 8195);
    assert_eq!(
        read(&file, 0, 8190).await,
        vec![0u8; 8190],
        "hole reads zeros"
    );
    let tail = read(&file, 8188, 12).await;
    assert_eq!(&tail, b"\0\0hello\0\0\0\0\0", "past EOF reads zeros");

    file.write_durable_at(&[3u8; 5000], 10_000).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 15_000);
    file.sync_data().await.unwrap();
    assert_eq!(read(&file, 9_999, 3).await, vec![0, 3, 3]);

    file.punch_hole(10_001, 4_000).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 15_000, "punch keeps the size");
    let punched = read(&file, 10_000, 5_000).await;
    assert_eq!(punched[0], 3);
    assert!(punched[1..4001].iter().all(|&b| b == 0));
    assert!(punched[4001..].iter().all(|&b| b == 3));

    file.allocate(0, 20_000).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 20_000, "allocate extends");
    file.allocate(0, 100).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 20_000, "allocate never shrinks");
    assert_eq!(read(&file, 15_000, 5_000).await, vec![0u8; 5_000]);

    file.set_len(8_192).await.unwrap();
    file.set_len(12_000).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 12_000);
    assert_eq!(
        &read(&file, 8_190, 5).await,
        b"he\0\0\0",
        "truncated bytes stay gone"
    );
    assert_eq!(read(&file, 10_000, 2_000).await, vec![0u8; 2_000]);

    assert_errno(
        file.punch_hole(0, 0).await,
        libc::EINVAL,
        "punch of 0 bytes",
    );
    assert_errno(
        file.allocate(0, 0).await,
        libc::EINVAL,
        "allocate of 0 bytes",
    );
    drop(file);

    let again = fs.open(&path, true).await.unwrap();
    assert_eq!(
        again.len().await.unwrap(),
        12_000,
        "open(create) keeps contents"
    );
    fs.sync_dir(root).await.unwrap();
}

async fn namespace_semantics<F: Filesystem>(fs: &F, root: &Path) {
    let tree = root.join("tree");
    fs.create_dir_all(&tree.join("b/c")).await.unwrap();
    fs.create_dir_all(&tree.join("b/c")).await.unwrap();
    for name in ["zeta", "alpha", "m"] {
        fs.open(&tree.join(name), true).await.unwrap();
    }
    fs.sync_dir(&tree).await.unwrap();
    assert_eq!(
        fs.list_dir(&tree).await.unwrap(),
        vec![
            entry("alpha", false),
            entry("b", true),
            entry("m", false),
            entry("zeta", false)
        ]
    );
    assert!(fs.exists(&tree.join("b")).await.unwrap());
    assert!(fs.exists(&tree.join("m")).await.unwrap());
    assert!(!fs.exists(&tree.join("nope")).await.unwrap());

    // Rename replaces the target; a handle follows its file.
    let alpha = fs.open(&tree.join("alpha"), false).await.unwrap();
    alpha.write_at(b"first", 0).await.unwrap();
    fs.rename(&tree.join("alpha"), &tree.join("zeta"))
        .await
        .unwrap();
    alpha.write_at(b"FIRST", 0).await.unwrap();
    let zeta = fs.open(&tree.join("zeta"), false).await.unwrap();
    assert_eq!(&read(&zeta, 0, 5).await, b"FIRST");
    assert!(!fs.exists(&tree.join("alpha")).await.unwrap());

    // A directory moves with its contents, across parents.
    fs.rename(&tree.join("b"), &tree.join("b/c/../../moved"))
        .await
        .unwrap();
    assert!(fs.exists(&tree.join("moved/c")).await.unwrap());

    // An unlinked file stays usable through its handle.
    fs.remove_file(&tree.join("zeta")).await.unwrap();
    zeta.write_at(b"x", 10).await.unwrap();
    assert_eq!(zeta.len().await.unwrap(), 11);
    assert_eq!(&read(&alpha, 0, 5).await, b"FIRST");

    fs.remove_dir(&tree.join("moved/c")).await.unwrap();
    fs.sync_dir(&tree.join("moved")).await.unwrap();
    assert_eq!(fs.list_dir(&tree.join("moved")).await.unwrap(), vec![]);
    fs.sync_dir(&tree).await.unwrap();
    remove_tree(fs, &tree).await.unwrap();
    assert!(!fs.exists(&tree).await.unwrap());
    remove_tree(fs, &tree).await.unwrap();
}

async fn error_semantics<F: Filesystem>(fs: &F, root: &Path) {
    let dir = root.join("errors");
    fs.create_dir_all(&dir.join("full")).await.unwrap();
    let file = dir.join("file");
    fs.open(&file, true).await.unwrap();
    fs.open(&dir.join("full/inner"), true).await.unwrap();
    fs.create_dir_all(&dir.join("empty")).await.unwrap();
    let missing = dir.join("missing");

    let e = fs
        .open(&missing, false)
        .await
        .err()
        .expect("open of a missing file");
    assert_eq!(e.kind(), io::ErrorKind::NotFound);
    assert_errno(fs.open(&missing, false).await, libc::ENOENT, "open missing");
    assert_errno(
        fs.open(&missing.join("x"), true).await,
        libc::ENOENT,
        "no parent",
    );
    assert_errno(fs.open(&dir, true).await, libc::EISDIR, "open a directory");
    assert_errno(
        fs.open(&file.join("x"), true).await,
        libc::ENOTDIR,
        "file as dir",
    );
    assert_errno(fs.list_dir(&missing).await, libc::ENOENT, "list missing");
    assert_errno(fs.list_dir(&file).await, libc::ENOTDIR, "list a file");
    assert_errno(
        fs.exists(&file.join("x")).await,
        libc::ENOTDIR,
        "exists under a file",
    );
    assert_errno(fs.sync_dir(&missing).await, libc::ENOENT, "sync missing");
    assert_errno(
        fs.free_bytes(&missing).await,
        libc::ENOENT,
        "free of missing",
    );
    assert_errno(
        fs.remove_file(&missing).await,
        libc::ENOENT,
        "remove missing",
    );
    assert_errno(
        fs.remove_file(&dir.join("empty")).await,
        libc::EISDIR,
        "unlink dir",
    );
    assert_errno(fs.remove_dir(&missing).await, libc::ENOENT, "rmdir missing");
    assert_errno(fs.remove_dir(&file).await, libc::ENOTDIR, "rmdir a file");
    assert_errno(
        fs.remove_dir(&dir.join("full")).await,
        libc::ENOTEMPTY,
        "rmdir full",
    );
    assert_errno(
        fs.rename(&missing, &file).await,
        libc::ENOENT,
        "rename missing",
    );
    let to_full = fs.rename(&file, &dir.join("full")).await;
    assert_errno(to_full, libc::EISDIR, "file over dir");
    let to_file = fs.rename(&dir.join("empty"), &file).await;
    assert_errno(to_file, libc::ENOTDIR, "dir over file");
    let to_nonempty = fs.rename(&dir.join("empty"), &dir.join("full")).await;
    assert_errno(to_nonempty, libc::ENOTEMPTY, "dir over non-empty dir");
    let into_self = fs.rename(&dir.join("full"), &dir.join("full/sub")).await;
    assert_errno(into_self, libc::EINVAL, "dir into itself");
    assert_errno(
        fs.create_dir_all(&file).await,
        libc::EEXIST,
        "mkdir over a file",
    );
    let under_file = fs.create_dir_all(&file.join("sub")).await;
    assert_errno(under_file, libc::ENOTDIR, "mkdir under a file");

    // Allowed replacements.
    fs.rename(&dir.join("empty"), &dir.join("full/inner2"))
        .await
        .unwrap();
    fs.create_dir_all(&dir.join("empty2")).await.unwrap();
    fs.rename(&dir.join("full/inner2"), &dir.join("empty2"))
        .await
        .unwrap();
    fs.rename(&file, &file).await.unwrap();
    assert!(fs.exists(&file).await.unwrap());
    assert!(fs.free_bytes(&dir).await.unwrap() > 0);
    remove_tree(fs, &dir).await.unwrap();
}

/// Everything in the `Filesystem` contract that does not involve crashes or faults.
async fn conformance<F: Filesystem>(fs: &F, root: &Path) {
    fs.create_dir_all(root).await.unwrap();
    data_semantics(fs, root).await;
    namespace_semantics(fs, root).await;
    error_semantics(fs, root).await;
    assert_eq!(fs.list_dir(root).await.unwrap(), vec![entry("data", false)]);
}

#[tokio::test]
async fn std_fs_conforms() {
    let dir = tempfile::tempdir().unwrap();
    conformance(&StdFs, &dir.path().join("root")).await;
}

#[tokio::test]
async fn sim_fs_conforms() {
    let fs = SimFs::new(IoMode::Buffered);
    conformance(&fs, Path::new("/srv/root")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_fs_conforms_on_a_multi_thread_runtime() {
    let fs = SimFs::new(IoMode::Buffered);
    let task = tokio::spawn(async move {
        conformance(&fs, Path::new("relative/root")).await;
    });
    task.await.unwrap();
}
