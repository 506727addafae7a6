"""Solvers: (graph, budget in bytes) -> Solution. Plain numbers in and out; no torch.

Every solver's schedule is replayed by the simulator before it is returned, so a solution's
``timeline.peak_bytes`` is the peak the generated code will have, not the solver's own estimate.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.heuristics import HEURISTICS
from fxopt.solvers.ilp import default_backend, solve_ilp
from fxopt.solvers.schedule import Schedule, Timeline, on_demand, save_all_set, simulate

__all__ = ["Graph", "Node", "Schedule", "Timeline", "Solution", "SOLVERS", "solve", "simulate", "eager_schedule"]

log = logging.getLogger("fxopt")

SOLVERS = ("auto", "ilp", "greedy", "checkpoint", "save_all")

# Above this many ILP variables "auto" does not start the exact solve: it would not finish in
# seconds with CBC. Coarsening larger graphs is the ILP-at-scale work.
AUTO_ILP_MAX_VARIABLES = 40_000


class SolverTimeoutWarning(UserWarning):
    """The ILP hit its time limit; the best plan found so far (or a heuristic's) is used."""


@dataclasses.dataclass(frozen=True)
class Solution:
    schedule: Schedule
    timeline: Timeline
    solver: str
    status: str  # "optimal" | "feasible" | "heuristic"
    solve_seconds: float


def eager_schedule(graph: Graph) -> Schedule:
    """The un-rewritten step: save what eager autograd saves, recompute nothing."""
    return on_demand(graph, save_all_set(graph))


def solve(
    graph: Graph,
    budget: int,
    solver: str = "auto",
    *,
    time_limit: float = 60.0,
    on_progress: Callable[[str], None] | None = None,
) -> Solution:
    """The cheapest schedule whose simulated peak is within ``budget`` bytes.

    ``solver``: "ilp" (exact, Checkmate-style, CBC), "greedy", "checkpoint" (Chen segments),
    "save_all" (no rewrite), or "auto" (heuristics first, then the ILP when the graph is small
    enough to solve in seconds; the cheapest valid schedule wins).
    Raises `InfeasibleBudgetError` when nothing fits, naming the smallest budget that does.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    progress = on_progress or (lambda msg: log.info(msg))
    fitting: list[Solution] = []
    lowest_peak: int | None = None

    def consider(schedule: Schedule, timeline: Timeline, name: str, status: str) -> None:
        nonlocal lowest_peak
        lowest_peak = timeline.peak_bytes if lowest_peak is None else min(lowest_peak, timeline.peak_bytes)
        if timeline.peak_bytes <= budget:
            fitting.append(Solution(schedule, timeline, name, status, 0.0))

    heuristics = list(HEURISTICS) if solver == "auto" else [solver] if solver in HEURISTICS else []
    for name in heuristics:
        progress(f"solver {name}")
        for schedule, timeline in HEURISTICS[name](graph, budget):
            consider(schedule, timeline, name, "heuristic")

    ilp_status = None
    if solver == "ilp" or solver == "auto" and _ilp_size(graph) <= AUTO_ILP_MAX_VARIABLES:
        progress(f"solver ilp ({default_backend()})")
        start = min(fitting, key=lambda s: s.timeline.recompute_cost).schedule if fitting else None
        res = solve_ilp(graph, budget, time_limit=time_limit, warm_start=start)
        ilp_status = res.status
        if res.schedule is not None:
            timeline = simulate(graph, res.schedule)
            if timeline.peak_bytes > budget:
                # The ILP's memory model is meant to over-approximate the code; a plan that does not
                # fit when simulated is a gap in that model. Never use it; say so.
                log.warning("fxopt: the ILP's plan peaks at %d bytes when simulated, above the budget "
                            "%d; it is discarded (please report this graph)", timeline.peak_bytes, budget)
            else:
                consider(res.schedule, timeline, "ilp", res.status)
        if res.status == "timeout" or res.status == "feasible":
            warnings.warn(
                f"the ILP stopped at its {time_limit:.0f} s time limit "
                + ("with a feasible, possibly sub-optimal plan" if res.schedule else "without a plan; using the best heuristic"),
                SolverTimeoutWarning,
                stacklevel=2,
            )
        if res.schedule is None and solver == "ilp":
            # Fall back on the heuristics: the ILP's memory model is conservative, so a budget it
            # calls infeasible may still be met by a simulated heuristic schedule.
            before = len(fitting)
            for name in ("greedy", "checkpoint"):
                for schedule, timeline in HEURISTICS[name](graph, budget):
                    consider(schedule, timeline, name, "heuristic")
            if len(fitting) > before and res.status == "infeasible":
                warnings.warn("the ILP found no plan within the budget; using the best heuristic",
                              SolverTimeoutWarning, stacklevel=2)

    if not fitting and solver in ("ilp", "auto") and _ilp_size(graph) <= AUTO_ILP_MAX_VARIABLES:
        # The lowest-peak ILP schedule, simulated, may fit where the ILP's conservative model
        # said nothing does: it is also what `min_feasible_budget` names, so that budget plans.
        res = solve_ilp(graph, None, minimize_peak=True, time_limit=time_limit)
        if res.schedule is not None:
            consider(res.schedule, simulate(graph, res.schedule), "ilp", "feasible")
    if not fitting:
        min_budget = min_feasible_budget(graph, solver, time_limit=time_limit, known=lowest_peak)
        raise InfeasibleBudgetError(budget, min_budget)
    rank = {"optimal": 0, "feasible": 1, "heuristic": 2}
    best = min(fitting, key=lambda s: (round(s.timeline.recompute_cost, 12), s.timeline.peak_bytes, rank[s.status]))
    if best.solver != "ilp" and ilp_status == "optimal":
        # The ILP's memory model over-approximates: a heuristic may beat it. Still proven optimal
        # within that model, so report what was found honestly.
        best = dataclasses.replace(best, status="heuristic")
    return dataclasses.replace(best, solve_seconds=time.perf_counter() - t0)


def _ilp_size(graph: Graph) -> int:
    cands = len(graph.needed_by_backward - graph.free)
    return 2 * cands * max(1, len(graph.backward_nodes) // 2)


def min_feasible_budget(graph: Graph, solver: str = "auto", *, time_limit: float = 60.0,
                        known: int | None = None) -> int:
    """The smallest peak ``solver`` can reach for this graph: for a heuristic its lowest peak; for
    the ILP its solve with the budget as the objective (and the heuristics it falls back on); for
    "auto" the lowest of all. Every schedule is simulated."""
    peaks = [] if known is None else [known]
    names = ("checkpoint", "greedy") if solver in ("auto", "ilp") else (solver,)
    for name in names:
        peaks += [t.peak_bytes for _, t in HEURISTICS[name](graph, 0)]
    if solver == "ilp" or solver == "auto" and _ilp_size(graph) <= AUTO_ILP_MAX_VARIABLES:
        res = solve_ilp(graph, None, minimize_peak=True, time_limit=time_limit)
        if res.schedule is not None:
            peaks.append(simulate(graph, res.schedule).peak_bytes)
    return min(peaks)
