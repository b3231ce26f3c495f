# iscsi-probe-lib.sh — what iscsi-cpu.sh and qd1-turnaround-probe.sh share: sourced, not run.
# iscsi_probe_node BIN DIR PORT VDISK_SIZE starts one node (2 reactors, 3 GiB cache, plus
# NODE_ARGS) on a fresh DIR with vdisk `bench` as LUN 0 of iqn.2024-01.io.ashlar:bench, its
# iSCSI portal on 127.0.0.1:PORT, NBD on PORT+1 and HTTP on PORT+2, attached for fio's
# libiscsi initiator; stops it when the script exits. Sets NODE (its pid), INITIATOR and
# ISCSI_FN (fio's --filename for the LUN).
iscsi_probe_node() {
    local bin=$1 dir=$2 port=$3 size=$4
    INITIATOR=iqn.2019-04.org.fio:fio
    ISCSI_FN="iscsi\\://127.0.0.1\\:$port/iqn.2024-01.io.ashlar\\:bench/0"
    rm -rf "$dir"; mkdir -p "$dir"
    # shellcheck disable=SC2086 # NODE_ARGS is a list of flags
    RUST_LOG=warn "$bin" node --data-dir "$dir" --nbd-listen "127.0.0.1:$((port + 1))" \
        --http-listen "127.0.0.1:$((port + 2))" --iscsi-listen "127.0.0.1:$port" --reactors 2 \
        --cache-size 3G --ensure-vdisk "bench:$size" ${NODE_ARGS:-} > "$dir.log" 2>&1 &
    NODE=$!
    trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null || true' EXIT
    for _ in $(seq 50); do curl -sf "http://127.0.0.1:$((port + 2))/healthz" >/dev/null && break; sleep 0.2; done
    ASHLAR_SERVER=http://127.0.0.1:$((port + 2)) "$bin" vg create bench >/dev/null
    ASHLAR_SERVER=http://127.0.0.1:$((port + 2)) "$bin" vg add-disk bench bench >/dev/null
    ASHLAR_SERVER=http://127.0.0.1:$((port + 2)) "$bin" vg attach bench --initiator "$INITIATOR" >/dev/null
}
