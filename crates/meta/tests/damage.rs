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

/// `rounds` copies of `bytes`, each with one bit flipped at a place drawn from `seed`, and
/// that place.
fn flipped_copies(bytes: &[u8], rounds: usize, mut seed: u64) -> Vec<(usize, Vec<u8>)> {
    (0..rounds)
        .map(|round| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let at = (seed >> 33) as usize % bytes.len();
            let mut damaged = bytes.to_vec();
            damaged[at] ^= 1 << (round % 8);
            (at, damaged)
        })
        .collect()
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
    for (round, (at, damaged)) in flipped_copies(&original, 300, 0x9e37_79b9_7f4a_7c15)
        .into_iter()
        .enumerate()
    {
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
    eprintln!("{} flips: {refused} refused at open, {errors} answered an error, {intact} read back intact", refused + errors + intact);
}

/// A store of `keys` vdisk records in `dir` (and its mirror beside it), written through
/// overwrites and deletes as well as puts, so the mirror has to follow every kind of commit.
async fn store_with_mirror(path: &std::path::Path, keys: usize) -> Vec<ashlar_meta::KeyValue> {
    let store = EmbeddedMetaStore::open(path).expect("open");
    for i in 0..keys + 2 {
        let key = format!("/ashlar/v1/vdisks/v{i}").into_bytes();
        store
            .put(key.clone(), b"first".to_vec(), None)
            .await
            .unwrap();
        store.put(key, value_of(i), None).await.unwrap();
    }
    for i in keys..keys + 2 {
        let key = format!("/ashlar/v1/vdisks/v{i}").into_bytes();
        assert_eq!(store.delete(KeyRange::Key(key)).await.unwrap(), 1);
    }
    all_vdisks(&store).await.expect("read back")
}

async fn all_vdisks(store: &EmbeddedMetaStore) -> Result<Vec<ashlar_meta::KeyValue>, MetaError> {
    store
        .range(KeyRange::prefix(b"/ashlar/v1/vdisks/".to_vec()), None)
        .await
}

fn mirror_of(path: &std::path::Path) -> std::path::PathBuf {
    path.with_file_name("meta.mirror.redb")
}

fn kept_aside(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("meta.redb.damaged-"))
        .collect()
}

/// The same flips as above, with the mirror intact beside the damaged file: the store always
/// opens, every record reads back exactly as written (revisions included), and where the
/// file was damaged it is kept aside rather than overwritten.
#[tokio::test]
async fn bytes_flipped_anywhere_with_an_intact_mirror_are_repaired_from_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let keys = 40;
    let written = store_with_mirror(&path, keys).await;
    assert_eq!(written.len(), keys);
    let original = std::fs::read(&path).unwrap();
    let mirror = std::fs::read(mirror_of(&path)).unwrap();
    let (mut restored, mut rounds) = (0, 0);
    for (round, (at, damaged)) in flipped_copies(&original, 1000, 0x2545_f491_4f6c_dd1d)
        .into_iter()
        .enumerate()
    {
        rounds += 1;
        let round_dir = dir.path().join(format!("round-{round}"));
        std::fs::create_dir(&round_dir).unwrap();
        let path = round_dir.join("meta.redb");
        std::fs::write(&path, &damaged).unwrap();
        std::fs::write(mirror_of(&path), &mirror).unwrap();
        let store = EmbeddedMetaStore::open(&path)
            .unwrap_or_else(|e| panic!("byte {at}: refused with an intact mirror: {e}"));
        let read = all_vdisks(&store)
            .await
            .unwrap_or_else(|e| panic!("byte {at}: {e}"));
        assert!(read == written, "byte {at}: the records differ");
        let aside = kept_aside(&round_dir);
        if !aside.is_empty() {
            restored += 1;
            // Kept, not overwritten (opening it to check may have let redb repair parts).
            let kept = std::fs::metadata(round_dir.join(&aside[0])).unwrap();
            assert!(kept.len() > 0, "byte {at}: the damaged file was not kept");
        }
        drop(store);
        std::fs::remove_dir_all(&round_dir).unwrap();
    }
    eprintln!("{rounds} flips: {restored} restored from the mirror, the rest read intact");
    assert!(
        restored > 0,
        "no flip made the store fall back to its mirror"
    );
}

#[tokio::test]
async fn a_lost_store_is_rebuilt_from_its_mirror_at_the_last_commit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    let written = store_with_mirror(&path, 5).await;
    let revision = {
        let store = EmbeddedMetaStore::open(&path).expect("open");
        store.current_revision().await.unwrap()
    };
    std::fs::remove_file(&path).unwrap();
    let store = EmbeddedMetaStore::open(&path).expect("open from the mirror");
    assert!(
        all_vdisks(&store).await.unwrap() == written,
        "the records differ"
    );
    assert_eq!(store.current_revision().await.unwrap(), revision);
    // Writes go on, to both copies: lose the store again and the new key is still there.
    store
        .put(b"/ashlar/v1/vdisks/new".to_vec(), b"{}".to_vec(), None)
        .await
        .unwrap();
    drop(store);
    std::fs::remove_file(&path).unwrap();
    let store = EmbeddedMetaStore::open(&path).expect("open from the mirror again");
    assert_eq!(all_vdisks(&store).await.unwrap().len(), written.len() + 1);
}

/// Changes one byte of every copy of the value `needle` in the file at `path` (redb writes
/// pages anew on each commit, so older copies of a record stay in pages no longer used).
fn damage_value(path: &std::path::Path, needle: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    let places: Vec<usize> = bytes
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle)
        .map(|(at, _)| at)
        .collect();
    assert!(
        !places.is_empty(),
        "{} does not hold the value",
        path.display()
    );
    for at in places {
        bytes[at + needle.len() - 2] ^= 0x01;
    }
    std::fs::write(path, &bytes).unwrap();
}

#[tokio::test]
async fn damage_to_both_copies_refuses_to_open_and_says_why_for_each() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = common::db_path(&dir);
    store_with_mirror(&path, 5).await;
    damage_value(&path, &value_of(3));
    damage_value(&mirror_of(&path), &value_of(3));
    match EmbeddedMetaStore::open(&path) {
        Err(MetaError::Corrupt { detail, .. }) => {
            assert!(
                detail.contains("v3") && detail.contains("meta.mirror.redb cannot replace it"),
                "{detail}"
            );
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("opened with both copies damaged"),
    }
    assert!(kept_aside(dir.path()).is_empty(), "a file was moved");
    // The store missing and its mirror damaged: an error too, never a new empty store that
    // would leave every vdisk unaccounted for.
    std::fs::remove_file(&path).unwrap();
    match EmbeddedMetaStore::open(&path) {
        Err(MetaError::Corrupt { detail, .. }) => {
            assert!(detail.contains("the file is missing"), "{detail}")
        }
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("opened a new store with a damaged mirror"),
    }
    assert!(!path.exists(), "an empty store was created");
}
