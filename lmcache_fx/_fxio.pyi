"""lmcache-fx C core (csrc/): batched reads and writes on io_uring or C threads.

An op is (fd, offset, length, address): `length` bytes between the file at
`offset` and memory at `address`. The engine cuts ops into pieces of at most
`split_bytes`, keeps up to `queue_depth` pieces in flight across the batch,
and returns per op the bytes transferred (short at EOF) or -errno. The GIL is
released for the whole batch. The caller keeps every buffer alive until the
call (or the Batch) is done.

O_DIRECT descriptors are detected per op; a piece whose buffer, offset or
length is not 4 KiB-aligned goes through an aligned bounce buffer. O_DIRECT
writes of an unaligned length pad the file with zeros to the block.
"""
from collections.abc import Sequence
from typing import Literal, overload

from typing_extensions import Buffer

Op = tuple[int, int, int, int]

DIO_ALIGN: int  # 4096
HAVE_LIBURING: int  # 1 when built with liburing (io_uring engine present)
CRC32C_IMPL: str  # best first: "vpclmulqdq+crc32q", "pclmulqdq+crc32q", "sse4.2", "armv8-pmull", "armv8-crc", "table"
def _fault_counts() -> dict[str, int]: ...  # tests: times each LMCACHE_FX_FAULT point fired

class Engine:
    kind: Literal["io_uring", "threads"]
    queue_depth: int
    split_bytes: int
    threads: int  # I/O threads of the thread engine, else 0
    fallback_reason: str | None  # why io_engine="auto" is not using io_uring
    registered: bool  # a fixed buffer is registered with io_uring
    closed: bool
    def __init__(
        self,
        io_engine: Literal["auto", "io_uring", "threads"] = "auto",
        queue_depth: int = 32,
        split_bytes: int = 1 << 20,
        threads: int = 0,
    ) -> None:
        """'io_uring' raises OSError when io_uring cannot be set up; 'auto'
        falls back to the thread engine and records fallback_reason.
        threads=0 means min(queue_depth, 16)."""
    @overload
    def read(self, ops: Sequence[Op], crc: Literal[False] = False) -> list[int]: ...
    @overload
    def read(self, ops: Sequence[Op], crc: Literal[True]) -> list[tuple[int, int]]:
        """With crc, each result is (bytes or -errno, CRC32C of the bytes)."""
    @overload
    def write(self, ops: Sequence[Op], crc: Literal[False] = False) -> list[int]: ...
    @overload
    def write(self, ops: Sequence[Op], crc: Literal[True]) -> list[tuple[int, int]]: ...
    def submit(self, ops: Sequence[Op], write: bool = False, crc: bool = False) -> Batch:
        """Runs the batch on a C thread; await Batch.fileno() becoming readable."""
    def register_buffer(self, address: int, length: int) -> int:
        """Registers memory as io_uring fixed buffers (pieces inside it use
        READ_FIXED). 0 or -errno (-ENOMEM without CAP_IPC_LOCK, -ENOSYS on
        the thread engine); failure only means plain reads. (0, 0) clears."""
    def close(self) -> None:
        """Waits for running batches, then frees rings and threads."""

class Batch:
    def fileno(self) -> int:
        """An eventfd that becomes readable when the batch is done."""
    def done(self) -> bool: ...
    def wait(self) -> list[int] | list[tuple[int, int]]:
        """Blocks (without the GIL) until done; returns the results."""

class HostBuffer(Buffer):
    """Anonymous memory, 4 KiB-aligned; 2 MiB-aligned with MADV_HUGEPAGE
    when hugepages (default for size >= 2 MiB)."""
    address: int
    def __init__(self, size: int, hugepages: bool = ...) -> None: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def crc32c(data: Buffer, value: int = 0) -> int: ...
def crc32c_at(address: int, length: int, value: int = 0) -> int: ...
def io_uring_status() -> tuple[bool, str]:
    """(usable, reason): sets up a small ring to find out."""
def advise_hugepages(address: int, length: int) -> int:
    """MADV_HUGEPAGE (+ MADV_COLLAPSE) on the 2 MiB-aligned interior of an
    existing mapping; bytes advised or -errno."""

class GpuStaging:
    """Pinned staging slots and a pipelined NVMe -> GPU read (csrc/gpu.c).

    Slots are 2 MiB-aligned huge-page memory, io_uring fixed buffers where
    allowed, page-locked through the GPU driver found at run time (libcuda.so.1
    or libamdhip64.so; LMCACHE_FX_GPU_DRIVER selects another library). A piece
    lands in a slot, an async host-to-device copy of it starts on a stream and
    an event is recorded; the slot is refilled only after that event completed.
    """
    address: int
    size: int
    slot_bytes: int
    slots: int
    device: int
    pinned: bool
    pin_error: str | None
    fixed_buffers: bool
    io: Literal["io_uring", "threads"]
    driver: str
    last_error: str | None
    closed: bool
    poll_us: int
    def __init__(
        self,
        slots: int = 8,
        slot_bytes: int = 4 << 20,
        device: int = 0,
        engine: Engine | None = None,
        io_engine: Literal["auto", "io_uring", "threads"] = "auto",
    ) -> None: ...
    def read(self, ops: Sequence[Op], trace: bool = False, cancel_on_error: bool = True) -> list[int]:
        """ops are (fd, offset, length, device_pointer); per op bytes copied,
        -errno, -ECANCELED (stopped by another op's error) or -EIO (driver)."""
    def last_trace(self) -> list[tuple[int, str, int, int, int, int]]: ...
    def last_stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

def gpu_driver() -> dict:
    """Which GPU driver library was found, or why none."""
def uring_register_probe(address: int, length: int) -> int:
    """Registers memory with a throwaway ring: 0 or -errno (e.g. -EFAULT)."""
