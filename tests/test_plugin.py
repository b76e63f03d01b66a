"""The LMCache plugin driven by a real LMCacheEngine on CPU, configured from
YAML exactly as a user writes it, with local_cpu: false so every retrieve
reads the fx tier."""

import asyncio
import contextlib
import dataclasses
import glob
import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from lmcache_fx import _fxio
from lmcache_fx.core.chunkfile import HEADER_SIZE
from lmcache_fx.core.options import ConfigError
from lmcache_fx.testing.cpu_engine import (
    KV,
    Geometry,
    async_lookup,
    config_from_dict,
    fx_backend,
    fx_config,
    lmcache_engine,
    retrieve,
    store_and_wait,
)

GEOMETRIES = {
    "bf16-gqa": Geometry(layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16),
    "mla-like": Geometry(layers=3, kv_heads=1, head_dim=576, dtype=torch.bfloat16, mla=True),
    "fp32-odd": Geometry(layers=2, kv_heads=3, head_dim=40, dtype=torch.float32),  # rows not 4 KiB multiples
}


def chunk_files(store):
    return sorted(glob.glob(os.path.join(store, "*", "*.fxkv")))


@pytest.mark.parametrize("engine_kind", ["io_uring", "threads"])
@pytest.mark.parametrize("geo_name", list(GEOMETRIES))
def test_round_trip_bit_exact(tmp_path, geo_name, engine_kind):
    geo = GEOMETRIES[geo_name]
    store = tmp_path / "store"
    ntok = 3 * 256 + 100  # a partial last chunk, stored because save_unfull_chunk is on
    cfg = config_from_dict(
        {**fx_config(store, io_engine="auto" if engine_kind == "io_uring" else "threads"), "save_unfull_chunk": True},
        tmp_path,
    )
    tokens = torch.randint(0, 30000, (ntok,))
    kv = KV(geo, ntok, seed=1)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        if engine_kind == "io_uring" and be.store.engine.kind != "io_uring":
            pytest.skip(f"io_uring unavailable: {be.store.engine.fallback_reason}")
        assert be.store.engine.kind == engine_kind
        store_and_wait(eng, tokens, kv, be)
        assert len(chunk_files(store)) == 4
        got = kv.empty_like()
        n = retrieve(eng, tokens, got)
        assert n == ntok
        assert kv.tokens_equal(got, ntok)
        assert be.store.stats.chunks_read == 4  # served by fx, not by a CPU copy
        # A different prompt sharing only the first two chunks hits only them.
        other = tokens.clone()
        other[600] += 1
        got2 = kv.empty_like()
        assert retrieve(eng, other, got2) == 512
        assert kv.tokens_equal(got2, 512)


def test_files_have_header_then_payload(tmp_path):
    geo = GEOMETRIES["bf16-gqa"]
    store = tmp_path / "s"
    cfg = config_from_dict(fx_config(store), tmp_path)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, torch.arange(512), KV(geo, 512), be)
    files = chunk_files(store)
    assert len(files) == 2
    for f in files:
        assert os.path.getsize(f) == HEADER_SIZE + 256 * geo.bytes_per_token
        assert (os.stat(f).st_mode & 0o777) == 0o600
        with open(f, "rb") as fh:
            assert fh.read(8) == b"LMCFXKV\0"
    assert not glob.glob(os.path.join(store, "*", "*.tmp.*"))


def _xproc(role, store, workdir, ntok):
    env = dict(
        os.environ,
        PYTHONHASHSEED="0",
        LMCACHE_TRACK_USAGE="false",
        PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.path.dirname(__file__)]),
    )
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "xproc.py"),
            role,
            str(store),
            str(workdir),
            str(ntok),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    return json.loads(line[-1][7:])


def test_store_in_one_process_retrieve_in_another(tmp_path):
    store = tmp_path / "store"
    a = _xproc("store", store, tmp_path, 1024)
    assert a["chunks"] == 4
    b = _xproc("retrieve", store, tmp_path, 1024)
    assert b == {"tokens": 1024, "equal": True, "chunks_read": 4}


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_async_loading_end_to_end(tmp_path):
    """LMCache's async loading (enable_async_loading) as vLLM drives it: the
    scheduler's lookup client asks the worker's lookup server over ZMQ, the
    storage manager's loop awaits fx's batched_async_contains and
    batched_get_non_blocking, and retrieve(req_id=...) takes what was
    prefetched. Every hit lands bit-exact through the awaited path (never the
    blocking one), no lookup pin outlives its load, and a chunk damaged after
    the lookup is a miss: the reported hit and the retrieve stop before it,
    nothing of it written."""
    from lmcache_fx.core.chunkfile import chunk_digest

    geo = GEOMETRIES["bf16-gqa"]
    store = tmp_path / "store"
    cfg = config_from_dict({**fx_config(store), "enable_async_loading": True}, tmp_path)
    tokens, more = torch.arange(1024), torch.arange(1536)
    kv = KV(geo, 1536, seed=11)
    with lmcache_engine(cfg, geo, async_lookup=True) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, tokens, kv, be)
        calls = {"blocking": 0, "awaited": 0}
        blocking, awaited = be.batched_get_blocking, be.batched_get_non_blocking

        def counted_blocking(*a, **k):
            calls["blocking"] += 1
            return blocking(*a, **k)

        async def counted_awaited(*a, **k):
            calls["awaited"] += 1
            return await awaited(*a, **k)

        be.batched_get_blocking, be.batched_get_non_blocking = counted_blocking, counted_awaited
        hits0 = be.store.stats.snapshot()["hits"]
        # Four stored chunks of six asked for: the hit is the four.
        assert async_lookup(eng, more, "req-1") == 1024
        got = kv.empty_like()
        mask = eng.retrieve(more, kvcaches=got.caches, slot_mapping=got.slot_mapping, req_id="req-1")
        assert int(mask.sum()) == 1024 and kv.tokens_equal(got, 1024)
        assert calls == {"blocking": 0, "awaited": 1}
        assert be.store.stats.snapshot()["hits"] - hits0 == 4
        assert be.store._pins == {} and be._lookup_pins == {}

        # The third chunk damaged between the lookup's check and the load: loaded up to it, no further.
        key2 = list(eng.token_database.process_tokens(tokens=tokens))[2][2]
        victim = be.store.path_for(chunk_digest(key2.to_string()))
        real_contains = be.batched_async_contains

        async def damage_after_lookup(*a, **k):
            n = await real_contains(*a, **k)
            _flip(victim, HEADER_SIZE + 4096)
            return n

        be.batched_async_contains = damage_after_lookup
        assert async_lookup(eng, tokens, "req-2") == 512
        got2 = kv.empty_like()
        mask = eng.retrieve(tokens, kvcaches=got2.caches, slot_mapping=got2.slot_mapping, req_id="req-2")
        assert int(mask.sum()) == 512 and kv.tokens_equal(got2, 512)
        assert be.store.stats.corrupt == 1 and not os.path.exists(victim)
        s = kv.slot_mapping[512:1024]
        assert all(
            torch.count_nonzero(c.view(c.shape[0], -1, c.shape[-2] * c.shape[-1])[:, s]) == 0 for c in got2.caches
        )
        assert be.store._pins == {} and be._lookup_pins == {}
    # The lookup client's and server's threads left before their ZMQ sockets closed (engine_on_cpu wakes them:
    # closing a socket under a thread blocked in its recv() aborted the process once).
    assert eng.fx_lookup_threads_at_close == []
    lookup_threads = ("async-lookup-client-thread", "async-lookup-server-thread")
    assert not [t.name for t in threading.enumerate() if t.name in lookup_threads and t.is_alive()]


