#!/usr/bin/env python3
"""Where the plugin's 2 MiB tail comes from: the same stored chunks read with
N requests in flight, one layer added at a time (root: XFS on a RAM-backed
loop device, cold).

One fx tier is set up the way `lmcache-fx bench` sets it up (a real
LMCacheEngine, its CPU pool registered with fx's engine) and one workload is
stored through it. Then N threads read one chunk per request, over the stored
chunks in turn (the bench's latency case), in six ways, interleaved within
each round and the order rotated every round:

- ``engine``: fx's engine alone, each chunk file opened once beforehand, the
  whole file read with each piece's CRC32C taken as it lands, into one buffer
  per thread;
- ``store-fixed``: ChunkStore.read (open, header check, CRC32C, close, the
  index) into one object of LMCache's pool per thread, kept for every request;
- ``store-rotating``: the same into pool objects taken in turn from a set
  allocated beforehand (about 80 MiB of them, beyond this CPU's L3), with no
  allocator call per request;
- ``store-new``: the same into a new pool object per request, allocated and
  freed by LMCache's allocator as the plugin does;
- ``plugin``: the plugin's batched_get_blocking([key]), what the bench times;
- ``plugin-reserve``: the same with the plugin's one-object allocations served
  from pool objects taken ahead, RESERVE_BATCH at a time, by one call of
  LMCache's batched_allocate (an experiment here, not what the plugin does):
  LMCache's allocator leaves the request path, its release stays.

Per mode and count in flight: p50 and p99 of each round, and their medians
over the rounds (p99/p50 taken within each round); the CPU time a request
took on its requesting thread (thread_time: fx's engine call, Python, the
allocator), the mean of each round and its median over the rounds. With
--gil, also where the requests near the p50 and the slowest 1 % spent their
time: in fx's engine, waiting for the GIL after it
(_fxio.last_read_chunks_ns), and the rest.
Timings belong here, never in tests.

    python scripts/latency_layers_probe.py --rounds 15 --json docs/bench-repeats/latency-layers/<commit>-run1.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from contextlib import ExitStack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.integration.common import allocate_from, allocate_many_from  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, why_not_available, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.run import READER_CLASSES  # noqa: E402
from lmcache_fx.tools.bench.workload import BenchConfig, Workload, latency_requests, rank_at  # noqa: E402
from lmcache_fx.tools.models import GB, PRESETS  # noqa: E402

MODES = ("engine", "store-fixed", "store-rotating", "store-new", "plugin", "plugin-reserve")
DEFAULT_MODES = MODES[:5]  # plugin-reserve only when asked for (--modes)
ROTATING_BYTES = 80 << 20  # the set store-rotating cycles through: more than the 32 MiB L3 here
RESERVE_BATCH = 8  # pool objects plugin-reserve takes per batched_allocate


class Reserve:
    """plugin-reserve's allocator: pool objects of one meta taken ahead in
    batches, handed out one per allocation; a thread that finds it empty
    while another refills it allocates the plugin's way."""

    def __init__(self, backend, meta):
        self.backend, self.meta = backend, meta
        self.objs: list = []
        self.lock = threading.Lock()
        self.counts = {"from_reserve": 0, "batches": 0, "one_by_one": 0}  # how the allocations were served

    def allocate(self, meta, busy_loop: bool = True):
        if meta == self.meta:
            try:
                got = self.objs.pop()
                # unlocked: a count lost to a thread switch would leave the counts below the
                # requests in the JSON, which tests/test_bench.py checks of the committed runs
                self.counts["from_reserve"] += 1
                return got
            except IndexError:
                pass
            if self.lock.acquire(blocking=False):
                try:
                    many = allocate_many_from(self.backend.local_cpu_backend, meta, RESERVE_BATCH)
                    if many:
                        self.counts["batches"] += 1
                        self.objs.extend(many[1:])
                        return many[0]
                finally:
                    self.lock.release()
        self.counts["one_by_one"] += 1
        return allocate_from(self.backend.local_cpu_backend, meta, busy_loop)

    def release(self) -> None:
        while self.objs:
            self.objs.pop()[0].ref_count_down()


