"""Where a pipeline may cut a training step, and each stage's part of its graph.

  - **Cut points** (`cut_points`). The forward, in program order (the order torch's pipeline
    splits in), is cut after a value where a few tensors cross: values computed before it and
    read after it (``crossing``; a backward-only value reading across counts, as for
    `articulation_values`). No parameter or input may be read on both sides (a tied weight:
    torch's pipelining does not keep its copies in step). DAGs with skip connections are fine:
    a U-Net's cut carries the skips across it. `choose_points` takes the fewest tensors per cut
    (1, then 2, ...) that give enough points.
  - **Stages** (`assign_stages`, `stage_graph`). With the cuts chosen, every node gets a stage: a
    forward value the one its position falls in; a parameter the stage that first reads it; a
    backward node the latest stage that holds what it reads and, given ``origins`` (AOTAutograd's
    ``seq_nr``), its forward op: a weight's gradient is made where the weight lives. A stage's
    solver graph takes what it reads from other stages as inputs (resident: received
    activations) or tangents (the gradients it receives), and marks what other stages read as
    outputs (sent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from fxopt.solvers.graph import Graph, Node

# The most tensors a cut may carry.
MAX_CROSSING = 4

# Cut points wanted per stage before a cut may carry more tensors, and the most the DP is given
# when fewer tensors per cut already allow a split (see `choose_points`).
POINTS_PER_STAGE = 2
MAX_POINTS = 256



@dataclasses.dataclass(frozen=True)
class CutPoint:
    """A place to cut the forward: after ``forward[position]`` (the graph node ``after``), with
    the values ``crossing`` read on both sides, ``bytes`` of storage (``saved_bytes`` of it read
    by the backward: SAVEd where the cut falls inside a stage)."""

    position: int
    after: int
    crossing: tuple[int, ...]
    bytes: int
    saved_bytes: int = 0


def forward_order(graph: Graph) -> list[int]:
    """The forward's values in program order (views of parameters aside)."""
    return sorted(graph.forward_required - graph.resident)


def input_spans(graph: Graph, order: list[int] | None = None) -> dict[int, tuple[int, int]]:
    """For each parameter or input the forward reads, the first and last positions reading it:
    no cut may fall in between."""
    order = forward_order(graph) if order is None else order
    spans: dict[int, tuple[int, int]] = {}
    for q, i in enumerate(order):
        for j in graph.nodes[i].inputs:
            if j in graph.resident:
                r = graph.roots[j]
                spans[r] = (spans.get(r, (q, q))[0], q)
    return spans


def _reach(graph: Graph, order: list[int]) -> tuple[dict[int, int], list[int]]:
    """For each forward value, the last position of the forward reading it (a backward-only value
    reading it counts at its latest input); and per position, how many parameters or inputs are
    read both at or before it and after it."""
    nodes, pos = graph.nodes, {v: q for q, v in enumerate(order)}
    last: dict[int, int] = {}
    for q, i in enumerate(order):
        for j in nodes[i].inputs:
            if j in pos:
                last[j] = max(last.get(j, q), q)
    for b in sorted(graph.backward_only - graph.resident):
        ins = [pos[u] for u in nodes[b].inputs if u in pos]
        for u in nodes[b].inputs:
            if u in pos and ins:
                last[u] = max(last.get(u, pos[u]), max(ins))
    blocked = [0] * (len(order) + 1)
    for a, b in input_spans(graph, order).values():
        if b > a:
            blocked[a] += 1
            blocked[b] -= 1
    return last, list(np.cumsum(blocked[:-1]))


def cut_points(graph: Graph, *, max_tensors: int = MAX_CROSSING, allowed: Callable[[int], bool] | None = None
               ) -> list[CutPoint]:
    """Every place the forward can be cut with at most ``max_tensors`` tensors crossing, no
    parameter or input read on both sides, and (``allowed``, given a position) where the caller
    can split. In forward order; points with the same crossing values keep the first."""
    order = forward_order(graph)
    nodes = graph.nodes
    last, blocked = _reach(graph, order)
    starts: list[list[int]] = [[] for _ in order]
    ends: list[list[int]] = [[] for _ in order]
    pos = {v: q for q, v in enumerate(order)}
    for v, q in last.items():
        if q > pos[v]:
            starts[pos[v]].append(v)
            ends[q].append(v)
    read_back = {graph.roots[j] for j in graph.backward_needs} | {
        graph.roots[j] for b in graph.backward_only for j in nodes[b].inputs}
    active: set[int] = set()
    out: list[CutPoint] = []
    seen: set[tuple[int, ...]] = set()
    for q in range(len(order) - 1):
        active.update(starts[q])
        active.difference_update(ends[q])
        if blocked[q] or not active or len(active) > max_tensors:
            continue
        if any(not nodes[v].tensor for v in active) or (allowed is not None and not allowed(q)):
            continue
        crossing = tuple(sorted(active))
        if crossing in seen:
            continue
        seen.add(crossing)
        roots = {graph.roots[v] for v in crossing} - graph.resident
        out.append(CutPoint(q, order[q], crossing, sum(nodes[r].bytes for r in roots),
                            sum(nodes[r].bytes for r in roots & read_back)))
    return out


