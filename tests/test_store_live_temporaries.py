"""Another process's scan judges a temporary of a live process on this host
by its mtime (over an hour old: stale, for a pid that may have been
recycled). A file a store renames to a temporary's name and still uses, an
evicted chunk's file reused for a new chunk or a removed chunk's file kept
as a spare, must not keep the old chunk's mtime: a peer's ledger recompute
would delete it mid-use (the store fails) and take its bytes off the ledger
that its owner then takes off again."""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from faults import fxfault as F  # noqa: E402

from lmcache_fx.core.chunkfile import HEADER_SIZE  # noqa: E402
from lmcache_fx.core.store import ChunkStore  # noqa: E402

CHUNK = 256 * 1024  # at least SPARE_MIN_BYTES: kept as a spare when removed
FILE = HEADER_SIZE + CHUNK
KEYS = [f"model@1@0@{h:016x}@bfloat16" for h in range(8)]
CAP_GB = (4 * FILE + 100) / (1 << 30)  # room for 4 chunks


def _open(path) -> ChunkStore:
    return F.open_store(path, max_capacity_gb=CAP_GB, odirect="false")


def _on_disk(path: str) -> int:
    return sum(os.path.getsize(p) for p in F.chunk_files(path) + F.tmp_files(path))


def _peer_recompute(store_dir: str) -> None:
    """Another process (a live pid other than this one) opens the store and
    runs its periodic ledger recompute, which removes stale temporaries."""
    code = (
        f"import sys; sys.path.insert(0, {HERE!r}); from faults import fxfault as F; "
        f"s = F.open_store({store_dir!r}, max_capacity_gb={CAP_GB!r}, odirect='false'); s._recompute(); s.close()"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(HERE), timeout=120)


def _aged_store(store_dir: str) -> None:
    """A full store whose chunks were last used 2 h ago (a cache's LRU end)."""
    s = _open(store_dir)
    try:
        src = F.Chunks()
        for k in KEYS[:4]:
            assert s.write([src.item(k, CHUNK)]) == [True]
    finally:
        s.close()
    t = time.time() - 2 * 3600
    for p in F.chunk_files(store_dir):
        os.utime(p, (t, t))


def test_a_reused_victim_being_written_survives_a_peers_scan(tmp_path):
    store_dir = str(tmp_path / "store")
    _aged_store(store_dir)
    s = _open(store_dir)
    try:
        real = s._wengine
        seen = []

        class PeerScansAtPayload:
            def __getattr__(self, name):
                return getattr(real, name)

            def write(self, ops, *a, **k):
                if not seen:  # the victim is this store's temporary now, the store lock released
                    seen.append(len(F.tmp_files(store_dir)))
                    _peer_recompute(store_dir)
                    seen.append(len(F.tmp_files(store_dir)))
                return real.write(ops, *a, **k)

        s._wengine = PeerScansAtPayload()
        try:
            src = F.Chunks()
            ok = s.write([src.item(KEYS[5], CHUNK)])
        finally:
            s._wengine = real
        assert s.stats.snapshot()["recycled"] == 1
        assert seen == [1, 1]  # the peer left the live temporary alone
        assert ok == [True]
        assert s.usage_bytes == _on_disk(store_dir) == 4 * FILE
        assert F.read_check(s, [KEYS[5]]) == (1, 0, [])
    finally:
        s.close()


def test_a_spare_survives_a_peers_scan(shm_dir):
    _aged_store(shm_dir)
    s = _open(shm_dir)
    try:
        assert s._keeps_spares
        assert s.remove(KEYS[0])
        assert s.spare_bytes == FILE and len(F.tmp_files(shm_dir)) == 1
        _peer_recompute(shm_dir)
        assert len(F.tmp_files(shm_dir)) == 1  # the peer left the spare alone
        assert s.usage_bytes == _on_disk(shm_dir) == 4 * FILE
        src = F.Chunks()
        assert s.write([src.item(KEYS[5], CHUNK)]) == [True]  # into the spare
        assert s.stats.snapshot()["recycled"] == 1
        assert s.usage_bytes == _on_disk(shm_dir) == 4 * FILE
    finally:
        s.close()
