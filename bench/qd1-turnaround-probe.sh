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
# PERF=1 records a CPU profile of the node during each job instead (with
# NODE_ARGS="--poll-window-us 0": where a QD1 read's CPU goes without the poll window).
# Knobs (environment): NODE_ARGS (more `ashlar node` flags), ROUNDS (2), FIO_ISCSI (default:
# what ../shared/bench/peers/build-fio-libiscsi.sh builds; the nbd engine comes from the
# system's fio).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-$HERE/../target/release/ashlar}
RUNTIME_S=${2:-5}
FIO_ISCSI=${FIO_ISCSI:-$("$HERE/../../shared/bench/peers/build-fio-libiscsi.sh" 2>/dev/null)}
source "$HERE/iscsi-probe-lib.sh"
iscsi_probe_node "$BIN" /tmp/qd1-turnaround-node 19191 1G
iscsi_job() { "$FIO_ISCSI" --ioengine=libiscsi --filename="$ISCSI_FN" --initiator="$INITIATOR" "$@"; }
# Written, then read once at 4 KiB so every read of the measured jobs is a cache hit.
iscsi_job --name=fill --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null
iscsi_job --name=warm --rw=read --bs=4k --iodepth=32 --size=1G >/dev/null
sleep 2

# PERF=1: a CPU profile of the node (call graphs) during each job instead of the trace.
profile() { # NAME fio-command...
    local name=$1 out=/tmp/qd1-turnaround.$1.cpu.perf
    shift
    ( sleep 1; perf record -F 2000 --call-graph dwarf,16384 -p "$NODE" -o "$out" \
        -- sleep 3 >/dev/null 2>&1 ) &
    local recorder=$!
    "$@" --name="$name" --rw=randread --bs=4k --iodepth=1 --size=1G --time_based \
        --runtime="$RUNTIME_S" > /dev/null
    wait "$recorder" || true
    echo "$name: profile $out, by module:"
    perf report -i "$out" --no-children --stdio --sort dso 2>/dev/null | grep -E '^ +[0-9]'
}

measure() { # NAME fio-command...
    if [ "${PERF:-0}" = 1 ]; then
        profile "$@"
        return
    fi
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
