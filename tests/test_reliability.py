"""Reliability and security: faults of a real cluster, each with a figure.

Every case runs real trials (real files, real XFS on loop devices, real
io_uring, real processes killed with SIGKILL) and reports its figure through
`figure()`: printed, and appended to $FX_RELIABILITY_OUT for
scripts/reliability.py, which regenerates docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from faults import fxfault as F

from lmcache_fx import _fxio
from lmcache_fx.core.chunkfile import HEADER_SIZE, BadHeader, ChunkMeta, chunk_digest, decode_header, encode_header
from lmcache_fx.core.options import ConfigError, FxOptions
from lmcache_fx.core.store import ChunkStore
from lmcache_fx.testing import loopfs

pytestmark = pytest.mark.reliability

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


figure = F.figure  # one row of docs/reliability.md (shared with tests/test_store_security.py)


@pytest.fixture
def store_dir(request, tmp_path):
    """A store directory on XFS on a loop device (O_DIRECT) when root, else on tmp_path."""
    if loopfs.why_not_available() is None:
        return request.getfixturevalue("xfs_store")
    return str(tmp_path / "store")


def fs_of(path: str) -> str:
    """'xfs', 'ext4', ... of the filesystem holding path (for the figures)."""
    best, fstype = "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            mnt, typ = line.split()[1], line.split()[2]
            if (path + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best):
                best, fstype = mnt, typ
    return fstype


def need_root_xfs():
    why = loopfs.why_not_available()
    if why:
        pytest.skip(f"XFS loop filesystem: {why}")


# ------------------------------------------------------------------ crashes
CRASH_TRIALS = 60


def test_sigkill_during_stores(store_dir):
    """A writer process killed with SIGKILL at a random moment, then a restart."""
    rng = random.Random(20240607)
    done_total = found_beyond = wrong = lost = tmp_left = acct_bad = killed_mid = 0
    tmp_seen = mid_write = large_found = 0
    for t in range(CRASH_TRIALS):
        # Every child stops for good between writing a batch's temporaries and renaming them (a test-only
        # hook, tests/faults/fxfault.py pause_in_commit) at a random batch, so no child ever finishes. Odd
        # trials are killed right there (mid-write, whatever the machine's speed), even ones at a random moment.
        # Every third trial writes batches of up to 24 chunks in overlapped sub-batches of 4; in another
        # third one chunk in ten is a payload of 8-9 MiB, written in checksummed 2 MiB segments.
        subs, large = t % 3 == 2, t % 3 == 1
        args = {"path": store_dir, "seed": t, "n": 400, "pause_at": rng.randint(1, 30), "large": large}
        p = F.spawn("writer", {**args, "sub_batches": subs, "batch_max": 24 if subs else 6})
        assert p.stdout.readline().strip() == "READY", p.stderr.read()
        early = []
        if t % 2:
            line = ""
            while line != "MIDWRITE":
                line = p.stdout.readline().strip()
                assert line, p.stderr.read()[-2000:]
                early.append(line)
            mid_write += 1
        else:
            time.sleep(rng.uniform(0.0, 0.25))
        p.send_signal(signal.SIGKILL)
        so, _ = p.communicate(timeout=30)
        so = "\n".join(early) + "\n" + so
        done = [int(x.split()[1]) for x in so.splitlines() if x.startswith("DONE ")]
        killed_mid += "FINISHED" not in so
        tmp_seen += len(F.tmp_files(store_dir))
        # Restart: a fresh store on the same directory.
        s = F.open_store(store_dir)
        try:
            tmp_left += len(F.tmp_files(store_dir))
            files = F.chunk_files(store_dir)
            if s.usage_bytes != sum(os.path.getsize(f) for f in files) or len(s) != len(files):
                acct_bad += 1
            keys = [f"crash/{t}/{i}" for i in range(max(done, default=-1) + 8)]
            got = s.read(keys, F.allocator(), lambda h: None)
            for i, (k, h) in enumerate(zip(keys, got)):
                if h is None:
                    lost += i in done
                    continue
                if F.check(k, memoryview(h)) != "ok":
                    wrong += 1
                elif i not in done:
                    found_beyond += 1  # renamed into place just before the kill
                large_found += len(memoryview(h)) > (8 << 20)
            done_total += len(done)
            if t >= 2:  # keep the directory bounded: drop trial t-2
                for i in range(400):
                    s.remove(f"crash/{t - 2}/{i}")
        finally:
            s.close()
    figure(
        "SIGKILL of a writer process at a random moment (store API; every third trial in overlapped "
        "sub-batches of 4 chunks; in another third, one chunk in ten of 8-9 MiB, written in checksummed "
        "segments), then restart",
        CRASH_TRIALS,
        "zero wrong chunks; every completed store found; temporaries removed at start; usage == bytes of files",
        fs=fs_of(store_dir),
        killed_mid_run=killed_mid,
        killed_between_write_and_rename=mid_write,
        trials_in_sub_batches=CRASH_TRIALS // 3,
        trials_with_large_payloads=CRASH_TRIALS // 3,
        large_chunks_found_after_restart=large_found,
        completed_stores=done_total,
        found_after_restart=done_total - lost,
        extra_whole_chunks=found_beyond,
        wrong_chunks=wrong,
        temporaries_left_by_kills=tmp_seen,
        temporaries_after_restart=tmp_left,
        accounting_mismatches=acct_bad,
    )
    assert killed_mid == CRASH_TRIALS and mid_write == CRASH_TRIALS // 2 and tmp_seen >= mid_write
    assert wrong == 0 and lost == 0 and tmp_left == 0 and acct_bad == 0 and large_found > 0


def test_writer_killed_right_after_sizing_a_temporary_leaves_no_undercount(store_dir):
    """A writer SIGKILLed just after the reservation sized its first
    temporary (before its write or commit): the shared usage, as a peer
    that had the store open reads it, counts at least every byte on disk
    (an undercount lets the store pass its cap), and after the peer removes
    the dead writer's temporary it equals the files' bytes again."""
    peer = F.open_store(store_dir)
    try:
        src = F.Chunks()
        assert all(peer.write([src.item(f"before/{i}", 300_000) for i in range(3)]))
        p = F.spawn("writer", {"path": store_dir, "seed": 1, "n": 1, "kill_after_sizing": True})
        assert p.stdout.readline().strip() == "READY", p.stderr.read()
        p.communicate(timeout=60)
        assert p.returncode == -signal.SIGKILL
        tmps = F.tmp_files(store_dir)
        assert len(tmps) == 1 and os.path.getsize(tmps[0]) > HEADER_SIZE, tmps
        on_disk = sum(os.path.getsize(f) for f in F.chunk_files(store_dir) + tmps)
        assert peer.usage_bytes >= on_disk

        F.recompute_overtaken(peer)  # keeps the ledger, less the dead writer's temporaries
        assert F.tmp_files(store_dir) == []
        assert peer.usage_bytes == sum(os.path.getsize(f) for f in F.chunk_files(store_dir))
    finally:
        peer.close()


@pytest.mark.slow
def test_sigkill_through_plugin(tmp_path):
    """The same through a real LMCacheEngine, twice on one store: killed at a
    random moment after its 1st and then its 3rd completed prompt."""
    store = str(tmp_path / "store")
    rng = random.Random(1)
    completed = whole = wrong = tmp_before = tmp_after = 0
    for trial, after in enumerate((1, 3)):
        base = 100 * trial  # new prompts each trial, on the same directory
        # the store after `after` prompts stops between its temporaries and the rename (test-only hook)
        p = F.spawn(
            "plugin",
            {
                "role": "store",
                "path": store,
                "workdir": str(tmp_path),
                "n": base + 40,
                "base": base,
                "pause_after": after,
            },
        )
        assert p.stdout.readline().strip() == "READY", p.stderr.read()[-3000:]
        done = 0
        while True:
            line = p.stdout.readline().strip()
            assert line, p.stderr.read()[-3000:]
            if line == "MIDWRITE":
                break
            done += line.startswith("DONE ")
        time.sleep(rng.uniform(0.0, 0.05))
        p.send_signal(signal.SIGKILL)
        so, _ = p.communicate(timeout=30)
        n_done = done + sum(1 for x in so.splitlines() if x.startswith("DONE "))
        tmp_before += len(F.tmp_files(store))
        r = F.result_of(
            F.spawn(
                "plugin", {"role": "retrieve", "path": store, "workdir": str(tmp_path), "n": base + 40, "base": base}
            ),
            300,
        )
        tmp_after += len(F.tmp_files(store))
        completed += n_done
        whole += sum(1 for n in r["got"][:n_done] if n == 512)
        wrong += r["wrong"]
    figure(
        "SIGKILL of an LMCacheEngine storing through the plugin, then a fresh engine on the same store",
        2,
        "completed prompts retrieved whole and bit-exact; no wrong tokens; temporaries removed",
        prompts_completed=completed,
        retrieved_whole=whole,
        wrong=wrong,
        temporaries_left_by_kills=tmp_before,
        temporaries_after_restart=tmp_after,
    )
    assert wrong == 0 and whole == completed and tmp_after == 0
    assert completed == 4 and tmp_before >= 2  # each kill landed mid-write: its temporaries were left


# ------------------------------------------------------------------ concurrency
def test_concurrent_processes_and_tp_ranks(store_dir):
    """Writers and readers in separate processes on one path, two TP ranks
    (different worker ids), then churn and deletion under readers."""
    size = (1 << 20) + 4096 * 3 + 17  # multi-piece reads (split 64K)
    common = {"path": store_dir, "nkeys": 24, "size": size}
    phase1 = [("writer", 0, 1), ("writer", 0, 2), ("writer", 1, 3), ("reader", 0, 4), ("reader", 1, 5)]
    procs = [F.spawn("conc", dict(common, role=r, rank=k, seed=s, seconds=6, delay=1.0)) for r, k, s in phase1]
    res1 = [F.result_of(p, 120) for p in procs]
    # Every chunk a writer completed is there, whole, for its rank.
    s = F.open_store(store_dir)
    lost = wrong = 0
    for r in res1:
        if r["role"] != "writer":
            continue
        h, m, bad = F.read_check(s, r["done"], r["rank"])
        lost += m
        wrong += len(bad)
    s.close()
    phase2 = [("churn", 0, 6), ("churn", 0, 7), ("remover", 0, 8), ("reader", 0, 9), ("reader", 0, 10)]
    common["nkeys"] = 8  # few keys: replacements and deletions land on the chunks being read
    procs = [F.spawn("conc", dict(common, role=r, rank=k, seed=s, seconds=5)) for r, k, s in phase2]
    res2 = [F.result_of(p, 120) for p in procs]
    readers = [r for r in res1 + res2 if r["role"] == "reader"]
    torn = sum(len(r["bad"]) for r in readers)
    r1 = [r for r in res1 if r["role"] == "reader"]
    r2 = [r for r in res2 if r["role"] == "reader"]
    figure(
        "Concurrent processes on one path: 3 writers (2 TP ranks) + 2 readers for 6 s, then 2 writers "
        "replacing chunks with new versions + a deleter + 2 readers for 5 s (1 MiB chunks, 64 KiB pieces)",
        10,
        "no torn or foreign-rank reads; no completed chunk lost; no crash when files vanish under readers",
        processes=10,
        phase1_reads=f"{sum(r['hits'] for r in r1)} hits / {sum(r['misses'] for r in r1)} misses",
        phase2_reads=f"{sum(r['hits'] for r in r2)} hits / {sum(r['misses'] for r in r2)} misses",
        torn_or_foreign=torn,
        completed_by_writers=sum(len(r["done"]) for r in res1 if r["role"] == "writer"),
        lost=lost,
        wrong_after=wrong,
        replaced=sum(r["writes"] for r in res2 if r["role"] == "churn"),
        deleted_under_readers=sum(r["removed"] for r in res2),
        crashes=0,
    )
    assert torn == 0 and lost == 0 and wrong == 0
    assert sum(r["hits"] for r in r1) > 0 and sum(r["hits"] for r in r2) > 0


# ------------------------------------------------------------------ full disk
def test_full_disk(tmp_path):
    need_root_xfs()
    with loopfs.xfs_loop("320M") as mnt, F.LogCount() as logs:
        path = os.path.join(mnt, "store")
        # Ballast leaves ~40 MiB for the store, whose cap (10 GB) is far above the disk.
        st = os.statvfs(mnt)
        with open(os.path.join(mnt, "ballast"), "wb") as f:
            f.truncate(0)
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - (40 << 20))
        s = F.open_store(path, max_capacity_gb=10)
        chunk = 1 << 20
        stored, n = [], 0
        raised = 0
        t_full = None
        for b in range(200):  # fill until ENOSPC, then a burst of 30 more batches
            src = F.Chunks()
            keys = [f"full/{n + i}" for i in range(4)]
            n += 4
            try:
                ok = s.write([src.item(k, chunk + 4096 * (i % 2)) for i, k in enumerate(keys)])
            except Exception:
                raised += 1
                continue
            stored += [k for k, g in zip(keys, ok) if g]
            if not all(ok) and t_full is None:
                t_full = b
            if t_full is not None and b - t_full >= 30:
                break
        assert t_full is not None, "the disk never filled"
        errors_in_burst = logs.count(logging.ERROR, "ENOSPC")
        other_warnings = logs.count(logging.WARNING, "store failed")
        # Reads keep working while the disk is full.
        present = [k for k in stored if s.contains(k)]
        hits, misses, bad = F.read_check(s, present)
        # Stores resume once the quiet period ends: eviction made room.
        time.sleep(max(0.0, max(s._full_until.values(), default=0.0) - time.monotonic()) + 0.1)
        src = F.Chunks()
        resumed = s.write([src.item(f"full/resume/{i}", chunk) for i in range(1)])
        h2, m2, bad2 = F.read_check(s, ["full/resume/0"])
        s.close()
    figure(
        "Full disk: 320 MB XFS loop filled to ENOSPC (ballast + 1 MiB chunks, cap far above the disk)",
        f"{n} chunk stores",
        "one logged error per burst; no raise; reads keep working; stores resume after eviction frees space",
        stored_before_full=len(stored),
        failing_batches_in_burst=30,
        errors_logged=errors_in_burst,
        per_chunk_warnings=other_warnings,
        raised=raised,
        reads_while_full=f"{hits}/{len(present)} hit, {len(bad)} wrong",
        resumed=bool(resumed[0] and h2 == 1),
    )
    assert raised == 0 and errors_in_burst == 1 and other_warnings == 0
    assert hits == len(present) and not bad
    assert resumed == [True] and h2 == 1 and not bad2


def test_a_disk_another_writer_fills_does_not_drain_the_store(tmp_path):
    """Another writer fills the store's filesystem and takes every byte the
    store frees. Each burst of ENOSPC evicted 5 % of the store, for room the
    other writer then took: the cache drained burst by burst and nothing new
    was stored. An eviction for room is repeated only once the store grew
    into what the last one freed."""
    need_root_xfs()
    with loopfs.xfs_loop("400M") as mnt, F.LogCount() as logs:
        s = F.open_store(os.path.join(mnt, "store"), max_capacity_gb=10)
        src = F.Chunks()
        keys = [f"tenant/{i}" for i in range(32)]
        assert s.write([src.item(k, 1 << 20) for k in keys]) == [True] * len(keys)
        before = s.usage_bytes
        with open(os.path.join(mnt, "other-writer"), "wb") as other:

            def take_free_space():
                os.sync()  # XFS frees a removed file's blocks in the background: counted once flushed
                st = os.statvfs(mnt)
                free = st.f_bavail * st.f_frsize - (256 << 10)
                if free > 0:
                    os.posix_fallocate(other.fileno(), os.fstat(other.fileno()).st_size, free)

            take_free_space()
            stored = []
            for b in range(6):
                s._full_until.clear()  # each burst now, not 5 s after the last
                stored += s.write([src.item(f"tenant/new/{b}", 1 << 20)])
                take_free_space()
        kept = sum(s.contains(k) for k in keys)
        after = s.usage_bytes
        hits, _, bad = F.read_check(s, [k for k in keys if s.contains(k)])
        s.close()
        skipped = logs.count(logging.WARNING, "not evicting again")
    figure(
        "Full disk, filled by another writer that takes every byte the store frees (400 MB XFS loop, 32 x 1 MiB chunks)",
        "6 ENOSPC bursts",
        "one eviction for room, not one per burst; the chunks kept read back right",
        chunks_kept=f"{kept}/{len(keys)}",
        usage_after_vs_before=round(after / before, 3),
        evictions_skipped_with_a_warning=skipped,
        wrong=len(bad),
    )
    assert stored == [False] * 6
    assert kept >= len(keys) - 3 and after >= 0.9 * before  # one 5 % eviction at most
    assert skipped >= 4 and hits == kept and not bad


@contextlib.contextmanager
def _striped_over_two_xfs(n_warm: int):
    """A store striped over two XFS loops holding n_warm 256 KiB chunks:
    (mount 0, mount 1, roots, store, sources, chunk bytes, warm keys)."""
    need_root_xfs()
    with loopfs.xfs_loop("320M") as m0, loopfs.xfs_loop("320M") as m1:
        roots = [os.path.join(m0, "fx"), os.path.join(m1, "fx")]
        s = F.open_store(",".join(roots), max_capacity_gb=1)
        try:
            src, chunk = F.Chunks(), 256 << 10
            warm = [f"warm/{i}" for i in range(n_warm)]
            assert all(s.write([src.item(k, chunk) for k in warm]))
            yield m0, m1, roots, s, src, chunk, warm
        finally:
            s.close()


def test_one_full_path_of_a_striped_store_sends_its_chunks_to_the_others(tmp_path):
    """A store striped over two filesystems, one of them filled by another
    writer. The full one's ENOSPC skipped stores on every path for 5 s at a
    time and evicted 5 % of the store by age, mostly from the path with room
    (a review: 40 of 1192 chunks stored in 16 s, 18 of 60 older chunks
    evicted, the error naming no path and asking to lower the cap). Now the
    chunks bound for the full path go under their other one: every batch
    after the first stores whole, nothing is evicted, the older chunks all
    hit, and the error and problem() name the full path."""
    with _striped_over_two_xfs(24) as (m0, m1, roots, s, src, chunk, warm), F.LogCount() as logs:
        assert all(F.chunk_files(r) for r in roots)  # both paths hold some
        st = os.statvfs(m1)
        with open(os.path.join(m1, "other-writer"), "wb") as other:
            os.posix_fallocate(other.fileno(), 0, st.f_bavail * st.f_frsize - (1 << 20))
        on_full = len(F.chunk_files(roots[1]))
        stored = []
        for b in range(12):
            keys = [f"new/{b}/{i}" for i in range(8)]
            stored.append(s.write([src.item(k, chunk) for k in keys]))
        assert all(all(ok) for ok in stored[1:]), [sum(ok) for ok in stored]
        assert sum(stored[0]) >= 4, stored[0]  # at most the chunks bound for the full path failed
        assert s.stats.evictions == 0
        hits, misses, bad = F.read_check(s, warm)
        assert (hits, misses, bad) == (len(warm), 0, [])
        assert len(F.chunk_files(roots[1])) <= on_full + 4  # what the last 1 MiB there took
        problem = s.problem()
        assert problem is not None and roots[1] in problem and "other paths" in problem, problem
        said = [r.getMessage() for r in logs.records if r.levelno >= logging.ERROR and "ENOSPC" in r.getMessage()]
        assert said and all(roots[1] in m and roots[0] not in m for m in said), said


def test_a_read_only_path_of_a_striped_store_sends_its_chunks_to_the_others(tmp_path):
    """One of a striped store's two filesystems remounted read-only (or
    its permissions lost, its device failing): it kept its share of every
    write batch, each of those chunks failing, for as long as it lasted, and
    problem() said nothing while some stores still worked (a review: 188 of
    576 failed over 8 s). Now its chunks go under their other path for 5 s
    at a time, and problem() names the path and the error."""
    with _striped_over_two_xfs(16) as (m0, m1, roots, s, src, chunk, warm):
        subprocess.run(["mount", "-o", "remount,ro", m1], check=True)
        try:
            stored = [s.write([src.item(f"new/{b}/{i}", chunk) for i in range(8)]) for b in range(10)]
            assert all(all(ok) for ok in stored[1:]), [sum(ok) for ok in stored]
            problem = s.problem()
            assert problem is not None and roots[1] in problem and "Read-only" in problem, problem
            assert F.read_check(s, warm) == (len(warm), 0, [])
        finally:
            subprocess.run(["mount", "-o", "remount,rw", m1], check=True)


def test_a_striped_store_starts_with_a_read_only_path(tmp_path):
    """A restart with one of a striped store's filesystems read-only (XFS
    remounts itself so after an I/O error): the store refused to start, so
    the whole cache, and the server with it, went down for one drive. It now
    starts with a warning naming the path: the chunks there are served, new
    ones go under the other path, problem() and doctor say so. The first
    path (the shared usage lives there) read-only still refuses."""
    from lmcache_fx.tools import doctor

    with _striped_over_two_xfs(16) as (m0, m1, roots, s, src, chunk, warm):
        s.close()
        subprocess.run(["mount", "-o", "remount,ro", m1], check=True)
        try:
            with F.LogCount() as logs:
                s2 = F.open_store(",".join(roots), max_capacity_gb=1)
            try:
                said = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
                assert any(roots[1] in m and "read-only" in m for m in said), said
                assert F.chunk_files(roots[1]) and F.read_check(s2, warm) == (len(warm), 0, [])
                on_ro = sorted(F.chunk_files(roots[1]))
                stored = [s2.write([src.item(f"new/{b}/{i}", chunk) for i in range(8)]) for b in range(4)]
                assert all(all(ok) for ok in stored), [sum(ok) for ok in stored]
                assert sorted(F.chunk_files(roots[1])) == on_ro  # all went under the other path
                assert F.read_check(s2, [f"new/{b}/{i}" for b in range(4) for i in range(8)])[:3] == (32, 0, [])
                problem = s2.problem()
                assert problem is not None and roots[1] in problem and "read-only" in problem, problem
                assert not s2.stats.write_errors
                # LMCache deletes a chunk there (its file stays) and stores the key again: it goes under the
                # other path. That re-store was skipped as if every path were full: an ENOSPC error, 5 % of
                # the store evicted, and 5 s of stores skipped (a review).
                k = next(k for k in warm if s2.path_for(chunk_digest(k)).startswith(roots[1] + "/"))
                with F.LogCount() as logs:
                    assert s2.remove(k)
                    assert s2.write([src.item(k, chunk)]) == [True]
                    again = [s2.write([src.item(f"again/{b}/{i}", chunk) for i in range(8)]) for b in range(3)]
                assert all(all(ok) for ok in again) and s2.stats.evictions == 0
                assert not [r for r in logs.records if "ENOSPC" in r.getMessage()]
                assert F.read_check(s2, [k])[:3] == (1, 0, [])
            finally:
                s2.close()
            checks = doctor.check_path(roots[1], FxOptions.from_mapping({"path": ",".join(roots)}), "", first=False)
            (c,) = [c for c in checks if c.name == "path"]
            assert c.status == "warn" and "starts" in c.summary, c
            assert not [c for c in checks if c.status == "fail"], checks  # its O_DIRECT probe would write there
            # gc cannot remove the chunks there: it says why, not that they were read or replaced meanwhile
            out = subprocess.run(
                [sys.executable, "-m", "lmcache_fx.tools.cli", "gc", ",".join(roots), "--to-gb", "0"],
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
            assert f"could not remove {roots[1]}/" in out and "Read-only file system" in out, out
            assert "since the listing" not in out, out
            with pytest.raises(ConfigError, match="read-only"):
                F.open_store(",".join(reversed(roots)), max_capacity_gb=1)
        finally:
            subprocess.run(["mount", "-o", "remount,rw", m1], check=True)


def _reopened_read_only_at_start(s, m1: str, roots: list[str]):
    """Store s closed and opened again over the same paths with the second
    path's filesystem (mounted at m1) read-only, then remounted read-write:
    the new store found it read-only at start."""
    s.close()
    subprocess.run(["mount", "-o", "remount,ro", m1], check=True)
    try:
        return F.open_store(",".join(roots), max_capacity_gb=1)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", m1], check=True)


def test_a_path_read_only_at_start_takes_chunks_again_once_remounted_read_write(tmp_path, monkeypatch):
    """A striped store started with one path read-only used that path again
    only after a restart, though the operator had fixed it (remounted it
    read-write): half the store's room sat unused, and the chunks there
    could not be evicted. The store looks at such a path again every
    READ_ONLY_LOOK_SECONDS: writable, it takes its share of new chunks, the
    store's problem() is gone and the change is said once."""
    from lmcache_fx.core import store as store_mod

    with _striped_over_two_xfs(8) as (m0, m1, roots, s, src, chunk, warm):
        s2 = _reopened_read_only_at_start(s, m1, roots)
        try:
            before = sorted(F.chunk_files(roots[1]))
            assert s2.write([src.item(f"ro/{i}", chunk) for i in range(8)]) == [True] * 8
            assert sorted(F.chunk_files(roots[1])) == before  # not looked at again yet: all went under roots[0]
            assert s2.problem() is not None and roots[1] in s2.problem()
            monkeypatch.setattr(store_mod, "READ_ONLY_LOOK_SECONDS", 0.0, raising=False)  # the interval passed
            with F.LogCount() as logs:
                assert s2.write([src.item(f"rw/{i}", chunk) for i in range(16)]) == [True] * 16
            assert len(F.chunk_files(roots[1])) > len(before), "the path takes chunks again"
            said = [r.getMessage() for r in logs.records if "writable again" in r.getMessage()]
            assert len(said) == 1 and roots[1] in said[0], said
            assert s2.problem() is None
            keys = warm + [f"ro/{i}" for i in range(8)] + [f"rw/{i}" for i in range(16)]
            assert F.read_check(s2, keys)[:3] == (len(keys), 0, [])
        finally:
            s2.close()


