#!/usr/bin/env python3
"""Memory of a store's index per chunk file: what each process that opens a
store (every TP rank, every server) holds in Python for every chunk file in
it, whatever the chunks' size.

Writes --chunks small chunks (4 KiB payloads, a vLLM-style key and a KV_2LTD
meta with its KV heads x head size recorded, as the storage plugin writes
them) into a store in a fresh directory (under --dir, by default a tmpfs of
its own when root, else /dev/shm), then, in the same process, measured with
tracemalloc:

  opened   a new ChunkStore on it: the start-up walk's index (path, size,
           recency per file)
  read     after a read of every chunk: each entry also holds its header's
           meta (one object shared by all chunks of a meta) and JSON body,
           the inode and mtimes it was read at

and the time the walk took. The figures are bytes per chunk file; a store of
N chunk files costs about N times them in every process that opens it.

    python scripts/index_memory_probe.py --chunks 50000 --json docs/index-memory-probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache_fx import _fxio as fx  # noqa: E402
from lmcache_fx.core.chunkfile import ChunkMeta  # noqa: E402
from lmcache_fx.core.options import FxOptions  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402
from lmcache_fx.testing import loopfs  # noqa: E402
from lmcache_fx.tools.bench import _git_commit as git_commit  # noqa: E402

SIZE = 4096
BATCH = 256
# A 4 KiB payload as 2 x 1 layer x 16 tokens x 64 (bf16): the meta's form, not a real model's size
META = ChunkMeta(((2, 1, 16, 64),), ("bfloat16",), "KV_2LTD", kv=(1, 64))


def key_of(i: int) -> str:
    return f"vllm@org/model-70b@8@0@{i:064x}"  # LMCache's model@world@worker@hash, a 64-hex hash


def _slots(dst):
    """A read's allocate: the next SIZE-byte slot of dst for each chunk."""
    slots = iter(range(BATCH))
    return lambda _meta: (lambda k: (k, dst.address + k * SIZE, SIZE))(next(slots))


def measure(where: str, n: int) -> dict:
    path = os.path.join(where, "store")
    opts = FxOptions.from_mapping({"path": path, "max_capacity_gb": 100})
    src = fx.HostBuffer(SIZE * BATCH)
    memoryview(src)[:] = os.urandom(SIZE * BATCH)
    st = ChunkStore(opts)
    try:
        for s in range(0, n, BATCH):
            items = [(key_of(i), src.address + (i - s) * SIZE, SIZE, META) for i in range(s, min(n, s + BATCH))]
            assert all(st.write(items)), "store write failed"
    finally:
        st.close()
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    st = ChunkStore(opts)
    walk_s = time.perf_counter() - t0
    try:
        gc.collect()
        opened, _ = tracemalloc.get_traced_memory()
        assert len(st) == n, (len(st), n)
        dst = fx.HostBuffer(SIZE * BATCH)
        for s in range(0, n, BATCH):
            keys = [key_of(i) for i in range(s, min(n, s + BATCH))]
            got = st.read(keys, _slots(dst), lambda h: None)
            assert all(g is not None for g in got), "store miss"
        gc.collect()
        read, _ = tracemalloc.get_traced_memory()
    finally:
        st.close()
        tracemalloc.stop()
    return {
        "chunks": n,
        "walk_s": round(walk_s, 3),
        "opened_bytes_per_chunk": round(opened / n, 1),
        "read_bytes_per_chunk": round(read / n, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=50000)
    ap.add_argument("--dir", help="where to make the store (default: a tmpfs of its own when root, else /dev/shm)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    with contextlib.ExitStack() as es:
        if args.dir:
            where = tempfile.mkdtemp(prefix="fx-index-memory-", dir=args.dir)
            es.callback(shutil.rmtree, where, True)
            medium = args.dir
        elif os.geteuid() == 0:
            where = es.enter_context(loopfs.tmpfs("size=2G"))
            medium = "tmpfs (size=2G)"
        else:
            where = tempfile.mkdtemp(prefix="fx-index-memory-", dir="/dev/shm")
            es.callback(shutil.rmtree, where, True)
            medium = "/dev/shm"
        r = measure(where, args.chunks)
    print(
        f"{r['chunks']} chunk files: start-up walk {r['walk_s']:.2f} s; index {r['opened_bytes_per_chunk']:.0f} B per "
        f"chunk after opening, {r['read_bytes_per_chunk']:.0f} B once every chunk was read"
    )
    commit = git_commit(ROOT, ("lmcache_fx",)) or ""
    doc = {
        "command": " ".join(
            shlex.quote(a)
            for a in [sys.executable.replace(ROOT + "/", ""), os.path.relpath(__file__, ROOT), *sys.argv[1:]]
        ),
        "commit": commit.removesuffix("+dirty"),
        "worktree_dirty": commit.endswith("+dirty"),
        "medium": medium,
        "python": sys.version.split()[0],
        "statistic": "tracemalloc's traced bytes after the step over the chunk files, one run",
        "result": r,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
