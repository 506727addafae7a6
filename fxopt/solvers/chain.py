"""Chains: the forward cut at its articulation values, checkpointed by dynamic programming.

A forward with articulation values a_0 < a_1 < ... < a_{L-2} (`checkpoint_cuts`: values through
which every later value reads the earlier ones, a residual block's or a transformer layer's
output) is a chain of L stages: stage s computes a_s from a_{s-1} (the last stage ends with the
loss), and its backward B_s reads some of its values and a_{s-1}. Beaumont, Eyraud-Dubois,
Herrmann, Joly and Shilova ("Optimal checkpointing for heterogeneous chains", 2019: the "rotor"
algorithm; revolve is its homogeneous case) give the optimal schedule of such a chain by dynamic
programming over sub-chains. To run stages s..t forward and back from a_{s-1}, either

    ALL      compute stage s keeping what B_s reads (and a_s), run s+1..t, then B_s;
    CK(e)    compute stages s..e keeping only a_e, run e+1..t from it, let it go, then run
             s..e again from a_{s-1} (their forward recomputed).

The recursion recomputes a stage as often as it pays (multi-level checkpointing). A stage is the
unit: whatever is inside it is kept whole (ALL) or recomputed whole. In fxopt's terms the first
descent of the recursion is the forward (what it keeps is the SAVE set), and every later sweep is
a run of recomputations in the backward order, placed just before the first backward node of the
stage it serves; `Schedule.backward` may list a recomputation of a node more than once, and the
simulator reads each node's latest copy. Before (save all) and after (CK(0) on a 3-stage chain):

    forward  a0 a1 loss | SAVE a0 a1 + reads    forward  a0 a1 loss | SAVE a0 + reads of stage 2
    backward B2 B1 B0                            backward B2 [stage 1 again] B1 [stage 0 again] B0

Memory, in bytes, while a sweep or a backward node runs = the fixed part (resident values, forward
outputs, tangents and the backward values alive: `fixed_backward_profile`, the same for every
schedule; in the forward, resident values and forward outputs) + what the enclosing calls hold
(a_e, or the values ALL keeps) + the stage's own walk (its values freed after their last use in
it). Two answers:

  - `min_peak_schedule`: the lowest peak any such schedule reaches (the DP over peaks, exact);
  - `cheapest_schedule`: the least recomputation within a budget (rotor's DP, with memory in
    `SLOTS` slots, every size rounded up).

The model is conservative where a chain is not a clean one: forward outputs and values that
cannot be recomputed are counted from the start, a_{s-1} until B_s ends, a sweep's walk over the
whole stage. Every schedule is simulated before it is used; `Chain.exact` says whether the
backward read nothing across stages, in which case prediction and simulation agree on the chains
the tests build. A graph with no useful articulation value gets nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import Candidate, checkpoint_cuts
from fxopt.solvers.liveness import LiveBytes, fixed_backward_profile, last_uses
from fxopt.solvers.schedule import OnDemand, Schedule, must_save, prune, simulate

# Memory slots of `cheapest_schedule`'s DP (rotor discretizes memory the same way). When every
# size held across a sub-call is a multiple of one unit and the budget is at most EXACT_SLOTS of
# them, that unit is the slot and the DP is exact; otherwise sizes are rounded up to budget /
# SLOTS, so a plan within the budget may be missed by that much.
SLOTS = 400
EXACT_SLOTS = 4000

# A sub-chain's decision: "all" or the stage e whose output CK(e) keeps; then its sub-calls.
Tree = tuple[int, int, "str | int", tuple]


@dataclasses.dataclass(frozen=True)
class Stage:
    link: int | None  # the articulation value ending the stage (None: the last stage)
    reads: frozenset[int]  # its values its backward reads: what ALL keeps
    link_bytes: int
    kept_bytes: int  # reads and link
    sweep_fixed: int  # the fixed part just before its backward starts (the sweeps for it run then)
    backward_peak: int  # fixed part + its reads still alive, the most while its backward runs
    # Walks (bytes beyond the fixed part and the caller's), in the forward and recomputed:
    ck: tuple[int, int]  # to its link: first stage of a sweep (input held by the caller), later ones
    ck_forward: tuple[int, int]
    all: int  # keeping reads and link
    all_forward: int
    last: int  # keeping reads only (ALL of a sub-chain's last stage)
    ck_cost: float
    all_cost: float
    last_cost: float


@dataclasses.dataclass(frozen=True)
class Chain:
    stages: tuple[Stage, ...]
    assigned: tuple[int, ...]  # per backward node (graph order), the stage whose backward it is
    forward_fixed: int  # resident values and forward outputs
    pinned: int  # values that cannot be recomputed: held throughout
    exact: bool  # no backward node reads a value of a stage other than its own or its input


@dataclasses.dataclass(frozen=True)
class ChainSchedule:
    schedule: Schedule
    peak_bytes: int  # the DP's prediction
    recompute_cost: float


def chain_of(graph: Graph) -> Chain | None:
    """The graph as a chain of stages, or None when it has no articulation value to cut at."""
    cuts = checkpoint_cuts(graph)
    if not cuts or not graph.backward_nodes:
        return None
    stage_of = _stage_of(graph, cuts)
    skip = graph.resident | graph.free | graph.forward_outputs | must_save(graph)
    reads = [_reads(graph, b, skip) for b in graph.backward_nodes]
    assigned = _assign(reads, stage_of, set(cuts), len(cuts) + 1)
    fixed = fixed_backward_profile(graph)
    nodes = graph.nodes
    forward_fixed = sum(nodes[r].bytes for r in {graph.roots[i] for i in graph.resident | graph.forward_outputs})
    pinned = sum(nodes[r].bytes for r in {graph.roots[i] for i in must_save(graph)}
                 if r not in graph.resident and r not in graph.forward_outputs)
    excluded = frozenset(graph.roots[i] for i in skip)
    stages, exact = [], True
    for s in range(len(cuts) + 1):
        own = frozenset().union(*(reads[k] for k, a in enumerate(assigned) if a == s))
        inp, link = (cuts[s - 1] if s else None), (cuts[s] if s < len(cuts) else None)
        exact &= all(stage_of.get(v) == s or v == inp for v in own)
        stage_reads = frozenset(v for v in own if stage_of.get(v) == s)
        stages.append(_stage(graph, stage_of, s, inp, link, stage_reads, excluded,
                             _fixed_at(fixed, assigned, s), _backward_peak(graph, fixed.during, reads, assigned, s,
                                                                          stage_reads)))
    return Chain(tuple(stages), tuple(assigned), forward_fixed, pinned, exact)


def _stage_of(graph: Graph, cuts: list[int]) -> dict[int, int]:
    """The stage of each forward value: values up to and including cut s are in stage s; a
    backward-only value is in the latest stage it reads."""
    out, s, cut = {}, 0, set(cuts)
    for i in sorted(graph.forward_required - graph.resident):
        out[i] = s
        s += i in cut
    for i in sorted(graph.backward_only - graph.resident):
        out[i] = max((out[j] for j in graph.nodes[i].inputs if j in out), default=0)
    return out


def _reads(graph: Graph, b: int, skip: frozenset[int]) -> frozenset[int]:
    """The forward values backward node b needs kept (as eager would save them): through views,
    and through backward-only values that cannot be SAVEd to what they are made from."""
    out: set[int] = set()
    stack = [j for j in graph.through_aliases(graph.nodes[b].inputs) if graph.nodes[j].kind == "forward"]
    while stack:
        i = stack.pop()
        if i in skip or i in out or graph.nodes[i].kind != "forward":
            continue
        if i in graph.saveable or not graph.nodes[i].recomputable:
            out.add(i)
        else:
            stack.extend(graph.through_aliases(graph.nodes[i].inputs))
    return frozenset(out)


def _assign(reads, stage_of: dict[int, int], cuts: set[int], count: int) -> list[int]:
    """Each backward node's stage, never increasing along the backward: the latest stage it reads
    (reading a stage's output counts as the next stage's, whose input it is)."""
    cur, out = count - 1, []
    for r in reads:
        if r:
            cur = min(cur, max(stage_of.get(v, 0) + (v in cuts) for v in r))
        out.append(cur)
    return out


def _fixed_at(fixed, assigned: list[int], s: int) -> int:
    """The fixed part as the backward of stage s (or of the next stage with one) begins."""
    k = next((k for k, a in enumerate(assigned) if a <= s), None)
    return fixed.before[k] if k is not None else fixed.during[-1]


def _backward_peak(graph: Graph, during: list[int], reads, assigned, s: int, stage_reads) -> int:
    """The most memory while stage s's backward runs: the fixed part and the storage of its reads
    (held from its start until the last read)."""
    span = [k for k, a in enumerate(assigned) if a == s]
    last: dict[int, int] = {}
    for k in span:
        for v in reads[k] & stage_reads:
            r = graph.roots[v]
            last[r] = max(last.get(r, k), k)
    # (One sweep from the stage's last step back: the reads held at k are those last read at k or
    # later. The sum per step was quadratic in the stage's steps: 1.1 million terms on a 32-layer
    # Llama's step.)
    ending: dict[int, int] = {}
    for r, e in last.items():
        ending[e] = ending.get(e, 0) + graph.nodes[r].bytes
    peak, held = 0, 0
    for k in reversed(span):
        held += ending.get(k, 0)
        peak = max(peak, during[k] + held)
    return peak


def _stage(graph: Graph, stage_of, s: int, inp, link, reads: frozenset[int], excluded, sweep_fixed: int,
           backward_peak: int) -> Stage:
    """One stage's sizes, walks and costs."""
    nodes = graph.nodes
    mine = {i for i, t in stage_of.items() if t == s and i not in graph.aliases and i not in excluded}
    forward = sorted(i for i in mine if i in graph.forward_required)
    with_reads = sorted(set(forward) | (reads & graph.backward_only))
    linked = reads | ({link} if link is not None else set())
    outside = excluded | ({graph.roots[inp]} if inp is not None else set())

    def again(wanted) -> list[int]:  # what recomputing `wanted` from the stage's input computes
        return sorted(graph.ancestors(wanted) & mine)

    def walk(order, kept, first: bool) -> int:
        return _walk(graph, order, kept, outside if first else excluded, None if first else inp)

    to_link, to_all, to_last = again([link] if link is not None else []), again(linked), again(reads)
    return Stage(
        link=link, reads=reads,
        link_bytes=nodes[link].bytes if link is not None else 0,
        kept_bytes=sum(nodes[r].bytes for r in {graph.roots[i] for i in linked} - outside),
        sweep_fixed=sweep_fixed, backward_peak=backward_peak,
        ck=(walk(to_link, {link}, True), walk(to_link, {link}, False)),
        ck_forward=(walk(forward, {link}, True), walk(forward, {link}, False)),
        all=walk(to_all, linked, True), all_forward=walk(with_reads, linked, True), last=walk(to_last, reads, True),
        ck_cost=_cost(graph, to_link), all_cost=_cost(graph, to_all), last_cost=_cost(graph, to_last),
    )


