"""Orchestration: the reader registry, one run (every reader opened, reps
interleaved A B C A B C ..., latency at several requests in flight,
medians and ratios), and fx's store-level tuning sweep."""

from __future__ import annotations

import gc
import os
import platform
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from typing import Optional

from ..models import GB, MIB, Geometry
from . import l2
from . import readers as rd
from .readers import Reader
from .workload import BenchConfig, Skip, Workload, combine_latency_rounds, cpu_seconds, median, ratio, summarize


class NoReader(Exception):
    """Not one of the readers asked for could start here (each one's reason said)."""


READER_LIST = [
    rd.FxReader,
    rd.FxThreadsReader,
    rd.FxNoVerifyReader,
    rd.FxUnmappedReader,
    rd.FxUnstagedReader,
    rd.FxStagedReader,
    rd.FxPiecesReader,
    rd.FxNice0Reader,
    rd.FxUnqueuedReader,
    rd.FxOpOrderReader,
    rd.LocalDiskReader,
    rd.FSConnectorReader,
    rd.RustRawBlockReader,
    l2.FsNativeReader,
    l2.FxL2Reader,
    l2.FxL2UnstagedReader,
    l2.FxL2NoVerifyReader,
    l2.RawBlockL2Reader,
    rd.FioReader,
]
READER_CLASSES = {c.name: c for c in READER_LIST}
ALL_READERS = [c.name for c in READER_LIST]
# Run unless --readers says otherwise: fx-unmapped, fx-unstaged, fx-staged, fx-pieces, fx-nice0, fx-unqueued and
# fx-op-order, the A/B halves of mapped and staged reads (and of small reads in place), of whole small reads under
# load, of runner_nice, of awaited_concurrency and of interleaved pieces, only where those matter (a tmpfs with huge
# pages; a loop device; awaited reads on a busy host; more awaited reads in flight than CPUs; a read over several
# devices); fx-l2-noverify, fx's CPU without its check at the level fs_native is measured at.
A_B_READERS = (
    "fx-unmapped",
    "fx-unstaged",
    "fx-staged",
    "fx-pieces",
    "fx-l2-unstaged",
    "fx-l2-noverify",
    "fx-nice0",
    "fx-unqueued",
    "fx-op-order",
)
DEFAULT_READERS = [n for n in ALL_READERS if n not in A_B_READERS]
READER_LABELS = {c.name: c.label for c in READER_LIST}

# ------------------------------------------------------------------ --devices N: sizes and memory

SINGLE_PATH_TRANSIENT = {"local_disk", "fs_connector", "fs_native"}  # hold one rep's chunks, removed after it
LMCACHE_ENGINE_READERS = {
    "fx",
    "fx-threads",
    "fx-noverify",
    "fx-unmapped",
    "fx-unstaged",
    "fx-staged",
    "fx-pieces",
    "fx-nice0",
    "fx-unqueued",
    "fx-op-order",
    "local_disk",
    "fs_connector",
    "rust_raw_block",
}
L2_READERS = {"fs_native", "fx-l2", "fx-l2-unstaged", "fx-l2-noverify", "raw_block"}


