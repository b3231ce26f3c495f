//! PREEMPT AND ABORT between two sessions of one logical unit, over real connections: the
//! preempted session's command held in flight by a slow device is never answered, the
//! preemption is answered only after that command's device I/O ended, and the preempted
//! nexus then sees REGISTRATIONS PREEMPTED. A plain PREEMPT, for contrast, lets the command
//! be answered.
use crate::pdu::{self, op, Bhs, Digests, Pdu};
use crate::reading::read_pdu;
use crate::scsi::sense::{status, Sense};
use crate::testing::{against_server_sessions, login_request_isid, ServerEnd, TestRegistry};
use crate::IscsiLimits;
use bytes::Bytes;
use std::time::Duration;
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

const PREEMPT: u8 = 4;
const PREEMPT_AND_ABORT: u8 = 5;
const EXCLUSIVE_ACCESS: u8 = 3;
/// How long the slow device holds the preempted session's read.
const HELD: Duration = Duration::from_millis(400);

/// A logged-in session seen from the initiator.
struct Initiator {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    cmd_sn: u32,
}

/// What a response PDU said, for assertions.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Answer {
    opcode: u8,
    itt: u32,
    status: u8,
    sense: Option<Sense>,
}

impl Initiator {
    async fn login(stream: TcpStream, isid: u8) -> Initiator {
        let (read_half, mut writer) = stream.into_split();
        writer.write_all(&login_request_isid(isid)).await.unwrap();
        let mut reader = BufReader::new(read_half);
        let reply = read_pdu(&mut reader, Digests::default(), 1 << 16)
            .await
            .unwrap()
            .expect("a login response");
        assert_eq!(reply.bhs.opcode(), op::LOGIN_RESPONSE);
        assert_eq!(reply.bhs.u16_at(36), 0, "login succeeds");
        Initiator {
            reader,
            writer,
            cmd_sn: 0,
        }
    }

    /// Sends a SCSI command to LUN 0 with `data` as immediate data.
    async fn send(&mut self, itt: u32, cdb: &[u8], data: &[u8], expected: u32, read: bool) {
        let mut bhs = Bhs::new(op::SCSI_COMMAND);
        let direction = if read {
            0x40
        } else if data.is_empty() {
            0
        } else {
            0x20
        };
        bhs.set_flags(0x80 | direction | 0x01);
        bhs.set_itt(itt);
        bhs.set_u32_at(20, expected);
        bhs.set_u32_at(24, self.cmd_sn);
        bhs.0[32..32 + cdb.len()].copy_from_slice(cdb);
        self.cmd_sn += 1;
        let pdu = Pdu::new(bhs, Bytes::copy_from_slice(data));
        self.writer
            .write_all(&pdu::encode(&pdu, Digests::default()))
            .await
            .unwrap();
    }

    /// The next response or Data-In with status, if one comes `within`.
    async fn answer(&mut self, within: Duration) -> Option<Answer> {
        let next = read_pdu(&mut self.reader, Digests::default(), 1 << 20);
        let pdu = tokio::time::timeout(within, next).await.ok()?.unwrap()?;
        let sense = (pdu.bhs.opcode() == op::SCSI_RESPONSE && pdu.data.len() >= 16).then(|| {
            let fixed = &pdu.data[2..];
            Sense::new(fixed[2] & 0x0f, fixed[12], fixed[13])
        });
        Some(Answer {
            opcode: pdu.bhs.opcode(),
            itt: pdu.bhs.itt(),
            status: pdu.bhs.0[3],
            sense,
        })
    }

    /// Runs a PERSISTENT RESERVE OUT and returns its status.
    async fn reserve_out(&mut self, itt: u32, action: u8, kind: u8, key: u64, sa: u64) -> u8 {
        let cdb = [0x5f, action, kind, 0, 0, 0, 0, 0, 24, 0];
        let mut params = [0u8; 24];
        params[0..8].copy_from_slice(&key.to_be_bytes());
        params[8..16].copy_from_slice(&sa.to_be_bytes());
        self.send(itt, &cdb, &params, 24, false).await;
        let answer = self
            .answer(Duration::from_secs(10))
            .await
            .expect("answered");
        assert_eq!((answer.opcode, answer.itt), (op::SCSI_RESPONSE, itt));
        answer.status
    }
}

