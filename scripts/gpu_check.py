#!/usr/bin/env python3
"""Device check of lmcache-fx's NVMe -> GPU pipeline: one unattended run.

    scripts/gpu_check.py --dir /mnt/nvme/x --json report.json      # on a GPU host (≤ 8 min)
    scripts/gpu_check.py --stand-in --json report.json              # on CPU, against the stand-in driver

Phases, each with an outcome (pass | fail | warn | skip) written to the JSON
report as soon as it ends (a hang leaves the phases before it, and the
watchdog marks the one that hung):
  environment  GPU, PCIe link, torch/CUDA, driver_info() (must be the real
               driver), filesystem and device of --dir (NVMe?), memlock, NUMA
  driver       staging page-locked, io_uring fixed buffers (a slow path fails
               the check), the thread's current context unchanged by a read,
               torch still works
  correctness  io_uring and threads x O_DIRECT on/off: a whole file; 500
               random unaligned ops (1 B - 9 MiB) with guard gaps; past-EOF and
               empty ops; from a fresh thread; four threads sharing one reader
               - bit-exact on the GPU, guards untouched
  errors       each in a child: bad fd; a destination past an allocation (the
               driver error named, torch still works); close during a read;
               200 create/close cycles with flat GPU and host memory
  ordering     a kernel still using B on the caller's stream, then a clone of
               B, then read_into(B): the clone holds B's old bytes; sync=False:
               work queued after the read sees the data
  throughput   medians of 3, cold cache: fio, torch pinned H2D, a plain-torch
               double buffer, serial read-then-copy, the pipeline at several
               slot configurations; efficiency = pipeline / min(fio, H2D),
               target >= 0.9 (a shortfall only warns); overlap =
               (t_read + t_copy - t_pipe) / t_copy
  lmcache      LMCache with its own CUDA connector (VLLMPagedMemGPUConnectorV2)
               and a vLLM-shaped paged KV cache on the GPU, direct_to_gpu on
               and off: store, retrieve blocking and non-blocking, bit-exact,
               chunk buffer free afterwards, GB/s, p50/p99; first LMCache
               alone (local CPU tier, no fx) through the same connector,
               so a failure says whether LMCache's own round trip fails too
Exit status: 0 when no phase failed (warnings allowed), 1 when one did, 2 when
there is no GPU (without --stand-in).

--stand-in builds tests/fake_gpu_driver.c and runs every phase that can run
on a CPU host against it ("device memory" is host memory, the LMCache phase
uses lmcache-fx's CPU test connector): how CI exercises this script.
"""

import argparse
import ctypes
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB, GiB = 1 << 20, 1 << 30
PHASES = ["environment", "driver", "correctness", "errors", "ordering", "throughput", "lmcache"]


def log(*a):
    print(*a, flush=True)


def _git_commit():
    """The checkout's commit (+dirty where the measured code differs), or None off a checkout."""
    try:
        from lmcache_fx.tools.bench import MEASURED_PATHS
        from lmcache_fx.tools.bench import _git_commit as commit

        return commit(ROOT, MEASURED_PATHS)
    except Exception:  # noqa: BLE001 - a report without it beats no report
        return None


# ------------------------------------------------------------------ the report
class Report:
    def __init__(self, path, args):
        self.path = path
        self.data = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # what produced it, as the bench's JSON records it: a page quoting the run names this
            "command": "python " + " ".join(["scripts/gpu_check.py", *sys.argv[1:]]),
            "git_commit": _git_commit(),
            "stand_in": args.stand_in,
            "args": vars(args),
            "phases": {},
            "current": None,
        }
        self.lock = threading.Lock()
        self.write()

    def write(self):
        with self.lock:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, default=str)
            os.replace(tmp, self.path)

    def phase(self, name, result):
        self.data["phases"][name] = result
        self.data["current"] = None
        self.write()

    def failed(self):
        return [n for n, r in self.data["phases"].items() if r.get("outcome") == "fail"]


def watchdog(rep, deadline_s):
    """Ends a hung run: the phase running is marked failed, the report written."""

    def fire():
        cur = rep.data.get("current") or "?"
        rep.data["phases"][cur] = {"outcome": "fail", "why": f"run exceeded {deadline_s} s (hung?)"}
        rep.data["timed_out"] = True
        rep.write()
        log(f"gpu_check: timed out in phase {cur}; report: {rep.path}")
        os._exit(1)

    t = threading.Timer(deadline_s, fire)
    t.daemon = True
    t.start()
    return t


# ------------------------------------------------------------------ the device
class Dev:
    """GPU memory through torch (real), or host memory (stand-in, whose device
    pointers are host addresses)."""

    def __init__(self, stand_in, index=0):
        import torch

        self.torch, self.stand_in, self.index = torch, stand_in, index
        self.device = torch.device("cpu") if stand_in else torch.device("cuda", index)

    def empty(self, n, fill=None):
        t = self.torch.empty(n, dtype=self.torch.uint8, device=self.device)
        if fill is not None:
            t.fill_(fill)
        return t

    def from_bytes(self, b):
        return self.torch.frombuffer(bytearray(b), dtype=self.torch.uint8).to(self.device)

    def sync(self):
        if not self.stand_in:
            self.torch.cuda.synchronize(self.index)


