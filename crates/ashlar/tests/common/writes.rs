//! Pipelined writes whose outcome is tracked per 4 KiB block, for crash and power-cut tests:
//! after the node is stopped (kill -9, SIGTERM, a power cut) and restarted, every block must
//! hold the newest write that was acknowledged, or the write still in flight at the stop, and
//! nothing else (no older data, no torn or foreign data).

use super::nbd::{read_simple_reply, request_bytes, NbdConn, CMD_WRITE};
use super::{Node, Rng, MIB};
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The data of write `seq` to the block at `offset`: 16-byte records (byte offset of the
/// record in the vdisk, sequence number), so a block from another write, another offset, or a
/// mix of two writes is recognised.
pub fn pattern(offset: u64, seq: u64, len: usize) -> Vec<u8> {
    let mut data = Vec::with_capacity(len);
    for i in 0..(len / 16) as u64 {
        data.extend_from_slice(&(offset + i * 16).to_le_bytes());
        data.extend_from_slice(&seq.to_le_bytes());
    }
    data
}

/// What a block looks like, for failure messages.
pub fn describe_block(block: &[u8]) -> String {
    if block.iter().all(|&b| b == 0) {
        return "zeros".into();
    }
    let first_offset = u64::from_le_bytes(block[0..8].try_into().unwrap());
    let first_seq = u64::from_le_bytes(block[8..16].try_into().unwrap());
    let n = block.len() / 16;
    let last = &block[(n - 1) * 16..];
    let last_seq = u64::from_le_bytes(last[8..16].try_into().unwrap());
    format!("first record (offset {first_offset}, seq {first_seq}), last record seq {last_seq}")
}

/// Tracking granularity: every 4 KiB block of the region.
pub const BLOCK: u64 = 4096;

#[derive(Default, Clone, Copy)]
pub struct Slot {
    /// Sequence number of the newest acknowledged write covering this block.
    pub acked: Option<u64>,
    /// The write covering this block whose reply has not arrived. At most one per block at a
    /// time, so the outcome never depends on how the server orders concurrent overlapping
    /// writes (NBD does not order them).
    pub in_flight: Option<u64>,
}

#[derive(Default)]
struct Tracker {
    slots: Vec<Slot>,
    /// cookie (= seq) → (first slot, slot count)
    pending: HashMap<u64, (usize, usize)>,
    acked_writes: u64,
    failures: Vec<String>,
}

pub struct CrashRun {
    pub slots: Vec<Slot>,
    pub acked_writes: u64,
}

/// Writes at random offsets of `[0, region)` with up to 32 in flight, each write of a size
/// picked from `sizes` and aligned to its size, for 3 s (running `during` meanwhile), then
/// SIGKILLs the node while writes are still in flight.
pub fn write_until_killed(
    node: &mut Node,
    vdisk: &str,
    sizes: &'static [u64],
    region: u64,
    during: impl FnOnce(&Node),
) -> CrashRun {
    write_until_stopped(node, vdisk, sizes, region, during, |node| node.kill9())
}

/// `write_until_killed` with another way to stop the node (`stop` returns once it exited).
pub fn write_until_stopped(
    node: &mut Node,
    vdisk: &str,
    sizes: &'static [u64],
    region: u64,
    during: impl FnOnce(&Node),
    stop_node: impl FnOnce(&mut Node),
) -> CrashRun {
    let conn = NbdConn::connect(node.nbd_addr(), vdisk).expect("connecting");
    let nslots = (region / BLOCK) as usize;
    let tracker = Arc::new(Mutex::new(Tracker {
        slots: vec![Slot::default(); nslots],
        ..Default::default()
    }));
    let mut write_stream = conn.stream.try_clone().unwrap();
    let mut read_stream = conn.stream.try_clone().unwrap();
    read_stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    // Tokens bound the writes in flight; the reader returns one per reply.
    let (token_tx, token_rx) = mpsc::sync_channel::<()>(32);
    for _ in 0..32 {
        token_tx.send(()).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));

    let reader = {
        let tracker = tracker.clone();
        std::thread::spawn(move || {
            // Owns the only sender: when it ends, the writer's recv fails and it stops.
            let token_tx = token_tx;
            loop {
                let (error, cookie) = match read_simple_reply(&mut read_stream) {
                    Ok(reply) => reply,
                    Err(_) => return, // the node was killed
                };
                let mut t = tracker.lock().unwrap();
                let Some((first, count)) = t.pending.remove(&cookie) else {
                    t.failures
                        .push(format!("reply with unknown cookie {cookie}"));
                    return;
                };
                if error != 0 {
                    t.failures.push(format!(
                        "write seq {cookie} at {} failed with errno {error}",
                        first as u64 * BLOCK
                    ));
                    return;
                }
                for slot in &mut t.slots[first..first + count] {
                    slot.in_flight = None;
                    slot.acked = Some(cookie);
                }
                t.acked_writes += 1;
                drop(t);
                let _ = token_tx.try_send(());
            }
        })
    };

    let writer = {
        let tracker = tracker.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rng = Rng::new(region ^ sizes.len() as u64);
            let mut seq = 0u64;
            while !stop.load(Ordering::SeqCst) {
                if token_rx.recv().is_err() {
                    return;
                }
                let (offset, size, this_seq) = loop {
                    let mut t = tracker.lock().unwrap();
                    // In-flight writes may cover the whole region: then let replies in (they
                    // need the lock) and try again, rather than spin holding it.
                    let free = (0..64).find_map(|_| {
                        let size = sizes[rng.below(sizes.len() as u64) as usize];
                        let count = (size / BLOCK) as usize;
                        let first = rng.below(region / size) as usize * count;
                        t.slots[first..first + count]
                            .iter()
                            .all(|s| s.in_flight.is_none())
                            .then_some((first, count))
                    });
                    let Some((first, count)) = free else {
                        drop(t);
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    };
                    seq += 1;
                    // Recorded before a byte is sent: once sent, it may be applied.
                    for slot in &mut t.slots[first..first + count] {
                        slot.in_flight = Some(seq);
                    }
                    t.pending.insert(seq, (first, count));
                    break (first as u64 * BLOCK, count as u64 * BLOCK, seq);
                };
                let data = pattern(offset, this_seq, size as usize);
                let request = request_bytes(CMD_WRITE, 0, this_seq, offset, size as u32, &data);
                if write_stream.write_all(&request).is_err() {
                    return; // the node was killed
                }
            }
        })
    };

    let started = Instant::now();
    during(node);
    let left = Duration::from_secs(3).saturating_sub(started.elapsed());
    std::thread::sleep(left);
    // Stop the node while writes are in flight. When the writer, not the node, is the
    // bottleneck (a loaded machine), none may be in flight at a given instant: look again
    // for a while before calling the writer stuck.
    let looked = Instant::now();
    loop {
        let t = tracker.lock().unwrap();
        assert!(t.failures.is_empty(), "write failures: {:?}", t.failures);
        if !t.pending.is_empty() {
            break;
        }
        assert!(
            looked.elapsed() < Duration::from_secs(5),
            "no write in flight after {:?}: the writer is stuck",
            started.elapsed()
        );
        drop(t);
        std::thread::sleep(Duration::from_micros(200));
    }
    stop_node(node);
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    reader.join().unwrap();
    let t = tracker.lock().unwrap();
    assert!(t.failures.is_empty(), "write failures: {:?}", t.failures);
    eprintln!(
        "{} writes of {sizes:?} bytes acknowledged before the kill, {} in flight",
        t.acked_writes,
        t.pending.len()
    );
    CrashRun {
        slots: t.slots.clone(),
        acked_writes: t.acked_writes,
    }
}

