#!/usr/bin/env python3
"""What a torch fill just before a timed read adds to the reader's measured
CPU (root: XFS on a RAM-backed loop device, cold).

lmcache-fx bench measures a tier read's CPU as the process's CPU over the
read. Before the commit that added this script it zeroed the destination with torch's zero_() just
before; torch's intra-op threads keep spinning for a while after such a fill,
and that spinning was counted as the reader's. This probe stores one
workload through a reader of the bench (LMCache's engine or an L2 adapter,
as the bench drives it), then reads it back --reps times, alternating: the
destination zeroed with torch's zero_() just before the read, or with one
memset (what the bench does now). Prints tier GB/s and CPU s/GB, medians,
and writes --json.

    sudo .venv/bin/python scripts/tier_cpu_probe.py --readers fx-noverify,fs_native --json docs/tier-cpu-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache_fx.testing.loopfs import drop_caches, why_not_available, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.l2 import L2Reader  # noqa: E402
from lmcache_fx.tools.bench.run import READER_CLASSES  # noqa: E402
from lmcache_fx.tools.bench.workload import BenchConfig, Workload, cpu_seconds, zero  # noqa: E402
from lmcache_fx.tools.models import GB, PRESETS  # noqa: E402


def _read_once(r, fill: str) -> tuple[float, float]:
    """(seconds, CPU seconds) of one timed tier read, after zeroing the
    destination one way."""
    drop_caches()
    if isinstance(r, L2Reader):
        dst = r.t[r.w.nbytes :]
        dst.zero_() if fill == "torch" else zero(dst)
        keys = r.keys(0)
        r.lookup_lock(keys)
        c, t = cpu_seconds(), time.perf_counter()
        ok = r.load(keys, r.dst_objs)
        s, cpu = time.perf_counter() - t, cpu_seconds() - c
        r.adapter.submit_unlock(keys)
    else:
        w = r.w
        w.dst.zero_() if fill == "torch" else zero(w.dst)
        r.meter.reset()
        mask = r.engine.retrieve(r._tokens, kvcaches=w.dst, slot_mapping=w.slot_mapping)
        ok = int(mask.sum()) == w.tokens_n
        s, cpu = r.meter.seconds, r.meter.cpu
    if not ok:
        raise RuntimeError(f"{r.name}: the read missed")
    return s, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--readers", default="fx-noverify,fs_native")
    ap.add_argument("--preset", default="qwen2.5-32b")
    ap.add_argument("--total-gb", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json")
    a = ap.parse_args()
    why = why_not_available()
    if why:
        print(f"skipped: {why}")
        return 0
    geo = PRESETS[a.preset]
    n = max(1, int(a.total_gb * GB) // geo.chunk_bytes)
    out: dict = {}
    with xfs_loop("5G", touch=True) as mnt, ExitStack() as stack:
        cfg = BenchConfig(path=mnt, geo=geo, n_chunks=n, reps=a.reps)
        w = Workload(geo, n)
        readers = []
        for name in a.readers.split(","):
            r = READER_CLASSES[name](cfg, w)
            r.open(stack)
            if isinstance(r, L2Reader):
                if not r.store(r.keys(0), r.src_objs):
                    raise RuntimeError(f"{name}: store failed")
            else:
                r._tokens = w.tokens(0)
                r.engine.store(r._tokens, kvcaches=w.src, slot_mapping=w.slot_mapping)
                r.wait_stored(r.keys(r._tokens))
            readers.append(r)
        samples: dict = {(r.name, f): [] for r in readers for f in ("torch", "memset")}
        for rep in range(a.reps):
            fills = ("torch", "memset") if rep % 2 == 0 else ("memset", "torch")
            for r in readers:
                for f in fills:
                    samples[(r.name, f)].append(_read_once(r, f))
        gb = w.nbytes / GB
        for (name, f), v in samples.items():
            e = out.setdefault(name, {})
            e[f] = {
                "tier_read_gbps": statistics.median(gb / s for s, _ in v),
                "tier_cpu_s_per_gb": statistics.median(c / gb for _, c in v),
                "samples_s_cpu": [[round(s, 5), round(c, 5)] for s, c in v],
            }
            print(
                f"{name:12s} fill by {f:6s}: {e[f]['tier_read_gbps']:6.2f} GB/s  "
                f"{e[f]['tier_cpu_s_per_gb']:.4f} CPU s/GB (medians of {a.reps})"
            )
    if a.json:
        doc = {
            "command": "python scripts/tier_cpu_probe.py " + " ".join(sys.argv[1:]),
            "git_commit": git_commit(),
            "medium": "XFS on a RAM-backed loop device (/dev/shm image), page cache dropped before every read",
            "workload": {"preset": a.preset, "chunks": n, "chunk_bytes": geo.chunk_bytes},
            "reps": a.reps,
            "statistic": "median over reps; the two fills alternate in order rep by rep",
            "host": {"cpus": os.cpu_count(), "loadavg_at_end": list(os.getloadavg())},
            "readers": out,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
