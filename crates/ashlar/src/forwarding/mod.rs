//! Any node serves a client of any vdisk (docs/forwarding.md): a node that does not own the
//! vdisk forwards its client's requests to the owner over the node-to-node protocol, and
//! asks for the vdisk once it has carried its I/O for a while (ownership follows the client).
//!
//! - `wire`: the forwarding messages inside node-to-node payloads.
//! - `device`: the block device of a front-end connection, served here or forwarded.
//! - `server`: the owner's side, which runs forwarded requests and hands vdisks over.
//! - `migration`: when sustained forwarded I/O moves a vdisk here.

pub mod device;
pub mod migration;
mod server;
pub mod wire;

pub use device::NodeDevice;
pub use migration::Migrations;
pub use server::ForwardServer;
