"""The three LMCache entry points over one store, driven by LMCache itself:
the in-process storage plugin and the remote storage plugin through a real
LMCacheEngine on CPU, the MP-mode L2 adapter through LMCache's MP
StorageManager (its store and prefetch controllers), its `lmcache bench l2`
command and a real `lmcache server` process.

Run as a script, this file is the other process of the cross-process test:
    python tests/test_entry_points.py <entry> <store_path> <workdir>
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, fx_config, lmcache_engine, retrieve  # noqa: E402

ENTRIES = ["plugin", "remote", "l2"]
GEO = Geometry(layers=2, kv_heads=2, head_dim=64, dtype=torch.bfloat16)  # 128 KiB chunks
NTOK = 4 * 256
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L2_JSON = {"type": "plugin", "module_path": "lmcache_fx.l2_adapter", "class_name": "FxL2Adapter"}


# ---------------------------------------------------------------- configs
def remote_config(path, name="fx", cpu_gb=0.1, **opts):
    """The YAML a user writes for the remote storage plugin form."""
    return {
        "chunk_size": GEO.chunk,
        "local_cpu": False,
        "max_local_cpu_size": cpu_gb,
        "remote_storage_plugins": [name],
        "extra_config": {
            f"remote_storage_plugin.{name}.module_path": "lmcache_fx.remote_plugin",
            f"remote_storage_plugin.{name}.class_name": "FxRemoteConnector",
            f"remote_storage_plugin.{name}.path": str(path),
            **{f"remote_storage_plugin.{name}.{k}": v for k, v in opts.items()},
        },
    }


def engine_config(entry, path, workdir, **opts):
    d = fx_config(path, cpu_gb=0.1, **opts) if entry == "plugin" else remote_config(path, **opts)
    return config_from_dict(d, workdir)


def backend_of(engine, entry):
    backends = engine.storage_manager.storage_backends
    name = "fx" if entry == "plugin" else "RemoteBackend-fx"
    assert name in backends, f"{entry}: backend not loaded; backends: {list(backends)}"
    return backends[name]


def fx_store_of(backend):
    """The ChunkStore behind either engine backend."""
    if hasattr(backend, "store"):
        return backend.store
    return backend.connection.getWrappedConnector().store


def store_engine(engine, entry, tokens, kv, timeout=60):
    """Stores and waits for the files: LMCache frees its pool at destroy even
    while a tier still writes from it."""
    be = backend_of(engine, entry)
    st = fx_store_of(be)
    want = len(st) + len(tokens) // GEO.chunk
    engine.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
    if entry == "plugin":
        be.flush(timeout)
        return be
    # RemoteBackend does not track batched puts (put_tasks is only filled by
    # the single-key path): wait for the chunks, then for the put to return.
    conn, end = be.connection.getWrappedConnector(), time.monotonic() + timeout
    while len(st) < want or conn.pending_puts():
        assert time.monotonic() < end, "remote puts still pending"
        time.sleep(0.01)
    return be


# ---------------------------------------------------------------- MP mode
class MPSide:
    """LMCache's MP StorageManager (L1 + store/prefetch controllers) with the
    fx L2 adapter, configured from the same arguments `lmcache server` takes."""

    def __init__(self, path, l1_gb=0.05, **params):
        from lmcache.v1.distributed.config import parse_args
        from lmcache.v1.distributed.storage_manager import StorageManager

        spec = json.dumps({**L2_JSON, "adapter_params": {"path": str(path), **params}})
        self.sm = StorageManager(
            parse_args(["--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU", "--l2-adapter", spec])
        )
        self.adapter = self.sm.l2_adapters()[0][1]

    @staticmethod
    def keys_and_data(n=4, seed=7):
        from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

        shape = torch.Size([GEO.kv_size, GEO.layers, GEO.chunk, GEO.kv_heads * GEO.head_dim])
        layout = MemoryLayoutDesc(shapes=[shape], dtypes=[GEO.dtype])
        g = torch.Generator().manual_seed(seed)
        rank = ObjectKey.ComputeKVRank(1, 0, 1, 0)
        keys = [
            ObjectKey(chunk_hash=(seed * 1000 + i).to_bytes(32, "big"), model_name="org/fx-test-model", kv_rank=rank)
            for i in range(n)
        ]
        return keys, [torch.randn(shape, generator=g).to(GEO.dtype) for _ in keys], layout

    def store(self, keys, data, layout, timeout=60):
        objs = self.sm.reserve_write(keys, layout)
        assert len(objs) == len(keys)
        for k, d in zip(keys, data):
            objs[k].tensor.copy_(d)
        self.sm.finish_write(keys)
        end = time.monotonic() + timeout
        # The store controller writes async; a task reports stored keys and
        # evictions to listeners after its files land, so wait for both.
        while not (
            all(self.adapter.store.contains(_ks(k)) for k in keys)
            and self.adapter.report_status()["tasks_in_flight"] == 0
        ):
            assert time.monotonic() < end, "L2 store did not complete"
            time.sleep(0.01)

    def load(self, keys, layout, data):
        """Prefetch through LMCache's prefetch controller (L2 lookup-and-lock,
        load, unlock); returns (L2 hits, bit-exact)."""
        from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

        h = self.sm.submit_prefetch_task(
            PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)])
        )
        assert self.sm.wait_prefetch_status(h, 60)
        r = self.sm.query_prefetch_status(h)
        hits = r.l2_hit_cells[0].popcount()
        equal = False
        if r.hit_cells[0].popcount() == len(keys):
            with self.sm.read_prefetched_results(keys, r.l1_owners) as objs:
                equal = objs is not None and all(_bytes(o.tensor) == _bytes(d) for o, d in zip(objs, data))
            self.sm.finish_read_prefetched(keys, l1_owners=r.l1_owners)
        return hits, equal

    def close(self):
        self.sm.close()


def _ks(k):
    from lmcache_fx.l2_adapter import object_key_string

    return object_key_string(k)


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------- one side of a round trip
def do_store(entry, path, workdir) -> dict:
    if entry == "l2":
        side = MPSide(path)
        try:
            keys, data, layout = MPSide.keys_and_data()
            side.store(keys, data, layout)
            return {"chunks": len(side.adapter.store)}
        finally:
            side.close()
    tokens, kv = torch.arange(NTOK) % 5000, KV(GEO, NTOK, seed=7)
    with lmcache_engine(engine_config(entry, path, workdir), GEO) as eng:
        be = store_engine(eng, entry, tokens, kv)
        return {"chunks": len(fx_store_of(be))}


def do_retrieve(entry, path, workdir) -> dict:
    if entry == "l2":
        side = MPSide(path)
        try:
            keys, data, layout = MPSide.keys_and_data()
            hits, equal = side.load(keys, layout, data)
            return {"chunks": hits, "equal": equal, "chunks_read": side.adapter.store.stats.chunks_read}
        finally:
            side.close()
    tokens, kv = torch.arange(NTOK) % 5000, KV(GEO, NTOK, seed=7)
    with lmcache_engine(engine_config(entry, path, workdir), GEO) as eng:
        got = kv.empty_like()
        n = retrieve(eng, tokens, got)
        return {
            "chunks": n // GEO.chunk,
            "equal": kv.tokens_equal(got, n),
            "chunks_read": fx_store_of(backend_of(eng, entry)).stats.chunks_read,
        }


def _env():
    return dict(
        os.environ,
        PYTHONHASHSEED="0",
        LMCACHE_TRACK_USAGE="false",
        LMCACHE_DISABLE_BANNER="1",
        PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(__file__)]),
    )


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("entry", ENTRIES)
def test_round_trip_bit_exact(tmp_path, entry):
    """Store and read back in one process, every read from the fx files."""
    store = tmp_path / "store"
    if entry == "l2":
        side = MPSide(store)
        try:
            keys, data, layout = MPSide.keys_and_data(seed=3)
            side.store(keys, data, layout)
            side.sm.clear(force=True)  # drop L1 so the prefetch must load from L2
            assert side.load(keys, layout, data) == (4, True)
            assert side.adapter.store.stats.chunks_read == 4
            assert side.adapter.report_status()["is_healthy"]
        finally:
            side.close()
        return
    tokens, kv = torch.randint(0, 30000, (NTOK,)), KV(GEO, NTOK, seed=1)
    with lmcache_engine(engine_config(entry, store, tmp_path), GEO) as eng:
        be = store_engine(eng, entry, tokens, kv)
        st = fx_store_of(be)
        assert len(st) == 4
        got = kv.empty_like()
        assert retrieve(eng, tokens, got) == NTOK
        assert kv.tokens_equal(got, NTOK)
        assert st.stats.chunks_read == 4  # served by fx (local_cpu is off)


@pytest.mark.parametrize("entry", ENTRIES)
def test_store_in_one_process_retrieve_in_another(tmp_path, entry):
    store = tmp_path / "store"
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), entry, str(store), str(tmp_path)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    assert json.loads(line[-1][7:]) == {"chunks": 4}
    assert do_retrieve(entry, store, tmp_path) == {"chunks": 4, "equal": True, "chunks_read": 4}


@pytest.mark.parametrize("src,dst", [("plugin", "remote"), ("remote", "plugin")])
def test_stored_through_one_found_through_another(tmp_path, src, dst):
    """Both engine entry points key chunks by CacheEngineKey.to_string() and
    store LMCache's KV_2LTD objects as they are: the same files serve both."""
    store = tmp_path / "store"
    tokens, kv = torch.arange(NTOK) + 77, KV(GEO, NTOK, seed=5)
    with lmcache_engine(engine_config(src, store, tmp_path), GEO) as eng:
        store_engine(eng, src, tokens, kv)
    with lmcache_engine(engine_config(dst, store, tmp_path), GEO) as eng:
        got = kv.empty_like()
        assert retrieve(eng, tokens, got) == NTOK
        assert kv.tokens_equal(got, NTOK)
        assert fx_store_of(backend_of(eng, dst)).stats.chunks_read == 4


