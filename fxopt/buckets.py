"""Plans for a range of shapes: one plan made at the largest shape, proven for every smaller one,
or the range split into buckets, each with its own plan.

A step captured with dynamic shapes (`fxopt.capture.shapes`) is analysed once, its sizes kept as
expressions (`fxopt.analysis.symbolic`). It is planned at the largest shape of the range; the
plan's peak there is within the budget, and since every size is checked non-decreasing in every
symbol (`SymbolicGraph.check_monotone`), the same schedule's peak at any smaller shape is no
higher (the argument is in `fxopt.analysis.symbolic`). One plan is enough for the budget.

It may cost more than it must at small shapes: a plan made for 512 tokens recomputes what a
plan for 64 tokens could keep. So the range is split, along its widest symbol (the largest
hi / lo), where that pays:

    seq 2..512:  [2, 96]  eager (everything SAVEd fits)   [97, 256] plan at 256   [257, 512] plan at 512

  - below the largest shape at which the un-rewritten step fits (its eager peak, monotone too,
    found by bisection), a bucket runs with nothing recomputed;
  - above it, at each halving of the range, the current bucket's plan is replayed at the
    smaller shape and compared with a plan made there; where the new plan saves more than
    `WASTE` of the step's compute, a bucket is split off with it.

Each bucket is one compiled graph, captured at its first call (`fxopt.FxoptModule`); a shape
never makes fxopt capture or plan again.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from fxopt import cache
from fxopt.analysis.joint import JointGraph, graph_fingerprint
from fxopt.analysis.symbolic import Ranges
from fxopt.errors import CaptureError, InfeasibleBudgetError
from fxopt.options import Options
from fxopt.solvers import eager_schedule, eager_timeline, min_feasible_budget, simulate, solve
from fxopt.solvers.auto import lowest_schedule
from fxopt.solvers.effort import effort_of
from fxopt.solvers.instant import peak_lower_bound
from fxopt.units import format_bytes
from fxopt.solvers.graph import Graph
from fxopt.solvers.plan import Plan

log = logging.getLogger("fxopt")

# A bucket is split off where a plan made for its shapes recomputes less than the larger
# bucket's plan by more than this share of the step's compute (its estimated seconds).
WASTE = 0.05


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The shapes one plan is for (``ranges``), and the plan, made at ``ranges.top()``."""

    ranges: Ranges
    plan: Plan

    def to_dict(self) -> dict:
        return {"ranges": {k: list(v) for k, v in self.ranges.bounds.items()}, "plan_peak_bytes": self.plan.peak_bytes,
                "recompute_cost": self.plan.recompute_cost, "solver": self.plan.solver}


def split_axis(ranges: Ranges) -> str:
    """The symbol buckets split: the one whose range is widest (largest hi / lo)."""
    return max(ranges.names, key=lambda name: ranges.bounds[name][1] / ranges.bounds[name][0])


def bucket_of(buckets: list[Bucket], point) -> int:
    for k, bucket in enumerate(buckets):
        if bucket.ranges.contains(point):
            return k
    raise ValueError(f"no bucket holds the shape {dict(point)}")


def plan_buckets(jg: JointGraph, plan: Plan, options: Options) -> list[Bucket]:
    """Buckets covering ``jg``'s ranges; ``plan`` was made at their top (see the module), each
    further plan with ``options``' solver, effort and MIP program, within its time limit."""
    ranges = jg.symbolic.ranges
    axis = split_axis(ranges)
    lo, hi = ranges.bounds[axis]
    budget = plan.budget_bytes
    top = ranges.top()

    def point(v: int) -> dict[str, int]:
        return {**top, axis: v}

    fits = _largest_eager_fit(jg, point, lo, hi, budget)
    buckets: list[Bucket] = []
    current, current_hi = plan, hi
    m = hi // 2
    while m > (fits if fits is not None else lo - 1) and m >= lo:
        t0 = time.perf_counter()
        graph = jg.at(point(m))
        step = sum(n.cost for n in graph.nodes)
        kept = simulate(graph, current.schedule).cost
        if kept <= WASTE * step:
            break  # the plan barely recomputes here: nothing to win below either
        fresh = _plan_at(jg, graph, point(m), budget, options)
        log.info("fxopt: %s=%d: the plan for %d recomputes %.2f ms, one made here %.2f ms (%.1f s)", axis, m,
                 current_hi, 1e3 * kept, 1e3 * fresh.recompute_cost, time.perf_counter() - t0)
        if kept - fresh.cost > WASTE * step:
            buckets.append(Bucket(ranges.with_bound(axis, m + 1, current_hi), current))
            current, current_hi = fresh, m
        m //= 2
    eager = _eager_plan(jg, point(fits), budget) if fits is not None and fits < current_hi else None
    if eager is not None:
        buckets.append(Bucket(ranges.with_bound(axis, fits + 1, current_hi), current))
        current, current_hi = eager, fits
    buckets.append(Bucket(ranges.with_bound(axis, lo, current_hi), current))
    return buckets[::-1]


