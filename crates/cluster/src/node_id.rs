//! A node's identity: a random 128-bit id, generated once per data directory and kept in
//! `<data-dir>/node-id`, so a node that restarts (or moves to another address) is the same
//! member of the cluster, and two data directories are never the same node.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::NodeIdError;

/// Name of the file in the data directory that holds the node id.
pub const NODE_ID_FILE: &str = "node-id";

/// Hex digits of a node id (128 bits).
const NODE_ID_HEX_DIGITS: usize = 32;

/// A node's identity in the cluster. Printed (and stored, in keys and records) as 32
/// lowercase hex digits. Never zero, so a zeroed file or field is never mistaken for an id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(u128);

impl NodeId {
    /// The id with this value; `None` for zero, which is never an id.
    pub fn new(value: u128) -> Option<NodeId> {
        (value != 0).then_some(NodeId(value))
    }

    /// A fresh random id from the kernel's random source.
    pub fn random() -> std::io::Result<NodeId> {
        let mut bytes = [0u8; 16];
        File::open("/dev/urandom")?.read_exact(&mut bytes)?;
        NodeId::new(u128::from_le_bytes(bytes)).ok_or_else(|| {
            std::io::Error::other("the random source returned 16 zero bytes; it is broken")
        })
    }

    pub fn value(self) -> u128 {
        self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl FromStr for NodeId {
    type Err = String;

    fn from_str(text: &str) -> Result<NodeId, String> {
        let well_formed = text.len() == NODE_ID_HEX_DIGITS
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !well_formed {
            return Err(format!(
                "{text:?} is not a node id ({NODE_ID_HEX_DIGITS} lowercase hex digits)"
            ));
        }
        let value = u128::from_str_radix(text, 16).map_err(|e| e.to_string())?;
        NodeId::new(value).ok_or_else(|| "the node id is zero".to_string())
    }
}

impl Serialize for NodeId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for NodeId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<NodeId, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Name of the second copy of the node id file, kept beside it.
pub const NODE_ID_MIRROR_FILE: &str = "node-id.mirror";

/// The node id of `data_dir`: read from its `node-id` file, or generated and stored durably
/// (file synced, renamed into place, directory synced) when there is none yet. The same
/// file is kept a second time as `node-id.mirror`. A `node-id` that is damaged or missing
/// while the mirror holds a valid id is restored from the mirror (the damaged file kept as
/// `node-id.damaged-<unix seconds>`). With no valid copy, a file that exists but does not
/// hold an id is an error, never replaced: replacing it would silently turn this node into a
/// new member. A file of version 1 (no CRC) is rewritten in version 2.
pub fn load_or_create_node_id(data_dir: &Path) -> Result<NodeId, NodeIdError> {
    let path = data_dir.join(NODE_ID_FILE);
    let mirror = read_node_id_file(&data_dir.join(NODE_ID_MIRROR_FILE));
    let id = match read_node_id_file(&path) {
        Ok(Some((id, NodeIdFileVersion::Checked))) => id,
        Ok(Some((id, NodeIdFileVersion::Unchecked))) => {
            store_node_id_file(data_dir, NODE_ID_FILE, id)?;
            tracing::info!(path = %path.display(), %id, "node id file rewritten with a CRC (version 2)");
            id
        }
        Ok(None) => match mirror {
            Ok(Some((id, _))) => {
                tracing::error!(path = %path.display(), %id,
                    "the node id file is missing; restoring it from its mirror");
                store_node_id_file(data_dir, NODE_ID_FILE, id)?;
                return Ok(id);
            }
            Ok(None) => create_node_id_file(data_dir)?,
            Err(error) => return Err(error),
        },
        Err(NodeIdError::Corrupt { detail, .. }) if matches!(mirror, Ok(Some(_))) => {
            let Ok(Some((id, _))) = mirror else {
                unreachable!("matched above")
            };
            restore_damaged(data_dir, id, &detail)?;
            return Ok(id);
        }
        Err(error) => return Err(error),
    };
    if !matches!(mirror, Ok(Some((copy, NodeIdFileVersion::Checked))) if copy == id) {
        if let Ok(Some((other, _))) = mirror {
            tracing::warn!(path = %path.display(), %id, mirror_id = %other,
                "the node id's mirror held another id; rewriting it from the node id file");
        }
        store_node_id_file(data_dir, NODE_ID_MIRROR_FILE, id)?;
    }
    Ok(id)
}

/// The id in the file at `path`, `None` if there is no such file.
fn read_node_id_file(path: &Path) -> Result<Option<(NodeId, NodeIdFileVersion)>, NodeIdError> {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8(bytes).map_err(|_| NodeIdError::Corrupt {
                path: path.to_path_buf(),
                detail: "the file is not text".to_string(),
            })?;
            parse_node_id_file(path, &text).map(Some)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(NodeIdError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Keeps the damaged `node-id` aside and writes it anew with `id` from the mirror.
fn restore_damaged(data_dir: &Path, id: NodeId, damage: &str) -> Result<(), NodeIdError> {
    let path = data_dir.join(NODE_ID_FILE);
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let aside = (0..)
        .map(|n| match n {
            0 => data_dir.join(format!("{NODE_ID_FILE}.damaged-{seconds}")),
            n => data_dir.join(format!("{NODE_ID_FILE}.damaged-{seconds}-{n}")),
        })
        .find(|candidate| !candidate.exists())
        .expect("an unused name");
    std::fs::rename(&path, &aside).map_err(|source| NodeIdError::Io {
        path: path.clone(),
        source,
    })?;
    tracing::error!(path = %path.display(), kept_as = %aside.display(), %damage, %id,
        "the node id file is damaged; restoring it from its mirror");
    store_node_id_file(data_dir, NODE_ID_FILE, id)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeIdFileVersion {
    /// Version 1: the id alone.
    Unchecked,
    /// Version 2: the id and its CRC.
    Checked,
}

/// The CRC32C of the id's text, as version 2 of the file writes it.
fn node_id_crc(id_text: &str) -> String {
    format!("{:08x}", crc32c::crc32c(id_text.as_bytes()))
}

/// Version 2 of the file: the id's 32 hex digits, a space, the CRC32C of those digits as 8
/// lowercase hex digits, and a newline. Version 1 (the digits and a newline) is still read.
fn parse_node_id_file(path: &Path, text: &str) -> Result<(NodeId, NodeIdFileVersion), NodeIdError> {
    let corrupt = |detail: String| NodeIdError::Corrupt {
        path: path.to_path_buf(),
        detail,
    };
    let line = text.strip_suffix('\n').unwrap_or(text);
    match line.split_once(' ') {
        Some((id_text, crc)) => {
            let id = id_text.parse().map_err(corrupt)?;
            if crc != node_id_crc(id_text) {
                return Err(corrupt(format!(
                    "the id {id_text} does not match its CRC {crc:?}: the file is damaged"
                )));
            }
            Ok((id, NodeIdFileVersion::Checked))
        }
        None => Ok((line.parse().map_err(corrupt)?, NodeIdFileVersion::Unchecked)),
    }
}

fn create_node_id_file(data_dir: &Path) -> Result<NodeId, NodeIdError> {
    let path = data_dir.join(NODE_ID_FILE);
    let id = NodeId::random().map_err(|source| NodeIdError::Io { path, source })?;
    store_node_id_file(data_dir, NODE_ID_FILE, id)?;
    Ok(id)
}

/// Writes the file `name` (version 2) durably: synced, renamed into place, directory synced.
fn store_node_id_file(data_dir: &Path, name: &str, id: NodeId) -> Result<(), NodeIdError> {
    let path = data_dir.join(name);
    let io = |path: &PathBuf| {
        let path = path.clone();
        move |source| NodeIdError::Io { path, source }
    };
    let temporary = data_dir.join(format!("{name}.tmp"));
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&temporary)
        .map_err(io(&temporary))?;
    let id_text = id.to_string();
    file.write_all(format!("{id_text} {}\n", node_id_crc(&id_text)).as_bytes())
        .and_then(|()| file.sync_all())
        .map_err(io(&temporary))?;
    // The rename publishes a complete file; syncing the directory makes the name durable,
    // so a power cut cannot give the node a second identity after its first registration.
    std::fs::rename(&temporary, &path).map_err(io(&path))?;
    File::open(data_dir)
        .and_then(|dir| dir.sync_all())
        .map_err(io(&data_dir.to_path_buf()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_is_created_once_and_then_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create_node_id(dir.path()).unwrap();
        let second = load_or_create_node_id(dir.path()).unwrap();
        assert_eq!(first, second);
        let text = std::fs::read_to_string(dir.path().join(NODE_ID_FILE)).unwrap();
        assert_eq!(
            text,
            format!("{first} {}\n", node_id_crc(&first.to_string()))
        );
        assert!(!dir.path().join("node-id.tmp").exists());
        let other = tempfile::tempdir().unwrap();
        assert_ne!(load_or_create_node_id(other.path()).unwrap(), first);
    }

    #[test]
    fn a_corrupt_file_is_an_error_not_a_new_id() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(NODE_ID_FILE), "not an id\n").unwrap();
        let error = load_or_create_node_id(dir.path()).unwrap_err();
        assert!(matches!(error, NodeIdError::Corrupt { .. }), "{error}");
        assert!(error.to_string().contains("node-id"), "{error}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join(NODE_ID_FILE)).unwrap(),
            "not an id\n"
        );
    }

    /// `bytes` with one bit flipped, for each bit.
    fn each_bit_flipped(bytes: &[u8]) -> impl Iterator<Item = (usize, Vec<u8>)> + '_ {
        (0..bytes.len() * 8).map(move |bit| {
            let mut damaged = bytes.to_vec();
            damaged[bit / 8] ^= 1 << (bit % 8);
            (bit, damaged)
        })
    }

    #[test]
    fn any_flipped_bit_of_the_file_is_an_error_never_another_id() {
        let dir = tempfile::tempdir().unwrap();
        let id = load_or_create_node_id(dir.path()).unwrap();
        let mirror = dir.path().join(NODE_ID_MIRROR_FILE);
        assert_eq!(
            std::fs::read(&mirror).unwrap(),
            std::fs::read(dir.path().join(NODE_ID_FILE)).unwrap()
        );
        // Without the mirror, nothing can stand in for a damaged file.
        std::fs::remove_file(&mirror).unwrap();
        let path = dir.path().join(NODE_ID_FILE);
        let intact = std::fs::read(&path).unwrap();
        for (bit, damaged) in each_bit_flipped(&intact) {
            std::fs::write(&path, &damaged).unwrap();
            match load_or_create_node_id(dir.path()) {
                Err(NodeIdError::Corrupt { .. }) => {}
                other => panic!("bit {bit}: {other:?} instead of an error"),
            }
            assert_eq!(
                std::fs::read(&path).unwrap(),
                damaged,
                "a damaged file was replaced"
            );
        }
        std::fs::write(&path, &intact).unwrap();
        assert_eq!(load_or_create_node_id(dir.path()).unwrap(), id);
    }

    fn damaged_copies_kept(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().starts_with("node-id.damaged-")
            })
            .count()
    }

