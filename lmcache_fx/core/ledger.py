"""The shared byte count of a store and the lock that guards it.

Every process (TP ranks, instances, nodes) writing to one path shares one
capacity. The bytes of the store live in a ledger, the lock file
<first path>/.fx/store.lock, changed only under an advisory flock on it: a
write reserves its bytes there (evicting first when the cap would be passed),
a commit or removal corrects them. See docs/shared-stores.md.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
import zlib
from contextlib import contextmanager
from typing import Optional

from .layout import FLOCK, LOCK_DIR, LOCK_NAME, MEMBERS_NAME, open_dir, share_fd
from .options import SHARED_GROUP_FIX, ConfigError

log = logging.getLogger("lmcache_fx")

LOCK_TIMEOUT = 5.0  # seconds a thread waits for the store lock before giving up (a stalled peer holds it)
STALLED_WAIT = 0.05  # the wait for it during the LOCK_TIMEOUT seconds after a wait ran out
_WARN_EVERY = 5.0  # one warning per burst of lock timeouts
LOCK_POLL_MAX = 0.05  # the longest pause between a waiter's tries for the store lock (_flock)
# Bytes of .fx/members a process read-locks while it has the store open:
UNLOCKED_READS = 0  # its reads of chunk files take no file locks (a network filesystem; fsck)
LOCKED_READS = 1  # each chunk file it reads is read-locked (layout.read_lock)


class LockTimeout(OSError):
    """The store lock was not free within LOCK_TIMEOUT: another process holds
    it (stopped, stuck in D state on a network filesystem, or hostile). The
    caller skips what needed it: a store, a ledger update, a removal."""


def _lock_file_error(path: str, e: OSError, shared_group: bool) -> ConfigError:
    """The error of a lock file (or its .fx directory) that cannot be opened;
    refused with shared_group, what a process without it made, and the fix."""
    hint = ""
    if shared_group and e.errno in (errno.EACCES, errno.EPERM):
        hint = f"; a process without shared_group: true made it (only its user may open it): {SHARED_GROUP_FIX}"
    return ConfigError(f"path: cannot open the store's lock file {path!r}: {e.strerror}{hint}")


class Ledger:
    """The shared byte count of a store, in its lock file: magic, usage,
    time of the last scan, CRC. One object per lock file per process (flock
    locks per open file, so threads and stores of one process take `mutex`
    first)."""

    REC = struct.Struct("<8sqd")
    MAGIC = b"FXLEDG1\0"
    # After the record, at CHANGES_OFF: a count of its changes and the usage it
    # was last written with, plus a CRC. A walk made without the lock is exact
    # when nothing changed meanwhile (changes()); readers of the 28-byte record
    # alone never look here.
    CHANGES = struct.Struct("<8sQq")
    CHANGES_MAGIC = b"FXCHNG1\0"
    CHANGES_OFF = 32
    _registry: dict = {}
    _reg_lock = threading.Lock()

    def __init__(self, fd: int, members_fd: int = -1, unlocked_reads: bool = True):
        self.fd = fd
        # A POSIX read lock on a byte of .fx/members while this process has the
        # store open (UNLOCKED_READS or LOCKED_READS): F_GETLK sees other
        # processes' locks, never this one's.
        self.members_fd = members_fd
        self.unlocked_reads = unlocked_reads  # some reads of this process take no file locks
        self._reads = 0  # read batches of this process that may hold chunk files open
        self._reads_lock = threading.Lock()
        self.mutex = threading.RLock()
        self.depth = 0  # nesting of hold() by the thread owning mutex
        self.refs = 0
        self.key: tuple = (0, 0)  # (st_dev, st_ino) of the lock file: its entry in _registry
        self.timeouts = 0  # lock waits that gave up (read by tests and metrics)
        self._warn_lock = threading.Lock()
        self._warn_until = 0.0
        self._quiet = 0
        self._stalled_until = 0.0
        # After a wait for another process's flock ran out: the ledger's change token then, and when.
        # While the token has not moved, that holder is taken as still stuck (short waits go on past
        # the window); the first lock had after it ends the stall, with one line saying so.
        self._stuck_token: Optional[tuple] = None
        self._stuck_since = 0.0
        # Why the last write of the record failed (None: it did not). The old record stays valid
        # then, so no reader sees a bad one and recounts: a writer must ask (writable()).
        self.write_error: Optional[OSError] = None
        self.puts = 0  # this process's writes of the record, to tell others' changes from its own

    @classmethod
    def open(cls, root: str, mode: int, dir_mode: int, shared_group: bool, locked_reads: bool = False) -> "Ledger":
        """This process's ledger of the store at `root`. `locked_reads`: the
        store read-locks every chunk file it reads (layout.read_lock)."""
        path = os.path.join(root, LOCK_NAME)
        try:
            try:
                os.mkdir(os.path.join(root, LOCK_DIR), dir_mode)
            except FileExistsError:
                pass
            dfd = open_dir(os.path.join(root, LOCK_DIR))  # refuses a planted symlink
        except OSError as e:
            raise _lock_file_error(path, e, shared_group) from None
        try:
            gid = None
            try:
                if shared_group:
                    gid = os.stat(root).st_gid  # the store's group, whoever made .fx
                    share_fd(dfd, gid, dir_mode)
                fd = os.open(
                    os.path.basename(LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd
                )
            except OSError as e:
                raise _lock_file_error(path, e, shared_group) from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise ConfigError(f"path: {path!r} is not a regular file; remove it")
            if shared_group:
                share_fd(fd, gid, mode)
            byte = LOCKED_READS if locked_reads else UNLOCKED_READS
            return cls._register(fd, st, lambda: _join_members(dfd, mode, gid, True, byte), byte)
        finally:
            os.close(dfd)

    @classmethod
    def _register(cls, fd: int, st: os.stat_result, join_members, byte: int) -> "Ledger":
        """This process's one ledger of the lock file `fd` is open on: a new
        one, which takes the process's lock on byte `byte` of .fx/members
        (join_members()), or the one it has, `fd` closed (flock locks go with
        the open file description: this one holds none), which also locks
        UNLOCKED_READS when this caller's reads take no file locks. The members
        file is opened only here, once per process and file: closing a second
        descriptor of it would drop the process's POSIX locks."""
        with cls._reg_lock:
            led = cls._registry.get((st.st_dev, st.st_ino))
            if led is None:
                led = cls._registry[(st.st_dev, st.st_ino)] = cls(
                    fd, join_members(), unlocked_reads=byte == UNLOCKED_READS
                )
                led.key = (st.st_dev, st.st_ino)
            else:
                os.close(fd)
                if byte == UNLOCKED_READS and not led.unlocked_reads:
                    led.unlocked_reads = True  # from now on, for the ledger's life
                    if led.members_fd >= 0:
                        try:
                            fcntl.lockf(led.members_fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, UNLOCKED_READS)
                        except OSError as e:  # never seen: nobody takes write locks on it
                            log.warning("lmcache-fx: no lock on the store's members file (%s)", e.strerror)
            led.refs += 1
        return led

    @classmethod
    def join(cls, root: str) -> Optional["Ledger"]:
        """This process's ledger of the store at `root`, counted as one that
        has the store open (tools reading its chunk files: fsck), without
        making anything; None when `root` has no store lock. release() after."""
        try:
            dfd = open_dir(os.path.join(root, LOCK_DIR))
        except OSError:
            return None
        try:
            # O_NONBLOCK: a FIFO planted at the lock's name blocked the read-only open for good (fsck, gc).
            flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            try:  # read-write, as Ledger.open: a store of this process may share this object later
                fd = os.open(os.path.basename(LOCK_NAME), flags | os.O_RDWR, dir_fd=dfd)
            except PermissionError:
                fd = os.open(os.path.basename(LOCK_NAME), flags | os.O_RDONLY, dir_fd=dfd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return None  # not a store lock
            os.set_blocking(fd, True)
            return cls._register(fd, st, lambda: _join_members(dfd, 0, None, False, UNLOCKED_READS), UNLOCKED_READS)
        except OSError:
            return None
        finally:
            os.close(dfd)

    def release(self) -> None:
        with self._reg_lock:
            self.refs -= 1
            if self.refs == 0:
                self._registry.pop(self.key, None)
                os.close(self.fd)
                if self.members_fd >= 0:
                    os.close(self.members_fd)  # drops this process's read lock: last, after its reads

    # ------------------------------------------------------------ reuse of evicted files
    def reading(self, delta: int) -> None:
        """Counts a read batch that may open chunk files (+1 before its first
        open, -1 once every descriptor it opened is closed)."""
        with self._reads_lock:
            self._reads += delta

    def reads_in_flight(self) -> int:
        """Read batches counted by reading() that have not ended."""
        with self._reads_lock:
            return self._reads

    def may_reuse(self) -> bool:
        """Whether an evicted file that has just been renamed away may be
        rewritten, provided the evictor also gets its write lock
        (layout.write_lock; a reader holding the file open has a read lock
        on it). Not while a process whose reads take no file locks has the
        store open (UNLOCKED_READS), nor, when this process has such reads,
        while one of them is in flight. Ask after the rename."""
        if self.unlocked_reads:
            with self._reads_lock:
                if self._reads:
                    return False
        return self._members_held(UNLOCKED_READS, 1) is False

    def others(self) -> bool:
        """Whether another process has the store open (holds either
        membership byte); True when that cannot be told."""
        return self._members_held(0, 2) is not False

    def _members_held(self, start: int, length: int) -> Optional[bool]:
        """Whether another process holds a lock on these bytes of
        .fx/members (F_GETLK never reports this process's own); None when
        that cannot be told."""
        if self.members_fd < 0:
            return None
        try:
            got = fcntl.fcntl(self.members_fd, fcntl.F_GETLK, FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
        except OSError:
            return None
        return FLOCK.unpack(got)[0] != fcntl.F_UNLCK

    @contextmanager
    def hold(self, timeout: Optional[float] = None):
        """The store lock, for this thread: waits at most `timeout` seconds
        (LOCK_TIMEOUT by default) for other threads and processes, polling
        flock with LOCK_NB, then raises LockTimeout (one warning per burst).
        No thread ever blocks without bound on another process."""
        wait = LOCK_TIMEOUT if timeout is None else timeout
        stalled = time.monotonic() < self._stalled_until or self._still_stuck()
        if stalled:
            # A wait just timed out: a short one only for a while, so a burst waits once, not per call.
            # Such a short wait failing does not prolong the while (ordinary contention would, for ever).
            wait = min(wait, STALLED_WAIT)
        deadline = time.monotonic() + wait
        if not self.mutex.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._timed_out("another thread of this process holds it", not stalled)
        try:
            if self.depth == 0:
                self._flock(deadline, not stalled)
            self.depth += 1
            try:
                yield self
            finally:
                self.depth -= 1
                if self.depth == 0:
                    try:
                        fcntl.flock(self.fd, fcntl.LOCK_UN)
                    except OSError:
                        pass
        finally:
            self.mutex.release()

    def _still_stuck(self) -> bool:
        """Whether the process whose flock made a wait run out still looks
        stuck: the ledger (read without the lock, as a hint) has not changed
        since. Without this, a stopped holder cost every caller a whole
        LOCK_TIMEOUT wait again each time the short-wait window ended (a
        writer blocked half the time); a holder at work changes the ledger."""
        token = self._stuck_token
        if token is None:
            return False
        if self.changes() == token:
            return True
        self._stuck_token = None
        return False

    def _flock(self, deadline: float, stall: bool = True) -> None:
        pause = 0.0005
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._stuck_since:
                    self._lock_free_again()
                return
            except BlockingIOError:
                pass
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                    pass
                else:  # a filesystem without locks: this process still serialises
                    log.warning("lmcache-fx: flock on the store lock file failed (%s)", e.strerror)
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                if stall:
                    self._stuck_token = self.changes()
                    self._stuck_since = self._stuck_since or time.monotonic()
                self._timed_out(lambda: f"another process holds it: {self._holder()}", stall)
            time.sleep(min(pause, left))
            pause = min(pause * 2, LOCK_POLL_MAX)

    def _lock_free_again(self) -> None:
        with self._warn_lock:
            since, self._stuck_since, self._stuck_token = self._stuck_since, 0.0, None
            self._stalled_until = 0.0
        if since:
            log.warning(
                "lmcache-fx: the store lock is free again, after about %.0f s held by another process",
                time.monotonic() - since,
            )

    def _holder(self) -> str:
        """Who holds the lock file's flock, from /proc/locks (this pid
        namespace's view): 'pid N (state)', or why that cannot be told."""
        try:
            st = os.fstat(self.fd)
            dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
            with open("/proc/locks") as f:
                held = [(w[4], w[5]) for w in (line.split() for line in f) if len(w) > 5 and w[1] == "FLOCK"]
        except OSError:
            return "which one cannot be told here"
        # The device /proc/locks names may not be the one fstat gives (btrfs subvolumes, overlayfs):
        # by inode alone when no line has both.
        ino = f":{st.st_ino}"
        pids = [p for p, i in held if i == dev + ino] or [p for p, i in held if i.endswith(ino)]
        if not pids:
            return "a process this host cannot see (another node or pid namespace)"
        return ", ".join(f"pid {p} ({_proc_state(p)})" for p in pids)

    def _timed_out(self, who, stall: bool = True):
        """Raises LockTimeout; `stall`: a whole wait ran out, so calls for
        the next LOCK_TIMEOUT seconds wait only STALLED_WAIT. `who`: a str,
        or a callable giving it (asked only when the warning is logged)."""
        now = time.monotonic()
        with self._warn_lock:
            self.timeouts += 1
            if stall:
                self._stalled_until = now + LOCK_TIMEOUT
            quiet = 0
            if now >= self._warn_until:
                quiet, self._quiet = self._quiet, 0
                self._warn_until = now + _WARN_EVERY
                warn = True
            else:
                self._quiet += 1
                warn = False
        if warn:
            log.warning(
                "lmcache-fx: the store lock was not free within %.1f s (%s); skipping what needed it "
                "(stores, ledger updates, removals) until it is%s",
                LOCK_TIMEOUT,
                who() if callable(who) else who,
                f" ({quiet} more timeouts in the last {_WARN_EVERY:.0f} s not logged)" if quiet else "",
            )
        raise LockTimeout(errno.ETIMEDOUT, "the store lock is held by another process")

    def get(self) -> Optional[tuple[int, float]]:
        """(usage, last scan time), or None when the record is missing or bad.
        Hold the lock to act on it; without, it is a hint (a torn read fails
        its CRC and gives None)."""
        try:
            b = os.pread(self.fd, self.REC.size + 4, 0)
        except OSError:
            return None
        return self._record(b)

    def _record(self, b: bytes) -> Optional[tuple[int, float]]:
        b = b[: self.REC.size + 4]
        if len(b) != self.REC.size + 4 or zlib.crc32(b[:-4]) != struct.unpack("<I", b[-4:])[0]:
            return None
        magic, usage, scanned = self.REC.unpack(b[:-4])
        if magic != self.MAGIC:
            return None
        return usage, scanned

    def changes(self) -> tuple:
        """A token that differs after any put() since it was taken: the count
        of changes, the usage it was written with and the record's usage (a
        writer of an older version changes the record without counting). Hold
        the lock."""
        try:
            b = os.pread(self.fd, self.CHANGES_OFF + self.CHANGES.size + 4, 0)
        except OSError:
            return (None, None, None)
        rec = self._record(b)
        usage = rec[0] if rec else None
        tail = b[self.CHANGES_OFF :]
        if len(tail) != self.CHANGES.size + 4 or zlib.crc32(tail[:-4]) != struct.unpack("<I", tail[-4:])[0]:
            return (0, None, usage)
        magic, count, written = self.CHANGES.unpack(tail[:-4])
        return (count, written, usage) if magic == self.CHANGES_MAGIC else (0, None, usage)

    def add(self, delta: int, recount: bool = False) -> Optional[int]:
        """Adds delta to the usage (never below 0), keeping the scan time, or
        with `recount` setting it to 0, so that the next store to write
        recounts the files; the new usage, or None when the record is missing
        or bad (it is left for a scan to rebuild). Hold the lock."""
        rec = self.get()
        if rec is None:
            return None
        usage = max(0, rec[0] + delta)
        self.put(usage, 0.0 if recount else rec[1])
        return usage

    def set_usage(self, usage: int) -> None:
        """Writes usage, keeping the record's scan time (now when the record
        is bad). Hold the lock."""
        rec = self.get()
        self.put(usage, rec[1] if rec else time.time())

    def put(self, usage: int, scanned: float) -> bool:
        """Writes the record and counts the change (one write); False, with
        write_error set, when the write failed. Hold the lock."""
        count = self.changes()[0] or 0
        b = self.REC.pack(self.MAGIC, int(usage), float(scanned))
        c = self.CHANGES.pack(self.CHANGES_MAGIC, count + 1, int(usage))
        pad = bytes(self.CHANGES_OFF - self.REC.size - 4)
        data = b + struct.pack("<I", zlib.crc32(b)) + pad + c + struct.pack("<I", zlib.crc32(c))
        try:
            n = os.pwrite(self.fd, data, 0)
            if n != len(data):
                raise OSError(errno.EIO, f"short write of the store's ledger ({n} of {len(data)} bytes)")
        except OSError as e:
            # The old record stays as it was, valid: nobody recounts. The caller asks writable().
            self.write_error = e
            return False
        self.write_error = None
        self.puts += 1
        return True

    def mark(self) -> tuple:
        """A token for others_changed(): the record's change count and this
        process's writes of it, now."""
        return (self.changes()[0], self.puts)

    def others_changed(self, since: tuple) -> bool:
        """Whether another process changed the record (stored, removed or
        evicted chunks) since mark() gave `since`: more changes counted than
        this process made; True when that cannot be told."""
        count, puts = since
        now = self.changes()[0]
        if count is None or now is None:
            return True
        return now - count > self.puts - puts

    def writable(self) -> bool:
        """Whether the record can be written, after a write of it failed (its
        filesystem gone read-only or shut down by an error, say): tried by
        writing it again, asking for a recount. True when no write failed.
        Hold the lock."""
        if self.write_error is None:
            return True
        rec = self.get()
        return self.put(rec[0] if rec else 0, 0.0)


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped", "t": "stopped by a tracer"}


def _proc_state(pid: str) -> str:
    """What /proc/<pid>/stat says the process is doing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "state unknown"
    return _STATES.get(state, f"state {state}")


def _after_fork_in_child() -> None:
    """A forked child shares its parent's lock file description (so the
    parent's flock would not exclude it) and has none of its POSIX locks
    (so other processes would not see it in .fx/members): stores it makes
    open ledgers of their own. Objects it inherited are left as they are."""
    Ledger._registry = {}
    Ledger._reg_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _join_members(dfd: int, mode: int, gid: Optional[int], create: bool, byte: int) -> int:
    """Opens .fx/members and takes a read lock on its byte `byte` (never
    waits: nobody takes a write lock). Returns the descriptor, or -1: then
    this process reuses no evicted file, and one that does cannot see it (a
    warning says so; a read that races a reuse fails its checks: the lock,
    then the name or the header's key, of locked reads; else the CRC)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(os.path.basename(MEMBERS_NAME), flags, mode or 0o600, dir_fd=dfd)
    except OSError as e:
        if create:
            log.warning("lmcache-fx: cannot open the store's members file (%s)", e.strerror)
        return -1
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if gid is not None:
            share_fd(fd, gid, mode)
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, byte)
    except OSError as e:
        if create:
            log.warning("lmcache-fx: no lock on the store's members file (%s)", e.strerror)
        os.close(fd)
        return -1
    return fd
