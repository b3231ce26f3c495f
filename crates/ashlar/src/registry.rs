//! Connects the NBD front-end to the engine: export names are vdisk names. In a cluster a
//! vdisk another node owns is forwarded to it (`forwarding::NodeDevice`).

use crate::forwarding::NodeDevice;
use crate::ownership::NodeOwnership;
use ashlar_engine::vdisk::ConnectionGuard;
use ashlar_engine::{Engine, VdiskHandle};
use ashlar_nbd::{ExportInfo, ExportRegistry};
use std::cell::RefCell;
use std::sync::Arc;

pub type NodeEngine = Engine<crate::cluster::NodeMeta>;

pub struct EngineRegistry {
    pub engine: Arc<NodeEngine>,
    /// In a cluster, an export is served only once this node holds its ownership claim.
    pub ownership: NodeOwnership,
    /// A connection that moved here from another reactor: its count, handed to the first
    /// open of its vdisk, so the connection is never uncounted on the way.
    pub moved: RefCell<Option<ConnectionGuard>>,
}

impl EngineRegistry {
    pub fn new(engine: Arc<NodeEngine>, ownership: NodeOwnership) -> Self {
        EngineRegistry {
            engine,
            ownership,
            moved: RefCell::new(None),
        }
    }

    /// The registry a moved connection resumes with on its new reactor.
    pub fn for_moved(
        engine: Arc<NodeEngine>,
        ownership: NodeOwnership,
        guard: ConnectionGuard,
    ) -> Self {
        EngineRegistry {
            engine,
            ownership,
            moved: RefCell::new(Some(guard)),
        }
    }
}

impl ExportRegistry for EngineRegistry {
    type Device = NodeDevice;

    fn list_exports(&self) -> Vec<ExportInfo> {
        self.engine
            .list_vdisks()
            .into_iter()
            .map(|v| ExportInfo {
                description: format!(
                    "Ashlar vdisk {} ({} bytes, {} shards)",
                    v.name, v.size_bytes, v.shards
                ),
                name: v.name,
            })
            .collect()
    }

    /// The empty name (the NBD default export) means the only vdisk, when there is one.
    /// In a cluster the vdisk is claimed first, or forwarded to the node that owns it (or
    /// the open refused, saying why).
    async fn open_export(&self, name: &str) -> Result<NodeDevice, String> {
        if let Some(guard) = self.moved.borrow_mut().take() {
            // The connection was served on another reactor of this node a moment ago.
            if guard.is_closing() {
                return Err(format!("vdisk {name} is being deleted"));
            }
            let handle = VdiskHandle::from_moved(guard);
            return NodeDevice::moved(self.engine.clone(), self.ownership.clone(), handle);
        }
        let name = if name.is_empty() {
            let vdisks = self.engine.list_vdisks();
            match vdisks.as_slice() {
                [only] => only.name.clone(),
                _ => {
                    return Err(format!(
                        "no default export: name one of the {} vdisks (nbdinfo --list)",
                        vdisks.len()
                    ))
                }
            }
        } else {
            name.to_string()
        };
        NodeDevice::open(self.engine.clone(), self.ownership.clone(), &name).await
    }
}
