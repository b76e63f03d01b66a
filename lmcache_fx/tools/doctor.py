"""`lmcache-fx doctor`: will the fast path be used on this host, and if not, why?

Checks, for each store path (from --path, or from the plugin entries of an
LMCache YAML): the io_uring engine (kernel, kernel.io_uring_disabled,
seccomp), O_DIRECT on the path's filesystem (a real 4 KiB write and read),
filesystem type and free space against max_capacity_gb, locked-memory limit
and whether io_uring fixed buffers register, transparent huge pages, the GPU
driver library and pinned-memory registration, the installed LMCache version,
and whether the plugin's options parse and its class imports the way LMCache
loads it. Nothing is created except a 4 KiB probe file, removed at once.

Exit status: 0 the configured fast path will be used (warnings may remain);
1 it will not (a FAIL line says why and how to fix it); 2 usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import resource
import shlex
import stat
import sys
from dataclasses import asdict, dataclass, field
from typing import Optional

from .. import _fxio
from ..core.drive import CAP_IPC_LOCK, memlock_refuses, memlock_text
from ..core.layout import LOCK_DIR, LOCK_NAME, aliased_root, device_of, on_read_only_fs, probe_odirect, root_problem
from ..core.medium import (
    client_local_locks,
    decide_mapped_reads,
    decide_staged_reads,
    huge_page_tmpfs,
    page_cache_fs,
)
from ..core.options import GIB, ConfigError, FxOptions, expand_path
from ..core.store import READ_ONLY_LOOK_SECONDS
from .common import fs_info, human_bytes
from .lmcache_config import (
    PLUGIN_CLASS,
    PLUGIN_MODULE,
    check_plugin,
    keys_outside_extra_config,
    load_lmcache_config,
    lost_path,
    outside_warning,
    plugin_entries,
)

EXAMPLES = """\
examples:
  lmcache-fx doctor --path /mnt/nvme/lmcache
  lmcache-fx doctor --config /etc/lmcache/lmcache.yaml
  lmcache-fx doctor --config lmcache.yaml --json | jq '.checks[] | select(.status=="fail")'
  LMCACHE_CONFIG_FILE=lmcache.yaml lmcache-fx doctor

