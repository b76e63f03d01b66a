"""The lmcache-fx entries of an LMCache YAML and their options, as LMCache
itself would read them (LMCache is imported only to parse the file)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from ..core.options import ConfigError, FxOptions, options_from_extra, stray_plugin_keys
from .common import AdminError

PLUGIN_MODULE = "lmcache_fx.lmcache_plugin"
PLUGIN_CLASS = "FxStorageBackend"


@dataclass
class PluginConf:
    """One lmcache-fx entry of an LMCache config."""

    name: str
    module_path: str
    class_name: str
    options: Optional[FxOptions] = None
    error: str = ""


def load_lmcache_config(path: str):
    """LMCacheEngineConfig exactly as LMCache builds it: the file, then
    LMCACHE_* environment overrides. Raises ValueError with a clear line."""
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
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
    """The lmcache-fx entries of storage_plugins, and warnings about
    storage_plugin.<name>.* settings LMCache will ignore."""
    extra = cfg.extra_config or {}
    listed = list(cfg.storage_plugins or [])
    out, warns = [], []
    for n in listed:
        mp, cn = _names(extra, n)
        if _is_ours(mp, cn):
            out.append(PluginConf(n, mp, cn))
    named = {
        k.split(".")[1] for k in extra if isinstance(k, str) and k.startswith("storage_plugin.") and k.count(".") >= 2
    }
    ours_unlisted = set()
    for n in sorted(named - set(listed)):
        if _is_ours(*_names(extra, n)):
            ours_unlisted.add(n)
            warns.append(
                f"extra_config has storage_plugin.{n}.* but storage_plugins does not list '{n}': "
                f"LMCache will not load it (add it: storage_plugins: [{n!r}])"
            )
    said = tuple(f"storage_plugin.{n}." for n in ours_unlisted)  # warned of above, with their own fix
    warns += stray_plugin_keys(
        {k: v for k, v in extra.items() if not (isinstance(k, str) and k.startswith(said))}, listed
    )
    return out, warns


def _names(extra: dict, name: str) -> tuple[str, str]:
    """module_path and class_name of storage_plugin.<name>."""
    return (
        str(extra.get(f"storage_plugin.{name}.module_path") or ""),
        str(extra.get(f"storage_plugin.{name}.class_name") or ""),
    )


def _is_ours(module_path: str, class_name: str) -> bool:
    """Whether a storage_plugin.<name> entry means lmcache-fx."""
    return "lmcache_fx" in module_path or class_name == PLUGIN_CLASS


def check_plugin(pc: PluginConf, cfg) -> None:
    """What LMCache does before the constructor, then the plugin's own option
    parsing: fills pc.options or pc.error."""
    if not pc.module_path or not pc.class_name:
        pc.error = (
            f"storage_plugin.{pc.name}.module_path and .class_name must both be set "
            f"({PLUGIN_MODULE} / {PLUGIN_CLASS}); LMCache skips the plugin otherwise"
        )
        return
    import importlib

    try:
        mod = importlib.import_module(pc.module_path)
        getattr(mod, pc.class_name)
    except Exception as e:  # noqa: BLE001
        pc.error = (
            f"LMCache cannot load {pc.module_path}.{pc.class_name}: {type(e).__name__}: {e} "
            f"(expected {PLUGIN_MODULE} / {PLUGIN_CLASS})"
        )
        return
    try:
        pc.options = options_from_extra(cfg.extra_config, f"storage_plugin.{pc.name}.")
    except ConfigError as e:
        pc.error = str(e)


def load_plugin_configs(path: str) -> tuple[list[PluginConf], list[str]]:
    """lmcache-fx entries of an LMCache YAML with their options or errors
    (used by ls/stat/fsck/gc --config), and plugin_entries' warnings about
    lmcache-fx settings of a name storage_plugins does not list (each with
    its fix). AdminError when unreadable."""
    try:
        cfg = load_lmcache_config(path)
    except ValueError as e:
        raise AdminError(str(e)) from None
    plugins, warns = plugin_entries(cfg)
    for pc in plugins:
        check_plugin(pc, cfg)
    return plugins, warns
