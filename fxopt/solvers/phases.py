"""The phases of `solve`, and which of them each strategy runs (`STRATEGIES`).

A phase is a step of one `fxopt.solvers.search.Search`: it runs when its condition holds and adds
the schedules it finds. A strategy is a tuple of phases, run in order. A source of candidate
schedules (`SOURCES`: a heuristic, the chain solver, the simple policies a user already has) is
one entry, ``run(graph, budget, effort) -> [(schedule, timeline)]``: "auto" runs it before the
instant program (``auto="first"``) or only when no plan is proven optimal by then
(``"unsettled"``), and with ``solver=True`` it is also a strategy of its own name. Every phase is
bounded by counted work (`fxopt.solvers.effort`); the safety stop only skips phases that improve a
plan that fits once the time limit has passed.

"auto", in order: eager's schedule, the answer where it fits and is proven optimal with no gap (then nothing else runs,
`run_save_all_first`); the first sources (save_all, checkpoint, chain, the simple policies); the instant program (a plan
and a lower bound, `fxopt.solvers.instant`); unless that settles it, the other sources (greedy,
segments); COMPRESS and OFFLOAD completing the cheapest over-budget schedules; saving more in the
cheapest plan; the ILP (its LP relaxation's bound and roundings, then the exact solve warm-started
from the best plan so far, `fxopt.solvers.ilp`); near the step's floor, the smallest budget's plan
(`run_lowest_plan`); what the cheapest plan, and the plan with the most room, recompute more than
once kept where that fits (`run_keep_recomputed`). "ilp" and "instant" run their own, then the
heuristics as a fallback where their model missed a plan that fits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from fxopt.solvers.block_plan import block_candidates
from fxopt.solvers.chain import chain_candidates
from fxopt.solvers.gap import COST_TOLERANCE, proven
from fxopt.solvers.heuristics import (checkpoint, compress_to_fit, cost_recomputed_once, exchange, greedy,
                                      keep_recomputed, offload_to_fit, save_all, save_more, segments)
from fxopt.solvers.ilp import build_ilp, lp_bound_and_roundings, solve_ilp
from fxopt.solvers.instant import bound_where_tight, instant_solve
from fxopt.solvers.mip import Progress, default_mip_solver
from fxopt.solvers.policies import policy_candidates
from fxopt.solvers.minimum import AUTO_ILP_MAX_VARIABLES, COMPRESS_TRIES, floor_of, lowest_plan
from fxopt.solvers.graph import Graph
from fxopt.solvers.schedule import InvalidScheduleError, Schedule, simulate, simulated
from fxopt.solvers.search import ILP_REL_GAP, Search, fmt_cost

log = logging.getLogger("fxopt")

# A budget at most this share above the step's floor (`peak_lower_bound`) is near its smallest
# budget: "auto" also plans the smallest budget there (`run_lowest_plan`). (Titan's debug Llama3's
# 50%: 5.1% above.)
NEAR_FLOOR = 0.10

# `loose_budget`: this many times all a graph's values hold together (a pipeline stage's step is
# asked for about 2.6 times that: the budget less what its other microbatches hold).
LOOSE = 4


@dataclasses.dataclass(frozen=True)
class Source:
    """A source of candidate schedules (see the module docstring)."""

    run: Callable  # (graph, budget, effort, memo) -> list of (schedule, timeline)
    auto: str | None = "first"  # when "auto" runs it: "first", "unsettled" or None (never)
    solver: bool = True  # also a strategy of its own name
    with_blocks: bool = False  # "auto" runs it also where the repeated blocks' plans fit (`run_blocks`)


SOURCES: dict[str, Source] = {
    "save_all": Source(lambda graph, budget, effort, memo: save_all(graph, budget, effort=effort, memo=memo),
                       with_blocks=True),
    "checkpoint": Source(lambda graph, budget, effort, memo: checkpoint(graph, budget, effort=effort)),
    "chain": Source(lambda graph, budget, effort, memo: chain_candidates(graph, budget), solver=False),
    # What a user already has (checkpoint each block, selective checkpointing): never worse than it.
    "policies": Source(lambda graph, budget, effort, memo: policy_candidates(graph, budget, memo), solver=False,
                       with_blocks=True),
    "greedy": Source(lambda graph, budget, effort, memo: greedy(graph, budget, effort=effort), auto="unsettled"),
    "segments": Source(lambda graph, budget, effort, memo: segments(graph, budget, effort=effort), auto="unsettled"),
}


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    run: Callable[[Search], None]
    when: Callable[[Search], bool] = lambda search: True


def run_sources(search: Search, names, *, fallback: bool = False) -> None:
    """Each source's schedules, kept for COMPRESS and OFFLOAD where over the budget; as a
    ``fallback`` without a word, and not kept."""
    for name in names:
        if not fallback:
            search.progress(f"solver {name}")
        # (A source is a function of the graph and budget: one "auto" ran first is not run again.)
        found = search.runs.get(name) or SOURCES[name].run(search.graph, search.budget, search.effort, search.memo)
        if name in HEURISTIC_NAMES:
            search.runs[name] = found
        for schedule, timeline in found:
            search.consider(schedule, timeline, name, "heuristic", keep_over=not fallback)


HEURISTIC_NAMES = ("save_all", "checkpoint", "greedy", "segments")  # (`lowest_plan` reuses their runs)


def sources(when: str) -> Phase:
    """The phase running every source "auto" runs ``when`` (where the repeated blocks' plans fit,
    only those marked ``with_blocks``)."""
    def run(search: Search) -> None:
        run_sources(search, [name for name, source in SOURCES.items()
                             if source.auto == when and (source.with_blocks or not search.by_blocks)])
    # ("first": not where the blocks claim a step proven infeasible: the search for its smallest
    # budget runs the policies itself. "unsettled": also a check on a proof.)
    return Phase(f"sources ({when})", run, (lambda s: not (s.by_blocks and s.proven_infeasible)) if when == "first"
                 else (lambda s: s.proven_infeasible or not s.settled()))


def run_save_all_first(search: Search) -> None:
    """Eager's schedule (SAVE everything, in the captured order) where it fits the budget, no other
    is as cheap and as low (`alone_at_its_cost`), and no plan can cost less: it recomputes
    nothing (no codec, no exposed copy either: the bound is 0, ``bound_source`` "save_all"), or
    the instant program's bound equals its cost (what it recomputes, views made fresh in the
    backward, every plan pays). It is then the answer,
    proven optimal with no gap, and "auto" runs no other phase (`Search.exact`): a pipeline
    stage, or any step planned at or near its eager peak, is answered by one simulation and at
    most one instant program (`eager_proof`: with the planner's memo, one per graph where its
    loose budget's proves it; one per graph more where it does not). Elsewhere nothing is kept from here but the simulated schedule, for
    the sources that run it (`run_sources`), and the phases run as they did."""
    found = SOURCES["save_all"].run(search.graph, search.budget, search.effort, search.memo)
    search.runs["save_all"] = found
    fitting = [(schedule, timeline) for schedule, timeline in found
               if timeline.peak_bytes <= search.budget and not timeline.over_host_budget]
    if not fitting:
        return
    schedule, timeline = fitting[0]
    if not alone_at_its_cost(search.graph, schedule):
        return
    bound, source = 0.0, "save_all"
    if timeline.cost > COST_TOLERANCE:
        bound = eager_proof(search, schedule, timeline.cost)
        if bound is None:
            return
        source = "instant"
    search.progress("solver save_all: it fits, and no plan costs less")
    search.consider(schedule, timeline, "save_all", "heuristic")
    search.raise_bound(bound, source)
    search.exact = True


def eager_proof(search: Search, schedule: Schedule, cost: float) -> float | None:
    """The instant program's bound proving eager's ``schedule`` (it fits, and costs ``cost``) the
    cheapest plan within the budget, or None where it does not. Where the search has a memo, the
    bound at a budget above any asked (`loose_budget`) is found once per graph and kept
    (`Memo.loose_bound`): the least cost within a budget only falls as the budget grows, so a
    bound there that eager's cost meets holds at every budget below it (a uniform pipeline's
    middle stages solve one graph at as many budgets, the stages' searches more). Else, or where
    that bound is short of eager's cost, the program at the budget itself."""
    graph, memo = search.graph, search.memo

    def program(budget: int) -> float | None:
        return instant_solve(graph, budget, effort=search.effort, time_limit=search.deadline,
                             mip_solver=search.mip_solver, start=schedule).bound

    def loose() -> tuple[int, float | None]:
        budget = loose_budget(graph)
        bound = program(budget)
        # (a program the safety stop cut short proves no more than it did: not kept as a proof)
        return budget, None if "instant" in search.deadline.stopped else bound

    if memo is not None:
        budget, bound = memo.loose_bound(graph, (search.effort, search.mip_solver), loose)
        if search.budget <= budget and proven(cost, bound, 0.0):
            return bound
    bound = program(search.budget)
    return bound if proven(cost, bound, 0.0) else None


def loose_budget(graph: Graph) -> int:
    """A budget above those a plan of ``graph`` is asked for in practice, and well scaled in the
    instant program's memory rows (`fxopt.solvers.mip.byte_unit`): `LOOSE` times every value's
    bytes, workspace and lingering buffers together. (A budget above it is proven at its own.)"""
    return LOOSE * sum(node.bytes + node.workspace + node.codec_workspace + node.lingers for node in graph.nodes)


def alone_at_its_cost(graph: Graph, schedule: Schedule) -> bool:
    """Whether every other schedule that costs as little as eager's (``schedule``) holds host
    memory (OFFLOAD) or peaks at least as high: none that "auto" would prefer at an equal cost
    (`Search.best`; at an equal cost, host memory and peak, the first found, eager's).
    A schedule as cheap recomputes what eager's recomputes (what every schedule must: the views
    the backward reads) and nothing more, but for the first computation of a value only the
    backward needs, which is free. So it differs from eager's only where a value eager SAVEs, with
    bytes of its own, is made again at no cost (its op costs nothing; or it is such a value, and
    what it reads is there or costs nothing to make again, or could be SAVEd instead), or where a
    value eager makes in the backward, with bytes of its own, could be SAVEd instead. Where none
    is (a sufficient test: any doubt answers False), eager's schedule is the only one at its
    cost and peak: the phases would find nothing to prefer."""
    nodes, saved, made = graph.nodes, schedule.saved, frozenset(schedule.backward)
    there = saved | graph.free | graph.resident
    held = {graph.roots[i] for i in graph.forward_outputs}

    def costs(i: int) -> bool:
        return nodes[i].cost - nodes[i].comm_exposed > 0

    def made_again_at_a_cost(j: int) -> bool:
        return not (j in there or j in made or j in graph.backward_only or j in graph.saveable) and costs(j)

    for i in saved - graph.free - graph.resident:
        if nodes[i].bytes == 0 or graph.roots[i] in held:
            continue
        if i in graph.backward_only:
            if not any(made_again_at_a_cost(j) for j in nodes[i].inputs):
                return False
        elif not costs(i):
            return False
    return not any(nodes[i].bytes > 0 for i in (graph.saveable & graph.backward_only & made) - saved)


def run_blocks(search: Search) -> None:
    """The step as a chain of repeated blocks (`fxopt.solvers.block_plan`): each kind solved
    once, a plan chosen per copy, simulated; below the lowest of those, at the smallest budget,
    the step's lowest-peak plan. Where a block plan fits, or none can (proven), the phases of
    the whole graph are not run (`by_blocks`); the bound then comes from `run_block_bound`.
    Where only the lowest-peak plan of another source fits (the smallest budget is below the
    blocks' lowest), they run, from it: that plan is the lowest, not a cheap one."""
    chain = search.chain()
    search.progress(f"repeated blocks: {len(chain.blocks.segments)} segments of {len(chain.blocks.kinds)} kinds")
    # (Below a proven floor no plan fits: the blocks' plans for this budget, and the curves refined
    # for them, would be in vain. The search for the smallest budget then starts from the curves as
    # every budget proven out of reach finds them, so it names the same budget for each.)
    found = [] if search.proven_infeasible else block_candidates(
        chain, search.budget, search.kind_solvers()[0], search.effort.block_refinements, search.memo)
    for schedule, timeline in found:
        search.consider(schedule, timeline, "blocks", "heuristic", keep_over=True)
    by_blocks = search.proven_infeasible or bool(search.fitting)
    if not search.fitting and not search.proven_infeasible:
        # Below the blocks' lowest plan: at the smallest budget fxopt names (an error's, or
        # budget="min"), the step's lowest-peak plan; at any other budget, the whole graph's phases.
        lowest = lowest_plan(search.graph, "auto", effort=search.effort, time_limit=search.deadline, memo=search.memo,
                             runs=search.runs, mip_solver=search.mip_solver, blocks=chain)
        if lowest.peak == search.budget:
            search.consider(lowest.schedule, simulate(search.graph, lowest.schedule), lowest.name, "heuristic")
    # (Where no plan can fit, proven, the search for the smallest budget uses the blocks too.)
    search.by_blocks = by_blocks


def run_block_bound(search: Search) -> None:
    """The proven bound for the repeated blocks' plan: one round of the instant program where
    that plan is tightest (`fxopt.solvers.instant.bound_where_tight`)."""
    best = search.cheapest()
    search.progress("bound for the blocks' plan")
    search.raise_bound(bound_where_tight(search.graph, search.budget, (best.schedule, best.timeline),
                                         effort=search.effort, time_limit=search.deadline,
                                         mip_solver=search.mip_solver, memo=search.memo), "instant")
    search.report_gap("blocks")


def run_instant(search: Search) -> None:
    search.progress("solver instant")
    best = search.cheapest()
    inst = instant_solve(search.graph, search.budget, effort=search.effort, time_limit=search.deadline,
                         mip_solver=search.mip_solver, start=best.schedule if best is not None else None)
    search.proven_infeasible = inst.infeasible
    search.raise_bound(inst.bound, "instant")
    for schedule, timeline in inst.plans:
        search.consider(schedule, timeline, "instant", "heuristic", keep_over=True)
    search.report_gap("instant")


def compress_cheapest_over_budget(search: Search) -> None:
    """COMPRESS where recomputation alone does not fit (or fits only at a higher cost): the
    cheapest over-budget schedules, completed with as little compression as fits."""
    search.progress("compressing saved values")
    _complete_cheapest(search, compress_to_fit, "compress")


def offload_cheapest_over_budget(search: Search) -> None:
    """OFFLOAD where the plans so far do not fit, or fit only at a higher cost: the cheapest
    over-budget schedules, completed with the values whose copies hide best."""
    search.progress("offloading saved values")
    _complete_cheapest(search, offload_to_fit, "offload")


def _complete_cheapest(search: Search, complete, label: str) -> None:
    best = search.cheapest()
    search.over.sort(key=lambda c: c[1].cost)
    for schedule, timeline, name in search.over[:COMPRESS_TRIES]:
        if best is not None and timeline.cost >= best.timeline.cost:
            break
        done = complete(search.graph, schedule, search.budget)
        if done is not None:
            search.consider(*done, f"{name}+{label}", "heuristic")


def check_proof(search: Search) -> None:
    log.warning("fxopt: the instant program called budget %d infeasible but a simulated plan fits "
                "(please report this graph)", search.budget)
    search.proven_infeasible = False


def _improve_cheapest(search: Search, doing: str, improve: Callable, tries: int, suffix: str) -> None:
    """The cheapest plan so far, improved by ``improve(graph, schedule, budget, tries=)`` where
    that answers (a schedule and its cost), considered under the cheapest's solver + ``suffix``."""
    best = search.cheapest()
    if best is None:
        return
    search.progress(doing)
    _improve(search, best, improve, tries, suffix)


def _improve(search: Search, plan, improve: Callable, tries: int, suffix: str) -> None:
    """``plan`` (one of the search's), improved by ``improve(graph, schedule, budget, tries=)``
    where that answers, considered under its solver + ``suffix``."""
    done = improve(search.graph, plan.schedule, search.budget, tries=tries)
    if done is not None:
        search.consider(*done, f"{plan.solver}+{suffix}", "heuristic")


def run_save_more(search: Search) -> None:
    """The cheapest plan so far with more SAVEd, where it still fits (`save_more`)."""
    _improve_cheapest(search, "saving more where it fits", save_more, search.effort.save_more_tries, "save")


def run_exchange(search: Search) -> None:
    """The cheapest plan so far with costly recomputations exchanged for cheap ones where that fits
    (`exchange`)."""
    _improve_cheapest(search, "exchanging recomputations", exchange, search.effort.exchange_tries, "exchange")


def run_keep_recomputed(search: Search) -> None:
    """The cheapest plan so far with what it recomputes more than once kept from its first
    recomputation instead, where that fits (`keep_recomputed`); then the same for the plan that
    fits with the most room (the lowest peak), where keeping could make it the cheapest
    (`cost_recomputed_once`). The cheapest plan may fit only just, with no room to keep anything:
    titan's debug Llama3 at 50% (51.66 MiB), an ILP rounding 0.1 MiB under the budget, kept
    0.447 -> 0.277 s, while its lowest-peak rounding, 2 MiB under, kept 3.158 -> 0.196 s."""
    _improve_cheapest(search, "keeping values recomputed more than once", keep_recomputed,
                      search.effort.keep_recomputed_tries, "keep")
    best = search.cheapest()
    if best is None:
        return
    roomiest = min(search.fitting, key=lambda s: (s.timeline.peak_bytes, s.timeline.cost))
    if roomiest.timeline.peak_bytes < best.timeline.peak_bytes and \
            cost_recomputed_once(search.graph, roomiest.schedule, roomiest.timeline) < best.timeline.cost:
        _improve(search, roomiest, keep_recomputed, search.effort.keep_recomputed_tries, "keep")


def run_lowest_plan(search: Search) -> None:
    """The smallest budget's plan (`fxopt.solvers.minimum.lowest_plan`, the plan "auto" finds at
    that budget: its lowest-peak schedule, made cheaper at its peak), where it fits: a budget
    above the smallest never gets a plan that costs more than the smallest's. Only where the
    budget is within `NEAR_FLOOR` of the step's floor: there the phases' plans fit only just, and
    the search costs about what the ILP's does. (Not wherever the memo happens to hold it: the
    answer would then depend on what was solved before.)"""
    search.progress("the smallest budget's plan")
    # (The blocks as `_nothing_fits` and `run_blocks` pass them: the memo keeps one answer per graph.)
    lowest = lowest_plan(search.graph, "auto", effort=search.effort, time_limit=search.deadline, memo=search.memo,
                         mip_solver=search.mip_solver, blocks=search.chain())
    if lowest.peak <= search.budget:
        search.consider(lowest.schedule, simulated(search.graph, lowest.schedule, search.memo), lowest.name,
                        "heuristic")


def _near_the_smallest_budget(search: Search) -> bool:
    """Whether `run_lowest_plan` runs: nothing proven yet, and the budget within `NEAR_FLOOR` of the
    step's floor."""
    return not search.settled() and search.budget <= floor_of(search.graph, search.memo)[0] * (1 + NEAR_FLOOR) \
        and not search.deadline.check("the smallest budget's plan")


def run_ilp(search: Search) -> None:
    """The ILP: its LP relaxation (a bound, and plans rounded from it), then the exact solve,
    warm-started from the best plan so far, unless a plan is already proven optimal."""
    graph, budget = search.graph, search.budget
    model = build_ilp(graph, budget)
    if search.solver == "auto" and model.mip.num_integer > AUTO_ILP_MAX_VARIABLES:
        search.progress(f"ILP skipped: {model.mip.num_integer} integer variables")
        return
    search.model = model
    search.progress(f"ILP: {model.mip.num_integer} integer variables, {model.mip.num_rows} constraints; "
                    "LP relaxation")
    lp_bound, roundings = lp_bound_and_roundings(graph, budget, effort=search.effort, time_limit=search.deadline,
                                                 mip_solver=search.mip_solver, model=model)
    search.raise_bound(lp_bound, "ilp")
    for schedule in roundings:
        try:
            search.consider(schedule, simulate(graph, schedule), "ilp-rounding", "heuristic")
        except InvalidScheduleError:
            continue
    best = search.cheapest()
    if lp_bound is None and best is None:
        search.progress("the LP relaxation found no plan within the budget")
    if best is not None and search.settled():
        search.progress("a plan is proven optimal")
    elif lp_bound is not None and not search.deadline.check("ILP"):
        _solve_ilp(search, model, best)


def _solve_ilp(search: Search, model, best) -> None:
    search.progress(f"solver ilp ({search.mip_solver or default_mip_solver()})")

    def report(p: Progress) -> None:
        if p.incumbent is None:
            search.progress(f"ILP: searching, bound {fmt_cost(p.bound)}, {p.seconds:.0f} s")
        else:
            found = "?" if p.gap is None else f"{100 * p.gap:.1f}%"
            search.progress(f"ILP: best {fmt_cost(p.incumbent)}, bound {fmt_cost(p.bound)}, gap {found}, "
                            f"{p.seconds:.0f} s")

    res = solve_ilp(search.graph, search.budget, effort=search.effort, time_limit=search.deadline,
                    warm_start=best.schedule if best else None, mip_solver=search.mip_solver, rel_gap=ILP_REL_GAP,
                    on_progress=report, model=model)
    search.ilp_status = res.status
    search.raise_bound(res.lower_bound, "ilp")
    if res.schedule is not None:
        timeline = simulate(search.graph, res.schedule)
        if timeline.peak_bytes > search.budget:
            # The ILP's memory model is meant to over-approximate the code; a plan that does not
            # fit when simulated is a gap in that model. Never use it; say so.
            log.warning("fxopt: the ILP's plan peaks at %d bytes when simulated, above the budget %d; it is "
                        "discarded (please report this graph)", timeline.peak_bytes, search.budget)
        else:
            search.consider(res.schedule, timeline, "ilp", "optimal" if res.status == "optimal" else "feasible")
    if res.interrupted:
        search.progress("ILP interrupted; keeping the best plan found")
    elif res.limit == "work":
        search.progress("ILP: its effort spent; keeping the best plan found")


def fallback(search: Search) -> None:
    """The heuristics, quietly, where the ILP's or the instant program's own plans do not fit:
    the ILP's memory model is conservative, so a budget it calls infeasible may still be met by a
    simulated heuristic schedule; the instant program's plans may peak at instants it did not
    model."""
    run_sources(search, ("segments", "greedy", "checkpoint", "chain"), fallback=True)


def complete_the_rest(search: Search) -> None:
    """Nothing fits yet: every other over-budget schedule, completed with compression (what
    `fxopt.solvers.minimum.lowest_plan` also tries, so the budget it names plans)."""
    for schedule, _, name in search.over[COMPRESS_TRIES:]:
        done = compress_to_fit(search.graph, schedule, search.budget)
        if done is not None:
            search.consider(*done, f"{name}+compress", "heuristic")


def _unproven(search: Search) -> bool:
    return not search.proven_infeasible


def _over_budget(attribute: str) -> Callable[[Search], bool]:
    return lambda s: bool(getattr(s.graph, attribute)) and bool(s.over) and not s.proven_infeasible


def _without_plan_of(prefix: str) -> Callable[[Search], bool]:
    return lambda s: not s.proven_infeasible and not any(f.solver.startswith(prefix) for f in s.fitting)


# The phases every strategy ends with (the order matters: a proof the plans contradict is
# dropped before the phases that only run where nothing is proven).
_COMPLETE = (
    Phase("compress", compress_cheapest_over_budget, _over_budget("compressible")),
    Phase("offload", offload_cheapest_over_budget, _over_budget("offloadable")),
    Phase("check the proof", check_proof, lambda s: s.proven_infeasible and bool(s.fitting)),
)
_LAST = (Phase("complete the rest", complete_the_rest,
               lambda s: not s.fitting and not s.proven_infeasible and bool(s.graph.compressible)),)
_SAVE_ALL = Phase("save_all", lambda s: run_sources(s, ["save_all"]))  # optimal when it fits: the models may miss it
_INSTANT = Phase("instant", run_instant, _unproven)


def _unless_exact(phase: Phase) -> Phase:
    """``phase``, skipped where eager's schedule is proven optimal with no gap (`run_save_all_first`)."""
    return dataclasses.replace(phase, when=lambda s, when=phase.when: not s.exact and when(s))


def _unless_by_blocks(phase: Phase) -> Phase:
    """``phase``, skipped where the repeated blocks' plans fit (`run_blocks`)."""
    return dataclasses.replace(phase, when=lambda s, when=phase.when: not s.by_blocks and when(s))


def strategies() -> dict[str, tuple[Phase, ...]]:
    """Each solver's phases (a source with ``solver=True`` is one of its own)."""
    whole = (_INSTANT, sources("unsettled"), *_COMPLETE,
             # (Past the time limit, what only improves a plan that fits is skipped.)
             Phase("save more", run_save_more, lambda s: not s.settled() and not s.deadline.check("save more")),
             Phase("exchange", run_exchange, lambda s: not s.settled() and not s.deadline.check("exchange")),
             Phase("ilp", run_ilp, lambda s: not s.settled() and not (s.fitting and s.deadline.check("ILP"))),
             Phase("the smallest budget's plan", run_lowest_plan, _near_the_smallest_budget),
             Phase("keep recomputed", run_keep_recomputed,
                   lambda s: not s.settled() and not s.deadline.check("keep recomputed")),
             *_LAST)
    out = {
        # Eager's schedule first: where it fits and nothing beats it, nothing else runs. A step of
        # repeated blocks is planned per block where that fits: the phases of the whole graph
        # then give way to the bound for that plan (`_unless_by_blocks`).
        "auto": (Phase("save_all first", run_save_all_first, _unproven),
                 *map(_unless_exact, (
                     Phase("blocks", run_blocks, lambda s: s.chain() is not None), sources("first"),
                     Phase("bound", run_block_bound, lambda s: s.by_blocks and bool(s.fitting) and not s.settled()),
                     *map(_unless_by_blocks, whole)))),
        "ilp": (_SAVE_ALL, *_COMPLETE, Phase("ilp", run_ilp, _unproven),
                Phase("fallback", fallback, _without_plan_of("ilp")), *_LAST),
        "instant": (_SAVE_ALL, _INSTANT, *_COMPLETE, Phase("fallback", fallback, _without_plan_of("instant")), *_LAST),
    }
    # (The heuristics in the order the solvers were always listed in; a new source after them.)
    listed = ("segments", "greedy", "checkpoint", "save_all")
    for name in sorted((n for n, source in SOURCES.items() if source.solver),
                       key=lambda n: listed.index(n) if n in listed else len(listed)):
        out[name] = (Phase(name, lambda s, name=name: run_sources(s, [name])), *_COMPLETE, *_LAST)
    return out