def build_stand_in():
    src = os.path.join(ROOT, "tests", "fake_gpu_driver.c")
    so = os.path.join(tempfile.mkdtemp(prefix="fxgpu-"), "fake_gpu_driver.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-o", so, src], check=True)
    return so


def fake_lib():
    lib = ctypes.CDLL(os.environ["LMCACHE_FX_GPU_DRIVER"])
    lib.fake_gpu_stream_new.restype = ctypes.c_void_p
    lib.fake_gpu_stream_sync.argtypes = [ctypes.c_void_p]
    lib.fake_gpu_kernel.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_uint,
    ]
    lib.fake_gpu_pinned_bytes.restype = ctypes.c_long
    return lib


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if os.geteuid() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            pass


def open_file(path, odirect):
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if odirect else 0)
    return os.open(path, flags)


def odirect_ok(path):
    try:
        os.close(open_file(path, True))
        return True
    except OSError:
        return False


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------ phase 0
def phase_environment(ctx):
    from lmcache_fx import gpu

    torch = ctx.dev.torch
    out = {
        "host": os.uname().nodename,
        "kernel": os.uname().release,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "driver_info": gpu.driver_info(),
        "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK),
        "dir": ctx.dir,
    }
    df = subprocess.run(["df", "-T", ctx.dir], capture_output=True, text=True).stdout.splitlines()
    out["filesystem"] = df[-1] if df else "?"
    try:
        st = os.stat(ctx.dir)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        real = os.path.realpath(f"/sys/dev/block/{dev}")
        out["block_device"] = real
        out["nvme"] = "/nvme" in real
    except OSError as e:
        out["block_device"], out["nvme"] = f"? ({e})", False
    if not ctx.stand_in:
        out["gpu"] = torch.cuda.get_device_name(ctx.dev.index)
        for q in ("pcie.link.gen.current", "pcie.link.width.current", "pci.bus_id", "driver_version"):
            if shutil.which("nvidia-smi"):
                r = subprocess.run(
                    ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", f"-i={ctx.dev.index}"],
                    capture_output=True,
                    text=True,
                )
                out[q] = r.stdout.strip()
    info = out["driver_info"]
    fake = "fake_gpu_driver" in str(info.get("path"))
    if info["api"] is None:
        return dict(out, outcome="fail", why=f"no GPU driver: {info['error']}")
    if ctx.stand_in != fake:
        return dict(out, outcome="fail", why=f"driver {info['path']} is {'not ' if ctx.stand_in else ''}the stand-in")
    why = [] if out["nvme"] or ctx.stand_in else [f"{ctx.dir} is not on an NVMe device ({out['block_device']})"]
    return dict(out, outcome="warn" if why else "pass", why="; ".join(why) or None)


# ------------------------------------------------------------------ phase 1
def phase_driver(ctx):
    from lmcache_fx import gpu

    dev, out = ctx.dev, {}
    with gpu.GpuReader(device=dev.index, slots=4, slot_bytes=MiB, warn=False) as rd:
        out.update(
            pinned=rd.pinned,
            pin_error=rd.staging.pin_error,
            io=rd.io,
            fixed_buffers=rd.staging.fixed_buffers,
            fixed_error=rd.staging.fixed_error,
            degraded=rd.degraded,
            numa_node=rd.numa_node,
            numa_info=rd.numa_info,
        )
        ctx.env_numa = rd.numa_info
        before = current_context(ctx)
        dst = dev.empty(4 * MiB)
        fd = open_file(ctx.path, False)
        try:
            res = rd.read_into([(fd, 0, 4 * MiB, dst.data_ptr())])
        finally:
            os.close(fd)
        dev.sync()
        out["read"] = res
        after = current_context(ctx)
        # None: the driver's own query could not be made (the check would then hold trivially)
        out["context_unchanged"] = before is not None and after == before
        out["context_query"] = "ok" if before is not None else "failed (cuCtxGetCurrent / hipGetDevice not reached)"
        out["bit_exact"] = bool(dev.torch.equal(dst, ctx.ref[: 4 * MiB]))
    if not ctx.stand_in:
        t = dev.torch.ones(1024, device=dev.device)
        out["torch_works"] = float(t.sum().item()) == 1024.0
        try:
            out["io_uring_pinned_table"] = pinned_table(ctx)
        except Exception as e:  # informative only
            out["io_uring_pinned_table"] = {"error": repr(e)[:300]}
    else:
        out["torch_works"] = True
    bad = [k for k in ("context_unchanged", "bit_exact", "torch_works", "pinned") if not out[k]]
    if out["degraded"]:
        bad.append(f"slow path: {out['degraded']}")
    return dict(out, outcome="fail" if bad else "pass", why="; ".join(bad) or None)


