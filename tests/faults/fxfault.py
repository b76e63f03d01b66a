"""Helpers and child processes for tests/test_reliability.py.

Run as a child: `python tests/faults/fxfault.py <role> <json-args>`; the child
prints lines (READY, DONE <i>, RESULT <json>) with flush, so a parent can kill
it at any moment and still know what it reported.

Payloads are deterministic: bytes 0..31 are a stamp (key digest, rank,
version), the rest comes from a PRNG seeded by the stamp, so any buffer can be
checked whole against what its stamp claims: a torn or foreign chunk is caught.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.chunkfile import SUFFIX, ChunkMeta, chunk_digest  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import TMP_MARK, ChunkStore  # noqa: E402

STAMP = struct.Struct("<16sII8x")  # key digest, rank, version


def figure(fault: str, trials, checked: str, **figures) -> None:
    """Prints one row of docs/reliability.md and records it for
    scripts/reliability.py (appended to $FX_RELIABILITY_OUT)."""
    row = {
        "fault": fault,
        "trials": trials,
        "checked": checked,
        "figures": figures,
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
    }
    print(f"\nRELIABILITY {json.dumps(row)}", flush=True)
    dest = os.environ.get("FX_RELIABILITY_OUT")
    if dest:
        with open(dest, "a") as f:
            f.write(json.dumps(row) + "\n")


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def payload(key: str, nbytes: int, version: int = 0, rank: int = 0) -> bytes:
    stamp = STAMP.pack(key_digest(key), rank, version)
    rest = random.Random(stamp).randbytes(max(nbytes - len(stamp), 0))
    return (stamp + rest)[:nbytes]


def meta_for(nbytes: int) -> ChunkMeta:
    return ChunkMeta(((nbytes,),), ("uint8",), "KV_2LTD")


def check(key: str, data, rank: int | None = None) -> str:
    """'ok', or why the bytes are not a whole chunk of this key."""
    data = bytes(data)
    if len(data) < STAMP.size:
        return "short"
    (
        kd,
        r,
        v,
    ) = STAMP.unpack_from(data, 0)
    if kd != key_digest(key):
        return "foreign-key"
    if rank is not None and r != rank:
        return "foreign-rank"
    if data != payload(key, len(data), v, r):
        return "torn"
    return "ok"


class Chunks:
    """Source buffers for writes: keeps HostBuffers alive for the batch."""

    def __init__(self):
        self.bufs = []

    def item(self, key: str, nbytes: int, version: int = 0, rank: int = 0):
        hb = _fxio.HostBuffer(max(nbytes, 1), hugepages=False)
        memoryview(hb)[:nbytes] = payload(key, nbytes, version, rank)
        self.bufs.append(hb)
        return (key, hb.address, nbytes, meta_for(nbytes))


def allocator():
    """allocate(meta) for ChunkStore.read: one HostBuffer per chunk."""

    def allocate(meta: ChunkMeta):
        n = 1
        for x in meta.shapes[0]:
            n *= x
        if n <= 0 or n > (1 << 30):
            return None
        hb = _fxio.HostBuffer(n, hugepages=False)
        return hb, hb.address, n

    return allocate


def refuse_threads(monkeypatch, name: str) -> None:
    """Thread.start raises, as where no thread can be started (a pids
    limit), for a thread named `name` or `name_<n>` (a pool's numbered
    threads: the loop's executor is "asyncio"); others start as usual.
    Undone by monkeypatch."""
    real_start = threading.Thread.start

    def start(self):
        if self.name == name or self.name.startswith(name + "_"):
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def resume(gen, res):
    """A read_steps generator whose pending batch gave `res`, wrapped as a
    fresh generator for drive_blocking (a test that acts between a read's
    steps takes the first one itself)."""
    while True:
        try:
            batch = gen.send(res)
        except StopIteration as stop:
            return stop.value
        res = yield batch


def read_check(store: ChunkStore, keys, rank: int | None = None) -> tuple[int, int, list]:
    """Reads keys; returns (hits, misses, [(key, problem)] for wrong chunks)."""
    got = store.read(list(keys), allocator(), lambda h: None)
    hits = misses = 0
    bad = []
    for k, h in zip(keys, got):
        if h is None:
            misses += 1
            continue
        hits += 1
        why = check(k, memoryview(h), rank)
        if why != "ok":
            bad.append((k, why))
    return hits, misses, bad


def reads_until(store: ChunkStore, keys, stop, seed: int, hits: list, wrong: list, pause: float = 0.0) -> None:
    """A reader thread's body: reads 3 random keys at a time until `stop`
    (an Event) is set, adding its hits to hits[0] and every wrong chunk to
    `wrong`."""
    rng = random.Random(seed)
    while not stop.is_set():
        h, _, bad = read_check(store, rng.sample(keys, 3))
        hits[0] += h
        wrong.extend(bad)
        if pause:
            time.sleep(pause)


def recompute_overtaken(store: ChunkStore) -> None:
    """store's periodic recompute, with another process's ledger change
    landing during its walk: it keeps the ledger and only takes the dead
    writers' temporaries it removes off it (the path where a temporary the
    ledger did not count became an undercount)."""
    real_walk = store._walk

    def walk_then_a_peer_changes_the_ledger(*a, **kw):
        found = real_walk(*a, **kw)
        with store._ledger.hold():
            store._ledger.add(0)
        return found

    store._walk = walk_then_a_peer_changes_the_ledger
    try:
        store._recompute()
    finally:
        store._walk = real_walk


def close_lmcache_during_a_read(eng, backend, engine, keys, attempts: int = 20):
    """Starts async loads of `keys` through `backend` (a storage plugin of
    LMCacheEngine `eng`) until one is in flight on `engine`, then closes
    LMCache's storage manager (its CPU tier first: the hook run before the
    pool is freed, then the pool's close). Returns [batches of `engine`
    running or queued when the pool closed], or None when no load was ever
    seen in flight. Root: the page cache is dropped before each try."""
    import asyncio

    from lmcache_fx.testing import loopfs

    sm = eng.storage_manager
    alloc = sm.storage_backends["LocalCPUBackend"].memory_allocator
    seen: list = []
    close_pool = alloc.close

    def close_seen():
        seen.append(sum(engine.batches_now))
        close_pool()

    alloc.close = close_seen
    for attempt in range(attempts):
        loopfs.drop_caches()  # the reads go to the disk, slower
        fut = asyncio.run_coroutine_threadsafe(backend.batched_get_non_blocking(f"lid-{attempt}", keys), sm.loop)
        end = time.monotonic() + 10
        while sum(engine.batches_now) == 0 and not fut.done() and time.monotonic() < end:
            time.sleep(0.0005)
        if sum(engine.batches_now):
            break
        for obj in fut.result(30):
            obj.ref_count_down()
    else:
        return None
    sm.close()
    fut.result(30)
    return seen


def set_format_version(path: str, version: int = 2) -> None:
    """Rewrites a chunk file's header as of another format version (a newer
    lmcache-fx's chunk), its header CRC made right, its mtime (the store's
    LRU clock) kept."""
    from lmcache_fx.core.chunkfile import HEADER_SIZE

    st = os.stat(path)
    with open(path, "r+b") as f:
        h = bytearray(f.read(HEADER_SIZE))
        struct.pack_into("<H", h, 8, version)
        struct.pack_into("<I", h, HEADER_SIZE - 4, _fxio.crc32c(bytes(h[: HEADER_SIZE - 4])))
        f.seek(0)
        f.write(h)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def open_store(path: str, **opts) -> ChunkStore:
    o = FxOptions.from_mapping({"path": path, **opts})
    return ChunkStore(o)


def chunk_files(path: str) -> list[str]:
    out = []
    for d in os.scandir(path):
        if d.is_dir(follow_symlinks=False) and len(d.name) == 2:
            out += [e.path for e in os.scandir(d.path) if e.name.endswith(SUFFIX)]
    return out


def tmp_files(path: str) -> list[str]:
    out = []
    for d in os.scandir(path):
        if d.is_dir(follow_symlinks=False) and len(d.name) == 2:
            out += [e.path for e in os.scandir(d.path) if TMP_MARK in e.name]
    return out


class LogCount(logging.Handler):
    """Counts lmcache_fx log records by level (pytest runs with -p no:logging)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def count(self, level: int, needle: str = "") -> int:
        return sum(1 for r in self.records if r.levelno == level and needle in r.getMessage())

    def __enter__(self):
        lg = logging.getLogger("lmcache_fx")
        self._old = lg.level
        lg.setLevel(logging.DEBUG)
        lg.addHandler(self)
        return self

    def __exit__(self, *a):
        lg = logging.getLogger("lmcache_fx")
        lg.removeHandler(self)
        lg.setLevel(self._old)


