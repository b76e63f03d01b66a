"""reuse_evicted: a store that must evict writes the new chunk into the
evicted chunk's file, but only when nobody can be reading that file: no
reader holds its read lock (every read of a store on a local filesystem
locks each chunk file it opens), and no process whose reads take no locks
(a store on a network filesystem, fsck) has the store open. Real files,
real engine, real processes; XFS on a RAM loop device where root allows."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from faults import fxfault as F  # noqa: E402

from lmcache_fx._fxio import crc32c  # noqa: E402
from lmcache_fx.core import medium  # noqa: E402
from lmcache_fx.core import store as store_mod  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest, decode_header, unflagged_chunk  # noqa: E402
from lmcache_fx.core.drive import _run_step, drive_blocking  # noqa: E402
from lmcache_fx.core.layout import read_lock  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402

CHUNK = 64 * 1024
FILE = HEADER_SIZE + CHUNK
KEYS = [f"model@1@0@{h:016x}@bfloat16" for h in range(12)]


def _open(path, **opts) -> ChunkStore:
    return F.open_store(path, max_capacity_gb=(4 * FILE + 100) / (1 << 30), **opts)  # room for 4 chunks


def _fill(s: ChunkStore, keys) -> list[int]:
    """Writes keys one at a time (each write past 4 evicts the oldest);
    returns the inode each key landed in."""
    src = F.Chunks()
    inodes = []
    for k in keys:
        assert s.write([src.item(k, CHUNK)]) == [True]
        inodes.append(os.stat(s.path_for(chunk_digest(k))).st_ino)
    return inodes


def _peer(code: str) -> subprocess.Popen:
    """Another process running `code`, once it has printed READY; it ends
    when its stdin closes (communicate)."""
    peer = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(HERE),
    )
    assert peer.stdout.readline().strip() == "READY"
    return peer


# Makes stores opened from then on read without file locks, as on a network filesystem.
_UNLOCKED = "import lmcache_fx.core.medium as m; m.locks_reads = lambda roots: False"


def _store_peer(store_dir: str, at_end: str = "", unlocked: bool = False) -> subprocess.Popen:
    """Another process with the store at store_dir open (a _peer), its reads
    without file locks if `unlocked`; it runs `at_end` when its stdin closes,
    then closes the store."""
    return _peer(
        f"import sys; sys.path.insert(0, {HERE!r}); {_UNLOCKED if unlocked else 'pass'}; "
        f"from faults import fxfault as F; s = F.open_store({store_dir!r}); "
        f"print('READY', flush=True); sys.stdin.read(); {at_end or 'pass'}; s.close()"
    )


def _check_store(s: ChunkStore, present, absent) -> None:
    hits, misses, bad = F.read_check(s, present)
    assert (hits, misses, bad) == (len(present), 0, [])
    assert F.read_check(s, absent)[:2] == (0, len(absent))


@pytest.fixture(params=["tmp", "xfs"])
def store_dir(request, tmp_path):
    """The store's path: on the test's tmp filesystem, and on XFS on a RAM
    loop device (O_DIRECT) where root allows (skipped otherwise, with why)."""
    if request.param == "tmp":
        return str(tmp_path / "store")
    return os.path.join(request.getfixturevalue("xfs_store"), "store")


def test_a_batch_that_reuses_its_victims_creates_no_file(store_dir, monkeypatch):
    """A store that will evict (as its last usage says) makes its temporaries
    under the ledger, after the eviction: an adopted victim becomes the
    temporary, so no file is created for it (and none is unlinked)."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])  # full
        created = []
        real_open = os.open

        def spy(path, flags, *a, **k):
            if flags & os.O_CREAT:
                created.append(path)
            return real_open(path, flags, *a, **k)

        monkeypatch.setattr(store_mod.os, "open", spy)
        src = F.Chunks()
        assert s.write([src.item(k, CHUNK) for k in KEYS[4:8]]) == [True] * 4
        assert (s.stats.snapshot()["evictions"], s.stats.snapshot()["recycled"]) == (4, 4)
        assert created == []
        # Two chunks of another size: no victim fits them, so their temporaries are made under the ledger.
        big = 2 * CHUNK
        assert s.write([src.item(k, big) for k in KEYS[8:10]]) == [True] * 2
        assert len(created) == 2 and s.stats.snapshot()["recycled"] == 4
        monkeypatch.undo()
        _check_store(s, KEYS[8:10], KEYS[:8])  # the big ones took the whole store
        assert s.usage_bytes == sum(os.path.getsize(p) for p in F.chunk_files(store_dir)) == 2 * (HEADER_SIZE + big)
        assert not [n for _, _, names in os.walk(store_dir) for n in names if store_mod.TMP_MARK in n]
    finally:
        s.close()


def test_evicted_files_are_reused_when_alone(store_dir):
    s = _open(store_dir)
    try:
        inodes = _fill(s, KEYS[:8])
        st = s.stats.snapshot()
        assert st["evictions"] == 4 and st["recycled"] == 4
        assert set(inodes[4:]) == set(inodes[:4])  # chunks 5..8 live in the files of 1..4
        _check_store(s, KEYS[4:8], KEYS[:4])  # bit-exact (CRC32C and payload pattern), evicted ones miss
        assert s.usage_bytes == sum(os.path.getsize(p) for p in F.chunk_files(store_dir)) == 4 * FILE
        assert len(F.chunk_files(store_dir)) == 4
    finally:
        s.close()
    s = _open(store_dir)  # a restart finds exactly the four newest
    try:
        _check_store(s, KEYS[4:8], KEYS[:4])
        src = F.Chunks()  # one batch that evicts the whole store: one eviction, every file reused
        assert s.write([src.item(k, CHUNK) for k in KEYS[8:12]]) == [True] * 4
        assert (s.stats.snapshot()["evictions"], s.stats.snapshot()["recycled"]) == (4, 4)
        _check_store(s, KEYS[8:12], KEYS[:8])
    finally:
        s.close()


