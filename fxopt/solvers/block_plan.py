"""Plans for a step made of repeated blocks: each kind of segment solved once for a curve of
plans, the segments' decisions chosen by rotor's dynamic program over the chain (which plan each
runs, and which are made again from an earlier one's input in the backward), and the step's
schedule made from those decisions and simulated.

The step is a chain of segments (`fxopt.solvers.blocks`): the forward runs them in order, the
backward in reverse; each reads what the one before hands it (its *link*: a layer's input). While
segment s runs, forward or backward, the step holds

    what the callers hold           the links kept so far, and the values the plans of the
                                    segments before s keep until their backward
  + what s holds in its own graph   as its plan p runs (`Point`: its memory per step)
  + the rest                        parameters, the gradients made so far, what segments read
                                    from one another: the same whatever the plans (the offsets)

Rockmate's hierarchical approach (Zhao et al., 2023) over rotor's chain (Beaumont et al., 2019):
each block's plans from a curve solved once, the blocks chained by dynamic programming
(`fxopt.solvers.block_rotor`, where a segment runs one of its kind's plans, or is run forward
keeping only its link to the next and made again, from an earlier link, just before its own
backward: at a tight budget the layers' values are made again after the head's peak instead of
kept through it).

  - A kind's curve (`KindCurve`): plans of its own graph from `fxopt.solvers.solve` (the instant
    program and the heuristics: counted effort, as everywhere), each asked to keep at most so
    many bytes through the step: its graph with a ballast at the end of its forward, which stands
    for the segments after it (`_with_ballast`), planned at that many bytes above the ballast;
    the last segment's kind, which keeps nothing for another, is asked for its own peak instead.
    Also eager's plan, the plan keeping nothing, and the kind's lowest-peak plan. Each is
    simulated in the kind's graph: its keep (`Timeline.saved_bytes`), cost, memory per step.
  - The links (`Links`): what each segment hands the next and no later one reads.
  - What the step SAVEs besides (`Variant`): all else segments read from one another; or that
    less the first segment's values (RoPE tables, a mask: made again where read); or that and
    the first segment's link (the embedding) too. Each variant's offsets come from one plan of
    the whole step (each segment at its kind's plan keeping least, which reads most of what
    others hand it, every link kept) simulated: at each step of a segment, the step's memory less
    the segment's own, less what the segments before keep and the links alive then. Steps are
    matched by node: a forward value, or the backward node a recomputation runs before (`_read`);
    its cost beyond the segments' own is the variant's. The same plan gives the memory where
    the backward would make segments again (just after the next segment's backward).
  - The choice (`_choices`): per variant, rotor's cheapest decisions predicted within the budget
    (`block_rotor.cheapest_tree`) and the cheapest making nothing again (`kept_tree`: one plan
    per segment, exact in bytes); the lowest peak (`_lowest`: `min_peak_tree`).
  - Refinement (`block_candidates`): each kind solved again halfway from the plans the choices
    run to their neighbours on its curve, and the choice made again: the curve drawn finely where
    the budget needs it, `Effort.block_refinements` solves at most.
  - The schedule (`expand`): SAVE what the plans run in the forward save, the links kept there
    and what the variant SAVEs; the backward runs each plan's backward (its recomputations in
    it), in the step's backward order, each preceded by what rotor's decisions make again for it
    (from the nearest values there), and recomputes what a segment reads from another and is
    not SAVEd just before it is read.

Nothing is trusted without the simulator: the prediction is exact for the plan the offsets were
read from, above it where another lets go sooner of what segments share, and choices whose
simulated peaks are over the budget anyway are made again with the budget lowered by the excess.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import math
import warnings
from collections import deque
from collections.abc import Callable

import numpy as np

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers.block_rotor import (Menu, RotorChain, Tree, actions, all_kept, cheapest_tree, evaluate, kept_tree,
                                      min_peak_tree, plans)
from fxopt.solvers.blocks import Blocks, find_blocks
from fxopt.solvers.effort import Deadline, Effort
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.heuristics import Candidate
from fxopt.solvers.schedule import (InvalidScheduleError, OnDemand, Schedule, Timeline, as_generated, must_save,
                                    on_demand, prune, required_saves, save_all_set, simulate, simulated,
                                    to_recompute)

# The shares of the way from a kind's plan keeping least to eager's that it is first solved at.
LEVELS = (0.0, 0.2, 0.5, 0.8)
# Rounds of `block_candidates`' refinement: each solves a kind again halfway from each plan the
# choice takes to its neighbours on the curve, where they are over REFINE_GAP of its span apart.
REFINE_ROUNDS = 4
REFINE_GAP = 0.001
# The strategy each kind's graph is solved with: the instant program (its plan and its proof),
# the heuristics where its plan does not fit.
KIND_SOLVER = "instant"
# A plan leaving more than this beyond the least any plan of its kind leaves alive after its
# backward is no plan of the curve (see `KindCurve.add`); less is left to the simulator to count.
LEFTOVER_SLACK = 4096

# A solver of a kind's graph: (graph, budget) -> a schedule, or None where nothing fits.
Solve = Callable[[Graph, int], "Schedule | None"]


@dataclasses.dataclass(frozen=True)
class Point:
    """One plan of a kind's own graph."""

    schedule: Schedule
    keep: int  # bytes of SAVEd values alive at the end of its forward (held until its backward)
    cost: float
    forward: np.ndarray  # its memory at each forward anchor (`KindCurve.forward_anchors`)
    backward: np.ndarray  # ... at each backward node (the recomputations before it included)
    end: int  # its memory after its last backward node
    peak: int  # its own peak


