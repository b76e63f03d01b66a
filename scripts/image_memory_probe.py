#!/usr/bin/env python3
"""Why a RAM-backed loop image reads faster in some places than in others
(root). No loop device and no filesystem: a 3 GiB image file is written
through, as testing.loopfs.touch_image writes the bench's images, and each
64 MiB of it is read with plain buffered preads (the copy the loop driver
makes for every request), positions rotated every rep. Beside each
position's speed, from /proc/self/pagemap of a mapping of the file, the
share of its 4 KiB pages that lie right after the page before them in
physical memory ("in runs"). Three images:

  shm          a fresh file in /dev/shm, 4 KiB pages (the bench's image
               until d737ccf);
  shm, sponge  the same after a 768 MiB file was written first and removed
               after the image, so the image got the pages allocated later;
  huge         a file on a tmpfs of its own mounted huge=always (the bench's
               image since d737ccf).

    .venv/bin/python scripts/image_memory_probe.py --json docs/image-memory-probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.testing.loopfs import _compact_memory, tmpfs, touch_image  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20
PAGE = 4096
CHUNK = 64 * MIB
SIZE = 3 << 30
SPONGE = 768 * MIB
OFFSETS_MIB = list(range(0, SIZE // MIB, 128))
_libc = ctypes.CDLL(None, use_errno=True)


def in_runs(path: str) -> np.ndarray:
    """Per 4 KiB page of the file: whether it lies right after the page
    before it in physical memory (from pagemap; root for the frame numbers)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
        a = np.frombuffer(m, dtype=np.uint8)
        int(a[::PAGE].sum())  # map every page
        va = a.__array_interface__["data"][0]
        with open("/proc/self/pagemap", "rb") as pm:
            pm.seek(va // PAGE * 8)
            e = np.frombuffer(pm.read(SIZE // PAGE * 8), dtype=np.uint64)
        del a
        m.close()
    finally:
        os.close(fd)
    pfn = (e & np.uint64((1 << 55) - 1)).astype(np.int64)
    if not pfn.any():
        raise SystemExit("pagemap gave no frame numbers: run as root")
    return np.concatenate([[False], np.diff(pfn) == 1])


def speeds(path: str, dst, reps: int) -> dict:
    fd = os.open(path, os.O_RDONLY)
    got: dict = {o: [] for o in OFFSETS_MIB}
    try:
        for rep in range(reps):
            k = rep * 5 % len(OFFSETS_MIB)
            for o in OFFSETS_MIB[k:] + OFFSETS_MIB[:k]:
                t0 = time.perf_counter()
                if (
                    _libc.pread(fd, ctypes.c_void_p(dst.address), ctypes.c_size_t(CHUNK), ctypes.c_long(o * MIB))
                    != CHUNK
                ):
                    raise OSError(ctypes.get_errno(), f"short read at {o} MiB")
                got[o].append(CHUNK / (time.perf_counter() - t0) / 1e9)
    finally:
        os.close(fd)
    return got


def image(directory: str, dst, reps: int, sponge: bool) -> dict:
    img = os.path.join(directory, "image")
    sp = os.path.join(directory, "sponge")
    try:
        if sponge:
            with open(sp, "wb") as f:
                f.truncate(SPONGE)
            touch_image(sp, SPONGE)
        with open(img, "wb") as f:
            f.truncate(SIZE)
        touch_image(img, SIZE)
        if sponge:
            os.unlink(sp)
        runs = in_runs(img)
        got = speeds(img, dst, reps)
    finally:
        for p in (img, sp):
            if os.path.exists(p):
                os.unlink(p)
    return {
        str(o): {
            "gbps": round(statistics.median(v), 3),
            "gbps_each": [round(x, 3) for x in v],
            "pages_in_runs": round(float(runs[o * MIB // PAGE : (o * MIB + CHUNK) // PAGE].mean()), 3),
        }
        for o, v in got.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    dst = _fxio.HostBuffer(CHUNK, hugepages=True)
    memoryview(dst)[:] = bytes(CHUNK)
    images = {}
    for name, sponge in (("shm", False), ("shm, sponge", True)):
        d = tempfile.mkdtemp(prefix="lmcache-fx-mem-", dir="/dev/shm")
        try:
            images[name] = image(d, dst, a.reps, sponge)
        finally:
            os.rmdir(d)
    _compact_memory()
    with tmpfs(f"size={SIZE + 4 * MIB},huge=always") as d:
        images["huge"] = image(d, dst, a.reps, False)
    for name, pos in images.items():
        cells = " ".join(f"{o}M {v['gbps']:.1f}/{v['pages_in_runs']:.2f}" for o, v in pos.items())
        print(f"{name}: {cells}", flush=True)
    doc = {
        "command": "python scripts/image_memory_probe.py"
        + f" --reps {a.reps}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "what": "buffered 64 MiB preads of a 3 GiB tmpfs file written through (no loop device), GB/s per "
        "position (median of reps), and the share of that 64 MiB's 4 KiB pages that follow the page before "
        "them in physical memory (pagemap); in 2 MiB pages that share is 511/512 by construction",
        "images": images,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