def test_a_path_remounted_read_only_while_running_is_steered_around_until_writable(tmp_path, monkeypatch):
    """A path whose filesystem went read-only while the store ran was marked
    failing for 5 s at a time: every 5 s one batch's chunks for it failed
    (EROFS), counted as write errors, for as long as it stayed read-only (a
    review: [4, 8, 8, 8, 8, 8] of 8 stored over six batches, again after each
    5 s). Found read-only, it is now steered around until a look finds it
    writable; remounted read-write, it takes chunks again."""
    from lmcache_fx.core import store as store_mod

    with _striped_over_two_xfs(8) as (m0, m1, roots, s, src, chunk, warm):
        subprocess.run(["mount", "-o", "remount,ro", m1], check=True)
        try:
            first = s.write([src.item(f"a/{i}", chunk) for i in range(8)])
            errors = s.stats.write_errors
            assert errors == 8 - sum(first) and errors > 0, first  # its chunks bound for roots[1] failed once
            time.sleep(5.5)  # past the 5 s a failing path used to be avoided for
            later = [s.write([src.item(f"b/{b}/{i}", chunk) for i in range(8)]) for b in range(3)]
            assert all(all(ok) for ok in later) and s.stats.write_errors == errors, [sum(ok) for ok in later]
            assert roots[1] in s.problem()
        finally:
            subprocess.run(["mount", "-o", "remount,rw", m1], check=True)
        on_rw = len(F.chunk_files(roots[1]))
        monkeypatch.setattr(store_mod, "READ_ONLY_LOOK_SECONDS", 0.0)
        assert s.write([src.item(f"c/{i}", chunk) for i in range(16)]) == [True] * 16
        assert len(F.chunk_files(roots[1])) > on_rw and s.problem() is None


