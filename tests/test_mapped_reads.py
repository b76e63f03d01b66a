"""Reads from memory that copy and checksum in one pass. Mapped reads
(csrc/mapped.c, read_chunks' `mapped`, the `mapped_reads` option): payloads of
chunk files of 2 MiB or more on a memory filesystem are copied from a mapping
of the file. Staged reads (batch.c, run_staged; Engine(staged=True)): pieces
are read into a staging buffer of the reading thread's and copied on.

Real files on a real tmpfs (/dev/shm; a tmpfs mounted with huge pages when
root), both engines. A file truncated under a live mapping raises a real
SIGBUS in a child interpreter: it must be a miss, not a crash."""

import contextlib
import os
import random
import signal
import subprocess
import tempfile

import pytest
from test_engine_chunks import body_of, read, run_child, write_chunk

from lmcache_fx import _fxio as fx
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta
from lmcache_fx.core.medium import huge_page_tmpfs, page_cache_fs
from lmcache_fx.core.options import ConfigError, FxOptions
from lmcache_fx.core.store import ChunkStore
from lmcache_fx.testing.loopfs import tmpfs

URING_OK, URING_WHY = fx.io_uring_status()
KINDS = [pytest.param("io_uring", marks=pytest.mark.skipif(not URING_OK, reason=URING_WHY)), "threads"]
MAP_MIN = 2 << 20  # FX_MAP_MIN: files this big or bigger are mapped


@pytest.fixture
def shm_root():
    """A store-like directory on /dev/shm (tmpfs)."""
    if not os.path.isdir("/dev/shm") or not page_cache_fs(["/dev/shm"]):
        pytest.skip("/dev/shm is not a tmpfs here")
    d = tempfile.mkdtemp(prefix="fx-mapped-", dir="/dev/shm")
    os.makedirs(os.path.join(d, "ab"))
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


@pytest.fixture
def huge_tmpfs():
    """A tmpfs mounted with huge=within_size (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs with huge pages needs root")
    with contextlib.ExitStack() as stack:
        try:
            mnt = stack.enter_context(tmpfs("size=256m,huge=within_size"))
        except RuntimeError as e:
            pytest.skip(f"this kernel refused a tmpfs with huge=within_size ({e})")
        yield mnt


def _rootfd(root):
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("submit", [False, True])
def test_mapped_reads_land_bit_exact_and_are_counted(kind, submit, shm_root):
    """Files at, below and above the 2 MiB threshold, payloads of odd lengths,
    read with and without `mapped`, verify on and off: the same statuses and
    the same bytes; only the files of 2 MiB or more are copied from their
    mappings (map_stats), and only when asked."""
    rng = random.Random(7)
    # file sizes: exactly the threshold, one byte short of it, odd, several pieces
    sizes = [MAP_MIN - HEADER_SIZE, MAP_MIN - HEADER_SIZE - 1, (3 << 20) + 17, 9 << 20, 5000]
    names = []
    for i, n in enumerate(sizes):
        write_chunk(shm_root, f"ab/m{i}.fxkv", rng.randbytes(n), key=f"m{i}")
        names.append((f"ab/m{i}.fxkv", n))
    payloads = [open(os.path.join(shm_root, f), "rb").read()[HEADER_SIZE:] for f, _ in names]
    fd = _rootfd(shm_root)
    eng = fx.Engine(kind, queue_depth=8, split_bytes=1 << 20)
    try:
        for verify in (True, False):
            for mapped in (False, True):
                before = fx.map_stats()
                res, datas, _ = read(
                    eng, fd, names, verify=verify, direct=True,
                    expects=[body_of(f"m{i}", n) for i, (_, n) in enumerate(names)], submit=submit,
                    mapped=mapped,
                )  # fmt: skip
                pieces = fx.map_stats()[0] - before[0]
                assert [r[0] for r in res] == [fx.CHUNK_OK] * len(names), (verify, mapped, res)
                assert datas == payloads, (verify, mapped)
                # mapped: sizes[0] (2 pieces), sizes[2] (4), sizes[3] (9); sizes[1] and [4] are read
                assert pieces == (15 if mapped else 0), (verify, mapped, pieces)
    finally:
        eng.close()
        os.close(fd)


@pytest.mark.parametrize("kind", KINDS)
def test_a_corrupt_payload_copied_from_its_mapping_is_a_crc_miss(kind, shm_root):
    """The CRC32C taken while copying is the one checked: a flipped byte is
    CHUNK_PAYLOAD_CRC, as on the read path."""
    p = bytearray(random.Random(3).randbytes(3 << 20))
    write_chunk(shm_root, "ab/bad.fxkv", bytes(p), key="bad")
    with open(os.path.join(shm_root, "ab/bad.fxkv"), "r+b") as f:
        f.seek(HEADER_SIZE + (2 << 20) + 12345)
        f.write(bytes([p[(2 << 20) + 12345] ^ 0x40]))
    fd = _rootfd(shm_root)
    eng = fx.Engine(kind, queue_depth=8)
    try:
        before = fx.map_stats()[0]
        res, _, _ = read(eng, fd, [("ab/bad.fxkv", len(p))], verify=True, direct=True, mapped=True)
        assert res[0][0] == fx.CHUNK_PAYLOAD_CRC
        assert fx.map_stats()[0] > before
    finally:
        eng.close()
        os.close(fd)


TRUNCATED = """
import shutil, sys
sys.path.insert(0, ARGS["tests"])
from test_engine_chunks import read
root = ARGS["root"]
rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
runs = []
for attempt in range(2):  # twice: the handler must still be in place, SIGBUS not left blocked
    shutil.copyfile(os.path.join(root, ARGS["spare"]), os.path.join(root, ARGS["cut"]))
    os.environ["LMCACHE_FX_FAULT"] = "map_truncate:1"  # armed when an engine is made
    eng = fx.Engine(ARGS["kind"], queue_depth=8, split_bytes=1 << 20)
    faults0 = fx.map_stats()[1]
    cut, _, _ = read(eng, rfd, [(ARGS["cut"], ARGS["n"])], verify=True, direct=True, mapped=True)
    faults = fx.map_stats()[1] - faults0
    good, datas, _ = read(eng, rfd, [(ARGS["good"], ARGS["n"])], verify=True, direct=True, mapped=True)
    want = open(os.path.join(root, ARGS["good"]), "rb").read()[4096:]
    runs.append({"status": [cut[0][0], good[0][0]], "faults": faults, "good_exact": datas[0] == want,
                 "cut_size": os.stat(os.path.join(root, ARGS["cut"])).st_size})
    eng.close()
