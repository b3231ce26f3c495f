//! Connects the iSCSI front-end to the engine: one target per volume group, its vdisks as
//! LUNs, claimed (in a cluster) as an initiator logs in; the accept loop of the iSCSI
//! portal; the limits from the command line; persistent reservations in the MetaStore
//! (`reservations`); each target's preferred node and failback to it (`failback`).

pub mod failback;
pub mod reservations;

use crate::args::NodeArgs;
use crate::node::{ConnectionCount, ConnectionTicket, Refusals};
use crate::ownership::{GroupNotServed, NodeOwnership};
use crate::registry::NodeEngine;
use crate::volume_groups::VolumeGroups;
use anyhow::{anyhow, bail, Result};
use ashlar_core::parse_size;
use ashlar_engine::reactor::ReactorId;
use ashlar_engine::VdiskHandle;
use ashlar_iscsi::{
    resume, serve_or_hand_over, Access, ChapCredentials, DataBudget, Handover, IscsiLimits,
    LogicalUnit, NopSettings, Refusal, ReservationStore, TargetRegistry, TargetUnavailable,
};
use failback::Failback;
use reservations::MetaReservations;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

pub type NodeVolumeGroups = VolumeGroups<crate::cluster::NodeMeta>;

/// The iSCSI limits of every session; clones share the node's data budget.
pub fn iscsi_limits(args: &NodeArgs) -> Result<IscsiLimits> {
    let size = |flag: &str, text: &str, min: u64, max: u64| -> Result<u64> {
        let value = parse_size(text).map_err(|e| anyhow!("{flag}: {e}"))?;
        if !(min..=max).contains(&value) {
            bail!(
                "{flag} must be between {} and {}",
                ashlar_core::format_size(min),
                ashlar_core::format_size(max)
            );
        }
        Ok(value)
    };
    let segment_max = (1 << 24) - 1;
    let max_burst = size("--iscsi-max-burst", &args.iscsi_max_burst, 512, segment_max)?;
    let first_burst = size(
        "--iscsi-first-burst",
        &args.iscsi_first_burst,
        512,
        max_burst,
    )?;
    if args.iscsi_max_commands == 0 || args.iscsi_max_commands > 65536 {
        bail!("--iscsi-max-commands must be between 1 and 65536");
    }
    Ok(IscsiLimits {
        max_commands_in_flight: args.iscsi_max_commands,
        max_recv_data_segment_bytes: size(
            "--iscsi-max-recv-segment",
            &args.iscsi_max_recv_segment,
            512,
            segment_max,
        )? as u32,
        max_burst_bytes: max_burst as u32,
        first_burst_bytes: first_burst as u32,
        max_transfer_bytes: size(
            "--iscsi-max-transfer",
            &args.iscsi_max_transfer,
            4096,
            1 << 30,
        )? as u32,
        nop: nop_settings(args)?,
        data_budget: DataBudget::new(size(
            "--iscsi-data-budget",
            &args.iscsi_data_budget,
            1 << 20,
            1 << 40,
        )?),
        ..IscsiLimits::default()
    })
}

/// NOP-In pings from the flags: none when the interval is 0.
fn nop_settings(args: &NodeArgs) -> Result<Option<NopSettings>> {
    const MAX_SECONDS: u64 = 3600;
    if args.iscsi_nop_interval_s > MAX_SECONDS {
        bail!("--iscsi-nop-interval-s must be at most {MAX_SECONDS}");
    }
    if !(1..=MAX_SECONDS).contains(&args.iscsi_nop_timeout_s) {
        bail!("--iscsi-nop-timeout-s must be between 1 and {MAX_SECONDS}");
    }
    Ok((args.iscsi_nop_interval_s > 0).then(|| NopSettings {
        interval: Duration::from_secs(args.iscsi_nop_interval_s),
        timeout: Duration::from_secs(args.iscsi_nop_timeout_s),
    }))
}

fn credentials(chap: &crate::volume_groups::Chap) -> ChapCredentials {
    ChapCredentials {
        user: chap.user.clone(),
        secret: chap.secret.clone(),
    }
}

/// Targets, access and LUNs from the node's volume groups and vdisks.
#[derive(Clone)]
pub struct IscsiRegistry {
    pub engine: Arc<NodeEngine>,
    pub groups: NodeVolumeGroups,
    pub reservations: Arc<MetaReservations<crate::cluster::NodeMeta>>,
    /// In a cluster, a target is served only once this node holds its vdisks' claims.
    pub ownership: NodeOwnership,
    /// In a cluster: the preferred-node rule at login, and failback.
    pub failback: Option<Arc<Failback>>,
}

