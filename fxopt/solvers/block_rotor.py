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
its caller holds it); a CK run's later segments hold their input themselves (``link``). The
ways of a sub-chain (`ways`: arrays, one definition for every DP and `evaluate`) give three
answers: the lowest peak (`min_peak_tree`, exact in bytes, the least cost among equals at each
sub-chain); the least cost within a budget (`cheapest_tree`: what the callers hold counted in
slots, each size rounded to the nearest, its answer checked exactly and asked again below the
budget where it is over); and the least cost making nothing again (`kept_tree`: every segment
ALL in the forward, a Pareto front of (held, cost) exact in bytes: where the budget is loose,
what a slot's rounding could miss).

For example (`tests/test_block_rotor.py` works it by hand), 3 layers after an embedding
(segment 0) and before a head (4) whose peak is the step's: keeping each layer's plan's values
through the head costs nothing and peaks highest; CK(1), CK(2), CK(3) keep only the links 1 -> 2,
2 -> 3 and 3 -> 4 (the embedding is made again for nothing), and before each layer's backward
s..s runs ALL(p), its values made again from its link (``again``); CK(3) alone keeps only the
head's input, and 0..3 is then made again in one sweep before 3's backward, 0..3 ALL -> 1..3
ALL -> 2..3 ALL -> 3..3 ALL, each keeping its plan's values and its link to the next.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import numpy as np

from fxopt.solvers.chain import tree_actions

# Slots of what the callers hold in `cheapest_tree`, between nothing and the most any segment
# leaves room for (sizes rounded to the nearest slot); exact where every size held is a multiple
# of one unit and at most EXACT_SLOTS of them span that range.
SLOTS = 1000
EXACT_SLOTS = 2000
# How many times `cheapest_tree` asks its DP again, the budget lowered by its answer's excess.
RETRIES = 2
# The most (held, cost) pairs `kept_tree` carries from a segment to the next; beyond it, evenly thinned.
PARETO_CAP = 4000


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


@dataclasses.dataclass(frozen=True, eq=False)
class RotorChain:
    menus: tuple[Menu, ...]
    sweep_fixed: np.ndarray  # per segment t: the step's memory as the sweeps before t's backward start
    # Each sub-chain's ways (`ways`), made the first time asked: every DP and `evaluate` of this
    # chain reads the same (its menus do not change).
    made: dict[tuple[int, int], Ways] = dataclasses.field(default_factory=dict, repr=False)


# A sub-chain's decision: (s, t, ("all", plan) or ("ck", e), its sub-calls).
Tree = tuple[int, int, tuple[str, int], tuple]


@dataclasses.dataclass(frozen=True)
class Ways:
    """The ways to process s..t from s's link, as arrays: ALL(p) for each plan p, then CK(e) for
    e = s..t-1. For each: the bytes it needs beyond what the callers hold (``need``), its cost,
    and what it holds for its sub-calls: ALL(p) calls s+1..t holding ``all_held[p]`` (where
    s < t); CK(e) calls e+1..t holding ``ck_next[e-s]``, then s..e holding ``ck_back[e-s]``."""

    s: int
    t: int
    need: np.ndarray
    cost: np.ndarray
    all_held: np.ndarray
    ck_next: np.ndarray
    ck_back: np.ndarray

    @property
    def plans(self) -> int:
        return len(self.all_held)

    def choice(self, o: int) -> tuple[str, int]:
        return ("all", o) if o < self.plans else ("ck", self.s + o - self.plans)

    def calls(self, o: int) -> tuple[tuple[int, int, float], ...]:
        s, t = self.s, self.t
        if o < self.plans:
            return ((s + 1, t, float(self.all_held[o])),) if s < t else ()
        e = s + o - self.plans
        return (e + 1, t, float(self.ck_next[e - s])), (s, e, float(self.ck_back[e - s]))


def ways(chain: RotorChain, s: int, t: int) -> Ways:
    """The ways to process s..t (see the module), made once per chain (`RotorChain.made`)."""
    found = chain.made.get((s, t))
    if found is None:
        found = chain.made[(s, t)] = _ways(chain, s, t)
    return found


def _ways(chain: RotorChain, s: int, t: int) -> Ways:
    menus, last = chain.menus, len(chain.menus) - 1
    forward = t == last  # (the step's forward: nothing made again)
    m = menus[s]
    own = m.forward if forward else chain.sweep_fixed[t] + m.sweep
    again = 0.0 if forward else (m.again_link if s < t else m.again)
    all_need = np.maximum(own, m.backward).astype(float)
    all_cost = again + m.cost
    all_held = (m.keep + menus[s + 1].link).astype(float) if s < t else np.zeros(len(m.keep))
    # CK(e): s..e run forward (each at the plan keeping least, a later one holding its own input).
    after = range(s, t)
    ck_own = np.array([menus[e].forward[menus[e].ck] if forward else chain.sweep_fixed[t] + menus[e].sweep[menus[e].ck]
                       for e in after], dtype=float)
    ck_own += np.array([menus[e].link if e > s else 0 for e in after], dtype=float)
    ck_need = np.maximum.accumulate(ck_own) if len(ck_own) else ck_own
    ck_cost = np.cumsum([0.0 if forward else menus[e].link_cost for e in after])
    ck_next = np.array([menus[e + 1].link for e in after], dtype=float)
    ck_back = np.array([menus[e + 1].link if menus[e].holds_link else 0 for e in after], dtype=float)
    return Ways(s, t, np.concatenate((all_need, ck_need)), np.concatenate((all_cost, ck_cost)), all_held, ck_next,
                ck_back)


def _sub_chains(count: int) -> Iterator[tuple[int, int]]:
    for length in range(1, count + 1):
        for s in range(count - length + 1):
            yield s, s + length - 1


def min_peak_tree(chain: RotorChain) -> tuple[float, float, Tree]:
    """The decisions with the lowest peak (then the least cost among them): (peak, cost, tree)."""
    best: dict[tuple[int, int], tuple[float, float, Tree]] = {}
    for s, t in _sub_chains(len(chain.menus)):
        w = ways(chain, s, t)
        peak, total = w.need.copy(), w.cost.copy()
        for o in range(len(peak)):
            for a, b, held in w.calls(o):
                peak[o] = max(peak[o], held + best[(a, b)][0])
                total[o] += best[(a, b)][1]
        o = min(range(len(peak)), key=lambda o: (peak[o], total[o]))
        best[(s, t)] = (float(peak[o]), float(total[o]),
                        (s, t, w.choice(o), tuple(best[(a, b)][2] for a, b, _ in w.calls(o))))
    return best[(0, len(chain.menus) - 1)]


def cheapest_tree(chain: RotorChain, budget: float, slots: int = SLOTS) -> Tree | None:
    """Rotor's DP: the least cost whose peak (the model's, `evaluate`: exact) is within
    ``budget``; None if none is found. The DP counts what the callers hold in slots, each size
    rounded to the nearest: where its answer peaks above the budget, it is asked again with the
    budget lowered by the excess (`RETRIES` times at most)."""
    all_ways = {(s, t): ways(chain, s, t) for s, t in _sub_chains(len(chain.menus))}
    target = budget
    for _ in range(1 + RETRIES):
        tree = _slotted_tree(chain, all_ways, target, slots)
        if tree is None:
            return None
        peak = evaluate(chain, tree, all_ways)[0]
        if peak <= budget:
            return tree
        target -= peak - budget
    return None


def _slotted_tree(chain: RotorChain, all_ways: dict[tuple[int, int], Ways], budget: float, slots: int) -> Tree | None:
    count = len(chain.menus)
    floor = min(float(w.need.min()) for w in all_ways.values())
    # The most the callers may hold anywhere: no more than every segment's largest keep and its
    # link (twice: kept for the next and until its own backward) together.
    menus = chain.menus
    most = sum(float(np.max(m.keep)) + 2 * m.link for m in menus)
    room = min(budget - floor, most)
    if room < 0:
        return None
    held = [w.all_held[w.all_held > 0] for w in all_ways.values()]
    held += [np.concatenate((w.ck_next, w.ck_back)) for w in all_ways.values()]
    unit = _unit(sorted({int(x) for h in held for x in h}), [m.link for m in menus if m.link > 0], room, slots)
    top = int((room + 0.5) // unit)  # held slots 0..top
    # Each sub-chain's least cost by the slots its callers hold, with as many more slots at
    # infinity (a call holding k slots reads it from k on); computed only up to the most its
    # callers can hold (what the segments before keep, and links) and leave it room for.
    table: dict[tuple[int, int], np.ndarray] = {}
    arg: dict[tuple[int, int], np.ndarray] = {}
    before = np.concatenate(([0.0], np.cumsum([float(np.max(m.keep)) for m in menus]))) + sum(m.link for m in menus)

    def size(b) -> np.ndarray:
        return np.minimum(np.rint(np.asarray(b) / unit).clip(0), top + 1).astype(np.int64)

    held_bytes = np.arange(top + 1) * unit  # (what the callers hold at each slot)
    for (s, t), w in all_ways.items():
        reach = int(min(top, (budget - float(w.need.min()) + 0.5) // unit, math.ceil(before[s] / unit) + 2 * count))  # (+: slots rounded up)
        h = np.arange(max(reach, -1) + 1)
        width = len(h)
        rows = np.empty((len(w.need), width))  # (every row is written below)
        p = w.plans
        if s < t:
            after = table[(s + 1, t)]
            for k, cost, row in zip(size(w.all_held).tolist(), w.cost[:p], rows[:p]):
                np.add(after[k:k + width], cost, out=row)
        else:
            rows[:p] = w.cost[:p, None]
        for j, (k_next, k_back, row) in enumerate(zip(size(w.ck_next).tolist(), size(w.ck_back).tolist(), rows[p:])):
            np.add(table[(s + j + 1, t)][k_next:k_next + width], w.cost[p + j], out=row)
            np.add(row, table[(s, s + j)][k_back:k_back + width], out=row)
        # Where the callers hold more than leaves room for what an option needs, it does not fit
        # (bytes: whole numbers): each option's slots from the first holding more on.
        room_left = np.searchsorted(held_bytes[:width], (budget - w.need) + 0.5, side="right")
        for o in np.flatnonzero(room_left < width).tolist():
            rows[o, room_left[o]:] = np.inf
        best = np.argmin(rows, axis=0) if width else np.zeros(0, dtype=np.int64)
        out = np.full(2 * (top + 1), np.inf)
        out[:len(h)] = rows[best, h]
        table[(s, t)], arg[(s, t)] = out, best
    if not np.isfinite(table[(0, count - 1)][0]):
        return None

    def tree_at(s: int, t: int, slot: int) -> Tree:
        w, o = all_ways[(s, t)], int(arg[(s, t)][slot])  # (a finite cost's slot is within its reach)
        return s, t, w.choice(o), tuple(tree_at(a, b, slot + int(size(held))) for a, b, held in w.calls(o))

    return tree_at(0, count - 1, 0)


def kept_tree(chain: RotorChain, budget: float, cap: int = PARETO_CAP) -> Tree | None:
    """The least cost within ``budget`` making nothing again (every segment ALL in the forward:
    one plan per block, Rockmate's choice without rotor's sweeps), exact in bytes: the (held,
    cost) pairs no other beats carried from segment to segment (at most ``cap``, evenly thinned,
    the least held and the cheapest kept); None if nothing fits."""
    last = len(chain.menus) - 1
    held, spent = np.zeros(1), np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for s in range(last + 1):
        w = ways(chain, s, last)
        p = w.plans
        fits = held[:, None] + w.need[None, :p] <= budget  # (state, plan)
        state, plan = np.nonzero(fits)
        if not len(state):
            return None
        k, c = held[state] + w.all_held[plan], spent[state] + w.cost[plan]
        order = np.lexsort((c, k))
        k, c, state, plan = k[order], c[order], state[order], plan[order]
        front = c < np.concatenate(([np.inf], np.minimum.accumulate(c)[:-1])) - 1e-15  # (none holds less as cheaply)
        k, c, state, plan = k[front], c[front], state[front], plan[front]
        if len(k) > cap:
            pick = np.unique(np.linspace(0, len(k) - 1, cap).round().astype(int))
            k, c, state, plan = k[pick], c[pick], state[pick], plan[pick]
        held, spent = k, c
        back.append((state, plan))
    k, chosen = int(np.argmin(spent)), []
    for state, plan in reversed(back):
        chosen.append(int(plan[k]))
        k = int(state[k])
    return all_kept(chosen[::-1])


def all_kept(plans: list[int]) -> Tree:
    """The decisions running each segment at its plan in ``plans`` in the forward, every link
    kept (no segment made again)."""
    last = len(plans) - 1
    tree: Tree = (last, last, ("all", plans[last]), ())
    for s in reversed(range(last)):
        tree = (s, last, ("all", plans[s]), (tree,))
    return tree


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


def evaluate(chain: RotorChain, tree: Tree, known: dict[tuple[int, int], Ways] | None = None) -> tuple[float, float]:
    """The peak (bytes) and cost the model gives a tree (``known``: ways already made)."""
    s, t, choice, subs = tree
    w = known[(s, t)] if known is not None else ways(chain, s, t)
    o = next(o for o in range(len(w.need)) if w.choice(o) == choice)
    values = [evaluate(chain, sub, known) for sub in subs]
    return (max([float(w.need[o])] + [held + v[0] for (_, _, held), v in zip(w.calls(o), values)]),
            float(w.cost[o]) + sum(v[1] for v in values))


def actions(tree: Tree) -> list:
    """The tree as a sequence (`fxopt.solvers.chain.tree_actions`): ("all", s, plan, with_link)
    make s with plan (keeping its link to s+1 when the sub-chain goes on), ("ck", e) keep e's
    link to e+1, ("B", s, plan) run s's backward, ("drop", e) let e's link go."""
    return tree_actions(tree)


def plans(tree: Tree) -> dict[int, int]:
    """The plan each segment's backward runs with."""
    return {a[1]: a[2] for a in actions(tree) if a[0] == "B"}
