"""Where a store's files live and what their names mean: the one definition
the store, its scans and the admin tools share.

    <root>/<ab>/<32 hex digest>.fxkv               a chunk (ab = its first two hex digits)
    <root>/<ab>/<digest>.fxkv.tmp.<pid>.<n>.<host>.<seat>
                                                   a write in progress (renamed into place when whole;
                                                   host and seat tags: layout._tags)
    <root>/.tmp.odirect.<pid>.<host>.<seat>        the O_DIRECT probe of a starting store
    <first root>/.fx/store.lock                    the shared ledger and evictor lock
    <first root>/.fx/members                       a POSIX read lock per process with the store open
    <first root>/.fx/roots                         the paths the last opener listed, in its order

With several roots a chunk lies under one of two roots its digest names
(root_choices): a write batch puts each chunk under the one with fewer of the
batch's chunks so far (place_roots), and a lookup tries the first, then the
second. Every open below a root follows no symlink (O_NOFOLLOW on the fan-out directory and
the file), so a planted link cannot redirect the store outside it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import stat
import struct
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Sequence

from .. import _fxio
from .chunkfile import SUFFIX

TMP_MARK = ".tmp."
STALE_TMP_SECONDS = 3600  # a temporary file this old belongs to a dead writer
# A spare (store.py: a removed chunk's file kept for reuse, SPARE_SECONDS at most while its process
# stores) this old belongs to a process that stopped storing (idle, or stopped): any process may
# remove it, or an idle peer's spares hold up to a quarter of the cap each for STALE_TMP_SECONDS.
STALE_SPARE_SECONDS = 300
SPARE_SEQ_MARK = "spare"  # in a spare's name: <digest>.fxkv.tmp.<pid>.spare<seq>.<host tag>.<seat tag>
PID_T_MAX = (1 << 31) - 1  # a temporary's "pid" beyond pid_t (or not positive) is no process's: age decides
LOCK_DIR = ".fx"  # in the first root: shared state; no fan-out directory, so never scanned
LOCK_NAME = os.path.join(LOCK_DIR, "store.lock")  # the shared ledger and evictor lock; never a chunk
# The paths the last process to open the store listed, "<st_dev>:<st_ino> <path>" a line, first to last:
# processes that list them otherwise split the ledger or miss each other's chunks (store._note_roots).
ROOTS_NAME = os.path.join(LOCK_DIR, "roots")
CAP_NAME = os.path.join(LOCK_DIR, "cap")  # the last opener's max_capacity_gb, in bytes
# Two counters (little-endian u64), changed under the store lock: spares kept (by any process), and
# removals of other processes' spares by an evictor; processes compare them with what they last saw.
SPARES_NAME = os.path.join(LOCK_DIR, "spares")
MEMBERS_NAME = os.path.join(LOCK_DIR, "members")  # a read lock per process that has the store open
FLOCK = struct.Struct("@hhqqi4x")  # struct flock (Linux, 64-bit): l_type, l_whence, l_start, l_len, l_pid
# Filesystems whose file locks go to a server or a cluster lock manager: a
# lock per chunk read would cost a round trip there (statfs f_type).
NETWORK_FS_MAGIC = frozenset(
    (
        0x6969,  # NFS
        0x517B,  # SMB
        0xFF534D42,  # CIFS
        0xFE534D42,  # SMB2
        0x65735546,  # FUSE
        0x00C36400,  # CephFS
        0x0BD00BD0,  # Lustre
        0x47504653,  # GPFS
        0x01021997,  # 9P
        0x5346414F,  # AFS
        0x01161970,  # GFS2
        0x7461636F,  # OCFS2
    )
)
DIGEST_HEX = 32
_HEX = frozenset("0123456789abcdef")


def _tags() -> tuple[str, str]:
    """(host tag, seat tag). The host tag names this kernel's pid space (host
    name, boot, pid namespace): temporaries of another node, container or
    boot are never judged by a pid that means nothing here. The seat tag is
    the same without the boot: a temporary of this host name and pid
    namespace under another host tag is one of an earlier boot."""
    host = socket.gethostname()
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""

    def tag(*parts: str) -> str:
        return hashlib.blake2b("|".join(p for p in parts if p).encode(), digest_size=4).hexdigest()

    return tag(host, boot, ns), tag("seat", host, ns) if boot else ""


def _boot_time() -> Optional[float]:
    """When this kernel booted (/proc/stat btime), or None."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