def _cost(graph: Graph, order: Iterable[int]) -> float:
    return sum(graph.nodes[i].cost for i in order)


def _walk(graph: Graph, order: list[int], kept, excluded, start: int | None) -> int:
    """The most bytes while ``order`` runs, each value freed after its last read in it unless
    ``kept``, storage in ``excluded`` not counted; ``start``: a value alive as it begins."""
    nodes = graph.nodes
    memory = LiveBytes(graph)
    pos = {i: k for k, i in enumerate(order)}
    last = last_uses(graph.through_aliases(nodes[i].inputs) for i in order)
    for i in order:  # a multi-output op's outputs live as long as its tuple
        if i in graph.tuple_items and nodes[i].inputs[0] in last:
            last[i] = max(last.get(i, pos[i]), last[nodes[i].inputs[0]])
    dying: dict[int, list[int]] = {}
    for i in [*order, *([start] if start is not None and start in last else [])]:
        if i not in kept:
            dying.setdefault(last.get(i, pos.get(i)), []).append(i)

    def key(i: int):
        r = graph.roots[i]
        return None if r in excluded else (r, 0)

    if start is not None and start in last and key(start):
        memory.hold(key(start))
    peak = 0
    for k, i in enumerate(order):
        if key(i):
            memory.hold(key(i))
        peak = max(peak, memory.bytes + nodes[i].workspace)
        for j in dying.get(k, ()):
            if key(j):
                memory.release(key(j))
    return peak


