//! `UringFs` against real filesystems: O_DIRECT on the build directory's filesystem (ext4 on
//! the project's machines), the page cache on /dev/shm, cancellation, backpressure and errors.

use ashlar_storage::fs::uring::{reap_completions, thread_stats, UringConfig, UringFile};
use ashlar_storage::fs::{remove_tree, DirEntry, DiskBuf, DiskFile, Filesystem, IoMode, UringFs};
use bytes::Bytes;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// Runs `make`'s future on a new thread (so it gets a new ring, with the config of its first
/// use) with a current-thread runtime inside a `LocalSet`, like a reactor.
fn on_fresh_thread<F, Fut>(make: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&runtime, make());
    })
    .join()
    .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
}

/// A directory on the build's filesystem (ext4 here: O_DIRECT works).
fn direct_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// A directory on tmpfs.
fn shm_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap()
}

fn fs_with(config: UringConfig) -> UringFs {
    UringFs::new(config).unwrap()
}

fn direct_fs() -> UringFs {
    fs_with(UringConfig::default())
}

fn buffered_fs() -> UringFs {
    fs_with(UringConfig {
        prefer_direct: false,
        ..Default::default()
    })
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn open_direct(fs: &UringFs, path: &Path) -> UringFile {
    let file = fs.open(path, true).await.unwrap();
    assert_eq!(
        file.mode(),
        IoMode::Direct,
        "{} should allow O_DIRECT",
        path.display()
    );
    file
}

async fn read_vec(file: &UringFile, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0xAAu8; len];
    file.read_at(&mut buf, offset).await.unwrap();
    buf
}

async fn round_trip(file: &UringFile) {
    let data = pattern(3 << 20, 1);
    file.write_at(&data, 0).await.unwrap();
    file.sync_data().await.unwrap();
    assert_eq!(file.len().await.unwrap(), data.len() as u64);
    assert_eq!(read_vec(file, 0, data.len()).await, data);
    let tail = pattern(8192, 2);
    file.write_durable_at(&tail, 1 << 20).await.unwrap();
    let back = read_vec(file, (1 << 20) - 4096, 16384).await;
    assert_eq!(&back[..4096], &data[(1 << 20) - 4096..1 << 20]);
    assert_eq!(&back[4096..12288], &tail[..]);
    assert_eq!(&back[12288..], &data[(1 << 20) + 8192..(1 << 20) + 12288]);
}

#[test]
fn direct_round_trip() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = open_direct(&direct_fs(), &path).await;
        round_trip(&file).await;
    });
}

#[test]
fn buffered_round_trip_on_tmpfs() {
    let dir = shm_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = buffered_fs().open(&path, true).await.unwrap();
        assert_eq!(file.mode(), IoMode::Buffered);
        round_trip(&file).await;
        // Buffered mode takes unaligned writes.
        file.write_at(b"hello", 4095).await.unwrap();
        file.write_durable_at(b"world", 10).await.unwrap();
        assert_eq!(read_vec(&file, 4094, 7).await[1..6], *b"hello");
        assert_eq!(read_vec(&file, 10, 5).await, b"world");
    });
}

/// A Direct-mode file of `len` pattern bytes cut 1234 bytes short, so it ends mid-block, on a
/// ring with 16 KiB operations (larger reads take several): the file, its bytes before the
/// cut, and its size.
async fn file_ending_mid_block(path: &Path, len: usize, seed: u64) -> (UringFile, Vec<u8>, usize) {
    let fs = fs_with(UringConfig {
        max_op_bytes: 16384,
        bounce_pool_bytes: 64 << 10,
        ..Default::default()
    });
    let file = open_direct(&fs, path).await;
    let data = pattern(len, seed);
    file.write_at(&data, 0).await.unwrap();
    let size = data.len() - 1234;
    file.set_len(size as u64).await.unwrap();
    (file, data, size)
}

