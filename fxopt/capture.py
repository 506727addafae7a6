"""Capture the training step and hand it to the planner: a torch.compile backend.

Dynamo captures the model's forward as one graph (``fullgraph=True``: a graph break is refused
with the reason, because a plan can only bound the peak of a step it sees whole). AOTAutograd
traces forward and backward into one aten-level joint graph, without decompositions, so random
ops stay whole and run exactly once, in eager order: dropout masks are eager's. Its partitioner
hook (``partition_fn``) is where fxopt plans and rewrites: analyze → solve → split with recompute.
The forward and backward run as FX Python code taking their inputs boxed, so saved tensors are
released as soon as the backward has used them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from fxopt import cache
from fxopt.analyze import CostModel, analyze
from fxopt.budget import Budget, resolve_budget
from fxopt.compression import Quantize, resolve_quantize
from fxopt.errors import CaptureError, InfeasibleBudgetError
from fxopt.passes.dropout import recompute_dropout_from_mask
from fxopt.passes import masks
from fxopt.passes.recompute import split_with_recompute
from fxopt.plan import Plan
from fxopt.solvers import eager_schedule, simulate, solve

log = logging.getLogger("fxopt")

COMPILERS = ("eager", "inductor")

# Logging inside forward() (HF's ``logger.warning_once`` in its loss path, say) is a graph break.
# Dynamo can move ``print`` and ``warnings.warn`` calls to after the graph, so they still run;
# a Logger method it can only skip: those are not emitted while the compiled step runs.
_REORDERABLE = (print, warnings.warn)
_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")


def _logger_methods() -> set:
    """Every logging method of the Logger classes in use, including those libraries add
    (``transformers`` adds ``warning_once`` and ``info_once`` to ``logging.Logger``)."""
    methods = set()
    for cls in {logging.Logger, logging.getLoggerClass()}:
        for klass in cls.__mro__:
            for name, value in vars(klass).items():
                if callable(value) and (name in _LOGGER_METHODS or name.endswith("_once") or name.startswith("warning_")):
                    methods.add(value)
    return methods


def logging_switches():
    """Dynamo's logging switches for the duration of a capture (see above)."""
    cfg = torch._dynamo.config
    return cfg.patch(
        reorderable_logging_functions=set(cfg.reorderable_logging_functions) | set(_REORDERABLE),
        ignore_logger_methods=set(cfg.ignore_logger_methods) | _logger_methods(),
    )




@dataclasses.dataclass(frozen=True)
class Options:
    """How to plan. ``budget``: see `fxopt.budget.resolve_budget`. ``solver``: see
    `fxopt.solvers.solve`. ``plan``: reuse this plan instead of solving (it must have been made
    for the same graph). ``time_limit``: seconds for the ILP. ``compiler``: what runs the
    rewritten forward and backward: ``"eager"`` (FX code, op by op) or ``"inductor"`` (see
    `fxopt.inductor`). ``inductor_config``: extra Inductor settings for ``"inductor"``.
    ``compress``: let the solver COMPRESS saved values losslessly (bool masks as packed bits,
    ReLU's backward reading a bool mask, max-pooling indices as int32); gradients stay
    bit-identical. ``quantize``: a `fxopt.Quantize` (or its format name) to also let it quantize
    saved floating-point activations (lossy; off by default)."""

    budget: Budget
    solver: str = "auto"
    plan: Plan | None = None
    time_limit: float = 60.0
    cost_model: CostModel = dataclasses.field(default_factory=CostModel)
    compiler: str = "eager"
    inductor_config: dict | None = None
    compress: bool = True
    quantize: Quantize | None = None
    # ``plan`` was made here from ``example_inputs``: a graph it does not fit (another input
    # shape, autocast on) is planned anew, as without example inputs, instead of refused.
    plan_from_examples: bool = False

    def __post_init__(self):
        object.__setattr__(self, "quantize", resolve_quantize(self.quantize))
        if not isinstance(self.compress, bool):
            raise TypeError(f"compress must be True or False, got {self.compress!r}")
        if self.compiler not in COMPILERS:
            raise ValueError(f"unknown compiler {self.compiler!r}; choose one of {', '.join(COMPILERS)}")


