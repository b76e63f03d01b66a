"""`lmcache-fx estimate`: the arithmetic (units, presets against the public
model configs, MLA, FP8 KV, TP replication, queueing) and the command."""

import argparse
import json
import os

import pytest

from lmcache_fx.tools import estimate as est
from lmcache_fx.tools.models import MIB

# From the public config.json of each model (num_hidden_layers,
# num_key_value_heads, head_dim = hidden_size / num_attention_heads unless
# given; DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64 per layer).
PUBLIC = {
    "qwen2.5-32b": dict(layers=64, kv_heads=8, head_dim=128, mla=False),  # hidden 5120 / 40 heads
    "llama-3-70b": dict(layers=80, kv_heads=8, head_dim=128, mla=False),  # hidden 8192 / 64 heads
    "qwen3-coder-480b": dict(layers=62, kv_heads=8, head_dim=128, mla=False),  # 96 q heads, head_dim 128
    "deepseek-v3": dict(layers=61, kv_heads=1, head_dim=512 + 64, mla=True),
}
# peers.md: KV per 256-token chunk, bf16 (whole model, and per rank at TP8)
PEERS_CHUNK_MIB = {
    "qwen2.5-32b": (64, None),
    "llama-3-70b": (80, 10),
    "qwen3-coder-480b": (62, 7.75),
    "deepseek-v3": (17.2, 17.2),
}


def run_json(capsys, *argv):
    rc = est.main(list(argv) + ["--json"])
    assert rc == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_presets_match_public_configs_and_peers(name):
    m = est.models()[name]
    g = m.geo
    assert dict(layers=g.layers, kv_heads=g.kv_heads, head_dim=g.head_dim, mla=g.mla) == PUBLIC[name]
    assert g.dtype == "bfloat16" and g.chunk == 256
    whole, rank8 = PEERS_CHUNK_MIB[name]
    assert g.chunk_bytes / MIB == pytest.approx(whole, rel=0.01)
    if rank8 is not None:
        r = est.estimate(est.Inputs(geo=g, tp=8, context=1024, hit_rate=1.0))
        assert r["kv_bytes_per_chunk"]["per_rank"] / MIB == pytest.approx(rank8, rel=0.01)


def test_preset_names_also_accepted_and_set_tp():
    ms = est.models()
    assert ms["llama-3-70b-tp8"].geo == ms["llama-3-70b"].geo
    assert ms["llama-3-70b-tp8"].preset_tp == 8 and ms["llama-3-70b"].preset_tp == 1
    args = est.build_parser().parse_args(["--model", "qwen3-coder-480b-tp8"])
    assert est.inputs_from_args(args).tp == 8


@pytest.mark.parametrize(
    "text,tokens",
    [
        ("32k", 32768),
        ("32K", 32768),
        ("1.5k", 1536),
        ("8000", 8000),
        ("128k", 131072),
        ("1m", 1 << 20),
        ("4_096", 4096),
        (300, 300),
    ],
)
def test_context_suffixes(text, tokens):
    assert est.parse_tokens(text) == tokens


