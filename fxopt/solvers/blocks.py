"""Repeated blocks: the step cut into a chain of segments, and the segments that are copies of
one another found, so that each kind is analyzed and solved once (`fxopt.solvers.block_plan`).

A segment is a run of the forward (a transformer layer; the embedding before the layers; the
final norm, head and loss after them) with the backward nodes that are its backward. Where the
analysis recorded the repeated modules a value is computed in (`Node.blocks`), each outermost
block is a segment and each run between blocks is one; otherwise the forward is cut at its
articulation values (`fxopt.solvers.heuristics.checkpoint_cuts`). A backward-only value is in
the latest segment it reads. A backward node is in the latest segment whose own values it reads
(never a later one than the backward node before it: the backward runs the segments in reverse);
one that reads none of them is in the latest segment reading the parameters or inputs it reads
(an embedding's weight gradient), else (a sum of gradients, a view) in that of the node before it.

Each segment cut out of the step is a graph of its own (`Segment.index` maps its nodes back):
what it reads from outside becomes an input of it (a tangent where that is a backward value: the
gradient flowing in from the segment after it), and what the rest of the step reads from it an
output (the value the next segment starts from, the gradient flowing out). Inputs are numbered
in the order the segment first reads them. Two segments are copies when their graphs are equal
but for names (`_shape`): the same ops, sizes, costs and edges, in the same order; a transformer's
layers are, but for the first, whose backward also holds the embedding's. Each kind of segment
keeps the graph of its first copy (`Blocks.kinds`).

For example, a 3-layer chain x → [l0] → [l1] → [l2] → loss is cut into 5 segments: what comes
before the first layer, the three layers (one kind when they are copies) and the loss. The value
each layer hands to the next (``a0`` from l0 to l1) is an output of l0 and an input of l1::

    l1 as a graph of its own:   inputs  a0, W1 (parameters), dy1 (a tangent: d loss / d a1)
                                nodes   l1's forward values, l1's backward nodes
                                outputs a1 (read by l2), dx1 (= d loss / d a0, read by l0's backward),
                                        dW1

What segments read from one another and the backward needs (``a0`` above, a RoPE table every
layer reads) is SAVEd whatever the plan (`Blocks.forced`): it is an input, always there, in each
segment's own graph.
"""

from __future__ import annotations

import dataclasses

from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.heuristics import checkpoint_cuts
from fxopt.solvers.policies import block_of


# The copies of one kind that make a step one of repeated blocks (`find_blocks`): a deep step.
# A shallower one is planned whole, fast enough, and better where a layer is little more than
# the value it hands the next (the blocks' plans SAVE those, or recompute them all).
MIN_COPIES = 6


@dataclasses.dataclass(frozen=True)
class Segment:
    index: tuple[int, ...]  # per node of its own graph, the step's node: its inputs, then its members
    inputs: int  # how many of ``index`` are inputs (from outside the segment)
    kind: int  # which of `Blocks.kinds` it is a copy of

    @property
    def members(self) -> tuple[int, ...]:
        """The step's nodes in it (forward values and backward nodes), in graph order."""
        return self.index[self.inputs:]


@dataclasses.dataclass(frozen=True, eq=False)
class Blocks:
    graph: Graph
    segments: tuple[Segment, ...]  # in forward order
    kinds: tuple[Graph, ...]  # each kind's graph (its first copy's)
    forced: frozenset[int]  # values segments read from one another that the backward needs: SAVEd

    def copies(self, kind: int) -> list[int]:
        """The segments that are copies of ``kind``."""
        return [s for s, seg in enumerate(self.segments) if seg.kind == kind]

    @property
    def depth(self) -> int:
        """The most copies of one kind."""
        return max(len(self.copies(k)) for k in range(len(self.kinds)))


def find_blocks(graph: Graph, min_copies: int | None = None) -> Blocks | None:
    """The step as a chain of segments, its identical ones grouped; None where the forward is not
    cut into at least three segments or no kind has ``min_copies`` copies (`MIN_COPIES`)."""
    if not graph.backward_nodes or len({n.name for n in graph.nodes}) < len(graph.nodes):
        return None  # (names are how a timeline's events are read back)
    segment_of = _forward_segments(graph)
    count = 1 + max(segment_of.values(), default=-1)
    if count < 3:
        return None
    exported = _exported(graph, segment_of)
    members: list[list[int]] = [[] for _ in range(count)]
    for i, s in segment_of.items():
        members[s].append(i)
    for b, s in zip(graph.backward_nodes, _assign_backward(graph, segment_of, exported, count)):
        members[s].append(b)
    kinds: dict[tuple, int] = {}
    graphs: list[Graph] = []
    segments = []
    live = set(segment_of) | set(graph.backward_nodes)  # (a forward value nothing needs never runs)
    for mine in members:
        index, inputs, fields = _cut_out(graph, sorted(mine), live)
        kind = kinds.setdefault(_shape(fields), len(kinds))
        if kind == len(graphs):
            graphs.append(_local(fields))
        segments.append(Segment(index, inputs, kind))
    blocks = Blocks(graph, tuple(segments), tuple(graphs), _forced(graph, segments))
    return blocks if blocks.depth >= (MIN_COPIES if min_copies is None else min_copies) else None


