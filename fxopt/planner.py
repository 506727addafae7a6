"""The planner: from a captured joint graph and the user's options to a plan.

analyze (`fxopt.analysis`) → the mask passes (`fxopt.passes.dropout`, `fxopt.passes.masks`) →
resolve the budget against the simulated eager peak → the plan cache (`fxopt.cache`) → solve
(`fxopt.solvers`), with the planner's fallbacks (`_solve`, the only place they live): a budget the
codecs or the ReLU-mask rewrite make infeasible is planned without them. A plan made from example
inputs that does not fit a later graph is planned anew.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.fx as fx

from fxopt.distributed.fsdp import agreed_plan
from fxopt import cache
from fxopt.analysis import analyze as analyze_step
from fxopt.analysis.bandwidth import device_transfers
from fxopt.analysis.symbolic import Sizes
from fxopt.budget import Budget
from fxopt.buckets import plan_buckets, range_infeasible
from fxopt.errors import CaptureError, InfeasibleBudgetError
from fxopt.fxgraph import copy_module
from fxopt.options import Options
from fxopt.passes import masks
from fxopt.passes.coalesce import coalesce_all_reduces
from fxopt.passes.decompose import reduction_scratch
from fxopt.passes.dropout import alias_identity_dropouts, recompute_dropout_from_mask
from fxopt.passes.accumulate import sum_gradients_in_place
from fxopt.passes.loss import loss_backward_in_place
from fxopt.passes.reorder import in_plan_order, reorder_step
from fxopt.solvers.plan import Plan
from fxopt.solvers.transfers import Transfers
from fxopt.solvers import eager_timeline, simulate, solve
from fxopt.solvers.effort import Deadline, effort_of, now
from fxopt.solvers.graph import Graph, is_lossy_codec
from fxopt.solvers.minimum import floor_of, infeasible, memo_key
from fxopt.solvers.stages import solve_stage

log = logging.getLogger("fxopt")

# When the wait for the plan now being made began, on the safety stop's clock (the planning
# thread's CPU time, `fxopt.solvers.effort.now`): the call that captures the step
# (`capture_clock`), or the end of the previous plan in it (a step in pieces). The solvers get what
# capture left of the time limit (a safety stop: the solvers' effort is counted, not timed), so
# that no answer takes much more than ``time_limit`` seconds of that thread's work end to end.
_CAPTURE_STARTED: contextvars.ContextVar[float | None] = contextvars.ContextVar("fxopt_capture_started",
                                                                               default=None)

# The least share of the time limit the solvers get, however long capture took (a large step's
# capture alone may take longer than the limit).
MIN_SOLVE_SHARE = 0.5


@contextlib.contextmanager
def capture_clock():
    """Around a call that may capture and plan a step: planning's time limit counts from here."""
    token, told = _CAPTURE_STARTED.set(now()), _TOLD.set(False)
    try:
        yield
    finally:
        _CAPTURE_STARTED.reset(token)
        _TOLD.reset(told)


# The calls (`capture_clock`) already told that their capture took more than the time limit left
# the solvers: said once per call.
_TOLD: contextvars.ContextVar[bool] = contextvars.ContextVar("fxopt_capture_overran", default=False)


def solve_seconds(options: Options) -> float:
    """The solvers' share of ``options.time_limit``: what capture left of it (`capture_clock`),
    at least `MIN_SOLVE_SHARE` of it. Where capture left less than that, the answer may take
    longer than the limit: said once per call, with what would shorten the capture."""
    started = _CAPTURE_STARTED.get()
    spent = 0.0 if started is None else now() - started
    least = MIN_SOLVE_SHARE * options.time_limit
    if options.time_limit - spent < least and started is not None and not _TOLD.get():
        _TOLD.set(True)
        fake = "" if options.planned_for is not None else ("plan on fake tensors (fxopt.plan(..., device='cpu'), no "
                                                           "kernel runs), ")
        log.warning("fxopt: capturing the step took %.1f s (CPU) of time_limit=%g s; the solvers still get %.1f s, so "
                    "this answer may take up to %.1f s of CPU. A shorter capture: %sa smaller example batch or sequence "
                    "(the graph is the same), or a larger time_limit.", spent, options.time_limit, least, spent + least,
                    fake)
    return max(least, options.time_limit - spent)

