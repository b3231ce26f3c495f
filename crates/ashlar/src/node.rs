//! `ashlar node`: start the engine, serve NBD and HTTP, stop cleanly on SIGTERM/SIGINT.

use crate::api_token::{node_token, require_token, ApiAuth, TokenSource, TOKEN_ENV};
use crate::args::NodeArgs;
use crate::forwarding::NodeDevice;
use crate::http::{router, ApiState};
use crate::ownership::NodeOwnership;
use crate::registry::{EngineRegistry, NodeEngine};
use anyhow::{anyhow, bail, Context, Result};
use ashlar_core::{format_size, parse_size, BLOCK_SIZE_BYTES};
use ashlar_engine::config::BlockLogSettings;
use ashlar_engine::reactor::{allowed_cpus, default_reactor_count, ReactorId};
use ashlar_engine::vdisk::ConnectionGuard;
use ashlar_engine::{Engine, EngineConfig, EngineError};
use ashlar_nbd::{resume_connection, serve_or_hand_over, Handover, NbdLimits, RequestBudget};
use ashlar_storage::disk::{Disk, Tier};
use ashlar_storage::extent_store::SEGMENT_BYTES;
use ashlar_storage::fs::{NodeFs, UringConfig};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

/// How long SIGTERM waits for clients' in-flight requests before exiting anyway.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// At most one warning per this interval about connections refused at `--max-connections`.
const REFUSAL_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// Runs a node; `api_token_file` is `--api-token-file`, the token its API requires.
pub fn run(args: NodeArgs, api_token_file: Option<PathBuf>) -> Result<()> {
    init_logging();
    raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the control runtime")?;
    runtime.block_on(serve(args, api_token_file))
}

/// Each shard keeps up to `--max-open-egroups` files open, and every client holds a socket:
/// the usual soft limit of 1024 descriptors is far below what the defaults need, so the node
/// raises its soft limit to the hard one (what any unprivileged process may do).
fn raise_open_file_limit() {
    // SAFETY: getrlimit/setrlimit with a struct owned by this frame.
    let (before, after) = unsafe {
        let mut limit: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return;
        }
        let before = limit.rlim_cur;
        if limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return;
            }
        }
        (before, limit.rlim_cur)
    };
    if after < 16_384 {
        tracing::warn!(
            open_files_limit = after,
            "the open-files limit is low for a storage node (raise `ulimit -Hn`): \
             each shard keeps up to --max-open-egroups files open"
        );
    } else if before != after {
        tracing::debug!(
            from = before,
            to = after,
            "raised the open-files soft limit"
        );
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn parse_disk(text: &str) -> Result<Disk> {
    let (path, tier) = match text.rsplit_once(':') {
        Some((path, "fast")) => (path, Tier::Fast),
        Some((path, "slow")) => (path, Tier::Slow),
        Some((_, other)) if !other.contains('/') => {
            bail!("--disk {text}: unknown tier '{other}' (use fast or slow)")
        }
        _ => (text, Tier::Fast),
    };
    let path = PathBuf::from(path);
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => bail!("--disk {text}: {} is not a directory; this version stores data in files on a mounted filesystem, so give the directory of a mount point", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(&path).with_context(|| format!("--disk {text}: creating {}", path.display()))?
        }
        Err(e) => bail!("--disk {text}: {e}"),
    }
    Ok(Disk { path, tier })
}

/// Most CPUs `--reactor-cpus` may list (and the highest CPU number it may name, plus one).
const MAX_LISTED_CPUS: usize = 1024;

/// A CPU list as `taskset -c` takes it: comma-separated CPUs and inclusive ranges (`0-3,6`),
/// in the order given.
fn parse_cpu_list(text: &str) -> Result<Vec<usize>, String> {
    let cpu = |part: &str| -> Result<usize, String> {
        let cpu: usize = part
            .trim()
            .parse()
            .map_err(|_| format!("'{part}' is not a CPU number"))?;
        if cpu >= MAX_LISTED_CPUS {
            return Err(format!("CPU {cpu} is beyond {}", MAX_LISTED_CPUS - 1));
        }
        Ok(cpu)
    };
    let mut cpus = Vec::new();
    for part in text.split(',') {
        match part.split_once('-') {
            Some((first, last)) => {
                let (first, last) = (cpu(first)?, cpu(last)?);
                if first > last {
                    return Err(format!("range {part} runs backwards"));
                }
                cpus.extend(first..=last);
            }
            None => cpus.push(cpu(part)?),
        }
        if cpus.len() > MAX_LISTED_CPUS {
            return Err(format!("more than {MAX_LISTED_CPUS} CPUs listed"));
        }
    }
    Ok(cpus)
}

