"""Balanced placement over a striped store's roots (layout.root_choices,
place_roots; ChunkStore._places, _find): each chunk of a write batch goes
under the less loaded of its digest's two roots, and every lookup, read,
touch, removal and the admin tools find it under either. Real files; the
roots are directories (placement does not need separate devices)."""

import json
import math
import os
import shutil

import pytest

from lmcache_fx import _fxio as fx
from lmcache_fx.core.chunkfile import ChunkMeta, chunk_digest
from lmcache_fx.core.layout import paths_for, place_roots, root_choices, root_index
from lmcache_fx.core.options import FxOptions
from lmcache_fx.core.store import ChunkStore, Entry

SIZE = 8192
META = ChunkMeta(((SIZE,),), ("uint8",), "raw")


def _roots(tmp_path, n):
    out = []
    for i in range(n):
        p = tmp_path / f"r{i}"
        p.mkdir()
        out.append(str(p))
    return out


def _store(roots, **opts):
    return ChunkStore(FxOptions.from_mapping({"path": ",".join(roots), "max_capacity_gb": 1, **opts}))


def _payloads(n):
    buf = fx.HostBuffer(n * SIZE)
    mv = memoryview(buf)
    for i in range(n):
        mv[i * SIZE : (i + 1) * SIZE] = os.urandom(SIZE)
    return buf


def _written(roots, keys, **opts):
    """A store on `roots` with `keys` written as one batch, and their payloads."""
    src = _payloads(len(keys))
    st = _store(roots, **opts)
    try:
        assert all(st.write([(k, src.address + i * SIZE, SIZE, META) for i, k in enumerate(keys)]))
    except BaseException:
        st.close()
        raise
    return st, src


def _read(st, keys):
    dst = fx.HostBuffer(len(keys) * SIZE)
    it = iter(range(len(keys)))

    def allocate(m):
        i = next(it)
        return i, dst.address + i * SIZE, SIZE

    return st.read(keys, allocate, lambda h: None), dst


def _where(roots, keys):
    """The root index each key's file lies under (exactly one)."""
    out = []
    for k in keys:
        d = chunk_digest(k)
        found = [i for i, r in enumerate(roots) if os.path.exists(os.path.join(r, d[:2], d + ".fxkv"))]
        assert len(found) == 1, (k, found)
        out.append(found[0])
    return out


def test_choices_are_two_distinct_roots_the_first_as_before():
    """The first choice is the root digest striping always used (older
    stores' chunks are found there first); the second differs from it;
    one root is both."""
    for i in range(500):
        d = chunk_digest(f"k{i}")
        for n in (2, 3, 8):
            a, b = root_choices(n, d)
            assert a == root_index(n, d) and b != a and 0 <= b < n
        assert root_choices(1, d) == (0, 0)
    assert place_roots(4, []) == []


def test_a_batch_spreads_evenly_and_reads_back(tmp_path):
    """48 chunks written as one batch over 8 roots: no root holds more than
    one over the even share (by digest alone the busiest would hold more),
    some chunks lie under their second root, and every chunk reads back
    exact."""
    roots = _roots(tmp_path, 8)
    keys = [f"req-7/chunk-{i}" for i in range(48)]
    st, src = _written(roots, keys)
    try:
        where = _where(roots, keys)
        counts = [where.count(r) for r in range(8)]
        by_digest = [sum(root_index(8, chunk_digest(k)) == r for k in keys) for r in range(8)]
        assert max(counts) <= math.ceil(len(keys) / 8) + 1 < max(by_digest), (counts, by_digest)
        digests = [chunk_digest(k) for k in keys]
        assert where == place_roots(8, digests)
        assert any(w != root_index(8, d) for w, d in zip(where, digests))
        out, dst = _read(st, keys)
        assert out == list(range(len(keys))) and bytes(dst) == bytes(src)
    finally:
        st.close()


