//! One connection: login, then the full feature phase.
//!
//! The reader (this task) reads PDUs in order, keeps the CmdSN window, collects write data
//! (immediate, unsolicited Data-Out, then R2T-solicited bursts) and starts one local task per
//! SCSI command, except a READ whose data is at hand (`BlockDevice::read_now`: cached on this
//! reactor), which it answers itself. Every PDU to the initiator goes through the writer
//! task, which stamps StatSN, ExpCmdSN and MaxCmdSN in send order, so sequence numbers never
//! go backwards.
//!
//! Memory: a command's unsolicited data (at most FirstBurstLength) is held without budget;
//! the window bounds how many such commands a session has. Solicited write data and read
//! data are reserved from the node-wide [`DataBudget`](crate::DataBudget) before the R2T is
//! sent or the read executed.

use crate::abort::{self, AbortOrder, AbortRoute};
use crate::error::{IscsiError, Violation, ViolationLog};
use crate::keepalive::{Decision, Keepalive, NopSettings};
use crate::limits::{Effective, IscsiLimits};
use crate::login::{self, Login, LoginReply, LoginRequest, SessionKind, Step};
use crate::lun::Lun;
use crate::params::SessionParams;
use crate::pdu::{self, op, reject, Bhs, Digests, Pdu, NO_TAG};
use crate::reading::{self, read_pdu};
use crate::registry::{LogicalUnit, TargetRegistry};
use crate::scsi::reservation::LunReservations;
use crate::scsi::sense::{status, Sense};
use crate::scsi::{self, Context, Nexus, ScsiResult};
use crate::text::TextPairs;
use crate::transfer::{Receiving, TransferBuffer};
use ashlar_core::buffers::receive::PayloadSource;
use bytes::{Bytes, BytesMut};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch, Notify, OwnedSemaphorePermit};
use tokio::task::{AbortHandle, JoinHandle};

/// Socket read buffer: headers and small PDUs come through it. Data-Out data bypasses it once
/// it holds none (`receive_payload`), so what it already read of a data segment is the part
/// copied on the way to the transfer's buffer: a small buffer keeps that part small. In one
/// set of three alternating rounds of 1 MiB writes (256 KiB segments), the node used 17 %
/// less CPU with 32 KiB than with 256 KiB; 4 KiB writes at QD32 stayed within the spread
/// (bench/results/20261129-084500-vm).
const READ_BUFFER_BYTES: usize = 32 * 1024;
/// Socket write buffer; the writer writes it out whenever its queue runs empty.
const WRITE_BUFFER_BYTES: usize = 256 * 1024;
/// Data-In bytes written before the writer lets the connection's reader run: writing a deep
/// queue of large reads that finished together before looking at the socket again left the
/// disk idle while they went out (the initiator's next commands were already waiting).
const YIELD_AFTER_BYTES: usize = 256 * 1024;
/// PDUs queued for the writer; producers wait when it is full.
const REPLY_QUEUE_PDUS: usize = 256;
/// Immediate SCSI commands (outside the CmdSN window) a session may have in flight; more
/// are rejected (reason "immediate command reject").
const MAX_IMMEDIATE_COMMANDS: usize = 16;
/// On shutdown or logout, how long running commands may take before the connection closes.
const DRAIN_GRACE: Duration = Duration::from_secs(30);
/// How long the Asynchronous Message announcing a dropped connection may wait for room in
/// the writer's queue; an initiator that reads nothing gets the close only.
const ASYNC_MESSAGE_WAIT: Duration = Duration::from_secs(5);
/// TSIH given to sessions (one connection each, so one value per node is enough for the
/// initiator to tell its sessions apart: they differ by ISID).
const TSIH: u16 = 1;

/// Serves one connection until the initiator logs out or disconnects, breaks the protocol,
/// or `shutdown` becomes true (then running commands finish first).
pub async fn serve_connection<R: TargetRegistry>(
    stream: TcpStream,
    registry: Rc<R>,
    limits: IscsiLimits,
    shutdown: watch::Receiver<bool>,
) -> Result<(), IscsiError> {
    serve_or_hand_over(stream, registry, limits, shutdown, |_| true)
        .await
        .map(|_| ())
}

/// A connection whose login finished, handed over to be served on another thread: the one
/// its target's I/O runs on, so no command crosses threads (see [`serve_or_hand_over`]).
pub struct Handover {
    stream: std::net::TcpStream,
    /// What the initiator sent after its last login PDU, already read from the socket.
    buffered: Vec<u8>,
    started: Started,
}

/// Like [`serve_connection`], but once a normal session's login is done, `stay` is asked
/// about the target's first logical unit; if it says no, nothing more is read or written and
/// the connection is returned, to be served with [`resume`] where the caller wants.
pub async fn serve_or_hand_over<R: TargetRegistry>(
    stream: TcpStream,
    registry: Rc<R>,
    limits: IscsiLimits,
    shutdown: watch::Receiver<bool>,
    mut stay: impl FnMut(&R::Device) -> bool,
) -> Result<Option<Handover>, IscsiError> {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown peer".into());
    let local = stream.local_addr().ok();
    stream.set_nodelay(true)?;
    let limits = Effective::from(&limits);
    let mut log = ViolationLog::new(peer);
    let (read_half, mut write_half) = stream.into_split();
    let mut reader = BufReader::with_capacity(READ_BUFFER_BYTES, read_half);
    let mut sequence = Sequence::default();
    // The I_T nexus exists for the logical units (unit attentions, reservations) before the
    // initiator learns it is logged in: a reset another initiator sends at once must reach it.
    let mut joined: Option<Joined> = None;
    let mut moves = false;
    let login = tokio::time::timeout(
        limits.login_timeout,
        login_phase(
            &mut reader,
            &mut write_half,
            registry.as_ref(),
            &limits,
            &mut sequence,
            &mut log,
            |logged_in| {
                let SessionKind::Normal { target } = &logged_in.kind else {
                    return;
                };
                if let Ok(luns) = registry.open_luns(target) {
                    moves = luns.first().is_some_and(|unit| !stay(&unit.device));
                    joined = Some(Joined::new(logged_in, &luns));
                }
            },
        ),
    )
    .await;
    let (logged_in, cid) = match login {
        Ok(Ok(Some(logged_in))) => logged_in,
        Ok(Ok(None)) => return Ok(None),
        Ok(Err(error)) => return Err(error),
        Err(_) => {
            log.report(Violation::LoginOrder, &"login did not finish in time");
            return Err(IscsiError::LoginTimeout(limits.login_timeout));
        }
    };
    let started = Started {
        logged_in,
        sequence,
        cid,
        log,
        limits,
        local,
        joined,
    };
    if moves {
        let buffered = reader.buffer().to_vec();
        let stream = reader
            .into_inner()
            .reunite(write_half)
            .map_err(|e| IscsiError::Io(std::io::Error::other(e.to_string())))?
            .into_std()?;
        return Ok(Some(Handover {
            stream,
            buffered,
            started,
        }));
    }
    serve_session(reader, write_half, started, registry, shutdown)
        .await
        .map(|()| None)
}

/// Serves a connection [`serve_or_hand_over`] handed over, on the calling thread.
pub async fn resume<R: TargetRegistry>(
    handover: Handover,
    registry: Rc<R>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), IscsiError> {
    let stream = TcpStream::from_std(handover.stream)?;
    let (read_half, write_half) = stream.into_split();
    let reader = BufReader::with_capacity(
        READ_BUFFER_BYTES,
        std::io::Cursor::new(handover.buffered).chain(read_half),
    );
    serve_session(reader, write_half, handover.started, registry, shutdown).await
}

/// What a session starts its full feature phase with.
struct Started {
    logged_in: login::LoggedIn,
    sequence: Sequence,
    /// The connection's CID, from its login.
    cid: u16,
    log: ViolationLog,
    limits: Effective,
    local: Option<std::net::SocketAddr>,
    joined: Option<Joined>,
}

/// The session's I_T nexus as its logical units know it, from just before the initiator is
/// told it is logged in until the session ends (dropping it tells the units the nexus left).
struct Joined {
    initiator_port: String,
    units: Vec<Arc<LunReservations>>,
    /// Names this session in the units' abort routes.
    id: u64,
    /// Where the units send PREEMPT AND ABORT orders; taken by the session's abort task.
    orders: Option<mpsc::UnboundedReceiver<AbortOrder>>,
}

impl Joined {
    fn new<D>(logged_in: &login::LoggedIn, luns: &[LogicalUnit<D>]) -> Joined {
        let initiator_port = Nexus::new(&logged_in.initiator, logged_in.isid).initiator_port;
        let units: Vec<_> = luns.iter().map(|unit| unit.shared.clone()).collect();
        let id = abort::next_session_id();
        let (sender, orders) = mpsc::unbounded_channel();
        for (index, unit) in units.iter().enumerate() {
            let route = AbortRoute {
                session: id,
                lun: Lun(index as u16),
                orders: sender.clone(),
            };
            unit.nexus_joined(&initiator_port, route);
        }
        Joined {
            initiator_port,
            units,
            id,
            orders: Some(orders),
        }
    }
}

impl Drop for Joined {
    fn drop(&mut self) {
        for unit in &self.units {
            unit.nexus_lost(&self.initiator_port, self.id);
        }
    }
}

