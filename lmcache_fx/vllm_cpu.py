"""vLLM general plugin: LMCache's KV connector for vLLM on CPU.

LMCache 0.5.6 ships vLLM KV connectors for cuda, xpu, musa and hpu only; on a
CPU build of vLLM its `CreateGPUConnector` fails and LMCache runs "in degraded
mode (recompute)". This plugin supplies the missing connector.

vLLM loads it in every process through the entry point

    [project.entry-points."vllm.general_plugins"]
    lmcache_fx_cpu = "lmcache_fx.vllm_cpu:register"

`register()` imports nothing heavy: importing lmcache (or torch/vLLM parts)
while vLLM loads plugins crashed worker start-up. It only installs an import
hook; when LMCache's `lmcache.v1.gpu_connector` module is first imported, its
`CreateGPUConnector` is wrapped. The wrapper acts only when the engine is
vLLM, vLLM runs on CPU and LMCache detected a CPU device; everything else goes
to LMCache's own function unchanged.

Set LMCACHE_FX_VLLM_CPU=0 to disable. With LMCACHE_FX_STATS_FILE=<path>, the
worker writes the lmcache-fx tier's counters (chunks/bytes read, hits,
corrupt, read seconds) there as JSON whenever they change (worker N > 0 to
<path>.rank<N>), and logs them
("lmcache-fx stats: {...}"), so a client of the server can see what fx served.
"""

from __future__ import annotations

import importlib.abc
import json
import logging
import os
import sys
import threading
import time

log = logging.getLogger("lmcache_fx.vllm_cpu")

_TARGET = "lmcache.v1.gpu_connector"
_PATCHED = "_lmcache_fx_cpu_patched"


# --------------------------------------------------------------- the hook
def register() -> None:
    """vLLM's plugin entry point: install the lazy patch. Cheap and safe in
    every process (API server, engine core, workers)."""
    if os.environ.get("LMCACHE_FX_VLLM_CPU", "1").strip().lower() in ("0", "false", "no", "off"):
        return
    mod = sys.modules.get(_TARGET)
    if mod is not None:
        _patch(mod)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of LMCache's gpu_connector
    package so the patch is applied right after the module runs."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = None
        for finder in sys.meta_path:  # whoever would have found it (normally PathFinder)
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):  # get_source, is_package, ... for tracebacks and tools
        return getattr(self._inner, name)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            _patch(module)
        except Exception:  # never break LMCache's import
            log.exception("lmcache-fx: could not install the vLLM CPU connector")


def _patch(mod) -> None:
    orig = getattr(mod, "CreateGPUConnector", None)
    if orig is None or getattr(orig, _PATCHED, False):
        return

    def CreateGPUConnector(config, metadata, engine, layout_hints=None, *args, **kwargs):
        if _cpu_vllm(engine):
            for flag in ("use_layerwise", "enable_blending", "use_gpu_connector_v3"):
                if getattr(config, flag, False):
                    raise ValueError(
                        f"lmcache-fx CPU connector: {flag}: true is not supported on CPU; "
                        f"set {flag}: false in the LMCache config"
                    )
            conn = connector_class().from_metadata(metadata)
            log.info(
                "lmcache-fx: vLLM on CPU: using the lmcache-fx CPU KV connector (%d layers, %d kv heads x %d, %s)",
                conn.num_layers,
                conn.kv_heads,
                conn.head_dim,
                metadata.kv_dtype,
            )
            _start_stats_reporter()
            return conn
        return orig(config, metadata, engine, layout_hints, *args, **kwargs)

    CreateGPUConnector.__wrapped__ = orig
    CreateGPUConnector.__doc__ = orig.__doc__
    setattr(CreateGPUConnector, _PATCHED, True)
    mod.CreateGPUConnector = CreateGPUConnector


def _cpu_vllm(engine) -> bool:
    """vLLM is the engine, vLLM runs on CPU, and LMCache detected a CPU device."""
    try:
        from lmcache import torch_device_type
        from lmcache.utils import EngineType

        if engine != EngineType.VLLM or torch_device_type not in ("cpu", ""):
            return False
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception as e:  # an LMCache or vLLM without what this asks: say so, the KV goes unstored
        log.warning(
            "lmcache-fx: cannot tell whether this is a vLLM CPU worker (%s: %s); LMCache's own connector "
            "(made for GPUs) is used instead of lmcache-fx's CPU one",
            type(e).__name__,
            e,
        )
        return False


