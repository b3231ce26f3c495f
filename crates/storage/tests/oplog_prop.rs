//! Property test: random writes, zeroes, direct writes (a barrier where a replay could bring
//! back an older record of the range), pipelined appends (several
//! batches in flight, completing in random order), drains, drains racing a write, reopens,
//! drain-everything-then-reopen, and power cuts of an idle log, checked after every step
//! against a model of the index and of the extent store the drains fill. Failing cases are
//! kept in `oplog_prop.proptest-regressions` (committed) and replayed first.

mod oplog_support;

mod oplog {
    use super::oplog_support::*;
    use ashlar_storage::oplog::{
        Append, DrainData, DrainItem, DrainKind, DrainReadLimits, Oplog, OplogConfig, OplogEvent,
        Seq, TryAppendError,
    };
    use proptest::prelude::*;
    use proptest::test_runner::FileFailurePersistence;
    use std::future::Future;
    use std::task::Poll;
    use std::time::Duration;

    /// Bytes of vdisk address space the operations touch.
    const SPACE: u64 = 64 << 10;
    const MAX_LEN: u64 = 12_000;

    #[derive(Clone, Debug)]
    enum Op {
        Write {
            offset: u64,
            len: u64,
            seed: u64,
        },
        Zero {
            offset: u64,
            len: u64,
        },
        /// The engine's bypass: data straight to the extent store, then a barrier.
        Direct {
            offset: u64,
            len: u64,
            seed: u64,
        },
        /// Several records appended before any is durable: they go out in several batches at
        /// once and complete in any order.
        Pipelined {
            writes: Vec<(u64, u64, u64)>,
        },
        Drain {
            max: u64,
        },
        /// drain_batch, then a write lands, then complete_drain.
        DrainAcrossWrite {
            max: u64,
            offset: u64,
            len: u64,
            seed: u64,
        },
        /// A write lands while drain_batch gathers its items (after its first turn): the
        /// write must stay out of the batch, whose items stay disjoint.
        DrainWhileGathering {
            max: u64,
            offset: u64,
            len: u64,
            seed: u64,
        },
        Reopen,
        /// Drain everything, let the log free its segments, reopen (review 4.1 d).
        DrainAllReopen,
        /// Power cut while nothing is under way: nothing may change.
        PowerCutIdle,
    }

