"""Reading a store's chunk files with the C engine for the admin commands:
headers of many files at once, and whole chunks verified (header checksum,
format version, key against the file name, payload length and CRC32C), two
batches in flight."""

from __future__ import annotations

import collections
import errno
import os
import resource
from dataclasses import dataclass
from typing import Iterator, Optional

from .. import _fxio
from ..core.chunkfile import HEADER_SIZE, BadHeader, FormatVersionMismatch, Header, chunk_digest, decode_header
from ..core.layout import StoreFile, open_in, round_up
from .common import AdminError


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class ChunkVerifier:
    """Opens chunk files (O_DIRECT where the filesystem allows) and reads them
    in batches through the C engine."""

    def __init__(
        self, io_engine: str = "auto", queue_depth: int = 64, split_bytes: int = 1 << 20, odirect: bool = True
    ):
        try:
            self.engine = _fxio.Engine(io_engine, queue_depth, split_bytes)
        except OSError as e:
            raise AdminError(f"--io-engine {io_engine}: {e}") from None
        self.odirect = odirect
        self._no_direct: set[str] = set()  # roots where O_DIRECT was refused
        self.used_direct = False
        self.max_files = max(16, min(4096, (raise_nofile() - 64) // 2))

    def open(self, f: StoreFile) -> tuple[int, str]:
        """(fd, "") or (-1, why). The file is read-locked, as the store's
        reads are, so a running store does not rewrite it while it is read."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.odirect and f.root not in self._no_direct:
            try:
                fd = open_in(f.path, flags | os.O_DIRECT, lock=True)
                self.used_direct = True
                return fd, ""
            except OSError as e:
                if e.errno != errno.EINVAL:  # no O_DIRECT on this filesystem
                    return -1, _open_why(e)
                self._no_direct.add(f.root)
        try:
            return open_in(f.path, flags, lock=True), ""
        except OSError as e:
            return -1, _open_why(e)

    def close(self) -> None:
        self.engine.close()

    # -- headers only (ls, stat)
    def headers(self, files: list[StoreFile]) -> Iterator[tuple[StoreFile, Optional[Header], str]]:
        for i in range(0, len(files), self.max_files):
            part = files[i : i + self.max_files]
            buf = _fxio.HostBuffer(HEADER_SIZE * len(part), hugepages=False)
            ops, opened, fds = [], [], []
            try:
                for j, f in enumerate(part):
                    fd, why = self.open(f)
                    if fd < 0:
                        yield f, None, why
                        continue
                    fds.append(fd)
                    ops.append((fd, 0, HEADER_SIZE, buf.address + HEADER_SIZE * j))
                    opened.append((j, f))
                res = self.engine.read(ops) if ops else []
            finally:
                for fd in fds:
                    os.close(fd)
            for (j, f), n in zip(opened, res):
                if n != HEADER_SIZE:
                    yield f, None, _short_why(n, f.size)
                    continue
                try:
                    yield f, decode_header(memoryview(buf)[HEADER_SIZE * j : HEADER_SIZE * (j + 1)]), ""
                except BadHeader as e:
                    yield f, None, f"bad header: {e}"

    # -- whole chunks with CRC (fsck)
    def verify(self, files: list[StoreFile], buffer_bytes: int) -> Iterator["Verdict"]:
        """Header + payload of every file, CRC32C by the engine; two batches of
        at most buffer_bytes in flight so the device never waits on Python."""
        pool: list = []
        inflight: collections.deque = collections.deque()
        for batch in _plan(files, buffer_bytes, self.max_files):
            if len(inflight) >= 2:
                yield from self._finish(inflight.popleft(), pool)
            need = sum(_span(f) for f in batch)
            buf = None
            for k, b in enumerate(pool):
                if len(b) >= need:
                    buf = pool.pop(k)
                    break
            if buf is None:
                buf = _fxio.HostBuffer(max(need, buffer_bytes))
            ops, items, fds, early = [], [], [], []
            off = 0
            for f in batch:
                if f.size < HEADER_SIZE:
                    early.append(
                        Verdict(
                            f, "bad", f"file is {f.size} bytes, shorter than the {HEADER_SIZE}-byte header (truncated)"
                        )
                    )
                    continue
                fd, why = self.open(f)
                if fd < 0:
                    early.append(Verdict(f, "gone" if "no longer" in why else "bad", why))
                    continue
                fds.append(fd)
                try:
                    f.ino = os.fstat(fd).st_ino  # what was verified, for a safe --repair
                except OSError:
                    pass
                plen = f.size - HEADER_SIZE
                first = len(ops)
                ops.append((fd, 0, HEADER_SIZE, buf.address + off))
                if plen:
                    ops.append((fd, HEADER_SIZE, plen, buf.address + off + HEADER_SIZE))
                items.append((f, off, first, plen))
                off += _span(f)
            try:
                batch_obj = self.engine.submit(ops, write=False, crc=True) if ops else None
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            inflight.append((batch_obj, buf, items, fds, early))
        while inflight:
            yield from self._finish(inflight.popleft(), pool)

    def _finish(self, entry, pool) -> Iterator["Verdict"]:
        batch_obj, buf, items, fds, early = entry
        try:
            res = batch_obj.wait() if batch_obj is not None else []
        finally:
            for fd in fds:
                os.close(fd)
        yield from early
        for f, off, first, plen in items:
            hn, _ = res[first]
            pn, pcrc = res[first + 1] if plen else (0, 0)
            yield _judge(f, memoryview(buf)[off : off + HEADER_SIZE], hn, pn, pcrc, plen)
        pool.append(buf)


def _span(f: StoreFile) -> int:
    return HEADER_SIZE + round_up(max(f.size - HEADER_SIZE, 0), 4096)


def _plan(files: list[StoreFile], buffer_bytes: int, max_files: int) -> Iterator[list[StoreFile]]:
    batch, used = [], 0
    for f in files:
        s = _span(f)
        if batch and (used + s > buffer_bytes or len(batch) >= max_files):
            yield batch
            batch, used = [], 0
        batch.append(f)
        used += s
    if batch:
        yield batch


def _open_why(e: OSError) -> str:
    if e.errno == errno.ENOENT:
        return "no longer there (removed while checking)"
    if e.errno == errno.ESTALE:
        return "no longer there (evicted and being reused while checking)"
    if e.errno == errno.ELOOP:
        return "a symbolic link (the store never follows them)"
    return f"cannot open: {e.strerror}"


def _short_why(n: int, size: int) -> str:
    if n < 0:
        return f"header read failed: {os.strerror(-n)}"
    return f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte header (truncated)"


@dataclass
class Verdict:
    file: StoreFile
    status: str  # ok | bad | version | gone
    problem: str = ""
    header: Optional[Header] = None


def _judge(f: StoreFile, hmv, hn: int, pn: int, pcrc: int, plen: int) -> Verdict:
    if hn != HEADER_SIZE:
        return Verdict(f, "bad", _short_why(hn, f.size))
    try:
        h = decode_header(hmv)
    except FormatVersionMismatch as e:
        return Verdict(f, "version", str(e))
    except BadHeader as e:
        return Verdict(f, "bad", f"bad header: {e}")
    if chunk_digest(h.key) != f.digest:
        return Verdict(f, "bad", f"holds key {h.key!r}, which belongs in another file", h)
    if h.payload_len != plen:
        how = "truncated" if plen < h.payload_len else "too long"
        return Verdict(f, "bad", f"payload is {plen} bytes, header says {h.payload_len} ({how})", h)
    if pn != plen:
        return Verdict(
            f,
            "bad",
            f"payload read failed: {os.strerror(-pn)}" if pn < 0 else f"payload read returned {pn} of {plen} bytes",
            h,
        )
    if plen and pcrc != h.payload_crc:
        return Verdict(f, "bad", f"payload checksum mismatch (CRC32C {pcrc:08x}, header says {h.payload_crc:08x})", h)
    return Verdict(f, "ok", "", h)