class PlanReady(Exception):
    """Raised from the partitioner to stop after planning (`fxopt.plan` does not run the model).
    ``forward`` and ``backward``: the rewritten modules, before any compiler."""

    def __init__(self, plan: Plan, forward: fx.GraphModule | None = None, backward: fx.GraphModule | None = None):
        super().__init__("plan ready")
        self.plan = plan
        self.forward = forward
        self.backward = backward


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def make_plan(joint: fx.GraphModule, num_fwd_outputs: int, options: Options, unread_resident_bytes: int = 0):
    """``unread_resident_bytes``: see `fxopt.analyze.analyze`."""
    # Budgets given as a fraction are of the step as eager autograd runs it: simulate that before
    # the passes below change what the backward reads (and analyze again only if they did).
    codecs = dict(compress=options.compress, quantize=options.quantize, unread_resident_bytes=unread_resident_bytes)
    before = analyze(joint, num_fwd_outputs, options.cost_model, **codecs) if options.plan is None else None
    # A plan made from example inputs may not fit this graph (another shape, autocast): keep the
    # graph as captured, to plan it anew from there if so (the passes below rewrite it in place).
    pristine = _copy(joint) if options.plan is not None and options.plan_from_examples else None
    rewritten = recompute_dropout_from_mask(joint)
    relu = masks.relu_masks(joint) if options.compress else 0
    jg = before if before is not None and not (rewritten or relu) else analyze(joint, num_fwd_outputs, options.cost_model, **codecs)

    def without_relu_masks():
        masks.undo_relu_masks(joint)
        return analyze(joint, num_fwd_outputs, options.cost_model, **codecs)

    eager_graph = before.graph if before is not None else None
    if options.plan is not None:
        if options.plan.fingerprint != jg.fingerprint and relu:
            jg = without_relu_masks()
        if options.plan.fingerprint != jg.fingerprint and options.plan_from_examples:
            if relu:
                masks.relu_masks(joint)
                jg = analyze(joint, num_fwd_outputs, options.cost_model, **codecs)
            before = analyze(pristine, num_fwd_outputs, options.cost_model, **codecs)
            eager_graph = before.graph
            options = dataclasses.replace(options, plan=None, plan_from_examples=False)
        elif options.plan.fingerprint != jg.fingerprint:
            raise CaptureError(
                "the given plan was made for a different graph (another model, input shape, dtype, "
                "compress= or quantize= setting "
                "or torch version); re-plan with fxopt.plan(model, budget, example_inputs)"
            )
        else:
            return jg, options.plan
    eager = simulate(eager_graph, eager_schedule(eager_graph))
    budget = resolve_budget(options.budget, eager.peak_bytes)
    cache_key = cache.key(jg.graph, budget, options.solver, options.time_limit)
    cached = cache.load(cache_key)
    if cached is not None:
        if cached.fingerprint != jg.fingerprint and relu:  # it was planned without the ReLU masks
            jg = without_relu_masks()
        return jg, cached
    log.info("fxopt: planning a step of %d nodes for a budget of %d bytes", len(jg.graph), budget)
    t0 = time.perf_counter()
    with progress_display() as report:
        try:
            solution = solve(jg.graph, budget, options.solver, time_limit=options.time_limit, on_progress=report)
        except InfeasibleBudgetError as err:
            if not relu:
                raise
            # The solvers do not always find the rewritten step's lowest peak (its memory model
            # differs a little): never let the ReLU masks make a budget infeasible.
            report("no plan fits with ReLU masks; planning without them")
            jg = without_relu_masks()
            try:
                solution = solve(jg.graph, budget, options.solver, time_limit=options.time_limit, on_progress=report)
            except InfeasibleBudgetError as err2:
                raise InfeasibleBudgetError(budget, min(err.min_budget, err2.min_budget)) from None
    plan = Plan.build(
        graph=jg.graph,
        schedule=solution.schedule,
        budget_bytes=budget,
        eager_peak_bytes=eager.peak_bytes,
        solver=solution.solver,
        status=solution.status,
        solve_seconds=time.perf_counter() - t0,
        fingerprint=jg.fingerprint,
        module_paths=jg.module_paths,
        timeline=solution.timeline,
        lower_bound_cost=solution.lower_bound_cost,
    )
    log.info("%s", plan.summary())
    cache.store(cache_key, plan)
    return jg, plan


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


