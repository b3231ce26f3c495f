//! A hand-written, blocking iSCSI initiator for the end-to-end tests: login (with CHAP and
//! mutual CHAP), SCSI commands with immediate data and R2T, NOP-Out, raw PDUs. Built on the
//! target's own PDU codec; every socket has a deadline.

use ashlar_iscsi::chap;
use ashlar_iscsi::pdu::{self, op, Bhs, Digests, Pdu, BHS_LEN, NO_TAG};
use bytes::Bytes;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub const INITIATOR: &str = "iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-test";
pub const INITIATOR_2: &str = "iqn.2007-10.com.github:sahlberg:libiscsi:iscsi-test-2";

pub fn target_iqn(group: &str) -> String {
    format!("{}{group}", ashlar_iscsi::TARGET_IQN_PREFIX)
}

/// One TCP connection speaking iSCSI.
pub struct Raw {
    pub stream: TcpStream,
    /// Digests in use (after a login that negotiated them).
    pub digests: Digests,
}

impl Raw {
    pub fn connect(port: u16) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connecting to the portal");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
            .set_write_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw {
            stream,
            digests: Digests::default(),
        }
    }

    pub fn send(&mut self, pdu: &Pdu) -> std::io::Result<()> {
        self.stream.write_all(&pdu::encode(pdu, self.digests))
    }

    /// Reads one PDU (no digests); `Err` on EOF or timeout.
    pub fn recv(&mut self) -> std::io::Result<Pdu> {
        let mut header = [0u8; BHS_LEN];
        self.stream.read_exact(&mut header)?;
        let bhs = Bhs(header);
        let layout = pdu::frame_layout(&bhs, self.digests, 1 << 24)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let mut rest = vec![0u8; layout.rest_len()];
        self.stream.read_exact(&mut rest)?;
        pdu::decode_rest(bhs, layout, Bytes::from(rest))
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// True once the target has closed the connection (EOF within the read timeout).
    pub fn closed_by_target(&mut self) -> bool {
        let mut byte = [0u8; 1];
        loop {
            match self.stream.read(&mut byte) {
                Ok(0) => return true,
                Ok(_) => continue, // a reject or response first; keep draining
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

fn text(pairs: &[(&str, String)]) -> Bytes {
    let mut out = Vec::new();
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    Bytes::from(out)
}

pub fn parse_text(data: &[u8]) -> Vec<(String, String)> {
    String::from_utf8_lossy(data)
        .split('\0')
        .filter(|s| !s.is_empty())
        .filter_map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect()
}

fn get<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// What to log in to and how.
pub struct LoginSpec<'a> {
    pub initiator: &'a str,
    /// `None` for a discovery session.
    pub target: Option<&'a str>,
    pub chap: Option<(&'a str, &'a str)>,
    pub mutual: Option<(&'a str, &'a str)>,
    /// Ask for CRC32C header and data digests.
    pub digests: bool,
}

/// A logged-in session.
pub struct Session {
    pub raw: Raw,
    cmd_sn: u32,
    itt: u32,
    /// The StatSN of the last status the target sent (a SCSI Response or a Data-In with
    /// status), if any.
    pub last_stat_sn: Option<u32>,
}

/// Why a login failed: the status the target answered with, a redirection (status class 1)
/// with the `TargetAddress` to log in at instead, or a broken exchange.
#[derive(Debug)]
pub enum LoginError {
    Status(u16),
    Redirected { status: u16, address: String },
    Other(String),
}

fn login_pdu(isid: [u8; 6], csg: u8, nsg: Option<u8>, itt: u32, body: Bytes) -> Pdu {
    let mut bhs = Bhs::new(op::LOGIN);
    bhs.0[0] |= 0x40;
    let mut flags = csg << 2;
    if let Some(nsg) = nsg {
        flags |= 0x80 | nsg;
    }
    bhs.set_flags(flags);
    bhs.0[8..14].copy_from_slice(&isid);
    bhs.set_itt(itt);
    bhs.set_u32_at(24, 1); // CmdSN
    Pdu::new(bhs, body)
}

fn exchange(raw: &mut Raw, pdu: Pdu) -> Result<Vec<(String, String)>, LoginError> {
    raw.send(&pdu)
        .map_err(|e| LoginError::Other(e.to_string()))?;
    let reply = raw.recv().map_err(|e| LoginError::Other(e.to_string()))?;
    if reply.bhs.opcode() != op::LOGIN_RESPONSE {
        return Err(LoginError::Other(format!(
            "opcode {:#x} in answer to a login",
            reply.bhs.opcode()
        )));
    }
    let status = u16::from_be_bytes([reply.bhs.0[36], reply.bhs.0[37]]);
    let pairs = parse_text(&reply.data);
    match (status >> 8, get(&pairs, "TargetAddress")) {
        (0, _) => Ok(pairs),
        (1, Some(address)) => Err(LoginError::Redirected {
            status,
            address: address.to_string(),
        }),
        _ => Err(LoginError::Status(status)),
    }
}

/// Logs `initiator` in to `target` (discovery when `None`) without CHAP; panics on refusal.
pub fn open(port: u16, initiator: &str, target: Option<&str>) -> Session {
    let spec = LoginSpec {
        initiator,
        target,
        chap: None,
        mutual: None,
        digests: false,
    };
    login(port, &spec).unwrap_or_else(|e| panic!("login of {initiator} to {target:?}: {e:?}"))
}

pub fn login(port: u16, spec: &LoginSpec) -> Result<Session, LoginError> {
    login_isid(port, spec, 1)
}

/// Like [`open`], with the last ISID byte `isid`: a second I_T nexus of the same initiator.
pub fn open_isid(port: u16, initiator: &str, target: &str, isid: u8) -> Session {
    let spec = LoginSpec {
        initiator,
        target: Some(target),
        chap: None,
        mutual: None,
        digests: false,
    };
    login_isid(port, &spec, isid).unwrap_or_else(|e| panic!("login of {initiator}: {e:?}"))
}

fn login_isid(port: u16, spec: &LoginSpec, isid_low: u8) -> Result<Session, LoginError> {
    let mut raw = Raw::connect(port);
    let isid = [0x80, 0x12, 0x34, 0x56, 0x00, isid_low];
    let mut first = vec![("InitiatorName", spec.initiator.to_string())];
    match spec.target {
        Some(target) => first.push(("TargetName", target.to_string())),
        None => first.push(("SessionType", "Discovery".to_string())),
    }
    if let Some((user, secret)) = spec.chap {
        first.push(("AuthMethod", "CHAP,None".into()));
        let answer = exchange(&mut raw, login_pdu(isid, 0, None, 1, text(&first)))?;
        if get(&answer, "AuthMethod") != Some("CHAP") {
            return Err(LoginError::Other(format!("AuthMethod answer {answer:?}")));
        }
        let answer = exchange(
            &mut raw,
            login_pdu(isid, 0, None, 1, text(&[("CHAP_A", "5".into())])),
        )?;
        let id: u8 = get(&answer, "CHAP_I").unwrap().parse().unwrap();
        let challenge = chap::decode_binary(get(&answer, "CHAP_C").unwrap()).unwrap();
        let response = chap::response(id, secret.as_bytes(), &challenge);
        let mut keys = vec![
            ("CHAP_N", user.to_string()),
            ("CHAP_R", chap::encode_hex(&response)),
        ];
        let mine = [0x42u8; 16];
        if spec.mutual.is_some() {
            keys.push(("CHAP_I", "77".into()));
            keys.push(("CHAP_C", chap::encode_hex(&mine)));
        }
        let answer = exchange(&mut raw, login_pdu(isid, 0, Some(1), 1, text(&keys)))?;
        if let Some((user, secret)) = spec.mutual {
            let expected = chap::response(77, secret.as_bytes(), &mine);
            let sent = get(&answer, "CHAP_R").and_then(chap::decode_binary);
            if get(&answer, "CHAP_N") != Some(user) || sent.as_deref() != Some(&expected[..]) {
                return Err(LoginError::Other(format!(
                    "the target's mutual CHAP answer is wrong: {answer:?}"
                )));
            }
        }
    } else {
        first.push(("AuthMethod", "None".into()));
        exchange(&mut raw, login_pdu(isid, 0, Some(1), 1, text(&first)))?;
    }
    let digest = if spec.digests { "CRC32C" } else { "None" };
    let operational = [
        ("HeaderDigest", digest.to_string()),
        ("DataDigest", digest.to_string()),
        ("MaxRecvDataSegmentLength", "65536".to_string()),
        ("InitialR2T", "Yes".to_string()),
        ("ImmediateData", "Yes".to_string()),
        ("MaxBurstLength", "262144".to_string()),
        ("FirstBurstLength", "65536".to_string()),
        ("ErrorRecoveryLevel", "0".to_string()),
        ("MaxConnections", "1".to_string()),
    ];
    let answer = exchange(&mut raw, login_pdu(isid, 1, Some(3), 1, text(&operational)))?;
    if spec.digests {
        if get(&answer, "HeaderDigest") != Some("CRC32C")
            || get(&answer, "DataDigest") != Some("CRC32C")
        {
            return Err(LoginError::Other(format!("digests refused: {answer:?}")));
        }
        raw.digests = Digests {
            header: true,
            data: true,
        };
    }
    Ok(Session {
        raw,
        cmd_sn: 1,
        itt: 0x100,
        last_stat_sn: None,
    })
}

/// What a SCSI command returned.
#[derive(Debug)]
pub struct Reply {
    pub status: u8,
    pub data: Vec<u8>,
    /// Fixed-format sense data (without the 2-byte length).
    pub sense: Vec<u8>,
}

impl Session {
    /// The CmdSN of the next command (what the target's ExpCmdSN is once it read them all).
    pub fn next_cmd_sn(&self) -> u32 {
        self.cmd_sn
    }

    fn next_itt(&mut self) -> u32 {
        self.itt += 1;
        self.itt
    }

    /// Runs one SCSI command on `lun`: `data_out` is sent (immediate data, then R2T
    /// bursts), up to `read_len` bytes are read back.
    pub fn scsi(&mut self, lun: u16, cdb: &[u8], data_out: &[u8], read_len: u32) -> Reply {
        let itt = self.send_command(lun, cdb, data_out, read_len);
        let mut data = Vec::new();
        loop {
            let pdu = self.raw.recv().expect("reading the command's answer");
            match pdu.bhs.opcode() {
                op::DATA_IN => {
                    assert_eq!(pdu.bhs.itt(), itt);
                    data.extend_from_slice(&pdu.data);
                    if pdu.bhs.flags() & 0x01 != 0 {
                        self.last_stat_sn = Some(pdu.bhs.u32_at(24));
                        return Reply {
                            status: pdu.bhs.0[3],
                            data,
                            sense: Vec::new(),
                        };
                    }
                }
                op::R2T => {
                    let offset = pdu.bhs.u32_at(40) as usize;
                    let length = pdu.bhs.u32_at(44) as usize;
                    let ttt = pdu.bhs.u32_at(20);
                    let mut sent = 0;
                    let mut data_sn = 0;
                    while sent < length {
                        let n = (length - sent).min(65536);
                        let out = data_out_pdu(
                            lun,
                            itt,
                            ttt,
                            data_sn,
                            offset + sent,
                            sent + n == length,
                            &data_out[offset + sent..offset + sent + n],
                        );
                        self.raw.send(&out).unwrap();
                        sent += n;
                        data_sn += 1;
                    }
                }
                op::SCSI_RESPONSE => {
                    assert_eq!(pdu.bhs.itt(), itt);
                    self.last_stat_sn = Some(pdu.bhs.u32_at(24));
                    let sense = if pdu.data.len() > 2 {
                        pdu.data[2..].to_vec()
                    } else {
                        Vec::new()
                    };
                    return Reply {
                        status: pdu.bhs.0[3],
                        data,
                        sense,
                    };
                }
                op::NOP_IN if pdu.bhs.itt() == NO_TAG => self.answer_ping(&pdu),
                other => panic!("unexpected opcode {other:#x} during a SCSI command"),
            }
        }
    }

    /// Sends a SCSI command PDU with up to 64 KiB of `data_out` as immediate data; returns
    /// its ITT.
    fn send_command(&mut self, lun: u16, cdb: &[u8], data_out: &[u8], read_len: u32) -> u32 {
        let itt = self.next_itt();
        let mut bhs = Bhs::new(op::SCSI_COMMAND);
        let immediate = data_out.len().min(65536);
        let mut flags = 0x80u8 | 0x01; // F, simple task
        if read_len > 0 {
            flags |= 0x40;
        }
        if !data_out.is_empty() {
            flags |= 0x20;
        }
        bhs.set_flags(flags);
        bhs.set_lun_field(ashlar_iscsi::lun::Lun(lun).encode());
        bhs.set_itt(itt);
        bhs.set_u32_at(
            20,
            if data_out.is_empty() {
                read_len
            } else {
                data_out.len() as u32
            },
        );
        bhs.set_u32_at(24, self.cmd_sn);
        self.cmd_sn += 1;
        bhs.0[32..32 + cdb.len()].copy_from_slice(cdb);
        self.raw
            .send(&Pdu::new(
                bhs,
                Bytes::copy_from_slice(&data_out[..immediate]),
            ))
            .unwrap();
        itt
    }

    /// WRITE(16) of `data` (more than the 64 KiB sent as immediate data) whose first
    /// solicited Data-Out carries a wrong data digest (negotiated digests only): the target
    /// must drop the connection.
    pub fn write16_with_bad_data_out_digest(&mut self, lun: u16, lba: u64, data: &[u8]) {
        assert!(data.len() > 65536 && self.raw.digests.data);
        let itt = self.send_command(lun, &write16_cdb(lba, data), data, 0);
        let r2t = self.raw.recv().expect("an R2T");
        assert_eq!(r2t.bhs.opcode(), op::R2T);
        let offset = r2t.bhs.u32_at(40) as usize;
        let length = (r2t.bhs.u32_at(44) as usize).min(65536);
        let out = data_out_pdu(
            lun,
            itt,
            r2t.bhs.u32_at(20),
            0,
            offset,
            true,
            &data[offset..offset + length],
        );
        let mut wire = pdu::encode(&out, self.raw.digests).to_vec();
        let last = wire.len() - 1;
        wire[last] ^= 0xff;
        self.raw.stream.write_all(&wire).unwrap();
    }

    /// Sends an immediate PDU of `opcode` (F set, TTT reserved) and reads the answer, which
    /// must be `answer` for the same task.
    fn immediate(&mut self, opcode: u8, data: Bytes, answer: u8) -> Pdu {
        let itt = self.next_itt();
        let mut bhs = Bhs::new(opcode);
        bhs.0[0] |= 0x40;
        bhs.set_flags(0x80);
        bhs.set_itt(itt);
        bhs.set_u32_at(20, NO_TAG);
        bhs.set_u32_at(24, self.cmd_sn);
        self.raw.send(&Pdu::new(bhs, data)).unwrap();
        loop {
            let pdu = self.raw.recv().expect("an answer");
            if pdu.bhs.opcode() == op::NOP_IN && pdu.bhs.itt() == NO_TAG {
                self.answer_ping(&pdu);
                continue;
            }
            assert_eq!(pdu.bhs.opcode(), answer);
            assert_eq!(pdu.bhs.itt(), itt);
            return pdu;
        }
    }

    /// Answers the target's NOP-In ping with a NOP-Out echoing its TTT (RFC 7143 11.18).
    pub fn answer_ping(&mut self, ping: &Pdu) {
        assert_eq!(ping.bhs.opcode(), op::NOP_IN);
        let ttt = ping.bhs.u32_at(20);
        assert_ne!(ttt, NO_TAG, "a ping asks for an answer");
        let mut bhs = Bhs::new(op::NOP_OUT);
        bhs.0[0] |= 0x40;
        bhs.set_flags(0x80);
        bhs.set_lun_field(ping.bhs.lun_field());
        bhs.set_itt(NO_TAG);
        bhs.set_u32_at(20, ttt);
        bhs.set_u32_at(24, self.cmd_sn);
        self.raw.send(&Pdu::new(bhs, Bytes::new())).unwrap();
    }

    /// Waits for the target's next NOP-In ping (nothing else may arrive meanwhile).
    pub fn next_ping(&mut self) -> Pdu {
        let pdu = self.raw.recv().expect("a NOP-In ping");
        assert_eq!(pdu.bhs.opcode(), op::NOP_IN, "a ping, not {pdu:?}");
        assert_eq!(pdu.bhs.itt(), NO_TAG);
        pdu
    }

    /// A task management request for `lun`; returns the response code.
    pub fn task_management(&mut self, function: u8, lun: u16) -> u8 {
        let itt = self.next_itt();
        let mut bhs = Bhs::new(op::TASK_MANAGEMENT);
        bhs.0[0] |= 0x40;
        bhs.set_flags(0x80 | function);
        bhs.set_lun_field(ashlar_iscsi::lun::Lun(lun).encode());
        bhs.set_itt(itt);
        bhs.set_u32_at(20, NO_TAG);
        bhs.set_u32_at(24, self.cmd_sn);
        self.raw.send(&Pdu::new(bhs, Bytes::new())).unwrap();
        loop {
            let pdu = self.raw.recv().expect("a task management response");
            if pdu.bhs.opcode() == op::NOP_IN && pdu.bhs.itt() == NO_TAG {
                self.answer_ping(&pdu);
                continue;
            }
            assert_eq!(pdu.bhs.opcode(), op::TASK_MANAGEMENT_RESPONSE);
            assert_eq!(pdu.bhs.itt(), itt);
            return pdu.bhs.0[2];
        }
    }

    pub fn test_unit_ready(&mut self, lun: u16) -> Reply {
        self.scsi(lun, &[0; 6], &[], 0)
    }

    /// REQUEST SENSE in fixed format.
    pub fn request_sense(&mut self, lun: u16) -> Reply {
        self.scsi(lun, &[0x03, 0, 0, 0, 252, 0], &[], 252)
    }

    /// PERSISTENT RESERVE OUT `action` of reservation `kind` with the reservation key `key`
    /// and service action key `sa_key`; `aptpl` asks for persistence through power loss.
    pub fn pr_out(
        &mut self,
        lun: u16,
        action: u8,
        kind: u8,
        key: u64,
        sa_key: u64,
        aptpl: bool,
    ) -> Reply {
        let mut params = vec![0u8; 24];
        params[0..8].copy_from_slice(&key.to_be_bytes());
        params[8..16].copy_from_slice(&sa_key.to_be_bytes());
        params[20] = u8::from(aptpl);
        let cdb = [0x5f, action, kind, 0, 0, 0, 0, 0, 24, 0];
        self.scsi(lun, &cdb, &params, 0)
    }

    /// PERSISTENT RESERVE IN `action` (0 READ KEYS, 1 READ RESERVATION, 2 REPORT
    /// CAPABILITIES).
    pub fn pr_in(&mut self, lun: u16, action: u8) -> Reply {
        self.scsi(lun, &[0x5e, action, 0, 0, 0, 0, 0, 0x10, 0, 0], &[], 4096)
    }

    /// COMPARE AND WRITE of `compare.len()` bytes at `lba` (the blocks must hold `compare`
    /// to become `write`).
    pub fn compare_and_write(&mut self, lun: u16, lba: u64, compare: &[u8], write: &[u8]) -> Reply {
        assert_eq!(compare.len(), write.len());
        let mut cdb = vec![0x89, 0];
        cdb.extend_from_slice(&lba.to_be_bytes());
        cdb.extend_from_slice(&[0, 0, 0, (compare.len() / 512) as u8, 0, 0]);
        let mut data = compare.to_vec();
        data.extend_from_slice(write);
        self.scsi(lun, &cdb, &data, 0)
    }

    /// NOP-Out ping; returns the echoed data.
    pub fn ping(&mut self, data: &[u8]) -> Vec<u8> {
        let pdu = self.immediate(op::NOP_OUT, Bytes::copy_from_slice(data), op::NOP_IN);
        pdu.data.to_vec()
    }

    /// SendTargets=All in this (discovery) session: the keys answered.
    pub fn send_targets(&mut self) -> Vec<(String, String)> {
        let body = text(&[("SendTargets", "All".into())]);
        parse_text(&self.immediate(op::TEXT, body, op::TEXT_RESPONSE).data)
    }

    /// READ(16) of `blocks` 512-byte blocks.
    pub fn read16(&mut self, lun: u16, lba: u64, blocks: u32) -> Reply {
        let mut cdb = vec![0x88, 0];
        cdb.extend_from_slice(&lba.to_be_bytes());
        cdb.extend_from_slice(&blocks.to_be_bytes());
        cdb.extend_from_slice(&[0, 0]);
        self.scsi(lun, &cdb, &[], blocks * 512)
    }

    /// WRITE(16) of `data` (a multiple of 512 bytes).
    pub fn write16(&mut self, lun: u16, lba: u64, data: &[u8]) -> Reply {
        self.scsi(lun, &write16_cdb(lba, data), data, 0)
    }
}

/// The CDB of a WRITE(16) of `data` (a multiple of 512 bytes) at `lba`.
fn write16_cdb(lba: u64, data: &[u8]) -> Vec<u8> {
    let mut cdb = vec![0x88 | 0x02, 0];
    cdb.extend_from_slice(&lba.to_be_bytes());
    cdb.extend_from_slice(&((data.len() / 512) as u32).to_be_bytes());
    cdb.extend_from_slice(&[0, 0]);
    cdb
}

/// A Data-Out of `data` at buffer `offset` for task `itt` (DataSN `data_sn`, under the
/// R2T's `ttt`), `last` in its burst.
fn data_out_pdu(
    lun: u16,
    itt: u32,
    ttt: u32,
    data_sn: u32,
    offset: usize,
    last: bool,
    data: &[u8],
) -> Pdu {
    let mut out = Bhs::new(op::DATA_OUT);
    out.set_flags(if last { 0x80 } else { 0 });
    out.set_lun_field(ashlar_iscsi::lun::Lun(lun).encode());
    out.set_itt(itt);
    out.set_u32_at(20, ttt);
    out.set_u32_at(36, data_sn);
    out.set_u32_at(40, offset as u32);
    Pdu::new(out, Bytes::copy_from_slice(data))
}
