use super::*;
use crate::limits::IscsiLimits;
use crate::testing::{TestRegistry, INITIATOR, TARGET};

fn request(transit: bool, csg: u8, nsg: u8, text: &str) -> LoginRequest {
    LoginRequest {
        transit,
        continue_: false,
        current_stage: csg,
        next_stage: nsg,
        version_min: 0,
        isid: [0x80, 0, 0, 0, 0, 1],
        tsih: 0,
        text: text.replace(';', "\0").into_bytes(),
    }
}

fn login() -> Login {
    Login::new(&Effective::from(&IscsiLimits::default()))
}

fn reply_of(step: Step) -> LoginReply {
    match step {
        Step::Continue(r) | Step::Fail(r) | Step::Done(r, _) => r,
    }
}

#[test]
fn no_auth_login_goes_to_full_feature() {
    let registry = TestRegistry::open();
    let mut l = login();
    let first = format!("InitiatorName={INITIATOR};TargetName={TARGET};AuthMethod=None;");
    let step = l.step(&request(true, 0, 1, &first), &registry);
    let r = reply_of(step);
    assert_eq!(r.status, status::SUCCESS);
    assert!(r.transit);
    assert_eq!(r.text.get("AuthMethod"), Some("None"));
    assert_eq!(r.text.get("TargetPortalGroupTag"), Some("1"));
    let ops = "HeaderDigest=CRC32C,None;DataDigest=None;MaxRecvDataSegmentLength=65536;\
        MaxBurstLength=262144;FirstBurstLength=65536;InitialR2T=No;ImmediateData=Yes;\
        ErrorRecoveryLevel=0;MaxConnections=1;";
    match l.step(&request(true, 1, 3, ops), &registry) {
        Step::Done(r, done) => {
            assert_eq!(r.status, status::SUCCESS);
            assert_eq!(r.text.get("HeaderDigest"), Some("CRC32C"));
            assert!(r.text.get("MaxRecvDataSegmentLength").is_some());
            assert!(done.params.header_digest);
            assert!(!done.params.initial_r2t);
            assert_eq!(done.params.initiator_max_recv_data_segment, 65536);
            assert_eq!(
                done.kind,
                SessionKind::Normal {
                    target: TARGET.into()
                }
            );
        }
        other => panic!("expected Done, got {other:?}"),
    }
}

#[test]
fn unknown_target_and_initiator_are_refused() {
    let registry = TestRegistry::open();
    let step = login().step(
        &request(
            true,
            0,
            1,
            &format!("InitiatorName={INITIATOR};TargetName=iqn.nope;"),
        ),
        &registry,
    );
    assert!(matches!(step, Step::Fail(ref r) if r.status == status::NOT_FOUND));
    let step = login().step(
        &request(
            true,
            0,
            1,
            &format!("InitiatorName=iqn.other;TargetName={TARGET};"),
        ),
        &registry,
    );
    assert!(matches!(step, Step::Fail(ref r) if r.status == status::AUTHORIZATION_FAILURE));
    let step = login().step(&request(true, 0, 1, "TargetName=x;"), &registry);
    assert!(matches!(step, Step::Fail(ref r) if r.status == status::MISSING_PARAMETER));
}

fn chap_exchange(secret: &str, mutual: Option<(&str, &str)>) -> (Step, Option<(u8, Vec<u8>)>) {
    let mut registry = TestRegistry::chap("user", "secret-12345");
    if let Some((user, secret)) = mutual {
        registry.access.mutual_chap = Some(crate::registry::ChapCredentials {
            user: user.into(),
            secret: secret.into(),
        });
    }
    let mut l = login();
    let first = format!("InitiatorName={INITIATOR};TargetName={TARGET};AuthMethod=CHAP,None;");
    let r = reply_of(l.step(&request(false, 0, 0, &first), &registry));
    assert_eq!(r.text.get("AuthMethod"), Some("CHAP"));
    let r = reply_of(l.step(&request(false, 0, 0, "CHAP_A=5;"), &registry));
    let id: u8 = r.text.get("CHAP_I").unwrap().parse().unwrap();
    let challenge = chap::decode_binary(r.text.get("CHAP_C").unwrap()).unwrap();
    let answer = chap::response(id, secret.as_bytes(), &challenge);
    let mut text = format!("CHAP_N=user;CHAP_R={};", chap::encode_hex(&answer));
    let mine = vec![9u8; 16];
    if mutual.is_some() {
        text.push_str(&format!("CHAP_I=3;CHAP_C={};", chap::encode_hex(&mine)));
    }
    let step = l.step(&request(true, 0, 1, &text), &registry);
    (step, mutual.map(|_| (3, mine)))
}

