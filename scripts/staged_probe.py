#!/usr/bin/env python3
"""Two ways of reading from memory, in one process: Engine.read_chunks of
chunk files on a tmpfs (warm), verification on, into one huge-page
destination, alternating rep by rep with their order rotated every rep, so
the host's drift falls on both; each rep's pair gives a ratio. Beside them
in every rep: LMCache's fs_native (8 workers, as the bench runs it) reading
its own files of the same payloads into the same destination, and the
one-pass copy and sum alone, memory to memory, the same bytes on every CPU
(the limit of any reader that moves them from memory on this host).

--compare staged (on /dev/shm by default): two engines alike but for
`staged` (True: pieces read into a cache-sized buffer of the reading
thread's and copied on with their CRC32C in one pass; False: read into the
destination, then summed).

--compare mapped (on a tmpfs mounted huge=within_size, which the probe
mounts itself when run as root and no --dir is given): one engine, files
copied from a mapping with their CRC32C in one pass (`mapped=True`) against
read as without it (`mapped=False`: staged reads).

    .venv/bin/python scripts/staged_probe.py --reps 15 --rounds 2 --json docs/staged-probe.json
    .venv/bin/python scripts/staged_probe.py --compare mapped --reps 15 --rounds 3 --json docs/mapped-probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # chunk_overhead's fs_native client

from chunk_overhead import FsNative  # noqa: E402

from lmcache_fx import _fxio as fx  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta, encode_header  # noqa: E402
from lmcache_fx.testing.loopfs import tmpfs  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

MIB = 1 << 20


# The two sides of each comparison: (name of the first, name of the second).
SIDES = {"staged": ("staged", "direct"), "mapped": ("mapped", "unmapped")}


@contextlib.contextmanager
def huge_page_tmpfs():
    """A 2 GiB tmpfs mounted huge=within_size for the run (root)."""
    try:
        with tmpfs("size=2g,huge=within_size") as mnt:
            yield mnt
    except RuntimeError as e:
        raise SystemExit(f"{e}: give --dir") from None


def probe(directory: str, chunk_mib: int, reps: int, compare: str = "staged") -> dict:
    n = chunk_mib * MIB
    count = max(4, (480 * MIB) // n)
    root = tempfile.mkdtemp(prefix="fx-staged-", dir=directory)
    pool = ThreadPoolExecutor(os.cpu_count() or 1)
    fs_native = None
    try:
        os.makedirs(os.path.join(root, "ab"))
        payload = random.Random(chunk_mib).randbytes(n)
        header = bytearray(HEADER_SIZE)
        encode_header(header, "k", ChunkMeta(((n,),), ("uint8",), "raw"), n, fx.crc32c(payload), 7)
        for i in range(count):
            with open(os.path.join(root, "ab", f"c{i}.fxkv"), "wb") as f:
                f.write(bytes(header) + payload)
        rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        # One engine per side (staged), or one for both (mapped: a read_chunks flag).
        if compare == "staged":
            engines = {s: fx.Engine("io_uring", queue_depth=32, staged=s) for s in (True, False)}
        else:
            one = fx.Engine("io_uring", queue_depth=32)
            engines = {True: one, False: one}
        span = -(-(n + HEADER_SIZE) // 4096) * 4096
        dest = fx.HostBuffer(count * span, hugepages=True)
        scratch = fx.HostBuffer(HEADER_SIZE * count, hugepages=False)
        chunks = [(rootfd, f"ab/c{i}.fxkv", dest.address + i * span, n) for i in range(count)]

        # LMCache's fs_native (8 workers, as the bench runs it): its own files
        # of the same payloads on the same tmpfs, read into the same destination.
        views = [memoryview(dest)[i * span : i * span + n] for i in range(count)]
        keys = [f"probe@{0:08x}@0@{n:x}{i:08x}" for i in range(count)]
        for v in views:
            v[:] = payload
        fs_native = FsNative(os.path.join(root, "fs_native"), 8)
        if not all(fs_native.set(keys, views)):
            raise SystemExit("fs_native could not store the probe's chunks")
        # The limit of any reader from memory here: the one-pass copy and sum
        # alone, memory to memory, the same bytes on every CPU (GIL released).
        src = fx.HostBuffer(count * span, hugepages=True)
        memoryview(src)[:] = os.urandom(MIB) * (count * span // MIB) + os.urandom(count * span % MIB)

        def fx_read(first: bool) -> None:
            res = engines[first].read_chunks(
                chunks, scratch.address, verify=True, direct=True, lock=True, mapped=compare == "mapped" and first
            )
            bad = [r for r in res if r[0] != fx.CHUNK_OK]
            if bad:
                raise SystemExit(f"reads failed: {bad[:3]}")

        def fs_native_read() -> None:
            if not all(fs_native.get(keys, views)):
                raise SystemExit("fs_native missed a chunk")

        # count * n bytes in one share per CPU, one call each (a task per
        # chunk left a CPU idle at the end of 7 chunks on 2; a task per MiB
        # costs Python's overhead per task).
        share = -(-(count * n) // (os.cpu_count() or 1) // 4096) * 4096
        shares = [(o, min(share, count * n - o)) for o in range(0, count * n, share)]

        def copy_alone() -> None:
            list(pool.map(lambda p: fx.crc32c_copy(dest.address + p[0], src.address + p[0], p[1]), shares))

        steps = {True: lambda: fx_read(True), False: lambda: fx_read(False), "fs_native": fs_native_read}
        steps["copy"] = copy_alone
        for step in steps.values():  # untimed: the destination's pages faulted in, every path warm
            step()
        gbps: dict = {k: [] for k in steps}
        cpu: dict = {k: [] for k in steps}
        staged0, mapped0 = fx.staged_pieces(), fx.map_stats()[0]
        order = list(steps)
        for rep in range(reps):
            for k in order[rep % len(order) :] + order[: rep % len(order)]:  # rotated: drift falls on all
                t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
                steps[k]()
                t, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                gbps[k].append(round(count * n / t / 1e9, 3))
                used = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
                cpu[k].append(round(used / (count * n / 1e9), 4))
        staged_pieces = fx.staged_pieces() - staged0
        mapped_pieces = fx.map_stats()[0] - mapped0
        for e in set(engines.values()):
            e.close()
        os.close(rootfd)
    finally:
        if fs_native:
            fs_native.close()
        pool.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    def ratio(x, y) -> float:  # median over reps of x's figure over y's in the same rep
        return round(statistics.median(a / b for a, b in zip(gbps[x], gbps[y])), 3)

    a, b = SIDES[compare]
    pairs = [x / y for x, y in zip(gbps[True], gbps[False])]
    return {
        "chunks": f"{count} x {chunk_mib} MiB",
        f"{a}_gbps": statistics.median(gbps[True]),
        f"{b}_gbps": statistics.median(gbps[False]),
        "fs_native_gbps": statistics.median(gbps["fs_native"]),
        "copy_limit_gbps": statistics.median(gbps["copy"]),
        f"{a}_cpu_s_per_gb": statistics.median(cpu[True]),
        f"{b}_cpu_s_per_gb": statistics.median(cpu[False]),
        "fs_native_cpu_s_per_gb": statistics.median(cpu["fs_native"]),
        "pair_ratio_median": round(statistics.median(pairs), 3),
        "pair_ratio_min": round(min(pairs), 3),
        "pair_ratio_max": round(max(pairs), 3),
        f"{a}_over_fs_native": ratio(True, "fs_native"),
        f"{b}_over_fs_native": ratio(False, "fs_native"),
        f"{a}_over_copy_limit": ratio(True, "copy"),
        "fs_native_over_copy_limit": ratio("fs_native", "copy"),
        "staged_pieces": staged_pieces,
        "mapped_pieces": mapped_pieces,
        f"{a}_gbps_each": gbps[True],
        f"{b}_gbps_each": gbps[False],
        "fs_native_gbps_each": gbps["fs_native"],
        "copy_limit_gbps_each": gbps["copy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=sorted(SIDES), default="staged", help="what the two sides differ in")
    ap.add_argument(
        "--dir",
        help="a directory on a tmpfs (default: /dev/shm; with --compare mapped, a tmpfs mounted "
        "huge=within_size for the run, root only)",
    )
    ap.add_argument("--sizes", default="2,64", help="chunk sizes in MiB")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2, help="each size this many times, fresh files each")
    ap.add_argument("--json")
    a = ap.parse_args()
    if not fx.CRC32C_COPY_ONE_PASS:
        raise SystemExit("this CPU has no one-pass copy and sum (CRC32C_COPY_ONE_PASS): nothing to compare")
    first, second = SIDES[a.compare]
    with contextlib.ExitStack() as stack:
        directory = a.dir or (stack.enter_context(huge_page_tmpfs()) if a.compare == "mapped" else "/dev/shm")
        rounds = []
        for r in range(a.rounds):
            for size in (int(s) for s in a.sizes.split(",")):
                p = probe(directory, size, a.reps, a.compare)
                p["round"] = r + 1
                rounds.append(p)
                print(
                    f"{p['chunks']}: {first} {p[first + '_gbps']:.2f} GB/s {p[first + '_cpu_s_per_gb']:.3f} CPU s/GB"
                    f" | {second} {p[second + '_gbps']:.2f} GB/s {p[second + '_cpu_s_per_gb']:.3f} | pair ratio "
                    f"median {p['pair_ratio_median']:.2f} ({p['pair_ratio_min']:.2f}-{p['pair_ratio_max']:.2f})"
                    f" | fs_native {p['fs_native_gbps']:.2f} GB/s ({first} at {p[first + '_over_fs_native']:.2f}×)"
                    f" | copy alone {p['copy_limit_gbps']:.2f} GB/s ({first} at {p[first + '_over_copy_limit']:.2f}×,"
                    f" fs_native at {p['fs_native_over_copy_limit']:.2f}×)",
                    flush=True,
                )
    medium = a.dir or ("a tmpfs mounted huge=within_size" if a.compare == "mapped" else "/dev/shm")
    doc = {
        "command": "python scripts/staged_probe.py"
        + (f" --compare {a.compare}" if a.compare != "staged" else "")
        + (f" --dir {a.dir}" if a.dir else "")
        + f" --sizes {a.sizes} --reps {a.reps} --rounds {a.rounds}"
        + (f" --json {a.json}" if a.json else ""),
        "git_commit": git_commit(),
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "crc32c_impl": fx.CRC32C_IMPL,
        "compare": f"{first} against {second}",
        "medium": f"{medium}, warm, verify on, io_uring engine (memory reads run on its threads)",
        "rounds": rounds,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
