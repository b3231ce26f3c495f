//! Shared helpers for the integration tests: the embedded store in a
//! temporary directory, a throwaway etcd, and [`Backend`], which lets one
//! test body run against both stores (see [`conformance!`]).
#![allow(dead_code)]

pub mod etcd_server;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use ashlar_meta::{EmbeddedMetaStore, EmbeddedOptions, EtcdMetaStore, EtcdOptions, MetaStore};
use tempfile::TempDir;

pub use etcd_server::EtcdServer;

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

/// Store settings a conformance test may change, meaning the same on both.
#[derive(Debug, Clone, Copy, Default)]
pub struct Settings {
    pub watch_channel_capacity: Option<usize>,
}

/// A MetaStore implementation under test. Each `open` gives an empty store
/// of its own (so revisions start at 1), plus a guard that keeps its backing
/// (directory or etcd process) alive.
pub trait Backend {
    type Store: MetaStore + Clone + std::fmt::Debug;
    type Guard: Send;
    /// A lease TTL the store honours as given (etcd counts whole seconds and
    /// has a minimum, 1 s for the test etcd).
    const TTL: Duration;
    fn open(settings: Settings) -> impl Future<Output = (Self::Guard, Self::Store)> + Send;
}

pub struct Embedded;

impl Backend for Embedded {
    type Store = EmbeddedMetaStore;
    type Guard = TempDir;
    const TTL: Duration = Duration::from_millis(300);

    async fn open(settings: Settings) -> (TempDir, EmbeddedMetaStore) {
        let defaults = EmbeddedOptions::default();
        store_with(EmbeddedOptions {
            watch_channel_capacity: settings
                .watch_channel_capacity
                .unwrap_or(defaults.watch_channel_capacity),
            ..defaults
        })
    }
}

pub struct Etcd;

impl Backend for Etcd {
    type Store = EtcdMetaStore;
    type Guard = EtcdServer;
    const TTL: Duration = Duration::from_secs(1);

    async fn open(settings: Settings) -> (EtcdServer, EtcdMetaStore) {
        let server = tokio::task::spawn_blocking(EtcdServer::start)
            .await
            .expect("start etcd");
        let store = etcd_store(&server.url, settings).await;
        (server, store)
    }
}

pub async fn etcd_store(endpoints: &str, settings: Settings) -> EtcdMetaStore {
    let mut options = EtcdOptions::new(endpoints).expect("endpoints");
    if let Some(c) = settings.watch_channel_capacity {
        options.watch_channel_capacity = c;
    }
    EtcdMetaStore::connect(options)
        .await
        .expect("connect to etcd")
}

/// Run each named generic test `fn name<B: Backend>()` once per store, as
/// `embedded::name` and `etcd::name`.
#[macro_export]
macro_rules! conformance {
    ($($test:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<$crate::common::Embedded>().await;
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<$crate::common::Etcd>().await;
                }
            )*
        }
    };
}
