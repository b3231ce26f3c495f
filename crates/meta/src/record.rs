//! On-disk encoding of one key's record in the embedded store's `kv` table.
//!
//! Layout (little endian), format 2: format byte, create_revision i64, mod_revision i64,
//! version i64, lease i64 (0 = none), the raw value, then a CRC32C of the key followed by
//! everything before the CRC. The CRC covers the key, so a record that a damaged page shows
//! under another key fails too. Format 1 (the same without the CRC) is read only to upgrade
//! a store written by an older build (`embedded.rs`, `recover`). A fixed header rather than
//! serde keeps the format obvious and independent of any crate.

use crate::types::{KeyValue, LeaseId, Revision};

const RECORD_FORMAT: u8 = 2;
const UNCHECKED_RECORD_FORMAT: u8 = 1;
const HEADER_LEN: usize = 1 + 4 * 8;
const CRC_LEN: usize = 4;

pub(crate) fn encode(kv: &KeyValue) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + kv.value.len() + CRC_LEN);
    out.push(RECORD_FORMAT);
    out.extend_from_slice(&kv.create_revision.0.to_le_bytes());
    out.extend_from_slice(&kv.mod_revision.0.to_le_bytes());
    out.extend_from_slice(&kv.version.to_le_bytes());
    out.extend_from_slice(&kv.lease.map_or(0, |l| l.0).to_le_bytes());
    out.extend_from_slice(&kv.value);
    let crc = record_crc(&kv.key, &out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn record_crc(key: &[u8], body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(key), body)
}

/// What is wrong with the record of `key`, for `MetaError::Corrupt`.
fn describe(key: &[u8], what: &str) -> String {
    format!("record of key {:?}: {what}", String::from_utf8_lossy(key))
}

/// Decode a record; the error describes what is wrong, for `MetaError::Corrupt`.
pub(crate) fn decode(key: &[u8], bytes: &[u8]) -> Result<KeyValue, String> {
    let describe = |what: &str| describe(key, what);
    if bytes.first() != Some(&RECORD_FORMAT) {
        return Err(describe(&format!(
            "record format {:?}, expected {RECORD_FORMAT}",
            bytes.first()
        )));
    }
    if bytes.len() < HEADER_LEN + CRC_LEN {
        return Err(describe(&format!(
            "{} bytes is shorter than the {HEADER_LEN}-byte header and its CRC",
            bytes.len()
        )));
    }
    let (body, crc) = bytes.split_at(bytes.len() - CRC_LEN);
    let stored = u32::from_le_bytes(crc.try_into().expect("CRC_LEN bytes"));
    if stored != record_crc(key, body) {
        return Err(describe("the record fails its CRC (damaged on disk)"));
    }
    decode_body(key, body)
}

/// Decode a format-1 record (no CRC), written before format 2 existed.
pub(crate) fn decode_unchecked(key: &[u8], bytes: &[u8]) -> Result<KeyValue, String> {
    if bytes.first() != Some(&UNCHECKED_RECORD_FORMAT) {
        return Err(describe(
            key,
            &format!(
                "record format {:?}, expected {UNCHECKED_RECORD_FORMAT}",
                bytes.first()
            ),
        ));
    }
    decode_body(key, bytes)
}

/// The header and value, whatever the format byte says.
fn decode_body(key: &[u8], bytes: &[u8]) -> Result<KeyValue, String> {
    let describe = |what: &str| describe(key, what);
    if bytes.len() < HEADER_LEN {
        return Err(describe(&format!(
            "{} bytes is shorter than the {HEADER_LEN}-byte header",
            bytes.len()
        )));
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

    #[test]
    fn any_flipped_bit_of_a_record_or_its_key_is_caught() {
        let kv = KeyValue {
            key: b"/ashlar/v1/vdisks/a".to_vec(),
            value: br#"{"size_bytes":1073741824}"#.to_vec(),
            create_revision: Revision(2),
            mod_revision: Revision(9),
            version: 4,
            lease: None,
        };
        let bytes = encode(&kv);
        for bit in 0..bytes.len() * 8 {
            let mut damaged = bytes.clone();
            damaged[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&kv.key, &damaged).is_err(), "bit {bit}");
        }
        let mut other_key = kv.key.clone();
        *other_key.last_mut().unwrap() = b'b';
        assert!(decode(&other_key, &bytes).is_err());
    }

    #[test]
    fn a_format_1_record_is_read_only_by_the_upgrade() {
        let kv = KeyValue {
            key: b"/k".to_vec(),
            value: b"v".to_vec(),
            create_revision: Revision(2),
            mod_revision: Revision(2),
            version: 1,
            lease: None,
        };
        let mut old = encode(&kv);
        old.truncate(old.len() - CRC_LEN);
        old[0] = UNCHECKED_RECORD_FORMAT;
        assert!(decode(&kv.key, &old).is_err());
        assert_eq!(decode_unchecked(&kv.key, &old), Ok(kv));
    }
}