def _read(events, anchor_of: Callable[[str], tuple[int, str, int] | None], shapes) -> list[tuple[np.ndarray, np.ndarray]]:
    """The most memory at each anchor of each segment in a timeline's ``events``: ``anchor_of``
    names the (segment, "f" or "b", position) of an event at an anchor; any other forward event
    counts at the latest forward anchor (the first, before any), any other backward event at the
    next backward anchor (the node a recomputation runs before). ``shapes``: per segment, how
    many forward and backward anchors."""
    out = [(np.full(f, -np.inf), np.full(b, -np.inf)) for f, b in shapes]
    at, early, pending = None, [], []
    for phase, name, live in events:
        where = anchor_of(name)
        if phase == "forward":
            if where is not None and where[1] == "f":
                at = where
                for x in early:
                    _raise(out, at, x)
                early = []
            if at is None:
                early.append(live)
            else:
                _raise(out, at, live)
        elif where is not None and where[1] == "b":
            for x in (*pending, live):
                _raise(out, where, x)
            pending = []
        else:
            pending.append(live)
    return out


def _raise(out, where: tuple[int, str, int], live: int) -> None:
    s, phase, k = where
    arr = out[s][0 if phase == "f" else 1]
    arr[k] = max(arr[k], live)


class KindCurve:
    """A kind's graph and its plans (see the module). A kind with a segment after one of its
    copies is solved for what it keeps through the step (``by_keep``: with the ballast); the
    last segment's kind, which keeps nothing for another, for its own peak."""

    def __init__(self, graph: Graph, by_keep: bool):
        self.graph, self.by_keep = graph, by_keep
        self.forward_anchors = tuple(sorted(graph.forward_required - graph.resident))
        self.backward_anchors = graph.backward_nodes
        names = {n.name: i for i, n in enumerate(graph.nodes)}
        fpos = {a: k for k, a in enumerate(self.forward_anchors)}
        bpos = {a: k for k, a in enumerate(self.backward_anchors)}
        self.anchor = {name: ((0, "f", fpos[i]) if i in fpos else (0, "b", bpos[i]))
                       for name, i in names.items() if i in fpos or i in bpos}
        self.points: list[Point] = []
        self.asked: set[int] = set()  # the axis values solved at
        self.ballast = _with_ballast(graph) if by_keep else None
        # What it cannot recompute, SAVEd by every plan (rotor counts it apart): its bytes, and
        # how much of it is made by each forward anchor.
        self.musts = must_save(graph)
        roots = {graph.roots[i] for i in self.musts} - graph.resident
        self.must = sum(graph.nodes[r].bytes for r in roots)
        self.musts_made = np.zeros(len(self.forward_anchors))
        for r in roots:
            self.musts_made[bisect.bisect_left(self.forward_anchors, r):] += graph.nodes[r].bytes

    def axis(self, point: Point) -> int:
        return point.keep if self.by_keep else point.peak

    def add(self, schedule: Schedule) -> Point | None:
        """``schedule`` simulated as a point of the curve; None where it does not run, where a
        point kept already beats it, or where it leaves more alive after its backward than the
        first point (eager's) by over `LEFTOVER_SLACK`: it would hold that through every segment
        after, which the choice does not count (a forward output's view made again in the
        backward, held as an output)."""
        try:
            timeline = simulate(self.graph, schedule)
        except InvalidScheduleError:
            return None
        end = timeline.events[-1][2]
        if self.points and end > self.points[0].end + LEFTOVER_SLACK:
            return None
        fwd, bwd = _read(timeline.events, self.anchor.get,
                         [(len(self.forward_anchors), len(self.backward_anchors))])[0]
        point = Point(schedule, timeline.saved_bytes - self._outputs_saved(schedule), timeline.cost, fwd, bwd, end,
                      timeline.peak_bytes)
        if any(_beats(q, point) for q in self.points):
            return None
        self.points.append(point)
        return point

    def _outputs_saved(self, schedule: Schedule) -> int:
        """Bytes of the SAVEd values that are outputs of the kind's graph: the segment after
        reads them, and the step SAVEs them whatever the plan (`Blocks.forced`), so they are no
        part of what a plan keeps."""
        graph = self.graph
        saved = as_generated(graph, schedule).saved
        return sum(graph.nodes[r].bytes for r in {graph.roots[i] for i in saved & graph.forward_outputs})

    def at(self, value: int, solve: Solve) -> Point | None:
        """The plan ``solve`` finds that keeps (``by_keep``: with the ballast) or peaks at most
        at about ``value`` bytes, added to the curve; None where none is added or ``value`` was
        asked already."""
        if value in self.asked:
            return None
        self.asked.add(value)
        if not self.by_keep:
            schedule = solve(self.graph, value)
            return None if schedule is None else self.add(schedule)
        if self.ballast is None:
            return None
        graph, rest = self.ballast
        schedule = solve(graph, rest + value)
        return None if schedule is None else self.add(dataclasses.replace(schedule, saved=schedule.saved - {len(self.graph)}))

    def between(self, chosen: set[int]) -> list[int]:
        """The axis values halfway from each chosen point to its neighbours on the curve (as
        far as the gap is over `REFINE_GAP` of the curve's span): where to draw it finer."""
        order = sorted(range(len(self.points)), key=lambda p: self.axis(self.points[p]))
        values = [self.axis(self.points[p]) for p in order]
        gap = REFINE_GAP * (values[-1] - values[0])
        out = []
        for k, p in enumerate(order):
            if p in chosen:
                out += [(values[k] + values[j]) // 2 for j in (k - 1, k + 1)
                        if 0 <= j < len(values) and abs(values[j] - values[k]) > gap]
        return sorted(set(out) - self.asked)


