"""The pipeline cut solver (`fxopt.solvers.stages`) on hand-built graphs, with hand-worked answers.

No tensors: cut points and what crosses them, stage assignment, stage graphs, the schedule's
timing, the in-flight memory model, the DP on hand-made atoms, and exact stage plans on a chain.
"""

from __future__ import annotations

import warnings

import pytest

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers import simulate
from fxopt.solvers import stages as st
from solver_graphs import GraphBuilder, chain, chain_inputs


def skip_graph(origins: bool = False):
    """a = f(x); b = f(a); c = f(b); d = c + a (a skip over b and c); e = f(d); loss = sum(e),
    and its backward. Returns the graph (and with ``origins`` the label of each node: a forward
    op's and the backward nodes that differentiate it share one)."""
    b = chain_inputs(4)
    b.fwd("a", ["x", "w1"], 16)
    b.fwd("b", ["a", "w2"], 16)
    b.fwd("c", ["b", "w3"], 16)
    b.fwd("d", ["c", "a"], 16)
    b.fwd("e", ["d", "w4"], 16)
    b.fwd("loss", ["e"], 1, output=True)
    b.bwd("g_e", ["tan"], 16)
    b.bwd("g_w4", ["d", "g_e"], 4, output=True)
    b.bwd("g_d", ["g_e", "w4"], 16)
    b.bwd("g_w3", ["b", "g_d"], 4, output=True)
    b.bwd("g_b", ["g_d", "w3"], 16)
    b.bwd("g_w2", ["a", "g_b"], 4, output=True)
    b.bwd("g_a1", ["g_b", "w2"], 16)
    b.bwd("g_a", ["g_a1", "g_d"], 16)
    b.bwd("g_w1", ["x", "g_a"], 4, output=True)
    graph = b.build()
    if not origins:
        return graph
    label = {"a": 1, "b": 2, "c": 3, "e": 5, "g_w1": 1, "g_a1": 2, "g_w2": 2, "g_b": 3, "g_w3": 3, "g_d": 5, "g_w4": 5}
    return graph, [label.get(n.name) for n in graph.nodes]


def names(graph, ids):
    return [graph.nodes[i].name for i in ids]


# ---------------------------------------------------------------- cut points

@pytest.mark.parametrize("max_tensors, expected", [
    # (position, the value the cut follows, what crosses, bytes, bytes the backward reads)
    (1, [(0, "a", ["a"], 16, 16), (3, "d", ["d"], 16, 16), (4, "e", ["e"], 16, 0)]),
    (2, [(0, "a", ["a"], 16, 16), (1, "b", ["a", "b"], 32, 32), (2, "c", ["a", "c"], 32, 16),
         (3, "d", ["d"], 16, 16), (4, "e", ["e"], 16, 0)]),
])
def test_cut_points_carry_the_skip_connection(max_tensors, expected):
    g = skip_graph()
    got = [(p.position, g.nodes[p.after].name, names(g, p.crossing), p.bytes, p.saved_bytes)
           for p in st.cut_points(g, max_tensors=max_tensors)]
    assert got == expected


def test_cut_points_on_a_chain_and_allowed_positions():
    g = chain(3)  # h1 a1 h2 a2 h3 a3 loss: every value crosses alone
    assert [g.nodes[p.after].name for p in st.cut_points(g, max_tensors=1)] == ["h1", "a1", "h2", "a2", "h3", "a3"]
    only_layers = [p.position for p in st.cut_points(g, max_tensors=1, allowed=lambda q: q % 2 == 1)]
    assert only_layers == [1, 3, 5]


def test_a_weight_read_at_both_ends_leaves_no_cut():
    b = GraphBuilder()
    b.input("x", 8)
    b.input("w", 4)
    b.input("tan", 1, tangent=True)
    b.fwd("h", ["x", "w"], 16)
    b.fwd("a", ["h"], 16)
    b.fwd("o", ["a", "w"], 16)  # the same weight again: tied
    b.fwd("loss", ["o"], 1, output=True)
    b.bwd("g_o", ["tan"], 16)
    b.bwd("g_w", ["a", "g_o"], 4, output=True)
    g = b.build()
    assert [g.nodes[p.after].name for p in st.cut_points(g)] == ["o"]  # only past the weight's last use
    with pytest.raises(ValueError, match="1 place.*cannot be split into 3 stages.*tied"):
        st.cut_model(g, 3, 3)


