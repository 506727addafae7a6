"""Schedules of a training step and the simulator that gives their memory timeline.

A `Schedule` is what every solver returns and what the recompute pass turns into code:

  - ``saved``: forward values kept from the forward for the backward (SAVE);
  - ``backward``: the nodes the backward computes, in order. Every backward node appears exactly
    once; a forward node appearing there is a recomputation (RECOMPUTE), and may appear again;
  - ``compressed``: SAVEd values kept compressed (COMPRESS, see `fxopt.analysis.codecs`): encoded right
    after their last forward use (of them or a view of them), decoded right before the backward
    first reads them.

The simulator frees every value right after its last use, exactly as the generated code does: FX
code drops each local after its last use, and the backward takes its inputs boxed, so saved
tensors die early too. Forward outputs are held by the caller, gradients are kept, and the
incoming gradients (tangents) are held by the autograd engine until the backward returns, so
none of these is freed. A multi-output op's tuple holds every output it made, so an output taken
out of it lives at least as long as the tuple. It counts with `fxopt.solvers.liveness`, the memory
model the ILP and the instant program's bound count with too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from fxopt.solvers.graph import Graph
from fxopt.solvers.liveness import Key, LiveBytes, last_uses


class InvalidScheduleError(ValueError):
    """A schedule reads a value that is not available, or skips or repeats a backward node."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    saved: frozenset[int]
    backward: tuple[int, ...]
    compressed: frozenset[int] = frozenset()

    def recomputed(self, graph: Graph) -> tuple[int, ...]:
        return tuple(i for i in self.backward if graph.nodes[i].kind == "forward")

    def to_dict(self) -> dict:
        return {"saved": sorted(self.saved), "backward": list(self.backward), "compressed": sorted(self.compressed)}

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        return cls(frozenset(d["saved"]), tuple(d["backward"]), frozenset(d.get("compressed", ())))


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Memory after each allocation of the step, in bytes."""

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    saved_bytes: int  # bytes of SAVEd storage alive at the end of the forward
    recompute_flops: int  # FLOPs beyond one execution of every node (compression included)
    recompute_cost: float  # the same in the cost model's seconds
    events: tuple[tuple[str, str, int], ...]  # (phase, node name, bytes live while it runs)


def forward_set(graph: Graph, saved: Iterable[int]) -> list[int]:
    """Forward values computed in the forward pass, in order."""
    return sorted(graph.forward_required | (frozenset(saved) & graph.backward_only))


def simulate(graph: Graph, schedule: Schedule) -> Timeline:
    """Replay the schedule and return its memory timeline; raise if it is not valid."""
    _check(graph, schedule)
    replay = _Replay(graph, schedule)
    replay.forward()
    steps = _pruned(graph, _copies(graph, schedule.backward, replay.available()))
    replay.backward(steps)
    extra_flops, extra_cost = _extra_work(graph, schedule, steps)
    return Timeline(
        peak_bytes=max(replay.forward_peak, replay.backward_peak),
        forward_peak_bytes=replay.forward_peak,
        backward_peak_bytes=replay.backward_peak,
        saved_bytes=replay.saved_bytes,
        recompute_flops=extra_flops,
        recompute_cost=extra_cost,
        events=tuple(replay.events),
    )


def _check(graph: Graph, schedule: Schedule) -> None:
    """Raise `InvalidScheduleError` unless the forward can run and SAVE as the schedule says, and
    its backward runs every backward node once, in order, recomputing only what may be."""
    nodes = graph.nodes
    saved = frozenset(schedule.saved)
    bad = saved - graph.saveable - graph.free
    if bad:
        raise InvalidScheduleError(f"cannot save {_names(graph, bad)}: not computed in the forward")
    bad = frozenset(schedule.compressed) - (saved & graph.compressible)
    if bad:
        raise InvalidScheduleError(f"cannot compress {_names(graph, bad)}: not saved, or no codec for it")
    backward = [i for i in schedule.backward if nodes[i].kind == "backward"]
    if backward != list(graph.backward_nodes):
        raise InvalidScheduleError("the backward must run every backward node once, in graph order")
    fwd = forward_set(graph, saved)
    fwd_computed = set(fwd)
    seen_once: set[int] = set()
    for i in schedule.backward:
        node = nodes[i]
        if node.kind == "forward" and not node.recomputable:
            if i in fwd_computed or i in seen_once:
                raise InvalidScheduleError(f"{node.name} cannot be recomputed (random, mutating or a collective)")
            seen_once.add(i)
    for i in fwd:
        for j in nodes[i].inputs:
            if nodes[j].kind == "forward" and j not in fwd_computed:
                raise InvalidScheduleError(f"{nodes[i].name} needs {nodes[j].name}, which the forward does not compute")


# One computation of a value in the backward: (node, its copy (node, n), the copies it reads).
Step = tuple[int, Key, list[Key]]


def _copies(graph: Graph, backward: Iterable[int], available: dict[int, Key] | None) -> list[Step]:
    """The backward's steps, each with the copies it reads: the latest computed, else the one
    ``available`` as the backward starts (a missing one is an `InvalidScheduleError`). With
    ``available=None`` every value the backward has not computed yet is copy 0 (as `prune` needs)."""
    nodes = graph.nodes
    current = dict(available or {})
    count: dict[int, int] = {}
    steps: list[Step] = []
    for e, i in enumerate(backward):
        args = []
        for j in nodes[i].inputs:
            if j in current:
                args.append(current[j])
            elif available is None:
                args.append((j, 0))
            else:
                raise InvalidScheduleError(
                    f"backward step {e} computes {nodes[i].name} but {nodes[j].name} is not available"
                )
        count[i] = count.get(i, 0) + 1
        current[i] = (i, count[i])
        steps.append((i, current[i], args))
    return steps


def _pruned(graph: Graph, steps: list[Step]) -> list[Step]:
    """The steps the generated code keeps: a recomputation nothing reads afterwards is dropped
    (dead-code elimination), so it neither runs nor allocates."""
    return [steps[e] for e in _read_events(graph, steps)]


class _Replay:
    """The generated code's memory, step by step: a `LiveBytes` over the storage of every copy of
    every value, a copy freed right after its last use (see the module)."""

    def __init__(self, graph: Graph, schedule: Schedule):
        self.graph, self.nodes = graph, graph.nodes
        self.saved = frozenset(schedule.saved)
        self.compressed = frozenset(schedule.compressed)
        self.memory = LiveBytes(graph)
        self.events: list[tuple[str, str, int]] = []
        self.storage_of: dict[Key, Key] = {}  # copy -> the copy owning its storage
        self.current: dict[int, Key] = {}  # value -> its latest live copy
        self.forever: set[Key] = set()  # copies never freed: inputs, outputs, tangents
        # A multi-output op's tuple holds every output it made: an output taken out by a getitem
        # lives until both the getitem's value and the tuple are dead, and taking it out again from
        # the same copy of the tuple gives the same tensor.
        self.held: dict[Key, list[Key]] = {}  # tuple copy -> storages it holds
        self.taken: dict[tuple[Key, int], Key] = {}  # (tuple copy, getitem) -> storage
        self.packed: set[int] = set()  # compressed values whose storage is, for now, only the encoding
        self.forward_peak = self.backward_peak = self.saved_bytes = 0

    def create(self, i: int, n: int) -> Key:
        graph, nodes, copy = self.graph, self.nodes, (i, n)
        root = graph.roots[i]
        if root == i and i in graph.tuple_items:
            src = self.current[nodes[i].inputs[0]]
            key = self.taken.get((src, i))
            if key is None:
                key = self.taken[(src, i)] = copy
                self.held.setdefault(src, []).append(key)
                self.memory.hold(key)  # the tuple's reference
            self.storage_of[copy] = key
        elif root == i:
            self.storage_of[copy] = copy
        else:
            src = next((self.current[j] for j in nodes[i].inputs if graph.roots[j] == root), None)
            self.storage_of[copy] = self.storage_of[src] if src is not None else self.current.get(root, (root, 0))
        self.current[i] = copy
        self.memory.hold(self.storage_of[copy])
        return copy

    def drop(self, copy: Key) -> None:
        self.memory.release(self.storage_of[copy])
        for key in self.held.pop(copy, ()):
            self.memory.release(key)

    def record(self, phase: str, name: str, live: int) -> int:
        self.events.append((phase, name, live))
        return live

    def encode(self, j: int) -> int:
        """COMPRESS value j: its encoding is made, then its storage let go. Bytes while encoding."""
        self.memory.hold(("encoded", j), self.nodes[j].compressed_bytes)
        encoding = self.memory.bytes + self.nodes[j].codec_workspace
        self.drop(self.current[j])
        self.packed.add(j)
        return encoding

    def decode(self, j: int) -> int:
        """Decode value j for its first backward read; the encoding dies then. Bytes while decoding:
        the encoding (held since `encode`, counted once), the decoded value and the codec's scratch."""
        self.memory.hold(self.storage_of[self.current[j]])
        decoding = self.memory.bytes + self.nodes[j].codec_workspace
        self.memory.release(("encoded", j), self.nodes[j].compressed_bytes)
        self.packed.discard(j)
        return decoding

    def forward(self) -> None:
        graph, nodes = self.graph, self.nodes
        for i, node in enumerate(nodes):
            if node.kind == "input" and not node.tangent:
                self.forever.add(self.create(i, 0))
        fwd = forward_set(graph, self.saved)
        fwd_pos = {i: k for k, i in enumerate(fwd)}
        last = last_uses([j for j in nodes[i].inputs if nodes[j].kind == "forward"] for i in fwd)
        keep = self.saved | graph.forward_outputs
        dying_at: dict[int, list[int]] = {}
        for i in fwd:
            if i not in keep:
                dying_at.setdefault(last.get(i, fwd_pos[i]), []).append(i)
        # A compressed value is encoded once neither it nor a view of it has a forward use left.
        compress_at: dict[int, list[int]] = {}
        if self.compressed:
            done_with: dict[int, int] = {}
            for i in fwd:
                r = graph.roots[i]
                done_with[r] = max(done_with.get(r, -1), last.get(i, fwd_pos[i]))
            for i in self.compressed:
                compress_at.setdefault(done_with[i], []).append(i)
        peak = self.memory.bytes
        for k, i in enumerate(fwd):
            self.create(i, 0)
            peak = max(peak, self.record("forward", nodes[i].name, self.memory.bytes + nodes[i].workspace))
            for j in dying_at.get(k, ()):
                self.drop(self.current.pop(j))
            for j in compress_at.get(k, ()):
                peak = max(peak, self.record("forward", f"compress {nodes[j].name}", self.encode(j)))
        self.forward_peak = peak
        for i in graph.forward_outputs:
            self.forever.add(self.current[i])
        held_saved = {self.storage_of[self.current[i]][0] for i in self.saved - graph.free - self.packed
                      if i in self.current}
        self.saved_bytes = (sum(nodes[r].bytes for r in held_saved)
                            + sum(nodes[i].compressed_bytes for i in self.packed))

    def available(self) -> dict[int, Key]:
        """What the backward starts with: saved values, tangents and forward outputs (its inputs)."""
        out = dict(self.current)
        for i, node in enumerate(self.nodes):
            if node.tangent:
                out[i] = (i, 0)
        return out

    def backward(self, steps: list[Step]) -> None:
        nodes = self.nodes
        last = last_uses(args for _, _, args in steps)
        for i, node in enumerate(nodes):
            if node.tangent:
                # The autograd engine holds the incoming gradients until the backward returns.
                self.forever.add(self.create(i, 0))
        # Values the backward never reads are freed as soon as it starts (boxed inputs).
        for i, copy in list(self.current.items()):
            if copy not in self.forever and copy not in last:
                if i in self.packed:
                    self.memory.release(("encoded", i), nodes[i].compressed_bytes)
                    self.packed.discard(i)
                else:
                    self.drop(copy)
                del self.current[i]
        peak = self.record("backward", "<start>", self.memory.bytes)
        for e, (i, copy, args) in enumerate(steps):
            for j in nodes[i].inputs:
                if j in self.packed:
                    peak = max(peak, self.record("backward", f"decompress {nodes[j].name}", self.decode(j)))
            for j, a in zip(nodes[i].inputs, args):
                self.current[j] = a  # the copy this node reads
            self.create(i, copy[1])
            peak = max(peak, self.record("backward", nodes[i].name, self.memory.bytes + nodes[i].workspace))
            for a in dict.fromkeys(args):
                if last.get(a) == e and a not in self.forever:
                    self.drop(a)
            if copy not in last and not nodes[i].output:
                self.drop(copy)
            elif nodes[i].output:
                self.forever.add(copy)
        self.backward_peak = peak


