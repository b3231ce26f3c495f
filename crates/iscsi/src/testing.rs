//! An in-memory [`BlockDevice`] and registry for the crate's tests.

use crate::pdu::{self, op, Bhs, Digests, Pdu};
use crate::registry::{
    Access, ChapCredentials, LogicalUnit, Refusal, TargetRegistry, TargetUnavailable,
};
use crate::scsi::reservation::LunReservations;
use ashlar_core::{check_range, BlockDevice, BlockStatusRun, IoResult};
use bytes::Bytes;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone)]
pub(crate) struct MemDevice {
    pub data: Rc<RefCell<Vec<u8>>>,
    /// How long each read takes (a slow device holds commands in flight).
    pub read_delay: Rc<Cell<Duration>>,
    /// Reads that have finished.
    pub reads_done: Rc<Cell<u32>>,
}

impl MemDevice {
    pub fn new(size: usize) -> Self {
        MemDevice {
            data: Rc::new(RefCell::new(vec![0; size])),
            read_delay: Rc::new(Cell::new(Duration::ZERO)),
            reads_done: Rc::new(Cell::new(0)),
        }
    }
}

impl BlockDevice for MemDevice {
    fn size_bytes(&self) -> u64 {
        self.data.borrow().len() as u64
    }
    async fn read(&self, offset: u64, length: u32) -> IoResult<Bytes> {
        check_range(offset, u64::from(length), self.size_bytes())?;
        let delay = self.read_delay.get();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let data = self.data.borrow();
        self.reads_done.set(self.reads_done.get() + 1);
        Ok(Bytes::copy_from_slice(
            &data[offset as usize..offset as usize + length as usize],
        ))
    }
    /// Without a read delay every read is "at hand", so the reader answers it itself.
    fn read_now(&self, offset: u64, length: u32) -> Option<IoResult<Bytes>> {
        if !self.read_delay.get().is_zero() {
            return None;
        }
        if let Err(error) = check_range(offset, u64::from(length), self.size_bytes()) {
            return Some(Err(error));
        }
        let data = self.data.borrow();
        self.reads_done.set(self.reads_done.get() + 1);
        let range = offset as usize..offset as usize + length as usize;
        Some(Ok(Bytes::copy_from_slice(&data[range])))
    }
    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> IoResult<()> {
        check_range(offset, data.len() as u64, self.size_bytes())?;
        self.data.borrow_mut()[offset as usize..offset as usize + data.len()]
            .copy_from_slice(&data);
        Ok(())
    }
    async fn flush(&self) -> IoResult<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, length: u32) -> IoResult<()> {
        self.write_zeroes(offset, length, true).await
    }
    async fn write_zeroes(&self, offset: u64, length: u32, _punch: bool) -> IoResult<()> {
        check_range(offset, u64::from(length), self.size_bytes())?;
        self.data.borrow_mut()[offset as usize..offset as usize + length as usize].fill(0);
        Ok(())
    }
    async fn block_status(&self, offset: u64, length: u32) -> IoResult<Vec<BlockStatusRun>> {
        check_range(offset, u64::from(length), self.size_bytes())?;
        Ok(vec![BlockStatusRun {
            length: u64::from(length),
            hole: false,
            zero: false,
        }])
    }
}

pub(crate) fn unit(size: usize) -> LogicalUnit<MemDevice> {
    LogicalUnit {
        device: MemDevice::new(size),
        name: "disk0".into(),
        id: 7,
        shared: Arc::new(LunReservations::default()),
    }
}

/// One target `iqn.t` open to `iqn.i` (with optional CHAP), one 1 MiB LUN that every
/// session of the registry shares (device and reservations).
pub(crate) struct TestRegistry {
    pub access: Access,
    /// What SendTargets discovery sessions must prove.
    pub discovery: Access,
    /// Why the target cannot be served now, if it cannot.
    pub unavailable: Option<TargetUnavailable>,
    pub device: MemDevice,
    pub shared: Arc<LunReservations>,
}

pub(crate) const TARGET: &str = "iqn.t";
pub(crate) const INITIATOR: &str = "iqn.i";

impl TestRegistry {
    pub fn open() -> Self {
        let lun = unit(1 << 20);
        TestRegistry {
            access: Access::default(),
            discovery: Access::default(),
            unavailable: None,
            device: lun.device,
            shared: lun.shared,
        }
    }
    pub fn chap(user: &str, secret: &str) -> Self {
        TestRegistry {
            access: Access {
                chap: Some(ChapCredentials {
                    user: user.into(),
                    secret: secret.into(),
                }),
                mutual_chap: None,
            },
            ..TestRegistry::open()
        }
    }
}

