"""The lmcache-fx entries of an LMCache YAML and their options, as LMCache
itself would read them (LMCache is imported only to parse the file)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from ..core.options import ConfigError, FxOptions, flat_keys, plugin_lists, plugin_options, stray_plugin_keys
from .common import AdminError

PLUGIN_MODULE = "lmcache_fx.lmcache_plugin"
PLUGIN_CLASS = "FxStorageBackend"
REMOTE_MODULE = "lmcache_fx.remote_plugin"
REMOTE_CLASS = "FxRemoteConnector"
# (the extra_config head of a plugin's keys, the config list naming it, the module and class it takes)
HEADS = (
    ("storage_plugin", "storage_plugins", PLUGIN_MODULE, PLUGIN_CLASS),
    ("remote_storage_plugin", "remote_storage_plugins", REMOTE_MODULE, REMOTE_CLASS),
)


@dataclass
class PluginConf:
    """One lmcache-fx entry of an LMCache config."""

    name: str
    module_path: str
    class_name: str
    options: Optional[FxOptions] = None
    error: str = ""
    head: str = "storage_plugin"  # or remote_storage_plugin

    @property
    def prefix(self) -> str:
        return f"{self.head}.{self.name}."


def load_lmcache_config(path: str):
    """LMCacheEngineConfig exactly as LMCache builds it: the file, then
    LMCACHE_* environment overrides. Raises ValueError with a clear line."""
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # its INFO lines on import are not the tool's output
    try:
        from lmcache.v1.config import LMCacheEngineConfig
    except Exception as e:  # noqa: BLE001 - any import failure is the answer
        raise ValueError(f"cannot import LMCache to read {path}: {e}") from None
    try:
        cfg = LMCacheEngineConfig.from_file(path)
        cfg.update_config_from_env()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: LMCache cannot read it: {type(e).__name__}: {e}") from None
    return cfg


def plugin_entries(cfg) -> tuple[list[PluginConf], list[str]]:
    """The lmcache-fx entries of storage_plugins and remote_storage_plugins,
    and warnings about <head>.<name>.* settings LMCache will ignore.
    ConfigError for settings written as a nested map (LMCache ignores them
    all, so the store would run at its defaults)."""
    extra = cfg.extra_config or {}
    out, warns = [], []
    lists = plugin_lists(cfg)
    for head, list_key, _, _ in HEADS:
        listed = list(getattr(cfg, list_key, None) or [])
        for n in listed:
            mp, cn = _names(extra, head, n)
            if _is_ours(mp, cn):
                out.append(PluginConf(n, mp, cn, head=head))
        named = {
            k[len(head) + 1 :].rpartition(".")[0]
            for k in extra
            if isinstance(k, str) and k.startswith(f"{head}.") and k.count(".") >= 2
        }
        ours_unlisted = set()
        for n in sorted(named - set(listed)):
            if any(n.startswith(f"{m}.") for m in listed) or not _is_ours(*_names(extra, head, n)):
                continue
            ours_unlisted.add(n)
            warns.append(
                f"extra_config has {head}.{n}.* but {list_key} does not list '{n}': "
                f"LMCache will not load it (add it: {list_key}: [{n!r}])"
            )
        said = tuple(f"{head}.{n}." for n in ours_unlisted)  # warned of above, with their own fix
        warns += stray_plugin_keys(
            {k: v for k, v in extra.items() if not (isinstance(k, str) and k.startswith(said))}, listed, head, lists
        )
    return out, warns


def _names(extra: dict, head: str, name: str) -> tuple[str, str]:
    """module_path and class_name of <head>.<name>."""
    return (
        str(extra.get(f"{head}.{name}.module_path") or ""),
        str(extra.get(f"{head}.{name}.class_name") or ""),
    )


def _is_ours(module_path: str, class_name: str) -> bool:
    """Whether an entry means lmcache-fx."""
    return "lmcache_fx" in module_path or class_name in (PLUGIN_CLASS, REMOTE_CLASS)


def check_plugin(pc: PluginConf, cfg) -> None:
    """What LMCache does before the constructor, then the plugin's own option
    parsing: fills pc.options or pc.error."""
    module, cls = next((m, c) for h, _, m, c in HEADS if h == pc.head)
    if not pc.module_path or not pc.class_name:
        pc.error = (
            f"{pc.prefix}module_path and .class_name must both be set "
            f"({module} / {cls}); LMCache skips the plugin otherwise"
        )
        return
    import importlib

    try:
        mod = importlib.import_module(pc.module_path)
        got = getattr(mod, pc.class_name)
    except Exception as e:  # noqa: BLE001
        pc.error = (
            f"LMCache cannot load {pc.module_path}.{pc.class_name}: {type(e).__name__}: {e} (expected {module} / {cls})"
        )
        return
    got_name = getattr(got, "__name__", "")
    other = next(((h, lk, m, c) for h, lk, m, c in HEADS if h != pc.head and got_name == c), None)
    if other is not None:  # a README row copied into the other list: LMCache calls it with the wrong arguments
        pc.error = (
            f"{pc.module_path}.{pc.class_name} belongs under {other[1]} ({other[0]}.<name>.*); "
            f"under {pc.head}s use {module} / {cls}"
        )
        return
    try:
        pc.options = plugin_options(cfg.extra_config, pc.head, pc.name, plugin_lists(cfg))[0]
    except ConfigError as e:
        pc.error = str(e)


def keys_outside_extra_config(path: str) -> list[str]:
    """The plugin options written at the top level of the YAML, as flat keys
    (`storage_plugin.fx.max_capacity_gb: 2` beside chunk_size, or a map
    under a plugin head): LMCache logs 'Unknown configuration key' and drops
    them, and the plugin runs at its defaults; only extra_config reaches a
    plugin."""
    try:
        import yaml

        with open(path) as f:
            top = yaml.safe_load(f) or {}
    except Exception:  # noqa: BLE001 - unreadable: LMCache's own reading says so
        return []
    out = []
    for k, v in (top if isinstance(top, dict) else {}).items():
        if not isinstance(k, str) or k == "extra_config":
            continue
        if _under_a_head(k):
            if isinstance(v, dict):
                out += flat_keys(v, k)
            elif "." in k:  # not storage_plugins: [..], LMCache's own list
                out.append(k)
        else:  # a path under no head (fx.path, fx: {path: ..}): none of LMCache's own keys is one
            out += [f for f in flat_keys(v, k) if "." in f and _gives_path(f)]
    return out


def _under_a_head(key: str) -> bool:
    return key.partition(".")[0].replace("-", "_").rstrip("s") in tuple(h for h, _, _, _ in HEADS)


def _gives_path(key: str) -> bool:
    return key.rpartition(".")[2].lower() in ("path", "paths")


def lost_path(pc: PluginConf, cfg, outside: Sequence[str]) -> str:
    """Why the plugin's store opens at its default path (100 GiB in the home
    directory) though the YAML gives one: a key outside extra_config
    (`outside`, keys_outside_extra_config) gives it, where extra_config gives
    the plugin none; "" otherwise."""
    if f"{pc.prefix}path" in (cfg.extra_config or {}):
        return ""
    lost = [k for k in outside if _gives_path(k) and (k.startswith(pc.prefix) or not _under_a_head(k))]
    if not lost:
        return ""
    default = FxOptions()
    return (
        f"{pc.prefix}path is not set in extra_config, so the store opens at its default ({default.path}, "
        f"{default.max_capacity_gb:g} GiB); {outside_warning(lost[0])}"
    )


def outside_warning(key: str) -> str:
    return (
        f"top-level key '{key}' is no LMCache setting (LMCache logs 'Unknown configuration key' and drops it, "
        "and the plugin runs without it): move it under extra_config"
    )


def load_plugin_configs(path: str) -> tuple[list[PluginConf], list[str]]:
    """lmcache-fx entries of an LMCache YAML with their options or errors
    (used by ls/stat/fsck/gc --config), and plugin_entries' warnings about
    lmcache-fx settings of a name storage_plugins does not list (each with
    its fix). AdminError when unreadable."""
    try:
        cfg = load_lmcache_config(path)
    except ValueError as e:
        raise AdminError(str(e)) from None
    try:
        plugins, warns = plugin_entries(cfg)
    except ConfigError as e:
        raise AdminError(f"{path}: {e}") from None
    outside = keys_outside_extra_config(path)
    for pc in plugins:
        check_plugin(pc, cfg)
        why = lost_path(pc, cfg, outside)
        if why and not pc.error:  # the tools would look at the default store, not the one meant
            pc.options, pc.error = None, why
    return plugins, [outside_warning(k) for k in outside] + warns
