#!/usr/bin/env bash
# Device check of lmcache-fx's NVMe -> GPU pipeline: one unattended run (≤ 8 min
# on one GPU), JSON written after every phase, non-zero exit on any
# correctness or LMCache failure (throughput shortfalls only warn).
#   scripts/gpu_check.sh DIR_ON_NVME [SIZE_GIB]     # on a GPU host
#   scripts/gpu_check.sh --stand-in                 # on a CPU host, against the stand-in driver
# Env: PYTHON (default .venv/bin/python, else python3), FX_GPU_CHECK_OUT (JSON report path; default
# $OUT/gpu-check.json where $OUT is a directory, as on a lent device machine, else ./gpu_check-<host>-<time>.json).
# Exit status: 0 passed (warnings allowed), 1 a phase failed or the run hung, 2 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  REPORT=${FX_GPU_CHECK_OUT:-$OUT/gpu-check.json}
else
  REPORT=${FX_GPU_CHECK_OUT:-$PWD/gpu_check-$(hostname)-$(date +%Y%m%d-%H%M%S).json}
fi
if ! "$PY" -c "import lmcache_fx._fxio as m; m.GpuStaging" 2>/dev/null; then
  echo "== building the C extension"
  if ! "$PY" setup.py -q build_ext --inplace; then
    # A report all the same: on a lent machine it is the one thing that comes back.
    printf '{"passed": false, "failed": ["build"], "why": "the C extension did not build (setup.py build_ext)"}\n' >"$REPORT"
    exit 1
  fi
fi
if [ "${1:-}" = "--stand-in" ]; then
  exec timeout -k 10 480 "$PY" scripts/gpu_check.py --stand-in --json "$REPORT" --deadline-s 460
fi
DIR=${1:?usage: scripts/gpu_check.sh DIR_ON_NVME [SIZE_GIB] | --stand-in}
SIZE=${2:-4}
unset LMCACHE_FX_GPU_DRIVER  # a leftover would point the check at the stand-in
mkdir -p "$DIR"
echo "== lmcache-fx gpu_check: dir=$DIR size=${SIZE}GiB python=$PY report=$REPORT"
exec timeout -k 10 480 "$PY" scripts/gpu_check.py --dir "$DIR" --size-gib "$SIZE" --json "$REPORT" --deadline-s 460
