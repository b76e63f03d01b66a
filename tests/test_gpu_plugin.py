"""The plugin's direct_to_gpu mode: options, the refusal on a host without a
GPU, and GPU-resident chunks through LMCache with the stand-in driver.

The driver is loaded once per process, so every test that needs a given
driver (none, the stand-in) runs in a child process: this file run as a
script (`python tests/test_gpu_plugin.py <scenario> <args>`). The stand-in
(tests/fake_gpu_driver.c) copies with memcpy on a worker thread, so its
"device pointers" are host addresses: the plugin's chunk buffer is put on
the CPU for it (FxStorageBackend.gpu_memory_device = "cpu"), and everything
else -- the allocator, the router, the pipeline, LMCache's retrieve -- is
the real path.
"""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1 << 20


# ------------------------------------------------------------------ options
def test_options_defaults_and_parsing():
    from lmcache_fx.core.options import FxOptions

    o = FxOptions()
    assert (o.direct_to_gpu, o.gpu_buffer_mib, o.gpu_staging_slots, o.gpu_slot_mib) == (False, 2048, 8, 4)
    o = FxOptions.from_mapping(
        {"direct_to_gpu": "true", "verify": "false", "gpu_buffer_mib": "512", "gpu_staging_slots": 4, "gpu_slot_mib": 2}
    )
    assert (o.direct_to_gpu, o.verify, o.gpu_buffer_mib, o.gpu_staging_slots, o.gpu_slot_mib) == (
        True,
        False,
        512,
        4,
        2,
    )
    # verify (the default) works on the GPU path: the pipeline checksums the staging slots
    assert FxOptions.from_mapping({"direct_to_gpu": True}).verify is True


@pytest.mark.parametrize(
    "values,message",
    [
        (
            {"direct_to_gpu": True, "auth_key": "0123456789abcdef"},
            r"x\.direct_to_gpu: cannot be combined with x\.auth_key",
        ),
        ({"direct_to_gpu": "maybe"}, r"x\.direct_to_gpu: expected true or false"),
        ({"gpu_buffer_mib": 0}, r"x\.gpu_buffer_mib: 0 is out of range"),
        ({"gpu_buffer_mib": "2G"}, r"x\.gpu_buffer_mib: expected an integer"),
        ({"gpu_staging_slots": 1}, r"x\.gpu_staging_slots: 1 is out of range \[2, 256\]"),
        ({"gpu_slot_mib": 4096}, r"x\.gpu_slot_mib: 4096 is out of range \[1, 1024\]"),
        ({"gpu_slots": 4}, r"unknown option 'x\.gpu_slots': did you mean 'x\.gpu_slot_mib'\?"),
    ],
)
def test_options_refused_with_their_name(values, message):
    from lmcache_fx.core.options import ConfigError, FxOptions

    with pytest.raises(ConfigError, match=message):
        FxOptions.from_mapping(values, where="x.")


def test_readme_rows_and_paragraph():
    text = open(os.path.join(ROOT, "README.md")).read()
    for row in (
        "| `direct_to_gpu` | `false` |",
        "| `gpu_buffer_mib` | `2048` |",
        "| `gpu_staging_slots` | `8` |",
        "| `gpu_slot_mib` | `4` |",
    ):
        assert row in text
    assert "**`direct_to_gpu: true`**" in text


# ------------------------------------------------------------------ routing, no driver
class _StubReader:
    """read_into with memcpy: what the pipeline does, minus the pipeline."""

    device = 0

    def __init__(self):
        self.calls = []
        self.streams = []

    def read_into(self, ops, cancel_on_error=True, crc=False, stream=None, why=False):
        import ctypes

        from lmcache_fx import _fxio

        self.calls.append(list(ops))
        self.streams.append(stream)
        out = []
        for fd, off, n, addr in ops:
            data = os.pread(fd, n, off)
            ctypes.memmove(addr, data, len(data))
            out.append((len(data), _fxio.crc32c(data)) if crc else len(data))
        return (out, None) if why else out