async fn serve_session<R: TargetRegistry, Rd: PayloadSource>(
    mut reader: Rd,
    write_half: tokio::net::tcp::OwnedWriteHalf,
    started: Started,
    registry: Rc<R>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), IscsiError> {
    let Started {
        logged_in,
        sequence,
        cid,
        mut log,
        limits,
        local,
        mut joined,
    } = started;
    // A normal session replaces a live one of the same initiator, ISID and target.
    let registration = match &logged_in.kind {
        SessionKind::Normal { target } => Some(limits.sessions.register(
            &logged_in.initiator,
            logged_in.isid,
            target,
        )),
        SessionKind::Discovery => None,
    };
    let luns = match &logged_in.kind {
        SessionKind::Normal { target } => match registry.open_luns(target) {
            Ok(luns) => luns,
            Err(reason) => {
                tracing::warn!(peer = log.peer(), %target, %reason, "target vanished after login");
                return Ok(());
            }
        },
        SessionKind::Discovery => Vec::new(),
    };
    tracing::info!(peer = log.peer(), initiator = %logged_in.initiator, kind = ?logged_in.kind,
        luns = luns.len(), header_digest = logged_in.params.header_digest,
        data_digest = logged_in.params.data_digest, "iSCSI session started");
    let digests = Digests {
        header: logged_in.params.header_digest,
        data: logged_in.params.data_digest,
    };
    let (replies, queue) = mpsc::channel(REPLY_QUEUE_PDUS);
    let sequence = Rc::new(sequence);
    let writer = tokio::task::spawn_local(write_pdus(queue, write_half, sequence.clone(), digests));
    let target_name = match &logged_in.kind {
        SessionKind::Normal { target } => target.clone(),
        SessionKind::Discovery => String::new(),
    };
    let nexus = Nexus::new(&logged_in.initiator, logged_in.isid);
    let session = Rc::new(Session {
        nexus,
        initiator: logged_in.initiator.clone(),
        discovery: logged_in.kind == SessionKind::Discovery,
        target_name,
        luns,
        params: logged_in.params,
        limits,
        sequence,
        tasks: RefCell::new(HashMap::new()),
        idle: Notify::new(),
        replies,
        next_ttt: Cell::new(1),
        portal: local.map(|a| a.to_string()).unwrap_or_default(),
        received: Cell::new(0),
        cid,
    });
    let dead = Rc::new(Notify::new());
    let pinger = session
        .limits
        .nop
        .map(|nop| tokio::task::spawn_local(ping_while_quiet(session.clone(), nop, dead.clone())));
    let aborter = joined
        .as_mut()
        .and_then(|joined| joined.orders.take())
        .map(|orders| tokio::task::spawn_local(abort_on_orders(session.clone(), orders)));
    let mut feature = FullFeature {
        session: session.clone(),
        registry,
        digests,
        held: BTreeMap::new(),
        text_pending: None,
        target_moved: false,
    };
    let ending = registration.as_ref().map(|r| r.ending.clone());
    let ended = feature
        .run(&mut reader, shutdown, ending, dead, &mut log)
        .await;
    if let Some(pinger) = pinger {
        pinger.abort();
    }
    if let Some(aborter) = aborter {
        aborter.abort();
    }
    // Commands still waiting for data never complete; running ones get a grace period.
    session.abort_where(
        |_| true,
        |task| !matches!(task.state, TaskState::Running(_)),
    );
    let drained = tokio::time::timeout(DRAIN_GRACE, session.wait_idle()).await;
    if feature.target_moved && drained.is_ok() {
        session.announce_drop().await;
    }
    drop(joined);
    drop(feature);
    drop(session);
    drop(registration);
    match ended {
        Err(error) => {
            writer.abort();
            Err(error)
        }
        Ok(()) => {
            if drained.is_err() {
                writer.abort();
                return Ok(());
            }
            match tokio::time::timeout(DRAIN_GRACE, writer).await {
                Ok(Ok(Ok(()))) | Err(_) => Ok(()),
                Ok(Ok(Err(error))) if peer_gone(&error) => Ok(()),
                Ok(Ok(Err(error))) => Err(IscsiError::Io(error)),
                Ok(Err(join)) => Err(IscsiError::Io(std::io::Error::other(join))),
            }
        }
    }
}

fn peer_gone(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        error.kind(),
        BrokenPipe | ConnectionReset | ConnectionAborted | NotConnected
    )
}

/// Sequence numbers of the connection: StatSN (stamped by the writer) and the CmdSN window
/// (ExpCmdSN advanced by the reader, MaxCmdSN derived from the commands in flight).
#[derive(Debug, Default)]
struct Sequence {
    stat_sn: Cell<u32>,
    exp_cmd_sn: Cell<u32>,
    /// Non-immediate commands accepted and not yet answered.
    active: Cell<u32>,
    window: Cell<u32>,
}

impl Sequence {
    fn max_cmd_sn(&self) -> u32 {
        let free = self.window.get().saturating_sub(self.active.get());
        self.exp_cmd_sn.get().wrapping_add(free).wrapping_sub(1)
    }

    /// Stamps StatSN/ExpCmdSN/MaxCmdSN into a target PDU.
    fn stamp(&self, bhs: &mut Bhs, stat: StatSn) {
        match stat {
            StatSn::Advance => {
                bhs.set_u32_at(24, self.stat_sn.get());
                self.stat_sn.set(self.stat_sn.get().wrapping_add(1));
            }
            StatSn::Carry => bhs.set_u32_at(24, self.stat_sn.get()),
            StatSn::Omit => {}
        }
        bhs.set_u32_at(28, self.exp_cmd_sn.get());
        bhs.set_u32_at(32, self.max_cmd_sn());
    }
}

/// How a PDU uses StatSN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StatSn {
    /// Carries the next StatSN and consumes it (responses).
    Advance,
    /// Carries the next StatSN without consuming it (R2T, unsolicited NOP-In).
    Carry,
    /// No StatSN (Data-In without status).
    Omit,
}

struct Outgoing {
    pdu: Pdu,
    stat: StatSn,
    /// Close the connection after this PDU (logout response, fatal reject).
    last: bool,
}

/// Writes the queued PDUs in order, stamping each as it is taken. The PDUs ready together
/// are framed into one buffer (their data copied once) and go out in one write; a large
/// data segment is written from where it is, not copied.
async fn write_pdus<W: AsyncWrite + Unpin>(
    mut queue: mpsc::Receiver<Outgoing>,
    mut socket: W,
    sequence: Rc<Sequence>,
    digests: Digests,
) -> std::io::Result<()> {
    let mut out = BytesMut::with_capacity(WRITE_BUFFER_BYTES);
    while let Some(mut outgoing) = queue.recv().await {
        let mut since_yield = 0;
        loop {
            sequence.stamp(&mut outgoing.pdu.bhs, outgoing.stat);
            frame(&outgoing.pdu, digests, &mut out, &mut socket).await?;
            if outgoing.last {
                socket.write_all(&out).await?;
                socket.shutdown().await?;
                return Ok(());
            }
            since_yield += outgoing.pdu.data.len();
            match queue.try_recv() {
                Ok(next) => outgoing = next,
                Err(_) => break,
            }
            // More is queued: after a large burst, let the reader start waiting commands.
            if since_yield >= YIELD_AFTER_BYTES {
                socket.write_all(&out).await?;
                out.clear();
                // Deferred until the runtime has polled for I/O: a reader with commands
                // waiting on the socket runs first and starts them.
                tokio::task::yield_now().await;
                since_yield = 0;
            }
        }
        socket.write_all(&out).await?;
        out.clear();
    }
    Ok(())
}

/// Adds `pdu` to the write buffer `out`, writing the buffer out first when it is full. A
/// data segment of more than a quarter of the buffer is written to the socket directly
/// (after what is buffered and its header), so the buffer never grows past its capacity
/// plus one PDU's framing and large reads are not copied.
async fn frame<W: AsyncWrite + Unpin>(
    pdu: &Pdu,
    digests: Digests,
    out: &mut BytesMut,
    socket: &mut W,
) -> std::io::Result<()> {
    if pdu.data.len() > WRITE_BUFFER_BYTES / 4 {
        pdu::encode_head_into(pdu, digests, out);
        socket.write_all(out).await?;
        out.clear();
        socket.write_all(&pdu.data).await?;
        out.extend_from_slice(pdu::encode_tail(pdu, digests).as_slice());
        return Ok(());
    }
    if out.len() + pdu::encoded_len(pdu, digests) > WRITE_BUFFER_BYTES {
        socket.write_all(out).await?;
        out.clear();
    }
    pdu::encode_into(pdu, digests, out);
    Ok(())
}

/// Runs a connection's login: the session logged in (`None` if the initiator left) with
/// the connection's CID.
async fn login_phase<Rd, Wr, R>(
    reader: &mut Rd,
    writer: &mut Wr,
    registry: &R,
    limits: &Effective,
    sequence: &mut Sequence,
    log: &mut ViolationLog,
    mut before_final_reply: impl FnMut(&login::LoggedIn),
) -> Result<Option<(login::LoggedIn, u16)>, IscsiError>
where
    Rd: AsyncBufRead + Unpin,
    Wr: AsyncWrite + Unpin,
    R: TargetRegistry,
{
    let mut login = Login::new(limits);
    let mut first = true;
    loop {
        let Some(request) =
            read_pdu(reader, Digests::default(), limits.max_text_bytes as u32).await?
        else {
            return Ok(None);
        };
        let bhs = request.bhs;
        if bhs.opcode() != op::LOGIN {
            log.report(
                Violation::LoginOrder,
                &format_args!("opcode {:#04x} during login", bhs.opcode()),
            );
            return Err(IscsiError::Protocol(format!(
                "opcode {:#04x} before login completed",
                bhs.opcode()
            )));
        }
        if first {
            first = false;
            sequence.exp_cmd_sn.set(bhs.u32_at(24));
            sequence.stat_sn.set(bhs.u32_at(28));
            sequence.window.set(limits.window);
        }
        let flags = bhs.flags();
        let mut isid = [0u8; 6];
        isid.copy_from_slice(&bhs.0[8..14]);
        let parsed = LoginRequest {
            transit: flags & 0x80 != 0,
            continue_: flags & 0x40 != 0,
            current_stage: (flags >> 2) & 0x03,
            next_stage: flags & 0x03,
            version_min: bhs.0[3],
            isid,
            tsih: bhs.u16_at(14),
            text: request.data.to_vec(),
        };
        let step = match login.step(&parsed, registry) {
            Step::Done(reply, logged_in) => admitted(registry, reply, logged_in).await,
            other => other,
        };
        let (reply, done) = match step {
            Step::Continue(reply) => (reply, None),
            Step::Done(reply, logged_in) => (reply, Some(logged_in)),
            Step::Fail(reply) => {
                let status = reply.status;
                tracing::info!(
                    peer = log.peer(),
                    initiator = login.initiator().unwrap_or("?"),
                    status = format_args!("{status:#06x}"),
                    "iSCSI login refused"
                );
                send_login_reply(writer, &bhs, &reply, sequence, false).await?;
                return Err(IscsiError::LoginRefused { status });
            }
        };
        if let Some(logged_in) = &done {
            before_final_reply(logged_in);
        }
        send_login_reply(writer, &bhs, &reply, sequence, done.is_some()).await?;
        if let Some(logged_in) = done {
            // With the connection's CID (bytes 20-21 of a login request).
            return Ok(Some((*logged_in, bhs.u16_at(20))));
        }
    }
}

