//! Command-line arguments. Every flag explains itself in `--help`.

use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

pub const DEFAULT_NBD_LISTEN: &str = "127.0.0.1:10809";
pub const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:10810";
pub const DEFAULT_ISCSI_LISTEN: &str = "127.0.0.1:3260";
pub const DEFAULT_SERVER: &str = "http://127.0.0.1:10810";
/// The node's data directory unless --data-dir says otherwise; the CLI looks there for the
/// API token a local node generated.
pub const DEFAULT_DATA_DIR: &str = "./ashlar-data";

#[derive(Parser, Debug)]
#[command(
    name = "ashlar",
    version,
    about = "Ashlar distributed block storage: node daemon and CLI",
    long_about = "Ashlar pools a node's disks and serves thin-provisioned virtual disks (vdisks) over NBD and iSCSI.\n\
Run `ashlar node` to start a node; use `ashlar vdisk ...` to manage its vdisks and `ashlar vg ...` to export them over iSCSI."
)]
pub struct Cli {
    /// HTTP address of the node the vdisk commands talk to.
    #[arg(long, global = true, env = "ASHLAR_SERVER", default_value = DEFAULT_SERVER, value_name = "URL")]
    pub server: String,
    /// File holding the HTTP API's bearer token (mode 0600; a file other users may read is
    /// refused). The CLI sends it with every request; `ashlar node` then requires it of every
    /// request but GET /healthz, also on loopback. Instead of a file, the token itself may be
    /// in ASHLAR_API_TOKEN (the file wins). Without either, a node whose --http-listen is not
    /// a loopback address requires the token in DATA_DIR/api-token, which it generates
    /// (mode 0600) at its first start, and the CLI sends ./ashlar-data/api-token when it can
    /// read it. A node on loopback without a token serves its API to anyone on the machine.
    #[arg(
        long,
        global = true,
        env = "ASHLAR_API_TOKEN_FILE",
        value_name = "PATH"
    )]
    pub api_token_file: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a node: serve its vdisks over NBD and its API over HTTP until SIGTERM/SIGINT.
    /// `ashlar node list` lists the nodes of the cluster instead.
    Node(NodeCommand),
    /// Create, list, inspect, resize, re-shard and delete vdisks on a running node.
    #[command(subcommand)]
    Vdisk(VdiskCommand),
    /// Volume groups: vdisks exported together as one iSCSI target, and who may use them.
    #[command(subcommand)]
    Vg(crate::args_vg::VgCommand),
    /// The cluster as a whole (nodes started with --etcd).
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Nodes up and down, every vdisk's copies and health (ok, rebuilding, under-replicated,
    /// unavailable, empty), resyncs in progress with their rate and ETA, and the cluster's
    /// fault tolerance: how many more node failures every vdisk's data survives now.
    Status {
        /// Print JSON instead of a report.
        #[arg(long)]
        json: bool,
    },
}

/// `ashlar node [FLAGS]` runs a node; `ashlar node list` asks a running one about the cluster.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct NodeCommand {
    #[command(subcommand)]
    pub action: Option<NodeAction>,
    #[command(flatten)]
    pub run: NodeArgs,
}

