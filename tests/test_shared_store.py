"""Shared stores: many processes, TP ranks, instances and mount namespaces on
one path (issue 10). Figures are printed as `SHARED {json}` lines; the table
in docs/shared-stores.md comes from them.

Run as a child: `python tests/test_shared_store.py <role> <json-args>`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

from faults import fxfault as F  # noqa: E402

from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest  # noqa: E402
from lmcache_fx.core.store import LOCK_NAME  # noqa: E402
from lmcache_fx.testing import loopfs  # noqa: E402

CHUNK = 256 * 1024  # payload bytes; files are HEADER_SIZE more


def figure(name: str, **fig) -> None:
    print(f"\nSHARED {json.dumps(dict(case=name, **fig))}", flush=True)


def dir_bytes(path: str) -> int:
    """Bytes of every file in the fan-out directories (chunks and temporaries)."""
    n = 0
    try:
        subs = [d.path for d in os.scandir(path) if len(d.name) == 2 and d.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    for sub in subs:
        try:
            for e in os.scandir(sub):
                try:
                    n += e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
        except OSError:
            pass
    return n


# ------------------------------------------------------------------ children
def child_writer(a):
    """Writes `n` chunks of rank `rank` in batches of 1-4 under a shared cap."""
    s = F.open_store(a["path"], max_capacity_gb=a["cap"] / (1 << 30))
    rng = random.Random(a["rank"])
    print("READY", flush=True)
    done, i = [], 0
    while i < a["n"]:
        src = F.Chunks()
        keys = [f"model@8@{a['rank']}@{h:016x}@bfloat16" for h in range(i, min(a["n"], i + rng.randint(1, 4)))]
        i += len(keys)
        ok = s.write([src.item(k, CHUNK, 0, a["rank"]) for k in keys])
        done += [k for k, g in zip(keys, ok) if g]
        if a.get("reread") and done:  # hits refresh the shared LRU clock
            F.read_check(s, rng.sample(done, min(2, len(done))), a["rank"])
    st = s.stats.snapshot()
    s.close()
    print(
        "RESULT "
        + json.dumps(
            {"done": done, "evictions": st["evictions"], "scans": st["scans"], "scan_seconds": st["scan_seconds"]}
        ),
        flush=True,
    )


def child_reader(a):
    """Reads random keys of all ranks until told to stop; counts wrong data."""
    s = F.open_store(a["path"], max_capacity_gb=a["cap"] / (1 << 30))
    rng = random.Random(99)
    print("READY", flush=True)
    res = {"hits": 0, "misses": 0, "bad": []}
    end = time.monotonic() + a["seconds"]
    while time.monotonic() < end:
        r = rng.randrange(a["ranks"])
        keys = [f"model@8@{r}@{rng.randrange(a['n']):016x}@bfloat16" for _ in range(3)]
        h, m, bad = F.read_check(s, keys, r)
        res["hits"] += h
        res["misses"] += m
        res["bad"] += bad
    s.close()
    print("RESULT " + json.dumps(res), flush=True)


def child_ns(a):
    """In another mount namespace: reads what the parent wrote, writes its own."""
    s = F.open_store(a["path"], max_capacity_gb=a["cap"] / (1 << 30))
    h, m, bad = F.read_check(s, a["read"], 0)
    src = F.Chunks()
    ok = s.write([src.item(k, CHUNK, 0, 1) for k in a["write"]])
    usage = s.usage_bytes
    s.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "hits": h,
                "misses": m,
                "bad": bad,
                "wrote": sum(ok),
                "usage": usage,
                "mountinfo_id": os.readlink("/proc/self/ns/mnt"),
            }
        ),
        flush=True,
    )


def spawn(role, args, prefix=()):
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false", PYTHONPATH=ROOT)
    return subprocess.Popen(
        [*prefix, sys.executable, os.path.abspath(__file__), role, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


# ------------------------------------------------------------------ tests
import pytest  # noqa: E402


def _need_xfs():
    why = loopfs.why_not_available()
    if why:
        pytest.skip(f"XFS loop filesystem: {why}")


def _result(p) -> dict:
    """The child's RESULT line. Not communicate(): it would lose what readline() already buffered."""
    so = p.stdout.read()
    p.wait(120)
    line = [x for x in so.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and line, p.stderr.read()[-3000:]
    return json.loads(line[-1][7:])


def _run_writers(path, writers, cap, n, readers=0, seconds=0.0):
    """Starts writer (and reader) processes, samples the directory's bytes
    every 2 ms, returns (peak bytes, writer results, reader results). Each
    sample is taken holding the store lock, under which writers size, trim,
    rename and evict their files: a walk of 256 directories while a writer
    evicts in one and writes in another would count both files."""
    from lmcache_fx.core.ledger import Ledger

    procs = [spawn("writer", {"path": path, "rank": r, "n": n, "cap": cap, "reread": True}) for r in range(writers)]
    rprocs = [
        spawn("reader", {"path": path, "cap": cap, "ranks": writers, "n": n, "seconds": seconds})
        for _ in range(readers)
    ]
    for p in procs + rprocs:
        line = p.stdout.readline().strip()
        assert line == "READY", p.stderr.read()[-3000:]
    peak = 0
    ledger = Ledger.open(path, 0o600, 0o700, False)  # the writers made it: the modes are not used
    try:
        while any(p.poll() is None for p in procs):
            with ledger.hold():
                peak = max(peak, dir_bytes(path))
            time.sleep(0.002)
    finally:
        ledger.release()
    res = [_result(p) for p in procs]
    rres = [_result(p) for p in rprocs]
    peak = max(peak, dir_bytes(path))
    return peak, res, rres


def test_one_capacity_for_many_writers(xfs_dir):
    """1, 4 and 8 writer processes (+2 readers with 8) on one path under one
    cap: the directory never holds more than cap + one chunk per writer;
    after, the ledger equals the files and every chunk read is its rank's."""
    _need_xfs()
    file_size = HEADER_SIZE + CHUNK
    cap = 24 * file_size + 1000  # 24 chunks; each writer writes 40: eviction all the time
    rows = []
    for writers in (1, 4, 8):
        path = os.path.join(xfs_dir, f"shared-cap-{writers}")
        readers = 2 if writers == 8 else 0
        peak, res, rres = _run_writers(path, writers, cap, 40, readers=readers, seconds=2.0)
        s = F.open_store(path, max_capacity_gb=cap / (1 << 30))
        files = F.chunk_files(path)
        on_disk = sum(os.path.getsize(f) for f in files)
        usage = s.usage_bytes
        wrong = 0
        for r in range(writers):
            present = [k for k in res[r]["done"] if s.contains(k)]
            _, _, bad = F.read_check(s, present, r)
            wrong += len(bad)
        wrong += sum(len(x["bad"]) for x in rres)
        s.close()
        over = max(0, peak - cap)
        row = dict(
            writers=writers,
            readers=readers,
            cap_bytes=cap,
            chunk_file_bytes=file_size,
            written=sum(len(x["done"]) for x in res),
            evictions=sum(x["evictions"] for x in res),
            scans=sum(x["scans"] for x in res),
            scan_ms_max=round(1000 * max(x["scan_seconds"] / max(x["scans"], 1) for x in res), 2),
            peak_bytes=peak,
            overshoot_bytes=over,
            overshoot_chunks=round(over / file_size, 2),
            end_files_bytes=on_disk,
            ledger_after_restart=usage,
            wrong=wrong,
            reader_hits=sum(x["hits"] for x in rres),
        )
        figure("capacity", **row)
        rows.append(row)
        assert wrong == 0
        assert over <= writers * file_size, row
        assert on_disk <= cap and usage == on_disk
        assert os.path.isfile(os.path.join(path, LOCK_NAME)) and not any(LOCK_NAME in x for x in files)
        shutil.rmtree(path, ignore_errors=True)


def test_lock_file_is_not_a_chunk(tmp_path):
    s = F.open_store(str(tmp_path / "s"))
    src = F.Chunks()
    assert s.write([src.item("a", 4096)]) == [True]
    assert os.path.isfile(tmp_path / "s" / LOCK_NAME)
    s.close()
    s = F.open_store(str(tmp_path / "s"))
    assert len(s) == 1 and s.usage_bytes == HEADER_SIZE + 4096  # not counted, not scanned
    s.close()


def test_usage_is_shared_between_instances(tmp_path, monkeypatch):
    """Two stores (as two processes would) on one path see one usage and one
    cap; the second one's write evicts the first one's oldest chunk."""
    from lmcache_fx.core import store as store_mod

    monkeypatch.setattr(store_mod, "TOUCH_SECONDS", 0.0)  # hits refresh recency at once (default: 10 s)
    f = HEADER_SIZE + CHUNK
    cap = (3 * f + 10) / (1 << 30)
    a = F.open_store(str(tmp_path / "s"), max_capacity_gb=cap)
    b = F.open_store(str(tmp_path / "s"), max_capacity_gb=cap)
    src = F.Chunks()
    assert a.write([src.item(f"a{i}", CHUNK) for i in range(3)]) == [True] * 3
    assert b.usage_bytes == 3 * f
    F.read_check(b, ["a0"])  # a hit: a0 is now the most recently used, for both
    assert b.settle_touches()  # once b's toucher has set its mtime (just after the hit)
    assert b.write([src.item("b0", CHUNK)]) == [True]
    assert a.usage_bytes == b.usage_bytes == 3 * f
    assert a.contains("a0") and not a.contains("a1") and a.contains("b0")
    a.close()
    b.close()


def test_tp_ranks_do_not_collide(tmp_path):
    """Keys of ranks 0..7 of one chunk hash: 8 files, each read back as its rank's."""
    s = F.open_store(str(tmp_path / "s"))
    keys = [f"m@8@{r}@00000000deadbeef@bfloat16" for r in range(8)]
    src = F.Chunks()
    assert s.write([src.item(k, 8192, 0, r) for r, k in enumerate(keys)]) == [True] * 8
    assert len({chunk_digest(k) for k in keys}) == 8 and len(F.chunk_files(str(tmp_path / "s"))) == 8
    for r, k in enumerate(keys):
        h, m, bad = F.read_check(s, [k], r)
        assert (h, m, bad) == (1, 0, [])
    s.close()


def test_other_model_dtype_world_size_never_match(tmp_path):
    """Keys differ in every field LMCache puts in them; a file planted under
    another key's name is refused by its header (key check), removed."""
    s = F.open_store(str(tmp_path / "s"))
    k = "llama@1@0@00000000cafef00d@bfloat16"
    src = F.Chunks()
    assert s.write([src.item(k, 8192)]) == [True]
    others = [
        "qwen@1@0@00000000cafef00d@bfloat16",
        "llama@1@0@00000000cafef00d@float16",
        "llama@2@0@00000000cafef00d@bfloat16",
        "llama@1@0@00000000cafef00e@bfloat16",
    ]
    assert not any(s.contains(o) for o in others)
    planted = s.path_for(chunk_digest(others[0]))
    os.makedirs(os.path.dirname(planted), exist_ok=True)
    shutil.copy(s.path_for(chunk_digest(k)), planted)
    h, m, bad = F.read_check(s, [others[0]])
    assert (h, m) == (0, 1) and not os.path.exists(planted)
    s.close()


@pytest.mark.slow
def test_instance_b_retrieves_what_instance_a_stored(tmp_path):
    """Two LMCacheEngines in two processes (same model and config): B gets A's prefix."""
    store = str(tmp_path / "store")
    env = dict(os.environ, PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false", PYTHONPATH=ROOT)
    outs = []
    for role in ("store", "retrieve"):
        p = subprocess.run(
            [sys.executable, os.path.join(HERE, "xproc.py"), role, store, str(tmp_path), "1024"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        assert line, p.stderr[-3000:]
        outs.append(json.loads(line[-1][7:]))
    figure(
        "instances",
        stored_chunks=outs[0]["chunks"],
        retrieved_tokens=outs[1]["tokens"],
        equal=outs[1]["equal"],
        chunks_read=outs[1]["chunks_read"],
    )
    assert outs[0]["chunks"] == 4 and outs[1]["tokens"] == 1024 and outs[1]["equal"]
    assert outs[1]["chunks_read"] == 4


def _mount_source(mnt: str) -> str:
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, m = line.split()[:2]
            if m == mnt:
                return dev
    raise AssertionError(f"{mnt} not mounted")


def test_two_real_users_share_a_store():
    """shared_group with two real users in one group, each with another
    primary group, under umask 022, on a store directory the operator made
    (root:fxshare, 0770, no setgid): each reads the other's chunks and evicts
    them under the shared cap; directories the store makes are 02770 in the
    store's group, files 0660 in it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create two users (useradd) and run a child as each")
    gid, ((u1, g1), (u2, g2)) = _two_users()
    with _group_store(gid) as path:
        cap = 6 * (CHUNK + HEADER_SIZE)
        k1 = [f"model@2@0@{h:016x}@bfloat16" for h in range(4)]
        k2 = [f"model@2@1@{h:016x}@bfloat16" for h in range(4)]
        r1 = _run_as(u1, g1, [gid], {"path": path, "cap": cap, "read": [], "read_rank": 0, "write": k1, "rank": 0})
        r2 = _run_as(u2, g2, [gid], {"path": path, "cap": cap, "read": k1, "read_rank": 0, "write": k2, "rank": 1})
        r3 = _run_as(u1, g1, [gid], {"path": path, "cap": cap, "read": k2, "read_rank": 1, "write": [], "rank": 0})
        dirs = [os.path.join(path, d) for d in os.listdir(path)]
        dmodes = {(oct(os.stat(d).st_mode & 0o7777), os.stat(d).st_gid == gid) for d in dirs}
        files = [os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs]
        fmodes = {(oct(os.stat(f).st_mode & 0o777), os.stat(f).st_gid == gid) for f in files}
        owners = {os.stat(f).st_uid for f in F.chunk_files(path)}
    figure(
        "two-real-users",
        user1_wrote=r1["wrote"],
        user2_read_user1=r2["hits"],
        user2_wrote=r2["wrote"],
        user2_evicted=r2["evictions"],
        user1_read_user2=r3["hits"],
        wrong=len(r2["bad"]) + len(r3["bad"]),
        dir_modes=sorted(dmodes),
        file_modes=sorted(fmodes),
    )
    assert r1["wrote"] == 4 and r2["hits"] == 4 and r2["wrote"] == 4 and r3["hits"] == 4
    assert r2["evictions"] >= 2 and not r2["bad"] and not r3["bad"]
    assert dmodes == {("0o2770", True)}, dmodes
    assert fmodes == {("0o660", True)}, fmodes
    assert owners == {u2} or owners == {u1, u2}


def test_a_user_without_shared_group_is_named_when_another_cannot_open_the_store():
    """A process without shared_group: true opened a group's store first:
    its lock file (and its chunks) only its user may open. The other user's
    process with shared_group: true failed to start with "Permission
    denied", never naming the setting; it now says which setting and what to
    do."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create two users (useradd) and run a child as each")
    gid, ((u1, g1), (u2, g2)) = _two_users()
    with _group_store(gid) as path:
        os.chown(path, u1, gid)  # user 1's directory, shared with the group
        os.chmod(path, 0o2770)  # setgid: what is made in it stays in the group, whoever makes it
        cap = 8 * (CHUNK + HEADER_SIZE)
        base = {"path": path, "cap": cap, "read": [], "read_rank": 0, "rank": 0}
        r1 = _run_as(u1, g1, [gid], {**base, "write": ["model@2@0@00@bfloat16"], "shared": False})
        r2 = _run_as(u2, g2, [gid], {**base, "write": []})
    assert r1.get("wrote") == 1, r1
    said = r2.get("error") or ""
    assert "Permission denied" in said and "shared_group: true in every process" in said, r2
    # The other order: the group's store made by the sharing process, then a chunk written by one
    # without shared_group (only its user may read it): a miss, and the reader is told why.
    with _group_store(gid) as path:
        os.chown(path, u1, gid)
        os.chmod(path, 0o2770)
        keys = ["model@2@0@01@bfloat16"]
        assert _run_as(u2, g2, [gid], {**base, "path": path, "write": []}).get("error") is None
        assert _run_as(u1, g1, [gid], {**base, "path": path, "write": keys, "shared": False})["wrote"] == 1
        r3 = _run_as(u2, g2, [gid], {**base, "path": path, "write": [], "read": keys})
    assert r3["hits"] == 0 and not r3["bad"], r3
    assert any("Permission denied" in m and "shared_group: true in every process" in m for m in r3["said"]), r3


def test_a_hit_of_another_user_refreshes_the_lru_clock():
    """shared_group: a hit sets its chunk's mtime (the shared LRU clock) to an
    exact time, which only the file's owner may do. Another user's hit failed
    with EPERM, unsaid, so the chunk that user kept reading was evicted
    first, as if never read. A hit on another user's chunk now sets it to
    now (write access, the group's, is enough)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create two users (useradd) and run a child as each")
    gid, ((u1, g1), (u2, g2)) = _two_users()
    with _group_store(gid) as path:
        cap = 8 * (CHUNK + HEADER_SIZE)
        keys = [f"model@2@0@{h:016x}@bfloat16" for h in range(4)]
        r1 = _run_as(u1, g1, [gid], {"path": path, "cap": cap, "read": [], "read_rank": 0, "write": keys, "rank": 0})
        assert r1["wrote"] == 4
        files = F.chunk_files(path)
        hour_ago = time.time() - 3600
        for f in files:  # written an hour ago: a hit is due to refresh them
            os.utime(f, (hour_ago, hour_ago))
        r2 = _run_as(
            u2, g2, [gid], {"path": path, "cap": cap, "read": keys[:1], "read_rank": 0, "write": [], "rank": 1}
        )
        fresh = sorted(f for f in files if os.stat(f).st_mtime > hour_ago + 60)
        owners = {os.stat(f).st_uid for f in files}

    assert r2["hits"] == 1 and not r2["bad"] and owners == {u1}
    assert len(fresh) == 1, fresh  # the chunk user 2 read, and only it


def test_two_mount_namespaces(xfs_dir, tmp_path):
    """A process in another mount namespace mounts the same XFS elsewhere and
    shares the store: it reads the parent's chunks, the parent reads its
    chunks, and both count one usage through the lock file."""
    _need_xfs()
    if shutil.which("unshare") is None:
        pytest.skip("unshare not found")
    path = os.path.join(xfs_dir, "ns-store")
    f = HEADER_SIZE + CHUNK
    cap = 6 * f + 100
    s = F.open_store(path, max_capacity_gb=cap / (1 << 30))
    src = F.Chunks()
    mine = [f"m@2@0@{i:016x}@bfloat16" for i in range(4)]
    assert s.write([src.item(k, CHUNK, 0, 0) for k in mine]) == [True] * 4
    dev = _mount_source(xfs_dir)
    other = str(tmp_path / "other-mnt")
    os.makedirs(other)
    theirs = [f"m@2@1@{i:016x}@bfloat16" for i in range(4)]
    args = {"path": os.path.join(other, "ns-store"), "cap": cap, "read": mine, "write": theirs}
    cmd = f"mount {dev} {other} && exec {sys.executable} {os.path.abspath(__file__)} ns '{json.dumps(args)}'"
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=ROOT)
    p = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if not line and "mount" in p.stderr:
        pytest.skip(f"cannot mount in a new namespace: {p.stderr[-300:]}")
    assert line, p.stderr[-3000:]
    r = json.loads(line[-1][7:])
    got = [k for k in theirs if s.contains(k)]
    h, m, bad = F.read_check(s, got, 1)
    usage = s.usage_bytes
    files = F.chunk_files(path)
    s.close()
    figure(
        "mount-namespaces",
        child_hits=r["hits"],
        child_wrote=r["wrote"],
        parent_hits=h,
        wrong=len(bad) + len(r["bad"]),
        usage=usage,
        files_bytes=sum(os.path.getsize(x) for x in files),
        cap=cap,
        other_ns=r["mountinfo_id"] != os.readlink("/proc/self/ns/mnt"),
    )
    assert r["hits"] == 4 and r["wrote"] == 4 and not r["bad"]
    assert h + m == len(got) and not bad and h >= 2  # the cap holds 6: two of the parent's were evicted
    assert usage == sum(os.path.getsize(x) for x in files) <= cap
    assert not os.path.ismount(other)  # the mount lived only in the child's namespace


def child_user(a):
    """As one of two real users sharing a store: read what the other wrote,
    write own chunks (evicting the other's under the shared cap)."""
    from lmcache_fx.core.options import ConfigError

    with F.LogCount() as logs:  # what the open and the reads say
        try:
            s = F.open_store(a["path"], shared_group=a.get("shared", True), max_capacity_gb=a["cap"] / (1 << 30))
        except ConfigError as e:
            print("RESULT " + json.dumps({"error": str(e)}), flush=True)
            return
        h, m, bad = F.read_check(s, a["read"], a["read_rank"])
    s.settle_touches()  # the hits' LRU clock, set by the store's toucher thread
    src = F.Chunks()
    ok = s.write([src.item(k, CHUNK, 0, a["rank"]) for k in a["write"]])
    st = s.stats.snapshot()
    s.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "hits": h,
                "misses": m,
                "bad": bad,
                "wrote": sum(ok),
                "evictions": st["evictions"],
                "uid": os.getuid(),
                "said": [r.getMessage() for r in logs.records],
            }
        ),
        flush=True,
    )


SHARE_GROUP, SHARE_USERS = "fxshare", ("fxuser1", "fxuser2")


def _two_users():
    """(gid of the shared group, [(uid, primary gid)] of two users in it, each with a primary group of their own)."""
    import grp
    import pwd

    if subprocess.run(["getent", "group", SHARE_GROUP], capture_output=True).returncode != 0:
        subprocess.run(["groupadd", SHARE_GROUP], check=True)
    users = []
    for u in SHARE_USERS:
        if subprocess.run(["id", u], capture_output=True).returncode != 0:
            subprocess.run(["useradd", "-M", "-U", "-G", SHARE_GROUP, "-s", "/usr/sbin/nologin", u], check=True)
        pw = pwd.getpwnam(u)
        users.append((pw.pw_uid, pw.pw_gid))
    return grp.getgrnam(SHARE_GROUP).gr_gid, users


@contextlib.contextmanager
def _group_store(gid):
    """A store directory the operator made for a group (root:<gid>, 0770, no
    setgid) under /tmp, reachable by the group's users; removed after."""
    import tempfile

    top = tempfile.mkdtemp(prefix="fx-users-")
    try:
        os.chmod(top, 0o755)
        path = os.path.join(top, "store")
        os.mkdir(path)
        os.chown(path, 0, gid)
        os.chmod(path, 0o770)
        yield path
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _run_as(uid, gid, groups, args) -> dict:
    """child_user(args) in a forked child with the user's ids (fork, not a new
    interpreter: this one may live where other users cannot reach, e.g. /root)."""
    import io
    import mmap  # noqa: F401  the child cannot import from where the interpreter lives: load what it needs now
    import traceback
    from contextlib import redirect_stdout

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            os.umask(0o022)
            buf = io.StringIO()
            with redirect_stdout(buf):
                child_user(args)
            os.write(w, buf.getvalue().encode())
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    line = [x for x in text.splitlines() if x.startswith("RESULT ")]
    assert status == 0 and line, text[-3000:]
    return json.loads(line[-1][7:])


ROLES = {"writer": child_writer, "reader": child_reader, "ns": child_ns, "user": child_user}

if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))