def _beats(q: Point, p: Point) -> bool:
    """``q`` keeps, costs and holds no more than ``p`` anywhere."""
    return (q.keep <= p.keep and q.cost <= p.cost and q.end <= p.end and bool((q.forward <= p.forward).all())
            and bool((q.backward <= p.backward).all()))


def kind_curve(graph: Graph, by_keep: bool, solve: Solve, lowest: Callable[[Graph], Schedule]) -> KindCurve:
    """A kind's first curve: eager's plan, the plan keeping nothing, its lowest-peak plan
    (``lowest``), and ``solve``'s at `LEVELS` of the way from the least to the most it keeps (or
    peaks at, for the last segment's kind)."""
    kind = KindCurve(graph, by_keep)
    kind.add(on_demand(graph, save_all_set(graph)))
    kind.add(on_demand(graph, required_saves(graph, ())))
    kind.add(lowest(graph))
    if kind.points:
        values = [kind.axis(p) for p in kind.points]
        for level in LEVELS:
            kind.at(int(min(values) + level * (max(values) - min(values))), solve)
    return kind


def _with_ballast(graph: Graph) -> tuple[Graph, int] | None:
    """The graph with a ballast at the end of its forward: one more forward output, made last,
    that holds scratch as large as eager's peak while it is made (its workspace) and nothing
    after, standing for the segments after this one; and the memory there with nothing SAVEd
    but what must be. That plus K is a budget asking for a plan that keeps at most about K
    through the step: everything it SAVEs is alive there, the values only the backward reads
    that it makes in the forward included. (A plan of one is a plan of the other.)"""
    weight = simulate(graph, on_demand(graph, save_all_set(graph))).peak_bytes
    ballast = Node(name="<ballast>", kind="forward", workspace=weight, output=True)
    heavy = Graph((*graph.nodes, ballast), graph.transfers)
    try:
        bare = simulate(heavy, on_demand(heavy, required_saves(heavy, ())))
    except InvalidScheduleError:
        return None
    at = next(live for phase, name, live in bare.events if phase == "forward" and name == ballast.name)
    return heavy, at - bare.saved_bytes


# ---------------------------------------------------------------- the chain

@dataclasses.dataclass(frozen=True, eq=False)
class Links:
    """What each segment hands the next (rotor's links, `fxopt.solvers.block_rotor`): per
    segment s, the forward values of segment s-1 that s reads and no later segment does (a
    layer's input), as the step SAVEs them where kept (``values``), and their bytes; and whether
    segment s's backward reads its link to the next (``read_back``: a Llama layer's does, where
    the next norm's ``pow(x, 1)`` goes with it), which is then held until that backward. The
    first segment's link is empty."""

    values: tuple[frozenset[int], ...]
    bytes: tuple[int, ...]
    read_back: tuple[bool, ...]

    @property
    def all(self) -> frozenset[int]:
        return frozenset().union(*self.values)


def _links(blocks: Blocks) -> Links:
    graph = blocks.graph
    segments = blocks.segments
    segment_of = {i: s for s, seg in enumerate(segments) for i in seg.members}
    reads = [{v for v in seg.index[:seg.inputs] if graph.nodes[v].kind == "forward"} for seg in segments]
    uncounted = graph.resident | graph.free | must_save(graph)  # (there anyway: no link's bytes)
    values: list[frozenset[int]] = []
    later: set[int] = set()
    for s in reversed(range(len(segments))):
        mine = {v for v in reads[s] if segment_of.get(v) == s - 1 and v not in later}
        later |= reads[s]
        values.append(frozenset(graph.through_aliases(mine) & (graph.saveable | graph.free) - uncounted))
    values.reverse()
    read_back = []
    for s, seg in enumerate(segments):
        local = blocks.kinds[seg.kind]
        out = {k for k, g in enumerate(seg.index) if s + 1 < len(segments) and g in values[s + 1]}
        readers = (*local.backward_nodes, *local.backward_only)
        read_back.append(any(local.through_aliases(local.nodes[i].inputs) & out for i in readers))
    return Links(tuple(values), tuple(sum(graph.nodes[r].bytes for r in {graph.roots[v] for v in link}
                                          if r not in uncounted) for link in values), tuple(read_back))


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """What the step SAVEs for the segments besides their links, whatever their plans
    (`Blocks.forced` less the links; less the first segment's values too where those are
    recomputed where needed instead: a language model's RoPE tables and mask cost little to make
    again), with what one simulated plan of the whole step says of the rest of the step around
    each segment (the probe: see `block_chain`)."""

    saved: frozenset[int]
    links: Links  # (the first segment's link to the next is none where its values are made again where read)
    offsets: tuple[tuple[np.ndarray, np.ndarray], ...]  # per segment: at its forward and backward anchors
    sweep_fixed: np.ndarray  # per segment t: the step's memory as the sweeps before t's backward start
    extra_cost: float  # the recomputation outside the segments' plans (of what is not SAVEd)


