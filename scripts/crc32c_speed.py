#!/usr/bin/env python3
"""Speed of the extension's CRC32C: GB/s and CPU ns/byte at 4 KiB, 64 KiB,
1 MiB (in this core's cache), 8 MiB (in a shared L3, where there is one that
large) and 64 MiB (memory) buffers, medians of 5 samples, for every
implementation this CPU runs (_fxio.crc32c_impls(), the one in use first).

    .venv/bin/python scripts/crc32c_speed.py
    .venv/bin/python scripts/crc32c_speed.py --compare HEAD   # before/after

The extension is timed through _fxio.crc32c_at on a page-aligned buffer; a
Python call costs a fraction of a microsecond, which shows at 4 KiB, so the
"net" columns subtract the time of a zero-length call.  --compare REV also
builds csrc/crc32c.c as of git revision REV and as in the working tree into
two small shared libraries (the extension's compiler flags) and times both
the same way through ctypes, for a like-for-like before/after.
"""

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lmcache_fx import _fxio as fx  # noqa: E402

SIZES = [("4 KiB", 4 << 10), ("64 KiB", 64 << 10), ("1 MiB", 1 << 20), ("8 MiB", 8 << 20), ("64 MiB", 64 << 20)]
CFLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall", "-Wextra"]


def measure(fn, addr, n, samples=5, sample_s=0.15):
    """Median over samples of (wall s/call, CPU s/call) for fn(addr, n)."""
    fn(addr, n)  # warm: page faults, first-call set-up
    reps = 1
    while True:  # calibrate reps so that a sample lasts about sample_s
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(addr, n)
        dt = time.perf_counter() - t0
        if dt >= sample_s / 4 or reps >= 1 << 22:
            break
        reps *= 2
    reps = max(1, int(reps * sample_s / max(dt, 1e-9)))
    wall, cpu = [], []
    for _ in range(samples):
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(reps):
            fn(addr, n)
        wall.append((time.perf_counter() - t0) / reps)
        cpu.append((time.thread_time() - c0) / reps)
    return statistics.median(wall), statistics.median(cpu)


def table(rows, fns, addr):
    """rows: label per fn; prints one line per fn and size."""
    width = max(len(r) for r in rows)
    print(f"{'':{width}} {'size':>7} {'GB/s':>7} {'CPU ns/B':>9} {'net GB/s':>9} {'net ns/B':>9}")
    out = []
    for label, fn in zip(rows, fns):
        w0, c0 = measure(fn, addr, 0)
        for name, n in SIZES:
            w, c = measure(fn, addr, n)
            nw, nc = max(w - w0, 1e-12), max(c - c0, 1e-12)
            print(
                f"{label:{width}} {name:>7} {n / w / 1e9:7.2f} {c / n * 1e9:9.4f} "
                f"{n / nw / 1e9:9.2f} {nc / n * 1e9:9.4f}"
            )
            out.append(
                {
                    "impl": label or out[-1]["impl"],
                    "size": name,
                    "bytes": n,
                    "gbps": n / w / 1e9,
                    "cpu_ns_per_byte": c / n * 1e9,
                    "net_gbps": n / nw / 1e9,
                }
            )
            label = ""
    return out


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line and line.split(":")[0].strip())
        return {k.strip(): info[k].strip() for k in info if k.strip() in ("model name", "cpu family", "model")}
    except OSError:
        return None


def build_so(source_text, out_dir, name):
    src = os.path.join(out_dir, name + ".c")
    so = os.path.join(out_dir, name + ".so")
    with open(src, "w") as f:
        f.write(source_text)
    subprocess.run(["gcc", *CFLAGS, "-I", os.path.join(ROOT, "csrc"), src, "-o", so, "-lpthread"], check=True)
    lib = ctypes.CDLL(so)
    lib.fx_crc32c.restype = ctypes.c_uint32
    lib.fx_crc32c.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    lib.fx_crc32c_impl.restype = ctypes.c_char_p
    return lib


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", metavar="REV", help="also time csrc/crc32c.c at git REV vs the working tree")
    ap.add_argument("--json", metavar="FILE", help="also write the extension's figures, command and commit here")
    args = ap.parse_args()

    size = max(n for _, n in SIZES)
    buf = fx.HostBuffer(size)
    mv = memoryview(buf)
    pattern = os.urandom(1 << 20)
    for off in range(0, size, len(pattern)):
        mv[off : off + len(pattern)] = pattern
    addr = buf.address

    print(f"CRC32C implementation in use: {fx.CRC32C_IMPL}")
    print("medians of 5; CPU = this thread's CPU time; net = minus a zero-length call\n")
    at = fx.crc32c_at
    impls = fx.crc32c_impls()
    rows = table(
        [f"extension ({i}{', in use' if i == fx.CRC32C_IMPL else ''})" for i in impls],
        [lambda a, n, i=i: at(a, n, 0, i) for i in impls],
        addr,
    )
    if args.json:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": "python " + " ".join(["scripts/crc32c_speed.py", *sys.argv[1:]]),
                    "git_commit": commit.strip() or None,
                    "cpus": os.cpu_count(),
                    "implementation": fx.CRC32C_IMPL,
                    "implementations": impls,
                    "cpu": _cpu_model(),
                    "note": "medians of 5; 1 MiB fits a core's L2, 8 MiB a shared L3 (32 MiB here), "
                    "64 MiB neither: memory-bound",
                    "rows": rows,
                },
                f,
                indent=1,
            )

    if args.compare:
        old = subprocess.run(
            ["git", "-C", ROOT, "show", f"{args.compare}:csrc/crc32c.c"], check=True, capture_output=True, text=True
        ).stdout
        with open(os.path.join(ROOT, "csrc", "crc32c.c")) as f:
            new = f.read()
        with tempfile.TemporaryDirectory() as d:
            libs = [build_so(old, d, "crc_old"), build_so(new, d, "crc_new")]
            labels = [
                f"{args.compare} ({libs[0].fx_crc32c_impl().decode()})",
                f"worktree ({libs[1].fx_crc32c_impl().decode()})",
            ]
            print(f"\nctypes, csrc/crc32c.c at {args.compare} vs the working tree:")
            table(labels, [lambda a, n, f=lib.fx_crc32c: f(0, a, n) for lib in libs], addr)
    mv.release()


if __name__ == "__main__":
    main()