def test_a_full_store_finds_its_victims_without_rescanning(store_dir):
    """Chunks a store writes join its evictor's list, so a store that
    evicts a batch per batch it writes does not walk every directory again
    each time; what it evicts is still the oldest."""
    s = _open(store_dir)
    try:
        src = F.Chunks()
        assert s.write([src.item(k, CHUNK) for k in KEYS[:4]]) == [True] * 4
        scans = s.stats.snapshot()["scans"]
        for j in (4, 8):
            assert s.write([src.item(k, CHUNK) for k in KEYS[j : j + 4]]) == [True] * 4
        st = s.stats.snapshot()
        assert st["evictions"] == 8 and st["scans"] <= scans + 1, st  # at most the first eviction's scan
        _check_store(s, KEYS[8:12], KEYS[:8])
    finally:
        s.close()


def test_an_evictor_refreshes_its_victim_list_without_the_store_lock(store_dir, monkeypatch):
    """An old victim list is rebuilt by a walk made before the store lock is
    taken (a large store's walk takes seconds, and peers' stores wait on the
    lock); a victim touched after that walk (a peer's hit) is kept: the
    evictor checks each one's mtime under the lock."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])  # full
        s._victims_at = -1e9  # the list is old
        depths = []
        real = s._walk

        def walk(*a, **k):
            depths.append(s._ledger.depth)
            out = real(*a, **k)
            t = time.time_ns()
            os.utime(s.path_for(chunk_digest(KEYS[0])), ns=(t, t))  # the oldest is read meanwhile
            return out

        monkeypatch.setattr(s, "_walk", walk)
        src = F.Chunks()
        assert s.write([src.item(KEYS[4], CHUNK)]) == [True]
        assert depths == [0]  # one walk, and the store lock not held for it
        _check_store(s, [KEYS[0], KEYS[2], KEYS[3], KEYS[4]], [KEYS[1]])
    finally:
        s.close()


def test_a_slow_walk_makes_ledger_rescans_rarer(store_dir, monkeypatch):
    """The ledger is recomputed from the files every RESCAN_SECONDS, or
    every SCAN_DUTY walks' time when a walk is slow (a store of millions of
    files), so the lock is not held for walks most of the time."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:1])
        rescans = []
        real = s._recompute
        monkeypatch.setattr(s, "_recompute", lambda: rescans.append(1) or real())
        src = F.Chunks()
        for i, walk_s in ((1, 10.0), (2, 0.0)):
            with s._ledger.hold():
                s._ledger.put(s._ledger.get()[0], time.time() - 2 * store_mod.RESCAN_SECONDS)
            s._walk_seconds = walk_s  # 10 s walks: a rescan at most every 1000 s
            assert s.write([src.item(KEYS[i], CHUNK)]) == [True]
            assert len(rescans) == (0 if walk_s else 1)
        assert s.usage_bytes == 3 * FILE
    finally:
        s.close()


def _lock_depths(monkeypatch, s: ChunkStore, target, name: str) -> list[int]:
    """From now on, each call of target.name appends the nesting depth of the
    store lock (0: not held) to the list returned."""
    depths: list[int] = []
    real = getattr(target, name)

    def spy(*a, **k):
        depths.append(s._ledger.depth)
        return real(*a, **k)

    monkeypatch.setattr(target, name, spy)
    return depths


def _drifted(s: ChunkStore, store_dir: str) -> str:
    """Two chunks in the store, then a chunk file removed behind its back (the
    ledger overcounts by FILE) and a dead writer's temporary of 100 bytes that
    the ledger counts (it reserved them); the ledger's recompute made due.
    Returns the temporary's path."""
    _fill(s, KEYS[:3])
    os.unlink(s.path_for(chunk_digest(KEYS[0])))
    stale = s.path_for(chunk_digest(KEYS[1])) + f"{store_mod.TMP_MARK}999999999.1.{store_mod.HOST_TAG}"
    with open(stale, "wb") as f:
        f.write(b"x" * 100)
    os.utime(stale, (1, 1))
    with s._ledger.hold():
        s._ledger.put(s._ledger.get()[0] + 100, time.time() - 2 * store_mod.RESCAN_SECONDS)
    assert s.usage_bytes == 3 * FILE + 100
    return stale


def test_the_periodic_ledger_recompute_walks_without_the_store_lock(store_dir, monkeypatch):
    """Every RESCAN_SECONDS the ledger is recomputed from the files by a walk
    made without the store lock (at a million chunks a walk takes seconds;
    every writer of every process waits on the lock, and gives up its store
    after LOCK_TIMEOUT). Nothing changed during the walk, so its count
    replaces the ledger, exactly: the removed file and the dead writer's
    temporary leave it, and the temporary is removed."""
    s = _open(store_dir)
    try:
        stale = _drifted(s, store_dir)
        depths = _lock_depths(monkeypatch, s, s, "_walk")
        src = F.Chunks()
        t0 = time.time()
        assert s.write([src.item(KEYS[3], CHUNK)]) == [True]
        assert depths == [0]  # one walk, the store lock not held for it
        assert not os.path.exists(stale)
        assert s.usage_bytes == 3 * FILE  # KEYS[1:4]: the files, exactly
        with s._ledger.hold():
            assert s._ledger.get()[1] >= t0  # recomputed by this write: not due again
    finally:
        s.close()


def test_a_recompute_over_a_store_that_changed_meanwhile_keeps_its_ledger(store_dir, monkeypatch):
    """A walk made without the lock while the ledger changed (a peer stored or
    evicted) may have counted a file before or after that change: its count
    is dropped, not written. Dead writers' temporaries are still removed and
    their bytes taken from the ledger; the rest of the drift waits until
    VICTIM_LIST_SECONDS later, when a walk over an unchanged store counts."""
    s = _open(store_dir)
    try:
        stale = _drifted(s, store_dir)
        real = s._walk

        def busy_walk(*a, **k):
            out = real(*a, **k)
            with s._ledger.hold():
                s._ledger_add_locked(0)  # a peer's commit meanwhile
            return out

        monkeypatch.setattr(s, "_walk", busy_walk)
        src = F.Chunks()
        assert s.write([src.item(KEYS[3], CHUNK)]) == [True]
        assert not os.path.exists(stale)
        assert s.usage_bytes == 4 * FILE  # the temporary's 100 bytes gone; the removed file still counted
        monkeypatch.setattr(s, "_walk", real)
        assert s.write([src.item(KEYS[4], CHUNK)]) == [True]  # the retry is not due yet
        assert s.usage_bytes == 4 * FILE  # KEYS[4] in, the oldest file (KEYS[1]) evicted: still overcounting
        s._recompute_after = 0.0  # VICTIM_LIST_SECONDS later
        assert s.write([src.item(KEYS[5], CHUNK)]) == [True]
        assert s.usage_bytes == 4 * FILE  # exact once a walk saw no change: KEYS[2:6]
        _check_store(s, KEYS[2:6], KEYS[:2])
    finally:
        s.close()


