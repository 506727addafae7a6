"""The backend of a step planned for a range of shapes (``fxopt.optimize(..., dynamic=...)``).

The first call captures the step with dynamic shapes and plans every bucket of the range at
once (`fxopt.buckets`); each bucket's graph is captured at the first call in it, and replays its
plan. The partitioner sees the joint graph with symbolic sizes: before planning it checks that
the step holds for the whole range (`fxopt.capture.shapes.check_symbolic`), and while fxopt reads
it no decision of fxopt's may depend on a size (`fxopt.analysis.joint.no_new_guards`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxopt.analysis import JointGraph, analyze
from fxopt.analysis.symbolic import Sizes
from fxopt.buckets import Bucket, bucket_of, plan_buckets, range_infeasible
from fxopt.capture.dynamo import PlanReady, eager_backend, unread_resident_bytes
from fxopt.capture.shapes import DynamicDims, check_symbolic, symbol_names
from fxopt.errors import CaptureError, InfeasibleBudgetError
from fxopt.fxgraph import copy_module
from fxopt.passes import masks
from fxopt.passes.dropout import alias_identity_dropouts, recompute_dropout_from_mask
from fxopt.passes.recompute import split_with_recompute
from fxopt.planner import Options, make_plan

log = logging.getLogger("fxopt")


@dataclasses.dataclass
class DynamicState:
    """What the compiled objects of one module share: the named dims and their ranges, the
    buckets once planned, and the call in progress (its dims and shape)."""

    dims: DynamicDims
    buckets: list[Bucket] | None = None
    call_dims: list = dataclasses.field(default_factory=list)  # (tensor, dim, name) of the call
    point: dict = dataclasses.field(default_factory=dict)
    captures: int = 0  # joint graphs captured
    plans: int = 0  # plans made (a bucket replaying its plan makes none)
    stop_after_plan: bool = False  # raise `PlanReady` once planned (`fxopt.optimize` with example inputs)
    analyze_at: dict | None = None  # only analyse, at this shape, and raise `Analyzed` (`fxopt.max_batch`)


class Analyzed(Exception):
    """Raised from the partitioner once a step captured with dynamic shapes is analysed:
    ``eager``, the step as captured; ``rewritten``, after the rewrites planning starts from
    (dropout recomputed from its mask, ReLU's backward reading a mask)."""

    def __init__(self, eager: JointGraph, rewritten: JointGraph):
        super().__init__("analysed")
        self.eager, self.rewritten = eager, rewritten


def make_dynamic_backend(options: Options, state: DynamicState, resident: torch.nn.Module):
    """A torch.compile backend for one bucket's compiled object (or, before any plan, the first)."""
    if options.offload not in (None, False):
        raise ValueError("OFFLOAD is not offered with dynamic shapes (its copies take time that depends "
                         "on the shape, so one plan is not proven for a range); pass offload=False")
    options = dataclasses.replace(options, offload=False)
    seen = {"names": {}, "unread": 0}
    ranges = state.dims.ranges

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_):
        state.captures += 1
        fake_mode = detect_fake_mode(joint_inputs)
        shape_env = getattr(fake_mode, "shape_env", None)
        if shape_env is None:
            return plan_and_split(joint, num_fwd_outputs)
        check_symbolic(shape_env, seen["names"], ranges)
        # Nothing fxopt does to the step (its rewrites, analysis, plans) may add a guard: that
        # would narrow the shapes the compiled step accepts.
        with shape_env.error_on_new_guards():
            return plan_and_split(joint, num_fwd_outputs)

    def plan_and_split(joint: fx.GraphModule, num_fwd_outputs: int):
        t0 = time.perf_counter()
        names = seen["names"]
        if state.analyze_at is not None:
            raise _analyzed(joint, num_fwd_outputs, options, seen["unread"], Sizes(names, state.analyze_at, ranges))
        if state.buckets is None:
            sizes = Sizes(names, ranges.top(), ranges)
            try:
                jg, plan = make_plan(joint, num_fwd_outputs, options, seen["unread"], sizes=sizes)
            except InfeasibleBudgetError as err:
                codecs = dict(compress=options.compress, quantize=options.quantize, sizes=sizes,
                              unread_resident_bytes=seen["unread"])
                raise range_infeasible(analyze(joint, num_fwd_outputs, options.cost_model, **codecs), err,
                                       options.solver) from None
            if jg.symbolic is None:
                raise CaptureError("dynamic= was given but the captured step has no symbolic size: "
                                   "every dimension it names was specialized")
            jg.symbolic.check_monotone()
            state.buckets = plan_buckets(jg, plan, solver=options.solver, time_limit=options.time_limit)
            state.plans += len({id(b.plan) for b in state.buckets if b.plan.solver != "save_all"})
            schedule = state.buckets[bucket_of(state.buckets, state.point)].plan.schedule
            if state.stop_after_plan:
                raise PlanReady(plan)
        else:
            bucket = state.buckets[bucket_of(state.buckets, state.point)]
            sizes = Sizes(names, bucket.ranges.top(), ranges)
            jg, plan = make_plan(joint, num_fwd_outputs, dataclasses.replace(options, plan=bucket.plan),
                                 seen["unread"], sizes=sizes)
            schedule = plan.schedule
        fw, bw = split_with_recompute(jg, schedule)
        log.debug("fxopt: planned and rewrote the dynamic step in %.2f s", time.perf_counter() - t0)
        return fw, bw

    if options.compiler == "inductor":
        from fxopt.capture.inductor import inductor_backend

        compile_step = inductor_backend(partition, options.inductor_config)
    else:
        compile_step = eager_backend(partition)

    def compile_dynamic(gm: fx.GraphModule, example_inputs):
        seen["names"] = symbol_names(gm, state.call_dims)
        seen["unread"] = unread_resident_bytes(resident, example_inputs)
        return compile_step(gm, example_inputs)

    return compile_dynamic


def _analyzed(joint: fx.GraphModule, num_fwd_outputs: int, options: Options, unread: int, sizes: Sizes) -> Analyzed:
    """The step analysed as captured, and after the rewrites `fxopt.planner.make_plan` applies."""
    codecs = dict(compress=options.compress, quantize=options.quantize, unread_resident_bytes=unread, sizes=sizes)
    alias_identity_dropouts(joint)
    eager = analyze(copy_module(joint), num_fwd_outputs, options.cost_model, **codecs)
    rewritten = recompute_dropout_from_mask(joint) + (masks.relu_masks(joint) if options.compress else 0)
    jg = analyze(joint, num_fwd_outputs, options.cost_model, **codecs) if rewritten else eager
    return Analyzed(eager, jg)
