"""The planner: from a captured joint graph and the user's options to a plan.

analyze (`fxopt.analysis`) → the mask passes (`fxopt.passes.dropout`, `fxopt.passes.masks`) →
resolve the budget against the simulated eager peak → the plan cache (`fxopt.cache`) → solve
(`fxopt.solvers`), with one fallback: a budget the ReLU-mask rewrite makes infeasible is planned
without it. A plan made from example inputs that does not fit a later graph is planned anew.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import sys
import time

import torch
import torch.fx as fx

from fxopt import cache
from fxopt.analysis import CostModel
from fxopt.analysis import analyze as analyze_step
from fxopt.analysis.bandwidth import device_transfers
from fxopt.analysis.codecs import Quantize, resolve_quantize
from fxopt.analysis.symbolic import Sizes
from fxopt.budget import Budget, resolve_budget
from fxopt.errors import BudgetError, CaptureError, InfeasibleBudgetError, check_choice
from fxopt.fxgraph import copy_module
from fxopt.passes import masks
from fxopt.passes.dropout import alias_identity_dropouts, recompute_dropout_from_mask
from fxopt.solvers.plan import Plan
from fxopt.solvers.transfers import Transfers
from fxopt.solvers import check_solver, eager_timeline, min_feasible_budget, simulate, solve
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.stages import InFlight, solve_stage, stage_min_budget
from fxopt.solvers.auto import DEFAULT_TIME_LIMIT, MIN_PHASE_SECONDS, lowest_schedule

log = logging.getLogger("fxopt")

# When the wait for the plan now being made began: the call that captures the step
# (`capture_clock`), or the end of the previous plan in it (a step in pieces). The solvers get what
# capture left of the time limit, so that an answer takes about ``time_limit`` seconds end to end.
_CAPTURE_STARTED: contextvars.ContextVar[float | None] = contextvars.ContextVar("fxopt_capture_started",
                                                                               default=None)

# The least share of the time limit the solvers get, however long capture took (a large step's
# capture alone may take longer than the limit).
MIN_SOLVE_SHARE = 0.5


@contextlib.contextmanager
def capture_clock():
    """Around a call that may capture and plan a step: planning's time limit counts from here."""
    token = _CAPTURE_STARTED.set(time.perf_counter())
    try:
        yield
    finally:
        _CAPTURE_STARTED.reset(token)


def solve_seconds(options: Options) -> float:
    """The solvers' share of ``options.time_limit``: what capture left of it (`capture_clock`),
    at least `MIN_SOLVE_SHARE` of it."""
    started = _CAPTURE_STARTED.get()
    spent = 0.0 if started is None else time.perf_counter() - started
    return max(MIN_SOLVE_SHARE * options.time_limit, options.time_limit - spent)

COMPILERS = ("eager", "inductor")


