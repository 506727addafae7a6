"""Rotor's dynamic program over a chain of segments with menus of plans
(`fxopt.solvers.block_rotor`), on hand-built menus (no graph): its answers checked against every
tree of decisions enumerated, and one worked by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fxopt.solvers.block_rotor import (Menu, RotorChain, actions, all_kept, cheapest_tree, evaluate, kept_tree,
                                       min_peak_tree, plans, ways)


def every_tree(chain: RotorChain, s: int, t: int):
    """Every tree of decisions for s..t."""
    w = ways(chain, s, t)
    for o in range(len(w.need)):
        subs = [list(every_tree(chain, a, b)) for a, b, _ in w.calls(o)]
        for picked in itertools.product(*subs):
            yield s, t, w.choice(o), tuple(picked)


def menu(rng, link: int, plans_: int, holds_link: bool) -> Menu:
    keep = rng.integers(0, 12, plans_) * 8
    cost = rng.integers(0, 10, plans_).astype(float)
    forward = rng.integers(20, 60, plans_) * 8
    return Menu(keep=keep, cost=cost, forward=forward, backward=forward + rng.integers(0, 20, plans_) * 8,
                sweep=rng.integers(5, 30, plans_) * 8.0, again=rng.integers(0, 6, plans_).astype(float),
                again_link=rng.integers(6, 9, plans_).astype(float), ck=int(np.argmin(keep)),
                link_cost=float(rng.integers(1, 4)), link=link, holds_link=holds_link)


def random_chain(seed: int, count: int = 4) -> RotorChain:
    rng = np.random.default_rng(seed)
    menus = tuple(menu(rng, 0 if s == 0 else 16, int(rng.integers(1, 4)), bool(rng.integers(0, 2)))
                  for s in range(count))
    return RotorChain(menus, rng.integers(100, 200, count) * 8.0)


@pytest.mark.parametrize("seed", range(12))
def test_the_dps_answer_is_the_best_tree(seed):
    """On every budget from the lowest peak up: the slotted DP's answer fits (the model's peak,
    exact) and costs what the cheapest tree that fits does; the lowest-peak DP finds the lowest
    peak of all trees; the DP without sweeps finds the cheapest tree that makes nothing again."""
    chain = random_chain(seed)
    last = len(chain.menus) - 1
    trees = [(evaluate(chain, tree), tree) for tree in every_tree(chain, 0, last)]
    kept = [(evaluate(chain, tree), tree) for tree in trees_without_sweeps(chain)]
    lowest, cost, tree = min_peak_tree(chain)
    assert lowest == min(peak for (peak, _), _ in trees)
    assert evaluate(chain, tree) == (lowest, cost)
    for budget in np.linspace(lowest, max(peak for (peak, _), _ in trees), 9).round():
        best = min(c for (peak, c), _ in trees if peak <= budget)
        found = cheapest_tree(chain, budget)
        assert found is not None
        peak, found_cost = evaluate(chain, found)
        assert peak <= budget and found_cost == pytest.approx(best)
        fits = [c for (peak, c), _ in kept if peak <= budget]
        found = kept_tree(chain, budget)
        assert (found is None) == (not fits)
        if fits:
            assert evaluate(chain, found)[0] <= budget and evaluate(chain, found)[1] == pytest.approx(min(fits))
    assert cheapest_tree(chain, lowest - 1) is None


def trees_without_sweeps(chain: RotorChain):
    return [all_kept(list(p)) for p in itertools.product(*[range(len(m.keep)) for m in chain.menus])]


def hand_chain() -> RotorChain:
    """An embedding (segment 0: made again for nothing), three layers (1-3: one plan each,
    keeping 40 bytes and making nothing again in its backward; made again in a sweep: 5 for what
    it keeps, 6 with its link to the next; each link 16 bytes) and a head (4) needing 300 bytes
    beyond what the callers hold. A sweep runs where the step holds 100."""
    layer = dict(keep=np.array([40]), cost=np.array([0.0]), forward=np.array([100.0]), backward=np.array([120.0]),
                 sweep=np.array([30.0]), again=np.array([5.0]), again_link=np.array([6.0]), ck=0, link_cost=1.0,
                 link=16)
    ends = dict(cost=np.array([0.0]), sweep=np.array([0.0]), again=np.array([0.0]), again_link=np.array([0.0]), ck=0,
                link_cost=0.0)
    menus = (Menu(keep=np.array([0]), forward=np.array([50.0]), backward=np.array([60.0]), link=0, **ends),
             Menu(**layer), Menu(**layer), Menu(**layer),
             Menu(keep=np.array([0]), forward=np.array([300.0]), backward=np.array([300.0]), link=16, **ends))
    return RotorChain(menus, np.full(5, 100.0))


@pytest.mark.parametrize("budget, peak, cost, kept_links", [
    # every layer kept: 300 + 3 x (40 + 16) + 16
    (484, 484, 0.0, []),
    # layers 2 and 3 kept, layer 1 made again from the embedding's (free) in the backward: 300 + 16 + 2 x 56
    (430, 428, 5.0, [2]),
    # layer 2 kept; 3 made again from its link (kept), 1 from the embedding: 300 + 16 + 56 + 16
    (400, 388, 10.0, [2, 4]),
    # the links kept, each layer made again from its own: 300 + 3 x 16
    (350, 348, 15.0, [2, 3, 4]),
    # the head's input kept only: one sweep makes the layers again, each keeping its values and
    # the next link (6, 6, 5): 300 + 16
    (320, 316, 17.0, [4]),
    (315, None, None, None),
])
def test_sweeps_in_the_backward_at_tight_budgets(budget, peak, cost, kept_links):
    """Hand-worked on `hand_chain`: the cheapest decisions at each budget, and the links the
    forward keeps (CK(e) keeps e's link to e+1)."""
    chain = hand_chain()
    tree = cheapest_tree(chain, budget)
    if peak is None:
        assert tree is None and min_peak_tree(chain)[0] > budget
        return
    assert evaluate(chain, tree) == (peak, cost)
    assert [a[1] + 1 for a in actions(tree) if a[0] == "ck"] == kept_links
    assert plans(tree) == {s: 0 for s in range(5)}
    assert (kept_tree(chain, budget) is not None) == (budget >= 484)


def test_each_sub_chains_ways_are_made_once_per_chain(monkeypatch):
    """Every DP and `evaluate` of one chain read each sub-chain's ways made once (counted), and
    answer as on a chain made anew for each of them."""
    import fxopt.solvers.block_rotor as block_rotor

    made = []
    real = block_rotor._ways
    monkeypatch.setattr(block_rotor, "_ways", lambda chain, s, t: made.append((s, t)) or real(chain, s, t))
    chain = random_chain(3, count=5)
    lowest, cost, tree = min_peak_tree(chain)
    answers = [(lowest, cost, tree), cheapest_tree(chain, lowest + 64), kept_tree(chain, lowest + 64),
               evaluate(chain, tree)]
    assert sorted(made) == sorted(set(made)) and len(made) == 5 * 6 // 2
    anew = lambda: RotorChain(chain.menus, chain.sweep_fixed)  # noqa: E731
    assert answers == [min_peak_tree(anew()), cheapest_tree(anew(), lowest + 64), kept_tree(anew(), lowest + 64),
                       evaluate(anew(), tree)]
