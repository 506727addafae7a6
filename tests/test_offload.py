"""OFFLOAD in the torch-free solvers: the simulator's clock and copy channels, the offload-first
completion, `solve` and `Plan` (no tensors).

Every expected number below is worked out by hand in the comments, with the simulator's rules
(`fxopt.solvers.schedule`, `fxopt.solvers.transfers`) on top of the memory rules of
``test_schedule.py``:
  - the clock advances by each node's cost (its seconds) and by stalls;
  - an offload is queued on the D2H channel after the value's last forward use; its device memory
    counts until the copy completes (let go before the first allocation at or after that time);
  - a reload is queued on the H2D channel at its reload point (not before the offload completed)
    and takes its device memory at issue; the first backward read waits for it (exposed time);
  - each channel serves one copy at a time, in the order issued.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers import SOLVERS, solve
from fxopt.solvers.auto import eager_schedule
from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import HEURISTICS, offload_to_fit, offload_windows
from fxopt.solvers.instant import instant_solve, peak_lower_bound
from fxopt.solvers.plan import Plan
from fxopt.solvers.schedule import InvalidScheduleError, Schedule, on_demand, save_all_set, simulate
from fxopt.solvers.transfers import INSTANT, PCIE_GEN4_X16_BYTES_PER_S, Transfers, host_peak_bytes
from solver_graphs import HAND_GRAPHS, GraphBuilder, chain, chain_inputs, ids, random_training_graph


def line() -> Graph:
    """x 8 (resident), tan 1 (tangent); every node costs 1 s.

        a = f(x) 16 | b = f(a) 16 | d = f(b) 2 | c = f(d) 64 | loss = f(c) 1 (output)
        g_c = f(tan) 16 | g_b = f(g_c) 16 | g_a = f(g_b, a) 8 (gradient)

    Only ``a`` is SAVEd. Clock: a [0,1], b [1,2], d [2,3], c [3,4], loss [4,5]; the backward starts
    at 5: g_c [5,6], g_b [6,7], g_a [7,8]. ``a``'s last forward use is b: its offload is issued at 2.
    Without OFFLOAD: a 24, b 40, d 42 (-b: 26), c 90 (-d: 88), loss 89 (-c: 25) -> forward peak 90;
    backward start 8 + loss 1 + a 16 + tan 1 = 26, g_c 42, g_b 58 (-g_c: 42), g_a 50 -> 58.
    """
    b = GraphBuilder()
    b.input("x", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("a", ["x"], 16)
    b.fwd("b", ["a"], 16)
    b.fwd("d", ["b"], 2)
    b.fwd("c", ["d"], 64)
    b.fwd("loss", ["c"], 1, output=True)
    b.bwd("g_c", ["tan"], 16, cost=1.0)
    b.bwd("g_b", ["g_c"], 16, cost=1.0)
    b.bwd("g_a", ["g_b", "a"], 8, output=True, cost=1.0)
    return b.build()


def offloading(graph: Graph, d2h: float, h2d: float, reload_at: dict[str, int] | None = None, *, offload=("a",),
               host_budget: int | None = None):
    """The eager schedule of ``graph`` with ``offload`` OFFLOADed, at these bandwidths; simulated."""
    g = graph.with_transfers(Transfers(d2h, h2d, host_budget))
    s = eager_schedule(g)
    at = tuple((ids(g, name)[0], p) for name, p in (reload_at or {}).items())
    s = dataclasses.replace(s, offloaded=frozenset(ids(g, *offload)), reload_at=at)
    return g, s, simulate(g, s)


def event(timeline, name: str) -> int:
    return next(b for _, n, b in timeline.events if n == name)


# ------------------------------------------------------------------ the simulator, by hand
def test_without_offload_the_clock_changes_nothing():
    g = line()
    s = eager_schedule(g)
    plain = simulate(g, s)
    assert plain.peak_bytes == 90 and plain.backward_peak_bytes == 58
    assert simulate(g.with_transfers(Transfers()), s) == plain
    assert plain.exposed_transfer_seconds == 0 and plain.host_peak_bytes == 0 and plain.copies == ()
    assert plain.cost == plain.recompute_cost
    # No OFFLOAD keys in what was there before: the plan cache's keys and old plans stay the same.
    assert set(s.to_dict()) == {"saved", "backward", "compressed"} and set(g.to_dict()) == {"nodes"}


def test_offload_needs_transfers_and_an_offloadable_saved_value():
    g = line()
    s = eager_schedule(g)
    with pytest.raises(InvalidScheduleError, match="no transfers"):
        simulate(g, dataclasses.replace(s, offloaded=frozenset(ids(g, "a"))))
    assert g.offloadable == frozenset()
    gt = g.with_transfers(Transfers())
    assert gt.offloadable == frozenset(ids(g, "a", "b", "d", "c"))  # not the output, not the inputs
    with pytest.raises(InvalidScheduleError, match="not saved"):
        simulate(gt, dataclasses.replace(s, offloaded=frozenset(ids(g, "b"))))
    with pytest.raises(InvalidScheduleError, match="reload points"):
        simulate(gt, dataclasses.replace(s, offloaded=frozenset(ids(g, "a")), reload_at=((ids(g, "a")[0], 9),)))


def test_device_memory_is_freed_only_when_the_copy_completes():
    # 16 B/s: a's copy runs [2,3], done when c allocates at 3: c 90 - 16 = 74; loss 73.
    _, _, fast = offloading(line(), d2h=16, h2d=16)
    assert event(fast, "c") == 74 and event(fast, "loss") == 73 and fast.forward_peak_bytes == 74
    # 8 B/s: the copy runs [2,4]; at c (3) a still counts: 90; at loss (4) it is gone: 73.
    _, _, slow = offloading(line(), d2h=8, h2d=16)
    assert event(slow, "c") == 90 and event(slow, "loss") == 73 and slow.forward_peak_bytes == 90
    assert [(c.channel, c.start, c.end) for c in slow.copies][0] == ("d2h", 2.0, 4.0)
    # At the end of the forward (5) the copy is done: a is not among the bytes saved on the device.
    assert fast.saved_bytes == 0 and simulate(line(), eager_schedule(line())).saved_bytes == 16


def test_a_reload_early_enough_does_not_stall():
    # Default point: g_a starts 2 s into the backward and the copy takes 1 s, so it is issued before
    # g_b (at 6), runs [6,7], and is back when g_a starts at 7. Backward: start 8 + 1 + 1 = 10,
    # g_c 26, reload a 42, g_b 58 (-g_c: 42), g_a 50 -> 58.
    g, _, t = offloading(line(), d2h=16, h2d=16)
    a = ids(g, "a")[0]
    assert t.reload_at == ((a, 1),)
    assert t.exposed_transfer_seconds == 0.0 and t.cost == 0.0
    assert event(t, "<start>") == 10 and event(t, "reload a") == 42 and t.backward_peak_bytes == 58
    assert t.peak_bytes == 74  # 90 without OFFLOAD
    reload = t.copies[1]
    assert (reload.channel, reload.issued, reload.start, reload.end, reload.needed) == ("h2d", 6.0, 6.0, 7.0, 7.0)
    # The same point given by the plan gives the same timeline.
    assert offloading(line(), 16, 16, {"a": 1})[2] == t


def test_a_reload_issued_too_late_stalls():
    # Issued just before g_a (7): the copy runs [7,8] and g_a waits 1 s, exposed: the plan's cost.
    # The backward holds a only from then: g_c 26, g_b 42 (-g_c: 26), reload a 42, g_a 50.
    _, _, t = offloading(line(), 16, 16, {"a": 2})
    assert t.exposed_transfer_seconds == 1.0 and t.cost == 1.0 and t.copies[1].exposed == 1.0
    assert t.backward_peak_bytes == 50
    with pytest.raises(InvalidScheduleError, match="after the backward first reads"):
        offloading(two_values(), 16, 16, {"p": 3}, offload=("p",))  # g_p, at 2, reads p


def test_a_slow_reload_starts_with_the_backward_and_still_stalls():
    # 4 B/s: 4 s of copy for 2 s of compute before g_a: issued at the backward's start (5), [5,9];
    # g_a waits from 7 to 9.
    g, _, t = offloading(line(), d2h=16, h2d=4)
    assert t.reload_at == ((ids(g, "a")[0], 0),)
    assert t.exposed_transfer_seconds == 2.0


def test_a_reload_waits_for_its_offload_and_both_copies_count():
    # 1 B/s down: the offload runs [2,18]. The reload, issued at 6, starts at 18, ends at 19: g_a
    # waits from 7 to 19. Meanwhile a is on the device twice: reload a 26 + 16 + 16 = 58, g_b 74.
    _, _, t = offloading(line(), d2h=1, h2d=16)
    assert (t.copies[1].start, t.copies[1].end) == (18.0, 19.0)
    assert t.exposed_transfer_seconds == 12.0
    assert event(t, "reload a") == 58 and t.backward_peak_bytes == 74


def two_values() -> Graph:
    """x 8, tan 1; p = f(x) 16 [0,1] | q = f(x) 16 [1,2] | r = f(p, q) 4 [2,3] | loss = f(r) 1 [3,4];
    backward from 4: g_r 4 [4,5] | g_q = f(g_r, q) [5,6] | g_p = f(g_r, p) [6,7] | g_x [7,8]."""
    b = GraphBuilder()
    b.input("x", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("p", ["x"], 16)
    b.fwd("q", ["x"], 16)
    b.fwd("r", ["p", "q"], 4)
    b.fwd("loss", ["r"], 1, output=True)
    b.bwd("g_r", ["tan"], 4, cost=1.0)
    b.bwd("g_q", ["g_r", "q"], 4, cost=1.0)
    b.bwd("g_p", ["g_r", "p"], 4, cost=1.0)
    b.bwd("g_x", ["g_p", "g_q"], 8, output=True, cost=1.0)
    return b.build()


def test_each_channel_serves_one_copy_at_a_time_in_order():
    # Both offloads are issued at 3 (after r): p [3,4], then q [4,5]. Reloads, planned from the
    # last first read: p before g_p (2 s in) -> [1,2] s in, issued before g_q; q before g_q -> [0,1],
    # issued at the start (4). q cannot start before its offload is done (5): [5,6], so g_q (due
    # at 5) waits 1 s; p, issued at 5, waits for the channel: [6,7], back as g_p starts at 7.
    g, _, t = offloading(two_values(), d2h=16, h2d=16, offload=("p", "q"))
    spans = [(c.channel, c.value, c.start, c.end) for c in t.copies]
    assert spans == [("d2h", "p", 3.0, 4.0), ("d2h", "q", 4.0, 5.0), ("h2d", "q", 5.0, 6.0), ("h2d", "p", 6.0, 7.0)]
    assert t.exposed_transfer_seconds == 1.0
    p, q = ids(g, "p", "q")
    assert t.reload_at == ((p, 1), (q, 0))
    # Host: both offloads hold 16 from 3; q's reload frees its 16 at 6, p's at 7.
    assert t.host_peak_bytes == 32 == host_peak_bytes(list(t.copies))
    assert not t.over_host_budget
    assert offloading(two_values(), 16, 16, offload=("p", "q"), host_budget=31)[2].over_host_budget


def test_a_compressed_offloaded_value_travels_encoded():
    g = line()
    a = ids(g, "a")[0]
    nodes = list(g.nodes)
    nodes[a] = dataclasses.replace(nodes[a], codec="int8/g64", compressed_bytes=4, codec_cost=2.0)
    g = Graph(tuple(nodes), Transfers(16, 16))
    s = dataclasses.replace(eager_schedule(g), compressed=frozenset([a]), offloaded=frozenset([a]))
    t = simulate(g, s)
    # 4 bytes each way, a quarter second; encoded at 2, [2,3], the copy [3, 3.25].
    assert [(c.channel, c.bytes) for c in t.copies] == [("d2h", 4), ("h2d", 4)]
    assert t.copies[0].start == 3.0 and t.host_peak_bytes == 4
    assert t.exposed_transfer_seconds == 0.0 and t.cost == t.recompute_cost == 2.0
    # At c (4) the encoding has left: c 90 - 16 = 74.
    assert event(t, "c") == 74
    plan = Plan.build(graph=g, schedule=s, budget_bytes=90, eager_peak_bytes=90, solver="test", status="heuristic",
                      solve_seconds=0.0, fingerprint="f")
    assert plan.decisions()["a"] == "COMPRESS+OFFLOAD" and plan.host_bytes == 4


# ------------------------------------------------------------------ offload_to_fit and solve
def test_offload_windows_are_the_compute_between_last_forward_use_and_first_read():
    g = line().with_transfers(Transfers(16, 16))
    windows = offload_windows(g, eager_schedule(g), ids(g, "a"))
    assert windows == {ids(g, "a")[0]: (16, 5.0)}  # issued at 2, read at 7


def test_offload_to_fit_offloads_only_what_it_takes():
    # chain(4) peaks at 122 in the backward (104 in the forward) with a1..a4 SAVEd. With copies of
    # 16 B in 16 us, a1 (the longest window: read last) goes first and brings it to 106, a2 to 98;
    # below that the forward's own peak and the backward's first steps are left.
    g = chain(4).with_transfers(Transfers(1e6, 1e6))
    s = eager_schedule(g)
    assert simulate(g, s).peak_bytes == 122
    for budget, offloaded, peak in ((106, ["a1"], 106), (98, ["a1", "a2"], 98)):
        schedule, t = offload_to_fit(g, s, budget)
        assert sorted(g.nodes[i].name for i in schedule.offloaded) == offloaded
        assert t.peak_bytes == peak and t.exposed_transfer_seconds == 0.0
    assert offload_to_fit(g, s, 94) is None
    assert offload_to_fit(g.with_transfers(Transfers(1e6, 1e6, host_budget=16)), s, 98) is None  # 32 B on the host
    # Copies longer than the windows cannot take a value off the device at all: none is tried.
    assert offload_to_fit(g.with_transfers(Transfers(1.0, 1.0)), s, 106) is None


def expensive_chain() -> Graph:
    """chain(6) with recomputation ten times as expensive (20 s and 10 s a layer)."""
    g = chain(6)
    return Graph(tuple(dataclasses.replace(n, cost=10 * n.cost) if n.kind == "forward" else n for n in g.nodes))


def test_the_solver_offloads_when_bandwidth_hides_it_and_recomputes_when_not():
    g = expensive_chain()
    eager = simulate(g, eager_schedule(g)).peak_bytes
    budget = int(0.8 * eager)
    recompute_only = solve(g, budget, time_limit=5)
    assert recompute_only.timeline.recompute_cost > 0 and not recompute_only.schedule.offloaded
    assert recompute_only.lower_bound_cost is not None
    fast = solve(g.with_transfers(Transfers(1e6, 1e6)), budget, time_limit=5)
    assert fast.schedule.offloaded and fast.timeline.cost == 0.0 < recompute_only.timeline.cost
    # the instant program relaxes OFFLOAD (copies free), so its bound holds, here proving the plan
    assert fast.bound_source == "instant" and fast.lower_bound_cost == 0.0
    slow = solve(g.with_transfers(Transfers(0.01, 0.01)), budget, time_limit=5)
    assert not slow.schedule.offloaded and slow.timeline.cost == pytest.approx(recompute_only.timeline.cost)
    # OFFLOAD was offered: only the instant program's bound, which counts copies free, holds
    assert slow.bound_source == "instant" and slow.lower_bound_cost <= slow.timeline.cost


def test_the_peak_floor_holds_with_offload():
    # A value is on the device while a backward node reads it, however it got there.
    g = expensive_chain().with_transfers(Transfers(1e9, 1e9))
    floor, _ = peak_lower_bound(g)
    with pytest.raises(InfeasibleBudgetError):
        solve(g, floor - 1, time_limit=5)


# ------------------------------------------------------------------ Plan
def test_plan_reports_offload_and_round_trips():
    g = line().with_transfers(Transfers(16, 16))
    s = dataclasses.replace(eager_schedule(g), offloaded=frozenset(ids(g, "a")))
    plan = Plan.build(graph=g, schedule=s, budget_bytes=80, eager_peak_bytes=90, solver="test", status="heuristic",
                      solve_seconds=0.0, fingerprint="f")
    assert plan.offloaded == ("a",) and plan.host_bytes == 16 and plan.exposed_transfer_seconds == 0.0
    assert plan.decisions()["a"] == "OFFLOAD" and plan.peak_bytes == 74
    assert plan.schedule.reload_at == ((ids(g, "a")[0], 1),)  # the default point, pinned
    assert "1 offloaded" in plan.summary()
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()
    assert again.graph.transfers == Transfers(16, 16) and again.timeline() == plan.timeline()
    assert json.loads(plan.to_json())["format_version"] == 3


def test_plan_without_offload_reports_none():
    g = line()
    plan = Plan.build(graph=g, schedule=eager_schedule(g), budget_bytes=90, eager_peak_bytes=90, solver="test",
                      status="heuristic", solve_seconds=0.0, fingerprint="f")
    assert plan.offloaded == () and plan.host_bytes == 0 and "OFFLOAD" not in plan.decisions().values()
    assert plan.cost == plan.recompute_cost


def test_transfers_defaults_and_checks():
    t = Transfers()
    assert t.d2h_bytes_per_s == t.h2d_bytes_per_s == PCIE_GEN4_X16_BYTES_PER_S == 20e9
    assert t.host_budget is None and Transfers.from_dict(t.to_dict()) == t
    for bad in (dict(d2h_bytes_per_s=0), dict(h2d_bytes_per_s=-1.0), dict(host_budget=-1)):
        with pytest.raises(ValueError):
            Transfers(**bad)


# ------------------------------------------------------------------ random graphs
PROPERTY = settings(max_examples=int(os.environ.get("FXOPT_EXAMPLES", 40)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
BANDWIDTHS = st.sampled_from([0.5, 4.0, 16.0, 64.0, 1e9])


def test_the_ilp_offloads_where_the_link_hides_the_copies():
    """expensive_chain at 80% of its eager peak (129 B): without OFFLOAD the ILP's optimum
    recomputes one layer's activation three times (90 s); over a link that moves its 16 B values
    in microseconds it offloads instead, costs nothing, and the plan it returns is what the
    simulator says (within the budget, no stall). Over 1 B/s a 16 B copy takes 16 s, longer than
    twice the whole backward (18 nodes of 0.04-0.16 s), so no value gets an OFFLOAD variable."""
    from fxopt.solvers.ilp import build_ilp, solve_ilp

    g = expensive_chain()
    budget = int(0.8 * simulate(g, eager_schedule(g)).peak_bytes)
    assert budget == 129
    assert solve_ilp(g, budget, time_limit=10).objective == pytest.approx(90.0)
    fast = g.with_transfers(Transfers(1e6, 1e6))
    res = solve_ilp(fast, budget, time_limit=10)
    t = simulate(fast, res.schedule)
    assert res.status == "optimal" and res.objective == pytest.approx(0.0) and res.schedule.offloaded
    assert t.peak_bytes <= budget and t.exposed_transfer_seconds == 0.0 and t.cost == pytest.approx(0.0)
    assert dict(res.schedule.reload_at).keys() == res.schedule.offloaded  # the model's reload points
    slow = g.with_transfers(Transfers(1.0, 1.0))
    assert not build_ilp(slow, budget).O
    assert solve_ilp(slow, budget, time_limit=10).objective == pytest.approx(90.0)


@PROPERTY
@given(data=st.data())
def test_random_ilp_plans_with_offload_fit_and_never_stall(data):
    """The ILP's OFFLOAD model is conservative: its optimal plan fits when simulated and waits
    for no copy (the channel rows keep every copy within its window), at any bandwidths, and its
    lowest-peak plan peaks no higher than it says."""
    from fxopt.solvers.ilp import solve_ilp

    graph = random_training_graph(data.draw, st)
    host_budget = data.draw(st.sampled_from([None, 0, 64]))
    g = graph.with_transfers(Transfers(data.draw(BANDWIDTHS), data.draw(BANDWIDTHS), host_budget))
    eager = simulate(g, eager_schedule(g)).peak_bytes
    lowest = solve_ilp(g, None, minimize_peak=True, time_limit=5)
    if lowest.schedule is None:
        return
    t = simulate(g, lowest.schedule)
    assert t.peak_bytes <= lowest.peak_bound + 1e-6 * eager and t.exposed_transfer_seconds < 1e-9
    assert not t.over_host_budget
    budget = int(lowest.peak_bound + data.draw(st.floats(0.0, 1.0)) * max(0, eager - lowest.peak_bound))
    res = solve_ilp(g, budget, time_limit=5)
    if res.status == "optimal":
        t = simulate(g, res.schedule)
        assert t.peak_bytes <= budget and t.exposed_transfer_seconds < 1e-9 and not t.over_host_budget
        assert t.cost <= res.objective * (1 + 1e-9) + 1e-12


@PROPERTY
@given(data=st.data())
def test_random_offloaded_schedules_obey_the_model(data):
    """Offloading every offloadable SAVEd value of the eager schedule: the copies follow the
    channel rules, the exposed time is the reloads' stalls, and with copies that take no time the
    peak never rises (a value is off the device between its offload and its reload)."""
    graph = random_training_graph(data.draw, st)
    d2h, h2d = data.draw(BANDWIDTHS), data.draw(BANDWIDTHS)
    g = graph.with_transfers(Transfers(d2h, h2d))
    s = eager_schedule(g)
    off = dataclasses.replace(s, offloaded=s.saved & g.offloadable)
    t = simulate(g, off)
    for channel in ("d2h", "h2d"):
        copies = [c for c in t.copies if c.channel == channel]
        for before, after in zip(copies, copies[1:]):
            assert after.start >= before.end and after.issued >= before.issued
        for c in copies:
            assert c.start >= c.issued and c.end >= c.start
    assert t.exposed_transfer_seconds == pytest.approx(sum(c.exposed for c in t.copies))
    assert t.host_peak_bytes <= sum(c.bytes for c in t.copies if c.channel == "d2h")
    # (Copies that take any time at all may still be in flight when the reload is issued: then
    # both buffers count, and the peak may rise. The heuristic leaves such values out.)
    free = simulate(graph.with_transfers(INSTANT), off)
    assert free.peak_bytes <= simulate(graph, s).peak_bytes
    assert free.exposed_transfer_seconds == 0.0


@PROPERTY
@given(data=st.data())
def test_random_solutions_with_transfers_fit_and_are_what_the_simulator_says(data):
    graph = random_training_graph(data.draw, st)
    host_budget = data.draw(st.sampled_from([None, 0, 16, 64]))
    g = graph.with_transfers(Transfers(data.draw(BANDWIDTHS), data.draw(BANDWIDTHS), host_budget))
    eager = simulate(g, eager_schedule(g)).peak_bytes
    floor, _ = peak_lower_bound(g)  # (below it every solver answers "infeasible" at once)
    budget = floor + int((eager - floor) * data.draw(st.floats(0.0, 1.0)))
    solver = data.draw(st.sampled_from(SOLVERS))
    try:
        solution = solve(g, budget, solver, time_limit=2)
    except InfeasibleBudgetError as err:
        assert err.min_budget > budget
        return
    t = simulate(g, solution.schedule)
    assert t == solution.timeline
    assert t.peak_bytes <= budget and not t.over_host_budget
    assert solution.schedule.offloaded <= solution.schedule.saved & g.offloadable
    if g.offloadable and solution.lower_bound_cost is not None:  # the ILP's does not hold with OFFLOAD
        # (the instant program's, or 0 where eager's schedule fits at no cost: `run_save_all_first`)
        assert solution.bound_source in ("instant", "save_all")
        assert solution.lower_bound_cost <= t.cost * (1 + 1e-9) + 1e-12


@PROPERTY
@given(data=st.data())
def test_random_instant_bound_and_proofs_hold_for_offloaded_plans(data):
    """The instant program with OFFLOAD offered: its bound is below the cost (exposed transfer
    time included) of every plan that fits, offloaded ones included, and where it proves the
    budget infeasible no plan fits, whatever the bandwidths."""
    graph = random_training_graph(data.draw, st)
    g = graph.with_transfers(Transfers(data.draw(BANDWIDTHS), data.draw(BANDWIDTHS)))
    eager = simulate(g, eager_schedule(g)).peak_bytes
    floor, _ = peak_lower_bound(g)
    budget = floor + int((eager - floor) * data.draw(st.floats(0.0, 1.0)))
    result = instant_solve(g, budget, time_limit=2)
    plans = [t for _, t in result.plans]
    for name, heuristic in HEURISTICS.items():
        for schedule, t in heuristic(g, budget):
            plans.append(t)
            done = offload_to_fit(g, schedule, budget)
            if done is not None:
                plans.append(done[1])
    fitting = [t.cost for t in plans if t.peak_bytes <= budget and not t.over_host_budget]
    if result.infeasible:
        assert not fitting
    elif result.bound is not None and fitting:
        assert result.bound <= min(fitting) * (1 + 1e-9) + 1e-12


@PROPERTY
@given(data=st.data())
def test_random_offload_completions_fit_and_are_what_the_simulator_says(data):
    graph = random_training_graph(data.draw, st)
    g = graph.with_transfers(Transfers(data.draw(BANDWIDTHS), data.draw(BANDWIDTHS)))
    s = eager_schedule(g)
    eager = simulate(g, s).peak_bytes
    floor, _ = peak_lower_bound(g)
    budget = floor + int((eager - floor) * data.draw(st.floats(0.0, 1.0)))
    done = offload_to_fit(g, s, budget)
    if done is not None:
        schedule, t = done
        assert t.peak_bytes <= budget and simulate(g, schedule) == t
        assert schedule.offloaded <= s.saved & g.offloadable and schedule.saved == s.saved
        assert t.cost == t.exposed_transfer_seconds  # the eager schedule recomputes nothing


@pytest.mark.parametrize("name", sorted(HAND_GRAPHS))
def test_hand_graphs_without_offload_simulate_the_same_with_transfers(name):
    g = HAND_GRAPHS[name]()
    s = on_demand(g, save_all_set(g))
    assert simulate(g.with_transfers(Transfers(1.0, 1.0)), s) == simulate(g, s)


def masked_chain(n: int = 6) -> Graph:
    """chain(n) with a dropout-like mask per layer: ``m_k`` (16 B, random: never recomputed) is
    read by ``a_k`` and by its backward, so every mask is SAVEd; OFFLOAD can take them away."""
    b = chain_inputs(n)
    prev = "x"
    for k in range(1, n + 1):
        b.fwd(f"h{k}", [prev, f"w{k}"], 16, cost=2.0)
        b.fwd(f"m{k}", [f"h{k}"], 16, cost=1.0, recomputable=False)
        b.fwd(f"a{k}", [f"h{k}", f"m{k}"], 16, cost=1.0)
        prev = f"a{k}"
    b.fwd("loss", [prev], 1, output=True)
    b.bwd(f"g_a{n}", ["tan"], 16)
    for k in range(n, 0, -1):
        b.bwd(f"g_h{k}", [f"g_a{k}", f"m{k}"], 16)
        b.bwd(f"g_w{k}", ["x" if k == 1 else f"a{k - 1}", f"g_h{k}"], 4, output=True)
        if k > 1:
            b.bwd(f"g_a{k - 1}", [f"g_h{k}", f"w{k}"], 16)
    return b.build()


def test_the_smallest_budget_counts_offload_where_the_link_hides_it():
    from fxopt.solvers.auto import min_feasible_budget

    g = masked_chain()
    plain = min_feasible_budget(g)  # every mask SAVEd on the device
    fast = g.with_transfers(Transfers(1e6, 1e6))
    lowest = min_feasible_budget(fast)
    assert lowest < plain
    solution = solve(fast, lowest, time_limit=5)  # the budget named plans, offloading
    assert solution.schedule.offloaded and solution.timeline.peak_bytes <= lowest
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(fast, lowest - 1, time_limit=5)
    assert err.value.min_budget == lowest
    # copies slower than any window take nothing off the device: the smallest budget is recompute's
    assert min_feasible_budget(g.with_transfers(Transfers(0.01, 0.01))) == plain
