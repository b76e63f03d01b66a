import os
import shutil
import sys
import uuid

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

    if not shutil.which("gcc"):
        pytest.skip("gcc not found: cannot build the stand-in GPU driver")
    so = str(tmp_path_factory.mktemp("fakegpu") / "fake_gpu_driver.so")
    _build_fake_gpu_driver(so)
    return so


def _build_fake_gpu_driver(out, *defines, soname=None):
    import subprocess

    cmd = [
        "gcc",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-shared",
        "-fPIC",
        "-pthread",
        *defines,
        "-o",
        out,
        os.path.join(os.path.dirname(__file__), "fake_gpu_driver.c"),
    ]
    if soname:
        cmd.insert(1, f"-Wl,-soname,{soname}")
    subprocess.run(cmd, check=True)


@pytest.fixture(scope="session")
def fake_hip_driver_dirs(tmp_path_factory):
    """The stand-in built as the HIP runtime (hip* names only): `loaded/` holds
    libamdhip64.so.6 (1 device), the runtime a process would already have from
    torch; `fresh/` holds libamdhip64.so and libamdhip64.so.7 (3 devices each),
    what a fresh dlopen would find on LD_LIBRARY_PATH."""
    import shutil

    if not shutil.which("gcc"):
        pytest.skip("gcc not found: cannot build the stand-in GPU driver")
    root = tmp_path_factory.mktemp("fakehip")
    loaded, fresh = root / "loaded", root / "fresh"
    loaded.mkdir()
    fresh.mkdir()
    _build_fake_gpu_driver(str(loaded / "libamdhip64.so.6"), "-DFAKE_HIP", soname="libamdhip64.so.6")
    for name in ("libamdhip64.so", "libamdhip64.so.7"):
        _build_fake_gpu_driver(str(fresh / name), "-DFAKE_HIP", "-DFAKE_NDEV=3", soname=name)
    return str(loaded), str(fresh)


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


@pytest.fixture
def shm_dir():
    """A store path on /dev/shm (a tmpfs), removed after the test; skipped
    where /dev/shm is no memory filesystem."""
    from lmcache_fx.core import medium

    if not os.path.isdir("/dev/shm") or not medium.page_cache_fs(["/dev/shm"]):
        pytest.skip("/dev/shm is not a tmpfs here: spares are kept on memory filesystems only")
    d = os.path.join("/dev/shm", f"lmcache-fx-test-{uuid.uuid4().hex}")
    yield os.path.join(d, "store")
    shutil.rmtree(d, ignore_errors=True)