fn engine_config(args: &NodeArgs) -> Result<EngineConfig> {
    let size = |flag: &str, text: &str| parse_size(text).map_err(|e| anyhow!("{flag}: {e}"));
    let reactor_cpus = match &args.reactor_cpus {
        Some(text) => {
            let cpus = parse_cpu_list(text).map_err(|e| anyhow!("--reactor-cpus {text}: {e}"))?;
            let allowed = allowed_cpus();
            if let Some(cpu) = cpus.iter().find(|cpu| !allowed.contains(cpu)) {
                bail!(
                    "--reactor-cpus {text}: CPU {cpu} is not one this process may run on ({})",
                    allowed
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                );
            }
            cpus
        }
        None => Vec::new(),
    };
    let reactors = args.reactors.unwrap_or(if reactor_cpus.is_empty() {
        default_reactor_count()
    } else {
        reactor_cpus.len()
    });
    if reactors == 0 || reactors > 256 {
        bail!("--reactors must be between 1 and 256");
    }
    let max_shards = ashlar_engine::config::MAX_SHARDS;
    if args.default_shards == 0 || args.default_shards > max_shards {
        bail!("--default-shards must be between 1 and {max_shards}");
    }
    let drain_batch_bytes = size("--drain-batch", &args.drain_batch)?;
    if !((1 << 20)..=(1 << 30)).contains(&drain_batch_bytes) {
        bail!("--drain-batch must be between 1M and 1G");
    }
    let drain_memory_bytes = size("--drain-memory", &args.drain_memory)?;
    if !((1 << 20)..=(1 << 40)).contains(&drain_memory_bytes) {
        bail!("--drain-memory must be between 1M and 1T");
    }
    if !(1..=4096).contains(&args.writes_in_flight_per_egroup) {
        bail!("--writes-in-flight-per-egroup must be between 1 and 4096");
    }
    let disks = if args.disks.is_empty() {
        vec![Disk {
            path: args.data_dir.join("disk0"),
            tier: Tier::Fast,
        }]
    } else {
        args.disks
            .iter()
            .map(|d| parse_disk(d))
            .collect::<Result<_>>()?
    };
    Ok(EngineConfig {
        data_dir: args.data_dir.clone(),
        disks,
        reactors,
        poll_window: Duration::from_micros(args.poll_window_us.min(1_000_000)),
        reactor_cpus,
        cache_bytes: size("--cache-size", &args.cache_size)?,
        oplog_bytes_per_vdisk: size("--oplog-size", &args.oplog_size)?,
        shard_queue_limit: args.shard_queue_limit.max(1),
        shard_requests_in_flight_limit:
            ashlar_engine::config::DEFAULT_SHARD_REQUESTS_IN_FLIGHT_LIMIT,
        drain_batch_bytes,
        drain_memory_bytes,
        drain_idle: Duration::from_millis(500),
        max_open_egroups_per_shard: args.max_open_egroups.max(1),
        max_writing_egroups_per_shard: args
            .max_writing_egroups
            .clamp(1, args.max_open_egroups.max(1)),
        writes_in_flight_per_egroup: args.writes_in_flight_per_egroup,
        default_shards: args.default_shards,
        fs: NodeFs::detect(uring_config(args)?).map_err(|e| anyhow!("setting up disk I/O: {e}"))?,
        block_log: block_log_settings(args)?,
    })
}

/// `--experimental-block-log` and its checkpoint size.
fn block_log_settings(args: &NodeArgs) -> Result<Option<BlockLogSettings>> {
    if !args.experimental_block_log {
        return Ok(None);
    }
    let checkpoint_bytes = parse_size(&args.block_log_checkpoint_bytes)
        .map_err(|e| anyhow!("--block-log-checkpoint-bytes: {e}"))?;
    if checkpoint_bytes < BLOCK_SIZE_BYTES {
        bail!("--block-log-checkpoint-bytes must be at least 4K");
    }
    let capacity_bytes = parse_size(&args.block_log_capacity_bytes)
        .map_err(|e| anyhow!("--block-log-capacity-bytes: {e}"))?;
    if capacity_bytes < 2 * SEGMENT_BYTES {
        bail!("--block-log-capacity-bytes must be at least 128M (two 64 MiB segments)");
    }
    Ok(Some(BlockLogSettings {
        checkpoint_bytes,
        capacity_bytes,
        segment_chunks: ashlar_storage::extent_store::DEFAULT_SEGMENT_CHUNKS,
    }))
}

