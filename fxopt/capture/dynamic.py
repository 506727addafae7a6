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
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxopt.analysis import JointGraph
from fxopt.analysis.symbolic import Sizes, error_on_new_guards
from fxopt.buckets import Bucket, bucket_of
from fxopt.capture.dynamo import Answered, CapturedStep, PlanReady, step_backend, unread_resident_bytes
from fxopt.capture.shapes import DynamicDims, SpecializedError, check_symbolic, symbol_names
from fxopt.passes.recompute import split_with_recompute
from fxopt.planner import Options, analyze_for_planning, make_plan, plan_range

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
    # Instead, stop with what this returns for the step captured (a `CapturedStep`), its symbols'
    # names and its shape environment: `Answered` (`fxopt.plan_ahead.capture_symbolic`'s stamping).
    ask: Callable | None = None


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
    seen = {"names": {}, "unread": 0, "inputs": []}
    ranges = state.dims.ranges

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_):
        state.captures += 1
        fake_mode = detect_fake_mode(joint_inputs)
        shape_env = getattr(fake_mode, "shape_env", None)
        if shape_env is None:
            return plan_and_split(joint, num_fwd_outputs)
        if state.ask is not None:
            captured = (CapturedStep(joint, num_fwd_outputs, seen["unread"], seen["inputs"]), seen["names"], shape_env)
            try:
                check_symbolic(shape_env, seen["names"], ranges)
            except SpecializedError as err:
                err.captured = captured  # (it holds where the guard does: a caller that narrows may keep it)
                raise
            raise Answered(state.ask(*captured))
        check_symbolic(shape_env, seen["names"], ranges)
        # Nothing fxopt does to the step (its rewrites, analysis, plans) may add a guard: that
        # would narrow the shapes the compiled step accepts.
        with error_on_new_guards(shape_env):
            return plan_and_split(joint, num_fwd_outputs)

    def plan_and_split(joint: fx.GraphModule, num_fwd_outputs: int):
        t0 = time.perf_counter()
        names = seen["names"]
        if state.analyze_at is not None:
            raise Analyzed(*analyze_for_planning(joint, num_fwd_outputs, options, seen["unread"],
                                                 Sizes(names, state.analyze_at, ranges)))
        if state.buckets is None:
            jg, plan, state.buckets = plan_range(joint, num_fwd_outputs, options, seen["unread"],
                                                 Sizes(names, ranges.top(), ranges))
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

    def name_symbols(gm: fx.GraphModule, example_inputs) -> None:
        seen["names"] = symbol_names(gm, state.call_dims)
        seen["unread"] = unread_resident_bytes(resident, example_inputs)
        seen["inputs"] = list(example_inputs)

    return step_backend(partition, options, name_symbols)
