"""Plans for a step made of repeated blocks: each kind of segment solved once for a curve of
plans, one plan chosen per segment by dynamic programming over the chain, and the step's schedule
made from those choices and simulated.

The step is a chain of segments (`fxopt.solvers.blocks`): the forward runs them in order, the
backward in reverse. While segment s runs, forward or backward, the step holds

    what segments before s keep     their SAVEd values, held from the end of their forward
                                    to their backward: the sum of keep(p_j), j < s
  + what s holds in its own graph   as its plan p_s runs (`Point`: its memory per step)
  + the rest                        parameters, the gradients made so far, what segments read
                                    from one another: the same whatever the plans (the offsets)

so a choice of plans (p_s) peaks at  max_s ( sum_{j<s} keep(p_j) + need_s(p_s) ), need_s(p) being
the most of "p's own memory + offset_s" over s's steps, and costs the sum of their costs. That is
Rockmate's hierarchical approach (Zhao et al., 2023) over rotor's chain (Beaumont et al., 2019;
`fxopt.solvers.chain`): a plan per block from a curve solved once, the blocks chained by
dynamic programming.

  - A kind's curve (`KindCurve`): plans of its own graph from `fxopt.solvers.solve` (the instant
    program and the heuristics: counted effort, as everywhere), each asked to keep at most so
    many bytes through the step: its graph with a ballast at the end of its forward, which stands
    for the segments after it (`_with_ballast`), planned at that many bytes above the ballast;
    the last segment's kind, which keeps nothing for another, is asked for its own peak instead.
    Also eager's plan, the plan keeping nothing, and the kind's lowest-peak plan. Each is
    simulated in the kind's graph: its keep (`Timeline.saved_bytes`), cost, memory per step.
  - What the segments hand one another (`Variant`): all SAVEd; or the first segment's values
    (a language model's embedding, RoPE tables, mask) recomputed where read; or none, each
    segment's input recomputed from the one before where read (the lowest peaks: each layer made
    again, layer after layer, around what it cannot recompute, its attention, which its plan
    SAVEs). Each variant's offsets come from one plan of the whole step (each segment at its
    kind's plan keeping least, which reads most of what others hand it) simulated: at each step
    of a segment, the step's memory less the segment's own and less what the segments before
    keep. Steps are matched by node: a forward value, or the backward node a recomputation runs
    before (`_read`); its cost beyond the segments' own is the variant's.
  - The choice (`_cheapest`): the cheapest choice predicted within the budget, the (kept so far,
    cost) pairs no other beats carried from segment to segment; the lowest peak (`_lowest`):
    the least budget at which choosing, segment by segment, the plan keeping least among those
    that fit gets through (keeping less never hurts a later segment).
  - Refinement (`block_candidates`): each kind solved again halfway from the plans the cheapest
    choice takes to their neighbours on its curve, and the choice made again: the curve drawn
    finely where the budget needs it, `Effort.block_refinements` solves at most.
  - The schedule (`expand`): SAVE what each chosen plan saves and what the variant SAVEs; the
    backward runs each plan's backward (its recomputations in it), in the step's backward order,
    recomputing just before it what a segment reads from another and is not SAVEd.

Nothing is trusted without the simulator: the prediction is exact for the plan the offsets were
read from, above it where another plan lets go sooner of what segments share, and a choice whose
simulated peak is over the budget anyway is made again with the budget lowered by the excess.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections import deque
from collections.abc import Callable

import numpy as np

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers.blocks import Blocks, find_blocks
from fxopt.solvers.effort import Deadline, Effort
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.heuristics import Candidate
from fxopt.solvers.schedule import (InvalidScheduleError, OnDemand, Schedule, Timeline, as_generated, on_demand, prune,
                                    required_saves, save_all_set, simulate)

# The shares of the way from a kind's plan keeping least to eager's that it is first solved at.
LEVELS = (0.2, 0.5, 0.8)
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
# The most (kept bytes, cost) pairs `_cheapest` carries from a segment to the next; beyond it,
# evenly thinned.
PARETO_CAP = 4000

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
class Variant:
    """What the step SAVEs for the segments whatever their plans (`Blocks.forced`, less the first
    segment's values where those are recomputed where needed instead: a language model's
    embedding and RoPE tables cost little to make again), with the offsets and the cost that
    come with it."""

    saved: frozenset[int]
    offsets: tuple[tuple[np.ndarray, np.ndarray], ...]  # per segment: at its forward and backward anchors
    extra_cost: float  # the recomputation outside the segments' plans (of what is not SAVEd)


@dataclasses.dataclass(eq=False)
class BlockChain:
    """The step's segments, its kinds' curves, and the variants of what the step SAVEs for them."""

    blocks: Blocks
    kinds: list[KindCurve]
    variants: list[Variant]

    def points(self, s: int) -> list[Point]:
        return self.kinds[self.blocks.segments[s].kind].points

    def need(self, variant: Variant, s: int) -> np.ndarray:
        """Per point of segment s's kind: the most the step holds while it runs, less what the
        segments before keep."""
        off_f, off_b = variant.offsets[s]
        return np.array([max(np.max(p.forward + off_f, initial=0.0), np.max(p.backward + off_b, initial=0.0))
                         for p in self.points(s)])

    def keep(self, s: int) -> np.ndarray:
        return np.array([p.keep for p in self.points(s)], dtype=np.int64)

    def copy(self) -> BlockChain:
        """The same chain, its curves drawn further apart from this one's (a solve refines its own)."""
        kinds = []
        for kind in self.kinds:
            other = copy.copy(kind)
            other.points, other.asked = list(kind.points), set(kind.asked)
            kinds.append(other)
        return BlockChain(self.blocks, kinds, self.variants)

    def cost(self, s: int) -> np.ndarray:
        return np.array([p.cost for p in self.points(s)])


