//! Oplog behaviour: reads, coalescing, group commit and the in-flight window, replay, torn
//! tails, corruption, drains, backpressure, failure and recovery, older formats. Tests live
//! in `mod oplog` so `cargo test oplog` selects them. Most run on `TestFs` (in memory, with
//! faults); a few on the real filesystem (`StdFs`).

mod oplog_support;

mod oplog {
    use super::oplog_support::*;
    use ashlar_storage::fs::{Filesystem, StdFs};
    use ashlar_storage::oplog::{
        Append, Backpressure, DrainKind, LogPiece, Oplog, OplogConfig, OplogError, OplogEvent,
        PieceSource, Seq, TryAppendError,
    };
    use bytes::Bytes;
    use std::cell::{Cell, RefCell};
    use std::path::{Path, PathBuf};
    use std::rc::Rc;
    use std::time::Duration;

    const MIB: u64 = 1 << 20;
    /// Where the first batch of a segment starts, and the size of a batch of one 4 KiB write.
    const FIRST_BATCH: u64 = 8192;
    const BATCH_4K: u64 = 8192;
    /// Offsets inside a batch of one record: its record header, CRC and payload.
    const RECORD_AT: u64 = 72 + 24;
    const PAYLOAD_AT: u64 = RECORD_AT + 40 + 4;

    fn fresh(seed: u64) -> TestFs {
        let fs = TestFs::new(seed);
        fs.set_yields(0);
        fs
    }

    fn kinds(pieces: &[LogPiece]) -> Vec<(u64, u64, &'static str)> {
        pieces
            .iter()
            .map(|p| {
                let kind = match p.source {
                    PieceSource::Data { .. } => "data",
                    PieceSource::Zero => "zero",
                    PieceSource::Absent => "absent",
                    PieceSource::Lost { .. } => "lost",
                };
                (p.offset, p.length, kind)
            })
            .collect()
    }

    /// Segment files (all of them: active and spare), by serial.
    fn segment_files(fs: &TestFs) -> Vec<PathBuf> {
        fs.files_with_prefix(&log_dir(), "seg-")
    }

    /// File offset of batch `i` (one 4 KiB write each) of the first segment.
    fn batch_pos(i: u64) -> u64 {
        FIRST_BATCH + i * BATCH_4K
    }