def test_a_store_opening_beside_a_peer_walks_without_the_lock(store_dir, monkeypatch):
    """At start a store walks every directory. Alone, it does so under the
    store lock and recomputes the ledger (removing dead writers'
    temporaries); beside a process that has the store open (a restarted TP
    rank's peers), without the lock, trusting the ledger they keep, so
    their stores do not wait for the walk."""
    s = _open(store_dir)
    _fill(s, KEYS[:3])
    s.close()
    depths = []
    real = store_mod.ChunkStore._walk

    def walk(self, *a, **k):
        depths.append(self._ledger.depth)
        return real(self, *a, **k)

    monkeypatch.setattr(store_mod.ChunkStore, "_walk", walk)
    stale = s.path_for(chunk_digest(KEYS[0])) + f"{store_mod.TMP_MARK}999999999.1.{store_mod.HOST_TAG}"
    for peer in (True, False):
        p = _store_peer(store_dir) if peer else None
        with open(stale, "wb") as f:  # a dead writer's temporary (after the peer's own start-up walk)
            f.write(b"x" * 100)
        os.utime(stale, (1, 1))
        try:
            depths.clear()
            s = _open(store_dir)
            try:
                assert depths == [0 if peer else 1]
                assert os.path.exists(stale) == peer  # removed by the locked walk only
                _check_store(s, KEYS[:3], KEYS[3:4])
                assert s.usage_bytes == 3 * FILE  # the ledger: kept by the peer, or recomputed
            finally:
                s.close()
        finally:
            if p is not None:
                p.communicate("")


def test_evicted_digests_are_kept_only_for_a_caller_that_takes_them(store_dir, monkeypatch):
    """take_evicted(): None (unknown) at the first call, since nothing is
    kept for a store user that never asks; then the digests evicted since
    the last call, in order; None again when more than EVICTED_KEPT piled up."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:5])  # the fifth evicts KEYS[0]; nobody has asked yet
        assert s._evicted is None and s.take_evicted() is None
        _fill(s, KEYS[5:7])
        assert s.take_evicted() == [chunk_digest(KEYS[1]), chunk_digest(KEYS[2])]
        assert s.take_evicted() == []
        monkeypatch.setattr(store_mod, "EVICTED_KEPT", 1)
        _fill(s, KEYS[7:9])
        assert s.take_evicted() is None and s.take_evicted() == []
    finally:
        s.close()


def test_a_commit_sets_the_lru_clock_outside_the_store_lock_unless_it_trims(store_dir, monkeypatch):
    """A finished file's mtime (the LRU clock) is set before the store lock
    is taken (O_DIRECT stores: in C, by Engine.write_chunks), unless its size needs a trim, which would set it again: then
    after the trim, under the lock. Either way each chunk's mtime is the
    one the store gave it, newer for the later chunk."""
    s = _open(store_dir)
    try:
        depths = _lock_depths(monkeypatch, s, os, "utime")
        src = F.Chunks()
        assert s.write([src.item(KEYS[0], CHUNK)]) == [True]
        assert s.write([src.item(KEYS[1], CHUNK - 100)]) == [True]  # not a multiple of 4 KiB: trimmed
        monkeypatch.undo()
        assert depths == ([1] if s.odirect else [0, 1])
        m0, m1 = (os.stat(s.path_for(chunk_digest(k))).st_mtime_ns for k in KEYS[:2])
        assert m0 < m1 and os.path.getsize(s.path_for(chunk_digest(KEYS[1]))) == HEADER_SIZE + CHUNK - 100
        _check_store(s, KEYS[:2], KEYS[2:3])
    finally:
        s.close()


def test_an_odirect_store_writes_a_batch_in_one_c_call_and_renames_under_the_lock(store_dir, monkeypatch):
    """O_DIRECT stores write a batch's payloads, headers (each payload's
    CRC32C filled in in C) and LRU clocks with one Engine.write_chunks call,
    one pipeline per chunk. The renames stay in the commit, under the store
    lock, so a ledger recompute that walked meanwhile is told. Every header
    carries its payload's CRC, every chunk reads back verified, the clocks
    follow the batch's order, and a chunk that needs a trim gets its clock
    after the trim, under the lock."""
    s = F.open_store(store_dir, max_capacity_gb=(8 * FILE) / (1 << 30))  # no eviction here
    real = s.engine
    try:
        if not s.odirect:
            pytest.skip(f"{store_dir} does not take O_DIRECT: its stores write through Engine.write")
        calls = []

        class Counting:
            def __getattr__(self, name):
                return getattr(real, name)

            def write(self, ops, **kw):
                calls.append(("write", len(ops)))
                return real.write(ops, **kw)

            def write_chunks(self, chunks, **kw):
                calls.append(("write_chunks", len(chunks)))
                return real.write_chunks(chunks, **kw)

        s.engine = Counting()
        renames = _lock_depths(monkeypatch, s, os, "rename")  # a key stored before: replaced
        new_names = _lock_depths(monkeypatch, s, store_mod._fxio, "rename_noreplace")  # a new key
        utimes = _lock_depths(monkeypatch, s, os, "utime")
        src = F.Chunks()
        sizes = [CHUNK, CHUNK, CHUNK, CHUNK - 100]  # the last: not a multiple of 4 KiB, trimmed
        assert s.write([src.item(k, n) for k, n in zip(KEYS[:3], sizes)]) == [True] * 3
        assert s.write([src.item(KEYS[3], sizes[3])]) == [True]
        s.engine = real
        monkeypatch.undo()
        assert calls == [("write_chunks", 3), ("write_chunks", 1)]
        assert renames == [] and new_names == [1] * 4 and utimes == [1]
        files = [s.path_for(chunk_digest(k)) for k in KEYS[:4]]
        m = [os.stat(p).st_mtime_ns for p in files]
        assert m[0] < m[1] < m[2] < m[3]
        for p, n in zip(files, sizes):
            with open(p, "rb") as f:
                h = decode_header(f.read(HEADER_SIZE))
                assert h.payload_len == n and h.payload_crc == crc32c(f.read())
        assert F.read_check(s, KEYS[:4]) == (4, 0, [])
        assert s.usage_bytes == sum(os.path.getsize(p) for p in F.chunk_files(store_dir))
        assert not F.tmp_files(store_dir)
    finally:
        s.engine = real
        s.close()


def test_no_reuse_when_turned_off(store_dir):
    s = _open(store_dir, reuse_evicted=False)
    try:
        inodes = _fill(s, KEYS[:8])
        st = s.stats.snapshot()
        assert st["evictions"] == 4 and st["recycled"] == 0
        _check_store(s, KEYS[4:8], KEYS[:4])
        assert inodes  # every write made a new file
    finally:
        s.close()


def test_reuse_while_another_process_reads_the_store(store_dir):
    """A peer process with the store open (TP ranks on one path) does not
    stop reuse: its reads lock the files they open. It then reads the
    reused files and gets exactly the new chunks."""
    s = _open(store_dir)
    assert s.lock_reads
    peer = _store_peer(
        store_dir, f"h, m, bad = F.read_check(s, {KEYS[4:8]!r}); print(h, m, bad, F.read_check(s, {KEYS[:4]!r})[:2])"
    )
    try:
        _fill(s, KEYS[:8])
        st = s.stats.snapshot()
        assert st["evictions"] == 4 and st["recycled"] == 4
        _check_store(s, KEYS[4:8], KEYS[:4])
    finally:
        out, _ = peer.communicate("", timeout=60)
        s.close()
    assert peer.returncode == 0 and out.split() == ["4", "0", "[]", "(0,", "4)"], out


def test_no_reuse_while_a_process_reading_without_locks_has_the_store_open(store_dir):
    s = _open(store_dir)
    peer = _store_peer(store_dir, unlocked=True)
    try:
        _fill(s, KEYS[:8])
        st = s.stats.snapshot()
        assert st["evictions"] == 4 and st["recycled"] == 0  # the peer could be reading any of them
        _check_store(s, KEYS[4:8], KEYS[:4])
    finally:
        peer.communicate("", timeout=60)
    assert peer.returncode == 0
    try:
        _fill(s, KEYS[8:10])  # the peer is gone: reuse again
        assert s.stats.snapshot()["recycled"] == 2
        _check_store(s, KEYS[6:10], KEYS[:6])
    finally:
        s.close()


def test_a_file_another_process_holds_read_locked_is_not_reused(store_dir):
    """A peer holding one chunk file open with its read lock (mid-read) keeps
    that file: it is unlinked, not rewritten, and the peer reads the chunk it
    opened, exactly; the other evicted files are reused."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])
        path = s.path_for(chunk_digest(KEYS[0]))
        code = (
            f"import os, sys; sys.path.insert(0, {HERE!r}); from faults import fxfault as F; "
            f"from lmcache_fx.core.layout import open_in; fd = open_in({path!r}, os.O_RDONLY, lock=True); "
            f"print('READY', flush=True); sys.stdin.read(); "
            f"print(F.check({KEYS[0]!r}, memoryview(os.pread(fd, {CHUNK}, {HEADER_SIZE}))))"
        )
        peer = _peer(code)
        try:
            _fill(s, KEYS[4:8])
            st = s.stats.snapshot()
            assert st["evictions"] == 4 and st["recycled"] == 3
            assert not os.path.exists(path)
        finally:
            out, _ = peer.communicate("", timeout=60)
        assert peer.returncode == 0 and out.strip() == "ok", out
        _check_store(s, KEYS[4:8], KEYS[:4])
    finally:
        s.close()


