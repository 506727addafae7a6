"""``released``: wait until a process group's worker thread has let go of a collective's output.

gloo runs each collective on a worker thread, and the work it runs holds the collective's output
tensors (an all-gather's, a reduce-scatter's, and gloo's own copy of a reduce-scatter's input)
until that thread drops it, after the wait has returned, at a moment the OS scheduler decides.
Measured on 2 and 4 gloo ranks under load (issue 26): about one all-gather in ten still had its
output held right after its wait, and about one in fifty after three more collectives had been
waited for. A gathered parameter the step has finished with then outlives its last read, and the
measured peak is above the plan by it. No count of later collectives bounds it, so it cannot be
modelled; `released` makes it not happen: placed right after a collective's wait
(`fxopt.passes.waits.wait_for_release`), it yields to the worker thread until the output's storage
is referenced by the step alone. It returns at once where the thread has already let go.
"""

from __future__ import annotations

import os
import time
import warnings

import torch

# A safety stop, never reached where the worker thread runs at all: past it the step goes on and
# says once that its measured peak may exceed its plan.
RELEASE_TIMEOUT_S = 5.0
_YIELDS = 1000  # polls that only yield the core before each poll also sleeps briefly
_warned = False


def _references(t: torch.Tensor) -> int:
    """References to ``t``'s storage other than this call's: its tensors (each view one)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1  # (less ``storage``, this wrapper)


@torch.library.custom_op("fxopt::released", mutates_args=())
def released(t: torch.Tensor) -> None:
    """Return once ``t``'s storage is referenced by ``t`` alone: the collective's work that made
    it (held by the process group's worker thread) has been let go, and with it any buffer the
    work kept. ``t`` is a collective's output right after its wait, before anything reads it."""
    global _warned
    if _references(t) <= 1:
        return
    start = time.perf_counter()
    polls = 0
    while _references(t) > 1:
        polls += 1
        if polls <= _YIELDS:
            os.sched_yield()
            continue
        if time.perf_counter() - start > RELEASE_TIMEOUT_S:
            if not _warned:
                _warned = True
                warnings.warn(f"fxopt: a collective's output was still held by its process group's worker thread "
                              f"{RELEASE_TIMEOUT_S:.0f} s after its wait; the step goes on, and its measured peak "
                              "may exceed its plan by such outputs", RuntimeWarning, stacklevel=2)
            return
        time.sleep(1e-4)


@released.register_fake
def _(t):
    return None


# Not dead code: the graph reads nothing it returns, but the step must wait where it is.
torch.fx.node.has_side_effect(torch.ops.fxopt.released.default)
