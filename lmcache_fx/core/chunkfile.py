"""The on-disk chunk format: a fixed 4 KiB header, then the payload at 4096.

The payload starts on a block boundary so an O_DIRECT read lands straight in
the destination buffer. The header carries everything needed to prove a file
is the chunk asked for: the full key, shapes, dtypes, memory format, payload
length and CRC32C, and a CRC32C of the header itself.

    offset size  field
    0      8     magic b"LMCFXKV\\0"
    8      2     format version
    10     2     flags: bit 0 = a MAC is present (auth_key); bit 1 = its
                 payload CRC is checked even with verify off
    12     4     header size (4096)
    16     8     payload length
    24     4     payload CRC32C
    28     4     meta length
    32     8     creation time, ns since the epoch
    40     n     meta: UTF-8 JSON {"key", "shapes", "dtypes", "fmt"[, "kv"][, "layers"]}
    4060   32    with flag bit 0: keyed BLAKE2b-256 of bytes 0..4059 and the payload
    4092   4     CRC32C of bytes 0..4091

The MAC needs no new format version: format 1 writers always wrote flags 0
and zeros after the meta, and format 1 readers ignore both (the header CRC
covers them either way). So files written with auth_key are read by every
version, with or without a key; a reader with auth_key treats a file with no
MAC, or one that does not verify, as a miss. A keyed header leaves 32 bytes
less room for the meta.

"kv" (the writing engine's KV heads and head size, from the storage and
remote plugins) needs no new version either: readers of earlier versions
ignore members they do not know. A KV_2LTD shape holds only their product.
Nor does "layers" (the writing engine's layer count, for a layerwise chunk:
one layer's KV, whose shape does not say how many the model has).

Flag bit 1 (FLAG_CHECK_PAYLOAD) marks a chunk written by a store that
writes new chunks into evicted chunks' files on a disk filesystem
(reuse_evicted). Headers, payloads and renames reach the disk in no set order
(no fsync), so after a power cut such a file can hold either chunk's header
over part of the other's payload, full length and well formed: only the
payload CRC tells. Every chunk such a store writes is flagged, not only those
it writes into a reused file: the one whose file is reused later keeps its
header, and a lost header write can leave that header at its old name over
the new payload. For the same reason such a store writes into no file whose
header is unflagged (a chunk of a verify-off store, or of an earlier
version): it removes those. Readers check the payload CRC of flagged chunks
even with verify off. Readers of earlier versions ignore the bit, as they
ignore the MAC's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass

from .. import _fxio

MAGIC = b"LMCFXKV\0"
FORMAT_VERSION = 1
HEADER_SIZE = 4096
_ZERO_HEADER = bytes(HEADER_SIZE)
SUFFIX = ".fxkv"
_FIXED = struct.Struct("<8sHHIQIIQ")  # up to and including the creation time
_MAX_META = HEADER_SIZE - _FIXED.size - 4
FLAG_MAC = 1
FLAG_CHECK_PAYLOAD = 2
MAC_SIZE = 32
MAC_OFF = HEADER_SIZE - 4 - MAC_SIZE  # the MAC covers bytes 0..MAC_OFF-1 of the header, then the payload
_MAX_META_MAC = MAC_OFF - _FIXED.size
_MAC_PERSON = b"lmcache-fx-mac1"


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
    # The writing engine's KV heads and head size, where it said (the storage and remote plugins): a
    # KV_2LTD shape holds only their product, so a model of 1 x 128 and one of 2 x 64 under one model
    # name made the same shapes. () from older writers and the L2 adapter: not judged then.
    kv: tuple[int, ...] = ()
    # The writing engine's layer count, for a chunk of one layer (layerwise: KV_T2D, KV_2TD, 2-D
    # KV_MLA_FMT), whose shape is the same for a model of fewer or more layers. 0: not recorded.
    layers: int = 0

    def to_json(self) -> dict:
        d = {"shapes": [list(s) for s in self.shapes], "dtypes": list(self.dtypes), "fmt": self.fmt}
        if self.kv:
            d["kv"] = list(self.kv)
        if self.layers:
            d["layers"] = self.layers
        return d

    @staticmethod
    def from_json(d: dict) -> "ChunkMeta":
        try:
            shapes = tuple(tuple(int(x) for x in s) for s in d["shapes"])
            dtypes = tuple(str(x) for x in d["dtypes"])
            fmt = str(d["fmt"])
            kv = tuple(int(x) for x in d.get("kv") or ())
            layers = int(d.get("layers") or 0)
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # int(Infinity) overflows
            raise BadHeader(f"bad meta: {e}") from None
        if not shapes or len(shapes) != len(dtypes) or any(x < 0 for s in shapes for x in s):
            raise BadHeader("bad meta: shapes and dtypes do not match")
        if len(kv) > 8 or any(x <= 0 for x in kv):
            raise BadHeader("bad meta: kv")
        if not 0 <= layers < 1 << 20:
            raise BadHeader("bad meta: layers")
        return _interned(ChunkMeta(shapes, dtypes, fmt, kv, layers))


@functools.lru_cache(maxsize=1024)
def _interned(m: ChunkMeta) -> ChunkMeta:
    """The first of the metas equal to m still cached: one object per
    distinct meta, as a store's chunks mostly share one, and a batch read
    groups chunks by meta with `is` before `==`."""
    return m


@dataclass(frozen=True)
class Header:
    key: str
    meta: ChunkMeta
    payload_len: int
    payload_crc: int
    created_ns: int
    mac: bytes = b""  # empty when the file carries none
    check_payload: bool = False  # FLAG_CHECK_PAYLOAD: its payload CRC is checked even with verify off


@functools.lru_cache(maxsize=16384)
def chunk_digest(key: str) -> str:
    """File name stem for a key: keys never become paths unescaped. Cached
    for the keys last asked (a lookup, its read and its unpin ask for the
    same keys; a hit costs a tenth of the hash)."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def encode_header(
    buf,
    key: str,
    meta: ChunkMeta,
    payload_len: int,
    payload_crc: int,
    created_ns: int,
    mac_key: bytes | None = None,
    payload=None,
    check_payload: bool = False,
) -> bytes:
    """Writes a header into the first 4096 bytes of a writable buffer; with
    `mac_key`, a MAC of the header and `payload` (a buffer) too; with
    `check_payload`, FLAG_CHECK_PAYLOAD. Returns the header's JSON body (what a reader
    passes as read_chunks' `expect`)."""
    body = header_body(key, meta)
    limit = _MAX_META if mac_key is None else _MAX_META_MAC
    if len(body) > limit:
        raise ValueError(f"chunk key and meta take {len(body)} bytes, more than the header's {limit}")
    mv = memoryview(buf)[:HEADER_SIZE]
    mv[:] = _ZERO_HEADER
    flags = (0 if mac_key is None else FLAG_MAC) | (FLAG_CHECK_PAYLOAD if check_payload else 0)
    _FIXED.pack_into(mv, 0, MAGIC, FORMAT_VERSION, flags, HEADER_SIZE, payload_len, payload_crc, len(body), created_ns)
    mv[_FIXED.size : _FIXED.size + len(body)] = body
    if mac_key is not None:
        mv[MAC_OFF : MAC_OFF + MAC_SIZE] = chunk_mac(mac_key, mv[:MAC_OFF], payload)
    struct.pack_into("<I", mv, HEADER_SIZE - 4, _fxio.crc32c(mv[: HEADER_SIZE - 4]))
    return body