def transfers(joint: fx.GraphModule, options: Options) -> Transfers | None:
    """The bandwidths OFFLOAD is planned with, or None where it is off: a replayed plan's own (so
    a plan replays on the graph it was made for), else the device's (`fxopt.analysis.bandwidth`).
    ``options.offload`` None: on where the step's tensors are on a CUDA device; a host memory
    limit: on, within it (`Transfers.host_budget`)."""
    if options.plan is not None:
        return options.plan.graph.transfers
    devices = {v.device for n in joint.graph.find_nodes(op="placeholder")
               for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)}
    device = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
    profile = options.planned_for
    kind = device.type if profile is None else profile.kind
    on = options.offload is not False and (options.offload is not None or kind == "cuda")
    if not on:
        return None
    if profile is not None and profile.host_link_bytes_per_second:  # (the profile's link, not one measured here)
        link = profile.host_link_bytes_per_second
        return Transfers(d2h_bytes_per_s=link, h2d_bytes_per_s=link, host_budget=options.host_budget)
    return dataclasses.replace(device_transfers(device), host_budget=options.host_budget)


def make_plan(joint: fx.GraphModule, num_fwd_outputs: int, options: Options, unread_resident_bytes: int = 0,
              sizes: Sizes | None = None, *, backward_bytes: int = 0, analyses: Analyses | None = None,
              whole_step: bool = True, compiled_peak_bytes: int | None = None):
    """The step ``joint`` analysed, and its plan. ``unread_resident_bytes``, ``sizes`` (a step
    captured with dynamic shapes, planned at ``sizes.point``), ``backward_bytes`` (held beside its
    backward only): see `fxopt.analysis.analyze`. A budget of ``"min"``: the smallest budget the
    solvers meet on this analysis of the step (`_at_smallest_budget`), then planned at it.
    ``analyses``: the graphs analysed for the plans made before this one from copies of the same
    capture (`Analyses`; `fxopt.plan_ahead.plan_each`), not analysed again. ``whole_step``: the
    graph is a whole training step, not a piece of one (`fxopt.analysis.analyze`).
    ``compiled_peak_bytes``: the measured peak of the compiler's own step (Inductor's:
    `fxopt.capture.inductor`), which a fractional budget is then a share of, not of eager's."""
    refuse_device(options)  # (`fxopt.plan` plans it on fake tensors, with device=None)
    refuse_meta_tensors(joint)
    coalesce_all_reduces(joint)  # DDP's gradients reduced in buckets, as its reducer does (eager too)
    with heap_frozen():
        jg, plan = _make_plan(joint, num_fwd_outputs, options, unread_resident_bytes, sizes, backward_bytes, analyses,
                              whole_step, compiled_peak_bytes)
    if options.planned_for is not None:  # (also on a plan from the cache: two profiles may make one graph)
        plan = dataclasses.replace(plan, planned_for=options.planned_for.planning_note())
    agreed = agreed_plan(joint, plan)  # a step with collectives inside: one plan on every rank
    if agreed is plan:
        return jg, plan
    step = _step_of(agreed, jg)  # (rank 0 may have kept the other order)
    if step is None:
        raise RuntimeError("the ranks captured different graphs of a step with collectives inside (another model, "
                           "input shape or dtype on some rank): every rank must run the same step")
    return step, agreed


