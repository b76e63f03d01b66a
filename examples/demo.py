#!/usr/bin/env python3
"""lmcache-fx demo: store a long context through LMCache with the fx tier,
then retrieve it cold in a fresh process, and print what came back.

    python examples/demo.py [--store DIR] [--tokens 16384] [--engine auto]

Each phase runs in its own process, like a server before and after a
restart; between them the page cache is dropped when running as root.
"""

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")

# A mid-size GQA model's KV per token: 28 layers x 4 kv heads x 128 dim, bf16.
GEOMETRY = dict(layers=28, kv_heads=4, head_dim=128)
CHUNK_TOKENS = 256  # chunk_size of the config below (fx_config's default): LMCache stores whole chunks


def phase(role, args):
    import logging

    import torch

    from lmcache_fx.testing.cpu_engine import (
        KV,
        Geometry,
        config_from_dict,
        fx_backend,
        fx_config,
        lmcache_engine,
        retrieve,
    )

    logging.getLogger("lmcache").setLevel(logging.WARNING)
    geo = Geometry(**GEOMETRY)
    os.makedirs(args.store, exist_ok=True)
    chunk_gb = geo.bytes_per_token * args.tokens / 1e9
    cfg = config_from_dict(
        fx_config(
            args.store, cpu_gb=max(0.25, chunk_gb * 1.2), io_engine=args.engine, max_capacity_gb=args.capacity_gb
        ),
        os.path.dirname(os.path.abspath(args.store)),
    )
    tokens = torch.arange(args.tokens) % 32000
    kv = KV(geo, args.tokens, seed=42)
    with lmcache_engine(cfg, geo, model="fx-demo-model") as eng:
        be = fx_backend(eng)
        t0 = time.perf_counter()
        if role == "store":
            eng.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
            be.flush(600)
            n = args.tokens
        else:
            got = kv.empty_like()
            n = retrieve(eng, tokens, got)
            ok = kv.tokens_equal(got, n)
        dt = time.perf_counter() - t0
        st = be.store.stats.snapshot()
        out = {
            "role": role,
            "tokens": n,
            "seconds": dt,
            "engine": be.store.engine.kind,
            "odirect": be.store.odirect,
            "verify": be.options.verify,
            "chunks_in_store": len(be.store),
            "bytes": st["bytes_written"] if role == "store" else st["bytes_read"],
            "tier_read_seconds": st["read_seconds"],
        }
        if role == "retrieve":
            out["bit_exact"] = ok
    print("RESULT " + json.dumps(out), flush=True)


def run_phase(role, args):
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        role,
        "--store",
        args.store,
        "--tokens",
        str(args.tokens),
        "--engine",
        args.engine,
        "--capacity-gb",
        str(args.capacity_gb),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        sys.stderr.write(r.stderr[-4000:])
        # The cause (a bad option, say) is an ERROR line early in the phase's output, cut off above.
        errors = [x for x in r.stderr.splitlines() if " ERROR" in x or x.startswith("lmcache_fx.")]
        if errors:
            sys.stderr.write("\n".join(["", "errors in that phase:", *errors[:5], ""]))
        raise SystemExit(f"demo: the {role} phase failed (exit {r.returncode})")
    return json.loads(lines[-1][7:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=os.path.join(os.getcwd(), ".fx-demo", "store"), help="store directory")
    ap.add_argument("--tokens", type=int, default=16384, help="context length (default 16384)")
    ap.add_argument("--engine", default="auto", choices=["auto", "io_uring", "threads"])
    ap.add_argument("--capacity-gb", type=float, default=20.0)
    ap.add_argument("--phase", choices=["store", "retrieve"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.store = os.path.abspath(os.path.expanduser(args.store))  # the plugin takes absolute paths only
    if args.tokens < CHUNK_TOKENS or args.tokens % CHUNK_TOKENS:
        ap.error(f"--tokens must be a multiple of {CHUNK_TOKENS} (LMCache stores whole chunks only), not {args.tokens}")
    if os.path.exists(args.store) and not os.path.isdir(args.store):
        ap.error(f"--store {args.store}: not a directory")
    if args.phase:
        return phase(args.phase, args)

    from lmcache_fx.testing.loopfs import drop_caches

    print(
        f"lmcache-fx demo: {args.tokens} tokens of KV ({GEOMETRY['layers']} layers, {GEOMETRY['kv_heads']} kv "
        f"heads x {GEOMETRY['head_dim']}, bf16) into {args.store}"
    )
    s = run_phase("store", args)
    if s["bytes"]:
        print(f"  stored by process 1: {s['bytes'] / 1e6:.0f} MB in {s['seconds']:.2f} s")
    else:
        print(f"  already in the store from an earlier run ({s['chunks_in_store']} chunks); nothing new written")
    cold = drop_caches()
    r = run_phase("retrieve", args)
    gbps = r["bytes"] / r["tier_read_seconds"] / 1e9 if r["tier_read_seconds"] else 0.0
    rows = [
        ("tokens retrieved", f"{r['tokens']} / {args.tokens}"),
        ("bit-exact", "yes" if r["bit_exact"] else "NO"),
        ("bytes read by fx", f"{r['bytes'] / 1e6:.0f} MB"),
        (
            "fx tier read",
            f"{r['tier_read_seconds'] * 1e3:.0f} ms, {gbps:.2f} GB/s"
            + ("" if cold else " (warm: page cache not dropped, not root)"),
        ),
        ("LMCache retrieve", f"{r['seconds'] * 1e3:.0f} ms"),
        (
            "engine",
            f"{r['engine']}, O_DIRECT {'on' if r['odirect'] else 'off'}, CRC32C verify {'on' if r['verify'] else 'off'}",
        ),
        ("chunks in store", str(r["chunks_in_store"])),
    ]
    print("\nRetrieved cold in a fresh process:")
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    if not r["bit_exact"] or r["tokens"] != args.tokens:
        raise SystemExit("demo: retrieval was incomplete or wrong")


if __name__ == "__main__":
    main()
