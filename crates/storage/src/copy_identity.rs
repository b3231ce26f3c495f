//! A vdisk copy's identity: a random 128-bit value kept in a small file in each of the
//! vdisk's directories (its oplog directory and its extent directory on every disk), drawn
//! anew whenever the copy's content may have changed by anything but the writes it took.
//!
//! A claimant compares the identity a copy answers its fence with to the one it answered
//! before: the same identity means the copy holds everything it acknowledged since and
//! nothing else changed it, so the claimant needs to compare only the chunks its own failed
//! writes touched (`docs/replication.md`, "Catching up"). So the identity is kept across a
//! restart only when every one of its files is there, intact and equal, and the caller
//! found nothing lost (an oplog replay that lost records asks for a new one). A directory
//! removed with the copy's data, a disk that came back empty, a file torn by a power cut:
//! each leaves a file missing or different, and a new identity follows.
//!
//! File format (version 1, `docs/replication.md`): one 4 KiB block, little-endian.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "ASHLCPID"
//!      8     4  version (1)
//!     12     4  zero
//!     16    16  identity (u128)
//!     32     4  CRC32C of bytes 0..32
//!     36  4060  zero
//! ```

use crate::fs::{DiskFile, Filesystem, DIRECT_IO_ALIGNMENT_BYTES};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Name of the identity file in each of a vdisk's directories.
pub const COPY_IDENTITY_FILE: &str = "copy-identity";
const TEMPORARY_FILE: &str = "copy-identity.new";
const MAGIC: &[u8; 8] = b"ASHLCPID";
const VERSION: u32 = 1;
const FILE_BYTES: usize = DIRECT_IO_ALIGNMENT_BYTES as usize;
const CHECKSUMMED_BYTES: usize = 32;

/// Which content a vdisk copy holds, as far as a claimant needs to know (see the module).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyIdentity(pub u128);

impl fmt::Debug for CopyIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CopyIdentity({:032x})", self.0)
    }
}

impl fmt::Display for CopyIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// What [`establish`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Established {
    pub identity: CopyIdentity,
    /// Why a new identity was drawn; `None` when the one on disk was kept.
    pub renewed: Option<String>,
}

/// The vdisk's identity from its files in `dirs`, kept when they all hold the same one and
/// `renew` gives no reason to change it; else `fresh` is written to every directory
/// (created if missing) and made durable before this returns.
pub async fn establish<F: Filesystem>(
    fs: &F,
    dirs: &[PathBuf],
    renew: Option<String>,
    fresh: CopyIdentity,
) -> io::Result<Established> {
    assert!(!dirs.is_empty(), "a vdisk has at least one directory");
    let reason = match renew {
        Some(reason) => reason,
        None => match read_all(fs, dirs).await {
            Ok(identity) => {
                return Ok(Established {
                    identity,
                    renewed: None,
                })
            }
            Err(reason) => reason,
        },
    };
    for dir in dirs {
        write(fs, dir, fresh).await?;
    }
    Ok(Established {
        identity: fresh,
        renewed: Some(reason),
    })
}

/// The identity every directory holds, or why there is none.
async fn read_all<F: Filesystem>(fs: &F, dirs: &[PathBuf]) -> Result<CopyIdentity, String> {
    let mut found: Option<CopyIdentity> = None;
    for dir in dirs {
        let path = dir.join(COPY_IDENTITY_FILE);
        let identity = read(fs, &path)
            .await
            .map_err(|why| format!("{}: {why}", path.display()))?;
        match found {
            Some(other) if other != identity => {
                return Err(format!(
                    "{} names another identity than the vdisk's other directories",
                    path.display()
                ))
            }
            _ => found = Some(identity),
        }
    }
    Ok(found.expect("at least one directory"))
}

async fn read<F: Filesystem>(fs: &F, path: &Path) -> Result<CopyIdentity, String> {
    let file = match fs.open(path, false).await {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err("missing".into()),
        Err(e) => return Err(format!("cannot open: {e}")),
    };
    let length = file.len().await.map_err(|e| format!("cannot stat: {e}"))?;
    if length != FILE_BYTES as u64 {
        return Err(format!("{length} bytes instead of {FILE_BYTES}"));
    }
    let mut block = vec![0u8; FILE_BYTES];
    file.read_at(&mut block, 0)
        .await
        .map_err(|e| format!("cannot read: {e}"))?;
    decode(&block)
}

