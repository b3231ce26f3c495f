//! CHAP with MD5 (RFC 1994, as used by RFC 7143 section 12.1.3): the digest, the encoding of
//! binary values (`0x` hex or `0b` base64), and the checks of one exchange.

/// Bytes of the challenge the target sends (RFC 7143 asks for at least as many as the
/// digest, 16).
pub const CHALLENGE_BYTES: usize = 16;
/// Longest binary value accepted from an initiator (challenge or response).
const MAX_BINARY_BYTES: usize = 1024;

/// The MD5 digest (RFC 1321).
pub fn md5(input: &[u8]) -> [u8; 16] {
    const SHIFTS: [[u32; 4]; 4] = [
        [7, 12, 17, 22],
        [5, 9, 14, 20],
        [4, 11, 16, 23],
        [6, 10, 15, 21],
    ];
    let constants: [u32; 64] =
        std::array::from_fn(|i| ((i as f64 + 1.0).sin().abs() * 4_294_967_296.0) as u32);
    let mut state: [u32; 4] = [0x6745_2301, 0xefcd_ab89, 0x98ba_dcfe, 0x1032_5476];
    let mut message = input.to_vec();
    let bit_length = (input.len() as u64).wrapping_mul(8);
    message.push(0x80);
    while message.len() % 64 != 56 {
        message.push(0);
    }
    message.extend_from_slice(&bit_length.to_le_bytes());
    for block in message.chunks_exact(64) {
        let words: [u32; 16] = std::array::from_fn(|i| {
            u32::from_le_bytes(block[i * 4..i * 4 + 4].try_into().expect("4 bytes"))
        });
        let [mut a, mut b, mut c, mut d] = state;
        for i in 0..64 {
            let round = i / 16;
            let (f, g) = match round {
                0 => ((b & c) | (!b & d), i),
                1 => ((d & b) | (!d & c), (5 * i + 1) % 16),
                2 => (b ^ c ^ d, (3 * i + 5) % 16),
                _ => (c ^ (b | !d), (7 * i) % 16),
            };
            let sum = f
                .wrapping_add(a)
                .wrapping_add(constants[i])
                .wrapping_add(words[g]);
            a = d;
            d = c;
            c = b;
            b = b.wrapping_add(sum.rotate_left(SHIFTS[round][i % 4]));
        }
        state = [
            state[0].wrapping_add(a),
            state[1].wrapping_add(b),
            state[2].wrapping_add(c),
            state[3].wrapping_add(d),
        ];
    }
    let mut out = [0u8; 16];
    for (i, word) in state.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&word.to_le_bytes());
    }
    out
}

/// The CHAP response: MD5(identifier || secret || challenge).
pub fn response(identifier: u8, secret: &[u8], challenge: &[u8]) -> [u8; 16] {
    let mut input = Vec::with_capacity(1 + secret.len() + challenge.len());
    input.push(identifier);
    input.extend_from_slice(secret);
    input.extend_from_slice(challenge);
    md5(&input)
}

/// `0x`-prefixed hexadecimal, the encoding this target sends.
pub fn encode_hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(2 + bytes.len() * 2);
    out.push_str("0x");
    for byte in bytes {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// Decodes a binary value in either encoding RFC 7143 allows (`0x` hex, `0b` base64).
pub fn decode_binary(text: &str) -> Option<Vec<u8>> {
    let (prefix, body) = (text.get(..2)?, text.get(2..)?);
    let bytes = match prefix {
        "0x" | "0X" => {
            let digits: Vec<u8> = body
                .bytes()
                .map(|b| (b as char).to_digit(16).map(|d| d as u8))
                .collect::<Option<_>>()?;
            // An odd count has an implied leading zero.
            let mut padded = Vec::with_capacity(digits.len() + 1);
            if digits.len() % 2 == 1 {
                padded.push(0);
            }
            padded.extend(digits);
            padded.chunks(2).map(|p| p[0] << 4 | p[1]).collect()
        }
        "0b" | "0B" => decode_base64(body)?,
        _ => return None,
    };
    (bytes.len() <= MAX_BINARY_BYTES).then_some(bytes)
}

fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let body = text.trim_end_matches('=');
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in body.bytes() {
        acc = acc << 6 | value(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// Compares without an early exit, so timing tells nothing about where a guess went wrong.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Fresh random bytes for a challenge and its identifier.
pub fn random_challenge() -> (u8, [u8; CHALLENGE_BYTES]) {
    let mut bytes = [0u8; CHALLENGE_BYTES + 1];
    if getrandom::getrandom(&mut bytes).is_err() {
        // No entropy source: derive something unpredictable enough from the clock and the
        // address of the stack; logged, since it weakens CHAP.
        tracing::error!("no random source for the CHAP challenge; using the clock");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let seed = md5(&nanos.to_le_bytes());
        bytes[..16].copy_from_slice(&seed);
    }
    let mut challenge = [0u8; CHALLENGE_BYTES];
    challenge.copy_from_slice(&bytes[1..]);
    (bytes[0], challenge)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        encode_hex(bytes)[2..].to_string()
    }

    #[test]
    fn md5_rfc1321_vectors() {
        assert_eq!(hex(&md5(b"")), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(hex(&md5(b"abc")), "900150983cd24fb0d6963f7d28e17f72");
        assert_eq!(
            hex(&md5(b"message digest")),
            "f96b697d7cb7938d525a2f31aaf161d0"
        );
        assert_eq!(
            hex(&md5(
                b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"
            )),
            "57edf4a22be3c955ac49da2e2107b67a"
        );
    }

    #[test]
    fn binary_values_decode_both_encodings() {
        assert_eq!(decode_binary("0x0102ff"), Some(vec![1, 2, 255]));
        assert_eq!(decode_binary("0x102"), Some(vec![1, 2]));
        assert_eq!(decode_binary("0bAQL/"), Some(vec![1, 2, 255]));
        assert_eq!(decode_binary("0bAQI="), Some(vec![1, 2]));
        assert_eq!(decode_binary("12"), None);
        assert_eq!(decode_binary("0xzz"), None);
        assert_eq!(decode_binary("é"), None);
        assert_eq!(decode_binary(&encode_hex(&[9, 8, 7])), Some(vec![9, 8, 7]));
    }

    #[test]
    fn constant_time_compare() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
