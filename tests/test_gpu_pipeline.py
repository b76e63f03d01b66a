"""The file -> GPU pipeline (csrc/gpu.c) against a stand-in driver.

Only the driver boundary is replaced: tests/fake_gpu_driver.c implements the
CUDA driver calls with memcpy on a per-stream worker thread (copies complete
asynchronously) and logs each copy's start and end; the pipeline's own trace
logs each read's submission and completion, on the same clock. From the two
logs: order, overlap, slot reuse only after the copy completed, error
propagation and bit-exact results.
"""

import ctypes
import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from lmcache_fx import _fxio

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20


@pytest.fixture(scope="session")
def fake_driver(fake_gpu_driver_so):
    so = fake_gpu_driver_so
    os.environ["LMCACHE_FX_GPU_DRIVER"] = so
    info = _fxio.gpu_driver()
    if info["path"] != so:
        pytest.skip(f"another GPU driver is already loaded in this process: {info}")
    lib = ctypes.CDLL(so)  # the same handle the pipeline uses: shared state
    lib.fake_gpu_log_len.restype = ctypes.c_long
    lib.fake_gpu_pinned_bytes.restype = ctypes.c_long
    lib.fake_gpu_unpinned_copies.restype = ctypes.c_long
    return so, lib


@pytest.fixture
def drv(fake_driver):
    so, lib = fake_driver
    lib.fake_gpu_reset()
    yield lib
    lib.fake_gpu_reset()


def fake_log(lib):
    out = []
    buf = (ctypes.c_longlong * 6)()
    for i in range(lib.fake_gpu_log_len()):
        lib.fake_gpu_log_get(ctypes.c_long(i), buf)
        out.append(tuple(buf))
    return out  # (kind 1 start / 2 end / 3 event, t_ns, seq, dst, src, n)


@pytest.fixture
def datafile(tmp_path):
    data = os.urandom(24 * MiB + 12345)
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    return str(p), data


def copies_from_log(log):
    starts = {e[2]: e for e in log if e[0] == 1}
    ends = {e[2]: e for e in log if e[0] == 2}
    return starts, ends


@pytest.mark.parametrize("io_engine", ["io_uring", "threads"])
def test_bit_exact_and_order(drv, datafile, io_engine):
    if io_engine == "io_uring" and not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    path, data = datafile
    drv.fake_gpu_set_delay_us(200)
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine=io_engine)
    assert g.io == io_engine and g.pinned and drv.fake_gpu_pinned_bytes() >= g.size
    dev = _fxio.HostBuffer(len(data) + 2 * MiB)  # "device memory" of the stand-in
    mv = memoryview(dev)
    mv[:] = b"\xee" * len(mv)
    fd = os.open(path, os.O_RDONLY)
    try:
        # unaligned offsets and lengths, an empty op, one past EOF (short)
        spec = [
            (0, 5 * MiB + 7),
            (5 * MiB + 7, 3),
            (5 * MiB + 10, 0),
            (5 * MiB + 10, 11 * MiB + 4093),
            (16 * MiB + 4103, 64 * MiB),
        ]
        where, ops, pos = [], [], 0
        for off, n in spec:
            where.append(pos)
            ops.append((fd, off, n, dev.address + pos))
            pos += min(n, len(data) - off) + 4096  # a guard gap after each
        res = g.read(ops, trace=True)
    finally:
        os.close(fd)
    want = [min(n, len(data) - off) for off, n in spec]
    assert res == want, g.last_error
    assert g.last_error is None
    for (off, _n), w, got in zip(spec, where, want):
        assert bytes(mv[w : w + got]) == data[off : off + got]
        assert bytes(mv[w + got : w + got + 4096]) == b"\xee" * 4096  # nothing written past the op
    assert drv.fake_gpu_unpinned_copies() == 0  # every copy came from page-locked staging

    tr = g.last_trace()
    log = fake_log(drv)
    starts, ends = copies_from_log(log)
    issues = [e for e in tr if e[1] == "copy_issue"]
    assert len(issues) == len(starts) == len(ends)
    done_t = {e[4]: e[0] for e in tr if e[1] == "read_done"}
    for k, ev in enumerate(issues, start=1):  # the stand-in numbers copies in issue order
        assert done_t[ev[4]] <= ev[0] <= starts[k][1] < ends[k][1]  # read landed, then its copy ran
        assert starts[k][5] == ev[5]
    # the stream runs copies in issue order
    assert [starts[k][1] for k in sorted(starts)] == sorted(starts[k][1] for k in starts)
    # per slot: submit -> done -> copy_issue -> copy_done -> next submit
    for slot in range(g.slots):
        kinds = [e[1] for e in tr if e[2] == slot and e[1] != "error"]
        for a, b in zip(kinds, kinds[1:]):
            assert (a, b) in {
                ("read_submit", "read_done"),
                ("read_done", "copy_issue"),
                ("copy_issue", "copy_done"),
                ("copy_done", "read_submit"),
                ("read_done", "read_submit"),
            }, kinds
    g.close()


def test_overlap_and_slot_reuse(drv, datafile):
    path, data = datafile
    drv.fake_gpu_set_delay_us(1500)  # copies slower than page-cache reads
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB)
    dev = _fxio.HostBuffer(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        res = g.read([(fd, 0, 16 * MiB, dev.address)], trace=True)
    finally:
        os.close(fd)
    assert res == [16 * MiB]
    assert bytes(memoryview(dev)[: 16 * MiB]) == data[: 16 * MiB]
    tr = g.last_trace()
    log = fake_log(drv)
    starts, ends = copies_from_log(log)
    last_read_done = max(e[0] for e in tr if e[1] == "read_done")
    first_copy_start = min(e[1] for e in starts.values())
    assert first_copy_start < last_read_done  # copies started before the reads ended
    # reads landed while a copy was running: real overlap, not turn-taking
    spans = [(starts[k][1], ends[k][1]) for k in starts]
    during = [e for e in tr if e[1] == "read_done" and any(a < e[0] < b for a, b in spans)]
    assert during, "no read completed while a copy was running"
    assert g.last_stats()["copies_during_reads"] > 0
    # a slot is read into again only after the copy out of it ended
    base, sb = g.address, g.slot_bytes
    copy_end_by_slot = {}
    for k in sorted(starts):
        slot = (starts[k][4] - base) // sb
        copy_end_by_slot.setdefault(slot, []).append((starts[k][1], ends[k][1]))
    for e in tr:
        if e[1] != "read_submit":
            continue
        prior = [c for c in copy_end_by_slot.get(e[2], []) if c[0] < e[0]]
        for _s, end in prior:
            assert end < e[0], f"slot {e[2]} refilled at {e[0]} before its copy ended at {end}"
    assert sum(len(v) for v in copy_end_by_slot.values()) == 16
    g.close()


def _check_drained(g, drv):
    tr = g.last_trace()
    subs = sum(1 for e in tr if e[1] == "read_submit")
    dones = sum(1 for e in tr if e[1] == "read_done")
    assert subs == dones  # every read reaped before return
    starts, ends = copies_from_log(fake_log(drv))
    assert set(starts) == set(ends)  # every queued copy finished before return


@pytest.mark.parametrize("cancel", [True, False])
def test_read_error(drv, datafile, tmp_path, cancel):
    path, data = datafile
    drv.fake_gpu_set_delay_us(300)
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB)
    dev = _fxio.HostBuffer(len(data) * 2)
    fd = os.open(path, os.O_RDONLY)
    wfd = os.open(tmp_path / "w.bin", os.O_WRONLY | os.O_CREAT)  # reads fail with EBADF
    os.pwrite(wfd, b"x" * MiB, 0)
    try:
        ops = [
            (fd, 0, 4 * MiB, dev.address),
            (wfd, 0, MiB, dev.address + 5 * MiB),
            (fd, 4 * MiB, 8 * MiB, dev.address + 7 * MiB),
        ]
        res = g.read(ops, trace=True, cancel_on_error=cancel)
    finally:
        os.close(fd)
        os.close(wfd)
    assert res[1] == -errno.EBADF
    assert "read at offset 0 failed" in g.last_error
    if cancel:
        assert res[2] in (-errno.ECANCELED, 8 * MiB)
        assert -errno.ECANCELED in res
    else:
        assert res[0] == 4 * MiB and res[2] == 8 * MiB
        m = memoryview(dev)
        assert bytes(m[7 * MiB : 15 * MiB]) == data[4 * MiB : 12 * MiB]
    if res[0] == 4 * MiB:
        assert bytes(memoryview(dev)[: 4 * MiB]) == data[: 4 * MiB]
    _check_drained(g, drv)
    g.close()


