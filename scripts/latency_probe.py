"""Latency under concurrency: N threads each read one chunk-sized op, over and over, on one Engine.

Real files on XFS on a RAM-backed loop device (lmcache_fx.testing.loopfs, root), O_DIRECT, page
cache dropped before each case. Each thread owns one chunk file and a 2 MiB-aligned buffer and calls
``engine.read([(fd, 0, chunk, addr)])`` in a loop for ``--seconds``; the engine cuts the op into
``split_bytes`` pieces. Per engine and per in-flight count: p50/p99 of the request latencies and the
aggregate GB/s. Rounds interleave the engines; the figures reported are medians over rounds.

Beside fx's engine (``io_uring``, ``threads``), ``pread`` reads each request with one blocking preadv on
its thread, as fs_native's workers do: the medium's own spread of latencies under the same load. A
``+crc`` suffix takes the CRC32C as well (fx's engine per piece as it lands, as its verified reads do;
``pread+crc`` of the whole request after it).

With ``--bursts``, each round also releases bursts from idle: as many requests as the largest in-flight
count, started together, one per thread, each read once (a batch of prompts after a pause); and the same
with every other request a short one (``--short-mib``), to see whether a short read waits behind long ones.
Per burst: the mean, p50 and slowest request (the short and the long ones apart).

    python scripts/latency_probe.py --label after --out docs/latency-probe.json

The JSON keeps earlier labels (e.g. "before") and records the command and ``git rev-parse HEAD``.
Timings belong here, never in tests.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.testing import loopfs  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import rank_at  # noqa: E402

MIB = 1 << 20
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


class PreadReader:
    """The medium's floor beside the engine, read as Engine.read is: one
    blocking O_DIRECT preadv of the whole request on the calling thread (the
    GIL released), as fs_native's workers read; with crc, then the CRC32C of
    what was read, the least any reader that checks its data must add."""

    def read(self, ops, crc: bool = False) -> list:
        out = []
        for fd, off, length, addr in ops:
            got = os.preadv(fd, [_view(addr, length)], off)
            out.append((got, _fxio.crc32c_at(addr, got)) if crc else got)
        return out

    def close(self) -> None:
        pass


def _view(addr: int, length: int) -> memoryview:
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def make_reader(name: str, queue_depth: int, split_bytes: int):
    """An engine by its --engines name: io_uring or threads (fx's engine;
    with +crc each piece's CRC32C is taken as it lands, as fx's verified
    reads do), pread or pread+crc (PreadReader)."""
    base, _, extra = name.partition("+")
    if extra not in ("", "crc"):
        raise SystemExit(f"--engines: unknown '{name}'; use io_uring, threads or pread, each with or without +crc")
    if base == "pread":
        return PreadReader()
    return _fxio.Engine(base, queue_depth=queue_depth, split_bytes=split_bytes)


def _case(engine, fds, bufs, chunk: int, seconds: float, crc: bool = False) -> dict:
    lat: list[list[float]] = [[] for _ in fds]
    start = threading.Barrier(len(fds) + 1)
    stop = 0.0  # set just before the barrier releases the threads
    errors: list[str] = []

    def worker(i: int) -> None:
        op = [(fds[i], 0, chunk, bufs[i].address)]
        start.wait()
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            r = engine.read(op, crc=crc)
            lat[i].append(time.perf_counter() - t0)
            if crc:
                r = [x[0] for x in r]
            if r[0] != chunk:
                errors.append(f"thread {i}: {r[0]}")
                return

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(fds))]
    for t in ts:
        t.start()
    loopfs.drop_caches()
    stop = time.monotonic() + seconds
    t0 = time.perf_counter()
    start.wait()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors))
    allv = [x for li in lat for x in li]
    n = len(allv)
    return {
        "requests": n,
        "p50_ms": round(rank_at(allv, 0.50) * 1e3, 2),
        "p99_ms": round(rank_at(allv, 0.99) * 1e3, 2),
        "max_ms": round(max(allv) * 1e3, 2),
        "gbps": round(n * chunk / wall / 1e9, 3),
    }


def _burst(engine, fds, bufs, sizes: list[int]) -> dict:
    """One burst: a thread per request, released together, each reading
    sizes[i] bytes of its file once; every request's latency in ms."""
    lat = [0.0] * len(fds)
    start = threading.Barrier(len(fds) + 1)
    errors: list[str] = []

    def worker(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        r = engine.read([(fds[i], 0, sizes[i], bufs[i].address)])
        lat[i] = time.perf_counter() - t0
        if r[0] != sizes[i]:
            errors.append(f"thread {i}: {r[0]}")

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(fds))]
    for t in ts:
        t.start()
    loopfs.drop_caches()
    start.wait()
    for t in ts:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))

    def figures(xs: list[float]) -> dict:
        return {
            "mean_ms": round(statistics.mean(xs) * 1e3, 2),
            "p50_ms": round(statistics.median(xs) * 1e3, 2),
            "max_ms": round(max(xs) * 1e3, 2),
        }

    out = {"ms": [round(x * 1e3, 2) for x in lat], **figures(lat)}
    if len(set(sizes)) > 1:
        out["short"] = figures([x for x, n in zip(lat, sizes) if n < max(sizes)])
        out["long"] = figures([x for x, n in zip(lat, sizes) if n == max(sizes)])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inflight", default="1,4,16", help="threads (requests in flight), comma list")
    ap.add_argument(
        "--engines",
        default="io_uring,threads",
        help="comma list of io_uring, threads (fx's engine), pread (plain blocking preads); +crc: take the CRC32C",
    )
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--split-mib", type=int, default=1)
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0, help="per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bursts", action="store_true", help="also bursts from idle, equal and mixed sizes")
    ap.add_argument("--short-mib", type=int, default=2, help="the short requests of a mixed burst")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default="docs/latency-probe.json")
    a = ap.parse_args()

    why = loopfs.why_not_available()
    if why:
        print(f"needs XFS on a loop device: {why}", file=sys.stderr)
        return 2
    inflight = [int(x) for x in a.inflight.split(",")]
    engines = a.engines.split(",")
    chunk = a.chunk_mib * MIB
    nfiles = max(inflight)
    size = f"{(nfiles * a.chunk_mib + 256) // 1024 + 1}G"
    commit = git_commit(ROOT, ("csrc",)) or ""
    head, dirty = commit.removesuffix("+dirty"), commit.endswith("+dirty")
    raw: dict[str, dict[int, list[dict]]] = {e: {n: [] for n in inflight} for e in engines}
    bursts: dict[str, dict[str, list[dict]]] = {e: {"equal": [], "mixed": []} for e in engines}
    equal = [chunk] * nfiles
    mixed = [chunk if i % 2 == 0 else a.short_mib * MIB for i in range(nfiles)]
    with loopfs.xfs_loop(size, touch=True) as mnt:
        fds, bufs = [], []
        pattern = os.urandom(MIB)
        for i in range(nfiles):
            p = os.path.join(mnt, f"chunk{i}")
            with open(p, "wb") as f:
                for _ in range(a.chunk_mib):
                    f.write(pattern)
            fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
            bufs.append(_fxio.HostBuffer(chunk))
        engs = {e: make_reader(e, a.queue_depth, a.split_mib * MIB) for e in engines}
        try:
            for rnd in range(a.rounds):
                for n in inflight:
                    for e in engines:
                        r = _case(engs[e], fds[:n], bufs[:n], chunk, a.seconds, crc=e.endswith("+crc"))
                        raw[e][n].append(r)
                        print(f"round {rnd} {e:8s} {n:2d} in flight: {r}", flush=True)
                if a.bursts:
                    for kind, sizes in (("equal", equal), ("mixed", mixed)):
                        for e in engines:
                            b = _burst(engs[e], fds, bufs, sizes)
                            bursts[e][kind].append(b)
                            print(f"round {rnd} {e:8s} {kind} burst of {nfiles}: {b}", flush=True)
        finally:
            for eng in engs.values():
                eng.close()
            for fd in fds:
                os.close(fd)

    summary: dict[str, dict[str, dict]] = {}
    for e in engines:
        summary[e] = {}
        for n in inflight:
            rs = raw[e][n]
            summary[e][str(n)] = {
                "p50_ms": round(statistics.median(r["p50_ms"] for r in rs), 2),
                "p99_ms": round(statistics.median(r["p99_ms"] for r in rs), 2),
                "p99_over_p50": round(statistics.median(r["p99_ms"] / r["p50_ms"] for r in rs), 2),
                "gbps": round(statistics.median(r["gbps"] for r in rs), 3),
            }
    burst_summary: dict[str, dict[str, dict]] = {}
    if a.bursts:
        for e in engines:
            burst_summary[e] = {}
            for kind in ("equal", "mixed"):
                bs = bursts[e][kind]
                med = {k: round(statistics.median(b[k] for b in bs), 2) for k in ("mean_ms", "p50_ms", "max_ms")}
                for part in ("short", "long"):
                    if all(part in b for b in bs):
                        med[part] = {
                            k: round(statistics.median(b[part][k] for b in bs), 2) for k in ("mean_ms", "max_ms")
                        }
                burst_summary[e][kind] = med
                print(f"{a.label}: {e:8s} {kind} burst of {nfiles} (medians over rounds): {med}")
    for e in engines:
        for n in inflight:
            s = summary[e][str(n)]
            print(
                f"{a.label}: {e:8s} {n:2d} in flight  p50 {s['p50_ms']:8.1f} ms  "
                f"p99 {s['p99_ms']:8.1f} ms  p99/p50 {s['p99_over_p50']:.2f}  {s['gbps']:.2f} GB/s"
            )

    doc: dict = {}
    if os.path.exists(a.out):
        with open(a.out) as f:
            doc = json.load(f)
    doc.setdefault("runs", {})[a.label] = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
        "commit": head,
        "csrc_modified_from_commit": dirty,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "chunk_mib": a.chunk_mib,
        "split_mib": a.split_mib,
        "queue_depth": a.queue_depth,
        "seconds_per_case": a.seconds,
        "rounds": a.rounds,
        "summary (medians over rounds)": summary,
        "rounds_raw": {e: {str(n): raw[e][n] for n in inflight} for e in engines},
    }
    if a.bursts:
        doc["runs"][a.label]["short_mib"] = a.short_mib
        doc["runs"][a.label]["bursts (medians over rounds)"] = burst_summary
        doc["runs"][a.label]["bursts_raw"] = bursts
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
