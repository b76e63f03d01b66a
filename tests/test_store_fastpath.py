"""The store's fast paths: reads through Engine.read_chunks with no
per-chunk open from Python, and writes through kept fan-out directory
descriptors."""

import os

import pytest

from lmcache_fx import _fxio as fx
from lmcache_fx.core import store as store_mod
from lmcache_fx.core.chunkfile import ChunkMeta
from lmcache_fx.core.options import FxOptions
from lmcache_fx.core.store import ChunkStore

N = 50
SIZE = 8192


@pytest.fixture
def root(request, tmp_path):
    try:
        return request.getfixturevalue("xfs_store")
    except pytest.skip.Exception:
        return str(tmp_path / "store")


def _filled(n, size):
    buf = fx.HostBuffer(n * size)
    mv = memoryview(buf)
    for i in range(n):
        mv[i * size : (i + 1) * size] = bytes([i & 0xFF]) * size
    return buf


def _count_opens(monkeypatch):
    calls = []
    real = os.open

    def counting(*a, **kw):
        calls.append(a[0])
        return real(*a, **kw)

    monkeypatch.setattr(os, "open", counting)
    return calls


@pytest.mark.parametrize("awaited", [False, True])
def test_read_makes_no_per_chunk_open(root, monkeypatch, awaited):
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1, "verify": True}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        keys = [f"fast-{i}" for i in range(N)]
        assert all(st.write([(k, src.address + i * SIZE, SIZE, meta) for i, k in enumerate(keys)]))
        dst = fx.HostBuffer(N * SIZE)
        it = iter(range(N))

        def allocate(m):
            i = next(it)
            return i, dst.address + i * SIZE, SIZE

        calls = _count_opens(monkeypatch)
        if awaited:
            import asyncio

            out = asyncio.run(st.read_async(keys, allocate, lambda h: None))
        else:
            out = st.read(keys, allocate, lambda h: None)
        monkeypatch.undo()
        assert out == list(range(N))
        assert bytes(dst) == bytes(src)
        assert len(calls) <= 2, calls  # no open per chunk (a constant few at most)
        assert st.stats.snapshot()["hits"] == N
    finally:
        st.close()


def test_write_opens_each_fanout_directory_once(root, monkeypatch):
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        assert all(st.write([(f"warm-{i}", src.address + i * SIZE, SIZE, meta) for i in range(N)]))
        keys = [f"w-{i}" for i in range(N)]
        subs = {st.path_for(store_mod.chunk_digest(k))[:-38] for k in keys}
        calls = _count_opens(monkeypatch)
        assert all(st.write([(k, src.address + i * SIZE, SIZE, meta) for i, k in enumerate(keys)]))
        monkeypatch.undo()
        dir_opens = [c for c in calls if isinstance(c, str) and "/" in c]
        tmp_opens = [c for c in calls if isinstance(c, str) and store_mod.TMP_MARK in c]
        assert len(tmp_opens) == N
        assert len(dir_opens) <= len(subs), dir_opens
        assert len(st) == 2 * N
    finally:
        st.close()


def test_a_write_batch_counts_its_files_in_the_ledger_with_one_write(root, monkeypatch):
    """The reservation counts a batch's fresh temporaries with one ledger
    write before sizing them, not one write per file (three system calls
    each on the storing thread): a store of N chunks writes the ledger a
    few times, whatever N."""
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        assert all(st.write([(f"warm-{i}", src.address + i * SIZE, SIZE, meta) for i in range(N)]))
        puts = []
        real = st._ledger.put
        monkeypatch.setattr(st._ledger, "put", lambda usage, scanned: (puts.append(usage), real(usage, scanned)))
        assert all(st.write([(f"w-{i}", src.address + i * SIZE, SIZE, meta) for i in range(N)]))
        monkeypatch.undo()
        assert 1 <= len(puts) <= 4, puts
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".fxkv")]
        assert len(files) == 2 * N and st.usage_bytes == sum(os.path.getsize(f) for f in files)
    finally:
        st.close()


