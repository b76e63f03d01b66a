"""`lmcache-fx ls | stat | fsck | gc`: look into a store, verify it, shrink it,
without the server and without reading code.

They read the store through the real pieces: file names and temporaries as
ChunkStore lays them out, headers with chunkfile.decode_header, payloads with
the C engine (io_uring, O_DIRECT where the filesystem allows, CRC32C computed
as the data lands). They are safe beside a running server: a chunk that
vanishes or is replaced while they look is skipped, and nothing is removed
unless asked (fsck --repair, gc). Removals go as the store's own do: under
the store lock (waiting at most LOCK_TIMEOUT), relative to the directory
listed (opened without following links, and still the one listed), each file
only while it is the one judged (its inode; a temporary only while still
stale by a fresh stat), and gc's bytes taken off the shared ledger (fsck
--repair's are left for the store to recount: see _remove).
"""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import json
import math
import os
import re
import stat as stat_mod
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from ..core import ledger as ledger_mod
from ..core.chunkfile import Header
from ..core.layout import (
    LOCK_DIR,
    LOCK_NAME,
    STALE_TMP_SECONDS,
    StoreFile,
    aliased_root,
    is_fanout_name,
    on_read_only_fs,
    open_dir,
    paths_for,
    scan_fanout,
    tmp_is_stale,
    tmp_judged_by_age,
)
from ..core.ledger import Ledger, LockTimeout
from ..core.options import GIB, ConfigError, auth_key_bytes, expand_path
from .common import (
    AdminError,
    fs_info,
    human_age,
    human_bytes,
    interrupt_code,
    printable,
    quiet_broken_pipe,
    signals_as_interrupt,
)
from .lmcache_config import load_plugin_configs
from .verify import OTHER_VERSION, ChunkVerifier

# ---------------------------------------------------------------- help texts

EXAMPLES = {
    "ls": """\
One line per chunk, least recently written first (the next to be evicted):
age, file size, model, geometry, LMCache key.

examples:
  lmcache-fx ls /mnt/nvme/lmcache
  lmcache-fx ls /mnt/nvme0/fx,/mnt/nvme1/fx --model Qwen/Qwen3-8B --sort size
  lmcache-fx ls --config lmcache.yaml --json | jq '.chunks[].key'
""",
    "stat": """\
Summary of a store: chunks, bytes, models, geometries, an age histogram,
usage against max_capacity_gb (from --config or --capacity-gb), free space.
Reads every header (4 KiB per chunk), not the payloads: use fsck for that.

examples:
  lmcache-fx stat /mnt/nvme/lmcache
  lmcache-fx stat --config lmcache.yaml
  lmcache-fx stat /mnt/nvme/lmcache --capacity-gb 2000 --json
""",
    "fsck": """\
Verifies every chunk: header checksum, format version, the key against the
file name, the payload length and the payload CRC32C (with --config naming a
store with auth_key, its MAC too, as the store checks it), reading with the C
engine (io_uring, O_DIRECT where allowed, two batches in flight). Also
reports temporaries of dead writers, files that do not belong, fan-out
directories that cannot be listed (UNREADABLE) or that are a link or a file
(FANOUT: the store cannot write there; remove it).
--repair removes bad chunks and stale temporaries under the store lock
(never files of another format version, foreign files, temporaries of live
writers, or files that could not be opened or read: those are reported as
UNREADABLE). Their bytes stay in the store's shared usage until a running
store next recounts (it may have never counted them): an overcount, never
an undercount.

exit status: 0 clean; 1 problems found and all repaired; 4 problems left
(unreadable files and directories, FANOUT included); 2 usage error or
unreadable path.

examples:
  lmcache-fx fsck /mnt/nvme/lmcache
  lmcache-fx fsck /mnt/nvme/lmcache --repair
  lmcache-fx fsck --config lmcache.yaml --json > fsck.json
""",
    "gc": """\
Removes least recently written chunks until the chunk files take at most
--to-gb GiB (the order the store itself evicts in after a restart). Safe
beside a running server: removals take the store lock, a chunk read since
the listing is kept, and the bytes removed come off the shared usage count
at once; a removed chunk is a miss there.

exit status: 0 at most --to-gb left; 1 not reached, or a file not removed,
or a fan-out directory that could not be listed (its chunks unseen);
2 usage error or unreadable path.

examples:
  lmcache-fx gc /mnt/nvme/lmcache --to-gb 1500
  lmcache-fx gc /mnt/nvme/lmcache --to-gb 0.5 --dry-run
  lmcache-fx gc --config lmcache.yaml --to-gb 100 --json
""",
}


# ---------------------------------------------------------------- the store on disk


@dataclass
class Scan:
    roots: list[str]
    chunks: list[StoreFile] = field(default_factory=list)
    temps: list[StoreFile] = field(default_factory=list)
    others: list[StoreFile] = field(default_factory=list)
    looks_like_store: dict = field(default_factory=dict)  # root -> bool
    dirs: dict = field(default_factory=dict)  # directory listed -> its (st_dev, st_ino) then
    # Fan-out directories that could not be listed (what they hold is unseen),
    # and fan-out names that are a link or a file (the store cannot write there).
    unlisted: list[StoreFile] = field(default_factory=list)
    blocked: list[StoreFile] = field(default_factory=list)


