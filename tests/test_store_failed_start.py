"""A store whose start fails undoes what it made, but never removes the
shared ledger files (.fx/store.lock, .fx/members) once it has opened them:
another process may have opened them meanwhile, and a ledger made anew
beside it would split the store into two ledgers and two evictor locks.
What can refuse a start (options, O_DIRECT, mapped reads) is decided before
those files are made, so a refused start on a new path leaves nothing."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from faults import fxfault as F  # noqa: E402

from lmcache_fx.core import medium  # noqa: E402
from lmcache_fx.core import store as store_mod  # noqa: E402
from lmcache_fx.core.layout import LOCK_DIR, LOCK_NAME  # noqa: E402
from lmcache_fx.core.options import ConfigError  # noqa: E402


def test_a_failed_start_keeps_a_ledger_another_process_opened(tmp_path, monkeypatch):
    store_dir = str(tmp_path / "store")
    peer = []
    real_open = store_mod.Ledger.open

    def open_then_a_peer_starts(*a, **k):
        led = real_open(*a, **k)
        p = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import os, sys; sys.path.insert(0, {HERE!r}); from faults import fxfault as F; "
                f"s = F.open_store({store_dir!r}); print(os.fstat(s._ledger.fd).st_ino, flush=True); "
                "sys.stdin.read(); s.close()",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.path.dirname(HERE),
        )
        peer.append((p, int(p.stdout.readline())))
        return led

    def walk_fails(root):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_mod.Ledger, "open", open_then_a_peer_starts)
    monkeypatch.setattr(store_mod, "fanout_dirs", walk_fails)  # the start-up scan fails, after Ledger.open
    try:
        with pytest.raises(OSError):
            F.open_store(store_dir)
        monkeypatch.undo()
        ((p, peer_ino),) = peer
        assert os.stat(os.path.join(store_dir, LOCK_NAME)).st_ino == peer_ino  # the peer's ledger is still the store's
        s = F.open_store(store_dir)
        try:
            assert os.fstat(s._ledger.fd).st_ino == peer_ino
            assert s._ledger.others()  # the peer's membership is seen: one members file
        finally:
            s.close()
    finally:
        for p, _ in peer:
            p.communicate("", timeout=60)


def test_a_refused_start_leaves_nothing(tmp_path):
    """mapped_reads: true where the store is not on a memory filesystem is
    refused before any shared file is made: the directories made for the
    store go again."""
    if medium.page_cache_fs([str(tmp_path)]):
        pytest.skip(f"{tmp_path} is a memory filesystem: mapped_reads: true is allowed there")
    store_dir = tmp_path / "new" / "store"
    with pytest.raises(ConfigError):
        F.open_store(str(store_dir), mapped_reads="true")
    assert not os.path.exists(tmp_path / "new")


def test_a_failed_start_on_a_new_path_removes_an_empty_lock_dir(tmp_path, monkeypatch):
    """Ledger.open failing after it made .fx: the empty .fx goes, and with it
    the store directory this start made."""
    store_dir = tmp_path / "new"

    def lock_file_refused(root, *a, **k):
        os.mkdir(os.path.join(root, LOCK_DIR))
        raise ConfigError("path: cannot open the store's lock file: Permission denied")

    monkeypatch.setattr(store_mod.Ledger, "open", lock_file_refused)
    with pytest.raises(ConfigError):
        F.open_store(str(store_dir))
    assert not os.path.exists(store_dir)