def test_an_eviction_reads_the_ledger_for_others_changes_once(root, monkeypatch):
    """A full store written by one process evicts its own older writes. The
    evictor asks whether another process changed the store since its walk
    (Ledger.others_changed, a read of the ledger) when its own later writes
    come up: once per eviction, not once per evicted chunk (the answer
    cannot change while it holds the ledger's lock)."""
    from lmcache_fx.core.ledger import Ledger

    size = 1 << 20
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 16 / 1024}))
    try:
        src = _filled(1, size)
        meta = ChunkMeta(((size,),), ("uint8",), "raw")
        asked, evictions = [], []
        real_ask, real_evict = Ledger.others_changed, ChunkStore._evict_locked
        monkeypatch.setattr(Ledger, "others_changed", lambda self, m: (asked.append(m), real_ask(self, m))[1])
        monkeypatch.setattr(
            ChunkStore, "_evict_locked", lambda self, *a, **k: (evictions.append(1), real_evict(self, *a, **k))[1]
        )
        for r in range(6):
            assert all(st.write([(f"r{r}-{i}", src.address, size, meta) for i in range(8)]))
        monkeypatch.undo()
        assert st.stats.snapshot()["evictions"] >= 24
        assert asked and len(asked) <= len(evictions), (len(asked), len(evictions))
    finally:
        st.close()


def test_files_given_room_are_counted_and_sized_before_the_evictor_may_rescan(root, monkeypatch):
    """A batch that evicts part way through its reservation, where the
    evictor rescans the store (it counts temporaries at their size on disk):
    the files given room before are counted and sized by then, so the
    usage the rescan finds includes them and the ledger equals the files
    after the batch (a file counted in the batch's usage but still empty
    would drop out of it, the ledger a chunk low for each)."""
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 40 * (SIZE + 4096) / (1 << 30)}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        assert all(st.write([(f"old-{i}", src.address + i * SIZE, SIZE, meta) for i in range(30)]))
        calls = []
        real_evict = st._evict_locked

        def evict(limit, usage, reuse=()):
            calls.append(usage)
            # The batch's first eviction (before its loop) frees nothing, as when the chunks it
            # would take are pinned: the loop then evicts part way through, after a rescan.
            return usage if len(calls) == 1 else real_evict(limit, st._rescan_locked(), reuse)

        monkeypatch.setattr(st, "_evict_locked", evict)
        monkeypatch.setattr(store_mod, "WRITE_SUB_CHUNKS", N)  # one batch of them all
        st._last_usage = 0  # as if the batch was not known to evict: temporaries made before the reservation
        assert all(st.write([(f"new-{i}", src.address + i * SIZE, SIZE, meta) for i in range(20)]))
        monkeypatch.undo()
        assert len(calls) >= 2, calls  # an eviction in the loop, after reservations
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".fxkv")]
        assert len(st) <= 40 and st.usage_bytes == sum(os.path.getsize(f) for f in files)
    finally:
        st.close()


def _chunk_bytes(root):
    """Bytes of every file under the store but its lock directory."""
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(root) if "/.fx" not in d + "/" for f in fs)


def test_an_evicted_file_adopted_but_not_sized_is_not_left_uncounted(root, monkeypatch):
    """A chunk's file taken over from a victim at the victim's size (an
    unaligned payload: the file trimmed) whose sizing fails leaves the
    reservation: it stayed on disk, out of the usage, until the commit
    removed it without the lock, the ledger below the files meanwhile. It
    goes at once, before the ledger is written again."""
    odd = 6000  # not a multiple of 4 KiB: a chunk's file is trimmed to HEADER_SIZE + 6000
    rsize = store_mod.HEADER_SIZE + 8192
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 20 * rsize / (1 << 30)}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((odd,),), ("uint8",), "raw")
        assert all(st.write([(f"old-{i}", src.address + i * SIZE, odd, meta) for i in range(20)]))
        real_ft, failed, below = os.ftruncate, [], []

        def ftruncate(fd, size):
            if os.fstat(fd).st_size == store_mod.HEADER_SIZE + odd and size == rsize:  # an adopted victim
                failed.append(fd)
                raise OSError(5, "Input/output error")
            return real_ft(fd, size)

        real_reserve = st._reserve

        def reserve(files):  # the lock is let go here; the commit comes after the payloads
            got = real_reserve(files)
            usage, on_disk = st._ledger.get()[0], _chunk_bytes(root)
            if usage < on_disk:
                below.append((usage, on_disk))
            return got

        monkeypatch.setattr(os, "ftruncate", ftruncate)
        monkeypatch.setattr(st, "_reserve", reserve)
        st.write([(f"new-{i}", src.address + i * SIZE, odd, meta) for i in range(5)])
        monkeypatch.undo()
        assert failed, "no victim was adopted: the case did not arise"
        assert below == []
        assert st.usage_bytes == _chunk_bytes(root)
    finally:
        st.close()


