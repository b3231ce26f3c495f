//! A tiny NBD client written from the protocol description, independent of the server's
//! own encoders, so the tests check the wire format rather than agree with themselves.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_MAGIC: u32 = 0x668e_33ef;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const FLAG_FUA: u16 = 1;
pub const FLAG_NO_HOLE: u16 = 2;
pub const FLAG_REQ_ONE: u16 = 8;

pub const CHUNK_NONE: u16 = 0;
pub const CHUNK_OFFSET_DATA: u16 = 1;
pub const CHUNK_OFFSET_HOLE: u16 = 2;
pub const CHUNK_BLOCK_STATUS: u16 = 5;
pub const CHUNK_ERROR: u16 = 0x8001;

pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ESHUTDOWN: u32 = 108;

/// Transmission flags every export of this server advertises.
pub const EXPECTED_FLAGS: u16 = 1 | 4 | 8 | 32 | 64 | 256;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Simple {
        cookie: u64,
        error: u32,
        data: Vec<u8>,
    },
    Chunk {
        flags: u16,
        kind: u16,
        cookie: u64,
        payload: Vec<u8>,
    },
}

impl Reply {
    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } | Reply::Chunk { cookie, .. } => *cookie,
        }
    }
}

/// Everything one request's reply said.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Answer {
    pub error: u32,
    pub message: String,
    pub data: Vec<u8>,
    pub extents: Vec<(u32, u32)>,
    pub context_id: u32,
    pub chunk_types: Vec<u16>,
}

/// What the handshake negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    pub structured: bool,
    pub allocation: bool,
}

pub const SIMPLE: Mode = Mode {
    structured: false,
    allocation: false,
};
pub const STRUCTURED: Mode = Mode {
    structured: true,
    allocation: true,
};

pub struct Client {
    pub stream: TcpStream,
    next_cookie: u64,
    /// Read lengths of requests without structured replies (a simple reply does not say).
    pending_reads: HashMap<u64, u32>,
    pub structured: bool,
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

pub fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

fn string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

/// Payload of NBD_OPT_GO / NBD_OPT_INFO.
pub fn go_payload(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut out = string(name);
    out.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        out.extend_from_slice(&info.to_be_bytes());
    }
    out
}

/// Payload of the meta-context options.
pub fn meta_payload(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut out = string(export);
    out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        out.extend_from_slice(&string(q));
    }
    out
}

