//! `ashlar`: the node daemon and the command-line client, one binary.

mod api_token;
mod args;
mod args_vg;
mod client;
mod client_cluster;
mod client_vg;
mod cluster;
mod cluster_status;
mod curator;
mod deletions;
mod drain;
mod forwarding;
mod http;
mod http_vg;
mod iscsi;
mod metrics;
mod net_faults;
mod node;
mod ownership;
mod registry;
mod replication;
mod trim;
mod volume_groups;

use clap::Parser;

fn main() {
    let cli = args::Cli::parse();
    let api = client::ApiTarget {
        server: cli.server,
        token_file: cli.api_token_file,
    };
    let result = match cli.command {
        args::Command::Node(node) => match node.action {
            None => node::run(node.run, api.token_file),
            Some(action) => client::run_node(&api, action),
        },
        args::Command::Vdisk(command) => client::run(&api, command),
        args::Command::Vg(command) => client_vg::run(&api, command),
        args::Command::Cluster(command) => client_cluster::run(&api, command),
    };
    if let Err(error) = result {
        // One line a user can act on; the chain gives the cause.
        eprintln!("error: {error:#}");
        std::process::exit(1);
    }
}
