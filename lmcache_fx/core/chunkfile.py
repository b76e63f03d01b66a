"""The on-disk chunk format: a fixed 4 KiB header, then the payload at 4096.

The payload starts on a block boundary so an O_DIRECT read lands straight in
the destination buffer. The header carries everything needed to prove a file
is the chunk asked for: the full key, shapes, dtypes, memory format, payload
length and CRC32C, and a CRC32C of the header itself.

    offset size  field
    0      8     magic b"LMCFXKV\\0"
    8      2     format version
    10     2     flags (0)
    12     4     header size (4096)
    16     8     payload length
    24     4     payload CRC32C
    28     4     meta length
    32     8     creation time, ns since the epoch
    40     n     meta: UTF-8 JSON {"key", "shapes", "dtypes", "fmt"}
    4092   4     CRC32C of bytes 0..4091
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from .. import _fxio

MAGIC = b"LMCFXKV\0"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
SUFFIX = ".fxkv"
_FIXED = struct.Struct("<8sHHIQIIQ")  # up to and including the creation time
_MAX_META = HEADER_SIZE - _FIXED.size - 4


class BadHeader(ValueError):
    """The header is not a valid lmcache-fx header (the file is a miss)."""


class FormatVersionMismatch(BadHeader):
    """A well-formed header of another format version."""


@dataclass(frozen=True)
class ChunkMeta:
    """What is needed to allocate the destination of a chunk."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # torch dtype names without the "torch." prefix
    fmt: str  # MemoryFormat name

    def to_json(self) -> dict:
        return {"shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes), "fmt": self.fmt}

    @staticmethod
    def from_json(d: dict) -> "ChunkMeta":
        try:
            shapes = tuple(tuple(int(x) for x in s) for s in d["shapes"])
            dtypes = tuple(str(x) for x in d["dtypes"])
            fmt = str(d["fmt"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # int(Infinity) overflows
            raise BadHeader(f"bad meta: {e}") from None
        if not shapes or len(shapes) != len(dtypes) or any(x < 0 for s in shapes for x in s):
            raise BadHeader("bad meta: shapes and dtypes do not match")
        return ChunkMeta(shapes, dtypes, fmt)


@dataclass(frozen=True)
class Header:
    key: str
    meta: ChunkMeta
    payload_len: int
    payload_crc: int
    created_ns: int


def chunk_digest(key: str) -> str:
    """File name stem for a key: keys never become paths unescaped."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def encode_header(buf, key: str, meta: ChunkMeta, payload_len: int, payload_crc: int, created_ns: int) -> None:
    """Writes a header into the first 4096 bytes of a writable buffer."""
    body = json.dumps({"key": key, **meta.to_json()}, separators=(",", ":")).encode()
    if len(body) > _MAX_META:
        raise ValueError(f"chunk key and meta take {len(body)} bytes, more than the header's {_MAX_META}")
    mv = memoryview(buf)[:HEADER_SIZE]
    mv[:] = bytes(HEADER_SIZE)
    _FIXED.pack_into(mv, 0, MAGIC, FORMAT_VERSION, 0, HEADER_SIZE, payload_len, payload_crc, len(body), created_ns)
    mv[_FIXED.size:_FIXED.size + len(body)] = body
    struct.pack_into("<I", mv, HEADER_SIZE - 4, _fxio.crc32c(mv[:HEADER_SIZE - 4]))


def decode_header(buf) -> Header:
    """Parses and checks a header; raises BadHeader on anything wrong."""
    mv = memoryview(buf)
    if len(mv) < HEADER_SIZE:
        raise BadHeader(f"header is {len(mv)} bytes, expected {HEADER_SIZE}")
    mv = mv[:HEADER_SIZE]
    magic, version, _flags, hsize, plen, pcrc, mlen, created = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadHeader("not an lmcache-fx chunk (bad magic)")
    (hcrc,) = struct.unpack_from("<I", mv, HEADER_SIZE - 4)
    if _fxio.crc32c(mv[:HEADER_SIZE - 4]) != hcrc:
        raise BadHeader("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise FormatVersionMismatch(f"format version {version}, this lmcache-fx reads {FORMAT_VERSION}")
    if hsize != HEADER_SIZE or mlen > _MAX_META:
        raise BadHeader("bad header or meta size")
    try:
        d = json.loads(bytes(mv[_FIXED.size:_FIXED.size + mlen]))
        key = d["key"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # deep nesting exhausts the stack
        raise BadHeader(f"bad meta: {type(e).__name__}") from None
    if not isinstance(key, str) or not isinstance(d, dict):
        raise BadHeader("bad meta: key is not a string")
    meta = ChunkMeta.from_json(d)
    expect = tensor_bytes(meta)
    if expect is not None and expect != plen:
        # A planted file with valid CRCs but shapes that do not add up would
        # make the reader allocate the wrong (possibly huge) destination.
        raise BadHeader(f"shapes and dtypes make {expect} bytes, payload length is {plen}")
    return Header(key, meta, plen, pcrc, created)


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float64": 8, "uint8": 1,
             "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}
_TENSOR_FORMATS = {"KV_2LTD", "KV_T2D", "KV_2TD", "KV_MLA_FMT"}


def tensor_bytes(meta: ChunkMeta):
    """Bytes the shapes and dtypes of a KV tensor chunk make, or None when the
    format or a dtype is not one whose size is known here (no check then)."""
    if meta.fmt not in _TENSOR_FORMATS or any(d not in _ITEMSIZE for d in meta.dtypes):
        return None
    total = 0
    for shape, dtype in zip(meta.shapes, meta.dtypes):
        n = _ITEMSIZE[dtype]
        for x in shape:
            n *= x
        total += n
    return total


def dtype_size(name: str) -> int:
    """Bytes of one element of a dtype named as torch names it ('bfloat16')."""
    try:
        return _ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None
