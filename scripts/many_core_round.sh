#!/usr/bin/env bash
# One unattended round on a many-core (GPU) host that is lent for minutes:
# the checks that need such a host, in order of what they are worth, each
# under its own time limit, every result written to OUTDIR as it finishes.
#   scripts/many_core_round.sh OUTDIR [BUDGET_S]      # from the repository root, as root
#
#   1. lmcache-fx bench --devices 8 at 2 MiB chunks (fx, fx-unstaged, fx-threads, fx-l2, fio):
#      bench-devices-8-2m.json, the target still open there (docs/benchmarks.md)
#   2. scripts/gpu_check.py on a 1 GiB file, when torch sees a GPU: gpu-check.json
#   3. scripts/inflight_probe.py --devices 8 --chunk-mib 2 --one-lane: reads in flight per device at
#      2 MiB, with and without two lanes (inflight-probe-8-2m.json)
#   4. lmcache-fx bench --devices 8 at 64 MiB (fx, fio): bench-devices-8-64m.json
# A step starts only while BUDGET_S (default 470) leaves it room; log.txt has everything printed.
#
# Such hosts are often offline. What this needs, and how it was brought there before (docs/benchmarks.md,
# "Eight devices on a 16-core host"):
#   - python3 with torch (the host's own), gcc and Python headers: the extension is built here, in place;
#     LIBURING_PREFIX=DIR (DIR/include/liburing.h, DIR/lib/liburing.a) for io_uring where liburing-dev is absent.
#   - LMCache 0.5.6 and what it needs beyond the host's packages, as wheels for the host's Python, downloaded
#     elsewhere with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
#     manylinux_2_28_x86_64 ... lmcache==0.5.6` (then each missing Requires-Dist the same way) and installed
#     with `pip install --no-index --no-deps --target DIR *.whl`, DIR on PYTHONPATH (about 38 MiB of wheels
#     beside a torch image). LMCache 0.5.6's wheels are built against torch 2.13: on an older torch its
#     `cuda_ops` does not load and its GPU connector runs on torch ops (it says so), which the bench (GPUs hidden)
#     does not use.
#   - fio with io_uring on PATH: a static build (fio 3.33's `./configure --build-static --disable-native
#     --disable-numa --disable-rdma --disable-rados --disable-rbd --disable-http --disable-gfapi --disable-libnfs
#     --disable-pmem --disable-xnvme --disable-libzbc --disable-tcmalloc --disable-dfs`) runs anywhere.
#   - mkfs.xfs on PATH (it needs libinih and liburcu: LD_LIBRARY_PATH), loop devices and XFS in the kernel.
set -u
OUTDIR=${1:?usage: scripts/many_core_round.sh OUTDIR [BUDGET_S]}
BUDGET=${2:-470}
cd "$(dirname "$0")/.."
mkdir -p "$OUTDIR"
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
step() { echo "== [$(($(date +%s) - T0)) s] $*"; }
exec > >(tee "$OUTDIR/log.txt") 2>&1
export LMCACHE_LOG_LEVEL=WARNING PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# What the list above brings along, when it was carried in .dev/ (untracked: bin/ fio and mkfs.xfs,
# lib/ their libraries, uring/ liburing, whl/ LMCache's wheels): used from there.
if [ -d .dev ]; then
  export PATH=$PWD/.dev/bin:$PATH LD_LIBRARY_PATH=$PWD/.dev/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  [ -d .dev/uring ] && export LIBURING_PREFIX=$PWD/.dev/uring
  if [ -d .dev/whl ] && ! "$PY" -c "import lmcache" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/fx-site .dev/whl/*.whl &&
      export PYTHONPATH=/tmp/fx-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
fi

step "host"
nproc
free -g | head -2
uname -r
"$PY" -V
for t in gcc mkfs.xfs fio losetup nvidia-smi; do printf '%s: %s\n' "$t" "$(command -v "$t" || echo MISSING)"; done
grep -qw xfs /proc/filesystems && echo "xfs: in the kernel" || echo "xfs: not listed in /proc/filesystems (a module may load)"
git log --oneline -1 2>/dev/null || echo "no git history here"

step "build"
"$PY" setup.py -q build_ext --inplace 2>&1 | tail -3
"$PY" -c "import lmcache_fx._fxio as m; e = m.Engine(io_engine='auto'); print('engine:', e.kind, e.fallback_reason or '')" ||
  exit 1
"$PY" -c "import lmcache; print('lmcache:', lmcache.__file__)" || echo "LMCache does not import: the bench cannot run"

# GPUs hidden from the bench: it measures the storage path, as on the CPU hosts.
BENCH=("$PY" -m lmcache_fx.tools.bench --devices 8 --quiet)
step "1. bench --devices 8, 2 MiB ($(left) s left)"
[ "$(left)" -gt 120 ] && CUDA_VISIBLE_DEVICES= timeout -k 5 170 "${BENCH[@]}" --preset llama-3.2-1b-tp4 --total-gb 2 \
  --reps 5 --readers fx,fx-unstaged,fx-threads,fx-l2,fio --json "$OUTDIR/bench-devices-8-2m.json"

step "2. gpu_check ($(left) s left)"
# At 1 GiB the phases before the LMCache one took 37 s on the H200, the LMCache one 59-70 s
# (docs/gpu-check-h200*.json): 200 s, not 100, so its own watchdog does not cut it off.
if [ "$(left)" -gt 210 ] && "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  mkdir -p /root/fx-gpu-check
  timeout -k 5 210 "$PY" scripts/gpu_check.py --dir /root/fx-gpu-check --size-gib 1 --json "$OUTDIR/gpu-check.json" \
    --deadline-s 200
fi

step "3. inflight probe, 2 MiB ($(left) s left)"
[ "$(left)" -gt 150 ] && timeout -k 5 80 "$PY" scripts/inflight_probe.py --devices 8 --chunk-mib 2 --chunks 480 \
  --reps 3 --one-lane --json "$OUTDIR/inflight-probe-8-2m.json"

step "4. bench --devices 8, 64 MiB ($(left) s left)"
[ "$(left)" -gt 100 ] && CUDA_VISIBLE_DEVICES= timeout -k 5 $(($(left) - 15)) "${BENCH[@]}" --total-gb 4 --reps 5 \
  --readers fx,fio --json "$OUTDIR/bench-devices-8-64m.json"
step "done"
