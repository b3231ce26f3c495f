//! The production transport: tokio TCP with TCP_NODELAY (a small request must not wait for
//! Nagle's timer: rust-deps.md measured a 20× difference for NBD).

use crate::config::TransportConfig;
use crate::transport::{Listener, Transport};
use std::io;
use std::net::SocketAddr;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener as TokioListener, TcpStream};

#[derive(Debug, Clone)]
pub struct TcpTransport {
    config: TransportConfig,
}

impl TcpTransport {
    pub fn new(config: TransportConfig) -> TcpTransport {
        config.limits.assert_valid();
        TcpTransport { config }
    }
}

fn split(stream: TcpStream) -> io::Result<(OwnedReadHalf, OwnedWriteHalf)> {
    stream.set_nodelay(true)?;
    Ok(stream.into_split())
}

impl Transport for TcpTransport {
    type Reader = OwnedReadHalf;
    type Writer = OwnedWriteHalf;
    type Listener = TcpListener;

    fn config(&self) -> &TransportConfig {
        &self.config
    }

    async fn dial(&self, addr: SocketAddr) -> io::Result<(OwnedReadHalf, OwnedWriteHalf)> {
        split(TcpStream::connect(addr).await?)
    }

    async fn bind(&self, addr: SocketAddr) -> io::Result<TcpListener> {
        Ok(TcpListener(TokioListener::bind(addr).await?))
    }
}

#[derive(Debug)]
pub struct TcpListener(TokioListener);

impl Listener for TcpListener {
    type Reader = OwnedReadHalf;
    type Writer = OwnedWriteHalf;

    fn local_addr(&self) -> SocketAddr {
        self.0.local_addr().expect("a bound socket has an address")
    }

    async fn accept(&mut self) -> io::Result<(OwnedReadHalf, OwnedWriteHalf, SocketAddr)> {
        let (stream, remote) = self.0.accept().await?;
        let (reader, writer) = split(stream)?;
        Ok((reader, writer, remote))
    }
}
