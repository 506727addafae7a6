"""Re-gathers issued ahead of their wait (prefetch), and priced by the time the step waits for them.

A re-gather is a RECOMPUTEd all-gather (FSDP's reshard after forward): the backward gathers a
sharded parameter again. The joint graph traces each all-gather with its wait right after it, so a
schedule that recomputes one where it is read runs

    ...; mm_9 = mm(g_8, w_7); ag = all_gather(shard_w3); w3 = wait(ag); g_9 = mm(g_8, w3); ...

and the step stands still for the whole communication. A functional all-gather is asynchronous
until its wait (gloo runs it on its worker thread, NCCL on its stream), so the rewritten step
issues it earlier, behind compute it does not depend on, and waits where it did:

    ...; ag = all_gather(shard_w3); mm_9 = mm(g_8, w_7); w3 = wait(ag); g_9 = mm(g_8, w3); ...

`prefetched` is that move, a pure function of the graph and the schedule (as OFFLOAD's default
reload points are, `fxopt.solvers.schedule`), so the simulator and the generated code
(`fxopt.passes.recompute`) run the same step: each re-gather goes as late as lets its
communication complete before its wait on the backward's clock (the compute of the steps
between, by `Node.cost`), counting back from the last wait so that re-gathers sharing the process
group do not overlap (one collective at a time, in the order issued); never before what it
reads, nor before an earlier read of the same value, nor across a step where the bytes it holds
would raise the schedule's peak (`fxopt.solvers.schedule.with_prefetch`). The simulator counts
the gathered buffer from the issue, and the collective's scratch (gloo's flat buffer) from the
issue through the wait, as the worker thread holds it while the step computes on (the bytes a
prefetch holds earlier are in every peak), and the time the wait still
stands still (`Timeline.exposed_comm_seconds`), which is what a plan's cost counts for a re-gather,
beside its compute (`Node.cost` less `Node.comm_exposed`).

`priced` sets what the solvers' linear models see for a re-gather before any plan exists
(`Node.cost`, `Node.comm_exposed`): its communication less the backward's compute before its
first backward reader (a parameter the backward reads at once cannot be hidden; one it reads
after 5 ms of backward compute hides 5 ms), never below zero. That leaves out what only a plan
decides (other re-gathers on the channel, the recomputations before the reader); the simulator
counts both, and every plan the solvers keep is simulated.

The gradients' reduce-scatters (and all-reduces) share that process group (`holds_group`): each
is waited for where it is issued, so it holds the group, and the step, for its whole
communication, and a re-gather still in flight when one is issued makes the step stand still for
the rest of it first (the group runs its collectives in the order issued). So a re-gather hides
only behind the compute between two of them: it is issued in the latest such stretch that holds
its whole communication before its wait, or, where none does, at the start of the longest one
(the rest exposed, at the reduce-scatter or at the wait). The simulator queues them alike, and
`priced` counts the longest stretch before the first reader as what can hide it.

The forward's all-gathers are moved the same way (`prefetched` on the forward's order,
`fxopt.solvers.schedule.forward_order`): the traced forward gathers each parameter where a module
reads it and waits at once, so the step stood still for each; issued ahead, the next block's
gather runs while this block computes. No collective holds the process group there but the
gathers themselves, and the bound is the same (no step raised above the schedule's peak).

The gradients' reduce-scatters are waited for later than they are issued, too (`_wait_points`):
the joint graph traces each with its wait right after it, so the backward stood still for every
gradient's reduction. Each is issued where the schedule has it, as soon as its gradient is
complete, and its wait moves towards the first step that reads the shard it returns (the end of
the backward, for a gradient nothing reads), as far as the memory allows, with the steps right
after it that read only what it returns (`_followers`: mixed precision's cast of the reduced shard
to the shard's dtype, which would otherwise hold it where it was issued; each step they cross holds
the shard, not the cast): on gloo the collective holds a copy of the whole gradient from its issue
to its wait (`Node.lingers`; gloo reduces in it), and the wait crosses no step where that copy
would raise the schedule's peak. The schedule without the move already holds each copy until the next
reduce-scatter's wait (`fxopt.solvers.liveness.Lingering`, the bound the solvers count with), so up
to there a move costs nothing; past it the copy is counted in each step it crosses. The
re-gathers are placed first (their exposed time is in a plan's cost) and the waits in the room
they leave. The simulator counts each moved copy exactly, from its issue to its own wait
(`Lingering.exact`), and runs the reduce-scatter beside the steps between on the process group's
clock (a re-gather issued meanwhile queues behind it): `Timeline.reduce_exposed_comm_seconds`,
reported, not in the plan's cost. The order is the generated code's (`fxopt.passes.waits`
splits ``fxopt::reduce_scatter`` into its issue and its wait), a pure function of the plan.
eager autograd's step (`simulate`'s ``eager_frees``) waits where it issues.

What is left out: a step with OFFLOAD keeps its gathers, re-gathers and waits where the schedule
puts them (its reload points are positions in that schedule).

DDP's all-reduces (in a step with no gather and no collective that holds bytes in flight) have
their waits moved the same way, to before the first step that reads what they return, with no
memory to check: an all-reduce's wait returns the storage it made when issued, alive from there
on (and no followers move: their bytes would need a timeline). It is where the generated code
waits for them (`fxopt.passes.waits.sink_all_reduce_waits`), so the simulator's clock runs each
beside the backward's compute after it (`Timeline.reduce_exposed_comm_seconds`), as the step does.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np

from fxopt.solvers.graph import Graph


def priced(graph: Graph) -> Graph:
    """``graph`` with each re-gatherable all-gather (a forward node with `Node.comm_seconds`)
    priced by its predicted exposed time (see the module): ``comm_exposed`` set, and ``cost`` its
    compute plus that."""
    gathers = [i for i, n in enumerate(graph.nodes) if n.kind == "forward" and n.comm_seconds > 0]
    if not gathers:
        return graph
    nodes = list(graph.nodes)
    before = _longest_stretch_before(graph)
    for i in gathers:
        n = nodes[i]
        reader = _first_backward_reader(graph, i)
        window = before[reader] if reader is not None else 0.0
        exposed = max(0.0, n.comm_seconds - window)
        nodes[i] = n.replaced(cost=n.cost - n.comm_exposed + exposed, comm_exposed=exposed)
    return Graph(tuple(nodes), graph.transfers)


def _longest_stretch_before(graph: Graph) -> dict[int, float]:
    """For each backward node, the seconds of the longest stretch of backward nodes before it with
    no collective that holds the process group (every plan runs them): what a re-gather read there
    can hide behind."""
    out, longest, stretch = {}, 0.0, 0.0
    for b in graph.backward_nodes:
        out[b] = max(longest, stretch)
        if holds_group(graph, b):
            longest, stretch = max(longest, stretch), 0.0
        else:
            stretch += graph.nodes[b].cost
    return out


def _first_backward_reader(graph: Graph, i: int) -> int | None:
    """The first backward node that reads value ``i`` (the gathered parameter), directly or
    through its views (its wait, the slice and view of its shape, a transpose)."""
    views = [j for j in range(i, len(graph.nodes)) if graph.roots[j] == graph.roots[i]]
    return min((u for j in views for u in graph.users[j] if graph.nodes[u].kind == "backward"), default=None)


def is_regather(graph: Graph, i: int) -> bool:
    """Whether node ``i`` is an all-gather issued ahead of its wait: run in the backward, a
    re-gather; in the forward, the first gather of a parameter (`prefetched` moves both)."""
    n = graph.nodes[i]
    return n.kind == "forward" and n.comm_seconds > 0


def holds_group(graph: Graph, i: int) -> bool:
    """Whether node ``i`` is a collective of the backward waited for where it is issued (a
    gradient's reduce-scatter or all-reduce), which holds the process group re-gathers share."""
    n = graph.nodes[i]
    return n.kind == "backward" and n.comm_seconds > 0


def reduce_wait(graph: Graph, i: int) -> int | None:
    """The wait of node ``i``, where ``i`` is a collective of the backward (`holds_group`: a
    gradient's reduce-scatter) read by nothing but its wait, which returns the collective's
    output (the same storage, `Graph.roots`): the generated code may wait for it later than it
    was traced (`prefetched`). None otherwise."""
    if not holds_group(graph, i) or len(graph.users[i]) != 1:
        return None
    w = graph.users[i][0]
    return w if graph.roots[w] == graph.roots[i] and graph.nodes[w].kind == "backward" else None


def prefetched(graph: Graph, backward: tuple[int, ...], live: list[int] | None = None,
               peak: int | None = None) -> tuple[int, ...]:
    """``backward`` (a pruned schedule's, see `fxopt.solvers.schedule.with_prefetch`; or the
    forward's steps, `fxopt.solvers.schedule.forward_order`) with each re-gather (each gather)
    moved ahead of its wait as far as hides its communication (see the module), and each
    reduce-scatter's wait moved back, towards the first step that reads what it returns, as far
    as the memory it holds in flight allows (`_wait_points`); neither further than keeps every
    step it moves across within ``peak``: ``live[k]``, the bytes live while step k runs with the
    collectives where ``backward`` has them, plus the bytes moved across it, at most ``peak``
    (None: no limit). The re-gathers are placed first: their exposed time is part of a plan's
    cost, the reduce-scatters' is not (every plan reduces every gradient)."""
    positions = moved_positions(graph, backward, live, peak)
    return backward if positions is None else tuple(backward[e] for e in positions)


def moved_positions(graph: Graph, backward: tuple[int, ...], live: list[int] | None = None,
                    peak: int | None = None) -> list[int] | None:
    """`prefetched`'s order as positions in ``backward`` (each step once), or None where nothing
    moves: a caller holding something per step (`fxopt.solvers.schedule`'s replay steps) reorders
    it so."""
    regathers = [e for e, i in enumerate(backward) if is_regather(graph, i)]
    waits = [(e, _wait_of(graph, backward, e)) for e, i in enumerate(backward) if reduce_wait(graph, i) is not None]
    if not regathers and not waits:
        return None
    extra = [0] * len(backward)  # bytes moved across each step: gathered, or held in flight
    issue_at = _issue_points(graph, backward, regathers, live, peak, extra) if regathers else {}
    wait_at = _wait_points(graph, backward, waits, live, peak, extra)
    moved = {}
    for e in sorted(wait_at):
        moved.setdefault(wait_at[e], []).append(e)
    for e in sorted(issue_at):
        moved.setdefault(issue_at[e], []).append(e)
    if not moved:
        return None
    order: list[int] = []
    for k in range(len(backward)):
        order.extend(moved.get(k, ()))
        if k not in issue_at and k not in wait_at:
            order.append(k)
    order.extend(moved.get(len(backward), ()))
    return order


def _issue_points(graph: Graph, backward: tuple[int, ...], regathers: list[int], live: list[int] | None,
                  peak: int | None, extra: list[int]) -> dict[int, int]:
    """The position each re-gather (by its position in ``backward``) is issued before (see
    `prefetched`), its gathered bytes added to ``extra`` at each step it moves across."""
    nodes = graph.nodes
    # When each step starts if nothing stood still: compute only (a re-gather's issue costs its
    # compute; its communication runs beside).
    seconds = [nodes[i].cost - nodes[i].comm_exposed for i in backward]
    start = list(itertools.accumulate(seconds, initial=0.0))
    busy = [(start[k], start[k + 1]) for k, i in enumerate(backward) if holds_group(graph, i)]
    issue_at: dict[int, int] = {}  # position of a re-gather -> position it is issued before
    channel_free_from = float("inf")
    for e in sorted(regathers, key=lambda e: -_wait_of(graph, backward, e)):
        i, wait = backward[e], _wait_of(graph, backward, e)
        earliest = _earliest(graph, backward, e)
        held = nodes[graph.roots[i]].bytes + nodes[i].workspace  # (gloo's flat buffer, to its wait)
        while True:
            begin = _begin(busy, min(start[wait], channel_free_from), start[earliest], nodes[i].comm_seconds)
            at = min(max(bisect.bisect_right(start, begin, 0, e + 1) - 1, earliest), e)
            # Not across a step it would raise above the peak: issued after the latest such step
            # (only the steps it would cross are looked at; after the latest, none is).
            blocked = None if live is None or peak is None else \
                next((k for k in range(e - 1, at - 1, -1) if live[k] + extra[k] + held > peak), None)
            if blocked is None:
                break
            earliest = blocked + 1
        while at < e and _tuple_item(graph, backward[at]):
            at += 1  # (a multi-output op's outputs are taken out right after it)
        channel_free_from = min(begin, start[at])
        issue_at[e] = at
        for k in range(at, e):
            extra[k] += held
    return issue_at


def _wait_points(graph: Graph, backward: tuple[int, ...], waits: list[tuple[int, int]], live: list[int] | None,
                 peak: int | None, extra: list[int]) -> dict[int, int]:
    """For each (collective, its wait) of ``waits`` (positions in ``backward``), the position the
    wait moves before, where it moves at all, with the steps that read nothing but what it returns
    right after it (`_followers`: mixed precision's cast of the reduced shard to the shard's dtype),
    which move with it, in their order: as late as the first step that reads what they return
    (the end, for a gradient nothing reads), never before a multi-output op's outputs are taken
    out, and no further than keeps each step it moves across, and the step after it, within
    ``peak`` with the bytes the collective holds until its wait (`Node.lingers`: gloo's copy of
    the whole gradient) added where ``live`` does not count them already: ``live`` holds the copy
    through the wait of the next collective that lingers, or to the end
    (`fxopt.solvers.liveness.Lingering`), so up to there the move is free (with a wait moved, the
    simulator counts each copy from its issue to its own wait, `Lingering.exact`: within that).
    Those bytes count in each step it moves across past that point; where followers move, each step
    it moves across holds the shard they read instead of what they make, and where they land the
    shard and all they make are live at once, the copy let go by the wait (``extra`` as the
    re-gathers left it, read, not written). Returns each moved position (a wait's, a follower's)
    and the position it moves before."""
    n = len(backward)
    through = _lingering_through(graph, backward)
    # (followers move bytes: only where the steps' bytes are known to check them against)
    checked = live is not None and peak is not None
    groups = {w: _followers(graph, backward, w) if checked else [w] for _, w in waits}
    made = {backward[k]: w for w, group in groups.items() for k in group}
    reader: dict[int, int] = {}  # a wait -> the first step after its group that reads what the group makes
    for k, i in enumerate(backward):
        for j in graph.nodes[i].inputs:
            w = made.get(j)
            if w is not None and w not in reader and k > groups[w][-1]:
                reader[w] = k
    # Bytes each step may still take (the steps the waits move across, one wait after another).
    room = peak - np.asarray(live, np.int64) - np.asarray(extra, np.int64) if checked else None
    wait_at: dict[int, int] = {}
    for e, w in waits:
        group = groups[w]
        start = group[-1] + 1  # (the first step the group moves across)
        held = graph.nodes[backward[e]].lingers
        shard = graph.nodes[graph.roots[backward[w]]].bytes if len(group) > 1 else 0
        # Each step the group moves across holds the shard the followers read instead of what they
        # make that outlives them (alive there before, from where they were to ``end`` or later).
        members = {backward[k] for k in group}
        owned = [backward[k] for k in group[1:] if graph.roots[backward[k]] == backward[k]]
        outlive = sum(graph.nodes[i].bytes for i in owned
                      if graph.nodes[i].output or not members.issuperset(graph.users[i]))
        transient = sum(graph.nodes[i].bytes for i in owned) - outlive
        last = through.get(e, w)
        end = reader.get(w, n)
        first = max(last + 1, start)  # (before it the copy is counted already)
        q = end
        if room is not None and start < n and (held or shard):
            held_from = np.zeros(n - start, np.int64)
            held_from[first - start:] = held
            need = held_from + (shard - outlive)
            full = (room[start:] < need) & (need > 0)  # the first step it would raise above the peak: not
            if full.any():  # crossed, and the wait not right before it (its own bytes are the step's before)
                q = max(start, min(end, start + int(full.argmax()) - 1))
            # Where the followers land, after the wait has let go of the copy (``live`` counts it
            # before ``first``): the shard and all they make are live at once.
            while shard and q > start and room[q - 1] < shard + transient - (held if q - 1 < first else 0):
                q -= 1
        while q > start and q < n and _tuple_item(graph, backward[q]):
            q -= 1
        if q > start:
            for k in group:
                wait_at[k] = q
            if room is not None and (held or shard):
                room[start:q] -= np.maximum(need[:q - start], 0)
    return wait_at


def _followers(graph: Graph, backward: tuple[int, ...], w: int) -> list[int]:
    """Position ``w`` (a reduce-scatter's wait) and the steps right after it that read nothing but
    what the wait and they return, and compute (no collective): mixed precision's cast of the
    reduced shard to the shard's dtype (``_to_copy``), which would otherwise hold the wait where
    it was issued (`_wait_points` moves them with it)."""
    group, values = [w], {backward[w]}
    for k in range(w + 1, len(backward)):
        node = graph.nodes[backward[k]]
        if node.kind != "backward" or node.comm_seconds > 0 or not node.inputs or not values.issuperset(node.inputs):
            break
        group.append(k)
        values.add(backward[k])
    return group


def _lingering_through(graph: Graph, backward: tuple[int, ...]) -> dict[int, int]:
    """For each collective that lingers (`Node.lingers`), by its position in ``backward``: the last
    position at which `fxopt.solvers.liveness.Lingering` still holds its bytes with each wait where
    ``backward`` has it (the wait of the next one that lingers; the last step for the last)."""
    lingering = [e for e, i in enumerate(backward) if graph.nodes[i].lingers]
    out = {}
    for e, after in zip(lingering, lingering[1:] + [None]):
        if after is None:
            out[e] = len(backward) - 1
        elif graph.users[backward[after]]:
            out[e] = min(_wait_of(graph, backward, after), len(backward) - 1)
        else:
            out[e] = after
    return out


def _begin(busy: list[tuple[float, float]], end: float, first: float, seconds: float) -> float:
    """When a re-gather of ``seconds`` should begin so that it ends by ``end``, not before
    ``first``, and, as the process group runs one collective at a time, between the intervals
    ``busy`` with the collectives waited where issued: in the latest stretch between them that holds
    it whole, else at the start of the longest one (the latest of equals)."""
    best: tuple[float, float] | None = None  # (length, start) of the longest stretch
    for lo, hi in _stretches(busy, end, first):
        if hi - lo >= seconds:
            return hi - seconds
        if best is None or hi - lo > best[0]:
            best = (hi - lo, lo)
    return best[1] if best is not None else end - seconds


def _stretches(busy: list[tuple[float, float]], end: float, first: float):
    """The stretches of time from ``first`` to ``end`` outside the intervals ``busy``, latest
    first, as (start, end)."""
    hi = end
    for lo_busy, hi_busy in reversed(busy):
        if hi_busy > hi:
            hi = min(hi, lo_busy)
            continue
        if hi_busy <= first:
            break
        if hi > hi_busy:
            yield hi_busy, hi
        hi = lo_busy
    if hi > first:
        yield first, hi


def _tuple_item(graph: Graph, i: int) -> bool:
    """Whether node ``i`` takes an output out of a multi-output op (a tuple)."""
    inputs = graph.nodes[i].inputs
    return len(inputs) == 1 and not graph.nodes[inputs[0]].tensor


def _wait_of(graph: Graph, backward: tuple[int, ...], e: int) -> int:
    """The position of the first step after ``e`` that reads the value step ``e`` makes (its wait),
    or the end."""
    i = backward[e]
    return next((k for k in range(e + 1, len(backward)) if i in graph.nodes[backward[k]].inputs), len(backward))


def _earliest(graph: Graph, backward: tuple[int, ...], e: int) -> int:
    """The earliest position step ``e`` may be issued before: after every earlier step that makes
    what it reads or that reads the value it makes (an earlier copy's reader must keep reading it)."""
    i = backward[e]
    inputs = set(graph.nodes[i].inputs)
    for k in range(e - 1, -1, -1):
        j = backward[k]
        if j in inputs or j == i or i in graph.nodes[j].inputs:
            return k + 1
    return 0


