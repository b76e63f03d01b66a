"""The option table: every option documented in README.md with its default,
and values parsed or refused with the option's name."""

import math
import os
import re

import pytest

from lmcache_fx.core.options import ConfigError, FxOptions

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_every_option_is_in_the_readme_table():
    text = open(README).read()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| `([^`]*)` \|", text, re.M))
    cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in text.splitlines() if re.match(r"^\| `[a-z_]+` \| `", line)]
    values = {c[0].strip(" `"): c[2] for c in cells}
    for name in FxOptions.names():
        assert name in rows, f"option {name} missing from README's table"
        default = getattr(FxOptions(), name)
        # the values column is the table's own text, modulo markdown backticks
        assert values[name].replace("`", "").replace("\\|", "|").strip() == FxOptions.doc()[name][1], name
        shown = rows[name]
        if isinstance(default, bool):
            assert shown == str(default).lower()
        elif name == "split_bytes":
            assert shown == f"{default >> 20}M"
        elif name == "path":
            assert shown == "~/.cache/lmcache-fx" and default == os.path.expanduser(shown)
        else:
            assert float(shown) == float(default) if isinstance(default, float) else shown == str(default)


@pytest.mark.parametrize(
    "value,expected",
    [("4M", 4 << 20), ("2MiB", 2 << 20), (65536, 65536), ("128K", 128 << 10), ("1Mi", 1 << 20), ("512Ki", 512 << 10)],
)
def test_sizes_with_suffixes(value, expected):
    assert FxOptions.from_mapping({"split_bytes": value}).split_bytes == expected


@pytest.mark.parametrize("value", ["1i", "Mi", "1Xi"])
def test_a_lone_i_is_no_unit(value):
    with pytest.raises(ConfigError, match=r"split_bytes: expected bytes like 1048576 or '1M'"):
        FxOptions.from_mapping({"split_bytes": value})


@pytest.mark.parametrize("value", ["4096.5", "8191.9", "1.0000001M"])
def test_a_size_string_with_a_fraction_of_a_byte_is_refused_not_truncated(value):
    """'4096.5' was taken as 4096 (a number 4096.5 is refused), and '8191.9'
    was refused as 8191, a value the user never wrote."""
    with pytest.raises(ConfigError, match=rf"split_bytes: expected a whole number of bytes, got '{value}'"):
        FxOptions.from_mapping({"split_bytes": value})
    assert FxOptions.from_mapping({"split_bytes": "1.5M"}).split_bytes == 3 << 19


@pytest.mark.parametrize("value,expected", [("true", True), ("False", False), (True, True), (0, False), ("on", True)])
def test_booleans(value, expected):
    assert FxOptions.from_mapping({"verify": value}).verify is expected


def test_unknown_option_suggests_the_close_name():
    with pytest.raises(ConfigError, match=r"unknown option 'x\.verfy': did you mean 'x\.verify'\?"):
        FxOptions.from_mapping({"verfy": True}, where="x.")


def test_paths_split_and_strip():
    assert FxOptions.from_mapping({"path": " /a , /b ,"}).paths == ["/a", "/b"]
    with pytest.raises(ConfigError, match="path: no directory given"):
        FxOptions.from_mapping({"path": " , "})


def engine_setting(tmp_path, values: dict, attr: str):
    """The C engine's `attr` in a store opened with these option values."""
    from lmcache_fx.core.store import ChunkStore

    store = ChunkStore(FxOptions.from_mapping({"path": str(tmp_path / f"s{len(os.listdir(tmp_path))}"), **values}))
    try:
        return getattr(store.engine, attr)
    finally:
        store.close()


