#!/usr/bin/env bash
# neighbour-write-probe.sh — does one vdisk's durable writes stall another vdisk's cached reads
# on the same reactor? One node with a single reactor (so both vdisks share it), vdisk `hot`
# (256 MiB, read twice so every block is in the cache's multi-touch pool) and vdisk `busy`
# (1 GiB, filled). Then cached 4 KiB random reads at QD1 on `hot`, alone, then the
# same while fio writes 4 KiB random blocks to `busy` at WRITE_QD (durable at acknowledgement).
# Prints the reads' p50/p99/p99.9 latency and the writes' IOPS for each phase.
#
#   bench/neighbour-write-probe.sh BIN [RUNTIME_S]      e.g. for an A/B of two binaries
#   bench/neighbour-write-probe.sh nbdkit [RUNTIME_S]   the machine's own share of the tail
#
# With `nbdkit` for BIN the same clients run against two nbdkit processes that share nothing:
# `memory` for the reads and `file` with `--filter=fua fuamode=force` (every write flushed
# before its reply) for the writes. Whatever tail the reads get there, the machine gives them
# (its CPUs, the clients, the kernel's completion and flush work), not a shared reactor.
#
# Knobs (environment): WRITE_QD (32), NODE_ARGS (more `ashlar node` flags), NBD_PORT (19502;
# nbdkit also uses the next port), HTTP_PORT (19503), DATA_DIR (/var/tmp/ashlar-neighbour-probe).
set -euo pipefail
BIN=${1:?usage: neighbour-write-probe.sh BIN|nbdkit [RUNTIME_S]}
RUNTIME_S=${2:-8}
WRITE_QD=${WRITE_QD:-32}
NBD_PORT=${NBD_PORT:-19502}
HTTP_PORT=${HTTP_PORT:-19503}
DATA_DIR=${DATA_DIR:-/var/tmp/ashlar-neighbour-probe}
rm -rf "$DATA_DIR"; mkdir -p "$DATA_DIR"
SERVERS=()
trap 'kill "${SERVERS[@]}" 2>/dev/null; wait "${SERVERS[@]}" 2>/dev/null || true; rm -rf "$DATA_DIR"' EXIT
if [ "$BIN" = nbdkit ]; then
    truncate -s 1G "$DATA_DIR/busy.img"
    nbdkit -f -p "$NBD_PORT" memory 256M > "$DATA_DIR.log" 2>&1 &
    SERVERS+=($!)
    nbdkit -f -p $((NBD_PORT + 1)) --filter=fua file "$DATA_DIR/busy.img" fuamode=force \
        >> "$DATA_DIR.log" 2>&1 &
    SERVERS+=($!)
    HOT=nbd://127.0.0.1:$NBD_PORT
    BUSY=nbd://127.0.0.1:$((NBD_PORT + 1))
    for uri in "$HOT" "$BUSY"; do
        for _ in $(seq 100); do nbdinfo --size "$uri" >/dev/null 2>&1 && break; sleep 0.1; done
    done
else
    # shellcheck disable=SC2086 # NODE_ARGS is a list of flags
    RUST_LOG=warn "$BIN" node --data-dir "$DATA_DIR" --nbd-listen 127.0.0.1:$NBD_PORT \
        --http-listen 127.0.0.1:$HTTP_PORT --reactors 1 --cache-size 1G \
        --ensure-vdisk hot:256M --ensure-vdisk busy:1G ${NODE_ARGS:-} > "$DATA_DIR.log" 2>&1 &
    SERVERS+=($!)
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$HTTP_PORT/healthz" >/dev/null 2>&1 && break; sleep 0.2; done
    HOT=nbd://127.0.0.1:$NBD_PORT/hot
    BUSY=nbd://127.0.0.1:$NBD_PORT/busy
fi
job() { fio --ioengine=nbd --size="$2" --output-format=json --uri="$1" "${@:3}"; }
job "$BUSY" 1G --name=fill --rw=write --bs=1M --iodepth=8 >/dev/null
job "$HOT" 256M --name=fill --rw=write --bs=1M --iodepth=8 >/dev/null
# 256 KiB reads fill the cache, the 4 KiB pass promotes every block (see nbd-ab.sh).
job "$HOT" 256M --name=warm --rw=read --bs=256k --iodepth=8 >/dev/null
job "$HOT" 256M --name=warm --rw=read --bs=4k --iodepth=32 >/dev/null
reads() {
    job "$HOT" 256M --name=reads --rw=randread --bs=4k --iodepth=1 --time_based \
        --runtime="$RUNTIME_S" --randrepeat=0 > "$DATA_DIR.reads.json"
}
writes() {
    job "$BUSY" 1G --name=writes --rw=randwrite --bs=4k --iodepth="$WRITE_QD" --time_based \
        --runtime=$((RUNTIME_S + 2)) --randrepeat=0 > "$DATA_DIR.writes.json"
}
summary() { # PHASE
    python3 - "$1" "$DATA_DIR.reads.json" "$DATA_DIR.writes.json" <<'PY'
import json, os, sys
def load(path):
    text = open(path).read()
    return json.loads(text[text.index("{"):])["jobs"][0]
reads = load(sys.argv[2])["read"]
pct = reads["clat_ns"]["percentile"]
line = (f"{sys.argv[1]:<16} reads p50 {pct['50.000000'] / 1000:7.1f} us  p99 "
        f"{pct['99.000000'] / 1000:7.1f} us  p99.9 {pct['99.900000'] / 1000:7.1f} us  "
        f"read IOPS {reads['iops']:8.0f}")
if sys.argv[1] != "alone" and os.path.exists(sys.argv[3]):
    line += f"  write IOPS {load(sys.argv[3])['write']['iops']:7.0f}"
print(line)
PY
}
reads; summary alone
writes & writer=$!
sleep 1
reads; wait "$writer"; summary "writes QD$WRITE_QD"