exit status: 0 the configured fast path (io_uring + O_DIRECT, unless the
options turn them off) will be used; 1 it will not; 2 usage error.
"""

LMCACHE_RANGE = ((0, 5, 6), (0, 6, 0))  # >=0.5.6,<0.6 as in pyproject.toml
PROBE_REGISTER_BYTES = 64 << 20


@dataclass
class Check:
    name: str
    status: str  # ok | info | warn | fail
    summary: str
    fix: str = ""
    data: dict = field(default_factory=dict)


# ---------------------------------------------------------------- LMCache config


# ---------------------------------------------------------------- host facts


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def proc_status() -> dict:
    out = {}
    for line in (_read("/proc/self/status") or "").splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = v.strip()
    return out


def kernel_version() -> tuple[str, tuple[int, int]]:
    rel = os.uname().release
    try:
        parts = rel.split("-")[0].split(".")
        return rel, (int(parts[0]), int(parts[1]))
    except (ValueError, IndexError):
        return rel, (0, 0)


def has_cap(status: dict, bit: int) -> bool:
    try:
        return bool(int(status.get("CapEff", "0"), 16) >> bit & 1)
    except ValueError:
        return False


def check_io_uring(io_engine: str) -> Check:
    rel, (maj, mnr) = kernel_version()
    st = proc_status()
    disabled = _read("/proc/sys/kernel/io_uring_disabled")
    group = _read("/proc/sys/kernel/io_uring_group")
    seccomp = st.get("Seccomp", "?")
    filters = st.get("Seccomp_filters", "?")
    data = {
        "kernel": rel,
        "io_uring_disabled": disabled,
        "io_uring_group": group,
        "seccomp": seccomp,
        "seccomp_filters": filters,
        "built_with_liburing": bool(_fxio.HAVE_LIBURING),
        "io_engine": io_engine,
    }
    usable, reason = _fxio.io_uring_status()
    data["usable"], data["reason"] = usable, reason
    facts = (
        f"kernel {rel}, kernel.io_uring_disabled={disabled if disabled is not None else 'absent'}, "
        f"seccomp {'off' if seccomp == '0' else {'1': 'strict', '2': f'filter ({filters} filters)'}.get(seccomp, seccomp)}"
    )
    if usable:
        if (maj, mnr) < (5, 15):
            return Check(
                "io_uring",
                "warn",
                f"usable ({facts}); kernels before 5.15 have slower, less tested io_uring",
                "upgrade the kernel to 5.15 or later",
                data,
            )
        return Check("io_uring", "ok", f"usable ({facts})", data=data)
    # Why not, most specific first.
    if not _fxio.HAVE_LIBURING:
        why = "lmcache-fx was built without liburing (only the thread engine is in it)"
        # --no-deps: a plain --force-reinstall reinstalls torch too (another build of it, in a vLLM image)
        fix = (
            "install liburing-dev (Debian/Ubuntu) or liburing-devel (Fedora/RHEL), then rebuild lmcache-fx alone: "
            "pip install --force-reinstall --no-deps --no-cache-dir <the lmcache-fx source you installed from>"
        )
    elif (maj, mnr) < (5, 6):
        why = f"kernel {rel} is older than 5.6 (no IORING_OP_READ/WRITE)"
        fix = "upgrade the kernel (5.15+ recommended)"
    elif disabled == "2":
        why = "kernel.io_uring_disabled=2: io_uring is off for everyone"
        fix = "sysctl -w kernel.io_uring_disabled=0 (and in /etc/sysctl.d to keep it)"
    elif disabled == "1":
        why = (
            f"kernel.io_uring_disabled=1: only CAP_SYS_ADMIN or members of group "
            f"{group} (kernel.io_uring_group) may use io_uring"
        )
        fix = (
            "add the server's user to that group, or sysctl -w kernel.io_uring_disabled=0"
            if str(group).strip() not in ("", "-1")
            else "sysctl -w kernel.io_uring_group=<a group of the server's user> (it is -1: no group), "
            "or sysctl -w kernel.io_uring_disabled=0"
        )
    elif seccomp == "2":
        why = f"a seccomp filter blocks io_uring_setup ({filters} filter(s); Docker's default profile does this)"
        fix = (
            "run the container with a seccomp profile that allows io_uring_setup, io_uring_enter and "
            "io_uring_register (docker run --security-opt seccomp=PROFILE.json)"
        )
    else:
        why = reason
        fix = "see the reason above"
    status = "info" if io_engine == "threads" else "fail"
    summary = f"not usable: {why} [{reason}]"
    if io_engine == "threads":
        summary += "; io_engine: threads is configured, so it is not needed"
    elif io_engine == "auto":
        summary += "; io_engine: auto will fall back to the thread engine"
    else:
        summary += "; io_engine: io_uring will refuse to start the plugin"
    return Check("io_uring", status, summary, fix, data)


def check_versions() -> list[Check]:
    from importlib import metadata

    out = []
    try:
        fxv = metadata.version("lmcache-fx")
    except metadata.PackageNotFoundError:
        fxv = "not installed (running from a source tree)"
    crc = _fxio.CRC32C_IMPL
    c = Check(
        "lmcache-fx",
        "ok",
        f"{fxv}, C engine with {'io_uring and ' if _fxio.HAVE_LIBURING else ''}threads, CRC32C {crc}",
        data={"version": fxv, "crc32c": crc, "liburing": bool(_fxio.HAVE_LIBURING)},
    )
    if crc == "table":
        c.status, c.fix = "warn", "this CPU lacks SSE4.2/ARMv8 CRC: verify: true costs noticeable CPU per GB"
    out.append(c)
    try:
        v = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        out.append(Check("LMCache", "fail", "not installed in this Python", "pip install 'lmcache>=0.5.6,<0.6'"))
        return out
    try:
        t = tuple(int(x) for x in v.split("+")[0].split(".")[:3] if x.isdigit())
    except ValueError:
        t = ()
    lo, hi = LMCACHE_RANGE
    if t and lo <= t < hi:
        out.append(Check("LMCache", "ok", f"{v} (supported: >=0.5.6,<0.6)", data={"version": v}))
    else:
        out.append(
            Check(
                "LMCache",
                "warn",
                f"{v} is outside the tested range >=0.5.6,<0.6",
                "install lmcache 0.5.x (>=0.5.6), or expect interface changes",
                {"version": v},
            )
        )
    return out


def check_memlock(pool_bytes: Optional[int]) -> list[Check]:
    st = proc_status()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    cap = has_cap(st, CAP_IPC_LOCK)

    data = {
        "memlock_soft": None if soft == resource.RLIM_INFINITY else soft,
        "memlock_hard": None if hard == resource.RLIM_INFINITY else hard,
        "cap_ipc_lock": cap,
        "pool_bytes": pool_bytes,
    }
    out = [
        Check(
            "memlock",
            "ok" if cap or soft == resource.RLIM_INFINITY else "info",
            f"RLIMIT_MEMLOCK {memlock_text(soft)} (hard {memlock_text(hard)}), CAP_IPC_LOCK {'yes' if cap else 'no'}",
            data=data,
        )
    ]
    # Does a fixed buffer register? Try with real memory on a real ring.
    try:
        eng = _fxio.Engine("io_uring", 4, 1 << 20)
    except OSError as e:
        out.append(Check("fixed buffers", "info", f"not tried: no io_uring ({e})"))
        return out
    try:
        size = PROBE_REGISTER_BYTES
        buf = _fxio.HostBuffer(size)
        r = eng.register_buffer(buf, size)
        eng.register_buffer(0, 0)
    finally:
        eng.close()
    data = {"probe_bytes": size, "result": r}
    if r < 0:
        return out + [
            Check(
                "fixed buffers",
                "warn",
                f"a {size >> 20} MiB buffer does not register ({os.strerror(-r)}): reads work, "
                "but pin pages per I/O (more CPU per GB)",
                "raise the memlock limit (ulimit -l unlimited; docker run --ulimit memlock=-1) or grant CAP_IPC_LOCK",
                data,
            )
        ]
    if pool_bytes and memlock_refuses(pool_bytes):
        return out + [
            Check(
                "fixed buffers",
                "warn",
                f"a {size >> 20} MiB buffer registers, but LMCache's pool of {pool_bytes / GIB:.1f} GiB "
                f"exceeds the memlock limit ({memlock_text(soft)}) without CAP_IPC_LOCK: it will not register",
                "raise the memlock limit above the pool size (ulimit -l unlimited) or grant CAP_IPC_LOCK",
                data,
            )
        ]
    shares = _fxio.io_uring_shares_buffers()
    data["rings_share_registration"] = shares
    if pool_bytes and pool_bytes > _fxio.FIXED_PER_RING_MAX and not shares:
        return out + [
            Check(
                "fixed buffers",
                "info",
                f"a {size >> 20} MiB buffer registers, but this kernel cannot share one registration among io_uring "
                f"rings (IORING_REGISTER_CLONE_BUFFERS), so LMCache's pool of {pool_bytes / GIB:.1f} GiB is not "
                "registered: pinning it again for each new ring held up the first concurrent reads, each ring as "
                "long as the whole pool takes to pin; reads pin their pages per request instead (more CPU per GB)",
                "Linux 6.12 or later registers the pool once for every ring",
                data,
            )
        ]
    note = "" if pool_bytes is None else f"; LMCache's pool ({pool_bytes / GIB:.1f} GiB) fits the limit"
    return out + [
        Check("fixed buffers", "ok", f"io_uring fixed buffers register ({size >> 20} MiB tried){note}", data=data)
    ]


def check_hugepages() -> Check:
    en = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    de = _read("/sys/kernel/mm/transparent_hugepage/defrag")

    def sel(s):
        if not s:
            return None
        for w in s.split():
            if w.startswith("["):
                return w.strip("[]")
        return s

    mode, defrag = sel(en), sel(de)
    data = {"thp_enabled": mode, "thp_defrag": defrag}
    buf = _fxio.HostBuffer(4 << 20, hugepages=False)
    adv = _fxio.advise_hugepages(buf.address, len(buf))
    data["madvise_result"] = adv
    if mode is None:
        return Check("huge pages", "info", "no transparent huge pages on this kernel", data=data)
    if mode == "never" or adv < 0:
        return Check(
            "huge pages",
            "warn",
            f"transparent huge pages are '{mode}': LMCache's pool stays on 4 KiB pages, so large reads "
            "are split into smaller requests (up to 7-10x more CPU per GB measured on virtio)",
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled",
            data,
        )
    return Check(
        "huge pages",
        "ok",
        f"transparent huge pages '{mode}', defrag '{defrag}': the plugin advises LMCache's pool onto 2 MiB pages",
        data=data,
    )


def check_gpu() -> Check:
    """The GPU driver lmcache-fx binds (the same binding the plugin's
    direct_to_gpu uses), and whether its pipeline would run on a slow path
    (staging not page-locked, fixed buffers refused) and on which NUMA node."""
    from .. import gpu

    info = gpu.driver_info()
    data: dict = {"driver": info}
    if info.get("api") is None and info.get("found"):  # a driver, no device it can use
        return Check(
            "GPU driver",
            "warn",
            f"{info['found_api']} driver {info['found']} found: no usable device{_why(info)}",
            "check the driver matches the kernel module (nvidia-smi / rocm-smi) and the device is visible "
            "in this container (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES, --gpus)",
            data,
        )
    if info.get("api") is None:
        return Check(
            "GPU driver",
            "info",
            "no CUDA or ROCm driver here (libcuda.so.1 / libamdhip64.so): LMCache "
            f"runs on CPU only (fine for tests, not for serving){_why(info)}",
            data=data,
        )
    found = f"{info['api']} driver {info.get('path') or ''} with {info.get('devices', 0)} device(s)"
    try:
        rd = gpu.GpuReader(device=0, slots=2, slot_bytes=1 << 20, warn=False)
    except Exception as e:  # noqa: BLE001 - the answer is the error
        return Check(
            "GPU driver",
            "fail",
            f"{found}; the staging pipeline cannot start: {e}",
            "direct_to_gpu will refuse to start; check the driver and the memlock limit",
            data,
        )
    try:
        data.update(degraded=rd.degraded, pinned=rd.pinned, io=rd.io, numa=getattr(rd, "numa_info", None))
    finally:
        rd.close()
    where = f"; staging on NUMA node {data['numa']}" if data["numa"] is not None else ""
    if data["degraded"]:
        return Check(
            "GPU driver",
            "warn",
            f"{found}; GPU reads would run on a slow path: {data['degraded']}",
            "raise the memlock limit (ulimit -l) or grant CAP_IPC_LOCK to the container",
            data,
        )
    return Check("GPU driver", "ok", f"{found}; staging page-locked, reads by {data['io']}{where}", data=data)


def _why(info: dict) -> str:
    return f" ({info['error']})" if info.get("error") else ""


# ---------------------------------------------------------------- the store path


def _nearest_existing(p: str) -> str:
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def _shown_key(spec: str) -> str:
    """auth_key as doctor may print it: where it is read from (env:, file:),
    never a key given in the config itself."""
    return spec if not spec or spec.startswith(("env:", "file:")) else "(set in the config; not shown)"


def _lock_file_problem(root: str) -> tuple[str, str]:
    """What the store would refuse of the shared state under `root`: its
    directory or lock file in place but not a real directory and a regular
    file (a link, a FIFO, a directory made by hand), as (path, what is
    wrong); ("", "") when sound or absent."""
    for name, want, what in ((LOCK_DIR, stat.S_ISDIR, "a directory"), (LOCK_NAME, stat.S_ISREG, "a regular file")):
        p = os.path.join(root, name)
        try:
            st = os.lstat(p)
        except OSError:
            return "", ""  # absent, or unreadable: the path check says why
        if not want(st.st_mode):
            return p, f"is not {what}" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
    return "", ""


def check_path(root: str, opts: FxOptions, tag: str, first: bool = True) -> list[Check]:
    """The checks of one store path; `first`: the first of the list (the
    shared usage lives there), which no store starts without."""
    from .admin import scan

    out = []
    root = os.path.abspath(os.path.expanduser(root))
    where = _nearest_existing(root)
    fi = fs_info(where)
    data = {"path": root, **fi}
    if os.path.exists(root):
        if not os.path.isdir(root):
            return [
                Check(
                    f"{tag}path",
                    "fail",
                    f"{root} exists and is not a directory: the plugin will not start",
                    "point path at a directory",
                    data,
                )
            ]
        why = root_problem(root, os.stat(root), opts.shared_group)
        if why and not first and on_read_only_fs(root):
            out.append(
                Check(
                    f"{tag}path",
                    "warn",
                    f"{why}: the plugin starts, serves its chunks and stores new ones under the other paths",
                    "mount it read-write: a running server looks at it again at a store every "
                    f"{READ_ONLY_LOOK_SECONDS:.0f} s and stores there once it is writable and accepted",
                    data,
                )
            )
        elif why:
            out.append(
                Check(
                    f"{tag}path",
                    "fail",
                    f"{why}: the plugin will not start",
                    "mount it read-write, or pick a path on another filesystem"
                    if "read-only filesystem" in why
                    else "use a directory of your own (chmod 700), or shared_group: true for a group store",
                    data,
                )
            )
        else:
            out.append(
                Check(f"{tag}path", "ok", f"{root} on {fi['fstype']} ({fi['device']} at {fi['mountpoint']})", data=data)
            )
        bad, what = _lock_file_problem(root)
        if bad:
            out.append(
                Check(
                    f"{tag}lock file",
                    "fail",
                    f"{bad} {what}: the plugin will not start",
                    f"remove it (rm -r {shlex.quote(bad)})",
                )
            )
    elif not os.path.isdir(where):  # a path under a regular file
        return [
            Check(
                f"{tag}path",
                "fail",
                f"{where} is not a directory: the plugin cannot create {root}",
                "point path at a directory",
                data,
            )
        ]
    elif not os.access(where, os.W_OK | os.X_OK):
        ro = on_read_only_fs(where)
        return [
            Check(
                f"{tag}path",
                "fail",
                f"{root} does not exist and {where} is "
                + ("on a read-only filesystem" if ro else "not writable")
                + ": the plugin cannot create it",
                "give a path on a writable filesystem" if ro else f"mkdir -p {root} and give it to the server's user",
                data,
            )
        ]
    else:
        out.append(
            Check(
                f"{tag}path",
                "ok",
                f"{root} does not exist yet; the plugin will create it under {where} ({fi['fstype']})",
                data=data,
            )
        )
    memory = check_memory_fs(where, fi, opts, tag)
    if memory:
        out.append(memory)
    locks, posix_local, flock_local = client_local_locks([where])
    if locks:
        lost = [
            w
            for w, on in (("evicted files are not reused", posix_local), ("capacity is counted per host", flock_local))
            if on
        ]
        out.append(
            Check(
                f"{tag}file locks",
                "warn",
                f"{locks}: file locks stay on this host, unseen by processes on other hosts; sharing the store "
                f"between hosts is not safe ({'; '.join(lost)})",
                "mount it with locking on the server (NFS: without nolock and local_lock; Lustre: -o flock)",
                data={"mount": locks, "posix_locks_local": posix_local, "flock_local": flock_local},
            )
        )
    # O_DIRECT: a real aligned write and read through the engine.
    if opts.odirect == "false":
        out.append(Check(f"{tag}O_DIRECT", "info", "odirect: false is configured: reads go through the page cache"))
    elif not first and os.path.isdir(root) and on_read_only_fs(root):
        # The probe writes a file; the store probes its first path only and writes nothing here.
        out.append(
            Check(f"{tag}O_DIRECT", "info", "not probed on a read-only filesystem (the store probes its first path)")
        )
    elif any(c.name == f"{tag}path" and c.status == "fail" for c in out):
        # The store would not start: a probe would fail the same way (an unreadable directory raised here).
        out.append(Check(f"{tag}O_DIRECT", "info", "not probed: the path above fails"))
    else:
        try:
            ok, why = probe_odirect(root if os.path.isdir(root) else where)
        except OSError as e:
            ok, why = False, f"the probe could not run: {e.strerror or e}"
        if ok:
            out.append(Check(f"{tag}O_DIRECT", "ok", f"works on {fi['fstype']} (4 KiB written and read back)"))
            staged, why = decide_staged_reads(opts.staged_reads, [where], True, opts.verify)
            out.append(
                Check(
                    f"{tag}staged reads",
                    "info",
                    (
                        "checked reads go through a cache-sized staging buffer, copied on with the check in one pass"
                        if staged
                        else "checked reads land in place and are summed there"
                    )
                    + f" ({why})",
                    data={"staged_reads": staged},
                )
            )
        elif opts.odirect != "true" and page_cache_fs([where]):
            # On a memory filesystem buffered I/O is what reading memory is: the store says so at info only.
            out.append(
                Check(
                    f"{tag}O_DIRECT",
                    "info",
                    f"not supported on {fi['fstype']} ({why}): reads and writes copy from memory, as on any "
                    "memory filesystem",
                    data={"error": why},
                )
            )
        else:
            out.append(
                Check(
                    f"{tag}O_DIRECT",
                    "fail",
                    f"not usable on {fi['fstype']} at {where}: {why}; "
                    + (
                        "odirect: true will refuse to start the plugin"
                        if opts.odirect == "true"
                        else "odirect: auto will use buffered I/O (page cache, more CPU, no fast path)"
                    ),
                    "put the store on a block filesystem (XFS or ext4 on NVMe), or set odirect: false "
                    "to accept buffered I/O",
                    {"error": why},
                )
            )
    # Free space against capacity.
    if fi["total_bytes"] == 0 and fi["fstype"] == "ramfs":  # no size at all: statvfs says 0 of 0 free
        out.append(
            Check(
                f"{tag}space",
                "info",
                f"ramfs has no size limit: the store is bounded by max_capacity_gb "
                f"({opts.max_capacity_gb:g}) and the host's memory alone",
                data={"free_bytes": None, "capacity_bytes": opts.max_capacity_bytes},
            )
        )
    elif fi["free_bytes"] is not None:
        # Striping spreads the capacity over the paths; the paths on this one filesystem share its room,
        # and the chunks of each of them are room the store can take back.
        here = device_of(root)
        mine = [p for p in opts.paths if device_of(p) == here] or [root]
        used = 0
        for p in mine:
            if os.path.isdir(p):
                try:
                    used += sum(f.size for f in scan([p]).chunks)
                except Exception:  # noqa: BLE001
                    pass
        cap = opts.max_capacity_bytes
        room = fi["free_bytes"] + used
        d = {"free_bytes": fi["free_bytes"], "store_bytes": used, "capacity_bytes": cap}
        nroots = len(opts.paths)
        same = len(mine)
        share = cap * same / nroots
        if share > room:
            out.append(
                Check(
                    f"{tag}space",
                    "warn",
                    f"{human_bytes(fi['free_bytes'])} free + {human_bytes(used)} in the store < "
                    f"max_capacity_gb {opts.max_capacity_gb:g}"
                    + (f" / {nroots} paths" if nroots > 1 else "")
                    + (f" x {same} of them on this filesystem" if same > 1 else "")
                    + ": writes will fail with ENOSPC before eviction starts",
                    f"set max_capacity_gb below {_gb(room * nroots / same / GIB * 0.95)}"
                    if room * 0.95 >= 1 << 20
                    else f"free space on {root}'s filesystem or give the store another one",
                    d,
                )
            )
        else:
            out.append(
                Check(
                    f"{tag}space",
                    "ok",
                    f"{human_bytes(fi['free_bytes'])} free, {human_bytes(used)} in the "
                    f"store, max_capacity_gb {opts.max_capacity_gb:g}",
                    data=d,
                )
            )
    return out


def _gb(x: float) -> str:
    """A capacity in GB as an operator writes it: 7780, not 7.78e+03."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def check_memory_fs(where: str, fi: dict, opts: FxOptions, tag: str) -> Optional[Check]:
    """A store in memory (tmpfs, ramfs): whether reads copy from mappings
    (mapped_reads), and what mount would read faster. None elsewhere, unless
    mapped_reads: true there (the plugin would refuse to start)."""
    try:
        mapped, why = decide_mapped_reads(opts.mapped_reads, [where])
    except ConfigError as e:
        return Check(f"{tag}memory fs", "fail", f"{e}: the plugin will not start", "set mapped_reads: auto")
    if fi["fstype"] not in ("tmpfs", "ramfs"):
        return None
    data = {"fstype": fi["fstype"], "mountpoint": fi["mountpoint"], "mapped_reads": mapped}
    if mapped:
        return Check(
            f"{tag}memory fs",
            "ok",
            f"{fi['fstype']} at {fi['mountpoint']}: payloads are copied from mappings of their files and checked "
            f"in the same pass ({why})",
            data=data,
        )
    if not huge_page_tmpfs([where]):
        # docs/benchmarks.md, "Staged reads from memory": on 4 KiB pages every
        # reader, fx's and LMCache's alike, is held by the kernel's read path
        # per page, at a third to a half of the speed of a plain copy from memory.
        return Check(
            f"{tag}memory fs",
            "info",
            f"{fi['fstype']} at {fi['mountpoint']} keeps files in 4 KiB pages: every reader of it is held by the "
            "kernel's read path per page; a tmpfs with huge pages reads faster for any reader, and fx copies from "
            "it with the check in the same pass (mapped_reads)",
            "mount -t tmpfs -o size=<N>G,huge=within_size tmpfs /mnt/kv and point path there"
            + (
                ""  # ramfs takes no huge= option: a remount with it succeeds and changes nothing
                if fi["fstype"] == "ramfs"
                else f" (or, for files written from then on: mount -o remount,huge=within_size {fi['mountpoint']})"
            ),
            data,
        )
    return Check(
        f"{tag}memory fs", "info", f"{fi['fstype']} at {fi['mountpoint']}: reads use read() ({why})", data=data
    )


