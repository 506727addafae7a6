"""Planning a model's step ahead of running it: what `fxopt.plan`, `fxopt.optimize` with
``example_inputs``, `fxopt.pipeline`'s stages, `fxopt.max_batch` and ``fxopt inspect`` share.

Each compiles the model with a backend that stops once the planner has planned
(`fxopt.capture.dynamo.PlanReady`), runs it once on the example inputs and keeps what the planner
made: the plan and the rewritten forward and backward (`plan_and_rewrite`), or for a range of
shapes the analysed graphs (`capture_symbolic`). The model is not changed and no backward runs.
The planner itself (options to plan, the fallbacks, the plan cache) is `fxopt.planner`; the
user-facing functions and `FxoptModule` are `fxopt.api`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map_only

from fxopt.analysis.costs import CostModel
from fxopt.analysis.symbolic import Sizes, error_on_new_guards
from fxopt.budget import BudgetLike
from fxopt.capture.compiled import compile_step, run_compiled
from fxopt.capture.dynamic import Analyzed, DynamicState, make_dynamic_backend
from fxopt.capture.dynamo import Answered, CapturedStep, PlanReady, make_backend, of_compiled_step
from fxopt.capture.repeat import LONG, SHORT, NotStamped, Run, repeated_run, stamped_joint
from fxopt.capture.shapes import DynamicDims, SpecializedError, capture_settings, check_symbolic, mark
from fxopt.devices import DeviceProfile
from fxopt.distributed import data_parallel, ddp as ddp_graph
from fxopt.errors import CaptureError, GraphBreakError, InfeasibleBudgetError
from fxopt.options import Options
from fxopt.planner import Analyses, analyze_for_planning, heap_frozen, meta_device_message
from fxopt.storage import storages, tensors_in
from fxopt.units import format_bytes

T = TypeVar("T")
log = logging.getLogger("fxopt")


def plan_and_rewrite(model: nn.Module, budget: BudgetLike | Options, example_inputs: Sequence[Any], *,
                     plan_only: bool = False, **options: Any) -> PlanReady:
    """Like `plan`, and also the rewritten forward and backward modules (before any compiler):
    ``.plan``, ``.forward``, ``.backward``. ``plan_only``: the caller only plans (the modules
    returned do not run), so a run of identical blocks may be captured as three and four and
    stamped out (`fxopt.capture.repeat`, where ``options.stamp``)."""
    return _capture_and_plan(model, Options.of(budget, **options), example_inputs, None, plan_only)


def plan_each(model: nn.Module, options: Options, example_inputs: Sequence[Any],
              ask: Callable[[Callable[[Options], PlanReady]], T], *, plan_only: bool = False) -> T:
    """Several plans of one capture: ``model``'s step captured once (as ``options`` says: its
    ``device``, ``compiler``), then ``ask(plan)`` is called, and ``plan(asked)`` plans a copy of
    the captured step for the `Options` ``asked`` as `plan_and_rewrite` would (its `PlanReady`,
    or its `InfeasibleBudgetError` raised); what ``ask`` returns. ``asked.device`` must be
    ``options.device``. (`fxopt.fit` asks for the smallest budget and a budget of one capture.)
    A graph the plans analyse alike (the step as captured, and as rewritten for planning, with the
    same analysis settings) is analysed once for all of them (`fxopt.planner.Analyses`).
    ``plan_only``: as for `plan_and_rewrite`."""
    return _capture_and_plan(model, options, example_inputs, ask, plan_only)


def _capture_and_plan(model: nn.Module, options: Options, example_inputs: Sequence[Any], ask, plan_only: bool):
    with heap_frozen():  # (the capture's full collections too: see `heap_frozen`)
        return _captured_and_planned(model, options, example_inputs, ask, plan_only)


def _captured_and_planned(model: nn.Module, options: Options, example_inputs: Sequence[Any], ask, plan_only: bool):
    if options.device is not None:
        return _plan_on_fake_tensors(model, options, example_inputs, ask, plan_only)
    check_model(model)
    distributed = data_parallel.DistributedStep(model) if data_parallel.fsdp_units(model) else None
    if distributed is not None and distributed.in_pieces:
        raise GraphBreakError(
            "this FSDP2 model's step is not one graph (FSDP's hooks run between its blocks), so fxopt plans it "
            "block by block as it runs: use fxopt.optimize(model, budget) and read its .plans after the first step")
    # An FSDP2 model planned as one graph: its shards gathered in the step (fxopt.distributed.fsdp2).
    gathering = distributed.one_graph.gathering() if distributed is not None else contextlib.nullcontext()
    held = 0
    if data_parallel.is_ddp(model):  # the step DDP runs, with DDP's buckets beside it
        data_parallel.check_ddp(model)
        if ddp_graph.not_one_graph(model) is None:  # its all-reduces in the graph, as fxopt.optimize runs it
            gathering = ddp_graph.OneGraph(model).reducing()
        held, model = data_parallel.bucket_bytes(model), model.module
    args, kwargs = split_inputs(example_inputs)
    # (each plan of one capture analyses what an earlier one analysed no more: `Analyses`)
    answer = None if ask is None else lambda step: ask(functools.partial(step.plan, analyses=Analyses()))
    # (A fraction with Inductor is of Inductor's own step, measured on the step captured whole.)
    stamp = plan_only and options.stamp and distributed is None and not held and not of_compiled_step(options)
    run = repeated_run(model) if stamp else None
    if run is not None:
        try:
            return _stamped(model, run, options, args, kwargs, answer or (lambda step: step.plan(options, copy=False)))
        except NotStamped as why:
            log.info("fxopt: capturing all %d blocks of %s: %s", len(run.keys), type(run.holder).__name__, why)
    return _capture(model, options, args, kwargs, answer, gathering, held)


def _capture(model: nn.Module, options: Options, args: tuple, kwargs: dict, ask, gathering=contextlib.nullcontext(),
             held: int = 0):
    """``model``'s step captured and planned for ``options`` (its `PlanReady`), or, with ``ask``,
    what ``ask`` returns for the `CapturedStep`."""
    backend = make_backend(options, lambda plan: None, stop_after_plan=True, resident=model, held_bytes=held, ask=ask)
    compiled = compile_step(model, backend, fullgraph=True, dynamic=False)
    try:
        with gathering:
            run_compiled(compiled, args, kwargs, options.compiler)
    except PlanReady as ready:
        return ready
    except Answered as answered:
        return answered.answer
    except InfeasibleBudgetError as err:
        if any(p.grad is not None for p in model.parameters()):
            raise
        raise with_accumulation_note(err, model) from None
    raise CaptureError(
        "nothing to plan: the captured step has no backward (no input or parameter requires grad, "
        "or it ran under torch.no_grad())"
    )


def _stamped(model: nn.Module, run: Run, options: Options, args: tuple, kwargs: dict, answer):
    """``answer(step)`` for the step of the whole ``run``, stamped out from its captures cut to
    three blocks and to four (`fxopt.capture.repeat`); `NotStamped` where it cannot be, before
    ``answer`` is called (whatever ``answer`` raises is the answer's)."""
    blocks = run.blocks
    answering = []

    def whole(long: CapturedStep):
        joint = stamped_joint(short, long, run)
        per_block = _unread(blocks[1], long.inputs)
        step = dataclasses.replace(long, joint=joint, unread_bytes=long.unread_bytes + (len(blocks) - LONG) * per_block)
        answering.append(True)
        return answer(step)

    try:
        with run.cut_to(SHORT):
            short = _capture(model, options, args, kwargs, lambda step: step)
        with run.cut_to(LONG):
            return _capture(model, options, args, kwargs, whole)
    except NotStamped:
        raise
    except Exception as err:  # noqa: BLE001 - a model that does not run cut short: captured whole
        if answering:
            raise
        raise NotStamped(f"its step did not capture with the run cut short ({type(err).__name__}: {err})") from err


def _unread(block: nn.Module, inputs: list) -> int:
    """Bytes of ``block``'s parameters, buffers and gradients its step does not read."""
    read = storages(list(inputs))
    return sum(n for key, n in storages(block, grads=True).items() if key not in read)


def _plan_on_fake_tensors(model: nn.Module, options: Options, example_inputs: Any, ask, plan_only: bool):
    """`plan_and_rewrite` (or `plan_each`) for ``options.device``: the step captured and planned
    on fake tensors of the host (`FakeStep`), counted and priced as the profile says
    (`for_profile`)."""
    fake = FakeStep.of(model, options.device)
    inputs = fake.inputs(example_inputs)
    on_fake = None if ask is None else lambda plan: ask(lambda asked: plan(for_profile(asked, model)))
    with fake.mode:
        return _capture_and_plan(fake.model, for_profile(options, model), inputs, on_fake, plan_only)


@dataclasses.dataclass(frozen=True)
class FakeStep:
    """A copy of ``model`` on fake tensors of the host (FakeTensorMode: no memory, no kernel runs
    but the host's scratch measurements), sharing nothing with it but its structure: each
    parameter and buffer, on any device the meta one included, becomes a fake tensor of its shape,
    dtype and strides (tied weights stay tied); `inputs` does the same to example inputs.

    The fake tensors are on the CPU for every profile: torch fakes a CUDA tensor only in a CUDA
    build (a CPU build fails at the first kernel's device guard), so a CUDA profile's step is the
    one this host's torch captures (its choice of attention kernel, say), with the
    profile's memory semantics applied by the analysis (`fxopt.analysis.analyze`'s ``device``)."""

    model: nn.Module
    mode: FakeTensorMode
    memo: dict

    @classmethod
    def of(cls, model: nn.Module, profile: DeviceProfile) -> FakeStep:
        if not isinstance(model, nn.Module):
            raise TypeError(f"fxopt optimizes an nn.Module, got {type(model).__name__}")
        if profile.kind != "cpu" and profile.scratch_measured:
            raise CaptureError(f"device={profile.name!r}: its scratch is marked measured, but a table measured on a "
                               f"{profile.kind} device is not read yet; set scratch.measured to false in "
                               f"{profile.path} (its default_factor is then the bound)")
        step = cls(model, FakeTensorMode(allow_non_fake_inputs=True), {})
        for t in [*model.parameters(), *model.buffers()]:
            step._fake(t)
        return dataclasses.replace(step, model=copy.deepcopy(model, step.memo))

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.memo:
            with self.mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            self.memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return self.memo[id(t)]

    def inputs(self, example_inputs: Any) -> Any:
        return tree_map_only(torch.Tensor, lambda t: self._fake(t).requires_grad_(t.requires_grad), example_inputs)


def for_profile(options: Options, model: nn.Module) -> Options:
    """``options`` for planning ``model``'s step on fake tensors for ``options.device``: the
    analysis counts its memory (``planned_for``) and, for a device not this host, the cost model
    is the profile's rates at the dtype most of the model's floating-point state is in (unless
    one was given)."""
    profile = options.device
    replaced: dict[str, Any] = dict(device=None, planned_for=profile)
    if profile.kind != "cpu" and options.cost_model == CostModel():
        replaced["cost_model"] = CostModel.for_device(profile, math_dtype(model))
    return dataclasses.replace(options, **replaced)


def math_dtype(model: nn.Module) -> torch.dtype:
    """The floating-point dtype that most of ``model``'s parameter and buffer bytes are in (float32
    for a model with none)."""
    by_dtype: dict[torch.dtype, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel() * t.element_size()
    return max(by_dtype, key=by_dtype.__getitem__, default=torch.float32)


def with_accumulation_note(err: InfeasibleBudgetError, model: nn.Module) -> InfeasibleBudgetError:
    """``err`` (about a step that starts with no gradients) saying for which step its minimum
    holds, and the minimum of the steps that start with the gradients held (gradient
    accumulation): those hold the gradients through the whole step besides what it allocates, so
    their minimum is this one plus the gradients' bytes."""
    grads = sum(storages([p for p in model.parameters() if p.requires_grad]).values())
    if not grads:
        return err
    note = (f"That minimum is for a step that starts without gradients (after optimizer.zero_grad()); a step that "
            f"starts with them held (gradient accumulation, or zero_grad(set_to_none=False)) also holds "
            f"{format_bytes(grads)} of gradients through it and needs at least {format_bytes(err.min_budget + grads)} "
            f"({err.min_budget + grads} bytes).")
    return err.with_detail(note)


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs`` as the (args, kwargs) of ``model(...)``: a dict is keyword arguments, a
    tensor the one positional argument, anything else the positional arguments."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        args, kwargs = tuple(example_inputs), {}
    if any(t.device.type == "meta" for t in tensors_in([args, kwargs])):
        raise CaptureError(meta_device_message("example inputs are"))
    return args, kwargs


def check_model(model: Any) -> None:
    """Refuse what fxopt cannot plan: not an nn.Module, or one with state on the meta device."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxopt optimizes an nn.Module, got {type(model).__name__}")
    on_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if on_meta:
        raise CaptureError(meta_device_message(f"{len(on_meta)} of the model's parameters and buffers "
                                               f"({', '.join(on_meta[:3])}{', ...' if len(on_meta) > 3 else ''}) are"))


def capture_symbolic(model: nn.Module, example_inputs: Any, dims: DynamicDims, point: dict,
                     options: Options | None = None):
    """Capture ``model``'s step on ``example_inputs`` with the ``dims`` symbolic and analyse it at
    ``point``, without planning or running it: (the step as captured, the step rewritten as
    planning starts from), as `fxopt.analysis.JointGraph`s; ``options``: how it is analysed (the
    defaults if None; the budget is not read). A range the captured graph holds for only in part (a size of 1 set
    apart) is narrowed to the part holding ``point``, once (a stamped run's three-block capture kept
    for it where its guards hold there: `_holding`). With ``options.device``: on fake
    tensors, for that profile (as `plan_and_rewrite`). A run of identical blocks is stamped out
    as for a plan (`fxopt.capture.repeat`, where ``options.stamp``: nothing captured here runs)."""
    if options is not None and options.device is not None:
        fake = FakeStep.of(model, options.device)
        inputs = fake.inputs(example_inputs)
        with fake.mode:
            return capture_symbolic(fake.model, inputs, dims, point, for_profile(options, model))
    check_model(model)
    args, kwargs = split_inputs(example_inputs)
    options = dataclasses.replace(options or Options(budget=1), offload=False)
    run = repeated_run(model) if options.stamp else None
    short = None  # the three-block capture, where it holds on the range narrowed
    for attempt in range(2):
        try:
            if run is not None:
                try:
                    return _symbolic_stamped(model, run, args, kwargs, dims, point, options, short)
                except NotStamped as why:
                    log.info("fxopt: capturing all %d blocks of %s: %s", len(run.keys), type(run.holder).__name__,
                             why)
                    run = None
            return _capture_symbolic(model, args, kwargs, dims, options, point=point)
        except SpecializedError as err:
            name, (lo, hi) = err.holds if err.holds is not None else (None, (0, -1))
            if attempt or name not in dims.ranges.bounds or not lo <= point[name] <= hi:
                raise
            dims = dataclasses.replace(dims, ranges=dims.ranges.with_bound(name, lo, hi))
            short = _holding(getattr(err, "short", None), dims)


def _capture_symbolic(model: nn.Module, args: tuple, kwargs: dict, dims: DynamicDims, options: Options, *,
                      point: dict | None = None, ask=None):
    """One capture of `capture_symbolic`: the analysed graphs at ``point``, or what ``ask``
    returns for the step captured (see `fxopt.capture.dynamic.DynamicState.ask`)."""
    state = DynamicState(dims)
    state.analyze_at, state.ask = point, ask
    state.call_dims = dims.dims(model, args, kwargs)
    compiled = compile_step(model, make_dynamic_backend(options, state, model), fullgraph=True, dynamic=None)
    try:
        with capture_settings():
            mark(state.call_dims, dims.ranges)
            run_compiled(compiled, args, kwargs, options.compiler)
    except Analyzed as done:
        return done.eager, done.rewritten
    except Answered as answered:
        return answered.answer
    raise CaptureError("nothing to analyse: the captured step has no backward (no input or parameter requires "
                       "grad, or it ran under torch.no_grad())")


def _holding(short, dims: DynamicDims):
    """``short`` (a three-block capture that failed `check_symbolic` on a wider range) where its
    guards hold on all of ``dims``'s ranges (so it is the step there, as a capture marked with
    them would be), else None."""
    if short is None:
        return None
    _, names, shape_env = short
    try:
        check_symbolic(shape_env, names, dims.ranges)
    except SpecializedError:
        return None
    return short


def _symbolic_stamped(model: nn.Module, run: Run, args: tuple, kwargs: dict, dims: DynamicDims, point: dict,
                      options: Options, kept=None):
    """`capture_symbolic` of the whole ``run`` stamped out from its captures cut to three blocks
    and to four (as `_stamped`): the stamped graph is the three-block capture's, its sizes in that
    capture's symbols, analysed as the capture's partitioner would. ``kept``: a three-block
    capture made for a wider range whose guards hold on ``dims``'s (`_holding`), not captured
    again unless the four-block capture, made for ``dims``, does not stamp from it."""
    if kept is not None:
        try:
            return _stamp_symbolic(model, run, args, kwargs, dims, point, options, kept)
        except NotStamped as why:
            log.info("fxopt: capturing three blocks again for the range narrowed: %s", why)
    return _stamp_symbolic(model, run, args, kwargs, dims, point, options, None)


def _stamp_symbolic(model: nn.Module, run: Run, args: tuple, kwargs: dict, dims: DynamicDims, point: dict,
                    options: Options, kept):
    blocks = run.blocks
    answering = []

    def analysed(long: CapturedStep, names: dict, shape_env):
        # (Where the caller froze the heap (`fxopt.max_batch`: `fxopt.planner.heap_frozen`), the
        # two captures' graphs frozen too, then the stamped one: stamping and analysing N blocks
        # on symbolic fake values allocate enough for several full collections.)
        with heap_frozen():
            joint = stamped_joint(short[0], long, run)
        unread = long.unread_bytes + (len(blocks) - LONG) * _unread(blocks[1], long.inputs)
        answering.append(True)
        _, short_names, short_env = short
        guards = error_on_new_guards(short_env) if short_env is not None else contextlib.nullcontext()
        with heap_frozen(), guards:
            return analyze_for_planning(joint, long.num_fwd_outputs, options, unread,
                                        Sizes(short_names, point, dims.ranges))

    try:
        if kept is not None:
            short = kept
        else:
            with run.cut_to(SHORT):
                try:
                    short = _capture_symbolic(model, args, kwargs, dims, options, ask=lambda *captured: captured)
                except SpecializedError as err:
                    err.short = err.captured  # (kept for the range narrowed: `_holding`)
                    raise
        with run.cut_to(LONG):
            return _capture_symbolic(model, args, kwargs, dims, options, ask=analysed)
    except (NotStamped, SpecializedError):  # (a range to narrow: `capture_symbolic` narrows it, and stamps again)
        raise
    except Exception as err:  # noqa: BLE001 - a model that does not capture cut short: captured whole
        if answering:
            raise
        raise NotStamped(f"its step did not capture with the run cut short ({type(err).__name__}: {err})") from err
