#!/usr/bin/env python3
"""Whether fx's 64 MiB reads trail fs_native's on the XFS loop because of the
reader or because of where the files lie (root). fx's store and fs_native
write the same 14 x 64 MiB payloads one chunk each in turn (so neither takes
all the first space), on a fresh image made as the bench makes it; then:

  sets   each reader over its own files (fx's store unchecked, fs_native with
         4 workers) and one reader over both (whole-file O_DIRECT preads of
         the payload on 4 threads), interleaved, order rotated every rep;
  files  every file alone (one 64 MiB O_DIRECT pread), order rotated, with
         the device offset of its first block (xfs_bmap): what each place
         on the medium reads at, whoever wrote the file.

    .venv/bin/python scripts/placement_probe.py --json docs/bench-repeats/placement/<commit>-run1.json
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # chunk_overhead's fs_native driver

from chunk_overhead import FsNative  # noqa: E402
from loop_position_probe import _first_block  # noqa: E402

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta, chunk_digest  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20
CB, N = 64 * MIB, 14
_libc = ctypes.CDLL(None, use_errno=True)


def _pread(path: str, addr: int, off: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = _libc.pread(fd, ctypes.c_void_p(addr), ctypes.c_size_t(CB), ctypes.c_long(off))
        if got != CB:
            raise OSError(ctypes.get_errno(), f"pread of {path}: {got}")
    finally:
        os.close(fd)


def run(mnt: str, reps: int) -> dict:
    src = _fxio.HostBuffer(CB * N, hugepages=True)
    memoryview(src)[:] = os.urandom(MIB) * (CB * N // MIB)
    dst = _fxio.HostBuffer(CB * N, hugepages=True)
    memoryview(dst)[:] = bytes(CB * N)
    views = [memoryview(src)[i * CB : (i + 1) * CB] for i in range(N)]
    dviews = [memoryview(dst)[i * CB : (i + 1) * CB] for i in range(N)]
    # fs_native wants LMCache's key wire format: model@rank@group@hash
    keys = [f"placement@{0:08x}@0@{CB:x}{i:08x}" for i in range(N)]
    fxdir = os.path.join(mnt, "fx")
    meta = ChunkMeta(((CB,),), ("uint8",), "raw")
    writer = ChunkStore(FxOptions(path=fxdir, max_capacity_gb=1e6))
    fsn = FsNative(os.path.join(mnt, "fs_native"), 4)
    eng = _fxio.Engine("io_uring", 32, MIB)
    eng.register_buffer(dst.address, CB * N)
    reader = ChunkStore(FxOptions(path=fxdir, verify=False, max_capacity_gb=1e6), engine=eng)
    try:
        for i in range(N):  # one chunk each in turn
            if not all(writer.write([(keys[i], src.address + i * CB, CB, meta)])):
                raise SystemExit("fx's store could not write")
            if not all(fsn.set([keys[i]], [views[i]])):
                raise SystemExit("fs_native could not write")
        fx_files = [writer.path_for(chunk_digest(k)) for k in keys]
        fs_files = sorted(
            p for p in glob.glob(os.path.join(mnt, "fs_native", "**"), recursive=True) if os.path.isfile(p)
        )
        if len(fs_files) != N:
            raise SystemExit(f"fs_native's files: {len(fs_files)}, not {N}")

        def fx_read() -> None:
            slot = iter(range(N))
            out = reader.read(keys, lambda m: (lambda i: (i, dst.address + i * CB, CB))(next(slot)), lambda h: None)
            if not all(o is not None for o in out):
                raise SystemExit("fx's store missed a chunk")

        def preads(files: list[str], off: int):
            def go() -> None:
                with ThreadPoolExecutor(4) as ex:
                    list(ex.map(lambda i: _pread(files[i], dst.address + i * CB, off), range(N)))

            return go

        def fs_read() -> None:
            if not all(fsn.get(keys, dviews)):
                raise SystemExit("fs_native missed a chunk")

        fx_read()  # the store's index learns the headers, as a running store has
        sets = {
            "fx's store, unchecked, its own files": fx_read,
            "fs_native (4 workers), its own files": fs_read,
            "preads of fx's files (4 threads)": preads(fx_files, HEADER_SIZE),
            "preads of fs_native's files (4 threads)": preads(fs_files, 0),
        }
        got: dict = {s: [] for s in sets}
        order = list(sets.items())
        for rep in range(reps):
            k = rep % len(order)
            for s, fn in order[k:] + order[:k]:
                drop_caches()
                t0 = time.perf_counter()
                fn()
                got[s].append(N * CB / (time.perf_counter() - t0) / 1e9)
        base = got["fs_native (4 workers), its own files"]
        files = [("fx", p, HEADER_SIZE) for p in fx_files] + [("fs_native", p, 0) for p in fs_files]
        one: dict = {p: [] for _, p, _ in files}
        for rep in range(reps):
            k = rep % len(files)
            for _, p, off in files[k:] + files[:k]:
                drop_caches()
                t0 = time.perf_counter()
                _pread(p, dst.address, off)
                one[p].append(CB / (time.perf_counter() - t0) / 1e9)
    finally:
        reader.close()
        eng.close()
        fsn.close()
        writer.close()
    return {
        "sets": {
            s: {
                "gbps": round(statistics.median(v), 3),
                "over_fs_native": round(statistics.median(a / b for a, b in zip(v, base)), 3),
                "gbps_each": [round(x, 3) for x in v],
            }
            for s, v in got.items()
        },
        "files": sorted(
            (
                {
                    "writer": w,
                    "offset_mib": _first_block(p).get("offset_mib"),
                    "gbps": round(statistics.median(one[p]), 3),
                }
                for w, p, _ in files
            ),
            key=lambda f: f["offset_mib"] if f["offset_mib"] is not None else -1,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args()
    with xfs_loop("3G", touch=True) as mnt:
        r = run(mnt, a.reps)
    for s, v in r["sets"].items():
        print(f"{s:42s} {v['gbps']:.2f} GB/s  over fs_native {v['over_fs_native']:.3f}", flush=True)
    print(" ".join(f"{f['writer']}@{f['offset_mib']}:{f['gbps']:.1f}" for f in r["files"]))
    doc = {
        "command": "python scripts/placement_probe.py" + f" --reps {a.reps}" + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "XFS on a 3 GiB RAM-backed loop image in /dev/shm, written through before mkfs; cold; O_DIRECT",
        **r,
    }
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