def test_router_splits_and_merges_in_op_order(tmp_path):
    from lmcache_fx import _fxio
    from lmcache_fx.gpu import GpuRouter

    data = os.urandom(64 * 1024)
    p = tmp_path / "f"
    p.write_bytes(data)
    dev, host = _fxio.HostBuffer(32 * 1024, hugepages=False), _fxio.HostBuffer(32 * 1024, hugepages=False)
    eng = _fxio.Engine("threads")
    rd = _StubReader()
    r = GpuRouter(eng, rd, lambda a: dev.address <= a < dev.address + len(dev))
    fd = os.open(p, os.O_RDONLY)
    try:
        ops = [
            (fd, 0, 4096, host.address),
            (fd, 4096, 10000, dev.address),
            (fd, 20000, 4096, host.address + 4096),
            (fd, 30000, 20000, dev.address + 12288),
            (fd, 60000, 8192, host.address + 8192),
        ]
        assert r.read(ops) == [4096, 10000, 4096, 20000, 5536]  # the last one short at EOF
        assert [len(c) for c in rd.calls] == [2]  # one pipeline call for the device ops, in order
        assert bytes(dev)[:10000] == data[4096:14096] and bytes(dev)[12288:32288] == data[30000:50000]
        assert bytes(host)[:4096] == data[:4096] and bytes(host)[4096:8192] == data[20000:24096]
        assert bytes(host)[8192 : 8192 + 5536] == data[60000:]
        # crc=True: (bytes, CRC32C) for every op, device and host alike, as the engine gives them
        want = [
            (n, _fxio.crc32c(data[off : off + n]))
            for off, n in ((0, 4096), (4096, 10000), (20000, 4096), (30000, 20000), (60000, 5536))
        ]
        assert r.read(ops, crc=True) == want
        assert rd.calls[-1] == [ops[1], ops[3]]
        assert r.read(ops[:1], crc=True) == want[:1]  # host-only batches: the engine's own

        async def via_submit():  # the awaited path: an eventfd batch from a thread
            b = r.submit(ops)
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            loop.add_reader(b.fileno(), lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(b.fileno())
            assert b.done()
            return b.wait()

        assert asyncio.run(via_submit()) == [4096, 10000, 4096, 20000, 5536]

        async def via_submit_crc():
            b = r.submit(ops, crc=True)
            while not b.done():
                await asyncio.sleep(0.001)
            return b.wait()

        assert asyncio.run(via_submit_crc()) == want
        assert r.kind == eng.kind  # everything else is the engine's
    finally:
        os.close(fd)
        eng.close()


def test_a_routed_read_on_its_own_thread_follows_the_callers_stream(tmp_path, monkeypatch):
    """torch's current stream is per thread: submit() runs the pipeline on a
    thread of its own, where read_into's default (torch's current stream)
    was the default stream, which does not wait for the caller's
    non-blocking stream. The caller's stream is taken on the caller's thread."""
    from lmcache_fx import _fxio, gpu

    monkeypatch.setattr(
        gpu, "_stream_handle", lambda stream, device: threading.get_ident() if stream is None else stream
    )
    p = tmp_path / "f"
    p.write_bytes(os.urandom(8192))
    dev = _fxio.HostBuffer(8192, hugepages=False)
    eng = _fxio.Engine("threads")
    rd = _StubReader()
    r = gpu.GpuRouter(eng, rd, lambda a: dev.address <= a < dev.address + len(dev))
    fd = os.open(p, os.O_RDONLY)
    try:
        assert r.submit([(fd, 0, 8192, dev.address)]).wait() == [8192]
        assert rd.streams == [threading.get_ident()]  # this thread's, not the read thread's
        assert r.read([(fd, 0, 8192, dev.address)]) == [8192]
        assert rd.streams[-1] is None  # on the caller's thread: read_into resolves it there
    finally:
        os.close(fd)
        eng.close()


# ------------------------------------------------------------------ child processes
@pytest.fixture(scope="module")
def fake_so(fake_gpu_driver_so):
    return fake_gpu_driver_so


def _child(scenario, driver, *args, timeout=120):
    env = dict(
        os.environ,
        PYTHONHASHSEED="0",
        LMCACHE_TRACK_USAGE="false",
        LMCACHE_FX_GPU_DRIVER=driver,
        PYTHONPATH=os.pathsep.join([ROOT, HERE]),
    )
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), scenario, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, (r.stdout[-3000:], r.stderr[-5000:])
    return json.loads(line[-1][7:])


def test_refused_without_a_gpu_driver(tmp_path):
    """No driver: a ConfigError naming the option and why, before anything
    started (no store directory, no writer thread, no staging), and LMCache
    starts without the tier."""
    out = _child("refuse", "/nonexistent/libcuda.so.1", tmp_path / "store", tmp_path)
    assert (
        "storage_plugin.fx.direct_to_gpu: cannot serve chunks in GPU memory here: no CUDA/ROCm driver found"
        in out["error"]
    ), out
    assert "nonexistent" in out["error"] and "direct_to_gpu: false" in out["error"]
    assert out["store_created"] is False and out["threads"] == []
    assert out["lmcache_backends"] == ["LocalCPUBackend"]


