#!/bin/bash
# A check round of `lmcache-fx bench` at the commit checked out here (root; about 17 min on 2 cores): three
# runs of each main case (XFS on a RAM-backed loop device, cold, at 64, 10 and 2 MiB; tmpfs, warm, at 64 and
# 2 MiB) and three 2 MiB latency runs, into docs/bench-repeats/round-<commit>/ (or $1). The tables:
#   python scripts/bench_tables.py --readme "XFS on a RAM loop device, cold, 7 × 64 MiB" OUT/xfs-64m-run*.json …
#   python scripts/bench_tables.py --latency-rounds "2 MiB, run 1" OUT/lat-2m-run1.json …
# Run it from a clean checkout with the extension built in place (python setup.py build_ext --inplace), no other
# load on the machine: each JSON records the commit, and a tree with changes is marked +dirty.
set -u
cd "$(dirname "$0")/.."
REV=$(git rev-parse --short HEAD)
OUT=${1:-docs/bench-repeats/round-$REV}
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH=$PWD
R=fx,fx-noverify,fx-l2,fx-l2-noverify,local_disk,fs_connector,rust_raw_block,fs_native,raw_block,fio
mkdir -p "$OUT"
fail=0
step() { # name, then the bench's arguments
    local name=$1
    shift
    $PY -m lmcache_fx.tools.cli bench "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
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
