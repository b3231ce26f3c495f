//! Real NBD clients (libnbd's nbdinfo and nbdcopy, qemu-img) against a memory export served
//! from a background thread. Each test is skipped, with a message, when its tool is absent.

mod common;

use ashlar_nbd::{serve_connection, NbdLimits};
use common::memory::{MemoryDevice, MemoryRegistry};
use std::net::SocketAddr;
use std::process::Command;
use std::rc::Rc;
use std::thread::JoinHandle;
use tokio::net::TcpListener;
use tokio::sync::watch;

const SIZE: u64 = 8 << 20;

/// A server on its own thread (current-thread runtime + `LocalSet`), so the test thread can
/// block on a child process.
struct ThreadServer {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    thread: JoinHandle<()>,
}

impl ThreadServer {
    /// Serves `mem` (8 MiB, data at [64 KiB, 192 KiB), the rest holes) and `empty` (1 MiB).
    fn start() -> ThreadServer {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = watch::channel(false);
        let thread = std::thread::spawn(move || {
            common::run(async move {
                let mem = MemoryDevice::new(SIZE);
                mem.fill(64 << 10, &vec![0x5a; 128 << 10]);
                let mut registry = MemoryRegistry::default();
                registry.add("mem", "memory export", mem);
                registry.add("empty", "nothing here", MemoryDevice::new(1 << 20));
                let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                accept_until_stopped(listener, Rc::new(registry), stop_rx).await;
            })
        });
        let addr = addr_rx.recv().unwrap();
        ThreadServer { addr, stop, thread }
    }

    fn uri(&self, export: &str) -> String {
        format!("nbd://{}/{export}", self.addr)
    }

    fn stop(self) {
        self.stop.send(true).unwrap();
        self.thread.join().expect("server thread did not panic");
    }
}

async fn accept_until_stopped(
    listener: TcpListener,
    registry: Rc<MemoryRegistry>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tasks = Vec::new();
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => accepted.unwrap().0,
            _ = stop.wait_for(|s| *s) => break,
        };
        let (registry, shutdown) = (registry.clone(), stop.clone());
        tasks.push(tokio::task::spawn_local(async move {
            if let Err(error) =
                serve_connection(stream, registry, NbdLimits::default(), shutdown).await
            {
                panic!("a real client saw a server error: {error}");
            }
        }));
    }
    for task in tasks {
        task.await.expect("connection task did not panic");
    }
}

/// Runs a tool; `None` (after saying so) when it is not installed.
fn tool(program: &str, args: &[&str]) -> Option<String> {
    let output = match Command::new(program).args(args).output() {
        Ok(output) => output,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            println!("skipping: {program} is not installed");
            return None;
        }
        Err(error) => panic!("cannot run {program}: {error}"),
    };
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{program} {args:?} failed: {stderr}"
    );
    Some(String::from_utf8(output.stdout).unwrap())
}

#[test]
fn nbdinfo_sees_size_features_and_hole_map() {
    let server = ThreadServer::start();
    let Some(json) = tool("nbdinfo", &["--json", &server.uri("mem")]) else {
        return server.stop();
    };
    let info: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(info["protocol"], "newstyle-fixed");
    assert_eq!(info["structured"], true);
    let export = &info["exports"][0];
    assert_eq!(export["export-size"], SIZE);
    assert_eq!(export["contexts"], serde_json::json!(["base:allocation"]));
    for feature in [
        "can_flush",
        "can_fua",
        "can_multi_conn",
        "can_trim",
        "can_zero",
    ] {
        assert_eq!(export[feature], true, "{feature}");
    }
    assert_eq!(export["is_read_only"], false);
    assert_eq!(export["block_size_maximum"], 32 << 20);

    let map = tool("nbdinfo", &["--map", &server.uri("mem")]).unwrap();
    let extents: Vec<(u64, u64, u32)> = map
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                fields[2].parse().unwrap(),
            )
        })
        .collect();
    let expected = vec![
        (0, 64 << 10, 3),
        (64 << 10, 128 << 10, 0),
        (192 << 10, SIZE - (192 << 10), 3),
    ];
    assert_eq!(extents, expected, "map:\n{map}");

    let list = tool(
        "nbdinfo",
        &["--list", "--json", &format!("nbd://{}", server.addr)],
    )
    .unwrap();
    let list: serde_json::Value = serde_json::from_str(&list).unwrap();
    let names: Vec<&str> = list["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["mem", "empty"]);
    server.stop();
}

#[test]
fn nbdcopy_round_trips_a_file_over_several_connections() {
    let server = ThreadServer::start();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.img");
    let back = dir.path().join("back.img");
    let data = common::noise(42, 1 << 20);
    // Leading zeroes let nbdcopy skip or zero them instead of writing data.
    let mut image = vec![0u8; 1 << 20];
    image.extend_from_slice(&data);
    std::fs::write(&source, &image).unwrap();
    let Some(_) = tool("nbdcopy", &["--version"]) else {
        return server.stop();
    };
    let uri = server.uri("mem");
    // A source smaller than the export is fine: the rest of the export is left alone.
    let src = source.to_str().unwrap();
    let copy_in = Command::new("nbdcopy")
        .args(["--connections=4", src, &uri])
        .output()
        .unwrap();
    assert!(
        copy_in.status.success(),
        "{}",
        String::from_utf8_lossy(&copy_in.stderr)
    );
    let copy_out = Command::new("nbdcopy")
        .args([&uri, back.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        copy_out.status.success(),
        "{}",
        String::from_utf8_lossy(&copy_out.stderr)
    );
    let copied = std::fs::read(&back).unwrap();
    assert_eq!(copied.len() as u64, SIZE);
    assert!(
        copied[..image.len()] == image[..],
        "data came back different"
    );
    server.stop();
}

#[test]
fn qemu_img_reads_the_export() {
    let server = ThreadServer::start();
    let Some(info) = tool("qemu-img", &["info", "--output=json", &server.uri("mem")]) else {
        return server.stop();
    };
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    assert_eq!(info["virtual-size"], SIZE);
    let map = tool("qemu-img", &["map", "--output=json", &server.uri("mem")]).unwrap();
    let map: serde_json::Value = serde_json::from_str(&map).unwrap();
    let data: Vec<(u64, u64)> = map
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["data"] == true)
        .map(|e| (e["start"].as_u64().unwrap(), e["length"].as_u64().unwrap()))
        .collect();
    assert_eq!(data, vec![(64 << 10, 128 << 10)]);
    server.stop();
}