# The names the store gives its temporaries (core/layout.py, store._tmp_name,
# layout.probe_odirect): <digest>.fxkv.tmp.<pid>.<n>[.<host tag>[.<seat tag>]]
# in the digest's fan-out directory, and .tmp.odirect.<pid>[.<host tag>[.<seat
# tag>]] at a root. A name with TMP_MARK in it that is neither is not the
# store's: reported as foreign, never removed.
_FANOUT_TMP = re.compile(r"([0-9a-f]{32})\.fxkv\.tmp\.[0-9]+\.(?:spare)?[0-9]+(\.[0-9a-f]{8}){0,2}")  # or a spare
_ROOT_TMP = re.compile(r"\.tmp\.odirect\.[0-9]+(\.[0-9a-f]{8}){0,2}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def check_root(root: str, origin: str = "") -> str:
    """The absolute root, or AdminError saying what is wrong with it;
    `origin`: where the path came from (a config's key), said with it."""
    p = os.path.abspath(expand_path(root))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        parent = os.path.dirname(p)
        hint = "" if os.path.isdir(parent) else f" (nor does {parent})"
        fix = (
            f"it is {origin}: no store has been made there yet, or the config is not the one the server reads"
            if origin
            else "give the store's path (the plugin's path option)"
        )
        raise AdminError(f"{p}: no such directory{hint}; {fix}") from None
    except PermissionError:
        raise AdminError(f"{p}: permission denied; run as the store's owner or root") from None
    if not stat_mod.S_ISDIR(st.st_mode):
        raise AdminError(f"{p}: not a directory; give the store directory, not a chunk file")
    if not os.access(p, os.R_OK | os.X_OK):
        raise AdminError(f"{p}: cannot list it (permission denied); run as the store's owner or root")
    return p


def split_paths(values: Iterable[str]) -> list[str]:
    out = []
    for v in values:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def scan(roots: list[str]) -> Scan:
    """Lists a store the way the store's own scan sees it (core/layout.py),
    keeping what it skips. Every directory is listed through a descriptor
    (fan-out directories opened without following links) whose identity is
    kept in Scan.dirs, for removals to check they act in the same one."""
    sc = Scan(roots)
    lists = {"chunk": sc.chunks, "tmp": sc.temps, "other": sc.others}
    for root in roots:
        looks = False
        try:
            rfd = os.open(root, _DIR_FLAGS)
        except OSError as e:
            raise AdminError(f"{root}: cannot list it: {e.strerror}") from None
        try:
            st = os.fstat(rfd)
            sc.dirs[root] = (st.st_dev, st.st_ino)
            try:
                with os.scandir(rfd) as top:
                    entries = list(top)
            except OSError as e:
                raise AdminError(f"{root}: cannot list it: {e.strerror}") from None
            for de in entries:
                name = de.name
                path = os.path.join(root, name)
                if is_fanout_name(name) and not de.is_dir(follow_symlinks=False):
                    sc.blocked.append(StoreFile(path, root, 0, 0, 0, 0, "other", why=_blocked_why(de)))
                    continue
                if is_fanout_name(name):
                    looks = True
                    try:
                        dfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=rfd)
                    except OSError as e:
                        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped since the listing
                            sc.blocked.append(StoreFile(path, root, 0, 0, 0, 0, "other", why=_blocked_why(de)))
                        else:
                            sc.unlisted.append(_unlisted(path, root, e))
                        continue
                    try:
                        dst = os.fstat(dfd)
                        sc.dirs[path] = (dst.st_dev, dst.st_ino)
                        for f in scan_fanout(root, path, dfd):
                            if f.kind == "tmp" and not _is_store_tmp(f):
                                f.kind, f.why = (
                                    "other",
                                    "not an lmcache-fx file (the store makes no temporary of this name)",
                                )
                            lists[f.kind].append(f)
                    except OSError as e:
                        sc.unlisted.append(_unlisted(path, root, e))
                    finally:
                        os.close(dfd)
                elif name == LOCK_DIR and de.is_dir(follow_symlinks=False):  # the shared-capacity lock
                    looks = True
                elif _ROOT_TMP.fullmatch(name):  # the O_DIRECT probe of a starting store or of doctor
                    try:
                        fst = de.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat_mod.S_ISREG(fst.st_mode):
                        sc.temps.append(
                            StoreFile(path, root, fst.st_size, fst.st_mtime, fst.st_mtime_ns, fst.st_ino, "tmp")
                        )
        finally:
            os.close(rfd)
        sc.looks_like_store[root] = looks or not entries
    sc.chunks.sort(key=lambda f: (f.mtime, f.digest))  # the store's order: least recently written first
    return sc


def _unlisted(path: str, root: str, e: OSError) -> StoreFile:
    why = f"cannot list this fan-out directory ({e.strerror}): its chunks were not seen; run as the store's owner"
    return StoreFile(path, root, 0, 0, 0, 0, "other", why=why)


def _blocked_why(de: os.DirEntry) -> str:
    what = "a link" if de.is_symlink() else "a file"
    return f"fan-out directory replaced by {what}: the store cannot use it (never followed); remove it"


def _is_store_tmp(f: StoreFile) -> bool:
    """Whether a temporary of a fan-out directory has a name the store gives
    its own: <digest>.fxkv.tmp.<pid>.<n>[.<host tag>[.<seat tag>]], digest of that
    directory."""
    m = _FANOUT_TMP.fullmatch(os.path.basename(f.path))
    return m is not None and m.group(1)[:2] == os.path.basename(os.path.dirname(f.path))


def is_stale_tmp(f: StoreFile, now: Optional[float] = None) -> bool:
    """The store's own rule: the writer process is gone, or the file is old."""
    return tmp_is_stale(os.path.basename(f.path), f.mtime, time.time() if now is None else now)


# ---------------------------------------------------------------- keys and formatting


def key_fields(key: str) -> dict:
    """model, world size, worker of an LMCache key (CacheEngineKey.to_string:
    model@world_size@worker_id@hash@dtype[@tag%value...]), or of an MP-mode
    key as the L2 adapter names it (l2_adapter.object_key_string:
    model with '/' as '-SEP-'@kv_rank in 0x hex@group@hash[@salt]; kv_rank
    packs world size, global rank, local world size and local rank a byte
    each, LMCache's ObjectKey.ComputeKVRank; no dtype)."""
    parts = key.split("@")
    if len(parts) >= 4 and parts[1].startswith("0x"):
        try:
            rank = int(parts[1], 16)
        except ValueError:
            rank = None
        return {
            "model": parts[0].replace("-SEP-", "/"),
            "world_size": None if rank is None else (rank >> 24) & 0xFF,
            "worker_id": None if rank is None else (rank >> 16) & 0xFF,
            "kv_dtype": None,
        }
    if len(parts) < 5:
        return {"model": "?", "world_size": None, "worker_id": None, "kv_dtype": None}
    try:
        ws, wid = int(parts[1]), int(parts[2])
    except ValueError:
        ws = wid = None
    return {"model": parts[0], "world_size": ws, "worker_id": wid, "kv_dtype": parts[4]}