/// `--io-read-buffers`: bytes of freed large read buffers the node keeps.
fn read_buffers_kept_limit(args: &NodeArgs) -> Result<usize> {
    let kept = parse_size(&args.io_read_buffers).map_err(|e| anyhow!("--io-read-buffers: {e}"))?;
    if kept > 16 << 30 {
        bail!("--io-read-buffers must be between 0 and 16G");
    }
    Ok(kept as usize)
}

/// The most memory small read buffers may map: what the read caches hold, plus the payloads
/// the front-ends' budgets let be in flight, plus slack for reads inside the node (hand-overs,
/// replication). Past it, small buffers come from the heap.
fn small_buffers_limit(
    config: &EngineConfig,
    nbd: &NbdLimits,
    iscsi: &ashlar_iscsi::IscsiLimits,
) -> usize {
    const SLACK_BYTES: u64 = 64 << 20;
    let bytes = config.cache_bytes
        + nbd.request_budget.capacity_bytes()
        + iscsi.data_budget.capacity_bytes()
        + SLACK_BYTES;
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

/// Each reactor's disk I/O limits: `--direct-io`, `--io-bounce-pool`, `--io-max-in-flight`.
fn uring_config(args: &NodeArgs) -> Result<UringConfig> {
    let bounce = parse_size(&args.io_bounce_pool).map_err(|e| anyhow!("--io-bounce-pool: {e}"))?;
    if !((1 << 20)..=(1 << 30)).contains(&bounce) {
        bail!("--io-bounce-pool must be between 1M and 1G");
    }
    if !(1..=32768).contains(&args.io_max_in_flight) {
        bail!("--io-max-in-flight must be between 1 and 32768");
    }
    let defaults = UringConfig::default();
    Ok(UringConfig {
        prefer_direct: args.direct_io == "on",
        bounce_pool_bytes: bounce as usize,
        max_in_flight_ops: args.io_max_in_flight,
        ring_entries: (args.io_max_in_flight as u32)
            .next_power_of_two()
            .max(defaults.ring_entries),
        ..defaults
    })
}

/// The NBD limits of every connection. They hold the node's one request budget, which every
/// connection on every reactor shares (clones of `NbdLimits` share it).
fn nbd_limits(args: &NodeArgs) -> Result<NbdLimits> {
    let max = parse_size(&args.nbd_max_request).map_err(|e| anyhow!("--nbd-max-request: {e}"))?;
    if !(4096..=(1 << 30)).contains(&max) {
        bail!("--nbd-max-request must be between 4K and 1G");
    }
    let budget =
        parse_size(&args.nbd_request_budget).map_err(|e| anyhow!("--nbd-request-budget: {e}"))?;
    if !((1 << 20)..=(1 << 40)).contains(&budget) {
        bail!("--nbd-request-budget must be between 1M and 1T");
    }
    Ok(NbdLimits {
        max_request_bytes: max as u32,
        max_in_flight_requests: args.nbd_max_in_flight.max(1),
        request_budget: RequestBudget::new(budget),
        ..NbdLimits::default()
    })
}

async fn ensure_vdisks(engine: &NodeEngine, specs: &[String]) -> Result<()> {
    for spec in specs {
        let (name, size) = spec
            .split_once(':')
            .ok_or_else(|| anyhow!("--ensure-vdisk {spec}: expected NAME:SIZE, e.g. demo:8G"))?;
        let size_bytes = parse_size(size).map_err(|e| anyhow!("--ensure-vdisk {spec}: {e}"))?;
        match engine.create_vdisk(name, size_bytes, None).await {
            Ok(_) => tracing::info!(vdisk = name, size = %format_size(size_bytes), "created vdisk"),
            Err(EngineError::AlreadyExists(_)) => {}
            Err(e) => return Err(anyhow!("--ensure-vdisk {spec}: {e}")),
        }
    }
    Ok(())
}

/// The gate of the node's API, from `--api-token-file`, `ASHLAR_API_TOKEN` or (beyond
/// loopback) `DATA_DIR/api-token`; says where the token is, never what it is.
fn api_auth(args: &NodeArgs, token_file: Option<&Path>) -> Result<ApiAuth> {
    let env_token = std::env::var(TOKEN_ENV).ok();
    let chosen = node_token(
        &args.http_listen,
        token_file,
        env_token.as_deref(),
        &args.data_dir,
    )?;
    let listen = args.http_listen;
    match &chosen {
        None => tracing::info!(%listen, "the HTTP API is on loopback and needs no token; \
            --api-token-file or {TOKEN_ENV} make it require one"),
        Some((_, TokenSource::DataDir { path, generated })) => tracing::info!(%listen,
            token_file = %path.display(), generated,
            "the HTTP API is not on loopback, so every request needs the bearer token kept in \
             token_file; give that file to the CLI with --api-token-file"),
        Some((_, source)) => {
            tracing::info!(%listen, "the HTTP API requires the bearer token from {source}")
        }
    }
    Ok(ApiAuth::new(chosen.map(|(token, _)| token)))
}

async fn serve(args: NodeArgs, api_token_file: Option<PathBuf>) -> Result<()> {
    // Flags first: a node refused for a bad flag leaves nothing behind.
    let config = engine_config(&args)?;
    ashlar_storage::fs::large_buffers::set_free_limit_bytes(read_buffers_kept_limit(&args)?);
    let limits = nbd_limits(&args)?;
    if args.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating data directory {}", args.data_dir.display()))?;
    // Without --etcd, the embedded store's own file lock guards the data directory.
    let _data_dir_lock = match args.etcd {
        Some(_) => Some(crate::cluster::lock_data_dir(&args.data_dir)?),
        None => None,
    };
    let node_id = ashlar_cluster::load_or_create_node_id(&args.data_dir)?;
    let Some(meta) = crate::cluster::open_meta(&args, wait_for_signal()).await? else {
        return Ok(());
    };
    let iscsi_limits = crate::iscsi::iscsi_limits(&args)?;
    let failback_after = crate::iscsi::failback_after(&args)?;
    ashlar_storage::fs::small_buffers::set_limit_bytes(small_buffers_limit(
        &config,
        &limits,
        &iscsi_limits,
    ));
    if args.iscsi_max_sessions == 0 {
        bail!("--iscsi-max-sessions must be at least 1");
    }
    // After the flags are checked: a bad flag's error is the first line the user sees.
    let auth = api_auth(&args, api_token_file.as_deref())?;
    let groups = crate::volume_groups::VolumeGroups::load(meta.clone())
        .await
        .map_err(|e| anyhow!("loading volume groups: {e}"))?;
    let iscsi_listener = TcpListener::bind(args.iscsi_listen)
        .await
        .with_context(|| format!("cannot listen for iSCSI on {} (another target there? choose another address with --iscsi-listen)", args.iscsi_listen))?;
    let nbd_listener = TcpListener::bind(args.nbd_listen).await.with_context(|| {
        format!(
            "cannot listen for NBD on {} (choose another address with --nbd-listen)",
            args.nbd_listen
        )
    })?;
    let http_listener = TcpListener::bind(args.http_listen).await.with_context(|| {
        format!(
            "cannot listen for HTTP on {} (choose another address with --http-listen)",
            args.http_listen
        )
    })?;
    let started = Instant::now();
    let engine = Engine::start(config, meta.clone())
        .await
        .map_err(|e| anyhow!("starting the engine: {e}"))?;
    ensure_vdisks(&engine, &args.ensure_vdisks).await?;
    let record_source = crate::cluster::RecordSource::new(&args, node_id, &engine.config().disks)?;
    let registration = crate::cluster::register(&meta, &record_source, &args).await?;
    // In a cluster, no vdisk serves I/O before this node claims it (gates close here,
    // before any listener accepts).
    let is_clustered = meta.is_clustered();
    let ownership = if is_clustered {
        let replication = crate::replication::NodeReplication::start(
            &args,
            node_id,
            meta.clone(),
            engine.clone(),
        )
        .await?;
        tokio::spawn(crate::deletions::follow_deletions(
            engine.clone(),
            meta.clone(),
        ));
        let replication = Arc::new(replication);
        let ownership = crate::ownership::NodeOwnership::clustered(
            &engine,
            meta.clone(),
            node_id,
            args.storage_only,
            registration.subscribe_lease(),
            replication.clone(),
            (args.migrate_after_s > 0).then(|| Duration::from_secs(args.migrate_after_s)),
        );
        replication.set_ownership(ownership.clone());
        tokio::spawn(crate::trim::run(
            engine.clone(),
            meta.clone(),
            ownership.clone(),
            node_id,
            Duration::from_secs(args.trim_copies_after_s),
        ));
        if !args.storage_only {
            tokio::spawn(crate::curator::run(
                engine.clone(),
                meta.clone(),
                ownership.clone(),
                node_id,
                Duration::from_secs(args.rereplicate_after_s),
            ));
        }
        ownership
    } else {
        crate::ownership::NodeOwnership::default()
    };
    print_banner(&args, &engine, &limits, &auth, started.elapsed());
    println!(
        "Node {node_id} registered{}",
        match &args.etcd {
            Some(endpoints) =>
                format!(" in etcd at {endpoints}; `ashlar node list` lists the cluster"),
            None => " (single node)".to_string(),
        }
    );

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut membership_shutdown = shutdown_rx.clone();
    let membership = tokio::spawn(ashlar_cluster::keep_registered(
        registration,
        move || record_source.record(),
        async move {
            let _ = membership_shutdown.wait_for(|stop| *stop).await;
        },
    ));
    let connections = Arc::new(ConnectionCount::default());
    let iscsi_sessions = Arc::new(ConnectionCount::default());
    let api = router(ApiState {
        engine: engine.clone(),
        nbd_listen: args.nbd_listen,
        meta,
        node_id,
        ownership: ownership.clone(),
    })
    .merge(crate::http_vg::router(crate::http_vg::VgState {
        engine: engine.clone(),
        groups: groups.clone(),
        iscsi_listen: args.iscsi_listen,
    }))
    // Outermost, so every route (and the fallback) is behind it.
    .layer(axum::middleware::from_fn_with_state(
        auth.clone(),
        require_token,
    ));
    let mut http_shutdown = shutdown_rx.clone();
    let http = tokio::spawn(async move {
        let graceful = async move {
            let _ = http_shutdown.wait_for(|stop| *stop).await;
        };
        axum::serve(http_listener, api)
            .with_graceful_shutdown(graceful)
            .await
    });
    let accept = accept_loop(
        nbd_listener,
        engine.clone(),
        ownership.clone(),
        limits,
        shutdown_rx.clone(),
        connections.clone(),
        args.max_connections,
    );
    let iscsi_accept = crate::iscsi::accept_loop(
        iscsi_listener,
        crate::iscsi::Targets {
            engine: engine.clone(),
            groups,
            ownership,
            cluster: is_clustered.then_some(crate::iscsi::ClusterTargets {
                node: node_id,
                failback_after,
            }),
        },
        iscsi_limits,
        shutdown_rx.clone(),
        iscsi_sessions.clone(),
        args.iscsi_max_sessions,
    );
    tokio::select! {
        result = accept => result?,
        result = iscsi_accept => result?,
        signal = wait_for_signal() => tracing::info!("received {signal}; stopping"),
    }
    let _ = shutdown_tx.send(true);
    if !iscsi_sessions.wait_idle(SHUTDOWN_GRACE).await {
        tracing::warn!(
            left = iscsi_sessions.live(),
            "iSCSI sessions still open after the grace period; exiting"
        );
    }
    if !connections.wait_idle(SHUTDOWN_GRACE).await {
        tracing::warn!(
            left = connections.live(),
            "clients still connected after the grace period; exiting"
        );
    }
    engine.begin_shutdown();
    // Ends the node's lease, so the cluster lists it as down at once.
    let _ = tokio::time::timeout(Duration::from_secs(2), membership).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), http).await;
    drop(engine);
    tracing::info!("stopped; every acknowledged write is on stable storage");
    Ok(())
}

