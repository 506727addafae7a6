"""Schedules of a training step and the simulator that gives their memory timeline.

A `Schedule` is what every solver returns and what the recompute pass turns into code:

  - ``saved``: forward values kept from the forward for the backward (SAVE);
  - ``backward``: the nodes the backward computes, in order. Every backward node appears exactly
    once; a forward node appearing there is a recomputation (RECOMPUTE), and may appear again;
  - ``compressed``: SAVEd values kept compressed (COMPRESS, see `fxopt.analysis.codecs`): encoded right
    after their last forward use (of them or a view of them), decoded right before the backward
    first reads them.
  - ``offloaded``: SAVEd values kept in host memory between forward and backward (OFFLOAD, see
    `fxopt.solvers.transfers`): copied to the host right after their last forward use (after
    encoding, if also COMPRESSed: then the encoding travels), and back at their reload point
    (``reload_at``: a backward position, or by default as late as lets the copy complete before
    the backward first reads them).

The simulator frees every value right after its last use, exactly as the generated code does: FX
code drops each local after its last use, and the backward takes its inputs boxed, so saved
tensors die early too. Forward outputs are held by the caller, gradients are kept, and the
incoming gradients (tangents) are held by the autograd engine until the backward returns, so
none of these is freed. A multi-output op's tuple holds every output it made, so an output taken
out of it lives at least as long as the tuple. It counts with `fxopt.solvers.liveness`, the memory
model the ILP and the instant program's bound count with too.

OFFLOAD takes time as well as bytes, so the simulator keeps a clock: it advances by each node's
compute time (`Node.cost`; encoding and decoding take half a codec's cost each) and by stalls. An
offload is queued on the device-to-host channel after the value's last forward use, and its
device memory counts until the copy completes (it is let go before the first allocation after
that). A reload is queued on the host-to-device channel at its reload point, once the offload has
completed, and takes its device memory at issue; the backward node that first reads the value
waits until the copy completes. That wait is the exposed transfer time, added to the schedule's
cost (`Timeline.cost`). Each channel serves one copy at a time, in the order issued
(`fxopt.solvers.transfers.Channel`). Without OFFLOAD the clock changes nothing.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable

from fxopt.solvers.graph import Graph
from fxopt.solvers.liveness import Key, LiveBytes, Lingering, last_uses
from fxopt.solvers.prefetch import holds_group, is_regather, prefetched, reduce_wait
from fxopt.solvers.transfers import INSTANT, Channel, Copy, host_peak_bytes


class InvalidScheduleError(ValueError):
    """A schedule reads a value that is not available, or skips or repeats a backward node."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    saved: frozenset[int]
    backward: tuple[int, ...]
    compressed: frozenset[int] = frozenset()
    offloaded: frozenset[int] = frozenset()
    # (value, position): the reload of an OFFLOADed value is issued just before ``backward[position]``
    # runs (or the next step the generated code keeps). A value not listed reloads at the default
    # point; `Timeline.reload_at` says where that was.
    reload_at: tuple[tuple[int, int], ...] = ()

    def recomputed(self, graph: Graph) -> tuple[int, ...]:
        return tuple(i for i in self.backward if graph.nodes[i].kind == "forward")

    def to_dict(self) -> dict:
        d = {"saved": sorted(self.saved), "backward": list(self.backward), "compressed": sorted(self.compressed)}
        if self.offloaded:  # (no keys without OFFLOAD: such a schedule's dict is what it always was)
            d["offloaded"] = sorted(self.offloaded)
        if self.reload_at:
            d["reload_at"] = [list(p) for p in self.reload_at]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        return cls(frozenset(d["saved"]), tuple(d["backward"]), frozenset(d.get("compressed", ())),
                   frozenset(d.get("offloaded", ())), tuple((j, p) for j, p in d.get("reload_at", ())))


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
    # OFFLOAD (all zero or empty without it): seconds the backward waited for reloads; the most
    # host memory held at once, and whether that is over the graph's ``transfers.host_budget``
    # (a plan over it is over budget, like one over the device budget: see `Transfers`); every
    # copy on the two channels; and where each reload was issued, as (value, backward position).
    exposed_transfer_seconds: float = 0.0
    host_peak_bytes: int = 0
    over_host_budget: bool = False
    copies: tuple[Copy, ...] = ()
    reload_at: tuple[tuple[int, int], ...] = ()
    recompute_comm_bytes: int = 0  # bytes re-gathered (recomputed all-gathers' communication)
    # Seconds the backward waited for its re-gathers (`fxopt.solvers.prefetch`: each issued ahead
    # of its wait, one collective at a time on the process group): their communication that the
    # backward's compute did not hide. Part of ``cost``; a re-gather's own compute is in
    # ``recompute_cost``.
    exposed_comm_seconds: float = 0.0
    # Seconds the forward waited for its all-gathers, each issued ahead of its first use
    # (`forward_order`). Not part of ``cost``: every plan gathers every parameter in the forward,
    # and what hides them is the forward's compute, which no decision changes (only the memory
    # a plan leaves may stop a gather from going further ahead).
    forward_exposed_comm_seconds: float = 0.0
    # Seconds the backward waited for its gradients' reduce-scatters: the whole of each one waited
    # for where it is issued, what the compute between did not hide of one waited for later
    # (`fxopt.solvers.prefetch.prefetched`). Not part of ``cost``, as the forward's: every plan
    # reduces every gradient (a plan changes it only by the memory it leaves for the waits to
    # move, and by the re-gathers that queue with them, whose own waits are in the cost).
    reduce_exposed_comm_seconds: float = 0.0

    @property
    def cost(self) -> float:
        """What the solvers minimise, in the cost model's seconds: recomputation and codecs
        (``recompute_cost``) plus the exposed transfer time and the re-gathers' exposed
        communication."""
        return self.recompute_cost + self.exposed_transfer_seconds + self.exposed_comm_seconds