def check_engine(opts: FxOptions, tag: str) -> Check:
    """The engine the plugin will build, built the same way (queue_depth for
    each device the paths lie on)."""
    from ..core.drive import make_engine
    from ..core.layout import devices_under

    devices = devices_under(opts.paths)
    try:
        eng = make_engine(opts, devices)
    except ConfigError as e:
        return Check(
            f"{tag}engine", "fail", f"the plugin will not start: {e}", "fix io_uring (see above) or set io_engine: auto"
        )
    try:
        kind, why = eng.kind, eng.fallback_reason
        qd, split, awaited = eng.queue_depth, eng.split_bytes, eng.max_running
    finally:
        eng.close()
    data = {"engine": kind, "queue_depth": qd, "devices": devices, "split_bytes": split, "fallback_reason": why}
    data["awaited_concurrency"] = awaited  # auto resolved: the CPUs this process may run on
    at_once = f"{awaited} awaited reads at once" if awaited else "awaited reads unbounded"
    if kind == "io_uring":
        per = (
            f" ({opts.queue_depth} for each of {devices} devices)"
            if devices > 1 and qd == opts.queue_depth * devices
            else ""
        )
        summary = f"io_uring, queue_depth {qd}{per}, split_bytes {split >> 10} KiB, {at_once}"
        return Check(f"{tag}engine", "ok", summary, data=data)
    if opts.io_engine == "threads":
        summary = f"threads (io_engine: threads is configured), queue_depth {qd}, {at_once}"
        return Check(f"{tag}engine", "info", summary, data=data)
    return Check(
        f"{tag}engine", "fail", f"the thread engine will run instead of io_uring: {why}", "see the io_uring line", data
    )


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser, command: str = "doctor") -> None:
    p.epilog = EXAMPLES
    p.add_argument(
        "--path",
        metavar="P",
        help="store directory (comma-separated for a striped store); "
        "default: the path of each lmcache-fx plugin in --config, else the option's default",
    )
    p.add_argument(
        "--config",
        metavar="YAML",
        help="LMCache config file to check the plugin against (default: $LMCACHE_CONFIG_FILE when set)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts instead of text")
    p.add_argument("--strict", action="store_true", help="exit 1 on warnings too")