def _extra_work(graph: Graph, schedule: Schedule, steps: list[Step]) -> tuple[int, float]:
    """FLOPs and cost beyond one execution of every node: recomputations (the first backward
    computation of a value only the backward needs is not one), encoding and decoding."""
    nodes = graph.nodes
    first_free = set(graph.backward_only - frozenset(schedule.saved))
    extra_flops, extra_cost = 0, 0.0
    for i, _, _ in steps:
        if nodes[i].kind != "forward":
            continue
        if i in first_free:
            first_free.discard(i)
            continue
        extra_flops += nodes[i].flops
        extra_cost += nodes[i].cost
    for i in frozenset(schedule.compressed):
        extra_flops += nodes[i].codec_flops
        extra_cost += nodes[i].codec_cost
    return extra_flops, extra_cost


def _read_events(graph: Graph, steps: list[Step]) -> list[int]:
    """Positions of the steps the generated code keeps: backward nodes, and recomputations read
    by a kept step (a multi-output op's outputs stay with it: it allocates them all)."""
    nodes = graph.nodes
    needed: set[Key] = set()
    keep = [False] * len(steps)
    for e in range(len(steps) - 1, -1, -1):
        i, copy, args = steps[e]
        if nodes[i].kind == "backward" or copy in needed:
            keep[e] = True
            needed.update(args)
    for e, (i, copy, args) in enumerate(steps):
        if not keep[e] and len(args) == 1 and args[0] in needed and not nodes[args[0][0]].tensor:
            keep[e] = True  # an output of a kept tuple
    return [e for e in range(len(steps)) if keep[e]]


