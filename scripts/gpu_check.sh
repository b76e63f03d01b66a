#!/usr/bin/env bash
# Device check of lmcache-fx's NVMe -> GPU pipeline: one unattended run (≤ 8 min
# on one GPU), JSON written after every phase, non-zero exit on any
# correctness or LMCache failure (throughput shortfalls only warn).
#   scripts/gpu_check.sh DIR_ON_NVME [SIZE_GIB]     # on a GPU host
#   scripts/gpu_check.sh --stand-in                 # on a CPU host, against the stand-in driver
# Env: PYTHON (default .venv/bin/python, else python3), FX_GPU_CHECK_OUT (JSON report path).
# Exit status: 0 passed (warnings allowed), 1 a phase failed or the run hung, 2 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT=${FX_GPU_CHECK_OUT:-$PWD/gpu_check-$(hostname)-$(date +%Y%m%d-%H%M%S).json}
if ! "$PY" -c "import lmcache_fx._fxio as m; m.GpuStaging" 2>/dev/null; then
  echo "== building the C extension"
  "$PY" setup.py -q build_ext --inplace || exit 1
fi
if [ "${1:-}" = "--stand-in" ]; then
  exec timeout -k 10 480 "$PY" scripts/gpu_check.py --stand-in --json "$OUT" --deadline-s 460
fi
DIR=${1:?usage: scripts/gpu_check.sh DIR_ON_NVME [SIZE_GIB] | --stand-in}
SIZE=${2:-4}
unset LMCACHE_FX_GPU_DRIVER  # a leftover would point the check at the stand-in
mkdir -p "$DIR"
echo "== lmcache-fx gpu_check: dir=$DIR size=${SIZE}GiB python=$PY report=$OUT"
exec timeout -k 10 480 "$PY" scripts/gpu_check.py --dir "$DIR" --size-gib "$SIZE" --json "$OUT" --deadline-s 460
