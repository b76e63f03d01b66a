"""LMCache MP-mode L2 adapter over the chunk store: translates
L2AdapterInterface calls into store calls, and nothing more.

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "lmcache_fx.l2_adapter", "class_name": "FxL2Adapter",
        "adapter_params": {"path": "/mnt/nvmeof/lmcache", "max_capacity_gb": 2000}}'

LMCache's plugin factory finds `FxL2AdapterConfig` by its naming convention
(`<ClassName>Config`) and builds it from `adapter_params`, so a wrong option
fails while LMCache parses its arguments, with the option's name; the
generic keys (`eviction`, `serde`, `shared`, `affinity_tag`) stay at the top
level of the JSON, where LMCache itself reads them for every adapter.

Threads and eventfds: LMCache's store and prefetch controllers call in from
two threads and poll the three eventfds below. A load is ONE engine batch for
the whole task (two when headers are new to this process), blocking in the C
engine (GIL released) on one of LOAD_THREADS reader threads; a failed batch
ends as misses. Lookups run on a thread of their own (each is a stat per
key). Stores go to one writer thread, which takes every store task waiting
when it comes round and writes them as one store.write (a group commit).
Each finished task signals its LMCache eventfd.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import TYPE_CHECKING, Optional

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from .core.chunkfile import HEADER_SIZE, ChunkMeta, chunk_digest
from .core.drive import drive_blocking
from .core.options import ConfigError, FxOptions, refuse_direct_to_gpu
from .integration.common import meta_of, open_store, refuse_as_storage_plugin, register_memory

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("lmcache_fx")
_names_taken: set[str] = set()  # metrics names of the adapters open in this process
_names_lock = threading.Lock()

WHERE = "adapter_params."
SWEEP_SECONDS = 60.0  # _report_evictions checks every key it knows at most this often
# Load tasks read at once; later ones wait their turn, in order. Each task is one engine batch,
# parallel inside, so a few threads keep the device busy between tasks (16 were slower than 4
# here). Awaited on an asyncio loop instead, each batch on a thread started for it, one-chunk
# 2 MiB loads took 1.49-1.81x fs_native's p50; on these threads 0.94-1.22x
# (docs/bench-repeats/latency-rounds/505836c-2m-*, 9c0b182-2m-*).
LOAD_THREADS = 4
SEED_BATCH = 4096  # keys already stored, reported to LMCache's listeners this many at a time


def _keep(obj) -> None:
    """The L1 objects a load reads into are LMCache's: a miss frees nothing."""


def object_key_string(key: "ObjectKey") -> str:
    """The store key of an ObjectKey: the same fields, order and spelling as
    LMCache's FS L2 adapter file names (model with '/' as '-SEP-', kv_rank
    in 0x hex, object group in hex, chunk hash in hex, cache_salt if any)."""
    s = f"{key.model_name.replace('/', '-SEP-')}@{key.kv_rank:#010x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    return f"{s}@{key.cache_salt}" if key.cache_salt else s


def object_key_of(s: str) -> Optional["ObjectKey"]:
    """The ObjectKey whose object_key_string is `s`, or None (a key of the
    engine entry points, or one that does not spell back the same)."""
    from lmcache.v1.distributed.api import ObjectKey

    parts = s.split("@", 4)
    if len(parts) < 4:
        return None
    try:
        key = ObjectKey(
            chunk_hash=bytes.fromhex(parts[3]),
            model_name=parts[0].replace("-SEP-", "/"),
            kv_rank=int(parts[1], 16),
            object_group_id=int(parts[2], 16),
            cache_salt=parts[4] if len(parts) == 5 else "",
        )
    except (ValueError, TypeError):
        return None
    return key if object_key_string(key) == s else None


# LMCache's own keys of every --l2-adapter entry (beside "type"), not adapter_params.
_LMCACHE_ADAPTER_KEYS = frozenset({"eviction", "serde", "shared", "affinity_tag", "persist_enabled"})


