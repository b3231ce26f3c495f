#!/usr/bin/env bash
# iscsi.sh — the iSCSI benchmark of issue 8: tgt and Ashlar over iSCSI, and Ashlar over NBD on
# the same vdisk, with the same fio jobs, in one run. Rows land in the same results.tsv as the
# peers' matrix:
#   tgt-iscsi        : tgtd (Debian's tgt), rdwr backing store on the shared ext4 image
#                      ($DATA_DIR/disk.img, SIZE, page cache warmed first), iSCSI limits raised as
#                      ../shared/bench/peers/tgt.sh does with TGT_TUNE=1; fio's libiscsi engine
#   ashlar-iscsi     : an `ashlar node` serving vdisk `bench` (SIZE) as LUN 0 of target
#                      iqn.2024-01.io.ashlar:bench (volume group `bench`, fio's initiator name
#                      attached); fio's libiscsi engine
#   ashlar-iscsi-nbd : the same node and vdisk through fio's nbd engine
# The vdisk is filled with 1 MiB sequential writes and read once (1 MiB, then 4 KiB QD32) before
# the jobs, as ashlar.sh does for `ashlar`, so 4 KiB reads come from the node's cache (ISCSI_CACHE,
# larger than SIZE) and never from holes; reads over 128 KiB (the 1 MiB jobs) skip the cache
# and come from the disk (MAX_INLINE_READ_BYTES); tgt's reads come from the kernel page cache.
# The three systems run job by job, interleaved (tgt, then Ashlar iSCSI and Ashlar NBD, which
# take turns going first), so a change in the machine's load hits all three alike. One
# unmeasured 4 KiB random write job after the fill warms Ashlar's write path (oplog segments). Before every job the node's oplog is let
# drain (as cold.sh does), so no row is charged (or disturbed by) another row's drain; the node
# CPU spent in those waits is recorded in the notes.
# tgt is set up here with the commands of tgt.sh (not by running tgt.sh, which runs its own
# matrix, iscsi-perf and compliance suite one system at a time).
#
# Knobs (environment; RUNTIME, RAMP, SIZE, DATA_DIR are in lib.sh):
#   ISCSI_JOBS="randread4k:1 randread4k:32 randwrite4k:1 randwrite4k:32 seqread1m:8 seqwrite1m:8"
#   ISCSI_SYSTEMS="tgt ashlar-iscsi ashlar-nbd"   which of the three run
#   ISCSI_CACHE=6G (the node's --cache-size), ASHLAR_REACTORS=2, ASHLAR_BIN,
#   ISCSI_NODE_ARGS (more `ashlar node` flags, e.g. "--poll-window-us 0"),
#   ISCSI_TGT_PORT=3263 ISCSI_TGT_CTL=63 (tgtd portal and control socket number),
#   ISCSI_ASHLAR_PORT=10831 ISCSI_NBD_PORT=10832 ISCSI_HTTP_PORT=10833,
#   ISCSI_TGT_TUNE=1 (0: tgt's stock iSCSI limits), ISCSI_TGT_BSOFLAGS= (e.g. direct),
#   ISCSI_INITIATOR=iqn.2019-04.org.fio:fio (fio's libiscsi engine's default initiator name),
#   DRAIN_WAIT=120, FIO_ISCSI (default: ../shared/bench/peers/build-fio-libiscsi.sh builds it)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PEERS=${PEERS:-$HERE/../../shared/bench/peers}
source "$PEERS/lib.sh"
init_results iscsi
ISCSI_JOBS=${ISCSI_JOBS:-"randread4k:1 randread4k:32 randwrite4k:1 randwrite4k:32 seqread1m:8 seqwrite1m:8"}
ISCSI_SYSTEMS=${ISCSI_SYSTEMS:-"tgt ashlar-iscsi ashlar-nbd"}
ISCSI_CACHE=${ISCSI_CACHE:-6G}
ASHLAR_REACTORS=${ASHLAR_REACTORS:-2}
ASHLAR_BIN=${ASHLAR_BIN:-$HERE/../target/release/ashlar}
ISCSI_TGT_PORT=${ISCSI_TGT_PORT:-3263}
ISCSI_TGT_CTL=${ISCSI_TGT_CTL:-63}
ISCSI_ASHLAR_PORT=${ISCSI_ASHLAR_PORT:-10831}
ISCSI_NBD_PORT=${ISCSI_NBD_PORT:-10832}
ISCSI_HTTP_PORT=${ISCSI_HTTP_PORT:-10833}
ISCSI_TGT_TUNE=${ISCSI_TGT_TUNE:-1}
ISCSI_TGT_BSOFLAGS=${ISCSI_TGT_BSOFLAGS:-}
ISCSI_INITIATOR=${ISCSI_INITIATOR:-iqn.2019-04.org.fio:fio}
DRAIN_WAIT=${DRAIN_WAIT:-120}
TGT_IQN=iqn.2024-01.bench.peers:tgt-iscsi
ASHLAR_IQN=iqn.2024-01.io.ashlar:bench

