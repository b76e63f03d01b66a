"""For probes: how long a process holds the store lock."""

from __future__ import annotations

import contextlib
import time
from typing import Callable

from ..core import ledger as ledger_mod


def time_lock_holds(record: Callable[[float], None]) -> None:
    """From now on, every hold of a store lock (Ledger.hold) in this process
    calls record(seconds held) as it ends."""
    real = ledger_mod.Ledger.hold

    @contextlib.contextmanager
    def hold(self, *a, **k):
        with real(self, *a, **k) as led:
            t0 = time.perf_counter()
            try:
                yield led
            finally:
                record(time.perf_counter() - t0)

    ledger_mod.Ledger.hold = hold  # type: ignore[method-assign]
