"""LMCache in-process storage plugin: translates LMCache's calls into store
calls, and nothing more.

    storage_plugins: ["fx"]
    extra_config:
      storage_plugin.fx.module_path: lmcache_fx.lmcache_plugin
      storage_plugin.fx.class_name: FxStorageBackend
      storage_plugin.fx.path: /mnt/nvmeof/lmcache

Reads go straight into MemoryObjs allocated from LMCache's LocalCPUBackend
(one engine batch per request); writes run on one background thread that
holds a reference to each object until its file is in place.

With `direct_to_gpu: true`, reads go instead into GPU MemoryObjs of the
plugin's own buffer (gpu.GpuChunkAllocator, as LMCache's GdsBackend does),
through the pipelined NVMe -> pinned staging -> GPU reader: the store's read
batches are driven through a gpu.GpuRouter, which sends ops into that buffer
to the pipeline and the header reads to the engine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable, List, Optional, Sequence

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from .core.chunkfile import ChunkMeta
from .core.options import ConfigError
from .integration.common import (
    STORE_DRAIN_WAIT,
    EngineShapes,
    allocate_from,
    allocate_many_from,
    before_pool_frees,
    configured_options,
    gpu_index,
    hit_prefix,
    meta_of,
    open_store,
    plugin_name,
    register_pool,
    worker_metrics_port,
)

log = logging.getLogger("lmcache_fx")

# A lookup's pins are released by its load; when LMCache loads nothing (a hit
# of less than one whole chunk of per-layer keys) it unpins them itself and no
# load comes, so the record is dropped after this long.
LOOKUP_PINS_KEPT_S = 600.0
WRITER_POLL_S = 0.1  # the writer looks for stores at least this often (a wake-up lost to an interrupt)


class _LookupPins:
    """The keys an async lookup pinned (its load unpins those it was asked
    to load), and those of them LMCache unpinned itself meanwhile."""

    __slots__ = ("at", "keys", "_left")

    def __init__(self, at: float, keys: list):
        self.at = at
        self.keys = keys
        self._left = Counter(keys)  # pins of each key not yet released by LMCache

    def holds(self, key) -> bool:
        """Whether a pin of `key` is still held for this lookup."""
        return self._left.get(key, 0) > 0

    def held(self) -> bool:
        return any(v > 0 for v in self._left.values())

    def released_one(self, key) -> None:
        """Notes one of LMCache's unpins of `key` (held here)."""
        self._left[key] -= 1

    def unreleased(self) -> list:
        """Each key once per pin of it still held for this lookup."""
        return list(self._left.elements())


