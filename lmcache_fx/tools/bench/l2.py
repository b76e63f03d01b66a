"""LMCache MP-mode L2 adapters as readers: LMCache's C++ filesystem adapter
`fs_native` (lmcache.lmcache_fs.LMCacheFSClient), its `raw_block` adapter on
a preallocated file, and lmcache-fx's FxL2Adapter (`fx-l2`), each built by
LMCache's own factory from the `--l2-adapter` JSON a user writes and driven
the way MP mode drives it: submit_store_task / submit_lookup_and_lock_task /
submit_load_task, completions awaited on the adapter's eventfds.

The L1 arena is one huge-page (2 MiB-aligned) buffer shared by these readers,
passed to the adapter as its L1MemoryDesc (fx registers it for fixed-buffer
reads): the first half holds the workload's chunks (store sources), the
second half is where loads land. One rep: store every chunk as one task,
wait, drop the page cache, lookup-and-lock and then load every chunk as one
task each (timed together: tier GB/s, process CPU s/GB; the lookup also on
its own), unlock, CRC32C of what landed against the source, delete. The
lookup is timed with the load as an engine-level tier's lookup is timed with
its gets: fx's lookup stats each chunk file, cold after the page cache drop,
and fs_native's goes to the disk too (each rep keeps lookup_s); rounds
before the commit that timed it so timed the load alone."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import time
from typing import Optional

from ...core.chunkfile import HEADER_SIZE
from ...core.layout import round_up
from ..models import GB, MIB
from .readers import Reader, preallocated_image
from .workload import (
    CpuSpan,
    Skip,
    cpu_seconds,
    crc_of,
    latency_figures,
    latency_requests,
    latency_warmup_requests,
    warmup_figures,
    zero,
)

BENCH_MODEL = "lmcache-fx-bench"


def l1_arena(w) -> tuple:
    """(HostBuffer, uint8 tensor over it) of 2 x the workload's bytes, made
    once per workload and shared by every L2 reader; sources filled in."""
    if getattr(w, "_l1", None) is None:
        import torch

        from ... import _fxio

        buf = _fxio.HostBuffer(2 * w.nbytes, hugepages=True)
        t = torch.frombuffer(memoryview(buf), dtype=torch.uint8)
        t[: w.nbytes].copy_(w.src.contiguous().view(-1).view(torch.uint8))
        w._l1 = (buf, t)
    return w._l1


def _wait_fd(fd: int, timeout: float) -> bool:
    from lmcache.v1.platform import consume_fd

    p = select.poll()
    p.register(fd, select.POLLIN)
    if p.poll(timeout * 1000):
        consume_fd(fd)
        return True
    return False


class L2Reader(Reader):
    spec_type = ""

    def adapter_spec(self) -> dict:
        raise NotImplementedError

    def check_available(self) -> None:
        pass

    def open(self, stack):
        try:
            from lmcache.v1.distributed.internal_api import L1MemoryDesc
            from lmcache.v1.distributed.l2_adapters import create_l2_adapter
            from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
        except Exception as e:
            raise Skip(f"this LMCache has no MP-mode L2 adapter API ({type(e).__name__}: {e})") from None
        self.check_available()
        self.make_dirs()
        buf, self.t = l1_arena(self.w)
        self.spec = self.adapter_spec()
        cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(self.spec)])).adapters[0]
        desc = L1MemoryDesc(ptr=buf.address, size=2 * self.w.nbytes, align_bytes=4096)
        self.adapter = create_l2_adapter(cfg, l1_memory_desc=desc)
        stack.callback(self.adapter.close)
        cb, n = self.cfg.geo.chunk_bytes, self.cfg.n_chunks
        self.src_objs = [self._obj(i * cb, cb) for i in range(n)]
        self.dst_objs = [self._obj((n + i) * cb, cb) for i in range(n)]
        if self.keeps_chunks and not self.store(self.keys(-1), self.src_objs):  # filled before the first rep
            raise RuntimeError(f"{self.name}: filling the store failed")

    @property
    def keeps_chunks(self) -> bool:
        """--full-store: this adapter keeps each rep's chunks, and the next
        rep's stores evict them."""
        return False

    def _obj(self, off: int, nbytes: int):
        import torch
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        meta = MemoryObjMetadata(
            shape=torch.Size([nbytes]),
            dtype=torch.uint8,
            address=off,
            phy_size=nbytes,
            fmt=MemoryFormat.KV_2LTD,
            ref_count=1,
        )
        return TensorMemoryObj(raw_data=self.t[off : off + nbytes], metadata=meta, parent_allocator=None)

    def keys(self, rep: int) -> list:
        from lmcache.v1.distributed.api import ObjectKey

        return [
            ObjectKey(
                chunk_hash=hashlib.blake2b(f"{self.name}:{rep}:{i}".encode(), digest_size=16).digest(),
                model_name=BENCH_MODEL,
                kv_rank=0,
            )
            for i in range(self.cfg.n_chunks)
        ]

    # ------------------------------------------------------------ the three calls, awaited on eventfds
    def store(self, keys, objs, timeout=300.0, per_task: int = 0) -> bool:
        """Stores keys as one task, or (per_task > 0) as tasks of that many
        keys submitted all at once; True when every task succeeded."""
        a = self.adapter
        k = per_task or len(keys) or 1
        tids = {a.submit_store_task(keys[i : i + k], objs[i : i + k]) for i in range(0, len(keys), k)}
        ok = True
        end = time.monotonic() + timeout
        while tids:
            for tid, res in a.pop_completed_store_tasks().items():
                if tid in tids:
                    tids.discard(tid)
                    ok = ok and bool(res.is_successful())
            if not tids:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: store task not done after {timeout:.0f} s")
            _wait_fd(a.get_store_event_fd(), 1.0)
        return ok

    def lookup_lock(self, keys, timeout=120.0) -> int:
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        a = self.adapter
        tid = a.submit_lookup_and_lock_task(keys, {0: MemoryLayoutDesc(shapes=[], dtypes=[])})
        end = time.monotonic() + timeout
        while True:
            bm = a.query_lookup_and_lock_result(tid)
            if bm is not None:
                return bm.popcount()
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: lookup task not done after {timeout:.0f} s")
            _wait_fd(a.get_lookup_and_lock_event_fd(), 1.0)

    def load(self, keys, objs, timeout=300.0) -> int:
        a = self.adapter
        tid = a.submit_load_task(keys, objs)
        end = time.monotonic() + timeout
        while True:
            bm = a.query_load_result(tid)
            if bm is not None:
                return bm.popcount()
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: load task not done after {timeout:.0f} s")
            _wait_fd(a.get_load_event_fd(), 1.0)

    def _drop(self, keys) -> None:
        try:
            self.adapter.delete(keys)
        except Exception:
            pass

    # ------------------------------------------------------------ one rep
    def run_rep(self, rep: int) -> dict:
        w, cfg = self.w, self.cfg
        n, nb = cfg.n_chunks, w.nbytes
        keys = self.keys(rep)
        t0 = time.perf_counter()
        stored = self.store(keys, self.src_objs, per_task=cfg.l2_store_task_chunks)
        store_s = time.perf_counter() - t0
        spread = self.files_per_device() if len(self.dirs) > 1 else None
        if cfg.cold:
            from ...testing.loopfs import drop_caches

            drop_caches()
        zero(self.t[nb:])
        c0, t0 = cpu_seconds(), time.perf_counter()
        found = self.lookup_lock(keys)
        lookup_s = time.perf_counter() - t0
        loaded = self.load(keys, self.dst_objs)
        tier_s = time.perf_counter() - t0
        cpu = cpu_seconds() - c0
        try:
            self.adapter.submit_unlock(keys)
        except Exception:
            pass
        out = {
            "rep": rep,
            "store_s": store_s,
            "store_ok": stored,
            "found": found,
            "tier_s": tier_s,
            "lookup_s": lookup_s,  # of tier_s, since the lookup is timed with the load
            "tier_bytes": loaded * cfg.geo.chunk_bytes,
            "chunks": loaded,
            "tokens": loaded * cfg.geo.chunk,
            "cpu_s": cpu,
        }
        if spread is not None:
            out["files_per_device"] = spread
        if cfg.verify:
            out["crc_ok"] = crc_of(self.t[nb:]) == w.src_crc
        ok = stored and loaded == n and out.get("crc_ok", True)
        out["ok"] = ok
        gb = nb / GB
        out["store_gbps"] = gb / store_s if stored else None
        out["store_us_per_chunk"] = store_s / n * 1e6 if stored else None
        out["retrieve_gbps"] = None  # no LMCacheEngine in front of an L2 adapter here
        out["tier_read_gbps"] = gb / tier_s if ok else None
        out["tier_us_per_chunk"] = tier_s / n * 1e6 if ok else None
        out["cpu_s_per_gb"] = None
        out["tier_cpu_s_per_gb"] = cpu / gb if ok else None
        if not self.keeps_chunks:
            self._drop(keys)
        else:  # what the store did with the chunks it evicted (fx-l2's report_status)
            st = self.adapter.report_status()
            out["evictions_total"], out["recycled_total"] = st.get("evictions"), st.get("recycled")
        return out

    # ------------------------------------------------------------ stores while loads run
    def mixed_rep(self, rep: int) -> dict:
        """Stores the workload's chunks under one set of keys, drops the page
        cache, then submits a store of as many new chunks and the load of the
        first set at the same moment (or the load cfg.mixed_store_lead_ms
        later, so that it starts beside running writes); the store timed from
        its submission, the load from its own, each to its completion. The
        loaded bytes are checked."""
        w, cfg = self.w, self.cfg
        n, nb = cfg.n_chunks, w.nbytes
        old, new = self.keys(20_000 + rep), self.keys(30_000 + rep)
        if not self.store(old, self.src_objs):
            raise RuntimeError(f"{self.name}: store failed")
        if cfg.cold:
            from ...testing.loopfs import drop_caches

            drop_caches()
        zero(self.t[nb:])
        self.lookup_lock(old)
        a = self.adapter
        t0 = time.perf_counter()
        st = a.submit_store_task(new, self.src_objs)
        if cfg.mixed_store_lead_ms:
            time.sleep(max(0.0, t0 + cfg.mixed_store_lead_ms / 1e3 - time.perf_counter()))
        tl = time.perf_counter()
        lt = a.submit_load_task(old, self.dst_objs)
        store_s = load_s = None
        stored, loaded = False, 0
        end = time.monotonic() + 300
        while store_s is None or load_s is None:
            if store_s is None:
                done = a.pop_completed_store_tasks()
                if st in done:
                    store_s, stored = time.perf_counter() - t0, bool(done[st].is_successful())
            if load_s is None:
                bm = a.query_load_result(lt)
                if bm is not None:
                    load_s, loaded = time.perf_counter() - tl, bm.popcount()
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: mixed rep did not finish")
            if store_s is None or load_s is None:
                _wait_fd(a.get_load_event_fd() if load_s is None else a.get_store_event_fd(), 0.002)
        try:
            a.submit_unlock(old)
        except Exception:
            pass
        crc_ok = crc_of(self.t[nb:]) == w.src_crc if cfg.verify else True
        self._drop(old)
        self._drop(new)
        ok = stored and loaded == n and crc_ok
        gb = nb / GB
        return {
            "rep": rep,
            "ok": ok,
            "crc_ok": crc_ok,
            "load_s": load_s,
            "store_s": store_s,
            "load_gbps": gb / load_s if ok else None,
            "store_gbps": gb / store_s if ok else None,
        }

    # ------------------------------------------------------------ latency
    def latency(self, conc: int) -> Optional[dict]:
        """p50/p99 of one-chunk load tasks with `conc` in flight, submitted
        and collected by one thread as MP mode's prefetch controller does."""
        keys = self.keys(10_000 + conc)
        # The untimed warm-up's chunks: of their own, so the timed ones stay cold (workload.LATENCY_WARMUP)
        n_warm = latency_warmup_requests(self.cfg.latency_warmup, conc)
        warm = self.keys(20_000 + conc)[: min(n_warm, len(keys))]
        if not self.store(keys, self.src_objs) or not self.store(warm, self.src_objs[: len(warm)]):
            raise RuntimeError(f"{self.name}: store failed")
        if self.cfg.cold:
            from ...testing.loopfs import drop_caches

            drop_caches()
        self.lookup_lock(keys + warm)
        warm_lat = self._loads(warm, n_warm, conc)[0] if warm else []
        n_req = latency_requests(len(keys), conc)
        span = CpuSpan()
        lat, misses = self._loads(keys, n_req, conc)
        cpu = span.figures(n_req)
        try:
            self.adapter.submit_unlock(keys + warm)
        except Exception:
            pass
        self._drop(keys + warm)
        return {
            "requests": len(lat),
            "chunks_per_request": 1,
            "misses": misses,
            **latency_figures(lat),
            **cpu,
            **warmup_figures(warm_lat),
        }

    def _loads(self, keys: list, n_req: int, conc: int) -> tuple[list, int]:
        """n_req one-chunk load tasks over keys (cycled), `conc` in flight;
        their latencies (s, in completion order) and misses."""
        a, fd, n = self.adapter, self.adapter.get_load_event_fd(), len(keys)
        pending: dict = {}
        lat: list[float] = []
        misses = 0
        nxt = 0
        end = time.monotonic() + 600
        while len(lat) < n_req:
            while nxt < n_req and len(pending) < conc:
                i = nxt % n
                pending[a.submit_load_task([keys[i]], [self.dst_objs[i]])] = time.perf_counter()
                nxt += 1
            _wait_fd(fd, 1.0)
            for tid in list(pending):
                bm = a.query_load_result(tid)
                if bm is not None:
                    lat.append(time.perf_counter() - pending.pop(tid))
                    misses += 1 - bm.popcount()
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: latency run did not finish")
        return lat, misses