@pytest.mark.parametrize("mode", [0, 1], ids=["copy-call-fails", "copy-fails-on-stream"])
def test_copy_error(drv, datafile, mode):
    path, data = datafile
    drv.fake_gpu_set_delay_us(300)
    drv.fake_gpu_fail_copy(ctypes.c_long(3), mode)
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB)
    dev = _fxio.HostBuffer(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        ops = [(fd, i * 2 * MiB, 2 * MiB, dev.address + i * 2 * MiB) for i in range(8)]
        res = g.read(ops, trace=True)
        assert -errno.EIO in res
        assert all(r in (-errno.EIO, -errno.ECANCELED, 2 * MiB) for r in res)
        assert res.count(2 * MiB) < 8
        name = "CUDA_ERROR_INVALID_VALUE" if mode == 0 else "CUDA_ERROR_ILLEGAL_ADDRESS"
        assert name in g.last_error
        if mode == 0:
            assert "cuMemcpyHtoDAsync" in g.last_error
        for i, r in enumerate(res):
            if r == 2 * MiB:
                assert bytes(memoryview(dev)[i * 2 * MiB : (i + 1) * 2 * MiB]) == data[i * 2 * MiB : (i + 1) * 2 * MiB]
        _check_drained(g, drv)
        # the pool is usable again once the driver is (sticky error cleared)
        drv.fake_gpu_reset()
        res = g.read(ops)
        assert res == [2 * MiB] * 8 and g.last_error is None
        assert bytes(memoryview(dev)[: 16 * MiB]) == data[: 16 * MiB]
    finally:
        os.close(fd)
        g.close()


def test_bad_descriptors(drv, tmp_path):
    g = _fxio.GpuStaging(slots=2, slot_bytes=MiB)
    dev = _fxio.HostBuffer(MiB)
    dfd = os.open(tmp_path, os.O_RDONLY)
    r, w = os.pipe()
    try:
        assert g.read([(dfd, 0, 10, dev.address)], cancel_on_error=False) == [-errno.EISDIR]
        assert g.read([(r, 0, 10, dev.address)]) == [-errno.ESPIPE]
        assert g.read([(999, 0, 10, dev.address), (dfd, 0, 0, dev.address)]) == [-errno.EBADF, -errno.ECANCELED]
        with pytest.raises(ValueError):
            g.read([(dfd, 0, 10, 0)])
        assert g.read([]) == []
    finally:
        os.close(dfd)
        os.close(r)
        os.close(w)
    g.close()
    with pytest.raises(ValueError):
        g.read([])


def test_odirect_unaligned(drv, odirect_tmp):
    data = os.urandom(9 * MiB + 333)
    p = odirect_tmp / "d.bin"
    p.write_bytes(data)
    g = _fxio.GpuStaging(slots=3, slot_bytes=MiB)
    dev = _fxio.HostBuffer(len(data) + 8192)
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        ops = [(fd, 1, 3 * MiB, dev.address + 5), (fd, 3 * MiB + 1, len(data), dev.address + 3 * MiB + 8)]
        res = g.read(ops)
    finally:
        os.close(fd)
    assert res == [3 * MiB, len(data) - 3 * MiB - 1], g.last_error
    m = memoryview(dev)
    assert bytes(m[5 : 5 + 3 * MiB]) == data[1 : 3 * MiB + 1]
    assert bytes(m[3 * MiB + 8 : 3 * MiB + 8 + res[1]]) == data[3 * MiB + 1 :]
    g.close()


def test_gil_released_and_engine_choice(drv, datafile):
    path, data = datafile
    e = _fxio.Engine(io_engine="threads")
    g = _fxio.GpuStaging(slots=2, slot_bytes=MiB, engine=e)
    assert g.io == "threads"
    drv.fake_gpu_set_delay_us(2000)
    dev = _fxio.HostBuffer(len(data))
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = time.monotonic()
        res = g.read([(fd, 0, 20 * MiB, dev.address)])
        el = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
        os.close(fd)
    assert res == [20 * MiB]
    assert el > 0.03 and count[0] > 1000  # Python ran while the pipeline waited
    g.close()
    e.close()


def test_no_driver_reports():
    code = (
        "from lmcache_fx import _fxio\n"
        "i = _fxio.gpu_driver(); assert i['api'] is None and 'nonexistent' in i['error'], i\n"
        "try:\n  _fxio.GpuStaging()\nexcept OSError as e:\n  print('OSError', e)\n"
    )
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER="/nonexistent/libcuda.so.1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "OSError GPU driver unavailable" in out.stdout


def test_io_uring_register_probe():
    """What io_uring can pin here: anonymous memory, mlock'ed or not (what
    cudaHostRegister'ed and torch pinned-by-register memory are)."""
    import mmap

    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    hb = _fxio.HostBuffer(4 * MiB)
    assert _fxio.uring_register_probe(hb.address, 4 * MiB) == 0
    libc = ctypes.CDLL(None, use_errno=True)
    m = mmap.mmap(-1, 2 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(2 * MiB)) == 0:
        assert _fxio.uring_register_probe(addr, 2 * MiB) == 0  # mlock'ed (page-locked) memory
        libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(2 * MiB))
    r = _fxio.uring_register_probe(addr, 2 * MiB)
    assert r == 0
    del addr
    m.close()


def test_python_api_and_example(drv, tmp_path):
    torch = pytest.importorskip("torch")
    from lmcache_fx import gpu

    assert gpu.available() and gpu.driver_info()["api"] == "cuda"
    a = torch.randn(300, 7)
    b = torch.arange(5000, dtype=torch.int64)
    p = tmp_path / "t.bin"
    p.write_bytes(a.numpy().tobytes() + b.numpy().tobytes())
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    with gpu.GpuReader(device=0, slots=2, slot_bytes=64 << 10) as rd:
        res = rd.read_tensors(str(p), [(0, a2), (a.numel() * 4, b2)])
        gpu.check_results(res, [a.numel() * 4, b.numel() * 8])
    assert torch.equal(a, a2) and torch.equal(b, b2)
    # the example, end to end, on the stand-in
    st = tmp_path / "m.safetensors"
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "safetensors_to_gpu.py"),
            "--make-demo",
            str(st),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr + out.stdout
    assert "bit-exact: yes" in out.stdout


# ------------------------------------------------------------------ issue 17
def _kernels(lib):
    lib.fake_gpu_stream_new.restype = ctypes.c_void_p
    lib.fake_gpu_stream_sync.argtypes = [ctypes.c_void_p]
    lib.fake_gpu_kernel.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_uint,
    ]
    return lib


@pytest.mark.parametrize("io_engine", ["io_uring", "threads"])
def test_copies_wait_for_the_callers_stream(drv, datafile, io_engine):
    """A kernel queued earlier on the caller's stream still reads B (clones it
    into C) and another still writes W: the pipeline's copies into B and W
    must land after them. Without the ordering, the copies (fast) land first:
    the clone holds the new bytes and the kernel's write wins over the read."""
    if io_engine == "io_uring" and not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    path, data = datafile
    lib = _kernels(drv)
    n = 3 * MiB + 5
    S = lib.fake_gpu_stream_new()
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine=io_engine)
    B, C, W = _fxio.HostBuffer(n), _fxio.HostBuffer(n), _fxio.HostBuffer(n)
    memoryview(B)[:n] = b"\x11" * n
    lib.fake_gpu_kernel(S, C.address, B.address, 0, n, 150000)  # reads B after 150 ms
    lib.fake_gpu_kernel(S, W.address, None, 0xAB, n, 0)  # then writes W
    fd = os.open(path, os.O_RDONLY)
    try:
        res = g.read([(fd, 7, n, B.address), (fd, 7 + n, n, W.address)], stream=S)
    finally:
        os.close(fd)
    assert res == [n, n], g.last_error
    lib.fake_gpu_stream_sync(S)
    assert bytes(memoryview(C)[:n]) == b"\x11" * n  # the clone holds B's old bytes
    assert bytes(memoryview(B)[:n]) == data[7 : 7 + n]
    assert bytes(memoryview(W)[:n]) == data[7 + n : 7 + 2 * n]  # the read came after the kernel's write
    log = fake_log(drv)
    kernel_end = max(e[1] for e in log if e[0] == 5)
    assert min(e[1] for e in log if e[0] == 1) > kernel_end  # no copy started before the caller's work ended
    g.close()


def test_sync_false_makes_the_callers_stream_wait(drv, datafile):
    """sync=False returns with copies still running; work queued on the
    caller's stream afterwards sees the data (the stream waits on the last
    copy's event); the next read waits for the slots before reusing them."""
    path, data = datafile
    lib = _kernels(drv)
    drv.fake_gpu_set_delay_us(5000)
    S = lib.fake_gpu_stream_new()
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB)
    n = 8 * MiB
    B, C, D = _fxio.HostBuffer(n), _fxio.HostBuffer(n), _fxio.HostBuffer(n)
    fd = os.open(path, os.O_RDONLY)
    try:
        res = g.read([(fd, 0, n, B.address)], stream=S, sync=False)
        t_ret = time.monotonic_ns()
        lib.fake_gpu_kernel(S, C.address, B.address, 0, n, 0)  # a kernel using B, queued after the read
        assert res == [n], g.last_error
        lib.fake_gpu_stream_sync(S)
        assert bytes(memoryview(C)[:n]) == data[:n]
        ends = [e[1] for e in fake_log(drv) if e[0] == 2]
        assert len(ends) == 8 and max(ends) > t_ret  # it returned before the last copies ended
        # the next read (sync) reuses the slots only after those copies ended
        res = g.read([(fd, n, n, D.address)], stream=S)
        assert res == [n] and bytes(memoryview(D)[:n]) == data[n : 2 * n]
        assert bytes(memoryview(B)[:n]) == data[:n]
    finally:
        os.close(fd)
    g.close()