@pytest.mark.parametrize("bad", ["0", "-5", "abc", "k"])
def test_context_rejects(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        est.parse_tokens(bad)


def test_bytes_per_token_units():
    g = est.models()["qwen3-coder-480b"].geo
    r = est.estimate(est.Inputs(geo=g, tp=8, context=32768, hit_rate=0.8))
    # 2 (K,V) x 62 layers x 8 heads x 128 dim x 2 bytes
    assert r["kv_bytes_per_token"] == {"model": 253952, "per_rank": 31744, "stored": 253952}
    assert r["kv_bytes_per_chunk"]["model"] == 62 * MIB
    # 0.8 x 32768 = 26214.4 tokens -> 102 whole chunks
    assert r["request"]["hit_chunks"] == 102 and r["request"]["hit_tokens"] == 26112
    assert r["request"]["miss_tokens"] == 32768 - 26112
    assert r["request"]["storage_bytes"] == 102 * 62 * MIB
    assert r["request"]["per_rank_bytes"] == 102 * 62 * MIB // 8


def test_fp8_kv_halves_bytes():
    g = est.models()["qwen3-coder-480b"].geo
    args = est.build_parser().parse_args(["--model", "qwen3-coder-480b", "--kv-dtype", "fp8"])
    g8 = est.inputs_from_args(args).geo
    assert g8.dtype_bytes == 1 and g8.bytes_per_token * 2 == g.bytes_per_token
    args = est.build_parser().parse_args(["--model", "deepseek-v3", "--kv-dtype", "fp8"])
    assert est.inputs_from_args(args).geo.bytes_per_token == 61 * 576  # MLA fp8: 35,136 B


def test_mla_same_on_every_rank_and_stored_once():
    g = est.models()["deepseek-v3"].geo
    r1 = est.estimate(est.Inputs(geo=g, tp=1, context=4096, hit_rate=1.0, storage_gbps=1.0))
    r8 = est.estimate(est.Inputs(geo=g, tp=8, context=4096, hit_rate=1.0, storage_gbps=1.0))
    assert r8["kv_bytes_per_token"] == {"model": 61 * 576 * 2, "per_rank": 61 * 576 * 2, "stored": 61 * 576 * 2}
    assert r8["geometry"]["kv_heads_per_rank"] == 1 and r8["geometry"]["stored_copies"] == 1
    assert r8["request"]["storage_bytes"] == r1["request"]["storage_bytes"]  # TP does not multiply reads
    assert r8["request"]["per_rank_bytes"] == r8["request"]["storage_bytes"]  # rank 0 takes it all


def test_a_custom_mla_geometry_has_one_latent_per_layer():
    """--mla with the geometry given took the default model's 8 KV heads:
    every figure 8 times too large while the text said "MLA latent 576"."""
    custom = est.build_parser().parse_args(["--layers", "61", "--head-dim", "576", "--mla"])
    preset = est.build_parser().parse_args(["--model", "deepseek-v3"])
    assert est.inputs_from_args(custom).geo.bytes_per_token == est.inputs_from_args(preset).geo.bytes_per_token
    assert est.inputs_from_args(custom).geo.bytes_per_token == 61 * 576 * 2
    for argv in (
        ["--layers", "61", "--head-dim", "576", "--mla", "--kv-heads", "8"],
        ["--model", "deepseek-v3", "--kv-heads", "8"],
    ):
        with pytest.raises(ValueError, match="--kv-heads 8: an MLA latent has one head"):
            est.inputs_from_args(est.build_parser().parse_args(argv))
    for name in ("deepseek-v3", "deepseek-v3-mla"):  # a preset keeps its name
        assert est.inputs_from_args(est.build_parser().parse_args(["--model", name])).model == "deepseek-v3"


def test_extreme_inputs_are_refused_or_answered_not_crashed(capsys):
    """--context inf raised OverflowError; a read speed so low that its
    margin is 0 divided by it; --concurrency 1e8 built a list of 1e8 times."""
    with pytest.raises(SystemExit) as e:
        est.main(["--context", "inf"])
    assert e.value.code == 2 and "expected a token count" in capsys.readouterr().err
    argv = ["--hit-rate", "1", "--context", "512", "--storage-gbps", "1e-320", "--prefill-tok-s", "1"]
    assert est.main(argv) == 0
    assert "the store LOSES" in capsys.readouterr().out
    g = est.models()["qwen2.5-32b"].geo
    r = est.estimate(
        est.Inputs(geo=g, context=4096, hit_rate=0.5, storage_gbps=2.0, prefill_tok_s=1000, concurrency=10**8)
    )
    q = r["ttft"]["with_store"]
    assert q["worst_s"] == pytest.approx(q["alone_s"] + (10**8 - 1) * q["step_s"])
    assert q["p50_s"] == pytest.approx((q["alone_s"] + q["worst_s"]) / 2)


def test_tp_beyond_kv_heads_replicates_and_bad_tp_rejected():
    g = est.models()["llama-3-70b"].geo
    r = est.estimate(est.Inputs(geo=g, tp=16, context=1024, hit_rate=1.0))
    assert r["geometry"]["kv_heads_per_rank"] == 1 and r["geometry"]["stored_copies"] == 16
    assert r["kv_bytes_per_token"]["stored"] == 2 * r["kv_bytes_per_token"]["model"]
    with pytest.raises(ValueError):
        est.estimate(est.Inputs(geo=g, tp=3))
    with pytest.raises(ValueError):
        est.estimate(est.Inputs(geo=g, hit_rate=1.5))


def test_hit_rounding_and_last_token_recomputed():
    g = est.models()["qwen2.5-32b"].geo
    r = est.estimate(est.Inputs(geo=g, context=1024, hit_rate=1.0, storage_gbps=1.0))
    assert r["request"]["hit_chunks"] == 4  # every chunk is read ...
    assert r["request"]["hit_tokens"] == 1023 and r["request"]["miss_tokens"] == 1  # ... one token computed
    r = est.estimate(est.Inputs(geo=g, context=200, hit_rate=1.0, storage_gbps=1.0, prefill_tok_s=1000))
    assert r["request"]["hit_chunks"] == 0 and r["load"]["load_s"] == 0  # shorter than a chunk: nothing stored
    assert r["ttft"]["with_store"]["p50_s"] == pytest.approx(r["ttft"]["recompute"]["p50_s"])
    assert r["binds"] == "prefill compute"


def test_load_times_units_and_binding():
    g = est.models()["qwen2.5-32b"].geo  # 262,144 B per token
    inp = est.Inputs(geo=g, context=40960, hit_rate=1.0, storage_gbps=5.0, link_gbit=100, pcie_gbps=25)
    r = est.estimate(inp)
    b = r["request"]["storage_bytes"]
    assert b == 40960 * 262144
    st = r["load"]["stages"]
    assert st["disk"]["s"] == pytest.approx(b / 5e9)
    assert st["link"]["s"] == pytest.approx(b / 12.5e9)  # 100 Gbit/s = 12.5 GB/s
    assert st["pcie"]["s"] == pytest.approx(b / 25e9)
    assert r["load"]["load_s"] == st["disk"]["s"] and r["load"]["binds"] == "disk"
    assert r["load"]["disk_stops_binding_above_gbps"] == pytest.approx(12.5)
    inp.storage_gbps = 20.0
    r = est.estimate(inp)
    assert r["load"]["binds"] == "link" and r["load"]["effective_gbps"] == pytest.approx(12.5)


def test_break_even_is_bytes_per_token_times_prefill_rate():
    g = est.models()["qwen2.5-32b"].geo
    R = 4000.0
    be = 262144 * R / 1e9  # 1.048576 GB/s
    for gbps, pays in ((be * 0.9, False), (be * 1.1, True)):
        r = est.estimate(
            est.Inputs(geo=g, context=16384, hit_rate=0.9, storage_gbps=gbps, pcie_gbps=0, prefill_tok_s=R)
        )
        assert r["break_even"]["storage_gbps"] == pytest.approx(be)
        assert r["break_even"]["pays_off"] is pays
        # the store wins on TTFT exactly when it beats the break-even bandwidth (serial model)
        assert (r["ttft"]["with_store"]["alone_s"] < r["ttft"]["recompute"]["alone_s"]) is pays
    # a link slower than the break-even makes the store lose at any disk speed
    r = est.estimate(est.Inputs(geo=g, context=16384, hit_rate=0.9, storage_gbps=100, link_gbit=8, prefill_tok_s=R))
    assert r["break_even"]["unreachable_because"] == ["link"] and r["break_even"]["pays_off"] is False


def test_fifo_queueing():
    s = est.fifo_ttft(16, 1.0, 0.5, overlap=False)
    assert s["alone_s"] == 1.5 and s["worst_s"] == 24.0 and s["p50_s"] == pytest.approx(8.5 * 1.5)
    assert s["p50_s"] == pytest.approx(s["mean_s"]) and s["requests_per_s"] == pytest.approx(1 / 1.5)
    assert s["closed_loop_s"] == 24.0
    o = est.fifo_ttft(16, 1.0, 0.5, overlap=True)
    assert o["alone_s"] == 1.5 and o["worst_s"] == pytest.approx(1.5 + 15 * 1.0)
    assert o["requests_per_s"] == pytest.approx(1.0)
    assert o["closed_loop_s"] == pytest.approx(16.0)
    assert est.fifo_ttft(1, 1.0, 0.5, overlap=False)["p50_s"] == 1.5


def test_fixed_overhead_per_request():
    """--overhead-ms: the same fixed time in every step, with or without the store; default 0 changes nothing;
    the break-even bandwidth does not depend on it (it cancels in load < recompute)."""
    g = est.models()["qwen2.5-32b"].geo
    kw = dict(geo=g, context=8192, hit_rate=1.0, storage_gbps=2.0, pcie_gbps=0, prefill_tok_s=4096, concurrency=4)
    a = est.estimate(est.Inputs(**kw))
    b = est.estimate(est.Inputs(**kw, overhead_s=0.05))
    load, miss = b["load"]["load_s"], b["request"]["miss_tokens"] / 4096
    assert a["ttft"]["recompute"]["alone_s"] == pytest.approx(2.0)
    assert b["ttft"]["recompute"]["alone_s"] == pytest.approx(2.05)
    assert b["ttft"]["with_store"]["alone_s"] == pytest.approx(load + miss + 0.05)
    assert b["ttft"]["with_store"]["p50_s"] == pytest.approx(2.5 * (load + miss + 0.05))
    assert b["break_even"] == a["break_even"]
    assert b["shares"]["fixed overhead"] == pytest.approx(0.05 / (load + miss + 0.05))
    assert b["ttft"]["speedup_p50"] < a["ttft"]["speedup_p50"] <= a["break_even"]["speedup_bound"]
    o = est.estimate(est.Inputs(**kw, overhead_s=0.05, async_loading=True))["ttft"]["with_store"]
    assert o["step_s"] == pytest.approx(max(load, miss + 0.05))


def test_overhead_through_the_cli(capsys):
    d = run_json(
        capsys,
        "--layers",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--kv-dtype",
        "fp32",
        "--context",
        "4096",
        "--hit-rate",
        "1",
        "--storage-gbps",
        "1.5",
        "--pcie-gbps",
        "0",
        "--prefill-tok-s",
        "16000",
        "--overhead-ms",
        "40",
    )
    assert d["inputs"]["overhead_s"] == pytest.approx(0.04)
    assert d["ttft"]["recompute"]["alone_s"] == pytest.approx(0.04 + 4096 / 16000)
    assert est.main(["--context", "4k", "--prefill-tok-s", "1000", "--overhead-ms", "25"]) == 0
    assert "plus 25 ms fixed per request" in capsys.readouterr().out


def test_speedup_bounded_by_the_miss_fraction():
    """Even infinitely fast storage cannot beat context / miss tokens (Amdahl)."""
    g = est.models()["qwen2.5-32b"].geo
    r = est.estimate(
        est.Inputs(
            geo=g, context=32768, hit_rate=0.8, storage_gbps=1e9, pcie_gbps=0, prefill_tok_s=5000, concurrency=16
        )
    )
    bound = 32768 / r["request"]["miss_tokens"]
    assert r["ttft"]["speedup_p50"] == pytest.approx(bound, rel=1e-6)


def test_issue_command_text_and_json(capsys):
    argv = [
        "--model",
        "qwen3-coder-480b",
        "--tp",
        "8",
        "--context",
        "32k",
        "--concurrency",
        "16",
        "--hit-rate",
        "0.8",
        "--storage-gbps",
        "5.2",
        "--link-gbit",
        "100",
        "--prefill-tok-s",
        "10000",
    ]
    assert est.main(argv) == 0
    out = capsys.readouterr().out
    for s in (
        "253,952 B model",
        "7.75 MiB per rank",
        "break-even read  2.54 GB/s",
        "binds            disk",
        "p50",
        "with store",
    ):
        assert s in out, s
    d = run_json(capsys, *argv)
    assert d["break_even"]["storage_gbps"] == pytest.approx(2.5395, rel=1e-3)
    assert d["ttft"]["concurrency"] == 16 and d["binds"] == "disk"
    assert d["ttft"]["recompute"]["p50_s"] == pytest.approx(8.5 * 32768 / 10000)


def test_through_the_cli_and_partial_inputs(capsys):
    from lmcache_fx.tools import cli

    assert cli.main(["estimate", "--model", "llama-3-70b", "--tp", "8", "--context", "8k"]) == 0
    out = capsys.readouterr().out
    assert "10.00 MiB per rank" in out and "give --storage-gbps" in out and "give --prefill-tok-s" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "nope"],
        ["--model", "qwen2.5-32b", "--tp", "3"],
        ["--hit-rate", "1.5"],
        ["--concurrency", "0"],
        ["--storage-gbps", "1", "--measure", "/tmp"],
        ["--overhead-ms", "-1"],
    ],
)
def test_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        est.main(argv)
    assert e.value.code == 2


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--layers", "-3"], "--layers"),
        (["--layers", "0"], "--layers"),
        (["--kv-heads", "0"], "--kv-heads"),
        (["--head-dim", "-1"], "--head-dim"),
        (["--chunk", "0"], "--chunk"),
        (["--tp", "0"], "--tp"),
        (["--storage-gbps", "-1"], "--storage-gbps"),
        (["--storage-gbps", "0"], "--storage-gbps"),
        (["--storage-gbps", "nan"], "--storage-gbps"),
        (["--link-gbit", "-1"], "--link-gbit"),
        (["--prefill-tok-s", "-5"], "--prefill-tok-s"),
        (["--pcie-gbps", "-1"], "--pcie-gbps"),
        (["--json", "/nonexistent/x.json"], "--json"),
    ],
)
def test_bad_numbers_and_paths_are_one_line_errors_naming_the_flag(argv, flag, capsys):
    """0 given is not "unset" (before, --tp 0 took the preset's and --layers
    0 the preset's layers), negatives are refused, and an unwritable --json
    is said before anything runs (before: a traceback after)."""
    with pytest.raises(SystemExit) as e:
        est.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err and "Traceback" not in err, err


