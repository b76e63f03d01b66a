"""`lmcache-fx bench`: one KV-cache workload through several readers, the
same run, interleaved (A B C A B C ...), medians of the repetitions.

Readers: lmcache-fx (io_uring and thread engines), LMCache's LocalDiskBackend,
FSConnector and RustRawBlockBackend (each through a real LMCacheEngine on CPU),
and fio (io_uring, O_DIRECT, same request size, queue depth and total bytes)
as the physical limit. A rep is: store through the engine, wait until the tier
holds every chunk, drop the page cache (root), retrieve through the engine
from the tier, and check that what landed equals what was stored (CRC32C).

    lmcache-fx bench --mkfs-loop 8G --json out.json --png out.png
    python -m lmcache_fx.tools.bench --path /mnt/nvme/bench --preset llama-3-70b-tp8
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from .models import GB, MIB, PRESETS, Geometry, parse_size

ALL_READERS = ["fx", "fx-threads", "fx-noverify", "local_disk", "fs_connector", "rust_raw_block", "fio"]
READER_LABELS = {
    "fx": "lmcache-fx (io_uring)",
    "fx-threads": "lmcache-fx (threads)",
    "fx-noverify": "lmcache-fx (io_uring, verify off)",
    "local_disk": "LMCache LocalDiskBackend",
    "fs_connector": "LMCache FSConnector",
    "rust_raw_block": "LMCache RustRawBlockBackend",
    "fio": "fio io_uring O_DIRECT",
}


def geometry_from_args(args) -> Geometry:
    base = PRESETS[args.preset] if args.preset else PRESETS["qwen2.5-32b"]
    over = {k: getattr(args, k) for k in ("layers", "kv_heads", "head_dim", "dtype", "chunk")
            if getattr(args, k, None) is not None}
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


METRICS = ("tier_read_gbps", "retrieve_gbps", "store_gbps", "cpu_s_per_gb", "tier_cpu_s_per_gb")


def summarize(reps: list[dict]) -> dict:
    return {m: median([r.get(m) for r in reps]) for m in METRICS}


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

        # Distinct first token per rep -> distinct keys for every chunk.
        return (torch.arange(self.tokens_n, dtype=torch.long) * 7 + 1000 * rep + 1) % 100_000


def crc_of(t) -> int:
    from .. import _fxio

    return _fxio.crc32c(t.contiguous().view(-1).view(__import__("torch").uint8).numpy())


# ------------------------------------------------------------------ LMCache driving


def _connector_class():
    from ..integration.connector import ChunkwiseConnector

    class ContiguousCPUConnector(ChunkwiseConnector):
        """Moves chunks between LMCache's objects ([kv, layers, tokens, hidden])
        and one contiguous CPU 'KV cache' tensor of the same layout."""

        def __init__(self, geo: Geometry):
            import torch

            self.geo = geo
            self._torch = torch

        def from_gpu(self, memory_obj, start, end, **kw):
            memory_obj.tensor[:, :, : end - start, :].copy_(kw["kvcaches"][:, :, start:end, :])

        def to_gpu(self, memory_obj, start, end, **kw):
            kw["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor[:, :, : end - start, :])

        def get_shape(self, num_tokens):
            return self._torch.Size([self.geo.kv_size, self.geo.layers, num_tokens, self.geo.hidden])

    return ContiguousCPUConnector


@contextmanager
def lmcache_engine(cfg_dict: dict, geo: Geometry, model: str = "lmcache-fx-bench"):
    """A real LMCacheEngine on CPU built from the YAML-shaped dict a user writes."""
    import torch
    from lmcache.v1.config import LMCacheEngineConfig

    from ..testing.cpu_engine import engine_on_cpu

    cfg = LMCacheEngineConfig.from_dict(cfg_dict)
    cfg.validate()
    with engine_on_cpu(cfg, _connector_class()(geo), getattr(torch, geo.dtype), geo.kv_shape(), geo.mla,
                       geo.chunk, model, prefix="fxbench") as engine:
        yield engine


class TierMeter:
    """Wraps a backend's blocking get calls: wall time and bytes returned."""

    def __init__(self, backend):
        self.backend = backend
        self.seconds = 0.0
        self.cpu = 0.0
        self.nbytes = 0
        self.calls = 0
        for name in ("batched_get_blocking", "get_blocking"):
            orig = getattr(backend, name, None)
            if orig is not None:
                setattr(backend, name, self._wrap(orig, batched=name.startswith("batched")))

    def _wrap(self, fn, batched):
        def timed(*a, **k):
            c, t = cpu_seconds(), time.perf_counter()
            out = fn(*a, **k)
            self.seconds += time.perf_counter() - t
            self.cpu += cpu_seconds() - c
            self.calls += 1
            for o in (out if batched else [out]):
                if o is not None:
                    self.nbytes += o.get_size()
            return out

        return timed

    def reset(self):
        self.seconds, self.cpu, self.nbytes, self.calls = 0.0, 0.0, 0, 0


