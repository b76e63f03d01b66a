#!/usr/bin/env python3
"""The first reads of a fresh process, many at once, with LMCache's pool
registered as io_uring fixed buffers (root: XFS on a RAM-backed loop).

Each concurrent batch takes an io_uring ring of its own, made on first use
and kept. On Linux 6.12+ a new ring clones the engine's registration; on
older kernels it could only pin the whole table again. This probe runs each
case in a fresh child process: a ChunkStore on the loop filesystem, a pool
of 4 KiB pages registered (timed: what pinning it once costs), 64 chunks of
2 MiB written, the page cache dropped, then bursts of --inflight one-chunk
reads released at once (wall time of the burst, each request's time). Cases:

    clone         the pool registered, rings clone it (needs Linux 6.12+)
    no_clone      the same with the no_clone fault point (a kernel before
                  6.12): a table over FIXED_PER_RING_MAX is not registered
    no_clone-max  no_clone with a pool of FIXED_PER_RING_MAX, the largest
                  still registered on every ring: each new ring pins it

    .venv/bin/python scripts/first_burst_probe.py --reps 5 --json docs/first-burst-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

CHILD = r"""
import json, os, statistics, sys, threading, time, ctypes
sys.path.insert(0, sys.argv[1])
from lmcache_fx import _fxio
from lmcache_fx.core.chunkfile import ChunkMeta
from lmcache_fx.core.options import FxOptions
from lmcache_fx.core.store import ChunkStore
from lmcache_fx.testing.loopfs import drop_caches, xfs_loop

pool_bytes, inflight, bursts = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
size, n = 2 << 20, 64
meta = ChunkMeta(((size // 2,),), ("bfloat16",), "raw")
with xfs_loop("1G", touch=True) as mnt:
    st = ChunkStore(FxOptions(path=os.path.join(mnt, "s"), max_capacity_gb=0.5))
    pool = _fxio.HostBuffer(pool_bytes, hugepages=False)
    ctypes.memset(pool.address, 1, pool_bytes)
    t = time.perf_counter()
    r = st.engine.register_buffer(pool.address, pool_bytes)
    register_ms = (time.perf_counter() - t) * 1e3
    keys = [f"probe@1@0@{i:04x}@bfloat16" for i in range(n)]
    assert all(st.write([(k, pool.address, size, meta) for k in keys]))
    out = {"register_result": r, "register_ms": register_ms, "registered": st.engine.registered, "bursts": []}
    for b in range(bursts):
        drop_caches()
        gate = threading.Barrier(inflight)
        lat = [0.0] * inflight
        misses = []

        def one(i, b=b):
            gate.wait()
            t = time.perf_counter()
            got = st.read([keys[(b * inflight + i) % n]], lambda m: (i, pool.address + i * size, size), lambda h: None)
            lat[i] = time.perf_counter() - t
            if got[0] is None:
                misses.append(i)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(inflight)]
        t0 = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        out["bursts"].append({
            "wall_ms": (time.perf_counter() - t0) * 1e3,
            "p50_ms": statistics.median(lat) * 1e3,
            "max_ms": max(lat) * 1e3,
            "misses": len(misses),
        })
    st.close()
print("RESULT " + json.dumps(out), flush=True)
"""

CASES = {
    "clone": ("", None),
    "no_clone": ("no_clone:1000000", None),
    "no_clone-max": ("no_clone:1000000", _fxio.FIXED_PER_RING_MAX),
}


def run_case(fault: str, pool_bytes: int, inflight: int, bursts: int) -> dict:
    env = dict(os.environ)
    env.pop("LMCACHE_FX_FAULT", None)
    if fault:
        env["LMCACHE_FX_FAULT"] = fault  # armed when the store makes its engine
    p = subprocess.run(
        [sys.executable, "-c", CHILD, ROOT, str(pool_bytes), str(inflight), str(bursts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"child failed (rc {p.returncode}):\n{p.stdout}\n{p.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="fresh processes per case")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--bursts", type=int, default=3, help="bursts per process (the first one is the point)")
    ap.add_argument("--json")
    a = ap.parse_args()
    big = int(a.pool_gib * (1 << 30))
    raw: dict = {name: [] for name in CASES}
    for rep in range(a.reps):
        for name, (fault, pool) in CASES.items():  # interleaved
            res = run_case(fault, pool or big, a.inflight, a.bursts)
            raw[name].append(res)
            first = res["bursts"][0]
            print(
                f"rep {rep} {name:13s} register {res['register_result']:4d} in {res['register_ms']:7.1f} ms;"
                f" first burst {first['wall_ms']:8.1f} ms (p50 {first['p50_ms']:.1f}), later"
                f" {statistics.median(b['wall_ms'] for b in res['bursts'][1:]):.1f} ms",
                flush=True,
            )
    summary = {}
    for name, runs in raw.items():
        summary[name] = {
            "pool_bytes": CASES[name][1] or big,
            "registered": [r["registered"] for r in runs],
            "register_ms": round(statistics.median(r["register_ms"] for r in runs), 1),
            "first_burst_wall_ms": round(statistics.median(r["bursts"][0]["wall_ms"] for r in runs), 1),
            "first_burst_p50_ms": round(statistics.median(r["bursts"][0]["p50_ms"] for r in runs), 1),
            "later_burst_wall_ms": round(statistics.median(b["wall_ms"] for r in runs for b in r["bursts"][1:]), 1),
            "misses": sum(b["misses"] for r in runs for b in r["bursts"]),
        }
    doc = {
        "command": "python scripts/first_burst_probe.py"
        + f" --reps {a.reps} --pool-gib {a.pool_gib:g} --inflight {a.inflight} --bursts {a.bursts}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "kernel": os.uname().release,
        "kernel_clones_registration": _fxio.io_uring_shares_buffers(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "XFS on a 1 GiB RAM-backed loop device; 64 chunks of 2 MiB; cold before each burst",
        "cases": summary,
        "raw": raw,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
