#!/usr/bin/env python3
"""The limit of the bench's XFS loop medium, as fio sees it at many settings
(root). One 1 GiB file on a fresh image made as the bench makes it
(testing.loopfs.xfs_loop(touch=True): 2 MiB pages), written once; then fio
(io_uring, O_DIRECT, cold: page cache dropped before each run) reads it at
every point of a grid of block size, queue depth and jobs (each job its own
share of the file), with fio's buffers in plain memory and in huge pages
(iomem=shmhuge: on this loop device a request from 4 KiB-page buffers is
capped in size, shared/notes/io-and-disk.md). Each point's figure is the
median of --reps; the JSON keeps every rep. The bench compares fx with the
best peer; this says how far the best of fio gets on the same medium.

    .venv/bin/python scripts/medium_limit_probe.py --json docs/medium-limit-probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx.testing.loopfs import drop_caches, image_pages, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20
FILE = 1 << 30
HUGE_PAGES = "/proc/sys/vm/nr_hugepages"


def fio_gbps(path: str, bs: int, qd: int, jobs: int, iomem: str) -> float:
    share = FILE // jobs
    cmd = [
        "fio", "--name=limit", f"--filename={path}", "--rw=read", "--direct=1", "--ioengine=io_uring",
        f"--bs={bs}", f"--iodepth={qd}", f"--numjobs={jobs}", f"--size={share}", f"--offset_increment={share}",
        f"--iomem={iomem}", "--group_reporting", "--output-format=json", "--invalidate=1",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{") :])["jobs"][0]["read"]["bw_bytes"] / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bs", default="1M,4M,16M")
    ap.add_argument("--qd", default="4,16,32")
    ap.add_argument("--jobs", default="1,2,4")
    ap.add_argument("--json")
    a = ap.parse_args()
    sizes = [int(x[:-1]) * MIB for x in a.bs.split(",")]
    qds = [int(x) for x in a.qd.split(",")]
    jobs = [int(x) for x in a.jobs.split(",")]
    with open(HUGE_PAGES) as f:
        huge0 = int(f.read())
    need = max(sizes) * max(qds) * max(jobs) // (2 * MIB) + 64  # fio's buffers for the largest point
    points: dict = {}
    try:
        with open(HUGE_PAGES, "w") as f:
            f.write(f"{huge0 + need}\n")
        with xfs_loop("3G", touch=True) as mnt:
            pages = image_pages(mnt)
            path = os.path.join(mnt, "limit.bin")
            subprocess.run(
                ["fio", "--name=fill", f"--filename={path}", "--rw=write", "--direct=1", "--bs=4M", f"--size={FILE}"],
                capture_output=True,
                check=True,
            )
            grid = list(itertools.product(("malloc", "shmhuge"), sizes, qds, jobs))
            for rep in range(a.reps):
                k = rep * 7 % len(grid)  # a different order every rep
                for iomem, bs, qd, nj in grid[k:] + grid[:k]:
                    drop_caches()
                    key = f"{iomem} bs={bs // MIB}M qd={qd} jobs={nj}"
                    points.setdefault(key, []).append(round(fio_gbps(path, bs, qd, nj, iomem), 3))
    finally:
        with open(HUGE_PAGES, "w") as f:
            f.write(f"{huge0}\n")
    res = {k: {"gbps": round(statistics.median(v), 3), "gbps_each": v} for k, v in points.items()}
    for k, v in sorted(res.items(), key=lambda kv: -kv[1]["gbps"])[:10]:
        print(f"{k:34s} {v['gbps']:.2f} GB/s", flush=True)
    best = max(res, key=lambda k: res[k]["gbps"])
    doc = {
        "command": "python scripts/medium_limit_probe.py"
        + f" --reps {a.reps} --bs {a.bs} --qd {a.qd} --jobs {a.jobs}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": "XFS on a 3 GiB RAM-backed loop device, made as the bench makes it; one 1 GiB file; cold",
        "loop_image": pages,
        "fio": subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip(),
        "points": res,
        "best": {"point": best, "gbps": res[best]["gbps"]},
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
