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
from typing import Any, Literal, Optional, overload

from typing_extensions import Buffer

Op = tuple[int, int, int, int]
# (dir_fd, name, address, length) or with the expected JSON body: (..., expect)
Chunk = tuple[int, str | bytes, int, int] | tuple[int, str | bytes, int, int, bytes | None]
ChunkResult = tuple[int, int, int, int, int]  # (status, nbytes, st_dev, st_ino, st_size)
WriteChunk = tuple[int, int, int, int, int]  # (fd, address, length, header_address, mtime_ns or 0)
WriteChunkResult = tuple[int, int, int, int]  # (payload bytes or -errno, header bytes or -errno, crc32c, clock)

CHUNK_OK: int  # 0
CHUNK_SHORT: int  # header or payload came back short (st_size tells a short file from a short read)
CHUNK_BAD_MAGIC: int
CHUNK_BAD_CRC: int  # header CRC32C
CHUNK_VERSION: int  # a well-formed header of another format version
CHUNK_BAD_HEADER: int  # header size or meta length out of range
CHUNK_LENGTH: int  # payload length is not the destination's
CHUNK_META: int  # JSON body differs from `expect`
CHUNK_PAYLOAD_CRC: int
CHUNK_STATUS_NAMES: tuple[str, ...]  # code -> name
CHUNK_HEADER_SIZE: int  # 4096

DIO_ALIGN: int  # 4096
HAVE_LIBURING: int  # 1 when built with liburing (io_uring engine present)
CRC32C_COPY_ONE_PASS: int  # 1: mapped reads copy and sum in one pass (512-bit folding, streaming stores)
WHOLE_MAX: int  # largest O_DIRECT payload read whole when busy (whole_when_busy), in bytes
FIXED_PER_RING_MAX: int  # largest table registered on every ring where the kernel cannot clone one (256 MiB)
CRC32C_IMPL: str  # best first: "vpclmulqdq+crc32q", "pclmulqdq+crc32q", "sse4.2", "armv8-pmull", "armv8-crc", "table"

def _fault_counts() -> dict[str, int]: ...  # tests: times each LMCACHE_FX_FAULT point fired

