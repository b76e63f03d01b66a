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


def test_stalled_clients_hold_no_more_than_a_few_threads_and_not_for_long(monkeypatch):
    """Clients that connect and never finish a request: at most MAX_CLIENTS
    of them get a thread at once (the rest are refused) and each is dropped
    after CLIENT_TIMEOUT_S; then a scrape is served again. Before, each got
    a thread with no timeout, kept after close()."""
    import threading
    import time
    import urllib.request

    monkeypatch.setattr(metrics, "CLIENT_TIMEOUT_S", 0.5)
    port = _free_port()
    h = metrics.start_metrics(lambda: {"hits": 3}, name="t-stall", port=port)
    clients = []
    try:

        def handlers():
            return sum(t.name.startswith("Thread") and "process_request" in t.name for t in threading.enumerate())

        for _ in range(3 * metrics.MAX_CLIENTS):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            clients.append(c)
        time.sleep(0.2)
        assert 0 < handlers() <= metrics.MAX_CLIENTS
        end = time.monotonic() + 10
        while handlers() and time.monotonic() < end:
            time.sleep(0.05)
        assert handlers() == 0  # each dropped after its timeout
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "lmcache_fx_hits_total" in body
    finally:
        for c in clients:
            c.close()
        h.close()


def test_clients_trickling_a_byte_at_a_time_are_dropped_at_a_total_deadline(monkeypatch):
    """MAX_CLIENTS clients each sending a header byte every 0.2 s (well
    inside the 0.5 s timeout per receive) lose their slots once their
    request has taken CLIENT_TIMEOUT_S in all, and a scrape is served. Before,
    the timeout applied per receive: they held every slot for as long as
    they trickled, and scrapes were refused."""
    import time
    import urllib.request

    monkeypatch.setattr(metrics, "CLIENT_TIMEOUT_S", 0.5)
    port = _free_port()
    h = metrics.start_metrics(lambda: {"hits": 3}, name="t-trickle", port=port)
    clients = []
    try:
        for _ in range(metrics.MAX_CLIENTS):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            clients.append(c)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # one byte of a header line each, every 0.2 s
            for c in clients:
                try:
                    c.sendall(b"X")
                except OSError:
                    pass
            time.sleep(0.2)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "lmcache_fx_hits_total" in body
    finally:
        for c in clients:
            c.close()
        h.close()


def test_a_second_store_asking_another_address_of_a_shared_port_is_told(caplog):
    """Stores of one process share a metrics port; a second one asking for
    0.0.0.0 where the first listens on loopback silently got loopback."""
    port = _free_port()
    a = metrics.start_metrics(lambda: {}, name="t-first", port=port)
    try:
        with caplog.at_level("WARNING", logger="lmcache_fx"):
            b = metrics.start_metrics(lambda: {}, name="t-second", port=port, addr="0.0.0.0")
        b.close()
        said = [r.getMessage() for r in caplog.records]
        assert any(f"metrics_port {port} is served on 127.0.0.1 already" in m and "0.0.0.0" in m for m in said), said
        assert _bound_address(port) == "127.0.0.1"
    finally:
        a.close()


def test_a_store_starting_while_the_last_one_on_its_port_closes_still_serves():
    """close() took the server out of the table, then shut it down (up to
    its 0.5 s poll) outside the lock: a store starting on that port meanwhile
    found no server, could not bind (the old socket still listening) and ran
    with its metrics off."""
    import threading
    import time

    port = _free_port()
    old = metrics.start_metrics(lambda: {}, name="t-old", port=port)
    t = threading.Thread(target=old.close)
    t.start()
    time.sleep(0.02)  # inside the old server's shutdown
    new = metrics.start_metrics(lambda: {}, name="t-new", port=port)
    t.join()
    try:
        assert new.port == port and port in metrics._servers
    finally:
        new.close()


def test_a_forked_child_closes_what_it_inherited_and_does_not_hang():
    """A forked child inherited the parent's server table: its close() of
    an inherited handle waited for good for a serving thread the fork did
    not copy. The child forgets them and closes their sockets."""
    import os
    import threading
    import time

    port = _free_port()
    h = metrics.start_metrics(lambda: {}, name="t-parent", port=port)
    inside, held = threading.Event(), threading.Event()

    def in_the_collector():  # another thread inside the global collector at the fork (a scrape, a store opening)
        with metrics.global_collector()._lock:
            inside.set()
            held.wait(30)

    threading.Thread(target=in_the_collector, daemon=True).start()
    inside.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: nothing of the parent's table; closing the inherited handle returns
            code = 1
            try:
                code = 0 if not metrics._servers else 3
                h.close()
            finally:
                os._exit(code)
        held.set()  # the parent's thread lets go: the child never had it
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung closing an inherited metrics handle")
        assert os.waitstatus_to_exitcode(status) == 0
        assert port in metrics._servers  # the parent's server is untouched
    finally:
        h.close()
