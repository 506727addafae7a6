"""Pipeline stage cuts: where to split a training step into stages, and each stage's plan.

A pipeline runs a step as S stages on S devices, each on M microbatches in turn. Stage s of
torch's 1F1B runs ``k_s = min(M, S - s)`` forwards before its first backward, so it holds the
SAVEd values of k_s microbatches at once (GPipe: all M); stage 0 holds S of them, the last one.
Equal layers per stage give unequal memory, and the stage that runs out decides the batch size.
This module chooses the cuts and, with fxopt's own `solve`, each stage's rematerialization.

The model, on the solver graph of one microbatch's step (`Graph`):

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
  - **Memory of a stage on its device** (`InFlight.device_peak`): one microbatch's step as
    planned (``Timeline.peak_bytes``), plus, for each of the k_s - 1 other microbatches in
    flight, its SAVEd values (``Timeline.saved_bytes``) and its output (held for its backward),
    plus what torch's runtime holds whatever the plan (`runtime_fixed`: receive buffers per
    microbatch, sends in flight), the gradients accumulated from earlier microbatches, and on the
    last stage the loss after its forward. `solve_stage` finds the cheapest schedule for which
    that is within the budget, with `solve` at step budgets it searches.
  - **The dynamic program** (`best_split`): stage boundaries at cut points, minimizing the
    slowest stage's time (its forward and backward cost plus its recompute cost) subject to every
    stage's modelled memory fitting the budget, then the largest memory per budget. It is exact
    over the cut points for the model below; the model is the approximation.

What is approximate: inside the DP a stage's plan is not solved. The forward between consecutive
cut points is an *atom*; each atom's solver graph is planned once per structure (repeated blocks
share it) by the heuristics and by `solve` at a few budgets (`atom_options`), which gives it, for
each share of what eager SAVEs (`SAVED_LEVELS`), the cheapest schedule found that SAVEs at most
that, as (SAVEd bytes, transient bytes, recompute cost). A stage at remat level λ takes option λ
of each atom: SAVEd bytes add up (with the cut values between its atoms that the backward reads
counted as SAVEd), transient bytes are the largest atom's, recompute costs add up. This is a
model of a plan, not a plan: plans across atom boundaries (recomputing two atoms from the
first's input) are not offered to it, and the atoms' own peaks are composed, not simulated.
What is exact: every stage of the chosen cuts is then planned by `solve_stage` on its own graph
(the real stage module's, when `fxopt.pipeline` captures it) and its memory checked; a stage that
does not fit raises that stage's margin in the DP by its excess, and the DP runs again
(`cut_and_plan`, `FEEDBACK_ROUNDS` times at most). The predicted step time and bubble
(`pipeline_timing`) replay the schedule's order of forwards and backwards per stage with each
stage's planned times, communication not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Sequence

import numpy as np

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers.auto import (DEFAULT_TIME_LIMIT, Solution, SolverTimeoutWarning, eager_schedule, lowest_schedule,
                                min_feasible_budget, solve)
from fxopt.solvers.chain import chain_candidates
from fxopt.solvers.graph import Graph, Node
from fxopt.solvers.heuristics import HEURISTICS
from fxopt.solvers.schedule import Schedule, Timeline, simulate

SCHEDULES = ("1F1B", "GPipe")

# The most tensors a cut may carry.
MAX_CROSSING = 4

# Cut points wanted per stage before a cut may carry more tensors, and the most the DP is given
# when fewer tensors per cut already allow a split (see `choose_points`).
POINTS_PER_STAGE = 2
MAX_POINTS = 256

# Times the DP runs again with a stage's margin raised by what its exact plan was over.
FEEDBACK_ROUNDS = 4

# `solve_stage`: solves at most per stage, the least time each gets, and the share of the budget
# within which the search between a budget that fits and one that does not stops.
STAGE_SOLVES = 6
MIN_STAGE_SECONDS = 0.5
STAGE_TOLERANCE = 0.01

# The shares of the way from an atom's eager peak to its lowest peak at which it is solved, and
# the remat levels of the DP: shares of what eager SAVEs (see `atom_options`).
ATOM_LEVELS = (2 / 3, 1 / 3, 0.0)
SAVED_LEVELS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.1, 0.0)


def in_flight_count(schedule: str, stages: int, microbatches: int, s: int) -> int:
    """Microbatches whose SAVEd values stage ``s`` holds at once: torch's 1F1B runs
    ``min(M, S - s)`` forwards before its first backward; GPipe runs all M."""
    return microbatches if schedule == "GPipe" else min(microbatches, stages - s)


# ---------------------------------------------------------------- memory beside one microbatch

@dataclasses.dataclass(frozen=True)
class InFlight:
    """What a pipeline stage's device holds beside one microbatch's step: ``microbatches`` in
    flight at once (this one included), each of the others with its SAVEd values and
    ``held_bytes`` (its output, kept for its backward); ``fixed_bytes`` whatever the plan;
    ``accumulated_bytes`` of gradients from earlier microbatches once the first backward is
    done, when ``accumulating`` microbatches are in flight at most (`accumulation`); and
    ``after_forward_bytes`` that run beside the state the forward ends in (the loss, which
    torch's schedules compute outside the last stage's module, between its forward and backward)."""

    microbatches: int = 1
    held_bytes: int = 0
    fixed_bytes: int = 0
    accumulated_bytes: int = 0
    accumulating: int = 1
    after_forward_bytes: int = 0

    def device_peak(self, graph: Graph, schedule: Schedule, timeline: Timeline | None = None) -> int:
        """The device's peak with ``schedule`` for each microbatch (its output counted once where
        it is SAVEd too)."""
        timeline = timeline or simulate(graph, schedule)
        per = timeline.saved_bytes + self.held_bytes - _saved_outputs(graph, schedule)
        others = max((self.microbatches - 1) * per, (self.accumulating - 1) * per + self.accumulated_bytes)
        step = timeline.peak_bytes
        if self.after_forward_bytes:
            forward_end = next((b for phase, _, b in reversed(timeline.events) if phase == "forward"), 0)
            step = max(step, forward_end + self.after_forward_bytes)
        return step + others + self.fixed_bytes

    def key(self) -> str:
        return (f"{self.microbatches}x{self.held_bytes}+{self.fixed_bytes}+{self.accumulating}x"
                f"{self.accumulated_bytes}+{self.after_forward_bytes}")


def _saved_outputs(graph: Graph, schedule: Schedule) -> int:
    """Bytes of the forward's outputs that are also SAVEd on the device (counted in both)."""
    on_device = schedule.saved - schedule.compressed - schedule.offloaded - graph.free
    roots = {graph.roots[i] for i in on_device} & {graph.roots[i] for i in graph.forward_outputs}
    return sum(graph.nodes[r].bytes for r in roots)


