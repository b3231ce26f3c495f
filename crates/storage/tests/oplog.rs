//! Oplog behaviour: reads, coalescing, group commit, replay, torn tails, corruption, drains,
//! backpressure and failure. Tests live in `mod oplog` so `cargo test oplog` selects them.

mod oplog_support;

mod oplog {
    use super::oplog_support::*;
    use ashlar_storage::disk::StdOpener;
    use ashlar_storage::oplog::{LogPiece, Oplog, OplogConfig, OplogError, PieceSource};
    use bytes::Bytes;
    use std::cell::RefCell;
    use std::collections::BTreeMap;
    use std::io::Write;
    use std::path::Path;
    use std::rc::Rc;
    use std::time::Duration;

    const MIB: u64 = 1 << 20;

    async fn open(dir: &Path) -> Oplog<StdOpener> {
        Oplog::open(StdOpener, OplogConfig::new(dir, 64 * MIB))
            .await
            .expect("open")
    }

    async fn open_with(dir: &Path, capacity: u64, segment: u64) -> Oplog<StdOpener> {
        Oplog::open(StdOpener, config(dir, capacity, segment))
            .await
            .expect("open")
    }

    fn kinds(pieces: &[LogPiece]) -> Vec<(u64, u64, &'static str)> {
        pieces
            .iter()
            .map(|p| {
                let kind = match p.source {
                    PieceSource::Data { .. } => "data",
                    PieceSource::Zero => "zero",
                    PieceSource::Absent => "absent",
                };
                (p.offset, p.length, kind)
            })
            .collect()
    }

    /// Simulates the engine's drain into a byte-map "extent store".
    async fn drain_into(
        oplog: &Oplog<StdOpener>,
        store: &mut BTreeMap<u64, u8>,
        max_bytes: u64,
    ) -> usize {
        let items = oplog.drain_batch(max_bytes);
        for item in &items {
            let data = oplog.read_drain_item(item).await.expect("read drain item");
            assert_eq!(data.len() as u64, item.length);
            if item.zero {
                assert!(data.iter().all(|&b| b == 0));
            }
            for (i, b) in data.iter().enumerate() {
                store.insert(item.offset + i as u64, *b);
            }
        }
        oplog.complete_drain(&items).await.expect("complete drain");
        items.len()
    }

