"""What every part of the bench shares: the geometry from the command line,
the workload (source KV of random bytes and a destination), the run's
configuration, CPU clocks and the statistics (medians, ratios, percentiles)."""

from __future__ import annotations

import os
import resource
import statistics
from dataclasses import asdict, dataclass
from typing import Optional

from ..models import GB, MIB, PRESETS, Geometry

DEFAULT_PRESET = "qwen2.5-32b"


def geometry_from_args(args) -> Geometry:
    base = PRESETS[args.preset] if args.preset else PRESETS[DEFAULT_PRESET]
    over = {
        k: getattr(args, k)
        for k in ("layers", "kv_heads", "head_dim", "dtype", "chunk")
        if getattr(args, k, None) is not None
    }
    if getattr(args, "mla", False):
        over["mla"] = True
    return Geometry(**{**asdict(base), **over})


def plan_chunks(geo: Geometry, total_bytes: int) -> int:
    """Whole chunks that fit in total_bytes (at least 1)."""
    return max(1, total_bytes // geo.chunk_bytes)


# ------------------------------------------------------------------ statistics


def median(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b) -> Optional[float]:
    if a is None or b is None or b == 0:
        return None
    return a / b


def percentile(xs, p: float) -> Optional[float]:
    """Nearest-rank percentile (p in 0..100)."""
    xs = sorted(xs)
    if not xs:
        return None
    k = max(0, min(len(xs) - 1, int(-(-p * len(xs) // 100)) - 1))
    return xs[k]


def rank_at(xs, q: float) -> float:
    """The value at rank round(q * (n - 1)) of the sorted samples (q in
    0..1): the latency probes' p50 and p99. It can differ from percentile()
    by one rank; the probes' committed runs use this one."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


METRICS = (
    "tier_read_gbps",
    "retrieve_gbps",
    "store_gbps",
    "cpu_s_per_gb",
    "tier_cpu_s_per_gb",
    "tier_us_per_chunk",
    "store_us_per_chunk",
)


def summarize(reps: list[dict]) -> dict:
    """Medians over the reps that read right (a rep with wrong bytes is no figure)."""
    return {m: median([r.get(m) for r in reps if r.get("ok")]) for m in METRICS}


# ------------------------------------------------------------------ clocks


def cpu_seconds() -> float:
    """CPU time of this process, all threads (microsecond resolution)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _host_cpu_line() -> list[int]:
    """Every field of /proc/stat's first line: user, nice, system, idle,
    iowait, irq, softirq, steal (then guest and guest_nice, which user and
    nice include already) ticks of the whole host so far."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def host_ticks() -> tuple[int, int]:
    """(all, idle + iowait) CPU ticks of the whole host so far (/proc/stat):
    the busy share of an interval counts the loop device's kernel workers,
    which no process's CPU time includes."""
    v = _host_cpu_line()
    return sum(v), v[3] + v[4]


class CpuSpan:
    """The CPU one stretch of the bench took, per request: this process's
    (every thread), the whole host's busy time (the loop device's kernel
    workers included, which no process's time counts; other work on the host
    too) and the host's stolen share (a VM's CPU its hypervisor gave to
    others). A slower host day shows in the stolen share or in every reader's
    figures alike, a reader's own cost in its process figure; and the share
    of the host's CPU time that was busy. The host's ticks are 1/CLK_TCK s
    (10 ms), coarse for a short round."""

    def __init__(self) -> None:
        self.cpu0, self.host0 = cpu_seconds(), _host_cpu_line()[:8]  # up to steal

    def figures(self, requests: int) -> dict:
        cpu = cpu_seconds() - self.cpu0
        d = [b - a for a, b in zip(self.host0, _host_cpu_line()[:8])]
        total, steal = sum(d), d[7]
        busy = total - d[3] - d[4] - steal
        tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
        n = max(requests, 1)
        return {
            "process_cpu_us_per_request": round(cpu / n * 1e6, 1),
            "host_busy_us_per_request": round(busy * tick_us / n, 1),
            "host_steal_share": round(steal / total, 4) if total else None,
            # the share of every CPU's time it was busy: below 1 with requests still waiting, some step of
            # theirs waits for something other than a CPU
            "host_busy_share": round(busy / total, 4) if total else None,
        }


def _runq_wait_s(schedstat: str) -> Optional[float]:
    """Seconds a thread has spent runnable but waiting for a CPU: the second
    figure of its schedstat file; None where the kernel keeps none or the
    thread is gone."""
    try:
        with open(schedstat) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def thread_runq_wait_s() -> Optional[float]:
    """The calling thread's wait for a CPU so far (_runq_wait_s)."""
    return _runq_wait_s("/proc/thread-self/schedstat")


def named_threads_runq_wait_s(name: str) -> dict[int, float]:
    """Thread id -> its wait for a CPU so far (_runq_wait_s), for this
    process's threads called `name` (fx's runners are fx-runner)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
        except OSError:  # a thread that just exited
            continue
        wait = _runq_wait_s(f"/proc/self/task/{tid}/schedstat")
        if wait is not None:
            out[int(tid)] = wait
    return out


def runq_wait_since(before: dict[int, float], name: str) -> Optional[float]:
    """Seconds the threads called `name` waited for a CPU since `before`
    (named_threads_runq_wait_s then): threads started since count whole,
    threads gone since are lost; None when there are none."""
    now = named_threads_runq_wait_s(name)
    if not now:
        return None
    return sum(w - before.get(tid, 0.0) for tid, w in now.items())


def children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------ the workload


class Workload:
    """Source KV [kv_size, layers, tokens, hidden] of random bytes, and a
    destination of the same shape."""

    def __init__(self, geo: Geometry, n_chunks: int, seed: int = 1234):
        import torch

        self.geo, self.n_chunks = geo, n_chunks
        self.tokens_n = n_chunks * geo.chunk
        self.nbytes = n_chunks * geo.chunk_bytes
        g = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=g)
        dt = getattr(torch, geo.dtype)
        shape = (geo.kv_size, geo.layers, self.tokens_n, geo.hidden)
        self.src = raw.view(dt).view(shape)
        self.dst = torch.zeros_like(self.src)
        self.slot_mapping = torch.arange(self.tokens_n, dtype=torch.long)
        self.src_crc = crc_of(self.src)

    def tokens(self, rep: int):
        import torch

        t = (torch.arange(self.tokens_n, dtype=torch.long) * 7 + 1000 * rep + 1) % 100_000
        # A distinct first token per rep -> distinct keys for every chunk (each chains from the one before).
        # Taken from the rest, it repeated every 100 reps: latency's rep 10_000 + concurrency had the
        # keys of throughput rep `concurrency`.
        t[0] = rep % 100_000
        return t


def zero(t) -> None:
    """Zeroes a contiguous CPU tensor with one memset on this thread. Not
    torch's zero_(): its intra-op threads spin for a while after a large
    fill, and a reader timed right after it had their spinning counted in its
    process CPU (docs/benchmarks.md, "Where fx stands"; scripts/tier_cpu_probe.py)."""
    import ctypes

    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("zero() takes a contiguous CPU tensor")
    ctypes.memset(t.data_ptr(), 0, t.numel() * t.element_size())


def crc_of(t) -> int:
    from ... import _fxio

    return _fxio.crc32c(t.contiguous().view(-1).view(__import__("torch").uint8).numpy())


# ------------------------------------------------------------------ configuration


class Skip(Exception):
    """A reader that cannot run here; the message says why."""


# Requests of a latency case: 16 per thread (per request in flight), and at
# least 400 in all, so that p99 (nearest rank) is at least the 5th slowest at
# every count in flight; with 16 per thread alone, 1 and 4 in flight made 16
# and 64 requests, where p99 was the slowest one: a single pause of the host.
LATENCY_REQUESTS_PER_THREAD = 16
LATENCY_MIN_REQUESTS = 400


def latency_requests(n_keys: int, conc: int) -> int:
    """How many requests a latency case sends: every stored chunk at least
    once, LATENCY_REQUESTS_PER_THREAD per thread, LATENCY_MIN_REQUESTS."""
    return max(n_keys, LATENCY_REQUESTS_PER_THREAD * conc, LATENCY_MIN_REQUESTS)


def latency_figures(lat: list) -> dict:
    """p50 / p99 of request latencies (seconds, in completion order), with
    every latency kept in that order (ms) and the positions of those above
    2x p50: whether a tail is a few requests served late, or a stretch of
    time in which every request in flight was slow (all of one "generation"
    of `conc` requests at once: a pause of the host, not unfairness)."""
    p50 = percentile(lat, 50)
    return {
        "p50_ms": p50 * 1e3,
        "p99_ms": percentile(lat, 99) * 1e3,
        "ms": [round(x * 1e3, 3) for x in lat],
        "over_2x_p50": [i for i, x in enumerate(lat) if x > 2 * p50],
    }


# Untimed requests before each latency round, on chunks of their own stored
# with the round's: the first ~16 requests after an idle pause and a cache
# drop took 1.4-2.1x the steady time for every reader (each thread of the path
# took 20-40 % more CPU per request at first), a ramp of the host, not
# unfairness between requests in flight, that alone lifted a 2 MiB case's
# p99/p50 over 2x. fio's ramp_time does the same; their latencies are kept
# apart ("warmup").
LATENCY_WARMUP = 40


def latency_warmup_requests(warmup: int, conc: int) -> int:
    """Untimed requests before a latency round: `warmup` (0: none), and at
    least four per request in flight."""
    return max(warmup, 4 * conc) if warmup > 0 else 0


def warmup_figures(lat: list) -> dict:
    """What the untimed requests took: how many, their p50 and slowest (ms)."""
    if not lat:
        return {}
    return {
        "warmup_requests": len(lat),
        "warmup_p50_ms": percentile(lat, 50) * 1e3,
        "warmup_max_ms": max(lat) * 1e3,
    }


# Rounds of every latency case: the targets are medians of at least 5, and a
# single case's p99 swings with the host (a pause of a few ms fails a 2 MiB
# case for any reader), so one case per run says little.
LATENCY_ROUNDS = 5


# CpuSpan's figures, the awaited path's LMCache loop thread CPU and run-queue wait (time it was ready to
# run and waited for a CPU), and fx's runner threads' run-queue wait (since d1b062a), per request.
LATENCY_CPU_FIGURES = (
    "process_cpu_us_per_request",
    "loop_cpu_us_per_request",
    "loop_wait_us_per_request",
    "runner_wait_us_per_request",
    "host_busy_us_per_request",
    "host_steal_share",
    "host_busy_share",
)


def combine_latency_rounds(rounds: list) -> dict:
    """One latency case from its rounds (each latency_figures() plus requests
    and misses, or {"error": ...}): p50, p99 and p99/p50 as medians over the
    rounds that ran, the ratio taken within each round (the same stretch of
    the host's time), the rounds' CPU and warm-up figures as medians, and
    every round kept."""
    ok = [r for r in rounds if r and r.get("p50_ms")]
    out: dict = {"rounds": rounds}
    if not ok:
        out["error"] = next((r["error"] for r in rounds if r and r.get("error")), "no round ran")
        return out
    each = [r["p99_ms"] / r["p50_ms"] for r in ok]
    out.update(
        p50_ms=median([r["p50_ms"] for r in ok]),
        p99_ms=median([r["p99_ms"] for r in ok]),
        p99_over_p50=median(each),
        p99_over_p50_each=[round(x, 3) for x in each],
        requests=ok[0].get("requests"),
        chunks_per_request=ok[0].get("chunks_per_request", 1),
        misses=sum(r.get("misses", 0) for r in ok),
    )
    for k in LATENCY_CPU_FIGURES + ("warmup_p50_ms", "warmup_max_ms"):  # where the rounds measured them
        vals = [r[k] for r in ok if r.get(k) is not None]
        if vals:
            out[k] = median(vals)
    if len(ok) < len(rounds):
        out["failed_rounds"] = len(rounds) - len(ok)
    return out


@dataclass
class BenchConfig:
    path: str
    geo: Geometry
    n_chunks: int
    reps: int = 3
    queue_depth: int = 32
    split_bytes: int = MIB
    cold: bool = True
    verify: bool = True
    latency: bool = False
    concurrency: tuple = (1, 4, 16)
    latency_rounds: int = LATENCY_ROUNDS  # each latency case this many times, readers interleaved
    latency_awaited: bool = False  # LMCache tiers' latency through batched_get_non_blocking on an event loop
    latency_warmup: int = LATENCY_WARMUP  # untimed requests before each latency round (latency_warmup_requests)
    mixed: bool = False  # also: stores while loads run (L2 adapters)
    mixed_store_lead_ms: float = 0.0  # --mixed: the load submitted this long after the store
    full_store: bool = False  # fx-l2 at its capacity: each chunk stored evicts one
    fs_native_workers: int = 8
    l2_store_task_chunks: int = 0  # L2 stores submitted as tasks of this many chunks, all at once (0: one task)
    # --devices N: one bench directory per device, cfg.path being the first.
    # Readers that take a path list (fx) stripe over all of them, fio runs one
    # job per device, the single-path peers use cfg.path (one device).
    stripe: tuple = ()

    @property
    def n_devices(self) -> int:
        return max(1, len(self.stripe))

    @property
    def total_bytes(self) -> int:
        return self.n_chunks * self.geo.chunk_bytes

    @property
    def pool_gb(self) -> float:
        # A retrieve allocates all its chunks at once; the store holds them
        # until written. Room for all of them plus two.
        n = max(self.n_chunks, max(self.concurrency) if self.latency else 0) + 2
        return n * self.geo.chunk_bytes / (1 << 30) + 0.01


__all__ = [
    "GB",
    "LATENCY_MIN_REQUESTS",
    "LATENCY_REQUESTS_PER_THREAD",
    "LATENCY_ROUNDS",
    "LATENCY_WARMUP",
    "combine_latency_rounds",
    "latency_figures",
    "latency_requests",
    "latency_warmup_requests",
    "warmup_figures",
    "MIB",
    "BenchConfig",
    "Skip",
    "Workload",
    "crc_of",
    "cpu_seconds",
    "children_cpu_seconds",
    "geometry_from_args",
    "plan_chunks",
    "median",
    "ratio",
    "percentile",
    "summarize",
    "METRICS",
]
