//! Human sizes: `8G`, `512M`, `64T`, `4096`. Suffixes are binary (K = 1024) because that is
//! what block-device users mean.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SizeParseError {
    #[error("empty size")]
    Empty,
    #[error(
        "invalid size '{0}': expected a number with an optional K, M, G, T or P suffix (e.g. 8G)"
    )]
    Invalid(String),
    #[error("size '{0}' is too large")]
    Overflow(String),
}

/// Parses `NUMBER[K|M|G|T|P][i][B]`, case-insensitive: `8G`, `8GiB`, `8gb` all mean 8 GiB.
pub fn parse_size(text: &str) -> Result<u64, SizeParseError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(SizeParseError::Empty);
    }
    let invalid = || SizeParseError::Invalid(trimmed.to_string());
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    if digits_end == 0 {
        return Err(invalid());
    }
    let number: u64 = trimmed[..digits_end]
        .parse()
        .map_err(|_| SizeParseError::Overflow(trimmed.to_string()))?;
    let suffix = trimmed[digits_end..].to_ascii_lowercase();
    let unit_suffix = suffix.trim_end_matches('b').trim_end_matches('i');
    let shift = match unit_suffix {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        "p" => 50,
        _ => return Err(invalid()),
    };
    // "b" alone or "ib" without a unit letter are not sizes.
    if unit_suffix.is_empty() && !suffix.is_empty() {
        return Err(invalid());
    }
    number
        .checked_mul(1u64 << shift)
        .ok_or_else(|| SizeParseError::Overflow(trimmed.to_string()))
}

/// Formats a byte count with the largest binary suffix that divides it exactly.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(u32, &str); 5] = [(50, "P"), (40, "T"), (30, "G"), (20, "M"), (10, "K")];
    for (shift, name) in UNITS {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{}", bytes >> shift, name);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("8G"), Ok(8 << 30));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("64T"), Ok(64 << 40));
        assert_eq!(parse_size("1K"), Ok(1024));
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(parse_size(""), Err(SizeParseError::Empty));
        assert!(matches!(parse_size("G"), Err(SizeParseError::Invalid(_))));
        assert!(matches!(parse_size("12X"), Err(SizeParseError::Invalid(_))));
        assert!(matches!(parse_size("-1"), Err(SizeParseError::Invalid(_))));
        assert!(matches!(
            parse_size("1.5G"),
            Err(SizeParseError::Invalid(_))
        ));
        assert!(matches!(parse_size("12b"), Err(SizeParseError::Invalid(_))));
        assert!(matches!(
            parse_size("99999999999P"),
            Err(SizeParseError::Overflow(_))
        ));
    }

    #[test]
    fn formats_round_trip() {
        for text in ["8G", "64T", "512M", "4K", "1000"] {
            assert_eq!(format_size(parse_size(text).unwrap()), text);
        }
    }
}
