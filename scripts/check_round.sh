#!/bin/bash
# A check round of `lmcache-fx bench` at the commit checked out here: three runs of each main case (XFS on a
# RAM-backed loop device, cold, at 64, 10 and 2 MiB; tmpfs, warm, at 64 and 2 MiB) and three 2 MiB latency runs,
# into docs/bench-repeats/round-<commit>/ (or $1), each case's log into $LOGS (default /tmp/check-round-<commit>/,
# not committed). About 17 min on 2 cores. Needs root (loop devices, dropping the page cache) and the venv of
# scripts/setup.sh (PYTHON=... for another), with every peer installed: it stops if LMCache's rust raw-block
# backend, which setup.sh may fail to install, is missing. Run it from a clean checkout with the extension built
# in place (python setup.py build_ext --inplace) and no other load on the machine: each JSON records the commit
# (+dirty when tracked files changed). The round's tables:
#   python scripts/bench_tables.py --readme "XFS on a RAM loop device, cold, 7 × 64 MiB" OUT/xfs-64m-run*.json …
#   python scripts/bench_tables.py --latency-rounds "2 MiB, run 1" OUT/lat-2m-run1.json …
# Since bd14339 the raw-block peers' images are preallocated on disk filesystems only, so tmpfs rounds before it
# are not comparable for those peers (docs/benchmarks.md, Method).
set -u
cd "$(dirname "$0")/.."
REV=$(git rev-parse --short HEAD)
OUT=${1:-docs/bench-repeats/round-$REV}
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=$PWD
LOGS=${LOGS:-/tmp/check-round-$REV}
R=fx,fx-noverify,fx-l2,fx-l2-noverify,local_disk,fs_connector,rust_raw_block,fs_native,raw_block,fio
[ "$(id -u)" = 0 ] || { echo "check_round: run as root" >&2; exit 2; }
$PY -c 'import lmcache_rust_raw_block_io' 2>/dev/null || {
    echo "check_round: LMCache's rust raw-block backend is not importable: the round would lack a peer" >&2
    exit 2
}
mkdir -p "$OUT" "$LOGS"
rm -rf /dev/shm/fxbench
fail=0
step() { # name, then the bench's arguments
    local name=$1
    shift
    $PY -m lmcache_fx.tools.cli bench "$@" --json "$OUT/$name.json" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$(date +%T) $name rc=$rc"
    [ $rc -eq 0 ] || fail=1
}
for run in 1 2 3; do
    for c in "qwen2.5-32b 64m" "llama-3-70b-tp8 10m" "llama-3.2-1b-tp4 2m"; do
        set -- $c
        step "xfs-$2-run$run" --mkfs-loop 5G --total-gb 0.5 --reps 5 --quiet --preset "$1" --readers $R
    done
    for c in "qwen2.5-32b 64m" "llama-3.2-1b-tp4 2m"; do
        set -- $c
        step "tmpfs-$2-run$run" --path /dev/shm/fxbench --warm --total-gb 0.5 --reps 5 --quiet --preset "$1" --readers $R
        rm -rf /dev/shm/fxbench
    done
    step "lat-2m-run$run" --mkfs-loop 5G --preset llama-3.2-1b-tp4 --total-gb 0.5 --reps 1 --quiet --latency \
        --latency-awaited --concurrency 4,16 --latency-rounds 5 --readers fx,local_disk,rust_raw_block,fs_connector,fx-l2,fs_native
done
exit $fail
