import os
import sys

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")
sys.path.insert(0, os.path.dirname(__file__))

from lmcache_fx.testing import loopfs  # noqa: E402


@pytest.fixture(scope="session")
def xfs_dir():
    """A directory on XFS on a RAM-backed loop device (O_DIRECT works)."""
    why = loopfs.why_not_available()
    if why:
        pytest.skip(f"XFS loop filesystem: {why}")
    with loopfs.xfs_loop("1G") as mnt:
        yield mnt


@pytest.fixture
def xfs_store(xfs_dir, request):
    path = os.path.join(xfs_dir, request.node.name.replace("/", "_")[:80])
    os.makedirs(path)
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def fake_gpu_driver_so(tmp_path_factory):
    """The stand-in GPU driver library (memcpy + a worker thread per stream),
    built from tests/fake_gpu_driver.c; selected with LMCACHE_FX_GPU_DRIVER."""
    import shutil
    import subprocess

    if not shutil.which("gcc"):
        pytest.skip("gcc not found: cannot build the stand-in GPU driver")
    so = str(tmp_path_factory.mktemp("fakegpu") / "fake_gpu_driver.so")
    subprocess.run(["gcc", "-O2", "-Wall", "-shared", "-fPIC", "-pthread", "-o", so,
                    os.path.join(os.path.dirname(__file__), "fake_gpu_driver.c")], check=True)
    return so


@pytest.fixture
def odirect_tmp(tmp_path):
    """tmp_path, skipped when its filesystem refuses O_DIRECT (tmpfs)."""
    p = tmp_path / "probe"
    try:
        fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as e:
        pytest.skip(f"{tmp_path} does not support O_DIRECT: {e.strerror}")
    return tmp_path