def test_python_api_takes_the_stream(drv, datafile):
    """GpuReader.read_into: a torch-like stream object (.cuda_stream), an int
    handle, or the default (torch's current stream; 0 without a torch GPU)."""
    from lmcache_fx import gpu

    path, data = datafile
    lib = _kernels(drv)
    S = lib.fake_gpu_stream_new()

    class TorchLikeStream:
        cuda_stream = S

    assert gpu._stream_handle(TorchLikeStream(), 0) == S and gpu._stream_handle(5, 0) == 5
    assert gpu._stream_handle(None, 0) == 0  # no torch GPU here
    B, C = _fxio.HostBuffer(MiB), _fxio.HostBuffer(MiB)
    memoryview(B)[:] = b"\x22" * MiB
    lib.fake_gpu_kernel(S, C.address, B.address, 0, MiB, 100000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with gpu.GpuReader(device=0, slots=2, slot_bytes=256 << 10) as rd:
            assert rd.read_into([(fd, 0, MiB, B.address)], stream=TorchLikeStream()) == [MiB]
            assert rd.read_into([(fd, MiB, 4096, C.address + 4096)]) == [4096]  # default stream: 0
    finally:
        os.close(fd)
    lib.fake_gpu_stream_sync(S)
    assert bytes(memoryview(C)[:4096]) == b"\x22" * 4096 and bytes(memoryview(B)) == data[:MiB]


def test_unpinned_staging_warns_once_with_the_reason(drv, datafile, caplog, monkeypatch):
    import logging

    from lmcache_fx import gpu
    from lmcache_fx.core import once

    path, data = datafile
    drv.fake_gpu_fail_register(1)
    monkeypatch.setattr(once, "_said", set())
    with caplog.at_level(logging.WARNING, logger="lmcache_fx.gpu"):
        rd = gpu.GpuReader(device=0, slots=2, slot_bytes=MiB)
        rd2 = gpu.GpuReader(device=0, slots=2, slot_bytes=MiB)
    warns = [r.getMessage() for r in caplog.records if r.name == "lmcache_fx.gpu"]
    assert len(warns) == 1, warns  # once per reason
    assert "not page-locked (host register failed: CUDA_ERROR_INVALID_VALUE (1))" in warns[0]
    assert "synchronous" in warns[0]
    assert not rd.pinned and rd.degraded and "CUDA_ERROR_INVALID_VALUE" in rd.degraded
    dev = _fxio.HostBuffer(2 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:  # still correct, only slower
        assert rd.read_into([(fd, 0, 2 * MiB, dev.address)]) == [2 * MiB]
    finally:
        os.close(fd)
    assert bytes(memoryview(dev)) == data[: 2 * MiB]
    rd.close()
    rd2.close()
    drv.fake_gpu_fail_register(0)
    with gpu.GpuReader(device=0, slots=2, slot_bytes=MiB) as ok:
        assert ok.pinned and ok.degraded is None


def test_fixed_buffer_refusal_is_reported(fake_gpu_driver_so, tmp_path):
    """io_uring refusing the slots as fixed buffers (no CAP_IPC_LOCK, a low
    RLIMIT_MEMLOCK) is named in fixed_error and in GpuReader.degraded."""
    import shutil

    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (256 << 10, 256 << 10))\n"
        "from lmcache_fx import gpu\n"
        "rd = gpu.GpuReader(device=0, slots=2, slot_bytes=1 << 20, io_engine='io_uring')\n"
        "print('FIXED', rd.staging.fixed_buffers, rd.degraded)\n"
    )
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:  # root has CAP_IPC_LOCK: drop it
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv: cannot drop CAP_IPC_LOCK")
        cmd = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *cmd]
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=fake_gpu_driver_so)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    line = [x for x in out.stdout.splitlines() if x.startswith("FIXED")][0]
    if line.startswith("FIXED True"):
        pytest.skip("io_uring registered the buffers anyway (kernel does not account them)")
    assert "io_uring fixed-buffer registration failed" in line and "every read pins its pages again" in line
    assert "lmcache-fx: GPU reads on a slow path" in out.stderr


def test_large_staging_is_not_registered_per_ring_where_rings_cannot_share_it(fake_gpu_driver_so):
    """On a kernel that cannot clone one ring's fixed buffers into another
    (the no_clone fault point), staging slots over 256 MiB in all are not
    registered on the store engine's rings (each would pin them again):
    fixed_error and GpuReader.degraded say why; a small pool still is."""
    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    code = (
        "from lmcache_fx import _fxio, gpu\n"
        "eng = _fxio.Engine('io_uring', 128, 1 << 20)\n"  # the store's engine (a read per slot): its rings
        "rd = gpu.GpuReader(device=0, engine=eng, slots=65, slot_bytes=4 << 20, io_engine='io_uring')\n"
        "print('FIXED', rd.staging.fixed_buffers, rd.degraded)\n"
        "rd.close()\n"
        "small = gpu.GpuReader(device=0, engine=eng, slots=2, slot_bytes=1 << 20, io_engine='io_uring')\n"
        "print('SMALL', small.staging.fixed_buffers)\n"
    )
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=fake_gpu_driver_so, LMCACHE_FX_FAULT="no_clone:1000")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    line = [x for x in out.stdout.splitlines() if x.startswith("FIXED")][0]
    assert line.startswith("FIXED False") and "before 6.12" in line, line
    assert [x for x in out.stdout.splitlines() if x.startswith("SMALL")] == ["SMALL True"], out.stdout


def test_primary_context_released_with_the_device_handle(drv):
    """cuDevicePrimaryCtxRelease takes the CUdevice from cuDeviceGet, not the
    ordinal (the stand-in's handles are 100 + ordinal)."""
    before = drv.fake_gpu_ctx_refs()
    g = _fxio.GpuStaging(slots=2, slot_bytes=MiB)
    assert drv.fake_gpu_ctx_refs() == before + 1
    g.close()
    assert drv.fake_gpu_ctx_refs() == before


def _hip_child(code, loaded, fresh, preload):
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_FX_GPU_DRIVER"}
    env["LD_LIBRARY_PATH"] = fresh
    env["PYTHONPATH"] = ROOT
    pre = f"import ctypes; ctypes.CDLL({os.path.join(loaded, 'libamdhip64.so.6')!r})\n" if preload else ""
    out = subprocess.run(
        [sys.executable, "-c", pre + code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])


HIP_CHILD = r"""
import ctypes, json, os
from lmcache_fx import _fxio
info = _fxio.gpu_driver()
out = {"info": info}
if info["api"] == "hip":
    lib = ctypes.CDLL(info["path"])  # the loaded runtime: the same handle
    lib.fake_gpu_stream_new.restype = ctypes.c_void_p
    lib.fake_gpu_stream_sync.argtypes = [ctypes.c_void_p]
    lib.fake_gpu_kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_size_t, ctypes.c_uint]
    lib.fake_gpu_set_delay_us(300)
    data = os.urandom(3 << 20)
    p = os.path.join(os.environ["TMPDIR_T"], "h.bin")
    open(p, "wb").write(data)
    g = _fxio.GpuStaging(slots=2, slot_bytes=1 << 20)
    B, C = _fxio.HostBuffer(3 << 20), _fxio.HostBuffer(3 << 20)
    memoryview(B)[:] = b"\x33" * (3 << 20)
    S = lib.fake_gpu_stream_new()
    lib.fake_gpu_kernel(S, C.address, B.address, 0, 3 << 20, 100000)
    fd = os.open(p, os.O_RDONLY)
    out["res"] = g.read([(fd, 1, (3 << 20) - 1, B.address)], stream=S)
    lib.fake_gpu_stream_sync(S)
    lib.fake_gpu_reset()
    lib.fake_gpu_fail_copy(1, 0)
    out["bad"] = g.read([(fd, 0, 4096, C.address + 4096)])
    out["bad_error"] = g.last_error
    os.close(fd)
    lib.fake_gpu_stream_sync(S)
    out["ordered"] = bytes(C) == b"\x33" * (3 << 20)
    out["exact"] = bytes(memoryview(B)[:(3 << 20) - 1]) == data[1:]
    out["pinned"], out["driver"] = g.pinned, g.driver
    g.close()
print(json.dumps(out))
"""


def test_hip_binds_the_runtime_already_loaded(fake_hip_driver_dirs, tmp_path):
    """The HIP branch, against the stand-in built as libamdhip64: with a
    runtime already loaded (as torch would have: .so.6, 1 device), that one is
    used even though a fresh dlopen would find others (.so and .so.7, 3
    devices) on LD_LIBRARY_PATH; copies, stream order and error names go
    through the hip* calls."""
    loaded, fresh = fake_hip_driver_dirs
    os.environ["TMPDIR_T"] = str(tmp_path)
    try:
        out = _hip_child(HIP_CHILD, loaded, fresh, preload=True)
    finally:
        del os.environ["TMPDIR_T"]
    want = {"api": "hip", "path": "libamdhip64.so.6", "devices": 1, "error": None}
    assert out["info"] == {**want, "found": "libamdhip64.so.6", "found_api": "hip"}, out
    assert out["res"] == [(3 << 20) - 1] and out["exact"] and out["ordered"] and out["pinned"], out
    assert out["bad"] == [-errno.EIO] and "hipMemcpyHtoDAsync failed: hipErrorInvalidValue (1)" in out["bad_error"]


def test_hip_fresh_load_prefers_versioned_names(fake_hip_driver_dirs):
    loaded, fresh = fake_hip_driver_dirs
    out = _hip_child(
        "import json; from lmcache_fx import _fxio; print(json.dumps({'info': _fxio.gpu_driver()}))",
        loaded,
        fresh,
        preload=False,
    )
    assert out["info"]["api"] == "hip" and out["info"]["path"] == "libamdhip64.so.7", out


