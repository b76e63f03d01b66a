#!/usr/bin/env python3
"""This tree's C engine against another build's, in one process: the same
chunk files on XFS on a RAM-backed loop device, cold (page cache dropped
before every read), read with Engine.read_chunks of each build's extension
(verification on, or off with --no-verify; O_DIRECT, locks, io_uring, one
registered huge-page destination), the two alternating rep by rep with
their order swapped every rep. Both extensions are loaded side by side
(each its own module object and C state), so the host's drift falls on both
and each rep's pair gives a ratio: whether a change of the read path moved
its speed or CPU, apart from the host's state between bench rounds. Root.

    git worktree add /work/old 1c5677d && (cd /work/old && python setup.py build_ext --inplace)
    .venv/bin/python scripts/build_ab_probe.py --other /work/old --reps 11 --json docs/build-ab-probe.json

--writes: the builds as writers instead. Every rep each build stores the
chunks afresh (this tree's ChunkStore on that build's engine, timed), and
this tree's engine then reads both builds' files, so a change of how files
are laid out on the medium shows in both its stores and the reads after
them; the JSON counts the extents of each build's chunk files (filefrag).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

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


def load_extension(tree: str, label: str):
    """The _fxio extension built in `tree`, as a module object of its own.
    Each under a name of its own (`fx_build_<label>._fxio`): loaded under the name
    this tree's copy was imported as, the first load after that import came
    back as that very module, so a run with --other-first compared this build
    with itself (docs/bench-repeats/build-ab-probe-1c5677d-other-first.json)."""
    found = glob.glob(os.path.join(tree, "lmcache_fx", "_fxio*.so"))
    if not found:
        raise SystemExit(f"no built lmcache_fx/_fxio*.so in {tree} (python setup.py build_ext --inplace there)")
    spec = importlib.util.spec_from_file_location(f"fx_build_{label}._fxio", found[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed_read(
    engine, chunks: list, scratch, verify: bool, nbytes: int, what: str, stage: bool = False
) -> tuple[float, float]:
    """One cold read_chunks of `chunks` (O_DIRECT, locks; checked payloads
    through the staging slots with `stage`): (GB/s, CPU s/GB)."""
    drop_caches()
    t0, c0 = time.perf_counter(), cpu_seconds()
    res = engine.read_chunks(chunks, scratch.address, verify=verify, direct=True, lock=True, stage=stage and verify)
    t, c = time.perf_counter() - t0, cpu_seconds() - c0
    bad = [r for r in res if r[0] != 0]
    if bad:
        raise SystemExit(f"{what}: reads failed: {bad[:3]}")
    return round(nbytes / t / 1e9, 3), round(c / (nbytes / 1e9), 4)


class Workload:
    """The probe's chunks of one size: their source, keys and meta, and one
    huge-page destination (faulted in before any timed read) with a header
    scratch for reading them back."""

    def __init__(self, chunk_mib: int):
        self.cb = cb = chunk_mib * MIB
        self.n = n = max(7, (448 * MIB) // cb)
        self.src = _fxio.HostBuffer(cb * n, hugepages=True)
        memoryview(self.src)[:] = os.urandom(MIB) * (cb * n // MIB)
        self.keys = [f"k{chunk_mib}-{i}" for i in range(n)]
        self.meta = ChunkMeta(((cb // 2,),), ("bfloat16",), "KV_2LTD")
        self.span = span = -(-(cb + HEADER_SIZE) // 4096) * 4096
        self.dst = _fxio.HostBuffer(n * span, hugepages=True)
        memoryview(self.dst)[:] = bytes(n * span)
        self.scratch = _fxio.HostBuffer(HEADER_SIZE * n, hugepages=False)

    def store(self, d: str, engine=None) -> tuple[list[str], float]:
        """Writes the chunks into a store at d (on `engine` if given): their
        files' paths and the seconds the write call took."""
        s = store_mod.ChunkStore(FxOptions(path=d, max_capacity_gb=1e6), engine=engine)
        try:
            t0 = time.perf_counter()
            ok = s.write([(k, self.src.address + i * self.cb, self.cb, self.meta) for i, k in enumerate(self.keys)])
            took = time.perf_counter() - t0
            if not all(ok):
                raise SystemExit("the store could not write the probe's chunks")
            return [s.path_for(chunk_digest(k)) for k in self.keys], took
        finally:
            s.close()

    def chunks(self, rootfd: int, d: str, paths: list[str]) -> list:
        """read_chunks' tuples for the files `paths` under d, opened as rootfd."""
        return [(rootfd, os.path.relpath(p, d), self.dst.address + i * self.span, self.cb) for i, p in enumerate(paths)]


