"""The smallest budget fxopt plans a step in, the schedule behind it, and the answer "infeasible".

`lowest_plan` searches for the lowest peak a solver reaches: the chain solver's lowest-peak
checkpointing, the heuristics' schedules (each also with everything compressed and, where
OFFLOAD is offered, offloaded), the ILP solved with the peak as its objective, and the instant
program's lowest peak, which also proves a floor no schedule goes below; the lowest of these
then lowered where its backward's recomputations can be moved (`fxopt.solvers.heuristics.lower_peak`:
a value kept from an earlier recomputation, or let go and recomputed after the peak). Every schedule is
simulated; the lowest-peak one is kept with its peak, so that planning at that peak finds it:
`solve` falls back on it when nothing else fits. The search does counted work only
(`fxopt.solvers.effort`), so it finds the same schedule for the same graph every time, and the
budget an `InfeasibleBudgetError` names plans, in this process or another, whatever was solved in
between (`infeasible` is where every such error of the solvers is made).

`Memo` keeps the answers, so that asking again costs nothing. It is a cache, not a state: a hit
is what the search would find again (unless the time limit, a safety stop, cut the search short:
the solve then says so). The planner owns one (`fxopt.cache.lowest_peaks`) and passes it to
`solve`; without one, every call searches afresh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers.block_plan import BlockChain, lowest_block_plan
from fxopt.solvers.chain import min_peak_schedule
from fxopt.solvers.policies import policy_candidates
from fxopt.solvers.effort import Deadline, Effort, effort_of
from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import HEURISTICS, Candidate, keep_recomputed, lower_peak, offload_all
from fxopt.solvers.ilp import build_ilp, default_mip_solver, lp_bound_and_roundings, solve_ilp
from fxopt.solvers.instant import lowest_peak, peak_lower_bound
from fxopt.solvers.schedule import InvalidScheduleError, Schedule, Timeline, simulate

# Above this many integer variables "auto" does not start the exact solve: it would not finish in
# seconds. (A 12-layer GPT-2 step, ~2,100 nodes, has about 7,500.)
AUTO_ILP_MAX_VARIABLES = 200_000

# How many of each heuristic's lowest-peak schedules are also tried compressed and offloaded (and
# how many over-budget schedules `solve` tries to complete with COMPRESS or OFFLOAD).
COMPRESS_TRIES = 12

# The search stops once a plan is within this share of the proven floor.
LOWEST_PEAK_SLACK = 0.002

EXACT_SOLVERS = ("auto", "ilp", "instant")


@dataclasses.dataclass(frozen=True)
class Lowest:
    """The lowest-peak schedule `lowest_plan` found, its peak, the solver that found it, and the
    floor it proved (no schedule peaks below it)."""

    peak: int
    schedule: Schedule
    name: str
    floor: int


class Memo:
    """`lowest_plan`'s answers by graph content, solver, effort and whether the ILP ran: the
    latest `KEEP` of them. And the simple policies' candidates of the latest `POLICIES_KEEP`
    graphs (`policies`): no budget changes them, and the search for the smallest budget and the
    solve at it both read them (on a 32-layer step, three whole-step simulations). And, for as
    many graphs, their floor (`floor`), eager's timeline (`eager`) and the instant program's bound
    at a budget above any asked (`loose_bound`)."""

    KEEP = 16
    POLICIES_KEEP = 8  # (each holds a few simulated timelines of its graph)
    TIMELINES_KEEP = 8

    def __init__(self) -> None:
        self._entries: list[tuple[tuple, Graph, Lowest]] = []
        self._policies: list[tuple[int, Graph, list]] = []
        self._stage_starts: list[tuple[tuple, Graph, list]] = []
        self._timelines: list[tuple[tuple, Graph, Timeline]] = []
        self._floors: list[tuple[int, Graph, tuple[int, str]]] = []
        self._eager: list[tuple[int, Graph, Timeline]] = []
        self._loose: list[tuple[tuple, Graph, tuple[int, float | None]]] = []
        self._hashes: list[tuple[Graph, int]] = []  # (the latest graphs' `_content_hash`: 12 ms on 7,600 nodes)

    def get(self, graph: Graph, key: tuple) -> Lowest | None:
        """The answer for ``graph`` (or one of equal content) under ``key`` (solver, effort,
        whether the ILP ran), if kept."""
        full = (self._hash(graph), *key)
        return next((lowest for k, g, lowest in self._entries if k == full and _same(g, graph)), None)

    def put(self, graph: Graph, key: tuple, lowest: Lowest) -> None:
        full = (self._hash(graph), *key)
        self._entries = [e for e in self._entries if not (e[0] == full and _same(e[1], graph))]
        self._entries.append((full, graph, lowest))
        del self._entries[:-self.KEEP]

    def policies(self, graph: Graph, compute: Callable[[], list]) -> list:
        """``compute()``, the simple policies' candidates for ``graph``, or those kept for it (or
        for one of equal content)."""
        return _kept(self._policies, self._hash(graph), graph, compute, self.POLICIES_KEEP)

    def stage_starts(self, graph: Graph, key: tuple, compute: Callable[[], list]) -> list:
        """``compute()``, the schedules a pipeline stage's search starts from for ``graph`` under
        ``key`` (solver, effort: `fxopt.solvers.stages.in_flight`), or those kept for it (or for
        one of equal content): what its device holds beside changes none of them, so the stages
        of one graph (a uniform stack's middle stages, each with its own microbatches in flight)
        share them. The latest `POLICIES_KEEP` graphs'."""
        return _kept(self._stage_starts, (self._hash(graph), *key), graph, compute, self.POLICIES_KEEP)

    def timeline(self, graph: Graph, schedule: Schedule) -> Timeline:
        """``simulate(graph, schedule)``, or the timeline kept for it (the latest `TIMELINES_KEEP`):
        the phases of one solve, and the solves of one step (the search for its smallest budget,
        then the plan at it), replay some schedules of the whole step more than once (eager's,
        which the blocks' plans and their bound both start from; a block plan chosen at both
        budgets), each a whole-step simulation. (Schedules the simulator refuses are not kept.)"""
        return _kept(self._timelines, (self._hash(graph), schedule), graph, lambda: simulate(graph, schedule),
                     self.TIMELINES_KEEP)

    def floor(self, graph: Graph) -> tuple[int, str]:
        """`peak_lower_bound` of ``graph``, or the one kept for it (or for one of equal content):
        a solve, its search for the smallest budget and the planner's fallbacks each read it, and
        the solve at that budget again (on a 32-layer step, 40 ms each). The latest
        `POLICIES_KEEP` graphs'."""
        return _kept(self._floors, self._hash(graph), graph, lambda: peak_lower_bound(graph), self.POLICIES_KEEP)

    def eager(self, graph: Graph, compute: Callable[[], Timeline]) -> Timeline:
        """``compute()``, the step's memory as eager autograd runs it (`fxopt.solvers.eager_timeline`),
        or the one kept for ``graph`` (or for one of equal content): each answer for one step
        starts from it (the 50% answer and the plan at the smallest budget, a whole-step
        simulation each on a 32-layer step). The latest `POLICIES_KEEP` graphs'."""
        return _kept(self._eager, self._hash(graph), graph, compute, self.POLICIES_KEEP)

    def loose_bound(self, graph: Graph, key: tuple, compute: Callable[[], tuple[int, float | None]]
                    ) -> tuple[int, float | None]:
        """``compute()``, (a budget above any a plan of ``graph`` is asked for, the instant
        program's bound there) under ``key`` (effort, MIP program), or the pair kept for it (or for
        one of equal content): a bound every plan within any lower budget meets too, which proves
        eager's schedule the cheapest at every budget it fits (`fxopt.solvers.phases.eager_proof`:
        a uniform pipeline's middle stages, one graph solved at as many budgets). The latest
        `POLICIES_KEEP` graphs'."""
        return _kept(self._loose, (self._hash(graph), *key), graph, compute, self.POLICIES_KEEP)

    def _hash(self, graph: Graph) -> int:
        """`_content_hash`, found once for each of the latest graphs looked up (by identity)."""
        known = next((h for g, h in self._hashes if g is graph), None)
        if known is None:
            known = _content_hash(graph)
            self._hashes = [*self._hashes[-self.POLICIES_KEEP + 1:], (graph, known)]
        return known

    def clear(self) -> None:
        self._entries.clear()
        self._policies.clear()
        self._stage_starts.clear()
        self._timelines.clear()
        self._floors.clear()
        self._eager.clear()
        self._loose.clear()
        self._hashes.clear()

    def __len__(self) -> int:
        return len(self._entries)


def floor_of(graph: Graph, memo: Memo | None = None) -> tuple[int, str]:
    """`peak_lower_bound(graph)`, kept in ``memo`` where one is given (`Memo.floor`)."""
    return peak_lower_bound(graph) if memo is None else memo.floor(graph)


def memo_key(solver: str, effort: Effort, run_ilp: bool = True, mip_solver: str | None = None) -> tuple:
    """What a lowest-peak answer depends on besides the graph, as `Memo` keys it: the solver, the
    effort, whether the ILP ran, the MIP program (None: the default one, `default_mip_solver`)."""
    return solver, effort, run_ilp, mip_solver or default_mip_solver()


def _content_hash(graph: Graph) -> int:
    return hash((graph.nodes, graph.transfers))  # (milliseconds for thousands of nodes: `Memo._hash` keeps it)


def _kept(entries: list, key, graph: Graph, compute: Callable[[], list], keep: int) -> list:
    """What ``entries`` (a `Memo` list of (key, graph, found), the latest ``keep``) holds for
    ``key`` and a graph of ``graph``'s content, or ``compute()``, then kept there."""
    known = next((found for k, g, found in entries if k == key and _same(g, graph)), None)
    if known is not None:
        return known
    found = compute()
    entries.append((key, graph, found))
    del entries[:-keep]
    return found


def _same(a: Graph, b: Graph) -> bool:
    return a is b or (a.nodes == b.nodes and a.transfers == b.transfers)


def infeasible(budget: int, lowest: Lowest | int | None, floor: int | None, detail: str = "",
               *, exact: bool = True) -> InfeasibleBudgetError:
    """The error for a budget nothing fits: the smallest budget found (``lowest``: its plan, or
    its peak) and the floor no schedule goes below. ``exact`` False: that smallest budget is only
    a bound (the message says "at least")."""
    peak = lowest.peak if isinstance(lowest, Lowest) else lowest
    return InfeasibleBudgetError(budget, peak, detail, lower_bound=floor, exact=exact)


def lowest_schedule(graph: Graph, solver: str = "auto", **kwargs) -> Lowest:
    """`lowest_plan` without the ILP's search unless ``run_ilp`` is given (the cheap one)."""
    return lowest_plan(graph, solver, **{"run_ilp": False, **kwargs})


def lowest_plan(graph: Graph, solver: str = "auto", *, effort: Effort | float | None = None,
                time_limit: Deadline | float | None = None, memo: Memo | None = None, run_ilp: bool = True,
                runs: dict[str, list[Candidate]] | None = None, mip_solver: str | None = None,
                blocks: BlockChain | None | bool = False) -> Lowest:
    """The lowest peak ``solver`` reaches for this graph, and its schedule: for a heuristic its
    lowest peak; for the ILP, the instant program and "auto", the lowest of the chain solver's
    (`fxopt.solvers.chain`: checkpointing at the articulation values), the simple policies' (for
    "auto", `fxopt.solvers.policies`), the heuristics', the ILP's
    solved for the peak (warm-started from the lowest so far; not with ``run_ilp`` False) and the
    instant program's lowest peak, each skipped once the lowest so far is within
    `LOWEST_PEAK_SLACK` of the floor. For "auto" on a step of repeated blocks
    (`fxopt.solvers.block_plan`), the blocks' lowest plan instead of the heuristics not run
    yet, the ILP's and the instant program's (whose work grows faster than the step). It does
    not depend on any budget. ``memo``: where answers are kept and looked up. ``runs``:
    heuristics already run on this graph at a budget none of their schedules met (they then gave
    what they give at budget 0: not run again). ``blocks``: the step's chain of repeated blocks
    (`fxopt.solvers.auto.lowest_plan` finds it; None or False: none)."""
    effort, deadline = effort_of(effort), Deadline.of(time_limit)
    key = memo_key(solver, effort, run_ilp, mip_solver)
    if memo is not None and (known := memo.get(graph, key)) is not None:
        return known
    reached = _Reached(graph)
    exact = solver in EXACT_SOLVERS
    # A step of repeated blocks: the blocks' lowest plan (`fxopt.solvers.block_plan`) stands for
    # the searches over the whole graph, whose work grows faster than the step.
    blocks = blocks if solver == "auto" and blocks is not False else None
    if (lowest := lowest_block_plan(blocks, memo)) is not None:
        reached.add(lowest[0], "blocks", lowest[1])
    whole = blocks is None
    if exact and (chain := min_peak_schedule(graph)) is not None:
        reached.add(chain.schedule, "chain")
        if chain.schedule.saved & graph.compressible:
            reached.add(compress_all(graph, chain.schedule), "chain+compress")
        reached.offloaded([chain.schedule], "chain")
    if solver == "auto":
        for schedule, timeline in policy_candidates(graph, 0, memo):
            reached.add(schedule, "policies", timeline)
    for name in ("checkpoint", "greedy", "segments") if exact else (solver,):
        if not whole and not (runs and name in runs):
            continue
        candidates = runs[name] if runs and name in runs else HEURISTICS[name](graph, 0, effort=effort)
        for schedule, timeline in candidates:
            reached.add(schedule, name, timeline)
        lowest_first = sorted(candidates, key=lambda c: c[1].peak_bytes)
        for schedule, _ in [c for c in lowest_first if c[0].saved & graph.compressible][:COMPRESS_TRIES]:
            reached.add(compress_all(graph, schedule), f"{name}+compress")
        reached.offloaded([s for s, _ in lowest_first[:COMPRESS_TRIES]], name)
    floor = floor_of(graph, memo)[0]
    if whole and run_ilp and solver in ("ilp", "auto") and reached.best[0] > floor * (1 + LOWEST_PEAK_SLACK):
        model = build_ilp(graph, None, minimize_peak=True)
        if solver == "ilp" or model.mip.num_integer <= AUTO_ILP_MAX_VARIABLES:
            found = lowest_peak_schedules(graph, effort, deadline, mip_solver, model, reached.best,
                                          target=int(floor * (1 + LOWEST_PEAK_SLACK)))
            for schedule in found:
                reached.add(schedule, "ilp")
            reached.offloaded(found, "ilp")
    if whole and exact and reached.best[0] > floor * (1 + LOWEST_PEAK_SLACK):
        # The instant program's lowest peak: a floor for every schedule, and plans near it.
        low = lowest_peak(graph, effort=effort, time_limit=deadline, mip_solver=mip_solver)
        floor = max(floor, low.floor)
        if solver != "ilp":  # (the ILP's minimum is its own; the floor holds for every schedule)
            for schedule, timeline in low.plans:
                reached.add(schedule, "instant", timeline)
            lowest_first = sorted(low.plans, key=lambda p: p[1].peak_bytes)
            reached.offloaded([s for s, _ in lowest_first[:COMPRESS_TRIES]], "instant")
    peak, schedule, name = reached.best
    if schedule is None:
        raise ValueError("no schedule of this graph stays within its host memory budget")
    if solver == "auto":
        peak, schedule, name = _finished(graph, (peak, schedule, name), floor, effort, deadline, whole)
    found = Lowest(peak, schedule, name, min(floor, peak))
    if memo is not None:
        # (Also where the time limit cut the search short, which the solve says: the budget an
        # error names from it must plan in this process too.)
        memo.put(graph, key, found)
    return found


def _finished(graph: Graph, best: tuple[int, Schedule, str], floor: int, effort: Effort,
              deadline: Deadline, whole: bool) -> tuple[int, Schedule, str]:
    """"auto"'s lowest (peak, schedule, name), its peak lowered where it is above the floor
    (`lower_peak`), then, where the whole graph's searches made it (``whole``), cheaper at that
    peak (`keep_recomputed`: the ILP's and the instant program's lowest-peak schedules are chosen
    for their peak alone, and may recompute a value many times where keeping it fits; a step of
    repeated blocks gets its lowest plan per block, where each block's is found the same way,
    and each of its whole-step simulations costs many small ones)."""
    peak, schedule, name = best
    if peak > floor * (1 + LOWEST_PEAK_SLACK) and not deadline.check("lower_peak") and \
            (lowered := lower_peak(graph, schedule, work=effort.lower_peak_work)):
        schedule, peak, name = lowered[0], lowered[1].peak_bytes, f"{name}+lower_peak"
    if whole and not deadline.check("keep recomputed") and \
            (kept := keep_recomputed(graph, schedule, peak, tries=effort.keep_recomputed_tries)) is not None:
        schedule, peak, name = kept[0], kept[1].peak_bytes, f"{name}+keep"
    return peak, schedule, name


class _Reached:
    """The schedules `lowest_plan` has reached, each simulated; the first of the lowest peak is
    `best`. A schedule over the host budget reaches nothing."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.best: tuple[int, Schedule | None, str] = (1 << 62, None, "")

    def add(self, schedule: Schedule, name: str, timeline: Timeline | None = None) -> None:
        timeline = timeline or simulate(self.graph, schedule)
        if not timeline.over_host_budget and timeline.peak_bytes < self.best[0]:
            self.best = (timeline.peak_bytes, schedule, name)

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


def lowest_peak_schedules(graph: Graph, effort: Effort, deadline: Deadline, mip_solver: str | None,
                          model=None, incumbent: tuple[int, Schedule | None, str] | None = None,
                          target: int | None = None) -> list[Schedule]:
    """The ILP's lowest-peak schedule and the roundings of its LP relaxation (one model for both),
    each valid one also with everything compressed; ``incumbent``: the lowest (peak, schedule) so
    far, for the ILP to start from; ``target``: a peak that is good enough (the ILP stops once it
    reaches it)."""
    model = model or build_ilp(graph, None, minimize_peak=True)
    _, schedules = lp_bound_and_roundings(graph, None, effort=effort, time_limit=deadline, mip_solver=mip_solver,
                                          model=model)
    out = []
    for schedule in schedules:
        try:
            simulate(graph, schedule)
            out.append(schedule)
            if schedule.saved & graph.compressible - schedule.compressed:
                out.append(compress_all(graph, schedule))
        except InvalidScheduleError:
            continue
    start = incumbent if incumbent is not None and incumbent[1] is not None else None
    # (The budget only places the incumbent's peak: the model is built already.)
    res = solve_ilp(graph, start[0] if start else None, minimize_peak=True, mip_solver=mip_solver, model=model,
                    warm_start=start[1] if start else None, effort=effort, time_limit=deadline, peak_target=target)
    if res.schedule is not None:
        out.append(res.schedule)
        out.append(compress_all(graph, res.schedule))
    return out


def compress_all(graph: Graph, schedule: Schedule) -> Schedule:
    """`schedule` with every SAVEd value that has a codec COMPRESSed (its lowest peak, mostly)."""
    return dataclasses.replace(schedule, compressed=schedule.saved & graph.compressible)
