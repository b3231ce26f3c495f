//! The node's metadata store (embedded, or etcd with `--etcd`) and its registration in the
//! cluster.
//!
//! The engine, the volume groups and everything that reaches them are written for one
//! concrete store type (`NodeEngine`, `NodeVolumeGroups`). Rather than make the whole binary
//! generic over `MetaStore`, [`NodeMeta`] is that one type: an enum of the two stores that
//! forwards each call. The match costs nothing next to a metadata request, and no client I/O
//! ever reaches the store.

use crate::args::NodeArgs;
use anyhow::{anyhow, bail, Context, Result};
use ashlar_cluster::{
    AdvertisedAddresses, DiskRecord, MembershipConfig, NodeId, NodeRecord, Registration,
    NODE_RECORD_VERSION,
};
use ashlar_meta::{
    EmbeddedMetaStore, EtcdMetaStore, EtcdOptions, KeyRange, KeyValue, LeaseId, MetaError,
    MetaStore, Revision, Txn, TxnResponse, Watch,
};
use ashlar_storage::disk::Disk;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a node that cannot reach etcd at start waits between attempts.
pub const ETCD_RETRY_INTERVAL: Duration = Duration::from_secs(2);

/// The node's metadata store: the embedded redb file (single node) or etcd (cluster).
#[derive(Clone, Debug)]
pub enum NodeMeta {
    Embedded(EmbeddedMetaStore),
    Etcd(EtcdMetaStore),
}

/// Forwards one call to whichever store the node runs on.
macro_rules! forward {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            NodeMeta::Embedded($store) => $call.await,
            NodeMeta::Etcd($store) => $call.await,
        }
    };
}

impl MetaStore for NodeMeta {
    async fn get(&self, key: &[u8]) -> Result<Option<KeyValue>, MetaError> {
        forward!(self, store => store.get(key))
    }

    async fn range(
        &self,
        range: KeyRange,
        limit: Option<usize>,
    ) -> Result<Vec<KeyValue>, MetaError> {
        forward!(self, store => store.range(range, limit))
    }

    async fn put(
        &self,
        key: impl Into<Vec<u8>> + Send,
        value: impl Into<Vec<u8>> + Send,
        lease: Option<LeaseId>,
    ) -> Result<Revision, MetaError> {
        let (key, value) = (key.into(), value.into());
        forward!(self, store => store.put(key, value, lease))
    }

