#!/usr/bin/env python3
"""LMCache's own `lmcache bench l2` on fs_native and lmcache-fx's FxL2Adapter:
the tool LMCache users check L2 adapters with. XFS on a RAM-backed loop device
(root; the RAM image preallocated), fresh directories per run, 5 measured rounds after 1 warm-up,
round-trip verification on (a mismatch exits non-zero), runs alternating
adapters; 14 x 64 MiB and 64 x 2 MiB objects.

    .venv/bin/python scripts/lmcache_bench_l2.py --runs 3 --json docs/bench-lmcache-l2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx.testing.loopfs import drop_caches, xfs_loop  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

CASES = {"65536k": (14, 65536), "2048k": (64, 2048)}
ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING"}


def adapter_json(name: str, base: str) -> str:
    if name == "fs_native":  # as its docs recommend for speed: O_DIRECT, workers (8 led on this host)
        spec = {"type": "fs_native", "base_path": base, "num_workers": 8, "use_odirect": True}
    else:
        spec = {
            "type": "plugin",
            "module_path": "lmcache_fx.l2_adapter",
            "class_name": "FxL2Adapter",
            "adapter_params": {"path": base, "max_capacity_gb": 100},
        }
    return json.dumps(spec, separators=(",", ":"))


def one(mnt: str, name: str, case: str, run: int, out_dir: str) -> dict:
    nkeys, kb = CASES[case]
    base = os.path.join(mnt, f"{name}-{case}-{run}")
    out = os.path.join(out_dir, f"{name}-{case}-{run}.json")
    lmcache = os.path.join(os.path.dirname(sys.executable), "lmcache")
    cmd = [lmcache, "bench", "l2", "--l2-adapter", adapter_json(name, base), "--num-keys", str(nkeys)]
    cmd += ["--data-size-kb", str(kb), "--l1-align-bytes", "4096", "--rounds", "5", "--no-skip-verify"]
    cmd += ["--format", "json", "--output", out, "-q"]
    drop_caches()
    r = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900)
    shutil.rmtree(base, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(f"{name} {case} run {run} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    with open(out) as f:
        raw = json.load(f)
    raw = raw.get("metrics", raw)  # {"title", "metrics"} as of LMCache 0.5.6's json format
    ops = {v["operation"]: v for k, v in raw.items() if k.startswith("op_")}
    return {
        "command": " ".join(cmd),
        "store_MBps": ops["Store"]["throughput_avg_mbps"],
        "load_MBps": ops["Load"]["throughput_avg_mbps"],
        "store_success": f"{ops['Store']['total_success']}/{ops['Store']['total_keys']}",
        "load_success": f"{ops['Load']['total_success']}/{ops['Load']['total_keys']}",
        "raw": raw,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default="docs/bench-lmcache-l2.json")
    a = ap.parse_args()
    cases: dict = {c: {"fs_native": {"runs": []}, "fx": {"runs": []}} for c in CASES}
    # The image written through before mkfs: else the first writes into it pay for its pages.
    with tempfile.TemporaryDirectory() as out_dir, xfs_loop("8G", touch=True) as mnt:
        for case in CASES:
            for run in range(1, a.runs + 1):
                order = ["fx", "fs_native"] if run % 2 else ["fs_native", "fx"]
                for name in order:
                    r = one(mnt, name, case, run, out_dir)
                    cases[case][name]["runs"].append(r)
                    print(f"{case} {name} run {run}: load {r['load_MBps']:.0f} MB/s, store {r['store_MBps']:.0f} MB/s")
    for case, per in cases.items():
        fsn, fx = per["fs_native"]["runs"], per["fx"]["runs"]
        for name in per:
            for k in ("load_MBps", "store_MBps"):
                per[name]["median_" + k] = statistics.median(r[k] for r in per[name]["runs"])
        per["fx_over_fs_native"] = {
            k: [round(x[k] / y[k], 3) for x, y in zip(fx, fsn)] for k in ("load_MBps", "store_MBps")
        }
        print(case, "fx/fs_native per run", per["fx_over_fs_native"])
    doc = {
        "what": "LMCache's own `lmcache bench l2` on XFS on an 8 GiB RAM-backed loop device (image preallocated), fresh directories per "
        "run, fs_native (8 workers, O_DIRECT) and lmcache-fx's FxL2Adapter (defaults), 5 measured rounds + 1 "
        "warm-up, --no-skip-verify (the last round's bytes compared; a mismatch exits non-zero), runs alternating "
        "adapters, the page cache dropped before each",
        "command": "python " + " ".join(["scripts/lmcache_bench_l2.py", *sys.argv[1:]]),
        "git_commit": git_commit(),
        "env": " ".join(f"{k}={v}" for k, v in ENV.items()),
        "cpus": os.cpu_count(),
        "cases": cases,
    }
    with open(a.json, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
