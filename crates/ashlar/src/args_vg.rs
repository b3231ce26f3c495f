//! Command-line arguments of `ashlar vg`.

use clap::Subcommand;

#[derive(Subcommand, Debug)]
pub enum VgCommand {
    /// Create an empty volume group; its iSCSI target is iqn.2024-01.io.ashlar:NAME.
    Create { name: String },
    /// Add a vdisk as the group's next LUN (LUN order is the order disks were added).
    AddDisk { name: String, vdisk: String },
    /// Remove a vdisk from the group (later LUNs move down by one at the next login).
    RemoveDisk { name: String, vdisk: String },
    /// Allow an initiator to discover and log in to the group's target.
    Attach {
        name: String,
        /// The initiator's iSCSI name (on Linux: /etc/iscsi/initiatorname.iscsi).
        #[arg(long, value_name = "IQN")]
        initiator: String,
        /// Require CHAP: the initiator logs in with this user and secret (12+ characters).
        #[arg(long, value_name = "USER:SECRET")]
        chap: Option<String>,
        /// Mutual CHAP: the target answers the initiator's challenge with these.
        #[arg(long, value_name = "USER:SECRET")]
        mutual_chap: Option<String>,
    },
    /// Remove an initiator's access (its sessions end at their next login).
    Detach {
        name: String,
        #[arg(long, value_name = "IQN")]
        initiator: String,
    },
    /// Show one volume group.
    Show {
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List volume groups.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete a volume group (its vdisks stay).
    Delete { name: String },
    /// Require CHAP of every SendTargets discovery session, whatever group the initiator is
    /// attached to (node-wide). Without flags, shows the current setting.
    DiscoveryAuth {
        /// The initiator must log in to discovery with this user and secret (12+ characters).
        #[arg(long, value_name = "USER:SECRET", conflicts_with = "off")]
        chap: Option<String>,
        /// Mutual CHAP: the target answers the initiator's challenge with these.
        #[arg(long, value_name = "USER:SECRET", requires = "chap")]
        mutual_chap: Option<String>,
        /// Let any initiator discover without CHAP again (the default).
        #[arg(long)]
        off: bool,
    },
}
