"""CPU allocation events from ``torch.profiler``, quiet: what the measured peaks on CPU
(`fxopt.measure`) and the measured scratch memory of ops (`fxopt.analysis.scratch`) read.
One recorder for both, below both."""

from __future__ import annotations

import contextlib
import gc

from fxopt._quiet import silenced


@contextlib.contextmanager
def profile_cpu_memory(collect: bool = True):
    """``torch.profiler`` recording CPU allocation events, without the lines the profiler prints
    on stderr as it starts and stops. Yields the profiler; read its events after the block.
    ``collect=False``: skip the garbage collection before it (where only events inside labelled
    ranges are read, as `fxopt.analysis.scratch` reads them, old garbage freed later is outside)."""
    from torch.profiler import ProfilerActivity, profile

    # Frees of blocks allocated before profiling start show up without their allocation and would
    # pull the running total down: collect old garbage first, and keep the cyclic collector from
    # freeing it in the middle of the measurement.
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    with silenced(2):
        prof.__enter__()
    try:
        yield prof
    finally:
        with silenced(2):
            prof.__exit__(None, None, None)
        if was_enabled:
            gc.enable()