/// Reads every block back after the restart and checks it against what was acknowledged.
pub fn check_after_restart(node: &Node, vdisk: &str, run: &CrashRun) {
    let mut conn = NbdConn::connect(node.nbd_addr(), vdisk).expect("connecting after restart");
    let region = run.slots.len() as u64 * BLOCK;
    let data = conn
        .read_range(0, region, MIB as u32)
        .expect("reading the region back");
    let zeros = vec![0u8; BLOCK as usize];
    let mut bad = Vec::new();
    let mut newer_than_acked = 0;
    for (i, slot) in run.slots.iter().enumerate() {
        let offset = i as u64 * BLOCK;
        let got = &data[offset as usize..(offset + BLOCK) as usize];
        let acked_ok = match slot.acked {
            Some(seq) => got == pattern(offset, seq, BLOCK as usize).as_slice(),
            None => got == zeros.as_slice(),
        };
        let in_flight_ok = slot
            .in_flight
            .is_some_and(|seq| got == pattern(offset, seq, BLOCK as usize).as_slice());
        if in_flight_ok {
            newer_than_acked += 1;
        }
        if !acked_ok && !in_flight_ok {
            bad.push(format!(
                "block at {offset}: expected {} or in-flight {:?}, found {}",
                slot.acked
                    .map_or("zeros (never acknowledged)".into(), |s| format!("seq {s}")),
                slot.in_flight,
                describe_block(got)
            ));
        }
    }
    eprintln!(
        "{newer_than_acked} of {} blocks of in-flight writes hold the new data",
        run.slots.iter().filter(|s| s.in_flight.is_some()).count()
    );
    assert!(
        bad.is_empty(),
        "{} of {} blocks lost acknowledged data or hold garbage after kill -9 and restart; \
         first ones:\n{}",
        bad.len(),
        run.slots.len(),
        bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n")
    );
    // The node keeps working: a fresh write reads back.
    let fresh = pattern(0, u64::MAX, MIB as usize);
    conn.write_ok(0, &fresh);
    assert_eq!(conn.read_ok(0, MIB as u32), fresh);
}
