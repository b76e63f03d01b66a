#!/usr/bin/env python3
"""Runs the reliability suite and regenerates docs/reliability.md.

    .venv/bin/python scripts/reliability.py [extra pytest args]

Each case in tests/test_reliability.py and tests/test_store_security.py records its figure (fault, trials, what
was checked, the numbers); this script runs them all with pytest, takes each
case's outcome from pytest's JUnit XML, and writes the table. Exit status is
pytest's. Root is needed for the XFS loop, EIO and ownership cases (they are
skipped, and the table says so, otherwise).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "reliability.md")
COMMAND = ".venv/bin/python scripts/reliability.py"


TRUST_MODEL = """
## What holds, in which configuration

| configuration | a torn or damaged file (power loss, crash, bad device, bit flips) | a file planted by someone who can write the store directory |
|---|---|---|
| `verify: true` (default) | a miss, never wrong data: the header CRC32C, the key in the header, the file length and the payload CRC32C are all checked | **served** if it is a well-formed chunk: CRC32C is no secret, anyone can compute it |
| `verify: false` | a miss when the header is bad or the file is shorter than its header says; a full-length payload with bad bytes (blocks never written before a power cut: zeros, or an older version of the same chunk) **is served**. fx does not fsync, and after real power cuts of XFS with buffered writes such chunks were common; evicted files are not reused in this configuration (on disk filesystems), since a reused file's new header could stand over another chunk's payload; a store that does reuse them (`verify: true` or `auth_key`) flags every chunk it writes and writes into no unflagged file (a verify-off store's chunk, or an earlier version's), and a `verify: false` reader checks flagged payloads' CRC32C anyway: a torn reused file (either chunk's header over part of the other's payload) is a miss | served |
| `auth_key` set (either `verify`) | a miss: the MAC covers the header and the payload | a miss, and removed, unless its writer holds the key |

A short read of a file that is long enough is a read error (a miss, counted in `read_errors`, the file kept), not corruption; a chunk is removed only after checking that the name still points at the file that was read (inode), so a good chunk renamed into place meanwhile by another process is never deleted.

## Trust model

- **Who can read.** Anyone who can read the chunk files reads the KV cache, i.e. a function of the prompts. Default modes are 0600 files / 0700 directories (this user only). With `shared_group: true` files are 0660 and directories 02770 (setgid) in the group of the store's root directory: every member of that group reads every tenant's KV. There is no encryption; `auth_key` authenticates, it does not hide.
- **Who can plant.** Anyone who can write the store directory (the owner; with `shared_group`, every member of the group; root) can create, replace or delete chunk files. Without `auth_key` a planted chunk with valid checksums under another key's name is served to every process that asks for that key: CRC32C detects accidents, not adversaries. Deleting or filling the store (denial of service) cannot be prevented by any option.
- **What `auth_key` guarantees.** Every chunk carries a keyed BLAKE2b-256 MAC over its header (key, shapes, dtypes, format, payload length and CRC, time) and payload, checked after the payload has landed. A reader with the key serves only chunks written by a holder of the same key, byte for byte; anything else is a miss and is removed so a key holder can write it again. All processes sharing a store must use the same key (a process without it writes chunks that keyed readers refuse; keyed chunks stay readable by readers without a key). Keep the key out of the YAML: `env:VARNAME` or `file:/path` (mode 0400). Cost: one keyed BLAKE2b pass over each chunk on write and on read, on the calling thread (hashlib releases the GIL); see the `auth_key` row above for GB/s measured here. `direct_to_gpu` cannot be combined with it (the payload never rests in host memory).
- **What the store never does**, whatever is planted: follow a symlink (fan-out directories and files are opened with O_NOFOLLOW relative to directory descriptors, the O_DIRECT probe uses O_TMPFILE or O_EXCL|O_NOFOLLOW), write through an existing file (temporaries are new files, O_EXCL, renamed into place), remove anything outside the store (stale temporaries and damaged chunks are removed relative to the descriptor of the directory listed), or wait without bound on the store lock: every lock wait polls up to `LOCK_TIMEOUT` (5 s, `lmcache_fx/core/ledger.py`); then the store is skipped (write returns False), the ledger update deferred to the next scan (an overcount: eviction starts early, the cap holds) and one warning is logged per burst, naming the holder's pid and state; while the ledger stays as the holder left it, later waits are short (a stopped holder costs one wait, not one per call).
- **The root directory is trusted**: the store refuses one owned by another user (without `shared_group`) or writable by everyone.
"""


def outcomes(junit: str) -> dict:
    res = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        name = tc.get("name")
        state, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                state = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                why = (el.get("message") or "").splitlines()[0][:160] if el.get("message") else ""
                break
        res[name] = (state, why, float(tc.get("time") or 0))
    return res


def cell(v) -> str:
    s = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return s.replace("|", "\\|").replace("\n", " ")


def figures_text(fig: dict) -> str:
    return "; ".join(f"{k}={cell(v)}" for k, v in fig.items())


def main() -> int:
    fd, rows_path = tempfile.mkstemp(prefix="fx-reliability-", suffix=".jsonl")
    os.close(fd)
    junit = rows_path + ".xml"
    env = dict(os.environ, FX_RELIABILITY_OUT=rows_path, LMCACHE_TRACK_USAGE="false", PYTHONHASHSEED="0")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:logging",
        "-p",
        "no:cacheprovider",
        "tests/test_reliability.py",
        "tests/test_store_security.py",
        f"--junitxml={junit}",
        "-rs",
        *sys.argv[1:],
    ]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    try:
        with open(rows_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        outs = outcomes(junit) if os.path.exists(junit) else {}
    finally:
        for p in (rows_path, junit):
            if os.path.exists(p):
                os.unlink(p)
    by_test = {r["test"].split("::")[-1]: r for r in rows}
    lines = [
        "# Reliability and security",
        "",
        f"Regenerated by `{COMMAND}` (runs `tests/test_reliability.py` and `tests/test_store_security.py`, "
        "marker `reliability`). "
        "Every trial is real: real processes killed with SIGKILL, real files on XFS loop filesystems "
        "(O_DIRECT), real io_uring, a real seccomp filter, real device errors.",
        "",
        f"Last run: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, Linux {platform.release()}, "
        f"{os.cpu_count()} CPUs, {'root' if os.geteuid() == 0 else 'not root'}; pytest exit status {rc}.",
        "",
        "| fault | trials | what was checked | result |",
        "|---|---|---|---|",
    ]
    for name, (state, why, secs) in outs.items():
        r = by_test.get(name)
        if r is None:
            lines.append(f"| `{name}` | - | - | {state}{': ' + cell(why) if why else ''} |")
            continue
        result = f"**{state}** ({secs:.0f} s): {figures_text(r['figures'])}"
        if state != "passed" and why:
            result += f" — {cell(why)}"
        lines.append(f"| {cell(r['fault'])} | {cell(r['trials'])} | {cell(r['checked'])} | {result} |")
    lines += ["", *TRUST_MODEL.strip("\n").splitlines()]
    lines += [
        "",
        "How the faults are made: `tests/faults/fxfault.py` (child processes, seccomp BPF filter via prctl, "
        "an XFS whose loop device sits on a second XFS that is shut down to make every block I/O fail with EIO).",
        "",
    ]
    os.makedirs(os.path.dirname(DOC), exist_ok=True)
    with open(DOC, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {DOC} ({len(outs)} cases, pytest exit status {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