def _make_plan(joint: fx.GraphModule, num_fwd_outputs: int, options: Options, unread_resident_bytes: int,
               sizes: Sizes | None, backward_bytes: int, analyses: Analyses | None, whole_step: bool,
               compiled_peak_bytes: int | None = None):
    # Budgets given as a fraction are of the step as eager autograd runs it: simulate that before
    # the passes below change what the backward reads (and analyze again only if they did).
    codecs = _codecs(options, unread_resident_bytes, sizes, backward_bytes, whole_step)
    analyze = _analyzer(joint, options, analyses)
    alias_identity_dropouts(joint)  # (eager makes no copy there: neither does the step, planned or not)
    before = analyze(joint, num_fwd_outputs, options.cost_model, **codecs) if options.plan is None else None
    # A plan made from example inputs may not fit this graph (another shape, autocast): keep the
    # graph as captured, to plan it anew from there if so (the passes below rewrite it in place).
    pristine = copy_module(joint) if options.plan is not None and options.plan_from_examples else None
    rewritten, relu = _rewrite_for_planning(joint, options)
    # (the rewrites touch a few nodes of thousands: what they left alone is read from ``before``)
    jg = before if before is not None and not rewritten else analyze(joint, num_fwd_outputs, options.cost_model,
                                                                      earlier=before, **codecs)

    def without_relu_masks():
        masks.undo_relu_masks(joint)
        return _as_compiled(analyze(joint, num_fwd_outputs, options.cost_model, **codecs), options)

    eager_graph = before.graph if before is not None else None
    if options.plan is not None:
        given = _given_plan(options, jg)
        if given is None and relu:
            jg = without_relu_masks()
            given = _given_plan(options, jg)
        if given is None and options.plan_from_examples:
            if relu:
                masks.relu_masks(joint)
                jg = analyze(joint, num_fwd_outputs, options.cost_model, **codecs)
            before = analyze(pristine, num_fwd_outputs, options.cost_model, **codecs)
            eager_graph = before.graph
            options = dataclasses.replace(options, plan=None, plan_from_examples=False)
            if options.budget.minimum:  # this graph's own minimum, planned from the graph as captured
                return make_plan(pristine, num_fwd_outputs, options, unread_resident_bytes, sizes,
                                 backward_bytes=backward_bytes, analyses=analyses, whole_step=whole_step)
        elif given is None:
            raise CaptureError(
                "the given plan was made for a different graph (another model, input shape, dtype, "
                "compress= or quantize= setting "
                "or torch version); re-plan with fxopt.plan(model, budget, example_inputs)"
            )
        else:
            return given
    eager = cache.lowest_peaks.eager(eager_graph, lambda: eager_timeline(eager_graph))
    jg = _as_compiled(jg, options)  # (after eager's peak: a share is of the step eager runs)
    if options.budget.minimum:
        def masked_again():
            masks.relu_masks(joint)
            return _as_compiled(analyze(joint, num_fwd_outputs, options.cost_model, **codecs), options)

        jg, options = _at_smallest_budget(jg, options, eager.peak_bytes, without_relu_masks if relu else None,
                                          masked_again)
    return _planned(jg, options, eager.peak_bytes, without_relu_masks if relu else None, compiled_peak_bytes)


def _planned(jg, options: Options, eager_peak_bytes: int, without_relu_masks, compiled_peak_bytes: int | None = None):
    """The analysed step ``jg`` planned within ``options``' budget (a share of ``eager_peak_bytes``,
    or of ``compiled_peak_bytes`` where that was measured, or bytes), or read from the plan cache:
    (the step as planned, the plan). ``without_relu_masks``: the step analysed again without its
    ReLU masks (None: it has none), for the fallbacks of `_solve`."""
    budget = options.budget.resolve(eager_peak_bytes if compiled_peak_bytes is None else compiled_peak_bytes)
    cache_key = cache.key(jg.graph, budget, options.solver_key(), effort_of(options.effort)) if _through_cache(
        options) else None
    cached = cache.load(cache_key) if cache_key is not None else None
    if cached is not None:
        step = _step_of(cached, jg)
        if step is None and without_relu_masks is not None:  # planned without the ReLU masks
            step = _step_of(cached, without_relu_masks())
        return step, dataclasses.replace(cached, compiled_peak_bytes=compiled_peak_bytes)
    log.info("fxopt: planning a step of %d nodes for a budget of %d bytes", len(jg.graph), budget)
    t0 = time.perf_counter()
    planned = dict(budget_bytes=budget, eager_peak_bytes=eager_peak_bytes, compiled_peak_bytes=compiled_peak_bytes)
    try:
        jg, solution = _solve_in_order(jg, options, planned, without_relu_masks, solve_seconds(options))
    finally:
        if _CAPTURE_STARTED.get() is not None:
            _CAPTURE_STARTED.set(now())  # the next piece's wait starts now
    plan = Plan.build(
        graph=jg.graph,
        schedule=solution.schedule,
        **planned,
        solver=solution.solver,
        status=solution.status,
        solve_seconds=time.perf_counter() - t0,
        fingerprint=jg.fingerprint,
        module_paths=jg.module_paths,
        timeline=solution.timeline,
        lower_bound_cost=solution.lower_bound_cost,
        reordered=jg.reordered,
    )
    log.info("%s", plan.summary())
    if cache_key is not None and not solution.stopped:  # (a plan the time limit cut short may differ next time)
        cache.store(cache_key, plan)
    return jg, plan