#[test]
fn unaligned_reads_in_direct_mode() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let (file, data, size) = file_ending_mid_block(&path, 64 << 10, 3).await;
        let cases = [
            (0, 1),
            (1, 1),
            (4095, 2),
            (100, 4096),
            (4096, 4096),
            (5000, 40_000),
            (12_000, 30_000),
            (size - 10, 10),
            (size - 10, 100),
            (size - 5000, 9000),
            (size, 50),
            (size + 4096, 4096),
            (1 << 30, 3),
        ];
        for (offset, len) in cases {
            let back = read_vec(&file, offset as u64, len).await;
            for (i, byte) in back.iter().enumerate() {
                let at = offset + i;
                let want = if at < size { data[at] } else { 0 };
                assert_eq!(*byte, want, "read of {len} at {offset}: byte {at}");
            }
        }
        let mut empty = [];
        file.read_at(&mut empty, 3).await.unwrap();
    });
}

#[test]
fn unaligned_write_in_direct_mode_is_einval() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = open_direct(&direct_fs(), &path).await;
        for (offset, len) in [(1u64, 4096usize), (0, 100), (4096, 4097), (512, 512)] {
            let data = vec![7u8; len];
            for durable in [false, true] {
                let error = if durable {
                    file.write_durable_at(&data, offset).await
                } else {
                    file.write_at(&data, offset).await
                }
                .unwrap_err();
                assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
            }
        }
        assert_eq!(file.len().await.unwrap(), 0, "nothing was written");
        file.write_at(&[], 0).await.unwrap();
    });
}

#[test]
fn write_durable_at_round_trip_and_extends() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let fs = direct_fs();
        let file = open_direct(&fs, &path).await;
        let data = pattern(3 * 4096, 4);
        file.write_durable_at(&data, 8192).await.unwrap();
        assert_eq!(file.len().await.unwrap(), 5 * 4096);
        assert_eq!(read_vec(&file, 8192, data.len()).await, data);
        assert_eq!(read_vec(&file, 0, 8192).await, vec![0u8; 8192]);
        drop(file);
        // Reopened, the data is there.
        let again = fs.open(&path, false).await.unwrap();
        assert_eq!(read_vec(&again, 8192, data.len()).await, data);
    });
}

#[test]
fn punch_hole_reads_zeros_and_keeps_the_size() {
    for direct in [true, false] {
        let dir = if direct { direct_dir() } else { shm_dir() };
        let path = dir.path().join("f");
        on_fresh_thread(move || async move {
            let fs = if direct { direct_fs() } else { buffered_fs() };
            let file = fs.open(&path, true).await.unwrap();
            let data = pattern(1 << 20, 5);
            file.write_at(&data, 0).await.unwrap();
            file.punch_hole(64 << 10, 128 << 10).await.unwrap();
            file.sync_data().await.unwrap();
            assert_eq!(file.len().await.unwrap(), 1 << 20);
            let back = read_vec(&file, 0, 1 << 20).await;
            assert_eq!(&back[..64 << 10], &data[..64 << 10]);
            assert!(back[64 << 10..192 << 10].iter().all(|&b| b == 0));
            assert_eq!(&back[192 << 10..], &data[192 << 10..]);
        });
    }
}

#[test]
fn allocate_extends_the_file() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = open_direct(&direct_fs(), &path).await;
        file.allocate(0, 1 << 20).await.unwrap();
        assert_eq!(file.len().await.unwrap(), 1 << 20);
        file.allocate(4 << 20, 4096).await.unwrap();
        assert_eq!(file.len().await.unwrap(), (4 << 20) + 4096);
        // Allocating inside the file changes neither size nor content.
        file.write_at(&pattern(4096, 6), 8192).await.unwrap();
        file.allocate(0, 16384).await.unwrap();
        assert_eq!(file.len().await.unwrap(), (4 << 20) + 4096);
        assert_eq!(read_vec(&file, 8192, 4096).await, pattern(4096, 6));
        assert_eq!(read_vec(&file, 3 << 20, 4096).await, vec![0u8; 4096]);
        file.set_len(12288).await.unwrap();
        assert_eq!(file.len().await.unwrap(), 12288);
    });
}

/// Limits far below the load: 256 operations on one thread with 64 ring entries, 16 admitted
/// at once and a 64 KiB buffer pool.
fn tight_config() -> UringConfig {
    UringConfig {
        ring_entries: 64,
        max_in_flight_ops: 16,
        bounce_pool_bytes: 64 << 10,
        max_op_bytes: 16 << 10,
        prefer_direct: true,
    }
}

