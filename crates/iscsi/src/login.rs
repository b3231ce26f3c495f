//! The login phase as a pure state machine (RFC 7143 sections 6 and 11.12-11.13): security
//! negotiation (AuthMethod None or CHAP, one-way or mutual), operational negotiation of every
//! key the RFC defines, and the stage transitions. [`Login::step`] takes one decoded login
//! request and returns the response to send; the connection does the I/O.

use crate::chap;
use crate::limits::Effective;
use crate::params::{negotiate_key, SessionParams};
use crate::registry::{Access, Refusal, TargetRegistry, TargetUnavailable};
use crate::text::TextPairs;

/// Login stages (CSG/NSG values).
pub const STAGE_SECURITY: u8 = 0;
pub const STAGE_OPERATIONAL: u8 = 1;
pub const STAGE_FULL_FEATURE: u8 = 3;

/// Login status class and detail (RFC 7143 11.13.5), as one `u16`.
pub mod status {
    pub const SUCCESS: u16 = 0x0000;
    /// Redirection: log in at the `TargetAddress` the response carries.
    pub const TARGET_MOVED_TEMPORARILY: u16 = 0x0101;
    pub const INITIATOR_ERROR: u16 = 0x0200;
    pub const AUTHENTICATION_FAILURE: u16 = 0x0201;
    pub const AUTHORIZATION_FAILURE: u16 = 0x0202;
    pub const NOT_FOUND: u16 = 0x0203;
    pub const UNSUPPORTED_VERSION: u16 = 0x0205;
    pub const MISSING_PARAMETER: u16 = 0x0207;
    pub const SESSION_DOES_NOT_EXIST: u16 = 0x020a;
    pub const INVALID_DURING_LOGIN: u16 = 0x020b;
    pub const TARGET_ERROR: u16 = 0x0300;
    /// The target is not operational at this portal now; the initiator may try again later.
    pub const SERVICE_UNAVAILABLE: u16 = 0x0301;
    pub const OUT_OF_RESOURCES: u16 = 0x0302;
}

/// The fields of a login request the state machine needs.
#[derive(Debug, Clone)]
pub struct LoginRequest {
    pub transit: bool,
    pub continue_: bool,
    pub current_stage: u8,
    pub next_stage: u8,
    pub version_min: u8,
    pub isid: [u8; 6],
    pub tsih: u16,
    pub text: Vec<u8>,
}

/// What to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoginReply {
    pub transit: bool,
    pub current_stage: u8,
    pub next_stage: u8,
    pub status: u16,
    pub text: TextPairs,
}

impl LoginReply {
    fn failure(stage: u8, status: u16) -> Self {
        LoginReply {
            transit: false,
            current_stage: stage,
            next_stage: 0,
            status,
            text: TextPairs::default(),
        }
    }
}

/// The final login response for a target that cannot be served through this portal now
/// (RFC 7143 11.13.5): a redirection carries the `TargetAddress` to log in at instead, with
/// no portal group tag (RFC 7143 13.8: omitted in a redirection).
pub fn unavailable_reply(stage: u8, unavailable: &TargetUnavailable) -> LoginReply {
    match unavailable {
        TargetUnavailable::MovedTemporarily { address } => {
            let mut reply = LoginReply::failure(stage, status::TARGET_MOVED_TEMPORARILY);
            reply.text.push("TargetAddress", address.clone());
            reply
        }
        TargetUnavailable::ServiceUnavailable => {
            LoginReply::failure(stage, status::SERVICE_UNAVAILABLE)
        }
    }
}

/// Whether the session is for discovery or for a target's LUNs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionKind {
    Discovery,
    Normal { target: String },
}

