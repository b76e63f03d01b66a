#!/usr/bin/env python3
"""Per-chunk cost of reading chunk files, cold, three ways, on the same medium:

  store        lmcache-fx's ChunkStore.read (the path LMCache's calls take)
  read_chunks  Engine.read_chunks: open, header + payload in one vectored
               read, header checks and close in C, one call per batch
  read_chunks_threads, read_chunks_noverify, read_chunks_16M_qd8[_noverify]
               the same on the thread engine, without CRC32C checks, and with
               pieces of up to 16 MiB at 8 in flight (about one read per
               chunk, as fs_native does) instead of the 1 MiB x 32 default
  store_noverify
               the store's read path with verification off. The files are
               the verify-on store's, flagged FLAG_CHECK_PAYLOAD on disk,
               which every reader checks: the *_noverify rows sum those
               payloads too (read_chunks_noverify after each batch, from
               memory; the store as checked reads)
  preadv[_crc] fx's own files read by the simplest one-request-per-chunk
               reader: open (O_DIRECT), one preadv of header and payload,
               close, one file after another on one thread (no hand-offs,
               nothing in flight but the one read), then with a CRC32C of the
               payload checked: a floor for any reader that opens each file
  fs_native    LMCache's C++ reader (lmcache.lmcache_fs.LMCacheFSClient, one
               whole-file O_DIRECT read per file on worker threads), on files
               it wrote itself with the same payload sizes; best of 4 and 8
               workers per repetition

For 4 KiB, 2 MiB and 64 MiB payloads on XFS on a RAM-backed loop device (root
only), page cache dropped before every read, methods interleaved, medians of
--reps, the order of the methods rotated every repetition. Prints µs per
chunk, GB/s, process CPU seconds per GB (all threads of this process,
io_uring's io-wq workers included; the loop device's kernel worker is not),
its ratio to fs_native's in the same repetition, and the context switches of
this process's threads per chunk (each one a sleep and a wake-up), and writes
--out (JSON with the command and commit).

    sudo .venv/bin/python scripts/chunk_overhead.py [--reps 5] [--out docs/chunk-overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache_fx import _fxio as fx  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta, chunk_digest  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing import loopfs  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
CASES = [(4 * KiB, 4096), (2 * MiB, 256), (64 * MiB, 14)]  # payload bytes, chunks


def rounded(n: int) -> int:
    return -(-n // 4096) * 4096


class FsNative:
    """LMCacheFSClient driven the way LMCache's native-connector L2 adapter
    drives it: submit a batch, wait on its eventfd, drain completions."""

    def __init__(self, base: str, workers: int):
        from lmcache.lmcache_fs import LMCacheFSClient

        os.makedirs(base, exist_ok=True)
        self.c = LMCacheFSClient(base, workers, "", True, 0)
        self.fd = self.c.event_fd()

    def _wait(self, fid: int) -> list:
        while True:
            select.select([self.fd], [], [], 1.0)
            for f, ok, err, bools in self.c.drain_completions():
                if int(f) == fid:
                    if not ok:
                        raise RuntimeError(f"fs_native batch failed: {err}")
                    return list(bools) if bools is not None else []

    def set(self, keys, views) -> list:
        return self._wait(int(self.c.submit_batch_set(keys, views)))

    def get(self, keys, views) -> list:
        return self._wait(int(self.c.submit_batch_get(keys, views)))

    def close(self):
        self.c.close()


def _switches() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw


def timed(fn):
    """(seconds, CPU seconds, context switches) of fn on a dropped cache."""
    loopfs.drop_caches()
    t0, c0, w0 = time.perf_counter(), time.process_time(), _switches()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0, _switches() - w0


def run_case(mnt: str, size: int, n: int, reps: int, log) -> dict:
    base = os.path.join(mnt, f"case-{size}")
    fxdir, fsdir = os.path.join(base, "fx"), os.path.join(base, "fs_native")
    os.makedirs(fxdir)
    span = rounded(size)
    dest = fx.HostBuffer(span * n)
    mv = memoryview(dest)
    mv[:] = b"\0" * len(dest)  # fault it in once: no page faults in the timed reads
    rng = os.urandom(min(size, 8 * MiB))
    payloads = []
    for i in range(n):
        off = i * span
        chunk = (rng * (-(-size // len(rng))))[:size]
        chunk = bytes([i & 0xFF]) + chunk[1:]
        mv[off : off + size] = chunk
        payloads.append(fx.crc32c(chunk))
    # fs_native wants LMCache's key wire format: model@rank@group@hash
    keys = [f"overhead@{0:08x}@0@{size:x}{i:08x}" for i in range(n)]
    meta = ChunkMeta(((size,),), ("uint8",), "raw")

    store = ChunkStore(FxOptions.from_mapping({"path": fxdir, "max_capacity_gb": 100, "verify": True}))
    unchecked = ChunkStore(FxOptions.from_mapping({"path": fxdir, "max_capacity_gb": 100, "verify": False}))
    clients: dict[int, FsNative] = {}
    try:
        return _measure(store, unchecked, clients, keys, meta, dest, mv, span, size, n, payloads, fsdir, reps, log)
    finally:
        unchecked.close()
        store.close()
        for c in clients.values():
            c.close()
        subprocess.run(["rm", "-rf", base], check=False)


def _measure(store, unchecked, clients, keys, meta, dest, mv, span, size, n, payloads, fsdir, reps, log) -> dict:
    for s in range(0, n, 256):
        ok = store.write([(keys[i], dest.address + i * span, size, meta) for i in range(s, min(n, s + 256))])
        assert all(ok), "store write failed"
    for w in (4, 8):
        clients[w] = FsNative(fsdir, w)
    views = [mv[i * span : i * span + size] for i in range(n)]
    assert all(clients[4].set(keys, views)), "fs_native write failed"

    def check():
        for i in (0, n // 2, n - 1):
            assert fx.crc32c(mv[i * span : i * span + size]) == payloads[i], f"chunk {i} differs"

    def clear():
        for i in (0, n // 2, n - 1):
            mv[i * span] = (i + 1) & 0xFF

    # (a) the store's read path (its index knows the chunks: a warm-up read first)
    def store_read(st=store):
        idx = iter(range(n))

        def allocate(_meta):
            i = next(idx)
            return i, dest.address + i * span, size

        out = st.read(keys, allocate, lambda h: None)
        assert all(o is not None for o in out), "store miss"

    # (b) read_chunks on the same files, digests and names computed per call
    eng = store.engine
    root = store.roots[0]
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    scratch = fx.HostBuffer(HEADER_SIZE * n, hugepages=False)
    thr = fx.Engine("threads", store.options.queue_depth, store.options.split_bytes)
    # whole-chunk pieces (up to 16 MiB), fewer in flight: what fs_native's one read per file does
    big = fx.Engine("auto", 8, 16 * MiB)

    def chunks_read(engine, verify=True):
        chunks = []
        for i, k in enumerate(keys):
            d = chunk_digest(k)
            chunks.append((rootfd, f"{d[:2]}/{d}.fxkv", dest.address + i * span, size))
        res = engine.read_chunks(chunks, scratch.address, verify=verify, direct=store.odirect)
        bad = [r for r in res if r[0] != 0]
        assert not bad, f"read_chunks: {bad[:3]}"

    # (c) one file after another: open, one preadv of header + payload, close
    paths = [store.path_for(chunk_digest(k)) for k in keys]
    hdr = memoryview(scratch)[:HEADER_SIZE]

    def preadv_read(crc=False):
        for i, path in enumerate(paths):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            try:
                got = os.preadv(fd, [hdr, views[i]], 0)
            finally:
                os.close(fd)
            assert got == HEADER_SIZE + size, f"short read of {path}: {got}"
            if crc:
                assert fx.crc32c_at(dest.address + i * span, size) == payloads[i], f"{path}: payload CRC32C differs"

    def fs_read(w):
        got = clients[w].get(keys, views)
        assert all(got), "fs_native miss"

    methods = {
        "store": store_read,
        "store_noverify": lambda: store_read(unchecked),
        "preadv": preadv_read,
        "preadv_crc": lambda: preadv_read(crc=True),
        "read_chunks": lambda: chunks_read(eng),
        "read_chunks_threads": lambda: chunks_read(thr),
        "read_chunks_noverify": lambda: chunks_read(eng, verify=False),
        "read_chunks_16M_qd8": lambda: chunks_read(big),
        "read_chunks_16M_qd8_noverify": lambda: chunks_read(big, verify=False),
        "fs_native_4": lambda: fs_read(4),
        "fs_native_8": lambda: fs_read(8),
    }
    for fn in methods.values():  # warm-up: indexes, rings, threads
        clear()
        fn()
        check()
    samples: dict[str, list] = {m: [] for m in methods}
    order = list(methods.items())
    for rep in range(reps):
        k = rep % len(order)  # rotated: the host's drift spreads over every method
        for name, fn in order[k:] + order[:k]:
            clear()
            samples[name].append(timed(fn))
            check()
        log(f"  {size // KiB} KiB x {n}: rep {rep + 1}/{reps} done")
    os.close(rootfd)
    thr.close()
    big.close()

    nbytes = size * n
    # fs_native: the faster of 4 and 8 workers in each repetition
    fsn = [a if a[0] <= b[0] else b for a, b in zip(samples["fs_native_4"], samples["fs_native_8"])]
    samples["fs_native_best"] = fsn
    out = {}
    for name, s in samples.items():
        out[name] = {
            "us_per_chunk": statistics.median(t for t, _, _ in s) / n * 1e6,
            "GBps": statistics.median(nbytes / t / 1e9 for t, _, _ in s),
            "cpu_s_per_GB": statistics.median(c / (nbytes / 1e9) for _, c, _ in s),
            "cpu_us_per_chunk": statistics.median(c for _, c, _ in s) / n * 1e6,
            "switches_per_chunk": statistics.median(w for _, _, w in s) / n,
            # each repetition's figure over fs_native's in the same repetition
            "cpu_over_fs_native": statistics.median(c / f[1] for (_, c, _), f in zip(s, fsn)),
            "speed_over_fs_native": statistics.median(f[0] / t for (t, _, _), f in zip(s, fsn)),
            "samples_s": [[round(t, 5), round(c, 5), w] for t, c, w in s],
        }
    return {"payload_bytes": size, "chunks": n, "methods": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "chunk-overhead.json"))
    ap.add_argument("--sizes", default="4K,2M,64M", help="which cases (4K, 2M, 64M)")
    args = ap.parse_args()
    why = loopfs.why_not_available()
    if why:
        print(f"chunk_overhead: needs XFS on a RAM loop device: {why}", file=sys.stderr)
        return 2
    want = {s.strip().upper() for s in args.sizes.split(",")}
    cases = [(s, n) for s, n in CASES if {4 * KiB: "4K", 2 * MiB: "2M", 64 * MiB: "64M"}[s] in want]
    commit = git_commit(ROOT, ("csrc", "lmcache_fx", "scripts")) or ""
    commit, dirty = commit.removesuffix("+dirty"), commit.endswith("+dirty")
    results = []
    with loopfs.xfs_loop("3G", touch=True) as mnt:
        for size, n in cases:
            results.append(run_case(mnt, size, n, args.reps, lambda m: print(m, file=sys.stderr, flush=True)))
    print(
        f"{'payload':>8} {'chunks':>6}  {'method':<28} {'us/chunk':>9} {'GB/s':>7} {'CPU s/GB':>9} "
        f"{'CPU/fs_native':>13} {'switches':>8}"
    )
    for r in results:
        for name, m in r["methods"].items():
            if name in ("fs_native_4", "fs_native_8"):
                continue
            label = "fs_native (best 4/8)" if name == "fs_native_best" else name
            sz = r["payload_bytes"]
            print(
                f"{(f'{sz // MiB} MiB' if sz >= MiB else f'{sz // KiB} KiB'):>8} {r['chunks']:>6}  {label:<28} "
                f"{m['us_per_chunk']:9.1f} {m['GBps']:7.2f} {m['cpu_s_per_GB']:9.3f} "
                f"{m['cpu_over_fs_native']:12.2f}× {m['switches_per_chunk']:8.2f}"
            )
    doc = {
        "command": " ".join(
            shlex.quote(a)
            for a in [sys.executable.replace(ROOT + "/", ""), os.path.relpath(__file__, ROOT), *sys.argv[1:]]
        ),
        "commit": commit,
        "worktree_dirty": dirty,
        "medium": "XFS on a RAM-backed loop device (/dev/shm image), page cache dropped before every read",
        "reps": args.reps,
        "statistic": "median over repetitions; methods interleaved within each repetition",
        "verify": "fx: CRC32C of every payload checked except the *_noverify rows; preadv_crc: CRC32C of each "
        "payload after its read; preadv and fs_native: none (fs_native has none)",
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_at_end": open("/proc/loadavg").read().split()[:3],
            "kernel": os.uname().release,
            "crc32c_impl": fx.CRC32C_IMPL,
        },
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