def test_awaited_concurrency_reaches_the_engine_and_is_checked(tmp_path):
    """awaited_concurrency goes from the option table to the C engine the
    store builds as its max_running: auto (the default) the CPUs the process
    may run on, or the number set; out of 0..1024 it is refused, naming the
    option and both kinds of value."""
    from lmcache_fx.core.drive import usable_cpus

    cpus = usable_cpus()
    assert FxOptions().awaited_concurrency == "auto"
    for values, want in (({}, cpus), ({"awaited_concurrency": " Auto "}, cpus), ({"awaited_concurrency": 0}, 0)):
        assert engine_setting(tmp_path, values, "max_running") == want
    assert engine_setting(tmp_path, {"awaited_concurrency": "3"}, "max_running") == 3
    with pytest.raises(ConfigError, match=r"x\.awaited_concurrency: 2000 is out of range \[0, 1024\] \(or auto\)"):
        FxOptions.from_mapping({"awaited_concurrency": 2000}, where="x.")


def test_whole_reads_when_busy_reaches_the_engine(tmp_path):
    """whole_reads_when_busy (default true) is the engine's whole_when_busy;
    a value that is not a boolean is refused, naming the option."""
    assert FxOptions().whole_reads_when_busy is True
    assert engine_setting(tmp_path, {}, "whole_when_busy") is True
    assert engine_setting(tmp_path, {"whole_reads_when_busy": "false"}, "whole_when_busy") is False
    with pytest.raises(ConfigError, match="whole_reads_when_busy"):
        FxOptions.from_mapping({"whole_reads_when_busy": "sometimes"})


def test_whole_read_bound_is_the_one_its_help_quotes():
    """The bound on whole reads lives in csrc/fxio.h (FX_WHOLE_MAX); the
    option's help (core/options.py does not load the C module, so it cannot
    read it), the engine attribute's doc and the stubs quote it in MiB, and
    must change with it."""
    from lmcache_fx import _fxio

    mib = _fxio.WHOLE_MAX >> 20
    assert mib << 20 == _fxio.WHOLE_MAX > 0
    said = f"at most {mib} MiB"
    assert said in FxOptions.doc()["whole_reads_when_busy"][0]
    assert said in _fxio.Engine.whole_when_busy.__doc__
    with open(os.path.join(os.path.dirname(README), "lmcache_fx", "_fxio.pyi")) as f:
        stubs = " ".join(f.read().split())
    assert stubs.count(f"payload of {said}") == 1 and stubs.count(f"payloads of {said}") == 1