def accumulation(schedule: str, stages: int, microbatches: int, s: int) -> int:
    """Microbatches in flight on stage ``s`` at most once a backward has accumulated gradients:
    on 1F1B with more microbatches than it warms up with, all of them (its second backward comes
    after another forward); else one fewer (each backward only lowers the count); none with one
    microbatch (nothing accumulates)."""
    k = in_flight_count(schedule, stages, microbatches, s)
    if microbatches == 1:
        return 0
    return k if schedule == "1F1B" and microbatches > k else k - 1


def runtime_fixed(schedule: str, stages: int, microbatches: int, s: int, received, sent, extra=0):
    """What torch's runtime holds on stage ``s``'s device beside one microbatch's step, whatever
    the plan (``received``, ``sent``: bytes of one microbatch's stage input and output; ``grads``:
    of its parameters' gradients), as torch 2.13's `PipelineStage` and schedules hold it:

      - the inputs of the other microbatches: on the first stage the caller's batch, later the
        receive buffers the stage allocates per microbatch;
      - input gradients sent: 1F1B keeps one send in flight; GPipe keeps every send's work (and
        with it the gradient) until its backward loop ends;
      - but on the last stage, a receive buffer per microbatch for the output gradient, and, on
        1F1B with two or more microbatches in flight, the output of the warm-up's last fired
        send, whose work object stays referenced through the steady state;
    (The gradients accumulated from earlier microbatches are `InFlight.accumulated_bytes`.)
    Works on numbers and on numpy arrays alike (the DP calls it on vectors)."""
    m, k = microbatches, in_flight_count(schedule, stages, microbatches, s)
    last = s == stages - 1
    if s == 0:
        inputs = (m - 1) * received
    else:
        inputs = (m - 1) * received + (m - 1 if schedule == "GPipe" else 1) * received
    outputs = 0 if last else (m - 1) * sent + (sent if schedule != "GPipe" and k >= 2 else 0)
    return inputs + outputs + extra


