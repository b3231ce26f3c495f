//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use ashlar_meta::{EmbeddedMetaStore, EmbeddedOptions};
use tempfile::TempDir;

/// A store in a fresh temporary directory; keep the `TempDir` alive.
pub fn store() -> (TempDir, EmbeddedMetaStore) {
    store_with(EmbeddedOptions::default())
}

pub fn store_with(options: EmbeddedOptions) -> (TempDir, EmbeddedMetaStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = EmbeddedMetaStore::open_with(&db_path(&dir), options).expect("open store");
    (dir, store)
}

pub fn db_path(dir: &TempDir) -> PathBuf {
    dir.path().join("meta.redb")
}
