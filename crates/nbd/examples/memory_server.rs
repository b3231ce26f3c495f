//! Serves sparse in-memory exports over NBD, for trying the server with real clients:
//!
//! ```text
//! cargo run -p ashlar-nbd --example memory_server -- 10809 [size-in-MiB]
//! nbdinfo nbd://127.0.0.1:10809/mem
//! fio --name=t --ioengine=nbd --uri=nbd://127.0.0.1:10809/mem --rw=randrw --bs=4k \
//!     --iodepth=16 --size=64m --verify=crc32c --runtime=5
//! ```
//!
//! Exports `mem` (default 1 GiB) and `small` (16 MiB). Ctrl-C shuts down gracefully.
//! `RUST_LOG=debug` shows per-connection detail.

#[allow(dead_code)]
#[path = "../tests/common/memory.rs"]
mod memory;

use ashlar_nbd::{serve_connection, NbdLimits};
use memory::{MemoryDevice, MemoryRegistry};
use std::rc::Rc;
use tokio::net::TcpListener;
use tokio::sync::watch;

fn main() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let port: u16 = match args.next().map(|a| a.parse()) {
        Some(Ok(port)) => port,
        _ => {
            eprintln!("usage: memory_server PORT [SIZE_MIB]");
            std::process::exit(2);
        }
    };
    let size_mib: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1024);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, serve(port, size_mib << 20));
}

async fn serve(port: u16, size: u64) {
    let mut registry = MemoryRegistry::default();
    registry.add(
        "mem",
        &format!("sparse memory, {size} bytes"),
        MemoryDevice::new(size),
    );
    registry.add(
        "small",
        "sparse memory, 16 MiB",
        MemoryDevice::new(16 << 20),
    );
    let registry = Rc::new(registry);
    let listener = match TcpListener::bind(("127.0.0.1", port)).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("cannot listen on 127.0.0.1:{port}: {error}");
            std::process::exit(1);
        }
    };
    eprintln!("serving nbd://127.0.0.1:{port}/mem ({size} bytes) and /small; Ctrl-C to stop");
    let (stop, stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    continue;
                }
            },
            _ = tokio::signal::ctrl_c() => break,
        };
        let (registry, shutdown) = (registry.clone(), stopped.clone());
        tasks.push(tokio::task::spawn_local(async move {
            tracing::info!(%peer, "client connected");
            match serve_connection(stream, registry, NbdLimits::default(), shutdown).await {
                Ok(()) => tracing::info!(%peer, "client done"),
                Err(error) => tracing::warn!(%peer, %error, "connection ended with an error"),
            }
        }));
    }
    eprintln!("shutting down: answering in-flight requests");
    let _ = stop.send(true);
    for task in tasks {
        let _ = task.await;
    }
}
