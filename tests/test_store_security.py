"""Security and robustness of the store tried from outside (issue 16): a
stalled peer holding the lock, swap attacks on the directories, engine errors
and cancellation, a good chunk renamed in under a damaged one, short reads,
misleading start-up errors, auth_key, simulated power loss.

Cases with a figure for docs/reliability.md report it through F.figure
(scripts/reliability.py runs this file too).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from faults import fxfault as F

from lmcache_fx import _fxio
from lmcache_fx.core import layout, ledger
from lmcache_fx.core import store as store_mod
from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest
from lmcache_fx.core.layout import HOST_TAG, LOCK_NAME, TMP_MARK
from lmcache_fx.core.options import ConfigError, FxOptions
from lmcache_fx.core.store import ChunkStore
from lmcache_fx.testing import loopfs

pytestmark = pytest.mark.reliability


@pytest.fixture
def store_dir(request, tmp_path):
    """On XFS on a loop device (O_DIRECT) when root, else on tmp_path."""
    if loopfs.why_not_available() is None:
        return request.getfixturevalue("xfs_store")
    return str(tmp_path / "store")


class Tracker:
    """allocate/release for ChunkStore.read that counts what is live."""

    def __init__(self):
        self.bufs = {}  # id -> HostBuffer
        self.allocated = self.released = 0

    def allocate(self, meta):
        n = 1
        for x in meta.shapes[0]:
            n *= x
        hb = _fxio.HostBuffer(max(n, 1), hugepages=False)
        self.bufs[id(hb)] = hb
        self.allocated += 1
        return hb, hb.address, n

    def release(self, h):
        self.released += 1
        self.bufs.pop(id(h), None)


def _in_thread(fn, timeout):
    """Runs fn in a daemon thread: (result or exception, seconds, still running)."""
    box = {}

    def go():
        try:
            box["r"] = fn()
        except BaseException as e:  # the failure looked for
            box["r"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(timeout)
    return box.get("r"), time.monotonic() - t0, th.is_alive()


# ------------------------------------------------------------------ 1. a stalled lock holder
def _stalled_holder(root: str) -> subprocess.Popen:
    """A process that takes the store lock and stops itself (SIGSTOP)."""
    code = (
        "import fcntl, os, signal, sys\n"
        f"fd = os.open({os.path.join(root, LOCK_NAME)!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('LOCKED', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "LOCKED"
    for _ in range(200):  # until it is really stopped
        with open(f"/proc/{p.pid}/stat") as f:
            if f.read().split(") ")[1][0] == "T":
                break
        time.sleep(0.01)
    return p


def test_stalled_lock_holder(store_dir, monkeypatch):
    """A peer holding the lock, stopped: stores, damaged-chunk reads, usage
    and a new store all return within a bound; stores skip, with one warning."""
    monkeypatch.setattr(ledger, "LOCK_TIMEOUT", 0.5, raising=False)
    s = F.open_store(store_dir)
    src = F.Chunks()
    good = [f"stall/good/{i}" for i in range(4)]
    bad = [f"stall/bad/{i}" for i in range(4)]
    assert all(s.write([src.item(k, 65536 + 4096 * i) for i, k in enumerate(good + bad)]))
    for k in bad:  # damage the payloads: reading them removes files (a locked step)
        with open(s.path_for(chunk_digest(k)), "r+b") as f:
            f.seek(HEADER_SIZE + 100)
            f.write(b"\xff\x00\xff")
    peer = _stalled_holder(store_dir)
    out = {}
    try:
        with F.LogCount() as logs:

            def work():
                t = time.monotonic()
                out["stores"] = s.write([src.item(f"stall/new/{i}", 65536) for i in range(8)])
                out["store_s"] = time.monotonic() - t
                t = time.monotonic()
                out["bad_reads"] = F.read_check(s, bad)
                out["bad_s"] = time.monotonic() - t
                out["good_reads"] = F.read_check(s, good)
                out["usage"] = s.usage_bytes
                t = time.monotonic()
                s2 = F.open_store(store_dir)
                out["start_s"] = time.monotonic() - t
                out["s2_reads"] = F.read_check(s2, good)
                s2.close()
                return True

            r, took, hung = _in_thread(work, 60)
            warnings = logs.count(logging.WARNING, "store lock was not free")
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait()
    assert not hung, "blocked on the stalled peer's lock"
    assert r is True, r
    # once the peer is gone, stores work again
    ok_after = s.write([src.item("stall/after", 65536)])
    s.close()
    F.figure(
        "A peer holding the store lock, stopped with SIGSTOP (lock wait bound lowered to 0.5 s)",
        "8 stores + 4 damaged-chunk reads + 4 reads + usage + a new store",
        "every call returns within the bound; stores skipped (False); damaged chunks a miss; good chunks "
        "still hit; one warning per burst; stores work again once the peer is gone",
        seconds_total=round(took, 2),
        store_batch_returned_after_s=round(out["store_s"], 2),
        damaged_read_returned_after_s=round(out["bad_s"], 2),
        start_returned_after_s=round(out["start_s"], 2),
        stores_ok=sum(out["stores"]),
        damaged_hits=out["bad_reads"][0],
        good_hits=out["good_reads"][0],
        wrong=len(out["bad_reads"][2]) + len(out["good_reads"][2]),
        warnings=warnings,
        stores_after_peer_gone=ok_after,
    )
    assert not any(out["stores"]) and out["bad_reads"][:2] == (0, 4) and out["good_reads"][:2] == (4, 0)
    assert out["s2_reads"][:2] == (4, 0) and not out["bad_reads"][2] and not out["good_reads"][2]
    assert took < 30 and warnings == 1
    assert ok_after == [True]


def test_a_stopped_lock_holder_costs_one_wait_not_one_per_window(store_dir, monkeypatch):
    """A peer stopped while holding the lock, for many LOCK_TIMEOUT windows:
    after the first wait ran out, every later store, removal and usage read
    returns at once while the ledger stays as the holder left it (before,
    each window's end cost a whole wait again: a writer blocked about half
    the time, a delete of LMCache's eviction 0.1 s a key). The warning names
    the holder's pid and that it is stopped; the lock had again is said once."""
    monkeypatch.setattr(ledger, "LOCK_TIMEOUT", 1.0)
    s = F.open_store(store_dir)
    src = F.Chunks()
    keys = [f"stopped/{i}" for i in range(40)]
    assert all(s.write([src.item(k, 65536) for k in keys]))
    peer = _stalled_holder(store_dir)
    rounds = []
    try:
        with F.LogCount() as logs:
            t = time.monotonic()
            assert s.write([src.item("stopped/new", 65536)]) == [False]  # the first wait runs out
            first = time.monotonic() - t
            stop = time.monotonic() + 3.5  # three windows and a half
            while time.monotonic() < stop:
                t = time.monotonic()
                s.remove(keys[len(rounds) % len(keys)])
                assert s.usage_bytes > 0
                assert s.write([src.item(f"stopped/new/{len(rounds)}", 65536)]) == [False]
                rounds.append(time.monotonic() - t)
            named = logs.count(logging.WARNING, f"pid {peer.pid} (stopped)")
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait()
    with F.LogCount() as logs:
        assert s.write([src.item("stopped/after", 65536)]) == [True]
        free_again = logs.count(logging.WARNING, "store lock is free again")
    s.close()
    assert first >= 1.0 and len(rounds) >= 5
    assert max(rounds) < 0.8, rounds  # a whole wait again would be >= 1.0 s
    assert named == 1 and free_again == 1


def test_a_writer_stopped_past_the_stale_age_is_not_taken_off_the_ledger_twice(store_dir):
    """A writer stopped mid-write (between its reservation and its commit)
    for longer than STALE_TMP_SECONDS: a peer removes its temporary as a dead
    writer's and takes its bytes off the ledger. Resumed, the writer took
    them off again, leaving the shared usage a chunk low (the cap passable)
    until a quiet recompute. It now sees its temporary was removed: the
    chunk is not stored, one warning, and the usage equals the files' bytes."""
    peer = F.open_store(store_dir)
    try:
        src = F.Chunks()
        assert all(peer.write([src.item(f"before/{i}", 200_000) for i in range(3)]))
        p = F.spawn(
            "writer",
            {"path": store_dir, "seed": 7, "n": 1, "pause_at": 1, "resume_on_stdin": True},
            stdin=subprocess.PIPE,
        )
        try:
            assert p.stdout.readline().strip() == "READY", p.stderr.read()
            assert p.stdout.readline().strip() == "MIDWRITE", p.stderr.read()
            (tmp,) = F.tmp_files(store_dir)
            old = time.time() - layout.STALE_TMP_SECONDS - 60  # as if the writer had been stopped that long
            os.utime(tmp, (old, old))
            peer._recompute()  # a peer's periodic recompute: the temporary is a dead writer's by its age
            assert F.tmp_files(store_dir) == []
            p.stdin.write("go\n")
            p.stdin.flush()
            so, se = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert "FINISHED" in so and "DONE 0" not in so, (so, se[-2000:])
        assert "was removed as stale while this process was stopped" in se
        files = F.chunk_files(store_dir)
        assert len(files) == 3 and F.tmp_files(store_dir) == []
        assert peer.usage_bytes == sum(os.path.getsize(f) for f in files)
    finally:
        peer.close()


def test_a_temporary_removed_as_stale_before_its_reservation_is_not_reserved(store_dir):
    """A writer stopped for over STALE_TMP_SECONDS after making its empty
    temporary but before reserving its bytes: a peer removes it (taking 0
    bytes off the ledger). Resumed, the writer reserved the chunk's bytes on
    the unlinked file, and its commit (which skips a temporary removed as
    stale) left them counted: the ledger a chunk high for good. It is now
    refused at the reservation; the ledger equals the files."""
    peer = F.open_store(store_dir)
    try:
        src = F.Chunks()
        assert all(peer.write([src.item(f"before/{i}", 131072) for i in range(2)]))
        tests = os.path.dirname(os.path.abspath(__file__))
        code = (
            f"import sys; sys.path.insert(0, {tests!r}); from faults import fxfault as F\n"
            f"s = F.open_store({store_dir!r}); src = F.Chunks(); real = s._reserve\n"
            "def reserve(files):\n"
            "    print('PREPARED', flush=True); sys.stdin.readline(); return real(files)\n"
            "s._reserve = reserve\n"
            "print('RESULT', s.write([src.item('late', 131072)]), flush=True); s.close()\n"
        )
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert p.stdout.readline().strip() == "PREPARED", p.stderr.read()
            (tmp,) = F.tmp_files(store_dir)
            old = os.path.getmtime(tmp) - layout.STALE_TMP_SECONDS - 60  # as if stopped that long
            os.utime(tmp, (old, old))
            peer._recompute()
            assert F.tmp_files(store_dir) == []
            so, se = p.communicate("go\n", timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert "RESULT [False]" in so, (so, se[-2000:])
        assert "was removed as stale while this process was stopped" in se
        files = F.chunk_files(store_dir)
        assert len(files) == 2 and peer.usage_bytes == sum(os.path.getsize(f) for f in files)
    finally:
        peer.close()


# ------------------------------------------------------------------ 2. swap attacks
def _tree(path) -> dict:
    """Every file under path with its bytes (to see that nothing outside changed)."""
    out = {}
    for dp, dns, fns in os.walk(path):
        for n in fns + [d for d in dns if os.path.islink(os.path.join(dp, d))]:
            p = os.path.join(dp, n)
            out[p] = os.readlink(p) if os.path.islink(p) else open(p, "rb").read()
    return out


def test_odirect_probe_never_follows_a_planted_link(tmp_path, monkeypatch):
    """Symlinks at the old probe name and the fallback's name: nothing is
    created outside, with O_TMPFILE and without it (the O_EXCL|O_NOFOLLOW path)."""
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.mkdir()
    names = [f".tmp.odirect.{os.getpid()}", f"{TMP_MARK}odirect.{os.getpid()}.{HOST_TAG}"]
    for n in names:
        os.symlink(outside / n, root / n)
    before = _tree(outside)
    F.open_store(str(root)).close()
    real_open = os.open

    def no_tmpfile(path, flags, *a, **kw):  # a filesystem without O_TMPFILE: the named fallback runs
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(layout.os, "open", no_tmpfile)
    ok, why = layout.probe_odirect(str(root))
    monkeypatch.undo()
    assert _tree(outside) == before and os.listdir(outside) == []
    assert all(os.path.islink(root / n) for n in names)  # not ours: never removed either


def test_swap_attacks(tmp_path, monkeypatch):
    """File symlink, fan-out directory symlink, hardlink, directory swap: the
    store opens, creates or removes nothing outside it."""
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    s = F.open_store(str(root))
    src = F.Chunks()
    checks = {}
    victim = outside / "victim"
    victim.write_bytes(b"precious" * 512)
    # (a) a fan-out directory swapped for a symlink after it was listed: the stale-temporary sweep
    key = "swap/a"
    assert s.write([src.item(key, 8192)]) == [True]
    sub = os.path.dirname(s.path_for(chunk_digest(key)))
    stale = f"{chunk_digest(key)}.fxkv{TMP_MARK}999999999.1.{HOST_TAG}"  # a dead writer's temporary
    shutil.copy(victim, outside / stale)
    os.utime(outside / stale, (1, 1))
    real_fanout = store_mod.fanout_dirs

    def swap_after_listing(r):
        dirs = real_fanout(r)
        if sub in dirs and not os.path.islink(sub):
            os.rename(sub, str(tmp_path / "moved-a"))
            os.symlink(outside, sub)
        return dirs

    monkeypatch.setattr(store_mod, "fanout_dirs", swap_after_listing)
    s2 = F.open_store(str(root))
    monkeypatch.undo()
    checks["dir_swapped_before_sweep"] = f"outside temporary kept={(outside / stale).exists()}"
    assert (outside / stale).exists()
    # (b) remove / evict through a fan-out directory now a symlink: the file outside stays
    shutil.copy(victim, outside / os.path.basename(s.path_for(chunk_digest(key))))
    before = _tree(outside)
    s2.remove(key)
    s._drop(chunk_digest(key), unlink=True)
    s2._evict_to(0)
    checks["remove_through_dir_link"] = f"outside unchanged={_tree(outside) == before}"
    assert _tree(outside) == before
    # (c) a write into a directory swapped for a symlink between create and rename
    os.unlink(sub)
    os.rename(str(tmp_path / "moved-a"), sub)
    key_c = "swap/c"
    sub_c = os.path.dirname(s.path_for(chunk_digest(key_c)))
    real_engine = s.engine

    def swap_c():
        if os.path.isdir(sub_c) and not os.path.islink(sub_c):
            os.rename(sub_c, str(tmp_path / "moved-c"))
            os.symlink(outside, sub_c)

    class SwapOnHeaders:
        def __getattr__(self, n):
            return getattr(real_engine, n)

        def write(self, ops, crc=False, split=0):
            r = real_engine.write(ops, crc=crc, split=split)
            if not crc:  # the header batch (page-cache stores)
                swap_c()
            return r

        def write_chunks(self, chunks, direct=False):
            r = real_engine.write_chunks(chunks, direct=direct)
            swap_c()  # O_DIRECT stores: payloads and headers in one call
            return r

    s.engine = SwapOnHeaders()
    w = s.write([src.item(key_c, 8192)])
    s.engine = real_engine
    checks["write_through_swapped_dir"] = (
        f"stored={w[0]}, files outside={sorted(os.listdir(outside)) == sorted(before and [os.path.basename(p) for p in before])}"
    )
    assert w == [False] and _tree(outside) == before
    os.unlink(sub_c)
    os.rename(str(tmp_path / "moved-c"), sub_c)
    # (d) a hardlink to a file outside planted as a chunk and as a stale temporary
    key_d = "swap/d"
    path_d = s.path_for(chunk_digest(key_d))
    os.makedirs(os.path.dirname(path_d), exist_ok=True)
    os.link(victim, path_d)
    os.link(victim, path_d + f"{TMP_MARK}999999999.2.{HOST_TAG}")
    s3 = F.open_store(str(root))
    h, m, bad = F.read_check(s3, [key_d])
    w_d = s3.write([src.item(key_d, 8192)])
    got, _, bad2 = F.read_check(s3, [key_d])
    checks["hardlink"] = (
        f"served={h}, outside bytes unchanged={victim.read_bytes() == b'precious' * 512}, "
        f"store wrote its own file={w_d[0] and got == 1}"
    )
    assert h == 0 and not bad and victim.read_bytes() == b"precious" * 512 and w_d == [True] and got == 1 and not bad2
    # (e) a chunk file replaced by a symlink to a file outside: never read, never written through
    key_e = "swap/e"
    s3.write([src.item(key_e, 8192)])
    pe = s3.path_for(chunk_digest(key_e))
    os.unlink(pe)
    os.symlink(victim, pe)
    s4 = F.open_store(str(root))
    he, _, _ = F.read_check(s4, [key_e])
    s4.write([src.item(key_e, 8192)])
    checks["file_symlink"] = f"served={he}, target unchanged={victim.read_bytes() == b'precious' * 512}"
    assert he == 0 and victim.read_bytes() == b"precious" * 512
    assert _tree(outside) == before
    for x in (s, s2, s3, s4):
        x.close()
    F.figure(
        "Swap attacks: fan-out directory swapped for a symlink after listing (stale-temporary sweep), "
        "removal/eviction and a write through a swapped directory, hardlinks to an outside file as a chunk "
        "and a temporary, a chunk replaced by a symlink",
        5,
        "nothing outside the store is created, changed or removed; nothing planted is served",
        **checks,
    )


# ------------------------------------------------------------------ 3. engine errors
class RaisingEngine:
    """The store's engine, raising on the n-th read/submit (1-based)."""

    def __init__(self, engine, fail_at, exc=None):
        self.engine, self.fail_at, self.calls = engine, fail_at, 0
        self.exc = exc or OSError(errno.EMFILE, "cannot take a ring")

    def __getattr__(self, n):
        return getattr(self.engine, n)

    def _tick(self):
        self.calls += 1
        if self.calls in self.fail_at:
            raise self.exc

    def read(self, ops, crc=False):
        self._tick()
        return self.engine.read(ops, crc=crc)

    def submit(self, ops, write=False, crc=False):
        self._tick()
        return self.engine.submit(ops, write=write, crc=crc)


def test_engine_errors_become_misses(store_dir):
    s = F.open_store(store_dir)
    src = F.Chunks()
    keys = [f"engerr/{i}" for i in range(6)]
    assert all(s.write([src.item(k, 65536 + 4096 * i) for i, k in enumerate(keys)]))
    results = {}
    for mode in ("blocking", "async"):
        for fail_at in ({1}, {2}, {1, 2}):
            s2 = F.open_store(store_dir)  # headers not cached: two steps
            t = Tracker()
            eng = RaisingEngine(s2.engine, fail_at)
            if mode == "blocking":
                got = s2.read(keys, t.allocate, t.release, engine=eng)
            else:
                got = asyncio.run(s2.read_async(keys, t.allocate, t.release, engine=eng))
            results[f"{mode} fails at step {sorted(fail_at)}"] = (
                sum(g is not None for g in got),
                t.allocated,
                t.released,
            )
            assert got == [None] * len(keys)
            assert t.allocated == t.released
            assert all(os.path.exists(s.path_for(chunk_digest(k))) for k in keys)  # an engine error damages nothing
            s2.close()
    # a real store whose engine was closed
    s3 = F.open_store(store_dir)
    s3.engine.close()
    t = Tracker()
    got = s3.read(keys, t.allocate, t.release)
    got2 = asyncio.run(s3.read_async(keys, t.allocate, t.release))
    assert got == got2 == [None] * len(keys) and t.allocated == t.released
    # the store still works with a working engine
    h, m, bad = F.read_check(s, keys)
    assert h == len(keys) and not bad
    s.close()


# ------------------------------------------------------------------ 4. cancellation
class WatchSubmits:
    def __init__(self, engine):
        self.engine, self.batches, self.big = engine, [], threading.Event()

    def __getattr__(self, n):
        return getattr(self.engine, n)

    def submit(self, ops, write=False, crc=False):
        b = self.engine.submit(ops, write=write, crc=crc)
        self.batches.append(b)
        if any(op[2] > HEADER_SIZE for op in ops):  # the payload step (headers are read first)
            self.big.set()
        return b


def test_cancel_mid_batch(store_dir):
    """A read cancelled while its big batch is in flight: the call returns
    only once nothing is in flight; every buffer is released; nothing lands
    in the destinations after it returned."""
    n, size = 24, 4 << 20
    s = F.open_store(store_dir)
    src = F.Chunks()
    keys = [f"cancel/{i}" for i in range(n)]
    for i in range(0, n, 4):
        assert all(s.write([src.item(k, size) for k in keys[i : i + 4]]))
        src = F.Chunks()
    # a slow reader: 4 KiB pieces one at a time
    slow = F.open_store(store_dir, queue_depth=1, split_bytes=4096)
    F.read_check(slow, keys[:1])  # headers cached for one; the others are read in step 1
    out = {}

    async def main():
        t = Tracker()
        eng = WatchSubmits(slow.engine)
        task = asyncio.ensure_future(slow.read_async(keys, t.allocate, t.release, engine=eng))
        while not eng.big.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        in_flight = not eng.batches[-1].done()
        task.cancel()
        try:
            await task
            out["raised"] = None
        except asyncio.CancelledError:
            out["raised"] = "CancelledError"
        out["done_at_return"] = all(b.done() for b in eng.batches)
        out["in_flight_at_cancel"] = in_flight
        out["alloc"], out["released"] = t.allocated, t.released
        # sentinel: nothing may land in the destinations after the call returned
        dests = list(t.bufs.values()) or []
        return dests

    # keep the destination buffers: Tracker drops released ones, so record them all
    allocated = []
    real_alloc = Tracker.allocate

    def keep(self, meta):
        r = real_alloc(self, meta)
        allocated.append(r[0])
        return r

    Tracker.allocate = keep
    try:
        asyncio.run(main())
    finally:
        Tracker.allocate = real_alloc
    for hb in allocated:
        memoryview(hb)[:] = b"\xab" * len(hb)
    time.sleep(0.3)
    landed = sum(1 for hb in allocated if bytes(memoryview(hb)).count(b"\xab") != len(hb))
    slow.close()
    s.close()
    F.figure(
        "Cancellation of an awaited read mid-batch (24 x 4 MiB, 4 KiB pieces at queue depth 1)",
        1,
        "the call returns once nothing is in flight; every buffer released; no read lands after it returned",
        in_flight_when_cancelled=out["in_flight_at_cancel"],
        raised=out["raised"],
        batches_done_at_return=out["done_at_return"],
        allocated=out["alloc"],
        released=out["released"],
        buffers_written_after_return=landed,
    )
    assert out["raised"] == "CancelledError" and out["done_at_return"]
    assert out["alloc"] == out["released"] and out["alloc"] > 0
    assert landed == 0


def test_a_read_whose_coroutine_is_closed_releases_every_handle(store_dir):
    """An awaited read whose coroutine is closed mid-batch (its task
    destroyed with its loop: GeneratorExit, neither a cancel nor an error)
    waited for the batch, but its handles were never released: the read
    generator was left to the collector (LMCache's objects were freed by its
    own safety net, each with a warning). Every handle is released now, and
    the store's reads-in-flight count is back to 0."""
    n, size = 16, 2 << 20
    s = F.open_store(store_dir)
    src = F.Chunks()
    keys = [f"closed/{i}" for i in range(n)]
    assert all(s.write([src.item(k, size) for k in keys]))
    slow = F.open_store(store_dir, queue_depth=1, split_bytes=4096)  # 4 KiB pieces one at a time
    t = Tracker()
    loop = asyncio.new_event_loop()
    try:
        coro = slow.read_async(keys, t.allocate, t.release)

        async def start():
            task = loop.create_task(coro)
            task._log_destroy_pending = False  # left pending on purpose: no "Task was destroyed" at exit
            while t.allocated < n:
                await asyncio.sleep(0.0005)
            return task

        loop.run_until_complete(start())
    finally:
        loop.close()  # the task left pending, as at a loop's shutdown
    coro.close()  # what destroying the task does: GeneratorExit into the read
    try:
        assert t.allocated == n and t.released == n
        assert slow._ledger.reads_in_flight() == 0
    finally:
        slow.close()
        s.close()


# ------------------------------------------------------------------ 5. a good chunk renamed in meanwhile
def test_damaged_chunk_removal_spares_a_replacement(store_dir, tmp_path):
    s = F.open_store(store_dir)
    src = F.Chunks()
    key = "inode/0"
    assert s.write([src.item(key, 65536)]) == [True]
    path = s.path_for(chunk_digest(key))
    with open(path, "r+b") as f:  # damaged payload
        f.seek(HEADER_SIZE + 10)
        f.write(b"\x00\xff\x00")
    # a valid copy, made by another store, to be renamed into place while the damaged one is read
    other = F.open_store(str(tmp_path / "other"))
    assert other.write([src.item(key, 65536)]) == [True]
    spare = other.path_for(chunk_digest(key))
    real = s.engine

    class RenameInAfterRead:
        def __getattr__(self, n):
            return getattr(real, n)

        def read(self, ops, crc=False):
            r = real.read(ops, crc=crc)
            if crc:  # the payload step has read the damaged file: another process replaces it now
                shutil.copy(spare, path + ".new")
                os.rename(path + ".new", path)
            return r

    s2 = F.open_store(store_dir)
    got = s2.read([key], F.allocator(), lambda h: None, engine=RenameInAfterRead())
    assert got == [None] and s2.stats.corrupt == 1
    assert os.path.exists(path), "the valid chunk renamed into place was deleted"
    h, m, bad = F.read_check(s2, [key])
    assert h == 1 and not bad
    for x in (s, s2, other):
        x.close()


# ------------------------------------------------------------------ 6. short reads
def test_short_read_is_a_read_error_not_corruption(store_dir):
    s = F.open_store(store_dir)
    src = F.Chunks()
    keys = ["short/0", "short/1"]
    assert all(s.write([src.item(k, 65536 + 512) for k in keys]))
    real = s.engine

    class ShortPayload:
        def __getattr__(self, n):
            return getattr(real, n)

        def read(self, ops, crc=False):
            r = real.read(ops, crc=crc)
            if crc:  # the payload of the first chunk came back short, as an odd device may
                n0, c0 = r[1]
                r[1] = (n0 - 4096, c0)
            return r

    s2 = F.open_store(store_dir)
    got = s2.read(keys, F.allocator(), lambda h: None, engine=ShortPayload())
    assert got[0] is None and got[1] is not None
    assert s2.stats.read_errors == 1 and s2.stats.corrupt == 0
    assert os.path.exists(s.path_for(chunk_digest(keys[0])))  # kept
    h, m, bad = F.read_check(s2, keys)  # and a good read later hits
    assert h == 2 and not bad
    # a file shorter than its header says is corrupt: a miss, removed
    p = s.path_for(chunk_digest(keys[1]))
    os.truncate(p, HEADER_SIZE + 1000)
    s3 = F.open_store(store_dir)
    h, m, bad = F.read_check(s3, [keys[1]])
    assert h == 0 and s3.stats.corrupt == 1 and not os.path.exists(p)
    for x in (s, s2, s3):
        x.close()


# ------------------------------------------------------------------ 9. real errors at start
def test_start_reports_the_real_error(tmp_path, monkeypatch):
    root = str(tmp_path / "store")
    os.mkdir(root, 0o700)
    real_stat, real_lstat, real_mkdir = os.stat, os.lstat, os.mkdir

    def eio(fn):
        def f(p, *a, **kw):
            if os.fspath(p) == root:
                raise OSError(errno.EIO, os.strerror(errno.EIO), root)
            return fn(p, *a, **kw)

        return f

    def mkdir(p, *a, **kw):
        if os.fspath(p) == root:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), root)
        return real_mkdir(p, *a, **kw)

    monkeypatch.setattr(os, "stat", eio(real_stat))
    monkeypatch.setattr(os, "lstat", eio(real_lstat))
    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(ConfigError) as ei:
        ChunkStore(FxOptions.from_mapping({"path": root}))
    monkeypatch.undo()
    msg = str(ei.value)
    assert "Input/output error" in msg and "File exists" not in msg and msg.startswith("path:"), msg