#[test]
fn many_concurrent_tasks_on_one_thread() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = Arc::new(open_direct(&fs_with(tight_config()), &path).await);
        const OPS: u64 = 256;
        let block = |i: u64| pattern(8192, 100 + i);
        let mut tasks = Vec::new();
        for i in 0..OPS {
            let file = file.clone();
            tasks.push(tokio::task::spawn_local(async move {
                file.write_at(&block(i), i * 8192).await.unwrap();
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let stats = thread_stats().unwrap();
        assert_eq!(stats.ring_entries, 64);
        assert_eq!(stats.in_flight_ops, 0);
        assert!(stats.bounce_bytes_allocated <= 64 << 10);
        let mut tasks = Vec::new();
        for i in 0..OPS {
            let file = file.clone();
            tasks.push(tokio::task::spawn_local(async move {
                // Unaligned reads spanning two blocks, and a whole block.
                let back = read_vec(&file, i * 8192 + 100, 8192).await;
                let mut want = block(i)[100..].to_vec();
                if i + 1 < OPS {
                    want.extend_from_slice(&block(i + 1)[..100]);
                } else {
                    want.extend_from_slice(&[0u8; 100]);
                }
                assert_eq!(back, want, "block {i}");
                if i % 16 == 0 {
                    file.sync_data().await.unwrap();
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        let stats = thread_stats().unwrap();
        assert_eq!(stats.in_flight_ops, 0);
        assert_eq!(stats.waiting_for_admission, 0);
    });
}

/// Polls every future in turn on each wake, like `join_all`.
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(Option::unwrap).collect()
}

/// The same load within one task and without a `LocalSet`.
#[test]
fn many_concurrent_ops_in_one_task_without_a_local_set() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let file = open_direct(&fs_with(tight_config()), &path).await;
            let writes = (0..256u64)
                .map(|i| {
                    let file = &file;
                    async move { file.write_at(&pattern(4096, i), i * 4096).await }
                })
                .collect();
            for result in join_all(writes).await {
                result.unwrap();
            }
            let reads = (0..256u64)
                .map(|i| {
                    let file = &file;
                    async move { (i, read_vec(file, i * 4096, 4096).await) }
                })
                .collect();
            for (i, data) in join_all(reads).await {
                assert_eq!(data, pattern(4096, i), "block {i}");
            }
            assert_eq!(thread_stats().unwrap().in_flight_ops, 0);
        });
    })
    .join()
    .unwrap();
}

struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// `read_new` hands over a buffer the kernel filled: the same bytes as `read_at`, zeros past
/// the end of the file, in pieces of `max_op_bytes`, and unaligned ranges through the bounce
/// path.
#[test]
fn read_new_returns_what_read_at_reads() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let (file, data, size) = file_ending_mid_block(&path, 256 << 10, 11).await;
        let cases = [
            (0, 4096),
            (0, 128 << 10),
            (8192, 64 << 10),
            (size - size % 4096 - 8192, 16384),
            (size - size % 4096, 4096),
            (size + 4096, 8192),
            (5000, 40_000),
            (3, 1),
            (0, 0),
        ];
        for (offset, len) in cases {
            let back = file.read_new(offset as u64, len).await.unwrap();
            assert_eq!(back.len(), len);
            assert_eq!(back.as_slice().as_ptr() as usize % 4096, 0);
            for (i, byte) in back.as_slice().iter().enumerate() {
                let at = offset + i;
                let want = if at < size { data[at] } else { 0 };
                assert_eq!(*byte, want, "read_new of {len} at {offset}: byte {at}");
            }
        }
    });
}

