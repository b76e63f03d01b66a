#!/usr/bin/env python3
"""Stores into a full store (the steady state of a cache that has run a
while: every new chunk evicts an old one), with `reuse_evicted` on and off,
and on with another process holding the store open (a second TP rank, or an
instance sharing the path), side by side (interleaved reps, medians), at the
store level (ChunkStore.write, no LMCache in the way); then the files just
written read back by plain preads (8 threads, cold on XFS), to show what
reuse does to reads of any reader.
Root: XFS on a RAM-backed loop device (O_DIRECT), and tmpfs (/dev/shm, page
cache).

    .venv/bin/python scripts/full_store_probe.py --json docs/full-store-probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core import store as store_mod  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta, chunk_digest  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import cpu_seconds  # noqa: E402

MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
CASES = {"64 MiB": (64 * MIB, 4, 8), "2 MiB": (2 * MIB, 64, 128)}  # chunk, chunks per batch, capacity in chunks
ON, OFF, PEER = "reuse_evicted on", "reuse_evicted off", "reuse_evicted on, another process has the store open"


def _preads(paths: list[str], dst: int, cb: int) -> None:
    """Each file's payload by one pread on 8 threads (O_DIRECT where the
    filesystem takes it): what any reader of these files gets, fx's aside."""

    def one(i: int) -> None:
        try:
            fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = os.open(paths[i], os.O_RDONLY)
        try:
            n = _libc.pread(fd, ctypes.c_void_p(dst + i * cb), ctypes.c_size_t(cb), ctypes.c_long(HEADER_SIZE))
            assert n == cb, n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, range(len(paths))))


def probe(base: str, case: str, reps: int, cold: bool) -> dict:
    cb, batch, cap = CASES[case]
    src = _fxio.HostBuffer(cb * batch, hugepages=True)
    memoryview(src)[:] = os.urandom(cb * batch)
    meta = ChunkMeta(((cb // 2,),), ("bfloat16",), "KV_2LTD")
    cap_gb = (cap * (HEADER_SIZE + cb) + 4096) / (1 << 30)
    stores, dirs = {}, {}
    for variant in (ON, OFF, PEER):
        d = dirs[variant] = os.path.join(base, f"full-{case.replace(' ', '')}-{(ON, OFF, PEER).index(variant)}")
        s = store_mod.ChunkStore(FxOptions(path=d, max_capacity_gb=cap_gb, reuse_evicted=variant != OFF))
        for j in range(0, cap, batch):  # fill it
            assert all(s.write([(f"fill{j + i}", src.address + i * cb, cb, meta) for i in range(batch)]))
        stores[variant] = s
    # The other process: its own ChunkStore on the same path, open while the reps run.
    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from lmcache_fx.core.store import ChunkStore; from lmcache_fx.core.options import FxOptions; "
            f"s = ChunkStore(FxOptions(path={dirs[PEER]!r}, max_capacity_gb={cap_gb!r})); "
            "print('READY', flush=True); sys.stdin.read(); s.close()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert peer.stdout.readline().strip() == "READY"
    raw: dict = {v: [] for v in stores}
    dst = _fxio.HostBuffer(cb * batch, hugepages=True)
    for rep in range(reps):
        for variant, s in stores.items():
            items = [(f"r{rep}-{i}", src.address + i * cb, cb, meta) for i in range(batch)]
            before = s.stats.snapshot()
            c0, t0 = cpu_seconds(), time.perf_counter()
            assert all(s.write(items))
            dt, c = time.perf_counter() - t0, cpu_seconds() - c0
            after = s.stats.snapshot()
            gb = batch * cb / 1e9
            if cold:
                drop_caches()
            t0 = time.perf_counter()  # the files just written, read by plain preads (no fx reader)
            _preads([s.path_for(chunk_digest(k)) for k, *_ in items], dst.address, cb)
            read_s = time.perf_counter() - t0
            raw[variant].append(
                {
                    "gbps": gb / dt,
                    "cpu_s_per_gb": c / gb,
                    "evictions": after["evictions"] - before["evictions"],
                    "recycled": after["recycled"] - before["recycled"],
                    "read_gbps": gb / read_s,
                }
            )
    peer.communicate("", timeout=60)
    for variant, s in stores.items():  # what the last batch wrote reads back, bit-exact

        def alloc(_meta, slots=iter(range(batch))):
            i = next(slots)
            return i, dst.address + i * cb, cb

        got = s.read([f"r{reps - 1}-{i}" for i in range(batch)], alloc, lambda h: None)
        assert got == list(range(batch)) and bytes(memoryview(dst)) == bytes(memoryview(src)), (
            "a chunk did not read back"
        )
        s.close()
        shutil.rmtree(dirs[variant], ignore_errors=True)
    out: dict = {"chunks per batch": batch, "capacity (chunks)": cap, "reps": reps}
    for variant, v in raw.items():
        out[variant] = {
            "gbps": statistics.median(x["gbps"] for x in v),
            "cpu_s_per_gb": statistics.median(x["cpu_s_per_gb"] for x in v),
            "gbps_each": [round(x["gbps"], 3) for x in v],
            "evictions_per_batch": statistics.median(x["evictions"] for x in v),
            "recycled_per_batch": statistics.median(x["recycled"] for x in v),
            "read_gbps": statistics.median(x["read_gbps"] for x in v),
        }
    for label, a in (("on / off", ON), ("on with another process / off", PEER)):
        out[label] = out[a]["gbps"] / out[OFF]["gbps"]
        out[label + " per rep"] = [round(x["gbps"] / y["gbps"], 3) for x, y in zip(raw[a], raw[OFF])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    media: dict = {}
    with xfs_loop("3G", touch=True) as mnt:
        media["XFS on a 3 GiB RAM-backed loop device (O_DIRECT)"] = {c: probe(mnt, c, args.reps, True) for c in CASES}
    shm = "/dev/shm/lmcache-fx-full-store-probe"
    os.makedirs(shm, exist_ok=True)
    try:
        media["tmpfs (/dev/shm, page cache)"] = {c: probe(shm, c, args.reps, False) for c in CASES}
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    out = {
        "command": "python " + " ".join(["scripts/full_store_probe.py", *sys.argv[1:]]),
        "git_commit": git_commit(),  # "+dirty": uncommitted changes to tracked files
        "cpus": os.cpu_count(),
        "loadavg_end": list(os.getloadavg()),
        "media": media,
    }
    for m, cases in media.items():
        for c, r in cases.items():
            on, off, peer = r[ON], r[OFF], r[PEER]
            print(
                f"{m[:40]:40} {c:7} on {on['gbps']:.2f} GB/s ({on['cpu_s_per_gb']:.3f} CPU s/GB, "
                f"{on['recycled_per_batch']:.0f}/{on['evictions_per_batch']:.0f} reused)  "
                f"off {off['gbps']:.2f} GB/s ({off['cpu_s_per_gb']:.3f})  on/off {r['on / off']:.2f}  "
                f"with another process {peer['gbps']:.2f} GB/s ({peer['recycled_per_batch']:.0f} reused, "
                f"/off {r['on with another process / off']:.2f})  "
                f"preads after: on {on['read_gbps']:.2f} off {off['read_gbps']:.2f} GB/s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
