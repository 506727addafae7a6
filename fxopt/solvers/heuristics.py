"""Heuristic solvers: each turns (graph, budget) into a SAVE set; `on_demand` builds the backward.

- ``save_all``: keep what eager autograd keeps. No recompute.
- ``checkpoint``: Chen et al.'s segment checkpointing. Walk the forward in order and keep one value
  every ``segment`` bytes; everything between checkpoints is recomputed, one segment at a time.
  Tries several segment sizes (the classic choice is sqrt of the total) and returns the cheapest
  schedule within the budget.
- ``greedy``: start from ``save_all`` and stop saving the values whose recomputation is cheapest
  per byte, until the simulated peak fits.
"""

from __future__ import annotations

import math

from fxopt.solvers.graph import Graph
from fxopt.solvers.schedule import Schedule, Timeline, must_save, on_demand, save_all_set, simulate

Candidate = tuple[Schedule, Timeline]


def save_all(graph: Graph, budget: int) -> list[Candidate]:
    schedule = on_demand(graph, save_all_set(graph))
    return [(schedule, simulate(graph, schedule))]


def _recomputable_saves(graph: Graph) -> list[int]:
    """Forward values worth deciding on: computed in the forward, needed by the backward, not free."""
    return sorted((graph.needed_by_backward & graph.saveable) - graph.free - must_save(graph))


def checkpoint(graph: Graph, budget: int) -> list[Candidate]:
    order = [i for i in _recomputable_saves(graph) if i in graph.forward_required and graph.roots[i] == i]
    total = sum(graph.nodes[i].bytes for i in order)
    if not order or total == 0:
        return save_all(graph, budget)
    base = must_save(graph)
    out: list[Candidate] = save_all(graph, budget)  # no checkpoint at all is a segment size too
    seen: set[frozenset[int]] = set()
    largest = max(graph.nodes[i].bytes for i in order)
    segment = float(total)
    while segment >= largest / 4:
        saved, acc = set(base), 0
        for i in order:
            acc += graph.nodes[i].bytes
            if acc >= segment:
                saved.add(i)
                acc = 0
        key = frozenset(saved)
        if key not in seen:
            seen.add(key)
            schedule = on_demand(graph, saved)
            out.append((schedule, simulate(graph, schedule)))
        segment /= math.sqrt(2)
    return out


def greedy(graph: Graph, budget: int) -> list[Candidate]:
    saved = set(save_all_set(graph))
    schedule = on_demand(graph, saved)
    out = [(schedule, simulate(graph, schedule))]
    if out[0][1].peak_bytes <= budget:
        return out
    # Values the backward derives itself (backward-only) are recomputed from the forward values
    # they depend on; include those so the greedy can drop them too.
    candidates = [i for i in _recomputable_saves(graph) if graph.roots[i] == i and graph.nodes[i].bytes > 0]
    candidates.sort(key=lambda i: (graph.nodes[i].cost / graph.nodes[i].bytes, i))
    for i in candidates:
        if i not in saved:
            continue
        saved.discard(i)
        schedule = on_demand(graph, saved)
        timeline = simulate(graph, schedule)
        out.append((schedule, timeline))
        if timeline.peak_bytes <= budget:
            break
    return out


HEURISTICS = {"save_all": save_all, "checkpoint": checkpoint, "greedy": greedy}