@pytest.mark.parametrize("damage", ["payload-bit", "header-bit", "truncated", "empty", "other-key"])
def test_damaged_chunk_is_a_miss_and_removed(tmp_path, damage):
    geo = GEOMETRIES["bf16-gqa"]
    store = tmp_path / "store"
    cfg = config_from_dict(fx_config(store), tmp_path)
    tokens = torch.arange(768)
    kv = KV(geo, 768, seed=3)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, tokens, kv, be)
        files = chunk_files(store)
        assert len(files) == 3
        # Damage the file of the second chunk.
        key1 = [k for k in eng.token_database.process_tokens(tokens=tokens)][1][2]
        victim = be.store.path_for(
            __import__("lmcache_fx.core.chunkfile", fromlist=["x"]).chunk_digest(key1.to_string())
        )
        assert victim in files
        size = os.path.getsize(victim)
        if damage == "payload-bit":
            _flip(victim, HEADER_SIZE + size // 3)
        elif damage == "header-bit":
            _flip(victim, 100)
        elif damage == "truncated":
            os.truncate(victim, size - 4096)
        elif damage == "empty":
            os.truncate(victim, 0)
        else:  # a valid chunk of another key under this key's name
            os.replace([f for f in files if f != victim][0], victim)
        got = kv.empty_like()
        n = retrieve(eng, tokens, got)
        assert n == 256  # only the prefix before the bad chunk
        assert kv.tokens_equal(got, 256)
        assert be.store.stats.corrupt >= 1
        assert not os.path.exists(victim)
        # Nothing wrong was written into the destination past the hit prefix.
        s = kv.slot_mapping[256:512]
        assert all(
            torch.count_nonzero(c.view(c.shape[0], -1, c.shape[-2] * c.shape[-1])[:, s]) == 0 for c in got.caches
        )


def test_async_load_path_releases_pins(tmp_path):
    geo = GEOMETRIES["bf16-gqa"]
    store = tmp_path / "store"
    cfg = config_from_dict(fx_config(store), tmp_path)
    tokens = torch.arange(768)
    kv = KV(geo, 768, seed=5)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, tokens, kv, be)
        keys = [k for _, _, k in eng.token_database.process_tokens(tokens=tokens)]
        loop = eng.storage_manager.loop

        async def go():
            n = await be.batched_async_contains("L1", keys, True)
            assert be.store._pins  # pinned while loading
            objs = await be.batched_get_non_blocking("L1", keys[:n], {"cum_chunk_lengths": [0, 256, 512, 768]})
            return n, objs

        n, objs = asyncio.run_coroutine_threadsafe(go(), loop).result(60)
        assert n == 3 and len(objs) == 3
        assert not be.store._pins  # released without an unpin from LMCache
        ref = kv.caches[0].view(2, -1, geo.kv_heads * geo.head_dim)[:, kv.slot_mapping[:256]]
        assert torch.equal(objs[0].tensor[:, 0, :, :], ref)
        for o in objs:
            o.ref_count_down()


def test_capacity_holds_and_survives_restart(tmp_path):
    geo = GEOMETRIES["bf16-gqa"]  # 256 KiB per chunk
    store = tmp_path / "store"
    chunk_file = HEADER_SIZE + 256 * geo.bytes_per_token
    cap_gb = 5.5 * chunk_file / (1 << 30)
    cfg = config_from_dict(fx_config(store, max_capacity_gb=cap_gb), tmp_path)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        for seed in range(4):  # 4 prompts x 2 chunks = 8 chunks into room for 5
            store_and_wait(eng, torch.arange(512) + 10000 * seed, KV(geo, 512, seed=seed), be)
        assert len(chunk_files(store)) == 5
        assert be.store.usage_bytes == 5 * chunk_file <= cap_gb * (1 << 30)
        assert be.store.stats.evictions == 3
        # The newest prompt is still whole.
        kv3 = KV(geo, 512, seed=3)
        got = kv3.empty_like()
        assert retrieve(eng, torch.arange(512) + 30000, got) == 512
    # A restart with a smaller cap recomputes usage from files and evicts.
    cfg2 = config_from_dict(fx_config(store, max_capacity_gb=2.5 * chunk_file / (1 << 30)), tmp_path)
    with lmcache_engine(cfg2, geo) as eng:
        be = fx_backend(eng)
        assert be.store.usage_bytes == 2 * chunk_file
        assert len(chunk_files(store)) == 2


