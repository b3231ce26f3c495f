//! Ashlar's metadata store: cluster-wide, strongly consistent state (nodes,
//! disks, vdisks, ownership leases, placement) behind an interface modelled
//! on etcd v3, so the same control-plane code runs on a single node (the
//! embedded redb implementation here) and on a cluster (`EtcdMetaStore`).
//!
//! Control plane only: vdisk create/resize/delete and startup, never per
//! client I/O. See docs/metastore.md for the model and key layout.

mod embedded;
mod engine;
mod error;
mod etcd;
pub mod layout;
mod lease;
mod mirror;
mod record;
mod release;
mod store;
mod types;
mod watch;

pub use embedded::{EmbeddedMetaStore, EmbeddedOptions};
pub use error::{ErrorSource, MetaError};
pub use etcd::{
    EtcdMetaStore, EtcdOptions, RequestCounts, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HTTP2_KEEP_ALIVE_INTERVAL, DEFAULT_REQUEST_TIMEOUT,
};
pub use store::MetaStore;
pub use types::{
    prefix_end, Compare, CompareOp, CompareTarget, EventKind, KeyRange, KeyValue, LeaseId,
    Revision, Txn, TxnOp, TxnOpResult, TxnResponse, WatchEvent,
};
pub use watch::{Watch, WatchItem};