@contextlib.contextmanager
def _ext4_that_errors_read_only(size_mb: int = 96):
    """ext4 on a RAM-backed loop device mounted errors=remount-ro: yields
    (mount point, a function that makes the filesystem meet an error, as a
    failing disk would: the kernel then refuses every write with EROFS
    while reads go on, and statvfs need not say read-only)."""
    need_root_xfs()
    if not shutil.which("mkfs.ext4"):
        pytest.skip("mkfs.ext4 not installed (e2fsprogs)")
    img = f"/dev/shm/lmcache-fx-ext4-{os.getpid()}.img"
    mnt = None
    loop = None
    try:
        with open(img, "wb") as f:
            f.truncate(size_mb << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True, capture_output=True)
        loop = subprocess.run(["losetup", "-f", "--show", img], check=True, capture_output=True, text=True)
        loop = loop.stdout.strip()
        trigger = f"/sys/fs/ext4/{os.path.basename(loop)}/trigger_fs_error"
        mnt = tempfile.mkdtemp(prefix="lmcache-fx-ext4-")
        subprocess.run(["mount", "-o", "errors=remount-ro", loop, mnt], check=True, capture_output=True)
        if not os.path.exists(trigger):
            pytest.skip(f"this kernel has no {trigger} to make the filesystem meet an error")

        def fail() -> None:
            with open(trigger, "w") as f:
                f.write("lmcache-fx test\n")

        yield mnt, fail
    finally:
        if mnt is not None:
            subprocess.run(["umount", mnt], capture_output=True)
            os.rmdir(mnt)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True)
        if os.path.exists(img):
            os.unlink(img)


def test_a_store_whose_ledger_cannot_be_written_stores_nothing_past_its_cap(tmp_path):
    """The first path of a striped store (where the shared usage is kept)
    meets an error and its filesystem refuses writes (EROFS), reads going
    on. Chunks went to the second path, but every write of the usage failed
    unseen and left the old record valid: the usage froze, nothing was
    evicted, and the second path grew past max_capacity_gb (a review: 2.6x
    the cap in 20 batches, not a word about the usage). Stores are skipped
    now while the usage cannot be written, with a warning and problem()
    naming the file."""
    with _ext4_that_errors_read_only() as (m0, fail), loopfs.tmpfs("size=256m") as m1:
        roots = [os.path.join(m0, "fx"), os.path.join(m1, "fx")]
        s = F.open_store(",".join(roots), max_capacity_gb=16 / 1024)
        try:
            cap = s.options.max_capacity_bytes
            src, chunk = F.Chunks(), 256 << 10
            assert all(s.write([src.item(f"warm/{i}", chunk) for i in range(8)]))
            fail()
            with F.LogCount() as logs:
                stored = sum(sum(s.write([src.item(f"new/{b}/{i}", chunk) for i in range(8)])) for b in range(20))
            on_disk = sum(os.path.getsize(p) for r in roots for p in F.chunk_files(r))
            assert on_disk <= cap, (stored, on_disk, cap)
            said = [r.getMessage() for r in logs.records if "usage cannot be written" in r.getMessage()]
            assert said and os.path.join(roots[0], ".fx") in said[0], [r.getMessage() for r in logs.records]
            assert "usage cannot be written" in s.problem(), s.problem()
        finally:
            s.close()


def test_a_path_an_error_made_read_only_is_steered_around_not_tried_every_5_s(tmp_path, monkeypatch):
    """ext4's errors=remount-ro refuses writes with EROFS without the
    read-only flag statvfs shows, so the path was only marked failing for
    5 s at a time: every 5 s a batch's chunks for it failed again (a review:
    failures at 0, 5.1 and 10.2 s). EROFS itself marks it read-only now
    until a look finds it takes writes (an O_TMPFILE made there)."""
    from lmcache_fx.core import store as store_mod

    with loopfs.tmpfs("size=256m") as m0, _ext4_that_errors_read_only() as (m1, fail):
        roots = [os.path.join(m0, "fx"), os.path.join(m1, "fx")]
        s = F.open_store(",".join(roots), max_capacity_gb=1)
        try:
            src, chunk = F.Chunks(), 256 << 10
            assert all(s.write([src.item(f"warm/{i}", chunk) for i in range(8)]))
            fail()
            first = s.write([src.item(f"a/{i}", chunk) for i in range(8)])
            errors = s.stats.write_errors
            assert errors == 8 - sum(first) and errors > 0, first
            monkeypatch.setattr(store_mod, "READ_ONLY_LOOK_SECONDS", 0.0)  # looks at every batch
            time.sleep(5.5)  # past the 5 s a failing path is avoided for
            later = [s.write([src.item(f"b/{b}/{i}", chunk) for i in range(8)]) for b in range(3)]
            assert all(all(ok) for ok in later) and s.stats.write_errors == errors, [sum(ok) for ok in later]
            assert roots[1] in s.problem()
        finally:
            s.close()


def test_a_path_writable_again_but_refused_stays_unused_and_says_why(tmp_path, monkeypatch):
    """A path read-only at start, remounted read-write but made writable by
    every user meanwhile (mode 777, which the store refuses at start): it
    stayed failing as "read-only filesystem", silently (a review). It stays
    unused, now with the reason the store refuses it, said once; fixed, it
    takes chunks again."""
    from lmcache_fx.core import store as store_mod

    with _striped_over_two_xfs(8) as (m0, m1, roots, s, src, chunk, warm):
        s2 = _reopened_read_only_at_start(s, m1, roots)
        mode = os.stat(roots[1]).st_mode & 0o7777
        os.chmod(roots[1], 0o777)
        try:
            monkeypatch.setattr(store_mod, "READ_ONLY_LOOK_SECONDS", 0.0)
            before = sorted(F.chunk_files(roots[1]))
            with F.LogCount() as logs:
                for b in range(3):
                    assert s2.write([src.item(f"r/{b}/{i}", chunk) for i in range(8)]) == [True] * 8
            assert sorted(F.chunk_files(roots[1])) == before
            said = [r.getMessage() for r in logs.records if "writable again" in r.getMessage()]
            assert len(said) == 1 and "refused" in said[0] and "every user" in said[0], said
            assert "every user" in s2.problem(), s2.problem()
            os.chmod(roots[1], mode)
            assert s2.write([src.item(f"ok/{i}", chunk) for i in range(16)]) == [True] * 16
            assert len(F.chunk_files(roots[1])) > len(before) and s2.problem() is None
        finally:
            os.chmod(roots[1], mode)
            s2.close()


