"""The dynamic program that cuts a pipeline: stage boundaries at cut points.

`best_split` minimizes the slowest stage's time (its forward and backward cost plus its recompute
cost) subject to every stage's modelled memory fitting the budget, then the largest memory per
budget. It is exact over the cut points for the model (`CutModel`: the atoms' options composed,
`fxopt.solvers.stages.atoms`); the model is the approximation: plans across atom boundaries
(recomputing two atoms from the first's input) are not offered to it, and the atoms' own peaks
are composed, not simulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from fxopt.solvers.effort import Deadline, Effort, effort_of
from fxopt.solvers.graph import Graph
from fxopt.solvers.stages.atoms import Atom, atom_of
from fxopt.solvers.stages.cuts import MAX_CROSSING, CutPoint, assign_stages, choose_points, forward_order, input_spans
from fxopt.solvers.stages.in_flight import SolveStops, accumulation, in_flight_count, runtime_fixed


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
              allowed: Callable[[int], bool] | None = None, solver: str = "auto",
              effort: Effort | float | None = None, time_limit: Deadline | float | None = None,
              extra_fixed: Sequence[int] = (), last_held: int | None = None, origins: Sequence | None = None
              ) -> CutModel:
    """The `CutModel` of a step's graph: its cut points (`choose_points`) and their atoms
    (`atom_of`, each distinct one planned with ``effort``, each of its solves with ``time_limit``,
    its own safety stop, `SolveStops`; said once if one stopped; ``origins`` as for `assign_stages`). Raises `ValueError` when there are fewer than
    ``stages - 1`` cut points."""
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
    effort, stops, known = effort_of(effort), SolveStops(time_limit), {}
    atoms = tuple(atom_of(graph, stage, s, solver, effort, stops, known) for s in range(len(points) + 1))
    stops.warn("the cut solver's model of a stage")
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