async fn write<F: Filesystem>(fs: &F, dir: &Path, identity: CopyIdentity) -> io::Result<()> {
    fs.create_dir_all(dir).await?;
    let temporary = dir.join(TEMPORARY_FILE);
    let file = fs.open(&temporary, true).await?;
    // A leftover from an interrupted renewal is the same size: this write replaces all of
    // it, and RWF_DSYNC makes bytes and size durable before the rename can be.
    file.write_durable_at(&encode(identity), 0).await?;
    drop(file);
    fs.rename(&temporary, &dir.join(COPY_IDENTITY_FILE)).await?;
    fs.sync_dir(dir).await
}

fn encode(identity: CopyIdentity) -> Vec<u8> {
    let mut block = vec![0u8; FILE_BYTES];
    block[0..8].copy_from_slice(MAGIC);
    block[8..12].copy_from_slice(&VERSION.to_le_bytes());
    block[16..32].copy_from_slice(&identity.0.to_le_bytes());
    let crc = crc32c::crc32c(&block[..CHECKSUMMED_BYTES]);
    block[32..36].copy_from_slice(&crc.to_le_bytes());
    block
}

fn decode(block: &[u8]) -> Result<CopyIdentity, String> {
    let crc = u32::from_le_bytes(block[32..36].try_into().expect("4 bytes"));
    if crc32c::crc32c(&block[..CHECKSUMMED_BYTES]) != crc {
        return Err("checksum mismatch".into());
    }
    if &block[0..8] != MAGIC {
        return Err("wrong magic".into());
    }
    let version = u32::from_le_bytes(block[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(format!("unknown version {version}"));
    }
    Ok(CopyIdentity(u128::from_le_bytes(
        block[16..32].try_into().expect("16 bytes"),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fs::sim::CutPolicy;
    use crate::fs::{IoMode, SimFs, StdFs};

    fn dirs(root: &Path) -> Vec<PathBuf> {
        vec![
            root.join("oplog/v"),
            root.join("d0/extents/v"),
            root.join("d1/extents/v"),
        ]
    }

    #[tokio::test]
    async fn kept_while_every_file_agrees_renewed_otherwise() {
        let root = tempfile::tempdir().unwrap();
        let dirs = dirs(root.path());
        let fs = StdFs;
        let first = establish(&fs, &dirs, None, CopyIdentity(1)).await.unwrap();
        assert_eq!(first.identity, CopyIdentity(1));
        assert!(first.renewed.unwrap().contains("missing"));

        let kept = establish(&fs, &dirs, None, CopyIdentity(2)).await.unwrap();
        assert_eq!(
            kept,
            Established {
                identity: CopyIdentity(1),
                renewed: None
            }
        );

        let asked = establish(
            &fs,
            &dirs,
            Some("replay lost records".into()),
            CopyIdentity(3),
        )
        .await
        .unwrap();
        assert_eq!(asked.identity, CopyIdentity(3));
        assert_eq!(asked.renewed.as_deref(), Some("replay lost records"));

        // A disk that came back empty.
        std::fs::remove_dir_all(&dirs[2]).unwrap();
        let after_wipe = establish(&fs, &dirs, None, CopyIdentity(4)).await.unwrap();
        assert_eq!(after_wipe.identity, CopyIdentity(4));
        assert!(after_wipe.renewed.unwrap().contains("missing"));

        // A flipped byte anywhere in the checksummed part.
        let path = dirs[1].join(COPY_IDENTITY_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[20] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let after_flip = establish(&fs, &dirs, None, CopyIdentity(5)).await.unwrap();
        assert_eq!(after_flip.identity, CopyIdentity(5));
        assert!(after_flip.renewed.unwrap().contains("checksum"));

        // One directory left behind by a crash in the middle of a renewal.
        let behind = encode(CopyIdentity(6));
        std::fs::write(dirs[0].join(COPY_IDENTITY_FILE), behind).unwrap();
        let after_mix = establish(&fs, &dirs, None, CopyIdentity(7)).await.unwrap();
        assert_eq!(after_mix.identity, CopyIdentity(7));
        assert!(after_mix.renewed.unwrap().contains("another identity"));
        let kept = establish(&fs, &dirs, None, CopyIdentity(8)).await.unwrap();
        assert_eq!(kept.identity, CopyIdentity(7));
    }

    /// A power cut right after `establish` returns keeps what it wrote.
    #[tokio::test]
    async fn an_established_identity_survives_a_power_cut() {
        let fs = SimFs::new(IoMode::Direct);
        let dirs = dirs(Path::new("/data"));
        establish(&fs, &dirs, None, CopyIdentity(9)).await.unwrap();
        fs.power_cut(CutPolicy::DropAll);
        let again = establish(&fs, &dirs, None, CopyIdentity(10)).await.unwrap();
        assert_eq!(
            again,
            Established {
                identity: CopyIdentity(9),
                renewed: None
            }
        );
    }
}