/// A finished login of a normal session stands only if the registry can serve its target
/// here now; otherwise it becomes a failure that redirects the initiator or turns it away.
async fn admitted<R: TargetRegistry>(
    registry: &R,
    reply: LoginReply,
    logged_in: Box<login::LoggedIn>,
) -> Step {
    let SessionKind::Normal { target } = &logged_in.kind else {
        return Step::Done(reply, logged_in);
    };
    match registry.prepare_target(target).await {
        Ok(()) => Step::Done(reply, logged_in),
        Err(unavailable) => Step::Fail(login::unavailable_reply(reply.current_stage, &unavailable)),
    }
}

async fn send_login_reply<Wr: AsyncWrite + Unpin>(
    writer: &mut Wr,
    request: &Bhs,
    reply: &LoginReply,
    sequence: &Sequence,
    final_: bool,
) -> Result<(), IscsiError> {
    let mut bhs = Bhs::new(op::LOGIN_RESPONSE);
    let mut flags = (reply.current_stage & 0x03) << 2;
    if reply.transit {
        flags |= 0x80 | (reply.next_stage & 0x03);
    }
    bhs.set_flags(flags);
    bhs.0[8..14].copy_from_slice(&request.0[8..14]);
    if final_ {
        bhs.set_u16_at(14, TSIH);
    }
    bhs.set_itt(request.itt());
    sequence.stamp(&mut bhs, StatSn::Advance);
    bhs.0[36] = (reply.status >> 8) as u8;
    bhs.0[37] = reply.status as u8;
    let pdu = Pdu::new(bhs, Bytes::from(reply.text.encode()));
    writer
        .write_all(&pdu::encode(&pdu, Digests::default()))
        .await?;
    writer.flush().await?;
    Ok(())
}

/// A SCSI command as parsed from its PDU.
#[derive(Debug, Clone)]
struct Command {
    itt: u32,
    lun_field: [u8; 8],
    lun: Option<Lun>,
    cdb: [u8; 16],
    expected: u32,
    read: bool,
}

struct PendingWrite {
    command: Command,
    buffer: TransferBuffer,
    /// TTT of the outstanding R2T; `NO_TAG` while unsolicited data may arrive.
    ttt: u32,
    r2t_sn: u32,
    /// Where the outstanding R2T's burst ends.
    burst_end: usize,
    /// DataSN the next Data-Out of the current sequence must carry (0 at each R2T).
    data_sn: u32,
    charge: Option<OwnedSemaphorePermit>,
}

impl PendingWrite {
    /// Where the data the transfer may receive now ends: its first burst while no R2T is
    /// outstanding (unsolicited data), else the outstanding R2T's burst.
    fn limit(&self, params: &SessionParams) -> usize {
        if self.ttt == NO_TAG {
            (params.first_burst as usize).min(self.command.expected as usize)
        } else {
            self.burst_end
        }
    }

    /// `Some(limit)` when a Data-Out (`bhs`, `len` bytes of data) continues the transfer:
    /// its TTT, buffer offset and DataSN are the next ones and it ends within the limit.
    fn continued_by(&self, bhs: &Bhs, len: usize, params: &SessionParams) -> Option<usize> {
        let limit = self.limit(params);
        let offset = bhs.u32_at(40) as usize;
        let continues = bhs.u32_at(20) == self.ttt
            && offset == self.buffer.len()
            && offset + len <= limit
            && bhs.u32_at(36) == self.data_sn;
        continues.then_some(limit)
    }

    /// Counts in a Data-Out whose data is now in the buffer.
    fn received(&mut self, bhs: &Bhs, limit: usize) -> Progress {
        self.data_sn = self.data_sn.wrapping_add(1);
        let received = self.buffer.len();
        if received == self.command.expected as usize {
            Progress::Complete
        } else if bhs.final_bit() || received == limit {
            Progress::BurstDone
        } else {
            Progress::Receiving
        }
    }
}

/// Where a write transfer stands after a Data-Out.
enum Progress {
    /// All its data is in: it runs.
    Complete,
    /// The current burst is in: the next R2T is due.
    BurstDone,
    /// More of the current burst is to come.
    Receiving,
}

enum TaskState {
    AwaitingData(Box<PendingWrite>),
    /// Waiting for budget before its first R2T.
    AwaitingBudget(Box<PendingWrite>, AbortHandle),
    /// Executing (`None` while being answered without a task).
    Running(Option<JoinHandle<()>>),
}

struct Task {
    lun: Option<Lun>,
    /// Counted in the CmdSN window (not immediate).
    counted: bool,
    /// The unit's PREEMPT AND ABORT count when the command arrived.
    preemptions: u64,
    state: TaskState,
}

/// State of a session shared by its reader and command tasks (all on one thread).
struct Session<D> {
    nexus: Nexus,
    initiator: String,
    discovery: bool,
    target_name: String,
    luns: Vec<LogicalUnit<D>>,
    params: SessionParams,
    limits: Effective,
    sequence: Rc<Sequence>,
    tasks: RefCell<HashMap<u32, Task>>,
    idle: Notify,
    replies: mpsc::Sender<Outgoing>,
    next_ttt: Cell<u32>,
    /// This connection's local address, given as TargetAddress in discovery.
    portal: String,
    /// PDUs read so far: the ping task's proof that the initiator is alive.
    received: Cell<u64>,
    /// The connection's CID (named in an Asynchronous Message about it).
    cid: u16,
}

impl<D: ashlar_core::BlockDevice + 'static> Session<D> {
    async fn send(&self, pdu: Pdu, stat: StatSn) {
        // Fails only when the writer is gone (the initiator left); nothing to answer then.
        let _ = self
            .replies
            .send(Outgoing {
                pdu,
                stat,
                last: false,
            })
            .await;
    }

    /// Removes a finished task; false if it was aborted meanwhile (then nothing is sent).
    fn finish(&self, itt: u32) -> bool {
        self.remove(itt).is_some()
    }

    /// Removes a task, giving its CmdSN window slot back.
    fn remove(&self, itt: u32) -> Option<Task> {
        let task = self.tasks.borrow_mut().remove(&itt)?;
        self.release_slot(task.counted);
        if self.tasks.borrow().is_empty() {
            self.idle.notify_waiters();
        }
        Some(task)
    }

    /// A command is answered: a `counted` one gives its CmdSN window slot back.
    fn release_slot(&self, counted: bool) {
        if counted {
            self.sequence
                .active
                .set(self.sequence.active.get().saturating_sub(1));
        }
    }

    /// What a command to `lun` runs against.
    fn context(&self, lun: Option<Lun>) -> Context<'_, D> {
        Context {
            unit: self.unit(lun),
            nexus: &self.nexus,
            target_name: &self.target_name,
            lun_count: self.luns.len(),
            max_transfer: self.limits.max_transfer,
        }
    }

    /// Reads the next PDU. A Data-Out that continues its write transfer is read straight
    /// into the transfer's buffer, without a copy on the way.
    async fn read_incoming<Rd: PayloadSource>(
        &self,
        reader: &mut Rd,
        digests: Digests,
        max_data: u32,
    ) -> Result<Option<Incoming>, IscsiError> {
        let Some(bhs) = reading::read_bhs(reader).await? else {
            return Ok(None);
        };
        let layout = pdu::frame_layout(&bhs, digests, max_data)?;
        if let Some(mut receiving) = self.lend_transfer(&bhs, &layout) {
            // On an error the connection ends, and with it the transfer (never taken back).
            reading::read_data_segment_into(reader, &bhs, &layout, receiving.target()).await?;
            return Ok(Some(Incoming::DataOut(bhs, receiving)));
        }
        let pdu = reading::read_rest(reader, bhs, layout).await?;
        Ok(Some(Incoming::Pdu(pdu)))
    }

    /// The buffer of the write transfer a Data-Out continues, lent out to receive its data.
    fn lend_transfer(&self, bhs: &Bhs, layout: &pdu::FrameLayout) -> Option<Receiving> {
        if bhs.opcode() != op::DATA_OUT || layout.ahs_bytes != 0 || layout.data_bytes == 0 {
            return None;
        }
        let mut tasks = self.tasks.borrow_mut();
        let Some(Task {
            state: TaskState::AwaitingData(pending),
            ..
        }) = tasks.get_mut(&bhs.itt())
        else {
            return None;
        };
        pending.continued_by(bhs, layout.data_bytes, &self.params)?;
        Some(pending.buffer.lend(layout.data_bytes))
    }

    /// Aborts every task for which `select` holds (and `also` on its state); returns how many.
    fn abort_where(
        &self,
        select: impl Fn(Option<Lun>) -> bool,
        also: impl Fn(&Task) -> bool,
    ) -> usize {
        let itts: Vec<u32> = self
            .tasks
            .borrow()
            .iter()
            .filter(|(_, t)| select(t.lun) && also(t))
            .map(|(itt, _)| *itt)
            .collect();
        for itt in &itts {
            self.abort(*itt);
        }
        itts.len()
    }

    /// Aborts one task: its response is never sent.
    fn abort(&self, itt: u32) -> bool {
        let Some(task) = self.remove(itt) else {
            return false;
        };
        match &task.state {
            TaskState::Running(Some(handle)) => handle.abort(),
            TaskState::AwaitingBudget(_, handle) => handle.abort(),
            TaskState::Running(None) | TaskState::AwaitingData(_) => {}
        }
        true
    }

    /// Takes the commands to `lun` that arrived before preemption number `before` out of the
    /// session (their responses are never sent) and stops those that have not reached the
    /// device. Returns the running ones: their device I/O may have started, so the caller
    /// lets them finish before the preemption is answered.
    fn withdraw_preempted(&self, lun: Lun, before: u64) -> Vec<JoinHandle<()>> {
        let itts: Vec<u32> = self
            .tasks
            .borrow()
            .iter()
            .filter(|(_, t)| t.lun == Some(lun) && t.preemptions < before)
            .map(|(itt, _)| *itt)
            .collect();
        let mut running = Vec::new();
        for itt in itts {
            match self.remove(itt).map(|task| task.state) {
                Some(TaskState::Running(Some(handle))) => running.push(handle),
                Some(TaskState::AwaitingBudget(_, handle)) => handle.abort(),
                _ => {}
            }
        }
        running
    }

    async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.tasks.borrow().is_empty() {
                return;
            }
            notified.await;
        }
    }

    fn new_ttt(&self) -> u32 {
        let ttt = self.next_ttt.get();
        let next = ttt.wrapping_add(1);
        self.next_ttt.set(if next == NO_TAG { 1 } else { next });
        ttt
    }

    fn unit(&self, lun: Option<Lun>) -> Option<&LogicalUnit<D>> {
        lun.and_then(|lun| self.luns.get(usize::from(lun.0)))
    }

    /// Tells the initiator that the target drops this connection now (RFC 7143 11.9,
    /// AsyncEvent 2), sent once its running commands are answered, just before the close:
    /// Time2Wait 0, so it logs in again at once (open-iscsi takes its reconnect delay from
    /// it; libiscsi its next reconnect time, which would otherwise be 3 s after its last
    /// reconnect), and Time2Retain 0, as error recovery level 0 keeps no task for
    /// reassignment.
    /// Bounded by [`ASYNC_MESSAGE_WAIT`]: an initiator that reads nothing gets the close only.
    async fn announce_drop(&self) {
        let message = pdu::dropping_connection(self.cid, 0, 0);
        let sent =
            tokio::time::timeout(ASYNC_MESSAGE_WAIT, self.send(message, StatSn::Advance)).await;
        if sent.is_err() {
            tracing::info!(target = %self.target_name,
                "the initiator reads nothing; closing without the Async Message");
        }
    }

    /// Sends a NOP-In ping (RFC 7143 11.19: ITT reserved, a TTT the answer echoes, StatSN
    /// not consumed). Never waits: with the writer's queue full the initiator is not
    /// reading, which the ping's timeout then catches.
    fn ping(&self) {
        let mut bhs = Bhs::new(op::NOP_IN);
        bhs.set_flags(0x80);
        bhs.set_itt(NO_TAG);
        bhs.set_u32_at(20, self.new_ttt());
        let _ = self.replies.try_send(Outgoing {
            pdu: Pdu::new(bhs, Bytes::new()),
            stat: StatSn::Carry,
            last: false,
        });
    }
}

