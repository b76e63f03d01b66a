"""The shared byte count of a store and the lock that guards it.

Every process (TP ranks, instances, nodes) writing to one path shares one
capacity. The bytes of the store live in a ledger, the lock file
<first path>/.fx/store.lock, changed only under an advisory flock on it: a
write reserves its bytes there (evicting first when the cap would be passed),
a commit or removal corrects them. See docs/shared-stores.md.
"""
from __future__ import annotations

import fcntl
import logging
import os
import stat
import struct
import threading
import zlib
from contextlib import contextmanager
from typing import Optional

from .layout import LOCK_DIR, LOCK_NAME, open_dir
from .options import ConfigError

log = logging.getLogger("lmcache_fx")


class Ledger:
    """The shared byte count of a store, in its lock file: magic, usage,
    time of the last scan, CRC. One object per lock file per process (flock
    locks per open file, so threads and stores of one process take `mutex`
    first)."""

    REC = struct.Struct("<8sqd")
    MAGIC = b"FXLEDG1\0"
    _registry: dict = {}
    _reg_lock = threading.Lock()

    def __init__(self, fd: int):
        self.fd = fd
        self.mutex = threading.RLock()
        self.depth = 0  # nesting of hold() by the thread owning mutex
        self.refs = 0

    @classmethod
    def open(cls, root: str, mode: int, dir_mode: int, shared_group: bool) -> "Ledger":
        path = os.path.join(root, LOCK_NAME)
        try:
            try:
                os.mkdir(os.path.join(root, LOCK_DIR), dir_mode)
            except FileExistsError:
                pass
            dfd = open_dir(os.path.join(root, LOCK_DIR))  # refuses a planted symlink
            try:
                if shared_group:
                    try:
                        os.fchmod(dfd, dir_mode)  # past the umask
                    except OSError:
                        pass
                fd = os.open(os.path.basename(LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                             mode, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise ConfigError(f"path: cannot open the store's lock file {path!r}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise ConfigError(f"path: {path!r} is not a regular file; remove it")
        if shared_group:
            try:
                os.fchmod(fd, mode)
            except OSError:
                pass
        with cls._reg_lock:
            led = cls._registry.get((st.st_dev, st.st_ino))
            if led is None:
                led = cls._registry[(st.st_dev, st.st_ino)] = cls(fd)
                led.key = (st.st_dev, st.st_ino)
            else:
                os.close(fd)
            led.refs += 1
        return led

    def release(self) -> None:
        with self._reg_lock:
            self.refs -= 1
            if self.refs == 0:
                self._registry.pop(self.key, None)
                os.close(self.fd)

    @contextmanager
    def hold(self):
        with self.mutex:
            if self.depth == 0:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_EX)
                except OSError as e:  # a filesystem without locks: this process still serialises
                    log.warning("lmcache-fx: flock on the store lock file failed (%s)", e.strerror)
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

    def get(self) -> Optional[tuple[int, float]]:
        """(usage, last scan time), or None when the record is missing or bad. Hold the lock."""
        try:
            b = os.pread(self.fd, self.REC.size + 4, 0)
        except OSError:
            return None
        if len(b) != self.REC.size + 4 or zlib.crc32(b[:-4]) != struct.unpack("<I", b[-4:])[0]:
            return None
        magic, usage, scanned = self.REC.unpack(b[:-4])
        if magic != self.MAGIC:
            return None
        return usage, scanned

    def put(self, usage: int, scanned: float) -> None:
        b = self.REC.pack(self.MAGIC, int(usage), float(scanned))
        try:
            os.pwrite(self.fd, b + struct.pack("<I", zlib.crc32(b)), 0)
        except OSError:
            pass  # the next reader finds a bad record and rescans
