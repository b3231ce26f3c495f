//! The production transport: tokio TCP with TCP_NODELAY (a small request must not wait for
//! Nagle's timer: rust-deps.md measured a 20× difference for NBD). A test may give it
//! [`OutgoingFaults`] ([`TcpTransport::with_faults`]): the connections it opens then meet
//! their peer's faults (`faults`).

use crate::config::TransportConfig;
use crate::faults::{FaultyWriter, OutgoingFaults};
use crate::transport::{Listener, Transport};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::AsyncWrite;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener as TokioListener, TcpStream};

#[derive(Clone)]
pub struct TcpTransport {
    config: TransportConfig,
    faults: Option<OutgoingFaults>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("config", &self.config)
            .field("faults", &self.faults.is_some())
            .finish()
    }
}

impl TcpTransport {
    pub fn new(config: TransportConfig) -> TcpTransport {
        config.limits.assert_valid();
        TcpTransport {
            config,
            faults: None,
        }
    }

    /// The connections this transport opens meet `faults` (tests only: delay, loss and
    /// partitions in-process).
    pub fn with_faults(mut self, faults: OutgoingFaults) -> TcpTransport {
        self.faults = Some(faults);
        self
    }
}

/// The writing half of a TCP connection: the socket's, or through injected faults.
pub enum TcpWriter {
    Plain(OwnedWriteHalf),
    Faulty(FaultyWriter),
}

impl AsyncWrite for TcpWriter {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            TcpWriter::Plain(w) => Pin::new(w).poll_write(cx, buf),
            TcpWriter::Faulty(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            TcpWriter::Plain(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            TcpWriter::Faulty(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            TcpWriter::Plain(w) => w.is_write_vectored(),
            TcpWriter::Faulty(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TcpWriter::Plain(w) => Pin::new(w).poll_flush(cx),
            TcpWriter::Faulty(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TcpWriter::Plain(w) => Pin::new(w).poll_shutdown(cx),
            TcpWriter::Faulty(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

fn split(stream: TcpStream) -> io::Result<(OwnedReadHalf, OwnedWriteHalf)> {
    stream.set_nodelay(true)?;
    Ok(stream.into_split())
}

impl Transport for TcpTransport {
    type Reader = OwnedReadHalf;
    type Writer = TcpWriter;
    type Listener = TcpListener;

    fn config(&self) -> &TransportConfig {
        &self.config
    }

    async fn dial(&self, addr: SocketAddr) -> io::Result<(OwnedReadHalf, TcpWriter)> {
        let (reader, writer) = split(TcpStream::connect(addr).await?)?;
        let writer = match &self.faults {
            Some(faults) => TcpWriter::Faulty(faults.wrap(addr, writer)),
            None => TcpWriter::Plain(writer),
        };
        Ok((reader, writer))
    }

    async fn bind(&self, addr: SocketAddr) -> io::Result<TcpListener> {
        Ok(TcpListener(TokioListener::bind(addr).await?))
    }
}

#[derive(Debug)]
pub struct TcpListener(TokioListener);

impl Listener for TcpListener {
    type Reader = OwnedReadHalf;
    type Writer = TcpWriter;

    fn local_addr(&self) -> SocketAddr {
        self.0.local_addr().expect("a bound socket has an address")
    }

    async fn accept(&mut self) -> io::Result<(OwnedReadHalf, TcpWriter, SocketAddr)> {
        let (stream, remote) = self.0.accept().await?;
        let (reader, writer) = split(stream)?;
        Ok((reader, TcpWriter::Plain(writer), remote))
    }

    type Portable = std::net::TcpStream;

    fn detach(reader: OwnedReadHalf, writer: TcpWriter) -> io::Result<std::net::TcpStream> {
        // Accepted connections are never wrapped in faults (those are the dialer's).
        let TcpWriter::Plain(writer) = writer else {
            return Err(io::Error::other(
                "a connection with injected faults cannot move",
            ));
        };
        let stream = reader.reunite(writer).map_err(io::Error::other)?;
        stream.into_std()
    }

    fn attach(stream: std::net::TcpStream) -> io::Result<(OwnedReadHalf, TcpWriter)> {
        let (reader, writer) = split(TcpStream::from_std(stream)?)?;
        Ok((reader, TcpWriter::Plain(writer)))
    }
}