HOST_TAG, SEAT_TAG = _tags()
BOOT_TIME = _boot_time()
# The fields a temporary's name ends with after its pid and sequence number
TMP_TAGS = f"{HOST_TAG}.{SEAT_TAG}" if SEAT_TAG else HOST_TAG


def device_of(path: str) -> Optional[int]:
    """st_dev of a path, or of its nearest existing parent (a store made
    later); None when not even / can be stat-ed."""
    p = os.path.abspath(path)
    while True:
        try:
            return os.stat(p).st_dev
        except OSError:
            parent = os.path.dirname(p)
            if parent == p:
                return None
            p = parent


def devices_under(paths: list[str]) -> int:
    """How many devices (distinct st_dev) the paths lie on, a path not yet
    made counting where its nearest existing parent lies: the store's queue
    depth and staging are per device (ChunkStore, doctor)."""
    devs = {device_of(p) for p in paths} - {None}
    return max(len(devs), 1)


def aliased_root(roots: Sequence[str]) -> Optional[tuple[str, str]]:
    """(a root, the earlier root it is the same directory as) for the first
    root listed twice under two names (a symlink, a bind mount, D and D/),
    else None. Roots that do not exist (yet) are not compared. A store
    refuses such a list: each chunk would be found under both names, taken
    for two copies, and unlinked as the older one."""
    seen: dict[tuple[int, int], str] = {}
    for r in roots:
        try:
            st = os.stat(r)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:
            return r, seen[(st.st_dev, st.st_ino)]
        seen[(st.st_dev, st.st_ino)] = r
    return None


def root_index(nroots: int, digest: str) -> int:
    """The first of the two roots a chunk of this digest may lie under (the
    only one before balanced placement, so older stores' chunks are found
    there first)."""
    return int(digest[:8], 16) % nroots


def root_choices(nroots: int, digest: str) -> tuple[int, int]:
    """The two roots a chunk of this digest may lie under, first choice
    first; one root: it twice."""
    a = root_index(nroots, digest)
    if nroots < 2:
        return a, a
    return a, (a + 1 + int(digest[8:16], 16) % (nroots - 1)) % nroots


def place_roots(nroots: int, digests: list[str], fixed: Optional[list[Optional[int]]] = None) -> list[int]:
    """Roots for a batch of new chunks: each on the one of its two choices
    that holds fewer of the batch so far (the first on a tie; greedy, so close
    to even, not exactly). `fixed`: a root already decided per chunk (where
    it lies), counted first. A digest met twice keeps its first root. A
    request's chunks are written together, so its load reads from every
    device alike: by digest alone, 64 chunks over 8 devices put 1.5x the mean
    on the busiest one, and a device-bound read ends when that one does
    (scripts/stripe_model.py)."""
    counts = [0] * nroots
    out: list[int] = [-1] * len(digests)
    seen: dict[str, int] = {}
    for j, r in enumerate(fixed or ()):
        if r is not None:
            out[j] = seen[digests[j]] = r
            counts[r] += 1
    for j, d in enumerate(digests):
        if out[j] >= 0:
            continue
        r = seen.get(d, -1)
        if r < 0:
            a, b = root_choices(nroots, d)
            r = seen[d] = b if counts[b] < counts[a] else a
        counts[r] += 1
        out[j] = r
    return out


def relative_name(digest: str) -> str:
    """The chunk's name below its root: <ab>/<digest>.fxkv."""
    return f"{digest[:2]}/{digest}{SUFFIX}"


def root_places(nroots: int, digest: str) -> list[int]:
    """The roots a chunk of this digest may lie under, in the order a lookup
    tries them (one with one root)."""
    a, b = root_choices(nroots, digest)
    return [a] if b == a else [a, b]


