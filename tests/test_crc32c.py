"""CRC32C of the C extension (csrc/crc32c.c) against an independent
pure-Python reference, on random lengths from 0 to several MiB, random
alignments and random starting values.

The reference is a byte-at-a-time table CRC. Checking thousands of slices of
a multi-MiB buffer byte by byte in Python would be slow, so the reference
walks the buffer once, recording its raw CRC state at the positions the cases
need, and gets each slice's CRC from two states with GF(2) polynomial
arithmetic (also pure Python): for raw states S (initial 0, no final XOR),
S[b] = S[a] * x^(8*(b-a)) mod P  xor  raw_crc(data[a:b]).
"""

import ctypes
import os
import platform
import random

import pytest

from lmcache_fx import _fxio as fx

KiB = 1 << 10
MiB = 1 << 20
POLY = 0x82F63B78  # CRC32C polynomial, reflected

FAST_IMPLS = {"vpclmulqdq-512", "vpclmulqdq+crc32q", "pclmulqdq+crc32q", "sse4.2", "armv8-pmull", "armv8-crc"}


# -------------------------------------------------------------- reference


def _table():
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ POLY if c & 1 else c >> 1
        t.append(c)
    return t


TABLE = _table()


def raw_crc(data, state=0):
    """Raw (no pre/post inversion) reflected CRC32C state after data."""
    t = TABLE
    for b in data:
        state = t[(state ^ b) & 0xFF] ^ (state >> 8)
    return state


def crc32c_ref(data, value=0):
    return raw_crc(data, value ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


def mulmod(a, b):
    """a*b mod P, both reflected (bit 31-d holds x^d)."""
    r = 0
    for i in range(32):
        if a & (0x80000000 >> i):
            r ^= b
        b = (b >> 1) ^ POLY if b & 1 else b >> 1  # b *= x
    return r


def xpow8(n):
    """x^(8n) mod P, reflected, by square-and-multiply."""
    result, base, k = 0x80000000, 0x40000000, 8 * n  # x^0, x^1
    while k:
        if k & 1:
            result = mulmod(result, base)
        base = mulmod(base, base)
        k >>= 1
    return result


class PrefixStates:
    """Raw CRC states of data[:i] for the positions asked for, in one pass."""

    def __init__(self, data, positions):
        self.state = {}
        state, pos = 0, 0
        t = TABLE
        for p in sorted(set(positions)):
            for b in data[pos:p]:
                state = t[(state ^ b) & 0xFF] ^ (state >> 8)
            pos = p
            self.state[p] = state

    def crc(self, a, b, value=0):
        """CRC32C(data[a:b], value), the API's meaning."""
        n = b - a
        raw = self.state[b] ^ mulmod(self.state[a], xpow8(n))
        return raw ^ mulmod((value ^ 0xFFFFFFFF), xpow8(n)) ^ 0xFFFFFFFF


def addr_of(buf, offset=0):
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) + offset


def test_reference_self_check():
    assert crc32c_ref(b"123456789") == 0xE3069283
    data = random.Random(1).randbytes(3000)
    ps = PrefixStates(data, [0, 5, 1000, 2999, 3000])
    for a, b in ((0, 3000), (5, 1000), (1000, 2999), (5, 5), (0, 5)):
        for v in (0, 1, 0xDEADBEEF):
            assert ps.crc(a, b, v) == crc32c_ref(data[a:b], v)


# ------------------------------------------------------------------ tests