class FxL2AdapterConfig(L2AdapterConfigBase):
    """`adapter_params` are lmcache-fx options (README's table)."""

    def __init__(self, options: FxOptions):
        self.options = options

    @classmethod
    def from_dict(cls, d: dict) -> "FxL2AdapterConfig":
        try:
            return cls._from_dict(d)
        except ConfigError as e:
            # `lmcache server` prints a traceback of its start-up for it: the line that says what to fix first
            log.error("lmcache-fx: L2 adapter not started: %s", e)
            raise

    @classmethod
    def _from_dict(cls, d: dict) -> "FxL2AdapterConfig":
        d = {k: v for k, v in (d or {}).items() if k != "type"}
        lmcaches = sorted(k for k in d if k in _LMCACHE_ADAPTER_KEYS)
        if lmcaches:
            raise ConfigError(
                f"{WHERE}{lmcaches[0]}: an LMCache setting of every L2 adapter, not an lmcache-fx option; "
                f'put it beside "type" in the --l2-adapter JSON, not in adapter_params'
            )
        options = FxOptions.from_mapping(d, where=WHERE)
        if "path" not in d:  # LMCache drops unknown keys beside "type": options put there leave no trace
            log.warning(
                "lmcache-fx: L2 adapter: adapter_params gives no path, so the store is at the default %s "
                '(lmcache-fx options go under "adapter_params", not beside "type")',
                ",".join(options.paths),
            )
        refuse_direct_to_gpu(options, WHERE)
        return cls(options)

    @classmethod
    def help(cls) -> str:
        rows = "\n".join(f"- {n} ({vals}): {meaning}" for n, (meaning, vals) in FxOptions.doc().items())
        return (
            "lmcache-fx L2 adapter, adapter_params fields (all optional):\n" + rows + "\n\nExample JSON:\n"
            '{"type": "plugin", "module_path": "lmcache_fx.l2_adapter", "class_name": "FxL2Adapter", '
            '"adapter_params": {"path": "/mnt/nvmeof/lmcache", "max_capacity_gb": 2000}}'
        )