class Engine:
    kind: Literal["io_uring", "threads"]
    queue_depth: int
    split_bytes: int
    threads: int  # I/O threads of the thread engine, else 0
    runner_nice: int  # priority steps a submitted batch's runner thread runs below the submitter
    max_running: int  # submitted batches run at once, the rest wait in arrival order (0: no bound)
    whole_when_busy: bool  # small O_DIRECT payloads as one request when other submitted batches run or wait
    batches_now: tuple[int, int]  # (running, waiting) submitted batches, counted where max_running bounds them
    fallback_reason: str | None  # why io_engine="auto" is not using io_uring
    registered: bool  # a fixed buffer is registered with io_uring
    closed: bool
    def __init__(
        self,
        io_engine: Literal["auto", "io_uring", "threads"] = "auto",
        queue_depth: int = 32,
        split_bytes: int = 1 << 20,
        threads: int = 0,
        staged: bool = True,
        runner_nice: int = 0,
        max_running: int = 0,
        whole_when_busy: bool = True,
    ) -> None:
        """'io_uring' raises OSError when io_uring cannot be set up; 'auto'
        falls back to the thread engine and records fallback_reason.
        threads=0 means min(queue_depth, 16). staged: pieces of 64 KiB or more
        read from memory with a CRC32C are read through a staging buffer of
        the reading thread's and copied on with their sum in one pass, where
        the CPU has that copy (CRC32C_COPY_ONE_PASS); False reads them into
        the destination and sums them there (for comparisons). runner_nice
        (0..19): a submitted batch runs on a runner thread (named fx-runner)
        that many priority steps below the thread that submitted it.
        max_running (0..1024): at most that many submitted batches run at
        once; a batch submitted beyond them waits, and the runners that
        finish take the waiting ones oldest first (0: every batch at once).
        whole_when_busy: a submitted batch that starts while others run or
        wait (under max_running) reads each O_DIRECT payload of at most 2 MiB
        in place as one request instead of split_bytes pieces."""
    @overload
    def read(
        self, ops: Sequence[Op], crc: Literal[False] = False, split: int = 0, stage: bool = False
    ) -> list[int]: ...
    @overload
    def read(self, ops: Sequence[Op], crc: Literal[True], split: int = 0, stage: bool = False) -> list[tuple[int, int]]:
        """With crc, each result is (bytes or -errno, CRC32C of the bytes).
        split: the largest piece for this call (0: split_bytes). stage (io_uring
        engine, with crc): pieces of 64 KiB to 1 MiB from O_DIRECT fds not on
        a memory filesystem are read into 1 MiB slots of the process's
        staging pool (16 MiB, in cache, shared by concurrent reads; at most
        8 a read; a piece finding none free waits for one of its read's own,
        or reads in place when the read holds none) and copied to their
        destination with their CRC32C in one pass, as each lands."""
    @overload
    def write(self, ops: Sequence[Op], crc: Literal[False] = False, split: int = 0) -> list[int]: ...
    @overload
    def write(self, ops: Sequence[Op], crc: Literal[True], split: int = 0) -> list[tuple[int, int]]: ...
    def submit(
        self, ops: Sequence[Op], write: bool = False, crc: bool = False, notify: Notifier | None = None
    ) -> Batch:
        """Runs the batch on a C thread (a runner kept between batches); await Batch.fileno() becoming readable
        (with `notify`, the Notifier's eventfd, shared with other batches)."""
    def read_chunks(
        self,
        chunks: Sequence[Chunk],
        scratch: int,
        verify: bool = False,
        direct: bool = False,
        lock: bool = False,
        mapped: bool = False,
        stage: bool = False,
    ) -> list[ChunkResult]:
        """Reads whole chunk files (csrc/chunks.c), one call per batch, the GIL
        released. Per chunk (dir_fd, name, address, length[, expect]): opens
        `name` relative to dir_fd with O_RDONLY|O_NOFOLLOW|O_CLOEXEC
        [|O_DIRECT], following no symlink anywhere in name (-ELOOP) and never
        leaving dir_fd (-EXDEV); fstat; reads the 4096-byte header into
        scratch + i * 4096 and `length` payload bytes from offset 4096 into
        address in one vectored read (larger payloads go on in split_bytes
        pieces); checks the header in C as chunkfile.decode_header does
        (magic, header CRC32C, format version, sizes), then that its payload
        length is `length`, that its JSON body is exactly `expect` (bytes;
        None: not checked), and with verify the payload CRC32C; closes. With
        `lock`, each file gets an OFD read lock after its open, held until
        its close: -ESTALE when a writer holds a lock on it (an evicted file
        being rewritten with another chunk; one rewritten before the lock
        holds that chunk's key, which `expect` or the caller checks). With
        `mapped`, files of 2 MiB or more read from memory (tmpfs, ramfs, the
        page cache) are mapped and their pieces copied from the mapping, each
        checksummed in the same pass; a piece whose source faults (the file
        truncated meanwhile: SIGBUS, caught) is read as without it. With
        `stage`, `verify` and `direct`, payload pieces go through staging
        slots, as Engine.read's `stage` (io_uring engine).
        Opens run on a few threads (a cold open waits for its inode) while
        the previous files are read. Returns per chunk (status, payload bytes
        or -errno, st_dev, st_ino, st_size): status 0 (CHUNK_OK), -errno, or
        a CHUNK_* code (CHUNK_STATUS_NAMES[code]); st_* are 0 / -1 when no
        file was opened. scratch: 4096-aligned, len(chunks) * 4096 bytes."""
    def write_chunks(self, chunks: Sequence[WriteChunk], direct: bool = False) -> list[WriteChunkResult]:
        """Writes chunk files (csrc/chunk_write.c), one call per batch, the GIL
        released, each chunk as one pipeline on the engine's threads: its
        `length` payload bytes from address to offset 4096 of fd (one write;
        `direct`: fd has O_DIRECT), the payload's CRC32C into the header the
        caller encoded at header_address (4096-aligned) and the header's own
        CRC over that, the header to offset 0, then with mtime_ns > 0 the
        file's mtime. Returns per chunk (payload bytes or -errno, header bytes
        or -errno (0: not reached), CRC32C of the payload, clock: 1 set, 0 not
        asked or not reached, -errno). The caller renames the files."""
    def submit_chunks(
        self,
        chunks: Sequence[Chunk],
        scratch: int,
        verify: bool = False,
        direct: bool = False,
        lock: bool = False,
        mapped: bool = False,
        stage: bool = False,
        notify: Notifier | None = None,
    ) -> Batch:
        """read_chunks on a C thread; Batch.wait() returns its results.
        `notify` as for submit()."""
    def register_buffer(self, buffer: int | Buffer, length: int | None = None, /) -> int:
        """Registers memory as io_uring fixed buffers (pieces inside it use
        READ_FIXED). 0 or -errno (-ENOMEM without CAP_IPC_LOCK, -ENOSYS on
        the thread engine, -EOPNOTSUPP for more than 256 MiB in all on a
        kernel before 6.12, where each ring would pin it again); failure
        only means plain reads. (0, 0) clears. Given a writable buffer
        object (a HostBuffer), the engine holds it until the registration is
        replaced or cleared or the engine closes; given an address (memory
        of another owner: a tensor, LMCache's pool), the owner must clear the
        registration before freeing it, or reads into whatever is mapped
        there next land in the old pinned pages."""
    def close(self) -> None:
        """Waits for running batches, then frees rings and threads."""