@dataclasses.dataclass(frozen=True)
class Options:
    """How to plan. ``budget``: see `fxopt.budget.resolve_budget`. ``solver``: see
    `fxopt.solvers.solve`. ``plan``: reuse this plan instead of solving (it must have been made
    for the same graph). ``time_limit``: seconds for one plan or the answer "infeasible"
    (`fxopt.solvers.DEFAULT_TIME_LIMIT` by default), capture included where a `capture_clock`
    runs (`solve_seconds`). ``compiler``: what runs the
    rewritten forward and backward: ``"eager"`` (FX code, op by op) or ``"inductor"`` (see
    `fxopt.capture.inductor`). ``inductor_config``: extra Inductor settings for ``"inductor"``.
    ``compress``: let the solver COMPRESS saved values losslessly (bool masks as packed bits,
    ReLU's backward reading a bool mask, max-pooling indices as int32); gradients stay
    bit-identical. ``quantize``: a `fxopt.Quantize` (or its format name) to also let it quantize
    saved floating-point activations (lossy; off by default). ``offload``: let the solver OFFLOAD
    saved values to host memory (see `transfers`): None (default) where the step runs on a CUDA
    device, True or False to force it (True on CPU plans with the default bandwidths and saves
    no memory: host and device are the same memory there), or the most host memory it may hold
    at once (bytes or a size string, ``"16GiB"``: on, within that). ``in_flight``: the step is
    one microbatch of a pipeline stage, whose device also holds what this says (the budget is
    the device's; see `fxopt.solvers.stages.solve_stage`)."""

    budget: Budget
    solver: str = "auto"
    plan: Plan | None = None
    time_limit: float = DEFAULT_TIME_LIMIT
    cost_model: CostModel = dataclasses.field(default_factory=CostModel)
    compiler: str = "eager"
    inductor_config: dict | None = None
    compress: bool = True
    quantize: Quantize | None = None
    offload: bool | int | str | None = None
    in_flight: InFlight | None = None
    # Plans to replay beside ``plan``, each on the graph it was made for (a pipeline stage's
    # steps that start with the gradients of earlier microbatches held: `fxopt.distributed.pipeline`).
    alternatives: tuple[Plan, ...] = ()
    # ``plan`` was made here from ``example_inputs``: a graph it does not fit (another input
    # shape, autocast on) is planned anew, as without example inputs, instead of refused.
    plan_from_examples: bool = False

    def __post_init__(self):
        object.__setattr__(self, "quantize", resolve_quantize(self.quantize))
        if not isinstance(self.compress, bool):
            raise TypeError(f"compress must be True or False, got {self.compress!r}")
        self.host_budget  # an unreadable host memory limit fails now
        check_choice("compiler", self.compiler, COMPILERS)
        check_solver(self.solver)
        resolve_budget(self.budget, 1)  # an unreadable budget fails now, not at the first call
        if not self.time_limit > 0:
            raise ValueError(f"time_limit must be a positive number of seconds, got {self.time_limit!r}")


    @property
    def host_budget(self) -> int | None:
        """The host memory OFFLOAD may hold at once, when ``offload`` gives one (else None)."""
        if self.offload is None or isinstance(self.offload, bool):
            return None
        if isinstance(self.offload, float) or isinstance(self.offload, str) and self.offload.strip().endswith("%"):
            raise BudgetError(f"offload={self.offload!r}: a host memory limit is bytes or a size string "
                              "('16GiB'), not a fraction; or pass True, False or None")
        if not isinstance(self.offload, (int, str)):
            raise TypeError(f"offload must be None, True, False or a host memory limit (bytes or '16GiB'), "
                            f"got {self.offload!r}")
        try:
            return resolve_budget(self.offload)
        except BudgetError as err:
            raise BudgetError(f"offload={self.offload!r}: pass True, False, None or a host memory limit "
                              f"(bytes or a size string such as '16GiB'); {err}") from None


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
    on = options.offload is not False and (options.offload is not None or device.type == "cuda")
    if not on:
        return None
    return dataclasses.replace(device_transfers(device), host_budget=options.host_budget)


def make_plan(joint: fx.GraphModule, num_fwd_outputs: int, options: Options, unread_resident_bytes: int = 0,
              sizes: Sizes | None = None):
    """``unread_resident_bytes``, ``sizes`` (a step captured with dynamic shapes, planned at
    ``sizes.point``): see `fxopt.analysis.analyze`."""
    # Budgets given as a fraction are of the step as eager autograd runs it: simulate that before
    # the passes below change what the backward reads (and analyze again only if they did).
    codecs = dict(compress=options.compress, quantize=options.quantize, unread_resident_bytes=unread_resident_bytes,
                  sizes=sizes)
    copies = transfers(joint, options)

    def analyze(gm, num_fwd_outputs, cost_model, **codecs):  # every analysis below carries the bandwidths
        jg = analyze_step(gm, num_fwd_outputs, cost_model, **codecs)
        return dataclasses.replace(jg, graph=jg.graph.with_transfers(copies)) if copies is not None else jg

    alias_identity_dropouts(joint)  # (eager makes no copy there: neither does the step, planned or not)
    before = analyze(joint, num_fwd_outputs, options.cost_model, **codecs) if options.plan is None else None
    # A plan made from example inputs may not fit this graph (another shape, autocast): keep the
    # graph as captured, to plan it anew from there if so (the passes below rewrite it in place).
    pristine = copy_module(joint) if options.plan is not None and options.plan_from_examples else None
    rewritten = recompute_dropout_from_mask(joint)
    relu = masks.relu_masks(joint) if options.compress else 0
    jg = before if before is not None and not (rewritten or relu) else analyze(joint, num_fwd_outputs, options.cost_model, **codecs)

    def without_relu_masks():
        masks.undo_relu_masks(joint)
        return analyze(joint, num_fwd_outputs, options.cost_model, **codecs)

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
        elif given is None:
            raise CaptureError(
                "the given plan was made for a different graph (another model, input shape, dtype, "
                "compress= or quantize= setting "
                "or torch version); re-plan with fxopt.plan(model, budget, example_inputs)"
            )
        else:
            return jg, given
    eager = eager_timeline(eager_graph)
    budget = resolve_budget(options.budget, eager.peak_bytes)
    cache_key = cache.key(jg.graph, budget, _cache_solver(options), options.time_limit)
    cached = cache.load(cache_key)
    if cached is not None:
        if cached.fingerprint != jg.fingerprint and relu:  # it was planned without the ReLU masks
            jg = without_relu_masks()
        return jg, cached
    log.info("fxopt: planning a step of %d nodes for a budget of %d bytes", len(jg.graph), budget)
    t0 = time.perf_counter()
    planned = dict(budget_bytes=budget, eager_peak_bytes=eager.peak_bytes)
    try:
        jg, solution = _solve(jg, options, planned, without_relu_masks if relu else None, solve_seconds(options))
    finally:
        if _CAPTURE_STARTED.get() is not None:
            _CAPTURE_STARTED.set(time.perf_counter())  # the next piece's wait starts now
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
    )
    log.info("%s", plan.summary())
    cache.store(cache_key, plan)
    return jg, plan


