#!/usr/bin/env bash
# ashlar-cluster.sh — a 3-node Ashlar cluster in the peers' table, beside ceph.sh's 3-OSD
# cluster: etcd and three `ashlar node --etcd` processes on 127.0.0.1 (one disk and the same
# two CPUs for every copy, as Ceph's OSDs share them), one vdisk per replication factor,
# claimed by node 1 and driven through node 1 by fio's nbd engine with the same workload
# matrix as every peer script (lib.sh's run_matrix).
#   ashlar-rfN : a vdisk with N copies (node 1 first; writes durable on every copy at ack)
# Server CPU = all three node processes (etcd is not counted: it sees no requests per I/O).
# Same run as Ceph (issue 7's benchmark):
#   ONLY=ceph CEPH_POOL_SIZES="2 3" EXTRA_SCRIPTS=$PWD/bench/ashlar-cluster.sh \
#     WORKLOADS="randread4k randwrite4k randrw8k" QDS="1 32" RUNTIME=15 SIZE=2G \
#     ../shared/bench/peers/run-all.sh
# then bench/cluster-vs-ceph.py RESULTS_DIR for the issue's ratios.
# Knobs (environment): see ../shared/bench/peers/lib.sh; ASHLAR_BIN (default: release build),
#   ASHLAR_CLUSTER_RFS="1 2 3", ASHLAR_CLUSTER_PORT_BASE=2 (node n uses ports <base>n809..811),
#   ASHLAR_CLUSTER_NODE_ARGS (extra `ashlar node` flags, e.g. "--cache-size 3G"),
#   ASHLAR_CLUSTER_WARM=0 (1: read the vdisk twice after the fill, 1 MiB then 4 KiB reads, so
#   reads start from the cache; give the nodes a --cache-size of at least reactors x SIZE,
#   since a vdisk's one shard uses one reactor's share of the cache).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=${PEERS:-$HERE/../../shared/bench/peers}
source "$PEERS/lib.sh"
init_results ashlar-cluster
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
ASHLAR_CLUSTER_RFS=${ASHLAR_CLUSTER_RFS:-"1 2 3"}
BASE=${ASHLAR_CLUSTER_PORT_BASE:-2}
ETCD_PORT=${ASHLAR_CLUSTER_ETCD_PORT:-23791}
NODE_ARGS=${ASHLAR_CLUSTER_NODE_ARGS:-}
WARM=${ASHLAR_CLUSTER_WARM:-0}
ensure_pkgs fio jq time libnbd-bin etcd-server || { note ashlar-cluster "could not install packages"; exit 1; }
[ -x "$ASHLAR_BIN" ] || { note ashlar-cluster "no binary at $ASHLAR_BIN (cargo build --release)"; exit 1; }

CLUSTER_DIR=$DATA_DIR/ashlar-cluster
PIDS=()
cleanup() {
    kill_bounded
    for pid in "${PIDS[@]}"; do stop_pid "$pid" ashlar-cluster; done
    PIDS=()
}
trap cleanup EXIT
trap 'exit 143' TERM INT

rm -rf "$CLUSTER_DIR"; mkdir -p "$CLUSTER_DIR"
etcd --data-dir "$CLUSTER_DIR/etcd" --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 1))" > "$RESULTS_DIR/logs/ashlar-cluster.etcd.log" 2>&1 &
PIDS+=($!)
wait_port 127.0.0.1 "$ETCD_PORT" 30 || { note ashlar-cluster "etcd did not start"; exit 1; }
NODE_PIDS=""
for n in 1 2 3; do
    RUST_LOG=warn "$ASHLAR_BIN" node --data-dir "$CLUSTER_DIR/node$n" --etcd "http://127.0.0.1:$ETCD_PORT" \
        --advertise 127.0.0.1 --nbd-listen "127.0.0.1:${BASE}${n}809" --http-listen "127.0.0.1:${BASE}${n}810" \
        --iscsi-listen "127.0.0.1:${BASE}${n}260" --node-listen "127.0.0.1:${BASE}${n}811" $NODE_ARGS \
        > "$RESULTS_DIR/logs/ashlar-cluster.node$n.log" 2>&1 &
    PIDS+=($!)
    NODE_PIDS="$NODE_PIDS $!"
done
for n in 1 2 3; do
    wait_port 127.0.0.1 "${BASE}${n}810" 60 || { note ashlar-cluster "node $n did not start"; exit 1; }
done
sleep 2 # every node registered and listed up before the first claim places copies

for rf in $ASHLAR_CLUSTER_RFS; do
    sys=ashlar-rf$rf
    uri=nbd://127.0.0.1:${BASE}1809/rf$rf
    "$ASHLAR_BIN" --server "http://127.0.0.1:${BASE}1810" vdisk create "rf$rf" --size "$SIZE" --rf "$rf" \
        >/dev/null || { note "$sys" "vdisk create failed"; continue; }
    log "filling $sys"
    run_bounded 1800 "$FIO" --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M \
        --iodepth=8 >/dev/null 2>&1 || note "$sys" "pre-fill failed (reads may hit holes)"
    if [ "$WARM" = 1 ]; then
        # Two reads of every block: the cache keeps a block in its protected pool only once
        # it was read twice (one pass stays in the small scan-resistant pool).
        log "warming node 1's read cache for $sys"
        run_bounded 900 "$FIO" --name=warm --ioengine=nbd --uri="$uri" --rw=read --bs=1M \
            --iodepth=8 >/dev/null 2>&1 || true
        run_bounded 900 "$FIO" --name=warm2 --ioengine=nbd --uri="$uri" --rw=read --bs=4k \
            --iodepth=32 >/dev/null 2>&1 || true
    fi
    sleep 5 # the fill's oplogs drain before the first job
    note "$sys" "ashlar $("$ASHLAR_BIN" --version | awk '{print $2}'), 3 nodes on one host, RF $rf, vdisk $SIZE claimed by node 1 (client on node 1), node flags '${NODE_ARGS:-defaults}', cache warmed: $WARM; writes durable on every copy at acknowledgement"
    log "== $sys: $uri runtime=${RUNTIME}s"
    SERVER_PIDS=$NODE_PIDS
    run_matrix "$sys" --ioengine=nbd --uri="$uri"
done
cleanup
finish_standalone