    #[test]
    fn a_damaged_or_lost_file_is_restored_from_its_mirror() {
        let dir = tempfile::tempdir().unwrap();
        let id = load_or_create_node_id(dir.path()).unwrap();
        let path = dir.path().join(NODE_ID_FILE);
        let intact = std::fs::read(&path).unwrap();
        for (bit, damaged) in each_bit_flipped(&intact) {
            std::fs::write(&path, &damaged).unwrap();
            assert_eq!(load_or_create_node_id(dir.path()).unwrap(), id, "bit {bit}");
            assert_eq!(
                std::fs::read(&path).unwrap(),
                intact,
                "bit {bit}: not restored"
            );
        }
        assert_eq!(
            damaged_copies_kept(dir.path()),
            intact.len() * 8,
            "each damaged file is kept"
        );
        std::fs::remove_file(&path).unwrap();
        assert_eq!(load_or_create_node_id(dir.path()).unwrap(), id);
        assert_eq!(std::fs::read(&path).unwrap(), intact);
        // A lost or damaged mirror is written again from the file.
        let mirror = dir.path().join(NODE_ID_MIRROR_FILE);
        std::fs::write(&mirror, "damaged\n").unwrap();
        assert_eq!(load_or_create_node_id(dir.path()).unwrap(), id);
        assert_eq!(std::fs::read(&mirror).unwrap(), intact);
    }