def pinned_table(ctx):
    """What io_uring can register, and whether O_DIRECT reads into torch pinned memory work (docs/gpu.md)."""
    from lmcache_fx import _fxio, gpu

    torch, n = ctx.dev.torch, 64 * MiB
    pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    reg = {"torch pin_memory (cudaHostAlloc)": gpu.io_uring_can_register(pin.data_ptr(), n)}
    hb = _fxio.HostBuffer(n)
    cudart = torch.cuda.cudart()
    r = int(cudart.cudaHostRegister(hb.address, n, 0))
    reg["cudaHostRegister'ed anonymous memory"] = (
        gpu.io_uring_can_register(hb.address, n) if r == 0 else f"cudaHostRegister failed: {r}"
    )
    if r == 0:
        cudart.cudaHostUnregister(hb.address)
    if odirect_ok(ctx.path):
        eng = _fxio.Engine(io_engine="auto")
        fd = open_file(ctx.path, True)
        rr = eng.read([(fd, 0, n, pin.data_ptr())])
        os.close(fd)
        eng.close()
        reg["O_DIRECT read into torch pinned memory"] = rr[0]
        reg["... bit-exact"] = bool(torch.equal(pin.to(ctx.dev.device), ctx.ref[:n]))
    return {k: (f"-{os.strerror(-v)}" if isinstance(v, int) and v < 0 else v) for k, v in reg.items()}


def current_context(ctx):
    from lmcache_fx import gpu

    info = gpu.driver_info()
    try:
        lib = ctypes.CDLL(info["path"])
        if info["api"] == "cuda":
            c = ctypes.c_void_p()
            lib.cuCtxGetCurrent(ctypes.byref(c))
            return c.value or 0  # 0: no context current (NULL), not a failed query
        d = ctypes.c_int(-1)
        lib.hipGetDevice(ctypes.byref(d))
        return d.value
    except (OSError, AttributeError):
        return None


# ------------------------------------------------------------------ phase 2
def check_ops(ctx, rd, fd, ops_spec, dst_size, stream=None):
    """ops_spec: (file_off, n, dst_off); dst filled with 0xEE; returns ok, detail."""
    dev = ctx.dev
    dst = dev.empty(dst_size, 0xEE)
    want = dev.empty(dst_size, 0xEE)
    ops, sizes = [], []
    for off, n, d in ops_spec:
        ops.append((fd, off, n, dst.data_ptr() + d))
        got = max(0, min(n, ctx.size - off))
        sizes.append(got)
        if got:
            want[d : d + got] = ctx.ref[off : off + got]
    dev.sync()
    res = rd.read_into(ops) if stream is None else rd.read_into(ops, stream=stream)
    dev.sync()
    ok = res == sizes and bool(dev.torch.equal(dst, want))
    return ok, (
        None
        if ok
        else {
            "results_wrong": [i for i, (r, s) in enumerate(zip(res, sizes)) if r != s][:10],
            "last_error": rd.last_error,
        }
    )


def random_ops(ctx, n, max_len, seed):
    rnd = random.Random(seed)
    spec, pos = [], 0
    for _ in range(n):
        ln = rnd.randint(1, max_len)
        off = rnd.randrange(0, max(1, ctx.size - ln))
        pos += rnd.randint(1, 4095)  # a guard gap, unaligned destination
        spec.append((off, ln, pos))
        pos += ln
    return spec, pos + 4096


def phase_correctness(ctx):
    from lmcache_fx import _fxio, gpu

    out, bad = {}, []
    engines = ["io_uring", "threads"] if _fxio.io_uring_status()[0] else ["threads"]
    if len(engines) == 1:
        out["io_uring"] = f"unavailable: {_fxio.io_uring_status()}"
    od = odirect_ok(ctx.path)
    out["odirect_supported"] = od
    whole = min(ctx.size, ctx.whole_bytes)
    for io in engines:
        for direct in [True, False] if od else [False]:
            key = f"{io}/{'odirect' if direct else 'buffered'}"
            r = {}
            with gpu.GpuReader(device=ctx.dev.index, io_engine=io, slots=8, slot_bytes=4 * MiB, warn=False) as rd:
                fd = open_file(ctx.path, direct)
                try:
                    r["whole_file"], _ = check_ops(ctx, rd, fd, [(0, whole, 0)], whole)
                    spec, size = random_ops(ctx, ctx.nops, ctx.max_op, seed=zlib.crc32(key.encode()) & 0xFFFF)
                    r["random_unaligned_ops"], r["random_detail"] = check_ops(ctx, rd, fd, spec, size)
                    r["past_eof_and_empty"], _ = check_ops(
                        ctx, rd, fd, [(ctx.size - 5000, 9000, 0), (ctx.size + 4096, 100, 16384), (77, 0, 20000)], 32768
                    )
                    box = {}
                    th = threading.Thread(
                        target=lambda box=box, rd=rd, fd=fd, spec=spec: box.setdefault(
                            "r", check_ops(ctx, rd, fd, spec[:20], spec[19][2] + spec[19][1] + 1)
                        )
                    )
                    th.start()
                    th.join()
                    r["fresh_thread"] = box.get("r", (False,))[0]
                    oks = []

                    def share(k, oks=oks, rd=rd, fd=fd):
                        sp, sz = random_ops(ctx, 20, ctx.max_op, seed=k)
                        oks.append(check_ops(ctx, rd, fd, sp, sz)[0])

                    ths = [threading.Thread(target=share, args=(k,)) for k in range(4)]
                    [t.start() for t in ths]
                    [t.join() for t in ths]
                    r["four_threads_one_reader"] = len(oks) == 4 and all(oks)
                finally:
                    os.close(fd)
            out[key] = r
            bad += [f"{key}: {k}" for k, v in r.items() if v is False]
    return dict(out, outcome="fail" if bad else "pass", why="; ".join(bad) or None)


