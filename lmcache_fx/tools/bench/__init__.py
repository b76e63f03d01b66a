"""`lmcache-fx bench`: one KV-cache workload through several readers, the
same run, interleaved (A B C A B C ...), medians of the repetitions.

Readers: lmcache-fx (io_uring and thread engines), LMCache's LocalDiskBackend,
FSConnector and RustRawBlockBackend (each through a real LMCacheEngine on CPU),
LMCache's MP-mode L2 adapters fs_native and raw_block beside lmcache-fx's
FxL2Adapter (driven through the L2 adapter interface as MP mode drives them),
and fio (io_uring, O_DIRECT, same request size, queue depth and total bytes)
as the device's limit. A rep is: store, wait until the tier holds every
chunk, drop the page cache (root), read every chunk back from the tier, and
check that what landed equals what was stored (CRC32C).

    lmcache-fx bench --mkfs-loop 8G --json out.json --png out.png
    python -m lmcache_fx.tools.bench --path /mnt/nvme/bench --preset llama-3-70b-tp8

Modules: workload (geometry, workload, statistics), readers (LMCache engine
readers, fio), l2 (L2 adapter readers), run (orchestration), report (output).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from contextlib import ExitStack, contextmanager, suppress
from typing import Optional, Sequence

from ...core.options import expand_path
from ..common import unwritable
from ..models import GB, MIB, PRESETS, Geometry, parse_size
from . import readers
from .readers import lmcache_engine
from .report import format_per_chunk, format_sweep, format_table, write_png
from .run import (
    ALL_READERS,
    DEFAULT_READERS,
    READER_CLASSES,
    READER_LABELS,
    NoReader,
    machine_info,
    run_bench,
    run_per_chunk,
    run_sweep,
)
from .workload import (
    LATENCY_ROUNDS,
    LATENCY_WARMUP,
    BenchConfig,
    Skip,
    Workload,
    geometry_from_args,
    median,
    percentile,
    plan_chunks,
    ratio,
    summarize,
)

PER_CHUNK_READERS = "fx,fx-l2,fs_native,raw_block"
# How the bench's loop images are made (testing.loopfs.xfs_loop, touch=True):
# every page written before mkfs, which is told not to discard them, so no
# reader's first writes pay for the image's pages. Up to 604ffd9 the images
# were fallocated after mkfs ("images preallocated"), which left the first
# write to every page to fault it in. Since then too, the image is held in
# 2 MiB pages (its own huge=always tmpfs), as fast at every position; before,
# in /dev/shm's 4 KiB pages, files at the device's start read slower.
LOOP_IMAGE_WORDS = "image in 2 MiB pages, written through before mkfs, no discard"


def add_arguments(p: argparse.ArgumentParser, command: str = "bench") -> None:
    p.epilog = """\
examples:
  lmcache-fx bench --mkfs-loop 5G --total-gb 0.5 --reps 5 --quiet --preset llama-3.2-1b-tp4   # root: XFS on RAM
  lmcache-fx bench --path /mnt/nvme/lmcache-bench --total-gb 4 --reps 5 --json bench.json
  lmcache-fx bench --path /dev/shm/fxbench --warm --readers fx,fx-l2,fs_native --latency
