//! Crash tests.
//!
//! - Power cuts: writers and a drainer run on `TestFs` until the power is cut at a random
//!   operation (the disk keeps any subset of the blocks not yet durable); the log is reopened
//!   on what the disk kept, checked, and the run goes on, over several cuts per seed and many
//!   seeds. Every acknowledged write must read back (from the log or the "extent store" the
//!   drainer fills); a write in flight at the cut reads old or new, whole; replay never fails
//!   and never reports a loss.
//! - kill -9: a child process (this test binary, re-executed) writes and drains on the real
//!   filesystem while printing every acknowledged write; the parent kills it mid-stream and
//!   checks. (The page cache survives a kill, so this checks the process-level logic only.)

mod oplog_support;

mod oplog {
    use super::oplog_support::*;
    use ashlar_storage::fs::{DiskFile, Filesystem, StdFs};
    use ashlar_storage::oplog::{DrainKind, Oplog, OplogConfig, PieceSource};
    use bytes::Bytes;
    use std::cell::{Cell, RefCell};
    use std::collections::BTreeMap;
    use std::io::{BufRead, BufReader, Read};
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};
    use std::rc::Rc;
    use std::time::{Duration, Instant};

    const SLOTS: u64 = 32;
    const WRITERS: u64 = 8;

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

    fn store_path() -> PathBuf {
        PathBuf::from("/fast/store")
    }

    /// Writes `data` at `offset` of a file that takes aligned writes only (read, modify, write
    /// the enclosing blocks).
    async fn write_unaligned<D: DiskFile>(
        file: &D,
        offset: u64,
        data: &[u8],
    ) -> std::io::Result<()> {
        let start = offset / 4_096 * 4_096;
        let end = (offset + data.len() as u64).div_ceil(4_096) * 4_096;
        let mut buf = vec![0u8; (end - start) as usize];
        file.read_at(&mut buf, start).await?;
        let at = (offset - start) as usize;
        buf[at..at + data.len()].copy_from_slice(data);
        file.write_at(&buf, start).await
    }

    /// What the range reads as: the log where it has the range, else the store file.
    async fn read_vdisk<F: Filesystem>(
        oplog: &Oplog<F>,
        store: &F::File,
        offset: u64,
        length: u64,
    ) -> Vec<u8> {
        let mut out = vec![0u8; length as usize];
        for piece in oplog.lookup(offset, length) {
            let at = (piece.offset - offset) as usize;
            let buf = &mut out[at..at + piece.length as usize];
            match piece.source {
                PieceSource::Absent => store.read_at(buf, piece.offset).await.expect("store read"),
                PieceSource::Lost { .. } => panic!("a crash lost {piece:?}"),
                _ => oplog.read_piece(&piece, buf).await.expect("log read"),
            }
        }
        out
    }

    /// Which generations of each slot a reader may see.
    #[derive(Clone, Default)]
    struct Expect {
        /// The last acknowledged generation of each slot.
        acked: BTreeMap<u64, u64>,
        /// A generation in flight (issued, not acknowledged) for each slot.
        in_flight: BTreeMap<u64, u64>,
    }

    impl Expect {
        fn check(&self, slot: u64, got: &[u8], context: &str) {
            let matches = |gen: Option<u64>| match gen {
                None => got.iter().all(|&b| b == 0),
                Some(g) => match contents(slot, g) {
                    Some(data) => got == &data[..],
                    None => got.iter().all(|&b| b == 0),
                },
            };
            let acked = self.acked.get(&slot).copied();
            let in_flight = self.in_flight.get(&slot).copied();
            assert!(
                matches(acked) || (in_flight.is_some() && matches(in_flight)),
                "{context}: slot {slot}: acknowledged generation {acked:?} lost (in flight: {in_flight:?})"
            );
        }

        /// After a check, what a slot holds is settled: whichever generation it showed.
        fn settle(&mut self, slot: u64, got: &[u8]) {
            if let Some(g) = self.in_flight.remove(&slot) {
                let new = match contents(slot, g) {
                    Some(data) => got == &data[..],
                    None => got.iter().all(|&b| b == 0),
                };
                if new {
                    self.acked.insert(slot, g);
                }
            }
        }
    }

    fn crash_config() -> OplogConfig {
        let segment = segment_for_batches(8);
        let mut config = config(&log_dir(), 6 * segment, segment);
        config.max_batch_bytes = 32 << 10;
        config
    }

    async fn writer(
        fs: TestFs,
        oplog: Oplog<TestFs>,
        w: u64,
        first_gen: u64,
        gens: u64,
        expect: Rc<RefCell<Expect>>,
    ) {
        for gen in first_gen..first_gen + gens {
            for slot in (w..SLOTS).step_by(WRITERS as usize) {
                let (offset, length) = slot_range(slot);
                expect.borrow_mut().in_flight.insert(slot, gen);
                let write = async {
                    match contents(slot, gen) {
                        Some(data) => oplog.write(offset, data).await,
                        None => oplog.write_zeroes(offset, length).await,
                    }
                };
                // After a power cut nothing more becomes durable; a writer waiting for space
                // would wait for a drain that cannot come.
                let result = tokio::select! {
                    biased;
                    result = write => result.is_ok(),
                    () = fs.power_cut() => false,
                };
                if !result {
                    // The disk is gone: stop, leaving the generation in flight.
                    return;
                }
                let mut expect = expect.borrow_mut();
                expect.in_flight.remove(&slot);
                expect.acked.insert(slot, gen);
            }
        }
    }

    /// The engine's drain: copy (or mark lost), sync the store, then tell the log.
    async fn drainer(
        oplog: Oplog<TestFs>,
        store: Rc<<TestFs as Filesystem>::File>,
        seed: u64,
        done: Rc<Cell<bool>>,
    ) {
        let mut rng = Rng::new(seed);
        while !done.get() {
            for _ in 0..rng.below(60) {
                tokio::task::yield_now().await;
            }
            if oplog.is_empty() || !(oplog.needs_drain() || rng.chance(30)) {
                continue;
            }
            let items = oplog.drain_batch(1 + rng.below(64 << 10)).await;
            for item in &items {
                assert_ne!(item.kind, DrainKind::Lost, "a crash-only log lost a range");
                let Ok(data) = oplog.read_drain_item(item).await else {
                    return;
                };
                if write_unaligned(&*store, item.offset, &data).await.is_err() {
                    return;
                }
            }
            if store.sync_data().await.is_err() {
                return;
            }
            oplog.complete_drain(&items).await;
        }
    }

    /// One life of the log: open on what the disk kept, check, write and drain until the
    /// power is cut. Returns the disk as it comes back.
    /// Torn tails and repaired headers seen by replays, over all seeds.
    #[derive(Default)]
    struct Seen {
        torn: u64,
        repaired: u64,
    }

    async fn epoch(
        fs: TestFs,
        seed: u64,
        epoch: u64,
        expect: Rc<RefCell<Expect>>,
        seen: Rc<RefCell<Seen>>,
    ) -> TestFs {
        let mut rng = Rng::new(seed * 31 + epoch);
        // Long enough in flight that cuts often land in the middle of writes.
        fs.set_yields_range(1, 8);
        let (oplog, report) = Oplog::open(fs.clone(), crash_config())
            .await
            .unwrap_or_else(|e| panic!("seed {seed} epoch {epoch}: replay failed: {e}"));
        assert!(
            report.lost.is_empty(),
            "seed {seed} epoch {epoch}: a crash-only log reported losses: {report:?}"
        );
        seen.borrow_mut().torn += report.torn.len() as u64;
        seen.borrow_mut().repaired += report.repaired.len() as u64;
        let store = Rc::new(fs.open(&store_path(), false).await.expect("store"));
        let context = format!("seed {seed} epoch {epoch}");
        for slot in 0..SLOTS {
            let (offset, length) = slot_range(slot);
            let got = read_vdisk(&oplog, &store, offset, length).await;
            expect.borrow().check(slot, &got, &context);
            expect.borrow_mut().settle(slot, &got);
        }
        // Run until a power cut (or, one time in three, a kill -9: the page cache survives
        // into the next life) somewhere in the next few thousand operations.
        let at = fs.ops() + 1 + rng.below(2_500);
        let kill = rng.chance(33);
        if kill {
            fs.kill_at(at);
        } else {
            fs.cut_power_at(at);
        }
        let done = Rc::new(Cell::new(false));
        let drain = tokio::task::spawn_local(drainer(
            oplog.clone(),
            store.clone(),
            rng.next(),
            done.clone(),
        ));
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let gens = 10 + rng.below(20);
                tokio::task::spawn_local(writer(
                    fs.clone(),
                    oplog.clone(),
                    w,
                    epoch * 1_000,
                    gens,
                    expect.clone(),
                ))
            })
            .collect();
        for writer in writers {
            if tokio::time::timeout(Duration::from_secs(60), writer)
                .await
                .is_err()
            {
                panic!(
                    "{context}: a writer hung (power cut: {}; needs_drain {}; usage {}; segments {:?})",
                    fs.is_cut(),
                    oplog.needs_drain(),
                    oplog.usage_bytes(),
                    oplog.segment_counts()
                );
            }
        }
        done.set(true);
        tokio::time::timeout(Duration::from_secs(60), drain)
            .await
            .unwrap_or_else(|_| panic!("{context}: the drainer hung"))
            .unwrap();
        drop(oplog);
        if kill {
            // Killed, or the workload ended first: the next process finds the disk as is.
            fs.revive();
            return fs;
        }
        match fs.crashed() {
            Some(after) => after,
            None => fs.cut_power_now(),
        }
    }

    #[test]
    fn power_cuts_lose_no_acknowledged_write() {
        let env = |name: &str, default: u64| {
            std::env::var(name)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(default)
        };
        let first = env("OPLOG_CRASH_FIRST_SEED", 0);
        let seeds = env("OPLOG_CRASH_SEEDS", 48);
        let seen = Rc::new(RefCell::new(Seen::default()));
        for seed in first..first + seeds {
            let seen = seen.clone();
            run_local(async move {
                let fs = TestFs::new(seed);
                fs.create_dir_all(Path::new("/fast")).await.unwrap();
                let store = fs.open(&store_path(), true).await.unwrap();
                store.allocate(0, SLOTS * 16_384 + 16_384).await.unwrap();
                store.sync_data().await.unwrap();
                fs.sync_dir(Path::new("/fast")).await.unwrap();
                let expect = Rc::new(RefCell::new(Expect::default()));
                let mut fs = fs;
                for e in 0..4 {
                    fs = epoch(fs, seed, e, expect.clone(), seen.clone()).await;
                }
                // Last check, then drain everything: the store alone must be right.
                fs.set_yields(0);
                let (oplog, report) = Oplog::open(fs.clone(), crash_config())
                    .await
                    .expect("final replay");
                assert!(report.lost.is_empty(), "seed {seed}: {report:?}");
                let store = fs.open(&store_path(), false).await.unwrap();
                let mut seen = Vec::new();
                for slot in 0..SLOTS {
                    let (offset, length) = slot_range(slot);
                    let got = read_vdisk(&oplog, &store, offset, length).await;
                    expect
                        .borrow()
                        .check(slot, &got, &format!("seed {seed} final"));
                    seen.push(got);
                }
                while !oplog.is_empty() {
                    let items = oplog.drain_batch(u64::MAX).await;
                    for item in &items {
                        let data = oplog.read_drain_item(item).await.expect("drain read");
                        write_unaligned(&store, item.offset, &data).await.unwrap();
                    }
                    store.sync_data().await.unwrap();
                    oplog.complete_drain(&items).await;
                }
                oplog.idle().await;
                for slot in 0..SLOTS {
                    let (offset, length) = slot_range(slot);
                    let mut got = vec![0u8; length as usize];
                    store.read_at(&mut got, offset).await.unwrap();
                    assert_eq!(
                        got, seen[slot as usize],
                        "seed {seed}: slot {slot} after the drain"
                    );
                }
            });
        }
        let seen = seen.borrow();
        eprintln!(
            "{seeds} seeds: {} torn tails cut off, {} header copies repaired",
            seen.torn, seen.repaired
        );
        assert!(
            seen.torn > 0,
            "the power cuts never tore a batch: the test is too gentle"
        );
    }

    const CHILD_ENV: &str = "ASHLAR_OPLOG_CRASH_CHILD";
    const TEST_NAME: &str = "oplog::kill9_loses_no_acknowledged_write";
    /// The parent kills the child after this many acknowledgements.
    const ACKS_BEFORE_KILL: usize = 1_500;

    fn kill9_config(dir: &Path) -> OplogConfig {
        let segment = 64 << 10;
        let mut config = config(&dir.join("log"), 8 * segment, segment);
        config.max_batch_bytes = 32 << 10;
        config
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
            let (oplog, _) = Oplog::open(StdFs, kill9_config(dir)).await.expect("open");
            let store = Rc::new(StdFs.open(&dir.join("store"), true).await.expect("store"));
            tokio::task::spawn_local(std_drainer(oplog.clone(), store));
            let writers: Vec<_> = (0..WRITERS)
                .map(|w| tokio::task::spawn_local(std_writer(oplog.clone(), w)))
                .collect();
            for writer in writers {
                let _ = writer.await;
            }
        });
    }

    async fn std_writer(oplog: Oplog<StdFs>, w: u64) {
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

    async fn std_drainer(oplog: Oplog<StdFs>, store: Rc<<StdFs as Filesystem>::File>) {
        loop {
            oplog.drain_wanted().await;
            let items = oplog.drain_batch(64 << 10).await;
            for item in &items {
                let data = oplog.read_drain_item(item).await.expect("read drain item");
                store
                    .write_at(&data, item.offset)
                    .await
                    .expect("store write");
            }
            store.sync_data().await.expect("store sync");
            oplog.complete_drain(&items).await;
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
        child.kill().expect("SIGKILL");
        child.wait().expect("reap child");
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

    async fn verify(dir: PathBuf, acked: BTreeMap<u64, u64>) {
        let (oplog, report) = Oplog::open(StdFs, kill9_config(&dir))
            .await
            .expect("reopen");
        assert!(report.lost.is_empty(), "{report:?}");
        let store = StdFs.open(&dir.join("store"), true).await.expect("store");
        let mut expect = Expect::default();
        for (&slot, &gen) in &acked {
            expect.acked.insert(slot, gen);
            // The next generation may have become durable unacknowledged.
            expect.in_flight.insert(slot, gen + 1);
        }
        for &slot in acked.keys() {
            let (offset, length) = slot_range(slot);
            let got = read_vdisk(&oplog, &store, offset, length).await;
            expect.check(slot, &got, "after kill -9");
        }
        while !oplog.is_empty() {
            let items = oplog.drain_batch(u64::MAX).await;
            for item in &items {
                let data = oplog.read_drain_item(item).await.expect("read drain item");
                store
                    .write_at(&data, item.offset)
                    .await
                    .expect("store write");
            }
            store.sync_data().await.expect("store sync");
            oplog.complete_drain(&items).await;
        }
        for &slot in acked.keys() {
            let (offset, length) = slot_range(slot);
            let mut got = vec![0u8; length as usize];
            store.read_at(&mut got, offset).await.expect("store read");
            expect.check(slot, &got, "after the drain");
        }
        oplog.destroy().await.expect("destroy");
    }
}