def _through_cache(options: Options) -> bool:
    """Whether a plan for ``options`` goes through the plan cache: not with the cache off
    (``FXOPT_CACHE=0``: no key hashed, a whole-step hash), nor one that SAVEs everything
    in the captured order (``solver="save_all"`` without ``reorder``), whose solve is one walk of
    the graph with no search, no dearer than hashing the graph for its key and writing the plan
    (0.11 s against 0.12 s at 5,808 nodes: `fxopt.pipeline`'s 48-layer whole step, planned only
    to choose the cuts, and the loss's plan, each made from a capture of its own every call)."""
    return cache.enabled() and (options.solver != "save_all" or options.reorder)


def _at_smallest_budget(jg, options: Options, eager_peak_bytes: int, without_relu_masks, masked_again):
    """``budget="min"`` on the analysed step itself, asked as a user would: a plan within one byte
    is infeasible, and the error names the smallest budget the solvers meet
    (`InfeasibleBudgetError.min_budget`; the lowest-peak search behind it is in the planner's memo,
    so planning at it does not search again). Returns the step to plan at it (its ReLU masks made
    again where that search undid them: planning at it tries with them first, as at any budget)
    and ``options`` at that budget."""
    undone = []

    def undo():
        undone.append(True)
        return without_relu_masks()

    one_byte = dataclasses.replace(options, budget=Budget(bytes=1, text="1"))
    try:
        _solve_in_order(jg, one_byte, dict(budget_bytes=1, eager_peak_bytes=eager_peak_bytes),
                        undo if without_relu_masks is not None else None, solve_seconds(options))
        least = 1  # a step that holds nothing
    except InfeasibleBudgetError as err:
        least = err.min_budget
    if undone:
        jg = masked_again()
    return jg, dataclasses.replace(options, budget=Budget(bytes=least, text=f"min ({least} bytes)"))


@contextlib.contextmanager
def heap_frozen():
    """Planning with the objects alive when it starts left out of Python's full garbage
    collections (`gc.freeze`), then put back (`gc.unfreeze`). Those objects are the captured
    step's graphs, fake tensors and Dynamo's state: at 32 layers of a small Llama some 650,000
    objects, which each full collection the solvers' allocations trigger walks (0.5-0.7 s each,
    four or five per answer) and finds nothing to free in. Around a capture too
    (`fxopt.plan_ahead`), whose full collections walk the model and what the process held
    before. The objects made since are still collected; what was frozen and freed meanwhile is
    collected after. And with the youngest generation collected every `PLANNING_GC_THRESHOLD`
    allocations at least, not Python's 700: the objects made since the freeze (the stamped graph,
    its fake tensors, the analysis) are walked by each full collection, which Python runs after
    every hundred young ones once they outnumber a quarter of what survived the last (after a
    freeze, nothing): 18 full collections in the 32-layer Llama's 50% answer, 0.8 s of its CPU;
    with the threshold raised, none, and the young collections still free the same cycles. The
    answer does not change. Left alone where the collector is off or the process froze objects
    of its own (their unfreeze is not ours to do)."""
    ours = _HEAP_FROZEN.get()
    if not gc.isenabled() or (gc.get_freeze_count() and not ours):
        yield
        return
    gc.freeze()  # (inside an enclosing call's: what the capture made since is frozen too)
    if ours:
        yield  # (the enclosing call unfreezes)
        return
    token = _HEAP_FROZEN.set(True)
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], PLANNING_GC_THRESHOLD), *threshold[1:])
    try:
        yield
    finally:
        _HEAP_FROZEN.reset(token)
        gc.set_threshold(*threshold)
        gc.unfreeze()


# The youngest generation's collection threshold while planning (`heap_frozen`; Python's is 700).
PLANNING_GC_THRESHOLD = 20_000

# Whether this call froze the heap (`heap_frozen`): an enclosed call freezes what was made since,
# and leaves the unfreezing to it.
_HEAP_FROZEN: contextvars.ContextVar[bool] = contextvars.ContextVar("fxopt_heap_frozen", default=False)


