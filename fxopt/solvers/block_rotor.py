"""Rotor's dynamic program over a chain of segments that each have a menu of plans: which
segments keep their input through the forward, which are made again from an earlier one in the
backward (multi-level checkpointing), and which plan each runs (`fxopt.solvers.block_plan` makes
the menus from each kind's curve, and the schedule from the decisions).

A chain of segments 0..n-1: segment s reads what s-1 hands it (its *link*, a transformer layer's
input) and hands s+1 its own. Beaumont et al.'s rotor (2019; `fxopt.solvers.chain` for stages
that are kept whole or recomputed whole) processes a sub-chain s..t, forward then backward, from
its link, which the caller holds, in one of two ways:

    ALL(p)   run s's forward with plan p (keeping ``keep[p]`` until s's backward) and keep the
             link to s+1; process s+1..t; run s's backward with plan p (its own recomputations in it);
    CK(e)    run s..e forward keeping nothing of them but the link to e+1; process e+1..t from it;
             let it go; process s..e again from s's link (their forward made again).

Rockmate's refinement (Zhao et al., 2023) is the menu: ALL runs any plan of the segment's curve.
The descent of the whole chain (every sub-chain s..n-1) is the step's forward: free, each
segment at its forward memory. Every other sub-chain s..t is processed in the backward, just
before t's backward, where the step holds what it holds then (``sweep_fixed[t]``: the gradients
made so far, what cannot be recomputed, ...): each segment made again costs ``again[p]`` (ALL: what
plan p keeps, and the link when the sub-chain goes on) or ``link_cost`` (CK: its link only).

Memory, at any moment: what the callers hold (links and plans' keeps, the DP's state) + the
segment's need then, which the menu gives beyond what the callers hold (its own input aside:
its caller holds it); a CK run's later segments hold their input themselves (``link``). Two
answers, as in `fxopt.solvers.chain`: the lowest peak (`min_peak_tree`, exact in bytes), and the
least cost within a budget (`cheapest_tree`, what the callers hold in slots, every size rounded
up: the model's peak of its answer is within the budget).

For example, a forward keeping only the first layer's input, then one sweep recomputing every
layer keeping what each plan p keeps, on 3 layers after an embedding (segment 0) and before a
head (4): CK(0) at 0..4 keeps the link 0 -> 1; 1..4 runs CK(3) forward (free), 4 runs ALL(p);
then, before 3's backward, 1..3 runs ALL(p1) -> 2..3 ALL(p2) -> 3..3 ALL(p3): each layer made
again once (``again``), its plan's backward run after.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

# Slots of what the callers hold in `cheapest_tree`, between nothing and the most any segment
# leaves room for (sizes rounded up to a slot); exact where every size held is a multiple of one
# unit and at most EXACT_SLOTS of them span that range.
SLOTS = 2000
EXACT_SLOTS = 4000


@dataclasses.dataclass(frozen=True)
class Menu:
    """One segment's plans (arrays by plan), and what rotor needs of it. Bytes are beyond what
    the callers hold, the segment's input (``link``) aside."""

    keep: np.ndarray  # held from its forward to its backward
    cost: np.ndarray  # its own recomputations, in its backward
    forward: np.ndarray  # the most the step holds while it runs, in the step's forward
    backward: np.ndarray  # ... while its backward runs (its recomputations in it)
    sweep: np.ndarray  # its own memory while made again in the backward, beyond ``sweep_fixed``
    again: np.ndarray  # the cost of making again what it keeps, in a sweep
    again_link: np.ndarray  # ... and its link to the next segment
    ck: int  # the plan a forward keeping nothing is counted as (the least keeping)
    link_cost: float  # making its link to the next segment again, from its own input
    link: int  # bytes of its input (what the previous segment hands it)
    holds_link: bool = False  # its backward reads its link to the next: held until then


@dataclasses.dataclass(frozen=True)
class RotorChain:
    menus: tuple[Menu, ...]
    sweep_fixed: np.ndarray  # per segment t: the step's memory as the sweeps before t's backward start


# A sub-chain's decision: (s, t, ("all", plan) or ("ck", e), its sub-calls).
Tree = tuple[int, int, tuple[str, int], tuple]
Option = tuple[tuple[str, int], float, float, tuple[tuple[int, int, float], ...]]  # choice, need, cost, calls


def _options(chain: RotorChain, s: int, t: int) -> Iterator[Option]:
    """The ways to process s..t from s's link: (choice, bytes it needs beyond the callers',
    cost, sub-calls (s', t', bytes held for them))."""
    menus, last = chain.menus, len(chain.menus) - 1
    forward = t == last  # (the step's forward: nothing made again)
    m = menus[s]
    goes_on = s < t
    own = m.forward if forward else chain.sweep_fixed[t] + m.sweep
    again = 0.0 if forward else (m.again_link if goes_on else m.again)
    for p in range(len(m.keep)):
        calls = ((s + 1, t, float(m.keep[p] + menus[s + 1].link)),) if goes_on else ()
        yield ("all", p), max(float(own[p]), float(m.backward[p])), float(again if forward else again[p]) + float(m.cost[p]), calls
    need, cost = -math.inf, 0.0
    for e in range(s, t):
        me = menus[e]
        ck = float(me.forward[me.ck] if forward else chain.sweep_fixed[t] + me.sweep[me.ck])
        need = max(need, ck + (me.link if e > s else 0))  # (a later segment holds its input itself)
        cost += 0.0 if forward else me.link_cost
        held = float(menus[e + 1].link)
        yield ("ck", e), need, cost, ((e + 1, t, held), (s, e, held if me.holds_link else 0.0))