def diagnose(path: Optional[str], config: Optional[str]) -> dict:
    checks: list[Check] = []
    checks += check_versions()
    plugins: list[tuple[str, FxOptions]] = []
    unsized: set[str] = set()  # plugins that fail to load: their paths are checked, not their space
    pool_bytes = None
    if config:
        try:
            cfg = load_lmcache_config(config)
        except ValueError as e:
            checks.append(Check("config", "fail", str(e), "fix the file; LMCache would not start with it"))
            cfg = None
        entries: list = []
        if cfg is not None:
            try:
                entries, warns = plugin_entries(cfg)
            except ConfigError as e:
                checks.append(Check("config", "fail", f"{config}: {e}", "write the keys flat, as named above"))
                entries, warns = [], []
                cfg = None
        if cfg is not None:
            outside = keys_outside_extra_config(config)
            checks += [Check("config", "warn", w) for w in [outside_warning(k) for k in outside] + warns]
            try:  # LMCache's pool exists even with local_cpu: false (it is the staging allocator)
                pool_bytes = int(float(cfg.max_local_cpu_size) * GIB)
            except (TypeError, ValueError):
                pool_bytes = None
            if not entries and os.environ.get("LMCACHE_EXTRA_CONFIG") and _yaml_names_fx(config):
                # LMCache takes the variable's map for the whole extra_config: the YAML's keys are gone
                checks.append(
                    Check(
                        "config",
                        "fail",
                        "LMCACHE_EXTRA_CONFIG is set, and LMCache takes it for the whole extra_config in "
                        f"place of {config}'s: no lmcache-fx plugin's module_path and class_name are left in it",
                        "put every storage_plugin.<name>.* key in LMCACHE_EXTRA_CONFIG too, or unset it",
                    )
                )
            elif not entries:
                checks.append(
                    Check(
                        "config",
                        "fail",
                        f"{config}: neither storage_plugins nor remote_storage_plugins lists an lmcache-fx plugin",
                        "add: storage_plugins: [fx] and extra_config: storage_plugin.fx.module_path: "
                        f"{PLUGIN_MODULE}, storage_plugin.fx.class_name: {PLUGIN_CLASS}",
                    )
                )
            names = [pc.name for pc in entries]
            for pc in entries:
                check_plugin(pc, cfg)
                why = lost_path(pc, cfg, outside)
                if why and not pc.error:  # it loads, at a path the operator did not mean
                    checks.append(
                        Check("config", "fail", why, "move the key under extra_config, as storage_plugin.<name>.path")
                    )
                label = pc.prefix[:-1] if names.count(pc.name) > 1 else pc.name  # fx in both lists: which
                if pc.error:
                    said = (
                        f"Failed to create backend {pc.name}"
                        if pc.head == "storage_plugin"
                        else "Failed to initialize/re-establish remote connection"
                    )
                    checks.append(
                        Check(
                            f"[{label}] plugin",
                            "fail",
                            f"will not load (LMCache would log '{said}' and run without the tier): {pc.error}",
                            "correct the setting named above in the YAML",
                        )
                    )
                    # Still check its path with the options that parse, so one run shows every problem;
                    # not its space, against a capacity it may not have.
                    o = _options_that_parse(cfg.extra_config or {}, pc.prefix)
                    if o is not None:
                        plugins.append((label, o))
                        unsized.add(label)
                else:
                    checks.append(
                        Check(
                            f"[{label}] plugin",
                            "ok",
                            f"loads; options: {_opts_summary(pc.options)}",
                            data={**asdict(pc.options), "auth_key": _shown_key(pc.options.auth_key)},
                        )
                    )
                    plugins.append((label, pc.options))
    io_engine = plugins[0][1].io_engine if plugins else "auto"
    checks.append(check_io_uring(io_engine))
    if path:
        base = plugins[0][1] if plugins else FxOptions()
        try:
            # A path given here is the operator's, against this working directory
            here = ",".join(os.path.abspath(expand_path(p)) for p in path.split(",") if p.strip())
            o = FxOptions.from_mapping({**_nondefault(base), "path": here or path})
        except ConfigError as e:
            raise ValueError(f"--path: {e}") from None
        plugins = [("", o)]
    elif not plugins and not config:
        plugins = [("", FxOptions())]
        checks.append(
            Check(
                "config",
                "info",
                "no --config: checking the default options on the default path "
                f"{FxOptions().path} (give --path or --config)",
            )
        )
    direct = {}  # plugin: whether O_DIRECT worked on its first path, the one the store probes
    for name, o in plugins:
        tag = f"[{name}] " if name else ""
        checks.append(check_engine(o, tag))
        for k, root in enumerate(o.paths):
            found = check_path(root, o, tag if len(o.paths) == 1 else f"{tag}{root}: ", first=k == 0)
            if k == 0:
                direct[name] = any(c.name.endswith("O_DIRECT") and c.status == "ok" for c in found)
            checks += [c for c in found if not (name in unsized and c.name.endswith("space"))]
        twice = aliased_root([os.path.abspath(os.path.expanduser(r)) for r in o.paths])
        if twice is not None:
            checks.append(
                Check(
                    f"{tag}paths",
                    "fail",
                    f"{twice[0]} is the same directory as {twice[1]} (a symlink or a bind mount): the store "
                    "refuses to start",
                    "list each directory once in path",
                    data={"path": twice[0], "same_as": twice[1]},
                )
            )
    checks += check_memlock(pool_bytes)
    checks.append(check_hugepages())
    checks.append(check_gpu())
    fails = [c for c in checks if c.status == "fail"]
    warns = [c for c in checks if c.status == "warn"]
    if fails:
        verdict = "the fast path will NOT be used; see the FAIL lines: " + ", ".join(
            c["name"] if isinstance(c, dict) else c.name for c in fails
        )
    else:
        used = []
        for name, o in plugins:
            parts = ["io_uring" if o.io_engine != "threads" else "threads"]
            if o.odirect != "false" and direct.get(name):
                parts.append("O_DIRECT")
            elif o.odirect != "false":  # odirect: auto where the probe failed (a memory filesystem): the store's too
                parts.append("buffered I/O (no O_DIRECT here)")
            used.append(f"{' + '.join(parts)} on {o.path}")
        verdict = "the configured fast path will be used: " + "; ".join(used)
        if warns:
            verdict += f" ({len(warns)} warning{'s' if len(warns) > 1 else ''})"
    return {"checks": [asdict(c) for c in checks], "fast_path": not fails, "warnings": len(warns), "verdict": verdict}


