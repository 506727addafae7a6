"""The public entry points: `optimize` and `plan`, and `FxoptModule`, the model `optimize` returns.
Planning ahead of the first call (``example_inputs``, `plan`) is `fxopt.plan_ahead`."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from fxopt.budget import BudgetLike
from fxopt.capture.compiled import compile_step, run_compiled
from fxopt.capture.coverage import check_whole, sequence_number
from fxopt.capture.dynamo import PlanReady, make_backend
from fxopt.buckets import Bucket, bucket_of
from fxopt.capture.dynamic import DynamicState, make_dynamic_backend
from fxopt.capture.pieces import GRAPH_BREAKS, PiecewiseBackend, Step
from fxopt.capture.shapes import DynamicDims, capture_settings, mark
from fxopt.distributed.data_parallel import DistributedStep
from fxopt.errors import CaptureError, GraphBreakError, InfeasibleBudgetError, check_choice
from fxopt.options import Options
from fxopt.plan_ahead import check_model, plan_and_rewrite, split_inputs, with_accumulation_note
from fxopt.planner import refuse_device
from fxopt.solvers.plan import Plan
from fxopt.storage import module_tensors, storages
from fxopt.units import format_bytes


class _WithTheOriginalsSignature:
    """`FxoptModule.forward` as an instance sees it: the method, carrying the original model's
    signature, so that code inspecting ``model.forward`` finds the model's arguments (HF's
    ``Trainer`` drops every dataset column that ``forward`` does not name)."""

    def __init__(self, method: Callable):
        self.method = method
        functools.update_wrapper(self, method)

    def __get__(self, obj: FxoptModule | None, cls=None):
        if obj is None:
            return self.method
        bound = functools.partial(self.method, obj)
        if "_signature" not in obj.__dict__:
            try:
                obj.__dict__["_signature"] = inspect.signature(obj.original.forward)
            except (TypeError, ValueError):  # a forward inspect cannot read: keep (*args, **kwargs)
                obj.__dict__["_signature"] = inspect.signature(bound)
        bound.__signature__ = obj.__dict__["_signature"]
        return bound


def held_gradient_bytes(params: list[torch.Tensor]) -> int:
    """Bytes of the gradients already there as a call starts (each storage once)."""
    grads = [p.grad for p in params if p.grad is not None]
    return sum(storages(grads).values()) if grads else 0


class FxoptModule(nn.Module):
    """A model whose training step fxopt plans and rewrites. Used like the original: it shares
    the original's parameters, buffers and submodules (and so its ``state_dict``); forward,
    ``loss.backward()`` and ``optimizer.step()`` work as before. Each new input signature is
    captured and planned at its first call; ``plans`` holds every plan, ``plan`` the latest.
    Pickled (``torch.save``), it keeps its plans and options; the compiled steps are made again
    at the first call after loading."""

    def __init__(self, model: nn.Module, options: Options, graph_breaks: str = "split",
                 dynamic: DynamicDims | None = None):
        super().__init__()
        check_choice("graph_breaks", graph_breaks, GRAPH_BREAKS)
        # Share the original's state, so parameters(), state_dict() and .to() are the original's.
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["_modules"] = model._modules
        self.__dict__["_model"] = model
        self.__dict__["_options"] = options
        self.__dict__["plans"] = []
        self.__dict__["_graph_breaks"] = graph_breaks
        self.__dict__["_dims"] = dynamic
        distributed = DistributedStep(model)
        distributed.check(graph_breaks, options.budget.bytes is not None, dynamic is not None)
        self.__dict__["_distributed"] = distributed
        self._new_compiled_state()
        self.training = model.training

    def _new_compiled_state(self) -> None:
        # One compiled step per amount of gradient memory held when a step starts (see `_step_for`);
        # with ``dynamic=``, one `DynamicRun` per such amount instead.
        self.__dict__["_steps"] = {}
        self.__dict__["_dynamic_runs"] = {} if self._dims is None else {
            0: DynamicRun(self._model, self._options, self._dims, self.plans)}
        # Eval-mode calls with gradients held whose step (forward and backward) is infeasible, by the
        # gradient bytes held: their forward runs without a backward (`_forward_only`).
        self.__dict__["_forward_only_steps"] = {}

    def __getstate__(self) -> dict:
        # Compiled steps hold torch.compile's state and closures, which do not pickle: made again.
        state = super().__getstate__()
        for name in ("_steps", "_dynamic_runs", "_forward_only_steps", "_signature"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._new_compiled_state()

    def _step_for(self, held_gradient_bytes: int) -> tuple[PiecewiseBackend, Callable, list[Callable]]:
        """The backend, the compiled step and the compiled calls of the submodules between FSDP2
        units (`fxopt.distributed.data_parallel.eager_modules`) of steps that start with
        ``held_gradient_bytes`` of gradients already there (0 normally; the accumulated
        gradients under gradient accumulation, or zeroed ones after
        ``zero_grad(set_to_none=False)``). Those stay alive through the whole step beside what it
        allocates, so such a step is captured and planned on its own, counting them
        (`fxopt.capture.dynamo.unread_resident_bytes`): torch.compile's guards do not look at
        ``.grad``, so one compiled step could not tell the two apart."""
        if held_gradient_bytes not in self._steps:
            model, options = self._model, self._options
            if held_gradient_bytes and options.plan is not None:
                # A given plan was made for a step without them: planned anew where it does not fit.
                options = dataclasses.replace(options, plan_from_examples=True)

            def piece_backend(budget, on_plan, whole, backward_bytes):
                # A whole step counts the parameters, buffers and gradients it does not read, and
                # what DDP holds; a piece's reserve counts everything it does not take, the
                # gradients later pieces make beside its backward only (see fxopt.capture.pieces).
                held = backend.step.held if backend.step is not None else 0
                return make_backend(dataclasses.replace(options, budget=budget), on_plan,
                                    resident=model if whole else None, held_bytes=held if whole else 0,
                                    backward_bytes=backward_bytes, whole_step=whole)

            # (The plans a run of the step runs with; a piece may be planned again once the whole step
            # is known, `fxopt.capture.pieces.PiecewiseBackend`.)
            backend = PiecewiseBackend(options.budget, piece_backend, self._graph_breaks, on_plan=self.plans.append,
                                       unreached_gradients_undefined=options.compiler == "eager")
            distributed = self._distributed
            compiled = compile_step(distributed.target(), backend, fullgraph=self._graph_breaks == "error",
                                    dynamic=False)
            between = distributed.compile_between(
                lambda call: compile_step(call, backend, fullgraph=False, dynamic=False))
            backend.entries = frozenset().union(*(c.entry_codes for c in (compiled, *between)))
            self._steps[held_gradient_bytes] = backend, compiled, between
        return self._steps[held_gradient_bytes]

    @property
    def _dynamic(self) -> DynamicRun | None:
        """The calls of a module planned with ``dynamic=`` that start with no gradient held."""
        return self._dynamic_runs.get(0)

    @property
    def buckets(self) -> list[Bucket] | None:
        """With ``dynamic=``: the shapes each plan is for, once planned (see `fxopt.buckets`)."""
        return None if self._dynamic is None else self._dynamic.state.buckets

    @property
    def plan(self) -> Plan | None:
        """The latest plan: the one given or made at construction, then the latest made (with
        ``dynamic=``: the plan for the largest shapes)."""
        if self._dynamic is not None:
            return self.buckets[-1].plan if self.buckets else None
        return self.plans[-1] if self.plans else self._options.plan

    @property
    def step_plans(self) -> list[Plan]:
        """The plans the latest call ran with, one per piece of its step in the order they ran
        (one for a step captured whole; a step in pieces is planned again once its first call has
        shown every piece, `fxopt.capture.pieces.PiecewiseBackend`); [] before a call, and with
        ``dynamic=``."""
        return list(self.__dict__.get("_step_plans", ()))

    @property
    def peak_bound_bytes(self) -> int | None:
        """The most the plans made so far let the step hold at once: the largest, over the plans, of
        what the rest of the step holds beside the piece (nothing for a whole step) plus the
        piece's predicted peak; at most the budget. None before a plan is made. (With
        ``dynamic=``: the highest of the buckets' plans, each at the top of its bucket.)"""
        if self._dims is not None:
            return max((p.peak_bytes for p in self.plans), default=None)
        return max((b for backend, _, _ in self._steps.values() for b in backend.bounds), default=None)

    @property
    def original(self) -> nn.Module:
        return self._model

    @_WithTheOriginalsSignature
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # (One walk of the model a call, each parameter under each of its names: the held
        # gradients' count and the step's record, `Step.start`, both read it.)
        tensors = module_tensors(self._model, remove_duplicate=False)
        held = held_gradient_bytes(tensors[0])
        if self._dims is not None:
            if held not in self._dynamic_runs:
                self._dynamic_runs[held] = DynamicRun(self._model, self._options, self._dims, self.plans)
            return self._dynamic_runs[held](args, kwargs)
        forward_only = not self.training and held and torch.is_grad_enabled()
        if forward_only and held in self._forward_only_steps:
            return self._forward_only(self._forward_only_steps[held], args, kwargs)
        try:
            return self._run_step(held, args, kwargs, tensors)
        except InfeasibleBudgetError as err:
            if not held:
                raise with_accumulation_note(err, self._model) from None
            err = err.with_detail(f"This step starts with {format_bytes(held)} of gradients already there "
                               "(gradient accumulation, or zero_grad(set_to_none=False)), alive through the whole "
                               "step; optimizer.zero_grad() (set_to_none, the default) before it frees them.")
            if not forward_only:
                raise err from None
            self._forward_only_steps[held] = err
            return self._forward_only(err, args, kwargs)

    def _run_step(self, held_gradient_bytes: int, args: tuple, kwargs: dict, tensors=None) -> Any:
        """One call of the compiled step, checked to have run within the graphs fxopt planned.
        ``tensors``: the model's parameters and buffers, as `Step.start` takes them, where walked."""
        backend, compiled, between = self._step_for(held_gradient_bytes)
        distributed = self._distributed
        ddp = distributed.running_ddp(self)
        backend.prepare()  # (a step in pieces learned from its last call: planned again before this one)
        step = backend.step = Step.start(self._model, [args, kwargs], held=lambda: distributed.held_beside(ddp),
                                         wrapping=distributed, tensors=tensors)
        try:
            out = distributed.call(functools.partial(run_compiled, compiler=self._options.compiler), compiled,
                                   between, args, kwargs)
        finally:
            backend.step = None
        step.check_covered(out)
        backend.learn(step)
        self.__dict__["_step_plans"] = [p.plan for p in step.pieces if p.plan is not None]
        return out

    def _forward_only(self, refusal: InfeasibleBudgetError, args: tuple, kwargs: dict) -> Any:
        """An eval-mode call with gradients held whose whole step is infeasible (``refusal``): its
        forward runs without a backward, as an evaluation needs (no activation is kept), and a
        backward through its outputs raises ``refusal``."""
        with torch.no_grad():
            out = self._run_step(0, args, kwargs)
        err = refusal.with_detail("This call ran in eval mode with gradients held, so fxopt ran its forward "
                           "only; to train in eval mode, zero the gradients first or raise the budget.")
        anchor = torch.empty(0, requires_grad=True)  # makes the outputs need a backward, as eager's do
        return tree_map_only(torch.Tensor, lambda t: _BackwardRefused.apply(err, t, anchor)
                             if t.is_floating_point() else t, out)

    def train(self, mode: bool = True) -> FxoptModule:
        self._model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_model")
            if model is None:  # being unpickled or copied: no state yet
                raise
            return getattr(model, name)

    def extra_repr(self) -> str:
        return f"budget={self._options.budget!r}, solver={self._options.solver!r}"