def test_restoring_a_key_its_index_forgot_keeps_the_usage_exact(tmp_path):
    """A chunk whose index entry is gone while its file is not (a read that
    missed dropped it, or the bounded index pruned it) is replaced by the
    next store of its key: the replaced file leaves the shared usage, so the
    ledger still equals the bytes on disk (it used to count both)."""
    path = str(tmp_path / "s")
    s = F.open_store(path, max_capacity_gb=1)
    try:
        src = F.Chunks()
        assert s.write([src.item("k/0", 65536), src.item("k/1", 151675)]) == [True, True]
        for key in ("k/0", "k/1"):
            s._drop(chunk_digest(key), unlink=False)  # forgotten by this process, still on disk
        assert s.write([src.item("k/0", 65536, version=1), src.item("k/1", 151675, version=1)]) == [True, True]
        assert s.usage_bytes == dir_bytes(path) == 2 * HEADER_SIZE + 65536 + 151675
        assert F.read_check(s, ["k/0", "k/1"])[:2] == (2, 0)
    finally:
        s.close()


def test_a_chunk_forgotten_by_a_lookup_during_a_read_is_a_miss_not_a_failed_read(tmp_path):
    """A read of [K1, K2] takes K2's header first (K1's is known); meanwhile
    another process stores K1 anew (another inode) and a lookup on another
    thread here sees it and forgets what was read of K1. K1 is a miss, K2 a
    hit with its bytes, no read error (the read allocated for a meta the
    lookup had cleared, and the whole batch failed); the next read gets K1's
    new bytes."""
    from lmcache_fx.core.drive import _run_step, drive_blocking

    path = str(tmp_path / "store")
    a, b = F.open_store(path, max_capacity_gb=0.01), F.open_store(path, max_capacity_gb=0.01)
    src = F.Chunks()
    k1, k2, spacer = (f"model@1@0@{h:016x}@bfloat16" for h in (1, 2, 3))
    try:
        assert b.write([src.item(k, 65536) for k in (k1, k2)]) == [True, True]
        assert F.read_check(a, [k1]) == (1, 0, [])  # a knows K1's header, not K2's
        gen = a.read_steps([k1, k2], F.allocator(), a._takes_chunks(a.engine))
        step = next(gen)  # K2's header
        ino = os.stat(a.path_for(chunk_digest(k1))).st_ino
        assert b.remove(k1) and b.write([src.item(spacer, 65536)]) == [True]  # the spacer takes the freed inode
        assert b.write([src.item(k1, 65536, version=1)]) == [True]
        assert os.stat(a.path_for(chunk_digest(k1))).st_ino != ino
        assert a.contains(k1)  # another file in K1's place: what was read of the old one is forgotten
        got = drive_blocking(a.engine, F.resume(gen, _run_step(a.engine, step)), lambda h: None)
        assert got[0] is None and got[1] is not None and F.check(k2, memoryview(got[1])) == "ok"
        assert a.stats.snapshot()["read_errors"] == 0
        out = a.read([k1], F.allocator(), lambda h: None)
        assert out[0] is not None and F.check(k1, memoryview(out[0])) == "ok"
        assert bytes(memoryview(out[0])) == F.payload(k1, 65536, version=1)
    finally:
        a.close()
        b.close()


