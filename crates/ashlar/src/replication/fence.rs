//! The highest owner epoch this node has seen for each vdisk it holds a copy of, kept on
//! disk so that a restart cannot forget it: a replica refuses every record of an older epoch,
//! so an owner that lost its claim can acknowledge nothing once the new owner fenced it.
//!
//! One small file per vdisk, `DATA_DIR/replica-fences/<vdisk id>`: the epoch as a
//! little-endian u64, a magic and a CRC32C (16 bytes), written to a temporary file, synced,
//! renamed over the old one, and the directory synced, before the new epoch is used.

use ashlar_core::VdiskId;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 4] = b"AFEN";
const FILE_BYTES: usize = 16;

/// What the fence says of a record's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// As new as anything seen: apply it.
    Admit,
    /// Older than `highest`: refuse it.
    Fenced { highest: u64 },
}

/// The fences of every vdisk, loaded from disk on first use. One owner: the receiver's
/// control loop (the intakes only follow what it tells them).
pub struct Fences {
    dir: PathBuf,
    highest: HashMap<VdiskId, u64>,
}

impl Fences {
    pub fn new(data_dir: &Path) -> Fences {
        Fences {
            dir: data_dir.join("replica-fences"),
            highest: HashMap::new(),
        }
    }

    /// The highest owner epoch seen for `vdisk` (0: none).
    pub async fn highest(&mut self, vdisk: VdiskId) -> std::io::Result<u64> {
        if let Some(highest) = self.highest.get(&vdisk) {
            return Ok(*highest);
        }
        let dir = self.dir.clone();
        let loaded = blocking(move || load(&dir, vdisk)).await?;
        self.highest.insert(vdisk, loaded);
        Ok(loaded)
    }

    /// Admits `epoch` for `vdisk`, persisting it first when it is higher than any seen. The
    /// file I/O (the first use of a vdisk, the first record of a new epoch) runs on the
    /// blocking pool.
    pub async fn admit(&mut self, vdisk: VdiskId, epoch: u64) -> std::io::Result<Verdict> {
        let highest = self.highest(vdisk).await?;
        if epoch < highest {
            return Ok(Verdict::Fenced { highest });
        }
        if epoch > highest {
            let dir = self.dir.clone();
            blocking(move || store(&dir, vdisk, epoch)).await?;
            self.highest.insert(vdisk, epoch);
        }
        Ok(Verdict::Admit)
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?
}

fn path(dir: &Path, vdisk: VdiskId) -> PathBuf {
    dir.join(vdisk.to_string())
}

fn load(dir: &Path, vdisk: VdiskId) -> std::io::Result<u64> {
    let path = path(dir, vdisk);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    decode(&bytes).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "replica fence file {} is damaged (bad size, magic or CRC); refusing to \
                     guess the highest owner epoch",
                path.display()
            ),
        )
    })
}

fn store(dir: &Path, vdisk: VdiskId, epoch: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = path(dir, vdisk);
    let temporary = path.with_extension("new");
    let mut file = std::fs::File::create(&temporary)?;
    file.write_all(&encode(epoch))?;
    file.sync_all()?;
    std::fs::rename(&temporary, &path)?;
    std::fs::File::open(dir)?.sync_all()
}

fn encode(epoch: u64) -> [u8; FILE_BYTES] {
    let mut bytes = [0u8; FILE_BYTES];
    bytes[..4].copy_from_slice(MAGIC);
    bytes[4..12].copy_from_slice(&epoch.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[..12]);
    bytes[12..].copy_from_slice(&crc.to_le_bytes());
    bytes
}

fn decode(bytes: &[u8]) -> Option<u64> {
    if bytes.len() != FILE_BYTES || &bytes[..4] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(bytes[12..16].try_into().ok()?);
    (crc == crc32c::crc32c(&bytes[..12]))
        .then(|| u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn epochs_only_grow_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let vdisk = VdiskId(3);
        let mut fences = Fences::new(dir.path());
        assert_eq!(fences.admit(vdisk, 2).await.unwrap(), Verdict::Admit);
        assert_eq!(fences.admit(vdisk, 2).await.unwrap(), Verdict::Admit);
        assert_eq!(
            fences.admit(vdisk, 1).await.unwrap(),
            Verdict::Fenced { highest: 2 }
        );
        assert_eq!(fences.admit(vdisk, 5).await.unwrap(), Verdict::Admit);
        // Another vdisk has its own fence.
        assert_eq!(fences.admit(VdiskId(4), 1).await.unwrap(), Verdict::Admit);
        let mut restarted = Fences::new(dir.path());
        assert_eq!(
            restarted.admit(vdisk, 4).await.unwrap(),
            Verdict::Fenced { highest: 5 }
        );
    }

    #[tokio::test]
    async fn a_damaged_fence_file_is_an_error_not_a_zero() {
        let dir = tempfile::tempdir().unwrap();
        let vdisk = VdiskId(3);
        Fences::new(dir.path()).admit(vdisk, 9).await.unwrap();
        let path = dir.path().join("replica-fences").join(vdisk.to_string());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[5] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let error = Fences::new(dir.path()).admit(vdisk, 1).await.unwrap_err();
        assert!(error.to_string().contains("damaged"), "{error}");
    }
}
