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
out of it lives at least as long as the tuple.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from fxopt.solvers.graph import Graph


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
    nodes = graph.nodes
    saved = frozenset(schedule.saved)
    bad = saved - graph.saveable - graph.free
    if bad:
        raise InvalidScheduleError(f"cannot save {_names(graph, bad)}: not computed in the forward")
    compressed = frozenset(schedule.compressed)
    bad = compressed - (saved & graph.compressible)
    if bad:
        raise InvalidScheduleError(f"cannot compress {_names(graph, bad)}: not saved, or no codec for it")
    backward = [i for i in schedule.backward if nodes[i].kind == "backward"]
    if backward != list(graph.backward_nodes):
        raise InvalidScheduleError("the backward must run every backward node once, in graph order")

    fwd_computed = set(forward_set(graph, saved))
    seen_once: set[int] = set()
    for i in schedule.backward:
        node = nodes[i]
        if node.kind == "forward" and not node.recomputable:
            if i in fwd_computed or i in seen_once:
                raise InvalidScheduleError(f"{node.name} cannot be recomputed (random, mutating or a collective)")
            seen_once.add(i)
    refs: dict[object, int] = {}  # storage key -> number of live values in it
    live_bytes = 0
    events: list[tuple[str, str, int]] = []

    def acquire(key: object, owner: int) -> None:
        nonlocal live_bytes
        if refs.get(key, 0) == 0:
            live_bytes += nodes[owner].bytes
        refs[key] = refs.get(key, 0) + 1

    def release(key: object, owner: int) -> None:
        nonlocal live_bytes
        refs[key] -= 1
        if refs[key] == 0:
            live_bytes -= nodes[owner].bytes

    # Instances: (node, n) where n counts computations of the node; storage key of an instance is
    # the instance owning the storage.
    storage_of: dict[tuple[int, int], tuple[int, int]] = {}
    current: dict[int, tuple[int, int]] = {}
    forever: set[tuple[int, int]] = set()
    # A multi-output op's tuple holds every output it made: an output taken out by a getitem
    # lives until both the getitem's value and the tuple are dead, and taking it out again from
    # the same copy of the tuple gives the same tensor.
    held: dict[tuple[int, int], list[tuple[int, int]]] = {}  # tuple instance -> storages it holds
    taken: dict[tuple[tuple[int, int], int], tuple[int, int]] = {}  # (tuple instance, getitem) -> storage

    def create(i: int, n: int) -> tuple[int, int]:
        inst = (i, n)
        root = graph.roots[i]
        if root == i and i in graph.tuple_items:
            src = current[nodes[i].inputs[0]]
            key = taken.get((src, i))
            if key is None:
                key = taken[(src, i)] = inst
                held.setdefault(src, []).append(key)
                acquire(key, i)  # the tuple's reference
            storage_of[inst] = key
        elif root == i:
            storage_of[inst] = inst
        else:
            src = next((current[j] for j in nodes[i].inputs if graph.roots[j] == root), None)
            storage_of[inst] = storage_of[src] if src is not None else current.get(root, (root, 0))
        current[i] = inst
        acquire(storage_of[inst], storage_of[inst][0])
        return inst

    def drop(inst: tuple[int, int]) -> None:
        release(storage_of[inst], storage_of[inst][0])
        for key in held.pop(inst, ()):
            release(key, key[0])

    for i, node in enumerate(nodes):
        if node.kind == "input" and not node.tangent:
            inst = create(i, 0)
            forever.add(inst)

    # ---- forward
    fwd = forward_set(graph, saved)
    fwd_pos = {i: k for k, i in enumerate(fwd)}
    keep = saved | graph.forward_outputs
    last_fwd_use: dict[int, int] = {}
    for k, i in enumerate(fwd):
        for j in nodes[i].inputs:
            if nodes[j].kind == "forward":
                if j not in fwd_pos:
                    raise InvalidScheduleError(f"{nodes[i].name} needs {nodes[j].name}, which the forward does not compute")
                last_fwd_use[j] = k
    dying_at: dict[int, list[int]] = {}
    for i in fwd:
        if i not in keep:
            dying_at.setdefault(last_fwd_use.get(i, fwd_pos[i]), []).append(i)
    # A compressed value is encoded once neither it nor a view of it has a forward use left.
    compress_at: dict[int, list[int]] = {}
    if compressed:
        done_with: dict[int, int] = {}
        for i in fwd:
            r = graph.roots[i]
            done_with[r] = max(done_with.get(r, -1), last_fwd_use.get(i, fwd_pos[i]))
        for i in compressed:
            compress_at.setdefault(done_with[i], []).append(i)
    packed: set[int] = set()  # compressed values whose storage is, for now, only the encoding
    forward_peak = live_bytes
    for k, i in enumerate(fwd):
        create(i, 0)
        events.append(("forward", nodes[i].name, live_bytes + nodes[i].workspace))
        forward_peak = max(forward_peak, live_bytes + nodes[i].workspace)
        for j in dying_at.get(k, ()):
            drop(current.pop(j))
        for j in compress_at.get(k, ()):
            live_bytes += nodes[j].compressed_bytes
            events.append(("forward", f"compress {nodes[j].name}", live_bytes + nodes[j].codec_workspace))
            forward_peak = max(forward_peak, live_bytes + nodes[j].codec_workspace)
            drop(current[j])
            packed.add(j)
    for i in graph.forward_outputs:
        forever.add(current[i])
    saved_bytes = sum(nodes[r].bytes for r in {storage_of[current[i]][0] for i in saved - graph.free - packed if i in current})
    saved_bytes += sum(nodes[i].compressed_bytes for i in packed)

    # ---- backward: saved values, tangents and forward outputs are its inputs
    count: dict[int, int] = {}
    last_use: dict[tuple[int, int], int] = {}
    avail = {i: current[i] for i in current}
    for i, node in enumerate(nodes):
        if node.tangent:
            avail[i] = (i, 0)
    order: list[tuple[int, tuple[int, int], list[tuple[int, int]]]] = []
    for e, i in enumerate(schedule.backward):
        args = []
        for j in nodes[i].inputs:
            if j not in avail:
                raise InvalidScheduleError(
                    f"backward step {e} computes {nodes[i].name} but {nodes[j].name} is not available"
                )
            args.append(avail[j])
            last_use[avail[j]] = e
        count[i] = count.get(i, 0) + 1
        inst = (i, count[i])
        avail[i] = inst
        order.append((i, inst, args))
    # A recomputation nothing reads afterwards is dropped from the generated code (dead-code
    # elimination), so it neither runs nor allocates.
    order = [order[e] for e in _read_events(graph, order)]
    last_use = {}
    for e, (_, _, args) in enumerate(order):
        for a in args:
            last_use[a] = e
    for i, node in enumerate(nodes):
        if node.tangent:
            # The autograd engine holds the incoming gradients until the backward returns.
            forever.add(create(i, 0))
    # Values the backward never reads are freed as soon as it starts (boxed inputs).
    for i, inst in list(current.items()):
        if inst not in forever and inst not in last_use:
            if i in packed:
                live_bytes -= nodes[i].compressed_bytes
                packed.discard(i)
            else:
                drop(inst)
            del current[i]
    events.append(("backward", "<start>", live_bytes))
    backward_peak = live_bytes
    for e, (i, inst, args) in enumerate(order):
        for j in nodes[i].inputs:
            if j in packed:  # decoded just before its first read; the encoding dies then
                acquire(storage_of[current[j]], storage_of[current[j]][0])
                decoding = live_bytes + nodes[j].compressed_bytes + nodes[j].codec_workspace
                events.append(("backward", f"decompress {nodes[j].name}", decoding))
                backward_peak = max(backward_peak, decoding)
                live_bytes -= nodes[j].compressed_bytes
                packed.discard(j)
        for j, a in zip(nodes[i].inputs, args):
            current[j] = a  # the instance this node reads
        create(i, inst[1])
        current[i] = inst
        events.append(("backward", nodes[i].name, live_bytes + nodes[i].workspace))
        backward_peak = max(backward_peak, live_bytes + nodes[i].workspace)
        for a in dict.fromkeys(args):
            if last_use.get(a) == e and a not in forever:
                drop(a)
        if inst not in last_use and not nodes[i].output:
            drop(inst)
        elif nodes[i].output:
            forever.add(inst)

    recomputed = [i for i, _, _ in order if nodes[i].kind == "forward"]
    first_free = set(graph.backward_only - saved)  # computing these once in the backward is not extra
    extra_flops, extra_cost = 0, 0.0
    for i in recomputed:
        if i in first_free:
            first_free.discard(i)
            continue
        extra_flops += nodes[i].flops
        extra_cost += nodes[i].cost
    for i in compressed:
        extra_flops += nodes[i].codec_flops
        extra_cost += nodes[i].codec_cost
    return Timeline(
        peak_bytes=max(forward_peak, backward_peak),
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        saved_bytes=saved_bytes,
        recompute_flops=extra_flops,
        recompute_cost=extra_cost,
        events=tuple(events),
    )


