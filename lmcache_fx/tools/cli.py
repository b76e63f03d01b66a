"""`lmcache-fx` command line: a thin dispatcher; each subcommand lives in
its own module and supplies add_arguments(parser) and run(args, parser)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import threading
import time

from .. import __version__

# subcommand -> (module, one-line help). A module supplies
# add_arguments(parser, command) and run(args, parser).
SUBCOMMANDS = {
    "bench": ("lmcache_fx.tools.bench", "measure lmcache-fx against fio and LMCache's own tiers"),
    "doctor": ("lmcache_fx.tools.doctor", "check whether the fast path will be used on this host"),
    "ls": ("lmcache_fx.tools.admin", "list the chunks of a store"),
    "stat": ("lmcache_fx.tools.admin", "summarise a store: chunks, bytes, models, ages, usage"),
    "fsck": ("lmcache_fx.tools.admin", "verify every chunk of a store; --repair removes bad ones"),
    "gc": ("lmcache_fx.tools.admin", "evict least recently used chunks down to a size"),
    "estimate": ("lmcache_fx.tools.estimate", "will external KV storage pay off, and how fast must it be?"),
}


class OneLineParser(argparse.ArgumentParser):
    """Errors as one line naming the command and where its help is, exit
    status 2: argparse's usage block before them ran to a dozen lines for
    bench and estimate, and the line that mattered came last."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="lmcache-fx")
    p.add_argument("--version", action="version", version=f"lmcache-fx {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, helptext) in SUBCOMMANDS.items():
        if importlib.util.find_spec(mod) is None:
            continue  # not part of this build
        m = importlib.import_module(mod)
        sp = sub.add_parser(
            name, help=helptext, description=helptext, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        m.add_arguments(sp, name)
        sp.set_defaults(_module=mod, _parser=sp)
    return p


def command_parser(command: str, add_arguments, doc: str) -> argparse.ArgumentParser:
    """A parser for one subcommand on its own (`python -m lmcache_fx.tools.<module>`, tests)."""
    p = OneLineParser(
        prog=f"lmcache-fx {command}",
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p, command)
    return p


def run_command(command: str, argv=None) -> int:
    """`python -m lmcache_fx.tools.<module> ARGS` is `lmcache-fx <command> ARGS`."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])


def main(argv=None) -> int:
    p = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = p.parse_known_args(argv)
    command = getattr(args, "command", None)
    # A flag before the command is the top level's; after it, the command's (the line names it)
    before = argv[: argv.index(command)] if command in argv else argv
    if [x for x in extra if x in before]:
        p.error(f"unrecognized arguments: {' '.join(x for x in extra if x in before)}")
    if not command:
        p.print_help()
        return 2
    if extra:
        args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return importlib.import_module(args._module).run(args, args._parser)
    except BrokenPipeError:  # `lmcache-fx estimate | head`: the reader went away
        from .common import quiet_broken_pipe

        return quiet_broken_pipe()


# How long the command waits, once it is done, for threads it did not start
# itself (LMCache's, a thread pool's) to end before it exits without them.
STRAY_THREAD_GRACE_S = 5.0


def console(argv=None) -> None:
    """The `lmcache-fx` command. A Ctrl-C is one line, not a traceback, and
    the process then dies of SIGINT (status 130 to a caller that only reads
    codes), as a shell expects of an interrupted program: a loop or a script
    running it stops too. Each command's own cleanup (stores closed, bench's
    loop devices unmounted and removed) has run by then. The process exits
    even where a thread that is not a daemon is still running: Python waits
    for every such thread at exit, and an LMCache engine interrupted before
    its close leaves some behind, so a Ctrl-C'd bench could hang for good
    after its cleanup (once in 12 tries)."""
    try:
        try:
            code = main(argv)
        except KeyboardInterrupt:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second one ends it at once
            sys.stderr.write("lmcache-fx: interrupted\n")
            code = 130
        except SystemExit as e:  # argparse's errors, bench's SIGTERM/SIGHUP: their message is already out
            if e.code is not None and not isinstance(e.code, int):
                sys.stderr.write(f"{e.code}\n")
                code = 1
            else:
                code = e.code or 0
    except KeyboardInterrupt:  # a second Ctrl-C while the first was handled
        code = 130
    if code == 130:  # interrupted (gc and fsck catch their Ctrl-C and return 130): a second one ends it at once
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        stray = stray_threads(STRAY_THREAD_GRACE_S)
    except KeyboardInterrupt:  # Ctrl-C while waiting for them
        code, stray = 130, ["(not waited for)"]
    if stray:
        sys.stderr.write(
            f"lmcache-fx: exiting without {len(stray)} thread(s) still running after "
            f"{STRAY_THREAD_GRACE_S:g} s: {', '.join(stray[:4])}\n"
        )
    if code == 130 or stray:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
    if code == 130:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if stray:
        os._exit(code)  # no atexit handlers: they would wait for the threads too
    sys.exit(code)


def _stop_idle_executor_workers() -> None:
    """Tells every ThreadPoolExecutor worker to end once idle, as the
    interpreter's exit would (concurrent.futures' own exit hook), so that
    the wait below does not wait for them: LMCache's LocalDiskBackend and
    RustRawBlockBackend leave their event loop's default executor running
    after close (threads asyncio_N), and every bench run that had them
    waited the whole grace period and said so. A worker still busy stays a
    stray. Private names of concurrent.futures: where they are missing,
    nothing is done (the wait is as before)."""
    from concurrent.futures import thread as cf_thread

    queues = getattr(cf_thread, "_threads_queues", None)
    lock = getattr(cf_thread, "_global_shutdown_lock", None)
    if queues is None or lock is None or not hasattr(cf_thread, "_shutdown"):
        return
    with lock:
        cf_thread._shutdown = True
    for q in list(queues.values()):
        q.put(None)


def stray_threads(grace_s: float) -> list[str]:
    """The names of the threads that are not daemons still running after
    waiting up to `grace_s` for them to end (idle executor workers told to
    end first)."""
    _stop_idle_executor_workers()
    deadline = time.monotonic() + grace_s
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
    return [
        t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon and t.is_alive()
    ]


if __name__ == "__main__":
    console()
