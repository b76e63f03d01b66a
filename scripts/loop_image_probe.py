#!/usr/bin/env python3
"""How a RAM-backed loop image is made, and what the first stores into its
XFS measure (root). Two ways, alternating round by round, each on a fresh
5 GiB image:

  fallocated after mkfs      what `lmcache-fx bench` did up to 604ffd9: mkfs.xfs
                             (which discards the device: the image's pages are
                             punched out), then fallocate over the image
                             (pages allocated, never written);
  written through, no discard  testing.loopfs.xfs_loop(touch=True): zeros
                             written over the image, then mkfs.xfs -K.

Each rep writes --chunks files of --chunk-mib MiB with one O_DIRECT write each
on 8 threads (open, write, close: what fs_native does), into a new directory,
then deletes them and drops the page cache. No lmcache-fx code on the timed
path: this is the medium. GB/s per rep, in order; per way the median over all reps, the slowest
three, and how many reps ran at under a third of that median.

    .venv/bin/python scripts/loop_image_probe.py --json docs/loop-image-probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx.testing.loopfs import drop_caches, image_of, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

OLD = "fallocated after mkfs"
NEW = "written through, no discard"


def fallocate_image(mnt: str) -> None:
    """The bench's old preparation: fallocate over the mounted device's image."""
    fd = os.open(image_of(mnt), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def store_rep(d: str, n: int, src: mmap.mmap) -> float:
    os.makedirs(d)
    nxt = iter(range(n))
    lock = threading.Lock()

    def writer() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            fd = os.open(os.path.join(d, str(i)), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                assert os.pwrite(fd, src, 0) == len(src)
            finally:
                os.close(fd)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gbps = n * len(src) / (time.perf_counter() - t) / 1e9
    for i in range(n):
        os.unlink(os.path.join(d, str(i)))
    drop_caches()
    return gbps


def one_round(mode: str, reps: int, n: int, src: mmap.mmap) -> dict:
    t = time.perf_counter()
    with xfs_loop("5G", touch=mode == NEW) as mnt:
        if mode == OLD:
            fallocate_image(mnt)
        prep = time.perf_counter() - t
        got = [store_rep(os.path.join(mnt, f"rep{r}"), n, src) for r in range(reps)]
    return {"mode": mode, "prepare_s": round(prep, 2), "store_gbps": [round(x, 2) for x in got]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each way")
    ap.add_argument("--reps", type=int, default=8, help="stores per image (XFS puts each new directory in its next AG)")
    ap.add_argument("--chunks", type=int, default=238)
    ap.add_argument("--chunk-mib", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    src = mmap.mmap(-1, a.chunk_mib << 20)
    src.write(os.urandom(len(src)))
    rounds = []
    for r in range(a.rounds):
        for mode in (OLD, NEW) if r % 2 == 0 else (NEW, OLD):
            rounds.append(one_round(mode, a.reps, a.chunks, src))
            print(f"{mode:28s} prepared in {rounds[-1]['prepare_s']:5.1f} s, stores GB/s {rounds[-1]['store_gbps']}")
    summary = {}
    for mode in (OLD, NEW):
        xs = [x for rd in rounds if rd["mode"] == mode for x in rd["store_gbps"]]
        summary[mode] = {
            "median_gbps": statistics.median(xs),
            "slowest_gbps": sorted(xs)[:3],
            "reps_under_a_third_of_the_median": sum(x < statistics.median(xs) / 3 for x in xs),
            "reps": len(xs),
        }
    print(json.dumps(summary, indent=1))
    doc = {
        "command": "python scripts/loop_image_probe.py"
        + "".join(f" --{k} {v}" for k, v in (("rounds", a.rounds), ("reps", a.reps), ("chunks", a.chunks)))
        + f" --chunk-mib {a.chunk_mib}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "XFS on a 5 GiB RAM-backed loop device; O_DIRECT stores, one write per file, 8 threads",
        "rounds": rounds,
        "summary": summary,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