def test_hip_found_on_a_rocm5_runtime_only_host(fake_hip_driver_dirs, tmp_path):
    """A ROCm 5.x host without the -dev package has libamdhip64.so.5 and no
    bare libamdhip64.so: the search list lacked .so.5, so such a host found
    no GPU runtime at all."""
    import shutil

    from conftest import _build_fake_gpu_driver

    loaded, _ = fake_hip_driver_dirs
    only5 = tmp_path / "rocm5"
    only5.mkdir()
    _build_fake_gpu_driver(str(only5 / "libamdhip64.so.5"), "-DFAKE_HIP", soname="libamdhip64.so.5")
    assert shutil.which("gcc") and sorted(os.listdir(only5)) == ["libamdhip64.so.5"]
    out = _hip_child(
        "import json; from lmcache_fx import _fxio; print(json.dumps({'info': _fxio.gpu_driver()}))",
        loaded,
        str(only5),
        preload=False,
    )
    assert out["info"]["api"] == "hip" and out["info"]["path"] == "libamdhip64.so.5", out


FORK_CHILD = r"""
import ctypes, os, sys, threading, time
from lmcache_fx import _fxio
lib = ctypes.CDLL(os.environ["LMCACHE_FX_GPU_DRIVER"])
lib.fake_gpu_set_delay_us(30000)
path = sys.argv[1]
g = _fxio.GpuStaging(slots=2, slot_bytes=1 << 20, io_engine=sys.argv[2])
# MADV_DONTFORK on the staging memory: "dc" in its VmFlags
smaps, cur, dc = open("/proc/self/smaps").read().splitlines(), None, None
for line in smaps:
    f = line.split()
    if "-" in f[0] and len(f) >= 5 and ":" not in f[0]:
        a, b = (int(x, 16) for x in f[0].split("-"))
        cur = a <= g.address < b
    elif f[0] == "VmFlags:" and cur:
        dc = "dc" in f[1:]
print("DONTFORK", dc, flush=True)
dev = _fxio.HostBuffer(8 << 20)
fd = os.open(path, os.O_RDONLY)
res = {}
t = threading.Thread(target=lambda: res.setdefault("r", g.read([(fd, 0, 8 << 20, dev.address)])))
t.start()
time.sleep(0.1)  # a read in progress in this thread: the pool's lock held at fork
pid = os.fork()
if pid == 0:
    code = 5
    try:
        g.read([(fd, 0, 4096, dev.address)])
        code = 3
    except RuntimeError as e:
        code = 0 if "fork" in str(e) and g.forked else 4
    g.close()
    del g
    os._exit(code)
_, st = os.waitpid(pid, 0)
t.join()
print("CHILD", os.waitstatus_to_exitcode(st), flush=True)
print("PARENT", res["r"], g.read([(fd, 0, 4096, dev.address)]), g.forked, flush=True)
g.close()
"""


@pytest.mark.parametrize("io_engine", ["threads", "io_uring"])
def test_fork_child_gets_an_error_not_a_hang(fake_gpu_driver_so, datafile, io_engine):
    if io_engine == "io_uring" and not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    path, _ = datafile
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=fake_gpu_driver_so, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FORK_CHILD, path, io_engine],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "DONTFORK True" in out.stdout
    assert "CHILD 0" in out.stdout, out.stdout  # a RuntimeError naming fork(), no hang
    assert f"PARENT [{8 << 20}] [4096] False" in out.stdout  # the parent's pool unaffected


def test_numa_node_lookup(tmp_path):
    root = tmp_path / "sys"
    for bus, node in (("0000:3b:00.0", "1\n"), ("0000:af:00.0", "-1\n"), ("0001:02:03.4", "3")):
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node)
    assert _fxio.gpu_numa_node("0000:3B:00.0", str(root)) == 1  # CUDA's upper case
    assert _fxio.gpu_numa_node("00000000:3b:00.0", str(root)) == 1  # 8-digit domain (nvidia-smi)
    assert _fxio.gpu_numa_node("0001:02:03.4", str(root)) == 3
    assert _fxio.gpu_numa_node("0000:AF:00.0", str(root)) == -1  # the kernel knows no node
    assert _fxio.gpu_numa_node("0000:01:00.0", str(root)) == -1  # no such device
    assert _fxio.gpu_numa_node("garbage", str(root)) == -1


def test_staging_bound_to_the_gpus_node(drv, tmp_path):
    d = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:fa:1e.0"  # the stand-in's bus id
    d.mkdir(parents=True)
    (d / "numa_node").write_text("0\n")
    g = _fxio.GpuStaging(slots=2, slot_bytes=MiB, numa_sysfs=str(tmp_path / "sys"))
    if "mbind failed" in g.numa_info:
        pytest.skip(g.numa_info)
    assert g.numa_node == 0 and "node 0: staging placed there" in g.numa_info
    best = None
    for line in open("/proc/self/numa_maps"):
        start = int(line.split()[0], 16)
        if start <= g.address and (best is None or start > best[0]):
            best = (start, line)
    assert best and "prefer:0" in best[1], best
    g.close()
    g = _fxio.GpuStaging(slots=2, slot_bytes=MiB, numa_sysfs=str(tmp_path / "nothing"))
    assert g.numa_node == -1 and "0000:FA:1E.0" in g.numa_info and "not placed" in g.numa_info
    g.close()


def test_device_cuda_means_the_current_device(monkeypatch):
    torch = pytest.importorskip("torch")
    from lmcache_fx import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert gpu._device_index("cuda") == 3 and gpu._device_index(torch.device("cuda")) == 3
    assert gpu._device_index(None) == 3
    assert gpu._device_index("cuda:1") == 1 and gpu._device_index(torch.device("cuda", 2)) == 2
    assert gpu._device_index(0) == 0


def test_chunk_allocator_close_drops_the_buffer_at_once(drv):
    pytest.importorskip("lmcache")
    import gc
    import weakref

    from lmcache_fx import gpu

    a = gpu.GpuChunkAllocator(8 * MiB, device=0, slots=2, slot_bytes=MiB, memory_device="cpu")
    ref = weakref.ref(a.allocator.tensor)
    gc.disable()
    try:
        a.close()
        assert ref() is None  # freed by close(), not left for the garbage collector
    finally:
        gc.enable()
    assert a.allocate([__import__("torch").Size([4096])], [__import__("torch").uint8]) is None


def test_freeing_a_chunk_waits_for_a_cancelled_read(drv, datafile):
    """An awaited GPU read cancelled mid-way leaves its thread writing into the
    chunks; LMCache then frees them: the free waits for that thread (and only
    for a read into the freed memory)."""
    pytest.importorskip("lmcache")
    import torch

    from lmcache_fx import gpu

    path, data = datafile
    drv.fake_gpu_set_delay_us(25000)  # 8 copies: ~200 ms
    a = gpu.GpuChunkAllocator(16 * MiB, device=0, slots=2, slot_bytes=MiB, memory_device="cpu")
    eng = _fxio.Engine("threads")
    router = gpu.GpuRouter(eng, a.reader, a.owns)
    obj = a.allocate([torch.Size([8 * MiB])], [torch.uint8])
    other = a.allocate([torch.Size([MiB])], [torch.uint8])
    fd = os.open(path, os.O_RDONLY)
    try:
        b = router.submit([(fd, 0, 8 * MiB, obj.data_ptr)])
        time.sleep(0.03)
        assert not b.done()
        other.ref_count_down()  # memory the read does not touch: freed at once
        assert not b.done()
        obj.ref_count_down()  # what LMCache does after the cancelled await
        assert b.done()  # the free returned only after the read's thread ended
        assert b.wait() == [8 * MiB]
    finally:
        os.close(fd)
        a.close()
        eng.close()


def test_a_routed_reads_reason_is_its_own_beside_other_threads_reads(drv, datafile, monkeypatch):
    """GpuRouter logged reader.last_error read after its read returned: a
    read of another thread on the same reader had cleared or replaced it by
    then (reasons lost, one torn by a write under way). read(why=True) hands
    each read its own; the last_error attribute is copied under a lock."""
    from lmcache_fx import gpu

    path, _ = datafile
    fd = os.open(path, os.O_RDONLY)
    r_pipe, w_pipe = os.pipe()
    eng = _fxio.Engine("threads", 8)
    rd = gpu.GpuReader(engine=eng, device=0, slots=2, slot_bytes=MiB, warn=False)
    router = gpu.GpuRouter(eng, rd, lambda a: True)
    good, bad = ctypes.create_string_buffer(MiB), ctypes.create_string_buffer(4096)
    logged = []
    monkeypatch.setattr(gpu, "log_once", lambda log, key, level, fmt, *a: logged.append(a[0]))
    stop = threading.Event()

    def others():
        while not stop.is_set():
            assert router.read([(fd, 0, MiB, ctypes.addressof(good))]) == [MiB]

    t = threading.Thread(target=others)
    t.start()
    try:
        fails = sum(router.read([(r_pipe, 0, 4096, ctypes.addressof(bad))])[0] < 0 for _ in range(200))
    finally:
        stop.set()
        t.join()
        os.close(fd)
        os.close(r_pipe)
        os.close(w_pipe)
        rd.close()
        eng.close()
    assert fails == 200 and len(logged) == 200, (fails, len(logged))
    assert all(w and "\x00" not in w and "Illegal seek" in w for w in logged), set(logged)


