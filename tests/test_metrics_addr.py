"""The metrics server listens on loopback unless metrics_addr says otherwise
(its page names store paths), and metrics_addr is checked by name."""

import socket

import pytest

from lmcache_fx.core import metrics
from lmcache_fx.core.options import ConfigError, FxOptions


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bound_address(port):
    server = metrics._servers[port][0]
    return server.server_address[0]


def test_metrics_listen_on_loopback_by_default():
    assert FxOptions().metrics_addr == "127.0.0.1"
    port = _free_port()
    h = metrics.start_metrics(lambda: {}, name="t-default", port=port)
    try:
        assert h.port == port and _bound_address(port) == "127.0.0.1"
    finally:
        h.close()


def test_metrics_addr_is_passed_through():
    port = _free_port()
    h = metrics.start_metrics(lambda: {}, name="t-any", port=port, addr="0.0.0.0")
    try:
        assert _bound_address(port) == "0.0.0.0"
    finally:
        h.close()


@pytest.mark.parametrize("bad", ["localhost:80", "999.1.1.1", "", 5])
def test_bad_metrics_addr_names_the_option(bad):
    with pytest.raises(ConfigError, match=r"x\.metrics_addr: expected an IP address"):
        FxOptions.from_mapping({"metrics_addr": bad}, where="x.")