def forward_set(graph: Graph, saved: Iterable[int]) -> list[int]:
    """Forward values computed in the forward pass, in order."""
    return sorted(graph.forward_required | (frozenset(saved) & graph.backward_only))


def simulated(graph: Graph, schedule: Schedule, memo=None) -> Timeline:
    """``simulate(graph, schedule)``, kept in ``memo`` (the planner's,
    `fxopt.solvers.minimum.Memo.timeline`) where one is given: the same timeline, simulated once."""
    return simulate(graph, schedule) if memo is None else memo.timeline(graph, schedule)


def simulate(graph: Graph, schedule: Schedule, *, eager_frees: bool = False, prefetch: bool = True) -> Timeline:
    """Replay the schedule and return its memory timeline; raise if it is not valid.
    ``eager_frees``: free as eager autograd does, not as the generated code does: a value that a
    backward formula (`Node.backward_formula`) reads (a saved tensor, an incoming gradient, a
    temporary of the formula) lives until the whole formula has run, since the autograd node
    holds its saved tensors, the engine its inputs, and the C++ formula its temporaries until
    then (`_formula_ends`); and the Python numbers eager wraps into
    tensors for forward ops (`Node.eager_number_bytes`) live to the end (the eager step's peak,
    `eager_timeline`). ``prefetch`` False: each re-gather issued where the schedule has it, not
    ahead (`with_prefetch`)."""
    _check(graph, schedule)
    # (eager autograd waits for each collective where issued: no wait moved, `eager_timeline`)
    schedule, kept, forward, decided = _generated(graph, schedule, prefetch and not eager_frees)
    replay = _Replay(graph, schedule, eager_frees)
    replay.forward(forward)
    available = replay.available()
    if kept is not None and _reads_available(graph, kept, available):
        # (The steps `prune` built, as the generated code runs them: every one kept again.)
        steps, positions = kept, list(range(len(kept)))
    else:
        steps = _copies(graph, schedule.backward, available)
        positions = _read_events(graph, steps)  # the steps kept, by their position in the schedule
        steps = [steps[e] for e in positions]
    replay.backward(steps, positions)
    events, forward_peak, forward_exposed = replay.events, replay.forward_peak, replay.forward_exposed_comm
    if not decided:  # (the forward's gathers placed from this timeline, and the forward replayed so)
        fwd = forward_set(graph, schedule.saved)
        order = _ahead(graph, fwd, events, max(replay.forward_peak, replay.backward_peak))
        if order is not None:
            ahead = _Replay(graph, schedule, eager_frees)
            ahead.forward(order)
            events = ahead.events + [e for e in events if e[0] == "backward"]
            forward_peak, forward_exposed = ahead.forward_peak, ahead.forward_exposed_comm
    extra_flops, extra_cost, extra_comm = _extra_work(graph, schedule, steps)
    copies = replay.d2h.copies + replay.h2d.copies
    host_peak = host_peak_bytes(copies)
    host_budget = graph.transfers.host_budget if graph.transfers is not None else None
    return Timeline(
        peak_bytes=max(forward_peak, replay.backward_peak),
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=replay.backward_peak,
        saved_bytes=replay.saved_bytes,
        recompute_flops=extra_flops,
        recompute_cost=extra_cost,
        recompute_comm_bytes=extra_comm,
        events=tuple(events),
        exposed_transfer_seconds=replay.exposed,
        exposed_comm_seconds=replay.exposed_comm,
        forward_exposed_comm_seconds=forward_exposed,
        reduce_exposed_comm_seconds=replay.reduce_exposed_comm,
        host_peak_bytes=host_peak,
        over_host_budget=host_budget is not None and host_peak > host_budget,
        copies=tuple(copies),
        reload_at=tuple(sorted(replay.reload_positions.items())),
    )


def as_generated(graph: Graph, schedule: Schedule, prefetch: bool = False) -> Schedule:
    """``schedule`` as the generated code runs it (`fxopt.passes.recompute`): without the
    recomputations nothing reads (`prune`), with ``prefetch`` its re-gathers issued ahead of
    their waits (`with_prefetch`: the simulator's and the generated code's order; the solvers
    rework the schedule without it), and without the SAVEd values the backward then does
    not read before it recomputes them, which die at their last forward use like any value the
    backward does not need. (A schedule that OFFLOADs is left as it is: its reload points are
    positions in it.)"""
    return _generated(graph, schedule, prefetch)[0]


def forward_order(graph: Graph, schedule: Schedule) -> list[int]:
    """The forward's steps as the generated code runs them (`fxopt.passes.recompute`): the values
    `forward_set` computes, in graph order, with each all-gather issued ahead of its first use
    (`fxopt.solvers.prefetch.prefetched`, as the backward's re-gathers), never across a step
    where its bytes would raise the step's peak."""
    generated, _, forward, decided = _generated(graph, schedule, True)
    fwd = forward_set(graph, generated.saved)
    if not decided:  # (as `simulate` places them: from the timeline without prefetch)
        where = simulate(graph, generated, prefetch=False)
        forward = _ahead(graph, fwd, where.events, where.peak_bytes)
    return forward if forward is not None else fwd