def geometry(h: Header) -> str:
    shapes = " + ".join(f"{d}[{','.join(str(x) for x in s)}]" for s, d in zip(h.meta.shapes, h.meta.dtypes))
    # KV heads x head size (and a layerwise chunk's layer count) where the writer recorded them: two
    # models can share the shapes
    said = (["x".join(map(str, h.meta.kv))] if h.meta.kv else []) + (
        [f"{h.meta.layers} layers"] if h.meta.layers else []
    )
    return f"{shapes} {h.meta.fmt}" + (f" ({', '.join(said)})" if said else "")


AGE_BUCKETS = [
    ("< 1 hour", 3600),
    ("1 hour - 1 day", 86400),
    ("1 - 7 days", 7 * 86400),
    ("7 - 30 days", 30 * 86400),
    ("> 30 days", float("inf")),
]


# ---------------------------------------------------------------- arguments

MAX_BUFFER_MB = 4096  # fsck --buffer-mb: two batches of it in flight, 8 GiB at most
MAX_GIB = 1 << 33  # 8 EiB: a size in bytes still fits an int64 (and a float stays finite)


def _gib(value: float, flag: str, zero_ok: bool) -> float:
    """A size in GiB from the command line, or AdminError naming the flag."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok) or value > MAX_GIB:
        least = ">= 0" if zero_ok else "above 0"
        raise AdminError(f"{flag} must be a number of GiB {least} and at most {MAX_GIB} (got {value})")
    return value


def _limit(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value}: give 0 (all) or a positive count")
    return n


def add_arguments(p: argparse.ArgumentParser, command: str) -> None:
    p.epilog = EXAMPLES[command]
    p.add_argument(
        "path", nargs="*", metavar="PATH", help="store directory; several (or comma-separated) for a striped store"
    )
    p.add_argument("--config", metavar="YAML", help="take the path (and capacity) from an LMCache config file")
    p.add_argument(
        "--plugin",
        metavar="NAME",
        help="which lmcache-fx entry of --config: its name, or <head>.<name> (storage_plugin.fx) "
        "where both plugin lists have the name (default: the only one)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")
    if command == "ls":
        p.add_argument("--model", help="only chunks of this model")
        p.add_argument(
            "--sort",
            choices=["age", "size", "key", "model"],
            default="age",
            help="order (default age: least recently written first, the eviction order)",
        )
        p.add_argument("--limit", type=_limit, default=0, metavar="N", help="print at most N chunks (0: all)")
    if command == "stat":
        p.add_argument("--capacity-gb", type=float, metavar="N", help="max_capacity_gb to compare usage with")
    if command == "fsck":
        p.add_argument("--repair", action="store_true", help="remove bad chunks and stale temporaries")
        p.add_argument(
            "--buffer-mb",
            type=int,
            default=16,
            metavar="MB",
            help=f"memory per batch (two batches in flight; default 16, at most {MAX_BUFFER_MB})",
        )
        p.add_argument("--io-engine", choices=["auto", "io_uring", "threads"], default="auto")
        p.add_argument(
            "--queue-depth", type=int, default=32, metavar="N", help="reads in flight per batch (default 32)"
        )
        p.add_argument("--no-odirect", action="store_true", help="read through the page cache")
    if command == "gc":
        p.add_argument(
            "--to-gb",
            type=float,
            required=True,
            metavar="N",
            help="keep at most N GiB of chunk files (the unit of max_capacity_gb)",
        )
        p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def resolve(args) -> tuple[list[str], Optional[object]]:
    """(roots, FxOptions from --config or None); AdminError on a wrong path."""
    opts, origin = None, ""
    paths = split_paths(args.path)
    if args.config:
        plugins, unlisted = load_plugin_configs(args.config)
        if not plugins:
            if unlisted:  # the settings are there, the name is not listed: say that, with the fix
                raise AdminError(f"{args.config}: {'; '.join(unlisted)}")
            raise AdminError(
                f"{args.config}: neither storage_plugins nor remote_storage_plugins has an lmcache-fx entry "
                "(storage_plugin.<name>.module_path: lmcache_fx.lmcache_plugin)"
            )
        for w in unlisted:  # settings LMCache will ignore: the store may not be the one meant
            print(f"warning: {args.config}: {w}", file=sys.stderr)
        if args.plugin:
            # A name, or <head>.<name> where both lists hold the name (two stores, two sets of keys)
            plugins = [p for p in plugins if args.plugin in (p.name, p.prefix[:-1])]
            if not plugins:
                raise AdminError(f"{args.config}: no lmcache-fx plugin named {args.plugin!r}")
        if len(plugins) > 1:
            names = [p.name for p in plugins]
            shown = [p.prefix[:-1] if names.count(p.name) > 1 else p.name for p in plugins]
            raise AdminError(
                f"{args.config}: several lmcache-fx plugins ({', '.join(shown)}); pick one with --plugin " + shown[0]
            )
        pc = plugins[0]
        if pc.error:
            raise AdminError(f"{args.config}: {pc.error}")
        opts = pc.options
        if not paths:
            paths = opts.paths
            origin = f"{pc.prefix}path in {args.config}"
    elif args.plugin:
        raise AdminError("--plugin needs --config")
    if not paths:
        raise AdminError("no store given: pass its PATH, or --config with the LMCache YAML")
    roots = [check_root(p, origin) for p in paths]
    # D and D/, or D and a link to it: counted twice, gc would remove twice what it should.
    twice = aliased_root(roots)
    if twice is not None:
        r, first = twice
        same = "" if first == r else f" (the same directory as {first})"
        raise AdminError(f"path: {r}{same} given more than once; list each directory once")
    return roots, opts


# ---------------------------------------------------------------- commands


def run(args, parser=None) -> int:
    try:
        with signals_as_interrupt():  # a SIGTERM'd gc says what it removed, as a Ctrl-C'd one does
            return {"ls": cmd_ls, "stat": cmd_stat, "fsck": cmd_fsck, "gc": cmd_gc}[args.command](args)
    except AdminError as e:  # a closed stdout is the dispatcher's (cli.main)
        print(f"lmcache-fx {args.command}: error: {printable(e)}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e)}))
        return 2
    except KeyboardInterrupt as e:  # gc says what it removed (a file unlinked as Ctrl-C came may go unsaid)
        print(f"lmcache-fx {args.command}: interrupted", file=sys.stderr)
        return interrupt_code(e)


def _emit(args, obj: dict, text: str) -> None:
    """The report, as JSON or text (each line made printable: the fields
    that come from files are escaped where they are put in, so a newline in
    one cannot start a line of its own). Into a closed pipe (`fsck | head`)
    it stops quietly and the command still returns its own status."""
    try:
        if args.json:
            print(json.dumps(obj, indent=1))
        else:
            print("\n".join(printable(line, backslashes=False) for line in text.rstrip("\n").split("\n")))
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_broken_pipe()


def _warn_not_store(sc: Scan) -> list[str]:
    return [
        f"{r} does not look like an lmcache-fx store (no <2 hex digits>/ directories)"
        for r, ok in sc.looks_like_store.items()
        if not ok
    ]


def _warn_unseen(sc: Scan) -> list[str]:
    """What ls, stat and gc could not see or the store cannot use (fsck reports them as problems)."""
    return [f"{d.path}: {d.why}" for d in sc.unlisted + sc.blocked]


def _chunk_record(f: StoreFile, h: Optional[Header], err: str, now: float) -> dict:
    rec = {"path": f.path, "digest": f.digest, "size": f.size, "mtime": f.mtime, "age_s": round(now - f.mtime, 3)}
    if h is not None:
        rec.update(
            key=h.key,
            **key_fields(h.key),
            shapes=[list(s) for s in h.meta.shapes],
            dtypes=list(h.meta.dtypes),
            fmt=h.meta.fmt,
            kv=list(h.meta.kv),
            layers=h.meta.layers,
            payload_len=h.payload_len,
            created_ns=h.created_ns,
            geometry=geometry(h),
        )
    elif err.startswith(OTHER_VERSION):  # left alone by the store and fsck: not a bad chunk
        rec["other_version"] = err
    else:
        rec["error"] = err
    return rec


def _read_headers(sc: Scan) -> list[dict]:
    rd = ChunkVerifier(queue_depth=64)
    now = time.time()
    try:
        recs = [_chunk_record(f, h, err, now) for f, h, err in rd.headers(sc.chunks)]
    finally:
        rd.close()
    order = {f.path: i for i, f in enumerate(sc.chunks)}
    recs.sort(key=lambda r: order[r["path"]])
    return recs


def cmd_ls(args) -> int:
    roots, _ = resolve(args)
    sc = scan(roots)
    recs = _read_headers(sc)
    if args.model:
        recs = [r for r in recs if r.get("model") == args.model]
    if args.sort == "size":
        recs.sort(key=lambda r: -r["size"])
    elif args.sort == "key":
        recs.sort(key=lambda r: r.get("key", ""))
    elif args.sort == "model":
        recs.sort(key=lambda r: (r.get("model", ""), r["mtime"]))
    shown = recs[: args.limit] if args.limit > 0 else recs
    warnings = _warn_not_store(sc) + _warn_unseen(sc)
    obj = {
        "paths": roots,
        "chunks": shown,
        "total_chunks": len(recs),
        "temporaries": [f.path for f in sc.temps],
        "other_files": [{"path": f.path, "why": f.why} for f in sc.others],
        "warnings": warnings,
    }
    lines = []
    if shown:
        lines.append(f"{'AGE':>6}  {'SIZE':>10}  {'MODEL':<24} {'GEOMETRY':<36} KEY")
    for r in shown:
        if "error" in r or "other_version" in r:
            tag, why = ("BAD", r["error"]) if "error" in r else ("VERSION", r["other_version"])
            lines.append(
                f"{human_age(r['age_s']):>6}  {human_bytes(r['size']):>10}  {tag}: {printable(why)}  ({printable(r['path'])})"
            )
        else:
            lines.append(
                f"{human_age(r['age_s']):>6}  {human_bytes(r['size']):>10}  {printable(r['model']):<24} "
                f"{printable(r['geometry']):<36} {printable(r['key'])}"
            )
    total = sum(r["size"] for r in recs)
    more = f" (showing {len(shown)})" if len(shown) < len(recs) else ""
    lines.append(
        f"{len(recs)} chunks, {human_bytes(total)}{more}"
        + (f"; {len(sc.temps)} temporaries" if sc.temps else "")
        + (f"; {len(sc.others)} other files (see fsck)" if sc.others else "")
    )
    lines += [f"warning: {printable(w)}" for w in warnings]
    _emit(args, obj, "\n".join(lines))
    return 0


def cmd_stat(args) -> int:
    if args.capacity_gb is not None:
        _gib(args.capacity_gb, "--capacity-gb", zero_ok=False)
    roots, opts = resolve(args)
    sc = scan(roots)
    recs = _read_headers(sc)
    now = time.time()
    cap_gb = args.capacity_gb if args.capacity_gb is not None else (opts.max_capacity_gb if opts else None)
    if cap_gb is not None and not (math.isfinite(cap_gb) and cap_gb > 0):
        cap_gb = None  # not a capacity to compare with
    total = sum(f.size for f in sc.chunks)
    models: dict = collections.OrderedDict()
    geos: dict = collections.OrderedDict()
    bad = other_version = 0
    for r in recs:
        if "error" in r:
            bad += 1
            continue
        if "other_version" in r:
            other_version += 1
            continue
        m = models.setdefault(r["model"], {"chunks": 0, "bytes": 0, "world_sizes": set(), "workers": set()})
        m["chunks"] += 1
        m["bytes"] += r["size"]
        m["world_sizes"].add(r["world_size"])
        m["workers"].add(r["worker_id"])
        g = geos.setdefault(r["geometry"], {"chunks": 0, "bytes": 0, "payload_len": set()})
        g["chunks"] += 1
        g["bytes"] += r["size"]
        g["payload_len"].add(r["payload_len"])
    ages = collections.OrderedDict((name, {"chunks": 0, "bytes": 0}) for name, _ in AGE_BUCKETS)
    for f in sc.chunks:
        a = now - f.mtime
        for name, lim in AGE_BUCKETS:
            if a < lim:
                ages[name]["chunks"] += 1
                ages[name]["bytes"] += f.size
                break
    fss = {r: fs_info(r) for r in roots}
    stale = sum(1 for t in sc.temps if is_stale_tmp(t, now))
    obj = {
        "paths": roots,
        "chunks": len(sc.chunks),
        "bytes": total,
        "bad_headers": bad,
        "other_version": other_version,
        "temporaries": len(sc.temps),
        "stale_temporaries": stale,
        "other_files": len(sc.others),
        "oldest_age_s": round(now - sc.chunks[0].mtime, 3) if sc.chunks else None,
        "newest_age_s": round(now - sc.chunks[-1].mtime, 3) if sc.chunks else None,
        "capacity_bytes": int(cap_gb * GIB) if cap_gb is not None else None,
        "usage_fraction": (total / (cap_gb * GIB)) if cap_gb else None,
        "models": [
            {
                "model": k,
                "chunks": v["chunks"],
                "bytes": v["bytes"],
                "world_sizes": sorted(x for x in v["world_sizes"] if x is not None),
                "workers": sorted(x for x in v["workers"] if x is not None),
            }
            for k, v in models.items()
        ],
        "geometries": [
            {"geometry": k, "chunks": v["chunks"], "bytes": v["bytes"], "payload_bytes": sorted(v["payload_len"])}
            for k, v in geos.items()
        ],
        "ages": [{"age": k, **v} for k, v in ages.items()],
        "filesystems": fss,
        "warnings": _warn_not_store(sc) + _warn_unseen(sc),
    }
    L = [f"store:        {', '.join(roots)}"]
    for r, fi in fss.items():
        free = human_bytes(fi["free_bytes"]) if fi["free_bytes"] is not None else "?"
        tot = human_bytes(fi["total_bytes"]) if fi["total_bytes"] is not None else "?"
        L.append(
            f"filesystem:   {fi['fstype']} on {fi['device']} at {fi['mountpoint']}, {free} free of {tot}"
            + (f"  ({r})" if len(roots) > 1 else "")
        )
    L.append(
        f"chunks:       {len(sc.chunks)}, {human_bytes(total)}"
        + (f"  ({bad} with a bad header: run fsck)" if bad else "")
        + (f"  ({other_version} of another format version, left alone)" if other_version else "")
    )
    if cap_gb is not None:
        src = "--capacity-gb" if args.capacity_gb is not None else "max_capacity_gb"
        L.append(f"capacity:     {human_bytes(cap_gb * GIB)} ({src}), {100 * total / (cap_gb * GIB):.1f}% used")
        free_all = sum(fi["free_bytes"] or 0 for fi in fss.values())
        if cap_gb * GIB > total + free_all:
            L.append(
                f"              warning: the filesystem has room for only {human_bytes(total + free_all)}; "
                "writes will hit ENOSPC before the capacity is reached"
            )
    else:
        L.append("capacity:     unknown (pass --capacity-gb N or --config YAML)")
    L.append(
        f"temporaries:  {len(sc.temps)} ({stale} stale)" + ("  -> fsck --repair removes stale ones" if stale else "")
    )
    if sc.others:
        L.append(f"other files:  {len(sc.others)} (see fsck)")
    if sc.chunks:
        L.append(
            f"written:      newest {human_age(obj['newest_age_s'])} ago, oldest {human_age(obj['oldest_age_s'])} ago"
        )
    if models:
        L.append("models:")
        for m in obj["models"]:
            L.append(
                f"  {printable(m['model']):<32} {m['chunks']:>8} chunks {human_bytes(m['bytes']):>11}   world size "
                f"{','.join(map(str, m['world_sizes']))}, workers {','.join(map(str, m['workers']))}"
            )
    if geos:
        L.append("geometries:")
        for g in obj["geometries"]:
            L.append(f"  {printable(g['geometry']):<44} {g['chunks']:>8} chunks {human_bytes(g['bytes']):>11}")
    if sc.chunks:
        L.append("age (since written):")
        peak = max(v["chunks"] for v in ages.values()) or 1
        for k, v in ages.items():
            bar = "#" * round(30 * v["chunks"] / peak)
            L.append(f"  {k:<16} {v['chunks']:>8} {human_bytes(v['bytes']):>11}  {bar}".rstrip())
    L += [f"warning: {printable(w)}" for w in obj["warnings"]]
    _emit(args, obj, "\n".join(L))
    return 0


def cmd_fsck(args) -> int:
    if not 1 <= args.buffer_mb <= MAX_BUFFER_MB:
        raise AdminError(f"--buffer-mb must be in 1..{MAX_BUFFER_MB} (MiB per batch; two batches are in flight)")
    if not 1 <= args.queue_depth <= 32768:
        raise AdminError("--queue-depth must be in 1..32768")
    roots, opts = resolve(args)
    mac_key, key_note = None, ""
    if opts is not None and opts.auth_key:  # checked as the store checks: a chunk it would remove is bad
        if sorted(map(os.path.realpath, roots)) != sorted(map(os.path.realpath, opts.paths)):
            # PATH given beside --config: the key is that config's store's, not necessarily this one's
            key_note = f"auth_key of {args.config} not applied: its store is {','.join(opts.paths)}, not this one"
        else:
            try:
                mac_key = auth_key_bytes(opts.auth_key, "auth_key")
            except ConfigError as e:
                raise AdminError(f"{args.config}: {e}") from None
    sc = scan(roots)
    rd = ChunkVerifier(args.io_engine, args.queue_depth, odirect=not args.no_odirect, mac_key=mac_key)
    t0 = time.perf_counter()
    problems, counts, nbytes = [], collections.Counter(), 0
    ok_paths: dict[str, list[StoreFile]] = {}  # digest -> its good files (two: a copy under each root)
    # Counted as a process with the store open while reading its chunk files,
    # so that running stores unlink what they evict instead of reusing it.
    member = Ledger.join(roots[0])
    try:
        for v in rd.verify(sc.chunks, args.buffer_mb << 20):
            counts[v.status] += 1
            if v.status == "ok":
                nbytes += v.size
                ok_paths.setdefault(v.file.digest, []).append(v.file)
                if len(roots) > 1 and v.file.path not in paths_for(roots, v.file.digest):
                    problems.append(
                        _problem(
                            v.file,
                            "misplaced",
                            "under neither of its two paths with this path list (written with another): a "
                            "store still serves it from the index its start-up walk builds; only a lookup that "
                            "looks for it by path (one not yet indexed) misses it",
                        )
                    )
                continue
            if v.status == "gone":
                continue
            problems.append(_problem(v.file, v.status, v.problem, v.ident, v.size))
        engine_kind = rd.engine.kind
        direct = rd.used_direct
        macs_unchecked = rd.macs_unchecked
    finally:
        rd.close()
        if member is not None:
            member.release()
    secs = time.perf_counter() - t0
    for files in ok_paths.values():
        for f in files[1:]:
            problems.append(
                _problem(
                    f,
                    "duplicate",
                    f"the same chunk as {files[0].path} (two writers stored it at once, under each of its roots): "
                    "both are whole; the next store of the chunk, or its removal, leaves one",
                )
            )
    now = time.time()
    for t in sc.temps:
        if is_stale_tmp(t, now):
            problems.append(_problem(t, "stale-tmp", "temporary of a writer that is gone"))
    for o in sc.others:
        problems.append(_problem(o, "foreign", o.why))
    for d in sc.unlisted:
        problems.append(_problem(d, "unreadable", d.why))
    for d in sc.blocked:
        problems.append(_problem(d, "fanout", d.why))
    notes = []
    if args.repair:
        todo = [p for p in problems if p["kind"] in REMOVABLE]
        if todo:
            notes = _remove(roots, sc, todo)
    # Errors are what the store would trip over or leak: bad chunks and stale
    # temporaries, and files that could not be read (so not verified). Files
    # of another format version and foreign files are reported but the store
    # never reads them; misplaced chunks it serves from the index its start-up
    # walk builds, and looks for by path only under their two roots; duplicate copies are whole
    # chunks the store heals on its next write of them. A fan-out directory
    # that is a link or a file stops the store writing there: an error too.
    found = [p for p in problems if p["kind"] in REMOVABLE or p["kind"] in ("unreadable", "fanout")]
    left = [p for p in found if not p.get("resolved")]
    code = 0 if not found else (1 if not left else 4)
    stale_tmp = {p["path"] for p in problems if p["kind"] == "stale-tmp"}
    live = [f for f in sc.temps if f.path not in stale_tmp]
    live_tmp = len(live)
    # Of another host, container or boot: whether their writer lives cannot be told from here.
    aged_tmp = sum(1 for f in live if tmp_judged_by_age(os.path.basename(f.path)))
    obj = {
        "paths": roots,
        "checked": len(sc.chunks),
        "ok": counts["ok"],
        "bad": counts["bad"],
        "unreadable": counts["unreadable"],
        "unlisted_dirs": len(sc.unlisted),
        "other_version": counts["version"],
        "vanished": counts["gone"],
        "bytes_verified": nbytes,
        "seconds": round(secs, 3),
        "gb_per_s": round(nbytes / secs / 1e9, 3) if secs > 0 else None,
        "engine": engine_kind,
        "odirect": direct,
        "macs_checked": mac_key is not None,
        "macs_unchecked": macs_unchecked,
        "live_temporaries": live_tmp,
        "temporaries_judged_by_age": aged_tmp,
        "problems": problems,
        "repair": args.repair,
        "exit_status": code,
        "warnings": _warn_not_store(sc) + notes,
    }
    L = []
    for p in problems:
        tag = {
            "bad": "BAD",
            "unreadable": "UNREADABLE",
            "stale-tmp": "STALE",
            "foreign": "FOREIGN",
            "version": "VERSION",
            "misplaced": "MISPLACED",
            "duplicate": "DUPLICATE",
            "fanout": "FANOUT",
        }[p["kind"]]
        act = ""
        if args.repair and p["kind"] in REMOVABLE:
            act = "  -> removed" if p["removed"] else f"  -> not removed: {printable(p['note'])}"
        L.append(f"{tag:<10} {printable(p['path'])}: {printable(p['problem'])}{act}")
    L.append(
        f"checked {len(sc.chunks)} chunks ({human_bytes(nbytes)} verified) in {secs:.2f} s"
        + (f", {nbytes / secs / 1e9:.2f} GB/s" if secs > 0 and nbytes else "")
        + f" with {engine_kind}{' + O_DIRECT' if direct else ''}: "
        f"{counts['ok']} ok, {counts['bad']} bad"
        + (f", {counts['unreadable']} unreadable (not verified, never removed)" if counts["unreadable"] else "")
        + (f", {counts['version']} of another format version" if counts["version"] else "")
        + (f", {counts['gone']} removed meanwhile" if counts["gone"] else "")
        + (f"; {len(sc.unlisted)} fan-out directories could not be listed" if sc.unlisted else "")
    )
    if key_note:
        L.append(key_note)
    if mac_key is not None:
        L.append("MACs checked with the auth_key of the config")
    elif macs_unchecked:
        L.append(
            f"{macs_unchecked} chunks carry a MAC (auth_key), not checked: pass --config with the store's "
            "auth_key to check them (a server with the key removes those it does not verify, and chunks with none)"
        )
    if live_tmp - aged_tmp:
        L.append(f"{live_tmp - aged_tmp} temporaries of writers running here (left alone)")
    if aged_tmp:
        L.append(
            f"{aged_tmp} temporaries of writers of another host, container or boot (left alone: whether they "
            f"still run cannot be told from here; removed once {STALE_TMP_SECONDS / 3600:g} h old)"
        )
    if any(p["kind"] in REMOVABLE for p in found) and not args.repair:
        L.append("run again with --repair to remove the bad chunks and stale temporaries")
    L += [f"warning: {printable(w)}" for w in obj["warnings"]]
    _emit(args, obj, "\n".join(L))
    return code


REMOVABLE = ("bad", "stale-tmp")  # what fsck --repair removes


def _problem(
    f: StoreFile, kind: str, why: str, ident: Optional[tuple[int, int, int]] = None, size: Optional[int] = None
) -> dict:
    """A finding; `ident` (st_dev, st_ino, st_ctime_ns) and `size` of the
    file judged (fstat of the one opened) where it was read, else the
    listing's."""
    return {
        "path": f.path,
        "kind": kind,
        "problem": why,
        "size": f.size if size is None else size,
        "ino": ident[1] if ident else f.ino,
        "dev": ident[0] if ident else None,
        "ctime_ns": ident[2] if ident else None,
        "temporary": f.kind == "tmp",
        "removed": False,
    }