class FxStorageBackend(StoragePluginInterface):
    # Torch device of the direct_to_gpu chunk buffer; None = the worker's GPU.
    # Only the tests set "cpu", with the stand-in driver (host "device pointers").
    gpu_memory_device: Optional[str] = None

    def __init__(self, config=None, dst_device: str = "cpu", metadata=None, local_cpu_backend=None, loop=None):
        super().__init__(
            dst_device="cpu", config=config, metadata=metadata, local_cpu_backend=local_cpu_backend, loop=loop
        )
        if local_cpu_backend is None:
            raise ConfigError("lmcache-fx needs LMCache's LocalCPUBackend as its allocator (max_local_cpu_size > 0)")
        self.name = plugin_name(config, type(self))
        prefix = f"storage_plugin.{self.name}."
        self.options = configured_options(config, "storage_plugin", self.name)
        self._gpu = None
        gpu_device = None
        if self.options.direct_to_gpu:  # checked before anything starts
            from . import gpu

            gpu_device = gpu_index(dst_device)
            why = gpu.direct_to_gpu_problem(gpu_device, self.gpu_memory_device)
            if why:
                raise ConfigError(
                    f"{prefix}direct_to_gpu: cannot serve chunks in GPU memory here: {why}; "
                    f"set {prefix}direct_to_gpu: false on hosts without a GPU"
                )
        self.store = open_store(self.options, prefix)
        if getattr(config, "use_layerwise", False):
            log.warning(
                "lmcache-fx: LMCache's layerwise retrieve (use_layerwise) checks only each chunk's first layer "
                "before it loads every layer, and loads what a backend returns per layer without checking that "
                "every chunk came back: a layer's chunk file lost or found damaged since (a full disk, a torn "
                "file) leaves that chunk's KV unwritten for that layer, not a miss. A retrieve after LMCache's "
                "lookup (vLLM's connector) is checked on every layer first; one without it (retrieve_layer "
                "called directly, as SGLang does) is not"
            )
        self._shapes = EngineShapes(metadata, self.store, config)
        if self.options.direct_to_gpu:
            try:
                self._gpu = gpu.GpuChunkAllocator(
                    self.options.gpu_buffer_mib << 20,
                    device=gpu_device,
                    engine=self.store.engine,
                    slots=self.options.gpu_staging_slots,
                    slot_bytes=self.options.gpu_slot_mib << 20,
                    memory_device=self.gpu_memory_device,
                )
            except Exception as e:
                self.store.close()
                raise ConfigError(
                    f"{prefix}direct_to_gpu: the GPU chunk buffer ({prefix}gpu_buffer_mib="
                    f"{self.options.gpu_buffer_mib}) or staging ({prefix}gpu_staging_slots="
                    f"{self.options.gpu_staging_slots} x {prefix}gpu_slot_mib="
                    f"{self.options.gpu_slot_mib}) could not be set up: {e}"
                ) from None
            self._reads = gpu.GpuRouter(self.store.engine, self._gpu.reader, self._gpu.owns)
            if getattr(config, "local_cpu", False):
                log.warning(
                    "lmcache-fx: direct_to_gpu with LMCache's local_cpu: true: LMCache keeps retrieved "
                    "chunks in its CPU tier's index, holding them in the %d MiB GPU buffer until it "
                    "evicts them; local_cpu: false is advised",
                    self.options.gpu_buffer_mib,
                )
        else:
            self._reads = self.store.engine
        register_pool(self.store.engine, local_cpu_backend)
        from .core import metrics

        try:
            port = worker_metrics_port(self.options, metadata, prefix)
        except ConfigError:
            if self._gpu is not None:
                self._gpu.close()
            self.store.close()
            raise
        self._metrics = metrics.start_metrics(self.store, name=self.name, port=port, addr=self.options.metrics_addr)
        self._put_lock = threading.Lock()
        # Keys taken for a store and not yet written, with the object each holds a reference to.
        self._put_keys: dict[CacheEngineKey, MemoryObj] = {}
        self._pool_gone = False  # LMCache's CPU pool is freed (or being freed): no store can read it
        self._closed = False  # close() began: no store is taken, no lookup answers a hit
        self._said_closed = False
        # async lookup id -> its lookups' pins, oldest first: each load releases the oldest (a lookup of an id
        # whose load still waits in LMCache's queue adds a record; it does not release the first's pins)
        self._lookup_pins: dict[str, list[_LookupPins]] = {}
        self._pins_lock = threading.Lock()  # _lookup_pins: LMCache's loop, and unpin() from any thread
        # (loop thread, record) of the async lookup that just returned, until its loop step ends: the
        # only window in which LMCache unpins the keys it rounds off that lookup (storage_manager's
        # async_lookup_and_prefetch, no await between). Any other unpin is not that lookup's.
        self._rounding: Optional[tuple[int, _LookupPins]] = None
        # Stores queued for the writer ((batch, callback), or None: stop), and the batch it writes now; both
        # under _put_lock. A deque, not a queue.Queue: an interrupt (Ctrl-C) inside Queue.put could leave an
        # item queued but its count or the writer's wake-up not done (flush, and LMCache's close, hung).
        self._writes: collections.deque = collections.deque()
        self._writing: list = []
        self._put_cv = threading.Condition(self._put_lock)
        self._writer = threading.Thread(target=self._write_loop, name=f"lmcache-fx-writer-{self.name}", daemon=True)
        self._writer.start()
        self._unhook_pool = before_pool_frees(local_cpu_backend, self._finish_stores)
        log.info(
            "lmcache-fx: plugin '%s' on %s, engine %s, O_DIRECT %s, %d chunks present%s",
            self.name,
            ",".join(self.store.roots),
            self.store.engine.kind,
            self.store.odirect,
            len(self.store),
            ""
            if self._gpu is None
            else f", direct_to_gpu on GPU {self._gpu.reader.device} ({self.options.gpu_buffer_mib} MiB buffer, "
            f"staging {self.options.gpu_staging_slots} x {self.options.gpu_slot_mib} MiB, "
            f"pinned {self._gpu.reader.pinned}, reads {self._gpu.reader.io}, "
            f"payload CRC32C {'checked' if self.options.verify else 'off'}; "
            f"{self._gpu.reader.degraded or 'no slow path'}; {self._gpu.reader.numa_info})",
        )

    def __str__(self) -> str:
        return f"FxStorageBackend({self.name})"

    # ------------------------------------------------------------ lookups
    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        if self._closed:  # a lookup in close()'s window: the read after it would miss
            return False
        k = key.to_string()
        if pin:
            return self.store.pin(k, self._shapes.fits)
        return self.store.contains(k, self._shapes.fits)

    def batched_contains(self, keys: List[CacheEngineKey], pin: Optional[bool] = None) -> int:
        # The hit prefix, its files stat'ed in one call (store.lookup). A chunk read before as another
        # model's shape is no hit (EngineShapes). LMCache's lookups pass `pin`; its retrieve asks
        # again without it (get_block_mapping): only the lookups count in the metrics' hit rate.
        if self._closed:
            return 0
        names = [k.to_string() for k in keys]
        return sum(
            self.store.lookup(names, pin=bool(pin), prefix=True, usable=self._shapes.fits, count=pin is not None)
        )

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        n = self.batched_contains(keys, pin)
        if pin and n:
            # LMCache sends no unpin after an async load: remember and release.
            now = time.monotonic()
            gone: list = []
            with self._pins_lock:
                for i, recs in list(self._lookup_pins.items()):
                    # Past LOOKUP_PINS_KEPT_S no load is coming (one cancelled before it started never
                    # ran its finally): what LMCache did not unpin itself is released below.
                    gone += [r for r in recs if now - r.at > LOOKUP_PINS_KEPT_S]
                    # A record of this id that LMCache released whole (nothing whole was hit: no load
                    # follows) goes now: the next load of this id must take this lookup's record.
                    recs[:] = [r for r in recs if now - r.at <= LOOKUP_PINS_KEPT_S and (i != lookup_id or r.held())]
                    if not recs:
                        del self._lookup_pins[i]
                rec = _LookupPins(now, list(keys[:n]))
                self._lookup_pins.setdefault(lookup_id, []).append(rec)
                self._rounding = (threading.get_ident(), rec)
            asyncio.get_running_loop().call_soon(self._rounding_over, rec)
            for r in gone:
                for k in r.unreleased():
                    self.store.unpin(k.to_string())
        return n

    def _rounding_over(self, rec: _LookupPins) -> None:
        with self._pins_lock:
            if self._rounding is not None and self._rounding[1] is rec:
                self._rounding = None

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._put_lock:
            return key in self._put_keys

    def pin(self, key: CacheEngineKey) -> bool:
        return not self._closed and self.store.pin(key.to_string(), self._shapes.fits)

    def unpin(self, key: CacheEngineKey) -> bool:
        # LMCache unpins the keys of an async lookup it rounds off (per-layer keys of a partial chunk)
        # right after the lookup, on its loop: noted on that lookup's record, so a record whose load
        # never runs releases only what is still pinned for it. A sync lookup's unpin (another thread,
        # or later) releases that lookup's own pin and is not noted.
        with self._pins_lock:
            r = self._rounding
            if r is not None and r[0] == threading.get_ident() and r[1].holds(key):
                r[1].released_one(key)
        return self.store.unpin(key.to_string())

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        return self.store.remove(key.to_string())

    def touch_cache(self) -> None:
        pass  # recency is updated on every hit

    def get_allocator_backend(self):
        # Stores are written from LMCache's CPU pool, also with direct_to_gpu
        # (LMCache only uses this to choose what memory a put hands us; GdsBackend
        # returns itself because cuFile writes from GPU memory, which we do not).
        return self.local_cpu_backend

    # ------------------------------------------------------------ reads
    def _allocate(self, meta: ChunkMeta, busy_loop: bool = True):
        if not self._shapes.fits(meta):
            return None
        return self._allocate_fitting(meta, busy_loop)

    def _allocate_fitting(self, meta: ChunkMeta, busy_loop: bool):
        """_allocate of a meta EngineShapes has judged already."""
        return allocate_from(self._gpu or self.local_cpu_backend, meta, busy_loop)

    def _stores_queued(self) -> bool:
        with self._put_lock:
            return bool(self._put_keys)

    def _allocate_many(self, meta: ChunkMeta, count: int):
        # Host destinations only: the GPU pipeline's pool allocates per chunk.
        if self._gpu or not self._shapes.fits(meta):
            return None
        return allocate_many_from(self.local_cpu_backend, meta, count)

    @staticmethod
    def _release(obj: MemoryObj) -> None:
        obj.ref_count_down()

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self.batched_get_blocking([key])[0]

    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        holds = [False]  # whether this read holds some of LMCache's pool

        def allocate(meta: ChunkMeta):
            # LMCache's busy loop, entered by a read that holds some of the pool, can wait on the
            # read itself (a hit prefix of more chunks than the pool holds) or on another read
            # waiting on this one, for good. Only a read that holds none waits so. One that holds
            # some and finds no room waits, bounded, for this plugin's queued stores (their objects
            # give room back once written) and tries once more; else it and the rest miss.
            if not self._shapes.fits(meta):
                return None
            got = self._allocate_fitting(meta, busy_loop=not holds[0])
            if got is None and holds[0] and self._stores_queued():
                try:
                    self.flush(STORE_DRAIN_WAIT)
                except TimeoutError:
                    pass
                got = self._allocate_fitting(meta, busy_loop=False)
            holds[0] = holds[0] or got is not None
            return got

        def allocate_many(meta: ChunkMeta, count: int):
            got = self._allocate_many(meta, count)
            holds[0] = holds[0] or got is not None
            return got

        return self.store.read([k.to_string() for k in keys], allocate, self._release, self._reads, allocate_many)

    def get_non_blocking(self, key: CacheEngineKey, location: Optional[str] = None) -> Optional[Future]:
        fut: Future = Future()
        try:
            fut.set_result(self.get_blocking(key))
        except Exception as e:
            fut.set_exception(e)
        return fut

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        try:
            objs = await self.store.read_async(
                [k.to_string() for k in keys],
                lambda m: self._allocate(m, busy_loop=False),
                self._release,
                engine=self._reads,
                allocate_many=self._allocate_many,
            )
        finally:
            # Only the keys asked for: the hit keys LMCache does not load (per-layer keys of a
            # partial chunk, rounded off) it unpins itself, and unpinning them again would drop
            # another request's pin.
            asked = set(keys)
            with self._pins_lock:
                recs = self._lookup_pins.get(lookup_id)
                rec = recs.pop(0) if recs else None  # the oldest: loads run in their lookups' order
                if recs == []:
                    del self._lookup_pins[lookup_id]
            for k in rec.keys if rec is not None else ():
                if k in asked:
                    self.store.unpin(k.to_string())
        return hit_prefix(objs)

    # ------------------------------------------------------------ writes
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: List[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
    ) -> None:
        batch = []
        with self._put_lock:
            if self._pool_gone:
                log.warning("lmcache-fx: %d chunks not stored: LMCache is closing its CPU pool", len(keys))
                return None
            if self._closed:
                # LMCache's close_backend / recreate_backend close this backend while vLLM still
                # stores through it: a store taken now was queued behind the writer's end, never
                # written, and its objects' references never dropped (the CPU pool ran out).
                if not self._said_closed:
                    self._said_closed = True
                    log.warning("lmcache-fx: %s is closed: stores after its close are not taken", self.name)
                return None
            for key, obj in zip(keys, objs):
                if key in self._put_keys:
                    continue
                obj.ref_count_up()  # LMCache drops its reference when we return
                self._put_keys[key] = obj
                batch.append((key, obj))
            # Under the lock: close() puts the writer's end after it, never before. An interrupt raised
            # in this thread (Ctrl-C, a signal handler's exception) before the append leaves keys that no
            # writer will take: flush() lets them go. One lost in notify() costs the writer one poll.
            if batch:
                self._writes.append((batch, on_complete_callback))
                self._put_cv.notify()
        return None

    def _write_loop(self) -> None:
        while True:
            with self._put_cv:
                while not self._writes:
                    self._put_cv.wait(WRITER_POLL_S)
                item = self._writes.popleft()
                if item is None:
                    return
                batch, callback = item
                # Take what else is queued (same callback) so one engine batch writes it all.
                while len(batch) < 64 and self._writes and self._writes[0] is not None:
                    if self._writes[0][1] is not callback:
                        break
                    batch = batch + self._writes.popleft()[0]
                self._writing = batch
            self._write_batch(batch, callback)

    def _write_batch(self, batch, callback) -> None:
        try:
            items, keep = [], []
            for k, o in batch:
                addr = o.data_ptr
                if self._gpu is not None and self._gpu.owns(addr):  # one of our GPU chunks: via host memory
                    host = o.raw_data.view(torch.uint8).reshape(-1)[: o.get_size()].to("cpu", copy=True)
                    keep.append(host)
                    addr = host.data_ptr()
                items.append((k.to_string(), addr, o.get_size(), self._shapes.for_write(meta_of(o))))
            done = self.store.write(items)
        except Exception:
            log.exception("lmcache-fx: store batch failed")
            done = [False] * len(batch)
        finally:
            with self._put_lock:
                for k, o in batch:
                    if self._put_keys.get(k) is o:  # else let go by flush() already, its reference with it
                        del self._put_keys[k]
                        o.ref_count_down()
                self._writing = []
        if callback is not None:
            for (k, _), ok in zip(batch, done):
                if ok:
                    try:
                        callback(k)
                    except Exception:
                        log.exception("lmcache-fx: on_complete_callback failed")

    def flush(self, timeout: Optional[float] = None) -> None:
        """Blocks until queued writes are on disk (tests, close)."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._put_lock:
                if not self._put_keys:
                    return
                # Keys taken that are neither queued nor being written: their submit was interrupted
                # before it queued them (flush waited for them for good, and close with it).
                taken = {k for item in self._writes if item is not None for k, _ in item[0]}
                taken.update(k for k, _ in self._writing)
                lost = [(k, o) for k, o in self._put_keys.items() if k not in taken]
                for k, _ in lost:
                    del self._put_keys[k]
                if lost:
                    for _, obj in lost:
                        obj.ref_count_down()
                    log.warning(
                        "lmcache-fx: %d chunks not stored: their store was interrupted before it was queued", len(lost)
                    )
                    continue
            if end is not None and time.monotonic() > end:
                raise TimeoutError("lmcache-fx: writes still pending")
            time.sleep(0.005)

    def _finish_stores(self) -> None:
        """Writes every queued store while LMCache's CPU pool is still there,
        takes no more, and waits for reads in flight into the pool
        (before_pool_frees: LMCache frees the pool before this backend's
        close). Reads after this are misses: the engine is closed."""
        with self._put_lock:
            self._pool_gone = True
        if self._writer.is_alive():
            self.flush()
        if self._gpu is None:  # GPU reads land in GPU memory, not in the pool
            self.store.engine.close()  # waits for the batches running or queued

    def close(self) -> None:
        self._unhook_pool()
        self._metrics.close()
        with self._put_lock:  # stores taken before it are written; none after (batched_submit_put_task)
            self._closed = True
            if self._writer.is_alive():
                self._writes.append(None)
                self._put_cv.notify()
        if self._writer.is_alive():
            self._writer.join()
        if self._gpu is not None:
            self._gpu.close()
        self.store.close()