def block_chain(graph: Graph, solve: Solve, lowest: Callable[[Graph], Schedule],
                blocks: Blocks | None = None) -> BlockChain | None:
    """The step's chain of segments, each kind solved once (`kind_curve`), and the variants'
    offsets, each read from one simulated plan; None where the step has no repeated block or
    no such plan runs."""
    blocks = blocks or find_blocks(graph)
    if blocks is None:
        return None
    last = blocks.segments[-1].kind
    kinds = [kind_curve(kind, k != last or len(blocks.copies(k)) > 1, solve, lowest)
             for k, kind in enumerate(blocks.kinds)]
    if not all(k.points for k in kinds):
        return None
    # The probe: each segment at the plan keeping least, which recomputes most, so reads in its
    # backward all that another plan would of what it reads from other segments: what those
    # hold is counted until their last possible reader (other choices may let it go sooner).
    least = [min(range(len(k.points)), key=lambda p: k.points[p].keep) for k in kinds]
    probe = [least[seg.kind] for seg in blocks.segments]
    variants = []
    for saved in _saved_variants(blocks):
        try:
            timeline = simulate(graph, expand(blocks, kinds, probe, saved))
        except InvalidScheduleError:
            continue
        own = sum(kinds[seg.kind].points[probe[s]].cost for s, seg in enumerate(blocks.segments))
        variants.append(Variant(saved, _offsets(blocks, kinds, probe, timeline), max(0.0, timeline.cost - own)))
    return BlockChain(blocks, kinds, variants) if variants else None


def _saved_variants(blocks: Blocks) -> list[frozenset[int]]:
    """What the step may SAVE for the segments: all that segments read from one another
    (`Blocks.forced`); or that less the first segment's values, which are then recomputed where
    read (before a language model's layers: the embedding, RoPE's tables, the mask, each made
    again at little cost); or none of it, every value a segment hands the next recomputed from
    the one before where the backward reads it (what a layer cannot recompute, its attention, is
    SAVEd by its plan: the rest of each layer is made again, layer after layer, at the lowest
    peak; rotor's multi-level checkpointing, in its simplest form)."""
    return list(dict.fromkeys((blocks.forced, blocks.forced - frozenset(blocks.segments[0].members), frozenset())))