/// Pings the initiator whenever it has been quiet for the interval; notifies `dead` when a
/// ping goes unanswered for the timeout.
async fn ping_while_quiet<D: ashlar_core::BlockDevice + 'static>(
    session: Rc<Session<D>>,
    nop: NopSettings,
    dead: Rc<Notify>,
) {
    let mut keepalive = Keepalive::new(nop, std::time::Instant::now());
    loop {
        match keepalive.decide(std::time::Instant::now(), session.received.get()) {
            Decision::Wait(until) => {
                tokio::time::sleep_until(tokio::time::Instant::from_std(until)).await
            }
            Decision::Ping => session.ping(),
            Decision::Dead => {
                dead.notify_one();
                return;
            }
        }
    }
}

/// Carries out the PREEMPT AND ABORT orders of the session's units: the preempted commands
/// are withdrawn at once, then the order is confirmed when those already running have
/// finished (at most [`abort::ABORT_WAIT`]; past it they are dropped).
async fn abort_on_orders<D: ashlar_core::BlockDevice + 'static>(
    session: Rc<Session<D>>,
    mut orders: mpsc::UnboundedReceiver<AbortOrder>,
) {
    while let Some(order) = orders.recv().await {
        let running = session.withdraw_preempted(order.lun, order.before);
        let deadline = tokio::time::Instant::now() + abort::ABORT_WAIT;
        for mut handle in running {
            if tokio::time::timeout_at(deadline, &mut handle)
                .await
                .is_err()
            {
                handle.abort();
            }
        }
        let _ = order.done.send(());
    }
}

/// The reader side of the full feature phase.
struct FullFeature<R: TargetRegistry> {
    session: Rc<Session<R::Device>>,
    registry: Rc<R>,
    digests: Digests,
    /// Commands that arrived ahead of a CmdSN gap, keyed by CmdSN, bounded by the window.
    held: BTreeMap<u32, Pdu>,
    /// The rest of a text response too long for one PDU, with its TTT.
    text_pending: Option<(u32, Vec<u8>)>,
    /// The reader stopped because the session's target moved to another node.
    target_moved: bool,
}

/// What the reader read.
enum Incoming {
    Pdu(Pdu),
    /// A Data-Out whose data is already in its transfer's buffer, lent out for it.
    DataOut(Bhs, Receiving),
}

/// Why the reader loop stops.
enum Flow {
    Continue,
    /// Logout answered or fatal error answered: stop reading.
    Stop,
}