/// `write_from` writes aligned data from the caller's own memory (no bounce buffer is ever
/// allocated for it), anything else through the bounce path, and data whose write was
/// dropped in flight stays alive until the kernel is done with it.
#[test]
fn write_from_sends_aligned_data_without_a_bounce_buffer() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let fs = direct_fs();
        let file = open_direct(&fs, &path).await;
        let aligned = |len: usize, seed: u64| {
            let mut buf = DiskBuf::zeroed(len);
            buf.as_mut_slice().copy_from_slice(&pattern(len, seed));
            buf.into_bytes()
        };
        let first = aligned(128 << 10, 1);
        file.write_from(first.clone(), 0, false).await.unwrap();
        let second = aligned(3 << 20, 2);
        file.write_from(second.clone(), 1 << 20, true)
            .await
            .unwrap();
        assert_eq!(
            thread_stats().unwrap().bounce_bytes_allocated,
            0,
            "aligned data needs no bounce buffer"
        );
        assert_eq!(read_vec(&file, 0, 128 << 10).await, first);
        assert_eq!(read_vec(&file, 1 << 20, 3 << 20).await, second);
        // Unaligned in memory: copied through a bounce buffer, written all the same.
        let backing = Bytes::from(pattern(8192 + 1, 3));
        let unaligned = backing.slice(1..);
        file.write_from(unaligned.clone(), 4096, true)
            .await
            .unwrap();
        assert!(thread_stats().unwrap().bounce_bytes_allocated > 0);
        assert_eq!(read_vec(&file, 4096, 8192).await, unaligned);
        // Dropped in flight: the ring keeps the data until the kernel is done with it, so
        // every block reads back as the new data or as it was (zeros), never as freed memory.
        let region = 8u64 << 20;
        file.set_len(region + (2 << 20)).await.unwrap();
        for round in 0..8u64 {
            let data = aligned(256 << 10, 10 + round);
            {
                let at = region + round * (256 << 10);
                let mut write = pin!(file.write_from(data.clone(), at, false));
                let _ = poll_once(write.as_mut());
            }
            drop(data);
        }
        wait_for_abandoned_operations().await;
        for round in 0..8u64 {
            let back = read_vec(&file, region + round * (256 << 10), 256 << 10).await;
            let want = pattern(256 << 10, 10 + round);
            for (block, (got, new)) in back.chunks(4096).zip(want.chunks(4096)).enumerate() {
                assert!(
                    got == new || got.iter().all(|b| *b == 0),
                    "round {round}, block {block}: neither the new data nor zeros"
                );
            }
        }
    });
}

/// Polls `future` once with a waker that does nothing.
fn poll_once<F: Future>(future: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn dropped_in_flight_operations_do_not_corrupt() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let config = UringConfig {
            bounce_pool_bytes: 4 << 20,
            ..Default::default()
        };
        let file = open_direct(&fs_with(config), &path).await;
        let data = pattern(16 << 20, 7);
        file.write_at(&data, 0).await.unwrap();
        file.sync_data().await.unwrap();
        for round in 0..20u64 {
            // A large read, dropped after it was submitted.
            {
                let mut big = vec![0u8; 16 << 20];
                let mut read = pin!(file.read_at(&mut big, round * 4096));
                assert!(poll_once(read.as_mut()).is_pending());
            }
            // A read into a new buffer, dropped after it was submitted: the ring keeps the
            // buffer alive until the kernel is done with it.
            {
                let mut read = pin!(file.read_new(round * 4096, 16 << 20));
                assert!(poll_once(read.as_mut()).is_pending());
            }
            // A write, dropped in flight: its range holds old or new data after, nothing else.
            {
                let fresh = pattern(1 << 20, 1000 + round);
                let mut write = pin!(file.write_at(&fresh, 8 << 20));
                let _ = poll_once(write.as_mut());
            }
            // Other operations still see the right data.
            let at = (round * 123_457) % (6 << 20);
            assert_eq!(
                read_vec(&file, at, 65536).await,
                data[at as usize..][..65536]
            );
        }
        wait_for_abandoned_operations().await;
        let tail = read_vec(&file, 9 << 20, 7 << 20).await;
        assert_eq!(tail, data[9 << 20..]);
    });
}

