"""The chain solver (`fxopt.solvers.chain`): rotor's dynamic program over the forward's
articulation stages, on hand-built chains, against hand-worked numbers and the ILP's optimum."""

from __future__ import annotations

import pytest

from fxopt.solvers.auto import eager_schedule, solve
from fxopt.solvers.chain import chain_candidates, chain_of, cheapest_schedule, min_peak_schedule
from fxopt.solvers.ilp import solve_ilp
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.schedule import simulate
from solver_graphs import GraphBuilder


def chain(sizes, *, across: bool = False):
    """x -> v1 -> ... -> vn -> loss, each v_k of ``sizes[k-1]`` bytes and cost 1; the backward of
    v_k reads its input v_{k-1} (x for v1; resident, 1 byte) and the next gradient (0 bytes). The
    loss (an output) and the tangent are 1 byte each. ``across``: the last backward node also
    reads vn, a value of another stage (no longer a clean chain)."""
    b = GraphBuilder()
    b.input("x", 1)
    b.input("tan", 1, tangent=True)
    prev = "x"
    for k, size in enumerate(sizes, 1):
        b.fwd(f"v{k}", [prev], size, cost=1.0)
        prev = f"v{k}"
    b.fwd("loss", [prev], 1, cost=0.0, output=True)
    grad = "tan"
    for k in range(len(sizes), 0, -1):
        b.bwd(f"d{k}", [grad, f"v{k - 1}" if k > 1 else "x"] + ([prev] if across and k == 1 else []), 0)
        grad = f"d{k}"
    return b.build()


def names(graph, ids):
    return [graph.nodes[i].name for i in ids]


def test_three_stages_by_hand():
    """Eager keeps v1 and v2: 2 (x, loss) + 3 * 10 while v3 runs. The lowest peak keeps only v2
    and recomputes v1 from x for d2: 2 + 2 * 10 (v1 and v2 alive as v2 is made; v2 and v3 as v3
    is), at the cost of one recomputation."""
    g = chain([10, 10, 10])
    assert simulate(g, eager_schedule(g)).peak_bytes == 32
    found = min_peak_schedule(g)
    assert (found.peak_bytes, found.recompute_cost) == (22, 1.0)
    assert names(g, found.schedule.saved) == ["v2"]
    assert names(g, found.schedule.backward) == ["d3", "v1", "d2", "d1"]
    timeline = simulate(g, found.schedule)
    assert (timeline.peak_bytes, timeline.recompute_cost) == (22, 1.0)
    assert solve_ilp(g, None, minimize_peak=True, time_limit=10).peak_bound == pytest.approx(22)
    assert cheapest_schedule(g, 32).recompute_cost == 0.0
    assert cheapest_schedule(g, 31).recompute_cost == 1.0
    assert cheapest_schedule(g, 21) is None  # below the lowest peak


def test_five_stages_recompute_a_stage_twice():
    """Multi-level checkpointing: keep v4 in the forward; for d4 recompute v1, v2, v3 from x
    (keeping v3 only), then v1 again for d2: at most two values of 10 alive, plus x, the loss and
    the tangent: 23. The ILP's model (a value recomputed once per backward stage, kept until the
    stage) proves 31 its lowest; v1 appears twice in the DP's backward."""
    g = chain([10] * 5)
    found = min_peak_schedule(g)
    timeline = simulate(g, found.schedule)
    assert found.peak_bytes == timeline.peak_bytes == 23
    assert found.recompute_cost == timeline.recompute_cost == 4.0
    assert names(g, found.schedule.backward).count("v1") == 2
    assert peak_lower_bound(g)[0] <= 23 < solve_ilp(g, None, minimize_peak=True, time_limit=10).peak_bound


@pytest.mark.parametrize("sizes", [[10, 10, 10], [10, 20, 5, 30, 10], [8] * 6, [3, 17, 4, 9]])
def test_lowest_peak_is_simulated_and_at_most_the_ilps(sizes):
    g = chain(sizes)
    found = min_peak_schedule(g)
    assert simulate(g, found.schedule).peak_bytes == found.peak_bytes
    ilp = solve_ilp(g, None, minimize_peak=True, time_limit=10)
    assert ilp.status == "optimal"
    assert peak_lower_bound(g)[0] <= found.peak_bytes <= simulate(g, ilp.schedule).peak_bytes


