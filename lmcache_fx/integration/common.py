"""What the LMCache adapters share: which plugin entry an instance is, its
options, chunk metadata of a MemoryObj, allocation from LMCache's pool, the
hit prefix of a read, and registering LMCache's pool with the engine."""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import math
import os
import resource
import sys
import threading
from typing import Callable, Optional

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from .. import _fxio
from ..core.chunkfile import ChunkMeta
from ..core.drive import memlock_refuses, memlock_text
from ..core.once import log_once
from ..core.options import ConfigError, FxOptions, plugin_lists, plugin_options
from ..core.store import ChunkStore

log = logging.getLogger("lmcache_fx")
# How long a read that finds LMCache's CPU pool taken by the plugin's own stores (their objects
# held until written) waits for them to give room back before it misses the rest.
STORE_DRAIN_WAIT = 1.0

__all__ = [
    "open_store",
    "refuse_as_storage_plugin",
    "plugin_name",
    "configured_options",
    "meta_of",
    "hit_prefix",
    "allocate_from",
    "allocate_many_from",
    "EngineShapes",
    "register_memory",
    "register_pool",
    "before_pool_frees",
    "worker_metrics_port",
    "gpu_index",
]

_claimed: dict[tuple, set] = {}  # (id(config), prefix) -> plugin names already built in this process
_claim_lock = threading.Lock()


_warned_config: set = set()  # config warnings said in this process (each once, however many plugins read them)


def configured_options(config, head: str, name: str) -> FxOptions:
    """The options of plugin <head>.<name> of an LMCache config, each warning
    about a key no loaded plugin reads logged once per process (two plugins
    read one extra_config). ConfigError as core.options.plugin_options."""
    options, warnings = plugin_options(config.extra_config, head, name, plugin_lists(config))
    with _claim_lock:
        new = [w for w in warnings if w not in _warned_config]
        _warned_config.update(new)
    for why in new:
        log.warning("lmcache-fx: %s", why)  # a misspelt key leaves a store at its defaults
    return options


def refuse_as_storage_plugin(wrong_entry: dict, what: str) -> None:
    """LMCache builds a storage_plugins entry with dst_device=...: a class of
    another entry point copied into that list (a README row in the wrong
    list) says where it belongs instead of failing with a TypeError."""
    if "dst_device" in wrong_entry:
        raise ConfigError(f"{what}; under storage_plugins use lmcache_fx.lmcache_plugin / FxStorageBackend")


def open_store(options: FxOptions, where: str) -> ChunkStore:
    """The adapter's ChunkStore; a ConfigError the store raises at start
    (a path that is a file, mapped_reads: true off tmpfs, ...) names the
    option by its full key (`where`, e.g. 'storage_plugin.fx.'), as option
    parsing does: with two plugins, or under the remote or L2 prefix, a
    bare 'path:' did not say which."""
    try:
        return ChunkStore(options)
    except ConfigError as e:
        msg = str(e)
        if msg.partition(":")[0] in FxOptions.doc():
            raise ConfigError(f"{where}{msg}") from None
        raise


def plugin_name(config, cls, names=None, prefix: str = "storage_plugin.", list_name: str = "storage_plugins") -> str:
    """The entry of LMCache's plugin list this instance was built for. LMCache
    does not pass it, so take the next entry naming this class, in the order
    LMCache builds them: `names` (default: the storage_plugins set, which
    LMCache iterates as a set)."""
    extra = (config.extra_config if config is not None else None) or {}
    if names is None:
        names = set(config.storage_plugins or []) if config is not None else []
    mine = [
        n
        for n in names
        if extra.get(f"{prefix}{n}.class_name") == cls.__name__
        and extra.get(f"{prefix}{n}.module_path") == cls.__module__
    ]
    if not mine:
        raise ConfigError(
            f"{list_name} has no entry whose {prefix}<name>.module_path is {cls.__module__} "
            f"and class_name is {cls.__name__}"
        )
    with _claim_lock:
        taken = _claimed.setdefault((id(config), prefix), set())
        named = _name_in_builder(mine)
        if named is not None:
            taken.add(named)
            return named
        for n in mine:
            if n not in taken:
                taken.add(n)
                return n
    return mine[0]  # a rebuild of an instance already made