def test_l2_and_engine_entry_points_share_a_path(tmp_path):
    """MP mode keys chunks by ObjectKey (chunk hash bytes from the MP token
    hasher, packed kv_rank, object group, cache_salt; no dtype), the engine
    entry points by CacheEngineKey (in-process token hash, world size,
    worker id, dtype): the same tokens give different keys, so neither can
    find the other's chunks (docs/entry-points.md). They share one path
    safely: one index, one capacity, no collisions."""
    store = tmp_path / "store"
    tokens, kv = torch.arange(NTOK) + 5, KV(GEO, NTOK, seed=9)
    with lmcache_engine(engine_config("plugin", store, tmp_path), GEO) as eng:
        store_engine(eng, "plugin", tokens, kv)
    side = MPSide(store)
    try:
        assert len(side.adapter.store) == 4 and side.adapter.get_usage().total_bytes_used > 0  # counted
        keys, data, layout = MPSide.keys_and_data(seed=11)
        side.store(keys, data, layout)
        assert len(side.adapter.store) == 8
        side.sm.clear(force=True)
        assert side.load(keys, layout, data) == (4, True)
    finally:
        side.close()
    with lmcache_engine(engine_config("remote", store, tmp_path), GEO) as eng:
        st = fx_store_of(backend_of(eng, "remote"))
        assert len(st) == 8
        got = kv.empty_like()
        assert retrieve(eng, tokens, got) == NTOK and kv.tokens_equal(got, NTOK)


def _deleted_keys(adapter) -> list:
    """A list that LMCache's L2AdapterListener callbacks on `adapter` fill
    with the keys it reports deleted."""
    deleted: list = []

    class Listener:
        def on_l2_keys_stored(self, keys, sizes):
            pass

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            deleted.extend(keys)

    adapter.register_listener(Listener())
    return deleted


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_l2_capacity_and_eviction_reported(tmp_path, where):
    """Usage and evictions as LMCache's controller sees them; on tmpfs a
    deleted chunk's file is kept as a spare, and counts as free space there
    (or the controller, seeing no drop, would delete more)."""
    import shutil
    import uuid

    from lmcache_fx.core.chunkfile import HEADER_SIZE
    from lmcache_fx.core.medium import page_cache_fs

    chunk = HEADER_SIZE + GEO.chunk * GEO.bytes_per_token
    path = tmp_path / "store"
    if where == "shm":
        if not page_cache_fs(["/dev/shm"]):
            pytest.skip("/dev/shm is not a tmpfs here")
        path = f"/dev/shm/lmcache-fx-test-{uuid.uuid4().hex}"
    side = MPSide(path, max_capacity_gb=5.5 * chunk / (1 << 30))
    try:
        ad = side.adapter
        assert ad.supports_global_eviction
        deleted = _deleted_keys(ad)
        k1, d1, layout = MPSide.keys_and_data(n=4, seed=1)
        k2, d2, _ = MPSide.keys_and_data(n=4, seed=2)
        side.store(k1, d1, layout)
        side.store(k2, d2, layout)
        u = ad.get_usage()
        assert u.total_bytes_used == 5 * chunk and u.total_capacity_bytes == ad.options.max_capacity_bytes
        assert 0 < u.usage_fraction <= 1
        assert sorted(deleted, key=str) == sorted(k1[:3], key=str)  # LRU first, reported to listeners
        ad.delete([k2[0]])
        assert ad.get_usage().total_bytes_used == 4 * chunk and k2[0] in deleted
        assert ad.store.spare_bytes == (chunk if where == "shm" else 0)
        st = ad.report_status()
        assert st["is_healthy"] and st["evictions"] == 3 and st["chunks"] == 4
    finally:
        side.close()
        if where == "shm":
            shutil.rmtree(path, ignore_errors=True)


def _l2_side_of_five_chunks(tmp_path):
    """An MPSide whose fx store has room for 5.5 chunks (a sixth evicts),
    the list its L2 deletions are reported into, and a chunk file's bytes."""
    from lmcache_fx.core.chunkfile import HEADER_SIZE

    chunk = HEADER_SIZE + GEO.chunk * GEO.bytes_per_token
    side = MPSide(tmp_path / "store", max_capacity_gb=5.5 * chunk / (1 << 30))
    return side, _deleted_keys(side.adapter), chunk


def test_l2_reports_evictions_by_what_was_evicted_not_by_every_key(tmp_path, monkeypatch):
    """After the first eviction (which checks every key the adapter knows),
    an eviction asks only about the keys the evictor removed: work per
    eviction, not per chunk in the store. At most once per SWEEP_SECONDS
    every key is checked again, which finds what another process removed."""
    from lmcache_fx import l2_adapter
    from lmcache_fx.core.options import FxOptions
    from lmcache_fx.core.store import ChunkStore

    side, deleted, chunk = _l2_side_of_five_chunks(tmp_path)
    try:
        ad = side.adapter
        k1, d1, layout = MPSide.keys_and_data(n=4, seed=1)
        k2, d2, _ = MPSide.keys_and_data(n=4, seed=2)
        k3, d3, _ = MPSide.keys_and_data(n=4, seed=3)
        k4, d4, _ = MPSide.keys_and_data(n=2, seed=4)
        side.store(k1, d1, layout)
        side.store(k2, d2, layout)  # 5 fit: k1[0..2] evicted (the first eviction: every key checked)
        assert sorted(deleted, key=str) == sorted(k1[:3], key=str)
        asked = []
        real = ad.store.lookup
        monkeypatch.setattr(ad.store, "lookup", lambda keys, **kw: asked.extend(keys) or real(keys, **kw))
        side.store(k3, d3, layout)  # evicts k1[3], k2[0..2]; k2[3] stays and is not asked about
        gone = [k1[3], *k2[:3]]
        assert sorted(deleted[3:], key=str) == sorted(gone, key=str)
        assert set(asked) - {_ks(k) for k in k3} == {_ks(k) for k in gone}  # k3: the test's own wait
        # Another process removes one of k3; this adapter's next eviction after a sweep is due finds it.
        other = ChunkStore(FxOptions(path=str(tmp_path / "store")))
        try:
            assert other.remove(_ks(k3[0]))
        finally:
            other.close()
        monkeypatch.setattr(l2_adapter, "SWEEP_SECONDS", 0.0)
        ad._sweep_at = 0.0
        side.store(k4, d4, layout)  # 3 of k3 + 2 + k2[3]: evicts k2[3]
        assert k3[0] in deleted and k2[3] in deleted and len(deleted) == 9
        st = ad.report_status()
        assert st["chunks"] == 5 and ad.get_usage().total_bytes_used == 5 * chunk
    finally:
        side.close()


def test_l2_hears_of_another_process_evictions_without_evicting_itself(tmp_path, monkeypatch):
    """The sweep that finds what other processes removed ran only after an
    eviction of this process: an adapter that never evicted kept reporting
    those keys as stored (LMCache's eviction policy then chose them, freeing
    nothing). Where another process has the store open, the sweep runs
    after a store once SWEEP_SECONDS have passed, eviction or not."""
    from lmcache_fx import l2_adapter

    side, deleted, _ = _l2_side_of_five_chunks(tmp_path)
    ready, done = tmp_path / "ready", tmp_path / "done"
    other = None
    try:
        ad = side.adapter
        k1, d1, layout = MPSide.keys_and_data(n=2, seed=1)
        k2, d2, _ = MPSide.keys_and_data(n=1, seed=2)
        side.store(k1, d1, layout)  # 2 of 5.5 chunks: no eviction
        # Another process opens the store, removes k1[0] (as its evictor would) and keeps the store open.
        code = (
            "import os, sys, time\n"
            "from lmcache_fx.core.options import FxOptions\n"
            "from lmcache_fx.core.store import ChunkStore\n"
            "st = ChunkStore(FxOptions(path=sys.argv[1]))\n"
            "assert st.remove(sys.argv[2])\n"
            "open(sys.argv[3], 'w').close()\n"
            "while not os.path.exists(sys.argv[4]):\n"
            "    time.sleep(0.05)\n"
            "st.close()\n"
        )
        argv = [sys.executable, "-c", code, str(tmp_path / "store"), _ks(k1[0]), str(ready), str(done)]
        other = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 60
        while not ready.exists():
            assert other.poll() is None and time.monotonic() < end, other.stderr.read() if other.poll() else "slow"
            time.sleep(0.05)
        monkeypatch.setattr(l2_adapter, "SWEEP_SECONDS", 0.0)
        ad._sweep_at = 0.0
        assert ad.store.stats.snapshot()["evictions"] == 0
        side.store(k2, d2, layout)  # no eviction here either
        assert ad.store.stats.snapshot()["evictions"] == 0
        assert deleted == [k1[0]]
    finally:
        done.touch()
        if other is not None:
            other.wait(60)
        side.close()


def test_l2_key_deleted_during_an_eviction_report_is_reported_once(tmp_path, monkeypatch):
    """LMCache's eviction controller may delete() a key while the writer
    thread's eviction report is asking the store about the keys it copied:
    the key is then missing for both, and only the delete reports it (twice
    would take its bytes off LMCache's per-salt usage twice)."""
    side, deleted, _ = _l2_side_of_five_chunks(tmp_path)
    try:
        ad = side.adapter
        k1, d1, layout = MPSide.keys_and_data(n=4, seed=1)
        k2, d2, _ = MPSide.keys_and_data(n=2, seed=2)
        side.store(k1, d1, layout)
        real, raced = ad.store.lookup, []

        def lookup_after_a_delete(names, **kw):
            if not raced and _ks(k1[3]) in names:  # the report's lookup: the controller deletes k1[3] first
                raced.append(True)
                ad.delete([k1[3]])
            return real(names, **kw)

        monkeypatch.setattr(ad.store, "lookup", lookup_after_a_delete)
        side.store(k2, d2, layout)  # 6 > 5.5 chunks: the store evicts k1[0]; the report sweeps every key
        assert raced and deleted.count(k1[3]) == 1 and k1[0] in deleted
    finally:
        side.close()


def _l2_task(adapter, submit, result, efd, *args, timeout=60):
    import select

    tid = submit(*args)
    end = time.monotonic() + timeout
    while (r := result(tid)) is None:
        assert time.monotonic() < end, "L2 task not done"
        select.select([efd], [], [], 0.2)
    return r


