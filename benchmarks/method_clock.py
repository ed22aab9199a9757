"""A clock that sums the wall time spent inside some methods of one object, whichever thread
calls them: the benchmarks wrap an optimizer's steps or the offload's gradient transport with it.

    clock = MethodClock(strategy.optimizer, ("step", "step_tensors"))
    ...; seconds = clock.take()   # the time since the last take, and start again
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable


class MethodClock:
    """Replaces each of `methods` that `obj` has with a timed wrapper around it."""

    def __init__(self, obj: Any, methods: Iterable[str]):
        self.total = 0.0
        for name in methods:
            if hasattr(obj, name):
                setattr(obj, name, self._timed(getattr(obj, name)))

    def _timed(self, original: Callable) -> Callable:
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.total += time.perf_counter() - t0

        return timed

    def take(self) -> float:
        """Seconds spent in the wrapped methods since the last call."""
        t, self.total = self.total, 0.0
        return t
