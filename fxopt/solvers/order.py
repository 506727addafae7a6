"""Operator order as a decision: a memory-aware topological order of the step's graph.

The captured graph runs its ops in the order tracing met them. Any other order within the
dependencies computes the same values, and may hold fewer bytes at once (OLLA, Steiner et al.
2022; Inductor's ``reorder_for_peak_memory``). A forward that finishes one wide branch before it
starts the next holds one wide value at a time, not two:

    captured:  a = up1(x) [wide]; b = up2(x) [wide]; c = down1(a); d = down2(b)   ... a, b alive
    reordered: a = up1(x); c = down1(a); b = up2(x); d = down2(b)                 ... a or b alive

`memory_order` is a greedy list scheduler, after the "least peak memory first" rule of Inductor's
``topological_sort_lpmf``: among the nodes whose inputs have run, it runs the one with the least
peak so far after it runs plus the bytes it leaves alive beyond those before it (among the nodes
that keep the peak where it is, the one that leaves the fewest bytes alive, as LPMF; where each
raises it, not simply the one that raises it least, which would start a second wide value a byte
cheaper than finishing the first); ties keep the captured order. It orders the forward nodes, then the backward nodes (a
forward node never reads a backward one), each walk with its own memory model:

    "save_all"   the forward keeps what the backward reads; the backward frees each at its last read
    "recompute"  the forward frees everything at its last forward use (the backward recomputes it)

Neither walk knows what the solvers will decide (which values they SAVE, where they recompute),
and autograd's own order is a good one (a depth-first order by memory is much worse on the
transformers), so an order is only a candidate: `choose_order` runs the solvers' lowest-peak
search (`fxopt.solvers.minimum.lowest_plan`, which simulates every schedule it keeps) in the
captured order and in each candidate, and keeps a candidate only where its lowest peak is lower.
The planner then solves the step in both orders and keeps the better plan (`fxopt.planner`), so
the decision never makes a plan worse; the smallest budget is the lower of the two.

What may not move: inputs keep their places (placeholders first, in the calling convention's
order), and values nothing reads go last; an op that takes an output out of a tuple runs right
after the tuple; ops that cannot be recomputed (random ops, mutations, collectives: `Node.recomputable`
False) and the caller's ``pinned`` ones (the all-gathers and their waits, which a re-gather may
recompute: see `fxopt.passes.reorder`) keep their order among themselves, so the random stream
(dropout's masks) and every rank's collective order are as captured; and the caller's ``barriers`` (ops that may write into a value:
see `fxopt.passes.reorder`) keep everything before them before and everything after them after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from fxopt.solvers.graph import Graph
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.minimum import lowest_plan

MODELS = ("save_all", "recompute")

# The orders `choose_order` tries: (memory model, the kinds of node it reorders).
CANDIDATES = (("save_all", ("backward",)), ("recompute", ("backward",)),
              ("save_all", ("forward", "backward")), ("recompute", ("forward", "backward")))


@dataclasses.dataclass(frozen=True)
class Order:
    """An order `choose_order` accepted: the permutation (``order[k]``: the index, in the captured
    graph, of the node that runs k-th), the candidate that made it (memory model, kinds of node
    reordered), and the lowest peak the solvers reach in the captured order and in this one."""

    order: tuple[int, ...]
    model: str
    phases: tuple[str, ...]
    peak_before: int
    peak_after: int


def choose_order(graph: Graph, barriers: Iterable[int] = (), pinned: Iterable[int] = (), solver: str = "auto",
                 **lowest) -> Order | None:
    """Of the `CANDIDATES` orders, the one in which the solvers reach the lowest peak
    (`fxopt.solvers.minimum.lowest_plan` with ``solver`` and the keywords ``lowest``: effort,
    memo, time limit, MIP program; every schedule it tries simulated), if that is below the
    captured order's; None where none is (the captured order stands). Counted work: one
    lowest-peak search per distinct order whose proven floor (`peak_lower_bound`) is below the
    peak to beat (one whose floor is not cannot win)."""
    barriers, pinned = frozenset(barriers), frozenset(pinned)
    captured = tuple(range(len(graph)))
    orders: dict[tuple[int, ...], tuple[str, tuple[str, ...]]] = {}
    for model, phases in CANDIDATES:
        order = memory_order(graph, model, barriers, phases, pinned)
        if order != captured:
            orders.setdefault(order, (model, phases))
    if not orders:
        return None
    before = lowest_plan(graph, solver, **lowest).peak
    best: Order | None = None
    for order, (model, phases) in orders.items():
        candidate = reordered(graph, order)
        to_beat = before if best is None else best.peak_after
        if peak_lower_bound(candidate)[0] >= to_beat:
            continue  # (no schedule in it peaks below its floor: it cannot win, and is not searched)
        peak = lowest_plan(candidate, solver, **lowest).peak
        if peak < to_beat:
            best = Order(order, model, phases, before, peak)
    return best


def memory_order(graph: Graph, model: str = "recompute", barriers: Iterable[int] = (),
                 phases: Sequence[str] = ("forward", "backward"), pinned: Iterable[int] = ()) -> tuple[int, ...]:
    """A topological order of ``graph`` (a permutation of its indices) that the greedy list
    scheduler of the module chooses under memory ``model`` ("save_all" or "recompute") for the
    nodes of the kinds in ``phases``; the others keep their captured order. ``barriers`` and
    ``pinned`` (nodes that keep their order among themselves besides those that cannot be
    recomputed, as the collectives a re-gather may recompute): see the module."""
    if model not in MODELS:
        raise ValueError(f"unknown memory model {model!r}; one of {', '.join(MODELS)}")
    nodes = graph.nodes
    barriers, pinned = frozenset(barriers), frozenset(pinned)
    bad = sorted(b for b in barriers | pinned if not 0 <= b < len(nodes))
    if bad:
        raise ValueError(f"barriers or pinned nodes {bad} are not nodes of the graph ({len(nodes)} nodes)")
    inputs = [i for i, n in enumerate(nodes) if n.kind == "input"]
    leading = 0
    while leading < len(nodes) and nodes[leading].kind == "input":
        leading += 1
    unread = [i for i in inputs if i >= leading and not graph.users[i]]
    head = list(range(leading)) + [i for i in inputs if i >= leading and graph.users[i]]
    order = list(head)
    for kind in ("forward", "backward"):
        phase = [i for i, n in enumerate(nodes) if n.kind == kind]
        order += _Walk(graph, phase, kind, model, barriers, pinned).run() if kind in phases else phase
    order += unread
    return tuple(order)


def reordered(graph: Graph, order: Sequence[int]) -> Graph:
    """``graph`` with its nodes in ``order`` (``order[k]``: the index of the node that becomes
    node k), every index in it renumbered. Raises ValueError unless ``order`` is a permutation
    in which every node's inputs and storage precede it."""
    order = list(order)
    if sorted(order) != list(range(len(graph))):
        raise ValueError(f"an order must list each of the graph's {len(graph)} nodes once")
    new = {old: k for k, old in enumerate(order)}
    nodes = []
    for old in order:
        n = graph.nodes[old]
        nodes.append(dataclasses.replace(
            n, inputs=tuple(new[j] for j in n.inputs), storage=None if n.storage is None else new[n.storage],
            eager_reads=tuple(new[j] for j in n.eager_reads)))
    return Graph(tuple(nodes), graph.transfers)  # (its checks refuse an order that is not topological)