def _l2_objects(n: int, nb: int, seed: int):
    """An arena of 2 x n chunks of nb bytes, the first n random; obj(i)
    (optionally of another dtype or shape) a TensorMemoryObj over chunk i; n
    ObjectKeys."""
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    arena = torch.zeros(2 * n * nb, dtype=torch.uint8)

    def obj(i, dtype=torch.uint8, shape=None):
        t = arena[i * nb : (i + 1) * nb].view(dtype)
        t = t if shape is None else t.view(*shape)
        meta = MemoryObjMetadata(
            shape=t.shape, dtype=dtype, address=i * nb, phy_size=nb, fmt=MemoryFormat.KV_2LTD, ref_count=1
        )
        return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)

    g = torch.Generator().manual_seed(seed)
    arena[: n * nb] = torch.randint(0, 256, (n * nb,), generator=g, dtype=torch.uint8)
    keys = [ObjectKey(chunk_hash=bytes([i + 1]) * 32, model_name="org/m", kv_rank=0) for i in range(n)]
    return arena, obj, keys


def _l2_store(ad, keys, objs):
    """One store task through the adapter, waited for; its L2StoreResult."""
    return _l2_task(
        ad, ad.submit_store_task, lambda t: ad.pop_completed_store_tasks().get(t), ad.get_store_event_fd(), keys, objs
    )


def _l2_load(ad, keys, objs, **kw):
    """One load task through the adapter, waited for; its Bitmap of hits."""
    return _l2_task(ad, ad.submit_load_task, ad.query_load_result, ad.get_load_event_fd(), keys, objs, **kw)


def test_l2_load_task_misses_only_the_bad_keys(tmp_path):
    """One load task is one engine batch for all its keys: a damaged chunk,
    a removed file, an unknown key and a destination of another dtype miss,
    each alone; every other key lands bit-exact in its own object."""
    from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig, object_key_string

    nb, n = 64 << 10, 8
    arena, obj, keys = _l2_objects(n, nb, 11)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    try:
        assert _l2_store(ad, keys[:7], [obj(i) for i in range(7)]).is_successful()
        damaged = ad.store.path_for(chunk_digest(object_key_string(keys[2])))
        with open(damaged, "r+b") as f:
            f.seek(HEADER_SIZE + 1000)
            b = f.read(1)
            f.seek(HEADER_SIZE + 1000)
            f.write(bytes([b[0] ^ 0x40]))
        os.unlink(ad.store.path_for(chunk_digest(object_key_string(keys[4]))))
        dst = [obj(n + i, torch.float16 if i == 5 else torch.uint8) for i in range(n)]
        bm = _l2_load(ad, keys, dst)  # key 7 was never stored
        assert bm.get_indices_list() == [0, 1, 3, 6]
        for i in (0, 1, 3, 4, 5, 6):  # 2 was read whole, then refused by its CRC
            same = torch.equal(arena[(n + i) * nb : (n + i + 1) * nb], arena[i * nb : (i + 1) * nb])
            assert same == (i in (0, 1, 3, 6)), i
        s = ad.store.stats.snapshot()
        assert s["corrupt"] == 1 and s["hits"] == 4
    finally:
        ad.close()


def test_l2_a_store_finished_while_lmcache_pops_the_results_is_not_lost(tmp_path, monkeypatch):
    """pop_completed_store_tasks swapped the results table for a new one;
    a store finishing then had taken the old table before the lock, and its
    result went into the table LMCache had just been handed: never returned,
    the task in LMCache's in-flight table for good and its L1 objects
    read-locked (a review: 2 of 3000 unpatched, and through LMCache's
    StorageManager). The moment is held open here by a slow result."""
    import lmcache_fx.l2_adapter as l2
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    real, inside, go = l2.L2StoreResult, threading.Event(), threading.Event()

    def held(*a, **kw):  # the finisher, its table in hand, before the lock
        inside.set()
        go.wait(30)
        return real(*a, **kw)

    nb = 64 << 10
    arena, obj, keys = _l2_objects(2, nb, 17)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    try:
        monkeypatch.setattr(l2, "L2StoreResult", held)
        tid = ad.submit_store_task(keys, [obj(0), obj(1)])
        assert inside.wait(60)
        # LMCache's controller, woken by another task's event, takes what is done and lets go of the table
        popped = dict(ad.pop_completed_store_tasks())
        go.set()
        end = time.monotonic() + 60
        while tid not in popped:
            assert time.monotonic() < end, "the store's result was never returned"
            select.select([ad.get_store_event_fd()], [], [], 0.2)
            popped.update(ad.pop_completed_store_tasks())
        assert popped[tid].is_successful()
    finally:
        go.set()
        ad.close()


def test_l2_chunks_of_another_dtype_warn_once_per_burst(tmp_path, caplog):
    """MP keys carry no dtype: after a KV dtype change every stored chunk meets
    an L1 object of another dtype, and each miss logged a warning (12 lines
    for one 12-key load). Now once per 5 s with a count."""
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 64 << 10, 12
    arena, obj, keys = _l2_objects(n, nb, 13)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    try:
        assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
        with caplog.at_level("WARNING", logger="lmcache_fx"):
            for _ in range(2):
                dst = [obj(n + i, torch.float16) for i in range(n)]
                bm = _l2_load(ad, keys, dst)
                assert bm.get_indices_list() == []
    finally:
        ad.close()
    said = [r.getMessage() for r in caplog.records if "stored chunk has dtypes" in r.getMessage()]
    assert len(said) == 1, said


def test_l2_a_chunk_stored_again_in_another_dtype_replaces_the_old_one(tmp_path):
    """MP keys carry no dtype. After a KV dtype change the stored chunk was a
    miss at load, and the recomputed KV stored under its key was skipped (the
    key was there) while the task said it succeeded: those prompts were never
    cached again (a review, through LMCache's StorageManager). A chunk read
    as another layout is written anew."""
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 64 << 10, 4
    arena, obj, keys = _l2_objects(n, nb, 19)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    try:
        assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()  # the old server's bf16 stand-in
        assert _l2_load(ad, keys, [obj(n + i, torch.float16) for i in range(n)]).get_indices_list() == []
        arena[n * nb :] = torch.randint(
            0, 256, (n * nb,), generator=torch.Generator().manual_seed(23), dtype=torch.uint8
        )
        new = arena[n * nb :].clone()
        r = _l2_store(ad, keys, [obj(n + i, torch.float16) for i in range(n)])  # the recomputed KV
        assert r.is_successful()
        arena[n * nb :] = 0
        assert _l2_load(ad, keys, [obj(n + i, torch.float16) for i in range(n)]).get_indices_list() == list(range(n))
        assert torch.equal(arena[n * nb :], new)
        # the same layout again is still a chunk already there: not written twice
        before = ad.store.stats.snapshot()["chunks_written"]
        assert _l2_store(ad, keys, [obj(n + i, torch.float16) for i in range(n)]).is_successful()
        assert ad.store.stats.snapshot()["chunks_written"] == before
    finally:
        ad.close()


