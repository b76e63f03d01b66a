"""The readers: lmcache-fx and LMCache's own tiers driven through a real
LMCacheEngine on CPU (store, wait, drop the page cache, retrieve, check),
and fio as the device's limit. The MP-mode L2 adapters (fs_native, fx-l2,
raw_block) are in l2.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Callable, Optional

from ..models import GB, MIB, Geometry
from .workload import (
    BenchConfig,
    CpuSpan,
    Skip,
    Workload,
    children_cpu_seconds,
    cpu_seconds,
    crc_of,
    latency_figures,
    latency_requests,
    latency_warmup_requests,
    named_threads_runq_wait_s,
    runq_wait_since,
    thread_runq_wait_s,
    warmup_figures,
    zero,
)


def _die_with_parent() -> None:
    """In fio's child before its exec: killed with the bench, however the
    bench ends. A second Ctrl-C landing in subprocess.run's own kill of the
    child, or a SIGKILL, left fio running under init, writing into the
    directory the bench then removes."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass


# ------------------------------------------------------------------ LMCache driving


def _connector_class():
    from ...integration.connector import ChunkwiseConnector

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

    from ...testing.cpu_engine import engine_on_cpu

    cfg = LMCacheEngineConfig.from_dict(cfg_dict)
    cfg.validate()
    with engine_on_cpu(
        cfg,
        _connector_class()(geo),
        getattr(torch, geo.dtype),
        geo.kv_shape(),
        geo.mla,
        geo.chunk,
        model,
        prefix="fxbench",
    ) as engine:
        yield engine


class TierMeter:
    """Wraps a backend's blocking get calls and the lookups LMCache makes
    before them (retrieve asks the tier which chunks it holds, then gets
    them): wall time, CPU and bytes returned. The lookup is the tier's work
    too: fx stats its chunk files there, cold after the page cache drop,
    where a tier that looks up in memory pays the same path walk inside its
    get; rounds up to b886275 timed the gets alone, for every reader."""

    def __init__(self, backend):
        self.backend = backend
        self.seconds = 0.0
        self.cpu = 0.0
        self.nbytes = 0
        self.calls = 0
        self._depth = threading.local()  # inside a wrapped call on this thread
        for name in ("batched_get_blocking", "get_blocking", "batched_contains", "contains"):
            orig = getattr(backend, name, None)
            if orig is not None:
                setattr(backend, name, self._wrap(orig, batched=name.startswith("batched"), get="_get" in name))

    def _wrap(self, fn, batched, get):
        def timed(*a, **k):
            # A wrapped call inside another (LMCache's default batched_contains loops over contains, which
            # LocalDisk, RustRawBlock and FSConnector use) is inside the outer one's span: counted once.
            if getattr(self._depth, "n", 0):
                return fn(*a, **k)
            self._depth.n = 1
            c, t = cpu_seconds(), time.perf_counter()
            try:
                out = fn(*a, **k)
            finally:
                self._depth.n = 0
            self.seconds += time.perf_counter() - t
            self.cpu += cpu_seconds() - c
            if get:
                self.calls += 1
                for o in out if batched else [out]:
                    if o is not None:
                        self.nbytes += o.get_size()
            return out

        return timed

    def reset(self):
        self.seconds, self.cpu, self.nbytes, self.calls = 0.0, 0.0, 0, 0


