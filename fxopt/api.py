"""The public entry points: `optimize` and `plan`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from fxopt.analysis import CostModel
from fxopt.analysis.codecs import Quantize
from fxopt.budget import Budget
from fxopt.capture.dynamo import PlanReady, is_graph_break, logging_switches, make_backend, unwrap_compile_error
from fxopt.buckets import Bucket, bucket_of
from fxopt.capture.dynamic import Analyzed, DynamicState, make_dynamic_backend
from fxopt.capture.pieces import GRAPH_BREAKS, PiecewiseBackend, Step, budget_bytes as _budget_bytes
from fxopt.capture.shapes import DynamicDims, SpecializedError, capture_settings, mark
from fxopt.distributed import data_parallel
from fxopt.errors import BudgetError, CaptureError, FxoptError, GraphBreakError, InfeasibleBudgetError, check_choice
from fxopt.planner import Options, capture_clock
from fxopt.solvers import DEFAULT_TIME_LIMIT
from fxopt.solvers.plan import Plan
from fxopt.storage import storages, tensors_in
from fxopt.units import format_bytes

# Dynamo keeps one compiled entry per input signature (and per fxopt module of the same class);
# past its limit it would silently run eagerly. fxopt raises instead, after this many.
RECOMPILE_LIMIT = 64


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxopt optimizes an nn.Module, got {type(model).__name__}")


@contextlib.contextmanager
def _dynamo_settings():
    cfg = torch._dynamo.config
    # Dynamo's DDP optimizer would split the step at DDP's bucket boundaries: fxopt plans it whole
    # (see fxopt.distributed.data_parallel).
    patch = {"recompile_limit": max(cfg.recompile_limit, RECOMPILE_LIMIT), "optimize_ddp": False}
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        patch["fail_on_recompile_limit_hit"] = True
    with cfg.patch(**patch), logging_switches():
        yield


_GLOBAL_MODULE_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                        "_global_backward_hooks", "_global_forward_hooks_always_called",
                        "_global_forward_hooks_with_kwargs")


@contextlib.contextmanager
def _dispatch_modes_see_the_step(compiler: str):
    """Let a TorchDispatchMode around the call (``FlopCounterMode``, a memory tracker) see the
    rewritten step's ops, recomputations included, instead of making Dynamo skip the frame:
    such a mode is told to ignore compile internals for the call, as torch does for modes that
    ask (it is off while compiling and on while the compiled graphs run)."""
    from torch.utils import _python_dispatch as pd

    modes = [m for m in pd._get_current_dispatch_mode_stack()
             if not m.is_infra_mode() and not m.ignore_compile_internals()]
    if not modes:
        yield
        return
    if compiler != "eager":
        names = ", ".join(sorted({type(m).__name__ for m in modes}))
        raise FxoptError(
            f"{names} cannot see inside kernels that Inductor generates, so it would miscount "
            "this fxopt step; run it with compiler='eager' (fxopt.optimize(..., compiler='eager')) "
            "where the mode must see every op"
        )
    for mode in modes:
        mode.ignore_compile_internals = lambda: True
    flag = getattr(pd, "_is_in_any_mode_without_ignore_compile_internals", None)
    if flag is not None:
        pd._is_in_any_mode_without_ignore_compile_internals = False
    # Modes that attribute ops to modules (FlopCounterMode's ModuleTracker) install global module
    # hooks; the step is one graph now, so it is attributed to the fxopt module as a whole.
    hook_dicts = [getattr(nn.modules.module, name) for name in _GLOBAL_MODULE_HOOKS
                  if hasattr(nn.modules.module, name)]
    stashed = [dict(d) for d in hook_dicts]
    for d in hook_dicts:
        d.clear()
    try:
        yield
    finally:
        for d, saved in zip(hook_dicts, stashed):
            d.update(saved)
        for mode in modes:
            del mode.ignore_compile_internals
        if flag is not None:
            pd._is_in_any_mode_without_ignore_compile_internals = flag


def _run_compiled(compiled, args, kwargs, compiler: str = "eager"):
    try:
        with _dynamo_settings(), _dispatch_modes_see_the_step(compiler), capture_clock():
            return compiled(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - translate what Dynamo wraps into fxopt's errors
        inner = unwrap_compile_error(err)
        if inner is not None and inner is not err:
            raise inner from None
        if is_graph_break(err):
            raise GraphBreakError(
                "fxopt needs the whole training step as one graph, but torch.compile could not "
                f"capture this model in one piece: {str(err).splitlines()[0]}\n"
                "Rewrite the unsupported Python (data-dependent control flow, .item(), unsupported "
                "libraries) or move it out of forward(); or let fxopt.optimize(model, budget) plan "
                "the pieces in order (graph_breaks='split', its default; the budget in bytes)."
            ) from err
        raise


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


class FxoptModule(nn.Module):
    """A model whose training step fxopt plans and rewrites. Used like the original: it shares
    the original's parameters, buffers and submodules (and so its ``state_dict``); forward,
    ``loss.backward()`` and ``optimizer.step()`` work as before. Each new input signature is
    captured and planned at its first call; ``plans`` holds every plan, ``plan`` the latest."""

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
        # One compiled step per amount of gradient memory held when a step starts (see `forward`).
        self.__dict__["_steps"] = {}
        # With ``dynamic=``: the calls, by the gradient memory held when a step starts (as `_steps`).
        self.__dict__["_dims"] = dynamic
        self.__dict__["_dynamic_runs"] = {} if dynamic is None else {0: DynamicRun(model, options, dynamic, self.plans)}
        if dynamic is not None and (data_parallel.is_ddp(model) or data_parallel.fsdp_units(model)):
            raise ValueError("dynamic= plans a step captured as one graph; a DDP or FSDP2 model is captured in "
                             "pieces: plan it without dynamic= (each shape on its own)")
        if data_parallel.is_ddp(model):
            data_parallel.check_ddp(model)
        # An FSDP2 model: planned block by block; the submodules between its units compiled too.
        units = data_parallel.fsdp_units(model)
        if units:
            data_parallel.check_fsdp(units, graph_breaks)
            if _budget_bytes(options.budget) is None:
                raise BudgetError(
                    f"fxopt plans an FSDP2 step piece by piece (FSDP's hooks run between the pieces) and needs "
                    f"the budget in bytes, not {options.budget!r}: the step's eager peak is not known until every "
                    "piece has run. Pass bytes or a size such as '2GiB'.")
        self.__dict__["_fsdp_units"] = units
        self.__dict__["_eager_modules"] = data_parallel.eager_modules(model, units) if units else []
        self.training = model.training

    def _step_for(self, held_gradient_bytes: int) -> tuple[PiecewiseBackend, Callable, list[Callable]]:
        """The backend, the compiled model and the compiled calls of the submodules between FSDP2
        units (`fxopt.distributed.data_parallel.eager_modules`) of steps that start with
        ``held_gradient_bytes`` of
        gradients already there (0 normally; the accumulated gradients under gradient
        accumulation, or zeroed ones after ``zero_grad(set_to_none=False)``). Those stay alive
        through the whole step beside what it allocates, so such a step is captured and planned
        on its own, counting them (`fxopt.capture.dynamo.unread_resident_bytes`): torch.compile's
        guards do not look at ``.grad``, so one compiled step could not tell the two apart."""
        if held_gradient_bytes not in self._steps:
            model, options = self._model, self._options
            if held_gradient_bytes and options.plan is not None:
                # A given plan was made for a step without them: planned anew where it does not fit.
                options = dataclasses.replace(options, plan_from_examples=True)

            def piece_backend(budget, on_plan, whole):
                def both(plan):
                    on_plan(plan)
                    self.plans.append(plan)
                # A whole step counts the parameters, buffers and gradients it does not read, and
                # what DDP holds; a piece's reserve counts everything it does not take (see
                # fxopt.capture.pieces).
                held = backend.step.held if backend.step is not None else 0
                return make_backend(dataclasses.replace(options, budget=budget), both,
                                    resident=model if whole else None, held_bytes=held if whole else 0)

            backend = PiecewiseBackend(options.budget, piece_backend, self._graph_breaks)
            # fxopt.optimize(DDP(model)): DDP's forward runs as it is, its call of the model runs
            # the compiled step (see fxopt.distributed.data_parallel).
            target = data_parallel.module_call(model.module) if data_parallel.is_ddp(model) else model
            compiled = torch.compile(target, backend=backend, fullgraph=self._graph_breaks == "error", dynamic=False)
            calls = [torch.compile(data_parallel.module_call(m), backend=backend, dynamic=False)
                     for m in self._eager_modules]
            self._steps[held_gradient_bytes] = backend, compiled, calls
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
        model = self._model
        held = sum(storages([p.grad for p in model.parameters() if p.grad is not None]).values())
        if self._dims is not None:
            if held not in self._dynamic_runs:
                self._dynamic_runs[held] = DynamicRun(model, self._options, self._dims, self.plans)
            return self._dynamic_runs[held](args, kwargs)
        backend, compiled, calls = self._step_for(held)
        ddp = model if data_parallel.is_ddp(model) else data_parallel.running_ddp(self)
        if ddp is not None:
            data_parallel.check_ddp(ddp)
        units = self._fsdp_units
        # Held beside the step by no tensor of the model: DDP's buckets (those the gradients are
        # not views of), a bound on FSDP2's buffers.
        beside = data_parallel.held_bytes([ddp]) if ddp is not None else 0
        if units:
            beside += data_parallel.fsdp_held_bytes(units)
        step = backend.step = Step.start(model, [args, kwargs], held=beside, every_graph_a_piece=bool(units),
                                         blocks_to_come=(lambda: data_parallel.units_to_come(units)) if units else None)
        try:
            with data_parallel.routes(self._eager_modules, calls):
                if ddp is model:
                    with data_parallel.routed(model.module, compiled):
                        out = _run_compiled(model, args, kwargs, self._options.compiler)
                else:
                    out = _run_compiled(compiled, args, kwargs, self._options.compiler)
            pieces = sum(p.plan is not None for p in step.pieces)
        except InfeasibleBudgetError as err:
            if not held:
                raise with_accumulation_note(err, model) from None
            raise InfeasibleBudgetError(err.budget, err.min_budget, " ".join(filter(None, [
                err.detail, f"This step starts with {format_bytes(held)} of gradients already there (gradient "
                "accumulation, or zero_grad(set_to_none=False)), alive through the whole step; "
                "optimizer.zero_grad() (set_to_none, the default) before it frees them."])),
                err.lower_bound) from None
        finally:
            backend.step = None
        if units and torch.is_grad_enabled():
            data_parallel.check_planned(out, step.counted())
        if not pieces and torch.is_grad_enabled() and any(
                t.requires_grad for t in tensors_in(out)):
            raise CaptureError(
                "torch.compile captured no graph of this training step (Dynamo skipped the frame), "
                "so it would run unoptimized; run it once with torch.compile(model, fullgraph=True) "
                "to see why")
        return out

    def train(self, mode: bool = True) -> FxoptModule:
        self._model.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_model"], name)

    def extra_repr(self) -> str:
        return f"budget={self._options.budget!r}, solver={self._options.solver!r}"


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
            self.compiled[k] = torch.compile(self.model, backend=backend, fullgraph=True, dynamic=None)
        try:
            with capture_settings():
                mark(state.call_dims, state.dims.ranges)
                out = _run_compiled(self.compiled[k], args, kwargs, self.options.compiler)
        finally:
            state.call_dims = []
        if k is None and state.buckets:  # the first call planned: its graph is its bucket's
            self.compiled[bucket_of(state.buckets, state.point)] = self.compiled.pop(None)
        self._record_plans()
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


def optimize(
    model: nn.Module,
    budget: Budget,
    *,
    example_inputs: Sequence[Any] | None = None,
    solver: str = "auto",
    plan: Plan | None = None,
    time_limit: float = DEFAULT_TIME_LIMIT,
    cost_model: CostModel | None = None,
    compiler: str = "eager",
    compress: bool = True,
    quantize: str | Quantize | None = None,
    offload: bool | int | str | None = None,
    graph_breaks: str = "split",
    dynamic: dict | None = None,
) -> FxoptModule:
    """Return ``model`` rewritten so that its training step (forward + backward) peaks within
    ``budget``, recomputing as little as possible.

    ``budget``: bytes (int), a size string (``"3GiB"``, ``"500MB"``), or a fraction of the
    un-rewritten step's predicted peak (a float in (0, 1], or ``"50%"``). The peak counts all
    tensor memory live during forward and backward: parameters, buffers, inputs, gradients,
    activations and temporaries.

    Without ``example_inputs`` the step is planned at the first call (and again for each new
    input shape); with them it is planned now, so errors such as `InfeasibleBudgetError` surface
    here. ``plan`` replays a plan from `fxopt.plan` or `Plan.from_json`. ``compiler``:
    ``"eager"`` runs the rewritten graphs op by op, ``"inductor"`` compiles them with Inductor
    (see `fxopt.capture.inductor`).

    ``compress`` (default True): the solver may also keep saved values COMPRESSed losslessly
    (masks as packed bits; gradients bit-identical). ``quantize``: ``"int8"``, ``"fp8"``,
    ``"int4"`` or a `fxopt.Quantize` lets it also quantize saved floating-point activations
    (lossy: gradients change; see `fxopt.gradient_sqnr`). Either way the solver compresses a
    value only where that is cheaper than recomputing within the budget; `Plan.compressed`
    lists what it chose.

    ``offload``: let the solver OFFLOAD saved values to host memory, copied back before the
    backward reads them (see docs/offload.md). None (default): on for a step on a CUDA device
    (bandwidths measured once per device), off on CPU. True on CPU plans with the default
    bandwidths but saves no memory (host and device are the same memory there). A size (bytes,
    or a string such as ``"16GiB"``): on, holding at most that much host memory at once.
    `Plan.offloaded` lists what it chose, `Plan.host_bytes` the host memory it holds.

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
    _check_model(model)
    if dynamic is not None:
        return _optimize_dynamic(model, budget, DynamicDims.parse(dynamic), example_inputs, plan, graph_breaks,
                                 solver=solver, time_limit=time_limit, cost_model=cost_model or CostModel(),
                                 compiler=compiler, compress=compress, quantize=quantize, offload=offload)
    options = Options(budget=budget, solver=solver, plan=plan, time_limit=time_limit,
                      cost_model=cost_model or CostModel(), compiler=compiler, compress=compress,
                      quantize=quantize, offload=offload)
    if example_inputs is not None and plan is None:
        try:
            options = dataclasses.replace(options, plan_from_examples=True, plan=_plan_now(
                model, budget, example_inputs, solver=solver, time_limit=time_limit,
                cost_model=options.cost_model, compiler=compiler, compress=compress, quantize=quantize,
                offload=offload))
        except GraphBreakError:
            if graph_breaks != "split":
                raise
            # A step in pieces is planned piece by piece at its first call.
    return FxoptModule(model, options, graph_breaks)