def test_chunks_under_their_second_root_are_found_by_every_path(tmp_path, capsys):
    """A new store on the same paths (its scan indexes them), and one whose
    index is emptied (each lookup then stats both places): contains, read,
    path_for and remove all find chunks under their second root; fsck calls
    none of them misplaced."""
    from lmcache_fx.tools.cli import main

    roots = _roots(tmp_path, 4)
    keys = [f"second/{i}" for i in range(24)]
    st, src = _written(roots, keys)
    st.close()
    where = _where(roots, keys)
    second = [k for k, w in zip(keys, where) if w != root_index(4, chunk_digest(k))]
    assert second
    for forget in (False, True):
        st = _store(roots)
        try:
            if forget:
                st._index.clear()
            assert all(st.contains(k) for k in keys)
            if forget:
                st._index.clear()
            out, dst = _read(st, keys)
            assert out == list(range(len(keys))) and bytes(dst) == bytes(src)
            for k, w in zip(keys, where):
                assert st.path_for(chunk_digest(k)) == os.path.join(
                    roots[w], chunk_digest(k)[:2], chunk_digest(k) + ".fxkv"
                )
        finally:
            st.close()
    assert main(["fsck", ",".join(roots), "--json"]) == 0
    assert '"misplaced"' not in capsys.readouterr().out
    st = _store(roots)
    try:
        st._index.clear()
        gone = second[0]
        assert st.remove(gone) and not st.contains(gone)
        assert not os.path.exists(st.path_for(chunk_digest(gone)))
        assert all(st.contains(k) for k in keys if k != gone)
    finally:
        st.close()


def test_a_chunk_stored_by_another_process_is_rewritten_where_it_lies(tmp_path):
    """A write of a chunk this store has not indexed, already lying under its
    second root (another process's write), goes to that root again, not to
    the other: one file per chunk, its bytes the new ones."""
    roots = _roots(tmp_path, 4)
    keys = [f"other/{i}" for i in range(16)]
    _written(roots, keys)[0].close()
    where = _where(roots, keys)
    k2 = next(k for k, w in zip(keys, where) if w != root_index(4, chunk_digest(k)))
    j = keys.index(k2)
    new = _payloads(1)
    st = _store(roots)
    try:
        st._index.clear()
        # a batch in which the chunk's first root would be the less loaded one
        batch = [(k2, new.address, SIZE, META)]
        assert st.write(batch) == [True]
        assert _where(roots, [k2]) == [where[j]]
        st._index.clear()
        out, dst = _read(st, [k2])
        assert out == [0] and bytes(dst) == bytes(new)
    finally:
        st.close()


def test_a_lone_chunk_goes_where_digest_striping_put_it(tmp_path):
    """A batch of one takes its first choice (a tie): what older versions of
    the store wrote and read, so either reads the other's lone chunks."""
    roots = _roots(tmp_path, 3)
    src = _payloads(1)
    st = _store(roots)
    try:
        for i in range(12):
            k = f"lone/{i}"
            assert st.write([(k, src.address, SIZE, META)]) == [True]
            assert _where(roots, [k]) == [root_index(3, chunk_digest(k))]
    finally:
        st.close()


@pytest.mark.parametrize("n", [2, 3])
def test_paths_for_lists_the_places_a_lookup_tries(tmp_path, n):
    roots = _roots(tmp_path, n)
    d = chunk_digest("x")
    a, b = root_choices(n, d)
    assert paths_for(roots, d) == [os.path.join(roots[r], d[:2], d + ".fxkv") for r in (a, b)]
    assert paths_for(roots[:1], d) == [os.path.join(roots[0], d[:2], d + ".fxkv")]