/// Every abandoned operation gives its slot and buffer back once it completes.
async fn wait_for_abandoned_operations() {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        reap_completions();
        let stats = thread_stats().unwrap();
        assert!(stats.bounce_bytes_allocated <= stats.bounce_bytes_limit);
        if stats.in_flight_ops == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "abandoned operations never finished"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A thread that ends with operations in flight (futures dropped, or leaked) waits for the
/// kernel before freeing its ring and buffers.
#[test]
fn thread_exit_with_operations_in_flight() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = open_direct(&direct_fs(), &path).await;
        file.write_at(&pattern(8 << 20, 13), 0).await.unwrap();
        let mut dropped = vec![0u8; 8 << 20];
        {
            let mut read = pin!(file.read_at(&mut dropped, 0));
            let _ = poll_once(read.as_mut());
        }
        let leaked: &'static mut [u8] = vec![0u8; 8 << 20].leak();
        let mut read = Box::pin(file.read_at(leaked, 0));
        let _ = poll_once(read.as_mut());
        std::mem::forget(read);
        assert!(thread_stats().unwrap().in_flight_ops >= 1);
    });
}

/// A future waiting for admission (pool exhausted) may be dropped too.
#[test]
fn dropped_waiters_for_admission_leave_no_trace() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let config = UringConfig {
            max_in_flight_ops: 2,
            ..tight_config()
        };
        let file = open_direct(&fs_with(config), &path).await;
        file.write_at(&pattern(1 << 20, 8), 0).await.unwrap();
        let mut a = vec![0u8; 16384];
        let mut b = vec![0u8; 16384];
        let mut c = vec![0u8; 16384];
        // A read that completes inside its first poll gives its grant back at once, and the
        // third is admitted: try again until the first two both have to wait.
        let mut attempts = 0;
        loop {
            attempts += 1;
            assert!(attempts <= 100, "the first two reads never both waited");
            wait_for_abandoned_operations().await;
            {
                let mut first = pin!(file.read_at(&mut a, 0));
                let mut second = pin!(file.read_at(&mut b, 16384));
                let mut third = pin!(file.read_at(&mut c, 32768));
                if poll_once(first.as_mut()).is_ready() || poll_once(second.as_mut()).is_ready() {
                    continue;
                }
                assert!(poll_once(third.as_mut()).is_pending());
                assert_eq!(thread_stats().unwrap().waiting_for_admission, 1);
            }
            assert_eq!(thread_stats().unwrap().waiting_for_admission, 0);
            break;
        }
        assert_eq!(
            read_vec(&file, 4096, 4096).await,
            pattern(1 << 20, 8)[4096..8192]
        );
    });
}

/// `reap_completions` wakes a waiting future without the runtime polling the ring's fd.
#[test]
fn reap_completions_wakes_waiting_futures() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = open_direct(&direct_fs(), &path).await;
        file.write_at(&pattern(65536, 9), 0).await.unwrap();
        let waker = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let mut buf = vec![0u8; 65536];
        // A read may complete inside its submission (a fast device); such a read shows nothing
        // about waking, so try again until one has to wait.
        let mut attempts = 0;
        loop {
            attempts += 1;
            assert!(
                attempts <= 100,
                "no read ever had to wait for its completion"
            );
            let mut read = pin!(file.read_at(&mut buf, 0));
            let std_waker = Waker::from(waker.clone());
            let mut cx = Context::from_waker(&std_waker);
            if read.as_mut().poll(&mut cx).is_ready() {
                continue;
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut reaped = 0;
            while waker.0.load(Ordering::SeqCst) == 0 {
                reaped += reap_completions();
                assert!(Instant::now() < deadline, "never woken");
                std::hint::spin_loop();
            }
            assert!(reaped >= 1);
            assert!(read.as_mut().poll(&mut cx).is_ready());
            break;
        }
        assert_eq!(buf, pattern(65536, 9));
    });
    assert_eq!(reap_completions(), 0, "no ring on this thread");
}