# ------------------------------------------------------------------ phase 3 (children)
def child_main(name, path, size, index, stand_in):
    """One error case in its own process; prints a JSON line."""
    import torch

    from lmcache_fx import gpu

    dev = Dev(stand_in, index)
    r = {}
    if name == "bad_fd":
        with gpu.GpuReader(device=index, slots=2, slot_bytes=MiB, warn=False) as rd:
            d = dev.empty(4096)
            r["results"] = rd.read_into([(9999, 0, 4096, d.data_ptr())])
            r["ok"] = r["results"] == [-9]  # EBADF
    elif name == "past_allocation":
        with gpu.GpuReader(device=index, slots=2, slot_bytes=MiB, warn=False) as rd:
            fd = open_file(path, False)
            if stand_in:  # the stand-in cannot fault: make its copy call fail the way the driver would
                fake_lib().fake_gpu_fail_copy(ctypes.c_long(1), 0)
                d = dev.empty(4096)
                addr = d.data_ptr()
            else:
                d = dev.empty(4096)
                addr = d.data_ptr() + (64 << 40)  # far past any allocation
            r["results"] = rd.read_into([(fd, 0, MiB, addr)])
            r["last_error"] = rd.last_error
            os.close(fd)
            r["named"] = bool(rd.last_error) and ("CUDA_ERROR" in rd.last_error or "hipError" in rd.last_error)
        if not stand_in:
            try:
                r["torch_works"] = float(torch.ones(8, device=dev.device).sum().item()) == 8.0
            except Exception as e:  # a sticky context error would show here
                r["torch_works"] = False
                r["torch_error"] = repr(e)[:300]
        else:
            fake_lib().fake_gpu_reset()
            r["torch_works"] = True
        r["ok"] = r["results"] == [-5] and r["named"] and r["torch_works"]
    elif name == "close_during_read":
        rd = gpu.GpuReader(device=index, slots=2, slot_bytes=MiB, warn=False)
        n = min(size, 256 * MiB)
        d = dev.empty(n)
        fd = open_file(path, False)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", rd.read_into([(fd, 0, n, d.data_ptr())])))
        t.start()
        time.sleep(0.02)
        rd.close()  # waits for the read
        t.join(60)
        os.close(fd)
        r["read"] = box.get("r")
        try:
            rd.read_into([])
            r["after_close"] = "no error"
        except ValueError as e:
            r["after_close"] = str(e)
        r["ok"] = not t.is_alive() and r["read"] == [n] and "closed" in r["after_close"]
    elif name == "cycles":

        def gpu_used():
            if stand_in:
                return fake_lib().fake_gpu_pinned_bytes()
            free, total = torch.cuda.mem_get_info(index)
            return total - free

        for _ in range(5):
            gpu.GpuReader(device=index, slots=4, slot_bytes=MiB, warn=False).close()
        g0, h0 = gpu_used(), rss_bytes()
        for _ in range(200):
            gpu.GpuReader(device=index, slots=4, slot_bytes=MiB, warn=False).close()
        g1, h1 = gpu_used(), rss_bytes()
        r.update(gpu_before=g0, gpu_after=g1, rss_before=h0, rss_after=h1)
        r["ok"] = g1 - g0 <= 8 * MiB and h1 - h0 <= 32 * MiB
    print("CHILD " + json.dumps(r, default=str), flush=True)


def phase_errors(ctx):
    out, bad = {}, []

    def start(name):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            name,
            "--child-path",
            ctx.path,
            "--child-size",
            str(ctx.size),
            "--device",
            str(ctx.dev.index),
        ] + (["--stand-in-child"] if ctx.stand_in else [])
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))

    def finish(name, p):
        try:
            so, se = p.communicate(timeout=90)
            line = [x for x in so.splitlines() if x.startswith("CHILD ")]
            r = json.loads(line[-1][6:]) if line else {"ok": False, "rc": p.returncode, "stderr": se[-1500:]}
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            r = {"ok": False, "why": "child hung (> 90 s)"}
        out[name] = r
        if not r.get("ok"):
            bad.append(name)

    # Three at once; the memory-flatness cycles alone (others' allocations would blur them).
    procs = [(n, start(n)) for n in ("bad_fd", "past_allocation", "close_during_read")]
    for n, p in procs:
        finish(n, p)
    finish("cycles", start("cycles"))
    return dict(out, outcome="fail" if bad else "pass", why=", ".join(bad) or None)