def prune(graph: Graph, schedule: Schedule) -> Schedule:
    """`schedule` without the recomputations nothing reads (what the generated code drops)."""
    kept = _read_events(graph, _copies(graph, schedule.backward, None))
    if len(kept) == len(schedule.backward):
        return schedule
    return dataclasses.replace(schedule, backward=tuple(schedule.backward[e] for e in kept))


def on_demand(graph: Graph, saved: Iterable[int]) -> Schedule:
    """The backward for a given SAVE set: before each backward node, recompute the values it needs
    that are not available, from the nearest available ones, and keep them until their last use
    (what `torch.utils.checkpoint` does for a segment)."""
    builder = OnDemand(graph, saved)
    for b in graph.backward_nodes:
        builder.run(b)
    return prune(graph, Schedule(builder.saved, builder.backward()))


def required_saves(graph: Graph, saved: Iterable[int]) -> frozenset[int]:
    """``saved`` as a schedule must have it: no views (a schedule makes them fresh from their
    base), and every value the backward reads for free or cannot recompute."""
    return (frozenset(saved) - graph.aliases) | (graph.needed_by_backward & graph.free) | must_save(graph)


class OnDemand:
    """A backward built node by node for a SAVE set: `run` recomputes, just before a backward node,
    what it needs that is not available, from the nearest available values; what is recomputed
    stays available until `forget` says otherwise. `on_demand` forgets nothing (the generated code
    frees each value after its last use anyway); the ILP's rounding and the instant program's plans
    forget what their solution does not keep."""

    def __init__(self, graph: Graph, saved: Iterable[int]):
        self.graph = graph
        self.saved = required_saves(graph, saved)
        # What the backward starts with (as `simulate` has it): resident values, forward outputs,
        # tangents, and the SAVEd values the forward computes.
        self.available = set(graph.resident) | set(graph.forward_outputs) | (set(forward_set(graph, self.saved)) & self.saved)
        self.available |= {i for i, n in enumerate(graph.nodes) if n.tangent}
        self.recomputed: set[int] = set()  # recomputed and still available
        self.events: list[int] = []

    def run(self, b: int) -> None:
        missing = _missing(self.graph, self.graph.nodes[b].inputs, self.available)
        self.events.extend(missing)
        self.available.update(missing)
        self.recomputed.update(missing)
        self.events.append(b)
        self.available.add(b)

    def recompute(self, wanted: Iterable[int], keep: Iterable[int]) -> None:
        """Recompute what ``wanted`` needs that is not available (from the nearest available
        values), and keep available only ``keep`` of it: the rest is used and let go (a segment
        recomputed to reach a checkpoint, as the chain solver does)."""
        missing = _missing(self.graph, wanted, self.available)
        self.events.extend(missing)
        kept = set(missing) & set(keep)
        self.available.update(kept)
        self.recomputed.update(kept)

    def forget(self, values: Iterable[int]) -> None:
        values = set(values)
        self.available -= values
        self.recomputed -= values

    def backward(self) -> tuple[int, ...]:
        return with_fresh_aliases(self.graph, self.events)