class FsNativeReader(L2Reader):
    """LMCache's C++ filesystem L2 adapter, configured as its docs advise
    for speed: use_odirect on, num_workers (the bench's --fs-native-workers)."""

    name = "fs_native"
    label = "LMCache fs_native (L2)"

    def check_available(self):
        try:
            import lmcache.lmcache_fs  # noqa: F401
        except Exception as e:
            raise Skip(f"lmcache.lmcache_fs not importable ({type(e).__name__}: {e})") from None

    def adapter_spec(self):
        self.label = f"LMCache fs_native (L2, {self.cfg.fs_native_workers} workers)"
        return {
            "type": "fs_native",
            "base_path": self.dir,
            "num_workers": self.cfg.fs_native_workers,
            "use_odirect": True,
        }

    def run_rep(self, rep):
        out = super().run_rep(rep)
        for de in os.scandir(self.dir):  # delete is asynchronous there: make sure nothing accumulates
            if de.is_file():
                try:
                    os.unlink(de.path)
                except OSError:
                    pass
        return out


class FxL2Reader(L2Reader):
    """lmcache-fx's FxL2Adapter as LMCache's plugin adapter type, defaults
    (io_uring, verify on) but for queue_depth / split_bytes from the command line."""

    name = "fx-l2"
    label = "lmcache-fx FxL2Adapter (L2)"
    stripes = True
    fx_options: dict = {}  # adapter options an A/B half sets beside the defaults

    @property
    def keeps_chunks(self) -> bool:
        return self.cfg.full_store

    def adapter_spec(self):
        cap = max(1.0, 4 * self.cfg.total_bytes / GB)
        if self.cfg.full_store:
            # Room for one rep's chunks as a write reserves them (payload rounded up to 4 KiB) and less
            # than one more: each store evicts one, and a rep never evicts its own.
            self.label = "lmcache-fx FxL2Adapter (L2, full: each store evicts)"
            cap = (self.cfg.n_chunks * (HEADER_SIZE + round_up(self.cfg.geo.chunk_bytes, 4096)) + 4096) / (1 << 30)
        return {
            "type": "plugin",
            "module_path": "lmcache_fx.l2_adapter",
            "class_name": "FxL2Adapter",
            "adapter_params": {
                "path": ",".join(self.dirs),  # several: chunks striped over them (layout.place_roots)
                "io_engine": "io_uring",
                "queue_depth": self.cfg.queue_depth,
                "split_bytes": self.cfg.split_bytes,
                "max_capacity_gb": cap,
                **self.fx_options,
            },
        }


