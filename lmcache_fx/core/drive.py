"""Running the store's read steps on the C engine: blocking, or awaited on an
event loop through the batch's eventfd; and building the engine itself."""
from __future__ import annotations

import asyncio
import logging

from .. import _fxio
from .options import ConfigError, FxOptions

log = logging.getLogger("lmcache_fx")


async def await_batch(batch, loop: asyncio.AbstractEventLoop) -> list:
    """The results of a submitted engine batch, awaited through its eventfd
    so the loop keeps running while the engine reads."""
    if not batch.done():
        fut = loop.create_future()
        fd = batch.fileno()
        loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            loop.remove_reader(fd)
    return batch.wait()


def drive_blocking(engine, gen, release) -> list:
    """Runs a read_steps generator with blocking engine batches."""
    try:
        ops, crc = next(gen)
        while True:
            ops, crc = gen.send(engine.read(ops, crc=crc))
    except StopIteration as stop:
        out, failed = stop.value
    for h in failed:
        release(h)
    return out


async def drive_async(engine, gen, release) -> list:
    """Runs a read_steps generator, awaiting each batch through its eventfd
    so the event loop keeps running while the engine reads."""
    loop = asyncio.get_running_loop()
    try:
        ops, crc = next(gen)
        while True:
            ops, crc = gen.send(await await_batch(engine.submit(ops, write=False, crc=crc), loop))
    except StopIteration as stop:
        out, failed = stop.value
    for h in failed:
        release(h)
    return out


_engine_warned = set()


def make_engine(options: FxOptions):
    """Builds the C engine; warns once per reason when io_uring is not used."""
    try:
        eng = _fxio.Engine(options.io_engine, options.queue_depth, options.split_bytes)
    except OSError as e:
        raise ConfigError(f"io_engine: {e}; use io_engine: auto to fall back to the thread engine") from None
    if eng.fallback_reason and eng.fallback_reason not in _engine_warned:
        _engine_warned.add(eng.fallback_reason)
        log.warning("lmcache-fx: io_uring unavailable (%s); using the thread engine", eng.fallback_reason)
    return eng
