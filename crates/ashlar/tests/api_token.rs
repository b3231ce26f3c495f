//! The HTTP API's bearer token against a real node: a node listening beyond loopback refuses
//! requests without its token (curl, as a stranger would), the CLI passes the token from
//! `--api-token-file`, `ASHLAR_API_TOKEN` or `./ashlar-data/api-token`, and a loopback node
//! stays open unless it is given a token.

mod common;

use common::{
    ashlar, ashlar_env, ashlar_in, free_port, require_tool, run_bounded, vdisk_names, CmdOut, Node,
};
use serde_json::Value;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// An IPv4 address of this machine that is not loopback, if it has one: what a stranger on
/// the network would connect to.
fn non_loopback_ipv4() -> Option<Ipv4Addr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list`, which is read only until freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: a non-null entry of the list getifaddrs returned.
        let interface = unsafe { &*entry };
        let addr = interface.ifa_addr;
        // SAFETY: a non-null ifa_addr points to a sockaddr of the family it names.
        if !addr.is_null() && i32::from(unsafe { (*addr).sa_family }) == libc::AF_INET {
            let ipv4 = unsafe { &*(addr as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(u32::from_be(ipv4.sin_addr.s_addr));
            if !ip.is_loopback() {
                found = Some(ip);
                break;
            }
        }
        entry = interface.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// `curl` one request: (HTTP status, body). `token` goes in `Authorization: Bearer`.
fn curl(method: &str, url: &str, token: Option<&str>, body: Option<&str>) -> (u16, String) {
    require_tool("curl");
    let mut args = vec![
        "-s".to_string(),
        "-m".into(),
        "10".into(),
        "-X".into(),
        method.into(),
        "-w".into(),
        "\n%{http_code}".into(),
    ];
    if let Some(token) = token {
        args.extend(["-H".into(), format!("Authorization: Bearer {token}")]);
    }
    if let Some(body) = body {
        args.extend([
            "-H".into(),
            "Content-Type: application/json".into(),
            "-d".into(),
            body.into(),
        ]);
    }
    args.push(url.into());
    let out = CmdOut::from_output(run_bounded("curl", &args, 20));
    out.assert_ok(&format!("curl {method} {url}"));
    let (body, status) = out
        .stdout
        .rsplit_once('\n')
        .unwrap_or_else(|| panic!("curl printed no status: {:?}", out.stdout));
    (status.parse().unwrap(), body.to_string())
}

/// Asserts a 401 with the API's error shape, `{"error": "..."}` containing `needle`.
fn assert_refused((status, body): (u16, String), needle: &str, what: &str) {
    assert_eq!(status, 401, "{what}: {body}");
    let error: Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {body}"));
    let message = error["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no error field: {body}"));
    assert!(message.contains(needle), "{what}: {message:?}");
}

fn mode_of(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

fn write_token_file(path: &Path, token: &str, mode: u32) {
    std::fs::write(path, format!("{token}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn a_node_beyond_loopback_refuses_strangers_and_serves_the_token_holder() {
    // The node keeps its data in ./ashlar-data of `work`, so the CLI run there finds the token.
    let work = tempfile::tempdir().unwrap();
    let data_dir = work.path().join("ashlar-data");
    let mut node = Node::start_http_on(IpAddr::from([0, 0, 0, 0]), Some(data_dir.clone()), &[]);
    assert!(
        node.stdout().contains("(bearer token required)"),
        "{}",
        node.stdout()
    );

    // The generated token: only its owner may read it, and the node names the file, never
    // the token.
    let token_file = data_dir.join("api-token");
    assert_eq!(mode_of(&token_file), 0o600);
    let token = std::fs::read_to_string(&token_file)
        .unwrap()
        .trim()
        .to_string();
    assert_eq!(token.len(), 64, "{token:?}");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()), "{token:?}");
    assert!(node.log().contains(&token_file.display().to_string()));
    assert!(!node.log().contains(&token) && !node.stdout().contains(&token));

    // A stranger, from this machine's network address where it has one (the policy follows
    // the listening address, so loopback shows it too).
    let host = non_loopback_ipv4().unwrap_or(Ipv4Addr::LOCALHOST);
    let base = format!("http://{host}:{}", node.http_port);
    let vdisks = format!("{base}/api/v1/vdisks");
    assert_refused(
        curl("GET", &vdisks, None, None),
        "requires a bearer token",
        "GET without a token",
    );
    let create = r#"{"name": "stranger", "size_bytes": 1048576}"#;
    assert_refused(
        curl("POST", &vdisks, None, Some(create)),
        "requires a bearer token",
        "POST without a token",
    );
    assert_refused(
        curl(
            "POST",
            &vdisks,
            Some("not-the-token-0123456789"),
            Some(create),
        ),
        "wrong API token",
        "POST with a wrong token",
    );
    let prefix = &token[..token.len() - 1];
    assert_refused(
        curl("GET", &vdisks, Some(prefix), None),
        "wrong API token",
        "all but the token's last character",
    );
    for path in [
        "/api/v1/nodes",
        "/api/v1/volume-groups",
        "/stats/vdisks",
        "/metrics",
        "/no/such/endpoint",
    ] {
        assert_refused(
            curl("GET", &format!("{base}{path}"), None, None),
            "requires a bearer token",
            path,
        );
    }
    assert_eq!(
        curl("GET", &format!("{base}/healthz"), None, None),
        (200, "ok\n".to_string()),
        "probes need no token"
    );
    let (status, body) = curl("GET", &vdisks, Some(&token), None);
    assert_eq!((status, body.as_str()), (200, "[]"), "the token holder");

    // The CLI: without a token it says how to pass one, in one line.
    let server = node.server_url();
    let elsewhere = node.root.path();
    let out = ashlar_in(elsewhere, &["--server", &server, "vdisk", "list"], &[]);
    out.assert_cli_error("requires an API token: pass --api-token-file PATH");
    assert!(out.stderr.contains("ASHLAR_API_TOKEN"), "{}", out.stderr);
    ashlar_env(
        &["--server", &server, "vdisk", "list"],
        &[("ASHLAR_API_TOKEN", "not-the-token-0123456789")],
    )
    .assert_cli_error("refused the API token from ASHLAR_API_TOKEN");

    // With the token: --api-token-file (before or after the subcommand), ASHLAR_API_TOKEN,
    // and ./ashlar-data/api-token by default.
    let file = token_file.display().to_string();
    ashlar(&[
        "--server",
        &server,
        "--api-token-file",
        &file,
        "vdisk",
        "create",
        "db1",
        "--size",
        "64M",
    ])
    .assert_ok("vdisk create with --api-token-file");
    ashlar(&[
        "--server",
        &server,
        "vg",
        "create",
        "grp",
        "--api-token-file",
        &file,
    ])
    .assert_ok("vg create with --api-token-file after the subcommand");
    let out = ashlar_env(
        &["--server", &server, "node", "list", "--json"],
        &[("ASHLAR_API_TOKEN", &token)],
    );
    out.assert_ok("node list with ASHLAR_API_TOKEN");
    let nodes: Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(nodes.as_array().map(Vec::len), Some(1), "{nodes}");
    let out = ashlar_in(
        work.path(),
        &["--server", &server, "vdisk", "list", "--json"],
        &[],
    );
    assert_eq!(
        vdisk_names(&out),
        ["db1"],
        "the stranger's POST created nothing"
    );
    let out = ashlar_env(
        &["--server", &server, "vdisk", "list", "--json"],
        &[("ASHLAR_API_TOKEN_FILE", &file)],
    );
    assert_eq!(vdisk_names(&out), ["db1"]);

    // A restart keeps the token, so CLIs given it keep working.
    node.sigterm_and_wait();
    node.restart();
    assert_eq!(std::fs::read_to_string(&token_file).unwrap().trim(), token);
    let out = ashlar(&[
        "--server",
        &server,
        "--api-token-file",
        &file,
        "vdisk",
        "list",
        "--json",
    ]);
    assert_eq!(vdisk_names(&out), ["db1"]);
    assert_refused(
        curl("GET", &vdisks, None, None),
        "requires a bearer token",
        "after the restart",
    );
}

#[test]
fn a_loopback_node_is_open_unless_given_a_token() {
    // The README's quick start: no token anywhere.
    let open = Node::start();
    let (status, body) = open.http_get("/api/v1/vdisks");
    assert_eq!((status, body.as_str()), (200, "[]"));
    assert!(!open.data_dir.join("api-token").exists());
    assert!(
        !open.stdout().contains("bearer token required"),
        "{}",
        open.stdout()
    );
    open.create_vdisk("quick", "64M");

    // A configured token is required on loopback too.
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    let token = "loopback-token-0123456789";
    write_token_file(&token_file, token, 0o600);
    let file = token_file.display().to_string();
    let guarded = Node::start_with(&["--api-token-file", &file]);
    assert!(guarded.stdout().contains("(bearer token required)"));
    assert!(
        !guarded.data_dir.join("api-token").exists(),
        "nothing generated"
    );
    let url = format!("{}/api/v1/vdisks", guarded.server_url());
    assert_refused(
        curl("GET", &url, None, None),
        "requires a bearer token",
        "loopback with a configured token",
    );
    assert_eq!(guarded.http_get("/healthz"), (200, "ok\n".to_string()));
    assert_eq!(curl("GET", &url, Some(token), None).0, 200);
    guarded
        .cli(&[
            "--api-token-file",
            &file,
            "vdisk",
            "create",
            "kept",
            "--size",
            "64M",
        ])
        .assert_ok("vdisk create with the token");
    guarded
        .cli(&["vdisk", "list"])
        .assert_cli_error("requires an API token");
}

#[test]
fn a_node_refuses_a_token_file_others_can_read_or_a_short_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    let file = token_file.display().to_string();
    let data_dir = dir.path().join("data").display().to_string();
    let http = format!("127.0.0.1:{}", free_port());
    let nbd = format!("127.0.0.1:{}", free_port());
    let iscsi = format!("127.0.0.1:{}", free_port());
    let node = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec![
            "node",
            "--data-dir",
            &data_dir,
            "--http-listen",
            &http,
            "--nbd-listen",
            &nbd,
            "--iscsi-listen",
            &iscsi,
        ];
        args.extend_from_slice(extra);
        ashlar_env(&args, env)
    };
    write_token_file(&token_file, "readable-by-all-0123456789", 0o644);
    assert_fails(
        node(&["--api-token-file", &file], &[]),
        "open to other users (mode 644)",
    );
    write_token_file(&token_file, "short", 0o600);
    assert_fails(node(&["--api-token-file", &file], &[]), "use at least 16");
    assert_fails(
        node(&[], &[("ASHLAR_API_TOKEN", "short")]),
        "use at least 16",
    );
}

/// A node that refused to start: exit 1 with an `error:` line containing `needle`. (Not
/// `assert_cli_error`: a node may log warnings before it checks its token.)
fn assert_fails(out: CmdOut, needle: &str) {
    assert_eq!(out.code(), Some(1), "{out:?}");
    let error = out.stderr.lines().find(|l| l.starts_with("error:"));
    assert!(
        error.is_some_and(|l| l.contains(needle)),
        "expected an error line with {needle:?}: {}",
        out.stderr
    );
}
