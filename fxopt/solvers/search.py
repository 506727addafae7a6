"""One `solve`'s state: what its phases found, what they proved, and the best plan of it all.

A `Search` is handed from phase to phase (`fxopt.solvers.phases`): each adds the schedules it
finds with `consider` (every one simulated first: a solution's ``timeline.peak_bytes`` is the
peak the generated code will have, not a solver's estimate) and raises the proven lower bound with
`raise_bound`; `best` is the answer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from fxopt.solvers.block_plan import BlockChain, memo_chain, solver_for
from fxopt.solvers.effort import Deadline, Effort
from fxopt.solvers.gap import gap, proven
from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import Candidate
from fxopt.solvers.minimum import Memo, lowest_schedule
from fxopt.solvers.schedule import Schedule, Timeline

log = logging.getLogger("fxopt")

# The solvers stop once a plan is proven within this fraction of the optimum (of their model).
ILP_REL_GAP = 0.005


@dataclasses.dataclass(frozen=True)
class Solution:
    """`solve`'s answer: the schedule, its simulated timeline, which solver found it and what is
    proven about it."""

    schedule: Schedule
    timeline: Timeline
    solver: str
    status: str  # "optimal" | "feasible" | "heuristic"
    solve_seconds: float
    # A proven lower bound on the recompute cost of any plan within the budget (None: none was
    # computed): the highest of the instant program's (`fxopt.solvers.instant`: valid for every
    # schedule the simulator accepts) and the ILP's (its LP relaxation's or branch-and-bound's:
    # valid within the ILP's model, which restricts recomputation to a window and counts memory
    # conservatively). `bound_source` says which ("instant" or "ilp"; "save_all": 0, where eager's
    # schedule fits and costs nothing, `fxopt.solvers.phases.run_save_all_first`). On a graph that offers
    # OFFLOAD, only the instant program's, a bound on the cost with exposed transfer time (see
    # `Search.raise_bound`).
    lower_bound_cost: float | None = None
    bound_source: str | None = None
    # The phases the time limit (a safety stop) cut short, or () when none was: only a solution
    # that names some may differ on another run (`fxopt.solvers.effort`).
    stopped: tuple[str, ...] = ()

    @property
    def gap(self) -> float | None:
        """(cost - lower bound) / cost: how far from optimal this plan may be; 0 when proven."""
        return gap(self.timeline.cost, self.lower_bound_cost)


class Search:
    """One `solve`: the schedules it has found (those within the budget, and the over-budget ones
    compression or offloading may bring within), the best lower bound proven, and what it may
    spend (``effort``, and ``deadline``, the safety stop). ``memo``: the lowest-peak answers kept
    across calls (`fxopt.solvers.minimum.Memo`). ``solve``: `fxopt.solvers.solve`, which the
    graphs of the step's repeated blocks are solved with (`chain`)."""

    def __init__(self, graph: Graph, budget: int, solver: str, effort: Effort, deadline: Deadline,
                 memo: Memo | None = None, on_progress: Callable[[str], None] | None = None,
                 mip_solver: str | None = None, solve: Callable | None = None):
        self.t0 = time.perf_counter()  # (the seconds a solve took, as its caller waited)
        self.graph, self.budget, self.solver = graph, budget, solver
        self.effort, self.deadline, self.memo, self.mip_solver = effort, deadline, memo, mip_solver
        self.solve = solve  # `fxopt.solvers.solve`, for the graphs of a step's repeated blocks
        self.progress = on_progress or (lambda msg: log.info("fxopt: %s", msg))
        self.fitting: list[Solution] = []
        self.over: list[tuple[Schedule, Timeline, str]] = []  # over the budget: compression may fit them
        self.lower_bound: float | None = None
        self.bound_source: str | None = None  # "instant", "ilp" or "save_all"
        self.proven_infeasible = False
        self.ilp_status: str | None = None
        self.model = None  # the ILP (`fxopt.solvers.ilp.RematIlp`), once built
        self.runs: dict[str, list[Candidate]] = {}  # each heuristic's schedules
        # The step as a chain of repeated blocks (`fxopt.solvers.block_plan`), once asked for;
        # ``by_blocks``: its plans fit, and the phases of the whole graph are not run.
        self._chain: BlockChain | None | bool = False
        self.by_blocks = False
        # Eager's schedule fits and is proven optimal with no gap: no phase can find a cheaper plan
        # (`fxopt.solvers.phases.run_save_all_first`).
        self.exact = False

    def chain(self) -> BlockChain | None:
        """The step's chain of repeated blocks, each kind solved once (None where it has none),
        with this search's effort and safety stop; built the first time it is asked for (or
        taken from ``memo``)."""
        if self._chain is False:
            self._chain = memo_chain(self.graph, self.kind_solvers(), (self.effort, self.mip_solver), self.memo)
        return self._chain

    def kind_solvers(self):
        """How the graphs of the step's repeated blocks are solved (`block_plan.solver_for`)."""
        return solver_for(self.solve, lowest_schedule, self.effort, self.deadline, self.mip_solver)

    def consider(self, schedule: Schedule, timeline: Timeline, name: str, status: str, *,
                 keep_over: bool = False) -> None:
        """A simulated schedule; within the budget it is a candidate answer; over it, with
        ``keep_over``, one to complete with COMPRESS or OFFLOAD."""
        if timeline.peak_bytes <= self.budget and not timeline.over_host_budget:
            self.fitting.append(Solution(schedule, timeline, name, status, 0.0))
        elif keep_over and timeline.peak_bytes > self.budget:
            self.over.append((schedule, timeline, name))

    def cheapest(self) -> Solution | None:
        return min(self.fitting, key=lambda s: s.timeline.cost) if self.fitting else None

    def raise_bound(self, bound: float | None, source: str) -> None:
        # The ILP models SAVE and RECOMPUTE (and COMPRESS), not OFFLOAD: on a graph that offers it
        # its bound does not hold (an offloaded plan may cost less than any plan it models), so
        # none is taken from it. The instant program's holds: it relaxes OFFLOAD too.
        if self.graph.offloadable and source == "ilp":
            return
        if bound is not None and (self.lower_bound is None or bound > self.lower_bound):
            self.lower_bound, self.bound_source = bound, source

    def settled(self) -> bool:
        """Nothing more to find: the budget is proven infeasible, or a plan proven within
        `ILP_REL_GAP` of the bound."""
        best = self.cheapest()
        return self.proven_infeasible or (best is not None and proven(best.timeline.cost, self.lower_bound,
                                                                      ILP_REL_GAP))

    def best(self) -> Solution:
        """The cheapest plan that fits (then the one holding the least host memory, then the lowest
        peak, then the best status), with its status as proven and the bound. (At equal cost, a
        plan that copies less is preferred to one that peaks lower by copying values out: its
        copies are hidden only as far as the measured bandwidth holds, and they take host memory.)"""
        rank = {"optimal": 0, "feasible": 1, "heuristic": 2}
        best = min(self.fitting, key=lambda s: (round(s.timeline.cost, 12), s.timeline.host_peak_bytes,
                                                s.timeline.peak_bytes, rank[s.status]))
        if best.solver != "ilp" and self.ilp_status == "optimal":
            # The ILP's memory model over-approximates: a heuristic may beat it. Still proven optimal
            # within that model, so report what was found honestly.
            best = dataclasses.replace(best, status="heuristic")
        if proven(best.timeline.cost, self.lower_bound, ILP_REL_GAP):
            best = dataclasses.replace(best, status="optimal")
        return dataclasses.replace(best, solve_seconds=time.perf_counter() - self.t0, lower_bound_cost=self.lower_bound,
                                   bound_source=self.bound_source, stopped=tuple(self.deadline.stopped))

    def report_gap(self, what: str) -> None:
        best = self.cheapest()
        if best is not None and self.lower_bound is not None:
            cost = best.timeline.recompute_cost
            self.progress(f"{what}: best {fmt_cost(cost)}, bound {fmt_cost(self.lower_bound)}, "
                          f"gap {100 * gap(cost, self.lower_bound):.2f}%")


def fmt_cost(cost: float | None) -> str:
    return "?" if cost is None else f"{cost * 1e3:.2f} ms"