def _boxed(gm: fx.GraphModule, example_inputs) -> Callable:
    """Run `gm` as FX Python code that takes its inputs as a list and clears it, so each input
    (a saved activation, a tangent) is freed after its last use, like every intermediate."""
    codegen = getattr(fx.graph, "_BoxedCodeGen", None)
    if codegen is not None:
        gm.graph.set_codegen(codegen())
        gm.recompile()

        def run(args):
            return gm(args)
    else:  # older torch: the interpreter also frees values after their last use
        def run(args):
            return fx.Interpreter(gm).boxed_run(args)

    run._boxed_call = True
    return run


def unread_resident_bytes(module: torch.nn.Module, example_inputs) -> int:
    """Bytes of ``module``'s parameters and buffers (each storage once) that are not among the
    captured graph's inputs: the step never reads them, yet they are alive throughout it."""
    read = set()
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            try:
                read.add((t.device, t.untyped_storage().data_ptr()))
            except Exception:  # noqa: BLE001 - a tensor without real storage: nothing to match
                pass
    unread = {}
    for t in [*module.parameters(), *module.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in read:
            unread[key] = t.untyped_storage().nbytes()
    return sum(unread.values())


def make_backend(options: Options, on_plan: Callable[[Plan], None], *, stop_after_plan: bool = False,
                 resident: torch.nn.Module | None = None):
    """A torch.compile backend that plans each captured graph and runs the rewritten step.
    ``resident``: the module being compiled, when known: its parameters and buffers the step does
    not read are counted in every peak too (a backend given to torch.compile does not see them)."""
    unread = {"bytes": 0}

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_):
        t0 = time.perf_counter()
        jg, plan = make_plan(joint, num_fwd_outputs, options, unread["bytes"])
        on_plan(plan)
        fw, bw = split_with_recompute(jg, plan.schedule)
        log.debug("fxopt: planned and rewrote the step in %.2f s", time.perf_counter() - t0)
        if stop_after_plan:
            raise PlanReady(plan, fw, bw)
        return fw, bw

    if options.compiler == "inductor":
        from fxopt.inductor import inductor_backend

        compile_step = inductor_backend(partition, options.inductor_config)
    else:
        compile_step = _eager_backend(partition)
    if resident is None:
        return compile_step

    def compile_with_resident(gm: fx.GraphModule, example_inputs):
        unread["bytes"] = unread_resident_bytes(resident, example_inputs)
        return compile_step(gm, example_inputs)

    return compile_with_resident


def _eager_backend(partition: Callable) -> Callable:
    compile_fn = _boxed

    def inference_not_planned(gm, example_inputs):
        # No gradient is needed (torch.no_grad, or nothing requires grad): there is no backward
        # and nothing to rematerialize; the forward runs as captured.
        return _boxed(gm, example_inputs)

    return aot_autograd(
        fw_compiler=compile_fn,
        bw_compiler=compile_fn,
        inference_compiler=inference_not_planned,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


def unwrap_compile_error(err: BaseException) -> BaseException:
    """Dynamo wraps what a backend raises; find fxopt's own error inside, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (PlanReady,)) or type(err).__module__.startswith("fxopt"):
            return err
        err = getattr(err, "inner_exception", None) or err.__cause__
    return None


def is_graph_break(err: BaseException) -> bool:
    return isinstance(err, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError))