def _ahead(graph: Graph, fwd: list[int], events, peak: int) -> list[int] | None:
    """The forward's steps ``fwd`` with its all-gathers issued ahead (`prefetched`), from the
    ``events`` of a timeline with them in graph order and its ``peak``; None where none moved."""
    live = [b for phase, name, b in events if phase == "forward" and not name.startswith("compress ")]
    if len(live) != len(fwd) or not any(is_regather(graph, i) for i in fwd):
        return None
    order = list(prefetched(graph, tuple(fwd), live, peak))
    return order if order != fwd else None


def _generated(graph: Graph, schedule: Schedule, prefetch: bool = False
               ) -> tuple[Schedule, list[Step] | None, list[int] | None, bool]:
    """`as_generated`'s schedule; the steps of its backward as `backward_steps` gives them
    (None for a schedule that OFFLOADs, or whose re-gathers the prefetch moved): `simulate`
    replays those, not built again; with ``prefetch``, the forward's order with its
    all-gathers issued ahead (None: `forward_set`'s, nothing moved); and whether that order is
    decided (False: the forward has gathers to place and no timeline without prefetch was made
    for the re-gathers, so `simulate` places them from its own). A pruned
    backward keeps every step when pruned again (a kept step's copies are made by kept steps),
    so they are its steps, their copies numbered as in the backward before pruning (the
    simulator reads a copy's number as a name only)."""
    if schedule.offloaded:
        return schedule, None, None, True
    steps = _copies(graph, schedule.backward, None)
    kept = _read_events(graph, steps)
    pruned = schedule if len(kept) == len(schedule.backward) else \
        dataclasses.replace(schedule, backward=tuple(schedule.backward[e] for e in kept))
    steps = [steps[e] for e in kept]
    forward, decided = None, True
    if prefetch:
        ahead, forward, decided = _with_prefetch(graph, pruned)
        if ahead is not pruned:  # (re-gathers moved: its steps are built anew)
            pruned, steps = ahead, None
    saved = _generated_saved(graph, pruned)
    if saved == frozenset(pruned.saved):
        return pruned, steps, forward, decided
    return (dataclasses.replace(pruned, saved=saved, compressed=frozenset(pruned.compressed) & saved), steps, forward,
            decided)


def _generated_saved(graph: Graph, schedule: Schedule) -> frozenset[int]:
    """The SAVEd values the generated code keeps: those the backward reads before it recomputes
    them, and the free ones (`_generated`'s schedule, `_with_prefetch`'s forward)."""
    return frozenset(schedule.saved) & (read_before_recompute(graph, schedule.backward) | graph.free)


def _reads_available(graph: Graph, steps: list[Step], available: dict[int, Key]) -> bool:
    """Whether ``steps`` (built with nothing given as available: copy 0 of every value the
    backward has not made) read only what ``available`` holds, as its copy 0, where they read a
    value the backward has not made: then they are the steps `_copies` builds with it. False
    where one is missing, or held as another copy: `_copies` with it says which (an error)."""
    for _, _, args in steps:
        for j, n in args:
            if n == 0 and available.get(j) != (j, 0):
                return False
    return True


def with_prefetch(graph: Graph, schedule: Schedule) -> Schedule:
    """``schedule`` (pruned, without OFFLOAD) with its re-gathers issued ahead of their waits as
    the generated code issues them (`fxopt.solvers.prefetch`), never across a step where the
    gathered bytes would raise the schedule's peak: the step holds them earlier, and no plan that
    fits its budget without the prefetch is over it with it."""
    return _with_prefetch(graph, schedule)[0]


def _with_prefetch(graph: Graph, schedule: Schedule) -> tuple[Schedule, list[int] | None, bool]:
    """`with_prefetch`'s schedule; the forward's order with its all-gathers issued ahead of their
    first use the same way (None where none moved); and whether that order is decided here. Both
    come from one timeline of the schedule without prefetch, made where re-gathers need it (else
    `simulate` places the forward's gathers from its own timeline, the same one, and replays the
    forward alone again): each move is checked against that timeline's peak, and a forward move
    changes no backward step's bytes (a gather reads a shard, alive anyway), nor a backward move
    a forward step's, so the two together raise no step above it either."""
    # (gathers to issue ahead, or gloo reduce-scatters whose waits may move: not DDP's all-reduces,
    # whose waits `fxopt.passes.waits.sink_all_reduce_waits` moves in the generated code alone)
    if schedule.offloaded or not any(n.comm_seconds and (n.kind == "forward" or n.lingers) for n in graph.nodes):
        return schedule, None, True
    if not any(is_regather(graph, i) for i in schedule.backward) and \
            not any(reduce_wait(graph, i) is not None for i in graph.backward_nodes):
        return schedule, None, False
    where = simulate(graph, schedule, prefetch=False)
    saved = _generated_saved(graph, schedule)
    forward = _ahead(graph, forward_set(graph, saved), where.events, where.peak_bytes)
    live = [b for phase, name, b in where.events if phase == "backward" and name != "<start>"
            and not name.startswith(("decompress ", "reload "))]
    if len(live) != len(schedule.backward):  # (a schedule `prune` would cut: as it is)
        return schedule, forward, True
    backward = prefetched(graph, schedule.backward, live, where.peak_bytes)
    return (schedule if backward == schedule.backward else dataclasses.replace(schedule, backward=backward)), forward, True


