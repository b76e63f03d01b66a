"""`lmcache-fx estimate`: will external KV storage pay off, and how fast must it be?

For a model, tensor parallelism, context length, concurrency and hit rate it
prints the KV bytes per token and per chunk, what each rank reads, the time to
load the cached prefix against the time to recompute it, the break-even read
bandwidth, the TTFT with and without the store at the given concurrency, and
which resource binds (disk, network link, PCIe, prefill compute).

    lmcache-fx estimate --model qwen3-coder-480b --tp 8 --context 32k --concurrency 16 \\
        --hit-rate 0.8 --storage-gbps 5.2 --link-gbit 100 --prefill-tok-s 12000
    lmcache-fx estimate --model qwen2.5-32b --context 16k --measure /mnt/nvme --prefill-tok-s 3000

Every formula and assumption is written down in docs/estimate.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

from .common import unwritable
from .models import GB, MIB, PRESETS, Geometry, parse_size

KIB = 1 << 10

# --kv-dtype spelling -> Geometry.dtype (bench.Geometry knows the byte sizes)
KV_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e5m2": "uint8",  # one byte like e4m3; Geometry has no e5m2 name
}

_TP_SUFFIX = re.compile(r"^(?P<base>.+)-tp(?P<tp>\d+)$")


# ------------------------------------------------------------------ models


@dataclass(frozen=True)
class Model:
    """A whole model's KV geometry (all KV heads), from a bench preset."""

    name: str
    preset: Optional[str]  # the bench preset it came from
    geo: Geometry  # whole model: kv_heads = all KV heads
    preset_tp: int  # the TP the preset's per-rank geometry was cut for


def models() -> dict[str, Model]:
    """Model names for --model, derived from bench.PRESETS (no second table).

    A preset `<name>-tp<N>` holds one rank's geometry at TP N, so the whole
    model has N times its KV heads; `<name>-mla` is an MLA latent, the same on
    every rank. Both the short name and the preset name are accepted; the
    preset name also sets the default --tp."""
    out: dict[str, Model] = {}
    for pname, g in PRESETS.items():
        m = _TP_SUFFIX.match(pname)
        if m and not g.mla:
            base, ptp = m["base"], int(m["tp"])
            whole = replace(g, kv_heads=g.kv_heads * ptp)
        else:
            base = pname[:-4] if pname.endswith("-mla") and g.mla else pname
            ptp, whole = 1, g
        out[base] = Model(base, pname, whole, 1)
        out[pname] = Model(base, pname, whole, ptp)
    return out


