"""Tests of the C core, lmcache_fx._fxio: engines, batches, O_DIRECT, CRC32C.

Every engine test runs on both engines: 'io_uring' (skipped, with the reason
io_uring_status() gives, where the kernel or the build lacks it) and
'threads'. Files live in pytest's tmp_path; the O_DIRECT tests are skipped
where that filesystem refuses O_DIRECT (tmpfs, for one).
"""

import asyncio
import ctypes
import errno
import gc
import os
import pathlib
import random
import resource
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from lmcache_fx import _fxio as fx

KiB = 1 << 10
MiB = 1 << 20
ALIGN = 4096

URING_OK, URING_WHY = fx.io_uring_status()
ENGINE_PARAMS = [
    pytest.param(
        "io_uring",
        marks=pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}"),
    ),
    "threads",
]


# ---------------------------------------------------------------- helpers


def _table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        t.append(c)
    return t


_CRC_TABLE = _table()


def crc32c_py(data, value=0):
    """Bitwise-table CRC32C (Castagnoli), independent of the C code."""
    crc = value ^ 0xFFFFFFFF
    t = _CRC_TABLE
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def addr_of(buf, offset=0):
    """Address of a writable buffer (bytearray, HostBuffer) plus offset."""
    if isinstance(buf, fx.HostBuffer):
        return buf.address + offset
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) + offset


def round_up(n, a=ALIGN):
    return (n + a - 1) // a * a


