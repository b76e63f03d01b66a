"""Every runtime option of lmcache-fx, in one table, with its default.

The same names are read from LMCache's `extra_config` as
`storage_plugin.<name>.<option>`; README.md prints this table.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

GIB = 1 << 30
# What an operator does where processes of several users share a store and one runs without
# shared_group (its files only its user may open): said by the ledger and the store alike.
SHARED_GROUP_FIX = "set shared_group: true in every process sharing the store, then chmod -R g+rwX the store's paths"


class ConfigError(ValueError):
    """A wrong option: the message names the option and the fix."""


def refuse_direct_to_gpu(options, where: str) -> None:
    """Entry points other than the in-process plugin cannot hand LMCache
    GPU-resident chunks: say so instead of silently ignoring the option."""
    if options.direct_to_gpu:
        raise ConfigError(
            f"{where}direct_to_gpu: only the in-process storage plugin (lmcache_fx.lmcache_plugin) "
            "serves chunks in GPU memory; remove it here or use storage_plugins"
        )


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
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, str):
        s = v.strip().lower()
    else:
        s = ""
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
        unit = {"_gb": " of GiB (no unit: 10 means 10 GiB)", "_mib": " of MiB (no unit: 2048 means 2 GiB)"}.get(
            name[name.rfind("_") :], ""
        )
        raise ConfigError(f"{name}: expected {'an integer' if kind is int else 'a number'}{unit}, got {v!r}") from None
    if not (lo <= x <= hi):
        raise ConfigError(f"{name}: {x} is out of range [{lo}, {hi}]")
    return x


def expand_path(p: str) -> str:
    """~ and $VARS of a store path, expanded as the plugin, doctor and the
    tools all expand them (the README's default is written with ~)."""
    return os.path.expandvars(os.path.expanduser(p.strip()))


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text) -> int:
    """Bytes from an integer or a string with a K/M/G/T suffix (powers of
    1024; 'M', 'MB', 'MiB' and Kubernetes' 'Mi' alike). ValueError when it
    is not one."""
    if isinstance(text, bool):
        raise ValueError(f"expected a size, got {text!r}")
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    if s[-2:-1] in _SIZE_UNITS and s.endswith("I"):  # 1Mi, as a pod spec writes it
        s = s[:-1]
    mult = _SIZE_UNITS.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        v = float(s) * mult
        n = int(v)
    except (ValueError, OverflowError):
        raise ValueError(f"expected bytes like 1048576 or '1M', got {text!r}") from None
    if n != v:  # '4096.5' was 4096, and '8191.9' was refused as 8191, a value never written
        raise ValueError(f"expected a whole number of bytes, got {text!r}")
    return n


def _parse_size(name: str, v, lo, hi) -> int:
    if isinstance(v, str):  # a number stays a number: 4096.5 is refused below, not truncated
        try:
            v = parse_size(v)
        except ValueError as e:
            raise ConfigError(f"{name}: {e}") from None
    return _parse_number(name, v, int, lo, hi)


# ---------------------------------------------------------------- the table
# Each option is declared once, as a field of FxOptions: its default, the
# values it accepts (as README shows them), its meaning, and its parser.


def _opt(default: Any, values: str, meaning: str, parse: Callable[[str, Any], Any]) -> Any:
    return field(default=default, metadata={"values": values, "meaning": meaning, "parse": parse})


def _boolean(full: str, v) -> bool:
    return _parse_bool(full, v)


def _choice(*choices: str) -> Callable[[str, Any], str]:
    return lambda full, v: _parse_choice(full, v, choices)


def _int(lo: int, hi: int) -> Callable[[str, Any], int]:
    return lambda full, v: _parse_number(full, v, int, lo, hi)


def _int_or_auto(lo: int, hi: int) -> Callable[[str, Any], int | str]:
    def parse(full: str, v) -> int | str:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        try:
            return _parse_number(full, v, int, lo, hi)
        except ConfigError as e:
            raise ConfigError(f"{e} (or auto)") from None

    return parse


