"""auth_key as configured: a key in the environment is taken as the bytes
it holds (a random key need not be UTF-8), and doctor never prints a key
written into the config itself."""

import hashlib
import json
import os
import subprocess
import sys

import yaml

from lmcache_fx.core.options import auth_key_bytes
from lmcache_fx.testing.cpu_engine import fx_config


def test_an_environment_key_that_is_not_utf8_is_its_bytes(tmp_path):
    """Set as `export K="$(head -c 24 /dev/urandom)"` would set it: bytes no
    UTF-8 decoder accepts. Before, encoding os.environ's str raised
    UnicodeEncodeError, naming no option."""
    raw = bytes(range(200, 224))
    code = (
        "import sys; from lmcache_fx.core.options import auth_key_bytes; "
        "sys.stdout.write(auth_key_bytes('env:FX_TEST_KEY').hex())"
    )
    env = {**os.environ}
    env_b = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    env_b[b"FX_TEST_KEY"] = raw
    r = subprocess.run([sys.executable, "-c", code], env=env_b, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == hashlib.blake2b(raw, digest_size=32, person=b"lmcache-fx-key1").hexdigest()
    os.environ["FX_TEST_KEY_UTF8"] = "a key of more than sixteen bytes"
    try:  # a UTF-8 key is the same key as before
        assert (
            auth_key_bytes("env:FX_TEST_KEY_UTF8")
            == hashlib.blake2b(b"a key of more than sixteen bytes", digest_size=32, person=b"lmcache-fx-key1").digest()
        )
    finally:
        del os.environ["FX_TEST_KEY_UTF8"]


def test_doctor_does_not_print_a_key_written_in_the_config(tmp_path):
    from lmcache_fx.tools import doctor

    literal = "S3CRET-literal-key-0123456789"
    for spec, shown in ((literal, False), ("env:SOME_VAR", True)):
        os.environ["SOME_VAR"] = "another key of sixteen bytes or more"
        conf = tmp_path / "lmc.yaml"
        conf.write_text(yaml.safe_dump({**fx_config(tmp_path / "s", auth_key=spec), "max_local_cpu_size": 1}))
        try:
            out = json.dumps(doctor.diagnose(None, str(conf)), default=str)
        finally:
            del os.environ["SOME_VAR"]
        assert (spec in out) == shown, spec
        assert '"auth_key": "' in out  # the setting itself is still reported


def test_a_key_file_over_64_kib_is_refused_not_cut(tmp_path):
    """Two key files that differ only past 64 KiB were one key (the file was
    read up to there); such a file is now refused, naming the option."""
    import pytest

    from lmcache_fx.core.options import ConfigError

    big = tmp_path / "key"
    big.write_bytes(b"k" * ((1 << 16) + 10))
    with pytest.raises(ConfigError, match=r"auth_key: the key file .* is over 64 KiB"):
        auth_key_bytes(f"file:{big}")
    big.write_bytes(b"k" * (1 << 16))
    assert len(auth_key_bytes(f"file:{big}")) == 32