# --------------------------------------------------------------- the connector
_connector_cls = None


def connector_class():
    """The connector class, built on first use (it subclasses LMCache's
    GPUConnectorInterface, so importing this module imports no LMCache)."""
    global _connector_cls
    if _connector_cls is None:
        _connector_cls = _make_connector_class()
    return _connector_cls


def _vec_block_positions(H: int, bs: int, D: int):
    """The layout of vLLM-CPU's vec and vec16 kernels inside one block of the
    [num_blocks, H, bs, 2 * D] cache (seen by its attention as [H, 2 * bs, D],
    K the first bs rows): K transposed for their dot products, [H, D, bs], V
    token by token, [H, bs, D]. [bs, 2 * H * D]: for each token the flat
    positions in the block of its K (H * D) then V (H * D) values."""
    import torch

    h = torch.arange(H).view(H, 1, 1) * (2 * bs * D)
    t = torch.arange(bs).view(1, bs, 1)
    d = torch.arange(D).view(1, 1, D)
    k = h + d * bs + t  # [H, bs, D]
    v = h + bs * D + t * D + d
    return torch.stack([k, v]).permute(2, 0, 1, 3).reshape(bs, 2 * H * D)


def _learned_block_positions(H: int, bs: int, D: int, dtype):
    """The same map learned from vLLM's own kernel, the one its attention
    stores with (vLLM picks an ISA per CPU: vec, vec16, amx, neon, ...; each
    owns its layout): token ids written a base-256 digit at a time (exact in
    every float dtype) into one block, read back. None where vLLM is not
    importable (no vLLM-CPU worker here: the tests); ValueError where its
    kernel stores no permutation of the values (a quantized cache)."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # noqa: BLE001 - vLLM absent or of another layout
        return None
    import torch

    isa = "?"
    n = 2 * bs * H * D
    ids = torch.arange(n).view(2, bs, H, D)
    where = torch.zeros(n, dtype=torch.long)
    try:
        isa = _get_attn_isa(dtype, bs, D)  # what vLLM's attention picks for this cache
        for digit in range(max(1, ((n - 1).bit_length() + 7) // 8)):
            part = (ids >> (8 * digit)) & 255
            block = torch.full((1, H, bs, 2 * D), -1, dtype=dtype)
            kc, vc = block.view(1, H, 2 * bs, D).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(part[0].to(dtype), part[1].to(dtype), kc, vc, torch.arange(bs), isa)
            got = block.flatten().to(torch.long)
            if (got < 0).any() or (got > 255).any():
                raise ValueError("values were not stored as given")
            where += got << (8 * digit)
    except Exception as e:  # noqa: BLE001 - the kernel's own error, named
        raise ValueError(f"lmcache-fx CPU connector: cannot learn vLLM-CPU's {isa} KV block layout: {e}") from None
    if not torch.equal(torch.sort(where).values, torch.arange(n)):
        raise ValueError(f"lmcache-fx CPU connector: vLLM-CPU's {isa} kernel stores no permutation of the KV values")
    pos = torch.empty(n, dtype=torch.long)
    pos[where] = torch.arange(n)  # pos[id]: where the value with that id lies
    return pos.view(2, bs, H * D).transpose(0, 1).reshape(bs, 2 * H * D)


def _make_connector_class():
    import torch

    from .integration.connector import ChunkwiseConnector

    class VLLMPagedMemCPUConnector(ChunkwiseConnector):
        """Copies between vLLM-CPU's paged KV cache and LMCache's KV_2LTD chunk
        objects ([2, layers, tokens, kv_heads * head_dim]) with index ops.

        vLLM-CPU 0.32.0 keeps one tensor per layer shaped
        [num_blocks, kv_heads, block_size, 2 * head_dim]; slot s is token
        s % block_size of block s // block_size. Where in a block a token's
        values lie is its kernels' choice (the vec kernels keep K transposed):
        learned from vLLM's own kernel at first use (_learned_block_positions),
        so a chunk that covers part of a block (a chunk size that is no
        multiple of the block size, the last chunk of a prompt) holds each
        token's K and V, in token order. (Read as plain rows before, K came back
        right only for whole blocks.) The layouts common on GPUs, [2, num_blocks,
        block_size, kv_heads, head_dim] and [num_blocks, 2, block_size,
        kv_heads, head_dim], are accepted too.
        """

        def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype):
            self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
            self.hidden = kv_heads * head_dim
            self.dtype = dtype
            self.kvcaches = None
            self._positions: dict = {}  # (block_size, dtype) -> vLLM-CPU's block layout, or why it has none
            self._index = (None, None, None)  # (slots, layout key, flat index): one per call, every layer's

        @classmethod
        def from_metadata(cls, metadata, *a, **k):
            if metadata.use_mla:
                raise ValueError("lmcache-fx CPU connector: MLA models are not supported")
            if metadata.kv_dtype not in (torch.float32, torch.float16, torch.bfloat16):
                # vLLM-CPU's quantized caches keep scales beside the values; the connector moves float values
                raise ValueError(
                    f"lmcache-fx CPU connector: a {metadata.kv_dtype} KV cache is not supported; "
                    "set vLLM's kv_cache_dtype to auto"
                )
            num_layers, _kv, _chunk, kv_heads, head_dim = metadata.kv_shape
            return cls(int(num_layers), int(kv_heads), int(head_dim), metadata.kv_dtype)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.hidden])

        # ---- views of one layer's cache for a set of slots
        def _split(self, t: torch.Tensor, slots: torch.Tensor):
            """(index function) -> a getter and a setter of [n, 2, H*D] for `slots`."""
            H, D = self.kv_heads, self.head_dim
            n = slots.numel()
            if t.dim() == 4 and t.shape[1] == H and t.shape[3] == 2 * D:  # vLLM-CPU: [nb, H, bs, 2D]
                nb, _, bs, _ = t.shape
                idx = self._flat_index(slots, bs, t.dtype)
                flat = t.view(nb * H * bs * 2 * D)

                def get():
                    return flat.index_select(0, idx).view(n, 2, H * D)

                def put(v):  # v: [n, 2, H*D]
                    flat.index_copy_(0, idx, v.reshape(n * 2 * H * D).to(t.dtype))

                return get, put
            if t.dim() == 5 and t.shape[0] == 2:  # [2, nb, bs, H, D]
                flat = t.view(2, -1, H * D)

                def get():
                    return flat[:, slots].transpose(0, 1)

                def put(v):
                    flat[:, slots] = v.transpose(0, 1).to(t.dtype)

                return get, put
            if t.dim() == 5 and t.shape[1] == 2:  # [nb, 2, bs, H, D]
                bs = t.shape[2]
                blk, off = slots // bs, slots % bs

                def get():
                    return t[blk, :, off].reshape(n, 2, H * D)

                def put(v):
                    t[blk, :, off] = v.view(n, 2, H, D).to(t.dtype)

                return get, put
            raise ValueError(
                f"lmcache-fx CPU connector: unknown KV cache layout {tuple(t.shape)} for {H} kv heads x {D}"
            )

        def _flat_index(self, slots: torch.Tensor, bs: int, dtype) -> torch.Tensor:
            """Where each of the slots' K and V values lies in a layer's
            cache seen flat, [n * 2 * H * D]: made once per call (every layer
            shares it; a gather per layer with two index tensors was 4-6x
            slower). The block layout is learned once per block size and
            dtype; a failure to learn it is kept and raised again at once."""
            key = (bs, dtype)
            last_slots, last_key, idx = self._index
            if last_slots is slots and last_key == key:
                return idx
            pos = self._positions.get(key)
            if pos is None:
                try:
                    pos = _learned_block_positions(self.kv_heads, bs, self.head_dim, dtype)
                except ValueError as e:
                    pos = e
                if pos is None:
                    pos = _vec_block_positions(self.kv_heads, bs, self.head_dim)
                self._positions[key] = pos
            if isinstance(pos, ValueError):
                raise ValueError(str(pos)) from None
            block = self.kv_heads * bs * 2 * self.head_dim
            idx = ((slots // bs) * block)[:, None] + pos[slots % bs]
            idx = idx.reshape(-1)
            self._index = (slots, key, idx)
            return idx

        def _caches(self, kwargs):
            if "kvcaches" in kwargs and kwargs["kvcaches"] is not None:
                self.kvcaches = kwargs["kvcaches"]
            if self.kvcaches is None:
                raise ValueError("kvcaches should be provided in kwargs or initialized beforehand")
            if "slot_mapping" not in kwargs:
                raise ValueError("'slot_mapping' should be provided in kwargs")
            return self.kvcaches, kwargs["slot_mapping"]

        def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
            caches, slot_mapping = self._caches(kwargs)
            slots = slot_mapping[start:end].to("cpu", torch.long)
            dst = memory_obj.tensor  # [2, L, chunk, H*D]
            n = end - start
            for layer in range(self.num_layers):
                get, _ = self._split(caches[layer], slots)
                dst[:, layer, :n, :] = get().transpose(0, 1).to(dst.dtype)

        def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
            caches, slot_mapping = self._caches(kwargs)
            # Tokens vLLM already holds are not overwritten (LMCache's own rule).
            skip = min(end - start, max(0, int(kwargs.get("vllm_cached_tokens", 0) or 0) - start))
            if skip >= end - start:
                return
            slots = slot_mapping[start + skip : end].to("cpu", torch.long)
            src = memory_obj.tensor[:, :, skip : end - start, :]  # [2, L, n, H*D]
            for layer in range(self.num_layers):
                _, put = self._split(caches[layer], slots)
                put(src[:, layer].transpose(0, 1))

    VLLMPagedMemCPUConnector.__module__ = __name__
    return VLLMPagedMemCPUConnector


# --------------------------------------------------------------- fx counters
_reporter_started = False


def _start_stats_reporter() -> None:
    """In the worker: a daemon thread that publishes the fx tier's counters
    whenever they change (LMCACHE_FX_STATS_FILE, and the log)."""
    global _reporter_started
    if _reporter_started:
        return
    _reporter_started = True
    threading.Thread(target=_report_loop, name="lmcache-fx-stats", daemon=True).start()


def _fx_backends():
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from .lmcache_plugin import FxStorageBackend

    eng = LMCacheEngineBuilder.get(ENGINE_NAME)
    sm = getattr(eng, "storage_manager", None) if eng is not None else None
    if sm is None:
        return {}, 0
    rank = getattr(getattr(eng, "metadata", None), "worker_id", 0) or 0
    return {n: b for n, b in sm.storage_backends.items() if isinstance(b, FxStorageBackend)}, int(rank)


def stats_file_of(path: str, rank: int) -> str:
    """Where a worker writes its counters: `path` for rank 0, `path.rank<N>`
    for the others (tensor-parallel workers each read their share; one file
    for all held whichever wrote last)."""
    return path if rank == 0 else f"{path}.rank{rank}"


def _report_loop(interval: float = 0.1) -> None:
    path = os.environ.get("LMCACHE_FX_STATS_FILE")
    last = None
    announced = False
    while True:
        time.sleep(interval)
        try:
            backends, rank = _fx_backends()
        except Exception:
            continue
        if not backends:
            continue
        if not announced:
            announced = True
            log.info("lmcache-fx: tier(s) in use by LMCache: %s", ", ".join(sorted(backends)))
        snap = {}
        for n, b in sorted(backends.items()):
            s = b.store.stats.snapshot()
            s["chunks_in_store"] = len(b.store)
            snap[n] = s
        if snap == last:
            continue
        last = snap
        line = json.dumps(snap, sort_keys=True)
        log.info("lmcache-fx stats: %s", line)
        if path:
            mine = stats_file_of(path, rank)
            try:
                tmp = f"{mine}.tmp.{os.getpid()}"
                with open(tmp, "w") as f:
                    f.write(line + "\n")
                os.replace(tmp, mine)
            except OSError as e:
                log.warning("lmcache-fx: cannot write stats file %s: %s", mine, e)