def test_chunks_whose_two_paths_are_both_read_only_are_skipped_not_taken_for_a_full_store(tmp_path):
    """Three paths, the last two read-only at start: a chunk may go under two
    of the three, and those whose two are both read-only were counted as a
    full store: every path marked full (nothing stored for 5 s at a time), an
    ENOSPC error asking to lower the cap, and 5 % of the store evicted again
    and again (a review: 0 of 472 stored in 30 s, 3 of 20 warm chunks
    evicted). They are skipped, said with the paths; the rest are stored."""
    need_root_xfs()
    with loopfs.xfs_loop("320M") as m0, loopfs.xfs_loop("320M") as m1, loopfs.xfs_loop("320M") as m2:
        roots = [os.path.join(m, "fx") for m in (m0, m1, m2)]
        src, chunk = F.Chunks(), 256 << 10
        s = F.open_store(",".join(roots), max_capacity_gb=1)
        warm = [f"warm/{i}" for i in range(24)]
        try:
            assert all(s.write([src.item(k, chunk) for k in warm]))
        finally:
            s.close()
        for m in (m1, m2):
            subprocess.run(["mount", "-o", "remount,ro", m], check=True)
        try:
            s = F.open_store(",".join(roots), max_capacity_gb=1)
            try:
                with F.LogCount() as logs:
                    stored = [s.write([src.item(f"new/{b}/{i}", chunk) for i in range(8)]) for b in range(6)]
                n = sum(sum(ok) for ok in stored)
                assert 0 < n < 48 and sum(stored[-1]) > 0, [sum(ok) for ok in stored]  # a third can go nowhere
                assert s.stats.evictions == 0 and F.read_check(s, warm) == (len(warm), 0, [])
                said = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
                assert not [m for m in said if "ENOSPC" in m], said
                assert any("not stored" in m and roots[1] in m and roots[2] in m for m in said), said
            finally:
                s.close()
        finally:
            for m in (m1, m2):
                subprocess.run(["mount", "-o", "remount,rw", m], check=True)


def test_a_read_only_path_holding_more_than_the_cap_is_said_and_not_walked_for_room(tmp_path):
    """A striped store restarted with a read-only path whose chunks alone are
    more than max_capacity_gb: nothing can be stored (they count in the
    usage and cannot be evicted). Each batch, and each chunk of it, walked
    the whole store twice under the lock looking for room (a review: 300
    walks in 30 batches), and the warning blamed pinned chunks. Now a walk
    that found nothing is not repeated for a while at the same usage, and
    the warning names the read-only path."""
    with _striped_over_two_xfs(40) as (m0, m1, roots, s, src, chunk, warm):
        on_ro = sum(os.path.getsize(p) for p in F.chunk_files(roots[1]))
        s.close()
        subprocess.run(["mount", "-o", "remount,ro", m1], check=True)
        try:
            s2 = F.open_store(",".join(roots), max_capacity_gb=on_ro * 0.8 / (1 << 30))
            try:
                scans = s2.stats.snapshot()["scans"]
                with F.LogCount() as logs:
                    stored = [s2.write([src.item(f"new/{b}/{i}", chunk) for i in range(4)]) for b in range(10)]
                assert not any(any(ok) for ok in stored)
                assert s2.stats.snapshot()["scans"] - scans <= 4  # 60 before, in these 10 quick batches
                said = [r.getMessage() for r in logs.records if "no room" in r.getMessage()]
                assert said and all(roots[1] in m and "read-only" in m for m in said), said
            finally:
                s2.close()
        finally:
            subprocess.run(["mount", "-o", "remount,rw", m1], check=True)


def test_a_walk_that_found_no_room_is_made_again_once_another_process_changed_the_store(store_dir):
    """After an eviction that walked and freed nothing (every chunk pinned),
    the evictor skips walks for a moment while nothing changes. Keyed on the
    shared usage alone, a process whose peer then replaced every chunk (the
    usage back at the same value: a full store of same-size chunks) never
    walked again and failed every write while it kept writing (a review:
    10 of 10 over 5 s). Keyed on the ledger's change count, it walks."""
    chunk = 256 << 10
    cap = 8 * (HEADER_SIZE + chunk) / (1 << 30)
    a = F.open_store(store_dir, max_capacity_gb=cap)
    try:
        src = F.Chunks()
        mine = [f"a/{i}" for i in range(8)]
        assert all(a.write([src.item(k, chunk)])[0] for k in mine)
        assert all(a.pin(k) for k in mine)
        assert a.write([src.item("x", chunk)]) == [False]  # nothing to evict: every chunk pinned
        for k in mine:
            a.unpin(k)
        code = (
            f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); from faults import fxfault as F; "
            f"s = F.open_store({store_dir!r}, max_capacity_gb={cap!r}); src = F.Chunks(); "
            f"assert all(s.write([src.item(f'b/{{i}}', {chunk})])[0] for i in range(8)); s.close()"
        )
        subprocess.run(
            [sys.executable, "-c", code], check=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__))
        )
        got = [a.write([src.item(f"y/{j}", chunk)])[0] for j in range(4)]
        assert got == [True] * 4, got
        assert F.read_check(a, [f"y/{j}" for j in range(4)])[:3] == (4, 0, [])
    finally:
        a.close()


def test_a_full_disk_eviction_spares_the_prompt_it_stopped(tmp_path):
    """A write that meets ENOSPC evicts 5 % of the store by age once it ends.
    Where the store held little else, that was the first chunks of the very
    write that met it, and the rest of its prompt, stored, could never be a
    hit (LMCache needs the prefix; found with a tmpfs and XFS another writer
    filled). The write's own chunks are spared: every chunk it said it
    stored is there after it."""
    need_root_xfs()
    with loopfs.xfs_loop("300M") as mnt:
        s = F.open_store(os.path.join(mnt, "store"), max_capacity_gb=10)
        src = F.Chunks()
        with open(os.path.join(mnt, "other-writer"), "wb") as other:
            os.sync()
            st = os.statvfs(mnt)
            left = st.f_bavail * st.f_frsize - (6 << 20)  # room for about six of the next eight
            os.posix_fallocate(other.fileno(), 0, left)
            keys = [f"prompt/{i}" for i in range(8)]
            out = s.write([src.item(k, 1 << 20) for k in keys])
        assert 0 < sum(out) < len(keys), out
        assert [s.contains(k) for k in keys] == out, out
        hits, _, bad = F.read_check(s, [k for k, ok in zip(keys, out) if ok])
        assert hits == sum(out) and not bad
        s.close()


# ------------------------------------------------------------------ EIO
def test_injected_eio(tmp_path):
    """The device under the store starts failing every I/O (EIO)."""
    need_root_xfs()
    if not _have("xfs_io"):
        pytest.skip("xfs_io not found (xfsprogs)")
    with F.failing_xfs() as (mnt, fail), F.LogCount() as logs:
        path = os.path.join(mnt, "store")
        s = F.open_store(path)
        keys = [f"eio/{i}" for i in range(16)]
        src = F.Chunks()
        assert all(s.write([src.item(k, 262144 + 4096 * i) for i, k in enumerate(keys)]))
        h0, _, _ = F.read_check(s, keys)
        fail()
        out = {}

        def go():
            try:
                out["read"] = F.read_check(s, keys)  # inodes cached: the reads themselves fail
                out["contains_new"] = s.contains("eio/never-stored")
                src2 = F.Chunks()
                out["write"] = s.write([src2.item(f"eio/new/{i}", 262144) for i in range(4)])
                loopfs.drop_caches()
                s.stats.add()
                out["read2"] = F.read_check(s, keys)  # and now the opens fail too
                try:
                    s2 = F.open_store(path)
                    out["restart"] = f"started, {len(s2)} chunks"
                    out["restart_read"] = F.read_check(s2, keys)
                    s2.close()
                except ConfigError as e:
                    out["restart"] = f"ConfigError: {e}"
            except Exception as e:  # a crash is the failure this test looks for
                out["raised"] = repr(e)

        t0 = time.monotonic()
        th = threading.Thread(target=go, daemon=True)
        th.start()
        th.join(60)
        took = time.monotonic() - t0
        hung = th.is_alive()
        s.close()
        warnings = logs.count(logging.WARNING)
        read_warnings = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
    print("\n".join(read_warnings))
    hits, misses, bad = out.get("read", (None, None, None))
    figure(
        "Injected EIO: the loop device under the store's XFS fails every I/O (its backing filesystem is shut down)",
        f"{len(keys)} reads + 4 stores + a restart",
        "misses and warnings; no exception; no hang",
        hits_before=h0,
        hits_after=hits,
        misses_after=misses,
        misses_after_drop_caches=(out.get("read2") or (0, 0))[1],
        wrong=len(bad or []),
        stores_ok=sum(out.get("write", [])),
        warnings=warnings,
        raised=out.get("raised"),
        restart=out.get("restart"),
        seconds=round(took, 2),
        hung=hung,
    )
    assert not hung and "raised" not in out
    assert hits == 0 and misses == len(keys) and not bad and out["read2"][:2] == (0, len(keys))
    assert not any(out["write"]) and warnings >= 1


def _have(tool):
    import shutil

    return shutil.which(tool) is not None


# ------------------------------------------------------------------ frozen filesystem
def test_hits_do_not_wait_for_a_frozen_filesystem(monkeypatch):
    """fsfreeze (what an LVM or cloud snapshot does) blocks every write to
    the filesystem until it thaws. A hit's recency (its mtime, the shared LRU
    clock) was set on the lookup and read path, so a pinned lookup and a
    read of a chunk due a touch waited for the thaw; LMCache's scheduler
    waited with them. The toucher sets it afterwards, on its own thread."""
    from lmcache_fx.core import store as store_mod

    need_root_xfs()
    if not _have("fsfreeze"):
        pytest.skip("fsfreeze not found (util-linux)")
    monkeypatch.setattr(store_mod, "TOUCH_SECONDS", 0.0)  # every hit is due a touch
    keys = [f"frozen/{i}" for i in range(8)]
    with loopfs.xfs_loop("400M") as mnt:  # mkfs.xfs makes none under 300 MB
        s = F.open_store(os.path.join(mnt, "s"))
        src = F.Chunks()
        assert s.write([src.item(k, 256 << 10) for k in keys]) == [True] * len(keys)
        old = 1_000_000_000
        for k in keys:
            os.utime(s.path_for(chunk_digest(k)), ns=(old, old))
        got: dict = {}

        def hits():
            t0 = time.monotonic()
            got["lookup"] = s.lookup(keys, pin=True)
            got["read"] = F.read_check(s, keys)
            got["s"] = time.monotonic() - t0

        subprocess.run(["fsfreeze", "-f", mnt], check=True)
        try:
            t = threading.Thread(target=hits, daemon=True)
            t.start()
            t.join(10)
            hung = t.is_alive()
        finally:
            subprocess.run(["fsfreeze", "-u", mnt], check=True)
        t.join(30)
        touched = s.settle_touches(10)
        mtimes = [os.stat(s.path_for(chunk_digest(k))).st_mtime_ns for k in keys]
        for k in keys:
            s.unpin(k)
        s.close()
    figure(
        "Frozen filesystem (fsfreeze, as a snapshot does) under a pinned lookup and a read of chunks due an LRU touch",
        len(keys),
        "the lookup and the read return while frozen, whole and right; the recency is set after the thaw",
        returned_while_frozen=not hung,
        seconds=round(got.get("s", -1), 3),
        lookup_hits=sum(got.get("lookup", [])),
        read=f"{got['read'][0]}/{len(keys)} hit, {len(got['read'][2])} wrong" if "read" in got else "none",
        touched_after_thaw=touched and all(m > old for m in mtimes),
    )
    assert not hung, "a hit waited for the frozen filesystem"
    assert got["lookup"] == [True] * len(keys) and got["read"] == (len(keys), 0, [])
    assert touched and all(m > old for m in mtimes)