def test_awaited_concurrency_auto_keeps_to_a_containers_cpu_limit(tmp_path):
    """auto counts the CPUs the process may use: a container's CPU limit
    (cgroup v2 cpu.max, v1 CFS quota over period) where one is set, read
    from files laid out as the kernel lays them out (here under tmp_path)."""
    from lmcache_fx.core.drive import cgroup_cpu_limit, usable_cpus

    def tree(proc_line: str, files: dict) -> tuple[str, str]:
        root = tmp_path / f"t{len(os.listdir(tmp_path))}"
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text + "\n")
        (root / "proc").write_text(proc_line + "\n")
        return str(root / "sys"), str(root / "proc")

    cases = [
        ("0::/kubepods/pod1", {"sys/kubepods/pod1/cpu.max": "250000 100000"}, 2.5),
        ("0::/", {"sys/cpu.max": "max 100000"}, None),  # unlimited
        ("0::/x", {"sys/cpu.max": "150000 100000"}, 1.5),  # a namespace: the container's cgroup at the root
        (
            "4:cpu,cpuacct:/docker/abc",
            {
                "sys/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "400000",
                "sys/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            },
            4.0,
        ),
        ("3:cpu:/docker/abc", {"sys/cpu/cpu.cfs_quota_us": "50000", "sys/cpu/cpu.cfs_period_us": "100000"}, 0.5),
        ("3:cpu:/", {"sys/cpu/cpu.cfs_quota_us": "-1", "sys/cpu/cpu.cfs_period_us": "100000"}, None),
        ("4:memory:/m", {"sys/memory/m/memory.max": "max"}, None),  # no cpu controller listed
        # not as the kernel writes them: skipped, never an error that would stop the store opening
        ("garbage\n0::/k", {"sys/k/cpu.max": "200000 100000"}, 2.0),
        ("0::/", {"sys/cpu.max": "lots 100000"}, None),
        ("3:cpu:/", {"sys/cpu/cpu.cfs_quota_us": "50000", "sys/cpu/cpu.cfs_period_us": "0"}, None),
    ]
    for line, files, want in cases:
        assert cgroup_cpu_limit(*tree(line, files)) == want, line
    assert cgroup_cpu_limit(str(tmp_path / "none"), str(tmp_path / "no-such-proc")) is None
    cpus = usable_cpus()
    assert 1 <= cpus <= len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    assert cpus == (
        min(len(os.sched_getaffinity(0)), max(1, math.ceil(limit))) if limit else len(os.sched_getaffinity(0))
    )


def test_runner_nice_reaches_the_engine_and_is_checked(tmp_path):
    """runner_nice goes from the option table to the C engine the store
    builds (the default 10, or what is set); out of 0..19 it is refused,
    naming the option."""
    for values, want in (({}, 10), ({"runner_nice": 0}, 0), ({"runner_nice": "3"}, 3)):
        assert engine_setting(tmp_path, values, "runner_nice") == want
    with pytest.raises(ConfigError, match=r"x\.runner_nice: 20 is out of range \[0, 19\]"):
        FxOptions.from_mapping({"runner_nice": 20}, where="x.")


def test_an_option_name_that_is_not_a_string_is_named_in_the_error():
    """A key YAML parsed as a number: a ConfigError that names it and the fix,
    not a TypeError; in LMCache's extra_config such a key is nobody's option."""
    with pytest.raises(ConfigError, match=r"option name 'storage_plugin.fx.1' is not a string: quote it"):
        FxOptions.from_mapping({"path": "/tmp/x", 1: 2}, where="storage_plugin.fx.")
    from lmcache_fx.core.options import options_from_extra

    o = options_from_extra({"storage_plugin.fx.path": "/tmp/x", 5: "y"}, "storage_plugin.fx.")
    assert o.paths == ["/tmp/x"]


def test_a_path_with_a_tilde_is_the_home_directory_as_the_tools_read_it(tmp_path, monkeypatch):
    """path: ~/... (the README's default is written so) made a directory
    named '~' under the current one, where the tools (which expand it)
    looked in the home directory. The store expands it too."""
    from lmcache_fx.core.store import ChunkStore

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert FxOptions.from_mapping({"path": "~/fx, /b"}).paths == [str(tmp_path / "home" / "fx"), "/b"]
    s = ChunkStore(FxOptions.from_mapping({"path": "~/fx"}))
    try:
        assert s.roots == [str(tmp_path / "home" / "fx")] and not (tmp_path / "~").exists()
    finally:
        s.close()


def test_a_directory_listed_twice_is_refused():
    """path: /a,/a was taken: every chunk was counted once per mention after a
    restart (the capacity cut to a half). Refused, naming the directory."""
    with pytest.raises(ConfigError, match=r"path: /a given more than once; list each directory once"):
        FxOptions.from_mapping({"path": "/a, /b, /a/"})


def test_misspelt_plugin_keys_are_named_with_the_fix():
    """A key meant for the plugin under a misspelt prefix or an unlisted name
    was ignored without a word, and the store ran at its defaults (the home
    directory, 100 GB). Each such key is named, with what LMCache reads."""
    from lmcache_fx.core.options import stray_plugin_keys

    extra = {
        "storage_plugin.fx.module_path": "lmcache_fx.lmcache_plugin",
        "storage_plugin.fx.path": "/ok",
        "storage_plugins.fx.path": "/nvme",
        "storage_plugin.fx_.max_capacity_gb": 1,
        "storage_plugin.other.thing": 2,  # another listed plugin's: not ours to judge
        "remote_url": "x",
        1: 2,
    }
    out = stray_plugin_keys(extra, ["fx", "other"])
    assert len(out) == 2
    assert "'storage_plugins.fx.path'" in out[0] and "rename it to 'storage_plugin.fx.path'" in out[0]
    assert "'storage_plugin.fx_.max_capacity_gb'" in out[1] and "no plugin 'fx_' in storage_plugins" in out[1]


def test_config_tool_names_misspelt_keys_and_takes_non_string_keys(tmp_path):
    """lmcache-fx's --config reader: a non-string extra_config key crashed it
    with a traceback; misspelt plugin keys were not named. Now both are
    handled, the warning naming the key."""
    from lmcache_fx.tools.lmcache_config import plugin_entries

    class Cfg:
        storage_plugins = ["fx"]
        extra_config = {
            1: 2,
            "storage_plugin.fx.module_path": "lmcache_fx.lmcache_plugin",
            "storage_plugin.fx.class_name": "FxStorageBackend",
            "storage_plugins.fx.path": "/nvme",
        }

    entries, warns = plugin_entries(Cfg())
    assert [e.name for e in entries] == ["fx"]
    assert len(warns) == 1 and "'storage_plugins.fx.path'" in warns[0]


def test_staged_reads_true_that_cannot_apply_says_why(tmp_path, caplog):
    """staged_reads: true with the thread engine (or verify off, or no
    O_DIRECT) was dropped without a word, where mapped_reads: true and
    odirect: true refuse; it warns now, saying why."""
    import logging

    from lmcache_fx.core.store import ChunkStore

    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        s = ChunkStore(
            FxOptions.from_mapping({"path": str(tmp_path / "s"), "staged_reads": "true", "io_engine": "threads"})
        )
    try:
        assert not s.staged_reads
        said = [r.getMessage() for r in caplog.records if "staged_reads: true has no effect" in r.getMessage()]
        assert len(said) == 1 and "the thread engine reads in place" in said[0]
    finally:
        s.close()


def test_odirect_fallback_on_a_device_warns_once(tmp_path, caplog, monkeypatch):
    """A filesystem that refuses O_DIRECT (not a memory filesystem) fell back
    to buffered I/O at info level: unseen at Python's default WARNING. One
    warning now, saying why."""
    import logging

    from lmcache_fx.core import medium, once
    from lmcache_fx.core import store as store_mod

    monkeypatch.setattr(store_mod, "probe_odirect", lambda root: (False, "Invalid argument"))
    monkeypatch.setattr(medium, "page_cache_fs", lambda roots: False)
    monkeypatch.setattr(once, "_said", set())
    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        # Two stores on one path (the plugin and an L2 adapter, two engines): one warning, not one each.
        stores = [store_mod.ChunkStore(FxOptions.from_mapping({"path": str(tmp_path / "s")})) for _ in range(2)]
    try:
        said = [r for r in caplog.records if "O_DIRECT not supported" in r.getMessage()]
        assert not any(s.odirect for s in stores) and len(said) == 1 and said[0].levelno == logging.WARNING
        assert "Invalid argument" in said[0].getMessage()
    finally:
        for s in stores:
            s.close()


def test_plugin_options_written_as_a_nested_map_are_refused_with_the_flat_keys():
    """storage_plugin: {fx: {path: ..}} looks right in YAML, but LMCache reads
    flat keys only: the plugin opened ~/.cache/lmcache-fx at 100 GB without a
    word, and doctor said OK. Refused now, naming the flat keys to write."""
    from lmcache_fx.core.options import stray_plugin_keys

    nested = {"storage_plugin": {"fx": {"path": "/nvme", "max_capacity_gb": 5}}}
    with pytest.raises(ConfigError, match=r"'storage_plugin' holds a map.*'storage_plugin\.fx\.path'"):
        stray_plugin_keys(nested, ["fx"])
    with pytest.raises(ConfigError, match=r"'storage_plugin\.fx\.max_capacity_gb'"):
        stray_plugin_keys({"storage_plugin.fx": {"max_capacity_gb": 5}}, ["fx"])
    with pytest.raises(ConfigError, match=r"'remote_storage_plugin\.fx\.path'"):
        stray_plugin_keys({"remote_storage_plugins": {"fx": {"path": "/a"}}}, ["fx"], "remote_storage_plugin")


def test_dotted_plugin_names_and_the_remote_prefix_are_judged_like_the_rest():
    """A listed name with a dot in it (fx.nvme) drew a false 'no plugin fx'
    warning for each of its keys; the remote plugin's keys were never
    judged, so a plural or unlisted prefix left it at its defaults."""
    from lmcache_fx.core.options import stray_plugin_keys

    ok = {"storage_plugin.fx.nvme.path": "/a", "storage_plugin.fx.nvme.max_capacity_gb": 5}
    assert stray_plugin_keys(ok, ["fx.nvme"]) == []
    remote = {
        "remote_storage_plugin.fx.path": "/a",
        "remote_storage_plugins.fx.max_capacity_gb": 1,
        "remote_storage_plugin.fxx.path": "/b",
        "storage_plugin.fx.path": "/c",  # the in-process plugin's: not judged under the remote head
    }
    out = stray_plugin_keys(remote, ["fx"], "remote_storage_plugin")
    assert len(out) == 2, out
    assert "rename it to 'remote_storage_plugin.fx.max_capacity_gb'" in out[0]
    assert "no plugin 'fxx' in remote_storage_plugins" in out[1]


def test_config_tools_read_remote_entries_and_name_a_class_in_the_wrong_list():
    """doctor and ls/stat/fsck/gc --config read only storage_plugins: the
    documented remote_storage_plugins YAML was 'no lmcache-fx plugin'. And
    FxRemoteConnector copied under storage_plugins passed the check, then
    failed in LMCache with a TypeError naming no fix."""
    from lmcache_fx.tools.lmcache_config import check_plugin, plugin_entries

    class Remote:
        storage_plugins: list = []
        remote_storage_plugins = ["fx"]
        extra_config = {
            "remote_storage_plugin.fx.module_path": "lmcache_fx.remote_plugin",
            "remote_storage_plugin.fx.class_name": "FxRemoteConnector",
            "remote_storage_plugin.fx.path": "/mnt/nvmeof/lmcache",
            "remote_storage_plugin.fx.max_capacity_gb": 2000,
        }

    entries, warns = plugin_entries(Remote())
    assert [(e.name, e.head) for e in entries] == [("fx", "remote_storage_plugin")] and warns == []
    check_plugin(entries[0], Remote())
    assert not entries[0].error and entries[0].options.max_capacity_gb == 2000

    class Misplaced:
        storage_plugins = ["fx"]
        extra_config = {
            "storage_plugin.fx.module_path": "lmcache_fx.remote_plugin",
            "storage_plugin.fx.class_name": "FxRemoteConnector",
        }

    entries, _ = plugin_entries(Misplaced())
    check_plugin(entries[0], Misplaced())
    assert "belongs under remote_storage_plugins" in entries[0].error
    assert "use lmcache_fx.lmcache_plugin / FxStorageBackend" in entries[0].error


def test_the_remote_and_l2_classes_built_as_a_storage_plugin_say_where_they_belong():
    """LMCache builds a storage_plugins entry with dst_device=...: the remote
    connector and the L2 adapter raised a bare TypeError."""
    from lmcache_fx.l2_adapter import FxL2Adapter
    from lmcache_fx.remote_plugin import FxRemoteConnector

    kw = dict(config=None, dst_device="cpu", metadata=None, local_cpu_backend=None, loop=None)
    with pytest.raises(ConfigError, match="belongs under remote_storage_plugins"):
        FxRemoteConnector(**kw)
    with pytest.raises(ConfigError, match="MP-mode L2 adapter.*under storage_plugins use lmcache_fx.lmcache_plugin"):
        FxL2Adapter(**kw)


def test_l2_adapter_settings_of_lmcache_in_adapter_params_and_a_defaulted_path(caplog):
    """LMCache's own adapter keys put in adapter_params got 'unknown option'
    without the fix; fx options put beside "type" (which LMCache drops)
    left the store at its default path without a word."""
    import logging

    from lmcache_fx.l2_adapter import FxL2AdapterConfig

    with pytest.raises(ConfigError, match=r'adapter_params.eviction: an LMCache setting.*beside "type"'):
        FxL2AdapterConfig.from_dict({"path": "/tmp/x", "eviction": {"policy": "LRU"}})
    with caplog.at_level(logging.WARNING, logger="lmcache_fx"):
        FxL2AdapterConfig.from_dict({"max_capacity_gb": 5})
    said = [r.getMessage() for r in caplog.records if "adapter_params gives no path" in r.getMessage()]
    assert len(said) == 1 and 'not beside "type"' in said[0]


def test_a_map_valued_option_of_another_listed_plugin_is_left_alone():
    """The nested-map check refused any map under the head, also a listed
    plugin's own <head>.<name>.<option> with a map value (its business):
    lmcache-fx then failed to start beside it."""
    from lmcache_fx.core.options import stray_plugin_keys

    extra = {"storage_plugin.fx.path": "/x", "storage_plugin.other.headers": {"a": 1}}
    assert stray_plugin_keys(extra, ["fx", "other"]) == []


def test_a_key_file_under_home_and_a_capacity_with_a_unit(tmp_path, monkeypatch):
    """auth_key: file:~/key was read as a file named '~' (path expands ~);
    max_capacity_gb: "10GB" said 'expected a number' without the unit."""
    from lmcache_fx.core.options import auth_key_bytes

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "key").write_bytes(b"k" * 32 + b"\n")
    assert auth_key_bytes("file:~/key") == auth_key_bytes("k" * 32)
    with pytest.raises(ConfigError, match=r"max_capacity_gb: expected a number of GiB \(no unit: 10 means 10 GiB\)"):
        FxOptions.from_mapping({"max_capacity_gb": "10GB"})