def solve_stage(graph: Graph, budget: int, in_flight: InFlight, solver: str = "auto", *,
                time_limit: float = DEFAULT_TIME_LIMIT, on_progress: Callable[[str], None] | None = None,
                mip_solver: str | None = None) -> Solution:
    """The cheapest schedule of one microbatch's step whose memory on the device with
    ``in_flight`` (`InFlight.device_peak`) is within ``budget``. `solve` bounds the step's peak,
    not what it SAVEs, so: first at the budget less what the other microbatches would hold if
    nothing were SAVEd; if that plan's device memory is over, the step's lowest-peak schedule
    and the heuristics' schedules (`_candidates`) are checked, and the step budget is bisected
    between the cheapest fitting one's peak and the first (`STAGE_SOLVES` solves in all, sharing
    ``time_limit``); the cheapest plan that fits wins. Raises `InfeasibleBudgetError` naming the
    least device memory of those schedules."""
    t0 = time.perf_counter()
    k, ka = in_flight.microbatches, in_flight.accumulating
    held = in_flight.held_bytes
    high = budget - in_flight.fixed_bytes - max((k - 1) * held, (ka - 1) * held + in_flight.accumulated_bytes)

    def attempt(target: int, share: float) -> tuple[Solution | None, bool]:
        left = max(MIN_STAGE_SECONDS, share * (time_limit - (time.perf_counter() - t0)))
        sol = _solve_quietly(graph, target, solver, left, mip_solver, on_progress)
        return sol, sol is not None and in_flight.device_peak(graph, sol.schedule, sol.timeline) <= budget

    found, fits = attempt(high, 0.5)  # most often it fits: half the time for it
    if fits:
        return dataclasses.replace(found, solve_seconds=time.perf_counter() - t0)
    # The step's budget bounds its peak, not what it SAVEs. The heuristics' schedules (greedy's
    # whole curve of fewer SAVEd values) give a plan that fits, if one does; then the step budget
    # is bisected between its peak and the first one's.
    candidates = _candidates(graph, in_flight, solver)
    fitting = [sol for sol, device in candidates if device <= budget]
    if not fitting:
        raise InfeasibleBudgetError(budget, min(device for _, device in candidates),
                                    f"(A pipeline stage holding {k} microbatches.)")
    found = min(fitting, key=lambda sol: sol.timeline.cost)
    low = found.timeline.peak_bytes
    for tries_left in range(STAGE_SOLVES - 1, 0, -1):
        if high - low <= STAGE_TOLERANCE * budget:
            break
        target = (low + high) // 2
        sol, fits = attempt(target, 1 / tries_left)
        if fits:
            low = target
            if sol.timeline.cost < found.timeline.cost:
                found = sol
        else:
            high = target
    return dataclasses.replace(found, solve_seconds=time.perf_counter() - t0)


def _candidates(graph: Graph, in_flight: InFlight, solver: str) -> list[tuple[Solution, int]]:
    """Schedules to start a stage's search from, with their device memory: every heuristic's
    (greedy's whole curve of fewer SAVEd values among them), the chain solver's, and the lowest-
    peak schedule `min_feasible_budget` finds."""
    min_feasible_budget(graph, solver, time_limit=2.0)
    found = [(name, *c) for name in HEURISTICS for c in HEURISTICS[name](graph, 0)]
    found += [("chain", *c) for c in chain_candidates(graph, 0)]
    lowest = lowest_schedule(graph, solver)
    if lowest is not None:
        found.append((lowest.name, lowest.schedule, simulate(graph, lowest.schedule)))
    return [(Solution(schedule, timeline, name, "heuristic", 0.0), in_flight.device_peak(graph, schedule, timeline))
            for name, schedule, timeline in found if not timeline.over_host_budget]


def _solve_quietly(graph: Graph, budget: int, solver: str, time_limit: float, mip_solver, on_progress
                   ) -> Solution | None:
    """`solve`, None where nothing fits; each of `solve_stage`'s solves has a share of its time,
    so a solve that stops at its limit is expected, not warned about."""
    if budget <= 0:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SolverTimeoutWarning)
            return solve(graph, budget, solver, time_limit=time_limit, mip_solver=mip_solver, on_progress=on_progress)
    except InfeasibleBudgetError:
        return None


def stage_min_budget(graph: Graph, in_flight: InFlight, solver: str = "auto") -> int:
    """The least device memory with ``in_flight`` of the schedules `solve_stage` starts from."""
    return min(device for _, device in _candidates(graph, in_flight, solver))


# ---------------------------------------------------------------- cut points

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


# ---------------------------------------------------------------- stages of a split

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


# ---------------------------------------------------------------- atoms: the DP's units

@dataclasses.dataclass(frozen=True)
class Atom:
    """The forward between two consecutive cut points, with its backward: its costs, the bytes of
    the parameters it owns and their gradients, and its remat options ``(SAVEd bytes, transient
    bytes, recompute cost)``, cheapest first (see `atom_options`)."""

    forward_cost: float
    backward_cost: float
    param_bytes: int
    grad_bytes: int
    out_bytes: int  # what it sends on (the last atom: the loss)
    options: tuple[tuple[int, int, float], ...]


def _structure(graph: Graph) -> tuple:
    return tuple((n.kind, n.inputs, n.bytes, n.workspace, round(n.cost, 12), n.storage, n.recomputable, n.output,
                  n.tangent, n.tensor, n.codec, n.compressed_bytes, round(n.codec_cost, 12)) for n in graph.nodes)


