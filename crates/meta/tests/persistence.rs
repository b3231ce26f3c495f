//! Durability of the embedded store: reopen, kill -9 mid-write, and
//! exclusive access to the file.
//!
//! The crash tests re-run this test binary as a child process: with
//! `ASHLAR_META_CHILD` set, the otherwise no-op test `child_process` does the
//! child's part (see `child_process`).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ashlar_meta::{EmbeddedMetaStore, KeyRange, MetaError, MetaStore, Revision};

const CHILD_MODE: &str = "ASHLAR_META_CHILD";
const CHILD_PATH: &str = "ASHLAR_META_CHILD_PATH";

/// The store keeps disk space allocated past the end of its file, so commits still find
/// room when data fills the filesystem (the full-disk e2e tests show it end to end).
#[tokio::test]
async fn space_is_reserved_beyond_the_end_of_the_file() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let store = EmbeddedMetaStore::open(&path).expect("open");
    for i in 0..20 {
        store
            .put(format!("/k{i}").as_bytes(), &[7u8; 1000], None)
            .await
            .expect("put");
        let meta = std::fs::metadata(&path).unwrap();
        assert!(
            meta.blocks() * 512 >= meta.len() + (4 << 20),
            "after commit {i}: {} bytes allocated for a file of {} bytes",
            meta.blocks() * 512,
            meta.len()
        );
    }
}

#[tokio::test]
async fn state_survives_close_and_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let (create_rev, last_rev) = {
        let store = EmbeddedMetaStore::open(&path).expect("open");
        let c = store.put(b"/a", b"1", None).await.expect("put");
        store.put(b"/a", b"2", None).await.expect("put");
        store.put(b"/gone", b"x", None).await.expect("put");
        store.delete(KeyRange::key("/gone")).await.expect("delete");
        let last = store.put(b"/b", b"3", None).await.expect("put");
        (c, last)
    };
    let store = EmbeddedMetaStore::open(&path).expect("reopen");
    assert_eq!(store.current_revision().await.expect("rev"), last_rev);
    let a = store.get(b"/a").await.expect("get").expect("present");
    assert_eq!(
        (a.value.as_slice(), a.create_revision, a.version),
        (&b"2"[..], create_rev, 2)
    );
    assert_eq!(store.get(b"/gone").await.expect("get"), None);
    assert_eq!(
        store
            .range(KeyRange::prefix("/"), None)
            .await
            .expect("range")
            .len(),
        2
    );
    // Revisions keep counting from where they were.
    assert_eq!(
        store.put(b"/c", b"4", None).await.expect("put"),
        last_rev.next()
    );
    // History does not survive: only new revisions can be watched.
    assert!(matches!(
        store.watch(KeyRange::prefix(""), Some(Revision(2))).await,
        Err(MetaError::Compacted { .. })
    ));
}

#[tokio::test]
async fn leases_of_the_previous_process_are_expired_on_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let (old_lease, rev) = {
        let store = EmbeddedMetaStore::open(&path).expect("open");
        let lease = store
            .grant_lease(Duration::from_secs(3600))
            .await
            .expect("grant");
        store
            .put(b"/owner/vd1", b"me", Some(lease))
            .await
            .expect("put");
        let rev = store.put(b"/vdisks/vd1", b"{}", None).await.expect("put");
        (lease, rev)
    };
    let store = EmbeddedMetaStore::open(&path).expect("reopen");
    assert_eq!(store.get(b"/owner/vd1").await.expect("get"), None);
    assert!(store.get(b"/vdisks/vd1").await.expect("get").is_some());
    // The clean-up is one revision.
    assert_eq!(store.current_revision().await.expect("rev"), rev.next());
    assert!(matches!(
        store.keep_alive(old_lease).await,
        Err(MetaError::LeaseNotFound(_))
    ));
    // New lease ids never collide with the previous process's.
    let new_lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    assert_ne!(new_lease, old_lease);
}

#[test]
fn second_open_in_this_process_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let _first = EmbeddedMetaStore::open(&path).expect("open");
    match EmbeddedMetaStore::open(&path) {
        Err(e @ MetaError::AlreadyOpen { .. }) => {
            assert!(e.to_string().contains("already open"), "{e}");
        }
        other => panic!("expected AlreadyOpen, got {other:?}"),
    }
}