def test_errors_the_store_raises_at_start_name_the_full_key(tmp_path):
    """A path that is a file, or mapped_reads: true off tmpfs, was refused as
    'path: ...' or 'mapped_reads: ...': with two plugins, or under the remote
    or L2 prefix, that did not say which key. The adapters name the full key."""
    from lmcache_fx.integration.common import open_store
    from lmcache_fx.l2_adapter import FxL2Adapter, FxL2AdapterConfig

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=r"^adapter_params\.path: .* is not a directory"):
        FxL2Adapter(FxL2AdapterConfig.from_dict({"path": str(afile)}))
    with pytest.raises(ConfigError, match=r"^storage_plugin\.fast\.path: "):
        open_store(FxOptions.from_mapping({"path": str(afile)}), "storage_plugin.fast.")


def test_no_path_of_its_own_while_an_ignored_key_gives_one_is_refused():
    """Options under a misspelt name, a plural head or the other plugin list's
    head left the plugin at its defaults: a 100 GiB store in the home
    directory, the meant path unused (the remote plugin said nothing). With
    no path of its own and an ignored key giving one, the plugin stops,
    naming the key and the fix."""
    from lmcache_fx.core.options import plugin_options

    remote_opts_as_local = {
        "remote_storage_plugin.fx.module_path": "lmcache_fx.remote_plugin",
        "storage_plugin.fx.path": "/nvme/store",
    }
    lists = {"storage_plugin": [], "remote_storage_plugin": ["fx"]}
    with pytest.raises(ConfigError) as e:
        plugin_options(remote_opts_as_local, "remote_storage_plugin", "fx", lists)
    said = str(e.value)
    assert said.startswith("remote_storage_plugin.fx.path is not set, so the store would open at its default (")
    assert "100 GiB" in said and "rename it to 'remote_storage_plugin.fx.path'" in said
    for extra, listed in (
        ({"storage_plugin.fxx.path": "/nvme"}, ["fx"]),
        ({"storage_plugins.fx.path": "/nvme"}, ["fx"]),
        ({"remote_storage_plugin.fx.path": "/nvme"}, ["fx"]),
    ):
        with pytest.raises(ConfigError, match=r"^storage_plugin\.fx\.path is not set"):
            plugin_options(extra, "storage_plugin", "fx", {"storage_plugin": listed})
    # With a path of its own, ignored keys are warnings: they may be another plugin's
    opts, warns = plugin_options(
        {"storage_plugin.fx.path": "/a", "storage_plugin.fxx.path": "/b"},
        "storage_plugin",
        "fx",
        {"storage_plugin": ["fx"]},
    )
    assert opts.paths == ["/a"] and len(warns) == 1 and "'storage_plugin.fxx.path'" in warns[0]
    # A nested map under the other head is the other plugin's to refuse: a warning here
    opts, warns = plugin_options(
        {"storage_plugin.fx.path": "/a", "remote_storage_plugin": {"x": {"path": "/b"}}},
        "storage_plugin",
        "fx",
        {"storage_plugin": ["fx"]},
    )
    assert opts.paths == ["/a"] and len(warns) == 1 and "holds a map" in warns[0]
    # Ignored keys that give no path leave the defaults, with a warning (as before)
    opts, warns = plugin_options(
        {"storage_plugin.fxx.verify": False}, "storage_plugin", "fx", {"storage_plugin": ["fx"]}
    )
    assert opts.verify and len(warns) == 1


