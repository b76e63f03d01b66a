"""The durable chunk store: one file per chunk, an in-memory LRU index, and
capacity, over the C engine. Knows nothing of LMCache; adapters translate.

Layout: <path>/<2 hex>/<32 hex>.fxkv, the name a BLAKE2b digest of the key,
the path chosen by digest when several are given (striping). Writes go to a
temporary name in the same directory and are renamed into place, so a reader
sees a whole chunk or none. The index is rebuilt at start from names and
sizes only; headers are read on first use.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generator, Optional, Sequence

from . import _fxio
from .chunkfile import (
    HEADER_SIZE,
    SUFFIX,
    BadHeader,
    ChunkMeta,
    FormatVersionMismatch,
    chunk_digest,
    decode_header,
    encode_header,
)
from .metrics import READ_LATENCY_BUCKETS, latency_bucket
from .options import ConfigError, FxOptions

log = logging.getLogger("lmcache_fx")

TMP_MARK = ".tmp."
STALE_TMP_SECONDS = 3600  # a temporary file this old belongs to a dead writer


@dataclass
class Entry:
    path: str
    size: int  # bytes of the file
    meta: Optional[ChunkMeta] = None  # known once the header was read or written


@dataclass
class ReadResult:
    ok: bool
    nbytes: int = 0


class Stats:
    """Counters; read them, never write from outside."""

    def __init__(self):
        self.lock = threading.Lock()
        self.chunks_read = self.bytes_read = 0
        self.chunks_written = self.bytes_written = 0
        self.hits = self.misses = self.corrupt = self.evictions = self.write_errors = self.read_errors = 0
        self.read_seconds = 0.0
        self.read_batches = 0
        self.read_latency_counts = [0] * (len(READ_LATENCY_BUCKETS) + 1)  # a histogram, +Inf last

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def observe_read(self, seconds: float, **kw) -> None:
        """Counts one read batch and its latency along with other counters."""
        i = latency_bucket(seconds)
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)
            self.read_batches += 1
            self.read_seconds += seconds
            self.read_latency_counts[i] += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(self).items() if k != "lock"}


class ChunkStore:
    def __init__(self, options: FxOptions, engine: Optional["_fxio.Engine"] = None):
        self.options = options
        self.roots = [os.path.abspath(p) for p in options.paths]
        self.file_mode = 0o660 if options.shared_group else 0o600
        self.dir_mode = 0o770 if options.shared_group else 0o700
        self._lock = threading.RLock()
        self._index: "OrderedDict[str, Entry]" = OrderedDict()  # digest -> entry, LRU first
        self._pins: dict[str, int] = {}
        self._usage = 0
        self._reserved = 0  # bytes of writes in progress, counted against capacity
        self._made_dirs: set[str] = set()
        self._tmp_seq = 0
        self._enospc_until = 0.0
        self._enospc_count = 0
        self._io_warn_until = 0.0
        self._io_warn_quiet = 0
        self._hdr_pool: list = []
        self.stats = Stats()
        self.engine = None
        created: list[str] = []
        try:  # nothing half-starts: on any error, undo what was made here
            for root in self.roots:
                self._prepare_root(root, created)
            self.engine = engine or make_engine(options)
            self.odirect = self._decide_odirect()
            self._scan()
        except BaseException:
            if self.engine is not None and engine is None:
                self.engine.close()
            for d in reversed(created):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            raise

    # ------------------------------------------------------------ start-up
    def _prepare_root(self, root: str, created: list) -> None:
        missing = []  # directories this call creates, deepest first
        p = root
        while not os.path.lexists(p) and p != os.path.dirname(p):
            missing.append(p)
            p = os.path.dirname(p)
        if not os.path.isdir(p):
            raise ConfigError(f"path: {p!r} exists and is not a directory; pick a directory")
        try:
            os.makedirs(root, mode=self.dir_mode, exist_ok=True)
            if missing and self.options.shared_group:
                os.chmod(root, self.dir_mode)  # the umask may have removed group bits
            st = os.stat(root)
        except OSError as e:
            raise ConfigError(f"path: cannot create or open the store directory {root!r}: {e.strerror}") from None
        finally:
            created.extend(d for d in reversed(missing) if os.path.isdir(d))
        why = root_problem(root, st, self.options.shared_group)
        if why:
            raise ConfigError(f"path: {why}")

    def _decide_odirect(self) -> bool:
        mode = self.options.odirect
        if mode == "false":
            return False
        probe = os.path.join(self.roots[0], f"{TMP_MARK}odirect.{os.getpid()}")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            os.close(fd)
            ok, why = True, ""
        except OSError as e:
            ok, why = False, e.strerror
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        if not ok and mode == "true":
            raise ConfigError(f"odirect: true, but {self.roots[0]!r} does not allow O_DIRECT ({why}); use auto")
        if not ok:
            log.info("lmcache-fx: O_DIRECT not supported on %s (%s); using buffered I/O", self.roots[0], why)
        return ok

    def _scan(self) -> None:
        """Rebuilds the index from names and sizes; removes stale temporaries."""
        found = []
        now = time.time()
        for root in self.roots:
            with os.scandir(root) as top:
                subdirs = [d.path for d in top if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
            for sub in subdirs:
                with os.scandir(sub) as it:
                    for de in it:
                        name = de.name
                        try:
                            st = de.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if not stat.S_ISREG(st.st_mode):
                            continue  # a planted symlink or device is never an entry
                        if TMP_MARK in name:
                            if self._tmp_is_stale(name, st.st_mtime, now):
                                _unlink_quiet(de.path)
                            continue
                        if name.endswith(SUFFIX) and len(name) == 32 + len(SUFFIX):
                            found.append((st.st_mtime, name[:32], de.path, st.st_size))
        found.sort()  # oldest first = least recently used
        with self._lock:
            for _, digest, path, size in found:
                self._index[digest] = Entry(path, size)
                self._usage += size
        if found:
            log.info("lmcache-fx: found %d chunks (%.2f GB) under %s", len(found), self._usage / 1e9,
                     ",".join(self.roots))
        self._evict_to(self.options.max_capacity_bytes)

    @staticmethod
    def _tmp_is_stale(name: str, mtime: float, now: float) -> bool:
        # <digest>.fxkv.tmp.<pid>.<seq>: stale when the writer is gone
        try:
            pid = int(name.split(TMP_MARK, 1)[1].split(".")[0])
        except (IndexError, ValueError):
            return now - mtime > STALE_TMP_SECONDS
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return now - mtime > STALE_TMP_SECONDS

    # ------------------------------------------------------------ lookups
    def path_for(self, digest: str) -> str:
        root = self.roots[int(digest[:8], 16) % len(self.roots)]
        return os.path.join(root, digest[:2], digest + SUFFIX)

    def _entry(self, key: str) -> Optional[Entry]:
        """Index entry, looking on disk when the index has none (another
        process may have written it)."""
        d = chunk_digest(key)
        with self._lock:
            e = self._index.get(d)
            if e is not None:
                return e
        path = self.path_for(d)
        try:
            dfd = _open_dir(os.path.dirname(path))
            try:
                st = os.stat(os.path.basename(path), dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        with self._lock:
            e = self._index.get(d)
            if e is None:
                e = self._index[d] = Entry(path, st.st_size)
                self._usage += st.st_size
            return e

    def contains(self, key: str) -> bool:
        return self._entry(key) is not None

    def pin(self, key: str) -> bool:
        d = chunk_digest(key)
        if self._entry(key) is None:
            return False
        with self._lock:
            self._pins[d] = self._pins.get(d, 0) + 1
        return True

    def unpin(self, key: str) -> bool:
        d = chunk_digest(key)
        with self._lock:
            n = self._pins.get(d, 0)
            if n <= 0:
                return False
            if n == 1:
                del self._pins[d]
            else:
                self._pins[d] = n - 1
        return True

    def remove(self, key: str) -> bool:
        return self._drop(chunk_digest(key), unlink=True)

    def _drop(self, digest: str, unlink: bool, expect_path: Optional[str] = None) -> bool:
        with self._lock:
            e = self._index.pop(digest, None)
            if e is not None:
                self._usage -= e.size
        path = e.path if e else (expect_path or self.path_for(digest))
        if unlink:
            return _unlink_quiet(path) or e is not None
        return e is not None

    @property
    def usage_bytes(self) -> int:
        with self._lock:
            return self._usage

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ------------------------------------------------------------ eviction
    def _evict_to(self, limit: int) -> bool:
        """Evicts least recently used, unpinned chunks until usage plus
        writes in progress <= limit."""
        victims = []
        with self._lock:
            limit -= self._reserved
            if self._usage <= limit:
                return True
            for d, e in self._index.items():
                if self._usage <= limit:
                    break
                if self._pins.get(d):
                    continue
                victims.append((d, e))
                self._usage -= e.size
            for d, _ in victims:
                del self._index[d]
            ok = self._usage <= limit
        for _, e in victims:
            _unlink_quiet(e.path)
        if victims:
            self.stats.add(evictions=len(victims))
        return ok

    # ------------------------------------------------------------ writes
    def write(self, items: Sequence[tuple[str, int, int, ChunkMeta]]) -> list[bool]:
        """Stores chunks given as (key, address, nbytes, meta); one engine batch
        for the payloads, one for the headers. Returns per item whether the
        chunk is now in the store."""
        out = [False] * len(items)
        todo = []
        cap = self.options.max_capacity_bytes
        for i, (key, addr, nbytes, meta) in enumerate(items):
            d = chunk_digest(key)
            with self._lock:
                if d in self._index:
                    out[i] = True
                    continue
            size = HEADER_SIZE + nbytes
            with self._lock:  # evict and reserve as one step, so concurrent writers cannot overshoot
                room = size <= cap and self._evict_to(cap - size)
                if room:
                    self._reserved += size
            if not room:
                log.warning("lmcache-fx: no room for a %d-byte chunk under max_capacity_gb=%s (pinned chunks "
                            "fill it)", size, self.options.max_capacity_gb)
                continue
            todo.append((i, key, d, addr, nbytes, meta))
        if not todo:
            return out
        try:
            return self._write_files(todo, out)
        finally:
            with self._lock:
                self._reserved -= sum(HEADER_SIZE + t[4] for t in todo)

    def _write_files(self, todo, out: list[bool]) -> list[bool]:
        if time.monotonic() < self._enospc_until:
            self._count_enospc(len(todo))
            return out
        hdrs = _fxio.HostBuffer(HEADER_SIZE * len(todo), hugepages=False)
        files = []  # (i, key, digest, tmp, fd, nbytes, meta)
        try:
            for i, key, d, addr, nbytes, meta in todo:
                tmp, fd = self._create_tmp(d)
                if fd < 0:
                    continue
                try:
                    # Size the file first: writes inside EOF run in parallel, where
                    # extending O_DIRECT writes are serialised by the filesystem.
                    os.ftruncate(fd, HEADER_SIZE + _round_up(nbytes, 4096))
                except OSError as e:
                    os.close(fd)
                    self._write_failed(tmp, -e.errno)
                    continue
                files.append((i, key, d, tmp, fd, addr, nbytes, meta))
            res = self.engine.write([(f[4], HEADER_SIZE, f[6], f[5]) for f in files], crc=True)
            now = time.time_ns()
            hdr_ops, good = [], []
            for j, (f, (n, crc)) in enumerate(zip(files, res)):
                i, key, d, tmp, fd, addr, nbytes, meta = f
                if n != nbytes:
                    self._write_failed(tmp, n)
                    continue
                off = HEADER_SIZE * j
                encode_header(memoryview(hdrs)[off:off + HEADER_SIZE], key, meta, nbytes, crc, now)
                hdr_ops.append((fd, 0, HEADER_SIZE, hdrs.address + off))
                good.append(f)
            hres = self.engine.write(hdr_ops) if hdr_ops else []
            for f, n in zip(good, hres):
                i, key, d, tmp, fd, addr, nbytes, meta = f
                if n != HEADER_SIZE:
                    self._write_failed(tmp, n)
                    continue
                size = HEADER_SIZE + nbytes
                try:
                    if nbytes % 4096:
                        os.ftruncate(fd, size)  # trim the block padding
                    os.rename(tmp, self.path_for(d))
                except OSError as e:
                    self._write_failed(tmp, -e.errno)
                    continue
                with self._lock:
                    old = self._index.pop(d, None)
                    if old:
                        self._usage -= old.size
                    self._index[d] = Entry(self.path_for(d), size, meta)
                    self._usage += size
                out[i] = True
                self.stats.add(chunks_written=1, bytes_written=size)
        finally:
            for f in files:
                os.close(f[4])
            for f in files:
                if not out[f[0]]:
                    _unlink_quiet(f[3])
        return out

    def _create_tmp(self, digest: str) -> tuple[str, int]:
        final = self.path_for(digest)
        sub = os.path.dirname(final)
        if sub not in self._made_dirs:
            try:
                os.mkdir(sub, self.dir_mode)
            except FileExistsError:
                pass
            except OSError as e:
                self._write_failed(None, -e.errno)
                return "", -1
            else:
                if self.options.shared_group:  # past the umask
                    try:
                        dfd = _open_dir(sub)
                        try:
                            os.fchmod(dfd, self.dir_mode)
                        finally:
                            os.close(dfd)
                    except OSError:
                        pass
            self._made_dirs.add(sub)
        with self._lock:
            self._tmp_seq += 1
            seq = self._tmp_seq
        tmp = f"{final}{TMP_MARK}{os.getpid()}.{seq}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.odirect:
            flags |= os.O_DIRECT
        try:
            fd = _open_in(tmp, flags, self.file_mode)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                self.stats.add(write_errors=1)
                self._io_warning("lmcache-fx: %s is not a directory (a planted symlink?); not storing there", sub)
            else:
                self._write_failed(None, -e.errno)
            return "", -1
        if self.options.shared_group:
            try:
                os.fchmod(fd, self.file_mode)  # past the umask
            except OSError:
                pass
        return tmp, fd

    def _write_failed(self, tmp: Optional[str], res: int) -> None:
        if tmp:
            _unlink_quiet(tmp)
        self.stats.add(write_errors=1)
        if res == -errno.ENOSPC or res == -errno.EDQUOT:
            self._count_enospc(1)
        else:
            self._io_warning("lmcache-fx: store failed: %s", os.strerror(-res) if res < 0 else f"short write ({res})")

    def _io_warning(self, msg: str, *args) -> None:
        """A failing device fails every chunk: one warning per 5 s, with a count."""
        now = time.monotonic()
        with self._lock:
            if now < self._io_warn_until:
                self._io_warn_quiet += 1
                return
            quiet, self._io_warn_quiet = self._io_warn_quiet, 0
            self._io_warn_until = now + 5.0
        if quiet:
            msg += f" ({quiet} more I/O errors in the last 5 s not logged)"
        log.warning(msg, *args)

    def _count_enospc(self, n: int) -> None:
        """One error per burst of full-disk failures, not one per chunk."""
        now = time.monotonic()
        if now >= self._enospc_until:
            log.error("lmcache-fx: the store filesystem is full (ENOSPC); skipping stores for 5 s "
                      "(%d skipped in the last burst). Lower max_capacity_gb below the free space.",
                      self._enospc_count)
            self._enospc_count = 0
            self._enospc_until = now + 5.0
            # Evict a little so stores can resume once space is back.
            self._evict_to(int(self.usage_bytes * 0.95))
        self._enospc_count += n

    # ------------------------------------------------------------ reads
    def read_steps(
        self, keys: Sequence[str], allocate: Callable[[ChunkMeta], Optional[tuple[object, int, int]]]
    ) -> Generator[tuple[list, bool], list, tuple[list, list]]:
        """Reads chunks as a generator that yields engine batches (ops, crc)
        and receives their results, so the same logic runs blocking or
        awaited. `allocate(meta)` returns (handle, address, nbytes) or None.
        Returns (one handle or None per key, handles of failed chunks)."""
        n = len(keys)
        entries = [self._entry(k) for k in keys]
        t0 = time.perf_counter()
        fds: list[int] = []
        try:
            # Phase 1: headers of chunks this process has not seen yet.
            need = [i for i, e in enumerate(entries) if e is not None and e.meta is None]
            if need:
                hbuf = _fxio.HostBuffer(HEADER_SIZE * len(need), hugepages=False)
                ops, opened = [], []
                for j, i in enumerate(need):
                    fd = self._open_read(entries[i].path)
                    if fd < 0:
                        entries[i] = None
                        continue
                    fds.append(fd)
                    ops.append((fd, 0, HEADER_SIZE, hbuf.address + HEADER_SIZE * j))
                    opened.append((j, i))
                res = yield ops, False
                for (j, i), r in zip(opened, res):
                    e = entries[i]
                    mv = memoryview(hbuf)[HEADER_SIZE * j:HEADER_SIZE * (j + 1)]
                    h = self._check_header(keys[i], e, mv, r)
                    if h is None:
                        entries[i] = None
                    else:
                        e.meta = h.meta
                for fd in fds:
                    os.close(fd)
                fds.clear()
            # Phase 2: header again (the file may have been replaced) and payload.
            out: list[Optional[object]] = [None] * n
            allocs: list[Optional[tuple]] = [None] * n
            for i, e in enumerate(entries):
                if e is None:
                    continue
                a = allocate(e.meta)
                if a is None:
                    break  # the pool is full: later chunks would be useless anyway
                allocs[i] = a
            hbuf = _fxio.HostBuffer(HEADER_SIZE * max(n, 1), hugepages=False)
            ops, slots = [], []
            for i, a in enumerate(allocs):
                if a is None:
                    continue
                fd = self._open_read(entries[i].path)
                if fd < 0:
                    entries[i] = None
                    continue
                fds.append(fd)
                ops.append((fd, 0, HEADER_SIZE, hbuf.address + HEADER_SIZE * i))
                ops.append((fd, HEADER_SIZE, a[2], a[1]))
                slots.append(i)
            res = yield ops, self.options.verify
            nbytes = 0
            for k, i in enumerate(slots):
                hr, pr = res[2 * k], res[2 * k + 1]
                prn, pcrc = pr if isinstance(pr, tuple) else (pr, None)
                e = entries[i]
                mv = memoryview(hbuf)[HEADER_SIZE * i:HEADER_SIZE * (i + 1)]
                h = self._check_header(keys[i], e, mv, hr[0] if isinstance(hr, tuple) else hr)
                if h is None:
                    continue
                if h.meta != e.meta or h.payload_len != allocs[i][2]:
                    # Replaced by a chunk of another geometry: learn it, miss now.
                    e.meta = h.meta
                    continue
                if prn != h.payload_len:
                    self._corrupt(keys[i], e, f"payload is {prn} bytes, header says {h.payload_len}"
                                  if prn >= 0 else f"read failed: {os.strerror(-prn)}", remove=prn >= 0)
                    continue
                if pcrc is not None and pcrc != h.payload_crc:
                    self._corrupt(keys[i], e, "payload checksum mismatch")
                    continue
                out[i] = allocs[i][0]
                nbytes += prn
            hits = sum(1 for o in out if o is not None)
            with self._lock:
                for i, o in enumerate(out):
                    d = chunk_digest(keys[i])
                    if o is not None and d in self._index:  # evicted meanwhile by another thread: still a hit
                        self._index.move_to_end(d, last=True)
            self.stats.observe_read(time.perf_counter() - t0, chunks_read=hits, bytes_read=nbytes, hits=hits,
                                    misses=n - hits)
            # Handles allocated for chunks that failed go back to the caller to free.
            failed = [allocs[i][0] for i in range(n) if allocs[i] is not None and out[i] is None]
            return out, failed
        finally:
            for fd in fds:
                os.close(fd)

    def _open_read(self, path: str) -> int:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.odirect:
            flags |= os.O_DIRECT
        try:
            return _open_in(path, flags)
        except OSError as e:
            # Gone (evicted or removed by another process): a miss.
            if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                self._io_warning("lmcache-fx: cannot open %s (%s); treating it as a miss", path, e.strerror)
            self._drop(chunk_digest_of_path(path), unlink=False)
            return -1

    def _check_header(self, key: str, e: Entry, mv, res: int):
        if res != HEADER_SIZE:
            self._corrupt(key, e, f"header read returned {res} bytes" if res >= 0
                          else f"header read failed: {os.strerror(-res)}", remove=res >= 0)
            return None
        try:
            h = decode_header(mv)
        except FormatVersionMismatch as ex:
            log.warning("lmcache-fx: %s has %s; treating it as a miss", e.path, ex)
            return None
        except BadHeader as ex:
            self._corrupt(key, e, str(ex))
            return None
        if h.key != key:
            self._corrupt(key, e, f"holds key {h.key!r}, not the one asked for")
            return None
        return h

    def _corrupt(self, key: str, e: Entry, why: str, remove: bool = True) -> None:
        if remove:
            log.warning("lmcache-fx: chunk file %s is bad (%s); treating it as a miss and removing it", e.path, why)
            self.stats.add(corrupt=1)
        else:  # a read error, not bad data: the file is kept, and a failing device warns once per burst
            self._io_warning("lmcache-fx: reading chunk file %s failed (%s); treating it as a miss", e.path, why)
            self.stats.add(read_errors=1)
        self._drop(chunk_digest(key), unlink=remove, expect_path=e.path)

    def read(self, keys: Sequence[str], allocate, release: Callable[[object], None]) -> list[Optional[object]]:
        """Blocking read: drives read_steps with the engine."""
        return drive_blocking(self.engine, self.read_steps(keys, allocate), release)

    async def read_async(self, keys: Sequence[str], allocate, release) -> list[Optional[object]]:
        """The same read, awaited on an event loop."""
        return await drive_async(self.engine, self.read_steps(keys, allocate), release)

    def close(self) -> None:
        self.engine.close()


def root_problem(root: str, st: os.stat_result, shared_group: bool) -> Optional[str]:
    """Why an existing store directory is refused (the store and doctor agree), or None."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{root!r} is not a directory"
    # Root too: a directory another user controls could hold links that make root write anywhere.
    if st.st_uid != os.geteuid() and not shared_group:
        return (f"{root!r} belongs to uid {st.st_uid}, not to this user; use a directory of your own "
                "or set shared_group: true for a store shared by a group")
    if st.st_mode & stat.S_IWOTH:
        return (f"{root!r} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): anyone could plant "
                "chunk files there; use a directory of your own (chmod 700) or a group one with shared_group: true")
    if not os.access(root, os.W_OK | os.X_OK):
        return f"{root!r} is not writable by this user; fix its permissions or pick another"
    return None


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def chunk_digest_of_path(path: str) -> str:
    return os.path.basename(path)[:32]


