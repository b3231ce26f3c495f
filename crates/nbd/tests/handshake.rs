//! Handshake phase over real TCP: options, info items, meta contexts, timeouts.

mod common;

use ashlar_nbd::NbdLimits;
use common::client::*;
use common::{assert_flags, assert_healthy, registry, run, TestServer, MEM_SIZE, SMALL_SIZE};
use std::time::Duration;
use tokio::io::AsyncReadExt;

#[test]
fn list_shows_every_export_with_its_description() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        c.send_option(OPT_LIST, &[]).await;
        let mut exports = Vec::new();
        loop {
            let reply = c.option_reply().await;
            if reply.kind == REP_ACK {
                break;
            }
            assert_eq!(reply.kind, REP_SERVER);
            let len = be32(&reply.data) as usize;
            let name = String::from_utf8(reply.data[4..4 + len].to_vec()).unwrap();
            let description = String::from_utf8(reply.data[4 + len..].to_vec()).unwrap();
            exports.push((name, description));
        }
        assert_eq!(
            exports,
            vec![
                ("mem".into(), "memory export".into()),
                ("small".into(), "a small one".into())
            ]
        );
        c.send_option(OPT_LIST, b"junk").await;
        assert_eq!(c.option_reply().await.kind, REP_ERR_INVALID);
        c.send_option(OPT_ABORT, &[]).await;
        assert_eq!(c.option_reply().await.kind, REP_ACK);
        assert!(c.closed_by_server().await);
        assert_eq!(server.stop().await, vec![Ok(())]);
    });
}

#[test]
fn info_then_go_report_size_name_description_and_block_sizes() {
    run(async {
        let limits = NbdLimits {
            min_block_size: 512,
            preferred_block_size: 8192,
            max_request_bytes: 1 << 20,
            ..NbdLimits::default()
        };
        let server = TestServer::start(registry(), limits).await;
        let mut c = Client::greet(server.addr, 1).await;
        let wanted = [INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE, 999];
        let info = c.go(OPT_INFO, "small", &wanted).await.unwrap();
        assert_eq!(info.size, SMALL_SIZE);
        assert_flags(info.flags);
        assert_eq!(info.item(INFO_NAME), Some(&b"small"[..]));
        assert_eq!(info.item(INFO_DESCRIPTION), Some(&b"a small one"[..]));
        let sizes = info.item(INFO_BLOCK_SIZE).unwrap();
        assert_eq!(
            (be32(sizes), be32(&sizes[4..]), be32(&sizes[8..])),
            (512, 8192, 1 << 20)
        );

        // INFO does not end the handshake; GO does, with the same information.
        let go = c.go(OPT_GO, "mem", &[]).await.unwrap();
        assert_eq!(go.size, MEM_SIZE);
        assert!(go.item(INFO_NAME).is_none(), "not requested");
        assert!(go.item(INFO_BLOCK_SIZE).is_some(), "always sent");
        assert_eq!(c.write(512, &[7; 512], 0).await, 0);
        assert_eq!(
            c.read(100, 512).await.error,
            EINVAL,
            "unaligned to the minimum block"
        );
        server.stop().await;
    });
}

#[test]
fn unknown_export_is_an_error_and_the_session_continues() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        let reply = c.go(OPT_GO, "nope", &[]).await.unwrap_err();
        assert_eq!(reply.kind, REP_ERR_UNKNOWN);
        assert!(String::from_utf8(reply.data).unwrap().contains("nope"));
        let reply = c.go(OPT_INFO, "", &[]).await.unwrap_err();
        assert_eq!(
            reply.kind, REP_ERR_UNKNOWN,
            "no default export in this registry"
        );
        assert_eq!(c.go(OPT_GO, "mem", &[]).await.unwrap().size, MEM_SIZE);
        c.disconnect().await;
        server.stop().await;
    });
}

#[test]
fn export_name_sends_padding_unless_no_zeroes() {
    run(async {
        let server = TestServer::default().await;
        for (flags, expected_len) in [(1u32, 134usize), (3, 10)] {
            let mut c = Client::greet(server.addr, flags).await;
            c.send_option(OPT_EXPORT_NAME, b"small").await;
            let mut reply = vec![0u8; expected_len];
            c.stream.read_exact(&mut reply).await.unwrap();
            assert_eq!(be64(&reply), SMALL_SIZE);
            assert_flags(be16(&reply[8..]));
            assert!(reply[10..].iter().all(|b| *b == 0));
            // The next bytes must be the reply to this read, not more padding.
            assert_eq!(c.read(0, 16).await.data, vec![0u8; 16]);
            c.disconnect().await;
            assert!(c.closed_by_server().await);
        }
        // An unknown name cannot be answered with an error: the server hangs up.
        let mut c = Client::greet(server.addr, 1).await;
        c.send_option(OPT_EXPORT_NAME, b"missing").await;
        assert!(c.closed_by_server().await);
        let outcomes = server.ended(3).await;
        assert!(
            outcomes[2].as_ref().unwrap_err().contains("missing"),
            "{outcomes:?}"
        );
        server.stop().await;
    });
}