@pytest.mark.parametrize(
    "opt,value,needle",
    [
        ("queue_dept", 8, "did you mean 'storage_plugin.fx.queue_depth'"),
        ("queue_depth", 0, "storage_plugin.fx.queue_depth: 0 is out of range"),
        ("queue_depth", "many", "storage_plugin.fx.queue_depth: expected an integer"),
        ("split_bytes", 5000, "not a multiple of 4096"),
        ("io_engine", "spdk", "storage_plugin.fx.io_engine: expected one of auto, io_uring, threads"),
        ("odirect", "maybe", "storage_plugin.fx.odirect"),
        ("verify", "perhaps", "storage_plugin.fx.verify: expected true or false"),
        ("max_capacity_gb", -1, "storage_plugin.fx.max_capacity_gb"),
        ("path", "/proc/lmcache-fx", "cannot create or open the store directory"),
    ],
)
def test_bad_option_is_refused_with_its_name(tmp_path, opt, value, needle):
    from lmcache_fx.lmcache_plugin import FxStorageBackend

    d = fx_config(value if opt == "path" else tmp_path / "store", **({} if opt == "path" else {opt: value}))
    cfg = config_from_dict(d, tmp_path)

    class FakeCPU:  # only the constructor runs; it fails before using this
        pass

    with pytest.raises(ConfigError) as ei:
        FxStorageBackend(config=cfg, metadata=None, local_cpu_backend=FakeCPU(), loop=None)
    assert needle in str(ei.value)


def test_two_instances_read_their_own_options(tmp_path):
    geo = GEOMETRIES["bf16-gqa"]
    d = fx_config(tmp_path / "a", name="fxa", io_engine="threads")
    d["storage_plugins"].append("fxb")
    d["extra_config"].update(
        {
            "storage_plugin.fxb.module_path": "lmcache_fx.lmcache_plugin",
            "storage_plugin.fxb.class_name": "FxStorageBackend",
            "storage_plugin.fxb.path": str(tmp_path / "b"),
            "storage_plugin.fxb.queue_depth": 7,
        }
    )
    cfg = config_from_dict(d, tmp_path)
    with lmcache_engine(cfg, geo) as eng:
        a, b = fx_backend(eng, "fxa"), fx_backend(eng, "fxb")
        assert a.store.roots == [str(tmp_path / "a")] and a.store.engine.kind == "threads"
        assert b.store.roots == [str(tmp_path / "b")] and b.store.engine.queue_depth == 7


def test_striping_over_paths(tmp_path):
    geo = GEOMETRIES["bf16-gqa"]
    paths = f"{tmp_path}/p0,{tmp_path}/p1"
    cfg = config_from_dict(fx_config(paths), tmp_path)
    tokens = torch.arange(256 * 12)
    kv = KV(geo, len(tokens), seed=9)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, tokens, kv, be)
        n0, n1 = len(chunk_files(tmp_path / "p0")), len(chunk_files(tmp_path / "p1"))
        assert n0 + n1 == 12 and n0 > 0 and n1 > 0
        got = kv.empty_like()
        assert retrieve(eng, tokens, got) == len(tokens)
        assert kv.tokens_equal(got, len(tokens))


@pytest.mark.xfs
def test_odirect_on_xfs(xfs_store, tmp_path):
    geo = GEOMETRIES["fp32-odd"]
    cfg = config_from_dict({**fx_config(xfs_store, odirect="true"), "save_unfull_chunk": True}, tmp_path)
    ntok = 700
    tokens = torch.arange(ntok)
    kv = KV(geo, ntok, seed=11)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        assert be.store.odirect
        store_and_wait(eng, tokens, kv, be)
        for f in chunk_files(xfs_store):  # trimmed back after the padded O_DIRECT write
            assert (os.path.getsize(f) - HEADER_SIZE) % (geo.bytes_per_token) == 0
        got = kv.empty_like()
        assert retrieve(eng, tokens, got) == ntok
        assert kv.tokens_equal(got, ntok)


def test_header_whose_shapes_do_not_match_the_payload_is_bad(tmp_path):
    """A planted chunk with valid CRCs but shapes that claim more (or fewer)
    bytes than its payload is refused before anything is allocated."""
    from lmcache_fx import _fxio
    from lmcache_fx.core.chunkfile import BadHeader, ChunkMeta, decode_header, encode_header

    buf = _fxio.HostBuffer(HEADER_SIZE, hugepages=False)
    good = ChunkMeta(((2, 4, 256, 128),), ("bfloat16",), "KV_2LTD")
    encode_header(buf, "k", good, 2 * 4 * 256 * 128 * 2, 0, 0)
    assert decode_header(buf).meta == good
    huge = ChunkMeta(((2, 4, 1 << 40, 128),), ("bfloat16",), "KV_2LTD")
    encode_header(buf, "k", huge, 2 * 4 * 256 * 128 * 2, 0, 0)
    with pytest.raises(BadHeader, match="shapes and dtypes make"):
        decode_header(buf)
    # Formats whose size the shapes do not give (compressed) are not checked.
    encode_header(buf, "k", ChunkMeta(((7,),), ("uint8",), "BINARY_BUFFER"), 3, 0, 0)
    assert decode_header(buf).payload_len == 3


def test_a_read_allocates_each_run_of_chunks_in_one_call(tmp_path, monkeypatch):
    """LMCache's pool gives the chunks of one shape in one batched_allocate
    call (LocalCPUBackend.allocate per chunk costs more than a small chunk's
    read); a run it cannot give whole is allocated one by one."""
    from lmcache_fx.integration.common import allocate_many_from

    geo = GEOMETRIES["bf16-gqa"]
    ntok = 4 * 256 + 100  # four full chunks and a partial one of another shape
    cfg = config_from_dict({**fx_config(tmp_path / "store"), "save_unfull_chunk": True}, tmp_path)
    tokens = torch.randint(0, 30000, (ntok,))
    kv = KV(geo, ntok, seed=3)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, tokens, kv, be)
        ma = be.local_cpu_backend.memory_allocator
        real, counts = ma.batched_allocate, []

        def counting(shapes, dtypes, count, fmt=None):
            counts.append(count)
            return real(shapes, dtypes, count, fmt)

        monkeypatch.setattr(ma, "batched_allocate", counting)
        got = kv.empty_like()
        assert retrieve(eng, tokens, got) == ntok
        assert kv.tokens_equal(got, ntok)
        assert counts == [4]  # the partial chunk alone: allocated by itself
        meta = max(be.store._index.values(), key=lambda e: e.size).meta  # a full chunk's
        too_many = (512 << 20) // (256 * geo.bytes_per_token) + 1  # more than the 0.5 GB pool holds
        assert allocate_many_from(be.local_cpu_backend, meta, too_many) is None
        two = allocate_many_from(be.local_cpu_backend, meta, 2)
        assert two is not None and len(two) == 2 and two[0][1] != two[1][1]
        for obj, _addr, _n in two:
            obj.ref_count_down()