def atom_of(graph: Graph, stage: list[int], s: int, solver: str = "auto", time_limit: float = 2.0) -> Atom:
    """Atom ``s`` of a split at every cut point (``stage`` from `assign_stages`)."""
    sub = stage_graph(graph, stage, s)
    sub_nodes = sub.nodes
    fwd = sum(n.cost for n in sub_nodes if n.kind == "forward")
    bwd = sum(n.cost for n in sub_nodes if n.kind == "backward")
    params = sum(n.bytes for k, n in enumerate(sub_nodes) if n.kind == "input" and not n.tangent
                 and graph.nodes[_original(graph, n.name)].kind == "input")
    crossing_in = sum(n.bytes for n in sub_nodes if n.kind == "input" and not n.tangent) - params
    grads = sum(n.bytes for i, n in enumerate(sub_nodes) if n.kind == "backward" and n.output and sub.roots[i] == i
                and graph.nodes[_original(graph, n.name)].output)
    out = sum(sub_nodes[r].bytes for r in {sub.roots[i] for i in sub.forward_outputs})
    fixed = params + crossing_in + grads + out
    options = atom_options(sub, fixed, solver, time_limit)
    return Atom(fwd, bwd, params, grads, out, options)


@functools.lru_cache(maxsize=None)
def _names(graph: Graph) -> dict[str, int]:
    return {n.name: i for i, n in enumerate(graph.nodes)}


def _original(graph: Graph, name: str) -> int:
    return _names(graph)[name]


_OPTIONS: dict[tuple, tuple] = {}


def atom_options(sub: Graph, fixed: int, solver: str = "auto", time_limit: float = 2.0) -> tuple:
    """An atom's remat options, one per `SAVED_LEVELS` share: the cheapest schedule found that
    SAVEs at most that share of what eager SAVEs (the one SAVEing least where none does), as
    (SAVEd bytes, transient bytes, recompute cost); transient is the peak beyond ``fixed``
    (parameters, gradients, what it receives and sends) and the SAVEd bytes. The schedules found:
    eager's, every heuristic's (greedy drops the cheapest values per byte one by one: a whole
    curve), the chain solver's and `solve`'s at `ATOM_LEVELS` of the way to its lowest peak.
    Cached by the atom's structure, so repeated blocks are solved once."""
    key = (_structure(sub), fixed, solver)
    if key in _OPTIONS:
        return _OPTIONS[key]
    timelines = [simulate(sub, eager_schedule(sub))]
    if sub.backward_nodes:
        for name in HEURISTICS:
            timelines.extend(t for _, t in HEURISTICS[name](sub, 0))
        timelines.extend(t for _, t in chain_candidates(sub, 0))
        low = min_feasible_budget(sub, solver, time_limit=time_limit)
        high = timelines[0].peak_bytes
        for share in ATOM_LEVELS:
            sol = _solve_quietly(sub, int(low + share * (high - low)), solver, time_limit, None, None)
            if sol is not None:
                timelines.append(sol.timeline)
    points = [(t.saved_bytes, max(0, t.peak_bytes - fixed - t.saved_bytes), t.cost) for t in timelines]
    eager = points[0][0]
    options = []
    for share in SAVED_LEVELS:
        within = [p for p in points if p[0] <= share * eager]
        options.append(min(within, key=lambda p: (p[2], p[1])) if within else min(points, key=lambda p: (p[0], p[2])))
    _OPTIONS[key] = tuple(options)
    return _OPTIONS[key]


# ---------------------------------------------------------------- the dynamic program

@dataclasses.dataclass(frozen=True)
class CutModel:
    """What the DP works on: the cut points, the atoms between them, and the pipeline.
    ``extra_fixed``: per stage, bytes its device holds that the graph does not show (the first
    stage: the other microbatches' inputs; the last: the loss when it runs outside the stage);
    ``last_held``: what the last stage holds per other microbatch in flight (its output) when
    that is not its last atom's output (a model whose loss runs outside it)."""

    points: tuple[CutPoint, ...]
    atoms: tuple[Atom, ...]
    stages: int
    microbatches: int
    schedule: str = "1F1B"
    extra_fixed: tuple[int, ...] = ()
    last_held: int | None = None
    origins: tuple | None = None  # see `assign_stages`

    def in_flight(self, s: int) -> int:
        return in_flight_count(self.schedule, self.stages, self.microbatches, s)


def cut_model(graph: Graph, stages: int, microbatches: int, schedule: str = "1F1B", *,
              allowed: Callable[[int], bool] | None = None, solver: str = "auto", time_limit: float = 2.0,
              extra_fixed: Sequence[int] = (), last_held: int | None = None, origins: Sequence | None = None
              ) -> CutModel:
    """The `CutModel` of a step's graph: its cut points (`choose_points`) and their atoms
    (`atom_of`; ``origins`` as for `assign_stages`). Raises `ValueError` when there are fewer
    than ``stages - 1`` cut points."""
    points = choose_points(graph, stages, allowed)
    if len(points) < stages - 1:
        raise ValueError(
            f"this step has {len(points)} place(s) to cut the forward at (where at most {MAX_CROSSING} tensors "
            f"cross and no parameter is read on both sides), so it cannot be split into {stages} stages; "
            f"ask for at most {len(points) + 1} stages" + _widest_input(graph))
    while True:
        stage, conflicts = assign_stages(graph, [p.position for p in points], origins)
        if not conflicts:
            break
        drop = {c for lo, hi in conflicts for c in range(lo, hi)}
        points = [p for c, p in enumerate(points) if c not in drop]
    if len(points) < stages - 1:
        raise ValueError(f"this step has {len(points)} place(s) to cut the forward at where every backward node "
                         f"finds what it reads, so it cannot be split into {stages} stages; ask for at most "
                         f"{len(points) + 1} stages")
    atoms = tuple(atom_of(graph, stage, s, solver, time_limit) for s in range(len(points) + 1))
    return CutModel(tuple(points), atoms, stages, microbatches, schedule, tuple(extra_fixed), last_held,
                    None if origins is None else tuple(origins))


