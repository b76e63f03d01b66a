#!/usr/bin/env python3
"""Staged reads against direct ones, in one process: Engine.read_chunks of
chunk files on a tmpfs (/dev/shm by default, warm), verification on, into one
huge-page destination, with two engines alike but for `staged` (True: pieces
read into a cache-sized buffer of the reading thread's and copied on with
their CRC32C in one pass; False: read into the destination, then summed).
The two alternate rep by rep, their order swapped every rep, so the host's
drift falls on both; each rep's pair gives a ratio.

    .venv/bin/python scripts/staged_probe.py --reps 15 --rounds 2 --json docs/staged-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lmcache_fx import _fxio as fx  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta, encode_header  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20


def probe(directory: str, chunk_mib: int, reps: int) -> dict:
    n = chunk_mib * MIB
    count = max(4, (480 * MIB) // n)
    root = tempfile.mkdtemp(prefix="fx-staged-", dir=directory)
    try:
        os.makedirs(os.path.join(root, "ab"))
        payload = random.Random(chunk_mib).randbytes(n)
        header = bytearray(HEADER_SIZE)
        encode_header(header, "k", ChunkMeta(((n,),), ("uint8",), "raw"), n, fx.crc32c(payload), 7)
        for i in range(count):
            with open(os.path.join(root, "ab", f"c{i}.fxkv"), "wb") as f:
                f.write(bytes(header) + payload)
        rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        engines = {s: fx.Engine("io_uring", queue_depth=32, staged=s) for s in (True, False)}
        span = -(-(n + HEADER_SIZE) // 4096) * 4096
        dest = fx.HostBuffer(count * span, hugepages=True)
        scratch = fx.HostBuffer(HEADER_SIZE * count, hugepages=False)
        chunks = [(rootfd, f"ab/c{i}.fxkv", dest.address + i * span, n) for i in range(count)]
        gbps: dict = {True: [], False: []}
        cpu: dict = {True: [], False: []}
        staged0 = fx.staged_pieces()
        for rep in range(reps):
            for staged in (True, False) if rep % 2 == 0 else (False, True):
                t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                res = engines[staged].read_chunks(chunks, scratch.address, verify=True, direct=True, lock=True)
                t, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                bad = [r for r in res if r[0] != fx.CHUNK_OK]
                if bad:
                    raise SystemExit(f"reads failed: {bad[:3]}")
                gbps[staged].append(round(count * n / t / 1e9, 3))
                used = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
                cpu[staged].append(round(used / (count * n / 1e9), 4))
        staged_pieces = fx.staged_pieces() - staged0
        for e in engines.values():
            e.close()
        os.close(rootfd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [a / b for a, b in zip(gbps[True], gbps[False])]
    return {
        "chunks": f"{count} x {chunk_mib} MiB",
        "staged_gbps": statistics.median(gbps[True]),
        "direct_gbps": statistics.median(gbps[False]),
        "staged_cpu_s_per_gb": statistics.median(cpu[True]),
        "direct_cpu_s_per_gb": statistics.median(cpu[False]),
        "pair_ratio_median": round(statistics.median(ratios), 3),
        "pair_ratio_min": round(min(ratios), 3),
        "pair_ratio_max": round(max(ratios), 3),
        "staged_pieces": staged_pieces,
        "staged_gbps_each": gbps[True],
        "direct_gbps_each": gbps[False],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm", help="a directory on a tmpfs (default /dev/shm)")
    ap.add_argument("--sizes", default="2,64", help="chunk sizes in MiB")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="each size this many times, fresh files each")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not fx.CRC32C_COPY_ONE_PASS:
        raise SystemExit("this CPU has no one-pass copy and sum (CRC32C_COPY_ONE_PASS): nothing is staged")
    rounds = []
    for r in range(a.rounds):
        for size in (int(s) for s in a.sizes.split(",")):
            p = probe(a.dir, size, a.reps)
            p["round"] = r + 1
            rounds.append(p)
            print(
                f"{p['chunks']}: staged {p['staged_gbps']:.2f} GB/s {p['staged_cpu_s_per_gb']:.3f} CPU s/GB | direct "
                f"{p['direct_gbps']:.2f} GB/s {p['direct_cpu_s_per_gb']:.3f} | pair ratio median "
                f"{p['pair_ratio_median']:.2f} ({p['pair_ratio_min']:.2f}-{p['pair_ratio_max']:.2f})",
                flush=True,
            )
    doc = {
        "command": f"python scripts/staged_probe.py --dir {a.dir} --sizes {a.sizes} --reps {a.reps} "
        f"--rounds {a.rounds}" + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "crc32c_impl": fx.CRC32C_IMPL,
        "medium": f"{a.dir}, warm, verify on, io_uring engine (memory reads run on its threads)",
        "rounds": rounds,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