def refuse_device(options: Options) -> None:
    """``device=`` is for planning without running (`fxopt.plan`): refused where a step runs."""
    if options.device is not None:
        raise CaptureError(f"device={options.device.name!r} plans a step without running it: give it to fxopt.plan "
                           "(or fxopt inspect --device), not to fxopt.optimize or the torch.compile backend, which "
                           "plan and run the step on the model's own device")


def refuse_meta_tensors(joint: fx.GraphModule) -> None:
    """A step whose parameters, buffers or inputs are on the meta device has no memory to measure
    (its ops' scratch memory, what they allocate): refuse it rather than plan it wrong."""
    on_meta = [n.name for n in joint.graph.find_nodes(op="placeholder")
               if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type == "meta"]
    if on_meta:
        raise CaptureError(meta_device_message(f"{len(on_meta)} of the captured step's inputs ({', '.join(on_meta[:3])}"
                                               f"{', ...' if len(on_meta) > 3 else ''}) are"))


def meta_device_message(what: str) -> str:
    return (f"{what} on the meta device (a model built under torch.device('meta'), or inputs made there): fxopt "
            "plans a step by measuring what its ops allocate, and meta tensors allocate nothing, so the plan "
            "would be wrong. Build the model and its inputs on a real device before planning (for a model built "
            "on meta: model.to_empty(device='cpu'), then initialize its weights). To plan it without building it, "
            "pass device='cpu' to fxopt.plan: the step is then planned on fake tensors of its shapes.")


def _codecs(options: Options, unread_resident_bytes: int, sizes: Sizes | None, backward_bytes: int = 0,
            whole_step: bool = True) -> dict:
    """The analysis' settings besides the cost model (see `fxopt.analysis.analyze`)."""
    return dict(compress=options.compress, quantize=options.quantize, unread_resident_bytes=unread_resident_bytes,
                sizes=sizes, device=options.planned_for, backward_held_bytes=backward_bytes, whole_step=whole_step)


def _analyzer(joint: fx.GraphModule, options: Options, analyses: Analyses | None = None):
    """`fxopt.analysis.analyze`, its graphs carrying the bandwidths OFFLOAD is planned with
    (`transfers`); a graph ``analyses`` holds, with the same settings, not analysed again."""
    copies = transfers(joint, options)

    def analyze(gm, num_fwd_outputs, cost_model, earlier=None, **codecs):
        def analysed():
            jg = analyze_step(gm, num_fwd_outputs, cost_model, earlier=earlier, **codecs)
            return dataclasses.replace(jg, graph=jg.graph.with_transfers(copies)) if copies is not None else jg

        if analyses is None:
            return analysed()
        return analyses.of(gm, (num_fwd_outputs, cost_model, codecs, copies), analysed)

    return analyze


class Analyses:
    """The analyses (`fxopt.analysis.JointGraph`) made for the plans of one captured step, so that
    no graph is analysed twice with the same settings: `fxopt.fit`'s plans at the smallest budget
    and at its budget (`fxopt.plan_ahead.plan_each`: each plans its own copy of one capture, with
    the same rewrites, the ReLU masks' fallback included). Owned by the call that makes the plans
    and passed to each (`make_plan`'s ``analyses``), never shared between captures. (Within one
    plan it would save nothing: a step's ReLU masks made again after they were undone have new
    names.)

    A graph is known by its nodes' code and scalar marks (`_graph_key`): within one capture,
    the copies' nodes carry the capture's values (shapes, dtypes, module paths) and the planner's
    passes are deterministic, so the same code is the same graph, and its analysis, rebound to the
    copy (`JointGraph.module`), is the one a fresh analysis of the copy makes. The settings (the
    cost model, the codecs' and the bandwidths) are compared by value."""

    def __init__(self) -> None:
        self._known: dict[tuple, list[tuple[tuple, Any]]] = {}

    def of(self, gm: fx.GraphModule, settings: tuple, analyse):
        """``gm``'s analysis with ``settings``: a known one for the same graph, or ``analyse()``."""
        key = _graph_key(gm)
        for known, jg in self._known.get(key, ()):
            if known == settings:
                return dataclasses.replace(jg, module=gm)
        jg = analyse()
        self._known.setdefault(key, []).append((settings, jg))
        return jg


