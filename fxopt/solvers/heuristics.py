"""Heuristic solvers: each turns (graph, budget) into a SAVE set; `on_demand` builds the backward.

- ``save_all``: keep what eager autograd keeps. No recompute.
- ``checkpoint``: Chen et al.'s segment checkpointing. Walk the forward in order and keep one value
  every ``segment`` bytes; everything between checkpoints is recomputed, one segment at a time.
  Tries several segment sizes (the classic choice is sqrt of the total) and returns the cheapest
  schedule within the budget.
- ``greedy``: start from ``save_all`` and stop saving the values whose recomputation is cheapest
  per byte, until the simulated peak fits.
- ``segments``: checkpoint at the forward's articulation values (a value every later value depends
  on only through it: a transformer layer's or residual block's output), so each segment is
  recomputed only for its own backward; then also SAVE the values whose recomputation costs most
  per byte, as many as fit. For deep models this reaches low budgets at a fraction of the
  recomputation the others need (recomputing one layer, not everything up to it).

`compress_to_fit` completes any of these with COMPRESS: a schedule over the budget keeps the values
that cost least to encode and decode per byte saved compressed, as many as it takes to fit.
`offload_to_fit` completes them with OFFLOAD (on a graph with transfers): the values whose copies
hide best behind compute, as many as it takes to fit.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from fxopt.solvers.effort import DEFAULT_EFFORT, Effort, simulation_weight
from fxopt.solvers.graph import Graph
from fxopt.solvers.schedule import (InvalidScheduleError, Schedule, Timeline, as_generated, backward_steps,
                                    forward_set, must_save, on_demand, prune, save_all_set, simulate, simulated, to_recompute,
                                    with_fresh_aliases)
from fxopt.solvers.transfers import INSTANT

Candidate = tuple[Schedule, Timeline]


def save_all(graph: Graph, budget: int, *, effort: Effort = DEFAULT_EFFORT, memo=None) -> list[Candidate]:
    """Eager's schedule, simulated (kept in ``memo``, `fxopt.solvers.minimum.Memo.timeline`, where
    one is given: the blocks' plans and their bound start from it too)."""
    schedule = on_demand(graph, save_all_set(graph))
    return [(schedule, simulated(graph, schedule, memo))]


def _recomputable_saves(graph: Graph) -> list[int]:
    """Forward values worth deciding on: computed in the forward, needed by the backward, not free."""
    return sorted((graph.needed_by_backward & graph.saveable) - graph.free - must_save(graph))


def checkpoint(graph: Graph, budget: int, *, effort: Effort = DEFAULT_EFFORT) -> list[Candidate]:
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


def greedy(graph: Graph, budget: int, *, effort: Effort = DEFAULT_EFFORT) -> list[Candidate]:
    """Drop SAVEd values one at a time, the cheapest to recompute per byte first, until the
    simulated peak fits; after the effort's `greedy_steps` drops (fewer on a graph whose
    simulations weigh more, `simulation_weight`), the shortest longer run of drops that fits is
    bisected instead (the peak falls as values are dropped, mostly), so that a deep model costs a
    few dozen simulations, not one per value. Every schedule tried is returned; the last ones drop
    everything (the lowest peak) where nothing fits."""
    saved = set(save_all_set(graph))
    out: list[Candidate] = []

    def run(drop) -> bool:
        schedule = on_demand(graph, saved - set(drop))
        out.append((schedule, simulate(graph, schedule)))
        return out[-1][1].peak_bytes <= budget

    if run(()):
        return out
    # Values the backward derives itself (backward-only) are recomputed from the forward values
    # they depend on; include those so the greedy can drop them too.
    candidates = [i for i in _recomputable_saves(graph) if graph.roots[i] == i and graph.nodes[i].bytes > 0
                  and i in saved]
    candidates.sort(key=lambda i: (graph.nodes[i].cost / graph.nodes[i].bytes, i))
    steps = max(1, int(effort.greedy_steps / simulation_weight(graph)))
    for k in range(1, min(steps, len(candidates)) + 1):
        if run(candidates[:k]):
            return out
    lo, hi = steps, len(candidates)  # dropping ``lo`` does not fit; ``hi``, perhaps
    if hi <= lo or not run(candidates):
        return out
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(candidates[:mid]):
            hi = mid
        else:
            lo = mid
    return out