def _path(full: str, v) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{full}: expected a directory path, got {v!r}")
    return v


def _capacity(full: str, v) -> float:
    return _parse_number(full, v, float, 1e-6, 1e9)


def _split(full: str, v) -> int:
    x = _parse_size(full, v, 4096, 1 << 30)
    if x % 4096:
        raise ConfigError(f"{full}: {x} is not a multiple of 4096; try {(x // 4096 + 1) * 4096}")
    return x


def _address(full: str, v) -> str:
    import ipaddress

    try:
        return str(ipaddress.ip_address(str(v).strip()))
    except ValueError:
        raise ConfigError(f"{full}: expected an IP address such as 127.0.0.1 or 0.0.0.0, got {v!r}") from None


def auth_key_bytes(spec: str, full: str = "auth_key") -> bytes:
    """The MAC key an auth_key value names: the string itself, `env:VARNAME`
    (read from the environment) or `file:/path` (the file's bytes, a trailing
    newline dropped); at least 16 bytes. Returned hashed to 32 bytes, so
    keys of any length fit BLAKE2b's key. ConfigError when unusable."""
    import hashlib

    if spec.startswith("env:"):
        var = spec[4:].strip()
        raw_b = os.environb.get(os.fsencode(var), b"")  # its bytes as set: a random key need not be UTF-8
        if not raw_b:
            raise ConfigError(f"{full}: environment variable {var!r} is not set or empty")
    elif spec.startswith("file:"):
        fn = os.path.expanduser(spec[5:].strip())  # as path is
        try:
            with open(fn, "rb") as f:
                raw_b = f.read((1 << 16) + 1).rstrip(b"\r\n")
        except OSError as e:
            raise ConfigError(f"{full}: cannot read the key file {fn!r}: {e.strerror}") from None
        if len(raw_b) > 1 << 16:  # not cut silently: two files that differ past 64 KiB are two keys
            raise ConfigError(f"{full}: the key file {fn!r} is over 64 KiB; use a key file of 16 bytes to 64 KiB")
    else:
        raw_b = spec.encode("utf-8", "surrogatepass")
    if len(raw_b) < 16:
        raise ConfigError(
            f"{full}: a key of {len(raw_b)} bytes is too short; use at least 16 (e.g. the output of "
            "`openssl rand -hex 32` in a file: file:/path)"
        )
    return hashlib.blake2b(raw_b, digest_size=32, person=b"lmcache-fx-key1").digest()


def _auth_key(full: str, v) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{full}: expected a key, env:VARNAME or file:/path, got {v!r}")
    if v:
        auth_key_bytes(v, full)  # refuse a key that cannot be read now, not at the first store
    return v


