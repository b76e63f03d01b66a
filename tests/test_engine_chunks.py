"""Engine.read_chunks / submit_chunks (csrc/chunks.c): a batch of chunk files
opened, read (header to scratch + payload to its destination in one vectored
read), checked against the on-disk format and closed in C; and
Engine.write_chunks (csrc/chunk_write.c), their writing, one pipeline per
chunk.

Real files on a real filesystem (XFS on a RAM-backed loop device when root,
else the temporary directory), real io_uring and the thread engine, O_DIRECT
on and off. Faults run in child interpreters (tests/test_engine_faults.py's
harness) so a hang fails instead of hanging pytest.
"""

import errno
import json
import os
import random
import resource
import signal
import stat
import struct
import threading

import pytest
from test_engine_faults import run_child as _run_child

from lmcache_fx import _fxio as fx
from lmcache_fx.core.chunkfile import (
    HEADER_SIZE,
    BadHeader,
    ChunkMeta,
    FormatVersionMismatch,
    decode_header,
    encode_header,
)
from lmcache_fx.core.medium import page_cache_fs

URING_OK, URING_WHY = fx.io_uring_status()
needs_uring = pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")
KINDS = [pytest.param("io_uring", marks=needs_uring), "threads"]
ALIGN = 4096


def _odirect_ok(path) -> bool:
    p = os.path.join(path, ".dio-probe")
    try:
        os.close(os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        try:
            os.unlink(p)
        except OSError:
            pass


@pytest.fixture
def store(request, tmp_path):
    """A store-like directory: <root>/<ab>/<name>.fxkv; XFS loop when it can be had."""
    try:
        root = request.getfixturevalue("xfs_store")
    except pytest.skip.Exception:
        root = str(tmp_path / "store")
        os.makedirs(root)
    os.makedirs(os.path.join(root, "ab"))
    return root


@pytest.fixture
def rootfd(store):
    fd = os.open(store, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def meta_for(n: int) -> ChunkMeta:
    return ChunkMeta(((n,),), ("uint8",), "raw")


def body_of(key: str, n: int) -> bytes:
    """The JSON body encode_header writes (what `expect` compares)."""
    return json.dumps({"key": key, **meta_for(n).to_json()}, separators=(",", ":")).encode()


def write_chunk(root, name, payload: bytes, key="k", plen=None, pcrc=None) -> bytes:
    h = bytearray(HEADER_SIZE)
    encode_header(
        h,
        key,
        meta_for(len(payload) if plen is None else plen),
        len(payload) if plen is None else plen,
        fx.crc32c(payload) if pcrc is None else pcrc,
        7,
    )
    with open(os.path.join(root, name), "wb") as f:
        f.write(bytes(h) + payload)
    return bytes(h)


def refix_crc(h: bytearray) -> bytearray:
    struct.pack_into("<I", h, HEADER_SIZE - 4, fx.crc32c(bytes(h[: HEADER_SIZE - 4])))
    return h


def span(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def read(eng, rootfd, names_lens, verify=True, direct=False, expects=None, submit=False, mapped=False, stage=False):
    """Reads chunks into one aligned buffer; returns (results, [payload bytes], scratch)."""
    total = sum(span(n) for _, n in names_lens) or ALIGN
    dest = fx.HostBuffer(total + ALIGN, hugepages=False)
    memoryview(dest)[:] = b"\xee" * len(dest)
    scratch = fx.HostBuffer(HEADER_SIZE * max(len(names_lens), 1), hugepages=False)
    chunks, offs, off = [], [], 0
    for i, (name, n) in enumerate(names_lens):
        c = (rootfd, name, dest.address + off, n)
        if expects is not None:
            c = c + (expects[i],)
        chunks.append(c)
        offs.append(off)
        off += span(n)
    if submit:
        res = eng.submit_chunks(
            chunks, scratch.address, verify=verify, direct=direct, mapped=mapped, stage=stage
        ).wait()
    else:
        res = eng.read_chunks(chunks, scratch.address, verify=verify, direct=direct, mapped=mapped, stage=stage)
    mv = memoryview(dest)
    datas = [bytes(mv[o : o + n]) for o, (_, n) in zip(offs, names_lens)]
    return res, datas, bytes(scratch)


def directs(store):
    return [False, True] if _odirect_ok(store) else [False]


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def run_child(body, args, tmp_path, env=None):
    """test_engine_faults' child harness (its prelude reads ARGS["path"])."""
    path = tmp_path / "prelude.bin"
    path.write_bytes(b"\0" * 4096)
    return _run_child(body, {**args, "path": str(path)}, tmp_path, env=env)


# ---------------------------------------------------------------- good chunks


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("submit", [False, True])
def test_bit_exact_payloads_and_headers(kind, submit, store, rootfd):
    """Payloads of many sizes (aligned, unaligned, empty, larger than a piece)
    land bit-exact; the header bytes are left in the scratch; the identity is
    the file's."""
    rng = random.Random(15)
    sizes = [0, 1, 4096, 4097, 8192, 65536 + 100, (1 << 20) + 4096, (3 << 20) + 17]
    files = []
    for i, n in enumerate(sizes):
        p = rng.randbytes(n)
        h = write_chunk(store, f"ab/c{i}.fxkv", p, key=f"key{i}")
        files.append((f"ab/c{i}.fxkv", p, h))
    eng = fx.Engine(kind, queue_depth=8, split_bytes=256 * 1024)
    for direct in directs(store):
        fds0 = fd_count()
        res, datas, scratch = read(
            eng,
            rootfd,
            [(f, len(p)) for f, p, _ in files],
            direct=direct,
            expects=[body_of(f"key{i}", len(p)) for i, (_, p, _) in enumerate(files)],
            submit=submit,
        )
        assert fd_count() == fds0
        for i, ((f, p, h), r, d) in enumerate(zip(files, res, datas)):
            st = os.stat(os.path.join(store, f))
            assert r == (fx.CHUNK_OK, len(p), st.st_dev, st.st_ino, st.st_size), (i, r, direct)
            assert d == p, (i, direct)
            assert scratch[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] == h
            assert decode_header(scratch[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]).key == f"key{i}"
    eng.close()


def _ofd_lock(fd: int, kind: int) -> bool:
    """An OFD lock of `kind` (fcntl.F_RDLCK / F_WRLCK) on a whole file, without waiting."""
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("@hhqqi4x", kind, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("submit", [False, True])
def test_lock_refuses_a_file_being_rewritten(kind, submit, store, rootfd):
    """With lock=True each file is read-locked (OFD) from its open to its
    close: a file an evictor holds write-locked (rewriting it with another
    chunk) is -ESTALE, not read; the others read exact and their locks are
    gone once the call returns. Without lock the write lock is not looked at."""
    import fcntl

    payloads = [random.Random(i).randbytes(20000) for i in range(3)]
    for i, p in enumerate(payloads):
        write_chunk(store, f"ab/l{i}.fxkv", p, key=f"l{i}")
    names = [(f"ab/l{i}.fxkv", len(p)) for i, p in enumerate(payloads)]
    wfd = os.open(os.path.join(store, "ab/l1.fxkv"), os.O_RDWR)
    eng = fx.Engine(kind, queue_depth=8)
    try:
        assert _ofd_lock(wfd, fcntl.F_WRLCK)
        for direct in directs(store):
            dest = fx.HostBuffer(3 * span(20000), hugepages=False)
            scratch = fx.HostBuffer(3 * HEADER_SIZE, hugepages=False)
            chunks = [(rootfd, n, dest.address + i * span(20000), ln) for i, (n, ln) in enumerate(names)]
            if submit:
                res = eng.submit_chunks(chunks, scratch.address, verify=True, direct=direct, lock=True).wait()
            else:
                res = eng.read_chunks(chunks, scratch.address, verify=True, direct=direct, lock=True)
            assert [r[0] for r in res] == [fx.CHUNK_OK, -errno.ESTALE, fx.CHUNK_OK], (res, direct)
            mv = memoryview(dest)
            for i in (0, 2):
                assert bytes(mv[i * span(20000) : i * span(20000) + 20000]) == payloads[i]
            res, datas, _ = read(eng, rootfd, names, direct=direct)  # lock=False
            assert [r[0] for r in res] == [fx.CHUNK_OK] * 3 and datas == payloads
        for i in (0, 2):  # no read lock left behind: a writer gets the file
            fd = os.open(os.path.join(store, f"ab/l{i}.fxkv"), os.O_RDWR)
            try:
                assert _ofd_lock(fd, fcntl.F_WRLCK)
            finally:
                os.close(fd)
    finally:
        os.close(wfd)
        eng.close()


@pytest.mark.parametrize("kind", KINDS)
def test_thousand_small_chunks_one_call(kind, store, rootfd):
    """1000 x 4 KiB in one call, with the descriptor limit low enough that the
    files must be opened in waves (no EMFILE for anyone)."""
    rng = random.Random(1000)
    payloads = [rng.randbytes(4096) for _ in range(1000)]
    for i, p in enumerate(payloads):
        write_chunk(store, f"ab/s{i}.fxkv", p, key=f"s{i}")
    eng = fx.Engine(kind, queue_depth=32)
    helped = fx._helper_waves()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
    try:
        for direct in directs(store):
            res, datas, _ = read(eng, rootfd, [(f"ab/s{i}.fxkv", 4096) for i in range(1000)], direct=direct)
            assert [r[0] for r in res] == [0] * 1000, direct
            assert datas == payloads
        for _ in range(5):  # waves of 32 files: some go down the second lane (once its thread is scheduled)
            if fx._helper_waves() > helped:
                break
            read(eng, rootfd, [(f"ab/s{i}.fxkv", 4096) for i in range(1000)])
        assert fx._helper_waves() > helped
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("one_lane,n", [(False, 200), (True, 200), (False, 20)])
def test_waves_with_few_descriptors_left(kind, one_lane, n, store, tmp_path):
    """A read of many waves goes down two lanes, the calling thread and a
    runner, each holding one wave's files open (or, with _set_one_lane, the
    calling thread alone opening the next wave while it reads one); a read
    of one wave (20 files, waves of 32) has one lane. With descriptors left
    for about one and a quarter waves, or for one file, a wave that finds
    none gives its chunks back for a later wave and waits for the other's
    files to close (one lane: for its own): every chunk is read, bit-exact.
    With none left, every chunk fails with EMFILE and the call returns (a
    child, killed if it hangs); once descriptors are free again the same
    read succeeds."""
    rng = random.Random(200)
    payloads = [rng.randbytes(4096) for _ in range(n)]
    for i, p in enumerate(payloads):
        write_chunk(store, f"ab/w{i}.fxkv", p, key=f"w{i}")
    body = """
import errno
import resource
n = ARGS["n"]
rootfd = os.open(ARGS["store"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
eng = fx.Engine(ARGS["kind"], queue_depth=32)
fx._set_one_lane(ARGS["one_lane"])
dest = fx.HostBuffer(n * 4096, hugepages=False)
scratch = fx.HostBuffer(4096 * n, hugepages=False)
chunks = [(rootfd, f"ab/w{i}.fxkv", dest.address + i * 4096, 4096) for i in range(n)]
eng.read_chunks(chunks[:40], scratch.address)  # the openers, rings and a runner made first
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))  # waves of 32 files

def leave(free):
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as e:
        assert e.errno == errno.EMFILE, e
    for _ in range(free):
        os.close(held.pop())
    return held

def read():
    memoryview(dest)[:] = bytes([0xEE]) * len(dest)
    return [r[0] for r in eng.read_chunks(chunks, scratch.address)], fx.crc32c(bytes(dest))

got = {}
for free in (40, 1):  # room for some files of two waves; for one file at a time
    held = leave(free)
    got[f"few{free}"] = read()
    for fd in held:
        os.close(fd)
held = leave(0)
got["none"] = read()
for fd in held:
    os.close(fd)
got["again"] = read()
out(**got)
"""
    r = run_child(body, {"store": store, "n": n, "kind": kind, "one_lane": one_lane}, tmp_path)
    want = fx.crc32c(b"".join(payloads))
    assert r["few40"] == [[fx.CHUNK_OK] * n, want]
    assert r["few1"] == [[fx.CHUNK_OK] * n, want]
    assert r["none"][0] == [-errno.EMFILE] * n
    assert r["again"] == [[fx.CHUNK_OK] * n, want]


def test_last_read_chunks_ns_is_this_threads_last_call(store, rootfd):
    """last_read_chunks_ns() gives this thread's last read_chunks call: its
    time in the engine (at least the call's own wall time less Python's
    part, so > 0) and its wait for the GIL after it; another thread's call
    does not change it."""
    payload = bytes(range(256)) * 64
    write_chunk(store, "ab/t.fxkv", payload, key="t")
    eng = fx.Engine("threads", queue_depth=4)
    try:
        res, datas, _ = read(eng, rootfd, [("ab/t.fxkv", len(payload))])
        assert res[0][0] == 0 and datas == [payload]
        mine = fx.last_read_chunks_ns()
        assert len(mine) == 2 and mine[0] > 0 and mine[1] >= 0
        other: list = []
        t = threading.Thread(target=lambda: other.append(read(eng, rootfd, [("ab/t.fxkv", len(payload))])))
        t.start()
        t.join()
        assert other and other[0][0][0][0] == 0
        assert fx.last_read_chunks_ns() == mine
    finally:
        eng.close()


# ---------------------------------------------------------------- damaged chunks


def _damaged(store):
    """name -> (file bytes, destination length, expected status, expected
    decode_header outcome: None ok, or the exception type)."""
    rng = random.Random(7)
    p = rng.randbytes(3 * 4096 + 5)
    good = bytearray(HEADER_SIZE)
    encode_header(good, "dk", meta_for(len(p)), len(p), fx.crc32c(p), 1)
    good = bytes(good)
    out = {}
    out["truncated_header"] = (good[:100], len(p), fx.CHUNK_SHORT, BadHeader)
    out["empty"] = (b"", len(p), fx.CHUNK_SHORT, BadHeader)
    out["truncated_payload"] = (good + p[:5000], len(p), fx.CHUNK_SHORT, None)
    h = bytearray(good)
    h[0:8] = b"NOTACHNK"
    out["bad_magic"] = (bytes(refix_crc(h)) + p, len(p), fx.CHUNK_BAD_MAGIC, BadHeader)
    h = bytearray(good)
    h[50] ^= 0x20
    out["bad_header_crc"] = (bytes(h) + p, len(p), fx.CHUNK_BAD_CRC, BadHeader)
    h = bytearray(good)
    struct.pack_into("<H", h, 8, 2)
    out["version"] = (bytes(refix_crc(h)) + p, len(p), fx.CHUNK_VERSION, FormatVersionMismatch)
    h = bytearray(good)
    struct.pack_into("<I", h, 12, 8192)
    out["header_size"] = (bytes(refix_crc(h)) + p, len(p), fx.CHUNK_BAD_HEADER, BadHeader)
    h = bytearray(good)
    struct.pack_into("<I", h, 28, 4053)
    out["meta_len"] = (bytes(refix_crc(h)) + p, len(p), fx.CHUNK_BAD_HEADER, BadHeader)
    out["wrong_length"] = (good + p, len(p) - 5, fx.CHUNK_LENGTH, None)
    q = bytearray(p)
    q[4097] ^= 1
    out["payload_crc"] = (good + bytes(q), len(p), fx.CHUNK_PAYLOAD_CRC, None)
    out["good"] = (good + p, len(p), fx.CHUNK_OK, None)
    return out, p


@pytest.mark.parametrize("kind", KINDS)
def test_every_header_error_code(kind, store, rootfd):
    """Each kind of damage gets its own status, in the order and by the rules
    of chunkfile.decode_header (checked side by side)."""
    cases, p = _damaged(store)
    names = sorted(cases)
    for name in names:
        with open(os.path.join(store, "ab", name + ".fxkv"), "wb") as f:
            f.write(cases[name][0])
    eng = fx.Engine(kind, queue_depth=4, split_bytes=8192)
    for direct in directs(store):
        res, datas, scratch = read(eng, rootfd, [(f"ab/{n}.fxkv", cases[n][1]) for n in names], direct=direct)
        for i, (name, r) in enumerate(zip(names, res)):
            data, dlen, want, dec = cases[name]
            assert r[0] == want, (name, direct, r, fx.CHUNK_STATUS_NAMES[r[0]] if r[0] >= 0 else r[0])
            st = os.stat(os.path.join(store, "ab", name + ".fxkv"))
            assert (r[2], r[3], r[4]) == (st.st_dev, st.st_ino, len(data))
            if len(data) >= HEADER_SIZE:
                hb = scratch[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
                assert hb == data[:HEADER_SIZE]
                if dec is None:
                    decode_header(hb)
                else:
                    with pytest.raises(dec):
                        decode_header(hb)
        got = dict(zip(names, res))
        assert got["truncated_payload"][1] == 5000 and got["good"][1] == len(p)
        assert datas[names.index("good")] == p
    # without verify a payload CRC mismatch is not looked for
    res, _, _ = read(eng, rootfd, [("ab/payload_crc.fxkv", len(p))], verify=False)
    assert res[0][0] == fx.CHUNK_OK
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
def test_expect_compares_the_whole_body(kind, store, rootfd):
    p = b"x" * 8192
    write_chunk(store, "ab/m.fxkv", p, key="mine")
    eng = fx.Engine(kind)
    ok = body_of("mine", len(p))
    for expect, want in [
        (ok, fx.CHUNK_OK),
        (None, fx.CHUNK_OK),
        (body_of("other", len(p)), fx.CHUNK_META),
        (ok[:-1], fx.CHUNK_META),
        (ok + b" ", fx.CHUNK_META),
        (b"", fx.CHUNK_META),
    ]:
        res, datas, _ = read(eng, rootfd, [("ab/m.fxkv", len(p))], expects=[expect])
        assert res[0][0] == want, expect
    eng.close()


# ---------------------------------------------------------------- hostile names


def _plant_hostile_names(store, tmp_path) -> tuple[list, bytes]:
    """A good chunk beside symlinks (to a file outside, to the good chunk, in
    place of a fan-out directory), a FIFO and a directory in chunks' places;
    the names to ask for, escapes and missing ones included, the good last."""
    outside = tmp_path / "outside"
    outside.mkdir()
    p = b"s" * 4096
    write_chunk(str(outside), "real.fxkv", p)
    write_chunk(store, "ab/good.fxkv", p)
    os.symlink(str(outside / "real.fxkv"), os.path.join(store, "ab", "link.fxkv"))
    os.symlink("good.fxkv", os.path.join(store, "ab", "rel.fxkv"))
    os.symlink(str(outside), os.path.join(store, "cd"))
    os.mkfifo(os.path.join(store, "ab", "fifo.fxkv"))
    os.mkdir(os.path.join(store, "ab", "dir.fxkv"))
    names = [
        "ab/link.fxkv",
        "ab/rel.fxkv",
        "cd/real.fxkv",
        "../outside/real.fxkv",
        str(outside / "real.fxkv"),
        "ab/fifo.fxkv",
        "ab/dir.fxkv",
        "ab/missing.fxkv",
        "zz/missing.fxkv",
        "ab/good.fxkv",
    ]
    return names, p


@pytest.mark.parametrize("kind", KINDS)
def test_symlinks_and_escapes_are_refused(kind, store, rootfd, tmp_path):
    """A symlink in place of a chunk or of a fan-out directory is ELOOP, ..
    and absolute names are EXDEV: nothing outside the directory is opened
    (no identity reported). A FIFO in a chunk's place does not block."""
    names, p = _plant_hostile_names(store, tmp_path)
    eng = fx.Engine(kind)
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("blocked")))
    signal.alarm(20)
    try:
        for direct in directs(store):
            res, datas, _ = read(eng, rootfd, [(n, 4096) for n in names], direct=direct)
            st = {n: r for n, r in zip(names, res)}
            for n in names[:3]:
                assert st[n][0] == -errno.ELOOP and st[n][2:4] == (0, 0), (n, st[n])
            for n in names[3:5]:
                assert st[n][0] == -errno.EXDEV and st[n][2:4] == (0, 0), (n, st[n])
            assert st["ab/fifo.fxkv"][0] in (-errno.ESPIPE, -errno.EINVAL)  # O_DIRECT: EINVAL at open
            assert st["ab/dir.fxkv"][0] in (-errno.EISDIR, -errno.EINVAL)
            assert st["ab/missing.fxkv"][0] == -errno.ENOENT and st["zz/missing.fxkv"][0] == -errno.ENOENT
            assert st["ab/good.fxkv"][0] == fx.CHUNK_OK and datas[-1] == p
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    eng.close()


def test_stat_beneath_sees_what_a_read_would_open(store, rootfd, tmp_path):
    """stat_beneath (the store's lookups) follows no symlink on the way: a
    planted fan-out directory and escapes are absent, a symlink in a chunk's
    place is stat'ed itself (not a regular file), and only the good chunk is
    one; with stop_at_missing nothing after the first non-regular name is
    looked at."""
    names, p = _plant_hostile_names(store, tmp_path)
    res = dict(zip(names, fx.stat_beneath([(rootfd, n) for n in names])))
    good = os.lstat(os.path.join(store, "ab", "good.fxkv"))
    assert res["ab/good.fxkv"] == (good.st_mode, good.st_size, good.st_mtime_ns, good.st_dev, good.st_ino)
    for n in ("ab/link.fxkv", "ab/rel.fxkv"):
        assert stat.S_ISLNK(res[n][0]), (n, res[n])
    assert stat.S_ISFIFO(res["ab/fifo.fxkv"][0]) and stat.S_ISDIR(res["ab/dir.fxkv"][0])
    for n in ("cd/real.fxkv", "../outside/real.fxkv", names[4], "ab/missing.fxkv", "zz/missing.fxkv"):
        assert res[n] is None, (n, res[n])
    good_first = [(rootfd, "ab/good.fxkv")] * 2 + [(rootfd, n) for n in names]
    got = fx.stat_beneath(good_first, stop_at_missing=True)
    assert got[:2] == [res["ab/good.fxkv"]] * 2 and stat.S_ISLNK(got[2][0]) and got[3:] == [None] * (len(names) - 1)
    assert fx.stat_beneath([]) == []
    with pytest.raises(TypeError):
        fx.stat_beneath([(rootfd,)])


def test_utime_beneath_touches_only_what_a_read_would_open(store, rootfd, tmp_path):
    """utime_beneath (the store's LRU clock on hits) followed a symlinked
    fan-out directory and "..": a planted link let it set times outside the
    store. Now it follows no link on the way, touches only regular files (a
    FIFO in a chunk's place neither blocks it nor is touched), and counts
    each refusal as a failure."""
    names, _ = _plant_hostile_names(store, tmp_path)
    outside = tmp_path / "outside" / "real.fxkv"
    every = [os.path.join(store, "ab", n) for n in ("link.fxkv", "rel.fxkv", "fifo.fxkv", "dir.fxkv", "good.fxkv")] + [
        str(outside)
    ]
    before = {p: os.lstat(p).st_mtime_ns for p in every}
    t = 123_456_789_000_000_000
    failed = fx.utime_beneath([(rootfd, n, t) for n in names])
    assert failed == len(names) - 1  # all but the good chunk
    assert os.stat(os.path.join(store, "ab", "good.fxkv")).st_mtime_ns == t
    for p in every[:-2] + every[-1:]:
        assert os.lstat(p).st_mtime_ns == before[p], p
    assert os.stat(outside).st_mtime_ns == before[str(outside)]


def test_bad_arguments():
    eng = fx.Engine("threads")
    sb = fx.HostBuffer(4096, hugepages=False)
    with pytest.raises(ValueError):
        eng.read_chunks([(0, "x", 0, 10)], sb.address)  # NULL destination
    with pytest.raises(ValueError):
        eng.read_chunks([(0, "x", sb.address, 10)], sb.address + 1)  # unaligned scratch
    with pytest.raises(ValueError):
        eng.read_chunks([(0, "", sb.address, 10)], sb.address)
    with pytest.raises(ValueError):
        eng.read_chunks([(-1, "x", sb.address, 10)], sb.address)
    with pytest.raises(TypeError):
        eng.read_chunks([(0, "x", sb.address, 10, "str")], sb.address)
    with pytest.raises(TypeError):
        eng.read_chunks([(0, "x")], sb.address)
    assert eng.read_chunks([], 0) == []
    with pytest.raises(ValueError):  # an unaligned header
        eng.write_chunks([(1, sb.address, 10, sb.address + 8, 0)])
    with pytest.raises(ValueError):
        eng.write_chunks([(-1, sb.address, 10, sb.address, 0)])
    with pytest.raises(ValueError):
        eng.write_chunks([(1, 0, 10, sb.address, 0)])  # NULL source
    with pytest.raises(TypeError):
        eng.write_chunks([(1, sb.address)])
    assert eng.write_chunks([]) == []
    eng.close()
    with pytest.raises(ValueError):
        eng.read_chunks([], 0)
    with pytest.raises(ValueError):
        eng.write_chunks([])


def _write_sources(sizes, seed):
    """Random payloads of `sizes` laid out 4096-aligned in one buffer, and a
    buffer of as many headers: (payloads, source, headers, offsets)."""
    rng = random.Random(seed)
    payloads = [rng.randbytes(n) for n in sizes]
    src = fx.HostBuffer(sum(span(n) for n in sizes), hugepages=False)
    hdrs = fx.HostBuffer(HEADER_SIZE * len(sizes), hugepages=False)
    offs = [sum(span(n) for n in sizes[:i]) for i in range(len(sizes))]
    for o, p in zip(offs, payloads):
        memoryview(src)[o : o + len(p)] = p
    return payloads, src, hdrs, offs


def _read_written(eng, rootfd, name, sizes, direct):
    """Reads back, verified, the chunk files `name % i`.fxkv (key k<i>, a
    payload of sizes[i]) under ab/: (results, [payload bytes])."""
    got, datas, _ = read(
        eng,
        rootfd,
        [(f"ab/{os.path.basename(name % i)}.fxkv", n) for i, n in enumerate(sizes)],
        direct=direct,
        expects=[body_of(f"k{i}", n) for i, n in enumerate(sizes)],
    )
    return got, datas


@pytest.mark.parametrize("kind", KINDS)
def test_write_chunks_writes_each_chunk_with_its_crc(kind, store, rootfd):
    """Engine.write_chunks: per chunk the payload at 4096, its CRC32C into
    the header the caller encoded (and the header's own CRC over that), the
    header at 0, and the mtime asked for (none for 0). Renamed into place,
    every chunk reads back bit-exact through read_chunks with verification
    on. A chunk whose write fails stops there: no header, no clock."""
    sizes = [4096, 3 * 4096, 1 << 20, 8192, 4096]  # 3: no clock asked; 4: its fd is read-only
    payloads, src, hdrs, offs = _write_sources(sizes, 7)
    sub = os.path.join(store, "ab")
    eng = fx.Engine(kind)
    try:
        for direct in directs(store):
            name = os.path.join(sub, f"{kind}-{direct}-%d")
            chunks, fds = [], []
            for i, n in enumerate(sizes):
                flags = os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
                fds.append(os.open(name % i + ".tmp", flags | (os.O_RDONLY if i == 4 else os.O_WRONLY), 0o644))
                encode_header(memoryview(hdrs)[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], f"k{i}", meta_for(n), n, 0, 7)
                mtime = 0 if i == 3 else 1_700_000_000_000_000_000 + i * 1001
                chunks.append((fds[i], src.address + offs[i], n, hdrs.address + i * HEADER_SIZE, mtime))
            before = os.stat(name % 3 + ".tmp").st_mtime_ns
            try:
                res = eng.write_chunks(chunks, direct=direct)
            finally:
                for fd in fds:
                    os.close(fd)
            for i in range(4):
                assert res[i][:3] == (sizes[i], HEADER_SIZE, fx.crc32c(payloads[i])), (i, res[i])
            assert [r[3] for r in res] == [1, 1, 1, 0, 0]
            assert res[4][:2] == (-errno.EBADF, 0) and os.path.getsize(name % 4 + ".tmp") == 0
            for i in range(3):
                assert os.stat(name % i + ".tmp").st_mtime_ns == chunks[i][4]
            assert os.stat(name % 3 + ".tmp").st_mtime_ns >= before
            for i in range(4):
                os.rename(name % i + ".tmp", name % i + ".fxkv")
            got, datas = _read_written(eng, rootfd, name, sizes[:4], direct)
            assert [g[0] for g in got] == [0] * 4 and datas == payloads[:4]
    finally:
        eng.close()


def _write_syscalls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw:"))


@pytest.mark.parametrize("kind", KINDS)
def test_write_chunks_odirect_header_and_payload_in_one_request(kind, store, rootfd):
    """On O_DIRECT an aligned chunk of up to 8 MiB goes out with its header
    as one write request (one pwritev at 0, the CRC taken first), counted by
    the kernel's write-syscall counter; an unaligned length keeps two
    (payload through a bounce buffer, then header); a larger payload goes in
    segments, each checksummed before its write, the last one short, then
    the header: 16 MiB segments for a chunk written alone (16 MiB in flight),
    2 MiB ones in a batch of 8 (one segment each on 8 writer threads). All
    read back bit-exact, verified (so the CRC chained over the segments is
    the payload's)."""
    if not _odirect_ok(store):
        pytest.skip(f"O_DIRECT not supported on {store}")
    sizes = [1 << 20, 5000, (16 << 20) + 12288]
    # FX_WRITE_IN_FLIGHT and FX_WRITE_SEGMENT in csrc/chunk_write.c: alone, 16 MiB + 12 KiB is a
    # segment of 16 MiB, one of 12 KiB and the header.
    expected = [1, 2, 3]
    payloads, src, hdrs, offs = _write_sources(sizes, 11)
    name = os.path.join(store, "ab", f"fused-{kind}-%d")
    eng = fx.Engine(kind)
    try:
        for i, n in enumerate(sizes):
            fd = os.open(name % i + ".tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT, 0o644)
            try:
                os.ftruncate(fd, HEADER_SIZE + span(n))
                encode_header(memoryview(hdrs)[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], f"k{i}", meta_for(n), n, 0, 7)
                before = _write_syscalls()
                res = eng.write_chunks([(fd, src.address + offs[i], n, hdrs.address + i * HEADER_SIZE, 0)], direct=True)
                writes = _write_syscalls() - before
            finally:
                os.close(fd)
            assert res[0][:3] == (n, HEADER_SIZE, fx.crc32c(payloads[i])), res
            assert writes == expected[i], (n, writes)
            os.truncate(name % i + ".tmp", HEADER_SIZE + n)
            os.rename(name % i + ".tmp", name % i + ".fxkv")
        got, datas = _read_written(eng, rootfd, name, sizes, True)
        assert [g[0] for g in got] == [0, 0, 0] and datas == payloads

        # A batch of 8: 2 MiB segments, so each 10 MiB + 12 KiB payload is 5 of them, one of 12 KiB
        # and the header.
        batch = [(10 << 20) + 12288] * 8
        payloads, src, hdrs, offs = _write_sources(batch, 12)
        name = os.path.join(store, "ab", f"segments-{kind}-%d")
        fds = []
        try:
            for i, n in enumerate(batch):
                fds.append(os.open(name % i + ".tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o644))
                os.ftruncate(fds[-1], HEADER_SIZE + span(n))
                encode_header(memoryview(hdrs)[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], f"k{i}", meta_for(n), n, 0, 7)
            before = _write_syscalls()
            res = eng.write_chunks(
                [(fd, src.address + offs[i], batch[i], hdrs.address + i * HEADER_SIZE, 0) for i, fd in enumerate(fds)],
                direct=True,
            )
            writes = _write_syscalls() - before
        finally:
            for fd in fds:
                os.close(fd)
        assert [r[:3] for r in res] == [(n, HEADER_SIZE, fx.crc32c(p)) for n, p in zip(batch, payloads)]
        assert writes == 8 * 7, writes
        for i, n in enumerate(batch):
            os.truncate(name % i + ".tmp", HEADER_SIZE + n)
            os.rename(name % i + ".tmp", name % i + ".fxkv")
        got, datas = _read_written(eng, rootfd, name, batch, True)
        assert [g[0] for g in got] == [0] * 8 and datas == payloads
    finally:
        eng.close()


def _extents(path: str) -> int:
    """The file's extents as the filesystem maps them (FS_IOC_FIEMAP, a count only)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        # struct fiemap: start, length, flags (FIEMAP_FLAG_SYNC), mapped extents (out), extent count 0: count only
        out = fcntl.ioctl(fd, 0xC020660B, struct.pack("=QQIIII", 0, (1 << 64) - 1, 1, 0, 0, 0))
    finally:
        os.close(fd)
    return struct.unpack("=QQIIII", out)[3]


@pytest.mark.parametrize("kind", KINDS)
def test_segmented_chunks_written_together_are_one_extent_each(kind, xfs_store):
    """Payloads over 8 MiB go out in segments, one chunk per writer thread at
    once; each file's blocks are allocated whole before its first segment, so
    on XFS (which allocates O_DIRECT writes as they come) the chunks written
    together are not interleaved on the device: one extent each, where they
    were one per 2 MiB segment."""
    store = xfs_store
    os.makedirs(os.path.join(store, "ab"))
    batch = [(10 << 20) + 12288] * 4
    payloads, src, hdrs, offs = _write_sources(batch, 13)
    name = os.path.join(store, "ab", f"extents-{kind}-%d")
    eng = fx.Engine(kind)
    fds = []
    try:
        for i, n in enumerate(batch):
            fds.append(os.open(name % i + ".tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_DIRECT, 0o644))
            os.ftruncate(fds[-1], HEADER_SIZE + span(n))  # as the store reserves: size set, no blocks
            encode_header(memoryview(hdrs)[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], f"k{i}", meta_for(n), n, 0, 7)
        res = eng.write_chunks(
            [(fd, src.address + offs[i], batch[i], hdrs.address + i * HEADER_SIZE, 0) for i, fd in enumerate(fds)],
            direct=True,
        )
    finally:
        for fd in fds:
            os.close(fd)
        eng.close()
    assert [r[:3] for r in res] == [(n, HEADER_SIZE, fx.crc32c(p)) for n, p in zip(batch, payloads)]
    assert [_extents(name % i + ".tmp") for i in range(len(batch))] == [1] * len(batch)
    for i in range(len(batch)):
        with open(name % i + ".tmp", "rb") as f:
            assert f.read()[HEADER_SIZE : HEADER_SIZE + batch[i]] == payloads[i]


SIZE_LIMIT_BODY = """
import errno, signal, resource
from lmcache_fx.core.chunkfile import encode_header, ChunkMeta, HEADER_SIZE
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
limit = 3 << 20  # whole blocks: the write that crosses it is short, the next one EFBIG
sizes = [1 << 20, 4 << 20, (8 << 20) + 12288, 5000]  # fused, fused over the limit, segments, bounced
span = [-(-n // 4096) * 4096 for n in sizes]
src = fx.HostBuffer(sum(span), hugepages=False)
hdrs = fx.HostBuffer(HEADER_SIZE * len(sizes), hugepages=False)
offs = [sum(span[:i]) for i in range(len(sizes))]
eng = fx.Engine(ARGS["kind"])
chunks, fds = [], []
for i, n in enumerate(sizes):
    fd = os.open(os.path.join(ARGS["root"], f"lim{i}.tmp"), os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_DIRECT, 0o644)
    encode_header(memoryview(hdrs)[i * HEADER_SIZE:(i + 1) * HEADER_SIZE], f"k{i}", ChunkMeta(((n,),), ("uint8",), "raw"), n, 0, 7)
    fds.append(fd)
    chunks.append((fd, src.address + offs[i], n, hdrs.address + i * HEADER_SIZE, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
res = eng.write_chunks(chunks, direct=True)
for fd in fds:
    os.close(fd)
eng.close()
out(res=[list(r) for r in res])
"""


@pytest.mark.parametrize("kind", KINDS)
def test_a_short_odirect_write_goes_on_and_its_real_error_is_told(kind, store, tmp_path):
    """A short O_DIRECT write was taken as ENOSPC, always: a file size
    limit (EFBIG) was reported as a full disk, and the store steered chunks
    away from a root with room; a payload over 2 GiB (the kernel writes at
    most 0x7ffff000 bytes per call) failed with ENOSPC on an empty disk. A
    short write of whole blocks goes on; the next write tells what stopped
    it. Chunks under the limit are written whole."""
    if not _odirect_ok(store):
        pytest.skip(f"O_DIRECT not supported on {store}")
    data = tmp_path / "data"  # the children's prelude reads ARGS["path"]
    data.write_bytes(b"x")
    got = _run_child(SIZE_LIMIT_BODY, {"kind": kind, "root": store, "path": str(data)}, tmp_path)["res"]
    assert got[0][:2] == [1 << 20, HEADER_SIZE] and got[3][:2] == [5000, HEADER_SIZE], got
    assert got[1][0] == -errno.EFBIG and got[2][0] == -errno.EFBIG, got
    assert got[1][1] == 0 and got[2][1] == 0, got  # no header: the chunk is not claimed whole


# ---------------------------------------------------------------- faults and fork

# Chunk files for the child bodies below (run_child prepends nothing of this).
CHILD_CHUNKS = """
from lmcache_fx.core.chunkfile import encode_header, ChunkMeta, HEADER_SIZE


def write_chunk_files(root, prefix, payloads, damage=()):
    # ab/<prefix><i>.fxkv per payload; those in `damage` get a payload byte flipped after the CRC was taken.
    os.makedirs(os.path.join(root, "ab"), exist_ok=True)
    for i, p in enumerate(payloads):
        h = bytearray(HEADER_SIZE)
        encode_header(h, f"{prefix}{i}", ChunkMeta(((len(p),),), ("uint8",), "raw"), len(p), fx.crc32c(p), 1)
        body = bytearray(p)
        if i in damage:
            body[len(body) // 2] ^= 1
        with open(os.path.join(root, "ab", f"{prefix}{i}.fxkv"), "wb") as f:
            f.write(bytes(h) + bytes(body))


def read_chunk_files(eng, rfd, prefix, sizes, direct, stage=False):
    # One read_chunks (verify on; stage: through the staging slots) of every file into 4 KiB-aligned slots of one buffer:
    # (results, each payload's bytes as read, the buffer, the slots' offsets).
    span = [-(-n // 4096) * 4096 for n in sizes]
    offs = [sum(span[:i]) for i in range(len(sizes))]
    dest = fx.HostBuffer(sum(span), hugepages=False)
    sc = fx.HostBuffer(HEADER_SIZE * len(sizes), hugepages=False)
    chunks = [(rfd, f"ab/{prefix}{i}.fxkv", dest.address + offs[i], n) for i, n in enumerate(sizes)]
    res = eng.read_chunks(chunks, sc.address, verify=True, direct=direct, stage=stage)
    mv = memoryview(dest)
    return res, [bytes(mv[o : o + n]) for o, n in zip(offs, sizes)], dest, offs
"""

FAULT_BODY = (
    CHILD_CHUNKS
    + """
import random, resource
root = ARGS["root"]
rng = random.Random(3)
sizes = [4096, 5000, 1 << 20, (2 << 20) + 4096, 8192 * 3, 0, 1, 100]
pl = [rng.randbytes(n) for n in sizes]
write_chunk_files(root, "f", pl)
fds0, thr0 = fd_count(), thread_count()
rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine(ARGS["kind"], queue_depth=4, split_bytes=256 * 1024)
report = []
staged0 = fx.direct_staged_pieces()
for direct in ARGS["directs"]:
    for rep in range(3):
        res, got, _, _ = read_chunk_files(eng, rfd, "f", sizes, direct, stage=ARGS.get("stage", False))
        for i, r in enumerate(res):
            report.append([direct, i, r[0], r[1], got[i] == pl[i]])
eng.close()
os.close(rfd)
import time
end = time.monotonic() + 5  # io_uring's kernel workers and joined threads leave the task list asynchronously
while thread_count() > thr0 and time.monotonic() < end:
    time.sleep(0.05)
out(report=report, fired=fx._fault_counts(), fds=[fds0, fd_count()], threads=[thr0, thread_count()],
    staged=fx.direct_staged_pieces() - staged0)
"""
)


def _staged_expected(store, stage: bool) -> bool:
    """Whether O_DIRECT pieces of a stage=True read should go through staging slots here."""
    return stage and True in directs(store) and not page_cache_fs([store])


STAGE_KINDS = [
    pytest.param("io_uring", False, marks=needs_uring),
    pytest.param("io_uring", True, marks=needs_uring, id="io_uring-staged"),
    pytest.param("threads", False),
]


@pytest.mark.parametrize("kind,stage", STAGE_KINDS)
@pytest.mark.parametrize("faults", ["short:40", "eintr:12,eagain:12", "short:20,eintr:10,wait_eintr:20"])
def test_faults_keep_chunks_exact_or_failed(kind, stage, faults, store, tmp_path):
    """Short transfers (also inside the header), EINTR and EAGAIN on fused
    reads, read into place or through staging slots: every chunk is exact
    with status 0, or fails with a status; no descriptor or thread is left
    behind."""
    if kind == "threads" and "wait_eintr" in faults:
        faults = faults.replace(",wait_eintr:20", "")
    r = run_child(
        FAULT_BODY,
        {"root": store, "kind": kind, "directs": directs(store), "stage": stage},
        tmp_path,
        env={"LMCACHE_FX_FAULT": faults},
    )
    assert sum(r["fired"].values()) > 0, r["fired"]
    assert (r["staged"] > 0) == _staged_expected(store, stage), r["staged"]
    for direct, i, status, nbytes, exact in r["report"]:
        assert status != 0 or exact, (direct, i, status, nbytes)
        assert status == 0 or status < 0 or status == fx.CHUNK_SHORT, (direct, i, status)
    # retries are capped but these counts are below the cap: everything succeeds
    assert all(s == 0 for _, _, s, _, _ in r["report"]), r["report"]
    assert r["fds"][0] == r["fds"][1] and r["threads"][0] == r["threads"][1], r


@needs_uring
@pytest.mark.parametrize("stage", [False, True], ids=["into-place", "staged"])
def test_ring_failure_fails_chunks_cleanly(stage, store, tmp_path):
    """The ring fails midway (submit_fail): chunks whose reads were in flight
    are reaped before the call returns (a staged one's bytes moved on or
    given up); each is exact or failed; a second call works; nothing leaks."""
    r = run_child(
        FAULT_BODY,
        {"root": store, "kind": "io_uring", "directs": directs(store), "stage": stage},
        tmp_path,
        env={"LMCACHE_FX_FAULT": "submit_fail:2,wait_eintr:4"},
    )
    assert r["fired"]["submit_fail"] == 2
    for direct, i, status, _nbytes, exact in r["report"]:
        assert (status == 0 and exact) or status < 0 or status == fx.CHUNK_SHORT, (direct, i, status)
    assert any(s != 0 for _, _, s, _, _ in r["report"])
    assert r["fds"][0] == r["fds"][1] and r["threads"][0] == r["threads"][1], r


@pytest.mark.parametrize("kind", KINDS)
def test_fork_child_gets_a_clear_error(kind, store, tmp_path):
    r = run_child(
        """
        root = ARGS["root"]
        os.makedirs(os.path.join(root, "ab"), exist_ok=True)
        eng = fx.Engine(ARGS["kind"])
        sc = fx.HostBuffer(4096, hugepages=False)
        rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:
            msg = "none"
            try:
                eng.read_chunks([(rfd, "ab/x.fxkv", 4096, 4096)], 4096)
            except RuntimeError as e:
                msg = str(e)
            except Exception as e:
                msg = "other " + repr(e)
            os.write(wr, msg.encode()[:500])
            os._exit(0)
        os.close(wr)
        _, st = os.waitpid(pid, 0)
        msg = os.read(rd, 1000).decode()
        res = eng.read_chunks([(rfd, "ab/x.fxkv", sc.address, 4096)], sc.address)
        out(msg=msg, status=st, parent=res[0][0])
        """,
        {"root": store, "kind": kind},
        tmp_path,
    )
    assert "another process (fork)" in r["msg"], r
    assert r["status"] == 0 and r["parent"] == -errno.ENOENT


# ---------------------------------------------------------------- memory media

TMPFS_BODY = (
    CHILD_CHUNKS
    + """
import random
root = ARGS["root"]
rng = random.Random(4)
sizes = [4096, 200 * 1024, 1 << 20, (3 << 20) + 100]
pl = [rng.randbytes(n) for n in sizes]
write_chunk_files(root, "m", pl)
rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine("io_uring", queue_depth=8, split_bytes=256 * 1024)
report = []
for direct in (False, True):
    res, got, dest, offs = read_chunk_files(eng, rfd, "m", sizes, direct)
    for i, r in enumerate(res):
        report.append([direct, i, r[0], got[i] == pl[i]])
    ops = [(os.open(os.path.join(root, "ab", f"m{i}.fxkv"), os.O_RDONLY), 4096, n, dest.address + offs[i])
           for i, n in enumerate(sizes)]
    rr = eng.read(ops, crc=True)
    for (fd, _, n, _), (got, crc), p in zip(ops, rr, pl):
        report.append(["ops", n, got, crc == fx.crc32c(p)])
        os.close(fd)
# A batch partly on disk (O_DIRECT on the test's directory): the io_uring path, the memory piece via io-wq.
disk = os.path.join(ARGS["disk"], "d.bin")
with open(disk, "wb") as f:
    f.write(pl[2])
dfd = os.open(disk, os.O_RDONLY | os.O_DIRECT)
mfd = os.open(os.path.join(root, "ab", "m3.fxkv"), os.O_RDONLY)
d2 = fx.HostBuffer(8 << 20, hugepages=False)
rr = eng.read([(mfd, 4096, sizes[3], d2.address), (dfd, 0, sizes[2], d2.address + (4 << 20))], crc=True)
report.append(["ops", sizes[3], rr[0][0], rr[0][1] == fx.crc32c(pl[3])])
report.append(["ops", sizes[2], rr[1][0], rr[1][1] == fx.crc32c(pl[2])])
os.close(dfd)
os.close(mfd)
eng.close()
out(report=report)
"""
)


@needs_uring
@pytest.mark.parametrize("mem_async", ["", "0", "1"])
def test_tmpfs_reads_are_exact(mem_async, tmp_path):
    """Reads served from memory (tmpfs, buffered fds): a batch wholly in
    memory runs on threads; in a batch partly on disk, the memory pieces go
    to io-wq workers (IOSQE_ASYNC) above LMCACHE_FX_MEM_ASYNC bytes (default
    128 KiB; 0 never, 1 always). Bytes and CRCs stay exact, buffered and
    O_DIRECT (tmpfs takes it from Linux 6.6; refused before, which is a
    per-chunk -EINVAL)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    import tempfile

    root = tempfile.mkdtemp(dir="/dev/shm", prefix="fx-chunks-")
    try:
        r = run_child(
            TMPFS_BODY,
            {"root": root, "disk": str(tmp_path)},
            tmp_path,
            env={"LMCACHE_FX_MEM_ASYNC": mem_async} if mem_async else None,
        )
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    for direct, i, status, exact in r["report"]:
        if direct == "ops":
            assert status == i and exact, r["report"]
        elif direct and status == -errno.EINVAL:
            continue  # tmpfs without O_DIRECT (Linux < 6.6)
        else:
            assert status == 0 and exact, (direct, i, status)


SPREAD_BODY = (
    CHILD_CHUNKS
    + """
import random
root = ARGS["root"]
rng = random.Random(9)
sizes = [rng.randrange(1, 3 << 20) // 4096 * 4096 + 4096 for _ in range(12)]
pl = [rng.randbytes(n) for n in sizes]
write_chunk_files(root, "s", pl, damage=(5,))
rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine("io_uring", queue_depth=16, split_bytes=256 * 1024)
runs0 = fx.crc_spread_runs()
report = []
staged0 = fx.direct_staged_pieces()
for direct in ARGS["directs"]:
    res, got, _, _ = read_chunk_files(eng, rfd, "s", sizes, direct, stage=ARGS["stage"])
    for i, r in enumerate(res):
        report.append([direct, i, r[0], got[i] == pl[i]])
# Engine.write / read with crc=True: the same spread, CRCs against the plain function.
big = fx.HostBuffer(8 << 20, hugepages=False)
memoryview(big)[:] = rng.randbytes(8 << 20)
fd = os.open(os.path.join(root, "w.bin"), os.O_RDWR | os.O_CREAT, 0o600)
want = fx.crc32c(bytes(memoryview(big)[: 4 << 20]))
ops = [(fd, 0, 4 << 20, big.address), (fd, 4 << 20, 4 << 20, big.address + (4 << 20))]
w = eng.write(ops, crc=True)
back = fx.HostBuffer(8 << 20, hugepages=False)
r = eng.read([(fd, 0, 4 << 20, back.address), (fd, 4 << 20, 4 << 20, back.address + (4 << 20))], crc=True)
crcs = [w[0][1] == want, w[1][1] == fx.crc32c(bytes(memoryview(big)[4 << 20:])), r[0][1] == want,
        bytes(back) == bytes(big)]
os.close(fd)
eng.close()
os.close(rfd)
out(report=report, crcs=crcs, runs=fx.crc_spread_runs() - runs0, staged=fx.direct_staged_pieces() - staged0)
"""
)


@needs_uring
def test_unchecked_device_reads_go_in_large_pieces(store, rootfd):
    """With verify off, O_DIRECT chunk reads from a device go in pieces of at
    least 16 MiB, one engine slot per MiB: at queue_depth 32 two of them are
    in flight. With verify on they keep split_bytes (1 MiB: 32 in flight), so
    each piece is checksummed as it lands. Both come back exact."""
    if True not in directs(store):
        pytest.skip("no O_DIRECT on this filesystem")
    if page_cache_fs([store]):
        pytest.skip("the store is in memory: reads from memory keep their pieces")
    rng = random.Random(16)
    payloads = [rng.randbytes(32 << 20) for _ in range(2)]
    names = []
    for i, p in enumerate(payloads):
        write_chunk(store, f"ab/big{i}.fxkv", p)
        names.append((f"ab/big{i}.fxkv", len(p)))
    eng = fx.Engine("io_uring", queue_depth=32, split_bytes=1 << 20)
    try:
        for verify, peak in ((False, 2), (True, 32)):
            fx._uring_peak_inflight()
            res, datas, _ = read(eng, rootfd, names, verify=verify, direct=True)
            assert [r[0] for r in res] == [0, 0], (verify, res)
            assert datas == payloads, verify
            assert fx._uring_peak_inflight() == peak, verify
    finally:
        eng.close()


@needs_uring
def test_staged_device_reads_are_exact_and_bounded_by_the_slots(store, rootfd):
    """stage=True on O_DIRECT reads from a device: chunks of many sizes
    (a tail shorter than a block, pieces under the 64 KiB floor, many
    slots' worth, an empty one) come back exact, their payload pieces read
    through the 8 MiB staging buffer (eight 1 MiB slots: no more than eight
    pieces in flight at queue_depth 32), a damaged payload is a CRC
    mismatch; Engine.read's CRCs equal the plain function's; without verify
    or without stage nothing is staged."""
    if True not in directs(store):
        pytest.skip("no O_DIRECT on this filesystem")
    if page_cache_fs([store]):
        pytest.skip("the store is in memory: nothing there is read O_DIRECT from a device")
    rng = random.Random(21)
    sizes = [24 << 20, 1, 5000, 60 << 10, (1 << 20) + 12345, 0, (3 << 20) + 4096, 8 << 20]
    payloads = [rng.randbytes(n) for n in sizes]
    names = []
    for i, p in enumerate(payloads):
        write_chunk(store, f"ab/st{i}.fxkv", p, key=f"st{i}")
        names.append((f"ab/st{i}.fxkv", len(p)))
    bad = bytearray(payloads[6])
    bad[len(bad) // 3] ^= 0x40
    write_chunk(store, "ab/stbad.fxkv", bytes(bad), pcrc=fx.crc32c(payloads[6]))
    eng = fx.Engine("io_uring", queue_depth=32, split_bytes=1 << 20)
    try:
        n0 = fx.direct_staged_pieces()
        res, datas, _ = read(eng, rootfd, names + [("ab/stbad.fxkv", len(bad))], direct=True, stage=True)
        staged = fx.direct_staged_pieces() - n0
        assert [r[0] for r in res] == [0] * len(sizes) + [fx.CHUNK_PAYLOAD_CRC], res
        assert datas[: len(sizes)] == payloads
        # every 1 MiB payload piece (those under 64 KiB and unaligned tails are not): 24 + 1 + 3 + 8, the damaged 3
        assert staged == 24 + 1 + 3 + 8 + 3, staged
        # only 1 MiB pieces: as many in flight as there are slots (unstaged, 32)
        for stage, peak in ((True, 8), (False, 32)):
            fx._uring_peak_inflight()
            res, datas, _ = read(eng, rootfd, [names[0], names[7]], direct=True, stage=stage)
            assert [r[0] for r in res] == [0, 0] and datas == [payloads[0], payloads[7]], stage
            assert fx._uring_peak_inflight() == peak, stage
        for verify, stage in ((False, True), (True, False)):
            n0 = fx.direct_staged_pieces()
            res, datas, _ = read(eng, rootfd, names, verify=verify, direct=True, stage=stage)
            assert [r[0] for r in res] == [0] * len(sizes) and datas == payloads, (verify, stage)
            assert fx.direct_staged_pieces() == n0, (verify, stage)
        # Engine.read(crc=True, stage=True) on an O_DIRECT fd: CRC and bytes, 3 MiB at an odd 4 KiB offset
        fd = os.open(os.path.join(store, "ab/st6.fxkv"), os.O_RDONLY | os.O_DIRECT)
        try:
            dest = fx.HostBuffer(3 << 20, hugepages=False)
            n0 = fx.direct_staged_pieces()
            got = eng.read([(fd, HEADER_SIZE, 3 << 20, dest.address)], crc=True, stage=True)
            assert got == [(3 << 20, fx.crc32c(payloads[6][: 3 << 20]))]
            assert bytes(dest) == payloads[6][: 3 << 20]
            assert fx.direct_staged_pieces() - n0 == 3
        finally:
            os.close(fd)
    finally:
        eng.close()


@needs_uring
def test_a_staged_read_over_two_devices_keeps_eight_pieces_in_flight_on_each(xfs_store, odirect_tmp):
    """A staged read of files on two devices keeps STAGE_BATCH_MAX (8) staged
    pieces in flight for each device it reads from, 16 in all, where a read
    on one device keeps 8 (the test above); the bytes and CRCs are exact."""
    if os.stat(odirect_tmp).st_dev == os.stat(xfs_store).st_dev:
        pytest.skip("tmp_path is on the loop device's filesystem")
    if page_cache_fs([xfs_store]) or page_cache_fs([str(odirect_tmp)]):
        pytest.skip("a path is in memory: nothing there is read O_DIRECT from a device")
    rng = random.Random(55)
    payloads = [rng.randbytes(12 << 20) for _ in range(2)]
    fds = []
    for d, p in zip((xfs_store, str(odirect_tmp)), payloads):
        path = os.path.join(d, "two-devices.bin")
        with open(path, "wb") as f:
            f.write(p)
        fds.append(os.open(path, os.O_RDONLY | os.O_DIRECT))
    eng = fx.Engine("io_uring", queue_depth=32, split_bytes=1 << 20)
    dest = fx.HostBuffer(24 << 20, hugepages=False)
    try:
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for ops, peak in (
            ([(fds[0], 0, 12 << 20, dest.address)], 8),
            (
                [(fds[0], 0, 12 << 20, dest.address), (fds[1], 0, 12 << 20, dest.address + (12 << 20))],
                16,
            ),
        ):
            n0 = fx.direct_staged_pieces()
            fx._uring_peak_inflight()
            got = eng.read(ops, crc=True, stage=True)
            assert fx._uring_peak_inflight() == peak, ops
            assert fx.direct_staged_pieces() - n0 == 12 * len(ops)
            assert got == [(12 << 20, fx.crc32c(p)) for p in payloads[: len(ops)]]
            assert bytes(memoryview(dest)[: 12 * len(ops) << 20]) == b"".join(payloads[: len(ops)])
    finally:
        for fd in fds:
            os.close(fd)
        eng.close()


@needs_uring
def test_concurrent_staged_reads_share_two_buffers_and_stay_exact(store, rootfd):
    """Six threads read staged at once, on one engine and on engines of
    their own, eight times each: every chunk exact; the pieces share the
    process's staging slots, from no more buffers than it may make (two: a
    piece finding none free waits for its batch's own or reads in place),
    and some went through them."""
    if not _staged_expected(store, True):
        pytest.skip("no O_DIRECT reads from a device here")
    rng = random.Random(33)
    payloads = [rng.randbytes((2 << 20) + 4096 * i) for i in range(6)]
    names = []
    for i, p in enumerate(payloads):
        write_chunk(store, f"ab/cc{i}.fxkv", p, key=f"cc{i}")
        names.append((f"ab/cc{i}.fxkv", len(p)))
    shared = fx.Engine("io_uring", queue_depth=32, split_bytes=1 << 20)
    own = [fx.Engine("io_uring", queue_depth=8, split_bytes=256 << 10) for _ in range(3)]
    bad: list = []
    n0 = fx.direct_staged_pieces()
    # Two, unless a store striped over more devices opened in this process before: its
    # stage_prepare made two per device at once (the bench's --devices tests).
    most = max(2, fx._stage_buffers())

    def reader(t: int) -> None:
        eng = shared if t % 2 else own[t // 2]
        for _ in range(8):
            res, datas, _ = read(eng, rootfd, names[t:] + names[:t], direct=True, stage=True)
            if [r[0] for r in res] != [0] * 6 or datas != payloads[t:] + payloads[:t]:
                bad.append(t)

    ts = [threading.Thread(target=reader, args=(t,)) for t in range(6)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        for e in [shared] + own:
            e.close()
    assert not bad, bad
    assert 1 <= fx._stage_buffers() <= most, (fx._stage_buffers(), most)
    assert fx.direct_staged_pieces() > n0


@needs_uring
def test_staged_reads_beside_chunk_writes_keep_more_in_flight(store, rootfd):
    """While Engine.write_chunks runs in the process (a store beside a load),
    a staged batch whose eight slots are busy reads its further pieces in
    place instead of waiting for a slot: more than eight in flight, and the
    chunks still exact. Alone it keeps to its slots (the test above)."""
    if not _staged_expected(store, True):
        pytest.skip("no O_DIRECT reads from a device here")
    rng = random.Random(44)
    payloads = [rng.randbytes(24 << 20) for _ in range(2)]
    names = []
    for i, p in enumerate(payloads):
        write_chunk(store, f"ab/bw{i}.fxkv", p, key=f"bw{i}")
        names.append((f"ab/bw{i}.fxkv", len(p)))
    wpay, src, hdrs, offs = _write_sources([32 << 20], 45)
    encode_header(memoryview(hdrs)[:HEADER_SIZE], "w", meta_for(32 << 20), 32 << 20, 0, 7)
    wfd = os.open(os.path.join(store, "ab", "bw-write.tmp"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    writer_eng = fx.Engine("io_uring")
    eng = fx.Engine("io_uring", queue_depth=32, split_bytes=1 << 20)
    stop, started = threading.Event(), threading.Event()
    errors: list = []

    def writer() -> None:
        while not stop.is_set():
            started.set()
            r = writer_eng.write_chunks([(wfd, src.address, 32 << 20, hdrs.address, 0)], direct=True)
            if r[0][0] != 32 << 20:
                errors.append(r)
                return

    t = threading.Thread(target=writer)
    peaks = []
    try:
        t.start()
        assert started.wait(10)
        for _ in range(6):
            fx._uring_peak_inflight()
            res, datas, _ = read(eng, rootfd, names, direct=True, stage=True)
            assert [r[0] for r in res] == [0, 0] and datas == payloads
            peaks.append(fx._uring_peak_inflight())
            if peaks[-1] > 8:
                break
    finally:
        stop.set()
        t.join()
        os.close(wfd)
        eng.close()
        writer_eng.close()
    assert not errors, errors
    assert max(peaks) > 8, peaks


def _staged_child(store, tmp_path, body: str) -> dict:
    """Runs body in a child interpreter (CHILD_CHUNKS' helpers, `random` and
    `root` at hand), skipping where nothing is read O_DIRECT from a device."""
    if not _staged_expected(store, True):
        pytest.skip("no O_DIRECT reads from a device here")
    return run_child(CHILD_CHUNKS + 'import random\nroot = ARGS["root"]\n' + body, {"root": store}, tmp_path)


@needs_uring
def test_a_batch_with_nothing_to_stage_takes_no_buffer(store, tmp_path):
    """In a fresh process, staged reads of chunks whose pieces are all under
    64 KiB (or read from memory) take none of the two staging buffers;
    one with 1 MiB pieces makes the first."""
    r = _staged_child(
        store,
        tmp_path,
        """
small = [random.Random(i).randbytes(60 << 10) for i in range(4)]
big = [random.Random(9).randbytes(2 << 20)]
write_chunk_files(root, "sm", small)
write_chunk_files(root, "bg", big)
rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine("io_uring", queue_depth=8, split_bytes=1 << 20)
res, got, _, _ = read_chunk_files(eng, rfd, "sm", [len(p) for p in small], True, stage=True)
after_small = [fx._stage_buffers(), [x[0] for x in res] == [0] * 4 and got == small]
res, got, _, _ = read_chunk_files(eng, rfd, "bg", [len(big[0])], True, stage=True)
after_big = [fx._stage_buffers(), [x[0] for x in res] == [0] and got == big]
eng.close()
out(after_small=after_small, after_big=after_big)
""",
    )
    assert r["after_small"] == [0, True] and r["after_big"] == [1, True], r


@needs_uring
def test_staged_reads_in_a_forked_child_use_buffers_of_its_own(store, tmp_path):
    """Staging buffers are pooled for the process and never inherited
    (MADV_DONTFORK): after the parent's staged reads left buffers in the
    pool, a forked child's new engine reads staged, exact, with buffers
    of its own (the parent's are not mapped there: a use would fault)."""
    r = _staged_child(
        store,
        tmp_path,
        """
pl = [random.Random(i).randbytes((3 << 20) + 4096) for i in range(3)]
write_chunk_files(root, "k", pl)
rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
eng = fx.Engine("io_uring", queue_depth=8, split_bytes=1 << 20)
res, got, _, _ = read_chunk_files(eng, rfd, "k", [len(p) for p in pl], True, stage=True)
parent_ok = [x[0] for x in res] == [0, 0, 0] and got == pl
rd, wr = os.pipe()
pid = os.fork()
if pid == 0:
    n0 = fx.direct_staged_pieces()
    e2 = fx.Engine("io_uring", queue_depth=8, split_bytes=1 << 20)
    res, got, _, _ = read_chunk_files(e2, rfd, "k", [len(p) for p in pl], True, stage=True)
    ok = [x[0] for x in res] == [0, 0, 0] and got == pl and fx.direct_staged_pieces() - n0 == 9  # 3 x 1 MiB each
    e2.close()
    os.write(wr, b"1" if ok else b"0")
    os._exit(0)
_, status = os.waitpid(pid, 0)
child = os.read(rd, 1)
eng.close()
out(parent_ok=parent_ok, child=child.decode(), status=status)
""",
    )
    assert r["parent_ok"] and r["status"] == 0 and r["child"] == "1", r


@needs_uring
def test_a_forked_child_starts_with_one_devices_staging(store, tmp_path):
    """A parent whose store stripes over four devices may have eight staging
    buffers; a forked child starts over: none made, and a one-device store
    there makes two, not the parent's eight (it cannot use the parent's
    store, whose engine refuses in a child)."""
    r = _staged_child(
        store,
        tmp_path,
        """
parent = fx.stage_prepare(4)
rd, wr = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(wr, bytes([fx._stage_buffers(), fx.stage_prepare(1), fx.stage_prepare(2)]))
    os._exit(0)
_, status = os.waitpid(pid, 0)
child = list(os.read(rd, 3))
out(parent=parent, child=child, status=status)
""",
    )
    assert r["status"] == 0 and r["parent"] == 8 and r["child"] == [0, 2, 4], r


@pytest.mark.parametrize("stage", [False, True], ids=["into-place", "staged"])
def test_checksums_spread_over_threads_are_exact(stage, store, tmp_path):
    """With several CPUs, the io_uring engine checksums landed pieces on a
    few threads at once (forced here for every landing with LMCACHE_FX_CRC_WIDTH=2 and
    LMCACHE_FX_CRC_MIN=0: which pieces land together is up to timing): every
    good chunk is exact with status 0, the damaged one is a payload CRC
    mismatch, and Engine.write/read CRCs equal the plain function's. Staged,
    the copies out of the staging slots are what is spread."""
    r = run_child(
        SPREAD_BODY,
        {"root": store, "directs": directs(store), "stage": stage},
        tmp_path,
        env={"LMCACHE_FX_CRC_WIDTH": "2", "LMCACHE_FX_CRC_MIN": "0"},
    )
    assert r["runs"] > 0, "the checksums were never spread"
    for direct, i, status, exact in r["report"]:
        if i == 5:
            assert status == fx.CHUNK_PAYLOAD_CRC, (direct, status)
        else:
            assert status == 0 and exact, (direct, i, status)
    assert all(r["crcs"]), r["crcs"]
    assert (r["staged"] > 0) == _staged_expected(store, stage), r["staged"]  # staged: copies spread too


@pytest.mark.parametrize("kind", KINDS)
def test_small_payloads_go_whole_only_among_other_awaited_reads(kind, store, rootfd):
    """A submitted read that starts while other submitted reads run or wait
    (max_running) reads each O_DIRECT payload of at most 2 MiB as one request
    instead of split_bytes pieces (whole_payloads counts them), every byte
    exact. A read alone, a blocking read, an engine without max_running or
    with whole_when_busy off, and payloads over 2 MiB keep their pieces."""
    if not _odirect_ok(store):
        pytest.skip("no O_DIRECT on this filesystem")
    sizes = {"ab/w0.fxkv": 2 << 20, "ab/w1.fxkv": (3 << 20) + 4096, "ab/big.fxkv": 6 << 20}
    payloads = {n: random.Random(n).randbytes(s) for n, s in sizes.items()}
    for n, p in payloads.items():
        write_chunk(store, n, p, key=n)

    def submit_all(eng, names):
        """Submits one single-chunk read per name back to back, then waits for all."""
        bufs, batches = [], []
        for n in names:
            dest = fx.HostBuffer(span(sizes[n]), hugepages=False)
            scratch = fx.HostBuffer(HEADER_SIZE, hugepages=False)
            bufs.append((n, dest, scratch))
            batches.append(
                eng.submit_chunks([(rootfd, n, dest.address, sizes[n])], scratch.address, verify=True, direct=True)
            )
        for (n, dest, _), b in zip(bufs, batches):
            assert b.wait()[0][0] == fx.CHUNK_OK, n
            assert bytes(memoryview(dest)[: sizes[n]]) == payloads[n], n

    eng = fx.Engine(kind, queue_depth=8, split_bytes=1 << 20, max_running=1)
    try:
        n0 = fx.whole_payloads()
        submit_all(eng, ["ab/w0.fxkv"])  # alone
        res, datas, _ = read(eng, rootfd, [("ab/w0.fxkv", sizes["ab/w0.fxkv"])], direct=True)  # blocking
        assert res[0][0] == fx.CHUNK_OK and datas == [payloads["ab/w0.fxkv"]]
        submit_all(eng, ["ab/big.fxkv", "ab/w1.fxkv"] * 4)  # over 2 MiB: pieces, however busy
        assert fx.whole_payloads() == n0
        # The first (6 MiB) read runs while the rest are submitted: those start with others waiting
        # (the premise, as in test_engine's bound tests: checked reads outlast their submission).
        submit_all(eng, ["ab/big.fxkv"] + ["ab/w0.fxkv"] * 12)
        assert fx.whole_payloads() - n0 >= 2
    finally:
        eng.close()
    for kw in ({}, {"max_running": 1, "whole_when_busy": False}):  # max_running 0: nothing known of the others
        eng = fx.Engine(kind, queue_depth=8, split_bytes=1 << 20, **kw)
        try:
            n0 = fx.whole_payloads()
            submit_all(eng, ["ab/big.fxkv", "ab/w0.fxkv", "ab/w1.fxkv", "ab/w0.fxkv"])
            assert fx.whole_payloads() == n0, kw
        finally:
            eng.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_list_changed_while_it_is_parsed_is_not_read_after_free(kind, store, rootfd, tmp_path):
    """Parsing a chunk's name runs its __fspath__, an op's numbers their
    __index__: Python code that can empty the caller's list while the engine
    walks it. The engine parses its own snapshot of the list: the call reads
    what it was given (a child, so a crash is a failed test, not a dead
    suite)."""
    payload = bytes(range(256)) * 16
    write_chunk(store, "ab/m.fxkv", payload, key="m")
    body = """
rootfd = os.open(ARGS["store"], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
eng = fx.Engine(ARGS["kind"], queue_depth=4)
dest = fx.HostBuffer(3 * 4096, hugepages=False)
scratch = fx.HostBuffer(3 * 4096, hugepages=False)
chunks = []

class Emptying:
    def __init__(self, name):
        self.name = name

    def __fspath__(self):
        chunks.clear()  # the list read_chunks was handed
        return self.name

chunks.extend([(rootfd, Emptying("ab/m.fxkv"), dest.address, 4096, None)] +
              [(rootfd, "ab/m.fxkv", dest.address + i * 4096, 4096) for i in (1, 2)])
statuses = [r[0] for r in eng.read_chunks(chunks, scratch.address)]
fd = os.open(os.path.join(ARGS["store"], "ab/m.fxkv"), os.O_RDONLY)
ops = []

class EmptyingInt:
    def __index__(self):
        ops.clear()
        return 4096

ops.extend([(fd, EmptyingInt(), 4096, dest.address)] + [(fd, 4096, 4096, dest.address + i * 4096) for i in (1, 2)])
reads = eng.read(ops)
out(statuses=statuses, reads=reads, same=bytes(dest)[:4096] == bytes(dest)[4096:8192])
"""
    r = run_child(body, {"store": store, "kind": kind}, tmp_path)
    assert r == {"statuses": [fx.CHUNK_OK] * 3, "reads": [4096] * 3, "same": True}


@pytest.mark.parametrize("kind", KINDS)
def test_lengths_whose_piece_count_would_wrap_are_refused(kind, tmp_path):
    """Ops whose pieces would number more than a size_t of their bytes can
    count (69 ops of 2**63 - 1 bytes at 4 KiB pieces), or whose offset and
    length pass 2**63: the engine refuses the call (EINVAL) instead of
    allocating a wrapped size and writing past it (a child: it segfaulted)."""
    body = """
import errno
fd = os.open(ARGS["path"], os.O_RDONLY)
buf = fx.HostBuffer(4096, hugepages=False)
eng = fx.Engine(ARGS["kind"], queue_depth=4)
got = []
for ops in ([(fd, 0, (1 << 63) - 1, buf.address)] * 69, [(fd, 1 << 62, 1 << 62, buf.address)]):
    try:
        eng.read(ops, split=4096)
        got.append("read")
    except OSError as e:
        got.append(e.errno == errno.EINVAL)
got.append(eng.read([(fd, 0, 4096, buf.address)]))  # the engine still reads
out(got=got)
"""
    r = run_child(body, {"kind": kind}, tmp_path)
    assert r["got"] == [True, True, [4096]]