# ------------------------------------------------------------------ CRC32C in the staging slots
@pytest.mark.parametrize("io_engine", ["io_uring", "threads"])
def test_crc_per_op_computed_in_staging(drv, datafile, io_engine):
    """read(..., crc=True) gives (bytes, CRC32C) per op as Engine.read does:
    pieces checksummed in their slots, combined in file order (ops of many
    pieces, unaligned, empty, past EOF); crc=False keeps plain ints."""
    if io_engine == "io_uring" and not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    path, data = datafile
    drv.fake_gpu_set_delay_us(100)
    g = _fxio.GpuStaging(slots=3, slot_bytes=MiB, io_engine=io_engine)
    dev = _fxio.HostBuffer(len(data) + 4 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        spec = [(0, 7 * MiB + 5), (7 * MiB + 5, 1), (3, 0), (9 * MiB + 4097, 5 * MiB + 123), (len(data) - 1000, 5000)]
        ops, pos = [], 0
        for off, n in spec:
            ops.append((fd, off, n, dev.address + pos))
            pos += n if off + n <= len(data) else len(data) - off
            pos += 4096
        res = g.read(ops, crc=True)
        plain = g.read(ops)
        bad = g.read([(fd, 0, 4096, dev.address), (999999, 0, 4096, dev.address)], crc=True, cancel_on_error=False)
    finally:
        os.close(fd)
    want = [(len(data[off : off + n]), _fxio.crc32c(data[off : off + n])) for off, n in spec]
    assert res == want, g.last_error
    assert plain == [w[0] for w in want]
    assert bad[0] == (4096, _fxio.crc32c(data[:4096])) and bad[1][0] == -errno.EBADF
    g.close()


def test_crc_on_odirect_unaligned(drv, odirect_tmp):
    data = os.urandom(6 * MiB + 777)
    p = odirect_tmp / "d.bin"
    p.write_bytes(data)
    g = _fxio.GpuStaging(slots=2, slot_bytes=MiB)
    dev = _fxio.HostBuffer(len(data) + 8192)
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        res = g.read(
            [(fd, 11, 4 * MiB + 3, dev.address + 1), (fd, 4 * MiB + 14, 4 * MiB, dev.address + 5 * MiB)], crc=True
        )
    finally:
        os.close(fd)
    assert res == [
        (4 * MiB + 3, _fxio.crc32c(data[11 : 4 * MiB + 14])),
        (len(data) - 4 * MiB - 14, _fxio.crc32c(data[4 * MiB + 14 :])),
    ], g.last_error
    g.close()


def test_reader_returns_crcs_and_catches_damage_between_read_and_copy(drv, datafile):
    """GpuReader.read_into(crc=True): the CRC is of the bytes the GPU got; a
    file damaged between two reads gives another CRC for the same length
    (what makes the store's verify turn it into a miss)."""
    from lmcache_fx.gpu import GpuReader

    path, data = datafile
    rd = GpuReader(device=0, slots=2, slot_bytes=MiB, io_engine="threads", warn=False)
    dev = _fxio.HostBuffer(4 * MiB)
    fd = os.open(path, os.O_RDWR)
    try:
        good = rd.read_into([(fd, 4096, 3 * MiB, dev.address)], crc=True)
        os.pwrite(fd, bytes([data[2 * MiB] ^ 1]), 2 * MiB)
        damaged = rd.read_into([(fd, 4096, 3 * MiB, dev.address)], crc=True)
    finally:
        os.close(fd)
    assert good == [(3 * MiB, _fxio.crc32c(data[4096 : 4096 + 3 * MiB]))]
    assert damaged[0][0] == 3 * MiB and damaged[0][1] != good[0][1]
    assert damaged[0][1] == _fxio.crc32c(bytes(memoryview(dev)[: 3 * MiB]))
    rd.close()


# ------------------------------------------------------------------ signals and io_uring faults
SIGNAL_STORM = r"""
import ctypes, os, signal, sys, threading, time
from lmcache_fx import _fxio
path, io_engine = sys.argv[1], sys.argv[2]
lib = ctypes.CDLL(os.environ["LMCACHE_FX_GPU_DRIVER"])
lib.fake_gpu_set_delay_us(300)
data = open(path, "rb").read()
want = [(len(data), _fxio.crc32c(data))]
handled = [0]
signal.signal(signal.SIGUSR1, lambda *a: handled.__setitem__(0, handled[0] + 1))
main, stop, sent = threading.main_thread().ident, threading.Event(), [0]
def storm():
    while not stop.is_set():
        signal.pthread_kill(main, signal.SIGUSR1)
        sent[0] += 1
        time.sleep(0.0001)
g = _fxio.GpuStaging(slots=4, slot_bytes=1 << 20, io_engine=io_engine)
dev = _fxio.HostBuffer(len(data) + 4096)
fd = os.open(path, os.O_RDONLY)
t = threading.Thread(target=storm, daemon=True)
t.start()
rounds = bad = 0
t0 = time.monotonic()
while rounds < 6 or time.monotonic() - t0 < 2:
    ctypes.memset(dev.address, 0, len(data))
    res = g.read([(fd, 0, len(data) + 4096, dev.address)], crc=True)
    rounds += 1
    bad += res != want or bytes(memoryview(dev)[:len(data)]) != data
stop.set()
t.join()
g.close()
print("STORM", rounds, bad, sent[0], handled[0], flush=True)
"""


@pytest.mark.parametrize("io_engine", ["io_uring", "threads"])
def test_signal_storm_during_large_reads(fake_gpu_driver_so, datafile, io_engine):
    """A thread sends SIGUSR1 (a Python handler, so no SA_RESTART) to the
    thread inside read() every ~0.1 ms: interrupted waits are retried, every
    read is whole and bit-exact with the right CRC, nothing hangs."""
    if io_engine == "io_uring" and not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    path, _ = datafile
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=fake_gpu_driver_so, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", SIGNAL_STORM, path, io_engine],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("STORM")][0].split()
    rounds, bad, sent, handled = map(int, line[1:])
    assert rounds >= 6 and bad == 0, line
    assert sent > 1000 and handled > 0, line


FAULTS = r"""
import json, os, sys
from lmcache_fx import _fxio
path, spec = sys.argv[1], sys.argv[2]
os.environ["LMCACHE_FX_FAULT"] = spec
eng = _fxio.Engine(io_engine="io_uring", queue_depth=8)  # arms the fault points
data = open(path, "rb").read()
g = _fxio.GpuStaging(slots=4, slot_bytes=1 << 20, engine=eng)
dev = _fxio.HostBuffer(len(data))
fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if sys.argv[3] == "direct" else 0))
out = {"io": g.io}
res = g.read([(fd, 0, 9 << 20, dev.address), (fd, 9 << 20, len(data), dev.address + (9 << 20))], crc=True,
             trace=True)
tr = g.last_trace()
out["first"] = {"res": res, "error": g.last_error, "submitted": sum(e[1] == "read_submit" for e in tr),
                "landed": sum(e[1] == "read_done" for e in tr),
                "exact": [r[0] > 0 and r[1] == _fxio.crc32c(data[o:o + r[0]]) for r, o in zip(res, (0, 9 << 20))]}
out["fired"] = _fxio._fault_counts()
res = g.read([(fd, 0, len(data), dev.address)], crc=True)
out["second"] = {"ok": res == [(len(data), _fxio.crc32c(data))] and bytes(dev) == data, "error": g.last_error}
g.close()
eng.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def _faults(so, path, spec, mode="buffered"):
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=so, PYTHONPATH=ROOT)
    env.pop("LMCACHE_FX_FAULT", None)
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, path, spec, mode], env=env, capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[0][7:])


@pytest.mark.parametrize("mode", ["buffered", "direct"])
def test_interrupted_waits_and_reads_are_retried(fake_gpu_driver_so, datafile, request, mode):
    """The engine's fault points reach the pipeline's ring: waits that return
    EINTR, reads that complete with EINTR / EAGAIN, and short reads (O_DIRECT:
    ending off the block grid, not at EOF) are retried; the data and its CRC
    are exact."""
    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    path = datafile[0]
    if mode == "direct":
        path = str(request.getfixturevalue("odirect_tmp") / "d.bin")
        with open(path, "wb") as f:
            f.write(datafile[1])
    out = _faults(fake_gpu_driver_so, path, "wait_eintr:300,eintr:7,eagain:7,short:9", mode)
    assert out["io"] == "io_uring"
    fired = out["fired"]
    assert fired["wait_eintr"] > 10 and (fired["eintr"], fired["eagain"], fired["short"]) == (7, 7, 9), out
    assert out["first"]["exact"] == [True, True] and out["first"]["error"] is None, out
    assert out["second"]["ok"], out


def test_failed_submission_reaps_every_read_in_flight(fake_gpu_driver_so, datafile):
    """The ring fails after the kernel took the reads (submit_fail), and the
    waits that reap them are interrupted (wait_eintr): every read submitted
    is reaped before read() returns -- none still lands in a slot the next
    read or close() reuses -- the ops fail with -EIO, and the pool stays
    usable (nothing was left unsubmitted in the ring)."""
    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    out = _faults(fake_gpu_driver_so, datafile[0], "submit_fail:1,wait_eintr:200")
    f = out["first"]
    assert out["fired"]["submit_fail"] == 1 and out["fired"]["wait_eintr"] > 0, out
    assert [r[0] for r in f["res"]] == [-errno.EIO, -errno.EIO] and "io_uring failed" in f["error"], out
    assert f["submitted"] == f["landed"] > 0, out  # every read in flight was reaped
    assert out["second"]["ok"] and out["second"]["error"] is None, out


FORK_API = r"""
import os, sys
from lmcache_fx import _fxio
from lmcache_fx.gpu import GpuReader, GpuRouter
path = sys.argv[1]
rd = GpuReader(device=0, slots=2, slot_bytes=1 << 20, io_engine=sys.argv[2], warn=False)
eng = _fxio.Engine(io_engine="threads")
dev = _fxio.HostBuffer(1 << 20)
router = GpuRouter(eng, rd, lambda a: dev.address <= a < dev.address + len(dev))
fd = os.open(path, os.O_RDONLY)
op = [(fd, 0, 4096, dev.address)]
assert rd.read_into(op) == [4096]
pid = os.fork()
if pid == 0:
    calls = {"read_into": lambda: rd.read_into(op), "staging.read": lambda: rd.staging.read(op),
             "last_stats": rd.staging.last_stats, "last_trace": rd.staging.last_trace,
             "trace": rd.trace, "router.read": lambda: router.read(op, crc=True),
             "router.submit": lambda: router.submit(op)}
    bad = []
    for name, fn in calls.items():
        try:
            fn()
            bad.append(name + ": no error")
        except RuntimeError as e:
            if "fork" not in str(e):
                bad.append(name + ": " + str(e))
    rd.close()  # forgets the parent's resources: no hang, no error
    print("CHILD", bad, rd.forked, flush=True)
    os._exit(0 if not bad else 3)
_, st = os.waitpid(pid, 0)
print("EXIT", os.waitstatus_to_exitcode(st), rd.read_into(op, crc=True)[0][0], rd.forked, flush=True)
rd.close()
"""


@pytest.mark.parametrize("io_engine", ["threads", "io_uring"])
def test_every_call_in_a_forked_child_names_fork(fake_gpu_driver_so, datafile, io_engine):
    if io_engine == "io_uring" and not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=fake_gpu_driver_so, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", FORK_API, datafile[0], io_engine],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CHILD [] True" in out.stdout, out.stdout
    assert "EXIT 0 4096 False" in out.stdout, out.stdout  # the parent's reader unaffected


def test_gpu_check_script_on_the_stand_in(tmp_path):
    """scripts/gpu_check.py --stand-in --json: every phase that can run on a
    CPU host runs against the stand-in, and the report names each phase and
    its outcome."""
    pytest.importorskip("lmcache")
    report = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_FX_GPU_DRIVER"}
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "gpu_check.py"),
            "--stand-in",
            "--json",
            str(report),
            "--dir",
            str(tmp_path / "d"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=400,
    )
    rep = json.loads(report.read_text())
    assert out.returncode == 0, (out.stdout[-3000:], json.dumps(rep["phases"], default=str)[-3000:])
    # What produced it, so a page quoting it can be held to a commit (the H200 runs' JSONs had neither).
    assert rep["command"].startswith("python scripts/gpu_check.py --stand-in") and rep["git_commit"], rep.get("command")
    ph = rep["phases"]
    assert list(ph) == ["environment", "driver", "correctness", "errors", "ordering", "throughput", "lmcache"]
    assert all(p["outcome"] == "pass" for p in ph.values()), {k: (v["outcome"], v.get("why")) for k, v in ph.items()}
    assert "fake_gpu_driver" in ph["environment"]["driver_info"]["path"]
    assert ph["driver"]["pinned"] and ph["driver"]["context_unchanged"] and ph["driver"]["degraded"] is None
    c = ph["correctness"]
    assert any(k.startswith("threads/") for k in c) and all(
        all(v is not False for v in r.values()) for k, r in c.items() if "/" in k
    )
    assert all(ph["errors"][k]["ok"] for k in ("bad_fd", "past_allocation", "close_during_read", "cycles"))
    assert ph["ordering"]["clone_holds_old_bytes"] and ph["ordering"]["sync_false_seen_by_later_work"]
    assert ph["throughput"]["pipeline"] and ph["throughput"]["best"]["ok"]
    lm = ph["lmcache"]
    assert lm["direct_to_gpu"]["ok"] and lm["direct_to_gpu"]["buffer_free_after"] and lm["cpu_tier"]["ok"]
    # the control: LMCache alone through the same connector gives back what it stored
    assert lm["lmcache_alone"]["ok"] and lm["lmcache_alone"]["equal_share"] == 1.0
    assert lm["cpu_tier"]["equal_share"] == 1.0 and "LMCache alone" not in (lm["why"] or "")
    assert rep["failed"] == [] and not rep.get("timed_out")


def test_check_retrieves_into_the_caches_a_connector_keeps(tmp_path):
    """The H200 run's LMCache phase came back all zeros, with and without fx:
    LMCache's CUDA connector keeps the first KV caches it is given, and the
    check retrieved into new tensors. Against a CPU connector that keeps its
    first caches the same way, a retrieve into new tensors finds nothing
    there, and the check's retrieve_in_place (into the same tensors, zeroed
    first) gets every value back."""
    import importlib.util

    import torch

    from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, lmcache_engine, retrieve

    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "scripts", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    geo = Geometry(layers=2, kv_heads=2, head_dim=64)
    cfg = config_from_dict({"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.5}, tmp_path)
    tokens = torch.arange(512) % 30000
    kv = KV(geo, 512, seed=3)
    with lmcache_engine(cfg, geo, keep_first_caches=True) as eng:
        eng.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
        got = kv.empty_like()
        assert retrieve(eng, tokens, got) == 512 and kv.equal_share(got, 512) < 0.01  # the first run's symptom
        n, equal, share = gpu_check.retrieve_in_place(eng, tokens, kv, retrieve)
    assert (n, equal, share) == (512, True, 1.0)


def test_kv_equal_share_counts_the_values_that_came_back():
    """The check's measure of a retrieve: the share of the stored tokens'
    values found again, 1.0 for a copy, lower for a damaged one, near 0 for
    an empty cache (what LMCache alone gave back on the H200 host)."""
    from lmcache_fx.testing.cpu_engine import KV, Geometry

    kv = KV(Geometry(layers=2, kv_heads=2, head_dim=8), 64, seed=1)
    same = kv.empty_like()
    same.caches = [c.clone() for c in kv.caches]
    assert kv.equal_share(same, 64) == 1.0 and kv.tokens_equal(same, 64)
    s = kv.slot_mapping[0]
    same.caches[1].view(2, -1, 16)[:, s] += 1  # one token of one layer changed
    share = kv.equal_share(same, 64)
    assert 0.99 < share < 1.0 and not kv.tokens_equal(same, 64)
    assert kv.equal_share(kv.empty_like(), 64) < 0.01


def test_reads_on_the_engines_rings_beside_its_registration(drv, datafile):
    """Given an io_uring Engine deep enough for its slots, the pipeline reads on
    the engine's rings: its slots are a second region of the engine's
    fixed-buffer table, beside a buffer the engine already registered (as the
    plugin registers LMCache's pool); both kinds of read stay bit-exact, closing
    the pool leaves the engine's registration working, and a pool whose engine
    was closed refuses to read."""
    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable")
    path, data = datafile
    eng = _fxio.Engine("io_uring", queue_depth=16, split_bytes=MiB)
    pool = _fxio.HostBuffer(8 * MiB)
    assert eng.register_buffer(pool.address, len(pool)) == 0 and eng.registered
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, engine=eng)
    assert g.io == "io_uring"
    assert g.fixed_buffers or g.fixed_error  # refused only for want of locked memory
    dev = _fxio.HostBuffer(len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(3):
            memoryview(dev)[:] = b"\0" * len(dev)
            assert g.read([(fd, 0, len(data), dev.address)]) == [len(data)], g.last_error
            assert bytes(memoryview(dev)) == data
            assert eng.read([(fd, 4096, 8 * MiB, pool.address)]) == [8 * MiB]
            assert bytes(memoryview(pool)) == data[4096 : 4096 + 8 * MiB]
        g.close()
        assert eng.registered
        assert eng.read([(fd, 0, 8 * MiB, pool.address)]) == [8 * MiB]
        assert bytes(memoryview(pool)) == data[: 8 * MiB]
        g2 = _fxio.GpuStaging(slots=2, slot_bytes=MiB, engine=eng)
        eng.close()
        with pytest.raises(OSError, match="engine is closed"):
            g2.read([(fd, 0, MiB, dev.address)])
        g2.close()
    finally:
        os.close(fd)


def test_thread_reader_on_the_thread_engines_pool(drv, datafile):
    """Given a thread Engine, the pipeline's reads run on the engine's pool
    (submit/reap beside its batches, which run at the same time), bit-exact;
    after the engine closed the pool refuses to read."""
    path, data = datafile
    eng = _fxio.Engine("threads", queue_depth=8, split_bytes=MiB)
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, engine=eng)
    assert g.io == "threads"
    dev = _fxio.HostBuffer(len(data))
    host = _fxio.HostBuffer(8 * MiB)
    fd = os.open(path, os.O_RDONLY)
    errors = []

    def batches():
        for _ in range(10):
            if eng.read([(fd, 4096, 8 * MiB, host.address)]) != [8 * MiB]:
                errors.append("batch")

    try:
        t = threading.Thread(target=batches)
        t.start()
        for _ in range(3):
            memoryview(dev)[:] = b"\0" * len(dev)
            assert g.read([(fd, 0, len(data), dev.address)], crc=True) == [(len(data), _fxio.crc32c(data))], (
                g.last_error
            )
            assert bytes(memoryview(dev)) == data
        t.join(60)
        assert not errors and bytes(memoryview(host)) == data[4096 : 4096 + 8 * MiB]
        eng.close()
        with pytest.raises(OSError, match="engine is closed"):
            g.read([(fd, 0, MiB, dev.address)])
        g.close()
    finally:
        os.close(fd)


def test_docs_gpu_h200_run_is_the_committed_json():
    """docs/gpu.md's account of the H200 run: every figure it quotes is the
    committed report's, every phase but the environment's (no NVMe) and
    LMCache's passed; fx's chunks were bit-exact in both modes, and the
    retrieve came back all zeros with LMCache alone too (lmcache_alone): the
    check's own fault, since mended (retrieve_in_place)."""
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        page = " ".join(f.read().split())
    with open(os.path.join(ROOT, "docs", "gpu-check-h200.json")) as f:
        run = json.load(f)
    with open(os.path.join(ROOT, "docs", "gpu-check-h200-lmcache.json")) as f:
        lm_run = json.load(f)
    ph = run["phases"]
    assert not run["stand_in"] and ph["environment"]["gpu"] == "NVIDIA H200"
    assert ph["environment"]["driver_version"] in page and ph["environment"]["torch"] in page
    assert {k: v["outcome"] for k, v in ph.items() if k != "lmcache"} == {
        "environment": "warn",
        "driver": "pass",
        "correctness": "pass",
        "errors": "pass",
        "ordering": "pass",
        "throughput": "pass",
    }
    assert ph["driver"]["fixed_buffers"] and ph["driver"]["bit_exact"]
    table = ph["driver"]["io_uring_pinned_table"]
    assert table["torch pin_memory (cudaHostAlloc)"] == 0 and table["cudaHostRegister'ed anonymous memory"] == 0
    assert table["O_DIRECT read into torch pinned memory"] == 64 << 20 and table["... bit-exact"]
    assert "CUDA_ERROR_INVALID_VALUE" in ph["errors"]["past_allocation"]["last_error"]
    tp = ph["throughput"]
    for v in (
        tp["fio_GBps"],
        tp["h2d_pinned_GBps"],
        tp["read_to_pinned_GBps"],
        tp["serial_read_then_copy_GBps"],
        tp["torch_double_buffer_GBps"],
        tp["best"]["GBps"],
        tp["pipeline_crc"]["GBps"],
        tp["efficiency"],
    ):
        assert f"{v:.2f}" in page, v
    assert f"{tp['best']['slots']} × {tp['best']['slot_MiB']} MiB" in page
    lm = lm_run["phases"]["lmcache"]
    assert not lm["lmcache_alone"]["ok"] and lm["lmcache_alone"]["equal_share"] < 1e-6
    assert "retrieve_in_place" in page and "_initialize_pointers" in page
    for case in ("direct_to_gpu", "cpu_tier"):
        c = lm[case]
        assert c["bit_exact"] == {"blocking": c["chunks"], "async": c["chunks"]} == {"blocking": 16, "async": 16}
        assert c["retrieve_tokens"] == c["ntok"] == 4096 and not c["retrieve_equal"]
    assert "LMCache alone" in lm["why"]


def test_docs_gpu_h200_lmcache_rerun_is_the_committed_json():
    """The LMCache phase, rerun on the H200 after the check was mended: every
    case's retrieve equal (LMCache alone, fx direct_to_gpu, fx as a CPU tier),
    fx's chunks bit-exact, on the real driver; the figures docs/gpu.md
    quotes are the report's."""
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        page = " ".join(f.read().split())
    with open(os.path.join(ROOT, "docs", "gpu-check-h200-lmcache-rerun.json")) as f:
        run = json.load(f)
    assert not run["stand_in"] and not run["failed"]
    assert run["phases"]["environment"]["gpu"] == "NVIDIA H200"
    lm = run["phases"]["lmcache"]
    assert lm["outcome"] == "pass"
    for case in ("lmcache_alone", "direct_to_gpu", "cpu_tier"):
        c = lm[case]
        assert c["ok"] and c["retrieve_equal"] and c["equal_share"] == 1.0, case
        assert c["retrieve_tokens"] == c["ntok"] == 4096, case
    for case in ("direct_to_gpu", "cpu_tier"):
        c = lm[case]
        assert c["bit_exact"] == {"blocking": 16, "async": 16} and c["chunks"] == 16, case
        assert f"{c['GBps_cold']:.2f}" in page and f"{c['p50_ms']:.0f}" in page, case
    assert lm["direct_to_gpu"]["direct_to_gpu"] and not lm["cpu_tier"]["direct_to_gpu"]
    assert "gpu-check-h200-lmcache-rerun.json" in page


def test_sync_false_copy_failing_after_return_is_reported_by_the_next_call(drv, datafile):
    """read(sync=False) returns with copies queued; one that then fails on
    the stream (as an illegal address does) was counted as copied. The next
    read raises, naming sync=False, instead of reading on as if the data were
    there (it was silently dropped), once; on a working context the reader
    reads again after that; close() after such a failure warns."""
    path, data = datafile
    n = 4 * MiB
    fd = os.open(path, os.O_RDONLY)
    try:
        for after in ("read", "close"):
            drv.fake_gpu_reset()
            drv.fake_gpu_set_delay_us(200000)  # the copies outlast the reads: all queued at return
            drv.fake_gpu_fail_copy(ctypes.c_long(2), 1)  # the 2nd copy is accepted, then fails
            g = _fxio.GpuStaging(slots=8, slot_bytes=MiB, io_engine="threads")
            B, D = _fxio.HostBuffer(n), _fxio.HostBuffer(n)
            res = g.read([(fd, 0, n, B.address)], sync=False, crc=True)
            assert res[0][0] == n  # queued, not known to have failed yet
            if after == "read":
                with pytest.raises(RuntimeError, match=r"read\(sync=False\) failed.*not in GPU memory"):
                    g.read([(fd, n, n, D.address)])
                assert g.read([(fd, n, n, D.address)]) == [-errno.EIO]  # reported once; the error sticks
                drv.fake_gpu_reset()  # a context that works again
                assert g.read([(fd, n, n, D.address)]) == [n], g.last_error
                assert bytes(memoryview(D)) == data[n : 2 * n]
                g.close()
            else:
                with pytest.warns(RuntimeWarning, match=r"read\(sync=False\) failed"):
                    g.close()
            assert bytes(memoryview(B)) != data[:n]  # what it had reported as copied was not all there
    finally:
        os.close(fd)


def test_failed_copy_gives_no_crc(drv, datafile):
    """crc=True on an op whose copy failed: the byte count is -EIO and the
    CRC 0, not the CRC of the bytes in the staging slot (they never arrived)."""
    path, _ = datafile
    drv.fake_gpu_fail_copy(ctypes.c_long(2), 1)
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine="threads")
    B = _fxio.HostBuffer(4 * MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert g.read([(fd, 0, 4 * MiB, B.address)], crc=True) == [(-errno.EIO, 0)]
    finally:
        os.close(fd)
        g.close()


def test_dropped_reader_tears_down_without_holding_the_gil(drv, datafile):
    """A GpuStaging dropped without close() (copies of a read(sync=False)
    still running) waits for them in its deallocator: with the GIL released,
    as close() does, so other Python threads run meanwhile."""
    path, _ = datafile
    n = 4 * MiB
    drv.fake_gpu_set_delay_us(100000)  # 4 copies x 100 ms after the read returns
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    fd = os.open(path, os.O_RDONLY)
    try:
        g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine="threads")
        B = _fxio.HostBuffer(n)
        assert g.read([(fd, 0, n, B.address)], sync=False) == [n]
        before = ticks[0]
        del g  # waits for the copies
        assert ticks[0] - before >= 20  # ~300 ms of teardown: the spinning thread ran (it stopped at ~1 before)
    finally:
        stop.set()
        t.join()
        os.close(fd)