def mount_table(tmp_path, path: str, fstype: str, options: str) -> str:
    """A /proc/self/mountinfo (the kernel's format) whose one line puts
    `path`'s device under a mount of `fstype` with `options`; its path."""
    st = os.stat(path)
    line = f"61 1 {os.major(st.st_dev)}:{os.minor(st.st_dev)} / {path} rw,relatime - {fstype} srv:/export {options}\n"
    table = tmp_path / f"mountinfo-{fstype}-{len(os.listdir(tmp_path))}"
    table.write_text("22 1 0:21 / /proc rw - proc proc rw\n" + line)
    return str(table)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fds_of(kind: str) -> int:
    """Descriptors of this process whose link names `kind` (io_uring, eventfd)."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += kind in os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass
    return n


def rings() -> int:
    """io_uring instances open in this process (the engine pools them)."""
    return fds_of("io_uring")


def os_threads() -> int:
    """Threads of this process, without io_uring's kernel workers (iou-wrk-*,
    which the kernel starts and retires on its own) and without the engine's
    idle batch runners (kept for the next submit and retired after 10 s idle,
    as the engine pools its rings: csrc/runner.c)."""
    n = -_fxio._runners_idle()
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().startswith("iou-"):
                    continue
        except OSError:
            continue  # exited meanwhile
        n += 1
    return n


def thread_names() -> list[str]:
    """The names (comm) of this process's threads, sorted: what a change in
    os_threads() was."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # exited meanwhile
    return sorted(names)


