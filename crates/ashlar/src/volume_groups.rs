//! Volume groups: named, ordered sets of vdisks exported together as one iSCSI target (one
//! LUN per vdisk, in the group's disk order), with the initiators attached to them and their
//! CHAP secrets. One JSON record per group under `/ashlar/v1/volume-groups/<name>` in the
//! MetaStore, written with compare-and-swap transactions; the node keeps a copy in memory
//! that iSCSI logins read (control plane only, never per I/O).

use ashlar_meta::layout::{volume_group_key, volume_groups};
use ashlar_meta::{Compare, MetaStore, Txn, TxnOp};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

/// Most vdisks (LUNs) in one group.
pub const MAX_DISKS_PER_GROUP: usize = 256;
/// Most initiators attached to one group.
pub const MAX_ATTACHMENTS_PER_GROUP: usize = 256;
/// Shortest CHAP secret accepted (RFC 7143 12.1.3 asks for at least 96 bits).
const MIN_SECRET_BYTES: usize = 12;
/// Longest name, user or secret accepted.
const MAX_TEXT_BYTES: usize = 223;

/// A CHAP user and secret.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Chap {
    pub user: String,
    pub secret: String,
}

/// One initiator allowed to log in to the group's target.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Attachment {
    pub initiator: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chap: Option<Chap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_chap: Option<Chap>,
}

/// What the MetaStore holds for a group (format version 1 of the JSON record).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeGroupRecord {
    pub name: String,
    /// Vdisk names; LUN n is `disks[n]`.
    pub disks: Vec<String>,
    pub attachments: Vec<Attachment>,
    pub created_unix_seconds: u64,
}

impl VolumeGroupRecord {
    /// The iSCSI target name of the group.
    pub fn iqn(&self) -> String {
        target_iqn(&self.name)
    }

    pub fn attachment(&self, initiator: &str) -> Option<&Attachment> {
        self.attachments.iter().find(|a| a.initiator == initiator)
    }
}

pub fn target_iqn(group: &str) -> String {
    format!("{}{group}", ashlar_iscsi::TARGET_IQN_PREFIX)
}

#[derive(Debug, thiserror::Error)]
pub enum VgError {
    #[error("volume group '{0}' not found")]
    NotFound(String),
    #[error("volume group '{0}' already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    #[error("metadata store: {0}")]
    Meta(String),
    #[error("corrupt volume group record {key}: {reason}")]
    Corrupt { key: String, reason: String },
}

fn meta_error(error: impl std::fmt::Display) -> VgError {
    VgError::Meta(error.to_string())
}

/// Checks a group name: it becomes part of an IQN, so lowercase letters, digits, '-' and '.'.
pub fn validate_name(name: &str) -> Result<(), VgError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !name.starts_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(VgError::Invalid(format!(
            "invalid volume group name '{name}': use 1-64 lowercase letters, digits, '-' and '.', not starting with '-' or '.'"
        )))
    }
}

/// Checks an initiator name: an `iqn.`, `eui.` or `naa.` name without spaces or commas.
pub fn validate_initiator(name: &str) -> Result<(), VgError> {
    let ok = (name.starts_with("iqn.") || name.starts_with("eui.") || name.starts_with("naa."))
        && name.len() <= MAX_TEXT_BYTES
        && name.bytes().all(|b| b.is_ascii_graphic() && b != b',');
    if ok {
        Ok(())
    } else {
        Err(VgError::Invalid(format!(
            "invalid initiator name '{name}': expected an iSCSI name such as iqn.1994-05.com.redhat:host1"
        )))
    }
}

pub fn validate_chap(what: &str, chap: &Chap) -> Result<(), VgError> {
    if chap.user.is_empty()
        || chap.user.len() > MAX_TEXT_BYTES
        || !chap.user.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(VgError::Invalid(format!(
            "{what}: the user must be 1-{MAX_TEXT_BYTES} printable characters"
        )));
    }
    if chap.secret.len() < MIN_SECRET_BYTES
        || chap.secret.len() > MAX_TEXT_BYTES
        || !chap.secret.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(VgError::Invalid(format!(
            "{what}: the secret must be {MIN_SECRET_BYTES}-{MAX_TEXT_BYTES} printable characters"
        )));
    }
    Ok(())
}

/// Checks CHAP and mutual CHAP settings: each well-formed, mutual only with one-way.
pub fn validate_chap_pair(chap: Option<&Chap>, mutual: Option<&Chap>) -> Result<(), VgError> {
    if let Some(chap) = chap {
        validate_chap("--chap", chap)?;
    }
    if let Some(mutual) = mutual {
        validate_chap("--mutual-chap", mutual)?;
        if chap.is_none() {
            return Err(VgError::Invalid(
                "--mutual-chap needs --chap: the initiator authenticates first".into(),
            ));
        }
    }
    Ok(())
}

/// The key of the node-wide (volume group independent) discovery authentication record.
pub const DISCOVERY_AUTH_KEY: &str = "/ashlar/v1/iscsi-discovery-auth";