#[test]
fn errors_propagate_as_io_errors() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let fs = direct_fs();
        let file = open_direct(&fs, &path).await;
        // Past ext4's largest file (16 TiB with 4 KiB blocks): the kernel answers EFBIG.
        let far = 1u64 << 50;
        let error = file.write_at(&[0u8; 4096], far).await.unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EFBIG), "{error}");
        let error = file.allocate(far, 4096).await.unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EFBIG), "{error}");
        // Offsets the kernel cannot address are refused before they reach it.
        let error = file
            .read_at(&mut [0u8; 10], u64::MAX - 4)
            .await
            .unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        let error = file.punch_hole(1 << 63, 4096).await.unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        // fallocate of zero bytes is the kernel's EINVAL.
        let error = file.allocate(0, 0).await.unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EINVAL));
        // Opening a missing file without create, or a directory.
        let error = fs.open(&path.with_extension("missing"), false).await;
        assert_eq!(error.unwrap_err().kind(), io::ErrorKind::NotFound);
        let error = fs.open(path.parent().unwrap(), false).await.unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EISDIR));
        // The file still works after all that.
        file.write_at(&pattern(4096, 10), 0).await.unwrap();
        assert_eq!(read_vec(&file, 0, 4096).await, pattern(4096, 10));
    });
}

#[test]
fn a_thread_may_run_one_runtime_after_another() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    std::thread::spawn(move || {
        for round in 0..3u64 {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let file = open_direct(&direct_fs(), &path).await;
                let data = pattern(1 << 20, round);
                file.write_at(&data, 0).await.unwrap();
                assert_eq!(read_vec(&file, 0, 1 << 20).await, data);
            });
        }
    })
    .join()
    .unwrap();
}

/// Outside any runtime (a plain executor), a waiting future blocks its thread until done.
#[test]
fn without_a_runtime_operations_block_until_done() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(3 << 20, 11)).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let file = runtime.block_on(direct_fs().open(&path, false)).unwrap();
        drop(runtime);
        let mut buf = vec![0u8; 3 << 20];
        {
            let mut read = pin!(file.read_at(&mut buf, 0));
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match poll_once(read.as_mut()) {
                    Poll::Ready(result) => break result.unwrap(),
                    Poll::Pending => assert!(Instant::now() < deadline),
                }
            }
        }
        assert_eq!(buf, pattern(3 << 20, 11));
    })
    .join()
    .unwrap();
}

/// The contract checks every `Filesystem` shares, on both modes.
#[test]
fn filesystem_contract() {
    for direct in [true, false] {
        let dir = if direct { direct_dir() } else { shm_dir() };
        let root = dir.path().to_path_buf();
        on_fresh_thread(move || async move {
            let fs = if direct { direct_fs() } else { buffered_fs() };
            contract(&fs, &root).await;
        });
    }
}

async fn contract(fs: &UringFs, root: &Path) {
    let sub: PathBuf = root.join("a/b");
    fs.create_dir_all(&sub).await.unwrap();
    assert!(fs.exists(&sub).await.unwrap());
    let path = sub.join("f");
    let file = fs.open(&path, true).await.unwrap();
    fs.sync_dir(&sub).await.unwrap();
    assert_eq!(file.path(), path);
    assert_eq!(file.len().await.unwrap(), 0);
    // Reads past the end are zeros.
    assert_eq!(read_vec(&file, 0, 100).await, vec![0u8; 100]);
    let data = pattern(8192, 12);
    file.write_at(&data, 4096).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 12288);
    assert_eq!(read_vec(&file, 0, 4096).await, vec![0u8; 4096]);
    let back = read_vec(&file, 10_000, 5000).await;
    assert_eq!(&back[..2288], &data[10_000 - 4096..]);
    assert_eq!(&back[2288..], &vec![0u8; 5000 - 2288][..]);
    file.set_len(4096 + 100).await.unwrap();
    assert_eq!(read_vec(&file, 4096, 200).await[100..], [0u8; 100]);
    file.set_len(1 << 20).await.unwrap();
    assert_eq!(file.len().await.unwrap(), 1 << 20);
    assert_eq!(read_vec(&file, 8192, 4096).await, vec![0u8; 4096]);
    // Directory operations.
    let renamed = sub.join("g");
    fs.rename(&path, &renamed).await.unwrap();
    fs.sync_dir(&sub).await.unwrap();
    assert!(!fs.exists(&path).await.unwrap());
    fs.open(&sub.join("h"), true).await.unwrap();
    fs.create_dir_all(&sub.join("d")).await.unwrap();
    assert_eq!(
        fs.list_dir(&sub).await.unwrap(),
        vec![
            DirEntry {
                name: "d".into(),
                is_dir: true
            },
            DirEntry {
                name: "g".into(),
                is_dir: false
            },
            DirEntry {
                name: "h".into(),
                is_dir: false
            },
        ]
    );
    // The renamed file still has its data, through the old handle and a new one.
    assert_eq!(read_vec(&file, 4096, 100).await, data[..100]);
    let reopened = fs.open(&renamed, false).await.unwrap();
    assert_eq!(read_vec(&reopened, 4096, 100).await, data[..100]);
    fs.remove_file(&sub.join("h")).await.unwrap();
    let missing = fs.remove_file(&sub.join("h")).await.unwrap_err();
    assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    assert_eq!(
        fs.list_dir(&root.join("nope")).await.unwrap_err().kind(),
        io::ErrorKind::NotFound
    );
    fs.remove_dir(&sub.join("d")).await.unwrap();
    assert!(fs.free_bytes(root).await.unwrap() > 0);
    remove_tree(fs, &root.join("a")).await.unwrap();
    assert!(!fs.exists(&root.join("a")).await.unwrap());
}

