"""Repeated blocks (`fxopt.solvers.blocks`, `fxopt.solvers.block_plan`): the block found, each
kind solved once, the plan chosen per copy simulated within the budget and as cheap as the
whole-graph ILP's, on hand-built chains of identical blocks (no tensors)."""

from __future__ import annotations

import dataclasses

import pytest

from fxopt.solvers import eager_timeline, simulate, solve
import fxopt.solvers.blocks as blocks_module
from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers import Memo
from fxopt.solvers.block_plan import _leads, _lowest, _run, block_candidates, block_chain, predicted_peak, solver_for
from fxopt.solvers.blocks import find_blocks
from fxopt.solvers.effort import DEFAULT_EFFORT, Deadline
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.minimum import lowest_schedule
from fxopt.solvers.schedule import on_demand, save_all_set
from solver_graphs import chain, diamond, mlp2, repeated_blocks


def names(graph, ids):
    return sorted(graph.nodes[i].name for i in ids)


class Counted:
    """The kinds' solvers, counting the graphs they are asked to solve."""

    def __init__(self):
        self.at, self.lowest_of = solver_for(solve, lowest_schedule, DEFAULT_EFFORT, Deadline(60), None)
        self.graphs: list = []

    def solve(self, graph, budget):
        self.graphs.append(graph)
        return self.at(graph, budget)

    def lowest(self, graph):
        self.graphs.append(graph)
        return self.lowest_of(graph)

    def chain(self, graph):
        return block_chain(graph, self.solve, self.lowest, find_blocks(graph, min_copies=3))


@pytest.mark.parametrize("n, modules, shared, kinds", [
    (3, True, True, 3),  # before the blocks, the blocks, the head (the table every block reads aside)
    (6, True, True, 3),
    (6, True, False, 3),
    (6, False, False, 4),  # between articulation values: the head's logits and loss apart
])
def test_the_repeated_block_is_found(n, modules, shared, kinds):
    g = repeated_blocks(n, modules=modules, shared=shared)
    blocks = find_blocks(g, min_copies=3)
    assert len(blocks.kinds) == kinds
    kind = blocks.segments[1].kind
    assert blocks.copies(kind) == list(range(1, n + 1))
    for k in range(1, n + 1):  # each copy: its forward values and its backward nodes, all of them
        members = names(g, blocks.segments[k].members)
        assert members == sorted(f"{v}{k}" for v in ("n", "u", "s", "v", "o", "a", "dv", "du", "dn", "dw", "dx", "g"))
    # What the blocks read from one another, and the table, is SAVEd whatever the plans.
    assert names(g, blocks.forced) >= [f"a{k}" for k in range(1, n)]
    assert ("rope" in names(g, blocks.forced)) == shared


def test_no_repeated_block_no_blocks():
    """A graph with no two segments alike, or one block, has nothing to solve once; a chain of
    identical layers has (their copies, whatever is around them)."""
    assert find_blocks(diamond(), min_copies=2) is None
    assert find_blocks(mlp2(), min_copies=2) is None
    assert find_blocks(repeated_blocks(1), min_copies=2) is None
    assert find_blocks(chain(4), min_copies=3).depth >= 3
    # A shallow step is planned whole (`MIN_COPIES`): 5 blocks are not, 6 are.
    assert find_blocks(repeated_blocks(5)) is None and find_blocks(repeated_blocks(6)).depth == 6


def test_each_kind_is_solved_once_whatever_the_depth():
    """The kinds' solvers are asked the same number of times for 3 blocks as for 12: the block is
    solved once, not per copy; and every graph they solve is one of the kinds'."""
    counts = []
    for n in (3, 12):
        counted = Counted()
        g = repeated_blocks(n)
        counted.chain(g)
        kinds = find_blocks(g, min_copies=3).kinds
        assert all(any(len(solved) in (len(k), len(k) + 1) for k in kinds) for solved in counted.graphs)
        counts.append(len(counted.graphs))
    assert counts[0] == counts[1]


