//! A minimal NBD client written from the protocol (doc/proto.md of NetworkBlockDevice/nbd),
//! independent of the server's code: fixed newstyle handshake, `NBD_OPT_GO`, simple replies,
//! and pipelined requests identified by cookies. Blocking std sockets with deadlines.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

pub const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1;
pub const FLAG_C_NO_ZEROES: u32 = 2;

pub const OPT_GO: u32 = 7;
pub const OPT_ABORT: u32 = 2;
pub const REP_ACK: u32 = 1;
pub const REP_INFO: u32 = 3;
pub const INFO_EXPORT: u16 = 0;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;

pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;

/// Default deadline of every socket read and write.
pub const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// One NBD connection in the transmission phase.
pub struct NbdConn {
    pub stream: TcpStream,
    /// Export size from `NBD_INFO_EXPORT`.
    pub size: u64,
    /// Transmission flags from `NBD_INFO_EXPORT`.
    pub flags: u16,
    next_cookie: u64,
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

fn protocol_error(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// Opens a TCP connection with deadlines, reads and checks the greeting, and sends the client
/// flags (fixed newstyle + no zeroes). Returns the stream ready for options.
pub fn greet(addr: SocketAddr) -> io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.set_nodelay(true)?;
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting)?;
    if be64(&greeting[0..8]) != NBDMAGIC || be64(&greeting[8..16]) != IHAVEOPT {
        return Err(protocol_error(format!("bad greeting {greeting:02x?}")));
    }
    let server_flags = be16(&greeting[16..18]);
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol_error(format!(
            "server does not offer fixed newstyle (flags {server_flags:#x})"
        )));
    }
    stream.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
    Ok(stream)
}

/// Encodes an option: IHAVEOPT, option, length, data.
pub fn option_bytes(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + data.len());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Encodes a request header (28 bytes) followed by `payload`.
pub fn request_bytes(
    command: u16,
    flags: u16,
    cookie: u64,
    offset: u64,
    length: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(28 + payload.len());
    out.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Reads one simple reply header: (error, cookie).
pub fn read_simple_reply(stream: &mut impl Read) -> io::Result<(u32, u64)> {
    let mut header = [0u8; 16];
    stream.read_exact(&mut header)?;
    let magic = be32(&header[0..4]);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(protocol_error(format!(
            "expected a simple reply, got magic {magic:#010x}"
        )));
    }
    Ok((be32(&header[4..8]), be64(&header[8..16])))
}