def test_a_reservation_that_raises_part_way_leaves_the_ledger_equal_to_the_files(root, monkeypatch):
    """Files given room are marked reserved (what the commit takes off the
    ledger) only once counted: a reservation that raises part way through
    (a MemoryError, a KeyboardInterrupt) took the earlier files' bytes off a
    ledger that had not counted them yet, leaving it below the files."""
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        assert all(st.write([(f"a-{i}", src.address + i * SIZE, SIZE, meta) for i in range(10)]))
        real, seen = st._removed_as_stale, []

        def interrupted(f, fst):
            seen.append(f)
            if len(seen) == 3:
                raise KeyboardInterrupt
            return real(f, fst)

        monkeypatch.setattr(st, "_removed_as_stale", interrupted)
        with pytest.raises(KeyboardInterrupt):
            st.write([(f"b-{i}", src.address + i * SIZE, SIZE, meta) for i in range(10)])
        monkeypatch.undo()
        assert all(st.write([(f"c-{i}", src.address + i * SIZE, SIZE, meta) for i in range(10)]))
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".fxkv")]
        assert len(files) == 20 and st.usage_bytes == sum(os.path.getsize(f) for f in files)
    finally:
        st.close()


def _stats_of_names(monkeypatch, suffix=".fxkv"):
    """The names of chunk files os.stat is asked about from here on."""
    calls = []
    real = os.stat

    def counting(p, *a, **kw):
        if isinstance(p, str) and p.endswith(suffix):
            calls.append(p)
        return real(p, *a, **kw)

    monkeypatch.setattr(os, "stat", counting)
    return calls