impl Client {
    /// Connects, checks the greeting and sends `client_flags`.
    pub async fn greet(addr: SocketAddr, client_flags: u32) -> Client {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).await.unwrap();
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        assert_eq!(&greeting[8..16], b"IHAVEOPT");
        assert_eq!(be16(&greeting[16..]), 3, "fixed newstyle + no zeroes");
        stream.write_all(&client_flags.to_be_bytes()).await.unwrap();
        Client {
            stream,
            next_cookie: 1,
            pending_reads: HashMap::new(),
            structured: false,
        }
    }

    /// Handshake through NBD_OPT_GO on `name` with the given features; returns the size.
    pub async fn connect(addr: SocketAddr, name: &str, mode: Mode) -> (Client, u64) {
        let mut client = Client::greet(addr, 1).await;
        if mode.structured {
            client.send_option(OPT_STRUCTURED_REPLY, &[]).await;
            assert_eq!(client.option_reply().await.kind, REP_ACK);
            client.mark_structured();
        }
        if mode.allocation {
            let (contexts, kind) = client
                .meta(OPT_SET_META_CONTEXT, name, &["base:allocation"])
                .await;
            assert_eq!(kind, REP_ACK);
            assert_eq!(contexts.len(), 1);
        }
        let infos = client
            .go(OPT_GO, name, &[INFO_BLOCK_SIZE])
            .await
            .expect("GO succeeds");
        (client, infos.size)
    }

    pub async fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut out = IHAVEOPT.to_be_bytes().to_vec();
        out.extend_from_slice(&option.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
        self.stream.write_all(&out).await.unwrap();
    }

    pub async fn option_reply(&mut self) -> OptionReply {
        let mut head = [0u8; 20];
        self.stream.read_exact(&mut head).await.unwrap();
        assert_eq!(be64(&head), 0x0003_e889_0455_65a9, "option reply magic");
        let mut data = vec![0u8; be32(&head[16..]) as usize];
        self.stream.read_exact(&mut data).await.unwrap();
        OptionReply {
            option: be32(&head[8..]),
            kind: be32(&head[12..]),
            data,
        }
    }

    /// Sends GO or INFO and collects the NBD_REP_INFO items.
    pub async fn go(
        &mut self,
        option: u32,
        name: &str,
        infos: &[u16],
    ) -> Result<GoInfo, OptionReply> {
        self.send_option(option, &go_payload(name, infos)).await;
        let mut info = GoInfo::default();
        loop {
            let reply = self.option_reply().await;
            assert_eq!(reply.option, option);
            match reply.kind {
                REP_INFO => {
                    let kind = be16(&reply.data);
                    if kind == INFO_EXPORT {
                        info.size = be64(&reply.data[2..]);
                        info.flags = be16(&reply.data[10..]);
                    }
                    info.items.push((kind, reply.data[2..].to_vec()));
                }
                REP_ACK => return Ok(info),
                _ => return Err(reply),
            }
        }
    }

    /// Sends a meta-context option; returns the contexts and the final reply type.
    pub async fn meta(
        &mut self,
        option: u32,
        export: &str,
        queries: &[&str],
    ) -> (Vec<(u32, String)>, u32) {
        self.send_option(option, &meta_payload(export, queries))
            .await;
        let mut contexts = Vec::new();
        loop {
            let reply = self.option_reply().await;
            if reply.kind != REP_META_CONTEXT {
                return (contexts, reply.kind);
            }
            contexts.push((
                be32(&reply.data),
                String::from_utf8(reply.data[4..].to_vec()).unwrap(),
            ));
        }
    }

    pub fn mark_structured(&mut self) {
        self.structured = true;
    }

    /// Sends one request; returns its cookie.
    pub async fn send(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let mut out = Vec::with_capacity(28 + payload.len());
        out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out.extend_from_slice(&flags.to_be_bytes());
        out.extend_from_slice(&command.to_be_bytes());
        out.extend_from_slice(&cookie.to_be_bytes());
        out.extend_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(payload);
        self.stream.write_all(&out).await.unwrap();
        if command == CMD_READ && !self.structured {
            self.pending_reads.insert(cookie, length);
        }
        cookie
    }

    /// Reads one simple reply or one structured chunk.
    pub async fn reply(&mut self) -> Reply {
        let mut magic = [0u8; 4];
        self.stream.read_exact(&mut magic).await.unwrap();
        match be32(&magic) {
            SIMPLE_MAGIC => {
                let mut rest = [0u8; 12];
                self.stream.read_exact(&mut rest).await.unwrap();
                let (error, cookie) = (be32(&rest), be64(&rest[4..]));
                let length = self.pending_reads.remove(&cookie).unwrap_or(0);
                let mut data = vec![0u8; if error == 0 { length as usize } else { 0 }];
                self.stream.read_exact(&mut data).await.unwrap();
                Reply::Simple {
                    cookie,
                    error,
                    data,
                }
            }
            STRUCTURED_MAGIC => {
                let mut rest = [0u8; 16];
                self.stream.read_exact(&mut rest).await.unwrap();
                let mut payload = vec![0u8; be32(&rest[12..]) as usize];
                self.stream.read_exact(&mut payload).await.unwrap();
                Reply::Chunk {
                    flags: be16(&rest),
                    kind: be16(&rest[2..]),
                    cookie: be64(&rest[4..]),
                    payload,
                }
            }
            other => panic!("bad reply magic {other:#x}"),
        }
    }

    /// Reads replies until the one for `cookie` is complete (others must not arrive).
    pub async fn answer(&mut self, cookie: u64, offset: u64, length: u32) -> Answer {
        let mut answer = Answer::default();
        let mut data = vec![0u8; length as usize];
        loop {
            let reply = self.reply().await;
            assert_eq!(reply.cookie(), cookie, "reply for another request");
            match reply {
                Reply::Simple {
                    error,
                    data: payload,
                    ..
                } => {
                    answer.error = error;
                    answer.data = payload;
                    return answer;
                }
                Reply::Chunk {
                    flags,
                    kind,
                    payload,
                    ..
                } => {
                    answer.chunk_types.push(kind);
                    apply_chunk(&mut answer, &mut data, kind, &payload, offset);
                    if flags & 1 != 0 {
                        if answer.error == 0
                            && answer.chunk_types.iter().any(|k| *k == 1 || *k == 2)
                        {
                            answer.data = data;
                        }
                        return answer;
                    }
                }
            }
        }
    }

    pub async fn call(
        &mut self,
        command: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Answer {
        let cookie = self.send(command, flags, offset, length, payload).await;
        self.answer(cookie, offset, length).await
    }

    pub async fn read(&mut self, offset: u64, length: u32) -> Answer {
        self.call(CMD_READ, 0, offset, length, &[]).await
    }

    pub async fn write(&mut self, offset: u64, data: &[u8], flags: u16) -> u32 {
        self.call(CMD_WRITE, flags, offset, data.len() as u32, data)
            .await
            .error
    }

    pub async fn disconnect(&mut self) {
        self.send(CMD_DISC, 0, 0, 0, &[]).await;
    }

    /// True if the server closes the connection within five seconds (reading and dropping
    /// whatever it still sends).
    pub async fn closed_by_server(&mut self) -> bool {
        is_closed(&mut self.stream).await
    }
}

fn apply_chunk(answer: &mut Answer, data: &mut [u8], kind: u16, payload: &[u8], offset: u64) {
    match kind {
        CHUNK_OFFSET_DATA => {
            let at = (be64(payload) - offset) as usize;
            data[at..at + payload.len() - 8].copy_from_slice(&payload[8..]);
        }
        CHUNK_OFFSET_HOLE => {
            let at = (be64(payload) - offset) as usize;
            data[at..at + be32(&payload[8..]) as usize].fill(0);
        }
        CHUNK_BLOCK_STATUS => {
            answer.context_id = be32(payload);
            answer.extents = payload[4..]
                .chunks(8)
                .map(|d| (be32(d), be32(&d[4..])))
                .collect();
        }
        CHUNK_ERROR => {
            answer.error = be32(payload);
            let len = be16(&payload[4..]) as usize;
            answer.message = String::from_utf8(payload[6..6 + len].to_vec()).unwrap();
        }
        CHUNK_NONE => {}
        other => panic!("unexpected chunk type {other}"),
    }
}

#[derive(Debug, Default, Clone)]
pub struct GoInfo {
    pub size: u64,
    pub flags: u16,
    pub items: Vec<(u16, Vec<u8>)>,
}

impl GoInfo {
    pub fn item(&self, kind: u16) -> Option<&[u8]> {
        self.items
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, v)| v.as_slice())
    }
}

/// True if the peer closes `stream` within five seconds.
pub async fn is_closed(stream: &mut TcpStream) -> bool {
    let drain = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), drain)
        .await
        .is_ok()
}