def test_the_ledger_counts_its_changes_after_the_record_older_readers_read(tmp_path):
    """Ledger.changes() is a token that differs after every put() (a walk made
    without the lock counts only when it did not change). It lives after the
    28-byte record, which stays as it was: a record written by an older
    version (no count) reads as count 0, and one changed by an older writer
    (record and count disagree on the usage) differs from the token before."""
    import struct
    import zlib

    from lmcache_fx.core.ledger import Ledger

    root = str(tmp_path / "store")
    os.makedirs(root)
    led = Ledger.open(root, 0o600, 0o700, False)
    try:
        with led.hold():
            led.put(1000, 5.0)
            t1 = led.changes()
            led.put(1000, 5.0)  # the same usage: still a change
            t2 = led.changes()
            assert t1 != t2 and t2[0] == t1[0] + 1 and t2[1:] == (1000, 1000)
            head = os.pread(led.fd, 28, 0)
            magic, usage, scanned = struct.unpack("<8sqd", head[:24])
            assert (magic, usage, scanned) == (Ledger.MAGIC, 1000, 5.0)
            assert zlib.crc32(head[:24]) == struct.unpack("<I", head[24:])[0]
            # An older writer rewrites the 28-byte record only:
            b = struct.pack("<8sqd", Ledger.MAGIC, 1200, 5.0)
            os.pwrite(led.fd, b + struct.pack("<I", zlib.crc32(b)), 0)
            assert led.get() == (1200, 5.0) and led.changes() != t2
            os.ftruncate(led.fd, 28)  # a lock file only an older version wrote
            assert led.changes() == (0, None, 1200)
            led.put(1300, 6.0)
            assert led.changes() == (1, 1300, 1300) and led.get() == (1300, 6.0)
    finally:
        led.release()