def _remove(roots: list[str], sc: Scan, todo: list[dict]) -> list[str]:
    """fsck --repair: removes each file of `todo` that is still the one judged
    (Remover), setting its "removed" and "note"; returns warnings. Nothing is
    removed at a root that does not look like a store."""
    rm = Remover(roots, sc.dirs)
    try:
        for p in todo:
            root = next((r for r in roots if p["path"].startswith(r.rstrip("/") + "/")), None)
            if root is None or not sc.looks_like_store.get(root, False):
                p["note"] = "its directory does not look like an lmcache-fx store (left alone)"
                continue
            # Not taken off the ledger: a bad file or a temporary may be one it never counted (a
            # planted file), and taking it off would leave the ledger below the truth, letting
            # running stores pass their cap. Left, it is an overcount, as of a file removed by
            # hand: eviction starts early until a store's next walk recounts (the store's own
            # periodic recompute). Recounting here would repeat the store's accounting and hold
            # the lock for a walk; invalidating the record would make a running store walk
            # under the lock at its next write.
            outcome, p["note"] = rm.remove(
                p["path"], p["ino"], p["dev"], temporary=p["temporary"], counted=False, ctime_ns=p["ctime_ns"]
            )
            p["removed"] = outcome == "removed"
            p["resolved"] = outcome != "failed"  # gone, or no longer the file judged
    finally:
        rm.close()
    return rm.warnings