#[test]
fn chap_right_and_wrong_secret() {
    let (step, _) = chap_exchange("secret-12345", None);
    let r = reply_of(step);
    assert_eq!(r.status, status::SUCCESS);
    assert!(r.transit);
    let (step, _) = chap_exchange("wrong", None);
    assert!(matches!(step, Step::Fail(ref r) if r.status == status::AUTHENTICATION_FAILURE));
}

#[test]
fn mutual_chap_answers_the_initiator() {
    let (step, challenge) = chap_exchange("secret-12345", Some(("target", "mutual-secret")));
    let r = reply_of(step);
    assert_eq!(r.status, status::SUCCESS);
    let (id, challenge) = challenge.unwrap();
    let expected = chap::response(id, b"mutual-secret", &challenge);
    assert_eq!(r.text.get("CHAP_N"), Some("target"));
    assert_eq!(
        chap::decode_binary(r.text.get("CHAP_R").unwrap()).unwrap(),
        expected
    );
}

#[test]
fn chap_required_but_not_offered() {
    let registry = TestRegistry::chap("user", "secret-12345");
    let first = format!("InitiatorName={INITIATOR};TargetName={TARGET};AuthMethod=None;");
    let step = login().step(&request(true, 0, 1, &first), &registry);
    assert!(matches!(step, Step::Fail(ref r) if r.status == status::AUTHENTICATION_FAILURE));
    // Skipping the security stage does not help.
    let first = format!("InitiatorName={INITIATOR};TargetName={TARGET};");
    let step = login().step(&request(true, 1, 3, &first), &registry);
    assert!(matches!(step, Step::Fail(ref r) if r.status == status::AUTHENTICATION_FAILURE));
}

#[test]
fn discovery_needs_no_target() {
    let registry = TestRegistry::open();
    let first = "InitiatorName=iqn.anyone;SessionType=Discovery;".to_string();
    match login().step(&request(true, 1, 3, &first), &registry) {
        Step::Done(_, done) => assert_eq!(done.kind, SessionKind::Discovery),
        other => panic!("{other:?}"),
    }
}

#[test]
fn discovery_chap_when_the_registry_asks_for_it() {
    let mut registry = TestRegistry::open();
    registry.discovery.chap = Some(crate::registry::ChapCredentials {
        user: "disc".into(),
        secret: "discovery-secret".into(),
    });
    let first = "InitiatorName=iqn.anyone;SessionType=Discovery;AuthMethod=None;".to_string();
    let step = login().step(&request(true, 0, 1, &first), &registry);
    assert!(matches!(step, Step::Fail(ref r) if r.status == status::AUTHENTICATION_FAILURE));
    let first = "InitiatorName=iqn.anyone;SessionType=Discovery;".to_string();
    let step = login().step(&request(true, 1, 3, &first), &registry);
    assert!(
        matches!(step, Step::Fail(ref r) if r.status == status::AUTHENTICATION_FAILURE),
        "skipping the security stage does not help"
    );
    let mut l = login();
    let first = "InitiatorName=iqn.anyone;SessionType=Discovery;AuthMethod=CHAP,None;";
    let r = reply_of(l.step(&request(false, 0, 0, first), &registry));
    assert_eq!(r.text.get("AuthMethod"), Some("CHAP"));
    // Normal sessions still follow the target's own rule (none here).
    let first = format!("InitiatorName={INITIATOR};TargetName={TARGET};AuthMethod=None;");
    let r = reply_of(login().step(&request(true, 0, 1, &first), &registry));
    assert_eq!(r.status, status::SUCCESS);
}

#[test]
fn bad_stage_and_version_are_refused() {
    let registry = TestRegistry::open();
    let mut bad = request(true, 0, 2, "InitiatorName=a;SessionType=Discovery;");
    assert!(matches!(login().step(&bad, &registry), Step::Fail(_)));
    bad.next_stage = 1;
    bad.version_min = 3;
    assert!(matches!(
        login().step(&bad, &registry),
        Step::Fail(ref r) if r.status == status::UNSUPPORTED_VERSION
    ));
}

#[test]
fn unavailable_targets_answer_redirection_or_service_unavailable() {
    let moved = TargetUnavailable::MovedTemporarily {
        address: "[fe80::1]:3260".into(),
    };
    let reply = unavailable_reply(STAGE_OPERATIONAL, &moved);
    assert_eq!(reply.status, 0x0101);
    assert!(!reply.transit);
    assert_eq!(reply.current_stage, STAGE_OPERATIONAL);
    // RFC 7143 13.8: no portal group tag in a redirection's TargetAddress.
    assert_eq!(reply.text.get("TargetAddress"), Some("[fe80::1]:3260"));
    let reply = unavailable_reply(STAGE_OPERATIONAL, &TargetUnavailable::ServiceUnavailable);
    assert_eq!(reply.status, 0x0301);
    assert_eq!(reply.text.get("TargetAddress"), None);
}