def test_victims_moved_for_reuse_are_counted_once_when_the_evictor_rescans(tmp_path):
    """A store whose victim list runs out mid-eviction (another process
    removed and wrote chunks since the list was made) rescans: the walk
    counted the victims it had just moved to this write's temporaries as a
    live writer's files, and adopting them counted them again, so it evicted
    more than it needed and the ledger stayed above the bytes on disk."""
    path = str(tmp_path / "s")
    a = F.open_store(path, max_capacity_gb=0.001)
    src, n = F.Chunks(), 64 << 10
    try:
        assert a.write([src.item(f"k{i}", n) for i in range(5)]) == [True] * 5
        b = F.open_store(path, max_capacity_gb=0.001)  # its victim list: k0..k4
        try:
            for i in range(3):
                a.remove(f"k{i}")
            assert a.write([src.item(f"k{i}", n) for i in range(5, 17)]) == [True] * 12
            assert a.usage_bytes == b.usage_bytes == dir_bytes(path)  # b sees the store full: it will reuse
            assert b.write([src.item(f"x{i}", n) for i in range(5)]) == [True] * 5
            assert b.stats.recycled >= 1  # the victims' files were reused
            assert b.usage_bytes == dir_bytes(path)
            assert b.stats.evictions == 4  # 17 - 3 + 5 chunks of 68 KiB under a 1 MiB cap: 14 fit, 4 go
        finally:
            b.close()
    finally:
        a.close()