def _widest_input(graph: Graph) -> str:
    """A note naming the parameter or input read across most of the forward, if one is."""
    order = forward_order(graph)
    spans = input_spans(graph, order)
    if not spans or not order:
        return ""
    r, (a, b) = max(spans.items(), key=lambda kv: kv[1][1] - kv[1][0])
    if b - a < len(order) // 2:
        return ""
    return (f". {graph.nodes[r].name} is read from forward position {a} to {b} of {len(order)} (a weight "
            "tied between the first and the last layers?): untie it, or keep its users in one stage")


@dataclasses.dataclass(frozen=True)
class StageEstimate:
    """The DP's model of one stage: atoms ``first`` to ``last`` (inclusive), its remat level, its
    time (forward, backward, recompute cost) and its memory on the device."""

    first: int
    last: int
    level: int
    forward_seconds: float
    backward_seconds: float
    recompute_seconds: float
    device_bytes: int

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds + self.recompute_seconds


@dataclasses.dataclass(frozen=True)
class Split:
    """Where the DP cut: indices into ``CutModel.points``, and its model of each stage."""

    cuts: tuple[int, ...]
    estimates: tuple[StageEstimate, ...]

    @property
    def slowest_seconds(self) -> float:
        return max(e.seconds for e in self.estimates)


class _Arrays:
    """The atoms' figures as prefix sums (numpy), one row per remat level."""

    def __init__(self, model: CutModel):
        atoms = model.atoms
        levels = max(len(a.options) for a in atoms)
        opt = [[a.options[min(lv, len(a.options) - 1)] for a in atoms] for lv in range(levels)]

        def cum(values) -> np.ndarray:
            return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float), axis=-1)], axis=-1) \
                if np.ndim(values) == 1 else np.concatenate([np.zeros((len(values), 1)), np.cumsum(values, axis=1)], axis=1)

        self.levels = levels
        self.fwd = cum([a.forward_cost for a in atoms])
        self.bwd = cum([a.backward_cost for a in atoms])
        self.params = cum([a.param_bytes + a.grad_bytes for a in atoms])
        self.grads = cum([a.grad_bytes for a in atoms])
        self.link = np.asarray([p.bytes for p in model.points] + [atoms[-1].out_bytes], dtype=float)
        self.cum_link = cum([p.saved_bytes for p in model.points] + [0])
        self.saved = cum(np.asarray([[o[0] for o in row] for row in opt], dtype=float))
        self.cost = cum(np.asarray([[o[2] for o in row] for row in opt], dtype=float))
        self.trans = np.asarray([[o[1] for o in row] for row in opt], dtype=float)


def _segments(model: CutModel, arr: _Arrays, s: int, j: int, i: np.ndarray):
    """For stage ``s`` covering atoms i..j-1 (a vector of i): per remat level (rows), the time
    (forward, backward, recompute) and the device memory, and the three times separately."""
    count, m = len(model.atoms), model.microbatches
    k = model.in_flight(s)
    inb = np.where(i > 0, arr.link[np.maximum(i - 1, 0)], 0.0)
    outb = arr.link[j - 1]
    extra = model.extra_fixed[s] if s < len(model.extra_fixed) else 0
    held = outb if j < count or model.last_held is None else float(model.last_held)
    inner = arr.cum_link[j - 1] - arr.cum_link[i]
    fixed = arr.params[j] - arr.params[i] + inb + outb
    saved = arr.saved[:, j][:, None] - arr.saved[:, i] + inner
    trans = np.maximum.accumulate(arr.trans[:, i[0]:j][:, ::-1], axis=1)[:, ::-1][:, i - i[0]]
    buffers = runtime_fixed(model.schedule, model.stages, m, s, inb, outb, extra)
    ka = accumulation(model.schedule, model.stages, m, s)
    others = np.maximum((k - 1) * (saved + held), (ka - 1) * (saved + held) + (ka > 0) * (arr.grads[j] - arr.grads[i]))
    device = fixed + saved + trans + others + buffers
    recompute = arr.cost[:, j][:, None] - arr.cost[:, i]
    fwd, bwd = arr.fwd[j] - arr.fwd[i], arr.bwd[j] - arr.bwd[i]
    return fwd + bwd + recompute, device, fwd, bwd, recompute