def _offsets(blocks: Blocks, kinds: list[KindCurve], probe: list[int], timeline: Timeline):
    """Per segment, the step's memory at each of its anchors in ``timeline`` (the ``probe``
    choice's), less the segment's own there and less what the segments before it keep."""
    graph = blocks.graph
    anchor: dict[str, tuple[int, str, int]] = {}  # (a kind's anchors, through each copy's `Segment.index`)
    for s, seg in enumerate(blocks.segments):
        kind = kinds[seg.kind]
        for k, i in enumerate(kind.forward_anchors):
            anchor[graph.nodes[seg.index[i]].name] = (s, "f", k)
        for k, i in enumerate(kind.backward_anchors):
            anchor[graph.nodes[seg.index[i]].name] = (s, "b", k)
    shapes = [(len(kinds[seg.kind].forward_anchors), len(kinds[seg.kind].backward_anchors)) for seg in blocks.segments]
    read = _read(timeline.events, anchor.get, shapes)
    out, kept = [], 0
    for s, seg in enumerate(blocks.segments):
        p = kinds[seg.kind].points[probe[s]]
        out.append((read[s][0] - p.forward - kept, read[s][1] - p.backward - kept))
        kept += p.keep
    return tuple(out)


Choice = tuple[Variant, list[int]]


def _cheapest(chain: BlockChain, budget: int) -> Choice | None:
    """The least-cost choice (a variant, a point per segment) whose predicted peak is within
    ``budget``, or None: per variant, the (kept so far, cost) pairs no other beats, carried
    segment by segment."""
    found = [(cost + variant.extra_cost, k, variant, choice) for k, variant in enumerate(chain.variants)
             for cost, choice in [_cheapest_in(chain, variant, budget)] if choice is not None]
    return min(found, key=lambda f: f[:2])[2:] if found else None


def _cheapest_in(chain: BlockChain, variant: Variant, budget: int) -> tuple[float, list[int] | None]:
    kept, spent = np.zeros(1, dtype=np.int64), np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for s in range(len(chain.blocks.segments)):
        need, keep, cost = chain.need(variant, s), chain.keep(s), chain.cost(s)
        fits = kept[:, None] + need[None, :] <= budget  # (state, point)
        state, point = np.nonzero(fits)
        if not len(state):
            return 0.0, None
        k, c = kept[state] + keep[point], spent[state] + cost[point]
        order = np.lexsort((c, k))
        k, c, state, point = k[order], c[order], state[order], point[order]
        best_before = np.concatenate(([np.inf], np.minimum.accumulate(c)[:-1]))
        front = c < best_before - 1e-15  # (no state with less kept costs as little)
        k, c, state, point = k[front], c[front], state[front], point[front]
        if len(k) > PARETO_CAP:  # (thinned evenly; the least-kept and the cheapest stay)
            pick = np.unique(np.linspace(0, len(k) - 1, PARETO_CAP).round().astype(int))
            k, c, state, point = k[pick], c[pick], state[pick], point[pick]
        kept, spent = k, c
        back.append((state, point))
    k = int(np.argmin(spent))
    total = float(spent[k])
    choice = []
    for state, point in reversed(back):
        choice.append(int(point[k]))
        k = int(state[k])
    return total, choice[::-1]


def _lowest(chain: BlockChain) -> int:
    """The least budget at which some choice's predicted peak fits (see the module)."""
    return min(_lowest_in(chain, variant) for variant in chain.variants)