    async fn delete(&self, range: KeyRange) -> Result<u64, MetaError> {
        forward!(self, store => store.delete(range))
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError> {
        forward!(self, store => store.txn(txn))
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, MetaError> {
        forward!(self, store => store.grant_lease(ttl))
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), MetaError> {
        forward!(self, store => store.keep_alive(lease))
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), MetaError> {
        forward!(self, store => store.revoke_lease(lease))
    }

    async fn watch(
        &self,
        range: KeyRange,
        start_revision: Option<Revision>,
    ) -> Result<Watch, MetaError> {
        forward!(self, store => store.watch(range, start_revision))
    }

    async fn current_revision(&self) -> Result<Revision, MetaError> {
        forward!(self, store => store.current_revision())
    }
}

impl NodeMeta {
    /// True when the node is one of a cluster (metadata in etcd).
    pub fn is_clustered(&self) -> bool {
        matches!(self, NodeMeta::Etcd(_))
    }
}

/// Opens the node's metadata store. With `--etcd`, waits until etcd answers: the first
/// failure is one warning line, later ones are quiet, and `stop` (a signal) ends the wait
/// with `None`.
pub async fn open_meta(
    args: &NodeArgs,
    stop: impl Future<Output = &'static str>,
) -> Result<Option<NodeMeta>> {
    let Some(endpoints) = &args.etcd else {
        let path = args.data_dir.join("meta.redb");
        let store = EmbeddedMetaStore::open(&path)
            .map_err(|e| anyhow!("opening metadata store {}: {e}", path.display()))?;
        return Ok(Some(NodeMeta::Embedded(store)));
    };
    let options = EtcdOptions::new(endpoints).map_err(|e| anyhow!("--etcd {endpoints}: {e}"))?;
    tokio::select! {
        store = connect_etcd(options) => Ok(Some(NodeMeta::Etcd(store))),
        signal = stop => {
            tracing::info!("received {signal} while waiting for etcd; stopping");
            Ok(None)
        }
    }
}

async fn connect_etcd(options: EtcdOptions) -> EtcdMetaStore {
    let endpoints = options.endpoints.join(",");
    let mut warned = false;
    loop {
        match EtcdMetaStore::connect(options.clone()).await {
            Ok(store) => {
                if warned {
                    tracing::info!("reached etcd at {endpoints}");
                }
                return store;
            }
            Err(error) => {
                let reason = match &error {
                    MetaError::Unavailable { reason, .. } => reason.clone(),
                    other => other.to_string(),
                };
                if warned {
                    tracing::debug!(%reason, "etcd still unreachable");
                } else {
                    tracing::warn!(
                        "cannot reach etcd at {endpoints}: {reason}; retrying every {}s",
                        ETCD_RETRY_INTERVAL.as_secs()
                    );
                    warned = true;
                }
            }
        }
        tokio::time::sleep(ETCD_RETRY_INTERVAL).await;
    }
}

/// What the node publishes about itself, from its flags and its disks' current space.
#[derive(Clone)]
pub struct RecordSource {
    node_id: NodeId,
    addresses: AdvertisedAddresses,
    storage_only: bool,
    disks: Vec<Disk>,
    started_at_unix_ms: u64,
}

impl RecordSource {
    pub fn new(args: &NodeArgs, node_id: NodeId, disks: &[Disk]) -> Result<Self> {
        let host = advertised_host(args)?;
        if args.etcd.is_some() {
            check_reachable(&host, args.node_listen)?;
        }
        let at = |listen: SocketAddr| host_port(&host, listen.port());
        Ok(RecordSource {
            node_id,
            addresses: AdvertisedAddresses {
                http: at(args.http_listen),
                nbd: at(args.nbd_listen),
                iscsi: at(args.iscsi_listen),
                node: at(args.node_listen),
            },
            storage_only: args.storage_only,
            disks: disks.to_vec(),
            started_at_unix_ms: unix_ms(SystemTime::now()),
        })
    }

    /// The record as of now (disk space is read again each time).
    pub fn record(&self) -> NodeRecord {
        NodeRecord {
            version: NODE_RECORD_VERSION,
            node_id: self.node_id,
            addresses: self.addresses.clone(),
            storage_only: self.storage_only,
            disks: self.disks.iter().map(disk_record).collect(),
            software_version: env!("CARGO_PKG_VERSION").to_string(),
            started_at_unix_ms: self.started_at_unix_ms,
        }
    }
}

/// `--advertise`, or without it (single node) the HTTP listen address's IP.
fn advertised_host(args: &NodeArgs) -> Result<String> {
    let Some(host) = &args.advertise else {
        return Ok(args.http_listen.ip().to_string());
    };
    if host.parse::<SocketAddr>().is_ok() {
        bail!("--advertise {host}: give the host only; the ports come from --http-listen, --nbd-listen, --iscsi-listen and --node-listen");
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || host.contains(['/', ' ']) {
        bail!("--advertise {host:?}: expected a host name or an IP address");
    }
    Ok(host.to_string())
}

/// Other nodes connect to the advertised host at `--node-listen`'s port: a node advertising
/// an address beyond loopback while listening on loopback could never be reached, and its
/// replicated writes would fail on every other node. Refused at start instead.
fn check_reachable(host: &str, node_listen: SocketAddr) -> Result<()> {
    let advertised_beyond_loopback = host
        .parse::<IpAddr>()
        .map(|ip| !ip.is_loopback() && !ip.is_unspecified())
        .unwrap_or(host != "localhost");
    if advertised_beyond_loopback && node_listen.ip().is_loopback() {
        bail!(
            "--node-listen {node_listen} is a loopback address but --advertise {host} is not: \
             other nodes could not reach this one for replication; give --node-listen \
             {}",
            host_port(host, node_listen.port())
        );
    }
    Ok(())
}

fn host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(ip)) => format!("[{ip}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn disk_record(disk: &Disk) -> DiskRecord {
    // A disk whose space cannot be read is listed with zeros rather than failing the record.
    let (capacity_bytes, free_bytes) = filesystem_space(&disk.path).unwrap_or((0, 0));
    DiskRecord {
        path: disk.path.display().to_string(),
        tier: disk.tier.name().to_string(),
        capacity_bytes,
        free_bytes,
    }
}

/// (size, bytes available to unprivileged writers) of the filesystem holding `path`.
fn filesystem_space(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("path contains a NUL byte"))?;
    // SAFETY: statvfs writes into the zeroed struct we own; the path is a valid C string.
    let stat = unsafe {
        let mut stat: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c_path.as_ptr(), &mut stat) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        stat
    };
    let block = stat.f_frsize as u64;
    Ok((stat.f_blocks as u64 * block, stat.f_bavail as u64 * block))
}

