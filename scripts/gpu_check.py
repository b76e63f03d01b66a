#!/usr/bin/env python3
"""GPU check of the NVMe -> GPU pipeline (run by scripts/gpu_check.sh).

Measures on one machine, cold cache where possible:
  fio      O_DIRECT io_uring sequential read of the test file (if fio exists)
  h2d      torch pinned host -> GPU copy (the PCIe ceiling)
  serial   read the file into pinned memory, then copy to the GPU (no overlap;
           what KvikIO's compat mode amounts to)
  pipeline lmcache-fx GpuReader: reads and H2D copies overlapped
and checks: bit-exact GPU contents, overlap (copies issued while reads were in
flight, and wall time below read + copy), target pipeline >= 90 % of
min(fio, h2d). Also what io_uring can register: torch pinned memory
(cudaHostAlloc) and cudaHostRegister'ed memory. Writes a JSON report.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB, GiB = 1 << 20, 1 << 30


def log(*a):
    print(*a, flush=True)


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if os.geteuid() == 0:
        try:
            subprocess.run(["sync"], check=False)
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            pass


def fs_info(path):
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
    return out[-1] if out else "?"


def run_fio(path, size, bs="4M", qd=16):
    if not shutil.which("fio"):
        return None, "fio not installed"
    cmd = ["fio", "--name=fxcheck", f"--filename={path}", "--rw=read", f"--bs={bs}", f"--iodepth={qd}",
           "--ioengine=io_uring", "--direct=1", f"--size={size}", "--output-format=json", "--numjobs=1"]
    drop_cache(path)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return None, r.stderr.strip()[-300:]
    j = json.loads(r.stdout[r.stdout.index("{"):])
    return j["jobs"][0]["read"]["bw_bytes"] / 1e9, " ".join(cmd)


def lmcache_direct_to_gpu(store_dir, device="cuda:0", layers=32):
    """LMCache store -> retrieve with the plugin's direct_to_gpu: chunks come
    back as MemoryObjs in the plugin's GPU buffer, bit-exact. device="cpu"
    runs it with the tests' stand-in driver (LMCACHE_FX_GPU_DRIVER)."""
    import shutil
    import tempfile

    import torch

    from lmcache_fx.core.chunkfile import HEADER_SIZE, chunk_digest
    from lmcache_fx.testing.cpu_engine import KV, Geometry, config_from_dict, fx_backend, fx_config, lmcache_engine, \
        retrieve, store_and_wait
    from lmcache_fx.lmcache_plugin import FxStorageBackend

    if device == "cpu":
        FxStorageBackend.gpu_memory_device = "cpu"
    store = os.path.join(store_dir, "lmcache_fx_gpu_check_store")
    shutil.rmtree(store, ignore_errors=True)
    geo = Geometry(layers=layers, kv_heads=8, head_dim=128, dtype=torch.bfloat16)  # 32 layers: 32 MiB chunks
    ntok = 16 * 256
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict(fx_config(store, direct_to_gpu=True, verify=False, gpu_buffer_mib=1024, cpu_gb=2),
                               tmp)
    tokens = torch.arange(ntok) % 30000
    kv = KV(geo, ntok, seed=3)
    kv.caches = [c.to(device) for c in kv.caches]  # the paged KV cache on the GPU, as in vLLM
    kv.slot_mapping = kv.slot_mapping.to(device)
    out = {}
    try:
        with lmcache_engine(cfg, geo) as eng:
            be = fx_backend(eng)
            store_and_wait(eng, tokens, kv, be)
            keys = [k for _, _, k in eng.token_database.process_tokens(tokens=tokens)]
            t0 = time.perf_counter()  # O_DIRECT reads where the filesystem allows
            objs = be.batched_get_blocking(keys)
            el = time.perf_counter() - t0
            exact = 0
            for o, k in zip(objs, keys):
                if o is None:
                    continue
                with open(be.store.path_for(chunk_digest(k.to_string())), "rb") as f:
                    f.seek(HEADER_SIZE)
                    want = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
                have = o.raw_data.view(torch.uint8).reshape(-1)[:o.get_size()]
                exact += have.device.type == torch.device(device).type and torch.equal(have.cpu(), want)
                o.ref_count_down()
            nbytes = sum(o.get_size() for o in objs if o is not None)
            got = kv.empty_like()
            n = retrieve(eng, tokens, got)
            out = {"chunks": len(keys), "returned": sum(o is not None for o in objs), "bit_exact": exact,
                   "GBps_cold": nbytes / el / 1e9, "retrieve_tokens": n, "ntok": ntok,
                   "retrieve_equal": kv.tokens_equal(got, n), "chunks_read": be.store.stats.chunks_read,
                   "pinned": be._gpu.reader.pinned, "io": be._gpu.reader.io}
            out["ok"] = out["bit_exact"] == len(keys) and n == ntok and out["retrieve_equal"]
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size-gib", type=float, default=4)
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()

    import torch

    from lmcache_fx import _fxio, gpu

    rep = {"host": os.uname().nodename, "kernel": os.uname().release, "fs": fs_info(a.dir),
           "torch": torch.__version__, "driver": gpu.driver_info()}
    if not torch.cuda.is_available():
        log("torch sees no GPU: nothing to check"); rep["error"] = "no GPU"
        json.dump(rep, open(a.out, "w"), indent=1)
        return 2
    dev = torch.device("cuda:0")
    rep["gpu"] = torch.cuda.get_device_name(0)
    log(f"GPU {rep['gpu']}; driver {rep['driver']}; fs: {rep['fs']}")
    size = int(a.size_gib * GiB) // (64 * MiB) * (64 * MiB)
    path = os.path.join(a.dir, "lmcache_fx_gpu_check.bin")

    # Test data: random on the GPU, kept there as the reference.
    t0 = time.time()
    ref = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
    with open(path, "wb") as f:
        step = 256 * MiB
        for o in range(0, size, step):
            f.write(ref[o:o + step].cpu().numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    log(f"wrote {size / GiB:.1f} GiB test file in {time.time() - t0:.1f} s")
    results = {}
    try:
        # fio
        bw, how = run_fio(path, size)
        results["fio_GBps"] = bw
        rep["fio_cmd"] = how
        log(f"fio io_uring O_DIRECT 4M QD16: {bw and round(bw, 2)} GB/s ({'' if bw else how})")

        # pinned H2D ceiling
        n = min(size, GiB)
        pin = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        d.copy_(pin, non_blocking=True); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            d.copy_(pin, non_blocking=True)
        torch.cuda.synchronize()
        results["h2d_pinned_GBps"] = 5 * n / (time.perf_counter() - t0) / 1e9
        log(f"torch pinned H2D: {results['h2d_pinned_GBps']:.2f} GB/s")

        # io_uring and pinned memory (issue 6 question)
        reg = {"torch_pin_memory(cudaHostAlloc)": _fxio.uring_register_probe(pin.data_ptr(), n)}
        hb = _fxio.HostBuffer(64 * MiB)
        cudart = torch.cuda.cudart()
        r = cudart.cudaHostRegister(hb.address, 64 * MiB, 0)
        reg["cudaHostRegister(anonymous, huge pages)"] = _fxio.uring_register_probe(hb.address, 64 * MiB) \
            if int(r) == 0 else f"cudaHostRegister failed: {r}"
        # An O_DIRECT read into cudaHostAlloc memory through the engine (no registration)
        eng = _fxio.Engine(io_engine="auto")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        rr = eng.read([(fd, 0, 64 * MiB, pin.data_ptr())])
        os.close(fd)
        reg["O_DIRECT read into torch pinned memory"] = rr[0]
        reg["... bytes match"] = bool(torch.equal(pin[:64 * MiB].to(dev), ref[:64 * MiB]))
        if int(r) == 0:
            cudart.cudaHostUnregister(hb.address)
        rep["io_uring_register"] = {k: (v if not isinstance(v, int) or v >= 0 else f"-{os.strerror(-v)}")
                                    for k, v in reg.items()}
        log(f"io_uring registration: {rep['io_uring_register']}")
        del d

        # serial baseline: engine read into pinned memory, then one copy
        dst = torch.empty(size, dtype=torch.uint8, device=dev)
        big = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        drop_cache(path)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        eng2 = _fxio.Engine(io_engine="auto", queue_depth=16, split_bytes=4 * MiB)
        t0 = time.perf_counter()
        rr = eng2.read([(fd, 0, size, big.data_ptr())])
        t_read = time.perf_counter() - t0
        dst.copy_(big, non_blocking=True); torch.cuda.synchronize()
        t_serial = time.perf_counter() - t0
        os.close(fd)
        assert rr == [size], rr
        results["serial_read_GBps"] = size / t_read / 1e9
        results["serial_read_then_copy_GBps"] = size / t_serial / 1e9
        log(f"engine read to pinned: {results['serial_read_GBps']:.2f} GB/s; read then copy: "
            f"{results['serial_read_then_copy_GBps']:.2f} GB/s")
        del big

        # the pipeline
        best = None
        for slots, mib in ((8, 4), (16, 4), (8, 8), (16, 8)):
            dst.zero_(); torch.cuda.synchronize()
            with gpu.GpuReader(device=0, slots=slots, slot_bytes=mib * MiB) as rd:
                drop_cache(path)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                t0 = time.perf_counter()
                res = rd.read_into([(fd, 0, size, dst.data_ptr())], trace=True)
                el = time.perf_counter() - t0
                os.close(fd)
                st = rd.stats()
                tr = rd.trace()
                exact = res == [size] and bool(torch.equal(dst, ref))
                cfg = {"slots": slots, "slot_MiB": mib, "GBps": size / el / 1e9, "bit_exact": exact,
                       "result": res, "io": rd.io, "pinned": rd.pinned,
                       "fixed_buffers": rd.staging.fixed_buffers, "stats": st, "last_error": rd.last_error}
            # overlap: copies issued while reads were in flight; copy time hidden
            reads_end = max(e[0] for e in tr if e[1] == "read_done")
            copies = [e for e in tr if e[1] == "copy_issue"]
            cfg["copies_issued_before_last_read_done"] = sum(1 for e in copies if e[0] < reads_end)
            cfg["copies_total"] = len(copies)
            results.setdefault("pipeline", []).append(cfg)
            log(f"pipeline slots={slots} slot={mib}MiB: {cfg['GBps']:.2f} GB/s, bit-exact {exact}, "
                f"io {cfg['io']}, pinned {cfg['pinned']}, fixed {cfg['fixed_buffers']}, "
                f"{cfg['copies_issued_before_last_read_done']}/{len(copies)} copies before the last read, "
                f"max reads in flight {st['max_reads_in_flight']}")
            if best is None or cfg["GBps"] > best["GBps"]:
                best = cfg
        ceiling = min(x for x in (results.get("fio_GBps"), results["h2d_pinned_GBps"]) if x)
        results["target_GBps"] = 0.9 * ceiling
        results["best_pipeline_GBps"] = best["GBps"]
        results["target_met"] = best["GBps"] >= 0.9 * ceiling
        # read-only + copy-only would be the serial time; overlap means below it
        t_copy = size / results["h2d_pinned_GBps"] / 1e9
        results["overlap_proven"] = (best["copies_issued_before_last_read_done"] > 0 and
                                     size / best["GBps"] / 1e9 < t_read + t_copy)
        results["all_bit_exact"] = all(c["bit_exact"] for c in results["pipeline"])
        log(f"best pipeline {best['GBps']:.2f} GB/s vs target {results['target_GBps']:.2f} "
            f"(90 % of min(fio, h2d)) -> {'MET' if results['target_met'] else 'NOT met'}; "
            f"overlap proven: {results['overlap_proven']}; all bit-exact: {results['all_bit_exact']}")
        # LMCache with the plugin's direct_to_gpu (chunks returned in GPU memory)
        try:
            results["lmcache_direct_to_gpu"] = lmcache_direct_to_gpu(a.dir)
        except Exception as e:
            results["lmcache_direct_to_gpu"] = {"ok": False, "error": repr(e)[:500]}
        d2g = results["lmcache_direct_to_gpu"]
        log(f"LMCache direct_to_gpu round trip: {d2g}")
        if "error" not in d2g:  # a mismatch fails the check; an error is only reported
            results["all_bit_exact"] = results["all_bit_exact"] and d2g["ok"]
    finally:
        if not a.keep:
            os.unlink(path)
    rep["results"] = results
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=1, default=str)
    log(f"report: {a.out}")
    return 0 if results.get("all_bit_exact") else 1


if __name__ == "__main__":
    sys.exit(main())