class Reader:
    name = ""
    label = ""
    # True: the reader spreads its data over every device of --devices N
    # (fx's path list, fio's one job per device); False: it takes one path
    # and runs on the first device, as it would be deployed.
    stripes = False
    spread_words = "striped over"  # how the label says it is spread over N devices

    def __init__(self, cfg: BenchConfig, workload: Workload):
        self.cfg, self.w = cfg, workload
        self.dir = os.path.join(cfg.path, self.name)
        # one directory per device when this reader stripes, else [self.dir]
        self.dirs = [os.path.join(p, self.name) for p in cfg.stripe] if self.stripes and cfg.stripe else [self.dir]

    def make_dirs(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d, exist_ok=True)

    def files_per_device(self) -> list[int]:
        """Regular files under each of self.dirs: where the chunks went."""
        out = []
        for d in self.dirs:
            n = 0
            for _root, _dirs, files in os.walk(d):
                n += len(files)
            out.append(n)
        return out

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

    def wait_stored(self, keys, timeout=120.0) -> float:
        """Waits until every chunk is written and on the tier; returns when
        (perf_counter) the last write was seen done. A tier's own lookup of
        each chunk (a stat through FSConnector's event loop: 5-9 % of its
        store) runs after that time, as does fx's: the store figure is the
        writes'. A chunk not found once its put task is done is waited for,
        and the time taken then."""
        end = time.monotonic() + timeout
        if hasattr(self.backend, "flush"):
            self.backend.flush(timeout)
        for k in keys:
            while self.backend.exists_in_put_tasks(k):
                if time.monotonic() > end:
                    raise RuntimeError(f"{self.name}: chunks not written after {timeout:.0f} s")
                time.sleep(0.0002)
        done = time.perf_counter()
        for k in keys:
            while not self.backend.contains(k):
                if time.monotonic() > end:
                    raise RuntimeError(f"{self.name}: chunks not on the tier after {timeout:.0f} s")
                time.sleep(0.0002)
                done = time.perf_counter()
        return done

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
        store_s = self.wait_stored(keys) - t0
        spread = self.files_per_device() if len(self.dirs) > 1 else None
        if cfg.cold:
            from ...testing.loopfs import drop_caches

            drop_caches()
        # retrieve
        zero(w.dst)
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
        if spread is not None:
            out["files_per_device"] = spread
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
        out["tier_us_per_chunk"] = self.meter.seconds / w.n_chunks * 1e6 if ok else None
        out["store_us_per_chunk"] = store_s / w.n_chunks * 1e6
        self.cleanup(keys)
        return out

    # -------------------------------------------------------------- latency
    def latency(self, conc: int) -> Optional[dict]:
        """p50/p99 of one-chunk requests with `conc` in flight over the
        stored chunks (cycled, latency_requests of them; O_DIRECT tiers
        re-read the device, others after a page-cache drop only the first
        time): `conc` threads calling the backend's batched_get_blocking([key]),
        or with cfg.latency_awaited `conc` coroutines on LMCache's event loop,
        each awaiting batched_async_contains then batched_get_non_blocking,
        timed together (a tier whose lookup is slow has fewer loads in flight)."""
        w = self.w
        tokens = w.tokens(10_000 + conc)
        keys = self.keys(tokens)
        self.engine.store(tokens, kvcaches=w.src, slot_mapping=w.slot_mapping)
        self.wait_stored(keys)  # LMCache's pool holds a store until written: room for one workload
        # The untimed warm-up's chunks: of their own, so the timed ones stay cold
        n_warm = latency_warmup_requests(self.cfg.latency_warmup, conc)
        n_wkeys = min(n_warm, len(keys))
        warm_tokens = w.tokens(20_000 + conc)[: n_wkeys * self.cfg.geo.chunk]
        warm_keys = self.keys(warm_tokens) if n_wkeys else []
        if warm_keys:
            self.engine.store(warm_tokens, kvcaches=w.src, slot_mapping=w.slot_mapping[: len(warm_tokens)])
            self.wait_stored(warm_keys)
        if self.cfg.cold:
            from ...testing.loopfs import drop_caches

            drop_caches()
        warm_lat: list[float] = []
        if warm_keys:
            self._latency_run([[warm_keys[i % n_wkeys]] for i in range(n_warm)], conc, warm_lat, [], "fxwarm")
        n_req = latency_requests(len(keys), conc)
        reqs = [[keys[i % len(keys)]] for i in range(n_req)]
        lat: list[float] = []
        errors: list = []
        span, cpu = CpuSpan(), {}
        # fx's awaited reads run on its runner threads; no other reader has any
        runners0 = named_threads_runq_wait_s("fx-runner") if self.name.startswith("fx") else None
        loop = self._latency_run(reqs, conc, lat, errors)
        if loop is not None:
            loop_s, wait_s = loop
            cpu["loop_cpu_us_per_request"] = round(loop_s / max(len(reqs), 1) * 1e6, 1)
            if wait_s is not None:
                cpu["loop_wait_us_per_request"] = round(wait_s / max(len(reqs), 1) * 1e6, 1)
        cpu.update(span.figures(len(reqs)))
        runner_wait = None if runners0 is None else runq_wait_since(runners0, "fx-runner")
        if runner_wait is not None:  # how long fx's runner threads waited for a CPU
            cpu["runner_wait_us_per_request"] = round(runner_wait / max(len(reqs), 1) * 1e6, 1)
        self.cleanup(keys + warm_keys)
        return {
            "requests": len(lat),
            "chunks_per_request": 1,
            "misses": len(errors),
            "path": "awaited" if self.cfg.latency_awaited else "blocking",
            **latency_figures(lat),
            **cpu,
            **warmup_figures(warm_lat),
        }

    def _latency_run(self, reqs: list, conc: int, lat: list, errors: list, tag: str = "fxbench") -> Optional[tuple]:
        """The requests by the case's path; awaited, the loop's CPU and wait (_latency_awaited)."""
        if self.cfg.latency_awaited:
            return self._latency_awaited(reqs, conc, lat, errors, tag)
        self._latency_threads(reqs, conc, lat, errors)
        return None

    def _latency_threads(self, reqs: list, conc: int, lat: list, errors: list) -> None:
        lock = threading.Lock()
        nxt = iter(reqs)

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
                _drop(objs)
                with lock:
                    lat.append(dt)

        ths = [threading.Thread(target=worker) for _ in range(conc)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()

    def _latency_awaited(self, reqs: list, conc: int, lat: list, errors: list, tag: str) -> tuple:
        """Runs the requests on LMCache's loop; returns the loop thread's CPU
        seconds over them (its own work and the tier's on it) and the seconds
        it waited for a CPU while ready to run (None where not kept)."""
        import asyncio

        backend, nxt = self.backend, iter(enumerate(reqs))

        async def worker():
            for i, r in nxt:  # one iterator: each coroutine takes the next request
                lid = f"{tag}-{i}"
                t = time.perf_counter()
                if await backend.batched_async_contains(lid, r, True) < len(r):
                    errors.append(r)
                    continue
                objs = await backend.batched_get_non_blocking(lid, r)
                dt = time.perf_counter() - t
                if len(objs) < len(r) or any(o is None for o in objs):
                    errors.append(r)
                _drop(objs)
                lat.append(dt)

        async def main() -> tuple:
            c, w = time.thread_time(), thread_runq_wait_s()
            await asyncio.gather(*(worker() for _ in range(conc)))
            w2 = thread_runq_wait_s()
            return time.thread_time() - c, (None if w is None or w2 is None else w2 - w)

        # LMCache's own loop (its storage-manager thread), as async loading runs them: LocalDiskBackend's
        # disk worker is bound to it.
        return asyncio.run_coroutine_threadsafe(main(), self.engine.storage_manager.loop).result()


def _drop(objs) -> None:
    """Lets go of the objects a get returned: LocalDiskBackend's async get
    pins them for LMCache's retrieve to unpin; every tier's carry one reference."""
    for o in objs:
        if o is None:
            continue
        if getattr(o, "is_pinned", False):
            o.unpin()
        o.ref_count_down()


def _base_config(cfg: BenchConfig) -> dict:
    return {
        "chunk_size": cfg.geo.chunk,
        "local_cpu": False,  # every retrieve reads the tier
        "max_local_cpu_size": round(cfg.pool_gb, 3),
        "extra_config": {},
    }


class FxReader(LMCacheReader):
    name = "fx"
    label = "lmcache-fx (io_uring)"
    io_engine = "io_uring"
    stripes = True
    fx_options: dict = {}  # more of fx's options, for a variant's one difference

    def lmcache_config(self):
        d = _base_config(self.cfg)
        p = "storage_plugin.fx."
        d["storage_plugins"] = ["fx"]
        d["extra_config"] = {
            p + "module_path": "lmcache_fx.lmcache_plugin",
            p + "class_name": "FxStorageBackend",
            p + "path": ",".join(self.dirs),  # several: chunks striped over them (layout.place_roots)
            p + "io_engine": self.io_engine,
            p + "queue_depth": self.cfg.queue_depth,
            p + "split_bytes": self.cfg.split_bytes,
            p + "max_capacity_gb": max(1.0, 4 * self.cfg.total_bytes / GB),
            **{p + k: v for k, v in self.fx_options.items()},
        }
        return d

    def is_mine(self, name, backend):
        return name == "fx"

    def open(self, stack):
        self.make_dirs()
        super().open(stack)
        eng = self.backend.store.engine
        if eng.kind != self.io_engine:
            raise Skip(f"engine is {eng.kind}: {eng.fallback_reason}")


class FxThreadsReader(FxReader):
    name = "fx-threads"
    label = "lmcache-fx (threads)"
    io_engine = "threads"


class FxNoVerifyReader(FxReader):
    """fx without the CRC32C check on read: what the checksum costs."""

    name = "fx-noverify"
    label = "lmcache-fx (io_uring, verify off)"
    fx_options = {"verify": False}


class FxUnmappedReader(FxReader):
    """fx with mapped_reads off: every payload through read() and then its
    CRC32C, what mapped reads are measured against (they differ only on a
    memory filesystem: on a tmpfs with huge pages by default)."""

    name = "fx-unmapped"
    label = "lmcache-fx (io_uring, no mapped reads)"
    fx_options = {"mapped_reads": False}


class FxUnstagedReader(FxReader):
    """fx with staged_reads off: checked O_DIRECT pieces read into place and
    then summed, what staged reads are measured against (they differ only
    where staging is on: on a loop device by default)."""

    name = "fx-unstaged"
    label = "lmcache-fx (io_uring, no staged reads)"
    fx_options = {"staged_reads": False}


class FxStagedReader(FxReader):
    """fx with staged_reads true: every checked O_DIRECT read staged, small
    ones too, what auto's reads of at most 4 MiB in place are measured
    against (on a loop device, with the one-pass copy; elsewhere auto stages
    nothing and this stages everything)."""

    name = "fx-staged"
    label = "lmcache-fx (io_uring, every read staged)"
    fx_options = {"staged_reads": True}


class FxPiecesReader(FxReader):
    """fx with whole_reads_when_busy false: awaited reads keep their
    split_bytes pieces however many run beside them, what reading small
    payloads whole under load is measured against."""

    name = "fx-pieces"
    label = "lmcache-fx (io_uring, pieces when busy)"
    fx_options = {"whole_reads_when_busy": False}


class FxNice0Reader(FxReader):
    """fx with runner_nice 0: awaited reads' runner threads at the priority of
    LMCache's event loop, what the default's lower priority is measured
    against (they differ only in awaited reads on a host short of CPU)."""

    name = "fx-nice0"
    label = "lmcache-fx (io_uring, runner_nice 0)"
    fx_options = {"runner_nice": 0}


class FxUnqueuedReader(FxReader):
    """fx with awaited_concurrency 0: every awaited read at once on a runner
    of its own, as before the bound (what the default's arrival-order queue
    is measured against; they differ only with more awaited reads in flight
    than CPUs)."""

    name = "fx-unqueued"
    label = "lmcache-fx (io_uring, awaited_concurrency 0)"
    fx_options = {"awaited_concurrency": 0}


class FxOpOrderReader(FxReader):
    """fx with a read's pieces queued op by op (_fxio._set_piece_order, set
    only while this reader reads), the order before the engine queued them
    round-robin over the devices: what the interleaving is measured against
    (it matters where a read spans several devices)."""

    name = "fx-op-order"
    label = "lmcache-fx (io_uring, pieces in op order)"

    @contextmanager
    def _op_order(self):
        from lmcache_fx import _fxio

        before = _fxio._set_piece_order(True)
        try:
            yield
        finally:
            _fxio._set_piece_order(before)

    def run_rep(self, rep: int) -> dict:
        with self._op_order():
            return super().run_rep(rep)

    def latency(self, conc: int) -> Optional[dict]:
        with self._op_order():
            return super().latency(conc)


class LocalDiskReader(LMCacheReader):
    name = "local_disk"
    label = "LMCache LocalDiskBackend"

    def lmcache_config(self):
        d = _base_config(self.cfg)
        d["local_disk"] = f"file://{self.dir}/"
        # LMCache 0.5.6's LocalDiskBackend.remove() does not lower current_cache_size,
        # so every store/remove round uses up capacity for good: room for all rounds, each latency round's too.
        cfg = self.cfg
        rounds = cfg.reps + (len(cfg.concurrency) * cfg.latency_rounds if cfg.latency else 0) + 2
        d["max_local_disk_size"] = max(1.0, 2 * rounds * cfg.total_bytes / (1 << 30))
        # LMCache docs: use_odirect for disks that support it; disk_io_threads left at its default (4).
        d["extra_config"] = {"use_odirect": True}
        return d

    def is_mine(self, name, backend):
        return type(backend).__name__ == "LocalDiskBackend"


class FSConnectorReader(LMCacheReader):
    name = "fs_connector"
    label = "LMCache FSConnector"

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


def preallocated_image(path: str, size: int) -> None:
    """A raw-block image as a raw device is: every block allocated (a
    sparse file made each first write into it allocate its extent). Not on
    a memory filesystem, where there are no extents to make and allocating
    would hold the whole image in RAM from the start."""
    from ...core.medium import page_cache_fs

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, size)
        if not page_cache_fs([os.path.dirname(path)]):
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError:  # a filesystem without fallocate: sparse, as before
                pass
    finally:
        os.close(fd)