def test_op_end_beyond_the_largest_offset_is_refused(drv, datafile):
    """An op whose offset + length wraps when an O_DIRECT read rounds it up
    to a block read nothing and reported 0 bytes, no error; it is refused."""
    path, _ = datafile
    g = _fxio.GpuStaging(slots=2, slot_bytes=MiB, io_engine="threads")
    B = _fxio.HostBuffer(MiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        big = (1 << 63) - 1
        with pytest.raises(ValueError, match="beyond the largest file offset"):
            g.read([(fd, big, big, B.address)])
    finally:
        os.close(fd)
        g.close()


def test_failed_init_keeps_no_reference_to_the_engine(drv):
    """io_engine='io_uring' with a thread engine fails; the engine it had
    taken is given back, so __init__ again on the object leaks nothing."""
    e = _fxio.Engine(io_engine="threads")
    before = sys.getrefcount(e)
    g = _fxio.GpuStaging.__new__(_fxio.GpuStaging)
    for _ in range(3):
        with pytest.raises(OSError, match="io_engine='io_uring'"):
            g.__init__(slots=2, slot_bytes=MiB, engine=e, io_engine="io_uring")
    assert sys.getrefcount(e) == before
    del g
    assert sys.getrefcount(e) == before
    e.close()


def test_init_from_two_threads_builds_one_staging(drv):
    """As Engine's: a second __init__ while the first built without the GIL
    overwrote its staging memory, ring, stream and events (30 of 30 tries:
    30 fds and ~400 MB leaked). One call builds it now; the other is refused."""
    from test_engine_faults import _two_inits_at_once

    both, said, before, after = _two_inits_at_once(
        lambda: _fxio.GpuStaging.__new__(_fxio.GpuStaging),
        lambda g: g.__init__(slots=4, slot_bytes=1 << 20, io_engine="auto"),
    )
    assert both == 0 and said <= {
        "GpuStaging is already initialised",
        "GpuStaging is being initialised by another call",
    }
    assert after[0] == before[0], (before, after)
    assert drv.fake_gpu_pinned_bytes() == 0


E_INVALID_VALUE, E_INVALID_CONTEXT, E_ILLEGAL_ADDRESS = 1, 201, 700


@pytest.mark.parametrize("code", [E_ILLEGAL_ADDRESS, E_INVALID_VALUE])
def test_sync_false_that_cannot_order_the_callers_stream_judges_every_copy(drv, datafile, code):
    """read(sync=False) counted the copies still running as done before it
    ordered the caller's stream after them; where that order failed it
    waited for the stream, ignored what that said, and dropped the pending
    state. A GPU fault at that moment (after which every call returns it)
    then reported every byte, with the CRC of the staging slots, and no
    later call said otherwise. Each copy is now judged by its event there:
    a fault fails the op; an order refused for another reason waits, and
    the data is there on return."""
    path, data = datafile
    n = 6 * MiB
    fd = os.open(path, os.O_RDONLY)
    try:
        drv.fake_gpu_set_delay_us(20000)  # the copies outlast the reads: queued at the end of the read
        g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine="threads")
        B = _fxio.HostBuffer(n)
        drv.fake_gpu_fail_call(b"cuStreamWaitEvent", ctypes.c_long(2), code)  # 1st: the pipeline on ev_in
        res = g.read([(fd, 0, n, B.address)], sync=False, crc=True)
        assert "ordering the caller's stream after the copies failed" in g.last_error
        if code == E_ILLEGAL_ADDRESS:
            assert res == [(-errno.EIO, 0)], res
        else:
            assert res == [(n, _fxio.crc32c(data[:n]))]
            assert bytes(memoryview(B)) == data[:n]  # waited for: there at return
        drv.fake_gpu_reset()
        with warnings_as_errors():
            g.close()  # nothing left pending to report
    finally:
        os.close(fd)