def test_a_new_chunk_goes_in_place_without_a_stat_of_its_name(root, monkeypatch):
    """The commit asked the directory for each chunk's final name before its
    rename (the file replaced leaves the usage). The rename is tried without
    replacing first: a new key needs no stat; a key stored again is still
    found and replaced, its old bytes taken off the usage."""
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        keys = [f"n-{i}" for i in range(N)]
        peer = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
        stats = _stats_of_names(monkeypatch)
        assert all(st.write([(k, src.address + i * SIZE, SIZE, meta) for i, k in enumerate(keys)]))
        assert stats == [] and st._rename_noreplace
        try:  # another process, open before, stores the same keys (its index does not know them)
            assert all(peer.write([(k, src.address + i * SIZE, SIZE // 2, meta) for i, k in enumerate(keys)]))
        finally:
            peer.close()
        monkeypatch.undo()
        assert len(stats) == N  # each replaced file asked about, as before
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".fxkv")]
        assert len(files) == N and st.usage_bytes == sum(os.path.getsize(f) for f in files)
        assert st.usage_bytes == N * (store_mod.HEADER_SIZE + SIZE // 2)
    finally:
        st.close()


def test_a_filesystem_without_rename_noreplace_falls_back_to_stat_and_rename(root, monkeypatch):
    """Where renameat2's RENAME_NOREPLACE is refused (EINVAL: some network
    filesystems, older kernels), the commit stats and renames as before,
    and does not try it again."""
    import errno

    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    try:
        src = _filled(N, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        tried = []

        def refused(dfd, a, b):
            tried.append(b)
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(store_mod._fxio, "rename_noreplace", refused)
        assert all(st.write([(f"e-{i}", src.address + i * SIZE, SIZE, meta) for i in range(N)]))
        assert all(st.write([(f"f-{i}", src.address + i * SIZE, SIZE, meta) for i in range(N)]))
        monkeypatch.undo()
        assert len(tried) == 1 and not st._rename_noreplace
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".fxkv")]
        assert len(files) == 2 * N and st.usage_bytes == sum(os.path.getsize(f) for f in files)
        assert len(st) == 2 * N
    finally:
        st.close()


def test_close_releases_directory_descriptors(root):
    before = len(os.listdir("/proc/self/fd"))
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    src = _filled(4, SIZE)
    meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
    assert all(st.write([(f"c-{i}", src.address + i * SIZE, SIZE, meta) for i in range(4)]))
    st.close()
    assert len(os.listdir("/proc/self/fd")) <= before


def _slow_store(root) -> ChunkStore:
    """A store whose reads are long in flight: 4 KiB pieces at queue depth 1."""
    return ChunkStore(
        FxOptions.from_mapping({"path": root, "max_capacity_gb": 1, "queue_depth": 1, "split_bytes": 4096})
    )


def _cancel_in_flight(st: ChunkStore, prefix: str):
    """Stores 16 chunks of 4 MiB, starts an awaited read of them and cancels
    it 10 ms in; returns (how the read ended, the buffers it was given by
    id, those released)."""
    import asyncio

    n, size = 16, 4 << 20
    src = _filled(n, size)
    meta = ChunkMeta(((size,),), ("uint8",), "raw")
    keys = [f"{prefix}-{i}" for i in range(n)]
    for i in range(0, n, 4):
        assert all(st.write([(k, src.address + j * size, size, meta) for j, k in enumerate(keys) if i <= j < i + 4]))
    bufs, released = {}, []

    def allocate(m):
        hb = fx.HostBuffer(size)
        bufs[id(hb)] = hb
        return hb, hb.address, size

    async def main():
        task = asyncio.ensure_future(st.read_async(keys, allocate, released.append))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
            return "done"
        except asyncio.CancelledError:
            return "cancelled"

    return asyncio.run(main()), bufs, released


def test_cancelled_chunks_read_waits_and_releases(root):
    """An awaited read_chunks batch cancelled in flight: the call returns
    once the batch is done, every handle released, nothing lands after."""
    import time

    st = _slow_store(root)
    try:
        how, bufs, released = _cancel_in_flight(st, "cancel")
        if how == "cancelled":
            assert len(released) == len(bufs)
        size = 4 << 20
        for hb in bufs.values():
            memoryview(hb)[:] = b"\xab" * size
        time.sleep(0.2)
        assert all(bytes(hb).count(b"\xab") == size for hb in bufs.values())
    finally:
        st.close()


def test_a_read_cancelled_where_no_thread_can_start_still_releases_every_handle(root, monkeypatch):
    """An awaited read cancelled in flight waits for its batch on a thread of
    the loop's executor; where none can be started (a pids limit), that
    error escaped the cancellation: the read ended as misses, not cancelled,
    and not one of LMCache's objects was handed back. It now waits on the
    loop's own thread and ends as a cancelled read should."""
    from faults import fxfault as F

    st = _slow_store(root)
    try:
        F.refuse_threads(monkeypatch, "asyncio")  # the loop's executor threads, asyncio_0 ...
        how, bufs, released = _cancel_in_flight(st, "nothread")
        assert how == "cancelled" and bufs and len(released) == len(bufs)
    finally:
        monkeypatch.undo()
        st.close()


def test_a_cancelled_read_waiting_its_turn_ends_at_once_unread(root):
    """With awaited_concurrency 1, an awaited read submitted while another
    runs waits for the runner; cancelled there, it ends at once (the first
    read still running), every handle released and nothing read into its
    buffers, while the first read completes with its data."""
    import asyncio

    n, size = 32, 4 << 20
    opts = {"path": root, "max_capacity_gb": 1, "queue_depth": 1, "split_bytes": 4096, "awaited_concurrency": 1}
    st = ChunkStore(FxOptions.from_mapping(opts))
    try:
        assert st.engine.max_running == 1
        src = _filled(n, size)
        meta = ChunkMeta(((size,),), ("uint8",), "raw")
        keys = [f"turn-{i}" for i in range(n)]
        for i in range(0, n, 4):
            assert all(st.write([(keys[j], src.address + j * size, size, meta) for j in range(i, i + 4)]))

        def allocator(bufs):
            def allocate(m):
                hb = fx.HostBuffer(size)
                bufs.append(hb)
                return hb, hb.address, size

            return allocate

        first_bufs, second_bufs, first_rel, second_rel = [], [], [], []

        async def main():
            first = asyncio.ensure_future(st.read_async(keys, allocator(first_bufs), first_rel.append))
            while not first_bufs:
                await asyncio.sleep(0.001)
            second = asyncio.ensure_future(st.read_async(keys[1:3], allocator(second_bufs), second_rel.append))
            while len(second_bufs) < 2:
                await asyncio.sleep(0)
            await asyncio.sleep(0)  # the second read submits its batch and awaits it
            assert not first.done(), "the first read ended before the second was cancelled (the test's premise)"
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            first_running = not first.done()
            return first_running, await first

        first_running, got = asyncio.run(main())
        assert first_running, "the cancelled read waited for the one before it"
        assert len(second_rel) == len(second_bufs) == 2
        assert all(bytes(hb) == bytes(size) for hb in second_bufs)  # never read into
        assert len(got) == n and first_rel == []
        for i, hb in enumerate(got):
            assert bytes(memoryview(hb)[:16]) == bytes([i & 0xFF]) * 16
    finally:
        st.close()


def _sub_batched_store(root, monkeypatch) -> ChunkStore:
    """A store whose writes go in sub-batches of 4 chunks of SIZE (its
    thresholds lowered); skips where it would not write through
    Engine.write_chunks (no O_DIRECT there)."""
    monkeypatch.setattr(store_mod, "WRITE_SUB_BYTES", 4 * SIZE)
    monkeypatch.setattr(store_mod, "WRITE_SUB_CHUNKS", 4)
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    if not st.odirect or not hasattr(st.engine, "write_chunks"):
        st.close()
        pytest.skip(f"no O_DIRECT on {root}: the store writes through Engine.write")
    return st


def _files_under(root):
    names = [n for _, _, fs in os.walk(root) for n in fs]
    return [n for n in names if store_mod.TMP_MARK in n], sum(
        os.path.getsize(os.path.join(d, n)) for d, _, fs in os.walk(root) for n in fs if n.endswith(".fxkv")
    )


def _assert_no_temporary_and_a_true_usage(st, root):
    tmps, on_disk = _files_under(root)
    assert tmps == [] and st.usage_bytes == on_disk


def _items(keys, src):
    """ChunkStore.write items: key i's payload is src's i-th SIZE bytes."""
    meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
    return [(k, src.address + i * SIZE, SIZE, meta) for i, k in enumerate(keys)]


def _read_back(st, keys, n_bytes):
    dst = fx.HostBuffer(len(keys) * n_bytes)

    def allocate(_meta, slot=iter(range(len(keys)))):
        i = next(slot)
        return i, dst.address + i * n_bytes, n_bytes

    return st.read(keys, allocate, lambda h: None), dst


def test_large_odirect_write_overlaps_its_sub_batches(root, monkeypatch):
    """An O_DIRECT store of many chunks goes in sub-batches, one
    Engine.write_chunks call each, and the next sub-batch's temporaries are
    made while the one before is still being written (held here until they
    appear). Every chunk lands, reads back, no temporary is left, and the
    shared usage is what the files hold."""
    st = _sub_batched_store(root, monkeypatch)
    real = st.engine
    calls, overlapped = [], []

    class Holding:  # the first write_chunks call waits until the next sub-batch's temporaries exist
        def __getattr__(self, a):
            return getattr(real, a)

        def write_chunks(self, chunks, direct=False):
            calls.append(len(chunks))
            if len(calls) == 1:
                import time

                end = time.monotonic() + 10
                while time.monotonic() < end and len(_files_under(root)[0]) <= len(chunks):
                    time.sleep(0.002)
                overlapped.append(len(_files_under(root)[0]) > len(chunks))
            return real.write_chunks(chunks, direct=direct)

    try:
        src = _filled(12, SIZE)
        keys = [f"sub-{i}" for i in range(12)]
        st.engine = Holding()
        assert all(st.write(_items(keys, src)))
        st.engine = real
        assert calls == [4, 4, 4] and overlapped == [True]
        out, dst = _read_back(st, keys, SIZE)
        assert out == list(range(12)) and bytes(dst) == bytes(src)
        _assert_no_temporary_and_a_true_usage(st, root)
    finally:
        st.engine = real
        st.close()


def test_failed_sub_batch_leaves_no_temporary_and_a_true_usage(root, monkeypatch):
    """When one sub-batch's write_chunks call fails, the write raises after
    every sub-batch started has finished: the failed one's temporaries are
    removed and its reservation returned; the others are in place and read
    back; the shared usage is what the files hold."""
    st = _sub_batched_store(root, monkeypatch)
    real = st.engine
    calls = []

    class Failing:  # the second write_chunks call raises, as a closed engine would
        def __getattr__(self, a):
            return getattr(real, a)

        def write_chunks(self, chunks, direct=False):
            calls.append(len(chunks))
            if len(calls) == 2:
                raise ValueError("engine is closed")
            return real.write_chunks(chunks, direct=direct)

    try:
        src = _filled(12, SIZE)
        keys = [f"fail-{i}" for i in range(12)]
        st.engine = Failing()
        with pytest.raises(ValueError, match="closed"):
            st.write(_items(keys, src))
        st.engine = real
        assert calls == [4, 4, 4]
        stored = [k for k in keys if st.contains(k)]
        assert stored == keys[:4] + keys[8:]
        out, dst = _read_back(st, stored, SIZE)
        assert out == list(range(8))
        assert bytes(dst) == bytes(memoryview(src)[: 4 * SIZE]) + bytes(memoryview(src)[8 * SIZE :])
        _assert_no_temporary_and_a_true_usage(st, root)
    finally:
        st.engine = real
        st.close()


def test_sub_batches_run_one_after_another_while_a_read_runs(root, monkeypatch):
    """Loads come first: while a read of the store is in progress, a large
    O_DIRECT store's sub-batches are written on the calling thread, one
    after the other (no overlap thread to take CPU from the load); with no
    read running, they are written on a thread of their own. Both stores
    land whole."""
    import threading

    st = _sub_batched_store(root, monkeypatch)
    real = st.engine
    writers: list[str] = []
    reading, release = threading.Event(), threading.Event()

    class Recording:  # write_chunks records its thread; reads hold until released
        def __getattr__(self, a):
            return getattr(real, a)

        def write_chunks(self, chunks, direct=False):
            writers.append(threading.current_thread().name)
            return real.write_chunks(chunks, direct=direct)

        def read(self, *a, **kw):  # a stand-in engine gets the two-op read steps
            reading.set()
            assert release.wait(10)
            return real.read(*a, **kw)

    try:
        src = _filled(12, SIZE)
        assert all(st.write(_items([f"old-{i}" for i in range(4)], src)))
        st.engine = Recording()
        result = []
        reader = threading.Thread(target=lambda: result.append(_read_back(st, [f"old-{i}" for i in range(4)], SIZE)))
        reader.start()
        try:
            assert reading.wait(10)
            main = threading.current_thread().name
            assert all(st.write(_items([f"busy-{i}" for i in range(12)], src)))
            assert writers == [main] * 3
        finally:
            release.set()
            reader.join()
        assert result[0][0] == list(range(4))
        writers.clear()
        assert all(st.write(_items([f"idle-{i}" for i in range(12)], src)))
        assert len(writers) == 3 and all(w == "lmcache-fx-write" for w in writers)
        st.engine = real
        out, dst = _read_back(st, [f"busy-{i}" for i in range(12)] + [f"idle-{i}" for i in range(12)], SIZE)
        assert out == list(range(24)) and bytes(dst) == bytes(src) * 2
    finally:
        release.set()
        st.engine = real
        st.close()


def _small_store(root, n, size=SIZE, metas=None):
    """A store with n chunks of `size` bytes (chunk i filled with i & 0xFF),
    their keys and their metas (one meta for all unless given)."""
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1, "verify": True}))
    src = _filled(n, size)
    metas = metas or [ChunkMeta(((size,),), ("uint8",), "raw")] * n
    keys = [f"scratch-{i}" for i in range(n)]
    assert all(st.write([(k, src.address + i * size, size, metas[i]) for i, k in enumerate(keys)]))
    return st, keys