impl IscsiRegistry {
    /// Whether this node serves every vdisk of the group now (all gates open).
    fn serves_all(&self, disks: &[String]) -> bool {
        let now = std::time::Instant::now();
        disks.iter().all(|name| {
            self.engine
                .serve_gate(name)
                .is_ok_and(|(_, gate)| gate.admits(now))
        })
    }

    /// Cluster mode, at a login: reads the units' reservation records again, so commands
    /// are checked against what the store holds (another node may have served them).
    async fn reload_reservations(&self, disks: &[String]) -> Result<(), String> {
        for name in disks {
            let info = self.engine.vdisk(name).map_err(|e| e.to_string())?;
            let changed = self
                .reservations
                .reload(info.id.0)
                .await
                .map_err(|e| format!("vdisk {name}: {e}"))?;
            if changed {
                tracing::info!(vdisk = %name,
                    "persistent reservations read again from the metadata store at login (changed elsewhere)");
            }
        }
        Ok(())
    }
}

impl TargetRegistry for IscsiRegistry {
    type Device = VdiskHandle;

    fn discover(&self, initiator: &str) -> Vec<String> {
        self.groups
            .list()
            .into_iter()
            .filter(|g| g.attachment(initiator).is_some())
            .map(|g| g.iqn())
            .collect()
    }

    fn authorize(&self, initiator: &str, target: &str) -> Result<Access, Refusal> {
        let group = self.groups.by_iqn(target).ok_or(Refusal::UnknownTarget)?;
        let attachment = group.attachment(initiator).ok_or(Refusal::NotAttached)?;
        Ok(Access {
            chap: attachment.chap.as_ref().map(credentials),
            mutual_chap: attachment.mutual_chap.as_ref().map(credentials),
        })
    }

    fn discovery_access(&self, _initiator: &str) -> Access {
        let auth = self.groups.discovery_auth();
        Access {
            chap: auth.chap.as_ref().map(credentials),
            mutual_chap: auth.mutual_chap.as_ref().map(credentials),
        }
    }

    /// In a cluster: claims the group's vdisks, or redirects the login to the node that
    /// owns them (or to the target's preferred node when nobody does), or turns it away
    /// (logged: the initiator sees only the status). Then reads the units' persistent
    /// reservations again, before the login is answered.
    async fn prepare_target(&self, target: &str) -> Result<(), TargetUnavailable> {
        let Some(group) = self.groups.by_iqn(target) else {
            return Ok(()); // removed since it was authorized: the session finds no target
        };
        let mut fresh = false;
        if let Some(failback) = &self.failback {
            failback.wait_hand_back(target).await;
            fresh = !self.serves_all(&group.disks);
            if fresh {
                match failback.login_redirect(&self.engine, &group).await {
                    Ok(None) => {}
                    Ok(Some((node, address))) => {
                        tracing::info!(%target, preferred = %node, portal = %address,
                            "iSCSI login redirected to the target's preferred node (nobody serves the target)");
                        return Err(TargetUnavailable::MovedTemporarily { address });
                    }
                    Err(error) => {
                        tracing::warn!(%target, %error,
                            "iSCSI login refused (service unavailable): cannot read the target's preferred node");
                        return Err(TargetUnavailable::ServiceUnavailable);
                    }
                }
            }
        }
        let served = self
            .ownership
            .ensure_serving_group(&self.engine, &group.disks)
            .await;
        match served {
            Ok(()) => {}
            Err(GroupNotServed::ServedBy {
                node,
                addresses: Some(addresses),
            }) => {
                tracing::info!(%target, owner = %node, portal = %addresses.iscsi,
                    "iSCSI login redirected to the node that owns the target's vdisks");
                return Err(TargetUnavailable::MovedTemporarily {
                    address: addresses.iscsi,
                });
            }
            Err(refused) => {
                tracing::warn!(%target, reason = %refused,
                    "iSCSI login refused (service unavailable): this node cannot serve the target now");
                return Err(TargetUnavailable::ServiceUnavailable);
            }
        }
        if let Some(failback) = &self.failback {
            if fresh {
                failback.claimed(&group.name).await;
            }
            if let Err(error) = self.reload_reservations(&group.disks).await {
                tracing::warn!(%target, %error,
                    "iSCSI login refused (service unavailable): cannot read the target's persistent reservations");
                return Err(TargetUnavailable::ServiceUnavailable);
            }
        }
        Ok(())
    }