def write_file(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def open_fd(path, flags=os.O_RDONLY):
    return os.open(path, flags | os.O_CLOEXEC, 0o644)


@pytest.fixture
def fds():
    """Collects descriptors opened by a test and closes them after it."""
    opened = []

    def _open(path, flags=os.O_RDONLY):
        fd = open_fd(path, flags)
        opened.append(fd)
        return fd

    yield _open
    for fd in opened:
        try:
            os.close(fd)
        except OSError:
            pass


@pytest.fixture(params=ENGINE_PARAMS)
def kind(request):
    return request.param


@pytest.fixture
def make_engine(kind):
    """Engine factory on the parametrised engine kind; closes them after."""
    made = []

    def _make(**kw):
        e = fx.Engine(io_engine=kind, **kw)
        made.append(e)
        assert e.kind == kind
        return e

    yield _make
    for e in made:
        e.close()


@pytest.fixture(scope="module")
def payload():
    """3 MiB + 5000 bytes of seeded random data (not a multiple of 4 KiB)."""
    return random.Random(1234).randbytes(3 * MiB + 5000)


@pytest.fixture
def direct_ok(tmp_path):
    """Skips when tmp_path's filesystem refuses O_DIRECT."""
    probe = tmp_path / "odirect-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"filesystem of {tmp_path} does not support O_DIRECT (EINVAL on open)")
        raise
    os.close(fd)
    return tmp_path


# ------------------------------------------------------------ module level


def test_module_constants():
    assert fx.DIO_ALIGN == 4096
    assert fx.HAVE_LIBURING in (0, 1)
    assert fx.CRC32C_IMPL in (
        "vpclmulqdq-512",
        "vpclmulqdq+crc32q",
        "pclmulqdq+crc32q",
        "sse4.2",
        "armv8-pmull",
        "armv8-crc",
        "table",
    )
    ok, why = fx.io_uring_status()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not fx.HAVE_LIBURING:
        assert ok is False and "liburing" in why


def test_crc32c_known_vectors():
    assert fx.crc32c(b"123456789") == 0xE3069283
    assert crc32c_py(b"123456789") == 0xE3069283
    assert fx.crc32c(b"") == 0
    # RFC 3720 (iSCSI) B.4 vectors
    assert fx.crc32c(bytes(32)) == 0x8A9136AA
    assert fx.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert fx.crc32c(bytes(range(32))) == 0x46DD794E
    assert fx.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C


def test_crc32c_matches_reference_and_chains():
    data = random.Random(7).randbytes(70_000)  # > 64 KiB: the GIL-free path too
    ref = crc32c_py(data)
    assert fx.crc32c(data) == ref
    assert fx.crc32c(bytearray(data)) == ref
    assert fx.crc32c(memoryview(data)) == ref
    # every start alignment and short tails (the hardware path's edges)
    for start in range(9):
        for n in (0, 1, 7, 8, 9, 15, 16, 17, 100):
            chunk = data[start : start + n]
            assert fx.crc32c(chunk) == crc32c_py(chunk), (start, n)
    # chaining: crc(a + b) == crc(b, value=crc(a))
    for cut in (0, 1, 13, 4096, 65_537, len(data)):
        assert fx.crc32c(data[cut:], fx.crc32c(data[:cut])) == ref
        assert fx.crc32c(data[cut:], value=fx.crc32c(data[:cut])) == ref
    # crc32c_at reads raw memory
    buf = bytearray(data)
    assert fx.crc32c_at(addr_of(buf), len(buf)) == ref
    assert fx.crc32c_at(addr_of(buf, 3), 1000) == crc32c_py(data[3:1003])
    assert fx.crc32c_at(addr_of(buf, 10), 500, fx.crc32c(data[:10])) == crc32c_py(data[:510])
    assert fx.crc32c_at(addr_of(buf), 0) == 0
    with pytest.raises(TypeError):
        fx.crc32c("not bytes")


def test_crc32c_large_buffers_match_chunked():
    """Long buffers (the multi-stream path) equal the CRC chained over short
    chunks, whose correctness the reference above pins down."""
    data = random.Random(8).randbytes(300_000)

    def chunked(buf, step=1000):
        crc = 0
        for i in range(0, len(buf), step):
            crc = fx.crc32c(buf[i : i + step], crc)
        return crc

    for start in (0, 1, 3, 7, 8):
        for n in (24_575, 24_576, 24_577, 49_152, 49_159, 73_728 + 13, 200_000, 299_000):
            chunk = data[start : start + n]
            want = chunked(chunk)
            assert fx.crc32c(chunk) == want, (start, n)
            buf = bytearray(chunk)
            assert fx.crc32c_at(addr_of(buf), n) == want, (start, n)
    # a non-zero starting value through the long path
    head, tail = data[:5], data[5:100_005]
    assert fx.crc32c(tail, fx.crc32c(head)) == chunked(data[:100_005])


# --------------------------------------------------------------- 1. round trip


@pytest.mark.parametrize("split", [4096, 65536, 1 << 20, "whole"])
@pytest.mark.parametrize("qd", [1, 2, 8, 64, 256])
def test_round_trip(make_engine, qd, split, payload, tmp_path, fds):
    size = len(payload)
    split_bytes = round_up(size) if split == "whole" else split
    eng = make_engine(queue_depth=qd, split_bytes=split_bytes)
    assert eng.queue_depth == qd and eng.split_bytes == split_bytes

    src = fx.HostBuffer(size)
    memoryview(src)[:] = payload
    path = tmp_path / "rt.bin"
    fd = fds(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    # three ops, boundaries at unaligned places, submitted out of file order
    cuts = [0, 777_777, 2 * MiB + 3, size]
    spans = [(a, b - a) for a, b in zip(cuts, cuts[1:])][::-1]
    expect = [(n, fx.crc32c(payload[a : a + n])) for a, n in spans]

    res = eng.write([(fd, a, n, src.address + a) for a, n in spans], crc=True)
    assert res == expect
    assert read_file(path) == payload

    dst = fx.HostBuffer(size)
    res = eng.read([(fd, a, n, dst.address + a) for a, n in spans], crc=True)
    assert res == expect
    assert memoryview(dst) == payload

    # without crc: plain byte counts, and a read into a bytearray
    ba = bytearray(size)
    assert eng.read([(fd, 0, size, addr_of(ba))]) == [size]
    assert ba == payload


def test_split_per_call(make_engine, payload, tmp_path, fds):
    """split= overrides split_bytes for one call (the store writes each
    O_DIRECT payload as one piece): same bytes and CRCs, a bad value refused."""
    size = len(payload)
    eng = make_engine(queue_depth=4, split_bytes=4096)
    src = fx.HostBuffer(size)
    memoryview(src)[:] = payload
    fd = fds(tmp_path / "s.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    assert eng.write([(fd, 0, size, src.address)], crc=True, split=1 << 30) == [(size, fx.crc32c(payload))]
    dst = fx.HostBuffer(size)
    assert eng.read([(fd, 0, size, dst.address)], crc=True, split=8192) == [(size, fx.crc32c(payload))]
    assert memoryview(dst) == payload
    for bad in (5000, (1 << 30) + 4096):
        with pytest.raises(ValueError, match="split must be"):
            eng.write([(fd, 0, size, src.address)], split=bad)


# ------------------------------------------------------- 2. many ops per batch


def test_many_files_one_batch(make_engine, tmp_path, fds):
    rng = random.Random(42)
    eng = make_engine(queue_depth=16, split_bytes=16 * KiB)
    lengths = [0, 1, 4095, 4096, 4097, 65_536, 100_000] + [rng.randrange(0, 70_000) for _ in range(193)]
    rng.shuffle(lengths)
    datas = [rng.randbytes(n) for n in lengths]
    src = bytearray(b"".join(datas))
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    paths = [tmp_path / f"f{i:03d}" for i in range(len(lengths))]
    wfds = [fds(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for p in paths]

    wres = eng.write([(fd, 0, n, addr_of(src, o) if n else 0) for fd, n, o in zip(wfds, lengths, offs)], crc=True)
    assert wres == [(n, fx.crc32c(d) if n else 0) for n, d in zip(lengths, datas)]
    for p, d in zip(paths, datas):
        assert read_file(p) == d

    rfds = [fds(p) for p in paths]
    dst = bytearray(len(src) + 1)
    dst[-1] = 0xA5  # sentinel past the last op
    rres = eng.read([(fd, 0, n, addr_of(dst, o)) for fd, n, o in zip(rfds, lengths, offs)])
    assert rres == lengths
    assert dst[:-1] == src and dst[-1] == 0xA5


def test_small_and_large_pieces_mixed_with_crc(make_engine, payload, tmp_path, fds):
    """Small pieces are handed to a worker several at a time (the thread
    engine, and memory reads on io_uring's side pool), large ones one at a
    time; in a batch of both, every op's bytes and CRC32C come out whole."""
    rng = random.Random(11)
    path = write_file(tmp_path / "mixed.bin", payload)
    fd = fds(path)
    eng = make_engine(queue_depth=32, split_bytes=MiB)
    ops, off = [], 0
    for _ in range(400):
        n = rng.choice([0, 1, 4096, 30_000, 65_535, 65_536, 65_537, 200_000, 1_500_000])
        foff = rng.randrange(0, len(payload) - n)
        ops.append((foff, n, off))
        off += n
    dst = bytearray(off + 1)
    dst[-1] = 0x5A
    res = eng.read([(fd, foff, n, addr_of(dst, boff)) for foff, n, boff in ops], crc=True)
    assert [r[0] for r in res] == [n for _, n, _ in ops]
    for (foff, n, boff), (_, crc) in zip(ops, res):
        assert dst[boff : boff + n] == payload[foff : foff + n]
        assert crc == (fx.crc32c(payload[foff : foff + n]) if n else 0)
    assert dst[-1] == 0x5A


def test_many_ops_on_one_file(make_engine, payload, tmp_path, fds):
    rng = random.Random(5)
    path = write_file(tmp_path / "one.bin", payload)
    fd = fds(path)
    eng = make_engine(queue_depth=8, split_bytes=4096)
    ops, spans, off = [], [], 0
    dst = bytearray(600 * 12_000)
    for _ in range(500):
        n = rng.choice([0, 1, 511, 4096, 5000, 11_999])
        foff = rng.randrange(0, len(payload) - n)
        ops.append((fd, foff, n, addr_of(dst, off)))
        spans.append((foff, n, off))
        off += n
    res = eng.read(ops, crc=True)
    assert [r[0] for r in res] == [n for _, n, _ in spans]
    for (foff, n, boff), (_, crc) in zip(spans, res):
        assert dst[boff : boff + n] == payload[foff : foff + n]
        assert crc == (fx.crc32c(payload[foff : foff + n]) if n else 0)


def test_empty_batch(make_engine):
    eng = make_engine()
    assert eng.read([]) == []
    assert eng.write([], crc=True) == []
    assert eng.submit([]).wait() == []


def test_bad_op_arguments(make_engine):
    eng = make_engine()
    buf = bytearray(16)
    a = addr_of(buf)
    with pytest.raises(ValueError):
        eng.read([(-1, 0, 1, a)])
    with pytest.raises(ValueError):
        eng.read([(0, -1, 1, a)])
    with pytest.raises(ValueError):
        eng.read([(0, 0, -1, a)])
    with pytest.raises(ValueError, match="NULL"):
        eng.read([(0, 0, 1, 0)])
    with pytest.raises(TypeError):
        eng.read([(0, 0, 1)])
    with pytest.raises(TypeError):
        eng.read(None)
    with pytest.raises(TypeError):
        eng.submit([(0, 0, "x", a)])
    assert buf == bytearray(16)


# ----------------------------------------------------- 3. EOF and bad fds


@pytest.mark.parametrize("split", [4096, 1 << 20])
def test_short_file_and_eof(make_engine, split, tmp_path, fds):
    data = random.Random(3).randbytes(10_000)
    fd = fds(write_file(tmp_path / "short.bin", data))
    eng = make_engine(queue_depth=4, split_bytes=split)
    cases = [  # (offset, length, expected bytes)
        (0, 16_384, 10_000),
        (8_000, 4_096, 2_000),
        (4_096, 100_000, 5_904),
        (9_999, 10, 1),
        (10_000, 100, 0),
        (20_000, 100, 0),
        (1 << 40, 4096, 0),
    ]
    bufs = [bytearray(b"\xee" * (n + 1)) for _, n, _ in cases]
    ops = [(fd, o, n, addr_of(b)) for (o, n, _), b in zip(cases, bufs)]
    res = eng.read(ops, crc=True)
    assert [r[0] for r in res] == [e for _, _, e in cases]
    for (o, n, e), b, (_, crc) in zip(cases, bufs, res):
        assert b[:e] == data[o : o + e]
        assert b[e:] == b"\xee" * (n + 1 - e)  # nothing written past the data
        assert crc == fx.crc32c(data[o : o + e])


def test_bad_descriptors_do_not_spoil_the_batch(make_engine, payload, tmp_path, fds):
    path = write_file(tmp_path / "good.bin", payload[: 200 * KiB])
    good = fds(path)
    eng = make_engine(queue_depth=4, split_bytes=64 * KiB)
    # A closed descriptor number that nothing reuses during the test: the
    # kernel hands out the lowest free number, so use one far above those.
    # (A low one would be taken by submit()'s eventfd or a new ring.)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    closed = os.dup2(good, min(soft, 4096) - 1)
    os.close(closed)
    huge = 1_000_000  # above any RLIMIT_NOFILE here
    b1, b2, b3, b4 = (bytearray(200 * KiB) for _ in range(4))
    ops = [
        (closed, 0, 100, addr_of(b1)),
        (good, 0, 200 * KiB, addr_of(b2)),
        (huge, 0, 300 * KiB, addr_of(b3)),
        (good, 4096, 100 * KiB, addr_of(b4)),
    ]
    res = eng.read(ops)
    assert res == [-errno.EBADF, 200 * KiB, -errno.EBADF, 100 * KiB]
    assert b2 == payload[: 200 * KiB]
    assert b4[: 100 * KiB] == payload[4096 : 4096 + 100 * KiB]
    assert b1 == bytearray(200 * KiB) and b3 == bytearray(200 * KiB)
    # the same through crc=True and submit()
    res = eng.read(ops, crc=True)
    assert res[0][0] == -errno.EBADF and res[2][0] == -errno.EBADF
    assert res[1] == (200 * KiB, fx.crc32c(payload[: 200 * KiB]))
    assert eng.submit(ops).wait() == [-errno.EBADF, 200 * KiB, -errno.EBADF, 100 * KiB]
    # writes to a bad fd
    wres = eng.write([(huge, 0, 10, addr_of(b1)), (closed, 0, 10, addr_of(b1))])
    assert wres == [-errno.EBADF, -errno.EBADF]


def test_wrong_access_mode_and_directory(make_engine, tmp_path, fds):
    path = write_file(tmp_path / "wo.bin", b"z" * 8192)
    wo = fds(path, os.O_WRONLY)
    ro = fds(path, os.O_RDONLY)
    dfd = fds(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    eng = make_engine(queue_depth=2, split_bytes=4096)
    buf = bytearray(8192)
    res = eng.read([(wo, 0, 8192, addr_of(buf)), (ro, 0, 8192, addr_of(buf))])
    assert res[0] < 0 and res[0] == -errno.EBADF
    assert res[1] == 8192 and buf == b"z" * 8192
    # a directory is no file to read: some negative errno (EISDIR, ESPIPE...)
    (res,) = eng.read([(dfd, 0, 10, addr_of(buf))])
    assert res < 0 and -res in errno.errorcode
    # writing a read-only fd fails; the file is untouched
    src = bytearray(b"q" * 100)
    assert eng.write([(ro, 0, 100, addr_of(src))]) == [-errno.EBADF]
    assert read_file(path) == b"z" * 8192


# ------------------------------------------------------------ 4. O_DIRECT


@pytest.mark.parametrize("split", [4096, 65536])
@pytest.mark.parametrize(
    "boff,foff,length",
    [
        (0, 0, 64 * KiB),  # all aligned: no bounce
        (1, 0, 64 * KiB),  # odd buffer
        (0, 1234, 64 * KiB),  # unaligned offset
        (0, 0, 3 * 4096 + 777),  # unaligned length (tail bounced)
        (3, 4095, 200_001),  # everything unaligned, several pieces
        (5, 10, 1),  # one byte
        (0, 4000, 200),  # crosses a block boundary inside one block pair
    ],
)
def test_odirect_reads_unaligned(make_engine, direct_ok, payload, boff, foff, length, split, fds):
    path = write_file(direct_ok / "d.bin", payload[: 512 * KiB])
    fd = fds(path, os.O_RDONLY | os.O_DIRECT)
    eng = make_engine(queue_depth=4, split_bytes=split)
    ba = bytearray(length + boff + 16)
    res = eng.read([(fd, foff, length, addr_of(ba, boff))], crc=True)
    want = payload[foff : foff + length]
    assert res == [(length, fx.crc32c(want))]
    assert ba[boff : boff + length] == want
    assert ba[:boff] == bytes(boff) and ba[boff + length :] == bytes(16)


def test_odirect_read_eof(make_engine, direct_ok, payload, fds):
    data = payload[:10_000]  # not a block multiple
    fd = fds(write_file(direct_ok / "e.bin", data), os.O_RDONLY | os.O_DIRECT)
    eng = make_engine(queue_depth=4, split_bytes=4096)
    hb = fx.HostBuffer(64 * KiB)
    ba = bytearray(20_000)
    cases = [  # (address, offset, length, expected)
        (hb.address, 0, 16_384, 10_000),  # aligned, short at EOF
        (hb.address + 16_384, 8192, 8192, 1808),  # aligned piece past EOF
        (addr_of(ba, 1), 5000, 8192, 5000),  # bounced, short
        (addr_of(ba, 10_001), 9_999, 50, 1),
        (hb.address + 32 * KiB, 12_288, 4096, 0),  # aligned, beyond EOF
        (addr_of(ba, 15_000), 10_001, 10, 0),  # bounced, beyond EOF
    ]
    res = eng.read([(fd, o, n, a) for a, o, n, _ in cases], crc=True)
    assert res == [(e, fx.crc32c(data[o : o + e])) for _, o, _, e in cases]
    mv = memoryview(hb)
    assert mv[:10_000] == data
    assert mv[16_384 : 16_384 + 1808] == data[8192:]
    assert ba[1:5001] == data[5000:]
    assert ba[10_001] == data[9_999]


def test_odirect_many_ops_mixed(make_engine, direct_ok, payload, fds):
    """O_DIRECT and buffered fds in one batch, random alignments."""
    rng = random.Random(11)
    data = payload[: 1 * MiB]
    path = write_file(direct_ok / "m.bin", data)
    dfd = fds(path, os.O_RDONLY | os.O_DIRECT)
    bfd = fds(path)
    eng = make_engine(queue_depth=8, split_bytes=8192)
    dst = bytearray(64 * 40_000)
    ops, spans = [], []
    for i in range(64):
        n = rng.choice([1, 100, 4096, 8192, 9000, 39_999])
        o = rng.choice([0, 4096, rng.randrange(0, len(data) - n)])
        b = i * 40_000 + rng.randrange(0, 2)
        ops.append((dfd if i % 3 else bfd, o, n, addr_of(dst, b)))
        spans.append((o, n, b))
    res = eng.read(ops)
    assert res == [n for _, n, _ in spans]
    for o, n, b in spans:
        assert dst[b : b + n] == data[o : o + n]


def test_odirect_writes(make_engine, direct_ok, payload, fds):
    eng = make_engine(queue_depth=4, split_bytes=8192)
    data = payload[: 64 * KiB + 100]

    # aligned offset and length, odd buffer: bounced but exact
    p1 = direct_ok / "w1.bin"
    fd1 = fds(p1, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    src = bytearray(64 * KiB + 1)
    src[1:] = data[: 64 * KiB]
    assert eng.write([(fd1, 0, 64 * KiB, addr_of(src, 1))], crc=True) == [(64 * KiB, fx.crc32c(data[: 64 * KiB]))]
    assert read_file(p1) == data[: 64 * KiB]

    # aligned buffer, unaligned length: the tail is padded with zeros to 4 KiB
    p2 = direct_ok / "w2.bin"
    fd2 = fds(p2, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    hb = fx.HostBuffer(len(data))
    memoryview(hb)[:] = data
    assert eng.write([(fd2, 0, len(data), hb.address)]) == [len(data)]
    got = read_file(p2)
    assert len(got) == round_up(len(data))
    assert got[: len(data)] == data and got[len(data) :] == bytes(len(got) - len(data))

    # small unaligned length on its own
    p3 = direct_ok / "w3.bin"
    fd3 = fds(p3, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    assert eng.write([(fd3, 8192, 100, hb.address)]) == [100]
    got = read_file(p3)
    assert len(got) == 8192 + 4096
    assert got[8192 : 8192 + 100] == data[:100] and got[8292:] == bytes(4096 - 100)

    # an unaligned offset fails with EINVAL; the other ops of the batch work
    p4 = direct_ok / "w4.bin"
    fd4 = fds(p4, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    res = eng.write([(fd4, 0, 8192, hb.address), (fd4, 8192 + 7, 4096, hb.address), (fd4, 16_384, 4096, hb.address)])
    assert res == [8192, -errno.EINVAL, 4096]
    got = read_file(p4)
    assert got[:8192] == data[:8192] and got[16_384:20_480] == data[:4096]

    # read back through O_DIRECT into an odd buffer
    back = bytearray(len(data) + 3)
    r = eng.read([(fd3, 8192, 100, addr_of(back, 3)), (fd3, 8100, 200, addr_of(back, 200))])
    assert r == [100, 200]
    assert back[3:103] == data[:100]
    assert back[200:400] == bytes(92) + data[:100] + bytes(8)


@pytest.mark.parametrize("qd,split", [(1, 4096), (8, 65536), (64, 1 << 20)])
def test_odirect_round_trip_aligned(make_engine, direct_ok, payload, qd, split, fds):
    size = 2 * MiB
    eng = make_engine(queue_depth=qd, split_bytes=split)
    path = direct_ok / "rt.bin"
    fd = fds(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    src = fx.HostBuffer(size)
    memoryview(src)[:] = payload[:size]
    assert eng.write([(fd, 0, MiB, src.address), (fd, MiB, MiB, src.address + MiB)]) == [MiB, MiB]
    dst = fx.HostBuffer(size)
    assert eng.read([(fd, 0, size, dst.address)], crc=True) == [(size, fx.crc32c(payload[:size]))]
    assert memoryview(dst) == payload[:size]


# ------------------------------------------------------- 5. engine options


def test_thread_engine_forced():
    e = fx.Engine(io_engine="threads", queue_depth=4)
    try:
        assert e.kind == "threads"
        assert e.fallback_reason is None
        assert e.threads == 4  # min(queue_depth, 16) by default
        assert e.registered is False and e.closed is False
    finally:
        e.close()
    e = fx.Engine(io_engine="threads", queue_depth=64, threads=3)
    try:
        assert e.threads == 3 and e.queue_depth == 64
    finally:
        e.close()
    e = fx.Engine(io_engine="threads", queue_depth=256)
    try:
        assert e.threads == 16
    finally:
        e.close()


def test_auto_engine():
    e = fx.Engine()
    try:
        assert e.queue_depth == 32 and e.split_bytes == 1 << 20
        if URING_OK:
            assert e.kind == "io_uring" and e.fallback_reason is None and e.threads == 0
        else:
            assert e.kind == "threads"
            assert isinstance(e.fallback_reason, str) and e.fallback_reason
    finally:
        e.close()


def test_io_uring_unavailable_raises():
    if URING_OK:
        e = fx.Engine(io_engine="io_uring")
        assert e.kind == "io_uring" and e.fallback_reason is None
        e.close()
    else:
        with pytest.raises(OSError, match="io_uring"):
            fx.Engine(io_engine="io_uring")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"io_engine": "bogus"}, "io_engine"),
        ({"io_engine": ""}, "io_engine"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"queue_depth": -5}, "queue_depth"),
        ({"queue_depth": 32769}, "queue_depth"),
        ({"split_bytes": 1000}, "split_bytes"),
        ({"split_bytes": 0}, "split_bytes"),
        ({"split_bytes": 4097}, "split_bytes"),
        ({"split_bytes": (1 << 30) + 4096}, "split_bytes"),
        ({"threads": -1}, "threads"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fx.Engine(**kwargs)


def test_bogus_engine_names_the_value():
    with pytest.raises(ValueError, match="io_engine.*bogus"):
        fx.Engine(io_engine="bogus")


def test_engine_init_twice_refused(make_engine):
    eng = make_engine()
    with pytest.raises(RuntimeError):
        eng.__init__()


def test_single_worker_many_ops(make_engine, kind, payload, tmp_path, fds):
    if kind != "threads":
        pytest.skip("threads= only applies to the thread engine")
    eng = make_engine(queue_depth=64, threads=1, split_bytes=4096)
    assert eng.threads == 1
    fd = fds(write_file(tmp_path / "s.bin", payload[:MiB]))
    dst = bytearray(MiB)
    assert eng.read([(fd, i * 64 * KiB, 64 * KiB, addr_of(dst, i * 64 * KiB)) for i in range(16)]) == [64 * KiB] * 16
    assert dst == payload[:MiB]


# ----------------------------------------------------------- 6. concurrency


def test_concurrent_batches_from_threads(make_engine, payload, tmp_path):
    eng = make_engine(queue_depth=8, split_bytes=64 * KiB)
    data = payload[: 2 * MiB]
    shared = write_file(tmp_path / "shared.bin", data)
    errors, done = [], []

    def work(tid):
        rng = random.Random(tid)
        rfd = open_fd(shared)
        own = tmp_path / f"own{tid}.bin"
        wfd = open_fd(own, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            for it in range(20):
                if it % 4 == 3:  # a write-then-read batch on this thread's file
                    blob = rng.randbytes(rng.randrange(1, 300 * KiB))
                    src = bytearray(blob)
                    if eng.write([(wfd, 0, len(blob), addr_of(src))]) != [len(blob)]:
                        errors.append((tid, it, "write"))
                    back = bytearray(len(blob))
                    if eng.read([(wfd, 0, len(blob), addr_of(back))]) != [len(blob)] or back != blob:
                        errors.append((tid, it, "write/read"))
                    continue
                spans = []
                for _ in range(8):
                    n = rng.randrange(0, 256 * KiB)
                    spans.append((rng.randrange(0, len(data) - n), n))
                bufs = [bytearray(n + 1) for _, n in spans]
                res = eng.read([(rfd, o, n, addr_of(b)) for (o, n), b in zip(spans, bufs)], crc=True)
                for (o, n), b, r in zip(spans, bufs, res):
                    if r != (n, fx.crc32c(data[o : o + n])) or b[:n] != data[o : o + n] or b[n]:
                        errors.append((tid, it, o, n, r))
            done.append(tid)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append((tid, repr(exc)))
        finally:
            os.close(rfd)
            os.close(wfd)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert sorted(done) == [0, 1, 2, 3]


@pytest.mark.parametrize("nthreads", [4, 16])
def test_concurrent_chunk_batches_complete_bit_exact(make_engine, payload, tmp_path, nthreads):
    """More batches in flight than the engine-wide queue depth (the slot-sharing
    and waiting paths of the io_uring engine): each thread reads one
    many-piece chunk as one op, over and over, some as submitted Batches;
    every read completes whole and bit-exact."""
    eng = make_engine(queue_depth=8, split_bytes=16 * KiB)
    size = MiB + 12 * KiB
    files = []
    for t in range(nthreads):
        data = payload[t * 4096 : t * 4096 + size]
        files.append((write_file(tmp_path / f"chunk{t}.bin", data), data))
    errors, done = [], []
    start = threading.Barrier(nthreads)

    def work(tid):
        path, data = files[tid]
        fd = open_fd(path)
        try:
            start.wait()
            for it in range(8):
                buf = bytearray(size + 1)
                op = [(fd, 0, size, addr_of(buf))]
                if it % 3 == 2:
                    res = eng.submit(op, crc=True).wait()
                else:
                    res = eng.read(op, crc=True)
                if res != [(size, fx.crc32c(data))] or buf[:size] != data or buf[size]:
                    errors.append((tid, it, res))
            done.append(tid)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append((tid, repr(exc)))
        finally:
            os.close(fd)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert sorted(done) == list(range(nthreads))


def _probe_partial(mv, step, stop):
    """Counts loop turns, and turns that saw the buffer partly filled.

    Each turn snapshots every step-th byte in one C call (bytes() of a strided
    memoryview), so no other Python thread can run in the middle of it.
    """
    turns = partial = 0
    while not stop.is_set():
        turns += 1
        snap = bytes(mv[::step])
        if 0 < snap.count(0) < len(snap):
            partial += 1
    return turns, partial


def test_read_releases_the_gil(make_engine, tmp_path, fds):
    """While read() runs, a pure-Python thread keeps running.

    The file's bytes are all non-zero and the destination starts zeroed; with
    queue_depth=1 and 4 KiB pieces the destination fills front to back. A
    Python loop in the main thread samples it: seeing it partly filled is
    only possible if the reading thread let go of the GIL inside read(). The
    control does the same with a GIL-holding copy, which must never be seen
    half done.
    """
    size = 16 * MiB
    data = random.Random(9).randbytes(size).replace(b"\0", b"\1")
    fd = fds(write_file(tmp_path / "gil.bin", data))
    eng = make_engine(queue_depth=1, split_bytes=4096)
    dst = fx.HostBuffer(size, hugepages=False)
    mv = memoryview(dst)
    zeros = bytes(size)

    def run(fill):
        stop = threading.Event()
        results = []

        def reader():
            try:
                for _ in range(10):
                    mv[:] = zeros  # memcpy with the GIL held
                    results.append(fill())
            finally:
                stop.set()

        t = threading.Thread(target=reader)
        t.start()
        turns, partial = _probe_partial(mv, 256 * KiB, stop)
        t.join()
        return turns, partial, results

    # control: a copy that holds the GIL is never seen half done
    def gil_copy():
        mv[:] = data
        return size

    turns, partial, results = run(gil_copy)
    assert results == [size] * 10
    assert turns > 0
    assert partial == 0

    turns, partial, results = run(lambda: eng.read([(fd, 0, size, dst.address)])[0])
    assert results == [size] * 10
    assert mv == data
    assert partial >= 100, f"Python thread made {partial} of {turns} turns during reads"


def test_many_submits_in_flight(make_engine, payload, tmp_path, fds):
    eng = make_engine(queue_depth=4, split_bytes=16 * KiB)
    data = payload[:MiB]
    fd = fds(write_file(tmp_path / "sub.bin", data))
    bufs = [bytearray(64 * KiB) for _ in range(16)]
    batches = [eng.submit([(fd, i * 64 * KiB, 64 * KiB, addr_of(b))], crc=True) for i, b in enumerate(bufs)]
    for i, (b, batch) in enumerate(zip(bufs, batches)):
        chunk = data[i * 64 * KiB : (i + 1) * 64 * KiB]
        assert batch.wait() == [(64 * KiB, fx.crc32c(chunk))]
        assert b == chunk


# ------------------------------------------------------------- 7. submit()


def test_submit_eventfd_and_wait(make_engine, payload, tmp_path, fds):
    eng = make_engine(queue_depth=4, split_bytes=64 * KiB)
    data = payload[: 2 * MiB]
    fd = fds(write_file(tmp_path / "s.bin", data))
    dst = fx.HostBuffer(2 * MiB)
    batch = eng.submit([(fd, 0, MiB, dst.address), (fd, MiB, MiB, dst.address + MiB)], crc=True)
    efd = batch.fileno()
    assert isinstance(efd, int) and efd >= 0
    r, _, _ = select.select([efd], [], [], 30)
    assert r == [efd]
    assert batch.done() is True
    assert struct.unpack("Q", os.read(efd, 8))[0] == 1
    expect = [(MiB, fx.crc32c(data[:MiB])), (MiB, fx.crc32c(data[MiB:]))]
    assert batch.wait() == expect
    assert batch.wait() == expect  # idempotent
    assert memoryview(dst) == data

    # poll() works as well, and wait() without waiting for readiness first
    dst2 = bytearray(MiB)
    b2 = eng.submit([(fd, 0, MiB, addr_of(dst2))])
    p = select.poll()
    p.register(b2.fileno(), select.POLLIN)
    assert p.poll(30_000)
    assert b2.wait() == [MiB] and dst2 == data[:MiB]
    b3 = eng.submit([(fd, MiB, MiB, addr_of(dst2))])
    assert b3.wait() == [MiB] and b3.done() and dst2 == data[MiB:]


def test_submit_write(make_engine, payload, tmp_path, fds):
    eng = make_engine(queue_depth=4, split_bytes=64 * KiB)
    path = tmp_path / "sw.bin"
    fd = fds(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    src = bytearray(payload[:300_000])
    batch = eng.submit([(fd, 0, len(src), addr_of(src))], write=True, crc=True)
    assert batch.wait() == [(len(src), fx.crc32c(src))]
    assert read_file(path) == src


def test_submit_asyncio(make_engine, payload, tmp_path, fds):
    eng = make_engine(queue_depth=4, split_bytes=32 * KiB)
    data = payload[: 2 * MiB]
    fd = fds(write_file(tmp_path / "a.bin", data))
    n = 8
    part = len(data) // n
    bufs = [bytearray(part) for _ in range(n)]

    async def one(i):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        batch = eng.submit([(fd, i * part, part, addr_of(bufs[i]))], crc=True)
        efd = batch.fileno()
        loop.add_reader(efd, lambda: fut.done() or fut.set_result(None))
        try:
            await asyncio.wait_for(fut, 30)
        finally:
            loop.remove_reader(efd)
        assert batch.done()
        return batch.wait()

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))

    results = asyncio.run(main())
    for i, res in enumerate(results):
        chunk = data[i * part : (i + 1) * part]
        assert res == [(part, fx.crc32c(chunk))]
        assert bufs[i] == chunk


def test_batches_signal_a_shared_notifier(make_engine, payload, tmp_path, fds):
    """Batches submitted with notify= signal the Notifier's one eventfd (none
    of their own), which stays open while a batch holds it."""
    eng = make_engine(queue_depth=4, split_bytes=64 * KiB)
    data = payload[: 2 * MiB]
    fd = fds(write_file(tmp_path / "n.bin", data))
    dst = fx.HostBuffer(2 * MiB)
    notifier = fx.Notifier()
    efd = notifier.fileno()
    assert notifier.drain() == 0  # nothing signalled yet, and it does not block
    batches = [eng.submit([(fd, i * MiB, MiB, dst.address + i * MiB)], crc=True, notify=notifier) for i in range(2)]
    assert all(b.fileno() == efd for b in batches)
    for batch in batches:
        batch.wait()
    r, _, _ = select.select([efd], [], [], 30)
    assert r == [efd] and notifier.drain() == 2 and notifier.drain() == 0
    assert [b.wait() for b in batches] == [[(MiB, fx.crc32c(data[:MiB]))], [(MiB, fx.crc32c(data[MiB:]))]]
    # the batch keeps the eventfd open after the last other reference goes
    b3 = eng.submit_chunks([], fx.HostBuffer(4096).address, notify=notifier)
    del notifier
    assert b3.wait() == [] and os.readlink(f"/proc/self/fd/{efd}") == "anon_inode:[eventfd]"
    del b3, batches, batch
    try:  # the last holder closed it (the number may have been taken again since, not by an eventfd)
        assert os.readlink(f"/proc/self/fd/{efd}") != "anon_inode:[eventfd]"
    except FileNotFoundError:
        pass
    with pytest.raises(TypeError, match="Notifier"):
        eng.submit([], notify=object())


def test_awaited_reads_share_one_eventfd_per_loop(make_engine, payload, tmp_path, fds):
    """drive_async awaits a C engine's batches through one Notifier per loop,
    registered once; concurrent reads each get their own results."""
    from lmcache_fx.core import drive

    eng = make_engine(queue_depth=4, split_bytes=32 * KiB)
    data = payload[: 2 * MiB]
    fd = fds(write_file(tmp_path / "w.bin", data))
    n, part = 8, (2 * MiB) // 8
    bufs = [bytearray(part) for _ in range(n)]

    def steps(i):
        res = yield ([(fd, i * part, part, addr_of(bufs[i]))], True)
        return res, []

    async def main():
        loop = asyncio.get_running_loop()
        out = await asyncio.gather(*(drive.drive_async(eng, steps(i), None) for i in range(n)))
        waiter = drive._waiters[loop]
        registered = loop._selector.get_key(waiter.notifier.fileno()).fd  # type: ignore[attr-defined]
        return out, waiter, registered

    results, waiter, registered = asyncio.run(main())
    assert registered == waiter.notifier.fileno() and waiter._pending == {}
    for i, res in enumerate(results):
        assert res == [(part, fx.crc32c(data[i * part : (i + 1) * part]))]
        assert bufs[i] == data[i * part : (i + 1) * part]


def test_a_loops_shared_eventfd_goes_with_the_loop(make_engine):
    """The per-loop waiter holds no reference to its loop: once a loop is
    closed and dropped, its eventfd is closed too (no descriptor per
    asyncio.run left behind)."""
    import gc

    from lmcache_fx.core import drive

    eng = make_engine()

    def steps():
        res = yield ([], False)
        return res, []

    async def one():
        return await drive.drive_async(eng, steps(), None), len(drive._waiters)

    assert asyncio.run(one()) == ([], 1)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        assert asyncio.run(one())[0] == []
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before and len(drive._waiters) == 0


def test_batches_run_on_runners_kept_between_batches(make_engine, payload, tmp_path, fds):
    """Submitted batches run on runner threads that wait for the next batch
    instead of exiting: one after another they take one runner (the one that
    ran the last is listed idle before its batch's wait() returns), so no
    thread is started per batch. (Batches in flight together each get a
    runner of their own: the concurrency tests below run through them.)"""
    eng = make_engine(queue_depth=4, split_bytes=64 * KiB)
    data = payload[:MiB]
    fd = fds(write_file(tmp_path / "r.bin", data))
    dst = fx.HostBuffer(MiB)
    eng.submit([(fd, 0, MiB, dst.address)]).wait()
    started = fx._runners_started()
    assert started >= 1 and fx._runners_idle() >= 1
    for _ in range(200):
        res = eng.submit([(fd, 0, 64 * KiB, dst.address)], crc=True).wait()
        assert res == [(64 * KiB, fx.crc32c(data[: 64 * KiB]))]
    assert fx._runners_started() == started  # not one thread more
    assert fx._runners_idle() >= 1


def test_max_running_bounds_batches_and_runs_the_rest_in_arrival_order(make_engine, payload, tmp_path, fds):
    """With max_running=1, batches submitted together run one at a time on
    one runner, oldest first: no second runner thread starts, and when the
    last one submitted is done every earlier one is done too (each is
    signalled as it ends, with its own results). close() waits for the
    batches still waiting, which finish with their data."""
    eng = make_engine(queue_depth=4, max_running=1)
    assert eng.max_running == 1 and make_engine().max_running == 0
    data = payload[: 2 * MiB]
    fd = fds(write_file(tmp_path / "q.bin", data))
    dst = fx.HostBuffer(2 * MiB)
    piece = 64 * KiB
    eng.submit([(fd, 0, piece, dst.address)]).wait()  # a runner at this nice, idle
    started = fx._runners_started()
    batches = [eng.submit([(fd, i * piece, piece, dst.address + i * piece)], crc=True) for i in range(32)]
    running, waiting = eng.batches_now
    assert running <= 1 and running + waiting <= 32
    assert batches[-1].wait() == [(piece, fx.crc32c(data[31 * piece : 32 * piece]))]
    assert all(b.done() for b in batches)
    assert eng.batches_now == (0, 0)
    assert fx._runners_started() - started <= 1
    for i, b in enumerate(batches):
        assert b.wait() == [(piece, fx.crc32c(data[i * piece : (i + 1) * piece]))]
    assert bytes(dst) == data

    later = [eng.submit([(fd, i * piece, piece, dst.address + i * piece)]) for i in range(16)]
    eng.close()  # returns once every waiting batch has run
    assert all(b.done() for b in later)
    assert [b.wait() for b in later] == [[piece]] * 16
    for bad in (-1, 1025):
        with pytest.raises(ValueError, match="max_running must be in 0..1024"):
            fx.Engine(max_running=bad)


def test_a_batch_cancelled_while_waiting_for_a_runner_ends_unread(make_engine, payload, tmp_path, fds):
    """cancel() takes a batch still waiting for a runner (max_running
    reached) off the list: it is done at once and wait() raises ECANCELED;
    a batch that has started stops where it is (cancel() False): its op is
    read whole if all of it was in flight, else it ends ECANCELED. Batches
    start oldest first, so the cancelled ones are the newest. A plain
    engine's batch (no bound) is never waiting: False."""
    eng = make_engine(queue_depth=4, max_running=1)
    data = payload[: 2 * MiB]
    fd = fds(write_file(tmp_path / "c.bin", data))
    dsts = [fx.HostBuffer(2 * MiB) for _ in range(64)]
    batches = [eng.submit([(fd, 0, 2 * MiB, d.address)], crc=True) for d in dsts]
    running, waiting = eng.batches_now
    cancelled = [b.cancel() for b in reversed(batches)][::-1]
    first = cancelled.index(True)  # the premise: 64 checked 2 MiB reads outlast their submission
    assert cancelled == [False] * first + [True] * (64 - first)
    assert running == 1 and waiting >= 64 - first  # counted before the cancels; batches only left the list since
    assert eng.batches_now[1] == 0  # the cancelled ones are off the list
    for b, d, c in zip(batches, dsts, cancelled):
        if c:
            assert b.done() and not b.cancel()
            with pytest.raises(OSError) as e:
                b.wait()
            assert e.value.errno == errno.ECANCELED and bytes(d) == bytes(2 * MiB)
        else:
            got = b.wait()
            assert got == [(2 * MiB, fx.crc32c(data))] and bytes(d) == data or got[0][0] == -errno.ECANCELED, got
    plain = make_engine(queue_depth=4)
    b = plain.submit([(fd, 0, 4096, dsts[0].address)])
    assert b.cancel() is False and b.wait() in ([4096], [-errno.ECANCELED])


def thread_nices(name: str) -> dict[int, int]:
    """thread id -> nice value of this process's threads called `name`."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # a thread that just exited
            continue
        if stat[stat.index("(") + 1 : stat.rindex(")")] == name:
            out[int(tid)] = int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19, nice
    return out


def runner_nices() -> list[int]:
    """The nice value of each of this process's runner threads (named fx-runner)."""
    return list(thread_nices("fx-runner").values())


def test_runners_run_runner_nice_steps_below_the_submitter(make_engine, payload, tmp_path, fds):
    """A submitted batch runs on a runner `runner_nice` priority steps below
    the thread that submitted it, counted from that thread's own priority;
    idle runners are reused only by batches that want the same steps (a
    thread cannot raise its priority back), so runner_nice=0 keeps the
    submitter's priority."""
    data = payload[:MiB]
    fd = fds(write_file(tmp_path / "n.bin", data))
    dst = fx.HostBuffer(MiB)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert base <= 5, "the test needs a process nice of at most 5"
    low = make_engine(queue_depth=4, runner_nice=7)
    plain = make_engine(queue_depth=4)
    assert (low.runner_nice, plain.runner_nice) == (7, 0)
    assert low.submit([(fd, 0, MiB, dst.address)], crc=True).wait() == [(MiB, fx.crc32c(data))]
    assert base + 7 in runner_nices()
    started = fx._runners_started()
    for _ in range(20):  # one after another: the same nice-7 runner, no thread more
        assert low.submit([(fd, 0, 4096, dst.address)]).wait() == [4096]
    assert fx._runners_started() == started
    # a plain engine's batch does not take the nice-7 runner
    assert plain.submit([(fd, 0, MiB, dst.address)]).wait() == [MiB]
    assert base in runner_nices()

    # counted from the submitter: a thread at nice base+3 gets runners at base+10
    seen = []

    def submit_at_3():
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), base + 3)
        seen.append(low.submit([(fd, 0, MiB, dst.address)]).wait())

    t = threading.Thread(target=submit_at_3)
    t.start()
    t.join()
    assert seen == [[MiB]] and base + 10 in runner_nices()
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="runner_nice must be in 0..19"):
            fx.Engine(runner_nice=bad)


def test_openers_run_at_the_engine_creators_priority():
    """With runner_nice, an io_uring engine starts its openers' threads
    (opens, memory reads, spread checksums: shared by blocking and awaited
    reads) when it is made, at its creator's priority, so that an awaited
    read needing them first does not leave them at a runner's lower one."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(thread_nices("fx-io"))
    eng = fx.Engine(io_engine="io_uring", queue_depth=8, runner_nice=7)
    try:
        deadline = time.monotonic() + 5
        while True:  # a new thread names itself as it starts
            new = {t: n for t, n in thread_nices("fx-io").items() if t not in before}
            if len(new) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert len(new) >= 2 and set(new.values()) == {base}, new
    finally:
        eng.close()


def test_batch_cannot_be_built_directly():
    with pytest.raises(TypeError):
        fx.Batch()


def test_dropped_batch_then_close(make_engine, payload, tmp_path, fds):
    """A batch dropped without wait() is joined by its destructor; close() then returns."""
    eng = make_engine()
    fd = fds(write_file(tmp_path / "d.bin", payload[:MiB]))
    dst = bytearray(MiB)
    batch = eng.submit([(fd, 0, MiB, addr_of(dst))])
    del batch
    eng.close()
    assert eng.closed and dst == payload[:MiB]


def run_child(body, *args, watchdog=2.0):
    """Runs body (Python source) in a child interpreter, in a thread that a
    watchdog abandons after `watchdog` seconds (the child then prints HUNG).
    Returns (returncode, stdout, stderr)."""
    script = textwrap.dedent(
        """
        import os, sys, threading, ctypes, select
        from lmcache_fx import _fxio as fx
        def addr(b):
            return ctypes.addressof(ctypes.c_char.from_buffer(b))
        def body():
        %s
        t = threading.Thread(target=body, daemon=True)
        t.start()
        t.join(%r)
        if t.is_alive():
            print("HUNG", flush=True)
            os._exit(3)
        """
    ) % (textwrap.indent(textwrap.dedent(body), "    "), watchdog)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fx.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=watchdog + 60,
    )
    return out.returncode, out.stdout, out.stderr


def test_run_child_sees_results(kind, tmp_path):
    """The harness the xfail tests below rely on works when nothing hangs."""
    rc, out, err = run_child(
        """
        eng = fx.Engine(io_engine=sys.argv[1])
        with open(sys.argv[2], "wb") as f:
            f.write(b"x" * 8192)
        fd = os.open(sys.argv[2], os.O_RDONLY)
        buf = bytearray(8192)
        batch = eng.submit([(fd, 0, 8192, addr(buf))])
        print("result", batch.wait(), flush=True)
        eng.close()
        print("closed", flush=True)
        """,
        kind,
        tmp_path / "h.bin",
    )
    assert rc == 0, err
    assert "result [8192]" in out and "closed" in out and "HUNG" not in out


def test_close_after_unwaited_finished_batch(kind, tmp_path):
    """Regression: close() used to block forever on a finished batch that was
    never wait()ed (its end_use ran only in batch_join)."""
    rc, out, err = run_child(
        """
        eng = fx.Engine(io_engine=sys.argv[1])
        with open(sys.argv[2], "wb") as f:
            f.write(b"x" * 8192)
        fd = os.open(sys.argv[2], os.O_RDONLY)
        buf = bytearray(8192)
        batch = eng.submit([(fd, 0, 8192, addr(buf))])
        select.select([batch.fileno()], [], [], 10)
        assert batch.done()
        eng.close()  # the batch has finished, it was only not waited on
        print("closed", batch.wait(), flush=True)
        # close() while a batch is still running waits for it to finish
        eng = fx.Engine(io_engine=sys.argv[1], queue_depth=1, split_bytes=4096)
        size = 8 << 20
        with open(sys.argv[2], "wb") as f:
            f.write(b"y" * size)
        fd = os.open(sys.argv[2], os.O_RDONLY)
        buf = bytearray(size)
        batch = eng.submit([(fd, 0, size, addr(buf))])
        eng.close()
        res = batch.wait()
        print("running-close", eng.closed, res, batch.done(), buf == b"y" * size, flush=True)
        """,
        kind,
        tmp_path / "c.bin",
    )
    assert "HUNG" not in out, "Engine.close() hung on a finished, un-waited batch"
    assert rc == 0, err
    assert "closed [8192]" in out
    assert f"running-close True [{8 << 20}] True True" in out


def test_pipe_fd_fails_instead_of_blocking(kind):
    """Regression: a read of an empty pipe gave -ESPIPE on the thread engine
    but blocked forever on io_uring."""
    rc, out, err = run_child(
        """
        eng = fx.Engine(io_engine=sys.argv[1])
        r, w = os.pipe()  # nothing is ever written
        nr, nw = os.pipe2(os.O_NONBLOCK)
        buf = bytearray(100)
        print("result", eng.read([(r, 0, 100, addr(buf)), (nr, 0, 100, addr(buf))]), flush=True)
        print("written", eng.write([(w, 0, 100, addr(buf))]), flush=True)
        """,
        kind,
    )
    assert "HUNG" not in out, "a read of an empty pipe blocked forever"
    assert rc == 0, err
    res = [int(x) for x in out.split("result [")[1].split("]")[0].split(",")]
    assert len(res) == 2 and all(r < 0 for r in res)
    res = int(out.split("written [")[1].split("]")[0])
    assert res < 0


def test_uninitialised_engine_raises(tmp_path):
    """Regression: an Engine whose __init__ never ran (split_bytes=0, no
    pool) crashed the interpreter with SIGFPE in fx_batch_prepare."""
    rc, out, err = run_child(
        """
        eng = fx.Engine.__new__(fx.Engine)
        with open(sys.argv[1], "wb") as f:
            f.write(b"x" * 100)
        fd = os.open(sys.argv[1], os.O_RDONLY)
        buf = bytearray(100)
        try:
            eng.read([(fd, 0, 100, addr(buf))])
        except (ValueError, RuntimeError, OSError) as exc:
            print("raised", type(exc).__name__, flush=True)
        """,
        tmp_path / "u.bin",
    )
    assert rc == 0, f"child died with {rc}: {err}"
    assert "raised" in out


# -------------------------------------------- 8. close() and register_buffer


def test_close_then_use_raises(make_engine, tmp_path, fds):
    eng = make_engine()
    fd = fds(write_file(tmp_path / "c.bin", b"abc"))
    buf = bytearray(3)
    assert eng.read([(fd, 0, 3, addr_of(buf))]) == [3]
    eng.close()
    assert eng.closed is True
    with pytest.raises(ValueError, match="closed"):
        eng.read([(fd, 0, 3, addr_of(buf))])
    with pytest.raises(ValueError, match="closed"):
        eng.write([(fd, 0, 3, addr_of(buf))])
    with pytest.raises(ValueError, match="closed"):
        eng.submit([(fd, 0, 3, addr_of(buf))])
    with pytest.raises(ValueError, match="closed"):
        eng.register_buffer(addr_of(buf), 3)
    eng.close()  # idempotent
    assert eng.closed is True and eng.registered is False


def test_register_buffer(make_engine, kind, payload, tmp_path, fds):
    eng = make_engine(queue_depth=8, split_bytes=64 * KiB)
    size = 2 * MiB
    data = payload[:size]
    fd = fds(write_file(tmp_path / "r.bin", data))
    hb = fx.HostBuffer(size)
    r = eng.register_buffer(hb.address, size)
    assert r == 0 or r < 0
    if kind == "threads":
        assert r == -errno.ENOSYS
    if r == 0:
        assert eng.registered is True
    else:
        assert eng.registered is False
    mv = memoryview(hb)

    # whole region, sub-ranges at odd addresses, a range running past its end
    assert eng.read([(fd, 0, size, hb.address)], crc=True) == [(size, fx.crc32c(data))]
    assert mv == data
    mv[:] = bytes(size)
    ops = [
        (fd, 0, 100, hb.address + 1),
        (fd, 4096, 300 * KiB, hb.address + 8192),
        (fd, 12345, 5000, hb.address + 512 * KiB + 7),
    ]
    assert eng.read(ops) == [100, 300 * KiB, 5000]
    assert mv[1:101] == data[:100]
    assert mv[8192 : 8192 + 300 * KiB] == data[4096 : 4096 + 300 * KiB]
    assert mv[512 * KiB + 7 : 512 * KiB + 5007] == data[12345 : 12345 + 5000]
    outside = bytearray(64 * KiB)
    assert eng.read([(fd, 0, 64 * KiB, addr_of(outside))]) == [64 * KiB]
    assert outside == data[: 64 * KiB]

    # writes from the registered region
    wpath = tmp_path / "rw.bin"
    wfd = fds(wpath, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    mv[:] = data
    assert eng.write([(wfd, 0, size, hb.address)]) == [size]
    assert read_file(wpath) == data

    # several threads on the registered region (each takes its own ring)
    errs = []

    def reader(i):
        lo = i * (size // 4)
        for _ in range(5):
            if eng.read([(fd, lo, size // 4, hb.address + lo)]) != [size // 4]:
                errs.append(i)

    ts = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errs == [] and mv == data

    # unregister: (0, 0); reads still correct
    if kind == "io_uring":
        assert eng.register_buffer(0, 0) == 0
        assert eng.registered is False
        mv[:] = bytes(size)
        assert eng.read([(fd, 0, size, hb.address)]) == [size]
        assert mv == data


def test_register_buffer_odirect(make_engine, direct_ok, payload, fds):
    eng = make_engine(queue_depth=4, split_bytes=64 * KiB)
    size = MiB
    data = payload[:size]
    fd = fds(write_file(direct_ok / "rd.bin", data), os.O_RDONLY | os.O_DIRECT)
    hb = fx.HostBuffer(size + ALIGN)
    r = eng.register_buffer(hb.address, size + ALIGN)
    assert r == 0 or r < 0
    mv = memoryview(hb)
    assert eng.read([(fd, 0, size, hb.address)]) == [size]
    assert mv[:size] == data
    assert eng.read([(fd, 100, 5000, hb.address + 3)]) == [5000]  # bounced
    assert mv[3:5003] == data[100:5100]


def test_a_registered_buffer_object_is_held_until_cleared(direct_ok, payload, fds):
    """A HostBuffer registered by its address and freed without clearing:
    the next buffer mapped at that address had its O_DIRECT reads land in
    the old pinned pages (the whole length reported, the new buffer left
    zeros). Registered as the object, the engine holds it (a buffer export)
    until the registration is replaced or cleared or the engine closes, so
    its memory cannot be freed and mapped again under the registration."""
    eng = fx.Engine(io_engine="io_uring", queue_depth=4, split_bytes=256 * KiB)
    try:
        size = MiB
        data = payload[:size]
        fd = fds(write_file(direct_ok / "held.bin", data), os.O_RDONLY | os.O_DIRECT)
        hb = fx.HostBuffer(size, hugepages=False)
        refs = sys.getrefcount(hb)
        if eng.register_buffer(hb) != 0:
            pytest.skip("io_uring buffer registration refused here (RLIMIT_MEMLOCK?)")
        assert eng.registered and sys.getrefcount(hb) == refs + 1  # held by the registration
        addr = hb.address
        del hb
        gc.collect()
        nxt = fx.HostBuffer(size, hugepages=False)
        assert nxt.address != addr  # still mapped: not handed out again
        assert eng.read([(fd, 0, size, nxt.address)]) == [size] and memoryview(nxt) == data
        refs = sys.getrefcount(nxt)
        assert eng.register_buffer(nxt) == 0 and sys.getrefcount(nxt) == refs + 1
        assert eng.register_buffer(0, 0) == 0 and not eng.registered
        assert sys.getrefcount(nxt) == refs  # cleared: released
        with pytest.raises(ValueError, match="beyond the buffer"):
            eng.register_buffer(nxt, size + 1)
        assert sys.getrefcount(nxt) == refs
        assert eng.register_buffer(nxt, size // 2) == 0 and sys.getrefcount(nxt) == refs + 1
        eng.close()
        assert sys.getrefcount(nxt) == refs  # released at close
        with pytest.raises(TypeError, match="length is missing"):
            fx.Engine(io_engine="io_uring").register_buffer(4096)
    finally:
        eng.close()


def test_a_failed_registration_keeps_holding_the_buffer_still_registered():
    """register_buffer(B) that fails before the registration changes (no
    descriptor for the ring it needs) left A registered but let go of A's
    buffer: A could be freed under its registration. A is held on until the
    registration really changes."""
    eng = fx.Engine(io_engine="io_uring", queue_depth=8)
    try:
        a, b = fx.HostBuffer(MiB, hugepages=False), fx.HostBuffer(MiB, hugepages=False)
        if eng.register_buffer(a) != 0:
            pytest.skip("io_uring buffer registration refused here (RLIMIT_MEMLOCK?)")
        refs = sys.getrefcount(a)
        low = os.open("/dev/null", os.O_RDONLY)  # the lowest free descriptor: none left above it
        os.close(low)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        try:
            r = eng.register_buffer(b)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert r < 0 and eng.registered  # still A's pages
        assert sys.getrefcount(a) == refs  # still held for it
        assert eng.register_buffer(0, 0) == 0 and sys.getrefcount(a) == refs - 1
    finally:
        eng.close()


def test_init_again_on_a_closed_engine_is_refused():
    """__init__ on a closed Engine started its threads again under an engine
    every call refuses (freed only by another close)."""
    eng = fx.Engine(io_engine="threads", threads=4)
    eng.close()
    before = len(os.listdir("/proc/self/task"))
    with pytest.raises(RuntimeError, match="closed; make a new one"):
        eng.__init__(io_engine="threads", threads=4)
    assert len(os.listdir("/proc/self/task")) == before and eng.closed


def test_dropping_a_batch_still_waiting_for_a_runner_does_not_run_it(tmp_path, fds):
    """max_running: a submitted batch that waits for a runner, dropped (its
    last reference gone), was run anyway into memory its owner let go, and
    the drop blocked until every batch ahead of it had run. It is taken off
    the queue at once; the batch ahead and later ones are unaffected."""
    size = 32 * MiB
    data = random.Random(5).randbytes(size)
    fd = fds(write_file(tmp_path / "slow.bin", data))
    eng = fx.Engine(io_engine="io_uring", max_running=1, queue_depth=1, split_bytes=4096)
    try:
        ahead = bytearray(size)  # 8192 pieces one at a time: still running when the next is dropped
        first = eng.submit([(fd, 0, size, addr_of(ahead))])
        dropped_buf = bytearray(4096)
        dropped = eng.submit([(fd, 0, 4096, addr_of(dropped_buf))])
        assert eng.batches_now[1] == 1
        del dropped
        gc.collect()
        assert eng.batches_now[1] == 0  # off the queue
        assert first.wait() == [size] and ahead == data
        assert dropped_buf == bytearray(4096)  # never read into
        later = bytearray(4096)
        assert eng.read([(fd, 0, 4096, addr_of(later))]) == [4096] and later == data[:4096]
    finally:
        eng.close()


# ----------------------------------------------------------- 9. HostBuffer


@pytest.mark.parametrize("size", [1, 4095, 4096, 100_000, 3 * MiB + 1])
def test_host_buffer_basics(size):
    hb = fx.HostBuffer(size, hugepages=False)
    assert hb.address % 4096 == 0
    assert len(hb) == size
    mv = memoryview(hb)
    assert mv.nbytes == size and not mv.readonly
    assert mv[0] == 0 and mv[-1] == 0  # fresh anonymous memory
    blob = random.Random(size).randbytes(size)
    mv[:] = blob
    assert bytes(hb) == blob
    assert fx.crc32c_at(hb.address, size) == fx.crc32c(blob)
    mv.release()


@pytest.mark.parametrize("size", [1, 4096, 2 * MiB, 5 * MiB + 3])
def test_host_buffer_hugepages(size):
    hb = fx.HostBuffer(size, hugepages=True)
    assert hb.address % (2 * MiB) == 0
    assert len(hb) == size
    mv = memoryview(hb)
    assert mv.nbytes == size and mv[0] == 0 and mv[-1] == 0
    mv[0] = 0xA5
    mv[size // 2] = 0x3C
    mv[-1] = 0x5A
    assert mv[-1] == 0x5A and (size == 1 or (mv[0] == 0xA5 and mv[size // 2] == 0x3C))
    assert fx.crc32c_at(hb.address, size) == fx.crc32c(mv)


def test_host_buffer_default_hugepages_for_large():
    big = fx.HostBuffer(4 * MiB)
    assert big.address % (2 * MiB) == 0
    small = fx.HostBuffer(8 * KiB)
    assert small.address % 4096 == 0


def test_host_buffers_are_distinct():
    bufs = [fx.HostBuffer(10_000) for _ in range(8)]
    spans = sorted((b.address, b.address + len(b)) for b in bufs)
    for (_a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    for i, b in enumerate(bufs):
        memoryview(b)[:] = bytes([i]) * 10_000
    for i, b in enumerate(bufs):
        assert bytes(b) == bytes([i]) * 10_000


@pytest.mark.parametrize("size", [0, -1])
def test_host_buffer_bad_size(size):
    with pytest.raises(ValueError):
        fx.HostBuffer(size)


def test_advise_hugepages_keeps_data():
    hb = fx.HostBuffer(6 * MiB, hugepages=False)
    blob = random.Random(1).randbytes(len(hb))
    memoryview(hb)[:] = blob
    r = fx.advise_hugepages(hb.address, len(hb))
    assert r < 0 or (r > 0 and r % (2 * MiB) == 0 and r <= len(hb))
    assert bytes(hb) == blob
    # a region with no whole aligned 2 MiB inside it advises nothing
    assert fx.advise_hugepages(hb.address + 1, 2 * MiB) == 0
    assert fx.advise_hugepages(hb.address, 4096) == 0


def _concurrent_reads(eng, requests, delays):
    """Runs each request (a list of read ops) on its own io_uring thread,
    thread i starting delays[i] s after a common release; returns where each
    ended in the engine's work (its slots returned so far when the request
    returned its last). Not wall-clock ends: on a busy 2-core host a thread
    waiting for a core or the GIL after its read would blur them."""
    ended = [0] * len(requests)
    results = [None] * len(requests)
    go = threading.Barrier(len(requests) + 1)

    def run(i):
        go.wait()
        if delays[i]:
            time.sleep(delays[i])
        results[i] = eng.read(requests[i])
        ended[i] = fx._uring_last_end()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in ts:
        t.start()
    go.wait()
    for t in ts:
        t.join()
    assert results == [[op[2] for op in r] for r in requests]
    return ended


def test_io_uring_serves_a_burst_in_turn_and_a_short_read_first(xfs_store, fds):
    """Concurrent requests on one io_uring engine: beyond the one piece every
    request keeps in flight, free slots go to the request with the least left
    to queue (the earliest among equals). So a burst of equal reads ends one
    after another instead of all together at the end (with equal shares the
    second of 8 to end did so at 0.64-0.71x the last in wall-clock time; now
    after 0.31-0.39x of the burst's work, with three CPU hogs beside it too),
    and a short read arriving behind long ones still ends first. Ends are
    counted in the engine's work (slots returned), not in seconds."""
    if not fx.io_uring_status()[0]:
        pytest.skip(f"io_uring unavailable: {fx.io_uring_status()[1]}")
    tmp_path = pathlib.Path(xfs_store)
    size, n = 16 * MiB, 8
    data = random.Random(11).randbytes(size)
    paths = [write_file(tmp_path / f"b{i}.bin", data) for i in range(n)]
    os.sync()  # else each first O_DIRECT read would first write its file's dirty pages back
    fdl = [fds(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    bufs = [fx.HostBuffer(size) for _ in range(n)]
    reads = [(fd, 0, size, b.address) for fd, b in zip(fdl, bufs)]
    # queue_depth 16 for the burst; 4 for the short read, which still waits for what the
    # device already holds (4 MiB here), not for the long reads
    burst, short = (fx.Engine(io_engine="io_uring", queue_depth=qd, split_bytes=MiB) for qd in (16, 4))
    try:
        for op in reads:  # each alone first: the first O_DIRECT read of a file also drops its cached pages
            assert burst.read([op]) == [size]
        base = fx._uring_last_end()  # this thread's last alone read: the work before the burst
        ends = sorted(e - base for e in _concurrent_reads(burst, [[op] for op in reads], [0] * n))
        # (the first may get a head start, its thread let go before the others)
        assert ends[-1] == n * size // MiB, ends  # one slot per MiB, all returned
        assert ends[1] < 0.55 * ends[-1], ends
        assert all(bytes(memoryview(b)) == data for b in bufs)
        # three long requests (64 MiB: four files each), then a 1 MiB read once they are going
        longs = [fx.HostBuffer(4 * size) for _ in range(3)]
        requests = [[(fdl[j], 0, size, lb.address + j * size) for j in range(4)] for lb in longs]
        requests.append([(fdl[4], 0, MiB, bufs[4].address)])
        ends = _concurrent_reads(short, requests, [0, 0, 0, 0.001])
        assert ends[3] < min(ends[:3]), ends
        assert all(bytes(memoryview(lb)) == data * 4 for lb in longs)
    finally:
        burst.close()
        short.close()


@pytest.mark.parametrize("split_mib,peak", [(4, 2), (1, 8)])
def test_io_uring_read_pieces_take_a_slot_per_mib(xfs_store, fds, split_mib, peak):
    """A read piece holds one engine-wide slot per started MiB, so bigger
    pieces keep the bytes in flight (and a later request's wait behind them)
    at what queue_depth 1 MiB pieces hold: with queue_depth 8, 4 MiB pieces
    go out 2 at a time, 1 MiB pieces 8. Writes count one slot a piece.
    O_DIRECT on XFS: reads from memory run on threads, not on the ring."""
    if not fx.io_uring_status()[0]:
        pytest.skip(f"io_uring unavailable: {fx.io_uring_status()[1]}")
    tmp_path = pathlib.Path(xfs_store)
    eng = fx.Engine(io_engine="io_uring", queue_depth=8, split_bytes=split_mib * MiB)
    try:
        size = 32 * MiB
        data = random.Random(7).randbytes(size)
        fd = fds(write_file(tmp_path / "big.bin", data), os.O_RDONLY | os.O_DIRECT)
        buf = fx.HostBuffer(size)
        fx._uring_peak_inflight()
        assert eng.read([(fd, 0, size, buf.address)], crc=True) == [(size, fx.crc32c(data))]
        assert fx._uring_peak_inflight() == peak
        assert bytes(memoryview(buf)) == data
        wfd = fds(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        assert eng.write([(wfd, 0, size, buf.address)]) == [size]
        assert fx._uring_peak_inflight() == 8
        assert read_file(tmp_path / "out.bin") == data
    finally:
        eng.close()


def test_read_pieces_are_queued_round_robin_over_devices(tmp_path):
    """A read whose files lie on several devices is queued a piece of each
    device in turn, each device's pieces in file order: a chunk file lies on
    one device, so a window of pieces in flight then spans every device a
    striped store put the read's chunks on. A read on one device keeps file
    order; every piece is queued once; _set_piece_order(True) (and
    LMCACHE_FX_PIECE_ORDER=ops at import) keeps file order everywhere. An
    O_DIRECT read so interleaved, through the io_uring engine's rings, is
    exact, each file's CRC32C joined in file order."""
    if not fx.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    shm = pathlib.Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a device of its own beside tmp_path")
    other = pathlib.Path(tempfile.mkdtemp(dir=shm))
    sizes = [3, 1, 2]
    where = [tmp_path, other, tmp_path]  # files 0 and 2 on one device, file 1 on another
    paths, fds = [], []
    try:
        for i, (n, d) in enumerate(zip(sizes, where)):
            p = d / f"f{i}"
            p.write_bytes(os.urandom(n << 20))
            paths.append(p)
            try:
                fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
            except OSError as e:
                pytest.skip(f"O_DIRECT refused on {d}: {e}")
        buf = fx.HostBuffer(8 << 20)
        ops, off = [], 0
        for fd, n in zip(fds, sizes):
            ops.append((fd, 0, n << 20, buf.address + off))
            off += n << 20
        file_order = [(i, k << 20) for i, n in enumerate(sizes) for k in range(n)]
        got = fx._piece_order(ops, 1 << 20)
        # device A: f0's three pieces then f2's two; device B: f1's one; in turn
        assert got == [(0, 0), (1, 0), (0, 1 << 20), (0, 2 << 20), (2, 0), (2, 1 << 20)]
        assert sorted(got) == file_order
        assert fx._piece_order([ops[0], ops[2]], 1 << 20) == [(0, 0), (0, 1 << 20), (0, 2 << 20), (1, 0), (1, 1 << 20)]
        assert fx._set_piece_order(True) is False
        try:
            assert fx._piece_order(ops, 1 << 20) == file_order
        finally:
            assert fx._set_piece_order(False) is True
        eng = fx.Engine("io_uring", 2, 1 << 20)
        try:
            fx._uring_peak_inflight()
            res = eng.read(ops, crc=True)
            assert fx._uring_peak_inflight() > 0  # on the rings, not the threads of memory reads
        finally:
            eng.close()
        data = bytes(memoryview(buf)[:off])
        start = 0
        for p, (n_bytes, crc), n in zip(paths, res, sizes):
            want = p.read_bytes()
            assert n_bytes == n << 20 and data[start : start + (n << 20)] == want
            assert crc == fx.crc32c(want)
            start += n << 20
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(other, ignore_errors=True)


def _sparse(tmp_path, size=64 * MiB):
    """A file of holes: reads of it take time but no disk."""
    p = tmp_path / "sparse.bin"
    with open(p, "wb") as f:
        f.truncate(size)
    return str(p)


def test_every_thread_waiting_on_a_batch_wakes(tmp_path, make_engine, fds):
    """Two threads in wait() on one submitted batch: its end woke only one
    (a condition signal, not a broadcast), the other waited for ever. Both
    return the batch's results now."""
    e = make_engine(queue_depth=8, split_bytes=MiB)
    fd = fds(_sparse(tmp_path))
    hb = fx.HostBuffer(16 * MiB, hugepages=False)
    b = e.submit([(fd, (i % 4) * 16 * MiB, 16 * MiB, hb.address) for i in range(24)])
    out = {}

    def wait(name):
        out[name] = b.wait()

    ts = [threading.Thread(target=wait, args=(n,), daemon=True) for n in ("a", "b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not [t.name for t in ts if t.is_alive()], "a thread still waits on a finished batch"
    assert out["a"] == out["b"] == [16 * MiB] * 24


def test_submitted_batch_that_cannot_start_raises_in_wait(tmp_path, make_engine, fds):
    """An op whose offset + length overflows: Engine.read raises EINVAL, and
    submit().wait() gave 0 bytes for every op, the good one too, as if read.
    It raises the same error now."""
    e = make_engine()
    p = tmp_path / "f"
    p.write_bytes(b"x" * 8192)
    fd = fds(str(p))
    hb = fx.HostBuffer(8192, hugepages=False)
    ops = [(fd, (1 << 63) - 4096, 8192, hb.address), (fd, 0, 4096, hb.address)]
    with pytest.raises(OSError) as read_err:
        e.read(ops)
    with pytest.raises(OSError) as wait_err:
        e.submit(ops).wait()
    assert read_err.value.errno == wait_err.value.errno == errno.EINVAL


def test_closed_read_coroutine_waits_for_its_batch_before_the_files_close(tmp_path, kind):
    """A drive_async read whose coroutine is closed (its task destroyed with
    a closed loop: GeneratorExit, neither a cancellation nor an error) let
    the read generator's finally close its files and give back its buffers
    while the batch still read into them. It waits for the batch first now."""
    from lmcache_fx.core import drive

    e = fx.Engine(io_engine=kind, queue_depth=8, split_bytes=MiB)
    fd = os.open(_sparse(tmp_path), os.O_RDONLY)
    hb = fx.HostBuffer(16 * MiB, hugepages=False)
    batches, seen = [], {}
    real = drive.submit_step

    def spy(engine, step, notify=None):
        b = real(engine, step, notify)
        batches.append(b)
        return b

    def gen():
        try:
            res = yield [(fd, (i % 4) * 16 * MiB, 16 * MiB, hb.address) for i in range(48)], False
            return [res], []
        finally:
            seen["batch_done"] = batches[-1].done() if batches else None

    loop = asyncio.new_event_loop()
    try:
        drive.submit_step = spy
        coro = drive.drive_async(e, gen(), lambda h: None)

        async def start():
            t = loop.create_task(coro)
            while not batches:
                await asyncio.sleep(0.001)
            return t

        loop.run_until_complete(start())
        assert not batches[-1].done()  # the batch is in flight when the coroutine closes
    finally:
        drive.submit_step = real
        loop.close()
    coro.close()
    assert seen == {"batch_done": True}
    os.close(fd)
    e.close()