def pair_ratio(v: dict, a: str, o: str) -> dict:
    """Median, min and max of each rep's a over o."""
    r = [x / y for x, y in zip(v[a], v[o])]
    return {"median": round(statistics.median(r), 3), "min": round(min(r), 3), "max": round(max(r), 3)}


def probe(mnt: str, builds: dict, chunk_mib: int, reps: int, verify: bool = True, stage: bool = False) -> dict:
    w = Workload(chunk_mib)
    n, cb, span, dst, scratch = w.n, w.cb, w.span, w.dst, w.scratch
    d = os.path.join(mnt, f"c{chunk_mib}")
    paths, _ = w.store(d)
    rootfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    chunks = w.chunks(rootfd, d, paths)
    engines = {}
    gbps: dict = {b: [] for b in builds}
    cpu: dict = {b: [] for b in builds}
    try:
        for b, mod in builds.items():
            engines[b] = mod.Engine("io_uring", 32, MIB)
            engines[b].register_buffer(dst.address, n * span)
        order = list(builds)
        for rep in range(reps):
            for b in order if rep % 2 == 0 else order[::-1]:
                g, c = timed_read(engines[b], chunks, scratch, verify, n * cb, b, stage)
                gbps[b].append(g)
                cpu[b].append(c)
    finally:
        for e in engines.values():
            e.close()
        os.close(rootfd)
    a, o = order
    return {
        "chunks": f"{n} x {chunk_mib} MiB",
        "gbps": {b: statistics.median(v) for b, v in gbps.items()},
        "cpu_s_per_gb": {b: statistics.median(v) for b, v in cpu.items()},
        "read_pair_ratio": pair_ratio(gbps, a, o),
        "cpu_pair_ratio_median": pair_ratio(cpu, a, o)["median"],
        "gbps_each": gbps,
        "cpu_s_per_gb_each": cpu,
    }