def _largest_eager_fit(jg: JointGraph, point, lo: int, hi: int, budget: int) -> int | None:
    """The largest value of the split axis at which the un-rewritten step fits the budget, or None.
    The eager peak is monotone in every size, so bisection finds it; scratch memory is counted as
    measured at the top of the range (conservative below it)."""
    def fits(v: int) -> bool:
        graph = jg.symbolic.at(point(v))
        return simulate(graph, eager_schedule(graph)).peak_bytes <= budget

    return largest(lo, hi, fits)


def _plan_at(jg: JointGraph, graph: Graph, point, budget: int, options: Options) -> Plan:
    """The plan for ``graph`` (``jg`` at ``point``), through the plan cache."""
    eager_peak = eager_timeline(graph).peak_bytes
    effort = effort_of(options.effort)
    key = cache.key(graph, budget, options.solver_key(), effort)
    cached = cache.load(key)
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    try:
        solution = solve(graph, budget, options.solver, effort=effort, time_limit=options.time_limit,
                         mip_solver=options.mip_solver)
    except InfeasibleBudgetError as err:  # the largest shape fits, so this one does: report it
        raise CaptureError(f"no plan found at {dict(point)} although one fits at the top of the range "
                           f"({err}); please report this model") from err
    plan = Plan.build(graph=graph, schedule=solution.schedule, budget_bytes=budget, eager_peak_bytes=eager_peak,
                      solver=solution.solver, status=solution.status, solve_seconds=time.perf_counter() - t0,
                      fingerprint=graph_fingerprint(graph), module_paths=jg.module_paths, timeline=solution.timeline,
                      lower_bound_cost=solution.lower_bound_cost)
    cache.store(key, plan)
    return plan


def _eager_plan(jg: JointGraph, point, budget: int) -> Plan | None:
    """The un-rewritten step at ``point`` as a plan, if it fits with scratch memory measured there."""
    graph = jg.at(point)
    schedule = eager_schedule(graph)
    timeline = simulate(graph, schedule)
    if timeline.peak_bytes > budget:
        return None
    return Plan.build(graph=graph, schedule=schedule, budget_bytes=budget, eager_peak_bytes=eager_timeline(graph).peak_bytes,
                      solver="save_all", status="optimal", solve_seconds=0.0, fingerprint=graph_fingerprint(graph),
                      module_paths=jg.module_paths, timeline=timeline, lower_bound_cost=0.0)


def range_infeasible(jg: JointGraph, err: InfeasibleBudgetError, solver: str) -> InfeasibleBudgetError:
    """The error for a budget no plan meets at the top of ``jg``'s ranges (``err``, from planning
    there): along the widest symbol, the largest value at which the lowest-peak schedule fxopt
    found fits (a range up to it plans), and the largest at which any schedule could (the peak
    lower bound, scratch memory counted as zero); or, if even the smallest shape cannot fit, what
    that shape needs."""
    ranges, budget = jg.symbolic.ranges, err.budget
    axis = split_axis(ranges)
    lo, hi = ranges.bounds[axis]
    top = ranges.top()
    zero = [0] * len(jg.graph)
    lowest = lowest_schedule(jg.graph, solver)

    def point(v: int) -> dict[str, int]:
        return {**top, axis: v}

    def schedule_fits(v: int) -> bool:  # (scratch memory measured at v, as a plan for a range up to v counts it)
        return simulate(jg.at(point(v)), lowest.schedule).peak_bytes <= budget

    def bound_fits(v: int) -> bool:
        return peak_lower_bound(jg.symbolic.at(point(v), zero, zero))[0] <= budget

    planned = largest(lo, hi - 1, schedule_fits) if lowest is not None else None
    possible = largest(lo, hi, bound_fits)
    if planned is not None:
        detail = (f"No plan fits at the largest shape ({_shape(top)}). Shapes with {axis} up to {planned} fit one plan: "
                  f"narrow the range to ({lo}, {planned})")
        bounded = possible is not None and planned < possible < hi
        detail += f"; none with {axis} above {possible} can (proven)." if bounded else "."
        return InfeasibleBudgetError(budget, err.min_budget, detail, lower_bound=err.lower_bound)
    bottom = ranges.bottom()
    needed = min_feasible_budget(jg.at(point(lo)), solver, run_ilp=False)
    detail = f"Even {_shape(point(lo))} does not fit: fxopt needs {format_bytes(needed)} there"
    if bottom != point(lo):
        detail += f", and no schedule of {_shape(bottom)} peaks below {format_bytes(peak_lower_bound(jg.at(bottom))[0])}"
    return InfeasibleBudgetError(budget, err.min_budget, detail + ".", lower_bound=err.lower_bound)


