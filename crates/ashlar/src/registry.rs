//! Connects the NBD front-end to the engine: export names are vdisk names.

use ashlar_engine::{Engine, VdiskHandle};
use ashlar_meta::EmbeddedMetaStore;
use ashlar_nbd::{ExportInfo, ExportRegistry};
use std::sync::Arc;

pub type NodeEngine = Engine<EmbeddedMetaStore>;

pub struct EngineRegistry {
    pub engine: Arc<NodeEngine>,
}

impl ExportRegistry for EngineRegistry {
    type Device = VdiskHandle;

    fn list_exports(&self) -> Vec<ExportInfo> {
        self.engine
            .list_vdisks()
            .into_iter()
            .map(|v| ExportInfo {
                description: format!("Ashlar vdisk {} ({} bytes, {} shards)", v.name, v.size_bytes, v.shards),
                name: v.name,
            })
            .collect()
    }

    fn open_export(&self, name: &str) -> Result<VdiskHandle, String> {
        self.engine.open(name).map_err(|e| e.to_string())
    }
}
