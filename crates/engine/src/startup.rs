//! What startup does with the data it finds: data of a vdisk the catalog names is kept, data
//! of a deleted vdisk (a tombstone in the catalog) is removed, and anything else is set aside
//! in `<disk>/quarantine/`, never deleted. A lost or stale metadata file must never cost the
//! data it no longer describes.

use ashlar_core::VdiskId;
use ashlar_storage::disk::Disk;
use ashlar_storage::fs::{remove_tree, Filesystem};
use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};

/// Directories of a disk that hold one subdirectory per vdisk, named by its id.
pub const VDISK_AREAS: [&str; 2] = ["extents", "oplog"];
/// Where data that no catalog entry accounts for is moved.
pub const QUARANTINE_DIR: &str = "quarantine";

/// What startup did with vdisk directories the catalog does not name.
#[derive(Debug, Default)]
pub struct DataAccount {
    /// Ids of deleted vdisks some of whose data could not be removed (tombstones stay).
    pub failed: HashSet<VdiskId>,
    /// Directories moved aside, as (original path, new path).
    pub quarantined: Vec<(PathBuf, PathBuf)>,
}

fn parse_vdisk_dir(name: &str) -> Option<VdiskId> {
    (name.len() == 16)
        .then(|| u64::from_str_radix(name, 16).ok())
        .flatten()
        .map(VdiskId)
}

/// Creates each disk's directory and its vdisk areas, durably. The disk directory's own
/// entry is synced even when it exists: whoever made it (a CLI run, an operator) may not have.
pub async fn prepare_disks<F: Filesystem>(fs: &F, disks: &[Disk]) -> io::Result<()> {
    for disk in disks {
        fs.create_dir_all(&disk.path).await?;
        if let Some(parent) = disk.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs.sync_dir(parent).await?;
        }
        for area in VDISK_AREAS {
            fs.create_dir_all(&disk.path.join(area)).await?;
        }
    }
    Ok(())
}

/// Sorts every vdisk directory on the disks into kept (`known`), removed (`deleted`) and
/// quarantined (anything else).
pub async fn account_for_data<F: Filesystem>(
    fs: &F,
    disks: &[Disk],
    known: &HashSet<VdiskId>,
    deleted: &HashSet<VdiskId>,
    now_unix_seconds: u64,
) -> io::Result<DataAccount> {
    let mut account = DataAccount::default();
    for disk in disks {
        for area in VDISK_AREAS {
            let area_dir = disk.path.join(area);
            for entry in fs.list_dir(&area_dir).await? {
                let path = area_dir.join(&entry.name);
                match parse_vdisk_dir(&entry.name) {
                    Some(id) if known.contains(&id) => {}
                    Some(id) if deleted.contains(&id) => {
                        tracing::info!(path = %path.display(), "removing data of a deleted vdisk");
                        match remove_tree(fs, &path).await {
                            Ok(()) => {}
                            Err(error) => {
                                // Left for the next start; the tombstone stays meanwhile.
                                tracing::error!(path = %path.display(), %error,
                                    "cannot remove data of a deleted vdisk; will retry at the next start");
                                account.failed.insert(id);
                            }
                        }
                    }
                    _ => {
                        match quarantine(fs, disk, area, &entry.name, now_unix_seconds, &path).await
                        {
                            Ok(aside) => {
                                tracing::warn!(path = %path.display(), moved_to = %aside.display(),
                                    "found data that no vdisk in the catalog accounts for; moved it aside \
                                     (nothing was deleted: inspect it, then remove it by hand)");
                                account.quarantined.push((path, aside));
                            }
                            Err(error) => tracing::error!(path = %path.display(), %error,
                                "found data that no vdisk in the catalog accounts for and could not \
                                 move it aside; left it where it is"),
                        }
                    }
                }
            }
        }
    }
    Ok(account)
}

/// Moves `path` to `<disk>/quarantine/<area>-<name>-<time>` and makes the move durable.
async fn quarantine<F: Filesystem>(
    fs: &F,
    disk: &Disk,
    area: &str,
    name: &str,
    now_unix_seconds: u64,
    path: &Path,
) -> io::Result<PathBuf> {
    let dir = disk.path.join(QUARANTINE_DIR);
    fs.create_dir_all(&dir).await?;
    let mut aside = dir.join(format!("{area}-{name}-{now_unix_seconds}"));
    let mut attempt = 1;
    while fs.exists(&aside).await? {
        attempt += 1;
        aside = dir.join(format!("{area}-{name}-{now_unix_seconds}-{attempt}"));
    }
    fs.rename(path, &aside).await?;
    fs.sync_dir(&dir).await?;
    if let Some(parent) = path.parent() {
        fs.sync_dir(parent).await?;
    }
    Ok(aside)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ashlar_storage::disk::Tier;
    use ashlar_storage::fs::StdFs;

    #[tokio::test]
    async fn unknown_data_is_set_aside_and_deleted_data_removed() {
        let root = tempfile::tempdir().unwrap();
        let disk = Disk {
            path: root.path().join("disk0"),
            tier: Tier::Fast,
        };
        let fs = StdFs;
        prepare_disks(&fs, std::slice::from_ref(&disk))
            .await
            .unwrap();
        let (kept, deleted, unknown) = (VdiskId(1), VdiskId(2), VdiskId(3));
        for id in [kept, deleted, unknown] {
            let dir = disk.path.join("extents").join(id.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("0000000000000000.egroup"), b"data").unwrap();
        }
        std::fs::create_dir_all(disk.path.join("oplog").join("not-a-vdisk")).unwrap();
        let account = account_for_data(
            &fs,
            std::slice::from_ref(&disk),
            &HashSet::from([kept]),
            &HashSet::from([deleted]),
            1234,
        )
        .await
        .unwrap();
        assert!(disk.path.join("extents").join(kept.to_string()).exists());
        assert!(!disk.path.join("extents").join(deleted.to_string()).exists());
        assert!(account.failed.is_empty());
        assert_eq!(account.quarantined.len(), 2);
        let aside = disk
            .path
            .join(QUARANTINE_DIR)
            .join(format!("extents-{unknown}-1234"));
        assert_eq!(
            std::fs::read(aside.join("0000000000000000.egroup")).unwrap(),
            b"data"
        );
        assert!(disk
            .path
            .join(QUARANTINE_DIR)
            .join("oplog-not-a-vdisk-1234")
            .is_dir());
    }
}
