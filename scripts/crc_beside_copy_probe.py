#!/usr/bin/env python3
"""What a CRC32C costs beside a memory copy on this host: the loop device's
"device" is a kernel thread copying from the image into the reader's
buffer, and a checking reader's CRC32C runs on the other core at the same
time. Two threads, no files: one copies 64 MiB at a time from one 1 GiB
region into another (memcpy, as the loop worker's copy), one takes the
CRC32C of a third 1 GiB region 64 MiB at a time (the extension's, the
GIL released); each alone and both at once, for --seconds each, rotated
--reps times. GB/s of each, medians. Huge-page buffers, touched first.

    .venv/bin/python scripts/crc_beside_copy_probe.py --json docs/crc-beside-copy-probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20
REGION = 1 << 30
PIECE = 64 * MIB
_libc = ctypes.CDLL(None)  # ctypes lets go of the GIL around foreign calls
_libc.memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def run(which: tuple[str, ...], bufs: dict, seconds: float) -> dict:
    """Runs the named workers at once for `seconds`; GB/s of each."""
    done: dict = {}
    stop = threading.Event()

    def copy() -> None:
        n, t0 = 0, time.perf_counter()
        while not stop.is_set():
            off = n * PIECE % REGION
            _libc.memcpy(bufs["dst"].address + off, bufs["src"].address + off, PIECE)
            n += 1
        done["copy"] = n * PIECE / (time.perf_counter() - t0) / 1e9

    def crc() -> None:
        n, t0 = 0, time.perf_counter()
        while not stop.is_set():
            _fxio.crc32c_at(bufs["crc"].address + n * PIECE % REGION, PIECE)
            n += 1
        done["crc"] = n * PIECE / (time.perf_counter() - t0) / 1e9

    ts = [threading.Thread(target={"copy": copy, "crc": crc}[w]) for w in which]
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join()
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    bufs = {k: _fxio.HostBuffer(REGION, hugepages=True) for k in ("src", "dst", "crc")}
    for b in bufs.values():
        memoryview(b)[:] = os.urandom(MIB) * (REGION // MIB)
    cases = [("copy",), ("crc",), ("copy", "crc")]
    got: dict = {" + ".join(c): {w: [] for w in c} for c in cases}
    for rep in range(a.reps):
        for c in cases[rep % 3 :] + cases[: rep % 3]:
            for w, v in run(c, bufs, a.seconds).items():
                got[" + ".join(c)][w].append(round(v, 3))
    res = {
        c: {w: {"gbps": round(statistics.median(v), 3), "gbps_each": v} for w, v in ws.items()} for c, ws in got.items()
    }
    alone = {"copy": res["copy"]["copy"]["gbps"], "crc": res["crc"]["crc"]["gbps"]}
    both = res["copy + crc"]
    summary = {w: round(both[w]["gbps"] / alone[w], 3) for w in alone}
    print(f"alone: copy {alone['copy']:.2f} GB/s, crc {alone['crc']:.2f} GB/s")
    print(
        f"together: copy {both['copy']['gbps']:.2f} ({summary['copy']:.2f}x), "
        f"crc {both['crc']['gbps']:.2f} ({summary['crc']:.2f}x)"
    )
    doc = {
        "command": "python scripts/crc_beside_copy_probe.py"
        + f" --reps {a.reps} --seconds {a.seconds}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "crc32c_impl": _fxio.crc32c_impls()[0],
        "cases": res,
        "together_over_alone": summary,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