def test_a_full_disk_while_reserving_keeps_the_ledger_exact(tmp_path, monkeypatch):
    """ENOSPC making a temporary inside the reservation (the store full, so
    temporaries are made under the ledger) evicted a little at once, nested
    under the reservation, which then wrote its own usage back over that
    eviction's: the evicted bytes stayed counted. The eviction runs once the
    write is over now, and the ledger equals the bytes on disk."""
    import errno

    from lmcache_fx.core import store as store_mod

    path = str(tmp_path / "s")
    s = F.open_store(path, max_capacity_gb=1)
    src, n = F.Chunks(), 64 << 10
    try:
        assert s.write([src.item(f"k{i}", n) for i in range(20)]) == [True] * 20
        s._last_usage = s.options.max_capacity_bytes  # believed full: temporaries made in the reservation
        real, made = os.open, [0]

        def full_on_second(p, flags, *a, **kw):
            if isinstance(p, str) and store_mod.TMP_MARK in p and flags & os.O_CREAT:
                made[0] += 1
                if made[0] == 2:
                    raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real(p, flags, *a, **kw)

        monkeypatch.setattr(store_mod.os, "open", full_on_second)
        assert s.write([src.item("x1", n), src.item("x2", n)]) == [True, False]
        monkeypatch.undo()
        assert s.stats.evictions >= 1 and s.usage_bytes == dir_bytes(path)
    finally:
        s.close()