    #[test]
    fn write_then_read_returns_the_data() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open(dir.path()).await;
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
        });
    }

    #[test]
    fn overlapping_writes_coalesce_to_the_newest_pieces() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open(dir.path()).await;
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
            // A write covering everything leaves one piece.
            let d = pattern(4, 30_000);
            oplog.write(0, d.clone()).await.unwrap();
            assert_eq!(kinds(&oplog.lookup(0, 30_000)), vec![(0, 30_000, "data")]);
            assert_eq!(read_data(&oplog, 0, 30_000).await, d.to_vec());
        });
    }

    #[test]
    fn zero_and_barrier_records() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open(dir.path()).await;
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
            // A barrier over everything empties the index.
            oplog.barrier(0, 1 << 30).await.unwrap();
            assert!(oplog.is_empty());
            assert_eq!(oplog.live_bytes(), 0);
            // Zero ranges larger than one record can hold are split.
            oplog.write_zeroes(0, 5 << 30).await.unwrap();
            assert_eq!(oplog.live_bytes(), 5 << 30);
            assert!(oplog
                .lookup(0, 5 << 30)
                .iter()
                .all(|p| p.source == PieceSource::Zero));
        });
    }

    #[test]
    fn concurrent_writes_share_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let opener = CountingOpener::default();
        let faults = opener.faults.clone();
        run_local(async move {
            let oplog = Oplog::open(opener, OplogConfig::new(dir.path(), 64 * MIB))
                .await
                .unwrap();
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
            let syncs = faults.syncs.get();
            assert!(syncs <= 4, "64 concurrent writes took {syncs} syncs");
            for i in 0..64u64 {
                assert_eq!(
                    read_data(&oplog, i * 8_192, 8_192).await,
                    pattern(i, 8_192).to_vec()
                );
            }
        });
    }

    #[test]
    fn commit_batches_respect_their_size_limit() {
        let dir = tempfile::tempdir().unwrap();
        let opener = CountingOpener::default();
        let faults = opener.faults.clone();
        run_local(async move {
            let mut config = OplogConfig::new(dir.path(), 64 * MIB);
            config.max_commit_batch_bytes = 3 * RECORD_4K as usize;
            let oplog = Oplog::open(opener, config).await.unwrap();
            let handles: Vec<_> = (0..30u64)
                .map(|i| {
                    let oplog = oplog.clone();
                    tokio::task::spawn_local(async move {
                        oplog.write(i * 4_096, pattern(i, 4_096)).await
                    })
                })
                .collect();
            for handle in handles {
                handle.await.unwrap().unwrap();
            }
            // At most 3 records per commit: at least 10 syncs.
            assert!(faults.syncs.get() >= 10, "{} syncs", faults.syncs.get());
            for i in 0..30u64 {
                assert_eq!(
                    read_data(&oplog, i * 4_096, 4_096).await,
                    pattern(i, 4_096).to_vec()
                );
            }
        });
    }

    /// Writes a mix of overlapping records across many small segments.
    async fn write_mix(oplog: &Oplog<StdOpener>) {
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
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let (pieces, bytes, usage, live) = {
                let oplog = open_with(dir.path(), 64 * MIB, 16_384).await;
                write_mix(&oplog).await;
                (
                    oplog.lookup(0, 80_000),
                    read_log(&oplog, 0, 80_000).await.unwrap(),
                    oplog.usage_bytes(),
                    oplog.live_bytes(),
                )
            };
            assert!(segment_files(dir.path()).len() > 3);
            let oplog = open_with(dir.path(), 64 * MIB, 16_384).await;
            assert_eq!(oplog.lookup(0, 80_000), pieces);
            assert_eq!(read_log(&oplog, 0, 80_000).await.unwrap(), bytes);
            // Segments holding only superseded records may be freed at open.
            assert!(oplog.usage_bytes() <= usage);
            assert_eq!(oplog.live_bytes(), live);
            // Appends continue after the replayed records, and survive another reopen.
            oplog.write(100, pattern(99, 500)).await.unwrap();
            drop(oplog);
            let oplog = open_with(dir.path(), 64 * MIB, 16_384).await;
            assert_eq!(read_data(&oplog, 100, 500).await, pattern(99, 500).to_vec());
        });
    }

    fn last_segment(dir: &Path) -> std::path::PathBuf {
        segment_files(dir).pop().expect("a segment")
    }

    #[test]
    fn torn_tail_is_cut_off_and_appends_continue() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            {
                let oplog = open_with(dir.path(), 64 * MIB, MIB).await;
                oplog.write(0, pattern(1, 5_000)).await.unwrap();
                oplog.write(10_000, pattern(2, 5_000)).await.unwrap();
                oplog.write(20_000, pattern(3, 5_000)).await.unwrap();
            }
            // Cut the last record in the middle of its payload.
            let last = last_segment(dir.path());
            let len = std::fs::metadata(&last).unwrap().len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&last)
                .unwrap()
                .set_len(len - 2_000)
                .unwrap();

            let oplog = open_with(dir.path(), 64 * MIB, MIB).await;
            assert_eq!(
                read_data(&oplog, 0, 5_000).await,
                pattern(1, 5_000).to_vec()
            );
            assert_eq!(
                read_data(&oplog, 10_000, 5_000).await,
                pattern(2, 5_000).to_vec()
            );
            assert_eq!(
                kinds(&oplog.lookup(20_000, 5_000)),
                vec![(20_000, 5_000, "absent")]
            );
            oplog.write(20_000, pattern(4, 5_000)).await.unwrap();
            drop(oplog);
            // The cut segment is no longer the last one, and must now be valid.
            assert_eq!(segment_files(dir.path()).len(), 2);
            let oplog = open_with(dir.path(), 64 * MIB, MIB).await;
            assert_eq!(
                read_data(&oplog, 10_000, 5_000).await,
                pattern(2, 5_000).to_vec()
            );
            assert_eq!(
                read_data(&oplog, 20_000, 5_000).await,
                pattern(4, 5_000).to_vec()
            );
        });
    }

    #[test]
    fn garbage_after_the_last_record_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            {
                let oplog = open(dir.path()).await;
                oplog.write(0, pattern(1, 3_000)).await.unwrap();
                oplog.write_zeroes(3_000, 3_000).await.unwrap();
            }
            let last = last_segment(dir.path());
            let clean_len = std::fs::metadata(&last).unwrap().len();
            let mut file = std::fs::OpenOptions::new()
                .append(true)
                .open(&last)
                .unwrap();
            file.write_all(&[0x41; 100]).unwrap();
            drop(file);

            let oplog = open(dir.path()).await;
            assert_eq!(
                std::fs::metadata(&last).unwrap().len(),
                clean_len,
                "garbage truncated"
            );
            assert_eq!(
                read_data(&oplog, 0, 3_000).await,
                pattern(1, 3_000).to_vec()
            );
            assert_eq!(
                kinds(&oplog.lookup(3_000, 3_000)),
                vec![(3_000, 3_000, "zero")]
            );
            oplog.write(6_000, pattern(2, 100)).await.unwrap();
            drop(oplog);
            let oplog = open(dir.path()).await;
            assert_eq!(
                read_data(&oplog, 6_000, 100).await,
                pattern(2, 100).to_vec()
            );
        });
    }

    #[test]
    fn a_torn_first_record_leaves_an_empty_reusable_segment() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            {
                let oplog = open(dir.path()).await;
                oplog.write(0, pattern(1, 3_000)).await.unwrap();
            }
            let last = last_segment(dir.path());
            std::fs::OpenOptions::new()
                .write(true)
                .open(&last)
                .unwrap()
                .set_len(20)
                .unwrap();
            let oplog = open(dir.path()).await;
            assert!(oplog.is_empty());
            oplog.write(0, pattern(2, 3_000)).await.unwrap();
            drop(oplog);
            let oplog = open(dir.path()).await;
            assert_eq!(
                read_data(&oplog, 0, 3_000).await,
                pattern(2, 3_000).to_vec()
            );
        });
    }

    #[test]
    fn a_corrupt_payload_byte_is_reported_not_returned() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open_with(dir.path(), 64 * MIB, 16_384).await;
            oplog.write(0, pattern(1, 10_000)).await.unwrap();
            oplog.write(20_000, pattern(2, 10_000)).await.unwrap(); // second segment
            let first = segment_files(dir.path())[0].clone();
            // Flip a byte in the third chunk of the first record's payload.
            let at = 40 + 3 * 4 + 8_192 + 5;
            let mut bytes = std::fs::read(&first).unwrap();
            bytes[at] ^= 0xFF;
            std::fs::write(&first, &bytes).unwrap();

            let pieces = oplog.lookup(0, 10_000);
            let mut buf = vec![0u8; 10_000];
            match oplog.read_piece(&pieces[0], &mut buf).await {
                Err(OplogError::Corrupt {
                    path, file_offset, ..
                }) => {
                    assert_eq!(path, first);
                    assert_eq!(file_offset, 40 + 12 + 8_192);
                }
                other => panic!("expected Corrupt, got {other:?}"),
            }
            // Chunks that are intact still read.
            assert_eq!(
                read_data(&oplog, 0, 8_192).await,
                pattern(1, 10_000)[..8_192].to_vec()
            );
            drop(oplog);

            // The damaged segment is not the last one: replay keeps it, reads report it.
            let oplog = open_with(dir.path(), 64 * MIB, 16_384).await;
            assert!(matches!(
                read_log(&oplog, 8_000, 500).await,
                Err(OplogError::Corrupt { .. })
            ));
            let items = oplog.drain_batch(u64::MAX);
            let bad = items.iter().find(|i| i.offset == 0).unwrap();
            assert!(matches!(
                oplog.read_drain_item(bad).await,
                Err(OplogError::Corrupt { .. })
            ));
        });
    }

    #[test]
    fn a_bad_header_in_an_older_segment_is_corruption() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            {
                let oplog = open_with(dir.path(), 64 * MIB, 16_384).await;
                oplog.write(0, pattern(1, 10_000)).await.unwrap();
                oplog.write(20_000, pattern(2, 10_000)).await.unwrap();
            }
            let first = segment_files(dir.path())[0].clone();
            let mut bytes = std::fs::read(&first).unwrap();
            bytes[10] ^= 1; // inside the seq field: header CRC mismatch
            std::fs::write(&first, &bytes).unwrap();
            match Oplog::open(StdOpener, config(dir.path(), 64 * MIB, 16_384)).await {
                Err(OplogError::Corrupt {
                    path,
                    file_offset: 0,
                    ..
                }) => assert_eq!(path, first),
                Err(other) => panic!("expected Corrupt, got {other}"),
                Ok(_) => panic!("expected Corrupt, opened"),
            }
        });
    }

    #[test]
    fn a_missing_middle_segment_is_corruption() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            {
                let oplog = open_with(dir.path(), 64 * MIB, 8_000).await;
                for i in 0..3u64 {
                    oplog.write(i * 10_000, pattern(i, 5_000)).await.unwrap();
                }
            }
            let files = segment_files(dir.path());
            assert_eq!(files.len(), 3);
            std::fs::remove_file(&files[1]).unwrap();
            assert!(matches!(
                Oplog::open(StdOpener, config(dir.path(), 64 * MIB, 8_000)).await,
                Err(OplogError::Corrupt { .. })
            ));
        });
    }

    #[test]
    fn drains_free_segments_oldest_first_and_keep_overwritten_entries() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            // Two 4 KiB records per segment.
            let oplog = open_with(dir.path(), 64 * MIB, 2 * RECORD_4K).await;
            for i in 0..6u64 {
                oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
            }
            assert_eq!(segment_ids(dir.path()), vec![1, 3, 5]);
            let mut store = BTreeMap::new();

            // The oldest segment's entries come first.
            let items = oplog.drain_batch(8_192);
            assert_eq!(
                items.iter().map(|i| i.offset).collect::<Vec<_>>(),
                vec![0, 4_096]
            );
            // Overwrite one of them while the drain runs: it must stay live.
            oplog.write(4_096, pattern(100, 4_096)).await.unwrap();
            for item in &items {
                let data = oplog.read_drain_item(item).await.unwrap();
                assert_eq!(data, pattern(item.offset / 4_096, 4_096));
                for (i, b) in data.iter().enumerate() {
                    store.insert(item.offset + i as u64, *b);
                }
            }
            oplog.complete_drain(&items).await.unwrap();
            assert_eq!(
                kinds(&oplog.lookup(0, 8_192)),
                vec![(0, 4_096, "absent"), (4_096, 4_096, "data")]
            );
            assert_eq!(
                read_data(&oplog, 4_096, 4_096).await,
                pattern(100, 4_096).to_vec()
            );
            assert_eq!(
                segment_ids(dir.path()),
                vec![3, 5, 7],
                "segment 1 freed, nothing else"
            );
            assert_eq!(oplog.usage_bytes(), 5 * RECORD_4K);

            while drain_into(&oplog, &mut store, 4_096).await > 0 {}
            assert!(oplog.is_empty());
            assert_eq!(oplog.usage_bytes(), 0);
            assert!(segment_files(dir.path()).is_empty());
            for i in 0..6u64 {
                let expected = if i == 1 {
                    pattern(100, 4_096)
                } else {
                    pattern(i, 4_096)
                };
                let got: Vec<u8> = (0..4_096).map(|b| store[&(i * 4_096 + b)]).collect();
                assert_eq!(got, expected.to_vec());
            }
            // Writes after a full drain start a new segment.
            oplog.write(0, pattern(7, 10)).await.unwrap();
            assert_eq!(segment_ids(dir.path()), vec![8]);
        });
    }

    /// Freed segments become spares and new segments reuse them; the stale records left in
    /// a reused file (behind the new ones, in the last and in older segments) never come back
    /// at replay, and a bad header in an older reused segment is still reported.
    #[test]
    fn reused_segment_files_replay_only_their_new_records() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let mut store = BTreeMap::new();
            {
                // Four 4 KiB records per segment.
                let oplog = open_with(dir.path(), 64 * MIB, 4 * RECORD_4K).await;
                for i in 0..12u64 {
                    oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
                }
                while drain_into(&oplog, &mut store, 4_096).await > 0 {}
                assert!(segment_files(dir.path()).is_empty());
                assert_eq!(
                    spare_files(dir.path()).len(),
                    2,
                    "two spares kept, one deleted"
                );
                // New records go into the spares: fewer records than the old files held, so
                // stale records follow them.
                for i in 0..6u64 {
                    oplog
                        .write(i * 4_096, pattern(100 + i, 4_096))
                        .await
                        .unwrap();
                }
                assert!(spare_files(dir.path()).is_empty(), "both spares reused");
                assert_eq!(segment_files(dir.path()).len(), 2);
                // Same length as before: the file was reused, not recreated.
                let first = &segment_files(dir.path())[0];
                assert_eq!(std::fs::metadata(first).unwrap().len(), 4 * RECORD_4K);
            }
            let oplog = open_with(dir.path(), 64 * MIB, 4 * RECORD_4K).await;
            for i in 0..6u64 {
                assert_eq!(
                    read_data(&oplog, i * 4_096, 4_096).await,
                    pattern(100 + i, 4_096).to_vec(),
                    "block {i}"
                );
            }
            for i in 6..12u64 {
                assert_eq!(
                    kinds(&oplog.lookup(i * 4_096, 4_096)),
                    vec![(i * 4_096, 4_096, "absent")],
                    "stale record of block {i} came back"
                );
            }
            assert_eq!(oplog.live_bytes(), 6 * 4_096);
            oplog.write(0, pattern(200, 4_096)).await.unwrap();
            drop(oplog);
            let oplog = open_with(dir.path(), 64 * MIB, 4 * RECORD_4K).await;
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(200, 4_096).to_vec()
            );
            assert_eq!(
                read_data(&oplog, 4_096, 4_096).await,
                pattern(101, 4_096).to_vec()
            );
            drop(oplog);

            // Damage the header of the first segment's second record: the records after it
            // are lost, which the next segment's first sequence number gives away.
            let first = segment_files(dir.path())[0].clone();
            let mut bytes = std::fs::read(&first).unwrap();
            bytes[RECORD_4K as usize + 10] ^= 1;
            std::fs::write(&first, &bytes).unwrap();
            match Oplog::open(StdOpener, config(dir.path(), 64 * MIB, 4 * RECORD_4K)).await {
                Err(OplogError::Corrupt {
                    path, file_offset, ..
                }) => {
                    assert_eq!(path, first);
                    assert_eq!(file_offset, RECORD_4K);
                }
                Err(other) => panic!("expected Corrupt, got {other}"),
                Ok(_) => panic!("expected Corrupt, opened"),
            }
        });
    }

    /// seg1: W1(A), W2(B); seg2: W3(A). Draining only W3 must not free seg2 while seg1 is
    /// live, or replay would bring W1 back over A.
    #[test]
    fn a_segment_is_not_freed_while_an_older_one_is_live() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (0u64, 65_536u64);
        run_local(async {
            {
                let oplog = open_with(dir.path(), 64 * MIB, 2 * RECORD_4K).await;
                oplog.write(a, pattern(1, 4_096)).await.unwrap();
                oplog.write(b, pattern(2, 4_096)).await.unwrap();
                oplog.write(a, pattern(3, 4_096)).await.unwrap();
                assert_eq!(segment_ids(dir.path()), vec![1, 3]);
                let items = oplog.drain_batch(u64::MAX);
                let w3: Vec<_> = items.into_iter().filter(|i| i.offset == a).collect();
                assert_eq!(w3.len(), 1);
                oplog.read_drain_item(&w3[0]).await.unwrap();
                oplog.complete_drain(&w3).await.unwrap();
                assert_eq!(kinds(&oplog.lookup(a, 4_096)), vec![(a, 4_096, "absent")]);
                assert_eq!(
                    segment_ids(dir.path()),
                    vec![1, 3],
                    "seg2 must survive while seg1 is live"
                );
            }
            let oplog = open_with(dir.path(), 64 * MIB, 2 * RECORD_4K).await;
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
            // Draining everything frees both, oldest first.
            let mut store = BTreeMap::new();
            while drain_into(&oplog, &mut store, u64::MAX).await > 0 {}
            assert!(segment_files(dir.path()).is_empty());
            assert_eq!(store[&a], pattern(3, 4_096)[0]);
        });
    }

    #[test]
    fn superseded_segments_are_freed_without_a_drain_when_space_is_needed() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            // Room for four records, one per segment; rewrite the same block over and over.
            let oplog = open_with(dir.path(), 4 * RECORD_4K, RECORD_4K).await;
            for i in 0..20u64 {
                oplog.write(0, pattern(i, 4_096)).await.unwrap();
                assert!(oplog.usage_bytes() <= 4 * RECORD_4K);
            }
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(19, 4_096).to_vec()
            );
            // Barrier-only traffic never leaves live entries, and must not stall either.
            for i in 0..200u64 {
                oplog.barrier(i * 4_096, 4_096).await.unwrap();
            }
        });
    }

    #[test]
    fn a_drain_item_stays_readable_after_its_segment_is_freed() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open_with(dir.path(), 3 * RECORD_4K, RECORD_4K).await;
            oplog.write(0, pattern(1, 4_096)).await.unwrap();
            oplog.write(8_192, pattern(2, 4_096)).await.unwrap();
            let items = oplog.drain_batch(4_096);
            assert_eq!(items.len(), 1);
            oplog.write(0, pattern(3, 4_096)).await.unwrap(); // supersedes the item: seg1 dead
            oplog.write(16_384, pattern(4, 4_096)).await.unwrap(); // needs space: frees seg1
            assert_eq!(segment_ids(dir.path()), vec![2, 3, 4]);
            assert_eq!(
                oplog.read_drain_item(&items[0]).await.unwrap(),
                pattern(1, 4_096)
            );
            oplog.complete_drain(&items).await.unwrap();
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(3, 4_096).to_vec()
            );
        });
    }

    #[test]
    fn a_piece_freed_by_a_drain_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open(dir.path()).await;
            oplog.write(0, pattern(1, 4_096)).await.unwrap();
            let pieces = oplog.lookup(0, 4_096);
            let mut store = BTreeMap::new();
            drain_into(&oplog, &mut store, u64::MAX).await;
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
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let capacity = 8 * RECORD_4K;
            let oplog = open_with(dir.path(), capacity, 2 * RECORD_4K).await;
            let store = Rc::new(RefCell::new(BTreeMap::new()));
            let drains = Rc::new(std::cell::Cell::new(0));
            let drainer = {
                let (oplog, store, drains) = (oplog.clone(), store.clone(), drains.clone());
                tokio::task::spawn_local(async move {
                    loop {
                        oplog.drain_wanted().await;
                        assert!(oplog.needs_drain());
                        // Let the writers pile up a little, like a busy engine would.
                        tokio::time::sleep(Duration::from_millis(2)).await;
                        let mut local = store.borrow().clone();
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
                        assert!(oplog.usage_bytes() <= capacity);
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
            // Every block reads as its newest write, from the log or the "extent store".
            for block in 0..40u64 {
                let newest = block;
                let bytes = read_log(&oplog, block * 4_096, 4_096).await.unwrap();
                let got: Vec<u8> = bytes
                    .iter()
                    .enumerate()
                    .map(|(i, b)| match b {
                        LogByte::Data(b) => *b,
                        LogByte::Absent => store.borrow()[&(block * 4_096 + i as u64)],
                        LogByte::Zero => 0,
                    })
                    .collect();
                assert_eq!(got, pattern(newest, 4_096).to_vec(), "block {block}");
            }
        });
    }

    #[test]
    fn needs_drain_follows_live_data() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open_with(dir.path(), 16 * RECORD_4K, 4 * RECORD_4K).await;
            assert!(!oplog.needs_drain());
            let wanted = {
                let oplog = oplog.clone();
                tokio::task::spawn_local(async move { oplog.drain_wanted().await })
            };
            for i in 0..8u64 {
                oplog.write(i * 4_096, pattern(i, 4_096)).await.unwrap();
            }
            assert!(
                !oplog.needs_drain(),
                "8 blocks are not above half of 16 records"
            );
            assert!(!wanted.is_finished());
            oplog.write(8 * 4_096, pattern(8, 4_096)).await.unwrap();
            assert!(oplog.needs_drain());
            tokio::time::timeout(Duration::from_secs(5), wanted)
                .await
                .expect("drain_wanted")
                .unwrap();
        });
    }

    #[test]
    fn records_larger_than_the_log_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        run_local(async {
            let oplog = open_with(dir.path(), 2 * MIB, MIB).await;
            let err = oplog
                .write(0, Bytes::from(vec![0u8; 2 * MIB as usize]))
                .await
                .unwrap_err();
            assert!(matches!(err, OplogError::TooLarge { capacity, .. } if capacity == 2 * MIB));
            // Larger than a segment but not than the log: gets a segment of its own.
            oplog.write(0, pattern(1, 1_500_000)).await.unwrap();
            oplog.write(0, pattern(2, 10)).await.unwrap();
            assert_eq!(segment_files(dir.path()).len(), 2);
            assert!(matches!(
                oplog.write(u64::MAX - 5, pattern(1, 10)).await,
                Err(OplogError::InvalidRange { .. })
            ));
        });
    }

    #[test]
    fn a_failed_commit_fails_its_writers_and_the_log_until_reopened() {
        let dir = tempfile::tempdir().unwrap();
        let opener = CountingOpener::default();
        let faults = opener.faults.clone();
        run_local(async move {
            let oplog = Oplog::open(opener.clone(), OplogConfig::new(dir.path(), 64 * MIB))
                .await
                .unwrap();
            oplog.write(0, pattern(1, 4_096)).await.unwrap();
            faults.fail_syncs.set(1);
            let handles: Vec<_> = (1..5u64)
                .map(|i| {
                    let oplog = oplog.clone();
                    tokio::task::spawn_local(async move {
                        oplog.write(i * 4_096, pattern(i, 4_096)).await
                    })
                })
                .collect();
            // The batch whose sync failed gets the I/O error; later writers find the log failed.
            let mut io_errors = 0;
            for handle in handles {
                match handle.await.unwrap() {
                    Err(OplogError::Io { .. }) => io_errors += 1,
                    Err(OplogError::Failed { .. }) => {}
                    other => panic!("expected a failure, got {other:?}"),
                }
            }
            assert!(io_errors >= 1);
            assert!(matches!(
                oplog.write(0, pattern(9, 10)).await,
                Err(OplogError::Failed { .. })
            ));
            // Acknowledged data still reads; unacknowledged data is not indexed.
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(1, 4_096).to_vec()
            );
            assert_eq!(
                kinds(&oplog.lookup(4_096, 4_096)),
                vec![(4_096, 4_096, "absent")]
            );
            drop(oplog);

            let oplog = Oplog::open(opener, OplogConfig::new(dir.path(), 64 * MIB))
                .await
                .unwrap();
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(1, 4_096).to_vec()
            );
            oplog.write(0, pattern(2, 4_096)).await.unwrap();
            assert_eq!(
                read_data(&oplog, 0, 4_096).await,
                pattern(2, 4_096).to_vec()
            );
        });
    }

    #[test]
    fn destroy_needs_an_empty_log_and_removes_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let log_dir = dir.path().join("nested").join("log");
        run_local(async {
            let oplog = open(&log_dir).await;
            oplog.write(0, pattern(1, 100)).await.unwrap();
            assert!(matches!(
                oplog.clone().destroy().await,
                Err(OplogError::NotEmpty {
                    live_bytes: 100,
                    ..
                })
            ));
            let mut store = BTreeMap::new();
            drain_into(&oplog, &mut store, u64::MAX).await;
            oplog.destroy().await.unwrap();
            assert!(!log_dir.exists());
        });
    }
}