impl<R: TargetRegistry> FullFeature<R> {
    async fn run<Rd: PayloadSource>(
        &mut self,
        reader: &mut Rd,
        mut shutdown: watch::Receiver<bool>,
        ending: Option<std::sync::Arc<crate::reinstate::Ending>>,
        dead: Rc<Notify>,
        log: &mut ViolationLog,
    ) -> Result<(), IscsiError> {
        let max_data = self.session.params.target_max_recv_data_segment;
        let ending = async move {
            match ending {
                Some(ending) => ending.ended().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(ending);
        // Made once, not per PDU: each would register with its notifier again.
        let session = self.session.clone();
        let stop = shutdown.wait_for(|stop| *stop);
        let closed = session.replies.closed();
        let dead = dead.notified();
        tokio::pin!(stop, closed, dead);
        loop {
            let next = tokio::select! {
                biased;
                _ = &mut stop => return Ok(()),
                target_moved = &mut ending => {
                    self.target_moved = target_moved;
                    if target_moved {
                        tracing::info!(peer = log.peer(), target = %self.session.target_name,
                            "iSCSI session ended: its target moved to another node; running commands finish, then an Async Message tells the initiator the connection drops (log in again at once) and it closes");
                    } else {
                        tracing::info!(peer = log.peer(), "iSCSI session reinstated by a new login; ending the old one");
                    }
                    return Ok(());
                }
                _ = &mut closed => return Ok(()),
                _ = &mut dead => {
                    let waited = self.session.limits.nop.map(|n| n.timeout).unwrap_or_default();
                    tracing::warn!(peer = log.peer(), ?waited,
                        "iSCSI initiator did not answer a NOP-In ping; dropping the connection");
                    // Its commands will never be answered: abort them all now.
                    self.session.abort_where(|_| true, |_| true);
                    return Err(IscsiError::Unresponsive(waited));
                }
                incoming = session.read_incoming(reader, self.digests, max_data) => incoming,
            };
            let pdu = match next {
                Ok(Some(incoming)) => {
                    self.session.received.set(self.session.received.get() + 1);
                    match incoming {
                        Incoming::Pdu(pdu) => pdu,
                        Incoming::DataOut(bhs, receiving) => {
                            self.data_out_received(bhs, receiving);
                            continue;
                        }
                    }
                }
                Ok(None) => return Ok(()),
                Err(error) => {
                    log.report(Violation::BadPdu, &error);
                    return Err(error);
                }
            };
            if let Flow::Stop = self.dispatch(pdu, log).await? {
                return Ok(());
            }
        }
    }

    async fn dispatch(&mut self, pdu: Pdu, log: &mut ViolationLog) -> Result<Flow, IscsiError> {
        let bhs = pdu.bhs;
        let opcode = bhs.opcode();
        let numbered = matches!(
            opcode,
            op::NOP_OUT | op::SCSI_COMMAND | op::TASK_MANAGEMENT | op::TEXT | op::LOGOUT
        );
        if !numbered {
            return self.handle(pdu, false, log).await;
        }
        // NOP-Out answering our ping (ITT reserved) carries no command.
        if opcode == op::NOP_OUT && bhs.itt() == NO_TAG {
            return Ok(Flow::Continue);
        }
        if bhs.immediate() {
            return self.handle(pdu, true, log).await;
        }
        let cmd_sn = bhs.u32_at(24);
        let sequence = self.session.sequence.clone();
        let exp = sequence.exp_cmd_sn.get();
        let max = sequence.max_cmd_sn();
        if cmd_sn == exp {
            sequence.exp_cmd_sn.set(exp.wrapping_add(1));
            let mut flow = self.handle(pdu, false, log).await?;
            // Commands held behind the gap may now run in order.
            while let Flow::Continue = flow {
                let next = sequence.exp_cmd_sn.get();
                let Some(held) = self.held.remove(&next) else {
                    break;
                };
                sequence.exp_cmd_sn.set(next.wrapping_add(1));
                flow = self.handle(held, false, log).await?;
            }
            return Ok(flow);
        }
        if pdu::sn_lt(exp, cmd_sn) && pdu::sn_le(cmd_sn, max) {
            if self.held.len() < self.session.limits.window as usize {
                self.held.insert(cmd_sn, pdu);
            }
            return Ok(Flow::Continue);
        }
        // Outside the window: silently ignored (RFC 7143 4.2.2.1).
        log.report(
            Violation::CmdSnOutsideWindow,
            &format_args!("CmdSN {cmd_sn} outside [{exp}, {max}]"),
        );
        Ok(Flow::Continue)
    }

    async fn handle(
        &mut self,
        pdu: Pdu,
        immediate: bool,
        log: &mut ViolationLog,
    ) -> Result<Flow, IscsiError> {
        match pdu.bhs.opcode() {
            op::NOP_OUT => {
                self.nop_out(pdu).await;
                Ok(Flow::Continue)
            }
            op::SCSI_COMMAND => self.scsi_command(pdu, immediate, log).await,
            op::DATA_OUT => self.data_out(pdu, log).await,
            op::TASK_MANAGEMENT => self.task_management(pdu).await,
            op::TEXT => self.text(pdu, log).await,
            op::LOGOUT => self.logout(pdu).await,
            op::LOGIN => {
                log.report(
                    Violation::LoginOrder,
                    &"login request in full feature phase",
                );
                self.reject(&pdu.bhs, reject::PROTOCOL_ERROR, true).await;
                Ok(Flow::Stop)
            }
            other => {
                log.report(
                    Violation::UnsupportedOpcode,
                    &format_args!("opcode {other:#04x}"),
                );
                self.reject(&pdu.bhs, reject::COMMAND_NOT_SUPPORTED, false)
                    .await;
                Ok(Flow::Continue)
            }
        }
    }

    async fn reject(&self, bhs: &Bhs, reason: u8, last: bool) {
        let mut out = Bhs::new(op::REJECT);
        out.set_flags(0x80);
        out.0[2] = reason;
        out.set_itt(NO_TAG);
        let _ = self
            .session
            .replies
            .send(Outgoing {
                pdu: Pdu::new(out, Bytes::copy_from_slice(&bhs.0)),
                stat: StatSn::Advance,
                last,
            })
            .await;
    }

    async fn nop_out(&self, pdu: Pdu) {
        let mut bhs = Bhs::new(op::NOP_IN);
        bhs.set_flags(0x80);
        bhs.set_lun_field(pdu.bhs.lun_field());
        bhs.set_itt(pdu.bhs.itt());
        bhs.set_u32_at(20, NO_TAG);
        let limit = self.session.params.initiator_max_recv_data_segment as usize;
        let data = pdu.data.slice(..pdu.data.len().min(limit));
        self.session
            .send(Pdu::new(bhs, data), StatSn::Advance)
            .await;
    }

    async fn scsi_command(
        &mut self,
        pdu: Pdu,
        immediate: bool,
        log: &mut ViolationLog,
    ) -> Result<Flow, IscsiError> {
        let bhs = pdu.bhs;
        let session = self.session.clone();
        if session.discovery {
            self.reject(&bhs, reject::PROTOCOL_ERROR, true).await;
            return Ok(Flow::Stop);
        }
        let flags = bhs.flags();
        let mut cdb = [0u8; 16];
        cdb.copy_from_slice(&bhs.0[32..48]);
        let command = Command {
            itt: bhs.itt(),
            lun_field: bhs.lun_field(),
            lun: Lun::decode(bhs.lun_field()),
            cdb,
            expected: bhs.u32_at(20),
            read: flags & 0x40 != 0,
        };
        let write = flags & 0x20 != 0;
        let refusal = {
            let tasks = session.tasks.borrow();
            if tasks.contains_key(&command.itt) {
                Some(reject::TASK_IN_PROGRESS)
            } else if immediate
                && tasks.values().filter(|t| !t.counted).count() >= MAX_IMMEDIATE_COMMANDS
            {
                Some(reject::IMMEDIATE_COMMAND_REJECT)
            } else {
                None
            }
        };
        if let Some(reason) = refusal {
            log.report(
                Violation::DuplicateTask,
                &format_args!("ITT {:#x} refused (reason {reason:#x})", command.itt),
            );
            self.reject(&bhs, reason, false).await;
            return Ok(Flow::Continue);
        }
        if !immediate {
            session
                .sequence
                .active
                .set(session.sequence.active.get() + 1);
        }
        let preemptions = session
            .unit(command.lun)
            .map_or(0, |unit| unit.shared.preemptions());
        let task = |state| Task {
            lun: command.lun,
            counted: !immediate,
            preemptions,
            state,
        };
        // Extended CDBs (AHS) and bidirectional commands are not supported.
        let refused = if !pdu.ahs.is_empty() {
            Some(Sense::INVALID_OPCODE)
        } else if write && (command.read || command.expected > session.limits.max_transfer) {
            Some(Sense::INVALID_FIELD_IN_CDB)
        } else {
            None
        };
        if let Some(sense) = refused {
            session
                .tasks
                .borrow_mut()
                .insert(command.itt, task(TaskState::Running(None)));
            respond(&session, &command, ScsiResult::check(sense)).await;
            return Ok(Flow::Continue);
        }
        let immediate_data = pdu.data;
        if !immediate_data.is_empty()
            && (!write
                || !session.params.immediate_data
                || immediate_data.len() > session.params.first_burst as usize
                || immediate_data.len() > command.expected as usize)
        {
            log.report(
                Violation::ImmediateData,
                &format_args!(
                    "{} bytes of immediate data not allowed",
                    immediate_data.len()
                ),
            );
            if !immediate {
                session
                    .sequence
                    .active
                    .set(session.sequence.active.get().saturating_sub(1));
            }
            self.reject(&bhs, reject::PROTOCOL_ERROR, false).await;
            return Ok(Flow::Continue);
        }
        let expected = command.expected as usize;
        // Runs now: no data, or all of it came with the command (a write then runs on the
        // PDU's own bytes, without copying them into a transfer buffer).
        if !write || expected == 0 || immediate_data.len() == expected {
            if command.read && answer_now(&session, &command, !immediate) {
                return Ok(Flow::Continue);
            }
            let itt = command.itt;
            // Empty unless a write's: immediate data with anything else was refused above.
            let handle = spawn_command(session.clone(), command.clone(), immediate_data, None);
            session
                .tasks
                .borrow_mut()
                .insert(itt, task(TaskState::Running(Some(handle))));
            return Ok(Flow::Continue);
        }
        let mut buffer =
            TransferBuffer::with_capacity(expected.min(session.params.first_burst as usize));
        buffer.extend_from_slice(&immediate_data);
        let pending = Box::new(PendingWrite {
            command: command.clone(),
            buffer,
            ttt: NO_TAG,
            r2t_sn: 0,
            burst_end: 0,
            data_sn: 0,
            charge: None,
        });
        let itt = command.itt;
        session
            .tasks
            .borrow_mut()
            .insert(itt, task(TaskState::AwaitingData(pending)));
        let unsolicited_follows = flags & 0x80 == 0;
        if !unsolicited_follows {
            self.solicit(itt);
        }
        Ok(Flow::Continue)
    }

    /// All data of a write is in: run it.
    fn start_write(&self, itt: u32) {
        let session = &self.session;
        let mut tasks = session.tasks.borrow_mut();
        let Some(task) = tasks.get_mut(&itt) else {
            return;
        };
        let TaskState::AwaitingData(pending) =
            std::mem::replace(&mut task.state, TaskState::Running(None))
        else {
            return;
        };
        let pending = *pending;
        let handle = spawn_command(
            session.clone(),
            pending.command,
            pending.buffer.freeze(),
            pending.charge,
        );
        task.state = TaskState::Running(Some(handle));
    }

    /// Asks for the next burst of a write: first reserves budget for all solicited bytes.
    fn solicit(&self, itt: u32) {
        let session = self.session.clone();
        let mut tasks = session.tasks.borrow_mut();
        let Some(task) = tasks.get_mut(&itt) else {
            return;
        };
        let TaskState::AwaitingData(pending) = &mut task.state else {
            return;
        };
        if pending.charge.is_some() {
            let r2t = next_r2t(&session, pending);
            drop(tasks);
            let session = session.clone();
            tokio::task::spawn_local(async move { session.send(r2t, StatSn::Carry).await });
            return;
        }
        let needed = pending.command.expected as usize - pending.buffer.len();
        let budget = session.limits.budget.clone();
        let waiting = session.clone();
        let handle = tokio::task::spawn_local(async move {
            let charge = budget.take(needed as u32).await;
            let r2t = {
                let mut tasks = waiting.tasks.borrow_mut();
                let Some(task) = tasks.get_mut(&itt) else {
                    return;
                };
                let state = std::mem::replace(&mut task.state, TaskState::Running(None));
                let TaskState::AwaitingBudget(mut pending, _) = state else {
                    task.state = state;
                    return;
                };
                pending.charge = charge;
                pending.buffer.reserve(needed);
                let r2t = next_r2t(&waiting, &mut pending);
                task.state = TaskState::AwaitingData(pending);
                r2t
            };
            waiting.send(r2t, StatSn::Carry).await;
        })
        .abort_handle();
        let state = std::mem::replace(&mut task.state, TaskState::Running(None));
        if let TaskState::AwaitingData(pending) = state {
            task.state = TaskState::AwaitingBudget(pending, handle);
        }
    }

    async fn data_out(&mut self, pdu: Pdu, log: &mut ViolationLog) -> Result<Flow, IscsiError> {
        let bhs = pdu.bhs;
        let itt = bhs.itt();
        let session = self.session.clone();
        // Err(true): the data does not continue the transfer; Err(false): no such task.
        let outcome: Result<Progress, bool> = {
            let mut tasks = session.tasks.borrow_mut();
            match tasks.get_mut(&itt) {
                Some(Task {
                    state: TaskState::AwaitingData(pending),
                    ..
                }) => match pending.continued_by(&bhs, pdu.data.len(), &session.params) {
                    Some(limit) => {
                        pending.buffer.extend_from_slice(&pdu.data);
                        Ok(pending.received(&bhs, limit))
                    }
                    None => {
                        let (ttt, offset, data_sn) =
                            (bhs.u32_at(20), bhs.u32_at(40), bhs.u32_at(36));
                        let end = offset as usize + pdu.data.len();
                        log.report(
                            Violation::DataOut,
                            &format_args!(
                                "Data-Out ITT {itt:#x} TTT {ttt:#x} DataSN {data_sn} [{offset}, {end}) does not continue the transfer"
                            ),
                        );
                        Err(true)
                    }
                },
                _ => {
                    // A command refused early, aborted, or never sent: its data is dropped.
                    log.report(
                        Violation::UnknownTask,
                        &format_args!("Data-Out for unknown ITT {itt:#x}"),
                    );
                    Err(false)
                }
            }
        };
        let progress = match outcome {
            Ok(progress) => progress,
            Err(false) => return Ok(Flow::Continue),
            Err(true) => {
                // The command fails (its later Data-Out is dropped as unknown); the
                // connection and the session's other commands carry on.
                let failed = match session.tasks.borrow().get(&itt).map(|t| &t.state) {
                    Some(TaskState::AwaitingData(pending)) => Some(pending.command.clone()),
                    _ => None,
                };
                if let Some(command) = failed {
                    let sense = crate::scsi::sense::Sense::DATA_PHASE_ERROR;
                    respond(&session, &command, ScsiResult::check(sense)).await;
                }
                return Ok(Flow::Continue);
            }
        };
        self.proceed(itt, progress);
        Ok(Flow::Continue)
    }

    /// A Data-Out's data, read straight into its transfer's buffer (see
    /// [`Session::lend_transfer`]), is in.
    fn data_out_received(&mut self, bhs: Bhs, receiving: Receiving) {
        let itt = bhs.itt();
        let progress = {
            let mut tasks = self.session.tasks.borrow_mut();
            let Some(Task {
                state: TaskState::AwaitingData(pending),
                ..
            }) = tasks.get_mut(&itt)
            else {
                // Aborted while its data arrived: the data goes with it.
                return;
            };
            let limit = pending.limit(&self.session.params);
            pending.buffer.take_back(receiving);
            pending.received(&bhs, limit)
        };
        self.proceed(itt, progress);
    }

    /// Runs a write whose data is all in, or asks for its next burst.
    fn proceed(&self, itt: u32, progress: Progress) {
        match progress {
            Progress::Complete => self.start_write(itt),
            Progress::BurstDone => self.solicit(itt),
            Progress::Receiving => {}
        }
    }

    async fn task_management(&mut self, pdu: Pdu) -> Result<Flow, IscsiError> {
        let bhs = pdu.bhs;
        let function = bhs.flags() & 0x7f;
        let lun = Lun::decode(bhs.lun_field());
        let referenced = bhs.u32_at(20);
        let session = self.session.clone();
        let lun_exists = session.unit(lun).is_some();
        let mut close = false;
        let response: u8 = match function {
            // ABORT TASK
            1 => {
                let found = session
                    .tasks
                    .borrow()
                    .get(&referenced)
                    .map(|t| t.lun == lun);
                match found {
                    Some(true) => {
                        session.abort(referenced);
                        0
                    }
                    Some(false) => 1,
                    // Already answered (or never received): the function is complete.
                    None => 0,
                }
            }
            // ABORT TASK SET, CLEAR TASK SET, LOGICAL UNIT RESET
            2 | 4 | 5 => {
                if !lun_exists {
                    2
                } else {
                    session.abort_where(|l| l == lun, |_| true);
                    if function == 5 {
                        if let Some(unit) = session.unit(lun) {
                            unit.shared.reset(Sense::BUS_DEVICE_RESET_OCCURRED);
                        }
                    }
                    0
                }
            }
            // TARGET WARM RESET, TARGET COLD RESET
            6 | 7 => {
                session.abort_where(|_| true, |_| true);
                for unit in &session.luns {
                    unit.shared.reset(Sense::RESET_OCCURRED);
                }
                close = function == 7;
                0
            }
            3 => 5, // CLEAR ACA: not supported
            8 => 4, // TASK REASSIGN: no connection recovery at level 0
            _ => 255,
        };
        let mut out = Bhs::new(op::TASK_MANAGEMENT_RESPONSE);
        out.set_flags(0x80);
        out.0[2] = response;
        out.set_itt(bhs.itt());
        let _ = session
            .replies
            .send(Outgoing {
                pdu: Pdu::new(out, Bytes::new()),
                stat: StatSn::Advance,
                last: close,
            })
            .await;
        Ok(if close { Flow::Stop } else { Flow::Continue })
    }

    async fn text(&mut self, pdu: Pdu, log: &mut ViolationLog) -> Result<Flow, IscsiError> {
        let bhs = pdu.bhs;
        let ttt = bhs.u32_at(20);
        let session = self.session.clone();
        let limit = session.params.initiator_max_recv_data_segment as usize;
        let mut body = if ttt != NO_TAG {
            match self.text_pending.take() {
                Some((tag, rest)) if tag == ttt => rest,
                _ => {
                    log.report(Violation::Text, &"text continuation with an unknown TTT");
                    self.reject(&bhs, reject::INVALID_PDU_FIELD, false).await;
                    return Ok(Flow::Continue);
                }
            }
        } else {
            self.text_pending = None;
            if bhs.flags() & 0x40 != 0 {
                // Requests split over several PDUs are not needed by any key we serve.
                log.report(Violation::Text, &"multi-PDU text request");
                self.reject(&bhs, reject::PROTOCOL_ERROR, false).await;
                return Ok(Flow::Continue);
            }
            let pairs = match TextPairs::parse(&pdu.data) {
                Ok(pairs) => pairs,
                Err(error) => {
                    log.report(Violation::Text, &error);
                    self.reject(&bhs, reject::PROTOCOL_ERROR, false).await;
                    return Ok(Flow::Continue);
                }
            };
            let mut reply = TextPairs::default();
            for (key, value) in &pairs.0 {
                if key == "SendTargets" {
                    self.send_targets(value, &mut reply);
                } else {
                    reply.push(key, "NotUnderstood");
                }
            }
            let mut body = reply.encode();
            body.truncate(session.limits.max_text_bytes.max(limit));
            body
        };
        let mut out = Bhs::new(op::TEXT_RESPONSE);
        out.set_lun_field(bhs.lun_field());
        out.set_itt(bhs.itt());
        let data = if body.len() > limit {
            let tag = session.new_ttt();
            out.set_flags(0x40); // C: more follows
            out.set_u32_at(20, tag);
            let rest = body.split_off(limit);
            self.text_pending = Some((tag, rest));
            body
        } else {
            out.set_flags(0x80);
            out.set_u32_at(20, NO_TAG);
            body
        };
        session
            .send(Pdu::new(out, Bytes::from(data)), StatSn::Advance)
            .await;
        Ok(Flow::Continue)
    }

    fn send_targets(&self, value: &str, reply: &mut TextPairs) {
        let session = &self.session;
        let visible = self.registry.discover(&session.initiator);
        let names: Vec<String> = match value {
            "All" if session.discovery => visible,
            "All" => vec![session.target_name.clone()],
            "" if !session.discovery => vec![session.target_name.clone()],
            name => visible.into_iter().filter(|t| t == name).collect(),
        };
        for name in names {
            reply.push("TargetName", name);
            reply.push(
                "TargetAddress",
                format!("{},{}", session.portal, crate::PORTAL_GROUP_TAG),
            );
        }
    }

    async fn logout(&mut self, pdu: Pdu) -> Result<Flow, IscsiError> {
        let bhs = pdu.bhs;
        let reason = bhs.flags() & 0x7f;
        let session = self.session.clone();
        let response = match reason {
            0 | 1 => 0,
            2 => 2, // connection recovery is not supported at level 0
            _ => 3,
        };
        // Commands waiting for data will not get it; running ones are answered first.
        session.abort_where(
            |_| true,
            |task| !matches!(task.state, TaskState::Running(_)),
        );
        let _ = tokio::time::timeout(DRAIN_GRACE, session.wait_idle()).await;
        let mut out = Bhs::new(op::LOGOUT_RESPONSE);
        out.set_flags(0x80);
        out.0[2] = response;
        out.set_itt(bhs.itt());
        out.set_u16_at(40, 0); // Time2Wait
        out.set_u16_at(42, 0); // Time2Retain
        let _ = session
            .replies
            .send(Outgoing {
                pdu: Pdu::new(out, Bytes::new()),
                stat: StatSn::Advance,
                last: response == 0,
            })
            .await;
        Ok(if response == 0 {
            Flow::Stop
        } else {
            Flow::Continue
        })
    }
}

/// Builds the next R2T of a write and records its burst.
fn next_r2t<D: ashlar_core::BlockDevice + 'static>(
    session: &Session<D>,
    pending: &mut PendingWrite,
) -> Pdu {
    let offset = pending.buffer.len();
    let remaining = pending.command.expected as usize - offset;
    let length = remaining.min(session.params.max_burst as usize);
    let ttt = session.new_ttt();
    pending.ttt = ttt;
    pending.burst_end = offset + length;
    pending.data_sn = 0;
    let mut bhs = Bhs::new(op::R2T);
    bhs.set_flags(0x80);
    bhs.set_lun_field(pending.command.lun_field);
    bhs.set_itt(pending.command.itt);
    bhs.set_u32_at(20, ttt);
    bhs.set_u32_at(36, pending.r2t_sn);
    bhs.set_u32_at(40, offset as u32);
    bhs.set_u32_at(44, length as u32);
    pending.r2t_sn += 1;
    Pdu::new(bhs, Bytes::new())
}

fn spawn_command<D: ashlar_core::BlockDevice + 'static>(
    session: Rc<Session<D>>,
    command: Command,
    data: Bytes,
    charge: Option<OwnedSemaphorePermit>,
) -> JoinHandle<()> {
    tokio::task::spawn_local(async move {
        let _charge = match charge {
            Some(charge) => Some(charge),
            None if command.read => {
                let bytes = command.expected.min(session.limits.max_transfer);
                session.limits.budget.take(bytes).await
            }
            None => None,
        };
        let ctx = session.context(command.lun);
        let result = scsi::execute(&ctx, &command.cdb, data, command.expected).await;
        respond(&session, &command, result).await;
    })
}

