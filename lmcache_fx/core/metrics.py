"""Prometheus metrics of lmcache-fx stores, read from `store.stats` at scrape
time (no work on the data path beyond the counters the store keeps anyway).

Two ways out, both from one collector:

* LMCache's own observability: the collector is registered in
  prometheus_client's global REGISTRY, which LMCache's internal API server
  serves at /metrics (`internal_api_server_enabled: true`).
* A port of its own (`metrics_port`): a Prometheus HTTP server on a private
  registry, so it also works where LMCache runs prometheus_client in
  multiprocess mode (PROMETHEUS_MULTIPROC_DIR, which only exports
  file-backed metrics).

Wiring in the plugin is two lines:

    self._metrics = metrics.start_metrics(self.store, name=self.name, port=port)
    ...
    self._metrics.close()

Metric names (all labelled store=<plugin name>, path=<store paths>):

    lmcache_fx_read_chunks_total, lmcache_fx_read_bytes_total,
    lmcache_fx_written_chunks_total, lmcache_fx_written_bytes_total,
    lmcache_fx_hits_total, lmcache_fx_misses_total (of reads), lmcache_fx_corrupt_total,
    lmcache_fx_unauthenticated_total (refused for their MAC),
    lmcache_fx_lookup_chunks_total, lmcache_fx_lookup_hits_total (of lookups: the hit rate),
    lmcache_fx_evictions_total, lmcache_fx_write_errors_total, lmcache_fx_read_errors_total,
    lmcache_fx_read_seconds_total (time inside read batches),
    lmcache_fx_read_batch_seconds (histogram, when the store keeps one),
    lmcache_fx_read_bandwidth_bytes_per_second (lifetime average),
    lmcache_fx_usage_bytes, lmcache_fx_capacity_bytes, lmcache_fx_chunks,
    lmcache_fx_awaited_running, lmcache_fx_awaited_waiting (awaited reads now, under awaited_concurrency),
    lmcache_fx_engine_info{engine, odirect, fixed_buffers} = 1

GB/s over a window is best taken in PromQL:
    rate(lmcache_fx_read_bytes_total[1m]) / rate(lmcache_fx_read_seconds_total[1m])
"""

from __future__ import annotations

import bisect
import io
import logging
import os
import threading
import time
from typing import Callable, Optional, Union

log = logging.getLogger("lmcache_fx")

# Upper bounds (seconds) of the read-batch latency histogram. A store keeps
# counts per bucket (one more for +Inf) in Stats.read_latency_counts.
READ_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Stats field -> (metric name without prefix, help). Counters.
COUNTERS = {
    "chunks_read": ("read_chunks", "Chunks read from the store and served"),
    "bytes_read": ("read_bytes", "Payload bytes read from the store and served"),
    "chunks_written": ("written_chunks", "Chunks written to the store"),
    "bytes_written": ("written_bytes", "Bytes of chunk files written (header included)"),
    "hits": ("hits", "Chunks a read served"),
    "misses": (
        "misses",
        "Chunks a read was tried for and not served (gone since the lookup, bad, unfit, or no room in the pool); "
        "chunks a lookup did not find are not read: see lookup_chunks",
    ),
    "corrupt": ("corrupt", "Chunk files found bad on read (treated as misses and removed)"),
    "unauthenticated": (
        "unauthenticated",
        "Chunk files whose MAC does not verify with auth_key, or that have none (written by a process with another "
        "auth_key or none, or planted): misses, removed; not counted in corrupt",
    ),
    "evictions": ("evictions", "Chunks evicted to stay under max_capacity_gb"),
    "recycled": ("recycled_files", "Evicted chunks whose file a new chunk was written into (reuse_evicted)"),
    "write_errors": ("write_errors", "Chunk writes that failed"),
    "read_errors": ("read_errors", "Chunk reads that failed with an I/O error (misses, file kept)"),
    "read_seconds": ("read_seconds", "Seconds spent in read batches"),
    "read_batches": ("read_batches", "Read batches (one per LMCache retrieve that reaches the store)"),
    "lookup_chunks": ("lookup_chunks", "Chunks LMCache's lookups asked for (storage plugin and L2 adapter)"),
    "lookup_hits": ("lookup_hits", "Chunks lookups found (the hit prefix): over lookup_chunks, the hit rate"),
}

PREFIX = "lmcache_fx_"


def latency_bucket(seconds: float) -> int:
    """Index into Stats.read_latency_counts for one observation."""
    return bisect.bisect_left(READ_LATENCY_BUCKETS, seconds)


Source = Union[Callable[[], dict], object]


def store_snapshot(store) -> dict:
    """Everything the metrics report about a ChunkStore, as one dict:
    the Stats counters plus usage, capacity, chunks and the engine in use."""
    snap = dict(store.stats.snapshot())
    snap["usage_bytes"] = store.used_bytes
    snap["capacity_bytes"] = store.options.max_capacity_bytes
    snap["chunks"] = len(store)
    eng = store.engine
    snap["engine"] = getattr(eng, "kind", "?")
    snap["odirect"] = bool(getattr(store, "odirect", False))
    snap["fixed_buffers"] = bool(getattr(eng, "registered", False))
    now = getattr(eng, "batches_now", None)  # C engines: awaited reads under awaited_concurrency
    if now is not None:
        snap["awaited_running"], snap["awaited_waiting"] = now
    snap["path"] = ",".join(getattr(store, "roots", []))
    return snap