class Batch:
    def fileno(self) -> int:
        """An eventfd that becomes readable when the batch is done: its own,
        or the Notifier's it was submitted with."""
    def done(self) -> bool: ...
    def wait(self) -> list[int] | list[tuple[int, int]] | list[ChunkResult]:
        """Blocks (without the GIL) until done; returns the results (OSError
        ECANCELED when cancel() stopped it before it ran)."""
    def cancel(self) -> bool:
        """True when the batch was still waiting for a runner (its engine's
        max_running reached): it ends at once, nothing read. False when it
        has started or finished: a running read stops where it is (what is
        in flight completes; pieces and chunk files not yet begun end
        ECANCELED), wait() for it as before."""

class Notifier:
    """One eventfd that every batch submitted with notify=it signals when
    done, so an event loop watches one descriptor for all of them; each such
    batch holds a reference, so it stays open until they are joined."""
    def fileno(self) -> int: ...
    def drain(self) -> int:
        """Resets the eventfd; the signals since the last drain (0: none, without blocking)."""

class HostBuffer(Buffer):
    """Anonymous memory, 4 KiB-aligned; 2 MiB-aligned with MADV_HUGEPAGE
    when hugepages (default for size >= 2 MiB)."""

    address: int
    def __init__(self, size: int, hugepages: bool = ...) -> None: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

def crc32c(data: Buffer, value: int = 0, impl: str | None = None) -> int: ...
def crc32c_at(address: int, length: int, value: int = 0, impl: str | None = None) -> int: ...
def crc32c_impls() -> list[str]: ...
def utime_beneath(items: Sequence[tuple[int, str, int]]) -> int: ...
def rename_noreplace(dir_fd: int, src: str, dst: str) -> None: ...
def stat_beneath(
    items: Sequence[tuple[int, str]], stop_at_missing: bool = False
) -> list[Optional[tuple[int, int, int, int, int]]]: ...
def crc32c_copy(dst: int, src: int, length: int, value: int = 0) -> int:
    """Copies length bytes from address src to address dst; returns their
    CRC32C (continuing value), computed while copying where CRC32C_COPY_ONE_PASS."""

def _uring_peak_inflight() -> int:
    """Most pieces one io_uring run had out at once since the last call (tests)."""

def uring_sync_pieces() -> int:
    """io_uring pieces the kernel cancelled because no io-wq worker could be
    started for them (a pids limit with no task to spare), then run on the
    reaping thread: non-zero means the engine ran short of kernel workers."""