def _check(graph: Graph, schedule: Schedule) -> None:
    """Raise `InvalidScheduleError` unless the forward can run and SAVE as the schedule says, and
    its backward runs every backward node once, in order, recomputing only what may be."""
    nodes = graph.nodes
    saved = frozenset(schedule.saved)
    bad = saved & graph.aliases
    if bad:
        raise InvalidScheduleError(f"cannot save {_names(graph, bad)}: a view, made fresh from its base where read")
    bad = saved - graph.saveable - graph.free
    if bad:
        raise InvalidScheduleError(f"cannot save {_names(graph, bad)}: not computed in the forward")
    bad = frozenset(schedule.compressed) - (saved & graph.compressible)
    if bad:
        raise InvalidScheduleError(f"cannot compress {_names(graph, bad)}: not saved, or no codec for it")
    bad = frozenset(schedule.offloaded) - (saved & graph.offloadable)
    if bad:
        why = "the graph has no transfers" if graph.transfers is None else "not saved, or not offloadable"
        raise InvalidScheduleError(f"cannot offload {_names(graph, bad)}: {why}")
    bad = {j for j, p in schedule.reload_at if j not in schedule.offloaded or not 0 <= p < len(schedule.backward)}
    if bad or len(dict(schedule.reload_at)) != len(schedule.reload_at):
        raise InvalidScheduleError(f"bad reload points for {_names(graph, bad)}: each offloaded value at most once, "
                                   "at a backward position")
    backward = [i for i in schedule.backward if nodes[i].kind == "backward"]
    if backward != list(graph.backward_nodes):
        raise InvalidScheduleError("the backward must run every backward node once, in graph order")
    _check_tuples(graph, schedule.backward)
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


def _check_tuples(graph: Graph, backward: tuple[int, ...]) -> None:
    """A multi-output op recomputed in the backward allocates all its outputs, and the generated
    code takes them out at once (`with_fresh_aliases`): the simulator counts them from there, so
    it accepts no schedule that takes them out later (their memory would go uncounted meanwhile)."""
    nodes = graph.nodes
    for e, i in enumerate(backward):
        if nodes[i].kind == "forward" and not nodes[i].tensor:
            items = [u for u in graph.users[i] if nodes[u].kind == "forward"]
            if list(backward[e + 1:e + 1 + len(items)]) != items:
                raise InvalidScheduleError(f"{nodes[i].name} is recomputed without all its outputs taken out right after it")


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
    # (One list built per step, not appended to per input: `simulate` and `prune` build these for
    # every schedule the solvers try.)
    for e, i in enumerate(backward):
        inputs = nodes[i].inputs
        if available is None:
            args = [current[j] if j in current else (j, 0) for j in inputs]
        else:
            try:
                args = [current[j] for j in inputs]
            except KeyError:
                j = next(j for j in inputs if j not in current)
                raise InvalidScheduleError(
                    f"backward step {e} computes {nodes[i].name} but {nodes[j].name} is not available"
                ) from None
        copy = current[i] = (i, count.get(i, 0) + 1)
        count[i] = copy[1]
        steps.append((i, copy, args))
    return steps