def test_a_key_too_long_for_the_header_fails_alone(tmp_path):
    """A key (with its meta) too long for the 4 KiB header made write()
    raise ValueError from inside the batch: every chunk of it was lost (and
    the adapters marked them all failed). That chunk alone is False now,
    with a warning; the others are stored; nothing is left counted."""
    for odirect in ("auto", "false"):
        path = str(tmp_path / f"s-{odirect}")
        s = F.open_store(path, max_capacity_gb=1, odirect=odirect)
        src, n = F.Chunks(), 64 << 10
        try:
            with F.LogCount() as logs:
                got = s.write([src.item("good", n), src.item("k" * 5000, n), src.item("good2", n)])
                warned = logs.count(logging.WARNING, "do not fit the 4096-byte header")
            assert got == [True, False, True] and warned == 1
            assert F.read_check(s, ["good", "good2"])[:2] == (2, 0)
            assert s.usage_bytes == dir_bytes(path) and not F.tmp_files(path)
        finally:
            s.close()


def test_a_batch_larger_than_the_cap_says_so_once(tmp_path):
    """A write batch larger than max_capacity_gb logged 'no room ... (pinned
    chunks fill it)' once per chunk left out, with nothing pinned. One
    warning per batch now, with the reason that applies."""
    f = HEADER_SIZE + CHUNK
    s = F.open_store(str(tmp_path / "s"), max_capacity_gb=(3 * f + 10) / (1 << 30))
    src = F.Chunks()
    with F.LogCount() as logs:
        got = s.write([src.item(f"big/{i}", CHUNK) for i in range(6)])
    s.close()
    assert got.count(True) == 3
    said = [r.getMessage() for r in logs.records if "not stored: no room" in r.getMessage()]
    assert len(said) == 1 and "3 of 6 chunks" in said[0] and "the batch alone" in said[0], said
    assert logs.count(logging.WARNING, "pinned chunks fill it") == 0
    # In the cap's unit with the digits it needs: "0.00 GiB in 6 chunks" said nothing
    assert f"({6 * f / (1 << 30):.3g} GiB in 6 chunks)" in said[0] and "(0.00 GiB" not in said[0], said