def _optimize_dynamic(model: nn.Module, budget: Budget, dims: DynamicDims, example_inputs, plan: Plan | None,
                      graph_breaks: str, **options) -> FxoptModule:
    if plan is not None:
        raise ValueError("dynamic= plans for a range of shapes; plan= replays one plan for one shape")
    if graph_breaks != "split":
        check_choice("graph_breaks", graph_breaks, GRAPH_BREAKS)
    module = FxoptModule(model, Options(budget=budget, **options), "error", dims)
    if example_inputs is not None:
        # Plan now (errors surface here): capture and plan at the examples' shape, without the
        # backward (no gradient is accumulated).
        args, kwargs = _split_inputs(example_inputs)
        module._dynamic.plan_only(args, kwargs)
    return module


def capture_symbolic(model: nn.Module, example_inputs: Any, dims: DynamicDims, point: dict, **options):
    """Capture ``model``'s step on ``example_inputs`` with the ``dims`` symbolic and analyse it at
    ``point``, without planning or running it: (the step as captured, the step rewritten as
    planning starts from), as `fxopt.analysis.JointGraph`s. A range the captured graph holds for
    only in part (a size of 1 set apart) is narrowed to the part holding ``point``, once."""
    _check_model(model)
    args, kwargs = _split_inputs(example_inputs)
    options = Options(budget=1, offload=False, **options)
    for attempt in range(2):
        state = DynamicState(dims)
        state.analyze_at = point
        state.call_dims = dims.dims(model, args, kwargs)
        compiled = torch.compile(model, backend=make_dynamic_backend(options, state, model), fullgraph=True,
                                 dynamic=None)
        try:
            with capture_settings():
                mark(state.call_dims, dims.ranges)
                _run_compiled(compiled, args, kwargs, options.compiler)
        except Analyzed as done:
            return done.eager, done.rewritten
        except SpecializedError as err:
            name, (lo, hi) = err.holds if err.holds is not None else (None, (0, -1))
            if attempt or name not in dims.ranges.bounds or not lo <= point[name] <= hi:
                raise
            dims = dataclasses.replace(dims, ranges=dims.ranges.with_bound(name, lo, hi))
    raise CaptureError("nothing to analyse: the captured step has no backward (no input or parameter requires "
                       "grad, or it ran under torch.no_grad())")