def articulation_values(graph: Graph) -> list[int]:
    """Forward values that cut the forward in two: no value computed before one is read after it
    except through it (parameters and inputs aside). In forward order."""
    order = sorted(graph.forward_required - graph.resident)
    pos = {i: k for k, i in enumerate(order)}
    cover = [0] * (len(order) + 1)
    for w in order:
        for u in graph.nodes[w].inputs:
            if u in pos and pos[w] - pos[u] > 1:
                cover[pos[u] + 1] += 1
                cover[pos[w]] -= 1
    # Backward-only values (computed in the backward from forward values) also read across.
    for b in sorted(graph.backward_only):
        ins = [pos[u] for u in graph.nodes[b].inputs if u in pos]
        if len(ins) > 1:
            cover[min(ins) + 1] += 1
            cover[max(ins)] -= 1
    cuts, depth = [], 0
    for k, i in enumerate(order):
        depth += cover[k]
        if depth == 0:
            cuts.append(i)
    return cuts


def checkpoint_cuts(graph: Graph) -> list[int]:
    """The articulation values worth checkpointing at: values a schedule may SAVE or recompute,
    owning storage, not forward outputs. In forward order (`segments` and the chain solver)."""
    nodes = graph.nodes
    decidable = set(_recomputable_saves(graph))
    return [i for i in articulation_values(graph)
            if i in decidable and graph.roots[i] == i and nodes[i].bytes > 0 and not nodes[i].output]


def segments(graph: Graph, budget: int, *, effort: Effort = DEFAULT_EFFORT) -> list[Candidate]:
    nodes = graph.nodes
    decidable = set(_recomputable_saves(graph))
    cuts = checkpoint_cuts(graph)
    out: list[Candidate] = save_all(graph, budget)  # no checkpoint at all is a choice too
    if not cuts:
        return out
    must = must_save(graph)

    def run(saved) -> Candidate:
        schedule = on_demand(graph, saved)
        candidate = (schedule, simulate(graph, schedule))
        out.append(candidate)
        return candidate

    # Every k-th cut, for k = 1, 2, 3, ...: fewer checkpoints for lower budgets.
    bases = []
    for k in range(1, min(len(cuts), 8) + 1):
        base = must | set(cuts[k - 1::k])
        if run(base)[1].peak_bytes <= budget:
            bases.append(base)
    for base in bases[:2]:
        extra = sorted((i for i in decidable - base if graph.roots[i] == i and nodes[i].bytes > 0),
                       key=lambda i: (-nodes[i].cost / nodes[i].bytes, i))
        # The longest prefix of `extra` (most recomputation saved per byte first) that fits.
        lo, hi = 0, len(extra)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if run(base | set(extra[:mid]))[1].peak_bytes <= budget:
                lo = mid
            else:
                hi = mid - 1
        # Then the values after it that still fit, one at a time (a few dozen at most).
        saved = set(base | set(extra[:lo]))
        for i in extra[lo + 1: lo + 41]:
            if run(saved | {i})[1].peak_bytes <= budget:
                saved.add(i)
    return out