class warnings_as_errors:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


@pytest.mark.parametrize("sync", [True, False])
def test_close_without_the_context_releases_nothing_bound_to_it(drv, datafile, sync):
    """close() whose context could not be made current went on with the
    teardown anyway: unregistering the pinned memory without a context
    (CUDA refuses it: the registration outlived the munmap, and the next
    pool at that address could not be pinned), and after a read(sync=False)
    freeing the staging memory under the copies still queued (the stand-in's
    stream then read freed pages; a GPU would DMA from them). Now nothing
    context-bound is called, the memory stays mapped, and close() says so
    once."""
    path, data = datafile
    n = 4 * MiB
    fd = os.open(path, os.O_RDONLY)
    try:
        g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine="threads")
        pinned = drv.fake_gpu_pinned_bytes()
        assert g.pinned and pinned > 0
        B = _fxio.HostBuffer(n)
        if not sync:
            drv.fake_gpu_set_delay_us(20000)
        res = g.read([(fd, 0, n, B.address)], sync=sync)
        assert res == [n]
        drv.fake_gpu_fail_call(b"cuCtxSetCurrent", ctypes.c_long(1), E_INVALID_CONTEXT)  # close()'s enter
        with pytest.warns(RuntimeWarning, match=r"context of device 0 could not be made current.*kept mapped") as w:
            g.close()
        assert len(w) == 1
        assert g.closed
        assert drv.fake_gpu_pinned_bytes() == pinned  # not unregistered without its context
        end = time.monotonic() + 10
        while bytes(memoryview(B)) != data[:n] and time.monotonic() < end:
            time.sleep(0.02)  # the queued copies read memory that is still there
        assert bytes(memoryview(B)) == data[:n]
        drv.fake_gpu_set_delay_us(0)
        g2 = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine="threads")
        assert g2.pinned, g2.pin_error
        g2.close()
    finally:
        os.close(fd)