def test_a_reader_that_opened_a_file_before_it_was_reused_misses(store_dir):
    """A reader that opened a chunk file by name just before the evictor
    moved it away takes its read lock after the move: the name no longer
    holds that file, so the read is a miss (ESTALE), never the new chunk."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])
        path = s.path_for(chunk_digest(KEYS[0]))
        fd = os.open(path, os.O_RDONLY)  # opened, not yet locked
        try:
            _fill(s, KEYS[4:5])  # evicts KEYS[0]: its file now holds KEYS[4]
            assert s.stats.snapshot()["recycled"] == 1
            assert os.fstat(fd).st_ino == os.stat(s.path_for(chunk_digest(KEYS[4]))).st_ino
            with pytest.raises(OSError) as ei:
                read_lock(fd, s._rootfds[0], os.path.relpath(path, s.roots[0]))
            assert ei.value.errno == errno.ESTALE
        finally:
            os.close(fd)
    finally:
        s.close()


def test_a_read_in_flight_keeps_its_files(store_dir):
    """A chunk a read holds open (read-locked) is evicted by unlinking, so
    the read still gets the bytes that were stored, from the file it holds.
    One it has not opened yet may be reused; opened by name later it is
    gone: a miss. Never another chunk's bytes."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])
        # The two-op path (the GPU router's) opens the file before yielding its batch.
        gen = s.read_steps([KEYS[0]], F.allocator(), chunks=False)
        batch = next(gen)
        _fill(s, KEYS[4:5])  # evicts KEYS[0] while its file is open here
        assert (s.stats.snapshot()["recycled"], s.stats.snapshot()["evictions"]) == (0, 1)
        got = drive_blocking(s.engine, F.resume(gen, _run_step(s.engine, batch)), lambda h: None)
        assert got[0] is not None and F.check(KEYS[0], memoryview(got[0])) == "ok"
        # read_chunks opens in C when its step runs.
        gen = s.read_steps([KEYS[1]], F.allocator(), s._takes_chunks(s.engine))
        batch = next(gen)
        _fill(s, KEYS[5:6])  # evicts KEYS[1], not yet opened: its file is reused
        assert (s.stats.snapshot()["recycled"], s.stats.snapshot()["evictions"]) == (1, 2)
        got = drive_blocking(s.engine, F.resume(gen, _run_step(s.engine, batch)), lambda h: None)
        assert got[0] is None  # opened by path after the eviction: gone
        assert s.stats.snapshot()["corrupt"] == 0
        _check_store(s, KEYS[2:6], KEYS[:2])
    finally:
        s.close()


