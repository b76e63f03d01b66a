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
from collections.abc import Buffer, Sequence
from typing import Literal, overload

Op = tuple[int, int, int, int]

DIO_ALIGN: int  # 4096
HAVE_LIBURING: int  # 1 when built with liburing (io_uring engine present)
CRC32C_IMPL: str  # "sse4.2", "armv8-crc" or "table"

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