def test_meta_of_is_built_once_per_shape_and_dtype():
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    from lmcache_fx.core.chunkfile import ChunkMeta
    from lmcache_fx.integration.common import meta_of

    def obj(shape, dtype):
        t = torch.zeros(shape, dtype=dtype)
        m = MemoryObjMetadata(
            shape=torch.Size(shape), dtype=dtype, address=0, phy_size=t.nbytes, fmt=MemoryFormat.KV_2LTD, ref_count=1
        )
        return TensorMemoryObj(raw_data=t.view(-1).view(torch.uint8), metadata=m, parent_allocator=None)

    a, b = meta_of(obj((2, 4, 16, 8), torch.bfloat16)), meta_of(obj((2, 4, 16, 8), torch.bfloat16))
    assert a is b and a == ChunkMeta(((2, 4, 16, 8),), ("bfloat16",), "KV_2LTD")
    c = meta_of(obj((2, 4, 16, 8), torch.float16))
    d = meta_of(obj((2, 4, 15, 8), torch.bfloat16))
    assert c.dtypes == ("float16",) and d.shapes == ((2, 4, 15, 8),) and len({a, c, d}) == 3


def _loaded(eng, lookup_id: str, timeout: float = 30.0):
    """What an async load put in LMCache's event manager (its load task runs
    on LMCache's loop): the loaded objects per tier."""
    from lmcache.v1.event_manager import EventType

    end = time.monotonic() + timeout
    while True:
        try:
            return eng.event_manager.get_event_future(EventType.LOADING, lookup_id).result()
        except AssertionError:  # not done yet
            assert time.monotonic() < end
            time.sleep(0.01)


def test_layerwise_async_lookup_leaves_other_requests_pins(tmp_path):
    """With per-layer keys (keys_per_chunk 2), LMCache rounds an async
    lookup's hit down to whole chunks and unpins the keys it drops itself;
    the plugin then releases only the keys it was asked to load. Before,
    it unpinned every key it had pinned, so a dropped key lost a pin that
    another request held. A lookup of less than one whole chunk leaves no
    load and no record past LOOKUP_PINS_KEPT_S."""

    from lmcache_fx import lmcache_plugin
    from lmcache_fx.core.chunkfile import chunk_digest

    geo = GEOMETRIES["bf16-gqa"]
    cfg = config_from_dict({**fx_config(tmp_path / "s", cpu_gb=0.05), "enable_async_loading": True}, tmp_path)
    with lmcache_engine(cfg, geo, async_lookup=True) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, torch.arange(768), KV(geo, 768, seed=1), be)  # three chunks of 256 tokens
        keys = [k for _, _, k in eng.token_database.process_tokens(tokens=torch.arange(1024))]
        assert len(keys) == 4  # the fourth is not stored
        other = keys[2].to_string()
        assert be.store.pin(other)  # another request's pin on the third chunk's file
        sm = eng.storage_manager

        def lookup(lookup_id, ks, starts):
            asyncio.run_coroutine_threadsafe(
                sm.async_lookup_and_prefetch(lookup_id, ks, starts, pin=True, keys_per_chunk=2), sm.loop
            ).result(30)

        # Keys of two chunks of two per-layer keys each: three hit, the third is rounded off.
        lookup("req-1", keys, [0, 512, 1024])
        loaded = _loaded(eng, "req-1")
        for tier in loaded:
            for _, obj in tier:  # the load's objects, as retrieve would take them
                obj.ref_count_down()
        assert "req-1" not in be._lookup_pins
        assert be.store._pins == {chunk_digest(other): 1}
        # One key hit of a two-key chunk: nothing whole, LMCache unpins it and loads nothing.
        be.store.unpin(other)
        lookup("req-2", [keys[0], keys[3]], [0, 512])
        assert be.store._pins == {} and list(be._lookup_pins) == ["req-2"]
        be._lookup_pins["req-2"][0].at -= lmcache_plugin.LOOKUP_PINS_KEPT_S + 1
        lookup("req-3", [keys[0], keys[3]], [0, 512])
        assert "req-2" not in be._lookup_pins


def test_two_plugins_keep_their_names_when_lmcache_rebuilds_them(tmp_path):
    """LMCache's StorageManager.recreate_backend makes every storage plugin
    again; each instance must still be the entry LMCache files it under
    (before, the rebuilt 'bulk' was named 'fast' and wrote to fast's path)."""
    d = fx_config(tmp_path / "fast", name="fast", cpu_gb=0.05)
    d["storage_plugins"] = ["fast", "bulk"]
    d["extra_config"].update(
        {
            "storage_plugin.bulk.module_path": "lmcache_fx.lmcache_plugin",
            "storage_plugin.bulk.class_name": "FxStorageBackend",
            "storage_plugin.bulk.path": str(tmp_path / "bulk"),
        }
    )
    with lmcache_engine(config_from_dict(d, tmp_path), GEOMETRIES["bf16-gqa"]) as eng:
        backends = eng.storage_manager.storage_backends

        def names():
            return {n: (b.name, b.store.roots) for n, b in backends.items() if n in ("fast", "bulk")}

        want = {n: (n, [str(tmp_path / n)]) for n in ("fast", "bulk")}
        assert names() == want
        old_bulk = backends["bulk"]  # LMCache makes a new one without closing this one
        try:
            assert eng.storage_manager.recreate_backend("fast") == {
                "fast": "FxStorageBackend",
                "bulk": "FxStorageBackend",
            }
            assert names() == want and backends["bulk"] is not old_bulk
        finally:
            old_bulk.close()


def test_a_chunk_larger_than_lmcaches_pool_is_a_miss_not_a_wait(tmp_path):
    """LMCache's allocator, asked with busy_loop for more than its whole
    pool, waits for room forever (a blocking retrieve then never returns).
    allocate_from answers None at once for such a chunk; one that fits is
    still allocated."""
    from lmcache_fx.core.chunkfile import ChunkMeta
    from lmcache_fx.integration.common import allocate_from

    geo = GEOMETRIES["bf16-gqa"]
    with lmcache_engine(config_from_dict(fx_config(tmp_path / "s", cpu_gb=0.05), tmp_path), geo) as eng:
        cpu = fx_backend(eng).local_cpu_backend
        huge = ChunkMeta(((2, 4, 1 << 20, 128),), ("bfloat16",), "KV_2LTD")  # 2 GiB
        small = ChunkMeta(((2, 4, 256, 128),), ("bfloat16",), "KV_2LTD")  # 512 KiB
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(huge=allocate_from(cpu, huge)), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive() and got == {"huge": None}
        obj, addr, n = allocate_from(cpu, small)
        assert n == 2 * 4 * 256 * 128 * 2 and addr
        obj.ref_count_down()