def test_a_read_that_cannot_learn_the_callers_context_leaves_it_current(drv, datafile):
    """ctx_enter ignored a failing cuCtxGetCurrent and then 'restored' no
    context: the caller's thread lost its own (torch's, or another GPU's)
    after the read. The read now fails instead, and the context stays."""
    path, _ = datafile
    g = _fxio.GpuStaging(slots=4, slot_bytes=MiB, io_engine="threads")
    B = _fxio.HostBuffer(MiB)
    mine = ctypes.c_int(0)  # any address stands for a context in the stand-in
    drv.cuCtxSetCurrent(ctypes.byref(mine))
    fd = os.open(path, os.O_RDONLY)
    try:
        drv.fake_gpu_fail_call(b"cuCtxGetCurrent", ctypes.c_long(1), E_INVALID_VALUE)
        res = g.read([(fd, 0, MiB, B.address)])
        assert res[0] < 0, res
        cur = ctypes.c_void_p()
        drv.cuCtxGetCurrent(ctypes.byref(cur))
        assert cur.value == ctypes.addressof(mine)
        assert g.read([(fd, 0, MiB, B.address)]) == [MiB], g.last_error  # the next read works
        cur = ctypes.c_void_p()
        drv.cuCtxGetCurrent(ctypes.byref(cur))
        assert cur.value == ctypes.addressof(mine)
    finally:
        os.close(fd)
        drv.cuCtxSetCurrent(None)
        g.close()


def test_a_library_that_is_no_gpu_driver_is_named_so():
    """A library exporting neither API was reported as "symbol hipInit
    missing", as if it were a broken HIP runtime."""
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER="libm.so.6", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", "from lmcache_fx import _fxio; print(_fxio.gpu_driver()['error'])"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.strip() == "libm.so.6 exports neither cuInit nor hipInit: not a CUDA driver or HIP runtime library"
    )


def test_staging_on_its_own_ring_falls_back_where_io_uring_enter_is_refused(fake_gpu_driver_so, datafile):
    """A seccomp profile that allows io_uring_setup but refuses
    io_uring_enter: the engine's rings are tried with a NOP and fall back,
    but a GpuStaging on a ring of its own (no engine given, the default of
    GpuReader) was never tried, and every GPU read failed. It reads with its
    threads now, and the bytes arrive."""
    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable here to begin with")
    path, data = datafile
    child = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {os.path.join(HERE, "faults")!r})
        import fxfault
        fxfault.deny_io_uring(1, (426,))  # io_uring_enter only, EPERM
        from lmcache_fx import _fxio
        g = _fxio.GpuStaging(slots=4, slot_bytes=1 << 20)
        B = _fxio.HostBuffer(1 << 20)
        fd = os.open({path!r}, os.O_RDONLY)
        print("RESULT", g.io, g.read([(fd, 0, 1 << 20, B.address)]), bytes(memoryview(B)) == open({path!r}, "rb").read(1 << 20))
        print("WHY", g.io_error)
        g.close()
        from lmcache_fx.gpu import GpuReader
        r = GpuReader(slots=4, slot_bytes=1 << 20)
        print("DEGRADED", r.degraded)
        r.close()
        """
    )
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=fake_gpu_driver_so, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-3] == "RESULT threads [1048576] True", r.stdout
    # Why it reads on threads is kept, and the reader's warning says it.
    assert lines[-2] == "WHY io_uring_enter on the staging slots' ring failed: Operation not permitted", r.stdout
    assert lines[-1].startswith("DEGRADED ") and "io_uring_enter on the staging slots' ring failed" in lines[-1]
    assert "reads run on threads" in r.stderr, r.stderr[-2000:]


def test_a_staging_pipeline_where_no_thread_can_start_is_refused_not_hung(fake_gpu_driver_so):
    """Under a pids limit with no task to spare a GPU driver cannot start the
    threads a stream needs and refuses the stream (out of memory); the
    pipeline must say so at start. (The stand-in driver ignored its failed
    pthread_create and handed out a stream nothing would ever run: every
    synchronisation hung.)"""
    import pids_limit

    parent = pids_limit.cgroup_parent()
    if parent is None:
        pytest.skip(pids_limit.SKIP_REASON)
    code = pids_limit.CHILD_CODE + textwrap.dedent(
        f"""
        from lmcache_fx import _fxio
        with no_task_to_spare({parent!r}):
            try:
                _fxio.GpuStaging(slots=2, slot_bytes=1 << 20, io_engine="io_uring")
                said = None
            except Exception as e:
                said = type(e).__name__ + ": " + str(e)
        g = _fxio.GpuStaging(slots=2, slot_bytes=1 << 20, io_engine="io_uring")  # once the limit is lifted
        g.close()
        print("SAID", said)
        """
    )
    env = dict(os.environ, LMCACHE_FX_GPU_DRIVER=fake_gpu_driver_so)
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the pipeline hung under the pids limit")
    assert out.returncode == 0, out.stderr
    said = [x for x in out.stdout.splitlines() if x.startswith("SAID")][0]
    assert "stream create failed" in said, said