def save_more(graph: Graph, schedule: Schedule, budget: int, *,
              tries: int = DEFAULT_EFFORT.save_more_tries) -> Candidate | None:
    """`schedule` with values it recomputes SAVEd instead, while its simulated peak stays within
    ``budget`` and its cost falls: the values whose recomputation costs most per byte first, each
    tried once (its first recomputation dropped, then all of them), ``tries`` schedules simulated
    at most, each weighted by the graph's size (`simulation_weight`). None if nothing more fits.
    (A lowest-peak plan recomputes what it need not where memory is not tight.)"""
    nodes, weight = graph.nodes, simulation_weight(graph)
    best = (schedule, simulate(graph, schedule))
    recomputed = {i for i in schedule.recomputed(graph) if i in graph.saveable and graph.roots[i] == i
                  and nodes[i].bytes > 0 and nodes[i].cost > 0}
    for v in sorted(recomputed, key=lambda i: (-nodes[i].cost / nodes[i].bytes, i)):
        for first_only in (True, False):
            if tries <= 0:
                return best if best[0] is not schedule else None
            current = best[0]
            at = [e for e, i in enumerate(current.backward) if i == v]
            if not at:
                break
            tries -= weight
            found = _cheaper_within(graph, current, budget, best[1].cost, saved=current.saved | {v},
                                    backward=_without_steps(current, at[:1] if first_only else at))
            if found is not None:
                best = found
                break
    return best if best[0] is not schedule else None


def _without_steps(schedule: Schedule, steps) -> tuple[int, ...]:
    """``schedule``'s backward without the steps at positions ``steps``."""
    drop = set(steps)
    return tuple(i for e, i in enumerate(schedule.backward) if e not in drop)


def _cheaper_within(graph: Graph, schedule: Schedule, budget: int, cost: float, **changes) -> Candidate | None:
    """``schedule`` with ``changes`` (its fields, `dataclasses.replace`), pruned and simulated,
    where that is a valid schedule within ``budget`` and host memory that costs less than
    ``cost``; else None."""
    try:
        candidate = prune(graph, dataclasses.replace(schedule, **changes))
        timeline = simulate(graph, candidate)
    except InvalidScheduleError:
        return None
    if timeline.peak_bytes <= budget and timeline.cost < cost and not timeline.over_host_budget:
        return candidate, timeline
    return None


def keep_recomputed(graph: Graph, schedule: Schedule, budget: int, *,
                    tries: float = DEFAULT_EFFORT.keep_recomputed_tries) -> Candidate | None:
    """`schedule` with values it recomputes more than once in the backward kept from their first
    recomputation to their last read instead, while its simulated peak stays within ``budget``
    and its cost falls: those whose repeated recomputations cost most first, each tried once
    per pass, passes while one helps, ``tries`` schedules simulated at most (each weighted by the
    graph's size, `simulation_weight`). None if nothing could be kept. (A lowest-peak schedule is
    chosen for its peak alone: titan's debug Llama's, at its smallest budget, recomputed its
    first layer's matmuls about a hundred times each, 13 times the step's FLOPs; nearly all of
    that is kept here at the same peak.) A schedule that OFFLOADs is left as it is (its reloads
    are placed by position in the backward)."""
    if schedule.offloaded:
        return None
    nodes, weight = graph.nodes, simulation_weight(graph)
    best = (schedule, simulate(graph, schedule))
    improved = True
    while improved and tries > 0:
        improved = False
        counts = collections.Counter(best[0].recomputed(graph))
        repeated = sorted((i for i, c in counts.items() if c > 1 and nodes[i].cost > 0),
                          key=lambda i: (-nodes[i].cost * counts[i], i))
        for v in repeated:
            if tries <= 0:
                break
            current = best[0]
            later = [e for e, i in enumerate(current.backward) if i == v][1:]
            if not later:
                continue
            tries -= weight
            found = _cheaper_within(graph, current, budget, best[1].cost, backward=_without_steps(current, later))
            if found is not None:
                best, improved = found, True
    return best if best[0] is not schedule else None


def cost_recomputed_once(graph: Graph, schedule: Schedule, timeline: Timeline) -> float:
    """The least cost `keep_recomputed` can bring ``schedule`` (simulated: ``timeline``) to: each
    value it recomputes made once. (It only drops a value's later recomputations: its first
    stays, and so does every value's first that any of them read.)"""
    counts = collections.Counter(schedule.recomputed(graph))
    nodes = graph.nodes
    return timeline.cost - sum((k - 1) * (nodes[i].cost - nodes[i].comm_exposed) for i, k in counts.items() if k > 1)


# Values `exchange` tries to SAVE in each pass: those whose recomputation costs most.
EXCHANGE_CANDIDATES = 12