def best_split(model: CutModel, budget: int, margins: Sequence[int] = ()) -> Split | None:
    """The split minimizing the slowest stage's time, then the largest share of the budget a
    stage needs, with every stage's modelled memory within ``budget`` less its margin; None if
    none fits."""
    return _dp(model, lambda s, times, device: _fit(times, device, budget - (margins[s] if s < len(margins) else 0),
                                                    budget))


def min_peak_split(model: CutModel) -> Split:
    """The split whose largest modelled stage memory is lowest (each stage at its lowest level)."""
    def lowest(s, times, device):
        level = np.argmin(device, axis=0)
        cols = np.arange(device.shape[1])
        return device[level, cols].astype(float), times[level, cols], level
    return _dp(model, lowest)


def _fit(times: np.ndarray, device: np.ndarray, limit: float, budget: int):
    """Per segment: (its objective: time, then memory share; its level) at the first level
    within ``limit``; inf where none is."""
    ok = device <= limit
    level = np.argmax(ok, axis=0)
    cols = np.arange(device.shape[1])
    feasible = ok[level, cols]
    return (np.where(feasible, times[level, cols], np.inf), np.where(feasible, device[level, cols] / budget, np.inf),
            level)


def _dp(model: CutModel, score) -> Split | None:
    """The min-max dynamic program over cut points. ``score(s, times, device)`` turns a stage's
    per-level times and memory (rows: levels, columns: segments) into (primary, secondary,
    level) per segment; a split's value is the largest primary over its stages, then the largest
    secondary."""
    arr, count, stages = _Arrays(model), len(model.atoms), model.stages
    best = [np.full((count + 1, 2), np.inf) for _ in range(stages)]
    arg = [np.zeros(count + 1, dtype=int) for _ in range(stages)]
    lev = [np.zeros(count + 1, dtype=int) for _ in range(stages)]
    for s in range(stages):
        for j in range(s + 1, count - (stages - 1 - s) + 1):
            if s == stages - 1 and j != count:
                continue
            i = np.arange(0, 1) if s == 0 else np.arange(s, j)
            times, device, *_ = _segments(model, arr, s, j, i)
            primary, secondary, level = score(s, times, device)
            if s:
                primary = np.maximum(primary, best[s - 1][i, 0])
                secondary = np.maximum(secondary, best[s - 1][i, 1])
            pick = int(np.lexsort((secondary, primary))[0])
            if np.isfinite(primary[pick]):
                best[s][j] = (primary[pick], secondary[pick])
                arg[s][j], lev[s][j] = int(i[pick]), int(level[pick])
    if not np.isfinite(best[stages - 1][count, 0]):
        return None
    bounds, j = [], count
    for s in range(stages - 1, -1, -1):
        bounds.append((int(arg[s][j]), j, int(lev[s][j])))
        j = int(arg[s][j])
    bounds.reverse()
    return _split(model, arr, bounds)


def _split(model: CutModel, arr: _Arrays, bounds) -> Split:
    estimates = []
    for s, (i, j, level) in enumerate(bounds):
        _, device, fwd, bwd, recompute = _segments(model, arr, s, j, np.asarray([i]))
        estimates.append(StageEstimate(i, j - 1, level, float(fwd[0]), float(bwd[0]), float(recompute[level, 0]),
                                       int(device[level, 0])))
    return Split(tuple(j - 1 for _, j, _ in bounds[:-1]), tuple(estimates))


def split_at(model: CutModel, cuts: Sequence[int], budget: int | None = None) -> Split:
    """The DP's model of a given split (``cuts``: indices into the points), each stage at its
    first level within ``budget`` (its lowest level without one, or if none fits)."""
    arr = _Arrays(model)
    bounds, i = [], 0
    for s, j in enumerate([c + 1 for c in cuts] + [len(model.atoms)]):
        _, device, *_ = _segments(model, arr, s, j, np.asarray([i]))
        fits = np.flatnonzero(device[:, 0] <= budget) if budget is not None else []
        bounds.append((i, j, int(fits[0]) if len(fits) else int(np.argmin(device[:, 0]))))
        i = j
    return _split(model, arr, bounds)


def balanced_cuts(weights: Sequence[float], stages: int) -> tuple[int, ...]:
    """Cuts (after atom index) splitting ``weights`` (per atom) into ``stages`` contiguous runs
    with the largest run's sum lowest: DeepSpeed's ``partition_method="parameters"`` on
    parameter bytes, or equal layers on a count per layer."""
    count = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((stages, count + 1), np.inf)
    arg = np.zeros((stages, count + 1), dtype=int)
    best[0, 1:] = prefix[1:]
    for s in range(1, stages):
        for j in range(s + 1, count + 1):
            i = np.arange(s, j)
            value = np.maximum(best[s - 1, i], prefix[j] - prefix[i])
            pick = int(np.argmin(value))
            best[s, j], arg[s, j] = value[pick], i[pick]
    cuts, j = [], count
    for s in range(stages - 1, 0, -1):
        j = int(arg[s, j])
        cuts.append(j - 1)
    return tuple(reversed(cuts))