def read_before_recompute(graph: Graph, backward: Iterable[int]) -> frozenset[int]:
    """Values the backward reads before it recomputes them: the only SAVEd values worth keeping."""
    read: set[int] = set()
    recomputed: set[int] = set()
    for i in backward:
        read.update(j for j in graph.nodes[i].inputs if j not in recomputed)
        if graph.nodes[i].kind == "forward":
            recomputed.add(i)
    return frozenset(read)


def with_fresh_aliases(graph: Graph, events: Iterable[int]) -> tuple[int, ...]:
    """Finish an event list the way the generated code must run it:
    - before each event, fresh copies of the aliases (views) it reads;
    - right after each multi-output op (a tuple), all its outputs: the op allocates them together,
      so they are taken out at once and each lives as long as it is used."""
    out: list[int] = []
    taken: set[int] = set()  # outputs of the latest copy of each tuple, already emitted

    def emit(i: int) -> None:
        for j in dict.fromkeys(graph.nodes[i].inputs):
            if j in graph.aliases:
                emit(j)
        out.append(i)
        if not graph.nodes[i].tensor and graph.nodes[i].kind == "forward":
            for g in graph.users[i]:
                if graph.nodes[g].kind == "forward":
                    out.append(g)
                    taken.add(g)

    for i in events:
        if i in graph.aliases:
            continue
        if i in taken:
            taken.discard(i)
            continue
        emit(i)
    return tuple(out)