class RustRawBlockReader(LMCacheReader):
    name = "rust_raw_block"
    label = "LMCache RustRawBlockBackend"

    def open(self, stack):
        try:
            import lmcache_rust_raw_block_io  # noqa: F401
        except Exception as e:
            raise Skip(
                f"lmcache-rust-raw-block-io not importable ({e}); pip install lmcache-rust-raw-block-io"
            ) from None
        super().open(stack)

    def lmcache_config(self):
        d = _base_config(self.cfg)
        dev = os.path.join(self.dir, "raw.img")
        cap = 3 * self.cfg.total_bytes + 256 * MIB
        preallocated_image(dev, cap)
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
            # Its periodic checkpoint (every 60 s) would write into other readers' timed spans; raw_block's
            # L2 run has it off too.
            "rust_raw_block.meta_enable_periodic": False,
        }
        return d

    def is_mine(self, name, backend):
        return type(backend).__name__ == "RustRawBlockBackend"


class FioReader(Reader):
    """fio io_uring O_DIRECT on one file of the same total bytes, request
    size = min(split_bytes, chunk), iodepth = queue_depth. With --devices N:
    one job per device, each on its own device's file of total/N bytes, the
    group's aggregate bandwidth (the limit of the N devices together)."""

    name = "fio"
    label = "fio io_uring O_DIRECT"
    stripes = True
    spread_words = "1 job on each of"

    def open(self, stack):
        if shutil.which("fio") is None:
            raise Skip("fio not found (apt-get install fio)")
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        self.files = [os.path.join(d, "fio.dat") for d in self.dirs]
        self.file = self.files[0]
        self.bs = min(self.cfg.split_bytes, self.cfg.geo.chunk_bytes)
        per = self.cfg.total_bytes // len(self.files)
        self.size = max(self.bs, per // self.bs * self.bs)  # per job
        stack.callback(self._remove_files)

    def _remove_files(self):
        for f in self.files:
            if os.path.exists(f):
                os.unlink(f)

    def _fio(self, rw: str, bs: int, qd: int, size: int) -> dict:
        cmd = [
            "fio",
            f"--rw={rw}",
            f"--bs={bs}",
            f"--iodepth={qd}",
            "--ioengine=io_uring",
            "--direct=1",
            f"--size={size}",
            "--numjobs=1",
            "--output-format=json",
            "--invalidate=1",
            "--group_reporting",  # one aggregate over the jobs (one per device)
        ]
        for i, f in enumerate(self.files):
            cmd += [f"--name=fxbench{i}", f"--filename={f}"]
        r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=_die_with_parent)
        if r.returncode != 0:
            raise RuntimeError(f"fio failed: {r.stderr.strip()[-400:]}")
        txt = r.stdout[r.stdout.index("{") :]
        return json.loads(txt)["jobs"][0]

    def run_rep(self, rep: int) -> dict:
        self._remove_files()
        total = self.size * len(self.files)
        t0 = time.perf_counter()
        wj = self._fio("write", self.bs, self.cfg.queue_depth, self.size)
        store_s = time.perf_counter() - t0
        if self.cfg.cold:
            from ...testing.loopfs import drop_caches

            drop_caches()
        c0 = children_cpu_seconds()
        rj = self._fio("read", self.bs, self.cfg.queue_depth, self.size)
        cpu = children_cpu_seconds() - c0
        gb = rj["read"]["io_bytes"] / GB
        out = {
            "rep": rep,
            "store_gbps": wj["write"]["bw_bytes"] / GB,
            "store_wall_gbps": total / GB / store_s,
            "tier_read_gbps": rj["read"]["bw_bytes"] / GB,
            "retrieve_gbps": None,
            # whole fio process (start-up, buffer setup included) ...
            "cpu_s_per_gb": cpu / gb if gb else None,
            # ... and fio's own account of its read job(s), the figure comparable to a tier read
            # (with group_reporting, usr/sys_cpu are the jobs' summed CPU over the group's runtime)
            "tier_cpu_s_per_gb": (rj["usr_cpu"] + rj["sys_cpu"]) / 100 * rj["read"]["runtime"] / 1e3 / gb
            if gb
            else None,
            "tier_bytes": rj["read"]["io_bytes"],
            "ok": rj["read"]["io_bytes"] == total,
        }
        if len(self.files) > 1:
            out["jobs"] = len(self.files)
        return out

    def latency(self, conc: int) -> Optional[dict]:
        # One request = one chunk, approximated by fio's completion latency of
        # chunk-sized reads at iodepth=conc.
        if self.cfg.cold:
            from ...testing.loopfs import drop_caches

            drop_caches()
        if not all(os.path.exists(f) for f in self.files):
            self._fio("write", self.bs, self.cfg.queue_depth, self.size)
        bs = self.cfg.geo.chunk_bytes // 4096 * 4096
        rj = self._fio("read", bs, conc, self.size // bs * bs)
        pct = rj["read"]["clat_ns"].get("percentile", {})
        return {
            "requests": rj["read"]["total_ios"],
            "chunks_per_request": 1,
            "p50_ms": pct.get("50.000000", 0) / 1e6,
            "p99_ms": pct.get("99.000000", 0) / 1e6,
        }