def parse_tokens(s) -> int:
    """'32k' -> 32768, '1.5k' -> 1536, '1m' -> 1048576, '8000' -> 8000 (k = 1024, as in '32K context')."""
    if isinstance(s, int):
        v = s
    else:
        t = str(s).strip().lower().replace("_", "").replace(",", "")
        mult = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
        if mult != 1:
            t = t[:-1]
        try:
            v = int(round(float(t) * mult))
        except (ValueError, OverflowError):  # OverflowError: inf, 1e400
            raise argparse.ArgumentTypeError(f"expected a token count like 32k or 8000, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"token count must be > 0, got {s!r}")
    return v


# ------------------------------------------------------------------ the model of the system


@dataclass
class Inputs:
    geo: Geometry  # whole model
    tp: int = 1
    context: int = 32768  # prompt tokens per request
    hit_rate: float = 0.8  # fraction of the prompt found in the store (a prefix)
    concurrency: int = 1  # requests arriving together
    storage_gbps: Optional[float] = None  # GB/s the store delivers to this node (all ranks)
    link_gbit: Optional[float] = None  # network line rate, Gbit/s (None: local storage)
    pcie_gbps: float = 25.0  # host-to-GPU GB/s per GPU
    prefill_tok_s: Optional[float] = None  # prompt tokens/s of the whole instance (all ranks)
    async_loading: bool = False  # loads overlap other requests' prefill
    overhead_s: float = 0.0  # fixed time per request (HTTP, tokenization, scheduling, lookup), in every step
    model: str = "custom"


def rank_geometry(geo: Geometry, tp: int) -> tuple[Geometry, int]:
    """(one rank's geometry, copies of the KV kept in storage across ranks).

    GQA: KV heads are split over the ranks; when tp > kv_heads each rank keeps
    one head and the heads are replicated tp/kv_heads times (vLLM), and LMCache
    stores every rank's copy. MLA: every rank holds the whole latent; LMCache
    stores and reads it once (save_only_first_rank, its MLA default) and
    broadcasts to the other ranks over the GPU interconnect."""
    if tp < 1:
        raise ValueError("tp must be >= 1")
    if geo.mla:
        return geo, 1
    if geo.kv_heads % tp == 0:
        return replace(geo, kv_heads=geo.kv_heads // tp), tp
    if tp % geo.kv_heads == 0:
        return replace(geo, kv_heads=1), tp
    raise ValueError(f"tp {tp} does not divide {geo.kv_heads} KV heads (nor they it)")


def fifo_ttft(n: int, load: float, compute: float, overlap: bool) -> dict:
    """TTFT of n identical requests arriving together, served first come first
    served. Serial (loads block the engine step): the k-th finishes at
    k*(load+compute). Overlapped (async loading, a two-stage pipeline): at
    load + compute + (k-1)*max(load, compute). Returns p50 (= mean: the
    completion times are evenly spaced), worst (k = n) and alone (k = 1).

    closed_loop_s: n clients each sending the next request when the last one
    finished (vllm bench --max-concurrency n): the server is never idle, so by
    Little's law TTFT = n*step - decode time; decode is not modelled (0)."""
    if overlap:
        step = max(load, compute)
        first = load + compute
    else:
        step = first = load + compute
    # The completion times first + k*step, k < n, are evenly spaced: median and mean are their midpoint
    # (no list of n of them: --concurrency 1e8 took gigabytes).
    return {
        "p50_s": first + (n - 1) * step / 2,
        "mean_s": first + (n - 1) * step / 2,
        "worst_s": first + (n - 1) * step,
        "alone_s": first,
        "closed_loop_s": max(n * step, first),
        "step_s": step,
        "requests_per_s": (1.0 / step) if step > 0 else None,
    }


def estimate(inp: Inputs) -> dict:
    geo = inp.geo
    if not 0.0 <= inp.hit_rate <= 1.0:
        raise ValueError("hit rate must be between 0 and 1")
    if inp.concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if inp.overhead_s < 0:
        raise ValueError("overhead must be >= 0")
    rank, copies = rank_geometry(geo, inp.tp)
    bpt_model = geo.bytes_per_token  # unique KV bytes of one token
    bpt_rank = rank.bytes_per_token
    bpt_stored = bpt_rank * copies  # bytes per token written to / read from storage
    ch = geo.chunk
    # LMCache stores whole chunks only (save_unfull_chunk false); whole chunks
    # are read, but the engine always computes the last prompt token itself.
    chunks = min(int(inp.hit_rate * inp.context + 1e-9) // ch, inp.context // ch)
    hit = min(chunks * ch, inp.context - 1)  # tokens whose KV comes from the store
    miss = inp.context - hit
    storage_bytes = chunks * ch * bpt_stored
    pcie_bytes = chunks * ch * bpt_rank  # per GPU (MLA: rank 0 takes all of it)

    res: dict = {
        "model": inp.model,
        "inputs": {k: v for k, v in asdict(inp).items() if k != "geo"},
        "geometry": {
            "layers": geo.layers,
            "kv_heads": geo.kv_heads,
            "head_dim": geo.head_dim,
            "dtype": geo.dtype,
            "dtype_bytes": geo.dtype_bytes,
            "mla": geo.mla,
            "chunk_tokens": ch,
            "kv_heads_per_rank": rank.kv_heads,
            "stored_copies": copies,
        },
        "kv_bytes_per_token": {"model": bpt_model, "per_rank": bpt_rank, "stored": bpt_stored},
        "kv_bytes_per_chunk": {"model": bpt_model * ch, "per_rank": bpt_rank * ch, "stored": bpt_stored * ch},
        "request": {
            "context_tokens": inp.context,
            "hit_tokens": hit,
            "hit_chunks": chunks,
            "miss_tokens": miss,
            "storage_bytes": storage_bytes,
            "per_rank_bytes": pcie_bytes,
        },
    }

    # load: the stages stream chunk by chunk, so the slowest one sets the time
    stages = {}
    if inp.storage_gbps:
        stages["disk"] = {
            "gbps": inp.storage_gbps,
            "bytes": storage_bytes,
            "s": storage_bytes / (inp.storage_gbps * GB),
        }
    if inp.link_gbit:
        lg = inp.link_gbit / 8
        stages["link"] = {"gbps": lg, "bytes": storage_bytes, "s": storage_bytes / (lg * GB)}
    if inp.pcie_gbps:
        stages["pcie"] = {"gbps": inp.pcie_gbps, "bytes": pcie_bytes, "s": pcie_bytes / (inp.pcie_gbps * GB)}
    load_s = max((s["s"] for s in stages.values()), default=None) if inp.storage_gbps else None
    load_bind = max(stages, key=lambda k: stages[k]["s"]) if load_s and hit else None
    # the store cannot be read faster than link or PCIe allow: the disk stops
    # binding above this bandwidth
    caps = [stages[k]["s"] for k in ("link", "pcie") if k in stages]
    disk_ceiling = storage_bytes / (max(caps) * GB) if caps and hit and max(caps) > 0 else None
    res["load"] = {
        "stages": stages,
        "load_s": load_s,
        "binds": load_bind,
        "effective_gbps": (storage_bytes / load_s / GB) if load_s else None,
        "disk_stops_binding_above_gbps": disk_ceiling,
    }

    R = inp.prefill_tok_s
    if R:
        res["compute"] = {
            "prefill_tok_s": R,
            "recompute_prefix_s": hit / R,
            "prefill_miss_s": miss / R,
            "prefill_whole_s": inp.context / R,
        }
        be = bpt_stored * R / GB
        # link or PCIe alone may already be slower than recomputing
        blocked_by = [k for k in ("link", "pcie") if k in stages and hit and stages[k]["s"] >= hit / R]
        res["break_even"] = {
            "storage_gbps": be,
            "formula": "stored KV bytes per token x prefill tokens/s",
            "for_load_10pct_of_recompute_gbps": 10 * be,
            "unreachable_because": blocked_by or None,
            "pays_off": (load_s < hit / R) if (load_s is not None and hit) else None,
            "margin": ((hit / R) / load_s) if (load_s and hit) else None,
        }
        # serial model: TTFT speedup over recompute <= min(effective read
        # bandwidth / break-even, context / miss tokens)
        eff = res["load"]["effective_gbps"]
        res["break_even"]["speedup_bound"] = min(
            x for x in (eff / be if eff else math.inf, inp.context / miss) if x is not None
        )
        t0 = inp.overhead_s  # a fixed cost per request, with or without the store
        base = fifo_ttft(inp.concurrency, 0.0, t0 + inp.context / R, False)
        res["ttft"] = {
            "concurrency": inp.concurrency,
            "queueing": "async" if inp.async_loading else "serial",
            "recompute": base,
        }
        if load_s is not None:
            st = fifo_ttft(inp.concurrency, load_s, t0 + miss / R, inp.async_loading)
            res["ttft"]["with_store"] = st
            res["ttft"]["speedup_p50"] = base["p50_s"] / st["p50_s"] if st["p50_s"] else None
            # which resource binds: the biggest share of the per-request time
            parts = {"prefill compute": miss / R}
            if t0:
                parts["fixed overhead"] = t0
            if load_bind:
                parts[{"disk": "disk", "link": "network link", "pcie": "PCIe"}[load_bind]] = load_s
            tot = sum(parts.values()) if not inp.async_loading else max(load_s if load_bind else 0.0, miss / R + t0)
            res["binds"] = max(parts, key=parts.get)
            res["shares"] = {k: (v / tot if tot else 0.0) for k, v in parts.items()}
    if "binds" not in res:
        res["binds"] = (
            "prefill compute"
            if R and not hit
            else {"disk": "disk", "link": "network link", "pcie": "PCIe"}.get(load_bind or "", None)
        )
    return res


# ------------------------------------------------------------------ measurement


def measure_read(
    path: str,
    chunk_bytes: int,
    total_bytes: int = 512 * MIB,
    reps: int = 3,
    io_engine: str = "auto",
    queue_depth: int = 32,
    split_bytes: int = MIB,
) -> dict:
    """Cold read GB/s of PATH with the fx engine: files of one chunk each,
    written and read with O_DIRECT (buffered where the filesystem refuses it),
    page cache dropped before each read when root; files removed after."""
    from .. import _fxio
    from ..core.medium import page_cache_fs
    from ..testing.loopfs import drop_caches

    size = -(-chunk_bytes // _fxio.DIO_ALIGN) * _fxio.DIO_ALIGN
    n = max(1, total_bytes // size)
    d = tempfile.mkdtemp(prefix=".lmcache-fx-estimate-", dir=path)
    fds: list[int] = []
    eng = _fxio.Engine(io_engine, queue_depth, split_bytes)
    direct = True
    try:
        src = _fxio.HostBuffer(size)
        seed = os.urandom(min(size, MIB))
        mv = memoryview(src)
        for off in range(0, size, len(seed)):
            mv[off : off + len(seed)] = seed[: size - off]
        for i in range(n):
            p = os.path.join(d, f"c{i:05d}")
            try:
                fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
            except OSError:
                direct = False
                fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
            fds.append(fd)
        w = eng.write([(fd, 0, size, src.address) for fd in fds])
        if any(r != size for r in w):
            raise OSError(f"measure: short or failed writes under {path}: {sorted(set(w))[:3]}")
        for fd in fds:
            os.fsync(fd)
        dst = _fxio.HostBuffer(n * size)
        memoryview(dst)[:] = b"\0" * (n * size)  # fault the pages in before timing
        eng.register_buffer(dst, n * size)
        gbps, cold = [], True
        in_memory = page_cache_fs([path])  # tmpfs, ramfs: the page cache is the medium, nothing to drop
        for _ in range(reps):
            cold = drop_caches() and cold and not in_memory
            t0 = time.perf_counter()
            r = eng.read([(fd, 0, size, dst.address + i * size) for i, fd in enumerate(fds)])
            dt = time.perf_counter() - t0
            if any(x != size for x in r):
                raise OSError(f"measure: short or failed reads under {path}: {sorted(set(r))[:3]}")
            gbps.append(n * size / dt / GB)
        return {
            "path": path,
            "gbps": statistics.median(gbps),
            "reps_gbps": gbps,
            "cold": cold,
            "in_memory": in_memory,
            "o_direct": direct,
            "engine": eng.kind,
            "queue_depth": queue_depth,
            "split_bytes": split_bytes,
            "file_bytes": size,
            "files": n,
            "total_bytes": n * size,
        }
    finally:
        for fd in fds:
            os.close(fd)
        eng.close()
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ output


def _slower(margin: float) -> str:
    """How many times slower than recomputing a read with this margin (read
    speed over break-even) is: a margin that underflowed to 0 is no ratio."""
    return f"{1 / margin:.1f}x" if margin > 0 else "immeasurably"


def _t(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    return f"{s:.2f} s"


def _b(n: float) -> str:
    if n >= GB:
        return f"{n / GB:.2f} GB"
    if n >= MIB:
        return f"{n / MIB:.2f} MiB"
    return f"{n / KIB:.1f} KiB"


def format_text(r: dict) -> str:
    g, i, rq = r["geometry"], r["inputs"], r["request"]
    bpt, bpc = r["kv_bytes_per_token"], r["kv_bytes_per_chunk"]
    kind = (
        f"MLA latent {g['head_dim']}" if g["mla"] else f"{g['kv_heads']} KV heads x {g['head_dim']} head dim, K and V"
    )
    out = [
        f"estimate: {r['model']}, TP {i['tp']}, context {i['context']:,} tokens, hit rate {i['hit_rate']:.2f}, "
        f"concurrency {i['concurrency']}",
        f"  KV geometry      {g['layers']} layers x {kind}, {g['dtype']} ({g['dtype_bytes']} B), "
        f"chunk {g['chunk_tokens']} tokens",
    ]
    rank_note = (
        "the whole latent on every rank; stored and read once (rank 0), broadcast to the others"
        if g["mla"]
        else f"{g['kv_heads_per_rank']} KV head(s) per rank"
        + (
            f", replicated: {g['stored_copies']} copies stored"
            if g["stored_copies"] * g["kv_heads_per_rank"] > g["kv_heads"]
            else ""
        )
    )
    out.append(
        f"  KV per token     {bpt['model']:,} B model, {bpt['per_rank']:,} B per rank, "
        f"{bpt['stored']:,} B through storage ({rank_note})"
    )
    out.append(
        f"  KV per chunk     {_b(bpc['model'])} model, {_b(bpc['per_rank'])} per rank, "
        f"{_b(bpc['stored'])} through storage"
    )
    out.append(
        f"  per request      {rq['hit_tokens']:,} tokens hit ({rq['hit_chunks']} chunks): "
        f"{_b(rq['storage_bytes'])} to read, {_b(rq['per_rank_bytes'])} per rank; "
        f"{rq['miss_tokens']:,} tokens to prefill"
    )
    ld = r["load"]
    if ld["load_s"] is None:
        out.append("  load             - (give --storage-gbps or --measure PATH)")
    else:
        names = {"disk": "disk", "link": "link", "pcie": "PCIe/rank"}
        st = ", ".join(f"{names[k]} {_t(v['s'])} @ {v['gbps']:.2f} GB/s" for k, v in ld["stages"].items())
        out.append(
            f"  load prefix      {_t(ld['load_s'])}  ({st}; slowest binds"
            + (f": {ld['binds']})" if ld["binds"] else ")")
        )
        if ld["disk_stops_binding_above_gbps"]:
            out.append(
                f"                   storage faster than {ld['disk_stops_binding_above_gbps']:.2f} GB/s "
                "buys nothing more (link/PCIe bind)"
            )
    c = r.get("compute")
    if not c:
        out.append("  recompute        - (give --prefill-tok-s)")
        return "\n".join(out)
    out.append(
        f"  recompute prefix {_t(c['recompute_prefix_s'])} at {c['prefill_tok_s']:,.0f} tok/s "
        f"(whole prompt {_t(c['prefill_whole_s'])}, the miss {_t(c['prefill_miss_s'])})"
        + (f"; plus {_t(i['overhead_s'])} fixed per request" if i.get("overhead_s") else "")
    )
    be = r["break_even"]
    line = (
        f"  break-even read  {be['storage_gbps']:.2f} GB/s (= {bpt['stored']:,} B/token x "
        f"{c['prefill_tok_s']:,.0f} tok/s)"
    )
    if be["pays_off"] is not None:
        line += (
            f"; at {i['storage_gbps']:.2f} GB/s loading is {be['margin']:.1f}x faster than recomputing"
            if be["pays_off"]
            else f"; at {i['storage_gbps']:.2f} GB/s the store LOSES ({_slower(be['margin'])} slower than recomputing)"
        )
    out.append(line)
    if be.get("speedup_bound") and math.isfinite(be["speedup_bound"]):
        out.append(
            f"                   TTFT speedup at most {be['speedup_bound']:.2f}x "
            "(= min(read bandwidth / break-even, context / tokens to prefill))"
        )
    if be["unreachable_because"]:
        out.append(
            f"                   unreachable at any disk speed: {', '.join(be['unreachable_because'])} "
            "alone is slower than recomputing"
        )
    t = r["ttft"]
    q = (
        "loads overlap other requests' prefill (async loading)"
        if t["queueing"] == "async"
        else "each load blocks the engine step (LMCache's default, synchronous loading)"
    )
    out.append(f"  TTFT             {t['concurrency']} requests arrive together, served first come first served; {q}")
    out.append(f"                   {'':12}{'p50':>10}{'worst':>10}{'alone':>10}{'loop':>10}{'req/s max':>11}")
    rows = [("recompute", t["recompute"])] + ([("with store", t["with_store"])] if "with_store" in t else [])
    for name, v in rows:
        rps = f"{v['requests_per_s']:.2f}" if v["requests_per_s"] else "-"
        out.append(
            f"                   {name:12}{_t(v['p50_s']):>10}{_t(v['worst_s']):>10}{_t(v['alone_s']):>10}"
            f"{_t(v['closed_loop_s']):>10}{rps:>11}"
        )
    out.append(
        f"                   (loop: {t['concurrency']} clients in a closed loop, steady state, decode time "
        "not subtracted)"
    )
    if t.get("speedup_p50"):
        out.append(
            f"                   p50 {t['speedup_p50']:.2f}x "
            + ("faster" if t["speedup_p50"] >= 1 else "SLOWER")
            + " with the store"
        )
    if r.get("shares"):
        sh = ", ".join(f"{k} {v:.0%}" for k, v in sorted(r["shares"].items(), key=lambda kv: -kv[1]))
        how = "busy, pipelined" if r["ttft"]["queueing"] == "async" else "of the time per request"
        out.append(f"  binds            {r['binds']} ({sh} {how})")
    elif r.get("binds"):
        out.append(f"  binds            {r['binds']}")
    return "\n".join(out)


# ------------------------------------------------------------------ command line


def add_arguments(p: argparse.ArgumentParser, command: str = "estimate") -> None:
    ms = models()
    p.epilog = (
        "examples:\n"
        "  lmcache-fx estimate --model qwen3-coder-480b --tp 8 --context 32k --concurrency 16 --hit-rate 0.8 \\\n"
        "      --storage-gbps 5.2 --link-gbit 100 --prefill-tok-s 10000\n"
        "  lmcache-fx estimate --model qwen2.5-32b --context 3584 --hit-rate 1 --measure /mnt/nvme/lmcache\n"
        "  lmcache-fx estimate --layers 4 --kv-heads 2 --head-dim 64 --kv-dtype fp32 --json out.json\n\n"
        "models: "
        + ", ".join(sorted(k for k, m in ms.items() if k == m.name))
        + " (or the bench preset names, which also set --tp)\nformulas and assumptions: docs/estimate.md"
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="model preset shared with the bench (default qwen2.5-32b); see below",
    )
    g = p.add_argument_group("custom geometry (whole model; overrides the preset)")
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int, dest="kv_heads", help="KV heads of the whole model (not per rank)")
    g.add_argument("--head-dim", type=int, dest="head_dim", help="head dim (MLA: latent + rope, e.g. 576)")
    g.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), dest="kv_dtype", help="KV cache dtype (fp8 = 1 byte)")
    g.add_argument("--mla", action="store_true", help="one latent per layer instead of K and V")
    g.add_argument("--chunk", type=int, help="tokens per chunk (LMCache chunk_size, default 256)")
    w = p.add_argument_group("workload")
    w.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default 1, or the preset's)")
    w.add_argument(
        "--context",
        type=parse_tokens,
        default=parse_tokens("32k"),
        help="prompt tokens per request: 32k (= 32768), 8000, 1.5k (default 32k)",
    )
    w.add_argument("--hit-rate", type=float, default=0.8, help="fraction of the prompt found in the store")
    w.add_argument("--concurrency", type=int, default=1, help="requests arriving together")
    s = p.add_argument_group("system")
    s.add_argument("--storage-gbps", type=float, help="read GB/s the store delivers to this node (all ranks)")
    s.add_argument("--measure", metavar="PATH", help="measure --storage-gbps with a cold fx read on PATH")
    s.add_argument("--measure-size", type=parse_size, default=512 * MIB, help="bytes to read (default 512M)")
    s.add_argument("--link-gbit", type=float, help="network line rate to remote storage, Gbit/s (100 = 100GbE)")
    s.add_argument(
        "--pcie-gbps",
        type=float,
        default=25.0,
        help="host-to-GPU GB/s per GPU (default 25, Gen4 x16; Gen5 ~50; 0 to ignore)",
    )
    s.add_argument(
        "--prefill-tok-s",
        type=float,
        dest="prefill_tok_s",
        help="prompt tokens/s of the whole instance at this context length",
    )
    s.add_argument(
        "--overhead-ms",
        type=float,
        default=0.0,
        dest="overhead_ms",
        help="fixed time per request added to every step, with or without the store (HTTP, "
        "tokenization, scheduling, lookup; default 0): the TTFT of a very short prompt",
    )
    s.add_argument(
        "--async-loading",
        action="store_true",
        help="loads overlap other requests' prefill (LMCache enable_async_loading)",
    )
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="JSON to FILE (or stdout)")


# Flags that must be > 0 when given (an attribute missing or None: not given).
# --pcie-gbps may be 0 ("ignore"); --overhead-ms 0 is the default.
POSITIVE = {
    "layers": "--layers",
    "kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "chunk": "--chunk",
    "tp": "--tp",
    "storage_gbps": "--storage-gbps",
    "link_gbit": "--link-gbit",
    "prefill_tok_s": "--prefill-tok-s",
}


def check_numbers(args) -> None:
    """ValueError naming the flag of a number that cannot be (0 included: a
    0 given is not "unset")."""
    for attr, flag in POSITIVE.items():
        v = getattr(args, attr, None)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"{flag} must be a number > 0 (got {v})")
    for attr, flag in (("pcie_gbps", "--pcie-gbps"), ("overhead_ms", "--overhead-ms")):
        v = getattr(args, attr, None)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{flag} must be a number >= 0 (got {v})")


def inputs_from_args(args) -> Inputs:
    check_numbers(args)
    ms = models()
    name = args.model or "qwen2.5-32b"
    if name not in ms:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(sorted(ms))} or give the geometry")
    m = ms[name]
    over = {
        k: getattr(args, k) for k in ("layers", "kv_heads", "head_dim", "chunk") if getattr(args, k, None) is not None
    }
    if getattr(args, "kv_dtype", None):
        over["dtype"] = KV_DTYPES[args.kv_dtype]
    if getattr(args, "mla", False):
        over["mla"] = True
    if over.get("mla") or m.geo.mla:
        # An MLA latent is one per layer and token: the preset's KV heads (8 for the default model) would
        # have multiplied every figure.
        if over.get("kv_heads", 1) != 1:
            raise ValueError(f"--kv-heads {over['kv_heads']}: an MLA latent has one head; leave --kv-heads out")
        if m.geo.kv_heads != 1:
            over["kv_heads"] = 1
    geo = replace(m.geo, **over)
    custom = bool(over.keys() - {"dtype", "chunk"})
    label = "custom" if custom else (m.name + (f", {args.kv_dtype} KV" if getattr(args, "kv_dtype", None) else ""))
    return Inputs(
        geo=geo,
        tp=args.tp if args.tp is not None else m.preset_tp,
        context=args.context,
        hit_rate=args.hit_rate,
        concurrency=args.concurrency,
        storage_gbps=args.storage_gbps,
        link_gbit=args.link_gbit,
        pcie_gbps=args.pcie_gbps,
        prefill_tok_s=args.prefill_tok_s,
        async_loading=args.async_loading,
        overhead_s=(getattr(args, "overhead_ms", 0.0) or 0.0) / 1e3,
        model=label,
    )