def plan_devices(cfg: BenchConfig, readers: list[str], n: int) -> list[int]:
    """Bytes of each of the N loop filesystems for this workload: every
    device holds its share of a striped reader's chunks (1.5 x the even
    share + 2 chunks, at most all of them: placement is balanced within a
    write batch, and a rep's store may come in several) and its fio job's file; the first device also holds the
    single-path peers (one rep's chunks at a time, and the raw-block images
    that keep what was written). Plus XFS's own room; XFS's minimum is 300 MiB."""
    cb = cfg.geo.chunk_bytes
    per_chunk = cb + 8192  # header and alignment
    total = cfg.n_chunks * per_chunk
    share = min(cfg.n_chunks, -(-cfg.n_chunks * 3 // (2 * n)) + 2) * per_chunk
    fio = cfg.total_bytes // n + MIB
    concurrency = max(cfg.concurrency) if cfg.latency else 0
    persistent = 0
    if "rust_raw_block" in readers:
        persistent += 3 * cfg.total_bytes + 256 * MIB  # RustRawBlockReader's image
    if "raw_block" in readers:
        slot = (cb + 4096 + 4095) // 4096 * 4096
        persistent += 64 * MIB + (2 * cfg.n_chunks + concurrency + 2) * slot + 16 * MIB  # RawBlockL2Reader's
    transient = total if SINGLE_PATH_TRANSIENT & set(readers) else 0

    def fs(nbytes: int) -> int:
        b = int(nbytes * 1.1) + 128 * MIB
        return max(512 * MIB, -(-b // MIB) * MIB)

    first = fs(fio + max(share, transient) + persistent)
    return [first] + [fs(fio + share)] * (n - 1)


def mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_needed(cfg: BenchConfig, readers: list[str], sizes: list[int]) -> int:
    """RAM a --devices run takes: the RAM-backed images (preallocated), the
    workload's source and destination, the L2 readers' L1 arena, and each
    LMCache engine's CPU pool (touched by every retrieve)."""
    need = sum(sizes) + 2 * cfg.total_bytes
    if L2_READERS & set(readers):
        need += 2 * cfg.total_bytes
    need += len(LMCACHE_ENGINE_READERS & set(readers)) * int(cfg.pool_gb * (1 << 30))
    return need


def check_memory(cfg: BenchConfig, readers: list[str], sizes: list[int], shrink: str = "--devices") -> Optional[str]:
    """None when the run fits in this host's available memory, else why not
    (`shrink`: the flag that sized the images, named among the fixes)."""
    need, avail = memory_needed(cfg, readers, sizes), mem_available()
    if avail is None:
        return None
    if need > 0.9 * avail:
        return (
            f"{len(sizes)} RAM-backed loop filesystems of {', '.join(f'{s / (1 << 30):.2f}' for s in sizes)} GiB "
            f"plus the workload and the readers' buffers need about {need / (1 << 30):.1f} GiB, but only "
            f"{avail / (1 << 30):.1f} GiB is available (90% may be used): lower --total-gb, {shrink} or --readers"
        )
    return None


# ------------------------------------------------------------------ the run


class Progress:
    def __init__(self, total: int, quiet: bool = False):
        self.total, self.done, self.quiet = total, 0, quiet
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, what: str):
        self.done += 1
        if self.quiet:
            return
        width = 24
        k = int(width * self.done / max(1, self.total))
        line = f"[{'#' * k}{'.' * (width - k)}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f}s  {what}"
        sys.stderr.write(("\r" + line.ljust(100)) if self.tty else line + "\n")
        sys.stderr.flush()

    def end(self):
        if self.tty and not self.quiet:
            sys.stderr.write("\n")


def machine_info(path: str) -> dict:
    info = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            # A VM may mask the model name ("AMD EPYC"): family and model say which core it is, and the
            # CRC32C path chosen (below) follows from them.
            names = {"model name": "cpu", "cpu family": "cpu_family", "model": "cpu_model"}
            for line in f:
                if not line.strip():
                    break  # the first CPU's entry only
                k, _, v = line.partition(":")
                if k.strip() in names:
                    info[names[k.strip()]] = v.strip()
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    try:
        r = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", path], capture_output=True, text=True)
        info["filesystem"] = r.stdout.strip()
        # The mount's options too: every reader reads a tmpfs with huge=within_size faster (benchmarks.md).
        r = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", "--target", path], capture_output=True, text=True)
        info["mount_options"] = r.stdout.strip()
    except OSError:
        pass
    try:
        import lmcache
        import torch

        info["lmcache"] = getattr(lmcache, "__version__", "?")
        info["torch"] = torch.__version__
    except Exception:
        pass
    try:
        from ... import _fxio

        info["io_uring"] = _fxio.io_uring_status()
        info["crc32c"] = _fxio.CRC32C_IMPL  # fx's checked reads and stores depend on it
        info["crc32c_copy_one_pass"] = bool(_fxio.CRC32C_COPY_ONE_PASS)  # staged_reads: auto needs it
    except Exception:
        pass
    return info


def run_bench(cfg: BenchConfig, readers: list[str], quiet: bool = False) -> dict:
    from ... import __version__
    from ...core.medium import page_cache_fs
    from ...testing.loopfs import drop_caches

    asked_warm = not cfg.cold
    # A file of tmpfs or ramfs is its page cache: dropping caches cannot make it cold (the run was
    # labelled COLD regardless), and would only empty the rest of the host's page cache.
    in_memory = page_cache_fs(list(cfg.stripe) or [cfg.path])
    if cfg.cold and (in_memory or not drop_caches()):
        cfg.cold = False
    w = Workload(cfg.geo, cfg.n_chunks)
    results: dict = {
        "version": __version__,
        "cold": cfg.cold,
        "cache_note": "page cache dropped before every read (cold)"
        if cfg.cold
        else "page cache not dropped (--warm): results are WARM"
        if asked_warm
        else "a memory filesystem (tmpfs, ramfs) is its page cache, which cannot be dropped: results are WARM"
        if in_memory
        else "page cache could NOT be dropped (not root): results are WARM",
        "config_fs_native_workers": cfg.fs_native_workers,
        "config": {
            "path": cfg.path,
            "geometry": asdict(cfg.geo),
            "chunk_bytes": cfg.geo.chunk_bytes,
            "bytes_per_token": cfg.geo.bytes_per_token,
            "n_chunks": cfg.n_chunks,
            "total_bytes": cfg.total_bytes,
            "reps": cfg.reps,
            "queue_depth": cfg.queue_depth,
            "split_bytes": cfg.split_bytes,
            "l2_store_task_chunks": cfg.l2_store_task_chunks,
            "devices": list(cfg.stripe) or [cfg.path],
            "full_store": cfg.full_store,
            "mixed_store_lead_ms": cfg.mixed_store_lead_ms,
            "latency_awaited": cfg.latency_awaited,
            "latency_warmup": cfg.latency_warmup if cfg.latency else None,
        },
        "machine": {**machine_info(cfg.path), "loadavg_start": list(os.getloadavg())},
        "readers": {},
    }
    with ExitStack() as stack:
        live: list[Reader] = []
        for name in readers:
            r = READER_CLASSES[name](cfg, w)
            entry = results["readers"][name] = {"label": READER_LABELS[name], "reps": []}
            if not quiet:
                sys.stderr.write(f"starting {READER_LABELS[name]} ...\n")
            try:
                r.open(stack)
                live.append(r)
                entry["available"] = True
                entry["label"] = r.label  # a reader may name its settings once open
                entry["devices"] = len(r.dirs)
                if cfg.n_devices > 1:  # say how each reader was deployed over the N devices
                    entry["label"] += (
                        f" ({r.spread_words} {cfg.n_devices} devices)"
                        if len(r.dirs) > 1
                        else f" (1 of {cfg.n_devices} devices)"
                    )
            except Skip as e:
                entry.update(available=False, skip_reason=str(e))
            except Exception as e:  # a peer that fails to start is reported, not fatal
                entry.update(available=False, skip_reason=f"{type(e).__name__}: {e}")
        if not live:  # nothing to measure, nor to rotate over
            raise NoReader(
                "no reader could start: "
                + "; ".join(f"{n}: {results['readers'][n].get('skip_reason', '?')}" for n in readers)
            )
        # As vLLM does after start-up: the set-up's objects leave the collector's work, so a full
        # collection, set off by whichever reader allocates last, does not land in one reader's
        # timing. (LMCacheEngine turns the collector off only where py_enable_gc is false.)
        gc.collect()
        gc.freeze()
        stack.callback(gc.unfreeze)
        results["machine"]["gc"] = "heap frozen after set-up" + ("" if gc.isenabled() else "; collector off")
        lat_steps = len(live) * len(cfg.concurrency) * cfg.latency_rounds if cfg.latency else 0
        prog = Progress(cfg.reps * len(live) + lat_steps, quiet)
        for rep in range(cfg.reps):
            for r in rotated(live, rep):  # interleaved, the order rotated every rep: A B C, B C A, ...
                entry = results["readers"][r.name]
                try:
                    res = r.run_rep(rep)
                except Exception as e:
                    res = {"rep": rep, "ok": False, "error": f"{type(e).__name__}: {e}"}
                entry["reps"].append(res)
                tr = res.get("tier_read_gbps")
                prog.step(f"{r.name} rep {rep + 1}: " + (f"{tr:.2f} GB/s" if tr else res.get("error", "FAILED")))
        if cfg.latency:
            for conc in cfg.concurrency:
                rounds: dict = {r.name: [] for r in live}
                for rnd in range(cfg.latency_rounds):
                    for r in rotated(live, rnd):  # interleaved, the order rotated every round
                        try:
                            lat = r.latency(conc)
                        except Exception as e:
                            lat = {"error": f"{type(e).__name__}: {e}"}
                        if lat is not None:
                            rounds[r.name].append(lat)
                        prog.step(f"{r.name} latency @{conc}, round {rnd + 1}")
                for name, rs in rounds.items():
                    if rs:
                        results["readers"][name].setdefault("latency", {})[str(conc)] = combine_latency_rounds(rs)
        prog.end()
        if cfg.mixed:
            run_mixed(cfg, live, results, quiet)
    summarize_readers(results)
    results["machine"]["loadavg_end"] = list(os.getloadavg())  # other work on the host during the run
    results["best_peer"] = best_peer(results)
    # A store figure through LMCache's engine includes LMCache's own copy into its pool; one through the
    # L2 interface does not. So stores are also compared within their level.
    results["best_store_same_level"] = {
        "engine": best_peer(results, LMCACHE_ENGINE_READERS).get("store_gbps"),
        "l2": best_peer(results, L2_READERS).get("store_gbps"),
    }
    bp = results["best_peer"]
    for name, e in results["readers"].items():
        if e.get("available") and is_fx(name):
            m = e["median"]
            level = results["best_store_same_level"]["l2" if name in L2_READERS else "engine"]
            e["ratio_to_best_peer"] = {
                "tier_read": ratio(m["tier_read_gbps"], (bp.get("tier_read_gbps") or {}).get("value")),
                "store": ratio(m["store_gbps"], (bp.get("store_gbps") or {}).get("value")),
                "store_same_level": ratio(m["store_gbps"], (level or {}).get("value")),
                "tier_cpu": ratio(m["tier_cpu_s_per_gb"], (bp.get("tier_cpu_s_per_gb") or {}).get("value")),
            }
    return results


def rotated(readers: list, n: int) -> list:
    """The readers in the order of rep (or round) n: each rep starts one
    further along (A B C, B C A, C A B, ...)."""
    k = n % len(readers) if readers else 0
    return readers[k:] + readers[:k]


def summarize_readers(results: dict) -> None:
    """Each reader's medians over its good reps, whether all went right
    (every rep verified, no latency case with misses or failed rounds), and
    its ratios to fio."""
    fio = results["readers"].get("fio", {})
    fio_med = summarize(fio.get("reps", [])) if fio.get("available") else {}
    for _name, e in results["readers"].items():
        if not e.get("available"):
            continue
        e["median"] = summarize(e["reps"])
        # A latency case whose requests missed timed fast misses, not reads: the run fails as for a bad rep
        lat_bad = {
            c: (f"{L['misses']} of its requests missed" if L.get("misses") else L.get("error") or "a round failed")
            for c, L in (e.get("latency") or {}).items()
            if L.get("misses") or L.get("error") or L.get("failed_rounds")
        }
        if lat_bad:
            e["latency_failed"] = lat_bad
        e["all_ok"] = all(r.get("ok") for r in e["reps"]) and not lat_bad
        e["ratio_to_fio"] = ratio(e["median"]["tier_read_gbps"], fio_med.get("tier_read_gbps"))
        e["cpu_ratio_to_fio"] = ratio(e["median"]["tier_cpu_s_per_gb"], fio_med.get("tier_cpu_s_per_gb"))


def run_mixed(cfg: BenchConfig, live: list, results: dict, quiet: bool) -> None:
    """Stores while loads run, for the readers that can (the L2 adapters):
    cfg.reps interleaved reps; medians, and each against the same reader's
    figure alone from the main reps."""
    mixers = [r for r in live if hasattr(r, "mixed_rep")]
    prog = Progress(cfg.reps * len(mixers), quiet)
    for rep in range(cfg.reps):
        for r in rotated(mixers, rep):  # interleaved, the order rotated every rep, as the main reps
            e = results["readers"][r.name]
            try:
                e.setdefault("mixed_reps", []).append(r.mixed_rep(rep))
            except Exception as ex:
                e.setdefault("mixed_reps", []).append({"error": f"{type(ex).__name__}: {ex}", "ok": False})
            prog.step(f"{r.name} mixed")
    prog.end()
    for r in mixers:
        e = results["readers"][r.name]
        reps = [x for x in e.get("mixed_reps", []) if x.get("ok")]
        alone = summarize(e["reps"])
        load = median([x["load_gbps"] for x in reps]) if reps else None
        store = median([x["store_gbps"] for x in reps]) if reps else None
        e["mixed"] = {
            "reps_ok": len(reps),
            "load_gbps": load,
            "store_gbps": store,
            "load_vs_alone": ratio(load, alone.get("tier_read_gbps")),
            "store_vs_alone": ratio(store, alone.get("store_gbps")),
        }


def is_fx(name: str) -> bool:
    return name.startswith("fx")


def best_peer(results: dict, among: Optional[set] = None) -> dict:
    """Among the readers that are neither lmcache-fx nor fio (and are in
    `among`, when given): the highest median tier read and store GB/s and
    the lowest tier CPU s/GB, with who. A peer counts with the medians of its
    good reps, as fx does (a peer with one failed rep was left out, and fx
    compared with a weaker one); the run itself fails either way."""
    out = {}
    peers = [
        (n, e["median"])
        for n, e in results["readers"].items()
        if e.get("available") and not is_fx(n) and n != "fio" and (among is None or n in among)
    ]
    for metric, better in (("tier_read_gbps", max), ("store_gbps", max), ("tier_cpu_s_per_gb", min)):
        vals = [(m[metric], n) for n, m in peers if m.get(metric) is not None]
        if vals:
            v, n = better(vals)
            out[metric] = {"reader": n, "value": v}
    return out


# ------------------------------------------------------------------ tuning sweep (store level)


def run_sweep(path: str, geo: Geometry, n_chunks: int, reps: int, qds, splits, cold: bool, quiet: bool = False) -> dict:
    """GB/s of lmcache-fx's store read path (no LMCache engine) against
    queue_depth (at split 1 MiB) and split_bytes (at queue_depth 32), into a
    huge-page, registered destination like the plugin's pool."""
    from ... import _fxio
    from ...core.chunkfile import ChunkMeta
    from ...core.options import FxOptions
    from ...core.store import ChunkStore
    from ...testing.loopfs import drop_caches

    d = os.path.join(path, "sweep")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    cb = geo.chunk_bytes
    src = _fxio.HostBuffer(cb, hugepages=True)
    memoryview(src)[:] = os.urandom(cb)
    meta = ChunkMeta(((geo.kv_size, geo.layers, geo.chunk, geo.hidden),), (geo.dtype,), "KV_2LTD")
    keys = [f"sweep@{i}" for i in range(n_chunks)]
    w = ChunkStore(FxOptions(path=d, io_engine="io_uring", max_capacity_gb=1e6))
    ok = w.write([(k, src.address, cb, meta) for k in keys])
    assert all(ok), "sweep: writes failed"
    w.close()
    dst = _fxio.HostBuffer(n_chunks * cb, hugepages=True)
    _fxio.advise_hugepages(dst.address, n_chunks * cb)
    points = [("queue_depth", qd, qd, MIB) for qd in qds] + [("split_bytes", sb, 32, sb) for sb in splits]
    order = [(p, rep) for rep in range(reps) for p in points]  # interleaved
    raw: dict = {}
    prog = Progress(len(order), quiet)
    for (what, val, qd, sb), _rep in order:
        eng = _fxio.Engine("io_uring", qd, sb)
        eng.register_buffer(dst, n_chunks * cb)
        s = ChunkStore(
            FxOptions(path=d, io_engine="io_uring", queue_depth=qd, split_bytes=sb, max_capacity_gb=1e6), engine=eng
        )
        slot = iter(range(n_chunks))
        if cold:
            drop_caches()
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = s.read(keys, lambda m, slot=slot: (lambda i: (i, dst.address + i * cb, cb))(next(slot)), lambda h: None)
        dt = time.perf_counter() - t0
        cpu = cpu_seconds() - c0
        s.close()
        good = sum(1 for o in out if o is not None) == n_chunks
        gb = n_chunks * cb / GB
        raw.setdefault(f"{what}={val}", []).append({"gbps": gb / dt if good else None, "cpu_s_per_gb": cpu / gb})
        prog.step(f"sweep {what}={val}")
    prog.end()
    shutil.rmtree(d, ignore_errors=True)

    def curve(what, vals):
        return [
            {
                "value": v,
                "gbps": median([x["gbps"] for x in raw[f"{what}={v}"]]),
                "cpu_s_per_gb": median([x["cpu_s_per_gb"] for x in raw[f"{what}={v}"]]),
            }
            for v in vals
        ]

    return {
        "chunk_bytes": cb,
        "n_chunks": n_chunks,
        "reps": reps,
        "cold": cold,
        "queue_depth": curve("queue_depth", qds),
        "split_bytes": curve("split_bytes", splits),
    }


# ------------------------------------------------------------------ cost per chunk


PER_CHUNK_GEOMETRY = Geometry(layers=1, kv_heads=1, head_dim=64, chunk=16)  # 4 KiB chunks


def run_per_chunk(cfg: BenchConfig, readers: list[str], n_chunks: int, quiet: bool = False) -> dict:
    """The fixed cost of a chunk: n_chunks chunks of 4 KiB through each
    reader (same method as the main run), µs per chunk of the tier read and
    of the store, medians of cfg.reps."""
    d = os.path.join(cfg.path, "per-chunk")
    os.makedirs(d, exist_ok=True)
    # The main run's settings, on 4 KiB chunks in one directory, without the latency and mixed passes.
    sub = replace(
        cfg, path=d, geo=PER_CHUNK_GEOMETRY, n_chunks=n_chunks, latency=False, mixed=False, full_store=False, stripe=()
    )
    res = run_bench(sub, readers, quiet=quiet)
    shutil.rmtree(d, ignore_errors=True)
    out = {
        "chunk_bytes": PER_CHUNK_GEOMETRY.chunk_bytes,
        "n_chunks": n_chunks,
        "reps": cfg.reps,
        "cold": res["cold"],
        "readers": {},
    }
    for name, e in res["readers"].items():
        if not e.get("available"):
            out["readers"][name] = {"label": e["label"], "available": False, "skip_reason": e.get("skip_reason")}
            continue
        m = e["median"]
        out["readers"][name] = {
            "label": e["label"],
            "available": True,
            "all_ok": e["all_ok"],
            "tier_us_per_chunk": m["tier_us_per_chunk"],
            "store_us_per_chunk": m["store_us_per_chunk"],
            "tier_cpu_us_per_chunk": (m["tier_cpu_s_per_gb"] * PER_CHUNK_GEOMETRY.chunk_bytes / GB * 1e6)
            if m["tier_cpu_s_per_gb"] is not None
            else None,
            "reps": e["reps"],
        }
    return out