# ------------------------------------------------------------------ 10. auth_key
KEY = "k" * 8 + "0123456789abcdef"


def test_a_peer_with_another_auth_key_is_named_not_taken_for_damage(store_dir):
    """Two processes on one store with different auth_keys (or one with none)
    remove each other's chunks on every read: by design, a chunk without
    this key's MAC is not served. It was said and counted as damage ("chunk
    file ... is bad", lmcache_fx_corrupt_total), so an operator looked for a
    failing disk. It is counted apart (unauthenticated) and the warning names
    the setting every process must share."""
    src = F.Chunks()
    other = F.open_store(store_dir, auth_key="another key, 16+ bytes")
    keyless = F.open_store(store_dir)
    try:
        assert other.write([src.item("by-other-key", 4096)]) == [True]
        assert keyless.write([src.item("by-no-key", 4096)]) == [True]
    finally:
        other.close()
        keyless.close()
    with F.LogCount() as logs:
        s = F.open_store(store_dir, auth_key=KEY)
        try:
            assert F.read_check(s, ["by-other-key", "by-no-key"])[:2] == (0, 2)
            st = s.stats.snapshot()
            assert st["unauthenticated"] == 2 and st["corrupt"] == 0, st
        finally:
            s.close()
    said = [r.getMessage() for r in logs.records if "refused" in r.getMessage()]
    assert said and "must set the same auth_key" in said[0] and "is bad" not in said[0], said
    assert "MAC does not verify with auth_key" in said[0] or "no MAC" in said[0]