methods, readers and the figures published: docs/benchmarks.md
"""
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model KV geometry per rank (default qwen2.5-32b, 64 MiB chunks; llama-3.2-1b-tp4 has 2 MiB chunks)",
    )
    g = p.add_argument_group("custom geometry (overrides the preset)")
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int, dest="kv_heads")
    g.add_argument("--head-dim", type=int, dest="head_dim")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--mla", action="store_true", help="one latent per layer (kv_size 1)")
    g.add_argument("--chunk", type=int, help="tokens per chunk (LMCache chunk_size)")
    p.add_argument("--total-gb", type=float, default=0.25, help="bytes per rep (default 0.25 GB)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per reader (default 3)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--path", help="directory on the filesystem to measure")
    where.add_argument(
        "--mkfs-loop",
        type=parse_size,
        metavar="SIZE",
        help="build XFS on a RAM-backed loop device of SIZE (root), remove it afterwards",
    )
    where.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="build N RAM-backed loop XFS filesystems sized from the workload (root), stripe fx over them, "
        "fio one job per device, single-path peers on the first device; removed afterwards",
    )
    p.add_argument(
        "--readers",
        default=",".join(DEFAULT_READERS),
        help=f"comma-separated subset of {','.join(ALL_READERS)} (default: all but fx-unmapped, fx-unstaged, fx-staged, fx-pieces, fx-l2-unstaged, fx-l2-noverify, fx-nice0, fx-unqueued and fx-op-order)",
    )
    p.add_argument("--queue-depth", type=int, default=32, help="fx queue_depth and fio iodepth")
    p.add_argument("--split-bytes", type=parse_size, default=MIB, help="fx split_bytes and fio bs")
    p.add_argument(
        "--fs-native-workers",
        type=int,
        default=8,
        help="fs_native num_workers (default 8: faster than LMCache's default 4 here, see docs/benchmarks.md)",
    )
    p.add_argument(
        "--l2-store-task-chunks",
        type=int,
        default=0,
        metavar="K",
        help="L2 adapters: submit each rep's store as tasks of K chunks, all at once, as LMCache's store "
        "controller does when several requests finish together (default 0: one task for all)",
    )
    p.add_argument("--latency", action="store_true", help="also p50/p99 at --concurrency requests in flight")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument(
        "--latency-rounds",
        type=int,
        default=LATENCY_ROUNDS,
        metavar="N",
        help=f"run each latency case N times, readers interleaved; p50, p99 and p99/p50 are medians over the "
        f"rounds (default {LATENCY_ROUNDS})",
    )
    p.add_argument(
        "--latency-warmup",
        type=int,
        default=LATENCY_WARMUP,
        metavar="N",
        help=f"before each latency round, N untimed requests (at least 4 per request in flight) on chunks of their "
        f"own, so the round times the steady state, not the host's ramp after the pause and cache drop; their "
        f"latencies are reported apart (default {LATENCY_WARMUP}; 0: none, as before)",
    )
    p.add_argument(
        "--latency-awaited",
        action="store_true",
        help="--latency through LMCache's async path: --concurrency requests in flight as coroutines on LMCache's "
        "event loop, each awaiting batched_async_contains then batched_get_non_blocking (both timed), as async loading "
        "and every remote-backend read do; the L2 adapters and fio are driven as without it",
    )
    p.add_argument(
        "--mixed",
        action="store_true",
        help="also stores while loads run (the L2 adapters): each loads its chunks while storing as many new "
        "ones, both timed, against the same reader alone",
    )
    p.add_argument(
        "--mixed-store-lead",
        type=float,
        default=0.0,
        metavar="MS",
        help="--mixed: submit the load MS milliseconds after the store (default 0: together), so that the load "
        "starts beside writes already running; the load is timed from its own submission",
    )
    p.add_argument(
        "--full-store",
        action="store_true",
        help="fx-l2's store is full, as a cache that has run a while: every chunk it stores evicts one (inside "
        "the store's timing); the other L2 adapters' chunks are deleted between reps (outside it)",
    )
    p.add_argument(
        "--per-chunk",
        type=int,
        default=0,
        metavar="N",
        help="also the cost per chunk: N chunks of 4 KiB through --per-chunk-readers, µs per chunk",
    )
    p.add_argument("--per-chunk-readers", default=PER_CHUNK_READERS)
    p.add_argument("--sweep", action="store_true", help="also sweep fx queue_depth and split_bytes")
    p.add_argument("--sweep-qd", default="1,2,4,8,16,32,64")
    p.add_argument("--sweep-split", default="128K,256K,512K,1M,2M,4M,8M")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache")
    p.add_argument("--no-verify", action="store_true", help="skip the checksum of what landed")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--png", metavar="FILE")
    p.add_argument("--quiet", action="store_true")


def _reader_list(p, s: str, flag: str = "--readers") -> list[str]:
    names = [r.strip() for r in s.split(",") if r.strip()]
    if not names:
        p.error(f"{flag}: give at least one of {', '.join(ALL_READERS)}")
    bad = [r for r in names if r not in READER_CLASSES]
    if bad:
        p.error(f"unknown reader(s) {', '.join(bad)}; choose from {', '.join(ALL_READERS)}")
    twice = sorted({r for r in names if names.count(r) > 1})
    if twice:  # two instances share one store directory: the second removed the first's under it
        p.error(f"{flag}: {', '.join(twice)} given more than once; name each reader once")
    return names


def check_args(p: argparse.ArgumentParser, args) -> list[str]:
    names = _reader_list(p, args.readers)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if not (math.isfinite(args.total_gb) and args.total_gb > 0):
        p.error(f"--total-gb must be a number of GB > 0 (got {args.total_gb})")
    if not 1 <= args.queue_depth <= 32768:
        p.error(f"--queue-depth must be in 1..32768 (got {args.queue_depth})")
    for flag, text in (("--concurrency", args.concurrency), ("--sweep-qd", getattr(args, "sweep_qd", "1"))):
        try:
            ok = all(n >= 1 for n in _ints(text)) and bool(_ints(text))
        except ValueError:
            ok = False
        if not ok:
            p.error(f"{flag} takes comma-separated whole numbers >= 1, like 1,4,16 (got {text!r})")
    # The sweep runs after every other measurement: what it would refuse is refused now.
    if any(n > 32768 for n in _ints(getattr(args, "sweep_qd", "1"))):
        p.error(f"--sweep-qd: each queue depth must be in 1..32768 (got {args.sweep_qd!r})")
    try:
        splits = _ints(getattr(args, "sweep_split", "1M"), parse_size)
    except (ValueError, argparse.ArgumentTypeError):
        splits = []
    if not splits or any(b <= 0 or b % 4096 for b in splits):
        p.error(
            f"--sweep-split takes comma-separated sizes, each a multiple of 4096, like 1M,4M (got {args.sweep_split!r})"
        )
    if args.split_bytes % 4096:
        p.error("--split-bytes must be a multiple of 4096")
    if getattr(args, "l2_store_task_chunks", 0) < 0:
        p.error("--l2-store-task-chunks must be >= 0")
    if getattr(args, "fs_native_workers", 4) < 1:
        p.error("--fs-native-workers must be >= 1")
    if getattr(args, "latency_rounds", 1) < 1:
        p.error("--latency-rounds must be >= 1")
    if getattr(args, "latency_warmup", 0) < 0:
        p.error("--latency-warmup must be >= 0 (0: no warm-up)")
    if getattr(args, "latency_awaited", False) and not args.latency:
        p.error("--latency-awaited is a way to run --latency: give both")
    if getattr(args, "per_chunk", 0) < 0:
        p.error("--per-chunk must be >= 0")
    if args.full_store and args.mixed:
        p.error("--full-store and --mixed measure different stores: run them apart")
    if args.mixed_store_lead < 0 or (args.mixed_store_lead and not args.mixed):
        p.error("--mixed-store-lead takes milliseconds >= 0, with --mixed")
    devices = getattr(args, "devices", None)
    if devices is not None and not 1 <= devices <= 64:
        p.error("--devices must be 1..64")
    if args.mkfs_loop is not None and args.mkfs_loop < XFS_MIN_BYTES:
        p.error(
            f"--mkfs-loop {args.mkfs_loop >> 20} MiB: XFS needs at least {XFS_MIN_BYTES >> 20} MiB; give 512M or more"
        )
    if args.mkfs_loop is None and args.path is None and devices is None:
        p.error("give --path DIR (a directory on the filesystem to measure), --mkfs-loop SIZE or --devices N (root)")
    if args.path is not None:
        args.path = os.path.abspath(expand_path(args.path))  # against this directory: fx takes absolute paths
        # --path itself may be new (it is made), not the directories above it: a typo is not a tree of them.
        parent = os.path.dirname(os.path.abspath(args.path))
        if os.path.exists(args.path) and not os.path.isdir(args.path):
            p.error(f"--path {args.path}: not a directory; give a directory on the filesystem to measure")
        if not os.path.isdir(parent):
            p.error(f"--path {args.path}: no such directory {parent}; create it, or give an existing directory")
    for flag, out in (("--json", args.json), ("--png", getattr(args, "png", None))):
        why = unwritable(out) if out else ""
        if why:  # said now, not after every measurement
            p.error(f"{flag} {out}: {why}")
    return names


XFS_MIN_BYTES = 300 << 20  # mkfs.xfs refuses a smaller filesystem


def _ints(s: str, conv=int) -> list:
    return [conv(x) for x in s.split(",") if x.strip()]


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MEASURED_PATHS = ("lmcache_fx", "csrc", "setup.py", "pyproject.toml")


def _git_commit(where: Optional[str] = None, paths: Sequence[str] = ()) -> Optional[str]:
    """HEAD of the checkout at `where` (this package's by default), with
    "+dirty" when tracked files differ from it (only those under `paths`,
    relative to `where`, when given: a probe that rewrites its own JSON under
    docs/ names the code it measures); None outside a checkout."""
    here = where or os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        sha = r.stdout.strip()
        if r.returncode != 0 or not sha:
            return None
        d = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", *paths],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha + ("+dirty" if d.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


@contextmanager
def _signals_as_exit():
    """While the run's filesystems and directories exist, Ctrl-C raises
    KeyboardInterrupt and SIGTERM / SIGHUP SystemExit, so the ExitStack's
    cleanup (stores removed; loop devices unmounted, detached, their images
    removed) runs whichever way the run ends. Before, only --devices had
    this: a SIGTERM (`timeout`, a closed terminal's SIGHUP) in a --mkfs-loop
    run left the loop device, its mount and 512 MiB of RAM behind."""
    import signal

    from ..common import signal_handlers

    def bye(signum, _frame):
        # One is enough: a second one arriving while the first's cleanup runs cut it short (an empty
        # mount point left; by reading, a loop device). Until the cleanup is done they are ignored (all
        # three: one not taken was ignored already; and this runs before the with below has bound anything).
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        if signum == signal.SIGINT:  # also when started with SIGINT ignored (a background job)
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # A SIGTERM or SIGHUP the run was started with ignored (nohup) stays ignored
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    with signal_handlers(bye, signals, keep_ignored=signals[1:]):
        yield


def _sizing_config(args, geo, n_chunks: int) -> BenchConfig:
    """The run's workload as far as sizing its RAM-backed images and the
    memory it takes needs it (--devices, --mkfs-loop)."""
    return BenchConfig(
        path="",
        geo=geo,
        n_chunks=n_chunks,
        reps=args.reps,
        latency=args.latency,
        concurrency=tuple(_ints(args.concurrency)),
    )


def build_devices(parser, args, stack: ExitStack, geo, n_chunks: int, names: list, per_chunk_names: list):
    """--devices N: N RAM-backed loop XFS filesystems sized from the
    workload, refused when the host's memory would not hold the run; each is
    unmounted, detached and its image removed when `stack` closes (error and
    Ctrl-C included). Returns (first mount, description, all mounts)."""
    from ...testing.loopfs import why_not_available, xfs_loop
    from .run import check_memory, plan_devices

    n = args.devices
    why = why_not_available()
    if why:
        parser.error(f"--devices: {why}")
    probe = _sizing_config(args, geo, n_chunks)
    readers_all = list(dict.fromkeys(names + per_chunk_names))
    sizes = plan_devices(probe, readers_all, n)
    too_big = check_memory(probe, readers_all, sizes)
    if too_big:
        parser.error(f"--devices {n}: {too_big}")
    mounts = []
    for i, size in enumerate(sizes):
        if not args.quiet:
            sys.stderr.write(f"bench: device {i + 1}/{n}: XFS on a {size / (1 << 30):.2f} GiB RAM-backed loop device\n")
        mounts.append(stack.enter_context(xfs_loop(size, touch=True)))
    fs = (
        f"{n} x XFS on RAM-backed loop devices ({', '.join(f'{s / (1 << 30):.2f}' for s in sizes)} GiB, "
        f"{LOOP_IMAGE_WORDS}); fx striped over all, single-path peers on the first"
    )
    return mounts[0], fs, tuple(mounts)


def run(args, parser: Optional[argparse.ArgumentParser] = None) -> int:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache would post usage reports otherwise
    # LMCache's INFO lines would bury the table; set here, not at import, so
    # importing this module changes nothing for other code in the process.
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    import logging

    parser = parser or build_parser()
    names = check_args(parser, args)
    per_chunk_names = _reader_list(parser, args.per_chunk_readers) if args.per_chunk else []
    geo = geometry_from_args(args)
    n_chunks = plan_chunks(geo, int(args.total_gb * GB))
    devices = getattr(args, "devices", None)
    # Imported before the handlers below turn SIGTERM into SystemExit: one raised inside torch's or
    # LMCache's import left it half made, and the cleanup's next import of it failed with a traceback.
    import torch  # noqa: F401

    with suppress(Exception):
        import lmcache.v1.cache_engine  # noqa: F401
    with ExitStack() as stack:
        stack.enter_context(_signals_as_exit())
        stripe: tuple = ()
        if devices:
            base, fs, stripe = build_devices(parser, args, stack, geo, n_chunks, names, per_chunk_names)
        elif args.mkfs_loop:
            from ...testing.loopfs import why_not_available, xfs_loop

            why = why_not_available()
            if why:
                parser.error(f"--mkfs-loop: {why}")
            from .run import check_memory

            readers_all = list(dict.fromkeys(names + per_chunk_names))
            too_big = check_memory(_sizing_config(args, geo, n_chunks), readers_all, [args.mkfs_loop], "--mkfs-loop")
            if too_big:  # its image lies in RAM: past the host's memory, the OOM killer picks who goes
                parser.error(f"--mkfs-loop {args.mkfs_loop >> 20} MiB: {too_big}")
            if not args.quiet:
                sys.stderr.write(f"bench: writing the {args.mkfs_loop / (1 << 30):.1f} GiB loop image through\n")
            base = stack.enter_context(xfs_loop(args.mkfs_loop, touch=True))
            fs = f"XFS on a {args.mkfs_loop / (1 << 30):.1f} GiB RAM-backed loop device ({LOOP_IMAGE_WORDS})"
        else:
            base, fs = args.path, None
        loop_images = None
        if fs:
            from ...testing.loopfs import image_pages

            # what each image got: in 4 KiB pages (the kernel refused huge ones) the medium is not even
            loop_images = [image_pages(m) for m in (stripe or (base,))]
        path = os.path.join(base, f"lmcache-fx-bench-{os.getpid()}")
        if not os.path.exists(base):  # --path made here (its parent exists): removed after, when left empty
            stack.callback(_rmdir_if_empty, base)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # a read-only or full filesystem, a directory of another user's
            parser.error(f"--path {base}: cannot make a directory there: {e.strerror}")
        stack.callback(shutil.rmtree, path, True)
        if stripe:
            stripe = tuple(os.path.join(m, f"lmcache-fx-bench-{os.getpid()}") for m in stripe)
            for d in stripe[1:]:
                os.makedirs(d, exist_ok=True)
                stack.callback(shutil.rmtree, d, True)
        if not args.quiet:
            sys.stderr.write(f"bench: {n_chunks} chunks of {geo.chunk_bytes / MIB:.2f} MiB under {path}\n")
        logging.getLogger("lmcache").setLevel(logging.WARNING)
        cfg = BenchConfig(
            path=path,
            geo=geo,
            n_chunks=n_chunks,
            reps=args.reps,
            queue_depth=args.queue_depth,
            split_bytes=args.split_bytes,
            cold=not args.warm,
            verify=not args.no_verify,
            latency=args.latency,
            concurrency=tuple(_ints(args.concurrency)),
            latency_rounds=args.latency_rounds,
            latency_awaited=args.latency_awaited,
            latency_warmup=args.latency_warmup,
            mixed=args.mixed,
            mixed_store_lead_ms=args.mixed_store_lead,
            full_store=args.full_store,
            fs_native_workers=args.fs_native_workers,
            l2_store_task_chunks=args.l2_store_task_chunks,
            stripe=stripe,
        )
        # The code measured, read before the run (a checkout that moves during a run must not be recorded
        # as the one measured): a change to docs/ alone (or a lease that leaves docs/bench-repeats behind
        # to fit its size limit) is not "+dirty".
        measured = _git_commit(CHECKOUT, MEASURED_PATHS)
        try:
            results = run_bench(cfg, names, quiet=args.quiet)
        except NoReader as e:
            parser.error(str(e))
        if stripe:
            results["devices_note"] = (
                f"{len(stripe)} devices: fx readers stripe over all of them (their path list), fio runs one job "
                "per device (aggregate), single-path peers run on the first device only, as they would be "
                "deployed (fs_native's base_path is one directory: a comma list is taken as one literal path)"
            )
        if fs:
            results["machine"]["filesystem"] = fs
        if loop_images:
            results["machine"]["loop_images"] = loop_images
        results["command"] = "lmcache-fx bench " + " ".join(
            sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
        )
        results["git_commit"] = measured
        if measured != _git_commit(CHECKOUT, MEASURED_PATHS):
            results["git_commit_changed"] = "the checkout changed during the run"
        if per_chunk_names:
            results["per_chunk"] = run_per_chunk(cfg, per_chunk_names, args.per_chunk, quiet=args.quiet)
        if args.sweep:
            results["sweep"] = run_sweep(
                path,
                geo,
                n_chunks,
                args.reps,
                _ints(args.sweep_qd),
                _ints(args.sweep_split, parse_size),
                results["cold"],
                args.quiet,
            )
    print(format_table(results))
    if "per_chunk" in results:
        print(format_per_chunk(results["per_chunk"]))
    if "sweep" in results:
        print(format_sweep(results["sweep"]))
    if args.json:
        why = _write_json(args.json, results)
        if why:
            sys.stderr.write(f"bench: --json {args.json}: not written: {why}\n")
            return 1
    if args.png:
        why = write_png(results, args.png)
        if why:
            sys.stderr.write(f"no chart: {why}\n")
    bad = [n for n, e in results["readers"].items() if e.get("available") and not e.get("all_ok")]
    if bad:
        sys.stderr.write(f"bench: readers with failed or unverified reps: {', '.join(bad)}\n")
        for n in bad:
            why = _first_error(results["readers"][n])
            if why:
                sys.stderr.write(f"  {n}: {why}\n")
        return 1
    return 0


def _first_error(entry: dict) -> str:
    """The first error a reader's reps recorded (the JSON keeps them all), as one line."""
    for rep in entry.get("reps") or ():
        err = rep.get("error") if isinstance(rep, dict) else None
        if err:
            return str(err).strip().splitlines()[0][:300]
    err = entry.get("error")
    if not err and entry.get("latency_failed"):
        conc, why = next(iter(entry["latency_failed"].items()))
        err = f"latency with {conc} in flight: {why}"
    return str(err).strip().splitlines()[0][:300] if err else ""


def _write_json(path: str, results: dict) -> str:
    """The results to `path`, a regular file through a temporary beside it:
    a full disk neither loses them to a traceback nor truncates the file
    there. Anything else (a pipe, /dev/stdout, a device) is written in place:
    renamed over, it would be replaced by a file. "" or why not."""
    in_place = os.path.exists(path) and not os.path.isfile(path)
    target = path if in_place else f"{path}.tmp.{os.getpid()}"
    try:
        with open(target, "w") as f:
            json.dump(results, f, indent=1)
        if not in_place:
            os.replace(target, path)
    except OSError as e:
        if not in_place:
            with suppress(OSError):
                os.unlink(target)
        return e.strerror or str(e)
    return ""


def _rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache-fx bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def main(argv=None) -> int:
    """`python -m lmcache_fx.tools.bench` is `lmcache-fx bench`."""
    from ..cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


__all__ = [
    "add_arguments",
    "run",
    "main",
    "build_parser",
    "check_args",
    "run_bench",
    "run_sweep",
    "run_per_chunk",
    "format_table",
    "format_sweep",
    "format_per_chunk",
    "write_png",
    "BenchConfig",
    "Workload",
    "Skip",
    "Geometry",
    "PRESETS",
    "ALL_READERS",
    "READER_CLASSES",
    "READER_LABELS",
    "geometry_from_args",
    "plan_chunks",
    "median",
    "ratio",
    "percentile",
    "summarize",
    "parse_size",
    "machine_info",
    "lmcache_engine",
    "readers",
]