@dataclass
class FxOptions:
    """Every runtime option with its default; defaults chosen by measurement
    (docs/benchmarks.md)."""

    path: str = _opt(
        os.path.join(os.path.expanduser("~"), ".cache", "lmcache-fx"),
        "path[,path...]",
        "store directory, absolute (~ and $VARS expanded); several comma-separated paths stripe chunks over them "
        "(each chunk under one of two paths its key names, a write batch spread evenly); every process sharing a "
        "store lists the same paths in the same order (the first holds the shared usage)",
        _path,
    )
    max_capacity_gb: float = _opt(
        100.0, "> 0", "bytes of chunk files kept under the paths, evicting least recently used", _capacity
    )
    io_engine: str = _opt(
        "auto",
        "auto | io_uring | threads",
        "io_uring, or C threads doing pread/pwrite; auto falls back to threads with a warning",
        _choice("auto", "io_uring", "threads"),
    )
    queue_depth: int = _opt(
        32,
        "1..32768",
        "sub-reads in flight for each device the paths lie on (as fio's iodepth per job), a read piece bigger "
        "than 1 MiB counting once per started MiB (thread engine: threads, this times the devices, at most 16)",
        _int(1, 32768),
    )
    split_bytes: int = _opt(
        1 << 20,
        "4K..1G, multiple of 4096 (bytes or K/M/G)",
        "size of the sub-reads a chunk is cut into (with verify false, O_DIRECT reads from a device take at least "
        "16 MiB: pieces are there so that each is checksummed as it lands)",
        _split,
    )
    odirect: str = _opt(
        "auto",
        "auto | true | false",
        "O_DIRECT (page cache bypassed); auto uses it where the filesystem allows",
        _choice("auto", "true", "false"),
    )
    mapped_reads: str = _opt(
        "auto",
        "auto | true | false",
        "copy payloads of 2 MiB files or more from a mapping of the file, checksummed in the same pass "
        "(memory filesystems only); auto: where a tmpfs keeps huge pages (huge=always or within_size) and the "
        "CPU copies and sums in one pass (AVX-512 VPCLMULQDQ), where that beats read(); true: on any tmpfs or ramfs",
        _choice("auto", "true", "false"),
    )
    staged_reads: str = _opt(
        "auto",
        "auto | true | false",
        "with verify and O_DIRECT, read payload pieces of up to 1 MiB into slots of a 16 MiB staging pool per device "
        "(up to eight devices; a read keeps 8 staged pieces in flight per device it reads from) that "
        "stays in the CPU's cache (one per process, made when the store opens, shared by concurrent reads; a piece "
        "finding no slot free waits for one of its read's own, or reads in place when that read has none) and copy "
        "them on with their CRC32C in one pass, instead of reading them into place and summing them there; auto: on "
        "loop devices (whose transfer is itself a CPU copy, sharing memory bandwidth with the check) on a CPU that "
        "copies and sums in one pass (AVX-512 VPCLMULQDQ), for reads of more than 4 MiB of payload (smaller ones "
        "have no stream to overlap and land in place); true: every read, on every device (io_uring engine only)",
        _choice("auto", "true", "false"),
    )
    runner_nice: int = _opt(
        10,
        "0..19",
        "priority steps (nice) below the submitting thread at which awaited reads run on the engine's runner threads, "
        "so that on a busy host LMCache's event loop gets a CPU before the runners' copies and checksums; "
        "0: the submitter's priority",
        _int(0, 19),
    )
    awaited_concurrency: int | str = _opt(
        "auto",
        "auto | 0..1024",
        "awaited reads (LMCache's async loads) that run at once; later ones wait and start in arrival order as "
        "earlier ones finish, so that requests finish about in the order they came instead of overtaking each "
        "other on CPUs they share; auto: the CPUs this process may use (its affinity, at most its container's "
        "CPU limit); 0: each at once, on a runner thread of its own",
        _int_or_auto(0, 1024),
    )
    whole_reads_when_busy: bool = _opt(
        True,
        "true | false",
        "an awaited read that starts while other awaited reads run or wait (under awaited_concurrency) reads "
        "each O_DIRECT payload of at most 2 MiB in place as one request, not split_bytes pieces: with every "
        "CPU busy a piece's check has no idle core to overlap the next piece's transfer, and each piece costs "
        "a completion; a read alone keeps its pieces; false: pieces always",
        _boolean,
    )
    verify: bool = _opt(
        True,
        "true | false",
        "check each payload's CRC32C on read; a mismatch is a miss (with false, chunks written by a store that "
        "reuses evicted files on disk are still checked)",
        _boolean,
    )
    reuse_evicted: bool = _opt(
        True,
        "true | false",
        "write a new chunk into the file of the chunk it evicts, when of the same size and no reader "
        "holds that file (no allocation; not on mounts whose file locks stay on this host, e.g. NFS nolock); "
        "on tmpfs also into the file of a removed chunk of 128 KiB or more, "
        "kept for 60 s "
        "(counted in the usage, the first to go when room is needed); false always unlinks",
        _boolean,
    )
    auth_key: str = _opt(
        "",
        "key (16+ bytes) | env:VARNAME | file:/path",
        "chunks carry a keyed BLAKE2b MAC of header and payload; a chunk without a valid one is a miss (empty = off)",
        _auth_key,
    )
    shared_group: bool = _opt(
        False,
        "true | false",
        "files 0660 and directories 02770 (setgid, in the group of "
        "the store's root) instead of 0600/0700, for a group of users",
        _boolean,
    )
    metrics_port: int = _opt(
        0,
        "0..65535",
        "Prometheus metrics on http://<metrics_addr>:<port + local worker "
        "id>/metrics; 0 = off (they are in LMCache's /metrics either way)",
        _int(0, 65535),
    )
    metrics_addr: str = _opt(
        "127.0.0.1",
        "IP address",
        "address the metrics server listens on; 0.0.0.0 for every interface (the page names store paths)",
        _address,
    )
    direct_to_gpu: bool = _opt(
        False,
        "true | false",
        "return chunks in GPU memory of the plugin's own (like "
        "LMCache's GdsBackend), read NVMe -> pinned staging -> GPU by the pipeline, payload "
        "CRC32C checked in staging (verify); needs a GPU driver, not with auth_key",
        _boolean,
    )
    gpu_buffer_mib: int = _opt(
        2048,
        "1..1048576",
        "direct_to_gpu: GPU memory holding retrieved chunks until LMCache releases them",
        _int(1, 1 << 20),
    )
    gpu_staging_slots: int = _opt(
        8, "2..256", "direct_to_gpu: page-locked staging slots (reads and GPU copies in flight)", _int(2, 256)
    )
    gpu_slot_mib: int = _opt(
        4, "1..1024", "direct_to_gpu: size of one staging slot (the largest read/copy piece)", _int(1, 1024)
    )

    @property
    def paths(self) -> list[str]:
        return [expand_path(p) for p in self.path.split(",") if p.strip()]

    @property
    def max_capacity_bytes(self) -> int:
        return int(self.max_capacity_gb * GIB)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def doc(cls) -> dict[str, tuple[str, str]]:
        """option -> (one-line meaning, accepted values), in table order."""
        return {f.name: (f.metadata["meaning"], f.metadata["values"]) for f in fields(cls)}

    @classmethod
    def from_mapping(cls, values: dict, where: str = "") -> "FxOptions":
        """Builds options from {name: value}; `where` prefixes names in errors."""
        o = cls()
        table = {f.name: f for f in fields(cls)}
        for name, v in values.items():
            full = f"{where}{name}"
            if not isinstance(name, str):  # e.g. a YAML key that parsed as a number
                raise ConfigError(f"option name {full!r} is not a string: quote it in the config")
            if name not in table:
                if name in LMCACHE_OWN_KEYS:
                    raise ConfigError(
                        f"unknown option '{full}': {name} is LMCache's own setting; set it at the top level "
                        "of the LMCache config, not among the plugin's options"
                    )
                close = difflib.get_close_matches(name, list(table), n=1)
                hint = f"did you mean '{where}{close[0]}'?" if close else f"valid options: {', '.join(table)}"
                raise ConfigError(f"unknown option '{full}': {hint}")
            setattr(o, name, table[name].metadata["parse"](full, v))
        if not o.paths:
            raise ConfigError(f"{where}path: no directory given; set it to a directory on the NVMe filesystem")
        for p in o.paths:
            unset = re.search(r"\$(\{)?([A-Za-z_][A-Za-z0-9_]*)(?(1)\})", p)
            if unset:  # expandvars leaves an unset variable as it is: a directory literally named so
                raise ConfigError(
                    f"{where}path: {p!r}: ${unset.group(2)} is not set in this process's environment "
                    "(a store path's $NAME is expanded, as ~ is)"
                )
            if not os.path.isabs(p):  # the server's working directory, not the one doctor and the tools run in
                raise ConfigError(
                    f"{where}path: {p!r} is relative, so each process would resolve it against its own working "
                    f"directory; give an absolute path (here: {os.path.abspath(p)!r}) or one under ~"
                )
        roots = [os.path.abspath(p) for p in o.paths]
        twice = sorted({p for p in roots if roots.count(p) > 1})
        if twice:  # its chunks would be counted once per mention: the capacity cut to a part
            raise ConfigError(f"{where}path: {', '.join(twice)} given more than once; list each directory once")
        if o.direct_to_gpu and o.auth_key:
            # verify works on the GPU path (the pipeline checksums each piece in its staging slot); the MAC
            # is computed over the payload in host memory, where a GPU-resident chunk never is.
            raise ConfigError(
                f"{where}direct_to_gpu: cannot be combined with {where}auth_key; the MAC of a payload copied "
                "straight to the GPU cannot be checked (its CRC32C is: verify works with direct_to_gpu)"
            )
        return o