class _Replay:
    """The generated code's memory, step by step: a `LiveBytes` over the storage of every copy of
    every value, a copy freed right after its last use; and its clock, with the copies OFFLOAD
    makes on two channels (see the module).

    Long because it is one state machine: creating, freeing, encoding, offloading and reloading a
    copy all move the same live bytes and the same clock, and the forward and backward walks call
    them in the generated code's order; split apart, each piece would take the whole state."""

    def __init__(self, graph: Graph, schedule: Schedule, eager_frees: bool = False):
        self.graph, self.nodes = graph, graph.nodes
        self.eager_frees = eager_frees
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
        # OFFLOAD. (Without transfers a schedule offloads nothing, see `_check`: the channels idle.)
        self.offloaded = frozenset(schedule.offloaded)
        self.reload_at = dict(schedule.reload_at)
        transfers = graph.transfers or INSTANT
        self.d2h = Channel("d2h", transfers.d2h_bytes_per_s)
        self.h2d = Channel("h2d", transfers.h2d_bytes_per_s)
        self.now = 0.0  # seconds since the step began: compute, codecs and stalls
        self.exposed = 0.0  # seconds the backward waited for reloads
        self.in_flight: list[tuple[float, int, int]] = []  # offloads not complete: (end, value, bytes)
        self.lingering = Lingering(graph, self.memory)  # collectives' buffers freed late (`Node.lingers`)
        self.offload_end: dict[int, float] = {}
        self.reloading: dict[int, int] = {}  # value -> its reload's index in ``h2d.copies``
        self.reload_positions: dict[int, int] = {}  # value -> schedule position its reload was issued at
        # Re-gathers (`fxopt.solvers.prefetch`): the process group runs one collective at a time.
        self.comm_free_at = 0.0
        self.gathering: dict[Key, float] = {}  # a re-gather's copy -> when its communication ends
        self.regathered_at = 0.0  # when the last re-gather issued ends
        self.exposed_comm = 0.0  # seconds the backward waited for re-gathers
        self.forward_exposed_comm = 0.0  # seconds the forward waited for gathers issued ahead
        self.reducing: dict[Key, float] = {}  # a reduce-scatter waited for later -> when it ends
        self.reduce_exposed_comm = 0.0  # seconds the backward waited for reduce-scatters

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
        self.settle()
        self.memory.hold(("encoded", j), self.nodes[j].compressed_bytes)
        encoding = self.memory.bytes + self.nodes[j].codec_workspace
        self.drop(self.current[j])
        self.packed.add(j)
        self.now += self.nodes[j].codec_cost / 2
        return encoding

    def decode(self, j: int) -> int:
        """Decode value j for its first backward read; the encoding dies then. Bytes while decoding:
        the encoding (held since `encode` or its reload, counted once), the decoded value and the
        codec's scratch."""
        self.settle()
        self.memory.hold(self.storage_of[self.current[j]])
        decoding = self.memory.bytes + self.nodes[j].codec_workspace
        self.memory.release(("encoded", j), self.nodes[j].compressed_bytes)
        self.packed.discard(j)
        self.now += self.nodes[j].codec_cost / 2
        return decoding

    def offload(self, j: int) -> None:
        """OFFLOAD value j after its last forward use: queue its copy to the host (of its encoding,
        if COMPRESSed); its device memory counts until the copy completes (`settle`)."""
        node = self.nodes[j]
        nbytes = node.compressed_bytes if j in self.packed else node.bytes
        copy = self.d2h.copy(node.name, nbytes, self.now)
        self.memory.hold(("offload", j), nbytes)
        if j in self.packed:
            self.memory.release(("encoded", j), nbytes)
        else:
            self.drop(self.current[j])
        self.in_flight.append((copy.end, j, nbytes))
        self.offload_end[j] = copy.end

    def settle(self) -> None:
        """Let go of the device memory of the offloads complete by now (before an allocation)."""
        if self.in_flight and min(self.in_flight)[0] <= self.now:
            for end, j, nbytes in self.in_flight:
                if end <= self.now:
                    self.memory.release(("offload", j), nbytes)
            self.in_flight = [c for c in self.in_flight if c[0] > self.now]

    def reload(self, j: int) -> int:
        """Issue value j's reload: its device memory (the encoding's, if COMPRESSed) is taken now;
        the copy starts once the channel is free and the offload complete. Bytes after."""
        self.settle()
        node = self.nodes[j]
        if j in self.packed:
            self.memory.hold(("encoded", j), node.compressed_bytes)
            nbytes = node.compressed_bytes
        else:
            self.memory.hold(self.storage_of[self.current[j]])
            nbytes = node.bytes
        self.h2d.copy(node.name, nbytes, self.now, not_before=self.offload_end[j])
        self.reloading[j] = len(self.h2d.copies) - 1
        return self.memory.bytes

    def wait(self, j: int) -> None:
        """The backward first reads value j: wait until its reload completes (the exposed time)."""
        k = self.reloading[j]
        copy = self.h2d.copies[k]
        self.h2d.copies[k] = dataclasses.replace(copy, needed=self.now)
        if copy.end > self.now:
            self.exposed += copy.end - self.now
            self.now = copy.end

    def forward(self, order: list[int] | None = None) -> None:
        """Run the forward: `forward_set`'s values in graph order, or in ``order`` (the same values
        with all-gathers issued ahead of their first use, `forward_order`): then each gather's
        communication runs on the process group while the steps before its first reader compute,
        its buffer and its scratch held from its issue, and that reader waits for what is left."""
        graph, nodes = self.graph, self.nodes
        for i, node in enumerate(nodes):
            if node.kind == "input" and not node.tangent:
                self.forever.add(self.create(i, 0))
        fwd = forward_set(graph, self.saved) if order is None else order
        ahead = order is not None
        fwd_pos = {i: k for k, i in enumerate(fwd)}
        last = last_uses([j for j in nodes[i].inputs if nodes[j].kind == "forward"] for i in fwd)
        keep = self.saved | graph.forward_outputs
        dying_at: dict[int, list[int]] = {}
        for i in fwd:
            if i not in keep:
                dying_at.setdefault(last.get(i, fwd_pos[i]), []).append(i)
        # A compressed value is encoded, and an offloaded one copied to the host, once neither it
        # nor a view of it has a forward use left.
        compress_at: dict[int, list[int]] = {}
        offload_at: dict[int, list[int]] = {}
        if self.compressed or self.offloaded:
            done_with: dict[int, int] = {}
            for i in fwd:
                r = graph.roots[i]
                done_with[r] = max(done_with.get(r, -1), last.get(i, fwd_pos[i]))
            for i in self.compressed:
                compress_at.setdefault(done_with[i], []).append(i)
            for i in self.offloaded:  # (after the encoding, if compressed too)
                offload_at.setdefault(done_with[i], []).append(i)
        peak = self.memory.bytes
        for k, i in enumerate(fwd):
            waited = self.wait_for_gathers(i) if ahead else ()
            self.settle()
            self.create(i, 0)
            if self.eager_frees and nodes[i].eager_number_bytes:
                self.memory.hold(("number", i), nodes[i].eager_number_bytes)
            gather = ahead and is_regather(graph, i)
            if gather:  # its scratch (gloo's flat buffer) is held while it runs, to its wait
                self.memory.hold(("gathering", (i, 0)), nodes[i].workspace)
            peak = max(peak, self.record("forward", nodes[i].name,
                                         self.memory.bytes + (0 if gather else nodes[i].workspace)))
            for key in waited:
                self.memory.release(("gathering", key), nodes[key[0]].workspace)
            if gather:
                self.comm_free_at = max(self.now, self.comm_free_at) + nodes[i].comm_seconds
                self.gathering[(i, 0)] = self.comm_free_at
                self.now += nodes[i].cost - nodes[i].comm_exposed
            else:  # (a gather not issued ahead is waited for at once)
                self.now += nodes[i].cost - nodes[i].comm_exposed + nodes[i].comm_seconds
                self.forward_exposed_comm += nodes[i].comm_seconds
            for j in dying_at.get(k, ()):
                self.drop(self.current.pop(j))
            self.lingering.after(i)
            for j in compress_at.get(k, ()):
                peak = max(peak, self.record("forward", f"compress {nodes[j].name}", self.encode(j)))
            for j in sorted(offload_at.get(k, ())):
                self.offload(j)
        self.forward_peak = peak
        for i in graph.forward_outputs:
            self.forever.add(self.current[i])
        self.settle()
        on_device = self.saved - graph.free - self.offloaded
        held_saved = {self.storage_of[self.current[i]][0] for i in on_device - self.packed if i in self.current}
        self.saved_bytes = (sum(nodes[r].bytes for r in held_saved)
                            + sum(nodes[i].compressed_bytes for i in self.packed & on_device)
                            + sum(nbytes for _, _, nbytes in self.in_flight))  # offloads still copying

    def wait_for_gathers(self, i: int) -> list[Key]:
        """Forward step ``i`` is about to run: wait for the all-gathers in flight it reads (the
        time the forward stands still); the gathers waited for."""
        waited = []
        for j in dict.fromkeys(self.nodes[i].inputs):
            end = self.gathering.pop((j, 0), None)
            if end is not None:
                waited.append((j, 0))
                if end > self.now:
                    self.forward_exposed_comm += end - self.now
                    self.now = end
        return waited

    def available(self) -> dict[int, Key]:
        """What the backward starts with: saved values, tangents and forward outputs (its inputs)."""
        out = dict(self.current)
        for i, node in enumerate(self.nodes):
            if node.tangent:
                out[i] = (i, 0)
        return out

    def backward(self, steps: list[Step], positions: list[int]) -> None:
        """Run the kept ``steps`` (``positions``: their places in the schedule's backward)."""
        nodes = self.nodes
        last = last_uses(args for _, _, args in steps)
        if self.eager_frees:
            last = _formula_ends(self.graph, steps, last)
        dying_at: dict[int, list[Key]] = {}
        for a, e in last.items():
            dying_at.setdefault(e, []).append(a)
        self.settle()
        for i, node in enumerate(nodes):
            if node.tangent:
                # The autograd engine holds the incoming gradients until the backward returns.
                self.forever.add(self.create(i, 0))
        # Values the backward never reads are freed as soon as it starts (boxed inputs).
        for i, copy in list(self.current.items()):
            if copy not in self.forever and copy not in last:
                if i in self.offloaded:
                    self.packed.discard(i)  # (its device memory went, or goes, with its offload)
                elif i in self.packed:
                    self.memory.release(("encoded", i), nodes[i].compressed_bytes)
                    self.packed.discard(i)
                else:
                    self.drop(copy)
                del self.current[i]
        reloads, first_read = self.reload_points(steps, positions)
        later = self.waited_later(steps)
        self.lingering.exact = bool(later)  # (gloo's copies counted to their own waits)
        peak = self.record("backward", "<start>", self.memory.bytes)
        # (What most steps of most graphs skip, told apart once: no reloads, no collectives.)
        current, comm = self.current, any(n.comm_seconds for n in nodes)
        for e, (i, copy, args) in enumerate(steps):
            node = nodes[i]
            if first_read:
                for j in reloads.get(e, ()):
                    peak = max(peak, self.record("backward", f"reload {nodes[j].name}", self.reload(j)))
                for j, n in dict.fromkeys(args):
                    if n == 0 and first_read.get(j) == e:
                        self.wait(j)
            waited = self.wait_for_collectives(args) if self.gathering or self.reducing else ()
            self.settle()
            if self.packed:
                for j in node.inputs:
                    if j in self.packed:
                        peak = max(peak, self.record("backward", f"decompress {nodes[j].name}", self.decode(j)))
            for j, a in zip(node.inputs, args):
                current[j] = a  # the copy this node reads
            self.create(i, copy[1])
            regather = comm and is_regather(self.graph, i)
            if regather:  # its scratch (gloo's flat buffer) is held while it runs, to its wait
                self.memory.hold(("gathering", copy), node.workspace)
            peak = max(peak, self.record("backward", node.name,
                                         self.memory.bytes + (0 if regather else node.workspace)))
            for key in waited:
                self.memory.release(("gathering", key), nodes[key[0]].workspace)
            if comm:
                self.run_backward_step(i, copy, regather, e in later)
            else:  # (`run_backward_step` with no collective: the step's compute)
                self.now += node.cost - node.comm_exposed
            for a in dying_at.get(e, ()):
                if a not in self.forever:
                    self.drop(a)
            if copy not in last and not nodes[i].output:
                self.drop(copy)
            elif nodes[i].output:
                self.forever.add(copy)
            self.lingering.after(i)
        self.lingering.release_all()
        self.backward_peak = peak

    def waited_later(self, steps: list[Step]) -> set[int]:
        """The steps that issue a reduce-scatter the backward waits for later than the next step
        (`fxopt.solvers.prefetch.prefetched` moved its wait): it runs beside the steps between."""
        return {e for e, (i, copy, _) in enumerate(steps)
                if holds_group(self.graph, i) and reduce_wait(self.graph, i) is not None
                and not (e + 1 < len(steps) and copy in steps[e + 1][2])}

    def wait_for_collectives(self, args: list[Key]) -> list[Key]:
        """A backward step reads ``args``: wait for the re-gathers and the reduce-scatters in
        flight among them (the time the step stands still); the re-gathers waited for."""
        waited = []
        for key in dict.fromkeys(args):
            end = self.gathering.pop(key, None)
            if end is not None:
                waited.append(key)
                if end > self.now:  # a re-gather not complete: the step stands still
                    self.exposed_comm += end - self.now
                    self.now = end
            end = self.reducing.pop(key, None)
            if end is not None and end > self.now:  # (a reduce-scatter's wait, moved later)
                self.reduce_exposed_comm += end - self.now
                self.now = end
        return waited

    def run_backward_step(self, i: int, copy: Key, regather: bool, later: bool) -> None:
        """The clock through backward step ``i`` (its ``copy``): its compute, and its collective on
        the process group (one at a time, in the order issued): a re-gather (``regather``) or a
        reduce-scatter waited for ``later`` runs beside the steps after it; a reduce-scatter waited
        for where issued stands the step still, behind whatever is in flight first."""
        node = self.nodes[i]
        holds = not regather and holds_group(self.graph, i)
        if regather:
            self.comm_free_at = max(self.now, self.comm_free_at) + node.comm_seconds
            self.gathering[copy] = self.regathered_at = self.comm_free_at
        elif later:
            self.comm_free_at = max(self.now, self.comm_free_at) + node.comm_seconds
            self.reducing[copy] = self.comm_free_at
        elif holds and self.comm_free_at > self.now:
            # (behind the re-gathers in flight: the plan's exposed communication; behind
            # reduce-scatters waited for later: theirs)
            behind_regathers = max(0.0, min(self.regathered_at, self.comm_free_at) - self.now)
            self.exposed_comm += behind_regathers
            self.reduce_exposed_comm += self.comm_free_at - self.now - behind_regathers
            self.now = self.comm_free_at
        if later:
            self.now += max(0.0, node.cost - node.comm_exposed - node.comm_seconds)
        else:
            self.now += node.cost - node.comm_exposed
        if holds and not later:
            self.comm_free_at = self.now
            self.reduce_exposed_comm += node.comm_seconds

    def reload_points(self, steps: list[Step], positions: list[int]) -> tuple[dict[int, list[int]], dict[int, int]]:
        """For the offloaded values the backward reads: the kept step before which each reload is
        issued (by step, in the order of their first reads), and the step that first reads each.

        A reload point the schedule gives is kept (it must not be after the first read). By default
        the reloads are placed as late as lets each copy complete before its first read, counting
        backwards from the last first read so that copies sharing the channel do not overlap: a
        reloaded value takes device memory for as short a time as hides its copy. (The backward's
        clock here counts compute and decoding only: a stall only delays what follows, and a copy
        that cannot start before its offload completes waits, exposed, as the simulator says.)"""
        if not self.offloaded:
            return {}, {}
        nodes = self.nodes
        first_read: dict[int, int] = {}  # (of the compressed values too: they are decoded there)
        for e, (_, _, args) in enumerate(steps):
            for j, n in args:
                if n == 0 and (j in self.offloaded or j in self.compressed):
                    first_read.setdefault(j, e)
        # When each kept step would start, from the backward's start, if nothing stalled.
        seconds = [nodes[i].cost for i, _, _ in steps]
        for j in self.compressed & first_read.keys():
            seconds[first_read[j]] += nodes[j].codec_cost / 2
        start = list(itertools.accumulate(seconds, initial=0.0))[:-1]
        first_read = {j: e for j, e in first_read.items() if j in self.offloaded}
        points: dict[int, int] = {}
        for j, p in self.reload_at.items():
            if j in first_read:
                if p > positions[first_read[j]]:
                    raise InvalidScheduleError(f"{nodes[j].name} is reloaded after the backward first reads it")
                points[j] = bisect.bisect_left(positions, p)
        channel_free_from = float("inf")
        for j in sorted(set(first_read) - set(points), key=lambda j: (-first_read[j], -j)):
            nbytes = nodes[j].compressed_bytes if j in self.compressed else nodes[j].bytes
            begin = min(start[first_read[j]], channel_free_from) - nbytes / self.h2d.bytes_per_s
            channel_free_from = begin
            points[j] = max(0, min(bisect.bisect_right(start, begin) - 1, first_read[j]))
        self.reload_positions = {j: positions[e] for j, e in points.items()}
        issue: dict[int, list[int]] = {}
        for j in sorted(points, key=lambda j: (first_read[j], j)):
            issue.setdefault(points[j], []).append(j)
        return issue, first_read