def exchange(graph: Graph, schedule: Schedule, budget: int, *,
             tries: int = DEFAULT_EFFORT.exchange_tries) -> Candidate | None:
    """`schedule` improved by exchanges: SAVE one value it recomputes (those whose recomputation
    costs most first, `EXCHANGE_CANDIDATES` of them), and where that no longer fits, RECOMPUTE
    (on demand) SAVEd values, those that cost least to recompute per byte first, each kept where
    it lowers the simulated peak, until it fits again; the exchange is kept where the plan's cost
    falls, and the next pass starts from it. `save_more` only adds: where the budget is tight at
    the peak (the loss's backward, say) the room a costly value needs is held by cheap ones. None
    if no exchange lowers the cost within ``tries`` simulated schedules (each candidate's SAVE,
    each RECOMPUTE tried; each weighted by the graph's size, `simulation_weight`). A schedule
    that COMPRESSes or OFFLOADs is left as it is."""
    if schedule.compressed or schedule.offloaded:
        return None
    nodes, weight = graph.nodes, simulation_weight(graph)

    def scored(saved: frozenset[int]) -> Candidate | None:
        nonlocal tries
        tries -= weight
        try:
            candidate = on_demand(graph, saved)
            return candidate, simulate(graph, candidate)
        except InvalidScheduleError:
            return None

    start = simulate(graph, schedule)
    best = (schedule, start)
    while tries > 0:
        saved = frozenset(best[0].saved)
        recomputed = sorted((i for i in best[0].recomputed(graph) if i in graph.saveable and graph.roots[i] == i
                             and nodes[i].bytes > 0 and nodes[i].cost > 0), key=lambda i: (-nodes[i].cost, i))
        cheap = sorted((i for i in saved if i in graph.saveable and graph.roots[i] == i and nodes[i].bytes > 0
                        and i not in graph.forward_outputs), key=lambda i: (nodes[i].cost / nodes[i].bytes, i))
        improved = False
        for v in recomputed[:EXCHANGE_CANDIDATES]:
            if tries <= 0:
                break
            trial, current = saved | {v}, scored(saved | {v})
            for u in cheap:
                if current is None or current[1].peak_bytes <= budget or tries <= 0:
                    break
                dropped = scored(trial - {u})
                if dropped is not None and dropped[1].peak_bytes < current[1].peak_bytes:
                    trial, current = trial - {u}, dropped
            if (current is not None and current[1].peak_bytes <= budget and current[1].cost < best[1].cost
                    and not current[1].over_host_budget):
                best, improved = current, True
                break
        if not improved:
            break
    return best if best[0] is not schedule else None


def compress_to_fit(graph: Graph, schedule: Schedule, budget: int) -> Candidate | None:
    """`schedule` with the fewest of its SAVEd values COMPRESSed (cheapest per byte saved first)
    that brings its simulated peak within `budget`; None if compressing all of them does not."""
    nodes = graph.nodes
    order = sorted(schedule.saved & graph.compressible - schedule.compressed,
                   key=lambda i: (nodes[i].codec_cost / (nodes[i].bytes - nodes[i].compressed_bytes), i))
    return _shortest_prefix(graph, schedule, "compressed", order, budget)


def offload_to_fit(graph: Graph, schedule: Schedule, budget: int) -> Candidate | None:
    """`schedule` with the fewest of its SAVEd values OFFLOADed that brings its simulated peak
    within `budget`; None if offloading all that may help does not, or if that takes more host
    memory than the graph's ``transfers.host_budget``.

    The values go in the order their copies hide best: the least share of their window (the
    compute time between their last forward use and their first backward read) that their two
    copies take, then the largest first. That share stands in for the bytes moved per exposed
    second, which depends on the other copies sharing the channels: only the simulator knows it,
    and it scores every prefix tried, stalls and all. Values whose copies take longer than their
    window cannot be off the device at all with the default reload point (back before it is gone),
    and are left out."""
    order = _offload_order(graph, schedule)
    best = _shortest_prefix(graph, schedule, "offloaded", order, budget)  # the least host memory, the fewest copies
    return None if best is None or best[1].over_host_budget else best