# ---------------------------------------------------------------- the schedule's timing

@dataclasses.dataclass(frozen=True)
class Timing:
    """A pipeline step as the schedule runs it: its length and the share of device time idle."""

    step_seconds: float
    bubble: float


def schedule_order(schedule: str, stages: int, microbatches: int, s: int) -> list[tuple[str, int]]:
    """The order stage ``s`` runs its forwards ("F", microbatch) and backwards ("B", microbatch)
    in, as torch's `ScheduleGPipe` and `Schedule1F1B` do."""
    m = microbatches
    if schedule == "GPipe":
        return [("F", b) for b in range(m)] + [("B", b) for b in range(m)]
    warmup = in_flight_count(schedule, stages, microbatches, s)
    order = [("F", b) for b in range(warmup)]
    for b in range(m):
        order.append(("B", b))
        if warmup + b < m:
            order.append(("F", warmup + b))
    return order


def pipeline_timing(forward: Sequence[float], backward: Sequence[float], microbatches: int,
                    schedule: str = "1F1B") -> Timing:
    """The schedule replayed with each stage's forward and backward seconds per microbatch
    (`replay`): the step's length and the share of device time idle."""
    actions = replay(forward, backward, microbatches, schedule)
    step = max((a[4] for a in actions), default=0.0)
    busy = microbatches * (sum(forward) + sum(backward))
    return Timing(step, 1.0 - busy / (len(forward) * step) if step > 0 else 0.0)