def _read_all(st, keys, size=SIZE, allocate_many=None):
    dst = fx.HostBuffer(len(keys) * size)
    it = iter(range(len(keys)))

    def allocate(m):
        i = next(it)
        return i, dst.address + i * size, size

    out = st.read(keys, allocate, lambda h: None, allocate_many=allocate_many)
    return out, dst


def test_header_scratch_is_kept_and_reused_between_reads(root):
    st, keys = _small_store(root, 8)
    try:
        out, _ = _read_all(st, keys)
        assert out == list(range(8))
        kept = list(st._scratch_kept)
        assert len(kept) == 1 and len(kept[0]) >= 8 * 4096
        out, _ = _read_all(st, keys)
        assert out == list(range(8))
        assert st._scratch_kept == kept and st._scratch_kept[0] is kept[0]  # the same buffer, kept again
    finally:
        st.close()


def test_scratch_beyond_the_kept_bytes_is_dropped(root, monkeypatch):
    monkeypatch.setattr(store_mod, "SCRATCH_KEPT_BYTES", 4096)
    st, keys = _small_store(root, 4)
    try:
        out, _ = _read_all(st, keys)
        assert out == list(range(4))
        assert st._scratch_kept == []  # 16 KiB of scratch: above the bound, unmapped
    finally:
        st.close()