@dataclasses.dataclass(eq=False)
class BlockChain:
    """The step's segments, its kinds' curves, what the segments hand one another, and the
    variants of what the step SAVEs for them."""

    blocks: Blocks
    kinds: list[KindCurve]
    variants: list[Variant]
    _memo: dict = dataclasses.field(default_factory=dict)  # (menus, sweeps, the lowest: by what they were made from)
    # What the copies of one chain share (`copy`: `memo_chain` hands each solve of the step a
    # copy, which refines its own curves): the entries made of the points they all hold, the
    # first ``_base`` of each kind's (menus, rotor's chains, sweeps' costs, the lowest), made once
    # for every solve of the step instead of once per solve.
    _shared: dict = dataclasses.field(default_factory=dict)
    _base: tuple[int, ...] | None = None  # (None: not a copy, nothing shared)

    def points(self, s: int) -> list[Point]:
        return self.kinds[self.blocks.segments[s].kind].points

    def copy(self) -> BlockChain:
        """The same chain, its curves drawn further apart from this one's (a solve refines its own)."""
        kinds = []
        for kind in self.kinds:
            other = copy.copy(kind)
            other.points, other.asked = list(kind.points), set(kind.asked)
            kinds.append(other)
        base = self._base if self._base is not None else tuple(len(kind.points) for kind in self.kinds)
        return BlockChain(self.blocks, kinds, self.variants, dict(self._memo), self._shared, base)

    def _kept(self, key: tuple, counts: tuple[int, ...], make: Callable[[], object]):
        """The entry of ``key`` (made of each kind's first ``counts`` points), made once: shared
        with the chain this one is a copy of, and its other copies, where those points are theirs
        too (the curves are only ever added to); else this chain's own."""
        store = self._shared if self._base is not None and all(map(int.__le__, counts, self._base)) else self._memo
        if key not in store:
            store[key] = make()
        return store[key]

    def _counts(self, kind: int | None = None, n: int = 0) -> tuple[int, ...]:
        """Each kind's points as counted in a key: all of them, or (``kind``) the first ``n`` of one."""
        if kind is None:
            return tuple(len(k.points) for k in self.kinds)
        return tuple(n if k == kind else 0 for k in range(len(self.kinds)))

    def rotor(self, variant: Variant) -> RotorChain:
        """The chain as rotor's dynamic program sees it with ``variant`` (`fxopt.solvers.block_rotor`):
        per segment, a menu of its kind's plans (see the module); one per variant and curves."""
        counts = self._counts()
        return self._kept(("rotor", id(variant), counts), counts, lambda: RotorChain(
            tuple(self._menu(variant, s) for s in range(len(self.blocks.segments))), variant.sweep_fixed))

    def _menu(self, variant: Variant, s: int) -> Menu:
        # (A kind's points are only ever added to: a menu of its first n points stays right.)
        n = len(self.points(s))
        return self._kept((id(variant), s, n), self._counts(self.blocks.segments[s].kind, n),
                          lambda: self._new_menu(variant, s))

    def _new_menu(self, variant: Variant, s: int) -> Menu:
        seg = self.blocks.segments[s]
        kind = self.kinds[seg.kind]
        points, link = kind.points, variant.links.bytes[s]
        off_f, off_b = variant.offsets[s]
        resident = self._resident_inputs(variant, s)
        keep = np.array([max(0, p.keep - kind.must) for p in points], dtype=np.int64)
        return Menu(
            keep=keep,
            cost=np.array([p.cost for p in points]),
            forward=np.array([np.max(p.forward + off_f, initial=0.0) for p in points]) - link,
            backward=np.array([np.max(p.backward + off_b, initial=0.0) for p in points]) - link,
            sweep=np.array([np.max(p.forward - kind.musts_made, initial=0.0) for p in points]) - resident - link,
            again=np.array([self._again(variant, s, p, False) for p in points]),
            again_link=np.array([self._again(variant, s, p, True) for p in points]),
            ck=int(np.argmin(keep)), link_cost=self._again(variant, s, None, True), link=link,
            holds_link=variant.links.read_back[s])

    def _again(self, variant: Variant, s: int, point: Point | None, with_link: bool) -> float:
        """The cost of making segment s again in a sweep, from its link and what the step holds
        anyway (`expand`): what ``point`` keeps (None: nothing), and its link to the next with
        ``with_link``; what it reads of another segment that the variant does not SAVE (RoPE's
        tables) made again with it. Infinite where that needs what cannot be made again."""
        key = (id(variant), s, None if point is None else id(point.schedule), with_link)
        kind = self.blocks.segments[s].kind
        # (made of ``point``: shared where it is one of the points the copies share)
        held = 0 if point is None else 1 + next(k for k, p in enumerate(self.kinds[kind].points) if p is point)

        def cost() -> float:
            graph, links, seg = self.blocks.graph, variant.links, self.blocks.segments[s]
            wanted = set(links.values[s + 1]) if with_link and s + 1 < len(links.values) else set()
            if point is not None:
                wanted |= {seg.index[i] for i in point.schedule.saved} - links.all
            there = self._there(variant) | links.values[s]
            try:
                return sum(graph.nodes[i].cost for i in to_recompute(graph, wanted, there))
            except InvalidScheduleError:
                return np.inf

        return self._kept(key, self._counts(kind, held), cost)

    def _there(self, variant: Variant) -> frozenset[int]:
        """What a sweep finds available whatever the decisions (`OnDemand`'s start, and what
        ``variant`` SAVEs): what it makes again is what it needs beyond these."""
        graph = self.blocks.graph
        return self._kept((id(variant), "there"), self._counts(0, 0), lambda: (  # (made of no point)
            graph.resident | graph.forward_outputs | variant.saved | must_save(graph)
            | {i for i, n in enumerate(graph.nodes) if n.tangent}))

    def _resident_inputs(self, variant: Variant, s: int) -> int:
        """Bytes of segment s's inputs that the step holds anyway while it is made again in the
        backward (parameters, what the variant SAVEs, what cannot be recomputed): counted in the
        sweep's fixed part, not again in the segment's own memory."""
        graph, seg = self.blocks.graph, self.blocks.segments[s]
        local = self.kinds[seg.kind].graph
        there = self._there(variant) | graph.free
        return sum(local.nodes[k].bytes for k in range(seg.inputs)
                   if not local.nodes[k].tangent and graph.through_aliases({seg.index[k]}) <= there)