@contextlib.contextmanager
def _three_chunks_async(tmp_path):
    """An engine with async loading and three stored chunks: (the plugin,
    the chunks' keys, a function running a coroutine on LMCache's loop)."""
    geo = GEOMETRIES["bf16-gqa"]
    cfg = config_from_dict({**fx_config(tmp_path / "s", cpu_gb=0.05), "enable_async_loading": True}, tmp_path)
    with lmcache_engine(cfg, geo, async_lookup=True) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, torch.arange(768), KV(geo, 768, seed=1), be)
        keys = [k for _, _, k in eng.token_database.process_tokens(tokens=torch.arange(768))]
        loop = eng.storage_manager.loop
        yield be, keys, lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(30)


def test_a_load_cancelled_before_it_starts_leaves_no_pin_for_good(tmp_path):
    """An async lookup pins its chunks and the load releases them in its
    finally; a load task cancelled before its first step (asyncio.wait_for
    with no time left, or cancel() right after create_task) never runs that
    finally, and its record was swept after LOOKUP_PINS_KEPT_S without
    unpinning: the chunks stayed pinned (never evictable) for good. The
    sweep releases what no load and no unpin of LMCache's released."""

    from lmcache_fx import lmcache_plugin

    with _three_chunks_async(tmp_path) as (be, keys, on_loop):

        async def cancelled_before_start(lookup_id):
            n = await be.batched_async_contains(lookup_id, keys, pin=True)
            task = asyncio.ensure_future(be.batched_get_non_blocking(lookup_id, keys[:n]))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return n

        assert on_loop(cancelled_before_start("req-A")) == 3
        assert sum(be.store._pins.values()) == 3  # held: no load ran to release them
        # The same id again: both kept (a load still queued in LMCache could be the first's), each
        # released by a load of its own, oldest first, or past LOOKUP_PINS_KEPT_S.
        assert on_loop(cancelled_before_start("req-A")) == 3
        assert sum(be.store._pins.values()) == 6 and len(be._lookup_pins["req-A"]) == 2
        for rec in be._lookup_pins["req-A"]:
            rec.at -= lmcache_plugin.LOOKUP_PINS_KEPT_S + 1

        async def lookup_and_load(lookup_id):
            n = await be.batched_async_contains(lookup_id, keys, pin=True)  # sweeps the expired record
            objs = await be.batched_get_non_blocking(lookup_id, keys[:n])
            for o in objs:
                o.ref_count_down()
            return len(objs)

        assert on_loop(lookup_and_load("req-B")) == 3
        assert be.store._pins == {} and be._lookup_pins == {}

        # Two lookups of one id before its first load ran (queued in LMCache): each load releases one
        # lookup's pins, the oldest first; the second's stay held for its own load.
        async def load(lookup_id):
            objs = await be.batched_get_non_blocking(lookup_id, keys)
            for o in objs:
                o.ref_count_down()

        for _ in range(2):
            assert on_loop(be.batched_async_contains("req-C", keys, pin=True)) == 3
        assert sum(be.store._pins.values()) == 6
        on_loop(load("req-C"))
        assert sum(be.store._pins.values()) == 3
        on_loop(load("req-C"))
        assert be.store._pins == {} and be._lookup_pins == {}


def test_a_sync_unpin_is_not_taken_for_an_async_lookups_own(tmp_path):
    """LMCache unpins the keys it rounds off an async lookup right after the
    lookup, on its loop; a sync lookup's unpin (lookup_unpin, on the
    caller's thread) releases that lookup's own pin. unpin() noted any
    unpin on the newest async record holding the key, so a sync unpin
    between an async lookup and a load that never runs made the sweep
    release one pin too few: the chunk stayed pinned for good."""

    from lmcache_fx import lmcache_plugin

    with _three_chunks_async(tmp_path) as (be, keys, on_loop):
        assert on_loop(be.batched_async_contains("req-A", keys, pin=True)) == 3  # its load never runs
        # Another request's sync lookup pins the first chunk and lookup_unpin releases it, on this thread.
        assert be.batched_contains(keys[:1], pin=True) == 1
        assert sum(be.store._pins.values()) == 4
        be.unpin(keys[0])
        assert sum(be.store._pins.values()) == 3 and be._lookup_pins["req-A"][0].unreleased() == keys
        be._lookup_pins["req-A"][0].at -= lmcache_plugin.LOOKUP_PINS_KEPT_S + 1
        assert on_loop(be.batched_async_contains("req-B", keys, pin=True)) == 3  # sweeps req-A's record
        assert sum(be.store._pins.values()) == 3 and list(be._lookup_pins) == ["req-B"]
        for k in keys:
            be.store.unpin(k.to_string())
        assert be.store._pins == {}


def test_a_lookup_id_used_again_unpins_each_key_once(tmp_path):
    """A layerwise async lookup that hit less than one whole chunk loads
    nothing (LMCache unpins its keys itself) and its record stays; the next
    lookup under the same id (a re-lookup after preemption) added to that
    record, so its load unpinned the first chunk's key twice, dropping
    another request's pin. The record is replaced now."""

    from lmcache_fx.core.chunkfile import chunk_digest

    geo = GEOMETRIES["bf16-gqa"]
    cfg = config_from_dict({**fx_config(tmp_path / "s", cpu_gb=0.05), "enable_async_loading": True}, tmp_path)
    with lmcache_engine(cfg, geo, async_lookup=True) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, torch.arange(512), KV(geo, 512, seed=1), be)  # two chunks of 256 tokens
        keys = [k for _, _, k in eng.token_database.process_tokens(tokens=torch.arange(1024))]
        sm = eng.storage_manager
        first = keys[0].to_string()
        assert be.store.pin(first)  # another request's pin on the first chunk's file

        def lookup(ks, starts):
            asyncio.run_coroutine_threadsafe(
                sm.async_lookup_and_prefetch("req-A", ks, starts, pin=True, keys_per_chunk=2), sm.loop
            ).result(30)

        lookup([keys[0], keys[3]], [0, 512])  # one key of a two-key chunk: no whole chunk, no load
        assert be.store._pins == {chunk_digest(first): 1}
        lookup([keys[0], keys[1]], [0, 512])  # the same id again: one whole chunk, loaded
        loaded = _loaded(eng, "req-A")
        for tier in loaded:
            for _, obj in tier:
                obj.ref_count_down()
        assert be.store._pins == {chunk_digest(first): 1}  # the other request's pin is still there
        assert be.store.unpin(first) and be.store._pins == {}


