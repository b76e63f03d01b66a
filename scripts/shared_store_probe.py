#!/usr/bin/env python3
"""Several processes storing into one full store at once (TP ranks sharing
a path): the aggregate store speed, and how much of the wall time the
shared store lock is held (every writer's reservation, eviction and commit
take it). Each process is a ChunkStore of its own, storing batches of
2 MiB chunks that all evict; tmpfs (/dev/shm), and XFS on a RAM-backed loop
device when root.

    .venv/bin/python scripts/shared_store_probe.py --json docs/shared-store-probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing.lock_timing import time_lock_holds  # noqa: E402
from lmcache_fx.testing.loopfs import xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20
CHUNK = 2 * MIB
PER_BATCH = 64
META = ChunkMeta(((CHUNK // 2,),), ("bfloat16",), "KV_2LTD")
MAX_PROCS = 4


def _capacity_gb() -> float:
    return MAX_PROCS * PER_BATCH * (HEADER_SIZE + CHUNK) / (1 << 30)  # one batch of each of MAX_PROCS writers


def writer(path: str, rank: int, batches: int) -> None:
    """One process: waits for a line on stdin, stores its batches, prints
    its time, the seconds it held the store lock and the files it reused."""
    held = [0.0]

    def add(seconds: float) -> None:
        held[0] += seconds

    time_lock_holds(add)
    src = _fxio.HostBuffer(CHUNK * PER_BATCH, hugepages=False)
    memoryview(src)[:] = os.urandom(MIB) * (CHUNK * PER_BATCH // MIB)
    s = ChunkStore(FxOptions(path=path, max_capacity_gb=_capacity_gb()))
    print("READY", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    stored = 0
    for b in range(batches):
        items = [(f"r{rank}-b{b}-{i}", src.address + i * CHUNK, CHUNK, META) for i in range(PER_BATCH)]
        stored += sum(s.write(items))
    out = {"seconds": time.perf_counter() - t0, "stored": stored, "lock_held_s": held[0]}
    out["recycled"] = s.stats.snapshot()["recycled"]
    s.close()
    print(json.dumps(out), flush=True)


def one(path: str, nprocs: int, batches: int) -> dict:
    """Fills the store to its capacity, then runs nprocs writers at once."""
    shutil.rmtree(path, ignore_errors=True)
    src = _fxio.HostBuffer(CHUNK * PER_BATCH, hugepages=False)
    s = ChunkStore(FxOptions(path=path, max_capacity_gb=_capacity_gb()))
    for b in range(MAX_PROCS):
        assert all(s.write([(f"fill{b}-{i}", src.address + i * CHUNK, CHUNK, META) for i in range(PER_BATCH)]))
    s.close()
    kids = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--writer", path, str(r), str(batches)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(nprocs)
    ]
    try:
        for k in kids:
            assert k.stdout is not None and k.stdout.readline().strip() == "READY"
        t0 = time.perf_counter()
        for k in kids:
            assert k.stdin is not None
            k.stdin.write("go\n")
            k.stdin.flush()
        res = [json.loads(k.stdout.readline()) for k in kids if k.stdout is not None]
        wall = time.perf_counter() - t0
    finally:
        for k in kids:
            k.wait()
        shutil.rmtree(path, ignore_errors=True)
    chunks = nprocs * batches * PER_BATCH
    assert sum(r["stored"] for r in res) == chunks
    return {
        "processes": nprocs,
        "gbps": chunks * CHUNK / 1e9 / wall,
        "lock_held_fraction": sum(r["lock_held_s"] for r in res) / wall,
        "recycled": sum(r["recycled"] for r in res),
        "chunks": chunks,
        "wall_s": wall,
    }


def main() -> None:
    if sys.argv[1:2] == ["--writer"]:
        writer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=12, help="batches of 64 x 2 MiB per process")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    media: list = [("tmpfs (/dev/shm, page cache)", None)]
    if os.geteuid() == 0:
        media.append(("XFS on a 3 GiB RAM-backed loop device (O_DIRECT)", "xfs"))
    out: dict = {"chunk_bytes": CHUNK, "chunks_per_batch": PER_BATCH, "batches": args.batches, "media": {}}
    for label, kind in media:
        with xfs_loop("3G", touch=True) if kind else contextlib.nullcontext("/dev/shm") as base:
            rows = [one(os.path.join(base, f"fx-shared-probe-{os.getpid()}"), n, args.batches) for n in (1, 2, 4)]
        out["media"][label] = rows
        for r in rows:
            print(
                f"{label:50} {r['processes']} processes: {r['gbps']:.2f} GB/s, store lock held "
                f"{100 * r['lock_held_fraction']:.0f}% of the time, {r['recycled']}/{r['chunks']} reused"
            )
    out.update(
        command="python scripts/shared_store_probe.py" + "".join(f" {a}" for a in sys.argv[1:]),
        git_commit=git_commit(),
        cpus=os.cpu_count(),
        loadavg_end=list(os.getloadavg()),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
