"""What is settled once. What a process says once: a condition that holds
for its whole life (a kernel feature missing, a medium without O_DIRECT, a
memlock limit, paths listed otherwise than another process lists them) is
logged when first met, not again by every store, engine or plugin of the
process that meets it. And a job handed to another thread (Handoff): it
either runs or, given up first, never does."""

from __future__ import annotations

import logging
import threading

_said: set = set()  # the keys said in this process
_mu = threading.Lock()


def log_once(logger: logging.Logger, key: object, level: int, msg: str, *args) -> bool:
    """Logs `msg` % `args` at `level` unless `key` was logged before in
    this process; whether it logged now."""
    with _mu:
        if key in _said:
            return False
        _said.add(key)
    logger.log(level, msg, *args)
    return True


class Handoff:
    """Whether a job handed to another thread runs, settled once under a
    lock between the thread that takes it (begin) and the one that handed
    it over (give_up): an interrupt or a cancellation can reach the giver
    after the job was queued, or its thread made, and before it ran a line,
    where nothing else tells "it will run" from "it never will"."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._runs: bool | None = None

    def begin(self) -> bool:
        """The taker, before the job: whether it may run it (not given up)."""
        with self._mu:
            if self._runs is None:
                self._runs = True
            return self._runs

    def give_up(self) -> bool:
        """The giver: True when the job will never run, False when it began."""
        with self._mu:
            if self._runs is None:
                self._runs = False
            return not self._runs