@pytest.mark.parametrize("n", [3, 4, 6])
@pytest.mark.parametrize("share", [0.9, 0.8, 0.7])
def test_the_block_plan_fits_and_costs_what_the_whole_graph_plan_does(n, share):
    """Without a table shared by every block (a clean chain), the cheapest block plan within the
    budget simulates within it and costs no more than 2% above the ILP's plan of the whole
    graph (it is the ILP's optimum here, or cheaper where the ILP stops short)."""
    g = repeated_blocks(n, shared=False, modules=False)
    budget = int(share * eager_timeline(g).peak_bytes)
    counted = Counted()
    found = [c for c in block_candidates(counted.chain(g), budget, counted.solve, 24) if c[1].peak_bytes <= budget]
    whole = solve(g, budget, "ilp")
    best = min(found, key=lambda c: c[1].cost)
    assert simulate(g, best[0]).peak_bytes <= budget
    assert best[1].cost <= whole.timeline.cost * 1.02 + 1e-9


@pytest.mark.parametrize("shared, modules", [(True, True), (False, True), (False, False)])  # (cut at articulation values: no table)
@pytest.mark.parametrize("logits", [64, 256])
def test_the_predicted_peak_is_the_simulated_one_or_above(shared, modules, logits):
    """The choice's predicted peak bounds its simulated one (exact for the plans the offsets were
    read from; above where a plan lets something go sooner than they do), the sweeps of rotor's
    decisions included, and the lowest predicted peak is a plan's that simulates there, above
    the proven floor."""
    g = repeated_blocks(5, shared=shared, modules=modules, logits=logits)
    counted = Counted()
    chained = counted.chain(g)
    lowest, found = _lowest(chained)
    assert _run(chained, found)[1].peak_bytes <= lowest
    assert lowest >= peak_lower_bound(g)[0]
    eager = eager_timeline(g).peak_bytes
    for budget in range(lowest, eager + 1, max(1, (eager - lowest) // 12)):
        for found in _leads(chained, budget):
            predicted = predicted_peak(chained, found)
            assert _run(chained, found)[1].peak_bytes <= predicted <= budget


@pytest.fixture
def whole_graph(monkeypatch):
    """The solvers without the repeated blocks' plans (as `benchmarks.planning_time` has them)."""
    def solve_whole(*args, **kwargs):
        monkeypatch.setattr(blocks_module, "MIN_COPIES", 1 << 30)
        try:
            return solve(*args, **kwargs)
        finally:
            monkeypatch.undo()
    return solve_whole


def smallest_budget(solver, g) -> int:
    with pytest.raises(InfeasibleBudgetError) as err:
        solver(g, 1, memo=Memo())
    return err.value.min_budget


@pytest.mark.parametrize("logits, shared", [(64, True), (256, True), (256, False), (1024, False)])
def test_at_the_smallest_budget_the_plan_costs_what_the_whole_graphs_does(whole_graph, logits, shared):
    """8 blocks before a head whose logits are 4 to 64 times a block's value (a language model's
    vocabulary): at the smallest budget fxopt names, the tightest place is the head, and the
    layers' values are best made again in the backward, after it (rotor's sweeps: the forward
    keeps the layers' links or less). The plan costs no more than 2% above the whole graph's
    at that budget; where the blocks' lowest is above it (another source's lowest-peak plan is
    the smallest), the whole graph's phases run."""
    g = repeated_blocks(8, logits=logits, shared=shared)
    least = smallest_budget(solve, g)
    blocks = solve(g, least, memo=Memo())
    whole = whole_graph(g, least, memo=Memo())
    assert blocks.timeline.peak_bytes <= least
    assert blocks.timeline.cost <= whole.timeline.cost * 1.02 + 1e-9


@pytest.mark.parametrize("logits, shared", [(64, True), (64, False), (256, False)])
def test_the_smallest_budget_through_the_blocks_is_the_whole_graphs(whole_graph, logits, shared):
    """The smallest budget found through the blocks (their lowest-peak decisions: some layers
    made again from an earlier one's link) is no higher than the whole graph's searches find."""
    g = repeated_blocks(8, logits=logits, shared=shared)
    assert smallest_budget(solve, g) <= smallest_budget(whole_graph, g)


@pytest.mark.slow
def test_a_model_of_repeated_layers_is_planned_per_block_within_its_budget_and_exact():
    """The zoo's ``gpt2_tiny`` (`fxopt.models.gpt2`) with 8 layers instead of 2, at 60% of its
    eager peak: planned through the blocks (each layer's graph solved once), its measured peak
    within the budget, its loss and gradients eager's."""
    import torch

    from fxopt.models import gpt2
    from helpers import assert_same_step, measured_peak, run_pair

    torch.manual_seed(0)
    model, inputs = gpt2(layers=8, dim=64, heads=4, seq=128, batch=8, vocab=512)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, 0.6)
    plan = optimized.plan
    assert plan.solver == "blocks" and plan.peak_bytes <= plan.budget_bytes
    assert_same_step(eager, optimized, loss_e, loss_o)
    assert measured_peak(optimized, inputs) <= plan.budget_bytes


def test_a_memos_timelines_spare_simulations_of_the_step_and_change_no_answer(monkeypatch):
    """The search for the smallest budget, then the plan at it, as the planner asks them with its
    memo: with the memo's timelines (`Memo.timeline`: eager's schedule, which the heuristics, the
    blocks' probes and their bound start from; the blocks' chosen plans) the step is simulated
    fewer times (counted, not timed) than with every one of those simulated again, each
    schedule kept once, and the answers are those of solves without a memo."""
    import sys

    import fxopt.solvers.schedule as schedule_module

    g = repeated_blocks(8, logits=256, shared=False)
    least = smallest_budget(solve, g)
    plain = solve(g, least)
    real, runs, kept = schedule_module.simulate, [], []

    def counted(graph, schedule, *args, **kwargs):
        if graph is g and not args and not kwargs:
            runs.append(schedule)
        return real(graph, schedule, *args, **kwargs)

    for module in [m for name, m in sys.modules.items() if name.startswith("fxopt.solvers")]:
        if getattr(module, "simulate", None) is real:
            monkeypatch.setattr(module, "simulate", counted)

    def both(memo):
        runs.clear()
        with pytest.raises(InfeasibleBudgetError) as err:
            solve(g, 1, memo=memo)
        found = solve(g, least, memo=memo)
        return err.value.min_budget, (found.schedule, found.timeline.peak_bytes, found.timeline.cost), len(runs)

    class Unkept(Memo):
        def timeline(self, graph, schedule):
            kept.append(schedule)
            return counted(graph, schedule)

    again = both(Unkept())
    once = both(Memo())
    assert once[:2] == again[:2] == (least, (plain.schedule, plain.timeline.peak_bytes, plain.timeline.cost))
    assert len(kept) > len(set(kept))  # (the memo's schedules repeat across the two solves)
    assert once[2] == again[2] - (len(kept) - len(set(kept)))


def test_the_copies_of_a_chain_share_what_their_common_points_make(monkeypatch):
    """Each solve of a step refines its own copy of the step's chain (`memo_chain`): what is made
    of the points every copy holds (a segment's menu, rotor's chain with its ways, the lowest) is
    made once for all of them (counted), and a copy's refinements stay its own: the plans a copy
    finds after another refined its curves are those of a chain no other copy touched."""
    import fxopt.solvers.block_plan as block_plan
    import fxopt.solvers.block_rotor as block_rotor

    g = repeated_blocks(8, logits=256, shared=True)
    budget = (eager_timeline(g).peak_bytes + smallest_budget(solve, g)) // 2
    counted = Counted()
    fresh = counted.chain(g).copy()
    expected = [(c[0], c[1].peak_bytes, c[1].cost) for c in block_candidates(fresh, budget, counted.solve, 24)]

    menus, ways = [], []
    real_menu, real_ways = block_plan.BlockChain._new_menu, block_rotor._ways
    monkeypatch.setattr(block_plan.BlockChain, "_new_menu", lambda self, v, s: menus.append((id(v), s)) or real_menu(self, v, s))
    monkeypatch.setattr(block_rotor, "_ways", lambda chain, s, t: ways.append((id(chain), s, t)) or real_ways(chain, s, t))
    chained = counted.chain(g)
    first, second = chained.copy(), chained.copy()
    segments, variants = len(chained.blocks.segments), chained.variants
    for copy in (first, second):
        for variant in variants:
            block_rotor.cheapest_tree(copy.rotor(variant), budget)
            block_rotor.kept_tree(copy.rotor(variant), budget)
            block_rotor.min_peak_tree(copy.rotor(variant))
        _lowest(copy)
    assert len(menus) == len(set(menus)) == segments * len(variants)  # (made by the first copy only)
    assert len(ways) == len(set(ways)) == len(variants) * segments * (segments + 1) // 2  # (each sub-chain's once)
    assert all(second.rotor(v) is first.rotor(v) for v in variants)
    assert _lowest(second) is _lowest(first)

    # A point only the first copy holds (as its own refinement adds one): its menus are its own.
    kind = max(range(len(chained.kinds)), key=lambda k: len(chained.blocks.copies(k)))
    held = len(chained.kinds[kind].points)
    first.kinds[kind].points.append(dataclasses.replace(first.kinds[kind].points[0]))
    menus.clear()
    for variant in variants:
        assert all(len(first.rotor(variant).menus[s].keep) == held + 1 for s in chained.blocks.copies(kind))
        assert all(len(second.rotor(variant).menus[s].keep) == held for s in chained.blocks.copies(kind))
    assert len(menus) == len(chained.blocks.copies(kind)) * len(variants)
    third = chained.copy()
    assert all(third.rotor(v) is second.rotor(v) for v in variants) and len(menus) == len(set(menus))
    again = [(c[0], c[1].peak_bytes, c[1].cost) for c in block_candidates(second, budget, counted.solve, 24)]
    assert again == expected


def test_below_the_floor_no_blocks_plan_is_made_and_the_same_smallest_budget_is_named(monkeypatch):
    """A budget below the step's proven floor plans nothing: the blocks' plans for it (the chain's
    choice, its curves refined) are not made, and the smallest budget named is the one a 1-byte
    budget names, whatever budget below the floor was asked."""
    import fxopt.solvers.phases as phases

    g = repeated_blocks(8)
    assert find_blocks(g) is not None
    floor = peak_lower_bound(g)[0]
    asked = []
    monkeypatch.setattr(phases, "block_candidates", lambda *a, **k: asked.append(a[1]) or [])
    named = []
    for budget in (1, floor // 2, floor - 1):
        with pytest.raises(InfeasibleBudgetError) as err:
            solve(g, budget, memo=Memo())
        named.append((err.value.min_budget, err.value.lower_bound))
    assert asked == [] and len(set(named)) == 1
    assert solve(g, named[0][0], memo=Memo()).timeline.peak_bytes <= named[0][0]


def test_the_memo_keeps_a_graphs_floor_and_eager_timeline(monkeypatch):
    """`Memo.floor` and `Memo.eager`: each found once per graph content (the solves of one step,
    and its answers, each read them)."""
    import fxopt.solvers.minimum as minimum

    g = repeated_blocks(6)
    same = dataclasses.replace(g)  # (another graph object, the same content)
    calls = []
    real = minimum.peak_lower_bound
    monkeypatch.setattr(minimum, "peak_lower_bound", lambda graph: calls.append(graph) or real(graph))
    memo = Memo()
    assert memo.floor(g) == memo.floor(same) == real(g)
    assert len(calls) == 1
    made = []
    assert memo.eager(g, lambda: made.append(1) or eager_timeline(g)) == memo.eager(same, lambda: made.append(1))
    assert made == [1]
