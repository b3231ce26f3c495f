//! Random 4 KiB reads through `UringFs` at a fixed queue depth, on one thread, to compare with
//! `fio --ioengine=io_uring --direct=1 --rw=randread --bs=4k --iodepth=32` on the same file.
//!
//! ```text
//! cargo run --release -p ashlar-storage --example uring_randread -- FILE [SIZE_MIB] [QD] [SECONDS]
//! ```
//! Creates FILE (SIZE_MIB, default 1024) if it is smaller, then reads for SECONDS (default
//! 20) with QD (default 32) tasks on a current-thread runtime inside a `LocalSet`, like a
//! reactor. Drop the page cache first (`echo 3 > /proc/sys/vm/drop_caches`) for an uncached
//! run; with O_DIRECT the page cache is not used for the reads anyway.

use ashlar_storage::fs::{DiskFile, Filesystem, IoMode, UringConfig, UringFs};
use std::cell::Cell;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

const BLOCK: u64 = 4096;

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(
        args.next()
            .expect("usage: uring_randread FILE [SIZE_MIB] [QD] [SECONDS]"),
    );
    let size_mib: u64 = args.next().map_or(1024, |a| a.parse().expect("SIZE_MIB"));
    let depth: usize = args.next().map_or(32, |a| a.parse().expect("QD"));
    let seconds: u64 = args.next().map_or(20, |a| a.parse().expect("SECONDS"));
    let size = size_mib << 20;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&runtime, async move {
        let fs = UringFs::new(UringConfig::default()).unwrap();
        let file = Rc::new(fs.open(&path, true).await.unwrap());
        println!("{}: {:?}", path.display(), file.mode());
        assert_eq!(file.mode(), IoMode::Direct, "the benchmark needs O_DIRECT");
        if file.len().await.unwrap() < size {
            println!("filling {size_mib} MiB");
            let chunk: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 7 + 1) as u8).collect();
            for at in (0..size).step_by(chunk.len()) {
                file.write_at(&chunk, at).await.unwrap();
            }
            file.sync_data().await.unwrap();
            println!("filled; drop the page cache and run again for a clean measurement");
        }

        let done = Rc::new(Cell::new(0u64));
        let stop = Instant::now() + Duration::from_secs(seconds);
        let started = Instant::now();
        let cpu_before = cpu_seconds();
        let blocks = size / BLOCK;
        let mut tasks = Vec::new();
        for worker in 0..depth as u64 {
            let (file, done) = (file.clone(), done.clone());
            tasks.push(tokio::task::spawn_local(async move {
                let mut x = (worker + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let mut buf = vec![0u8; BLOCK as usize];
                let mut n = 0u64;
                while !n.is_multiple_of(64) || Instant::now() < stop {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    file.read_at(&mut buf, (x % blocks) * BLOCK).await.unwrap();
                    n += 1;
                    done.set(done.get() + 1);
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let elapsed = started.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu_before;
        let ios = done.get() as f64;
        println!(
            "QD{depth} 4 KiB random reads: {:.0} IOPS over {elapsed:.1} s, {cpu:.2} CPU s ({:.0} IOs per CPU second)",
            ios / elapsed,
            ios / cpu
        );
    });
}