def test_a_stale_header_in_kept_scratch_is_never_taken_for_a_chunk(root):
    """A truncated chunk read into the scratch slot where the same chunk's
    whole header landed in the read before is a miss: a header's bytes are
    used only once its read is known to be whole."""
    st, keys = _small_store(root, 3)
    try:
        out, _ = _read_all(st, keys)
        assert out == [0, 1, 2]
        path = st.path_for(store_mod.chunk_digest(keys[0]))
        os.truncate(path, 2048)  # shorter than its header
        out, dst = _read_all(st, keys)
        assert out == [None, 1, 2]
        assert bytes(memoryview(dst)[SIZE : 2 * SIZE]) == bytes([1]) * SIZE
    finally:
        st.close()


def test_allocate_many_takes_each_run_of_one_meta_in_one_call(root):
    a, b = ChunkMeta(((SIZE,),), ("uint8",), "raw"), ChunkMeta(((SIZE // 2, 2),), ("uint8",), "raw")
    metas = [a, a, a, b, b, a]
    st, keys = _small_store(root, 6, metas=metas)
    calls = []
    dst = fx.HostBuffer(6 * SIZE)
    nxt = iter(range(6))

    def many(meta, count):
        calls.append((meta, count))
        return [(i, dst.address + i * SIZE, SIZE) for i in (next(nxt) for _ in range(count))]

    def one(meta):
        i = next(nxt)
        calls.append((meta, 1))
        return i, dst.address + i * SIZE, SIZE

    try:
        out = st.read(keys, one, lambda h: None, allocate_many=many)
        assert out == [0, 1, 2, 3, 4, 5]
        assert calls == [(a, 3), (b, 2), (a, 1)]  # runs of two or more in one call; a lone chunk one by one
        for i in range(6):
            assert bytes(memoryview(dst)[i * SIZE : (i + 1) * SIZE]) == bytes([i]) * SIZE
    finally:
        st.close()


def test_allocate_many_declining_falls_back_to_one_by_one(root):
    st, keys = _small_store(root, 5)
    asked, released = [], []
    dst = fx.HostBuffer(5 * SIZE)
    nxt = iter(range(5))

    def one(meta):
        i = next(nxt)
        if i == 3:
            return None  # the pool is full here: later chunks miss
        return i, dst.address + i * SIZE, SIZE

    def many(meta, count):
        asked.append(count)
        return None

    try:
        out = st.read(keys, one, released.append, allocate_many=many)
        assert asked == [5]
        assert out == [0, 1, 2, None, None]
        assert released == []
    finally:
        st.close()


def test_allocate_many_of_the_wrong_length_makes_the_batch_misses(root):
    st, keys = _small_store(root, 4)
    dst = fx.HostBuffer(4 * SIZE)

    def many(meta, count):
        return [(i, dst.address + i * SIZE, SIZE) for i in range(count - 1)]  # one short

    released = []
    try:
        out = st.read(keys, lambda m: None, released.append, allocate_many=many)
        assert out == [None] * 4
        assert sorted(released) == [0, 1, 2]  # what it gave is handed back, not leaked
    finally:
        st.close()


def _same_sub_keys(st, prefix, n):
    """n keys whose chunks share one fan-out directory."""
    by_sub: dict = {}
    for i in range(100000):
        k = f"{prefix}-{i}"
        sub = os.path.dirname(st.path_for(store_mod.chunk_digest(k)))
        ks = by_sub.setdefault(sub, [])
        ks.append(k)
        if len(ks) == n:
            return sub, ks
    raise AssertionError("no fan-out directory got enough keys")


def _read_one(st, key, size):
    dst = fx.HostBuffer(size)
    out = st.read([key], lambda m: (0, dst.address, size), lambda h: None)
    return bytes(dst) if out == [0] else None


@pytest.mark.parametrize("full", [False, True])
def test_write_after_fanout_directory_removed_between_batches(root, full):
    """A fan-out directory removed after this process made it (fsck, an
    operator): the next store into it makes it again and succeeds, also in
    a full store (temporaries made under the reservation). Nothing is
    written anywhere else."""
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 3 * SIZE / (1 << 30) if full else 1}))
    try:
        src = _filled(3, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        sub, (a, b, c) = _same_sub_keys(st, f"gone{int(full)}", 3)
        assert st.write([(a, src.address, SIZE, meta), (b, src.address + SIZE, SIZE, meta)]) == [True, True]
        for name in os.listdir(sub):
            os.unlink(os.path.join(sub, name))
        os.rmdir(sub)
        results = [st.write([(c, src.address + 2 * SIZE, SIZE, meta)])[0] for _ in range(2)]
        assert results[-1] is True
        assert results == [True, True]
        assert os.path.isdir(sub) and not os.path.islink(sub)
        assert _read_one(st, c, SIZE) == bytes([2]) * SIZE
        assert sorted(os.listdir(sub)) == [os.path.basename(st.path_for(store_mod.chunk_digest(c)))]
    finally:
        st.close()


def test_write_after_fanout_directory_swapped_between_batches(root, tmp_path):
    """A fan-out directory moved away after this process stored into it, a
    symlink planted at its path: no store goes through the link or leaves
    a file in the moved directory, and once a real directory is back at the
    path stores succeed there."""
    st = ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1}))
    try:
        src = _filled(3, SIZE)
        meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
        sub, (a, b, c) = _same_sub_keys(st, "swap", 3)
        assert st.write([(a, src.address, SIZE, meta)]) == [True]
        moved = os.path.join(os.path.dirname(sub), "moved-away")
        os.rename(sub, moved)
        evil = tmp_path / "evil"
        evil.mkdir()
        os.symlink(str(evil), sub)
        assert st.write([(b, src.address + SIZE, SIZE, meta)]) == [False]
        assert st.write([(b, src.address + SIZE, SIZE, meta)]) == [False]
        assert os.listdir(evil) == []
        assert os.listdir(moved) == [os.path.basename(st.path_for(store_mod.chunk_digest(a)))]
        assert not st.contains(b)
        os.unlink(sub)
        os.mkdir(sub)
        assert st.write([(c, src.address + 2 * SIZE, SIZE, meta)]) == [True]
        assert _read_one(st, c, SIZE) == bytes([2]) * SIZE
    finally:
        st.close()


