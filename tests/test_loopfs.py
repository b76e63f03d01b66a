"""The test helper that builds XFS on a RAM-backed loop device leaves
nothing behind, even when a descriptor under the mount is still open as
it exits (a failed umount used to keep the device and its RAM image)."""

import os
import time

import pytest

from lmcache_fx.testing import loopfs

pytestmark = pytest.mark.skipif(loopfs.why_not_available() is not None, reason=str(loopfs.why_not_available()))


def _mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def test_busy_mount_is_released_when_its_last_descriptor_closes():
    with loopfs.xfs_loop("512M") as mnt:
        img = loopfs.image_of(mnt)
        fd = os.open(os.path.join(mnt, "held"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert not _mounted(mnt)  # detached from the tree at once
        assert not os.path.exists(img.replace(" (deleted)", ""))
    finally:
        os.close(fd)
    end = time.monotonic() + 10
    while any(img.split(" (deleted)")[0] in line for line in os.popen("losetup -a")):
        assert time.monotonic() < end, "loop device still attached after its last descriptor closed"
        time.sleep(0.1)


def test_touched_image_keeps_every_page_after_mkfs():
    """touch=True (the bench's images): the image is written through and
    mkfs.xfs does not discard it, so every page of it is still there when
    the filesystem is mounted; without it mkfs's discard punches the image
    back into holes, whose first write later pays for the page."""
    size = 320 << 20
    with loopfs.xfs_loop(size, touch=True) as mnt:
        st = os.stat(loopfs.image_of(mnt))
        assert st.st_size == size and st.st_blocks * 512 == size
    with loopfs.xfs_loop(size) as mnt:
        assert os.stat(loopfs.image_of(mnt)).st_blocks * 512 < size // 2


def _mount_options(path: str) -> str | None:
    """Options of the mount whose mount point is the longest prefix of path."""
    best, opts = "", None
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mp, _, o = line.split()[:4]
            if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
                best, opts = mp, o
    return opts


def test_touched_image_lies_in_huge_pages_and_its_tmpfs_goes_with_it():
    """touch=True (the bench's medium) puts the image on a tmpfs of its own
    mounted huge=always and reports how much of it got 2 MiB pages (in 4 KiB
    pages its speed varied by position with where each page lay in memory);
    that tmpfs is gone afterwards. huge=False keeps it in /dev/shm."""
    size = 320 << 20
    with loopfs.xfs_loop(size, touch=True) as mnt:
        info = loopfs.image_pages(mnt)
        img = loopfs.image_of(mnt)
        opts = _mount_options(img)
        if info["tmpfs"].startswith("/dev/shm"):
            pytest.skip("the kernel refused a huge=always tmpfs here (the warning says why)")
        assert "huge=always" in opts and not img.startswith("/dev/shm/")
        assert 0.5 < info["huge_share"] <= 1.0, info
        image_dir = os.path.dirname(img)
    assert loopfs.image_pages(mnt) is None
    assert not os.path.exists(image_dir)
    assert _mount_options(image_dir) != opts
    with loopfs.xfs_loop(size, touch=True, huge=False) as mnt:
        assert loopfs.image_of(mnt).startswith("/dev/shm/")
        assert loopfs.image_pages(mnt) == {"tmpfs": "/dev/shm 4 KiB pages", "huge_share": 0.0}