def _formula_ends(graph: Graph, steps: list[Step], last: dict[Key, int]) -> dict[Key, int]:
    """``last`` (each copy's last reading step) as eager autograd frees: a copy last read inside
    a backward formula lives until that formula's last step. What the formula reads from outside
    it, because the autograd node holds its saved tensors, and the engine its inputs, until it
    returns; what it makes inside it, because those are the C++ function's temporaries and
    locals, freed as it returns (``PowBackward0``'s ``grad * (2 * self.pow(1))`` holds
    ``self.pow(1)`` and ``2 * self.pow(1)`` until the product is made; not so in the Python
    backward of a custom ``autograd.Function``, `Node.python_formula`). A formula is a run of
    steps with the same `Node.backward_formula` (a custom Function's Python backward apart: it
    may carry the sequence number of the formula before it), through the steps without one
    between them (views of SAVEd values a schedule makes fresh where they are read)."""
    run: list[int] = []  # the formula run of each step
    starts: list[int] = []
    ends: list[int] = []
    formulas: list[int | None] = []
    python: list[bool] = []
    for e, (i, _, _) in enumerate(steps):
        f, py = graph.nodes[i].backward_formula, graph.nodes[i].python_formula
        if not starts or f is not None and (f, py) != (formulas[-1], python[-1]):
            starts.append(e)
            ends.append(e)
            formulas.append(f)
            python.append(py)
        run.append(len(starts) - 1)
        if f is not None:
            ends[-1] = e
    made = {copy: e for e, (_, copy, _) in enumerate(steps)}

    def held(a: Key, r: int) -> bool:
        return formulas[r] is not None and (not python[r] or made.get(a, -1) < starts[r])

    return {a: max(e, ends[run[e]]) if held(a, run[e]) else e for a, e in last.items()}