def _graph_key(gm: fx.GraphModule) -> tuple:
    """``gm``'s graph node by node, in order: its name, op, target and arguments (what its code
    says: an argument that is a node shows as its name, unquoted) and its scalar marks (such as
    `fxopt.fxgraph.EAGER_COPIES`, which the analysis reads and the code does not show)."""
    return tuple((n.name, n.op, str(n.target), repr((n.args, n.kwargs)),
                  tuple((k, v) for k, v in n.meta.items() if isinstance(v, (bool, int, float, str))))
                 for n in gm.graph.nodes)


def _as_compiled(jg, options: Options):
    """``jg`` as ``options.compiler`` runs it: with Inductor, each op's workspace at least the
    reductions its decomposition writes to memory (`fxopt.passes.decompose.reduction_scratch`)."""
    if options.compiler != "inductor":
        return jg
    from torch._inductor.decomposition import select_decomp_table

    table, memo = select_decomp_table(), {}
    by_name = {n.name: n for n in jg.module.graph.nodes}
    nodes, changed = list(jg.graph.nodes), False
    for i, name in enumerate(jg.names):
        extra = reduction_scratch(by_name[name], table, memo) if name in by_name else 0
        if extra > nodes[i].workspace:
            nodes[i], changed = dataclasses.replace(nodes[i], workspace=extra), True
    return dataclasses.replace(jg, graph=Graph(tuple(nodes), jg.graph.transfers)) if changed else jg


def _rewrite_for_planning(joint: fx.GraphModule, options: Options) -> tuple[bool, int]:
    """The rewrites planning starts from, in place: dropout recomputed from its mask, (with
    ``loss_in_place``, but not for Inductor, whose graphs are functional) the cross-entropy's
    backward written over its incoming gradient, (not for Inductor either) the sums of a value's
    gradients written over one of them as eager's engine writes them (`passes.accumulate`), and
    (with ``compress``) ReLU's backward reading a bool mask. Whether anything changed, and how
    many ReLU masks were made (`masks.undo_relu_masks` takes them back)."""
    dropout = recompute_dropout_from_mask(joint)
    functional = options.compiler == "inductor"
    loss = loss_backward_in_place(joint) if options.loss_in_place and not functional else 0
    sums = sum_gradients_in_place(joint) if not functional else 0
    relu = masks.relu_masks(joint) if options.compress else 0
    return bool(dropout or loss or sums or relu), relu


def analyze_for_planning(joint: fx.GraphModule, num_fwd_outputs: int, options: Options,
                         unread_resident_bytes: int = 0, sizes: Sizes | None = None):
    """The step analysed as captured and after the rewrites planning starts from (both
    `fxopt.analysis.JointGraph`s), without planning it: what `make_plan` starts from
    (`fxopt.max_batch` reads it)."""
    codecs = _codecs(options, unread_resident_bytes, sizes)
    analyze = _analyzer(joint, options)
    coalesce_all_reduces(joint)  # (as `make_plan`)
    alias_identity_dropouts(joint)  # (as `make_plan`: eager makes no copy there)
    pristine = copy_module(joint)  # (the step as captured, kept for the eager analysis to read at other shapes)
    eager = analyze(joint, num_fwd_outputs, options.cost_model, **codecs)
    rewritten, _ = _rewrite_for_planning(joint, options)
    if not rewritten:
        return eager, eager
    # As `make_plan`: the rewrites touch a few nodes of thousands, and what they left alone (the
    # two slowest per-node parts) is read from the analysis before them. That analysis is then
    # rebound to the copy made before the rewrites, the same graph node for node: the analysis a
    # fresh one of the copy makes (as `Analyses` rebinds one), whose `JointGraph.at` reads the
    # step as captured, not as rewritten.
    planned = analyze(joint, num_fwd_outputs, options.cost_model, earlier=eager, **codecs)
    return dataclasses.replace(eager, module=pristine, reusable=None), planned


def plan_range(joint: fx.GraphModule, num_fwd_outputs: int, options: Options, unread_resident_bytes: int,
               sizes: Sizes):
    """A step captured with dynamic shapes, planned at the top of its range (``sizes.point``), and
    the range split into buckets, each with its plan (`fxopt.buckets`): (the step planned, its
    plan, the buckets). An infeasible budget names the smallest one the whole range needs."""
    try:
        jg, plan = make_plan(joint, num_fwd_outputs, options, unread_resident_bytes, sizes=sizes)
    except InfeasibleBudgetError as err:
        eager = analyze_step(joint, num_fwd_outputs, options.cost_model,
                             **_codecs(options, unread_resident_bytes, sizes))
        raise range_infeasible(eager, err, options.solver) from None
    if jg.symbolic is None:
        raise CaptureError("dynamic= was given but the captured step has no symbolic size: "
                           "every dimension it names was specialized")
    jg.symbolic.check_monotone()
    return jg, plan, plan_buckets(jg, plan, options)