# ------------------------------------------------------------------ slow medium
@contextlib.contextmanager
def _reads_throttled(dev: str, bps: int):
    """This process's reads of block device `dev` limited to `bps` bytes/s
    (a cgroup v1 blkio throttle); skips where that cannot be set."""
    base = "/sys/fs/cgroup/blkio"
    if not os.path.isfile(os.path.join(base, "blkio.throttle.read_bps_device")):
        pytest.skip("no cgroup v1 blkio throttle here to make a slow device")
    cg = os.path.join(base, f"fx-slow-{os.getpid()}")
    rdev = os.stat(dev).st_rdev
    os.makedirs(cg, exist_ok=True)
    try:
        with open(os.path.join(cg, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{os.major(rdev)}:{os.minor(rdev)} {bps}")
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        yield
    finally:
        with open(os.path.join(base, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(cg)


def _device_of(mnt: str) -> str:
    with open("/proc/self/mounts") as f:
        return next(line.split()[0] for line in f if line.split()[1] == mnt)


@pytest.mark.parametrize("io_engine", ["io_uring", "threads"])
def test_a_cancelled_read_waits_only_for_what_is_in_flight(io_engine):
    """An awaited read cancelled (asyncio.wait_for timing out) while its batch
    runs on a slow device: the engine went on reading every piece of the
    batch, so the timeout returned only once the whole read was done, with
    nothing in flight but its queue depth. Pieces and chunk files not yet
    begun now end unread; what is in flight completes, and every handle is
    released."""
    need_root_xfs()
    bps, n, size = 16 << 20, 24, 4 << 20  # the whole read takes 6 s at this speed
    with loopfs.xfs_loop("400M") as mnt:
        s = F.open_store(os.path.join(mnt, "s"), io_engine=io_engine)
        keys = [f"slow/{i}" for i in range(n)]
        src = F.Chunks()
        assert s.write([src.item(k, size) for k in keys]) == [True] * n
        taken, freed = [0], [0]
        alloc = F.allocator()

        def allocate(meta):
            taken[0] += 1
            return alloc(meta)

        async def cancelled():
            try:
                await asyncio.wait_for(s.read_async(keys, allocate, lambda h: freed.__setitem__(0, freed[0] + 1)), 0.5)
                return "completed"
            except asyncio.TimeoutError:
                return "timed out"

        loopfs.drop_caches()
        with _reads_throttled(_device_of(mnt), bps):
            t0 = time.monotonic()
            outcome = asyncio.run(cancelled())
            took = time.monotonic() - t0
        hits, _, bad = F.read_check(s, keys)  # unthrottled: the store is whole
        s.close()
    whole = n * size / bps
    figure(
        f"A read cancelled (asyncio.wait_for, 0.5 s) on a slow device (reads throttled to 16 MiB/s; 24 x 4 MiB; {io_engine})",
        1,
        "the cancel returns once what is in flight is read, not the whole batch; handles released; store whole",
        outcome=outcome,
        cancel_returned_after_s=round(took, 2),
        whole_read_s=round(whole, 1),
        handles=f"{freed[0]} of {taken[0]} released",
        read_back=f"{hits}/{n} hit, {len(bad)} wrong",
    )
    assert outcome == "timed out"
    assert took < 0.6 * whole, f"the cancel waited {took:.1f} s of a {whole:.0f} s read"
    assert freed[0] == taken[0] and hits == n and not bad


def test_a_read_cancelled_while_it_waits_for_the_engines_slots_reads_nothing():
    """A running batch that waits its turn for one of the engine's queue
    slots (another batch holds them) and is cancelled meanwhile: it read its
    first piece into its buffer once the slot came, for nobody. Now it ends
    unread."""
    need_root_xfs()
    mib = 1 << 20
    with loopfs.xfs_loop("400M") as mnt:
        for name, size in (("a", 8 * mib), ("b", 4 * mib)):
            with open(os.path.join(mnt, name), "wb") as f:
                f.write(os.urandom(size))
        loopfs.drop_caches()
        eng = _fxio.Engine("io_uring", queue_depth=1, split_bytes=mib)
        fa = os.open(os.path.join(mnt, "a"), os.O_RDONLY | os.O_DIRECT)
        fb = os.open(os.path.join(mnt, "b"), os.O_RDONLY | os.O_DIRECT)
        da, db = _fxio.HostBuffer(8 * mib), _fxio.HostBuffer(4 * mib)
        try:
            with _reads_throttled(_device_of(mnt), 16 * mib):  # a's 8 pieces: half a second
                a = eng.submit([(fa, 0, 8 * mib, da.address)])
                time.sleep(0.05)  # a holds the one slot
                b = eng.submit([(fb, 0, 4 * mib, db.address)])
                time.sleep(0.02)  # b is running, waiting for the slot
                assert b.cancel() is False  # running: it stops where it is
                got_b, got_a = b.wait(), a.wait()
        finally:
            os.close(fa)
            os.close(fb)
            eng.close()
    assert got_a == [8 * mib]
    assert got_b == [-errno.ECANCELED] and bytes(db) == bytes(4 * mib), "b read after its cancel"


# ------------------------------------------------------------------ store directory replaced
def test_a_store_directory_replaced_under_a_running_store(tmp_path):
    """The store's directory removed and made again (rm -rf, mkdir), or a
    filesystem mounted on it unmounted lazily (umount -l, root only). Writes
    found fan-out directories by path, lookups and reads through the root's
    descriptor opened at start: every store said stored and none was ever
    read, and with umount -l the chunks filled the filesystem below, counted
    in no ledger of it. Now stores are refused with a warning naming the
    directory, and nothing is written under the new one."""
    cases = ["replaced"] + (["unmounted"] if os.geteuid() == 0 else [])
    seen: dict = {}
    for case in cases:
        root = str(tmp_path / case)
        os.makedirs(root)
        if case == "unmounted":
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=700", "fx-replaced", root], check=True)
        try:
            with F.LogCount() as logs:
                s = F.open_store(root)
                src = F.Chunks()
                assert s.write([src.item(f"{case}/before", 64 << 10)]) == [True]
                if case == "replaced":
                    shutil.rmtree(root)
                    os.makedirs(root)
                else:
                    subprocess.run(["umount", "-l", root], check=True)
                stored = s.write([src.item(f"{case}/after/{i}", 64 << 10) for i in range(4)])
                problem = s.problem()  # what a health report says (the L2 adapter's report_status)
                files_under_new = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
                warned = [
                    r
                    for r in logs.records
                    if "was removed, replaced or unmounted" in r.getMessage() and root in r.getMessage()
                ]
                s.close()
            fresh = F.open_store(root)  # a restart uses the new directory
            assert fresh.write([src.item(f"{case}/new", 64 << 10)]) == [True]
            hits, _, bad = F.read_check(fresh, [f"{case}/new"])
            fresh.close()
        finally:
            if case == "unmounted":
                subprocess.run(["umount", "-l", root], check=False, capture_output=True)
        seen[case] = dict(
            stored=stored, files_under_new=files_under_new, warned=len(warned), new_ok=(hits, bad), problem=problem
        )
    figure(
        "Store directory removed and made again, or a filesystem on it unmounted lazily, under a running store",
        len(cases),
        "stores refused with a warning naming the directory; nothing written under the new one; a restart uses it",
        **{f"{c}_stored": sum(v["stored"]) for c, v in seen.items()},
        **{f"{c}_files_under_new": len(v["files_under_new"]) for c, v in seen.items()},
        **{f"{c}_warnings": v["warned"] for c, v in seen.items()},
    )
    for case, v in seen.items():
        assert v["stored"] == [False] * 4, case
        assert v["files_under_new"] == [], case
        assert v["warned"] == 1, case
        assert v["new_ok"] == (1, []), case
        assert v["problem"] and "was removed, replaced or unmounted" in v["problem"], case


# ------------------------------------------------------------------ no io_uring
@pytest.mark.slow
def test_no_io_uring_under_seccomp(tmp_path):
    base = str(tmp_path / "s")
    plain = F.result_of(F.spawn("noring", {"path": base + "-plain"}))
    eperm = F.result_of(
        F.spawn("noring", {"path": base + "-eperm", "deny": errno.EPERM, "plugin": True, "workdir": str(tmp_path)}), 300
    )
    enosys = F.result_of(F.spawn("noring", {"path": base + "-enosys", "deny": errno.ENOSYS}))
    # A profile that allows io_uring_setup but not io_uring_enter: the ring was made, every read then
    # failed (each chunk a miss) and nothing fell back.
    enter = F.result_of(F.spawn("noring", {"path": base + "-enter", "deny": errno.EPERM, "calls": [426]}))
    figure(
        "No io_uring: backend started under a seccomp filter denying io_uring (EPERM as Docker, and ENOSYS), "
        "or only io_uring_enter",
        4,
        "thread engine, exactly one warning for two stores, same bytes as with io_uring; "
        "io_engine: io_uring refused naming the option; a real LMCacheEngine round trip",
        engine_without_filter=plain["kinds"][0],
        engine_eperm=eperm["kinds"],
        engine_enosys=enosys["kinds"],
        engine_enter_denied=enter["kinds"],
        warnings=[eperm["warnings"], enosys["warnings"], enter["warnings"]],
        reason=eperm["fallback_reason"],
        same_bytes=eperm["digest"] == plain["digest"] == enosys["digest"] == enter["digest"],
        strict=eperm["strict"][:90],
        plugin=eperm["plugin"],
    )
    if plain["kinds"][0] != "io_uring":
        pytest.skip(f"io_uring unavailable even without the filter: {plain['why']}")
    assert "io_uring_enter failed" in enter["fallback_reason"] and "seccomp" in enter["fallback_reason"]
    for r in (eperm, enosys, enter):
        assert not r["io_uring_usable"]
        assert r["kinds"] == ["threads", "threads"] and r["warnings"] == 1
        assert r["stored"] == 12 and r["bad"] == 0 and r["digest"] == plain["digest"]
        assert r["strict"].startswith("io_engine:")
    assert eperm["plugin"]["engine"] == "threads" and eperm["plugin"]["tokens"] == 1024 and eperm["plugin"]["equal"]


# ------------------------------------------------------------------ corruption
CORRUPT_TRIALS = 1200


def test_random_corruption_is_always_a_miss(store_dir):
    rng = random.Random(99)
    s = F.open_store(store_dir)
    src = F.Chunks()
    sizes = [4096, 65536 + 123, 300000, 8192 * 3]
    keys = [f"corrupt/{i}" for i in range(len(sizes))]
    assert all(s.write([src.item(k, n) for k, n in zip(keys, sizes)]))
    pristine = {}
    for k in keys:
        with open(s.path_for(chunk_digest(k)), "rb") as f:
            pristine[k] = f.read()
    detected = removed = wrong = 0
    kinds = {"flip": 0, "truncate": 0, "flip-after-cached-header": 0}
    with F.LogCount() as logs:
        for t in range(CORRUPT_TRIALS):
            k = keys[t % len(keys)]
            path = s.path_for(chunk_digest(k))
            data = bytearray(pristine[k])
            cached = rng.random() < 0.3
            if rng.random() < 0.6:
                kind = "flip-after-cached-header" if cached else "flip"
                for _ in range(rng.choice([1, 1, 1, 2, 8])):
                    # header, payload, or the edges of both
                    off = rng.choice(
                        [
                            rng.randrange(len(data)),
                            rng.randrange(HEADER_SIZE),
                            rng.choice([0, 8, 16, 24, 28, HEADER_SIZE - 4, HEADER_SIZE, len(data) - 1]),
                        ]
                    )
                    data[off] ^= rng.randrange(1, 256)
            else:
                kind = "truncate"
                data = data[
                    : rng.choice([0, rng.randrange(HEADER_SIZE), HEADER_SIZE, rng.randrange(len(data)), len(data) - 1])
                ]
            kinds[kind] += 1
            if cached:  # this process has read the header before: phase 2 checks it again
                _put(path, pristine[k])
                h, _, bad = F.read_check(s, [k])
                assert h == 1 and not bad
            _put(path, bytes(data))
            h, m, bad = F.read_check(s, [k])
            detected += m
            wrong += len(bad) + (h if not bad else 0)
            removed += not os.path.exists(path)
            s.remove(k)
    s.close()
    figure(
        "Corruption: random bytes flipped (1-8, header and payload) and files truncated",
        CORRUPT_TRIALS,
        "every damaged file is a miss and removed; one warning per 5 s names one, with a count of the rest",
        fs=fs_of(store_dir),
        odirect=s.odirect,
        **kinds,
        detected=detected,
        removed=removed,
        wrong_chunks_served=wrong,
        warnings=logs.count(logging.WARNING, "is bad"),
    )
    assert detected == CORRUPT_TRIALS and removed == CORRUPT_TRIALS and wrong == 0
    # A warning each was one line per chunk at a restart after a power cut: thousands.
    assert 1 <= logs.count(logging.WARNING, "is bad") < CORRUPT_TRIALS // 10
    assert s.stats.snapshot()["corrupt"] == CORRUPT_TRIALS


FUZZ_STORE_TRIALS = 400


def test_damaged_files_fuzzed_through_the_store(store_dir):
    """Real chunk files damaged at random (bytes flipped anywhere, cut short,
    grown with garbage, zeroed ranges, another chunk's file, headers changed
    and re-sealed with a valid CRC) and read back in batches of 1-6 through
    read_steps and the C engine, blocking and awaited, with cached and fresh
    headers: every result is a miss or exactly the bytes stored."""
    import asyncio

    rng = random.Random(1616)
    key_mac = "fuzz-auth-key-0123456789"
    sizes = [4096, 65536 + 123, 300000, 8192 * 3, 1 << 20, 777]
    keys = [f"fuzz/{i}" for i in range(len(sizes))]
    configs = [{}, {"auth_key": key_mac, "verify": False}]  # the two configurations that promise exact bytes
    counts = {
        "batches": 0,
        "damaged_files": 0,
        "reads": 0,
        "hits_exact": 0,
        "misses": 0,
        "wrong": 0,
        "undamaged_missed": 0,
        "clean_batch_missed": 0,
        "exceptions": 0,
    }
    kinds: dict = {}
    for cfg in configs:
        w = F.open_store(store_dir, **cfg)
        for k in keys:  # written anew in this configuration (with or without a MAC)
            w.remove(k)
        src = F.Chunks()
        assert all(w.write([src.item(k, n) for k, n in zip(keys, sizes)]))
        pristine = {k: open(w.path_for(chunk_digest(k)), "rb").read() for k in keys}
        w.close()
        s = None
        for _t in range(FUZZ_STORE_TRIALS // len(configs)):
            if s is None or rng.random() < 0.15:  # a fresh process view: headers not cached
                if s is not None:
                    s.close()
                s = F.open_store(store_dir, **cfg)
            pick = rng.sample(keys, rng.randint(1, len(keys)))
            damaged = set()
            for k in pick:
                data = bytearray(pristine[k])
                if rng.random() < 0.6:
                    kind = rng.choice(["flip", "flip_header", "truncate", "grow", "zero", "foreign", "reseal"])
                    kinds[kind] = kinds.get(kind, 0) + 1
                    if kind == "flip":
                        for _ in range(rng.randint(1, 8)):
                            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
                    elif kind == "flip_header":
                        data[rng.randrange(HEADER_SIZE)] ^= rng.randrange(1, 256)
                    elif kind == "truncate":
                        data = data[: rng.randrange(len(data))]
                    elif kind == "grow":
                        data += rng.randbytes(rng.randint(1, 9000))
                    elif kind == "zero":
                        a = rng.randrange(len(data))
                        data[a : a + rng.randint(1, 8192)] = bytes(len(data[a : a + rng.randint(1, 8192)]))
                    elif kind == "foreign":
                        data = bytearray(pristine[rng.choice([x for x in keys if x != k])])
                    else:  # a header field or meta byte changed and the header CRC made valid again
                        body_end = 40 + struct.unpack_from("<I", data, 28)[0]
                        data[rng.randrange(min(body_end, HEADER_SIZE - 4))] ^= rng.randrange(1, 256)
                        _reseal(data)
                    if bytes(data) != pristine[k]:
                        damaged.add(k)
                _put(s.path_for(chunk_digest(k)), bytes(data))
            try:
                if rng.random() < 0.5:
                    got = s.read(pick, F.allocator(), lambda h: None)
                else:
                    got = asyncio.run(s.read_async(pick, F.allocator(), lambda h: None))
            except Exception:
                counts["exceptions"] += 1
                continue
            counts["batches"] += 1
            counts["damaged_files"] += len(damaged)
            for k, h in zip(pick, got):
                counts["reads"] += 1
                if h is None:
                    counts["misses"] += 1
                    counts["undamaged_missed"] += k not in damaged
                    counts["clean_batch_missed"] += not damaged
                elif bytes(memoryview(h)) == pristine[k][HEADER_SIZE:]:
                    counts["hits_exact"] += 1
                else:
                    counts["wrong"] += 1
            for k in pick:  # put every file back for the next trial
                _put(s.path_for(chunk_digest(k)), pristine[k])
        s.close()
    figure(
        "Damaged chunk files fuzzed through the store: read_steps + the C engine (blocking and awaited, cached "
        "and fresh headers), verify on, and verify off with auth_key",
        counts["batches"],
        "every read is a miss or exactly the bytes stored; no exception (undamaged chunks behind a damaged one in a "
        "batch may miss: a read stops at the first chunk it cannot place)",
        fs=fs_of(store_dir),
        **counts,
        damage_kinds=kinds,
    )
    # An undamaged chunk misses once when a damaged header (re-sealed with another geometry) taught this
    # process a wrong meta: the next read relearns it ("replaced by a chunk of another geometry").
    assert counts["wrong"] == 0 and counts["exceptions"] == 0
    assert counts["clean_batch_missed"] <= kinds.get("reseal", 0)
    assert counts["hits_exact"] > 0 and counts["misses"] > 0


def _put(path, data):
    tmp = path + ".planted"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


FUZZ_DIRECT = 150_000
FUZZ_HYPOTHESIS = 5_000


def _valid_header(key="model@1@0@abc@bfloat16", meta=None, plen=262144, pcrc=7):
    buf = bytearray(HEADER_SIZE)
    encode_header(buf, key, meta or ChunkMeta(((2, 2, 256, 128),), ("bfloat16",), "KV_2LTD"), plen, pcrc, 1)
    return buf


def _reseal(buf):
    struct.pack_into("<I", buf, HEADER_SIZE - 4, _fxio.crc32c(bytes(buf[: HEADER_SIZE - 4])))
    return buf


def _decode_only_badheader(buf):
    try:
        decode_header(buf)
        return "ok"
    except BadHeader:
        return "bad"


def test_header_fuzz():
    """decode_header on mutated headers, most re-sealed with a valid CRC so
    parsing reaches the JSON meta, plus hypothesis-built fields and metas."""
    rng = random.Random(5)
    base = _valid_header()
    body_end = 40 + struct.unpack_from("<I", base, 28)[0]
    metas = [
        b'{"key":"k","shapes":[[Infinity]],"dtypes":["x"],"fmt":"f"}',
        b"[" * 3000 + b"]" * 3000,
        b'{"key":"k","shapes":[[1e999]],"dtypes":["x"],"fmt":"f"}',
        b'{"key":"k","shapes":{"a":1},"dtypes":1}',
        b'{"key":1}',
        b'"x"',
        b"null",
        b'{"key":"\\ud800","shapes":[[-1]],"dtypes":["a"],"fmt":"f"}',
        b'{"key":"k","shapes":[[NaN]],"dtypes":["x"],"fmt":"f"}',
        b'{"key":"k","shapes":[],"dtypes":[],"fmt":1}',
        b'{"key":"k","shapes":[[1]],"dtypes":["x"],"fmt":"f"}',
        b"\xff\xfe",
        b"{" * 2000,
    ]
    outcome = {"ok": 0, "bad": 0}
    crashes = []
    t0 = time.perf_counter()
    for _i in range(FUZZ_DIRECT):
        buf = bytearray(base)
        r = rng.random()
        if r < 0.3:  # flip bytes in the fixed fields and meta, reseal
            for _ in range(rng.randint(1, 6)):
                buf[rng.randrange(body_end + 8)] = rng.randrange(256)
            _reseal(buf)
        elif r < 0.6:  # a planted meta
            m = rng.choice(metas) if rng.random() < 0.5 else bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            if rng.random() < 0.5:
                m = bytearray(m)
                for _ in range(rng.randint(1, 3)):
                    if m:
                        m[rng.randrange(len(m))] = rng.choice(b'[]{}",:0123456789eE-+.aINfn\\u ')
                m = bytes(m)
            m = m[:4000]
            buf[40 : 40 + len(m)] = m
            struct.pack_into("<I", buf, 28, rng.choice([len(m), rng.randrange(4100), 4052, 0xFFFFFFFF]))
            _reseal(buf)
        elif r < 0.8:  # unsealed random damage
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(HEADER_SIZE)] ^= rng.randrange(1, 256)
        elif r < 0.9:  # short buffers
            buf = buf[: rng.randrange(HEADER_SIZE)]
        else:  # random bytes with the magic
            buf = bytearray(b"LMCFXKV\0" + rng.randbytes(HEADER_SIZE - 8))
            if rng.random() < 0.5:
                _reseal(buf)
        try:
            outcome[_decode_only_badheader(buf)] += 1
        except Exception as e:
            crashes.append(f"{type(e).__name__}: {str(e)[:80]}")
    direct_s = time.perf_counter() - t0
    hyp = _hypothesis_fuzz()
    figure(
        "Header parsing fuzzed: mutated and re-sealed headers, planted metas (direct decode_header calls) "
        "+ hypothesis-built fields",
        FUZZ_DIRECT + hyp["examples"],
        "decode_header only ever returns a header or raises BadHeader (no other exception)",
        direct_inputs=FUZZ_DIRECT,
        accepted=outcome["ok"],
        rejected=outcome["bad"],
        other_exceptions=len(crashes),
        first=sorted(set(crashes))[:3],
        seconds=round(direct_s, 1),
        hypothesis_examples=hyp["examples"],
        hypothesis_result=hyp["result"],
    )
    assert not crashes
    assert hyp["result"] in ("passed", "skipped: hypothesis not installed"), hyp


def _hypothesis_fuzz() -> dict:
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st
    except ImportError:
        return {"examples": 0, "result": "skipped: hypothesis not installed"}
    n = [0]
    json_vals = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda c: (
            st.lists(c, max_size=4)
            | st.dictionaries(st.sampled_from(["key", "shapes", "dtypes", "fmt", "x"]), c, max_size=5)
        ),
        max_leaves=12,
    )

    @settings(
        max_examples=FUZZ_HYPOTHESIS,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        version=st.integers(0, 0xFFFF),
        hsize=st.sampled_from([4096, 0, 4095, 0xFFFFFFFF]),
        plen=st.integers(0, 2**64 - 1),
        mlen_delta=st.integers(-8, 8),
        meta=json_vals,
        raw=st.binary(max_size=64),
        use_raw=st.booleans(),
    )
    def run(version, hsize, plen, mlen_delta, meta, raw, use_raw):
        n[0] += 1
        import json as _j

        body = raw if use_raw else _j.dumps(meta).encode()[:4000]
        buf = bytearray(HEADER_SIZE)
        struct.pack_into(
            "<8sHHIQIIQ",
            buf,
            0,
            b"LMCFXKV\0",
            version,
            0,
            hsize,
            plen,
            0,
            max(0, min(len(body) + mlen_delta, 0xFFFFFFFF)),
            0,
        )
        buf[40 : 40 + len(body)] = body
        _reseal(buf)
        _decode_only_badheader(buf)

    try:
        run()
        return {"examples": n[0], "result": "passed"}
    except Exception as e:
        return {"examples": n[0], "result": f"{type(e).__name__}: {str(e)[:120]}"}


# ------------------------------------------------------------------ hostile directory
def test_hostile_store_directory(tmp_path):
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    s = F.open_store(str(root))
    src = F.Chunks()
    checks = {}
    # 1. Keys that look like paths never escape.
    evil = ["../../etc/passwd", "/etc/shadow", "a/b/../../c", "x\0y", "..", "\udc80surrogate", "k" * 2000]
    ok = s.write([src.item(k, 8192 + i) for i, k in enumerate(evil)])
    h, m, bad = F.read_check(s, evil)
    everything = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path) for f in fs]
    escaped = [p for p in everything if not p.startswith(str(root) + os.sep)]
    checks["evil_keys"] = f"{sum(ok)}/{len(evil)} stored, {h} read back, files outside the store: {len(escaped)}"
    assert all(ok) and h == len(evil) and not bad and not escaped
    # 2. Private permissions by default.
    modes = {oct(os.stat(p).st_mode & 0o777) for p in F.chunk_files(str(root))}
    dmodes = {oct(os.stat(os.path.join(root, d)).st_mode & 0o777) for d in os.listdir(root)} | {
        oct(os.stat(root).st_mode & 0o777)
    }
    checks["private_modes"] = f"files {sorted(modes)}, dirs {sorted(dmodes)}"
    assert modes == {"0o600"} and dmodes == {"0o700"}
    # 3. A planted symlink in place of a chunk file is never followed.
    secret = outside / "secret"
    secret.write_bytes(b"secret" * 1000)
    victim = "planted/victim"
    vpath = s.path_for(chunk_digest(victim))
    os.makedirs(os.path.dirname(vpath), exist_ok=True)
    real_chunk = s.path_for(chunk_digest(evil[0]))
    os.symlink(real_chunk, vpath)  # a valid chunk behind the link: still not served
    s2 = F.open_store(str(root))
    link_hit = s2.contains(victim)
    h_link, _, _ = F.read_check(s2, [victim])
    wrote = s2.write([src.item(victim, 4096)])  # replaces the link, does not write through it
    follow_write = os.path.islink(vpath) or open(real_chunk, "rb").read(8) != b"LMCFXKV\0"
    os.unlink(vpath)
    os.symlink(str(secret), vpath)
    s3 = F.open_store(str(root))
    secret_after = secret.read_bytes() == b"secret" * 1000 and os.path.islink(vpath)
    h_secret, _, _ = F.read_check(s3, [victim])
    checks["symlinked_file"] = (
        f"contains={link_hit}, reads={h_link + h_secret}, write replaced the link "
        f"itself={not follow_write}, target untouched={secret_after}"
    )
    assert not link_hit and h_link == 0 and h_secret == 0 and wrote == [True] and not follow_write and secret_after
    # 4. A planted symlink in place of a fan-out directory is never followed.
    evil_dir = outside / "d"
    evil_dir.mkdir()
    key2 = next(
        f"dirlink/{i}"
        for i in range(10000)
        if not os.path.exists(os.path.dirname(s.path_for(chunk_digest(f"dirlink/{i}"))))
    )
    sub = os.path.dirname(s.path_for(chunk_digest(key2)))
    os.symlink(str(evil_dir), sub)
    s4 = F.open_store(str(root))
    w = s4.write([src.item(key2, 4096)])
    files_outside = os.listdir(evil_dir)
    # a valid chunk planted behind the directory link is not served either
    other = F.open_store(str(tmp_path / "other"))
    other.write([src.item(key2, 4096)])
    os.rename(
        other.path_for(chunk_digest(key2)), os.path.join(evil_dir, os.path.basename(s4.path_for(chunk_digest(key2))))
    )
    s5 = F.open_store(str(root))
    h_dir, _, _ = F.read_check(s5, [key2])
    checks["symlinked_dir"] = f"store refused={w == [False]}, files written outside={len(files_outside)}, reads={h_dir}"
    assert w == [False] and not files_outside and h_dir == 0 and not s5.contains(key2)
    os.unlink(sub)
    # 5. shared_group opens files and directories to the group, whatever the umask.
    old = os.umask(0o022)
    try:
        g = F.open_store(str(tmp_path / "shared"), shared_group=True)
        g.write([src.item("shared/0", 4096)])
        gf = {oct(os.stat(p).st_mode & 0o777) for p in F.chunk_files(str(tmp_path / "shared"))}
        gd = {
            oct(os.stat(os.path.join(tmp_path, "shared", d)).st_mode & 0o777) for d in os.listdir(tmp_path / "shared")
        }
    finally:
        os.umask(old)
    checks["shared_group_umask_022"] = f"files {sorted(gf)}, dirs {sorted(gd)}"
    assert gf == {"0o660"} and gd == {"0o770"}
    # 6. A store directory owned by another user is refused, root or not.
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o777)
    os.chmod(foreign, 0o777)
    refused = {}
    if os.geteuid() == 0:
        os.chown(foreign, 12345, 12345)
        try:
            F.open_store(str(foreign))
            refused["root"] = "started"
        except ConfigError as e:
            refused["root"] = str(e)
        # ... and as an ordinary user (uid 65534) on a root-owned directory, in a forked child
        import shutil
        import tempfile

        top = tempfile.mkdtemp(prefix="fx-foreign-")  # reachable by uid 65534, unlike tmp_path
        try:
            os.chmod(top, 0o755)
            f2 = os.path.join(top, "store")
            os.mkdir(f2)
            os.chmod(f2, 0o777)
            refused["nobody"] = _as_user(65534, lambda: F.open_store(f2))
        finally:
            shutil.rmtree(top, ignore_errors=True)
    else:
        try:
            F.open_store(str(foreign))
        except ConfigError as e:
            refused["user"] = str(e)
    checks["foreign_owner"] = refused
    # 7. A store directory every user can write to (planted chunks would be served) is refused.
    open_dir = tmp_path / "world"
    open_dir.mkdir()
    os.chmod(open_dir, 0o1777)
    try:
        F.open_store(str(open_dir))
        checks["world_writable"] = "started"
    except ConfigError as e:
        checks["world_writable"] = str(e)
    for s_ in (s, s2, s3, s4, s5, other, g):
        s_.close()
    figure(
        "Hostile store directory: path-like keys, planted symlinks (file and fan-out dir), permissions, a "
        "directory owned by another user or writable by all",
        sum(len(x) if isinstance(x, dict) else 1 for x in checks.values()),
        "keys never escape; symlinks never followed (read or write); 0600/0700 by default, 0660/0770 with "
        "shared_group under umask 022; foreign owner or world-writable directory refused with a clear error",
        **checks,
    )
    assert refused and all("belongs to uid" in v for v in refused.values()), refused
    assert "writable by every user" in checks["world_writable"]