/// READ(10) of one 4 KiB block at `lba`.
fn read10(lba: u32) -> [u8; 10] {
    let lba = lba.to_be_bytes();
    [0x28, 0, lba[0], lba[1], lba[2], lba[3], 0, 0, 8, 0]
}

/// What the preempted session saw.
struct Seen {
    /// Reads the device had finished when the preemption was answered.
    reads_done_at_answer: u32,
    /// Every PDU the preempted session got after the preemption, in order.
    after: Vec<Answer>,
}

/// B holds an EXCLUSIVE ACCESS reservation and has a READ in the slow device when A
/// preempts it with `action`; B then sends TEST UNIT READY and, once answered, a READ.
fn preempt_while_b_reads(action: u8) -> Seen {
    let registry = TestRegistry::open();
    let device = registry.device.clone();
    let (seen, end) =
        against_server_sessions(registry, IscsiLimits::default(), 2, |streams| async move {
            let mut streams = streams.into_iter();
            let mut a = Initiator::login(streams.next().unwrap(), 1).await;
            let mut b = Initiator::login(streams.next().unwrap(), 2).await;
            assert_eq!(a.reserve_out(1, 0, 0, 0, 0xa).await, status::GOOD);
            assert_eq!(b.reserve_out(1, 0, 0, 0, 0xb).await, status::GOOD);
            assert_eq!(
                b.reserve_out(2, 1, EXCLUSIVE_ACCESS, 0xb, 0).await,
                status::GOOD
            );
            device.read_delay.set(HELD);
            b.send(3, &read10(0), &[], 4096, true).await;
            // Let the read reach the device.
            tokio::time::sleep(HELD / 4).await;
            let preempted = a.reserve_out(2, action, EXCLUSIVE_ACCESS, 0xa, 0xb).await;
            assert_eq!(preempted, status::GOOD);
            let reads_done_at_answer = device.reads_done.get();
            device.read_delay.set(Duration::ZERO);
            // Whatever B was owed for its read arrives well before this.
            let mut after = Vec::new();
            while let Some(answer) = b.answer(HELD).await {
                after.push(answer);
            }
            b.send(4, &[0; 6], &[], 0, false).await;
            after.extend(b.answer(Duration::from_secs(5)).await);
            b.send(5, &read10(0), &[], 4096, true).await;
            after.extend(b.answer(Duration::from_secs(5)).await);
            Seen {
                reads_done_at_answer,
                after,
            }
        });
    assert_eq!(end, ServerEnd::Finished);
    seen
}

fn response(itt: u32, status: u8, sense: Option<Sense>) -> Answer {
    Answer {
        opcode: op::SCSI_RESPONSE,
        itt,
        status,
        sense,
    }
}

#[test]
fn preempt_and_abort_never_answers_the_preempted_command() {
    let seen = preempt_while_b_reads(PREEMPT_AND_ABORT);
    assert_eq!(
        seen.reads_done_at_answer, 1,
        "the preemption is answered only once the preempted read left the device"
    );
    assert_eq!(
        seen.after,
        vec![
            // The held READ (ITT 3) is never answered; TEST UNIT READY reports the
            // preemption, and A's reservation then excludes B.
            response(
                4,
                status::CHECK_CONDITION,
                Some(Sense::REGISTRATIONS_PREEMPTED)
            ),
            response(5, status::RESERVATION_CONFLICT, None),
        ]
    );
}

#[test]
fn plain_preempt_lets_the_running_command_finish() {
    let seen = preempt_while_b_reads(PREEMPT);
    let read_answer = Answer {
        opcode: op::DATA_IN,
        itt: 3,
        status: status::GOOD,
        sense: None,
    };
    assert_eq!(
        seen.after,
        vec![
            read_answer,
            response(
                4,
                status::CHECK_CONDITION,
                Some(Sense::REGISTRATIONS_PREEMPTED)
            ),
            response(5, status::RESERVATION_CONFLICT, None),
        ]
    );
}