# LMCache's own top-level settings users put among a plugin's options (read from LMCache 0.5.6's
# config; named here because core/ does not import LMCache): said as such, not as a misspelling.
LMCACHE_OWN_KEYS = frozenset(
    {
        "chunk_size",
        "local_cpu",
        "max_local_cpu_size",
        "local_disk",
        "max_local_disk_size",
        "remote_url",
        "remote_serde",
        "save_unfull_chunk",
        "use_layerwise",
        "save_decode_cache",
        "enable_blending",
    }
)

_PLUGIN_KEYS = ("module_path", "class_name")  # LMCache's own keys under a plugin's prefix


def flat_keys(value: Any, prefix: str) -> list[str]:
    """The flat extra_config keys a nested map under `prefix` stands for."""
    if not isinstance(value, dict):
        return [prefix]
    return [k for name, v in value.items() for k in flat_keys(v, f"{prefix}.{name}")]


PLUGIN_HEADS = ("storage_plugin", "remote_storage_plugin")  # extra_config heads of LMCache's two plugin lists


def plugin_lists(config) -> dict:
    """{head: the names its list holds} of an LMCache config object (its
    storage_plugins and remote_storage_plugins)."""
    return {h: list(getattr(config, f"{h}s", None) or []) for h in PLUGIN_HEADS}


