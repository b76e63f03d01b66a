#!/usr/bin/env python3
"""fx's store read path against split_bytes and queue_depth, on a grid:
ChunkStore.read of ~0.47 GB (7 x 64 MiB, 47 x 10 MiB, 238 x 2 MiB) from XFS
on a RAM-backed loop device, cold (page cache dropped before every read;
--tmpfs: /dev/shm, warm),
verification on, into one registered huge-page destination as the plugin's
pool is. The points of one chunk size are interleaved and their order
rotated every rep, so the host's drift spreads over all of them. Root.

    .venv/bin/python scripts/read_split_probe.py --reps 7 --json docs/read-split-probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.chunkfile import ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions, parse_size  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import cpu_seconds  # noqa: E402

MIB = 1 << 20
SIZES = {"64M": (7, 64 * MIB), "10M": (47, 10 * MIB), "2M": (238, 2 * MIB)}


def probe(mnt: str, label: str, reps: int, qds: list[int], splits: list[int], cold: bool) -> dict:
    n, cb = SIZES[label]
    d = os.path.join(mnt, label)
    os.makedirs(d)
    src = _fxio.HostBuffer(cb, hugepages=True)
    memoryview(src)[:] = os.urandom(cb)
    meta = ChunkMeta(((cb // 2,),), ("bfloat16",), "KV_2LTD")
    keys = [f"{label}@{i}" for i in range(n)]
    w = ChunkStore(FxOptions(path=d, max_capacity_gb=1e6))
    assert all(w.write([(k, src.address, cb, meta) for k in keys])), "writes failed"
    w.close()
    dst = _fxio.HostBuffer(n * cb, hugepages=True)
    points = [(qd, sb) for sb in splits for qd in qds]
    got: dict = {p: [] for p in points}
    for rep in range(reps):
        k = rep % len(points)
        for qd, sb in points[k:] + points[:k]:
            eng = _fxio.Engine("io_uring", qd, sb)
            eng.register_buffer(dst.address, n * cb)
            s = ChunkStore(FxOptions(path=d, queue_depth=qd, split_bytes=sb, max_capacity_gb=1e6), engine=eng)
            slot = iter(range(n))
            if cold:
                drop_caches()
            c0, t0 = cpu_seconds(), time.perf_counter()
            out = s.read(
                keys, lambda m, slot=slot: (lambda i: (i, dst.address + i * cb, cb))(next(slot)), lambda h: None
            )
            t, c = time.perf_counter() - t0, cpu_seconds() - c0
            s.close()
            assert all(o is not None for o in out), f"qd {qd} split {sb}: a chunk missed"
            got[(qd, sb)].append((n * cb / t / 1e9, c / (n * cb / 1e9)))
    base = got[(32, MIB)] if (32, MIB) in got else None
    rows = []
    for (qd, sb), rs in got.items():
        row = {
            "queue_depth": qd,
            "split_bytes": sb,
            "gbps": round(statistics.median(r[0] for r in rs), 3),
            "cpu_s_per_gb": round(statistics.median(r[1] for r in rs), 4),
            "gbps_each": [round(r[0], 3) for r in rs],
        }
        if base:
            # Same rep, same position in the rotation's cycle: the ratio of a pair read minutes apart at most.
            row["over_qd32_1m"] = round(statistics.median(a[0] / b[0] for a, b in zip(rs, base)), 3)
        rows.append(row)
    return {"chunks": f"{n} x {cb // MIB} MiB", "reps": reps, "points": rows}


@contextlib.contextmanager
def tmpfs_dir():
    d = tempfile.mkdtemp(prefix="fx-split-", dir="/dev/shm")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sizes", default="64M,10M,2M")
    ap.add_argument("--qd", default="8,16,32")
    ap.add_argument("--split", default="1M,2M,4M,8M")
    ap.add_argument("--tmpfs", action="store_true", help="a directory under /dev/shm, warm, instead of the XFS loop")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    qds = [int(x) for x in a.qd.split(",")]
    splits = [parse_size(x) for x in a.split.split(",")]
    results = {}
    with tmpfs_dir() if a.tmpfs else xfs_loop("3G", touch=True) as mnt:
        for label in a.sizes.split(","):
            results[label] = probe(mnt, label, a.reps, qds, splits, cold=not a.tmpfs)
            for r in sorted(results[label]["points"], key=lambda r: -r["gbps"]):
                print(
                    f"{label} qd {r['queue_depth']:>2} split {r['split_bytes'] // MIB:>2}M: {r['gbps']:.2f} GB/s "
                    f"{r['cpu_s_per_gb']:.3f} CPU s/GB  x{r.get('over_qd32_1m', float('nan')):.2f} of qd32/1M",
                    flush=True,
                )
    doc = {
        "command": "python scripts/read_split_probe.py"
        + "".join(f" --{k} {v}" for k, v in (("reps", a.reps), ("sizes", a.sizes), ("qd", a.qd), ("split", a.split)))
        + (" --tmpfs" if a.tmpfs else "")
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "tmpfs (/dev/shm), warm, verify on"
        if a.tmpfs
        else "XFS on a 3 GiB RAM-backed loop device, O_DIRECT, cold, verify on",
        "results": results,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