# ------------------------------------------------------------------ phase 4
def phase_ordering(ctx):
    from lmcache_fx import gpu

    dev, torch, out = ctx.dev, ctx.dev.torch, {}
    n = 64 * MiB if not ctx.stand_in else 4 * MiB
    old = 0x5A
    fd = open_file(ctx.path, False)
    try:
        with gpu.GpuReader(device=dev.index, slots=4, slot_bytes=MiB, warn=False) as rd:
            B = dev.empty(n, old)
            dev.sync()
            if ctx.stand_in:
                lib = fake_lib()
                S = lib.fake_gpu_stream_new()
                C = dev.empty(n)
                lib.fake_gpu_kernel(S, C.data_ptr(), B.data_ptr(), 0, n, 200000)  # sleeps, then clones B
                res = rd.read_into([(fd, 0, n, B.data_ptr())], stream=S)
                lib.fake_gpu_stream_sync(S)
            else:
                torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU time on the current stream
                C = B.clone()  # queued after the sleep, reads B
                res = rd.read_into([(fd, 0, n, B.data_ptr())])  # default: torch's current stream
                torch.cuda.synchronize()
            out["clone_holds_old_bytes"] = bool((C == old).all().item())
            out["read_landed"] = res == [n] and bool(torch.equal(B, ctx.ref[:n]))
            # sync=False: work queued on the stream after the read sees the data
            B2 = dev.empty(n, old)
            dev.sync()
            if ctx.stand_in:
                lib.fake_gpu_set_delay_us(2000)
                res2 = rd.read_into([(fd, n, n, B2.data_ptr())], stream=S, sync=False)
                D = dev.empty(n)
                lib.fake_gpu_kernel(S, D.data_ptr(), B2.data_ptr(), 0, n, 0)
                lib.fake_gpu_stream_sync(S)
                lib.fake_gpu_set_delay_us(0)
            else:
                res2 = rd.read_into([(fd, n, n, B2.data_ptr())], sync=False)
                D = B2.clone()
                torch.cuda.synchronize()
            out["sync_false_seen_by_later_work"] = res2 == [n] and bool(torch.equal(D, ctx.ref[n : 2 * n]))
    finally:
        os.close(fd)
    bad = [k for k, v in out.items() if v is False]
    return dict(out, outcome="fail" if bad else "pass", why=", ".join(bad) or None)


# ------------------------------------------------------------------ phase 5
def run_fio(path, size):
    if not shutil.which("fio"):
        return None, "fio not installed"
    cmd = [
        "fio",
        "--name=fxcheck",
        f"--filename={path}",
        "--rw=read",
        "--bs=4M",
        "--iodepth=16",
        "--ioengine=io_uring",
        "--direct=1",
        f"--size={size}",
        "--output-format=json",
        "--numjobs=1",
    ]
    drop_cache(path)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return None, r.stderr.strip()[-300:]
    j = json.loads(r.stdout[r.stdout.index("{") :])
    return j["jobs"][0]["read"]["bw_bytes"] / 1e9, " ".join(cmd)


def median_of(k, fn):
    return statistics.median(fn() for _ in range(k))


