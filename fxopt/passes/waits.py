"""An all-reduce's wait moved to just before the first op that reads its result, so that the
backward computes on while the process group reduces (the overlap eager DDP has).

The joint graph traces each functional collective with its wait right after it (under tracing,
``funcol`` waits at once), so the backward would stop at every gradient's all-reduce until it is
done. The gradients' all-reduces (`fxopt.distributed.ddp`) are read by nothing but the backward's
outputs (or by the sum of a tied parameter's uses), so their waits can go that late:

    before:  r = all_reduce(mul(g_w2, s), "sum", pg); w = wait_tensor(r); g_h = mm(g_y, w2); ...
             return (w, ...)
    after:   r = all_reduce(mul(g_w2, s), "sum", pg); g_h = mm(g_y, w2); ...; w = wait_tensor(r)
             return (w, ...)

The memory is the same: ``wait_tensor`` returns the tensor it waits on, which the all-reduce made
when it was issued and which lives to the end as a gradient; the simulator counts it from the
all-reduce on (`fxopt.analysis.scratch`). Only the all-reduces' waits move: a reduce-scatter's
gloo copy is freed late by the waits that follow it (`fxopt.solvers.graph.Node.lingers`), which
the simulator models at the traced positions.

On gloo, each all-gather's and reduce-scatter's wait is followed by ``fxopt::released``
(`wait_for_release`): the step goes on once gloo's worker thread has let go of the collective's
work, so that a gathered parameter is freed at its last read, as the plan counts it, not later at
a moment the OS scheduler decides (see `fxopt.ops.collectives`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.analysis.costs import GATHERS, REDUCES, WAITS, group_backend

# The collectives whose outputs gloo's worker thread may hold past their wait (`wait_for_release`).
RELEASED = GATHERS + ("reduce_scatter_tensor",)


def _is_all_reduce_wait(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace != "_c10d_functional" or target._opname not in WAITS or not node.args:
        return False
    source = node.args[0]
    return (isinstance(source, fx.Node) and isinstance(source.target, torch._ops.OpOverload)
            and source.target.namespace == "_c10d_functional" and source.target._opname in REDUCES)


def sink_all_reduce_waits(graph: fx.Graph) -> fx.Graph:
    """``graph`` with each all-reduce's wait just before its first reader (in place)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for wait in [n for n in graph.nodes if _is_all_reduce_wait(n)]:
        first = min(wait.users, key=order.__getitem__, default=None)
        if first is not None and order[first] > order[wait] + 1:
            first.prepend(wait)
    return graph


def _collective_waited(node: fx.Node) -> fx.Node | None:
    """The functional collective ``node`` waits on, where ``node`` is a wait."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    if target.namespace != "_c10d_functional" or target._opname not in WAITS or not node.args:
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node) or not isinstance(source.target, torch._ops.OpOverload):
        return None
    return source if source.target.namespace == "_c10d_functional" else None


def wait_for_release(graph: fx.Graph) -> fx.Graph:
    """``graph`` with ``fxopt::released`` right after the wait of each all-gather and
    reduce-scatter on a gloo group (or a group this process cannot name, as the analysis assumes
    gloo there), in place: each collective's output is then the step's alone before anything
    reads it."""
    import fxopt.ops.collectives  # noqa: F401 - registers torch.ops.fxopt.released

    for wait in list(graph.nodes):
        source = _collective_waited(wait)
        if source is None or source.target._opname not in RELEASED or group_backend(source) not in ("gloo", None):
            continue
        with graph.inserting_after(wait):
            graph.call_function(torch.ops.fxopt.released.default, (wait,))
    return graph