def _snap_of(source: Source) -> dict:
    return source() if callable(source) else store_snapshot(source)


def build_metrics(snapshots: dict) -> list:
    """Prometheus metric families from {store name: snapshot}; a snapshot is
    store_snapshot()'s dict (fields it lacks are left out)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["store", "path"]
    out: list = []  # metric families of several kinds
    gauges = {
        "usage_bytes": "Bytes of chunk files in the store, as this process counts them",
        "capacity_bytes": "max_capacity_gb in bytes",
        "chunks": "Chunk files in this process's index",
        "awaited_running": "Awaited reads running now (at most awaited_concurrency)",
        "awaited_waiting": "Awaited reads waiting for a running one to finish, started oldest first",
    }
    per_field: list[tuple[type, str, str, str]] = [
        (CounterMetricFamily, field, name, doc) for field, (name, doc) in COUNTERS.items()
    ]
    per_field += [(GaugeMetricFamily, field, field, doc) for field, doc in gauges.items()]
    for family, field, name, doc in per_field:
        fam = family(PREFIX + name, doc, labels=labels)
        for sname, s in snapshots.items():
            if field in s:
                fam.add_metric([sname, s.get("path", "")], float(s[field]))
        if fam.samples:
            out.append(fam)
    bw = GaugeMetricFamily(
        PREFIX + "read_bandwidth_bytes_per_second",
        "Payload bytes read per second inside read batches, since start",
        labels=labels,
    )
    for sname, s in snapshots.items():
        if s.get("read_seconds"):
            bw.add_metric([sname, s.get("path", "")], s.get("bytes_read", 0) / s["read_seconds"])
    if bw.samples:
        out.append(bw)
    info = GaugeMetricFamily(
        PREFIX + "engine_info",
        "The I/O engine in use (value is always 1)",
        labels=labels + ["engine", "odirect", "fixed_buffers"],
    )
    for sname, s in snapshots.items():
        if "engine" in s:
            info.add_metric(
                [
                    sname,
                    s.get("path", ""),
                    str(s["engine"]),
                    str(bool(s.get("odirect"))).lower(),
                    str(bool(s.get("fixed_buffers"))).lower(),
                ],
                1.0,
            )
    if info.samples:
        out.append(info)
    hist = HistogramMetricFamily(PREFIX + "read_batch_seconds", "Latency of read batches", labels=labels)
    for sname, s in snapshots.items():
        counts = s.get("read_latency_counts")
        if not counts or len(counts) != len(READ_LATENCY_BUCKETS) + 1:
            continue
        cum, buckets = 0, []
        for bound, c in zip(list(READ_LATENCY_BUCKETS) + [float("inf")], counts):
            cum += c
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(cum)))
        hist.add_metric([sname, s.get("path", "")], buckets, float(s.get("read_seconds", 0.0)))
    if hist.samples:
        out.append(hist)
    return out


class FxCollector:
    """A prometheus_client collector over any number of stores."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sources: dict[str, Source] = {}

    def add(self, name: str, source: Source) -> None:
        with self._lock:
            self._sources[name] = source

    def add_unique(self, name: str, source: Source) -> str:
        """Adds `source` under `name`, or under name-2, name-3... where a
        live source has it: two engines in one process, each with a plugin
        named fx, took one series, and the first's vanished when the second
        closed. Returns the name used."""
        with self._lock:
            used, n = name, 1
            while used in self._sources:
                n += 1
                used = f"{name}-{n}"
            self._sources[used] = source
            return used

    def remove(self, name: str) -> None:
        with self._lock:
            self._sources.pop(name, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sources)

    def collect(self):
        with self._lock:
            sources = dict(self._sources)
        snaps = {}
        for name, src in sources.items():
            try:
                snaps[name] = _snap_of(src)
            except Exception as e:  # a scrape must never take the server down
                log.debug("lmcache-fx: metrics of %s unavailable: %s", name, e)
        return build_metrics(snaps)

    def describe(self):
        return []  # unchecked collector: names depend on what the stores report


_lock = threading.Lock()
_global: Optional[FxCollector] = None  # in prometheus_client.REGISTRY
_servers: dict[int, tuple] = {}  # port -> (server, thread, FxCollector, users)


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's metrics servers: their
    threads did not come along. It closes the listening sockets it inherited
    (they kept the port taken while it lived) and forgets them: a close()
    there waited for good for a serving thread that is not there, and a
    store of the child joined a server that served nothing."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork, as the collector's
    if _global is not None:
        _global._lock = threading.Lock()
    for server, *_ in _servers.values():
        try:
            server.socket.close()
        except OSError:
            pass
    _servers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def global_collector() -> FxCollector:
    """The collector registered in prometheus_client's global REGISTRY."""
    global _global
    with _lock:
        if _global is None:
            from prometheus_client import REGISTRY

            _global = FxCollector()
            REGISTRY.register(_global)
        return _global


