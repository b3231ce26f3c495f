//! On-disk encoding of one key's record in the embedded store's `kv` table.
//!
//! Layout (little endian): format byte, create_revision i64, mod_revision
//! i64, version i64, lease i64 (0 = none), then the raw value. A fixed header
//! rather than serde keeps the format obvious and independent of any crate.

use crate::types::{KeyValue, LeaseId, Revision};

const RECORD_FORMAT: u8 = 1;
const HEADER_LEN: usize = 1 + 4 * 8;

pub(crate) fn encode(kv: &KeyValue) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + kv.value.len());
    out.push(RECORD_FORMAT);
    out.extend_from_slice(&kv.create_revision.0.to_le_bytes());
    out.extend_from_slice(&kv.mod_revision.0.to_le_bytes());
    out.extend_from_slice(&kv.version.to_le_bytes());
    out.extend_from_slice(&kv.lease.map_or(0, |l| l.0).to_le_bytes());
    out.extend_from_slice(&kv.value);
    out
}

/// Decode a record; the error describes what is wrong, for `MetaError::Corrupt`.
pub(crate) fn decode(key: &[u8], bytes: &[u8]) -> Result<KeyValue, String> {
    let describe = |what: &str| format!("record of key {:?}: {what}", String::from_utf8_lossy(key));
    if bytes.len() < HEADER_LEN {
        return Err(describe(&format!(
            "{} bytes is shorter than the {HEADER_LEN}-byte header",
            bytes.len()
        )));
    }
    if bytes[0] != RECORD_FORMAT {
        return Err(describe(&format!("unknown record format {}", bytes[0])));
    }
    let field = |i: usize| {
        let start = 1 + i * 8;
        let mut buf = [0u8; 8];
        buf.copy_from_slice(&bytes[start..start + 8]);
        i64::from_le_bytes(buf)
    };
    let (create, modr, version, lease) = (field(0), field(1), field(2), field(3));
    if create <= 0 || modr < create || version <= 0 || lease < 0 {
        return Err(describe(&format!(
            "impossible header (create {create}, mod {modr}, version {version}, lease {lease})"
        )));
    }
    Ok(KeyValue {
        key: key.to_vec(),
        value: bytes[HEADER_LEN..].to_vec(),
        create_revision: Revision(create),
        mod_revision: Revision(modr),
        version,
        lease: (lease != 0).then_some(LeaseId(lease)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let kv = KeyValue {
            key: b"/k".to_vec(),
            value: b"hello".to_vec(),
            create_revision: Revision(2),
            mod_revision: Revision(7),
            version: 3,
            lease: Some(LeaseId(42)),
        };
        assert_eq!(decode(&kv.key, &encode(&kv)), Ok(kv));
    }

    #[test]
    fn rejects_garbage() {
        assert!(decode(b"/k", b"short").is_err());
        let mut bytes = encode(&KeyValue {
            key: b"/k".to_vec(),
            value: Vec::new(),
            create_revision: Revision(2),
            mod_revision: Revision(2),
            version: 1,
            lease: None,
        });
        bytes[0] = 9;
        assert!(decode(b"/k", &bytes).is_err());
    }
}