fn print_banner(
    args: &NodeArgs,
    engine: &NodeEngine,
    limits: &NbdLimits,
    auth: &ApiAuth,
    startup: Duration,
) {
    let config = engine.config();
    tracing::info!(reactors = config.reactors, cache = %format_size(config.cache_bytes),
        nbd_request_budget = %format_size(limits.request_budget.capacity_bytes()),
        max_connections = args.max_connections, disk_io = config.fs.name(),
        direct_io = %args.direct_io,
        io_bounce_pool = %args.io_bounce_pool,
        io_read_buffers = %args.io_read_buffers,
        io_max_in_flight = args.io_max_in_flight,
        startup_ms = startup.as_millis() as u64, "node ready");
    println!(
        "Ashlar node ready: NBD on {}, iSCSI on {}, HTTP API on http://{}{}",
        args.nbd_listen,
        args.iscsi_listen,
        args.http_listen,
        if auth.requires_token() {
            " (bearer token required)"
        } else {
            ""
        }
    );
    for vdisk in engine.list_vdisks() {
        let uri = format!("nbd://{}/{}", args.nbd_listen, vdisk.name);
        println!(
            "vdisk {} ({}): {uri}",
            vdisk.name,
            format_size(vdisk.size_bytes)
        );
    }
    if let Some(vdisk) = engine.list_vdisks().first() {
        let uri = format!("nbd://{}/{}", args.nbd_listen, vdisk.name);
        println!("Connect with:");
        println!("  nbdinfo {uri}");
        println!("  qemu-img info {uri}");
        println!("  fio --name=t --ioengine=nbd --uri={uri} --rw=randrw --bs=4k --iodepth=32 --size=1G --runtime=10 --time_based");
        println!("  mkdir -p /tmp/mnt && nbdfuse /tmp/mnt {uri} &   # then: losetup -f --show /tmp/mnt/nbd; mkfs.ext4; mount");
    }
    println!(
        "Manage vdisks with: ashlar vdisk --help; export them over iSCSI with: ashlar vg --help"
    );
}

