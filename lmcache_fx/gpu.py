"""File -> GPU reads without GPUDirect Storage: pinned staging, pipelined.

    from lmcache_fx.gpu import GpuReader
    with GpuReader(device=0) as rd:
        results = rd.read_into([(fd, file_offset, nbytes, tensor.data_ptr()), ...])

Each op is cut into pieces of `slot_bytes`; a piece is read (io_uring, or C
threads when the engine has no io_uring) into a page-locked staging slot, and
as soon as it lands an async host-to-device copy to its place on the GPU is
queued on a stream, while later reads go on. A slot is refilled only after
its copy's event completed. Results are per op: bytes copied to the GPU
(short at end of file) or -errno; -ECANCELED for ops stopped by another op's
error (cancel_on_error, the default).

Stream order: the copies start only after the work already queued on the
caller's stream (`stream=`, torch's current stream by default), so a
destination still used by earlier kernels is not overwritten under them.
With sync=True (the default) every read and copy has finished when read_into
returns; with sync=False it returns once every copy is queued, and the
caller's stream waits for them (work queued on it afterwards sees the data;
the host does not wait). Its byte counts then include copies still queued: one
that fails after it returned is reported by the next read_into, which raises
RuntimeError without reading, or by close(), with a RuntimeWarning.

Integrity: read_into(..., crc=True) returns (bytes, CRC32C) per op, as the
engine's read(..., crc=True) does. Each piece is checksummed in its staging
slot, which the pipeline owns from the read until the copy out of it ended,
so the CRC is that of the bytes handed to the GPU (0 for an op whose copy
failed; with sync=False, see above for copies still queued); the store's
verify works on the GPU path.

Fork: a reader made before os.fork() refuses every read in the child with a
RuntimeError naming fork (its threads, ring, staging memory and GPU context
stay with the parent); close() there only forgets them.

The driver is found at run time: a CUDA/HIP library the process already
loaded (torch's), else libcuda.so.1, else ROCm's libamdhip64.so.7/.6/.5/.so;
LMCACHE_FX_GPU_DRIVER=/path/lib.so selects another library exporting the
CUDA driver names (the tests' stand-in, tests/fake_gpu_driver.c, whose
"device pointers" are host addresses).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import sys
import threading
import weakref
from typing import Any, Iterable, Optional, Sequence

from . import _fxio
from .core.once import log_once

DEFAULT_SLOTS = 8
DEFAULT_SLOT_BYTES = 4 << 20

log = logging.getLogger("lmcache_fx.gpu")


def driver_info() -> dict:
    """{'api': 'cuda'|'hip'|None, 'path', 'devices', 'error', 'found',
    'found_api'}; loads the driver once. 'found': the library of a driver
    that could not be bound for want of a device (api None), or the bound
    one's path."""
    return _fxio.gpu_driver()


def available() -> bool:
    return driver_info()["api"] is not None


def io_uring_can_register(address: int, length: int) -> int:
    """0 if io_uring can take [address, address+length) as a fixed buffer, else
    -errno. Tried on a throwaway ring: no engine's registration is touched.
    Use it on pinned memory (cudaHostAlloc, torch pin_memory) before
    Engine.register_buffer; see docs/gpu.md for what is known to work."""
    return _fxio.uring_register_probe(address, length)


def _current_device() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.current_device()
    except Exception:
        pass
    return 0


def _device_index(device: Any) -> int:
    """GPU ordinal of device: an int, "cuda:N", a torch.device; None, "cuda"
    or torch.device("cuda") mean torch's current device (as in torch)."""
    if device is None:
        return _current_device()
    if isinstance(device, int):
        return device
    if not isinstance(device, str):
        idx = getattr(device, "index", None)  # torch.device
        if idx is not None:
            return int(idx)
    s = str(device)
    if ":" in s:
        return int(s.rsplit(":", 1)[1])
    return _current_device()


def _stream_handle(stream: Any, device: int) -> int:
    """The CUstream / hipStream_t to order the copies after: an int handle,
    an object with .cuda_stream (a torch.cuda.Stream), or None for torch's
    current stream on the device (0, the default stream, when torch is not
    loaded or has no GPU: there is no torch work to order after)."""
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return 0
        try:
            if not torch.cuda.is_available():
                return 0
            return int(torch.cuda.current_stream(device).cuda_stream)
        except Exception:
            return 0
    handle = getattr(stream, "cuda_stream", stream)
    return int(handle)


