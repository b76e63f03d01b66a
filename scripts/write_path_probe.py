#!/usr/bin/env python3
"""O_DIRECT stores: the one-call write path (Engine.write_chunks: payload,
CRC32C, header and LRU clock as one pipeline per chunk) against the
two-batch path (a payload batch, headers encoded in Python, a header batch),
which page-cache stores and stores with auth_key still run. Both on one
store in one process, interleaved (A B B A ...), ChunkStore.write of
238 x 2 MiB; once into a store with room (each rep's chunks removed after
it) and once into a full one (every chunk evicts one, victims reused).
Root: XFS on a RAM-backed loop device.

    .venv/bin/python scripts/write_path_probe.py --reps 12 --json docs/write-path-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core import store as store_mod  # noqa: E402
from lmcache_fx.core.chunkfile import ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.testing.loopfs import xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import cpu_seconds  # noqa: E402

MIB = 1 << 20
N, CHUNK = 238, 2 * MIB


class _TwoBatches:
    """The store's engine without write_chunks: the store then writes with
    two engine batches, as it does where write_chunks is not used."""

    def __init__(self, engine):
        self._engine = engine

    def write(self, *a, **kw):
        return self._engine.write(*a, **kw)


def run(mnt: str, name: str, cap_gb: float, room: bool, reps: int, src, meta) -> dict:
    s = store_mod.ChunkStore(FxOptions(path=os.path.join(mnt, name), max_capacity_gb=cap_gb))
    real = s.engine
    got: dict = {"one call": [], "two batches": []}
    try:
        for rep in range(reps):
            kinds = ["one call", "two batches"]
            for kind in kinds if rep % 2 else kinds[::-1]:
                s.engine = real if kind == "one call" else _TwoBatches(real)
                keys = [f"{name}-{kind[0]}{rep}-{i}" for i in range(N)]
                t0, c0 = time.perf_counter(), cpu_seconds()
                ok = s.write([(k, src.address + i * CHUNK, CHUNK, meta) for i, k in enumerate(keys)])
                t, c = time.perf_counter() - t0, cpu_seconds() - c0
                s.engine = real
                assert all(ok), f"{kind}: {ok.count(False)} chunks not stored"
                got[kind].append({"gbps": N * CHUNK / t / 1e9, "cpu_s_per_gb": c / (N * CHUNK / 1e9)})
                if room:
                    for k in keys:
                        s.remove(k)
        stats = s.stats.snapshot()
    finally:
        s.engine = real
        s.close()
    out: dict = {"store": "with room" if room else "full (every chunk evicts one)", "reps": reps}
    for kind, rs in got.items():
        out[kind] = {
            "gbps": statistics.median(r["gbps"] for r in rs),
            "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in rs),
            "gbps_each": [round(r["gbps"], 3) for r in rs],
        }
    pairs = [a["gbps"] / b["gbps"] for a, b in zip(got["one call"], got["two batches"])]
    out["one_call_over_two_batches"] = out["one call"]["gbps"] / out["two batches"]["gbps"]
    out["per_pair"] = [round(p, 3) for p in pairs]
    out["evictions"], out["recycled"] = stats["evictions"], stats["recycled"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)  # 12 for docs/write-path-probe.json
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    src = _fxio.HostBuffer(N * CHUNK, hugepages=True)
    memoryview(src)[:] = os.urandom(MIB) * (N * CHUNK // MIB)
    meta = ChunkMeta(((CHUNK // 2,),), ("bfloat16",), "KV_2LTD")
    with xfs_loop("6G", touch=True) as mnt:
        # Write the loop image's pages once: no rep pays for the RAM behind the device.
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={mnt}/fill", "bs=4M", "count=1400", "oflag=direct", "status=none"], check=True
        )
        os.unlink(f"{mnt}/fill")
        results = [
            run(mnt, "room", 2.5, True, a.reps, src, meta),
            run(mnt, "full", 1.6, False, a.reps, src, meta),
        ]
    doc = {
        "command": "python scripts/write_path_probe.py"
        + (f" --reps {a.reps}" if a.reps != 8 else "")
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "XFS on a 6 GiB RAM-backed loop device (O_DIRECT), image pages written first",
        "chunks": f"{N} x 2 MiB per write",
        "results": results,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    for r in results:
        print(
            f"{r['store']}: one call {r['one call']['gbps']:.2f} GB/s {r['one call']['cpu_s_per_gb']:.3f} CPU s/GB, "
            f"two batches {r['two batches']['gbps']:.2f} GB/s {r['two batches']['cpu_s_per_gb']:.3f}; "
            f"ratio {r['one_call_over_two_batches']:.2f} (pairs {min(r['per_pair']):.2f}-{max(r['per_pair']):.2f})"
        )


if __name__ == "__main__":
    main()