def test_remove_after_close_is_false_not_an_error(tmp_path):
    """LMCache may still call remove() on a backend it has closed (shutdown
    order): it got AttributeError from the released ledger. Now False, and
    the file stays for the next process."""
    s = ChunkStore(FxOptions(path=str(tmp_path / "s")))
    buf = _filled(1, 1 << 16)
    meta = ChunkMeta(((1 << 15,),), ("bfloat16",), "KV_2LTD")
    assert s.write([("k0", buf.address, 1 << 16, meta)]) == [True]
    path = s.path_for(store_mod.chunk_digest("k0"))
    s.close()
    assert s.remove("k0") is False
    assert os.path.exists(path)


def test_a_full_disk_is_one_error_per_burst_with_the_previous_bursts_count(tmp_path, caplog):
    """The first ENOSPC error said "(0 skipped in the last burst)": the count
    it gave is the previous burst's, unknown for the first. Said only where
    there was one now, and named as the previous burst's."""
    s = ChunkStore(FxOptions(path=str(tmp_path / "s")))
    try:
        with caplog.at_level("ERROR", logger="lmcache_fx"):
            s._count_enospc(3)
            s._count_enospc(2)  # the same burst: no second line
            s._full_until.clear()  # the burst's 5 s are over
            s._count_enospc(1)
        said = [r.getMessage() for r in caplog.records if "ENOSPC" in r.getMessage()]
        assert len(said) == 2 and "burst" not in said[0], said
        assert "(5 chunk stores failed or skipped in the previous burst)" in said[1], said
    finally:
        s.close()
