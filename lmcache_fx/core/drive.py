"""Running the store's read steps on the C engine: blocking, or awaited on an
event loop through the batch's eventfd; and building the engine itself."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import weakref

from .. import _fxio
from .once import log_once
from .options import ConfigError, FxOptions

log = logging.getLogger("lmcache_fx")


async def await_batch(batch, loop: asyncio.AbstractEventLoop) -> list:
    """The results of a submitted engine batch, awaited through its eventfd
    so the loop keeps running while the engine reads."""
    if not batch.done():
        fut = loop.create_future()
        fd = batch.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        loop.add_reader(fd, ready)
        try:
            await fut
        finally:
            loop.remove_reader(fd)
    return batch.wait()


class _LoopWaiter:
    """The C engine's batches awaited on one event loop through one eventfd
    they all signal (a Notifier), watched by the loop for as long as it
    lives: a batch then costs the loop no eventfd of its own, no epoll
    registration and removal, and completions that land together are taken
    in one wake-up. Only the loop's thread touches it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.notifier = _fxio.Notifier()
        self._pending: dict = {}  # Batch -> the future its awaiting task waits on
        loop.add_reader(self.notifier.fileno(), self._ready)

    def _ready(self) -> None:
        self.notifier.drain()
        for batch in [b for b in self._pending if b.done()]:
            fut = self._pending.pop(batch)
            if not fut.done():
                fut.set_result(None)

    async def wait(self, batch, loop: asyncio.AbstractEventLoop) -> list:
        """The results of a batch submitted with notify=self.notifier."""
        if not batch.done():
            fut = loop.create_future()
            self._pending[batch] = fut
            try:
                await fut
            finally:
                self._pending.pop(batch, None)
        return batch.wait()


# One waiter per loop, gone with it (a waiter holds no reference to its loop).
_waiters: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaiter]" = weakref.WeakKeyDictionary()


def _loop_waiter(engine, loop: asyncio.AbstractEventLoop):
    """This loop's waiter for batches of a C Engine; None for stand-ins (the
    GPU router's thread batches, test wrappers) and for loops that cannot
    watch a descriptor, which await each batch's own eventfd."""
    if not isinstance(engine, _fxio.Engine):
        return None
    w = _waiters.get(loop)
    if w is None:
        try:
            w = _waiters[loop] = _LoopWaiter(loop)
        except (NotImplementedError, TypeError):
            return None
    return w


def is_chunks_step(step) -> bool:
    """A read_steps step is (ops, crc): engine.read of (fd, offset, length,
    address) ops; or ("chunks", chunks, scratch, verify, direct, lock, mapped,
    stage): engine.read_chunks of whole chunk files, headers into the
    HostBuffer `scratch`."""
    return len(step) == 8 and step[0] == "chunks"


def _run_step(engine, step) -> list:
    if is_chunks_step(step):
        _, chunks, scratch, verify, direct, lock, mapped, stage = step
        return engine.read_chunks(
            chunks, scratch.address, verify=verify, direct=direct, lock=lock, mapped=mapped, stage=stage
        )
    ops, crc = step
    return engine.read(ops, crc=crc)


def submit_step(engine, step, notify=None):
    """Starts one read_steps step on the engine; returns its Batch. With
    `notify` (a Notifier; C engines only) the batch signals its eventfd."""
    kw = {} if notify is None else {"notify": notify}
    if is_chunks_step(step):
        _, chunks, scratch, verify, direct, lock, mapped, stage = step
        return engine.submit_chunks(
            chunks, scratch.address, verify=verify, direct=direct, lock=lock, mapped=mapped, stage=stage, **kw
        )
    ops, crc = step
    return engine.submit(ops, write=False, crc=crc, **kw)


def drive_blocking(engine, gen, release) -> list:
    """Runs a read_steps generator with blocking engine batches. An engine
    error is thrown into the generator, which makes the batch misses. An
    interrupt (Ctrl-C, a signal handler's exception) between steps hands
    every handle back before it goes on up: no batch is in flight then (each
    returns only when done), so the read is abandoned as a cancelled one."""
    try:
        step = next(gen)
        while True:
            try:
                res = _run_step(engine, step)
            except Exception as e:  # a ring not taken, the engine closed, ...
                step = gen.throw(e)
                continue
            step = gen.send(res)
    except StopIteration as stop:
        out, failed = stop.value
    except BaseException:
        _abandon(gen, release)
        raise
    for h in failed:
        release(h)
    return out


