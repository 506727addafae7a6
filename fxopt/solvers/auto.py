"""``solve``: the one entry point of the solvers, and the strategies it runs.

A strategy is a tuple of phases (`fxopt.solvers.phases.STRATEGIES`); ``"auto"`` combines all of
them. Every phase's schedule is replayed by the simulator before it is kept, so a solution's
``timeline.peak_bytes`` is the peak the generated code will have, not the solver's own estimate.
Every phase is bounded by counted work (`fxopt.solvers.effort`), so the same graph, budget,
solver and effort give the same solution on any machine; the time limit is a safety stop that
says so when it stops a phase. When nothing fits, the answer names the smallest budget that does
(`fxopt.solvers.minimum.lowest_plan`), and planning at that budget succeeds.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from fxopt.errors import check_choice
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT, Deadline, Effort, effort_of
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers import minimum
from fxopt.solvers.block_plan import memo_chain, solver_for
from fxopt.solvers.minimum import Memo, floor_of, infeasible, memo_key
from fxopt.solvers.phases import strategies
from fxopt.solvers.schedule import Schedule, Timeline, on_demand, save_all_set, simulate
from fxopt.solvers.search import ILP_REL_GAP, Search, Solution

__all__ = ["DEFAULT_TIME_LIMIT", "ILP_REL_GAP", "REVISION", "SOLVERS", "Solution", "SolverTimeoutWarning",
           "check_solver", "eager_schedule", "eager_timeline", "solve", "lowest_plan", "lowest_schedule", "min_feasible_budget"]

# Bumped whenever the solvers may answer differently for the same graph, budget and options, so
# that plans cached on disk by an older revision are not served (`fxopt.cache.key`).
# 21: the loss's backward written in place by default (`fxopt.passes.loss`).
# 22: `save_more`, `exchange` and `greedy` count a graph's simulated schedules by its size
# (`fxopt.solvers.effort.simulation_weight`): graphs above 2,500 nodes may get other plans.
# 23: the profiles the ILP, the instant program and the chain solver count fixed memory with
# hold a collective's late-freed buffers (`Node.lingers`) as the simulator does: FSDP steps on gloo
# may get other plans and floors.
# 24: the eager step's memory without the incoming gradients eager never gets (a step returning
# its scalar loss beside non-scalar outputs: `fxopt.analysis.joint`): its fractions resolve lower.
# 25: gradient sums written in place, as eager's engine writes them (`fxopt.passes.accumulate`):
# other graphs, and the eager step's peak lower where such a sum was its peak.
# 26: a lowest-peak schedule, and the cheapest plan of the whole graph's phases, keep what they
# recompute more than once where that fits (`fxopt.solvers.heuristics.keep_recomputed`); a
# mixed-precision reduce-scatter's wait moves with the cast after it (`fxopt.solvers.prefetch`).
# 27: eager's schedule proven the cheapest by the instant program's bound at a loose budget, found
# once per graph (`fxopt.solvers.phases.eager_proof`): the same plans, but its bound may be that
# program's rather than the one at the budget (a plan's ``lower_bound_cost`` may differ in its last digits).
# 28: "auto" keeps what the fitting plan with the most room recomputes more than once too, not only the
# cheapest plan's, and near the step's floor (`fxopt.solvers.phases.NEAR_FLOOR`) considers the
# smallest budget's plan: a budget there never gets a plan costlier than the smallest budget's.
REVISION = 28

STRATEGIES = strategies()
SOLVERS = tuple(STRATEGIES)


class SolverTimeoutWarning(UserWarning):
    """The time limit (a safety stop) cut a solve short: its plan is the best found by then, and
    another run may find another."""


def check_solver(solver: str) -> None:
    """Raise `ValueError` unless ``solver`` is one of `SOLVERS` (for every entry point that takes one)."""
    check_choice("solver", solver, SOLVERS)


def eager_schedule(graph: Graph) -> Schedule:
    """The un-rewritten step: save what eager autograd saves, recompute nothing."""
    return on_demand(graph, save_all_set(graph))


def eager_timeline(graph: Graph) -> Timeline:
    """The un-rewritten step's memory as eager autograd runs it (`eager_schedule`, freed as
    autograd frees, what its autograd nodes save kept for their formulas: `Node.eager_reads`, its
    formulas' in-place writes in place: `Node.eager_in_place`): the
    peak a fractional budget is a share of."""
    if any(n.eager_bytes is not None or n.eager_reads or n.eager_in_place for n in graph.nodes):
        graph = Graph(tuple(_as_eager(n, graph) for n in graph.nodes), graph.transfers)
    return simulate(graph, eager_schedule(graph), eager_frees=True)


def _as_eager(node: Node, graph: Graph) -> Node:
    if node.eager_bytes is None and not node.eager_reads and not node.eager_in_place:
        return node
    nbytes = node.bytes if node.eager_bytes is None else node.eager_bytes
    return dataclasses.replace(node, bytes=0 if node.eager_in_place else nbytes,
                               storage=_made_by_eager(node, graph) if node.eager_in_place else node.storage,
                               inputs=tuple(dict.fromkeys(node.inputs + node.eager_reads)), eager_reads=(),
                               eager_in_place=False)


def _made_by_eager(node: Node, graph: Graph) -> int:
    """The input an op eager runs in place (`Node.eager_in_place`) writes into: its first input
    that eager makes (not an incoming gradient eager never gets: those have ``eager_bytes`` 0)."""
    return next(j for j in node.inputs if not (graph.nodes[j].tangent and graph.nodes[j].eager_bytes == 0))


def solve(
    graph: Graph,
    budget: int,
    solver: str = "auto",
    *,
    effort: Effort | float | None = None,
    time_limit: Deadline | float = DEFAULT_TIME_LIMIT,
    memo: Memo | None = None,
    on_progress: Callable[[str], None] | None = None,
    mip_solver: str | None = None,
) -> Solution:
    """The cheapest schedule whose simulated peak is within ``budget`` bytes.

    ``solver``: "ilp" (exact, Checkmate-style), "instant" (the instant program: a plan and a lower
    bound from the memory at the backward's tightest instants, see `fxopt.solvers.instant`),
    "segments" (checkpoints at the forward's articulation values, then the most expensive values
    per byte), "greedy", "checkpoint" (Chen segments), "save_all" (no rewrite), or "auto" (all of
    them in turn, see `fxopt.solvers.phases`; the cheapest valid schedule wins). ``effort``: the
    work each phase may do (`fxopt.solvers.effort.Effort`, or a multiple of the default).
    ``time_limit``: a safety stop, seconds for the whole solve (or a `Deadline` shared with the
    caller's other solves); past it the best plan found so far is used, and the solution names the
    phases it stopped (`Solution.stopped`, a `SolverTimeoutWarning`). ``memo``: the lowest-peak
    answers kept across calls (`fxopt.solvers.minimum.Memo`; None: none kept). ``on_progress``
    receives one-line progress messages (by default they go to the ``fxopt`` logger). Ctrl-C
    during the ILP stops it and keeps the best plan found so far. Raises
    `InfeasibleBudgetError` when nothing fits, naming the smallest budget that plans and the peak
    no schedule goes below."""
    check_solver(solver)
    search = Search(graph, budget, solver, effort_of(effort), Deadline.of(time_limit), memo, on_progress, mip_solver,
                    solve)
    floor, where = floor_of(graph, memo)
    known = memo.get(graph, memo_key(solver, search.effort, True, mip_solver)) if memo is not None else None
    if budget < floor:
        # Proven at once: while ``where`` runs, more than the budget is alive whatever the plan.
        search.progress(f"infeasible: at least {floor} bytes are alive at {where}")
        search.proven_infeasible = True
    elif known is not None and budget < known.floor:
        # Proven by the lowest-peak program of an earlier search on this graph.
        search.progress(f"infeasible: no schedule peaks below {known.floor} bytes")
        search.proven_infeasible = True
    for phase in STRATEGIES[solver]:
        if phase.when(search):
            phase.run(search)
    solution = search.best() if search.fitting else _nothing_fits(search)
    if solution.stopped:
        _say_stopped(search.deadline, "this plan is the best found by then")
    return solution


def _say_stopped(deadline: Deadline, what: str) -> None:
    """The one warning a solve the safety stop cut short gives (`SolverTimeoutWarning`)."""
    warnings.warn(f"the solvers stopped at the time limit ({deadline.seconds:.1f} s) in: {', '.join(deadline.stopped)}; "
                  f"{what}, and another run may find another (raise time_limit, or lower the effort)",
                  SolverTimeoutWarning, stacklevel=3)


def lowest_plan(graph: Graph, solver: str = "auto", **kwargs) -> minimum.Lowest:
    """`fxopt.solvers.minimum.lowest_plan`, for "auto" on a step of repeated blocks with their
    plans (`fxopt.solvers.block_plan`, the blocks' graphs solved by `solve`)."""
    if solver == "auto" and "blocks" not in kwargs:
        effort, deadline = effort_of(kwargs.get("effort")), Deadline.of(kwargs.get("time_limit"))
        kwargs = {**kwargs, "effort": effort, "time_limit": deadline}
        solvers = solver_for(solve, minimum.lowest_schedule, effort, deadline, kwargs.get("mip_solver"))
        kwargs["blocks"] = memo_chain(graph, solvers, (effort, kwargs.get("mip_solver")), kwargs.get("memo"))
    return minimum.lowest_plan(graph, solver, **kwargs)


def min_feasible_budget(graph: Graph, solver: str = "auto", **kwargs) -> int:
    """The smallest peak ``solver`` reaches for this graph: `lowest_plan`'s (the same keywords)."""
    return lowest_plan(graph, solver, **kwargs).peak


def lowest_schedule(graph: Graph, solver: str = "auto", **kwargs) -> minimum.Lowest:
    """`lowest_plan` without the ILP's search unless ``run_ilp`` is given (the cheap one)."""
    return lowest_plan(graph, solver, **{"run_ilp": False, **kwargs})


def _nothing_fits(search: Search) -> Solution:
    """The lowest-peak plan where it fits (a plan the phases missed); else `InfeasibleBudgetError`
    naming its peak, the smallest budget that plans."""
    graph, budget = search.graph, search.budget
    search.progress("no plan fits; searching for the smallest budget")
    # (Nothing fits: the heuristics' schedules here are theirs at any lower budget.)
    lowest = minimum.lowest_plan(graph, search.solver, effort=search.effort, time_limit=search.deadline,
                                 memo=search.memo, runs=search.runs, mip_solver=search.mip_solver,
                                 blocks=search.chain() if search.solver == "auto" else None)
    if lowest.peak <= budget:
        search.consider(lowest.schedule, simulate(graph, lowest.schedule), lowest.name, "heuristic")
        if search.fitting:
            return search.best()
    # A budget the instant program proved infeasible is below every schedule's peak too.
    floor = max(floor_of(graph, search.memo)[0], budget + 1 if search.proven_infeasible else 0, lowest.floor)
    stopped = search.deadline.stopped
    detail = (f"The search for it stopped at the time limit ({search.deadline.seconds:.1f} s) in: {', '.join(stopped)}; "
              "a longer time_limit may find a smaller one." if stopped and lowest.peak > floor else "")
    if stopped:
        # (Said as a warning too: budget="min" plans at the budget the error names, and keeps
        # no error to say it with.)
        _say_stopped(search.deadline, "the smallest budget named is the smallest found by then")
    raise infeasible(budget, lowest, min(floor, lowest.peak), detail)