has() { case " $2 " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
die() { note iscsi "$*"; log "ERROR: $*"; exit 1; }

ensure_pkgs fio jq time curl libnbd-bin tgt libiscsi-bin || die "could not install fio jq time curl libnbd-bin tgt libiscsi-bin"
for tool in tgtd tgtadm iscsi-readcapacity16 jq curl /usr/bin/time; do
    command -v "$tool" >/dev/null 2>&1 || die "missing tool: $tool (Debian packages tgt, libiscsi-bin, jq, curl, time)"
done
if has ashlar-iscsi "$ISCSI_SYSTEMS" || has ashlar-nbd "$ISCSI_SYSTEMS"; then
    [ -x "$ASHLAR_BIN" ] || die "no Ashlar binary at $ASHLAR_BIN (set ASHLAR_BIN or cargo build --release)"
fi
if [ -z "${FIO_ISCSI:-}" ]; then
    FIO_ISCSI=$("$PEERS/build-fio-libiscsi.sh" 2> "$RESULTS_DIR/logs/build-fio-libiscsi.log") ||
        die "could not build fio with the libiscsi engine (see logs/build-fio-libiscsi.log; it needs libiscsi-dev zlib1g-dev dpkg-dev gcc make pkg-config and deb-src access)"
fi
"$FIO_ISCSI" --enghelp 2>/dev/null | grep -qx $'\tlibiscsi' || die "$FIO_ISCSI has no libiscsi engine"
log "fio with libiscsi: $FIO_ISCSI"

TGTD_PID="" NODE_PID=""
NODE_DIR=$DATA_DIR/ashlar-iscsi
API=http://127.0.0.1:$ISCSI_HTTP_PORT
tgtctl() { timeout 30 tgtadm -C "$ISCSI_TGT_CTL" "$@"; }
stop_tgtd() {
    [ -n "$TGTD_PID" ] || return 0
    if kill -0 "$TGTD_PID" 2>/dev/null; then
        # tgtd ignores SIGTERM while it has targets: take them down, then the system (as tgt.sh).
        tgtctl --lld iscsi --op delete --mode target --tid 1 --force >/dev/null 2>&1
        tgtctl --op delete --mode system >/dev/null 2>&1
        local i; for ((i = 0; i < 50; i++)); do kill -0 "$TGTD_PID" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$TGTD_PID" 2>/dev/null && { log "tgtd still up, KILL $TGTD_PID"; kill -KILL "$TGTD_PID"; }
    fi
    TGTD_PID=""
}
cleanup() {
    kill_bounded
    stop_tgtd
    stop_pid "$NODE_PID" ashlar; NODE_PID=""
    rm -rf "$NODE_DIR"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

# --- tgt (the commands of tgt.sh) ---
TGT_FN=""
if has tgt "$ISCSI_SYSTEMS"; then
    fill_file "$DISK_IMG" || die "could not create $DISK_IMG"
    warm_cache "$DISK_IMG"
    port_free "$ISCSI_TGT_PORT" || die "port $ISCSI_TGT_PORT busy (set ISCSI_TGT_PORT)"
    tgtctl --op show --mode system >/dev/null 2>&1 && die "a tgtd already answers on control port $ISCSI_TGT_CTL; set ISCSI_TGT_CTL"
    tgtd -f -C "$ISCSI_TGT_CTL" --iscsi "portal=127.0.0.1:$ISCSI_TGT_PORT" > "$RESULTS_DIR/logs/tgt-iscsi.tgtd.log" 2>&1 &
    TGTD_PID=$!
    wait_port 127.0.0.1 "$ISCSI_TGT_PORT" 20 || die "tgtd did not listen: $(tail -3 "$RESULTS_DIR/logs/tgt-iscsi.tgtd.log" | tr '\n' ' ')"
    for _ in $(seq 50); do tgtctl --op show --mode system >/dev/null 2>&1 && break; sleep 0.1; done
    bsargs=(--bstype rdwr)
    [ -n "$ISCSI_TGT_BSOFLAGS" ] && bsargs+=(--bsoflags "$ISCSI_TGT_BSOFLAGS")
    { tgtctl --lld iscsi --op new --mode target --tid 1 -T "$TGT_IQN" &&
      tgtctl --lld iscsi --op new --mode logicalunit --tid 1 --lun 1 -b "$DISK_IMG" "${bsargs[@]}" &&
      tgtctl --lld iscsi --op bind --mode target --tid 1 -I ALL; } || die "tgtadm target setup failed"
    tuned="stock iSCSI limits"
    if [ "$ISCSI_TGT_TUNE" = 1 ]; then
        for kv in MaxRecvDataSegmentLength=262144 MaxXmitDataSegmentLength=262144 \
                  FirstBurstLength=262144 MaxBurstLength=1048576; do
            tgtctl --lld iscsi --op update --mode target --tid 1 -n "${kv%=*}" -v "${kv#*=}" ||
                note tgt-iscsi "could not set $kv"
        done
        tuned="MaxRecv/XmitDataSegmentLength=256K FirstBurstLength=256K MaxBurstLength=1M"
    fi
    iscsi-readcapacity16 -i "$ISCSI_INITIATOR" "iscsi://127.0.0.1:$ISCSI_TGT_PORT/$TGT_IQN/1" \
        > "$RESULTS_DIR/logs/tgt-iscsi.readcapacity16.log" 2>&1 ||
        die "tgt LUN does not answer READ CAPACITY 16: $(tail -2 "$RESULTS_DIR/logs/tgt-iscsi.readcapacity16.log" | tr '\n' ' ')"
    note tgt-iscsi "tgt $(dpkg-query -W -f='${Version}' tgt), tgtd pid $TGTD_PID, rdwr backing store${ISCSI_TGT_BSOFLAGS:+ bsoflags=$ISCSI_TGT_BSOFLAGS} (pread/pwrite through the page cache, no O_DIRECT) on $DISK_IMG ($SIZE, ext4, page cache warmed with one sequential read), $tuned; writes land in the page cache (not durable at ack: fio's libiscsi engine sends WRITE16 without FUA and no SYNCHRONIZE CACHE)"
    TGT_FN="iscsi\\://127.0.0.1\\:$ISCSI_TGT_PORT/${TGT_IQN//:/\\:}/1"
fi

# --- Ashlar node, vdisk, volume group ---
ASHLAR_FN="" NBD_URI=""
# wait_drained : until the node's oplog holds at most 1 MiB or has not shrunk for 5 s (cold.sh)
DRAIN_TICKS=0
wait_drained() {
    [ -n "$NODE_PID" ] || return 0
    local t0 last="" same=0 used c0
    c0=$(proc_ticks "$NODE_PID"); t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$DRAIN_WAIT" ]; do
        used=$(curl -s -m 5 "$API/stats/vdisks" | jq -r '[.vdisks[].oplog_live_bytes] | add // 0' 2>/dev/null)
        [ -n "$used" ] || { log "no oplog figure from $API/stats/vdisks"; break; }
        [ "$used" -le 1048576 ] && break
        if [ "$used" = "$last" ]; then same=$((same + 1)); [ $same -ge 10 ] && break; else same=0; fi
        last=$used
        sleep 0.5
    done
    DRAIN_TICKS=$((DRAIN_TICKS + $(proc_ticks "$NODE_PID") - c0))
}

if has ashlar-iscsi "$ISCSI_SYSTEMS" || has ashlar-nbd "$ISCSI_SYSTEMS"; then
    for p in "$ISCSI_ASHLAR_PORT" "$ISCSI_NBD_PORT" "$ISCSI_HTTP_PORT"; do
        port_free "$p" || die "port $p busy (set ISCSI_ASHLAR_PORT / ISCSI_NBD_PORT / ISCSI_HTTP_PORT)"
    done
    rm -rf "$NODE_DIR"; mkdir -p "$NODE_DIR"
    RUST_LOG=warn "$ASHLAR_BIN" node --data-dir "$NODE_DIR" --nbd-listen "127.0.0.1:$ISCSI_NBD_PORT" \
        --http-listen "127.0.0.1:$ISCSI_HTTP_PORT" --iscsi-listen "127.0.0.1:$ISCSI_ASHLAR_PORT" \
        --reactors "$ASHLAR_REACTORS" --cache-size "$ISCSI_CACHE" --ensure-vdisk "bench:$SIZE" \
        ${ISCSI_NODE_ARGS:-} > "$RESULTS_DIR/logs/ashlar-iscsi.server.log" 2>&1 &
    NODE_PID=$!
    { wait_port 127.0.0.1 "$ISCSI_HTTP_PORT" 60 && wait_port 127.0.0.1 "$ISCSI_NBD_PORT" 60 &&
      wait_port 127.0.0.1 "$ISCSI_ASHLAR_PORT" 60; } ||
        die "ashlar node did not start: $(tail -3 "$RESULTS_DIR/logs/ashlar-iscsi.server.log" | tr '\n' ' ')"
    acli() { ASHLAR_SERVER=$API timeout 30 "$ASHLAR_BIN" "$@"; }
    { acli vg create bench && acli vg add-disk bench bench &&
      acli vg attach bench --initiator "$ISCSI_INITIATOR" && acli vg show bench; } \
        > "$RESULTS_DIR/logs/ashlar-iscsi.vg.log" 2>&1 ||
        die "ashlar vg setup failed: $(tail -3 "$RESULTS_DIR/logs/ashlar-iscsi.vg.log" | tr '\n' ' ')"
    iscsi-readcapacity16 -i "$ISCSI_INITIATOR" "iscsi://127.0.0.1:$ISCSI_ASHLAR_PORT/$ASHLAR_IQN/0" \
        > "$RESULTS_DIR/logs/ashlar-iscsi.readcapacity16.log" 2>&1 ||
        die "Ashlar LUN 0 does not answer READ CAPACITY 16: $(tail -2 "$RESULTS_DIR/logs/ashlar-iscsi.readcapacity16.log" | tr '\n' ' ')"
    NBD_URI=nbd://127.0.0.1:$ISCSI_NBD_PORT/bench
    ASHLAR_FN="iscsi\\://127.0.0.1\\:$ISCSI_ASHLAR_PORT/${ASHLAR_IQN//:/\\:}/0"
    log "filling the vdisk ($SIZE, 1 MiB writes over NBD)"
    run_bounded 900 "$FIO" --name=fill --ioengine=nbd --uri="$NBD_URI" --rw=write --bs=1M \
        --iodepth=8 >/dev/null 2>&1 ||
        die "pre-fill of the vdisk failed (its reads would hit holes and never touch the disk)"
    # The first write job after a fill used to run slower than the later ones (the oplog
    # creates its segment files as it first fills; 24.7k, 28.2k, 29.0k, 30.8k IOPS for four
    # randwrite4k QD32 jobs in a row, ../bench/results/20261128-211914-vm), and ashlar-iscsi
    # always ran first. One unmeasured write job takes that cost before any row.
    log "warming the node's write path (4 KiB random writes over NBD, $RUNTIME s)"
    run_bounded 900 "$FIO" --name=warm-writes --ioengine=nbd --uri="$NBD_URI" --rw=randwrite \
        --bs=4k --iodepth=32 --time_based --runtime="$RUNTIME" >/dev/null 2>&1 || true
    wait_drained
    log "warming the node's read cache"
    run_bounded 900 "$FIO" --name=warm --ioengine=nbd --uri="$NBD_URI" --rw=read --bs=1M \
        --iodepth=8 >/dev/null 2>&1 || true
    run_bounded 900 "$FIO" --name=warm2 --ioengine=nbd --uri="$NBD_URI" --rw=read --bs=4k \
        --iodepth=32 >/dev/null 2>&1 || true
    note ashlar-iscsi "ashlar $("$ASHLAR_BIN" --version | awk '{print $2}'), node pid $NODE_PID, $ASHLAR_REACTORS reactors, cache $ISCSI_CACHE (> SIZE: reads after fill+warm come from the node's cache), --direct-io on (default), data on $(df -hT "$NODE_DIR" | awk 'NR==2{print $2}') under $NODE_DIR; vdisk bench $SIZE as LUN 0 of $ASHLAR_IQN (default iSCSI limits: MaxRecvDataSegmentLength 256K, MaxBurst 1M, FirstBurst 64K), initiator $ISCSI_INITIATOR; ashlar-iscsi-nbd = same node and vdisk through fio's nbd engine; writes durable at acknowledgement"
fi

ashlar_iscsi_case() { # WORKLOAD QD
    if [ -n "$ASHLAR_FN" ] && has ashlar-iscsi "$ISCSI_SYSTEMS"; then
        wait_drained
        SERVER_PIDS=$NODE_PID FIO=$FIO_ISCSI run_case ashlar-iscsi "$1" "$2" \
            --ioengine=libiscsi --filename="$ASHLAR_FN" --initiator="$ISCSI_INITIATOR"
    fi
}
ashlar_nbd_case() { # WORKLOAD QD
    if [ -n "$NBD_URI" ] && has ashlar-nbd "$ISCSI_SYSTEMS"; then
        wait_drained
        SERVER_PIDS=$NODE_PID run_case ashlar-iscsi-nbd "$1" "$2" --ioengine=nbd --uri="$NBD_URI"
    fi
}

record_load iscsi
job_index=0
for job in $ISCSI_JOBS; do
    wl=${job%%:*} qd=${job##*:}
    if [ -n "$TGT_FN" ]; then
        wait_drained   # the node's drain of the previous Ashlar job must not run beside tgt's
        SERVER_PIDS=$TGTD_PID FIO=$FIO_ISCSI run_case tgt-iscsi "$wl" "$qd" \
            --ioengine=libiscsi --filename="$TGT_FN" --initiator="$ISCSI_INITIATOR"
        # tgt's writes sit in the page cache; written back during the next row, they slowed
        # Ashlar's flushes (NBD seqwrite1m 501 MiB/s, p99 79 ms, right after tgt's, in
        # ../bench/results/20261128-212152-vm; 1,391-1,481 without tgt before it).
        sync
    fi
    # Ashlar's two front-ends take turns going first, so neither is always the one that
    # runs right after tgt or on the node's state the other left.
    if [ $((job_index % 2)) = 0 ]; then
        ashlar_iscsi_case "$wl" "$qd"; ashlar_nbd_case "$wl" "$qd"
    else
        ashlar_nbd_case "$wl" "$qd"; ashlar_iscsi_case "$wl" "$qd"
    fi
    job_index=$((job_index + 1))
done
if [ -n "$NODE_PID" ]; then
    wait_drained
    note ashlar-iscsi "node CPU while waiting for the oplog to drain before Ashlar jobs (not charged to any row): $(awk -v t="$DRAIN_TICKS" -v hz="$CLK_TCK" 'BEGIN{printf "%.2f", t/hz}') s in total"
    ps -o rss= -p "$NODE_PID" | awk '{printf "ashlar-iscsi\tnode RSS after the jobs: %.0f MiB\n", $1/1024}' >> "$RESULTS_DIR/notes.tsv"
fi
note iscsi "fio $("$FIO_ISCSI" --version) rebuilt from Debian's source with --enable-libiscsi for the libiscsi rows (one session per job, initiator $ISCSI_INITIATOR, header digest offered None,CRC32C), Debian's fio for the nbd rows; jobs $ISCSI_JOBS interleaved per job: tgt-iscsi, then ashlar-iscsi and ashlar-iscsi-nbd taking turns going first; one unmeasured 4 KiB random write job over NBD warmed the write path after the fill"
cleanup
finish_standalone