def _given_plan(options: Options, jg) -> Plan | None:
    """The given plan (or one of its ``alternatives``) made for this graph, if any."""
    return next((p for p in (options.plan, *options.alternatives) if p.fingerprint == jg.fingerprint), None)


def _cache_solver(options: Options) -> str:
    """The solver as the plan cache keys it: a pipeline stage's with what it holds beside."""
    return options.solver if options.in_flight is None else f"{options.solver}|{options.in_flight.key()}"


def _solve_one(graph, budget: int, options: Options, time_limit: float, report, retry: bool = False):
    if options.in_flight is not None:
        return solve_stage(graph, budget, options.in_flight, options.solver, time_limit=max(MIN_PHASE_SECONDS, time_limit),
                           on_progress=report)
    return solve(graph, budget, options.solver, time_limit=time_limit, on_progress=report, retry=retry)


def _solve(jg, options: Options, planned: dict, without_relu_masks, time_limit: float):
    """The analyzed step ``jg`` solved within ``planned["budget_bytes"]`` in ``time_limit``
    seconds, as (the step planned, the solution); with the ReLU masks (``without_relu_masks``
    undoes them), a budget they make infeasible is planned without them, in what is left of the
    time limit (not searched where the smallest budget named is already below its floor)."""
    budget, t0 = planned["budget_bytes"], time.perf_counter()
    with progress_display() as report:
        try:
            return jg, _solve_one(jg.graph, budget, options, time_limit, report)
        except InfeasibleBudgetError as err:
            if without_relu_masks is None:
                _remember_minimum(err, [jg], options, planned)
                raise
            # The solvers do not always find the rewritten step's lowest peak (its memory model
            # differs a little): never let the ReLU masks make a budget infeasible.
            tried, jg = jg, without_relu_masks()
            left = time_limit - (time.perf_counter() - t0)
            floor = peak_lower_bound(jg.graph)[0]
            if budget < floor and err.min_budget <= floor:
                # No schedule of the step without them peaks below ``floor``: the smallest budget
                # named with them is the answer (the lower of the two floors bounds the step).
                both = InfeasibleBudgetError(budget, err.min_budget, lower_bound=None if err.lower_bound is None
                                             else min(err.lower_bound, floor))
                _remember_minimum(both, [tried], options, planned)
                raise both from None
            report("no plan fits with ReLU masks; planning without them")
            try:
                if budget < floor:
                    # Out of reach without them too: only the smallest budget there is of interest.
                    least = (min_feasible_budget(jg.graph, options.solver, time_limit=max(MIN_PHASE_SECONDS, left),
                                                 run_ilp=False) if options.in_flight is None
                             else stage_min_budget(jg.graph, options.in_flight, options.solver))
                    raise InfeasibleBudgetError(budget, least, lower_bound=floor)
                return jg, _solve_one(jg.graph, budget, options, left, report, retry=True)
            except InfeasibleBudgetError as err2:
                # The step runs either way: a peak neither can go below bounds it.
                floors = [e.lower_bound for e in (err, err2)]
                both = InfeasibleBudgetError(budget, min(err.min_budget, err2.min_budget),
                                             lower_bound=None if None in floors else min(floors))
                _remember_minimum(both, [tried, jg], options, planned)
                raise both from None


def _remember_minimum(err: InfeasibleBudgetError, analyzed: list, options: Options, planned: dict) -> None:
    """Store, in the plan cache, the plan behind the smallest budget ``err`` names (the schedule
    the solvers reached it with, among the graphs ``analyzed``), under the key a call with that
    budget looks up: asking for the minimum fxopt named plans at once, in this process or the
    next, and is not left to a time-limited search finding the same schedule again."""
    for jg in analyzed:
        lowest = lowest_schedule(jg.graph, options.solver)
        if lowest is None or lowest.peak != err.min_budget:
            continue
        timeline = simulate(jg.graph, lowest.schedule)
        plan = Plan.build(graph=jg.graph, schedule=lowest.schedule, **dict(planned, budget_bytes=err.min_budget),
                          solver=lowest.name, status="heuristic", solve_seconds=0.0, fingerprint=jg.fingerprint,
                          module_paths=jg.module_paths, timeline=timeline, lower_bound_cost=None)
        cache.store(cache.key(analyzed[0].graph, err.min_budget, _cache_solver(options), options.time_limit), plan)
        return


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
