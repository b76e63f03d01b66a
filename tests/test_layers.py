"""The architecture's rules, checked on every run (README: Architecture):
core/ imports neither torch nor LMCache, no import cycles, the operator
commands start without torch or LMCache, ruff and mypy are clean, and the C
core compiles warning-free with -Werror, no C file calling back into itself
through others. Each checker is also shown to fail
on a planted violation, so a green run means something."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "lmcache_fx")
CHECK = os.path.join(ROOT, "scripts", "check_layers.py")
BIN = os.path.dirname(sys.executable)


def _run(*cmd, cwd=ROOT):
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, timeout=600)


def test_layer_rules_hold():
    r = _run(sys.executable, CHECK, PKG)
    assert r.returncode == 0, r.stdout + r.stderr


def test_layer_checker_catches_each_kind_of_violation(tmp_path):
    pkg = tmp_path / "lmcache_fx"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(pkg / "core" / "layout.py", "a") as f:
        f.write("\nimport torch\n")
    with open(pkg / "core" / "options.py", "a") as f:
        f.write("\n\ndef _leak():\n    from ..tools import admin\n")
    with open(pkg / "tools" / "estimate.py", "a") as f:
        f.write("\nimport lmcache\n")
    r = _run(sys.executable, CHECK, str(pkg))
    assert r.returncode == 1
    assert "core/layout.py" in r.stdout and "core imports torch" in r.stdout
    assert "core imports lmcache_fx.tools" in r.stdout
    assert "tools import lmcache at module level" in r.stdout
    assert "import cycle:" in r.stdout  # options -> tools.admin -> ... -> core.options


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{d}"],
        ["stat", "{d}"],
        ["fsck", "{d}"],
        ["gc", "{d}", "--to-gb", "1"],
        ["estimate", "--model", "qwen2.5-32b"],
        ["doctor", "--path", "{d}"],
        ["bench", "--help"],
    ],
)
def test_commands_start_without_torch_or_lmcache(tmp_path, argv):
    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    argv = [a.format(d=d) for a in argv]
    code = (
        "import sys, contextlib, io\n"
        "from lmcache_fx.tools.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'lmcache') if m in sys.modules))\n"
    )
    r = _run(sys.executable, "-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", (argv, r.stdout, r.stderr[-2000:])


def _tool(name):
    exe = os.path.join(BIN, name)
    if not os.path.exists(exe):
        pytest.skip(f"{name} is not installed in this environment (scripts/setup.sh installs it)")
    return exe


def test_ruff_lint_and_format():
    ruff = _tool("ruff")
    paths = ["lmcache_fx", "tests", "scripts", "examples"]
    r = _run(ruff, "check", *paths)
    assert r.returncode == 0, r.stdout[-4000:]
    r = _run(ruff, "format", "--check", *paths)
    assert r.returncode == 0, r.stdout[-4000:]


def test_mypy_core():
    r = _run(_tool("mypy"))  # files and settings: pyproject.toml [tool.mypy]
    assert r.returncode == 0, r.stdout[-4000:]


def _c_flags():
    flags = [
        "-fsyntax-only",
        "-std=gnu11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-missing-field-initializers",
        "-Wno-cast-function-type",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{ROOT}/csrc",
    ]
    if os.path.exists("/usr/include/liburing.h"):
        flags.append("-DFX_HAVE_LIBURING=1")
    return flags


def test_c_core_compiles_warning_free():
    gcc = shutil.which("gcc") or pytest.skip("gcc not found")
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c")))
    assert sources
    bad = []
    for src in sources:
        r = _run(gcc, *_c_flags(), src)
        if r.returncode != 0:
            bad.append(f"{os.path.basename(src)}:\n{r.stderr[-2000:]}")
    assert not bad, "\n".join(bad)


def test_c_warning_check_can_fail(tmp_path):
    gcc = shutil.which("gcc") or pytest.skip("gcc not found")
    src = tmp_path / "unused.c"
    src.write_text("int f(int a) { int unused; return a; }\n")
    assert _run(gcc, *_c_flags(), str(src)).returncode != 0


def _check_layers():
    spec = importlib.util.spec_from_file_location("check_layers", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _c_call_cycles(sources: list[str], objdir) -> list[list[str]]:
    """Compiles each C file to an object and returns the loops among them
    (check_layers.cycles, as for Python imports): A -> B when A uses a
    symbol that B defines (nm)."""
    gcc = shutil.which("gcc") or pytest.skip("gcc not found")
    nm = shutil.which("nm") or pytest.skip("nm not found")
    flags = [f for f in _c_flags() if f != "-fsyntax-only"]
    defined: dict[str, str] = {}
    used: dict[str, set[str]] = {}
    for src in sources:
        name = os.path.basename(src)
        obj = os.path.join(str(objdir), name + ".o")
        r = _run(gcc, *flags, "-fPIC", "-c", src, "-o", obj)
        assert r.returncode == 0, r.stderr[-2000:]
        out = _run(nm, "-P", obj).stdout.split("\n")
        rows = [line.split() for line in out if line.strip()]
        used[name] = {row[0] for row in rows if len(row) > 1 and row[1] == "U"}
        for row in rows:
            if len(row) > 1 and row[1] in "TDBR":
                defined[row[0]] = name
    edges = {a: {defined[s] for s in syms if defined.get(s, a) != a} for a, syms in used.items()}
    return _check_layers().cycles(edges)


def test_c_units_do_not_call_each_other_in_a_loop(tmp_path):
    """Each C file stands above what it calls: none calls, through others,
    back into itself (module.c defines the engine, gpu.c drives it, init.c
    puts the module together)."""
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c")))
    assert _c_call_cycles(sources, tmp_path) == []


def test_c_call_loop_check_can_fail(tmp_path):
    (tmp_path / "a.c").write_text("int b(void);\nint a(void) { return b(); }\n")
    (tmp_path / "b.c").write_text("int a(void);\nint b(void) { return a() + 1; }\n")
    (tmp_path / "c.c").write_text("int a(void);\nint c(void) { return a(); }\n")
    objs = tmp_path / "o"
    objs.mkdir()
    cycles = _c_call_cycles([str(tmp_path / n) for n in ("a.c", "b.c", "c.c")], objs)
    assert [sorted(set(c)) for c in cycles] == [["a.c", "b.c"]]
