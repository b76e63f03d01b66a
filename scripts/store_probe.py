#!/usr/bin/env python3
"""Store-level probes behind docs/benchmarks.md's analysis (root: XFS on a
RAM-backed loop device, cold reads), no LMCache in the way:

  reads:  ChunkStore.read of 7 x 64 MiB chunks into one huge-page registered
          buffer, verify on / off, 1 MiB and 16 MiB pieces, QD 32 and 128,
          against whole-file O_DIRECT preads of the same files on 8 Python
          threads (what fs_native does in C++), with and without a CRC32C of
          each chunk after its read (the price of fx's check on any reader),
          and beside a thread that only computes CRC32Cs, over a buffer in its
          cache or streamed from memory (what the check's memory traffic, not
          its CPU, costs a medium whose "device" is a memcpy), interleaved,
          medians, with the busy CPUs of the whole host;
  stores: ChunkStore.write of 238 x 2 MiB, each stage of the write timed
          (temporaries, reservation, payload + header + LRU clock as one call
          on O_DIRECT, commit), per chunk.

    .venv/bin/python scripts/store_probe.py --json docs/store-probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
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
from lmcache_fx.tools.bench.workload import cpu_seconds, host_ticks  # noqa: E402

MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def _threads_read(paths, dst: int, span: int, nthreads: int, crc: bool = False) -> None:
    """One whole-file O_DIRECT pread per file on nthreads threads; with
    `crc`, each thread then takes the CRC32C of the payload it read (fx's
    check, the GIL released), as fs_native would if it verified."""

    def one(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
        try:
            n = _libc.pread(fd, ctypes.c_void_p(dst + i * span), ctypes.c_size_t(span), ctypes.c_long(0))
            assert n == span, n
        finally:
            os.close(fd)
        if crc:
            _fxio.crc32c_at(dst + i * span + HEADER_SIZE, span - HEADER_SIZE)

    with ThreadPoolExecutor(nthreads) as ex:
        list(ex.map(one, range(len(paths))))


class _CrcBeside:
    """A thread computing CRC32Cs over `span` bytes of `buf` until stopped
    (the GIL released in each call)."""

    def __init__(self, buf, span: int):
        import threading

        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(buf.address, span))
        self.t.start()

    def _run(self, addr: int, span: int) -> None:
        while not self.stop.is_set():
            _fxio.crc32c_at(addr, span)

    def close(self) -> None:
        self.stop.set()
        self.t.join()


def reads(mnt: str, reps: int) -> dict:
    cb, n = 64 * MIB, 7
    src = _fxio.HostBuffer(cb * n, hugepages=True)
    memoryview(src)[:] = os.urandom(cb * n)
    meta = ChunkMeta(((cb // 2,),), ("bfloat16",), "KV_2LTD")
    d = os.path.join(mnt, "reads")
    s = store_mod.ChunkStore(FxOptions(path=d, max_capacity_gb=1e6))
    keys = [f"r{i}" for i in range(n)]
    assert all(s.write([(k, src.address + i * cb, cb, meta) for i, k in enumerate(keys)]))
    paths = [s.path_for(chunk_digest(k)) for k in keys]
    s.close()
    span = cb + HEADER_SIZE
    dst = _fxio.HostBuffer(n * span, hugepages=True)
    beside = _fxio.HostBuffer(256 * MIB, hugepages=True)
    memoryview(beside)[:] = os.urandom(MIB) * 256
    modes = {
        "fx verify on, 1 MiB pieces, QD 32": (True, MIB, 32),
        "fx verify on, 1 MiB pieces, QD 128": (True, MIB, 128),
        "fx verify on, 16 MiB pieces, QD 16": (True, 16 * MIB, 16),
        "fx verify off, 1 MiB pieces, QD 32": (False, MIB, 32),
        "fx verify off, 1 MiB pieces, QD 128": (False, MIB, 128),
        "fx verify off, 16 MiB pieces, QD 16": (False, 16 * MIB, 16),
        "whole-file O_DIRECT pread, 8 threads": None,
        "whole-file O_DIRECT pread, 8 threads, then CRC32C of each": "crc",
        "whole-file O_DIRECT pread, 8 threads, beside CRC32Cs of 1 MiB in cache": MIB,
        "whole-file O_DIRECT pread, 8 threads, beside CRC32Cs of 256 MiB from memory": 256 * MIB,
    }
    raw: dict = {m: [] for m in modes}
    base = "whole-file O_DIRECT pread, 8 threads"
    for rep in range(reps):
        order = list(modes.items())
        k = rep % len(order)  # rotated each rep: the host's drift spreads over every mode
        for m, how in order[k:] + order[:k]:
            if how is None or how == "crc" or isinstance(how, int):
                drop_caches()
                crc_beside = _CrcBeside(beside, how) if isinstance(how, int) else None
                b0, c0, t0 = host_ticks(), cpu_seconds(), time.perf_counter()
                try:
                    _threads_read(paths, dst.address, span, 8, crc=how == "crc")
                finally:
                    dt = time.perf_counter() - t0
                    if crc_beside:
                        crc_beside.close()
            else:
                verify, split, qd = how
                eng = _fxio.Engine("io_uring", qd, split)
                eng.register_buffer(dst.address, n * span)
                st = store_mod.ChunkStore(
                    FxOptions(path=d, queue_depth=qd, split_bytes=split, verify=verify, max_capacity_gb=1e6),
                    engine=eng,
                )

                def alloc(_meta, slot=iter(range(2 * n))):
                    i = next(slot) % n
                    return i, dst.address + i * cb, cb

                st.read(keys, alloc, lambda h: None)  # learns the headers, as a running store has
                drop_caches()
                b0, c0, t0 = host_ticks(), cpu_seconds(), time.perf_counter()
                out = st.read(keys, alloc, lambda h: None)
                dt = time.perf_counter() - t0
                assert all(o is not None for o in out)
            c, b1 = cpu_seconds() - c0, host_ticks()
            if isinstance(how, tuple):
                st.close()
                eng.close()
            gb = n * cb / 1e9
            busy = os.cpu_count() * (1 - (b1[1] - b0[1]) / max(b1[0] - b0[0], 1))
            raw[m].append({"gbps": gb / dt, "cpu_s_per_gb": c / gb, "busy_cpus": busy})
    return {
        "chunks": f"{n} x 64 MiB",
        "reps": reps,
        "cold": True,
        "modes": {
            m: {
                "gbps": statistics.median(x["gbps"] for x in v),
                "cpu_s_per_gb": statistics.median(x["cpu_s_per_gb"] for x in v),
                "gbps_each": [round(x["gbps"], 3) for x in v],
                "busy_cpus": round(statistics.median(x["busy_cpus"] for x in v), 2),
                # Each rep's figure over the plain preads' in the same rep.
                "over_preads": round(statistics.median(x["gbps"] / b["gbps"] for x, b in zip(v, raw[base])), 3),
            }
            for m, v in raw.items()
        },
    }


def store_stages(mnt: str, reps: int) -> dict:
    cb, n = 2 * MIB, 238
    src = _fxio.HostBuffer(cb * n, hugepages=True)
    memoryview(src)[:] = os.urandom(cb * n)
    meta = ChunkMeta(((cb // 2,),), ("bfloat16",), "KV_2LTD")
    spent: dict = {}
    cls = store_mod.ChunkStore
    saved = {name: getattr(cls, name) for name in ("_create_tmp", "_reserve", "_commit")}

    def timed(name, f):
        @functools.wraps(f)
        def w(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

        return w

    for name, f in saved.items():
        setattr(cls, name, timed(name, f))
    try:
        s = cls(FxOptions(path=os.path.join(mnt, "stores"), max_capacity_gb=1e6))
        real = s.engine

        class Timed:  # the engine, its writes timed: payloads (crc=True) and headers apart, or together
            def __getattr__(self, a):
                return getattr(real, a)

            def write_chunks(self, chunks, direct=False):
                t0 = time.perf_counter()
                try:
                    return real.write_chunks(chunks, direct=direct)
                finally:
                    k = "write_chunks"
                    spent[k] = spent.get(k, 0.0) + time.perf_counter() - t0

            def write(self, ops, crc=False, split=0):
                t0 = time.perf_counter()
                try:
                    return real.write(ops, crc=crc, split=split)
                finally:
                    k = "payload write" if crc else "header write"
                    spent[k] = spent.get(k, 0.0) + time.perf_counter() - t0

        t = Timed()
        s.engine = s._wengine = s._wengine_for = t
        total = 0.0
        each = []
        for rep in range(-1, reps):  # rep -1 warms up: the first write into a fresh store allocates its inodes
            items = [(f"w{rep}-{i}", src.address + i * cb, cb, meta) for i in range(n)]
            if rep == 0:
                spent.clear()
            t0 = time.perf_counter()
            assert all(s.write(items))
            dt = time.perf_counter() - t0
            if rep >= 0:
                total += dt
                each.append(round(n * cb / 1e9 / dt, 3))
            for k, *_ in items:
                s.remove(k)
        s.engine = real
        s.close()
    finally:
        for name, f in saved.items():
            setattr(cls, name, f)
    per = reps * n
    names = {
        "_create_tmp": "create the temporary",
        "_reserve": "reserve (ledger, ftruncate)",
        "payload write": "payload write (O_DIRECT, CRC32C)",
        "header write": "header write",
        "write_chunks": "payload, CRC32C, header, LRU clock: one pipeline per chunk (Engine.write_chunks, O_DIRECT)",
        "_commit": "commit (trim, utime, rename, ledger)",
    }
    return {
        "chunks": f"{n} x 2 MiB",
        "reps": reps,
        "gbps": per * cb / 1e9 / total,
        "gbps_each": each,
        "warm_up": "one untimed write of as many chunks first",
        "us_per_chunk": {names[k]: spent[k] / per * 1e6 for k in names if k in spent},
        "us_per_chunk_total": total / per * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    with xfs_loop("3G", touch=True) as mnt:
        r = reads(mnt, args.reps)
        w = store_stages(mnt, args.reps)
    out = {
        "command": "python " + " ".join(["scripts/store_probe.py", *sys.argv[1:]]),
        "git_commit": git_commit(),  # "+dirty": uncommitted changes to tracked files
        "cpus": os.cpu_count(),
        "loadavg_end": list(os.getloadavg()),
        "medium": "XFS on a 3 GiB RAM-backed loop device",
        "reads": r,
        "stores": w,
    }
    for m, v in r["modes"].items():
        print(
            f"{m:76} {v['gbps']:6.2f} GB/s {v['over_preads']:6.3f}x  {v['cpu_s_per_gb']:.3f} CPU s/GB"
            f"  {v['busy_cpus']:.2f} CPUs busy"
        )
    print(f"stores {w['chunks']}: {w['gbps']:.2f} GB/s; µs per chunk:")
    for k, v in w["us_per_chunk"].items():
        print(f"  {k:40} {v:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