impl NbdConn {
    /// Handshake with `NBD_OPT_GO` on export `name`.
    pub fn connect(addr: SocketAddr, name: &str) -> io::Result<NbdConn> {
        let mut stream = greet(addr)?;
        let mut data = Vec::new();
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes()); // no information requests
        stream.write_all(&option_bytes(OPT_GO, &data))?;
        let mut size = None;
        let mut flags = 0;
        loop {
            let mut header = [0u8; 20];
            stream.read_exact(&mut header)?;
            if be64(&header[0..8]) != OPTION_REPLY_MAGIC {
                return Err(protocol_error(format!("bad option reply {header:02x?}")));
            }
            let option = be32(&header[8..12]);
            let kind = be32(&header[12..16]);
            let length = be32(&header[16..20]) as usize;
            if option != OPT_GO {
                return Err(protocol_error(format!(
                    "reply to option {option}, expected {OPT_GO}"
                )));
            }
            if length > 1 << 20 {
                return Err(protocol_error(format!("option reply of {length} bytes")));
            }
            let mut payload = vec![0u8; length];
            stream.read_exact(&mut payload)?;
            match kind {
                REP_ACK => break,
                REP_INFO => {
                    if payload.len() >= 12 && be16(&payload[0..2]) == INFO_EXPORT {
                        size = Some(be64(&payload[2..10]));
                        flags = be16(&payload[10..12]);
                    }
                }
                kind if kind & 0x8000_0000 != 0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!(
                            "NBD_OPT_GO {name:?} refused ({kind:#x}): {}",
                            String::from_utf8_lossy(&payload)
                        ),
                    ));
                }
                other => {
                    return Err(protocol_error(format!(
                        "unexpected option reply {other:#x}"
                    )))
                }
            }
        }
        let size = size.ok_or_else(|| protocol_error("no NBD_INFO_EXPORT before ACK".into()))?;
        Ok(NbdConn {
            stream,
            size,
            flags,
            next_cookie: 1,
        })
    }

    pub fn cookie(&mut self) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        cookie
    }

    /// Sends a request without waiting for its reply.
    pub fn send(
        &mut self,
        command: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<()> {
        self.stream
            .write_all(&request_bytes(command, 0, cookie, offset, length, payload))
    }

    /// Reads a simple reply header: (error, cookie). For a successful READ the caller must
    /// then read the data.
    pub fn reply(&mut self) -> io::Result<(u32, u64)> {
        read_simple_reply(&mut self.stream)
    }

    /// One WRITE, waiting for its reply; returns the NBD error (0 = success).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<u32> {
        let cookie = self.cookie();
        self.send(CMD_WRITE, cookie, offset, data.len() as u32, data)?;
        let (error, got) = self.reply()?;
        if got != cookie {
            return Err(protocol_error(format!("cookie {got}, expected {cookie}")));
        }
        Ok(error)
    }

    /// One READ: `Ok(Ok(data))`, or `Ok(Err(errno))` when the server answered an error.
    pub fn read(&mut self, offset: u64, length: u32) -> io::Result<Result<Vec<u8>, u32>> {
        let cookie = self.cookie();
        self.send(CMD_READ, cookie, offset, length, &[])?;
        let (error, got) = self.reply()?;
        if got != cookie {
            return Err(protocol_error(format!("cookie {got}, expected {cookie}")));
        }
        if error != 0 {
            // Simple replies carry no payload with an error.
            return Ok(Err(error));
        }
        let mut data = vec![0u8; length as usize];
        self.stream.read_exact(&mut data)?;
        Ok(Ok(data))
    }

    /// A READ that must succeed.
    pub fn read_ok(&mut self, offset: u64, length: u32) -> Vec<u8> {
        match self.read(offset, length) {
            Ok(Ok(data)) => data,
            Ok(Err(errno)) => panic!("NBD read [{offset}, +{length}) failed with errno {errno}"),
            Err(e) => panic!("NBD read [{offset}, +{length}): {e}"),
        }
    }

    /// A WRITE that must succeed.
    pub fn write_ok(&mut self, offset: u64, data: &[u8]) {
        match self.write(offset, data) {
            Ok(0) => {}
            Ok(errno) => panic!(
                "NBD write [{offset}, +{}) failed with errno {errno}",
                data.len()
            ),
            Err(e) => panic!("NBD write [{offset}, +{}): {e}", data.len()),
        }
    }

    /// Reads `length` bytes in pipelined requests of `chunk` bytes (up to 16 in flight).
    pub fn read_range(&mut self, offset: u64, length: u64, chunk: u32) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; length as usize];
        let mut sent = 0u64;
        let mut pending: std::collections::HashMap<u64, (u64, u32)> = Default::default();
        while sent < length || !pending.is_empty() {
            while sent < length && pending.len() < 16 {
                let len = (chunk as u64).min(length - sent) as u32;
                let cookie = self.cookie();
                self.send(CMD_READ, cookie, offset + sent, len, &[])?;
                pending.insert(cookie, (sent, len));
                sent += len as u64;
            }
            let (error, cookie) = self.reply()?;
            let (at, len) = pending
                .remove(&cookie)
                .ok_or_else(|| protocol_error(format!("unknown cookie {cookie}")))?;
            if error != 0 {
                return Err(io::Error::other(format!(
                    "read [{}, +{len}) failed with errno {error}",
                    offset + at
                )));
            }
            self.stream
                .read_exact(&mut out[at as usize..(at + len as u64) as usize])?;
        }
        Ok(out)
    }

    /// Reads `length` bytes as separate requests of `block` bytes (up to 32 in flight) and
    /// returns each one's outcome: its data, or the errno the server answered. Unlike
    /// `read_range`, a failed request does not stop the others, so a test sees exactly which
    /// blocks fail.
    pub fn read_blocks(
        &mut self,
        offset: u64,
        length: u64,
        block: u32,
    ) -> io::Result<Vec<Result<Vec<u8>, u32>>> {
        let count = length.div_ceil(block as u64) as usize;
        let mut out: Vec<Option<Result<Vec<u8>, u32>>> = (0..count).map(|_| None).collect();
        let mut next = 0usize;
        let mut pending: std::collections::HashMap<u64, (usize, u32)> = Default::default();
        while next < count || !pending.is_empty() {
            while next < count && pending.len() < 32 {
                let at = next as u64 * block as u64;
                let len = (block as u64).min(length - at) as u32;
                let cookie = self.cookie();
                self.send(CMD_READ, cookie, offset + at, len, &[])?;
                pending.insert(cookie, (next, len));
                next += 1;
            }
            let (error, cookie) = self.reply()?;
            let (index, len) = pending
                .remove(&cookie)
                .ok_or_else(|| protocol_error(format!("unknown cookie {cookie}")))?;
            out[index] = Some(if error != 0 {
                Err(error)
            } else {
                let mut data = vec![0u8; len as usize];
                self.stream.read_exact(&mut data)?;
                Ok(data)
            });
        }
        Ok(out.into_iter().map(|r| r.unwrap()).collect())
    }

    /// Writes every `(offset, data)` with up to 32 requests in flight; returns each write's
    /// NBD error (0 = success), in the order given.
    pub fn write_many(&mut self, writes: &[(u64, Vec<u8>)]) -> io::Result<Vec<u32>> {
        let mut errors = vec![u32::MAX; writes.len()];
        let mut next = 0usize;
        let mut pending: std::collections::HashMap<u64, usize> = Default::default();
        while next < writes.len() || !pending.is_empty() {
            while next < writes.len() && pending.len() < 32 {
                let (offset, data) = &writes[next];
                let cookie = self.cookie();
                self.send(CMD_WRITE, cookie, *offset, data.len() as u32, data)?;
                pending.insert(cookie, next);
                next += 1;
            }
            let (error, cookie) = self.reply()?;
            let index = pending
                .remove(&cookie)
                .ok_or_else(|| protocol_error(format!("unknown cookie {cookie}")))?;
            errors[index] = error;
        }
        Ok(errors)
    }

    /// NBD_CMD_DISC, then close.
    pub fn disconnect(mut self) {
        let cookie = self.cookie();
        let _ = self.send(CMD_DISC, cookie, 0, 0, &[]);
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
    }
}

/// True if the peer closed `stream` (EOF or reset) within `limit`, reading and discarding
/// whatever it still sends.
pub fn closed_by_peer(stream: &mut TcpStream, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return false
            }
            Err(_) => return true, // reset
        }
    }
}