async fn wait_for_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut interrupt)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return "nothing";
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = interrupt.recv() => "SIGINT",
    }
}

#[derive(Default)]
pub(crate) struct ConnectionCount {
    pub(crate) live: AtomicUsize,
    changed: Notify,
}

impl ConnectionCount {
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    async fn wait_idle(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while self.live() > 0 {
            if tokio::time::timeout_at(deadline, self.changed.notified())
                .await
                .is_err()
            {
                return self.live() == 0;
            }
        }
        true
    }
}

/// One live connection, counted from its accept until it ends, however it ends (the ticket
/// moves with a connection handed over to another reactor, so it is counted once).
pub(crate) struct ConnectionTicket(pub(crate) Arc<ConnectionCount>);

impl Drop for ConnectionTicket {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
        self.0.changed.notify_waiters();
    }
}

/// Connections refused at a connection limit, warned about at most once per
/// [`REFUSAL_WARNING_INTERVAL`] so a flood of connections cannot flood the log.
pub(crate) struct Refusals {
    /// What is limited and by which flag, for the warning: e.g. ("NBD connection",
    /// "--max-connections").
    what: &'static str,
    flag: &'static str,
    last_warning: Option<Instant>,
    unreported: u64,
}

impl Refusals {
    pub(crate) fn new(what: &'static str, flag: &'static str) -> Refusals {
        Refusals {
            what,
            flag,
            last_warning: None,
            unreported: 0,
        }
    }