# ---------------------------------------------------------------- the dynamic programs

Option = tuple["str | int", int, float, tuple[tuple[int, int, int], ...]]  # choice, need, cost, calls


def _options(chain: Chain, s: int, t: int) -> Iterator[Option]:
    """The ways to run stages s..t: (choice, bytes the sweep or the backward needs, recompute
    cost, sub-calls (s', t', bytes held for them)). The descent of the whole chain is the forward:
    free, at the forward's fixed part."""
    stages = chain.stages
    forward = t == len(stages) - 1
    fixed = chain.forward_fixed if forward else stages[t].sweep_fixed
    paid = 0.0 if forward else 1.0
    st = stages[s]
    if s == t:
        yield "all", max(fixed + (st.all_forward if forward else st.last), st.backward_peak), paid * st.last_cost, ()
        return
    walk = st.all_forward if forward else st.all
    yield "all", max(fixed + walk, st.backward_peak), paid * st.all_cost, ((s + 1, t, st.kept_bytes),)
    sweep, cost = 0, 0.0
    for e in range(s, t):
        ck = stages[e].ck_forward if forward else stages[e].ck
        sweep = max(sweep, ck[0] if e == s else ck[1])
        cost += stages[e].ck_cost
        yield e, fixed + sweep, paid * cost, ((e + 1, t, stages[e].link_bytes), (s, e, 0))