/// Answers a command that needs no waiting (a READ of data at hand) in the reader itself:
/// no task, no wakeup. It takes no data budget: the data goes straight to the writer's
/// queue, where a task gives its budget back too, and that queue is bounded. Only done when
/// the queue has room for the whole answer, so the reader never waits for the writer; false
/// when nothing was done (the command then runs as a task).
fn answer_now<D: ashlar_core::BlockDevice + 'static>(
    session: &Session<D>,
    command: &Command,
    counted: bool,
) -> bool {
    if session.replies.capacity() < Answer::most_pdus(&session.params, command) {
        return false;
    }
    let Some(result) = scsi::execute_now(&session.context(command.lun), &command.cdb) else {
        return false;
    };
    session.release_slot(counted);
    for (pdu, stat) in Answer::new(&session.params, command, result) {
        let last = false;
        // Room was checked and nothing else sends meanwhile (one thread). Closed: the
        // initiator left, nothing to answer.
        let _ = session.replies.try_send(Outgoing { pdu, stat, last });
    }
    true
}

/// Sends a command's Data-In and status, unless it was aborted meanwhile.
async fn respond<D: ashlar_core::BlockDevice + 'static>(
    session: &Session<D>,
    command: &Command,
    result: ScsiResult,
) {
    if !session.finish(command.itt) {
        return;
    }
    for (pdu, stat) in Answer::new(&session.params, command, result) {
        session.send(pdu, stat).await;
    }
}