def phase_throughput(ctx):
    from lmcache_fx import _fxio, gpu

    dev, torch = ctx.dev, ctx.dev.torch
    size, out = ctx.tp_bytes, {"bytes": ctx.tp_bytes}
    od = odirect_ok(ctx.path)
    if not ctx.stand_in:
        vals = [run_fio(ctx.path, size) for _ in range(3)]
        bws = [v for v, _ in vals if v]
        out["fio_GBps"] = statistics.median(bws) if bws else None
        out["fio"] = vals[0][1]
    else:
        out["fio_GBps"], out["fio"] = None, "not run with the stand-in"
    dst = dev.empty(size)
    pin = torch.empty(size, dtype=torch.uint8, pin_memory=not ctx.stand_in)

    def h2d():
        dev.sync()
        t0 = time.perf_counter()
        dst.copy_(pin, non_blocking=True)
        dev.sync()
        return size / (time.perf_counter() - t0) / 1e9

    out["h2d_pinned_GBps"] = median_of(3, h2d)
    eng = _fxio.Engine(io_engine="auto", queue_depth=16, split_bytes=4 * MiB)

    def read_only():
        drop_cache(ctx.path)
        fd = open_file(ctx.path, od)
        t0 = time.perf_counter()
        r = eng.read([(fd, 0, size, pin.data_ptr())])
        el = time.perf_counter() - t0
        os.close(fd)
        assert r == [size], r
        return el

    t_read = median_of(3, read_only)
    t_copy = size / out["h2d_pinned_GBps"] / 1e9
    out["read_to_pinned_GBps"] = size / t_read / 1e9

    def serial():
        el = read_only()
        t0 = time.perf_counter()
        dst.copy_(pin, non_blocking=True)
        dev.sync()
        return size / (el + time.perf_counter() - t0) / 1e9

    out["serial_read_then_copy_GBps"] = median_of(3, serial)

    def double_buffer():  # plain torch: two pinned halves, read one while the other copies
        chunk = 8 * MiB
        bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=not ctx.stand_in) for _ in range(2)]
        evs = [None, None]
        drop_cache(ctx.path)
        fd = open_file(ctx.path, od)
        t0 = time.perf_counter()
        for i, off in enumerate(range(0, size, chunk)):
            b = bufs[i % 2]
            if evs[i % 2] is not None:
                evs[i % 2].synchronize()
            n = min(chunk, size - off)
            eng.read([(fd, off, n, b.data_ptr())])
            dst[off : off + n].copy_(b[:n], non_blocking=True)
            if not ctx.stand_in:
                evs[i % 2] = torch.cuda.Event()
                evs[i % 2].record()
        dev.sync()
        el = time.perf_counter() - t0
        os.close(fd)
        return size / el / 1e9

    out["torch_double_buffer_GBps"] = median_of(3, double_buffer)
    out["pipeline"] = []
    for slots, mib in ctx.tp_configs:
        with gpu.GpuReader(device=dev.index, slots=slots, slot_bytes=mib * MiB, warn=False) as rd:
            runs = []
            for _ in range(3):
                drop_cache(ctx.path)
                fd = open_file(ctx.path, od)
                t0 = time.perf_counter()
                res = rd.read_into([(fd, 0, size, dst.data_ptr())])
                el = time.perf_counter() - t0
                os.close(fd)
                runs.append((el, res == [size], rd.stats()))
            el = statistics.median(e for e, _, _ in runs)
            c = {
                "slots": slots,
                "slot_MiB": mib,
                "GBps": size / el / 1e9,
                "ok": all(o for _, o, _ in runs),
                "overlap": (t_read + t_copy - el) / t_copy,
                "copies_during_reads": runs[-1][2]["copies_during_reads"],
            }
            out["pipeline"].append(c)
    best = max(out["pipeline"], key=lambda c: c["GBps"])
    ceiling = min(x for x in (out["fio_GBps"], out["h2d_pinned_GBps"]) if x)
    out["best"] = best
    out["efficiency"] = best["GBps"] / ceiling
    out["overlap"] = best["overlap"]
    # The best configuration again with CRC32C of every piece in its staging slot (what verify costs).
    with gpu.GpuReader(device=dev.index, slots=best["slots"], slot_bytes=best["slot_MiB"] * MiB, warn=False) as rd:
        runs = []
        for _ in range(3):
            drop_cache(ctx.path)
            fd = open_file(ctx.path, od)
            t0 = time.perf_counter()
            res = rd.read_into([(fd, 0, size, dst.data_ptr())], crc=True)
            el = time.perf_counter() - t0
            os.close(fd)
            runs.append((el, res[0][0] == size))
        el = statistics.median(e for e, _ in runs)
        out["pipeline_crc"] = {
            "slots": best["slots"],
            "slot_MiB": best["slot_MiB"],
            "GBps": size / el / 1e9,
            "ok": all(o for _, o in runs),
            "cost": 1 - size / el / 1e9 / best["GBps"],
        }
    bad = [f"pipeline {c['slots']}x{c['slot_MiB']}MiB returned short" for c in out["pipeline"] if not c["ok"]]
    if not out["pipeline_crc"]["ok"]:
        bad.append("pipeline with crc=True returned short")
    if bad:
        return dict(out, outcome="fail", why="; ".join(bad))
    if ctx.stand_in:
        return dict(out, outcome="pass", why="stand-in figures: memcpy, not PCIe; no target applies")
    warn = []
    if out["efficiency"] < 0.9:
        warn.append(f"efficiency {out['efficiency']:.2f} < 0.9 of min(fio, H2D)")
    if out["overlap"] <= 0:
        warn.append(f"no overlap measured ({out['overlap']:.2f})")
    return dict(out, outcome="warn" if warn else "pass", why="; ".join(warn) or None)


# ------------------------------------------------------------------ phase 6
def retrieve_in_place(eng, tokens, kv, retrieve):
    """Retrieves into the very KV cache tensors the store read, zeroed first,
    and compares them with a copy taken before: (tokens retrieved, all equal,
    share of values equal). LMCache's CUDA connector keeps the pointers of
    the first KV caches it is given (vLLM's never move), so a retrieve into
    other tensors lands in the first ones: the H200 run's first reports
    (docs/gpu.md) came back all zeros that way."""
    want = kv.empty_like()
    want.caches = [c.clone() for c in kv.caches]
    for c in kv.caches:
        c.zero_()
    n = retrieve(eng, tokens, kv)
    return n, want.tokens_equal(kv, n), want.equal_share(kv, n)


def lmcache_kv_engine(ctx, cfg, geo, ntok, model):
    """A paged KV cache of ntok tokens (on the GPU, as vLLM's) and an LMCache
    engine over the connector this host has: LMCache's own CUDA connector,
    or with --stand-in the CPU one, keeping its first caches as LMCache's
    does. Returns (kv, the engine's context manager, the connector's name)."""
    from lmcache_fx.testing.cpu_engine import KV, engine_on_cpu, lmcache_engine

    kv = KV(geo, ntok, seed=3)
    if ctx.stand_in:
        return kv, lmcache_engine(cfg, geo, keep_first_caches=True), "PagedCPUConnector (stand-in)"
    from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemGPUConnectorV2

    kv.caches = [c.to(ctx.dev.device) for c in kv.caches]
    kv.slot_mapping = kv.slot_mapping.to(ctx.dev.device)
    conn = VLLMPagedMemGPUConnectorV2(hidden_dim_size=geo.kv_heads * geo.head_dim, num_layers=geo.layers, use_gpu=False)
    cm = engine_on_cpu(cfg, conn, geo.dtype, geo.kv_shape(), geo.mla, geo.chunk, model)
    return kv, cm, "VLLMPagedMemGPUConnectorV2"