def _uring_last_end() -> int:
    """The engine's slots returned so far when this thread's last io_uring
    run returned its last: where it ended in the engine's work (tests)."""

def _runners_idle() -> int:
    """Batch runner threads waiting for the next submit (tests)."""

def _runners_started() -> int:
    """Batch runner threads started in this process so far (tests)."""

def _helper_waves() -> int:
    """Waves of chunk files read_chunks read on its second lane (a runner
    beside the calling thread) so far (tests)."""

def map_stats() -> tuple[int, int]:
    """(pieces copied from a file mapping, copies whose source faulted and
    were read instead), since the module was loaded."""

def whole_payloads() -> int:
    """O_DIRECT payloads of at most 2 MiB that a submitted read, started
    while other submitted reads ran or waited, read as one request instead
    of split_bytes pieces, since the module was loaded."""

def direct_staged_pieces() -> int:
    """O_DIRECT pieces the io_uring engine read through a staging slot
    (stage=True), since the module was loaded."""

def io_uring_shares_buffers() -> bool:
    """Whether the kernel clones one io_uring ring's fixed buffers into
    another (IORING_REGISTER_CLONE_BUFFERS, Linux 6.12+). Without it each
    ring would pin a registration again, so a table over FIXED_PER_RING_MAX
    is not registered (register_buffer: -EOPNOTSUPP)."""

def stage_prepare(devices: int = 1, /) -> int:
    """Makes the io_uring engine's staging buffers now, rather than at the
    first staged read (their 2 MiB pages may need the kernel to compact
    memory first): two for each of the `devices` a store stripes over, at
    most 16 (eight devices), and lets reads use that many; returns how many this process has
    (0 without io_uring)."""

def _stage_buffers() -> int:
    """8 MiB buffers of staging slots the io_uring engine has made in this
    process (two, or two per device of the widest staging store opened, at
    most 16; made as reads need their slots or by stage_prepare, kept for
    its life)."""

def staged_pieces() -> int:
    """Pieces read from memory through a staging buffer of the reading
    thread's and copied on with their CRC32C, since the module was loaded."""

def last_read_chunks_ns() -> tuple[int, int]:
    """This thread's last Engine.read_chunks call: (ns in the engine, ns
    waiting for the GIL after it)."""

def _set_one_lane(one: bool) -> bool:
    """True: every read_chunks call reads its waves one after another on
    the calling thread, as before they went down two lanes (probes and
    tests); returns the previous setting."""

def _set_piece_order(ops: bool) -> bool:
    """True keeps every read's pieces in op order (probes, tests); returns the previous setting."""
    ...

def _piece_order(ops: Sequence[tuple[int, int, int, int]], split: int) -> list[tuple[int, int]]:
    """(op, offset) of each piece of a read of ops, in the order the io_uring engine queues them (tests)."""
    ...

def crc_spread_runs() -> int:
    """io_uring batches whose landed pieces were checksummed on several threads."""

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
    fixed_error: str | None
    io: Literal["io_uring", "threads"]
    io_error: str | None  # why reads run on threads where io_uring was asked for
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
    def read(
        self,
        ops: Sequence[Op],
        trace: bool = False,
        cancel_on_error: bool = True,
        stream: int = 0,
        sync: bool = True,
        crc: bool = False,
        why: bool = False,
    ) -> Any:
        """ops are (fd, offset, length, device_pointer); per op bytes copied,
        -errno, -ECANCELED (stopped by another op's error) or -EIO (driver);
        (bytes, CRC32C) per op with crc; why=True: (that list, this read's
        first error or None)."""
    def last_trace(self) -> list[tuple[int, str, int, int, int, int]]: ...
    def last_stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...

def gpu_driver() -> dict:
    """Which GPU driver library was found, or why none."""

def uring_register_probe(address: int, length: int) -> int:
    """Registers memory with a throwaway ring: 0 or -errno (e.g. -EFAULT)."""