/// A finished login.
#[derive(Debug, Clone)]
pub struct LoggedIn {
    pub initiator: String,
    pub isid: [u8; 6],
    pub kind: SessionKind,
    pub params: SessionParams,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Auth {
    /// No AuthMethod chosen yet.
    Pending,
    /// AuthMethod=CHAP answered; waiting for CHAP_A.
    ChapChosen,
    /// Challenge sent; waiting for CHAP_N/CHAP_R.
    ChallengeSent { identifier: u8, challenge: Vec<u8> },
    /// Authenticated (or no authentication required).
    Done,
}

/// One connection's login.
pub struct Login {
    stage: u8,
    first: bool,
    initiator: Option<String>,
    kind: Option<SessionKind>,
    access: Access,
    auth: Auth,
    params: SessionParams,
    /// Text of requests sent with the C bit, waiting for the last part.
    partial: Vec<u8>,
    max_text: usize,
    declared_limits: bool,
    isid: [u8; 6],
}

/// The result of one step.
#[derive(Debug)]
pub enum Step {
    /// Send the reply and read the next request.
    Continue(LoginReply),
    /// Send the reply (a success into full feature phase) and start the session.
    Done(LoginReply, Box<LoggedIn>),
    /// Send the reply (a failure) and close the connection.
    Fail(LoginReply),
}

impl Login {
    pub fn new(limits: &Effective) -> Self {
        Login {
            stage: STAGE_SECURITY,
            first: true,
            initiator: None,
            kind: None,
            access: Access::default(),
            auth: Auth::Pending,
            params: SessionParams::initial(limits),
            partial: Vec::new(),
            max_text: limits.max_text_bytes,
            declared_limits: false,
            isid: [0; 6],
        }
    }

    pub fn initiator(&self) -> Option<&str> {
        self.initiator.as_deref()
    }

    /// Processes one login request.
    pub fn step<R: TargetRegistry + ?Sized>(
        &mut self,
        request: &LoginRequest,
        registry: &R,
    ) -> Step {
        let stage = request.current_stage;
        if request.version_min > 0 {
            return Step::Fail(LoginReply::failure(stage, status::UNSUPPORTED_VERSION));
        }
        // The first request may start in either negotiation stage; later ones continue ours.
        let stage_ok = if self.first {
            stage == STAGE_SECURITY || stage == STAGE_OPERATIONAL
        } else {
            stage == self.stage
        };
        let transit_ok = !request.transit
            || (request.next_stage > stage
                && (request.next_stage == STAGE_OPERATIONAL
                    || request.next_stage == STAGE_FULL_FEATURE));
        if !stage_ok || !transit_ok || (request.transit && request.continue_) {
            return Step::Fail(LoginReply::failure(stage, status::INITIATOR_ERROR));
        }
        self.stage = stage;
        if self.partial.len() + request.text.len() > self.max_text {
            return Step::Fail(LoginReply::failure(stage, status::OUT_OF_RESOURCES));
        }
        self.partial.extend_from_slice(&request.text);
        if request.continue_ {
            // More text follows: acknowledge with an empty response (RFC 7143 6.2).
            return Step::Continue(LoginReply {
                transit: false,
                current_stage: stage,
                next_stage: 0,
                status: status::SUCCESS,
                text: TextPairs::default(),
            });
        }
        let text = std::mem::take(&mut self.partial);
        let pairs = match TextPairs::parse(&text) {
            Ok(pairs) => pairs,
            Err(_) => return Step::Fail(LoginReply::failure(stage, status::INITIATOR_ERROR)),
        };
        let mut reply = TextPairs::default();
        if self.first {
            self.first = false;
            self.isid = request.isid;
            if request.tsih != 0 {
                // Adding a connection to an existing session (MaxConnections is 1).
                return Step::Fail(LoginReply::failure(stage, status::SESSION_DOES_NOT_EXIST));
            }
            if let Err(code) = self.identify(&pairs, registry, &mut reply) {
                return Step::Fail(LoginReply::failure(stage, code));
            }
        } else if pairs.get("InitiatorName").is_some() || pairs.get("SessionType").is_some() {
            // Declared once, in the first request.
            if pairs.get("InitiatorName") != self.initiator.as_deref() {
                return Step::Fail(LoginReply::failure(stage, status::INVALID_DURING_LOGIN));
            }
        }
        let outcome = if stage == STAGE_SECURITY {
            self.security(&pairs, &mut reply)
        } else {
            self.operational(&pairs, &mut reply)
        };
        if let Err(code) = outcome {
            return Step::Fail(LoginReply::failure(stage, code));
        }
        self.finish_step(request, reply)
    }

