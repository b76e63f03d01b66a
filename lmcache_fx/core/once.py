"""What a process says once: a condition that holds for its whole life (a
kernel feature missing, a medium without O_DIRECT, a memlock limit, paths
listed otherwise than another process lists them) is logged when first met,
not again by every store, engine or plugin of the process that meets it."""

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
