//! Parsing of option payloads and the `base:allocation` query rules, as pure functions.

use crate::proto::{Cursor, BASE_ALLOCATION, MAX_STRING_BYTES};

/// Why an option payload is syntactically invalid (answered with `NBD_REP_ERR_INVALID`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionParseError {
    #[error("option payload is truncated or has trailing bytes")]
    BadLength,
    #[error("string longer than {MAX_STRING_BYTES} bytes")]
    StringTooLong,
    #[error("string is not valid UTF-8")]
    NotUtf8,
    #[error("option takes no data")]
    UnexpectedData,
}

/// Payload of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoRequest {
    pub name: String,
    pub info_requests: Vec<u16>,
}

/// Payload of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    pub export: String,
    pub queries: Vec<String>,
}

pub fn parse_go(data: &[u8]) -> Result<GoRequest, OptionParseError> {
    let mut cur = Cursor::new(data);
    let name = read_string(&mut cur)?;
    let count = cur.u16().map_err(|_| OptionParseError::BadLength)?;
    let mut info_requests = Vec::with_capacity(usize::from(count).min(cur.remaining() / 2));
    for _ in 0..count {
        info_requests.push(cur.u16().map_err(|_| OptionParseError::BadLength)?);
    }
    if cur.remaining() != 0 {
        return Err(OptionParseError::BadLength);
    }
    Ok(GoRequest {
        name,
        info_requests,
    })
}

pub fn parse_meta(data: &[u8]) -> Result<MetaRequest, OptionParseError> {
    let mut cur = Cursor::new(data);
    let export = read_string(&mut cur)?;
    let count = cur.u32().map_err(|_| OptionParseError::BadLength)?;
    // Each query takes at least its 4-byte length, which bounds the allocation by the
    // (already capped) payload size rather than by the client's claimed count.
    let mut queries = Vec::with_capacity((count as usize).min(cur.remaining() / 4));
    for _ in 0..count {
        queries.push(read_string(&mut cur)?);
    }
    if cur.remaining() != 0 {
        return Err(OptionParseError::BadLength);
    }
    Ok(MetaRequest { export, queries })
}

/// Options that must carry no data (`NBD_OPT_LIST`, `NBD_OPT_STRUCTURED_REPLY`).
pub fn expect_empty(data: &[u8]) -> Result<(), OptionParseError> {
    if data.is_empty() {
        Ok(())
    } else {
        Err(OptionParseError::UnexpectedData)
    }
}

/// The whole payload of `NBD_OPT_EXPORT_NAME` is the name.
pub fn parse_export_name(data: &[u8]) -> Result<String, OptionParseError> {
    to_string(data)
}

fn read_string(cur: &mut Cursor<'_>) -> Result<String, OptionParseError> {
    let len = cur.u32().map_err(|_| OptionParseError::BadLength)?;
    let len = usize::try_from(len).map_err(|_| OptionParseError::BadLength)?;
    if len > MAX_STRING_BYTES {
        return Err(OptionParseError::StringTooLong);
    }
    to_string(cur.bytes(len).map_err(|_| OptionParseError::BadLength)?)
}

fn to_string(bytes: &[u8]) -> Result<String, OptionParseError> {
    if bytes.len() > MAX_STRING_BYTES {
        return Err(OptionParseError::StringTooLong);
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| OptionParseError::NotUtf8)
}

/// Which of the two meta-context options a query list is for; they treat `base:` and an
/// empty list differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaMode {
    List,
    Set,
}

/// Whether the queries name `base:allocation` (the only context this server has).
/// Unknown namespaces and leaf names are ignored, as the protocol requires.
pub fn selects_allocation(queries: &[String], mode: MetaMode) -> bool {
    match mode {
        // No query lists everything; `base:` is a wildcard for listing only.
        MetaMode::List => {
            queries.is_empty() || queries.iter().any(|q| q == "base:" || q == BASE_ALLOCATION)
        }
        // No query selects nothing; `base:` must be ignored when selecting.
        MetaMode::Set => queries.iter().any(|q| q == BASE_ALLOCATION),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(s: &str) -> Vec<u8> {
        let mut out = (s.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(s.as_bytes());
        out
    }

    #[test]
    fn go_payload_parses_name_and_infos() {
        let mut raw = string("disk");
        raw.extend_from_slice(&2u16.to_be_bytes());
        raw.extend_from_slice(&3u16.to_be_bytes());
        raw.extend_from_slice(&1u16.to_be_bytes());
        let go = parse_go(&raw).unwrap();
        assert_eq!(go.name, "disk");
        assert_eq!(go.info_requests, vec![3, 1]);
    }

    #[test]
    fn go_payload_rejects_bad_lengths() {
        let mut raw = string("disk");
        raw.extend_from_slice(&1u16.to_be_bytes());
        assert_eq!(
            parse_go(&raw),
            Err(OptionParseError::BadLength),
            "missing info"
        );
        raw.extend_from_slice(&[0, 3, 9]);
        assert_eq!(
            parse_go(&raw),
            Err(OptionParseError::BadLength),
            "trailing byte"
        );
        let mut lying = 0xffff_fff0u32.to_be_bytes().to_vec();
        lying.extend_from_slice(&[0, 0]);
        assert_eq!(parse_go(&lying), Err(OptionParseError::StringTooLong));
        let mut short = 10u32.to_be_bytes().to_vec();
        short.extend_from_slice(b"abc");
        assert_eq!(parse_go(&short), Err(OptionParseError::BadLength));
        let mut bad_utf8 = 2u32.to_be_bytes().to_vec();
        bad_utf8.extend_from_slice(&[0xff, 0xfe, 0, 0]);
        assert_eq!(parse_go(&bad_utf8), Err(OptionParseError::NotUtf8));
        assert_eq!(parse_go(&[]), Err(OptionParseError::BadLength));
    }

    #[test]
    fn meta_payload_parses_queries() {
        let mut raw = string("disk");
        raw.extend_from_slice(&2u32.to_be_bytes());
        raw.extend_from_slice(&string("base:allocation"));
        raw.extend_from_slice(&string("qemu:dirty-bitmap:x"));
        let meta = parse_meta(&raw).unwrap();
        assert_eq!(meta.export, "disk");
        assert_eq!(meta.queries, vec!["base:allocation", "qemu:dirty-bitmap:x"]);

        let mut huge_count = string("disk");
        huge_count.extend_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_meta(&huge_count), Err(OptionParseError::BadLength));
    }

    #[test]
    fn allocation_selection_rules() {
        let q = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(selects_allocation(&[], MetaMode::List));
        assert!(!selects_allocation(&[], MetaMode::Set));
        assert!(selects_allocation(&q(&["base:"]), MetaMode::List));
        assert!(!selects_allocation(&q(&["base:"]), MetaMode::Set));
        assert!(selects_allocation(
            &q(&["x-a:b", "base:allocation"]),
            MetaMode::Set
        ));
        assert!(!selects_allocation(
            &q(&["base:other", "nocolon"]),
            MetaMode::List
        ));
    }

    #[test]
    fn empty_options() {
        assert!(expect_empty(&[]).is_ok());
        assert_eq!(expect_empty(&[1]), Err(OptionParseError::UnexpectedData));
        assert_eq!(parse_export_name(b"mem").unwrap(), "mem");
    }
}