def _lowest_in(chain: BlockChain, variant: Variant) -> int:
    count = len(chain.blocks.segments)
    needs, keeps = [chain.need(variant, s) for s in range(count)], [chain.keep(s) for s in range(count)]

    def fits(budget: int) -> bool:
        kept = 0
        for need, keep in zip(needs, keeps):
            ok = need + kept <= budget
            if not ok.any():
                return False
            kept += int(keep[ok].min())
        return True

    lo, hi, kept = int(max(n.min() for n in needs)), 0, 0
    for need, keep in zip(needs, keeps):  # every segment at the point keeping least fits here
        p = int(np.argmin(keep))
        hi = max(hi, int(np.ceil(kept + need[p])))
        kept += int(keep[p])
    hi = max(hi, lo)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def expand(blocks: Blocks, kinds: list[KindCurve], choice: list[int], saved: frozenset[int] | None = None) -> Schedule:
    """The step's schedule for a point per segment (see the module), SAVEing ``saved`` (by
    default `Blocks.forced`) besides what the points save; what a segment reads from another
    that is not SAVEd (nor made fresh, a view) is recomputed just before it is read."""
    graph = blocks.graph
    keep, compressed = set(blocks.forced if saved is None else saved), set()
    queues: list[deque] = []
    where: dict[int, int] = {}
    for s, seg in enumerate(blocks.segments):
        local = kinds[seg.kind].points[choice[s]].schedule
        keep |= {seg.index[i] for i in local.saved}
        compressed |= {seg.index[i] for i in local.compressed}
        queues.append(deque(seg.index[i] for i in local.backward))
        where.update((g, s) for g in seg.members if graph.nodes[g].kind == "backward")
    builder = OnDemand(graph, frozenset(keep) & (graph.saveable | graph.free))
    # (A plan's own recomputations are made as it makes them, even of a value made again just
    # before for what another segment reads: reusing that copy would hold it, and all made with
    # it, from the first backward that needed it to the segment's own: on a 32-layer Llama, a
    # peak of 775 MB where 537 MB do.)
    for b in graph.backward_nodes:
        queue = queues[where[b]]
        while queue:
            i = queue.popleft()
            builder.run(i)
            if i == b:
                break
    return prune(graph, Schedule(builder.saved, builder.backward(), frozenset(compressed) & builder.saved))


def _refine(chain: BlockChain, choice: list[int], solve: Solve, most: int) -> tuple[int, int]:
    """Draw each kind's curve finer around the plans ``choice`` takes (`KindCurve.between`),
    solving ``most`` times at most: (points added, solves)."""
    added = solved = 0
    for k, kind in enumerate(chain.kinds):
        chosen = {p for s, p in enumerate(choice) if chain.blocks.segments[s].kind == k}
        for value in kind.between(chosen)[:most - solved]:
            solved += 1
            added += kind.at(value, solve) is not None
    return added, solved


def block_candidates(chain: BlockChain | None, budget: int, solve: Solve, refinements: int) -> list[Candidate]:
    """For `fxopt.solvers.solve`: the chain's lowest-peak plan and its cheapest within
    ``budget``, simulated. The curves are refined around the cheapest (`_refine`: `REFINE_ROUNDS`
    rounds and ``refinements`` solves at most); where the choice is over the budget when
    simulated, it is made again with the budget lowered by the excess, twice at most."""
    if chain is None:
        return []
    runs: dict[tuple, Candidate] = {}

    def run(found: Choice) -> Timeline | None:
        key = (chain.variants.index(found[0]), tuple(found[1]))
        if key not in runs:
            try:
                runs[key] = _run(chain, found)
            except InvalidScheduleError:  # (not a plan of this step: no candidate)
                return None
        return runs[key][1]

    lowest = _cheapest(chain, _lowest(chain))
    if lowest is not None:
        run(lowest)
    for _ in range(REFINE_ROUNDS):  # (on the predictions: only the choice it ends with is simulated)
        found = _cheapest(chain, budget)
        if found is None or refinements <= 0:
            break
        added, solved = _refine(chain, found[1], solve, refinements)
        refinements -= solved
        if not added:
            break
    target = budget
    for _ in range(3):
        found = _cheapest(chain, target)
        timeline = None if found is None else run(found)
        if timeline is None or timeline.peak_bytes <= budget:
            break
        target -= timeline.peak_bytes - budget
    return list(runs.values())


def _run(chain: BlockChain, found: Choice) -> Candidate:
    variant, choice = found
    schedule = expand(chain.blocks, chain.kinds, choice, variant.saved)
    return schedule, simulate(chain.blocks.graph, schedule)


def lowest_block_plan(chain: BlockChain | None) -> Candidate | None:
    """The chain's plan of the least predicted peak (the cheapest of those), simulated."""
    found = None if chain is None else _cheapest(chain, _lowest(chain))
    try:
        return None if found is None else _run(chain, found)
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
        known = (block_chain(graph, *solvers),)
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