def stray_plugin_keys(
    extra: dict, listed: Sequence[str], head: str = "storage_plugin", lists: Optional[dict] = None
) -> list[str]:
    """extra_config keys that look meant for a plugin under `head`
    (storage_plugin, remote_storage_plugin) but that no plugin LMCache
    loads will read ('storage_plugins.fx.path', a name not in the list),
    each with the fix: a misspelt key would otherwise leave the store at its
    defaults without a word. `lists` ({head: names listed}) lets the fix
    name the other head where the name is listed there. A nested map
    (storage_plugin: {fx: {path: ..}}) is refused (ConfigError): LMCache
    reads flat keys only, and the store would open at its default path and
    capacity."""
    return [why for _, why in _stray_keys(extra, listed, head, lists or {})]


def _stray_keys(extra: dict, listed: Sequence[str], head: str, lists: dict) -> list[tuple[str, str]]:
    """stray_plugin_keys' (key, why) pairs."""
    out = []
    lists_key = f"{head}s"
    for k in extra or {}:
        if not isinstance(k, str):
            continue
        first = k.partition(".")[0]
        # A map where flat keys belong (the head, or <head>.<name>); a map value of a listed plugin's
        # own <head>.<name>.<option> is that plugin's business.
        if first.replace("-", "_").rstrip("s") == head and isinstance(extra[k], dict) and k.count(".") <= 1:
            flat = flat_keys(extra[k], head + k[len(first) :])
            raise ConfigError(
                f"extra_config key '{k}' holds a map, but LMCache reads flat keys only and would ignore it; "
                f"write {', '.join(repr(f) for f in flat[:3])}{' ...' if len(flat) > 3 else ''}"
            )
        if not k.startswith(f"{head}."):
            if first != head and first.replace("-", "_").rstrip("s") == head:
                out.append(
                    (
                        k,
                        f"extra_config key '{k}': LMCache reads {head}.<name>.<option> (singular), "
                        f"so it ignores this one; rename it to '{head}.{k.partition('.')[2]}'",
                    )
                )
            continue
        rest = k[len(head) + 1 :]
        if any(rest.startswith(f"{n}.") for n in listed):  # a listed name, dots in it or not
            continue
        if "." in rest:
            name, _, option = rest.rpartition(".")
            other = next((h for h in PLUGIN_HEADS if h != head and name in lists.get(h, ())), None)
            fix = (
                f"'{name}' is listed in {other}s, whose options LMCache reads as {other}.{name}.<option>: "
                f"rename it to '{other}.{name}.{option}'"
                if other
                else f"use {head}.<name>.<option> with a listed name"
            )
            out.append(
                (
                    k,
                    f"extra_config key '{k}': no plugin '{name}' in {lists_key} {list(listed)}; LMCache ignores it ({fix})",
                )
            )
    return out


