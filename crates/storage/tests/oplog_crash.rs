//! kill -9 test: a child process (this test binary, re-executed) writes and drains while
//! printing every acknowledged write; the parent SIGKILLs it mid-stream, reopens the log and
//! checks that every acknowledged write reads back, from the log or from the "extent store"
//! file the child drained into.

mod oplog_support;

mod oplog {
    use super::oplog_support::*;
    use ashlar_storage::disk::{FileIo, StdFile, StdOpener};
    use ashlar_storage::oplog::{Oplog, PieceSource};
    use bytes::Bytes;
    use std::collections::BTreeMap;
    use std::io::{BufRead, BufReader, Read};
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    const CHILD_ENV: &str = "ASHLAR_OPLOG_CRASH_CHILD";
    const TEST_NAME: &str = "oplog::kill9_loses_no_acknowledged_write";
    const SLOTS: u64 = 64;
    const WRITERS: u64 = 8;
    /// The parent kills the child after this many acknowledgements.
    const ACKS_BEFORE_KILL: usize = 1_500;

    /// Each slot is a disjoint range with its own unaligned offset and length.
    fn slot_range(slot: u64) -> (u64, u64) {
        (
            slot * 16_384 + (slot * 37) % 4_096,
            1 + (slot * 7_919) % 12_288,
        )
    }

    /// Contents of generation `gen` of a slot; every fifth generation is a zero record.
    fn contents(slot: u64, gen: u64) -> Option<Bytes> {
        (gen % 5 != 4).then(|| pattern(slot * 1_000_003 + gen, slot_range(slot).1 as usize))
    }

    fn log_dir(dir: &Path) -> PathBuf {
        dir.join("log")
    }

    fn store_path(dir: &Path) -> PathBuf {
        dir.join("store")
    }

    #[test]
    fn kill9_loses_no_acknowledged_write() {
        match std::env::var_os(CHILD_ENV) {
            Some(dir) => child(Path::new(&dir)),
            None => parent(),
        }
    }

    fn child(dir: &Path) {
        run_local(async {
            // Small: writers regularly wait for space and drains run all the time.
            let oplog = Oplog::open(StdOpener, config(&log_dir(dir), 256 << 10, 32 << 10))
                .await
                .expect("open");
            let store = StdFile::open(&store_path(dir), true).expect("store");
            tokio::task::spawn_local(drainer(oplog.clone(), store));
            let writers: Vec<_> = (0..WRITERS)
                .map(|w| tokio::task::spawn_local(writer(oplog.clone(), w)))
                .collect();
            for writer in writers {
                let _ = writer.await;
            }
        });
    }

    async fn writer(oplog: Oplog<StdOpener>, w: u64) {
        let deadline = Instant::now() + Duration::from_secs(60);
        for gen in 0.. {
            for slot in (w..SLOTS).step_by(WRITERS as usize) {
                let (offset, length) = slot_range(slot);
                match contents(slot, gen) {
                    Some(data) => oplog.write(offset, data).await.expect("write"),
                    None => oplog
                        .write_zeroes(offset, length)
                        .await
                        .expect("write_zeroes"),
                }
                println!("ACK {slot} {gen}");
            }
            if Instant::now() > deadline {
                return;
            }
        }
    }

    /// The engine's drain: copy, sync the store, then tell the log.
    async fn drainer(oplog: Oplog<StdOpener>, store: StdFile) {
        loop {
            oplog.drain_wanted().await;
            let items = oplog.drain_batch(64 << 10);
            for item in &items {
                let data = oplog.read_drain_item(item).await.expect("read drain item");
                store
                    .write_at(&data, item.offset)
                    .await
                    .expect("store write");
            }
            store.sync_data().await.expect("store sync");
            oplog.complete_drain(&items).await.expect("complete drain");
        }
    }

    fn parse_ack(line: &str) -> Option<(u64, u64)> {
        let mut words = line.strip_suffix('\n')?.strip_prefix("ACK ")?.split(' ');
        let slot = words.next()?.parse().ok()?;
        let gen = words.next()?.parse().ok()?;
        Some((slot, gen))
    }

    fn parent() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child");
        let mut reader = BufReader::new(child.stdout.take().expect("child stdout"));
        let mut acked: BTreeMap<u64, u64> = BTreeMap::new();
        let mut count = 0;
        let mut line = String::new();
        let started = Instant::now();
        while count < ACKS_BEFORE_KILL {
            line.clear();
            if reader.read_line(&mut line).expect("read child output") == 0 {
                panic!("child exited after {count} acknowledgements");
            }
            if let Some((slot, gen)) = parse_ack(&line) {
                acked.insert(slot, gen);
                count += 1;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "child too slow"
            );
        }
        child.kill().expect("SIGKILL"); // std sends SIGKILL on unix
        child.wait().expect("reap child");
        // Acknowledgements printed before the kill; only complete lines count.
        let mut rest = String::new();
        reader.read_to_string(&mut rest).expect("rest of output");
        for line in rest.split_inclusive('\n') {
            if let Some((slot, gen)) = parse_ack(line) {
                acked.insert(slot, gen);
                count += 1;
            }
        }
        eprintln!("child acknowledged {count} writes before SIGKILL");
        run_local(verify(dir.path().to_path_buf(), acked));
    }

    /// What the range reads as: the log where it has the range, else the store file.
    async fn read_vdisk(
        oplog: &Oplog<StdOpener>,
        store: &StdFile,
        offset: u64,
        length: u64,
    ) -> Vec<u8> {
        let mut out = vec![0u8; length as usize];
        for piece in oplog.lookup(offset, length) {
            let at = (piece.offset - offset) as usize;
            let buf = &mut out[at..at + piece.length as usize];
            match piece.source {
                PieceSource::Absent => store.read_at(buf, piece.offset).await.expect("store read"),
                _ => oplog.read_piece(&piece, buf).await.expect("log read"),
            }
        }
        out
    }

    async fn verify(dir: PathBuf, acked: BTreeMap<u64, u64>) {
        let oplog = Oplog::open(StdOpener, config(&log_dir(&dir), 256 << 10, 32 << 10))
            .await
            .expect("reopen");
        let store = StdFile::open(&store_path(&dir), true).expect("store");
        let check = |slot: u64, got: &[u8]| {
            let gen = acked[&slot];
            // The acknowledged generation, or the next one if it became durable unacknowledged.
            let matches = |g: u64| match contents(slot, g) {
                Some(data) => got == &data[..],
                None => got.iter().all(|&b| b == 0),
            };
            assert!(
                matches(gen) || matches(gen + 1),
                "slot {slot}: acknowledged generation {gen} lost"
            );
        };
        for &slot in acked.keys() {
            let (offset, length) = slot_range(slot);
            check(slot, &read_vdisk(&oplog, &store, offset, length).await);
        }
        // Recovery drains the log into the store: afterwards the store alone is right.
        while !oplog.is_empty() {
            let items = oplog.drain_batch(u64::MAX);
            for item in &items {
                let data = oplog.read_drain_item(item).await.expect("read drain item");
                store
                    .write_at(&data, item.offset)
                    .await
                    .expect("store write");
            }
            store.sync_data().await.expect("store sync");
            oplog.complete_drain(&items).await.expect("complete drain");
        }
        for &slot in acked.keys() {
            let (offset, length) = slot_range(slot);
            let mut got = vec![0u8; length as usize];
            store.read_at(&mut got, offset).await.expect("store read");
            check(slot, &got);
        }
        oplog.destroy().await.expect("destroy");
    }
}