    #[test]
    fn both_copies_damaged_is_an_error_and_nothing_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        load_or_create_node_id(dir.path()).unwrap();
        for name in [NODE_ID_FILE, NODE_ID_MIRROR_FILE] {
            std::fs::write(dir.path().join(name), "not an id\n").unwrap();
        }
        let error = load_or_create_node_id(dir.path()).unwrap_err();
        assert!(matches!(error, NodeIdError::Corrupt { .. }), "{error}");
        for name in [NODE_ID_FILE, NODE_ID_MIRROR_FILE] {
            assert_eq!(
                std::fs::read_to_string(dir.path().join(name)).unwrap(),
                "not an id\n"
            );
        }
        // The file missing and its mirror damaged: an error too, not a new identity.
        std::fs::remove_file(dir.path().join(NODE_ID_FILE)).unwrap();
        let error = load_or_create_node_id(dir.path()).unwrap_err();
        assert!(error.to_string().contains("node-id.mirror"), "{error}");
        assert!(!dir.path().join(NODE_ID_FILE).exists());
    }

    #[test]
    fn a_version_1_file_keeps_its_id_and_gains_a_crc() {
        let dir = tempfile::tempdir().unwrap();
        let id = NodeId::new(0xfeed_beef).unwrap();
        std::fs::write(dir.path().join(NODE_ID_FILE), format!("{id}\n")).unwrap();
        assert_eq!(load_or_create_node_id(dir.path()).unwrap(), id);
        let text = std::fs::read_to_string(dir.path().join(NODE_ID_FILE)).unwrap();
        assert_eq!(text, format!("{id} {}\n", node_id_crc(&id.to_string())));
        assert_eq!(load_or_create_node_id(dir.path()).unwrap(), id);
    }

    #[test]
    fn text_form_round_trips_and_rejects_bad_input() {
        let id = NodeId::new(0x1234_5678_9abc_def0).unwrap();
        assert_eq!(id.to_string().len(), 32);
        assert_eq!(id.to_string().parse::<NodeId>(), Ok(id));
        assert!("0".repeat(32).parse::<NodeId>().is_err());
        assert!("ABCDEF".repeat(6)[..32].parse::<NodeId>().is_err());
        assert!("abc".parse::<NodeId>().is_err());
        assert!(NodeId::new(0).is_none());
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<NodeId>(&json).unwrap(), id);
    }
}