def test_l2_a_chunk_written_anew_at_another_size_keeps_the_per_salt_bytes_true(tmp_path):
    """A chunk stored again after a KV dtype change of another size (bf16 to
    fp8: half the bytes) is written anew; the adapter told LMCache's
    listeners nothing of it, and its per-salt bytes kept the old size, then
    leaked the difference for good once the key was deleted (a read-back).
    The old size is reported gone and the new one stored."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    from lmcache_fx.core.chunkfile import HEADER_SIZE
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 64 << 10, 2
    arena, obj, keys = _l2_objects(n, nb, 29)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))

    def fp8(i):  # half of slot i's bytes, one byte an element
        t = arena[i * nb : i * nb + nb // 2].view(torch.float8_e4m3fn)
        meta = MemoryObjMetadata(
            shape=t.shape, dtype=t.dtype, address=i * nb, phy_size=nb // 2, fmt=MemoryFormat.KV_2LTD, ref_count=1
        )
        return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)

    def usage():
        u = ad.get_usage()
        return u.total_bytes_used, sum(u.bytes_by_cache_salt.values()), ad.store.used_bytes

    try:
        assert _l2_store(ad, keys, [obj(i, torch.bfloat16) for i in range(n)]).is_successful()
        assert usage() == (n * (HEADER_SIZE + nb),) * 3
        half = [fp8(n + i) for i in range(n)]
        assert _l2_load(ad, keys, half).get_indices_list() == []  # the bf16 chunks: a miss
        assert _l2_store(ad, keys, half).is_successful()
        assert _l2_load(ad, keys, half).get_indices_list() == list(range(n))
        assert usage() == (n * (HEADER_SIZE + nb // 2),) * 3
        ad.delete(keys)
        end = time.monotonic() + 30
        while usage() != (0, 0, 0):
            assert time.monotonic() < end, usage()
            time.sleep(0.05)
    finally:
        ad.close()


def test_l2_a_key_whose_file_is_gone_is_reported_deleted(tmp_path):
    """LMCache's eviction controller deletes the keys at the head of its LRU.
    A key this adapter had reported stored but whose file was gone by then
    (dropped as bad at a read, removed by another process or an operator)
    was not reported deleted: LMCache kept it, with its bytes per salt, and
    offered it again on every pass, each freeing nothing. delete() now
    reports it; and a lookup that misses a key reported stored reports it
    deleted at once."""
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig, object_key_string

    class Deleted(L2AdapterListener):
        def __init__(self):
            self.keys = []

        def on_l2_keys_stored(self, keys, sizes):
            pass

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            self.keys += keys

    nb, n = 64 << 10, 3
    arena, obj, keys = _l2_objects(n, nb, 23)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    try:
        heard = Deleted()
        ad.register_listener(heard)
        assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
        bad = ad.store.path_for(chunk_digest(object_key_string(keys[0])))
        with open(bad, "r+b") as f:  # a payload byte flipped: a load finds it bad and drops the file
            f.seek(HEADER_SIZE + 100)
            b = f.read(1)
            f.seek(HEADER_SIZE + 100)
            f.write(bytes([b[0] ^ 1]))
        assert _l2_load(ad, [keys[0]], [obj(n)]).get_indices_list() == []
        assert not os.path.exists(bad) and heard.keys == []
        ad.delete([keys[0]])
        assert heard.keys == [keys[0]]
        os.unlink(ad.store.path_for(chunk_digest(object_key_string(keys[1]))))  # removed behind its back
        lookup = (ad.submit_lookup_and_lock_task, ad.query_lookup_and_lock_result, ad.get_lookup_and_lock_event_fd())
        assert _l2_task(ad, *lookup, [keys[1]], {}).get_indices_list() == []
        end = time.monotonic() + 30
        while heard.keys != [keys[0], keys[1]]:  # the lookup that missed it tells LMCache
            assert time.monotonic() < end and heard.keys == [keys[0]], heard.keys
            time.sleep(0.02)
        assert sum(ad.get_usage().bytes_by_cache_salt.values()) == HEADER_SIZE + nb  # keys[2]'s alone
        ad.delete([keys[0], keys[1]])  # reported already: nothing more to say
        assert heard.keys == [keys[0], keys[1]]
    finally:
        ad.close()


def test_l2_a_task_whose_submit_found_no_thread_never_runs(tmp_path):
    """Where no thread can start (a container at its pids.max), the
    executor's submit raises with the task already queued: LMCache takes the
    task for failed, frees a load's buffers and never unlocks a lookup's
    keys, and the next thread that started ran it anyway: file bytes into
    freed buffers, chunks pinned for good. Such a task is now skipped."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import pids_limit

    parent = pids_limit.cgroup_parent()
    if parent is None:
        pytest.skip(pids_limit.SKIP_REASON)
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (
        pids_limit.CHILD_CODE
        + f"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
from test_entry_points import _l2_load, _l2_objects, _l2_store, _l2_task
from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

nb, n = 64 << 10, 4
arena, obj, keys = _l2_objects(n, nb, 31)
ad = FxL2Adapter(FxL2AdapterConfig.from_dict({{"path": {str(tmp_path / "s")!r}}}))
raised = []
assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
with no_task_to_spare({parent!r}):
    for submit in (lambda: ad.submit_lookup_and_lock_task(keys[:2], {{}}), lambda: ad.submit_load_task([keys[2]], [obj(n + 2)])):
        try:
            submit()
        except RuntimeError as e:
            raised.append(str(e))
# LMCache took both for failed: the load's buffer is free (here: still zero), the lookup's keys never unlocked.
bm = _l2_task(ad, ad.submit_lookup_and_lock_task, ad.query_lookup_and_lock_result, ad.get_lookup_and_lock_event_fd(), [keys[3]], {{}})
ad.submit_unlock([keys[3]])
got = _l2_load(ad, [keys[3]], [obj(n + 3)]).get_indices_list()
ad.close()
print(json.dumps({{"raised": raised, "hit": bm.get_indices_list(), "got": got,
    "untouched": bool((arena[(n + 2) * nb : (n + 3) * nb] == 0).all()), "pins": len(ad.store._pins),
    "in_flight": ad._in_flight}}))
"""
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tests)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(got["raised"]) == 2, got  # both submits found no thread
    assert got["hit"] == [0] and got["got"] == [0], got  # later tasks run as before
    assert got["untouched"], got  # the abandoned load wrote nothing
    assert got["pins"] == 0 and got["in_flight"] == 0, got  # nor did the abandoned lookup pin anything


def test_l2_after_a_restart_lmcaches_eviction_knows_the_chunks_already_stored(tmp_path):
    """After a restart over a full store, get_usage counted the last run's
    chunks but LMCache's L2 eviction policy knew none of them: with an
    `eviction` block, each pass of its controller deleted the newest chunks
    (the only ones it knew) and kept the old. The adapter now tells its
    listeners of the chunks already stored, least recently used first: the
    passes take the old chunks and keep the new."""
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.internal_api import L2AdapterListener
    from lmcache.v1.distributed.storage_controllers.eviction_controller import (
        L2AdapterEvictionState,
        L2EvictionController,
    )

    from lmcache_fx.core.chunkfile import HEADER_SIZE
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig, object_key_of, object_key_string

    class Stored(L2AdapterListener):
        def __init__(self):
            self.keys = []

        def on_l2_keys_stored(self, keys, sizes):
            assert all(n == HEADER_SIZE + nb for n in sizes)
            self.keys += keys

        def on_l2_keys_accessed(self, keys):
            pass

        def on_l2_keys_deleted(self, keys):
            pass

    nb, n = 64 << 10, 15
    arena, obj, keys = _l2_objects(n + 8, nb, 41)
    cfg = {"path": str(tmp_path / "s"), "max_capacity_gb": 16 * (HEADER_SIZE + nb) / (1 << 30)}
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict(cfg))
    try:
        for i in range(n):  # one at a time: each its own place in the LRU
            assert _l2_store(ad, keys[i : i + 1], [obj(i)]).is_successful()
    finally:
        ad.close()
    assert all(object_key_of(object_key_string(k)) == k for k in keys)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict(cfg))  # the server restarted
    try:
        ad.set_backend_identity("fx")
        heard = Stored()
        ad.register_listener(heard)
        state = L2AdapterEvictionState(
            0, ad, EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8, eviction_ratio=0.2)
        )
        end = time.monotonic() + 30
        while len(heard.keys) < n:
            assert time.monotonic() < end, heard.keys
            time.sleep(0.05)
        assert heard.keys == keys[:n]  # least recently used first
        late = Stored()
        ad.register_listener(late)  # registered after: hears of them at once
        assert sorted(late.keys, key=keys.index) == keys[:n]
        controller = L2EvictionController([state])  # its thread not started: one pass per round, here
        new = keys[n:]
        for r in range(0, len(new), 2):
            assert _l2_store(ad, new[r : r + 2], [obj(n + r), obj(n + r + 1)]).is_successful()
            controller._check_and_evict_global(state)  # the controller's once-a-second pass
        kept_new = sum(ad.store.lookup([object_key_string(k) for k in new]))
        assert kept_new == len(new), kept_new  # before: about half the new ones deleted
    finally:
        ad.close()


def test_l2_a_listener_that_raises_does_not_hold_a_load_task(tmp_path):
    """A listener raising in on_l2_keys_accessed left the load task unfinished
    for good (LMCache's prefetch waiting on it), with nothing logged."""
    from lmcache.v1.distributed.internal_api import L2AdapterListener

    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    class Raising(L2AdapterListener):
        def on_l2_keys_stored(self, keys, sizes):
            pass

        def on_l2_keys_accessed(self, keys):
            raise RuntimeError("listener accessed")

        def on_l2_keys_deleted(self, keys):
            pass

    nb, n = 64 << 10, 4
    arena, obj, keys = _l2_objects(n, nb, 17)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    try:
        assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
        ad.register_listener(Raising())
        bm = _l2_load(ad, keys, [obj(n + i) for i in range(n)], timeout=20)
        assert bm.popcount() == n and torch.equal(arena[n * nb :], arena[: n * nb])
        assert ad.report_status()["tasks_in_flight"] == 0
    finally:
        ad.close()


def test_l2_adapter_after_close_reports_unhealthy_and_refuses_tasks(tmp_path):
    """With its directory removed under it (every store skipped), the adapter
    reported itself healthy. After close(), report_status and get_usage raised AttributeError (the
    store's ledger is gone), though LMCache's status endpoint may ask then; a
    store task was given an id and never finished while lookups and loads
    raised."""
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 64 << 10, 2
    arena, obj, keys = _l2_objects(n, nb, 19)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
    assert ad.report_status()["is_healthy"] is True
    shutil.rmtree(tmp_path / "s")  # its directory gone: every store is skipped until a restart
    st = ad.report_status()
    assert st["is_healthy"] is False and "was removed, replaced or unmounted" in st["problem"], st
    ad.close()
    assert ad.report_status()["is_healthy"] is False and ad.get_usage().total_bytes_used == 0
    for call in (
        lambda: ad.submit_store_task(keys, [obj(i) for i in range(n)]),
        lambda: ad.submit_lookup_and_lock_task(keys, {}),
        lambda: ad.submit_load_task(keys, [obj(n + i) for i in range(n)]),
        lambda: ad.delete(keys),
    ):
        with pytest.raises(RuntimeError, match="L2 adapter .* is closed"):
            call()
    assert ad.report_status()["tasks_in_flight"] == 0


def test_l2_adapter_whose_stores_fail_reports_unhealthy_until_one_succeeds(tmp_path):
    """A store directory that cannot be written (made immutable here, as a
    read-only remount would): every store task failed, yet report_status
    said healthy with an empty problem. Four failed chunk stores in a row
    are a problem now; a store that writes clears it."""
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    if os.geteuid() != 0 or not shutil.which("chattr"):
        pytest.skip("needs root and chattr to make the store directory immutable")
    nb, n = 64 << 10, 4
    arena, obj, keys = _l2_objects(3 * n, nb, 23)
    store = tmp_path / "s"
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(store)}))
    try:
        assert _l2_store(ad, keys[:n], [obj(i) for i in range(n)]).is_successful()
        assert ad.report_status()["is_healthy"] is True
        if subprocess.run(["chattr", "-R", "+i", str(store)], capture_output=True).returncode != 0:
            pytest.skip(f"chattr +i is refused on {tmp_path}'s filesystem")
        try:
            assert not _l2_store(ad, keys[n : 2 * n], [obj(i) for i in range(n, 2 * n)]).is_successful()
            st = ad.report_status()
        finally:
            subprocess.run(["chattr", "-R", "-i", str(store)], check=True)
        assert st["is_healthy"] is False and "the last 4 chunk stores failed" in st["problem"], st
        assert _l2_store(ad, keys[2 * n :], [obj(i) for i in range(2 * n, 3 * n)]).is_successful()
        assert ad.report_status()["is_healthy"] is True
    finally:
        ad.close()


def test_l2_tasks_submitted_while_it_closes_finish_or_are_refused(tmp_path):
    """A lookup or load that passed the closed check just before close() met
    the shut-down thread pool: "cannot schedule new futures after shutdown",
    and tasks_in_flight stayed above 0 for good; a status asked meanwhile
    raised AttributeError. Each submit now either runs or is refused as
    closed, and a status during close says unhealthy."""
    import threading

    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 4096, 2
    arena, obj, keys = _l2_objects(n, nb, 23)
    for _ in range(5):
        ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
        assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
        said, stop = [], threading.Event()

        def hammer(ad=ad, said=said, stop=stop):
            while not stop.is_set():
                for call in (
                    lambda: ad.submit_lookup_and_lock_task(keys, {}),
                    lambda: ad.submit_load_task(keys, [obj(n + i) for i in range(n)]),
                    lambda: ad.report_status()["is_healthy"],
                ):
                    try:
                        call()
                    except RuntimeError as e:
                        said.append(str(e))
                    except Exception as e:  # noqa: BLE001 - what the test is for
                        said.append(f"UNEXPECTED {type(e).__name__}: {e}")

        t = threading.Thread(target=hammer)
        t.start()
        time.sleep(0.05)
        ad.close()
        stop.set()
        t.join()
        assert not [x for x in said if not x.endswith(" is closed")], said[:3]
        with ad._lock:
            assert ad._in_flight == 0


