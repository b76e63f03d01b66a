"""A pids limit with no task to spare, for a child interpreter: what a
container at its pids.max looks like to the process (no thread, no kernel
worker can start). Needs root and a pids cgroup controller."""

from __future__ import annotations

import os


def cgroup_parent() -> str | None:
    """Where a child may make a pids cgroup of its own: cgroup v1's pids
    hierarchy, or the v2 root where the pids controller is on; None if
    neither (or not root)."""
    if os.geteuid() != 0:
        return None
    if os.path.isfile("/sys/fs/cgroup/pids/cgroup.procs"):
        return "/sys/fs/cgroup/pids"
    try:
        with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
            return "/sys/fs/cgroup" if "pids" in f.read().split() else None
    except OSError:
        return None


SKIP_REASON = "needs root and a pids cgroup controller (v1 hierarchy or v2 root) to set a pids limit"

# Pasted into a child's script: `with no_task_to_spare(parent): ...` runs the
# block in a cgroup of the child's own whose pids.max is what it has now.
CHILD_CODE = r"""
import contextlib as _contextlib
import os as _os


@_contextlib.contextmanager
def no_task_to_spare(parent):
    cg = _os.path.join(parent, f"fx-pids-test-{_os.getpid()}")
    _os.mkdir(cg)
    try:
        with open(_os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(_os.getpid()))
        with open(_os.path.join(cg, "pids.current")) as f:
            now = int(f.read())
        with open(_os.path.join(cg, "pids.max"), "w") as f:
            f.write(str(now))
        yield
    finally:
        with open(_os.path.join(cg, "pids.max"), "w") as f:
            f.write("max")
        with open(_os.path.join(parent, "cgroup.procs"), "w") as f:
            f.write(str(_os.getpid()))
        _os.rmdir(cg)
"""