def _extra_work(graph: Graph, schedule: Schedule, steps: list[Step]) -> tuple[int, float, int]:
    """FLOPs, cost and communicated bytes beyond one execution of every node: recomputations
    (the first backward computation of a value only the backward needs is not one; a recomputed
    all-gather is a re-gather, counted in bytes, not FLOPs; its wait, where it has
    `Node.comm_seconds`, is the replay's ``exposed_comm``), encoding and decoding."""
    nodes = graph.nodes
    first_free = set(graph.backward_only - frozenset(schedule.saved))
    extra_flops, extra_cost, extra_comm = 0, 0.0, 0
    for i, _, _ in steps:
        if nodes[i].kind != "forward":
            continue
        if i in first_free:
            first_free.discard(i)
            continue
        extra_flops += nodes[i].flops
        extra_cost += nodes[i].cost - nodes[i].comm_exposed  # (its exposed communication: the replay's)
        extra_comm += nodes[i].comm_bytes
    for i in frozenset(schedule.compressed):
        extra_flops += nodes[i].codec_flops
        extra_cost += nodes[i].codec_cost
    return extra_flops, extra_cost, extra_comm


def _read_events(graph: Graph, steps: list[Step]) -> list[int]:
    """Positions of the steps the generated code keeps: backward nodes, and recomputations read
    by a kept step (a multi-output op's outputs stay with it: it allocates them all)."""
    nodes = graph.nodes
    needed: set[Key] = set()
    keep = [False] * len(steps)
    for e in range(len(steps) - 1, -1, -1):
        i, copy, args = steps[e]
        if copy in needed or nodes[i].kind == "backward":
            keep[e] = True
            needed.update(args)
    for e, (i, copy, args) in enumerate(steps):
        if not keep[e] and len(args) == 1 and args[0] in needed and not nodes[args[0][0]].tensor:
            keep[e] = True  # an output of a kept tuple
    return [e for e, kept in enumerate(keep) if kept]