def _as_user(uid, fn) -> str:
    """Runs fn in a forked child with uid/gid dropped; its ConfigError text, or 'started'."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no logging, no exit handlers
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                fn()
                msg = "started"
            except ConfigError as e:
                msg = str(e)
            except BaseException as e:
                msg = f"{type(e).__name__}: {e}"
            os.write(w, msg.encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    return msg


# ------------------------------------------------------------------ bad configuration
BAD_OPTIONS = [
    ("path", 123),
    ("path", None),
    ("path", ""),
    ("path", " , "),
    ("path", ["a"]),
    ("max_capacity_gb", "lots"),
    ("max_capacity_gb", -1),
    ("max_capacity_gb", 0),
    ("max_capacity_gb", 1e12),
    ("max_capacity_gb", float("nan")),
    ("max_capacity_gb", float("inf")),
    ("max_capacity_gb", True),
    ("max_capacity_gb", None),
    ("max_capacity_gb", "100G"),
    ("max_capacity_gb", [1]),
    ("io_engine", "spdk"),
    ("io_engine", 1),
    ("io_engine", None),
    ("io_engine", True),
    ("io_engine", ""),
    ("queue_depth", 0),
    ("queue_depth", -1),
    ("queue_depth", 10**9),
    ("queue_depth", 2.5),
    ("queue_depth", "many"),
    ("queue_depth", True),
    ("queue_depth", None),
    ("queue_depth", float("inf")),
    ("queue_depth", "1e3x"),
    ("split_bytes", 0),
    ("split_bytes", 5000),
    ("split_bytes", -4096),
    ("split_bytes", "1T"),
    ("split_bytes", 2**40),
    ("split_bytes", "1X"),
    ("split_bytes", True),
    ("split_bytes", 4096.5),
    ("split_bytes", "nan"),
    ("split_bytes", "inf"),
    ("split_bytes", "1e400"),
    ("split_bytes", None),
    ("split_bytes", [4096]),
    ("odirect", "maybe"),
    ("odirect", 2),
    ("odirect", None),
    ("verify", "perhaps"),
    ("verify", 2),
    ("verify", None),
    ("verify", [True]),
    ("shared_group", "group"),
    ("shared_group", -1),
    ("shared_group", None),
    ("metrics_port", -1),
    ("metrics_port", 65536),
    ("metrics_port", "http"),
    ("metrics_port", 1.5),
    ("queue_dept", 8),
    ("bogus", 1),
    ("PATH", "/tmp"),
]
GENERIC_BAD = ["\x00absurd", -1, None, [1], {"a": 1}]  # for options added after this table


def _bad_options():
    known = {n for n, _ in BAD_OPTIONS}
    extra = [(n, v) for n in FxOptions.names() if n not in known for v in GENERIC_BAD]
    return BAD_OPTIONS + extra, sorted({n for n, _ in extra})


def test_bad_configuration(tmp_path):
    """Every option with a wrong value, unknown names and unusable paths: a
    ConfigError naming the option, and nothing left running or created."""
    from lmcache_fx.lmcache_plugin import FxStorageBackend
    from lmcache_fx.testing.cpu_engine import config_from_dict, fx_config

    class FakeCPU:  # the constructor must fail before needing LMCache's allocator
        pass

    prefix = "storage_plugin.fx."
    failures = []
    store_dir = tmp_path / "never-created"
    fds0, thr0 = F.open_fds(), F.os_threads_at_rest()
    cases, untabled = _bad_options()
    for name, value in cases:
        d = fx_config(store_dir)
        if name == "path":
            d["extra_config"][prefix + "path"] = value
        else:
            d["extra_config"][prefix + name] = value
        cfg = config_from_dict(d, tmp_path)
        try:
            FxStorageBackend(config=cfg, metadata=None, local_cpu_backend=FakeCPU(), loop=None)
            failures.append(f"{name}={value!r}: started")
        except ConfigError as e:
            wanted = prefix + ("queue_depth" if name == "queue_dept" else name)
            if name in ("bogus", "PATH"):
                wanted = prefix + name
            if wanted not in str(e):
                failures.append(f"{name}={value!r}: message does not name {wanted}: {e}")
        except Exception as e:
            failures.append(f"{name}={value!r}: {type(e).__name__}: {e}")
        if store_dir.exists():
            failures.append(f"{name}={value!r}: created the store directory")
    # Unusable paths, tried on the store itself (all options otherwise good).
    ro = tmp_path / "ro"
    ro.mkdir()
    paths = [
        ("/proc/lmcache-fx", "cannot create"),
        (str(tmp_path / "afile"), "not a directory"),
        (str(tmp_path / "afile" / "sub"), "not a directory"),
    ]
    (tmp_path / "afile").write_text("x")
    mounted = False
    if (
        os.geteuid() == 0
        and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M,mode=0755", "tmpfs", str(ro)]).returncode == 0
    ):
        mounted = True
        paths += [(str(ro), "on a read-only filesystem; mount it read-write"), (str(ro / "sub"), "cannot create")]
    paths.append((f"{tmp_path}/good-first,/proc/lmcache-fx", "cannot create"))
    # odirect: true where O_DIRECT is impossible (ramfs; tmpfs allows it since Linux 6.6);
    # io_engine: io_uring refused is exercised under seccomp (test_no_io_uring_under_seccomp)
    shm = None
    if os.geteuid() == 0:
        shm = str(tmp_path / "ramfs")
        os.mkdir(shm)
        if subprocess.run(["mount", "-t", "ramfs", "ramfs", shm]).returncode != 0:
            shm = None
    try:
        for p, needle in paths:
            try:
                ChunkStore(FxOptions.from_mapping({"path": p}))
                failures.append(f"path={p}: started")
            except ConfigError as e:
                if needle not in str(e) or not str(e).startswith("path:"):
                    failures.append(f"path={p}: {e}")
        if os.path.exists(f"{tmp_path}/good-first"):
            failures.append("path=good,bad: created the first directory before refusing the second")
        if shm:
            try:
                ChunkStore(FxOptions.from_mapping({"path": shm + "/s", "odirect": "true"}))
                failures.append("odirect=true on ramfs: started")
            except ConfigError as e:
                if not str(e).startswith("odirect:"):
                    failures.append(f"odirect=true on ramfs: {e}")
            if os.path.exists(shm + "/s"):
                failures.append("odirect=true on ramfs: left the store directory behind")
        time.sleep(0.2)
        fds1, thr1 = F.open_fds(), F.os_threads_at_rest()
        # More is a leak; fewer is an earlier test's thread finishing meanwhile.
        if fds1 > fds0 or thr1 > thr0:
            failures.append(f"half-started: fds {fds0}->{fds1}, OS threads {thr0}->{thr1}")
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=False)
        if shm:
            subprocess.run(["umount", shm], check=False)
    ntrials = len(cases) + len(paths) + (1 if shm else 0)
    figure(
        "Bad configuration: every option wrong-typed, negative, absurd (nan/inf/huge), unknown names, "
        "unusable paths (missing parent, a file, read-only fs, one bad of two), odirect: true on ramfs",
        ntrials,
        "ConfigError naming the option (and a fix); no directory created, no fd or thread left behind",
        options=len(FxOptions.names()),
        refused_correctly=ntrials - len(failures),
        failures=failures[:6],
        options_tried_with_generic_values_only=untabled,
    )
    assert not failures, failures


# ------------------------------------------------------------------ load
SOAK_SECONDS = 20


def test_soak_16_concurrent(store_dir):
    """Mixed stores and retrieves at 16 concurrent requests; memory, fds and
    threads measured at rest after a 3 s warm-up and again after the soak."""
    r = F.result_of(
        F.spawn(
            "soak",
            {"path": store_dir, "seconds": SOAK_SECONDS, "conc": 16, "nkeys": 400, "cap_gb": 48 / 1024, "warmup": 3},
        ),
        SOAK_SECONDS + 120,
    )
    rss0, fds0, thr0, rings0 = r["start"]
    rss1, fds1, thr1, rings1 = r["end"]
    peak = max(s[1] for s in r["samples"])
    figure(
        f"Load: mixed stores/retrieves at 16 concurrent requests (4 async) for {SOAK_SECONDS} s after a 3 s "
        "warm-up, 400 keys, 48 MiB cap (eviction on)",
        f"{r['stores'] + r['retrieves']} requests",
        "no wrong chunk, no exception; RSS, open fds and threads at rest equal before and after the soak; "
        "usage within cap and equal to files",
        stores=r["stores"],
        retrieves=r["retrieves"],
        hits=r["hits"],
        misses=r["misses"],
        wrong=r["wrong"],
        exceptions=r["errors"],
        evictions=r["stats"]["evictions"],
        rss_mib=f"{rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} (peak {peak / 2**20:.1f})",
        fds=f"{fds0} -> {fds1}",
        pooled_io_uring_rings=f"{rings0} -> {rings1}",
        threads=f"{thr0} -> {thr1}",
        usage=r["usage"],
        files_bytes=r["files_bytes"],
    )
    assert r["wrong"] == 0 and r["errors"] == 0 and r["alive"] == 0, r["error_samples"]
    assert r["retrieves"] > 100 and r["hits"] > 0
    # The engine keeps one ring per concurrent batch it has seen (at most 16 here): fds other than
    # rings must not move, and the ring pool stays within the concurrency.
    assert fds1 - rings1 == fds0 - rings0 and rings1 <= 16, r["fd_kinds"]
    assert thr1 == thr0, (r["threads_start"], r["threads_end"], r["idle_runners"])
    assert rss1 - rss0 < 16 << 20, (rss0, rss1)
    assert r["usage"] <= r["cap"] and r["usage"] == r["files_bytes"]


def test_header_body_is_the_plain_json_form():
    """header_body encodes the meta once per meta; the bytes are those of
    json.dumps of the whole body, for keys with quotes, escapes and non-ASCII,
    and the header decodes back to the same key and meta."""
    import json
    import math

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from lmcache_fx.core.chunkfile import dtype_size, header_body

    @settings(max_examples=300, deadline=None)
    @given(
        st.text(max_size=60),
        st.lists(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=4), min_size=1, max_size=3),
        st.sampled_from(["bfloat16", "float16", "uint8"]),
    )
    def check(key, shapes, dtype):
        meta = ChunkMeta(tuple(tuple(s) for s in shapes), (dtype,) * len(shapes), "KV_2LTD")
        want = json.dumps({"key": key, **meta.to_json()}, separators=(",", ":")).encode()
        assert header_body(key, meta) == want
        nbytes = sum(math.prod(s) * dtype_size(d) for s, d in zip(meta.shapes, meta.dtypes))
        if len(want) < 3000 and nbytes < 1 << 40:
            buf = bytearray(HEADER_SIZE)
            encode_header(buf, key, meta, nbytes, 7, 1)
            h = decode_header(buf)
            assert (h.key, h.meta) == (key, meta)

    check()


_INTERRUPTED_WRITE = r"""
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[2])
from lmcache_fx import _fxio
from lmcache_fx.core import store as S
from lmcache_fx.core.chunkfile import ChunkMeta
from lmcache_fx.core.options import FxOptions