#[test]
fn second_open_in_another_process_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let mut child = spawn_child("hold", &path);
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    wait_for_line(&mut lines, "holding");

    let err = EmbeddedMetaStore::open(&path).expect_err("second open must fail");
    assert!(matches!(err, MetaError::AlreadyOpen { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("already open by another process"), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");

    // Closing stdin lets the child exit; then the file opens fine.
    drop(child.stdin.take());
    let status = child.wait().expect("wait");
    assert!(status.success(), "child failed: {status}");
    EmbeddedMetaStore::open(&path).expect("open after the holder exited");
}

#[tokio::test]
async fn acknowledged_puts_survive_sigkill_mid_write() {
    const KILL_AFTER: u64 = 150;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let mut child = spawn_child("write", &path);
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();

    let mut last_acked: Option<u64> = None;
    for line in lines.by_ref() {
        let line = line.expect("child stdout");
        if let Some(n) = line.strip_prefix("acked ") {
            last_acked = Some(n.parse().expect("ack number"));
            if last_acked >= Some(KILL_AFTER) {
                // SIGKILL while the child is in its next write.
                child.kill().expect("kill child");
                break;
            }
        }
    }
    // Acks printed before the kill landed are acknowledged too.
    for line in lines {
        let Ok(line) = line else { break };
        if let Some(n) = line.strip_prefix("acked ") {
            last_acked = Some(n.parse().expect("ack number"));
        }
    }
    let status = child.wait().expect("wait");
    assert!(!status.success(), "child should have been killed");
    let last_acked = last_acked.expect("child acknowledged writes");
    assert!(last_acked >= KILL_AFTER);

    let store = EmbeddedMetaStore::open(&path).expect("reopen after kill -9");
    for i in 0..=last_acked {
        let kv = store
            .get(child_key(i).as_bytes())
            .await
            .expect("get")
            .unwrap_or_else(|| panic!("acknowledged put {i} lost (last acked {last_acked})"));
        assert_eq!(kv.value, child_value(i).into_bytes());
        // Write i was the store's (i + 2)th revision: nothing was reordered.
        assert_eq!(kv.mod_revision, Revision(i as i64 + 2));
    }
    let rev = store.current_revision().await.expect("rev");
    assert!(rev >= Revision(last_acked as i64 + 2));
    // At most the one in-flight write beyond the last ack made it.
    assert!(
        rev <= Revision(last_acked as i64 + 3),
        "rev {rev}, last acked {last_acked}"
    );
}

fn child_key(i: u64) -> String {
    format!("/crash/{i:08}")
}

fn child_value(i: u64) -> String {
    format!("value-{i}-{}", "x".repeat((i % 50) as usize))
}

fn spawn_child(mode: &str, path: &Path) -> Child {
    Command::new(std::env::current_exe().expect("current exe"))
        .args([
            "child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_MODE, mode)
        .env(CHILD_PATH, path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child test process")
}

fn wait_for_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, want: &str) {
    for line in lines {
        // libtest prints "test child_process ... " without a newline before the test's own
        // output, so the first line the child prints may carry that prefix.
        if line.expect("child stdout").trim().ends_with(want) {
            return;
        }
    }
    panic!("child exited before printing {want:?}");
}

/// The child's side of the multi-process tests; a no-op in a normal run.
#[test]
fn child_process() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        return;
    };
    let path = std::path::PathBuf::from(std::env::var(CHILD_PATH).expect("child path"));
    let store = EmbeddedMetaStore::open(&path).expect("child open");
    let mut out = std::io::stdout();
    match mode.as_str() {
        "hold" => {
            writeln!(out, "holding")
                .and_then(|_| out.flush())
                .expect("stdout");
            // Hold the store open until the parent closes our stdin.
            let mut buf = String::new();
            while std::io::stdin()
                .read_line(&mut buf)
                .map(|n| n > 0)
                .unwrap_or(false)
            {}
        }
        "write" => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                // Bounded: stops by itself if the parent never kills it.
                for i in 0..100_000u64 {
                    store
                        .put(child_key(i), child_value(i), None)
                        .await
                        .expect("child put");
                    // Printed only after put returned: this is the acknowledgement.
                    if writeln!(out, "acked {i}")
                        .and_then(|_| out.flush())
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
        other => panic!("unknown child mode {other}"),
    }
}

/// The lease-expiry task and blocking calls hold the store for a moment after the caller's
/// last handle goes; a reopen right after the drop must wait for that, not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_right_after_drop_waits_for_the_release() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    for round in 0..40 {
        let store =
            EmbeddedMetaStore::open(&path).unwrap_or_else(|e| panic!("open in round {round}: {e}"));
        let lease = store
            .grant_lease(Duration::from_millis(1))
            .await
            .expect("grant");
        // A 1 ms lease may already have expired when the put arrives (CI saw it): the
        // store then refuses the put, which is right; what is tested is the reopen.
        match store
            .put(format!("/round/{round}"), b"x", Some(lease))
            .await
        {
            Ok(_) | Err(MetaError::LeaseNotFound(_)) => {}
            Err(e) => panic!("put in round {round}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(round % 3)).await;
    }
}
