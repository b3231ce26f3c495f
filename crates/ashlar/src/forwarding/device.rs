//! The block device a front-end connection of this node uses: the vdisk's local handle while
//! this node owns it, else a forwarder to the node that does. A request refused as "not
//! served here" (this node lost the claim, or the owner gave the vdisk up or cannot be
//! reached) finds the vdisk's server again and is tried once more there.

use super::migration::Activity;
use super::wire::{self, ForwardMessage, ForwardOp};
use crate::ownership::{Frontend, NodeOwnership, ServedBy};
use crate::registry::NodeEngine;
use crate::replication::Peer;
use ashlar_cluster::NodeId;
use ashlar_core::{check_range, BlockDevice, BlockStatusRun, IoError, IoResult, VdiskId};
use ashlar_engine::vdisk::VdiskShared;
use ashlar_engine::VdiskHandle;
use ashlar_transport::TransportError;
use bytes::{Bytes, BytesMut};
use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How long the owner may take to answer one forwarded request.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(30);
/// Forwarded reads and writes go in pieces of at most this many bytes, all in flight at once
/// (the node-to-node frame limit is 16 MiB).
pub const FORWARD_PIECE_BYTES: u32 = 4 << 20;
/// How long an owner may take to hand a vdisk over (its writes in flight settle first).
pub const HAND_OVER_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a request refused as "not served here" keeps finding the vdisk's server.
pub const REROUTE_WINDOW: Duration = Duration::from_secs(5);
const REROUTE_FIRST_PAUSE: Duration = Duration::from_millis(20);
const REROUTE_MAX_PAUSE: Duration = Duration::from_millis(500);

/// Where a connection's requests go now.
enum Route {
    Here(VdiskHandle),
    Owner(Forwarded),
}

struct Forwarded {
    node: NodeId,
    peer: Arc<Peer>,
    activity: Arc<Activity>,
}

/// A front-end connection's vdisk, served here or forwarded.
#[derive(Clone)]
pub struct NodeDevice(Rc<Routed>);

struct Routed {
    name: String,
    vdisk: VdiskId,
    /// This node's state of the vdisk: its size, also while forwarding.
    shared: Arc<VdiskShared>,
    route: RefCell<Rc<Route>>,
    engine: Arc<NodeEngine>,
    ownership: NodeOwnership,
    /// One re-route at a time; requests that failed meanwhile use its result.
    rerouting: tokio::sync::Mutex<()>,
}

impl NodeDevice {
    /// Opens `name` for a client of this node: served here if this node may claim it, else
    /// forwarded to its owner. The error is the line the client is shown.
    pub async fn open(
        engine: Arc<NodeEngine>,
        ownership: NodeOwnership,
        name: &str,
    ) -> Result<NodeDevice, String> {
        let route = resolve(&engine, &ownership, name)
            .await
            .map_err(|e| e.to_string())?;
        NodeDevice::with_route(engine, ownership, name, route)
    }

    /// The device of a connection that moved here from another reactor of this node with
    /// the vdisk's local handle.
    pub fn moved(
        engine: Arc<NodeEngine>,
        ownership: NodeOwnership,
        handle: VdiskHandle,
    ) -> Result<NodeDevice, String> {
        let name = handle.name().to_string();
        NodeDevice::with_route(engine, ownership, &name, Route::Here(handle))
    }

    fn with_route(
        engine: Arc<NodeEngine>,
        ownership: NodeOwnership,
        name: &str,
        route: Route,
    ) -> Result<NodeDevice, String> {
        let shared = engine.vdisk_shared(name).map_err(|e| e.to_string())?;
        Ok(NodeDevice(Rc::new(Routed {
            name: name.to_string(),
            vdisk: shared.id,
            shared,
            route: RefCell::new(Rc::new(route)),
            engine,
            ownership,
            rerouting: tokio::sync::Mutex::new(()),
        })))
    }

