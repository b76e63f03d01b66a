#!/usr/bin/env python3
"""What recording a checksum costs a store on this medium (root: XFS on a
RAM-backed loop device): fx's ChunkStore.write beside writers that do what
fs_native does (a temporary, one O_DIRECT write of the whole payload, a
rename) with and without a CRC32C of what they write, the same with fx's
other file steps per chunk, and beside fs_native itself (LMCache's C++
client, driven directly, 8 workers, O_DIRECT).

The store side of scripts/store_probe.py's reads: on this VM the loop
device's "device" is a copy on the same 2 cores, so a writer's own CPU and
memory traffic are taken from the medium. If writers that checksum run as
far behind plain writers as fx runs behind fs_native, the gap is the check's
cost here, not fx's writer; what fx runs behind the writer that also takes
fx's file steps is its Python, ledger and lock.

Every mode writes the same chunks from one huge-page source, interleaved in
an order rotated each rep; each rep's files are removed (outside the timing)
before the next mode writes.

    .venv/bin/python scripts/store_check_probe.py --reps 15 --json docs/bench-repeats/store-check/<commit>-run1.json

--staged adds writers that copy each segment (2 MiB, 256 KiB) into a
staging buffer of their own with its CRC32C in one pass and write from
there: the mirror of fx's staged reads, so that the loop's copy would read
from cache.

--loop-busy also records, per write, the share of time the loop device had
a write in flight (/sys/block/loopN/inflight read every 0.5 ms by a process
of its own, started before and stopped after the timing): how much of a
write the writers keep the medium busy.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.chunkfile import ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing.loopfs import xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import cpu_seconds, host_ticks  # noqa: E402

MIB = 1 << 20
HEADER = 4096  # fx's chunk header
SEGMENT = 2 * MIB  # fx's segment of a large O_DIRECT payload (csrc/chunk_write.c)
THREADS = 8  # fs_native's workers in the bench, and fx's writer threads
_libc = ctypes.CDLL(None, use_errno=True)
_libc.pwrite.restype = ctypes.c_ssize_t
_libc.pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]


def _pwrite_all(fd: int, addr: int, n: int, off: int) -> None:
    w = _libc.pwrite(fd, addr, n, off)
    if w != n:
        raise OSError(ctypes.get_errno(), f"pwrite returned {w} of {n}")


def _write_like_fs_native(d: str, names: list, src: int, cb: int, crc: str, hdr: int = 0) -> None:
    """fs_native's write shape on THREADS threads: a temporary opened
    O_DIRECT, the payload in one pwrite, close, rename. crc: "" none,
    "whole" the payload's CRC32C before its write, "segments" one per
    SEGMENT just before that segment's write (fx's order), "steps" the
    segments with fx's other steps per chunk on the same threads: a fan-out
    directory, the file sized first, the payload after a 4 KiB header
    written last (from `hdr`), the mtime set, the final name stat'ed;
    "staged<K>" each K KiB segment copied into a staging buffer of the
    thread's own with its CRC32C in the same pass, and written from there
    (so the medium's copy reads it from cache)."""
    local = threading.local()
    stage_k = int(crc[len("staged") :]) * 1024 if crc.startswith("staged") else 0

    def one(i: int) -> None:
        sub = os.path.join(d, f"{i % 256:02x}") if crc == "steps" else d
        tmp = os.path.join(sub, names[i] + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        try:
            a = src + i * cb
            base = HEADER if crc == "steps" else 0
            if crc == "steps":
                os.ftruncate(fd, HEADER + cb)
            if stage_k:
                st = getattr(local, "buf", None)
                if st is None:
                    st = local.buf = _fxio.HostBuffer(stage_k, hugepages=False)
                c = 0
                for off in range(0, cb, stage_k):
                    k = min(stage_k, cb - off)
                    c = _fxio.crc32c_copy(st.address, a + off, k, c)
                    _pwrite_all(fd, st.address, k, off)
            elif crc in ("segments", "steps"):
                for off in range(0, cb, SEGMENT):
                    k = min(SEGMENT, cb - off)
                    _fxio.crc32c_at(a + off, k)
                    _pwrite_all(fd, a + off, k, base + off)
            else:
                if crc == "whole":
                    _fxio.crc32c_at(a, cb)
                _pwrite_all(fd, a, cb, 0)
            if crc == "steps":
                _pwrite_all(fd, hdr, HEADER, 0)
                os.utime(fd, ns=(i, i))
        finally:
            os.close(fd)
        if crc == "steps":
            try:
                os.stat(os.path.join(sub, names[i]), follow_symlinks=False)
            except FileNotFoundError:
                pass
        os.rename(tmp, os.path.join(sub, names[i]))

    with ThreadPoolExecutor(THREADS) as ex:
        list(ex.map(one, range(len(names))))


class _FsNative:
    """LMCache's fs_native client as its L2 adapter drives it: one
    submit_batch_set of every chunk, completions from its eventfd."""

    def __init__(self, d: str):
        from lmcache.lmcache_fs import LMCacheFSClient

        self.c = LMCacheFSClient(d, THREADS, "", True, 0)
        self.poll = select.poll()
        self.poll.register(int(self.c.event_fd()), select.POLLIN)

    def write(self, names: list, src_mv: memoryview, cb: int) -> None:
        # LMCache's wire format for a key: model@kv_rank@group@chunk_hash
        keys = [f"probe@00000000@0@{nm.encode().hex()}" for nm in names]
        fid = int(self.c.submit_batch_set(keys, [src_mv[i * cb : (i + 1) * cb] for i in range(len(names))]))
        end = time.monotonic() + 300  # the bench's wait for an L2 store task
        while time.monotonic() < end:
            self.poll.poll(1000)
            for f, ok, err, bools in self.c.drain_completions():
                if int(f) == fid:
                    if not ok or (bools is not None and not all(bools)):
                        raise RuntimeError(f"fs_native store failed: {err}")
                    return
        raise RuntimeError("fs_native store not done after 300 s")

    def close(self) -> None:
        self.c.close()


# Counts samples of a block device's writes in flight until its stdin closes: "busy total".
_SAMPLER = """
import select, sys
p, busy, total = sys.argv[1], 0, 0
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.0005)[0]:
    with open(p) as f:
        busy += int(f.read().split()[1]) > 0
    total += 1
print(busy, total)
"""


def _loop_inflight_path(mnt: str) -> str:
    """/sys/block/<dev>/inflight of the block device under `mnt`."""
    st = os.stat(mnt)
    dev = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"))
    return f"/sys/block/{dev}/inflight"


class _LoopBusy:
    """The share of samples with a write in flight, from its making (the
    sampler ready) to stop()."""

    def __init__(self, path: str):
        self.p = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == "ready"

    def stop(self) -> float:
        out, _ = self.p.communicate("")
        busy, total = (int(x) for x in out.split())
        return busy / max(total, 1)


def _clear(d: str) -> None:
    for root, _dirs, files in os.walk(d):
        for f in files:
            os.unlink(os.path.join(root, f))
    os.sync()


def stores(mnt: str, cb: int, n: int, reps: int, loop_busy: bool = False, staged: bool = False) -> dict:
    src = _fxio.HostBuffer(cb * n, hugepages=True)
    src_mv = memoryview(src)
    src_mv[:] = os.urandom(MIB) * (cb * n // MIB)
    meta = ChunkMeta(((cb // 2,),), ("bfloat16",), "KV_2LTD")
    hdr = _fxio.HostBuffer(HEADER)
    dirs = {m: os.path.join(mnt, m) for m in ("plain", "crc", "seg", "steps", "fsn", "fx")}
    for m in ("stg2048", "stg256") if staged else ():
        dirs[m] = os.path.join(mnt, m)
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    for j in range(256):  # fx's fan-out directories, made once as fx's are
        os.makedirs(os.path.join(dirs["steps"], f"{j:02x}"), exist_ok=True)
    fsn = _FsNative(dirs["fsn"])
    fx = ChunkStore(FxOptions(path=dirs["fx"], max_capacity_gb=1e6))
    modes = {
        "fs_native (LMCacheFSClient, 8 workers, O_DIRECT)": "fsn",
        "temporary, one O_DIRECT write, rename; 8 threads (fs_native's shape)": "plain",
        "the same, CRC32C of each payload before its write": "crc",
        "the same, CRC32C of each 2 MiB segment just before its write (fx's order)": "seg",
        "the same, with fx's file steps per chunk (fan-out directory, sized first, header, mtime, stat)": "steps",
        "fx ChunkStore.write (defaults: header, CRC32C, crash-safe commit)": "fx",
    }
    if staged:
        modes[
            "the same as fx's order, each 2 MiB segment copied into a staging buffer with its CRC32C, written from there"
        ] = "stg2048"
        modes[
            "the same as fx's order, each 256 KiB segment copied into a staging buffer with its CRC32C, written from there"
        ] = "stg256"
    raw: dict = {m: [] for m in modes}
    fx_keys: list = []
    for rep in range(-1, reps):  # rep -1: untimed, every path warmed once
        order = list(modes.items())
        k = rep % len(order)
        for m, how in order[k:] + order[:k]:
            names = [f"r{rep + 1}c{i}" for i in range(n)]
            sampler = _LoopBusy(_loop_inflight_path(mnt)) if loop_busy else None
            b0, c0, t0 = host_ticks(), cpu_seconds(), time.perf_counter()
            if how == "fsn":
                fsn.write(names, src_mv, cb)
            elif how == "fx":
                fx_keys = names
                ok = fx.write([(key, src.address + i * cb, cb, meta) for i, key in enumerate(names)])
                if not all(ok):
                    raise RuntimeError("fx store refused a chunk")
            else:
                named = {"plain": "", "crc": "whole", "seg": "segments", "steps": "steps"}
                crc = named[how] if how in named else "staged" + how[3:]
                _write_like_fs_native(dirs[how], names, src.address, cb, crc, hdr.address)
            dt = time.perf_counter() - t0
            c, b1 = cpu_seconds() - c0, host_ticks()
            medium_busy = sampler.stop() if sampler else None
            if how == "fx":
                for key in fx_keys:
                    fx.remove(key)
                os.sync()
            else:
                _clear(dirs[how])
            if rep < 0:
                continue
            gb = n * cb / 1e9
            busy = os.cpu_count() * (1 - (b1[1] - b0[1]) / max(b1[0] - b0[0], 1))
            raw[m].append({"gbps": gb / dt, "cpu_s_per_gb": c / gb, "busy_cpus": busy, "loop_busy": medium_busy})
    fx.close()
    fsn.close()
    base = next(m for m, h in modes.items() if h == "plain")
    fsn_name = next(m for m, h in modes.items() if h == "fsn")
    return {
        "chunks": f"{n} x {cb // MIB} MiB",
        "reps": reps,
        "modes": {
            m: {
                "gbps": round(statistics.median(x["gbps"] for x in v), 3),
                "cpu_s_per_gb": round(statistics.median(x["cpu_s_per_gb"] for x in v), 4),
                "busy_cpus": round(statistics.median(x["busy_cpus"] for x in v), 2),
                # the share of the write with the loop device writing (--loop-busy)
                "loop_busy": round(statistics.median(x["loop_busy"] for x in v), 3) if loop_busy else None,
                "loop_busy_each": [round(x["loop_busy"], 3) for x in v] if loop_busy else None,
                "gbps_each": [round(x["gbps"], 3) for x in v],
                "cpu_s_per_gb_each": [round(x["cpu_s_per_gb"], 4) for x in v],
                # each rep's speed over the plain writers' and over fs_native's in the same rep
                "over_plain": round(statistics.median(x["gbps"] / b["gbps"] for x, b in zip(v, raw[base])), 3),
                "over_fs_native": round(statistics.median(x["gbps"] / b["gbps"] for x, b in zip(v, raw[fsn_name])), 3),
            }
            for m, v in raw.items()
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--sizes", default="64M,10M,2M", help="chunk sizes in MiB, each ~0.47 GB a write")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--loop-busy", action="store_true", help="also the share of each write the loop device was busy")
    ap.add_argument(
        "--staged",
        action="store_true",
        help="also writers that copy each segment into a staging buffer of their own with its CRC32C in one pass "
        "and write from there, as staged reads do the other way",
    )
    args = ap.parse_args()
    cases = []
    with xfs_loop("3G", touch=True) as mnt:
        for s in args.sizes.split(","):
            cb = int(s.rstrip("Mm")) * MIB
            n = max(1, (448 * MIB) // cb)
            cases.append(stores(mnt, cb, n, args.reps, args.loop_busy, args.staged))
            print(f"{cases[-1]['chunks']}, medians of {args.reps}:")
            for m, v in cases[-1]["modes"].items():
                print(
                    f"  {m:76} {v['gbps']:6.2f} GB/s  {v['over_plain']:5.2f}x plain  "
                    f"{v['over_fs_native']:5.2f}x fs_native  {v['cpu_s_per_gb']:.3f} CPU s/GB  "
                    f"{v['busy_cpus']:.2f} CPUs busy" + (f"  loop busy {v['loop_busy']:.2f}" if args.loop_busy else "")
                )
    out = {
        "command": "python " + " ".join(["scripts/store_check_probe.py", *sys.argv[1:]]),
        "git_commit": git_commit(),  # "+dirty": uncommitted changes to tracked files
        "cpus": os.cpu_count(),
        "loadavg_end": list(os.getloadavg()),
        "medium": "XFS on a 3 GiB RAM-backed loop device (image written through)",
        "cases": cases,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
