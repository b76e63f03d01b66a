"""A reuse of an evicted chunk's file that ends after its payload was written
and before its header (the writer killed, or its header write failed) must
not leave the evicted chunk's valid header over the new key's bytes: a C
reader (read_chunks) that opened the file by its old name just before the
evictor moved it away, and read-locks it once the writer is gone, would
otherwise take another key's bytes as a hit (verify: false checks no
payload CRC). The reader's early open is modelled by a hard link made before
the eviction, which read_chunks opens instead of the store's name. On a
memory filesystem: on disk filesystems evicted files are not reused with
verify off and no auth_key at all (a power cut could tear them)."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from faults import fxfault as F  # noqa: E402

from lmcache_fx.core.chunkfile import HEADER_SIZE, MAGIC, chunk_digest  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402

CHUNK = 64 * 1024
FILE = HEADER_SIZE + CHUNK
KEYS = [f"model@1@0@{h:016x}@bfloat16" for h in range(6)]


def _open(path, odirect: str) -> ChunkStore:
    # room for 4 chunks; verify off: the header is all that stands between a reader and foreign bytes
    return F.open_store(path, max_capacity_gb=(4 * FILE + 100) / (1 << 30), verify="false", odirect=odirect)


class _HeaderWriteFails:
    """The store's payload engine, whose header writes fail with EIO after
    the payloads went in whole (the Python path's second write call; in
    Engine.write_chunks, the payload written and the header reported
    failed). `at_payload(fds)` runs just before the payloads are written."""

    def __init__(self, real, at_payload):
        self.real, self.at_payload, self.calls = real, at_payload, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def write(self, ops, *a, **k):
        self.calls += 1
        if self.calls == 1:
            self.at_payload([op[0] for op in ops])
            return self.real.write(ops, *a, **k)
        return [-errno.EIO] * len(ops)

    def write_chunks(self, ops, direct=True):
        self.at_payload([op[0] for op in ops])
        res = self.real.write([(fd, HEADER_SIZE, n, addr) for fd, addr, n, _h, _t in ops], crc=True)
        return [(n, -errno.EIO, crc, 0) for n, crc in res]


@pytest.mark.parametrize("odirect", ["false", "true"])
def test_header_write_failing_after_a_reused_payload_is_a_miss_for_an_early_reader(shm_dir, odirect):
    store_dir = shm_dir
    tmp_path = Path(os.path.dirname(shm_dir))  # the hard link below needs the store's filesystem
    os.makedirs(tmp_path, exist_ok=True)
    if odirect == "true":
        try:
            os.close(os.open(tmp_path / "probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        except OSError as e:
            pytest.skip(f"{tmp_path} does not support O_DIRECT: {e.strerror}")
    w = _open(store_dir, odirect)
    r = _open(store_dir, odirect)  # the reader: another index, so it still knows KEYS[0]'s file
    rfd = -1
    try:
        src = F.Chunks()
        for k in KEYS[:4]:
            assert w.write([src.item(k, CHUNK)]) == [True]
        assert F.read_check(r, KEYS[:1]) == (1, 0, [])  # learns KEYS[0]'s header body
        name0 = os.path.relpath(w.path_for(chunk_digest(KEYS[0])), store_dir)
        early = tmp_path / "early"  # where the reader's early open still finds KEYS[0]'s file
        os.makedirs(early / os.path.dirname(name0))
        os.link(os.path.join(store_dir, name0), early / name0)
        rfd = os.open(early, os.O_PATH | os.O_DIRECTORY)
        r._rootfd_of = lambda path: rfd  # type: ignore[method-assign]

        seen = []

        def at_payload(fds):
            with open(early / name0, "rb") as f:
                seen.append(f.read(len(MAGIC)))

        real = w._wengine
        w._wengine = _HeaderWriteFails(real, at_payload)
        try:
            assert w.write([src.item(KEYS[4], CHUNK)]) == [False]  # payload in KEYS[0]'s file, no header
        finally:
            w._wengine = real
        assert w.stats.snapshot()["recycled"] == 1  # the reuse did happen
        with open(early / name0, "rb") as f:
            f.seek(HEADER_SIZE)
            assert F.check(KEYS[4], f.read(CHUNK)) == "ok"  # the new payload, as the aborted writer left it

        got = r.read([KEYS[0]], F.allocator(), lambda h: None)
        assert got == [None]  # not a hit holding KEYS[4]'s bytes
        assert seen == [bytes(len(MAGIC))]  # the old header was gone before the payload went in
        assert r.stats.snapshot()["corrupt"] == 0  # the name no longer holds the file: gone, not corrupt
        assert os.path.exists(early / name0)
    finally:
        if rfd >= 0:
            os.close(rfd)
        r.close()
        w.close()