/// A filesystem that really refuses O_DIRECT (ramfs), if this process may mount one: the
/// file opens through the page cache, and it is counted.
#[test]
fn ramfs_refuses_o_direct_and_falls_back() {
    let mount = direct_dir();
    let target = std::ffi::CString::new(mount.path().to_str().unwrap()).unwrap();
    // SAFETY: plain C strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            c"ramfs".as_ptr(),
            target.as_ptr(),
            c"ramfs".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        eprintln!(
            "skipped: cannot mount ramfs here ({})",
            io::Error::last_os_error()
        );
        return;
    }
    struct Unmount(std::ffi::CString);
    impl Drop for Unmount {
        fn drop(&mut self) {
            // SAFETY: a C string that outlives the call.
            unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
        }
    }
    let _unmount = Unmount(target);
    let path = mount.path().join("f");
    on_fresh_thread(move || async move {
        let before = ashlar_storage::fs::uring::buffered_fallback_opens();
        let file = direct_fs().open(&path, true).await.unwrap();
        assert_eq!(file.mode(), IoMode::Buffered);
        assert!(ashlar_storage::fs::uring::buffered_fallback_opens() > before);
        file.write_at(b"unaligned is fine here", 3).await.unwrap();
        assert_eq!(read_vec(&file, 3, 22).await, b"unaligned is fine here");
    });
}

/// The calling thread's ring counters `(submit_calls, entries_submitted)`.
fn submissions() -> (u64, u64) {
    let stats = thread_stats().unwrap();
    (stats.submit_calls, stats.entries_submitted)
}

/// Writes 32 blocks from one task in one turn; returns how many `io_uring_enter` calls and
/// entries that took, after checking every block reads back.
async fn write_a_turns_worth(file: &UringFile) -> (u64, u64) {
    file.write_at(&pattern(4096, 1), 0).await.unwrap();
    let before = submissions();
    let writes = (0..32u64).map(|i| async move {
        file.write_at(&pattern(4096, 200 + i), i * 4096)
            .await
            .unwrap()
    });
    join_all(writes.collect()).await;
    let after = submissions();
    for i in 0..32u64 {
        assert_eq!(read_vec(file, i * 4096, 4096).await, pattern(4096, 200 + i));
    }
    (after.0 - before.0, after.1 - before.1)
}

#[test]
fn a_submitter_sends_the_operations_of_a_turn_in_one_system_call() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = open_direct(&direct_fs(), &path).await;
        tokio::task::spawn_local(ashlar_storage::fs::uring::run_submitter());
        tokio::task::yield_now().await;
        // A second submitter on the same thread ends at once.
        ashlar_storage::fs::uring::run_submitter().await;
        let (calls, entries) = write_a_turns_worth(&file).await;
        assert_eq!(entries, 32);
        assert!(calls <= 2, "{calls} submissions for one turn's 32 writes");
    });
    let path = dir.path().join("g");
    on_fresh_thread(move || async move {
        // Without a submitter each operation goes as it starts.
        let file = open_direct(&direct_fs(), &path).await;
        let (calls, entries) = write_a_turns_worth(&file).await;
        assert_eq!((calls, entries), (32, 32));
    });
}

