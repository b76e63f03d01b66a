#!/usr/bin/env python3
"""fx's store read path against split_bytes and queue_depth, on a grid:
ChunkStore.read of ~0.47 GB (7 x 64 MiB, 47 x 10 MiB, 238 x 2 MiB) from XFS
on a RAM-backed loop device, cold (page cache dropped before every read;
--tmpfs: /dev/shm, warm),
verification on, into one registered huge-page destination as the plugin's
pool is, one engine and store per point, warmed by a read first. The points
of one chunk size are interleaved and their order rotated every rep, so the
host's drift spreads over all of them. Root.

--verify off|both: the grid with verification off too (on a device, unchecked
reads go in pieces of at least 16 MiB whatever split_bytes says, so points
that differ only in a smaller split are the same setting twice: a gauge of
the host's noise). --fs-native 4,8: LMCache's C++ reader in the rotation, on
files it wrote with the same payloads (O_DIRECT, those worker counts), and
each fx point's speed over the faster of them in the same rep.

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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # chunk_overhead's fs_native driver

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.chunkfile import ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions, parse_size  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import cpu_seconds  # noqa: E402

MIB = 1 << 20
SIZES = {"64M": (7, 64 * MIB), "10M": (47, 10 * MIB), "2M": (238, 2 * MIB)}


def probe(
    mnt: str,
    label: str,
    reps: int,
    qds: list[int],
    splits: list[int],
    cold: bool,
    verifies: tuple[bool, ...] = (True,),
    fs_workers: tuple[int, ...] = (),
) -> dict:
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
    views = [memoryview(dst)[i * cb : (i + 1) * cb] for i in range(n)]
    fs_clients = {}
    if fs_workers:
        from chunk_overhead import FsNative

        # LMCache's key wire format (model@rank@group@hash); the same payload in every file, as fx's
        fs_keys = [f"split@{0:08x}@0@{cb:x}{i:08x}" for i in range(n)]
        memoryview(dst)[:cb] = memoryview(src)
        for i in range(1, n):
            views[i][:] = views[0]
        for wk in fs_workers:  # one set of files, read by each worker count
            fs_clients[wk] = FsNative(os.path.join(mnt, f"{label}-fs_native"), wk)
        assert all(fs_clients[fs_workers[0]].set(fs_keys, views)), "fs_native writes failed"
    points: list = [(qd, sb, v) for v in verifies for sb in splits for qd in qds]
    points += [("fs_native", wk, None) for wk in fs_workers]
    got: dict = {p: [] for p in points}

    def read(s: ChunkStore) -> list:
        slot = iter(range(n))
        return s.read(keys, lambda m: (lambda i: (i, dst.address + i * cb, cb))(next(slot)), lambda h: None)

    # One engine and store per point for the whole run, each warmed by a read (rings, threads, the index of
    # headers a running store has), so that a timed read is what a running store's is. Each point's reader
    # returns whether every chunk came back.
    stores = {}
    readers = {}
    for qd, sb, verify in points:
        if qd == "fs_native":
            readers[(qd, sb, verify)] = lambda c=fs_clients[sb]: all(c.get(fs_keys, views))
            continue
        eng = _fxio.Engine("io_uring", qd, sb)
        eng.register_buffer(dst.address, n * cb)
        stores[(qd, sb, verify)] = s = ChunkStore(
            FxOptions(path=d, queue_depth=qd, split_bytes=sb, verify=verify, max_capacity_gb=1e6), engine=eng
        )
        readers[(qd, sb, verify)] = lambda s=s: all(o is not None for o in read(s))
        assert readers[(qd, sb, verify)](), "warm-up read missed"
    for rep in range(reps):
        k = rep % len(points)
        for p in points[k:] + points[:k]:
            if cold:
                drop_caches()
            c0, t0 = cpu_seconds(), time.perf_counter()
            ok = readers[p]()
            t, c = time.perf_counter() - t0, cpu_seconds() - c0
            assert ok, f"{p}: a chunk missed"
            got[p].append((n * cb / t / 1e9, c / (n * cb / 1e9)))
    for c in fs_clients.values():
        c.close()
    for s in stores.values():
        eng = s.engine
        s.close()
        eng.close()
    for gone in (d, os.path.join(mnt, f"{label}-fs_native")):  # room for the next size
        shutil.rmtree(gone, ignore_errors=True)
    base = got.get((32, MIB, True))
    fs_best = [max(x) for x in zip(*(got[("fs_native", wk, None)] for wk in fs_workers))] if fs_workers else None
    rows = []
    for (qd, sb, verify), rs in got.items():
        row: dict = (
            {"reader": "fs_native", "workers": sb}
            if qd == "fs_native"
            else {"queue_depth": qd, "split_bytes": sb, "verify": verify}
        )
        row |= {
            "gbps": round(statistics.median(r[0] for r in rs), 3),
            "cpu_s_per_gb": round(statistics.median(r[1] for r in rs), 4),
            "gbps_each": [round(r[0], 3) for r in rs],
        }
        if base:
            # Same rep, same position in the rotation's cycle: the ratio of a pair read minutes apart at most.
            row["over_qd32_1m"] = round(statistics.median(a[0] / b[0] for a, b in zip(rs, base)), 3)
        if fs_best:
            # each rep's speed over the faster fs_native of the same rep
            row["over_fs_native"] = round(statistics.median(a[0] / b[0] for a, b in zip(rs, fs_best)), 3)
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
    ap.add_argument("--verify", choices=("on", "off", "both"), default="on", help="fx's verification (default on)")
    ap.add_argument("--fs-native", default="", metavar="WORKERS", help="e.g. 4,8: fs_native in the rotation")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    verifies = {"on": (True,), "off": (False,), "both": (True, False)}[a.verify]
    fs_workers = tuple(int(x) for x in a.fs_native.split(",") if x)
    qds = [int(x) for x in a.qd.split(",")]
    splits = [parse_size(x) for x in a.split.split(",")]
    results = {}
    with tmpfs_dir() if a.tmpfs else xfs_loop("3G", touch=True) as mnt:
        for label in a.sizes.split(","):
            results[label] = probe(mnt, label, a.reps, qds, splits, not a.tmpfs, verifies, fs_workers)
            for r in sorted(results[label]["points"], key=lambda r: -r["gbps"]):
                what = (
                    f"fs_native, {r['workers']} workers"
                    if "workers" in r
                    else f"qd {r['queue_depth']:>3} split {r['split_bytes'] // MIB:>2}M verify {'on ' if r['verify'] else 'off'}"
                )
                print(
                    f"{label} {what:<28}: {r['gbps']:.2f} GB/s {r['cpu_s_per_gb']:.3f} CPU s/GB  "
                    f"x{r.get('over_qd32_1m', float('nan')):.2f} of qd32/1M  x{r.get('over_fs_native', float('nan')):.2f} of fs_native",
                    flush=True,
                )
    doc = {
        "command": "python scripts/read_split_probe.py"
        + "".join(f" --{k} {v}" for k, v in (("reps", a.reps), ("sizes", a.sizes), ("qd", a.qd), ("split", a.split)))
        + (" --tmpfs" if a.tmpfs else "")
        + (f" --verify {a.verify}" if a.verify != "on" else "")
        + (f" --fs-native {a.fs_native}" if a.fs_native else "")
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": ("tmpfs (/dev/shm), warm" if a.tmpfs else "XFS on a 3 GiB RAM-backed loop device, O_DIRECT, cold")
        + f", verify {a.verify}",
        "results": results,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