/// Registers the node (its lease TTL from `--node-lease-ttl-ms`).
pub async fn register(
    meta: &NodeMeta,
    source: &RecordSource,
    args: &NodeArgs,
) -> Result<Registration<NodeMeta>> {
    if args.node_lease_ttl_ms == 0 {
        bail!("--node-lease-ttl-ms must be at least 1");
    }
    let config = MembershipConfig {
        lease_ttl: Duration::from_millis(args.node_lease_ttl_ms),
        ..MembershipConfig::default()
    };
    ashlar_cluster::register(meta.clone(), source.record(), config)
        .await
        .context("registering the node in the metadata store")
}

/// Holds an exclusive lock on `<data-dir>/node.lock` for the life of the process. The
/// embedded store locks its file itself; on etcd nothing else stops a second node from
/// starting on the same data directory (same node id, same data files).
pub fn lock_data_dir(data_dir: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = data_dir.join("node.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!(
            "data directory {} is in use by another ashlar node; stop it or choose another --data-dir",
            data_dir.display()
        );
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_join_host_and_port() {
        assert_eq!(host_port("10.0.0.1", 10810), "10.0.0.1:10810");
        assert_eq!(host_port("node1.example", 3260), "node1.example:3260");
        assert_eq!(host_port("fe80::1", 10809), "[fe80::1]:10809");
    }

    #[test]
    fn a_node_listener_others_cannot_reach_is_refused() {
        let loopback: SocketAddr = "127.0.0.1:10811".parse().unwrap();
        assert!(check_reachable("127.0.0.1", loopback).is_ok());
        assert!(check_reachable("localhost", loopback).is_ok());
        assert!(check_reachable("10.0.0.2", "10.0.0.2:10811".parse().unwrap()).is_ok());
        assert!(check_reachable("10.0.0.2", "0.0.0.0:10811".parse().unwrap()).is_ok());
        let error = check_reachable("10.0.0.2", loopback)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("give --node-listen 10.0.0.2:10811"),
            "{error}"
        );
        assert!(check_reachable("node1.example", loopback).is_err());
        // Not an address anyone connects to; nothing to judge.
        assert!(check_reachable("0.0.0.0", loopback).is_ok());
    }

    #[test]
    fn filesystem_space_is_read() {
        let (capacity, free) = filesystem_space(Path::new("/")).unwrap();
        assert!(capacity > 0 && free <= capacity);
        assert!(filesystem_space(Path::new("/no/such/dir")).is_err());
    }
}
