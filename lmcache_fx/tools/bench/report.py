"""Output: the text table (medians, ratios), the latency table, the sweep
line, and the PNG chart."""

from __future__ import annotations

from typing import Optional

from ..models import GB, MIB

# ------------------------------------------------------------------ output


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def format_table(results: dict) -> str:
    rows = [
        ("reader", "tier GB/s", "retrieve GB/s", "store GB/s", "tier CPU s/GB", "retrieve CPU s/GB", "vs fio", "ok")
    ]
    for _name, e in results["readers"].items():
        if not e.get("available"):
            rows.append((e["label"], "skipped: " + e.get("skip_reason", "")[:70], "", "", "", "", "", ""))
            continue
        m = e["median"]
        rows.append(
            (
                e["label"],
                _f(m["tier_read_gbps"]),
                _f(m["retrieve_gbps"]),
                _f(m["store_gbps"]),
                _f(m["tier_cpu_s_per_gb"], "{:.3f}"),
                _f(m["cpu_s_per_gb"], "{:.3f}"),
                _f(e.get("ratio_to_fio"), "{:.2f}x"),
                "yes" if e.get("all_ok") else "NO",
            )
        )
    widths = [max(len(r[i]) for r in rows if not r[1].startswith("skipped") or i == 0) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        if r[1].startswith("skipped"):
            lines.append(f"{r[0].ljust(widths[0])}  {r[1]}")
        else:
            lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
    lines.insert(1, "-" * len(lines[0]))
    c = results["config"]
    head = (
        f"{'COLD' if results['cold'] else 'WARM'}: {results['cache_note']}\n"
        f"{c['n_chunks']} chunks x {c['chunk_bytes'] / MIB:.2f} MiB = {c['total_bytes'] / GB:.2f} GB, "
        f"medians of {c['reps']} reps, queue_depth {c['queue_depth']}, split {c['split_bytes'] // 1024} KiB"
    )
    out = head + "\n" + "\n".join(lines)
    bp = results.get("best_peer") or {}
    fxs = [(e["label"], e["ratio_to_best_peer"]) for e in results["readers"].values() if e.get("ratio_to_best_peer")]
    if fxs and bp:

        def who(m):
            b = bp.get(m)
            return f"{results['readers'][b['reader']]['label']} {b['value']:.3g}" if b else "-"

        out += (
            f"\n\nfx / best peer (tier read: {who('tier_read_gbps')} GB/s; store: {who('store_gbps')} GB/s; "
            f"tier CPU: {who('tier_cpu_s_per_gb')} s/GB)\n"
        )
        lw = max([36] + [len(label) + 2 for label, _ in fxs])
        out += "reader".ljust(lw) + f"{'tier read':>12}{'store':>12}{'store, same level':>19}{'tier CPU':>12}\n"
        for label, r in fxs:
            out += (
                label.ljust(lw)
                + "".join(
                    _f(r.get(k), "{:.2f}x").rjust(w)
                    for k, w in (("tier_read", 12), ("store", 12), ("store_same_level", 19), ("tier_cpu", 12))
                )
                + "\n"
            )
        out += (
            "(store, same level: against the best store through LMCache's engine for fx's plugins, through the "
            "L2 interface for fx-l2; an engine-level store includes LMCache's own copy into its pool)\n"
        )
    nd = len(c.get("devices") or [])
    if nd > 1:
        fio = results["readers"].get("fio", {})
        out += f"\n\n{results.get('devices_note', f'{nd} devices')}\n"
        for e in results["readers"].values():
            if e.get("available") and e.get("devices", 1) > 1 and e is not fio:
                out += f"{e['label']} / fio aggregate, tier read: {_f(e.get('ratio_to_fio'), '{:.2f}x')}\n"
    mixed = [(e["label"], e["mixed"]) for e in results["readers"].values() if e.get("mixed")]
    if mixed:
        out += "\n\nstores while loads run (a store of as many new chunks submitted with the load), medians\n"
        out += "reader".ljust(36) + f"{'load GB/s':>11}{'vs alone':>10}{'store GB/s':>12}{'vs alone':>10}\n"
        for label, m in mixed:
            out += (
                label.ljust(36)
                + _f(m.get("load_gbps"), "{:.2f}").rjust(11)
                + _f(m.get("load_vs_alone"), "{:.2f}x").rjust(10)
                + _f(m.get("store_gbps"), "{:.2f}").rjust(12)
                + _f(m.get("store_vs_alone"), "{:.2f}x").rjust(10)
                + "\n"
            )
    lat = [(e["label"], e["latency"]) for e in results["readers"].values() if e.get("latency")]
    if lat:
        concs = sorted({int(k) for _, L in lat for k in L})
        out += "\n\nlatency per request, p50 / p99 ms (p99/p50), medians over the rounds, by concurrent requests\n"
        if results.get("config", {}).get("latency_awaited"):
            out += "(LMCache tiers awaited on LMCache's event loop: batched_get_non_blocking; L2 adapters and fio as ever)\n"
        out += "reader".ljust(30) + "".join(f"{c:>26}" for c in concs) + "\n"
        for label, L in lat:
            cells = []
            for cc in concs:
                v = L.get(str(cc)) or {}
                cell = f"{_f(v.get('p50_ms'), '{:.1f}')} / {_f(v.get('p99_ms'), '{:.1f}')}"
                if v.get("p99_over_p50") is not None:
                    cell += f" ({v['p99_over_p50']:.2f}x)"
                cells.append(cell.rjust(26))
            out += label.ljust(30) + "".join(cells) + "\n"
        out += _latency_cpu_table(lat, concs)
    return out


def _latency_cpu_table(lat: list, concs: list) -> str:
    """The latency cases' CPU per request (medians over the rounds): the
    process's, LMCache's loop thread's (awaited), the host's busy time, and
    the host's stolen share; empty when no case measured them."""
    if not any(v.get("process_cpu_us_per_request") is not None for _, L in lat for v in L.values()):
        return ""
    out = "\nCPU per request in those cases, us: process / loop thread (awaited) / host busy; host steal share\n"
    out += "reader".ljust(30) + "".join(f"{c:>26}" for c in concs) + "\n"
    for label, L in lat:
        cells = []
        for cc in concs:
            v = L.get(str(cc)) or {}
            cell = "/".join(
                _f(v.get(k), "{:.0f}")
                for k in ("process_cpu_us_per_request", "loop_cpu_us_per_request", "host_busy_us_per_request")
            )
            steal = v.get("host_steal_share")
            cell += f"; {_f(steal * 100 if steal is not None else None, '{:.1f}')}%"
            cells.append(cell.rjust(26))
        out += label.ljust(30) + "".join(cells) + "\n"
    return out


def write_png(results: dict, path: str) -> Optional[str]:
    """Grouped bars per reader (tier read, engine retrieve, store GB/s), fio's
    cold read drawn across. Returns None, or why no chart was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"matplotlib not available ({e}); pip install matplotlib"
    names = [n for n, e in results["readers"].items() if e.get("available") and n != "fio"]
    labels = [results["readers"][n]["label"].replace("LMCache ", "LMCache\n").replace(" (", "\n(") for n in names]
    series = [
        ("tier_read_gbps", "cold tier read" if results["cold"] else "warm tier read"),
        ("retrieve_gbps", "engine retrieve"),
        ("store_gbps", "store"),
    ]
    fig, ax = plt.subplots(figsize=(max(10, 1.3 * len(names)), 5))
    width = 0.26
    for i, (m, lab) in enumerate(series):
        raw = [results["readers"][n]["median"][m] for n in names]
        bars = ax.bar([x + (i - 1) * width for x in range(len(names))], [v or 0 for v in raw], width, label=lab)
        ax.bar_label(bars, labels=["" if v is None else f"{v:.2f}" for v in raw], fontsize=7)  # no figure: no label
    fio = results["readers"].get("fio", {})
    if fio.get("available") and fio["median"]["tier_read_gbps"]:
        v = fio["median"]["tier_read_gbps"]
        ax.axhline(v, color="black", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, v, f" fio read {v:.2f} GB/s", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel("GB/s (median)")
    c = results["config"]
    ax.set_title(
        f"{'cold' if results['cold'] else 'WARM (page cache not dropped)'}: "
        f"{c['n_chunks']} x {c['chunk_bytes'] / MIB:.2f} MiB chunks, {results['machine'].get('filesystem', '')}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def format_sweep(s: dict) -> str:
    out = [
        f"\nfx tuning (store level, {s['n_chunks']} x {s['chunk_bytes'] / MIB:.2f} MiB, "
        f"{'cold' if s['cold'] else 'warm'})"
    ]
    out.append(
        "queue_depth (split 1 MiB): "
        + ", ".join(
            f"{p['value']}: {_f(p['gbps'])} GB/s {_f(p['cpu_s_per_gb'], '{:.3f}')} CPU-s/GB" for p in s["queue_depth"]
        )
    )
    out.append(
        "split_bytes (queue_depth 32): "
        + ", ".join(
            f"{p['value'] // 1024}K: {_f(p['gbps'])} GB/s {_f(p['cpu_s_per_gb'], '{:.3f}')} CPU-s/GB"
            for p in s["split_bytes"]
        )
    )
    return "\n".join(out)


def format_per_chunk(pc: dict) -> str:
    out = [
        f"\ncost per chunk: {pc['n_chunks']} chunks of {pc['chunk_bytes'] // 1024} KiB, "
        f"{'cold' if pc['cold'] else 'warm'}, medians of {pc['reps']}",
        "reader".ljust(36) + f"{'read us/chunk':>15}{'read CPU us/chunk':>19}{'store us/chunk':>16}",
    ]
    for e in pc["readers"].values():
        if not e.get("available"):
            out.append(e["label"].ljust(36) + "skipped: " + str(e.get("skip_reason"))[:70])
            continue
        out.append(
            e["label"].ljust(36)
            + _f(e["tier_us_per_chunk"], "{:.1f}").rjust(15)
            + _f(e["tier_cpu_us_per_chunk"], "{:.1f}").rjust(19)
            + _f(e["store_us_per_chunk"], "{:.1f}").rjust(16)
        )
    return "\n".join(out)