def _open_dir(path: str) -> int:
    """A fan-out directory, refusing a symlink planted in its place (ELOOP)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _open_in(path: str, flags: int, mode: int = 0o600) -> int:
    """os.open of <root>/<ab>/<name> that follows no symlink below the root."""
    dfd = _open_dir(os.path.dirname(path))
    try:
        return os.open(os.path.basename(path), flags | os.O_NOFOLLOW, mode, dir_fd=dfd)
    finally:
        os.close(dfd)


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def drive_blocking(engine, gen, release) -> list:
    """Runs a read_steps generator with blocking engine batches."""
    try:
        ops, crc = next(gen)
        while True:
            ops, crc = gen.send(engine.read(ops, crc=crc))
    except StopIteration as stop:
        out, failed = stop.value
    for h in failed:
        release(h)
    return out


async def drive_async(engine, gen, release) -> list:
    """Runs a read_steps generator, awaiting each batch through its eventfd
    so the event loop keeps running while the engine reads."""
    import asyncio

    loop = asyncio.get_running_loop()

    async def run(ops, crc):
        batch = engine.submit(ops, write=False, crc=crc)
        fd = batch.fileno()
        if not batch.done():
            fut = loop.create_future()
            loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(fd)
        return batch.wait()

    try:
        ops, crc = next(gen)
        while True:
            ops, crc = gen.send(await run(ops, crc))
    except StopIteration as stop:
        out, failed = stop.value
    for h in failed:
        release(h)
    return out


_engine_warned = set()


def make_engine(options: FxOptions):
    """Builds the C engine; warns once per reason when io_uring is not used."""
    try:
        eng = _fxio.Engine(options.io_engine, options.queue_depth, options.split_bytes)
    except OSError as e:
        raise ConfigError(f"io_engine: {e}; use io_engine: auto to fall back to the thread engine") from None
    if eng.fallback_reason and eng.fallback_reason not in _engine_warned:
        _engine_warned.add(eng.fallback_reason)
        log.warning("lmcache-fx: io_uring unavailable (%s); using the thread engine", eng.fallback_reason)
    return eng
