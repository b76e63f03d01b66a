"""lmcache-fx: a fast, durable NVMe / NVMe-oF KV-cache tier for LMCache.

Layers (README: Architecture): `_fxio` (C: io_uring and thread engines),
`core` (chunk files, index, capacity; no torch, no LMCache), one thin adapter
per LMCache entry point (`lmcache_plugin`, `remote_plugin`, `l2_adapter`,
`vllm_cpu`) over `integration`, and the `tools` behind the lmcache-fx command.
The on-disk format version is `core.chunkfile.FORMAT_VERSION`.
"""

__version__ = "0.1.0"