def test_custom_geometry(capsys):
    d = run_json(
        capsys,
        "--layers",
        "2",
        "--kv-heads",
        "4",
        "--head-dim",
        "64",
        "--kv-dtype",
        "fp16",
        "--chunk",
        "16",
        "--tp",
        "2",
        "--context",
        "100",
        "--hit-rate",
        "0.5",
    )
    assert d["model"] == "custom"
    assert d["kv_bytes_per_token"] == {
        "model": 2 * 2 * 4 * 64 * 2,
        "per_rank": 2 * 2 * 2 * 64 * 2,
        "stored": 2 * 2 * 4 * 64 * 2,
    }
    assert d["request"]["hit_chunks"] == 3 and d["geometry"]["chunk_tokens"] == 16


def test_measure_reads_cold_and_cleans_up(odirect_tmp, capsys):
    d = run_json(
        capsys,
        "--layers",
        "2",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--chunk",
        "256",
        "--context",
        "4k",
        "--measure",
        str(odirect_tmp),
        "--measure-size",
        "4M",
        "--prefill-tok-s",
        "1000",
    )
    m = d["measured"]
    assert m["gbps"] > 0 and len(m["reps_gbps"]) == 3 and m["o_direct"] is True
    assert m["file_bytes"] == 2 * 2 * 2 * 64 * 2 * 256 and m["files"] == 4 * MIB // m["file_bytes"]
    assert d["inputs"]["storage_gbps"] == m["gbps"] and d["load"]["load_s"] > 0
    assert m["cold"] is (os.geteuid() == 0)
    assert not any(n.startswith(".lmcache-fx-estimate-") for n in os.listdir(odirect_tmp))