out(runs=runs)
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_truncated_under_its_mapping_is_a_miss_not_a_crash(kind, shm_root, tmp_path):
    """A real truncation under a live mapping (the map_truncate fault cuts
    the file to its header just before the copy, as another process could):
    the copy's SIGBUS is caught, the piece is read instead and comes back
    short, so the chunk is a miss; another chunk then reads exact from its
    mapping; twice in a row in the same process."""
    n = 5 << 20
    rng = random.Random(11)
    for name in ("cut", "good"):
        write_chunk(shm_root, f"ab/{name}.fxkv", rng.randbytes(n), key=name)
    with open(os.path.join(shm_root, "ab/cut.fxkv"), "rb") as f:  # restored between attempts
        original = f.read()
    with open(os.path.join(shm_root, "ab/spare.fxkv"), "wb") as g:
        g.write(original)
    out = run_child(
        TRUNCATED,
        {"root": shm_root, "kind": kind, "cut": "ab/cut.fxkv", "good": "ab/good.fxkv", "spare": "ab/spare.fxkv",
         "n": n, "tests": os.path.dirname(__file__)},
        tmp_path,
    )  # fmt: skip
    for run in out["runs"]:
        assert run["cut_size"] == HEADER_SIZE, out  # the fault really cut the file
        assert run["faults"] >= 1, out  # and the copy really faulted
        assert run["status"] == [fx.CHUNK_SHORT, fx.CHUNK_OK], out
        assert run["good_exact"], out