def test_a_full_disk_eviction_that_freed_nothing_is_tried_again(tmp_path, monkeypatch):
    """After an ENOSPC burst the store evicts 5 % for room, and not again
    until it has grown into what that freed. An eviction that freed nothing
    (the lock held elsewhere, every victim pinned) was recorded all the
    same: no full-disk eviction ever ran again while the disk stayed full."""
    s = F.open_store(str(tmp_path / "s"))
    src = F.Chunks()
    assert s.write([src.item(f"k{i}", CHUNK) for i in range(4)]) == [True] * 4
    calls = []
    monkeypatch.setattr(s, "_evict_to", lambda limit: calls.append(limit) or False)  # frees nothing
    s._evict_for_room()
    s._evict_for_room()
    s.close()
    assert len(calls) == 2 and s._enospc_evicted_to is None


def test_a_write_whose_sub_batch_thread_cannot_start_stores_every_chunk(xfs_dir, monkeypatch):
    """A large O_DIRECT store writes its sub-batches on a thread each;
    where none can be started (a pids limit) the write raised after it had
    stored some chunks, and the plugins took every chunk as not stored. The
    sub-batch now runs on the calling thread."""
    from lmcache_fx.core import store as store_mod

    monkeypatch.setattr(store_mod, "WRITE_SUB_BYTES", 1)  # sub-batches of WRITE_SUB_CHUNKS
    s = F.open_store(os.path.join(xfs_dir, "subs"))
    try:
        assert s.odirect
        F.refuse_threads(monkeypatch, "lmcache-fx-write")
        src = F.Chunks()
        keys = [f"sub-{i}" for i in range(3 * store_mod.WRITE_SUB_CHUNKS)]
        assert s.write([src.item(k, CHUNK) for k in keys]) == [True] * len(keys)
        monkeypatch.undo()
        assert F.read_check(s, keys) == (len(keys), 0, [])
    finally:
        s.close()