def os_threads_at_rest(settle: float = 0.3, limit: float = 10.0) -> int:
    """os_threads() once the count holds still for `settle` s. pthread_join
    (and Thread.join) return when the thread has cleared its tid, a moment
    before the kernel drops its task from /proc/self/task, and a runner that
    retires leaves the idle count a moment before its task goes; so a stable
    reading is the true one."""
    n, since, t_end = os_threads(), time.monotonic(), time.monotonic() + limit
    while time.monotonic() < t_end:
        time.sleep(0.05)
        m = os_threads()
        if m != n:
            n, since = m, time.monotonic()
        elif time.monotonic() - since >= settle:
            break
    return n


# --------------------------------------------------------------- seccomp
def deny_io_uring(err: int = 1, calls: tuple = (425, 426, 427)) -> None:
    """Installs a seccomp filter failing the io_uring system calls `calls`
    (io_uring_setup 425, io_uring_enter 426, io_uring_register 427: all by
    default) with errno `err` (1 = EPERM, as Docker's default profile;
    38 = ENOSYS)."""
    import platform

    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
    LD, JEQ, RET = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    allow, deny = 0x7FFF0000, 0x00050000 | err
    n = len(calls)
    prog = [(LD, 0, 0, 4), (JEQ, 0, n + 1, arch), (LD, 0, 0, 0)]  # arch (else allow), then the number
    prog += [(JEQ, n - i, 0, nr) for i, nr in enumerate(calls)]  # one of them: to the deny
    prog += [(RET, 0, 0, allow), (RET, 0, 0, deny)]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    arr = (SockFilter * len(prog))(*[SockFilter(*p) for p in prog])
    fprog = SockFprog(len(prog), arr)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if libc.prctl(38, 1, None, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    if libc.prctl(22, 2, ctypes.cast(ctypes.byref(fprog), ctypes.c_void_p), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


# --------------------------------------------------------------- loop devices
def _run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def failing_xfs(size_outer="400M", size_inner="320M"):
    """XFS on a loop device whose backing file lives on a second XFS (itself on
    a /dev/shm loop). Yields (mountpoint, fail): fail() shuts the outer
    filesystem down, so every block I/O of the inner device returns EIO -
    a real device-level error under the store's filesystem. Removes only what
    it made."""
    import tempfile

    work = tempfile.mkdtemp(prefix="fx-eio-", dir="/dev/shm")
    outer_img = os.path.join(work, "outer.img")
    outer_mnt, inner_mnt = os.path.join(work, "outer"), os.path.join(work, "inner")
    os.makedirs(outer_mnt)
    os.makedirs(inner_mnt)
    made = []  # undo steps, last first
    try:
        with open(outer_img, "wb") as f:
            f.truncate(int(size_outer[:-1]) << 20)
        a = _run("losetup", "-f", "--show", outer_img)
        made.append(("losetup", "-d", a))
        _run("mkfs.xfs", "-q", "-f", a)
        _run("mount", a, outer_mnt)
        made.append(("umount", outer_mnt))
        inner_img = os.path.join(outer_mnt, "inner.img")
        with open(inner_img, "wb") as f:
            f.truncate(int(size_inner[:-1]) << 20)
        b = _run("losetup", "-f", "--show", inner_img)
        made.append(("losetup", "-d", b))
        _run("mkfs.xfs", "-q", "-f", b)
        _run("mount", b, inner_mnt)
        made.append(("umount", inner_mnt))

        def fail():
            _run("xfs_io", "-x", "-c", "shutdown", outer_mnt)

        yield inner_mnt, fail
    finally:
        for cmd in reversed(made):
            subprocess.run(cmd, check=False, capture_output=True)
        import shutil

        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------- children
def out(*a):
    print(*a, flush=True)


def child_writer(a):
    """Stores chunks of one trial until killed (or done); DONE <i> after each
    completed store."""
    if a.get("sub_batches"):  # batches of more than 4 chunks go in overlapped sub-batches of 4
        from lmcache_fx.core import store as store_mod

        store_mod.WRITE_SUB_BYTES, store_mod.WRITE_SUB_CHUNKS = 4096, 4
    store = open_store(a["path"], **a.get("opts", {}))
    rng = random.Random(a["seed"])
    if a.get("kill_after_sizing"):
        kill_after_first_ftruncate()
    if a.get("pause_at") is not None:
        pause_in_commit(store, lambda n: n == a["pause_at"], resume_on_stdin=a.get("resume_on_stdin", False))
    out("READY")
    i = 0
    while i < a["n"]:
        batch = []
        src = Chunks()
        for _ in range(rng.randint(1, a.get("batch_max", 6))):
            if i >= a["n"]:
                break
            size = rng.choice([65536, 262144, 1 << 20, 4096 * rng.randint(1, 300) + rng.randint(1, 4095)])
            if a.get("large") and rng.random() < 0.1:  # above 8 MiB: written in checksummed segments
                size = (8 << 20) + 4096 * rng.randint(1, 256)
            batch.append((i, src.item(f"crash/{a['seed']}/{i}", size)))
            i += 1
        ok = store.write([it for _, it in batch])
        for (j, _), good in zip(batch, ok):
            if good:
                out(f"DONE {j}")
    out("FINISHED")


def kill_after_first_ftruncate() -> None:
    """Test-only fault hook for this process: the first ftruncate (a store
    sizing its first temporary in the reservation) completes, then the
    process dies by SIGKILL before anything else runs."""
    real = os.ftruncate

    def ftruncate(fd, length):
        real(fd, length)
        os.kill(os.getpid(), signal.SIGKILL)

    os.ftruncate = ftruncate


def pause_in_commit(store, when, resume_on_stdin: bool = False) -> None:
    """Test-only fault hook, on this store object only: the `when(n)`-th
    batch (or sub-batch) stops between writing its temporaries and renaming
    them into place (prints MIDWRITE and sleeps until killed, or with
    `resume_on_stdin` until a line comes on stdin), so a SIGKILL lands
    mid-write whatever the machine's speed; with overlapped sub-batches the
    next one's writes are then in flight too."""
    real = store._commit
    count = [0]

    def commit(files, ready, out_):
        count[0] += 1
        if ready and when(count[0]):
            out("MIDWRITE")
            if resume_on_stdin:
                sys.stdin.readline()
            else:
                while True:
                    time.sleep(3600)
        return real(files, ready, out_)

    store._commit = commit


def child_conc(a):
    """One process of the concurrency test: writer, churn, reader or remover."""
    role, path, rank = a["role"], a["path"], a.get("rank", 0)
    nkeys, size = a["nkeys"], a["size"]
    rng = random.Random(a["seed"])
    store = open_store(path, split_bytes="64K", queue_depth=8)
    keys = [f"model@2@{rank}@{h:016x}@bfloat16" for h in range(nkeys)]
    end = time.monotonic() + a["seconds"]
    st = {
        "role": role,
        "rank": rank,
        "writes": 0,
        "reads": 0,
        "hits": 0,
        "misses": 0,
        "bad": [],
        "done": [],
        "removed": 0,
    }
    out("READY")
    if role == "reader":
        time.sleep(a.get("delay", 0))
    while time.monotonic() < end:
        if role == "writer":
            pick = rng.sample(keys, 4)
            src = Chunks()
            ok = store.write([src.item(k, size, 0, rank) for k in pick])
            st["writes"] += 1
            st["done"] += [k for k, g in zip(pick, ok) if g]
        elif role == "churn":  # replaces chunks with new versions while others read them
            k = rng.choice(keys)
            # Forget it without unlinking, so the rename replaces the file under the readers.
            store._drop(chunk_digest(k), unlink=False)
            src = Chunks()
            store.write([src.item(k, size, rng.randint(1, 1 << 30), rank)])
            st["writes"] += 1
        elif role == "remover":  # deletes files behind the readers' backs
            files = chunk_files(path)
            if files:
                try:
                    os.unlink(rng.choice(files))
                    st["removed"] += 1
                except FileNotFoundError:
                    pass
            time.sleep(0.02)
        else:  # reader
            pick = rng.sample(keys, rng.randint(1, 4))
            h, m, bad = read_check(store, pick, rank)
            st["reads"] += 1
            st["hits"] += h
            st["misses"] += m
            st["bad"] += bad
    st["done"] = sorted(set(st["done"]))
    out("RESULT " + json.dumps(st))


def child_noring(a):
    """Store and read back under a seccomp filter denying io_uring (or not)."""
    if a.get("deny") is not None:
        deny_io_uring(a["deny"], tuple(a.get("calls", (425, 426, 427))))
    from lmcache_fx.core.options import ConfigError

    with LogCount() as logs:
        usable, why = _fxio.io_uring_status()
        res = {"io_uring_usable": usable, "why": why}
        try:
            open_store(a["path"] + "-strict", io_engine="io_uring")
            res["strict"] = "started"
        except ConfigError as e:
            res["strict"] = str(e)
        stores = [open_store(a["path"]) for _ in range(2)]  # two instances: still one warning
        res["kinds"] = [s.engine.kind for s in stores]
        res["fallback_reason"] = stores[0].engine.fallback_reason
        src = Chunks()
        keys = [f"noring/{i}" for i in range(12)]
        ok = stores[0].write([src.item(k, 262144 + 4096 * i + i) for i, k in enumerate(keys)])
        res["stored"] = sum(ok)
        got = stores[1].read(keys, allocator(), lambda h: None)
        digest = hashlib.sha256()
        bad = 0
        for k, h in zip(keys, got):
            if h is None or check(k, memoryview(h)) != "ok":
                bad += 1
            else:
                digest.update(bytes(memoryview(h)))
        res["bad"] = bad
        res["digest"] = digest.hexdigest()
        res["warnings"] = logs.count(logging.WARNING, "io_uring unavailable")
        for s in stores:
            s.close()
    if a.get("plugin"):
        res["plugin"] = plugin_round_trip(a["path"] + "-plugin", a["workdir"])
    out("RESULT " + json.dumps(res))


def plugin_round_trip(store_path, workdir):
    """A real LMCacheEngine storing and retrieving 1024 tokens through fx."""
    import torch

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

    geo = Geometry(layers=2, kv_heads=2, head_dim=64)
    cfg = config_from_dict(fx_config(store_path, cpu_gb=0.05), workdir)
    tokens = torch.arange(1024) % 5000
    kv = KV(geo, 1024, seed=7)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, tokens, kv, be)
        got = kv.empty_like()
        n = retrieve(eng, tokens, got)
        return {
            "engine": be.store.engine.kind,
            "tokens": n,
            "equal": kv.tokens_equal(got, n),
            "chunks_read": be.store.stats.chunks_read,
        }


def child_plugin_writer(a):
    """Stores prompts through a real LMCacheEngine with fx until killed."""
    import torch

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

    geo = Geometry(layers=2, kv_heads=2, head_dim=64)
    cfg = config_from_dict(fx_config(a["path"], cpu_gb=0.05), a["workdir"])
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        if a["role"] == "store":
            armed = [False]
            if a.get("pause_after") is not None:  # the next store after that many prompts stops mid-write
                pause_in_commit(be.store, lambda n: armed[0])
            out("READY")
            for j, i in enumerate(range(a.get("base", 0), a["n"])):
                armed[0] = a.get("pause_after") is not None and j >= a["pause_after"]
                store_and_wait(eng, torch.arange(512) + 10000 * i, KV(geo, 512, seed=i), be)
                out(f"DONE {i}")
            out("FINISHED")
        else:
            res = {"full": 0, "partial": 0, "none": 0, "wrong": 0}
            for i in range(a.get("base", 0), a["n"]):
                kv = KV(geo, 512, seed=i)
                got = kv.empty_like()
                n = retrieve(eng, torch.arange(512) + 10000 * i, got)
                if n and not kv.tokens_equal(got, n):
                    res["wrong"] += 1
                res["full" if n == 512 else "partial" if n else "none"] += 1
                res.setdefault("got", []).append(n)
            out("RESULT " + json.dumps(res))


def child_soak(a):
    """Mixed stores and retrieves at `conc` concurrent requests for `seconds`;
    samples RSS, fds and threads. 1/4 of the requests use the async path."""
    import asyncio
    import threading

    store = open_store(a["path"], max_capacity_gb=a["cap_gb"], queue_depth=16)
    nkeys, conc = a["nkeys"], a["conc"]
    keys = [f"soak/{i}" for i in range(nkeys)]
    sizes = [65536, 262144, 4096 * 37 + 123]
    stop = threading.Event()
    lock = threading.Lock()
    tot = {"stores": 0, "retrieves": 0, "hits": 0, "misses": 0, "wrong": 0, "errors": 0}
    errs: list = []

    def one(rng, use_async, loop):
        if rng.random() < 0.4:
            src = Chunks()
            pick = rng.sample(range(nkeys), rng.randint(1, 4))
            store.write([src.item(keys[i], sizes[i % 3]) for i in pick])
            with lock:
                tot["stores"] += 1
        else:
            pick = [keys[i] for i in rng.sample(range(nkeys), rng.randint(1, 8))]
            if use_async:
                got = loop.run_until_complete(store.read_async(pick, allocator(), lambda h: None))
            else:
                got = store.read(pick, allocator(), lambda h: None)
            h = sum(1 for g in got if g is not None)
            w = sum(1 for k, g in zip(pick, got) if g is not None and check(k, memoryview(g)) != "ok")
            with lock:
                tot["retrieves"] += 1
                tot["hits"] += h
                tot["misses"] += len(pick) - h
                tot["wrong"] += w

    def worker(n):
        rng = random.Random(n)
        use_async = n % 4 == 0
        loop = asyncio.new_event_loop() if use_async else None
        try:
            while not stop.is_set():
                try:
                    one(rng, use_async, loop)
                except Exception:
                    with lock:
                        tot["errors"] += 1
                        if len(errs) < 5:
                            errs.append(traceback.format_exc()[-600:])
        finally:
            if loop:
                loop.close()

    import gc

    def phase(seconds, samples=None):
        stop.clear()
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(conc)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(1.0)
            if samples is not None:
                samples.append((round(time.monotonic() - t0, 1), rss_bytes(), open_fds(), os_threads()))
        stop.set()
        for t in threads:
            t.join(60)
        gc.collect()
        return sum(t.is_alive() for t in threads)

    cold = (rss_bytes(), open_fds(), os_threads_at_rest())
    alive = phase(a.get("warmup", 3))  # fills the ring pool, allocator arenas, the LRU
    start = (rss_bytes(), open_fds(), os_threads_at_rest(), rings())
    names_start = thread_names()
    samples = []
    alive += phase(a["seconds"], samples)
    end = (rss_bytes(), open_fds(), os_threads_at_rest(), rings())
    names_end = thread_names()
    fd_kinds = sorted(
        os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}")
    )
    files = chunk_files(a["path"])
    res = dict(
        tot,
        error_samples=errs,
        fd_kinds=fd_kinds,
        start=start,
        end=end,
        threads_start=names_start,
        threads_end=names_end,
        idle_runners=_fxio._runners_idle(),
        samples=samples,
        usage=store.usage_bytes,
        files_bytes=sum(os.path.getsize(f) for f in files),
        cap=store.options.max_capacity_bytes,
        stats=store.stats.snapshot(),
        alive=alive,
        cold=cold,
    )
    store.close()
    out("RESULT " + json.dumps(res))


ROLES = {
    "writer": child_writer,
    "conc": child_conc,
    "noring": child_noring,
    "plugin": child_plugin_writer,
    "soak": child_soak,
}


def spawn(role: str, args: dict, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false", PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), role, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def result_of(p: subprocess.Popen, timeout: float = 120) -> dict:
    so, se = p.communicate(timeout=timeout)
    line = [x for x in so.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise AssertionError(f"child failed rc={p.returncode}: {se[-3000:]}")
    return json.loads(line[-1][7:])


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
