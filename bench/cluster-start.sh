# cluster-start.sh — sourced by cluster.sh and cluster-restore.sh: starts etcd and three
# `ashlar node --etcd` processes on loopback and waits until each serves.
#   start_cluster BASE_DIR ETCD_PORT PREFIX LEASE_TTL_MS [NODE_ARGS...]
# (plus NODE_ARGS_1, NODE_ARGS_2, NODE_ARGS_3 from the environment: flags for one node)
# Node n listens on <PREFIX>n809 (NBD), n810 (HTTP), n260 (iSCSI), n811 (node-to-node) and
# keeps its data in BASE_DIR/node<n>, its log in BASE_DIR/node<n>.log. Sets PIDS (etcd and
# the nodes, stopped at exit) and NODE_PID[n]. Needs ASHLAR_BIN, etcd and curl.
declare -A NODE_PID
PIDS=()

#   prepare_cluster_run BASE_DIR OUT_DIR : checks the binary and tools, empties BASE_DIR,
#   creates OUT_DIR, and stops everything started at exit.
prepare_cluster_run() {
    [ -x "$ASHLAR_BIN" ] || { echo "no binary at $ASHLAR_BIN (cargo build --release -p ashlar)" >&2; exit 1; }
    local tool
    for tool in etcd fio jq curl; do
        command -v "$tool" >/dev/null || { echo "$tool is missing (apt-get install etcd-server fio jq curl)" >&2; exit 1; }
    done
    rm -rf "$1"
    mkdir -p "$1" "$2"
    trap stop_cluster EXIT
}

stop_cluster() { local pid; for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
start_cluster() {
    local base=$1 etcd_port=$2 prefix=$3 lease_ttl_ms=$4 n
    shift 4
    etcd --data-dir "$base/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
        --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" > "$base/etcd.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 50); do
        curl -sf "http://127.0.0.1:$etcd_port/health" >/dev/null 2>&1 && break
        sleep 0.2
    done
    for n in 1 2 3; do
        # NODE_ARGS_<n>: flags for node n only (e.g. --reactor-cpus), split on spaces.
        local extra="NODE_ARGS_$n"
        "$ASHLAR_BIN" node --data-dir "$base/node$n" --etcd "http://127.0.0.1:$etcd_port" \
            --advertise 127.0.0.1 --nbd-listen "127.0.0.1:${prefix}${n}809" \
            --http-listen "127.0.0.1:${prefix}${n}810" --iscsi-listen "127.0.0.1:${prefix}${n}260" \
            --node-listen "127.0.0.1:${prefix}${n}811" --node-lease-ttl-ms "$lease_ttl_ms" "$@" \
            ${!extra:-} \
            > "$base/node$n.log" 2>&1 &
        PIDS+=($!)
        NODE_PID[$n]=$!
    done
    for n in 1 2 3; do
        for _ in $(seq 100); do
            curl -sf "http://127.0.0.1:${prefix}${n}810/healthz" >/dev/null 2>&1 && break
            sleep 0.2
        done
    done
}