class _Walk:
    """One phase's greedy walk (see the module): bytes alive by storage, each storage let go once
    no node of the phase still to run reads it (unless ``kept``)."""

    def __init__(self, graph: Graph, phase: list[int], kind: str, model: str, barriers: frozenset[int],
                 pinned: frozenset[int]):
        self.graph, self.phase, self.nodes = graph, phase, graph.nodes
        members = set(phase)
        roots = graph.roots
        # Which storage this phase may free: not the resident values, the outputs (the caller's
        # and the gradients), the tangents; in the forward under "save_all", not what the backward
        # reads; in the backward under "recompute", no forward storage (it is not there to free).
        kept = {roots[i] for i in graph.resident | graph.forward_outputs}
        kept |= {roots[i] for i, n in enumerate(self.nodes) if n.output or n.tangent}
        if kind == "forward" and model == "save_all":
            kept |= {roots[j] for b in graph.backward_nodes for j in self.nodes[b].inputs}
        self.counted = {r for r in {roots[j] for i in phase for j in (i, *self.nodes[i].inputs)}
                        if r not in kept and (r in members or (kind == "backward" and model == "save_all"))}
        # Readers still to run, by storage.
        self.readers: dict[int, int] = {}
        for i in phase:
            for r in {roots[j] for j in self.nodes[i].inputs} & self.counted:
                self.readers[r] = self.readers.get(r, 0) + 1
        self.live = sum(self.nodes[r].bytes for r in self.counted - members)  # forward storage the backward starts with
        # Dependencies inside the phase: inputs, the order of the ops that cannot be recomputed
        # and of the pinned ones, and barriers.
        self.preds: dict[int, set[int]] = {i: {j for j in self.nodes[i].inputs if j in members} for i in phase}
        chain = [i for i in phase if not self.nodes[i].recomputable or i in pinned | barriers]
        for a, b in zip(chain, chain[1:]):
            self.preds[b].add(a)
        for k, b in enumerate(phase):
            if b in barriers:
                for a in phase[:k]:
                    self.preds[b].add(a)
                for c in phase[k + 1:]:
                    self.preds[c].add(b)
        self.succs: dict[int, list[int]] = {i: [] for i in phase}
        for b, ps in self.preds.items():
            for a in ps:
                self.succs[a].append(b)
        # An output taken out of a tuple follows the tuple at once.
        self.items = {i: [u for u in graph.users[i] if u in graph.tuple_items and u in members]
                      for i in phase if not self.nodes[i].tensor}

    def run(self) -> list[int]:
        nodes, roots = self.nodes, self.graph.roots
        waiting = {i: len(ps) for i, ps in self.preds.items()}
        ready = {i for i, w in waiting.items() if w == 0}
        position = {i: k for k, i in enumerate(self.phase)}
        peak, order, done = self.live, [], set()

        def group(i: int) -> list[int]:
            return [i] + [u for u in self.items.get(i, ()) if self.preds[u] <= done | {i}]

        def effect(i: int) -> tuple[int, int]:
            """(bytes while ``i``'s group runs, bytes alive after it)."""
            members = group(i)
            made = sum(nodes[u].bytes for u in members if roots[u] == u and u in self.counted)
            reads: dict[int, int] = {}
            for u in members:
                for r in {roots[j] for j in nodes[u].inputs} & self.counted:
                    reads[r] = reads.get(r, 0) + 1
            freed = sum(nodes[r].bytes for r, n in reads.items() if self.readers[r] == n)
            freed += sum(nodes[u].bytes for u in members
                         if roots[u] == u and u in self.counted and not self.readers.get(u))
            during = self.live + made + max(nodes[u].workspace for u in members)
            return during, self.live + made - freed

        def score(i: int) -> int:
            during, after = effects[i]
            return max(peak, during) + after - self.live

        while ready:
            effects = {i: effect(i) for i in ready}
            chosen = min(ready, key=lambda i: (score(i), position[i]))
            during, after = effects[chosen]
            peak = max(peak, during)
            for u in group(chosen):
                ready.discard(u)
                done.add(u)
                order.append(u)
                for r in {roots[j] for j in nodes[u].inputs} & self.counted:
                    self.readers[r] -= 1
                for s in self.succs[u]:
                    waiting[s] -= 1
                    if waiting[s] == 0 and s not in done:
                        ready.add(s)
            self.live = after
        if len(order) != len(self.phase):
            raise ValueError("the graph's dependencies have a cycle")  # (a barrier inside a tuple's items)
        return order
