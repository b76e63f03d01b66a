"""The durable chunk store: one file per chunk, an in-memory LRU index, and
capacity, over the C engine. Knows nothing of LMCache; adapters translate.

Files are laid out as core/layout.py says; writes go to a temporary name in
the same directory and are renamed into place, so a reader sees a whole chunk
or none. The index is rebuilt at start from names and sizes only; headers are
read on first use.

Capacity is shared by every process on a path through the ledger
(core/ledger.py). Scans recompute the ledger from the files (at start, every
RESCAN_SECONDS, and when an evictor's list of victims runs out) so crashes and
foreign deletions cannot make it drift for long. The periodic one walks
without the lock and counts only when the ledger did not change meanwhile; an
evictor's list is otherwise refreshed by a walk made without the lock too.
Least recently used is the file mtime: a write sets it, a hit refreshes it at
most once per TOUCH_SECONDS, and the evictor removes the oldest files first,
whoever wrote them.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional, Sequence

from .. import _fxio
from . import medium
from .chunkfile import (
    HEADER_SIZE,
    BadHeader,
    ChunkMeta,
    FormatVersionMismatch,
    chunk_digest,
    decode_header,
    encode_header,
    header_body_of,
    header_fits,
    mac_ok,
    memory_at,
    unflagged_chunk,
    why_no_mac,
)
from .drive import ReadCancelled, drive_async, drive_blocking, make_engine
from .layout import (
    CAP_NAME,
    HOST_TAG,
    LOCK_DIR,
    LOCK_NAME,
    ROOTS_NAME,
    SPARE_SEQ_MARK,
    SPARES_NAME,
    STALE_SPARE_SECONDS,
    STALE_TMP_SECONDS,
    TMP_MARK,
    TMP_TAGS,
    FileStat,
    chunk_digest_of_path,
    devices_under,
    fanout_dirs,
    on_read_only_fs,
    open_dir,
    open_in,
    paths_for,
    place_roots,
    probe_odirect,
    relative_name,
    rename_if_same,
    root_choices,
    root_index,
    root_of_path,
    root_places,
    root_problem,
    round_up,
    scan_fanout,
    share_fd,
    stat_in,
    stat_many,
    takes_writes,
    tmp_is_spare,
    tmp_is_stale,
    unlink_if_same,
    unlink_quiet,
    write_lock,
)
from .ledger import Ledger, LockTimeout
from .metrics import READ_LATENCY_BUCKETS, latency_bucket
from .once import Handoff, log_once
from .options import GIB, SHARED_GROUP_FIX, ConfigError, FxOptions, auth_key_bytes

log = logging.getLogger("lmcache_fx")

# Store failures that say a root's filesystem or device is unusable for now, not that one chunk
# was: a striped store sends the chunks bound there to their other root for a while.
STEERED_ERRNOS = frozenset(-e for e in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENODEV, errno.ENXIO))

__all__ = [
    "ChunkStore",
    "Entry",
    "ReadResult",
    "Stats",
    "LOCK_NAME",
    "TMP_MARK",
    "HOST_TAG",
    "root_problem",
    "drive_async",
    "drive_blocking",
    "make_engine",
]

TOUCH_SECONDS = 10.0  # a hit refreshes its chunk's mtime (the shared LRU clock) at most this often
RESCAN_SECONDS = 300.0  # the ledger is recomputed from the files at least this often (by any process)
EVICTED_KEPT = 1 << 16  # evicted digests kept for take_evicted()
WRITE_WHOLE = 1 << 30  # Engine.write split: one piece per payload (the largest the engine takes)
# A large O_DIRECT store goes in sub-batches of about this many bytes (and at least WRITE_SUB_CHUNKS
# chunks), each one's payloads written while the next is prepared and the one before put in place.
WRITE_SUB_BYTES = 64 << 20
WRITE_SUB_CHUNKS = 16
FAILED_STORES_PROBLEM = 4  # chunk stores failed in a row before problem() reports it
VICTIM_LIST_SECONDS = 30.0  # an evictor reuses its sorted scan this long before scanning again
# On memory filesystems a removed chunk's file is kept as a spare for the next chunk of its size
# (fresh pages cost more than the copy into them): at most this long, and at most this share of
# max_capacity_gb, counted in the usage meanwhile. Not on disk filesystems: on XFS spares made
# stores 8-20 % faster but loads through LMCache's engine ~5 % slower, in bench pairs
# (docs/bench-repeats/spares/), and loads are what a cache is for.
SPARE_SECONDS = 60.0
SPARE_SHARE = 4
FRUITLESS_SECONDS = 2.0  # after a walk for room that found none, none again this long while the ledger is unchanged
SPARES_LOOK_SECONDS = 1.0  # an evictor walks for other processes' new spares at most this often
READ_ONLY_LOOK_SECONDS = 10.0  # a path on a read-only filesystem is looked at again this often (writable: used again)
SPARES_KEPT, SPARES_TAKEN = 0, 8  # the offsets of layout.SPARES_NAME's two counters
# Only files of at least this many bytes are kept as spares: for a small file the two renames,
# the open and the lock that a spare costs are more than its fresh pages (the crossing lies between
# 64 and 128 KiB on tmpfs; the probe is in the commit message that set this).
SPARE_MIN_BYTES = 128 << 10
# Both intervals grow to this many times the last walk's duration: a store of a million files
# is not walked every 30 s, nor its lock held for a walk more than ~1% of the time.
SCAN_DUTY = 100
# Read batches take their header scratch (HEADER_SIZE per chunk) from buffers kept between
# batches, at most this many bytes of them idle: a fresh mapping costs a page fault, a zeroed
# page and an unmap per chunk, about a quarter of a 4 KiB chunk's read from memory (perf).
SCRATCH_KEPT_BYTES = 32 << 20
TOUCHES_PENDING_MAX = 1 << 16  # recency updates waiting for the toucher; more are dropped (advisory)
_tmp_seq = itertools.count(1)  # process-wide: two stores on one path in one process never collide
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A root is the path the operator gave, a link to it followed (every tool follows it too); what
# lies below it is opened with _DIR_FLAGS: a link planted there redirects nothing.
_ROOT_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_GONE = (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.ESTALE)  # ESTALE: being reused (read locks)
_PID = [os.getpid()]  # this process's pid for temporary names, re-read in a forked child
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))
_CORRUPT_STATUSES = frozenset(
    (_fxio.CHUNK_BAD_MAGIC, _fxio.CHUNK_BAD_CRC, _fxio.CHUNK_BAD_HEADER, _fxio.CHUNK_PAYLOAD_CRC)
)
# Written over a reused file's header before its new payload (_open_deferred): page-aligned, as
# O_DIRECT needs, and read-only, so every thread may write from it.
_ZERO_HEADER = mmap.mmap(-1, HEADER_SIZE, prot=mmap.PROT_READ)


def _same_dir(dfd: int, path: str) -> bool:
    """Whether `path` (not followed if a symlink) is still the directory `dfd` is open on."""
    try:
        a, b = os.stat(dfd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(b.st_mode) and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _fstat(fd: int) -> Optional[os.stat_result]:
    """fstat of fd, or None where it fails."""
    try:
        return os.fstat(fd)
    except OSError:
        return None


def _identity(fd: int) -> tuple[Optional[tuple[int, int]], Optional[int]]:
    """((st_dev, st_ino), st_size) of an open file, or (None, None)."""
    st = _fstat(fd) if fd >= 0 else None
    if st is None:
        return None, None
    return (st.st_dev, st.st_ino), st.st_size


@dataclass(slots=True)
class Entry:
    path: str
    size: int  # bytes of the file
    meta: Optional[ChunkMeta] = None  # known once the header was read or written
    touched: float = 0.0  # time.monotonic() of the last mtime refresh by this process
    body: Optional[bytes] = None  # the header's JSON body as last seen (read_chunks' `expect`)
    check_payload: bool = False  # its header as last seen has FLAG_CHECK_PAYLOAD
    # Its header was of another format version when last read: a miss for lookups here, and written
    # over by a store of its key (else it was found by every lookup, refused by every read, never
    # stored again).
    other_version: bool = False
    # The inode that meta or other_version was read from (0: not known): a lookup that finds another
    # file in its place forgets both, since lookups now answer from them (another process may have
    # stored the chunk anew, and a flag of the file before hid it for good).
    ino: int = 0
    # The mtime the last lookup's stat saw, and the one seen when meta or other_version was read: a
    # chunk lookups do not count whose mtime moved since is looked at again (reuse_evicted writes a
    # new chunk into an evicted one's file: same inode, new content).
    seen_mtime_ns: int = 0
    mtime_ns: int = 0
    # (inode, mtime) of the file check_payload was known for, kept as this process writes, reads and
    # touches it: an evictor reusing the file trusts the flag only while both match (a peer that
    # stored the key anew, unflagged, left another file at the same path).
    flag_seen: tuple[int, int] = (0, 0)


def _fit(e: Optional[Entry], usable: Optional[Callable[[ChunkMeta], bool]]) -> Optional[Entry]:
    """e, or None where a read before found it of another format version or
    of a meta `usable` refuses (lookups answer as the read would), unless
    its file was written since (then the next read looks at it again)."""
    if e is None or not (e.other_version or (usable is not None and e.meta is not None and not usable(e.meta))):
        return e
    if e.mtime_ns and e.seen_mtime_ns != e.mtime_ns:
        _forget_header(e)
        return e
    return None


def _read_from(e: Entry, ident: Optional[tuple[int, int]]) -> None:
    """Notes which file e's meta or other_version was just read from: its
    inode ((st_dev, st_ino) `ident`) and the mtime the lookup before saw."""
    e.ino, e.mtime_ns = (ident[1] if ident else 0), e.seen_mtime_ns
    e.flag_seen = (e.ino, e.mtime_ns)


def _forget_header(e: Entry) -> None:
    """What a read learnt of e's header, forgotten: the next read takes it anew."""
    e.meta = e.body = None
    e.other_version, e.check_payload, e.ino, e.mtime_ns, e.flag_seen = False, False, 0, 0, (0, 0)


@dataclass
class _WriteFile:
    """One chunk being written: its temporary file and where it goes."""

    i: int  # its index in the write call
    key: str
    digest: str
    addr: int
    nbytes: int
    meta: ChunkMeta
    final: str  # the chunk's path
    tmp: str  # the temporary's name in the fan-out directory
    dfd: int  # the fan-out directory's descriptor (the store's)
    fd: int
    reserved: int = 0  # bytes counted in the shared usage
    body: Optional[bytes] = None  # the header's JSON body
    recycled: bool = False  # an evicted chunk's file was moved to the temporary's name, to be written into
    recycled_ino: int = 0
    recycled_size: int = 0  # its bytes, taken off the usage until the file is adopted (_open_deferred)
    recycled_flagged: bool = False  # the evictor's index knew its header carries FLAG_CHECK_PAYLOAD
    mtime_ns: int = 0  # its LRU clock, set when it was put in place


@dataclass
class _Spare:
    """A removed chunk's file, moved to a temporary's name of this process
    (so a walk counts it, and removes it once this process is gone or the
    spare is older than STALE_SPARE_SECONDS)."""

    path: str
    ident: tuple[int, int]  # (st_dev, st_ino)
    size: int
    at: float  # monotonic, when it was kept


def _less_moved(usage: int, files: Sequence["_WriteFile"]) -> int:
    """A rescan's usage less the files moved to temporaries of this write
    (victims, spares) and not adopted yet: the walk counts them as a live
    writer's, and adopting one counts it again (_open_deferred)."""
    return max(0, usage - _moved_bytes(files))


def _moved_bytes(files: Sequence["_WriteFile"]) -> int:
    """Bytes of the files moved to temporaries of this write (victims,
    spares) and not adopted yet: on disk, out of the write's own count."""
    return sum(f.recycled_size for f in files if f.recycled)


class _StrayAllocations(ValueError):
    """An allocate_many answer that does not fit its run: a misuse, which
    makes the batch misses; its destinations are released with the rest."""

    def __init__(self, msg: str, allocs: list):
        super().__init__(msg)
        self.allocs = allocs


class _Call:
    """fn() run on a thread of its own (`background`; fn releases the GIL)
    or here; result() waits for it and returns or raises what it did. The
    waits outlast an interrupt (Ctrl-C, a signal handler's exception), which
    is raised once fn has returned: fn writes through files and buffers the
    caller frees after it (a commit freed them under a running write: a
    SIGSEGV, or chunk bytes written into whatever files took their
    descriptors). `owner`, when given, has the call as its `call` before the
    thread starts."""

    def __init__(self, fn: Callable[[], Any], background: bool, owner: Any = None):
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        if owner is not None:
            owner.call = self
        # An interrupt inside Thread.start() can come after the thread was made and before it ran a
        # line (its ident still unset): whether it runs fn is settled by the handoff.
        self._handoff = Handoff()
        if background:
            try:
                thread = threading.Thread(target=self._run_begun, args=(fn,), name="lmcache-fx-write", daemon=True)
                thread.start()
                return
            except BaseException as e:
                if not self._handoff.give_up():  # it runs: waited for first
                    self.wait_out()
                    raise
                if not isinstance(e, RuntimeError):  # an interrupt before it ran: fn never runs
                    self._error = e
                    self._done.set()
                    raise
            # no thread can be started (a pids limit): the sub-batch runs here
        self._run(fn)

    def _run_begun(self, fn: Callable[[], Any]) -> None:
        """The thread's target: fn, unless its starter gave it up first."""
        if self._handoff.begin():
            self._run(fn)

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # handed to whoever waits
            self._error = e
        finally:
            self._done.set()

    def wait_out(self) -> None:
        """Waits until fn has returned; an interrupt meanwhile is raised
        after it. (Not Thread.join: an interrupted join takes the thread
        for finished from then on.)"""
        held: Optional[BaseException] = None
        while True:
            try:
                if self._done.wait(0.05):
                    break
            except BaseException as e:
                held = held or e
        if held is not None:
            raise held

    def result(self) -> Any:
        self.wait_out()
        if self._error is not None:
            raise self._error
        return self._value


@dataclass
class _ChunkFiles:
    """A (sub-)batch of O_DIRECT stores whose Engine.write_chunks call was
    started: what its commit needs."""

    files: list  # every _WriteFile made (the commit removes what is not put in place)
    dirfds: dict  # its fan-out directories' descriptors, closed after the commit
    good: list = field(default_factory=list)  # those with room, being written
    hdrs: Any = None  # their headers' buffer, alive until the writes are done
    call: Optional[_Call] = None
    finished: bool = False  # _finish_chunk_files began: it commits once


def _tmp_name(final: str, spare: bool = False) -> str:
    """A temporary's name in the directory of `final` (a scan knows its writer
    by it, and a spare as one: layout.tmp_is_stale)."""
    return f"{os.path.basename(final)}{TMP_MARK}{_PID[0]}.{SPARE_SEQ_MARK if spare else ''}{next(_tmp_seq)}.{TMP_TAGS}"


def _ident(st: Optional[os.stat_result]) -> Optional[tuple[int, int]]:
    return None if st is None else (st.st_dev, st.st_ino)


def _gib_text(n: int) -> str:
    # In the unit of max_capacity_gb, with the digits a small cap needs (not "0.00 GiB")
    return f"{n / (1 << 30):.3g} GiB"