CUT_IN_A_PAGE = """
import sys
sys.path.insert(0, ARGS["tests"])
from test_engine_chunks import read
rfd = os.open(ARGS["root"], os.O_RDONLY | os.O_DIRECTORY)
os.environ["LMCACHE_FX_FAULT"] = "map_cut:1"  # armed when an engine is made
eng = fx.Engine(ARGS["kind"], queue_depth=8, split_bytes=1 << 20)
faults0, pieces0 = fx.map_stats()[1], fx.map_stats()[0]
res, datas, _ = read(eng, rfd, [(ARGS["cut"], ARGS["n"])], verify=False, direct=True, mapped=True)
out(status=res[0][0], nbytes=res[0][1], faults=fx.map_stats()[1] - faults0, pieces=fx.map_stats()[0] - pieces0,
    size=os.stat(os.path.join(ARGS["root"], ARGS["cut"])).st_size)
eng.close()
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_cut_inside_its_last_page_under_its_mapping_is_a_miss(kind, shm_root, tmp_path):
    """A file cut by less than a page under a live mapping (the map_cut
    fault takes its last byte just before the copy): no SIGBUS, the copy
    reads a zero where the byte was, and with verify off no CRC would tell.
    The size after the copy does: the chunk is short, a miss, not the
    payload with its end zeroed."""
    n = 5 << 20
    write_chunk(shm_root, "ab/cut.fxkv", random.Random(12).randbytes(n), key="cut")
    out = run_child(
        CUT_IN_A_PAGE,
        {"root": shm_root, "kind": kind, "cut": "ab/cut.fxkv", "n": n, "tests": os.path.dirname(__file__)},
        tmp_path,
    )
    assert out["size"] == HEADER_SIZE + n - 1 and out["faults"] == 0 and out["pieces"] >= 1, (
        out
    )  # cut, copied, no fault
    assert out["status"] == fx.CHUNK_SHORT and out["nbytes"] == n - 1, out


FOREIGN = """
import sys
sys.path.insert(0, ARGS["tests"])
from test_engine_chunks import read
import signal
seen = []
signal.signal(signal.SIGBUS, lambda s, f: seen.append(s))  # the handler that was there before
rfd = os.open(ARGS["root"], os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine("threads", queue_depth=4)
pieces0 = fx.map_stats()[0]
res, _, _ = read(eng, rfd, [(ARGS["name"], ARGS["n"])], verify=True, direct=True, mapped=True)
copied = fx.map_stats()[0] - pieces0
os.kill(os.getpid(), signal.SIGBUS)  # not a fault of a mapped copy
for _ in range(100):
    if seen:
        break
    time.sleep(0.01)
eng.close()
out(status=res[0][0], copied=copied, seen=seen)
"""


def test_a_sigbus_not_of_a_mapped_copy_goes_to_the_handler_before(shm_root, tmp_path):
    """The guard's SIGBUS handler passes on every SIGBUS that is not a fault
    of a guarded copy: here to the Python handler installed before it."""
    n = 3 << 20
    write_chunk(shm_root, "ab/f.fxkv", random.Random(5).randbytes(n), key="f")
    out = run_child(
        FOREIGN, {"root": shm_root, "name": "ab/f.fxkv", "n": n, "tests": os.path.dirname(__file__)}, tmp_path
    )
    assert out["status"] == fx.CHUNK_OK and out["copied"] > 0, out
    assert out["seen"] == [int(signal.SIGBUS)], out


# ------------------------------------------------------------- the option


def _store(root, **opts):
    return ChunkStore(FxOptions.from_mapping({"path": root, "max_capacity_gb": 1, **opts}))


def test_mapped_reads_option_follows_the_medium(shm_root, tmp_path):
    """auto maps where the tmpfs keeps huge pages (not /dev/shm's default);
    true maps on any tmpfs; false never; true on a disk filesystem is a
    ConfigError that names the key and the fix."""
    st = _store(shm_root)
    try:
        assert st.mapped_reads == (huge_page_tmpfs([shm_root]) and bool(fx.CRC32C_COPY_ONE_PASS))
    finally:
        st.close()
    for mode, want in (("true", True), ("false", False)):
        st = _store(shm_root, mapped_reads=mode)
        try:
            assert st.mapped_reads is want
        finally:
            st.close()
    disk = str(tmp_path / "disk")
    os.makedirs(disk)
    if page_cache_fs([disk]):
        pytest.skip("the temporary directory is itself a tmpfs: no disk filesystem to refuse")
    with pytest.raises(ConfigError, match=r"mapped_reads: true.*use auto"):
        _store(disk, mapped_reads="true")
    assert _store(disk).mapped_reads is False


def test_a_store_on_a_huge_page_tmpfs_maps_its_reads(huge_tmpfs):
    """On a tmpfs mounted huge=within_size the default (auto) maps: chunks
    written and read back through the store are exact, copied from their
    mappings, and a chunk cut short on disk is a miss."""
    assert huge_page_tmpfs([huge_tmpfs])
    root = os.path.join(huge_tmpfs, "store")
    st = _store(root, verify=True)
    try:
        assert st.mapped_reads == bool(fx.CRC32C_COPY_ONE_PASS)
        if not st.mapped_reads:
            st.close()
            st = _store(root, verify=True, mapped_reads="true")  # the path itself, on a CPU without one pass
        size, n = 4 << 20, 4
        src = fx.HostBuffer(n * size)
        mv = memoryview(src)
        for i in range(n):
            mv[i * size : (i + 1) * size] = random.Random(i).randbytes(size)
        meta = ChunkMeta(((size,),), ("uint8",), "raw")
        keys = [f"huge-{i}" for i in range(n)]
        assert all(st.write([(k, src.address + i * size, size, meta) for i, k in enumerate(keys)]))
        dst = fx.HostBuffer(n * size)
        it = iter(range(n))
        before = fx.map_stats()[0]
        out = st.read(keys, lambda m: (lambda i: (i, dst.address + i * size, size))(next(it)), lambda h: None)
        assert out == list(range(n))
        assert bytes(dst) == bytes(src)
        assert fx.map_stats()[0] - before == n * (size // (1 << 20))
        # one file cut short: a miss, the others still hits
        victim = next(
            os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".fxkv")
        )  # fmt: skip
        os.truncate(victim, HEADER_SIZE + size // 2)
        it = iter(range(n))
        out = st.read(keys, lambda m: (lambda i: (i, dst.address + i * size, size))(next(it)), lambda h: None)
        assert sum(o is None for o in out) == 1
        assert all(o is None or o == i for i, o in enumerate(out))
    finally:
        st.close()


# ------------------------------------------------------------- staged reads


@pytest.mark.parametrize("kind", KINDS)
def test_staged_reads_land_bit_exact_and_are_counted(kind, shm_root):
    """Reads from memory with a CRC32C go through the reading thread's staging
    buffer (Engine(staged=True), the default) where the one-pass copy exists:
    the same statuses and bytes as read directly (staged=False), a flipped
    byte still a CRC miss, a file cut short still short; pieces under 64 KiB
    and reads without verify are not staged."""
    rng = random.Random(21)
    sizes = [(1 << 20) + 4096, (3 << 20) + 17, 70000, 5000]  # several stretches, an odd tail, small ones
    names = []
    for i, n in enumerate(sizes):
        write_chunk(shm_root, f"ab/s{i}.fxkv", rng.randbytes(n), key=f"s{i}")
        names.append((f"ab/s{i}.fxkv", n))
    payloads = [open(os.path.join(shm_root, f), "rb").read()[HEADER_SIZE:] for f, _ in names]
    bad = bytearray(payloads[1])
    bad[(2 << 20) + 5] ^= 1
    write_chunk(shm_root, "ab/bad.fxkv", bytes(bad), key="bad", pcrc=fx.crc32c(payloads[1]))
    write_chunk(shm_root, "ab/cut.fxkv", payloads[1], key="cut")
    os.truncate(os.path.join(shm_root, "ab/cut.fxkv"), HEADER_SIZE + (2 << 20) + 100)
    fd = _rootfd(shm_root)
    try:
        for staged in (True, False):
            eng = fx.Engine(kind, queue_depth=8, split_bytes=1 << 20, staged=staged)
            try:
                for verify in (True, False):
                    before = fx.staged_pieces()
                    res, datas, _ = read(eng, fd, names, verify=verify, direct=True)
                    counted = fx.staged_pieces() - before
                    assert [r[0] for r in res] == [fx.CHUNK_OK] * len(names), (staged, verify, res)
                    assert datas == payloads, (staged, verify)
                    # O_DIRECT pieces of 64 KiB or more: (1 MiB + 4 KiB) 1 MiB of 1 MiB + 4 KiB; (3 MiB + 17)
                    # three of 1 MiB (the 17-byte tail is a piece of its own); 70000: its aligned 69632 bytes
                    want = 5 if (staged and verify and fx.CRC32C_COPY_ONE_PASS) else 0
                    assert counted == want, (staged, verify, counted)
                res, _, _ = read(eng, fd, [("ab/bad.fxkv", len(bad)), ("ab/cut.fxkv", len(bad))], direct=True)
                assert [r[0] for r in res] == [fx.CHUNK_PAYLOAD_CRC, fx.CHUNK_SHORT], (staged, res)
                assert res[1][1] == (2 << 20) + 100
            finally:
                eng.close()
    finally:
        os.close(fd)


SHORT_STAGED = """
import sys
sys.path.insert(0, ARGS["tests"])
from test_engine_chunks import read
rfd = os.open(ARGS["root"], os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine(ARGS["kind"], queue_depth=4, split_bytes=1 << 20)
s0 = fx.staged_pieces()
res, datas, _ = read(eng, rfd, [(ARGS["name"], ARGS["n"])], verify=True, direct=True)
want = open(os.path.join(ARGS["root"], ARGS["name"]), "rb").read()[4096:]
out(status=res[0][0], nbytes=res[0][1], exact=datas[0] == want, staged=fx.staged_pieces() - s0,
    short=fx._fault_counts().get("short"), eintr=fx._fault_counts().get("eintr"))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_staged_reads_ride_out_short_reads_and_eintr(kind, shm_root, tmp_path):
    """Short transfers and EINTR inside a staged piece (fault points) are
    retried as on the direct path: the chunk still reads exact."""
    if not fx.CRC32C_COPY_ONE_PASS:
        pytest.skip("no one-pass copy on this CPU: nothing is staged")
    n = (3 << 20) + 4096
    write_chunk(shm_root, "ab/f.fxkv", random.Random(8).randbytes(n), key="f")
    out = run_child(
        SHORT_STAGED,
        {"root": shm_root, "kind": kind, "name": "ab/f.fxkv", "n": n, "tests": os.path.dirname(__file__)},
        tmp_path,
        env={"LMCACHE_FX_FAULT": "short:3,eintr:2"},
    )
    assert out["status"] == fx.CHUNK_OK and out["nbytes"] == n and out["exact"], out
    assert out["staged"] > 0 and out["short"] == 3 and out["eintr"] == 2, out


def _toggle_byte(path, off, a, b, stop):
    """Another process writing one byte of a mapped chunk file back and forth."""
    import mmap

    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 0)
    while not stop.is_set():
        for _ in range(10000):
            m[off] = b
            m[off] = a
    m[off] = a
    m.close()
    os.close(fd)


def test_a_checked_mapped_read_never_passes_bytes_other_than_those_summed(shm_root):
    """The one-pass copy with CRC32C read a piece's tail (under 512 bytes)
    twice from the mapping, once to copy it and once to sum it: a byte
    written by another process in between went to the destination while the
    CRC was of the old one, and the read passed its check with bytes the
    header's CRC is not of (7 in 2379 reads, 8 s, before). The tail is summed
    from the copy now. A race, so bounded: 4 s of reads while a process flips
    a tail byte; no read may pass with the flipped byte."""
    import multiprocessing
    import time

    if not fx.CRC32C_COPY_ONE_PASS:
        pytest.skip("this CPU has no one-pass copy with CRC32C (the path raced here)")
    n = (2 << 20) + 1500  # the last 1 MiB piece is 1500 bytes: the one-pass copy, a 476-byte tail
    payload = bytearray(random.Random(1).randbytes(n))
    pos = (2 << 20) + 1024 + 200  # in that tail
    a, b = payload[pos], payload[pos] ^ 0xFF
    write_chunk(shm_root, "ab/c.fxkv", bytes(payload), key="c")
    stop = multiprocessing.Event()
    flipper = multiprocessing.Process(
        target=_toggle_byte, args=(os.path.join(shm_root, "ab", "c.fxkv"), HEADER_SIZE + pos, a, b, stop)
    )
    flipper.start()
    rfd = _rootfd(shm_root)
    eng = fx.Engine("threads", queue_depth=4, split_bytes=1 << 20)
    passed = wrong = 0
    try:
        end = time.monotonic() + 4
        while time.monotonic() < end:
            res, datas, _ = read(eng, rfd, [("ab/c.fxkv", n)], verify=True, mapped=True)
            if res[0][0] == fx.CHUNK_OK:
                passed += 1
                wrong += datas[0][pos] != a
    finally:
        stop.set()
        flipper.join()
        eng.close()
        os.close(rfd)
    assert passed > 0 and wrong == 0


def test_sigbus_handed_back_by_faulthandler_ends_the_process(shm_root, tmp_path):
    """faulthandler enabled after the engine's SIGBUS guard saves the guard
    as its previous handler, and the guard, put back by the next mapped read,
    saves faulthandler as its own: a SIGBUS from outside a guarded copy went
    from one to the other for ever (47979 tracebacks in 10 s, the process
    never died). It ends with one traceback and the default action now."""
    n = 3 << 20
    write_chunk(shm_root, "ab/f.fxkv", random.Random(5).randbytes(n), key="f")
    code = f"""
import faulthandler, os, signal, sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_engine_chunks import read
from lmcache_fx import _fxio as fx
rfd = os.open({shm_root!r}, os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine("threads", queue_depth=4)
assert read(eng, rfd, [("ab/f.fxkv", {n})], verify=True, mapped=True)[0][0][0] == fx.CHUNK_OK  # the guard
faulthandler.enable()
assert read(eng, rfd, [("ab/f.fxkv", {n})], verify=True, mapped=True)[0][0][0] == fx.CHUNK_OK  # put back
assert fx.map_stats()[0] > 0
os.kill(os.getpid(), signal.SIGBUS)
print("survived")
"""
    r = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGBUS and "survived" not in r.stdout, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count("Fatal Python error: Bus error") == 1