def test_auth_key(store_dir, tmp_path, monkeypatch):
    """Chunks planted without the key (or with another) are misses and are
    removed; with the key, hits. Old files (no MAC) stay readable without a key."""
    keyed = F.open_store(store_dir, auth_key=KEY)
    plain = F.open_store(store_dir)
    other = F.open_store(str(tmp_path / "other"), auth_key="another key, 16+ bytes")
    src = F.Chunks()
    checks = {}
    k1 = [f"auth/keyed/{i}" for i in range(4)]
    assert all(keyed.write([src.item(k, 65536 + 100 * i) for i, k in enumerate(k1)]))
    checks["keyed_read_by_keyed"] = F.read_check(F.open_store(store_dir, auth_key=KEY), k1)[0]
    checks["keyed_read_without_key"] = F.read_check(F.open_store(store_dir), k1)[0]  # compatible
    # planted by a holder of no key: valid CRCs, right name, right header key
    k2 = [f"auth/planted/{i}" for i in range(4)]
    plain.write([src.item(k, 65536, version=666) for k in k2])
    # planted by a holder of another key, renamed into the store
    k3 = [f"auth/otherkey/{i}" for i in range(4)]
    other.write([src.item(k, 65536, version=667) for k in k3])
    for k in k3:
        dst = keyed.path_for(chunk_digest(k))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(other.path_for(chunk_digest(k)), dst)
    # a keyed chunk with its payload changed and verify off (the MAC covers the payload)
    nov = F.open_store(store_dir, auth_key=KEY, verify=False)
    k4 = "auth/tampered"
    nov.write([src.item(k4, 65536)])
    with open(nov.path_for(chunk_digest(k4)), "r+b") as f:
        f.seek(HEADER_SIZE + 5000)
        f.write(b"\x01")
    reader = F.open_store(store_dir, auth_key=KEY)
    h2, m2, _ = F.read_check(reader, k2)
    h3, m3, _ = F.read_check(reader, k3)
    h4, _, _ = F.read_check(F.open_store(store_dir, auth_key=KEY, verify=False), [k4])
    removed = sum(not os.path.exists(reader.path_for(chunk_digest(k))) for k in k2 + k3)
    # rewritten by a key holder, they hit
    keyed.write([src.item(k, 65536) for k in k2])
    h5, _, bad5 = F.read_check(reader, k2)
    # key sources
    monkeypatch.setenv("FX_TEST_KEY", KEY)
    kf = tmp_path / "key"
    kf.write_text(KEY + "\n")
    via_env = F.open_store(store_dir, auth_key="env:FX_TEST_KEY")
    via_file = F.open_store(store_dir, auth_key=f"file:{kf}")
    checks["env_and_file_keys_read"] = (F.read_check(via_env, k1)[0], F.read_check(via_file, k1)[0])
    refused = []
    for bad in ("short", "env:FX_NO_SUCH_VAR_16", f"file:{tmp_path}/nokey", 5):
        try:
            FxOptions.from_mapping({"path": store_dir, "auth_key": bad})
        except ConfigError as e:
            refused.append(str(e).startswith("auth_key:"))
    # cost: keyed BLAKE2b over 64 MiB in memory
    buf = bytearray(os.urandom(1 << 20)) * 64
    secs = []
    for _ in range(3):
        t = time.perf_counter()
        hashlib.blake2b(buf, key=b"x" * 32, digest_size=32).digest()
        secs.append(time.perf_counter() - t)
    gbps = len(buf) / min(secs) / 1e9
    F.figure(
        "auth_key: chunks planted by a group member without the key (valid CRCs, right name and header "
        "key), with another key, and a keyed chunk's payload changed under verify: false",
        len(k2) + len(k3) + 1,
        "planted chunks are misses and are removed; a key holder's rewrite hits; "
        "keyed files read by readers without a key; env:/file: keys; bad keys refused naming the option",
        planted_no_key_served=h2,
        planted_other_key_served=h3,
        tampered_served=h4,
        planted_removed=removed,
        rewritten_by_key_holder_hits=h5,
        wrong_chunks_served=h2 + h3 + h4 + len(bad5),
        **checks,
        bad_keys_refused=f"{sum(refused)}/4",
        mac_gb_per_s_64MiB=round(gbps, 2),
    )
    assert checks["keyed_read_by_keyed"] == 4 and checks["keyed_read_without_key"] == 4
    assert h2 == h3 == h4 == 0 and m2 == m3 == 4 and removed == 8
    assert h5 == 4 and not bad5 and checks["env_and_file_keys_read"] == (4, 4) and refused == [True] * 4


