#!/usr/bin/env bash
# GPU check of lmcache-fx's NVMe -> GPU pipeline, in one short unattended run
# (< 5 min; default 4 GiB test file). Needs torch with CUDA (or ROCm) and,
# for the fio figure, fio. Usage:
#   scripts/gpu_check.sh [DIR on the NVMe to test] [SIZE_GIB]
# Env: PYTHON (default .venv/bin/python, else python3), FX_GPU_CHECK_OUT (JSON report path).
# Exit status: 0 all bit-exact, 1 a mismatch, 2 no GPU, other: a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DIR=${1:-${FX_GPU_CHECK_DIR:-/tmp}}
SIZE=${2:-${FX_GPU_CHECK_GIB:-4}}
OUT=${FX_GPU_CHECK_OUT:-$PWD/gpu_check-$(hostname)-$(date +%Y%m%d-%H%M%S).json}
mkdir -p "$DIR"
echo "== lmcache-fx gpu_check: dir=$DIR size=${SIZE}GiB python=$PY"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader || true
command -v rocm-smi >/dev/null && rocm-smi --showproductname || true
if ! "$PY" -c "import lmcache_fx._fxio as m; m.GpuStaging" 2>/dev/null; then
  echo "== building the C extension"
  "$PY" setup.py -q build_ext --inplace
fi
"$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 2)" || { echo "torch sees no GPU"; exit 2; }
exec timeout 290 "$PY" scripts/gpu_check.py --dir "$DIR" --size-gib "$SIZE" --out "$OUT"
