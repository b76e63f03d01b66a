#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from a `lmcache-fx bench --json`
file, so the page's figures are the JSON's and nothing is typed by hand:

    python scripts/bench_tables.py docs/bench-xfs-64m.json
    python scripts/bench_tables.py --ratios docs/bench-xfs-64m.json docs/bench-repeats/xfs-64m-run*.json
    python scripts/bench_tables.py --runs fx-unmapped docs/bench-repeats/mapped-reads/huge-*.json
    python scripts/bench_tables.py --probe docs/mapped-probe.json      # scripts/staged_probe.py's rounds
    python scripts/bench_tables.py --l2-stores "64 MiB, run 1" docs/bench-repeats/l2-written-images/64m-run1.json ...
    python scripts/bench_tables.py --latency-rounds "64 MiB" docs/bench-repeats/latency-rounds/*-64m-run1.json \
        "2 MiB, run 1" docs/bench-repeats/latency-rounds/*-2m-run1.json   # --latency-rounds runs
    python scripts/bench_tables.py --latency-probe docs/latency-probe.json floor-2m floor-10m   # its labels
    python scripts/bench_tables.py --latency-layers "run 1" docs/bench-repeats/latency-layers/868fddf-run1.json ...
        # and --latency-gil (the --gil runs), --latency-reserve (the runs with plugin-reserve, a row each)
    python scripts/bench_tables.py --latency-cpu "10 MiB, run 1" docs/bench-repeats/latency-awaited/5028bcf-10m-run1.json ...
        # --latency-rounds runs' CPU per request (runs since 5028bcf); --latency-first-tenth: where the slow
        # requests fell, and the warm-up's p50 over the timed one (runs since --latency-warmup)
    python scripts/bench_tables.py --per-chunk-runs "run 1" docs/bench-repeats/per-chunk-written/77cbeb3-run1.json ...
    python scripts/bench_tables.py --chunk-overhead "run 1" docs/bench-repeats/chunk-overhead/41bcd7c-run1.json ...
    python scripts/bench_tables.py --build-ab-writes "run 1" docs/bench-repeats/extents/63cb079-writes.json ...
    python scripts/bench_tables.py --split-grid "run 1" docs/bench-repeats/inflight/50a45b7-run1.json ...
    python scripts/bench_tables.py --awaited-probe docs/awaited-cost-probe.json 7e41988-nice1 ...
        # runs of scripts/awaited_cost_probe.py with the loop's run-queue wait (since 7e41988)
    python scripts/bench_tables.py --positions docs/loop-position-probe.json
    python scripts/bench_tables.py --image-memory docs/bench-repeats/image-memory/run1.json
    python scripts/bench_tables.py --lmcache-l2 docs/bench-lmcache-l2.json     # LMCache's `lmcache bench l2`
    python scripts/bench_tables.py --medium-limit docs/medium-limit-probe.json # fio over a grid
    python scripts/bench_tables.py --staged-direct "run 1" docs/bench-repeats/staged-direct/run1.json ...
    python scripts/bench_tables.py --placement "run 1" docs/bench-repeats/placement/<commit>-run1.json ...
    python scripts/bench_tables.py --readme "XFS …, 7 × 64 MiB" docs/bench-repeats/round-5dbed3b/xfs-64m-run*.json \
        "same, 238 × 2 MiB" docs/bench-repeats/round-5dbed3b/xfs-2m-run*.json   # README.md's two tables
    python scripts/bench_tables.py --mixed-runs 64MiB docs/bench-mixed-64m.json docs/bench-repeats/mixed-64m-run*.json \
        2MiB docs/bench-mixed-2m.json docs/bench-repeats/mixed-2m-run*.json

Prints the command line and commit, the main table (medians; fx's ratios to
the best peer, its store also against the best store of its own level), the
latency table and the cost-per-chunk table when the run has them."""

from __future__ import annotations

import json
import statistics
import sys
from typing import Callable

L2_PEERS = ("fs_native", "raw_block")  # LMCache's MP-mode L2 adapters the bench runs


def _f(v, fmt: str) -> str:
    return "–" if v is None else fmt.format(v)


def main_table(d: dict) -> str:
    rows = [
        "| reader | tier GB/s | retrieve GB/s | store GB/s | tier CPU s/GB | read / best peer "
        "| store / best peer, same level | CPU / lowest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best = (d.get("best_peer") or {}).get("tier_read_gbps", {}).get("reader")
    for name, e in d["readers"].items():
        if not e.get("available"):
            rows.append(f"| {e['label']} | skipped: {e.get('skip_reason', '')} |||||||")
            continue
        m, r = e["median"], e.get("ratio_to_best_peer") or {}
        label = f"**{e['label']}**" if name == best else e["label"]
        tier = _f(m["tier_read_gbps"], "{:.2f}")
        rows.append(
            f"| {label} | {f'**{tier}**' if name == best else tier} | {_f(m.get('retrieve_gbps'), '{:.2f}')} "
            f"| {_f(m.get('store_gbps'), '{:.2f}')} | {_f(m.get('tier_cpu_s_per_gb'), '{:.3f}')} "
            f"| {_f(r.get('tier_read'), '{:.2f}×') if r else ''} "
            f"| {_f(r.get('store_same_level'), '{:.2f}×') if r else ''} "
            f"| {_f(r.get('tier_cpu'), '{:.1f}×') if r else ''} |"
        )
    return "\n".join(rows)


def latency_table(d: dict) -> str:
    lat = [(e["label"], e["latency"]) for e in d["readers"].values() if e.get("available") and e.get("latency")]
    if not lat:
        return ""
    concs = sorted({int(c) for _, x in lat for c in x}, key=int)
    rows = ["| reader | " + " | ".join(f"{c} in flight" for c in concs) + " |", "|---|" + "---:|" * len(concs)]
    for label, x in lat:
        cells = []
        for c in concs:
            v = x.get(str(c)) or {}
            cell = f"{v['p50_ms']:.1f} / {v['p99_ms']:.1f}" if "p50_ms" in v else "–"
            if v.get("p99_over_p50") is not None:  # runs with --latency-rounds: medians over the rounds
                cell += f" ({v['p99_over_p50']:.2f}×)"
            cells.append(cell)
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def per_chunk_table(d: dict) -> str:
    pc = (d.get("per_chunk") or {}).get("readers") or {}
    if not pc:
        return ""
    rows = ["| reader | read µs/chunk | read CPU µs/chunk | store µs/chunk |", "|---|---:|---:|---:|"]
    for e in pc.values():
        if e.get("available"):
            rows.append(
                f"| {e['label']} | {_f(e['tier_us_per_chunk'], '{:.1f}')} "
                f"| {_f(e['tier_cpu_us_per_chunk'], '{:.1f}')} | {_f(e['store_us_per_chunk'], '{:.1f}')} |"
            )
    return "\n".join(rows)


def mixed_table(d: dict) -> str:
    rows = [
        "| reader | load GB/s while storing | vs alone | store GB/s while loading | vs alone |",
        "|---|---:|---:|---:|---:|",
    ]
    mixed = [(e["label"], e["mixed"]) for e in d["readers"].values() if e.get("mixed")]
    if not mixed:
        return ""
    for label, m in mixed:
        rows.append(
            f"| {label} | {_f(m.get('load_gbps'), '{:.2f}')} | {_f(m.get('load_vs_alone'), '{:.2f}×')} "
            f"| {_f(m.get('store_gbps'), '{:.2f}')} | {_f(m.get('store_vs_alone'), '{:.2f}×')} |"
        )
    return "\n".join(rows)


def full_store_probe_table(d: dict) -> str:
    """scripts/full_store_probe.py's JSON: stores into a full store with
    reuse_evicted on and off, per medium and chunk size."""
    head = (
        f"`{d['command']}` at `{(d.get('git_commit') or 'unknown')[:12]}`{'+dirty' if d.get('dirty') else ''}; "
        f"load average at the end {d['loadavg_end'][0]:.1f} ({d['cpus']} cores)."
    )
    peer_key = "reuse_evicted on, another process has the store open"
    with_peer = any(peer_key in r for cases in d["media"].values() for r in cases.values())
    rows = [
        "| medium | chunks per batch (store holds) | reuse on: GB/s · CPU s/GB | reuse off: GB/s · CPU s/GB "
        "| on / off (median · per rep min–max) "
        + ("| on, another process with the store open: GB/s · reused per batch · / off " if with_peer else "")
        + "| preads of what was written: on · off GB/s |",
        "|---|---|---:|---:|---:|" + ("---:|" if with_peer else "") + "---:|",
    ]
    for medium, cases in d["media"].items():
        for case, r in cases.items():
            on, off, per = r["reuse_evicted on"], r["reuse_evicted off"], r["on / off per rep"]
            peer = r.get(peer_key)
            rows.append(
                f"| {medium} | {r['chunks per batch']} × {case} ({r['capacity (chunks)']}) "
                f"| {on['gbps']:.2f} · {on['cpu_s_per_gb']:.3f} | {off['gbps']:.2f} · {off['cpu_s_per_gb']:.3f} "
                f"| {r['on / off']:.2f}× ({min(per):.2f}–{max(per):.2f}) "
                + (
                    f"| {peer['gbps']:.2f} · {peer['recycled_per_batch']:.0f} of {peer['evictions_per_batch']:.0f} "
                    f"· {r['on with another process / off']:.2f}× "
                    if peer is not None
                    else ("| – " if with_peer else "")
                )
                + (f"| {on['read_gbps']:.2f} · {off['read_gbps']:.2f} |" if "read_gbps" in on else "| – |")
            )
    return head + "\n\n" + "\n".join(rows)


def render(d: dict) -> str:
    if "media" in d:
        return full_store_probe_table(d)
    m = d["machine"]
    head = (
        f"`{d['command']}` at `{(d.get('git_commit') or 'unknown')[:12]}`; {d['config']['reps']} reps, medians; "
        f"load average at the start {m['loadavg_start'][0]:.1f}, at the end {m['loadavg_end'][0]:.1f} "
        f"({m['cpus']} cores); {'cold' if d['cold'] else 'WARM'}"
        + (
            "; `--full-store`: fx-l2 holds one rep's chunks, so each of its stores evicts one (inside its timing), "
            "the other adapters' chunks are deleted between reps (outside theirs)."
            if d["config"].get("full_store")
            else "."
        )
    )
    parts = [head, main_table(d)]
    lat = latency_table(d)
    if lat:
        parts += ["Latency per one-chunk request, p50 / p99 ms:", lat]
    mx = mixed_table(d)
    if mx:
        parts += [
            "Stores while loads run (`--mixed`: a store of as many new chunks submitted with the load), medians:",
            mx,
        ]
    pc = per_chunk_table(d)
    if pc:
        n = d["per_chunk"]
        parts += [
            f"Cost per chunk ({n['n_chunks']} chunks of {n['chunk_bytes'] // 1024} KiB, medians of {n['reps']}):",
            pc,
        ]
    return "\n\n".join(parts)


def ratios_table(paths: list[str]) -> str:
    """fx's ratios in each of several runs of one case (the same command at
    the same commit): tier read and store (same level) against the best peer,
    as min / median / max over the runs."""
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    rows = [
        f"{len(runs)} runs ({', '.join(paths)}):",
        "",
        "| reader | read / best peer (min · median · max) | store / best of its level | tier CPU / lowest |",
        "|---|---|---|---|",
    ]
    names = [n for n, e in runs[0]["readers"].items() if e.get("ratio_to_best_peer")]
    for n in names:
        cells = []
        for k, fmt in (("tier_read", "{:.2f}×"), ("store_same_level", "{:.2f}×"), ("tier_cpu", "{:.1f}×")):
            vs = sorted(
                v
                for r in runs
                if (v := ((r["readers"].get(n) or {}).get("ratio_to_best_peer") or {}).get(k)) is not None
            )
            cells.append(" · ".join(fmt.format(v) for v in (vs[0], statistics.median(vs), vs[-1])) if vs else "–")
        rows.append(f"| {runs[0]['readers'][n]['label']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def runs_table(paths: list[str], over: str) -> str:
    """Tier read GB/s run by run (one row per file): fx's readers with their
    ratio to the run's best peer, fx over the reader `over`, the peers, the
    best peer's name, and the tier CPU s/GB of fx, `over` and fs_native."""
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append((p.rsplit("/", 1)[-1].removesuffix(".json"), json.load(f)))
    names = [n for n, e in runs[0][1]["readers"].items() if e.get("available")]
    fx_names = [n for n in names if n.startswith("fx")]
    peers = [n for n in names if not n.startswith("fx") and n != "fio"]
    first = "fx" if "fx" in names else fx_names[0]
    cpu_of = list(dict.fromkeys(n for n in (first, over, "fs_native") if n in names))
    fx_over = "fx" in names and over in names  # runs of fx's L2 adapter alone have no fx column to divide
    rows = [
        "| run | " + " | ".join(fx_names) + (f" | fx / {over}" if fx_over else "") + " | " + " | ".join(peers)
        + " | best peer | tier CPU s/GB (" + " / ".join(cpu_of) + ") |",
        "|---|" + "---:|" * (len(fx_names) + fx_over + len(peers)) + "---|---|",
    ]  # fmt: skip
    for label, d in runs:
        r = d["readers"]
        best = d["best_peer"]["tier_read_gbps"]

        def gbps(n, r=r):
            return r[n]["median"]["tier_read_gbps"]

        cells = [f"{gbps(n):.2f} ({gbps(n) / best['value']:.2f}×)" for n in fx_names]
        if fx_over:
            cells.append(f"{gbps('fx') / gbps(over):.2f}×")
        cells += [f"{gbps(n):.2f}" for n in peers]
        cells.append(best["reader"])
        cells.append(" / ".join(f"{r[n]['median']['tier_cpu_s_per_gb']:.3f}" for n in cpu_of))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def mixed_runs_table(groups: list[tuple[str, list[str]]]) -> str:
    """`--mixed` over several runs, per chunk size (a label and its runs'
    files): each L2 reader's load and store while the other runs, against
    its own figure alone, run by run; and fx-l2's load over each reader's."""
    rows = [
        "| chunk | reader | load GB/s while storing (each run) | vs alone | store GB/s while loading | vs alone "
        "| fx-l2's load / this reader's |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, paths in groups:
        runs = []
        for p in paths:
            with open(p) as f:
                runs.append(json.load(f))
        names = [n for n, e in runs[0]["readers"].items() if e.get("mixed")]

        def cell(n, key, fmt, runs=runs):
            return " · ".join(_f(((r["readers"].get(n) or {}).get("mixed") or {}).get(key), fmt) for r in runs)

        for n in names:
            fx_over = ""
            if n != "fx-l2":
                vs = []
                for r in runs:
                    a = ((r["readers"].get("fx-l2") or {}).get("mixed") or {}).get("load_gbps")
                    b = ((r["readers"].get(n) or {}).get("mixed") or {}).get("load_gbps")
                    vs.append(_f(a / b if a and b else None, "{:.2f}×"))
                fx_over = " · ".join(vs)
            rows.append(
                f"| {label} | {runs[0]['readers'][n]['label']} | {cell(n, 'load_gbps', '{:.2f}')} "
                f"| {cell(n, 'load_vs_alone', '{:.2f}×')} | {cell(n, 'store_gbps', '{:.2f}')} "
                f"| {cell(n, 'store_vs_alone', '{:.2f}×')} | {fx_over} |"
            )
    return "\n".join(rows)


def _labelled_runs(cases: list[tuple[str, str]]) -> list[tuple[str, dict]]:
    """(label, JSON file) pairs, each file loaded."""
    runs = []
    for label, path in cases:
        with open(path) as f:
            runs.append((label, json.load(f)))
    return runs


def _md_table(head: list[str], body: list[list[str]], align: str = "---", left: int = 1) -> str:
    """A markdown table: the first `left` columns left-aligned, the others by `align`."""
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * left + f"{align}|" * (len(head) - left)]
    rows += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(rows)


def store_runs_table(cases: list[tuple[str, str]]) -> str:
    """L2 stores and loads run by run (a label and a file each): each L2
    reader's store and load GB/s (medians of the run's reps; the slowest
    store rep in brackets), and fx-l2's over the best of the others."""
    runs = _labelled_runs(cases)
    names = [n for n, e in runs[0][1]["readers"].items() if e.get("available")]
    # LMCache's L2 adapters only: not fx's own variants (fx-l2-unstaged, ...), fio or engine-level tiers
    peers = [n for n in names if n in L2_PEERS]
    body = []
    for label, d in runs:
        r = d["readers"]

        def med(n, k, r=r):
            return r[n]["median"][k]

        cells = [
            f"{med(n, 'store_gbps'):.2f} ({min(x['store_gbps'] for x in r[n]['reps'] if x.get('store_gbps')):.2f})"
            f" · {med(n, 'tier_read_gbps'):.2f}"
            for n in names
        ]
        bs = max(med(n, "store_gbps") for n in peers)
        bl = max(med(n, "tier_read_gbps") for n in peers)
        cells.append(f"{med('fx-l2', 'store_gbps') / bs:.2f}× · {med('fx-l2', 'tier_read_gbps') / bl:.2f}×")
        body.append([label] + cells)
    head = ["run"] + [f"{n} store (slowest rep) · load" for n in names] + ["fx-l2 / best peer: store · load"]
    return _md_table(head, body)


README_READERS = ["fx", "fx-l2", "local_disk", "fs_connector", "rust_raw_block", "fs_native", "raw_block"]


def _span(vs: list[float], fmt: str = "{:.2f}×") -> str:
    """min–max (median) of one ratio over a case's runs."""
    vs = sorted(vs)
    lo, hi, mid = fmt.format(vs[0]), fmt.format(vs[-1]), fmt.format(statistics.median(vs))
    return f"{lo} ({mid})" if lo == hi else f"{lo.rstrip('×')}–{hi} ({mid})"


def readme_tables(cases: list[tuple[str, list[str]]]) -> str:
    """The README's two tables over one round (a label and the case's runs'
    files each): tier read GB/s of each case's first run, the fastest reader
    in bold; then fx's ratios over every run of each case, min–max (median):
    reads against the best peer, stores against the best of the same level
    (fx through LMCache's engine against the engine-level tiers, fx-l2
    against the other L2 adapters), tier CPU against the lowest peer's."""
    head = ["medium, chunks"] + [
        "fx",
        "fx L2 adapter",
        "LocalDisk",
        "FSConnector",
        "RustRawBlock",
        "fs_native (L2)",
        "raw_block (L2)",
    ]
    body, ratios = [], []
    for label, paths in cases:
        runs = []
        for p in paths:
            with open(p) as f:
                runs.append(json.load(f))
        v = [runs[0]["readers"][n]["median"]["tier_read_gbps"] for n in README_READERS]
        body.append([label] + [f"**{x:.2f}**" if x == max(v) else f"{x:.2f}" for x in v])

        def r(n, k, runs=runs):
            return [d["readers"][n]["ratio_to_best_peer"][k] for d in runs]

        ratios.append(
            [label, str(len(runs))]
            + [_span(r("fx", "tier_read")), _span(r("fx-l2", "tier_read"))]
            + [_span(r("fx", "store_same_level")), _span(r("fx-l2", "store_same_level"))]
            + [_span(r("fx", "tier_cpu"), "{:.1f}×"), _span(r("fx-noverify", "tier_cpu"), "{:.1f}×")]
        )
    rhead = [
        "medium, chunks",
        "runs",
        "read: fx",
        "read: fx L2 adapter",
        "store: fx / best engine tier",
        "store: fx L2 / best L2 adapter",
        "CPU per GB: fx / lowest",
        "the same, verify off",
    ]
    return _md_table(head, body, "---:") + "\n\n" + _md_table(rhead, ratios, "---:")


def devices_table(cases: list[tuple[str, str]]) -> str:
    """`lmcache-fx bench --devices N` runs side by side (a label and a file
    each): per reader, tier read GB/s (store GB/s) · tier CPU s/GB, medians
    over the reps; then each fx reader's tier read over fio's aggregate."""
    runs = _labelled_runs(cases)
    names: list[str] = []
    labels: dict[str, str] = {}
    for _, d in runs:
        for n, e in d["readers"].items():
            if n not in names:
                names.append(n)
                labels[n] = e["label"]
    body = []
    for n in names:
        row = [labels[n]]
        for _, d in runs:
            e = d["readers"].get(n)
            if not e or not e.get("available"):
                row.append("–")
                continue
            m = e["median"]
            row.append(
                f"{_f(m['tier_read_gbps'], '{:.2f}')} ({_f(m.get('store_gbps'), '{:.2f}')}) "
                f"· {_f(m.get('tier_cpu_s_per_gb'), '{:.3f}')}"
            )
        body.append(row)
    for n in names:  # the striped readers (fio aside): the target is theirs
        striped = [d["readers"].get(n, {}).get("devices", 1) > 1 for _, d in runs]
        if n == "fio" or not any(striped):
            continue
        row = [f"**{labels[n]} / fio aggregate**"]
        for _, d in runs:
            v = d["readers"].get(n, {}).get("ratio_to_fio")
            row.append(f"**{v:.2f}×**" if v is not None else "–")
        body.append(row)
    return _md_table(["reader"] + [label for label, _ in runs], body)


def inflight_table(cases: list[tuple[str, str]]) -> str:
    """scripts/inflight_probe.py's runs (a label and a file each): per way,
    GB/s · block-layer reads in flight per device · share of samples with
    none, medians over the reps."""
    import re

    def key(way: str) -> str:  # "queue_depth 256 (32 per device)" names N x 32
        return re.sub(r"queue_depth \d+ \(32 per device\)", "queue_depth 32 × devices", way)

    runs = [(label, {key(w): v for w, v in d["ways"].items()}) for label, d in _labelled_runs(cases)]
    ways = list(dict.fromkeys(w for _, d in runs for w in d))
    body = []
    for w in ways:
        row = [w]
        for _, d in runs:
            v = d.get(w)
            row.append(
                "–"
                if v is None
                else f"{v['gbps_median']:.2f} · {v['mean_reads_per_device_median']:.1f} · {v['idle_share_median']:.2f}"
            )
        body.append(row)
    return _md_table(["way"] + [label for label, _ in runs], body)


def stripe_model_table(d: dict) -> str:
    """scripts/stripe_model.py's run: per device count and chunks a request,
    a device-bound read's share of even-share speed by digest alone and
    balanced, median (1st percentile) over the requests."""
    body = []
    for r in d["rows"]:
        cells = [f"{r[k]['median']:.2f} ({r[k]['p1']:.2f})" for k in ("by_digest", "balanced")]
        body.append([str(r["devices"]), str(r["chunks"]), *cells])
    return _md_table(["devices", "chunks a request", "by digest", "balanced"], body)


def latency_rounds_table(cases: list[tuple[str, str]]) -> str:
    """Latency cases of runs with --latency-rounds (a label and a file each):
    a row per label and count in flight, a column per reader, each cell the
    median of the rounds' own p99/p50 (their range) and the medians of p50 /
    p99 in ms."""
    runs = _labelled_runs(cases)
    names = [n for n, e in runs[0][1]["readers"].items() if e.get("latency")]
    rows = [
        "| chunk, in flight | " + " | ".join(runs[0][1]["readers"][n]["label"] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, d in runs:
        concs = sorted({int(c) for n in names for c in d["readers"][n]["latency"]})
        for c in concs:
            cells = []
            for n in names:
                v = d["readers"][n]["latency"].get(str(c)) or {}
                each = v.get("p99_over_p50_each") or []
                cells.append(
                    f"{v['p99_over_p50']:.2f} ({min(each):.2f}–{max(each):.2f}) · {v['p50_ms']:.1f} / {v['p99_ms']:.1f}"
                    if each
                    else "–"
                )
            rows.append(f"| {label}, {c} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _latency_cases_table(cases: list[tuple[str, str]], cell: Callable[[dict], str], head: str) -> str:
    """Latency cases of bench runs (a label and a file each): a row per label
    and count in flight (its first column headed `head`), a column per
    reader, each cell `cell` of the case."""
    runs = _labelled_runs(cases)
    names = [n for n, e in runs[0][1]["readers"].items() if e.get("latency")]
    body = []
    for label, d in runs:
        for c in sorted({int(c) for n in names for c in d["readers"][n]["latency"]}):
            body.append([f"{label}, {c}"] + [cell(d["readers"][n]["latency"].get(str(c)) or {}) for n in names])
    return _md_table([head] + [runs[0][1]["readers"][n]["label"] for n in names], body)


def latency_first_tenth_table(cases: list[tuple[str, str]]) -> str:
    """Where a latency case's slow requests (over 2x its round's p50) fell:
    each cell the slow requests in the first tenth of each round's requests
    / all slow ones, summed over the rounds, then the warm-up requests' p50
    over the timed ones' (medians over the rounds; runs since
    --latency-warmup)."""

    def cell(v: dict) -> str:
        rounds = [r for r in v.get("rounds", []) if r.get("ms")]
        first = sum(1 for r in rounds for i in r["over_2x_p50"] if i * 10 < len(r["ms"]))
        slow = sum(len(r["over_2x_p50"]) for r in rounds)
        warm = v.get("warmup_p50_ms")
        return f"{first} / {slow}" + (f" · {warm / v['p50_ms']:.2f}×" if warm else "")

    return _latency_cases_table(cases, cell, "run, in flight")


def latency_cpu_table(cases: list[tuple[str, str]]) -> str:
    """The CPU per request of the latency cases (runs since 5028bcf): each
    cell the medians over the rounds of the process's / LMCache loop
    thread's (awaited runs) / the host's busy µs per request, and the
    host's stolen share."""
    keys = ("process_cpu_us_per_request", "loop_cpu_us_per_request", "host_busy_us_per_request")

    def cell(v: dict) -> str:
        steal = v.get("host_steal_share")
        cpu = " / ".join(_f(v.get(k), "{:.0f}") for k in keys)
        return f"{cpu}; {_f(None if steal is None else steal * 100, '{:.1f}')} %"

    return _latency_cases_table(cases, cell, "chunk, in flight")


def latency_probe_table(d: dict, labels: list[str]) -> str:
    """Runs of scripts/latency_probe.py (labels of its JSON): a row per label
    and count in flight, a column per engine, each cell the median of the
    rounds' own p99/p50 (their range), the medians of p50 / p99 in ms and the
    median GB/s."""
    runs = [d["runs"][label] for label in labels]
    engines = list(runs[0]["summary (medians over rounds)"])

    def cell(s: dict, rounds: list) -> str:
        each = [x["p99_ms"] / x["p50_ms"] for x in rounds]
        return (
            f"{s['p99_over_p50']:.2f} ({min(each):.2f}–{max(each):.2f}) · {s['p50_ms']:.1f} / {s['p99_ms']:.1f}"
            f" · {s['gbps']:.2f} GB/s"
        )

    body = [
        [f"{r['chunk_mib']} MiB, {c}"]
        + [cell(r["summary (medians over rounds)"][e][c], r["rounds_raw"][e][c]) for e in engines]
        for r in runs
        for c in r["summary (medians over rounds)"][engines[0]]
    ]
    return _md_table(["chunk, in flight"] + engines, body)


def awaited_probe_table(d: dict, labels: list[str]) -> str:
    """Runs of scripts/awaited_cost_probe.py (labels of its JSON) with the
    loop thread's run-queue wait (since 7e41988): a row per label and count in
    flight, a column per reader, each cell the medians over the rounds of p50 /
    p99 ms · the loop's wait for a CPU / its CPU, µs per request · the host's
    busy share; then each reader's p50 over RustRawBlockBackend's (medians of
    the rounds' own ratios)."""
    runs = [(label, d["runs"][label]) for label in labels]
    names = list(runs[0][1]["tiers (medians over rounds)"])
    others = [n for n in names if n != "rust_raw_block"]

    def cell(v: dict) -> str:
        return (
            f"{v['p50_ms']:.2f} / {v['p99_ms']:.2f} · {v['loop_wait_us']:.0f} / {v['loop_cpu_us']:.0f} · "
            f"{v['host_busy_share']:.2f}"
        )

    body = []
    for label, r in runs:
        tiers = r["tiers (medians over rounds)"]
        for c in tiers[names[0]]:
            ratios = [r[f"{n} over rust_raw_block (medians of each round's ratio)"][c]["p50_ms"] for n in others]
            body.append(
                [f"{label}, {c}"] + [cell(tiers[n][c]) for n in names] + [" · ".join(f"{x:.2f}×" for x in ratios)]
            )
    return _md_table(["run, in flight"] + names + [" · ".join(others) + " p50 / RustRawBlock's"], body)


def _layers_runs_table(cases: list[tuple[str, str]], cell: Callable[[dict], str]) -> str:
    """Runs of scripts/latency_layers_probe.py (a label and a file each): a
    row per mode, a column per run and count in flight, each cell `cell` of
    that mode's medians over the rounds."""
    runs = _labelled_runs(cases)
    first = runs[0][1]["summary (medians over rounds)"]
    modes, concs = list(first), list(next(iter(first.values())))
    cols = [(label, d["summary (medians over rounds)"], c) for label, d in runs for c in concs]
    return _md_table(
        ["mode"] + [f"{label}, {c} in flight" for label, _, c in cols],
        [[m] + [cell(summary[m][c]) for _, summary, c in cols] for m in modes],
    )


def latency_layers_table(cases: list[tuple[str, str]]) -> str:
    """The layers probe's runs, each cell the median of the rounds' own
    p99/p50 (their range) and the medians of p50 / p99 in ms."""

    def cell(v: dict) -> str:
        return (
            f"{v['p99_over_p50']:.2f} ({v['p99_over_p50_min']:.2f}–{v['p99_over_p50_max']:.2f}) "
            f"· {v['p50_ms']:.1f} / {v['p99_ms']:.1f}"
        )

    return _layers_runs_table(cases, cell)


def latency_gil_table(cases: list[tuple[str, str]]) -> str:
    """The layers probe's --gil runs, each cell where the requests near the
    p50 and the slowest 1 % spent their time (ms, medians over the rounds):
    in fx's engine / waiting for the GIL after it / the rest."""

    def cell(v: dict) -> str:
        a, b = v["split"]["near_p50"], v["split"]["top_1pct"]
        return (
            f"{a['engine_ms']:.2f} / {a['gil_wait_ms']:.2f} / {a['rest_ms']:.2f} · "
            f"{b['engine_ms']:.2f} / {b['gil_wait_ms']:.2f} / {b['rest_ms']:.2f}"
        )

    return _layers_runs_table(cases, cell)


def latency_reserve_table(cases: list[tuple[str, str]]) -> str:
    """The layers probe's runs with plugin-reserve (a label and a file
    each), a row per run: p99/p50 at each count in flight of store-rotating,
    the plugin and plugin-reserve (medians over the rounds), and at the most
    in flight where the slowest 1 % of the plugin's and plugin-reserve's
    requests spent their time, ms in fx's engine / waiting for the GIL after
    it; and the requesting thread's CPU per request (µs) of those two modes."""
    runs = _labelled_runs(cases)
    modes = ("store-rotating", "plugin", "plugin-reserve")
    first = runs[0][1]["summary (medians over rounds)"]
    concs = list(first["plugin"])
    top = concs[-1]
    head = ["run"] + [f"{m}: p99/p50 at {' · '.join(concs)}" for m in modes]
    head += [f"{m}: slowest 1 % at {top}, engine / GIL wait ms" for m in modes[1:]]
    head += [f"{m}: CPU µs a request at {' · '.join(concs)}" for m in modes[1:]]
    body = []
    for label, d in runs:
        s = d["summary (medians over rounds)"]
        row = [label] + [" · ".join(f"{s[m][c]['p99_over_p50']:.2f}" for c in concs) for m in modes]
        for m in modes[1:]:
            t = s[m][top]["split"]["top_1pct"]
            row.append(f"{t['engine_ms']:.1f} / {t['gil_wait_ms']:.1f}")
        row += [" · ".join(f"{s[m][c]['thread_cpu_us_per_request']:.0f}" for c in concs) for m in modes[1:]]
        body.append(row)
    return _md_table(head, body)


def per_chunk_runs_table(cases: list[tuple[str, str]]) -> str:
    """The cost-per-chunk case of several runs (a label and a file each): a
    row per reader, a column per run, each cell µs per chunk of the tier read
    and of the store (medians of the run's reps)."""
    runs = _labelled_runs(cases)

    def cell(v: dict) -> str:
        return f"{_f(v.get('tier_us_per_chunk'), '{:.1f}')} · {_f(v.get('store_us_per_chunk'), '{:.1f}')}"

    readers = runs[0][1]["per_chunk"]["readers"]
    return _md_table(
        ["reader"] + [f"{label}: read · store µs" for label, _ in runs],
        [[e["label"]] + [cell(d["per_chunk"]["readers"][n]) for _, d in runs] for n, e in readers.items()],
        align="---:",
    )


def store_check_table(cases: list[tuple[str, str]]) -> str:
    """Runs of scripts/store_check_probe.py (a label and a file each): a row
    per chunk size and writer, a column per run, each cell GB/s, the median
    of each rep's speed over fs_native's and CPU s/GB (medians of the reps)."""
    runs = _labelled_runs(cases)

    def cell(v: dict) -> str:
        return f"{v['gbps']:.2f} · {v['over_fs_native']:.2f}× · {v['cpu_s_per_gb']:.3f}"

    body = []
    for i, case in enumerate(runs[0][1]["cases"]):
        for m in case["modes"]:
            body.append([case["chunks"], m] + [cell(d["cases"][i]["modes"][m]) for _, d in runs])
    head = ["chunks", "writer"] + [f"{label}: GB/s · over fs_native · CPU s/GB" for label, _ in runs]
    return _md_table(head, body, align="---:", left=2)


# scripts/chunk_overhead.py's methods in the table, in its order, and their labels
CHUNK_OVERHEAD_ROWS = {
    "store": "fx's store (`ChunkStore.read`)",
    "store_noverify": "fx's store, verify off",
    "read_chunks": "fx's engine alone (`read_chunks`)",
    "read_chunks_noverify": "fx's engine alone, verify off",
    "preadv": "open, one preadv, close, one file at a time",
    "preadv_crc": "the same, then a CRC32C of the payload",
    "fs_native_best": "fs_native (best of 4 and 8 workers each rep)",
}


def chunk_overhead_table(cases: list[tuple[str, str]]) -> str:
    """Runs of scripts/chunk_overhead.py (a label and a file each): a row per
    payload size and reader, a cell per run each of CPU µs per chunk, CPU
    over fs_native's and speed over fs_native's (medians of the run's per-rep
    ratios) and context switches per chunk."""
    runs = _labelled_runs(cases)
    body = []
    for i, case in enumerate(runs[0][1]["results"]):
        size = case["payload_bytes"]
        chunks = f"{case['chunks']} × " + (f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB")
        for m, label in CHUNK_OVERHEAD_ROWS.items():
            vs = [d["results"][i]["methods"][m] for _, d in runs]
            body.append(
                [chunks, label]
                + [
                    " · ".join(f.format(v[k]) for v in vs)
                    for k, f in (
                        ("cpu_us_per_chunk", "{:.0f}"),
                        ("cpu_over_fs_native", "{:.2f}×"),
                        ("speed_over_fs_native", "{:.2f}×"),
                        ("switches_per_chunk", "{:.2f}"),
                    )
                ]
            )
    n = " · ".join(label for label, _ in runs)
    head = [
        "chunks",
        "reader",
        f"CPU µs per chunk ({n})",
        "CPU over fs_native",
        "speed over fs_native",
        "context switches per chunk",
    ]
    return _md_table(head, body, align="---:", left=2)


def build_ab_writes_table(cases: list[tuple[str, str]]) -> str:
    """Runs of scripts/build_ab_probe.py --writes (a label and a file each):
    a row per run and chunk size, with each build's extents per chunk file
    and the medians (and ranges) of the pairs' ratios, this build over the
    other, of store speed, read speed and read CPU per GB."""
    runs = _labelled_runs(cases)
    body = []
    for label, d in runs:
        for c in d["cases"]:
            e, sp, rp = c["extents_per_file"], c["store_pair_ratio"], c["read_pair_ratio"]
            body.append(
                [
                    label,
                    c["chunks"].replace(" x ", " × "),
                    f"{_f(e.get('this'), '{:g}')} · {_f(e.get('other'), '{:g}')}",
                    f"{sp['median']:.3f} ({sp['min']:.2f}–{sp['max']:.2f})",
                    f"{rp['median']:.3f} ({rp['min']:.2f}–{rp['max']:.2f})",
                    f"{c['cpu_pair_ratio_median']:.3f}",
                ]
            )
    head = ["run", "chunks", "extents per file (this · other)", "store, this / other", "read after", "read CPU"]
    return _md_table(head, body, align="---:", left=2)


def split_grid_table(cases: list[tuple[str, str]]) -> str:
    """Runs of scripts/read_split_probe.py --fs-native (a label and a file
    each): a row per chunk size and point, a cell per run of GB/s, CPU s/GB
    and the median of each rep's speed over the faster fs_native's."""
    runs = _labelled_runs(cases)

    def name(p: dict) -> str:
        if "workers" in p:
            return f"fs_native, {p['workers']} workers"
        return f"fx, queue_depth {p['queue_depth']}, {p['split_bytes'] >> 20} MiB pieces, verify {'on' if p['verify'] else 'off'}"

    body = []
    for size, res in runs[0][1]["results"].items():
        for i, p in enumerate(res["points"]):
            cells = []
            for _, d in runs:
                q = d["results"][size]["points"][i]
                assert name(q) == name(p), "runs with different grids"
                cells.append(f"{q['gbps']:.2f} · {q['cpu_s_per_gb']:.3f} · {q['over_fs_native']:.2f}×")
            body.append([res["chunks"].replace(" x ", " × "), name(p)] + cells)
    head = ["chunks", "reader"] + [f"{label}: GB/s · CPU s/GB · over fs_native" for label, _ in runs]
    return _md_table(head, body, align="---:", left=2)


def positions_table(d: dict) -> str:
    """scripts/loop_position_probe.py's images: a row per offset into the
    loop device, a column per image, GB/s of 64 MiB O_DIRECT reads there
    (medians of the reps); then where each layout's files went and its GB/s."""
    ims = d["images"]
    body = [[f"{o} MiB"] + [f"{im['positions'][o]['gbps']:.2f}" for im in ims] for o in ims[0]["positions"]]
    for s in ims[0]["layouts"]["sets"]:
        body.append(
            [f"7 × 64 MiB files, {s}"]
            + [
                f"{im['layouts']['sets'][s]['gbps']:.2f} (from "
                + ", ".join(f"{b['offset_mib']}" for b in im["layouts"]["sets"][s]["first_blocks"][:3])
                + " MiB …)"
                for im in ims
            ]
        )
    body.append(
        ["second set over first (pairs' median)"] + [f"{im['layouts']['second_over_first']:.3f}×" for im in ims]
    )
    heads = [
        f"image {i + 1}" + (f", {im['pages']} pages" if "pages" in im else "") + ": GB/s" for i, im in enumerate(ims)
    ]
    return _md_table(["where"] + heads, body, align="---:")


def first_burst_table(d: dict) -> str:
    """scripts/first_burst_probe.py: per case, the pool, whether it was
    registered, what registering it took, and the first and later bursts
    (medians over the fresh processes)."""
    rows = [
        "| case | pool | registered | register ms | first burst: wall ms · p50 ms | later bursts: wall ms |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, c in d["cases"].items():
        reg = c["registered"]
        rows.append(
            f"| {name} | {c['pool_bytes'] / (1 << 20):.0f} MiB | {sum(reg)} of {len(reg)} | {c['register_ms']:.1f} "
            f"| {c['first_burst_wall_ms']:.1f} · {c['first_burst_p50_ms']:.1f} | {c['later_burst_wall_ms']:.1f} |"
        )
    return "\n".join(rows)


def image_memory_table(d: dict) -> str:
    """scripts/image_memory_probe.py: a row per 256 MiB of the image file, a
    cell per image of GB/s (median of the reps) and the share of the 64 MiB's
    4 KiB pages that lie in runs in physical memory."""
    ims = d["images"]
    first = next(iter(ims.values()))
    offs = [o for o in first if int(o) % 256 == 0]
    body = [[f"{o} MiB"] + [f"{ims[n][o]['gbps']:.1f} · {ims[n][o]['pages_in_runs']:.2f}" for n in ims] for o in offs]
    return _md_table(["where in the image"] + [f"{n}: GB/s · pages in runs" for n in ims], body, align="---:")


def lmcache_l2_table(d: dict) -> str:
    """scripts/lmcache_bench_l2.py: a row per object size, LMCache's own
    `lmcache bench l2` figures for fs_native and fx (medians of the runs,
    MB/s) and fx over fs_native run by run."""
    names = {"65536k": "14 × 64 MiB", "2048k": "64 × 2 MiB"}
    body = []
    for case, c in d["cases"].items():
        fs, fx, r = c["fs_native"], c["fx"], c["fx_over_fs_native"]
        body.append(
            [
                names.get(case, case),
                f"{fs['median_load_MBps']:.0f} / {fx['median_load_MBps']:.0f}",
                ", ".join(f"{x:.2f}" for x in r["load_MBps"]),
                f"{fs['median_store_MBps']:.0f} / {fx['median_store_MBps']:.0f}",
                ", ".join(f"{x:.2f}" for x in r["store_MBps"]),
            ]
        )
    heads = [
        "objects",
        "load MB/s fs_native / fx (medians)",
        "load fx/fs_native per run",
        "store MB/s fs_native / fx",
        "store fx/fs_native per run",
    ]
    return _md_table(heads, body, align="---:")


def medium_limit_table(d: dict) -> str:
    """scripts/medium_limit_probe.py: a row per fio setting, ordered by the
    MiB of buffers it reads into (block size x depth x jobs), GB/s (median
    of the reps) with fio's buffers in plain memory and in huge pages."""
    rows: dict = {}
    for key, v in d["points"].items():
        iomem, *fields = key.split()  # "shmhuge bs=1M qd=4 jobs=2"
        bs, qd, jobs = (f.split("=")[1] for f in fields)
        rows.setdefault((int(bs[:-1]), int(qd), int(jobs)), {})[iomem] = v["gbps"]
    body = [
        [f"{bs} MiB", str(qd), str(jobs), f"{bs * qd * jobs}"] + [f"{v[m]:.2f}" for m in ("malloc", "shmhuge")]
        for (bs, qd, jobs), v in sorted(rows.items(), key=lambda kv: (kv[0][0] * kv[0][1] * kv[0][2], kv[0]))
    ]
    heads = ["block", "iodepth", "jobs", "MiB of buffers", "GB/s, 4 KiB-page buffers", "GB/s, huge-page buffers"]
    return _md_table(heads, body, align="---:", left=1)


def staged_direct_table(cases: list[tuple[str, str]]) -> str:
    """Runs of scripts/staged_direct_probe.py (a label and a file each): a row
    per way of reading, a cell per run of GB/s, CPU s/GB and the median of
    each rep's speed over the direct checked read's."""
    runs = _labelled_runs(cases)
    body = [
        [w]
        + [
            f"{d['ways'][w]['gbps']:.2f} · {d['ways'][w]['cpu_s_per_gb']:.3f} · {d['ways'][w]['over_direct_checked']:.3f}×"
            for _, d in runs
        ]
        for w in runs[0][1]["ways"]
    ]
    return _md_table(
        ["way"] + [f"{label}: GB/s · CPU s/GB · over direct checked" for label, _ in runs], body, align="---:"
    )


def placement_table(cases: list[tuple[str, str]]) -> str:
    """Runs of scripts/placement_probe.py (a label and a file each): a row per
    reader and set of files, a cell per run of GB/s and the median of each
    rep's speed over fs_native's; then the files read alone, grouped by where
    they lie (the image's first 256 MiB or beyond) and by writer, the median
    of their GB/s and how many there were."""
    runs = _labelled_runs(cases)
    body = []
    for s in runs[0][1]["sets"]:
        body.append([s] + [f"{d['sets'][s]['gbps']:.2f} · {d['sets'][s]['over_fs_native']:.3f}×" for _, d in runs])
    groups = (
        ("fx's files in the first 256 MiB, each alone", lambda f: f["writer"] == "fx" and f["offset_mib"] < 256),
        ("fx's files beyond, each alone", lambda f: f["writer"] == "fx" and f["offset_mib"] >= 256),
        ("fs_native's files in the first 256 MiB, each alone", lambda f: f["writer"] != "fx" and f["offset_mib"] < 256),
        ("fs_native's files beyond, each alone", lambda f: f["writer"] != "fx" and f["offset_mib"] >= 256),
    )
    for name, pick in groups:
        cells = []
        for _, d in runs:
            g = [f["gbps"] for f in d["files"] if pick(f)]
            cells.append(f"{statistics.median(g):.2f} ({len(g)} files)" if g else "none")
        body.append([name] + cells)
    head = ["reader and files"] + [f"{label}: GB/s · over fs_native" for label, _ in runs]
    return _md_table(head, body, align="---:")


def probe_table(d: dict) -> str:
    """The rounds of a scripts/staged_probe.py JSON: its two sides, fs_native
    and the copy alone (GB/s, medians of the round's reps), the ratios of the
    same reps, and CPU per GB."""
    a, b = d["compare"].split(" against ")
    rows = [
        f"| chunks | round | {a} GB/s | {b} GB/s | fs_native GB/s | copy alone GB/s | {a} / {b} (pairs) "
        f"| {a} / fs_native | {a} / copy alone | fs_native / copy alone | CPU s/GB: {a} · {b} · fs_native |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in sorted(d["rounds"], key=lambda r: (-int(r["chunks"].split(" x ")[1].split()[0]), r["round"])):
        rows.append(
            f"| {r['chunks'].replace(' x ', ' × ')} | {r['round']} | {r[a + '_gbps']:.2f} | {r[b + '_gbps']:.2f} "
            f"| {r['fs_native_gbps']:.2f} | {r['copy_limit_gbps']:.2f} | {r['pair_ratio_median']:.2f}× "
            f"({r['pair_ratio_min']:.2f}–{r['pair_ratio_max']:.2f}) | {r[a + '_over_fs_native']:.2f}× "
            f"| {r[a + '_over_copy_limit']:.2f}× | {r['fs_native_over_copy_limit']:.2f}× "
            f"| {r[a + '_cpu_s_per_gb']:.3f} · {r[b + '_cpu_s_per_gb']:.3f} · {r['fs_native_cpu_s_per_gb']:.3f} |"
        )
    return "\n".join(rows)


def lookup_table(d: dict, before: str, after: str) -> str:
    """scripts/lookup_probe.py runs of two builds (label prefixes `before`
    and `after`, runs -run1, -run2, ...): µs of CPU per key of each way, each
    run's median, and after/before per run pair."""
    runs = d["runs"]
    n = sorted(int(k.rsplit("-run", 1)[1]) for k in runs if k.startswith(before + "-run"))
    ways = list(runs[f"{before}-run{n[0]}"]["ways"])
    keys = runs[f"{before}-run{n[0]}"]["keys"]
    head = [f"way, {keys} keys", f"`{before}`: µs CPU per key", f"`{after}`: µs CPU per key", f"`{after}` / `{before}`"]
    body = []
    for w in ways:
        b = [runs[f"{before}-run{i}"]["ways"][w]["us_per_key_cpu"] for i in n]
        a = [runs[f"{after}-run{i}"]["ways"][w]["us_per_key_cpu"] for i in n]
        body.append(
            [
                w,
                " · ".join(f"{x:.2f}" for x in b),
                " · ".join(f"{x:.2f}" for x in a),
                " · ".join(f"{y / x:.2f}×" for x, y in zip(b, a)),
            ]
        )
    return _md_table(head, body, align="---:")


if __name__ == "__main__":
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):  # the forms are in the docstring
        print(__doc__.strip())
        sys.exit(0)
    if sys.argv[1:2] == ["--probe"]:
        for path in sys.argv[2:]:
            with open(path) as f:
                print(probe_table(json.load(f)))
        sys.exit(0)
    if sys.argv[1:2] == ["--lookups"]:  # FILE BEFORE AFTER
        with open(sys.argv[2]) as f:
            print(lookup_table(json.load(f), sys.argv[3], sys.argv[4]))
        sys.exit(0)
    if sys.argv[1:2] == ["--latency-probe"]:  # FILE LABEL...
        with open(sys.argv[2]) as f:
            print(latency_probe_table(json.load(f), sys.argv[3:]))
        sys.exit(0)
    one_file_tables = {  # FILE
        "--positions": positions_table,
        "--medium-limit": medium_limit_table,
        "--lmcache-l2": lmcache_l2_table,
        "--image-memory": image_memory_table,
        "--first-burst": first_burst_table,
    }
    if sys.argv[1:2] and sys.argv[1] in one_file_tables:
        with open(sys.argv[2]) as f:
            print(one_file_tables[sys.argv[1]](json.load(f)))
        sys.exit(0)
    if sys.argv[1:2] == ["--ratios"]:
        print(ratios_table(sys.argv[2:]))
        sys.exit(0)
    if sys.argv[1:2] == ["--awaited-probe"]:  # FILE LABEL ...
        with open(sys.argv[2]) as f:
            print(awaited_probe_table(json.load(f), sys.argv[3:]))
        sys.exit(0)
    if sys.argv[1:2] == ["--stripe-model"]:  # FILE
        with open(sys.argv[2]) as f:
            print(stripe_model_table(json.load(f)))
        sys.exit(0)
    if sys.argv[1:2] == ["--runs"]:
        print(runs_table(sys.argv[3:], sys.argv[2]))
        sys.exit(0)
    pair_tables = {
        "--l2-stores": store_runs_table,
        "--latency-rounds": latency_rounds_table,
        "--latency-cpu": latency_cpu_table,
        "--latency-first-tenth": latency_first_tenth_table,
        "--latency-layers": latency_layers_table,
        "--latency-gil": latency_gil_table,
        "--latency-reserve": latency_reserve_table,
        "--per-chunk-runs": per_chunk_runs_table,
        "--store-check": store_check_table,
        "--chunk-overhead": chunk_overhead_table,
        "--build-ab-writes": build_ab_writes_table,
        "--split-grid": split_grid_table,
        "--placement": placement_table,
        "--staged-direct": staged_direct_table,
        "--devices-runs": devices_table,
        "--inflight-runs": inflight_table,
    }
    if sys.argv[1:2] and sys.argv[1] in pair_tables:  # LABEL FILE LABEL FILE ...
        args = sys.argv[2:]
        print(pair_tables[sys.argv[1]](list(zip(args[::2], args[1::2]))))
        sys.exit(0)
    if sys.argv[1:2] == ["--readme"]:  # LABEL FILE... LABEL FILE...
        cases: list[tuple[str, list[str]]] = []
        for a in sys.argv[2:]:
            if a.endswith(".json") and cases:
                cases[-1][1].append(a)
            else:
                cases.append((a, []))
        print(readme_tables(cases))
        sys.exit(0)
    if sys.argv[1:2] == ["--mixed-runs"]:
        groups: list[tuple[str, list[str]]] = []
        for a in sys.argv[2:]:
            if a.endswith(".json") and groups:
                groups[-1][1].append(a)
            else:
                groups.append((a.replace("MiB", " MiB"), []))
        print(mixed_runs_table(groups))
        sys.exit(0)
    for path in sys.argv[1:]:
        with open(path) as f:
            print(render(json.load(f)))
            print()
