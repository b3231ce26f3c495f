//! Key layout of the cluster records (docs/cluster-metadata.md). Everything lives under
//! `/ashlar/v1/cluster/`, beside the vdisk catalog's `/ashlar/v1/vdisks/`.

use ashlar_core::VdiskId;
use ashlar_meta::KeyRange;

use crate::node_id::NodeId;

/// Persistent member records (no lease): a node stays listed, as down, until removed.
pub const MEMBERS_PREFIX: &str = "/ashlar/v1/cluster/members/";
/// Live records, attached to the node's lease: present exactly while the node is up.
pub const LIVE_PREFIX: &str = "/ashlar/v1/cluster/live/";
/// Owner records, attached to the owning node's lease.
pub const OWNERS_PREFIX: &str = "/ashlar/v1/cluster/owners/";
/// Persistent per-vdisk epoch records (no lease): the highest ownership epoch ever granted.
pub const EPOCHS_PREFIX: &str = "/ashlar/v1/cluster/epochs/";
/// Persistent per-vdisk placement records (no lease): the nodes holding its copies.
pub const PLACEMENT_PREFIX: &str = "/ashlar/v1/cluster/placement/";
/// Resyncs in progress, one record per vdisk (no lease: a record of a node that is down or
/// no longer owns the vdisk is ignored, and replaced by the next resync).
pub const RESYNC_PREFIX: &str = "/ashlar/v1/cluster/resync/";
/// Draining nodes, one record each (no lease: a drain lasts until it is cancelled).
pub const DRAINS_PREFIX: &str = "/ashlar/v1/cluster/drain/";
/// The cluster secret node-to-node connections authenticate with (when not given in a file).
pub const SECRET_KEY: &str = "/ashlar/v1/cluster/secret";

pub fn member_key(node: NodeId) -> Vec<u8> {
    format!("{MEMBERS_PREFIX}{node}").into_bytes()
}

pub fn live_key(node: NodeId) -> Vec<u8> {
    format!("{LIVE_PREFIX}{node}").into_bytes()
}

/// Vdisks are named by id, not name: ids are never reused (they come from a counter), so a
/// vdisk deleted and created again under the same name starts a history of its own.
pub fn owner_key(vdisk: VdiskId) -> Vec<u8> {
    format!("{OWNERS_PREFIX}{vdisk}").into_bytes()
}

pub fn epoch_key(vdisk: VdiskId) -> Vec<u8> {
    format!("{EPOCHS_PREFIX}{vdisk}").into_bytes()
}

pub fn placement_key(vdisk: VdiskId) -> Vec<u8> {
    format!("{PLACEMENT_PREFIX}{vdisk}").into_bytes()
}

pub fn resync_key(vdisk: VdiskId) -> Vec<u8> {
    format!("{RESYNC_PREFIX}{vdisk}").into_bytes()
}

pub fn drain_key(node: NodeId) -> Vec<u8> {
    format!("{DRAINS_PREFIX}{node}").into_bytes()
}

pub fn drains() -> KeyRange {
    KeyRange::prefix(DRAINS_PREFIX)
}

pub fn resyncs() -> KeyRange {
    KeyRange::prefix(RESYNC_PREFIX)
}

pub fn placements() -> KeyRange {
    KeyRange::prefix(PLACEMENT_PREFIX)
}

pub fn epochs() -> KeyRange {
    KeyRange::prefix(EPOCHS_PREFIX)
}

pub fn members() -> KeyRange {
    KeyRange::prefix(MEMBERS_PREFIX)
}

pub fn live_nodes() -> KeyRange {
    KeyRange::prefix(LIVE_PREFIX)
}

pub fn owners() -> KeyRange {
    KeyRange::prefix(OWNERS_PREFIX)
}

/// The vdisk an owner key names (`VdiskId` prints as 16 hex digits).
pub fn vdisk_of_owner_key(key: &[u8]) -> Option<VdiskId> {
    let hex = std::str::from_utf8(key.strip_prefix(OWNERS_PREFIX.as_bytes())?).ok()?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
        .map(VdiskId)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_sit_under_their_prefixes_and_parse_back() {
        let node = NodeId::new(7).unwrap();
        assert!(members().contains(&member_key(node)));
        assert!(live_nodes().contains(&live_key(node)));
        assert!(!members().contains(&live_key(node)));
        let vdisk = VdiskId(0x2a);
        assert_eq!(
            owner_key(vdisk),
            b"/ashlar/v1/cluster/owners/000000000000002a"
        );
        assert_eq!(vdisk_of_owner_key(&owner_key(vdisk)), Some(vdisk));
        assert_eq!(vdisk_of_owner_key(&epoch_key(vdisk)), None);
        assert!(owners().contains(&owner_key(vdisk)));
        assert!(!owners().contains(&epoch_key(vdisk)));
        for prefix in [
            MEMBERS_PREFIX,
            LIVE_PREFIX,
            OWNERS_PREFIX,
            EPOCHS_PREFIX,
            PLACEMENT_PREFIX,
            RESYNC_PREFIX,
            SECRET_KEY,
        ] {
            assert!(prefix.starts_with(ashlar_meta::layout::ROOT));
        }
    }
}