def _yaml_names_fx(config: str) -> bool:
    """Whether the YAML itself (before LMCache's environment overrides)
    has an lmcache-fx plugin's keys in its extra_config."""
    try:
        import yaml

        with open(config) as f:
            extra = (yaml.safe_load(f) or {}).get("extra_config") or {}
    except Exception:  # noqa: BLE001 - unreadable: LMCache's own reading said so above
        return False
    return isinstance(extra, dict) and any("lmcache_fx" in str(v) for v in extra.values())


def _options_that_parse(extra: dict, prefix: str) -> Optional[FxOptions]:
    """A failing plugin's options, those of its keys that parse on their own;
    None when its path is not among them, or when they do not go together."""
    good = {}
    for k, v in extra.items():
        opt = k[len(prefix) :] if isinstance(k, str) and k.startswith(prefix) else ""
        if opt and opt not in ("module_path", "class_name"):
            try:
                FxOptions.from_mapping({opt: v})
                good[opt] = v
            except ConfigError:
                pass
    if "path" not in good:  # its path did not parse, or it has none: the default is not where it would be
        return None
    try:
        return FxOptions.from_mapping(good)
    except ConfigError:
        return None


def _opts_summary(o: FxOptions) -> str:
    return (
        f"path {o.path}, max_capacity_gb {o.max_capacity_gb:g}, io_engine {o.io_engine}, queue_depth "
        f"{o.queue_depth}, split_bytes {o.split_bytes >> 10} KiB, odirect {o.odirect}, verify "
        f"{str(o.verify).lower()}"
    )


