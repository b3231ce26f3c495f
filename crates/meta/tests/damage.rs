//! Damage to the embedded store's file: an older format is upgraded, and bytes flipped
//! anywhere in the file make it refuse to open or answer an error, never panic and never
//! read back a value other than the one written.

mod common;

use ashlar_meta::{EmbeddedMetaStore, KeyRange, MetaError, MetaStore};
use redb::{Database, ReadableDatabase, TableDefinition};

const KV: TableDefinition<&[u8], &[u8]> = TableDefinition::new("kv");
const META: TableDefinition<&str, i64> = TableDefinition::new("meta");

fn format_1_record(create: i64, modified: i64, version: i64, value: &[u8]) -> Vec<u8> {
    let mut out = vec![1u8];
    for field in [create, modified, version, 0] {
        out.extend_from_slice(&field.to_le_bytes());
    }
    out.extend_from_slice(value);
    out
}

#[tokio::test]
async fn a_store_of_format_1_is_upgraded_to_records_with_crcs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    {
        let db = Database::create(&path).unwrap();
        let wtx = db.begin_write().unwrap();
        {
            let mut meta = wtx.open_table(META).unwrap();
            meta.insert("format_version", 1).unwrap();
            meta.insert("revision", 3).unwrap();
            let mut kv = wtx.open_table(KV).unwrap();
            kv.insert(
                b"/a".as_slice(),
                format_1_record(2, 3, 2, b"hello").as_slice(),
            )
            .unwrap();
        }
        wtx.commit().unwrap();
    }
    for _ in 0..2 {
        let store = EmbeddedMetaStore::open(&path).expect("open");
        let kv = store.get(b"/a").await.unwrap().expect("kept");
        assert_eq!(
            (kv.value.as_slice(), kv.mod_revision.0, kv.version),
            (b"hello".as_slice(), 3, 2)
        );
    }
    let db = Database::create(&path).unwrap();
    let rtx = db.begin_read().unwrap();
    let meta = rtx.open_table(META).unwrap();
    assert_eq!(meta.get("format_version").unwrap().unwrap().value(), 2);
    let kv = rtx.open_table(KV).unwrap();
    let record = kv.get(b"/a".as_slice()).unwrap().unwrap();
    assert_eq!(record.value()[0], 2, "rewritten in format 2");
}

fn value_of(i: usize) -> Vec<u8> {
    format!(
        "{{\"name\":\"vdisk-{i}\",\"size_bytes\":{}}}",
        (i + 1) << 30
    )
    .into_bytes()
}

#[tokio::test]
async fn bytes_flipped_anywhere_never_panic_and_never_read_back_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let keys = 40;
    {
        let store = EmbeddedMetaStore::open(&path).expect("open");
        for i in 0..keys {
            store
                .put(
                    format!("/ashlar/v1/vdisks/v{i}").into_bytes(),
                    value_of(i),
                    None,
                )
                .await
                .unwrap();
        }
    }
    let original = std::fs::read(&path).unwrap();
    let (mut refused, mut errors, mut intact) = (0, 0, 0);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..300 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let at = (seed >> 33) as usize % original.len();
        let mut damaged = original.clone();
        damaged[at] ^= 1 << (round % 8);
        let path = dir.path().join(format!("damaged-{round}.redb"));
        std::fs::write(&path, &damaged).unwrap();
        let store = match EmbeddedMetaStore::open(&path) {
            Ok(store) => store,
            Err(MetaError::Corrupt { .. } | MetaError::Storage { .. }) => {
                refused += 1;
                continue;
            }
            Err(other) => panic!("byte {at}: unexpected error {other}"),
        };
        let listed = store
            .range(KeyRange::prefix(b"/ashlar/v1/vdisks/".to_vec()), None)
            .await;
        match listed {
            Ok(kvs) => {
                for kv in kvs.iter() {
                    let i: usize = String::from_utf8_lossy(&kv.key)["/ashlar/v1/vdisks/v".len()..]
                        .parse()
                        .unwrap_or_else(|_| {
                            panic!("byte {at}: a key that was never written: {:?}", kv.key)
                        });
                    assert_eq!(
                        kv.value,
                        value_of(i),
                        "byte {at}: key v{i} reads back wrong"
                    );
                }
                assert_eq!(kvs.len(), keys, "byte {at}: keys missing without an error");
                intact += 1;
            }
            Err(_) => errors += 1,
        }
        std::fs::remove_file(&path).unwrap();
    }
    eprintln!("300 flips: {refused} refused at open, {errors} answered an error, {intact} read back intact");
}
