"""A clock that runs fast or slow, for the tests that show counted effort, not the clock, decides
an answer (the solvers', `fxopt.max_batch`'s): `every_clock` patches the clocks Python code reads
with it (the safety stop's is the planning thread's CPU time, `fxopt.solvers.effort.now`)."""

from __future__ import annotations

import time


class FastClock:
    """``clock`` (`time.perf_counter` unless given) running ``factor`` times fast from now on (a
    machine that many times slower, as far as that clock can tell; a factor below 1, a faster
    machine)."""

    def __init__(self, factor: float, clock=None):
        self.real, self.factor = clock or time.perf_counter, factor
        self.t0 = self.real()

    def __call__(self) -> float:
        return self.t0 + (self.real() - self.t0) * self.factor


CLOCKS = ("perf_counter", "process_time", "thread_time")


def every_clock(monkeypatch, factor: float, clocks=CLOCKS) -> None:
    """Each of ``clocks`` (names in `time`) running ``factor`` times fast from now on."""
    import time as _time

    for name in clocks:
        monkeypatch.setattr(_time, name, FastClock(factor, getattr(_time, name)))
