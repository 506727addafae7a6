"""The largest batch whose training step fits a budget: `max_batch`.

One capture with the batch dimension symbolic (`fxopt.capture.shapes`) gives the solver graph at
every batch size (`fxopt.analysis.symbolic`); every peak below is monotone in the batch (see
there), so each question is a bisection over graphs evaluated, not captured:

  1. an upper bracket, proven: the largest batch whose `peak_lower_bound` (scratch memory
     counted as zero, so a bound on every schedule) fits; then, below it, the largest whose
     bound with the scratch measured at that batch fits. No batch above it can fit. (One bound
     per batch tried, where a lowest-peak search above it would solve every kind of block: on
     a real-size step the largest ops' scratch, the logits', puts most of the zero-scratch
     bracket out of reach.) Each bound is convex in the batch and, near the answer, grows along
     its last linear piece, so each search asks first where the bound, growing as it does from
     the range's largest batch but one to the largest, meets the budget
     (`fxopt.buckets.largest_near`: the same answer, fewer graphs made).
  2. fxopt's answer: at that batch, the lowest peak fxopt's solvers reach
     (`fxopt.solvers.min_feasible_budget`); if it is over the budget, that lowest-peak schedule,
     replayed at smaller batches, finds the largest at which it fits, and the batch above that
     is tried once more. Then one plan is made at the answer.
  3. beside it, the largest batch of the step as eager autograd runs it, and with each block
     under per-block ``torch.utils.checkpoint`` (its block inputs SAVEd, the rest recomputed),
     both by their simulated peaks.

Every peak at a batch b is simulated with the scratch memory of its ops measured at b (once per
op and shape: `fxopt.analysis.scratch` caches them), except the zero-scratch bracket's.

Every decision is counted work, never the clock, so the same model and options give the same
answer on a quiet machine and a busy one: each solve does the options' ``effort``
(`fxopt.solvers.effort`), with their solver and MIP program, and the bisection of step 2 runs at
most `BISECTION_SOLVES` solves (times ``effort``). ``time_limit`` is a safety stop shared by all of
them, counted from the end of the capture: a search it cuts short keeps the best answer found by
then and says so (`MaxBatch.stopped`, a `SolverTimeoutWarning`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from fxopt.analysis import JointGraph
from fxopt.analysis.joint import graph_fingerprint
from fxopt.api import FxoptModule
from fxopt.buckets import Bucket, guessed, largest, largest_from_above, largest_from_below, largest_near
from fxopt.budget import Budget, BudgetLike
from fxopt.capture.shapes import DynamicDims
from fxopt.errors import BudgetError, InfeasibleBudgetError
from fxopt.options import Options
from fxopt.plan_ahead import capture_symbolic
from fxopt.planner import heap_frozen
from fxopt.solvers import eager_schedule, eager_timeline, min_feasible_budget, simulate, solve
from fxopt.solvers.auto import SolverTimeoutWarning, lowest_schedule
from fxopt.solvers.effort import Deadline, Effort, effort_of
from fxopt.solvers.graph import Graph
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.minimum import Memo
from fxopt.solvers.plan import Plan
from fxopt.solvers.schedule import Schedule, on_demand
from fxopt.units import format_bytes

log = logging.getLogger("fxopt")

# The batch `max_batch` captures the step at (its graph is evaluated at every other batch).
PROBE_BATCH = 4
# The most solves the bisection for fxopt's batch runs at effort 1 (it scales with ``effort``):
# counted, so that the answer does not depend on the machine. A gap of 2**5 batches between the
# largest batch planned and the bracket closes within it; about what 6 seconds of solves reached
# on a quiet 2-core machine before the solves were counted.
BISECTION_SOLVES = 6


@dataclasses.dataclass(frozen=True)
class _Solving:
    """How `max_batch` solves: the options' solver, effort and MIP program, the safety stop all
    its solves share, and the lowest peaks they found (kept for this call only)."""

    solver: str
    effort: Effort
    mip_solver: str | None
    deadline: Deadline
    memo: Memo
    bisection_solves: int

    @classmethod
    def of(cls, options: Options) -> _Solving:
        effort = effort_of(options.effort)
        return cls(options.solver, effort, options.mip_solver, Deadline(options.time_limit), Memo(),
                   max(1, round(BISECTION_SOLVES * options.effort)))

    def lowest(self) -> dict[str, Any]:
        """The keywords of `min_feasible_budget` and `lowest_schedule` (the heuristics' lowest peak)."""
        return {"effort": self.effort, "time_limit": self.deadline, "memo": self.memo, "run_ilp": False,
                "mip_solver": self.mip_solver}


@dataclasses.dataclass(frozen=True)
class MaxBatch:
    """What `max_batch` found. ``batch``: the largest batch fxopt plans within ``budget_bytes``,
    with its ``plan`` (made at that batch on the step captured with a symbolic batch; it holds at
    every smaller batch of the same capture too: `optimize` gives the module that runs it).
    ``proven_max``: no schedule of any kind fits a batch above it (the peak lower bound), so
    ``batch == proven_max`` is proven optimal. ``next_plan``: below that, the lowest-peak plan
    fxopt found at ``batch + 1`` (its peak over the budget; None when ``batch == proven_max``).
    ``eager_batch``, ``checkpoint_batch``: the largest batch of the un-rewritten step and of
    per-block checkpointing (None where the model has no repeated blocks), by simulated peaks.
    ``limit``: the largest batch searched; ``seconds``: wall time. ``stopped``: the phases the
    safety stop (``time_limit``) cut short or skipped; empty where counted work alone decided the
    answer (then the same on any machine)."""

    batch: int
    plan: Plan
    proven_max: int
    eager_batch: int
    checkpoint_batch: int | None
    budget_bytes: int
    limit: int
    seconds: float
    blocks: int = 0  # blocks per-block checkpointing wrapped
    next_plan: Plan | None = None
    dim: Any = "batch"
    captured: tuple[int, int] = (1, 2**16)  # the batches the answer's capture holds for
    options: Options | None = dataclasses.field(default=None, repr=False)  # how it was analysed
    stopped: tuple[str, ...] = ()

    def summary(self) -> str:
        proof = ("proven: no schedule fits a larger batch" if self.batch == self.proven_max
                 else f"no schedule fits above {self.proven_max} (proven)")
        at_limit = " (the search limit)" if self.batch == self.limit else ""
        ckpt = "-" if self.checkpoint_batch is None else str(self.checkpoint_batch)
        cut = f"; stopped at the time limit in: {', '.join(self.stopped)}" if self.stopped else ""
        return (f"largest batch within {format_bytes(self.budget_bytes)}: fxopt {self.batch}{at_limit} ({proof}); "
                f"eager {self.eager_batch}; per-block checkpointing {ckpt}; {self.seconds:.1f} s{cut}")

    def optimize(self, model: nn.Module) -> FxoptModule:
        """``model`` (the one searched) running ``plan`` at any batch from the capture's smallest to
        ``batch``: one plan, proven within the budget for all of them (see `fxopt.buckets`)."""
        return replay(model, self, self.plan, (self.captured[0], self.batch))


def replay(model: nn.Module, found: MaxBatch, plan: Plan, batches: tuple[int, int]) -> FxoptModule:
    """A module running ``plan`` (made on ``found``'s capture) for ``batches``."""
    dims = DynamicDims.parse({found.dim: found.captured})
    options = dataclasses.replace(found.options, budget=Budget(bytes=plan.budget_bytes), offload=False)
    module = FxoptModule(model, options, "error", dims)
    module._dynamic.state.buckets = [Bucket(dims.ranges.with_bound(dims.ranges.names[0], *batches), plan)]
    return module


def max_batch(model: nn.Module, budget: BudgetLike | Options, make_inputs: Callable[[int], Any], *,
              dim: Any = "batch", limit: int = 2**16, blocks: Sequence[nn.Module] | None = None,
              **options: Any) -> MaxBatch:
    """The largest batch size whose training step fxopt plans within ``budget`` (bytes or a size
    such as ``"24GiB"``), with its plan, and beside it the largest of eager autograd and of
    per-block checkpointing. ``options``: the fields of `fxopt.Options`, as for `fxopt.optimize`
    (``budget`` may be an `Options`); the solver, ``effort``, ``mip_solver``, ``time_limit``,
    ``compress``, ``quantize`` and the cost model are read (OFFLOAD is not offered: its copies'
    time depends on the batch).

    ``make_inputs(b)``: the example inputs of ``model(...)`` at batch ``b`` (a tuple, or a dict
    of keyword arguments). ``dim``: which dimension is the batch, as for `fxopt.optimize`'s
    ``dynamic=`` (``"batch"``: dim 0 of every tensor argument; or ``(argument, dim)``). ``limit``:
    the largest batch considered. ``blocks``: the modules per-block checkpointing wraps (by
    default the longest run of same-class children of an ``nn.Sequential`` or ``nn.ModuleList``).
    ``effort`` decides how far each solve and the bisection go (counted work: the same answer on
    any machine); ``time_limit`` is a safety stop for all the solves together, from the end of the
    capture: an answer it cut short says so (``stopped``, a `SolverTimeoutWarning`). The step is
    captured once; see `fxopt.maxbatch` for how the answer is found and proven."""
    t0 = time.perf_counter()
    options = Options.of(budget, **options)
    budget_bytes = options.budget.bytes
    if budget_bytes is None:
        raise BudgetError(f"max_batch needs the budget in bytes or as a size ('24GiB'), not {str(options.budget)!r}: "
                          "a share of the eager peak, or the smallest budget, depends on the batch")
    if options.offload not in (None, False):
        raise ValueError("max_batch does not offer OFFLOAD (its copies' time depends on the batch, so one plan is "
                         "not proven for every batch); pass offload=False or leave it out")
    name = DynamicDims.parse({dim: (1, limit)}).ranges.names[0]
    # (The model and what the process held, then each capture's graphs and fake values, left out
    # of the full collections that the capture's and the searches' allocations trigger, as for a
    # plan: `fxopt.planner.heap_frozen`.)
    with heap_frozen():
        return _max_batch(model, options, make_inputs, dim, name, limit, blocks, t0)


def _max_batch(model: nn.Module, options: Options, make_inputs, dim, name: str, limit: int,
               blocks: Sequence[nn.Module] | None, t0: float) -> MaxBatch:
    budget_bytes = options.budget.bytes
    segments = _capture_segments(model, make_inputs, dim, name, limit, budget_bytes, options)
    log.info("fxopt: max_batch: captured and analysed in %.1f s", time.perf_counter() - t0)
    how = _Solving.of(options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)  # said once below, for the whole search
        found = _search(segments, budget_bytes, how, t0)
    if how.deadline.stopped:
        warnings.warn(f"max_batch stopped at the time limit ({options.time_limit:.1f} s after the capture) in: "
                      f"{', '.join(how.deadline.stopped)}; this answer is the best found by then, and another run "
                      "may find another (raise time_limit, or lower the effort)", SolverTimeoutWarning, stacklevel=2)
    proven_max, batch, plan, next_plan, answer = found
    if options.device is not None:  # (planned on fake tensors for it: say how its memory was counted)
        plan = dataclasses.replace(plan, planned_for=options.device.planning_note())
    block_paths = _block_paths(model, blocks)
    eager_batch = _largest_of(segments, lambda s: eager_schedule(s.eager.jg.graph)) or 0
    checkpoint_batch = None
    if block_paths:
        checkpoint_batch = _largest_of(segments, lambda s: per_block_schedule(s.eager.jg, block_paths)) or 0
    log.info("fxopt: max_batch: eager %d, per-block checkpointing %s (%.1f s)", eager_batch, checkpoint_batch,
             time.perf_counter() - t0)
    return MaxBatch(batch, plan, proven_max, eager_batch, checkpoint_batch, budget_bytes, limit,
                    time.perf_counter() - t0, len(block_paths), next_plan, dim, (answer.fxopt.lo, answer.fxopt.hi),
                    options, tuple(how.deadline.stopped))


def _search(segments: list[_Segment], budget_bytes: int, how: _Solving, t0: float
            ) -> tuple[int, int, Plan, Plan | None, _Segment]:
    """The proven bracket, fxopt's batch, its plan, the lowest-peak plan at the next batch (None
    at the bracket) and the segment they are in."""
    # The answers lie in the last segment, or, where nothing fits there, in the one before.
    proven_max = next((s.proven_max for s in reversed(segments) if s.proven_max is not None), None)
    if proven_max is None:
        first = segments[0].fxopt
        graph = first.at(first.lo)
        raise InfeasibleBudgetError(budget_bytes, min_feasible_budget(graph, how.solver, **how.lowest()),
                                    f"Even batch {first.lo} does not fit.", lower_bound=peak_lower_bound(graph)[0])
    log.info("fxopt: max_batch: no batch above %d fits (%.1f s)", proven_max, time.perf_counter() - t0)
    for segment in reversed(segments):
        if segment.proven_max is not None:
            found = segment.fxopt.fxopt_batch(segment.fxopt.lo, segment.proven_max, how)
            if found is not None:
                batch, plan = found
                next_plan = (segment.fxopt.lowest_plan(batch + 1, how)
                             if batch < min(segment.proven_max, segment.fxopt.hi) else None)
                log.info("fxopt: max_batch: fxopt plans batch %d (%.1f s)", batch, time.perf_counter() - t0)
                return proven_max, batch, plan, next_plan, segment
    first = segments[0].fxopt  # (the smallest batch searched: its lowest peak is what the budget would need)
    graph = first.at(first.lo)
    raise InfeasibleBudgetError(budget_bytes, min_feasible_budget(graph, how.solver, **how.lowest()),
                                f"fxopt found no plan at any batch from {first.lo} (the smallest its capture holds "
                                "for) up.", lower_bound=peak_lower_bound(graph)[0])


@dataclasses.dataclass
class _Segment:
    """A range of batches captured as one step (a model may specialize a batch size: then the
    range is captured in segments): searches on the step as captured (``eager``) and as planned
    (``fxopt``), the largest batch the peak lower bound allows in it with the scratch memory
    measured at each batch (``proven_max``), and without any (``bracket``: no larger, and
    where the segment ends below it, the next segment is not captured)."""

    eager: _Search
    fxopt: _Search
    proven_max: int | None
    bracket: int | None


def _capture_segments(model, make_inputs, dim, name: str, limit: int, budget: int, options: Options
                      ) -> list[_Segment]:
    segments: list[_Segment] = []
    start = 1
    while start <= limit:
        probe = min(max(start, PROBE_BATCH), limit)
        dims = DynamicDims.parse({dim: (start, limit)})
        eager_jg, jg = capture_symbolic(model, make_inputs(probe), dims, {name: probe}, options)
        with heap_frozen():  # (frozen again, inside `max_batch`'s: this capture's graphs too)
            lo, hi = jg.symbolic.ranges.bounds[name]  # (narrowed where the model specializes a size)
            search = _Search(jg, name, budget, lo, hi)
            # (hi: the search limit, 2**16 by default; each bracket asked first where its bound,
            # growing as from the range's two largest batches, meets the budget)
            top = largest_near(lo, hi, search.lower_bound_fits,
                               search.guess(search.zero_bound, hi, bottom_first=True))
            # (a step planning does not rewrite is one graph: its graphs at each batch made once)
            eager = search if eager_jg is jg else _Search(eager_jg, name, budget, lo, hi)
            proven = None if top is None else largest_near(lo, top, search.measured_bound_fits,
                                                           search.guess(search.measured_bound, top))
            segments.append(_Segment(eager, search, proven, top))
        if top is None or top < hi or hi >= limit:
            break
        start = hi + 1
    return segments


def _largest_of(segments: list[_Segment], schedule_of) -> int | None:
    for segment in reversed(segments):
        # (the bracket of the planned step's graph, not its proven_max: the step as captured may
        # be another graph, whose scratch the planned one's bound does not speak for)
        top = segment.bracket if segment.bracket is not None else segment.eager.lo - 1
        # (eager's and per-block checkpointing's batches lie well below the bracket, mostly)
        found = segment.eager.largest_with(schedule_of(segment), segment.eager.lo, top, from_below=True)
        if found is not None:
            return found
    return None


class _Search:
    """Bisections over the batch of one symbolic step (see the module)."""

    def __init__(self, jg: JointGraph, name: str, budget: int, lo: int, hi: int):
        self.jg, self.name, self.budget, self.lo, self.hi = jg, name, budget, lo, hi
        self.zero = [0] * len(jg.graph)
        self.measured: dict[int, Graph] = {}
        self.bounds: dict[tuple[int, bool], int] = {}  # (batch, scratch measured) -> peak lower bound

    def at(self, b: int) -> Graph:
        """The graph at batch ``b``, scratch memory measured there (once)."""
        if b not in self.measured:
            self.measured[b] = self.jg.at({self.name: b})
        return self.measured[b]

    def zero_bound(self, b: int) -> int:
        """The peak lower bound at ``b`` with every op's scratch counted as zero (once per batch)."""
        if (b, False) not in self.bounds:
            graph = self.jg.symbolic.at({self.name: b}, self.zero, self.zero)
            self.bounds[(b, False)] = peak_lower_bound(graph)[0]
        return self.bounds[(b, False)]

    def measured_bound(self, b: int) -> int:
        """The peak lower bound at ``b``, scratch measured there (once per batch)."""
        if (b, True) not in self.bounds:
            self.bounds[(b, True)] = peak_lower_bound(self.at(b))[0]
        return self.bounds[(b, True)]

    def lower_bound_fits(self, b: int) -> bool:
        return self.zero_bound(b) <= self.budget

    def measured_bound_fits(self, b: int) -> bool:
        """Whether the peak lower bound at ``b``, scratch measured there, fits: where not, no
        schedule fits ``b``, and no solve or lowest-peak search need ask."""
        return self.measured_bound(b) <= self.budget

    def guess(self, bound: Callable[[int], int], hi: int, bottom_first: bool = False) -> int:
        """Where a bracket search over [lo, hi] starts: where ``bound`` meets the budget along its
        growth from ``hi - 1`` to ``hi`` (`fxopt.buckets.guessed`). ``bottom_first``: ``lo``
        asked first, and where it does not fit, ``lo`` (nothing fits: the top's graphs not made)."""
        if hi <= self.lo or (bottom_first and bound(self.lo) > self.budget):
            return self.lo
        return guessed(self.lo, hi, bound(hi - 1), bound(hi), self.budget)

    largest = staticmethod(largest)

    def largest_with(self, schedule: Schedule, lo: int, hi: int, from_below: bool = False,
                     from_above: bool = False) -> int | None:
        """The largest batch in [lo, hi] at which ``schedule``'s peak fits (bisection, each batch
        tried with the scratch memory measured there; ``from_below``: searched up from ``lo``
        first, `largest_from_below`; ``from_above``: ``hi`` tried first, `largest_from_above`)."""
        search = largest_from_below if from_below else largest_from_above if from_above else self.largest
        return search(lo, hi, lambda b: simulate(self.at(b), schedule).peak_bytes <= self.budget)

    def fxopt_batch(self, lo: int, hi: int, how: _Solving) -> tuple[int, Plan] | None:
        """fxopt's largest batch in [lo, hi] and its plan. At ``hi`` (the proven bracket) the
        heuristics' lowest peak; where it is over the budget, that lowest-peak schedule replayed
        at smaller batches gives the largest at which it fits, and `solve` tries the batch above
        that, then bisects between the largest batch planned and the smallest not, with at most
        ``how.bisection_solves`` solves (one or two, mostly)."""
        found = self.solve(hi, how, full=hi == lo)
        if isinstance(found, Plan):
            return hi, found
        # (a lowest-peak schedule of ``hi`` fits the batch below it, mostly: asked there first)
        replayed = None if found is None else self.largest_with(found, lo, hi - 1, from_above=True)
        feasible: tuple[int, Plan | Schedule] | None = None if replayed is None else (replayed, found)
        failed = hi
        for probe in range(how.bisection_solves):
            low = feasible[0] if feasible is not None else lo - 1
            if failed - low <= 1 or how.deadline.check("max_batch's bisection"):
                break
            candidate = low + 1 if probe == 0 else (low + failed + 1) // 2
            found = self.solve(candidate, how)
            if isinstance(found, Plan):
                feasible = (candidate, found)
            else:
                failed = candidate
        if feasible is None:
            return None
        batch, found = feasible
        if not isinstance(found, Plan):  # a replayed schedule: plan the batch itself, cheaper if it can
            plan = self.solve(batch, how, fits=True)
            plan = plan if isinstance(plan, Plan) and plan.peak_bytes <= self.budget else None
            found = plan or self.plan_of(batch, found, "lowest peak", "heuristic")
        return batch, found

    def solve(self, b: int, how: _Solving, full: bool = True, fits: bool = False) -> Plan | Schedule | None:
        """The plan fxopt finds at batch ``b`` within the budget, or, where it finds none, the
        lowest-peak schedule it reached (None if it has none). Cheapest first: the peak lower
        bound, then the lowest peaks of the heuristics (`min_feasible_budget` without the ILP),
        then (``full``) `solve`, with ``how``'s solver, effort, MIP program and safety stop.
        ``fits``: a schedule is known to fit ``b`` (one replayed there): straight to `solve`, the
        lowest-peak search, which only says whether one does, skipped."""
        graph = self.at(b)
        t0 = time.perf_counter()
        lowest_peak = self.budget if fits else min_feasible_budget(graph, how.solver, **how.lowest())
        if lowest_peak > self.budget and (not full or self.measured_bound(b) > self.budget):
            log.info("fxopt: max_batch: no plan at batch %d (lowest peak %d, %.1f s)", b, lowest_peak,
                     time.perf_counter() - t0)
            return lowest_schedule(graph, how.solver, **how.lowest()).schedule
        try:
            solution = solve(graph, self.budget, how.solver, effort=how.effort, time_limit=how.deadline,
                             memo=how.memo, mip_solver=how.mip_solver)
        except InfeasibleBudgetError:
            lowest = lowest_schedule(graph, how.solver, **how.lowest())
            log.info("fxopt: max_batch: no plan at batch %d (%.1f s)", b, time.perf_counter() - t0)
            return None if lowest is None else lowest.schedule
        log.info("fxopt: max_batch: a plan at batch %d (%.1f s)", b, time.perf_counter() - t0)
        return self.plan_of(b, solution.schedule, solution.solver, solution.status, solution.lower_bound_cost,
                            time.perf_counter() - t0)

    def lowest_plan(self, b: int, how: _Solving) -> Plan:
        """The lowest-peak plan fxopt's heuristics find at batch ``b`` (its budget: its own peak)."""
        lowest = lowest_schedule(self.at(b), how.solver, **how.lowest())
        plan = self.plan_of(b, lowest.schedule, "lowest peak", "heuristic")
        return dataclasses.replace(plan, budget_bytes=max(lowest.peak, plan.peak_bytes))

    def plan_of(self, b: int, schedule: Schedule, solver: str, status: str, bound: float | None = None,
                seconds: float = 0.0) -> Plan:
        graph = self.at(b)
        eager = eager_timeline(graph).peak_bytes
        return Plan.build(graph=graph, schedule=schedule, budget_bytes=self.budget, eager_peak_bytes=eager,
                          solver=solver, status=status, solve_seconds=seconds, fingerprint=graph_fingerprint(graph),
                          module_paths=self.jg.module_paths, lower_bound_cost=bound)


def _block_paths(model: nn.Module, blocks: Sequence[nn.Module] | None) -> list[str]:
    """The module paths of the blocks per-block checkpointing wraps."""
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is not None:
        return [names[id(b)] for b in blocks if id(b) in names]
    best: list[str] = []
    for path, m in model.named_modules():
        if isinstance(m, (nn.Sequential, nn.ModuleList)):
            children = list(m.named_children())
            run: list[str] = []
            for k, (child_name, child) in enumerate(children):
                if run and type(child) is not type(children[k - 1][1]):
                    run = []
                run.append(f"{path}.{child_name}" if path else child_name)
                if len(run) > len(best):
                    best = list(run)
    return best if len(best) >= 2 else []


def per_block_schedule(jg: JointGraph, block_paths: Sequence[str]) -> Schedule:
    """Per-block ``torch.utils.checkpoint`` as a schedule: every value outside the blocks and every
    value a block hands to what follows it SAVEd, everything else inside a block recomputed in the
    backward, on demand."""
    graph = jg.graph

    def block(i: int) -> int | None:
        path = jg.module_paths[i].removeprefix("L['self'].")
        for k, p in enumerate(block_paths):
            if path == p or path.startswith(p + "."):
                return k
        return None

    where = [block(i) for i in range(len(graph))]
    saved = set()
    for i in graph.saveable:
        k = where[i]
        if k is None or any(graph.nodes[u].kind == "forward" and where[u] != k for u in graph.users[i]):
            saved.add(i)
    return on_demand(graph, saved)
