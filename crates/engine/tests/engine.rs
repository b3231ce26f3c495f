//! The engine in-process: writes and reads through `VdiskHandle`s on the reactors, across
//! shard changes and restarts, checked against an in-memory model.

mod common;

use ashlar_core::{BlockDevice, IoError};
use ashlar_engine::{Engine, EngineError};
use ashlar_meta::EmbeddedMetaStore;
use bytes::Bytes;
use common::{config, pattern};
use std::path::Path;
use std::sync::Arc;

type TestEngine = Engine<EmbeddedMetaStore>;

async fn start(dir: &Path) -> Arc<TestEngine> {
    let meta = EmbeddedMetaStore::open(&dir.join("meta.redb")).expect("meta");
    Engine::start(config(dir, 32 << 20), meta)
        .await
        .expect("engine")
}

/// Runs `body` with a handle on reactor 0.
async fn on_reactor<T: Send + 'static, Fut: std::future::Future<Output = T> + 'static>(
    engine: &Arc<TestEngine>,
    body: impl FnOnce(ashlar_engine::VdiskHandle) -> Fut + Send + 'static,
) -> T {
    let engine2 = engine.clone();
    engine.reactors().handles()[0]
        .clone()
        .run(move || async move { body(engine2.open("v").expect("open")).await })
        .await
        .expect("reactor")
}

/// Writes of assorted sizes and alignments (oplog path, bypass path, zeroes); returns the model.
async fn write_mix(engine: &Arc<TestEngine>, size: usize, seed: u64) -> Vec<u8> {
    on_reactor(engine, move |handle| async move {
        let mut model = vec![0u8; size];
        let ops: Vec<(u64, usize, u8)> = vec![
            (0, 4096, 0),
            (4096 * 3 + 17, 9000, 0),
            (1 << 20, 1 << 20, 0),       // whole extent: bypasses the oplog
            ((4 << 20) - 512, 1024, 0),  // crosses a shard range
            (3 << 20, 2 << 20, 0),       // aligned, crosses a range boundary
            ((1 << 20) + 8192, 4096, 0), // small write over bypassed data
            (5 << 20, 100_000, 1),       // write-zeroes with hole punching
            ((6 << 20) + 100, 5000, 1),
        ];
        for (index, (offset, length, zero)) in ops.into_iter().enumerate() {
            if zero == 1 {
                handle
                    .write_zeroes(offset, length as u32, true)
                    .await
                    .expect("zero");
                model[offset as usize..offset as usize + length].fill(0);
            } else {
                let data = pattern(seed + index as u64, length);
                model[offset as usize..offset as usize + length].copy_from_slice(&data);
                handle
                    .write(offset, Bytes::from(data), false)
                    .await
                    .expect("write");
            }
        }
        model
    })
    .await
}

async fn check(engine: &Arc<TestEngine>, model: Vec<u8>) {
    on_reactor(engine, move |handle| async move {
        for (offset, length) in [
            (0usize, model.len()),
            (4096 * 3, 20_000),
            ((4 << 20) - 4096, 8192),
            (1, 3),
        ] {
            let got = handle
                .read(offset as u64, length as u32)
                .await
                .expect("read");
            assert!(
                got[..] == model[offset..offset + length],
                "mismatch at [{offset}, +{length})"
            );
        }
    })
    .await
}

#[tokio::test(flavor = "current_thread")]
async fn data_survives_reshards_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let size = 12usize << 20;
    let engine = start(dir.path()).await;
    engine
        .create_vdisk("v", size as u64, Some(2))
        .await
        .unwrap();
    let model = write_mix(&engine, size, 1).await;
    check(&engine, model.clone()).await;
    for shards in [1, 3, 4, 2] {
        engine.set_shards("v", shards).await.unwrap();
        check(&engine, model.clone()).await;
    }
    let model2 = write_mix(&engine, size, 100).await;
    drop(engine);
    // Restart: the oplog is replayed; everything acknowledged reads back.
    let engine = start(dir.path()).await;
    assert_eq!(engine.vdisk("v").unwrap().shards, 2);
    check(&engine, model2).await;
    let _ = model;
}

#[tokio::test(flavor = "current_thread")]
async fn control_errors_are_precise() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start(dir.path()).await;
    engine.create_vdisk("v", 1 << 30, None).await.unwrap();
    assert!(matches!(
        engine.create_vdisk("v", 1 << 30, None).await,
        Err(EngineError::AlreadyExists(_))
    ));
    assert!(matches!(
        engine.create_vdisk("w", 0, None).await,
        Err(EngineError::InvalidSize(_))
    ));
    assert!(matches!(
        engine.create_vdisk("a/b", 4096, None).await,
        Err(EngineError::InvalidName { .. })
    ));
    assert!(matches!(
        engine.set_shards("v", 0).await,
        Err(EngineError::InvalidShards(0))
    ));
    assert!(matches!(
        engine.resize("v", 1 << 20, false).await,
        Err(EngineError::ShrinkRefused { .. })
    ));
    assert!(matches!(
        engine.vdisk("nope"),
        Err(EngineError::NotFound(_))
    ));
    let handle_engine = engine.clone();
    // Out-of-range I/O is refused without touching data.
    let error = on_reactor(&handle_engine, |handle| async move {
        handle.read((1 << 30) - 4096, 8192).await.unwrap_err()
    })
    .await;
    assert!(matches!(error, IoError::OutOfRange { .. }));
    engine.resize("v", 2 << 30, false).await.unwrap();
    assert_eq!(engine.vdisk("v").unwrap().size_bytes, 2 << 30);
    engine.delete_vdisk("v", false).await.unwrap();
    assert!(engine.list_vdisks().is_empty());
}

#[tokio::test(flavor = "current_thread")]
async fn shrink_discards_the_tail() {
    let dir = tempfile::tempdir().unwrap();
    let engine = start(dir.path()).await;
    engine.create_vdisk("v", 16 << 20, Some(2)).await.unwrap();
    on_reactor(&engine, |handle| async move {
        handle
            .write(12 << 20, Bytes::from(vec![7u8; 8192]), false)
            .await
            .unwrap();
    })
    .await;
    engine.resize("v", 8 << 20, true).await.unwrap();
    engine.resize("v", 16 << 20, false).await.unwrap();
    let data = on_reactor(&engine, |handle| async move {
        handle.read(12 << 20, 8192).await.unwrap()
    })
    .await;
    assert!(
        data.iter().all(|&b| b == 0),
        "grown tail must read as zeros"
    );
}