base = sys.argv[1]
st = S.ChunkStore(FxOptions.from_mapping({"path": os.path.join(base, "store"), "max_capacity_gb": 1, "odirect": "true"}))
SIZE, N = 4 << 20, 17  # two sub-batches (16 + 1), both written on threads of their own
src = _fxio.HostBuffer(SIZE)
memoryview(src)[:] = b"\xc3" * SIZE
meta = ChunkMeta(((SIZE,),), ("uint8",), "raw")
real = S._Call


class SlowCall(real):  # a slow device: each sub-batch's writes start late
    def __init__(self, fn, background, *rest, **kw):
        super().__init__(lambda: (time.sleep(1.0), fn())[1], background, *rest, **kw)


S._Call = SlowCall
# Python's own Ctrl-C handler, even where SIGINT came ignored (a background job of a non-interactive shell)
signal.signal(signal.SIGINT, signal.default_int_handler)
real_start = threading._start_new_thread
if sys.argv[3] == "wait":  # while the store waits for its sub-batches' writes
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
else:  # inside Thread.start, just after the write thread was made (before it has run a line)

    def start_then_sigint(fn, args, *rest):
        r = real_start(fn, args, *rest)
        t = getattr(fn, "__self__", None)
        if t is not None and t.name == "lmcache-fx-write" and not getattr(start_then_sigint, "done", False):
            start_then_sigint.done = True
            signal.raise_signal(signal.SIGINT)
        return r

    threading._start_new_thread = start_then_sigint