#[test]
fn a_durable_write_is_submitted_at_once_and_a_queued_one_when_the_submitter_runs_or_ends() {
    let dir = direct_dir();
    let path = dir.path().join("f");
    on_fresh_thread(move || async move {
        let file = open_direct(&direct_fs(), &path).await;
        let submitter = tokio::task::spawn_local(ashlar_storage::fs::uring::run_submitter());
        file.write_at(&pattern(4096, 1), 0).await.unwrap();

        let durable_data = pattern(4096, 2);
        let mut durable = pin!(file.write_durable_at(&durable_data, 4096));
        let before = submissions();
        let _ = poll_once(durable.as_mut());
        assert_eq!(
            submissions(),
            (before.0 + 1, before.1 + 1),
            "a commit waits for nobody"
        );
        durable.await.unwrap();

        let queued_data = pattern(4096, 3);
        let mut queued = pin!(file.write_at(&queued_data, 8192));
        let before = submissions();
        let _ = poll_once(queued.as_mut());
        assert_eq!(submissions(), before, "queued for the submitter");
        // The submitter goes away before it ran: ending, it submits what is queued.
        submitter.abort();
        assert!(submitter.await.unwrap_err().is_cancelled());
        assert_eq!(submissions(), (before.0 + 1, before.1 + 1));
        queued.await.unwrap();
        // With no submitter, operations go at once again.
        let before = submissions();
        let plain_data = pattern(4096, 4);
        let mut plain = pin!(file.write_at(&plain_data, 12288));
        let _ = poll_once(plain.as_mut());
        assert_eq!(submissions(), (before.0 + 1, before.1 + 1));
        plain.await.unwrap();
        for (i, seed) in [1, 2, 3, 4].into_iter().enumerate() {
            assert_eq!(
                read_vec(&file, i as u64 * 4096, 4096).await,
                pattern(4096, seed)
            );
        }
    });
}

/// Whole blocks of a `write_shared` batch go to the disk from the caller's aligned buffer (a
/// front-end's `DiskBuf` payload) without a bounce copy; unaligned or partial data still
/// lands through the copying path; either way the store reads back what was written.
#[test]
fn extent_store_writes_shared_aligned_payloads_without_a_copy() {
    use ashlar_core::VdiskId;
    use ashlar_storage::disk::{Disk, Tier};
    use ashlar_storage::extent_store::{ExtentStore, ExtentStoreConfig};
    let dir = direct_dir();
    let root = dir.path().to_path_buf();
    on_fresh_thread(move || async move {
        let config = ExtentStoreConfig {
            vdisk: VdiskId(9),
            disks: vec![Disk {
                path: root.clone(),
                tier: Tier::Fast,
            }],
            max_open_egroups: 2,
            max_writing_egroups: ashlar_storage::extent_store::DEFAULT_MAX_WRITING_EGROUPS,
            writes_in_flight_per_egroup:
                ashlar_storage::extent_store::DEFAULT_WRITES_IN_FLIGHT_PER_EGROUP,
            journal: None,
        };
        let store = ExtentStore::new(direct_fs(), config);
        let size = 6usize << 20;
        let mut model = vec![0u8; size];
        let mut payload = DiskBuf::zeroed(2 << 20);
        payload
            .as_mut_slice()
            .copy_from_slice(&pattern(2 << 20, 21));
        let payload = payload.into_bytes();
        store.write_shared(1 << 20, &payload).await.unwrap();
        model[1 << 20..3 << 20].copy_from_slice(&payload);
        assert!(
            thread_stats().unwrap().bounce_bytes_allocated < 1 << 20,
            "2 MiB of aligned data went through bounce buffers"
        );
        // Unaligned in memory and on the vdisk: partial blocks at both ends.
        let backing = Bytes::from(pattern(3 * 4096 + 1001, 22));
        let unaligned = backing.slice(1..);
        store
            .write_shared((3 << 20) - 4000, &unaligned)
            .await
            .unwrap();
        model[(3 << 20) - 4000..(3 << 20) - 4000 + unaligned.len()].copy_from_slice(&unaligned);
        let mut back = vec![0u8; size];
        store.read(0, &mut back).await.unwrap();
        assert!(back == model, "the store reads back what was written");
    });
}