def _shape(point) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items())


def largest(lo: int, hi: int, fits) -> int | None:
    """The largest v in [lo, hi] with ``fits(v)``, for ``fits`` true up to some v (monotone), or None."""
    if hi < lo or not fits(lo):
        return None
    return _bisect(lo, hi, fits)


def largest_from_below(lo: int, hi: int, fits) -> int | None:
    """`largest`, for an answer expected near ``lo`` in a wide range: ``fits`` asked up from
    ``lo`` in doubling steps until it fails, then the bisection between; about 2 log2(v - lo)
    questions for the answer v, not log2(hi - lo) (`fxopt.max_batch`'s eager batch on
    Llama-3-8B, 3 below its zero-scratch bracket of 22: 4 questions, not 5; its brackets start
    from a guess: `largest_near`). The same answer as `largest` for a monotone ``fits``."""
    if hi < lo or not fits(lo):
        return None
    return _up(lo, hi, fits)


def _up(lo: int, hi: int, fits) -> int:
    """`largest_from_below`'s search, ``fits(lo)`` known true."""
    step = 1
    while lo < hi:
        probe = min(lo + step, hi)
        if not fits(probe):
            hi = probe - 1
            break
        lo, step = probe, 2 * step
    return _bisect(lo, hi, fits)


def largest_from_above(lo: int, hi: int, fits) -> int | None:
    """`largest`, for an answer expected at ``hi``: ``fits(hi)`` asked first, and only where it
    fails the bisection below it (`fxopt.max_batch` replaying the lowest-peak schedule of the
    batch above its range, which fits the batch just below mostly: on Llama-3-8B one question,
    not four). The same answer as `largest` for a monotone ``fits``."""
    if hi < lo:
        return None
    if fits(hi):
        return hi
    return largest(lo, hi - 1, fits)


def largest_near(lo: int, hi: int, fits, guess: int) -> int | None:
    """`largest`, for an answer expected at ``guess`` (clamped into [lo, hi]): ``fits(guess)``
    asked first, then up from it (where it fits) or down from it (where not) in doubling steps,
    then the bisection between; two questions where ``guess`` is the answer or one above it.
    `fxopt.max_batch`'s bounds grow along their last linear piece near the answer, so their values
    at the range's two largest batches guess it (`guessed`): on Llama-3-8B its zero-scratch
    bracket (22 over batches 2 to 65,536) takes 5 questions, not 10, the one with the scratch
    measured (9) 4, not 5. The same answer as `largest` for a monotone ``fits``."""
    if hi < lo:
        return None
    guess = min(max(guess, lo), hi)
    if fits(guess):
        return _up(guess, hi, fits)
    failed, step = guess, 1
    while failed > lo:
        probe = max(failed - step, lo)
        if fits(probe):
            return _bisect(probe, failed - 1, fits)
        failed, step = probe, 2 * step
    return None


def guessed(lo: int, hi: int, at_before: int, at_hi: int, budget: int) -> int:
    """The largest batch in [lo, hi] within ``budget`` along the line through a bound's values at
    ``hi - 1`` and ``hi``: ``hi`` where it fits there, ``lo`` where the bound does not grow there.
    A bound that is a maximum of sizes each growing in proportion to the batch (a peak lower
    bound) is convex in it, so that line is below it and meets the budget at or above the answer:
    at it where the bound's last linear piece reaches down to the answer (its largest values, the
    activations', grow fastest)."""
    if at_hi <= budget:
        return hi
    slope = at_hi - at_before
    if slope <= 0:
        return lo
    return max(hi - -(-(at_hi - budget) // slope), lo)


def _bisect(lo: int, hi: int, fits) -> int:
    """The largest v in [lo, hi] with ``fits(v)``, ``fits(lo)`` known true."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