def _shortest_prefix(graph: Graph, schedule: Schedule, field: str, order: list[int], budget: int) -> Candidate | None:
    """`schedule` with the shortest prefix of ``order`` added to its set ``field`` (``compressed``
    or ``offloaded``) whose simulated peak is within `budget`, by bisection (each value added
    lowers the peak or leaves it); None if all of ``order`` does not bring it there."""
    if not order:
        return None

    def run(k: int) -> Candidate:
        s = dataclasses.replace(schedule, **{field: getattr(schedule, field) | frozenset(order[:k])})
        return s, simulate(graph, s)

    best = run(len(order))
    if best[1].peak_bytes > budget:
        return None
    lo, hi = 1, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        candidate = run(mid)
        if candidate[1].peak_bytes <= budget:
            best, hi = candidate, mid
        else:
            lo = mid + 1
    return best


def offload_all(graph: Graph, schedule: Schedule) -> Schedule | None:
    """`schedule` with every SAVEd value whose copies fit in its window OFFLOADed (its lowest
    peak, mostly: what `fxopt.solvers.auto.min_feasible_budget` tries); None if there is none."""
    order = _offload_order(graph, schedule)
    return dataclasses.replace(schedule, offloaded=schedule.offloaded | frozenset(order)) if order else None


def _offload_order(graph: Graph, schedule: Schedule) -> list[int]:
    """The SAVEd values of `schedule` OFFLOAD may take off the device, those whose copies hide
    best first (see `offload_to_fit`)."""
    transfers = graph.transfers
    candidates = schedule.saved & graph.offloadable - schedule.offloaded
    if transfers is None or not candidates:
        return []
    share: dict[int, float] = {}
    nbytes: dict[int, int] = {}
    for j, (size, window) in offload_windows(graph, schedule, candidates).items():
        busy = transfers.d2h_seconds(size) + transfers.h2d_seconds(size)
        if busy < window:
            share[j], nbytes[j] = busy / window, size
    return sorted(share, key=lambda j: (share[j], -nbytes[j], j))


def offload_windows(graph: Graph, schedule: Schedule, values) -> dict[int, tuple[int, float]]:
    """For each of ``values`` (offloadable, SAVEd by ``schedule``) that the backward reads: the
    bytes its offload would move and the seconds from its last forward use to its first backward
    read. Read from the simulator's clock with copies that take no time (so nothing stalls)."""
    free_copies = graph.with_transfers(INSTANT)
    timeline = simulate(free_copies, dataclasses.replace(schedule, offloaded=frozenset(values), reload_at=()))
    gone = {c.value: c for c in timeline.copies if c.channel == "d2h"}
    by_name = {graph.nodes[j].name: j for j in values}
    return {by_name[c.value]: (c.bytes, c.needed - gone[c.value].issued)
            for c in timeline.copies if c.channel == "h2d" and c.needed is not None}


# Each takes (graph, budget, effort=...) and returns its schedules, simulated, fitting or not.
HEURISTICS = {"save_all": save_all, "checkpoint": checkpoint, "greedy": greedy, "segments": segments}