# ------------------------------------------------------------------ 11. simulated power loss
def test_power_loss_valid_header_over_bad_payload(store_dir):
    """What a power cut can leave when data is not fsynced: the header
    written, the payload zeroed (blocks never written) or cut short."""
    s = F.open_store(store_dir)
    src = F.Chunks()
    keys = [f"power/{i}" for i in range(12)]
    assert all(s.write([src.item(k, 65536 * (1 + i % 3) + 77) for i, k in enumerate(keys)]))
    pristine = {k: open(s.path_for(chunk_digest(k)), "rb").read() for k in keys}

    def damage():
        for i, k in enumerate(keys):
            d = bytearray(pristine[k])
            if i % 3 == 0:
                d[HEADER_SIZE:] = bytes(len(d) - HEADER_SIZE)  # zeroed payload
            elif i % 3 == 1:
                d = d[: HEADER_SIZE + (len(d) - HEADER_SIZE) // 2]  # partial payload
            else:
                d[HEADER_SIZE + 4096 : HEADER_SIZE + 8192] = bytes(4096)  # one block never written
            with open(s.path_for(chunk_digest(k)), "wb") as f:
                f.write(d)

    res = {}
    for name, opts in (
        ("verify_on", {}),
        ("verify_off", {"verify": False}),
        ("verify_off_auth_key", {"verify": False, "auth_key": KEY}),
    ):
        if name == "verify_off_auth_key":  # the chunks must have been written with the key
            w = F.open_store(store_dir, auth_key=KEY)
            for k in keys:
                w.remove(k)
            w.write([src.item(k, 65536 * (1 + i % 3) + 77) for i, k in enumerate(keys)])
            pristine = {k: open(s.path_for(chunk_digest(k)), "rb").read() for k in keys}
            w.close()
        damage()
        r = F.open_store(store_dir, **opts)
        h, m, bad = F.read_check(r, keys)
        res[name] = {"hits": h, "misses": m, "wrong": len(bad)}
        r.close()
        for k in keys:  # restore for the next configuration
            with open(s.path_for(chunk_digest(k)), "wb") as f:
                f.write(pristine[k])
    s.close()
    F.figure(
        "Simulated power loss: a valid header over a zeroed, partial or partly unwritten payload",
        len(keys) * 3,
        "verify on: always a miss; verify off: a short file is a miss, a full-length bad payload is served "
        "(what verify is for); verify off + auth_key: a miss",
        **res,
    )
    assert res["verify_on"] == {"hits": 0, "misses": 12, "wrong": 0}
    assert res["verify_off_auth_key"] == {"hits": 0, "misses": 12, "wrong": 0}
    assert res["verify_off"]["misses"] >= 4  # the partial payloads


def test_a_header_claiming_more_than_its_file_holds_is_removed_before_any_room_is_sought(tmp_path):
    """Someone with write access (no auth_key needed for this) replaces a
    chunk's file with a valid header alone, whose shapes claim 2 GiB: the
    store must not ask for 2 GiB before it has seen the payload (LMCache's
    allocator waits forever for room it cannot have). A process that read
    the chunk before misses once and then reads the header anew; one that
    never read it checks at once: both find the file shorter than its header
    says, a corrupt chunk, removed."""
    from lmcache_fx.core.chunkfile import ChunkMeta, encode_header

    key = "model@1@0@00000000000000aa@bfloat16"
    huge = ChunkMeta(((2, 4, 1 << 20, 128),), ("bfloat16",), "KV_2LTD")
    asked: list[int] = []

    def allocate(meta):
        n = 2 * 4 * 128 * (1 << 20) * 2 if meta == huge else F.allocator()(meta)
        asked.append(n if isinstance(n, int) else n[2])
        return None if isinstance(n, int) else n

    for knew in (True, False):
        path = str(tmp_path / f"s{knew}")
        w = F.open_store(path)
        r = F.open_store(path)
        try:
            src = F.Chunks()  # holds the source buffer while it is written
            assert w.write([src.item(key, 64 * 1024)]) == [True]
            if knew:
                assert F.read_check(r, [key]) == (1, 0, [])
            hb = _fxio.HostBuffer(HEADER_SIZE, hugepages=False)
            encode_header(hb, key, huge, 2 * 4 * 128 * (1 << 20) * 2, 0, time.time_ns())
            victim = w.path_for(chunk_digest(key))
            with open(victim + ".planted", "wb") as f:
                f.write(bytes(memoryview(hb)[:HEADER_SIZE]))
            os.replace(victim + ".planted", victim)
            asked.clear()
            for _ in range(2 if knew else 1):
                assert r.read([key], allocate, lambda h: None) == [None]
            assert not os.path.exists(victim) and r.stats.snapshot()["corrupt"] == 1, knew
            assert max(asked, default=0) < 1 << 30  # nothing of what the header claimed was asked for
        finally:
            r.close()
            w.close()


@pytest.mark.parametrize("odirect", [False, True])
def test_fifo_in_a_chunks_place_before_its_header_is_read_is_a_miss(tmp_path, odirect, request):
    """A store that found a chunk by its scan reads its header (phase 1)
    with a plain open: a FIFO put in the file's place then blocked that open
    for ever (until some writer came), and with it the read and every
    reader after it. Now the open does not wait, and anything but a regular
    file there is a miss, with a warning; the good chunk beside it hits."""
    if odirect:
        why = loopfs.why_not_available()
        if why is not None:
            pytest.skip(f"O_DIRECT needs the XFS loop store: {why}")
        root = request.getfixturevalue("xfs_store")
    else:
        root = str(tmp_path / "store")
    src = F.Chunks()
    s1 = F.open_store(root)
    assert s1.write([src.item("fifo/0", 65536), src.item("fifo/1", 65536)]) == [True, True]
    s1.close()
    s2 = F.open_store(root)  # its scan indexes both; neither header read yet
    p = s2.path_for(chunk_digest("fifo/0"))
    os.unlink(p)
    os.mkfifo(p, 0o600)
    with F.LogCount() as logs:
        out, took, hung = _in_thread(lambda: F.read_check(s2, ["fifo/0", "fifo/1"]), 20)
        warned = logs.count(logging.WARNING, "cannot open")
    try:
        assert not hung, "a read blocked on a FIFO in a chunk's place"
        assert out[:2] == (1, 1) and not out[2] and warned == 1
    finally:
        if hung:  # free the stuck open: it waits for a writer
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        s2.close()


@pytest.mark.parametrize("pid", ["99999999999999999999", "-1", "0"])
def test_temporary_named_with_no_process_pid_is_judged_by_age(tmp_path, pid):
    """`<digest>.fxkv.tmp.<pid>` with a pid no process can have: os.kill
    raised OverflowError out of the scan (the store would not start, and
    writes and eviction raised after a rescan), or with -1 or 0 signalled a
    group and took it for alive. Such a name is judged by its age alone: kept
    while young, removed as stale when old, and the store works beside it."""
    root = str(tmp_path / "store")
    src = F.Chunks()
    s = F.open_store(root, max_capacity_gb=1)
    assert s.write([src.item("tmp/0", 65536)]) == [True]
    fan = os.path.dirname(s.path_for(chunk_digest("tmp/0")))
    s.close()
    young = os.path.join(fan, f"junk.fxkv{TMP_MARK}{pid}")
    with open(young, "wb") as f:
        f.write(b"x")
    now = time.time()
    assert not layout.tmp_is_stale(os.path.basename(young), now, now)
    assert layout.tmp_is_stale(os.path.basename(young), now - layout.STALE_TMP_SECONDS - 1, now)
    s = F.open_store(root, max_capacity_gb=1)
    try:
        s._rescan_soon = True  # what a skipped ledger update asks for: the next write walks the store
        assert s.write([src.item("tmp/1", 65536)]) == [True]
        assert F.read_check(s, ["tmp/0", "tmp/1"])[:2] == (2, 0)
        assert os.path.exists(young)  # young: not removed
    finally:
        s.close()


@pytest.mark.skipif(not layout.SEAT_TAG or layout.BOOT_TIME is None, reason="no boot id or boot time here")
def test_a_temporary_of_an_earlier_boot_is_stale_at_once(tmp_path):
    """After a crash and reboot, the temporaries of this host's writers
    waited an hour (their host tag, which names the boot, is not this one's:
    judged by age), counted in the usage. One of this host name and pid
    namespace (its seat tag) under another host tag, older than this boot,
    is stale at once; another seat's, or one written since the boot, is
    still judged by age (a same-named host's live writer on a network store)."""
    boot, seat = layout.BOOT_TIME, layout.SEAT_TAG
    earlier = f"{'ab' * 16}.fxkv{TMP_MARK}4242.7.0badb007.{seat}"
    spare = f"{'ab' * 16}.fxkv{TMP_MARK}4242.spare3.0badb007.{seat}"
    other_seat = f"{'ab' * 16}.fxkv{TMP_MARK}4242.7.0badb007.5ea75ea7"
    assert layout.tmp_is_stale(earlier, boot - 1, boot + 60)
    assert layout.tmp_is_stale(spare, boot - 1, boot + 60)
    assert not layout.tmp_is_stale(earlier, boot + 1, boot + 60)  # written since this boot
    assert not layout.tmp_is_stale(other_seat, boot - 1, boot + 60)
    mine = f"{'ab' * 16}.fxkv{TMP_MARK}{os.getpid()}.7.{HOST_TAG}.{seat}"  # this boot's: judged by its pid
    assert not layout.tmp_is_stale(mine, boot - 1, boot + 60)
    # A store starting on the directory removes it
    root = str(tmp_path / "store")
    src = F.Chunks()
    s = F.open_store(root, max_capacity_gb=1)
    assert s.write([src.item("boot/0", 65536)]) == [True]
    path = s.path_for(chunk_digest("boot/0")) + f"{TMP_MARK}4242.7.0badb007.{seat}"
    s.close()
    with open(path, "wb") as f:
        f.write(b"x" * 4096)
    os.utime(path, (boot - 1, boot - 1))
    s = F.open_store(root, max_capacity_gb=1)
    try:
        assert not os.path.exists(path) and s.usage_bytes == s._walk(remove_stale=False)[1]
    finally:
        s.close()
    # The store's own temporaries carry both tags
    assert store_mod._tmp_name("/x/y.fxkv").endswith(f".{HOST_TAG}.{seat}")


def test_a_last_recompute_in_the_future_is_due(tmp_path):
    """A ledger whose last recompute lies in the future (written by a process
    whose clock ran a day ahead, or before the clock was stepped back) made
    every running store wait for that time to pass before its next walk: a
    dead writer's temporary and its reserved bytes stayed meanwhile."""
    root = str(tmp_path / "store")
    src = F.Chunks()
    s = F.open_store(root, max_capacity_gb=1)
    try:
        assert s.write([src.item("clock/0", 65536)]) == [True]
        dead = s.path_for(chunk_digest("clock/1")) + f"{TMP_MARK}999999999.1.{HOST_TAG}"
        os.makedirs(os.path.dirname(dead), exist_ok=True)
        with open(dead, "wb") as f:
            f.write(b"x" * 8192)
        with s._ledger.hold():
            usage = s._ledger.get()[0]
            s._ledger.put(usage + 8192, time.time() + 86400)  # its reservation; a recompute a day ahead
        assert s._recompute_due()
        s._recompute()
        assert F.tmp_files(root) == [] and s.usage_bytes == sum(os.path.getsize(f) for f in F.chunk_files(root))
        assert abs(s._ledger.get()[1] - time.time()) < 60  # the record's time is this clock's again
        with s._ledger.hold():
            s._ledger.put(s._ledger.get()[0], time.time() + 30)  # a peer's clock a little ahead: not due
        assert not s._recompute_due()
        # A peer whose clock runs 10 min ahead recomputes too and stamps its time: due again at once,
        # each host's stamp the other's, was a whole walk per write. Once an interval, by this clock.
        with s._ledger.hold():
            s._ledger.put(s._ledger.get()[0], time.time() + 600)
        assert not s._recompute_due()
    finally:
        s.close()


def test_one_lock_timeout_does_not_make_ordinary_contention_fail(tmp_path, monkeypatch):
    """After a wait for the store lock ran out, calls for the next
    LOCK_TIMEOUT seconds wait briefly; each such brief wait that failed
    under ordinary contention (threads holding the lock for milliseconds)
    restarted that window, so one stall made the process skip stores for as
    long as it stayed busy. A brief wait that fails no longer prolongs it:
    after it, the lock is had again under the same contention."""
    monkeypatch.setattr(ledger, "LOCK_TIMEOUT", 0.3)
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    led = ledger.Ledger.open(str(root), 0o600, 0o700, False)
    try:

        def long_hold():
            with led.hold():
                time.sleep(0.6)

        t = threading.Thread(target=long_hold)
        t.start()
        time.sleep(0.05)
        with pytest.raises(ledger.LockTimeout):
            with led.hold():
                pass
        window_end = led._stalled_until
        t.join()
        failed = []
        stop = time.monotonic() + 1.5  # five windows of LOCK_TIMEOUT

        def busy():
            while time.monotonic() < stop:
                try:
                    with led.hold():
                        time.sleep(0.002)
                except ledger.LockTimeout:
                    failed.append(time.monotonic())
                time.sleep(0.001)  # some work between holds, as a store does

        ts = [threading.Thread(target=busy) for _ in range(2)]
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        # a brief wait may still lose to a holder now and then inside the first window; none after it
        assert not [x for x in failed if x > window_end] and led._stalled_until == window_end
    finally:
        led.release()