def _sub_chains(count: int) -> Iterator[tuple[int, int]]:
    for length in range(1, count + 1):
        for s in range(count - length + 1):
            yield s, s + length - 1


def _min_peak_tree(chain: Chain) -> Tree:
    """The decisions with the lowest peak (then the least recomputation among them)."""
    best: dict[tuple[int, int], tuple[int, float, Tree]] = {}
    for s, t in _sub_chains(len(chain.stages)):
        for choice, need, cost, calls in _options(chain, s, t):
            peak = max([need] + [held + best[(a, b)][0] for a, b, held in calls])
            total = cost + sum(best[(a, b)][1] for a, b, _ in calls)
            if (s, t) not in best or (peak, total) < best[(s, t)][:2]:
                best[(s, t)] = (peak, total, (s, t, choice, tuple(best[(a, b)][2] for a, b, _ in calls)))
    return best[(0, len(chain.stages) - 1)][2]


def _cheapest_tree(chain: Chain, budget: int, slots: int) -> Tree | None:
    """Rotor's DP: the least recomputation with memory ``budget`` (bytes, pinned values aside)
    in ``slots`` slots; None if nothing fits."""
    if budget <= 0:
        return None
    step = math.gcd(*(b for st in chain.stages for b in (st.link_bytes, st.kept_bytes)))
    unit = step if 0 < step and budget // step <= EXACT_SLOTS else budget / slots
    slots = int(budget // unit)
    spare = budget - slots * unit  # with m slots free, m * unit + spare bytes are

    def size(b: int) -> int:
        return max(0, math.ceil(b / unit - 1e-9))

    table: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, list[Option]]] = {}
    for s, t in _sub_chains(len(chain.stages)):
        options = list(_options(chain, s, t))
        best, arg = np.full(slots + 1, np.inf), np.full(slots + 1, -1)
        for k, (_, need, cost, calls) in enumerate(options):
            total = np.full(slots + 1, cost)
            for a, b, held in calls:
                h = size(held)
                shifted = np.full(slots + 1, np.inf)
                if h <= slots:
                    shifted[h:] = table[(a, b)][0][:slots + 1 - h]
                total += shifted
            total[:min(size(need - spare), slots + 1)] = np.inf
            better = total < best
            best, arg = np.where(better, total, best), np.where(better, k, arg)
        table[(s, t)] = (best, arg, options)
    if not np.isfinite(table[(0, len(chain.stages) - 1)][0][slots]):
        return None
    return _tree_at(table, 0, len(chain.stages) - 1, slots, size)


def _tree_at(table, s: int, t: int, m: int, size) -> Tree:
    _, arg, options = table[(s, t)]
    choice, _, _, calls = options[int(arg[m])]
    return s, t, choice, tuple(_tree_at(table, a, b, m - size(held), size) for a, b, held in calls)


def _evaluate(chain: Chain, tree: Tree) -> tuple[int, float]:
    """The peak (bytes, pinned values aside) and recompute cost the model gives a tree."""
    s, t, choice, subs = tree
    for c, need, cost, calls in _options(chain, s, t):
        if c == choice:
            values = [_evaluate(chain, sub) for sub in subs]
            return (max([need] + [held + v[0] for (_, _, held), v in zip(calls, values)]),
                    cost + sum(v[1] for v in values))
    raise AssertionError(f"no option {choice} for stages {s}..{t}")


# ---------------------------------------------------------------- from decisions to a schedule