    fn range() -> impl Strategy<Value = (u64, u64)> {
        (1..=MAX_LEN).prop_flat_map(|len| (0..=SPACE - len, Just(len)))
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (range(), any::<u64>()).prop_map(|((offset, len), seed)| Op::Write { offset, len, seed }),
            2 => range().prop_map(|(offset, len)| Op::Zero { offset, len }),
            2 => (range(), any::<u64>()).prop_map(|((offset, len), seed)| Op::Direct { offset, len, seed }),
            3 => proptest::collection::vec((range(), any::<u64>()).prop_map(|((o, l), s)| (o, l, s)), 2..8)
                .prop_map(|writes| Op::Pipelined { writes }),
            3 => (0..10_000u64).prop_map(|max| Op::Drain { max }),
            1 => (0..10_000u64, range(), any::<u64>())
                .prop_map(|(max, (offset, len), seed)| Op::DrainAcrossWrite { max, offset, len, seed }),
            2 => (0..10_000u64, range(), any::<u64>())
                .prop_map(|(max, (offset, len), seed)| Op::DrainWhileGathering { max, offset, len, seed }),
            1 => Just(Op::Reopen),
            1 => Just(Op::DrainAllReopen),
            1 => Just(Op::PowerCutIdle),
        ]
    }

    /// What the oplog should say, and what the drains put in the extent store.
    struct Model {
        /// The index, byte by byte.
        log: Vec<LogByte>,
        /// The extent store's contents.
        store: Vec<u8>,
        /// What a reader must see: the last acknowledged write of each byte.
        truth: Vec<u8>,
    }

    impl Model {
        fn new() -> Self {
            Model {
                log: vec![LogByte::Absent; SPACE as usize],
                store: vec![0; SPACE as usize],
                truth: vec![0; SPACE as usize],
            }
        }

        fn write(&mut self, offset: u64, data: &[u8]) {
            let at = offset as usize;
            for (i, &b) in data.iter().enumerate() {
                self.log[at + i] = LogByte::Data(b);
                self.truth[at + i] = b;
            }
        }

        fn zero(&mut self, offset: u64, len: u64) {
            for i in offset as usize..(offset + len) as usize {
                self.log[i] = LogByte::Zero;
                self.truth[i] = 0;
            }
        }

        fn direct(&mut self, offset: u64, data: &[u8]) {
            let at = offset as usize;
            for (i, &b) in data.iter().enumerate() {
                self.log[at + i] = LogByte::Absent;
                self.store[at + i] = b;
                self.truth[at + i] = b;
            }
        }

        /// The drain copied `data` for the item into the store; `skip` is a range written
        /// after the drain batch was taken, which stays in the log.
        fn drained(&mut self, item: &DrainItem, data: &[u8], skip: Option<(u64, u64)>) {
            for (i, &b) in data.iter().enumerate() {
                let at = item.offset + i as u64;
                self.store[at as usize] = b;
                let overwritten = skip.is_some_and(|(o, l)| at >= o && at < o + l);
                if !overwritten {
                    self.log[at as usize] = LogByte::Absent;
                }
            }
        }
    }

    fn prop_config(segment: u64) -> OplogConfig {
        let mut config = config(&log_dir(), 400 * segment, segment);
        config.max_batches_in_flight = 3;
        // A turn per entry: a write can land between any two entries a drain gathers.
        config.drain_index_entries_per_turn = 1;
        config
    }

    async fn open(fs: &TestFs, segment: u64) -> Oplog<TestFs> {
        open_clean(fs, prop_config(segment)).await
    }

    /// Takes a drain batch and reads its items, checking them against the model.
    async fn take_batch(
        oplog: &Oplog<TestFs>,
        model: &Model,
        max: u64,
    ) -> Vec<(DrainItem, Vec<u8>)> {
        let items = oplog.drain_batch(max).await;
        read_batch(oplog, model, items, max).await
    }

    /// Reads a drain batch's items (in reads shaped by `max`), checking them against the
    /// model.
    async fn read_batch(
        oplog: &Oplog<TestFs>,
        model: &Model,
        items: Vec<DrainItem>,
        max: u64,
    ) -> Vec<(DrainItem, Vec<u8>)> {
        // Small reads with small gaps, so batches are cut into many merged reads.
        let limits = DrainReadLimits {
            max_read_bytes: 3 * 4096 + max % 8192,
            max_gap_bytes: max % 4096,
        };
        let read = oplog
            .read_drain_data(&items, limits)
            .await
            .expect("read drain data");
        assert_eq!(read.len(), items.len(), "one result per drain item");
        let mut out = Vec::new();
        let mut previous_end = 0;
        for (item, data) in items.into_iter().zip(read) {
            assert!(
                item.offset >= previous_end,
                "drain items sorted and disjoint"
            );
            previous_end = item.offset + item.length;
            assert_ne!(item.kind, DrainKind::Lost);
            let data = match data {
                DrainData::Data(bytes) => bytes.to_vec(),
                DrainData::Zero => vec![0u8; item.length as usize],
                other => panic!("drain item at {} read as {other:?}", item.offset),
            };
            assert_eq!(data.len() as u64, item.length);
            for (i, &b) in data.iter().enumerate() {
                let expected = model.log[(item.offset + i as u64) as usize];
                match expected {
                    LogByte::Data(d) => assert!(
                        item.kind == DrainKind::Data && d == b,
                        "drain item data differs at {}",
                        item.offset
                    ),
                    LogByte::Zero => assert!(item.kind == DrainKind::Zero && b == 0),
                    other => panic!("drain item covers a byte the index holds as {other:?}"),
                }
            }
            out.push((item, data));
        }
        out
    }

    async fn complete(oplog: &Oplog<TestFs>, batch: &[(DrainItem, Vec<u8>)]) {
        let items: Vec<DrainItem> = batch.iter().map(|(item, _)| *item).collect();
        oplog.complete_drain(&items).await;
    }

    async fn drain_everything(oplog: &Oplog<TestFs>, model: &mut Model) {
        loop {
            let batch = take_batch(oplog, model, 1 << 20).await;
            if batch.is_empty() {
                break;
            }
            complete(oplog, &batch).await;
            for (item, data) in &batch {
                model.drained(item, data, None);
            }
        }
        oplog.idle().await;
    }

    /// Appends the writes without waiting, then drives the log until all are durable; checks
    /// that `Durable` events only go forward.
    async fn pipelined(oplog: &Oplog<TestFs>, writes: &[(u64, u64, u64)], model: &mut Model) {
        let mut seqs: Vec<Seq> = Vec::new();
        let mut durable: Option<Seq> = None;
        let max = oplog.max_write_bytes() as usize;
        let parts = writes.iter().flat_map(|&(offset, len, seed)| {
            let data = pattern(seed, len as usize);
            (0..data.len())
                .step_by(max)
                .map(move |at| {
                    (
                        offset + at as u64,
                        data.slice(at..(at + max).min(data.len())),
                    )
                })
                .collect::<Vec<_>>()
        });
        for (offset, data) in parts {
            loop {
                match oplog.try_append(Append::Write {
                    offset,
                    data: data.clone(),
                }) {
                    Ok(seq) => {
                        seqs.push(seq);
                        break;
                    }
                    Err(TryAppendError::Backpressure(_)) => {
                        if let OplogEvent::Durable { through } = oplog.next_event().await {
                            assert!(Some(through) > durable);
                            durable = Some(through);
                        }
                    }
                    Err(TryAppendError::Rejected(error)) => panic!("append refused: {error}"),
                }
            }
            model.write(offset, &data);
        }
        let last = *seqs.last().expect("writes");
        while durable < Some(last) {
            let event = tokio::time::timeout(Duration::from_secs(10), oplog.next_event())
                .await
                .expect("pipelined records become durable");
            match event {
                OplogEvent::Durable { through } => {
                    assert!(Some(through) > durable);
                    durable = Some(through);
                }
                OplogEvent::Failed { seqs, error } => panic!("{seqs:?} failed: {error}"),
                _ => {}
            }
        }
        for seq in seqs {
            assert!(matches!(oplog.outcome(seq), Some(Ok(()))));
        }
    }

    /// Checks what readers see, and (unless just reopened) the exact index.
    async fn check(oplog: &Oplog<TestFs>, model: &mut Model, exact: bool) {
        let seen = read_log(oplog, 0, SPACE).await.expect("read");
        for (i, byte) in seen.iter().enumerate() {
            let value = match byte {
                LogByte::Data(b) => *b,
                LogByte::Zero => 0,
                LogByte::Absent => model.store[i],
                LogByte::Lost => panic!("byte {i} lost"),
            };
            assert_eq!(value, model.truth[i], "byte {i} reads wrong ({byte:?})");
        }
        if exact {
            assert!(seen == model.log, "index differs from the model");
            let live = model.log.iter().filter(|b| **b != LogByte::Absent).count() as u64;
            assert_eq!(oplog.live_bytes(), live);
            assert_eq!(oplog.is_empty(), live == 0);
        } else {
            // Replay may bring back records that were drained but whose segment was kept
            // (an older segment was still live); they hold what the store holds.
            model.log = seen;
        }
        assert!(oplog.usage_bytes() <= oplog.capacity_bytes());
    }

    async fn run(ops: Vec<Op>, segment: u64, seed: u64) {
        let mut fs = TestFs::new(seed);
        fs.set_yields(3);
        let mut oplog = open(&fs, segment).await;
        let mut model = Model::new();
        for op in ops {
            let mut exact = true;
            match op {
                Op::Write { offset, len, seed } => {
                    let data = pattern(seed, len as usize);
                    oplog.write(offset, data.clone()).await.expect("write");
                    model.write(offset, &data);
                }
                Op::Zero { offset, len } => {
                    oplog.write_zeroes(offset, len).await.expect("zero");
                    model.zero(offset, len);
                }
                Op::Direct { offset, len, seed } => {
                    let data = pattern(seed, len as usize);
                    // As the engine does: a barrier only while a replay could bring back an
                    // older record of the range. A wrong "no" shows at the next reopen or
                    // power cut, when the older record comes back over the model's truth.
                    if oplog.replay_may_reach(offset, len) {
                        oplog.barrier(offset, len).await.expect("barrier");
                    } else {
                        assert!(!oplog.holds_any_of(offset, len));
                    }
                    model.direct(offset, &data);
                }
                Op::Pipelined { writes } => pipelined(&oplog, &writes, &mut model).await,
                Op::Drain { max } => {
                    let batch = take_batch(&oplog, &model, max).await;
                    complete(&oplog, &batch).await;
                    for (item, data) in &batch {
                        model.drained(item, data, None);
                    }
                }
                Op::DrainAcrossWrite {
                    max,
                    offset,
                    len,
                    seed,
                } => {
                    let batch = take_batch(&oplog, &model, max).await;
                    let data = pattern(seed, len as usize);
                    oplog.write(offset, data.clone()).await.expect("write");
                    model.write(offset, &data);
                    complete(&oplog, &batch).await;
                    for (item, drained) in &batch {
                        model.drained(item, drained, Some((offset, len)));
                    }
                }
                Op::DrainWhileGathering {
                    max,
                    offset,
                    len,
                    seed,
                } => {
                    let data = pattern(seed, len as usize);
                    let mut gathering = std::pin::pin!(oplog.drain_batch(max));
                    let first =
                        std::future::poll_fn(|cx| Poll::Ready(gathering.as_mut().poll(cx))).await;
                    oplog.write(offset, data.clone()).await.expect("write");
                    let items = match first {
                        Poll::Ready(items) => items,
                        Poll::Pending => gathering.await,
                    };
                    // The batch holds what the log held before the write.
                    let batch = read_batch(&oplog, &model, items, max).await;
                    model.write(offset, &data);
                    complete(&oplog, &batch).await;
                    for (item, drained) in &batch {
                        model.drained(item, drained, Some((offset, len)));
                    }
                }
                Op::Reopen => {
                    drop(oplog);
                    oplog = open(&fs, segment).await;
                    exact = false;
                }
                Op::DrainAllReopen => {
                    drain_everything(&oplog, &mut model).await;
                    assert!(oplog.is_empty());
                    drop(oplog);
                    oplog = open(&fs, segment).await;
                    exact = false;
                }
                Op::PowerCutIdle => {
                    oplog.idle().await;
                    let after = fs.cut_power_now();
                    drop(oplog);
                    fs = after;
                    fs.set_yields(3);
                    oplog = open(&fs, segment).await;
                    exact = false;
                }
            }
            check(&oplog, &mut model, exact).await;
        }
        // Draining everything empties the log.
        drain_everything(&oplog, &mut model).await;
        check(&oplog, &mut model, true).await;
        assert!(oplog.is_empty());
        oplog.destroy().await.expect("destroy");
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 100,
            failure_persistence: Some(Box::new(FileFailurePersistence::WithSource("proptest-regressions"))),
            ..ProptestConfig::default()
        })]

        #[test]
        fn oplog_matches_its_model(
            ops in proptest::collection::vec(op(), 1..40),
            batches in prop_oneof![Just(1u64), Just(2), Just(16)],
            seed in any::<u64>(),
        ) {
            run_local(run(ops, segment_for_batches(batches), seed));
        }
    }
}
