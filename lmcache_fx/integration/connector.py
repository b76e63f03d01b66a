"""The base of lmcache-fx's CPU KV connectors (the vLLM-CPU one, and the
tests' and bench's): LMCache's batched connector calls as a loop over the
per-chunk ones, which each connector supplies."""

from __future__ import annotations

from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface


class ChunkwiseConnector(GPUConnectorInterface):
    """LMCache's batched calls as a loop over the per-chunk ones."""

    def batched_from_gpu(self, memory_objs, starts, ends, **kw):
        for o, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(o, s, e, **kw)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kw):
        for o, s, e in zip(memory_objs, starts, ends):
            self.to_gpu(o, s, e, **kw)