class ReadCancelled(Exception):
    """Thrown into a read_steps generator when the awaiting task was
    cancelled, once its batch in flight has finished: the read ends as misses."""


async def outlast_cancels(fut: "asyncio.Future") -> None:
    """Awaits `fut` (work on another thread) to its end through any
    cancellation of the awaiting task: the caller must not go on while that
    work still runs. Its error is not raised: it is over either way."""
    while True:
        try:
            await asyncio.shield(fut)
            return
        except asyncio.CancelledError:
            if fut.done():
                return
        except Exception:
            return


async def _finish_batch(batch, loop: asyncio.AbstractEventLoop) -> None:
    """After a cancellation: a running C batch stops where it is (what is in flight completes), so
    wait (in a thread; the loop keeps running) until nothing of it is in
    flight. Further cancellations only make this wait on."""
    fut = None
    if not batch.done():
        try:
            fut = loop.run_in_executor(None, batch.wait)
        except RuntimeError:  # no thread can be started (a pids limit): wait here, the loop held that long
            _wait_out(batch)
            return
    if fut is not None:
        await outlast_cancels(fut)  # an error of the batch: nothing in flight either
        return
    try:
        batch.wait()  # done: collects it without blocking
    except Exception:
        pass


def _stop(batch) -> None:
    """Stops a batch: one not started ends unread; one running ends once what is in flight completes."""
    cancel = getattr(batch, "cancel", None)  # C batches have it
    if cancel is not None:
        cancel()


def _wait_out(batch) -> None:
    """A batch stopped (one not yet started ends unread) and waited for,
    blocking: nothing of it is in flight after this."""
    _stop(batch)
    try:
        batch.wait()
    except Exception:
        pass  # ended with an error: nothing in flight either


async def drive_async(engine, gen, release) -> list:
    """Runs a read_steps generator, awaiting each batch through its eventfd
    so the event loop keeps running while the engine reads. An engine error
    is thrown into the generator (the batch becomes misses). Cancelled, it
    waits for the batch in flight to finish before the generator closes its
    files and the handles are released (no read lands after this returns),
    releases every handle, hits included, and re-raises CancelledError."""
    loop = asyncio.get_running_loop()
    waiter = _loop_waiter(engine, loop)
    cancelled = None
    try:
        step = next(gen)
        while True:
            batch = None
            try:
                if waiter is None:
                    batch = submit_step(engine, step)
                    res = await await_batch(batch, loop)
                else:
                    batch = submit_step(engine, step, waiter.notifier)
                    res = await waiter.wait(batch, loop)
            except asyncio.CancelledError as c:
                cancelled = c
                if batch is not None:
                    _stop(batch)
                    await _finish_batch(batch, loop)
                step = gen.throw(ReadCancelled("the read was cancelled"))
                continue
            except Exception as e:
                step = gen.throw(e)
                continue
            except BaseException:
                # The coroutine closed (GeneratorExit: its task destroyed with
                # the loop) or interrupted: nothing can be awaited, so wait
                # here before the generator's finally closes the batch's files.
                if batch is not None:
                    _wait_out(batch)
                _abandon(gen, release)
                raise
            step = gen.send(res)
    except StopIteration as stop:
        out, failed = stop.value
    for h in failed:
        release(h)
    if cancelled is not None:
        for h in out:
            if h is not None:
                release(h)
        raise cancelled
    return out


def _abandon(gen, release) -> None:
    """A read whose coroutine closes without awaiting (its batch waited out):
    the generator is told the read was cancelled, so it closes its files and
    hands back every handle, released here; left to the collector, it never
    handed them back (LMCache's objects were freed by its own safety net,
    with a warning each)."""
    try:
        gen.throw(ReadCancelled("the read's coroutine was closed"))
    except StopIteration as stop:
        out, failed = stop.value
        for h in list(failed) + [h for h in out if h is not None]:
            release(h)
        return
    except Exception:
        return  # a generator that does not take the cancel: it has ended (its finally ran)
    gen.close()  # it went on to another step: nothing more can run


