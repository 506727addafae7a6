"""The measurement in progress, as fxopt's backend sees it: `fxopt.measure` starts one around a
step it measures; the backend leaves its own work (capturing, planning, compiling a graph) out of
it (`not_measured`) and says where the compiled graph starts running (`step_runs`). Here, below
both, so that capture need not import the measurement room above it."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

# The measurement in progress in this context, if any (`not_measured` pauses it).
SESSION: contextvars.ContextVar[Any] = contextvars.ContextVar("fxopt_measurement", default=None)


@contextlib.contextmanager
def not_measured():
    """Around fxopt's backend (capturing, planning and compiling a graph), which a measurement in
    progress leaves out (see the module docstring); a measurement inside (planning's own, of each
    op's scratch memory) starts from nothing."""
    session = SESSION.get()
    if session is None:
        yield
        return
    session.pause()
    token = SESSION.set(None)
    try:
        yield
    finally:
        SESSION.reset(token)
        session.after_backend()


def step_runs() -> None:
    """Where a graph fxopt compiled starts running: a measurement `not_measured` paused resumes."""
    session = SESSION.get()
    if session is not None and session.paused:
        session.resume()