def block_chain(graph: Graph, solve: Solve, lowest: Callable[[Graph], Schedule],
                blocks: Blocks | None = None, memo=None) -> BlockChain | None:
    """The step's chain of segments, each kind solved once (`kind_curve`), and the variants'
    offsets, each read from one simulated plan (the probe); None where the step has no repeated
    block or no such plan runs. ``memo``: the planner's (`fxopt.solvers.minimum.Memo`), whose
    simulations of the step the probes read (`simulated`)."""
    blocks = blocks or find_blocks(graph)
    if blocks is None:
        return None
    last = blocks.segments[-1].kind
    kinds = [kind_curve(kind, k != last or len(blocks.copies(k)) > 1, solve, lowest)
             for k, kind in enumerate(blocks.kinds)]
    if not all(k.points for k in kinds):
        return None
    links = _links(blocks)
    # The probe: each segment at the plan keeping least, which recomputes most, so reads in its
    # backward all that another plan would of what it reads from other segments (what those hold
    # is counted until their last possible reader: other choices may let it go sooner), every
    # link kept.
    least = [min(range(len(k.points)), key=lambda p: k.points[p].keep) for k in kinds]
    probe = [least[seg.kind] for seg in blocks.segments]
    chain = BlockChain(blocks, kinds, [])
    tree = all_kept(probe)
    for saved, handed in _saved_variants(blocks, links):
        try:
            schedule = expand(chain, tree, saved, handed)
            timeline = simulated(graph, schedule, memo)
        except InvalidScheduleError:
            continue
        own = sum(kinds[seg.kind].points[probe[s]].cost for s, seg in enumerate(blocks.segments))
        offsets, sweep_fixed = _offsets(chain, handed, probe, schedule, timeline)
        chain.variants.append(Variant(saved, handed, offsets, sweep_fixed, max(0.0, timeline.cost - own)))
    return chain if chain.variants else None


def _saved_variants(blocks: Blocks, links: Links) -> list[tuple[frozenset[int], Links]]:
    """What the step may SAVE for the segments besides their links, and their links: all else
    they read from one another (`Blocks.forced`); or that less the first segment's values, which
    are then recomputed where read (before a language model's layers: RoPE's tables, the mask,
    each made again at little cost, from what is always there); or that and the first
    segment's link to the next too (the embedding). Not SAVEing a value a later segment made (one read
    by two segments after it, where the blocks were cut at articulation values) would have it
    made again from the segments before, at a time the chain's model does not follow; rotor's
    decisions (`fxopt.solvers.block_rotor`) make the links again instead, where it pays."""
    shared = blocks.forced - links.all
    fresh = shared - frozenset(blocks.segments[0].members)
    out = {(shared, links.values): (shared, links), (fresh, links.values): (fresh, links)}
    if len(links.values) > 1 and links.values[1]:
        unlinked = Links((frozenset(), frozenset(), *links.values[2:]), (0, 0, *links.bytes[2:]),
                         (False, *links.read_back[1:]))
        out[(fresh, unlinked.values)] = (fresh, unlinked)
    return list(out.values())