class GpuReader:
    """A staging pool on one GPU and the pipeline that reads through it.

    engine: an lmcache_fx Engine to follow (its io_uring or thread choice);
    io_engine: 'auto' | 'io_uring' | 'threads' when no engine is given.
    slots * slot_bytes of host memory is page-locked for the reader's life.
    One read_into runs at a time per reader (others wait)."""

    def __init__(
        self,
        engine=None,
        device: Any = None,
        slots: int = DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        io_engine: str = "auto",
        warn: bool = True,
    ):
        self.device = _device_index(device)
        self._pid = os.getpid()
        self._st = _fxio.GpuStaging(
            slots=slots, slot_bytes=slot_bytes, device=self.device, engine=engine, io_engine=io_engine
        )
        self._inflight: set = set()  # routed reads running on threads (GpuRouter.submit)
        self._inflight_mu = threading.Lock()
        if warn and self.degraded:
            log_once(
                log, ("gpu", self.degraded), logging.WARNING, "lmcache-fx: GPU reads on a slow path: %s", self.degraded
            )

    # -- properties of the staging pool
    @property
    def staging(self) -> "_fxio.GpuStaging":
        return self._st

    @property
    def pinned(self) -> bool:
        return self._st.pinned

    @property
    def io(self) -> str:
        return self._st.io

    @property
    def last_error(self) -> Optional[str]:
        return self._st.last_error

    @property
    def degraded(self) -> Optional[str]:
        """Why reads run slower than they could, or None: staging not
        page-locked (every copy synchronous, no overlap), io_uring refusing
        the slots as fixed buffers (pages pinned again on every read), or its
        own ring refused (reads on threads)."""
        why = []
        if not self._st.pinned:
            why.append(
                f"staging memory not page-locked ({self._st.pin_error}): copies to the GPU are "
                "synchronous, reads and copies do not overlap"
            )
        if self._st.fixed_error:
            why.append(f"{self._st.fixed_error}: every read pins its pages again")
        if self._st.io_error:
            why.append(f"{self._st.io_error}: reads run on threads")
        return "; ".join(why) or None

    @property
    def numa_node(self) -> int:
        """NUMA node the staging memory was bound to (the GPU's), or -1."""
        return self._st.numa_node

    @property
    def numa_info(self) -> str:
        return self._st.numa_info

    def stats(self) -> dict:
        s = dict(self._st.last_stats())
        s["gb_per_s"] = s["bytes"] / s["wall_ns"] if s["wall_ns"] else 0.0
        return s

    def trace(self) -> list[tuple]:
        """(t_ns CLOCK_MONOTONIC, kind, slot, op, piece, value) of the last
        read_into(trace=True); kinds: read_submit, read_done, copy_issue,
        copy_done (when the event was seen complete), error."""
        return self._st.last_trace()

    @property
    def forked(self) -> bool:
        """This process is a fork()ed child of the one that made the reader."""
        return os.getpid() != self._pid or self._st.forked

    def check_fork(self) -> None:
        """Raises RuntimeError (naming fork) in a fork()ed child."""
        if self.forked:
            raise RuntimeError(
                "GpuReader was created before fork(): it cannot be used in the child (its threads, "
                "io_uring ring, staging memory and GPU context stay with the parent); create a new "
                "one in the child, or start the child with spawn"
            )

    # -- reads
    def read_into(
        self,
        ops: Sequence[tuple[int, int, int, int]],
        trace: bool = False,
        cancel_on_error: bool = True,
        stream: Any = None,
        sync: bool = True,
        crc: bool = False,
        why: bool = False,
    ) -> Any:
        """ops: (fd, file_offset, length, device_address). GIL released.
        stream: ordered after the work queued on it so far (default: torch's
        current stream); sync=False: return once the copies are queued, with
        `stream` made to wait for them instead of this thread. crc=True:
        (bytes, CRC32C of those bytes) per op instead of bytes. why=True:
        (that list, this read's first error or None), which another thread's
        read cannot replace as it can `last_error`."""
        self.check_fork()
        return self._st.read(
            ops,
            trace=trace,
            cancel_on_error=cancel_on_error,
            stream=_stream_handle(stream, self.device),
            sync=sync,
            crc=crc,
            why=why,
        )

    def read_tensors(
        self,
        path: str,
        items: Iterable[tuple[int, Any]],
        odirect: bool = True,
        trace: bool = False,
        stream: Any = None,
        sync: bool = True,
    ) -> list[int]:
        """Fills each contiguous tensor with the file's bytes at file_offset.
        O_DIRECT is used when asked and the filesystem allows it."""
        items = list(items)
        ops_t = []
        for _off, t in items:
            if not t.is_contiguous():
                raise ValueError("read_tensors needs contiguous tensors")
        fd = _open(path, odirect)
        try:
            for off, t in items:
                ops_t.append((fd, int(off), t.numel() * t.element_size(), t.data_ptr()))
            return self.read_into(ops_t, trace=trace, stream=stream, sync=sync)
        finally:
            os.close(fd)

    # -- routed reads on threads (GpuRouter): memory is freed only after them
    def _track(self, batch: "_ThreadBatch", on: bool) -> None:
        with self._inflight_mu:
            (self._inflight.add if on else self._inflight.discard)(batch)

    def wait_writes(self, lo: int = 0, hi: int = 1 << 64) -> None:
        """Waits for every routed read still writing into [lo, hi): what must
        happen before that memory is freed (e.g. after an awaited read was
        cancelled, its thread still runs). Nothing to wait for in a fork()ed
        child: those threads are the parent's."""
        if self.forked:
            return
        with self._inflight_mu:
            batches = [b for b in self._inflight if b.overlaps(lo, hi)]
        for b in batches:
            b.join()

    def close(self) -> None:
        self.wait_writes()
        self._st.close()  # in a fork()ed child: forgets the parent's resources

    def __enter__(self) -> "GpuReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: str, odirect: bool) -> int:
    flags = os.O_RDONLY | os.O_CLOEXEC
    if odirect:
        try:
            return os.open(path, flags | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:  # tmpfs and friends refuse O_DIRECT
                raise
    return os.open(path, flags)


def check_results(results: Sequence[int], sizes: Sequence[int], what: str = "read") -> None:
    """Raises OSError on the first op that failed or came back short."""
    for i, (r, n) in enumerate(zip(results, sizes)):
        if r < 0:
            raise OSError(-r, f"{what}: op {i}: {os.strerror(-r)}")
        if r != n:
            raise OSError(errno.EIO, f"{what}: op {i}: {r} of {n} bytes (file too short)")


def direct_to_gpu_problem(device: Any = None, memory_device: Optional[str] = None) -> Optional[str]:
    """Why GPU-resident chunks cannot be served here (None when they can):
    the pipeline needs a GPU driver with the device, and the chunk buffer a
    torch that sees it. memory_device: the torch device of the chunk buffer
    (default cuda:<device>); 'cpu' only with the tests' stand-in driver,
    whose "device pointers" are host addresses."""
    info = driver_info()
    if info["api"] is None and info.get("found"):
        return f"the {info['found_api']} driver {info['found']} has no usable device here ({info['error']})"
    if info["api"] is None:
        return f"no CUDA/ROCm driver found ({info['error']})"
    idx = _device_index(device)
    if not 0 <= idx < int(info.get("devices") or 0):
        return f"GPU {idx} does not exist ({info['path']} reports {info.get('devices')} device(s))"
    if memory_device is None or str(memory_device).startswith("cuda"):
        try:
            import torch

            ok, n = torch.cuda.is_available(), torch.cuda.device_count()
        except Exception as e:  # a torch without CUDA/ROCm support at all
            return f"torch cannot use the GPU ({e})"
        if not ok:
            return "torch sees no CUDA/ROCm device (torch.cuda.is_available() is False)"
        if idx >= n:
            return f"torch sees {n} GPU(s), not cuda:{idx}"
    return None


class GpuChunkAllocator:
    """GPU-resident MemoryObjs for LMCache, the way its GdsBackend makes them:
    one preallocated GPU tensor carved by LMCache's own GPUMemoryAllocator
    (4 KiB-aligned objects), filled through the pipeline. The plugin's
    direct_to_gpu mode allocates retrieved chunks here and reads them with a
    GpuRouter; LMCache's connector then copies GPU -> KV cache directly.

    memory_device: torch device of the buffer, default cuda:<device>; 'cpu'
    only with the tests' stand-in driver (see direct_to_gpu_problem)."""

    def __init__(
        self,
        size: int,
        device: Any = None,
        engine=None,
        slots: int = DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        memory_device: Optional[str] = None,
    ):
        from lmcache.v1.memory_allocators.gpu_memory_allocator import GPUMemoryAllocator

        idx = _device_index(device)
        mdev = memory_device or f"cuda:{idx}"
        self.allocator = GPUMemoryAllocator(size, device=mdev, align_bytes=4096)
        base = self.allocator.tensor
        if str(base.device).split(":")[0] != mdev.split(":")[0]:  # LMCache falls back to CPU silently
            self.allocator.close()
            raise OSError(errno.ENODEV, f"chunk buffer landed on {base.device}, not {mdev}")
        self.base, self.size = base.data_ptr(), base.numel() * base.element_size()
        del base
        try:
            self.reader = GpuReader(engine=engine, device=idx, slots=slots, slot_bytes=slot_bytes)
        except BaseException:
            self.allocator.close()
            self.allocator = None
            raise
        # A chunk is handed back (LMCache's ref_count_down -> free) only after
        # any routed read still writing into it ended: an awaited retrieve
        # cancelled mid-read leaves its thread running into those buffers.
        inner = self.allocator.allocator
        reader_ref = weakref.ref(self.reader)
        orig_free, orig_bfree = inner.free, inner.batched_free

        def settle(objs):
            rd = reader_ref()
            if rd is None:
                return
            for o in objs:
                try:
                    a = int(o.data_ptr)
                    rd.wait_writes(a, a + int(o.get_size()))
                except Exception:
                    rd.wait_writes()

        def free(memory_obj, *a, **k):
            settle([memory_obj])
            return orig_free(memory_obj, *a, **k)

        def batched_free(memory_objs, *a, **k):
            settle(memory_objs)
            return orig_bfree(memory_objs, *a, **k)

        inner.free, inner.batched_free = free, batched_free

    def owns(self, address: int) -> bool:
        return self.base <= address < self.base + self.size

    def allocate(self, shapes, dtypes, fmt=None, busy_loop: bool = True):
        """A MemoryObj, or None when the buffer is full (no waiting: in one
        retrieve, the chunks already read are what would have to be freed)."""
        from lmcache.v1.memory_management import MemoryFormat

        if self.allocator is None:
            return None
        obj = self.allocator.allocate(shapes, dtypes, fmt or MemoryFormat.KV_2LTD)
        if obj is None:
            need = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
            if need > self.size:  # never a hit, where the CPU path says so (integration.common.allocate_from)
                log_once(
                    log,
                    ("gpu-chunk-too-big", need),
                    logging.WARNING,
                    "lmcache-fx: a chunk of %.1f MiB is larger than the GPU chunk buffer (%.1f MiB): every such "
                    "chunk is a miss; raise gpu_buffer_mib",
                    need / (1 << 20),
                    self.size / (1 << 20),
                )
        return obj

    def batched_allocate(self, shapes, dtypes, batch_size: int, fmt=None, busy_loop: bool = True):
        from lmcache.v1.memory_management import MemoryFormat

        if self.allocator is None:
            return None
        return self.allocator.batched_allocate(shapes, dtypes, batch_size, fmt or MemoryFormat.KV_2LTD)

    def close(self) -> None:
        """Waits for reads still running, frees the staging pool and drops
        the gpu_buffer_mib tensor now (not at garbage collection): its memory
        goes back to torch once LMCache holds no chunk of it."""
        self.reader.close()
        alloc, self.allocator = self.allocator, None
        if alloc is not None:
            alloc.close()
            inner = alloc.allocator
            for name in ("free", "batched_free"):  # our hooks hold the reader only weakly; drop them anyway
                inner.__dict__.pop(name, None)
            alloc.tensor = None


class GpuRouter:
    """An engine stand-in for ChunkStore's drive_blocking / drive_async:
    read ops whose address `owns` are sent to the GPU pipeline (one read_into
    per batch), the others to the engine, both at once; results come back in
    op order. Writes go to the engine unchanged. With crc=True every op's
    result is (bytes, CRC32C), as from the engine: the pipeline checksums the
    GPU-bound payloads in its staging slots, so the store's verify holds."""

    def __init__(self, engine, reader: GpuReader, owns):
        self.engine, self.reader, self.owns = engine, reader, owns

    def __getattr__(self, name):  # kind, register_buffer, ...: the engine's
        return getattr(self.engine, name)

    def _split(self, ops):
        dev, host = [], []
        for i, op in enumerate(ops):
            (dev if self.owns(op[3]) else host).append(i)
        return dev, host

    def read(self, ops, crc: bool = False, stream: Any = None):
        """`stream`: what the copies are ordered after (GpuReader.read_into);
        None: torch's current stream of the calling thread."""
        dev, host = self._split(ops)
        if not dev:
            return self.engine.read(ops, crc=crc)
        check = getattr(self.reader, "check_fork", None)
        if check is not None:
            check()  # before the engine starts reading for a child that cannot finish
        batch = self.engine.submit([ops[i] for i in host], write=False, crc=crc) if host else None
        try:
            dres, why = self.reader.read_into(
                [ops[i] for i in dev], cancel_on_error=False, crc=crc, stream=stream, why=True
            )
        finally:
            hres = batch.wait() if batch is not None else []
        if why:
            # The store sees an op's -errno only ("read failed: Input/output error"): the GPU's own
            # reason (an illegal address, a failed copy) is said here, once per reason.
            log_once(log, ("gpu-read", why), logging.WARNING, "lmcache-fx: a read into GPU memory failed: %s", why)
        out = [0] * len(ops)
        for i, r in zip(dev, dres):
            out[i] = r
        for i, r in zip(host, hres):
            out[i] = r
        return out

    def write(self, ops, crc: bool = False, split: int = 0):
        return self.engine.write(ops, crc=crc, split=split)

    def submit(self, ops, write: bool = False, crc: bool = False):
        dev = [] if write else self._split(ops)[0]
        if not dev:
            return self.engine.submit(ops, write=write, crc=crc)
        check = getattr(self.reader, "check_fork", None)
        if check is not None:
            check()
        ranges = [(ops[i][3], ops[i][3] + ops[i][2]) for i in dev]
        track = getattr(self.reader, "_track", None)
        # torch's current stream is per thread: the read's own thread would see the default stream,
        # which does not wait for the caller's non-blocking stream. Taken here, on the caller's.
        stream = _stream_handle(None, self.reader.device)
        return _ThreadBatch(lambda: self.read(ops, crc, stream), ranges, track)


class _ThreadBatch:
    """A Batch (fileno / done / wait) for a routed read run on its own thread.
    ranges: the device memory it writes; track(batch, on) registers it with
    the reader while it runs (GpuReader.wait_writes)."""

    def __init__(self, fn, ranges=(), track=None):
        self._fd = os.eventfd(0, os.EFD_CLOEXEC)
        self._ev = threading.Event()
        self._res: Any = None
        self._exc: Optional[BaseException] = None
        self._ranges = list(ranges)
        self._track = track

        def run():
            try:
                self._res = fn()
            except BaseException as e:
                self._exc = e
            finally:
                self._ev.set()
                if track is not None:
                    track(self, False)
                fd = self._fd
                if fd >= 0:
                    os.eventfd_write(fd, 1)

        self._t = threading.Thread(target=run, name="lmcache-fx-gpu-read", daemon=True)
        if track is not None:
            track(self, True)  # close() from here on waits for it (join: on the event, started or not)
        try:
            self._t.start()
        except BaseException:  # no thread (can't start new thread): nothing to wait for, nothing kept
            if track is not None:
                track(self, False)
            self._close()
            raise

    def overlaps(self, lo: int, hi: int) -> bool:
        return any(a < hi and lo < b for a, b in self._ranges)

    def join(self) -> None:
        """Until the read is done writing (not the thread's end: callable
        before the thread has started, and from inside it)."""
        if threading.current_thread() is not self._t:
            self._ev.wait()

    def fileno(self) -> int:
        return self._fd

    def done(self) -> bool:
        return self._ev.is_set()

    def wait(self):
        self._t.join()
        self._close()
        if self._exc is not None:
            raise self._exc
        return self._res

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):  # wait() never called (a cancelled await); the thread is done: it held self
        self._close()