def paths_for(roots: list[str], digest: str) -> list[str]:
    """Every place a chunk of this digest may lie, in the order a lookup
    tries them (one with one root)."""
    name = relative_name(digest)
    return [os.path.join(roots[r], name) for r in root_places(len(roots), digest)]


def is_fanout_name(name: str) -> bool:
    return len(name) == 2 and _HEX.issuperset(name)


@dataclass
class StoreFile:
    """One entry of a fan-out directory, as a scan sees it."""

    path: str
    root: str
    size: int
    mtime: float
    mtime_ns: int
    ino: int
    kind: str  # chunk | tmp | other
    digest: str = ""
    why: str = ""  # for other: why it does not belong


def classify(name: str, fanout: str) -> tuple[str, str, str]:
    """(kind, digest, why) of a name found in fan-out directory `fanout`."""
    if TMP_MARK in name:
        return "tmp", "", ""
    if name.endswith(SUFFIX) and len(name) == DIGEST_HEX + len(SUFFIX) and _HEX.issuperset(name[:DIGEST_HEX]):
        if name[:2] != fanout:
            return "other", "", f"chunk file in the wrong directory (belongs in {name[:2]}/)"
        return "chunk", name[:DIGEST_HEX], ""
    return "other", "", "not an lmcache-fx file"


