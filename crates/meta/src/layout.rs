//! Key layout conventions shared by every user of the MetaStore. All keys
//! live under a versioned root so a future layout can coexist during a
//! migration; values are JSON documents unless noted (see docs/metastore.md).

use crate::types::KeyRange;

/// Root of every Ashlar key; the version is bumped only for incompatible layouts.
pub const ROOT: &str = "/ashlar/v1/";

/// Prefix of vdisk records: `/ashlar/v1/vdisks/<name>` -> JSON.
pub const VDISKS_PREFIX: &str = "/ashlar/v1/vdisks/";

/// Counter for allocating vdisk ids: decimal i64 text, bumped with a CAS txn
/// guarded on the key's `mod_revision` (or `Compare::absent` for the first id).
pub const NEXT_VDISK_ID: &str = "/ashlar/v1/ids/next-vdisk-id";

/// Prefix of volume group records: `/ashlar/v1/volume-groups/<name>` -> JSON.
pub const VOLUME_GROUPS_PREFIX: &str = "/ashlar/v1/volume-groups/";

/// The key of volume group `name`.
pub fn volume_group_key(name: &str) -> Vec<u8> {
    format!("{VOLUME_GROUPS_PREFIX}{name}").into_bytes()
}

/// Every volume group record.
pub fn volume_groups() -> KeyRange {
    KeyRange::prefix(VOLUME_GROUPS_PREFIX)
}

/// The key of vdisk `name`.
pub fn vdisk_key(name: &str) -> Vec<u8> {
    format!("{VDISKS_PREFIX}{name}").into_bytes()
}

/// Every vdisk record.
pub fn vdisks() -> KeyRange {
    KeyRange::prefix(VDISKS_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vdisk_keys_are_under_the_prefix() {
        let key = vdisk_key("db1");
        assert_eq!(key, b"/ashlar/v1/vdisks/db1");
        assert!(vdisks().contains(&key));
        assert!(key.starts_with(ROOT.as_bytes()));
        assert!(NEXT_VDISK_ID.starts_with(ROOT));
        let group = volume_group_key("vg1");
        assert!(volume_groups().contains(&group));
        assert!(!vdisks().contains(&group));
    }
}
