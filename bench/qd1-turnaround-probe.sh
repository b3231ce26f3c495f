#!/usr/bin/env bash
# qd1-turnaround-probe.sh — where the time of one QD1 4 KiB cached read goes, for Ashlar's
# iSCSI and NBD front-ends on the same vdisk: the node's syscalls are traced for one second
# in the middle of a fio job (perf, raw_syscalls), and each request/reply cycle split into
#   server     : recv returning the request -> send of the reply starting (the node's own work),
#   send       : the send syscall (on loopback it also runs the client's TCP receive),
#   turnaround : send returning -> recv returning the next request (the client's share:
#                its wakeup, its library, its next request, the kernel between).
# The tracing slows every syscall, so compare the two front-ends within one run, not with
# untraced figures. Used for bench/results/20261129-042227-vm/NOTES.md.
#
#   bench/qd1-turnaround-probe.sh [BIN] [RUNTIME_S]      (as root)
#
# Knobs (environment): NODE_ARGS (more `ashlar node` flags), ROUNDS (2), FIO_ISCSI (default:
# what ../shared/bench/peers/build-fio-libiscsi.sh builds; the nbd engine comes from the
# system's fio).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-$HERE/../target/release/ashlar}
RUNTIME_S=${2:-5}
FIO_ISCSI=${FIO_ISCSI:-$("$HERE/../../shared/bench/peers/build-fio-libiscsi.sh" 2>/dev/null)}
DIR=/tmp/qd1-turnaround-node
INITIATOR=iqn.2019-04.org.fio:fio
FN='iscsi\://127.0.0.1\:19191/iqn.2024-01.io.ashlar\:bench/0'
rm -rf "$DIR"; mkdir -p "$DIR"
# shellcheck disable=SC2086 # NODE_ARGS is a list of flags
RUST_LOG=warn "$BIN" node --data-dir "$DIR" --nbd-listen 127.0.0.1:19192 \
    --http-listen 127.0.0.1:19193 --iscsi-listen 127.0.0.1:19191 --reactors 2 \
    --cache-size 3G --ensure-vdisk bench:1G ${NODE_ARGS:-} > "$DIR.log" 2>&1 &
NODE=$!
trap 'kill $NODE 2>/dev/null; wait $NODE 2>/dev/null || true' EXIT
for _ in $(seq 50); do curl -sf http://127.0.0.1:19193/healthz >/dev/null && break; sleep 0.2; done
export ASHLAR_SERVER=http://127.0.0.1:19193
"$BIN" vg create bench >/dev/null
"$BIN" vg add-disk bench bench >/dev/null
"$BIN" vg attach bench --initiator "$INITIATOR" >/dev/null
iscsi_job() { "$FIO_ISCSI" --ioengine=libiscsi --filename="$FN" --initiator="$INITIATOR" "$@"; }
# Written, then read once at 4 KiB so every read of the measured jobs is a cache hit.
iscsi_job --name=fill --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null
iscsi_job --name=warm --rw=read --bs=4k --iodepth=32 --size=1G >/dev/null
sleep 2

measure() { # NAME fio-command...
    local name=$1 trace=/tmp/qd1-turnaround.$1
    shift
    ( sleep 2; perf record -e raw_syscalls:sys_enter,raw_syscalls:sys_exit -p "$NODE" \
        -o "$trace.perf" -- sleep 1 >/dev/null 2>&1 ) &
    local tracer=$!
    "$@" --name="$name" --rw=randread --bs=4k --iodepth=1 --size=1G --time_based \
        --runtime="$RUNTIME_S" --output-format=json > "$trace.json"
    wait "$tracer" || true
    perf script -i "$trace.perf" -F time,event,trace 2>/dev/null > "$trace.txt"
    python3 - "$name" "$trace" <<'PY'
import json, re, statistics, sys
name, trace = sys.argv[1], sys.argv[2]
text = open(trace + ".json").read()
job = json.loads(text[text.index("{"):])["jobs"][0]["read"]
RECV, SEND = 45, 44  # recvfrom, sendto on x86_64
server, send, turnaround = [], [], []
recv_done = send_start = send_done = None
for line in open(trace + ".txt"):
    m = re.match(r"\s*([\d.]+):\s+raw_syscalls:sys_(enter|exit):\s+NR (\d+)(?: = (-?\d+))?", line)
    if not m:
        continue
    t, kind, nr = float(m.group(1)) * 1e6, m.group(2), int(m.group(3))
    ret = int(m.group(4)) if m.group(4) else None
    if nr == RECV and kind == "exit" and ret and ret > 0:
        if send_done is not None:
            turnaround.append(t - send_done)
            send_done = None
        recv_done = t
    elif nr == SEND and kind == "enter":
        send_start = t
        if recv_done is not None:
            server.append(t - recv_done)
            recv_done = None
    elif nr == SEND and kind == "exit" and send_start is not None:
        send.append(t - send_start)
        send_done, send_start = t, None
med = lambda xs: statistics.median(xs) if xs else float("nan")
print(f"{name:5} job IOPS {job['iops']:8.0f} p50 {job['clat_ns']['percentile']['50.000000'] / 1000:5.1f} us | "
      f"traced medians: server {med(server):4.0f} us, send {med(send):4.0f} us, "
      f"turnaround {med(turnaround):4.0f} us ({len(turnaround)} cycles)")
PY
}
for _ in $(seq "${ROUNDS:-2}"); do
    measure iscsi iscsi_job
    measure nbd fio --ioengine=nbd --uri=nbd://127.0.0.1:19192/bench
done