def backward_steps(graph: Graph, schedule: Schedule) -> list[Step]:
    """The backward's steps the generated code keeps, each with the copy it makes and the copies
    it reads (copy 0: what the forward left, a SAVEd value's)."""
    steps = _copies(graph, schedule.backward, None)
    return [steps[e] for e in _read_events(graph, steps)]


def kept_steps(graph: Graph, schedule: Schedule) -> list[int]:
    """The positions in ``schedule.backward`` that `prune` keeps."""
    return list(_read_events(graph, _copies(graph, schedule.backward, None)))


def prune(graph: Graph, schedule: Schedule) -> Schedule:
    """`schedule` without the recomputations nothing reads (what the generated code drops)."""
    kept = kept_steps(graph, schedule)
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
    - before each event, a fresh copy of each alias (view) it reads, unless the latest copy of
      that view was made from the latest copies of what it views (then it is read again: the
      storage is the same, alive either way, and making it again would cost a step);
    - right after each multi-output op (a tuple), all its outputs: the op allocates them together,
      so they are taken out at once and each lives as long as it is used."""
    out: list[int] = []
    taken: set[int] = set()  # outputs of the latest copy of each tuple, already emitted
    made: dict[int, int] = {}  # value -> position in `out` of its latest copy

    def current(j: int) -> bool:
        at = made.get(j)
        return at is not None and all(made.get(x, -1) < at and (x not in graph.aliases or current(x))
                                      for x in graph.nodes[j].inputs)

    def emit(i: int) -> None:
        for j in dict.fromkeys(graph.nodes[i].inputs):
            if j in graph.aliases and not current(j):
                emit(j)
        if i in graph.aliases and current(i):
            return  # an output of the view tuple just made
        made[i] = len(out)
        out.append(i)
        if not graph.nodes[i].tensor and graph.nodes[i].kind == "forward":
            for g in graph.users[i]:
                if graph.nodes[g].kind == "forward":
                    made[g] = len(out)
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


def to_recompute(graph: Graph, wanted: Iterable[int], available: Iterable[int]) -> list[int]:
    """Forward values to compute, in order, so that everything in ``wanted`` is available, from
    the ``available`` values (`InvalidScheduleError` where that needs one that cannot be recomputed)."""
    return _missing(graph, wanted, set(available))


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
    Backward-only values eager computes in its backward (`Node.backward_formula`), and those that
    cannot be computed in the forward, are made in the backward from the forward values they
    read, which are saved instead."""
    saved: set[int] = set()
    stack = list(graph.through_aliases(graph.backward_needs))
    seen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in seen or graph.nodes[i].kind != "forward":
            continue
        seen.add(i)
        in_backward = graph.nodes[i].backward_formula is not None and i in graph.backward_only
        if i in graph.saveable and not in_backward or not graph.nodes[i].recomputable:
            saved.add(i)
        else:
            stack.extend(graph.through_aliases(graph.nodes[i].inputs))
    return frozenset(saved)


def _names(graph: Graph, idx: Iterable[int]) -> str:
    return ", ".join(graph.nodes[i].name for i in sorted(idx))