    /// The first request: who is logging in, to what, and what that requires.
    fn identify<R: TargetRegistry + ?Sized>(
        &mut self,
        pairs: &TextPairs,
        registry: &R,
        reply: &mut TextPairs,
    ) -> Result<(), u16> {
        let initiator = pairs
            .get("InitiatorName")
            .filter(|name| !name.is_empty())
            .ok_or(status::MISSING_PARAMETER)?;
        self.initiator = Some(initiator.to_string());
        let kind = match pairs.get("SessionType").unwrap_or("Normal") {
            "Discovery" => {
                self.access = registry.discovery_access(initiator);
                SessionKind::Discovery
            }
            "Normal" => {
                let target = pairs
                    .get("TargetName")
                    .filter(|name| !name.is_empty())
                    .ok_or(status::MISSING_PARAMETER)?;
                self.access =
                    registry
                        .authorize(initiator, target)
                        .map_err(|refusal| match refusal {
                            Refusal::UnknownTarget => status::NOT_FOUND,
                            Refusal::NotAttached => status::AUTHORIZATION_FAILURE,
                        })?;
                reply.push("TargetPortalGroupTag", "1");
                SessionKind::Normal {
                    target: target.to_string(),
                }
            }
            _ => return Err(status::INITIATOR_ERROR),
        };
        self.kind = Some(kind);
        Ok(())
    }

    fn security(&mut self, pairs: &TextPairs, reply: &mut TextPairs) -> Result<(), u16> {
        let chap = self.access.chap.clone();
        if let Some(methods) = pairs.get("AuthMethod") {
            if self.auth != Auth::Pending {
                return Err(status::INITIATOR_ERROR);
            }
            let offered: Vec<&str> = methods.split(',').collect();
            if chap.is_some() {
                if !offered.contains(&"CHAP") {
                    return Err(status::AUTHENTICATION_FAILURE);
                }
                reply.push("AuthMethod", "CHAP");
                self.auth = Auth::ChapChosen;
            } else if offered.contains(&"None") {
                reply.push("AuthMethod", "None");
                self.auth = Auth::Done;
            } else {
                return Err(status::AUTHENTICATION_FAILURE);
            }
        }
        if let Some(algorithms) = pairs.get("CHAP_A") {
            if self.auth != Auth::ChapChosen {
                return Err(status::INITIATOR_ERROR);
            }
            if !algorithms.split(',').any(|a| a == "5") {
                return Err(status::AUTHENTICATION_FAILURE);
            }
            let (identifier, challenge) = chap::random_challenge();
            reply.push("CHAP_A", "5");
            reply.push("CHAP_I", identifier.to_string());
            reply.push("CHAP_C", chap::encode_hex(&challenge));
            self.auth = Auth::ChallengeSent {
                identifier,
                challenge: challenge.to_vec(),
            };
        }
        if pairs.get("CHAP_R").is_some() || pairs.get("CHAP_N").is_some() {
            self.check_chap_response(pairs, reply)?;
        }
        for (key, value) in &pairs.0 {
            if !is_security_key(key) && !is_declarative(key) {
                self.negotiate(key, value, reply);
            }
        }
        Ok(())
    }

    fn check_chap_response(&mut self, pairs: &TextPairs, reply: &mut TextPairs) -> Result<(), u16> {
        let Auth::ChallengeSent {
            identifier,
            challenge,
        } = &self.auth
        else {
            return Err(status::INITIATOR_ERROR);
        };
        let credentials = self
            .access
            .chap
            .as_ref()
            .ok_or(status::AUTHENTICATION_FAILURE)?;
        let name = pairs.get("CHAP_N").ok_or(status::AUTHENTICATION_FAILURE)?;
        let sent = pairs
            .get("CHAP_R")
            .and_then(chap::decode_binary)
            .ok_or(status::AUTHENTICATION_FAILURE)?;
        let expected = chap::response(*identifier, credentials.secret.as_bytes(), challenge);
        let name_ok = chap::constant_time_eq(name.as_bytes(), credentials.user.as_bytes());
        if !(chap::constant_time_eq(&sent, &expected) && name_ok) {
            return Err(status::AUTHENTICATION_FAILURE);
        }
        // Mutual CHAP: the initiator challenges us in the same request.
        match (pairs.get("CHAP_I"), pairs.get("CHAP_C")) {
            (None, None) => {}
            (Some(id), Some(their_challenge)) => {
                let mutual = self
                    .access
                    .mutual_chap
                    .as_ref()
                    .ok_or(status::AUTHENTICATION_FAILURE)?;
                let id: u8 = id.parse().map_err(|_| status::AUTHENTICATION_FAILURE)?;
                let their_challenge =
                    chap::decode_binary(their_challenge).ok_or(status::AUTHENTICATION_FAILURE)?;
                // A reflected challenge would let the initiator use us as an oracle.
                if their_challenge.is_empty() || their_challenge == *challenge {
                    return Err(status::AUTHENTICATION_FAILURE);
                }
                let answer = chap::response(id, mutual.secret.as_bytes(), &their_challenge);
                reply.push("CHAP_N", mutual.user.clone());
                reply.push("CHAP_R", chap::encode_hex(&answer));
            }
            _ => return Err(status::AUTHENTICATION_FAILURE),
        }
        self.auth = Auth::Done;
        Ok(())
    }