def test_choose_points_takes_the_fewest_tensors_that_give_enough():
    g = skip_graph()
    assert len(st.choose_points(g, 1)) == 3  # 1 tensor per cut gives 3 >= 2 per stage
    assert len(st.choose_points(g, 2)) == 5  # 3 < 4: two tensors per cut are allowed


# ---------------------------------------------------------------- stages

def test_assign_stages_by_what_each_backward_node_can_read():
    g = skip_graph()
    stage, conflicts = st.assign_stages(g, [1])  # cut after b: a and b cross
    by_name = {n.name: stage[i] for i, n in enumerate(g.nodes)}
    assert conflicts == []
    assert {k: by_name[k] for k in ("w1", "w2", "w3", "tan", "a", "b", "c", "loss")} == \
        {"w1": 0, "w2": 0, "w3": 1, "tan": 1, "a": 0, "b": 0, "c": 1, "loss": 1}
    # Without origins a backward node runs in the latest stage that has what it reads: g_w2
    # reads a (which crosses into stage 1) and g_b (made there).
    assert {k: by_name[k] for k in ("g_e", "g_d", "g_b", "g_w2", "g_a1", "g_a", "g_w1")} == \
        {"g_e": 1, "g_d": 1, "g_b": 1, "g_w2": 1, "g_a1": 0, "g_a": 0, "g_w1": 0}
    g, origins = skip_graph(origins=True)
    stage, _ = st.assign_stages(g, [1], origins)
    assert stage[names(g, range(len(g))).index("g_w2")] == 0  # with b, whose weight it differentiates


def test_stage_graph_receives_activations_and_gradients():
    g = skip_graph()
    stage, _ = st.assign_stages(g, [1])
    first = st.stage_graph(g, stage, 0)
    rows = [(n.name, n.kind, n.bytes, n.tangent, n.output) for n in first.nodes]
    assert rows == [("x", "input", 8, False, False), ("w1", "input", 4, False, False),
                    ("w2", "input", 4, False, False),
                    ("g_d", "input", 16, True, False), ("g_b", "input", 16, True, False),  # the two gradients in
                    ("a", "forward", 16, False, True), ("b", "forward", 16, False, True),  # sent on
                    ("g_a1", "backward", 16, False, False), ("g_a", "backward", 16, False, False),
                    ("g_w1", "backward", 4, False, True)]
    second = st.stage_graph(g, stage, 1)
    assert [(n.name, n.kind, n.tangent) for n in second.nodes if n.kind == "input"] == \
        [("w3", "input", False), ("w4", "input", False), ("tan", "input", True), ("a", "input", False),
         ("b", "input", False)]
    assert {n.name for n in second.nodes if n.output} == {"loss", "g_w4", "g_d", "g_w3", "g_b", "g_w2"}
    simulate(second, st.eager_schedule(second))  # a valid step


# ---------------------------------------------------------------- the schedule

@pytest.mark.parametrize("schedule, forward, backward, microbatches, step, bubble", [
    # 2 stages, 2 microbatches, F = 1 s, B = 2 s. 1F1B: stage 1 runs F0 [1,2] B0 [2,4] F1 [4,5]
    # B1 [5,7]; stage 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]. 12 busy of 2 x 9.
    ("1F1B", [1, 1], [2, 2], 2, 9.0, 1 / 3),
    ("GPipe", [1, 1], [2, 2], 2, 9.0, 1 / 3),
    # One stage: no bubble.
    ("GPipe", [1], [2], 3, 9.0, 0.0),
    # A slow last stage: 1F1B stage 1 F0 [1,3] B0 [3,5] F1 [5,7] B1 [7,9]; stage 0 B1 at [9,10].
    ("1F1B", [1, 2], [1, 2], 2, 10.0, 1 - 12 / 20),
])
def test_pipeline_timing(schedule, forward, backward, microbatches, step, bubble):
    timing = st.pipeline_timing(forward, backward, microbatches, schedule)
    assert timing.step_seconds == pytest.approx(step)
    assert timing.bubble == pytest.approx(bubble)