def _fix_for_unwritable(root: str) -> str:
    """What to do about a store file this process cannot write: nothing can
    be done on a read-only filesystem (EROFS), where the owner's rights would
    not help; else run as its owner."""
    if on_read_only_fs(root):
        return "the store is on a read-only filesystem: nothing can be removed there"
    return "run as the store's owner"


class Remover:
    """Removes store files as the store's own cleanup does (store.py's
    stale-temporary removal and evictor): under the store lock, taken with its
    bounded wait (Ledger.hold, LOCK_TIMEOUT) and held for at most
    BATCH_SECONDS at a time so running stores are never held up long; each
    file through a descriptor of its directory opened without following links
    and still the directory the listing saw; only while it is the file judged
    (layout.unlink_if_same: a regular file of that inode, not newer than the
    fresh stat it was judged by; a temporary only while that stat still finds
    it stale); the bytes removed taken off the shared ledger before the lock
    is let go; once done, the record is marked for a recount by the next
    store that writes (a chunk-named file planted since the last recount was
    never counted: taken off, it left the count below the files, and stores
    passed the cap until their own recount, five minutes on; clamping at what
    the listing still held overcounted where a store evicted a listed file
    meanwhile). Between two holds the lock is left free for longer
    than a waiting store's pause between tries: taken again at once, a store
    waiting for it almost never got it, and a long removal made its stores
    time out. A store with no lock file (no store ever opened it) is cleaned
    without the lock; one whose lock file cannot be opened or written is left
    alone."""

    BATCH_SECONDS = 0.1
    YIELD_SECONDS = 1.2 * ledger_mod.LOCK_POLL_MAX

    def __init__(self, roots: list[str], dirs: dict):
        self.roots = roots
        self.dirs = dirs  # directory -> (st_dev, st_ino) the listing saw
        self.warnings: list[str] = []
        self.stuck = ""  # why nothing more is removed
        self.freed = 0  # bytes removed that the ledger counts, not yet taken off it
        self.removed_bytes = 0
        self._recount_asked = False  # the ledger marked for a recount by the first subtraction
        self._dirfds: dict[str, int] = {}
        self._hold: Optional[Any] = None  # Ledger.hold() entered
        self._until = 0.0
        self._released = 0.0  # when the last hold ended
        lock = os.path.join(roots[0], LOCK_NAME)
        self.ledger = Ledger.join(roots[0])
        if self.ledger is None:
            if os.path.lexists(lock):
                regular = os.path.isfile(lock) and not os.path.islink(lock)
                self.stuck = (
                    f"cannot open the store's lock file {lock} ({_fix_for_unwritable(roots[0])})"
                    if regular
                    else f"the store's lock file {lock} is not a regular file (remove it)"
                )
        elif fcntl.fcntl(self.ledger.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            self.stuck = (
                f"cannot write the store's lock file {lock}, which counts its bytes ({_fix_for_unwritable(roots[0])})"
            )
        if self.stuck:
            self.warnings.append(f"nothing removed: {self.stuck}")

    def _lock(self) -> bool:
        if self.stuck:
            return False
        if self.ledger is None or (self._hold is not None and time.monotonic() < self._until):
            return True
        self._unlock()
        wait = self._released + self.YIELD_SECONDS - time.monotonic()
        if wait > 0:
            time.sleep(wait)  # a waiting store's turn
        hold = self.ledger.hold()
        try:
            hold.__enter__()
        except LockTimeout:
            self.stuck = f"the store lock was not free within {ledger_mod.LOCK_TIMEOUT:g} s (another process holds it); run again later"
            self.warnings.append(f"stopped removing: {self.stuck}")
            return False
        self._hold, self._until = hold, time.monotonic() + self.BATCH_SECONDS
        return True

    def _unlock(self) -> None:
        """Takes what was removed off the ledger, then lets the lock go."""
        for fd in self._dirfds.values():
            os.close(fd)
        self._dirfds.clear()
        if self._hold is None:
            return
        try:
            if self.freed and self.ledger is not None:
                # Marked for a recount with the first subtraction, not only at close(): files the
                # ledger never counted (planted, or left by a crash) come off it too, and a gc
                # killed or kept from the lock before close() left it below the files until the
                # stores' periodic rescan. The mark stays until a store recounts, after which what
                # is removed was counted. (A bad record: the next store to meet it rescans.)
                self.ledger.add(-self.freed, recount=not self._recount_asked)
                self._recount_asked = True
                self.freed = 0
        finally:
            hold, self._hold = self._hold, None
            hold.__exit__(None, None, None)
            self._released = time.monotonic()

    def _dir(self, sub: str) -> tuple[int, str]:
        """A descriptor of directory `sub`, still the one listed; (-1, why) if not."""
        fd = self._dirfds.get(sub)
        if fd is not None:
            return fd, ""
        try:
            # A root is the path the user gave (followed, as the store follows it); a
            # fan-out directory is opened without following a link planted in its place.
            fd = os.open(sub, _DIR_FLAGS) if sub in self.roots else open_dir(sub)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                return -1, "its directory was replaced by a link or a file since the listing (left alone)"
            return -1, f"cannot open its directory: {e.strerror}"
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            return -1, f"cannot open its directory: {e.strerror}"
        if self.dirs.get(sub) != (st.st_dev, st.st_ino):
            os.close(fd)
            return -1, "its directory was replaced since the listing (left alone)"
        self._dirfds[sub] = fd
        return fd, ""

    def remove(
        self,
        path: str,
        ino: int,
        dev: Optional[int] = None,
        temporary: bool = False,
        counted: bool = True,
        mtime_ns: Optional[int] = None,
        ctime_ns: Optional[int] = None,
    ) -> tuple[str, str]:
        """(outcome, note): outcome "removed"; "gone" (absent already);
        "changed" (no longer the file judged: replaced, a live writer's again,
        read or written since; left alone); "failed" (not removed: an error,
        its directory replaced, the lock not had). `ino` (and `dev` where known): the file judged;
        `temporary`: removed only while still stale; `counted`: its bytes are
        in the ledger; `mtime_ns`: kept when newer (read or written since);
        `ctime_ns`: kept when its inode changed since it was judged (a chunk
        a server removed as bad and stored anew can get the same inode
        number: fsck --repair removed the new, good one)."""
        if not self._lock():
            return "failed", self.stuck
        sub, name = os.path.split(path)
        dfd, why = self._dir(sub)
        if dfd < 0:
            return "failed", why
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return "gone", "already gone"
        except OSError as e:
            return "failed", e.strerror or str(e)
        if not stat_mod.S_ISREG(st.st_mode):
            return "changed", "no longer a regular file (left alone)"
        if st.st_ino != ino or (dev is not None and st.st_dev != dev):
            return "changed", "replaced by another file since it was checked (left alone)"
        if temporary and not tmp_is_stale(name, st.st_mtime, time.time()):
            return "changed", "in use by a live writer again (left alone)"
        if mtime_ns is not None and st.st_mtime_ns > mtime_ns:
            return "changed", "read or written since the listing (kept)"
        if ctime_ns is not None and st.st_ctime_ns != ctime_ns:
            return "changed", "changed since it was checked (left alone)"
        # The file just judged, under the store lock: removed here, so that an error (a read-only
        # filesystem) is reported as one, not taken for a file changed meanwhile.
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            return "gone", "already gone"
        except OSError as e:
            return "failed", e.strerror or str(e)
        gone = st
        self.removed_bytes += gone.st_size
        if counted:
            self.freed += gone.st_size
        return "removed", ""

    def close(self) -> None:
        try:
            if self.removed_bytes and self.ledger is not None and self._lock():
                self.ledger.add(-self.freed, recount=True)
                self.freed = 0
            self._unlock()
        finally:
            if self.ledger is not None:
                self.ledger.release()
                self.ledger = None


def cmd_gc(args) -> int:
    _gib(args.to_gb, "--to-gb", zero_ok=True)
    roots, _ = resolve(args)
    target = int(args.to_gb * GIB)
    sc = scan(roots)
    before = sum(f.size for f in sc.chunks)
    usage = before
    removed: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    kept: list[dict[str, str]] = []
    rm = None if args.dry_run else Remover(roots, sc.dirs)
    interrupted = 0  # the exit status of an interrupt (130: Ctrl-C)
    try:
        try:
            for f in sc.chunks:  # least recently written first
                if usage <= target:
                    break
                if rm is not None:
                    outcome, note = rm.remove(f.path, f.ino, mtime_ns=f.mtime_ns)
                    if outcome == "gone":
                        usage -= f.size
                        continue
                    if outcome == "changed":
                        kept.append({"path": f.path, "why": note})
                        continue
                    if outcome == "failed":
                        failed.append({"path": f.path, "error": note})
                        if rm.stuck:
                            break
                        continue
                removed.append({"path": f.path, "size": f.size, "age_s": round(time.time() - f.mtime, 3)})
                usage -= f.size
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: what was removed is taken off the ledger, then said
            interrupted = interrupt_code(e)
    finally:
        if rm is not None:
            rm.close()
    obj = {
        "paths": roots,
        "target_bytes": target,
        "before_bytes": before,
        "after_bytes": usage,
        "chunks_before": len(sc.chunks),
        "removed_chunks": len(removed),
        "freed_bytes": sum(r["size"] for r in removed),
        "dry_run": args.dry_run,
        "interrupted": bool(interrupted),
        "removed": removed,
        "kept": kept,
        "failed": failed,
        "unlisted_dirs": [d.path for d in sc.unlisted],
        "warnings": _warn_not_store(sc) + _warn_unseen(sc),
    }
    verb = "would remove" if args.dry_run else "removed"
    L = [
        f"{verb} {len(removed)} of {len(sc.chunks)} chunks ({human_bytes(obj['freed_bytes'])}): "
        f"{human_bytes(before)} -> {human_bytes(usage)} (target {human_bytes(target)})"
    ]
    if removed:
        L.append(
            f"oldest removed written {human_age(removed[0]['age_s'])} ago, newest {human_age(removed[-1]['age_s'])} ago"
        )
    if kept:
        L.append(f"kept {len(kept)} chunks read or replaced since the listing")
    L += [f"could not remove {printable(x['path'])}: {printable(x['error'])}" for x in failed]
    if sc.unlisted:  # their chunks are in the store's usage but not in `usage` here
        L.append(
            f"error: {len(sc.unlisted)} fan-out directories could not be listed: the store may still hold "
            "more than the target; run as the store's owner"
        )
    L += [f"warning: {printable(w)}" for w in obj["warnings"]]
    if interrupted:
        L.append("interrupted: stopped before the target")
    _emit(args, obj, "\n".join(L))
    if interrupted:
        return interrupted
    return 1 if failed or sc.unlisted or usage > target else 0