def cpu_seconds() -> float:
    """CPU time of this process, all threads (microsecond resolution)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------ readers


class Skip(Exception):
    """A reader that cannot run here; the message says why."""


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

    @property
    def total_bytes(self) -> int:
        return self.n_chunks * self.geo.chunk_bytes

    @property
    def pool_gb(self) -> float:
        # A retrieve allocates all its chunks at once; the store holds them
        # until written. Room for all of them plus two.
        n = max(self.n_chunks, max(self.concurrency) if self.latency else 0) + 2
        return n * self.geo.chunk_bytes / (1 << 30) + 0.01


class Reader:
    name = ""

    def __init__(self, cfg: BenchConfig, workload: Workload):
        self.cfg, self.w = cfg, workload
        self.dir = os.path.join(cfg.path, self.name)

    def open(self, stack: ExitStack) -> None: ...

    def run_rep(self, rep: int) -> dict:
        raise NotImplementedError

    def latency(self, conc: int) -> Optional[dict]:
        return None


class LMCacheReader(Reader):
    backend_match: Callable[[str, object], bool]

    def lmcache_config(self) -> dict:
        raise NotImplementedError

    def open(self, stack):
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)
        self.engine = stack.enter_context(lmcache_engine(self.lmcache_config(), self.cfg.geo))
        backends = self.engine.storage_manager.storage_backends
        found = [b for n, b in backends.items() if self.is_mine(n, b)]
        if not found:
            raise Skip(f"LMCache started without this tier (backends: {list(backends)}); see its log above")
        self.backend = found[0]
        self.meter = TierMeter(self.backend)

    def is_mine(self, name, backend) -> bool:
        raise NotImplementedError

    def keys(self, tokens) -> list:
        return [k for _, _, k in self.engine.token_database.process_tokens(tokens=tokens)]

    def wait_stored(self, keys, timeout=120.0) -> None:
        end = time.monotonic() + timeout
        if hasattr(self.backend, "flush"):
            self.backend.flush(timeout)
        for k in keys:
            while self.backend.exists_in_put_tasks(k) or not self.backend.contains(k):
                if time.monotonic() > end:
                    raise RuntimeError(f"{self.name}: chunks not on the tier after {timeout:.0f} s")
                time.sleep(0.002)

    def cleanup(self, keys) -> None:
        for k in keys:
            try:
                self.backend.remove(k)
            except Exception:
                pass

    def run_rep(self, rep: int) -> dict:
        w, cfg = self.w, self.cfg
        tokens = w.tokens(rep)
        keys = self.keys(tokens)
        # store
        t0 = time.perf_counter()
        self.engine.store(tokens, kvcaches=w.src, slot_mapping=w.slot_mapping)
        self.wait_stored(keys)
        store_s = time.perf_counter() - t0
        if cfg.cold:
            from ..testing.loopfs import drop_caches

            drop_caches()
        # retrieve
        w.dst.zero_()
        self.meter.reset()
        c0, t0 = cpu_seconds(), time.perf_counter()
        mask = self.engine.retrieve(tokens, kvcaches=w.dst, slot_mapping=w.slot_mapping)
        ret_s = time.perf_counter() - t0
        cpu = cpu_seconds() - c0
        got_tokens = int(mask.sum())
        out = {
            "rep": rep,
            "store_s": store_s,
            "retrieve_s": ret_s,
            "tier_s": self.meter.seconds,
            "tier_bytes": self.meter.nbytes,
            "tokens": got_tokens,
            "cpu_s": cpu,
        }
        if cfg.verify:
            out["crc_ok"] = crc_of(w.dst) == w.src_crc
        ok = got_tokens == w.tokens_n and self.meter.nbytes == w.nbytes and out.get("crc_ok", True)
        out["ok"] = ok
        gb = w.nbytes / GB
        out["store_gbps"] = gb / store_s
        out["retrieve_gbps"] = gb / ret_s if ok else None
        out["tier_read_gbps"] = gb / self.meter.seconds if ok and self.meter.seconds > 0 else None
        out["cpu_s_per_gb"] = cpu / gb if ok else None
        out["tier_cpu_s_per_gb"] = self.meter.cpu / gb if ok else None
        self.cleanup(keys)
        return out

    # -------------------------------------------------------------- latency
    def latency(self, conc: int) -> Optional[dict]:
        """p50/p99 of one-chunk requests with `conc` in flight: `conc` threads
        call the backend's batched_get_blocking([key]) over the stored chunks
        (cycled, so at least 4 requests per thread; O_DIRECT tiers re-read the
        device, others after a page-cache drop only the first time)."""
        w = self.w
        tokens = w.tokens(10_000 + conc)
        keys = self.keys(tokens)
        self.engine.store(tokens, kvcaches=w.src, slot_mapping=w.slot_mapping)
        self.wait_stored(keys)
        if self.cfg.cold:
            from ..testing.loopfs import drop_caches

            drop_caches()
        n_req = max(len(keys), 4 * conc)
        reqs = [[keys[i % len(keys)]] for i in range(n_req)]
        lat: list[float] = []
        lock = threading.Lock()
        nxt = iter(reqs)
        errors = []

        def worker():
            while True:
                with lock:
                    r = next(nxt, None)
                if r is None:
                    return
                t = time.perf_counter()
                objs = self.backend.batched_get_blocking(r)
                dt = time.perf_counter() - t
                if any(o is None for o in objs):
                    errors.append(r)
                for o in objs:
                    if o is not None:
                        o.ref_count_down()
                with lock:
                    lat.append(dt)

        ths = [threading.Thread(target=worker) for _ in range(conc)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        self.cleanup(keys)
        return {"requests": len(lat), "chunks_per_request": 1, "misses": len(errors),
                "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3}


def _base_config(cfg: BenchConfig) -> dict:
    return {
        "chunk_size": cfg.geo.chunk,
        "local_cpu": False,  # every retrieve reads the tier
        "max_local_cpu_size": round(cfg.pool_gb, 3),
        "extra_config": {},
    }


class FxReader(LMCacheReader):
    name = "fx"
    io_engine = "io_uring"

    def lmcache_config(self):
        d = _base_config(self.cfg)
        p = "storage_plugin.fx."
        d["storage_plugins"] = ["fx"]
        d["extra_config"] = {
            p + "module_path": "lmcache_fx.lmcache_plugin",
            p + "class_name": "FxStorageBackend",
            p + "path": self.dir,
            p + "io_engine": self.io_engine,
            p + "queue_depth": self.cfg.queue_depth,
            p + "split_bytes": self.cfg.split_bytes,
            p + "max_capacity_gb": max(1.0, 4 * self.cfg.total_bytes / GB),
        }
        return d

    def is_mine(self, name, backend):
        return name == "fx"

    def open(self, stack):
        super().open(stack)
        eng = self.backend.store.engine
        if eng.kind != self.io_engine:
            raise Skip(f"engine is {eng.kind}: {eng.fallback_reason}")


class FxThreadsReader(FxReader):
    name = "fx-threads"
    io_engine = "threads"


class FxNoVerifyReader(FxReader):
    """fx without the CRC32C check on read: what the checksum costs."""

    name = "fx-noverify"

    def lmcache_config(self):
        d = super().lmcache_config()
        d["extra_config"]["storage_plugin.fx.verify"] = False
        return d


class LocalDiskReader(LMCacheReader):
    name = "local_disk"

    def lmcache_config(self):
        d = _base_config(self.cfg)
        d["local_disk"] = f"file://{self.dir}/"
        # LMCache 0.5.6's LocalDiskBackend.remove() does not lower current_cache_size,
        # so every store/remove round uses up capacity for good: room for all rounds.
        rounds = self.cfg.reps + len(self.cfg.concurrency) + 2
        d["max_local_disk_size"] = max(1.0, 2 * rounds * self.cfg.total_bytes / (1 << 30))
        # LMCache docs: use_odirect for disks that support it; disk_io_threads left at its default (4).
        d["extra_config"] = {"use_odirect": True}
        return d

    def is_mine(self, name, backend):
        return type(backend).__name__ == "LocalDiskBackend"


class FSConnectorReader(LMCacheReader):
    name = "fs_connector"

    def lmcache_config(self):
        d = _base_config(self.cfg)
        d["remote_storage_plugins"] = ["fs"]
        d["remote_serde"] = "naive"
        d["extra_config"] = {
            "remote_storage_plugin.fs.base_path": self.dir,
            # O_DIRECT (the connector's fastest documented mode) needs save_chunk_meta off.
            "fs_connector_use_odirect": True,
            "save_chunk_meta": False,
        }
        return d

    def is_mine(self, name, backend):
        return type(backend).__name__ == "RemoteBackend"

    def cleanup(self, keys):
        super().cleanup(keys)
        for de in os.scandir(self.dir):
            if de.is_file():
                os.unlink(de.path)


class RustRawBlockReader(LMCacheReader):
    name = "rust_raw_block"

    def open(self, stack):
        try:
            import lmcache_rust_raw_block_io  # noqa: F401
        except Exception as e:
            raise Skip(f"lmcache-rust-raw-block-io not importable ({e}); pip install lmcache-rust-raw-block-io")
        super().open(stack)

    def lmcache_config(self):
        d = _base_config(self.cfg)
        dev = os.path.join(self.dir, "raw.img")
        cap = 3 * self.cfg.total_bytes + 256 * MIB
        with open(dev, "wb") as f:
            f.truncate(cap)
        p = "storage_plugin.rust_raw_block."
        d["storage_plugins"] = ["rust_raw_block"]
        d["extra_config"] = {
            p + "module_path": "lmcache.v1.storage_backend.plugins.rust_raw_block_backend",
            p + "class_name": "RustRawBlockBackend",
            "rust_raw_block.device_path": dev,
            "rust_raw_block.capacity_bytes": cap,
            "rust_raw_block.use_odirect": True,
            "rust_raw_block.io_engine": "io_uring",
            "rust_raw_block.meta_total_bytes": 64 * MIB,
        }
        return d

    def is_mine(self, name, backend):
        return type(backend).__name__ == "RustRawBlockBackend"


class FioReader(Reader):
    """fio io_uring O_DIRECT on one file of the same total bytes, request
    size = min(split_bytes, chunk), iodepth = queue_depth."""

    name = "fio"

    def open(self, stack):
        if shutil.which("fio") is None:
            raise Skip("fio not found (apt-get install fio)")
        os.makedirs(self.dir, exist_ok=True)
        self.file = os.path.join(self.dir, "fio.dat")
        self.bs = min(self.cfg.split_bytes, self.cfg.geo.chunk_bytes)
        self.size = self.cfg.total_bytes // self.bs * self.bs
        stack.callback(lambda: os.path.exists(self.file) and os.unlink(self.file))

    def _fio(self, rw: str, bs: int, qd: int, size: int) -> dict:
        cmd = ["fio", "--name=fxbench", f"--filename={self.file}", f"--rw={rw}", f"--bs={bs}",
               f"--iodepth={qd}", "--ioengine=io_uring", "--direct=1", f"--size={size}",
               "--numjobs=1", "--output-format=json", "--invalidate=1"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"fio failed: {r.stderr.strip()[-400:]}")
        txt = r.stdout[r.stdout.index("{"):]
        return json.loads(txt)["jobs"][0]

    def run_rep(self, rep: int) -> dict:
        if os.path.exists(self.file):
            os.unlink(self.file)
        t0 = time.perf_counter()
        wj = self._fio("write", self.bs, self.cfg.queue_depth, self.size)
        store_s = time.perf_counter() - t0
        if self.cfg.cold:
            from ..testing.loopfs import drop_caches

            drop_caches()
        c0 = children_cpu_seconds()
        rj = self._fio("read", self.bs, self.cfg.queue_depth, self.size)
        cpu = children_cpu_seconds() - c0
        gb = rj["read"]["io_bytes"] / GB
        return {
            "rep": rep,
            "store_gbps": wj["write"]["bw_bytes"] / GB,
            "store_wall_gbps": self.size / GB / store_s,
            "tier_read_gbps": rj["read"]["bw_bytes"] / GB,
            "retrieve_gbps": None,
            # whole fio process (start-up, buffer setup included) ...
            "cpu_s_per_gb": cpu / gb if gb else None,
            # ... and fio's own account of its read job, the figure comparable to a tier read
            "tier_cpu_s_per_gb": (rj["usr_cpu"] + rj["sys_cpu"]) / 100 * rj["read"]["runtime"] / 1e3 / gb
            if gb else None,
            "tier_bytes": rj["read"]["io_bytes"],
            "ok": rj["read"]["io_bytes"] == self.size,
        }

    def latency(self, conc: int) -> Optional[dict]:
        # One request = up to 4 chunks, read at request size bs: approximated by
        # fio's completion latency of chunk-sized reads at iodepth=conc.
        if self.cfg.cold:
            from ..testing.loopfs import drop_caches

            drop_caches()
        if not os.path.exists(self.file):
            self._fio("write", self.bs, self.cfg.queue_depth, self.size)
        bs = self.cfg.geo.chunk_bytes // 4096 * 4096
        rj = self._fio("read", bs, conc, self.size // bs * bs)
        pct = rj["read"]["clat_ns"].get("percentile", {})
        return {"requests": rj["read"]["total_ios"], "chunks_per_request": 1,
                "p50_ms": pct.get("50.000000", 0) / 1e6, "p99_ms": pct.get("99.000000", 0) / 1e6}


READER_CLASSES = {c.name: c for c in (FxReader, FxThreadsReader, FxNoVerifyReader, LocalDiskReader, FSConnectorReader,
                                      RustRawBlockReader, FioReader)}


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
        line = (f"[{'#' * k}{'.' * (width - k)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.t0:5.0f}s  {what}")
        sys.stderr.write(("\r" + line.ljust(100)) if self.tty else line + "\n")
        sys.stderr.flush()

    def end(self):
        if self.tty and not self.quiet:
            sys.stderr.write("\n")


def machine_info(path: str) -> dict:
    info = {"kernel": platform.release(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    try:
        r = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--target", path], capture_output=True,
                           text=True)
        info["filesystem"] = r.stdout.strip()
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
        from .. import _fxio

        info["io_uring"] = _fxio.io_uring_status()
    except Exception:
        pass
    return info


def run_bench(cfg: BenchConfig, readers: list[str], quiet: bool = False) -> dict:
    from .. import __version__
    from ..testing.loopfs import drop_caches

    if cfg.cold and not drop_caches():
        cfg.cold = False
    w = Workload(cfg.geo, cfg.n_chunks)
    results: dict = {
        "version": __version__,
        "cold": cfg.cold,
        "cache_note": "page cache dropped before every read (cold)" if cfg.cold else
        "page cache could NOT be dropped (not root): results are WARM",
        "config": {
            "path": cfg.path, "geometry": asdict(cfg.geo), "chunk_bytes": cfg.geo.chunk_bytes,
            "bytes_per_token": cfg.geo.bytes_per_token, "n_chunks": cfg.n_chunks,
            "total_bytes": cfg.total_bytes, "reps": cfg.reps, "queue_depth": cfg.queue_depth,
            "split_bytes": cfg.split_bytes,
        },
        "machine": machine_info(cfg.path),
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
            except Skip as e:
                entry.update(available=False, skip_reason=str(e))
            except Exception as e:  # a peer that fails to start is reported, not fatal
                entry.update(available=False, skip_reason=f"{type(e).__name__}: {e}")
        lat_steps = len(live) * len(cfg.concurrency) if cfg.latency else 0
        prog = Progress(cfg.reps * len(live) + lat_steps, quiet)
        for rep in range(cfg.reps):
            for r in live:  # interleaved: A B C A B C ...
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
                for r in live:
                    try:
                        lat = r.latency(conc)
                    except Exception as e:
                        lat = {"error": f"{type(e).__name__}: {e}"}
                    results["readers"][r.name].setdefault("latency", {})[str(conc)] = lat
                    prog.step(f"{r.name} latency @{conc}")
        prog.end()
    fio = results["readers"].get("fio", {})
    fio_med = summarize(fio.get("reps", [])) if fio.get("available") else {}
    for name, e in results["readers"].items():
        if not e.get("available"):
            continue
        e["median"] = summarize(e["reps"])
        e["all_ok"] = all(r.get("ok") for r in e["reps"])
        e["ratio_to_fio"] = ratio(e["median"]["tier_read_gbps"], fio_med.get("tier_read_gbps"))
        e["cpu_ratio_to_fio"] = ratio(e["median"]["tier_cpu_s_per_gb"], fio_med.get("tier_cpu_s_per_gb"))
    return results


# ------------------------------------------------------------------ tuning sweep (store level)


def run_sweep(path: str, geo: Geometry, n_chunks: int, reps: int, qds, splits, cold: bool,
              quiet: bool = False) -> dict:
    """GB/s of lmcache-fx's store read path (no LMCache engine) against
    queue_depth (at split 1 MiB) and split_bytes (at queue_depth 32), into a
    huge-page, registered destination like the plugin's pool."""
    from .. import _fxio
    from ..core.chunkfile import ChunkMeta
    from ..testing.loopfs import drop_caches
    from ..core.options import FxOptions
    from ..core.store import ChunkStore

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
    for (what, val, qd, sb), rep in order:
        eng = _fxio.Engine("io_uring", qd, sb)
        eng.register_buffer(dst.address, n_chunks * cb)
        s = ChunkStore(FxOptions(path=d, io_engine="io_uring", queue_depth=qd, split_bytes=sb,
                                 max_capacity_gb=1e6), engine=eng)
        slot = iter(range(n_chunks))
        if cold:
            drop_caches()
        c0, t0 = cpu_seconds(), time.perf_counter()
        out = s.read(keys, lambda m: (lambda i: (i, dst.address + i * cb, cb))(next(slot)), lambda h: None)
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
        return [{"value": v, "gbps": median([x["gbps"] for x in raw[f"{what}={v}"]]),
                 "cpu_s_per_gb": median([x["cpu_s_per_gb"] for x in raw[f"{what}={v}"]])} for v in vals]

    return {"chunk_bytes": cb, "n_chunks": n_chunks, "reps": reps, "cold": cold,
            "queue_depth": curve("queue_depth", qds), "split_bytes": curve("split_bytes", splits)}