def test_schedule_order_is_torchs():
    assert st.schedule_order("1F1B", 3, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                                   ("B", 2), ("B", 3)]
    assert st.schedule_order("1F1B", 3, 4, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                                                   ("F", 3), ("B", 3)]
    assert [st.in_flight_count("1F1B", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [st.in_flight_count("GPipe", 4, 8, s) for s in range(4)] == [8, 8, 8, 8]
    # Once gradients accumulate: 1F1B with spare microbatches runs another forward first.
    assert [st.accumulation("1F1B", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [st.accumulation("1F1B", 4, 4, s) for s in range(4)] == [3, 3, 2, 1]
    assert st.accumulation("GPipe", 2, 4, 0) == 3 and st.accumulation("GPipe", 2, 1, 0) == 0


@pytest.mark.parametrize("schedule, s, expected", [
    # 4 microbatches, 2 stages, received 10 and sent 100 bytes per microbatch.
    ("1F1B", 0, 3 * 10 + 3 * 100 + 100),  # other inputs; 3 output-gradient buffers; warm-up send
    ("1F1B", 1, 3 * 10 + 10),  # 3 receive buffers and one input gradient sending
    ("GPipe", 0, 3 * 10 + 3 * 100),
    ("GPipe", 1, 3 * 10 + 3 * 10),  # GPipe keeps every input gradient's send
])
def test_runtime_fixed(schedule, s, expected):
    assert st.runtime_fixed(schedule, 2, 4, s, 10, 100) == expected


def test_device_peak_counts_the_microbatches_in_flight():
    g = chain(4)
    schedule = st.eager_schedule(g)
    timeline = simulate(g, schedule)
    one = st.InFlight(1)
    assert one.device_peak(g, schedule) == timeline.peak_bytes
    three = st.InFlight(3, held_bytes=2, fixed_bytes=5, accumulated_bytes=1000, accumulating=1)
    assert three.device_peak(g, schedule) == timeline.peak_bytes + max(2 * (timeline.saved_bytes + 2), 1000) + 5


def test_device_peak_counts_an_output_saved_in_name_only_as_held():
    """A schedule may SAVE a forward output that the backward does not read (the generated code
    drops that SAVE, `as_generated`): each other microbatch in flight then holds its SAVEd ``a``
    and its output ``o``, 16 + 16 bytes. The output was subtracted as SAVEd twice before (16), and
    stage 0 of a skip CNN under GPipe measured 3,324 B over the budget named for it (issue 24)."""
    from fxopt.solvers.schedule import Schedule
    from solver_graphs import ids

    b = GraphBuilder()
    b.input("x", 8)
    b.input("w", 4)
    b.input("tan", 16, tangent=True)
    b.fwd("a", ["x", "w"], 16)
    b.fwd("o", ["a"], 16, output=True)
    b.bwd("g_a", ["tan", "a"], 16)
    b.bwd("g_w", ["x", "g_a"], 4, output=True)
    g = b.build()
    schedule = Schedule(frozenset(ids(g, "a", "o")), ids(g, "g_a", "g_w"))
    timeline = simulate(g, schedule)
    assert timeline.saved_bytes == 16  # a: the SAVE of o is dropped
    assert st.InFlight(2, held_bytes=16).device_peak(g, schedule, timeline) == timeline.peak_bytes + 16 + 16


# ---------------------------------------------------------------- the DP

def atoms_model(options, stages=2, microbatches=2, count=4):
    """``count`` atoms of forward cost 1, no parameters, nothing sent between them, each with
    the given remat options (SAVEd bytes, transient bytes, recompute cost)."""
    points = tuple(st.CutPoint(q, q, (q,), 0, 0) for q in range(count - 1))
    atoms = tuple(st.Atom(1.0, 0.0, 0, 0, 0, tuple(options)) for _ in range(count))
    return st.CutModel(points, atoms, stages, microbatches)


@pytest.mark.parametrize("budget, cuts, slowest, devices", [
    # Stage 0 holds 2 microbatches (20 bytes per atom), stage 1 one (10 per atom).
    (40, (1,), 2.0, [40, 20]),  # 2 + 2 atoms
    (30, (0,), 3.0, [20, 30]),  # stage 0 fits one atom only
])
def test_dp_one_option(budget, cuts, slowest, devices):
    split = st.best_split(atoms_model([(10, 0, 0.0)]), budget)
    assert split.cuts == cuts
    assert split.slowest_seconds == pytest.approx(slowest)
    assert [e.device_bytes for e in split.estimates] == devices


def test_dp_infeasible_without_remat_fits_with_it():
    # At 25: stage 1 holds at most 2 atoms (10 each), so stage 0 needs 2, which at 2 x 20 = 40
    # does not fit; recomputing (4 bytes SAVEd, 0.5 s each) it needs 2 x 8 = 16.
    assert st.best_split(atoms_model([(10, 0, 0.0)]), 25) is None
    split = st.best_split(atoms_model([(10, 0, 0.0), (4, 0, 0.5)]), 25)
    assert split.cuts == (1,)
    assert [e.level for e in split.estimates] == [1, 0]
    assert [e.seconds for e in split.estimates] == [3.0, 2.0]
    assert [e.device_bytes for e in split.estimates] == [16, 20]
    lowest = st.min_peak_split(atoms_model([(10, 0, 0.0), (4, 0, 0.5)]))
    # One atom on stage 0 (2 x 4) and three on stage 1 (3 x 4), all recomputed.
    assert lowest.cuts == (0,) and [e.device_bytes for e in lowest.estimates] == [8, 12]


def test_balanced_cuts():
    assert st.balanced_cuts([1, 2, 3, 4], 2) == (2,)  # [1 2 3] [4]: 6
    assert st.balanced_cuts([1, 1, 1, 1, 1, 1], 3) == (1, 3)
    assert st.balanced_cuts([5, 1, 1, 1, 1, 1], 2) == (0,)


# ---------------------------------------------------------------- exact stage plans

def test_solve_stage_fits_the_device():
    g = chain(6)
    in_flight = st.InFlight(3, held_bytes=16, fixed_bytes=40)
    eager = st.InFlight(3, 16, 40).device_peak(g, st.eager_schedule(g))
    sol = st.solve_stage(g, eager - 40, in_flight)
    assert in_flight.device_peak(g, sol.schedule, sol.timeline) <= eager - 40
    with pytest.raises(InfeasibleBudgetError) as err:
        st.solve_stage(g, 100, in_flight)
    least = err.value.min_budget
    sol = st.solve_stage(g, least, in_flight)  # the smallest budget named plans
    assert in_flight.device_peak(g, sol.schedule, sol.timeline) <= least



def test_stages_of_one_graph_share_their_search_starts(monkeypatch):
    """The schedules a stage's search starts from (the heuristics', the chain's, the lowest-peak
    one) do not depend on what the device holds beside: the stages of one graph, each with its own
    microbatches in flight, find them once in the planner's memo, and each plan is the one a
    fresh memo gives."""
    import fxopt.solvers.stages.in_flight as in_flight
    from fxopt.solvers.minimum import Memo

    g = chain(12)
    heuristics = {}
    counted = {name: (lambda h, n=name: lambda *a, **k: heuristics.__setitem__(n, heuristics.get(n, 0) + 1) or h(*a, **k))(h)
               for name, h in in_flight.HEURISTICS.items()}
    monkeypatch.setattr(in_flight, "HEURISTICS", counted)
    stages = [st.InFlight(k, held_bytes=16, fixed_bytes=40) for k in (4, 3, 2)]  # 1F1B's stages 0-2 of 4
    budgets = [int(stage.device_peak(g, st.eager_schedule(g)) * 0.7) for stage in stages]
    memo = Memo()
    shared = [st.solve_stage(g, b, stage, memo=memo) for stage, b in zip(stages, budgets)]
    runs_shared = dict(heuristics)
    heuristics.clear()
    alone = [st.solve_stage(g, b, stage, memo=Memo()) for stage, b in zip(stages, budgets)]
    for x, y in zip(shared, alone):
        assert (x.schedule, x.timeline.cost, x.solver) == (y.schedule, y.timeline.cost, y.solver)
    assert set(runs_shared.values()) == {1} and set(heuristics.values()) == {3}  # (every stage's search starts)


@pytest.mark.slow
def test_a_stage_plan_does_not_depend_on_how_long_its_solves_take(monkeypatch):
    """A stage's search makes several solves (`STAGE_SOLVES` and the lowest-peak search), each
    with counted effort. With the safety stop's clock standing still but for 60 s at the end of
    each (a machine on which every solve takes 60% of the 100 s time limit, however fast it is),
    the plan is the one made with the clock standing still, and nothing says it stopped: each
    solve has a stop of its own. One stop shared by all of them passed at the third, and the plan
    was another (issue 24: on a busy machine budget_holds' last pipeline stage was planned by the
    simple policies, on a quiet one by the ILP)."""
    import fxopt.solvers.effort as effort
    import fxopt.solvers.stages.in_flight as in_flight
    from fxopt.solvers import SolverTimeoutWarning

    g, stage = chain(16), st.InFlight(2, held_bytes=8, fixed_bytes=10)
    budget = int(stage.device_peak(g, st.eager_schedule(g)) * 0.6)
    clock = [0.0]
    monkeypatch.setattr(effort, "now", lambda: clock[0])
    still = st.solve_stage(g, budget, stage, time_limit=100.0)

    def taking_60_s(work):
        def run(*args, **kwargs):
            try:
                return work(*args, **kwargs)
            finally:
                clock[0] += 60.0
        return run

    monkeypatch.setattr(in_flight, "solve", taking_60_s(in_flight.solve))
    monkeypatch.setattr(in_flight, "lowest_plan", taking_60_s(in_flight.lowest_plan))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SolverTimeoutWarning)
        busy = st.solve_stage(g, budget, stage, time_limit=100.0)
    assert clock[0] >= 3 * 100.0  # (the search took longer than the time limit, several times over)
    assert still.stopped == busy.stopped == ()
    assert (busy.schedule, busy.timeline.cost, busy.solver, busy.status) == \
        (still.schedule, still.timeline.cost, still.solver, still.status)


def test_a_pipeline_plan_does_not_depend_on_how_long_its_solves_take(monkeypatch):
    """The whole pipeline's planning on a graph (`plan_simulated`: the cut model's atoms, the DP,
    every stage's search), each solve and lowest-peak search taking 60% of the time limit on the
    safety stop's clock: the same cuts and stage plans as with the clock standing still. Before,
    one stop was shared by all of it, and every stage's plan was another."""
    import fxopt.solvers.effort as effort
    import fxopt.solvers.stages.atoms as atoms
    import fxopt.solvers.stages.in_flight as in_flight

    g = chain(12)
    with pytest.raises(InfeasibleBudgetError) as err:
        st.plan_simulated(g, 2, 4, 1)
    budget = int(err.value.min_budget * 1.1)
    clock = [0.0]
    monkeypatch.setattr(effort, "now", lambda: clock[0])

    def plans():
        _, split, results, _ = st.plan_simulated(g, 2, 4, budget, time_limit=100.0)
        return split.cuts, [(r.solution.schedule, r.solution.solver, r.solution.status, r.solution.stopped)
                            for r in results]

    still = plans()

    def taking_60_s(work):
        def run(*args, **kwargs):
            try:
                return work(*args, **kwargs)
            finally:
                clock[0] += 60.0
        return run

    for module, name in ((in_flight, "solve"), (in_flight, "lowest_plan"), (atoms, "lowest_plan")):
        monkeypatch.setattr(module, name, taking_60_s(getattr(module, name)))
    assert plans() == still
    assert clock[0] >= 10 * 100.0


def test_a_stopped_stage_search_says_so(monkeypatch):
    """Where a solve of the search does reach its own stop, the stage's plan names the phases it
    stopped and one `SolverTimeoutWarning` says so (the planner then does not cache it)."""
    import fxopt.solvers.effort as effort
    from fxopt.solvers import SolverTimeoutWarning
    from clocks import FastClock

    g, stage = chain(12), st.InFlight(3, held_bytes=16, fixed_bytes=40)
    budget = int(stage.device_peak(g, st.eager_schedule(g)) * 0.7)
    monkeypatch.setattr(effort, "now", FastClock(1e6))
    with pytest.warns(SolverTimeoutWarning, match="per solve") as warned:
        sol = st.solve_stage(g, budget, stage, time_limit=1.0)
    assert sol.stopped and len([w for w in warned if w.category is SolverTimeoutWarning]) == 1
    assert stage.device_peak(g, sol.schedule, sol.timeline) <= budget


def test_plan_simulated_every_stage_within_the_budget():
    g = chain(8)
    with pytest.raises(InfeasibleBudgetError) as err:
        st.plan_simulated(g, 4, 4, 150)
    least = err.value.min_budget
    assert least > 150
    model, split, results, timing = st.plan_simulated(g, 4, 4, least)
    assert len(split.cuts) == 3
    assert all(r.device_bytes <= least for r in results)
    assert [r.in_flight.microbatches for r in results] == [4, 3, 2, 1]
    assert 0 < timing.bubble < 1