def _offsets(chain: BlockChain, links: Links, probe: list[int], schedule: Schedule, timeline: Timeline):
    """From the probe's ``timeline``: per segment, the step's memory at each of its anchors less
    the segment's own there, less what the segments before it keep beyond what cannot be
    recomputed, and less the links alive then (rotor counts those); and per segment t, the
    step's memory as the sweeps before t's backward would start (at the end of the backward of
    the segment after it), less the same."""
    blocks, kinds = chain.blocks, chain.kinds
    graph = blocks.graph
    count = len(blocks.segments)
    anchor: dict[str, tuple[int, str, int]] = {}  # (a kind's anchors, through each copy's `Segment.index`)
    for s, seg in enumerate(blocks.segments):
        kind = kinds[seg.kind]
        for k, i in enumerate(kind.forward_anchors):
            anchor[graph.nodes[seg.index[i]].name] = (s, "f", k)
        for k, i in enumerate(kind.backward_anchors):
            anchor[graph.nodes[seg.index[i]].name] = (s, "b", k)
    shapes = [(len(kinds[seg.kind].forward_anchors), len(kinds[seg.kind].backward_anchors)) for seg in blocks.segments]
    read = _read(timeline.events, anchor.get, shapes)
    alive_f, alive_b, alive_sweep = _links_alive(chain.blocks, links, schedule)
    out, kept = [], 0
    for s, seg in enumerate(blocks.segments):
        p = kinds[seg.kind].points[probe[s]]
        out.append((read[s][0] - p.forward - kept - alive_f[s], read[s][1] - p.backward - kept - alive_b[s]))
        kept += max(0, p.keep - kinds[seg.kind].must)
    # The sweeps before t's backward: as a later segment's backward ends, the memory just after
    # its last node (the next step's, less what that step makes).
    sweep = np.full(count, np.inf)
    kept_after = np.cumsum([max(0, kinds[seg.kind].points[probe[s]].keep - kinds[seg.kind].must)
                            for s, seg in enumerate(blocks.segments)])
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    events = [e for e in timeline.events if e[0] == "backward"]
    last = None  # (the segment whose backward ran last)
    for k, (_, name, live) in enumerate(events):
        where = anchor.get(name)
        if where is None or where[1] != "b":
            continue
        if last is not None and where[0] < last[0]:
            for t in range(where[0], last[0]):
                sweep[t] = min(sweep[t], last[1] - kept_after[t] - alive_sweep[t])
        after = events[k + 1] if k + 1 < len(events) else None
        last = (where[0], live if after is None else after[2] - _made(graph, index.get(after[1])))
    return tuple(out), sweep


def _made(graph: Graph, i: int | None) -> int:
    """The bytes node i's step adds while it runs: its own storage (a view has none) and its
    workspace; none counted for a reload or a decompression (``i`` None: the memory then is
    counted whole, which is above the memory before it)."""
    if i is None:
        return 0
    node = graph.nodes[i]
    return (node.bytes if graph.roots[i] == i else 0) + node.workspace