    pub(crate) fn refused(&mut self, peer: std::net::SocketAddr, limit: usize) {
        self.unreported += 1;
        let now = Instant::now();
        if self
            .last_warning
            .is_some_and(|last| now.duration_since(last) < REFUSAL_WARNING_INTERVAL)
        {
            tracing::debug!(%peer, "{} refused: limit reached", self.what);
            return;
        }
        tracing::warn!(%peer, limit, refused = self.unreported,
            "{} limit reached ({}); closing new connections at once (this warning repeats at \
             most every 10 s; `refused` counts since the last one)", self.what, self.flag);
        self.last_warning = Some(now);
        self.unreported = 0;
    }
}

/// A connection on its way to another reactor, still counted by the node (for SIGTERM) and
/// by its vdisk (so a delete without `--force` is refused).
struct Moving {
    target: ReactorId,
    counted: ConnectionGuard,
    ticket: ConnectionTicket,
}

/// Continues a connection's transmission phase on `target`, a reactor that runs one of its
/// vdisk's shards. The connection stays counted (its ticket moves with it).
fn move_connection(
    handover: Handover,
    moving: Moving,
    engine: Arc<NodeEngine>,
    ownership: NodeOwnership,
    limits: NbdLimits,
    shutdown: watch::Receiver<bool>,
) {
    let export = handover.export().to_string();
    let Moving {
        target,
        counted,
        ticket,
    } = moving;
    let reactor = engine.reactors().get(target).clone();
    let moved = reactor.spawn_detached(move || async move {
        let _ticket = ticket;
        let registry = Rc::new(EngineRegistry::for_moved(engine, ownership, counted));
        if let Err(error) = resume_connection(handover, registry, limits, shutdown).await {
            tracing::info!(%error, "NBD connection ended with an error");
        }
    });
    match moved {
        Ok(()) => {
            tracing::debug!(%export, reactor = target.0, "NBD connection moved next to its shards")
        }
        Err(_) => tracing::warn!(%export, "reactor queue full; connection dropped"),
    }
}

