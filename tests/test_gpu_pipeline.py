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
import os
import subprocess
import sys
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
        spec = [(0, 5 * MiB + 7), (5 * MiB + 7, 3), (5 * MiB + 10, 0), (5 * MiB + 10, 11 * MiB + 4093),
                (16 * MiB + 4103, 64 * MiB)]
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
    for (off, n), w, got in zip(spec, where, want):
        assert bytes(mv[w:w + got]) == data[off:off + got]
        assert bytes(mv[w + got:w + got + 4096]) == b"\xee" * 4096  # nothing written past the op
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
            assert (a, b) in {("read_submit", "read_done"), ("read_done", "copy_issue"),
                              ("copy_issue", "copy_done"), ("copy_done", "read_submit"),
                              ("read_done", "read_submit")}, kinds
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
    assert bytes(memoryview(dev)[:16 * MiB]) == data[:16 * MiB]
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
        for s, end in prior:
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
        ops = [(fd, 0, 4 * MiB, dev.address), (wfd, 0, MiB, dev.address + 5 * MiB),
               (fd, 4 * MiB, 8 * MiB, dev.address + 7 * MiB)]
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
        assert bytes(m[7 * MiB:15 * MiB]) == data[4 * MiB:12 * MiB]
    if res[0] == 4 * MiB:
        assert bytes(memoryview(dev)[:4 * MiB]) == data[:4 * MiB]
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
                assert bytes(memoryview(dev)[i * 2 * MiB:(i + 1) * 2 * MiB]) == data[i * 2 * MiB:(i + 1) * 2 * MiB]
        _check_drained(g, drv)
        # the pool is usable again once the driver is (sticky error cleared)
        drv.fake_gpu_reset()
        res = g.read(ops)
        assert res == [2 * MiB] * 8 and g.last_error is None
        assert bytes(memoryview(dev)[:16 * MiB]) == data[:16 * MiB]
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
    assert bytes(m[5:5 + 3 * MiB]) == data[1:3 * MiB + 1]
    assert bytes(m[3 * MiB + 8:3 * MiB + 8 + res[1]]) == data[3 * MiB + 1:]
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
    code = ("from lmcache_fx import _fxio\n"
            "i = _fxio.gpu_driver(); assert i['api'] is None and 'nonexistent' in i['error'], i\n"
            "try:\n  _fxio.GpuStaging()\nexcept OSError as e:\n  print('OSError', e)\n")
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
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "safetensors_to_gpu.py"),
                          "--make-demo", str(st), "--device", "cpu"],
                         capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    assert out.returncode == 0, out.stderr + out.stdout
    assert "bit-exact: yes" in out.stdout