def _name_in_builder(mine: list) -> Optional[str]:
    """The entry LMCache's builder is making, read from its loop variable
    (`storage_plugin` in storage_plugin_launcher, `plugin_name` where
    RemoteBackends are made): a rebuild (StorageManager.recreate_backend
    makes every storage plugin again) then gets each instance's own name,
    where counting claims would hand a second instance the first's."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            break
        for var in ("storage_plugin", "plugin_name"):
            v = frame.f_locals.get(var)
            if isinstance(v, str) and v in mine:
                return v
        frame = frame.f_back
    return None


def meta_of(obj: MemoryObj) -> ChunkMeta:
    """The ChunkMeta of an LMCache memory object. Built once per shape, dtype
    and format (ChunkMeta is immutable): building it costs ~1.5 µs, about a
    tenth of a small chunk's whole load from memory, for every object of a
    batch that all share one."""
    m = obj.meta
    if m.shapes or m.dtypes:  # several tensors per object: rare, built each time
        return _build_meta(m.shapes or [m.shape], m.dtypes or [m.dtype], m.fmt)
    try:
        return _meta_for(m.shape, m.dtype, m.fmt)
    except TypeError:  # a shape given as a list: not a cache key
        return _build_meta([m.shape], [m.dtype], m.fmt)


@functools.lru_cache(maxsize=1024)
def _meta_for(shape, dtype, fmt) -> ChunkMeta:
    return _build_meta([shape], [dtype], fmt)


def _build_meta(shapes, dtypes, fmt) -> ChunkMeta:
    return ChunkMeta(
        tuple(tuple(int(x) for x in s) for s in shapes),
        tuple(str(d).removeprefix("torch.") for d in dtypes),
        fmt.name,
    )


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def hit_prefix(objs: list) -> list:
    """The objects up to the first miss (LMCache's async loads take a
    prefix); the objects after it are released."""
    out = []
    for o in objs:
        if o is None:
            break
        out.append(o)
    for o in objs[len(out) :]:
        if o is not None:
            o.ref_count_down()
    return out


_TENSOR_FORMATS = ("KV_2LTD", "KV_MLA_FMT", "KV_T2D", "KV_2TD")


def engine_format(metadata, config) -> Optional[str]:
    """The MemoryFormat name of the KV objects an LMCacheEngine of this
    metadata and config stores, as LMCacheEngine chooses it (layerwise: one
    layer's KV per object); None without metadata."""
    if metadata is None:
        return None
    mla = bool(getattr(metadata, "use_mla", False))
    if getattr(config, "use_layerwise", False):
        return "KV_MLA_FMT" if mla else "KV_2TD" if getattr(config, "enable_blending", False) else "KV_T2D"
    return "KV_MLA_FMT" if mla else "KV_2LTD"


def _per_layer(meta: ChunkMeta) -> bool:
    """A chunk of one layer's KV (layerwise): KV_T2D, KV_2TD, 2-D KV_MLA_FMT."""
    return meta.fmt in ("KV_T2D", "KV_2TD") or (meta.fmt == "KV_MLA_FMT" and len(meta.shapes[0]) == 2)


def _tokens(meta: ChunkMeta) -> int:
    """The token count a tensor chunk's shape holds (0: not of its format's rank)."""
    s = meta.shapes[0] if meta.shapes else ()
    if meta.fmt == "KV_2TD":
        return s[1] if len(s) == 3 else 0
    if meta.fmt == "KV_T2D" or (meta.fmt == "KV_MLA_FMT" and len(s) == 2):
        return s[0] if len(s) in (2, 3) else 0
    return s[2] if len(s) == 4 else 0


class EngineShapes:
    """Whether a stored chunk is a chunk of this engine's KV cache: of the
    format this engine stores (a layerwise engine's per-layer objects, a
    blending engine's, MLA's), and of the shapes and dtypes LMCacheMetadata
    gives a chunk of its token count. Keys carry no geometry, so two models
    served under one model name (each at /model, say) share them, and a chunk
    of the other one's shape, handed to LMCache, made its retrieve raise, or
    loaded KV of another model or layout. Such a chunk is a miss. Chunks this
    engine writes record its KV heads and head size (ChunkMeta.kv; a shape
    holds their product) and, of one layer, its layer count (ChunkMeta.layers),
    which other engines hold them to. Not checked: chunks of several tensors
    while the serving engine has not registered its layer groups (until then
    the metadata knows one), and formats that are not KV tensors (a serde's).
    Judged once per meta; again once the layer groups are registered."""

    def __init__(self, metadata, store=None, config=None):
        self._md = metadata
        self._store = store  # for its burst_warning
        self._fmt = engine_format(metadata, config)
        self._layerwise = bool(getattr(config, "use_layerwise", False))
        self._judged: dict[ChunkMeta, Optional[ChunkMeta]] = {}  # meta -> None if it fits, else what would
        self._groups = None
        self._written: dict[ChunkMeta, ChunkMeta] = {}
        try:  # (layers, 2, chunk, KV heads, head size): the last two, which the shapes multiply
            self._kv = tuple(int(x) for x in metadata.kv_shape[3:5])
            self._layers = int(metadata.kv_shape[0])
        except (AttributeError, TypeError, ValueError, IndexError):
            self._kv, self._layers = (), 0

    def for_write(self, meta: ChunkMeta) -> ChunkMeta:
        """The meta a chunk of this engine is stored with: a KV tensor chunk
        records this engine's KV heads and head size, one of one layer also
        its layer count, which fits() holds other chunks to."""
        if not self._kv or meta.fmt not in _TENSOR_FORMATS or meta.kv or meta.layers:
            return meta
        out = self._written.get(meta)
        if out is None:
            layers = self._layers if _per_layer(meta) else 0
            out = self._written[meta] = dataclasses.replace(meta, kv=self._kv, layers=layers)
        return out

    def fits(self, meta: ChunkMeta) -> bool:
        md = self._md
        if md is None or meta.fmt not in _TENSOR_FORMATS:
            return True
        groups = getattr(md, "kv_layer_groups_manager", None)
        if groups is not self._groups:
            self._judged, self._groups = {}, groups
        if meta not in self._judged:
            self._judged[meta] = self._misfit(meta, groups)
        want = self._judged[meta]
        if want is not None and self._store is not None:
            self._store.burst_warning(
                "chunks of another shape",
                "lmcache-fx: stored chunk has shapes %s (%s, %s%s), this engine's KV cache makes %s (%s, %s%s) for its "
                "tokens: another model or LMCache mode under this model name? miss",
                meta.shapes,
                meta.dtypes,
                meta.fmt,
                _recorded(meta),
                want.shapes,
                want.dtypes,
                want.fmt,
                _recorded(want) if meta.kv or meta.layers else "",
            )
        return want is None

    def _misfit(self, meta: ChunkMeta, groups) -> Optional[ChunkMeta]:
        """None when meta fits, else the meta this engine would have made."""
        if groups is None and len(meta.shapes) != 1:
            return None  # several tensors: the groups are not known yet
        if meta.fmt == "KV_MLA_FMT" and len(meta.shapes[0]) == 3:
            return None  # MLA through a layerwise connector that shapes it [T, 2, H] or [2, T, H]: not judged
        try:
            want = self._want(self._fmt, _tokens(meta))
        except (AttributeError, TypeError, IndexError, ValueError, KeyError):  # metadata without these: not checked
            return None
        # A chunk that records its writer's KV heads and head size (and layer count) must have this
        # engine's (an older writer's records none: its shapes are all there is to judge).
        kv_fits = not meta.kv or not self._kv or meta.kv == self._kv
        layers_fit = not meta.layers or not self._layers or meta.layers == self._layers
        if kv_fits and layers_fit and want == dataclasses.replace(meta, kv=(), layers=0):
            return None
        return dataclasses.replace(want, kv=self._kv, layers=self._layers if _per_layer(want) else 0)

    def _want(self, fmt: Optional[str], tokens: int) -> Optional[ChunkMeta]:
        """The meta of a chunk of `tokens` tokens this engine makes in `fmt`
        (its own format): a chunkwise engine's from LMCacheMetadata's shapes,
        a layerwise engine's one layer as LMCache's layerwise connectors shape it."""
        md = self._md
        if fmt == "KV_2LTD" or (fmt == "KV_MLA_FMT" and not self._layerwise):
            return _build_meta(md.get_shapes(tokens), md.get_dtypes(), MemoryFormat[fmt])
        shape = {"KV_MLA_FMT": (tokens, self._hidden()), "KV_T2D": (tokens, 2, self._hidden())}.get(
            fmt, (2, tokens, self._hidden())
        )
        return _build_meta([shape], [md.kv_dtype], MemoryFormat[fmt])  # as store_layer allocates

    def _hidden(self) -> int:
        return int(self._md.kv_shape[3]) * int(self._md.kv_shape[4])


def _recorded(meta: ChunkMeta) -> str:
    """What the writer recorded beyond the shapes, for a warning."""
    said = ([f"KV heads x head size {meta.kv}"] if meta.kv else []) + ([f"{meta.layers} layers"] if meta.layers else [])
    return ", " + ", ".join(said) if said else ""


def _alloc_args(meta: ChunkMeta) -> Optional[tuple]:
    """(shapes, dtypes, fmt) of LMCache's allocators for a chunk's meta, or
    None (warned) when it names what this torch or LMCache does not have."""
    try:
        return [torch.Size(s) for s in meta.shapes], [_torch_dtype(d) for d in meta.dtypes], MemoryFormat[meta.fmt]
    except (KeyError, ValueError) as e:
        log.warning("lmcache-fx: chunk meta not usable here (%s); miss", e)
        return None


def allocate_from(local_cpu_backend, meta: ChunkMeta, busy_loop: bool = True):
    """A MemoryObj for a chunk from LMCache's pool, as (obj, address, bytes)
    for ChunkStore reads; None when the pool is full or the meta is foreign."""
    args = _alloc_args(meta)
    if args is None:
        return None
    if busy_loop and _meta_bytes(meta) > _pool_bytes(local_cpu_backend):
        # LMCache's busy loop waits for room that never comes (a header may say anything its CRC covers).
        log.warning("lmcache-fx: a chunk of %s is larger than LMCache's CPU pool; miss", meta.shapes)
        return None
    obj = local_cpu_backend.allocate(*args, busy_loop=busy_loop)
    if obj is None:
        return None
    return obj, obj.data_ptr, obj.get_size()


@functools.lru_cache(maxsize=1024)
def _meta_bytes(meta: ChunkMeta) -> int:
    """Bytes of the tensors a meta describes (its dtypes known: _alloc_args
    has taken it); per meta once, off the per-chunk path."""
    return sum(math.prod(s) * _torch_dtype(d).itemsize for s, d in zip(meta.shapes, meta.dtypes))


def _pool_buffer(local_cpu_backend) -> tuple[int, int]:
    """(address, bytes) of LMCache's CPU pool; raises where it is not one flat buffer."""
    buf = local_cpu_backend.get_memory_allocator().buffer
    return buf.data_ptr(), buf.numel() * buf.element_size()


def _pool_bytes(local_cpu_backend) -> float:
    """The size of LMCache's CPU pool, where it is one flat buffer; else
    unbounded (inf). Asked once per backend (its pool does not change), kept
    on it as before_pool_frees keeps its hooks."""
    size = local_cpu_backend.__dict__.get("_lmcache_fx_pool_bytes")
    if size is None:
        try:
            size = float(_pool_buffer(local_cpu_backend)[1])
        except Exception:
            size = float("inf")
        local_cpu_backend._lmcache_fx_pool_bytes = size
    return size


def allocate_many_from(local_cpu_backend, meta: ChunkMeta, count: int) -> Optional[list]:
    """`count` MemoryObjs of one meta from LMCache's pool in one call of its
    allocator's batched_allocate, as allocate_from's triples; None when the
    pool has no such call or cannot give them all now (nothing is evicted
    here: the caller then allocates one by one, which evicts). One call per
    batch: LocalCPUBackend.allocate per object was half of the plugin's read
    of a small chunk from memory (docs/benchmarks.md, "Cost per chunk")."""
    batched = getattr(getattr(local_cpu_backend, "memory_allocator", None), "batched_allocate", None)
    args = _alloc_args(meta) if batched is not None else None
    if args is None:
        return None
    objs = batched(args[0], args[1], count, args[2])
    if objs is None or len(objs) != count:
        for o in objs or ():
            o.ref_count_down()
        return None
    return [(o, o.data_ptr, o.get_size()) for o in objs]


def _thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str:
    """The transparent huge page mode in force ("always", "madvise",
    "never"), "" where it cannot be read."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def register_memory(engine, addr: int, size: int, what: str) -> bool:
    """Huge pages and io_uring fixed buffers on memory LMCache reads into,
    where the kernel allows: bigger requests and no per-I/O page pinning.
    What is refused for a reason the operator can change (huge pages off,
    the memlock limit) is one warning per process: at INFO, a server's
    default logging showed none of it, and doctor was the only place that
    said what it costs."""
    if not addr or not size:
        return False
    _fxio.advise_hugepages(addr, size)
    if _thp_mode() == "never":
        log_once(
            log,
            "thp",
            logging.WARNING,
            "lmcache-fx: transparent huge pages are off (never): %s stays in 4 KiB pages, and reads into it "
            "take more CPU per GB (smaller requests, a page pinned per 4 KiB); fix: echo madvise > "
            "/sys/kernel/mm/transparent_hugepage/enabled (lmcache-fx doctor measures the cost)",
            what,
        )
    r = engine.register_buffer(addr, size)
    if r == -errno.EOPNOTSUPP:
        log.info(
            "lmcache-fx: %s (%.1f GiB) not registered as fixed buffers: this kernel cannot share one registration "
            "among io_uring rings (IORING_REGISTER_CLONE_BUFFERS, Linux 6.12+), and pinning it again for each "
            "ring would hold up the first concurrent reads; plain reads are used",
            what,
            size / (1 << 30),
        )
        return False
    if r in (-errno.ENOMEM, -errno.EPERM) and memlock_refuses(size):
        log_once(
            log,
            "memlock",
            logging.WARNING,
            "lmcache-fx: %s (%.1f GiB) not registered as io_uring fixed buffers (%s): the locked-memory limit "
            "(RLIMIT_MEMLOCK, ulimit -l: %s) is below it and the process lacks CAP_IPC_LOCK; plain reads are used, "
            "which pin pages on every read (more CPU per GB); fix: raise it (docker run --ulimit memlock=-1, "
            "or LimitMEMLOCK=infinity in a systemd unit)",
            what,
            size / (1 << 30),
            os.strerror(-r),
            memlock_text(resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]),
        )
        return False
    if r < 0:
        log.info("lmcache-fx: %s not registered as fixed buffers (%s); plain reads are used", what, os.strerror(-r))
        return False
    return True


def register_pool(engine, local_cpu_backend) -> bool:
    """register_memory on LMCache's CPU pool, when it is one flat buffer."""
    try:
        addr, size = _pool_buffer(local_cpu_backend)
    except Exception as e:  # an allocator without one flat buffer
        log.debug("lmcache-fx: no flat pool to register (%s)", e)
        return False
    return register_memory(engine, addr, size, "LMCache's CPU pool")


def before_pool_frees(local_cpu_backend, finish: Callable[[], None]) -> Callable[[], None]:
    """Runs finish() when LMCache closes its LocalCPUBackend, before the
    backend frees the pool that queued stores are written from. LMCache's
    StorageManager.close closes backends in the order it made them, the CPU
    tier first, so a plugin's own close() comes after the pool is gone: a
    store still queued then reads freed memory (a segfault, or another
    object's bytes under this key). Returns what removes the hook (close)."""
    hooks = local_cpu_backend.__dict__.get("_lmcache_fx_before_close")
    if hooks is None:
        hooks = []
        close_pool = local_cpu_backend.close

        def close() -> None:
            for hook in list(hooks):
                try:
                    hook()
                except Exception:
                    log.exception("lmcache-fx: finishing before LMCache's CPU pool closes failed")
            close_pool()

        local_cpu_backend._lmcache_fx_before_close = hooks
        local_cpu_backend.close = close  # this instance only: LMCache calls backend.close()
    hooks.append(finish)

    def remove() -> None:
        if finish in hooks:
            hooks.remove(finish)

    return remove


def worker_metrics_port(options, metadata, prefix: str) -> int:
    """metrics_port plus this worker's local id (one port per worker on a
    host: tensor-parallel workers must not collide); 0 when off.
    ConfigError when that passes 65535."""
    port = options.metrics_port
    if port:
        port += int(getattr(metadata, "local_worker_id", 0) or 0)
        if port > 65535:
            raise ConfigError(
                f"{prefix}metrics_port: {options.metrics_port} + local worker id "
                f"{port - options.metrics_port} = {port} is above 65535; pick a lower port"
            )
    return port


def gpu_index(dst_device) -> Optional[int]:
    """The GPU ordinal of LMCache's dst_device ('cuda:1' -> 1), None for the current one."""
    s = str(dst_device or "")
    if s.startswith("cuda") or s.startswith("hip"):
        return int(s.split(":", 1)[1]) if ":" in s else None
    return None