POOL_FREED_AFTER_READS = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from faults import fxfault as F
from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, fx_backend, fx_config, lmcache_engine, store_and_wait

work = {work!r}
geo = Geometry(layers=32, kv_heads=8, head_dim=128)  # 32 MiB chunks
ntok = 8 * geo.chunk
cfg = config_from_dict(fx_config(os.path.join(work, "s"), cpu_gb=0.4), work)
with lmcache_engine(cfg, geo) as eng:
    be = fx_backend(eng)
    store_and_wait(eng, torch.arange(ntok), KV(geo, ntok, seed=2), be)
    keys = [k for _, _, k in eng.token_database.process_tokens(tokens=torch.arange(ntok))]
    print("RESULT", F.close_lmcache_during_a_read(eng, be, be.store.engine, keys) or "none", flush=True)
    os._exit(0)  # the engine's own teardown would close its storage manager again
"""


def test_lmcache_frees_its_pool_only_after_reads_into_it_end(tmp_path):
    """LMCache closes its CPU tier, freeing the pool, before the plugin's
    own close: an async load into that pool still reading went on writing
    into freed memory (the process died of SIGSEGV). The hook that runs
    before the pool is freed now also waits for the plugin's reads in flight
    (its engine closes, so later reads are misses). Seen from the pool's
    close: no batch of the plugin's engine is running or queued then."""
    code = POOL_FREED_AFTER_READS.format(tests=os.path.dirname(os.path.abspath(__file__)), work=str(tmp_path))
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, (r.returncode, r.stderr[-3000:])
    if line[-1] == "RESULT none":
        pytest.skip("no read was still in flight when the pool closed (the medium is too fast here)")
    assert line[-1] == "RESULT [0]"


def test_a_memlock_limit_that_refuses_the_pool_is_one_warning(tmp_path):
    """Under a small RLIMIT_MEMLOCK without CAP_IPC_LOCK the pool's fixed
    buffer registration is refused (reads then pin pages each time): that
    was said at INFO, which a server's default logging does not show. One
    warning per process now, naming the limit and the fix."""
    import shutil
    import subprocess
    import sys

    if not (shutil.which("prlimit") and shutil.which("setpriv")):
        pytest.skip("prlimit and setpriv (util-linux) are needed to drop the limit and the capability")
    if not _fxio.io_uring_status()[0]:
        pytest.skip("io_uring unavailable: nothing is registered")
    code = (
        "import logging; logging.basicConfig(format='%(levelname)s %(message)s')\n"
        "from lmcache_fx.integration.common import register_memory\n"
        "from lmcache_fx import _fxio\n"
        "e = _fxio.Engine(); b = _fxio.HostBuffer(64 << 20)\n"
        "print([register_memory(e, b.address, 64 << 20, 'the pool') for _ in range(2)])\n"
        "from lmcache_fx.core.drive import memlock_refuses\n"
        "print(memlock_refuses(1 << 10), memlock_refuses(64 << 20))\n"
    )
    r = subprocess.run(
        ["prlimit", "--memlock=65536", "setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock",
         sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-2:] == ["[False, False]", "False True"]  # blamed only past the limit
    warned = [x for x in r.stderr.splitlines() if x.startswith("WARNING lmcache-fx")]
    assert len(warned) == 1 and "RLIMIT_MEMLOCK, ulimit -l: 64 KiB" in warned[0] and "CAP_IPC_LOCK" in warned[0], warned


def test_huge_pages_off_is_one_warning(monkeypatch, caplog, tmp_path):
    """Transparent huge pages off (never): the pool stays in 4 KiB pages and
    reads cost more CPU per GB; only doctor said so. One warning per process
    now. (The sysfs file is read through _thp_mode, given a file of the same
    form here: the host's setting is not the test's to change.)"""
    from lmcache_fx.core import once
    from lmcache_fx.integration import common

    thp = tmp_path / "enabled"
    thp.write_text("always madvise [never]\n")
    real = common._thp_mode
    assert real(str(thp)) == "never"
    monkeypatch.setattr(common, "_thp_mode", lambda: real(str(thp)))
    monkeypatch.setattr(once, "_said", set())
    e = _fxio.Engine()
    b = _fxio.HostBuffer(4 << 20)
    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        for _ in range(2):
            common.register_memory(e, b.address, 4 << 20, "the pool")
    said = [r.getMessage() for r in caplog.records if "transparent huge pages are off" in r.getMessage()]
    assert len(said) == 1 and "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in said[0]
    e.close()


def test_engine_shapes_judges_kv_2ltd_chunks_by_the_metadatas_shapes():
    """LMCache's own metadata decides: a chunk of its shapes for any token
    count up to a chunk fits (a partial last chunk too); other layers, heads
    or dtype do not; a chunk of several tensors is not judged before the
    serving engine registers its layer groups (the metadata then knows one
    group only), nor are other formats."""
    from lmcache.v1.metadata import LMCacheMetadata

    from lmcache_fx.core.chunkfile import ChunkMeta
    from lmcache_fx.integration.common import EngineShapes

    md = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (2, 2, 256, 2, 64))
    shapes = EngineShapes(md)

    def meta(*shapes, dtype="bfloat16", fmt="KV_2LTD"):
        return ChunkMeta(tuple(shapes), (dtype,) * len(shapes), fmt)

    assert shapes.fits(meta((2, 2, 256, 128))) and shapes.fits(meta((2, 2, 100, 128)))
    assert not shapes.fits(meta((2, 1, 256, 256)))  # the same bytes: one layer of four heads
    assert not shapes.fits(meta((2, 4, 256, 128)))
    assert not shapes.fits(meta((2, 2, 256, 128), dtype="float16"))
    assert shapes.fits(meta((2, 2, 256, 128), (2, 1, 256, 64)))  # two groups, none registered yet
    assert not shapes.fits(meta((256, 2, 128), fmt="KV_T2D"))  # a layerwise engine's: not this one's format
    assert shapes.fits(meta((16,), dtype="uint8", fmt="BINARY_BUFFER"))  # a serde's bytes: not judged
    # KV heads x head size: written with this engine's, held to them; a chunk recording none (an
    # older writer's) is judged by its shapes alone
    mine = shapes.for_write(meta((2, 2, 256, 128)))
    assert mine.kv == (2, 64) and mine.layers == 0 and shapes.fits(mine) and shapes.fits(meta((2, 2, 256, 128)))
    assert not shapes.fits(dataclasses.replace(mine, kv=(1, 128)))


