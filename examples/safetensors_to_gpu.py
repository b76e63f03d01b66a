#!/usr/bin/env python3
"""Load a .safetensors file straight into GPU tensors through lmcache-fx's
pinned-staging pipeline (NVMe -> pinned slot -> async H2D copy, overlapped).

    python examples/safetensors_to_gpu.py model.safetensors [--device cuda:0]
    python examples/safetensors_to_gpu.py --make-demo /tmp/demo.safetensors --device cpu

The safetensors header is parsed here (8-byte little-endian length + JSON), so
neither the safetensors package nor a CPU copy of the weights is needed. With
--device cpu it runs on a machine without a GPU: the stand-in driver
(tests/fake_gpu_driver.c, built with gcc on the fly) "copies" into CPU tensors.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def read_header(path):
    """(tensors: {name: (dtype, shape, begin, end)}, data_start, metadata)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: header of {n} bytes is not plausible")
        hdr = json.loads(f.read(n))
    meta = hdr.pop("__metadata__", None)
    size = os.path.getsize(path)
    out = {}
    for name, t in hdr.items():
        b, e = t["data_offsets"]
        if not 0 <= b <= e or 8 + n + e > size:
            raise ValueError(f"{path}: tensor {name} lies outside the file")
        out[name] = (t["dtype"], tuple(t["shape"]), b, e)
    return out, 8 + n, meta


def load(path, device, slots=8, slot_bytes=4 << 20):
    import torch

    from lmcache_fx.gpu import GpuReader, _device_index, _open, check_results

    tensors, start, _ = read_header(path)
    out, ops = {}, []
    for name, (dt, shape, b, e) in tensors.items():
        t = torch.empty(shape, dtype=getattr(torch, DTYPES[dt]), device=device)
        if t.numel() * t.element_size() != e - b:
            raise ValueError(f"{name}: {e - b} bytes for {dt}{list(shape)}")
        out[name] = t
        ops.append((start + b, e - b, t))
    dev_index = 0 if str(device) == "cpu" else _device_index(device)  # "cuda": torch's current device
    fd = _open(path, odirect=True)
    try:
        with GpuReader(device=dev_index, slots=slots, slot_bytes=slot_bytes) as rd:
            t0 = time.perf_counter()
            # The copies are ordered after torch's current stream (the default): the blocks torch.empty
            # handed back may still be in use by kernels queued earlier.
            res = rd.read_into([(fd, off, n, t.data_ptr()) for off, n, t in ops if n])
            el = time.perf_counter() - t0
            stats = rd.stats()
    finally:
        os.close(fd)
    check_results(res, [n for _, n, _ in ops if n], what=path)
    return out, el, stats


def make_demo(path):
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(4096, 512, generator=g).to(torch.bfloat16),
        "layer0.attn.qkv": torch.randn(1536, 512, generator=g),
        "layer0.mlp.up": torch.randn(2048, 513, generator=g).to(torch.float16),
        "layer0.norm": torch.randn(513, generator=g),
        "step": torch.tensor([7], dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }
    rev = {v: k for k, v in DTYPES.items()}
    hdr, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        hdr[name] = {
            "dtype": rev[str(t.dtype).removeprefix("torch.")],
            "shape": list(t.shape),
            "data_offsets": [off, off + len(raw)],
        }
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def ensure_standin():
    """--device cpu: use the stand-in driver, built from the tests' source."""
    if os.environ.get("LMCACHE_FX_GPU_DRIVER"):
        return
    so = os.path.join(tempfile.mkdtemp(prefix="fxgpu-"), "fake_gpu_driver.so")
    src = os.path.join(os.path.dirname(HERE), "tests", "fake_gpu_driver.c")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-pthread", "-o", so, src], check=True)
    os.environ["LMCACHE_FX_GPU_DRIVER"] = so


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--make-demo", metavar="PATH", help="write a small demo file there and load it")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--slot-mib", type=int, default=4)
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-exact check against a CPU read")
    a = ap.parse_args()
    if a.device == "cpu":
        ensure_standin()
    path = a.path
    if a.make_demo:
        make_demo(a.make_demo)
        path = a.make_demo
    if not path:
        ap.error("a .safetensors path (or --make-demo PATH) is needed")
    import torch

    tensors, el, stats = load(path, a.device, a.slots, a.slot_mib << 20)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(
        f"{len(tensors)} tensors, {total / 1e6:.1f} MB to {a.device} in {el * 1e3:.1f} ms "
        f"({total / el / 1e9:.2f} GB/s); {stats['reads']} reads, {stats['copies']} copies, "
        f"{stats['copies_during_reads']} copies issued while reads were in flight"
    )
    if not a.no_verify:
        hdr, start, _ = read_header(path)
        ok = True
        with open(path, "rb") as f:
            for name, (_dt, _shape, b, e) in hdr.items():
                f.seek(start + b)
                raw = f.read(e - b)
                got = tensors[name].cpu().contiguous().view(torch.uint8).numpy().tobytes() if e > b else b""
                ok &= got == raw
        print("bit-exact:", "yes" if ok else "NO")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
