"""A real LMCacheEngine on CPU, for tests, the benchmark and the demo.

LMCache's MockGPUConnector moves nothing, so this module supplies a small
connector that really gathers and scatters a paged KV cache (per layer
[kv_size, num_blocks, block_size, kv_heads, head_dim]) through a slot
mapping into LMCache's chunk objects ([kv_size, layers, tokens, heads*dim]).
"""

from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager

import torch
import yaml
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from ..integration.connector import ChunkwiseConnector

__all__ = [
    "ChunkwiseConnector",
    "PagedCPUConnector",
    "Geometry",
    "KV",
    "fx_config",
    "config_from_dict",
    "engine_on_cpu",
    "lmcache_engine",
    "fx_backend",
    "store_and_wait",
    "retrieve",
]


class PagedCPUConnector(ChunkwiseConnector):
    """A paged KV cache on the CPU. With keep_first_caches it behaves as
    LMCache's CUDA connector does: it keeps the first KV caches it is given
    and works on them from then on, whatever a later call passes (vLLM's
    caches never move)."""

    def __init__(self, num_layers, kv_size, kv_heads, head_dim, keep_first_caches=False):
        self.num_layers, self.kv_size = num_layers, kv_size
        self.hidden = kv_heads * head_dim
        self.kvcaches = None
        self.keep_first_caches = keep_first_caches

    def _flat(self, kvcaches, layer):
        # [kv_size, num_blocks, block_size, H, D] -> [kv_size, slots, H*D]
        if self.keep_first_caches:
            if self.kvcaches is None:
                self.kvcaches = kvcaches
            kvcaches = self.kvcaches
        t = kvcaches[layer]
        return t.view(self.kv_size, -1, self.hidden)

    def from_gpu(self, memory_obj, start, end, **kw):
        slots = kw["slot_mapping"][start:end]
        dst = memory_obj.tensor
        for layer in range(self.num_layers):
            dst[:, layer, : end - start, :] = self._flat(kw["kvcaches"], layer)[:, slots, :]

    def to_gpu(self, memory_obj, start, end, **kw):
        slots = kw["slot_mapping"][start:end]
        src = memory_obj.tensor
        for layer in range(self.num_layers):
            self._flat(kw["kvcaches"], layer)[:, slots, :] = src[:, layer, : end - start, :]

    def get_shape(self, num_tokens):
        return torch.Size([self.kv_size, self.num_layers, num_tokens, self.hidden])


class Geometry:
    """A model's KV geometry: layers, kv heads, head dim, dtype, MLA or not."""

    def __init__(self, layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16, mla=False, chunk=256):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.mla, self.chunk = dtype, mla, chunk
        self.kv_size = 1 if mla else 2

    @property
    def bytes_per_token(self):
        return (
            self.kv_size
            * self.layers
            * self.kv_heads
            * self.head_dim
            * torch.tensor([], dtype=self.dtype).element_size()
        )

    def kv_shape(self):
        return (self.layers, self.kv_size, self.chunk, self.kv_heads, self.head_dim)


def fx_config(path, name="fx", local_cpu=False, cpu_gb=0.5, chunk=256, extra=None, **opts):
    """The LMCache YAML a user writes, parsed by LMCache itself."""
    cfg = {
        "chunk_size": chunk,
        "local_cpu": local_cpu,
        "max_local_cpu_size": cpu_gb,
        "storage_plugins": [name],
        "extra_config": {
            f"storage_plugin.{name}.module_path": "lmcache_fx.lmcache_plugin",
            f"storage_plugin.{name}.class_name": "FxStorageBackend",
            f"storage_plugin.{name}.path": str(path),
            **{f"storage_plugin.{name}.{k}": v for k, v in opts.items()},
            **(extra or {}),
        },
    }
    return cfg


def config_from_dict(d: dict, tmpdir) -> LMCacheEngineConfig:
    p = os.path.join(str(tmpdir), f"lmcache-{uuid.uuid4().hex[:8]}.yaml")
    with open(p, "w") as f:
        yaml.safe_dump(d, f)
    cfg = LMCacheEngineConfig.from_file(p)
    cfg.validate()
    return cfg


class KV:
    """A paged KV cache filled with random values, and a slot mapping."""

    def __init__(self, geo: Geometry, num_tokens: int, seed: int = 0, block_size: int = 16):
        g = torch.Generator().manual_seed(seed)
        nblocks = (num_tokens + block_size - 1) // block_size + 2
        shape = (geo.kv_size, nblocks, block_size, geo.kv_heads, geo.head_dim)
        self.caches = [torch.randn(shape, generator=g).to(geo.dtype) for _ in range(geo.layers)]
        # A shuffled slot mapping, like a real paged cache.
        self.slot_mapping = torch.randperm(nblocks * block_size, generator=g)[:num_tokens]

    def empty_like(self):
        other = object.__new__(KV)
        other.caches = [torch.zeros_like(c) for c in self.caches]
        other.slot_mapping = self.slot_mapping
        return other

    def equal_share(self, other, n) -> float:
        """The share of the first n tokens' values (all layers) that equal other's."""
        s = self.slot_mapping[:n]
        same = total = 0
        for a, b in zip(self.caches, other.caches):
            x = a.view(a.shape[0], -1, a.shape[-2] * a.shape[-1])[:, s]
            y = b.view(b.shape[0], -1, b.shape[-2] * b.shape[-1])[:, s]
            same += int((x == y).sum())
            total += x.numel()
        return same / total if total else 1.0

    def tokens_equal(self, other, n) -> bool:
        s = self.slot_mapping[:n]
        return all(
            torch.equal(
                a.view(a.shape[0], -1, a.shape[-2] * a.shape[-1])[:, s],
                b.view(b.shape[0], -1, b.shape[-2] * b.shape[-1])[:, s],
            )
            for a, b in zip(self.caches, other.caches)
        )


