#!/usr/bin/env python3
"""What zeroing a reused file's old header costs a full store: stores into a
store at its capacity (every chunk evicts one, whose file is reused,
`reuse_evicted`), with the store's 4 KiB zeroing write before each new
payload (as it is) against the same store with that write skipped, in one
process, interleaved rep by rep with their order swapped every rep. XFS on a
RAM-backed loop device, O_DIRECT. Root.

The zeroing is what keeps a reader that opened the victim just before from
taking the evicted chunk's header over the new key's bytes when the writer
dies between its payload and its header (docs/shared-stores.md).

    .venv/bin/python scripts/reuse_zero_probe.py --reps 15 --json docs/bench-repeats/reuse-zero/<commit>-run1.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core import store as store_mod  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.testing.loopfs import xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

CAPACITY = 24  # chunks
BATCH = 8  # chunks per write call
WRITES = 96  # chunks timed per rep, after the store is filled


def _skippable_zeroing() -> list[bool]:
    """The store module's os, with pwrite of the zero header skipped while
    the returned flag holds True (this process only)."""
    skip = [False]
    real = os
    proxy = types.ModuleType("os")
    proxy.__dict__.update({k: getattr(os, k) for k in dir(os) if not k.startswith("__")})

    def pwrite(fd, data, offset):
        if skip[0] and data is store_mod._ZERO_HEADER:
            return HEADER_SIZE
        return real.pwrite(fd, data, offset)

    proxy.pwrite = pwrite
    store_mod.os = proxy  # type: ignore[attr-defined]
    return skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--mib", type=int, default=2, help="payload MiB per chunk (default 2)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    size = args.mib << 20
    skip = _skippable_zeroing()
    src = _fxio.HostBuffer(BATCH * size)
    memoryview(src)[:] = os.urandom(len(src))
    meta = ChunkMeta(((size,),), ("uint8",), "raw")
    runs: dict = {"zeroed": [], "skipped": []}
    image = f"{max(3, 2 * args.reps * CAPACITY * (size + HEADER_SIZE) // (1 << 30) + 2)}G"
    with xfs_loop(image, touch=True) as mnt:
        for rep in range(args.reps):
            for mode in ("zeroed", "skipped") if rep % 2 == 0 else ("skipped", "zeroed"):
                skip[0] = mode == "skipped"
                cap_gb = CAPACITY * (size + HEADER_SIZE) / (1 << 30) + 1e-6
                st = store_mod.ChunkStore(FxOptions.from_mapping({"path": os.path.join(mnt, f"{mode}{rep}"),
                                                                  "max_capacity_gb": cap_gb}))  # fmt: skip
                try:
                    k = 0

                    def batch(k: int) -> list:
                        return [(f"m@1@0@{k + i:016x}@u8", src.address + i * size, size, meta) for i in range(BATCH)]

                    for _ in range(CAPACITY // BATCH):  # fill it
                        assert all(st.write(batch(k)))
                        k += BATCH
                    t = time.perf_counter()
                    ok = 0
                    for _ in range(WRITES // BATCH):
                        ok += sum(st.write(batch(k)))
                        k += BATCH
                    secs = time.perf_counter() - t
                    snap = st.stats.snapshot()
                finally:
                    st.close()
                assert ok == WRITES and snap["recycled"] == WRITES, (mode, ok, snap["recycled"])
                runs[mode].append(WRITES * size / secs / 1e9)
                print(f"rep {rep} {mode:8} {runs[mode][-1]:.2f} GB/s", flush=True)
    pairs = [z / s for z, s in zip(runs["zeroed"], runs["skipped"])]
    out = {
        "command": "python " + " ".join(["scripts/reuse_zero_probe.py", *sys.argv[1:]]),
        "git_commit": git_commit(ROOT, ["lmcache_fx", "csrc", "scripts/reuse_zero_probe.py"]),
        "medium": "XFS on a RAM-backed loop device, O_DIRECT",
        "cpus": os.cpu_count(),
        "loadavg_end": list(os.getloadavg()),
        "chunk_bytes": size,
        "capacity_chunks": CAPACITY,
        "chunks_per_write": BATCH,
        "chunks_timed_per_rep": WRITES,
        "reps": args.reps,
        "gbps": {m: [round(x, 4) for x in v] for m, v in runs.items()},
        "zeroed_over_skipped_each": [round(x, 4) for x in pairs],
        "zeroed_over_skipped_median": round(statistics.median(pairs), 4),
    }
    print(
        f"median GB/s zeroed {statistics.median(runs['zeroed']):.2f}, skipped {statistics.median(runs['skipped']):.2f}; "
        f"zeroed/skipped per rep {min(pairs):.3f}-{max(pairs):.3f}, median {out['zeroed_over_skipped_median']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
