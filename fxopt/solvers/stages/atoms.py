"""Atoms: the units of the cut DP, each with its remat options.

Inside the DP a stage's plan is not solved. The forward between consecutive cut points is an
*atom*; each atom's solver graph is planned once per structure (repeated blocks share it) by the
heuristics and by `solve` at a few budgets (`atom_options`), which gives it, for each share of
what eager SAVEs (`SAVED_LEVELS`), the cheapest schedule found that SAVEs at most that, as (SAVEd
bytes, transient bytes, recompute cost). A stage at remat level λ takes option λ of each atom.
"""

from __future__ import annotations

import dataclasses

from fxopt.solvers.auto import eager_schedule
from fxopt.solvers.chain import chain_candidates
from fxopt.solvers.effort import Effort
from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import HEURISTICS
from fxopt.solvers.minimum import Memo, lowest_plan
from fxopt.solvers.schedule import simulate
from fxopt.solvers.stages.cuts import stage_graph
from fxopt.solvers.stages.in_flight import SolveStops, _solve_quietly

# The shares of the way from an atom's eager peak to its lowest peak at which it is solved, and
# the remat levels of the DP: shares of what eager SAVEs (see `atom_options`).
ATOM_LEVELS = (2 / 3, 1 / 3, 0.0)
SAVED_LEVELS = (1.0, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.1, 0.0)


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


def atom_of(graph: Graph, stage: list[int], s: int, solver: str, effort: Effort, stops: SolveStops,
            known: dict | None = None) -> Atom:
    """Atom ``s`` of a split at every cut point (``stage`` from `assign_stages`); ``stops``: each
    of its solves' safety stop; ``known``: the options of the atoms planned so far, by structure
    (`atom_options`)."""
    sub = stage_graph(graph, stage, s)
    sub_nodes, index = sub.nodes, {n.name: i for i, n in enumerate(graph.nodes)}
    fwd = sum(n.cost for n in sub_nodes if n.kind == "forward")
    bwd = sum(n.cost for n in sub_nodes if n.kind == "backward")
    params = sum(n.bytes for n in sub_nodes if n.kind == "input" and not n.tangent
                 and graph.nodes[index[n.name]].kind == "input")
    crossing_in = sum(n.bytes for n in sub_nodes if n.kind == "input" and not n.tangent) - params
    grads = sum(n.bytes for i, n in enumerate(sub_nodes) if n.kind == "backward" and n.output and sub.roots[i] == i
                and graph.nodes[index[n.name]].output)
    out = sum(sub_nodes[r].bytes for r in {sub.roots[i] for i in sub.forward_outputs})
    fixed = params + crossing_in + grads + out
    options = atom_options(sub, fixed, solver, effort, stops, known)
    return Atom(fwd, bwd, params, grads, out, options)


def atom_options(sub: Graph, fixed: int, solver: str, effort: Effort, stops: SolveStops,
                 known: dict | None = None) -> tuple:
    """An atom's remat options, one per `SAVED_LEVELS` share: the cheapest schedule found that
    SAVEs at most that share of what eager SAVEs (the one SAVEing least where none does), as
    (SAVEd bytes, transient bytes, recompute cost); transient is the peak beyond ``fixed``
    (parameters, gradients, what it receives and sends) and the SAVEd bytes. The schedules found:
    eager's, every heuristic's (greedy drops the cheapest values per byte one by one: a whole
    curve), the chain solver's and `solve`'s at `ATOM_LEVELS` of the way to its lowest peak (each
    solve with the next of ``stops``, its safety stop). Kept in ``known`` by the atom's structure,
    so that a model's repeated blocks are solved once."""
    key = (_structure(sub), fixed, solver)
    if known is not None and key in known:
        return known[key]
    timelines = [simulate(sub, eager_schedule(sub))]
    if sub.backward_nodes:
        for name in HEURISTICS:
            timelines.extend(t for _, t in HEURISTICS[name](sub, 0, effort=effort))
        timelines.extend(t for _, t in chain_candidates(sub, 0))
        memo = Memo()
        low = lowest_plan(sub, solver, effort=effort, time_limit=stops.next(), memo=memo).peak
        high = timelines[0].peak_bytes
        for share in ATOM_LEVELS:
            sol = _solve_quietly(sub, int(low + share * (high - low)), solver, effort, stops, None, None, memo)
            if sol is not None:
                timelines.append(sol.timeline)
    points = [(t.saved_bytes, max(0, t.peak_bytes - fixed - t.saved_bytes), t.cost) for t in timelines]
    eager = points[0][0]
    options = []
    for share in SAVED_LEVELS:
        within = [p for p in points if p[0] <= share * eager]
        options.append(min(within, key=lambda p: (p[2], p[1])) if within else min(points, key=lambda p: (p[0], p[2])))
    if known is not None:
        known[key] = tuple(options)
    return tuple(options)