    fn open_luns(&self, target: &str) -> Result<Vec<LogicalUnit<VdiskHandle>>, String> {
        let group = self
            .groups
            .by_iqn(target)
            .ok_or_else(|| format!("target {target} no longer exists"))?;
        group
            .disks
            .iter()
            .map(|name| {
                let info = self.engine.vdisk(name).map_err(|e| e.to_string())?;
                let device = self.engine.open(name).map_err(|e| e.to_string())?;
                Ok(LogicalUnit {
                    device,
                    name: name.clone(),
                    id: info.id.0,
                    shared: self.reservations.unit(info.id.0),
                })
            })
            .collect()
    }
}

/// The persistent reservations, loaded before any session is served (a session must not run
/// without them). While the metadata store cannot answer (etcd down), says so once and
/// retries: the node stays up and serves NBD meanwhile; iSCSI logins wait in the backlog.
async fn load_reservations(
    groups: &NodeVolumeGroups,
    ownership: &NodeOwnership,
    mut shutdown: watch::Receiver<bool>,
) -> Result<MetaReservations<crate::cluster::NodeMeta>> {
    let mut warned = false;
    // Changes are fenced by the vdisks' ownership claims (nothing to fence on one node).
    let fence: Arc<dyn reservations::ServingClaims> = Arc::new(ownership.clone());
    loop {
        match MetaReservations::load_fenced(groups.meta().clone(), Some(fence.clone())).await {
            Ok(reservations) => {
                if warned {
                    tracing::info!("iSCSI persistent reservations loaded; the portal serves");
                }
                return Ok(reservations);
            }
            Err(error) if !warned => {
                tracing::warn!(%error, "cannot load iSCSI persistent reservations; the portal waits and retries every 2 s");
                warned = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            _ = shutdown.changed() => bail!("stopped while loading iSCSI persistent reservations"),
        }
    }
}

/// Cluster mode: which logical units this node serves anew with each claim it makes, so
/// that their I_T nexuses are told (UNIT ATTENTION 29/00) as after a power on. A claim
/// continues this node's serving only if its epoch is the one right after the epoch this
/// node last held (every claim raises the epoch, so nobody else claimed in between). Any
/// other claim, the first on this node included, may follow another node's serving: the
/// unit attentions, RESERVE(6) and task state that node held are gone, and the nexuses must
/// look again.
struct ServedAnew {
    /// The last epoch this node claimed each unit (vdisk id) at.
    last_epoch: std::sync::Mutex<std::collections::HashMap<u64, u64>>,
    reservations: Arc<MetaReservations<crate::cluster::NodeMeta>>,
}

impl ServedAnew {
    fn claimed(&self, vdisk: ashlar_core::VdiskId, epoch: ashlar_cluster::OwnershipEpoch) {
        let previous = self
            .last_epoch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(vdisk.0, epoch.0);
        if continues(previous, epoch.0) {
            return;
        }
        self.reservations.unit(vdisk.0).served_anew();
        tracing::info!(%vdisk, %epoch, previous_here = ?previous,
            "iSCSI unit served anew on this node: each I_T nexus's next command gets UNIT ATTENTION (29/00 power on, reset)");
    }
}

/// Whether a claim at `epoch` continues this node's serving that last held `previous` (the
/// same claim told again, or the next epoch).
fn continues(previous: Option<u64>, epoch: u64) -> bool {
    previous.is_some_and(|last| last == epoch || last.checked_add(1) == Some(epoch))
}

/// An iSCSI session on its way to the reactor that runs its target's shards.
struct MovingSession {
    handover: Handover,
    ticket: ConnectionTicket,
    registry: IscsiRegistry,
    shutdown: watch::Receiver<bool>,
}

fn move_session(moving: MovingSession, target: ReactorId) {
    let reactor = moving.registry.engine.reactors().get(target).clone();
    let moved = reactor.spawn_detached(move || async move {
        let MovingSession {
            handover,
            ticket,
            registry,
            shutdown,
        } = moving;
        let _ticket = ticket;
        if let Err(error) = resume(handover, Rc::new(registry), shutdown).await {
            tracing::info!(%error, "iSCSI connection ended with an error");
        }
    });
    match moved {
        Ok(()) => tracing::info!(reactor = target.0, "iSCSI session moved next to its shards"),
        Err(_) => tracing::warn!("reactor queue full; iSCSI connection dropped"),
    }
}

/// What the portal's targets are made of: the node's vdisks, its volume groups, and (in a
/// cluster) the ownership layer that claims a target's vdisks at login, with this node's
/// id and failback setting.
pub struct Targets {
    pub engine: Arc<NodeEngine>,
    pub groups: NodeVolumeGroups,
    pub ownership: NodeOwnership,
    pub cluster: Option<ClusterTargets>,
}

/// The cluster part of [`Targets`].
pub struct ClusterTargets {
    pub node: ashlar_cluster::NodeId,
    /// `None`: no failback (`--iscsi-failback-after-s 0`).
    pub failback_after: Option<Duration>,
}

/// `--iscsi-failback-after-s`: `None` when 0 (failback off).
pub fn failback_after(args: &NodeArgs) -> Result<Option<Duration>> {
    if args.iscsi_failback_after_s > failback::MAX_FAILBACK_AFTER_S {
        bail!(
            "--iscsi-failback-after-s must be at most {}",
            failback::MAX_FAILBACK_AFTER_S
        );
    }
    Ok((args.iscsi_failback_after_s > 0).then(|| Duration::from_secs(args.iscsi_failback_after_s)))
}

/// Accepts iSCSI connections and serves each on a reactor, round-robin (one session per
/// connection: MaxConnections=1); once logged in, a session whose first LUN's shards run on
/// another reactor moves there. With `max_sessions` live, a new connection is closed at
/// once.
pub async fn accept_loop(
    listener: TcpListener,
    targets: Targets,
    limits: IscsiLimits,
    shutdown: watch::Receiver<bool>,
    sessions: Arc<ConnectionCount>,
    max_sessions: usize,
) -> Result<()> {
    let Targets {
        engine,
        groups,
        ownership,
        cluster,
    } = targets;
    let reservations = Arc::new(load_reservations(&groups, &ownership, shutdown.clone()).await?);
    let failback = cluster.map(|cluster| {
        // Every node's copy of the reservations follows the store.
        tokio::spawn(reservations::follow_changes(reservations.clone()));
        let served_anew = ServedAnew {
            last_epoch: Default::default(),
            reservations: reservations.clone(),
        };
        ownership.on_claimed(Arc::new(move |vdisk, epoch| {
            served_anew.claimed(vdisk, epoch)
        }));
        let failback = Arc::new(Failback::new(
            groups.meta().clone(),
            cluster.node,
            cluster.failback_after,
            limits.sessions.clone(),
        ));
        if failback.enabled() {
            tokio::spawn(
                failback
                    .clone()
                    .run(engine.clone(), groups.clone(), ownership.clone()),
            );
        }
        failback
    });
    let registry = IscsiRegistry {
        engine,
        groups,
        reservations,
        ownership,
        failback,
    };
    let mut next_reactor = 0usize;
    let mut refusals = Refusals::new("iSCSI session", "--iscsi-max-sessions");
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "iSCSI accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if sessions.live() >= max_sessions {
            refusals.refused(peer, max_sessions);
            drop(stream);
            continue;
        }
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%peer, %error, "cannot hand over iSCSI connection");
                continue;
            }
        };
        let reactors = registry.engine.reactors().handles();
        let reactor = &reactors[next_reactor % reactors.len()];
        next_reactor += 1;
        sessions.live.fetch_add(1, Ordering::SeqCst);
        let ticket = ConnectionTicket(sessions.clone());
        let registry = registry.clone();
        let limits = limits.clone();
        let shutdown = shutdown.clone();
        let spawned = reactor.spawn_detached(move || async move {
            let stream = match tokio::net::TcpStream::from_std(std_stream) {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::warn!(%peer, %error, "cannot register iSCSI connection");
                    return;
                }
            };
            let serving = Rc::new(registry.clone());
            // A session whose first LUN's shards run on another reactor moves there after
            // its login: served here, every command would cross reactors.
            let mut better = None;
            let stay = |device: &VdiskHandle| {
                better = device.better_reactor();
                better.is_none()
            };
            let served = serve_or_hand_over(stream, serving, limits, shutdown.clone(), stay).await;
            match (served, better) {
                (Ok(Some(handover)), Some(target)) => {
                    let moving = MovingSession {
                        handover,
                        ticket,
                        registry,
                        shutdown,
                    };
                    move_session(moving, target);
                }
                (Ok(_), _) => {}
                (Err(error), _) => {
                    tracing::info!(%peer, %error, "iSCSI connection ended with an error")
                }
            }
        });
        if spawned.is_err() {
            tracing::warn!(%peer, "reactor queue full; iSCSI connection dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::continues;

    #[test]
    fn only_the_next_epoch_continues_this_nodes_serving() {
        assert!(!continues(None, 1), "the first claim here");
        assert!(continues(Some(4), 5), "claimed again, nobody in between");
        assert!(continues(Some(5), 5), "the same claim told twice");
        assert!(!continues(Some(4), 6), "another claim came in between");
        assert!(!continues(Some(u64::MAX), 0));
    }
}
