//! The JSON records kept under the cluster keys. Each carries `"version"`, its format version;
//! a reader refuses a version it does not know rather than guess at its fields.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::ClusterError;
use crate::node_id::NodeId;
use crate::ownership::OwnershipEpoch;

/// Format version of [`NodeRecord`].
pub const NODE_RECORD_VERSION: u32 = 1;
/// Format version of [`OwnerRecord`] and [`EpochRecord`].
pub const OWNERSHIP_RECORD_VERSION: u32 = 1;

/// Where other nodes and clients reach a node, each as `host:port`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdvertisedAddresses {
    /// The HTTP API (and the CLI's `--server`).
    pub http: String,
    pub nbd: String,
    pub iscsi: String,
    /// Node-to-node traffic (replication). Empty in records of nodes older than replication.
    #[serde(default)]
    pub node: String,
}

/// One of a node's disks, with its space when the record was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskRecord {
    pub path: String,
    /// `fast` or `slow`.
    pub tier: String,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
}

/// What a node says about itself: its member record and its live record hold this.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub version: u32,
    pub node_id: NodeId,
    pub addresses: AdvertisedAddresses,
    /// Holds replicas but never owns vdisks or serves clients.
    pub storage_only: bool,
    pub disks: Vec<DiskRecord>,
    pub software_version: String,
    /// When this run of the node started (Unix time, milliseconds).
    pub started_at_unix_ms: u64,
}

impl NodeRecord {
    pub fn capacity_bytes(&self) -> u64 {
        self.disks.iter().map(|d| d.capacity_bytes).sum()
    }

    pub fn free_bytes(&self) -> u64 {
        self.disks.iter().map(|d| d.free_bytes).sum()
    }
}

/// The value of an owner key: who owns the vdisk, at which epoch. The key is attached to
/// the owner's lease, so it vanishes when the owner's registration ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerRecord {
    pub version: u32,
    pub node_id: NodeId,
    pub epoch: OwnershipEpoch,
}

/// The value of a vdisk's epoch key: the highest epoch ever granted for it, and to whom.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochRecord {
    pub version: u32,
    pub epoch: OwnershipEpoch,
    pub node_id: NodeId,
}

/// A record type with a format version.
pub trait Versioned: Serialize + DeserializeOwned {
    const VERSION: u32;
    const NAME: &'static str;
}

impl Versioned for NodeRecord {
    const VERSION: u32 = NODE_RECORD_VERSION;
    const NAME: &'static str = "node record";
}

impl Versioned for OwnerRecord {
    const VERSION: u32 = OWNERSHIP_RECORD_VERSION;
    const NAME: &'static str = "owner record";
}

impl Versioned for EpochRecord {
    const VERSION: u32 = OWNERSHIP_RECORD_VERSION;
    const NAME: &'static str = "epoch record";
}

pub fn encode<T: Versioned>(record: &T) -> Vec<u8> {
    // Serializing plain structs of strings and integers cannot fail.
    serde_json::to_vec(record).expect("cluster records serialize")
}

/// Decodes the record stored under `key`, checking its format version first so that a newer
/// format is reported as such, not as a missing field.
pub fn decode<T: Versioned>(key: &[u8], value: &[u8]) -> Result<T, ClusterError> {
    #[derive(Deserialize)]
    struct Probe {
        version: u32,
    }
    let probe: Probe = serde_json::from_slice(value)
        .map_err(|e| ClusterError::corrupt(key, format!("not a {}: {e}", T::NAME)))?;
    if probe.version != T::VERSION {
        return Err(ClusterError::corrupt(
            key,
            format!(
                "{} format version {} is unknown to this version of Ashlar (it reads {})",
                T::NAME,
                probe.version,
                T::VERSION
            ),
        ));
    }
    serde_json::from_slice(value)
        .map_err(|e| ClusterError::corrupt(key, format!("bad {}: {e}", T::NAME)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeRecord {
        NodeRecord {
            version: NODE_RECORD_VERSION,
            node_id: NodeId::new(99).unwrap(),
            addresses: AdvertisedAddresses {
                http: "10.0.0.1:10810".into(),
                nbd: "10.0.0.1:10809".into(),
                iscsi: "10.0.0.1:3260".into(),
                node: "10.0.0.1:10811".into(),
            },
            storage_only: true,
            disks: vec![
                DiskRecord {
                    path: "/d0".into(),
                    tier: "fast".into(),
                    capacity_bytes: 100,
                    free_bytes: 40,
                },
                DiskRecord {
                    path: "/d1".into(),
                    tier: "slow".into(),
                    capacity_bytes: 1000,
                    free_bytes: 500,
                },
            ],
            software_version: "0.1.0".into(),
            started_at_unix_ms: 1_700_000_000_000,
        }
    }

    #[test]
    fn records_round_trip() {
        let record = node();
        assert_eq!(
            decode::<NodeRecord>(b"/k", &encode(&record)).unwrap(),
            record
        );
        assert_eq!(record.capacity_bytes(), 1100);
        assert_eq!(record.free_bytes(), 540);
        let owner = OwnerRecord {
            version: OWNERSHIP_RECORD_VERSION,
            node_id: record.node_id,
            epoch: OwnershipEpoch(3),
        };
        assert_eq!(
            decode::<OwnerRecord>(b"/k", &encode(&owner)).unwrap(),
            owner
        );
    }

    #[test]
    fn unknown_versions_and_garbage_are_refused_by_key() {
        let mut value: serde_json::Value = serde_json::to_value(node()).unwrap();
        value["version"] = 2.into();
        let error = decode::<NodeRecord>(b"/k/n", &serde_json::to_vec(&value).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("/k/n") && error.contains("version 2"),
            "{error}"
        );
        let error = decode::<EpochRecord>(b"/k/e", b"{not json").unwrap_err();
        assert!(error.to_string().contains("/k/e"), "{error}");
    }

    #[test]
    fn a_record_from_before_replication_has_no_node_address() {
        let mut old: serde_json::Value = serde_json::from_slice(&encode(&node())).unwrap();
        old["addresses"].as_object_mut().unwrap().remove("node");
        let bytes = serde_json::to_vec(&old).unwrap();
        let decoded: NodeRecord = decode(b"k", &bytes).unwrap();
        assert_eq!(decoded.addresses.node, "");
        assert_eq!(decoded.addresses.nbd, "10.0.0.1:10809");
    }
}
