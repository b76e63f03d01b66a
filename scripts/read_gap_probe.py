#!/usr/bin/env python3
"""Where fx-l2's read gap to fs_native goes (root: XFS on a RAM-backed loop
device, cold; or tmpfs, warm, with --tmpfs), in `lmcache-fx bench`'s own L2
run, interleaved rep by rep:

  fs_native          LMCache's C++ adapter: one whole-file O_DIRECT read per
                     chunk on its worker threads, no check;
  raw_block          LMCache's raw-block adapter (the best peer on tmpfs);
  fx-l2              fx's adapter, defaults (1 MiB pieces, CRC32C checked);
  fx-l2-noverify     the same with verify off;
  fx-l2-preads       fx-l2's own chunk files, each payload loaded by one pread
                     (O_DIRECT on XFS) on 8 threads made at start-up
                     (fs_native's way, no header or CRC check): the files
                     without fx's reader, the limit of any reader that checks
                     nothing;
  fx-l2-preads-crc   the same, each thread then taking the CRC32C of the
                     payload it read (fx's check, the GIL released): the
                     limit of a reader that checks what it read.

fx-l2 over fx-l2-preads is the price of fx's reader (pieces, header, check);
fx-l2-preads over fs_native that of the files and of Python threads driving
the preads; the best peer over fx-l2-preads-crc says how far ahead of it any
checked read could be.

    .venv/bin/python scripts/read_gap_probe.py --runs 2 --json docs/read-gap-probe.json
    .venv/bin/python scripts/read_gap_probe.py --tmpfs --runs 3 --preset llama-3.2-1b-tp4 \
        --json docs/read-gap-probe-tmpfs-2m.json
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio  # noqa: E402
from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest  # noqa: E402
from lmcache_fx.l2_adapter import object_key_string  # noqa: E402
from lmcache_fx.tools import bench  # noqa: E402
from lmcache_fx.tools.bench import l2  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
READERS = ["fs_native", "raw_block", "fx-l2", "fx-l2-noverify", "fx-l2-preads", "fx-l2-preads-crc"]
PEERS = ["fs_native", "raw_block"]


class FxL2NoVerify(l2.FxL2Reader):
    name = "fx-l2-noverify"
    label = "lmcache-fx FxL2Adapter (L2, verify off)"

    def adapter_spec(self):
        spec = super().adapter_spec()
        spec["adapter_params"]["verify"] = False
        self.label = FxL2NoVerify.label
        return spec


class FxL2Preads(l2.FxL2Reader):
    name = "fx-l2-preads"
    label = "fx-l2's files, one pread per payload on 8 threads (no check)"
    direct = True  # O_DIRECT, as fs_native reads; off on tmpfs (--tmpfs)
    crc = False

    def open(self, stack):
        self.pool = ThreadPoolExecutor(8)
        stack.callback(self.pool.shutdown)
        super().open(stack)
        self.label = type(self).label

    def load(self, keys, objs, timeout=300.0) -> int:
        st = self.adapter.store
        paths = [st.path_for(chunk_digest(object_key_string(k))) for k in keys]

        def one(i: int) -> bool:
            fd = os.open(paths[i], os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
            try:
                n = objs[i].get_size()
                got = _libc.pread(fd, ctypes.c_void_p(objs[i].data_ptr), ctypes.c_size_t(n), ctypes.c_long(HEADER_SIZE))
            finally:
                os.close(fd)
            if self.crc:
                _fxio.crc32c_at(objs[i].data_ptr, n)  # the value is not compared: only its cost counts
            return got == n

        return sum(self.pool.map(one, range(len(keys))))


class FxL2PreadsCrc(FxL2Preads):
    name = "fx-l2-preads-crc"
    label = "fx-l2's files, one pread per payload on 8 threads, then its CRC32C"
    crc = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--preset", default="qwen2.5-32b")
    ap.add_argument("--json", default="docs/read-gap-probe.json")
    ap.add_argument("--tmpfs", action="store_true", help="tmpfs (/dev/shm), warm, instead of the XFS loop")
    a = ap.parse_args()
    FxL2Preads.direct = not a.tmpfs
    run = importlib.import_module(
        "lmcache_fx.tools.bench.run"
    )  # the module: the package exports a function of that name
    for cls in (FxL2NoVerify, FxL2Preads, FxL2PreadsCrc):
        run.READER_CLASSES[cls.name] = cls
        run.READER_LABELS[cls.name] = cls.label
        run.L2_READERS.add(cls.name)
    out: dict = {"command": "python scripts/read_gap_probe.py " + " ".join(sys.argv[1:]), "runs": []}
    for i in range(a.runs):
        order = READERS if i % 2 == 0 else READERS[::-1]  # each reader goes first in some run
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            medium = ["--path", "/dev/shm/fx-read-gap", "--warm"] if a.tmpfs else ["--mkfs-loop", "5G"]
            argv = medium + ["--total-gb", "0.5", "--reps", str(a.reps), "--quiet", "--no-verify"]
            argv += ["--preset", a.preset, "--readers", ",".join(order), "--json", tmp.name]
            if bench.main(argv) != 0:
                return 1
            with open(tmp.name) as f:
                res = json.load(f)
        med = {n: e["median"]["tier_read_gbps"] for n, e in res["readers"].items() if e.get("available")}
        best = max(PEERS, key=lambda n: med[n])
        out.setdefault("git_commit", res.get("git_commit"))
        out["runs"].append(
            {
                "order": order,
                "tier_read_gbps": med,
                "tier_read_gbps_each": {
                    n: [r.get("tier_read_gbps") for r in e["reps"]]
                    for n, e in res["readers"].items()
                    if e.get("available")
                },
                "tier_cpu_s_per_gb": {
                    n: e["median"]["tier_cpu_s_per_gb"] for n, e in res["readers"].items() if e.get("available")
                },
                "fx-l2 / fx-l2-preads": med["fx-l2"] / med["fx-l2-preads"],
                "fx-l2-noverify / fx-l2-preads": med["fx-l2-noverify"] / med["fx-l2-preads"],
                "fx-l2-preads / fs_native": med["fx-l2-preads"] / med["fs_native"],
                "fx-l2 / fs_native": med["fx-l2"] / med["fs_native"],
                "best peer": best,
                "fx-l2 / best peer": med["fx-l2"] / med[best],
                "fx-l2 / fx-l2-preads-crc": med["fx-l2"] / med["fx-l2-preads-crc"],
                "best peer / fx-l2-preads": med[best] / med["fx-l2-preads"],
                "best peer / fx-l2-preads-crc": med[best] / med["fx-l2-preads-crc"],
                "machine": res["machine"],
            }
        )
    keys = [
        "fx-l2 / fx-l2-preads",
        "fx-l2-noverify / fx-l2-preads",
        "fx-l2-preads / fs_native",
        "fx-l2 / fs_native",
        "fx-l2 / best peer",
        "fx-l2 / fx-l2-preads-crc",
        "best peer / fx-l2-preads",
        "best peer / fx-l2-preads-crc",
    ]
    out["summary"] = {k: [round(r[k], 3) for r in out["runs"]] for k in keys}
    out["summary"]["best peer"] = [r["best peer"] for r in out["runs"]]
    out["summary"]["median_gbps"] = {n: statistics.median(r["tier_read_gbps"][n] for r in out["runs"]) for n in READERS}
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