def lower_peak(graph: Graph, schedule: Schedule, *, work: int = DEFAULT_EFFORT.lower_peak_work) -> Candidate | None:
    """`schedule` with a lower simulated peak, where the backward's recomputations can give one:
    a local search at the backward step where the peak is, two moves, the first that lowers the
    peak kept, then again at the new peak:

      keep    a value the peak's run of recomputations makes again, made earlier in the
              backward too: that copy is kept until here instead (its ancestors, recomputed
              only for it, go with it);
      split   a value held across the peak and not read there: let go after its last read
              before, and recomputed just before its next read after (its views with it), from
              the latest copies of its inputs, or else from what is alive there.

    The lowest-peak searches decide what to SAVE and recompute per value, recomputing on
    demand: a value they recompute twice is made twice, and one read on both sides of the peak
    is held across it. Their lowest peak on the bench GPT-2's 2-rank FSDP step was its MLP's
    backward with the whole residual stream recomputed from the embeddings inside it. None where
    no move lowers the peak within ``work`` (simulated steps, each schedule's forward and
    backward counted), or where the peak is in the forward. A schedule that OFFLOADs is left as
    it is (its reload points are positions in its backward)."""
    if schedule.offloaded:
        return None
    best = as_generated(graph, schedule)
    timeline = simulate(graph, best)
    size = len(forward_set(graph, best.saved))
    improved = False
    while work > 0:
        at = _peak_step(timeline)
        if at is None:
            break
        for backward in _peak_moves(graph, best, at):
            work -= size + len(backward)
            try:
                candidate = as_generated(graph, dataclasses.replace(best, backward=backward))
                trial = simulate(graph, candidate)
            except InvalidScheduleError:
                continue
            if trial.peak_bytes < timeline.peak_bytes and not trial.over_host_budget:
                best, timeline, improved = candidate, trial, True
                break
            if work <= 0:
                break
        else:
            break  # (no move lowers this peak)
    return (best, timeline) if improved else None


def _peak_step(timeline: Timeline) -> int | None:
    """The position, among the backward's steps the simulator ran, of the one at the peak (or the
    last before it, where the peak is a reload or a decompression); None where the peak is in the
    forward or before the backward's first step."""
    events = timeline.events
    top = max(range(len(events)), key=lambda e: events[e][2])
    if events[top][0] != "backward":
        return None
    at = sum(1 for phase, name, _ in events[:top + 1]
             if phase == "backward" and name != "<start>" and not name.startswith(("reload ", "decompress "))) - 1
    return at if at >= 0 else None


def _peak_moves(graph: Graph, schedule: Schedule, at: int):
    """The backward orders `lower_peak` tries at step ``at`` of ``schedule`` (as generated: every
    step of its backward runs): keep, then split, the largest values first."""
    nodes, roots, backward = graph.nodes, graph.roots, schedule.backward
    if nodes[backward[at]].kind == "forward":  # keep: the run of recomputations around the peak
        lo = hi = at
        while lo > 0 and nodes[backward[lo - 1]].kind == "forward":
            lo -= 1
        while hi + 1 < len(backward) and nodes[backward[hi + 1]].kind == "forward":
            hi += 1
        before = set(backward[:lo])
        for q in range(hi, lo - 1, -1):
            if backward[q] in before and roots[backward[q]] == backward[q] and nodes[backward[q]].bytes:
                yield backward[:q] + backward[q + 1:]
    steps = backward_steps(graph, schedule)
    made = {copy: e for e, (_, copy, _) in enumerate(steps)}
    last: dict = {}
    for e, (_, _, args) in enumerate(steps):
        for a in args:
            last[a] = e
    read_at = {roots[j] for j, _ in steps[at][2]}
    next_read: dict[int, tuple[int, int]] = {}  # storage -> (its first read after the peak, the value read)
    for e in range(len(steps) - 1, at, -1):
        for j, n in steps[e][2]:
            root = roots[j]
            if made.get((j, n), -1) < at and root not in read_at and nodes[j].kind == "forward" \
                    and nodes[root].bytes and nodes[root].recomputable:
                next_read[root] = (e, j)
    forever = {i for i, n in enumerate(nodes) if n.kind == "input"} | set(graph.forward_outputs)
    for root, (e, j) in sorted(next_read.items(), key=lambda kv: (-nodes[kv[0]].bytes, kv[0])):
        # Made again from the latest copies of its inputs (held until then), or from what is
        # alive there anyway.
        views = [j]
        while views[-1] != root:
            views.append(next(k for k in nodes[views[-1]].inputs if roots[k] == root))
        yield backward[:e] + tuple(reversed(views)) + backward[e:]
        alive = {a[0] for a, r in last.items() if made.get(a, -1) < e <= r and roots[a[0]] != root} | forever
        try:
            chain = to_recompute(graph, [j], alive)
        except InvalidScheduleError:
            continue
        if chain != [root]:
            yield with_fresh_aliases(graph, backward[:e] + tuple(chain) + backward[e:])