#[derive(Subcommand, Debug)]
pub enum NodeAction {
    /// List the cluster's nodes: id, address, up or down, storage-only, disks, capacity, free
    /// space and vdisks owned (a single node without --etcd lists itself).
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Empty a node before removing it: it stops claiming vdisks and getting new copies, its
    /// claims are given up and every copy it holds is rebuilt on other nodes (by the
    /// curators; the only copy of an RF 1 vdisk is offline while it is copied). Shows
    /// progress until the node holds nothing.
    Drain {
        /// The node's id (`ashlar node list`).
        node: String,
        /// Stop draining: the node may claim vdisks and get copies again.
        #[arg(long)]
        cancel: bool,
        /// Ask for the drain and return at once (follow it with `ashlar cluster status`).
        #[arg(long, conflicts_with = "cancel")]
        no_wait: bool,
        /// Give up waiting (the drain goes on) after this many seconds.
        #[arg(long, default_value_t = 3600, value_name = "SECONDS")]
        timeout_s: u64,
    },
}

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// Directory for the node's metadata (and its data when no --disk is given).
    #[arg(long, default_value = DEFAULT_DATA_DIR, value_name = "DIR")]
    pub data_dir: PathBuf,
    /// A directory on a local filesystem to store data in, with its tier (default fast).
    /// Repeat for several disks. The oplog lives on the first fast disk. Without --disk, data
    /// lives in DATA_DIR/disk0.
    #[arg(long = "disk", value_name = "PATH[:fast|:slow]")]
    pub disks: Vec<String>,
    /// Address to serve NBD on (export names are vdisk names).
    #[arg(long, default_value = DEFAULT_NBD_LISTEN, value_name = "ADDR")]
    pub nbd_listen: SocketAddr,
    /// Address to serve the HTTP API, /stats and /metrics on. On an address that is not
    /// loopback (0.0.0.0 included) every request but GET /healthz needs the API token
    /// (`Authorization: Bearer <token>`; see --api-token-file).
    #[arg(long, default_value = DEFAULT_HTTP_LISTEN, value_name = "ADDR")]
    pub http_listen: SocketAddr,
    /// Reactor threads (one per core). Default: one per CPU.
    #[arg(long, value_name = "N")]
    pub reactors: Option<usize>,
    /// CPUs the reactors are pinned to, in reactor order (e.g. `2-3` or `1,0`); reactor i
    /// runs on the i-th listed CPU (wrapping around). Every CPU must be one this process may
    /// run on. Default: the CPUs it may run on (all, unless `taskset` or a cpuset narrowed
    /// them), in ascending order; --reactors then defaults to how many are listed. Nodes
    /// sharing a host can be given different CPUs (or orders) so their reactors do not
    /// all contend for the same ones.
    #[arg(long, value_name = "LIST")]
    pub reactor_cpus: Option<String>,
    /// After a client request arrives or its reply goes out, a reactor keeps polling for
    /// what comes next this many microseconds before it sleeps. Saves a wakeup per request
    /// (tens of microseconds on virtual machines) at the cost of CPU while clients are
    /// active; spins that keep catching nothing (after requests that wait for a slow disk)
    /// stop by themselves. 0 turns it off.
    #[arg(long, default_value_t = ashlar_engine::config::DEFAULT_POLL_WINDOW.as_micros() as u64, value_name = "MICROSECONDS")]
    pub poll_window_us: u64,
    /// Read cache of the whole node, split across reactors (K/M/G suffixes). Blocks read
    /// from disk by reads of up to 256 KiB fill it; longer reads (scans) pass it by.
    #[arg(long, default_value = "1G", value_name = "SIZE")]
    pub cache_size: String,
    /// Oplog capacity of each vdisk, split across its shards (at least 16M per shard).
    /// Writers wait when it is full.
    #[arg(long, default_value = "256M", value_name = "SIZE")]
    pub oplog_size: String,
    /// Oplog data one drain step moves into the extent store at once, per shard (held in
    /// memory while it runs, taken from --drain-memory). Larger steps bring more blocks to
    /// each extent group they touch, so far fewer disk writes and syncs per block drained;
    /// 1M to 1G.
    #[arg(long, default_value = "128M", value_name = "SIZE")]
    pub drain_batch: String,
    /// Oplog data the drain steps of the whole node hold in memory at once (1M to 1T). A step
    /// takes --drain-batch when that much is free, else what is free (at least 1M): many
    /// shards draining at once take smaller steps rather than more memory.
    #[arg(long, default_value = "256M", value_name = "SIZE")]
    pub drain_memory: String,
    /// Requests queued per shard controller before clients wait.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub shard_queue_limit: usize,
    /// Extent groups each shard keeps open (about 20.3 KiB of checksums and one file
    /// descriptor each; each covers 4 MiB of the vdisk, so the default covers 4 GiB per shard).
    /// A read or write of an egroup that is not open first reads its checksum blocks from disk.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_open_egroups: usize,
    /// Extent groups a shard writes at once when it moves oplog data into the extent store
    /// (1 to --max-open-egroups; larger values are lowered to it). More drains faster, so client
    /// writes wait less behind a drain step; fewer holds less memory (up to 4 MiB read per
    /// extent group the step opens).
    #[arg(long, default_value_t = ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS, value_name = "N")]
    pub max_writing_egroups: usize,
    /// Disk writes one extent group keeps in flight while a write batch (a drain step, a
    /// bypass write) updates it (1 to 4096). A large drain step brings tens of blocks to each
    /// extent group; more in flight drains a little faster, fewer keeps the oplog's commits
    /// (every client write at QD1) from queueing behind them.
    #[arg(long, default_value_t = ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP, value_name = "N")]
    pub writes_in_flight_per_egroup: usize,
    /// Experimental, for benchmarks and tests: drain steps append whole blocks to a block
    /// log per shard (extent store format 3) instead of writing each block in place; past
    /// --block-log-capacity-bytes drain steps write the blocks still in use home. Hidden until
    /// the capacity has a sizing rule (docs/extent-store-log-proposal.md).
    #[arg(long, hide = true)]
    pub experimental_block_log: bool,
    /// With --experimental-block-log: log bytes a shard may hold that no checksum table names
    /// yet before a drain step writes the tables (memory ~40 bytes per 4 KiB block).
    #[arg(long, default_value = "256M", value_name = "SIZE", hide = true)]
    pub block_log_checkpoint_bytes: String,
    /// With --experimental-block-log: log bytes a shard keeps per disk; past it a drain step
    /// writes the oldest segments' blocks still in use home and removes the segments, down to
    /// a quarter below it.
    #[arg(long, default_value = "2G", value_name = "SIZE", hide = true)]
    pub block_log_capacity_bytes: String,
    /// Disk I/O with O_DIRECT (`on`, the default: data is cached once, in Ashlar's cache) or
    /// through the kernel page cache (`off`). Files on a filesystem that refuses O_DIRECT
    /// (e.g. ramfs) fall back to the page cache either way, with one warning in the log.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = ["on", "off"])]
    pub direct_io: String,
    /// Bytes of 4 KiB-aligned bounce buffers each reactor keeps for its disk I/O (K/M/G
    /// suffixes, binary units; 1M to 1G). A disk read or write that finds them in use waits
    /// for one to finish; one operation moves at most 1 MiB.
    #[arg(long, default_value = "16M", value_name = "SIZE")]
    pub io_bounce_pool: String,
    /// Bytes of freed large disk buffers (64 KiB and up: the kernel's targets for large cold
    /// reads and the drain's reads of the oplog, the oplog batches it writes from, and write
    /// payloads received from clients) the whole node keeps for reuse (K/M/G suffixes; 0 to 16G, 0 keeps none). Reused buffers need no fresh pages from the kernel: with none kept, sequential
    /// 1 MiB reads spend most of a core zeroing new pages.
    #[arg(long, default_value = "64M", value_name = "SIZE")]
    pub io_read_buffers: String,
    /// Disk operations each reactor has in flight at once (1 to 32768); more wait for one to
    /// finish. Its io_uring has room for at least this many.
    #[arg(long, default_value_t = ashlar_storage::fs::uring::DEFAULT_MAX_IN_FLIGHT_OPS, value_name = "N")]
    pub io_max_in_flight: usize,
    /// Shard count of vdisks created without --shards (1 to 64). One shard serves a vdisk on
    /// one core with no cross-core hop per request, and each shard has its own oplog (at
    /// least 16M); give a vdisk that needs more than one core more shards with
    /// `vdisk create --shards N` or `vdisk set NAME --shards N`.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub default_shards: u32,
    /// Largest NBD request accepted (bigger ones are refused with an error).
    #[arg(long, default_value = "32M", value_name = "SIZE")]
    pub nbd_max_request: String,
    /// Requests in flight per NBD connection before the server stops reading more.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub nbd_max_in_flight: usize,
    /// Bytes of NBD request payloads (write data being received or waiting to be written,
    /// read data waiting to be sent) the whole node holds in memory, over all connections
    /// (K/M/G suffixes, binary units; 1M to 1T). A connection that finds it used up stops
    /// reading until some is released; no request fails for it. Besides it, each connection
    /// may hold 128 KiB for small I/O. A request larger than the budget waits until it can
    /// take all of it.
    #[arg(long, default_value = "256M", value_name = "SIZE")]
    pub nbd_request_budget: String,
    /// NBD connections the node serves at once (at least 1). Over the limit, a new connection
    /// is accepted and closed at once (the client sees EOF), with a warning logged at most
    /// every 10 seconds; connections already served are unaffected.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_connections: usize,
    /// Address to serve iSCSI on (one target per volume group; see `ashlar vg --help`).
    #[arg(long, default_value = DEFAULT_ISCSI_LISTEN, value_name = "ADDR")]
    pub iscsi_listen: SocketAddr,
    /// iSCSI sessions the node serves at once (one connection each). Over the limit a new
    /// connection is closed at once, with a warning logged at most every 10 seconds.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub iscsi_max_sessions: usize,
    /// SCSI commands in flight per iSCSI session: the CmdSN window (MaxCmdSN) the target
    /// advertises (1 to 65536). The initiator may not send more.
    #[arg(long, default_value_t = 128, value_name = "N")]
    pub iscsi_max_commands: u32,
    /// Largest data segment of one iSCSI PDU the node accepts (MaxRecvDataSegmentLength,
    /// 512 to 16M-1).
    #[arg(long, default_value = "256K", value_name = "SIZE")]
    pub iscsi_max_recv_segment: String,
    /// MaxBurstLength the node offers: bytes per R2T or per Data-In sequence (512 to 16M-1).
    #[arg(long, default_value = "1M", value_name = "SIZE")]
    pub iscsi_max_burst: String,
    /// FirstBurstLength the node offers: unsolicited write bytes per command, held before any
    /// budget is taken (at most the max burst). A session holds at most
    /// --iscsi-max-commands times this.
    #[arg(long, default_value = "64K", value_name = "SIZE")]
    pub iscsi_first_burst: String,
    /// Largest data transfer of one SCSI command (reported in the Block Limits VPD page;
    /// 4K to 1G). Larger commands fail with CHECK CONDITION.
    #[arg(long, default_value = "32M", value_name = "SIZE")]
    pub iscsi_max_transfer: String,
    /// Bytes of iSCSI command data (solicited write data, read data waiting to be sent) the
    /// whole node holds over all sessions (1M to 1T). A command that finds it used up waits;
    /// none fails for it.
    #[arg(long, default_value = "256M", value_name = "SIZE")]
    pub iscsi_data_budget: String,
    /// etcd client URLs, comma-separated (http://h1:2379,http://h2:2379): keep the metadata in
    /// etcd and join the cluster there. Without it the node is a single node with its metadata
    /// in DATA_DIR/meta.redb. While etcd cannot be reached at start the node says so once and
    /// retries every 2 seconds.
    #[arg(long, value_name = "URLS", requires = "advertise")]
    pub etcd: Option<String>,
    /// Host name or IP address other nodes and clients reach this node at (required with
    /// --etcd); the node advertises it with the ports of --http-listen, --nbd-listen,
    /// --iscsi-listen and --node-listen.
    #[arg(long, value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Address to serve node-to-node traffic on (replication; with --etcd only). Other nodes
    /// connect to the --advertise host at this port and must hold the cluster secret.
    #[arg(long, default_value = "127.0.0.1:10811", value_name = "ADDR")]
    pub node_listen: SocketAddr,
    /// File holding the cluster secret (at least 16 bytes; the same file on every node) that
    /// node-to-node connections authenticate with. Without it the first node generates one
    /// and keeps it in etcd, where every node reads it: then whoever can read etcd can join.
    #[arg(long, value_name = "FILE", requires = "etcd")]
    pub cluster_secret_file: Option<PathBuf>,
    /// A client of a vdisk another node owns is served here by forwarding its requests to
    /// the owner; after this many seconds of forwarded I/O without a pause over 5 s, this
    /// node asks the owner to hand the vdisk over (only for vdisks with 2 or 3 copies, and
    /// only while no client of the owner itself uses it), so ownership follows the client.
    /// 0 never moves a vdisk.
    #[arg(long, default_value_t = 30, value_name = "SECONDS", requires = "etcd")]
    pub migrate_after_s: u64,

    /// A node that asked to take a vdisk over without holding a copy is given one first: the
    /// owner adds it to the copy set (one copy more than RF) and fills it while serving. If
    /// the node stops asking (its client left) for this many seconds without taking the
    /// vdisk over, the owner drops that extra copy again (every write goes to RF + 1 nodes
    /// meanwhile). At least 1.
    #[arg(
        long,
        default_value_t = crate::replication::DEFAULT_COPY_WISH_KEEP.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..),
        value_name = "SECONDS",
        requires = "etcd"
    )]
    pub hand_over_copy_keep_s: u64,

    /// A replicated vdisk with a copy on a node that has been down this many seconds gets
    /// the copy replaced by a live node and filled from the survivors (the curator), even
    /// if no client writes to it. Writes to a vdisk whose copy failed restore it at once.
    #[arg(long, default_value_t = 60, value_name = "SECONDS", requires = "etcd")]
    pub rereplicate_after_s: u64,
    /// A copy on a node that is up (it keeps its etcd lease) but has not answered this
    /// node's claims for this many seconds (a network cut between the two, a copy whose
    /// disk refuses writes) is replaced by another live node, as a copy on a node that is
    /// down is at once, so writes resume at full RF before the cut heals. Only while this
    /// node holds a complete copy, and only by a node that answers. 0 = never: writes fail
    /// until the copy answers again.
    #[arg(long, default_value_t = 30, value_name = "SECONDS", requires = "etcd")]
    pub replace_unreachable_copy_after_s: u64,
    /// Seconds a node keeps data of a replicated vdisk whose copy set no longer names it
    /// (its copy was replaced while it was down, drained off, or handed on) once every copy
    /// of the set is up and holds all the data; then the data is removed. 0 = at once.
    #[arg(long, default_value_t = 60, value_name = "SECONDS", requires = "etcd")]
    pub trim_copies_after_s: u64,
    /// Most MiB per second a claim's online resync compares and sends while clients do I/O
    /// on the vdisk (0 = no cap: --resync-latency-percent alone sets the pace); with no
    /// client I/O it goes as fast as the disks and network go. The resync shares the disk
    /// and CPUs with client I/O: a lower rate keeps more of the clients' IOPS while a copy is
    /// rebuilt, and takes longer.
    #[arg(
        long,
        default_value_t = 0,
        value_name = "MIB_PER_SECOND",
        requires = "etcd"
    )]
    pub resync_max_mib_s: u64,
    /// While clients do I/O on a vdisk being resynced, the resync slows down (by a quarter,
    /// every 100 ms) whenever the clients' mean latency over the last 500 ms exceeds this
    /// percentage of their latency without the resync (measured by pausing it for 300 ms
    /// every 3 s), and speeds up again (by 2 MiB/s per 100 ms, up to --resync-max-mib-s if
    /// set) while it stays below; never below 1 MiB/s. 0 = no latency control: the rate is
    /// --resync-max-mib-s (no limit if that is 0 too).
    #[arg(long, default_value_t = 130, value_name = "PERCENT", requires = "etcd")]
    pub resync_latency_percent: u32,
    /// Tests only: faults (delay, loss, cuts) injected into the node-to-node connections
    /// this node opens, per peer address, read from this file as it changes
    /// (`crates/ashlar/src/net_faults.rs` has the format).
    #[arg(long, value_name = "FILE", hide = true, requires = "etcd")]
    pub test_net_faults: Option<PathBuf>,

    /// Mark the node storage-only: it holds replicas of other nodes' vdisks (chosen before
    /// other nodes when copies are placed) and never owns vdisks or serves clients.
    #[arg(long, requires = "etcd")]
    pub storage_only: bool,
    /// TTL of the node's lease in the metadata store, in milliseconds: a node that stops
    /// keeping it alive (killed, cut off) is listed as down this long after its last
    /// keep-alive. etcd counts whole seconds, at least its minimum (2 s by default).
    #[arg(long, default_value_t = ashlar_cluster::DEFAULT_NODE_LEASE_TTL.as_millis() as u64, value_name = "MILLISECONDS")]
    pub node_lease_ttl_ms: u64,
    /// Seconds an iSCSI initiator may stay quiet before the node sends it a NOP-In ping
    /// (0 = never ping; at most 3600).
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    pub iscsi_nop_interval_s: u64,
    /// Seconds a pinged initiator has to send anything before its connection is dropped
    /// and its commands aborted (1 to 3600).
    #[arg(long, default_value_t = 10, value_name = "SECONDS")]
    pub iscsi_nop_timeout_s: u64,
    /// Cluster mode, failback: a node serving an iSCSI target whose preferred node (the
    /// first node that served it) is another one hands the target back once it has seen
    /// that node up for this many seconds: the target's sessions here end, its vdisks are
    /// released, and the initiators' next logins are redirected to the preferred node.
    /// Only targets whose vdisks are all replicated move. 0 = never (at most 86400).
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    pub iscsi_failback_after_s: u64,
    /// Create this vdisk at startup if it does not exist yet (e.g. demo:8G). Repeatable.
    #[arg(long = "ensure-vdisk", value_name = "NAME:SIZE")]
    pub ensure_vdisks: Vec<String>,
}

