#!/usr/bin/env python3
"""How much a striped store keeps in flight on each device, against fio's
one job per device (root: N XFS filesystems on RAM-backed loop devices, the
bench's --devices layout, cold reads).

On a 16-core host fx striped over eight devices read 0.27x fio's aggregate
with cores and devices to spare (docs/bench-devices-8.json): too little in
flight per device. This probe counts it. While each way reads, a thread
samples every device's /sys/block/loopN/inflight (requests queued or being
served) about every millisecond; per device it reports the mean reads in
flight and the share of samples with none, with GB/s and process CPU s/GB.
On this 2-core VM the reads are CPU-bound, so the GB/s say little about a
bigger host; the in-flight counts are set by the ways' own caps.

Ways: ChunkStore.read of K chunks (--chunk-mib, 64 MiB by default) striped over the N paths (verify
on) with staged reads (the default on loop devices with VPCLMULQDQ: at most
STAGE_BATCH_MAX = 8 pieces of a read in flight per device it reads from),
without them at queue_depth 32 (per device, the default), and without them
at queue_depth 4 per device (32 over the engine: the default before it was
per device);
fio with one job per device (1 MiB, iodepth 32, O_DIRECT, io_uring), each on
its own device's file (its GB/s are fio's own, group reporting). Ways rotated
every rep, page cache dropped before each.

--throttle-mbps M caps each loop device's reads at M MB/s (the cgroup v1 blkio
throttle, removed afterwards): devices slower than the CPU, so that the GB/s
show how many devices each way keeps busy, as on a host with cores to spare.
--piece-order adds the fx ways with their pieces queued op by op
(_fxio._set_piece_order), the order before the engine interleaved them.
--placement adds the default way over as many other chunks, each written in a
batch of its own: a lone chunk goes under its digest's first root, where digest
striping put every chunk before a write batch was balanced over the roots (the
main set is written as one batch).
--one-lane adds the fx ways with every read_chunks call's waves (64 files each)
read one after another on the calling thread (_fxio._set_one_lane), as before
a read of several waves went down two lanes.

    .venv/bin/python scripts/inflight_probe.py --devices 8 --chunks 48 --reps 5 --json docs/inflight-probe-8.json
    .venv/bin/python scripts/inflight_probe.py --devices 8 --chunks 48 --reps 5 --throttle-mbps 400 --piece-order
    .venv/bin/python scripts/inflight_probe.py --devices 8 --chunks 48 --reps 5 --throttle-mbps 400 --placement
    .venv/bin/python scripts/inflight_probe.py --devices 8 --chunks 768 --chunk-mib 2 --reps 3 --throttle-mbps 50 \
        --placement --one-lane
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core import store as store_mod  # noqa: E402
from lmcache_fx.core.chunkfile import ChunkMeta, chunk_digest  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.testing.loopfs import drop_caches, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402
from lmcache_fx.tools.bench.workload import cpu_seconds  # noqa: E402

MIB = 1 << 20


def loop_name(mnt: str) -> str:
    """The loop device (loopN) a mount point lies on."""
    dev = os.stat(mnt).st_dev
    return os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))


class InflightSampler:
    """Samples each device's reads in flight until stopped."""

    def __init__(self, names: list[str], period_s: float = 0.001):
        self.files = [open(f"/sys/block/{n}/inflight") for n in names]
        self.samples: list[list[int]] = [[] for _ in names]
        self.period_s = period_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for f, out in zip(self.files, self.samples):
                f.seek(0)
                out.append(int(f.read().split()[0]))
            time.sleep(self.period_s)

    def close(self) -> dict:
        """Per device over the reading window: from the first sample with a
        read in flight on any device to the last (a way's start-up, fio's
        process start among it, is left out)."""
        self.stop.set()
        self.thread.join()
        for f in self.files:
            f.close()
        m = min(len(s) for s in self.samples)
        busy = [i for i in range(m) if any(s[i] for s in self.samples)]
        lo, hi = (busy[0], busy[-1] + 1) if busy else (0, 0)
        self.samples = [s[lo:hi] for s in self.samples]
        per = [
            {"mean_reads": statistics.fmean(s) if s else 0.0, "idle_share": s.count(0) / len(s) if s else 1.0}
            for s in self.samples
        ]
        return {
            "samples": min(len(s) for s in self.samples),
            "per_device": per,
            "mean_reads_per_device": statistics.fmean(p["mean_reads"] for p in per),
            "idle_share": statistics.fmean(p["idle_share"] for p in per),
        }


