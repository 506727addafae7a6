"""The simple policies (`fxopt.solvers.policies`) on hand-built graphs, no tensors: which modules
are repeated blocks, what each policy SAVEs and recomputes (worked by hand), and that "auto"
never answers with a plan costlier than the best of them that fits."""

from __future__ import annotations

import pytest

from fxopt.solvers import solve
from fxopt.solvers.policies import named_policy_candidates, policies, policy_candidates, repeated_blocks
from fxopt.solvers.schedule import simulate
from solver_graphs import GraphBuilder, ids

LAYER, ATTN, LINEAR, NORM = "Layer", "Attention", "Linear", "LayerNorm"


@pytest.mark.parametrize("stacks,expected", [
    # Two decoder layers (each with an attention module and leaf Linears) and a final norm: the
    # layers and their attention modules are blocks; a Linear is one op; the model is there once.
    ([[("m", "Model"), ("m.h.0", LAYER), ("m.h.0.attn", ATTN), ("m.h.0.attn.q", LINEAR)],
      [("m", "Model"), ("m.h.0", LAYER), ("m.h.0.ln", NORM)],
      [("m", "Model"), ("m.h.1", LAYER), ("m.h.1.attn", ATTN), ("m.h.1.attn.q", LINEAR)],
      [("m", "Model"), ("m.ln_f", NORM)],
      []],
     [(0, 1), (0,), (2, 3), (), ()]),
    # diffusers' down blocks: two classes at one depth (neither repeated); the ResNet blocks in both are.
    ([[("u", "UNet"), ("u.down.0", "CrossAttnDown"), ("u.down.0.resnets.0", "Resnet"), ("u.down.0.resnets.0.conv", "Conv")],
      [("u", "UNet"), ("u.down.1", "Down"), ("u.down.1.resnets.0", "Resnet"), ("u.down.1.resnets.0.conv", "Conv")]],
     [(0,), (1,)]),
    # One class at two depths, once at each: not repeated.
    ([[("a", LAYER), ("a.b", "Inner"), ("a.b.c", LINEAR)], [("x", "Other"), ("x.a", LAYER), ("x.a.l", LINEAR)]],
     [(), ()]),
])
def test_repeated_blocks(stacks, expected):
    assert repeated_blocks(stacks) == expected


def two_layers(nested: bool = False, derived: bool = False):
    """Two layers ``h = in @ w`` (a matmul), ``a = gelu(h)``, ``o = a * s``, then ``loss = sum(o2)``.

    The backward reads h1, h2 (gelu's backward) and o1 (w2's gradient): eager SAVEs those. Each
    layer is a block; ``nested``: (h, a) and (o) are blocks inside it too; ``derived``: gelu's
    backward reads ``d = gelu'(h)`` instead, a backward-only value in no module (as AOTAutograd
    makes them)."""
    b = GraphBuilder()
    for name, size in (("x", 8), ("w1", 4), ("w2", 4), ("s", 4)):
        b.input(name, size)
    b.input("tan", 1, tangent=True)
    previous = "x"
    for k in (1, 2):
        layer = k - 1
        first, second = ((layer, 2 + 2 * layer), (layer, 3 + 2 * layer)) if nested else ((layer,), (layer,))
        b.fwd(f"h{k}", [previous, f"w{k}"], 16, cost=2.0, flops=200, blocks=first, op_class="matmul")
        b.fwd(f"a{k}", [f"h{k}"], 16, cost=1.0, flops=16, blocks=first)
        b.fwd(f"o{k}", [f"a{k}", "s"], 16, cost=1.0, flops=16, blocks=second)
        if derived:
            b.fwd(f"d{k}", [f"h{k}"], 16, cost=1.0, flops=16)
        previous = f"o{k}"
    b.fwd("loss", ["o2"], 1, cost=1.0, flops=16, output=True)
    b.bwd("g_o2", ["tan"], 16)
    for k in (2, 1):
        b.bwd(f"g_a{k}", [f"g_o{k}", "s"], 16)
        b.bwd(f"g_h{k}", [f"g_a{k}", f"d{k}" if derived else f"h{k}"], 16)
        b.bwd(f"g_w{k}", ["x" if k == 1 else "o1", f"g_h{k}"], 4, output=True)
        if k == 2:
            b.bwd("g_o1", ["g_h2", "w2"], 16)
    return b.build()


# name -> (SAVEd values, recompute FLOPs), worked by hand:
# - selective saves the matmuls' outputs and recomputes a1, o1 for w2's gradient (16 + 16);
# - blocks-1 saves o1 (layer 2's input) and recomputes h1 and h2 (200 each);
# - selective-1 (matmuls and o1) is save_all, named once;
# - blocks-2 saves what enters each inner block (a1, o1, a2), recomputing h1 and h2;
# - with d = gelu'(h): eager saves d1 and d2 for h1 and h2; each d is in its layer's block, so
#   blocks-1 still saves o1 alone (computing d1 and d2 in the backward is not a recomputation),
#   and selective-1 (the matmuls and o1) is no longer save_all.
EXPECTED = {
    "flat": (two_layers, {"save_all": (("h1", "o1", "h2"), 0), "selective": (("h1", "h2"), 32),
                          "blocks-1": (("o1",), 400)}),
    "nested": (lambda: two_layers(nested=True),
               {"save_all": (("h1", "o1", "h2"), 0), "selective": (("h1", "h2"), 32), "blocks-1": (("o1",), 400),
                "blocks-2": (("a1", "o1", "a2"), 400)}),
    "derived": (lambda: two_layers(derived=True),
                {"save_all": (("d1", "o1", "d2"), 0), "selective": (("h1", "h2"), 32), "blocks-1": (("o1",), 400),
                 "selective-1": (("h1", "o1", "h2"), 0)}),
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_each_policy_saves_and_recomputes_as_worked_by_hand(case):
    build, expected = EXPECTED[case]
    graph = build()
    assert policies(graph) == {name: frozenset(ids(graph, *saved)) for name, (saved, _) in expected.items()}
    found = dict(named_policy_candidates(graph))
    assert {name: timeline.recompute_flops for name, (_, timeline) in found.items()} == \
        {name: flops for name, (_, flops) in expected.items()}
    for schedule, timeline in found.values():
        assert simulate(graph, schedule) == timeline


def test_a_graph_without_blocks_or_op_classes_gets_save_all_only():
    from solver_graphs import chain

    assert list(policies(chain(4))) == ["save_all"]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_auto_is_never_costlier_than_a_policy_that_fits(case):
    graph = EXPECTED[case][0]()
    for schedule, timeline in policy_candidates(graph, 0):
        found = solve(graph, timeline.peak_bytes, time_limit=1.0)
        assert found.timeline.peak_bytes <= timeline.peak_bytes
        assert found.timeline.cost <= timeline.cost + 1e-12


def test_the_candidates_do_not_simulate_save_all(monkeypatch):
    """`policy_candidates` leaves save_all out (a heuristic of its own) without simulating it: on a
    32-layer step, a whole-step simulation for nothing."""
    import fxopt.solvers.policies as module

    graph = EXPECTED[list(EXPECTED)[-1]][0]()
    simulated = []
    monkeypatch.setattr(module, "simulate", lambda g, s: simulated.append(s.saved) or simulate(g, s))
    found = policy_candidates(graph, 0)
    named = policies(graph)
    assert "save_all" in named and len(simulated) == len(found) == len(named) - 1
    assert named["save_all"] not in simulated