def test_refused_when_torch_sees_no_gpu(fake_so, tmp_path):
    """A driver but a torch without the device (this host's CPU torch with
    the stand-in): refused too, naming torch."""
    out = _child("refuse", fake_so, tmp_path / "store", tmp_path)
    if out.get("cuda"):
        pytest.skip("torch sees a GPU here")
    assert "direct_to_gpu: cannot serve chunks in GPU memory here: torch sees no CUDA/ROCm device" in out["error"], out
    assert out["store_created"] is False and out["threads"] == []


def test_chunks_through_the_gpu_reader_bit_exact(fake_so, tmp_path):
    """A batch of chunks through the plugin's read path with verify on: payload
    ops go to the pipeline (which returns their CRC32C, computed in the
    staging slots), header ops to the engine, and the data is bit-exact; a
    damaged payload is a miss; with O_DIRECT where tmp_path allows it (the
    pipeline aligns its pieces)."""
    out = _child("roundtrip", fake_so, tmp_path / "store", tmp_path)
    assert out["driver"] == fake_so
    # LMCache retrieves through the fx tier, from chunks in the plugin's buffer.
    assert out["retrieve_tokens"] == out["ntok"] and out["retrieve_equal"], out
    assert out["chunks_read"] >= out["nchunks"]
    # The plugin's read path, blocking and awaited: every chunk in the buffer, bit-exact with its file.
    for mode in ("blocking", "async"):
        r = out[mode]
        assert r["n"] == out["nchunks"] and r["in_buffer"] == r["n"] and r["bit_exact"] == r["n"], (mode, r)
    # Routing: payloads went to the pipeline (every copy into the buffer), headers to the engine (none into it).
    assert out["pipeline_ops"] >= 3 * out["nchunks"] and out["pipeline_ops_outside_buffer"] == 0
    assert out["engine_ops"] > 0 and out["engine_ops_into_buffer"] == 0
    assert out["copies"] > out["pipeline_ops"] and out["copies_outside_buffer"] == 0  # chunks > one slot
    assert out["staging_pinned"] is True
    # verify on: every pipeline call asked for CRCs (checked in the staging slots) and good chunks are hits.
    assert out["pipeline_crc_calls"] >= 2
    d = out["damaged"]
    assert d["missing"] == [2, 4] and d["file_removed"] and d["others"]["bit_exact"] == out["nchunks"] - 2, d
    t = out["truncated"]
    assert t["missing"] == [2] and t["file_removed"] and t["others"]["bit_exact"] == out["nchunks"] - 1, t
    # Everything released (failed reads included): the whole buffer can be allocated again.
    assert out["buffer_free_after"] is True
    # A buffer too small for the request: the retrieve stops at the chunk that did not fit.
    assert out["small_buffer_tokens"] == 512


def test_close_while_a_routed_read_starts_waits_for_it(fake_so, tmp_path):
    """A routed read registers its batch with the reader before its thread
    runs; a close() from another thread in between joined a thread not yet
    made or started and raised (AttributeError / RuntimeError), leaving the
    staging pool open. It waits for that read now, then closes."""
    out = _child("close_race", fake_so, tmp_path)
    assert out["close"] == "ok" and out["result"] == [4 << 20] and out["tracked"] == 0 and out["closed"], out


def test_a_failed_copy_to_the_gpu_is_logged_with_the_drivers_reason_once(fake_so, tmp_path):
    """A GPU fault reached the log only as the store's "read failed:
    Input/output error" of a chunk file, as if the disk had failed; the
    driver's reason stayed in the reader's last_error. Said once per reason
    (the faulting copy's; then, the fault sticking, each later read's)."""
    out = _child("copy_fault", fake_so, tmp_path)
    assert all(r[0] < 0 for r in out["res"]), out
    said = [m for m in out["said"] if "a read into GPU memory failed" in m]
    assert 1 <= len(said) < 3 and len(set(said)) == len(said), out
    assert all("CUDA_ERROR_ILLEGAL_ADDRESS" in m for m in said), out