def choose_points(graph: Graph, stages: int, allowed: Callable[[int], bool] | None = None) -> list[CutPoint]:
    """The cut points carrying the fewest tensors (1, 2, ... `MAX_CROSSING`) of which there are at
    least `POINTS_PER_STAGE` per stage: the coarsest structure (a transformer's residual stream, a
    CNN's block outputs) that leaves the DP a choice. Where more tensors per cut would give over
    `MAX_POINTS` points, fewer are kept as long as they are enough to cut at all."""
    enough: list[CutPoint] | None = None
    points: list[CutPoint] = []
    for t in range(1, MAX_CROSSING + 1):
        points = cut_points(graph, max_tensors=t, allowed=allowed)
        if len(points) >= POINTS_PER_STAGE * stages:
            return enough if enough is not None and len(points) > MAX_POINTS else points
        if len(points) >= stages - 1:
            enough = points
    return points


def assign_stages(graph: Graph, positions: Sequence[int], origins: Sequence | None = None
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """The stage of every node when the forward is cut after the given forward positions (see the
    module docstring; -1 for an input no forward value reads), and the conflicts: pairs of stages
    (earlier, later) that some backward node needs values of both from, which no cut between them
    can give it (a cut there must go). ``origins``: per node, a label shared by a forward op and
    the backward nodes that differentiate it (AOTAutograd's ``seq_nr``); a backward node then goes
    to the latest stage it can run in that holds its forward op, else to the latest it can run in."""
    order, nodes = forward_order(graph), graph.nodes
    count = len(positions) + 1
    stage = [-1] * len(nodes)
    s, cuts = 0, sorted(positions)
    for q, i in enumerate(order):
        stage[i] = s
        if s < len(cuts) and q == cuts[s]:
            s += 1
    reach = list(stage)  # the latest stage a forward value is available in
    for i in order:
        for j in nodes[i].inputs:
            if j in graph.resident and stage[graph.roots[j]] < 0:
                stage[graph.roots[j]] = reach[graph.roots[j]] = stage[i]  # its first reader owns it
            if stage[j] >= 0 and nodes[j].kind == "forward":
                reach[j] = max(reach[j], stage[i])
    for b in sorted(graph.backward_only - graph.resident):  # it reads across too (see `_reach`)
        ins = [j for j in nodes[b].inputs if stage[j] >= 0 and nodes[j].kind == "forward"]
        for j in ins:
            reach[j] = max(reach[j], max(stage[u] for u in ins))
    holds: dict = {}
    for i in order:
        if origins is not None and origins[i] is not None:
            holds.setdefault(origins[i], set()).add(stage[i])
    conflicts: list[tuple[int, int]] = []
    for i, node in enumerate(nodes):
        if stage[i] >= 0 and node.kind != "backward":
            continue
        if node.kind == "input":
            stage[i] = reach[i] = count - 1 if node.tangent else stage[graph.roots[i]]
            continue
        ahead = [j for j in node.inputs if nodes[j].kind != "backward" and not nodes[j].tangent]
        behind = [stage[j] for j in node.inputs if nodes[j].kind == "backward" or nodes[j].tangent]
        lo = max((stage[j] for j in ahead), default=0)
        hi = min([reach[j] for j in ahead] + behind + [count - 1])
        if hi < lo:
            conflicts.append((hi, lo))
        mine = [t for t in holds.get(origins[i] if origins is not None else None, ()) if lo <= t <= hi]
        stage[i] = (max(mine) if mine else max(lo, hi)) if node.kind == "backward" else lo
        reach[i] = hi if node.kind == "forward" else stage[i]
    return stage, conflicts


def stage_graph(graph: Graph, stage: list[int], s: int) -> Graph:
    """Stage ``s``'s solver graph: its nodes, with what they read from other stages as inputs
    (forward values and parameters: resident; backward values: tangents) and what other stages
    read from it as outputs."""
    nodes = graph.nodes
    members = [i for i, n in enumerate(nodes) if stage[i] == s and n.kind != "input"]
    mine = set(members)
    read_outside = {j for i, n in enumerate(nodes) if stage[i] != s for j in n.inputs if j in mine}
    externals = sorted({j for i in members for j in nodes[i].inputs if j not in mine})
    index: dict[int, int] = {}
    root_input: dict[int, int] = {}
    out: list[Node] = []
    for j in externals:
        node, r = nodes[j], graph.roots[j]
        tangent = node.kind == "backward" or node.tangent
        first = r not in root_input
        index[j] = len(out)
        if first:
            root_input[r] = len(out)
        share = None if first or tangent else root_input[r]
        out.append(Node(node.name, "input", bytes=nodes[r].bytes if first else 0, storage=share, tangent=tangent,
                        tensor=node.tensor))
    for i in members:
        node, r = nodes[i], graph.roots[i]
        storage = None if r == i else index.get(r, root_input.get(r))
        if r != i and r in mine:
            storage = index[r]
        index[i] = len(out)
        out.append(dataclasses.replace(node, inputs=tuple(index[j] for j in node.inputs), storage=storage,
                                       output=node.output or i in read_outside))
    return Graph(tuple(out), graph.transfers)
