#!/usr/bin/env python3
"""How evenly a striped store spreads one request's chunks over its devices,
and what that bounds a device-bound read at (no I/O: the store's own
placement functions on each key's chunk_digest).

Where the devices, not the CPU, are the limit, a read ends when its busiest
device does: at (k/n) / max share of what even shares would read (fio's one
job per device reads even shares). Two placements: by digest alone
(layout.root_index, the store's before balanced placement: a request of k
chunks over n devices gives some device well over k/n), and balanced
(layout.place_roots: each chunk on the less loaded of its digest's two roots,
the request written as one batch, as LMCache stores a request's chunks). For
each k and n, `--requests` random requests (keys as LMCache names its chunks,
a random prefix hash each), the median and 1st percentile of that fraction.

    .venv/bin/python scripts/stripe_model.py --json docs/stripe-model.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx.core.chunkfile import chunk_digest  # noqa: E402
from lmcache_fx.core.layout import place_roots, root_index  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402


def even_fraction(roots: list[int], n: int) -> float:
    """(k/n) / the busiest device's share: a device-bound read's speed over
    what even shares would give."""
    counts = [0] * n
    for r in roots:
        counts[r] += 1
    return len(roots) / n / max(counts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="2,4,8")
    ap.add_argument("--chunks", default="8,16,32,48,64,128,256,512,1024")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    devices = [int(x) for x in a.devices.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    rows = []
    for n in devices:
        for k in chunks:
            by_digest, balanced = [], []
            for _ in range(a.requests):
                prefix = f"{rng.getrandbits(64):016x}"
                digests = [chunk_digest(f"model@1@0@{prefix}{i:06d}@bfloat16") for i in range(k)]
                by_digest.append(even_fraction([root_index(n, d) for d in digests], n))
                balanced.append(even_fraction(place_roots(n, digests), n))
            row = {"devices": n, "chunks": k}
            for name, fr in (("by_digest", by_digest), ("balanced", balanced)):
                fr.sort()
                row[name] = {"median": statistics.median(fr), "p1": fr[len(fr) // 100]}
            rows.append(row)
            print(
                f"{n} devices, {k:5d} chunks a request: by digest median {row['by_digest']['median']:.2f} "
                f"(p1 {row['by_digest']['p1']:.2f}), balanced {row['balanced']['median']:.2f} "
                f"(p1 {row['balanced']['p1']:.2f})"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "command": "python scripts/stripe_model.py " + " ".join(argv or sys.argv[1:]),
                    "git_commit": git_commit(),
                    "requests": a.requests,
                    "seed": a.seed,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
