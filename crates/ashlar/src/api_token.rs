//! The HTTP API's bearer token: where a node and the CLI find it, and the check every request
//! to the node's API passes.
//!
//! A node whose `--http-listen` address is not loopback requires a token of every request
//! except `GET /healthz`; on loopback the API stays open unless a token is configured, in
//! which case it is required there too (whoever configures one means it). Without a
//! configured token, a node beyond loopback uses `DATA_DIR/api-token`, generated at its first
//! start with mode 0600, so it is never open to the network by accident.

use crate::http::ApiError;
use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::fmt;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The environment variable that holds the token itself (a file is `--api-token-file`).
pub const TOKEN_ENV: &str = "ASHLAR_API_TOKEN";
/// The token a node generates beyond loopback, in its data directory.
pub const TOKEN_FILE_NAME: &str = "api-token";
/// Fewer characters than this cannot resist guessing over the network.
pub const MIN_TOKEN_CHARS: usize = 16;
/// Far below the HTTP server's header size limit; anything longer is a mistake.
const MAX_TOKEN_CHARS: usize = 4096;
/// Random bytes of a generated token (64 hex characters).
const GENERATED_TOKEN_BYTES: usize = 32;
/// The one path served without a token: it says only "ok", and probes rarely hold secrets.
const UNAUTHENTICATED_PATH: &str = "/healthz";

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("reading the API token file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the API token file {} is open to other users (mode {mode:03o}); run `chmod 600 {}`", path.display(), path.display())]
    OpenToOthers { path: PathBuf, mode: u32 },
    #[error("writing the API token file {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}: the API token is empty")]
    Empty { origin: String },
    #[error("{origin}: the API token may hold only printable ASCII characters without spaces")]
    BadCharacters { origin: String },
    #[error("{origin}: the API token has {chars} characters; use at least {MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")]
    TooShort { origin: String, chars: usize },
    #[error("{origin}: the API token has more than {MAX_TOKEN_CHARS} characters")]
    TooLong { origin: String },
    #[error("no randomness for an API token: {0}")]
    Random(String),
}

/// A bearer token. Never printed: `Debug` hides it. No `PartialEq`: compare with
/// [`ApiToken::matches`], in constant time.
#[derive(Clone)]
pub struct ApiToken(String);

impl ApiToken {
    /// The token in `text`, without surrounding whitespace (a file's final newline).
    /// `origin` names where it came from, for the error.
    pub fn parse(text: &str, origin: &str) -> Result<ApiToken, TokenError> {
        let token = text.trim();
        let origin = origin.to_string();
        if token.is_empty() {
            return Err(TokenError::Empty { origin });
        }
        if token.len() > MAX_TOKEN_CHARS {
            return Err(TokenError::TooLong { origin });
        }
        // What an HTTP header value carries unchanged, and what a shell copies without quoting
        // trouble.
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::BadCharacters { origin });
        }
        Ok(ApiToken(token.to_string()))
    }

    /// A fresh token from the operating system's CSPRNG.
    pub fn generate() -> Result<ApiToken, TokenError> {
        let mut bytes = [0u8; GENERATED_TOKEN_BYTES];
        getrandom::fill(&mut bytes).map_err(|e| TokenError::Random(e.to_string()))?;
        Ok(ApiToken(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time that depends on neither: both are hashed
    /// first, so even their lengths are compared as equal-length digests.
    pub fn matches(&self, presented: &str) -> bool {
        let expected = Sha256::digest(self.0.as_bytes());
        let presented = Sha256::digest(presented.as_bytes());
        expected.as_slice().ct_eq(presented.as_slice()).into()
    }

    fn require_min_length(self, origin: &str) -> Result<ApiToken, TokenError> {
        let chars = self.0.chars().count();
        if chars < MIN_TOKEN_CHARS {
            return Err(TokenError::TooShort {
                origin: origin.to_string(),
                chars,
            });
        }
        Ok(self)
    }
}

impl fmt::Debug for ApiToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiToken(<redacted>)")
    }
}