def _given_plan(options: Options, jg):
    """The given plan (or one of its ``alternatives``) made for this graph, if any, with the step
    in its order (`_step_of`): (the step, the plan), or None."""
    for plan in (options.plan, *options.alternatives):
        step = _step_of(plan, jg)
        if step is not None:
            return step, plan
    return None


def _step_of(plan: Plan, jg):
    """``jg`` as ``plan`` was made for it, its ops in the plan's order where one of them was
    reordered (`fxopt.passes.reorder`); None where the plan was made for another graph."""
    names = [n.name for n in plan.graph.nodes]
    if (plan.reordered or jg.reordered) and list(jg.names) != names:
        jg = in_plan_order(jg, names, reordered=plan.reordered)
    return jg if jg is not None and plan.fingerprint == jg.fingerprint else None


def _solve_in_order(jg, options: Options, planned: dict, without_relu_masks, time_limit: float):
    """`_solve`, and with ``options.reorder`` the same in the memory-aware order whose lowest peak
    is below the captured order's (`fxopt.passes.reorder`, a copy of the step; not for a pipeline
    stage): the better solution of the two (lower cost, then lower peak; the captured order on a
    tie). Infeasible only where both are, naming the smaller of their budgets (each plans) and
    the lower of their floors. The time limit, a safety stop, is shared."""
    t0 = now()
    moved = None
    if options.reorder and options.in_flight is None:
        moved = reorder_step(jg, options.solver, effort=effort_of(options.effort), memo=cache.lowest_peaks,
                             time_limit=Deadline(time_limit), mip_solver=options.mip_solver)
    if moved is None:
        return _solve(jg, options, planned, without_relu_masks, time_limit)
    step, order = moved
    log.info("fxopt: also planning the step reordered for memory (%s model, %s): lowest peak %d -> %d bytes",
             order.model, " and ".join(order.phases), order.peak_before, order.peak_after)
    found, errors = [], []
    for tried, undo in ((jg, without_relu_masks), (step, None)):
        left = max(time_limit - (now() - t0), MIN_SOLVE_SHARE * time_limit)
        try:
            found.append(_solve(tried, options, planned, undo, left))
        except InfeasibleBudgetError as err:
            errors.append(err)
    if not found:
        floors = [err.lower_bound for err in errors]
        raise infeasible(planned["budget_bytes"], min(err.min_budget for err in errors),
                         None if None in floors else min(floors)) from None
    return min(found, key=lambda f: (f[1].timeline.cost, f[1].timeline.peak_bytes))


def _solve_one(graph: Graph, budget: int, options: Options, deadline: Deadline, report):
    effort = effort_of(options.effort)
    if options.in_flight is not None:
        return solve_stage(graph, budget, options.in_flight, options.solver, effort=effort, time_limit=deadline,
                           on_progress=report, mip_solver=options.mip_solver, memo=cache.lowest_peaks)
    return solve(graph, budget, options.solver, effort=effort, time_limit=deadline, memo=cache.lowest_peaks,
                 on_progress=report, mip_solver=options.mip_solver)


def solve_graph(graph: Graph, budget: int, options: Options):
    """A solver graph alone solved as the planner solves a step's (the codecs' fallbacks, the
    planner's memo of lowest peaks): the `Solution`, or `InfeasibleBudgetError`."""
    return _solve(_Analyzed(graph), options, {"budget_bytes": budget}, None, options.time_limit)[1]


@dataclasses.dataclass(frozen=True)
class _Analyzed:
    """A solver graph standing in for an analyzed step (`solve_graph`)."""

    graph: Graph


