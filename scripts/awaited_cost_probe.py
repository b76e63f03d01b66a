"""What an awaited load costs LMCache's event loop, fx beside LMCache's RustRawBlockBackend.

LMCache's async loading and its remote backends await every lookup and load on one event loop (the
storage manager's thread). With many requests in flight on a small host that thread's CPU per request
is what the requests queue behind, so this probe measures it where the bench's awaited latency case
measures only time.

- ``tiers``: real LMCacheEngines on CPU with fx's plugin and RustRawBlockBackend (the bench's readers; in
  ``--readers`` also ``fx-noverify``, fx without its CRC32C check, ``fx-unstaged``, ``fx-nice0`` and
  ``fx-paged-pool``, fx with LMCache's pool on its paged allocator), on XFS on a RAM-backed loop device (root),
  O_DIRECT. Per reader and in-flight count, ``--requests`` one-chunk requests sent as the bench's
  awaited latency case sends them (coroutines on that engine's own loop, each awaiting
  batched_async_contains(pin) then batched_get_non_blocking), every request a hit: the loop thread's CPU per
  request (its thread_time over the case), the process's, p50 and p99; since 5028bcf also the whole host's busy
  time per request (the loop device's kernel workers included), its busy share and its stolen share. Rounds interleave the readers.
- ``handoff``: on an event loop of its own, what any awaited read through fx's C engine pays before a
  byte moves: Engine.submit_chunks of an empty batch awaited through its own eventfd (drive.await_batch) and
  through the loop's shared one (a Notifier, as drive_async awaits the C engine's batches since 6635808), the
  same waited for blocking, and for scale a Python thread that wakes the loop with call_soon_threadsafe (a
  completion handed back the way pure-Python readers hand it). Loop CPU and wall per call.

Medians over rounds; each reader's ratios over RustRawBlock are taken within each round, then the median.

    python scripts/awaited_cost_probe.py --label before --out docs/awaited-cost-probe.json

The JSON keeps earlier labels and records the command and ``git rev-parse HEAD`` (``+dirty`` when csrc/
or lmcache_fx/ differ from it). Timings belong here, never in tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.drive import _loop_waiter, await_batch  # noqa: E402
from lmcache_fx.testing import loopfs  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench import readers as bench_readers  # noqa: E402
from lmcache_fx.tools.bench.workload import (  # noqa: E402
    BenchConfig,
    CpuSpan,
    Workload,
    named_threads_runq_wait_s,
    percentile,
    runq_wait_since,
)
from lmcache_fx.tools.models import PRESETS  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


class FxPagedPoolReader(bench_readers.FxReader):
    """fx with LMCache's CPU pool on its paged allocator (a slot per chunk:
    O(1) allocation and free) instead of its default first-fit one. LMCache
    0.5.6 picks the paged allocator for the pool only when its own raw-block
    backend is configured for io_uring (`rust_raw_block.io_engine`, read by
    LocalCPUBackend whatever the backends), so RustRawBlockBackend is measured
    with it and fx without; this reader sets that key to measure what the
    allocator's work on the loop costs fx. A diagnostic, not a configuration
    fx asks users for."""

    name = "fx-paged-pool"
    label = "lmcache-fx (io_uring, LMCache's paged pool)"

    def lmcache_config(self):
        d = super().lmcache_config()
        d["extra_config"]["rust_raw_block.io_engine"] = "io_uring"
        return d


READERS = {
    "fx": bench_readers.FxReader,
    "fx-noverify": bench_readers.FxNoVerifyReader,  # fx without its CRC32C check: what the check costs
    "fx-unstaged": bench_readers.FxUnstagedReader,  # checked in place, not through staging slots
    "fx-nice0": bench_readers.FxNice0Reader,  # runners at the loop's priority (runner_nice 0)
    "fx-paged-pool": FxPagedPoolReader,  # LMCache's pool on the paged allocator RustRawBlock's config gets
    "rust_raw_block": bench_readers.RustRawBlockReader,
}


def handoff_round(n: int) -> dict:
    """Loop CPU and wall per call (µs) of the three ways, on a loop of this round's own."""
    eng = _fxio.Engine("auto", 32, 1 << 20)
    scratch = _fxio.HostBuffer(1 << 16, hugepages=False)
    out: dict = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def awaited() -> None:
            await await_batch(eng.submit_chunks([], scratch.address), loop)

        waiter = _loop_waiter(eng, loop)

        async def awaited_shared() -> None:
            await waiter.wait(eng.submit_chunks([], scratch.address, notify=waiter.notifier), loop)

        async def waited() -> None:
            eng.submit_chunks([], scratch.address).wait()

        async def thread_wake() -> None:
            fut = loop.create_future()
            threading.Thread(target=loop.call_soon_threadsafe, args=(fut.set_result, None)).start()
            await fut

        ways = {
            "engine batch, awaited (eventfd)": awaited,
            "engine batch, awaited (the loop's shared eventfd)": awaited_shared,
            "engine batch, waited blocking": waited,
            "python thread, call_soon_threadsafe": thread_wake,
        }
        for name, way in ways.items():
            for _ in range(n // 10):  # warm: thread stacks, the engine's first batch
                await way()
            c, t = time.thread_time(), time.perf_counter()
            for _ in range(n):
                await way()
            out[name] = {
                "loop_cpu_us": round((time.thread_time() - c) / n * 1e6, 2),
                "wall_us": round((time.perf_counter() - t) / n * 1e6, 2),
            }

    try:
        asyncio.run(main())
    finally:
        eng.close()
    return out


def tier_case(reader, keys: list, conc: int, n_req: int) -> dict:
    """`n_req` one-chunk requests, `conc` in flight, sent by the bench's own
    awaited latency case (LMCacheReader._latency_awaited, which returns the
    loop thread's CPU over them and the time it waited for a CPU) on the
    reader's LMCache loop; the process's CPU and the host's (CpuSpan) around it."""
    reqs = [[keys[i % len(keys)]] for i in range(n_req)]
    lat: list[float] = []
    errors: list = []
    runners0 = named_threads_runq_wait_s("fx-runner") if reader.name.startswith("fx") else None
    span, t = CpuSpan(), time.perf_counter()
    loop_cpu_s, loop_wait_s = reader._latency_awaited(reqs, conc, lat, errors)
    wall = time.perf_counter() - t
    cpu = span.figures(n_req)
    runner_wait_s = None if runners0 is None else runq_wait_since(runners0, "fx-runner")
    return {
        "requests": n_req,
        "misses": len(errors),
        "loop_cpu_us": round(loop_cpu_s / n_req * 1e6, 1),
        # since 7e41988: the loop thread's run-queue wait, ready to run with no CPU
        "loop_wait_us": None if loop_wait_s is None else round(loop_wait_s / n_req * 1e6, 1),
        # since d1b062a: fx's runner threads' run-queue wait
        "runner_wait_us": None if runner_wait_s is None else round(runner_wait_s / n_req * 1e6, 1),
        "process_cpu_us": cpu["process_cpu_us_per_request"],
        "host_busy_us": cpu["host_busy_us_per_request"],
        "host_steal_share": cpu["host_steal_share"],
        "host_busy_share": cpu["host_busy_share"],
        "loop_busy": round(loop_cpu_s / wall, 3),
        "p50_ms": round(percentile(lat, 50) * 1e3, 3),
        "p99_ms": round(percentile(lat, 99) * 1e3, 3),
    }


def _median_of(rs: list[dict], k: str):
    """The median of the rounds' figure k, over the rounds that have it (None when none do)."""
    v = [r[k] for r in rs if r.get(k) is not None]
    return round(statistics.median(v), 3) if v else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readers", default="fx,rust_raw_block")
    ap.add_argument("--inflight", default="1,16")
    ap.add_argument("--requests", type=int, default=400, help="per case and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--handoff-calls", type=int, default=2000, help="per way and round")
    ap.add_argument("--preset", default="llama-3.2-1b-tp4", help="the geometry (2 MiB chunks by default)")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default="docs/awaited-cost-probe.json")
    a = ap.parse_args()

    why = loopfs.why_not_available()
    if why:
        print(f"needs XFS on a loop device: {why}", file=sys.stderr)
        return 2
    names = a.readers.split(",")
    inflight = [int(x) for x in a.inflight.split(",")]
    geo = PRESETS[a.preset]
    n_chunks = 64
    commit = git_commit(ROOT, ("csrc", "lmcache_fx"))

    handoff_raw = []
    for rnd in range(a.rounds):
        handoff_raw.append(handoff_round(a.handoff_calls))
        print(f"round {rnd} handoff: {handoff_raw[-1]}", flush=True)

    raw: dict[str, dict[str, list]] = {r: {str(n): [] for n in inflight} for r in names}
    size = f"{(3 * len(names) * n_chunks * geo.chunk_bytes) // (1 << 30) + 2}G"
    with loopfs.xfs_loop(size, touch=True) as mnt:
        cfg = BenchConfig(path=mnt, geo=geo, n_chunks=n_chunks, latency=True, concurrency=tuple(inflight))
        w = Workload(geo, n_chunks)
        with ExitStack() as stack:
            opened = {}
            for name in names:
                r = READERS[name](cfg, w)
                r.open(stack)
                tokens = w.tokens(20_000)
                keys = r.keys(tokens)
                r.engine.store(tokens, kvcaches=w.src, slot_mapping=w.slot_mapping)
                r.wait_stored(keys)
                opened[name] = (r, keys)
            loopfs.drop_caches()
            for rnd in range(a.rounds):
                for n in inflight:
                    for name in names if rnd % 2 == 0 else names[::-1]:
                        r, keys = opened[name]
                        res = tier_case(r, keys, n, a.requests)
                        raw[name][str(n)].append(res)
                        print(f"round {rnd} {name:15s} {n:2d} in flight: {res}", flush=True)

    handoff = {
        way: {k: _median_of([r[way] for r in handoff_raw], k) for k in ("loop_cpu_us", "wall_us")}
        for way in handoff_raw[0]
    }
    tiers: dict = {}
    for name in names:
        tiers[name] = {}
        for n, rs in raw[name].items():
            tiers[name][n] = {
                k: _median_of(rs, k)
                for k in (
                    "loop_cpu_us",
                    "loop_wait_us",
                    "runner_wait_us",
                    "process_cpu_us",
                    "host_busy_us",
                    "host_steal_share",
                    "host_busy_share",
                    "loop_busy",
                    "p50_ms",
                    "p99_ms",
                )
            }
            tiers[name][n]["misses"] = sum(x["misses"] for x in rs)
    ratios: dict = {}  # reader -> in flight -> figure -> median of the rounds' ratios
    if "rust_raw_block" in names:
        for name in names:
            if name == "rust_raw_block":
                continue
            ratios[name] = {
                n: {
                    k: round(statistics.median(f[k] / b[k] for f, b in zip(rs, raw["rust_raw_block"][n])), 3)
                    for k in ("loop_cpu_us", "process_cpu_us", "host_busy_us", "p50_ms")
                }
                for n, rs in raw[name].items()
            }
    for way, v in handoff.items():
        print(f"{a.label}: handoff {way:38s} loop CPU {v['loop_cpu_us']:6.1f} us, wall {v['wall_us']:6.1f} us")
    for name in names:
        for n, v in tiers[name].items():
            print(f"{a.label}: {name:15s} {n:>2s} in flight: {v}")
    for name, by_n in ratios.items():
        for n, v in by_n.items():
            print(f"{a.label}: {name} / rust_raw_block at {n} in flight: {v}")

    out_path = os.path.join(ROOT, a.out) if not os.path.isabs(a.out) else a.out
    doc: dict = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            doc = json.load(f)
    doc.setdefault("runs", {})[a.label] = {
        "command": "python scripts/awaited_cost_probe.py " + " ".join(sys.argv[1:]),
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "preset": a.preset,
        "chunk_bytes": geo.chunk_bytes,
        "requests": a.requests,
        "rounds": a.rounds,
        "handoff (medians over rounds)": handoff,
        "tiers (medians over rounds)": tiers,
        **{f"{name} over rust_raw_block (medians of each round's ratio)": v for name, v in ratios.items()},
        "handoff_rounds": handoff_raw,
        "tier_rounds": raw,
    }
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {out_path} [{a.label}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