def _bare_paths(extra: dict, prefix: str) -> list[str]:
    """extra_config keys under no plugin head that give a path: `path`,
    `fx.path`, a map holding one (`fx: {path: ..}`). LMCache passes a plugin
    only its <head>.<name>.<option> keys and reads none of its own ending in
    `path` alone (its are `rust_raw_block.device_path` and the like), so
    such a key was meant for a plugin and is lost."""
    out = []
    for k, v in (extra or {}).items():
        if not isinstance(k, str) or k.partition(".")[0].replace("-", "_").rstrip("s") in PLUGIN_HEADS:
            continue  # a plugin head's key: _stray_keys judges it
        given = [f for f in flat_keys(v, k) if f.rpartition(".")[2].lower() in ("path", "paths")]
        if not given:
            continue
        if isinstance(v, dict):
            out.append(
                f"extra_config key '{k}' holds a map giving '{given[0]}', but LMCache reads flat keys only and "
                f"passes a plugin only its own: write '{prefix}path'"
            )
        else:
            out.append(
                f"extra_config key '{k}' gives a path, but LMCache passes the plugin only {prefix}<option> "
                f"keys: rename it to '{prefix}path'"
            )
    return out


def plugin_options(extra: dict, head: str, name: str, lists: dict) -> tuple[FxOptions, list[str]]:
    """The options of the plugin LMCache builds as <head>.<name>, and the
    warnings about extra_config keys no plugin LMCache loads will read, for
    both heads (`lists`: {head: the names its list holds}). ConfigError for
    a bad option or a nested map, and when the plugin has no path of its own
    while an ignored key gives one (a misspelt name or prefix, the other
    plugin's head): the store would open at its default path and capacity,
    in the home directory, where the operator meant another."""
    prefix = f"{head}.{name}."
    options = options_from_extra(extra, prefix)
    strays, notes = [], []
    for h in PLUGIN_HEADS:
        try:
            strays += _stray_keys(extra, lists.get(h, ()), h, lists)
        except ConfigError as e:  # a nested map under the other head is the other plugin's to refuse
            if h == head:
                raise
            notes.append(str(e))
    lost = [why for k, why in strays if k.rpartition(".")[2] == "path"]
    if f"{prefix}path" not in (extra or {}):
        lost += _bare_paths(extra, prefix)
    if lost and f"{prefix}path" not in (extra or {}):
        default = FxOptions()
        more = f" (and {len(lost) - 1} more such key{'s' if len(lost) > 2 else ''})" if len(lost) > 1 else ""
        raise ConfigError(
            f"{prefix}path is not set, so the store would open at its default ({default.path}, "
            f"{default.max_capacity_gb:g} GiB); {lost[0]}{more}"
        )
    return options, [why for _, why in strays] + notes


def options_from_extra(extra: dict, prefix: str) -> FxOptions:
    """Options under `prefix` of LMCache's extra_config (e.g.
    'storage_plugin.fx.'), checked by name."""
    values = {k[len(prefix) :]: v for k, v in (extra or {}).items() if isinstance(k, str) and k.startswith(prefix)}
    for k in _PLUGIN_KEYS:
        values.pop(k, None)
    return FxOptions.from_mapping(values, where=prefix)
