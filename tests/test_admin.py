"""Operator tools (doctor, ls, stat, fsck, gc, metrics) against a real store
written by the plugin through a real LMCacheEngine, then damaged on purpose."""

import contextlib
import errno
import json
import os
import platform
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
import torch

from lmcache_fx import _fxio
from lmcache_fx.core import metrics
from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest
from lmcache_fx.core.options import GIB, FxOptions
from lmcache_fx.core.store import ChunkStore
from lmcache_fx.testing.cpu_engine import (
    KV,
    Geometry,
    config_from_dict,
    fx_backend,
    fx_config,
    lmcache_engine,
    retrieve,
    store_and_wait,
)
from lmcache_fx.tools.cli import main

MODELS = {
    "org/model-a": (Geometry(layers=4, kv_heads=2, head_dim=64), 1024, 0),  # 4 chunks of 512 KiB + header
    "org/mla-b": (Geometry(layers=3, kv_heads=1, head_dim=576, mla=True), 512, 50000),  # 2 MLA chunks
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tokens(model):
    geo, n, base = MODELS[model]
    return torch.arange(n) + base


@pytest.fixture(scope="module")
def real_store(tmp_path_factory):
    """A store written by the plugin: 4 chunks of one model, 2 of an MLA
    model. Returns (path, {model: [chunk file path in token order]})."""
    d = tmp_path_factory.mktemp("real")
    store = d / "store"
    files = {}
    for model, (geo, n, _) in MODELS.items():
        cfg = config_from_dict(fx_config(store, cpu_gb=0.05), d)
        with lmcache_engine(cfg, geo, model=model) as eng:
            be = fx_backend(eng)
            toks = _tokens(model)
            store_and_wait(eng, toks, KV(geo, n, seed=7), be)
            keys = [k.to_string() for _, _, k in eng.token_database.process_tokens(tokens=toks)]
            files[model] = [be.store.path_for(chunk_digest(k)) for k in keys]
    assert all(os.path.exists(f) for fs in files.values() for f in fs)
    return str(store), files


@pytest.fixture
def store_copy(real_store, tmp_path):
    src, files = real_store
    dst = str(tmp_path / "store")
    shutil.copytree(src, dst)
    # Distinct write times, oldest first in this order: a0 a1 a2 a3 b0 b1.
    order = [f.replace(src, dst) for m in MODELS for f in files[m]]
    now = time.time()
    for i, f in enumerate(order):
        os.utime(f, (now - 3600 * (len(order) - i), now - 3600 * (len(order) - i)))
    return dst, {m: [f.replace(src, dst) for f in fs] for m, fs in files.items()}


def cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_json(capsys, *argv):
    rc, out, err = cli(capsys, *argv, "--json")
    return rc, json.loads(out), err


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


# ---------------------------------------------------------------- help and errors


@pytest.mark.parametrize("cmd", ["doctor", "ls", "stat", "fsck", "gc", "estimate", "bench"])
def test_help_has_examples(capsys, cmd):
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"lmcache-fx {cmd}" in out and "--json" in out


@pytest.mark.parametrize(
    "argv,said",
    [
        (["estimate", "--kv-dtype", "fp7"], "argument --kv-dtype: invalid choice: 'fp7'"),
        (["estimate", "--bogus"], "unrecognized arguments: --bogus"),
        (["bench", "--reps", "x"], "argument --reps: invalid int value: 'x'"),
        (["bench", "--path", "/x", "--bogus"], "unrecognized arguments: --bogus"),
        (["stat", "--bogus"], "unrecognized arguments: --bogus"),
        (["doctor", "--strict", "yes"], "unrecognized arguments: yes"),
        (["gc", "/x"], "the following arguments are required: --to-gb"),
    ],
)
def test_a_wrong_flag_is_one_line_naming_the_command(capsys, argv, said):
    """argparse printed its usage block first: 7 to 12 lines for estimate and
    bench, the error last; a flag unknown to a command was said by
    `lmcache-fx` itself, not naming the command."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"lmcache-fx {argv[0]}: error: {said}") and f"lmcache-fx {argv[0]} --help" in err, err


@pytest.mark.parametrize("argv", [["--bogus"], ["--bogus", "ls", "/tmp"]])
def test_a_wrong_flag_before_the_command_is_the_top_levels(capsys, argv):
    """'lmcache-fx --bogus' printed the help without naming the flag, and
    '--bogus ls' blamed ls for a flag given before it."""
    with pytest.raises(SystemExit) as ei:
        main(argv)
    err = capsys.readouterr().err
    assert ei.value.code == 2 and err == "lmcache-fx: error: unrecognized arguments: --bogus (see lmcache-fx --help)\n"


@pytest.mark.parametrize("cmd", ["ls", "stat", "fsck", "gc"])
def test_wrong_path_is_a_clear_error(capsys, tmp_path, cmd):
    extra = ["--to-gb", "1"] if cmd == "gc" else []
    rc, out, err = cli(capsys, cmd, tmp_path / "nope", *extra)
    assert rc == 2 and "no such directory" in err and str(tmp_path / "nope") in err
    f = tmp_path / "file"
    f.write_text("x")
    rc, obj, err = cli_json(capsys, cmd, f, *extra)
    assert rc == 2 and "not a directory" in obj["error"]
    rc, out, err = cli(capsys, cmd, *extra)
    assert rc == 2 and "no store given" in err
    rc, out, err = cli(capsys, cmd, "--config", tmp_path / "missing.yaml", *extra)
    assert rc == 2 and "no such file" in err


# ---------------------------------------------------------------- ls and stat


def test_ls_lists_every_chunk_with_model_and_geometry(capsys, store_copy):
    path, files = store_copy
    rc, obj, _ = cli_json(capsys, "ls", path)
    assert rc == 0 and obj["total_chunks"] == 6
    chunks = obj["chunks"]
    # Least recently written first: the order the store evicts in.
    assert [c["path"] for c in chunks] == files["org/model-a"] + files["org/mla-b"]
    a = [c for c in chunks if c["model"] == "org/model-a"]
    assert len(a) == 4 and all(
        c["shapes"] == [[2, 4, 256, 128]] and c["dtypes"] == ["bfloat16"] and c["fmt"] == "KV_2LTD" for c in a
    )
    # the plugin records the writer's KV heads x head size (the shape holds only their product)
    assert all(len(c["kv"]) == 2 and c["kv"][0] * c["kv"][1] == 128 for c in a)
    assert all(c["geometry"].endswith(f"KV_2LTD ({c['kv'][0]}x{c['kv'][1]})") for c in a)
    b = [c for c in chunks if c["model"] == "org/mla-b"]
    assert len(b) == 2 and all(c["fmt"] == "KV_MLA_FMT" and c["world_size"] == 1 for c in b)
    assert all(c["size"] == HEADER_SIZE + c["payload_len"] for c in chunks)
    rc, out, _ = cli(capsys, "ls", path, "--model", "org/mla-b")
    assert rc == 0 and out.count("org/mla-b@1@0@") == 2 and "org/model-a" not in out
    assert "2 chunks" in out


def test_stat_summarises_models_geometries_ages_usage(capsys, store_copy):
    path, files = store_copy
    total = sum(os.path.getsize(f) for fs in files.values() for f in fs)
    rc, obj, _ = cli_json(capsys, "stat", path, "--capacity-gb", 10 * total / GIB)
    assert rc == 0
    assert obj["chunks"] == 6 and obj["bytes"] == total and obj["bad_headers"] == 0
    assert {m["model"]: m["chunks"] for m in obj["models"]} == {"org/model-a": 4, "org/mla-b": 2}
    assert len(obj["geometries"]) == 2
    assert abs(obj["usage_fraction"] - 0.1) < 1e-6
    ages = {a["age"]: a["chunks"] for a in obj["ages"]}
    assert ages["1 hour - 1 day"] == 6  # the fixture dated them 1-6 hours ago
    assert obj["filesystems"][path]["free_bytes"] > 0
    rc, out, _ = cli(capsys, "stat", path)
    assert "org/model-a" in out and "KV_MLA_FMT" in out and "capacity:     unknown" in out


def test_ls_and_stat_do_not_take_a_copy_under_another_name_for_a_chunk(capsys, store_copy):
    """A valid chunk copied under another digest's name: the store never
    reads it as that key, fsck calls it bad, but ls listed it as a chunk (two
    entries of one key) and stat counted it under its model."""
    path, files = store_copy
    a = files["org/model-a"]
    d = os.path.basename(a[0])
    other = os.path.join(os.path.dirname(a[0]), d[:2] + "f" * 30 + ".fxkv")
    shutil.copy(a[0], other)
    rc, obj, _ = cli_json(capsys, "ls", path)
    bad = [c for c in obj["chunks"] if c["path"] == other]
    assert rc == 0 and len(bad) == 1 and "belongs in another file" in bad[0]["error"], bad
    assert len({c["key"] for c in obj["chunks"] if "key" in c}) == 6
    rc, obj, _ = cli_json(capsys, "stat", path)
    assert obj["bad_headers"] == 1 and {m["model"]: m["chunks"] for m in obj["models"]}["org/model-a"] == 4


def test_names_and_keys_are_printed_escaped(capsys, store_copy):
    """Names and keys come from whoever wrote the store. A file name with a
    byte that is no UTF-8 stopped fsck's report with a traceback on a UTF-8
    terminal (and --repair had removed files by then); a newline in a name
    forged a report line; a terminal escape in a key reached the terminal.
    Each is printed escaped now, and the report is whole."""
    path, files = store_copy
    sub = os.path.dirname(files["org/model-a"][0])
    odd = os.path.join(os.fsencode(sub), b"bad\xff\nchecked 0 chunks: 0 ok, 0 bad\x1b]0;t\x07")
    with open(odd, "wb") as f:
        f.write(b"x")
    rc, out, err = cli(capsys, "fsck", path)
    assert rc == 0, err
    line = [x for x in out.splitlines() if "bad\\xff" in x]
    assert line == [
        f"FOREIGN    {sub}/bad\\xff\\x0achecked 0 chunks: 0 ok, 0 bad\\x1b]0;t\\x07: not an lmcache-fx file"
    ], out
    assert [x for x in out.splitlines() if x.startswith("checked ")] == [out.splitlines()[-1]] and "\x1b" not in out
    r = subprocess.run(
        [sys.executable, "-m", "lmcache_fx.tools.cli", "fsck", path],
        capture_output=True, env=dict(os.environ, PYTHONIOENCODING="utf-8"), cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and b"Traceback" not in r.stderr and b"checked 6 chunks" in r.stdout, r.stderr[-500:]


def test_fsck_into_a_closed_pipe_keeps_its_status(store_copy):
    """`fsck | head` stopped quietly but exited 0, even where fsck found
    damage: with pipefail a script saw a clean store. The report's status
    stays."""
    path, files = store_copy
    _flip(files["org/model-a"][1], 100)
    sub = os.path.dirname(files["org/model-a"][0])
    for i in range(1500):  # a report longer than the pipe holds: the write meets the closed pipe
        open(os.path.join(sub, f"notes-{i:04d}-" + "x" * 80), "w").close()
    r = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{sys.executable} -m lmcache_fx.tools.cli fsck {path} | head -c 1 >/dev/null"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 4 and not r.stderr, r.stderr


def test_gc_stopped_by_ctrl_c_says_what_it_removed(capsys, store_copy, monkeypatch):
    """Ctrl-C during gc printed a traceback and nothing of what it had
    removed. It stops at that chunk, counts what went off the ledger, says
    so and exits 130."""
    from lmcache_fx.tools import admin

    path, files = store_copy
    order = files["org/model-a"] + files["org/mla-b"]
    st = ChunkStore(FxOptions(path=path, io_engine="threads", max_capacity_gb=1))
    real, calls = admin.Remover.remove, []

    def remove(self, *a, **kw):
        calls.append(a[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(admin.Remover, "remove", remove)
    try:
        rc, out, err = cli(capsys, "gc", path, "--to-gb", 0)
        assert rc == 130 and "Traceback" not in err
        assert out.startswith("removed 2 of 6 chunks") and "interrupted: stopped before the target" in out, out
        assert not any(os.path.exists(f) for f in order[:2]) and all(os.path.exists(f) for f in order[2:])
        assert _ledger_usage(st) == st._walk(remove_stale=False)[1]
    finally:
        st.close()


def test_gc_stopped_by_sigterm_says_what_it_removed(store_copy):
    """SIGTERM (`timeout`, `kill`) or SIGHUP ended gc at once: nothing said
    of what it had removed, and its subtraction from the ledger left to the
    stores' recount. It stops as on Ctrl-C: says so, exits 143."""
    path, files = store_copy
    order = files["org/model-a"] + files["org/mla-b"]
    st = ChunkStore(FxOptions(path=path, io_engine="threads", max_capacity_gb=1))
    script = (
        "import os, signal, sys\n"
        "from lmcache_fx.tools import admin, cli\n"
        "real, calls = admin.Remover.remove, []\n"
        "def remove(self, *a, **kw):\n"
        "    calls.append(a[0])\n"
        "    if len(calls) == 3:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(self, *a, **kw)\n"
        "admin.Remover.remove = remove\n"
        "cli.console(sys.argv[1:])\n"
    )
    try:
        r = subprocess.run(
            [sys.executable, "-c", script, "gc", path, "--to-gb", "0"],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
        assert r.returncode == 128 + signal.SIGTERM and "Traceback" not in r.stderr, (r.returncode, r.stderr)
        assert r.stdout.startswith("removed 2 of 6 chunks"), r.stdout
        assert "interrupted: stopped before the target" in r.stdout, r.stdout
        assert not any(os.path.exists(f) for f in order[:2]) and all(os.path.exists(f) for f in order[2:])
        assert _ledger_usage(st) == st._walk(remove_stale=False)[1]
    finally:
        st.close()


def test_gc_under_nohup_ignores_the_hangup_as_before(store_copy):
    """gc, fsck, ls and stat take SIGHUP as a Ctrl-C; one started with it
    ignored (nohup) stopped on a hangup all the same. It stays ignored."""
    path, files = store_copy
    script = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does\n"
        "from lmcache_fx.tools import admin, cli\n"
        "real, calls = admin.Remover.remove, []\n"
        "def remove(self, *a, **kw):\n"
        "    calls.append(a[0])\n"
        "    if len(calls) == 3:\n"
        "        os.kill(os.getpid(), signal.SIGHUP)\n"
        "    return real(self, *a, **kw)\n"
        "admin.Remover.remove = remove\n"
        "cli.console(sys.argv[1:])\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, "gc", path, "--to-gb", "0"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith("removed 6 of 6 chunks"), (r.returncode, r.stdout, r.stderr)


# ---------------------------------------------------------------- fsck


def test_fsck_clean_store(capsys, store_copy):
    path, files = store_copy
    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 0, obj
    assert obj["checked"] == obj["ok"] == 6 and obj["bad"] == 0 and not obj["problems"]
    assert obj["bytes_verified"] == sum(os.path.getsize(f) for fs in files.values() for f in fs)
    assert obj["engine"] == ("io_uring" if _fxio.io_uring_status()[0] else "threads")
    # Small batches: many batches in flight one after another give the same answer.
    rc, obj2, _ = cli_json(capsys, "fsck", path, "--buffer-mb", 1, "--io-engine", "threads")
    assert rc == 0 and obj2["ok"] == 6 and obj2["engine"] == "threads"


def test_fsck_finds_and_repairs_damage_then_the_plugin_reads_the_rest(capsys, store_copy, tmp_path):
    path, files = store_copy
    a, b = files["org/model-a"], files["org/mla-b"]
    _flip(a[1], 100)  # header bit
    _flip(a[3], HEADER_SIZE + 5000)  # payload bit
    os.truncate(b[1], os.path.getsize(b[1]) - 4096)  # truncated
    sub = os.path.dirname(a[0])
    empty = os.path.join(sub, os.path.basename(sub) + "0" * 30 + ".fxkv")
    open(empty, "w").close()  # an empty chunk file
    other = os.path.join(sub, os.path.basename(sub) + "1" * 30 + ".fxkv")
    shutil.copy(a[0], other)  # a valid chunk under another key's name
    stale = a[0] + ".tmp.999999999.1"  # a temporary of a dead writer
    open(stale, "w").write("partial")
    live = a[0] + f".tmp.{os.getpid()}.7"  # a temporary of a live writer
    open(live, "w").write("partial")
    # Another host's, container's or boot's (its tag is not this one's), fresh: its writer cannot be
    # checked from here. It was reported as one of "running writers".
    elsewhere = a[0] + ".tmp.4242.3.0123abcd"
    open(elsewhere, "w").write("partial")
    foreign = os.path.join(sub, "notes.txt")
    open(foreign, "w").write("hello")

    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 4
    probs = {p["path"]: p for p in obj["problems"]}
    assert "header checksum mismatch" in probs[a[1]]["problem"]
    assert "payload checksum mismatch" in probs[a[3]]["problem"]
    assert "truncated" in probs[b[1]]["problem"]
    assert "shorter than the 4096-byte header" in probs[empty]["problem"]
    assert "belongs in another file" in probs[other]["problem"]
    assert probs[stale]["kind"] == "stale-tmp" and probs[foreign]["kind"] == "foreign"
    assert live not in probs and elsewhere not in probs
    assert obj["live_temporaries"] == 2 and obj["temporaries_judged_by_age"] == 1
    assert obj["ok"] == 3 and obj["bad"] == 5
    rc, out, _ = cli(capsys, "fsck", path)
    assert "run again with --repair" in out and "BAD" in out
    assert "1 temporaries of writers running here" in out
    assert "1 temporaries of writers of another host, container or boot" in out and "1 h old" in out

    rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
    assert rc == 1
    for p in (a[1], a[3], b[1], empty, other, stale):
        assert not os.path.exists(p), p
    for p in (a[0], a[2], b[0], live, foreign):
        assert os.path.exists(p), p
    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 0 and obj["ok"] == 3  # the foreign file is reported, not an error
    os.unlink(live)

    # The store the plugin finds afterwards: model-a serves its first chunk, and nothing is corrupt.
    geo, n, _ = MODELS["org/model-a"]
    cfg = config_from_dict(fx_config(path, cpu_gb=0.05), tmp_path)
    kv = KV(geo, n, seed=7)
    with lmcache_engine(cfg, geo, model="org/model-a") as eng:
        be = fx_backend(eng)
        got = kv.empty_like()
        assert retrieve(eng, _tokens("org/model-a"), got) == 256
        assert kv.tokens_equal(got, 256)
        assert be.store.stats.corrupt == 0


def test_fsck_misplaced_when_striped_and_version(capsys, store_copy, tmp_path):
    """Checked as a store striped over more paths, a chunk is misplaced
    where neither of its two roots (paths_for) is the path it lies under:
    with two paths never, with more some: exactly those."""
    from lmcache_fx.core.layout import paths_for

    path, files = store_copy
    extra = []
    for i in range(3):
        extra.append(str(tmp_path / f"p{i}"))
        os.mkdir(extra[-1])
    chunks = [f for fs in files.values() for f in fs]
    seen = 0
    for more in (1, 2, 3):
        roots = [path] + extra[:more]
        rc, obj, _ = cli_json(capsys, "fsck", ",".join(roots))
        mis = sorted(p["path"] for p in obj["problems"] if p["kind"] == "misplaced")
        want = sorted(f for f in chunks if f not in paths_for(roots, os.path.basename(f)[: -len(".fxkv")]))
        assert rc == 0 and mis == want, (more, mis, want)
        assert more > 1 or not mis  # two roots: every chunk may lie under either
        seen += len(mis)
    assert seen > 0


# ---------------------------------------------------------------- gc


def test_gc_evicts_least_recently_written_first(capsys, store_copy):
    path, files = store_copy
    order = files["org/model-a"] + files["org/mla-b"]
    sizes = [os.path.getsize(f) for f in order]
    keep = sum(sizes[3:])  # room for the newest three
    rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", keep / GIB, "--dry-run")
    assert rc == 0 and obj["removed_chunks"] == 3 and all(os.path.exists(f) for f in order)
    assert [r["path"] for r in obj["removed"]] == order[:3]
    rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", keep / GIB)
    assert rc == 0 and obj["after_bytes"] == keep and obj["freed_bytes"] == sum(sizes[:3])
    assert [os.path.exists(f) for f in order] == [False] * 3 + [True] * 3
    rc, out, _ = cli(capsys, "gc", path, "--to-gb", 0)
    assert rc == 0 and "removed 3 of 3 chunks" in out
    # The plugin's own scan agrees: nothing left.
    st = ChunkStore(FxOptions(path=path, io_engine="threads"))
    assert len(st) == 0 and st.usage_bytes == 0
    st.close()


# ---------------------------------------------------------------- config in admin commands


def test_admin_commands_take_the_path_from_the_lmcache_yaml(capsys, store_copy, tmp_path):
    path, _ = store_copy
    import yaml

    y = tmp_path / "lmcache.yaml"
    y.write_text(yaml.safe_dump(fx_config(path, max_capacity_gb=1)))
    rc, obj, _ = cli_json(capsys, "stat", "--config", y)
    assert rc == 0 and obj["paths"] == [path] and obj["capacity_bytes"] == GIB and obj["chunks"] == 6
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(fx_config(path, queue_dept=3)))
    rc, out, err = cli(capsys, "ls", "--config", bad)
    assert rc == 2 and "did you mean 'storage_plugin.fx.queue_depth'" in err


# ---------------------------------------------------------------- doctor


def _fast_path_expected(path):
    from lmcache_fx.tools.doctor import probe_odirect

    return _fxio.io_uring_status()[0] and probe_odirect(path)[0]


def test_doctor_space_counts_striped_paths_on_one_filesystem_together(tmp_path):
    """With two paths on one filesystem, doctor compared each with half the
    capacity as if each had that filesystem's free space to itself: a
    capacity twice the free space passed as OK, and writes would meet
    ENOSPC before eviction."""
    from lmcache_fx.core.options import FxOptions
    from lmcache_fx.tools.doctor import check_path

    a, b = tmp_path / "a", tmp_path / "b"
    st = os.statvfs(tmp_path)
    free_gib = st.f_bavail * st.f_frsize / (1 << 30)
    opts = FxOptions.from_mapping({"path": f"{a},{b}", "max_capacity_gb": 1.5 * free_gib})
    space = [c for c in check_path(str(a), opts, "") if c.name == "space"]
    assert len(space) == 1 and space[0].status == "warn", space
    assert "x 2 of them on this filesystem" in space[0].summary
    said = float(space[0].fix.rpartition("below ")[2])  # three digits: free space moves meanwhile
    assert abs(said - free_gib * 0.95) <= 0.01 * free_gib, space[0].fix
    # The chunks under every path on the filesystem are room the store takes back, not only this path's:
    # 0.5 x free in each (sparse files), capacity 1.8 x free, fits in free + both.
    for i, root in enumerate((a, b)):
        (root / "ab").mkdir(parents=True)
        with open(root / "ab" / f"ab{i:030x}.fxkv", "wb") as f:
            f.truncate(int(0.5 * free_gib * (1 << 30)))
    opts = FxOptions.from_mapping({"path": f"{a},{b}", "max_capacity_gb": 1.8 * free_gib})
    space = [c for c in check_path(str(a), opts, "") if c.name == "space"]
    assert space[0].status == "ok" and space[0].data["store_bytes"] >= free_gib * (1 << 30) * 0.99, space


def test_ls_limit_below_zero_is_refused(capsys, store_copy):
    """--limit -1 listed every chunk, as 0 does, without a word."""
    path, _ = store_copy
    with pytest.raises(SystemExit) as e:
        cli(capsys, "ls", path, "--limit", "-1")
    assert e.value.code == 2 and "give 0 (all) or a positive count" in capsys.readouterr().err


def test_doctor_on_a_real_store(capsys, store_copy):
    path, _ = store_copy
    rc, obj, _ = cli_json(capsys, "doctor", "--path", path)
    checks = {c["name"]: c for c in obj["checks"]}
    for name in ("io_uring", "engine", "path", "O_DIRECT", "space", "memlock", "huge pages", "GPU driver", "LMCache"):
        assert name in checks, name
    assert "kernel.io_uring_disabled" in checks["io_uring"]["summary"]
    assert checks["LMCache"]["data"]["version"].startswith("0.5")
    expected = _fast_path_expected(path)
    assert obj["fast_path"] == expected and rc == (0 if expected else 1)
    assert checks["space"]["data"]["store_bytes"] > 0  # it counted the store's chunks
    if checks["O_DIRECT"]["status"] == "ok":  # the store's choice of staged reads, with its reason
        from lmcache_fx.core.medium import decide_staged_reads

        staged, why = decide_staged_reads("auto", [path], True, True)
        assert checks["staged reads"]["data"] == {"staged_reads": staged} and why in checks["staged reads"]["summary"]
    assert not [f for f in os.listdir(path) if ".tmp." in f]  # the probe is gone
    rc, out, _ = cli(capsys, "doctor", "--path", path)
    assert ("fast path will be used" in out) == expected


def test_a_store_path_that_is_a_link_to_a_directory_is_followed(capsys, store_copy, tmp_path):
    """A store path that is a symlink to the real directory (a mount moved
    behind a stable name): every tool followed it, but the store refused it
    with a bare NotADirectoryError and doctor died with a traceback. The
    link is followed, as the tools do; below the root no link is."""
    path, files = store_copy
    link = str(tmp_path / "link")
    os.symlink(path, link)
    rc, obj, _ = cli_json(capsys, "doctor", "--path", link)
    checks = {c["name"]: c for c in obj["checks"]}
    assert checks["path"]["status"] == "ok" and checks["O_DIRECT"]["status"] in ("ok", "fail"), checks
    st = ChunkStore(FxOptions(path=link, io_engine="threads", max_capacity_gb=1))
    try:
        assert len(st) == 6 and st.lookup([k for k in _keys(files)]) == [True] * 6
    finally:
        st.close()


def _keys(files):
    from lmcache_fx.core.chunkfile import decode_header

    out = []
    for fs in files.values():
        for f in fs:
            with open(f, "rb") as fh:
                out.append(decode_header(fh.read(HEADER_SIZE)).key)
    return out


@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_doctor_fails_a_lock_file_the_store_would_refuse(capsys, store_copy, tmp_path, kind, monkeypatch):
    """.fx/store.lock made a directory, a link or a FIFO: the plugin refuses
    to start on it ("... not a regular file; remove it"), while doctor said
    the fast path would be used. It fails the check and says to remove it;
    gc no longer blames the user it runs as."""
    path, _ = store_copy
    spaced = os.path.join(os.path.dirname(path), "my store")  # the fix named "rm -r .../my" once
    os.rename(path, spaced)
    path = spaced
    lock = os.path.join(path, ".fx", "store.lock")
    os.unlink(lock)
    if kind == "directory":
        os.mkdir(lock)
    elif kind == "symlink":
        os.symlink(str(tmp_path / "elsewhere"), lock)
    else:
        os.mkfifo(lock)
    rc, obj, _ = cli_json(capsys, "doctor", "--path", path)
    checks = {c["name"]: c for c in obj["checks"]}
    assert rc == 1 and checks["lock file"]["status"] == "fail", checks.get("lock file")
    assert checks["lock file"]["summary"].startswith(f"{lock} is not a regular file")
    assert checks["lock file"]["fix"] == f"remove it (rm -r '{lock}')"
    # For a FIFO as well: one that may not write the lock file opened it read-only, and a FIFO's
    # read-only open waited for a writer for good (fsck and gc hung); RDWR refused, below.
    real_open = os.open

    def no_write_access(p, flags, *a, **kw):
        if p == "store.lock" and flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied")
        return real_open(p, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_write_access)
    rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", 0)
    assert rc == 1 and obj["failed"][0]["error"] == f"the store's lock file {lock} is not a regular file (remove it)"
    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 0 and obj["bad"] == 0, obj


def test_devices_under_counts_filesystems_not_paths(tmp_path):
    """Two directories on one filesystem are one device; a path not made yet
    counts where its nearest parent lies; /dev/shm beside tmp_path is a
    second one."""
    from lmcache_fx.core.layout import devices_under

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    assert devices_under([str(a), str(b / "not" / "yet")]) == 1
    if os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:
        assert devices_under([str(a), "/dev/shm/fx-not-made"]) == 2


@pytest.mark.skipif(not _fxio.io_uring_status()[0], reason="io_uring unusable here")
def test_doctor_builds_the_engine_with_a_queue_per_device(capsys, tmp_path):
    """doctor builds the engine as the store will: for a path list over two
    devices, queue_depth for each (2 x 32 = 64), and says so; one device
    keeps queue_depth."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a device of its own beside tmp_path")
    other = os.path.join(shm, f"fx-doctor-{os.getpid()}")
    try:
        qd = FxOptions().queue_depth
        _, obj, _ = cli_json(capsys, "doctor", "--path", f"{tmp_path / 's'},{other}")
        eng = next(c for c in obj["checks"] if c["name"].endswith("engine"))
        assert eng["data"]["devices"] == 2 and eng["data"]["queue_depth"] == 2 * qd, eng
        assert f"queue_depth {2 * qd} ({qd} for each of 2 devices)" in eng["summary"]
        _, obj, _ = cli_json(capsys, "doctor", "--path", str(tmp_path / "one"))
        eng = next(c for c in obj["checks"] if c["name"].endswith("engine"))
        assert eng["data"]["devices"] == 1 and eng["data"]["queue_depth"] == FxOptions().queue_depth
        from lmcache_fx.core.drive import usable_cpus

        cpus = usable_cpus()  # awaited_concurrency auto, resolved
        assert eng["data"]["awaited_concurrency"] == cpus and f"{cpus} awaited reads at once" in eng["summary"]
    finally:
        shutil.rmtree(other, ignore_errors=True)


@pytest.mark.skipif(not _fxio.io_uring_status()[0], reason="io_uring unusable here")
def test_doctor_says_a_large_pool_is_not_registered_where_rings_cannot_share_it(monkeypatch):
    """Where the kernel cannot clone one ring's fixed buffers into another
    (the no_clone fault point stands in for a kernel before 6.12), the
    fixed-buffers check says LMCache's pool over 256 MiB will not be
    registered, why, and what would register it; a pool under that, or a
    kernel that clones, gets no such line."""
    from lmcache_fx.tools import doctor

    big = 8 << 30
    monkeypatch.setenv("LMCACHE_FX_FAULT", "no_clone:1000")  # armed by the Engine the check makes
    fixed = [c for c in doctor.check_memlock(big) if c.name == "fixed buffers"]
    small = [c for c in doctor.check_memlock(64 << 20) if c.name == "fixed buffers"]
    monkeypatch.delenv("LMCACHE_FX_FAULT")
    plain = [c for c in doctor.check_memlock(big) if c.name == "fixed buffers"]
    assert len(fixed) == 1 and len(small) == 1 and len(plain) == 1
    if fixed[0].data["result"] == 0 and "memlock limit" not in fixed[0].summary:  # where the pool could register
        assert fixed[0].data["rings_share_registration"] is False, fixed
        assert fixed[0].status == "info" and "8.0 GiB is not registered" in fixed[0].summary, fixed
        assert "6.12" in fixed[0].fix, fixed
        assert "not registered" not in small[0].summary, small
        if plain[0].data["rings_share_registration"]:
            assert plain[0].status == "ok" and "not registered" not in plain[0].summary, plain


def test_doctor_checks_the_plugin_config(capsys, tmp_path):
    import yaml

    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({**fx_config(tmp_path / "s", max_capacity_gb=1), "max_local_cpu_size": 1}))
    rc, obj, _ = cli_json(capsys, "doctor", "--config", good)
    checks = {c["name"]: c for c in obj["checks"]}
    assert checks["[fx] plugin"]["status"] == "ok" and checks["[fx] path"]["status"] == "ok"
    assert not os.path.exists(tmp_path / "s")  # doctor creates nothing
    assert rc == (0 if _fast_path_expected(str(tmp_path)) else 1)

    bad = tmp_path / "bad.yaml"
    d = fx_config(tmp_path / "s", split_bytes=5000)
    d["extra_config"]["storage_plugin.fy.module_path"] = "lmcache_fx.lmcache_plugin"
    bad.write_text(yaml.safe_dump(d))
    rc, out, _ = cli(capsys, "doctor", "--config", bad)
    assert rc == 1
    assert "[FAIL] [fx] plugin" in out and "not a multiple of 4096" in out
    assert "storage_plugins does not list 'fy'" in out
    assert "fast path will NOT be used" in out

    wrongmod = tmp_path / "wrongmod.yaml"
    d = fx_config(tmp_path / "s")
    d["extra_config"]["storage_plugin.fx.module_path"] = "lmcache_fx.plugin"
    wrongmod.write_text(yaml.safe_dump(d))
    rc, obj, _ = cli_json(capsys, "doctor", "--config", wrongmod)
    assert rc == 1 and any("cannot load lmcache_fx.plugin" in c["summary"] for c in obj["checks"])

    f = tmp_path / "afile"
    f.write_text("x")
    notdir = tmp_path / "notdir.yaml"
    notdir.write_text(yaml.safe_dump(fx_config(f)))
    rc, obj, _ = cli_json(capsys, "doctor", "--config", notdir)
    assert rc == 1 and {c["name"]: c for c in obj["checks"]}["[fx] path"]["status"] == "fail"

    rc, out, err = cli(capsys, "doctor", "--config", tmp_path / "missing.yaml")
    assert rc == 2 and "no such file" in err


def test_doctor_names_each_entry_and_what_lmcache_would_log(capsys, tmp_path):
    """fx in both plugin lists was labelled [fx] twice; a remote entry that
    fails was said to make LMCache log 'Failed to create backend', which it
    logs for storage_plugins only; and a failing entry's space was checked
    against the default capacity it never asked for."""
    import yaml

    d = fx_config(tmp_path / "local")
    d["remote_storage_plugins"] = ["fx"]
    d["extra_config"].update(
        {
            "remote_storage_plugin.fx.module_path": "lmcache_fx.remote_plugin",
            "remote_storage_plugin.fx.class_name": "FxRemoteConnector",
            "remote_storage_plugin.fx.path": str(tmp_path / "remote"),
            "remote_storage_plugin.fx.max_capacity_gb": "10GB",
        }
    )
    y = tmp_path / "both.yaml"
    y.write_text(yaml.safe_dump(d))
    rc, obj, _ = cli_json(capsys, "doctor", "--config", y)
    checks = {c["name"]: c for c in obj["checks"]}
    assert checks["[storage_plugin.fx] plugin"]["status"] == "ok"
    bad = checks["[remote_storage_plugin.fx] plugin"]
    assert bad["status"] == "fail" and "Failed to initialize/re-establish remote connection" in bad["summary"]
    assert "Failed to create backend" not in bad["summary"] and "'10GB'" in bad["summary"]
    assert "[remote_storage_plugin.fx] path" in checks and "[remote_storage_plugin.fx] space" not in checks
    assert "[storage_plugin.fx] space" in checks and rc == 1


def test_doctor_says_when_lmcache_extra_config_replaced_the_plugin_keys(capsys, tmp_path, monkeypatch):
    """LMCache takes LMCACHE_EXTRA_CONFIG for the whole extra_config: the
    YAML's plugin keys are gone. doctor said the YAML lists no lmcache-fx
    plugin, and that its fix was to add the keys the YAML already has."""
    import yaml

    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump(fx_config(tmp_path / "s")))
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", '{"storage_plugin.fx.max_capacity_gb": 5}')
    rc, obj, _ = cli_json(capsys, "doctor", "--config", y)
    fails = [c for c in obj["checks"] if c["status"] == "fail"]
    assert rc == 1 and len(fails) == 1 and "LMCACHE_EXTRA_CONFIG is set" in fails[0]["summary"], fails
    assert "in LMCACHE_EXTRA_CONFIG too, or unset it" in fails[0]["fix"]
    # A YAML that never named fx: the variable is not to blame
    d = fx_config(tmp_path / "s")
    d["extra_config"] = {"some_other_key": 1}
    del d["storage_plugins"]
    y.write_text(yaml.safe_dump(d))
    rc, obj, _ = cli_json(capsys, "doctor", "--config", y)
    fails = [c for c in obj["checks"] if c["status"] == "fail"]
    assert rc == 1 and len(fails) == 1 and "LMCACHE_EXTRA_CONFIG" not in fails[0]["summary"], fails


def test_doctor_checks_the_directory_meant(capsys, tmp_path, monkeypatch):
    """--path '$VAR/fx' was made absolute before $VAR was expanded (the
    working directory prefixed to it); and a plugin that failed on its path
    had its path checked at the default, ~/.cache/lmcache-fx, reported OK."""
    import yaml

    monkeypatch.setenv("FX_DOCTOR_TOP", str(tmp_path))
    (tmp_path / "fx").mkdir()
    rc, obj, _ = cli_json(capsys, "doctor", "--path", "$FX_DOCTOR_TOP/fx")
    paths = [c for c in obj["checks"] if c["name"] == "path"]
    assert len(paths) == 1 and paths[0]["summary"].startswith(f"{tmp_path}/fx on "), paths
    y = tmp_path / "rel.yaml"
    y.write_text(yaml.safe_dump(fx_config("relstore")))
    rc, obj, _ = cli_json(capsys, "doctor", "--config", y)
    names = {c["name"]: c for c in obj["checks"]}
    assert rc == 1 and "is relative" in names["[fx] plugin"]["summary"]
    assert "[fx] path" not in names and "[fx] O_DIRECT" not in names, sorted(names)


def test_doctor_says_to_free_space_where_no_capacity_would_fit(capsys, tmp_path):
    """On a filesystem with less than a MiB free, the fix said "set
    max_capacity_gb below 0", which the option refuses."""
    import subprocess

    import yaml

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        with open(mnt / "filler", "wb") as f:  # fill it
            with contextlib.suppress(OSError):
                f.write(b"x" * (1 << 20))
        y = tmp_path / "c.yaml"
        y.write_text(yaml.safe_dump(fx_config(mnt / "store", max_capacity_gb=1)))
        rc, obj, _ = cli_json(capsys, "doctor", "--config", y)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
    space = {c["name"]: c for c in obj["checks"]}["[fx] space"]
    assert space["status"] == "warn" and "below 0" not in space["fix"], space
    assert space["fix"].startswith(f"free space on {mnt}/store's filesystem"), space


SECCOMP_DOCTOR = textwrap.dedent("""
    import ctypes, struct, sys
    # A seccomp filter answering io_uring_setup (425) with EPERM, like Docker's default profile.
    def ins(code, jt, jf, k): return struct.pack("HBBI", code, jt, jf, k)
    prog = (ins(0x20, 0, 0, 0)                      # ld [nr]
            + ins(0x15, 0, 1, 425)                  # jeq 425
            + ins(0x06, 0, 0, 0x00050000 | 1)       # ret ERRNO(EPERM)
            + ins(0x06, 0, 0, 0x7fff0000))          # ret ALLOW
    buf = ctypes.create_string_buffer(prog)
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fp = Fprog(len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0          # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(fp), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER
    from lmcache_fx.tools.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter uses x86_64 syscall numbers")
def test_doctor_says_what_a_memory_store_reads_with(capsys, tmp_path):
    """A store on a tmpfs: doctor says whether reads copy from mappings
    (mapped_reads) and, on 4 KiB pages, which mount would read faster; a
    disk directory gets no such line; mapped_reads: true off memory is a
    failure that names the key and the fix. As root, the hint's remount is
    carried out on a tmpfs of our own, and the same check then says the
    reads are mapped (where the CPU has the one-pass copy)."""
    from lmcache_fx.core.medium import huge_page_tmpfs
    from lmcache_fx.testing.loopfs import tmpfs
    from lmcache_fx.tools.common import fs_info
    from lmcache_fx.tools.doctor import check_memory_fs

    shm = os.path.join("/dev/shm", f"fx-doctor-{os.getpid()}")
    os.makedirs(shm)
    try:
        rc, obj, _ = cli_json(capsys, "doctor", "--path", shm)
        checks = {c["name"]: c for c in obj["checks"]}
        c = checks["memory fs"]
        if huge_page_tmpfs([shm]):  # a host that forces huge pages on every tmpfs
            assert c["data"]["mapped_reads"] == bool(_fxio.CRC32C_COPY_ONE_PASS)
        else:
            assert c["status"] == "info" and "4 KiB pages" in c["summary"] and not c["data"]["mapped_reads"]
            assert "huge=within_size" in c["fix"]
            rc, out, _ = cli(capsys, "doctor", "--path", shm)
            assert "hint: mount -t tmpfs" in out
    finally:
        os.rmdir(shm)
    disk = tmp_path / "s"
    disk.mkdir()
    if fs_info(str(disk))["fstype"] not in ("tmpfs", "ramfs"):
        rc, obj, _ = cli_json(capsys, "doctor", "--path", disk)
        assert "memory fs" not in {c["name"] for c in obj["checks"]}
        bad = check_memory_fs(str(disk), fs_info(str(disk)), FxOptions(path=str(disk), mapped_reads="true"), "")
        assert bad.status == "fail" and "mapped_reads: true" in bad.summary and "auto" in bad.fix
    if os.geteuid() != 0:
        return  # the remount below needs root
    with contextlib.ExitStack() as stack:
        try:
            mnt = stack.enter_context(tmpfs("size=16m"))
        except RuntimeError as e:
            pytest.skip(f"could not mount a tmpfs ({e})")
        opts = FxOptions(path=mnt)
        if huge_page_tmpfs([mnt]):
            pytest.skip("this host forces huge pages on every tmpfs: no 4 KiB-page tmpfs to remount")
        before = check_memory_fs(mnt, fs_info(mnt), opts, "")
        assert before.status == "info" and "remount,huge=within_size" in before.fix
        remount = before.fix.split("(or, for files written from then on: ")[1].rstrip(")")
        assert subprocess.run(remount.split()).returncode == 0, remount
        after = check_memory_fs(mnt, fs_info(mnt), opts, "")
        assert after.data["mapped_reads"] == bool(_fxio.CRC32C_COPY_ONE_PASS)
        assert after.status == ("ok" if _fxio.CRC32C_COPY_ONE_PASS else "info")


def test_doctor_explains_io_uring_blocked_by_seccomp(tmp_path):
    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring is not usable here to begin with")
    env = dict(os.environ, PYTHONPATH=ROOT, LMCACHE_TRACK_USAGE="false")
    env.pop("LMCACHE_CONFIG_FILE", None)

    def doctor(*args):
        r = subprocess.run(
            [sys.executable, "-c", SECCOMP_DOCTOR, "doctor", "--path", str(tmp_path), "--json", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        # The plugin's own fallback warning came first on stderr, bare, before doctor's table.
        assert "io_uring unavailable" not in r.stderr, r.stderr
        return r.returncode, json.loads(r.stdout)

    rc, obj = doctor()
    checks = {c["name"]: c for c in obj["checks"]}
    assert rc == 1 and checks["io_uring"]["status"] == "fail"
    assert "seccomp filter blocks io_uring_setup" in checks["io_uring"]["summary"]
    assert "seccomp" in checks["io_uring"]["fix"]
    assert checks["engine"]["status"] == "fail" and checks["engine"]["data"]["engine"] == "threads"
    # With io_engine: threads configured, the thread engine is the fast path asked for.
    import yaml

    y = tmp_path / "threads.yaml"
    y.write_text(yaml.safe_dump(fx_config(tmp_path / "s", io_engine="threads")))
    r = subprocess.run(
        [sys.executable, "-c", SECCOMP_DOCTOR, "doctor", "--config", str(y), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    obj = json.loads(r.stdout)
    checks = {c["name"]: c for c in obj["checks"]}
    assert checks["io_uring"]["status"] == "info" and checks["[fx] engine"]["status"] == "info"
    assert r.returncode == (0 if _fast_path_expected(str(tmp_path)) else 1)


# ---------------------------------------------------------------- metrics


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_from_a_real_store(store_copy):
    path, files = store_copy
    from prometheus_client import REGISTRY, generate_latest

    store = ChunkStore(FxOptions(path=path, max_capacity_gb=1))
    keys = []
    for f in files["org/model-a"][:2]:
        with open(f, "rb") as fh:
            from lmcache_fx.core.chunkfile import decode_header

            keys.append(decode_header(fh.read(HEADER_SIZE)).key)
    bufs = []

    def allocate(meta):
        b = _fxio.HostBuffer(256 * 4 * 2 * 128 * 2, hugepages=False)
        bufs.append(b)
        return b, b.address, len(b)

    got = store.read(keys + ["org/model-a@1@0@dead@bfloat16"], allocate, lambda h: None)
    assert got[0] is not None and got[1] is not None and got[2] is None
    port = _free_port()
    h = metrics.start_metrics(store, name="fxtest", port=port, addr="127.0.0.1")
    h2 = metrics.start_metrics(lambda: {"hits": 5, "path": "/other"}, name="fxother", port=port, addr="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        lab = f'path="{path}",store="fxtest"'
        assert f"lmcache_fx_read_chunks_total{{{lab}}} 2.0" in body
        assert f"lmcache_fx_hits_total{{{lab}}} 2.0" in body
        assert f"lmcache_fx_misses_total{{{lab}}} 1.0" in body
        assert f"lmcache_fx_chunks{{{lab}}} 6.0" in body
        assert f"lmcache_fx_awaited_running{{{lab}}} 0.0" in body  # no awaited read in flight
        assert f"lmcache_fx_awaited_waiting{{{lab}}} 0.0" in body
        assert 'lmcache_fx_engine_info{engine="' in body and f'odirect="{str(store.odirect).lower()}"' in body
        assert 'lmcache_fx_hits_total{path="/other",store="fxother"} 5.0' in body  # two stores, one port
        # LMCache's own /metrics serves the global registry: the store is there too.
        assert f"lmcache_fx_read_bytes_total{{{lab}}}" in generate_latest(REGISTRY).decode()
    finally:
        h.close()
        h2.close()
        store.close()
    assert "fxtest" not in generate_latest(REGISTRY).decode()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_metrics_histogram_and_bandwidth_from_a_snapshot():
    counts = [0] * (len(metrics.READ_LATENCY_BUCKETS) + 1)
    for s in (0.0004, 0.003, 0.003, 20.0):
        counts[metrics.latency_bucket(s)] += 1
    snap = {
        "bytes_read": 4 << 30,
        "read_seconds": 2.0,
        "read_batches": 4,
        "read_latency_counts": counts,
        "engine": "io_uring",
        "path": "/p",
    }
    text = metrics.render(lambda: snap, name="x")
    assert 'lmcache_fx_read_batch_seconds_bucket{le="0.0005",path="/p",store="x"} 1.0' in text
    assert 'lmcache_fx_read_batch_seconds_bucket{le="0.005",path="/p",store="x"} 3.0' in text
    assert 'lmcache_fx_read_batch_seconds_bucket{le="+Inf",path="/p",store="x"} 4.0' in text
    assert 'lmcache_fx_read_bandwidth_bytes_per_second{path="/p",store="x"} 2.147483648e+09' in text
    assert "lmcache_fx_read_batches_total" in text
    # A port already taken is logged, never raised: metrics must not stop the cache.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        h = metrics.start_metrics(lambda: snap, name="y", port=s.getsockname()[1], addr="127.0.0.1")
        assert h.port == 0
        h.close()


@pytest.mark.skipif(
    "metrics_port" not in FxOptions.names(),
    reason="the plugin does not start metrics yet (metrics_port option not wired in)",
)
def test_plugin_exports_metrics_on_its_port(tmp_path):
    geo, n, _ = MODELS["org/model-a"]
    port = _free_port()
    cfg = config_from_dict(fx_config(tmp_path / "store", cpu_gb=0.05, metrics_port=port), tmp_path)
    toks = _tokens("org/model-a")
    kv = KV(geo, n, seed=1)
    with lmcache_engine(cfg, geo, model="org/model-a") as eng:
        be = fx_backend(eng)
        store_and_wait(eng, toks, kv, be)
        assert retrieve(eng, toks, kv.empty_like()) == n
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        lab = f'path="{tmp_path / "store"}",store="fx"'
        assert f"lmcache_fx_read_chunks_total{{{lab}}} 4.0" in body
        assert f"lmcache_fx_written_chunks_total{{{lab}}} 4.0" in body
        assert f"lmcache_fx_read_batch_seconds_count{{{lab}}} 1.0" in body
        assert 'lmcache_fx_engine_info{engine="' in body
    with pytest.raises(OSError):  # closed with the engine
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_doctor_warns_where_file_locks_stay_on_this_host(capsys, tmp_path, monkeypatch):
    """A store path on NFS mounted nolock (a mount table in the kernel's
    format that says so): doctor warns that the store cannot be shared
    between hosts, says what is given up and how to mount it; a path on a
    mount with server-side locks gets no such line."""
    from lmcache_fx.core import medium
    from lmcache_fx.tools import doctor

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from faults import fxfault as F

    path = tmp_path / "s"
    path.mkdir()
    real = medium.client_local_locks
    for options, warned in (("rw,vers=3,nolock", True), ("rw,vers=4.2,local_lock=none", False)):
        table = F.mount_table(tmp_path, str(path), "nfs", options)
        monkeypatch.setattr(doctor, "client_local_locks", lambda roots, t=table: real(roots, t))
        rc, obj, _ = cli_json(capsys, "doctor", "--path", path)
        checks = {c["name"]: c for c in obj["checks"]}
        assert ("file locks" in checks) == warned, options
        if warned:
            c = checks["file locks"]
            assert c["status"] == "warn" and "nfs mounted nolock" in c["summary"]
            assert "evicted files are not reused" in c["summary"] and "counted per host" in c["summary"]
            assert "without nolock" in c["fix"] and c["data"]["posix_locks_local"] is True


# ---------------------------------------------------------------- removals beside running stores


def _fx():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from faults import fxfault as F

    return F


def _ledger_usage(store):
    with store._ledger.hold():
        return store._ledger.get()[0]


def _after_scan(monkeypatch, fn):
    """admin.scan, then fn(): a change made between the listing and what follows it."""
    from lmcache_fx.tools import admin

    real = admin.scan

    def scan_then(roots):
        sc = real(roots)
        fn()
        return sc

    monkeypatch.setattr(admin, "scan", scan_then)


def _running_store(store_copy):
    """(path, chunk files oldest first, a store open on them whose ledger counts them all)."""
    path, files = store_copy
    order = files["org/model-a"] + files["org/mla-b"]
    st = ChunkStore(FxOptions(path=path, io_engine="threads", max_capacity_gb=1))
    assert _ledger_usage(st) == sum(os.path.getsize(f) for f in order)
    return path, order, st


def test_gc_takes_what_it_removes_off_a_running_stores_usage(capsys, store_copy):
    """gc beside a running store: the bytes it removes come off the shared
    ledger at once, so the store does not go on evicting as if still full."""
    path, order, st = _running_store(store_copy)
    try:
        keep = sum(os.path.getsize(f) for f in order[3:])
        rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", keep / GIB)
        assert rc == 0 and obj["removed_chunks"] == 3
        assert _ledger_usage(st) == keep == st._walk(remove_stale=False)[1]
    finally:
        st.close()


def test_gc_of_planted_files_keeps_the_usage_at_what_is_left(capsys, store_copy):
    """Chunk-named files planted since the ledger's last recount were never
    counted; gc took their sizes off it anyway, the count fell below the
    files (to 0 in the repro) and a running store then stored past its cap
    until its next recount, five minutes on. gc now marks the count for a
    recount, which the store's next write makes."""
    path, order, st = _running_store(store_copy)
    try:
        planted = []
        for i in range(4):  # 1 MiB each, older than every chunk: gc's first victims
            d = "%032x" % (0xABC0 + i)
            p = os.path.join(path, d[:2], d + ".fxkv")
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(b"x" * (1 << 20))
            os.utime(p, (1, 1))
            planted.append(p)
        keep = sum(os.path.getsize(f) for f in order[1:])
        rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", keep / GIB)
        assert rc == 0 and obj["removed_chunks"] == 5, obj
        assert not any(os.path.exists(p) for p in planted)
        assert st._recompute_due()
        F = _fx()
        src = F.Chunks()
        assert st.write([src.item("org/model-a@1@0@new@half", 8192)]) == [True]
        assert _ledger_usage(st) == keep + HEADER_SIZE + 8192 == st._walk(remove_stale=False)[1]
    finally:
        st.close()


def test_gc_that_never_reaches_its_close_still_leaves_a_recount_asked(capsys, store_copy, monkeypatch):
    """gc asked for the recount that mends its subtraction of files the
    ledger never counted only in close(): a gc killed (SIGTERM, a timeout)
    or kept from the lock before it left the ledger below the files until
    the stores' periodic rescan. The first subtraction asks for it."""
    from lmcache_fx.tools import admin

    path, order, st = _running_store(store_copy)
    try:
        d = "%032x" % 0xABCD
        p = os.path.join(path, d[:2], d + ".fxkv")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:  # never counted, older than every chunk: gc's first victim
            f.write(b"x" * (1 << 20))
        os.utime(p, (1, 1))
        real_close = admin.Remover.close

        def killed_before_its_end(self):  # what is left of close() when gc dies first: the lock let go
            self.removed_bytes = 0
            real_close(self)

        monkeypatch.setattr(admin.Remover, "close", killed_before_its_end)
        keep = sum(os.path.getsize(f) for f in order[1:])
        rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", keep / GIB)
        monkeypatch.undo()
        assert obj["removed_chunks"] == 2 and not os.path.exists(p), obj
        assert st._recompute_due()  # asked for: the store's next write recounts
        src = _fx().Chunks()  # kept: the write reads from its buffer
        assert st.write([src.item("org/model-a@1@0@new@recount", 8192)]) == [True]
        assert _ledger_usage(st) == keep + HEADER_SIZE + 8192 == st._walk(remove_stale=False)[1]
    finally:
        st.close()


def test_gc_beside_a_store_that_evicts_keeps_the_count_exact(capsys, store_copy, monkeypatch):
    """A store evicting a chunk gc has listed but not reached takes it off
    the count itself; gc's first fix (never below what its listing held)
    then put it back, the count above the files until a recount."""
    path, files = store_copy
    order = files["org/model-a"] + files["org/mla-b"]
    st = ChunkStore(FxOptions(path=path, io_engine="threads", max_capacity_gb=1))
    try:
        gone = order[4]  # listed, not among gc's victims: evicted by the store meanwhile

        def evicted_meanwhile():
            size = os.path.getsize(gone)
            os.unlink(gone)
            with st._ledger.hold():
                st._ledger.add(-size)

        _after_scan(monkeypatch, evicted_meanwhile)
        keep = sum(os.path.getsize(f) for f in order[2:] if f != gone)
        rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", (keep + os.path.getsize(order[5])) / GIB)
        assert rc == 0 and obj["removed_chunks"] == 2, obj
        assert _ledger_usage(st) == st._walk(remove_stale=False)[1]
    finally:
        st.close()


def test_gc_leaves_waiting_stores_their_turn_at_the_lock(store_copy):
    """gc's removals hold the store lock 0.1 s at a time, and took it again
    at once: a store of another process waiting for it (trying every 50 ms
    at the most) almost never got it, and a long removal made stores give up
    after their 5 s (16 stores skipped in the review's repro). Between holds
    the lock is now free longer than a waiter's pause between tries."""
    from lmcache_fx.tools import admin

    path, _ = store_copy
    waiter = textwrap.dedent(
        f"""
        import json, time
        from lmcache_fx.core.ledger import Ledger
        led, waits = Ledger.join({path!r}), []
        time.sleep(0.5)
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            t0 = time.monotonic()
            with led.hold(timeout=3.0):
                waits.append(time.monotonic() - t0)
            time.sleep(0.05)
        print(json.dumps(waits))
        """
    )
    child = subprocess.Popen([sys.executable, "-c", waiter], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    rm = admin.Remover([path], {})  # no directory is the listing's: each removal fails, under the lock
    try:
        while child.poll() is None:
            rm.remove(os.path.join(path, "ab", "x.fxkv"), 0)
    finally:
        rm.close()
    out = child.communicate(timeout=30)[0]
    assert child.returncode == 0
    waits = json.loads(out)
    assert len(waits) >= 5 and max(waits) < 1.0, waits


def test_ls_and_stat_skip_a_chunk_evicted_during_the_listing(capsys, store_copy, monkeypatch):
    """A chunk a running store evicted between the listing and its header's
    read was shown by ls as BAD ('no longer there') and counted by stat as
    a bad header ('run fsck'), where fsck finds nothing wrong. It is
    skipped, as fsck skips it."""
    path, files = store_copy
    gone = files["org/model-a"][1]
    for command in ("ls", "stat"):
        _after_scan(monkeypatch, lambda: os.path.exists(gone) and os.unlink(gone))
        rc, obj, _ = cli_json(capsys, command, path)
        monkeypatch.undo()
        assert rc == 0, obj
        if command == "ls":
            assert gone not in [c["path"] for c in obj["chunks"]] and not [c for c in obj["chunks"] if "error" in c]
        else:
            assert obj["bad_headers"] == 0, obj
    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 0 and obj["bad"] == 0, obj


def test_fsck_repair_leaves_what_it_removes_for_the_store_to_recount(capsys, store_copy):
    """fsck --repair beside a running store: a bad chunk and a dead writer's
    temporary (its reservation counted, as a writer that died leaves it) are
    removed, their bytes left in the ledger (an overcount, never under), and
    the store's own recount takes them off."""
    path, files = store_copy
    a = files["org/model-a"]
    st = ChunkStore(FxOptions(path=path, io_engine="threads", max_capacity_gb=1))
    try:
        _flip(a[3], HEADER_SIZE + 5000)
        stale = a[0] + ".tmp.999999999.1"
        with open(stale, "wb") as f:
            f.write(b"x" * 8192)
        with st._ledger.hold():
            rec = st._ledger.get()
            st._ledger.put(rec[0] + 8192, rec[1])
        before = _ledger_usage(st)
        rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
        assert rc == 1, obj
        assert not os.path.exists(a[3]) and not os.path.exists(stale)
        bad = {p["path"]: p for p in obj["problems"]}[a[3]]
        truth = st._walk(remove_stale=False)[1]
        assert _ledger_usage(st) == before == truth + 8192 + bad["size"]
        with st._ledger.hold():
            assert st._rescan_locked() == truth
        assert _ledger_usage(st) == truth
    finally:
        st.close()


def _written_store(tmp_path, sizes: list) -> str:
    """A store under tmp_path holding one chunk of each payload size (keys
    m@1@0@h<i>@half, written by the store itself, closed); its path."""
    F = _fx()
    path = str(tmp_path / "store")
    st = F.open_store(path, max_capacity_gb=1, io_engine="threads")
    src = F.Chunks()
    try:
        assert all(st.write([src.item(f"m@1@0@h{i}@half", n) for i, n in enumerate(sizes)]))
    finally:
        st.close()
    return path


def test_fsck_repair_of_a_file_the_ledger_never_counted_leaves_it_at_or_above_the_truth(capsys, tmp_path):
    """A chunk-named garbage file planted beside a running store after it
    counted its bytes: --repair removes it and the ledger stays at least
    what the files hold, so running stores cannot pass their cap. Before,
    its bytes came off the ledger, 1 MiB below the truth."""
    F = _fx()
    path = str(tmp_path / "store")
    st = F.open_store(path, max_capacity_gb=1, io_engine="threads")
    src = F.Chunks()
    try:
        assert all(st.write([src.item(f"m@1@0@h{i}@half", 65536) for i in range(4)]))
        before = _ledger_usage(st)
        os.makedirs(os.path.join(path, "ab"), 0o700, exist_ok=True)
        planted = os.path.join(path, "ab", "ab" + "0" * 30 + ".fxkv")
        with open(planted, "wb") as f:
            f.write(os.urandom(1 << 20))
        rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
        assert rc == 1 and not os.path.exists(planted), obj
        assert _ledger_usage(st) >= st._walk(remove_stale=False)[1] == before
    finally:
        st.close()


def test_removals_wait_for_the_store_lock(capsys, store_copy, monkeypatch):
    """While another process holds the store lock (past its bounded wait),
    gc and fsck --repair remove nothing and say why; once it is free, they do."""
    import fcntl

    from lmcache_fx.core import ledger

    path, files = store_copy
    a = files["org/model-a"]
    _flip(a[1], 100)
    monkeypatch.setattr(ledger, "LOCK_TIMEOUT", 0.2)
    fd = os.open(os.path.join(path, ".fx", "store.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
        assert rc == 4 and os.path.exists(a[1])
        bad = [p for p in obj["problems"] if p["kind"] == "bad"]
        assert len(bad) == 1 and not bad[0]["removed"] and "store lock" in bad[0]["note"]
        rc, out, _ = cli(capsys, "gc", path, "--to-gb", 0)
        assert rc == 1 and "store lock" in out
        assert all(os.path.exists(f) for fs in files.values() for f in fs)
    finally:
        os.close(fd)
    rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", 0)
    assert rc == 0 and obj["removed_chunks"] == 6
    assert not any(os.path.exists(f) for fs in files.values() for f in fs)


def test_gc_is_not_redirected_by_a_fanout_directory_swapped_for_a_link(capsys, store_copy, tmp_path, monkeypatch):
    """A fan-out directory swapped for a symlink to another store after gc's
    listing: gc removes nothing there (it removes relative to the directory
    it listed, opened without following links)."""
    path, files = store_copy
    other = str(tmp_path / "other")
    shutil.copytree(path, other)
    victim = files["org/model-a"][0]
    sub = os.path.dirname(victim)
    theirs = os.path.join(other, os.path.basename(sub), os.path.basename(victim))

    def swap():
        os.rename(sub, sub + ".moved")
        os.symlink(os.path.dirname(theirs), sub)

    _after_scan(monkeypatch, swap)
    rc, obj, _ = cli_json(capsys, "gc", path, "--to-gb", 0)
    assert os.path.exists(theirs) and len(_fx().chunk_files(other)) == 6
    assert rc == 1 and [x["path"] for x in obj["failed"]] == [victim]


def test_fsck_repair_rejudges_a_temporary_at_removal(capsys, store_copy, monkeypatch):
    """A temporary stale when listed (a live pid's, two hours old: as an
    evicted file just renamed to a writer's temporary) that its writer has
    written to since: --repair judges it again from a fresh stat and keeps it."""
    from lmcache_fx.core.layout import HOST_TAG

    path, files = store_copy
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        tmp = f"{files['org/model-a'][0]}.tmp.{writer.pid}.1.{HOST_TAG}"
        with open(tmp, "wb") as f:
            f.write(b"x" * 4096)
        old = time.time() - 7200
        os.utime(tmp, (old, old))
        _after_scan(monkeypatch, lambda: os.utime(tmp))  # the writer's first write
        rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
        assert os.path.exists(tmp)
        p = {p["path"]: p for p in obj["problems"]}[tmp]
        assert not p["removed"] and "live writer" in p["note"]
    finally:
        writer.kill()
        writer.wait()


def test_fsck_repair_leaves_a_bad_chunk_written_anew_since_it_was_judged(capsys, store_copy, monkeypatch):
    """fsck judged a chunk bad; a server then found it bad too, removed it
    and stored the chunk anew, and the new file got the same inode number
    (ext4 reuses a freed one at once): --repair, matching only device and
    inode, removed the new, good chunk. It now also matches the inode's
    change time. Here the judged file is written over in place with the
    good bytes (the same inode, as a store reusing an evicted file writes
    into it): left alone, and read whole after."""
    from lmcache_fx.tools import admin

    path, files = store_copy
    victim = files["org/model-a"][2]
    with open(victim, "rb") as f:
        good = f.read()
    _flip(victim, HEADER_SIZE + 777)
    real = admin._remove

    def written_anew_first(roots, sc, todo):
        time.sleep(0.01)  # past the coarsest timestamp granularity a filesystem may keep
        with open(victim, "r+b") as f:  # the same inode, its bytes good again
            f.write(good)
        return real(roots, sc, todo)

    monkeypatch.setattr(admin, "_remove", written_anew_first)
    rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
    p = {p["path"]: p for p in obj["problems"]}[victim]
    assert p["kind"] == "bad" and not p["removed"] and "changed since it was checked" in p["note"], p
    monkeypatch.undo()
    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 0 and obj["bad"] == 0 and os.path.exists(victim), obj


def test_fsck_reports_read_errors_and_never_removes_on_them(capsys, store_copy, monkeypatch):
    """A read that fails (EAGAIN past the retries, from the engine's fault
    point) or an open that fails (EMFILE) is not a bad chunk: reported as
    unreadable, exit status 4, never removed (the store keeps such files)."""
    from lmcache_fx.tools import verify

    path, files = store_copy
    every = [f for fs in files.values() for f in fs]
    monkeypatch.setenv("LMCACHE_FX_FAULT", "eagain:1000000")
    rc, obj, _ = cli_json(capsys, "fsck", path, "--repair", "--io-engine", "threads")
    monkeypatch.delenv("LMCACHE_FX_FAULT")
    assert rc == 4 and obj["bad"] == 0 and obj["unreadable"] == 6, obj
    assert all(not p["removed"] for p in obj["problems"])
    assert all(os.path.exists(f) for f in every)

    real = verify.open_in

    def emfile(p, *a, **kw):
        if p == every[2]:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real(p, *a, **kw)

    monkeypatch.setattr(verify, "open_in", emfile)
    rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
    assert rc == 4 and obj["ok"] == 5 and obj["bad"] == 0 and os.path.exists(every[2]), obj
    assert [p["kind"] for p in obj["problems"]] == ["unreadable"]
    monkeypatch.undo()
    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 0 and obj["ok"] == 6


def test_fsck_judges_the_file_it_opened_not_the_listing(capsys, tmp_path, monkeypatch):
    """A chunk replaced after fsck's listing by a whole chunk of the same key
    and another size is verified as the file it opened: ok, and kept."""
    F = _fx()
    path = str(tmp_path / "store")
    key = "m@1@0@00000000000000aa@bfloat16"
    st = F.open_store(path, max_capacity_gb=1, io_engine="threads")
    src = F.Chunks()
    try:
        assert st.write([src.item(key, 65536)]) == [True]

        def replace():
            st.remove(key)
            assert st.write([src.item(key, 131072)]) == [True]

        _after_scan(monkeypatch, replace)
        rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
        assert rc == 0 and obj["ok"] == 1 and not obj["problems"], obj
        assert F.read_check(st, [key])[:2] == (1, 0)
    finally:
        st.close()


def test_a_fifo_in_a_chunks_place_blocks_no_command(capsys, store_copy, monkeypatch):
    """A chunk file swapped for a FIFO after the listing: ls, stat and fsck
    open it without blocking (O_NONBLOCK), call it unreadable, remove nothing."""
    import signal

    path, files = store_copy
    victim = files["org/mla-b"][0]
    with open(victim, "rb") as f:
        whole = f.read()

    def fifo():
        os.unlink(victim)
        os.mkfifo(victim)

    def run(*argv):
        if stat.S_ISFIFO(os.lstat(victim).st_mode):  # a regular file again for the listing
            os.unlink(victim)
            with open(victim, "wb") as f:
                f.write(whole)
        signal.alarm(20)
        try:
            return cli_json(capsys, *argv)
        finally:
            signal.alarm(0)

    def hung(*_):
        raise TimeoutError("blocked in open() of a FIFO")

    _after_scan(monkeypatch, fifo)
    old = signal.signal(signal.SIGALRM, hung)
    try:
        rc, obj, _ = run("ls", path)
        assert rc == 0 and obj["total_chunks"] == 6
        assert "not a regular file" in {c["path"]: c for c in obj["chunks"]}[victim]["error"]
        rc, obj, _ = run("stat", path)
        assert rc == 0 and obj["chunks"] == 6
        rc, obj, _ = run("fsck", path, "--repair")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert rc == 4 and obj["ok"] == 5 and obj["unreadable"] == 1
    assert stat.S_ISFIFO(os.lstat(victim).st_mode)


def test_fsck_repair_removes_only_the_stores_own_temporaries(capsys, store_copy, tmp_path):
    """Old files with `.tmp.` in their names that the store never makes (a
    user's notes in a wrong directory, one in a fan-out directory) and a
    directory are left alone, and a wrong directory is still called one;
    an old O_DIRECT probe of a store is removed."""
    old = time.time() - 7200
    wrong = tmp_path / "notastore"
    wrong.mkdir()
    (wrong / ".tmp.notes").write_text("my notes")
    (wrong / ".tmp.cache").mkdir()
    (wrong / "important.txt").write_text("data")
    for n in (".tmp.notes", ".tmp.cache"):
        os.utime(wrong / n, (old, old))
    rc, obj, _ = cli_json(capsys, "fsck", wrong, "--repair")
    assert sorted(os.listdir(wrong)) == [".tmp.cache", ".tmp.notes", "important.txt"]
    assert rc == 0 and any("does not look like an lmcache-fx store" in w for w in obj["warnings"]), obj

    path, files = store_copy
    sub = os.path.dirname(files["org/model-a"][0])
    notes = os.path.join(sub, "notes.tmp.txt")
    probe = os.path.join(path, ".tmp.odirect.999999999")
    for p in (notes, probe):
        with open(p, "w") as f:
            f.write("x")
        os.utime(p, (old, old))
    rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
    probs = {p["path"]: p for p in obj["problems"]}
    assert os.path.exists(notes) and probs[notes]["kind"] == "foreign"
    assert not os.path.exists(probe) and probs[probe]["removed"]


def test_fsck_stopped_midway_waits_for_its_reads(tmp_path):
    """fsck's verifier stopped with a batch in flight (Ctrl-C, an error, the
    caller done: here the generator closed at its first verdict) waits for
    the batch's reads before its buffer goes. Before, the buffer was freed
    under the engine's thread: a segfault. In a child: a crash must not
    take pytest down."""
    path = _written_store(tmp_path, [2 << 20] * 12)
    code = textwrap.dedent(
        """
        import sys
        from lmcache_fx.tools.admin import scan
        from lmcache_fx.tools.verify import ChunkVerifier
        sc = scan([sys.argv[1]])
        for engine in ("threads", "auto") * 5:
            rd = ChunkVerifier(engine)
            g = rd.verify(sc.chunks, 8 << 20)
            assert next(g).status == "ok"
            g.close()
            rd.close()
        print("survived")
        """
    )
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_fsck_stopped_at_a_verdict_leaves_no_chunk_file_open(tmp_path):
    """A file the verifier has opened but not yet handed on (to a batch, or
    to its read alone when larger than a batch) was only in a local while
    earlier batches' verdicts were yielded: a stop there (Ctrl-C, the caller
    done) left it open, and with it its read lock on the chunk (a writer's
    lock on that file was refused). Closed now, in both places."""
    from lmcache_fx.tools.admin import scan
    from lmcache_fx.tools.verify import ChunkVerifier

    F = _fx()
    path = _written_store(tmp_path, [100_000] * 4 + [3_000_000])
    sc = scan([path])
    small = [f for f in sc.chunks if f.size < 1 << 20]
    large = [f for f in sc.chunks if f.size > 1 << 20]
    for files, buffer_bytes in ((small[:2] + large, 1 << 20), (small, 106496 + 1000)):  # next: large; one per batch
        rd = ChunkVerifier("threads")
        before = F.open_fds()
        g = rd.verify(files, buffer_bytes)
        assert next(g).status == "ok"
        g.close()
        rd.close()
        assert F.open_fds() == before, (len(files), buffer_bytes)


def test_fsck_reads_a_file_larger_than_its_buffer_header_first_and_in_pieces(tmp_path):
    """A 1 TiB chunk-named sparse file is bad by its header, its payload
    never read; chunks larger than --buffer-mb are verified in pieces of it
    (a flipped byte in the third piece is found). Before, fsck asked for a
    1 TiB buffer and stopped with "give a smaller --buffer-mb"."""
    F = _fx()
    path = _written_store(tmp_path, [(5 << 19) + 123] * 3)
    chunks = sorted(F.chunk_files(path))
    _flip(chunks[0], HEADER_SIZE + (2 << 20) + 77)
    os.makedirs(os.path.join(path, "56"), exist_ok=True)
    huge = os.path.join(path, "56", "56" + "0" * 30 + ".fxkv")
    with open(huge, "wb") as f:
        f.truncate(1 << 40)
    t0 = time.monotonic()
    fx = os.path.join(os.path.dirname(sys.executable), "lmcache-fx")  # a child: a crash must not take pytest down
    r = subprocess.run([fx, "fsck", path, "--buffer-mb", "1", "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    obj = json.loads(r.stdout)
    assert obj["ok"] == 2 and obj["bad"] == 2, obj
    probs = {p["path"]: p["problem"] for p in obj["problems"]}
    assert "bad header" in probs[huge] and "payload checksum mismatch" in probs[chunks[0]]
    assert time.monotonic() - t0 < 60  # the 1 TiB was not read


def _unlistable(path):
    """How to run the CLI so that a mode-000 directory cannot be listed:
    as is, or as root without the capabilities that bypass modes."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("root without setpriv: cannot drop CAP_DAC_OVERRIDE")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]


def test_a_fanout_directory_that_cannot_be_listed_is_unreadable_not_foreign(tmp_path):
    """fsck calls a fan-out directory it cannot list UNREADABLE (exit 4),
    gc says it could not see everything (exit 1). Before: FOREIGN, ignored,
    "all ok", exit 0."""
    F = _fx()
    path = _written_store(tmp_path, [4096] * 6)
    sub = os.path.dirname(sorted(F.chunk_files(path))[0])
    pre = _unlistable(path)
    fx = [os.path.join(os.path.dirname(sys.executable), "lmcache-fx")]
    os.chmod(sub, 0)
    try:
        r = subprocess.run([*pre, *fx, "fsck", path, "--json"], capture_output=True, text=True, timeout=60)
        obj = json.loads(r.stdout)
        assert r.returncode == 4, (obj, r.stderr)
        p = {p["path"]: p for p in obj["problems"]}[sub]
        assert p["kind"] == "unreadable" and "cannot list" in p["problem"]
        r = subprocess.run([*pre, *fx, "gc", path, "--to-gb", "1"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "could not be listed" in r.stdout, (r.stdout, r.stderr)
    finally:
        os.chmod(sub, 0o700)


def test_fsck_reports_a_fanout_name_that_is_a_link_or_a_file(capsys, store_copy, tmp_path):
    """A fan-out name that is a symlink (to a directory of chunk files) or a
    file: the store cannot write there; fsck says so and to remove it, exit
    4, and never follows the link. Before: skipped in silence, exit 0."""
    path, _ = store_copy
    outside = tmp_path / "outside"
    outside.mkdir()
    free = [n for n in (f"{i:02x}" for i in range(256)) if not os.path.lexists(os.path.join(path, n))]
    link, plain = os.path.join(path, free[0]), os.path.join(path, free[1])
    (outside / (free[0] + "0" * 30 + ".fxkv")).write_bytes(b"x" * 8192)
    os.symlink(outside, link)
    with open(plain, "w") as f:
        f.write("x")
    rc, obj, _ = cli_json(capsys, "fsck", path, "--repair")
    assert rc == 4 and obj["ok"] == 6, obj
    probs = {p["path"]: p for p in obj["problems"]}
    assert probs[link]["kind"] == probs[plain]["kind"] == "fanout"
    assert "replaced by a link" in probs[link]["problem"] and "remove it" in probs[link]["problem"]
    assert "replaced by a file" in probs[plain]["problem"]
    assert os.path.islink(link) and os.path.exists(outside / (free[0] + "0" * 30 + ".fxkv"))
    rc, out, _ = cli(capsys, "fsck", path)
    assert rc == 4 and "FANOUT" in out


@pytest.mark.parametrize("cmd", ["gc", "fsck"])
def test_the_same_directory_twice_is_refused(capsys, store_copy, tmp_path, cmd):
    """D,D/ or D and a link to D: one store counted twice (gc removed twice
    what it should; fsck called every chunk a DUPLICATE of itself). Refused,
    as the store's own options refuse a path listed twice."""
    path, files = store_copy
    link = str(tmp_path / "link")
    os.symlink(path, link)
    extra = ["--to-gb", 0] if cmd == "gc" else []
    for roots in (f"{path},{path}/", f"{path},{link}"):
        rc, out, err = cli(capsys, cmd, roots, *extra)
        assert rc == 2 and "given more than once; list each directory once" in err, err
        assert len(err.strip().splitlines()) == 1
    assert all(os.path.exists(f) for fs in files.values() for f in fs)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["stat", "--capacity-gb", "0"], "--capacity-gb"),
        (["stat", "--capacity-gb", "nan"], "--capacity-gb"),
        (["stat", "--capacity-gb", "inf"], "--capacity-gb"),
        (["stat", "--capacity-gb", "-1"], "--capacity-gb"),
        (["gc", "--to-gb", "nan"], "--to-gb"),
        (["gc", "--to-gb", "inf"], "--to-gb"),
        (["gc", "--to-gb", "-1"], "--to-gb"),
        (["gc", "--to-gb", "1e300"], "--to-gb"),
        (["stat", "--capacity-gb", "1e300"], "--capacity-gb"),
        (["fsck", "--buffer-mb", "100000000"], "--buffer-mb"),
        (["fsck", "--buffer-mb", "0"], "--buffer-mb"),
    ],
)
def test_bad_numbers_are_one_line_errors_naming_the_flag(capsys, tmp_path, argv, flag):
    rc, out, err = cli(capsys, argv[0], tmp_path, *argv[1:])
    assert rc == 2 and flag in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    if argv[0] == "fsck":
        assert "4096" in err  # the bound is said


def test_config_with_the_plugin_unlisted_says_to_list_it(capsys, tmp_path):
    """The plugin's settings are there but storage_plugins does not list it:
    the error says to list it, not to set a module_path that is set."""
    import yaml

    d = fx_config(tmp_path / "s")
    del d["storage_plugins"]
    y = tmp_path / "unlisted.yaml"
    y.write_text(yaml.safe_dump(d))
    rc, out, err = cli(capsys, "stat", "--config", y)
    assert rc == 2 and "storage_plugins does not list 'fx'" in err and "storage_plugins: ['fx']" in err, err
    assert "module_path: lmcache_fx" not in err


def test_a_spare_is_one_of_the_stores_temporaries_to_the_tools(tmp_path):
    """Spares are named <digest>.fxkv.tmp.<pid>.spare<n>.<host>: the tools
    took them for foreign files ("not an lmcache-fx file"), so fsck --repair
    and gc never removed a dead process's spares. They are temporaries."""
    from faults import fxfault as F

    from lmcache_fx.tools import admin

    shm = f"/dev/shm/fx-admin-spare-{os.getpid()}"
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm: spares are kept on memory filesystems only")
    shutil.rmtree(shm, ignore_errors=True)
    try:
        s = F.open_store(shm, max_capacity_gb=0.01)
        src = F.Chunks()
        assert s.write([src.item(f"k{i}", 128 * 1024) for i in range(3)]) == [True] * 3
        assert s.remove("k0") and s.spare_bytes
        (spare,) = F.tmp_files(shm)
        assert ".spare" in os.path.basename(spare)
        sc = admin.scan([shm])
        assert [t.path for t in sc.temps] == [spare] and not sc.others
        s.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_missing_store_named_by_a_config_says_which_key(capsys, tmp_path):
    """A store path from --config that does not exist was answered "give the
    store's path, as in storage_plugin.<name>.path", the path having come
    from that key (and for a remote entry, from another head)."""
    import yaml

    d = {
        "chunk_size": 256,
        "local_cpu": False,
        "max_local_cpu_size": 0.1,
        "remote_storage_plugins": ["fx"],
        "extra_config": {
            "remote_storage_plugin.fx.module_path": "lmcache_fx.remote_plugin",
            "remote_storage_plugin.fx.class_name": "FxRemoteConnector",
            "remote_storage_plugin.fx.path": str(tmp_path / "never-made"),
        },
    }
    y = tmp_path / "remote.yaml"
    y.write_text(yaml.safe_dump(d))
    rc, out, err = cli(capsys, "stat", "--config", y)
    assert rc == 2 and f"it is remote_storage_plugin.fx.path in {y}" in err and "storage_plugin.<name>" not in err, err
    rc, out, err = cli(capsys, "stat", tmp_path / "never-made")
    assert rc == 2 and "give the store's path (the plugin's path option)" in err, err


def test_one_name_in_both_plugin_lists_is_two_stores_to_pick_from(capsys, tmp_path):
    """storage_plugins and remote_storage_plugins may both list 'fx', with
    keys of their own (storage_plugin.fx.* and remote_storage_plugin.fx.*):
    two stores. --plugin fx took the first silently; it now asks for the
    head, and --plugin <head>.fx picks that one."""
    import yaml

    local, remote = tmp_path / "local", tmp_path / "remote"
    local.mkdir()
    remote.mkdir()
    d = fx_config(local)
    d["remote_storage_plugins"] = ["fx"]
    d["extra_config"].update(
        {
            "remote_storage_plugin.fx.module_path": "lmcache_fx.remote_plugin",
            "remote_storage_plugin.fx.class_name": "FxRemoteConnector",
            "remote_storage_plugin.fx.path": str(remote),
        }
    )
    y = tmp_path / "both.yaml"
    y.write_text(yaml.safe_dump(d))
    for argv in ((), ("--plugin", "fx")):
        rc, out, err = cli(capsys, "stat", "--config", y, *argv)
        assert rc == 2 and "storage_plugin.fx, remote_storage_plugin.fx" in err, err
        assert "pick one with --plugin storage_plugin.fx" in err, err
    for head, path in (("storage_plugin", local), ("remote_storage_plugin", remote)):
        rc, obj, err = cli_json(capsys, "stat", "--config", y, "--plugin", f"{head}.fx")
        assert rc == 0 and obj["paths"] == [str(path)], (obj, err)


def test_mp_mode_keys_name_their_model_and_ranks(capsys, tmp_path):
    """The L2 adapter's keys (model with '/' as '-SEP-', kv_rank in hex, no
    dtype) read as model '?' in ls and stat, 'world size , workers ' in stat,
    and --model found none of them."""
    from lmcache.v1.distributed.api import ObjectKey

    from lmcache_fx.l2_adapter import object_key_string
    from lmcache_fx.tools.admin import key_fields

    rank = ObjectKey.ComputeKVRank(8, 5, 4, 1)  # TP worker 1 of node 1, TP 4 x PP 2
    key = ObjectKey(chunk_hash=(77).to_bytes(32, "big"), model_name="org/m-1", kv_rank=rank)
    assert key_fields(object_key_string(key)) == {"model": "org/m-1", "world_size": 8, "worker_id": 5, "kv_dtype": None}
    salted = ObjectKey(chunk_hash=(78).to_bytes(32, "big"), model_name="org/m-1", kv_rank=rank, cache_salt="s1")
    assert key_fields(object_key_string(salted))["model"] == "org/m-1"
    s = ChunkStore(FxOptions.from_mapping({"path": str(tmp_path / "s"), "max_capacity_gb": 1}))
    try:
        data = torch.arange(4096, dtype=torch.uint8)
        from lmcache_fx.core.chunkfile import ChunkMeta

        meta = ChunkMeta(shapes=((4096,),), dtypes=("uint8",), fmt="KV_2LTD")
        assert s.write([(object_key_string(key), data.data_ptr(), 4096, meta)]) == [True]
    finally:
        s.close()
    rc, obj, _ = cli_json(capsys, "ls", tmp_path / "s", "--model", "org/m-1")
    assert rc == 0 and len(obj["chunks"]) == 1 and obj["chunks"][0]["model"] == "org/m-1", obj


@pytest.mark.parametrize("group,fix", [("-1", "kernel.io_uring_group=<a group"), ("1000", "add the server's user")])
def test_doctor_io_uring_group_fix_is_one_that_can_be_done(monkeypatch, group, fix):
    """kernel.io_uring_disabled=1 with kernel.io_uring_group=-1 (no group):
    doctor told the operator to add the server's user to group -1."""
    from lmcache_fx.tools import doctor

    real = doctor._read
    facts = {"/proc/sys/kernel/io_uring_disabled": "1", "/proc/sys/kernel/io_uring_group": group}
    monkeypatch.setattr(doctor, "_read", lambda p: facts.get(p, real(p)))
    monkeypatch.setattr(doctor._fxio, "io_uring_status", lambda: (False, "io_uring_setup failed: EPERM"))
    monkeypatch.setattr(doctor, "has_cap", lambda st, bit: False)
    c = doctor.check_io_uring("auto")
    assert c.status == "fail" and "kernel.io_uring_disabled=1" in c.summary, c
    assert fix in c.fix, c.fix


def test_version_flag(capsys):
    """`lmcache-fx --version` was an unknown flag."""
    from lmcache_fx import __version__

    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out == f"lmcache-fx {__version__}\n"


def test_doctor_on_ramfs_says_what_the_store_does_there(capsys, tmp_path):
    """On ramfs doctor warned "0 B free ... writes will fail with ENOSPC"
    (ramfs has no size, statvfs says 0 of 0) and failed O_DIRECT, telling
    the operator to move to a block filesystem, while the store itself
    treats buffered I/O on a memory filesystem as what reading memory is."""
    if os.geteuid() != 0:
        pytest.skip("mounting a ramfs needs root")
    mnt = tmp_path / "ram"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here: {r.stderr.strip()}")
    try:
        rc, obj, _ = cli_json(capsys, "doctor", "--path", str(mnt / "s"))
        checks = {c["name"]: c for c in obj["checks"]}
        assert checks["space"]["status"] == "info" and "no size limit" in checks["space"]["summary"], checks["space"]
        assert checks["O_DIRECT"]["status"] in ("info", "ok"), checks["O_DIRECT"]
        # The verdict said "io_uring + O_DIRECT" where the store runs buffered; the hint's remount with
        # huge= does nothing on ramfs.
        if checks["O_DIRECT"]["status"] == "info":
            assert "O_DIRECT on" not in obj["verdict"] and "buffered I/O" in obj["verdict"], obj["verdict"]
        assert "remount" not in (checks["memory fs"]["fix"] or ""), checks["memory fs"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_doctor_names_the_filesystem_mounted_over_another(tmp_path):
    """Of two mounts at one point fs_info took the first listed, the hidden
    one: doctor named tmpfs on a ramfs mounted over it."""
    from lmcache_fx.testing.loopfs import tmpfs
    from lmcache_fx.tools.common import fs_info

    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    with contextlib.ExitStack() as stack:
        try:
            mnt = stack.enter_context(tmpfs("size=16m"))
        except RuntimeError as e:
            pytest.skip(f"could not mount a tmpfs ({e})")
        r = subprocess.run(["mount", "-t", "ramfs", "ramfs", mnt], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a ramfs here: {r.stderr.strip()}")
        stack.callback(subprocess.run, ["umount", mnt], check=True)
        assert fs_info(mnt)["fstype"] == "ramfs"


def test_doctor_on_a_path_it_cannot_open_or_under_a_file_says_so(tmp_path):
    """A store directory the user cannot open (root made it, the server
    runs as another user) or a path under a regular file: doctor's O_DIRECT
    probe raised, a traceback instead of the FAIL lines."""
    afile = tmp_path / "afile"
    afile.write_bytes(b"x")
    afile.chmod(0o755)
    fx = [os.path.join(os.path.dirname(sys.executable), "lmcache-fx")]
    r = subprocess.run(
        [*fx, "doctor", "--path", str(afile / "sub"), "--json"], capture_output=True, text=True, timeout=120
    )
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["path"]["status"] == "fail" and "is not a directory" in checks["path"]["summary"], checks["path"]
    shut = tmp_path / "shut"
    shut.mkdir()
    pre = _unlistable(str(shut))
    shut.chmod(0o700 if pre else 0)  # as root without the capabilities: 0700 of another owner
    if pre:
        os.chown(shut, 65534, 65534)
    try:
        r = subprocess.run(
            [*pre, *fx, "doctor", "--path", str(shut), "--json"], capture_output=True, text=True, timeout=120
        )
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
        assert checks["path"]["status"] == "fail", checks["path"]
        assert checks["O_DIRECT"]["status"] != "ok", checks["O_DIRECT"]
    finally:
        shut.chmod(0o700)


def test_fsck_with_the_configs_auth_key_finds_the_chunks_a_keyed_store_removes(capsys, tmp_path):
    """fsck ignored auth_key, even with --config: chunks without a MAC made
    with the key (planted by a group member, or stored by a server without
    it) were 'ok', and the next keyed read removed them. With the config's
    key fsck judges them as the store does, for chunks read whole and for
    those read in pieces (past --buffer-mb); without it, it says that MACs
    went unchecked."""
    import yaml

    F = _fx()
    path = str(tmp_path / "store")
    key_a, key_b = "A" * 32, "B" * 32
    src = F.Chunks()
    good = [("m@1@0@a0@half", 64 << 10), ("m@1@0@a1@half", 3 << 20)]
    other = [("m@1@0@b0@half", 3 << 20)]
    unkeyed = [("m@1@0@u0@half", 64 << 10)]
    for key, items in ((key_a, good), (key_b, other), ("", unkeyed)):
        st = F.open_store(path, max_capacity_gb=1, io_engine="threads", **({"auth_key": key} if key else {}))
        try:
            assert all(st.write([src.item(k, n) for k, n in items]))
        finally:
            st.close()
    y = tmp_path / "lmcache.yaml"
    y.write_text(yaml.safe_dump(fx_config(path, max_capacity_gb=1, auth_key=key_a)))
    rc, obj, _ = cli_json(capsys, "fsck", path, "--buffer-mb", 1)
    assert rc == 0 and obj["ok"] == 4 and obj["macs_unchecked"] == 3 and not obj["macs_checked"]
    rc, out, _ = cli(capsys, "fsck", path)
    assert "3 chunks carry a MAC (auth_key), not checked: pass --config" in out
    rc, obj, _ = cli_json(capsys, "fsck", "--config", y, "--buffer-mb", 1)
    assert obj["macs_checked"] and obj["ok"] == 2 and obj["bad"] == 2, obj
    why = {p["path"]: p["problem"] for p in obj["problems"]}
    digest = {F.chunk_digest(k): k for k, _ in good + other + unkeyed}
    by_key = {digest[os.path.basename(p)[: -len(".fxkv")]]: w for p, w in why.items()}
    assert by_key == {
        "m@1@0@b0@half": "MAC does not verify with auth_key: the store removes it on read",
        "m@1@0@u0@half": "no MAC (written without auth_key): the store removes it on read",
    }
    # the config's key is its own store's: another store named beside it is not judged by it
    other = _written_store(tmp_path / "other", [64 << 10])
    rc, out, _ = cli(capsys, "fsck", other, "--config", y, "--repair")
    assert rc == 0 and f"auth_key of {y} not applied: its store is {path}, not this one" in out, out
    rc, obj, _ = cli_json(capsys, "fsck", "--config", y, "--repair")
    assert rc == 1 and sum(p.get("removed", False) for p in obj["problems"]) == 2
    st = F.open_store(path, max_capacity_gb=1, io_engine="threads", auth_key=key_a)
    try:
        hits, misses, bad = F.read_check(st, [k for k, _ in good])
        assert (hits, misses, bad) == (2, 0, [])
    finally:
        st.close()


def test_tools_on_a_read_only_filesystem_say_so(capsys, tmp_path):
    """On a read-only filesystem gc and fsck --repair told root to 'run as the
    store's owner', and estimate --json said 'permission denied': EROFS,
    which no owner's rights mend, is said as such."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs and remount it read-only")
    from pathlib import Path

    from lmcache_fx.testing.loopfs import tmpfs

    F = _fx()
    with tmpfs("size=16m") as where:
        mnt = Path(where)
        st = F.open_store(str(mnt / "st"), max_capacity_gb=1, io_engine="threads")
        src = F.Chunks()
        try:
            assert all(st.write([src.item(f"m@1@0@r{i}@half", 64 << 10) for i in range(3)]))
        finally:
            st.close()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        rc, out, err = cli(capsys, "gc", mnt / "st", "--to-gb", 0)
        said = out + err
        assert rc == 1 and "read-only filesystem" in said and "owner" not in said, said
        rc, obj, _ = cli_json(capsys, "doctor", "--path", mnt / "new")
        path_check = next(c for c in obj["checks"] if c["name"] == "path")
        assert path_check["status"] == "fail" and "is on a read-only filesystem" in path_check["summary"], path_check
        assert path_check["fix"] == "give a path on a writable filesystem", path_check
        with pytest.raises(SystemExit) as e:
            cli(capsys, "estimate", "--json", mnt / "x.json")
        rc, said = e.value.code, capsys.readouterr().err
        assert rc == 2 and "on a read-only filesystem" in said and "permission denied" not in said, said


def test_ls_and_stat_say_another_format_version_as_fsck_does(capsys, tmp_path):
    """ls showed a chunk of another format version as 'BAD ... ' and stat
    counted it 'with a bad header: run fsck', while fsck (rightly) reports it
    as VERSION and never removes it: in a rolling upgrade an operator was
    told to delete good chunks. All three say the same now."""
    import struct

    from lmcache_fx import _fxio

    path = _written_store(tmp_path, [64 << 10, 64 << 10])
    victim = sorted(F for F in _fx().chunk_files(path))[0]
    b = bytearray(open(victim, "rb").read(4096))
    struct.pack_into("<H", b, 8, 2)  # format version 2, its header checksum made right
    struct.pack_into("<I", b, 4092, _fxio.crc32c(bytes(b[:4092])))
    with open(victim, "r+b") as f:
        f.write(b)
    rc, out, _ = cli(capsys, "ls", path)
    line = next(ln for ln in out.splitlines() if os.path.basename(victim) in ln)
    assert "VERSION: another format version" in line and "BAD" not in out, out
    rc, obj, _ = cli_json(capsys, "stat", path)
    assert obj["bad_headers"] == 0 and obj["other_version"] == 1, obj
    rc, out, _ = cli(capsys, "stat", path)
    assert "(1 of another format version, left alone)" in out and "run fsck" not in out, out
    rc, obj, _ = cli_json(capsys, "fsck", path)
    assert rc == 0 and obj["other_version"] == 1 and obj["bad"] == 0


def test_plugin_options_outside_extra_config_are_named(capsys, tmp_path):
    """storage_plugin.fx.max_capacity_gb written at the top level of the YAML
    (beside chunk_size) is dropped by LMCache with its 'Unknown configuration
    key', and the plugin ran at 100 GiB while doctor said all was well."""
    import yaml

    d = {**fx_config(tmp_path / "s"), "storage_plugin.fx.max_capacity_gb": 1}
    y = tmp_path / "split.yaml"
    y.write_text(yaml.safe_dump(d))
    rc, obj, _ = cli_json(capsys, "doctor", "--config", y)
    said = [c["summary"] for c in obj["checks"] if c["name"] == "config" and c["status"] == "warn"]
    assert any(s.startswith("top-level key 'storage_plugin.fx.max_capacity_gb' is no LMCache setting") for s in said)
    assert all("move it under extra_config" in s for s in said if "top-level" in s)
    os.makedirs(tmp_path / "s")
    rc, out, err = cli(capsys, "stat", "--config", y)
    assert rc == 0 and "top-level key 'storage_plugin.fx.max_capacity_gb'" in err, err
    # A path there (flat, as a map, or under no plugin head), with none in extra_config: the plugin
    # opens its default store, 100 GiB in the home directory. doctor fails it; the tools refuse it.
    for top in (
        {"storage_plugin.fx.path": str(tmp_path / "s")},
        {"storage_plugin": {"fx": {"path": str(tmp_path / "s")}}},
        {"fx.path": str(tmp_path / "s")},
        {"fx": {"paths": str(tmp_path / "s")}},
    ):
        d = fx_config(tmp_path / "s")
        del d["extra_config"]["storage_plugin.fx.path"]
        y.write_text(yaml.safe_dump({**d, **top}))
        rc, obj, _ = cli_json(capsys, "doctor", "--config", y)
        failed = [c["summary"] for c in obj["checks"] if c["status"] == "fail"]
        assert rc == 1 and any(
            f.startswith("storage_plugin.fx.path is not set in extra_config, so the store opens at its default")
            for f in failed
        ), (top, failed)
        rc, out, err = cli(capsys, "stat", "--config", y)
        assert rc == 2 and "storage_plugin.fx.path is not set in extra_config" in err, (top, err)


def test_metrics_give_a_hit_rate_and_keep_stores_of_one_name_apart(tmp_path):
    """hits/misses count reads only: a chunk a lookup did not find is never
    read, so the page's hit rate read 100 % while 8 % of the tokens asked
    for were served (a review). LMCache's lookups are counted now, not the
    second look its retrieve takes (a read-back). And two engines in
    one process, each with a plugin named fx, shared one series: the first
    one's vanished when the second closed."""
    from prometheus_client.parser import text_string_to_metric_families

    geo, n, _ = MODELS["org/model-a"]
    port = _free_port()
    toks = _tokens("org/model-a")
    kv = KV(geo, n, seed=1)

    def page() -> dict:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {
            (s.name, s.labels["store"]): s.value
            for f in text_string_to_metric_families(body)
            for s in f.samples
            if s.name in ("lmcache_fx_lookup_chunks_total", "lmcache_fx_lookup_hits_total", "lmcache_fx_chunks")
        }

    cfg_a = config_from_dict(fx_config(tmp_path / "a", cpu_gb=0.05, metrics_port=port), tmp_path)
    cfg_b = config_from_dict(fx_config(tmp_path / "b", cpu_gb=0.05, metrics_port=port), tmp_path)
    with lmcache_engine(cfg_a, geo, model="org/model-a") as eng:
        store_and_wait(eng, toks, kv, fx_backend(eng))
        chunks = n // geo.chunk
        before = page()
        other = toks + 7  # never stored: its first chunk misses, and the lookup stops there
        assert eng.lookup(toks) == n and eng.lookup(other) == 0  # as vLLM's scheduler asks
        assert retrieve(eng, toks, kv.empty_like()) == n  # its second look (get_block_mapping) is not counted
        after = page()
        asked = after["lmcache_fx_lookup_chunks_total", "fx"] - before["lmcache_fx_lookup_chunks_total", "fx"]
        found = after["lmcache_fx_lookup_hits_total", "fx"] - before["lmcache_fx_lookup_hits_total", "fx"]
        assert found == chunks and asked == 2 * chunks, (asked, found)
        with lmcache_engine(cfg_b, geo, model="org/model-a") as eng_b:
            store_and_wait(eng_b, toks[: geo.chunk], KV(geo, geo.chunk, seed=2), fx_backend(eng_b))
            both = page()
            assert both["lmcache_fx_chunks", "fx"] == chunks and both["lmcache_fx_chunks", "fx-2"] == 1, both
        assert page()["lmcache_fx_chunks", "fx"] == chunks  # still there after the second closed