/// What SendTargets discovery sessions must prove, whatever group the initiator is
/// attached to (RFC 7143 12: discovery sessions may require CHAP too).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct DiscoveryAuth {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chap: Option<Chap>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mutual_chap: Option<Chap>,
}

/// The groups of a node: the MetaStore records and the copy logins read.
#[derive(Clone)]
pub struct VolumeGroups<M> {
    meta: M,
    cache: Arc<RwLock<BTreeMap<String, VolumeGroupRecord>>>,
    discovery: Arc<RwLock<DiscoveryAuth>>,
}

impl<M: MetaStore + Clone> VolumeGroups<M> {
    /// Loads every group record.
    pub async fn load(meta: M) -> Result<Self, VgError> {
        let kvs = meta
            .range(volume_groups(), None)
            .await
            .map_err(meta_error)?;
        let mut cache = BTreeMap::new();
        for kv in kvs {
            let record = decode(&kv.key, &kv.value)?;
            cache.insert(record.name.clone(), record);
        }
        let discovery = match meta
            .get(DISCOVERY_AUTH_KEY.as_bytes())
            .await
            .map_err(meta_error)?
        {
            Some(kv) => serde_json::from_slice(&kv.value).map_err(|e| VgError::Corrupt {
                key: DISCOVERY_AUTH_KEY.into(),
                reason: e.to_string(),
            })?,
            None => DiscoveryAuth::default(),
        };
        Ok(VolumeGroups {
            meta,
            cache: Arc::new(RwLock::new(cache)),
            discovery: Arc::new(RwLock::new(discovery)),
        })
    }

