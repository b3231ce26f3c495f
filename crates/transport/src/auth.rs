//! Mutual authentication with the cluster secret: HMAC-SHA256 over the handshake transcript.
//! Pure functions; `handshake.rs` does the I/O.
//!
//! Each side proves it holds the secret by a MAC over both hellos, which carry both sides'
//! fresh nonces: a proof recorded from another connection does not verify (replay), and the
//! two directions use different labels, so a server's proof cannot be reflected back as a
//! client's. The secret itself never goes on the wire.

use crate::wire::hello::{Hello, Mac, Nonce, MAC_BYTES};
use hmac::{Hmac, KeyInit, Mac as _};
use sha2::Sha256;
use std::fmt;

const SERVER_LABEL: &[u8] = b"ashlar node protocol v1: server proof";
const CLIENT_LABEL: &[u8] = b"ashlar node protocol v1: client proof";

/// The secret every node of one cluster holds. Never printed, never sent.
#[derive(Clone, PartialEq, Eq)]
pub struct ClusterSecret(Vec<u8>);

impl ClusterSecret {
    /// Fewer bytes than this cannot resist guessing.
    pub const MIN_BYTES: usize = 16;

    /// `None` when `bytes` is shorter than [`ClusterSecret::MIN_BYTES`].
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<ClusterSecret> {
        let bytes = bytes.into();
        (bytes.len() >= Self::MIN_BYTES).then_some(ClusterSecret(bytes))
    }

    fn mac(&self) -> Hmac<Sha256> {
        <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(<redacted>)")
    }
}

/// Whose proof a MAC is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Server,
    Client,
}

fn transcript_mac(
    secret: &ClusterSecret,
    role: Role,
    client_hello: &Hello,
    server_hello: &Hello,
) -> Hmac<Sha256> {
    let mut mac = secret.mac();
    mac.update(match role {
        Role::Server => SERVER_LABEL,
        Role::Client => CLIENT_LABEL,
    });
    mac.update(&client_hello.signed_part());
    mac.update(&server_hello.signed_part());
    mac
}

/// The proof `role` sends: a MAC over both hellos. `server_hello.mac` is not covered (it is
/// the server's proof itself).
pub fn prove(
    secret: &ClusterSecret,
    role: Role,
    client_hello: &Hello,
    server_hello: &Hello,
) -> Mac {
    let tag = transcript_mac(secret, role, client_hello, server_hello)
        .finalize()
        .into_bytes();
    let mut out = [0u8; MAC_BYTES];
    out.copy_from_slice(&tag);
    out
}

/// Whether `proof` is `role`'s proof for these hellos. Constant time.
pub fn verify(
    secret: &ClusterSecret,
    role: Role,
    client_hello: &Hello,
    server_hello: &Hello,
    proof: &Mac,
) -> bool {
    transcript_mac(secret, role, client_hello, server_hello)
        .verify_slice(proof)
        .is_ok()
}

/// A fresh nonce from the operating system. Failing to get one means no connection can be
/// made safely.
pub fn fresh_nonce() -> std::io::Result<Nonce> {
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce)
        .map_err(|error| std::io::Error::other(format!("no randomness for a nonce: {error}")))?;
    Ok(nonce)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::NodeId;
    use crate::wire::hello::HelloKind;

    fn hello(kind: HelloKind, node: u64, nonce: u8) -> Hello {
        Hello {
            kind,
            node_id: NodeId(node),
            max_frame_payload_bytes: 1024,
            max_in_flight_requests: 8,
            nonce: [nonce; 32],
            mac: [0; 32],
            lane: 0,
        }
    }

    fn secret(byte: u8) -> ClusterSecret {
        ClusterSecret::new(vec![byte; 32]).unwrap()
    }

    #[test]
    fn proof_verifies_only_with_same_secret_role_and_transcript() {
        let (client, server) = (
            hello(HelloKind::ClientHello, 1, 1),
            hello(HelloKind::ServerHello, 2, 2),
        );
        let proof = prove(&secret(1), Role::Server, &client, &server);
        assert!(verify(&secret(1), Role::Server, &client, &server, &proof));
        assert!(
            !verify(&secret(2), Role::Server, &client, &server, &proof),
            "other secret"
        );
        assert!(
            !verify(&secret(1), Role::Client, &client, &server, &proof),
            "reflected"
        );
        let replayed = hello(HelloKind::ClientHello, 1, 3);
        assert!(
            !verify(&secret(1), Role::Server, &replayed, &server, &proof),
            "other client nonce"
        );
    }

    #[test]
    fn short_secret_is_refused_and_debug_hides_it() {
        assert!(ClusterSecret::new(vec![1; 15]).is_none());
        assert_eq!(format!("{:?}", secret(b'k')), "ClusterSecret(<redacted>)");
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(fresh_nonce().unwrap(), fresh_nonce().unwrap());
    }
}