def run(args, parser: Optional[argparse.ArgumentParser] = None) -> int:
    parser = parser or build_parser()
    try:
        inp = inputs_from_args(args)
        rank_geometry(inp.geo, inp.tp)
    except ValueError as e:
        parser.error(str(e))
    if not 0 <= args.hit_rate <= 1:
        parser.error("--hit-rate must be between 0 and 1")
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if args.json and args.json != "-":
        why = unwritable(args.json)
        if why:  # said before a --measure run, not after
            parser.error(f"--json {args.json}: {why}")
    meas = None
    if args.measure:
        if args.storage_gbps:
            parser.error("give --storage-gbps or --measure, not both")
        if not os.path.isdir(args.measure):
            what = "not a directory" if os.path.exists(args.measure) else "no such directory"
            parser.error(f"--measure {args.measure}: {what}; give a directory on the storage to measure")
        why = unwritable(os.path.join(args.measure, ".lmcache-fx-estimate"))
        if why:  # it writes its files there first
            parser.error(
                f"--measure {args.measure}: {why.replace('a path you can write', 'a directory you can write')}"
            )
        rank, _ = rank_geometry(inp.geo, inp.tp)
        try:
            meas = measure_read(args.measure, rank.chunk_bytes, args.measure_size)
        except OSError as e:
            why = e.strerror if e.strerror and e.filename else str(e)
            sys.stderr.write(f"estimate: --measure {args.measure}: {why}\n")
            return 1
        inp.storage_gbps = meas["gbps"]
    res = estimate(inp)
    if meas:
        res["measured"] = meas
    if args.json:
        text = json.dumps(res, indent=1)
        if args.json == "-":
            print(text)
            return 0
        try:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        except OSError as e:  # checked above; changed since, or a full disk
            sys.stderr.write(f"estimate: --json {args.json}: {e.strerror or e}\n")
            return 1
    out = format_text(res)
    if meas:
        out += (
            f"\n  measured         {meas['gbps']:.2f} GB/s on {meas['path']} ({meas['files']} x "
            f"{_b(meas['file_bytes'])} files, {meas['engine']} QD {meas['queue_depth']}, "
            f"{'O_DIRECT' if meas['o_direct'] else 'BUFFERED'}, "
            f"{'cold' if meas['cold'] else 'from memory' if meas['in_memory'] else 'WARM (not root)'}; "
            f"reps {', '.join(f'{x:.2f}' for x in meas['reps_gbps'])}); one process: "
            "TP ranks reading at once may get more"
        )
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .cli import command_parser

    return command_parser("estimate", add_arguments, __doc__ or "")


def main(argv=None) -> int:
    from .cli import run_command

    return run_command("estimate", argv)


if __name__ == "__main__":
    sys.exit(main())
