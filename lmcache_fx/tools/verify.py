"""Reading a store's chunk files with the C engine for the admin commands:
headers of many files at once, and whole chunks verified (header checksum,
format version, key against the file name, payload length and CRC32C), two
batches in flight.

Each file is opened as the store's readers open one (csrc/chunks.c
chunk_open): no symlink followed, O_NONBLOCK so that a FIFO planted in a
chunk's place cannot block the open, refused unless a regular file,
read-locked. It is judged by what fstat says of the file opened, never by the
size the listing saw (a chunk replaced meanwhile by a whole one of another
size is not bad). A file that cannot be opened or read (EAGAIN, EMFILE,
EIO...) is `unreadable`: reported, never called bad (the store keeps a file
whose read failed)."""

from __future__ import annotations

import collections
import errno
import fcntl
import hmac
import os
import resource
import stat
from dataclasses import dataclass
from typing import Iterator, Optional, Union

from .. import _fxio
from ..core.chunkfile import (
    HEADER_SIZE,
    MAC_OFF,
    BadHeader,
    FormatVersionMismatch,
    Header,
    chunk_digest,
    decode_header,
    mac_hasher,
    mac_ok,
    why_no_mac,
)
from ..core.layout import StoreFile, open_in, round_up
from .common import AdminError

OTHER_VERSION = "another format version"  # how headers() begins the why of a chunk of another format version


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


def _key_elsewhere(f: StoreFile, h: Header) -> str:
    """Why a file's header is not its own chunk's (a copy under another
    chunk's name, which the store never reads as that key), or ""."""
    if chunk_digest(h.key) != f.digest:
        return f"holds key {h.key!r}, which belongs in another file"
    return ""