def test_a_chunk_larger_than_the_gpu_buffer_is_said_once(fake_so, tmp_path):
    """With gpu_buffer_mib below one chunk every retrieve missed and nothing
    was logged (the CPU path warns in that case). One warning per size now,
    naming the option; a chunk that fits still gets its buffer."""
    out = _child("too_big", fake_so, tmp_path)
    assert out["got"] == [False, False] and out["fits"], out
    warned = [m for m in out["said"] if "larger than the GPU chunk buffer" in m]
    assert len(warned) == 1 and "2.0 MiB" in warned[0] and "gpu_buffer_mib" in warned[0], out


def test_a_routed_read_whose_thread_cannot_start_leaves_nothing_behind(fake_so, tmp_path):
    """Thread creation failing (can't start new thread) left the batch
    registered: every free of an overlapping chunk and every close raised
    after it, and its eventfd stayed open. The error goes to the caller (a
    miss) and nothing is kept."""
    out = _child("start_fail", fake_so, tmp_path)
    assert out["submit"].startswith("RuntimeError") and out["tracked"] == 0, out
    assert out["free"] == "ok" and out["close"] == "ok" and out["eventfds"] == out["eventfds_before"], out


# ------------------------------------------------------------------ the child side
def _threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lmcache-fx"))


def child_refuse(store, workdir):
    import torch

    from lmcache_fx.core.options import ConfigError
    from lmcache_fx.lmcache_plugin import FxStorageBackend
    from lmcache_fx.testing.cpu_engine import Geometry, config_from_dict, fx_config, lmcache_engine

    cfg = config_from_dict(fx_config(store, direct_to_gpu=True), workdir)
    out = {"cuda": torch.cuda.is_available()}
    try:
        FxStorageBackend(config=cfg, dst_device="cpu", local_cpu_backend=object())
        out["error"] = None
    except ConfigError as e:
        out["error"] = str(e)
    out["store_created"] = os.path.exists(store)
    out["threads"] = _threads()
    with lmcache_engine(
        config_from_dict(fx_config(store, direct_to_gpu=True), workdir), Geometry()
    ) as eng:  # LMCache logs the refusal and runs without the tier
        out["lmcache_backends"] = list(eng.storage_manager.storage_backends)
    return out