class FxL2Adapter(L2AdapterInterface):
    def __init__(self, config, l1_memory_desc: "Optional[L1MemoryDesc]" = None, **wrong_entry):
        refuse_as_storage_plugin(
            wrong_entry, "lmcache_fx.l2_adapter.FxL2Adapter is an MP-mode L2 adapter (lmcache server --l2-adapter)"
        )
        if not isinstance(config, FxL2AdapterConfig):  # raw adapter_params (no config class found)
            config = FxL2AdapterConfig.from_dict(config if isinstance(config, dict) else {})
        self.options = config.options
        super().__init__(max_capacity_bytes=self.options.max_capacity_bytes)
        self.store = open_store(self.options, WHERE)
        from .core import metrics

        with _names_lock:  # the store label of its metrics: l2, then l2-2, l2-3 ... in one process
            names = itertools.chain(["l2"], (f"l2-{i}" for i in itertools.count(2)))
            self.name = next(n for n in names if n not in _names_taken)
            _names_taken.add(self.name)
        # The MP server is one process per host: no worker id to add.
        self._metrics = metrics.start_metrics(
            self.store, name=self.name, port=self.options.metrics_port, addr=self.options.metrics_addr
        )
        if l1_memory_desc is not None:
            self._register_l1(l1_memory_desc)

        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._done_store: dict[L2TaskId, L2StoreResult] = {}
        self._done_lookup: dict[L2TaskId, Bitmap] = {}
        self._done_load: dict[L2TaskId, Bitmap] = {}
        self._in_flight = 0
        self._abandoned: set[L2TaskId] = set()  # tasks whose submit raised after queuing them (_submit)
        self._seeding = False  # the chunks already stored are (being) reported to the listeners
        self._sizes: dict["ObjectKey", int] = {}  # keys stored by this adapter -> file bytes
        self._by_digest: dict[str, "ObjectKey"] = {}  # the same keys by their files' digest
        self._evictions_seen = 0
        self._sweep_at = 0.0  # when _report_evictions next checks every key it knows
        self._closed = False
        self._failures = 0

        self._readers = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="lmcache-fx-l2-reader")
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="lmcache-fx-l2-lookup")
        # Store tasks waiting for the writer: written together, as one batch, when it comes round.
        self._stores_waiting: list[tuple[L2TaskId, list, list]] = []
        self._stores_cv = threading.Condition()
        self._stopping = False
        self._writer = threading.Thread(target=self._write_stores, name="lmcache-fx-l2-writer", daemon=True)
        self._writer.start()
        log.info(
            "lmcache-fx: L2 adapter on %s, engine %s, O_DIRECT %s, %d chunks present",
            ",".join(self.store.roots),
            self.store.engine.kind,
            self.store.odirect,
            len(self.store),
        )

    def register_listener(self, listener) -> None:
        """LMCache's listeners (its L2 eviction policy) hear of the chunks
        already in the store too: stored by an earlier run or by another
        process under MP keys. Without, after a restart the policy knew only
        the chunks stored since, while get_usage counted every chunk: with an
        `eviction` block, each pass deleted the newest chunks, the only ones
        it knew, and kept the old. The first listener starts a thread that
        reads the keys from the chunks' headers (least recently used first)
        and reports them stored, as LMCache's raw_block adapter does from its
        index; a listener registered after that hears of every key known by
        then at once."""
        super().register_listener(listener)
        with self._lock:
            first, self._seeding = not self._seeding, True
            known = [] if first else list(self._sizes.items())
        if first:
            threading.Thread(target=self._seed_listeners, name="lmcache-fx-l2-seed", daemon=True).start()
        elif known:
            try:
                listener.on_l2_keys_stored([k for k, _ in known], [n for _, n in known])
            except Exception:
                log.exception("lmcache-fx: a listener refused the keys already stored")

    def _seed_listeners(self) -> None:
        try:
            found = self.store.stored_keys(stop=lambda: self._closed)
            # Keys of the engine entry points are not MP keys (None): left out.
            parsed = [(k, chunk_digest(name), size) for name, size in found if (k := object_key_of(name)) is not None]
            keys, sizes = [], []
            with self._lock:  # held only to take the keys in: every submit waits for it
                for k, digest, size in parsed:
                    if k in self._sizes:
                        continue  # stored (and reported) by this run already
                    self._sizes[k] = size
                    self._by_digest[digest] = k
                    keys.append(k)
                    sizes.append(size)
            for i in range(0, len(keys), SEED_BATCH):
                if self._closed:
                    return
                self._notify_keys_stored(keys[i : i + SEED_BATCH], sizes[i : i + SEED_BATCH])
            if keys:
                log.info("lmcache-fx: L2 adapter told LMCache of %d chunks already stored", len(keys))
        except Exception:
            if not self._closed:
                log.exception("lmcache-fx: telling LMCache of the chunks already stored failed")

    def _register_l1(self, desc: "L1MemoryDesc") -> None:
        register_memory(self.store.engine, desc.ptr, desc.stable_registration_size or desc.size, "L1")

    def _task_id(self) -> L2TaskId:
        with self._lock:
            return self._task_id_locked()

    def _task_id_locked(self) -> L2TaskId:
        if self._closed:  # one answer for every submit: a task made now would never finish
            raise RuntimeError(f"lmcache-fx L2 adapter {self.name} is closed")
        self._next_id += 1
        self._in_flight += 1
        return self._next_id

    def _submit(self, pool, fn, *args) -> L2TaskId:
        """A lookup or load task given to its threads under the lock close()
        refuses new tasks under: given before the threads stop, or refused.
        A ThreadPoolExecutor queues the work before it starts a thread for
        it: where none can start (a container at its process limit) submit
        raises with the work queued, LMCache takes the task for failed (it
        frees a load's buffers, never unlocks a lookup's keys), and a thread
        started later ran it all the same: file bytes into freed buffers,
        chunks pinned for good. Such a task is marked abandoned, and skipped
        when a thread picks it up."""
        with self._lock:
            tid = self._task_id_locked()
            try:
                pool.submit(self._unless_abandoned, fn, tid, *args)
            except BaseException:
                self._abandoned.add(tid)
                self._in_flight -= 1
                raise
            return tid

    def _unless_abandoned(self, fn, tid: L2TaskId, *args) -> None:
        with self._lock:
            if tid in self._abandoned:
                self._abandoned.discard(tid)
                return
        fn(tid, *args)

    def _finish(self, table: dict, task_id: L2TaskId, result, efd) -> None:
        with self._lock:
            table[task_id] = result
            self._in_flight -= 1
        efd.notify()

    # ------------------------------------------------------------ eventfds
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ------------------------------------------------------------ store
    def submit_store_task(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> L2TaskId:
        with self._stores_cv:  # under the writer's lock: a task is queued before it stops, or refused
            tid = self._task_id()
            self._stores_waiting.append((tid, list(keys), list(objects)))
            self._stores_cv.notify()
        return tid

    def _write_stores(self) -> None:
        """The writer thread: every store task waiting when it comes round,
        written as one batch. One-chunk tasks written one by one left the
        engine's writer threads idle: a chunk alone is one synchronous write
        (64 x 2 MiB in one-chunk tasks: 2.4 GB/s against fs_native's 9.1,
        together 5.9 against 8.4; the message of the commit that made it)."""
        while True:
            with self._stores_cv:
                while not self._stores_waiting and not self._stopping:
                    self._stores_cv.wait()
                if not self._stores_waiting:
                    return  # stopping, and nothing left to write
                tasks, self._stores_waiting = self._stores_waiting, []
            self._store(tasks)

    def _store(self, tasks: list) -> None:
        """Writes store tasks as one store.write, each key once, then
        finishes each task with its own result."""
        items: list = []
        where: dict[str, int] = {}  # key string -> its place in items (a key in two tasks is written once)
        parsed: list = []
        for tid, keys, objects in tasks:
            try:
                its = [(object_key_string(k), o.data_ptr, o.get_size(), meta_of(o)) for k, o in zip(keys, objects)]
            except Exception:
                log.exception("lmcache-fx: L2 store task %d failed", tid)
                parsed.append((tid, keys, None, None))
                continue
            places = []
            for it in its:
                if it[0] not in where:
                    where[it[0]] = len(items)
                    items.append(it)
                places.append(where[it[0]])
            parsed.append((tid, keys, its, places))
        try:
            done = self.store.write(items) if items else []
        except Exception:
            log.exception("lmcache-fx: L2 store of %d tasks failed", len(tasks))
            done = [False] * len(items)
        for tid, keys, its, places in parsed:
            try:
                self._finish_store(tid, keys, its, [done[p] for p in places] if its is not None else None)
            except Exception:  # a listener raised: the task still ends, as failed, so LMCache lets go of it
                log.exception("lmcache-fx: finishing L2 store task %d failed", tid)
                self._finish(self._done_store, tid, L2StoreResult(False, 0), self._store_efd)
        try:
            self._report_evictions()
        except Exception:
            log.exception("lmcache-fx: reporting evictions failed")

    def _finish_store(self, tid: L2TaskId, keys, items, done) -> None:
        ok, nbytes = done is not None, 0
        new_keys, new_sizes, resized, old_sizes = [], [], [], []
        for k, it, d in zip(keys, items or (), done or ()):
            if not d:
                ok = False
                continue
            size = HEADER_SIZE + it[2]
            with self._lock:
                old = self._sizes.get(k)
                self._sizes[k] = size
                if old is None:
                    self._by_digest[chunk_digest(it[0])] = k
            if old != size:
                # New, or written anew at another size (a KV dtype change: MP keys carry none), which
                # listeners hear of as the old size gone and the new stored: per-salt bytes stay true.
                if old is not None:
                    resized.append(k)
                    old_sizes.append(old)
                new_keys.append(k)
                new_sizes.append(size)
                nbytes += it[2]
        if not ok:
            with self._lock:
                self._failures += 1
        if resized:
            self._notify_keys_deleted(resized, old_sizes)
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)
        self._finish(self._done_store, tid, L2StoreResult(ok, nbytes), self._store_efd)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        # Emptied in place, never swapped: a finisher holds the table from before it takes the lock,
        # and a result put into a table already handed to LMCache was never seen (its L1 objects
        # stayed read-locked, the task in LMCache's in-flight table for good).
        with self._lock:
            done = dict(self._done_store)
            self._done_store.clear()
        return done

    # ------------------------------------------------------------ lookup and lock
    def submit_lookup_and_lock_task(
        self, keys: list["ObjectKey"], group_layout_descs: "dict[int, MemoryLayoutDesc]"
    ) -> L2TaskId:
        return self._submit(self._lookups, self._lookup, list(keys))

    def _lookup(self, tid: L2TaskId, keys) -> None:
        bm = Bitmap(len(keys))
        missed = []
        try:
            # Pinned chunks are never evicted; the batch's files stat'ed in one call.
            for i, hit in enumerate(self.store.lookup([object_key_string(k) for k in keys], pin=True, count=True)):
                if hit:
                    bm.set(i)
                else:
                    missed.append(keys[i])
        except Exception:
            log.exception("lmcache-fx: L2 lookup task %d failed", tid)
        self._finish(self._done_lookup, tid, bm, self._lookup_efd)
        try:
            self._report_gone(missed)
        except Exception:
            log.exception("lmcache-fx: reporting chunks found gone failed")

    def _report_gone(self, keys) -> None:
        """Keys found missing (by a lookup, or by _report_evictions) that
        LMCache was told are stored: gone without this adapter removing them
        (its store's or another process's evictor, a file dropped as bad, an
        operator). A lookup reports them at once rather than at the next
        sweep (_report_evictions). Keys not known any more (a delete()
        reported them) are left out."""
        if not keys:
            return
        gone, sizes = [], []
        with self._lock:
            for k in keys:
                size = self._sizes.pop(k, None)
                if size is not None:
                    self._by_digest.pop(chunk_digest(object_key_string(k)), None)
                    gone.append(k)
                    sizes.append(size)
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Optional[Bitmap]:
        with self._lock:
            return self._done_lookup.pop(task_id, None)

    def submit_unlock(self, keys: list["ObjectKey"]) -> None:
        for k in keys:
            self.store.unpin(object_key_string(k))  # in memory: cannot fail

    # ------------------------------------------------------------ load
    def submit_load_task(self, keys: list["ObjectKey"], objects: list["MemoryObj"]) -> L2TaskId:
        return self._submit(self._readers, self._load, list(keys), list(objects))

    def _load(self, tid: L2TaskId, keys, objects) -> None:
        bm = Bitmap(len(keys))
        try:
            # One read_steps for the whole task, so one engine batch reads every
            # chunk (opens, headers, CRC in C), each into the object LMCache gave for it.
            gen = self.store.read_steps(
                [object_key_string(k) for k in keys], [self._into(o) for o in objects], per_key=True
            )
            out = drive_blocking(self.store.engine, gen, _keep)
            for i, h in enumerate(out):
                if h is not None:
                    bm.set(i)
        except Exception:
            log.exception("lmcache-fx: L2 load task %d failed", tid)
            bm = Bitmap(len(keys))
        hits = [keys[i] for i in bm.get_indices_list()]
        try:
            if hits:
                self._notify_keys_accessed(hits)
        except Exception:  # a listener raised: the task still ends (its bytes landed), or LMCache waits for good
            log.exception("lmcache-fx: reporting L2 load task %d's hits failed", tid)
        self._finish(self._done_load, tid, bm, self._load_efd)

    def _into(self, obj: "MemoryObj"):
        mine = meta_of(obj)
        size = obj.get_size()

        def allocate(meta: ChunkMeta):
            if meta.dtypes != mine.dtypes:  # MP keys carry no dtype: a KV dtype change meets every chunk
                self.store.burst_warning(
                    "chunks of another dtype",
                    "lmcache-fx: stored chunk has dtypes %s, the L1 object %s; miss",
                    meta.dtypes,
                    mine.dtypes,
                )
                return None
            if meta != mine:  # nor a layout: one of the same bytes in other shapes would scramble the KV
                self.store.burst_warning(
                    "chunks of another shape",
                    "lmcache-fx: stored chunk has shapes %s (%s), the L1 object %s (%s); miss",
                    meta.shapes,
                    meta.fmt,
                    mine.shapes,
                    mine.fmt,
                )
                return None
            return obj, obj.data_ptr, size  # the store checks the payload length against size

        return allocate

    def query_load_result(self, task_id: L2TaskId) -> Optional[Bitmap]:
        with self._lock:
            return self._done_load.pop(task_id, None)

    # ------------------------------------------------------------ capacity and eviction
    def delete(self, keys: list["ObjectKey"]) -> None:
        """LMCache's L2 eviction controller (an `eviction` block in the
        adapter JSON) removes keys through here."""
        if self._closed:
            raise RuntimeError(f"lmcache-fx L2 adapter {self.name} is closed")
        try:
            self._delete(keys)
        except Exception:
            if self._closed:  # closed under it: the same answer as before
                raise RuntimeError(f"lmcache-fx L2 adapter {self.name} is closed") from None
            raise

    def _delete(self, keys: list["ObjectKey"]) -> None:
        gone, sizes = [], []
        for k in keys:
            s = object_key_string(k)
            with self._lock:
                size = self._sizes.pop(k, None)
                self._by_digest.pop(chunk_digest(s), None)
            before = self.store.used_bytes if size is None else 0
            # A key this adapter told LMCache of is gone after the call whether or not a file was
            # removed now (the store dropped it as bad, another process or an operator removed it):
            # left unsaid, LMCache's LRU kept offering it, each pass freeing nothing.
            if self.store.remove(s) or size is not None:
                gone.append(k)
                sizes.append(size if size is not None else max(before - self.store.used_bytes, 0))
        if gone:
            self._notify_keys_deleted(gone, sizes)

    def _report_evictions(self) -> None:
        """The store evicts by itself to stay under max_capacity_gb; tell
        LMCache's listeners which of the keys it knows were evicted. After
        an eviction of this process, the keys its evictor removed are asked
        about (work per eviction, not per key stored); at most once per
        SWEEP_SECONDS every key this adapter knows instead, which also finds
        what other processes evicted, and, where other processes share the
        store, that sweep runs without an eviction of this one (before, an
        adapter that never evicted never heard of theirs but through a
        lookup or delete of the key)."""
        n = self.store.stats.snapshot()["evictions"]
        now = time.monotonic()
        own = n != self._evictions_seen
        if not own and (now < self._sweep_at or not self.store.shared()):
            return
        self._evictions_seen = n
        digests = self.store.take_evicted() if own else None
        with self._lock:
            if digests is None or now >= self._sweep_at:
                self._sweep_at = now + SWEEP_SECONDS
                known = list(self._sizes)
            else:
                keys = (self._by_digest.get(d) for d in digests)
                known = [k for k in keys if k is not None and k in self._sizes]
        there = self.store.lookup([object_key_string(k) for k in known])
        # Only keys still known are reported: a delete() since the copy above took and reported its own.
        self._report_gone([k for k, ok in zip(known, there) if not ok])

    def get_usage(self) -> AdapterUsage:
        """Bytes from the store itself (it counts chunks of every process and
        its own evictions); per-salt bytes from what this adapter stored."""
        base = super().get_usage()
        try:
            used = 0 if self._closed else self.store.used_bytes
        except Exception:
            if not self._closed:
                raise
            used = 0  # closed meanwhile: it holds nothing for LMCache
        return AdapterUsage(
            total_bytes_used=used,
            total_capacity_bytes=self.options.max_capacity_bytes,
            bytes_by_cache_salt=MappingProxyType(dict(base.bytes_by_cache_salt)),
        )

    # ------------------------------------------------------------ status and close
    def report_status(self) -> dict:
        if not self._closed:
            try:
                return self._status()
            except Exception:
                if not self._closed:
                    raise
        # LMCache's status endpoint may ask during or after close, when the store's ledger is gone
        with self._lock:
            in_flight = self._in_flight
        return {"is_healthy": False, "type": "FxL2Adapter", "paths": self.store.roots, "tasks_in_flight": in_flight}

    def _status(self) -> dict:
        with self._lock:
            in_flight, failures = self._in_flight, self._failures
        st = self.store.stats.snapshot()
        problem = self.store.problem()
        return {
            "is_healthy": problem is None,
            "problem": problem or "",
            "type": "FxL2Adapter",
            "paths": self.store.roots,
            "io_engine": self.store.engine.kind,
            "io_engine_fallback": self.store.engine.fallback_reason,
            "odirect": self.store.odirect,
            "chunks": len(self.store),
            "usage_bytes": self.store.used_bytes,
            "capacity_bytes": self.options.max_capacity_bytes,
            "tasks_in_flight": in_flight,
            "failed_store_tasks": failures,
            **{
                k: st[k]
                for k in (
                    "hits",
                    "misses",
                    "corrupt",
                    "evictions",
                    "recycled",
                    "write_errors",
                    "chunks_read",
                    "bytes_read",
                    "chunks_written",
                    "bytes_written",
                )
            },
        }

    def close(self) -> None:
        if self._closed:
            return
        with self._stores_cv, self._lock:
            self._closed = True  # submits from now on are refused (_task_id)
            self._stopping = True
            self._stores_cv.notify()
        self._writer.join()  # store tasks submitted are written first
        self._metrics.close()
        with _names_lock:
            _names_taken.discard(self.name)
        for pool in (self._lookups, self._readers):
            pool.shutdown(wait=True)  # tasks submitted finish: reads into L1 land before it goes
        self.store.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        log.info("lmcache-fx: L2 adapter closed")