def _links_alive(blocks: Blocks, links: Links, schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes of the links a schedule SAVEs that are alive (made, not yet read for the last time)
    at each segment's forward anchors, at its backward anchors (its own input aside: it is in its
    own graph), and as the sweeps before its backward start."""
    graph = blocks.graph
    count = len(blocks.segments)
    generated = as_generated(graph, schedule)
    where = {i: s for s, seg in enumerate(blocks.segments) for i in seg.members if graph.nodes[i].kind == "backward"}
    # Each backward step's segment: a recomputation's is that of the backward node it runs before.
    segment_at, nxt = [0] * len(generated.backward), 0
    for e in reversed(range(len(generated.backward))):
        nxt = where.get(generated.backward[e], nxt)
        segment_at[e] = nxt
    last_reader: dict[int, int] = {}  # root -> the segment whose backward reads it last
    for e, i in enumerate(generated.backward):
        for j in graph.nodes[i].inputs:
            last_reader[graph.roots[j]] = segment_at[e]
    alive_f, alive_b, alive_sweep = np.zeros(count), np.zeros(count), np.zeros(count)
    saved_roots = {graph.roots[i] for i in generated.saved}
    for k in range(1, count):
        roots = {graph.roots[v] for v in links.values[k]} & saved_roots
        for r in roots:
            size, reader = graph.nodes[r].bytes, last_reader.get(r)
            alive_f[k + 1:] += size
            if reader is not None:
                alive_b[max(reader, k + 1):] += size
                alive_sweep[reader:] += size
    return alive_f, alive_b, alive_sweep


Choice = tuple[Variant, Tree]


def _choices(chain: BlockChain, budget: int, variants: list[Variant] | None = None
             ) -> list[tuple[float, int, Variant, Tree]]:
    """Per variant (of ``variants``, by default all), the cheapest decisions within ``budget``
    that make nothing again (exact in bytes) and rotor's (with sweeps; what the callers hold in
    slots), with their predicted cost."""
    found = []
    for k, variant in enumerate(chain.variants):
        if variants is not None and variant not in variants:
            continue
        rotor = chain.rotor(variant)
        for tree in dict.fromkeys((kept_tree(rotor, budget), cheapest_tree(rotor, budget))):
            if tree is not None:
                found.append((evaluate(rotor, tree)[1] + variant.extra_cost, k, variant, tree))
    return sorted(found, key=lambda f: f[:2])


def _lowest(chain: BlockChain) -> tuple[int, Choice]:
    """The least budget at which some choice's predicted peak fits, and the choice (rotor's
    lowest-peak decisions, the cheapest of them)."""
    counts = chain._counts()
    return chain._kept(("lowest", *counts), counts, lambda: _new_lowest(chain))


def _new_lowest(chain: BlockChain) -> tuple[int, Choice]:
    best = None
    for k, variant in enumerate(chain.variants):
        peak, cost, tree = min_peak_tree(chain.rotor(variant))
        if best is None or (math.ceil(peak), cost + variant.extra_cost, k) < best[:3]:
            best = (math.ceil(peak), cost + variant.extra_cost, k, variant, tree)
    return best[0], best[3:]


def predicted_peak(chain: BlockChain, found: Choice) -> int:
    """The peak the model gives a choice (`block_rotor.evaluate`)."""
    variant, tree = found
    return math.ceil(evaluate(chain.rotor(variant), tree)[0])


def expand(chain: BlockChain, tree: Tree, saved: frozenset[int], links: Links) -> Schedule:
    """The step's schedule for rotor's decisions (see the module), SAVEing ``saved`` besides
    what the plans run in the forward save and the links kept there: in the backward, each sweep
    makes again what its segments' plans keep and the links it keeps (from the nearest values
    available), just before the backward of the segment it serves."""
    blocks = chain.blocks
    graph = blocks.graph
    steps = actions(tree)
    last = len(blocks.segments) - 1
    first = next(k for k, a in enumerate(steps) if a[0] == "B")
    everything_linked = links.all

    def kept_by(s: int, plan: int) -> set[int]:
        seg = blocks.segments[s]
        return {seg.index[i] for i in chain.points(s)[plan].schedule.saved} - everything_linked

    keep, compressed = set(saved), set()
    for action in steps[:first]:
        if action[0] == "all":
            s, plan, with_link = action[1:]
            keep |= kept_by(s, plan) | (links.values[s + 1] if with_link else set())
            seg = blocks.segments[s]
            compressed |= {seg.index[i] for i in chain.points(s)[plan].schedule.compressed}
        elif action[0] == "ck":
            keep |= links.values[action[1] + 1]
    assert steps[first][:2] == ("B", last)
    builder = OnDemand(graph, frozenset(keep) & (graph.saveable | graph.free))
    where: dict[int, int] = {}
    for s, seg in enumerate(blocks.segments):
        where.update((g, s) for g in seg.members if graph.nodes[g].kind == "backward")
    queue = deque(steps[first:])
    current, local = None, deque()
    # (A plan's own recomputations are made as it makes them, even of a value made again just
    # before for what another segment reads: reusing that copy would hold it, and all made with
    # it, from the first backward that needed it to the segment's own: on a 32-layer Llama, a
    # peak of 775 MB where 537 MB do.)
    for b in graph.backward_nodes:
        s = where[b]
        if s != current:
            plan = None
            while queue and plan is None:
                action = queue.popleft()
                if action[0] == "B":
                    plan = action[2] if action[1] == s else None
                elif action[0] == "all":
                    wanted = kept_by(action[1], action[2]) | (links.values[action[1] + 1] if action[3] else set())
                    builder.recompute(wanted, keep=wanted)
                elif action[0] == "ck":
                    builder.recompute(links.values[action[1] + 1], keep=links.values[action[1] + 1])
                elif not links.read_back[action[1]]:  # (else its backward reads it: kept until then)
                    builder.forget(links.values[action[1] + 1])
            if plan is None:
                raise InvalidScheduleError(f"no backward of segment {s} in the decisions")
            current, seg = s, blocks.segments[s]
            local = deque(seg.index[i] for i in chain.points(s)[plan].schedule.backward)
        while local:
            i = local.popleft()
            builder.run(i)
            if i == b:
                break
    return prune(graph, Schedule(builder.saved, builder.backward(), frozenset(compressed) & builder.saved))


def _refine(chain: BlockChain, trees: list[Tree], solve: Solve, most: int) -> tuple[int, int]:
    """Draw each kind's curve finer around the plans ``trees`` run (`KindCurve.between`),
    solving ``most`` times at most: (points added, solves)."""
    added = solved = 0
    chosen_plans = [(s, p) for tree in trees for s, p in plans(tree).items()]
    for k, kind in enumerate(chain.kinds):
        chosen = {p for s, p in chosen_plans if chain.blocks.segments[s].kind == k}
        for value in kind.between(chosen)[:most - solved]:
            solved += 1
            added += kind.at(value, solve) is not None
    return added, solved


def block_candidates(chain: BlockChain | None, budget: int, solve: Solve, refinements: int,
                     memo=None) -> list[Candidate]:
    """For `fxopt.solvers.solve`: the chain's cheapest plans within ``budget`` (`_leads`),
    simulated (`simulated`, in ``memo``), or where none fits its lowest-peak plan. The curves are
    refined around the cheapest (`_refine`: `REFINE_ROUNDS` rounds and ``refinements`` solves at
    most); where the choices are over the budget when simulated, they are made again with the
    budget lowered by the excess, twice at most."""
    if chain is None:
        return []
    runs: dict[tuple, Candidate] = {}

    def run(found: Choice) -> Timeline | None:
        key = (chain.variants.index(found[0]), found[1])
        if key not in runs:
            try:
                runs[key] = _run(chain, found, memo)
            except InvalidScheduleError:  # (not a plan of this step: no candidate)
                return None
        return runs[key][1]

    made: dict[tuple, list[Choice]] = {}

    def leads(target: int, variants: list[Variant] | None = None) -> list[Choice]:
        # (`_leads` again on curves no point was added to since, at the same budget, is the
        # same choice: made once. A curve's points are only ever added to.)
        key = (target, None if variants is None else tuple(map(id, variants)),
               tuple(len(kind.points) for kind in chain.kinds))
        if key not in made:
            made[key] = _leads(chain, target, variants)
        return made[key]

    variants = None  # (the rounds after the first: the variants it chose)
    for _ in range(REFINE_ROUNDS):  # (on the predictions: only the choices it ends with are simulated)
        found = leads(budget, variants)
        if not found or refinements <= 0:
            break
        variants = [variant for variant, _ in found]
        added, solved = _refine(chain, [tree for _, tree in found], solve, refinements)
        refinements -= solved
        if not added:
            break
    target = budget
    for _ in range(3):
        found = leads(target)
        timelines = [run(f) for f in found]
        over = [t.peak_bytes for t in timelines if t is not None and t.peak_bytes > budget]
        if not found or len(over) < len(found):
            break
        target -= min(over) - budget
    if not any(t.peak_bytes <= budget for _, t in runs.values()):
        run(_lowest(chain)[1])  # (for the phases that complete a plan over the budget)
    return list(runs.values())


def _leads(chain: BlockChain, budget: int, variants: list[Variant] | None = None) -> list[Choice]:
    """The cheapest choice within ``budget``, and the cheapest making nothing again where that is
    another (the one a tight budget needs, the other the one whose plans are worth refining
    where the budget is loose); of ``variants`` (by default all)."""
    found = _choices(chain, budget, variants)
    kept = [f for f in found if all(a[0] != "ck" for a in actions(f[3]))]
    return list(dict.fromkeys(f[2:] for f in found[:1] + kept[:1]))


def _run(chain: BlockChain, found: Choice, memo=None) -> Candidate:
    variant, tree = found
    schedule = expand(chain, tree, variant.saved, variant.links)
    return schedule, simulated(chain.blocks.graph, schedule, memo)


def lowest_block_plan(chain: BlockChain | None, memo=None) -> Candidate | None:
    """The chain's plan of the least predicted peak (the cheapest of those), simulated (`simulated`)."""
    if chain is None:
        return None
    try:
        return _run(chain, _lowest(chain)[1], memo)
    except InvalidScheduleError:
        return None