#[test]
fn unsupported_options_get_err_unsup() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        for option in [OPT_STARTTLS, 4, 11, 12345] {
            c.send_option(option, b"some data").await;
            let reply = c.option_reply().await;
            assert_eq!((reply.option, reply.kind), (option, REP_ERR_UNSUP));
        }
        assert_eq!(c.go(OPT_GO, "mem", &[]).await.unwrap().size, MEM_SIZE);
        server.stop().await;
    });
}

#[test]
fn structured_reply_option_takes_no_data() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        c.send_option(OPT_STRUCTURED_REPLY, b"x").await;
        assert_eq!(c.option_reply().await.kind, REP_ERR_INVALID);
        // Still simple replies, since negotiation failed.
        c.go(OPT_GO, "mem", &[]).await.unwrap();
        let answer = c.read(0, 8).await;
        assert_eq!((answer.error, answer.chunk_types.len()), (0, 0));
        server.stop().await;
    });
}

#[test]
fn meta_context_options_follow_the_rules() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        // Structured replies come first.
        let (_, kind) = c
            .meta(OPT_SET_META_CONTEXT, "mem", &["base:allocation"])
            .await;
        assert_eq!(kind, REP_ERR_INVALID);
        c.send_option(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(c.option_reply().await.kind, REP_ACK);
        c.mark_structured();

        let listed = |v: Vec<(u32, String)>| v.into_iter().map(|(_, n)| n).collect::<Vec<_>>();
        let (all, kind) = c.meta(OPT_LIST_META_CONTEXT, "mem", &[]).await;
        assert_eq!(
            (listed(all), kind),
            (vec!["base:allocation".to_string()], REP_ACK)
        );
        let (wild, _) = c.meta(OPT_LIST_META_CONTEXT, "mem", &["base:"]).await;
        assert_eq!(wild.len(), 1);
        let (other, kind) = c
            .meta(OPT_LIST_META_CONTEXT, "mem", &["x-foo:bar", "base:nothing"])
            .await;
        assert_eq!((other.len(), kind), (0, REP_ACK));
        let (none, kind) = c.meta(OPT_SET_META_CONTEXT, "mem", &["base:"]).await;
        assert_eq!((none.len(), kind), (0, REP_ACK), "base: is not a selection");
        let (_, kind) = c
            .meta(OPT_SET_META_CONTEXT, "ghost", &["base:allocation"])
            .await;
        assert_eq!(kind, REP_ERR_UNKNOWN);
        let mut truncated = meta_payload("mem", &["base:allocation"]);
        truncated.pop();
        c.send_option(OPT_SET_META_CONTEXT, &truncated).await;
        assert_eq!(c.option_reply().await.kind, REP_ERR_INVALID);

        // Selected for another export than the one entered: block status is not available.
        let (selected, _) = c
            .meta(OPT_SET_META_CONTEXT, "small", &["base:allocation"])
            .await;
        assert_eq!(selected.len(), 1);
        c.go(OPT_GO, "mem", &[]).await.unwrap();
        let answer = c.call(CMD_BLOCK_STATUS, 0, 0, 4096, &[]).await;
        assert_eq!(answer.error, EINVAL);
        server.stop().await;
    });
}

#[test]
fn handshake_times_out() {
    run(async {
        let limits = NbdLimits {
            handshake_timeout: Duration::from_millis(200),
            ..NbdLimits::default()
        };
        let server = TestServer::start(registry(), limits).await;
        let mut idle = Client::greet(server.addr, 1).await;
        assert!(idle.closed_by_server().await);
        let outcomes = server.ended(1).await;
        assert!(
            outcomes[0].as_ref().unwrap_err().contains("handshake"),
            "{outcomes:?}"
        );
        assert_healthy(server.addr).await;
        server.stop().await;
    });
}

#[test]
fn shutdown_during_handshake_closes_idle_clients() {
    run(async {
        let server = TestServer::default().await;
        let mut c = Client::greet(server.addr, 1).await;
        c.send_option(OPT_LIST, &[]).await;
        while c.option_reply().await.kind != REP_ACK {}
        server.trigger_shutdown();
        assert!(c.closed_by_server().await);
        assert_eq!(server.stop().await, vec![Ok(())]);
    });
}