# ------------------------------------------------------------------ output


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def format_table(results: dict) -> str:
    rows = [("reader", "tier GB/s", "retrieve GB/s", "store GB/s", "tier CPU s/GB", "retrieve CPU s/GB",
             "vs fio", "ok")]
    for name, e in results["readers"].items():
        if not e.get("available"):
            rows.append((e["label"], "skipped: " + e.get("skip_reason", "")[:70], "", "", "", "", "", ""))
            continue
        m = e["median"]
        rows.append((e["label"], _f(m["tier_read_gbps"]), _f(m["retrieve_gbps"]), _f(m["store_gbps"]),
                     _f(m["tier_cpu_s_per_gb"], "{:.3f}"), _f(m["cpu_s_per_gb"], "{:.3f}"),
                     _f(e.get("ratio_to_fio"), "{:.2f}x"),
                     "yes" if e.get("all_ok") else "NO"))
    widths = [max(len(r[i]) for r in rows if not r[1].startswith("skipped") or i == 0) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        if r[1].startswith("skipped"):
            lines.append(f"{r[0].ljust(widths[0])}  {r[1]}")
        else:
            lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    lines.insert(1, "-" * len(lines[0]))
    c = results["config"]
    head = (f"{'COLD' if results['cold'] else 'WARM'}: {results['cache_note']}\n"
            f"{c['n_chunks']} chunks x {c['chunk_bytes'] / MIB:.2f} MiB = {c['total_bytes'] / GB:.2f} GB, "
            f"medians of {c['reps']} reps, queue_depth {c['queue_depth']}, split {c['split_bytes'] // 1024} KiB")
    out = head + "\n" + "\n".join(lines)
    lat = [(e["label"], e["latency"]) for e in results["readers"].values() if e.get("latency")]
    if lat:
        concs = sorted({int(k) for _, L in lat for k in L})
        out += "\n\nlatency per request, p50 / p99 ms, by concurrent requests\n"
        out += "reader".ljust(30) + "".join(f"{c:>18}" for c in concs) + "\n"
        for label, L in lat:
            cells = []
            for cc in concs:
                v = L.get(str(cc)) or {}
                cells.append(f"{_f(v.get('p50_ms'), '{:.1f}')} / {_f(v.get('p99_ms'), '{:.1f}')}".rjust(18))
            out += label.ljust(30) + "".join(cells) + "\n"
    return out


def write_png(results: dict, path: str) -> Optional[str]:
    """Grouped bars per reader (tier read, engine retrieve, store GB/s), fio's
    cold read drawn across. Returns None, or why no chart was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"matplotlib not available ({e}); pip install matplotlib"
    names = [n for n, e in results["readers"].items() if e.get("available") and n != "fio"]
    labels = [results["readers"][n]["label"].replace("LMCache ", "LMCache\n").replace(" (", "\n(") for n in names]
    series = [("tier_read_gbps", "cold tier read" if results["cold"] else "warm tier read"),
              ("retrieve_gbps", "engine retrieve"), ("store_gbps", "store")]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.26
    for i, (m, lab) in enumerate(series):
        vals = [results["readers"][n]["median"][m] or 0 for n in names]
        bars = ax.bar([x + (i - 1) * width for x in range(len(names))], vals, width, label=lab)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    fio = results["readers"].get("fio", {})
    if fio.get("available") and fio["median"]["tier_read_gbps"]:
        v = fio["median"]["tier_read_gbps"]
        ax.axhline(v, color="black", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, v, f" fio read {v:.2f} GB/s", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("GB/s (median)")
    c = results["config"]
    ax.set_title(f"{'cold' if results['cold'] else 'WARM (page cache not dropped)'}: "
                 f"{c['n_chunks']} x {c['chunk_bytes'] / MIB:.2f} MiB chunks, {results['machine'].get('filesystem', '')}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ------------------------------------------------------------------ command line


def add_arguments(p: argparse.ArgumentParser, command: str = "bench") -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="model KV geometry per rank (default qwen2.5-32b)")
    g = p.add_argument_group("custom geometry (overrides the preset)")
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int, dest="kv_heads")
    g.add_argument("--head-dim", type=int, dest="head_dim")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--mla", action="store_true", help="one latent per layer (kv_size 1)")
    g.add_argument("--chunk", type=int, help="tokens per chunk (LMCache chunk_size)")
    p.add_argument("--total-gb", type=float, default=0.25, help="bytes per rep (default 0.25 GB)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per reader (default 3)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--path", help="directory on the filesystem to measure")
    where.add_argument("--mkfs-loop", type=parse_size, metavar="SIZE",
                       help="build XFS on a RAM-backed loop device of SIZE (root), remove it afterwards")
    p.add_argument("--readers", default=",".join(ALL_READERS),
                   help=f"comma-separated subset of {','.join(ALL_READERS)}")
    p.add_argument("--queue-depth", type=int, default=32, help="fx queue_depth and fio iodepth")
    p.add_argument("--split-bytes", type=parse_size, default=MIB, help="fx split_bytes and fio bs")
    p.add_argument("--latency", action="store_true", help="also p50/p99 at --concurrency requests in flight")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--sweep", action="store_true", help="also sweep fx queue_depth and split_bytes")
    p.add_argument("--sweep-qd", default="1,2,4,8,16,32,64")
    p.add_argument("--sweep-split", default="128K,256K,512K,1M,2M,4M,8M")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum of what landed")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--png", metavar="FILE")
    p.add_argument("--quiet", action="store_true")


def check_args(p: argparse.ArgumentParser, args) -> list[str]:
    readers = [r.strip() for r in args.readers.split(",") if r.strip()]
    bad = [r for r in readers if r not in READER_CLASSES]
    if bad:
        p.error(f"unknown reader(s) {', '.join(bad)}; choose from {', '.join(ALL_READERS)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.total_gb <= 0:
        p.error("--total-gb must be > 0")
    if args.split_bytes % 4096:
        p.error("--split-bytes must be a multiple of 4096")
    if args.mkfs_loop is None and args.path is None:
        p.error("give --path DIR (a directory on the filesystem to measure) or --mkfs-loop SIZE (root)")
    return readers


def _ints(s: str, conv=int) -> list:
    return [conv(x) for x in s.split(",") if x.strip()]


def run(args, parser: Optional[argparse.ArgumentParser] = None) -> int:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache would post usage reports otherwise
    # LMCache's INFO lines would bury the table; set here, not at import, so
    # importing this module changes nothing for other code in the process.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import logging

    parser = parser or build_parser()
    readers = check_args(parser, args)
    geo = geometry_from_args(args)
    n_chunks = plan_chunks(geo, int(args.total_gb * GB))
    with ExitStack() as stack:
        if args.mkfs_loop:
            from ..testing.loopfs import why_not_available, xfs_loop

            why = why_not_available()
            if why:
                parser.error(f"--mkfs-loop: {why}")
            base = stack.enter_context(xfs_loop(args.mkfs_loop))
            fs = f"XFS on a {args.mkfs_loop / (1 << 30):.1f} GiB RAM-backed loop device"
        else:
            base, fs = args.path, None
        path = os.path.join(base, f"lmcache-fx-bench-{os.getpid()}")
        os.makedirs(path, exist_ok=True)
        stack.callback(shutil.rmtree, path, True)
        if not args.quiet:
            sys.stderr.write(f"bench: {n_chunks} chunks of {geo.chunk_bytes / MIB:.2f} MiB under {path}\n")
        logging.getLogger("lmcache").setLevel(logging.WARNING)
        cfg = BenchConfig(path=path, geo=geo, n_chunks=n_chunks, reps=args.reps, queue_depth=args.queue_depth,
                          split_bytes=args.split_bytes, cold=not args.warm, verify=not args.no_verify,
                          latency=args.latency, concurrency=tuple(_ints(args.concurrency)))
        results = run_bench(cfg, readers, quiet=args.quiet)
        if fs:
            results["machine"]["filesystem"] = fs
        results["command"] = "lmcache-fx bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                                            else sys.argv[1:])
        if args.sweep:
            results["sweep"] = run_sweep(path, geo, n_chunks, args.reps, _ints(args.sweep_qd),
                                         _ints(args.sweep_split, parse_size), results["cold"], args.quiet)
    print(format_table(results))
    if "sweep" in results:
        print(format_sweep(results["sweep"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.png:
        why = write_png(results, args.png)
        if why:
            sys.stderr.write(f"no chart: {why}\n")
    bad = [n for n, e in results["readers"].items() if e.get("available") and not e.get("all_ok")]
    if bad:
        sys.stderr.write(f"bench: readers with failed or unverified reps: {', '.join(bad)}\n")
        return 1
    return 0


def format_sweep(s: dict) -> str:
    out = [f"\nfx tuning (store level, {s['n_chunks']} x {s['chunk_bytes'] / MIB:.2f} MiB, "
           f"{'cold' if s['cold'] else 'warm'})"]
    out.append("queue_depth (split 1 MiB): " + ", ".join(
        f"{p['value']}: {_f(p['gbps'])} GB/s {_f(p['cpu_s_per_gb'], '{:.3f}')} CPU-s/GB" for p in s["queue_depth"]))
    out.append("split_bytes (queue_depth 32): " + ", ".join(
        f"{p['value'] // 1024}K: {_f(p['gbps'])} GB/s {_f(p['cpu_s_per_gb'], '{:.3f}')} CPU-s/GB"
        for p in s["split_bytes"]))
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmcache-fx bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def main(argv=None) -> int:
    """`python -m lmcache_fx.tools.bench` is `lmcache-fx bench`."""
    from .cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