@pytest.mark.parametrize("h,gbps", [(0.5, 2.0), (0.95, 2.0), (0.95, 20.0), (1.0, 3.0)])
def test_speedup_bounded_by_bandwidth_over_break_even(h, gbps):
    g = est.models()["qwen3-coder-480b"].geo
    r = est.estimate(
        est.Inputs(
            geo=g, tp=8, context=65536, hit_rate=h, storage_gbps=gbps, pcie_gbps=0, prefill_tok_s=4000, concurrency=16
        )
    )
    be = r["break_even"]["storage_gbps"]
    sp = r["ttft"]["speedup_p50"]
    assert sp <= gbps / be * (1 + 1e-9) and sp <= 65536 / r["request"]["miss_tokens"] * (1 + 1e-9)
    assert sp <= r["break_even"]["speedup_bound"] * (1 + 1e-9)


def test_output_into_a_closed_pipe_stops_quietly():
    """`lmcache-fx estimate ... | head -c 10` ended in a BrokenPipeError
    traceback, exit 1; ls, stat and doctor stopped quietly."""
    import subprocess
    import sys

    cmd = (
        f"{sys.executable} -m lmcache_fx.tools.estimate --storage-gbps 5 --prefill-tok-s 10000 "
        "--model qwen2.5-32b | true; echo ${PIPESTATUS[0]}"  # true reads nothing: gone before the first write
    )
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "0" and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_measure_on_a_memory_filesystem_is_not_called_cold(capsys):
    """On tmpfs the page cache is the medium: dropping it drops nothing, yet
    the measurement was labelled cold like a disk's."""
    from lmcache_fx.core.medium import page_cache_fs

    if not os.path.isdir("/dev/shm") or not page_cache_fs(["/dev/shm"]):
        pytest.skip("no tmpfs at /dev/shm")
    d = run_json(
        capsys,
        *("--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--chunk", "256", "--context", "4k"),
        *("--measure", "/dev/shm", "--measure-size", "1M", "--prefill-tok-s", "1000"),
    )
    m = d["measured"]
    assert m["gbps"] > 0 and m["in_memory"] is True and m["cold"] is False, m


def test_measure_on_a_file_or_a_read_only_filesystem_says_which(tmp_path, capsys):
    """--measure on a file said 'no such directory'; on a read-only
    filesystem it printed a raw '[Errno 30] ...' line and exit 1, where every
    other bad argument is one 'error:' line and exit 2."""

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit) as e:
        est.main(["--model", "qwen2.5-32b", "--measure", str(afile)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--measure {afile}: not a directory; give a directory" in err, err
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs")
    from lmcache_fx.testing.loopfs import tmpfs

    with tmpfs("size=1m,ro") as ro, pytest.raises(SystemExit) as e:
        est.main(["--model", "qwen2.5-32b", "--measure", ro])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "on a read-only filesystem; give a directory you can write" in err, err
    assert "Errno" not in err
