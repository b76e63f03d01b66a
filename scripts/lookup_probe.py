#!/usr/bin/env python3
"""What a lookup costs per key: µs per key of the store's lookups, the way
LMCache's entry points ask (a prefix of a prompt's chunks, pinned or not; one
key at a time), on chunks that are there, on chunks that are not, on
chunks this process has not indexed yet (a fresh process after a restart),
and pinned on chunks not touched lately (each one's mtime, the store's
shared LRU clock, then set by the lookup).

Each way runs `--reps` times over `--keys` keys of 4 KiB chunks, the ways
rotated every rep; the figure is the median. A lookup is CPU work and a few
syscalls per key, so its cost is measured in the calling thread's CPU time
(time.thread_time) as well as wall time. Where the store has
ChunkStore.lookup (a batch in one call), the batched ways use it; otherwise
they loop over contains()/pin() as LMCache's entry points did before, so the
same command measures a build before and after.

    sudo .venv/bin/python scripts/lookup_probe.py --label after --json docs/lookup-probe.json

XFS on a RAM-backed loop device when root (--path to use a directory
instead). The JSON keeps earlier labels and records the command and commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from contextlib import ExitStack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache_fx import _fxio as fx  # noqa: E402
from lmcache_fx.core.chunkfile import ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing import loopfs  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

SIZE = 4096


def prefix(store, keys, pin: bool) -> int:
    """How many leading keys are there (pinned with `pin`), as LMCache's
    batched_contains asks."""
    if hasattr(store, "lookup"):
        return sum(store.lookup(keys, pin=pin, prefix=True))
    n = 0
    for k in keys:
        if not (store.pin(k) if pin else store.contains(k)):
            break
        n += 1
    return n


def unpin_all(store, keys) -> None:
    for k in keys:
        while store.unpin(k):
            pass


def timed(fn, *args) -> tuple[float, float, object]:
    """(wall s, this thread's CPU s, result) of fn(*args)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    r = fn(*args)
    return time.perf_counter() - t0, time.thread_time() - c0, r


def run(path: str, nkeys: int, reps: int) -> dict:
    opts = FxOptions.from_mapping({"path": path, "max_capacity_gb": 10})
    keys = [f"lookup@{0:08x}@0@{i:08x}" for i in range(nkeys)]
    absent = [f"absent@{0:08x}@0@{i:08x}" for i in range(nkeys)]
    meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
    src = fx.HostBuffer(SIZE * nkeys)
    memoryview(src)[:] = os.urandom(len(src))
    store = ChunkStore(opts)
    try:
        for s in range(0, nkeys, 256):
            got = store.write([(keys[i], src.address + i * SIZE, SIZE, meta) for i in range(s, min(nkeys, s + 256))])
            assert all(got), "store write failed"
        ways = {
            "prefix, indexed hits": lambda: prefix(store, keys, False) == nkeys,
            "prefix pinned, indexed hits": lambda: prefix(store, keys, True) == nkeys,
            # As on a server that has run a while: hits older than TOUCH_SECONDS, each one's mtime (the
            # shared LRU clock) set by the lookup. The entries are made stale before the timing.
            "prefix pinned, not touched lately": None,
            "one key at a time, indexed hits": lambda: all(store.contains(k) for k in keys),
            "one key at a time, misses": lambda: not any(store.contains(k) for k in absent),
            "prefix, not yet indexed": None,  # timed without opening the store, below
        }
        samples: dict[str, list] = {w: [] for w in ways}
        names = list(ways)
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for w in order:
                if w == "prefix pinned, not touched lately":
                    for e in list(store._index.values()):
                        e.touched = -1e9
                    wall, cpu, n = timed(prefix, store, keys, True)
                    ok = n == nkeys
                elif w == "prefix, not yet indexed":
                    s = ChunkStore(opts)
                    try:
                        wall, cpu, n = timed(prefix, s, keys, False)
                    finally:
                        s.close()
                    ok = n == nkeys
                else:
                    wall, cpu, ok = timed(ways[w])
                assert ok, f"{w}: wrong answer"
                samples[w].append((wall, cpu))
            unpin_all(store, keys)
        out = {}
        for w, xs in samples.items():
            out[w] = {
                "us_per_key_wall": round(statistics.median(x[0] for x in xs) / nkeys * 1e6, 3),
                "us_per_key_cpu": round(statistics.median(x[1] for x in xs) / nkeys * 1e6, 3),
            }
        return out
    finally:
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", help="a directory to use instead of an XFS loop filesystem")
    ap.add_argument("--keys", type=int, default=512)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--label", default="run")
    ap.add_argument("--json", help="add this run under --label to this JSON file")
    args = ap.parse_args()
    with ExitStack() as stack:
        if args.path:
            base = os.path.abspath(args.path)
            medium = "directory"
        else:
            why = loopfs.why_not_available()
            if why:
                print(f"lookup_probe: {why}; give --path", file=sys.stderr)
                return 2
            base = stack.enter_context(loopfs.xfs_loop("1G", touch=True))
            medium = "XFS on a RAM-backed loop device"
        path = os.path.join(base, "lookup-probe")
        os.makedirs(path, exist_ok=True)
        res = run(path, args.keys, args.reps)
    batched = hasattr(ChunkStore, "lookup")
    for w, r in res.items():
        print(f"{args.label}: {w:34s} {r['us_per_key_cpu']:7.2f} µs CPU/key  {r['us_per_key_wall']:7.2f} µs wall/key")
    if args.json:
        doc = {}
        if os.path.exists(args.json):
            with open(args.json) as f:
                doc = json.load(f)
        doc.setdefault("runs", {})[args.label] = {
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "git_commit": git_commit(ROOT, ["lmcache_fx", "csrc"]),
            "medium": medium,
            "keys": args.keys,
            "reps": args.reps,
            "batched_lookup": batched,
            "ways": res,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json} [{args.label}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