    /// What discovery sessions must prove now.
    pub fn discovery_auth(&self) -> DiscoveryAuth {
        self.discovery
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the discovery authentication (the whole record: last writer wins).
    pub async fn set_discovery_auth(&self, auth: DiscoveryAuth) -> Result<(), VgError> {
        validate_chap_pair(auth.chap.as_ref(), auth.mutual_chap.as_ref())?;
        let value = serde_json::to_vec(&auth).map_err(meta_error)?;
        self.meta
            .put(DISCOVERY_AUTH_KEY.as_bytes().to_vec(), value, None)
            .await
            .map_err(meta_error)?;
        *self.discovery.write().unwrap_or_else(|e| e.into_inner()) = auth;
        Ok(())
    }

    /// The MetaStore the records live in (iSCSI reservations live there too).
    pub fn meta(&self) -> &M {
        &self.meta
    }

    pub fn list(&self) -> Vec<VolumeGroupRecord> {
        self.read().values().cloned().collect()
    }

    pub fn get(&self, name: &str) -> Result<VolumeGroupRecord, VgError> {
        self.read()
            .get(name)
            .cloned()
            .ok_or_else(|| VgError::NotFound(name.into()))
    }

    /// The group whose target name is `iqn`.
    pub fn by_iqn(&self, iqn: &str) -> Option<VolumeGroupRecord> {
        let name = iqn.strip_prefix(ashlar_iscsi::TARGET_IQN_PREFIX)?;
        self.read().get(name).cloned()
    }

    pub async fn create(&self, name: &str) -> Result<VolumeGroupRecord, VgError> {
        validate_name(name)?;
        let record = VolumeGroupRecord {
            name: name.to_string(),
            disks: Vec::new(),
            attachments: Vec::new(),
            created_unix_seconds: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        let key = volume_group_key(name);
        let value = serde_json::to_vec(&record).map_err(meta_error)?;
        let response = self
            .meta
            .txn(
                Txn::new()
                    .when([Compare::absent(key.clone())])
                    .and_then([TxnOp::put(key, value, None)]),
            )
            .await
            .map_err(meta_error)?;
        if !response.succeeded {
            return Err(VgError::AlreadyExists(name.into()));
        }
        self.write().insert(name.to_string(), record.clone());
        Ok(record)
    }

    /// Deletes the group's record, and first its target's preferred-node record (a group
    /// created again under the name starts without one).
    pub async fn delete(&self, name: &str) -> Result<(), VgError> {
        crate::iscsi::failback::forget_preferred(&self.meta, name)
            .await
            .map_err(meta_error)?;
        let deleted = self
            .meta
            .delete(ashlar_meta::KeyRange::key(volume_group_key(name)))
            .await
            .map_err(meta_error)?;
        self.write().remove(name);
        if deleted == 0 {
            return Err(VgError::NotFound(name.into()));
        }
        Ok(())
    }

    /// Changes a group with `change`, atomically (retried if the record changed meanwhile).
    pub async fn update(
        &self,
        name: &str,
        change: impl Fn(&mut VolumeGroupRecord) -> Result<(), VgError>,
    ) -> Result<VolumeGroupRecord, VgError> {
        let key = volume_group_key(name);
        loop {
            let current = self
                .meta
                .get(&key)
                .await
                .map_err(meta_error)?
                .ok_or_else(|| VgError::NotFound(name.into()))?;
            let mut record = decode(&current.key, &current.value)?;
            change(&mut record)?;
            let value = serde_json::to_vec(&record).map_err(meta_error)?;
            let response = self
                .meta
                .txn(
                    Txn::new()
                        .when([Compare::mod_revision_equals(
                            key.clone(),
                            current.mod_revision,
                        )])
                        .and_then([TxnOp::put(key.clone(), value, None)]),
                )
                .await
                .map_err(meta_error)?;
            if response.succeeded {
                self.write().insert(name.to_string(), record.clone());
                return Ok(record);
            }
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, VolumeGroupRecord>> {
        self.cache.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, VolumeGroupRecord>> {
        self.cache.write().unwrap_or_else(|e| e.into_inner())
    }
}

fn decode(key: &[u8], value: &[u8]) -> Result<VolumeGroupRecord, VgError> {
    serde_json::from_slice(value).map_err(|e| VgError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason: e.to_string(),
    })
}

/// The changes `ashlar vg` makes, as functions over a record.
pub mod change {
    use super::*;

    pub fn add_disk(record: &mut VolumeGroupRecord, vdisk: &str) -> Result<(), VgError> {
        if record.disks.iter().any(|d| d == vdisk) {
            return Err(VgError::Conflict(format!(
                "vdisk '{vdisk}' is already in volume group '{}'",
                record.name
            )));
        }
        if record.disks.len() >= MAX_DISKS_PER_GROUP {
            return Err(VgError::Invalid(format!(
                "volume group '{}' has the most disks allowed ({MAX_DISKS_PER_GROUP})",
                record.name
            )));
        }
        record.disks.push(vdisk.to_string());
        Ok(())
    }

    pub fn remove_disk(record: &mut VolumeGroupRecord, vdisk: &str) -> Result<(), VgError> {
        let before = record.disks.len();
        record.disks.retain(|d| d != vdisk);
        if record.disks.len() == before {
            return Err(VgError::NotFound(format!(
                "vdisk '{vdisk}' in volume group '{}'",
                record.name
            )));
        }
        Ok(())
    }

    /// Attaches an initiator, or replaces its secrets if it is attached already.
    pub fn attach(record: &mut VolumeGroupRecord, attachment: &Attachment) -> Result<(), VgError> {
        validate_initiator(&attachment.initiator)?;
        validate_chap_pair(attachment.chap.as_ref(), attachment.mutual_chap.as_ref())?;
        record
            .attachments
            .retain(|a| a.initiator != attachment.initiator);
        if record.attachments.len() >= MAX_ATTACHMENTS_PER_GROUP {
            return Err(VgError::Invalid(format!(
                "volume group '{}' has the most attachments allowed ({MAX_ATTACHMENTS_PER_GROUP})",
                record.name
            )));
        }
        record.attachments.push(attachment.clone());
        Ok(())
    }

    pub fn detach(record: &mut VolumeGroupRecord, initiator: &str) -> Result<(), VgError> {
        let before = record.attachments.len();
        record.attachments.retain(|a| a.initiator != initiator);
        if record.attachments.len() == before {
            return Err(VgError::NotFound(format!(
                "initiator '{initiator}' attached to volume group '{}'",
                record.name
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> VolumeGroupRecord {
        VolumeGroupRecord {
            name: "vg1".into(),
            disks: vec![],
            attachments: vec![],
            created_unix_seconds: 0,
        }
    }

    #[test]
    fn names_and_secrets_are_checked() {
        assert!(validate_name("db-1.a").is_ok());
        assert!(validate_name("DB").is_err());
        assert!(validate_name("-x").is_err());
        assert!(validate_initiator("iqn.1994-05.com.redhat:host1").is_ok());
        assert!(validate_initiator("host1").is_err());
        assert!(validate_initiator("iqn.a,b").is_err());
        let short = Chap {
            user: "u".into(),
            secret: "short".into(),
        };
        assert!(validate_chap("--chap", &short).is_err());
    }

    #[test]
    fn changes_keep_order_and_refuse_nonsense() {
        let mut r = record();
        change::add_disk(&mut r, "a").unwrap();
        change::add_disk(&mut r, "b").unwrap();
        assert!(change::add_disk(&mut r, "a").is_err());
        change::remove_disk(&mut r, "a").unwrap();
        assert_eq!(r.disks, vec!["b".to_string()]);
        assert!(change::remove_disk(&mut r, "a").is_err());
        let attachment = Attachment {
            initiator: "iqn.x:y".into(),
            chap: None,
            mutual_chap: Some(Chap {
                user: "t".into(),
                secret: "0123456789abc".into(),
            }),
        };
        assert!(change::attach(&mut r, &attachment).is_err());
        let attachment = Attachment {
            mutual_chap: None,
            ..attachment
        };
        change::attach(&mut r, &attachment).unwrap();
        change::attach(&mut r, &attachment).unwrap();
        assert_eq!(r.attachments.len(), 1);
        change::detach(&mut r, "iqn.x:y").unwrap();
        assert!(change::detach(&mut r, "iqn.x:y").is_err());
        assert_eq!(r.iqn(), "iqn.2024-01.io.ashlar:vg1");
    }
}