    /// The local handle while this node serves the vdisk (`None` while forwarding).
    pub fn local_handle(&self) -> Option<VdiskHandle> {
        match &**self.0.route.borrow() {
            Route::Here(handle) => Some(handle.clone()),
            Route::Owner(_) => None,
        }
    }
}

/// Where `name` is served for a new route.
async fn resolve(
    engine: &Arc<NodeEngine>,
    ownership: &NodeOwnership,
    name: &str,
) -> Result<Route, String> {
    match ownership
        .route(engine, name, Frontend::Nbd)
        .await
        .map_err(|refused| refused.message)?
    {
        ServedBy::Here => Ok(Route::Here(engine.open(name).map_err(|e| e.to_string())?)),
        ServedBy::Owner { node, peer } => {
            let vdisk = engine.vdisk_shared(name).map_err(|e| e.to_string())?.id;
            Ok(Route::Owner(Forwarded {
                node,
                peer,
                activity: ownership.migrations().activity(vdisk),
            }))
        }
    }
}

impl Routed {
    /// Runs `op` on the current route; a "not served here" failure re-routes and runs it
    /// again on the new route, for up to [`REROUTE_WINDOW`] (an owner handing the vdisk
    /// over refuses requests for a moment before etcd shows it released).
    async fn run<T, F, Fut>(&self, op: F) -> IoResult<T>
    where
        F: Fn(Rc<Route>) -> Fut,
        Fut: Future<Output = IoResult<T>>,
    {
        let started = std::time::Instant::now();
        let mut pause = REROUTE_FIRST_PAUSE;
        let mut route = self.route.borrow().clone();
        let mut first = true;
        loop {
            match op(route.clone()).await {
                Err(IoError::NotServing(reason)) if started.elapsed() < REROUTE_WINDOW => {
                    if !first {
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(REROUTE_MAX_PAUSE);
                    }
                    first = false;
                    route = self.reroute(&route, reason).await?;
                }
                other => return other,
            }
        }
    }

    async fn reroute(&self, failed: &Rc<Route>, reason: String) -> IoResult<Rc<Route>> {
        let _one_at_a_time = self.rerouting.lock().await;
        let current = self.route.borrow().clone();
        if !Rc::ptr_eq(&current, failed) {
            return Ok(current);
        }
        let route = resolve(&self.engine, &self.ownership, &self.name)
            .await
            .map_err(|message| IoError::NotServing(format!("{reason}; {message}")))?;
        match (&**failed, &route) {
            (Route::Here(_), Route::Owner(to)) => {
                tracing::info!(vdisk = %self.name, owner = %to.node, %reason,
                    "this node no longer serves the vdisk; forwarding its client's requests to the owner")
            }
            (Route::Owner(from), Route::Here(_)) => {
                tracing::info!(vdisk = %self.name, from = %from.node,
                    "serving the vdisk here now (it was forwarded)")
            }
            (Route::Owner(from), Route::Owner(to)) if from.node != to.node => {
                tracing::info!(vdisk = %self.name, from = %from.node, to = %to.node,
                    "the vdisk's owner changed; forwarding to the new one")
            }
            _ => {}
        }
        let route = Rc::new(route);
        *self.route.borrow_mut() = route.clone();
        Ok(route)
    }

    fn check(&self, offset: u64, length: u64) -> IoResult<()> {
        check_range(
            offset,
            length,
            self.shared.size_bytes.load(Ordering::Relaxed),
        )
    }

    /// One forwarded request; notes it for migration.
    async fn forward(&self, to: &Forwarded, offset: u64, op: ForwardOp) -> IoResult<Bytes> {
        if self.ownership.migrations().note(&to.activity) {
            self.start_move(to);
        }
        let payload = wire::encode(&ForwardMessage::Io {
            vdisk: self.vdisk,
            offset,
            op,
        });
        match to.peer.call(payload, FORWARD_TIMEOUT).await {
            Ok(answer) => Ok(answer),
            Err(TransportError::Remote(remote)) => Err(wire::io_error(
                remote.code,
                format!("owner node {}: {}", to.node, remote.message),
            )),
            // The owner may be gone: find the vdisk's server again.
            Err(error) => Err(IoError::NotServing(format!(
                "vdisk {}: its owner node {} did not answer: {error}",
                self.name, to.node
            ))),
        }
    }