def replay(forward: Sequence[float], backward: Sequence[float], microbatches: int, schedule: str = "1F1B"
           ) -> list[tuple[int, str, int, float, float]]:
    """Every action of the schedule as (stage, "F" or "B", microbatch, start, end): an action
    starts when its stage is free and its input is there (a forward: the previous stage's
    forward of that microbatch; a backward: the next stage's backward, or on the last stage its
    own forward). Communication takes no time."""
    stages = len(forward)
    orders = [schedule_order(schedule, stages, microbatches, s) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free, nxt, out = [0.0] * stages, [0] * stages, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for s in range(stages):
            while nxt[s] < len(orders[s]):
                kind, b = orders[s][nxt[s]]
                dep = (("F", s - 1, b) if s else None) if kind == "F" else \
                    (("B", s + 1, b) if s < stages - 1 else ("F", s, b))
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = done[(kind, s, b)] = start + (forward[s] if kind == "F" else backward[s])
                out.append((s, kind, b, start, free[s]))
                nxt[s] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise AssertionError("the schedule's orders deadlock")
    return out


# ---------------------------------------------------------------- from the DP to exact plans

@dataclasses.dataclass(frozen=True)
class StageResult:
    """A stage planned exactly: its solution, its memory on the device (`InFlight.device_peak`)
    and its time per microbatch (forward; backward, its recomputation aside)."""

    solution: Solution
    device_bytes: int
    in_flight: InFlight
    forward_seconds: float
    backward_seconds: float

    @property
    def recompute_seconds(self) -> float:
        return self.solution.timeline.cost


def cut_and_plan(model: CutModel, budget: int, plan_stage: Callable[[int, Split, int], StageResult], *,
                 rounds: int = FEEDBACK_ROUNDS) -> tuple[Split, list[StageResult]]:
    """The DP's split, each stage planned exactly by ``plan_stage(s, split, budget)`` (which
    raises `InfeasibleBudgetError` naming the stage's smallest device budget when it does not
    fit); a stage over the budget raises its margin in the DP by the excess, and the DP runs
    again. If no round fits, the split with the lowest modelled memory is planned. Raises
    `InfeasibleBudgetError` with the smallest device budget that split needs, planned exactly."""
    margins = [0] * model.stages
    for _ in range(rounds):
        split = best_split(model, budget, margins)
        if split is None:
            break
        results, over = [], False
        for s in range(model.stages):
            try:
                results.append(_within(plan_stage(s, split, budget), budget))
            except InfeasibleBudgetError as err:
                # The model was short by at least what the exact plan is over.
                margins[s] += max(1, err.min_budget - budget) + max(0, budget - split.estimates[s].device_bytes)
                over = True
        if not over:
            return split, results
    split = min_peak_split(model)
    try:
        return split, [_within(plan_stage(s, split, budget), budget) for s in range(model.stages)]
    except InfeasibleBudgetError:
        pass
    need = 0
    for s in range(model.stages):
        try:
            need = max(need, plan_stage(s, split, 1).device_bytes)
        except InfeasibleBudgetError as err:
            need = max(need, err.min_budget)
    raise InfeasibleBudgetError(budget, need, f"(Split into {model.stages} pipeline stages, {model.microbatches} "
                                f"microbatches, {model.schedule}; the budget is per device.)")


def _within(result: StageResult, budget: int) -> StageResult:
    """A stage's result, refused if its device memory is over the budget (never used over it)."""
    if result.device_bytes > budget:
        raise InfeasibleBudgetError(budget, result.device_bytes)
    return result


def plan_split(model: CutModel, split: Split, budget: int, plan_stage: Callable[[int, Split, int], StageResult]
               ) -> list[StageResult]:
    """A given split's stages planned exactly (as for `cut_and_plan`); raises
    `InfeasibleBudgetError` with the largest smallest budget of the stages that do not fit."""
    results, need = [], 0
    for s in range(model.stages):
        try:
            results.append(_within(plan_stage(s, split, budget), budget))
        except InfeasibleBudgetError as err:
            need = max(need, err.min_budget)
    if need:
        raise InfeasibleBudgetError(budget, need, f"(These {model.stages} pipeline stages, {model.microbatches} "
                                    f"microbatches, {model.schedule}; the budget is per device.)")
    return results


def graph_in_flight(model: CutModel, graph: Graph, sub: Graph, s: int) -> InFlight:
    """What stage ``s`` (its graph ``sub``, part of ``graph``) holds beside one microbatch: the
    other in-flight microbatches' SAVEd values and outputs, what torch's runtime holds
    (`runtime_fixed`), and ``extra_fixed``."""
    m = model.microbatches
    received = sum(n.bytes for n in sub.nodes if n.kind == "input" and not n.tangent
                   and graph.nodes[_original(graph, n.name)].kind == "forward")
    sent = sum(sub.nodes[r].bytes for r in {sub.roots[i] for i in sub.forward_outputs})
    last = s == model.stages - 1
    held = model.last_held if last and model.last_held is not None else sent
    extra = model.extra_fixed[s] if s < len(model.extra_fixed) else 0
    grads = sum(n.bytes for n in sub.nodes if n.kind == "backward" and n.output
                and graph.nodes[_original(graph, n.name)].output)
    fixed = runtime_fixed(model.schedule, model.stages, m, s, received, sent, extra)
    return InFlight(model.in_flight(s), held, fixed, grads, accumulation(model.schedule, model.stages, m, s))


def plan_split_graph(graph: Graph, model: CutModel, budget: int, split: Split, s: int, *, solver: str = "auto",
                     time_limit: float = DEFAULT_TIME_LIMIT) -> StageResult:
    """Stage ``s`` of ``split`` planned by `solve_stage` on its part of ``graph`` (the simulated
    pipeline: no stage module is captured)."""
    stage, _ = assign_stages(graph, [model.points[c].position for c in split.cuts], model.origins)
    sub = stage_graph(graph, stage, s)
    in_flight = graph_in_flight(model, graph, sub, s)
    sol = solve_stage(sub, budget, in_flight, solver, time_limit=time_limit)
    return stage_result(sub, sol, in_flight)


def stage_result(sub: Graph, sol: Solution, in_flight: InFlight) -> StageResult:
    fwd = sum(sub.nodes[i].cost for i in sub.forward_required)
    bwd = sum(sub.nodes[i].cost for i in sub.backward_nodes)
    return StageResult(sol, in_flight.device_peak(sub, sol.schedule, sol.timeline), in_flight, fwd, bwd)


def plan_simulated(graph: Graph, stages: int, microbatches: int, budget: int, *, schedule: str = "1F1B",
                   solver: str = "auto", time_limit: float = DEFAULT_TIME_LIMIT,
                   cuts: Sequence[int] | None = None) -> tuple[CutModel, Split, list[StageResult], Timing]:
    """Cuts and exact stage plans for ``graph`` without processes or capture, each stage planned on
    its part of the graph; ``cuts`` (indices into the cut points): plan this split instead of the
    DP's. Returns the model, the split, the stages' results and the predicted timing."""
    model = cut_model(graph, stages, microbatches, schedule, solver=solver, time_limit=min(2.0, time_limit))

    def plan_stage(s: int, split: Split, budget: int) -> StageResult:
        return plan_split_graph(graph, model, budget, split, s, solver=solver, time_limit=time_limit)

    if cuts is not None:
        split = split_at(model, cuts, budget)
        results = plan_split(model, split, budget, plan_stage)
    else:
        split, results = cut_and_plan(model, budget, plan_stage)
    return model, split, results, timing_of(results, microbatches, schedule)


def timing_of(results: Sequence[StageResult], microbatches: int, schedule: str) -> Timing:
    """`pipeline_timing` with each stage's planned forward and backward (its recomputation in it)."""
    return pipeline_timing([r.forward_seconds for r in results],
                           [r.backward_seconds + r.recompute_seconds for r in results], microbatches, schedule)
