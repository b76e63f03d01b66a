"""Faults in the C core (issue 16 item 7), driven through the real extension,
real io_uring and real files.

Faults come from the fault points compiled into the core, armed by
LMCACHE_FX_FAULT="kind:count,..." when an Engine is created (kinds:
wait_eintr, submit_fail, eagain, eintr, short, map_truncate, no_clone, map_cut; see
csrc/fxio.h), and from the real thing: signals sent to the reading thread, a
low RLIMIT_NOFILE, fork().

Every case runs in a child interpreter with a timeout, so a hang fails the test
instead of hanging pytest. The child prints one line `RESULT <json>`. What must
hold everywhere: per op, the bytes are exact or the result is a -errno; no
exception for per-op failures; the engine works after; descriptors and threads
(io_uring's own iou-* workers aside) are back to where they were.
"""

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import pids_limit
import pytest

from lmcache_fx import _fxio as fx

MiB = 1 << 20
ALIGN = 4096
URING_OK, URING_WHY = fx.io_uring_status()
needs_uring = pytest.mark.skipif(not URING_OK, reason=f"io_uring unusable here: {URING_WHY}")
KINDS = [pytest.param("io_uring", marks=needs_uring), "threads"]

PRELUDE = r'''
import ctypes, gc, json, os, resource, select, signal, sys, threading, time
from lmcache_fx import _fxio as fx

MiB = 1 << 20
ALIGN = 4096
ARGS = json.loads(sys.argv[1])

def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

def fd_count():
    return len(os.listdir("/proc/self/fd"))

def thread_count():
    """Threads of this process, io_uring's own workers (iou-*) aside."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += not f.read().startswith("iou-")
        except OSError:
            pass
    return n

with open(ARGS["path"], "rb") as f:
    DATA = f.read()

def open_data(direct):
    return os.open(ARGS["path"], os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))

def read_all(eng, fd, nops=6, crc=False, submit=False):
    """Reads the file in nops ops (the last asks past EOF) into one aligned
    buffer; returns (results, problems): problems lists ops whose result is
    neither a -errno nor exactly the bytes expected."""
    size = len(DATA)
    span = -(-size // ALIGN) * ALIGN
    part = -(-span // nops // ALIGN) * ALIGN
    hb = fx.HostBuffer(span, hugepages=False)
    mv = memoryview(hb)
    mv[:] = bytes([0xEE]) * span
    ops = []
    for off in range(0, span, part):
        ops.append((fd, off, min(part, span - off), hb.address + off))
    if submit:
        res = eng.submit(ops, crc=crc).wait()
    else:
        res = eng.read(ops, crc=crc)
    problems = []
    for (_, off, ln, _), r in zip(ops, res):
        n = r[0] if crc else r
        want = min(ln, max(size - off, 0))
        if n < 0:
            continue
        if n != want or mv[off:off + n] != DATA[off:off + n]:
            problems.append([off, ln, n, want])
        elif crc and r[1] != fx.crc32c(DATA[off:off + n]):
            problems.append([off, ln, n, "crc"])
    return [r[0] if crc else r for r in res], problems
'''