def test_a_chunk_rewritten_before_the_c_readers_lock_is_a_miss_not_corrupt(store_dir):
    """read_chunks locks but checks no names (a path lookup per chunk): a
    reader that opened KEYS[0]'s file just before the evictor moved it away,
    and locked it once KEYS[4] was written into it, gets a whole chunk of
    KEYS[4] (what read_chunks returns for it is replayed here on the real
    files). Its key makes it a miss, and as the name no longer holds that
    file, a chunk gone, not a corrupt one. A file at the name holding
    another key is corrupt, and removed."""
    import shutil

    from lmcache_fx import _fxio
    from lmcache_fx.core.chunkfile import decode_header
    from lmcache_fx.core.store import Entry

    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])
        path0 = s.path_for(chunk_digest(KEYS[0]))
        st0 = os.stat(path0)
        _fill(s, KEYS[4:5])  # KEYS[0]'s file now holds KEYS[4]
        path4 = s.path_for(chunk_digest(KEYS[4]))
        assert s.stats.snapshot()["recycled"] == 1 and os.stat(path4).st_ino == st0.st_ino
        with open(path4, "rb") as f:
            hdr = bytearray(f.read(HEADER_SIZE))
        meta = decode_header(hdr).meta
        ident = (st0.st_dev, st0.st_ino)
        e = Entry(path0, FILE, meta)
        assert not s._chunk_ok(KEYS[0], e, e.meta, _fxio.CHUNK_META, CHUNK, ident, FILE, memoryview(hdr), (0, 0, CHUNK))
        assert s.stats.snapshot()["corrupt"] == 0 and os.path.exists(path4)
        shutil.copyfile(path4, path0)  # a file at KEYS[0]'s name that holds KEYS[4]
        st = os.stat(path0)
        ident = (st.st_dev, st.st_ino)
        assert not s._chunk_ok(KEYS[0], e, e.meta, _fxio.CHUNK_META, CHUNK, ident, FILE, memoryview(hdr), (0, 0, CHUNK))
        assert s.stats.snapshot()["corrupt"] == 1 and not os.path.exists(path0) and os.path.exists(path4)
    finally:
        s.close()


def test_unlocked_reads_in_flight_keep_every_file(store_dir, monkeypatch):
    """Where reads take no file locks (a network filesystem), a read in
    flight in this process stops all reuse, from its first step."""
    monkeypatch.setattr(medium, "locks_reads", lambda roots: False)
    s = _open(store_dir)
    try:
        assert not s.lock_reads
        _fill(s, KEYS[:4])
        gen = s.read_steps([KEYS[1]], F.allocator(), s._takes_chunks(s.engine))
        batch = next(gen)
        _fill(s, KEYS[4:5])  # evicts KEYS[0], which the read does not even want
        assert (s.stats.snapshot()["recycled"], s.stats.snapshot()["evictions"]) == (0, 1)
        got = drive_blocking(s.engine, F.resume(gen, _run_step(s.engine, batch)), lambda h: None)
        assert got[0] is not None and F.check(KEYS[1], memoryview(got[0])) == "ok"
        _fill(s, KEYS[5:6])  # no read in flight: reuse again
        assert s.stats.snapshot()["recycled"] == 1
        _check_store(s, KEYS[2:6], KEYS[:2])
    finally:
        s.close()


def test_fsck_counts_as_a_process_with_the_store_open(store_dir):
    """lmcache-fx fsck reads chunk files of a live store: while it runs (its
    Ledger.join held in another process), stores unlink what they evict."""
    from lmcache_fx.core.ledger import Ledger

    assert Ledger.join(str(os.path.dirname(store_dir))) is None  # no store there: nothing made
    assert not os.path.exists(os.path.join(os.path.dirname(store_dir), ".fx"))
    s = _open(store_dir)
    code = (
        "import sys; from lmcache_fx.core.ledger import Ledger; led = Ledger.join(%r); "
        "print('READY' if led is not None else 'NONE', flush=True); sys.stdin.read(); led.release()"
    ) % (store_dir,)
    peer = _peer(code)
    try:
        _fill(s, KEYS[:6])
        assert (s.stats.snapshot()["evictions"], s.stats.snapshot()["recycled"]) == (2, 0)
    finally:
        peer.communicate("", timeout=60)
    try:
        _fill(s, KEYS[6:7])
        assert s.stats.snapshot()["recycled"] == 1
        _check_store(s, KEYS[3:7], KEYS[:3])
    finally:
        s.close()


def test_threads_reading_while_full_writes_reuse_files_never_see_wrong_bytes(store_dir):
    """Writer threads keep a full store evicting (reusing files no read
    holds) while reader threads read random keys: every hit is exactly its
    key's bytes, and files are reused."""
    import threading

    s = _open(store_dir)
    keys = [f"model@1@0@{h:016x}@bfloat16" for h in range(400)]
    wrong, hits, stop = [], [0], threading.Event()

    def writer(part):
        src = F.Chunks()
        for k in part:
            s.write([src.item(k, CHUNK)])

    try:
        readers = [
            threading.Thread(target=F.reads_until, args=(s, keys, stop, i, hits, wrong, 0.001)) for i in range(2)
        ]
        writers = [threading.Thread(target=writer, args=(keys[i::2],)) for i in range(2)]
        for t in readers + writers:
            t.start()
        for t in writers:
            t.join()
        stop.set()
        for t in readers:
            t.join()
        st = s.stats.snapshot()
        assert wrong == [] and st["corrupt"] == 0 and hits[0] > 0
        assert st["evictions"] >= 390 and st["recycled"] > 0, st
        assert s.usage_bytes == sum(os.path.getsize(p) for p in F.chunk_files(store_dir)) <= 4 * FILE
        _fill(s, [f"model@1@0@{h:016x}@bfloat16" for h in range(400, 404)])  # no reader left: all reused
        assert s.stats.snapshot()["recycled"] == st["recycled"] + 4
        _check_store(s, [f"model@1@0@{h:016x}@bfloat16" for h in range(400, 404)], keys[:10])
    finally:
        s.close()


