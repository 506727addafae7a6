"""``solve``: the one entry point of the solvers, and the ``"auto"`` strategy that combines them.

Every solver's schedule is replayed by the simulator before it is returned, so a solution's
``timeline.peak_bytes`` is the peak the generated code will have, not the solver's own estimate.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

from fxopt.errors import InfeasibleBudgetError, check_choice
from fxopt.solvers.graph import Graph, is_lossy_codec
from fxopt.solvers.heuristics import (HEURISTICS, Candidate, compress_to_fit, greedy, offload_all, offload_to_fit,
                                      save_more, segments)
from fxopt.solvers.gap import gap, proven
from fxopt.solvers.ilp import RematIlp, build_ilp, lp_bound_and_roundings, solve_ilp
from fxopt.solvers.chain import chain_candidates, min_peak_schedule
from fxopt.solvers.instant import instant_solve, lowest_peak, peak_lower_bound
from fxopt.solvers.mip import Progress, default_mip_solver
from fxopt.solvers.schedule import InvalidScheduleError, Schedule, Timeline, on_demand, save_all_set, simulate

log = logging.getLogger("fxopt")

# Bumped whenever the solvers may answer differently for the same graph, budget and options, so
# that plans cached on disk by an older revision are not served (`fxopt.cache.key`).
REVISION = 12

SOLVERS = ("auto", "ilp", "instant", "segments", "greedy", "checkpoint", "save_all")

# Above this many integer variables "auto" does not start the exact solve: it would not finish in
# seconds. (A 12-layer GPT-2 step, ~2,100 nodes, has about 7,500.)
AUTO_ILP_MAX_VARIABLES = 200_000

# How many over-budget heuristic schedules (the cheapest) `solve` tries to complete with COMPRESS.
COMPRESS_TRIES = 12

# The ILP stops once its plan is proven within this fraction of the optimum (of its model).
ILP_REL_GAP = 0.005

# Share of the time limit "auto" gives the instant program before the ILP.
INSTANT_TIME_SHARE = 0.75

# Seconds for the whole of one `solve` (every solver, the fallbacks and the search for the smallest
# budget when nothing fits) unless the caller gives another limit: a user trying budgets gets each
# answer in seconds; a longer limit may buy a proven-optimal plan on large graphs.
DEFAULT_TIME_LIMIT = 4.0

# The least a time-limited phase is given, even past the deadline, so that a late phase (the
# lowest-peak search after a long ILP) still answers: a solve may overrun its limit by about this.
MIN_PHASE_SECONDS = 0.5

# Share of the remaining time "auto" gives to saving more in its cheapest plan, where it still fits,
# before the ILP (a plan at a tight budget may recompute what it need not where memory is loose).
SAVE_MORE_TIME_SHARE = 0.2

# The search for the smallest budget stops once a plan is within this share of the proven floor.
LOWEST_PEAK_SLACK = 0.002

# Share of the search for the smallest budget left to the instant program's lowest peak (its
# floor, and plans near it) after the ILP's has had the rest: the ILP reaches `peak_lower_bound`
# within a fraction of a second where it can (T5), and then nothing else runs; the instant
# program finds lower peaks than the ILP's where it does not (Llama, Qwen2: 2.6% lower).
LOWEST_PEAK_TIME_SHARE = 0.7

# Share of the remaining time that the search for the smallest budget (when nothing fits) may
# spend in the instant program's and the ILP's lowest peaks (searched once per graph and
# process); the rest is left for planning without the codecs.
MIN_BUDGET_TIME_SHARE = 0.8


class SolverTimeoutWarning(UserWarning):
    """The ILP hit its time limit; the best plan found so far (or a heuristic's) is used."""


@dataclasses.dataclass(frozen=True)
class Solution:
    schedule: Schedule
    timeline: Timeline
    solver: str
    status: str  # "optimal" | "feasible" | "heuristic"
    solve_seconds: float
    # A proven lower bound on the recompute cost of any plan within the budget (None: none was
    # computed): the highest of the instant program's (`fxopt.solvers.instant`: valid for every
    # schedule the simulator accepts) and the ILP's (its LP relaxation's or branch-and-bound's:
    # valid within the ILP's model, which restricts recomputation to a window and counts memory
    # conservatively). `bound_source` says which ("instant" or "ilp"). On a graph that offers
    # OFFLOAD, only the instant program's, a bound on the cost with exposed transfer time (see
    # `_Search.raise_bound`).
    lower_bound_cost: float | None = None
    bound_source: str | None = None

    @property
    def gap(self) -> float | None:
        """(cost - lower bound) / cost: how far from optimal this plan may be; 0 when proven."""
        return gap(self.timeline.cost, self.lower_bound_cost)


def check_solver(solver: str) -> None:
    """Raise `ValueError` unless ``solver`` is one of `SOLVERS` (for every entry point that takes one)."""
    check_choice("solver", solver, SOLVERS)


def eager_schedule(graph: Graph) -> Schedule:
    """The un-rewritten step: save what eager autograd saves, recompute nothing."""
    return on_demand(graph, save_all_set(graph))


def eager_timeline(graph: Graph) -> Timeline:
    """The un-rewritten step's memory as eager autograd runs it (`eager_schedule`, freed as
    autograd frees): the peak a fractional budget is a share of."""
    if any(n.eager_bytes is not None for n in graph.nodes):
        graph = Graph(tuple(n if n.eager_bytes is None else dataclasses.replace(n, bytes=n.eager_bytes)
                            for n in graph.nodes), graph.transfers)
    return simulate(graph, eager_schedule(graph), eager_frees=True)


def solve(
    graph: Graph,
    budget: int,
    solver: str = "auto",
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    on_progress: Callable[[str], None] | None = None,
    mip_solver: str | None = None,
    retry: bool = False,
) -> Solution:
    """The cheapest schedule whose simulated peak is within ``budget`` bytes.

    ``solver``: "ilp" (exact, Checkmate-style), "instant" (the instant program: a plan and a lower
    bound from the memory at the backward's tightest instants, see `fxopt.solvers.instant`),
    "segments" (checkpoints at the forward's articulation values, then the most expensive values
    per byte), "greedy", "checkpoint" (Chen segments), "save_all" (no rewrite), or "auto"
    (save_all and checkpoint, then the instant program; unless that proves its plan within
    `ILP_REL_GAP` of optimal: greedy and segments, the ILP's LP relaxation rounded and the ILP
    warm-started from the best plan so far; the cheapest valid schedule wins).
    ``time_limit``: seconds for the whole solve, the answer "infeasible" included (each late phase
    still gets `MIN_PHASE_SECONDS`); at the limit the best plan found so far is used, with its
    proven gap. ``on_progress`` receives one-line progress messages (by default they go to the
    ``fxopt`` logger). Ctrl-C during the ILP stops it and keeps the best plan found so far.
    ``retry``: a second try (the graph without codecs or ReLU masks) in what is left of the
    first's limit: past it, the lowest-peak search for a plan that fits is skipped (the first ran
    it). Raises `InfeasibleBudgetError` when nothing fits, naming the smallest budget that does
    and the peak no schedule goes below."""
    check_solver(solver)
    search = _Search(graph, budget, solver, time_limit, on_progress, mip_solver, retry)
    floor, where = peak_lower_bound(graph)
    reached = lowest_schedule(graph, solver)
    if budget < floor:
        # Proven at once: while ``where`` runs, more than the budget is alive whatever the plan.
        search.progress(f"infeasible: at least {floor} bytes are alive at {where}")
        search.proven_infeasible = True
    elif reached is not None and budget < reached.floor:
        # Proven by the lowest-peak program of an earlier search on this graph.
        search.progress(f"infeasible: no schedule peaks below {reached.floor} bytes")
        search.proven_infeasible = True
    # "auto" runs the fast heuristics first, and the slower ones (a few seconds each on thousands
    # of nodes) only if the instant program does not prove its plan optimal.
    first = ["save_all", "checkpoint"] if solver == "auto" else [solver] if solver in HEURISTICS else []
    if solver in ("ilp", "instant"):
        first = ["save_all"]  # recomputing nothing is optimal when it fits: the models may not see it
    search.run_heuristics(first)
    if solver == "auto":
        search.run_chain()
    if solver in ("instant", "auto") and not search.proven_infeasible:
        search.run_instant()
    if solver == "auto" and (search.proven_infeasible or not search.settled()):
        # (Also when the budget is proven infeasible: cheap, and a check on that proof.)
        search.run_heuristics([name for name in HEURISTICS if name not in first])
    if graph.compressible and search.over and not search.proven_infeasible:
        search.compress_cheapest_over_budget()
    if graph.offloadable and search.over and not search.proven_infeasible:
        search.offload_cheapest_over_budget()
    if search.proven_infeasible and search.fitting:
        log.warning("fxopt: the instant program called budget %d infeasible but a simulated plan fits "
                    "(please report this graph)", budget)
        search.proven_infeasible = False
    # (Past the deadline, what only improves a plan that fits is skipped; a search for one that fits
    # still runs, each phase given `MIN_PHASE_SECONDS`.)
    if solver == "auto" and not search.settled() and search.seconds_left() > 0:
        search.save_more()
    if not search.proven_infeasible and (solver == "ilp" or solver == "auto" and not search.settled()
                                         and (search.seconds_left() > 0 or not search.fitting)):
        search.run_ilp()
    if (solver == "ilp" and not any(s.solver.startswith("ilp") for s in search.fitting)
            or solver == "instant" and not search.proven_infeasible
            and not any(s.solver == "instant" for s in search.fitting)):
        # Fall back on the heuristics: the ILP's memory model is conservative, so a budget it
        # calls infeasible may still be met by a simulated heuristic schedule; the instant
        # program's plans may peak at instants it did not model.
        search.run_heuristics(("segments", "greedy", "checkpoint"), fallback=True)
        search.run_chain(fallback=True)  # what `min_feasible_budget` also names a budget by
    if not search.fitting and not search.proven_infeasible:
        search.rescue()
    if not search.fitting:
        return search.nothing_fits()
    return search.best()


class _Search:
    """One `solve`: the schedules it has found (those within the budget, and the heuristics' over
    it, which compression may bring within), the best lower bound proven, and its phases."""

    def __init__(self, graph: Graph, budget: int, solver: str, time_limit: float,
                 on_progress: Callable[[str], None] | None, mip_solver: str | None, retry: bool = False):
        self.t0 = time.perf_counter()
        self.retry = retry
        self.graph, self.budget, self.solver = graph, budget, solver
        self.time_limit, self.mip_solver = time_limit, mip_solver
        self.on_progress = on_progress
        self.progress = on_progress or (lambda msg: log.info("fxopt: %s", msg))
        self.fitting: list[Solution] = []
        self.over: list[tuple[Schedule, Timeline, str]] = []  # over-budget heuristic schedules
        self.lowest_peak: int | None = None
        self.lower_bound: float | None = None
        self.bound_source: str | None = None  # "instant" or "ilp"
        self.proven_infeasible = False
        self.ilp_status: str | None = None
        self.model: RematIlp | None = None  # the ILP, once built (and not skipped as too large)
        self.heuristic_runs: dict[str, list[Candidate]] = {}  # each heuristic's schedules

    def seconds_left(self) -> float:
        return self.time_limit - (time.perf_counter() - self.t0)

    def phase_seconds(self, share: float = 1.0) -> float:
        """Seconds for the next time-limited phase: ``share`` of what is left, at least
        `MIN_PHASE_SECONDS`."""
        return max(MIN_PHASE_SECONDS, share * self.seconds_left())

    def consider(self, schedule: Schedule, timeline: Timeline, name: str, status: str) -> None:
        peak = timeline.peak_bytes
        self.lowest_peak = peak if self.lowest_peak is None else min(self.lowest_peak, peak)
        _remember_lowest(self.graph, self.solver, schedule, peak, name)
        if peak <= self.budget and not timeline.over_host_budget:
            self.fitting.append(Solution(schedule, timeline, name, status, 0.0))

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
        best = self.cheapest()
        return self.proven_infeasible or (best is not None and proven(best.timeline.cost, self.lower_bound,
                                                                      ILP_REL_GAP))

    def run_heuristics(self, names, *, fallback: bool = False) -> None:
        """Each heuristic's schedules; as a ``fallback`` without a word, and not kept for compression."""
        for name in names:
            if not fallback:
                self.progress(f"solver {name}")
            run = HEURISTICS[name]
            if run in (segments, greedy):  # (past the deadline they stop trying values one at a time)
                self.heuristic_runs[name] = run(self.graph, self.budget,
                                                deadline=self.t0 + max(self.time_limit, MIN_PHASE_SECONDS))
            else:
                self.heuristic_runs[name] = run(self.graph, self.budget)
            for schedule, timeline in self.heuristic_runs[name]:
                self.consider(schedule, timeline, name, "heuristic")
                if timeline.peak_bytes > self.budget and not fallback:
                    self.over.append((schedule, timeline, name))

    def run_chain(self, *, fallback: bool = False) -> None:
        """The chain solver's cheapest schedule within the budget, and its lowest-peak one
        (`fxopt.solvers.chain`); over the budget, compression may make them fit."""
        if not fallback:
            self.progress("solver chain")
        for schedule, timeline in chain_candidates(self.graph, self.budget):
            self.consider(schedule, timeline, "chain", "heuristic")
            if timeline.peak_bytes > self.budget and not fallback:
                self.over.append((schedule, timeline, "chain"))

    def run_instant(self) -> None:
        share = self.phase_seconds(1.0 if self.solver == "instant" else INSTANT_TIME_SHARE)
        self.progress("solver instant")
        best = self.cheapest()
        inst = instant_solve(self.graph, self.budget, time_limit=share, mip_solver=self.mip_solver,
                             start=best.schedule if best is not None else None)
        self.proven_infeasible = inst.infeasible
        self.raise_bound(inst.bound, "instant")
        for schedule, timeline in inst.plans:
            self.consider(schedule, timeline, "instant", "heuristic")
            if timeline.peak_bytes > self.budget:
                self.over.append((schedule, timeline, "instant"))  # compression may make it fit
        best = self.cheapest()
        if best is not None and self.lower_bound is not None:
            cost = best.timeline.recompute_cost
            self.progress(f"instant: best {_fmt(cost)}, bound {_fmt(self.lower_bound)}, "
                          f"gap {100 * gap(cost, self.lower_bound):.2f}%, {time.perf_counter() - self.t0:.0f} s")

    def compress_cheapest_over_budget(self) -> None:
        """COMPRESS where recomputation alone does not fit (or fits only at a higher cost): the
        cheapest over-budget schedules, completed with as little compression as fits."""
        self.progress("compressing saved values")
        best = self.cheapest()
        self.over.sort(key=lambda c: c[1].cost)
        for schedule, timeline, name in self.over[:COMPRESS_TRIES]:
            if best is not None and timeline.cost >= best.timeline.cost:
                break
            self.compress_to_fit(schedule, name)

    def compress_to_fit(self, schedule: Schedule, name: str) -> None:
        done = compress_to_fit(self.graph, schedule, self.budget)
        if done is not None:
            self.consider(*done, f"{name}+compress", "heuristic")

    def offload_cheapest_over_budget(self) -> None:
        """OFFLOAD where the plans so far do not fit, or fit only at a higher cost: the cheapest
        over-budget schedules, completed with the values whose copies hide best."""
        self.progress("offloading saved values")
        best = self.cheapest()
        self.over.sort(key=lambda c: c[1].cost)
        for schedule, timeline, name in self.over[:COMPRESS_TRIES]:
            if best is not None and timeline.cost >= best.timeline.cost:
                break
            done = offload_to_fit(self.graph, schedule, self.budget)
            if done is not None:
                self.consider(*done, f"{name}+offload", "heuristic")

    def save_more(self) -> None:
        """The cheapest plan so far with more SAVEd, where it still fits (`save_more`)."""
        best = self.cheapest()
        if best is None:
            return
        self.progress("saving more where it fits")
        done = save_more(self.graph, best.schedule, self.budget, seconds=self.phase_seconds(SAVE_MORE_TIME_SHARE))
        if done is not None:
            self.consider(*done, f"{best.solver}+save", "heuristic")

    def run_ilp(self) -> None:
        """The ILP: its LP relaxation (a bound, and plans rounded from it), then the exact solve,
        warm-started from the best plan so far, unless a plan is already proven optimal."""
        model = build_ilp(self.graph, self.budget)
        if self.solver == "auto" and model.mip.num_integer > AUTO_ILP_MAX_VARIABLES:
            self.progress(f"ILP skipped: {model.mip.num_integer} integer variables")
            return
        self.model = model
        self.progress(f"ILP: {model.mip.num_integer} integer variables, {model.mip.num_rows} constraints; "
                      "LP relaxation")
        lp_bound, roundings = lp_bound_and_roundings(self.graph, self.budget, time_limit=self.phase_seconds(),
                                                     mip_solver=self.mip_solver, model=model)
        self.raise_bound(lp_bound, "ilp")
        for schedule in roundings:
            try:
                self.consider(schedule, simulate(self.graph, schedule), "ilp-rounding", "heuristic")
            except InvalidScheduleError:
                continue
        best = self.cheapest()
        if lp_bound is None and best is None:
            self.progress("the LP relaxation found no plan within the budget")
        remaining = self.seconds_left()
        if best is not None and proven(best.timeline.recompute_cost, self.lower_bound, ILP_REL_GAP):
            self.progress("a plan is proven optimal")
        elif lp_bound is not None and remaining > 0:
            self.solve_ilp(model, remaining, best)

    def solve_ilp(self, model: RematIlp, remaining: float, best: Solution | None) -> None:
        self.progress(f"solver ilp ({self.mip_solver or default_mip_solver()}), {remaining:.0f} s left")

        def report(p: Progress) -> None:
            if p.incumbent is None:
                self.progress(f"ILP: searching, bound {_fmt(p.bound)}, {p.seconds:.0f} s")
            else:
                found = "?" if p.gap is None else f"{100 * p.gap:.1f}%"
                self.progress(f"ILP: best {_fmt(p.incumbent)}, bound {_fmt(p.bound)}, gap {found}, {p.seconds:.0f} s")

        res = solve_ilp(self.graph, self.budget, time_limit=remaining, warm_start=best.schedule if best else None,
                        mip_solver=self.mip_solver, rel_gap=ILP_REL_GAP, on_progress=report, model=model)
        self.ilp_status = res.status
        self.raise_bound(res.lower_bound, "ilp")
        if res.schedule is not None:
            timeline = simulate(self.graph, res.schedule)
            if timeline.peak_bytes > self.budget:
                # The ILP's memory model is meant to over-approximate the code; a plan that
                # does not fit when simulated is a gap in that model. Never use it; say so.
                log.warning("fxopt: the ILP's plan peaks at %d bytes when simulated, above the budget "
                            "%d; it is discarded (please report this graph)", timeline.peak_bytes, self.budget)
            else:
                self.consider(res.schedule, timeline, "ilp", "optimal" if res.status == "optimal" else "feasible")
        if res.interrupted:
            self.progress("ILP interrupted; keeping the best plan found")
        elif res.status in ("timeout", "feasible"):
            self.warn_timeout(found_plan=res.schedule is not None)

    def warn_timeout(self, *, found_plan: bool) -> None:
        best = self.cheapest()
        warnings.warn(
            f"the ILP stopped at the solvers' {self.time_limit:.1f} s time limit "
            + ("with a feasible plan" if found_plan else "without a plan; using the best heuristic")
            + ("" if self.lower_bound is None or best is None else
               f" (its recompute cost is at most {100 * gap(best.timeline.recompute_cost, self.lower_bound):.0f}% "
               "above the proven lower bound)"),
            SolverTimeoutWarning,
            stacklevel=5,  # solve's caller (solve, run_ilp, solve_ilp, warn_timeout are 4 to 1)
        )

    def rescue(self) -> None:
        """Nothing fits yet: plans that may fit where the searches above found none."""
        graph = self.graph
        if graph.compressible:
            # Every over-budget heuristic schedule, completed with compression (what
            # `min_feasible_budget` also tries, so the budget it names plans).
            for schedule, _, name in self.over[COMPRESS_TRIES:]:
                self.compress_to_fit(schedule, name)
        reached = _LOWEST.get(_lowest_key(graph, self.solver))
        if not self.fitting and reached is not None and reached.peak <= self.budget:
            # The schedule behind a smallest budget named earlier in this process: a time-limited
            # search need not find it again, and the budget it named must plan.
            self.consider(reached.schedule, simulate(graph, reached.schedule), reached.name, "heuristic")
        if (not self.fitting and self.model is not None and not self.proven_infeasible
                and not (self.retry and self.seconds_left() <= 0)):
            # The lowest-peak ILP schedule, simulated, may fit where the ILP's conservative model
            # said nothing does: it is also what `min_feasible_budget` names, so that budget plans.
            self.progress("no plan fits; solving for the lowest peak")
            for schedule in _lowest_peak_schedules(graph, self.phase_seconds(MIN_BUDGET_TIME_SHARE), self.mip_solver):
                self.consider(schedule, simulate(graph, schedule), "ilp", "feasible")

    def nothing_fits(self) -> Solution:
        """Raise `InfeasibleBudgetError` with the smallest budget that plans; first, if the graph
        has codecs, plan without them (a solution there is one here too)."""
        graph, budget, solver = self.graph, self.budget, self.solver
        self.progress("no plan fits; searching for the smallest budget")
        # (Nothing fits: the heuristics' schedules here are theirs at any lower budget.)
        min_budget = min_feasible_budget(graph, solver, time_limit=self.phase_seconds(MIN_BUDGET_TIME_SHARE),
                                         known=self.lowest_peak, run_ilp=self.model is None,
                                         runs=self.heuristic_runs)
        reached = _LOWEST.get(_lowest_key(graph, solver))
        if min_budget <= budget and reached is not None and reached.peak <= budget:
            # The search for the smallest budget found a schedule within this one (the searches
            # before it ran out of time): that is the answer, not "infeasible, try this budget".
            self.consider(reached.schedule, simulate(graph, reached.schedule), reached.name, "heuristic")
            if self.fitting:
                return self.best()
        # A budget the instant program proved infeasible is below every schedule's peak too.
        reached = lowest_schedule(graph, solver)
        floor = max(peak_lower_bound(graph)[0], budget + 1 if self.proven_infeasible else 0,
                    reached.floor if reached is not None else 0)
        fewer = without_codecs(graph, lossy_only=any(is_lossy_codec(n.codec) for n in graph.nodes))
        if fewer is graph:
            raise InfeasibleBudgetError(budget, min_budget, lower_bound=floor)
        if budget < max(peak_lower_bound(graph)[0], reached.floor if reached is not None else 0):
            # Without the codecs the budget is out of reach too (they only add choices), and their
            # smallest budget is no lower: the search above tried these schedules uncompressed.
            # (Not on the instant program's word alone at this budget: that proof is checked by
            # planning without them; the floor of its lowest peak is tested against every plan.)
            raise InfeasibleBudgetError(budget, min_budget, lower_bound=floor)
        # The solvers do not always find the lowest peak of the larger problem (more choices,
        # the same time): never let the codecs make a budget infeasible that plans without them.
        self.progress("no plan fits with " + ("quantization" if fewer.compressible else "compression")
                      + "; planning without it")
        try:
            found = solve(fewer, budget, solver, time_limit=self.seconds_left(), on_progress=self.on_progress,
                          mip_solver=self.mip_solver, retry=True)
        except InfeasibleBudgetError as err:
            # (The codecs only add choices: the graph's own floor holds for both.)
            raise InfeasibleBudgetError(budget, min(min_budget, err.min_budget), lower_bound=floor) from None
        # Its schedule is one of this graph's (fewer codecs, the same values).
        return dataclasses.replace(found, timeline=simulate(graph, found.schedule),
                                   solve_seconds=time.perf_counter() - self.t0)

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
        return dataclasses.replace(best, solve_seconds=time.perf_counter() - self.t0,
                                   lower_bound_cost=self.lower_bound, bound_source=self.bound_source)


def without_codecs(graph: Graph, *, lossy_only: bool) -> Graph:
    """`graph` with no codec on its values (only the lossy ones dropped with ``lossy_only``); the
    graph itself when there is nothing to drop."""
    drop = [i for i, n in enumerate(graph.nodes) if n.codec is not None and (is_lossy_codec(n.codec) or not lossy_only)]
    if not drop:
        return graph
    nodes = list(graph.nodes)
    for i in drop:
        nodes[i] = dataclasses.replace(nodes[i], codec=None, compressed_bytes=0, codec_cost=0.0, codec_flops=0,
                                       codec_workspace=0)
    return Graph(tuple(nodes), graph.transfers)


def _fmt(cost: float | None) -> str:
    return "?" if cost is None else f"{cost * 1e3:.2f} ms"


def min_feasible_budget(graph: Graph, solver: str = "auto", *, time_limit: float = DEFAULT_TIME_LIMIT,
                        known: int | None = None, run_ilp: bool = True,
                        runs: dict[str, list[Candidate]] | None = None) -> int:
    """The smallest peak ``solver`` can reach for this graph: for a heuristic its lowest peak; for
    the ILP, the instant program and "auto", the lowest of the chain solver's (`fxopt.solvers.chain`:
    the lowest peak of checkpointing at the articulation values), the heuristics', the ILP's
    solve with the peak as the objective (warm-started from the lowest so far) and then, in the
    rest of ``time_limit`` (`LOWEST_PEAK_TIME_SHARE`), the instant program's lowest peak (a floor
    for every schedule, and plans near it); each is skipped once the lowest so far is within
    `LOWEST_PEAK_SLACK` of `peak_lower_bound` (proven). Every schedule is
    simulated. The answer does not depend on the budget: the first one per graph and solver in this
    process is kept (`_LOWEST`), so asking again answers at once, and the same.

    ``runs``: heuristics already run on this graph at a budget none of their schedules met (their
    schedules are then what they give at any lower budget, so they are not run again). Each
    heuristic's `COMPRESS_TRIES` lowest-peak schedules are also tried with everything compressed
    and, on a graph that offers OFFLOAD, with everything offloaded whose copies fit in its window
    (`offload_all`; within the host budget)."""
    t0 = time.perf_counter()
    remembered = _LOWEST.get(_lowest_key(graph, solver))
    if remembered is not None and remembered.searched:
        return remembered.peak if known is None else min(known, remembered.peak)
    reached = _Reached(graph, solver, [] if known is None else [known])
    exact = solver in ("auto", "ilp", "instant")
    if exact and (chain := min_peak_schedule(graph)) is not None:
        reached.add(chain.schedule, "chain")
        if chain.schedule.saved & graph.compressible:
            reached.add(compress_all(graph, chain.schedule), "chain+compress")
        reached.offloaded([chain.schedule], "chain")
    for name in ("checkpoint", "greedy", "segments") if exact else (solver,):
        candidates = runs[name] if runs and name in runs else HEURISTICS[name](graph, 0)
        for schedule, timeline in candidates:
            reached.add(schedule, name, timeline)
        lowest_first = sorted(candidates, key=lambda c: c[1].peak_bytes)
        for schedule, _ in [c for c in lowest_first if c[0].saved & graph.compressible][:COMPRESS_TRIES]:
            reached.add(compress_all(graph, schedule), f"{name}+compress")
        reached.offloaded([s for s, _ in lowest_first[:COMPRESS_TRIES]], name)
    floor = peak_lower_bound(graph)[0]
    if run_ilp and solver in ("ilp", "auto") and min(reached.peaks) > floor * (1 + LOWEST_PEAK_SLACK):
        model = build_ilp(graph, None, minimize_peak=True)
        if solver == "ilp" or model.mip.num_integer <= AUTO_ILP_MAX_VARIABLES:
            incumbent = min(reached.lowest, key=lambda p: p[0]) if reached.lowest else None
            # (For the ILP alone its search is the answer: the instant program's after it gives
            # only the floor.)
            seconds = (time_limit - (time.perf_counter() - t0) if solver == "ilp"
                       else (1 - LOWEST_PEAK_TIME_SHARE) * time_limit)
            found = _lowest_peak_schedules(graph, max(MIN_PHASE_SECONDS, seconds), None, model, incumbent,
                                           target=int(floor * (1 + LOWEST_PEAK_SLACK)))
            for schedule in found:
                reached.add(schedule, "ilp")
            reached.offloaded(found, "ilp")
    if exact and min(reached.peaks) > floor * (1 + LOWEST_PEAK_SLACK):
        # The instant program's lowest peak: a floor for every schedule, and plans near it.
        low = lowest_peak(graph, time_limit=max(MIN_PHASE_SECONDS, time_limit - (time.perf_counter() - t0)))
        floor = max(floor, low.floor)
        if solver != "ilp":  # (the ILP's minimum is its own; the floor holds for every schedule)
            for schedule, timeline in low.plans:
                reached.add(schedule, "instant", timeline)
            reached.offloaded([s for s, _ in sorted(low.plans, key=lambda p: p[1].peak_bytes)[:COMPRESS_TRIES]],
                              "instant")
    if (remembered := _LOWEST.get(_lowest_key(graph, solver))) is not None:
        remembered.searched = True
        remembered.floor = max(remembered.floor, floor)
    return min(reached.peaks)


class _Reached:
    """The peaks `min_feasible_budget` has reached, each schedule simulated and remembered
    (`_LOWEST`); a schedule over the host budget reaches nothing."""

    def __init__(self, graph: Graph, solver: str, peaks: list[int]):
        self.graph, self.solver, self.peaks = graph, solver, peaks
        self.lowest: list[tuple[int, Schedule]] = []

    def add(self, schedule: Schedule, name: str, timeline: Timeline | None = None) -> None:
        timeline = timeline or simulate(self.graph, schedule)
        if timeline.over_host_budget:
            return
        self.peaks.append(timeline.peak_bytes)
        self.lowest.append((timeline.peak_bytes, schedule))
        _remember_lowest(self.graph, self.solver, schedule, timeline.peak_bytes, name)

    def offloaded(self, schedules: list[Schedule], name: str) -> None:
        """With OFFLOAD offered, each also with everything it may offload (after compressing all)."""
        graph = self.graph
        if not graph.offloadable:
            return
        for schedule in schedules:
            bases = [(schedule, name)]
            if schedule.saved & graph.compressible - schedule.compressed:
                bases.append((compress_all(graph, schedule), f"{name}+compress"))
            for base, label in bases:
                if (done := offload_all(graph, base)) is not None:
                    self.add(done, f"{label}+offload")


@dataclasses.dataclass
class Lowest:
    """The lowest-peak schedule seen for one graph and solver, and the solver that found it."""

    peak: int
    schedule: Schedule
    name: str
    searched: bool = False  # `min_feasible_budget` ran on this graph: ``peak`` is its answer
    floor: int = 0  # proven: no schedule peaks below it (`fxopt.solvers.instant.lowest_peak`)


# The lowest-peak schedule seen so far per (graph, solver) in this process: the plan behind the
# smallest budget an `InfeasibleBudgetError` named, so that planning at that budget succeeds even
# when a time-limited search would not find it again. A few graphs' worth; the oldest go first.
_LOWEST: dict[tuple, Lowest] = {}  # by `_lowest_key`
_LOWEST_KEEP = 16


def _lowest_key(graph: Graph, solver: str) -> tuple:
    """A graph's content (its nodes, and its transfers: an offloading schedule plans only with
    them) and the solver."""
    return _Content(graph), solver


class _Content:
    """A graph's nodes and transfers as a dictionary key, hashed once (a few thousand nodes take
    milliseconds to hash, and a search looks the key up for every schedule it tries)."""

    def __init__(self, graph: Graph):
        self.nodes, self.transfers = graph.nodes, graph.transfers
        self.hash = graph.__dict__.get("_content_hash")
        if self.hash is None:
            self.hash = graph.__dict__["_content_hash"] = hash((graph.nodes, graph.transfers))

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other) -> bool:
        return (isinstance(other, _Content) and self.hash == other.hash
                and (self.nodes is other.nodes or self.nodes == other.nodes) and self.transfers == other.transfers)


