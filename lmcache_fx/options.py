"""Every runtime option of lmcache-fx, in one table, with its default.

The same names are read from LMCache's `extra_config` as
`storage_plugin.<name>.<option>`; README.md prints this table.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields

GIB = 1 << 30


class ConfigError(ValueError):
    """A wrong option: the message names the option and the fix."""


def refuse_direct_to_gpu(options, where: str) -> None:
    """Entry points other than the in-process plugin cannot hand LMCache
    GPU-resident chunks: say so instead of silently ignoring the option."""
    if options.direct_to_gpu:
        raise ConfigError(f"{where}direct_to_gpu: only the in-process storage plugin (lmcache_fx.lmcache_plugin) "
                          "serves chunks in GPU memory; remove it here or use storage_plugins")


def _parse_bool(name: str, v) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("false", "0", "no", "off"):
        return False
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise ConfigError(f"{name}: expected true or false, got {v!r}")


def _parse_choice(name: str, v, choices) -> str:
    s = str(v).strip().lower() if isinstance(v, (str, bool)) else None
    if isinstance(v, bool):
        s = "true" if v else "false"
    if s not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {v!r}")
    return s


def _parse_number(name: str, v, kind, lo, hi):
    if isinstance(v, bool):
        raise ConfigError(f"{name}: expected a number, got {v!r}")
    try:
        x = kind(v)
        if kind is int and isinstance(v, float) and v != x:
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{name}: expected {'an integer' if kind is int else 'a number'}, got {v!r}") from None
    if not (lo <= x <= hi):
        raise ConfigError(f"{name}: {x} is out of range [{lo}, {hi}]")
    return x


def _parse_size(name: str, v, lo, hi) -> int:
    """Bytes, as an integer or with a K/M/G suffix (powers of 1024)."""
    if isinstance(v, str):
        s = v.strip().upper().removesuffix("IB").removesuffix("B")
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
        if mult != 1:
            s = s[:-1]
        try:
            v = int(float(s) * mult)
        except (ValueError, OverflowError):
            raise ConfigError(f"{name}: expected bytes like 1048576 or '1M', got {v!r}") from None
    return _parse_number(name, v, int, lo, hi)


@dataclass
class FxOptions:
    """Defaults chosen by measurement (docs/benchmarks.md)."""

    path: str = os.path.join(os.path.expanduser("~"), ".cache", "lmcache-fx")
    max_capacity_gb: float = 100.0
    io_engine: str = "auto"
    queue_depth: int = 32
    split_bytes: int = 1 << 20
    odirect: str = "auto"
    verify: bool = True
    shared_group: bool = False
    metrics_port: int = 0
    direct_to_gpu: bool = False
    gpu_buffer_mib: int = 2048
    gpu_staging_slots: int = 8
    gpu_slot_mib: int = 4

    # option -> (one-line meaning, accepted values)
    DOC = {
        "path": ("store directory; several comma-separated paths stripe chunks over them", "path[,path...]"),
        "max_capacity_gb": ("bytes of chunk files kept under the paths, evicting least recently used", "> 0"),
        "io_engine": ("io_uring, or C threads doing pread/pwrite; auto falls back to threads with a warning",
                      "auto | io_uring | threads"),
        "queue_depth": ("sub-reads in flight per batch (thread engine: threads, at most 16 by default)", "1..32768"),
        "split_bytes": ("size of the sub-reads a chunk is cut into", "4K..1G, multiple of 4096"),
        "odirect": ("O_DIRECT (page cache bypassed); auto uses it where the filesystem allows",
                    "auto | true | false"),
        "verify": ("check each payload's CRC32C on read; a mismatch is a miss", "true | false"),
        "shared_group": ("files 0660 and directories 0770 instead of 0600/0700, for a group of users",
                         "true | false"),
        "metrics_port": ("Prometheus metrics on http://0.0.0.0:<port + local worker id>/metrics; 0 = off "
                         "(they are in LMCache's /metrics either way)", "0..65535"),
        "direct_to_gpu": ("return chunks in GPU memory of the plugin's own (like LMCache's GdsBackend), read "
                          "NVMe -> pinned staging -> GPU by the pipeline; needs a GPU driver and verify: false",
                          "true | false"),
        "gpu_buffer_mib": ("direct_to_gpu: GPU memory holding retrieved chunks until LMCache releases them",
                           "1..1048576"),
        "gpu_staging_slots": ("direct_to_gpu: page-locked staging slots (reads and GPU copies in flight)",
                              "2..256"),
        "gpu_slot_mib": ("direct_to_gpu: size of one staging slot (the largest read/copy piece)", "1..1024"),
    }

    @property
    def paths(self) -> list[str]:
        return [p.strip() for p in self.path.split(",") if p.strip()]

    @property
    def max_capacity_bytes(self) -> int:
        return int(self.max_capacity_gb * GIB)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_mapping(cls, values: dict, where: str = "") -> "FxOptions":
        """Builds options from {name: value}; `where` prefixes names in errors."""
        o = cls()
        valid = cls.names()
        for name, v in values.items():
            full = f"{where}{name}"
            if name not in valid:
                close = difflib.get_close_matches(name, valid, n=1)
                hint = f"did you mean '{where}{close[0]}'?" if close else f"valid options: {', '.join(valid)}"
                raise ConfigError(f"unknown option '{full}': {hint}")
            setattr(o, name, cls._parse(full, name, v))
        if not o.paths:
            raise ConfigError(f"{where}path: no directory given; set it to a directory on the NVMe filesystem")
        if o.direct_to_gpu and o.verify:
            raise ConfigError(
                f"{where}direct_to_gpu: needs {where}verify: false; payloads copied straight to the GPU "
                "cannot be checked against their CRC32C yet (a corrupt chunk would not be detected)"
            )
        return o

    @staticmethod
    def _parse(full: str, name: str, v):
        if name == "path":
            if not isinstance(v, str):
                raise ConfigError(f"{full}: expected a directory path, got {v!r}")
            return v
        if name == "max_capacity_gb":
            return _parse_number(full, v, float, 1e-6, 1e9)
        if name == "io_engine":
            return _parse_choice(full, v, ("auto", "io_uring", "threads"))
        if name == "queue_depth":
            return _parse_number(full, v, int, 1, 32768)
        if name == "split_bytes":
            x = _parse_size(full, v, 4096, 1 << 30)
            if x % 4096:
                raise ConfigError(f"{full}: {x} is not a multiple of 4096; try {(x // 4096 + 1) * 4096}")
            return x
        if name == "odirect":
            return _parse_choice(full, v, ("auto", "true", "false"))
        if name == "metrics_port":
            return _parse_number(full, v, int, 0, 65535)
        if name == "gpu_buffer_mib":
            return _parse_number(full, v, int, 1, 1 << 20)
        if name == "gpu_staging_slots":
            return _parse_number(full, v, int, 2, 256)
        if name == "gpu_slot_mib":
            return _parse_number(full, v, int, 1, 1024)
        return _parse_bool(full, v)  # verify, shared_group, direct_to_gpu