impl TargetRegistry for TestRegistry {
    type Device = MemDevice;
    fn discover(&self, initiator: &str) -> Vec<String> {
        if initiator == INITIATOR {
            vec![TARGET.into()]
        } else {
            vec![]
        }
    }
    fn authorize(&self, initiator: &str, target: &str) -> Result<Access, Refusal> {
        if target != TARGET {
            return Err(Refusal::UnknownTarget);
        }
        if initiator != INITIATOR {
            return Err(Refusal::NotAttached);
        }
        Ok(self.access.clone())
    }
    fn discovery_access(&self, _initiator: &str) -> Access {
        self.discovery.clone()
    }
    async fn prepare_target(&self, _target: &str) -> Result<(), TargetUnavailable> {
        self.unavailable.clone().map_or(Ok(()), Err)
    }
    fn open_luns(&self, target: &str) -> Result<Vec<LogicalUnit<MemDevice>>, String> {
        if target == TARGET {
            Ok(vec![LogicalUnit {
                device: self.device.clone(),
                shared: self.shared.clone(),
                ..unit(0)
            }])
        } else {
            Err("no such target".into())
        }
    }
}

/// One login PDU that goes from the operational stage straight to full feature phase with
/// no authentication: a whole login to [`TARGET`] as [`INITIATOR`].
pub(crate) fn login_request() -> Vec<u8> {
    login_request_isid(0)
}

/// [`login_request`] with `isid` as the last byte of the ISID (sessions differing by it are
/// different I_T nexuses).
pub(crate) fn login_request_isid(isid: u8) -> Vec<u8> {
    let mut bhs = Bhs::new(op::LOGIN);
    bhs.0[0] |= 0x40;
    bhs.set_flags(0x80 | (1 << 2) | 3); // operational -> full feature
    bhs.0[8] = 0x80;
    bhs.0[13] = isid;
    let text = format!("InitiatorName={INITIATOR}\0TargetName={TARGET}\0");
    pdu::encode(&Pdu::new(bhs, Bytes::from(text)), Digests::default()).to_vec()
}

/// How the server of [`against_server`] ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ServerEnd {
    Finished,
    Panicked,
    /// Still running 40 s after the client was done.
    Hung,
}

/// Runs `client` against one connection that [`serve_connection`](crate::serve_connection)
/// serves with `registry` on loopback, both on one current-thread runtime in a `LocalSet`
/// (as on a reactor). The client must close or drop its stream when done. Returns what the
/// client returned and how the server ended.
pub(crate) fn against_server<T, F>(
    registry: TestRegistry,
    limits: crate::IscsiLimits,
    client: impl FnOnce(tokio::net::TcpStream) -> F,
) -> (T, ServerEnd)
where
    F: std::future::Future<Output = T>,
{
    against_server_sessions(registry, limits, 1, |mut streams| {
        client(streams.pop().expect("one connection"))
    })
}

/// Like [`against_server`] with `count` connections to one server (one registry, so the
/// sessions share the logical unit), given to `client` in the order they were made. The
/// server ends when every connection has.
pub(crate) fn against_server_sessions<T, F>(
    registry: TestRegistry,
    limits: crate::IscsiLimits,
    count: usize,
    client: impl FnOnce(Vec<tokio::net::TcpStream>) -> F,
) -> (T, ServerEnd)
where
    F: std::future::Future<Output = T>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (_stop, shutdown) = tokio::sync::watch::channel(false);
        let server = tokio::task::spawn_local(async move {
            let registry = Rc::new(registry);
            let mut sessions = Vec::new();
            for _ in 0..count {
                let (stream, _) = listener.accept().await.unwrap();
                let serve = crate::serve_connection(
                    stream,
                    registry.clone(),
                    limits.clone(),
                    shutdown.clone(),
                );
                sessions.push(tokio::task::spawn_local(serve));
            }
            for session in sessions {
                // A session that panicked fails the server the same way.
                let _ = session.await.unwrap();
            }
        });
        let mut streams = Vec::new();
        for _ in 0..count {
            streams.push(tokio::net::TcpStream::connect(address).await.unwrap());
        }
        let out = client(streams).await;
        let end = match tokio::time::timeout(std::time::Duration::from_secs(40), server).await {
            Ok(Ok(_)) => ServerEnd::Finished,
            Ok(Err(_)) => ServerEnd::Panicked,
            Err(_) => ServerEnd::Hung,
        };
        (out, end)
    })
}
