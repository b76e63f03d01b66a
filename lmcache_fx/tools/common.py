"""Helpers every operator command shares: the error a user can fix, sizes and
ages for people, what filesystem a path is on, quiet exit on a closed pipe."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager

from ..core.layout import on_read_only_fs


class AdminError(Exception):
    """A problem the user can fix (wrong path, bad config): one clear line."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP taken as a Ctrl-C is: the command stops where it is,
    runs its cleanup and says what it did (gc what it removed), then exits
    128 + `signum`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def interrupt_code(e: KeyboardInterrupt) -> int:
    """The exit status for an interrupt: 130 for Ctrl-C, 128 + the signal's
    number for one Terminated."""
    return 128 + getattr(e, "signum", signal.SIGINT)


@contextmanager
def signals_as_interrupt():
    """While inside, SIGTERM and SIGHUP (`timeout`, `kill`, a closed
    terminal) raise Terminated in the main thread as Ctrl-C raises
    KeyboardInterrupt, where their default ends the process at once, with no
    cleanup and no report. A signal the process was started with ignored
    (`nohup`) stays ignored. Outside the main thread it does nothing."""

    def stop(signum, _frame):
        raise Terminated(signum)

    with signal_handlers(stop, (signal.SIGTERM, signal.SIGHUP), keep_ignored=(signal.SIGTERM, signal.SIGHUP)):
        yield


@contextmanager
def signal_handlers(handler, signals, keep_ignored=()):
    """`handler` for each of `signals` while inside, the previous handlers
    back on the way out; yields the signals it took (dict: signal -> the
    handler before). One of `keep_ignored` that the process was started
    with ignored (nohup's SIGHUP) is left ignored. Only the main thread can
    install handlers: elsewhere it takes none."""
    old = {}
    for sig in signals:
        try:
            if sig in keep_ignored and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            old[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread
            pass
    try:
        yield old
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def printable(text: object, backslashes: bool = True) -> str:
    """`text` safe to print as one line: each character that is not
    printable (control characters, a newline, a terminal escape, a file
    name's byte that is no UTF-8, kept by Python as a lone surrogate) as an
    escape. Store files are named and keyed by whoever wrote them: printed
    raw, a name with a newline forged a report line, an escape sequence
    reached the terminal, and an undecodable byte stopped the report with a
    UnicodeEncodeError."""
    s = str(text)
    if s.isprintable() and not (backslashes and "\\" in s):
        return s
    # A backslash doubled, so that a name holding the text "\\x0a" is not shown as one holding a newline;
    # not with `backslashes` false, for a line whose fields were made printable already.
    esc = "\\\\" if backslashes else "\\"
    return "".join(esc if c == "\\" else c if c.isprintable() else _escape(ord(c)) for c in s)


def _escape(o: int) -> str:
    if 0xDC80 <= o <= 0xDCFF:  # os.fsdecode's stand-in for the byte o - 0xDC00
        return f"\\x{o - 0xDC00:02x}"
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def human_age(s: float) -> str:
    s = max(0.0, s)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}" if s / size >= 10 else f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"


def fs_info(path: str) -> dict:
    """Filesystem type, mount point, device, total and free bytes of a path."""
    out = {"fstype": "?", "mountpoint": "?", "device": "?", "total_bytes": None, "free_bytes": None}
    real = os.path.realpath(path)
    best = -1
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                mp = _unescape(left.split()[4])
                fstype, dev = (right.split() + ["?", "?"])[:2]
                # >=: of two mounts at one point the later one (listed after) is the one seen
                if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= best:
                    best = len(mp)
                    out.update(fstype=fstype, mountpoint=mp, device=_unescape(dev))
    except OSError:
        pass
    try:
        sv = os.statvfs(path)
        out["total_bytes"] = sv.f_blocks * sv.f_frsize
        out["free_bytes"] = sv.f_bavail * sv.f_frsize
    except OSError:
        pass
    return out


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def unwritable(path: str) -> str:
    """Why a file cannot be written at `path` ("" when it can), without
    making it: asked before a command's work, not after."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory; give a file name"
    if not os.path.isdir(d):
        return f"no such directory {d}; create it or give another path"
    if not os.access(path if os.path.exists(path) else d, os.W_OK):
        if on_read_only_fs(d):  # access() says EROFS for root too; the owner's rights would not help there
            return "on a read-only filesystem; give a path you can write"
        return "permission denied; give a path you can write"
    return ""


def quiet_broken_pipe() -> int:
    """`lmcache-fx ls | head`: stop quietly when the reader goes away."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, sys.stdout.fileno())
    os.close(fd)
    return 0