/// Where a token came from: told to the operator instead of the token itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// `--api-token-file` (or `ASHLAR_API_TOKEN_FILE`).
    File(PathBuf),
    /// `ASHLAR_API_TOKEN`.
    Env,
    /// `DATA_DIR/api-token`; `generated` when this start created it.
    DataDir { path: PathBuf, generated: bool },
}

impl fmt::Display for TokenSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenSource::File(path) => write!(f, "--api-token-file {}", path.display()),
            TokenSource::Env => f.write_str(TOKEN_ENV),
            TokenSource::DataDir { path, .. } => write!(f, "{}", path.display()),
        }
    }
}

/// Reads a token file, refusing one that other users may read or write: a token anyone on
/// the machine can read protects nothing.
pub fn read_token_file(path: &Path) -> Result<ApiToken, TokenError> {
    let read_error = |source| TokenError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mode = std::fs::metadata(path)
        .map_err(read_error)?
        .permissions()
        .mode()
        & 0o777;
    if mode & 0o007 != 0 {
        return Err(TokenError::OpenToOthers {
            path: path.to_path_buf(),
            mode,
        });
    }
    if mode & 0o070 != 0 {
        tracing::warn!(path = %path.display(), mode = format!("{mode:03o}"),
            "the API token file can be read by its group; `chmod 600` it unless that is meant");
    }
    let text = std::fs::read_to_string(path).map_err(read_error)?;
    ApiToken::parse(&text, &path.display().to_string())
}