def _sub_chains(count: int) -> Iterator[tuple[int, int]]:
    for length in range(1, count + 1):
        for s in range(count - length + 1):
            yield s, s + length - 1


def min_peak_tree(chain: RotorChain) -> tuple[float, float, Tree]:
    """The decisions with the lowest peak (then the least cost among them): (peak, cost, tree)."""
    best: dict[tuple[int, int], tuple[float, float, Tree]] = {}
    for s, t in _sub_chains(len(chain.menus)):
        for choice, need, cost, calls in _options(chain, s, t):
            peak = max([need] + [held + best[(a, b)][0] for a, b, held in calls])
            total = cost + sum(best[(a, b)][1] for a, b, _ in calls)
            if (s, t) not in best or (peak, total) < best[(s, t)][:2]:
                best[(s, t)] = (peak, total, (s, t, choice, tuple(best[(a, b)][2] for a, b, _ in calls)))
    return best[(0, len(chain.menus) - 1)]


def cheapest_tree(chain: RotorChain, budget: float, slots: int = SLOTS) -> Tree | None:
    """Rotor's DP: the least cost whose peak (the model's) is within ``budget``, what the callers
    hold counted in slots; None if nothing fits."""
    count = len(chain.menus)
    options = {(s, t): list(_options(chain, s, t)) for s, t in _sub_chains(count)}
    floor = min(need for opts in options.values() for _, need, _, _ in opts)
    # The most the callers may hold anywhere: no more than every segment's largest keep and its
    # link (twice: kept for the next and until its own backward) together.
    menus = chain.menus
    most = sum(float(np.max(m.keep)) + 2 * m.link for m in menus)
    room = min(budget - floor, most)
    if room < 0:
        return None
    unit = _unit(sorted({int(h) for opts in options.values() for _, _, _, calls in opts for _, _, h in calls}),
                 [m.link for m in menus if m.link > 0], room, slots)
    top = int(room // unit)  # held slots 0..top

    def size(b: float) -> int:
        return max(0, math.ceil(b / unit - 1e-9))

    h = np.arange(top + 1)
    table: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    inf = np.full(top + 2, np.inf)
    for s, t in _sub_chains(count):
        rows = []
        for _, need, cost, calls in options[(s, t)]:
            total = np.full(top + 1, cost)
            for a, b, held in calls:
                k = size(held)
                sub = table[(a, b)][0]
                shifted = inf[:top + 1].copy()
                if k <= top:
                    shifted[:top + 1 - k] = sub[k:]
                total = total + shifted
            fits = budget - need  # the callers may hold this much
            total[h * unit > fits + 1e-9] = np.inf
            rows.append(total)
        stacked = np.vstack(rows)
        arg = np.argmin(stacked, axis=0)
        table[(s, t)] = (stacked[arg, h], arg)
    if not np.isfinite(table[(0, count - 1)][0][0]):
        return None
    return _tree_at(options, table, 0, count - 1, 0, size)


def _unit(sizes: list[int], links: list[int], room: float, slots: int) -> float:
    """The bytes of a slot: exact where every size held is a multiple of one unit that few slots
    span; else a fraction of the links' common size (links are what a tight budget holds: a
    transformer's layer inputs, all of one size), counted exactly; else ``room`` in ``slots``."""
    step = math.gcd(*sizes) if sizes else 0
    if step > 0 and room / step <= EXACT_SLOTS:
        return float(step)
    common = math.gcd(*links) if links else 0
    if common > 0 and common * EXACT_SLOTS >= room:
        return common / max(1, math.floor(common * EXACT_SLOTS / max(room, 1.0)))
    return max(room / slots, 1.0)


def _tree_at(options, table, s: int, t: int, held: int, size) -> Tree:
    choice, _, _, calls = options[(s, t)][int(table[(s, t)][1][held])]
    return s, t, choice, tuple(_tree_at(options, table, a, b, held + size(h), size) for a, b, h in calls)


def evaluate(chain: RotorChain, tree: Tree) -> tuple[float, float]:
    """The peak (bytes) and cost the model gives a tree."""
    s, t, choice, subs = tree
    for c, need, cost, calls in _options(chain, s, t):
        if c == choice:
            values = [evaluate(chain, sub) for sub in subs]
            return (max([need] + [held + v[0] for (_, _, held), v in zip(calls, values)]),
                    cost + sum(v[1] for v in values))
    raise AssertionError(f"no option {choice} for segments {s}..{t}")


def actions(tree: Tree, out: list | None = None) -> list:
    """The tree as a sequence: ("all", s, plan, with_link) make s with plan (keeping its link to
    s+1 when the sub-chain goes on), ("ck", e) keep e's link to e+1, ("B", s, plan) run s's
    backward, ("drop", e) let e's link go."""
    out = [] if out is None else out
    s, t, (kind, x), subs = tree
    if kind == "all":
        out.append(("all", s, x, s < t))
        if subs:
            actions(subs[0], out)
        out.append(("B", s, x))
    else:
        out.append(("ck", x))
        actions(subs[0], out)
        out.append(("drop", x))
        actions(subs[1], out)
    return out


def plans(tree: Tree) -> dict[int, int]:
    """The plan each segment's backward runs with."""
    return {a[1]: a[2] for a in actions(tree) if a[0] == "B"}