@pytest.mark.parametrize("blending", [False, True])
def test_engine_shapes_judges_a_layerwise_engines_chunks_by_format_heads_and_layers(blending):
    """A layerwise engine stores one layer's KV per chunk ([tokens, 2, heads x
    head size], KV_2TD [2, tokens, ...] when blending): a chunk of the other
    format (same keys), of another hidden size or dtype is a miss, and one
    its writer recorded with other KV heads x head size (same product) or
    another layer count is too (the shape says neither); an older writer's
    chunk recording none is judged by its shape. A chunkwise engine's chunks
    are misses to it."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from lmcache_fx.core.chunkfile import ChunkMeta
    from lmcache_fx.integration.common import EngineShapes

    md = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (4, 2, 256, 2, 64))
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, use_layerwise=True, enable_blending=blending)
    shapes = EngineShapes(md, config=cfg)
    fmt, other = ("KV_2TD", "KV_T2D") if blending else ("KV_T2D", "KV_2TD")

    def layer(tokens=256, hidden=128, dtype="bfloat16", f=fmt):
        return ChunkMeta(((2, tokens, hidden) if f == "KV_2TD" else (tokens, 2, hidden),), (dtype,), f)

    assert shapes.fits(layer()) and shapes.fits(layer(tokens=100))
    assert not shapes.fits(layer(f=other)) and not shapes.fits(layer(hidden=64))
    assert not shapes.fits(layer(dtype="float16"))
    assert not shapes.fits(ChunkMeta(((2, 4, 256, 128),), ("bfloat16",), "KV_2LTD"))
    mine = shapes.for_write(layer())
    assert (mine.kv, mine.layers) == ((2, 64), 4) and shapes.fits(mine)
    assert not shapes.fits(dataclasses.replace(mine, kv=(4, 32)))  # same product, other heads
    assert not shapes.fits(dataclasses.replace(mine, layers=2))  # a model of two layers: its layer 0 looks alike
    assert shapes.fits(dataclasses.replace(mine, kv=(), layers=0))


def test_engine_shapes_judges_mla_chunks_by_the_metadatas_shapes():
    """MLA (KV_MLA_FMT, [1, layers, tokens, latent]) is judged as KV_2LTD is:
    a chunk of another layer count or latent size under one model name is a
    miss (it was served, or made LMCache's retrieve raise)."""
    from lmcache.v1.metadata import LMCacheMetadata

    from lmcache_fx.core.chunkfile import ChunkMeta
    from lmcache_fx.integration.common import EngineShapes

    md = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (3, 1, 256, 1, 576), use_mla=True)
    shapes = EngineShapes(md)

    def mla(layers=3, latent=576):
        return ChunkMeta(((1, layers, 256, latent),), ("bfloat16",), "KV_MLA_FMT")

    assert shapes.fits(mla()) and shapes.fits(shapes.for_write(mla()))
    assert not shapes.fits(mla(layers=2)) and not shapes.fits(mla(latent=512))
    assert not shapes.fits(ChunkMeta(((2, 3, 256, 576),), ("bfloat16",), "KV_2LTD"))