/// The token in `path`, or a new one written there with mode 0600 if there is none yet.
/// Returns whether it was generated now.
fn load_or_generate(path: &Path) -> Result<(ApiToken, bool), TokenError> {
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path);
    let mut file = match created {
        Ok(file) => file,
        // Kept from an earlier start: CLIs given that file keep working across restarts.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Ok((read_token_file(path)?, false))
        }
        Err(source) => {
            return Err(TokenError::Write {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let write_error = |source| TokenError::Write {
        path: path.to_path_buf(),
        source,
    };
    let token = ApiToken::generate()?;
    writeln!(file, "{}", token.as_str()).map_err(write_error)?;
    file.sync_all().map_err(write_error)?;
    Ok((token, true))
}

/// Whether `addr` is a loopback address (127.0.0.0/8, ::1, or ::ffff:127.x.y.z). The
/// unspecified address (0.0.0.0, ::) listens on every interface, so it is not.
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

/// What the node's API requires: `None` serves it open (loopback without a configured token).
///
/// A token file wins over `env_token` (the value of `ASHLAR_API_TOKEN`, empty counts as unset);
/// without either, a node beyond loopback uses `DATA_DIR/api-token`, generating it.
pub fn node_token(
    listen: &SocketAddr,
    token_file: Option<&Path>,
    env_token: Option<&str>,
    data_dir: &Path,
) -> Result<Option<(ApiToken, TokenSource)>, TokenError> {
    if let Some(path) = token_file {
        let token = read_token_file(path)?.require_min_length(&path.display().to_string())?;
        return Ok(Some((token, TokenSource::File(path.to_path_buf()))));
    }
    if let Some(text) = env_token.filter(|t| !t.is_empty()) {
        let token = ApiToken::parse(text, TOKEN_ENV)?.require_min_length(TOKEN_ENV)?;
        return Ok(Some((token, TokenSource::Env)));
    }
    if is_loopback(listen) {
        return Ok(None);
    }
    let path = data_dir.join(TOKEN_FILE_NAME);
    let (token, generated) = load_or_generate(&path)?;
    let token = token.require_min_length(&path.display().to_string())?;
    Ok(Some((token, TokenSource::DataDir { path, generated })))
}

/// The token the CLI sends: `--api-token-file`, else `ASHLAR_API_TOKEN`, else the node's
/// generated file under `default_data_dir` if this user can read it, else none.
pub fn client_token(
    token_file: Option<&Path>,
    env_token: Option<&str>,
    default_data_dir: &Path,
) -> Result<Option<(ApiToken, TokenSource)>, TokenError> {
    if let Some(path) = token_file {
        return Ok(Some((
            read_token_file(path)?,
            TokenSource::File(path.to_path_buf()),
        )));
    }
    if let Some(text) = env_token.filter(|t| !t.is_empty()) {
        return Ok(Some((ApiToken::parse(text, TOKEN_ENV)?, TokenSource::Env)));
    }
    let path = default_data_dir.join(TOKEN_FILE_NAME);
    match read_token_file(&path) {
        Ok(token) => Ok(Some((
            token,
            TokenSource::DataDir {
                path,
                generated: false,
            },
        ))),
        // No local node's token (or not ours to read): ask without one; a node that needs
        // one answers 401 and the CLI says how to pass it.
        Err(TokenError::Read { source, .. })
            if matches!(
                source.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The token in an `Authorization: Bearer <token>` header (the scheme is case-insensitive).
fn bearer(header: &HeaderValue) -> Option<&str> {
    let value = header.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Wrong,
}

/// The API's gate: the token every request must carry, if any.
#[derive(Clone, Debug, Default)]
pub struct ApiAuth {
    token: Option<Arc<ApiToken>>,
}

impl ApiAuth {
    pub fn new(token: Option<ApiToken>) -> ApiAuth {
        ApiAuth {
            token: token.map(Arc::new),
        }
    }

    pub fn requires_token(&self) -> bool {
        self.token.is_some()
    }

    /// Whether a request for `path` with this `Authorization` header may be served.
    pub fn check(&self, path: &str, header: Option<&HeaderValue>) -> Result<(), Refusal> {
        let Some(expected) = &self.token else {
            return Ok(());
        };
        if path == UNAUTHENTICATED_PATH {
            return Ok(());
        }
        match header.and_then(bearer) {
            None => Err(Refusal::Missing),
            Some(presented) if expected.matches(presented) => Ok(()),
            Some(_) => Err(Refusal::Wrong),
        }
    }
}

/// axum middleware: a request without the node's token gets 401 and the API's error JSON.
pub async fn require_token(State(auth): State<ApiAuth>, request: Request, next: Next) -> Response {
    let checked = auth.check(request.uri().path(), request.headers().get(AUTHORIZATION));
    match checked {
        Ok(()) => next.run(request).await,
        Err(refusal) => {
            tracing::debug!(method = %request.method(), path = request.uri().path(), ?refusal,
                "HTTP API request refused: no valid bearer token");
            unauthorized(refusal)
        }
    }
}

fn unauthorized(refusal: Refusal) -> Response {
    let (message, challenge) = match refusal {
        Refusal::Missing => (
            "this node's API requires a bearer token (`Authorization: Bearer <token>`); the CLI \
             takes it with --api-token-file PATH or ASHLAR_API_TOKEN",
            "Bearer realm=\"ashlar\"",
        ),
        Refusal::Wrong => (
            "wrong API token: this node requires another one",
            "Bearer realm=\"ashlar\", error=\"invalid_token\"",
        ),
    };
    let mut response = ApiError(StatusCode::UNAUTHORIZED, message.into()).into_response();
    response
        .headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(text: &str) -> ApiToken {
        ApiToken::parse(text, "test").unwrap()
    }

    fn header(text: &str) -> HeaderValue {
        HeaderValue::from_str(text).unwrap()
    }

    fn temp_dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    fn write_mode(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn the_right_token_matches_and_others_do_not() {
        let secret = token("0123456789abcdef-secret");
        assert!(secret.matches("0123456789abcdef-secret"));
        assert!(!secret.matches("0123456789abcdef-secreT"));
        assert!(!secret.matches("0123456789abcdef-secre"));
        assert!(!secret.matches("0123456789abcdef-secret "));
        assert!(!secret.matches(""));
    }

    #[test]
    fn a_gate_with_a_token_refuses_missing_and_wrong_tokens() {
        let auth = ApiAuth::new(Some(token("0123456789abcdef-secret")));
        let path = "/api/v1/vdisks";
        assert_eq!(auth.check(path, None), Err(Refusal::Missing));
        assert_eq!(
            auth.check(path, Some(&header("Bearer nope-nope-nope-nope"))),
            Err(Refusal::Wrong)
        );
        // Another scheme is no bearer token at all.
        assert_eq!(
            auth.check(path, Some(&header("Basic 0123456789abcdef-secret"))),
            Err(Refusal::Missing)
        );
        assert_eq!(
            auth.check(path, Some(&header("Bearer 0123456789abcdef-secret"))),
            Ok(())
        );
        assert_eq!(
            auth.check(path, Some(&header("bearer 0123456789abcdef-secret"))),
            Ok(()),
            "the scheme is case-insensitive"
        );
        for path in ["/metrics", "/stats/vdisks", "/api/v1/nodes", "/nowhere"] {
            assert_eq!(auth.check(path, None), Err(Refusal::Missing), "{path}");
        }
        assert_eq!(auth.check("/healthz", None), Ok(()));
    }

    #[test]
    fn a_gate_without_a_token_lets_everything_through() {
        let auth = ApiAuth::new(None);
        assert_eq!(auth.check("/api/v1/vdisks", None), Ok(()));
        assert_eq!(
            auth.check("/api/v1/vdisks", Some(&header("Bearer anything"))),
            Ok(())
        );
    }

    #[test]
    fn tokens_are_trimmed_and_checked() {
        assert_eq!(token("  abc\n").as_str(), "abc");
        assert!(matches!(
            ApiToken::parse(" \n", "f"),
            Err(TokenError::Empty { .. })
        ));
        assert!(matches!(
            ApiToken::parse("two words", "f"),
            Err(TokenError::BadCharacters { .. })
        ));
        assert!(matches!(
            ApiToken::parse(&"x".repeat(MAX_TOKEN_CHARS + 1), "f"),
            Err(TokenError::TooLong { .. })
        ));
        assert_eq!(
            format!("{:?}", token("hidden-secret")),
            "ApiToken(<redacted>)"
        );
    }

    #[test]
    fn generated_tokens_are_long_hex_and_differ() {
        let a = ApiToken::generate().unwrap();
        let b = ApiToken::generate().unwrap();
        assert_eq!(a.as_str().len(), 2 * GENERATED_TOKEN_BYTES);
        assert!(a.as_str().bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a.as_str(), b.as_str());
    }

    #[test]
    fn loopback_is_127_8_and_1_but_not_unspecified() {
        for addr in [
            "127.0.0.1:1",
            "127.3.2.1:1",
            "[::1]:1",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert!(is_loopback(&addr.parse().unwrap()), "{addr}");
        }
        for addr in ["0.0.0.0:1", "[::]:1", "10.0.0.2:1", "[fe80::1]:1"] {
            assert!(!is_loopback(&addr.parse().unwrap()), "{addr}");
        }
    }

    #[test]
    fn a_loopback_node_is_open_unless_told_a_token() {
        let dir = temp_dir();
        let loopback: SocketAddr = "127.0.0.1:10810".parse().unwrap();
        assert!(node_token(&loopback, None, None, dir.path())
            .unwrap()
            .is_none());
        assert!(
            node_token(&loopback, None, Some(""), dir.path())
                .unwrap()
                .is_none(),
            "an empty ASHLAR_API_TOKEN is unset"
        );
        assert!(!dir.path().join(TOKEN_FILE_NAME).exists());
        let (told, source) = node_token(&loopback, None, Some("0123456789abcdef"), dir.path())
            .unwrap()
            .unwrap();
        assert_eq!(told.as_str(), "0123456789abcdef");
        assert_eq!(source, TokenSource::Env);
    }

    #[test]
    fn a_node_beyond_loopback_generates_a_private_token_once() {
        let dir = temp_dir();
        let everywhere: SocketAddr = "0.0.0.0:10810".parse().unwrap();
        let path = dir.path().join(TOKEN_FILE_NAME);
        let (first, source) = node_token(&everywhere, None, None, dir.path())
            .unwrap()
            .unwrap();
        assert_eq!(
            source,
            TokenSource::DataDir {
                path: path.clone(),
                generated: true
            }
        );
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap().trim(),
            first.as_str()
        );
        // A restart keeps the token.
        let (second, source) = node_token(&everywhere, None, None, dir.path())
            .unwrap()
            .unwrap();
        assert_eq!(second.as_str(), first.as_str());
        assert_eq!(
            source,
            TokenSource::DataDir {
                path,
                generated: false
            }
        );
    }

    #[test]
    fn a_token_file_wins_and_must_be_private_and_long_enough() {
        let dir = temp_dir();
        let everywhere: SocketAddr = "0.0.0.0:10810".parse().unwrap();
        let file = dir.path().join("token");
        write_mode(&file, "from-the-file-0123456789\n", 0o600);
        let (token, source) = node_token(
            &everywhere,
            Some(&file),
            Some("from-env-0123456789"),
            dir.path(),
        )
        .unwrap()
        .unwrap();
        assert_eq!(token.as_str(), "from-the-file-0123456789");
        assert_eq!(source, TokenSource::File(file.clone()));
        assert!(
            !dir.path().join(TOKEN_FILE_NAME).exists(),
            "nothing generated when a token is given"
        );

        write_mode(&file, "from-the-file-0123456789\n", 0o644);
        assert!(matches!(
            node_token(&everywhere, Some(&file), None, dir.path()),
            Err(TokenError::OpenToOthers { mode: 0o644, .. })
        ));
        write_mode(&file, "short\n", 0o600);
        assert!(matches!(
            node_token(&everywhere, Some(&file), None, dir.path()),
            Err(TokenError::TooShort { chars: 5, .. })
        ));
        assert!(matches!(
            node_token(&everywhere, None, Some("short"), dir.path()),
            Err(TokenError::TooShort { .. })
        ));
        assert!(matches!(
            node_token(
                &everywhere,
                Some(&dir.path().join("missing")),
                None,
                dir.path()
            ),
            Err(TokenError::Read { .. })
        ));
    }

    #[test]
    fn the_client_takes_the_file_then_the_env_then_the_local_node_file() {
        let dir = temp_dir();
        let file = dir.path().join("token");
        write_mode(&file, "file-token\n", 0o600);
        let data_dir = dir.path().join("ashlar-data");
        std::fs::create_dir(&data_dir).unwrap();

        let (token, source) = client_token(Some(&file), Some("env-token"), &data_dir)
            .unwrap()
            .unwrap();
        assert_eq!(
            (token.as_str(), source),
            ("file-token", TokenSource::File(file))
        );
        let (token, source) = client_token(None, Some("env-token"), &data_dir)
            .unwrap()
            .unwrap();
        assert_eq!((token.as_str(), source), ("env-token", TokenSource::Env));
        assert!(client_token(None, None, &data_dir).unwrap().is_none());

        let local = data_dir.join(TOKEN_FILE_NAME);
        write_mode(&local, "local-token\n", 0o600);
        let (token, _) = client_token(None, None, &data_dir).unwrap().unwrap();
        assert_eq!(token.as_str(), "local-token");
        write_mode(&local, "local-token\n", 0o604);
        assert!(matches!(
            client_token(None, None, &data_dir),
            Err(TokenError::OpenToOthers { .. })
        ));
    }
}