def test_l2_load_tasks_beyond_the_reader_threads_all_land_and_close_waits_for_them(tmp_path):
    """More one-key load tasks in flight than LOAD_THREADS: the later ones
    wait their turn; close() right after submitting lets every one finish
    (LMCache may free an L1 object once close returns), each bit-exact in its
    own object, each result there to collect."""
    from lmcache_fx import l2_adapter
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 256 << 10, 4 * l2_adapter.LOAD_THREADS + 3
    arena, obj, keys = _l2_objects(n, nb, 5)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
    tids = [ad.submit_load_task([keys[i]], [obj(n + i)]) for i in range(n)]
    ad.close()
    results = {t: ad.query_load_result(t) for t in tids}
    assert all(bm is not None and bm.get_indices_list() == [0] for bm in results.values()), results
    assert torch.equal(arena[n * nb :], arena[: n * nb])


def test_l2_store_tasks_waiting_are_written_together(tmp_path):
    """Store tasks that wait while the writer is busy are written as one
    store.write (one engine batch, parallel inside) when it comes round: a
    key in two of them is written once, and every task gets its own result;
    the chunks read back bit-exact."""
    import threading

    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 128 << 10, 12
    arena, obj, keys = _l2_objects(n, nb, 9)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    calls, go = [], threading.Event()
    write = ad.store.write

    def held_write(items):
        calls.append([it[0] for it in items])
        if len(calls) == 1:
            go.wait(30)  # the writer is busy: the other tasks queue meanwhile
        return write(items)

    ad.store.write = held_write
    try:
        tids = [ad.submit_store_task([keys[0]], [obj(0)])]
        while not calls:
            time.sleep(0.01)
        tids += [ad.submit_store_task([keys[i]], [obj(i)]) for i in range(1, n)]
        tids.append(ad.submit_store_task([keys[3], keys[5]], [obj(3), obj(5)]))  # keys of two other tasks
        go.set()
        results: dict = {}
        end = time.monotonic() + 60
        while len(results) < len(tids):
            results.update(ad.pop_completed_store_tasks())
            assert time.monotonic() < end, "store tasks not done"
            time.sleep(0.01)
        assert all(results[t].is_successful() for t in tids)
        assert len(calls) == 2 and len(calls[1]) == n - 1 == len(set(calls[1])), calls
        bm = _l2_load(ad, keys, [obj(n + i) for i in range(n)])
        assert bm.popcount() == n
        assert torch.equal(arena[n * nb :], arena[: n * nb])
    finally:
        go.set()
        ad.close()


@pytest.mark.parametrize(
    "params,needle",
    [
        ({"queue_dept": 8}, "did you mean 'adapter_params.queue_depth'"),
        ({"split_bytes": 5000}, "adapter_params.split_bytes"),
    ],
)
def test_l2_bad_option_is_refused_with_its_name(tmp_path, params, needle, caplog):
    with caplog.at_level("ERROR", logger="lmcache_fx"):
        with pytest.raises(ValueError, match=needle):  # ConfigError, raised while the server builds its adapters
            MPSide(tmp_path / "s", **params)
    # Said as one line of fx's own too: `lmcache server` buries the exception under a start-up traceback
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lmcache-fx: L2 adapter not started")]
    assert len(said) == 1 and needle in said[0], said


def _lmcache_cli():
    return os.path.join(os.path.dirname(sys.executable), "lmcache")


