"""Model KV geometries the tools share (bench, estimate): bytes per token and
per chunk of one rank, and presets of common models."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..core.chunkfile import dtype_size
from ..core.options import parse_size as _parse_bytes

GB = 1e9
MIB = 1 << 20


@dataclass(frozen=True)
class Geometry:
    """KV geometry of one rank: bytes per token = kv_size*layers*heads*dim*dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    mla: bool = False
    chunk: int = 256

    @property
    def kv_size(self) -> int:
        return 1 if self.mla else 2

    @property
    def dtype_bytes(self) -> int:
        return dtype_size(self.dtype)

    @property
    def hidden(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.kv_size * self.layers * self.hidden * self.dtype_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.bytes_per_token * self.chunk

    def kv_shape(self) -> tuple:
        """LMCacheMetadata.kv_shape: (layers, kv_size, chunk, heads, head_dim)."""
        return (self.layers, self.kv_size, self.chunk, self.kv_heads, self.head_dim)


# Per-rank geometry (bf16, 256-token chunks). TP8 divides the KV heads by 8;
# MLA keeps one latent (512 + 64 rope) per layer, the same on every rank.
PRESETS: dict[str, Geometry] = {
    "qwen2.5-32b": Geometry(layers=64, kv_heads=8, head_dim=128),  # 64 MiB / chunk
    "llama-3-70b-tp8": Geometry(layers=80, kv_heads=1, head_dim=128),  # 10 MiB / chunk / rank
    "qwen3-coder-480b-tp8": Geometry(layers=62, kv_heads=1, head_dim=128),  # 7.75 MiB / chunk / rank
    "deepseek-v3-mla": Geometry(layers=61, kv_heads=1, head_dim=576, mla=True),  # 17.2 MiB / chunk
    # A small model's chunk: Llama-3.2-1B (16 layers, 8 KV heads of 64) at TP4, 2 MiB / chunk / rank
    "llama-3.2-1b-tp4": Geometry(layers=16, kv_heads=2, head_dim=64),
}


def parse_size(s) -> int:
    """'8G', '512M', '1MiB', 4096 -> bytes (powers of 1024), for argparse."""
    try:
        v = _parse_bytes(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 8G or 1M, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {s!r}")
    return v