def header_body(key: str, meta: ChunkMeta) -> bytes:
    """The JSON body of a header: the key and the meta, as
    json.dumps({"key": key, **meta.to_json()}, separators=(",", ":")) writes
    it; the meta's part is encoded once per meta (a batch shares one)."""
    return b'{"key":' + json.dumps(key).encode() + b"," + _meta_json(meta)


@functools.lru_cache(maxsize=256)
def _meta_json(meta: ChunkMeta) -> bytes:
    """The meta's members and the closing brace of a header body."""
    return json.dumps(meta.to_json(), separators=(",", ":")).encode()[1:]


def header_fits(key: str, meta: ChunkMeta, mac: bool = False) -> bool:
    """Whether the key and meta fit in a header (encode_header raises where
    not). Cheap for the keys users write: json.dumps spells a character in
    at most 12 bytes, so a key that short cannot overflow the header."""
    limit = _MAX_META_MAC if mac else _MAX_META
    rest = len(_meta_json(meta)) + 10  # '{"key":' and '"",' around it
    if 12 * len(key) + rest <= limit:
        return True
    return len(header_body(key, meta)) <= limit


def header_body_of(buf) -> bytes:
    """The JSON body bytes of an encoded header (unchecked: decode_header first)."""
    mv = memoryview(buf)
    (mlen,) = struct.unpack_from("<I", mv, 28)
    return bytes(mv[_FIXED.size : _FIXED.size + min(mlen, _MAX_META)])