def test_a_batch_cut_into_sub_batches_is_balanced_as_a_whole(odirect_tmp, monkeypatch):
    """An O_DIRECT store writes a large batch in sub-batches (here of 2
    chunks); the roots are chosen for the whole batch first, so 48 chunks
    over 8 roots still hold no more than one over the even share each."""
    from lmcache_fx.core import store as store_mod

    monkeypatch.setattr(store_mod, "WRITE_SUB_CHUNKS", 2)
    monkeypatch.setattr(store_mod, "WRITE_SUB_BYTES", SIZE)
    roots = _roots(odirect_tmp, 8)
    keys = [f"subs/{i}" for i in range(48)]
    src = _payloads(len(keys))
    st = _store(roots, odirect="true")
    try:
        calls = []
        real = st._start_chunk_files

        def counting(weng, todo, out, background, started):
            calls.append(len(todo))
            return real(weng, todo, out, background, started)

        monkeypatch.setattr(st, "_start_chunk_files", counting)
        assert all(st.write([(k, src.address + i * SIZE, SIZE, META) for i, k in enumerate(keys)]))
        assert calls == [2] * 24, calls
        counts = [_where(roots, keys).count(r) for r in range(8)]
        assert max(counts) <= 48 // 8 + 1, counts
        out, dst = _read(st, keys)
        assert out == list(range(len(keys))) and bytes(dst) == bytes(src)
    finally:
        st.close()


def _second_root_key(roots, prefix="k"):
    """A key whose second root differs from its first (always, with 2+ roots) and a copy path there."""
    k = f"{prefix}/0"
    d = chunk_digest(k)
    a, b = root_choices(len(roots), d)
    name = os.path.join(d[:2], d + ".fxkv")
    return k, os.path.join(roots[a], name), os.path.join(roots[b], name)


def test_the_same_key_twice_in_a_batch_is_one_file(tmp_path):
    roots = _roots(tmp_path, 4)
    src = _payloads(2)
    st = _store(roots)
    try:
        assert st.write([("twice", src.address, SIZE, META), ("twice", src.address + SIZE, SIZE, META)]) == [True, True]
        _where(roots, ["twice"])  # exactly one file
        assert place_roots(4, [chunk_digest("twice")] * 3) == [root_choices(4, chunk_digest("twice"))[0]] * 3
    finally:
        st.close()


def test_two_copies_heal_on_rewrite_and_both_go_on_remove(tmp_path):
    """Two writers that raced can leave a chunk under both its roots (made
    here by copying the file). Storing it again keeps one file, the new
    bytes, found by a store whose index still names the other copy; remove
    takes every copy."""

    roots = _roots(tmp_path, 4)
    k, first, second = _second_root_key(roots)
    old, new = _payloads(1), _payloads(1)
    a, b = _store(roots), _store(roots)
    try:
        assert a.write([(k, old.address, SIZE, META)]) == [True] and os.path.exists(first)
        os.makedirs(os.path.dirname(second), exist_ok=True)
        shutil.copyfile(first, second)
        a._index.clear()
        assert a.contains(k)
        a._index[chunk_digest(k)] = Entry(second, os.path.getsize(second))  # as if it had found that copy
        b._index.clear()
        assert b.write([(k, new.address, SIZE, META)]) == [True]
        assert os.path.exists(first) != os.path.exists(second)  # one copy left
        assert a.contains(k)  # its index named the copy that went: found under the other root
        out, dst = _read(a, [k])
        assert out == [0] and bytes(dst) == bytes(new)
        os.makedirs(os.path.dirname(second), exist_ok=True)
        here = a.path_for(chunk_digest(k))
        shutil.copyfile(here, first if here == second else second)
        assert os.path.exists(first) and os.path.exists(second)
        assert b.remove(k) and not os.path.exists(first) and not os.path.exists(second)
        assert not a.contains(k) and not b.contains(k)
    finally:
        a.close()
        b.close()