def _missing(graph: Graph, wanted: Iterable[int], avail: set[int]) -> list[int]:
    """Forward values (not aliases) to compute, in order, so that everything in `wanted` can be
    made available."""
    out: set[int] = set()
    stack = [j for j in graph.through_aliases(wanted) if j not in avail]
    while stack:
        i = stack.pop()
        if i in out:
            continue
        if graph.nodes[i].kind != "forward" or not graph.nodes[i].recomputable:
            raise InvalidScheduleError(f"{graph.nodes[i].name} is not available and cannot be recomputed")
        out.add(i)
        stack.extend(j for j in graph.through_aliases(graph.nodes[i].inputs) if j not in avail and j not in out)
    return sorted(out)


def must_save(graph: Graph) -> frozenset[int]:
    """Values the backward needs that cannot be recomputed (random ops, mutations): always SAVEd."""
    return frozenset(i for i in graph.needed_by_backward if not graph.nodes[i].recomputable) - graph.free - graph.aliases


def save_all_set(graph: Graph) -> frozenset[int]:
    """What eager autograd keeps: every forward value the backward reads (for a view, its base).
    Backward-only values that cannot be computed in the forward are made in the backward from
    the forward values they read, which are saved instead."""
    saved: set[int] = set()
    stack = list(graph.through_aliases(graph.backward_needs))
    seen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in seen or graph.nodes[i].kind != "forward":
            continue
        seen.add(i)
        if i in graph.saveable or not graph.nodes[i].recomputable:
            saved.add(i)
        else:
            stack.extend(graph.through_aliases(graph.nodes[i].inputs))
    return frozenset(saved)


def _names(graph: Graph, idx: Iterable[int]) -> str:
    return ", ".join(graph.nodes[i].name for i in sorted(idx))
