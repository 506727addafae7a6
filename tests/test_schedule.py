"""The torch-free graph model and the simulator, on hand-built graphs (no tensors).

Every expected number below is worked out by hand in the comments, with the simulator's rules:
  - non-tangent inputs (parameters, user inputs) are resident for the whole step;
  - a value dies right after its last use (in the forward: its last forward use, unless SAVEd);
  - forward outputs and gradients (backward nodes with output=True) are never freed;
  - tangents are allocated when the backward starts and held until it returns (the autograd
    engine holds the incoming gradients);
  - a view owns no bytes but keeps its base's storage alive;
  - an op's workspace counts only while it runs.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxopt.solvers.plan import Plan
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.schedule import (
    InvalidScheduleError,
    Schedule,
    must_save,
    on_demand,
    save_all_set,
    simulate,
    with_fresh_aliases,
)
from solver_graphs import HAND_GRAPHS, GraphBuilder, diamond, ids, mlp2, random_training_graph, residual_block


def sched(graph: Graph, saved: list[str], backward: list[str]) -> Schedule:
    return Schedule(frozenset(ids(graph, *saved)), ids(graph, *backward))


def names(graph: Graph, idx) -> set[str]:
    return {graph.nodes[i].name for i in idx}


# ------------------------------------------------------------------ the graph model
@pytest.mark.parametrize(
    "make, expected",
    [
        (mlp2, dict(
            resident={"x", "w1", "w2"}, free={"x", "w1", "w2"}, aliases=set(), backward_only=set(),
            needed_by_backward={"a", "h"},  # a is read; h is what a is recomputed from
            saveable={"h", "a", "o", "loss"}, must_save=set(), save_all={"a"},
        )),
        (residual_block, dict(
            # w1t = w1.t() is a view of a parameter: resident and free to keep
            resident={"x", "w1", "w2", "w1t"}, free={"x", "w1", "w2", "w1t"},
            aliases={"hv"}, backward_only=set(),
            needed_by_backward={"a", "d", "h", "hv", "mask", "w1t"},
            saveable={"h", "a", "mask", "d", "o", "y", "loss"},  # not hv: a view is made fresh where read
            must_save={"mask"},  # random: cannot be recomputed
            save_all={"d", "h", "mask"},  # hv is a view: its base h is kept
        )),
        (diamond, dict(
            resident={"x", "w"}, free={"x", "w"}, aliases=set(),
            backward_only={"c", "s"},  # cos(p), sin(p): only the backward reads them
            needed_by_backward={"p", "l", "r", "c", "s"},
            saveable={"p", "l", "r", "m", "loss", "c", "s"}, must_save=set(),
            save_all={"l", "r", "c", "s"},  # backward-only values computable in the forward are kept
        )),
    ],
    ids=["mlp2", "residual_block", "diamond"],
)
def test_graph_classification(make, expected):
    g = make()
    assert names(g, g.resident) == expected["resident"]
    assert names(g, g.free) == expected["free"]
    assert names(g, g.aliases) == expected["aliases"]
    assert names(g, g.backward_only) == expected["backward_only"]
    assert names(g, g.needed_by_backward) == expected["needed_by_backward"]
    assert names(g, g.saveable) == expected["saveable"]
    assert names(g, must_save(g)) == expected["must_save"]
    assert names(g, save_all_set(g)) == expected["save_all"]


def test_graph_rejects_malformed_nodes():
    with pytest.raises(ValueError, match="does not precede"):
        Graph((Node("a", "forward", inputs=(1,)), Node("b", "input")))
    with pytest.raises(ValueError, match="does not precede"):
        Graph((Node("a", "forward", inputs=(0,)), Node("b", "input")))  # reads itself
    with pytest.raises(ValueError, match="aliases storage"):
        Graph((Node("x", "input", bytes=4), Node("v", "forward", inputs=(0,), storage=2)))
    with pytest.raises(ValueError, match="tangent but not an input"):
        Graph((Node("x", "input", bytes=4), Node("t", "forward", inputs=(0,), tangent=True)))


def test_roots_follow_view_chains():
    b = GraphBuilder()
    b.input("x", 8)
    b.fwd("a", ["x"], 16)
    b.fwd("v1", ["a"], view_of="a")
    b.fwd("v2", ["v1"], view_of="v1")
    g = b.build()
    a, v1, v2 = ids(g, "a", "v1", "v2")
    assert g.roots[v2] == g.roots[v1] == a
    assert g.nodes[v2].bytes == 0


# ------------------------------------------------------------------ simulate: hand-computed timelines
# mlp2:  x 8, w1 4, w2 4 (inputs: 16 resident), tan 1 (tangent)
#        h = x@w1 16 | a = relu(h) 16 | o = a@w2 32 | loss = sum(o) 1 (forward output)
#        g_o 32 | g_w2 4 (grad) | g_a 16 | g_h 16 | g_w1 4 (grad)
# Forward with a SAVEd: h 32, a 48 (-h: 32), o 64, loss 65 (-o: 33)           -> forward peak 65
# Forward with nothing saved: h 32, a 48 (-h), o 64 (-a: 48), loss 49 (-o: 17)  -> forward peak 64
# Forward with h SAVEd: h 32, a 48, o 80 (-a: 64), loss 65 (-o: 33)            -> forward peak 80
MLP2_CASES = {
    # eager: backward starts at 33 + tan 1 = 34; g_o 66; g_w2 70; g_a 86 (-g_o: 54);
    # g_h 70 (-g_a, -a: 38); g_w1 42 (-g_h: 26)
    "save_a": (["a"], ["g_o", "g_w2", "g_a", "g_h", "g_w1"], dict(
        peak_bytes=86, forward_peak_bytes=65, backward_peak_bytes=86, saved_bytes=16, recompute_flops=0,
        recompute_cost=0.0)),
    # recompute h, a before g_w2 and keep a: start 18; g_o 50; h 66; a 82 (-h: 66); g_w2 70;
    # g_a 86 (-g_o: 54); g_h 70 (-g_a, -a: 38); g_w1 42.  Extra flops: h 200 + a 16
    "recompute_once": ([], ["g_o", "h", "a", "g_w2", "g_a", "g_h", "g_w1"], dict(
        peak_bytes=86, forward_peak_bytes=64, backward_peak_bytes=86, saved_bytes=0, recompute_flops=216,
        recompute_cost=3.0)),
    # save h, recompute a from it: start 34; g_o 66; a 82 (-h: 66); g_w2 70; g_a 86 (-g_o: 54);
    # g_h 70 (-g_a, -a: 38); g_w1 42.  Extra flops: a 16
    "save_h": (["h"], ["g_o", "a", "g_w2", "g_a", "g_h", "g_w1"], dict(
        peak_bytes=86, forward_peak_bytes=80, backward_peak_bytes=86, saved_bytes=16, recompute_flops=16,
        recompute_cost=1.0)),
    # recompute h, a twice, the first time before g_o: start 18; h 34; a 50 (-h: 34); g_o 66;
    # g_w2 70 (-a: 54); g_a 70 (-g_o: 38); h 54; a 70 (-h: 54); g_h 70 (-g_a, -a: 38); g_w1 42.
    # Extra flops: 2 * (200 + 16).  (70 is the least any schedule can do: g_w2 needs g_o 32, a 16
    # and its own 4 on top of the 18 always there.)
    "recompute_twice_early": ([], ["h", "a", "g_o", "g_w2", "g_a", "h", "a", "g_h", "g_w1"], dict(
        peak_bytes=70, forward_peak_bytes=64, backward_peak_bytes=70, saved_bytes=0, recompute_flops=432,
        recompute_cost=6.0)),
    # the same, recomputing after g_o: a is allocated while g_o 32 and h 16 are alive:
    # start 18; g_o 50; h 66; a 82 (-h: 66); g_w2 70 (-a: 54); g_a 70 (-g_o: 38); h 54; a 70;
    # g_h 70; g_w1 42
    "recompute_twice_late": ([], ["g_o", "h", "a", "g_w2", "g_a", "h", "a", "g_h", "g_w1"], dict(
        peak_bytes=82, forward_peak_bytes=64, backward_peak_bytes=82, saved_bytes=0, recompute_flops=432,
        recompute_cost=6.0)),
}

# residual_block: x 8, w1 4, w2 4 (16 resident), tan 1; w1t = view(w1) 0; h 16; hv = view(h) 0;
#   a 16; mask 2 (random); d 16; o 8; y 8; loss 1 | g_y 8, g_w2 4 (grad), g_d 16, g_a 16, g_h 16,
#   g_w1 4 (grad)
RESIDUAL_CASES = {
    # Forward, keeping h, mask, d: w1t 16 (no bytes), h 32, hv 32, a 48 (-hv: h still kept),
    # mask 50, d 66 (-a: 50), o 58, y 66 (-o: 58), loss 59 (-y: 51)
    # Backward: start 51 + tan = 52; g_y 60; g_w2 64 (-d: 48); g_d 64 (-g_y: 56);
    # g_a 72 (-g_d, -mask: 54); hv 54 (a fresh view of h); g_h 70 (-g_a, -hv: h freed: 38); g_w1 42
    "eager": (["h", "mask", "d"], ["g_y", "g_w2", "g_d", "g_a", "hv", "g_h", "g_w1"], dict(
        peak_bytes=72, forward_peak_bytes=66, backward_peak_bytes=72, saved_bytes=34, recompute_flops=0,
        recompute_cost=0.0)),
    # Keep only the random mask. Forward: w1t 16, h 32, hv 32 (-h: the view keeps it), a 48
    # (-hv: h freed: 32), mask 34, d 50 (-a: 34), o 42 (-d: 26), y 34 (-o: 26), loss 27 (-y: 19).
    # Backward: start 20; g_y 28; w1t 28; h 44; hv 44; a 60 (-hv: h kept by the later hv);
    # d 76 (-a: 60); g_w2 64 (-d: 48); g_d 64 (-g_y: 56); g_a 72 (-g_d, -mask: 54); hv 54;
    # g_h 70 (-g_a, -hv: 38); g_w1 42.  Extra flops: h 300 + a 16 + d 16 (views cost none)
    "keep_mask": (["mask"], ["g_y", "w1t", "h", "hv", "a", "d", "g_w2", "g_d", "g_a", "hv", "g_h", "g_w1"], dict(
        peak_bytes=76, forward_peak_bytes=50, backward_peak_bytes=76, saved_bytes=2, recompute_flops=332,
        recompute_cost=5.0)),
}

# diamond: x 8, w 8 (16 resident), tan 1; p 16, l = sin(p) 16, r = cos(p) 16, m = l*r 16, loss 1;
#   c = cos(p) 16 and s = sin(p) 16 are backward-only | g_m, g_l, g_r, g_p1, g_p2, g_p 16, g_w 8 (grad)
DIAMOND_CASES = {
    # Forward keeping p, l, r: p 32, l 48, r 64, m 80, loss 81 (m still alive while loss runs; -m: 65).
    # Backward: start 66; g_m 82; g_l 98 (-r: 82); g_r 98 (-g_m, -l: 66); c 82;
    # g_p1 98 (-c, -g_l: 66); s 82 (-p: 66); g_p2 82 (-s, -g_r: 50); g_p 66 (-g_p1, -g_p2: 34);
    # g_w 42. c and s are computed once in the backward, which is not a recomputation.
    "keep_p_l_r": (["p", "l", "r"], ["g_m", "g_l", "g_r", "c", "g_p1", "s", "g_p2", "g_p", "g_w"], dict(
        peak_bytes=98, forward_peak_bytes=81, backward_peak_bytes=98, saved_bytes=48, recompute_flops=0,
        recompute_cost=0.0)),
    # Keeping c and s computes them in the forward, after loss: p 32, l 48, r 64, m 80, loss 81
    # (-m: 65), c 81, s 97 (-p: 81).  Backward: start 82; g_m 98; g_l 114 (-r: 98);
    # g_r 114 (-g_m, -l: 82); g_p1 98 (-g_l, -c: 66); g_p2 82 (-g_r, -s: 50); g_p 66 (34); g_w 42
    "keep_l_r_c_s": (["l", "r", "c", "s"], ["g_m", "g_l", "g_r", "g_p1", "g_p2", "g_p", "g_w"], dict(
        peak_bytes=114, forward_peak_bytes=97, backward_peak_bytes=114, saved_bytes=64, recompute_flops=0,
        recompute_cost=0.0)),
    # Keep only p: forward p 32, l 48, r 64, m 80 (-l, -r: 48), loss 49 (-m: 33).
    # Backward: start 34; g_m 50; r 66; g_l 82 (-r: 66); l 82; g_r 98 (-g_m, -l: 66); c 82;
    # g_p1 98 (-g_l, -c: 66); s 82 (-p: 66); g_p2 82 (-g_r, -s: 50); g_p 66 (34); g_w 42.
    # Extra flops: r 64 + l 64 (c and s: first computation, free)
    "keep_p": (["p"], ["g_m", "r", "g_l", "l", "g_r", "c", "g_p1", "s", "g_p2", "g_p", "g_w"], dict(
        peak_bytes=98, forward_peak_bytes=80, backward_peak_bytes=98, saved_bytes=16, recompute_flops=128,
        recompute_cost=8.0)),
    # Computing c twice in a row: nothing reads the first copy, so the generated code drops it
    # (dead-code elimination) and the simulator neither runs nor counts it.
    "c_twice": (["p"], ["g_m", "r", "g_l", "l", "g_r", "c", "c", "g_p1", "s", "g_p2", "g_p", "g_w"], dict(
        recompute_flops=128, recompute_cost=8.0)),
}

TIMELINE_CASES = [
    pytest.param(make, saved, backward, expected, id=f"{make.__name__}-{name}")
    for make, cases in [(mlp2, MLP2_CASES), (residual_block, RESIDUAL_CASES), (diamond, DIAMOND_CASES)]
    for name, (saved, backward, expected) in cases.items()
]


@pytest.mark.parametrize("make, saved, backward, expected", TIMELINE_CASES)
def test_simulate_hand_computed(make, saved, backward, expected):
    g = make()
    timeline = simulate(g, sched(g, saved, backward))
    got = {k: getattr(timeline, k) for k in expected}
    assert got == pytest.approx(expected)
    assert timeline.peak_bytes == max(timeline.forward_peak_bytes, timeline.backward_peak_bytes)


def test_simulate_events_recompute_twice():
    g = mlp2()
    timeline = simulate(g, sched(g, [], ["h", "a", "g_o", "g_w2", "g_a", "h", "a", "g_h", "g_w1"]))
    assert timeline.events == (
        ("forward", "h", 32), ("forward", "a", 48), ("forward", "o", 64), ("forward", "loss", 49),
        ("backward", "<start>", 18),
        ("backward", "h", 34), ("backward", "a", 50), ("backward", "g_o", 66), ("backward", "g_w2", 70),
        ("backward", "g_a", 70), ("backward", "h", 54), ("backward", "a", 70), ("backward", "g_h", 70),
        ("backward", "g_w1", 42),
    )


def _two_layer(**fwd_overrides) -> Graph:
    """x 8 (input), tan 4 (tangent); a = f(x) 16; y = g(a) 32 (forward output);
    backward: g_a = f(tan, a) 16; g_x = f(g_a) 8 (gradient)."""
    b = GraphBuilder()
    b.input("x", 8)
    b.input("tan", 4, tangent=True)
    b.fwd("a", ["x"], 16, **fwd_overrides)
    b.fwd("y", ["a"], 32, output=True)
    b.bwd("g_a", ["tan", "a"], 16)
    b.bwd("g_x", ["g_a"], 8, output=True)
    return b.build()


def test_forward_output_and_gradient_never_freed_tangent_held():
    g = _two_layer()
    timeline = simulate(g, sched(g, ["a"], ["g_a", "g_x"]))
    # forward: a 24, y 56 (forward peak; the tangent is not allocated yet)
    # backward: start 56 + tan 4 = 60; g_a 76 (-a: 60); g_x 68 (-g_a: 52)
    # y (forward output), tan (held) and g_x (gradient) are all still counted at the end.
    assert timeline.forward_peak_bytes == 56
    assert timeline.events[-3:] == (("backward", "<start>", 60), ("backward", "g_a", 76), ("backward", "g_x", 68))
    assert timeline.peak_bytes == 76


def test_workspace_counts_only_while_the_op_runs():
    g = _two_layer(workspace=100)
    timeline = simulate(g, sched(g, ["a"], ["g_a", "g_x"]))
    # a runs with 100 bytes of scratch: 8 + 16 + 100 = 124; gone when y runs (56)
    assert timeline.events[:2] == (("forward", "a", 124), ("forward", "y", 56))
    assert timeline.forward_peak_bytes == 124
    assert timeline.backward_peak_bytes == 76


def test_view_keeps_base_alive():
    b = GraphBuilder()
    b.input("x", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("a", ["x"], 16)
    b.fwd("v", ["a"], view_of="a")
    b.fwd("y", ["v"], 32, output=True)
    b.bwd("g_y", ["tan", "v"], 4)
    b.bwd("g_x", ["g_y"], 8, output=True)
    g = b.build()
    # Saving a (the base) and making v fresh in the backward: a 24, v 24 (no bytes), y 56 (-v).
    # Backward: start 57 (tan 1); v 57 (-a: v still holds it); g_y 61 (-v: storage freed: 45); g_x 53
    timeline = simulate(g, sched(g, ["a"], ["v", "g_y", "g_x"]))
    assert [e[2] for e in timeline.events] == [24, 24, 56, 57, 57, 61, 53]
    # A view is never SAVEd (it would keep the same 16 bytes of a alive and save making it again,
    # a step every schedule pays and the lower bounds count): the simulator refuses it.
    with pytest.raises(InvalidScheduleError, match="a view"):
        simulate(g, sched(g, ["v"], ["g_y", "g_x"]))


def test_a_view_is_made_again_only_when_its_base_is():
    """A view read twice is made once while its base's copy is the same (reading it again holds
    no more memory: its storage is the base's), and again after the base is recomputed."""
    b = GraphBuilder()
    b.input("x", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("a", ["x"], 16)
    b.fwd("v", ["a"], view_of="a")
    b.fwd("y", ["v"], 32, output=True)
    b.bwd("g1", ["tan", "v"], 4)
    b.bwd("g2", ["g1", "v"], 4)
    b.bwd("g3", ["g2", "v"], 8, output=True)
    g = b.build()
    idx = {n.name: i for i, n in enumerate(g.nodes)}
    names = lambda events: [g.nodes[i].name for i in events]  # noqa: E731
    assert names(with_fresh_aliases(g, [idx["g1"], idx["g2"], idx["g3"]])) == ["v", "g1", "g2", "g3"]
    assert names(with_fresh_aliases(g, [idx["g1"], idx["g2"], idx["a"], idx["g3"]])) == ["v", "g1", "g2", "a", "v", "g3"]


def test_tuple_holds_its_outputs_while_it_lives():
    """A multi-output op's tuple holds every output it made (the generated code takes them out
    with getitem, but the tuple keeps a reference): keeping the tuple alive to take an output out
    again later keeps that output alive in between, and taking it out again is the same tensor."""
    b = GraphBuilder()
    b.input("x", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("t", ["x"], 0, tensor=False)  # e.g. native_layer_norm: (out, mean, rstd)
    b.fwd("o", ["t"], 16)
    b.fwd("m", ["t"], 2)
    b.fwd("y", ["o"], 4, output=True)
    b.bwd("g1", ["tan", "m"], 20)
    b.bwd("g2", ["g1"], 4)
    b.bwd("g3", ["g2", "o"], 4)
    b.bwd("g_x", ["g3"], 8, output=True)
    g = b.build()
    assert names(g, g.tuple_items) == {"o", "m"}
    # The backward recomputes t, takes o out (unread: the tuple's outputs come out together) and
    # m, and takes o out of the same t again for g3. forward: t 8, o 24, y 28 (-o: 12).
    # backward: start 13 (tan); t 13; o 29 (held by t); m 31; g1 51 (-m: still held by t);
    # g2 55 (-g1: 35); o 35 (the same tensor; -t: m freed, 33); g3 37 (-g2, -o: 17); g_x 25.
    timeline = simulate(g, sched(g, [], ["t", "o", "m", "g1", "g2", "o", "g3", "g_x"]))
    assert [e[2] for e in timeline.events] == [8, 24, 28, 13, 13, 29, 31, 51, 55, 35, 37, 25]
    assert timeline.peak_bytes == 55


# ------------------------------------------------------------------ on_demand, the schedule builder
def test_on_demand_recomputes_just_before_first_use():
    g = mlp2()
    assert on_demand(g, []) == sched(g, [], ["g_o", "h", "a", "g_w2", "g_a", "g_h", "g_w1"])
    assert on_demand(g, save_all_set(g)) == sched(g, ["a"], ["g_o", "g_w2", "g_a", "g_h", "g_w1"])


def test_on_demand_makes_views_fresh_and_keeps_random_values():
    g = residual_block()
    schedule = on_demand(g, [])
    # mask cannot be recomputed: it is saved whatever was asked; w1t is free (a view of w1).
    assert names(g, schedule.saved) == {"mask", "w1t"}
    # hv is never saved: it is made from h right before its first reader, and read again by the
    # second (h is the same copy; its storage is alive either way).
    assert [g.nodes[i].name for i in schedule.backward] == [
        "g_y", "h", "hv", "a", "d", "g_w2", "g_d", "g_a", "g_h", "g_w1"]
    assert simulate(g, schedule).peak_bytes == 76  # as the "keep_mask" case above


@pytest.mark.parametrize("make", list(HAND_GRAPHS.values()), ids=list(HAND_GRAPHS))
def test_eager_schedule_recomputes_nothing(make):
    g = make()
    schedule = on_demand(g, save_all_set(g))
    timeline = simulate(g, schedule)
    assert timeline.recompute_flops == 0
    assert timeline.recompute_cost == 0.0
    forward_recomputed = [i for i in schedule.recomputed(g) if i not in g.aliases]
    assert set(forward_recomputed) <= g.backward_only
    assert len(forward_recomputed) == len(set(forward_recomputed))


# ------------------------------------------------------------------ invalid schedules
INVALID = [
    # (graph, saved, backward, message pattern)
    pytest.param(mlp2, [], ["g_o", "g_w2", "g_a", "g_h", "g_w1"], "a is not available", id="missing-value"),
    pytest.param(mlp2, [], ["g_o", "a", "h", "g_w2", "g_a", "g_h", "g_w1"], "h is not available",
                 id="recompute-before-its-input"),
    pytest.param(mlp2, ["a"], ["g_o", "g_w2", "g_a", "g_h"], "every backward node once", id="skipped-backward-node"),
    pytest.param(mlp2, ["a"], ["g_o", "g_a", "g_w2", "g_h", "g_w1"], "in graph order", id="reordered-backward"),
    pytest.param(mlp2, ["a"], ["g_o", "g_w2", "g_w2", "g_a", "g_h", "g_w1"], "once", id="repeated-backward-node"),
    pytest.param(mlp2, ["a", "g_o"], ["g_o", "g_w2", "g_a", "g_h", "g_w1"], "cannot save g_o", id="save-backward-node"),
    pytest.param(mlp2, ["a", "tan"], ["g_o", "g_w2", "g_a", "g_h", "g_w1"], "cannot save tan", id="save-tangent"),
    pytest.param(residual_block, ["mask", "d"], ["g_y", "g_w2", "g_d", "g_a", "hv", "g_h", "g_w1"],
                 "h is not available", id="view-of-unavailable-base"),
]


@pytest.mark.parametrize("make, saved, backward, message", INVALID)
def test_invalid_schedules_raise(make, saved, backward, message):
    g = make()
    with pytest.raises(InvalidScheduleError, match=message):
        simulate(g, sched(g, saved, backward))


def _backward_only_chain() -> Graph:
    """p = x*w; loss = sum(p); c = cos(p) and nc = -c are backward-only (nc reads c, which the
    forward never computes, so nc cannot be saved); t = a tuple (non-tensor) and its getitem t0."""
    b = GraphBuilder()
    b.input("x", 8)
    b.input("w", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("p", ["x", "w"], 16)
    b.fwd("t", ["p"], 0, tensor=False)
    b.fwd("t0", ["t"], 16, cost=0.0)
    b.fwd("loss", ["t0"], 1, output=True)
    b.fwd("c", ["p"], 16)
    b.fwd("nc", ["c"], 16)
    b.bwd("g_t0", ["tan"], 16)
    b.bwd("g_p", ["g_t0", "nc"], 16)
    b.bwd("g_w", ["g_p", "x"], 8, output=True)
    return b.build()


@pytest.mark.parametrize("saved, message", [
    (["nc"], "cannot save nc"),  # its input c is not computed in the forward
    (["c", "nc"], "cannot save nc"),
    (["t"], "cannot save t"),  # a tuple is not a tensor
])
def test_cannot_save_what_the_forward_cannot_hold(saved, message):
    g = _backward_only_chain()
    with pytest.raises(InvalidScheduleError, match=message):
        simulate(g, sched(g, saved, ["g_t0", "nc", "g_p", "g_w"]))


def test_backward_only_values_are_computed_where_scheduled():
    g = _backward_only_chain()
    # Saving c computes it in the forward, after loss: p 32, t 32 (a tuple, no bytes of its own),
    # t0 48 (-t), loss 49 (-t0: 33), c 49 (-p: 33). Backward: start 34; g_t0 50; nc 66 (-c: 50);
    # g_p 66 (-g_t0, -nc: 34); g_w 42.
    in_forward = simulate(g, sched(g, ["c"], ["g_t0", "nc", "g_p", "g_w"]))
    assert in_forward.events == (
        ("forward", "p", 32), ("forward", "t", 32), ("forward", "t0", 48), ("forward", "loss", 49),
        ("forward", "c", 49), ("backward", "<start>", 34), ("backward", "g_t0", 50), ("backward", "nc", 66),
        ("backward", "g_p", 66), ("backward", "g_w", 42))
    # Saving p instead computes c in the backward: forward p 32, t 32, t0 48, loss 49 (-t0: 33);
    # backward: start 34; g_t0 50; c 66 (-p: 50); nc 66 (-c: 50); g_p 66; g_w 42.
    in_backward = simulate(g, sched(g, ["p"], ["g_t0", "c", "nc", "g_p", "g_w"]))
    assert in_backward.events == (
        ("forward", "p", 32), ("forward", "t", 32), ("forward", "t0", 48), ("forward", "loss", 49),
        ("backward", "<start>", 34), ("backward", "g_t0", 50), ("backward", "c", 66), ("backward", "nc", 66),
        ("backward", "g_p", 66), ("backward", "g_w", 42))
    # Computing a backward-only value once, in either pass, is not a recomputation.
    assert in_forward.recompute_flops == in_backward.recompute_flops == 0
    assert in_forward.saved_bytes == in_backward.saved_bytes == 16


def test_recomputing_a_random_value_is_invalid():
    g = residual_block()
    schedule = sched(g, ["h", "d"], ["g_y", "g_w2", "g_d", "hv", "a", "mask", "g_a", "hv", "g_h", "g_w1"])
    with pytest.raises(InvalidScheduleError, match="mask"):
        simulate(g, schedule)


def test_saved_bytes_ignores_free_values():
    g = residual_block()
    schedule = on_demand(g, save_all_set(g))
    assert simulate(g, schedule).saved_bytes == 34  # h 16 + mask 2 + d 16, as in the "eager" case


# ------------------------------------------------------------------ JSON round trips
@pytest.mark.parametrize("make", list(HAND_GRAPHS.values()) + [_backward_only_chain],
                         ids=list(HAND_GRAPHS) + ["backward_only_chain"])
def test_graph_and_schedule_json_round_trip(make):
    g = make()
    g2 = Graph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert g2.nodes == g.nodes
    schedule = on_demand(g, [])
    s2 = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert s2 == schedule
    assert simulate(g2, s2) == simulate(g, schedule)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_graph_json_round_trip(data):
    g = random_training_graph(data.draw, st)
    g2 = Graph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert g2.nodes == g.nodes
    for schedule in (on_demand(g, save_all_set(g)), on_demand(g, [])):
        s2 = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
        assert s2 == schedule
        assert simulate(g2, s2) == simulate(g, schedule)


def test_plan_json_round_trip(tmp_path):
    g = mlp2()
    schedule = sched(g, [], ["h", "a", "g_o", "g_w2", "g_a", "h", "a", "g_h", "g_w1"])
    plan = Plan.build(graph=g, schedule=schedule, budget_bytes=70, eager_peak_bytes=86, solver="ilp",
                      status="optimal", solve_seconds=0.5, fingerprint="abc", module_paths=("", "fc1"))
    assert plan.peak_bytes == 70 and plan.recompute_flops == 432
    assert plan.recomputed == {"h": 2, "a": 2}
    assert plan.decisions() == {"a": "RECOMPUTE", "h": "RECOMPUTE"}
    path = tmp_path / "plan.json"
    text = plan.to_json(path)
    for loaded in (Plan.from_json(text), Plan.from_json(path)):
        assert loaded.to_dict() == plan.to_dict()
        assert loaded.graph.nodes == g.nodes
        assert loaded.schedule == schedule
        assert loaded.timeline() == simulate(g, schedule)
    bad = json.loads(text)
    bad["format_version"] = 999
    with pytest.raises(ValueError, match="format"):
        Plan.from_dict(bad)


def test_a_multi_output_op_recomputed_has_its_outputs_taken_out_at_once():
    """The op allocates all its outputs: a schedule that recomputes it and takes one out later
    would hold memory the simulator did not count meanwhile, so it is refused."""
    b = GraphBuilder()
    b.input("x", 8)
    b.input("tan", 1, tangent=True)
    b.fwd("t", ["x"], 0, tensor=False)
    b.fwd("o", ["t"], 16)
    b.fwd("m", ["t"], 2)
    b.fwd("y", ["o", "m"], 8, output=True)
    b.bwd("g1", ["tan", "o"], 4)
    b.bwd("g2", ["g1", "m"], 8, output=True)
    g = b.build()
    assert simulate(g, sched(g, [], ["t", "o", "m", "g1", "g2"])).peak_bytes > 0
    with pytest.raises(InvalidScheduleError, match="outputs taken out right after"):
        simulate(g, sched(g, [], ["t", "o", "g1", "m", "g2"]))


def test_a_collectives_lingering_buffers_are_held_until_the_next_ones_wait():
    """gloo frees a reduce-scatter's copy of its input on its worker thread, after the wait returns
    (`Node.lingers`; measured on 2 ranks: as late as the next collective's issue). The simulator
    holds it from the collective on, through the next lingering collective and its wait, and
    frees it after that wait; the last one is held to the end of the backward."""
    import dataclasses

    b = GraphBuilder()
    b.input("x", 4)
    b.input("tan", 1, tangent=True)
    b.fwd("h", ["x"], 8)
    b.fwd("loss", ["h"], 1, output=True)
    b.bwd("g", ["tan", "h"], 8)
    b.bwd("rs1", ["g"], 4)
    b.bwd("wait1", ["rs1"], 4, output=True)
    b.bwd("big", ["g"], 100)
    b.bwd("rs2", ["big"], 4)
    b.bwd("wait2", ["rs2"], 4, output=True)
    b.bwd("g_x", ["g"], 4, output=True)
    plain = b.build()
    lingers = {"rs1": 8, "rs2": 100}
    graph = Graph(tuple(dataclasses.replace(n, lingers=lingers.get(n.name, 0)) for n in plain.nodes))
    schedule = on_demand(plain, {[n.name for n in plain.nodes].index("h")})
    before = {name: live for phase, name, live in simulate(plain, schedule).events if phase == "backward"}
    after = {name: live for phase, name, live in simulate(graph, schedule).events if phase == "backward"}
    held = {name: after[name] - before[name] for name in before}
    assert held == {"<start>": 0, "g": 0, "rs1": 0, "wait1": 8, "big": 8, "rs2": 8, "wait2": 108, "g_x": 100}
    assert simulate(graph, schedule).peak_bytes >= simulate(plain, schedule).peak_bytes
    assert Graph.from_dict(graph.to_dict()).nodes == graph.nodes


def _replayed(graph: Graph, schedule: Schedule, *, steps_built_again: bool):
    """`simulate`'s timeline (or its error), with the backward's steps as `prune` built them, or
    built again from what the forward left (as before `simulate` reused them)."""
    import dataclasses
    from unittest import mock

    import fxopt.solvers.schedule as schedule_module

    patch = mock.patch.object(schedule_module, "_reads_available", lambda *a: False) if steps_built_again \
        else mock.patch.object(schedule_module, "_reads_available", schedule_module._reads_available)
    with patch:
        try:
            return dataclasses.astuple(simulate(graph, schedule)), dataclasses.astuple(
                simulate(graph, schedule, eager_frees=True))
        except InvalidScheduleError as err:
            return str(err)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_simulate_replays_the_steps_prune_built_as_if_built_again(data):
    """`simulate` replays the backward steps `as_generated` built while pruning, not built again:
    the same timeline (or error) as with them built again, on random steps and SAVE sets, with
    recomputations nothing reads (pruned) and values read before anything made them (an error)."""
    graph = random_training_graph(data.draw, st)
    saveable = sorted(graph.saveable)
    saved = data.draw(st.sets(st.sampled_from(saveable))) if saveable else set()
    base = on_demand(graph, saved)
    backward = list(base.backward)
    forward = [i for i, n in enumerate(graph.nodes) if n.kind == "forward" and n.recomputable and n.tensor]
    for i in data.draw(st.lists(st.sampled_from(forward), max_size=3)) if forward else []:
        backward.insert(data.draw(st.integers(0, len(backward))), i)
    schedule = Schedule(base.saved, tuple(backward))
    assert _replayed(graph, schedule, steps_built_again=False) == _replayed(graph, schedule, steps_built_again=True)
