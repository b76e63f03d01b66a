#!/usr/bin/env python3
"""Checked O_DIRECT reads through a small staging buffer, against fx's
direct reads, on the XFS loop (root). The engine today reads a checked
piece straight into its destination and takes its CRC32C afterwards: three
passes over memory with the loop device's copy (the image read, the
destination written, the destination read again), and on this VM the CRC's
memory traffic slows the copy (docs/crc-beside-copy-probe.json). Staged,
each reading thread reads a window of the file into a buffer of its own,
small enough to stay in the CPU's cache, and moves it to the destination
with the one-pass copy and CRC32C (_fxio.crc32c_copy, streaming stores):
two passes over memory, the third in cache, at the price of a copy on the
reader's core. The hand-made ways (threads with windows of their own) were
the measurement that led to the engine's own staged reads (Engine.read's
stage=True, option staged_reads), which run here beside them.

7 x 64 MiB files written O_DIRECT on a fresh image made as the bench makes
it; every way reads all of them into one huge-page destination, page cache
dropped before each, ways rotated every rep; GB/s and process CPU s/GB
(getrusage), and each rep's speed over the direct checked read's of the
same rep (pairs' median). Every checked read is compared with the CRC32C
the files were written with.

    .venv/bin/python scripts/staged_direct_probe.py --reps 15 --json docs/staged-direct-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loop_position_probe's file writer

from loop_position_probe import write_direct  # noqa: E402

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, image_pages, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import cpu_seconds  # noqa: E402

MIB = 1 << 20
CHUNK = 64 * MIB
N = 7
STAGED = ((2, 4, 4), (4, 4, 4), (4, 2, 2), (8, 2, 2), (4, 8, 8))  # threads, window MiB, queue depth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    with xfs_loop("3G", touch=True) as mnt:
        pages = image_pages(mnt)
        src = _fxio.HostBuffer(CHUNK, hugepages=True)
        memoryview(src)[:] = os.urandom(CHUNK)
        want = _fxio.crc32c(memoryview(src))
        fds = []
        for i in range(N):
            p = os.path.join(mnt, f"c{i}")
            write_direct(p, src, CHUNK)
            fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
        dest = _fxio.HostBuffer(N * CHUNK, hugepages=True)
        memoryview(dest)[:] = bytes(N * CHUNK)
        ops = [(fds[i], 0, CHUNK, dest.address + i * CHUNK) for i in range(N)]
        direct = _fxio.Engine(io_engine="io_uring", queue_depth=32, split_bytes=MIB)  # fx's defaults

        def direct_read(crc: bool, staged: bool = False):
            def go() -> None:
                if crc:
                    assert direct.read(ops, crc=True, stage=staged) == [(CHUNK, want)] * N
                else:
                    assert direct.read(ops) == [CHUNK] * N

            return go

        def staged_read(threads: int, window: int, qd: int):
            engines = [_fxio.Engine(io_engine="io_uring", queue_depth=qd, split_bytes=MIB) for _ in range(threads)]
            stages = [_fxio.HostBuffer(window, hugepages=True) for _ in range(threads)]
            for s in stages:
                memoryview(s)[:] = bytes(window)
            bad: list = []

            def one(t: int) -> None:
                for i in range(t, N, threads):
                    crc = 0
                    for off in range(0, CHUNK, window):
                        if engines[t].read([(fds[i], off, window, stages[t].address)]) != [window]:
                            bad.append((i, off))
                        crc = _fxio.crc32c_copy(dest.address + i * CHUNK + off, stages[t].address, window, crc)
                    if crc != want:
                        bad.append(i)

            def go() -> None:
                ts = [threading.Thread(target=one, args=(t,)) for t in range(threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                assert not bad, bad

            return go

        ways = {"direct, unchecked (QD 32, 1 MiB pieces)": direct_read(False)}
        ways["direct, checked (fx's default: QD 32, 1 MiB pieces)"] = direct_read(True)
        ways["engine staged (stage=True: QD 32, 1 MiB pieces, 8 MiB of slots)"] = direct_read(True, staged=True)
        for th, win, qd in STAGED:
            name = f"staged, {th} threads, {win} MiB window each, QD {qd}: {th * win} MiB staging"
            ways[name] = staged_read(th, win * MIB, qd)
        names = list(ways)
        got: dict = {n: {"gbps": [], "cpu": []} for n in names}
        for rep in range(a.reps):
            k = rep % len(names)
            for n in names[k:] + names[:k]:
                drop_caches()
                c0, t0 = cpu_seconds(), time.perf_counter()
                ways[n]()
                el, c = time.perf_counter() - t0, cpu_seconds() - c0
                got[n]["gbps"].append(round(N * CHUNK / el / 1e9, 3))
                got[n]["cpu"].append(round(c / (N * CHUNK / 1e9), 4))
        for f in fds:
            os.close(f)
    base = got[names[1]]["gbps"]
    res = {
        n: {
            "gbps": round(statistics.median(v["gbps"]), 3),
            "cpu_s_per_gb": round(statistics.median(v["cpu"]), 4),
            "over_direct_checked": round(statistics.median(x / y for x, y in zip(v["gbps"], base)), 3),
            "gbps_each": v["gbps"],
            "cpu_each": v["cpu"],
        }
        for n, v in got.items()
    }
    for n, v in res.items():
        print(f"{n:75s} {v['gbps']:6.2f} GB/s {v['cpu_s_per_gb']:.4f} CPU s/GB {v['over_direct_checked']:.3f}x")
    doc = {
        "command": "python scripts/staged_direct_probe.py"
        + f" --reps {a.reps}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "XFS on a 3 GiB RAM-backed loop device made as the bench makes it; 7 x 64 MiB files; cold",
        "loop_image": pages,
        "ways": res,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
