"""What the filesystem under a store is, and what the store does on it:
memory or disk, loop device or drive, huge pages, locks kept on the client.
Each decision returns why, in words doctor prints."""

from __future__ import annotations

import os

from .. import _fxio
from .layout import NETWORK_FS_MAGIC
from .options import ConfigError


def fs_magics(roots: list[str]) -> set:
    """statfs f_type of each root (those statfs answers for)."""
    import ctypes

    out = set()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        for root in roots:
            buf = ctypes.create_string_buffer(256)
            if libc.statfs(root.encode(), buf) == 0:
                out.add(int.from_bytes(buf.raw[:8], "little"))
    except (OSError, AttributeError):
        pass
    return out


MEMORY_FS_MAGICS = frozenset({0x01021994, 0x858458F6})  # statfs f_type of tmpfs, ramfs


def page_cache_fs(roots: list[str]) -> bool:
    """Whether any root is on tmpfs or ramfs."""
    return bool(fs_magics(roots) & MEMORY_FS_MAGICS)


def mounts_of(roots: list[str], mountinfo: str = "/proc/self/mountinfo") -> list[tuple[int, str, set[str]]]:
    """(device, filesystem type, its mount and superblock options) of each
    mount of the roots' devices, from the mount table; [] when that cannot
    be read."""
    try:
        devs = {os.stat(r).st_dev for r in roots}
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, sup = left.split(), right.split()
        if not sep or len(fields) < 6 or len(sup) < 3:
            continue
        major, _, minor = fields[2].partition(":")
        try:
            dev = os.makedev(int(major), int(minor))
        except ValueError:
            continue
        if dev in devs:
            out.append((dev, sup[0], set(fields[5].split(",")) | set(sup[2].split(","))))
    return out