def scan_fanout(root: str, sub: str, dfd: Optional[int] = None) -> Iterator[StoreFile]:
    """Every entry of one fan-out directory; a non-regular file is `other`
    (a planted symlink or device is never a chunk). The directory is listed
    through a descriptor opened without following links (`dfd`, or one opened
    here), so a fan-out directory swapped for a symlink is never listed.
    Raises OSError when the directory cannot be listed; entries that vanish
    meanwhile are skipped."""
    fanout = os.path.basename(sub)
    own = dfd is None
    fd = open_dir(sub) if dfd is None else dfd
    try:
        with os.scandir(fd) as it:  # lists a duplicate of dfd; dfd stays open
            for de in it:
                kind, digest, why = classify(de.name, fanout)
                try:
                    st = os.stat(de.name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue  # vanished
                if not stat.S_ISREG(st.st_mode):
                    kind, digest, why = "other", "", "not a regular file (the store ignores it)"
                yield StoreFile(
                    os.path.join(sub, de.name),
                    root,
                    st.st_size,
                    st.st_mtime,
                    st.st_mtime_ns,
                    st.st_ino,
                    kind,
                    digest,
                    why,
                )
    finally:
        if own:
            os.close(fd)


def fanout_dirs(root: str) -> list[str]:
    """The fan-out directories of a root (real directories, not symlinks)."""
    with os.scandir(root) as top:
        return [de.path for de in top if is_fanout_name(de.name) and de.is_dir(follow_symlinks=False)]


def _tmp_fields(name: str) -> list[str]:
    """The dot-separated fields of a temporary's name after the mark:
    <pid>, <seq>, <host tag>, <seat tag> (the O_DIRECT probe's: odirect,
    <pid>, <host tag>, <seat tag>); [] when the name has no mark."""
    return name.split(TMP_MARK, 1)[1].split(".") if TMP_MARK in name else []


def _tmp_writer(name: str) -> Optional[tuple[int, list[str]]]:
    """<digest>.fxkv.tmp.<pid>.<seq>[.<host tag>[.<seat tag>]]: (pid, the fields after
    the mark) when the writer's pid means something here; None when only the
    file's age can judge it (no pid in the name, not a pid that os.kill
    could take (it would overflow, or signal a group), another node's or
    container's pid)."""
    parts = _tmp_fields(name)
    try:
        pid = int(parts[0])
    except (IndexError, ValueError):
        return None
    if not 0 < pid <= PID_T_MAX or (len(parts) >= 3 and parts[2] != HOST_TAG):
        return None
    return pid, parts


def tmp_judged_by_age(name: str) -> bool:
    """Whether a temporary's writer can only be judged by the file's age
    (STALE_TMP_SECONDS): one of another host or container, or with no pid
    in its name; else by whether its pid lives here."""
    return _tmp_writer(name) is None


def _of_an_earlier_boot(name: str, mtime: float) -> bool:
    """Whether a temporary was left by this host and pid namespace before
    this boot (its seat tag ours, its host tag not, older than the boot):
    its writer is gone, as after a crash and restart. Without this, such
    files waited STALE_TMP_SECONDS, counted in the usage. The age check
    keeps a same-named host's live writer safe (network stores)."""
    if not SEAT_TAG or BOOT_TIME is None or mtime >= BOOT_TIME:
        return False
    parts = _tmp_fields(name)  # the host and seat tags are fields 2 and 3 in both forms of name
    return len(parts) >= 4 and parts[2] != HOST_TAG and parts[3] == SEAT_TAG


def tmp_is_spare(name: str) -> bool:
    """Whether a temporary is a spare (a removed chunk's file kept for reuse):
    its process moves it in and out of that name only under the store lock,
    so an evictor holding the lock may remove it (store._walk)."""
    parts = _tmp_fields(name)
    return len(parts) >= 2 and parts[1].startswith(SPARE_SEQ_MARK)


def tmp_is_stale(name: str, mtime: float, now: float) -> bool:
    # Stale when the writer is gone (or a spare, when old)
    writer = _tmp_writer(name)
    if writer is None:
        return _of_an_earlier_boot(name, mtime) or now - mtime > STALE_TMP_SECONDS
    pid, parts = writer
    if pid == os.getpid():
        return False
    if tmp_is_spare(name) and now - mtime > STALE_SPARE_SECONDS:
        return True  # an idle (or stopped) process's spare: its owner finds it gone and counts nothing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    # A live pid may be a recycled one, not the writer: age decides. So a store makes a file it
    # renames to a temporary's name new before it uses it (a reused victim: the write zeroing its
    # header; a spare: a utime).
    return now - mtime > STALE_TMP_SECONDS


def root_problem(root: str, st: os.stat_result, shared_group: bool) -> Optional[str]:
    """Why an existing store directory is refused (the store and doctor agree), or None."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{root!r} is not a directory"
    # Root too: a directory another user controls could hold links that make root write anywhere.
    if st.st_uid != os.geteuid() and not shared_group:
        return (
            f"{root!r} belongs to uid {st.st_uid}, not to this user; use a directory of your own "
            "or set shared_group: true for a store shared by a group"
        )
    if st.st_mode & stat.S_IWOTH:
        return (
            f"{root!r} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}): anyone could plant "
            "chunk files there; use a directory of your own (chmod 700) or a group one with shared_group: true"
        )
    if not os.access(root, os.W_OK | os.X_OK):
        if on_read_only_fs(root):
            return f"{root!r} is on a read-only filesystem; mount it read-write or pick another path"
        return f"{root!r} is not writable by this user; fix its permissions or pick another"
    return None


def on_read_only_fs(path: str) -> bool:
    """Whether `path` lies on a filesystem mounted read-only (EROFS: no
    owner's or root's rights would make it writable); False if unknown."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def takes_writes(path: str) -> bool:
    """Whether a file can be made under directory `path` now, as far as its
    filesystem goes: an unnamed O_TMPFILE made and closed (nothing is left),
    False only on EROFS. A filesystem an error remounted read-only
    (ext4's errors=remount-ro) refuses writes while statvfs may not say so.
    Where O_TMPFILE is not supported, the mount's read-only flag decides."""
    try:
        fd = os.open(path, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.EROFS:
            return False
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return not on_read_only_fs(path)
        return True  # another reason (its mode, say): not a read-only filesystem
    os.close(fd)
    return True


def round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def chunk_digest_of_path(path: str) -> str:
    return os.path.basename(path)[:32]


def root_of_path(path: str) -> str:
    """The root a chunk path <root>/<ab>/<name> lies under."""
    return os.path.dirname(os.path.dirname(path))


def open_dir(path: str) -> int:
    """A fan-out directory, refusing a symlink planted in its place (ELOOP)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def open_in(path: str, flags: int, mode: int = 0o600, lock: bool = False, regular: bool = False) -> int:
    """os.open of <root>/<ab>/<name> that follows no symlink below the root;
    with `lock`, a chunk file opened for reading and read-locked (read_lock).
    `regular`: anything but a regular file there (a FIFO, whose open would
    block until a writer came; a device) raises OSError(ESPIPE or EISDIR),
    as csrc/chunks.c's chunk_open refuses it."""
    dfd = open_dir(os.path.dirname(path))
    try:
        name = os.path.basename(path)
        fd = os.open(name, flags | os.O_NOFOLLOW | (os.O_NONBLOCK if regular else 0), mode, dir_fd=dfd)
        if regular:
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    e = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.ESPIPE
                    raise OSError(e, "not a regular file", path)
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)  # io_uring would answer EAGAIN
            except BaseException:
                os.close(fd)
                raise
        if lock:
            try:
                read_lock(fd, dfd, name)
            except BaseException:
                os.close(fd)
                raise
        return fd
    finally:
        os.close(dfd)


def read_lock(fd: int, dfd: int, name: str) -> None:
    """An OFD read lock on the chunk file open at `fd`, held until it is
    closed (csrc/chunks.c's chunk_lock takes the same), and `name` (in the
    directory `dfd`) checked to still be that file (chunk_lock leaves that to
    the header's key): an evictor rewrites a file only after moving it away
    and taking its write lock, so a locked file whose name still holds it
    cannot change while it is read. Raises OSError(ESTALE) when the file is
    being, or has been, reused."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise OSError(errno.ESTALE, "the chunk file is being reused") from None
        if e.errno != errno.EINVAL:  # no OFD locks: the evictor cannot lock either, so reuses nothing
            raise
    a = os.fstat(fd)
    try:
        b = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        b = None
    if b is None or (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise OSError(errno.ESTALE, "the chunk file was moved away for reuse")


def write_lock(fd: int) -> bool:
    """An OFD write lock on the whole file open (for writing) at `fd`,
    without waiting, held until it is closed: False when a reader holds a
    read lock on it (or the kernel has no OFD locks)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return False
    return True


class FileStat(NamedTuple):
    """What a lookup keeps of a chunk file's lstat (os.stat_result's names)."""

    st_mode: int
    st_size: int
    st_mtime_ns: int
    st_dev: int
    st_ino: int


def stat_many(items: Sequence[tuple[int, str]], stop_at_missing: bool = False) -> list[Optional[FileStat]]:
    """The lstat of each (root descriptor, name below it), no symlink
    followed on the way (as a read opens them), all in one call without the
    GIL: a lookup of many chunks pays a syscall loop in C, not a Python loop
    of opens, stats and closes per chunk. None where absent or refused; with
    `stop_at_missing`, also for every name after the first that is not a
    regular file (not looked at)."""
    return [None if r is None else FileStat(*r) for r in _fxio.stat_beneath(items, stop_at_missing)]


def stat_in(path: str) -> Optional[os.stat_result]:
    """lstat of <root>/<ab>/<name>, following no symlink below the root; None when absent."""
    try:
        dfd = open_dir(os.path.dirname(path))
    except OSError:
        return None
    try:
        return os.stat(os.path.basename(path), dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(dfd)


def unlink_quiet(path: str) -> bool:
    """Removes <root>/<ab>/<name> relative to its directory opened without
    following links: a fan-out directory swapped for a symlink redirects
    nothing."""
    try:
        dfd = open_dir(os.path.dirname(path))
    except OSError:
        return False
    try:
        os.unlink(os.path.basename(path), dir_fd=dfd)
        return True
    except OSError:
        return False
    finally:
        os.close(dfd)


def unlink_if_same(
    path: str,
    ident: Optional[tuple[int, int]] = None,
    mtime_ns: Optional[int] = None,
    dirfds: Optional[dict[str, int]] = None,
) -> Optional[os.stat_result]:
    """Removes <root>/<ab>/<name> only if it is still the file that was
    looked at: the same (st_dev, st_ino) when `ident` is given, not newer than
    `mtime_ns` when that is. lstat and unlink go through one directory
    descriptor opened without following links (kept in `dirfds` when given,
    for the caller to close). Returns the stat of what was removed, or None
    (absent, not a regular file, replaced meanwhile, or cannot be removed)."""
    return _if_same(path, ident, mtime_ns, dirfds, lambda name, dfd: os.unlink(name, dir_fd=dfd))


def rename_if_same(
    path: str,
    mtime_ns: Optional[int],
    dst_dfd: int,
    dst_name: str,
    dirfds: Optional[dict[str, int]] = None,
    ident: Optional[tuple[int, int]] = None,
) -> Optional[os.stat_result]:
    """Moves <root>/<ab>/<name> to dst_name in the directory dst_dfd, with
    the checks of unlink_if_same (a regular file, the same `ident`, not newer
    than mtime_ns). Returns the stat of what was moved, or None (nothing
    moved; EXDEV, another root's filesystem, among the reasons)."""
    return _if_same(
        path, ident, mtime_ns, dirfds, lambda name, dfd: os.rename(name, dst_name, src_dir_fd=dfd, dst_dir_fd=dst_dfd)
    )


def _if_same(path, ident, mtime_ns, dirfds, act) -> Optional[os.stat_result]:
    sub = os.path.dirname(path)
    dfd = dirfds.get(sub) if dirfds is not None else None
    try:
        if dfd is None:
            dfd = open_dir(sub)
            if dirfds is not None:
                dirfds[sub] = dfd
    except OSError:
        return None
    try:
        name = os.path.basename(path)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        if ident is not None and (st.st_dev, st.st_ino) != tuple(ident):
            return None  # another file was renamed into place: not the one that was judged
        if mtime_ns is not None and st.st_mtime_ns > mtime_ns:
            return None
        try:
            act(name, dfd)
        except OSError:
            return None
        return st
    finally:
        if dirfds is None:
            os.close(dfd)


def probe_odirect(directory: str) -> tuple[bool, str]:
    """Whether files in `directory` take O_DIRECT I/O: a 4 KiB write and read
    through an unnamed file (O_TMPFILE), or, where the filesystem has none, an
    exclusive new name opened relative to the directory without following
    links, so nothing planted under any name can redirect the probe. Returns
    (ok, why not)."""
    import mmap

    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # a store root: a link to it is followed
    name = None
    try:
        flags = os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC
        try:
            fd = os.open(".", flags | os.O_TMPFILE, 0o600, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.EINVAL:  # O_DIRECT refused (O_TMPFILE itself fails with EOPNOTSUPP/EISDIR)
                return False, _odirect_why(e)
            name = f"{TMP_MARK}odirect.{os.getpid()}.{TMP_TAGS}"
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
            except OSError as e2:
                if e2.errno != errno.EINVAL:
                    name = None  # not ours: never unlink what another made
                return False, _odirect_why(e2)
        try:
            buf = mmap.mmap(-1, 8192)  # page-aligned, as O_DIRECT needs
            try:
                buf[:4096] = bytes(range(256)) * 16
                w = os.pwritev(fd, [memoryview(buf)[:4096]], 0)
                if w != 4096:
                    return False, f"O_DIRECT write wrote {w} of 4096 bytes"
                r = os.preadv(fd, [memoryview(buf)[4096:]], 0)
                if r != 4096 or buf[4096:] != buf[:4096]:
                    return False, "O_DIRECT read returned other bytes"
            finally:
                buf.close()
        except OSError as e:
            return False, _odirect_why(e)
        finally:
            os.close(fd)
        return True, ""
    finally:
        if name is not None:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass
        os.close(dfd)


def _odirect_why(e: OSError) -> str:
    if e.errno == errno.EINVAL:
        return "the filesystem refuses O_DIRECT (EINVAL; tmpfs before Linux 6.6 and some FUSE filesystems do)"
    return f"O_DIRECT probe failed: {e.strerror}"


def share_fd(fd: int, gid: Optional[int], mode: int) -> None:
    """shared_group: gives a file or directory the store root's group `gid`
    (its creator's primary group may be one the other users are not in; a
    member may chown to it) and `mode` (setgid for a directory), past the
    umask; quietly not where this process may not."""
    try:
        if gid is not None and os.fstat(fd).st_gid != gid:
            os.fchown(fd, -1, gid)
    except OSError:
        pass
    try:
        os.fchmod(fd, mode)
    except OSError:
        pass