def test_engine_shapes_leaves_mla_shaped_by_other_layerwise_connectors_unjudged():
    """LMCache labels every layerwise MLA object KV_MLA_FMT, but SGLang's and
    the buffer connector shape it [T, 2, H] or [2, T, H]: judged against
    [T, H], each chunk the engine wrote was a miss and written again on every
    request. Such chunks are not judged; vLLM's [T, H] ones are. A layer's
    dtype is the metadata's kv_dtype, as store_layer allocates it."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    from lmcache_fx.core.chunkfile import ChunkMeta
    from lmcache_fx.integration.common import EngineShapes

    md = LMCacheMetadata("m", 1, 1, 0, 0, torch.bfloat16, (3, 1, 256, 1, 576), use_mla=True)
    shapes = EngineShapes(md, config=LMCacheEngineConfig.from_defaults(chunk_size=256, use_layerwise=True))
    for shape in ((256, 2, 576), (2, 256, 576)):
        assert shapes.fits(shapes.for_write(ChunkMeta((shape,), ("bfloat16",), "KV_MLA_FMT")))
    assert shapes.fits(shapes.for_write(ChunkMeta(((256, 576),), ("bfloat16",), "KV_MLA_FMT")))
    assert not shapes.fits(ChunkMeta(((256, 512),), ("bfloat16",), "KV_MLA_FMT"))
    assert not shapes.fits(ChunkMeta(((256, 576),), ("float16",), "KV_MLA_FMT"))


def test_a_chunks_kv_heads_and_head_size_go_through_its_header():
    """ChunkMeta.kv is written in the header's JSON only where set (older
    headers have none and read as before), and read back as written; a
    malformed one is a bad header."""
    from lmcache_fx import _fxio
    from lmcache_fx.core.chunkfile import HEADER_SIZE, BadHeader, ChunkMeta, decode_header, encode_header

    buf = bytearray(HEADER_SIZE)
    for kv in ((), (8, 128)):
        m = ChunkMeta(((2, 2, 16, 1024),), ("bfloat16",), "KV_2LTD", kv)
        body = encode_header(buf, "k", m, 2 * 2 * 16 * 1024 * 2, 0, 1)
        assert (b'"kv"' in body) == bool(kv)
        assert decode_header(buf).meta == m
    m = ChunkMeta(((2, 2, 16, 1024),), ("bfloat16",), "KV_2LTD", (8, 128))
    for bad in (b'"kv":[0,128]', b'"kv":"8,128"'):  # as long as '"kv":[8,128]': only the field differs
        encode_header(buf, "k", m, 2 * 2 * 16 * 1024 * 2, 0, 1)
        raw = bytearray(bytes(buf).replace(b'"kv":[8,128]', bad))
        raw[HEADER_SIZE - 4 :] = _fxio.crc32c(bytes(raw[: HEADER_SIZE - 4])).to_bytes(4, "little")
        with pytest.raises(BadHeader, match="bad meta"):
            decode_header(raw)
    encode_header(buf, "k", dataclasses.replace(m, kv=(1,) * 9), 2 * 2 * 16 * 1024 * 2, 0, 1)
    with pytest.raises(BadHeader, match="bad meta: kv"):
        decode_header(buf)
    # a layerwise chunk's layer count, the same way
    lw = ChunkMeta(((256, 2, 128),), ("bfloat16",), "KV_T2D", (2, 64), 32)
    assert b'"layers":32' in encode_header(buf, "k", lw, 256 * 2 * 128 * 2, 0, 1) and decode_header(buf).meta == lw
    encode_header(buf, "k", dataclasses.replace(lw, layers=-1), 256 * 2 * 128 * 2, 0, 1)
    with pytest.raises(BadHeader, match="bad meta: layers"):
        decode_header(buf)


def test_layerwise_mode_is_warned_about_at_start(tmp_path, caplog):
    """LMCache's retrieve_layer checks only a chunk's first layer and loads
    short per-layer results without a word (a layer file lost since leaves
    stale KV; reproduced with a layerwise connector on CPU). fx cannot turn
    that into a miss from a backend, so it says so once at start."""
    cfg = config_from_dict({**fx_config(tmp_path / "s", cpu_gb=0.05), "use_layerwise": True}, tmp_path)
    with caplog.at_level("WARNING", logger="lmcache_fx"):
        with lmcache_engine(cfg, GEOMETRIES["bf16-gqa"]):
            pass
    said = [r.getMessage() for r in caplog.records if "use_layerwise" in r.getMessage()]
    assert len(said) == 1 and "checks only each chunk's first layer" in said[0], said


def _prompt_on_a_store(tmp_path, ntok: int):
    """The bf16 geometry, an engine configuration with fx under
    tmp_path/store, a prompt of ntok tokens and its KV."""
    geo = GEOMETRIES["bf16-gqa"]
    cfg = config_from_dict(fx_config(tmp_path / "store"), tmp_path)
    return geo, cfg, torch.randint(0, 30000, (ntok,)), KV(geo, ntok, seed=3)


@pytest.mark.parametrize("where", ["before-queued", "after-queued"])
def test_a_store_interrupted_in_its_submit_does_not_hang_close(tmp_path, monkeypatch, caplog, where):
    """A KeyboardInterrupt (or a signal handler's exception) raised in the
    storing thread inside the plugin's submit left state no writer could
    finish: after it took a batch's keys and before it queued them, the keys
    stayed pending for good and flush(), and with it LMCache's close, waited
    forever (a `lmcache-fx bench` stopped by SIGTERM hung in its cleanup);
    inside queue.Queue.put, the item could be queued with its count or the
    writer's wake-up not done (a hang, a dead writer, or references dropped
    twice: a review). Before it was queued, the keys are let go now (their
    references dropped once, one warning) and can be stored again; after,
    the writer finds the batch and writes it, its references dropped once."""
    import collections

    geo, cfg, tokens, kv = _prompt_on_a_store(tmp_path, 512)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        held, refs = [], []

        def interrupt(item) -> None:
            if item is not None and not held:
                held.extend(o for _, o in item[0])
                refs.extend(o.get_ref_count() for o in held)
                raise KeyboardInterrupt

        class Interrupting(collections.deque):
            def append(self, item):
                if where == "before-queued":
                    interrupt(item)
                super().append(item)
                if where == "after-queued":
                    interrupt(item)  # where Queue.put's count or wake-up would have come

        monkeypatch.setattr(be, "_writes", Interrupting())
        with pytest.raises(KeyboardInterrupt):
            eng.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
        assert held
        with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
            try:
                be.flush(timeout=10)  # raised TimeoutError: the keys were waited for for good
            except TimeoutError:
                be._put_keys.clear()  # so that the engine can close
                raise
        assert not be._stores_queued() and be._writer.is_alive()
        assert [o.get_ref_count() for o in held] == [r - 1 for r in refs]  # the plugin's own reference, once
        files = len(chunk_files(tmp_path / "store"))
        if where == "before-queued":
            assert "store was interrupted before it was queued" in caplog.text and files == 0
            store_and_wait(eng, tokens, kv, be)  # stored now, not skipped as pending
            assert len(chunk_files(tmp_path / "store")) == 2
        else:
            assert "not stored" not in caplog.text and files == 2


def test_a_blocking_read_interrupted_between_steps_hands_back_every_object(tmp_path, monkeypatch):
    """LMCache's retrieve reads on its own thread through drive_blocking. A
    KeyboardInterrupt taken right after a blocking engine batch returned
    (the signal came while it ran without the GIL) left the read unclosed
    and handed back none of the objects it had allocated: LMCache's garbage
    collector freed them later, a warning each (a review). They are handed
    back now, before the interrupt goes on up."""
    import weakref

    from lmcache_fx.core import drive

    geo, cfg, tokens, kv = _prompt_on_a_store(tmp_path, 1024)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        store_and_wait(eng, tokens, kv, be)
        allocated, released = [], []
        many, release = be._allocate_many, be._release

        def allocate_many(meta, n):
            got = many(meta, n)
            allocated.extend(weakref.ref(t[0]) for t in got or ())
            return got

        monkeypatch.setattr(be, "_allocate_many", allocate_many)
        monkeypatch.setattr(be, "_release", lambda o: (released.append(o), release(o)))
        real_step = drive._run_step

        def step(engine, st):
            res = real_step(engine, st)
            if drive.is_chunks_step(st):
                raise KeyboardInterrupt  # the SIGINT that came during the blocking batch
            return res

        monkeypatch.setattr(drive, "_run_step", step)
        with pytest.raises(KeyboardInterrupt):
            retrieve(eng, tokens, KV(geo, 1024, seed=4))
        assert allocated and len(released) == len(allocated)
        assert all(w() is None or w().get_ref_count() == 0 for w in allocated)
