"""Where the step's collectives are issued and waited for. An all-reduce's wait moved to just before
the first op that reads its result, so that the backward computes on while the process group
reduces (the overlap eager DDP has); each forward all-gather issued ahead of its first use as the
plan's simulator issues it (`issue_gathers_ahead`, `fxopt.solvers.prefetch`).

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
all-reduce on (`fxopt.analysis.scratch`). A gradient's reduce-scatter holds more in flight (on
gloo, a copy of the whole gradient, `fxopt.solvers.graph.Node.lingers`), so its wait moves in the
plan's schedule, as far as the plan's memory allows (`fxopt.solvers.prefetch.prefetched`), and the
backward follows that order (`fxopt.passes.recompute`).

On gloo, each all-gather's wait is followed by ``fxopt::released``, and each reduce-scatter with
its wait becomes ``fxopt::reduce_scatter`` (`wait_for_release`), or, where the wait is later than
the issue, ``fxopt::reduce_scatter_issue`` there and ``fxopt::reduce_scatter_wait`` at the wait:

    before:  rs = reduce_scatter_tensor(g_w2, "sum", 2, pg); h = mm(g_y, w2); w = wait_tensor(rs)
    after:   c = fxopt::reduce_scatter_issue(g_w2, "sum", 2, pg); h = mm(g_y, w2)
             w = fxopt::reduce_scatter_wait(c, 2, pg)

The step goes on once gloo's
worker thread has let go of the collective's work, so that a gathered parameter, or gloo's copy of
a gradient it reduces in, is freed where the plan counts it, not later at a moment the OS scheduler
decides (see `fxopt.ops.collectives`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.analysis.costs import GATHERS, REDUCES, WAITS, group_backend


def issue_gathers_ahead(graph: fx.Graph, order: list[str], gathers: set[str]) -> fx.Graph:
    """``graph`` (a forward) with each all-gather named in ``gathers`` moved right before the node
    that follows it in ``order`` (the forward's steps by name as the simulator runs them,
    `fxopt.solvers.schedule.forward_order`; nodes of the graph it does not name stay where they
    are), in place: each gather is issued ahead of its wait, so the process group gathers the
    next block's parameter while the step computes this one's:

        before:  ag1 = all_gather(s1); w1 = wait(ag1); h1 = mm(x, w1); ag2 = all_gather(s2); w2 = wait(ag2); ...
        after:   ag1 = all_gather(s1); w1 = wait(ag1); ag2 = all_gather(s2); h1 = mm(x, w1); w2 = wait(ag2); ...
    """
    by_name = {n.name: n for n in graph.nodes}
    steps = [by_name[name] for name in order if name in by_name]
    for k in range(len(steps) - 2, -1, -1):  # (from the last: a gather moves before one moved already)
        if steps[k].name in gathers:
            steps[k + 1].prepend(steps[k])
    return graph


def _is_all_reduce_wait(node: fx.Node) -> bool:
    source = _collective_waited(node)
    return source is not None and source.target._opname in REDUCES


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
    """``graph`` with ``fxopt::released`` right after the wait of each all-gather on a gloo group
    (or a group this process cannot name, as the analysis assumes gloo there), and each such
    reduce-scatter and its wait replaced by ``fxopt::reduce_scatter`` where the reduce-scatter was
    issued (the wait right after it), or by ``fxopt::reduce_scatter_issue`` there and
    ``fxopt::reduce_scatter_wait`` where it is waited for, in place: each collective's buffers
    are then freed where the plan frees them."""
    import fxopt.ops.collectives  # noqa: F401 - registers torch.ops.fxopt.*

    for wait in list(graph.nodes):
        source = _collective_waited(wait)
        if source is None or group_backend(source) not in ("gloo", None):
            continue
        if source.target._opname in GATHERS:
            with graph.inserting_after(wait):
                graph.call_function(torch.ops.fxopt.released.default, (wait,))
        elif source.target._opname == "reduce_scatter_tensor" and len(source.users) == 1:
            if source.next is wait:  # (waited for where issued: one op)
                with graph.inserting_before(source):
                    both = graph.call_function(torch.ops.fxopt.reduce_scatter.default, source.args)
                both.meta.update(wait.meta)
                wait.replace_all_uses_with(both)
            else:  # (waited for later: issued here, waited for there)
                _, _, group_size, group_name = source.args
                with graph.inserting_before(source):
                    issue = graph.call_function(torch.ops.fxopt.reduce_scatter_issue.default, source.args)
                if "val" in source.args[0].meta:  # (the copy: the input's shape and dtype)
                    issue.meta["val"] = source.args[0].meta["val"]
                with graph.inserting_before(wait):
                    done = graph.call_function(torch.ops.fxopt.reduce_scatter_wait.default,
                                               (issue, group_size, group_name))
                done.meta.update(wait.meta)
                wait.replace_all_uses_with(done)
            graph.erase_node(wait)
            graph.erase_node(source)
    return graph