@pytest.mark.parametrize("sizes", [[10, 10, 10], [10, 20, 5, 30, 10], [8] * 6])
def test_cheapest_within_budget_matches_the_ilps_optimum(sizes):
    """Where the ILP proves its plan optimal (within its model, whose memory accounting is
    conservative) the DP's cost is no higher (mostly the same; on [10, 20, 5, 30, 10] at 46
    bytes 3 where the ILP proves 4); its predicted peak is the simulated one, within the budget."""
    g = chain(sizes)
    low, eager = min_peak_schedule(g).peak_bytes, simulate(g, eager_schedule(g)).peak_bytes
    for budget in range(low, eager + 1, 4):
        found = cheapest_schedule(g, budget)
        timeline = simulate(g, found.schedule)
        assert found.peak_bytes == timeline.peak_bytes <= budget
        assert found.recompute_cost == pytest.approx(timeline.recompute_cost)
        ilp = solve(g, budget, "ilp", time_limit=10)
        if ilp.status == "optimal" and ilp.solver == "ilp":
            assert found.recompute_cost <= ilp.timeline.recompute_cost + 1e-9, budget


def test_auto_takes_the_chain_plan_below_the_ilps_reach():
    """At 24 bytes on 6 stages of 8 (the ILP's model reaches 27 at best) "auto" plans."""
    g = chain([8] * 6)
    low = min_peak_schedule(g).peak_bytes
    assert low < solve_ilp(g, None, minimize_peak=True, time_limit=10).peak_bound
    found = solve(g, low, "auto", time_limit=10)
    assert found.timeline.peak_bytes <= low


def test_not_a_chain_gets_nothing_or_a_valid_schedule():
    b = GraphBuilder()  # the backward reads no forward value: nothing to checkpoint
    b.input("x", 1)
    b.input("tan", 1, tangent=True)
    b.fwd("a", ["x"], 4)
    b.fwd("loss", ["a"], 1, output=True)
    b.bwd("da", ["tan"], 4)
    b.bwd("dx", ["da"], 4)
    flat = b.build()
    assert chain_of(flat) is None and min_peak_schedule(flat) is None
    assert chain_candidates(flat, 100) == []
    b = GraphBuilder()  # a diamond: a cuts it (c and the loss read only x and a), c does not
    b.input("x", 1)
    b.input("tan", 1, tangent=True)
    b.fwd("a", ["x"], 4)
    b.fwd("c", ["x"], 4)
    b.fwd("loss", ["a", "c"], 1, output=True)
    b.bwd("da", ["tan", "c"], 4)
    b.bwd("dc", ["tan", "a"], 4)
    diamond = b.build()
    g = chain([10, 10, 10], across=True)
    assert not chain_of(g).exact
    # (graph, budget, candidates): the lowest-peak schedule always; beside it the cheapest within
    # the budget where one fits (none within 12 on the diamond: its lowest peak is 15)
    for graph, budget, count in ((diamond, 12, 1), (diamond, 100, 2), (g, 40, 2), (g, 25, 2)):
        candidates = chain_candidates(graph, budget)
        assert len(candidates) == count, (budget, len(candidates))
        for schedule, timeline in candidates:
            assert simulate(graph, schedule) == timeline
        assert candidates[0][0] == min_peak_schedule(graph).schedule
        if count == 2:
            assert candidates[-1][1].peak_bytes <= budget


def test_a_stages_backward_peak_reads_each_values_size_once():
    """`_backward_peak` sums the reads held at each step of a stage's backward in one sweep: each
    value's size is read once, not once per step (1.1 million reads on a 32-layer Llama's step;
    fails before: steps x values). The peak is the definition's: at each step, the fixed memory and
    every read whose last read is at or after it."""
    from types import SimpleNamespace

    from fxopt.solvers.chain import _backward_peak

    class Counted(list):
        reads = 0

        def __getitem__(self, i):
            Counted.reads += 1
            return super().__getitem__(i)

    steps = 200
    sizes = [(7 * k) % 13 + 1 for k in range(steps)]
    graph = SimpleNamespace(roots=list(range(steps)), nodes=Counted(SimpleNamespace(bytes=b) for b in sizes))
    reads = [frozenset({k, k // 2}) for k in range(steps)]  # step k reads value k and value k // 2
    during = [(3 * k) % 17 for k in range(steps)]
    assigned = [0] * steps
    last = {v: max(k for k in range(steps) if v in reads[k]) for v in range(steps)}
    expected = max(during[k] + sum(sizes[v] for v, e in last.items() if e >= k) for k in range(steps))
    assert _backward_peak(graph, during, reads, assigned, 0, frozenset(range(steps))) == expected
    assert Counted.reads <= steps