def run_child(body, args, tmp_path, env=None, timeout=60):
    """Runs PRELUDE + body in a child interpreter; returns its RESULT dict."""
    script = tmp_path / "child.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    e = dict(os.environ)
    e.pop("LMCACHE_FX_FAULT", None)
    e.update(env or {})
    root = os.path.dirname(os.path.dirname(os.path.abspath(fx.__file__)))
    e["PYTHONPATH"] = root + os.pathsep + e.get("PYTHONPATH", "")
    try:
        p = subprocess.run(
            [sys.executable, str(script), json.dumps(args)], env=e, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"child hung (killed after {timeout} s); stdout: {exc.stdout!r}")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"child rc={p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """6 MiB + 1234 bytes of random data (not a multiple of 4 KiB), on a
    filesystem that takes O_DIRECT where it can."""
    d = tmp_path_factory.mktemp("faults")
    path = d / "data.bin"
    path.write_bytes(random.Random(16).randbytes(6 * MiB + 1234))
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        direct = True
    except OSError:
        direct = False
    return str(path), direct


def directs(data_file):
    return [False, True] if data_file[1] else [False]


# ------------------------------------------------------------------ EINTR / EAGAIN


@needs_uring
def test_eintr_from_every_wait(data_file, tmp_path):
    """A wait that returns -EINTR is retried, in the main loop and in the drain."""
    r = run_child(
        """
        eng = fx.Engine(io_engine="io_uring", queue_depth=8, split_bytes=256 * 1024)
        report = {}
        for direct in ARGS["directs"]:
            fd = open_data(direct)
            report[str(direct)] = read_all(eng, fd)
            os.close(fd)
        out(report=report, fired=fx._fault_counts())
        """,
        {"path": data_file[0], "directs": directs(data_file)},
        tmp_path,
        env={"LMCACHE_FX_FAULT": "wait_eintr:40"},
    )
    assert r["fired"]["wait_eintr"] == 40
    for direct, (res, problems) in r["report"].items():
        assert problems == [] and all(n >= 0 for n in res), (direct, res, problems)
        assert sum(res) == os.path.getsize(data_file[0])


@needs_uring
def test_abort_reaps_every_read_in_flight(data_file, tmp_path):
    """The ring fails with reads in flight and the drain's waits are interrupted
    (EINTR): every read in flight is still reaped before the call returns.
    Before: the first EINTR ended the drain, the ring was torn down with the
    reads still landing in the caller's buffer, and every op failed even when
    all its bytes had arrived."""
    r = run_child(
        """
        fds0, thr0 = fd_count(), thread_count()
        eng = fx.Engine(io_engine="io_uring", queue_depth=8, split_bytes=256 * 1024)
        fd = open_data(ARGS["direct"])
        part = 512 * 1024                   # 2 pieces per op: 4 ops in flight when it fails
        hb = fx.HostBuffer(12 * part, hugepages=False)
        mv = memoryview(hb)
        mv[:] = bytes([0xEE]) * (12 * part)
        res = eng.read([(fd, i * part, part, hb.address + i * part) for i in range(12)])
        problems = [i for i, n in enumerate(res)
                    if n >= 0 and (n != part or mv[i * part:(i + 1) * part] != DATA[i * part:(i + 1) * part])]
        fired = fx._fault_counts()
        again, problems2 = read_all(eng, fd)         # a new ring replaces the one thrown away
        os.close(fd)
        eng.close()
        out(res=res, problems=problems, again=again, problems2=problems2, fired=fired,
            fds=[fds0, fd_count()], threads=[thr0, thread_count()])
        """,
        {"path": data_file[0], "direct": data_file[1]},
        tmp_path,
        # pieces queued op by op, so that the pieces in flight are whole ops (one
        # file on one device is queued so anyway; the variable pins it)
        env={"LMCACHE_FX_FAULT": "submit_fail:1,wait_eintr:6", "LMCACHE_FX_PIECE_ORDER": "ops"},
    )
    assert r["fired"]["submit_fail"] == 1 and r["fired"]["wait_eintr"] == 6, r["fired"]
    assert r["problems"] == [] and r["problems2"] == [], r
    # the 8 pieces in flight (the first 4 ops) arrived whole and count; the rest failed
    assert r["res"] == [512 * 1024] * 4 + [-errno.EIO] * 8, r["res"]
    assert all(n >= 0 for n in r["again"]) and sum(r["again"]) == os.path.getsize(data_file[0])
    assert r["fds"][0] == r["fds"][1] and r["threads"][0] == r["threads"][1], r


@needs_uring
def test_abort_leaves_no_read_landing_after_return(data_file, tmp_path):
    """O_DIRECT reads from the disk are really in flight when the ring fails:
    after read() returns, the buffer must not change any more."""
    if not data_file[1]:
        pytest.skip("no O_DIRECT on this filesystem: reads would not be in flight")
    r = run_child(
        """
        eng = fx.Engine(io_engine="io_uring", queue_depth=64, split_bytes=64 * 1024)
        fd = open_data(True)
        span = -(-len(DATA) // ALIGN) * ALIGN
        late = 0
        for trial in range(ARGS["trials"]):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            hb = fx.HostBuffer(span, hugepages=False)
            mv = memoryview(hb)
            mv[:] = bytes([0xEE]) * span
            ops = [(fd, off, min(MiB, span - off), hb.address + off) for off in range(0, span, MiB)]
            res = eng.read(ops)
            snap = bytes(mv)
            time.sleep(0.05)
            late += bytes(mv) != snap
            for (_, off, ln, _), n in zip(ops, res):
                assert n < 0 or mv[off:off + n] == DATA[off:off + n], (off, n)
        out(late=late, fired=fx._fault_counts())
        """,
        {"path": data_file[0], "trials": 4},
        tmp_path,
        env={"LMCACHE_FX_FAULT": "submit_fail:4,wait_eintr:1000"},
    )
    assert r["fired"]["submit_fail"] == 4
    assert r["late"] == 0, "bytes landed in the buffer after read() had returned"


@pytest.mark.parametrize("kind", KINDS)
def test_some_eagain_and_eintr_completions_are_retried(kind, data_file, tmp_path):
    r = run_child(
        """
        eng = fx.Engine(io_engine=ARGS["kind"], queue_depth=4, split_bytes=512 * 1024)
        report = {}
        for direct in ARGS["directs"]:
            fd = open_data(direct)
            report[str(direct)] = read_all(eng, fd, crc=True)
            os.close(fd)
        out(report=report, fired=fx._fault_counts())
        """,
        {"path": data_file[0], "kind": kind, "directs": directs(data_file)},
        tmp_path,
        env={"LMCACHE_FX_FAULT": "eagain:12,eintr:12"},
    )
    assert r["fired"]["eagain"] == 12 and r["fired"]["eintr"] == 12
    for direct, (res, problems) in r["report"].items():
        assert problems == [] and sum(res) == os.path.getsize(data_file[0]), (direct, res, problems)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault,err", [("eagain", errno.EAGAIN), ("eintr", errno.EINTR)])
def test_endless_eagain_or_eintr_fails_the_op_not_the_call(kind, fault, err, data_file, tmp_path):
    """Before: resubmitted forever (the child hung). Now: a bounded number of
    retries, then that op's result is the -errno; reads and writes alike; the
    engine works once the fault is gone."""
    r = run_child(
        """
        fds0, thr0 = fd_count(), thread_count()
        eng = fx.Engine(io_engine=ARGS["kind"], queue_depth=4, split_bytes=256 * 1024)
        fd = open_data(False)
        res, problems = read_all(eng, fd)
        wpath = ARGS["path"] + ".w." + ARGS["kind"]
        wfd = os.open(wpath, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        src = bytearray(DATA[:MiB])
        wres = eng.write([(wfd, 0, MiB, ctypes.addressof(ctypes.c_char.from_buffer(src)))])
        fired = fx._fault_counts()
        os.environ["LMCACHE_FX_FAULT"] = ""
        fx.Engine(io_engine="threads", queue_depth=1).close()   # a new Engine disarms
        again, problems2 = read_all(eng, fd)
        os.close(fd); os.close(wfd); os.unlink(wpath)
        eng.close()
        out(res=res, problems=problems, wres=wres, again=again, problems2=problems2, fired=fired,
            fds=[fds0, fd_count()], threads=[thr0, thread_count()])
        """,
        {"path": data_file[0], "kind": kind},
        tmp_path,
        env={"LMCACHE_FX_FAULT": f"{fault}:100000000"},
    )
    assert r["res"] == [-err] * len(r["res"]) and r["wres"] == [-err], r
    assert 0 < r["fired"][fault] < 100000
    assert r["problems2"] == [] and sum(r["again"]) == os.path.getsize(data_file[0])
    assert r["fds"][0] == r["fds"][1] and r["threads"][0] == r["threads"][1], r


# ------------------------------------------------------------------ short reads


@pytest.mark.parametrize("kind", KINDS)
def test_short_reads_are_continued_not_taken_as_eof(kind, data_file, tmp_path):
    """Every read returns about half of what it asked for (every other one off
    the 4 KiB grid): the reads go on from there and the bytes come back whole;
    the op that asks past the end still ends at the end of the file. Before: a
    short O_DIRECT read was taken as the end of the file."""
    r = run_child(
        """
        eng = fx.Engine(io_engine=ARGS["kind"], queue_depth=8, split_bytes=512 * 1024)
        report = {}
        for direct in ARGS["directs"]:
            fd = open_data(direct)
            report[str(direct)] = read_all(eng, fd, crc=True)
            report[str(direct) + "-submit"] = read_all(eng, fd, nops=5, submit=True)
            os.close(fd)
        out(report=report, fired=fx._fault_counts())
        """,
        {"path": data_file[0], "kind": kind, "directs": directs(data_file)},
        tmp_path,
        env={"LMCACHE_FX_FAULT": "short:100000"},
    )
    assert r["fired"]["short"] > 20
    for name, (res, problems) in r["report"].items():
        assert problems == [] and all(n >= 0 for n in res), (name, res, problems)
        assert sum(res) == os.path.getsize(data_file[0]), (name, res)


@pytest.mark.parametrize("kind", KINDS)
def test_unaligned_odirect_tail_still_ends_at_eof(kind, data_file, tmp_path):
    """No faults: an O_DIRECT read past the end of a file whose size is off the
    4 KiB grid ends there in one go (a short read at EOF is EOF)."""
    if not data_file[1]:
        pytest.skip("no O_DIRECT on this filesystem")
    r = run_child(
        """
        eng = fx.Engine(io_engine=ARGS["kind"], queue_depth=8, split_bytes=1 << 20)
        fd = open_data(True)
        out(one=read_all(eng, fd, nops=1), many=read_all(eng, fd, nops=7))
        """,
        {"path": data_file[0], "kind": kind},
        tmp_path,
    )
    for res, problems in (r["one"], r["many"]):
        assert problems == [] and sum(res) == os.path.getsize(data_file[0]), (res, problems)


# ------------------------------------------------------------------ real signals


@pytest.mark.parametrize("kind", KINDS)
def test_signals_during_reads(kind, data_file, tmp_path):
    """SIGUSR1, with a Python handler, sent over and over to the reading thread
    (and to the process, for submit()'s threads) while large reads run: the
    waits see EINTR; every read comes back whole."""
    r = run_child(
        """
        got = [0]
        signal.signal(signal.SIGUSR1, lambda *a: got.__setitem__(0, got[0] + 1))
        eng = fx.Engine(io_engine=ARGS["kind"], queue_depth=32, split_bytes=128 * 1024)
        main = threading.get_ident()
        stop = threading.Event()
        sent = [0]
        def pester():
            while not stop.is_set():
                signal.pthread_kill(main, signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGUSR1)
                sent[0] += 2
                time.sleep(0.0002)
        t = threading.Thread(target=pester)
        t.start()
        bad, total = [], 0
        try:
            deadline = time.monotonic() + 1.5
            rounds = 0
            while time.monotonic() < deadline or rounds < 6:
                for direct in ARGS["directs"]:
                    fd = open_data(direct)
                    if direct:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    for submit in (False, True):
                        res, problems = read_all(eng, fd, nops=3, submit=submit)
                        total += 1
                        if problems or sum(res) != len(DATA):
                            bad.append([direct, submit, res, problems])
                    os.close(fd)
                rounds += 1
        finally:
            stop.set()
            t.join()
        out(bad=bad, total=total, sent=sent[0], handled=got[0])
        """,
        {"path": data_file[0], "kind": kind, "directs": directs(data_file)},
        tmp_path,
    )
    assert r["bad"] == [] and r["total"] >= 6, r
    assert r["sent"] > 100 and r["handled"] > 0, r


# ------------------------------------------------------------------ RLIMIT_NOFILE


@needs_uring
def test_ring_creation_fails_under_low_nofile(data_file, tmp_path):
    """No descriptor left for a ring: io_uring_status says why, Engine('auto')
    falls back to threads, Engine('io_uring') raises OSError, registering a
    buffer returns -EMFILE, and a batch whose ring cannot be replaced runs on
    the calling thread (before: OSError ENOMEM out of read())."""
    r = run_child(
        """
        fd = open_data(False)
        dfd = open_data(True) if ARGS["direct"] else fd
        keep = fx.Engine(io_engine="io_uring", queue_depth=8, split_bytes=256 * 1024)
        os.environ["LMCACHE_FX_FAULT"] = "submit_fail:1"
        old = fx.Engine(io_engine="io_uring", queue_depth=8, split_bytes=256 * 1024)
        # the first read fails the engine's only ring (thrown away: it needs a new one)
        first, p0 = read_all(old, fd)
        os.environ["LMCACHE_FX_FAULT"] = ""    # each Engine() re-reads it: the next disarms
        reg = fx.HostBuffer(MiB, hugepages=False)
        fds0 = fd_count()
        probe = os.dup(0); os.close(probe)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))   # no new descriptor
        status = fx.io_uring_status()
        auto = fx.Engine(io_engine="auto", queue_depth=8)
        auto_res, p1 = read_all(auto, fd)
        try:
            fx.Engine(io_engine="io_uring")
            forced = "no error"
        except OSError as e:
            forced = f"OSError: {e}"
        registered = keep.register_buffer(reg.address, MiB)
        keep_res, p2 = read_all(keep, fd)               # its ring is still there
        old_res, p3 = read_all(old, fd)                 # needs a new ring: none to be had
        # batches at once on keep: all but one need a ring of their own, none to be had
        errors, bad = [], []
        def reader():
            for _ in range(3):
                try:
                    res, problems = read_all(keep, dfd, nops=2)
                    if problems or sum(res) != len(DATA):
                        bad.append([res, problems])
                except Exception as e:
                    errors.append(repr(e))
        ts = [threading.Thread(target=reader) for _ in range(3)]
        for t in ts: t.start()
        for t in ts: t.join()
        resource.setrlimit(resource.RLIMIT_NOFILE, (probe + 1, hard))   # room for its eventfd only
        sub_res = old.submit([(fd, 0, MiB, reg.address)]).wait()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        fds1 = fd_count()
        after, p4 = read_all(old, fd)
        for e in (old, keep, auto):
            e.close()
        out(first=first, status=status, auto_kind=auto.kind, reason=auto.fallback_reason,
            auto_res=auto_res, forced=forced, registered=registered, keep_res=keep_res,
            old_res=old_res, sub_res=sub_res, after=after, problems=[p0, p1, p2, p3, p4],
            sub_ok=bytes(memoryview(reg)) == DATA[:MiB], fds=[fds0, fds1], errors=errors, bad=bad)
        """,
        {"path": data_file[0], "direct": data_file[1]},
        tmp_path,
    )
    size = os.path.getsize(data_file[0])
    assert r["problems"] == [[]] * 5, r["problems"]
    assert r["status"][0] is False and "Too many open files" in r["status"][1], r["status"]
    assert r["auto_kind"] == "threads" and "Too many open files" in r["reason"]
    assert r["forced"].startswith("OSError") and "Too many open files" in r["forced"]
    assert r["registered"] == -errno.EMFILE
    for name in ("auto_res", "keep_res", "old_res", "after"):
        assert sum(r[name]) == size, (name, r[name])
    assert r["errors"] == [] and r["bad"] == [], (r["errors"], r["bad"])
    assert r["sub_res"] == [MiB] and r["sub_ok"]
    assert r["fds"][0] == r["fds"][1]


# ------------------------------------------------------------------ fork


@pytest.mark.parametrize("kind", KINDS)
def test_fork_child_gets_a_clear_error(kind, data_file, tmp_path):
    """In a forked child every call on the parent's Engine, Batch and HostBuffer
    raises RuntimeError at once (before: the thread engine's child hung waiting
    for threads it does not have; io_uring's used the parent's ring); close()
    there returns; a new Engine in the child works; the parent's engine still
    works, also with reads running in another thread while it forks."""
    r = run_child(
        """
        eng = fx.Engine(io_engine=ARGS["kind"], queue_depth=8, split_bytes=256 * 1024)
        fd = open_data(False)
        hb = fx.HostBuffer(2 * MiB)
        hb_addr = hb.address
        batch = eng.submit([(fd, 0, MiB, hb_addr)])
        batch.wait()
        if ARGS["kind"] == "io_uring":
            assert eng.register_buffer(hb_addr, 2 * MiB) == 0
        stop = threading.Event()
        busy = [0]
        def reader():
            while not stop.is_set():
                res, problems = read_all(eng, fd, nops=4)
                assert not problems and sum(res) == len(DATA)
                busy[0] += 1
        t = threading.Thread(target=reader)
        t.start()
        children = []
        for i in range(4):
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:
                report = {}
                def attempt(name, fn):
                    try:
                        report[name] = ["ok", repr(fn())]
                    except BaseException as e:
                        report[name] = [type(e).__name__, str(e)]
                attempt("read", lambda: eng.read([(fd, 0, 4096, hb_addr)]))
                attempt("write", lambda: eng.write([(fd, 0, 4096, hb_addr)]))
                attempt("submit", lambda: eng.submit([(fd, 0, 4096, hb_addr)]))
                # checksummed: took the engine's lock (maybe held by a parent thread at fork) first
                attempt("submit_crc", lambda: eng.submit([(fd, 0, 4096, hb_addr)], crc=True))
                attempt("register", lambda: eng.register_buffer(0, 0))
                attempt("batch_wait", lambda: batch.wait())
                attempt("batch_done", lambda: batch.done())
                attempt("hb_address", lambda: hb.address)
                attempt("hb_view", lambda: memoryview(hb))
                def fresh():
                    e2 = fx.Engine(io_engine=ARGS["kind"])
                    buf = bytearray(MiB)
                    res = e2.read([(fd, 0, MiB, ctypes.addressof(ctypes.c_char.from_buffer(buf)))])
                    # submitted: a runner of the child's own (the parent's idle ones are not here)
                    buf2 = bytearray(MiB)
                    sub = e2.submit([(fd, MiB, MiB, ctypes.addressof(ctypes.c_char.from_buffer(buf2)))]).wait()
                    e2.close()
                    return res == [MiB] and bytes(buf) == DATA[:MiB] and sub == [MiB] and bytes(buf2) == DATA[MiB:2 * MiB]
                attempt("fresh", fresh)
                attempt("close", eng.close)
                del batch
                gc.collect()
                os.write(wfd, json.dumps(report).encode())
                os._exit(0)
            os.close(wfd)
            children.append((pid, rfd))
            time.sleep(0.02)
        reports = []
        for pid, rfd in children:
            ready, _, _ = select.select([rfd], [], [], 10)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                reports.append("HUNG")
            else:
                chunks = []
                while True:
                    b = os.read(rfd, 65536)
                    if not b:
                        break
                    chunks.append(b)
                reports.append(json.loads(b"".join(chunks) or b"null"))
            os.close(rfd)
            _, status = os.waitpid(pid, 0)
        stop.set()
        t.join()
        # the parent: its engine, batch results and buffer still work
        res, problems = read_all(eng, fd)
        again = eng.read([(fd, 0, MiB, hb_addr)])
        ok_hb = bytes(memoryview(hb)[:MiB]) == DATA[:MiB]
        # MADV_DONTFORK: a HostBuffer is not mapped in a child at all
        pid = os.fork()
        if pid == 0:
            ctypes.string_at(hb_addr, 1)
            os._exit(0)
        _, st = os.waitpid(pid, 0)
        eng.close()
        out(reports=reports, res=res, problems=problems, again=again, ok_hb=ok_hb, busy=busy[0],
            hb_child_signal=os.WTERMSIG(st) if os.WIFSIGNALED(st) else None)
        """,
        {"path": data_file[0], "kind": kind},
        tmp_path,
    )
    assert "HUNG" not in r["reports"], r["reports"]
    for rep in r["reports"]:
        for name in (
            "read",
            "write",
            "submit",
            "submit_crc",
            "register",
            "batch_wait",
            "batch_done",
            "hb_address",
            "hb_view",
        ):
            assert rep[name][0] == "RuntimeError", (name, rep[name])
            assert "another process (fork)" in rep[name][1], (name, rep[name])
        assert "create a new Engine in the child" in rep["read"][1]
        assert rep["fresh"] == ["ok", "True"] and rep["close"] == ["ok", "None"], rep
    assert r["problems"] == [] and sum(r["res"]) == os.path.getsize(data_file[0])
    assert r["again"] == [MiB] and r["ok_hb"] and r["busy"] > 0
    assert r["hb_child_signal"] == signal.SIGSEGV


def test_bad_fault_spec_is_refused(tmp_path, data_file):
    r = run_child(
        """
        try:
            fx.Engine(io_engine="threads")
            msg = "accepted"
        except ValueError as e:
            msg = str(e)
        out(msg=msg)
        """,
        {"path": data_file[0]},
        tmp_path,
        env={"LMCACHE_FX_FAULT": "eagain:3,bogus:1"},
    )
    assert "LMCACHE_FX_FAULT" in r["msg"] and "bogus" in r["msg"]


# ------------------------------------------------------------------ fixed buffers without the clone

NO_CLONE_BODY = """
import errno
fd = open_data(False)

def burst(eng, buf, n=4):
    # n reads at once: a ring each, so each new ring takes the registration
    bad = []
    def one(i):
        off = i * MiB
        res = eng.read([(fd, off, MiB, buf.address + off)])
        if res != [MiB] or memoryview(buf)[off:off + MiB] != DATA[off:off + MiB]:
            bad.append(i)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts: t.start()
    for t in ts: t.join()
    return bad

eng = fx.Engine("io_uring", queue_depth=8, split_bytes=MiB)
big = fx.HostBuffer(300 * MiB, hugepages=False)
r_big = eng.register_buffer(big.address, len(big))
reg_big = eng.registered
bad_big = burst(eng, big)
small = fx.HostBuffer(8 * MiB, hugepages=False)
r_small = eng.register_buffer(small.address, len(small))
reg_small = eng.registered
bad_small = burst(eng, small)
eng.close()
out(r_big=r_big, reg_big=reg_big, bad_big=bad_big, r_small=r_small, reg_small=reg_small, bad_small=bad_small)
"""


def _kernel_clones() -> bool:
    """IORING_REGISTER_CLONE_BUFFERS came with Linux 6.12."""
    nums = os.uname().release.split("-")[0].split(".")
    try:
        return (int(nums[0]), int(nums[1])) >= (6, 12)
    except (IndexError, ValueError):
        return False


@needs_uring
def test_without_the_clone_a_large_table_is_not_pinned_on_every_ring(data_file, tmp_path):
    """On a kernel that cannot clone one ring's fixed buffers into another
    (before 6.12; here the no_clone fault point), each new ring would pin
    the whole table again, one after another (16 reads at once after
    start-up, a 4 GiB pool: 1.46 s): a table over 256 MiB is refused with
    EOPNOTSUPP, and reads into it are plain and exact; a small one is still
    registered on every ring, reads through several rings exact. Where the
    kernel clones, the large table registers."""
    faulted = run_child(NO_CLONE_BODY, {"path": data_file[0]}, tmp_path, env={"LMCACHE_FX_FAULT": "no_clone:100000"})
    assert faulted["r_big"] == -errno.EOPNOTSUPP and not faulted["reg_big"], faulted
    assert faulted["r_small"] == 0 and faulted["reg_small"], faulted
    assert faulted["bad_big"] == [] and faulted["bad_small"] == [], faulted
    plain = run_child(NO_CLONE_BODY, {"path": data_file[0]}, tmp_path)
    assert plain["bad_big"] == [] and plain["bad_small"] == [], plain
    if _kernel_clones():
        assert plain["r_big"] == 0 and plain["reg_big"], plain
    else:
        assert plain["r_big"] == -errno.EOPNOTSUPP, plain


def _two_inits_at_once(make, init, tries=30):
    """Runs init(obj) from two threads at once on each of `tries` fresh
    objects; (tries where both calls succeeded, the errors said, fds and
    threads before and after)."""
    import gc
    import threading

    def counts():
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    gc.collect()
    before, both, said = counts(), 0, set()
    for _ in range(tries):
        obj, errs, bar = make(), [], threading.Barrier(2)

        def go(obj=obj, errs=errs, bar=bar):
            bar.wait()
            try:
                init(obj)
            except RuntimeError as e:
                errs.append(str(e))

        ts = [threading.Thread(target=go) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        both += not errs
        said.update(errs)
        obj.close()
        del obj
        gc.collect()
    return both, said, before, counts()


@pytest.mark.parametrize("kind", KINDS)
def test_engine_init_from_two_threads_builds_one_engine(kind):
    """__init__ drops the GIL to build the ring or the threads: a second call
    on the same object passed the "already initialised" check meanwhile and
    overwrote the first call's engine (39 of 50 tries; 39 ring fds or 120
    threads leaked). One call builds it now; the other is refused."""
    both, said, before, after = _two_inits_at_once(
        lambda: fx.Engine.__new__(fx.Engine), lambda e: e.__init__(io_engine=kind, queue_depth=8, threads=4)
    )
    assert both == 0 and said <= {"Engine is already initialised", "Engine is being initialised by another call"}
    # fds back; threads not above (earlier tests' threads may still be ending)
    assert after[0] == before[0] and after[1] <= before[1], (before, after)


def test_register_buffer_past_the_address_space_is_refused():
    """A length whose count of 1 GiB iovecs wrapped to 0 registered nothing
    and returned 0, and Engine.registered said True."""
    e = fx.Engine(io_engine="auto", queue_depth=4)
    hb = fx.HostBuffer(1 << 20)
    try:
        for n in (2**64 - 1, 2**64 - 4096, 2**63):
            with pytest.raises(ValueError, match="run past the address space"):
                e.register_buffer(hb.address, n)
            assert not e.registered
    finally:
        e.close()


@needs_uring
def test_a_clone_probe_short_of_descriptors_is_not_the_kernels_answer(data_file, tmp_path):
    """Whether this kernel shares one ring's registration with another is
    probed once with two rings of one entry. A probe that could not make its
    second ring (descriptors run out) answered "no" for the life of the
    process: registering the LMCache pool then failed, and said the kernel
    could not share, after the limit was lifted too."""
    body = r"""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    base = os.open("/dev/null", os.O_RDONLY)
    os.close(base)
    resource.setrlimit(resource.RLIMIT_NOFILE, (base + 1, hard))  # the probe's first ring fits, its second not
    under = fx.io_uring_shares_buffers()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out(under=under, after=fx.io_uring_shares_buffers())
    """
    control = run_child("out(after=fx.io_uring_shares_buffers())", {"path": data_file[0]}, tmp_path)
    got = run_child(body, {"path": data_file[0]}, tmp_path)
    assert got["under"] is False and got["after"] == control["after"], (got, control)


@needs_uring
def test_a_staging_buffer_that_could_not_be_mapped_is_tried_again_later(data_file, tmp_path):
    """One staging buffer that could not be mapped (an address-space limit)
    switched staged reads off for the life of the process; the next mapping
    is tried a second later, and the reads are staged again."""
    if not data_file[1]:
        pytest.skip("staged reads are O_DIRECT reads; this filesystem refuses O_DIRECT")
    body = r"""
    def vm_bytes():
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmSize:")) * 1024

    eng = fx.Engine("io_uring", queue_depth=8)
    fd = open_data(True)
    size = 1 << 20
    hb = fx.HostBuffer(4 * size, hugepages=False)
    ops = [(fd, i * size, size, hb.address + i * size) for i in range(4)]
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (4 << 20), hard))
    under = [r[0] for r in eng.read(ops, crc=True, stage=True)]
    made_under = fx._stage_buffers()
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    time.sleep(1.2)
    res = eng.read(ops, crc=True, stage=True)
    ok = all(bytes(memoryview(hb)[i * size : (i + 1) * size]) == DATA[i * size : (i + 1) * size] for i in range(4))
    out(under=under, made_under=made_under, after=[r[0] for r in res], ok=ok, made=fx._stage_buffers(),
        staged=fx.direct_staged_pieces())
    """
    got = run_child(body, {"path": data_file[0]}, tmp_path)
    assert got["under"] == [1 << 20] * 4 and got["made_under"] == 0, got  # read unstaged under the limit
    assert got["ok"] and got["after"] == [1 << 20] * 4 and got["made"] >= 1 and got["staged"] >= 4, got


@needs_uring
def test_a_ring_refused_for_want_of_address_space_does_not_blame_memlock(data_file, tmp_path):
    """io_uring_setup answers ENOMEM under an address-space limit too (and on
    kernels since 5.12 a ring is charged to the memory cgroup, not to
    memlock): the message named the memlock limit whatever the cause."""
    body = r"""
    with open("/proc/self/status") as f:
        vm = next(int(ln.split()[1]) for ln in f if ln.startswith("VmSize:")) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm, hard))
    try:
        fx.Engine("io_uring", queue_depth=8)
        said = None
    except OSError as e:
        said = str(e)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    out(said=said)
    """
    said = run_child(body, {"path": data_file[0]}, tmp_path)["said"]
    assert said is not None and "Cannot allocate memory" in said, said
    assert "address-space limit (ulimit -v) is set" in said and "memlock limit too low" not in said, said


@needs_uring
def test_reads_the_kernel_cancels_for_want_of_a_worker_run_on_the_reaping_thread(xfs_dir, tmp_path):
    """A read io_uring cannot finish inline goes to an io-wq worker; where
    none can be started (a pids limit with no task to spare, as in a
    container at its limit), the kernel ends it -ECANCELED. Every such read
    came back a failure (a miss to the store), for as long as the limit
    held; they are run on the reaping thread instead, and counted."""
    parent = pids_limit.cgroup_parent()
    if parent is None:
        pytest.skip(pids_limit.SKIP_REASON)
    path = os.path.join(xfs_dir, f"pids-{os.getpid()}.bin")
    with open(path, "wb") as f:
        f.write(random.Random(66).randbytes(4 * MiB))
    body = r"""
    import logging
    from lmcache_fx.core.chunkfile import ChunkMeta
    from lmcache_fx.core.options import FxOptions
    from lmcache_fx.core.store import ChunkStore

    said = []
    handler = logging.Handler()
    handler.emit = lambda rec: said.append(rec.getMessage())
    logging.getLogger("lmcache_fx").addHandler(handler)
    store = ChunkStore(FxOptions.from_mapping({"path": ARGS["store"], "max_capacity_gb": 1, "io_engine": "io_uring"}))
    size = 1 << 20
    src = fx.HostBuffer(4 * size, hugepages=False)
    memoryview(src)[:] = DATA[: 4 * size]
    meta = ChunkMeta(((size,),), ("uint8",), "raw")
    keys = [f"k{i}" for i in range(4)]
    assert all(store.write([(k, src.address + i * size, size, meta) for i, k in enumerate(keys)]))
    dst = fx.HostBuffer(4 * size, hugepages=False)
    with no_task_to_spare(ARGS["parent"]):
        eng = fx.Engine("io_uring", queue_depth=8)
        before = fx.uring_sync_pieces()
        results = {}
        for direct in (True, False):
            fd = open_data(direct)
            res, bad = read_all(eng, fd, nops=4, crc=True)
            os.close(fd)
            results[str(direct)] = [res, bad]
        ran_here = fx.uring_sync_pieces() - before
        store_reads = []
        for _ in range(2):
            slots = iter(range(4))
            got = store.read(keys, lambda _m: (lambda i: (i, dst.address + i * size, size))(next(slots)), lambda h: None)
            store_reads.append(sum(g is not None for g in got))
        exact = bytes(memoryview(dst)) == DATA[: 4 * size]
    store.close()
    warned = [m for m in said if "io_uring could not start a kernel worker" in m]
    out(results=results, ran_here=ran_here, store_reads=store_reads, exact=exact, warned=len(warned))
    """
    store_dir = os.path.join(xfs_dir, f"pids-store-{os.getpid()}")
    try:
        got = run_child(
            pids_limit.CHILD_CODE + textwrap.dedent(body),
            {"path": path, "parent": parent, "store": store_dir},
            tmp_path,
        )
    finally:
        os.unlink(path)
        shutil.rmtree(store_dir, ignore_errors=True)
    for direct, (res, bad) in got["results"].items():
        assert not bad, (direct, bad)
        assert all(r >= 0 for r in res), (direct, res)  # no -ECANCELED, no other -errno
    assert got["ran_here"] > 0, got  # the limit did cancel reads, and they were run here
    # through the store: every chunk a hit, exact, and the operator told once why reads are slower
    assert got["store_reads"] == [4, 4] and got["exact"] and got["warned"] == 1, got