try:
    st.write([(f"k-{i}", src.address, SIZE, meta) for i in range(N)])
    print("RETURNED", flush=True)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
S._Call = real
threading._start_new_thread = real_start
others, held = [], []
for j in range(20):  # files opened now take any descriptor the store let go of, and stay open
    p = os.path.join(base, f"other-{j}.txt")
    f = open(p, "w")
    f.write("another file\n")
    f.flush()
    held.append(f)
    others.append(p)
time.sleep(2.5)  # any write still running would have landed by now
for f in held:
    f.close()
print("OVERWRITTEN", sum(b"\xc3" in open(p, "rb").read() for p in others), flush=True)
got = [k for k in (f"k-{i}" for i in range(N)) if st.contains(k)]
print("STORED", len(got), "TEMPORARIES", sum(S.TMP_MARK in n for _, _, fs in os.walk(base) for n in fs), flush=True)
st.close()
"""


@pytest.mark.parametrize("when", ["wait", "start"])
def test_an_interrupt_while_a_store_waits_for_its_writes_frees_nothing_they_use(xfs_store, when):
    """A store of several sub-batches writes each on a thread of its own and
    waits for it. A Ctrl-C (or a signal handler's exception) during that
    wait left it, and the commit that follows closed and unlinked the
    temporaries and freed the header buffer while the engine still wrote
    through them: a SIGSEGV, or chunk bytes written into whatever files took
    those descriptors (a review: 10 of 20 unrelated files overwritten). The
    wait now outlasts the interrupt, which is raised once the writes are
    done; what was written is committed. `start`: the interrupt lands inside
    Thread.start, once the write thread exists but before it has run (a
    later review: the store took it for a thread that never runs, and its
    write landed in 4-10 of 20 other files); the thread now either writes,
    and is waited for, or gives up before writing."""
    p = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_WRITE, xfs_store, os.path.dirname(os.path.dirname(__file__)), when],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
    lines = dict(ln.split(" ", 1) if " " in ln else (ln, "") for ln in p.stdout.splitlines())
    assert "INTERRUPTED" in lines, p.stdout
    assert lines["OVERWRITTEN"] == "0", p.stdout
    assert lines["STORED"].endswith("TEMPORARIES 0"), p.stdout
    # wait: every sub-batch written; start: the first one written whole (its thread had begun) or not at all
    assert lines["STORED"].split()[0] in (("17",) if when == "wait" else ("0", "16")), p.stdout
