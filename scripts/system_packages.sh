#!/usr/bin/env bash
# The Debian/Ubuntu packages lmcache-fx's set-up needs, installed with apt-get (as root) when missing:
# those named, and what building the C extension for the Python given needs on a fresh image: venv
# support (Debian splits it off), the Python headers, a compiler (a pyenv Python has the first two).
# Shared by scripts/setup.sh and examples/chat/setup_vllm.sh.
#   usage: scripts/system_packages.sh PYTHON [PACKAGE ...]
set -euo pipefail
PY=$1
shift
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup: not root (or no apt-get): skipping system packages (wanted: $*; and python venv, headers, gcc)" >&2
    exit 0
fi
need=""
for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"
done
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