def test_each_config_warning_is_logged_once_however_many_plugins_read_it(tmp_path, caplog):
    """Two lmcache-fx plugins in one config each logged every stray-key
    warning: the same lines twice."""
    from lmcache_fx.integration import common
    from lmcache_fx.testing.cpu_engine import config_from_dict, fx_config

    d = fx_config(tmp_path / "a", name="fx")
    d["storage_plugins"] = ["fx", "fy"]
    d["extra_config"].update(
        {
            "storage_plugin.fy.module_path": "lmcache_fx.lmcache_plugin",
            "storage_plugin.fy.class_name": "FxStorageBackend",
            "storage_plugin.fy.path": str(tmp_path / "b"),
            f"storage_plugin.stray{os.getpid()}.verify": False,
        }
    )
    cfg = config_from_dict(d, tmp_path)
    with caplog.at_level("WARNING", logger="lmcache_fx"):
        a = common.configured_options(cfg, "storage_plugin", "fx")
        b = common.configured_options(cfg, "storage_plugin", "fy")
    said = [r.getMessage() for r in caplog.records if f"stray{os.getpid()}" in r.getMessage()]
    assert a.paths == [str(tmp_path / "a")] and b.paths == [str(tmp_path / "b")]
    assert len(said) == 1, said


def test_a_relative_path_or_an_unset_variable_is_refused_and_a_set_one_expanded(monkeypatch):
    """A relative path was resolved against the server's working directory,
    where doctor and the tools resolved it against theirs (they looked at
    another directory); '$HOME/fx' made a directory literally named '$HOME'
    under it."""
    monkeypatch.setenv("FX_STORE_TOP", "/nvme")
    monkeypatch.delenv("FX_NO_SUCH_VAR", raising=False)
    assert FxOptions.from_mapping({"path": "$FX_STORE_TOP/a, ${FX_STORE_TOP}/b"}).paths == ["/nvme/a", "/nvme/b"]
    with pytest.raises(ConfigError, match=r"x\.path: 'relstore' is relative, .* give an absolute path"):
        FxOptions.from_mapping({"path": "relstore"}, where="x.")
    with pytest.raises(ConfigError, match=r"path: '\$FX_NO_SUCH_VAR/a': \$FX_NO_SUCH_VAR is not set"):
        FxOptions.from_mapping({"path": "$FX_NO_SUCH_VAR/a"})
    assert FxOptions.from_mapping({"path": "/mnt/price$1"}).paths == ["/mnt/price$1"]  # no variable's name