class Layers:
    """The tier, its stored chunks, and one read of a chunk per mode."""

    def __init__(self, reader, keys, chunk_bytes: int):
        self.chunk_bytes = chunk_bytes
        self.backend = reader.backend
        self.store = self.backend.store
        self.keys = keys
        self.names = [k.to_string() for k in keys]
        self.paths = [self.store._entry(n).path for n in self.names]
        size = os.path.getsize(self.paths[0])
        self.file_bytes = size
        self.read_bytes = (size + 4095) // 4096 * 4096
        metas: list = []
        self.store.read(self.names[:1], lambda m: metas.append(m), lambda h: None)  # the meta, nothing read
        self.meta = metas[0]
        self.fds: list[int] = []
        self.buffers: list = []

    def allocate(self):
        got = self.backend._allocate(self.meta)
        if got is None:
            raise RuntimeError("LMCache's pool gave no object")
        return got

    def prepare(self, mode: str, conc: int) -> list:
        """Per-thread state: a buffer, a kept object, or a share of the rotating set."""
        if mode == "engine":
            self.fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in self.paths]
            while len(self.buffers) < conc:  # kept across cases and faulted in now, outside any timing
                b = _fxio.HostBuffer(self.read_bytes)
                memoryview(b)[:] = bytes(len(b))
                self.buffers.append(b)
            return self.buffers[:conc]
        if mode == "store-fixed":
            return [[self.allocate()] for _ in range(conc)]
        if mode == "store-rotating":
            n = max(conc, ROTATING_BYTES // self.chunk_bytes)
            objs = [self.allocate() for _ in range(n)]
            return [objs[t::conc] for t in range(conc)]
        if mode == "plugin-reserve":
            self.reserve = Reserve(self.backend, self.meta)
            self.backend._allocate = self.reserve.allocate  # this instance only; release() takes it away
        return [None] * conc

    def release(self, mode: str, state: list) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if mode == "plugin-reserve":
            del self.backend._allocate  # the class's method again
            self.reserve.release()
        if mode in ("store-fixed", "store-rotating"):
            for objs in state:
                for o in objs:
                    o[0].ref_count_down()

    def read(self, mode: str, state, i: int, n: int) -> bool:
        k = i % len(self.keys)
        if mode == "engine":
            got = self.store.engine.read([(self.fds[k], 0, self.read_bytes, state.address)], crc=True)
            return got[0][0] >= self.file_bytes
        if mode in ("plugin", "plugin-reserve"):
            objs = self.backend.batched_get_blocking([self.keys[k]])
            for o in objs:
                if o is not None:
                    o.ref_count_down()
            return objs[0] is not None
        if mode == "store-new":
            out = self.store.read([self.names[k]], self.backend._allocate, self.backend._release)
            if out[0] is not None:
                out[0].ref_count_down()
            return out[0] is not None
        dst = state[n % len(state)]
        out = self.store.read([self.names[k]], lambda m: dst, lambda h: None)
        return out[0] is not None


def _split(lat: list[float], parts: list[tuple[int, int]], p50: float, p99: float) -> dict:
    """Where the requests near the p50 (within 10 %) and the slowest 1 %
    (at or above the p99) spent their time, means in ms: in fx's engine (the
    read_chunks call), waiting for the GIL after it, and the rest (Python
    and the GIL waits elsewhere)."""
    out = {}
    for name, pick in (("near_p50", lambda x: abs(x - p50) <= 0.1 * p50), ("top_1pct", lambda x: x >= p99)):
        sel = [(x, e, g) for x, (e, g) in zip(lat, parts) if pick(x)]
        out[name] = {
            "requests": len(sel),
            "engine_ms": statistics.mean(e for _, e, _ in sel) / 1e6,
            "gil_wait_ms": statistics.mean(g for _, _, g in sel) / 1e6,
            "rest_ms": statistics.mean(x * 1e3 - (e + g) / 1e6 for x, e, g in sel),
        }
    return out


def _case(layers: Layers, mode: str, conc: int, gil: bool = False) -> dict:
    n_req = latency_requests(len(layers.keys), conc)
    nxt = iter(range(n_req))
    lock = threading.Lock()
    lat: list[float] = []
    cpus: list[float] = []  # the requesting thread's CPU time of each request
    parts: list[tuple[int, int]] = []  # with gil: (engine ns, GIL wait ns) of each request's read_chunks
    errors: list[str] = []
    state = layers.prepare(mode, conc)
    drop_caches()

    def worker(t: int) -> None:
        done = 0
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            c0, t0 = time.thread_time(), time.perf_counter()
            ok = layers.read(mode, state[t], i, done)
            dt = time.perf_counter() - t0
            cpu = time.thread_time() - c0
            part = _fxio.last_read_chunks_ns() if gil else (0, 0)
            done += 1
            with lock:
                lat.append(dt)
                cpus.append(cpu)
                parts.append(part)
                if not ok:
                    errors.append(f"request {i} missed")

    try:
        ths = [threading.Thread(target=worker, args=(t,)) for t in range(conc)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    finally:
        layers.release(mode, state)
    if errors:
        raise RuntimeError(f"{mode}: {errors[:3]}")
    p50, p99 = rank_at(lat, 0.5), rank_at(lat, 0.99)
    out = {
        "requests": len(lat),
        "p50_ms": p50 * 1e3,
        "p99_ms": p99 * 1e3,
        "thread_cpu_us_per_request": statistics.mean(cpus) * 1e6,
    }
    if mode == "plugin-reserve":
        out["allocations"] = dict(layers.reserve.counts)
    if gil:
        out["split"] = _split(lat, parts, p50, p99)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.2-1b-tp4")
    ap.add_argument("--total-gb", type=float, default=0.5)
    ap.add_argument("--inflight", default="4,16")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--gil",
        action="store_true",
        help="also split each request's time: fx's engine (read_chunks), the wait for the GIL after it, the rest "
        "(not for the engine mode, which calls Engine.read)",
    )
    ap.add_argument(
        "--switch-ms",
        default="",
        help="Python's GIL switch interval(s) in ms (sys.setswitchinterval; default: the process's, 5 ms); "
        "with several, every mode runs at each, interleaved, as 'MODE @N ms'",
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    why = why_not_available()
    if why:
        print(f"skipped: {why}")
        return 0
    modes = a.modes.split(",")
    if a.gil and "engine" in modes:
        raise SystemExit("--gil: leave out the engine mode (it makes no read_chunks call to split)")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown '{m}'; use any of {', '.join(MODES)}")
    concs = [int(x) for x in a.inflight.split(",")]
    switch = [float(x) for x in a.switch_ms.split(",") if x.strip()]
    # (label, mode, switch interval in s or None): one label per mode and interval
    cases = [
        (m if len(switch) < 2 else f"{m} @{ms:g} ms", m, ms / 1000 if switch else None)
        for m in modes
        for ms in (switch or [0])
    ]
    labels = [c[0] for c in cases]
    default_switch = sys.getswitchinterval()
    geo = PRESETS[a.preset]
    n = max(1, int(a.total_gb * GB) // geo.chunk_bytes)
    raw: dict = {label: {str(c): [] for c in concs} for label in labels}
    with xfs_loop("5G", touch=True) as mnt, ExitStack() as stack:
        cfg = BenchConfig(path=mnt, geo=geo, n_chunks=n, reps=1)
        w = Workload(geo, n)
        r = READER_CLASSES["fx"](cfg, w)
        r.open(stack)
        tokens = w.tokens(0)
        keys = r.keys(tokens)
        r.engine.store(tokens, kvcaches=w.src, slot_mapping=w.slot_mapping)
        r.wait_stored(keys)
        layers = Layers(r, keys, geo.chunk_bytes)
        for rnd in range(a.rounds):
            order = cases[rnd % len(cases) :] + cases[: rnd % len(cases)]
            for c in concs:
                for label, m, sw in order:
                    sys.setswitchinterval(sw if sw is not None else default_switch)
                    try:
                        raw[label][str(c)].append(_case(layers, m, c, a.gil))
                    finally:
                        sys.setswitchinterval(default_switch)
            print(f"round {rnd + 1}/{a.rounds} done", flush=True)
    summary: dict = {}
    for m in labels:
        summary[m] = {}
        for c in concs:
            rs = raw[m][str(c)]
            each = [x["p99_ms"] / x["p50_ms"] for x in rs]
            s = summary[m][str(c)] = {
                "p99_over_p50": statistics.median(each),
                "p99_over_p50_min": min(each),
                "p99_over_p50_max": max(each),
                "p50_ms": statistics.median(x["p50_ms"] for x in rs),
                "p99_ms": statistics.median(x["p99_ms"] for x in rs),
                "thread_cpu_us_per_request": statistics.median(x["thread_cpu_us_per_request"] for x in rs),
            }
            if a.gil:
                s["split"] = {
                    w: {
                        k: statistics.median(x["split"][w][k] for x in rs)
                        for k in ("engine_ms", "gil_wait_ms", "rest_ms")
                    }
                    for w in ("near_p50", "top_1pct")
                }
            print(
                f"{m:24s} {c:2d} in flight: p99/p50 {s['p99_over_p50']:.2f} ({min(each):.2f}–{max(each):.2f})  "
                f"p50 {s['p50_ms']:.2f} ms  p99 {s['p99_ms']:.2f} ms  "
                f"CPU of the requesting thread {s['thread_cpu_us_per_request']:.0f} µs a request"
            )
            for w, v in s.get("split", {}).items():
                print(
                    f"{'':27s}{w:9s} engine {v['engine_ms']:.2f} ms, GIL wait after it {v['gil_wait_ms']:.2f} ms, "
                    f"rest {v['rest_ms']:.2f} ms"
                )
    if a.json:
        doc = {
            "command": "python scripts/latency_layers_probe.py " + " ".join(sys.argv[1:]),
            "git_commit": git_commit(),
            "medium": "XFS on a RAM-backed loop device (/dev/shm image written through), page cache dropped per case",
            "workload": {"preset": a.preset, "chunks": n, "chunk_bytes": geo.chunk_bytes},
            "rounds": a.rounds,
            "switch_interval_ms": switch or [default_switch * 1000],
            "statistic": "per round p50 and p99 of the requests (nearest rank); medians over rounds, "
            "p99/p50 taken within each round",
            "host": {"cpus": os.cpu_count(), "loadavg_at_end": list(os.getloadavg())},
            "summary (medians over rounds)": summary,
            "rounds_raw": raw,
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