    #[test]
    fn write_then_read_returns_the_data_on_a_real_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let config = OplogConfig::new(dir.path().join("log"), 7, 16 * MIB);
            let oplog = open_clean(&StdFs, config.clone()).await;
            assert!(oplog.is_empty());
            let data = pattern(1, 10_000);
            oplog.write(5_000, data.clone()).await.unwrap();
            assert!(!oplog.is_empty());
            assert_eq!(oplog.live_bytes(), 10_000);
            assert_eq!(
                kinds(&oplog.lookup(0, 20_000)),
                vec![
                    (0, 5_000, "absent"),
                    (5_000, 10_000, "data"),
                    (15_000, 5_000, "absent")
                ]
            );
            assert_eq!(read_data(&oplog, 5_000, 10_000).await, data.to_vec());
            // Unaligned sub-ranges crossing chunk boundaries.
            assert_eq!(
                read_data(&oplog, 9_000, 100).await,
                data[4_000..4_100].to_vec()
            );
            assert_eq!(read_data(&oplog, 14_999, 1).await, data[9_999..].to_vec());
            assert!(oplog.lookup(0, 0).is_empty());
            oplog.write(0, Bytes::new()).await.unwrap();
            assert_eq!(oplog.live_bytes(), 10_000);
            drop(oplog);
            let oplog = open_clean(&StdFs, config.clone()).await;
            assert_eq!(read_data(&oplog, 5_000, 10_000).await, data.to_vec());
            let mut store = Store::default();
            drain_all(&oplog, &mut store).await;
            assert!(oplog.is_empty());
            oplog.destroy().await.unwrap();
            assert!(!dir.path().join("log").exists());
        });
    }

    #[test]
    fn overlapping_writes_coalesce_to_the_newest_pieces() {
        run_local(async {
            let fs = fresh(1);
            let oplog = open_clean(&fs, config(&log_dir(), 16 * MIB, MIB)).await;
            let a = pattern(1, 16_384);
            let b = pattern(2, 4_000);
            let c = pattern(3, 10_000);
            oplog.write(0, a.clone()).await.unwrap();
            oplog.write(6_000, b.clone()).await.unwrap(); // inside a: splits it in three
            oplog.write(12_000, c.clone()).await.unwrap(); // over a's tail and beyond
            assert_eq!(
                kinds(&oplog.lookup(0, 22_000)),
                vec![
                    (0, 6_000, "data"),
                    (6_000, 4_000, "data"),
                    (10_000, 2_000, "data"),
                    (12_000, 10_000, "data")
                ]
            );
            let mut expected = a.to_vec();
            expected.resize(22_000, 0);
            expected[6_000..10_000].copy_from_slice(&b);
            expected[12_000..22_000].copy_from_slice(&c);
            assert_eq!(read_data(&oplog, 0, 22_000).await, expected);
            assert_eq!(oplog.live_bytes(), 22_000);
            let d = pattern(4, 30_000);
            oplog.write(0, d.clone()).await.unwrap();
            assert_eq!(kinds(&oplog.lookup(0, 30_000)), vec![(0, 30_000, "data")]);
            assert_eq!(read_data(&oplog, 0, 30_000).await, d.to_vec());
        });
    }

    #[test]
    fn zero_and_barrier_records() {
        run_local(async {
            let fs = fresh(2);
            let oplog = open_clean(&fs, config(&log_dir(), 16 * MIB, MIB)).await;
            oplog.write(0, pattern(1, 12_288)).await.unwrap();
            oplog.write_zeroes(4_096, 4_096).await.unwrap();
            oplog.barrier(10_000, 10_000).await.unwrap();
            assert_eq!(
                kinds(&oplog.lookup(0, 20_000)),
                vec![
                    (0, 4_096, "data"),
                    (4_096, 4_096, "zero"),
                    (8_192, 1_808, "data"),
                    (10_000, 10_000, "absent")
                ]
            );
            let bytes = read_log(&oplog, 4_000, 4_300).await.unwrap();
            assert_eq!(bytes[96], LogByte::Zero);
            assert!(matches!(bytes[95], LogByte::Data(_)));
            oplog.barrier(0, 1 << 30).await.unwrap();
            assert!(oplog.is_empty());
            // Zero ranges of any size are one record.
            oplog.write_zeroes(0, 5 << 40).await.unwrap();
            assert_eq!(oplog.live_bytes(), 5 << 40);
            drop(oplog);
            let oplog = open_clean(&fs, config(&log_dir(), 16 * MIB, MIB)).await;
            assert_eq!(kinds(&oplog.lookup(0, 5 << 40)), vec![(0, 5 << 40, "zero")]);
        });
    }

    #[test]
    fn concurrent_writes_share_batches_without_a_sync_per_commit() {
        run_local(async {
            let fs = fresh(3);
            // Writes take long enough for every writer to arrive while the window is full:
            // records arriving meanwhile share the next batch.
            fs.set_yields_range(40, 60);
            let mut config = config(&log_dir(), 16 * MIB, MIB);
            config.max_batch_bytes = 512 << 10;
            let oplog = open_clean(&fs, config).await;
            oplog.idle().await;
            let (writes_before, syncs_before) = (fs.durable_writes(), fs.syncs());
            let handles: Vec<_> = (0..64u64)
                .map(|i| {
                    let oplog = oplog.clone();
                    tokio::task::spawn_local(async move {
                        oplog.write(i * 8_192, pattern(i, 8_192)).await
                    })
                })
                .collect();
            for handle in handles {
                handle.await.unwrap().unwrap();
            }
            let writes = fs.durable_writes() - writes_before;
            // About one batch per window slot, then one with everybody else.
            assert!(
                writes <= 10,
                "64 concurrent writes took {writes} durable writes"
            );
            assert_eq!(
                fs.syncs(),
                syncs_before,
                "a commit must not flush the whole file"
            );
            for i in 0..64u64 {
                assert_eq!(
                    read_data(&oplog, i * 8_192, 8_192).await,
                    pattern(i, 8_192).to_vec()
                );
            }
        });
    }

    #[test]
    fn batches_respect_their_size_limit() {
        run_local(async {
            let fs = fresh(4);
            let mut config = config(&log_dir(), 16 * MIB, MIB);
            // Room for three 4 KiB records per batch.
            config.max_batch_bytes = 4 * 4096;
            let oplog = open_clean(&fs, config.clone()).await;
            oplog.idle().await;
            let before = fs.durable_writes();
            let mut seqs = Vec::new();
            let mut refused = 0;
            for i in 0..30u64 {
                loop {
                    match oplog.try_append(Append::Write {
                        offset: i * 4_096,
                        data: pattern(i, 4_096),
                    }) {
                        Ok(seq) => {
                            seqs.push(seq);
                            break;
                        }
                        Err(TryAppendError::Backpressure(Backpressure::BatchFull)) => {
                            refused += 1;
                            oplog.next_event().await;
                        }
                        Err(other) => panic!("{other:?}"),
                    }
                }
            }
            assert!(refused > 0, "a full pending batch refuses records");
            oplog.idle().await;
            assert!(
                fs.durable_writes() - before >= 10,
                "at most 3 records per batch"
            );
            for (i, seq) in seqs.iter().enumerate() {
                assert!(matches!(oplog.outcome(*seq), Some(Ok(()))));
                assert_eq!(
                    read_data(&oplog, i as u64 * 4_096, 4_096).await,
                    pattern(i as u64, 4_096).to_vec()
                );
            }
            // Writes larger than a record can hold are split by `write`, refused by
            // `try_append`.
            let big = pattern(99, 40_000);
            assert!(matches!(
                oplog.try_append(Append::Write {
                    offset: 0,
                    data: big.clone()
                }),
                Err(TryAppendError::Rejected(OplogError::TooLarge { .. }))
            ));
            oplog.write(1_000, big.clone()).await.unwrap();
            assert_eq!(read_data(&oplog, 1_000, 40_000).await, big.to_vec());
            assert!(matches!(
                oplog.write(u64::MAX - 5, pattern(1, 10)).await,
                Err(OplogError::InvalidRange { .. })
            ));
            assert!(matches!(
                oplog.try_append(Append::Zero {
                    offset: 0,
                    length: 0
                }),
                Err(TryAppendError::Rejected(OplogError::InvalidRange { .. }))
            ));
        });
    }

    /// Batches complete in random order; they are acknowledged, and indexed, strictly in
    /// order, and never more than the window is in flight.
    #[test]
    fn the_window_is_respected_and_acknowledgements_stay_in_order() {
        for window in [1usize, 3] {
            run_local(async move {
                let fs = fresh(5);
                fs.set_yields(6);
                let mut config = config(&log_dir(), 16 * MIB, MIB);
                config.max_batches_in_flight = window;
                let oplog = open_clean(&fs, config).await;
                oplog.idle().await;
                fs.track_concurrency_from(FIRST_BATCH);
                let mut rng = Rng::new(window as u64);
                let mut appended: Vec<(Seq, u64)> = Vec::new();
                let mut durable: Option<Seq> = None;
                let mut next = 0u64;
                while next < 200 || durable < appended.last().map(|a| a.0) {
                    for _ in 0..rng.below(4) {
                        if next >= 200 {
                            break;
                        }
                        let seq = oplog
                            .try_append(Append::Write {
                                offset: next * 4_096,
                                data: pattern(next, 4_096),
                            })
                            .unwrap();
                        if let Some((last, _)) = appended.last() {
                            assert!(seq > *last);
                        }
                        appended.push((seq, next));
                        next += 1;
                    }
                    if durable >= appended.last().map(|a| a.0) {
                        continue;
                    }
                    // While appending, take an event only if one is ready (dropping the
                    // future otherwise: next_event is cancel-safe); at the end, wait for them.
                    let event = if next < 200 {
                        match poll_once(oplog.next_event()).await {
                            Some(event) => event,
                            None => {
                                tokio::task::yield_now().await;
                                continue;
                            }
                        }
                    } else {
                        tokio::time::timeout(Duration::from_secs(5), oplog.next_event())
                            .await
                            .expect("an event while records are in flight")
                    };
                    if let OplogEvent::Durable { through } = event {
                        assert!(Some(through) > durable, "durable goes forward");
                        durable = Some(through);
                    }
                    // Exactly the records up to `durable` are in the index.
                    for (seq, block) in &appended {
                        let source = oplog.lookup(block * 4_096, 4_096)[0].source;
                        let indexed = matches!(source, PieceSource::Data { .. });
                        assert_eq!(
                            indexed,
                            Some(*seq) <= durable,
                            "record {seq} vs {durable:?}"
                        );
                    }
                }
                assert!(fs.max_concurrent_writes() <= window as u64);
                if window > 1 {
                    assert!(fs.max_concurrent_writes() > 1, "the window is used");
                }
            });
        }
    }

    /// Writes a mix of overlapping records across many small segments.
    async fn write_mix<F: Filesystem>(oplog: &Oplog<F>) {
        for i in 0..40u64 {
            let offset = (i * 7_919) % 60_000;
            match i % 5 {
                3 => oplog.write_zeroes(offset, 3_000).await.unwrap(),
                4 => oplog.barrier(offset, 2_000).await.unwrap(),
                _ => oplog
                    .write(offset, pattern(i, 1_000 + (i as usize * 131) % 9_000))
                    .await
                    .unwrap(),
            }
        }
    }

    #[test]
    fn reopening_replays_the_same_index() {
        run_local(async {
            let fs = fresh(6);
            let config = config(&log_dir(), 4 * MIB, segment_for_batches(4));
            let (pieces, bytes, live) = {
                let oplog = open_clean(&fs, config.clone()).await;
                write_mix(&oplog).await;
                assert!(oplog.segment_counts().0 > 3);
                (
                    oplog.lookup(0, 80_000),
                    read_log(&oplog, 0, 80_000).await.unwrap(),
                    oplog.live_bytes(),
                )
            };
            let oplog = open_clean(&fs, config.clone()).await;
            assert_eq!(oplog.lookup(0, 80_000), pieces);
            assert_eq!(read_log(&oplog, 0, 80_000).await.unwrap(), bytes);
            assert_eq!(oplog.live_bytes(), live);
            // Appends continue after the replayed records, and survive another reopen.
            oplog.write(100, pattern(99, 500)).await.unwrap();
            drop(oplog);
            let oplog = open_clean(&fs, config.clone()).await;
            assert_eq!(read_data(&oplog, 100, 500).await, pattern(99, 500).to_vec());
        });
    }

    /// A write that bypasses the log needs a barrier only while a replay could bring back an
    /// older record of its range: until the segment holding that record is freed, drained or
    /// not, and also after a reopen.
    #[test]
    fn replay_may_reach_a_range_until_the_segment_of_its_records_is_freed() {
        run_local(async {
            let fs = fresh(31);
            // Segments of 16 batches: a tail less than half used is not freed when idle.
            let config = config(&log_dir(), 4 * MIB, segment_for_batches(16));
            let oplog = open_clean(&fs, config.clone()).await;
            assert!(!oplog.replay_may_reach(0, MIB), "an empty log");
            oplog.write(8_192, pattern(1, 4_096)).await.unwrap();
            oplog.write_zeroes(40_960, 8_192).await.unwrap();
            assert!(oplog.replay_may_reach(8_192, 4_096));
            assert!(oplog.replay_may_reach(0, 12_288));
            assert!(oplog.replay_may_reach(49_151, 1));
            assert!(
                !oplog.replay_may_reach(0, 8_192),
                "granules no record touches"
            );
            assert!(!oplog.replay_may_reach(12_288, 28_672));
            assert!(!oplog.replay_may_reach(8_192, 0), "an empty range");
            // A barrier brings nothing back.
            oplog.barrier(MIB, MIB).await.unwrap();
            assert!(!oplog.replay_may_reach(MIB, MIB));
            // Drained, the records stay in their segment: a replay would apply them again.
            let mut store = Store::default();
            drain_all(&oplog, &mut store).await;
            assert!(oplog.is_empty());
            assert!(oplog.replay_may_reach(8_192, 4_096));
            drop(oplog);
            let oplog = open_clean(&fs, config.clone()).await;
            assert!(oplog.replay_may_reach(8_192, 4_096), "rebuilt by replay");
            assert!(oplog.replay_may_reach(40_960, 8_192));
            assert!(!oplog.replay_may_reach(0, 8_192));
            // Writes elsewhere fill newer segments; once everything is drained the older
            // segments are freed, and with them what a replay could bring back.
            for i in 0..20 {
                oplog
                    .write(2 * MIB + i * 4_096, pattern(i, 4_096))
                    .await
                    .unwrap();
            }
            drain_all(&oplog, &mut store).await;
            assert!(!oplog.replay_may_reach(0, 2 * MIB));
            assert!(
                oplog.replay_may_reach(2 * MIB + 19 * 4_096, 4_096),
                "the records of the tail, which is kept"
            );
            drop(oplog);
            let oplog = open_clean(&fs, config).await;
            assert!(!oplog.replay_may_reach(0, 2 * MIB), "also after a reopen");
        });
    }

    /// Writes `n` 4 KiB records, one batch each, block `i` holding `pattern(i)`.
    async fn write_blocks<F: Filesystem>(oplog: &Oplog<F>, n: u64) {
        for i in 0..n {
            oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
        }
    }

    async fn check_blocks<F: Filesystem>(oplog: &Oplog<F>, blocks: impl Iterator<Item = u64>) {
        for i in blocks {
            assert_eq!(
                read_data(oplog, i * 4_096, 4_096).await,
                pattern(i, 4_096).to_vec(),
                "block {i}"
            );
        }
    }

    /// A log of 40 one-record batches, 16 per segment; returns the first segment's path.
    async fn forty_batches(fs: &TestFs, config: &OplogConfig) -> PathBuf {
        let oplog = open_clean(fs, config.clone()).await;
        write_blocks(&oplog, 40).await;
        drop(oplog);
        segment_files(fs)[0].clone()
    }

    fn corruption_config() -> OplogConfig {
        config(&log_dir(), 8 * MIB, segment_for_batches(16))
    }

    #[test]
    fn a_rotted_payload_chunk_costs_only_its_range() {
        run_local(async {
            let fs = fresh(7);
            let config = corruption_config();
            let first = forty_batches(&fs, &config).await;
            fs.corrupt(&first, batch_pos(3) + PAYLOAD_AT + 100, 0x40);
            let (oplog, report) = open_report(&fs, config).await;
            assert_eq!(report.lost.len(), 1, "{report:?}");
            let lost = &report.lost[0];
            assert_eq!((lost.offset, lost.length), (3 * 4_096, 4_096));
            assert_eq!(lost.path, first);
            assert_eq!(lost.file_offset, batch_pos(3) + PAYLOAD_AT);
            assert!(report.torn.is_empty());
            assert_eq!(
                kinds(&oplog.lookup(3 * 4_096, 4_096)),
                vec![(3 * 4_096, 4_096, "lost")]
            );
            check_blocks(&oplog, (0..40).filter(|&i| i != 3)).await;
            let mut buf = vec![0u8; 4_096];
            let piece = oplog.lookup(3 * 4_096, 4_096)[0];
            match oplog.read_piece(&piece, &mut buf).await {
                Err(OplogError::Lost {
                    offset,
                    length,
                    path,
                    file_offset,
                    ..
                }) => {
                    assert_eq!(
                        (offset, length, file_offset),
                        (3 * 4_096, 4_096, lost.file_offset)
                    );
                    assert_eq!(path, first);
                }
                other => panic!("expected Lost, got {other:?}"),
            }
            // An overwrite heals the range.
            oplog.write(3 * 4_096, pattern(3, 4_096)).await.unwrap();
            check_blocks(&oplog, 0..40).await;
        });
    }

    #[test]
    fn a_rotted_record_header_costs_only_its_record() {
        run_local(async {
            let fs = fresh(8);
            let config = corruption_config();
            let first = forty_batches(&fs, &config).await;
            fs.corrupt(&first, batch_pos(5) + RECORD_AT + 10, 0x01);
            let (oplog, report) = open_report(&fs, config).await;
            assert_eq!(report.lost.len(), 1, "{report:?}");
            let lost = &report.lost[0];
            assert_eq!((lost.offset, lost.length), (5 * 4_096, 4_096));
            assert_eq!(
                (lost.path.clone(), lost.file_offset),
                (first, batch_pos(5) + RECORD_AT)
            );
            assert!(read_log(&oplog, 5 * 4_096, 4_096)
                .await
                .unwrap()
                .iter()
                .all(|b| *b == LogByte::Lost));
            check_blocks(&oplog, (0..40).filter(|&i| i != 5)).await;
        });
    }

    #[test]
    fn a_rotted_batch_header_is_recovered_from_its_records() {
        run_local(async {
            let fs = fresh(9);
            let config = corruption_config();
            let first = forty_batches(&fs, &config).await;
            // In the fixed part, then (another batch) in the table; also the first batch of
            // the oldest segment, the last batch of a segment and the first of the next one.
            let second = segment_files(&fs)[1].clone();
            fs.corrupt(&first, batch_pos(2) + 20, 0x10);
            fs.corrupt(&first, batch_pos(7) + 72 + 3, 0x10);
            fs.corrupt(&first, batch_pos(0) + 40, 0x01);
            fs.corrupt(&first, batch_pos(15) + 33, 0x01);
            fs.corrupt(&second, batch_pos(0) + 50, 0x01);
            let (oplog, report) = open_report(&fs, config.clone()).await;
            assert!(report.lost.is_empty(), "{report:?}");
            let mut damaged: Vec<(PathBuf, u64)> = report
                .repaired
                .iter()
                .map(|d| (d.path.clone(), d.file_offset))
                .collect();
            damaged.sort();
            assert_eq!(
                damaged,
                vec![
                    (first.clone(), batch_pos(0)),
                    (first.clone(), batch_pos(2)),
                    (first.clone(), batch_pos(7)),
                    (first.clone(), batch_pos(15)),
                    (second.clone(), batch_pos(0)),
                ]
            );
            check_blocks(&oplog, 0..40).await;
            drop(oplog);
            // Both a batch header and its record's header: the record cannot be located.
            fs.corrupt(&first, batch_pos(2) + RECORD_AT + 12, 0x10);
            match Oplog::open(fs.clone(), config).await {
                Err(OplogError::LostUnknownRanges {
                    path, file_offset, ..
                }) => {
                    assert_eq!(path, first);
                    assert_eq!(file_offset, batch_pos(2));
                }
                Err(other) => panic!("expected LostUnknownRanges, got {other}"),
                Ok(_) => panic!("expected LostUnknownRanges, opened"),
            }
        });
    }

    #[test]
    fn a_rotted_segment_header_copy_is_rewritten_from_the_other() {
        run_local(async {
            let fs = fresh(10);
            let config = corruption_config();
            let first = forty_batches(&fs, &config).await;
            fs.corrupt(&first, 24, 0x02);
            let (oplog, report) = open_report(&fs, config.clone()).await;
            assert!(report.lost.is_empty(), "{report:?}");
            assert_eq!(report.repaired.len(), 1);
            assert_eq!(report.repaired[0].path, first);
            assert_eq!(report.repaired[0].file_offset, 0);
            check_blocks(&oplog, 0..40).await;
            drop(oplog);
            // Repaired: the other copy can go now.
            fs.corrupt(&first, 4_096 + 30, 0x02);
            let (oplog, report) = open_report(&fs, config.clone()).await;
            assert_eq!(report.repaired.len(), 1);
            assert_eq!(report.repaired[0].file_offset, 4_096);
            check_blocks(&oplog, 0..40).await;
            drop(oplog);
            // Both copies at once: the file holds batches, so nobody can tell whether they
            // are live.
            fs.corrupt(&first, 8, 0x02);
            fs.corrupt(&first, 4_096 + 8, 0x02);
            assert!(matches!(
                Oplog::open(fs.clone(), config).await,
                Err(OplogError::LostUnknownRanges { .. })
            ));
        });
    }

    #[test]
    fn a_bad_last_batch_is_a_torn_tail_and_is_sealed_off() {
        run_local(async {
            let fs = fresh(11);
            let config = corruption_config();
            let first = {
                let oplog = open_clean(&fs, config.clone()).await;
                write_blocks(&oplog, 5).await;
                segment_files(&fs)[0].clone()
            };
            // The last batch's payload is bad and nothing after it vouches for it: it may
            // have been torn by a crash.
            fs.corrupt(&first, batch_pos(4) + PAYLOAD_AT + 7, 0x08);
            let (oplog, report) = open_report(&fs, config.clone()).await;
            assert!(report.lost.is_empty(), "{report:?}");
            assert_eq!(report.torn.len(), 1);
            assert_eq!(report.torn[0].file_offset, batch_pos(4));
            assert_eq!(report.torn[0].batches, 1);
            check_blocks(&oplog, 0..4).await;
            assert_eq!(
                kinds(&oplog.lookup(4 * 4_096, 4_096)),
                vec![(4 * 4_096, 4_096, "absent")]
            );
            // New batches after the tear do not turn it into "corruption" later: it was
            // sealed off.
            for i in 10..30u64 {
                oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
            }
            drop(oplog);
            let oplog = open_clean(&fs, config.clone()).await;
            check_blocks(&oplog, (0..4).chain(10..30)).await;
            assert_eq!(
                kinds(&oplog.lookup(4 * 4_096, 4_096)),
                vec![(4 * 4_096, 4_096, "absent")]
            );
        });
    }

    /// Four batches written while each other were in flight, then nothing: a bad one among
    /// them is a torn write, and the valid ones after it (never acknowledged: they wait for
    /// it) go with it. With one more batch written alone afterwards (it vouches for all of
    /// them), the same damage is corruption.
    #[test]
    fn a_bad_batch_inside_the_last_window_is_torn_with_the_batches_after_it() {
        for vouched in [false, true] {
            run_local(async move {
                let fs = fresh(31);
                fs.set_yields_range(5, 5);
                let config = corruption_config();
                let oplog = open_clean(&fs, config.clone()).await;
                oplog.idle().await;
                let mut last = None;
                for i in 0..4u64 {
                    last = Some(
                        oplog
                            .try_append(Append::Write {
                                offset: i * 4_096,
                                data: pattern(i, 4_096),
                            })
                            .unwrap(),
                    );
                    // Submit it now, without waiting for it.
                    poll_once(oplog.next_event()).await;
                }
                while oplog.outcome(last.unwrap()).is_none() {
                    oplog.next_event().await;
                }
                let first = segment_files(&fs)[0].clone();
                let windows: Vec<u32> = (0..4)
                    .map(|i| {
                        let bytes = fs.read_file(&first);
                        let at = (batch_pos(i) + 64) as usize;
                        u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
                    })
                    .collect();
                assert_eq!(windows, vec![1, 2, 3, 4], "the four batches overlapped");
                if vouched {
                    fs.set_yields(0);
                    oplog.write(10 * 4_096, pattern(10, 4_096)).await.unwrap();
                }
                drop(oplog);
                fs.corrupt(&first, batch_pos(2) + PAYLOAD_AT + 1, 0x20);
                let (oplog, report) = open_report(&fs, config.clone()).await;
                check_blocks(&oplog, 0..2).await;
                if vouched {
                    assert!(report.torn.is_empty(), "{report:?}");
                    assert_eq!(report.lost.len(), 1);
                    assert_eq!(report.lost[0].offset, 2 * 4_096);
                    check_blocks(&oplog, [3, 10].into_iter()).await;
                } else {
                    assert!(report.lost.is_empty(), "{report:?}");
                    assert_eq!(report.torn.len(), 1);
                    assert_eq!(report.torn[0].file_offset, batch_pos(2));
                    assert_eq!(report.torn[0].batches, 2);
                    for i in 2..4u64 {
                        assert_eq!(kinds(&oplog.lookup(i * 4_096, 4_096))[0].2, "absent");
                    }
                    // Sealed: later writes do not turn the torn batches into corruption.
                    fs.set_yields(0);
                    oplog.write(10 * 4_096, pattern(10, 4_096)).await.unwrap();
                    drop(oplog);
                    let oplog = open_clean(&fs, config).await;
                    check_blocks(&oplog, [0, 1, 10].into_iter()).await;
                }
            });
        }
    }

    /// A process dies while a batch is being written: the batch is complete in the page
    /// cache, not on disk. The next process replays it (durable but unacknowledged) and
    /// writes after it; a power cut must then not tear it (replay makes what it reads durable
    /// first), or it would read as corruption of acknowledged data.
    #[test]
    fn writes_a_dead_process_left_in_the_page_cache_are_made_durable_before_use() {
        for seed in 0..8 {
            run_local(async move {
                let fs = fresh(100 + seed);
                let config = corruption_config();
                let oplog = open_clean(&fs, config.clone()).await;
                write_blocks(&oplog, 3).await;
                // A 12 KiB write (a 16 KiB batch) in flight when the process is killed.
                fs.set_yields_range(10, 10);
                oplog
                    .try_append(Append::Write {
                        offset: 3 * 4_096,
                        data: pattern(3, 12_288),
                    })
                    .unwrap();
                poll_once(oplog.next_event()).await;
                fs.kill_now();
                // The write under way finds the process gone.
                let event = tokio::time::timeout(Duration::from_secs(5), oplog.next_event())
                    .await
                    .expect("the write ends");
                assert!(matches!(event, OplogEvent::Failed { .. }), "{event:?}");
                drop(oplog);
                fs.revive();
                fs.set_yields(0);
                let oplog = open_clean(&fs, config.clone()).await;
                assert_eq!(
                    read_data(&oplog, 3 * 4_096, 12_288).await,
                    pattern(3, 12_288).to_vec(),
                    "the complete batch in the page cache is replayed"
                );
                for i in 10..30u64 {
                    oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
                }
                oplog.idle().await;
                drop(oplog);
                let after = fs.cut_power_now();
                let (oplog, report) = open_report(&after, config).await;
                assert!(report.lost.is_empty(), "seed {seed}: {report:?}");
                check_blocks(&oplog, (0..3).chain(10..30)).await;
            });
        }
    }

    #[test]
    fn a_file_of_another_log_is_refused() {
        run_local(async {
            let fs = fresh(12);
            let config = corruption_config();
            forty_batches(&fs, &config).await;
            let mut other = config.clone();
            other.log_id = 42;
            assert!(matches!(
                Oplog::open(fs.clone(), other).await,
                Err(OplogError::ForeignFile { found, expected: 42, .. }) if found == LOG_ID
            ));
        });
    }

    /// seg1: W1(A), W2(B); seg2: W3(A). Draining only W3 must not free seg2 while seg1 is
    /// live, or replay would bring W1 back over A.
    #[test]
    fn a_segment_is_not_freed_while_an_older_one_is_live() {
        let (a, b) = (0u64, 65_536u64);
        run_local(async {
            let fs = fresh(13);
            let config = config(&log_dir(), 8 * MIB, segment_for_batches(2));
            {
                let oplog = open_clean(&fs, config.clone()).await;
                oplog.write(a, pattern(1, 4_096)).await.unwrap();
                oplog.write(b, pattern(2, 4_096)).await.unwrap();
                oplog.write(a, pattern(3, 4_096)).await.unwrap();
                oplog.idle().await;
                let segments = oplog.segment_counts().0;
                let items = oplog.drain_batch(u64::MAX).await;
                let w3: Vec<_> = items.into_iter().filter(|i| i.offset == a).collect();
                assert_eq!(w3.len(), 1);
                oplog.read_drain_item(&w3[0]).await.unwrap();
                oplog.complete_drain(&w3).await;
                oplog.idle().await;
                assert_eq!(kinds(&oplog.lookup(a, 4_096)), vec![(a, 4_096, "absent")]);
                assert_eq!(
                    oplog.segment_counts().0,
                    segments,
                    "seg2 must survive while seg1 is live"
                );
            }
            let oplog = open_clean(&fs, config.clone()).await;
            // A may come back from the log (W3 was drained but is still there), never as W1.
            let bytes = read_log(&oplog, a, 4_096).await.unwrap();
            if bytes[0] != LogByte::Absent {
                assert_eq!(
                    read_data(&oplog, a, 4_096).await,
                    pattern(3, 4_096).to_vec()
                );
            }
            assert_eq!(
                read_data(&oplog, b, 4_096).await,
                pattern(2, 4_096).to_vec()
            );
            let mut store = Store::default();
            drain_all(&oplog, &mut store).await;
            assert_eq!(store.get(a), Some(pattern(3, 4_096)[0]));
        });
    }

    #[test]
    fn drains_free_segments_oldest_first_and_keep_overwritten_entries() {
        run_local(async {
            let fs = fresh(14);
            // Two 4 KiB records per segment.
            let oplog = open_clean(&fs, config(&log_dir(), 8 * MIB, segment_for_batches(2))).await;
            write_blocks(&oplog, 6).await;
            oplog.idle().await;
            // Three segments written, one ready (`next`).
            assert_eq!(oplog.segment_counts().0, 4);
            let mut store = Store::default();
            let items = oplog.drain_batch(8_192).await;
            assert_eq!(
                items.iter().map(|i| i.offset).collect::<Vec<_>>(),
                vec![0, 4_096],
                "the oldest segment's entries come first"
            );
            // Overwrite one of them while the drain runs: it must stay live.
            oplog.write(4_096, pattern(100, 4_096)).await.unwrap();
            for item in &items {
                let data = oplog.read_drain_item(item).await.unwrap();
                assert_eq!(data, pattern(item.offset / 4_096, 4_096));
                for (i, b) in data.iter().enumerate() {
                    store.bytes.insert(item.offset + i as u64, *b);
                }
            }
            oplog.complete_drain(&items).await;
            oplog.idle().await;
            assert_eq!(
                kinds(&oplog.lookup(0, 8_192)),
                vec![(0, 4_096, "absent"), (4_096, 4_096, "data")]
            );
            assert_eq!(
                read_data(&oplog, 4_096, 4_096).await,
                pattern(100, 4_096).to_vec()
            );
            assert_eq!(
                oplog.segment_counts().0,
                4,
                "segment 1 freed, one more written"
            );
            drain_all(&oplog, &mut store).await;
            assert!(oplog.is_empty());
            for i in 0..6u64 {
                let expected = if i == 1 {
                    pattern(100, 4_096)
                } else {
                    pattern(i, 4_096)
                };
                let got: Vec<u8> = (0..4_096)
                    .map(|b| store.get(i * 4_096 + b).unwrap())
                    .collect();
                assert_eq!(got, expected.to_vec());
            }
        });
    }

    #[test]
    fn superseded_segments_are_freed_without_a_drain() {
        run_local(async {
            let fs = fresh(15);
            // Four segments of two batches.
            let config = config(
                &log_dir(),
                4 * segment_for_batches(2),
                segment_for_batches(2),
            );
            let oplog = open_clean(&fs, config).await;
            for i in 0..40u64 {
                tokio::time::timeout(Duration::from_secs(5), oplog.write(0, pattern(i, 4_096)))
                    .await
                    .expect("a write of superseded data never waits for a drain")
                    .unwrap();
            }
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(39, 4_096).to_vec()
            );
            // Barrier-only traffic never leaves live entries, and must not stall either.
            for i in 0..200u64 {
                tokio::time::timeout(Duration::from_secs(5), oplog.barrier(i * 4_096, 4_096))
                    .await
                    .expect("barriers never wait")
                    .unwrap();
            }
            assert!(oplog.usage_bytes() <= oplog.capacity_bytes());
        });
    }

    #[test]
    fn a_drain_item_stays_readable_after_its_segment_is_freed() {
        run_local(async {
            let fs = fresh(16);
            let config = config(
                &log_dir(),
                3 * segment_for_batches(1),
                segment_for_batches(1),
            );
            let oplog = open_clean(&fs, config).await;
            oplog.write(0, pattern(1, 4_096)).await.unwrap();
            oplog.write(8_192, pattern(2, 4_096)).await.unwrap();
            let items = oplog.drain_batch(4_096).await;
            assert_eq!(items.len(), 1);
            // Supersedes the item: its segment is dead and gets freed.
            oplog.write(0, pattern(3, 4_096)).await.unwrap();
            oplog.idle().await;
            // The next write needs that segment's file, which the drain still reads: it waits
            // for the drain (refused with Full: a drain is wanted).
            assert!(matches!(
                oplog.try_append(Append::Write {
                    offset: 16_384,
                    data: pattern(4, 4_096)
                }),
                Err(TryAppendError::Backpressure(Backpressure::Full))
            ));
            assert!(oplog.needs_drain());
            let writer = {
                let oplog = oplog.clone();
                tokio::task::spawn_local(
                    async move { oplog.write(16_384, pattern(4, 4_096)).await },
                )
            };
            tokio::task::yield_now().await;
            assert!(!writer.is_finished());
            assert_eq!(
                oplog.read_drain_item(&items[0]).await.unwrap(),
                pattern(1, 4_096),
                "the freed segment's file was not reused under the drain"
            );
            oplog.complete_drain(&items).await;
            tokio::time::timeout(Duration::from_secs(5), writer)
                .await
                .expect("the write proceeds once the drain completes")
                .unwrap()
                .unwrap();
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(3, 4_096).to_vec()
            );
            assert_eq!(
                read_data(&oplog, 16_384, 4_096).await,
                pattern(4, 4_096).to_vec()
            );
        });
    }

    #[test]
    fn a_piece_freed_by_a_drain_is_stale() {
        run_local(async {
            let fs = fresh(17);
            let config = config(
                &log_dir(),
                4 * segment_for_batches(1),
                segment_for_batches(1),
            );
            let oplog = open_clean(&fs, config).await;
            oplog.write(0, pattern(1, 4_096)).await.unwrap();
            oplog.write(4_096, pattern(2, 4_096)).await.unwrap();
            let pieces = oplog.lookup(0, 4_096);
            let mut store = Store::default();
            drain_all(&oplog, &mut store).await;
            let mut buf = vec![0u8; 4_096];
            assert!(matches!(
                oplog.read_piece(&pieces[0], &mut buf).await,
                Err(OplogError::Stale { .. })
            ));
            let mut short = vec![0u8; 10];
            assert!(matches!(
                oplog.read_piece(&pieces[0], &mut short).await,
                Err(OplogError::InvalidRange { .. })
            ));
        });
    }

    #[test]
    fn writers_wait_for_space_until_a_drain_frees_it() {
        run_local(async {
            let fs = fresh(18);
            fs.set_yields(2);
            let capacity = 4 * segment_for_batches(2);
            let oplog = open_clean(&fs, config(&log_dir(), capacity, segment_for_batches(2))).await;
            let store = Rc::new(RefCell::new(Store::default()));
            let drains = Rc::new(Cell::new(0));
            let drainer = {
                let (oplog, store, drains) = (oplog.clone(), store.clone(), drains.clone());
                tokio::task::spawn_local(async move {
                    loop {
                        oplog.drain_wanted().await;
                        assert!(oplog.needs_drain());
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        let mut local = std::mem::take(&mut *store.borrow_mut());
                        drain_into(&oplog, &mut local, 3 * 4_096).await;
                        *store.borrow_mut() = local;
                        drains.set(drains.get() + 1);
                    }
                })
            };
            let writers: Vec<_> = (0..40u64)
                .map(|i| {
                    let oplog = oplog.clone();
                    tokio::task::spawn_local(async move {
                        oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
                    })
                })
                .collect();
            for writer in writers {
                tokio::time::timeout(Duration::from_secs(30), writer)
                    .await
                    .expect("writer stuck")
                    .unwrap();
            }
            assert!(drains.get() > 0, "writers never needed a drain");
            drainer.abort();
            for block in 0..40u64 {
                let bytes = read_log(&oplog, block * 4_096, 4_096).await.unwrap();
                let got: Vec<u8> = bytes
                    .iter()
                    .enumerate()
                    .map(|(i, b)| match b {
                        LogByte::Data(b) => *b,
                        LogByte::Absent => store.borrow().get(block * 4_096 + i as u64).unwrap(),
                        other => panic!("{other:?}"),
                    })
                    .collect();
                assert_eq!(got, pattern(block, 4_096).to_vec(), "block {block}");
            }
        });
    }

    #[test]
    fn needs_drain_follows_live_data_and_refused_writers() {
        run_local(async {
            let fs = fresh(19);
            let capacity = 4 * segment_for_batches(4);
            let oplog = open_clean(&fs, config(&log_dir(), capacity, segment_for_batches(4))).await;
            assert!(!oplog.needs_drain());
            let wanted = {
                let oplog = oplog.clone();
                tokio::task::spawn_local(async move { oplog.drain_wanted().await })
            };
            // Writes until the segments in use pass half the capacity.
            let mut i = 0;
            while !oplog.needs_drain() {
                assert!(!wanted.is_finished());
                assert!(oplog.usage_bytes() <= capacity / 2);
                oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
                i += 1;
            }
            assert!(oplog.usage_bytes() > capacity / 2);
            tokio::time::timeout(Duration::from_secs(5), wanted)
                .await
                .expect("drain_wanted")
                .unwrap();
            // Fill the log: appends are refused with Full, never an error.
            loop {
                match oplog.try_append(Append::Write {
                    offset: i * 4_096,
                    data: pattern(i, 4_096),
                }) {
                    Ok(_) => {
                        oplog.idle().await;
                        i += 1;
                    }
                    Err(TryAppendError::Backpressure(Backpressure::Full)) => break,
                    Err(other) => panic!("{other:?}"),
                }
                assert!(i < 100, "the log never filled");
            }
            assert!(oplog.needs_drain());
            let mut store = Store::default();
            drain_into(&oplog, &mut store, 4 * 4_096).await;
            let freed = tokio::time::timeout(Duration::from_secs(5), async {
                loop {
                    if let OplogEvent::SpaceFreed = oplog.next_event().await {
                        return;
                    }
                }
            })
            .await;
            assert!(freed.is_ok(), "a drain frees a segment and says so");
            oplog
                .try_append(Append::Write {
                    offset: i * 4_096,
                    data: pattern(i, 4_096),
                })
                .unwrap();
        });
    }

    /// Fails the batch writes (durable writes past the segment headers) for which `fail` says
    /// so.
    fn fail_batch_writes(fs: &TestFs, fail: impl Fn() -> bool + 'static) {
        fs.set_fault(move |op: &FaultOp| {
            op.kind == OpKind::DurableWrite && op.offset >= FIRST_BATCH && fail()
        });
    }

    #[test]
    fn a_failed_commit_fails_its_writers_then_the_log_recovers_by_itself() {
        run_local(async {
            let fs = fresh(20);
            fs.set_yields(2);
            let config = config(&log_dir(), 8 * MIB, segment_for_batches(16));
            let oplog = open_clean(&fs, config.clone()).await;
            oplog.write(0, pattern(1, 4_096)).await.unwrap();
            let failures = Rc::new(Cell::new(1u32));
            {
                let failures = failures.clone();
                fail_batch_writes(&fs, move || {
                    let left = failures.get();
                    failures.set(left.saturating_sub(1));
                    left > 0
                });
            }
            let handles: Vec<_> = (1..9u64)
                .map(|i| {
                    let oplog = oplog.clone();
                    tokio::task::spawn_local(async move {
                        oplog.write(i * 4_096, pattern(i, 4_096)).await
                    })
                })
                .collect();
            let mut failed = Vec::new();
            for (i, handle) in (1..9u64).zip(handles) {
                match handle.await.unwrap() {
                    Ok(()) => {}
                    Err(OplogError::Io { .. }) => failed.push(i),
                    Err(other) => panic!("expected an I/O error, got {other:?}"),
                }
            }
            assert!(!failed.is_empty(), "the failed batch's writers hear of it");
            // No reopen: the log sealed the failed region off and takes writes again.
            for i in 20..30u64 {
                oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
            }
            check_blocks(&oplog, (1..9).filter(|i| !failed.contains(i))).await;
            for &i in &failed {
                assert_eq!(
                    kinds(&oplog.lookup(i * 4_096, 4_096)),
                    vec![(i * 4_096, 4_096, "absent")],
                    "a failed write is never indexed"
                );
            }
            drop(oplog);
            // Replay neither resurrects the failed batch nor calls it corruption.
            let (oplog, report) = open_report(&fs, config).await;
            assert!(
                report.lost.is_empty() && report.torn.is_empty(),
                "{report:?}"
            );
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(1, 4_096).to_vec()
            );
            check_blocks(&oplog, (1..9).filter(|i| !failed.contains(i)).chain(20..30)).await;
            for &i in &failed {
                assert_eq!(kinds(&oplog.lookup(i * 4_096, 4_096))[0].2, "absent");
            }
        });
    }

    #[test]
    fn a_failing_disk_fails_writes_fast_and_they_succeed_once_it_heals() {
        run_local(async {
            let fs = fresh(21);
            let config = config(&log_dir(), 8 * MIB, segment_for_batches(16));
            let oplog = open_clean(&fs, config.clone()).await;
            oplog.write(0, pattern(1, 4_096)).await.unwrap();
            // Every write past the headers fails: batches and the seals that would recover.
            fail_batch_writes(&fs, || true);
            for i in 1..6u64 {
                let result = tokio::time::timeout(
                    Duration::from_secs(5),
                    oplog.write(i * 4_096, pattern(i, 4_096)),
                )
                .await
                .expect("a failing disk fails writes, it never hangs them");
                assert!(result.is_err(), "write {i} succeeded on a failing disk");
            }
            fs.clear_fault();
            oplog.write(7 * 4_096, pattern(7, 4_096)).await.unwrap();
            oplog.write(8 * 4_096, pattern(8, 4_096)).await.unwrap();
            check_blocks(&oplog, [7, 8].into_iter()).await;
            drop(oplog);
            let (oplog, report) = open_report(&fs, config).await;
            assert!(report.lost.is_empty(), "{report:?}");
            check_blocks(&oplog, [7, 8].into_iter()).await;
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(1, 4_096).to_vec()
            );
        });
    }

    #[test]
    fn failing_segment_header_writes_fail_writers_instead_of_hanging() {
        run_local(async {
            let fs = fresh(29);
            let segment = segment_for_batches(2);
            let config = config(&log_dir(), 3 * segment, segment);
            let oplog = open_clean(&fs, config.clone()).await;
            for i in 0..3u64 {
                oplog.write(0, pattern(i, 4_096)).await.unwrap();
            }
            // Activating and freeing segments (header writes) fails from now on; the same
            // block is rewritten, so segments keep dying and being needed again.
            fs.set_fault(|op: &FaultOp| op.kind == OpKind::DurableWrite && op.offset < FIRST_BATCH);
            let mut errors = 0;
            for i in 10..30u64 {
                let result =
                    tokio::time::timeout(Duration::from_secs(5), oplog.write(0, pattern(i, 4_096)))
                        .await
                        .expect("a failing disk fails writes, it never hangs them");
                if let Err(error) = result {
                    assert!(matches!(error, OplogError::Io { .. }), "{error:?}");
                    errors += 1;
                }
            }
            assert!(errors > 0, "writes kept succeeding without new segments");
            fs.clear_fault();
            for i in 100..120u64 {
                oplog.write(0, pattern(i, 4_096)).await.unwrap();
            }
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(119, 4_096).to_vec()
            );
            drop(oplog);
            let oplog = open_clean(&fs, config).await;
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(119, 4_096).to_vec()
            );
        });
    }

    #[test]
    fn no_space_reaches_the_writer_and_writes_resume_once_space_is_freed() {
        run_local(async {
            let fs = fresh(22);
            let segment = segment_for_batches(4);
            let config = config(&log_dir(), 8 * segment, segment);
            let filler = PathBuf::from("/fast/filler");
            fs.set_capacity(Some(3 * segment));
            let oplog = open_clean(&fs, config.clone()).await;
            oplog.idle().await;
            // Two segments prepared (tail and next); fill the rest of the disk.
            fs.write_file(
                &filler,
                &vec![0u8; (3 * segment - fs.used_bytes()) as usize],
            );
            let mut result = Ok(());
            for i in 0..20u64 {
                result = oplog.write(i * 4_096, pattern(i, 4_096)).await;
                if result.is_err() {
                    break;
                }
            }
            assert!(
                matches!(result, Err(OplogError::NoSpace { .. })),
                "expected NoSpace, got {result:?}"
            );
            assert!(matches!(
                oplog.write(100 * 4_096, pattern(100, 4_096)).await,
                Err(OplogError::NoSpace { .. })
            ));
            fs.remove_file(&filler).await.unwrap();
            oplog.write(100 * 4_096, pattern(100, 4_096)).await.unwrap();
            check_blocks(&oplog, [100].into_iter()).await;
        });
    }

    /// Review 4.1 d: drain everything, reopen, write, reopen. Sequence numbers never go back,
    /// and a reused file's old batches never come back.
    #[test]
    fn sequence_numbers_never_go_back() {
        run_local(async {
            let fs = fresh(23);
            // One segment holds the three records with room to spare.
            let config = config(
                &log_dir(),
                4 * segment_for_batches(4),
                segment_for_batches(4),
            );
            let mut store = Store::default();
            let last = {
                let oplog = open_clean(&fs, config.clone()).await;
                let mut last = None;
                for i in 0..3u64 {
                    let seq = oplog
                        .try_append(Append::Write {
                            offset: i * 4_096,
                            data: pattern(i, 4_096),
                        })
                        .unwrap();
                    oplog.idle().await;
                    last = Some(seq);
                }
                drain_all(&oplog, &mut store).await;
                assert!(oplog.is_empty());
                last.unwrap()
            };
            let oplog = open_clean(&fs, config.clone()).await;
            assert!(
                oplog.is_empty(),
                "drained records whose segment was freed stay gone"
            );
            let seq = oplog
                .try_append(Append::Write {
                    offset: 0,
                    data: pattern(50, 4_096),
                })
                .unwrap();
            assert!(seq > last, "{seq} after {last}");
            oplog.idle().await;
            drop(oplog);
            let oplog = open_clean(&fs, config.clone()).await;
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(50, 4_096).to_vec()
            );
            for i in 1..3u64 {
                assert_eq!(
                    kinds(&oplog.lookup(i * 4_096, 4_096)),
                    vec![(i * 4_096, 4_096, "absent")],
                    "a stale record of block {i} came back"
                );
            }
            // Every file reused several times over: still nothing stale, numbers still rise.
            let mut previous = seq;
            for round in 0..6u64 {
                for i in 0..3u64 {
                    oplog
                        .write(i * 4_096, pattern(round * 10 + i, 4_096))
                        .await
                        .unwrap();
                }
                drain_all(&oplog, &mut store).await;
                let seq = oplog
                    .try_append(Append::Zero {
                        offset: 1 << 30,
                        length: 1,
                    })
                    .unwrap();
                assert!(seq > previous);
                previous = seq;
                oplog.idle().await;
            }
            drop(oplog);
            let oplog = open_clean(&fs, config).await;
            let seq = oplog
                .try_append(Append::Zero {
                    offset: 0,
                    length: 1,
                })
                .unwrap();
            assert!(seq > previous, "{seq} after {previous}");
            // A drained record whose segment was not freed may come back (rule 2), but only
            // as the newest data of its block, never an older round's from a reused file.
            for i in 0..3u64 {
                match read_log(&oplog, i * 4_096, 4_096).await.unwrap()[0] {
                    LogByte::Absent => {}
                    LogByte::Data(_) => assert_eq!(
                        read_data(&oplog, i * 4_096, 4_096).await,
                        pattern(50 + i, 4_096).to_vec(),
                        "block {i} came back stale"
                    ),
                    other => panic!("block {i} reads as {other:?}"),
                }
            }
        });
    }

    #[test]
    fn lost_ranges_drain_as_lost_and_free_their_segment() {
        run_local(async {
            let fs = fresh(24);
            let config = corruption_config();
            let first = forty_batches(&fs, &config).await;
            fs.corrupt(&first, batch_pos(1) + PAYLOAD_AT + 904, 0x01);
            let (oplog, report) = open_report(&fs, config.clone()).await;
            assert_eq!(report.lost.len(), 1);
            let mut store = Store::default();
            let items = oplog.drain_batch(u64::MAX).await;
            let lost: Vec<_> = items.iter().filter(|i| i.kind == DrainKind::Lost).collect();
            assert_eq!(lost.len(), 1);
            assert_eq!((lost[0].offset, lost[0].length), (4_096, 4_096));
            match oplog.read_drain_item(lost[0]).await {
                Err(error) => assert_eq!(error.lost_range(), Some((4_096, 4_096))),
                Ok(_) => panic!("a lost item read as data"),
            }
            drain_all(&oplog, &mut store).await;
            assert!(oplog.is_empty());
            assert!(store.lost.contains_key(&4_096));
            assert_eq!(store.get(0), Some(pattern(0, 4_096)[0]));
            // The drain freed the damaged segment like any other.
            drop(oplog);
            assert!(!segment_files(&fs).is_empty());
            let (oplog, report) = open_report(&fs, config).await;
            assert!(report.lost.is_empty(), "{report:?}");
            assert!(oplog.is_empty());
        });
    }

    #[test]
    fn a_checksum_mismatch_found_by_a_read_carries_its_range() {
        run_local(async {
            let fs = fresh(25);
            let config = corruption_config();
            let oplog = open_clean(&fs, config).await;
            write_blocks(&oplog, 3).await;
            let first = segment_files(&fs)[0].clone();
            fs.corrupt(&first, batch_pos(1) + PAYLOAD_AT + 9, 0x80);
            match read_log(&oplog, 4_096 + 100, 50).await {
                Err(OplogError::ChecksumMismatch {
                    offset,
                    length,
                    path,
                    file_offset,
                    ..
                }) => {
                    assert_eq!((offset, length), (4_196, 50));
                    assert_eq!((path, file_offset), (first, batch_pos(1) + PAYLOAD_AT));
                }
                other => panic!("expected ChecksumMismatch, got {other:?}"),
            }
            let items = oplog.drain_batch(u64::MAX).await;
            let bad = items.iter().find(|i| i.offset == 4_096).unwrap();
            let error = oplog.read_drain_item(bad).await.unwrap_err();
            assert_eq!(error.lost_range(), Some((4_096, 4_096)));
        });
    }

    /// Encodes a version 1/2 record (header, chunk CRCs, payload).
    fn v2_record(kind: u8, seq: u64, offset: u64, payload: &[u8], length: u32) -> Vec<u8> {
        let chunks = if kind == 1 { length.div_ceil(4096) } else { 0 };
        let mut out = Vec::new();
        out.extend_from_slice(b"AOPL");
        out.push(1);
        out.push(kind);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        out.extend_from_slice(&length.to_le_bytes());
        out.extend_from_slice(&chunks.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
        let crc = crc32c::crc32c(&out[..36]);
        out.extend_from_slice(&crc.to_le_bytes());
        if kind == 1 {
            for chunk in payload.chunks(4096) {
                out.extend_from_slice(&crc32c::crc32c(chunk).to_le_bytes());
            }
            out.extend_from_slice(payload);
        }
        out
    }

    #[test]
    fn a_version_2_log_is_replayed_read_only_then_drained_and_destroyed() {
        run_local(async {
            let fs = fresh(26);
            let dir = log_dir();
            let mut seg1 = v2_record(1, 1, 0, &pattern(1, 5_000), 5_000);
            seg1.extend(v2_record(2, 2, 10_000, &[], 3_000));
            let seg3 = v2_record(1, 3, 1_000, &pattern(3, 2_000), 2_000);
            fs.write_file(&dir.join("00000000000000000001.oplog"), &seg1);
            fs.write_file(&dir.join("00000000000000000003.oplog"), &seg3);
            fs.write_file(&dir.join("spare-00000000000000000001.oplog"), &[7u8; 100]);
            let (oplog, report) = open_report(&fs, config(&dir, 8 * MIB, MIB)).await;
            assert_eq!(report.legacy_version, Some(2));
            let mut expected = pattern(1, 5_000).to_vec();
            expected[1_000..3_000].copy_from_slice(&pattern(3, 2_000));
            assert_eq!(read_data(&oplog, 0, 5_000).await, expected);
            assert_eq!(
                kinds(&oplog.lookup(10_000, 3_000)),
                vec![(10_000, 3_000, "zero")]
            );
            assert!(matches!(
                oplog.write(0, pattern(9, 10)).await,
                Err(OplogError::ReadOnly { version: 2, .. })
            ));
            let mut store = Store::default();
            drain_all(&oplog, &mut store).await;
            assert!(oplog.is_empty());
            assert_eq!(store.get(1_000), Some(pattern(3, 2_000)[0]));
            assert_eq!(store.get(0), Some(pattern(1, 5_000)[0]));
            assert_eq!(
                fs.file_names(&dir),
                vec!["spare-00000000000000000001.oplog".to_string()],
                "drained version 2 segments are deleted oldest first"
            );
            oplog.destroy().await.unwrap();
            assert!(!fs.exists(&dir).await.unwrap());
        });
    }

    #[test]
    fn destroy_needs_an_empty_log_and_removes_the_directory() {
        run_local(async {
            let fs = fresh(27);
            let dir = log_dir();
            let oplog = open_clean(&fs, config(&dir, 8 * MIB, MIB)).await;
            oplog.write(0, pattern(1, 100)).await.unwrap();
            assert!(matches!(
                oplog.clone().destroy().await,
                Err(OplogError::NotEmpty {
                    live_bytes: 100,
                    ..
                })
            ));
            let mut store = Store::default();
            drain_all(&oplog, &mut store).await;
            oplog.destroy().await.unwrap();
            assert!(!fs.exists(&dir).await.unwrap());
            assert!(fs.exists(Path::new("/fast/oplog")).await.unwrap());
        });
    }

    #[test]
    fn a_changed_segment_size_is_taken_at_reopen() {
        run_local(async {
            let fs = fresh(30);
            let small = config(
                &log_dir(),
                8 * segment_for_batches(2),
                segment_for_batches(2),
            );
            let large = config(
                &log_dir(),
                8 * segment_for_batches(8),
                segment_for_batches(8),
            );
            {
                let oplog = open_clean(&fs, small.clone()).await;
                write_blocks(&oplog, 5).await;
            }
            let oplog = open_clean(&fs, large.clone()).await;
            check_blocks(&oplog, 0..5).await;
            for i in 5..30u64 {
                oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
            }
            let mut store = Store::default();
            drain_all(&oplog, &mut store).await;
            oplog.write(0, pattern(77, 4_096)).await.unwrap();
            oplog.idle().await;
            drop(oplog);
            let oplog = open_clean(&fs, large).await;
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(77, 4_096).to_vec()
            );
            for path in segment_files(&fs) {
                assert_eq!(
                    fs.read_file(&path).len() as u64,
                    segment_for_batches(8),
                    "files of the old size are gone once freed"
                );
            }
        });
    }

    #[test]
    fn bad_configurations_are_refused() {
        run_local(async {
            let fs = fresh(28);
            let good = config(&log_dir(), 8 * MIB, MIB);
            type Change = Box<dyn Fn(&mut OplogConfig)>;
            let cases: Vec<Change> = vec![
                Box::new(|c| c.segment_bytes = 1_000_000),
                Box::new(|c| c.segment_bytes = 16 * 1024),
                Box::new(|c| c.capacity_bytes = c.segment_bytes),
                Box::new(|c| c.max_batch_bytes = c.segment_bytes),
                Box::new(|c| c.max_batch_bytes = 4_096),
                Box::new(|c| c.max_batches_in_flight = 0),
                Box::new(|c| c.max_spare_segments = 0),
            ];
            for (i, change) in cases.iter().enumerate() {
                let mut config = good.clone();
                change(&mut config);
                assert!(
                    matches!(
                        Oplog::open(fs.clone(), config).await,
                        Err(OplogError::InvalidConfig { .. })
                    ),
                    "case {i}"
                );
            }
            let defaults = OplogConfig::new("/x", 1, 256 * MIB);
            assert_eq!(defaults.segment_bytes, 32 * MIB);
            assert_eq!(defaults.max_batch_bytes, 4 * MIB);
            assert_eq!(defaults.max_segments(), 8);
            assert!(defaults.max_write_bytes() >= 4 * MIB - 8192);
        });
    }
}
