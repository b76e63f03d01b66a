#!/usr/bin/env python3
"""How fast a RAM-backed loop device reads at each position (root). On a
fresh image (testing.loopfs.xfs_loop(touch=True), as the bench makes it):

  positions  64 MiB O_DIRECT preads of the loop device itself at offsets
             across the image, page cache dropped before each, the offsets
             rotated every rep: the medium's speed where a file lands;
  layouts    the same 64 MiB payloads written as files (O_DIRECT, blocks
             allocated first) in one directory and in a directory per file,
             each set read with the same whole-file preads on 4 threads:
             where XFS puts each set (allocation group and offset of each
             file's first block), and what that costs one reader.

No lmcache-fx code on the timed path: this is the medium. Readers whose
files land in different places are compared across that difference.

--image-pages 4k,huge makes each image twice: in /dev/shm's 4 KiB pages
(the bench's medium until the image went to 2 MiB pages) and on a
huge=always tmpfs of its own (xfs_loop's default for touched images now).

    .venv/bin/python scripts/loop_position_probe.py --images 2 --image-pages 4k,huge \
        --json docs/loop-position-probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, image_pages, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20
CHUNK = 64 * MIB
OFFSETS_MIB = [0, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 2560]
_libc = ctypes.CDLL(None, use_errno=True)


def _pread(fd: int, addr: int, n: int, off: int) -> None:
    got = _libc.pread(fd, ctypes.c_void_p(addr), ctypes.c_size_t(n), ctypes.c_long(off))
    if got != n:
        raise OSError(ctypes.get_errno(), f"pread of {n} bytes at {off}: {got}")


def write_direct(path: str, src, n: int) -> None:
    """A new file of the first n bytes at src (a HostBuffer), its blocks
    allocated first and the bytes written in one O_DIRECT write."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, n)
        if _libc.pwrite(fd, ctypes.c_void_p(src.address), ctypes.c_size_t(n), ctypes.c_long(0)) != n:
            raise OSError(ctypes.get_errno(), f"short write of {path}")
    finally:
        os.close(fd)


def _device(mnt: str) -> str:
    return subprocess.run(["findmnt", "-n", "-o", "SOURCE", mnt], capture_output=True, text=True).stdout.strip()


def _first_block(path: str) -> dict:
    """Allocation group and device offset (MiB) of the file's first extent."""
    out = subprocess.run(["xfs_bmap", "-v", path], capture_output=True, text=True).stdout
    m = re.search(r"^\s+0: \[\d+\.\.\d+\]:\s+(\d+)\.\.\d+\s+(\d+) ", out, re.M)
    return {"ag": int(m.group(2)), "offset_mib": int(m.group(1)) * 512 // MIB} if m else {}


def positions(mnt: str, dst, reps: int) -> dict:
    fd = os.open(_device(mnt), os.O_RDONLY | os.O_DIRECT)
    got: dict = {o: [] for o in OFFSETS_MIB}
    try:
        for rep in range(reps):
            k = rep % len(OFFSETS_MIB)
            for o in OFFSETS_MIB[k:] + OFFSETS_MIB[:k]:
                drop_caches()
                t0 = time.perf_counter()
                _pread(fd, dst.address, CHUNK, o * MIB)
                got[o].append(CHUNK / (time.perf_counter() - t0) / 1e9)
    finally:
        os.close(fd)
    return {
        str(o): {"gbps": round(statistics.median(v), 3), "gbps_each": [round(x, 3) for x in v]} for o, v in got.items()
    }


def layouts(mnt: str, src, dst, n: int, reps: int) -> dict:
    sets = {}
    for name, per_dir in (("one directory", False), ("a directory per file", True)):
        base = os.path.join(mnt, "per-dir" if per_dir else "one-dir")
        os.makedirs(base)
        paths = []
        for i in range(n):
            d = os.path.join(base, f"{i:02x}") if per_dir else base
            os.makedirs(d, exist_ok=True)
            p = os.path.join(d, f"c{i}")
            write_direct(p, src, CHUNK)
            paths.append(p)
        sets[name] = paths

    def read_all(paths: list[str]) -> None:
        def one(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
            try:
                _pread(fd, dst.address + i * CHUNK, CHUNK, 0)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(4) as ex:
            list(ex.map(one, range(len(paths))))

    got: dict = {s: [] for s in sets}
    names = list(sets)
    for rep in range(reps):
        for s in names if rep % 2 == 0 else names[::-1]:
            drop_caches()
            t0 = time.perf_counter()
            read_all(sets[s])
            got[s].append(n * CHUNK / (time.perf_counter() - t0) / 1e9)
    a, b = names
    return {
        "chunks": f"{n} x 64 MiB",
        "sets": {
            s: {
                "written": i + 1,
                "first_blocks": [_first_block(p) for p in sets[s]],
                "gbps": round(statistics.median(got[s]), 3),
                "gbps_each": [round(x, 3) for x in got[s]],
            }
            for i, s in enumerate(names)
        },
        # each rep's pair: the set written second over the one written first
        "second_over_first": round(statistics.median(y / x for x, y in zip(got[a], got[b])), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=3, help="fresh images, one after another")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--image-pages", default="4k,huge", help="4k (/dev/shm), huge (a huge=always tmpfs), or both")
    ap.add_argument("--json")
    a = ap.parse_args()
    kinds = [k.strip() for k in a.image_pages.split(",")]
    if not kinds or any(k not in ("4k", "huge") for k in kinds):
        ap.error(f"--image-pages {a.image_pages!r}: give 4k, huge or 4k,huge")
    src = _fxio.HostBuffer(CHUNK, hugepages=True)
    memoryview(src)[:] = os.urandom(CHUNK)
    n = 7
    dst = _fxio.HostBuffer(n * CHUNK, hugepages=True)
    memoryview(dst)[:] = bytes(n * CHUNK)  # faulted in before any timed read
    images = []
    for i, kind in [(i, k) for i in range(a.images) for k in kinds]:
        with xfs_loop("3G", touch=True, huge=kind == "huge") as mnt:
            im = {"pages": "2 MiB" if kind == "huge" else "4 KiB", "image_pages": image_pages(mnt)}
            im.update(positions=positions(mnt, dst, a.reps), layouts=layouts(mnt, src, dst, n, a.reps))
        images.append(im)
        pos = im["positions"]
        print(f"image {i + 1}, {im['pages']} pages: " + " ".join(f"{o}M {v['gbps']:.2f}" for o, v in pos.items()))
        for s, v in im["layouts"]["sets"].items():
            where = ", ".join(f"AG {b.get('ag')} @{b.get('offset_mib')}M" for b in v["first_blocks"][:3])
            print(f"  {s}: {v['gbps']:.2f} GB/s (first files at {where})", flush=True)
        print(f"  second set over first: {im['layouts']['second_over_first']:.3f}", flush=True)
    doc = {
        "command": "python scripts/loop_position_probe.py"
        + f" --images {a.images} --reps {a.reps} --image-pages {a.image_pages}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "XFS on a 3 GiB RAM-backed loop image (each image's pages: its `pages`), written through "
        "before mkfs; cold",
        "images": images,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