class FxL2UnstagedReader(FxL2Reader):
    """FxL2Adapter with staged_reads false: checked O_DIRECT pieces read into
    place, the A/B half of staged reads at the L2 level."""

    name = "fx-l2-unstaged"
    label = "lmcache-fx FxL2Adapter (L2, no staged reads)"
    fx_options = {"staged_reads": False}


class FxL2NoVerifyReader(FxL2Reader):
    """FxL2Adapter with verify false: its CPU beside fs_native's, which
    checks nothing, at the same level (LMCache's engine allocates each
    destination for fx-noverify; the L2 bench hands both adapters theirs)."""

    name = "fx-l2-noverify"
    label = "lmcache-fx FxL2Adapter (L2, verify off)"
    fx_options = {"verify": False}


class RawBlockL2Reader(L2Reader):
    """LMCache's raw_block L2 adapter on a preallocated file on the measured
    filesystem (its docs: a raw device or a pre-sized file), O_DIRECT,
    io_engine io_uring, slots of one chunk plus its 4 KiB header."""

    name = "raw_block"
    label = "LMCache raw_block (L2)"

    def check_available(self):
        try:
            import lmcache.v1.distributed.l2_adapters.raw_block_l2_adapter  # noqa: F401
        except Exception as e:
            raise Skip(f"raw_block L2 adapter not importable ({type(e).__name__}: {e})") from None

    def adapter_spec(self):
        slot = (self.cfg.geo.chunk_bytes + 4096 + 4095) // 4096 * 4096
        meta = 64 * MIB
        n_slots = 2 * self.cfg.n_chunks + (max(self.cfg.concurrency) if self.cfg.latency else 0) + 2
        dev = os.path.join(self.dir, "raw.img")
        size = meta + n_slots * slot + 16 * MIB
        preallocated_image(dev, size)
        return {
            "type": "raw_block",
            "device_path": dev,
            "slot_bytes": slot,
            "use_odirect": True,
            "io_engine": "io_uring",
            "meta_total_bytes": meta,
            "meta_enable_periodic": False,
        }
