"""Option staged_reads: checked O_DIRECT reads through the reading thread's
staging buffer (csrc/uring_engine.c, fx_batch.stage_direct), chosen per
medium by the store. The engine-level checks (exact bytes, faults, slots)
are in tests/test_engine_chunks.py; here the store's choice and a real
store's reads on a loop device (XFS on a RAM-backed loop, root) and on a
disk filesystem that is not one."""

import json
import os
import random
import subprocess
import sys

import pytest
from test_mapped_reads import _store

from lmcache_fx import _fxio as fx
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta
from lmcache_fx.core.medium import decide_staged_reads, loop_backed, page_cache_fs
from lmcache_fx.core.options import ConfigError, FxOptions

URING_OK, URING_WHY = fx.io_uring_status()


def test_the_choice_and_its_reasons(tmp_path):
    """false, verify false and no O_DIRECT never stage, each saying why;
    true stages wherever checked O_DIRECT reads run; auto only on a loop
    device, on a CPU with the one-pass copy."""
    root = str(tmp_path)
    assert decide_staged_reads("false", [root], True, True) == (False, "staged_reads: false")
    assert decide_staged_reads("true", [root], True, False)[1].startswith("verify: false")
    assert decide_staged_reads("auto", [root], False, True)[1].startswith("no O_DIRECT")
    assert decide_staged_reads("true", [root], True, True) == (True, "staged_reads: true")
    on, why = decide_staged_reads("auto", [root], True, True)
    if not fx.CRC32C_COPY_ONE_PASS:
        assert (on, why) == (False, "this CPU has no one-pass copy and sum (AVX-512 VPCLMULQDQ)")
    else:
        assert on == loop_backed(root), why
        assert on or why.startswith("not a loop device"), why
    with pytest.raises(ConfigError, match="staged_reads"):
        FxOptions.from_mapping({"staged_reads": "sometimes"})


def _write_and_read(st, n, size, seed):
    src = fx.HostBuffer(n * size)
    mv = memoryview(src)
    rng = random.Random(seed)
    for i in range(n):
        mv[i * size : (i + 1) * size] = rng.randbytes(size)
    meta = ChunkMeta(((size,),), ("uint8",), "raw")
    keys = [f"staged-{seed}-{i}" for i in range(n)]
    assert all(st.write([(k, src.address + i * size, size, meta) for i, k in enumerate(keys)]))
    dst = fx.HostBuffer(n * size)

    def read():
        it = iter(range(n))
        return st.read(keys, lambda m: (lambda i: (i, dst.address + i * size, size))(next(it)), lambda h: None)

    return src, dst, read