/// The PDUs that answer a command, in order: its Data-In segments (never crossing a burst,
/// F at the end of each burst), then status: in the last Data-In when the command succeeded
/// with data (phase collapse), else in a SCSI Response.
struct Answer {
    itt: u32,
    status: u8,
    sense: Option<Sense>,
    /// What the initiator gets (cut to its expected length).
    data: Bytes,
    residual_flag: u8,
    residual: u32,
    collapse: bool,
    segment: usize,
    burst: usize,
    offset: usize,
    data_sn: u32,
    /// The SCSI Response (or the collapsed status) has been produced.
    done: bool,
}

impl Answer {
    fn new(params: &SessionParams, command: &Command, result: ScsiResult) -> Answer {
        let expected = command.expected as usize;
        let transfer = result.transfer as usize;
        let (residual_flag, residual) = match transfer.cmp(&expected) {
            std::cmp::Ordering::Greater => (0x04u8, transfer - expected),
            std::cmp::Ordering::Less => (0x02u8, expected - transfer),
            std::cmp::Ordering::Equal => (0, 0),
        };
        let data = if command.read {
            result.data_in.slice(..result.data_in.len().min(expected))
        } else {
            Bytes::new()
        };
        let collapse = result.status == status::GOOD && result.sense.is_none() && !data.is_empty();
        Answer {
            itt: command.itt,
            status: result.status,
            sense: result.sense,
            data,
            residual_flag,
            residual: residual as u32,
            collapse,
            segment: params.initiator_max_recv_data_segment as usize,
            burst: params.max_burst as usize,
            offset: 0,
            data_sn: 0,
            done: false,
        }
    }

    /// The most PDUs an answer to `command` can take, before it runs.
    fn most_pdus(params: &SessionParams, command: &Command) -> usize {
        let segment = (params.initiator_max_recv_data_segment as usize).max(1);
        (command.expected as usize).div_ceil(segment) + 1
    }

    fn data_in(&mut self) -> (Pdu, StatSn) {
        let offset = self.offset;
        let burst_end = (offset / self.burst + 1) * self.burst;
        let end = (offset + self.segment).min(self.data.len()).min(burst_end);
        let last = end == self.data.len();
        let mut bhs = Bhs::new(op::DATA_IN);
        let mut flags = 0u8;
        if last || end == burst_end {
            flags |= 0x80;
        }
        let status_here = last && self.collapse;
        if status_here {
            flags |= 0x01 | self.residual_flag;
            bhs.0[3] = self.status;
            bhs.set_u32_at(44, self.residual);
            self.done = true;
        }
        bhs.set_flags(flags);
        bhs.set_itt(self.itt);
        bhs.set_u32_at(20, NO_TAG);
        bhs.set_u32_at(36, self.data_sn);
        bhs.set_u32_at(40, offset as u32);
        self.offset = end;
        self.data_sn += 1;
        let stat = if status_here {
            StatSn::Advance
        } else {
            StatSn::Omit
        };
        (Pdu::new(bhs, self.data.slice(offset..end)), stat)
    }

    fn response(&mut self) -> (Pdu, StatSn) {
        self.done = true;
        let mut bhs = Bhs::new(op::SCSI_RESPONSE);
        bhs.set_flags(0x80 | self.residual_flag);
        bhs.0[2] = 0x00; // command completed at target
        bhs.0[3] = self.status;
        bhs.set_itt(self.itt);
        bhs.set_u32_at(44, self.residual);
        let sense = match self.sense {
            Some(sense) => {
                let fixed = sense.fixed();
                let mut segment = Vec::with_capacity(2 + fixed.len());
                segment.extend_from_slice(&(fixed.len() as u16).to_be_bytes());
                segment.extend_from_slice(&fixed);
                Bytes::from(segment)
            }
            None => Bytes::new(),
        };
        (Pdu::new(bhs, sense), StatSn::Advance)
    }
}

impl Iterator for Answer {
    type Item = (Pdu, StatSn);

    fn next(&mut self) -> Option<(Pdu, StatSn)> {
        if self.done {
            None
        } else if self.offset < self.data.len() {
            Some(self.data_in())
        } else {
            Some(self.response())
        }
    }
}

#[cfg(test)]
mod fuzz {
    //! Random PDUs after a valid login: the connection ends or carries on, never panics, and
    //! the server always finishes.
    use super::*;
    use crate::testing::{against_server, login_request, ServerEnd, TestRegistry};
    use proptest::prelude::*;
    use tokio::io::AsyncReadExt;

    fn run(stream_bytes: Vec<u8>) {
        let limits = IscsiLimits {
            login_timeout: Duration::from_secs(2),
            ..IscsiLimits::default()
        };
        let ((), end) = against_server(TestRegistry::open(), limits, |mut client| async move {
            client.write_all(&login_request()).await.unwrap();
            client.write_all(&stream_bytes).await.unwrap();
            client.shutdown().await.unwrap();
            // Drain whatever the target answers until it closes.
            let mut sink = Vec::new();
            let _ =
                tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut sink)).await;
        });
        assert_eq!(end, ServerEnd::Finished);
    }

    /// A PDU with a random header whose lengths agree with its body, so it reaches the
    /// full-feature handlers instead of only the framing checks.
    fn framed(header: Vec<u8>, data: Vec<u8>, opcode: u8) -> Vec<u8> {
        let mut bhs = Bhs(header.try_into().unwrap());
        bhs.0[0] = (bhs.0[0] & 0x40) | opcode;
        bhs.0[4] = 0;
        pdu::encode(&Pdu::new(bhs, Bytes::from(data)), Digests::default()).to_vec()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn random_pdus_after_login(pdus in proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 48),
             proptest::collection::vec(any::<u8>(), 0..700),
             prop_oneof![Just(0x00u8), Just(0x01), Just(0x02), Just(0x04), Just(0x05),
                         Just(0x06), Just(0x10), Just(0x03), any::<u8>().prop_map(|b| b & 0x3f)]),
            0..12)) {
            let bytes: Vec<u8> = pdus
                .into_iter()
                .flat_map(|(header, data, opcode)| framed(header, data, opcode))
                .collect();
            run(bytes);
        }

        #[test]
        fn random_bytes_after_login(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
            run(bytes);
        }
    }
}

#[cfg(test)]
mod admission {
    //! A login to a target the registry cannot serve here now ends with a redirection or
    //! "service unavailable", and the connection closes.
    use super::*;
    use crate::login::status;
    use crate::registry::TargetUnavailable;
    use crate::testing::{against_server, login_request, ServerEnd, TestRegistry};
    use tokio::io::AsyncReadExt;

    /// Logs in once against `registry`: the final response's status, its text, and
    /// whether the target then closed the connection.
    fn login_answer(registry: TestRegistry) -> (u16, TextPairs, bool) {
        let limits = IscsiLimits::default();
        let (answer, end) = against_server(registry, limits, |mut client| async move {
            client.write_all(&login_request()).await.unwrap();
            let mut reader = BufReader::new(client);
            let answer = read_pdu(&mut reader, Digests::default(), 1 << 16)
                .await
                .unwrap()
                .expect("a login response");
            assert_eq!(answer.bhs.opcode(), op::LOGIN_RESPONSE);
            let status = answer.bhs.u16_at(36);
            // A logged-in session stays open until the initiator leaves.
            let closed = status != status::SUCCESS && {
                let mut rest = Vec::new();
                let read = reader.read_to_end(&mut rest);
                tokio::time::timeout(Duration::from_secs(5), read)
                    .await
                    .is_ok_and(|read| read.is_ok() && rest.is_empty())
            };
            (status, TextPairs::parse(&answer.data).unwrap(), closed)
        });
        assert_eq!(end, ServerEnd::Finished);
        answer
    }

    #[test]
    fn a_target_served_elsewhere_redirects_the_login() {
        let registry = TestRegistry {
            unavailable: Some(TargetUnavailable::MovedTemporarily {
                address: "10.0.0.2:3260".into(),
            }),
            ..TestRegistry::open()
        };
        let (status, text, closed) = login_answer(registry);
        assert_eq!(status, status::TARGET_MOVED_TEMPORARILY);
        assert_eq!(text.get("TargetAddress"), Some("10.0.0.2:3260"));
        assert!(
            closed,
            "the target closes the connection after a redirection"
        );
    }

    #[test]
    fn a_target_nobody_can_serve_now_is_service_unavailable() {
        let registry = TestRegistry {
            unavailable: Some(TargetUnavailable::ServiceUnavailable),
            ..TestRegistry::open()
        };
        let (status, text, closed) = login_answer(registry);
        assert_eq!(status, status::SERVICE_UNAVAILABLE);
        assert_eq!(text.get("TargetAddress"), None);
        assert!(closed);
    }

    #[test]
    fn a_servable_target_logs_in() {
        let (status, _, _) = login_answer(TestRegistry::open());
        assert_eq!(status, status::SUCCESS);
    }
}

#[cfg(test)]
mod target_moved {
    //! A session told that its target moved to another node (failback): an Asynchronous
    //! Message says the connection drops, stamped like any other target PDU, then the
    //! connection closes.
    use super::*;
    use crate::testing::{against_server, login_request, ServerEnd, TestRegistry, TARGET};

    /// The initiator's CID in the test's login.
    const CID: u16 = 0x0107;