    async fn forward_read(&self, to: &Forwarded, offset: u64, length: u32) -> IoResult<Bytes> {
        let pieces = pieces(offset, length);
        let reads = pieces
            .iter()
            .map(|&(at, len)| self.forward(to, at, ForwardOp::Read { length: len }));
        let mut joined = BytesMut::with_capacity(length as usize);
        for piece in futures_util::future::join_all(reads).await {
            joined.extend_from_slice(&piece?);
        }
        if joined.len() != length as usize {
            return Err(IoError::Io(format!(
                "owner node {} answered a read of {length} bytes with {}",
                to.node,
                joined.len()
            )));
        }
        Ok(joined.freeze())
    }

    async fn forward_write(
        &self,
        to: &Forwarded,
        offset: u64,
        data: &Bytes,
        fua: bool,
    ) -> IoResult<()> {
        let writes = pieces(offset, data.len() as u32)
            .into_iter()
            .map(|(at, len)| {
                let start = (at - offset) as usize;
                let data = data.slice(start..start + len as usize);
                self.forward(to, at, ForwardOp::Write { data, fua })
            });
        for written in futures_util::future::join_all(writes).await {
            written?;
        }
        Ok(())
    }

    /// Asks the owner to hand the vdisk over, then claims it here (`docs/forwarding.md`).
    fn start_move(&self, to: &Forwarded) {
        let (engine, ownership, name) = (
            self.engine.clone(),
            self.ownership.clone(),
            self.name.clone(),
        );
        let (vdisk, node, peer, activity) =
            (self.vdisk, to.node, to.peer.clone(), to.activity.clone());
        self.ownership.spawn_on_control(async move {
            let moved = move_here(&engine, &ownership, &name, vdisk, node, &peer).await;
            if !moved {
                ownership.migrations().restart(&activity);
            }
        });
    }
}

/// Cuts `[offset, offset + length)` into forwarding pieces (one piece when empty).
fn pieces(offset: u64, length: u32) -> Vec<(u64, u32)> {
    let mut out = Vec::with_capacity(1);
    let mut at = 0u32;
    loop {
        let len = (length - at).min(FORWARD_PIECE_BYTES);
        out.push((offset + u64::from(at), len));
        at += len;
        if at >= length {
            return out;
        }
    }
}

/// Moves the vdisk's ownership here; whether it did.
async fn move_here(
    engine: &Arc<NodeEngine>,
    ownership: &NodeOwnership,
    name: &str,
    vdisk: VdiskId,
    owner: NodeId,
    peer: &Peer,
) -> bool {
    match engine.vdisk(name) {
        Ok(info) if info.replication_factor > 1 => {}
        Ok(_) => {
            tracing::debug!(
                vdisk = name,
                "sustained forwarded I/O, but the vdisk's one copy is on its owner: it stays there"
            );
            return false;
        }
        Err(_) => return false,
    }
    tracing::info!(vdisk = name, %owner,
        "this node has forwarded the vdisk's client I/O for a while; asking its owner to hand it over");
    let ask = wire::encode(&ForwardMessage::HandOver {
        vdisk,
        asker: ownership.node_id(),
    });
    if let Err(error) = peer.call(ask, HAND_OVER_TIMEOUT).await {
        tracing::info!(vdisk = name, %owner, %error, "the owner keeps the vdisk");
        return false;
    }
    match ownership.ensure_serving(engine, name, Frontend::Nbd).await {
        Ok(()) => {
            tracing::info!(vdisk = name, from = %owner, "vdisk ownership moved here, next to its clients");
            true
        }
        Err(refused) => {
            tracing::warn!(vdisk = name, reason = %refused.message,
                "the owner handed the vdisk over but this node could not claim it");
            false
        }
    }
}

