//! Text key=value pairs of login and text PDUs (RFC 7143 section 6): UTF-8 `key=value`
//! strings, each ended by a NUL byte.

use thiserror::Error;

/// Longest key the protocol allows (RFC 7143 6.1).
const MAX_KEY_BYTES: usize = 63;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TextError {
    #[error("text pair {0:?} has no '='")]
    NoEquals(String),
    #[error("text key {0:?} is empty, too long or not printable")]
    BadKey(String),
    #[error("text is not UTF-8")]
    NotUtf8,
    #[error("key {0} appears twice")]
    Duplicate(String),
}

/// Ordered key=value pairs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextPairs(pub Vec<(String, String)>);

impl TextPairs {
    /// Parses NUL-separated pairs; a missing final NUL is tolerated, empty strings skipped.
    pub fn parse(bytes: &[u8]) -> Result<Self, TextError> {
        let text = std::str::from_utf8(bytes).map_err(|_| TextError::NotUtf8)?;
        let mut pairs: Vec<(String, String)> = Vec::new();
        for item in text.split('\0').filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| TextError::NoEquals(item.chars().take(64).collect()))?;
            if key.is_empty()
                || key.len() > MAX_KEY_BYTES
                || !key
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-.+@_".contains(&b))
            {
                return Err(TextError::BadKey(key.chars().take(64).collect()));
            }
            if pairs.iter().any(|(k, _)| k == key) {
                return Err(TextError::Duplicate(key.to_string()));
            }
            pairs.push((key.to_string(), value.to_string()));
        }
        Ok(TextPairs(pairs))
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn push(&mut self, key: &str, value: impl Into<String>) {
        self.0.push((key.to_string(), value.into()));
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (key, value) in &self.0 {
            out.extend_from_slice(key.as_bytes());
            out.push(b'=');
            out.extend_from_slice(value.as_bytes());
            out.push(0);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_encode() {
        let pairs = TextPairs::parse(b"InitiatorName=iqn.x\0SessionType=Normal\0").unwrap();
        assert_eq!(pairs.get("InitiatorName"), Some("iqn.x"));
        assert_eq!(pairs.get("SessionType"), Some("Normal"));
        assert_eq!(TextPairs::parse(&pairs.encode()).unwrap(), pairs);
        assert!(TextPairs::parse(b"novalue\0").is_err());
        assert!(TextPairs::parse(b"=x\0").is_err());
        assert!(TextPairs::parse(b"A=1\0A=2\0").is_err());
        assert!(TextPairs::parse(&[0xff, b'=', 0]).is_err());
        assert_eq!(TextPairs::parse(b"A=\0").unwrap().get("A"), Some(""));
    }
}