def test_a_forked_child_has_its_own_ledger_and_membership(store_dir, monkeypatch):
    """A child forked after the store was opened makes its own ledger for a
    store it opens (the parent's flock description is not its lock), and is
    seen by the parent as another process with the store open (its reads
    without locks, so the parent reuses nothing while it is there)."""
    s = _open(store_dir)
    monkeypatch.setattr(medium, "locks_reads", lambda roots: False)  # for the child's store
    r, w = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: open the store, say so, wait to be told to go
        code = 1
        try:
            c = _open(store_dir)
            code = 0 if c._ledger is not s._ledger and c._ledger.members_fd >= 0 else 3
            os.write(w, b"R")
            os.read(r2, 1)
            c.close()
        finally:
            os._exit(code)
    try:
        assert os.read(r, 1) == b"R"
        _fill(s, KEYS[:6])
        assert (s.stats.snapshot()["evictions"], s.stats.snapshot()["recycled"]) == (2, 0)
    finally:
        os.write(w2, b"G")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    try:
        _fill(s, KEYS[6:7])  # the child is gone
        assert s.stats.snapshot()["recycled"] == 1
    finally:
        s.close()
        for fd in (r, w, r2, w2):
            os.close(fd)


def test_a_second_store_on_the_path_keeps_this_process_a_member(store_dir, monkeypatch):
    """Two stores of one process on one path share a ledger; opening the
    second must not drop the process's lock on .fx/members (POSIX locks go
    with any descriptor of the file closed), or another process would reuse
    files this one reads."""
    monkeypatch.setattr(medium, "locks_reads", lambda roots: False)
    s = _open(store_dir)
    s2 = _open(store_dir)
    peer = _store_peer(store_dir, "print(s._ledger.may_reuse(), flush=True)")
    try:
        out, _ = peer.communicate("", timeout=60)
    finally:
        s2.close()
        s.close()
    assert peer.returncode == 0 and out.strip() == "False"  # this process is still seen


def test_a_store_reading_without_locks_joins_a_locking_process_as_such(store_dir, monkeypatch):
    """A process whose first store locks its reads and whose second (same
    ledger) does not is then seen as a process with unlocked reads."""
    s = _open(store_dir)
    peer_code = "print(s._ledger.may_reuse(), flush=True)"
    try:
        peer = _store_peer(store_dir, peer_code)
        out, _ = peer.communicate("", timeout=60)
        assert peer.returncode == 0 and out.strip() == "True"
        monkeypatch.setattr(medium, "locks_reads", lambda roots: False)
        s2 = _open(store_dir)
        try:
            peer = _store_peer(store_dir, peer_code)
            out, _ = peer.communicate("", timeout=60)
            assert peer.returncode == 0 and out.strip() == "False"
        finally:
            s2.close()
    finally:
        s.close()


@pytest.mark.parametrize(
    "fstype,options,want",
    [
        ("nfs4", "rw,vers=4.2,local_lock=none,addr=10.0.0.1", ("", False, False)),
        ("nfs", "rw,vers=3,nolock,addr=10.0.0.1", ("nfs mounted nolock", True, True)),
        ("nfs4", "rw,vers=4.2,local_lock=all", ("nfs4 mounted local_lock=all", True, True)),
        ("nfs", "rw,vers=3,local_lock=posix", ("nfs mounted local_lock=posix", True, False)),
        ("nfs", "rw,vers=3,local_lock=flock", ("nfs mounted local_lock=flock", False, True)),
        ("lustre", "rw,localflock", ("lustre mounted localflock", True, True)),
        ("lustre", "rw,flock", ("", False, False)),
    ],
)
def test_mounts_that_keep_locks_on_this_host_are_told(tmp_path, fstype, options, want):
    """client_local_locks reads the mount table the kernel writes: NFS with
    nolock or local_lock, Lustre with localflock keep file locks on this
    client, which other hosts then cannot see."""
    table = F.mount_table(tmp_path, str(tmp_path), fstype, options)
    assert medium.client_local_locks([str(tmp_path)], table) == want
    assert medium.client_local_locks([str(tmp_path)], str(tmp_path / "no-such-table")) == ("", False, False)


def test_no_reuse_where_other_hosts_cannot_see_this_ones_locks(tmp_path, monkeypatch, caplog):
    """On a mount whose POSIX locks stay on this host (NFS nolock), a reader
    on another host holds no lock the evictor could see: evicted files are
    unlinked, never rewritten, with one warning that says why and the fix."""
    store_dir = str(tmp_path / "store")
    os.makedirs(store_dir)
    table = F.mount_table(tmp_path, store_dir, "nfs", "rw,vers=3,nolock")
    real = medium.client_local_locks
    monkeypatch.setattr(medium, "client_local_locks", lambda roots: real(roots, table))
    with caplog.at_level("WARNING", logger="lmcache_fx"):
        s = _open(store_dir)
    try:
        said = [r.getMessage() for r in caplog.records if "keeps file locks on this host alone" in r.getMessage()]
        assert len(said) == 1 and "nfs mounted nolock" in said[0] and "not reused" in said[0]
        assert "counted per host" in said[0] and "without nolock" in said[0]
        assert s.reuse_evicted is False
        _fill(s, KEYS[:8])
        st = s.stats.snapshot()
        assert st["evictions"] == 4 and st["recycled"] == 0  # each victim unlinked, a new file made
        _check_store(s, KEYS[4:8], KEYS[:4])
    finally:
        s.close()


def test_no_reuse_where_nothing_would_tell_a_torn_reused_file(store_dir):
    """A reused file's new header, payload and rename reach the disk in no
    set order: after a real power cut (XFS shutdown without a log flush) a
    new key's header stood over the old key's payload in 2 of 162 torn
    chunks, which only the payload check or a MAC can tell. With verify off
    and no auth_key, evicted files are not reused on disk filesystems."""
    for i, (opts, reused) in enumerate(
        (
            ({}, 4),
            ({"verify": False}, 0),
            ({"verify": False, "auth_key": "k" * 32}, 4),
        )
    ):
        s = _open(f"{store_dir}-{i}", **opts)
        try:
            assert s.reuse_evicted == (reused > 0), opts
            _fill(s, KEYS[:8])  # the last four each evict one
            st = s.stats.snapshot()
            assert (st["evictions"], st["recycled"]) == (4, reused), opts
            _check_store(s, KEYS[4:8], KEYS[:4])
        finally:
            s.close()