#[derive(Subcommand, Debug)]
pub enum VdiskCommand {
    /// Create a thin-provisioned vdisk (costs nothing until written).
    Create {
        name: String,
        /// Size with an optional K/M/G/T suffix (binary units), e.g. 200G.
        #[arg(long, value_name = "SIZE")]
        size: String,
        /// Shard controllers serving it (1-64). Default: the node's --default-shards.
        #[arg(long, value_name = "N")]
        shards: Option<u32>,
        /// Copies of its data kept on distinct nodes (1, 2 or 3; 2 and 3 need a cluster):
        /// a write is acknowledged once it is durable on every copy.
        #[arg(long, value_name = "N", default_value_t = 1)]
        rf: u8,
    },
    /// List vdisks.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one vdisk.
    Show {
        name: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Change a vdisk's size. Growing is always allowed; shrinking discards the tail.
    Resize {
        name: String,
        #[arg(long, value_name = "SIZE")]
        size: String,
        /// Allow the new size to be smaller (data past it is discarded).
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Change settings of a vdisk while clients use it.
    Set {
        name: String,
        /// New shard count (1-64); changes with no data moved and no I/O failed.
        #[arg(long, value_name = "N")]
        shards: u32,
    },
    /// Delete a vdisk and its data.
    Delete {
        name: String,
        /// Delete even while clients are connected (their I/O then fails).
        #[arg(long)]
        force: bool,
    },
}
