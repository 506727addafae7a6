"""Repeated blocks (`fxopt.solvers.blocks`, `fxopt.solvers.block_plan`): the block found, each
kind solved once, the plan chosen per copy simulated within the budget and as cheap as the
whole-graph ILP's, on hand-built chains of identical blocks (no tensors)."""

from __future__ import annotations

import pytest

from fxopt.solvers import eager_timeline, simulate, solve
from fxopt.solvers.block_plan import _cheapest, _lowest, block_candidates, block_chain, expand, solver_for
from fxopt.solvers.blocks import find_blocks
from fxopt.solvers.effort import DEFAULT_EFFORT, Deadline
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.minimum import lowest_schedule
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


@pytest.mark.parametrize("shared", [True, False])
def test_the_predicted_peak_is_the_simulated_one_or_above(shared):
    """The choice's predicted peak bounds its simulated one (exact for the plans the offsets were
    read from; above where a plan lets something go sooner than they do), and the lowest
    predicted peak is a plan's that simulates there, above the proven floor."""
    g = repeated_blocks(5, shared=shared)
    counted = Counted()
    chained = counted.chain(g)
    lowest = _lowest(chained)
    variant, choice = _cheapest(chained, lowest)
    assert simulate(g, expand(chained.blocks, chained.kinds, choice, variant.saved)).peak_bytes <= lowest
    assert lowest >= peak_lower_bound(g)[0]
    for share in (0.95, 0.85, 0.75):
        budget = int(share * eager_timeline(g).peak_bytes)
        found = _cheapest(chained, budget)
        if found is None:
            continue
        variant, choice = found
        kept, predicted = 0, 0
        for s, p in enumerate(choice):
            predicted = max(predicted, kept + chained.need(variant, s)[p])
            kept += chained.points(s)[p].keep
        timeline = simulate(g, expand(chained.blocks, chained.kinds, choice, variant.saved))
        assert timeline.peak_bytes <= predicted <= budget


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
