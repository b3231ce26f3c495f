//! Connection placement: a connection accepted on a reactor that runs none of its vdisk's
//! shards moves, after the handshake, to one that does. Moved connections must serve data
//! exactly like the others, for our client and for fio's (with verification), and the node
//! must still count them, so SIGTERM waits for them.

mod common;

use common::nbd::NbdConn;
use common::{fio_args, run_fio, Node, Rng, MIB};

#[test]
fn connections_move_next_to_a_one_shard_vdisk_and_keep_their_data() {
    // Two reactors (the suite's default), one shard: every other connection starts on the
    // reactor without the shard.
    let mut node = Node::start_with(&["--ensure-vdisk", "one:64M", "--default-shards", "1"]);
    assert_eq!(node.show("one")["shards"], 1);
    node.sigterm_and_wait();
    node.rust_log = "info,ashlar=debug".to_string();
    node.restart();

    let mut conns: Vec<NbdConn> = (0..4)
        .map(|_| NbdConn::connect(node.nbd_addr(), "one").expect("connect"))
        .collect();
    for (i, conn) in conns.iter_mut().enumerate() {
        let data = Rng::new(i as u64).bytes(8192);
        conn.write_ok(i as u64 * MIB + 4096, &data);
    }
    assert_eq!(node.vdisk_stats("one")["connections"], 4);
    // Each connection reads every other connection's block: all of them see one vdisk.
    for conn in conns.iter_mut() {
        for j in 0..4u64 {
            let want = Rng::new(j).bytes(8192);
            assert_eq!(conn.read_ok(j * MIB + 4096, 8192), want, "block {j}");
        }
    }
    for conn in conns {
        conn.disconnect();
    }

    let fio = run_fio(&fio_args(
        &node.uri("one"),
        "moved",
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            "--numjobs=2",
            "--offset_increment=32M",
            "--do_verify=1",
        ],
    ));
    fio.assert_ok("2 jobs x 16M randwrite + verify on a one-shard vdisk");

    let moved = node.log().matches("moved next to its shards").count();
    assert!(
        moved >= 3,
        "of 6 connections alternating between 2 reactors, at least 3 should have moved; \
         the log says {moved}"
    );
    assert_eq!(node.vdisk_stats("one")["errors"], 0);
    assert!(node.sigterm_and_wait().success());
}