class _BackwardRefused(torch.autograd.Function):
    """The identity, whose backward raises the error it was given (see `FxoptModule._forward_only`)."""

    @staticmethod
    def forward(ctx, error: Exception, t: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.error = error
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise ctx.error


class DynamicRun:
    """The calls of a module planned for a range of shapes: each call runs the compiled graph of
    its shape's bucket (`fxopt.buckets`); the first call captures and plans them all."""

    def __init__(self, model: nn.Module, options: Options, dims: DynamicDims, plans: list[Plan]):
        self.model, self.options, self.plans = model, options, plans
        self.state = DynamicState(dims)
        self.compiled: dict[int | None, Any] = {}
        self.recorded = False

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        state = self.state
        state.call_dims = state.dims.dims(self.model, args, kwargs)
        state.point = state.dims.point(state.call_dims)
        if not state.dims.ranges.contains(state.point) or state.buckets and not any(
                b.ranges.contains(state.point) for b in state.buckets):
            planned = [dict(b.ranges.bounds) for b in state.buckets or []] or dict(state.dims.ranges.bounds)
            raise ValueError(f"this call's shape {state.point} is outside the ranges fxopt planned for "
                             f"({planned}); widen them")
        k = bucket_of(state.buckets, state.point) if state.buckets else None
        if k not in self.compiled:
            backend = make_dynamic_backend(self.options, state, self.model)
            self.compiled[k] = compile_step(self.model, backend, fullgraph=True, dynamic=None)
        since = sequence_number()
        try:
            with capture_settings():
                mark(state.call_dims, state.dims.ranges)
                out = run_compiled(self.compiled[k], args, kwargs, self.options.compiler)
        finally:
            state.call_dims = []
        if k is None and state.buckets:  # the first call planned: its graph is its bucket's
            self.compiled[bucket_of(state.buckets, state.point)] = self.compiled.pop(None)
        self._record_plans()
        # One graph (fullgraph) entered at a frame of fxopt's own is the whole step: nothing else
        # computes, unless Dynamo was off (torch.compiler.set_stance("force_eager"), config.disable).
        if torch.is_grad_enabled():
            check_whole(out, since, planned=_compiled_node, glue=())
        return out

    def _record_plans(self) -> None:
        if self.state.buckets and not self.recorded:
            self.plans.extend(b.plan for b in self.state.buckets)
            self.recorded = True

    def plan_only(self, args: tuple, kwargs: dict) -> None:
        """Capture and plan at this call's shape without running it (the model is not changed)."""
        self.state.stop_after_plan = True
        try:
            self(args, kwargs)
        except PlanReady:
            pass
        finally:
            self.state.stop_after_plan = False
            self.compiled.pop(None, None)
        self._record_plans()
        if self.state.buckets is None:
            raise CaptureError("nothing to plan: the captured step has no backward (no input or parameter "
                               "requires grad, or it ran under torch.no_grad())")


def _compiled_node(node) -> bool:
    """Whether an autograd node is a compiled graph's (every compile of a `DynamicRun` is fxopt's)."""
    return type(node).__name__ == "CompiledFunctionBackward"


def optimize(model: nn.Module, budget: BudgetLike | Options, *, example_inputs: Sequence[Any] | None = None,
             graph_breaks: str = "split", dynamic: dict | None = None, **options: Any) -> FxoptModule:
    """Return ``model`` rewritten so that its training step (forward + backward) peaks within
    ``budget``, recomputing as little as possible.

    ``budget``: the peak (see `fxopt.Options.budget`: bytes, a size such as ``"3GiB"``, a share
    of the eager peak, or ``"min"``), or a whole `fxopt.Options`. ``options``: the other fields
    of `fxopt.Options` by name (``solver=``, ``time_limit=``, ``compiler=``, ``compress=``,
    ``quantize=``, ``offload=``, ``plan=`` to replay a plan, ...).

    Without ``example_inputs`` the step is planned at the first call (and again for each new
    input shape); with them it is planned now, so errors such as `InfeasibleBudgetError` surface
    here.

    ``graph_breaks``: what to do when torch.compile cannot capture the forward in one graph
    (``.item()`` steering control flow, an unsupported call). ``"split"`` (default): plan the
    pieces in order, each against the budget minus what the rest of the step holds while it runs
    (see `fxopt.capture.pieces`; the budget must then be in bytes, and a `GraphBreakWarning` names the
    break). ``"error"``: raise `CaptureError`. Logging and printing inside forward() are not
    breaks: ``print`` and ``warnings.warn`` run after the captured graph, ``logging.Logger``
    calls are skipped while the optimized step runs.

    ``dynamic``: plan once for a range of input shapes instead of once per shape, e.g.
    ``{"batch": (1, 32), "seq": (2, 512)}`` (``"batch"``: dim 0 of every tensor argument;
    ``"seq"``: dim 1 of those with two or more; ``(argument, dim)``: one dimension of one
    argument, by position or name). The step is captured once with those dimensions symbolic,
    planned at the largest shape and proven within the budget at every smaller one, or split into
    a few buckets of shapes, each with its own plan and graph (see docs/dynamic-shapes.md). A
    fraction budget is of the eager peak at the largest shape. The step must be one graph; a call
    outside the ranges raises.
    """
    check_model(model)
    options = Options.of(budget, **options)
    refuse_device(options)
    check_choice("graph_breaks", graph_breaks, GRAPH_BREAKS)
    if dynamic is not None:
        return _optimize_dynamic(model, options, DynamicDims.parse(dynamic), example_inputs)
    if example_inputs is not None and options.plan is None:
        try:
            options = dataclasses.replace(options, plan_from_examples=True,
                                          plan=plan(model, options, example_inputs))
        except GraphBreakError:
            if graph_breaks != "split":
                raise
            # A step in pieces is planned piece by piece at its first call.
    return FxoptModule(model, options, graph_breaks)


def _optimize_dynamic(model: nn.Module, options: Options, dims: DynamicDims, example_inputs) -> FxoptModule:
    if options.plan is not None:
        raise ValueError("dynamic= plans for a range of shapes; plan= replays one plan for one shape")
    module = FxoptModule(model, options, "error", dims)
    if example_inputs is not None:
        # Plan now (errors surface here): capture and plan at the examples' shape, without the
        # backward (no gradient is accumulated).
        args, kwargs = split_inputs(example_inputs)
        module._dynamic.plan_only(args, kwargs)
    return module


def plan(model: nn.Module, budget: BudgetLike | Options, example_inputs: Sequence[Any], **options: Any) -> Plan:
    """Capture and plan the training step of ``model`` on ``example_inputs`` without running it.

    ``budget``, ``options``: as for `optimize` (the fields of `fxopt.Options`). ``example_inputs``:
    the positional arguments of ``model(...)`` (a tuple or list; a dict is passed as keyword
    arguments). Returns a `Plan`; raises `InfeasibleBudgetError` (with ``.min_budget``) when no
    schedule fits. ``compiler``: the one the plan is for (Inductor's graph passes may change the
    captured graph a little, so a plan replays on its own compiler).
    """
    return plan_and_rewrite(model, budget, example_inputs, plan_only=True, **options).plan