def lowest_schedule(graph: Graph, solver: str = "auto") -> Lowest | None:
    """The lowest-peak schedule this process has seen for ``graph`` planned by ``solver``."""
    return _LOWEST.get(_lowest_key(graph, solver))


def _remember_lowest(graph: Graph, solver: str, schedule: Schedule, peak: int, name: str) -> None:
    key = _lowest_key(graph, solver)
    known = _LOWEST.get(key)
    if known is None or peak < known.peak:
        _LOWEST.pop(key, None)
        _LOWEST[key] = Lowest(peak, schedule, name, searched=known is not None and known.searched,
                              floor=known.floor if known is not None else 0)
        while len(_LOWEST) > _LOWEST_KEEP:
            del _LOWEST[next(iter(_LOWEST))]


def _lowest_peak_schedules(graph: Graph, time_limit: float, mip_solver: str | None,
                           model=None, incumbent: tuple[int, Schedule] | None = None,
                           target: int | None = None) -> list[Schedule]:
    """The ILP's lowest-peak schedule and the roundings of its LP relaxation (one model for both);
    ``incumbent``: a schedule and its simulated peak for the ILP to start from; ``target``: a peak
    that is good enough (the ILP stops once it reaches it)."""
    t0 = time.perf_counter()
    model = model or build_ilp(graph, None, minimize_peak=True)
    _, schedules = lp_bound_and_roundings(graph, None, time_limit=time_limit, mip_solver=mip_solver, model=model)
    out = []
    for schedule in schedules:
        try:
            simulate(graph, schedule)
            out.append(schedule)
            if schedule.saved & graph.compressible - schedule.compressed:
                out.append(compress_all(graph, schedule))
        except InvalidScheduleError:
            continue
    # (The budget only places the incumbent's peak: the model is built already.)
    res = solve_ilp(graph, incumbent[0] if incumbent else None, minimize_peak=True, mip_solver=mip_solver,
                    model=model, warm_start=incumbent[1] if incumbent else None,
                    time_limit=max(MIN_PHASE_SECONDS, time_limit - (time.perf_counter() - t0)), peak_target=target)
    if res.schedule is not None:
        out.append(res.schedule)
        out.append(compress_all(graph, res.schedule))
    return out


def compress_all(graph: Graph, schedule: Schedule) -> Schedule:
    """`schedule` with every SAVEd value that has a codec COMPRESSed (its lowest peak, mostly)."""
    return dataclasses.replace(schedule, compressed=schedule.saved & graph.compressible)
