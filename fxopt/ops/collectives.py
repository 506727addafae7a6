"""Collectives whose buffers are freed where the step's plan frees them, on gloo: ``released`` (wait
until a process group's worker thread has let go of a collective's output) and ``reduce_scatter``
(torch's functional reduce-scatter and its wait, returning once gloo's copy of the input is freed).

gloo runs each collective on a worker thread, and the work it runs holds the collective's output
tensors (an all-gather's, a reduce-scatter's, and gloo's own copy of a reduce-scatter's input)
until that thread drops it, after the wait has returned, at a moment the OS scheduler decides.
Measured on 2 and 4 gloo ranks under load (issue 26): about one all-gather in ten still had its
output held right after its wait, and about one in fifty after three more collectives had been
waited for. A gathered parameter the step has finished with then outlives its last read, and the
measured peak is above the plan by it. No count of later collectives bounds it, so it cannot be
modelled; `released` makes it not happen: placed right after an all-gather's wait
(`fxopt.passes.waits.wait_for_release`), it yields to the worker thread until the output's storage
is referenced by the step alone. It returns at once where the thread has already let go.

A reduce-scatter's work holds no tensor the step can see: gloo reduces in a copy of the input
(made when the collective is issued, freed when the work is dropped: profiled, one rank in 25 steps
still held a 256 KiB copy after the next reduce-scatter's wait). `reduce_scatter` takes the
functional reduce-scatter's and its wait's place: it makes that copy itself, all-reduces it in place
(as gloo does), waits until the worker thread has let go of it (`released`), and returns this
rank's chunk. The same bytes, at the same moments as the plan counts them (`Node.lingers`).
Where the plan waits for a reduce-scatter later than it issues it (`fxopt.solvers.prefetch`), the
two halves run apart: `reduce_scatter_issue` makes the copy and issues its all-reduce, and
`reduce_scatter_wait` waits for it, and for gloo to let go of it, and returns the chunk; the copy
(the whole gradient) lives from the one to the other, as the simulator counts it.
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


def _until_alone(t: torch.Tensor, alone: int = 1) -> None:
    """Yield until ``t``'s storage has ``alone`` references (its tensors, each view one), or the
    safety stop (`RELEASE_TIMEOUT_S`) has passed."""
    global _warned
    start = time.perf_counter()
    polls = 0
    while _references(t) > alone:
        polls += 1
        if polls <= _YIELDS:
            os.sched_yield()
            continue
        if time.perf_counter() - start > RELEASE_TIMEOUT_S:
            if not _warned:
                _warned = True
                warnings.warn(f"fxopt: a collective's buffer was still held by its process group's worker thread "
                              f"{RELEASE_TIMEOUT_S:.0f} s after its wait; the step goes on, and its measured peak "
                              "may exceed its plan by such buffers", RuntimeWarning, stacklevel=3)
            return
        time.sleep(1e-4)


def _references(t: torch.Tensor) -> int:
    """References to ``t``'s storage other than this call's: its tensors (each view one)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1  # (less ``storage``, this wrapper)


@torch.library.custom_op("fxopt::released", mutates_args=())
def released(t: torch.Tensor) -> None:
    """Return once ``t``'s storage is referenced by ``t`` alone: the collective's work that made
    it (held by the process group's worker thread) has been let go, and with it any buffer the
    work kept. ``t`` is a collective's output right after its wait, before anything reads it."""
    _until_alone(t)


@released.register_fake
def _(t):
    return None


# Not dead code: the graph reads nothing it returns, but the step must wait where it is.
torch.fx.node.has_side_effect(torch.ops.fxopt.released.default)


@torch.library.custom_op("fxopt::reduce_scatter", mutates_args=())
def reduce_scatter(input: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    """``wait_tensor(reduce_scatter_tensor(input, reduce_op, group_size, group_name))`` of
    ``torch.distributed._functional_collectives``, on a gloo group: the copy of ``input`` gloo
    would reduce in made here, all-reduced in place through an alias (the work holds the alias, so
    its release shows on the copy's storage), freed once the worker thread has let go of it; this
    rank's chunk of it (dim 0) returned. Its two halves (below) one after the other."""
    return reduce_scatter_wait(reduce_scatter_issue(input, reduce_op, group_size, group_name), group_size, group_name)


@reduce_scatter.register_fake
def _(input, reduce_op, group_size, group_name):
    return input.new_empty((input.shape[0] // group_size, *input.shape[1:]))


# `reduce_scatter` split in two, where the step waits for a gradient's reduce-scatter later than
# it issues it (`fxopt.passes.waits.wait_for_release`, as the plan's simulator places the wait,
# `fxopt.solvers.prefetch`): the backward computes on while gloo's worker thread reduces.

@torch.library.custom_op("fxopt::reduce_scatter_issue", mutates_args=())
def reduce_scatter_issue(input: torch.Tensor, reduce_op: str, group_size: int, group_name: str) -> torch.Tensor:
    """The first half of `reduce_scatter`: the copy of ``input`` gloo would reduce in, made here,
    its all-reduce issued in place through an alias (the work holds the alias), the copy returned
    for `reduce_scatter_wait`. ``input`` may be freed as soon as this returns; the copy (the whole
    gradient) lives until the wait."""
    copy = input.clone(memory_format=torch.contiguous_format)
    torch.ops._c10d_functional.all_reduce_(copy.view(copy.shape), reduce_op, group_name)
    return copy


@reduce_scatter_issue.register_fake
def _(input, reduce_op, group_size, group_name):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxopt::reduce_scatter_wait", mutates_args=())
def reduce_scatter_wait(copy: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """The second half of `reduce_scatter`: wait for the all-reduce `reduce_scatter_issue` issued on
    ``copy`` (``wait_tensor``), until gloo's worker thread has let go of it (`released`'s test), and
    return this rank's chunk of it (dim 0). The copy dies with its last reference, this op's
    argument, right after."""
    from torch.distributed import get_rank
    from torch.distributed.distributed_c10d import _resolve_process_group

    torch.ops._c10d_functional.wait_tensor(copy)
    _until_alone(copy)
    return copy.chunk(group_size)[get_rank(_resolve_process_group(group_name))].clone()


@reduce_scatter_wait.register_fake
def _(copy, group_size, group_name):
    return copy.new_empty((copy.shape[0] // group_size, *copy.shape[1:]))