def huge_page_tmpfs(roots: list[str]) -> bool:
    """Whether every root is on a tmpfs that keeps files in huge pages: mounted
    huge=always or huge=within_size, or every tmpfs forced to (shmem_enabled)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            forced = "[force]" in f.read()
    except OSError:
        forced = False
    try:
        devs = {os.stat(r).st_dev for r in roots}
    except OSError:
        return False
    huge = {
        dev
        for dev, fstype, opts in mounts_of(roots)
        if fstype == "tmpfs" and (forced or "huge=always" in opts or "huge=within_size" in opts)
    }
    return devs <= huge


def decide_mapped_reads(mode: str, roots: list[str]) -> tuple[bool, str]:
    """Whether payloads are copied from file mappings (read_chunks' `mapped`)
    under option mapped_reads = mode, and why (doctor says it): on memory
    filesystems only; by default where their huge pages make the copy from
    a mapping, summed in the same pass, faster than read() then a CRC32C
    (docs/benchmarks.md, "Mapped reads"), on a CPU that copies and sums in
    one pass. ConfigError for `true` off memory filesystems."""
    if mode == "false":
        return False, "mapped_reads: false"
    magics = fs_magics(roots)
    memory = bool(magics) and magics <= MEMORY_FS_MAGICS  # every root on tmpfs or ramfs
    if not memory:
        if mode == "true":
            raise ConfigError(f"mapped_reads: true, but {','.join(roots)!r} is not all on tmpfs or ramfs; use auto")
        return False, "not a memory filesystem"
    if mode == "true":
        return True, "mapped_reads: true"
    # auto also needs the one-pass copy: elsewhere it is a copy and then a sum, as read() then a CRC32C is
    if not _fxio.CRC32C_COPY_ONE_PASS:
        return False, "this CPU has no one-pass copy and sum (AVX-512 VPCLMULQDQ)"
    if not huge_page_tmpfs(roots):
        return False, "a memory filesystem of 4 KiB pages, where read() is faster than a mapping"
    return True, "a tmpfs with huge pages, on a CPU that copies and sums in one pass"


def loop_backed(root: str) -> bool:
    """Whether root lies on a loop device (or a partition of one): its
    /sys/dev/block entry, or its parent's, has a loop/ directory."""
    try:
        dev = os.stat(root).st_dev
    except OSError:
        return False
    sys_dev = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    return os.path.isdir(os.path.join(sys_dev, "loop")) or os.path.isdir(os.path.join(sys_dev, "..", "loop"))


# Under staged_reads auto, a read of at most this many payload bytes lands in
# place and is summed there: a piece or a few have no stream for staging to
# overlap (the loop's copy into a slot while earlier slots are summed and
# copied on), and summed in place while still in cache they cost one copy
# fewer. One-chunk loads awaited on LMCache's loop, in place against staged
# in the same runs (six runs at 2 MiB): p50 0.87-0.98x with 1 in flight,
# 0.75-0.89x with 4, level with 16; process CPU per request 0.73-0.97x; at
# 4 MiB level, CPU 0.80-0.90x; at 8 MiB staging won (in place 1.01-1.43x)
# (docs/benchmarks.md, "Small reads in place").
STAGE_ABOVE_BYTES = 4 << 20


def decide_staged_reads(mode: str, roots: list[str], odirect: bool, verify: bool) -> tuple[bool, str]:
    """Whether checked O_DIRECT payloads go through the engine's staging
    buffers (read_chunks' `stage`) under option staged_reads = mode,
    and why (doctor says it). Only with verify and O_DIRECT (it is how the
    check is taken). By default on loop devices, where the device's transfer
    is a copy on a core and a sum of the bytes in place competes with it for
    memory bandwidth (docs/benchmarks.md, "Staged checked reads"); on drives
    that DMA the data it adds a copy, and is not measured there."""
    if mode == "false":
        return False, "staged_reads: false"
    if not verify:
        return False, "verify: false (staging is how the check is taken)"
    if not odirect:
        return False, "no O_DIRECT (buffered reads from the page cache are staged already)"
    if mode == "true":
        return True, "staged_reads: true"
    if not _fxio.CRC32C_COPY_ONE_PASS:
        return False, "this CPU has no one-pass copy and sum (AVX-512 VPCLMULQDQ)"
    if not all(loop_backed(r) for r in roots):
        return False, "not a loop device (a drive that DMAs the data would pay a copy)"
    return True, (
        f"a loop device, on a CPU that copies and sums in one pass (reads over {STAGE_ABOVE_BYTES >> 20} MiB; "
        "smaller ones land in place)"
    )


def client_local_locks(roots: list[str], mountinfo: str = "/proc/self/mountinfo") -> tuple[str, bool, bool]:
    """Where a root's filesystem keeps file locks on this client only, not
    on its server: (what, POSIX locks local, flock local), or ("", False,
    False). NFS mounted nolock or local_lock=all|posix|flock, Lustre
    localflock. Other hosts then see none of this host's locks: the readers
    an evictor must not rewrite under (Ledger.may_reuse asks .fx/members)
    and the store lock the shared usage is counted under."""
    for _, fstype, opts in mounts_of(roots, mountinfo):
        if fstype.startswith("nfs"):
            posix = bool(opts & {"nolock", "local_lock=all", "local_lock=posix"})
            flock = bool(opts & {"nolock", "local_lock=all", "local_lock=flock"})
            if posix or flock:
                said = sorted(opts & {"nolock", "local_lock=all", "local_lock=posix", "local_lock=flock"})
                return f"{fstype} mounted {','.join(said)}", posix, flock
        elif fstype == "lustre" and "localflock" in opts:
            return "lustre mounted localflock", True, True
    return "", False, False


def locks_reads(roots: list[str]) -> bool:
    """Whether reads take a file lock per chunk (layout.read_lock), which lets
    full stores reuse evicted files with other processes reading: on local
    filesystems. On network and cluster ones (or when statfs cannot tell) a
    lock would be a round trip per read, and reuse needs the store to
    themselves (Ledger.may_reuse)."""
    magics = fs_magics(roots)
    return len(magics) > 0 and not magics & NETWORK_FS_MAGIC