def _extents(paths: list[str]) -> float | None:
    """Median extents per file, as filefrag counts them (None without it)."""
    try:
        out = subprocess.run(["filefrag", *paths], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    counts = [int(m.group(1)) for m in re.finditer(r": (\d+) extents? found", out)]
    return statistics.median(counts) if counts else None


def probe_writes(mnt: str, builds: dict, chunk_mib: int, reps: int, verify: bool = True, stage: bool = False) -> dict:
    """Each build stores the chunks afresh every rep; this tree's engine
    reads each build's files after. Pairs as in probe()."""
    w = Workload(chunk_mib)
    n, cb, span, dst, scratch = w.n, w.cb, w.span, w.dst, w.scratch
    reader = _fxio.Engine("io_uring", 32, MIB)
    reader.register_buffer(dst.address, n * span)
    stored: dict = {b: [] for b in builds}
    gbps: dict = {b: [] for b in builds}
    cpu: dict = {b: [] for b in builds}
    extents: dict = {}
    order = list(builds)
    try:
        for rep in range(reps):
            now = order if rep % 2 == 0 else order[::-1]
            names = {}
            for b in now:
                d = os.path.join(mnt, f"w{chunk_mib}-{b}")
                shutil.rmtree(d, ignore_errors=True)
                eng = builds[b].Engine("io_uring", 32, MIB)
                try:
                    names[b], took = w.store(d, eng)
                finally:
                    eng.close()
                stored[b].append(round(n * cb / took / 1e9, 3))
                if rep == 0:
                    extents[b] = _extents(names[b])
            for b in now:
                d = os.path.join(mnt, f"w{chunk_mib}-{b}")
                rootfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    g, c = timed_read(
                        reader, w.chunks(rootfd, d, names[b]), scratch, verify, n * cb, f"{b}'s files", stage
                    )
                finally:
                    os.close(rootfd)
                gbps[b].append(g)
                cpu[b].append(c)
    finally:
        reader.close()
        for b in builds:  # room for the next size
            shutil.rmtree(os.path.join(mnt, f"w{chunk_mib}-{b}"), ignore_errors=True)
    a, o = order
    return {
        "chunks": f"{n} x {chunk_mib} MiB",
        "extents_per_file": extents,
        "store_gbps": {b: statistics.median(v) for b, v in stored.items()},
        "store_pair_ratio": pair_ratio(stored, a, o),
        "gbps": {b: statistics.median(v) for b, v in gbps.items()},
        "cpu_s_per_gb": {b: statistics.median(v) for b, v in cpu.items()},
        "read_pair_ratio": pair_ratio(gbps, a, o),
        "cpu_pair_ratio_median": pair_ratio(cpu, a, o)["median"],
        "store_gbps_each": stored,
        "gbps_each": gbps,
        "cpu_s_per_gb_each": cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="a tree with another build of the extension (built in place)")
    ap.add_argument("--sizes", default="64,10,2", help="chunk sizes in MiB")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument(
        "--other-first",
        action="store_true",
        help="load the other build's extension first (the load order is kept in the JSON; run both ways)",
    )
    ap.add_argument(
        "--no-verify",
        action="store_true",
        help="read without the CRC32C check (O_DIRECT pieces of at least 16 MiB then, as the engine reads unchecked)",
    )
    ap.add_argument("--writes", action="store_true", help="the builds as writers, this tree's engine reading (above)")
    ap.add_argument("--stage", action="store_true", help="checked reads through the staging slots (staged_reads)")
    ap.add_argument("--json")
    a = ap.parse_args()
    here, other = git_commit(ROOT), git_commit(a.other)
    # Each rep's pair ratio is this build's figure over the other's, whichever was loaded first.
    loaded = [("other", a.other), ("this", ROOT)] if a.other_first else [("this", ROOT), ("other", a.other)]
    mods = {name: load_extension(tree, name) for name, tree in loaded}
    if os.path.realpath(mods["this"].__file__) == os.path.realpath(mods["other"].__file__):
        raise SystemExit("both builds loaded from one file: nothing to compare")
    builds = {"this": mods["this"], "other": mods["other"]}
    cases = []
    with xfs_loop("3G", touch=True) as mnt:
        for size in (int(x) for x in a.sizes.split(",")):
            c = (probe_writes if a.writes else probe)(mnt, builds, size, a.reps, verify=not a.no_verify, stage=a.stage)
            cases.append(c)
            if a.writes:
                print(
                    f"{c['chunks']}: extents per file this {c['extents_per_file'].get('this')} other "
                    f"{c['extents_per_file'].get('other')}; stores this {c['store_gbps']['this']:.2f} other "
                    f"{c['store_gbps']['other']:.2f} GB/s, pairs median {c['store_pair_ratio']['median']:.3f} "
                    f"({c['store_pair_ratio']['min']:.2f}-{c['store_pair_ratio']['max']:.2f})",
                    flush=True,
                )
            print(
                f"{c['chunks']}: this {c['gbps']['this']:.2f} GB/s {c['cpu_s_per_gb']['this']:.4f} CPU s/GB | other "
                f"{c['gbps']['other']:.2f} GB/s {c['cpu_s_per_gb']['other']:.4f} | read pairs median "
                f"{c['read_pair_ratio']['median']:.3f} ({c['read_pair_ratio']['min']:.2f}-"
                f"{c['read_pair_ratio']['max']:.2f}), CPU pairs median {c['cpu_pair_ratio_median']:.3f}",
                flush=True,
            )
    doc = {
        "command": "python scripts/build_ab_probe.py --other <tree at the other commit>"
        + (" --other-first" if a.other_first else "")
        + f" --sizes {a.sizes} --reps {a.reps}"
        + (" --no-verify" if a.no_verify else "")
        + (" --writes" if a.writes else "")
        + (" --stage" if a.stage else "")
        + (f" --json {a.json}" if a.json else ""),
        "this_commit": here,
        "other_commit": other,
        "loaded_first": loaded[0][0],
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "medium": ("the builds write, this tree's engine reads; " if a.writes else "")
        + "XFS on a 3 GiB RAM-backed loop device, cold; "
        + (
            "verify off, O_DIRECT, io_uring, QD 32, pieces of at least 16 MiB"
            if a.no_verify
            else "verify on, O_DIRECT, io_uring, QD 32, 1 MiB pieces" + (", staged" if a.stage else "")
        ),
        "cases": cases,
    }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