def lmcache_run(ctx, direct, layers):
    import asyncio

    torch = ctx.dev.torch
    from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest
    from lmcache_fx.lmcache_plugin import FxStorageBackend
    from lmcache_fx.testing.cpu_engine import (
        Geometry,
        config_from_dict,
        fx_backend,
        fx_config,
        retrieve,
        store_and_wait,
    )

    if ctx.stand_in:
        FxStorageBackend.gpu_memory_device = "cpu"
    store = os.path.join(ctx.dir, f"lmcache_fx_gpu_check_store_{int(direct)}")
    shutil.rmtree(store, ignore_errors=True)
    geo = Geometry(layers=layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    nchunks = ctx.lm_chunks
    ntok = nchunks * 256
    opts = dict(direct_to_gpu=direct, verify=True, cpu_gb=0.25 if ctx.stand_in else 2)
    if direct:
        opts["gpu_buffer_mib"] = 1024 if not ctx.stand_in else 128
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict(fx_config(store, **opts), tmp)
    tokens = torch.arange(ntok) % 30000
    out = {"direct_to_gpu": direct}
    try:
        kv, cm, out["connector"] = lmcache_kv_engine(ctx, cfg, geo, ntok, "fx-gpu-check")
        with cm as eng:
            be = fx_backend(eng)
            store_and_wait(eng, tokens, kv, be)
            keys = [k for _, _, k in eng.token_database.process_tokens(tokens=tokens)]
            lat = []
            exact = {"blocking": 0, "async": 0}
            nbytes = 0
            for mode in ("blocking", "async"):
                for _ in range(ctx.lm_reps):
                    for k in keys:
                        drop_cache(be.store.path_for(chunk_digest(k.to_string())))
                    t0 = time.perf_counter()
                    objs = (
                        be.batched_get_blocking(keys)
                        if mode == "blocking"
                        else asyncio.run(be.batched_get_non_blocking("gpu-check", keys))
                    )
                    lat.append(time.perf_counter() - t0)
                    nbytes = sum(o.get_size() for o in objs if o is not None)
                    ok = 0
                    for o, k in zip(objs, keys):
                        if o is None:
                            continue
                        with open(be.store.path_for(chunk_digest(k.to_string())), "rb") as f:
                            f.seek(HEADER_SIZE)
                            want = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
                        have = o.raw_data.view(torch.uint8).reshape(-1)[: o.get_size()]
                        where_ok = (not direct) or have.device.type == ctx.dev.device.type
                        ok += where_ok and torch.equal(have.cpu(), want)
                        o.ref_count_down()
                    exact[mode] = ok
            lat.sort()
            n, equal, share = retrieve_in_place(eng, tokens, kv, retrieve)
            out.update(
                chunks=len(keys),
                bit_exact=exact,
                retrieve_tokens=n,
                ntok=ntok,
                retrieve_equal=equal,
                equal_share=share,
                GBps_cold=nbytes / statistics.median(lat) / 1e9,
                p50_ms=1e3 * lat[len(lat) // 2],
                p99_ms=1e3 * lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            )
            if direct:
                g = be._gpu
                whole = g.allocate([torch.Size([g.size])], [torch.uint8])
                out["buffer_free_after"] = whole is not None
                if whole is not None:
                    whole.ref_count_down()
                out["pinned"], out["io"] = g.reader.pinned, g.reader.io
            out["ok"] = (
                exact["blocking"] == len(keys)
                and exact["async"] == len(keys)
                and n == ntok
                and out["retrieve_equal"]
                and out.get("buffer_free_after", True)
            )
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return out


def lmcache_control(ctx, layers):
    """LMCache alone (its local CPU tier, no fx): the same KV stored and
    retrieved through the same connector. When this round trip does not give
    back what was stored, a failure of the fx cases is LMCache's (its
    connector on this host's torch), not fx's read path."""
    torch = ctx.dev.torch
    from lmcache_fx.testing.cpu_engine import Geometry, config_from_dict, retrieve

    geo = Geometry(layers=layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    ntok = ctx.lm_chunks * 256
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict({"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 2}, tmp)
    tokens = torch.arange(ntok) % 30000
    kv, cm, _ = lmcache_kv_engine(ctx, cfg, geo, ntok, "fx-gpu-check-control")
    with cm as eng:
        eng.store(tokens, kvcaches=kv.caches, slot_mapping=kv.slot_mapping)
        n, equal, share = retrieve_in_place(eng, tokens, kv, retrieve)
    return {
        "retrieve_tokens": n,
        "ntok": ntok,
        "retrieve_equal": equal,
        "equal_share": share,
        "ok": n == ntok and equal,
    }


def phase_lmcache(ctx):
    out, bad = {}, []
    try:
        out["lmcache_alone"] = lmcache_control(ctx, ctx.lm_layers)
    except Exception as e:
        import traceback

        out["lmcache_alone"] = {"ok": False, "error": repr(e)[:500], "trace": traceback.format_exc()[-2000:]}
    for direct in (True, False):
        key = "direct_to_gpu" if direct else "cpu_tier"
        try:
            out[key] = lmcache_run(ctx, direct, ctx.lm_layers)
        except Exception as e:  # an LMCache failure fails the check
            import traceback

            out[key] = {"ok": False, "error": repr(e)[:500], "trace": traceback.format_exc()[-2000:]}
        if not out[key].get("ok"):
            bad.append(key)
    why = ", ".join(bad) or None
    if bad and not out["lmcache_alone"].get("ok"):
        why += " (LMCache alone, without fx, does not give back what it stored either: see lmcache_alone)"
    return dict(out, outcome="fail" if bad else "pass", why=why)


# ------------------------------------------------------------------ main
class Ctx:
    pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the NVMe to test (default: a temporary directory with --stand-in)")
    ap.add_argument("--size-gib", type=float, default=4, help="test file size (GPU host)")
    ap.add_argument("--json", "--out", dest="json", default=None, help="report path (written after every phase)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--stand-in", action="store_true", help="CPU host: run against tests/fake_gpu_driver.c")
    ap.add_argument("--deadline-s", type=int, default=470, help="the watchdog ends a hung run after this")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-path", help=argparse.SUPPRESS)
    ap.add_argument("--child-size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stand-in-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_main(a.child, a.child_path, a.child_size, a.device, a.stand_in_child)
        return 0

    if a.stand_in:
        os.environ["LMCACHE_FX_GPU_DRIVER"] = build_stand_in()
    elif os.environ.pop("LMCACHE_FX_GPU_DRIVER", None):
        log("gpu_check: LMCACHE_FX_GPU_DRIVER was set: ignored (the check needs the real driver)")
    tmpdir = None
    if not a.dir:
        if not a.stand_in:
            ap.error("--dir (a directory on the NVMe to test) is needed on a GPU host")
        a.dir = tmpdir = tempfile.mkdtemp(prefix="fx-gpu-check-")
    os.makedirs(a.dir, exist_ok=True)
    a.json = a.json or os.path.join(
        os.getcwd(), f"gpu_check-{os.uname().nodename}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    rep = Report(a.json, a)
    wd = watchdog(rep, a.deadline_s)

    import torch

    if not a.stand_in and not torch.cuda.is_available():
        rep.phase(
            "environment",
            {
                "outcome": "fail",
                "why": "torch sees no GPU (torch.cuda.is_available() is False)",
                "torch": torch.__version__,
            },
        )
        log("gpu_check: torch sees no GPU")
        return 2
    ctx = Ctx()
    ctx.stand_in, ctx.dir = a.stand_in, a.dir
    ctx.dev = Dev(a.stand_in, a.device)
    if a.stand_in:
        ctx.size = 64 * MiB + 12345
        ctx.whole_bytes, ctx.nops, ctx.max_op = ctx.size, 100, 512 << 10
        ctx.tp_bytes, ctx.tp_configs, ctx.lm_layers = 32 * MiB, [(4, 1), (8, 2)], 4
        ctx.lm_chunks, ctx.lm_reps = 4, 1
    else:
        ctx.size = max(256 * MiB, int(a.size_gib * GiB) // (64 * MiB) * (64 * MiB))
        ctx.whole_bytes, ctx.nops, ctx.max_op = min(ctx.size, GiB), 500, 9 * MiB
        ctx.tp_bytes, ctx.tp_configs, ctx.lm_layers = ctx.size, [(8, 4), (16, 4), (8, 8), (16, 8)], 32
        ctx.lm_chunks, ctx.lm_reps = 16, 3
    ctx.path = os.path.join(a.dir, "lmcache_fx_gpu_check.bin")
    # Test data: random, kept on the device as the reference.
    t0 = time.time()
    g = torch.Generator().manual_seed(17)
    ref = (
        torch.randint(0, 256, (ctx.size,), dtype=torch.uint8, generator=g)
        if a.stand_in
        else torch.randint(0, 256, (ctx.size,), dtype=torch.uint8, device=ctx.dev.device)
    )
    with open(ctx.path, "wb") as f:
        for o in range(0, ctx.size, 256 * MiB):
            f.write(ref[o : o + 256 * MiB].cpu().numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    ctx.ref = ref
    log(
        f"gpu_check: {'stand-in' if a.stand_in else 'GPU'} run, test file {ctx.size / MiB:.0f} MiB "
        f"written in {time.time() - t0:.1f} s; report {a.json}"
    )
    funcs = {
        "environment": phase_environment,
        "driver": phase_driver,
        "correctness": phase_correctness,
        "errors": phase_errors,
        "ordering": phase_ordering,
        "throughput": phase_throughput,
        "lmcache": phase_lmcache,
    }
    wanted = [p for p in a.phases.split(",") if p]
    try:
        for name in PHASES:
            if name not in wanted:
                rep.phase(name, {"outcome": "skip", "why": "not asked (--phases)"})
                continue
            rep.data["current"] = name
            rep.write()
            t0 = time.time()
            try:
                r = funcs[name](ctx)
            except Exception as e:
                import traceback

                r = {"outcome": "fail", "why": repr(e)[:500], "trace": traceback.format_exc()[-2000:]}
            r["seconds"] = round(time.time() - t0, 2)
            rep.phase(name, r)
            log(f"  {name:12s} {r['outcome'].upper():5s} {r['seconds']:6.1f} s  {r.get('why') or ''}")
    finally:
        if not a.keep:
            try:
                os.unlink(ctx.path)
            except OSError:
                pass
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    wd.cancel()
    failed = rep.failed()
    rep.data["failed"] = failed
    rep.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    rep.write()
    log(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'passed'}; report: {a.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