def test_the_toucher_survives_a_thread_it_cannot_start_and_a_fork(tmp_path, monkeypatch):
    """The LRU clock's thread: one that could not start made the lookup
    raise and left the toucher dead (every later touch queued for nothing,
    its descriptors never closed); a child forked while its lock was held
    hung in close()."""
    import threading

    from lmcache_fx.core import store as store_mod

    monkeypatch.setattr(store_mod, "TOUCH_SECONDS", 0.0)
    s = F.open_store(str(tmp_path / "s"))
    src = F.Chunks()
    assert s.write([src.item(f"t{i}", CHUNK) for i in range(3)]) == [True] * 3
    F.refuse_threads(monkeypatch, "lmcache-fx-toucher")
    assert s.lookup(["t0", "t1"], pin=True) == [True, True]  # no raise: recency is advisory
    monkeypatch.undo()
    monkeypatch.setattr(store_mod, "TOUCH_SECONDS", 0.0)
    old = 1_000_000_000
    os.utime(s.path_for(chunk_digest("t2")), ns=(old, old))
    assert s.lookup(["t2"], pin=True) == [True] and s.settle_touches()
    assert os.stat(s.path_for(chunk_digest("t2"))).st_mtime_ns > old  # a thread started at the next touch
    toucher = s._toucher
    held, go = threading.Event(), threading.Event()

    def hold():
        with toucher._cv:
            held.set()
            go.wait(10)

    h = threading.Thread(target=hold)
    h.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: its copy of the lock is held by a thread it does not have
        import signal

        signal.alarm(10)
        s._toucher.close()
        s._toucher.settle(0.1)
        os._exit(0)
    go.set()
    h.join()
    _, status = os.waitpid(pid, 0)
    for k in ("t0", "t1", "t2"):
        s.unpin(k)
    s.close()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status  # SIGALRM: hung
    assert toucher._fds == []  # closed with the thread, which close() waited for


def test_an_evictor_takes_chunks_another_process_wrote_since_its_walk_before_its_own_newer_ones(tmp_path):
    """Process A evicts from the list its last walk made plus the chunks it
    wrote since. Once the walk's chunks were gone it evicted its own chunks
    of a moment ago, while older chunks that process B wrote after A's walk
    stayed (a review: B's 16 older chunks all kept, 8 of A's newer ones
    evicted): the store's LRU was not shared. A looks again when its list
    reaches its own writes and another process has changed the store since
    its walk: the oldest go, whoever wrote them."""
    path = str(tmp_path / "s")
    cap = 32 * (HEADER_SIZE + CHUNK)
    a = F.open_store(path, max_capacity_gb=cap / (1 << 30))
    try:
        src = F.Chunks()

        def write(prefix, n):
            for i in range(n):  # one a batch, each younger than the last
                assert a.write([src.item(f"{prefix}/{i}", CHUNK)]) == [True]
                time.sleep(0.005)

        write("A/first", 32)  # full; A's victim list: this walk and its own writes
        b = spawn("writer", {"path": path, "cap": cap, "rank": 1, "n": 16})  # evicts A/first 0-15
        assert len(_result(b)["done"]) == 16
        write("A/new", 16)  # evicts A/first 16-31
        on_disk = {os.path.basename(p)[:32] for p in F.chunk_files(path)}
        b_keys = [f"model@8@1@{h:016x}@bfloat16" for h in range(16)]
        assert all(chunk_digest(k) in on_disk for k in b_keys)  # B's, then A's 16 newer
        write("A/newer", 8)  # the 8 oldest are B's
        on_disk = {os.path.basename(p)[:32] for p in F.chunk_files(path)}
        assert sum(chunk_digest(k) in on_disk for k in b_keys) == 8
        assert all(chunk_digest(f"A/new/{i}") in on_disk for i in range(16))
    finally:
        a.close()
