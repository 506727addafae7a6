"""CPU allocation events from ``torch.profiler``, quiet: what the measured peaks on CPU
(`fxopt.measure`) and the measured scratch memory of ops (`fxopt.analysis.scratch`) read.
One recorder for both, below both.

The profiler records an allocation or a free on the thread that makes it, and only on a thread
that runs under the profiler: a block freed by another thread leaves no event, and a running sum
of the events keeps it alive for ever. That happens with every collective over gloo: its work
runs on gloo's worker thread (under the profiler, which hands its state over), keeps the tensors
it reads and writes, and drops them on that thread once it is done, after the waiting thread
has let go of them (a re-gathered parameter, read once and dropped, is freed there). So the
events are read with the CPU allocator's own count of live bytes (``total_allocated``, every
thread), which c10 keeps for blocks freed by any thread while its flag
``caffe2_report_cpu_memory_usage`` is set (otherwise only on threads that are profiled):
`every_thread_counted` sets it while the profiler records, and `allocation_events` gives each
event with the count just after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import glob
import os

from fxopt._quiet import silenced


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One allocation (``nbytes`` > 0) or free (< 0) of CPU memory the profiler recorded, at
    ``start_ns`` (the clock of ``time.time_ns``); ``total_bytes``: the allocator's count of live
    bytes just after it, frees on unprofiled threads included (see the module docstring)."""

    start_ns: int
    nbytes: int
    total_bytes: int


def _report_flag() -> ctypes.c_bool | None:
    """c10's ``FLAGS_caffe2_report_cpu_memory_usage``, where this build exports it."""
    import torch

    for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
        try:
            return ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
        except (OSError, ValueError):
            continue
    return None


@contextlib.contextmanager
def every_thread_counted():
    """Meanwhile the CPU allocator counts blocks freed on any thread (see the module docstring;
    where the flag is not found, only those freed on profiled threads, as without it)."""
    flag = _report_flag()
    if flag is None or flag.value:
        yield
        return
    flag.value = True
    try:
        yield
    finally:
        flag.value = False


@contextlib.contextmanager
def profile_cpu_memory(collect: bool = True, every_thread: bool = False):
    """``torch.profiler`` recording CPU allocation events, without the lines the profiler prints
    on stderr as it starts and stops. Yields the profiler; read its events after the block.
    ``collect=False``: skip the garbage collection before it (where only events inside labelled
    ranges are read, as `fxopt.analysis.scratch` reads them, old garbage freed later is outside).
    ``every_thread``: the allocator counts frees on every thread meanwhile (`allocation_events`)."""
    from torch.profiler import ProfilerActivity, profile

    # Frees of blocks allocated before profiling start show up without their allocation and would
    # pull the running total down: collect old garbage first, and keep the cyclic collector from
    # freeing it in the middle of the measurement.
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    with contextlib.ExitStack() as stack:
        if every_thread:
            stack.enter_context(every_thread_counted())
        with silenced(2):
            prof.__enter__()
        try:
            yield prof
        finally:
            with silenced(2):
                prof.__exit__(None, None, None)
            if was_enabled:
                gc.enable()


def allocation_events(prof) -> list[Allocation]:
    """The CPU allocations and frees ``prof`` recorded, in time order."""
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            out.append(Allocation(event.start_time_ns, fields.alloc_size, fields.total_allocated))
    return sorted(out, key=lambda a: a.start_ns)


def peak_increase(allocations: list[Allocation]) -> int:
    """The most the allocator's count of live bytes rose above where it stood before the first of
    ``allocations`` (`allocation_events` of one run): that run's peak above what was there."""
    if not allocations:
        return 0
    start = allocations[0].total_bytes - allocations[0].nbytes
    return max(0, max(a.total_bytes for a in allocations) - start)