def _unlink_at(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


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
        self.unauthenticated = 0  # refused for their MAC (auth_key): removed, but not counted in corrupt
        self.lookup_chunks = self.lookup_hits = 0  # chunks asked for in lookups, and found
        self.recycled = 0  # evictions whose file a new chunk was written into
        self.scans = 0  # directory scans under the shared lock (start, drift, victims)
        self.scan_seconds = 0.0
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


def _say_uring_short_of_workers() -> None:
    log_once(
        log,
        "uring_sync_pieces",
        logging.WARNING,
        "lmcache-fx: io_uring could not start a kernel worker (io-wq) for some reads, most likely a pids limit "
        "(the container's or cgroup's pids.max) with no task to spare; those reads run on the reading thread "
        "instead, slower. Raise the pids limit to restore parallel reads",
    )


class _Toucher:
    """Sets the shared LRU clock (chunk mtimes) of hits on a thread of its
    own, off the lookup and read path: a metadata write waits for as long as
    the filesystem is frozen (fsfreeze, an LVM or cloud snapshot), and a hit
    must not. Recency is advisory: past TOUCHES_PENDING_MAX waiting, more
    are dropped. Holds its own descriptors of the roots, so that closing the
    store never waits for a frozen filesystem, nor leaves one in use."""

    def __init__(self, rootfds: Sequence[int]):
        self._fds = [os.dup(fd) for fd in rootfds]
        self._cv = threading.Condition()
        self._pending: list[tuple[int, str, int]] = []
        self._busy = False
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._pid = _PID[0]
        self.dropped = 0

    def _check_fork(self) -> None:
        """A forked child: the parent's thread is not here, and its lock may
        have been held at the fork."""
        if self._pid != _PID[0]:
            self._cv, self._pending, self._busy, self._thread = threading.Condition(), [], False, None
            self._pid = _PID[0]

    def submit(self, items: list[tuple[int, str, int]]) -> None:
        """Queues (root index, name beneath it, mtime ns) touches, in order;
        past TOUCHES_PENDING_MAX the oldest waiting go (the newest matter
        most to the LRU). Never raises: recency is advisory."""
        self._check_fork()
        with self._cv:
            if self._stop:
                return
            self._pending += items
            over = len(self._pending) - TOUCHES_PENDING_MAX
            if over > 0:
                self.dropped += over
                del self._pending[:over]
            if self._thread is None:
                t = threading.Thread(target=self._run, name="lmcache-fx-toucher", daemon=True)
                try:
                    t.start()
                except RuntimeError as e:  # no thread to be had: these touches go, the next submit tries again
                    self.dropped += len(self._pending)
                    self._pending = []
                    log.warning("lmcache-fx: no thread for the LRU clock (%s); hits' recency not recorded", e)
                    return
                self._thread = t
            self._cv.notify()

    def _run(self) -> None:
        fds = self._fds
        try:
            while True:
                with self._cv:
                    while not self._pending and not self._stop:
                        self._cv.wait()
                    if not self._pending:
                        return
                    batch, self._pending, self._busy = self._pending, [], True
                # Failures: gone, or not ours to touch; recency is advisory.
                _fxio.utime_beneath([(fds[r], name, t) for r, name, t in batch])
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
        finally:
            self._close_fds()

    def settle(self, timeout: float = 5.0) -> bool:
        """Waits until the touches queued so far are written; False if not
        within `timeout` (a frozen filesystem)."""
        self._check_fork()
        end = time.monotonic() + timeout
        with self._cv:
            while self._pending or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Stops the thread once what is queued is written; its descriptors
        go with it. Waited for up to a second (a frozen filesystem is not
        waited out), so that the roots are not left in use when it is idle."""
        self._check_fork()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            thread = self._thread
        if thread is None:
            self._close_fds()
        else:
            thread.join(1.0)

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class ChunkStore:
    def __init__(self, options: FxOptions, engine: Optional["_fxio.Engine"] = None):
        self.options = options
        self.roots = [os.path.abspath(p) for p in options.paths]
        self.file_mode = 0o660 if options.shared_group else 0o600
        # setgid: files and directories made below take the store's group, whoever makes them
        self.dir_mode = 0o2770 if options.shared_group else 0o700
        self._root_gid: dict[str, int] = {}
        self._rescan_soon = False  # a ledger update was skipped (lock timeout): the next write recomputes it
        self._scanned = time.time()  # when the ledger was last recomputed, as last read from it
        self._recompute_after = 0.0  # monotonic: no recompute before (a busy store's walk was wasted)
        self._recomputed_at = -1e18  # monotonic: this process's last recompute
        self._lock = threading.RLock()  # never held while taking the ledger
        self._index: "OrderedDict[str, Entry]" = OrderedDict()  # digest -> entry, LRU first (this process)
        self._index_limit = 65536
        self._pins: dict[str, int] = {}
        self._ledger: Ledger = None  # type: ignore[assignment]  # opened below; None once closed
        self._last_usage = 0  # the shared usage as last read from the ledger
        self._victims: list = []  # (mtime_ns, digest, path, size) oldest last; from this process's last scan
        self._victims_at = -1e9
        # The newest mtime that walk saw: victims younger came from this process's own writes since, and
        # other processes' chunks written since may be older than them (_evict_locked looks again).
        self._victims_walked_ns = 0
        self._victims_mark: tuple = (None, 0)  # the ledger's Ledger.mark() at that walk
        # (the ledger's change token, until when) after an eviction that walked and freed nothing
        self._fruitless: Optional[tuple[tuple, float]] = None
        self._walk_seconds = 0.0  # how long this process's last walk of the store took
        # Digests this process's evictor removed since the last take_evicted(); None (not kept)
        # until the first take, and once more than EVICTED_KEPT piled up, until the next.
        self._evicted: Optional[list[str]] = None
        self._made_dirs: set[str] = set()
        self._rename_noreplace = True  # until a filesystem of the store says it has no such rename
        self._spares: dict[int, list[_Spare]] = {}  # file size -> spares (ledger held to change)
        self._spare_bytes = 0  # their sizes' sum, kept so other threads read it without the ledger
        self._spares_pid = _PID[0]
        self._spares_fd = -1  # SPARES_NAME, open for the store's life on memory filesystems
        self._spares_writable = False  # ...for writing: the evictor may take other processes' spares
        self._spares_taken_seen = 0  # its count of takes when this store last looked (_forget_taken_spares)
        self._spares_kept_seen = 0  # its count of spares kept when this store last walked
        self._spares_kept_at = -1e9  # when this store last walked because it changed
        # Other processes' spares the last walk saw, (mtime_ns, path, size): the evictor's first victims
        self._others_spares: list[tuple[int, str, int]] = []
        self._rootfds: list[int] = []  # per root, O_PATH, for the store's life
        self._root_ids: list[tuple[int, int]] = []  # per root, (st_dev, st_ino) of what was opened
        self._wengine: Any = None  # payload writes on page-cache media (a thread engine), else the engine
        # root index -> until when its filesystem counts as full (ENOSPC met): chunks bound there go to
        # their other root; with every root full, stores are skipped
        self._full_until: dict[int, float] = {}
        # root index -> (until when, why) its stores fail otherwise (a read-only remount, lost
        # permissions, a failing device): steered around like a full one, never a cause to evict
        self._failing: dict[int, tuple[float, str]] = {}
        self._read_only_looked = 0.0  # monotonic: when paths on read-only filesystems were last looked at
        self._errors_at_write = 0  # stats.write_errors at the last store that wrote a chunk (problem())
        self._evict_after_write = False  # a full disk was met: evict a little once the write ends
        self._enospc_evicted_to: Optional[int] = None  # the usage the last full-disk eviction left
        self._enospc_freed = 0
        self._enospc_count = 0
        self._warned: dict[str, tuple[float, int]] = {}  # kind -> (quiet until, warnings not logged since)
        self._scratch_kept: list = []  # header scratch HostBuffers kept between read batches, smallest first
        self._scratch_pid = _PID[0]
        self._last_mtime_ns = 0
        self._toucher: Optional[_Toucher] = None
        self.stats = Stats()
        self.engine: Any = None
        if options.auth_key and options.direct_to_gpu:
            raise ConfigError(
                "auth_key: payloads read straight to the GPU cannot be authenticated; "
                "set direct_to_gpu: false or remove auth_key"
            )
        self._mac_key = auth_key_bytes(options.auth_key, "auth_key") if options.auth_key else None
        created: list[str] = []
        lock_made = False
        try:  # nothing half-starts: on any error, undo what was made here
            for root in self.roots:
                self._prepare_root(root, created)
            for root in self.roots:
                self._rootfds.append(os.open(root, _ROOT_FLAGS))
                st = os.fstat(self._rootfds[-1])
                if (st.st_dev, st.st_ino) in self._root_ids:
                    # Two names of one directory (a symlink, a bind mount): each chunk would be found
                    # under both, taken for two copies and unlinked as the older one.
                    first = self.roots[self._root_ids.index((st.st_dev, st.st_ino))]
                    raise ConfigError(
                        f"path: {root} is the same directory as {first} (a symlink or a bind mount); "
                        "list each directory once"
                    )
                self._root_ids.append((st.st_dev, st.st_ino))
            self._toucher = _Toucher(self._rootfds)
            # Reads read-lock each chunk file on local filesystems: evicted files can then be reused
            # while other processes read the store (_open_deferred).
            self.lock_reads = medium.locks_reads(self.roots)
            # Reuse rewrites a file only when no reader can hold it, which locks tell: not where
            # another host cannot see this one's locks (nor this one another's).
            local_locks, posix_local, flock_local = medium.client_local_locks(self.roots)
            self.reuse_evicted = options.reuse_evicted and not posix_local
            magics = medium.fs_magics(self.roots)
            in_memory = bool(magics) and magics <= medium.MEMORY_FS_MAGICS  # every root: a disk one can be torn
            if self.reuse_evicted and not options.verify and self._mac_key is None and not in_memory:
                # A reused file's new header, payload and rename reach the disk in no set order (no
                # fsync): after a power cut the new key's header can stand over the old key's payload,
                # which only the payload check (or a MAC) tells. Without either, another prompt's KV
                # would be served (found by real power cuts of XFS: 2 chunks of 162 torn ones).
                self.reuse_evicted = False
                log.info("lmcache-fx: evicted files are not reused (reuse_evicted) with verify: false and no auth_key")
            if local_locks and (posix_local and options.reuse_evicted or flock_local):
                log.warning(
                    "lmcache-fx: %s at %s keeps file locks on this host alone, so processes on other hosts "
                    "cannot see this one's: %s; mount it with locking on the server (NFS: without nolock and "
                    "local_lock) to share it between hosts",
                    local_locks,
                    ",".join(self.roots),
                    "; ".join(
                        w
                        for w, on in (
                            ("evicted files are not reused (reuse_evicted off)", posix_local and options.reuse_evicted),
                            ("the shared capacity is counted per host", flock_local),
                        )
                        if on
                    ),
                )
            # A store that rewrites evicted files on disk flags every chunk it writes: after a power cut
            # either chunk's header can stand over part of the other's payload, so every reader checks
            # those payloads, verify or not (chunkfile.py, FLAG_CHECK_PAYLOAD).
            self._check_payload = self.reuse_evicted and not in_memory
            self._keeps_spares = self.reuse_evicted and self.lock_reads and bool(magics & medium.MEMORY_FS_MAGICS)
            # Distinct devices under the paths: queue depth and staging are per device, or a read
            # striped over eight devices keeps under one piece in flight on each.
            self.devices = devices_under(self.roots)
            self.engine = engine or make_engine(options, self.devices)
            self.odirect = self._decide_odirect()
            self.mapped_reads = self._decide_mapped_reads()
            # Staging is how a check is taken: decided for checked reads, which a verify-off store makes
            # too, of chunks flagged FLAG_CHECK_PAYLOAD (_read_payloads).
            staged, why = medium.decide_staged_reads(self.options.staged_reads, self.roots, self.odirect, True)
            if staged and getattr(self.engine, "kind", "") != "io_uring":
                staged, why = False, "the thread engine reads in place (staging is io_uring's)"
            self._stage_checked = staged
            if not self.options.verify:
                staged, why = medium.decide_staged_reads(self.options.staged_reads, self.roots, self.odirect, False)
            self.staged_reads = staged  # every read's, as doctor says
            if self.options.staged_reads == "true" and not staged:
                log.warning("lmcache-fx: staged_reads: true has no effect here: %s", why)
            # auto stages only reads big enough to stream; true stages every read (to test the path).
            self.stage_above = medium.STAGE_ABOVE_BYTES if self.options.staged_reads == "auto" else 0
            if self.staged_reads:
                # Made now, not at the first read: faulting in their 2 MiB pages took 20-25 ms in the
                # bench's process (compaction), which the first load after start-up waited for.
                _fxio.stage_prepare(self.devices)
            direct = os.O_DIRECT if self.odirect else 0
            self._reuse_flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | direct
            self._tmp_flags = self._reuse_flags | os.O_CREAT | os.O_EXCL
            self._wengine = self._payload_write_engine()
            self._wengine_for = self.engine  # replaced meanwhile (a test's fault injector): writes use the new one
            # Last before the scan: what can refuse a start is decided before the shared files exist.
            lock_made = not os.path.lexists(os.path.join(self.roots[0], LOCK_DIR))
            self._ledger = Ledger.open(
                self.roots[0], self.file_mode, self.dir_mode, options.shared_group, locked_reads=self.lock_reads
            )
            self._note_roots()
            self._note_cap()
            if magics & medium.MEMORY_FS_MAGICS:  # where spares are kept (by this process or another)
                self._open_spares_file()
            self._scan()
        except BaseException:
            # The ledger's files stay: another process may have opened them since, and one made
            # anew would split the store in two ledgers and evictor locks.
            had_ledger = self._ledger is not None
            self._release(close_engine=self.engine is not None and engine is None)
            if not had_ledger and lock_made:
                try:  # Ledger.open failed: at most an empty .fx of ours (rmdir takes only that)
                    os.rmdir(os.path.join(self.roots[0], LOCK_DIR))
                except OSError:
                    pass
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
        while True:  # only ENOENT means missing: any other error (EIO, EACCES) is reported as it is
            try:
                pst = os.stat(p)
                break
            except FileNotFoundError:
                if p == os.path.dirname(p):
                    raise ConfigError(f"path: cannot create or open the store directory {root!r}") from None
                missing.append(p)
                p = os.path.dirname(p)
            except NotADirectoryError:
                raise ConfigError(f"path: a part of {root!r} is not a directory; pick a directory") from None
            except OSError as e:
                raise ConfigError(f"path: cannot open {p!r}: {e.strerror}") from None
        if not stat.S_ISDIR(pst.st_mode):
            raise ConfigError(f"path: {p!r} exists and is not a directory; pick a directory")
        try:
            for d in reversed(missing):
                try:
                    os.mkdir(d, self.dir_mode & 0o777)
                except FileExistsError:
                    continue  # made meanwhile by another process
                created.append(d)
            if missing and self.options.shared_group:
                os.chmod(root, self.dir_mode)  # the umask may have removed group bits
            st = os.stat(root)
        except OSError as e:
            raise ConfigError(f"path: cannot create or open the store directory {root!r}: {e.strerror}") from None
        why = root_problem(root, st, self.options.shared_group)
        if why and root != self.roots[0] and on_read_only_fs(root):
            # One drive of several remounted read-only (as XFS does after an I/O error): refusing to
            # start took the whole store, and with it the server, down at the next restart.
            # Its chunks are served; stores go to each chunk's other path (_places).
            self._mark_read_only(self.roots.index(root), "read-only filesystem")
            log.warning(
                "lmcache-fx: store path %s is on a read-only filesystem: its chunks are served and new ones go "
                "under the other paths (they count in the usage and cannot be evicted); mount it read-write to "
                "store there again (looked at every %.0f s)",
                root,
                READ_ONLY_LOOK_SECONDS,
            )
        elif why:
            raise ConfigError(f"path: {why}")
        self._root_gid[root] = st.st_gid

    def _note_roots(self) -> None:
        """Says, once, where another process opened this store with its paths
        listed otherwise, and records this one's list. The first path holds
        the shared usage and the evictor's lock, and a chunk's two candidate
        paths are positions in the list: two processes listing the paths in
        another order (or one with a path added, in a rolling restart) each
        kept to the cap on their own, the store holding up to twice it, and
        looked for each other's chunks under other paths."""
        ids = []
        for fd in self._rootfds:
            st = os.fstat(fd)
            ids.append(f"{st.st_dev}:{st.st_ino}")
        theirs: list = []
        try:
            with open(os.path.join(self.roots[0], ROOTS_NAME)) as f:
                theirs = [line.split(" ", 1) for line in f.read().splitlines() if " " in line]
        except (OSError, UnicodeDecodeError):
            pass
        if theirs and [t[1] for t in theirs] == self.roots and [t[0] for t in theirs] != ids:
            # The same list, but a path leads elsewhere: a drive not mounted (its mount point on the
            # root filesystem now), or replaced.
            changed = [r for (then, _), now, r in zip(theirs, ids, self.roots) if then != now]
            log_once(
                log,
                ("roots moved", tuple(changed)),
                logging.WARNING,
                "lmcache-fx: store path %s is not the directory it was when this store was last opened (another "
                "filesystem or directory now: a drive not mounted?). Chunks stored there before are not found, "
                "and new ones are stored in what is there now; mount it, or list the paths anew",
                ", ".join(changed),
            )
        elif theirs and [t[0] for t in theirs] != ids:
            self._roots_warning(
                f"{self.roots[0]} was last opened with the paths listed as {','.join(t[1] for t in theirs)}"
            )
        for root in self.roots[1:]:
            if os.path.lexists(os.path.join(root, ROOTS_NAME)):
                self._roots_warning(
                    f"{root} is listed first by another process (its {ROOTS_NAME} holds a store's shared usage; "
                    "if no process lists it first any more, remove that directory)"
                )
        if [t[0] for t in theirs] == ids:
            return
        # the next opener compares with this list
        self._record_in_lock_dir(ROOTS_NAME, "".join(f"{i} {r}\n" for i, r in zip(ids, self.roots)))

    def _note_cap(self) -> None:
        """Says, once, where the last process to open this store set another
        max_capacity_gb, and records this one's. Each process evicts the
        shared usage down to its own cap, so the smallest governs and the
        process that set it evicts the others' chunks again and again (a
        review: 6870 evictions against 73 in 12 s), with nothing said."""
        mine = self.options.max_capacity_bytes
        try:
            with open(os.path.join(self.roots[0], CAP_NAME)) as f:
                theirs: Optional[int] = int(f.read().split()[0])
        except (OSError, UnicodeDecodeError, ValueError, IndexError):
            theirs = None
        if theirs is not None and theirs != mine:
            log_once(
                log,
                ("cap", self.roots[0], theirs, mine),
                logging.WARNING,
                "lmcache-fx: max_capacity_gb is %s in this process but %s in the last process that opened %s. "
                "Every process evicts the store's shared usage down to its own cap: the smallest governs, and "
                "the process that set it evicts the others' chunks again and again. Set the same "
                "max_capacity_gb in every process sharing a store",
                f"{mine / GIB:g}",
                f"{theirs / GIB:g}",
                ",".join(self.roots),
            )
        if theirs != mine:
            self._record_in_lock_dir(CAP_NAME, f"{mine}\n")

    def _record_in_lock_dir(self, name: str, text: str) -> None:
        """Replaces the file `name` (under LOCK_DIR) with text, atomically,
        for the next opener to compare with; a store this user cannot write
        keeps the last one."""
        try:
            dfd = open_dir(os.path.join(self.roots[0], LOCK_DIR))
            try:
                tmp = f"{os.path.basename(name)}.{os.getpid()}{TMP_MARK}"
                fd = os.open(
                    tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dfd
                )
                try:
                    os.write(fd, text.encode())
                    if self.options.shared_group:
                        os.fchmod(fd, self.file_mode)
                finally:
                    os.close(fd)
                os.rename(tmp, os.path.basename(name), src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def _roots_warning(self, what: str) -> None:
        log_once(
            log,
            ("roots", what),
            logging.WARNING,
            "lmcache-fx: %s; this process lists %s. Every process sharing a store must list the same paths in the "
            "same order: the first holds the shared usage and the evictor (the cap is not shared otherwise), and a "
            "chunk is looked for under paths named by its position in the list",
            what,
            ",".join(self.roots),
        )

    def _decide_mapped_reads(self) -> bool:
        return medium.decide_mapped_reads(self.options.mapped_reads, self.roots)[0]

    def _decide_odirect(self) -> bool:
        mode = self.options.odirect
        if mode == "false":
            return False
        try:
            ok, why = probe_odirect(self.roots[0])
        except OSError as e:
            ok, why = False, e.strerror or str(e)
        if not ok and mode == "true":
            raise ConfigError(f"odirect: true, but {self.roots[0]!r} does not allow O_DIRECT ({why}); use auto")
        if not ok:
            # A warning where the page cache is not the medium (reads then go through it); on tmpfs and
            # ramfs buffered I/O is what reading memory is, so only said at info.
            level = logging.INFO if medium.page_cache_fs(self.roots) else logging.WARNING
            log_once(  # once per path and reason, however many stores open it
                log,
                ("odirect", self.roots[0], why),
                level,
                "lmcache-fx: O_DIRECT not supported on %s (%s); using buffered I/O",
                self.roots[0],
                why,
            )
        return ok

    def _payload_write_engine(self) -> Any:
        """Page-cache media (O_DIRECT off, or tmpfs/ramfs): io_uring runs
        buffered writes on one io-wq worker per file, so payloads are written
        by a thread engine of the store's own instead."""
        if getattr(self.engine, "kind", "") == "threads" or (self.odirect and not medium.page_cache_fs(self.roots)):
            return self.engine
        try:
            return _fxio.Engine(
                "threads", self.options.queue_depth, self.options.split_bytes, runner_nice=self.options.runner_nice
            )
        except (OSError, AttributeError):
            return self.engine

    def _close_fds(self) -> None:
        fds, self._rootfds = self._rootfds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def _walk(self, remove_stale: bool = True, stale: Optional[list] = None) -> tuple[list, int]:
        """Lists every root: chunk files as (mtime_ns, digest, path, size),
        newest first, and the bytes the store holds (chunks plus temporaries
        of live writers, which are reserved in the ledger). Removes stale
        temporaries, relative to the descriptor of the directory listed (a
        fan-out directory swapped meanwhile redirects nothing); with `stale`
        (a list), appends them there as (directory, name, inode) instead,
        uncounted. Other processes' (and other store objects') spares it
        counts and notes for the evictor, which takes them before any chunk
        (_take_others_spares_locked): spares are moved only under the ledger
        lock, and idle processes' spares could otherwise hold a store for
        STALE_SPARE_SECONDS. The lock file sits in no fan-out directory:
        never seen."""
        found = []
        usage = 0
        now, t0 = time.time(), time.monotonic()
        # Copies (one step each under the GIL): walks without the lock run beside threads that keep and take spares
        own = {os.path.basename(sp.path) for lst in list(self._own_spares().values()) for sp in list(lst)}
        others = []
        kept = self._spares_count(SPARES_KEPT)  # before the listing: a spare kept during it is looked for again
        for root in self.roots:
            for sub in fanout_dirs(root):
                try:
                    dfd = open_dir(sub)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                        continue  # removed, or swapped for a link, since the listing
                    if e.errno in (errno.EACCES, errno.EPERM):
                        # Made by another user's process without shared_group: its chunks are out of
                        # this process's reach (not counted, not served); not a reason to refuse to start.
                        self.burst_warning(
                            "unreadable directories",
                            "lmcache-fx: cannot list %s (%s): another user's process without shared_group: true "
                            f"made it; its chunks are not counted or served here: {SHARED_GROUP_FIX}",
                            sub,
                            e.strerror,
                        )
                        continue
                    raise
                try:
                    for f in list(scan_fanout(root, sub, dfd)):
                        if f.kind == "tmp":
                            name = os.path.basename(f.path)
                            gone = (remove_stale or stale is not None) and tmp_is_stale(name, f.mtime, now)
                            if not gone and name not in own and tmp_is_spare(name):
                                others.append((f.mtime_ns, f.path, f.size))
                            if gone and stale is not None:
                                stale.append((sub, os.path.basename(f.path), f.ino))
                            elif gone:
                                try:
                                    os.unlink(os.path.basename(f.path), dir_fd=dfd)
                                except OSError:
                                    pass
                            else:
                                usage += f.size
                        elif f.kind == "chunk":
                            found.append((f.mtime_ns, f.digest, f.path, f.size))
                            usage += f.size
                finally:
                    os.close(dfd)
        found.sort(reverse=True)
        self._walk_seconds = time.monotonic() - t0
        self._others_spares = sorted(others)  # oldest first
        self._spares_kept_seen = kept
        return found, usage

    def _open_spares_file(self) -> None:
        """Opens SPARES_NAME (made if missing) for the store's life: on a
        memory filesystem, where spares are kept."""
        path = os.path.join(self.roots[0], SPARES_NAME)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode)
        except OSError:
            # Read-only: its owners still learn of takes; its evictor takes no other process's spare (their
            # owners would not learn of it), and other evictors learn of its spares at their walks alone.
            try:
                self._spares_fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as e:
                log.warning(
                    "lmcache-fx: cannot open %s (%s): this process takes no other process's spares, and reports "
                    "its own as free space after another process took them (until they expire)%s",
                    path,
                    e.strerror,
                    f"; {SHARED_GROUP_FIX}" if e.errno == errno.EACCES else "",
                )
            return
        self._spares_writable = True
        if self.options.shared_group:
            with contextlib.suppress(OSError):  # another user's file: its mode was set when it was made
                os.fchmod(fd, self.file_mode)
        self._spares_fd = fd

    def _spares_count(self, which: int) -> int:
        """A counter of SPARES_NAME (SPARES_KEPT, SPARES_TAKEN); 0 without it."""
        if self._spares_fd < 0:
            return 0
        try:
            return int.from_bytes(os.pread(self._spares_fd, 8, which).ljust(8, b"\0"), "little")
        except OSError:
            return 0

    def _count_spares_locked(self, which: int) -> int:
        """Adds one to a counter of SPARES_NAME (ledger held); returns it.
        Counts, not the file's mtime: on a filesystem whose clock ticks every
        few ms (ramfs; tmpfs before Linux 6.13) two changes in one tick left
        the mtime as it was."""
        n = (self._spares_count(which) + 1) % (1 << 64)
        if self._spares_fd >= 0:
            with contextlib.suppress(OSError):
                os.pwrite(self._spares_fd, n.to_bytes(8, "little"), which)
        return n

    def _note_spares_taken(self) -> None:
        """After removing other processes' spares: their owners look which
        of theirs are gone (_forget_taken_spares)."""
        self._count_spares_locked(SPARES_TAKEN)

    def _take_others_spares_locked(self, limit: int, usage: int) -> int:
        """Removes other processes' spares the last walk saw (ledger held),
        oldest first, until usage <= limit; returns the usage after. Spares
        go before any chunk, and the walks before most evictions are made
        without the lock (_refresh_victims): the only ones that saw them. A
        name still there under the lock, not newer, is still the spare seen
        (a spare's name is used once, and moved only under the lock). None
        is taken by a process that cannot write SPARES_NAME (their owners
        would not learn of it)."""
        if usage <= limit or not self._others_spares or not self._spares_writable:
            return usage
        seen, self._others_spares = self._others_spares, []
        dirfds: dict[str, int] = {}
        taken = 0
        try:
            for k, (mt, path, _size) in enumerate(seen):
                if usage <= limit:
                    self._others_spares = seen[k:]
                    break
                st = unlink_if_same(path, mtime_ns=mt, dirfds=dirfds)
                if st is not None:
                    usage, taken = max(0, usage - st.st_size), taken + st.st_size
        finally:
            for fd in dirfds.values():
                os.close(fd)
        if taken:
            self._note_spares_taken()
            log.debug("lmcache-fx: the evictor took %s of other processes' spares", _gib_text(taken))
        return usage

    def _every(self, seconds: float) -> float:
        """`seconds`, or SCAN_DUTY walks' time when that is longer."""
        return max(seconds, SCAN_DUTY * self._walk_seconds)

    def _refresh_victims(self, batch: int) -> None:
        """Before a write that will evict takes the store lock: a victim list
        older than its interval, or shorter than the batch, is rebuilt from a
        walk made WITHOUT the lock (a large store's walk takes seconds; peers'
        stores would wait on it). Its entries are only candidates: the
        evictor checks each victim's mtime under the lock before removing it."""
        now = time.monotonic()
        if self._fruitless_now(now):
            return  # a walk just found nothing to evict, and nothing changed since (_evict_locked)
        if len(self._victims) >= batch and now - self._victims_at <= self._every(VICTIM_LIST_SECONDS):
            # Another process kept a spare since this store's last walk: its evictor's first victim,
            # which only a walk finds (at most once a SPARES_LOOK_SECONDS, or SCAN_DUTY walks' time).
            if self._spares_count(SPARES_KEPT) == self._spares_kept_seen:
                return
            if now - self._spares_kept_at <= self._every(SPARES_LOOK_SECONDS):
                return
            self._spares_kept_at = now
        try:
            found, _ = self._walk(remove_stale=False)
        except OSError:
            return  # the evictor rescans under the lock, and says why
        with self._lock:
            self._set_victims(found)
        self.stats.add(scans=1, scan_seconds=self._walk_seconds)

    def _set_victims(self, found: list) -> None:
        """A walk's chunks (oldest last) become the victim list."""
        self._victims, self._victims_at = found, time.monotonic()
        self._victims_walked_ns = found[0][0] if found else 0
        self._victims_mark = self._ledger.mark() if self._ledger is not None else (None, 0)

    def _rescan_locked(self) -> Optional[int]:
        """Recomputes the shared usage from the files (ledger held); refreshes
        this process's victim list and prunes its index. None when the
        directory cannot be listed."""
        t0 = time.perf_counter()
        try:
            found, usage = self._walk()
        except OSError as e:
            self._io_warning("lmcache-fx: cannot scan the store (%s)", e.strerror)
            return None
        self._ledger.put(usage, time.time())
        self._counted(found, usage)
        self.stats.add(scans=1, scan_seconds=time.perf_counter() - t0)
        return usage

    def _rescan_evicting(self, limit: int, reuse: Sequence["_WriteFile"]) -> Optional[int]:
        """The evictor's rescan (ledger held): the usage found, less the
        victims moved to temporaries of `reuse`, after taking the other
        processes' spares the walk saw, as far as room is needed (room no
        chunk holds: they go before any chunk). None when the store cannot be
        listed."""
        u = self._rescan_locked()
        if u is None:
            return None
        return self._take_others_spares_locked(limit, _less_moved(u, reuse))

    def _counted(self, found: list, usage: int) -> None:
        """After the ledger was set from a walk of an unchanged store: the
        walk's chunks become the victim list, and entries of chunks it did
        not find leave the index."""
        self._last_usage = usage
        self._rescan_soon = False
        self._scanned = time.time()
        self._set_victims(found)
        present = {f[1] for f in found}
        with self._lock:
            for d in [d for d in self._index if d not in present]:
                del self._index[d]
            self._index_limit = max(65536, 2 * len(found))

    def _recompute_due(self) -> bool:
        """Whether the ledger is due to be recomputed from the files: a
        ledger update was skipped, or the last recompute (by any process:
        read from the record, without the lock, as a hint) is older than
        RESCAN_SECONDS (or SCAN_DUTY walks' time), or as far in the future."""
        if time.monotonic() < self._recompute_after:
            return False
        if self._rescan_soon:
            return True
        # Without the lock, as a hint: a torn read fails its CRC and gives None (the reservation,
        # under the lock, then rescans a record that is really bad).
        rec = self._ledger.get()
        if rec is not None:
            self._scanned = rec[1]
        # A last recompute further in the future than an interval is a clock stepped back since (or
        # a clock that once read 2099): due, or dead writers' temporaries would wait for it to pass.
        # At most once an interval by this process's own clock: hosts whose clocks differ by more
        # would each find the other's stamp due at every write, a whole walk each time.
        age, every = time.time() - self._scanned, self._every(RESCAN_SECONDS)
        return age > every or (age < -every and time.monotonic() - self._recomputed_at > every)

    def _recompute(self) -> None:
        """Recomputes the shared usage from the files by a walk made WITHOUT
        the store lock: at a million chunks a walk takes 10-30 s, and every
        writer of every process waits on the lock (past LOCK_TIMEOUT their
        stores are skipped, and each skip asked for another locked walk).
        The walk's count replaces the ledger only when the ledger did not
        change meanwhile (Ledger.changes): then no reservation, commit,
        removal or eviction ran during the walk, and its count is the one a
        walk under the lock would have made. Dead writers' temporaries are
        removed under the lock either way, each looked at again and its
        bytes taken from the ledger. A store busy through the walk keeps its
        ledger and tries again after VICTIM_LIST_SECONDS (or SCAN_DUTY
        walks' time); what else its ledger drifted by meanwhile (files
        removed behind the store's back: an overcount, so eviction starts
        early) waits for a quiet walk."""
        self._recomputed_at = time.monotonic()
        try:
            with self._ledger.hold():
                before = self._ledger.changes()
        except LockTimeout:
            return
        stale: list = []
        t0 = time.perf_counter()
        try:
            found, usage = self._walk(stale=stale)
        except OSError as e:
            self._io_warning("lmcache-fx: cannot scan the store (%s)", e.strerror)
            return
        self.stats.add(scans=1, scan_seconds=time.perf_counter() - t0)
        try:
            with self._ledger.hold():
                gone = self._remove_stale_locked(stale)
                if before[0] is not None and self._ledger.changes() == before:  # None: the lock file unreadable
                    self._ledger.put(usage, time.time())
                    exact = True
                else:
                    if gone:
                        self._ledger.add(-gone)
                    exact = False
        except LockTimeout:
            return
        if exact:
            self._counted(found, usage)
            return
        self._recompute_after = time.monotonic() + self._every(VICTIM_LIST_SECONDS)
        with self._lock:  # the walk's chunks are still good candidates (each victim is checked again)
            self._set_victims(found)

    def _remove_stale_locked(self, stale: list) -> int:
        """Removes the dead writers' temporaries a walk found (ledger held),
        each only when its name still holds that file and it is still stale.
        Returns their bytes (the ledger counted what their writers had
        reserved: the size they were given under the lock)."""
        gone, now = 0, time.time()
        for sub, name, ino in stale:
            try:
                dfd = open_dir(sub)
            except OSError:
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if st.st_ino == ino and stat.S_ISREG(st.st_mode) and tmp_is_stale(name, st.st_mtime, now):
                    os.unlink(name, dir_fd=dfd)
                    gone += st.st_size
            except OSError:
                pass
            finally:
                os.close(dfd)
        return gone

    def _scan(self) -> None:
        """At start: rebuilds the index from names and sizes, recomputes the
        shared usage, removes stale temporaries, evicts down to the cap.
        Where other processes have the store open and the ledger has a valid
        record (they keep it), the walk is made without the lock and the
        record trusted: a process starting beside its peers (a restarted TP
        rank) does not stop their stores for a walk of the whole store;
        stale temporaries wait for the next rescan. When another process
        holds the lock past LOCK_TIMEOUT, a walk without it too, and the next
        write rescans."""
        rec = None
        if self._ledger.others():
            try:
                with self._ledger.hold():
                    rec = self._ledger.get()
            except LockTimeout:
                pass
        if rec is not None:
            self._start_from(*self._walk(remove_stale=False))
            self._last_usage, self._scanned = rec
            if rec[0] > self.options.max_capacity_bytes:
                self._evict_to(self.options.max_capacity_bytes)
            return
        try:
            with self._ledger.hold():
                found, usage = self._older_copies_dropped_locked(*self._walk())
                self._start_from(found, usage)
                self._ledger.put(usage, time.time())
                self._last_usage = usage
                self._evict_locked(self.options.max_capacity_bytes, usage)
        except LockTimeout:
            found, usage = self._walk(remove_stale=False)
            self._index_found(found)
            self._last_usage = usage
            self._rescan_soon = True

    def _older_copies_dropped_locked(self, found: list, usage: int) -> tuple[list, int]:
        """A chunk under both of its roots (a crash between a commit's rename
        and its removal of the other copy, each on its own filesystem's log):
        the older copy goes (ledger held, this process alone on the store).
        Left, it was counted, and read again once the newer was evicted."""
        if len(self.roots) == 1:
            return found, usage
        seen: set = set()
        keep, dropped = [], 0
        for rec in found:  # newest first
            if rec[1] in seen:
                gone = unlink_if_same(rec[2])  # a regular file only, no link followed
                if gone is not None:
                    usage -= gone.st_size
                    dropped += 1
                    continue
            seen.add(rec[1])
            keep.append(rec)
        if dropped:
            log.info("lmcache-fx: removed the older copy of %d chunk(s) found under two of the paths", dropped)
        return keep, usage

    def _start_from(self, found: list, usage: int) -> None:
        """A start-up walk's chunks become the index and the victim list."""
        self._index_found(found)
        self._set_victims(found)
        self.stats.add(scans=1, scan_seconds=self._walk_seconds)
        if found:
            log.info(
                "lmcache-fx: found %d chunks (%.2f GB in the store) under %s",
                len(found),
                usage / 1e9,
                ",".join(self.roots),
            )

    def _index_found(self, found: list) -> None:
        now_ns, mono = time.time_ns(), time.monotonic()
        with self._lock:
            for mt, digest, path, size in reversed(found):  # oldest first = least recently used
                self._index[digest] = Entry(path, size, touched=mono - max(0, now_ns - mt) / 1e9, seen_mtime_ns=mt)
            self._index_limit = max(65536, 2 * len(found))

    # ------------------------------------------------------------ lookups
    def path_for(self, digest: str) -> str:
        """Where the chunk of this digest lies: its indexed path, else the
        first of its places (paths_for) that holds a file, else the first."""
        with self._lock:
            e = self._index.get(digest)
        return e.path if e is not None else self._find(digest)[0]

    def _stat_places(self, places: list[tuple[int, str]], prefix: bool = False) -> list[Optional[FileStat]]:
        """lstat of each (root index, name below that root), no symlink
        followed on the way; one call for all. `prefix`: none after the first
        that is not a regular file (not looked at)."""
        if not self._rootfds:  # closed: by path, as before the descriptors
            return [stat_in(os.path.join(self.roots[r], name)) for r, name in places]  # type: ignore[misc]
        return stat_many([(self._rootfds[r], name) for r, name in places], prefix)

    def _find(self, digest: str) -> tuple[str, Optional[FileStat]]:
        """The first of a digest's places that holds a regular file, with its
        stat; else (the first place, None)."""
        return self._find_many([digest])[0]

    def _find_many(self, digests: Sequence[str]) -> list[tuple[str, Optional[FileStat]]]:
        """_find of many digests, every place of each stat'ed in one call."""
        places = [root_places(len(self.roots), d) for d in digests]
        sts = iter(self._stat_places([(r, relative_name(d)) for d, rs in zip(digests, places) for r in rs]))
        out = []
        for d, rs in zip(digests, places):
            hits = [(r, st) for r, st in zip(rs, sts) if st is not None and stat.S_ISREG(st.st_mode)]
            r, st = hits[0] if hits else (rs[0], None)
            out.append((os.path.join(self.roots[r], relative_name(d)), st))
        return out

    def _root_index_of(self, path: str) -> int:
        """Which of the roots a chunk path lies under."""
        if len(self.roots) == 1:  # per chunk of every read: no path taken apart
            return 0
        try:
            return self.roots.index(root_of_path(path))
        except ValueError:  # not below a root as given (every Entry's is): where its digest names first
            return root_index(len(self.roots), chunk_digest_of_path(path))

    def _rootfd_of(self, path: str) -> int:
        """The descriptor of the root a chunk path lies under."""
        return self._rootfds[self._root_index_of(path)]

    def _entry(self, key: str, d: Optional[str] = None, check: bool = False) -> Optional[Entry]:
        """Index entry, looking on disk when the index has none (another
        process may have written it). `check`: confirm an indexed file is
        still there (another process may have evicted it). `d`: the key's
        digest when known. _entries of one chunk without the batch's lists:
        LMCache asks contains() one key at a time, where the batch's
        bookkeeping cost as much as the stat."""
        if d is None:
            d = chunk_digest(key)
        with self._lock:
            e = self._index.get(d)
        if e is not None and not check:
            return e
        place = self._first_place(d, e)
        if self._rootfds:  # layout.stat_many of one, inline: through _stat_places 6.9 us a key, here 5.6
            r = _fxio.stat_beneath(((self._rootfds[place[0]], place[1]),))[0]
            st = None if r is None else FileStat(*r)
        else:
            st = self._stat_places([place])[0]
        return self._settle(d, e, place, st)

    def _entries(self, digests: Sequence[str], check: bool = False, prefix: bool = False) -> list[Optional[Entry]]:
        """_entry of many chunks: the files to look at (every one with
        `check`, else those the index lacks) are stat'ed in one call, at the
        place each is indexed under or its first place. `prefix`: the entries
        after the first chunk not found are None, not looked for."""
        with self._lock:
            out: list[Optional[Entry]] = [self._index.get(d) for d in digests]
        todo = [i for i, e in enumerate(out) if e is None or check]
        places = [self._first_place(digests[i], out[i]) for i in todo]
        k = 0
        while k < len(todo):
            sts = self._stat_places(places[k:], prefix)
            for j, st in enumerate(sts, k):
                i = todo[j]
                out[i] = self._settle(digests[i], out[i], places[j], st)
                if out[i] is None and prefix:
                    return out[:i] + [None] * (len(out) - i)
                if prefix and (st is None or not stat.S_ISREG(st.st_mode)):
                    k = j + 1  # found under its other root: the rest were not looked at
                    break
            else:
                k = len(todo)
        return out

    def _first_place(self, d: str, e: Optional[Entry]) -> tuple[int, str]:
        """(root index, name below it) where a lookup stats a chunk first:
        where the index has it, else the first of its places."""
        r = self._root_index_of(e.path) if e is not None else root_places(len(self.roots), d)[0]
        return r, relative_name(d)

    def _settle(self, d: str, e: Optional[Entry], place: tuple[int, str], st: Optional[FileStat]) -> Optional[Entry]:
        """One chunk's entry after the stat of its place: an indexed file gone
        leaves the index (and is looked for under its other root, where
        another process may have moved it); a file found that the index
        lacks joins it."""
        path = None
        if st is None or not stat.S_ISREG(st.st_mode):
            if e is not None:
                with self._lock:
                    if self._index.get(d) is e:
                        del self._index[d]
                e = None
            st = None
            if len(self.roots) > 1:
                path, st = self._find(d)
        if st is None:
            return None
        if e is not None:
            if e.ino and st.st_ino != e.ino:  # another file in its place: what was read of it is not this one's
                _forget_header(e)
            e.seen_mtime_ns = st.st_mtime_ns
            return e
        if path is None:
            path = os.path.join(self.roots[place[0]], place[1])
        with self._lock:
            e = self._index.get(d)
            if e is None:
                mono = time.monotonic() - max(0, time.time_ns() - st.st_mtime_ns) / 1e9
                e = self._index[d] = Entry(path, st.st_size, touched=mono, seen_mtime_ns=st.st_mtime_ns)
                self._bound_index()
            return e

    def _bound_index(self) -> None:
        """Keeps the index within bounds (self._lock held): entries of files
        that other processes evicted are only found out when used."""
        if len(self._index) <= self._index_limit:
            return
        drop = [d for d in itertools.islice(self._index, len(self._index) // 2) if not self._pins.get(d)]
        for d in drop:
            del self._index[d]

    def _touch_many(self, entries: Sequence[Entry]) -> None:
        """Marks chunks used for every process's LRU: those due (at most once
        per TOUCH_SECONDS per chunk and process) get their mtimes, in the
        order given, by the toucher (relative to the root's descriptor,
        <ab>/<digest>.fxkv, the name itself not followed). A long-running
        server's hits are mostly older than TOUCH_SECONDS: each lookup and read
        touches nearly all of them."""
        now = time.monotonic()
        due = [e for e in entries if now - e.touched >= TOUCH_SECONDS]
        if not due or self._toucher is None or not self._rootfds:
            return
        t = self._next_mtime_ns(len(due))
        items = []
        for k, e in enumerate(due):
            e.touched = now
            # The flag goes with the touch only while the lookup's stat saw the file it was known for
            # (a peer's new file may have the same inode number; its mtime differs).
            e.flag_seen = (e.flag_seen[0], t + k) if e.flag_seen[0] and e.flag_seen[1] == e.seen_mtime_ns else (0, 0)
            items.append((self._root_index_of(e.path), relative_name(chunk_digest_of_path(e.path)), t + k))
        self._toucher.submit(items)

    def settle_touches(self, timeout: float = 5.0) -> bool:
        """Waits until the recency updates of the hits so far are written;
        False if not within `timeout` (a frozen filesystem)."""
        return self._toucher is None or self._toucher.settle(timeout)

    def _next_mtime_ns(self, count: int = 1) -> int:
        """Now, in ns, strictly increasing in this process: chunks written in
        one batch keep their order in every process's LRU. The first of
        `count` consecutive values, all this process's."""
        with self._lock:
            t = max(time.time_ns(), self._last_mtime_ns + 1)
            self._last_mtime_ns = t + count - 1
            return t

    def contains(self, key: str, usable: Optional[Callable[[ChunkMeta], bool]] = None) -> bool:
        return _fit(self._entry(key, check=True), usable) is not None

    def lookup(
        self,
        keys: Sequence[str],
        pin: bool = False,
        prefix: bool = False,
        usable: Optional[Callable[[ChunkMeta], bool]] = None,
        count: bool = False,
    ) -> list[bool]:
        """Whether each chunk is in the store, each file confirmed on disk
        (another process may have evicted it), the batch's stats in one call.
        With `pin`, each one found is pinned (never evicted until unpinned)
        and its recency touched: a lookup announces a read. `prefix`: the keys
        after the first missing one are not looked at (False), as LMCache asks
        for a prompt's chunks, whose hits end at the first miss. A chunk read
        before as unfit is not found: of another format version, or of a meta
        `usable` refuses (the caller's read would refuse it; found, a caller
        that stores only past the hits it was told of never stored it again)."""
        digests = [chunk_digest(k) for k in keys]
        found = self._entries(digests, check=True, prefix=prefix)
        for i, e in enumerate(found):
            if e is not None and _fit(e, usable) is None:
                found[i] = None
                if prefix:
                    found[i:] = [None] * (len(found) - i)
                    break
        if pin:
            self._pin_found(digests, found)
        out = [e is not None for e in found]
        if count:  # an engine's lookup for a request (the metrics' hit rate), not bookkeeping or a re-check
            self.stats.add(lookup_chunks=len(out), lookup_hits=sum(out))
        return out

    def _pin_found(self, digests: Sequence[str], found: Sequence[Optional[Entry]]) -> None:
        """Pins each chunk found (an entry, not None) and touches it, to keep
        it from other processes' evictors: a pinned lookup announces a read."""
        self._pin_digests([d for d, e in zip(digests, found) if e is not None])
        self._touch_many([e for e in found if e is not None])

    def _pin_digests(self, digests: Sequence[str]) -> None:
        with self._lock:
            for d in digests:
                self._pins[d] = self._pins.get(d, 0) + 1

    def _unpin_locked(self, d: str) -> bool:
        """One pin of digest d let go (self._lock held); False where it had none."""
        n = self._pins.get(d, 0)
        if n <= 0:
            return False
        if n == 1:
            del self._pins[d]
        else:
            self._pins[d] = n - 1
        return True

    def take_evicted(self) -> Optional[list[str]]:
        """The digests of the chunks this process's evictor removed since the
        last call (a key may have been stored again since: ask contains()),
        or None when that is unknown: at the first call (nothing is kept for
        a caller that never asks), and when more than EVICTED_KEPT were not
        taken. Not what other processes evicted."""
        with self._lock:
            out, self._evicted = self._evicted, []
        return out

    def shared(self) -> bool:
        """Whether another process has this store open now (True when that
        cannot be told): its evictions are not in take_evicted()."""
        return self._ledger.others()

    def pin(self, key: str, usable: Optional[Callable[[ChunkMeta], bool]] = None) -> bool:
        """lookup([key], pin=True) on the one-chunk path (LMCache's
        contains(key, pin=True) asks one key at a time)."""
        d = chunk_digest(key)
        e = _fit(self._entry(key, d, check=True), usable)
        if e is None:
            return False  # a miss takes no lock
        self._pin_found((d,), (e,))
        return True

    def unpin(self, key: str) -> bool:
        d = chunk_digest(key)
        with self._lock:
            return self._unpin_locked(d)

    def remove(self, key: str) -> bool:
        if self._ledger is None:  # closed: nothing to count a removal in (and nothing is served)
            return False
        d = chunk_digest(key)
        removed = self._drop(d, unlink=True)
        if len(self.roots) > 1:  # a copy under its other root too (two writers raced), or moved there
            for p in paths_for(self.roots, d):
                if stat_in(p) is not None:
                    removed = self._drop(d, unlink=True, expect_path=p) or removed
        return removed

    def _drop(
        self, digest: str, unlink: bool, expect_path: Optional[str] = None, ident: Optional[tuple[int, int]] = None
    ) -> bool:
        """Forgets a chunk and, with `unlink`, removes its file: only the file
        `ident` (st_dev, st_ino) names when given, so a valid chunk another
        process renamed into place meanwhile is never deleted. When the lock
        is not free within LOCK_TIMEOUT the file is removed without it and
        the ledger keeps counting it until the next scan (an overcount:
        eviction starts early, the cap holds)."""
        with self._lock:
            e = self._index.pop(digest, None)
        path = e.path if e else (expect_path or self.path_for(digest))
        if not unlink:
            return e is not None
        try:
            with self._ledger.hold():
                if (
                    self._keeps_spares
                    and e is not None
                    and e.size >= SPARE_MIN_BYTES
                    and self._keep_spare_locked(path, ident)
                ):
                    return True
                st = unlink_if_same(path, ident)
                if st is not None:
                    self._ledger_add_locked(-st.st_size)
        except LockTimeout:
            st = unlink_if_same(path, ident)
            self._rescan_soon = True
        return st is not None or e is not None

    # ------------------------------------------------------------ spares (memory filesystems)
    def _own_spares(self) -> dict[int, list[_Spare]]:
        """This process's spares; none in a forked child (they are the parent's)."""
        if self._spares_pid != _PID[0]:
            self._spares, self._spare_bytes, self._spares_pid = {}, 0, _PID[0]
        return self._spares

    def _keep_spare_locked(self, path: str, ident: Optional[tuple[int, int]]) -> bool:
        """Moves a removed chunk's file to a temporary's name in its directory
        and keeps it for the next chunk of its size (ledger held; it stays
        counted). False when it was not moved (the caller unlinks it)."""
        spares = self._own_spares()
        freed = self._expire_spares_locked()
        if freed:
            self._ledger_add_locked(-freed)
        sub = os.path.dirname(path)
        dirfds: dict[str, int] = {}
        try:
            dfd = open_dir(sub)
        except OSError:
            return False
        dirfds[sub] = dfd
        try:
            name = _tmp_name(path, spare=True)
            st = rename_if_same(path, None, dfd, name, dirfds, ident=ident)
            if st is not None:
                try:
                    # A live writer's temporary is judged by its mtime (layout.tmp_is_stale): the
                    # removed chunk's would let another process's scan delete a spare in use.
                    os.utime(name, dir_fd=dfd, follow_symlinks=False)
                except OSError:
                    if unlink_if_same(os.path.join(sub, name), (st.st_dev, st.st_ino), dirfds=dirfds) is not None:
                        self._ledger_add_locked(-st.st_size)
                    return True  # removed after all
        finally:
            os.close(dfd)
        if st is None:
            return False
        sp = _Spare(os.path.join(sub, name), (st.st_dev, st.st_ino), st.st_size, time.monotonic())
        spares.setdefault(st.st_size, []).append(sp)
        self._spare_bytes += st.st_size
        if self._spare_bytes > self.options.max_capacity_bytes // SPARE_SHARE:
            self._ledger_add_locked(-self._drop_spares_locked(lambda s: s is sp))
        # For other processes' evictors (_refresh_victims); not this store's, if it had seen all before.
        before = self._spares_kept_seen
        if self._count_spares_locked(SPARES_KEPT) == (before + 1) % (1 << 64):
            self._spares_kept_seen = (before + 1) % (1 << 64)
        return True

    def _expire_spares_locked(self) -> int:
        """Unlinks the spares older than SPARE_SECONDS (ledger held); returns
        the bytes freed. Asked at every removal and every store that could
        take a spare; an idle store's spares wait for its next, or for any
        process's walk past STALE_SPARE_SECONDS (layout.tmp_is_stale)."""
        now = time.monotonic()
        return self._drop_spares_locked(lambda sp: now - sp.at > SPARE_SECONDS) if self._spare_bytes else 0

    def _drop_spares_locked(self, which: Callable[[_Spare], bool]) -> int:
        """Unlinks the spares `which` selects (ledger held). Returns the bytes
        freed, for the caller to take off the shared usage."""
        freed = 0
        for size, lst in list(self._own_spares().items()):
            keep = []
            for sp in lst:
                if which(sp):
                    self._spare_bytes -= sp.size
                    if unlink_if_same(sp.path, sp.ident) is not None:
                        freed += sp.size
                else:
                    keep.append(sp)
            if keep:
                self._spares[size] = keep
            else:
                del self._spares[size]
        return freed

    def _take_spares_locked(self, files: Sequence["_WriteFile"], usage: int) -> int:
        """Moves a spare of the right size to the temporary's name of each file
        whose temporary is not made yet (ledger held), as the evictor does
        with a victim (see _open_deferred). Returns the usage less them and
        less the spares that expired."""
        usage = max(0, usage - self._expire_spares_locked())
        spares = self._own_spares()
        dirfds: dict[str, int] = {}
        try:
            for f in files:
                lst = spares.get(HEADER_SIZE + f.nbytes)
                if f.fd >= 0 or f.recycled or not lst:
                    continue
                # Oldest first (chunks written in order take files removed in order), under the
                # file's own root: a rename cannot cross to another filesystem.
                root = root_of_path(f.final)
                k = next((j for j, s in enumerate(lst) if root_of_path(s.path) == root), -1)
                if k < 0:
                    continue
                sp = lst.pop(k)
                if not lst:
                    del spares[HEADER_SIZE + f.nbytes]
                self._spare_bytes -= sp.size
                st = rename_if_same(sp.path, None, f.dfd, f.tmp, dirfds, ident=sp.ident)
                if st is None:
                    # Gone meanwhile: whoever removed it (a peer's scan, fsck --repair, gc) took its
                    # bytes off the ledger; by hand, they stay counted until a scan (only upwards).
                    continue
                f.recycled, f.recycled_ino, f.recycled_size = True, st.st_ino, st.st_size
                usage = max(0, usage - st.st_size)
        finally:
            for fd in dirfds.values():
                os.close(fd)
        return usage

    def _ledger_add_locked(self, delta: int) -> Optional[int]:
        """Adds to the shared usage (ledger held); a bad record is rebuilt by a scan."""
        usage = self._ledger.add(delta)
        if usage is None:
            return self._rescan_locked()
        self._last_usage = usage
        return usage

    @property
    def usage_bytes(self) -> int:
        """Bytes in the store, counted over every process writing to it (the
        last known count while another process holds the lock too long).
        Read without the lock (a torn read fails the record's CRC): asked per
        key by LMCache's eviction, it waited out a stalled peer's lock."""
        rec = self._ledger.get()
        if rec is not None:
            self._last_usage = rec[0]
            return rec[0]
        try:
            with self._ledger.hold():
                rec = self._ledger.get()
                if rec is None:
                    u = self._rescan_locked()
                    return self._last_usage if u is None else u
                self._last_usage = rec[0]
                return rec[0]
        except LockTimeout:
            return self._last_usage

    @property
    def spare_bytes(self) -> int:
        """Bytes of this process's spares: in usage_bytes (they hold the
        space) but the first to go when room is needed. Only those younger
        than STALE_SPARE_SECONDS: an older one another process's walk may
        have removed (and taken off usage_bytes), so it is not taken off
        again here (used_bytes may overstate by it, never understate). Nor
        those another process's evictor took (_forget_taken_spares)."""
        if self._spares_pid != _PID[0] or not self._spare_bytes:
            return 0
        self._forget_taken_spares()
        old = time.monotonic() - STALE_SPARE_SECONDS
        spares = list(self._spares.values())  # each list oldest first
        if all(lst[0].at > old for lst in spares if lst):
            return self._spare_bytes
        return sum(sp.size for lst in spares for sp in lst if sp.at > old)

    def _forget_taken_spares(self) -> None:
        """Forgets this process's spares that another process's evictor
        removed (and took off the shared usage), so used_bytes does not take
        them off again: a read of SPARES_NAME's count of takes per call, an
        lstat per spare after it changed. Skipped while another thread holds
        the store lock (no wait here: LMCache asks this per key); the next
        call looks."""
        if self._spares_fd < 0:
            return
        seen = self._spares_count(SPARES_TAKEN)
        if seen == self._spares_taken_seen or not self._ledger.mutex.acquire(blocking=False):
            return
        try:
            self._spares_taken_seen = seen
            for size, lst in list(self._own_spares().items()):
                keep = [sp for sp in lst if _ident(stat_in(sp.path)) == sp.ident]
                self._spare_bytes -= sum(sp.size for sp in lst) - sum(sp.size for sp in keep)
                if keep:
                    self._spares[size] = keep
                else:
                    del self._spares[size]
        finally:
            self._ledger.mutex.release()

    @property
    def used_bytes(self) -> int:
        """usage_bytes less this process's spares: how full the store is to
        whoever asks to decide on evicting (LMCache's eviction controller,
        the metrics), so a removal frees its bytes at once."""
        return max(0, self.usage_bytes - self.spare_bytes)

    def stored_keys(self, stop: Callable[[], bool] = lambda: False) -> list[tuple[str, int]]:
        """(key, file bytes) of each chunk this process's index holds, least
        recently used first, each key read from its file's header (a file
        gone, unreadable or not a valid header of this version is left out).
        One header read per chunk: for a caller that must learn what earlier
        runs or other processes stored (LMCache's listeners after a restart),
        on a thread of its own. `stop()` true ends the listing early."""
        with self._lock:
            found = sorted((e.seen_mtime_ns, e.path, e.size) for e in self._index.values())
        out = []
        for _, path, size in found:
            if stop():
                break
            try:  # as reads open a chunk: no symlink below the root followed, a FIFO refused
                fd = open_in(path, os.O_RDONLY | os.O_CLOEXEC, regular=True)
            except OSError:
                continue
            try:
                out.append((decode_header(os.pread(fd, HEADER_SIZE, 0)).key, size))
            except (OSError, BadHeader):
                pass
            finally:
                os.close(fd)
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ------------------------------------------------------------ eviction
    def _evict_to(self, limit: int) -> bool:
        """Evicts least recently used (oldest mtime), unpinned chunks of any
        process until the shared usage <= limit."""
        try:
            with self._ledger.hold():
                rec = self._ledger.get()
                usage = rec[0] if rec else self._rescan_locked()
                if usage is None:
                    return False
                return self._evict_locked(limit, usage) <= limit
        except LockTimeout:
            return False

    def _evict_locked(self, limit: int, usage: int, reuse: Sequence["_WriteFile"] = ()) -> int:
        """The evictor (ledger held): removes the oldest chunks from this
        process's sorted scan, rescanning when it is old or used up, until
        usage <= limit. Returns the usage after. A victim the size of a file
        of `reuse` whose temporary is not made yet is moved to that
        temporary's name instead of unlinked (see _open_deferred)."""
        if usage <= limit:
            return usage
        if self._spare_bytes:  # spares go before any chunk, oldest first
            drop: set[int] = set()
            left = usage
            for sp in sorted((sp for lst in self._own_spares().values() for sp in lst), key=lambda sp: sp.at):
                if left <= limit:
                    break
                drop.add(id(sp))
                left -= sp.size
            usage = max(0, usage - self._drop_spares_locked(lambda sp: id(sp) in drop))
        usage = self._take_others_spares_locked(limit, usage)  # then other processes' spares
        if usage <= limit:
            self._ledger.set_usage(usage)
            self._last_usage = usage
            return usage
        # A walk that found nothing to evict a moment ago, with no ledger change since (by any process),
        # is not made again (rescanned): with every chunk pinned or on a read-only path, each batch (and
        # each file of it) walked twice under the lock.
        now = time.monotonic()
        rescanned = self._fruitless_now(now)
        walked = False
        if not rescanned and (not self._victims or now - self._victims_at > self._every(VICTIM_LIST_SECONDS)):
            u, walked = self._rescan_evicting(limit, reuse), True
            if u is None:
                return usage
            usage, rescanned = u, True
        waiting: dict[int, list] = {}  # file size -> files to write that could take a victim of it
        for f in reversed(reuse):
            if f.fd < 0 and not f.recycled:  # a temporary not yet made
                waiting.setdefault(HEADER_SIZE + f.nbytes, []).append(f)
        dirfds: dict[str, int] = {}  # victims' directories, opened once per eviction
        # Whether another process changed the store since the walk: asked once per eviction (a read of
        # the ledger), when the first of this process's own later writes comes up; the answer cannot
        # change while this evictor holds the ledger's lock.
        others: Optional[bool] = None
        n = 0
        try:
            while usage > limit:
                kept = []
                while usage > limit and self._victims:
                    v = self._victims.pop()
                    mt, d, path, size = v
                    own_later = mt > self._victims_walked_ns and not rescanned
                    if own_later and others is None:
                        others = self._ledger.others_changed(self._victims_mark)
                    if own_later and others:
                        # The walk's chunks are gone: the rest are this process's writes since, and
                        # chunks other processes wrote since may be older. Look again first.
                        self._victims.append(v)
                        break
                    with self._lock:
                        pinned = bool(self._pins.get(d))
                    if pinned:
                        kept.append(v)
                        continue
                    st = None
                    takers = waiting.get(size)
                    if takers:
                        f = takers[-1]
                        st = rename_if_same(path, mt, f.dfd, f.tmp, dirfds)
                        if st is not None:
                            f.recycled, f.recycled_ino, f.recycled_size = True, st.st_ino, st.st_size
                            f.recycled_flagged = self._known_flagged(d, path, st)
                            takers.pop()
                    if st is None:
                        st = unlink_if_same(path, mtime_ns=mt, dirfds=dirfds)
                    if st is None:
                        continue  # evicted or removed by another process, or used (rewritten) since the scan
                    usage = max(0, usage - st.st_size)
                    n += 1
                    with self._lock:
                        e = self._index.get(d)
                        if e is not None and e.path == path:
                            del self._index[d]
                        if self._evicted is not None:
                            self._evicted.append(d)
                            if len(self._evicted) > EVICTED_KEPT:
                                self._evicted = None
                self._victims.extend(reversed(kept))
                if usage <= limit or rescanned:
                    break
                u, walked = self._rescan_evicting(limit, reuse), True  # the list ran out: look again, once
                if u is None:
                    break
                usage, rescanned = u, True
        finally:
            for fd in dirfds.values():
                os.close(fd)
        if n:
            self.stats.add(evictions=n)
        # Victims moved to temporaries of `reuse` stay on disk until adopted: the ledger keeps them
        # (a writer killed before adopting leaves it above the files, never below); `usage` does not.
        self._ledger.set_usage(usage + _moved_bytes(reuse))
        self._last_usage = usage
        if usage > limit and not n and walked:  # the ledger's change count after this write is the key
            self._fruitless = (self._ledger.changes(), time.monotonic() + self._every(FRUITLESS_SECONDS))
        elif usage <= limit or n:
            self._fruitless = None
        elif self._fruitless is not None and rescanned and not walked:  # skipped: this write changed nothing
            self._fruitless = (self._ledger.changes(), self._fruitless[1])
        return usage

    def _fruitless_now(self, now: float) -> bool:
        """Whether the last eviction walked, found nothing to evict, and
        nothing changed the ledger since (no store, removal or eviction by any
        process), within FRUITLESS_SECONDS: another walk would find the same."""
        f = self._fruitless
        return f is not None and now < f[1] and self._ledger.changes() == f[0]

    def _known_flagged(self, digest: str, path: str, st: os.stat_result) -> bool:
        """Whether the index knows the chunk file at path (stat `st`) carries
        FLAG_CHECK_PAYLOAD (written, read or touched by this process as that
        inode and mtime), so its reuse needs no look at it."""
        with self._lock:
            e = self._index.get(digest)
        return e is not None and e.path == path and e.check_payload and e.flag_seen == (st.st_ino, st.st_mtime_ns)

    def _may_write_into(self, f: "_WriteFile") -> bool:
        """Whether the evicted file moved to f's temporary may take f's chunk.
        On disk only one whose header carries FLAG_CHECK_PAYLOAD (or that is
        no chunk): after a power cut an unflagged header (a verify-off store's
        chunk, or an earlier version's) could stand at its old name over part
        of the new payload, unchecked by readers with verify off. Its first
        bytes are read where the evictor's index did not know."""
        if not self._check_payload or f.recycled_flagged:
            return True
        try:
            fd = os.open(f.tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=f.dfd)
        except OSError:
            return False
        try:
            return not unflagged_chunk(os.pread(fd, 12, 0))
        except OSError:
            return False
        finally:
            os.close(fd)

    # ------------------------------------------------------------ writes
    def write(self, items: Sequence[tuple[str, int, int, ChunkMeta]]) -> list[bool]:
        """Stores chunks given as (key, address, nbytes, meta); one engine batch
        for the payloads, one for the headers. Returns per item whether the
        chunk is now in the store."""
        out = [False] * len(items)
        digests = [chunk_digest(it[0]) for it in items]
        with self._lock:
            known = [i for i, d in enumerate(digests) if d in self._index]
        if known:  # still there (another process may have evicted it): nothing to write...
            for i, e in zip(known, self._entries([digests[i] for i in known], check=True)):
                # ...unless it was read as another layout than this one. MP keys carry no dtype: after a
                # KV dtype change every such chunk was a miss at load and, skipped here, a miss for good.
                out[i] = e is not None and not e.other_version and (e.meta is None or e.meta == items[i][3])
        todo = [
            (i, key, digests[i], addr, nbytes, meta) for i, (key, addr, nbytes, meta) in enumerate(items) if not out[i]
        ]
        mac = self._mac_key is not None
        fits = [header_fits(t[1], t[5], mac) for t in todo]
        if not all(fits):
            # Refused alone: raised from inside the batch, it cost every other chunk of it.
            big = [t for t, ok in zip(todo, fits) if not ok]
            log.warning(
                "lmcache-fx: %d chunk(s) not stored: key and meta do not fit the %d-byte header (e.g. key %.80r...)",
                len(big),
                HEADER_SIZE,
                big[0][1],
            )
            todo = [t for t, ok in zip(todo, fits) if ok]
        if not todo:
            return out
        try:
            return self._write_files(todo, out)
        finally:
            if self._evict_after_write:
                self._evict_after_write = False
                self._evict_for_room(spare=[t[2] for t in todo])

    def _evict_for_room(self, spare: Sequence[str] = ()) -> None:
        """After a burst of ENOSPC: evicts 5 % of the store, so that its
        stores resume, unless what the last such eviction freed went to other
        files (the store did not grow back since): evicting at every burst
        then only drained the cache while another writer took the room. The
        chunks of the write that met it (digests `spare`) are not evicted:
        by age its first ones went first, and the rest of its prompt, still
        stored, could then never be a hit (LMCache needs the prefix)."""
        usage = self.usage_bytes
        last = self._enospc_evicted_to
        if last is not None and usage <= last:
            log.warning(
                "lmcache-fx: not evicting again for room on the full filesystem of %s: the %s freed at the "
                "last full-disk eviction went to other files (this store holds %s); free space there or "
                "lower max_capacity_gb",
                ",".join(self.roots),
                _gib_text(max(self._enospc_freed, 0)),
                _gib_text(usage),
            )
            return
        self._pin_digests(spare)  # for the eviction: the evictor keeps pinned victims
        try:
            self._evict_to(int(usage * 0.95))
        finally:
            with self._lock:
                for d in spare:
                    self._unpin_locked(d)
        after = self.usage_bytes
        if after < usage:  # one that freed nothing (the lock not had, every victim pinned) is tried again
            self._enospc_evicted_to, self._enospc_freed = after, usage - after

    def _reserve(self, files: list["_WriteFile"]) -> list["_WriteFile"]:
        """Counts the files in the shared usage, evicting first where the cap
        would be passed, and sizes them, as one step under the lock (so a
        scan sees a temporary at the size it is counted at). Returns those
        that got room; their `reserved` is set to the bytes reserved."""
        cap = self.options.max_capacity_bytes
        ok: list = []
        try:
            hold = self._ledger.hold()
            hold.__enter__()
        except LockTimeout:
            return ok  # a peer holds the lock too long: these stores are skipped (write -> False)
        try:
            if not self._ledger.writable():
                # Its filesystem refuses writes (gone read-only, shut down): the usage stays frozen,
                # so the other paths would fill past the cap unseen. No room is given until it takes
                # writes again (then the files are recounted).
                self._ledger_unwritable_warning(len(files))
                return ok
            rec = self._ledger.get()
            if rec is None:
                usage = self._rescan_locked()
            else:
                usage, self._scanned = rec
            if usage is None:
                return ok
            start, counted_ahead = usage, False
            if self._spare_bytes:
                usage = self._take_spares_locked(files, usage)
            reuse = files if self.reuse_evicted else ()
            need = sum(HEADER_SIZE + round_up(f.nbytes, 4096) for f in files)
            if usage + need > cap:  # room for the whole batch in one eviction (the loop below mends the rest)
                usage = self._evict_locked(max(cap - need, 0), usage, reuse)
            no_room = 0
            unsized: list = []  # (file, bytes) given room, in `usage` only: neither in the ledger nor sized
            for f in files:
                rsize = HEADER_SIZE + round_up(f.nbytes, 4096)
                if usage + rsize > cap and rsize <= cap:
                    # The evictor may rescan, counting temporaries at their size on disk.
                    counted_ahead = counted_ahead or bool(unsized)
                    usage = self._size_reserved(unsized, usage, files, ok)
                    usage = self._evict_locked(cap - rsize, usage, reuse)
                if usage + rsize > cap:
                    no_room += 1
                    continue
                if f.fd >= 0 and self._removed_as_stale(f, _fstat(f.fd)):
                    continue  # made before the reservation, removed meanwhile (by its size then: 0)
                try:
                    if (self._open_deferred(f) if f.fd < 0 else 0) != rsize:
                        unsized.append((f, rsize))  # reserved once counted and sized
                    else:
                        f.reserved = rsize
                except OSError as e:
                    self._write_failed(None, -(e.errno or errno.EIO), f.final)
                    continue
                usage += rsize
                ok.append(f)
            counted_ahead = counted_ahead or bool(unsized)
            usage = self._size_reserved(unsized, usage, files, ok)
            for f in files:
                if f.recycled:  # moved for a file that got no room: evicted after all
                    _unlink_at(f.dfd, f.tmp)
                    f.recycled = False
            if no_room:
                self._no_room_warning(no_room, len(files), need, cap)
            if ok or usage != start or counted_ahead:  # the evictor may have written the ledger meanwhile
                self._ledger.set_usage(usage)
                self._last_usage = usage
        finally:
            hold.__exit__(None, None, None)
        return ok

    def _size_reserved(
        self, unsized: list[tuple["_WriteFile", int]], usage: int, files: list["_WriteFile"], ok: list["_WriteFile"]
    ) -> int:
        """Reserves the files given room in `usage` (ledger held): counted
        first, then sized, and only then marked `reserved` (what a commit
        takes off the ledger: where the reservation raises before, they were
        never counted, and go uncounted).

        Counted with one ledger write for them all (one per file, three
        system calls, was about a tenth of the storing thread's time per
        2 MiB chunk on the XFS loop, ~13 of ~130 us). Counted before sized: a
        writer killed in between leaves the ledger above the files (eviction
        starts early) rather than below (the cap passed: a dead writer's
        temporary is taken off at its size when it is removed). Files moved
        to this batch's temporaries (victims, spares) and not adopted yet are
        on disk but out of `usage` until adopted: counted here too. Sized
        before written because writes inside EOF run in parallel, where
        extending O_DIRECT writes are serialised by the filesystem. Returns
        `usage` less the files that could not be sized, which leave `ok`;
        `unsized` is emptied."""
        if not unsized:
            return usage
        self._ledger.set_usage(usage + _moved_bytes(files))
        for f, rsize in unsized:
            try:
                os.ftruncate(f.fd, rsize)
            except OSError as e:
                self._write_failed(None, -(e.errno or errno.EIO), f.final)
                usage -= rsize
                ok.remove(f)
                # Out of the count now: gone before the ledger is written again. An evicted
                # file adopted at its old size stayed on disk, uncounted, until the commit.
                _unlink_at(f.dfd, f.tmp)
            else:
                f.reserved = rsize
        unsized.clear()
        return usage

    def _ledger_path(self) -> str:
        return os.path.join(self.roots[0], LOCK_NAME)

    def _ledger_unwritable_warning(self, skipped: int) -> None:
        e = self._ledger.write_error
        self.stats.add(write_errors=skipped)
        self.burst_warning(
            "ledger",
            "lmcache-fx: %d chunks not stored: the store's usage cannot be written to %s (%s), so no room can be "
            "counted against max_capacity_gb; stores resume when its filesystem takes writes again",
            skipped,
            self._ledger_path(),
            e.strerror if e is not None and e.strerror else e,
        )

    def _no_room_warning(self, skipped: int, batch: int, need: int, cap: int) -> None:
        """Why chunks of a write batch found no room, once per batch."""
        if need > cap:
            why = f"the batch alone ({_gib_text(need)} in {batch} chunks) is more than the cap"
        else:
            with self._lock:
                pinned = sum(1 for v in self._pins.values() if v)
            why = (
                f"what is left is pinned ({pinned} chunks pinned by this process's lookups and reads) "
                "or being written by other processes"
            )
            stuck = [f"{self.roots[r]}: {w}" for r, (until, w) in list(self._failing.items()) if until == math.inf]
            if stuck:  # chunks there count in the usage and cannot be evicted
                why += f", or lies on a path not written to now ({'; '.join(stuck)})"
        self.burst_warning(
            "batches with no room",
            "lmcache-fx: %d of %d chunks not stored: no room under max_capacity_gb=%s: %s",
            skipped,
            batch,
            self.options.max_capacity_gb,
            why,
        )

    def _open_deferred(self, f: "_WriteFile") -> int:
        """Opens the temporary of a file whose creation was deferred to the
        reservation (ledger held; see _write_files). Returns its size. An
        evicted file the evictor moved to the temporary's name becomes it when
        nobody can be reading it: no process whose reads take no file locks
        has the store open (Ledger.may_reuse, asked after the move) and no
        reader holds a read lock on it (this write lock, taken without
        waiting, is held until the new chunk is in place). A reader that
        opened it before the move and locks it later finds its name gone
        (layout.read_lock) or, in read_chunks, another key or no header (a
        miss): the old header is zeroed before any new byte is written, so a
        write that dies or fails before its header leaves no valid header
        over another key's payload. Otherwise it is unlinked (a plain
        eviction) and a new temporary made. Raises OSError."""
        if f.recycled:
            f.recycled, fd = False, -1
            try:
                if self._ledger.may_reuse():
                    fd = os.open(f.tmp, self._reuse_flags, dir_fd=f.dfd)
                    st = os.fstat(fd)
                    # Ours only: setting its mtime (the LRU clock) needs the owner.
                    if (
                        stat.S_ISREG(st.st_mode)
                        and st.st_ino == f.recycled_ino
                        and st.st_uid == os.geteuid()
                        and self._may_write_into(f)
                        and write_lock(fd)
                        # The write also sets its mtime to now: other processes' scans judge a
                        # live writer's temporary by its age (layout.tmp_is_stale), not the victim's.
                        and os.pwrite(fd, _ZERO_HEADER, 0) == HEADER_SIZE
                    ):
                        f.fd, fd = fd, -1
                        self.stats.add(recycled=1)
                        return st.st_size
            except OSError:
                pass
            finally:
                if fd >= 0:
                    os.close(fd)
            _unlink_at(f.dfd, f.tmp)
        f.fd = self._create_at(f.dfd, f.tmp, f.final)
        return 0

    def _write_files(self, todo, out: list[bool]) -> list[bool]:
        if self._all_full():
            self._count_enospc(len(todo))
            return out
        gone = self._root_replaced()
        if gone is not None:
            # Writes find fan-out directories by path, reads and lookups through the descriptors
            # opened at start: written there, a chunk would never be read, nor counted in this ledger.
            self.stats.add(write_errors=len(todo))
            self._io_warning(
                "lmcache-fx: store directory %s was removed, replaced or unmounted since this store opened "
                "it; stores are skipped (reads go on from what was opened); restart to use the new one",
                gone,
            )
            return out
        # Each chunk's root, for the whole batch before it is cut into sub-batches: balanced
        # per 16-chunk sub-batch, 48 x 64 MiB still put 8 on one of 8 roots.
        placed = [t + (root,) for t, root in zip(todo, self._places(todo))]
        todo = [t for t in placed if t[-1] >= 0]
        if len(todo) < len(placed):  # both of their roots full or failing
            self._unplaced(len(placed) - len(todo))
            if not todo:
                return out
        weng = self._wengine if self.engine is self._wengine_for else self.engine
        if self.odirect and self._mac_key is None and hasattr(weng, "write_chunks"):
            return self._write_chunk_files(weng, todo, out)
        files: list[_WriteFile] = []
        ready: list[_WriteFile] = []
        dirfds: dict[str, int] = {}  # fan-out directory -> O_PATH descriptor, for this batch
        try:
            good = self._prepare(todo, files, dirfds)
            if not good:
                return out
            hdrs = self._take_scratch(len(good))  # kept again once the header writes are done
            # O_DIRECT: each payload as one write. The block layer splits it into device-sized
            # requests anyway, and the filesystem allocates its extent once instead of per piece
            # (XFS, 64 MiB chunks: ~1.2x; docs/benchmarks.md). Page-cache writes keep the engine's
            # pieces: there, pieces are what spreads the copying over threads.
            split = WRITE_WHOLE if self.odirect else 0
            res = weng.write([(f.fd, HEADER_SIZE, f.nbytes, f.addr) for f in good], crc=True, split=split)
            now = time.time_ns()
            hdr_ops, good2 = [], []
            for j, (f, (n, crc)) in enumerate(zip(good, res)):
                if n != f.nbytes:
                    self._write_failed(None, n, f.final)
                    continue
                off = HEADER_SIZE * j
                f.body = encode_header(
                    memoryview(hdrs)[off : off + HEADER_SIZE],
                    f.key,
                    f.meta,
                    f.nbytes,
                    crc,
                    now,
                    self._mac_key,
                    memory_at(f.addr, f.nbytes) if self._mac_key else None,
                    self._check_payload,
                )
                hdr_ops.append((f.fd, 0, HEADER_SIZE, hdrs.address + off))
                good2.append(f)
            hres = weng.write(hdr_ops) if hdr_ops else []
            self._keep_scratch([hdrs])  # both blocking writes are over
            for f, n in zip(good2, hres):
                if n != HEADER_SIZE:
                    self._write_failed(None, n, f.final)
                    continue
                ready.append(f)
        finally:
            try:
                self._commit(files, ready, out)
            finally:
                for dfd in dirfds.values():
                    os.close(dfd)
        return out

    def _prepare(self, todo, files: list["_WriteFile"], dirfds: dict[str, int]) -> list["_WriteFile"]:
        """What a batch does before its payloads: its temporaries made (each
        appended to `files` as it is, for the caller's cleanup), the ledger
        recomputed when due, and the reservation. Returns the files that got
        room."""
        # A batch that will evict (as the shared usage last read says) rebuilds an old victim
        # list before it takes the lock, and makes its temporaries in the reservation, under
        # it: an evicted file of the same size is then moved to the temporary's name and
        # written into, with no file made and unlinked for it.
        need = sum(HEADER_SIZE + round_up(t[4], 4096) for t in todo)
        evicts = self._last_usage + need > self.options.max_capacity_bytes
        spares = self._own_spares()
        defer = self.reuse_evicted and (evicts or any(HEADER_SIZE + t[4] in spares for t in todo))
        for i, key, d, addr, nbytes, meta, root in todo:
            f = self._create_tmp(i, key, d, addr, nbytes, meta, dirfds, root, make=not defer)
            if f is not None:
                files.append(f)
        if not files:
            return []
        if self._recompute_due():
            self._recompute()
        if evicts:
            self._refresh_victims(len(files))
        return self._reserve(files)

    def _places(self, todo) -> list[int]:
        """The root each chunk of a write batch goes under: balanced over the
        batch (place_roots); a chunk already stored (by another process: this
        one's index had it not) is rewritten where it lies, not copied under
        its other root."""
        if len(self.roots) == 1:
            return [0] * len(todo)
        digests = [t[2] for t in todo]
        # Two stats per new chunk (one call for the batch): the cost of finding it under either root.
        fixed = [self._root_index_of(path) if st is not None else None for path, st in self._find_many(digests)]
        # A root whose filesystem is full (or whose stores fail) takes none: a chunk goes under its other
        # choice, or nowhere (-1) when that one is unusable too, or when it lies on an unusable one.
        failing = self._failing_roots()
        full = self._full_roots() | failing
        skip = set()
        for k, d in enumerate(digests if full else ()):
            if fixed[k] in failing:  # lies where it cannot be replaced (LMCache removed it, the file stayed)
                fixed[k] = None
            a, b = (fixed[k], fixed[k]) if fixed[k] is not None else root_choices(len(self.roots), d)
            if a in full and b in full:
                skip.add(k)
                fixed[k] = None  # placed, then dropped
            elif a in full or b in full:
                fixed[k] = b if a in full else a
        out = place_roots(len(self.roots), digests, fixed)
        for k in skip:
            out[k] = -1
        return out

    def _write_chunk_files(self, weng: Any, todo, out: list[bool]) -> list[bool]:
        """O_DIRECT stores without a MAC, on Engine.write_chunks. A large
        batch goes in sub-batches of about WRITE_SUB_BYTES, overlapped: while
        one sub-batch's payloads are written on the engine's threads, this
        thread makes and reserves the next one's temporaries, then puts the
        previous one in place. Those steps are per chunk and one at a time
        (a create and a rename, each a directory update: ~50 us a chunk,
        a fifth of a 2 MiB chunk's write); overlapped, they stop adding to
        it. Each sub-batch is a batch of its own: its own reservation and
        commit under the ledger. While a read of this store runs, the
        sub-batches go one after the other: loads come first."""
        per = max(WRITE_SUB_CHUNKS, WRITE_SUB_BYTES // max(max(t[4] for t in todo), 1))
        subs = [todo[k : k + per] for k in range(0, len(todo), per)]
        # Every sub-batch started, in order, until it is finished: whatever is raised here (an interrupt
        # among them), each one started is waited for and committed below, never left writing.
        started: list[_ChunkFiles] = []
        try:
            for sub in subs:
                if self._all_full():
                    self._count_enospc(len(sub))
                    continue
                # Overlapped only while no read of this store runs: beside a load, the
                # overlap's extra thread took CPU from the load and did not speed the store
                # (bench --mixed, 2 MiB: loads 1.05-1.38x fs_native's against 1.39-1.42x;
                # docs/bench-repeats/loads-first/). One after the other, each goes in place
                # before the next is written.
                background = len(subs) > 1 and not self._ledger.reads_in_flight()
                if not background:
                    self._finish_started(started, 0, out)
                self._start_chunk_files(weng, sub, out, background, started)
                self._finish_started(started, 1, out)
        finally:
            self._finish_started(started, 0, out)
        return out

    def _finish_started(self, started: list["_ChunkFiles"], keep: int, out: list[bool]) -> None:
        """Finishes the oldest sub-batches of `started` until `keep` are left."""
        while len(started) > keep:
            b = started[0]
            if not b.finished:
                self._finish_chunk_files(b, out)
            started.pop(0)

    def _start_chunk_files(self, weng: Any, todo, out: list[bool], background: bool, started: list) -> None:
        """Prepares a (sub-)batch and starts its Engine.write_chunks call, on
        a thread of its own with `background` (the call releases the GIL).
        It joins `started` first: the caller finishes it whatever happens."""
        b = _ChunkFiles([], {})
        started.append(b)
        good = self._prepare(todo, b.files, b.dirfds)
        if not good:
            return
        b.good = good
        b.hdrs = self._take_scratch(len(good))  # kept again once its writes are done
        ops = self._chunk_ops(good, b.hdrs)
        _Call(lambda: weng.write_chunks(ops, direct=True), background, owner=b)

    def _finish_chunk_files(self, b: "_ChunkFiles", out: list[bool]) -> None:
        """Waits for a started (sub-)batch's writes, then commits it: the
        files written are put in place, the rest removed."""
        ready: list[_WriteFile] = []
        b.finished = True
        held: Optional[BaseException] = None
        try:
            if b.call is not None:
                try:
                    b.call.wait_out()
                except BaseException as e:  # an interrupt while waiting: what was written goes in place first
                    held = e
                ready = self._chunks_written(b.good, b.call.result())
                self._keep_scratch([b.hdrs])  # the call is over: no write of it reads the headers any more
        finally:
            try:
                self._commit(b.files, ready, out)
            finally:
                for dfd in b.dirfds.values():
                    os.close(dfd)
        if held is not None:
            raise held

    def _chunk_ops(self, good: list["_WriteFile"], hdrs: Any) -> list[tuple]:
        """Engine.write_chunks' ops: each chunk's payload, header (its CRC32C
        filled in in C) and LRU clock run as one pipeline per chunk on the
        engine's threads, so no step waits for the whole batch's previous one
        with Python in between. The renames stay in the commit, under the
        store lock: a ledger recompute that walked meanwhile is then always
        told (the commit changes the ledger), where a rename behind its back
        could be missed by its directory listing."""
        now = time.time_ns()
        ops = []
        for j, f in enumerate(good):
            off = HEADER_SIZE * j
            f.body = encode_header(
                memoryview(hdrs)[off : off + HEADER_SIZE],
                f.key,
                f.meta,
                f.nbytes,
                0,
                now,
                check_payload=self._check_payload,
            )
            if not f.nbytes % 4096:  # else trimmed under the lock, which sets the clock again
                f.mtime_ns = self._next_mtime_ns()
            ops.append((f.fd, f.addr, f.nbytes, hdrs.address + off, f.mtime_ns))
        return ops

    def _chunks_written(self, good: list["_WriteFile"], res: list) -> list["_WriteFile"]:
        """The files of `good` that Engine.write_chunks wrote whole."""
        ready = []
        for f, (n, hn, _crc, clock) in zip(good, res):
            if clock != 1:
                f.mtime_ns = 0  # set by the commit
            if n != f.nbytes:
                self._write_failed(None, n, f.final)
            elif hn != HEADER_SIZE:
                self._write_failed(None, hn, f.final)
            else:
                ready.append(f)
        return ready

    def _commit(self, files: list["_WriteFile"], ready: list["_WriteFile"], out: list[bool]) -> None:
        """Renames finished files into place and removes the rest, correcting
        the shared usage in the same locked step (a scan never sees a state
        the ledger does not count)."""
        done: list = []
        try:
            reserved = [f for f in files if f.reserved]
            if reserved:
                in_place = self._before_commit(ready)
                try:
                    with self._ledger.hold():
                        self._ledger_add_locked(self._put_in_place(reserved, ready, out, done, in_place))
                        self._add_victims_locked(done)
                except LockTimeout:
                    # The bytes are reserved already: put the chunks in place without the lock; the
                    # ledger overcounts (eviction starts early, the cap holds) until the next write rescans.
                    self._put_in_place(reserved, ready, out, done, in_place)
                    self._rescan_soon = True
        finally:
            for f in files:
                if f.fd >= 0:
                    os.close(f.fd)
            for f in files:
                if not out[f.i] and not f.reserved and f.fd >= 0:
                    _unlink_at(f.dfd, f.tmp)  # never counted: no lock needed
                if f.recycled:  # moved and not adopted (an error in between): evicted after all
                    _unlink_at(f.dfd, f.tmp)
        if done:
            with self._lock:
                self._bound_index()
            self.stats.add(chunks_written=len(done), bytes_written=sum(HEADER_SIZE + f.nbytes for f in done))
            self._errors_at_write = self.stats.write_errors

    def _before_commit(self, ready: list["_WriteFile"]) -> dict[int, bool]:
        """What of a commit needs no store lock, done before it is taken (the
        lock is every writer's, in every process): whether each fan-out
        directory is still the one at its path, and the LRU clock of each
        finished file whose size needs no trim (a trim would set its mtime
        again). Returns {directory descriptor: still in place}."""
        in_place: dict[int, bool] = {}
        for f in ready:
            if f.dfd not in in_place:
                in_place[f.dfd] = _same_dir(f.dfd, os.path.dirname(f.final))
            if in_place[f.dfd] and not f.nbytes % 4096 and not f.mtime_ns:
                t = f.mtime_ns = self._next_mtime_ns()
                try:
                    os.utime(f.fd, ns=(t, t))  # the LRU clock, exact within a batch
                except OSError:
                    f.mtime_ns = 0  # set again under the lock, where a failure fails the chunk
        return in_place

    def _put_in_place(
        self,
        reserved: list["_WriteFile"],
        ready: list["_WriteFile"],
        out: list[bool],
        done: list,
        in_place: dict[int, bool],
    ) -> int:
        """Renames the finished files of `reserved` into place (relative to
        their fan-out directory's descriptor, opened without following links)
        and removes the others. Returns the correction of the shared usage.
        `in_place`: _before_commit's answer per directory."""
        delta = 0
        ready_ids = {id(f) for f in ready}
        for f in reserved:
            st = _fstat(f.fd)  # one fstat for both questions: removed as stale, and the inode
            if self._removed_as_stale(f, st):
                continue  # its remover took its bytes off the ledger already
            if id(f) in ready_ids and not in_place[f.dfd]:
                self.stats.add(write_errors=1)
                self._io_warning(
                    "lmcache-fx: %s was moved or replaced during a store; not storing there", os.path.dirname(f.final)
                )
            elif id(f) in ready_ids:
                size = HEADER_SIZE + f.nbytes
                name = os.path.basename(f.final)
                try:
                    if f.nbytes % 4096:
                        os.ftruncate(f.fd, size)  # trim the block padding (under the ledger: it counts sizes)
                    if not f.mtime_ns:
                        t = f.mtime_ns = self._next_mtime_ns()
                        os.utime(f.fd, ns=(t, t))  # the LRU clock, exact within a batch
                    # The file this rename replaces, if any, leaves the shared usage. Asked of the
                    # directory, not of this process's index: an entry may be gone while its file is
                    # not (a read that missed dropped it; the index is bounded), and another process
                    # may have stored the key. Under the ledger, so no commit renames in between (after
                    # a lock timeout nothing is counted: the next write rescans).
                    old = self._rename_into_place(f.dfd, f.tmp, name)
                except OSError as e:
                    self._write_failed(None, -(e.errno or errno.EIO), f.final)
                else:
                    delta += size - f.reserved - (old.st_size if old is not None and stat.S_ISREG(old.st_mode) else 0)
                    delta -= self._unlink_other_copy_locked(f)
                    out[f.i] = True
                    done.append(f)
                    with self._lock:
                        self._index.pop(f.digest, None)
                        self._index[f.digest] = Entry(
                            f.final,
                            size,
                            f.meta,
                            touched=time.monotonic(),
                            body=f.body,
                            check_payload=self._check_payload,
                            flag_seen=((st or os.fstat(f.fd)).st_ino, f.mtime_ns) if self._check_payload else (0, 0),
                        )
                    continue
            _unlink_at(f.dfd, f.tmp)
            delta -= f.reserved
        return delta

    def _rename_into_place(self, dfd: int, tmp: str, name: str) -> Optional[os.stat_result]:
        """Renames `tmp` to `name` in the directory `dfd`; returns the stat
        of the file it replaced, None where there was none. Tried first
        without replacing (RENAME_NOREPLACE): for a new key, the common case,
        the rename itself says nothing was there, where a stat of `name`
        came first on every chunk. Where `name` exists, or the filesystem
        has no such rename (then never tried again), stat and rename as
        before. Raises OSError."""
        if self._rename_noreplace:
            try:
                _fxio.rename_noreplace(dfd, tmp, name)
                return None
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    self._rename_noreplace = False
                elif e.errno != errno.EEXIST:
                    raise
        try:
            old = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            old = None
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return old

    def _removed_as_stale(self, f: "_WriteFile", st: Optional[os.stat_result]) -> bool:
        """Whether a peer removed this write's temporary as a dead writer's
        (ledger held, as removers hold it): this process was stopped longer
        than STALE_TMP_SECONDS mid-write. Its bytes were taken off the
        ledger then; taking them off again would leave it a chunk low.
        `st`: the temporary's _fstat."""
        gone = st is not None and st.st_nlink == 0
        if gone:
            self.stats.add(write_errors=1)
            self._io_warning(
                "lmcache-fx: a store's temporary %s was removed as stale while this process was stopped for "
                "over %.0f s; that chunk is not stored",
                f.tmp,
                STALE_TMP_SECONDS,
            )
        return gone

    def _unlink_other_copy_locked(self, f: "_WriteFile") -> int:
        """A chunk just put in place under one of its two roots: a copy under
        the other (two writers raced, or it was stored there before) goes, so
        that no reader keeps finding older bytes there (ledger held). Returns
        the bytes removed."""
        if len(self.roots) == 1:
            return 0
        for p in paths_for(self.roots, f.digest):
            if p != f.final:
                gone = unlink_if_same(p)  # a regular file only, no link followed
                if gone is not None:
                    return gone.st_size
        return 0

    def _add_victims_locked(self, done: list["_WriteFile"]) -> None:
        """Chunks just put in place join the young end of the evictor's list
        (ledger held): a store that evicts as much as it writes (a full one)
        then finds its victims there instead of rescanning every directory
        once per batch. The list still expires after VICTIM_LIST_SECONDS, and
        each victim is checked against its mtime before it goes. An expired
        list is rebuilt by a walk before any eviction reads it: it is let go
        instead of added to. (Kept, it grew by every chunk written for as long
        as this process did not evict: a store LMCache keeps under its cap by
        deleting, or one whose peer does the periodic recompute, ~110 MB an
        interval at 1000 chunks a second.)"""
        if not done:
            return
        if time.monotonic() - self._victims_at > self._every(VICTIM_LIST_SECONDS):
            self._victims = []
            return
        self._victims[:0] = sorted(
            ((f.mtime_ns, f.digest, f.final, HEADER_SIZE + f.nbytes) for f in done), reverse=True
        )

    def _fanout_fd(self, sub: str, dirfds: dict[str, int]) -> int:
        """The fan-out directory's descriptor (O_PATH, no symlink followed in
        its place: ELOOP), opened once per write batch; the directory made
        first when this process has not yet. Raises OSError."""
        fd = dirfds.get(sub)
        if fd is not None:
            return fd
        if sub not in self._made_dirs:
            try:
                os.mkdir(sub, self.dir_mode)
            except FileExistsError:
                pass
            else:
                if self.options.shared_group:  # the store's group, setgid, past the umask
                    try:
                        dfd = open_dir(sub)
                        try:
                            share_fd(dfd, self._root_gid.get(os.path.dirname(sub)), self.dir_mode)
                        finally:
                            os.close(dfd)
                    except OSError:
                        pass
            self._made_dirs.add(sub)
        fd = dirfds[sub] = os.open(sub, _DIR_FLAGS)
        return fd

    def _create_tmp(
        self,
        i: int,
        key: str,
        digest: str,
        addr: int,
        nbytes: int,
        meta: ChunkMeta,
        dirfds: dict[str, int],
        root: int,
        make: bool = True,
    ) -> Optional["_WriteFile"]:
        """The chunk's _WriteFile under roots[root] (place_roots): its fan-out
        directory opened (made when missing) and, with `make`, its temporary
        created (else fd is -1 and _open_deferred makes it)."""
        final = os.path.join(self.roots[root], relative_name(digest))
        sub = os.path.dirname(final)
        tmp = _tmp_name(final)
        fd = -1
        for attempt in (0, 1):
            try:
                dfd = self._fanout_fd(sub, dirfds)
                if make:
                    fd = self._create_at(dfd, tmp, final)
                break
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    self.stats.add(write_errors=1)
                    self._io_warning("lmcache-fx: %s is not a directory (a planted symlink?); not storing there", sub)
                    return None
                if e.errno == errno.ENOENT and attempt == 0:  # the directory was removed: make it again
                    fd0 = dirfds.pop(sub, None)
                    if fd0 is not None:  # kept open (closed with the batch's): earlier files may refer to it
                        dirfds[f"{sub}\0{fd0}"] = fd0
                    self._made_dirs.discard(sub)
                    continue
                self._write_failed(None, -(e.errno or errno.EIO), final)
                return None
        return _WriteFile(i, key, digest, addr, nbytes, meta, final, tmp, dfd, fd)

    def _create_at(self, dfd: int, tmp: str, final: str) -> int:
        """Creates the temporary `tmp` of the chunk at `final` in its fan-out
        directory `dfd`. Raises OSError."""
        fd = os.open(tmp, self._tmp_flags, self.file_mode, dir_fd=dfd)
        if self.options.shared_group:  # in the group of the store's root
            share_fd(fd, self._root_gid.get(root_of_path(final)), self.file_mode)
        return fd

    def problem(self) -> Optional[str]:
        """What keeps this store from storing, for a health report: a root
        removed, replaced or unmounted since start (every store is skipped
        until a restart), the filesystem full (stores skipped for a while),
        or at least FAILED_STORES_PROBLEM chunk stores failed since the last
        one that did not (a read-only remount, lost permissions: the log
        says why); None when nothing does."""
        gone = self._root_replaced()
        if gone is not None:
            return f"store directory {gone} was removed, replaced or unmounted; restart"
        e = self._ledger.write_error
        if e is not None:
            return (
                f"the store's usage cannot be written to {self._ledger_path()} ({e.strerror or e}): stores are skipped"
            )
        full = self._full_roots()
        if full and len(full) == len(self.roots):
            return "the store filesystem is full (ENOSPC): stores are skipped for now"
        if full:
            paths = ", ".join(self.roots[r] for r in sorted(full))
            return f"the filesystem of store path {paths} is full (ENOSPC): chunks go to the other paths for now"
        failing = self._failing_roots()
        if failing:
            said = "; ".join(f"{self.roots[r]} ({self._failing[r][1]})" for r in sorted(failing))
            return f"stores under {said} fail: chunks go to the other paths for now"
        failed = self.stats.write_errors - self._errors_at_write
        if failed >= FAILED_STORES_PROBLEM:
            return f"the last {failed} chunk stores failed (the log says why)"
        return None

    def _root_replaced(self) -> Optional[str]:
        """The first root whose path no longer leads to the directory opened
        at start (removed, replaced, a filesystem unmounted from under it),
        else None. A stat per root per write batch."""
        for root, ident in zip(self.roots, self._root_ids):
            try:
                st = os.stat(root)
            except OSError:
                return root
            if (st.st_dev, st.st_ino) != ident:
                return root
        return None

    def _write_failed(self, tmp: Optional[str], res: int, where: Optional[str] = None) -> None:
        """A chunk's store failed with res (-errno, or a short write's
        count); `where`, its path, names the root in what is said."""
        if tmp:
            unlink_quiet(tmp)
        self.stats.add(write_errors=1)
        root = self._root_index_of(where) if where is not None else None
        if res == -errno.ENOSPC or res == -errno.EDQUOT:
            self._count_enospc(1, root)
            return
        why = os.strerror(-res) if res < 0 else f"short write ({res})"
        steer = root is not None and len(self.roots) > 1 and res in STEERED_ERRNOS
        # A filesystem remounted read-only stays so until someone remounts it: its chunks go to their other
        # path until it is found writable (_look_at_read_only_roots), not one batch's worth failing every 5 s.
        # EROFS is conclusive: a filesystem an error remounted read-only (ext4's errors=remount-ro) refuses
        # writes while statvfs may not flag it read-only.
        read_only = steer and res == -errno.EROFS and root is not None
        if steer and root is not None:
            with self._lock:
                if read_only:
                    self._mark_read_only(root, why)
                else:
                    self._failing[root] = (time.monotonic() + 5.0, why)
        self._io_warning(
            "lmcache-fx: store failed%s: %s%s",
            f" under {self.roots[root]}" if root is not None and len(self.roots) > 1 else "",
            why,
            (
                f"; its chunks go to their other path until it is writable again (looked at every "
                f"{READ_ONLY_LOOK_SECONDS:.0f} s)"
                if read_only
                else "; for 5 s its chunks go to their other path"
                if steer
                else ""
            ),
        )

    def _failing_roots(self) -> set[int]:
        """The roots whose stores failed (but for ENOSPC) in the last 5 s, and
        those on a read-only filesystem at start, until one is found writable
        (looked at every READ_ONLY_LOOK_SECONDS)."""
        now = time.monotonic()
        failing = list(self._failing.items())
        if now - self._read_only_looked >= READ_ONLY_LOOK_SECONDS and any(u == math.inf for _, (u, _w) in failing):
            self._read_only_looked = now
            self._look_at_read_only_roots()
            failing = list(self._failing.items())
        return {r for r, (until, _) in failing if now < until}

    def _mark_read_only(self, r: int, why: str) -> None:
        """Root r is on a read-only filesystem: avoided until a look
        (_look_at_read_only_roots, from READ_ONLY_LOOK_SECONDS on) finds it
        writable."""
        self._failing[r] = (math.inf, why)
        self._read_only_looked = time.monotonic()

    def _look_at_read_only_roots(self) -> None:
        """A path on a read-only filesystem (at start, or since a store
        there failed with EROFS) that is writable now (remounted read-write
        after an fsck, say) takes new chunks again: it used to until a
        restart. Its chunks become evictable with it. One writable but
        refused otherwise (root_problem: its mode, its owner) stays unused,
        with that reason, said once per reason."""
        for r, (until, _) in list(self._failing.items()):
            root = self.roots[r]
            if until != math.inf or not takes_writes(root):
                continue
            try:
                refused = root_problem(root, os.stat(root), self.options.shared_group)
            except OSError as e:
                refused = f"{root!r}: {e.strerror}"
            with self._lock:
                until, why = self._failing.get(r, (0.0, ""))
                flipped = until == math.inf and why != refused  # by this thread: said once
                if flipped:  # expired, not removed: callers look an entry up after _failing_roots()
                    self._failing[r] = (math.inf, refused) if refused else (0.0, why)
            if flipped and refused:
                log.warning("lmcache-fx: store path %s is writable again but refused: %s", root, refused)
            elif flipped:
                log.warning("lmcache-fx: store path %s is writable again: new chunks go there again", root)

    def _io_warning(self, msg: str, *args) -> None:
        """A failing device fails every chunk: one warning per 5 s, with a count."""
        self.burst_warning("I/O errors", msg, *args)

    def burst_warning(self, what: str, msg: str, *args) -> None:
        """One warning of a kind per 5 s, with a count of those not logged:
        a failing device, or a restart after a power cut, fails many chunks
        at once, and a line each buried everything else. The adapters' own
        per-chunk warnings go through it too."""
        now = time.monotonic()
        with self._lock:
            until, quiet = self._warned.get(what, (0.0, 0))
            if now < until:
                self._warned[what] = (until, quiet + 1)
                return
            self._warned[what] = (now + 5.0, 0)
        if quiet:
            msg += f" ({quiet} more {what} in the last 5 s not logged)"
        log.warning(msg, *args)

    def _full_roots(self) -> set[int]:
        """The roots whose filesystem was full (ENOSPC) in the last 5 s."""
        now = time.monotonic()
        return {r for r, until in self._full_until.items() if now < until}

    def _all_full(self) -> bool:
        return len(self._full_roots()) == len(self.roots)

    def _unplaced(self, n: int) -> None:
        """n chunks of a batch not stored because both of their paths are
        full or failing (some paths still take chunks): counted as failed
        stores and said once per 5 s with the paths, not as a full store
        (which marked every path full and evicted)."""
        self.stats.add(write_errors=n)
        full, failing = self._full_roots(), self._failing_roots()
        said = [f"{self.roots[r]} (full)" for r in sorted(full)]
        said += [f"{self.roots[r]} ({self._failing[r][1]})" for r in sorted(failing - full)]
        self._io_warning(
            "lmcache-fx: %d chunk(s) not stored: both of the paths they may go under are unusable for now: %s",
            n,
            "; ".join(said),
        )

    def _count_enospc(self, n: int, root: Optional[int] = None) -> None:
        """One error per burst of full-disk failures, not one per chunk. `root`:
        the root whose filesystem is full (None: the store's, every root). One
        full root of several only steers chunks to their other root for 5 s;
        with every root full, stores are skipped and a little is evicted."""
        now = time.monotonic()
        hit = range(len(self.roots)) if root is None or len(self.roots) == 1 else [root]
        new = [r for r in hit if now >= self._full_until.get(r, 0.0)]
        if new:
            for r in new:
                self._full_until[r] = now + 5.0
            # The count is the previous burst's (this one's is not known yet): said only where there was one.
            before = f" ({self._enospc_count} chunk stores failed or skipped in the previous burst)"
            if self._all_full():
                log.error(
                    "lmcache-fx: the store filesystem is full (ENOSPC); skipping stores for 5 s%s. "
                    "Lower max_capacity_gb below the free space.",
                    before if self._enospc_count else "",
                )
                # Evict a little so stores can resume once space is back: when the write ends, not
                # here, where a caller may hold the ledger with a usage of its own to write back over it.
                self._evict_after_write = True
            else:
                log.error(
                    "lmcache-fx: the filesystem of store path %s is full (ENOSPC); for 5 s its chunks go to "
                    "their other path%s. Free space there, or lower max_capacity_gb below the free space of "
                    "the store's paths together.",
                    ", ".join(self.roots[r] for r in new),
                    before if self._enospc_count else "",
                )
            self._enospc_count = 0
        self._enospc_count += n

    # ------------------------------------------------------------ reads
    def read_steps(
        self,
        keys: Sequence[str],
        allocate: Any,
        chunks: bool = True,
        per_key: bool = False,
        allocate_many: Optional[Callable[[ChunkMeta, int], Optional[list]]] = None,
    ) -> Generator[tuple, list, tuple[list, list]]:
        """Reads chunks as a generator that yields engine batches and
        receives their results, so the same logic runs blocking or awaited
        (core/drive.py runs them). A batch is (ops, crc), engine.read ops;
        or, for the payloads when `chunks` (the engine is the store's own
        Engine: host addresses), ("chunks", chunks, scratch, verify, direct,
        lock), one engine.read_chunks call. `allocate(meta)` returns (handle,
        address, nbytes) or None (the pool is full: this key and the later
        ones miss). With `per_key`, `allocate` is one such callable per key
        (the destination is the caller's, e.g. LMCache's L2 objects) and a
        None misses that key only. Optional `allocate_many(meta, count)`
        returns `count` such triples in one call, or None (then `allocate`
        runs per chunk): each run of consecutive chunks of one meta takes it
        first, for a pool whose one call per batch costs less than one per
        chunk. Returns (one handle or None per key, handles of failed chunks).

        An engine error thrown in at a step (the driver's `gen.throw`), or any
        other failure inside, makes the whole batch misses: every handle
        allocated so far comes back among the failed ones. The driver must
        not close the generator while a batch it yielded is in flight (its
        file descriptors are closed on the way out)."""
        n = len(keys)
        allocs: list[Optional[tuple]] = [None] * n
        fds: list[int] = []
        held: list = []  # header scratch buffers this read took (_take_scratch), kept again at the end
        ledger = self._ledger
        if ledger is not None:
            ledger.reading(1)  # chunk files may be open from here on (Ledger.may_reuse, for unlocked reads)
        try:
            return (yield from self._read_steps(keys, allocate, allocs, fds, held, chunks, per_key, allocate_many))
        except Exception as ex:
            if not isinstance(ex, ReadCancelled):
                self._io_warning(
                    "lmcache-fx: reading %d chunks failed (%s: %s); treating them as misses", n, type(ex).__name__, ex
                )
                self.stats.add(read_errors=1)
            self.stats.add(misses=n)
            stray = [a[0] for a in ex.allocs] if isinstance(ex, _StrayAllocations) else []
            return [None] * n, [a[0] for a in allocs if a is not None] + stray
        finally:
            for fd in fds:
                os.close(fd)
            self._keep_scratch(held)
            if ledger is not None:
                ledger.reading(-1)

    def _read_steps(
        self,
        keys,
        allocate,
        allocs: list,
        fds: list[int],
        held: list,
        chunks: bool = True,
        per_key: bool = False,
        allocate_many=None,
    ):
        n = len(keys)
        digests = [chunk_digest(k) for k in keys]
        entries: list[Any] = self._entries(digests)
        t0 = time.perf_counter()
        # Phase 1: headers of chunks this process has not seen yet.
        need = [i for i, e in enumerate(entries) if e is not None and e.meta is None]
        if need:
            hbuf = self._take_scratch(len(need))
            held.append(hbuf)
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
            for k, ((j, i), r) in enumerate(zip(opened, res)):
                e = entries[i]
                mv = memoryview(hbuf)[HEADER_SIZE * j : HEADER_SIZE * (j + 1)]
                h = self._check_header(keys[i], e, mv, r, fds[k])
                if h is not None:
                    ident, size = _identity(fds[k])
                    if size is not None and size < HEADER_SIZE + h.payload_len:
                        # Its payload cannot be there: a miss before room is sought for what it claims.
                        self._corrupt_unless_moved(keys[i], e, f"{size} bytes for a payload of {h.payload_len}", ident)
                        h = None
                if h is None:
                    entries[i] = None
                else:
                    e.meta, e.body, e.check_payload, e.other_version = (
                        h.meta,
                        header_body_of(mv),
                        h.check_payload,
                        False,
                    )
                    _read_from(e, ident)
            while fds:
                os.close(fds.pop())
        # Phase 2: header again (the file may have been replaced) and payload. Each chunk is read as
        # the meta and header body taken here: a lookup on another thread may forget them on the shared
        # entry meanwhile (another file in its place), and a chunk whose meta is gone already is a miss.
        pairs = [(None, None) if e is None else (e.meta, e.body) for e in entries]
        metas, bodies = [p[0] for p in pairs], [p[1] for p in pairs]
        for i, m in enumerate(metas):
            if m is None:
                entries[i] = None
        out: list[Optional[object]] = [None] * n
        if allocate_many is not None and not per_key:
            self._allocate_runs(metas, allocs, allocate_many)
        for i, m in enumerate(metas):
            if m is None or allocs[i] is not None:
                continue
            a = allocate[i](m) if per_key else allocate(m)
            if a is None:
                if per_key:
                    continue  # this destination does not fit this chunk
                break  # the pool is full: later chunks would be useless anyway
            allocs[i] = a
        if chunks:
            return (yield from self._read_payloads(keys, digests, entries, metas, bodies, allocs, held, t0))
        hbuf = self._take_scratch(n)
        held.append(hbuf)
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
        # Chunks last seen with FLAG_CHECK_PAYLOAD get their payload CRC whatever verify says.
        crc = self.options.verify or any(entries[i].check_payload for i in slots)
        res = yield ops, crc
        nbytes = 0
        for k, i in enumerate(slots):
            hr, pr = res[2 * k], res[2 * k + 1]
            prn, pcrc = pr if isinstance(pr, tuple) else (pr, None)
            e = entries[i]
            fd = fds[k]
            mv = memoryview(hbuf)[HEADER_SIZE * i : HEADER_SIZE * (i + 1)]
            h = self._check_header(keys[i], e, mv, hr[0] if isinstance(hr, tuple) else hr, fd)
            if h is None:
                continue
            if h.meta != metas[i] or h.payload_len != allocs[i][2]:
                # Replaced by a chunk of another geometry: a miss now; the next read takes its header
                # anew (phase 1, which checks the file holds the payload the header claims).
                e.meta = None
                continue
            if prn != h.payload_len:
                ident, size = _identity(fd)
                if prn < 0:
                    self._corrupt(keys[i], e, f"read failed: {os.strerror(-prn)}", remove=False)
                else:
                    self._short_payload(keys[i], e, size, h.payload_len, prn, ident)
                continue
            if pcrc is not None and (self.options.verify or h.check_payload) and pcrc != h.payload_crc:
                self._corrupt(keys[i], e, "payload checksum mismatch", ident=_identity(fd)[0])
                continue
            if h.check_payload and pcrc is None:
                # Flagged since its header was last seen (rewritten by another store), so read without
                # its CRC: a miss this time; the next read learns the flag in phase 1 and asks for it.
                e.meta = e.body = None
                continue
            if self._mac_rejects(keys[i], e, mv, h, allocs[i][1], prn, _identity(fd)[0]):
                continue
            e.check_payload = h.check_payload
            out[i] = allocs[i][0]
            nbytes += prn
        used = [(entries[i], fds[k]) for k, i in enumerate(slots) if out[i] is not None]
        return self._finish_read(digests, out, allocs, used, nbytes, t0)

    @staticmethod
    def _allocate_runs(metas: list, allocs: list, allocate_many) -> None:
        """Destinations for runs of two or more consecutive chunks of one meta
        (None: a miss) from allocate_many, one call per run, up to the first
        run it cannot give (the chunks from there on are allocated one by one)."""
        n, i = len(metas), 0
        while i < n:
            m = metas[i]
            j = i + 1
            if m is not None:
                while j < n and metas[j] is not None and (metas[j] is m or metas[j] == m):
                    j += 1
                if j - i > 1:
                    got = allocate_many(m, j - i)
                    if got is None:
                        return
                    if len(got) != j - i:  # a slice of another length would shift every later destination
                        raise _StrayAllocations(f"allocate_many gave {len(got)} destinations for {j - i} chunks", got)
                    allocs[i:j] = got
            i = j

    def _read_payloads(
        self, keys, digests: list[str], entries: list, metas: list, bodies: list, allocs: list, held: list, t0: float
    ):
        """Phase 2 on engine.read_chunks: per chunk, open (relative to its
        root's descriptor, no symlink followed), header and payload in one
        vectored read, the header checked in C against the body last seen
        (no JSON decoded on a hit), close. Statuses map to the policy of the
        two-op path."""
        n = len(keys)
        batch, slots = [], []
        for i, a in enumerate(allocs):
            if a is None:
                continue
            d = digests[i]
            rfd = self._rootfd_of(entries[i].path)  # the root its lookup found it under
            batch.append((rfd, relative_name(d), a[1], a[2], bodies[i]))
            slots.append(i)
        scratch = self._take_scratch(len(slots))
        held.append(scratch)
        # Chunks last seen with FLAG_CHECK_PAYLOAD are checked whatever verify says: as verified reads,
        # each piece summed as it lands, not summed over again from memory after the batch (C's
        # fallback for flags it meets unannounced), which read them 0.68x as fast at 2 MiB.
        verify = self.options.verify or any(entries[i].check_payload for i in slots)
        res = yield (
            "chunks",
            batch,
            scratch,
            verify,
            self.odirect,
            self.lock_reads,
            self.mapped_reads,
            verify and self._stage_checked and sum(c[3] for c in batch) > self.stage_above,
        )
        out: list[Optional[object]] = [None] * n
        nbytes = 0
        hit_entries = []
        smv = memoryview(scratch)
        for k, i in enumerate(slots):
            status, nb, dev, ino, size = res[k]
            e = entries[i]
            # A plain hit: C found the body the read expected, and the entry still holds the meta and body
            # taken together (a lookup or read on another thread may have replaced them meanwhile: then
            # the header is decoded and held to the meta this destination was allocated for).
            if (
                status == 0
                and bodies[i] is not None
                and self._mac_key is None
                and e.meta is metas[i]
                and e.body is bodies[i]
            ):
                out[i] = allocs[i][0]
                nbytes += nb
                hit_entries.append(e)
                continue
            mv = smv[HEADER_SIZE * k : HEADER_SIZE * (k + 1)]
            if self._chunk_ok(keys[i], e, metas[i], status, nb, (dev, ino), size, mv, allocs[i]):
                out[i] = allocs[i][0]
                nbytes += nb
                hit_entries.append(e)
        return self._finish_read(digests, out, allocs, [(e, None) for e in hit_entries], nbytes, t0)

    def _chunk_ok(
        self, key: str, e: Entry, meta: ChunkMeta, status: int, nb: int, ident: tuple[int, int], size: int, mv, alloc
    ) -> bool:
        """One read_chunks result that was not a plain hit: True when the
        chunk is good after all (status 0: MAC checked, or the body learnt),
        else the miss handled as the two-op path handles it."""
        length = alloc[2]
        if status == _fxio.CHUNK_OK or status in (_fxio.CHUNK_META, _fxio.CHUNK_LENGTH):
            try:
                h = decode_header(mv)
            except BadHeader as ex:  # checked in C already: only the JSON can be bad here
                self._corrupt(key, e, str(ex), ident=ident)
                return False
            if h.key != key:  # or evicted and rewritten with h.key just before our lock
                self._corrupt_unless_moved(key, e, f"holds key {h.key!r}, not the one asked for", ident)
                return False
            if status != _fxio.CHUNK_OK or h.meta != meta:
                # Replaced by a chunk of another geometry (or another body): a miss now; the next read
                # takes its header anew (phase 1, which checks the file holds what the header claims).
                e.meta = e.body = None
                return False
            if e.meta is meta:  # else another thread replaced it meanwhile: its pair is left as it is
                e.body, e.check_payload, e.other_version = header_body_of(mv), h.check_payload, False
            return not self._mac_rejects(key, e, mv, h, alloc[1], nb, ident)
        if status in _CORRUPT_STATUSES:  # or being reused (its header zeroed first)
            why = _fxio.CHUNK_STATUS_NAMES[status].replace("_", " ")
            self._corrupt_unless_moved(
                key, e, why if status != _fxio.CHUNK_PAYLOAD_CRC else "payload checksum mismatch", ident
            )
        elif status == _fxio.CHUNK_VERSION:
            self._other_version(e, "another format version", ident)
        elif status == _fxio.CHUNK_SHORT:
            self._short_payload(key, e, size if size >= 0 else None, length, nb, ident)
        elif status < 0 and -status in _GONE:
            self._drop(chunk_digest(key), unlink=False)  # evicted or removed by another process: a miss
        elif status < 0:
            self._corrupt(key, e, f"read failed: {os.strerror(-status)}", remove=False)
        else:
            self._corrupt(key, e, f"read_chunks status {status}", remove=False)
        return False

    @staticmethod
    def _moved_away(path: str, ident: tuple[int, int]) -> bool:
        """Whether the file read (`ident`) is no longer the one at `path`: a
        reader that opened it just before an evictor moved it away (to write
        another chunk into it) and read-locked it after (read_chunks checks
        no names: this runs on a miss only)."""
        st = stat_in(path)
        return st is None or (st.st_dev, st.st_ino) != tuple(ident)

    def _corrupt_unless_moved(self, key: str, e: Entry, why: str, ident: Optional[tuple[int, int]]) -> None:
        """A bad file read (`ident`) is corrupt, and removed, while it is still
        the one at its path; one moved away meanwhile (an evictor reusing it)
        is another chunk's now: a miss, its entry dropped, nothing removed."""
        if ident is not None and self._moved_away(e.path, ident):
            self._drop(chunk_digest(key), unlink=False)
        else:
            self._corrupt(key, e, why, ident=ident)

    def _take_scratch(self, nchunks: int) -> "_fxio.HostBuffer":
        """A header area of HEADER_SIZE per chunk for one batch: the smallest
        kept buffer that fits, or a new one of a power of two bytes (so that
        it fits later batches too). The caller gives it back to _keep_scratch
        once no I/O of it is in flight (read_steps when it closes its files,
        the driver's contract; writes once their call returned). What an earlier batch left in it is never taken for a
        header: reads use header bytes only once their read is known to be
        whole, and encode_header writes all 4 KiB of each."""
        need = HEADER_SIZE * max(nchunks, 1)
        buf = None
        with self._lock:
            if self._scratch_pid != _PID[0]:  # a forked child: the parent's buffers are not mapped here
                self._scratch_kept, self._scratch_pid = [], _PID[0]
            for j, b in enumerate(self._scratch_kept):
                if len(b) >= need:
                    buf = self._scratch_kept.pop(j)
                    break
        if buf is None:
            buf = _fxio.HostBuffer(1 << (need - 1).bit_length(), hugepages=False)
        return buf

    def _keep_scratch(self, bufs: list) -> None:
        """Keeps scratch buffers for later batches, SCRATCH_KEPT_BYTES of them
        at most; the rest are unmapped."""
        with self._lock:
            if self._scratch_pid != _PID[0]:  # taken before a fork: the parent's to keep, not this child's
                return
            kept = self._scratch_kept
            for buf in bufs:
                if sum(map(len, kept)) + len(buf) <= SCRATCH_KEPT_BYTES:
                    kept.append(buf)
            kept.sort(key=len)

    def _finish_read(self, digests: list[str], out: list, allocs: list, used: list, nbytes: int, t0: float):
        """The bookkeeping of a read batch, once: the shared LRU clock of the
        chunks used ((entry, fd or None) pairs), this process's recency,
        the stats. Returns (out, handles of failed chunks for the caller to free)."""
        self._touch_many([e for e, _ in used])
        hits = len(used)
        if hits:
            with self._lock:
                idx = self._index
                for d, o in zip(digests, out):
                    if o is not None and d in idx:  # evicted meanwhile by another thread: still a hit
                        idx.move_to_end(d, last=True)
        n = len(out)
        self.stats.observe_read(
            time.perf_counter() - t0, chunks_read=hits, bytes_read=nbytes, hits=hits, misses=n - hits
        )
        if _fxio.uring_sync_pieces():
            _say_uring_short_of_workers()
        failed = [allocs[i][0] for i in range(n) if allocs[i] is not None and out[i] is None]
        return out, failed

    def _mac_rejects(self, key: str, e: Entry, mv, h, addr: int, nbytes: int, ident) -> bool:
        """With auth_key: True (the chunk handled as corrupt) when its MAC over
        the header and the payload at addr does not verify."""
        if self._mac_key is None or mac_ok(self._mac_key, mv, h, memory_at(addr, nbytes)):
            return False
        # Well formed (its header's CRC32C held, its payload's too where checked) but not this key's:
        # most likely another process sharing the store with another auth_key or none, each then
        # removing the other's chunks; said as that, not as damage.
        self._corrupt(key, e, why_no_mac(h), ident=ident, unauthenticated=True)
        return True

    def _short_payload(self, key: str, e: Entry, size: Optional[int], length: int, nbytes: int, ident) -> None:
        """A payload read shorter than its header says: the file is corrupt
        (removed) if it is shorter too, else a read error (kept)."""
        if size is not None and size < HEADER_SIZE + length:
            self._corrupt(key, e, f"file is {size} bytes, its header says {HEADER_SIZE + length}", ident=ident)
        else:  # the file is long enough: the read came back short, the data may well be good
            self._corrupt(key, e, f"short read: {nbytes} of {length} payload bytes", remove=False)

    def _open_read(self, path: str) -> int:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.odirect:
            flags |= os.O_DIRECT
        try:
            return open_in(path, flags, lock=self.lock_reads, regular=True)
        except OSError as e:
            # Gone (evicted or removed by another process, or being reused: ESTALE): a miss.
            if e.errno not in _GONE:
                hint = ""
                if self.options.shared_group and e.errno in (errno.EACCES, errno.EPERM):
                    hint = f"; a process without shared_group: true wrote it (only its user may read it): {SHARED_GROUP_FIX}"
                self._io_warning("lmcache-fx: cannot open %s (%s)%s; treating it as a miss", path, e.strerror, hint)
            self._drop(chunk_digest_of_path(path), unlink=False)
            return -1

    def _check_header(self, key: str, e: Entry, mv, res: int, fd: int = -1):
        if res != HEADER_SIZE:
            ident, size = _identity(fd)
            short_file = res >= 0 and size is not None and size < HEADER_SIZE
            # a short read of a file long enough (fstat) is a read error: the file is kept
            self._corrupt(
                key,
                e,
                f"header read returned {res} bytes" if res >= 0 else f"header read failed: {os.strerror(-res)}",
                remove=short_file,
                ident=ident,
            )
            return None
        try:
            h = decode_header(mv)
        except FormatVersionMismatch as ex:
            self._other_version(e, str(ex), _identity(fd)[0])
            return None
        except BadHeader as ex:
            self._corrupt(key, e, str(ex), ident=_identity(fd)[0])
            return None
        if h.key != key:
            self._corrupt(key, e, f"holds key {h.key!r}, not the one asked for", ident=_identity(fd)[0])
            return None
        return h

    def _other_version(self, e: Entry, why: str, ident: Optional[tuple[int, int]]) -> None:
        """A chunk of another format version (a newer lmcache-fx beside this
        one): left alone, a miss here until a store of its key writes over it
        (or a lookup finds another file in its place)."""
        e.other_version = True
        _read_from(e, ident)
        self.burst_warning(
            "chunks of another format version",
            "lmcache-fx: %s has %s; a miss here until its key is stored again",
            e.path,
            why,
        )

    def _corrupt(
        self,
        key: str,
        e: Entry,
        why: str,
        remove: bool = True,
        ident: Optional[tuple[int, int]] = None,
        unauthenticated: bool = False,
    ) -> None:
        if unauthenticated:
            self.stats.add(unauthenticated=1)
            self.burst_warning(
                "unauthenticated chunk files",
                "lmcache-fx: chunk file %s is well formed but refused: %s. Another process writing this store "
                "with another auth_key, or none, makes such files (each then removes the other's chunks): every "
                "process sharing a store must set the same auth_key. Treating it as a miss and removing it",
                e.path,
                why,
            )
        elif remove:
            self.stats.add(corrupt=1)
            self.burst_warning(
                "bad chunk files",
                "lmcache-fx: chunk file %s is bad (%s); treating it as a miss and removing it",
                e.path,
                why,
            )
        else:  # a read error, not bad data: the file is kept, and a failing device warns once per burst
            self._io_warning("lmcache-fx: reading chunk file %s failed (%s); treating it as a miss", e.path, why)
            self.stats.add(read_errors=1)
        if remove and ident is None:
            remove = False  # which file was read is unknown: never remove by name alone
        self._drop(chunk_digest(key), unlink=remove, expect_path=e.path, ident=ident)

    def read(
        self, keys: Sequence[str], allocate, release: Callable[[object], None], engine=None, allocate_many=None
    ) -> list[Optional[object]]:
        """Blocking read: drives read_steps with the engine (or another
        object with the engine's read/submit, e.g. the GPU router). Never
        raises: an engine error makes the batch misses, every handle
        allocated for it released."""
        try:
            eng = engine or self.engine
            steps = self.read_steps(keys, allocate, self._takes_chunks(eng), allocate_many=allocate_many)
            return drive_blocking(eng, steps, release)
        except Exception as ex:  # read_steps already turns engine errors into misses: a last guard
            self._io_warning("lmcache-fx: read failed (%s); treating %d chunks as misses", ex, len(keys))
            return [None] * len(keys)

    async def read_async(
        self, keys: Sequence[str], allocate, release, engine=None, allocate_many=None
    ) -> list[Optional[object]]:
        """The same read, awaited on an event loop. Cancelled, it waits for
        the batch in flight to finish, releases every handle and re-raises
        CancelledError."""
        try:
            eng = engine or self.engine
            steps = self.read_steps(keys, allocate, self._takes_chunks(eng), allocate_many=allocate_many)
            return await drive_async(eng, steps, release)
        except Exception as ex:
            self._io_warning("lmcache-fx: read failed (%s); treating %d chunks as misses", ex, len(keys))
            return [None] * len(keys)

    def _takes_chunks(self, engine) -> bool:
        """Whether reads through `engine` take read_chunks steps: a C Engine
        (host destinations) does; the GPU router (which forwards other
        attributes to the engine) and other stand-ins, whose destinations may
        be device pointers, get (ops, crc) steps."""
        return isinstance(engine, _fxio.Engine) and bool(self._rootfds)

    def close(self) -> None:
        if self._spare_bytes and self._ledger is not None:
            try:
                with self._ledger.hold():
                    self._ledger_add_locked(-self._drop_spares_locked(lambda sp: True))
            except LockTimeout:  # removed without the lock: the next recompute counts them out
                self._drop_spares_locked(lambda sp: True)
        self._release(close_engine=True)

    def _release(self, close_engine: bool) -> None:
        """Lets go of what the store holds (its engines, the clock's
        thread, descriptors, the ledger), by close() and by a failed start."""
        if close_engine:
            self.engine.close()
        if self._wengine is not None and self._wengine is not self.engine:
            self._wengine.close()
        if self._toucher is not None:
            self._toucher.close()
        self._close_fds()
        if self._spares_fd >= 0:
            os.close(self._spares_fd)
            self._spares_fd = -1
        if self._ledger is not None:
            self._ledger.release()
            self._ledger = None  # type: ignore[assignment]