def test_known_vectors():
    assert fx.crc32c(b"123456789") == 0xE3069283
    assert fx.crc32c(b"") == 0
    assert fx.crc32c(b"", 0x12345678) == 0x12345678
    # RFC 3720 (iSCSI) B.4
    assert fx.crc32c(bytes(32)) == 0x8A9136AA
    assert fx.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert fx.crc32c(bytes(range(32))) == 0x46DD794E
    assert fx.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def test_implementation_is_the_fastest_the_cpu_allows():
    """The start-up self-test rejects a fast path that disagrees with the
    table code; a fallback here means such a path is broken."""
    impl = fx.CRC32C_IMPL
    assert impl in FAST_IMPLS | {"table"}
    flags = _cpu_flags()
    machine = platform.machine()
    if flags is None:
        pytest.skip("no /proc/cpuinfo")
    if machine == "x86_64":
        if {"pclmulqdq", "sse4_2", "avx2", "vpclmulqdq", "avx512f", "avx512vl"} <= flags:
            assert impl == "vpclmulqdq-512"
        elif {"pclmulqdq", "sse4_2", "avx2", "vpclmulqdq"} <= flags:
            assert impl == "vpclmulqdq+crc32q"
        elif {"pclmulqdq", "sse4_2"} <= flags:
            assert impl == "pclmulqdq+crc32q"
        elif "sse4_2" in flags:
            assert impl == "sse4.2"
    elif machine == "aarch64":
        if {"crc32", "pmull"} <= flags:
            assert impl == "armv8-pmull"
        elif "crc32" in flags:
            assert impl == "armv8-crc"


IMPLS = fx.crc32c_impls()
# Around each path's block and the 512-bit path's 1 KiB start.
SHORT_LENGTHS = [0, 1, 3, 7, 8, 15, 16, 17, 31, 63, 64, 127, 128, 255, 256, 511, 512, 513]
SHORT_LENGTHS += [1023, 1024, 1025, 1536, 1791, 1792, 2047, 2048, 2100]


def test_implementations_listed():
    """crc32c_impls() lists the one in use first and the table code last
    (every CPU runs it); a name it does not list is refused by name."""
    assert IMPLS[0] == fx.CRC32C_IMPL
    assert IMPLS[-1] == "table"
    assert len(set(IMPLS)) == len(IMPLS)
    with pytest.raises(ValueError, match="'crc-9000' is not one this CPU runs"):
        fx.crc32c(b"abc", impl="crc-9000")
    with pytest.raises(ValueError, match="crc32c_impls"):
        fx.crc32c_at(addr_of(bytearray(8)), 8, impl="crc-9000")


@pytest.mark.parametrize("impl", IMPLS)
def test_every_short_length_and_alignment(impl):
    rng = random.Random(11)
    data = bytearray(rng.randbytes(2200))
    mv = memoryview(data)
    for n in range(0, 1100):
        off = (n * 7) % 64
        value = rng.getrandbits(32)
        chunk = mv[off : off + n]
        assert fx.crc32c(chunk, value, impl=impl) == crc32c_ref(chunk, value), (n, off)
    for off in range(64):
        for n in SHORT_LENGTHS:
            chunk = mv[off : off + n]
            assert fx.crc32c(chunk, impl=impl) == crc32c_ref(chunk), (n, off)


def _cases(rng, size, count, max_len):
    """(offset, length, value): lengths log-uniform up to max_len, so tiny,
    odd and multi-MiB lengths all appear; random starts."""
    out = []
    for i in range(count):
        if i % 5 == 0:
            n = rng.randrange(0, 4 * KiB)
        else:
            n = int(2 ** rng.uniform(0, max_len.bit_length() - 1))
        n = min(n, max_len) + rng.choice((0, 0, 1, -1, 3, 13))
        n = max(0, min(n, size - 64))
        off = rng.randrange(64) if i % 3 else rng.randrange(size - n + 1)
        out.append((off, n, rng.getrandbits(32)))
    return out


@pytest.fixture(scope="module")
def several_mib():
    """A 7 MiB buffer, cases on it and their reference CRCs (the pure-Python
    pass over the buffer is made once for every implementation)."""
    size = 7 * MiB + 4099
    rng = random.Random(2024)
    data = bytearray(rng.randbytes(size))
    cases = _cases(rng, size, 400, 6 * MiB)
    # round sizes of the interleaved and 512-bit paths and their neighbours
    for n in (1024, 1280, 1536, 1792, 2560, 3584, 4096, 5120, 7168, 10240, 14336, 20480, 28672, 64 * KiB, MiB, 4 * MiB):
        for d in (-1, 0, 1, 127, 129, 511, 513):
            cases.append((rng.randrange(64), n + d, rng.getrandbits(32)))
    ref = PrefixStates(data, [p for off, n, _ in cases for p in (off, off + n)])
    return data, [(off, n, value, ref.crc(off, off + n, value)) for off, n, value in cases]