def _nondefault(o: FxOptions) -> dict:
    d = FxOptions()
    return {k: getattr(o, k) for k in FxOptions.names() if getattr(o, k) != getattr(d, k)}


@contextlib.contextmanager
def _plugin_logs_dropped():
    """The plugin's own log lines are dropped while doctor builds what the
    plugin builds (its engine, a store): each says what a check then reports
    in the table, and printed by Python's last-resort handler they came
    before it on stderr, bare."""
    logger = logging.getLogger("lmcache_fx")
    held = logging.NullHandler()
    before = logger.propagate
    logger.addHandler(held)
    logger.propagate = False
    try:
        yield
    finally:
        logger.propagate = before
        logger.removeHandler(held)


def run(args, parser=None) -> int:
    config = args.config or os.environ.get("LMCACHE_CONFIG_FILE") or None
    try:
        if config and not os.path.isfile(config):
            raise ValueError(f"{config}: no such file" + ("" if args.config else " (from $LMCACHE_CONFIG_FILE)"))
        with _plugin_logs_dropped():
            res = diagnose(args.path, config)
    except ValueError as e:
        print(f"lmcache-fx doctor: error: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(e)}))
        return 2
    code = 0 if res["fast_path"] and not (args.strict and res["warnings"]) else 1
    res["exit_status"] = code
    _print(res, args.json)  # a closed stdout is the dispatcher's (cli.main)
    return code


def _print(res: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, indent=1))
        return
    width = max(len(c["name"]) for c in res["checks"])
    for c in res["checks"]:
        print(f"[{c['status'].upper():<4}] {c['name']:<{width}}  {c['summary']}")
        if c["fix"] and c["status"] in ("warn", "fail"):
            print(f"{'':>7} {'':<{width}}  fix: {c['fix']}")
        elif c["fix"] and c["status"] == "info":  # nothing wrong; how it would go faster
            print(f"{'':>7} {'':<{width}}  hint: {c['fix']}")
    print(res["verdict"])