class ChunkVerifier:
    """Opens chunk files (O_DIRECT where the filesystem allows) and reads them
    in batches through the C engine."""

    def __init__(
        self,
        io_engine: str = "auto",
        queue_depth: int = 64,
        split_bytes: int = 1 << 20,
        odirect: bool = True,
        mac_key: Optional[bytes] = None,
    ):
        try:
            self.engine = _fxio.Engine(io_engine, queue_depth, split_bytes)
        except OSError as e:
            raise AdminError(f"--io-engine {io_engine}: {e}") from None
        self.odirect = odirect
        # With the store's auth_key: a whole chunk without a MAC made with it is bad, as the store
        # judges it (a miss, removed). Without: MACs are not checked, only counted.
        self.mac_key = mac_key
        self.macs_unchecked = 0
        self._no_direct: set[str] = set()  # roots where O_DIRECT was refused
        self.used_direct = False
        self.max_files = max(16, min(4096, (raise_nofile() - 64) // 2))

    def open(self, f: StoreFile) -> tuple[int, Optional[os.stat_result], str, int]:
        """(fd, its fstat, "", 0) or (-1, None, why, errno). The file is
        read-locked, as the store's reads are, so a running store does not
        rewrite it while it is read."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.odirect and f.root not in self._no_direct:
            try:
                fd, st = open_regular(f.path, flags | os.O_DIRECT)
                self.used_direct = True
                return fd, st, "", 0
            except OSError as e:
                if e.errno != errno.EINVAL:  # no O_DIRECT on this filesystem
                    return -1, None, _open_why(e), e.errno or 0
                self._no_direct.add(f.root)
        try:
            fd, st = open_regular(f.path, flags)
            return fd, st, "", 0
        except OSError as e:
            return -1, None, _open_why(e), e.errno or 0

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
                    fd, st, why, err = self.open(f)
                    if fd < 0 or st is None:
                        if err not in (errno.ENOENT, errno.ESTALE):  # else evicted since the listing: skipped
                            yield f, None, why
                        continue
                    fds.append(fd)
                    ops.append((fd, 0, HEADER_SIZE, buf.address + HEADER_SIZE * j))
                    opened.append((j, f, st.st_size))
                res = self.engine.read(ops) if ops else []
            finally:
                for fd in fds:
                    os.close(fd)
            for (j, f, size), n in zip(opened, res):
                if n != HEADER_SIZE:
                    yield f, None, _short_why(n, size)
                    continue
                try:
                    h = decode_header(memoryview(buf)[HEADER_SIZE * j : HEADER_SIZE * (j + 1)])
                except FormatVersionMismatch as e:  # not bad: read by the version that wrote it (fsck: VERSION)
                    yield f, None, f"{OTHER_VERSION}: {e}"
                    continue
                except BadHeader as e:
                    yield f, None, f"bad header: {e}"
                    continue
                why = _key_elsewhere(f, h)
                yield (f, None, why) if why else (f, h, "")

    # -- whole chunks with CRC (fsck)
    def verify(self, files: list[StoreFile], buffer_bytes: int) -> Iterator["Verdict"]:
        """Header + payload of every file, CRC32C by the engine; two batches of
        at most buffer_bytes in flight so the device never waits on Python.
        Each file is laid out by the size fstat gives of the file opened. A
        file larger than one batch is read apart (_verify_large): header
        first, payload in pieces of buffer_bytes, so memory stays two batches
        whatever sizes files claim. Out of descriptors (EMFILE), what is open
        is read first and the open tried again."""
        pool: list = []
        inflight: collections.deque = collections.deque()  # _Job, oldest first
        pending: list[tuple[StoreFile, int, os.stat_result]] = []  # opened, for the next batch
        used = 0

        def submit() -> Iterator[Verdict]:
            """The files opened so far as a batch (pending emptied), at most two in flight."""
            if len(inflight) >= 2:
                yield from self._finish(inflight, pool)
            self._submit(pending, buffer_bytes, pool, inflight)

        held = -1  # a descriptor opened and not yet handed on (pending, _verify_large): a stop at a yield closes it
        try:
            for f in files:
                if not pending and len(inflight) >= 2:
                    yield from self._finish(inflight, pool)
                fd, st, why, err = self.open(f)
                held = fd
                if fd < 0 and err in (errno.EMFILE, errno.ENFILE) and (pending or inflight):
                    if pending:
                        yield from submit()
                        used = 0
                    while inflight:
                        yield from self._finish(inflight, pool)
                    fd, st, why, err = self.open(f)
                    held = fd
                if fd < 0 or st is None:
                    yield Verdict(f, "gone" if err in (errno.ENOENT, errno.ESTALE) else "unreadable", why)
                    continue
                ident, size = _ident(st), st.st_size
                if size < HEADER_SIZE:
                    held = -1
                    os.close(fd)
                    why = f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte header (truncated)"
                    yield Verdict(f, "bad", why, ident=ident, size=size)
                    continue
                span = _span(size)
                if span > buffer_bytes:
                    # Alone, after the batches before it: their buffers serve it.
                    if pending:
                        yield from submit()
                        used = 0
                    while inflight:
                        yield from self._finish(inflight, pool)
                    held = -1  # _verify_large closes it
                    yield self._verify_large(f, fd, st, buffer_bytes, pool)
                    continue
                if pending and (used + span > buffer_bytes or len(pending) >= self.max_files):
                    yield from submit()
                    used = 0
                held = -1
                pending.append((f, fd, st))
                used += span
            if pending:
                yield from submit()
            while inflight:
                yield from self._finish(inflight, pool)
        finally:
            if held >= 0:
                os.close(held)
            for _, fd, _ in pending:
                os.close(fd)
            while inflight:  # abandoned (an error, or the caller stopped): wait for the reads, then close
                inflight[0].end()
                inflight.popleft()

    def _buffer(self, pool: list, need: int, buffer_bytes: int):
        """A read buffer of at least `need` bytes: one of `pool`, or a new one
        of max(need, buffer_bytes); AdminError when it cannot be had."""
        for k, b in enumerate(pool):
            if len(b) >= need:
                return pool.pop(k)
        size = max(need, buffer_bytes)
        try:
            return _fxio.HostBuffer(size)
        except (OSError, MemoryError, ValueError) as e:
            raise AdminError(
                f"cannot allocate a {size >> 20} MiB read buffer ({e}); give a smaller --buffer-mb"
            ) from None

    def _submit(self, pending: list, buffer_bytes: int, pool: list, inflight: collections.deque) -> None:
        """Starts the reads of the files opened in `pending` (emptied: their
        descriptors go with the batch, closed when it is finished) as a _Job
        appended to `inflight` before the reads start, so that whatever ends
        verify() (an error, an interrupt) finds it and waits for its reads
        before its buffer goes."""
        batch = list(pending)
        pending.clear()
        job = _Job(None, [fd for _, fd, _ in batch])
        try:
            job.buf = self._buffer(pool, sum(_span(st.st_size) for _, _, st in batch), buffer_bytes)
            ops = []
            off = 0
            for f, fd, st in batch:
                plen = st.st_size - HEADER_SIZE
                first = len(ops)
                ops.append((fd, 0, HEADER_SIZE, job.buf.address + off))
                if plen:
                    ops.append((fd, HEADER_SIZE, plen, job.buf.address + off + HEADER_SIZE))
                job.items.append((f, off, first, plen, _ident(st), st.st_size))
                off += _span(st.st_size)
            inflight.append(job)
            if ops:
                job.batch = self.engine.submit(ops, write=False, crc=True)
        except BaseException:
            if not inflight or inflight[-1] is not job:
                job.end()  # never started: only its descriptors to close
            raise

    def _finish(self, inflight: collections.deque, pool: list) -> Iterator["Verdict"]:
        """Waits for the oldest batch of `inflight` (taken off it only once
        its reads have ended) and judges its files."""
        job = inflight[0]
        res = job.end()
        inflight.popleft()
        for f, off, first, plen, ident, size in job.items:
            hn, _ = res[first]
            pn, pcrc = res[first + 1] if plen else (0, 0)
            v = _judge(f, memoryview(job.buf)[off : off + HEADER_SIZE], hn, pn, pcrc, plen, ident, size)
            if v.status == "ok" and v.header is not None:
                whole = memoryview(job.buf)[off : off + HEADER_SIZE + plen]
                v = self._judge_mac(v, whole[:HEADER_SIZE], lambda w=whole: w[HEADER_SIZE:])
            yield v
        pool.append(job.buf)

    def _judge_mac(self, v: "Verdict", hmv, payload) -> "Verdict":
        """A whole chunk's verdict once its MAC is judged (payload(): its
        bytes, or a hash of them with the header taken, from _verify_large)."""
        h = v.header
        assert h is not None
        if self.mac_key is None:
            self.macs_unchecked += bool(h.mac)
            return v
        got = payload()
        ok = bool(h.mac) and (
            mac_ok(self.mac_key, hmv, h, got)
            if isinstance(got, memoryview)
            else hmac.compare_digest(got.digest(), h.mac)
        )
        if ok:
            return v
        return Verdict(v.file, "bad", f"{why_no_mac(h)}: the store removes it on read", h, v.ident, v.size)

    def _verify_large(self, f: StoreFile, fd: int, st: os.stat_result, buffer_bytes: int, pool: list) -> "Verdict":
        """A file larger than one batch (fd closed here): its header read
        alone and judged first, so a file whose size is not the header's
        HEADER_SIZE + payload_len is bad without its payload read; then the
        payload in pieces of buffer_bytes, two in flight, CRC32C continued
        over the pieces."""
        ident, size = _ident(st), st.st_size
        plen = size - HEADER_SIZE
        piece = max(4096, buffer_bytes // 4096 * 4096)  # O_DIRECT: pieces start aligned
        bufs: list = []
        jobs: collections.deque = collections.deque()
        try:
            bufs.append(self._buffer(pool, piece, piece))
            hn = self.engine.read([(fd, 0, HEADER_SIZE, bufs[0].address)])[0]
            h = _judge_header(f, memoryview(bufs[0])[:HEADER_SIZE], hn, plen, ident, size)
            if isinstance(h, Verdict):
                return h
            mac = mac_hasher(self.mac_key, memoryview(bufs[0])[:MAC_OFF]) if self.mac_key and h.mac else None
            bufs.append(self._buffer(pool, piece, piece))
            crc, pos, k = 0, HEADER_SIZE, 0
            while pos < size or jobs:
                while pos < size and len(jobs) < 2:
                    n = min(piece, size - pos)
                    job = _Job(bufs[k % 2], [])
                    jobs.append((job, n))
                    job.batch = self.engine.submit([(fd, pos, n, job.buf.address)], write=False, crc=False)
                    pos, k = pos + n, k + 1
                job, want = jobs[0]
                got = job.end()[0]
                jobs.popleft()
                if got < 0:
                    return Verdict(f, "unreadable", f"payload read failed: {os.strerror(-got)}", h, ident, size)
                if got != want:
                    why = f"payload read returned {got} of {want} bytes (the file changed while read)"
                    return Verdict(f, "unreadable", why, h, ident, size)
                crc = _fxio.crc32c_at(job.buf.address, got, crc)
                if mac is not None:
                    mac.update(memoryview(job.buf)[:got])
            if crc != h.payload_crc:
                why = f"payload checksum mismatch (CRC32C {crc:08x}, header says {h.payload_crc:08x})"
                return Verdict(f, "bad", why, h, ident, size)
            return self._judge_mac(Verdict(f, "ok", "", h, ident, size), None, lambda: mac)
        finally:
            while jobs:  # the reads land in bufs: wait for them before the buffers go
                jobs[0][0].end()
                jobs.popleft()
            pool.extend(bufs)
            os.close(fd)


class _Job:
    """A batch of reads and what it reads into. It holds its buffer until
    the reads have ended (end()), however it is let go: the engine's thread
    writes into the buffer, and a buffer freed under it crashes the process.
    A Batch itself waits for its reads when deallocated, so only the buffer
    must outlive it."""

    __slots__ = ("batch", "buf", "fds", "items", "res")

    def __init__(self, buf, fds: list):
        self.batch = None  # the engine's Batch, once submitted
        self.buf = buf
        self.fds = fds  # descriptors the reads use, closed by end()
        self.items: list = []
        self.res: list = []

    def end(self) -> list:
        """Waits for the reads (once), then closes the descriptors; the results."""
        try:
            if self.batch is not None:
                self.res = self.batch.wait()
        finally:
            self.batch = None  # dropped: its dealloc waits, should wait() not have run
            fds, self.fds = self.fds, []
            for fd in fds:
                os.close(fd)
        return self.res

    def __del__(self):
        if self.batch is not None:  # let go unwaited (an interrupt between two lines)
            try:
                self.end()
            except BaseException:
                pass


def open_regular(path: str, flags: int) -> tuple[int, os.stat_result]:
    """Opens a chunk file as csrc/chunks.c chunk_open does: with O_NONBLOCK (a
    FIFO planted in a chunk's place must not block the open; cleared again for
    the reads), no symlink followed below the root, refused unless a regular
    file (ESPIPE; EISDIR for a directory), read-locked (layout.read_lock).
    Returns (fd, its fstat); raises OSError."""
    fd = open_in(path, flags | os.O_NONBLOCK, lock=True)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            if stat.S_ISDIR(st.st_mode):
                raise OSError(errno.EISDIR, "a directory")
            raise OSError(errno.ESPIPE, "not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _span(size: int) -> int:
    return HEADER_SIZE + round_up(max(size - HEADER_SIZE, 0), 4096)


def _open_why(e: OSError) -> str:
    if e.errno == errno.ENOENT:
        return "no longer there (removed while checking)"
    if e.errno == errno.ESTALE:
        return "no longer there (evicted and being reused while checking)"
    if e.errno == errno.ELOOP:
        return "a symbolic link now (the store never follows them)"
    if e.errno == errno.ESPIPE:
        return "not a regular file now (a FIFO, socket or device: the store never reads it)"
    if e.errno == errno.EISDIR:
        return "a directory now (the store never reads it)"
    return f"cannot open: {e.strerror}"


def _short_why(n: int, size: int) -> str:
    if n < 0:
        return f"header read failed: {os.strerror(-n)}"
    if size >= HEADER_SIZE:
        return f"header read returned {n} of {HEADER_SIZE} bytes (the file changed while read)"
    return f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte header (truncated)"


def _ident(st: os.stat_result) -> tuple[int, int, int]:
    """What a removal checks of a file judged: a file removed and stored
    anew can get the same inode number, so its change time too."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


@dataclass
class Verdict:
    file: StoreFile
    status: str  # ok | bad | version | gone | unreadable (an open or read error: reported, never removed)
    problem: str = ""
    header: Optional[Header] = None
    # (st_dev, st_ino, st_ctime_ns) of the file judged (fstat of the one opened): a removal checks all
    # three, since a file removed and stored anew can get the same inode number
    ident: Optional[tuple[int, int, int]] = None
    size: int = 0  # its size (fstat)


def _judge_header(
    f: StoreFile, hmv, hn: int, plen: int, ident: tuple[int, int, int], size: int
) -> Union[Header, "Verdict"]:
    """The header read (hn bytes into hmv) of a file of `size` bytes: its
    Header when the file holds the header's key and HEADER_SIZE +
    payload_len bytes, else the Verdict."""

    def v(status: str, why: str = "", h: Optional[Header] = None) -> Verdict:
        return Verdict(f, status, why, h, ident, size)

    if hn < 0:
        return v("unreadable", f"header read failed: {os.strerror(-hn)}")
    if hn != HEADER_SIZE:  # fstat said it held a header: it changed while it was read
        return v("unreadable", _short_why(hn, size))
    try:
        h = decode_header(hmv)
    except FormatVersionMismatch as e:
        return v("version", str(e))
    except BadHeader as e:
        return v("bad", f"bad header: {e}")
    why = _key_elsewhere(f, h)
    if why:
        return v("bad", why, h)
    if h.payload_len != plen:
        how = "truncated" if plen < h.payload_len else "too long"
        return v("bad", f"payload is {plen} bytes, header says {h.payload_len} ({how})", h)
    return h


def _judge(
    f: StoreFile, hmv, hn: int, pn: int, pcrc: int, plen: int, ident: tuple[int, int, int], size: int
) -> Verdict:
    def v(status: str, why: str = "", h: Optional[Header] = None) -> Verdict:
        return Verdict(f, status, why, h, ident, size)

    h = _judge_header(f, hmv, hn, plen, ident, size)
    if isinstance(h, Verdict):
        return h
    if pn < 0:
        return v("unreadable", f"payload read failed: {os.strerror(-pn)}", h)
    if pn != plen:
        return v("unreadable", f"payload read returned {pn} of {plen} bytes (the file changed while read)", h)
    if plen and pcrc != h.payload_crc:
        return v("bad", f"payload checksum mismatch (CRC32C {pcrc:08x}, header says {h.payload_crc:08x})", h)
    return v("ok", "", h)