def _read_events(graph: Graph, order) -> list[int]:
    """Positions of the events the generated code keeps: backward nodes, and recomputations read
    by a kept event (a multi-output op's outputs stay with it: it allocates them all)."""
    nodes = graph.nodes
    needed: set[tuple[int, int]] = set()
    keep = [False] * len(order)
    for e in range(len(order) - 1, -1, -1):
        i, inst, args = order[e]
        if nodes[i].kind == "backward" or inst in needed:
            keep[e] = True
            needed.update(args)
    for e, (i, inst, args) in enumerate(order):
        if not keep[e] and len(args) == 1 and args[0] in needed and not nodes[args[0][0]].tensor:
            keep[e] = True  # an output of a kept tuple
    return [e for e in range(len(order)) if keep[e]]


def prune(graph: Graph, schedule: Schedule) -> Schedule:
    """`schedule` without the recomputations nothing reads (what the generated code drops)."""
    nodes = graph.nodes
    avail: dict[int, tuple[int, int]] = {}
    count: dict[int, int] = {}
    order = []
    for i in schedule.backward:
        args = [avail.get(j, (j, 0)) for j in nodes[i].inputs]
        count[i] = count.get(i, 0) + 1
        avail[i] = (i, count[i])
        order.append((i, avail[i], args))
    kept = _read_events(graph, order)
    if len(kept) == len(order):
        return schedule
    return dataclasses.replace(schedule, backward=tuple(schedule.backward[e] for e in kept))


def on_demand(graph: Graph, saved: Iterable[int]) -> Schedule:
    """The backward for a given SAVE set: before each backward node, recompute the values it needs
    that are not available, from the nearest available ones, and keep them until their last use
    (what `torch.utils.checkpoint` does for a segment)."""
    saved = (frozenset(saved) - graph.aliases) | (graph.needed_by_backward & graph.free) | must_save(graph)
    nodes = graph.nodes
    avail = set(graph.resident) | set(graph.forward_outputs) | (set(forward_set(graph, saved)) & saved)
    avail |= {i for i, n in enumerate(nodes) if n.tangent}
    events: list[int] = []
    for b in graph.backward_nodes:
        missing = _missing(graph, nodes[b].inputs, avail)
        events.extend(missing)
        avail.update(missing)
        events.append(b)
        avail.add(b)
    return prune(graph, Schedule(saved, with_fresh_aliases(graph, events)))


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