    fn operational(&mut self, pairs: &TextPairs, reply: &mut TextPairs) -> Result<(), u16> {
        // Entering the operational stage requires authentication to be complete; an
        // initiator that skips the security stage gets in only where none is required.
        if self.auth != Auth::Done {
            if self.access.chap.is_some() || self.auth != Auth::Pending {
                return Err(status::AUTHENTICATION_FAILURE);
            }
            self.auth = Auth::Done;
        }
        for (key, value) in &pairs.0 {
            if is_security_key(key) {
                return Err(status::INITIATOR_ERROR);
            }
            if !is_declarative(key) {
                self.negotiate(key, value, reply);
            }
        }
        Ok(())
    }

    fn negotiate(&mut self, key: &str, value: &str, reply: &mut TextPairs) {
        if let Some(answer) = negotiate_key(&mut self.params, key, value) {
            reply.push(key, answer);
        }
        if key == "MaxRecvDataSegmentLength" && !self.declared_limits {
            // Ours is declarative too: say it once.
            self.declared_limits = true;
            reply.push(
                "MaxRecvDataSegmentLength",
                self.params.target_max_recv_data_segment.to_string(),
            );
        }
    }

    fn finish_step(&mut self, request: &LoginRequest, mut text: TextPairs) -> Step {
        let stage = self.stage;
        if request.transit && stage == STAGE_SECURITY && self.auth == Auth::Pending {
            // Leaving the security stage without choosing a method means "None".
            if self.access.chap.is_some() {
                return Step::Fail(LoginReply::failure(stage, status::AUTHENTICATION_FAILURE));
            }
            self.auth = Auth::Done;
        }
        let may_transit = request.transit && (stage != STAGE_SECURITY || self.auth == Auth::Done);
        if !may_transit {
            return Step::Continue(LoginReply {
                transit: false,
                current_stage: stage,
                next_stage: 0,
                status: status::SUCCESS,
                text,
            });
        }
        let next = request.next_stage;
        if next == STAGE_FULL_FEATURE {
            if !self.declared_limits {
                self.declared_limits = true;
                text.push(
                    "MaxRecvDataSegmentLength",
                    self.params.target_max_recv_data_segment.to_string(),
                );
            }
            self.params.settle();
            let (Some(initiator), Some(kind)) = (self.initiator.clone(), self.kind.clone()) else {
                return Step::Fail(LoginReply::failure(stage, status::MISSING_PARAMETER));
            };
            let reply = LoginReply {
                transit: true,
                current_stage: stage,
                next_stage: next,
                status: status::SUCCESS,
                text,
            };
            return Step::Done(
                reply,
                Box::new(LoggedIn {
                    initiator,
                    isid: self.isid,
                    kind,
                    params: self.params.clone(),
                }),
            );
        }
        self.stage = next;
        Step::Continue(LoginReply {
            transit: true,
            current_stage: stage,
            next_stage: next,
            status: status::SUCCESS,
            text,
        })
    }
}

fn is_security_key(key: &str) -> bool {
    key == "AuthMethod" || key.starts_with("CHAP_")
}

fn is_declarative(key: &str) -> bool {
    matches!(
        key,
        "InitiatorName" | "InitiatorAlias" | "SessionType" | "TargetName" | "TargetAlias"
    )
}

#[cfg(test)]
mod tests;