class MetricsHandle:
    """What start_metrics returns; close() takes the store out of the metrics."""

    def __init__(self, name: str, port: int):
        self.name, self.port = name, port
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        global_collector().remove(self.name)
        if not self.port:
            return
        with _lock:
            entry = _servers.get(self.port)
            if entry is None:
                return
            server, thread, coll, users = entry
            coll.remove(self.name)
            if users > 1:
                _servers[self.port] = (server, thread, coll, users - 1)
                return
            del _servers[self.port]
            # Under the lock (serve_forever ends within its 0.5 s poll): a store starting on this port
            # meanwhile found no server and could not bind, the old socket still listening.
            server.shutdown()
            server.server_close()


# A scrape takes milliseconds: a client whose request has not all come within
# this long of its connection is dropped (a total, not per receive: one
# trickling a byte at a time would keep its slot for ever), and past this
# many at once new ones are refused, so stalled clients cannot hold threads
# and sockets in the inference process.
CLIENT_TIMEOUT_S = 10.0
MAX_CLIENTS = 16


class _DeadlineReader(io.RawIOBase):
    """A socket's receiving side that gives up (TimeoutError) once `deadline`
    (time.monotonic()) has passed, however the bytes trickle in."""

    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request took too long")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(b)
        finally:
            self._sock.settimeout(CLIENT_TIMEOUT_S)  # the response's sends keep a whole timeout each


def _serve(addr: str, port: int, registry):
    """An HTTP server for registry on addr:port in a daemon thread, each
    client on a thread of its own with a timeout and a bound on how many.
    OSError when the port cannot be had."""
    import socket
    import socketserver
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    slots = threading.BoundedSemaphore(MAX_CLIENTS)

    class Handler(WSGIRequestHandler):
        timeout = CLIENT_TIMEOUT_S  # each send of the response

        def setup(self):
            super().setup()
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

        def handle(self):
            try:
                super().handle()
            except OSError:  # timed out or reset: nothing to answer, nothing to print
                self.close_connection = True

        def log_message(self, format, *args):  # noqa: A002 - the base class's name
            pass

    class Server(socketserver.ThreadingMixIn, WSGIServer):
        daemon_threads = True
        block_on_close = False
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

        def process_request(self, request, client_address):
            if not slots.acquire(blocking=False):
                self.shutdown_request(request)  # too many at once
                return
            super().process_request(request, client_address)

        def process_request_thread(self, request, client_address):
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

    server = make_server(addr, port, make_wsgi_app(registry), Server, handler_class=Handler)
    thread = threading.Thread(target=server.serve_forever, name=f"lmcache-fx-metrics-{port}", daemon=True)
    thread.start()
    return server, thread


def start_metrics(source: Source, name: str = "fx", port: int = 0, addr: str = "127.0.0.1") -> MetricsHandle:
    """Exposes a store's metrics: always in the global REGISTRY (LMCache's
    /metrics), and on http://addr:port/metrics when port > 0. Stores in one
    process share a port. A port that cannot be bound is logged, not raised:
    metrics must never stop the cache."""
    name = global_collector().add_unique(name, source)
    h = MetricsHandle(name, 0)
    if port:
        from prometheus_client import CollectorRegistry

        with _lock:
            entry = _servers.get(port)
            if entry is not None:
                server, thread, coll, users = entry
                if addr != getattr(server, "fx_addr", addr):
                    log.warning(
                        "lmcache-fx: metrics_port %d is served on %s already (by another store of this process); "
                        "metrics_addr %s of '%s' is not used",
                        port,
                        server.fx_addr,
                        addr,
                        name,
                    )
                coll.add(name, source)
                _servers[port] = (server, thread, coll, users + 1)
                h.port = port
                return h
            coll = FxCollector()
            coll.add(name, source)
            reg = CollectorRegistry(auto_describe=False)
            reg.register(coll)
            try:
                server, thread = _serve(addr, port, reg)
            except OSError as e:
                log.error(
                    "lmcache-fx: metrics_port %d: cannot listen on %s:%d (%s); Prometheus metrics are "
                    "off for '%s' (they are still in LMCache's /metrics)",
                    port,
                    addr,
                    port,
                    e.strerror or e,
                    name,
                )
                return h
            server.fx_addr = addr  # what it was asked to listen on, for a second store's metrics_addr
            _servers[port] = (server, thread, coll, 1)
            h.port = port
        log.info("lmcache-fx: Prometheus metrics of '%s' on http://%s:%d/metrics", name, addr, port)
    return h


def render(source: Source, name: str = "fx") -> str:
    """The text exposition of one store's metrics (tests, debugging)."""
    from prometheus_client import CollectorRegistry, generate_latest

    coll = FxCollector()
    coll.add(name, source)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(coll)
    return generate_latest(reg).decode()