def test_a_size_with_a_unit_where_a_number_of_mib_goes_says_the_unit():
    """'gpu_buffer_mib: 2Gi' said only "expected an integer"; the _gb options
    said their unit, the _mib ones did not."""
    with pytest.raises(ConfigError, match=r"gpu_buffer_mib: expected an integer of MiB \(no unit: 2048 means 2 GiB\)"):
        FxOptions.from_mapping({"gpu_buffer_mib": "2Gi"})


def test_a_path_under_no_plugin_head_is_refused_where_the_plugin_has_none():
    """`path: /nvme`, `fx.path: /nvme` or `fx: {path: /nvme}` in extra_config
    were dropped without a word (LMCache passes a plugin only its
    <head>.<name>.<option> keys), and the store opened at its default: 100 GiB
    in the home directory. They stop the plugin now, naming the key and the
    fix; LMCache's own *_path keys and a plugin with a path of its own are
    left alone."""
    from lmcache_fx.core.options import plugin_options

    lists = {"storage_plugin": ["fx"], "remote_storage_plugin": []}
    for extra, named in (
        ({"path": "/nvme"}, "extra_config key 'path' gives a path"),
        ({"fx.path": "/nvme"}, "extra_config key 'fx.path' gives a path"),
        ({"fx": {"path": "/nvme", "verify": True}}, "extra_config key 'fx' holds a map giving 'fx.path'"),
        ({"lmcache_fx": {"store": {"Path": "/nvme"}}}, "holds a map giving 'lmcache_fx.store.Path'"),
        ({"fx.paths": "/nvme"}, "extra_config key 'fx.paths' gives a path"),
    ):
        with pytest.raises(ConfigError) as e:
            plugin_options(
                {"storage_plugin.fx.module_path": "lmcache_fx.lmcache_plugin", **extra}, "storage_plugin", "fx", lists
            )
        said = str(e.value)
        assert said.startswith("storage_plugin.fx.path is not set, so the store would open at its default ("), said
        assert named in said and "'storage_plugin.fx.path'" in said, said
    for extra in ({"rust_raw_block.device_path": "/dev/nvme0n1"}, {"dax.device_path": "/dev/dax0.0"}):
        opts, warns = plugin_options(extra, "storage_plugin", "fx", lists)
        assert warns == [] and opts.path == FxOptions().path
    opts, warns = plugin_options({"storage_plugin.fx.path": "/a", "path": "/b"}, "storage_plugin", "fx", lists)
    assert opts.path == "/a"


def test_lmcache_own_settings_among_the_plugins_options_are_said_as_such():
    """storage_plugin.fx.chunk_size was refused with the list of fx's options
    only: the operator was not told that chunk_size is LMCache's own setting,
    set at the top level. Each name so treated is one LMCache has."""
    import dataclasses

    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_fx.core.options import LMCACHE_OWN_KEYS

    with pytest.raises(ConfigError) as e:
        FxOptions.from_mapping({"path": "/nvme", "chunk_size": 256}, "storage_plugin.fx.")
    assert str(e.value) == (
        "unknown option 'storage_plugin.fx.chunk_size': chunk_size is LMCache's own setting; set it at the top "
        "level of the LMCache config, not among the plugin's options"
    )
    assert LMCACHE_OWN_KEYS <= {f.name for f in dataclasses.fields(LMCacheEngineConfig)}
    assert not LMCACHE_OWN_KEYS & {f.name for f in dataclasses.fields(FxOptions)}