def tree_actions(tree: Tree, out: list | None = None) -> list:
    """The tree as a sequence: ("ck", e) keep stage e's link, ("all", s, with_link) make s
    (keeping its link to s+1 when the sub-chain goes on), ("B", s) run stage s's backward,
    ("drop", e) let stage e's link go. A choice is "all" or a link e (here), or ("all", plan) or
    ("ck", e) (`fxopt.solvers.block_rotor`'s: its "all" and "B" actions name the plan after s)."""
    out = [] if out is None else out
    s, t, choice, subs = tree
    kind, x = choice if isinstance(choice, tuple) else ("all", None) if choice == "all" else ("ck", choice)
    if kind == "all":
        plan = () if x is None else (x,)
        out.append(("all", s, *plan, s < t))
        if subs:
            tree_actions(subs[0], out)
        out.append(("B", s, *plan))
    else:
        out.append(("ck", x))
        tree_actions(subs[0], out)
        out.append(("drop", x))
        tree_actions(subs[1], out)
    return out


def _schedule(graph: Graph, chain: Chain, tree: Tree) -> Schedule:
    """The schedule for a tree: the actions before the last stage's backward are the forward
    (they give the SAVE set); each later sweep runs just before the first backward node of the
    stage it serves. What a sweep does not provide is recomputed on demand."""
    stages, last = chain.stages, len(chain.stages) - 1
    actions = tree_actions(tree)
    first = actions.index(("B", last))
    saved: set[int] = set()
    for action in actions[:first]:
        saved |= _wanted(stages, action)
    builder = OnDemand(graph, saved)
    queue, current = deque(actions[first + 1:]), last
    for b, stage in zip(graph.backward_nodes, chain.assigned):
        while current > stage and queue:
            action = queue.popleft()
            if action[0] == "B":
                current = action[1]
            elif action[0] == "drop":
                builder.forget([stages[action[1]].link])
            else:
                wanted = _wanted(stages, action)
                builder.recompute(wanted, keep=wanted)
        builder.run(b)
    return prune(graph, Schedule(builder.saved, builder.backward()))


def _wanted(stages: tuple[Stage, ...], action) -> set[int]:
    if action[0] == "ck":
        return {stages[action[1]].link}
    if action[0] == "all":
        st = stages[action[1]]
        return set(st.reads) | ({st.link} if action[2] else set())
    return set()


def min_peak_schedule(graph: Graph, chain: Chain | None = None) -> ChainSchedule | None:
    """The chain schedule with the lowest peak (then the least recomputation); None if the graph
    is no chain."""
    chain = chain or chain_of(graph)
    if chain is None:
        return None
    tree = _min_peak_tree(chain)
    peak, cost = _evaluate(chain, tree)
    return ChainSchedule(_schedule(graph, chain, tree), chain.pinned + peak, cost)


def cheapest_schedule(graph: Graph, budget: int, chain: Chain | None = None,
                      slots: int = SLOTS) -> ChainSchedule | None:
    """The chain schedule with the least recomputation whose predicted peak is within
    ``budget``; None if the graph is no chain or nothing fits."""
    chain = chain or chain_of(graph)
    if chain is None:
        return None
    tree = _cheapest_tree(chain, budget - chain.pinned, slots)
    if tree is None:
        return None
    peak, cost = _evaluate(chain, tree)
    if peak + chain.pinned > budget:  # rounding at the slots' edge: never offer what the model rejects
        return None
    return ChainSchedule(_schedule(graph, chain, tree), chain.pinned + peak, cost)


def chain_candidates(graph: Graph, budget: int) -> list[Candidate]:
    """For `solve`: the lowest-peak chain schedule and the cheapest within ``budget``, simulated
    (at a budget near the lowest peak, the slots' rounding may leave only the first). Where the
    model underestimates (a chain that is not a clean one), the DP runs again with the budget
    lowered by the excess, twice at most."""
    chain = chain_of(graph)
    if chain is None:
        return []
    lowest = min_peak_schedule(graph, chain)
    out: list[Candidate] = [(lowest.schedule, simulate(graph, lowest.schedule))]
    target = budget
    for _ in range(3):
        found = cheapest_schedule(graph, target, chain)
        if found is None:
            break
        timeline = simulate(graph, found.schedule)
        out.append((found.schedule, timeline))
        if timeline.peak_bytes <= budget:
            break
        target -= timeline.peak_bytes - budget
    return out