impl BlockDevice for NodeDevice {
    fn size_bytes(&self) -> u64 {
        match &**self.0.route.borrow() {
            Route::Here(handle) => handle.size_bytes(),
            Route::Owner(_) => self.0.shared.size_bytes.load(Ordering::Relaxed),
        }
    }

    async fn read(&self, offset: u64, length: u32) -> IoResult<Bytes> {
        let routed = &self.0;
        routed.check(offset, u64::from(length))?;
        routed
            .run(|route| async move {
                match &*route {
                    Route::Here(handle) => handle.read(offset, length).await,
                    Route::Owner(to) => routed.forward_read(to, offset, length).await,
                }
            })
            .await
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> IoResult<()> {
        let routed = &self.0;
        routed.check(offset, data.len() as u64)?;
        let data = &data;
        routed
            .run(|route| async move {
                match &*route {
                    Route::Here(handle) => handle.write(offset, data.clone(), fua).await,
                    Route::Owner(to) => routed.forward_write(to, offset, data, fua).await,
                }
            })
            .await
    }

    async fn flush(&self) -> IoResult<()> {
        let routed = &self.0;
        routed
            .run(|route| async move {
                match &*route {
                    Route::Here(handle) => handle.flush().await,
                    Route::Owner(to) => routed.forward(to, 0, ForwardOp::Flush).await.map(drop),
                }
            })
            .await
    }

    async fn trim(&self, offset: u64, length: u32) -> IoResult<()> {
        let routed = &self.0;
        routed.check(offset, u64::from(length))?;
        routed
            .run(|route| async move {
                match &*route {
                    Route::Here(handle) => handle.trim(offset, length).await,
                    Route::Owner(to) => routed
                        .forward(to, offset, ForwardOp::Trim { length })
                        .await
                        .map(drop),
                }
            })
            .await
    }

    async fn write_zeroes(&self, offset: u64, length: u32, may_punch_hole: bool) -> IoResult<()> {
        let routed = &self.0;
        routed.check(offset, u64::from(length))?;
        routed
            .run(|route| async move {
                match &*route {
                    Route::Here(handle) => {
                        handle.write_zeroes(offset, length, may_punch_hole).await
                    }
                    Route::Owner(to) => {
                        let op = ForwardOp::WriteZeroes {
                            length,
                            may_punch_hole,
                        };
                        routed.forward(to, offset, op).await.map(drop)
                    }
                }
            })
            .await
    }

    fn read_now(&self, offset: u64, length: u32) -> Option<IoResult<Bytes>> {
        match &**self.0.route.borrow() {
            Route::Here(handle) => handle.read_now(offset, length),
            Route::Owner(_) => None,
        }
    }

    async fn block_status(&self, offset: u64, length: u32) -> IoResult<Vec<BlockStatusRun>> {
        let routed = &self.0;
        routed.check(offset, u64::from(length))?;
        routed
            .run(|route| async move {
                match &*route {
                    Route::Here(handle) => handle.block_status(offset, length).await,
                    Route::Owner(to) => {
                        let answer = routed
                            .forward(to, offset, ForwardOp::BlockStatus { length })
                            .await?;
                        wire::decode_runs(&answer)
                            .map_err(|e| IoError::Io(format!("owner node {}: {e}", to.node)))
                    }
                }
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_range_in_order() {
        assert_eq!(pieces(100, 0), vec![(100, 0)]);
        assert_eq!(pieces(0, 4096), vec![(0, 4096)]);
        let piece = FORWARD_PIECE_BYTES;
        assert_eq!(
            pieces(512, 2 * piece + 7),
            vec![
                (512, piece),
                (512 + u64::from(piece), piece),
                (512 + 2 * u64::from(piece), 7)
            ]
        );
    }
}