def test_fsck_reports_a_second_copy_as_duplicate_not_an_error(tmp_path, capsys):
    """A chunk under both its roots (made here by copying it): fsck names
    the second copy DUPLICATE, once, and exits 0; the store's next write of
    the chunk leaves one file, and fsck then reports nothing."""
    import json

    from lmcache_fx.tools.cli import main

    roots = _roots(tmp_path, 3)
    k, first, second = _second_root_key(roots, "dup")
    st, src = _written(roots, [k, "dup/other"])
    try:
        os.makedirs(os.path.dirname(second), exist_ok=True)
        shutil.copyfile(first, second)
        assert main(["fsck", ",".join(roots), "--json"]) == 0
        dup = [p for p in json.loads(capsys.readouterr().out)["problems"] if p["kind"] == "duplicate"]
        assert len(dup) == 1 and dup[0]["path"] in (first, second)
        both = dup[0]["path"] + " " + dup[0]["problem"]
        assert first in both and second in both  # one copy named as the problem, the other in its text
        st._index.clear()
        assert st.write([(k, src.address, SIZE, META)]) == [True]
        assert os.path.exists(first) != os.path.exists(second)
        assert main(["fsck", ",".join(roots), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["problems"] == []
    finally:
        st.close()


def _evicted_by_another_process(roots, key):
    """Removes `key`'s file wherever it lies, behind this store's back."""
    for p in paths_for(roots, chunk_digest(key)):
        if os.path.exists(p):
            os.unlink(p)


def _first_place_holds_a_symlink(st, roots, key):
    """Moves `key`'s file under its other root (as another process's write or
    a rebalance may leave it) and plants a symlink to it at its first place:
    a lookup must not take the link, and must find the file."""
    d = chunk_digest(key)
    a, b = root_choices(len(roots), d)
    first, other = paths_for(roots, d)
    src = first if os.path.exists(first) else other
    if src != other:
        os.makedirs(os.path.dirname(other), exist_ok=True)
        os.rename(src, other)
    os.makedirs(os.path.dirname(first), exist_ok=True)
    os.symlink(other, first)
    return first, other


def test_lookup_of_a_prefix_looks_past_a_chunk_found_under_its_other_root(tmp_path):
    """store.lookup stats a batch in one call that stops at the first name
    that is not a regular file; a chunk found there under its other root
    must not end the prefix, and the names after it are looked at anew."""
    roots = _roots(tmp_path, 3)
    keys = [f"prefix/{i}" for i in range(8)]
    st, src = _written(roots, keys)
    try:
        first, other = _first_place_holds_a_symlink(st, roots, keys[3])
        fresh = _store(roots)  # nothing indexed: every chunk looked for at its first place
        try:
            assert fresh.lookup(keys, prefix=True) == [True] * 8
            assert fresh.path_for(chunk_digest(keys[3])) == other and os.path.islink(first)
        finally:
            fresh.close()
        # Indexed under its first place (this process wrote it there): gone from there, found anew.
        if st.path_for(chunk_digest(keys[3])) == first:
            assert st.lookup(keys, prefix=True) == [True] * 8
            assert st.path_for(chunk_digest(keys[3])) == other
    finally:
        st.close()


def test_lookup_prefix_stops_at_the_first_miss_and_pins_only_hits(tmp_path):
    roots = _roots(tmp_path, 2)
    keys = [f"pins/{i}" for i in range(6)]
    st, src = _written(roots, keys)
    try:
        _evicted_by_another_process(roots, keys[2])
        assert st.lookup(keys) == [True, True, False, True, True, True]
        assert st.lookup(keys, pin=True, prefix=True) == [True, True, False, False, False, False]
        assert sorted(st._pins) == sorted(chunk_digest(k) for k in keys[:2])
        assert [st.unpin(k) for k in keys] == [True, True, False, False, False, False]
        assert chunk_digest(keys[2]) not in st._index  # the index forgot the file that went
        assert st.lookup([]) == [] and st.lookup([], prefix=True) == []
    finally:
        st.close()


def test_a_pinned_lookup_touches_stale_chunks_in_order_and_no_symlink(tmp_path, monkeypatch):
    """The shared LRU clock: a pinned lookup sets the mtime of each chunk not
    touched for TOUCH_SECONDS (one C call for the batch), strictly
    increasing in the order asked, and leaves the recently touched ones and
    a symlink planted as a chunk (and what it points to) alone."""
    from lmcache_fx.core import store as store_mod

    roots = _roots(tmp_path, 2)
    keys = [f"touch/{i}" for i in range(6)]
    st, src = _written(roots, keys)
    try:
        outside = tmp_path / "outside"
        outside.write_bytes(b"x")
        os.utime(outside, ns=(1, 1))
        first, other = _first_place_holds_a_symlink(st, roots, keys[5])
        os.unlink(other)  # only the link is left in the chunk's place: absent, never touched through
        os.unlink(first)
        os.symlink(outside, first)
        old = 1_000_000_000
        for k in keys[:5]:
            os.utime(st.path_for(chunk_digest(k)), ns=(old, old))
        monkeypatch.setattr(store_mod, "TOUCH_SECONDS", 3600.0)
        st2 = _store(roots)  # fresh: entries' recency from the files' (old) mtimes
        try:
            st2.lookup(keys[:1], pin=True)  # touched now: the next lookup leaves it
            assert st2.settle_touches()  # set by the store's toucher thread
            t0 = os.stat(st2.path_for(chunk_digest(keys[0]))).st_mtime_ns
            order = [keys[3], keys[1], keys[0], keys[4], keys[2], keys[5]]
            assert st2.lookup(order, pin=True) == [True] * 5 + [False]
            assert st2.settle_touches()
            m = {k: os.stat(st2.path_for(chunk_digest(k))).st_mtime_ns for k in keys[:5]}
            assert m[keys[0]] == t0 > old
            assert old < m[keys[3]] < m[keys[1]] < m[keys[4]] < m[keys[2]]
            assert os.lstat(outside).st_mtime_ns == 1 and os.path.islink(first)
        finally:
            st2.close()
    finally:
        st.close()


def test_contains_and_pin_of_one_key_agree_with_the_batch_lookup(tmp_path):
    """contains() and pin() take a one-chunk path of their own (no batch
    lists); they must answer as lookup() does: a hit, a chunk evicted by
    another process (and forgotten by the index), one moved under its other
    root behind a planted symlink (found there, the link not taken), and a
    symlink to a file outside the store (a miss). pin() pins only the hits
    and touches a stale one's LRU clock."""
    roots = _roots(tmp_path, 2)
    keys = [f"one/{i}" for i in range(5)]
    st, src = _written(roots, keys)
    try:
        _evicted_by_another_process(roots, keys[1])
        first, other = _first_place_holds_a_symlink(st, roots, keys[2])
        outside = tmp_path / "outside.fxkv"
        shutil.copyfile(other if os.path.exists(other) else first, outside)
        f3, o3 = _first_place_holds_a_symlink(st, roots, keys[3])
        os.unlink(o3)
        os.unlink(f3)
        os.symlink(outside, f3)
        want = [True, False, True, False, True]
        old = 1_000_000_000
        os.utime(st.path_for(chunk_digest(keys[4])), ns=(old, old))
        fresh = _store(roots)  # nothing indexed: each looked for at its first place
        try:
            assert [fresh.contains(k) for k in keys] == want == fresh.lookup(keys)
            assert fresh.path_for(chunk_digest(keys[2])) == other and os.path.islink(first)
        finally:
            fresh.close()
        fresh = _store(roots)
        try:
            assert [fresh.pin(k) for k in keys] == want
            assert sorted(fresh._pins) == sorted(chunk_digest(k) for k, w in zip(keys, want) if w)
            assert fresh.settle_touches()
            assert os.stat(fresh.path_for(chunk_digest(keys[4]))).st_mtime_ns > old  # touched: was stale
            assert [fresh.unpin(k) for k in keys] == want and not any(fresh._pins.values())
        finally:
            fresh.close()
        assert [st.contains(k) for k in keys] == want  # this process's index, checked on disk
        assert chunk_digest(keys[1]) not in st._index and chunk_digest(keys[3]) not in st._index
        assert st.lookup(keys) == want
    finally:
        st.close()


def test_a_chunk_left_under_both_roots_keeps_only_its_newer_copy_at_start(tmp_path):
    """A commit renames a chunk into place under one root and then removes a
    copy under its other root: each on its own filesystem's log, so a power
    cut can keep both. The older copy was counted, and read again once the
    newer was evicted. A store starting alone on the paths removes it."""
    roots = _roots(tmp_path, 2)
    keys = [f"dup/{i}" for i in range(4)]
    st, src = _written(roots, keys)
    newer = st.path_for(chunk_digest(keys[0]))
    st.close()
    older = next(p for p in paths_for(roots, chunk_digest(keys[0])) if p != newer)
    os.makedirs(os.path.dirname(older), exist_ok=True)
    shutil.copyfile(newer, older)
    os.utime(older, ns=(1_000_000_000, 1_000_000_000))
    st2 = _store(roots)
    try:
        assert os.path.exists(newer) and not os.path.exists(older)
        files = [os.path.join(d, f) for r in roots for d, _, fs in os.walk(r) for f in fs if f.endswith(".fxkv")]
        assert len(files) == len(keys) and st2.usage_bytes == sum(os.path.getsize(f) for f in files)
        got, dst = _read(st2, keys)
        assert all(h is not None for h in got) and bytes(dst) == bytes(src)
    finally:
        st2.close()


def test_a_process_listing_the_paths_otherwise_is_told(tmp_path, caplog, monkeypatch):
    """Two processes listing a striped store's paths in another order kept
    two ledgers (the first path holds it) and each filled the cap on its own:
    the store held 1.78x the cap, with nothing said. The same list with a
    path added (a rolling restart) shared the ledger but not the count. The
    second opener now warns once, naming both lists; the same list says
    nothing."""
    import logging

    from lmcache_fx.core import once

    monkeypatch.setattr(once, "_said", set())
    a, b, c = _roots(tmp_path, 3)
    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        _store([a, b]).close()
        _store([a, b]).close()
        assert not [r for r in caplog.records if "same order" in r.getMessage()]
        _store([b, a]).close()  # another order: b first holds a second ledger
        _store([a, b, c]).close()  # a path added
    said = [r.getMessage() for r in caplog.records if "same order" in r.getMessage()]
    assert len(said) == 3, said
    assert said[0].startswith(f"lmcache-fx: {a} is listed first by another process")
    assert f"this process lists {b},{a}" in said[0]
    assert said[1].startswith(f"lmcache-fx: {a} was last opened with the paths listed as {a},{b};")
    assert f"this process lists {a},{b},{c}" in said[1]
    assert said[2].startswith(f"lmcache-fx: {b} is listed first by another process")  # the [b, a] process


def test_a_path_that_leads_to_another_directory_than_before_is_named(tmp_path, caplog, monkeypatch):
    """A drive not mounted at a restart leaves its mount point, an empty
    directory of the root filesystem, at the listed path. The store said
    that it "was last opened with the paths listed as A,B; this process
    lists A,B" (two same lists) and to list the paths alike. It now names
    the path that leads elsewhere and says what that means."""
    import logging

    from lmcache_fx.core import once

    monkeypatch.setattr(once, "_said", set())
    a, b = _roots(tmp_path, 2)
    _store([a, b]).close()
    os.rename(b, b + ".mounted-before")
    os.mkdir(b)  # what an unmounted drive's mount point is: another directory at the same path
    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        _store([a, b]).close()
    said = [r.getMessage() for r in caplog.records if "lmcache-fx" in r.getMessage()]
    moved = [m for m in said if "is not the directory it was" in m]
    assert len(moved) == 1 and f"store path {b} is" in moved[0] and "not mounted" in moved[0], said
    assert not [m for m in said if "same order" in m], said


def test_processes_setting_another_max_capacity_gb_are_told(tmp_path, caplog, monkeypatch):
    """Each process evicts the shared usage down to its own cap: the
    smallest governs, and its process evicts the others' chunks again and
    again (a review: 6870 evictions against 73 in 12 s), with nothing said.
    An opener whose max_capacity_gb differs from the last opener's now warns
    once, naming the setting and both values; the same cap says nothing."""
    import logging

    from lmcache_fx.core import once

    monkeypatch.setattr(once, "_said", set())
    (a,) = _roots(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        _store([a], max_capacity_gb=2).close()
        _store([a], max_capacity_gb=2).close()
        assert not [r for r in caplog.records if "max_capacity_gb" in r.getMessage()]
        _store([a], max_capacity_gb=0.5).close()
    said = [r.getMessage() for r in caplog.records if "max_capacity_gb" in r.getMessage()]
    assert len(said) == 1, said
    assert "max_capacity_gb is 0.5 in this process but 2 in the last process" in said[0], said
    assert "Set the same max_capacity_gb in every process" in said[0]


def test_a_directory_listed_twice_under_two_names_is_refused_and_loses_nothing(tmp_path, capsys):
    """path: a,b where b is a symlink to a (or a bind mount of it). Each chunk
    was found under both names, taken for two copies and unlinked as the
    older one: at start every chunk went, and each chunk stored later was
    unlinked right after its commit (0 files, the usage still counting
    them). The store refuses such a list, naming both and the fix; doctor
    fails it; what is stored under a stays."""
    from lmcache_fx.core.options import ConfigError
    from lmcache_fx.tools.cli import main as cli

    (a,) = _roots(tmp_path, 1)
    link = str(tmp_path / "r0-link")
    os.symlink(a, link)
    st = _store([a])
    n = 12
    buf = _payloads(n)
    keys = [f"twice-{i}" for i in range(n)]
    assert all(st.write([(k, buf.address + i * SIZE, SIZE, META) for i, k in enumerate(keys)]))
    st.close()
    files = sorted(f for _, _, fs in os.walk(a) for f in fs if f.endswith(".fxkv"))
    assert len(files) == n
    for roots in ([a, link], [link, a]):
        with pytest.raises(ConfigError, match=r"is the same directory as .*list each directory once"):
            _store(roots)
    assert sorted(f for _, _, fs in os.walk(a) for f in fs if f.endswith(".fxkv")) == files
    st = _store([a])
    try:
        assert st.contains(keys[0]) and len(st) == n
    finally:
        st.close()
    capsys.readouterr()
    rc = cli(["doctor", "--path", f"{a},{link}", "--json"])
    obj = json.loads(capsys.readouterr().out)
    bad = [c for c in obj["checks"] if c["name"].endswith("paths")]
    assert rc != 0 and not obj["fast_path"] and bad and bad[0]["status"] == "fail", obj["verdict"]
    assert link in bad[0]["summary"] and a in bad[0]["summary"]


def test_chunks_misplaced_by_a_path_added_are_still_served(tmp_path, capsys):
    """A path added to a striped store (a,b -> a,b,c) leaves some chunks under
    neither of their two paths. fsck called them unreachable unless the
    paths were given as when they were written; the store serves them from
    the index its start-up walk builds, and fsck now says so."""
    from lmcache_fx.tools.cli import main as cli

    a, b, c = _roots(tmp_path, 3)
    n = 48
    buf = _payloads(n)
    keys = [f"added-{i}" for i in range(n)]
    st = _store([a, b])
    assert all(st.write([(k, buf.address + i * SIZE, SIZE, META) for i, k in enumerate(keys)]))
    st.close()
    capsys.readouterr()
    cli(["fsck", f"{a},{b},{c}", "--json"])
    mis = [p for p in json.loads(capsys.readouterr().out)["problems"] if p["kind"] == "misplaced"]
    assert mis and all("serves it from the index" in p["problem"] for p in mis), mis
    st = _store([a, b, c])
    try:
        dst = fx.HostBuffer(n * SIZE)
        it = iter(range(n))
        got = st.read(keys, lambda m: (lambda i: (i, dst.address + i * SIZE, SIZE))(next(it)), lambda h: None)
        assert got == list(range(n)) and bytes(dst) == bytes(buf)
    finally:
        st.close()