/// Accepts NBD clients and places each connection on a reactor, round-robin; once a client
/// has chosen its vdisk, a connection on a reactor that runs none of the vdisk's shards moves
/// to one that does, so its requests are served without crossing reactors where possible.
/// With `max_connections` live, a new connection is closed as soon as it is accepted.
async fn accept_loop(
    listener: TcpListener,
    engine: Arc<NodeEngine>,
    ownership: NodeOwnership,
    limits: NbdLimits,
    shutdown: watch::Receiver<bool>,
    connections: Arc<ConnectionCount>,
    max_connections: usize,
) -> Result<()> {
    let mut next_reactor = 0usize;
    let mut refusals = Refusals::new("NBD connection", "--max-connections");
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: keep serving existing clients.
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Only this loop adds connections, so the count cannot pass the limit in between.
        if connections.live() >= max_connections {
            refusals.refused(peer, max_connections);
            // Closed now, the client sees EOF instead of waiting in the listen backlog.
            drop(stream);
            continue;
        }
        let std_stream = match stream.into_std() {
            Ok(s) => s,
            Err(error) => {
                tracing::warn!(%peer, %error, "cannot hand over connection");
                continue;
            }
        };
        let reactors = engine.reactors().handles();
        let reactor = &reactors[next_reactor % reactors.len()];
        next_reactor += 1;
        connections.live.fetch_add(1, Ordering::SeqCst);
        let ticket = ConnectionTicket(connections.clone());
        let registry_engine = engine.clone();
        let ownership = ownership.clone();
        let limits = limits.clone();
        let shutdown = shutdown.clone();
        let spawned = reactor.spawn_detached(move || async move {
            let stream = match tokio::net::TcpStream::from_std(std_stream) {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::warn!(%peer, %error, "cannot register connection");
                    return;
                }
            };
            let registry = Rc::new(EngineRegistry::new(
                registry_engine.clone(),
                ownership.clone(),
            ));
            tracing::debug!(%peer, "NBD client connected");
            let mut target = None;
            let stay = |device: &NodeDevice| {
                // A forwarded connection's requests leave the node anyway: it stays.
                let Some(handle) = device.local_handle() else {
                    return true;
                };
                target = handle
                    .better_reactor()
                    .map(|reactor| (reactor, handle.count_while_moving()));
                target.is_none()
            };
            let served =
                serve_or_hand_over(stream, registry, limits.clone(), shutdown.clone(), stay).await;
            match (served, target) {
                (Ok(Some(handover)), Some((target, counted))) => move_connection(
                    handover,
                    Moving {
                        target,
                        counted,
                        ticket,
                    },
                    registry_engine,
                    ownership,
                    limits,
                    shutdown,
                ),
                (Ok(_), _) => {}
                (Err(error), _) => {
                    tracing::info!(%peer, %error, "NBD connection ended with an error")
                }
            }
        });
        if spawned.is_err() {
            tracing::warn!(%peer, "reactor queue full; connection dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_read_as_taskset_writes_them() {
        assert_eq!(parse_cpu_list("3").unwrap(), vec![3]);
        assert_eq!(parse_cpu_list("1,0").unwrap(), vec![1, 0]);
        assert_eq!(parse_cpu_list("0-3,6").unwrap(), vec![0, 1, 2, 3, 6]);
        assert_eq!(parse_cpu_list("4-4").unwrap(), vec![4]);
        for (bad, why) in [
            ("", "not a CPU number"),
            ("1,,2", "not a CPU number"),
            ("x", "not a CPU number"),
            ("3-1", "runs backwards"),
            ("1-", "not a CPU number"),
            ("5000", "beyond"),
            ("0-1023,0", "more than"),
        ] {
            let error = parse_cpu_list(bad).unwrap_err();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }
}