def test_lmcache_bench_l2_verifies(tmp_path):
    """LMCache's own L2 benchmark drives store / lookup / load and checks the
    data (--no-skip-verify)."""
    spec = json.dumps({**L2_JSON, "adapter_params": {"path": str(tmp_path / "b")}})
    r = subprocess.run(
        [
            _lmcache_cli(),
            "bench",
            "l2",
            "--l2-adapter",
            spec,
            "--num-keys",
            "16",
            "--rounds",
            "1",
            "--data-size-kb",
            "128",
            "--l1-align-bytes",
            "4096",
            "--lookup-max-hit-rate",
            "1.0",
            "--no-skip-verify",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "All 16 keys data verified OK" in out, out[-3000:]


def test_real_lmcache_server_loads_the_adapter(tmp_path):
    """`lmcache server` on CPU builds the adapter from --l2-adapter, shows its
    report_status, and closes it on SIGINT. (Nothing is stored: that needs an
    inference engine as the client.)"""
    import socket

    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()
    spec = json.dumps({**L2_JSON, "adapter_params": {"path": str(tmp_path / "srv")}})
    p = subprocess.Popen(
        [
            _lmcache_cli(),
            "server",
            "--l1-size-gb",
            "0.05",
            "--eviction-policy",
            "LRU",
            "--port",
            str(ports[0]),
            "--http-port",
            str(ports[1]),
            "--l2-adapter",
            spec,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    try:
        status, end = None, time.monotonic() + 120
        while status is None and time.monotonic() < end and p.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[1]}/status", timeout=2) as f:
                    status = json.load(f)
            except OSError:
                time.sleep(0.5)
        assert status is not None, "server did not come up"
        (l2,) = status["storage_manager"]["l2_adapters"]
        assert l2["type"] == "FxL2Adapter" and l2["is_healthy"] and l2["paths"] == [str(tmp_path / "srv")]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    assert p.returncode is not None and "FxL2Adapter" not in "".join(
        line for line in out.splitlines() if "Traceback" in line or "Error" in line
    ), out[-3000:]


if __name__ == "__main__":
    print("RESULT " + json.dumps(do_store(sys.argv[1], sys.argv[2], sys.argv[3])))


def test_direct_to_gpu_is_refused_outside_the_in_process_plugin():
    from lmcache_fx.core.options import ConfigError
    from lmcache_fx.l2_adapter import FxL2AdapterConfig

    with pytest.raises(ConfigError, match="direct_to_gpu: only the in-process storage plugin"):
        FxL2AdapterConfig.from_dict({"path": "/tmp/x", "direct_to_gpu": True, "verify": False})


def test_the_remote_plugin_refuses_cachegen_and_kivi_serde_naming_the_setting(tmp_path):
    """remote_serde: cachegen hands the remote connector CacheGen's bytes
    over immutable memory: every put failed ("underlying buffer is not
    writable", logged by LMCache) and nothing was stored. kivi (LMCache
    0.5.6) hands on the pool object without taking a reference: freed and
    reused while written, it stored another prompt's KV under the key. The
    connector raises at start for either, naming the setting and what to
    use; naive passes this check."""
    from lmcache.v1.storage_backend.naive_serde.kivi_serde import KIVISerializer
    from lmcache.v1.storage_backend.naive_serde.naive_serde import NaiveSerializer

    from lmcache_fx.core.options import ConfigError
    from lmcache_fx.remote_plugin import FxRemoteConnector

    class Obj:  # what the serializers are handed: a pool object counting its references
        ref_count = 1

        def ref_count_up(self):
            self.ref_count += 1

    # What the refusal rests on, in the LMCache installed: naive takes a reference, kivi none.
    assert NaiveSerializer().serialize(Obj()).ref_count == 2
    assert KIVISerializer().serialize(Obj()).ref_count == 1
    for serde, why in (("cachegen", "compressed bytes"), ("kivi", "takes no reference")):
        cfg = config_from_dict({**remote_config(tmp_path / "s"), "remote_serde": serde}, tmp_path)
        with pytest.raises(ConfigError, match=f"remote_serde: {serde} .*{why}.* set remote_serde: naive"):
            FxRemoteConnector(config=cfg)
    cfg = config_from_dict({**remote_config(tmp_path / "s"), "remote_serde": "naive"}, tmp_path)
    with pytest.raises(ConfigError, match="needs LMCache's LocalCPUBackend"):  # past the serde check
        FxRemoteConnector(config=cfg)


CLOSE_WITH_QUEUED_STORES = """
import os, sys, time
sys.path.insert(0, {tests!r})
os.environ["LMCACHE_TRACK_USAGE"] = "false"
import torch
from test_entry_points import GEO, backend_of, engine_config, fx_store_of
from lmcache_fx.testing.cpu_engine import KV, lmcache_engine, retrieve

entry, path, work = {entry!r}, {path!r}, {work!r}
n = 24 * GEO.chunk
tokens, kv = torch.arange(n) % 5000, KV(GEO, n, seed=3)
with lmcache_engine(engine_config(entry, path, work), GEO) as eng:
    st = fx_store_of(backend_of(eng, entry))
    write = st.write

    started = []

    def slow_write(items):  # a slow device: the writes are still queued when LMCache closes
        started.append(len(items))
        time.sleep(0.3)
        return write(items)

    st.write = slow_write
    eng.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
    # the remote plugin refuses puts LMCache had not started when its CPU
    # tier closed; wait until one write is under way so the count below
    # tests the shutdown wait, not the scheduler
    deadline = time.monotonic() + 60
    while not started and time.monotonic() < deadline:
        time.sleep(0.01)
# LMCache destroyed: its CPU pool is freed by now
with lmcache_engine(engine_config(entry, path, work), GEO) as eng:
    got = kv.empty_like()
    hit = retrieve(eng, tokens, got)
    print("RESULT", len(fx_store_of(backend_of(eng, entry))), hit, kv.tokens_equal(got, hit) if hit else None)
"""


@pytest.mark.parametrize("entry", ["plugin", "remote"])
def test_close_with_stores_queued_writes_them_before_lmcache_frees_its_pool(tmp_path, entry):
    """LMCache closes its CPU tier (freeing the pool stores are written from)
    before the plugin's own close: stores still queued then read freed memory
    (the process died of SIGSEGV). The plugins finish them first; the
    in-process plugin writes every store LMCache handed it, the remote one
    every put that started (a put LMCache starts after that is refused, with
    a warning); what is on disk reads back bit-exact."""
    code = CLOSE_WITH_QUEUED_STORES.format(
        tests=os.path.dirname(os.path.abspath(__file__)), entry=entry, path=str(tmp_path / "s"), work=str(tmp_path)
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, (r.returncode, r.stderr[-3000:])
    chunks, hit, equal = line[-1].split()[1:]
    assert int(chunks) >= 1 and int(hit) == int(chunks) * GEO.chunk and equal == "True"
    if entry == "plugin":
        assert int(chunks) == 24


REMOTE_POOL_FREED_AFTER_READS = """
import os, sys, time
sys.path.insert(0, {tests!r})
import torch
from faults import fxfault as F
from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, lmcache_engine
from test_entry_points import backend_of, fx_store_of, remote_config

work = {work!r}
geo = Geometry(layers=32, kv_heads=8, head_dim=128)  # 32 MiB chunks
ntok = 8 * geo.chunk
d = remote_config(os.path.join(work, "s"), cpu_gb=0.4)
d["chunk_size"] = geo.chunk
with lmcache_engine(config_from_dict(d, work), geo) as eng:
    be = backend_of(eng, "remote")
    st, conn = fx_store_of(be), be.connection.getWrappedConnector()
    tokens, kv = torch.arange(ntok), KV(geo, ntok, seed=2)
    eng.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
    end = time.monotonic() + 120
    while len(st) < 8 or conn.pending_puts():
        assert time.monotonic() < end, "remote puts still pending"
        time.sleep(0.01)
    keys = [k for _, _, k in eng.token_database.process_tokens(tokens=tokens)]
    print("RESULT", F.close_lmcache_during_a_read(eng, be, st.engine, keys) or "none", flush=True)
    os._exit(0)  # the engine's own teardown would close its storage manager again
"""


def test_remote_plugin_lets_lmcache_free_its_pool_only_after_reads_into_it_end(tmp_path):
    """The remote form of the plugin's test (tests/test_plugin.py): LMCache
    frees its CPU pool before the connector's close, and an async load still
    reading into the pool wrote into freed memory. The connector's hook that
    runs before the pool is freed waits for its reads in flight: seen from
    the pool's close, no batch of its engine is running or queued."""
    code = REMOTE_POOL_FREED_AFTER_READS.format(tests=os.path.dirname(os.path.abspath(__file__)), work=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, (r.returncode, r.stderr[-3000:])
    if line[-1] == "RESULT none":
        pytest.skip("no read was still in flight when the pool closed (the medium is too fast here)")
    assert line[-1] == "RESULT [0]"


def test_remote_plugin_and_l2_adapter_serve_their_metrics(tmp_path):
    """metrics_port and metrics_addr were accepted by the remote plugin and
    the L2 adapter and then ignored (their stores were in no /metrics at
    all). Both now serve them like the in-process plugin: on the port, and
    in prometheus_client's global REGISTRY (LMCache's /metrics)."""
    import socket

    from prometheus_client import REGISTRY, generate_latest

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def scrape(port):
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    port = free_port()
    with lmcache_engine(engine_config("remote", tmp_path / "r", tmp_path, metrics_port=port), GEO) as eng:
        store_engine(eng, "remote", torch.arange(NTOK), KV(GEO, NTOK, seed=2))
        page = scrape(port)
        assert 'store="remote-fx"' in page and "lmcache_fx_written_chunks_total" in page
        assert 'store="remote-fx"' in generate_latest(REGISTRY).decode()
    port = free_port()
    side = MPSide(tmp_path / "l2", metrics_port=port)
    try:
        keys, data, layout = MPSide.keys_and_data(seed=4)
        side.store(keys, data, layout)
        page = scrape(port)
        assert 'store="l2"' in page and "lmcache_fx_written_chunks_total" in page
    finally:
        side.close()
    assert 'store="l2"' not in generate_latest(REGISTRY).decode()  # taken out at close


def _engine_script(code: str, *args) -> tuple[dict, str]:
    """Runs `code` (an engine scenario) in a process of its own, so that a
    hang fails the test instead of stopping the run; its last stdout line
    as JSON, and its stderr."""
    r = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], env=_env(), capture_output=True, text=True, timeout=180
    )
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


_SMALL_POOL = """
import json, sys, threading, time
import torch
from test_entry_points import GEO, backend_of, engine_config, fx_store_of, store_engine
from lmcache_fx.testing.cpu_engine import KV, config_from_dict, fx_config, lmcache_engine, retrieve
entry, store, work, local_cpu = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
n = 8 * GEO.chunk
tokens, kv = torch.arange(n) % 5000, KV(GEO, n, seed=7)
with lmcache_engine(engine_config(entry, store, work), GEO) as eng:
    store_engine(eng, entry, tokens, kv)
cfg = fx_config(store, cpu_gb=0.0006, local_cpu=local_cpu) if entry == "plugin" else None
if cfg is None:
    from test_entry_points import remote_config
    cfg = remote_config(store, cpu_gb=0.0006)
with lmcache_engine(config_from_dict(cfg, work), GEO) as eng:
    got, res = kv.empty_like(), {}
    th = threading.Thread(target=lambda: res.setdefault("n", retrieve(eng, tokens, got)), daemon=True)
    th.start()
    th.join(60)
    if th.is_alive():
        print(json.dumps({"hung": True}), flush=True)
        import os
        os._exit(3)
    alloc = eng.storage_manager.storage_backends["LocalCPUBackend"].get_memory_allocator()
    alloc = getattr(alloc, "pin_allocator", alloc)
    print(json.dumps({"tokens": res["n"], "equal": kv.tokens_equal(got, res["n"]),
                      "held": alloc.num_active_allocations}), flush=True)
"""


@pytest.mark.parametrize("entry,local_cpu", [("plugin", False), ("plugin", True), ("remote", False)])
def test_a_hit_prefix_larger_than_lmcaches_pool_loads_what_fits(tmp_path, entry, local_cpu):
    """A cached prompt of more chunks than LMCache's CPU pool holds (8 stored,
    room for 2): the plugin's blocking read waited in LMCache's busy loop for
    room its own earlier chunks held, and the retrieve never returned. Only a
    destination taken while the read holds none may wait now: the prefix
    that fits is loaded, bit-exact, and the pool is given back."""
    out, _ = _engine_script(_SMALL_POOL, entry, tmp_path / "store", tmp_path, "1" if local_cpu else "0")
    assert out.get("hung") is None, "the retrieve never returned"
    assert 0 < out["tokens"] < 8 * GEO.chunk and out["tokens"] % GEO.chunk == 0, out
    assert out["equal"] and out["held"] == 0, out


def test_l2_a_chunk_of_the_same_bytes_in_other_shapes_is_a_miss(tmp_path, caplog):
    """MP keys carry no layout: a server whose L1 objects for the same keys
    have other shapes of the same dtype and bytes (a KV layout change) got
    every chunk as a hit, its tensors scrambled. Each is a miss now, with a
    warning that names both shapes."""
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    nb, n = 64 << 10, 3
    arena, obj, keys = _l2_objects(n, nb, 5)
    ad = FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(tmp_path / "s")}))
    try:
        assert _l2_store(ad, keys, [obj(i) for i in range(n)]).is_successful()
        with caplog.at_level("WARNING", logger="lmcache_fx"):
            bm = _l2_load(ad, keys, [obj(n + i, shape=(2, nb // 2)) if i else obj(n + i) for i in range(n)])
        assert bm.get_indices_list() == [0]  # the one of its own shape still loads
        assert not arena[(n + 1) * nb :].any()  # nothing landed in the others
        assert any("shapes ((65536,),)" in r.getMessage() and "(2, 32768)" in r.getMessage() for r in caplog.records)
    finally:
        ad.close()


_OTHER_GEOMETRY = """
import json, sys
import torch
from test_entry_points import GEO, backend_of, engine_config, store_engine
from lmcache_fx.testing.cpu_engine import KV, Geometry, lmcache_engine, retrieve
entry, store, work, layers, heads, head_dim = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7])
n = 4 * GEO.chunk
tokens = torch.arange(n) % 5000
with lmcache_engine(engine_config(entry, store, work), GEO) as eng:
    store_engine(eng, entry, tokens, KV(GEO, n, seed=7))
other = Geometry(layers=layers, kv_heads=heads, head_dim=head_dim, dtype=GEO.dtype)
with lmcache_engine(engine_config(entry, store, work), other) as eng:
    kv = KV(other, n, seed=9)
    got = kv.empty_like()
    try:
        hit = retrieve(eng, tokens, got)
    except Exception as e:
        print(json.dumps({"raised": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        sys.exit(0)
    alloc = eng.storage_manager.storage_backends["LocalCPUBackend"].get_memory_allocator()
    alloc = getattr(alloc, "pin_allocator", alloc)
    written = sum(int((c != 0).sum()) for c in got.caches)
    print(json.dumps({"tokens": hit, "written": written, "held": alloc.num_active_allocations}), flush=True)
"""


@pytest.mark.parametrize("entry", ["plugin", "remote"])
@pytest.mark.parametrize("layers,heads,head_dim", [(1, 4, 64), (4, 2, 64), (2, 1, 128)])
def test_chunks_of_another_models_geometry_under_one_model_name_are_misses(tmp_path, entry, layers, heads, head_dim):
    """Keys carry the model name, not the KV geometry: a model of other layers
    and heads served under the same name (both at /model) met the first
    one's chunks, and fx handed LMCache tensors of their shapes: its
    retrieve raised (IndexError, a shape mismatch), and on a GPU the same
    bytes in another layout could have been scattered. Such chunks are
    misses now, checked against LMCacheMetadata's shapes for their tokens.
    A model of 1 KV head of 128 where the first had 2 of 64 makes the same
    KV_2LTD shapes, and was served the first one's KV (a review); the
    plugins record the writer's KV heads and head size, and hold chunks to
    them."""
    out, err = _engine_script(_OTHER_GEOMETRY, entry, tmp_path / "store", tmp_path, layers, heads, head_dim)
    assert out == {"tokens": 0, "written": 0, "held": 0}, out
    assert "this engine's KV cache makes" in err


_STUCK = """
import json, sys, time
import torch
from faults import fxfault as F
from test_entry_points import GEO, backend_of, engine_config, fx_store_of, store_engine
from lmcache_fx.core.chunkfile import chunk_digest
from lmcache_fx.testing.cpu_engine import KV, Geometry, lmcache_engine, retrieve
entry, store, work, case = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
n = 4 * GEO.chunk
tokens = torch.arange(n) % 5000
with lmcache_engine(engine_config(entry, store, work), GEO) as eng:
    store_engine(eng, entry, tokens, KV(GEO, n, seed=7))
    keys = [k for _, _, k in eng.token_database.process_tokens(tokens=tokens)]
    victim = fx_store_of(backend_of(eng, entry)).path_for(chunk_digest(keys[1].to_string()))
geo = GEO
if case == "version":  # chunk 1 written by a newer lmcache-fx
    F.set_format_version(victim)
else:  # another model of other layers under the same model name
    geo = Geometry(layers=4, kv_heads=GEO.kv_heads, head_dim=GEO.head_dim, dtype=GEO.dtype)
rounds = []
with lmcache_engine(engine_config(entry, store, work), geo) as eng:
    be = backend_of(eng, entry)
    st = fx_store_of(be)
    kv = KV(geo, n, seed=9 if case == "geometry" else 7)
    for r in range(3):
        found = eng.lookup(tokens)
        got = kv.empty_like()
        hit = retrieve(eng, tokens, got)
        ok = kv.tokens_equal(got, hit)
        # vLLM's adapter stores past the hits the lookup told it of (num_saved_tokens)
        mask = torch.ones(n, dtype=torch.bool)
        mask[:found] = False
        before = st.stats.snapshot().get("chunks_written", 0)
        if found < n:
            eng.store(tokens, mask=mask, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
            if entry == "plugin":
                be.flush(30)
            else:
                conn, end = be.connection.getWrappedConnector(), time.monotonic() + 30
                time.sleep(0.2)
                while conn.pending_puts() and time.monotonic() < end:
                    time.sleep(0.01)
        rounds.append([found, hit, ok, st.stats.snapshot().get("chunks_written", 0) - before])
    print(json.dumps({"rounds": rounds, "pins": len(st._pins)}), flush=True)
"""


@pytest.mark.parametrize("entry", ["plugin", "remote"])
@pytest.mark.parametrize("case", ["version", "geometry"])
def test_a_chunk_every_read_refuses_is_no_hit_and_is_stored_again(tmp_path, entry, case):
    """A chunk file of another format version (a newer lmcache-fx beside this
    one), or of another model's shape under the same model name, was found by
    every lookup and refused by every read; a caller storing past the hits it
    was told of (vLLM's adapter) never stored it again, and a store of it was
    skipped as already there: the prompt loaded a shorter prefix than the
    lookup said, for good (a review, through LMCache's engine on CPU). After
    the first refusal lookups answer as the read would, the store writes it
    anew, and the next round loads the whole prompt."""
    out, err = _engine_script(_STUCK, entry, tmp_path / "store", tmp_path, case)
    (f1, h1, ok1, _), (f2, h2, ok2, w2), (f3, h3, ok3, w3) = out["rounds"]
    n = 4 * GEO.chunk
    want = GEO.chunk if case == "version" else 0  # the prefix before the refused chunk
    assert (f1, h1, ok1) == (n, want, True), out
    # stored again: the refused chunk, or (another model) every chunk, whose headers the read saw
    assert f2 == want and h2 == want and w2 == (1 if case == "version" else 4), out
    assert (f3, h3, ok3, w3) == (n, n, True, 0), out
    assert out["pins"] == 0, out


_REPLACED_UNDER_A_CONSUMER = """
import glob, json, os, shutil, sys
import torch
from faults import fxfault as F
from test_entry_points import GEO, backend_of, engine_config, fx_store_of, store_engine
from lmcache_fx.testing.cpu_engine import KV, Geometry, lmcache_engine, retrieve
entry, store, work, case = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
n = 4 * GEO.chunk
tokens = torch.arange(n) % 5000
mine = GEO if case == "version" else Geometry(layers=4, kv_heads=GEO.kv_heads, head_dim=GEO.head_dim, dtype=GEO.dtype)
good = os.path.join(work, "good")
with lmcache_engine(engine_config(entry, good, work), mine) as eng:  # the chunks the consumer can use
    store_engine(eng, entry, tokens, KV(mine, n, seed=7))
with lmcache_engine(engine_config(entry, store, work), GEO) as eng:  # the ones it meets first
    store_engine(eng, entry, tokens, KV(GEO, n, seed=7))
if case == "version":  # every chunk a newer lmcache-fx's
    for path in glob.glob(os.path.join(store, "*", "*.fxkv")):
        F.set_format_version(path)
kv = KV(mine, n, seed=7)
rounds = []
with lmcache_engine(engine_config(entry, store, work), mine) as eng:  # a consumer: it never stores
    got = kv.empty_like()
    rounds.append([eng.lookup(tokens), retrieve(eng, tokens, got)])
    for path in glob.glob(os.path.join(good, "*", "*.fxkv")):  # another writer puts usable chunks in place
        place = os.path.join(store, os.path.relpath(path, good))
        shutil.copyfile(path, place + ".new")
        os.replace(place + ".new", place)
    for _ in range(2):
        got = kv.empty_like()
        hit = retrieve(eng, tokens, got)
        rounds.append([eng.lookup(tokens), hit, kv.tokens_equal(got, hit)])
print(json.dumps({"rounds": rounds}), flush=True)
"""


@pytest.mark.parametrize("entry", ["plugin", "remote"])
@pytest.mark.parametrize("case", ["version", "geometry"])
def test_a_chunk_refused_then_stored_anew_by_another_process_is_found_again(tmp_path, entry, case):
    """Lookups answer from what a read learnt of a chunk (another format
    version, another model's shape); when another process then stored a
    usable chunk in its place, a process that never stores (a consumer, a
    decode instance) kept missing it, its entry still flagged (a read-back).
    A lookup that finds another file in the place forgets what was read."""
    out, err = _engine_script(_REPLACED_UNDER_A_CONSUMER, entry, tmp_path / "store", tmp_path, case)
    n = 4 * GEO.chunk
    assert out["rounds"][0] == [n, 0], out  # found, then refused by the read
    assert out["rounds"][1:] == [[n, n, True]] * 2, out


# An engine whose LMCache pool has room for six 1 MiB chunks, as `eng`, its fx backend as `be`.
_POOL_OF_SIX = """
import json, os, sys, threading, time
import torch
from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, fx_backend, fx_config, lmcache_engine
from lmcache_fx.testing.cpu_engine import retrieve, store_and_wait
work = sys.argv[1]
geo = Geometry(layers=8)  # 1 MiB chunks
cfg = config_from_dict(fx_config(os.path.join(work, "s"), cpu_gb=0.0065), work)  # room for 6
with lmcache_engine(cfg, geo) as eng:
    be = fx_backend(eng)
"""

_CONCURRENT_READS = (
    _POOL_OF_SIX
    + """
    cpu = be.local_cpu_backend
    reqs = [(torch.arange(1024) + 50000 * i, KV(geo, 1024, seed=i)) for i in range(3)]
    for t, kv in reqs:
        store_and_wait(eng, t, kv, be)
    one, many = cpu.allocate, cpu.memory_allocator.batched_allocate

    def slow(f):
        def g(*a, **k):
            o = f(*a, **k)
            time.sleep(0.05)  # the three reads' allocations interleave
            return o
        return g

    cpu.allocate, cpu.memory_allocator.batched_allocate = slow(one), slow(many)
    res = {}

    def run(i, t, kv):
        got = kv.empty_like()
        n = retrieve(eng, t, got)
        res[i] = [n, kv.tokens_equal(got, n)]

    ths = [threading.Thread(target=run, args=(i, t, kv), daemon=True) for i, (t, kv) in enumerate(reqs)]
    for th in ths:
        th.start()
        time.sleep(0.01)
    for th in ths:
        th.join(60)
    alloc = cpu.get_memory_allocator()
    alloc = getattr(alloc, "pin_allocator", alloc)
    print(json.dumps({"hung": sum(th.is_alive() for th in ths), "res": res, "held": alloc.num_active_allocations}))
    sys.stdout.flush()
    os._exit(0)
"""
)


def test_concurrent_blocking_retrieves_never_wait_on_each_other(tmp_path):
    """Three blocking retrieves of 4 chunks each into a pool of 6: a read
    that held some of the pool and waited in LMCache's busy loop for more
    could wait on another read doing the same, for good. Only a read that
    holds none waits there now; every retrieve returns, each a bit-exact
    prefix, and the pool is given back."""
    out, err = _engine_script(_CONCURRENT_READS, tmp_path)
    assert out["hung"] == 0, err[-3000:]
    assert len(out["res"]) == 3 and all(n > 0 and equal for n, equal in out["res"].values()), out
    assert out["held"] == 0, out


_READ_AFTER_STORES = (
    _POOL_OF_SIX
    + """
    a, b = [(torch.arange(1024) + 50000 * i, KV(geo, 1024, seed=i)) for i in range(2)]
    store_and_wait(eng, a[0], a[1], be)
    write = be.store.write

    def slow_write(items):
        time.sleep(0.5)  # B's objects stay queued, holding 4 of the pool's 6 chunks, while A is read
        return write(items)

    be.store.write = slow_write
    eng.store(b[0], kvcaches=b[1].caches, slot_mapping=b[1].slot_mapping)
    got = a[1].empty_like()
    n = retrieve(eng, a[0], got)
    be.flush(30)
    print(json.dumps({"tokens": n, "equal": a[1].tokens_equal(got, n)}))
    sys.stdout.flush()
    os._exit(0)
"""
)


_REMOTE_READ_AFTER_STORES = """
import json, os, sys, time
import torch
from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, lmcache_engine, retrieve
from test_entry_points import backend_of, fx_store_of, remote_config
work = sys.argv[1]
geo = Geometry(layers=8)  # 1 MiB chunks
cfg = config_from_dict(remote_config(os.path.join(work, "s"), cpu_gb=0.0065), work)  # room for 6
with lmcache_engine(cfg, geo) as eng:
    be = backend_of(eng, "remote")
    st, conn = fx_store_of(be), be.connection.getWrappedConnector()

    def stored(n):
        end = time.monotonic() + 60
        while (len(st) < n or conn.pending_puts()) and time.monotonic() < end:
            time.sleep(0.01)

    a, b = [(torch.arange(1024) + 50000 * i, KV(geo, 1024, seed=i)) for i in range(2)]
    eng.store(a[0], kvcaches=a[1].caches, slot_mapping=a[1].slot_mapping)
    stored(4)
    write = st.write

    def slow_write(items):
        time.sleep(0.5)  # B's objects stay held, 4 of the pool's 6 chunks, while A is read
        return write(items)

    st.write = slow_write
    eng.store(b[0], kvcaches=b[1].caches, slot_mapping=b[1].slot_mapping)
    time.sleep(0.05)  # B's put under way
    got = a[1].empty_like()
    n = retrieve(eng, a[0], got)
    stored(8)
    print(json.dumps({"tokens": n, "equal": a[1].tokens_equal(got, n)}))
    sys.stdout.flush()
    os._exit(0)
"""


def test_stores_reaching_the_plugin_during_its_close_are_refused_without_holding_the_pool(tmp_path):
    """LMCache's close_backend / recreate_backend close the plugin while the
    worker still stores through it. A store taken after close() was queued
    behind the writer's end: never written, its objects' references never
    dropped, the CPU pool running out (the review's script: 39 of 77 racing
    puts held, the whole pool in five trials). Stores after close are
    refused without a reference; those before it are written; lookups after
    it answer no hit (the read would miss)."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    from lmcache_fx.testing.cpu_engine import fx_backend

    geo = Geometry(layers=2, kv_heads=2, head_dim=64, dtype=torch.bfloat16, chunk=256)
    cfg = config_from_dict(fx_config(tmp_path / "s", cpu_gb=0.05), tmp_path)
    with lmcache_engine(cfg, geo) as eng:
        be, cpu = fx_backend(eng), eng.storage_manager.storage_backends["LocalCPUBackend"]
        shape = [torch.Size([2, geo.layers, geo.chunk, geo.kv_heads * geo.head_dim])]

        def put(i):  # what StorageManager.batched_put does with a plugin: submit, then drop its reference
            o = cpu.allocate(shape, [torch.bfloat16], fmt=MemoryFormat.KV_2LTD, busy_loop=False)
            key = CacheEngineKey("fx-test-model", 1, 0, 1000 + i, torch.bfloat16)
            be.batched_submit_put_task([key], [o])
            o.ref_count_down()
            return key, o

        objs, stop = [], threading.Event()

        def putter():
            i = 0
            while not stop.is_set() and i < 300:
                objs.append(put(i))
                i += 1
                time.sleep(0.001)

        t = threading.Thread(target=putter)
        t.start()
        time.sleep(0.05)
        be.close()
        time.sleep(0.05)
        stop.set()
        t.join()
        late_key, late = put(10_000)
        held = [o for _, o in objs + [(late_key, late)] if o.get_ref_count() > 0]
        assert held == [] and not be.exists_in_put_tasks(late_key), len(held)
        assert len(be._writes) == 0  # nothing left behind the writer's end
        written = [k for k, _ in objs if be.store.contains(k.to_string())]
        assert written and not be.contains(written[0]) and be.batched_contains(written[:1]) == 0


def test_a_remote_read_right_after_stores_waits_for_them_to_give_the_pool_back(tmp_path):
    """The remote plugin's read found LMCache's pool taken by this
    connector's puts still being written (LMCache holds a put's objects
    until its batched_put returns), and the chunks stored before missed
    (512 of 1024 tokens in the review's script). It waits for its puts,
    bounded, and reads the rest: the whole prefix, exact."""
    out, err = _engine_script(_REMOTE_READ_AFTER_STORES, tmp_path)
    assert out == {"tokens": 1024, "equal": True}, (out, err[-2000:])


def test_a_read_right_after_stores_waits_for_them_to_give_the_pool_back(tmp_path):
    """A read that holds some of the pool does not wait in LMCache's busy
    loop; finding no room while this plugin's stores are queued (their
    objects hold the pool until written), it waits for them, bounded, and
    loads the whole prefix instead of missing all but what was free."""
    out, err = _engine_script(_READ_AFTER_STORES, tmp_path)
    assert out == {"tokens": 1024, "equal": True}, (out, err[-2000:])


def test_a_remote_put_whose_writer_thread_cannot_start_neither_hangs_close_nor_writes_later(tmp_path, monkeypatch):
    """The remote plugin counted a put's write before handing it to its
    writer thread; where that thread could not be started (a pids limit),
    the write stayed queued, counted for good: LMCache's close (which waits
    for the counted writes before it frees its pool) hung, and once a later
    put started the thread the stale write stored whatever the pool then
    held under the first prompt's keys: full hits with another prompt's KV
    (a review). The put gives up its write now, which never runs."""
    cfg = config_from_dict(remote_config(tmp_path / "s"), tmp_path)
    first, second = torch.randint(0, 30000, (NTOK,)), torch.randint(0, 30000, (NTOK,))
    kv1, kv2 = KV(GEO, NTOK, seed=2), KV(GEO, NTOK, seed=5)
    real_start = threading.Thread.start

    def start(self):
        if self.name.startswith("lmcache-fx-remote-writer"):
            raise RuntimeError("can't start new thread")
        return real_start(self)

    with lmcache_engine(cfg, GEO) as eng:
        be = backend_of(eng, "remote")
        conn = be.connection.getWrappedConnector()
        monkeypatch.setattr(threading.Thread, "start", start)
        eng.store(first, kvcaches=kv1.caches, slot_mapping=kv1.slot_mapping)
        time.sleep(0.5)  # LMCache's put of it has given up
        assert conn.pending_puts() == 0 and conn._writes_queued == 0  # before: 1 queued for good
        monkeypatch.setattr(threading.Thread, "start", real_start)
        eng.store(second, kvcaches=kv2.caches, slot_mapping=kv2.slot_mapping)  # the writer thread starts now
        end = time.monotonic() + 30
        while (conn._writes_queued or conn.pending_puts()) and time.monotonic() < end:
            time.sleep(0.02)
        got = kv1.empty_like()
        n = retrieve(eng, first, got)
        assert n == 0 or kv1.tokens_equal(got, n)  # before: all 1024 hit, with the second prompt's KV
        closing = threading.Thread(target=conn._finish_puts, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive()  # LMCache's pool close went on


def test_a_cancelled_remote_put_never_writes_after_it_returns_and_never_hangs_close(tmp_path, monkeypatch):
    """LMCache holds a put's objects until its batched_put returns. A put
    cancelled (a caller's timeout; LMCache 0.5.6 cancels none) while its
    write waited behind another cancelled the write's executor job: the
    write never ran, its count never came back, and _finish_puts (LMCache's
    pool close) waited for good (a review); one cancelled while its write
    ran returned at once, the write still reading the objects. Now a write
    not begun is given up, and a put whose write runs returns after it."""
    import asyncio

    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    cfg = config_from_dict(remote_config(tmp_path / "s"), tmp_path)
    with lmcache_engine(cfg, GEO) as eng:
        be = backend_of(eng, "remote")
        conn = be.connection.getWrappedConnector()
        cpu = conn.local_cpu_backend
        write, spans = conn.store.write, []

        def slow(items):
            t = time.monotonic()
            try:
                return (time.sleep(0.5), write(items))[1]
            finally:
                spans.append((t, time.monotonic()))

        monkeypatch.setattr(conn.store, "write", slow)
        shape = torch.Size([2, 2, 256, 128])
        objs = [cpu.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD) for _ in range(2)]
        key = [CacheEngineKey("m", 1, 0, h, torch.bfloat16) for h in (1, 2)]
        running = asyncio.run_coroutine_threadsafe(conn.batched_put([key[0]], [objs[0]]), be.loop)
        queued = asyncio.run_coroutine_threadsafe(conn.batched_put([key[1]], [objs[1]]), be.loop)
        time.sleep(0.1)
        queued.cancel()  # its write waits behind the first
        time.sleep(0.1)
        running.cancel()  # its write runs
        end = time.monotonic() + 10
        while conn.pending_puts() and time.monotonic() < end:
            time.sleep(0.01)
        returned = time.monotonic()
        assert conn.pending_puts() == 0 and conn._writes_queued == 0  # before: 1 queued for good
        assert spans and spans[0][1] <= returned  # the running put returned only after its write
        time.sleep(0.7)
        assert len(spans) == 1 and not conn.store.contains(key[1].to_string())  # the given-up write never ran
        assert conn.store.contains(key[0].to_string())
        closing = threading.Thread(target=conn._finish_puts, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive()
        for o in objs:
            o.ref_count_down()


def test_a_remote_get_cancelled_while_it_waits_for_puts_hands_back_its_hits(tmp_path, monkeypatch):
    """A remote read whose pool ran out waits for the connector's running
    puts (STORE_DRAIN_WAIT) before reading the rest. LMCache cancels a get
    that outlasts blocking_timeout_secs: cancelled in that wait, the read
    dropped the objects its first pass had filled, which LMCache's garbage
    collector freed later with a warning each (a review). They are handed
    back now."""
    import weakref

    cfg = config_from_dict({**remote_config(tmp_path / "s"), "blocking_timeout_secs": 1}, tmp_path)
    tokens, kv = torch.randint(0, 30000, (NTOK,)), KV(GEO, NTOK, seed=2)
    with lmcache_engine(cfg, GEO) as eng:
        be = backend_of(eng, "remote")
        conn = be.connection.getWrappedConnector()
        store_engine(eng, "remote", tokens, kv)
        keys = [k for _, _, k in eng.token_database.process_tokens(tokens)]
        write = conn.store.write
        monkeypatch.setattr(conn.store, "write", lambda items: (time.sleep(3), write(items))[1])  # a slow put
        other = KV(GEO, NTOK, seed=9)
        eng.store(torch.randint(0, 30000, (NTOK,)), kvcaches=other.caches, slot_mapping=other.slot_mapping)
        time.sleep(0.1)
        assert conn.pending_puts()
        got, released = [], []
        allocate, release = conn._allocate, conn._release

        def two_then_full(meta):  # the pool has room for two chunks
            if len(got) >= 2:
                return None
            a = allocate(meta)
            got.append(weakref.ref(a[0]))
            return a

        monkeypatch.setattr(conn, "_allocate", two_then_full)
        monkeypatch.setattr(conn, "_allocate_many", lambda meta, n: None)
        monkeypatch.setattr(conn, "_release", lambda o: (released.append(o), release(o)))
        be.batched_get_blocking(keys)  # LMCache waits 1 s, then cancels the get
        end = time.monotonic() + 5
        while len(released) < len(got) and time.monotonic() < end:
            time.sleep(0.05)
        assert len(got) == 2 and len(released) == 2, (len(got), len(released))
        end = time.monotonic() + 10
        while conn.pending_puts() and time.monotonic() < end:
            time.sleep(0.05)