def memo_chain(graph: Graph, solvers: tuple[Solve, Callable[[Graph], Schedule]], key: tuple,
               memo=None) -> BlockChain | None:
    """`block_chain` with the kinds' ``solvers`` (`solver_for`), kept in ``memo`` (a
    `fxopt.solvers.minimum.Memo`, by the graph's content and ``key``: what the solvers' answers
    depend on) and given as a copy, which a solve may refine without changing what the next one
    starts from."""
    key = ("blocks", *key)
    known = memo.get(graph, key) if memo is not None else None
    if known is None:
        known = (block_chain(graph, *solvers, memo=memo),)
        if memo is not None:
            memo.put(graph, key, known)
    return None if known[0] is None else known[0].copy()


def solver_for(solve, lowest, effort: Effort, deadline: Deadline,
               mip_solver: str | None) -> tuple[Solve, Callable[[Graph], Schedule]]:
    """The kinds' solvers, from ``solve`` (`fxopt.solvers.solve`: here with `KIND_SOLVER`, None
    where nothing fits) and ``lowest`` (`fxopt.solvers.minimum.lowest_schedule`: a lowest-peak
    plan), with the effort and safety stop of the solve that asks. (Given, not imported: they run
    this module's phase.)"""
    def at(graph: Graph, budget: int) -> Schedule | None:
        # (Said once, by the solve that asks: a phase the time limit stops is named in its shared
        # ``deadline``, and so in its answer and warning.)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return solve(graph, budget, KIND_SOLVER, effort=effort, time_limit=deadline, mip_solver=mip_solver,
                             on_progress=_quiet).schedule
            except InfeasibleBudgetError:
                return None

    def lowest_of(graph: Graph) -> Schedule:
        return lowest(graph, effort=effort, time_limit=deadline, mip_solver=mip_solver).schedule

    return at, lowest_of


def _quiet(message: str) -> None:
    """(A kind's solves say nothing: the step's solve says what it does.)"""