def _solve(jg, options: Options, planned: dict, without_relu_masks, time_limit: float):
    """The analyzed step ``jg`` solved within ``planned["budget_bytes"]``, as (the step planned,
    the solution). The fallbacks, in turn, where nothing fits (`_tries`): the step without its
    lossy codecs, then without any (the solvers do not always find the lowest peak of the larger
    problem they make, with the same effort: never let a codec make a budget infeasible that plans
    without it); with the ReLU masks (``without_relu_masks`` undoes them), the step without them,
    with the same fallbacks. All share ``time_limit``, the safety stop. Where none fits, the error
    names the least of the budgets the tries named (each plans: at it, the tries before fail and
    that one plans) and the lowest of their floors (the step runs either way)."""
    budget, deadline = planned["budget_bytes"], Deadline(time_limit)
    errors: list[InfeasibleBudgetError] = []
    with progress_display() as report:
        for tried, graph in _tries(jg, without_relu_masks, budget, options, errors, report):
            try:
                solution = _solve_one(graph, budget, options, deadline, report)
            except InfeasibleBudgetError as err:
                errors.append(err)
                continue
            if graph is not tried.graph:  # its schedule is one of the step's (fewer codecs, the same values)
                solution = dataclasses.replace(solution, timeline=simulate(tried.graph, solution.schedule))
            return tried, solution
    floors = [err.lower_bound for err in errors]
    raise infeasible(budget, min(err.min_budget for err in errors), None if None in floors else min(floors)) from None


def _tries(jg, without_relu_masks, budget: int, options: Options, errors: list, report):
    """(the analyzed step, the graph to solve) for `_solve`, in turn, each after the previous
    failed (its error in ``errors``): the codecs' fallbacks (`_without_codecs`) of the step, then
    of the step without its ReLU masks, unless it cannot fit and names no smaller budget."""
    yield from _without_codecs(jg, budget, options, report)
    if without_relu_masks is None:
        return
    undone = without_relu_masks()
    floor = floor_of(undone.graph, cache.lowest_peaks)[0]
    if budget < floor and min(err.min_budget for err in errors) <= floor:
        return  # out of reach without them too, and its smallest budget is no lower
    report("no plan fits with ReLU masks; planning without them")
    yield from _without_codecs(undone, budget, options, report)


def _without_codecs(jg, budget: int, options: Options, report):
    """The step's graph, then without its lossy codecs, then without any; not where the budget is
    below the step's proven floor (the codecs only add choices: without them it is out of reach
    too, and the lowest-peak search tried their schedules uncompressed). (The floor is the lowest-
    peak search's, not the instant program's word alone at this budget: that proof is checked by
    planning without them; the floor of its lowest peak is tested against every plan.)"""
    graph = jg.graph
    yield jg, graph
    for lossy_only in (True, False):
        fewer = without_codecs(graph, lossy_only=lossy_only)
        if fewer is graph:
            continue
        searched = cache.lowest_peaks.get(graph, memo_key(options.solver, effort_of(options.effort), True,
                                                          options.mip_solver))
        if budget < max(floor_of(graph, cache.lowest_peaks)[0], searched.floor if searched is not None else 0):
            return
        report("no plan fits with " + ("quantization" if fewer.compressible else "compression")
               + "; planning without it")
        yield jg, fewer
        graph = fewer


def without_codecs(graph: Graph, *, lossy_only: bool) -> Graph:
    """`graph` with no codec on its values (only the lossy ones dropped with ``lossy_only``); the
    graph itself when there is nothing to drop."""
    drop = [i for i, n in enumerate(graph.nodes) if n.codec is not None and (is_lossy_codec(n.codec) or not lossy_only)]
    if not drop:
        return graph
    nodes = list(graph.nodes)
    for i in drop:
        nodes[i] = dataclasses.replace(nodes[i], codec=None, compressed_bytes=0, codec_cost=0.0, codec_flops=0,
                                       codec_workspace=0)
    return Graph(tuple(nodes), graph.transfers)


@contextlib.contextmanager
def progress_display():
    """Where the solver's progress goes: the ``fxopt`` logger, and, when stderr is a terminal
    (and ``FXOPT_PROGRESS`` is not 0), a status line that shows the latest message."""
    show = sys.stderr.isatty() and os.environ.get("FXOPT_PROGRESS", "1") != "0"
    if not show:
        yield lambda msg: log.info("fxopt: %s", msg)
        return
    from rich.console import Console

    with Console(stderr=True).status("fxopt: planning…") as status:
        def report(msg: str) -> None:
            log.info("fxopt: %s", msg)
            status.update(f"fxopt: {msg}")

        yield report