def plan(
    model: nn.Module,
    budget: Budget,
    example_inputs: Sequence[Any],
    *,
    solver: str = "auto",
    time_limit: float = DEFAULT_TIME_LIMIT,
    cost_model: CostModel | None = None,
    compiler: str = "eager",
    compress: bool = True,
    quantize: str | Quantize | None = None,
    offload: bool | int | str | None = None,
) -> Plan:
    """Capture and plan the training step of ``model`` on ``example_inputs`` without running it.

    ``example_inputs``: the positional arguments of ``model(...)`` (a tuple or list; a dict is
    passed as keyword arguments). Returns a `Plan`; raises `InfeasibleBudgetError` (with
    ``.min_budget``) when no schedule fits. ``compiler``: the one the plan is for (Inductor's
    graph passes may change the captured graph a little, so a plan replays on its own compiler).
    ``compress``, ``quantize``, ``offload``: as for `optimize`.
    """
    return plan_and_rewrite(model, budget, example_inputs, solver=solver, time_limit=time_limit,
                            cost_model=cost_model or CostModel(), compiler=compiler, compress=compress,
                            quantize=quantize, offload=offload).plan


def plan_and_rewrite(model: nn.Module, budget: Budget, example_inputs: Sequence[Any], **options) -> PlanReady:
    """Like `plan` (``options``: its keyword arguments, see `fxopt.planner.Options`), and also the
    rewritten forward and backward modules (before any compiler): ``.plan``, ``.forward``,
    ``.backward``."""
    _check_model(model)
    options = Options(budget=budget, **options)
    if data_parallel.fsdp_units(model):
        raise GraphBreakError(
            "an FSDP2 model's step is not one graph (FSDP's hooks run between its blocks), so fxopt plans it "
            "block by block as it runs: use fxopt.optimize(model, budget) and read its .plans after the first step")
    held = 0
    if data_parallel.is_ddp(model):  # the step DDP runs, with DDP's buckets beside it
        data_parallel.check_ddp(model)
        held, model = data_parallel.bucket_bytes(model), model.module
    backend = make_backend(options, lambda plan: None, stop_after_plan=True, resident=model, held_bytes=held)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    args, kwargs = _split_inputs(example_inputs)
    try:
        _run_compiled(compiled, args, kwargs, options.compiler)
    except PlanReady as ready:
        return ready
    except InfeasibleBudgetError as err:
        if any(p.grad is not None for p in model.parameters()):
            raise
        raise with_accumulation_note(err, model) from None
    raise CaptureError(
        "nothing to plan: the captured step has no backward (no input or parameter requires grad, "
        "or it ran under torch.no_grad())"
    )


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
    return InfeasibleBudgetError(err.budget, err.min_budget, " ".join(filter(None, [err.detail, note])), err.lower_bound)


_plan_now = plan  # `optimize` takes a `plan` argument that hides this function there


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}