def _forward_segments(graph: Graph) -> dict[int, int]:
    """The segment of each forward value the step computes (not resident), numbered in forward
    order: by outermost block where the analysis recorded them, else between articulation values.
    A backward-only value goes with the latest segment it reads."""
    order = sorted(graph.forward_required - graph.resident)
    out: dict[int, int] = {}
    if any(graph.nodes[i].blocks for i in order):
        block = block_of(graph, 1)
        s = 0
        for k, i in enumerate(order):
            s += k > 0 and block[i] != block[order[k - 1]]
            out[i] = s
    else:
        cuts, s = set(checkpoint_cuts(graph)), 0
        for i in order:
            out[i] = s
            s += i in cuts
    for i in sorted(graph.backward_only - graph.resident):
        out[i] = max((out[j] for j in graph.nodes[i].inputs if j in out), default=0)
    return out


def _exported(graph: Graph, segment_of: dict[int, int]) -> frozenset[int]:
    """Forward values the forward of another segment reads."""
    out = set()
    for i, mine in segment_of.items():
        out.update(j for j in graph.nodes[i].inputs if j in segment_of and segment_of[j] != mine)
    return frozenset(out)


def _forced(graph: Graph, segments: list[Segment]) -> frozenset[int]:
    """The forward values a segment reads from another (through views, what they are made from)
    that the backward needs: kept for it whatever the plan."""
    read = {j for seg in segments for j in seg.index[:seg.inputs] if graph.nodes[j].kind == "forward"}
    return graph.through_aliases(read & graph.needed_by_backward) & (graph.saveable | graph.free) - graph.resident


def _assign_backward(graph: Graph, segment_of: dict[int, int], exported: frozenset[int], count: int) -> list[int]:
    """Each backward node's segment (see the module): the latest segment whose own values it
    reads (a value another segment's forward reads too is no evidence: every layer reads the
    value before it and a RoPE table), never later than the node before it; else, where it reads
    parameters or inputs, the latest segment reading them (the embedding's weight gradient goes
    with the embedding); else the segment of the node before it."""
    readers: dict[int, set[int]] = {}  # resident value -> the segments whose forward reads it
    for i, s in segment_of.items():
        for j in graph.nodes[i].inputs:
            if j in graph.resident:
                readers.setdefault(j, set()).add(s)
    cur, out = count - 1, []
    for b in graph.backward_nodes:
        read = graph.through_aliases(graph.nodes[b].inputs)
        own = [segment_of[j] for j in read if j in segment_of and j not in exported]
        if own:
            cur = min(cur, max(own))
        else:
            near = [s for j in read for s in readers.get(j, ()) if s <= cur]
            cur = max(near, default=cur)
        out.append(cur)
    return out


def _cut_out(graph: Graph, members: list[int], live: set[int]) -> tuple[tuple[int, ...], int, list[dict]]:
    """A segment as a graph of its own (see the module): (its nodes' indices in the step, how many
    are inputs, each node's fields as a dict: `_local` makes the graph, `_shape` compares them).
    ``live``: the nodes that run (a reader outside them reads nothing)."""
    nodes = graph.nodes
    inside = set(members)
    outside: dict[int, None] = {}
    for i in members:
        for j in nodes[i].inputs:
            if j not in inside:
                outside.setdefault(j)
        s = nodes[i].storage
        if s is not None and s != i and s not in inside:
            outside.setdefault(s)
    index = (*outside, *members)
    local = {g: k for k, g in enumerate(index)}
    out: list[dict] = []
    for k, j in enumerate(outside):
        root = graph.roots[j]
        shares = root != j and local.get(root, k) < k
        out.append(vars(Node(name=nodes[j].name, kind="input", bytes=0 if shares else nodes[root].bytes,
                             storage=local[root] if shares else None, tensor=nodes[j].tensor,
                             tangent=nodes[j].kind == "backward" or nodes[j].tangent)))
    users = graph.users
    for i in members:
        n = nodes[i]
        read_outside = any(u not in inside and u in live for u in users[i])
        out.append({**vars(n), "inputs": tuple(local[j] for j in n.inputs),
                    "storage": None if n.storage is None or n.storage == i else local[n.storage],
                    "output": n.output or read_outside, "blocks": (), "eager_reads": (),
                    "backward_formula": None if n.backward_formula is None else 0})
    return index, len(outside), out


def _local(fields: list[dict]) -> Graph:
    return Graph(tuple(Node(**f) for f in fields))


def _shape(fields: list[dict]) -> tuple:
    """What makes two segments copies: their graphs but for names."""
    return tuple(tuple(v for k, v in f.items() if k != "name") for f in fields)
