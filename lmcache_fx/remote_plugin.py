"""LMCache remote storage plugin: translates RemoteConnector calls into
store calls, and nothing more.

    remote_storage_plugins: ["fx"]
    extra_config:
      remote_storage_plugin.fx.module_path: lmcache_fx.remote_plugin
      remote_storage_plugin.fx.class_name: FxRemoteConnector
      remote_storage_plugin.fx.path: /mnt/nvmeof/lmcache

How LMCache 0.5.6 drives it (read in storage_backend/connector/__init__.py
and remote_backend.py):
- `RemoteBackend(plugin_name="fx")` asks for the virtual URL `plugin://fx`.
  `class_name` names a RemoteConnector subclass, so LMCache wraps it in its
  DynamicConnectorAdapter, whose can_parse matches `plugin://<type>` (type =
  the name up to the first dot), and constructs it as
  `cls(loop=, local_cpu_backend=, config=)`: no plugin name, no metadata.
- The connector is wrapped in InstrumentedRemoteConnector, which drops one
  reference of every object after `put`/`batched_put` returns; the naive
  serde (the default `remote_serde`) passes the MemoryObj itself, so the
  objects are LMCache's pool buffers and stay valid until we return.
- `batched_get` runs on the storage-manager event loop under
  `blocking_timeout_secs` (a timeout is a miss); `batched_contains` runs on
  the caller's thread; pin/unpin never reach a connector.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from .core.chunkfile import ChunkMeta
from .core.drive import outlast_cancels
from .core.once import Handoff
from .core.options import ConfigError, refuse_direct_to_gpu
from .integration.common import (
    STORE_DRAIN_WAIT,
    EngineShapes,
    allocate_from,
    allocate_many_from,
    before_pool_frees,
    configured_options,
    hit_prefix,
    meta_of,
    open_store,
    plugin_name,
    refuse_as_storage_plugin,
    register_pool,
    worker_metrics_port,
)

log = logging.getLogger("lmcache_fx")

PREFIX = "remote_storage_plugin."


def remote_plugin_name(config, cls) -> str:
    """The `remote_storage_plugins` entry this connector was built for:
    RemoteBackends are built one by one in list order from one config."""
    names = list(dict.fromkeys((config.remote_storage_plugins or []) if config is not None else []))
    return plugin_name(config, cls, names, PREFIX, "remote_storage_plugins")


class FxRemoteConnector(RemoteConnector):
    def __init__(self, loop=None, local_cpu_backend=None, config=None, **wrong_entry):
        refuse_as_storage_plugin(
            wrong_entry,
            "lmcache_fx.remote_plugin.FxRemoteConnector belongs under remote_storage_plugins "
            "(remote_storage_plugin.<name>.*)",
        )
        serde = getattr(config, "remote_serde", None)
        if serde == "cachegen":
            # CacheGen hands its connector compressed bytes over immutable memory, not a tensor: every
            # put failed with "underlying buffer is not writable", and nothing was ever stored.
            raise ConfigError(
                "remote_serde: cachegen is not stored by the lmcache-fx remote plugin (it hands the connector "
                "compressed bytes, not KV tensors); set remote_serde: naive, or use lmcache-fx as a "
                "storage plugin (storage_plugins)"
            )
        if serde == "kivi":
            # LMCache 0.5.6's KIVI serializer hands on the pool object without a reference of its own
            # (naive's takes one): LMCache's put path then drops one reference too many, the buffer
            # goes back to the pool while the connector writes it, and the next prompt's KV, written
            # into it meanwhile, was stored under this key ("Double free" in LMCache's log).
            raise ConfigError(
                "remote_serde: kivi is not stored by the lmcache-fx remote plugin (LMCache's KIVI serializer "
                "takes no reference on the buffer it hands on: freed and reused while written, it stored another "
                "prompt's KV under the key); set remote_serde: naive, or use lmcache-fx as a storage plugin "
                "(storage_plugins)"
            )
        if local_cpu_backend is None or getattr(local_cpu_backend, "metadata", None) is None:
            raise ConfigError("lmcache-fx remote plugin needs LMCache's LocalCPUBackend (max_local_cpu_size > 0)")
        super().__init__(config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.name = remote_plugin_name(config, type(self))
        self.options = configured_options(config, "remote_storage_plugin", self.name)
        refuse_direct_to_gpu(self.options, f"{PREFIX}{self.name}.")
        port = worker_metrics_port(self.options, local_cpu_backend.metadata, f"{PREFIX}{self.name}.")
        self.store = open_store(self.options, f"{PREFIX}{self.name}.")
        self._shapes = EngineShapes(local_cpu_backend.metadata, self.store, config)
        register_pool(self.store.engine, local_cpu_backend)
        from .core import metrics

        self._metrics = metrics.start_metrics(
            self.store, name=f"remote-{self.name}", port=port, addr=self.options.metrics_addr
        )
        # Writes block in the C engine (GIL released) on one thread, so the
        # event loop keeps serving gets while a put is in flight.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"lmcache-fx-remote-writer-{self.name}")
        self._pending_lock = threading.Condition()
        self._pending_puts = 0  # batched_put coroutines running (RemoteBackend does not track batched puts)
        self._writes_queued = 0  # their writes given to the writer thread and not done
        self._pool_gone = False  # LMCache's CPU pool is freed (or being freed): no put can read it
        self._unhook_pool = before_pool_frees(local_cpu_backend, self._finish_puts)
        log.info(
            "lmcache-fx: remote plugin '%s' on %s, engine %s, O_DIRECT %s, %d chunks present",
            self.name,
            ",".join(self.store.roots),
            self.store.engine.kind,
            self.store.odirect,
            len(self.store),
        )

    def __repr__(self) -> str:
        return f"FxRemoteConnector({self.name})"

    # ------------------------------------------------------------ lookups
    async def exists(self, key: CacheEngineKey) -> bool:
        return self.store.contains(key.to_string(), self._shapes.fits)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.store.contains(key.to_string(), self._shapes.fits)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return sum(self.store.lookup([k.to_string() for k in keys], prefix=True, usable=self._shapes.fits))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        return self.batched_contains(keys)

    # ------------------------------------------------------------ reads
    def _allocate(self, meta: ChunkMeta):
        # busy_loop=False: this runs on LMCache's event loop, which must not spin.
        if not self._shapes.fits(meta):
            return None
        return allocate_from(self.local_cpu_backend, meta, busy_loop=False)

    def _allocate_many(self, meta: ChunkMeta, count: int):
        return allocate_many_from(self.local_cpu_backend, meta, count) if self._shapes.fits(meta) else None

    @staticmethod
    def _release(obj: MemoryObj) -> None:
        obj.ref_count_down()

    async def _read(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        # One engine batch (two when headers are new to this process), awaited
        # through the loop's shared eventfd: the loop is free while the engine reads.
        names = [k.to_string() for k in keys]
        full = [False]  # the pool had no room for a chunk that fits: it and the later ones missed

        def allocate(meta: ChunkMeta):
            got = self._allocate(meta)
            full[0] = full[0] or (got is None and self._shapes.fits(meta))
            return got

        out = await self.store.read_async(names, allocate, self._release, allocate_many=self._allocate_many)
        # LMCache holds a put's pool objects until its batched_put returns. A read right after a store
        # (the next turn of a chat) found the pool taken by this connector's puts still being written,
        # and the chunks it had stored before missed. Where puts were running, wait for them (bounded,
        # on the loop: their coroutines resume on it) and read the missed tail once more, as the
        # in-process plugin does (STORE_DRAIN_WAIT).
        if full[0]:
            try:
                if await self._puts_returned(STORE_DRAIN_WAIT):
                    first = len(out)
                    while first and out[first - 1] is None:
                        first -= 1
                    out[first:] = await self.store.read_async(
                        names[first:], self._allocate, self._release, allocate_many=self._allocate_many
                    )
            except BaseException:
                # Cancelled meanwhile (LMCache's blocking_timeout_secs): the hits of the first read are
                # this read's to hand back (the second hands back its own); dropped, LMCache's garbage
                # collector freed them, a warning each.
                for obj in out:
                    if obj is not None:
                        self._release(obj)
                raise
        return out

    async def _puts_returned(self, timeout: float) -> bool:
        """Waits, on the loop, until no put of this connector is running, at
        most `timeout` seconds; whether any was running when called."""
        with self._pending_lock:
            if not self._pending_puts:
                return False
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            await asyncio.sleep(0.005)
            with self._pending_lock:
                if not self._pending_puts:
                    break
        await asyncio.sleep(0)  # LMCache's wrapper lets go of the last put's objects once it resumes
        return True

    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return (await self._read([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        return await self._read(keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: List[CacheEngineKey]) -> List[MemoryObj]:
        objs = await self._read(keys)
        return hit_prefix(objs)

    # ------------------------------------------------------------ writes
    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: List[CacheEngineKey], memory_objs: List[MemoryObj]):
        # LMCache keeps a reference to each object until this coroutine returns,
        # so the write finishes before we return: one engine batch of payloads,
        # one of headers.
        items = [
            (k.to_string(), o.data_ptr, o.get_size(), self._shapes.for_write(meta_of(o)))
            for k, o in zip(keys, memory_objs)
        ]
        loop = asyncio.get_running_loop()
        with self._pending_lock:
            if self._pool_gone:
                log.warning("lmcache-fx: %d chunks not stored: LMCache is closing its CPU pool", len(items))
                return
            self._pending_puts += 1
            self._writes_queued += 1  # submitted at once below: no await in between
        job = Handoff()
        try:
            cf = self._writer.submit(self._write, items, job)
        except BaseException:
            # Queued, but no thread to run it (a pids limit) or an interrupt: LMCache lets go of the
            # objects when this returns, so the write must never run (it would store what the pool
            # holds by then as these keys), and its count goes now (_finish_puts waited for it for good).
            self._give_up(job)
            with self._pending_lock:
                self._pending_puts -= 1
                self._pending_lock.notify_all()
            raise
        try:
            # Shielded: a cancelled put must not cancel its write's job, which would never run
            # `_write` and so never give its count back (_finish_puts, and LMCache's close, waited for
            # good). LMCache 0.5.6 cancels no puts; a caller with a timeout on one would.
            fut = asyncio.wrap_future(cf, loop=loop)
            done = await asyncio.shield(fut)
        except asyncio.CancelledError:
            # Not begun: it never will (LMCache lets go of the objects when this returns). Begun: it
            # reads those objects, so this put returns only once it is done.
            if not self._give_up(job):
                await outlast_cancels(fut)
            raise
        finally:
            with self._pending_lock:
                self._pending_puts -= 1
                self._pending_lock.notify_all()
        if not all(done):
            log.debug("lmcache-fx: %d of %d chunks not stored", done.count(False), len(done))

    def _give_up(self, job: Handoff) -> bool:
        """Abandons a put's write unless the writer began it: True when it
        will never run (its count given back), False when it runs."""
        if not job.give_up():
            return False
        with self._pending_lock:
            self._writes_queued -= 1
            self._pending_lock.notify_all()
        return True

    def _write(self, items: list, job: Handoff) -> list[bool]:
        """A put's write, on the writer thread; counted until it is done, on
        that thread (what _finish_puts waits for needs no event loop). One its
        put gave up (`abandoned`, its count taken back) is not written."""
        if not job.begin():
            return [False] * len(items)
        try:
            return self.store.write(items)
        finally:
            with self._pending_lock:
                self._writes_queued -= 1
                self._pending_lock.notify_all()

    def pending_puts(self) -> int:
        """batched_put calls that started and have not finished (tests)."""
        with self._pending_lock:
            return self._pending_puts

    # ------------------------------------------------------------ misc
    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self.store.remove(key.to_string())

    async def list(self) -> List[str]:
        return []  # the store indexes digests; keys live in chunk headers only

    def _finish_puts(self) -> None:
        """Lets the writes of the puts that started finish while LMCache's CPU
        pool is still there, and starts no more (before_pool_frees). Waits on
        the writer thread alone, so it holds also where LMCache closes from
        its event loop's thread (where a put's coroutine could not resume).
        Then waits for reads in flight into the pool; later ones are misses
        (the engine is closed)."""
        with self._pending_lock:
            self._pool_gone = True
            self._pending_lock.wait_for(lambda: self._writes_queued == 0)
        self.store.engine.close()  # waits for the batches running or queued

    async def close(self):
        self._unhook_pool()
        self._metrics.close()
        self._writer.shutdown(wait=True)
        self.store.close()