@pytest.mark.parametrize("reads", ["read_chunks", "two_op"])
def test_torn_reused_files_are_misses_even_with_verify_off(store_dir, reads):
    """After a power cut a file a new chunk was written into can hold the new
    header over part of the old chunk's payload, or the old header (its
    renames and header writes lost) over part of the new payload: full
    length, well formed. A store that reuses files on disk flags every chunk
    it writes (FLAG_CHECK_PAYLOAD); one restarted with verify off still
    checks those payloads (in C on read_chunks, through the engine's CRC on
    the two-op path) and misses both tears. A verify-off store on disk reuses
    nothing, and its own chunks are not flagged."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])
        paths = {k: s.path_for(chunk_digest(k)) for k in KEYS[:6]}
        with open(paths[KEYS[0]], "rb") as f:
            first = f.read()  # KEYS[0]'s file as it stood before its reuse
        _fill(s, KEYS[4:6])  # KEYS[4] and KEYS[5] go into the files of KEYS[0] and KEYS[1]
        assert s.stats.snapshot()["recycled"] == 2
    finally:
        s.close()
    for k in KEYS[2:6]:
        with open(paths[k], "rb") as f:
            assert decode_header(f.read(HEADER_SIZE)).check_payload, k
    assert decode_header(first[:HEADER_SIZE]).check_payload
    with open(paths[KEYS[4]], "rb") as f:
        new4 = f.read()
    # Tear 1: KEYS[4]'s header landed, its payload's first 4 KiB did not (another chunk's bytes there).
    with open(paths[KEYS[2]], "rb") as f:
        other = f.read()[HEADER_SIZE : HEADER_SIZE + 4096]
    fd = os.open(paths[KEYS[4]], os.O_WRONLY)
    try:
        assert os.pwrite(fd, other, HEADER_SIZE) == 4096
    finally:
        os.close(fd)
    # Tear 2: at KEYS[0]'s old name, its own header over KEYS[4]'s first 4 KiB (renames and headers lost).
    with open(paths[KEYS[0]], "wb") as f:
        f.write(first[:HEADER_SIZE] + new4[HEADER_SIZE : HEADER_SIZE + 4096] + first[HEADER_SIZE + 4096 :])
    s = F.open_store(store_dir, verify=False)  # room for the five files: none evicted at start
    try:
        keys = KEYS[:6]
        if reads == "two_op":
            got = drive_blocking(s.engine, s.read_steps(keys, F.allocator(), chunks=False), lambda h: None)
        else:
            assert s._takes_chunks(s.engine)
            got = s.read(keys, F.allocator(), lambda h: None)
        assert [h is not None for h in got] == [False, False, True, True, False, True]
        assert all(F.check(k, memoryview(h)) == "ok" for k, h in zip(keys, got) if h is not None)
        assert s.stats.snapshot()["corrupt"] == 2
        assert not os.path.exists(paths[KEYS[0]]) and not os.path.exists(paths[KEYS[4]])
        src = F.Chunks()
        assert s.write([src.item(KEYS[6], CHUNK)]) == [True]
        with open(s.path_for(chunk_digest(KEYS[6])), "rb") as f:
            assert not decode_header(f.read(HEADER_SIZE)).check_payload
    finally:
        s.close()


def test_a_store_that_flags_its_chunks_writes_into_no_unflagged_file(store_dir):
    """A victim whose header is unflagged (a verify-off store's chunk, or an
    earlier version's) keeps that header where a power cut loses the reuse's
    renames and header writes, over part of the new payload, and a reader
    with verify off would not check it. Such files are unlinked, not reused,
    also after a restart (the header is read where the index does not know);
    flagged victims are reused."""
    s = _open(store_dir, verify=False)  # on disk: reuses nothing, flags nothing
    try:
        _fill(s, KEYS[:4])
    finally:
        s.close()
    for i in range(2):
        s = _open(store_dir)
        try:
            if i == 0:
                _fill(s, KEYS[4:6])  # evicts two unflagged chunks
                assert (s.stats.snapshot()["evictions"], s.stats.snapshot()["recycled"]) == (2, 0)
            else:  # restarted: two unflagged and two flagged victims, the index knowing none of them
                _fill(s, KEYS[6:10])
                assert (s.stats.snapshot()["evictions"], s.stats.snapshot()["recycled"]) == (4, 2)
                _check_store(s, KEYS[6:10], KEYS[:6])
        finally:
            s.close()


def test_a_flagged_chunk_stored_anew_unflagged_by_a_peer_is_looked_at_before_reuse(store_dir):
    """The evictor trusts its index that a victim's header is flagged only
    for the file it wrote (its inode and mtime). A peer that flags nothing
    (verify off, or an earlier version) stores the key anew at the same path:
    that unflagged file is looked at and unlinked, not written into (the
    index said "flagged" by path alone, and a power cut could then leave the
    peer's header over part of the new payload)."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])  # full, every chunk flagged and known so
        peer = _open(store_dir, verify=False)
        try:
            assert peer.remove(KEYS[0])
            src = F.Chunks()
            assert peer.write([src.item(KEYS[0], CHUNK, version=1)]) == [True]
        finally:
            peer.close()
        p = s.path_for(chunk_digest(KEYS[0]))
        with open(p, "rb") as f:
            assert unflagged_chunk(f.read(12))
        os.utime(p, ns=(1, 1))  # the oldest: the next eviction's first victim
        _fill(s, KEYS[4:5])
        snap = s.stats.snapshot()
        assert (snap["evictions"], snap["recycled"]) == (1, 0), snap  # unlinked after a look, not reused
        assert not os.path.exists(p)
        _check_store(s, KEYS[1:5], KEYS[:1])
        _fill(s, KEYS[5:6])  # a victim it wrote itself is still reused without a look
        assert s.stats.snapshot()["recycled"] == 1
    finally:
        s.close()


def test_a_touch_does_not_carry_a_flag_over_to_a_peers_new_file(store_dir):
    """The flag's (inode, mtime) follow this process's own touches. A peer's
    new unflagged file at the same path can take the freed inode number (ext4
    and XFS hand it on); a pinned lookup due a touch then moved the old
    file's flag onto it, and its mtime too: the evictor wrote into it without
    a look. A touch carries the flag only while the lookup's stat saw the
    file it was known for."""
    s = _open(store_dir)
    try:
        _fill(s, KEYS[:4])
        peer = _open(store_dir, verify=False)
        try:
            src = F.Chunks()
            assert peer.remove(KEYS[0]) and peer.write([src.item(KEYS[0], CHUNK, version=1)]) == [True]
        finally:
            peer.close()
        p = s.path_for(chunk_digest(KEYS[0]))
        with open(p, "rb") as f:
            assert unflagged_chunk(f.read(12))
        s._index[chunk_digest(KEYS[0])].touched = 0.0  # its touch is due
        assert s.lookup([KEYS[0]], pin=True) == [True] and s.unpin(KEYS[0]) and s.settle_touches()
        for k in KEYS[4:8]:  # evicts K1, K2, K3, then K0 (the newest), each with a fresh victim list
            s._victims, s._victims_at = [], 0.0
            _fill(s, [k])
        snap = s.stats.snapshot()
        assert (snap["evictions"], snap["recycled"]) == (4, 3), snap  # K0's file looked at and unlinked
        _check_store(s, KEYS[4:8], KEYS[:4])
    finally:
        s.close()


def test_a_chunk_reused_since_the_two_op_path_last_saw_it_is_read_again_with_its_crc(store_dir):
    """The two-op path asks the engine for CRCs only where a chunk's header as
    last seen was flagged. One rewritten since by a store that flags its
    chunks (another process) is read without its CRC: a miss, its file kept;
    the next read learns the flag and checks the payload."""
    from lmcache_fx.core.chunkfile import encode_header

    s = _open(store_dir, verify=False)  # reuses nothing on disk: its chunks are not flagged
    try:
        _fill(s, KEYS[:4])
    finally:
        s.close()
    s = _open(store_dir, verify=False)
    try:

        def read():
            return drive_blocking(s.engine, s.read_steps([KEYS[0]], F.allocator(), chunks=False), lambda h: None)[0]

        assert read() is not None  # its header learnt: not flagged
        p = s.path_for(chunk_digest(KEYS[0]))
        with open(p, "r+b") as f:  # rewritten meanwhile by a store that flags its chunks: the same chunk
            h = decode_header(f.read(HEADER_SIZE))
            buf = bytearray(HEADER_SIZE)
            encode_header(buf, h.key, h.meta, h.payload_len, h.payload_crc, h.created_ns, check_payload=True)
            f.seek(0)
            f.write(buf)
        assert read() is None and os.path.exists(p) and s.stats.snapshot()["corrupt"] == 0
        with open(p, "r+b") as f:  # and torn by a power cut
            f.seek(HEADER_SIZE)
            f.write(bytes(4096))
        assert read() is None and s.stats.snapshot()["corrupt"] == 1 and not os.path.exists(p)
    finally:
        s.close()


def test_no_reuse_with_verify_off_when_any_path_is_on_disk(tmp_path, shm_dir):
    """One path on tmpfs and one on disk, verify off, no auth_key: the disk
    path's evicted files could be torn by a power cut like any other, so
    reuse is off unless every path is in memory."""
    both = F.open_store(f"{shm_dir},{tmp_path / 'disk'}", verify=False)
    mem = F.open_store(shm_dir + "-only", verify=False)
    try:
        assert not both.reuse_evicted and mem.reuse_evicted
    finally:
        both.close()
        mem.close()


def test_a_chunk_refused_then_rewritten_into_its_own_file_is_found_again(tmp_path):
    """A consumer that read a chunk of another format version stops counting
    it in lookups; a producer with reuse_evicted (the default) wrote this
    version's chunk back into the same file (same inode, new content), and
    the consumer kept missing it for good, where a fresh process found it (a
    read-back). A lookup that sees the file written since looks again."""
    d = str(tmp_path / "s")
    producer, consumer = _open(d), _open(d)
    try:
        assert producer.reuse_evicted
        src = F.Chunks()
        _fill(producer, KEYS[:4])
        k0 = KEYS[0]
        p0 = producer.path_for(chunk_digest(k0))
        st0 = os.stat(p0)
        F.set_format_version(p0)  # k0 as a newer lmcache-fx wrote it, its place in the LRU kept
        assert F.read_check(consumer, [k0])[:2] == (0, 1)
        assert not consumer.contains(k0) and consumer.lookup([k0]) == [False]  # refused: no hit while it stands
        for k in KEYS[4:8] + [k0]:  # each evicts the oldest and writes into its file; k0 last
            assert producer.write([src.item(k, CHUNK)]) == [True]
        assert os.stat(p0).st_ino == st0.st_ino  # k0 is back in its own file
        assert consumer.contains(k0) and consumer.lookup([k0]) == [True]
        assert F.read_check(consumer, [k0]) == (1, 0, [])
    finally:
        producer.close()
        consumer.close()


def test_a_store_that_does_not_evict_keeps_no_growing_victim_list(store_dir, monkeypatch):
    """Every chunk written joined the evictor's list, which only an eviction
    or a walk of this process let go of: a store LMCache keeps under its cap
    by deleting (MP mode's eviction watermark), or one whose peer did the
    periodic recompute, held an entry for every chunk ever written (a soak:
    112 015 entries, 40 MB, in 280 s). A list past its age is rebuilt by a
    walk before any eviction reads it; it is let go instead of added to, and
    a later eviction still takes the oldest chunks."""
    monkeypatch.setattr(store_mod, "VICTIM_LIST_SECONDS", 0.05)
    s = _open(store_dir)
    try:
        src = F.Chunks()
        longest = 0
        for b in range(12):
            keys = [f"churn/{b}/{i}" for i in range(4)]
            assert s.write([src.item(k, CHUNK) for k in keys]) == [True] * 4
            longest = max(longest, len(s._victims))
            for k in keys:
                assert s.remove(k)
            time.sleep(0.06)
        assert s.stats.snapshot()["evictions"] == 0
        assert longest <= 4, longest  # one batch's worth at most, not the 48 written
        _fill(s, KEYS[:8])  # one at a time: each past the fourth evicts
        _check_store(s, KEYS[4:8], KEYS[:4])  # the oldest went
    finally:
        s.close()