def throttle(name: str, bps: int) -> None:
    """Caps (0: uncaps) the reads of block device `name` at bps bytes/s."""
    with open(f"/sys/block/{name}/dev") as f:
        majmin = f.read().strip()
    with open("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device", "w") as f:
        f.write(f"{majmin} {bps}")


def fio_read(files: list[str], size: int) -> float:
    """fio's aggregate read bandwidth, bytes/s, as fio measured it (its
    process start left out)."""
    cmd = ["fio", "--output-format=json", "--group_reporting"]
    for i, f in enumerate(files):
        cmd += [
            f"--name=d{i}",
            f"--filename={f}",
            "--rw=read",
            "--bs=1M",
            "--iodepth=32",
            "--ioengine=io_uring",
            "--direct=1",
            f"--size={size}",
        ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out[out.index("{") :])["jobs"][0]["read"]["bw_bytes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--chunk-mib", type=int, default=64, help="chunk size (default 64 MiB; 2: a small model's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--throttle-mbps",
        type=int,
        default=0,
        help="cap each loop device's reads at this many MB/s (cgroup v1 blkio throttle, removed after): devices "
        "slower than the CPU, as on a host with cores to spare",
    )
    ap.add_argument("--piece-order", action="store_true", help="also the ways with pieces queued op by op")
    ap.add_argument(
        "--placement",
        action="store_true",
        help="also the default way over as many chunks written one a batch (each under its digest's first root, "
        "as digest striping put every chunk)",
    )
    ap.add_argument(
        "--one-lane",
        action="store_true",
        help="also the default ways with each read's waves read one after another (one lane)",
    )
    ap.add_argument("--json")
    a = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("fio not found (apt-get install fio)")
    n, k = a.devices, a.chunks
    cb = a.chunk_mib * MIB
    per_dev = k * cb // n
    sets = 2 if a.placement else 1
    size = max(768 * MIB, int(((1 + sets) * k * cb // n + per_dev) * 1.2) + 256 * MIB)
    with ExitStack() as stack:
        mnts = [stack.enter_context(xfs_loop(size, touch=True)) for _ in range(n)]
        names = [loop_name(m) for m in mnts]
        if a.throttle_mbps:
            for name in names:
                stack.callback(throttle, name, 0)  # removed before the device is
                throttle(name, a.throttle_mbps * 10**6)
        paths = [os.path.join(m, "store") for m in mnts]
        src = _fxio.HostBuffer(cb, hugepages=True)
        memoryview(src)[:] = os.urandom(cb)
        meta = ChunkMeta(((cb // 2,),), ("bfloat16",), "KV_2LTD")
        keys = [f"c{i}" for i in range(k)]
        s = store_mod.ChunkStore(FxOptions(path=",".join(paths), max_capacity_gb=1e6))
        assert all(s.write([(key, src.address, cb, meta) for key in keys]))  # one batch: balanced

        def where_of(ks):
            return [
                next(i for i, p in enumerate(paths) if s.path_for(chunk_digest(key)).startswith(p + "/")) for key in ks
            ]

        where = where_of(keys)
        lone_keys = [f"lone{i}" for i in range(k)] if a.placement else []
        for key in lone_keys:  # one a batch: each under its first root
            assert s.write([(key, src.address, cb, meta)]) == [True]
        where_lone = where_of(lone_keys)
        s.close()
        fio_files = [os.path.join(m, "fio.bin") for m in mnts]
        fio_read(fio_files, per_dev)  # lays the files out
        dst = _fxio.HostBuffer(k * cb, hugepages=True)
        ways = {
            "fx, staged (the default here), queue_depth 32 per device": dict(staged_reads="true", queue_depth=32),
            "fx, unstaged, queue_depth 32 per device": dict(staged_reads="false", queue_depth=32),
            f"fx, unstaged, queue_depth {32 // n or 1} per device ({32 // n * n or n} in all)": dict(
                staged_reads="false", queue_depth=32 // n or 1
            ),
            "fio, 1 job per device, iodepth 32": None,
        }
        if a.placement:
            ways["fx, staged, chunks written one a batch (by digest)"] = dict(
                staged_reads="true", queue_depth=32, keys=lone_keys
            )
        if a.one_lane:  # waves one after another, as before two lanes
            ways["fx, staged, one lane"] = dict(staged_reads="true", queue_depth=32, one_lane=1)
            if a.placement:
                ways["fx, staged, chunks written one a batch (by digest), one lane"] = dict(
                    staged_reads="true", queue_depth=32, keys=lone_keys, one_lane=1
                )
        if a.piece_order:  # the order pieces were queued in before, beside
            ways["fx, staged, pieces in op order"] = dict(staged_reads="true", queue_depth=32, ops=1)
            ways["fx, unstaged, pieces in op order"] = dict(staged_reads="false", queue_depth=32, ops=1)
        raw: dict = {w: [] for w in ways}
        for rep in range(a.reps):
            order = list(ways.items())
            r = rep % len(order)
            for w, opts in order[r:] + order[:r]:
                st = None
                read_keys = keys
                if opts is not None:
                    opts = dict(opts)
                    _fxio._set_piece_order(bool(opts.pop("ops", 0)))
                    _fxio._set_one_lane(bool(opts.pop("one_lane", 0)))
                    read_keys = opts.pop("keys", keys)
                    st = store_mod.ChunkStore(FxOptions(path=",".join(paths), max_capacity_gb=1e6, **opts))

                    def alloc(_meta, slot=iter(range(2 * k))):
                        i = next(slot) % k
                        return i, dst.address + i * cb, cb

                    st.read(read_keys, alloc, lambda h: None)  # learns the headers, as a running store has
                drop_caches()
                sampler = InflightSampler(names)
                c0, t0 = cpu_seconds(), time.perf_counter()
                if st is not None:
                    out = st.read(read_keys, alloc, lambda h: None)
                    assert all(o is not None for o in out), w
                else:
                    fio_bw = fio_read(fio_files, per_dev)
                dt, c = time.perf_counter() - t0, cpu_seconds() - c0
                inflight = sampler.close()
                if st is not None:
                    st.close()
                gb = k * cb / 1e9
                gbps = gb / dt if st is not None else fio_bw / 1e9  # fio: its own figure
                raw[w].append({"gbps": gbps, "cpu_s_per_gb": c / gb if st is not None else None, **inflight})
        result = {
            "command": "python scripts/inflight_probe.py " + " ".join(sys.argv[1:]),
            "git_commit": git_commit(),
            "cpus": os.cpu_count(),
            "devices": n,
            "throttle_mbps_per_device": a.throttle_mbps,
            "chunks": f"{k} x {a.chunk_mib} MiB",
            "chunks_per_device": [where.count(i) for i in range(n)],
            **({"chunks_per_device_one_a_batch": [where_lone.count(i) for i in range(n)]} if a.placement else {}),
            "stage_batch_max": 8,
            "reps": a.reps,
            "ways": {
                w: {
                    "gbps_median": statistics.median(x["gbps"] for x in v),
                    "mean_reads_per_device_median": statistics.median(x["mean_reads_per_device"] for x in v),
                    "idle_share_median": statistics.median(x["idle_share"] for x in v),
                    "runs": v,
                }
                for w, v in raw.items()
            },
        }
    for w, v in result["ways"].items():
        print(
            f"{w:55s} {v['gbps_median']:6.2f} GB/s  reads in flight per device {v['mean_reads_per_device_median']:5.1f}"
            f"  idle {v['idle_share_median']:.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