    async fn next(reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> Option<Pdu> {
        let read = read_pdu(reader, Digests::default(), 1 << 20);
        tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("the target answers or closes")
            .expect("a well-formed PDU")
    }

    #[test]
    fn the_initiator_is_told_the_connection_drops_before_it_closes() {
        let limits = IscsiLimits {
            nop: None,
            ..IscsiLimits::default()
        };
        let table = limits.sessions.clone();
        let (seen, end) = against_server(TestRegistry::open(), limits, |stream| async move {
            let (read_half, mut writer) = stream.into_split();
            let mut login = login_request();
            login[20..22].copy_from_slice(&CID.to_be_bytes());
            writer.write_all(&login).await.unwrap();
            let mut reader = BufReader::new(read_half);
            let reply = next(&mut reader).await.expect("a login response");
            assert_eq!(reply.bhs.u16_at(36), 0, "logged in");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while table.live_sessions_of(TARGET) == 0 {
                assert!(tokio::time::Instant::now() < deadline, "never registered");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(table.end_target(TARGET), 1);
            let mut seen = Vec::new();
            while let Some(pdu) = next(&mut reader).await {
                seen.push(pdu);
            }
            (reply.bhs, seen)
        });
        assert_eq!(end, ServerEnd::Finished);
        let (login, seen) = seen;
        let opcodes: Vec<u8> = seen.iter().map(|p| p.bhs.opcode()).collect();
        assert_eq!(opcodes, vec![op::ASYNC_MESSAGE], "then the close");
        let message = seen[0].bhs;
        assert_eq!(message.0[36], pdu::async_event::DROPPING_CONNECTION);
        assert_eq!(message.u16_at(38), CID, "Parameter1: the connection's CID");
        assert_eq!(message.u16_at(40), 0, "Time2Wait: log in again at once");
        assert_eq!(message.u16_at(42), 0, "Time2Retain: no task is kept");
        assert_eq!(message.itt(), NO_TAG);
        assert_eq!(message.u32_at(24), login.u32_at(24) + 1, "the next StatSN");
        assert_eq!(message.u32_at(28), login.u32_at(28), "ExpCmdSN");
        assert_eq!(message.u32_at(32), login.u32_at(32), "MaxCmdSN");
    }
}

#[cfg(test)]
mod writing {
    //! The writer frames PDUs into its buffer or, for large data, writes the data where it
    //! is; either way the bytes are exactly what `pdu::encode` gives, in queue order, each
    //! stamped as it is taken. Answers are cut into segments and bursts.
    use super::*;
    use crate::limits::Effective;
    use crate::pdu::BHS_LEN;

    fn data_in(itt: u32, len: usize) -> Pdu {
        let mut bhs = Bhs::new(op::DATA_IN);
        bhs.set_itt(itt);
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        Pdu::new(bhs, Bytes::from(data))
    }

    #[tokio::test]
    async fn written_bytes_are_the_encoded_pdus_in_order() {
        let digests = Digests {
            header: true,
            data: true,
        };
        // Small, odd (padded), empty and large (written directly) data segments mixed.
        let sizes = [4096, 3, 0, 100_000, 5, 300_000, 4096];
        let stats = [StatSn::Omit, StatSn::Advance, StatSn::Carry];
        let (replies, queue) = mpsc::channel(sizes.len());
        let mut expected = Vec::new();
        let model = Sequence::default();
        model.window.set(4);
        for (i, size) in sizes.iter().enumerate() {
            let pdu = data_in(i as u32, *size);
            let stat = stats[i % stats.len()];
            let mut stamped = pdu.clone();
            model.stamp(&mut stamped.bhs, stat);
            expected.extend_from_slice(&pdu::encode(&stamped, digests));
            let last = i + 1 == sizes.len();
            replies.send(Outgoing { pdu, stat, last }).await.unwrap();
        }
        let sequence = Rc::new(Sequence::default());
        sequence.window.set(4);
        let mut written = Vec::new();
        write_pdus(queue, &mut written, sequence.clone(), digests)
            .await
            .unwrap();
        assert_eq!(written.len(), expected.len());
        assert!(written == expected, "the bytes differ from encode()'s");
        assert_eq!(sequence.stat_sn.get(), model.stat_sn.get());
    }

    #[tokio::test]
    async fn the_async_message_carries_and_consumes_the_next_stat_sn() {
        let (replies, queue) = mpsc::channel(1);
        let pdu = pdu::dropping_connection(3, 0, 0);
        let stat = StatSn::Advance;
        let last = true;
        replies.send(Outgoing { pdu, stat, last }).await.unwrap();
        let sequence = Rc::new(Sequence::default());
        sequence.stat_sn.set(7);
        sequence.exp_cmd_sn.set(20);
        sequence.window.set(4);
        sequence.active.set(1);
        let mut written = Vec::new();
        write_pdus(queue, &mut written, sequence.clone(), Digests::default())
            .await
            .unwrap();
        assert_eq!(written.len(), BHS_LEN, "a header alone");
        let bhs = Bhs(written[..BHS_LEN].try_into().unwrap());
        assert_eq!(bhs.opcode(), op::ASYNC_MESSAGE);
        assert_eq!(bhs.u32_at(24), 7, "StatSN");
        assert_eq!(bhs.u32_at(28), 20, "ExpCmdSN");
        assert_eq!(bhs.u32_at(32), 22, "MaxCmdSN: ExpCmdSN + 3 free slots - 1");
        assert_eq!(bhs.0[36], pdu::async_event::DROPPING_CONNECTION);
        assert_eq!(bhs.u16_at(38), 3, "CID");
        assert_eq!(sequence.stat_sn.get(), 8, "consumed, as by a response");
    }

    #[test]
    fn a_read_answer_is_cut_into_segments_and_bursts_with_status_last() {
        let mut params = SessionParams::initial(&Effective::from(&IscsiLimits::default()));
        params.initiator_max_recv_data_segment = 8192;
        params.max_burst = 16384;
        let command = Command {
            itt: 9,
            lun_field: [0; 8],
            lun: Some(Lun(0)),
            cdb: [0; 16],
            expected: 20480,
            read: true,
        };
        let result = ScsiResult::data(vec![1; 20480]);
        let pdus: Vec<(Pdu, StatSn)> = Answer::new(&params, &command, result).collect();
        let shape: Vec<(usize, u8, u32, StatSn)> = pdus
            .iter()
            .map(|(p, s)| (p.data.len(), p.bhs.flags(), p.bhs.u32_at(40), *s))
            .collect();
        assert_eq!(
            shape,
            vec![
                (8192, 0x00, 0, StatSn::Omit),
                (8192, 0x80, 8192, StatSn::Omit),
                (4096, 0x81, 16384, StatSn::Advance),
            ]
        );
        assert!(pdus.len() <= Answer::most_pdus(&params, &command));
        // A failed read answers with a SCSI Response only.
        let failed = ScsiResult::check(Sense::LBA_OUT_OF_RANGE);
        let pdus: Vec<_> = Answer::new(&params, &command, failed).collect();
        assert_eq!(pdus.len(), 1);
        assert_eq!(pdus[0].0.bhs.opcode(), op::SCSI_RESPONSE);
        assert_eq!(pdus[0].1, StatSn::Advance);
    }
}

#[cfg(test)]
mod writer {
    //! The PDU writer gives the thread up between large Data-In PDUs queued together.
    use super::*;
    use std::cell::RefCell;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A socket that takes everything at once and records, per large write, whether another
    /// task on the thread has run by then.
    struct Recorder {
        other_ran: Rc<Cell<bool>>,
        seen: Rc<RefCell<Vec<bool>>>,
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            if buf.len() >= 64 * 1024 {
                self.seen.borrow_mut().push(self.other_ran.get());
            }
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// Queues `count` 1 MiB Data-In PDUs and closes the queue; returns the writer's queue, the
    /// flag another task will set when it runs, and a socket recording that flag at each
    /// large write.
    fn large_data_in(count: usize) -> (mpsc::Receiver<Outgoing>, Rc<Cell<bool>>, Recorder) {
        let (sender, queue) = mpsc::channel(8);
        for _ in 0..count {
            let pdu = Pdu::new(Bhs::new(op::DATA_IN), Bytes::from(vec![5u8; 1 << 20]));
            let outgoing = Outgoing {
                pdu,
                stat: StatSn::Omit,
                last: false,
            };
            assert!(sender.try_send(outgoing).is_ok());
        }
        let other_ran = Rc::new(Cell::new(false));
        let socket = Recorder {
            other_ran: other_ran.clone(),
            seen: Rc::new(RefCell::new(Vec::new())),
        };
        (queue, other_ran, socket)
    }

    /// Writes what `large_data_in` queued while another task waits to run; returns whether
    /// that task had run, per large write and when the writer returned.
    async fn write_beside_another_task(count: usize) -> (Vec<bool>, bool) {
        let local = tokio::task::LocalSet::new();
        local
            .run_until(async {
                let (queue, other_ran, socket) = large_data_in(count);
                let seen = socket.seen.clone();
                let flag = other_ran.clone();
                let other = tokio::task::spawn_local(async move { flag.set(true) });
                let sequence = Rc::new(Sequence {
                    stat_sn: Cell::new(1),
                    exp_cmd_sn: Cell::new(1),
                    active: Cell::new(0),
                    window: Cell::new(32),
                });
                write_pdus(queue, socket, sequence, Digests::default())
                    .await
                    .expect("written");
                let ran_by_return = other_ran.get();
                other.await.expect("other task");
                let seen = seen.borrow().clone();
                (seen, ran_by_return)
            })
            .await
    }

    #[tokio::test(flavor = "current_thread")]
    async fn other_tasks_run_between_large_data_in_pdus() {
        let (seen, _) = write_beside_another_task(4).await;
        assert_eq!(seen.len(), 4, "one data write per PDU");
        assert!(!seen[0], "the first PDU goes out at once");
        assert!(seen[3], "the other task ran before the last PDU: {seen:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_burst_that_empties_the_queue_ends_without_a_yield() {
        let (seen, ran_by_return) = write_beside_another_task(1).await;
        assert_eq!(seen, [false]);
        assert!(
            !ran_by_return,
            "nothing was queued behind the PDU: no yield"
        );
    }
}
