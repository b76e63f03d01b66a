"""`lmcache-fx doctor` reports the GPU path through the same binding the
plugin uses (stand-in driver here): the driver and devices, and a slow path
(staging not page-locked) as a warning with the reason."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doctor_gpu(tmp_path, env_extra, pre=""):
    store = tmp_path / "store"
    store.mkdir(mode=0o700, exist_ok=True)
    code = (
        f"{pre}\n"
        "import json, sys, contextlib, io\n"
        "from lmcache_fx.tools.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    main(['doctor', '--path', {str(store)!r}, '--json'])\n"
        "gpu = [c for c in json.loads(out.getvalue())['checks'] if c['name'] == 'GPU driver'][0]\n"
        "print('RESULT', json.dumps(gpu))\n"
    )
    env = dict(os.environ, **env_extra)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("RESULT ")][0][7:])


def test_doctor_reports_the_gpu_path(tmp_path, fake_gpu_driver_so):
    c = _doctor_gpu(tmp_path, {"LMCACHE_FX_GPU_DRIVER": fake_gpu_driver_so})
    assert c["status"] == "ok", c
    assert "staging page-locked" in c["summary"] and c["data"]["driver"]["devices"] >= 1


def test_doctor_warns_when_gpu_reads_would_be_slow(tmp_path, fake_gpu_driver_so):
    pre = f"import ctypes; ctypes.CDLL({fake_gpu_driver_so!r}, mode=ctypes.RTLD_GLOBAL).fake_gpu_fail_register(1)"
    c = _doctor_gpu(tmp_path, {"LMCACHE_FX_GPU_DRIVER": fake_gpu_driver_so}, pre)
    assert c["status"] == "warn", c
    assert "slow path" in c["summary"] and "not page-locked" in c["summary"]


def test_doctor_without_a_gpu_driver(tmp_path):
    env = {"LMCACHE_FX_GPU_DRIVER": str(tmp_path / "no-such-driver.so")}
    c = _doctor_gpu(tmp_path, env)
    assert c["status"] in ("info", "warn"), c


def test_doctor_warns_of_a_driver_that_sees_no_device(tmp_path):
    """A driver whose init succeeds but sees no device (a container not
    given the GPU, CUDA_VISIBLE_DEVICES="") was dropped as if absent:
    doctor said "no CUDA or ROCm driver here ... fine for tests" (info),
    and direct_to_gpu "no CUDA/ROCm driver found". Both name the driver and
    the missing device now; doctor warns with the visibility fix."""
    import shutil

    import pytest

    if not shutil.which("gcc"):
        pytest.skip("gcc not found: cannot build the stand-in GPU driver")
    from conftest import _build_fake_gpu_driver

    so = str(tmp_path / "fake_gpu_nodev.so")
    _build_fake_gpu_driver(so, "-DFAKE_NDEV=0")
    c = _doctor_gpu(tmp_path, {"LMCACHE_FX_GPU_DRIVER": so})
    assert c["status"] == "warn" and "no usable device" in c["summary"] and so in c["summary"], c
    assert "visible" in c["fix"], c
    code = "from lmcache_fx import gpu; print('RESULT', gpu.direct_to_gpu_problem(0, 'cpu'))"
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=so)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    why = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][0]
    assert "no usable device" in why and so in why, why