def child_roundtrip(store, workdir):
    import ctypes

    import torch

    from lmcache_fx import _fxio
    from lmcache_fx.core.chunkfile import HEADER_SIZE
    from lmcache_fx.lmcache_plugin import FxStorageBackend
    from lmcache_fx.testing.cpu_engine import (
        KV,
        Geometry,
        config_from_dict,
        fx_backend,
        fx_config,
        lmcache_engine,
        retrieve,
        store_and_wait,
    )

    FxStorageBackend.gpu_memory_device = "cpu"  # the stand-in's "device pointers" are host addresses
    lib = ctypes.CDLL(os.environ["LMCACHE_FX_GPU_DRIVER"])  # the handle the pipeline uses
    lib.fake_gpu_log_len.restype = ctypes.c_long
    out = {"driver": _fxio.gpu_driver()["path"]}
    geo = Geometry(layers=6, kv_heads=3, head_dim=40, dtype=torch.float32)  # 1.4 MiB chunks: 2 pieces of 1 MiB
    ntok = 5 * 256 + 77  # a partial last chunk
    out["ntok"], out["nchunks"] = ntok, 6
    opts = dict(
        direct_to_gpu=True, verify=True, gpu_buffer_mib=16, gpu_staging_slots=3, gpu_slot_mib=1, split_bytes="64K"
    )
    cfg = config_from_dict({**fx_config(store, **opts), "save_unfull_chunk": True}, workdir)
    tokens = torch.randint(0, 30000, (ntok,), generator=torch.Generator().manual_seed(5))
    kv = KV(geo, ntok, seed=9)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        gpu = be._gpu
        router = be._reads

        class Recorder:  # the engine, with the ops it was given recorded
            def __init__(self, engine):
                self.engine, self.ops = engine, []

            def __getattr__(self, name):
                return getattr(self.engine, name)

            def read(self, ops, crc=False):
                self.ops += ops
                return self.engine.read(ops, crc=crc)

            def submit(self, ops, write=False, crc=False):
                if not write:
                    self.ops += ops
                return self.engine.submit(ops, write=write, crc=crc)

        class ReaderRecorder:
            def __init__(self, reader):
                self.reader, self.ops = reader, []

            def __getattr__(self, name):  # device, ...: the reader's
                return getattr(self.reader, name)

            def read_into(self, ops, **kw):
                self.ops += ops
                self.crc_asked = getattr(self, "crc_asked", 0) + bool(kw.get("crc"))
                return self.reader.read_into(ops, **kw)

        router.engine = Recorder(router.engine)
        router.reader = ReaderRecorder(router.reader)
        out["staging_pinned"] = gpu.reader.pinned
        out["odirect"] = be.store.odirect
        lib.fake_gpu_reset()

        store_and_wait(eng, tokens, kv, be)
        got = kv.empty_like()
        out["retrieve_tokens"] = retrieve(eng, tokens, got)
        out["retrieve_equal"] = kv.tokens_equal(got, out["retrieve_tokens"])
        out["chunks_read"] = be.store.stats.chunks_read

        keys = [k for _, _, k in eng.token_database.process_tokens(tokens=tokens)]
        from lmcache_fx.core.chunkfile import chunk_digest

        files = [be.store.path_for(chunk_digest(k.to_string())) for k in keys]

        def check(objs, fs=None):
            r = {"n": sum(o is not None for o in objs), "in_buffer": 0, "bit_exact": 0}
            for o, f in zip(objs, fs or files):
                if o is None:
                    continue
                r["in_buffer"] += gpu.owns(o.data_ptr) and gpu.owns(o.data_ptr + o.get_size() - 1)
                with open(f, "rb") as fh:
                    fh.seek(HEADER_SIZE)
                    want = fh.read()
                have = ctypes.string_at(o.data_ptr, o.get_size())
                r["bit_exact"] += have == want and len(want) == o.get_size()
                o.ref_count_down()
            return r

        out["blocking"] = check(be.batched_get_blocking(keys))

        async def aget():
            return await be.batched_get_non_blocking("lookup-1", keys)

        out["async"] = check(asyncio.run(aget()))

        lo, hi = gpu.base, gpu.base + gpu.size
        rops, eops = router.reader.ops, router.engine.ops
        out["pipeline_ops"] = len(rops)
        out["pipeline_ops_outside_buffer"] = sum(not (lo <= a < hi) for _, _, _, a in rops)
        out["engine_ops"] = len(eops)
        out["engine_ops_into_buffer"] = sum(lo <= a < hi for _, _, _, a in eops)
        buf = (ctypes.c_longlong * 6)()
        copies = outside = 0
        for i in range(lib.fake_gpu_log_len()):
            lib.fake_gpu_log_get(ctypes.c_long(i), buf)
            if buf[0] == 1:  # a copy's start: (kind, t, seq, dst, src, n)
                copies += 1
                outside += not (lo <= buf[3] and buf[3] + buf[5] <= hi)
        out["copies"], out["copies_outside_buffer"] = copies, outside
        out["pipeline_crc_calls"] = getattr(router.reader, "crc_asked", 0)
        # A truncated chunk file: its GPU read comes back short; a miss, the file removed, the others intact.
        os.truncate(files[2], os.path.getsize(files[2]) - 4096)
        objs = be.batched_get_blocking(keys)
        out["truncated"] = {
            "missing": [i for i, o in enumerate(objs) if o is None],
            "file_removed": not os.path.exists(files[2]),
            "others": check([o for i, o in enumerate(objs) if i != 2], [f for i, f in enumerate(files) if i != 2]),
        }
        for o in objs[2:3]:
            if o is not None:
                o.ref_count_down()
        # A damaged payload (one byte flipped in its second piece, same length): verify makes it a miss,
        # the file removed, the others intact and bit-exact
        # (chunk 2, truncated above, stays a miss).
        with open(files[4], "r+b") as fh:
            pos = HEADER_SIZE + (1 << 20) + 12345
            fh.seek(pos)
            b = fh.read(1)
            fh.seek(pos)
            fh.write(bytes([b[0] ^ 0x40]))
        objs = be.batched_get_blocking(keys)
        out["damaged"] = {
            "missing": [i for i, o in enumerate(objs) if o is None],
            "file_removed": not os.path.exists(files[4]),
            "others": check(
                [o for i, o in enumerate(objs) if i not in (2, 4)], [f for i, f in enumerate(files) if i not in (2, 4)]
            ),
        }
        for o in objs[4:5]:
            if o is not None:
                o.ref_count_down()
        whole = gpu.allocate([torch.Size([gpu.size])], [torch.uint8])
        out["buffer_free_after"] = whole is not None
        if whole is not None:
            whole.ref_count_down()

    # The same store with a buffer for two chunks of this geometry only.
    small = dict(opts, gpu_buffer_mib=1)
    geo2 = Geometry(layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)  # 512 KiB chunks
    cfg2 = config_from_dict(fx_config(os.path.join(str(store), "small"), **small), workdir)
    kv2 = KV(geo2, 1024, seed=2)
    with lmcache_engine(cfg2, geo2) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, torch.arange(1024), kv2, be)
        got = kv2.empty_like()
        n = retrieve(eng, torch.arange(1024), got)
        out["small_buffer_tokens"] = n if kv2.tokens_equal(got, n) else -1
    return out