@pytest.mark.parametrize("impl", IMPLS)
def test_random_lengths_and_alignments_to_several_mib(several_mib, impl):
    data, cases = several_mib
    mv = memoryview(data)
    base = addr_of(data)
    for off, n, value, want in cases:
        assert fx.crc32c(mv[off : off + n], value, impl=impl) == want, (off, n)
        assert fx.crc32c_at(base + off, n, value, impl=impl) == want, (off, n)
    if impl == IMPLS[0]:  # the one in use, as the engine calls it
        for off, n, value, want in cases[::7]:
            assert fx.crc32c_at(base + off, n, value) == want, (off, n)


def test_copy_and_sum_is_bit_exact(several_mib):
    """crc32c_copy (the mapped reads' one-pass copy) gives the reference CRC
    and an exact copy, at 64-byte-aligned destinations (the streaming path
    where CRC32C_COPY_ONE_PASS) and unaligned ones (copy, then sum), writing
    nothing past the end."""
    data, cases = several_mib
    base = addr_of(data)
    dst = bytearray(6 * MiB + 256)
    dbase = addr_of(dst)
    pad = (-dbase) % 64
    for k, (off, n, value, want) in enumerate(cases[::3]):
        at = pad + (0 if k % 2 == 0 else 1 + k % 63)  # aligned, then unaligned
        dst[at + n : at + n + 64] = b"\xa5" * len(dst[at + n : at + n + 64])
        assert fx.crc32c_copy(dbase + at, base + off, n, value) == want, (off, n, at)
        assert dst[at : at + n] == data[off : off + n], (off, n, at)
        assert set(dst[at + n : at + n + 64]) <= {0xA5}, (off, n, at)


def test_chaining_equals_one_pass():
    rng = random.Random(5)
    data = rng.randbytes(3 * MiB + 77)
    whole = fx.crc32c(data)
    for cut in (0, 1, 15, 16, 255, 4096, 100_001, MiB + 3, len(data)):
        assert fx.crc32c(data[cut:], fx.crc32c(data[:cut])) == whole, cut
    ref = PrefixStates(data, [0, len(data)])
    assert whole == ref.crc(0, len(data))


def test_buffer_ending_at_unmapped_page():
    """No read past the end: the buffer's last byte is the last of a mapping."""
    import mmap

    page = mmap.PAGESIZE
    m = mmap.mmap(-1, 64 * page)
    try:
        rng = random.Random(9)
        m[:] = rng.randbytes(64 * page)
        base = addr_of(m)
        # each length ends exactly at the mapping's end
        for n in (1, 7, 8, 9, 16, 255, 256, 513, 1792, 4095, 4096, 5000, 28672 + 5, 64 * page - 1, 64 * page):
            start = 64 * page - n
            for impl in IMPLS:
                assert fx.crc32c_at(base + start, n, impl=impl) == crc32c_ref(m[start:]), (n, impl)
    finally:
        m.close()


@pytest.mark.parametrize("split_kib", [4, 8, 64])
def test_combine_through_split_reads(tmp_path, split_kib):
    """Reads split into pieces checksum each piece and join them with
    fx_crc32c_combine; the joined CRC must equal the reference."""
    rng = random.Random(split_kib)
    size = 3 * MiB + 12345
    payload = rng.randbytes(size)
    path = tmp_path / "c.bin"
    path.write_bytes(payload)
    spans = [(0, size), (1, size - 1), (4095, 300_001), (8192, 2 * MiB), (size - 5000, 5000), (777, 0)]
    ref = PrefixStates(payload, [p for a, n in spans for p in (a, a + n)])
    eng = fx.Engine("threads", queue_depth=8, split_bytes=split_kib * KiB)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        bufs = [bytearray(max(n, 1)) for _, n in spans]
        res = eng.read([(fd, a, n, addr_of(b)) for (a, n), b in zip(spans, bufs)], crc=True)
        assert res == [(n, ref.crc(a, a + n)) for a, n in spans]
    finally:
        os.close(fd)
        eng.close()