def _first_line(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return None


CAP_IPC_LOCK = 14  # the capability that lets a process lock memory past RLIMIT_MEMLOCK


def memlock_refuses(size: int, status: str = "/proc/self/status") -> bool:
    """Whether the locked-memory limit refuses pinning `size` bytes (an io_uring
    fixed-buffer registration): the soft RLIMIT_MEMLOCK below it and no
    CAP_IPC_LOCK to pass it. Where the capability cannot be read, it is
    taken as absent."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if soft == resource.RLIM_INFINITY or soft >= size:
        return False
    try:
        with open(status) as f:
            eff = next((int(x.split()[1], 16) for x in f if x.startswith("CapEff:")), 0)
    except (OSError, ValueError):
        return True
    return not eff >> CAP_IPC_LOCK & 1


def memlock_text(limit: int) -> str:
    """A RLIMIT_MEMLOCK value for people: "unlimited", KiB below 1 MiB (the
    common 64 KiB default read "0 MiB"), else MiB."""
    import resource

    if limit == resource.RLIM_INFINITY:
        return "unlimited"
    return f"{limit >> 10} KiB" if limit < (1 << 20) else f"{limit >> 20} MiB"


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> float | None:
    """The CPUs this process's cgroup may use (a container's CPU limit: its
    quota over its period), from cgroup v2's cpu.max or v1's CFS files; None
    where none is set or none can be read. A container that sees its own
    cgroup at the mount's root (a cgroup namespace, or v1 without one) has
    the files there rather than under the path /proc names."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            limit = _limit_of(root, line)
        except (ValueError, ZeroDivisionError):  # a line or a file not as the kernel writes them
            continue
        if limit is not False:
            return limit
    return None


def _limit_of(root: str, line: str) -> float | None | bool:
    """One /proc/self/cgroup line's CPU limit: a number, None (its files say
    unlimited) or False (no CPU controller there, or no file found)."""
    _, controllers, path = line.split(":", 2)
    rel = path.lstrip("/")
    if controllers == "":  # v2: "quota period", or "max period" when unlimited
        for d in (os.path.join(root, rel), root):
            parts = (_first_line(os.path.join(d, "cpu.max")) or "").split()
            if len(parts) == 2:
                return None if parts[0] == "max" else int(parts[0]) / int(parts[1])
    elif "cpu" in controllers.split(","):
        for mount in (controllers, "cpu", "cpu,cpuacct"):
            for d in (os.path.join(root, mount, rel), os.path.join(root, mount)):
                quota = _first_line(os.path.join(d, "cpu.cfs_quota_us"))
                period = _first_line(os.path.join(d, "cpu.cfs_period_us"))
                if quota and period:
                    return int(quota) / int(period) if int(quota) > 0 else None
    return False


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), at most its cgroup's
    CPU limit rounded up."""
    n = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    return max(1, min(n, math.ceil(limit))) if limit else n


def awaited_concurrency(options: FxOptions) -> int:
    """The engine's max_running: the option, with auto the CPUs this process
    may use (more batches than that only take CPU from each other)."""
    v = options.awaited_concurrency
    if v == "auto":
        return min(usable_cpus(), 1024)
    return int(v)


def make_engine(options: FxOptions, devices: int = 1):
    """Builds the C engine, `queue_depth` for each of the `devices` the store's
    paths lie on (as fio's iodepth is per job); warns once per reason when
    io_uring is not used."""
    try:
        eng = _fxio.Engine(
            options.io_engine,  # type: ignore[arg-type]
            min(options.queue_depth * max(devices, 1), 32768),
            options.split_bytes,
            runner_nice=options.runner_nice,
            max_running=awaited_concurrency(options),
            whole_when_busy=options.whole_reads_when_busy,
        )
    except OSError as e:
        raise ConfigError(f"io_engine: {e}; use io_engine: auto to fall back to the thread engine") from None
    if eng.fallback_reason:
        log_once(
            log,
            ("engine", eng.fallback_reason),
            logging.WARNING,
            "lmcache-fx: io_uring unavailable (%s); using the thread engine",
            eng.fallback_reason,
        )
    return eng
