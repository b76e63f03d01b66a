"""lmcache-fx: a fast, durable NVMe / NVMe-oF KV-cache tier for LMCache.

Layers: `_fxio` (C: io_uring and thread engines), `store` (chunk files,
index, capacity), and one thin adapter per LMCache entry point
(`lmcache_plugin`).
"""
__version__ = "0.1.0"
FORMAT_VERSION = 1