def chunk_mac(mac_key: bytes, header_prefix, payload) -> bytes:
    """Keyed BLAKE2b-256 of a header's bytes 0..MAC_OFF-1 (every field, the
    key and the meta) and the payload. hashlib releases the GIL over large
    buffers."""
    h = mac_hasher(mac_key, header_prefix)
    h.update(payload)
    return h.digest()


def mac_hasher(mac_key: bytes, header_prefix):
    """chunk_mac's hash with the header taken, for a payload given in pieces
    (update(), then digest())."""
    h = hashlib.blake2b(key=mac_key, digest_size=MAC_SIZE, person=_MAC_PERSON)
    h.update(header_prefix)
    return h


def why_no_mac(h: "Header") -> str:
    """Why a chunk whose MAC was checked is refused by a store with auth_key."""
    return "MAC does not verify with auth_key" if h.mac else "no MAC (written without auth_key)"


def mac_ok(mac_key: bytes, header, h: "Header", payload) -> bool:
    """Whether the header (its 4096 bytes) and the payload carry a MAC made
    with this key. A file without one (written without auth_key) is not."""
    if not h.mac:
        return False
    return hmac.compare_digest(chunk_mac(mac_key, memoryview(header)[:MAC_OFF], payload), h.mac)


def memory_at(address: int, nbytes: int) -> memoryview:
    """A read-only view of `nbytes` of host memory at `address` (a buffer the
    caller owns and keeps alive while the view is used)."""
    if nbytes <= 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B").toreadonly()


def unflagged_chunk(prefix) -> bool:
    """Whether the first bytes of a file (at least 12) are a chunk header of
    this format without FLAG_CHECK_PAYLOAD: a file a store must not write a
    new chunk into on disk, since a power cut could leave that header over
    part of the new payload, and readers with verify off would not check it."""
    mv = memoryview(prefix)
    if len(mv) < 12 or bytes(mv[:8]) != MAGIC:
        return False
    (flags,) = struct.unpack_from("<H", mv, 10)
    return not flags & FLAG_CHECK_PAYLOAD


def decode_header(buf) -> Header:
    """Parses and checks a header; raises BadHeader on anything wrong."""
    mv = memoryview(buf)
    if len(mv) < HEADER_SIZE:
        raise BadHeader(f"header is {len(mv)} bytes, expected {HEADER_SIZE}")
    mv = mv[:HEADER_SIZE]
    magic, version, flags, hsize, plen, pcrc, mlen, created = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadHeader("not an lmcache-fx chunk (bad magic)")
    (hcrc,) = struct.unpack_from("<I", mv, HEADER_SIZE - 4)
    if _fxio.crc32c(mv[: HEADER_SIZE - 4]) != hcrc:
        raise BadHeader("header checksum mismatch")
    if version != FORMAT_VERSION:
        raise FormatVersionMismatch(f"format version {version}, this lmcache-fx reads {FORMAT_VERSION}")
    if hsize != HEADER_SIZE or mlen > (_MAX_META_MAC if flags & FLAG_MAC else _MAX_META):
        raise BadHeader("bad header or meta size")
    try:
        d = json.loads(bytes(mv[_FIXED.size : _FIXED.size + mlen]))
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
    mac = bytes(mv[MAC_OFF : MAC_OFF + MAC_SIZE]) if flags & FLAG_MAC else b""
    return Header(key, meta, plen, pcrc, created, mac, bool(flags & FLAG_CHECK_PAYLOAD))


_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "float64": 8,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
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