def _router_setup(workdir, size):
    import torch

    from lmcache_fx import _fxio, gpu

    path = os.path.join(workdir, "data.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    a = gpu.GpuChunkAllocator(16 << 20, device=0, slots=2, slot_bytes=1 << 20, memory_device="cpu")
    router = gpu.GpuRouter(_fxio.Engine("threads"), a.reader, a.owns)
    obj = a.allocate([torch.Size([size])], [torch.uint8])
    return a, router, obj, os.open(path, os.O_RDONLY)


def child_close_race(workdir):
    a, router, obj, fd = _router_setup(workdir, 4 << 20)
    rd, orig, out = a.reader, a.reader._track, {}

    def track(batch, on):  # registered, its thread not started: another thread closes the reader now
        orig(batch, on)
        if on:

            def closer():
                try:
                    rd.close()
                    out["close"] = "ok"
                except BaseException as e:
                    out["close"] = f"{type(e).__name__}: {e}"

            threading.Thread(target=closer).start()
            time.sleep(0.2)  # the closer is waiting (or has raised) by now

    rd._track = track
    out["result"] = router.submit([(fd, 0, 4 << 20, obj.data_ptr)]).wait()
    end = time.monotonic() + 30
    while "close" not in out and time.monotonic() < end:
        time.sleep(0.01)
    out["tracked"] = len(rd._inflight)
    try:
        rd.read_into([(fd, 0, 4096, obj.data_ptr)])
        out["closed"] = False
    except Exception:
        out["closed"] = True
    return out


def child_start_fail(workdir):
    a, router, obj, fd = _router_setup(workdir, 1 << 20)
    from faults.fxfault import fds_of

    out = {"eventfds_before": fds_of("eventfd")}
    threading.stack_size(1 << 44)  # no thread can be made with this stack
    try:
        router.submit([(fd, 0, 4096, obj.data_ptr)])
        out["submit"] = "started"
    except Exception as e:
        out["submit"] = f"{type(e).__name__}: {e}"
    finally:
        threading.stack_size(0)
    out["tracked"] = len(a.reader._inflight)
    out["eventfds"] = fds_of("eventfd")
    for what, fn in (("free", obj.ref_count_down), ("close", a.close)):
        try:
            fn()
            out[what] = "ok"
        except Exception as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


def child_copy_fault(workdir):
    """Three routed reads after a copy to the GPU faults (the fault sticks)."""
    import ctypes
    import logging

    said = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())
    logging.getLogger("lmcache_fx").addHandler(handler)
    a, router, obj, fd = _router_setup(workdir, 1 << 20)
    drv = ctypes.CDLL(os.environ["LMCACHE_FX_GPU_DRIVER"])
    drv.fake_gpu_fail_copy(ctypes.c_long(1), 1)  # the next copy fails on the stream, and the fault sticks
    res = [router.read([(fd, 0, 1 << 20, obj.data_ptr)]) for _ in range(3)]
    os.close(fd)
    obj.ref_count_down()
    a.close()
    return {"res": res, "said": said}


def child_too_big(workdir):
    """A chunk larger than the whole GPU chunk buffer, asked for twice."""
    import logging

    import torch

    from lmcache_fx import gpu

    said = []
    handler = logging.Handler()
    handler.emit = lambda r: said.append(r.getMessage())
    logging.getLogger("lmcache_fx").addHandler(handler)
    a = gpu.GpuChunkAllocator(1 << 20, device=0, slots=2, slot_bytes=1 << 20, memory_device="cpu")
    got = [a.allocate([torch.Size([1 << 20])], [torch.bfloat16]) for _ in range(2)]
    fits = a.allocate([torch.Size([1 << 18])], [torch.bfloat16])
    out = {"got": [g is not None for g in got], "fits": fits is not None, "said": said}
    fits.ref_count_down()
    a.close()
    return out


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    fn = {
        "refuse": child_refuse,
        "roundtrip": child_roundtrip,
        "close_race": child_close_race,
        "start_fail": child_start_fail,
        "too_big": child_too_big,
        "copy_fault": child_copy_fault,
    }[sys.argv[1]]
    print("RESULT " + json.dumps(fn(*sys.argv[2:])))