def _flip_a_payload_byte(store_dir: str, at: int, mask: int) -> None:
    """XORs mask into payload byte `at` of the store's first chunk file (by
    name), its cached pages dropped: an O_DIRECT read must meet the flip."""
    victim = sorted(os.path.join(d, f) for d, _, fs in os.walk(store_dir) for f in fs if f.endswith(".fxkv"))[0]
    with open(victim, "r+b") as f:
        f.seek(HEADER_SIZE + at)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ mask]))
    fd = os.open(victim, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


@pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")
def test_a_store_on_a_loop_device_stages_its_checked_reads(xfs_store):
    """On XFS on a loop device the default (auto) stages where the CPU has
    the one-pass copy (else true is used, to run the path): chunks read back
    through the store are exact, their pieces counted through the slots; a
    payload byte flipped on disk is a miss, never wrong data; with verify
    off nothing is staged."""
    assert loop_backed(xfs_store)
    st = _store(xfs_store)
    try:
        assert st.odirect and st.staged_reads == bool(fx.CRC32C_COPY_ONE_PASS)
        if not st.staged_reads:
            st.close()
            st = _store(xfs_store, staged_reads="true")
            assert st.staged_reads
        size, n = 3 << 20, 4
        src, dst, read = _write_and_read(st, n, size, 1)
        before = fx.direct_staged_pieces()
        assert read() == list(range(n))
        assert bytes(dst) == bytes(src)
        assert fx.direct_staged_pieces() - before == n * 3  # 1 MiB pieces (split_bytes)
        _flip_a_payload_byte(xfs_store, (2 << 20) + 77, 0x20)
        memoryview(dst)[:] = bytes(len(dst))
        out = read()
        assert sum(o is None for o in out) == 1, out
        for i, o in enumerate(out):
            if o is not None:
                assert bytes(memoryview(dst)[i * size : (i + 1) * size]) == bytes(
                    memoryview(src)[i * size : (i + 1) * size]
                )
    finally:
        st.close()
    st = _store(xfs_store, verify=False, staged_reads="true")
    try:
        assert not st.staged_reads
    finally:
        st.close()


@pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")
@pytest.mark.skipif(
    not fx.CRC32C_COPY_ONE_PASS, reason="auto stages nothing on a CPU without the one-pass copy (AVX-512 VPCLMULQDQ)"
)
def test_auto_stages_only_reads_over_four_mib(xfs_store):
    """Under auto a read of at most STAGE_ABOVE_BYTES of payload lands in
    place (one 2 MiB chunk, one 4 MiB chunk: no piece staged), a larger one
    is staged (three 2 MiB chunks: six 1 MiB pieces); every read exact.
    Under true even the smallest read is staged."""
    from lmcache_fx.core.medium import STAGE_ABOVE_BYTES

    assert STAGE_ABOVE_BYTES == 4 << 20
    st = _store(xfs_store)
    try:
        assert st.staged_reads
        for seed, (n, size, pieces) in enumerate([(1, 2 << 20, 0), (1, 4 << 20, 0), (3, 2 << 20, 6)], 10):
            src, dst, read = _write_and_read(st, n, size, seed)
            before = fx.direct_staged_pieces()
            assert read() == list(range(n))
            assert bytes(dst) == bytes(src)
            assert fx.direct_staged_pieces() - before == pieces, (n, size)
    finally:
        st.close()
    st = _store(xfs_store, staged_reads="true")
    try:
        src, dst, read = _write_and_read(st, 1, 2 << 20, 20)
        before = fx.direct_staged_pieces()
        assert read() == [0] and bytes(dst) == bytes(src)
        assert fx.direct_staged_pieces() - before == 2
    finally:
        st.close()


_OPEN_IN_A_CHILD = """
import json, sys
from lmcache_fx import _fxio as fx
from lmcache_fx.core.options import FxOptions
from lmcache_fx.core.store import ChunkStore
before = fx._stage_buffers()
st = ChunkStore(FxOptions.from_mapping({"path": sys.argv[1], "max_capacity_gb": 1, "staged_reads": sys.argv[2]}))
print(json.dumps({"before": before, "after_open": fx._stage_buffers(), "staged": st.staged_reads}))
st.close()
"""


def _open_in_a_child(path: str, mode: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(fx.__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_IN_A_CHILD, path, mode], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")
def test_a_store_over_two_devices_stages_and_queues_per_device(xfs_store, odirect_tmp):
    """Paths on two devices: the store counts them, its engine's queue depth
    is queue_depth for each, and staging it opens makes two buffers per
    device (a read over N devices keeps N times the pieces in flight, and
    needs the slots). Two paths on one device count once."""
    other = str(odirect_tmp / "store")
    if os.stat(odirect_tmp).st_dev == os.stat(xfs_store).st_dev:
        pytest.skip("tmp_path is on the loop device's filesystem")
    got = _open_in_a_child(f"{xfs_store},{other}", "true")
    assert got["before"] == 0 and got["staged"] is True and got["after_open"] == 4, got
    st = _store(f"{xfs_store},{other}", queue_depth=12)
    try:
        assert st.devices == 2 and st.engine.queue_depth == 24
    finally:
        st.close()
    st = _store(f"{xfs_store}/a,{xfs_store}/b", queue_depth=12)
    try:
        assert st.devices == 1 and st.engine.queue_depth == 12
    finally:
        st.close()


@pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")
@pytest.mark.parametrize("mode", ["true", "false"])
def test_a_store_that_stages_makes_its_staging_buffers_when_it_opens(xfs_store, mode):
    """In a fresh process, opening a store that stages its reads makes both
    staging buffers before any read (their huge pages cost the first load
    20-25 ms when made on demand); one that does not stage makes none."""
    got = _open_in_a_child(xfs_store, mode)
    assert got["before"] == 0 and got["staged"] == (mode == "true"), got
    assert got["after_open"] == (2 if mode == "true" else 0), got


def test_a_disk_store_off_a_loop_device_reads_in_place(tmp_path):
    """On a filesystem that is no loop device (the temporary directory's),
    auto does not stage: a drive that DMAs the data would pay a copy."""
    root = str(tmp_path / "store")
    os.makedirs(root)
    if page_cache_fs([root]) or loop_backed(root):
        pytest.skip("the temporary directory is a memory filesystem or on a loop device")
    st = _store(root)
    try:
        assert not st.staged_reads
    finally:
        st.close()


@pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")
def test_a_verify_off_store_checks_flagged_chunks_as_they_land(xfs_store):
    """Chunks a verify-on store wrote on disk carry FLAG_CHECK_PAYLOAD, which
    every reader checks, verify or not. A verify-off store read them as
    unchecked reads and then summed each payload again from memory after the
    batch, one chunk after another: 0.69-0.72x the speed of a verify-on store
    on the same files (scripts/chunk_overhead.py at 2 MiB). It now reads them
    as checked reads, staged where the medium stages them (each piece summed
    as it lands): exact, and a flipped payload byte is still a miss."""
    writer = _store(xfs_store, staged_reads="true")
    try:
        size, n = 3 << 20, 4
        src, dst, _ = _write_and_read(writer, n, size, 30)
        keys = [f"staged-30-{i}" for i in range(n)]
    finally:
        writer.close()
    st = _store(xfs_store, verify=False, staged_reads="true")
    try:
        assert not st.staged_reads  # what a verify-off store's own reads do

        def read():
            it = iter(range(n))
            return st.read(keys, lambda m: (lambda i: (i, dst.address + i * size, size))(next(it)), lambda h: None)

        read()  # the index learns the headers (and their flag)
        memoryview(dst)[:] = bytes(len(dst))
        before = fx.direct_staged_pieces()
        assert read() == list(range(n))
        assert bytes(dst) == bytes(src)
        assert fx.direct_staged_pieces() - before == n * 3  # checked as they landed, 1 MiB pieces
        _flip_a_payload_byte(xfs_store, (1 << 20) + 5, 0x01)
        assert sum(o is None for o in read()) == 1
    finally:
        st.close()
