#!/usr/bin/env python3
"""What a large store costs its writers and its peers (root: XFS on a
RAM-backed loop device), at the store level, with N small chunks:

  walk:      one walk of every fan-out directory (what a scan does), warm and
             with cold dentries and inodes;
  evict:     a write of 100 chunks into the full store with an old victim
             list: the write's time and the longest hold of the store lock
             (peers' stores wait that long);
  recompute: a write of 100 chunks when the ledger is due to be recomputed
             from the files (every RESCAN_SECONDS): its time, the longest
             hold of the store lock, and whether the ledger then equals the
             files;
  open:      a second process opening the store while another has it open
             (a restarted TP rank): its time and its longest lock hold;
  contains:  the cost of one contains() (an fstatat), which the L2 adapter
             now asks per evicted key instead of per key it has stored.

    .venv/bin/python scripts/large_store_probe.py --json docs/large-store-probe.json
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
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing.lock_timing import time_lock_holds  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

CHUNK = 4096
BATCH = 1000
META = ChunkMeta(((CHUNK // 2,),), ("bfloat16",), "KV_2LTD")

_holds: list[float] = []


def _options(path: str, n: int) -> FxOptions:
    return FxOptions(path=path, max_capacity_gb=n * (HEADER_SIZE + CHUNK) / (1 << 30))


def _keys(prefix: str, n: int) -> list[str]:
    return [f"probe@1@0@{prefix}{i:012x}@bfloat16" for i in range(n)]


def _write(s: ChunkStore, src, keys: list[str]) -> None:
    for i in range(0, len(keys), BATCH):
        part = keys[i : i + BATCH]
        assert all(s.write([(k, src.address + j * CHUNK, CHUNK, META) for j, k in enumerate(part)]))


def probe(mnt: str, n: int, reps: int) -> dict:
    path = os.path.join(mnt, "store")
    src = _fxio.HostBuffer(CHUNK * BATCH, hugepages=False)
    memoryview(src)[:] = os.urandom(CHUNK * BATCH)
    s = ChunkStore(_options(path, n))
    _write(s, src, _keys("f", n))
    out: dict = {"chunks": n, "chunk_bytes": CHUNK, "reps": reps}

    walk = []
    for rep in range(reps + 1):
        if rep == reps:
            drop_caches()
        t0 = time.perf_counter()
        found, _ = s._walk(remove_stale=False)
        walk.append(time.perf_counter() - t0)
        assert len(found) == n
    out["walk_s"] = {"warm": walk[:reps], "cold": walk[reps]}

    ev_hold, ev_s = [], []
    for rep in range(reps):
        s._victims_at = -1e9  # an old victim list: the write rebuilds it
        _holds.clear()
        t0 = time.perf_counter()
        _write(s, src, _keys(f"e{rep}-", 100))
        ev_s.append(time.perf_counter() - t0)
        ev_hold.append(max(_holds))
    out["evicting_write_100"] = {"seconds": ev_s, "longest_lock_hold_s": ev_hold}

    rc_hold, rc_s, rc_exact = [], [], []
    for rep in range(reps):
        with s._ledger.hold():
            s._ledger.put(s._ledger.get()[0] + 4096, time.time() - 1e6)  # due, and 4 KiB off
        _holds.clear()
        t0 = time.perf_counter()
        _write(s, src, _keys(f"r{rep}-", 100))
        rc_s.append(time.perf_counter() - t0)
        rc_hold.append(max(_holds))
        _, on_disk = s._walk(remove_stale=False)
        rc_exact.append(s.usage_bytes == on_disk)
    out["recompute_due_write_100"] = {"seconds": rc_s, "longest_lock_hold_s": rc_hold, "ledger_exact": rc_exact}

    t0 = time.perf_counter()
    keys = _keys("f", n)[-2000:]
    hits = sum(s.contains(k) for k in keys)
    out["contains_us_per_key"] = (time.perf_counter() - t0) / len(keys) * 1e6
    out["contains_hits"] = hits

    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {ROOT!r}); from lmcache_fx.core.store import ChunkStore; "
            f"from lmcache_fx.core.options import FxOptions; s = ChunkStore(FxOptions(path={path!r}, "
            f"max_capacity_gb={n * (HEADER_SIZE + CHUNK) / (1 << 30)!r})); print('READY', flush=True); "
            "sys.stdin.read(); s.close()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "READY"
        op_hold, op_s = [], []
        for rep in range(reps + 1):
            if rep == reps:
                drop_caches()
            _holds.clear()
            t0 = time.perf_counter()
            s2 = ChunkStore(_options(path, n))
            op_s.append(time.perf_counter() - t0)
            op_hold.append(max(_holds) if _holds else 0.0)
            s2.close()
        out["open_beside_a_peer"] = {
            "seconds": op_s[:reps],
            "longest_lock_hold_s": op_hold[:reps],
            "cold_seconds": op_s[reps],
            "cold_longest_lock_hold_s": op_hold[reps],
        }
    finally:
        peer.communicate("")
    s.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=50_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("large_store_probe: needs root (XFS on a RAM-backed loop device)")
    time_lock_holds(_holds.append)
    with xfs_loop("4G", touch=True) as mnt:
        res = probe(mnt, args.chunks, args.reps)
    res.update(
        command="python scripts/large_store_probe.py" + "".join(f" {a}" for a in sys.argv[1:]),
        git_commit=git_commit(),
        loadavg_end=list(os.getloadavg()),
        medium="XFS on a 4 GiB RAM-backed loop device",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    w, e, o = res["walk_s"], res["evicting_write_100"], res["open_beside_a_peer"]
    r = res["recompute_due_write_100"]
    print(f"{res['chunks']} chunks of {CHUNK} B on {res['medium']}:")
    print(f"  walk: {statistics.median(w['warm']):.3f} s warm, {w['cold']:.3f} s cold")
    print(
        f"  a 100-chunk write that evicts, old victim list: {statistics.median(e['seconds']):.3f} s, longest lock "
        f"hold {1e3 * max(e['longest_lock_hold_s']):.1f} ms"
    )
    print(
        f"  a 100-chunk write with the ledger recompute due: {statistics.median(r['seconds']):.3f} s, longest lock "
        f"hold {1e3 * max(r['longest_lock_hold_s']):.1f} ms, ledger = files after: {all(r['ledger_exact'])}"
    )
    print(
        f"  opening beside a peer: {statistics.median(o['seconds']):.3f} s ({o['cold_seconds']:.3f} s cold), "
        f"longest lock hold {1e3 * max(o['longest_lock_hold_s'] + [o['cold_longest_lock_hold_s']]):.1f} ms"
    )
    print(f"  contains(): {res['contains_us_per_key']:.1f} us a key")


if __name__ == "__main__":
    main()
