//! The vdisk catalog in the MetaStore: one JSON record per vdisk under
//! `/ashlar/v1/vdisks/<name>` and a counter `/ashlar/v1/ids/next-vdisk-id` so ids are never
//! reused. Only control-plane operations come here, never client I/O.
//!
//! A deleted vdisk leaves a tombstone `/ashlar/v1/tombstones/<id>` until its data is gone, so
//! startup can tell data it may remove (a delete cut short) from data it cannot account for
//! (which it sets aside, never deletes).

use ashlar_core::VdiskId;
use ashlar_meta::{Compare, KeyRange, MetaStore, Txn, TxnOp};
use serde::{Deserialize, Serialize};

const VDISK_PREFIX: &str = "/ashlar/v1/vdisks/";
const NEXT_VDISK_ID_KEY: &str = "/ashlar/v1/ids/next-vdisk-id";
const TOMBSTONE_PREFIX: &str = "/ashlar/v1/tombstones/";

/// What the catalog stores for a vdisk (format version 1 of the JSON record).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VdiskRecord {
    pub id: VdiskId,
    pub name: String,
    pub size_bytes: u64,
    pub shards: u32,
    pub replication_factor: u8,
    pub block_size_bytes: u32,
    pub created_unix_seconds: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("vdisk '{0}' already exists")]
    AlreadyExists(String),
    #[error("metadata store: {0}")]
    Meta(String),
    #[error("corrupt catalog record {key}: {reason}")]
    Corrupt { key: String, reason: String },
}

fn vdisk_key(name: &str) -> Vec<u8> {
    format!("{VDISK_PREFIX}{name}").into_bytes()
}

fn meta_error(error: impl std::fmt::Display) -> CatalogError {
    CatalogError::Meta(error.to_string())
}

fn decode(key: &[u8], value: &[u8]) -> Result<VdiskRecord, CatalogError> {
    serde_json::from_slice(value).map_err(|e| CatalogError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason: e.to_string(),
    })
}

pub async fn list<M: MetaStore>(meta: &M) -> Result<Vec<VdiskRecord>, CatalogError> {
    let kvs = meta
        .range(KeyRange::Prefix(VDISK_PREFIX.as_bytes().to_vec()), None)
        .await
        .map_err(meta_error)?;
    kvs.iter().map(|kv| decode(&kv.key, &kv.value)).collect()
}

/// Creates the record, allocating a fresh id, atomically: fails if the name exists.
pub async fn create<M: MetaStore>(
    meta: &M,
    mut record: VdiskRecord,
) -> Result<VdiskRecord, CatalogError> {
    let key = vdisk_key(&record.name);
    loop {
        let counter = meta
            .get(NEXT_VDISK_ID_KEY.as_bytes())
            .await
            .map_err(meta_error)?;
        let (next_id, counter_revision) = match &counter {
            Some(kv) => {
                let text = String::from_utf8_lossy(&kv.value);
                let id = text
                    .trim()
                    .parse::<u64>()
                    .map_err(|e| CatalogError::Corrupt {
                        key: NEXT_VDISK_ID_KEY.into(),
                        reason: e.to_string(),
                    })?;
                (id, kv.mod_revision)
            }
            None => (1, ashlar_meta::Revision(0)),
        };
        record.id = VdiskId(next_id);
        let value = serde_json::to_vec(&record).map_err(meta_error)?;
        let txn = Txn {
            compares: vec![
                Compare::mod_revision_equals(
                    NEXT_VDISK_ID_KEY.as_bytes().to_vec(),
                    counter_revision,
                ),
                Compare::absent(key.clone()),
            ],
            success: vec![
                TxnOp::Put {
                    key: NEXT_VDISK_ID_KEY.as_bytes().to_vec(),
                    value: (next_id + 1).to_string().into_bytes(),
                    lease: None,
                },
                TxnOp::Put {
                    key: key.clone(),
                    value,
                    lease: None,
                },
            ],
            failure: vec![],
        };
        if meta.txn(txn).await.map_err(meta_error)?.succeeded {
            return Ok(record);
        }
        if meta.get(&key).await.map_err(meta_error)?.is_some() {
            return Err(CatalogError::AlreadyExists(record.name));
        }
        // Lost a race on the id counter only: try again with the new value.
    }
}

pub async fn update<M: MetaStore>(meta: &M, record: &VdiskRecord) -> Result<(), CatalogError> {
    let value = serde_json::to_vec(record).map_err(meta_error)?;
    meta.put(vdisk_key(&record.name), value, None)
        .await
        .map_err(meta_error)?;
    Ok(())
}

fn tombstone_key(id: VdiskId) -> Vec<u8> {
    format!("{TOMBSTONE_PREFIX}{id}").into_bytes()
}

/// Removes the vdisk's record and leaves a tombstone for its id, in one transaction: from
/// then on its data may be removed, here or by a later startup.
pub async fn delete<M: MetaStore>(meta: &M, record: &VdiskRecord) -> Result<(), CatalogError> {
    let txn = Txn {
        compares: vec![],
        success: vec![
            TxnOp::Delete {
                range: KeyRange::Key(vdisk_key(&record.name)),
            },
            TxnOp::Put {
                key: tombstone_key(record.id),
                value: record.name.clone().into_bytes(),
                lease: None,
            },
        ],
        failure: vec![],
    };
    meta.txn(txn).await.map_err(meta_error)?;
    Ok(())
}

/// Ids of deleted vdisks whose data may still be on disk.
pub async fn tombstones<M: MetaStore>(
    meta: &M,
) -> Result<std::collections::HashSet<VdiskId>, CatalogError> {
    let kvs = meta
        .range(KeyRange::Prefix(TOMBSTONE_PREFIX.as_bytes().to_vec()), None)
        .await
        .map_err(meta_error)?;
    kvs.iter().map(|kv| tombstone_id(&kv.key)).collect()
}

/// The keys of tombstones, for a watch: another node deleting a vdisk writes one.
pub fn tombstone_range() -> KeyRange {
    KeyRange::Prefix(TOMBSTONE_PREFIX.as_bytes().to_vec())
}

/// The vdisk a tombstone key names.
pub fn tombstone_id(key: &[u8]) -> Result<VdiskId, CatalogError> {
    let key = String::from_utf8_lossy(key);
    key.strip_prefix(TOMBSTONE_PREFIX)
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
        .map(VdiskId)
        .ok_or_else(|| CatalogError::Corrupt {
            key: key.clone().into_owned(),
            reason: "tombstone key does not end in a vdisk id".into(),
        })
}

/// Forgets the tombstone once the vdisk's data is gone.
pub async fn remove_tombstone<M: MetaStore>(meta: &M, id: VdiskId) -> Result<(), CatalogError> {
    meta.delete(KeyRange::Key(tombstone_key(id)))
        .await
        .map_err(meta_error)?;
    Ok(())
}

/// Vdisk names are used in NBD export names, URLs and file names: keep them plain.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 {
        return Err("a vdisk name must be 1 to 64 characters long".into());
    }
    if name.starts_with('.') || name.starts_with('-') {
        return Err("a vdisk name must not start with '.' or '-'".into());
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "character '{bad}' is not allowed in a vdisk name (use letters, digits, '.', '_', '-')"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(validate_name("db1").is_ok());
        assert!(validate_name("a.b_c-d").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("../x").is_err());
        assert!(validate_name("a/b").is_err());
        assert!(validate_name("-x").is_err());
        assert!(validate_name(&"x".repeat(65)).is_err());
    }
}
