"""XFS on a RAM-backed loop device: a fast, stable stand-in for NVMe that
supports O_DIRECT (tmpfs does not). Root only; used by tests and the bench.
And a tmpfs of one's own, with mount options (huge pages, a size).

    with xfs_loop("4G") as mnt: ...
    with xfs_loop("4G", touch=True) as mnt: ...   # for measurements (see xfs_loop)
    with tmpfs("size=256m,huge=within_size") as mnt: ...
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager

log = logging.getLogger(__name__)


def why_not_available() -> str | None:
    """None when an XFS loop filesystem can be built here, else the reason."""
    if os.geteuid() != 0:
        return "needs root to attach a loop device and mount XFS"
    for tool in ("losetup", "mkfs.xfs", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install xfsprogs util-linux mount)"
    if not os.path.isdir("/dev/shm"):
        return "/dev/shm is missing"
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def _bytes(size) -> int:
    if isinstance(size, int):
        return size
    s = str(size).strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult != 1 else s) * mult)


def image_of(mountpoint: str) -> str:
    """The backing file of the loop device mounted at mountpoint, as the
    kernel names it (with " (deleted)" once the file is unlinked)."""
    with open("/proc/self/mounts") as f:
        dev = next(line.split()[0] for line in f if line.split()[1] == mountpoint)
    with open(f"/sys/block/{os.path.basename(dev)}/loop/backing_file") as f:
        return f.read().strip()


TOUCH_PIECE = 64 << 20


def touch_image(path: str, size: int) -> None:
    """Writes zeros over the whole of a (new) image file, so that every page
    of it is allocated and written before the device is used."""
    zeros = memoryview(bytes(TOUCH_PIECE))
    fd = os.open(path, os.O_WRONLY)

    def fill(off: int) -> None:
        end = min(off + TOUCH_PIECE, size)
        while off < end:
            off += os.pwrite(fd, zeros[: end - off], off)

    try:
        with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            list(pool.map(fill, range(0, size, TOUCH_PIECE)))
    finally:
        os.close(fd)


HUGE = 2 << 20
_image_pages: dict[str, dict] = {}


def _shmem_huge_bytes() -> int:
    """Bytes of tmpfs/shmem held in 2 MiB pages, host-wide."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("ShmemHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _compact_memory() -> None:
    """Asks the kernel to gather free memory into 2 MiB blocks (root)."""
    try:
        with open("/proc/sys/vm/compact_memory", "w") as f:
            f.write("1\n")
    except OSError:
        pass


def image_pages(mountpoint: str) -> dict | None:
    """How the image under an xfs_loop(touch=True) mount is held in memory:
    {"tmpfs": its mount options, "huge_share": the part of the image in
    2 MiB pages}; None for other mounts."""
    return _image_pages.get(mountpoint)


@contextmanager
def xfs_loop(size="2G", mountpoint: str | None = None, touch: bool = False, huge: bool | None = None):
    """Builds XFS on a RAM image, mounts it, yields the mount point, and
    removes everything it made afterwards (only the device it attached).

    touch=True (for measurements) makes a medium as fast at every position:
    - The image lies on a tmpfs of its own mounted huge=always (memory
      compacted first), so it is held in 2 MiB pages. In 4 KiB pages (/dev/shm)
      its speed depended on where the page allocator had put each page: on
      this VM 64 MiB reads of stretches whose pages lay scattered in physical
      memory ran at 4.9-6.6 GB/s, of stretches in runs at 7.1-8.9, of the same
      file in 2 MiB pages at 14.0-15.7 (scripts/image_memory_probe.py), and
      the image's first pages were the scattered ones, so files XFS put at the
      device's start read slower (scripts/loop_position_probe.py
      --image-pages). Where the kernel refuses huge pages, /dev/shm with one
      warning; image_pages() says what the image got. huge=False keeps a
      touched image in /dev/shm (to measure the difference).
    - The image is written through with zeros first and mkfs.xfs told not
      to discard (-K). mkfs discards a device by default, which punches every
      page out of the image, so the first write to each block afterwards pays
      for allocating its page (and, in a VM, for the host faulting it in), not
      a cost of the medium; fallocate after mkfs allocates the pages without
      touching them. scripts/loop_image_probe.py measures the difference."""
    why = why_not_available()
    if why:
        raise RuntimeError(f"XFS loop filesystem unavailable: {why}")
    mnt = mountpoint or tempfile.mkdtemp(prefix="lmcache-fx-xfs-")
    nbytes = _bytes(size)
    dev = None
    mounted = False
    stack = ExitStack()
    img = None
    try:
        image_dir, options = "/dev/shm", None
        if touch if huge is None else huge:
            options = f"size={(nbytes + 2 * HUGE - 1) // HUGE * HUGE},huge=always"
            _compact_memory()
            try:
                image_dir = stack.enter_context(tmpfs(options))
            except RuntimeError as e:
                log.warning("loop image in /dev/shm's 4 KiB pages, whose speed varies by position: %s", e)
                options = None
        img = tempfile.mktemp(prefix="lmcache-fx-", suffix=".img", dir=image_dir)
        with open(img, "wb") as f:
            f.truncate(nbytes)
        if touch:
            huge0 = _shmem_huge_bytes()
            touch_image(img, nbytes)
            share = min(1.0, max(0.0, (_shmem_huge_bytes() - huge0) / nbytes)) if options else 0.0
            if options and share < 0.9:
                log.warning(
                    "loop image only %.0f%% in 2 MiB pages (memory fragmented): its speed will vary by position",
                    100 * share,
                )
            _image_pages[mnt] = {"tmpfs": options or "/dev/shm 4 KiB pages", "huge_share": round(share, 3)}
        dev = _run("losetup", "-f", "--show", img)
        _run("mkfs.xfs", "-q", "-f", *(["-K"] if touch else []), dev)
        os.makedirs(mnt, exist_ok=True)
        _run("mount", dev, mnt)
        mounted = True
        yield mnt
    finally:
        if mounted and subprocess.run(["umount", mnt], capture_output=True, check=False).returncode != 0:
            # Busy (a descriptor still open under it): detach it now, the kernel frees it with the last
            # descriptor. A failed umount would otherwise keep the device and its RAM image for good.
            subprocess.run(["umount", "-l", mnt], check=False)
        if dev:
            subprocess.run(["losetup", "-d", dev], capture_output=True, check=False)  # autoclear if still held
        if img and os.path.exists(img):
            os.unlink(img)
        stack.close()  # the image's own tmpfs, lazily: a busy loop device keeps it until released
        _image_pages.pop(mnt, None)
        if mountpoint is None:
            shutil.rmtree(mnt, ignore_errors=True)


@contextmanager
def tmpfs(options: str):
    """Mounts a tmpfs with `options` on a new temporary directory, yields it,
    and unmounts and removes it afterwards. RuntimeError, saying why, when
    not root or when the kernel refuses the options."""
    if os.geteuid() != 0:
        raise RuntimeError("mounting a tmpfs needs root")
    mnt = tempfile.mkdtemp(prefix="lmcache-fx-tmpfs-")
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", mnt], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"mount -t tmpfs -o {options} refused: {r.stderr.strip()}")
        try:
            yield mnt
        finally:
            subprocess.run(["umount", "-l", mnt], check=False)
    finally:
        os.rmdir(mnt)


def drop_caches() -> bool:
    """Drops the page cache (root); False when it could not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False