@contextmanager
def engine_on_cpu(
    cfg: LMCacheEngineConfig,
    connector,
    kv_dtype,
    kv_shape,
    use_mla,
    chunk_size,
    model,
    prefix="fx",
    async_lookup=False,
):
    """A single-worker LMCacheEngine with the given connector, destroyed on
    exit (an engine left alive keeps a non-daemon thread and hangs exit).
    LMCache's usage reporting is turned off unless the caller chose. With
    `async_lookup` (and enable_async_loading in cfg) the engine gets LMCache's
    async lookup server, and engine.fx_lookup_client is the scheduler side's
    client talking to it over ZMQ, as vLLM's scheduler would."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    iid = f"{prefix}-{uuid.uuid4().hex[:8]}"
    md = LMCacheMetadata(
        model_name=model,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=kv_dtype,
        kv_shape=kv_shape,
        use_mla=use_mla,
        role="worker",
        chunk_size=chunk_size,
        engine_id=iid,  # names the lookup client's and server's ZMQ sockets
    )
    engine = LMCacheEngineBuilder.get_or_create(iid, cfg, md, connector, lambda *a, **k: None, lambda *a, **k: None)
    server = client = None
    try:
        if async_lookup:
            from lmcache.v1.lookup_client.lmcache_async_lookup_client import (
                LMCacheAsyncLookupClient,
                LMCacheAsyncLookupServer,
            )

            server = LMCacheAsyncLookupServer(engine, md)
            engine.post_init(async_lookup_server=server)
            client = engine.fx_lookup_client = LMCacheAsyncLookupClient(cfg, md)
        else:
            engine.post_init()
        yield engine
    finally:
        if client is not None and server is not None:
            # the threads still running when their sockets close (tests check it is none)
            engine.fx_lookup_threads_at_close = _stop_lookup_threads(client, server)
        for end in (client, server):
            if end is not None:
                end.close()
        LMCacheEngineBuilder.destroy(iid)


def _stop_lookup_threads(client, server, timeout: float = 5.0) -> list:
    """Lets the async lookup client's and server's threads leave before
    their sockets close. LMCache's close() only clears `running` and joins
    for 1 s while each thread sits in a blocking recv(), then closes the
    socket under it; a ZMQ socket used from two threads at once aborts the
    process (seen once in CI, in this teardown). Each thread is woken by one
    harmless message: the server by a cleanup for a lookup id nobody used,
    the client by a response for it. Returns the names of those still
    running after `timeout`."""
    lookup_id = f"fx-shutdown-{uuid.uuid4().hex[:8]}"
    client.running = server.running = False
    try:
        client._send_cleanup_message(lookup_id)
        server.send_response_to_scheduler(lookup_id, 0)
    except Exception:  # a socket already gone: nothing of that end to wake
        pass
    for end in (client, server):
        end.thread.join(timeout)
    return [end.thread.name for end in (client, server) if end.thread.is_alive()]


@contextmanager
def lmcache_engine(
    cfg: LMCacheEngineConfig, geo: Geometry, model="fx-test-model", async_lookup=False, keep_first_caches=False
):
    conn = PagedCPUConnector(geo.layers, geo.kv_size, geo.kv_heads, geo.head_dim, keep_first_caches)
    with engine_on_cpu(
        cfg, conn, geo.dtype, geo.kv_shape(), geo.mla, geo.chunk, model, async_lookup=async_lookup
    ) as engine:
        yield engine


def async_lookup(engine, tokens, lookup_id: str, timeout: float = 30.0) -> int:
    """LMCache's async loading as vLLM's scheduler drives it: register the
    lookup, send it to the worker's lookup server, poll until the worker has
    looked up and prefetched; returns the hit tokens it reported."""
    client = engine.fx_lookup_client
    if client.lookup_cache(lookup_id) != -1:
        raise RuntimeError(f"lookup {lookup_id} already known")
    client.lookup(tokens, lookup_id)
    end = time.monotonic() + timeout
    while (n := client.lookup_cache(lookup_id)) is None:
        if time.monotonic() > end:
            raise TimeoutError(f"async lookup {lookup_id} not answered in {timeout:.0f} s")
        time.sleep(0.005)
    return n


def fx_backend(engine, name="fx"):
    backends = engine.storage_manager.storage_backends
    assert name in backends, f"plugin {name} not loaded; backends: {list(backends)}"
    return backends[name]


def store_and_wait(engine, tokens, kv: KV, backend=None, timeout=60):
    engine.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
    if backend is not None and hasattr(backend, "flush"):
        backend.flush(timeout)


def retrieve(engine, tokens, kv: KV):
    mask = engine.retrieve(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
    return int(mask.sum())
