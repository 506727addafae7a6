"""Checkmate's rematerialization ILP, specialised to a training step.

Checkmate (Jain et al., MLSys 2020) decides for every stage t and node i whether i is computed in
t (R[t,i]) and whether it is resident entering t (S[t,i]). Here the forward runs once, in order,
and the backward nodes run once, in order; what is decided is which forward values survive the
forward (S[0,i], the SAVE set) and which are recomputed before each backward stage (R[t,i]), as
many times as pays. Stages are the backward nodes that read a forward value; the other backward
nodes only see the residency between stages. This keeps the problem to
|forward values| x |consuming backward nodes| binaries, and much smaller after pruning: R[t,i]
exists only where i is an ancestor of what stage t reads, S[t,i] only until i's last possible use.

Constraints (i, j forward values; t a stage; D_t the forward values stage t reads):
    S[t+1,i] <= S[t,i] + R[t,i]                 a value is resident only if kept or just computed
    S[t,i] + R[t,i] >= 1            i in D_t    what a stage reads is there
    R[t,i] <= S[t,j] + R[t,j]       j input of i
    mem(t) = C_t + sum_i bytes_i (S[t,i] + R[t,i]) <= budget
    forward: F_k + sum_{i saved, no longer needed by the forward at step k} bytes_i <= budget
Views are not variables: a schedule makes a fresh view from its base right before each use.
C_t and F_k are the fixed parts (backward values, tangents; forward values in use). Counting every
value recomputed in stage t as alive at its end over-approximates the generated code, which frees
recomputation intermediates early, so a plan that fits here fits when simulated.

Objective: minimise the cost of recomputation (plus that of computing backward-only values in
the forward when they are saved). With ``minimize_peak`` the budget becomes a variable and the
solve returns the smallest budget this model can reach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import time

import pulp

from fxopt._quiet import silenced
from fxopt.solvers.graph import Graph
from fxopt.solvers.schedule import Schedule, read_before_recompute, with_fresh_aliases


@dataclasses.dataclass(frozen=True)
class IlpResult:
    schedule: Schedule | None
    status: str  # "optimal", "feasible", "infeasible", "timeout"
    objective: float | None
    peak_bound: float | None  # with minimize_peak: the smallest budget found
    seconds: float
    variables: int


def _backward_profile(graph: Graph) -> tuple[list[int], list[int]]:
    """Bytes of backward values and tangents live at each backward node while it runs (and just
    before it allocates), plus what is resident for the whole step (inputs, forward outputs)."""
    nodes = graph.nodes
    bwd = graph.backward_nodes
    pos = {b: k for k, b in enumerate(bwd)}
    last: dict[int, int] = {}
    for k, b in enumerate(bwd):
        for j in nodes[b].inputs:
            if nodes[j].kind == "backward" or nodes[j].tangent:
                last[j] = k
    resident_roots = {graph.roots[i] for i in graph.resident | graph.forward_outputs}
    base = sum(nodes[r].bytes for r in resident_roots)
    refs: dict[int, int] = {}
    live = 0

    def hold(i: int) -> None:
        nonlocal live
        r = graph.roots[i]
        if r in resident_roots:
            return
        if refs.get(r, 0) == 0:
            live += nodes[r].bytes
        refs[r] = refs.get(r, 0) + 1

    def let_go(i: int) -> None:
        nonlocal live
        r = graph.roots[i]
        if r in resident_roots:
            return
        refs[r] -= 1
        if refs[r] == 0:
            live -= nodes[r].bytes

    dying: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        if n.tangent:  # held by the autograd engine for the whole backward
            hold(i)
    for b in bwd:
        if not nodes[b].output:
            dying.setdefault(last.get(b, pos[b]), []).append(b)
    profile, before = [], []
    for k, b in enumerate(bwd):
        before.append(base + live)
        hold(b)
        profile.append(base + live + nodes[b].workspace)
        for j in dying.get(k, ()):
            let_go(j)
    return profile, before


def _forward_profile(graph: Graph, order: list[int]) -> tuple[list[int], dict[int, tuple[int, int]]]:
    """Bytes live at each step of the forward when nothing is saved, and each storage root's
    live interval [first step, last step] in it."""
    nodes = graph.nodes
    pos = {i: k for k, i in enumerate(order)}
    resident_roots = {graph.roots[i] for i in graph.resident}
    end: dict[int, int] = {}
    for k, i in enumerate(order):
        r = graph.roots[i]
        end[r] = max(end.get(r, k), k)
        for j in nodes[i].inputs:
            if j in pos:
                rj = graph.roots[j]
                end[rj] = max(end.get(rj, k), k)
    for i in graph.forward_outputs:
        end[graph.roots[i]] = len(order)
    base = sum(nodes[r].bytes for r in resident_roots)
    start = {graph.roots[i]: pos[i] for i in reversed(order)}
    delta = [0] * (len(order) + 2)
    for r, s in start.items():
        if r in resident_roots:
            continue
        delta[s] += nodes[r].bytes
        delta[end[r] + 1] -= nodes[r].bytes
    profile, live = [], base
    for k in range(len(order)):
        live += delta[k]
        profile.append(live + nodes[order[k]].workspace)
    return profile, {r: (s, end[r]) for r, s in start.items()}


def default_backend() -> str:
    """HiGHS when ``highspy`` is installed (it solves these problems several times faster than
    CBC, see benchmarks/), else CBC, which ships with PuLP."""
    return "highs" if importlib.util.find_spec("highspy") is not None else "cbc"


def _stage_values(graph: Graph, schedule: Schedule, stages: list[int], cset: set[int]):
    """The ILP's R and S variables that describe `schedule` (for a warm start)."""
    nodes = graph.nodes
    bwd = graph.backward_nodes
    stage_pos = {bwd[k]: t for t, k in enumerate(stages)}
    # Instance of each value available before event e, and the last event reading each instance.
    current = {i: (i, 0) for i in schedule.saved}
    last_use: dict[tuple[int, int], int] = {}
    count: dict[int, int] = {}
    starts: list[dict[int, tuple[int, int]]] = []
    seg_start = 0
    r_on: set[tuple[int, int]] = set()
    t = 0
    for e, i in enumerate(schedule.backward):
        if e == seg_start:
            starts.append(dict(current))
        for j in nodes[i].inputs:
            if j in current:
                last_use[current[j]] = e
        if nodes[i].kind == "forward" and i in cset and t < len(stages):
            r_on.add((t, i))
        count[i] = count.get(i, 0) + 1
        current[i] = (i, count[i])
        if i in stage_pos:
            t = stage_pos[i] + 1
            seg_start = e + 1
    s_on: set[tuple[int, int]] = set()
    seg_first = [0]
    for e, i in enumerate(schedule.backward):
        if i in stage_pos:
            seg_first.append(e + 1)
    for t, snapshot in enumerate(starts[: len(stages)]):
        for i, inst in snapshot.items():
            if i in cset and last_use.get(inst, -1) >= seg_first[t]:
                s_on.add((t, i))
    for i in schedule.saved & cset:
        s_on.add((0, i))
    return r_on, s_on


def solve_ilp(
    graph: Graph,
    budget: int | None,
    *,
    time_limit: float = 60.0,
    minimize_peak: bool = False,
    threads: int | None = None,
    backend: str | None = None,
    warm_start: Schedule | None = None,
    verbose: bool = False,
) -> IlpResult:
    """Solve the ILP. ``backend``: "highs" (default when ``highspy`` is installed) or "cbc".
    ``warm_start``: a schedule to start from (ignored by the solver if it breaks a constraint)."""
    t0 = time.perf_counter()
    nodes = graph.nodes
    cands = sorted(graph.needed_by_backward - graph.free - graph.aliases)
    cset = set(cands)
    saveable = graph.saveable
    bwd = graph.backward_nodes
    stages = [k for k, b in enumerate(bwd) if graph.through_aliases(nodes[b].inputs) & cset]
    reads = [sorted(graph.through_aliases(nodes[bwd[k]].inputs) & cset) for k in stages]
    T = len(stages)
    anc = [graph.ancestors(d) & cset for d in reads]
    last = {i: -1 for i in cands}
    for t in range(T):
        for i in anc[t]:
            last[i] = max(last[i], t)

    def mem_bytes(i: int) -> int:
        if graph.roots[i] != i:
            return 0
        if not nodes[i].tensor:  # its outputs nobody needs are allocated too
            return nodes[i].bytes + sum(nodes[g].bytes for g in graph.users[i] if g not in cset)
        return nodes[i].bytes

    prob = pulp.LpProblem("fxopt_remat", pulp.LpMinimize)
    S: dict[tuple[int, int], pulp.LpVariable | int] = {}
    R: dict[tuple[int, int], pulp.LpVariable] = {}
    for i in cands:
        if i in saveable:
            S[0, i] = pulp.LpVariable(f"S_0_{i}", cat="Binary")
        else:
            S[0, i] = 0
        if not nodes[i].tensor:
            continue  # a multi-output op's outputs are taken out at once: it is never kept
        for t in range(1, last[i] + 1):
            S[t, i] = pulp.LpVariable(f"S_{t}_{i}", cat="Binary")
    for t in range(T):
        for i in anc[t]:
            if nodes[i].recomputable:
                R[t, i] = pulp.LpVariable(f"R_{t}_{i}", cat="Binary")

    def s(t: int, i: int):
        return S.get((t, i), 0)

    def r(t: int, i: int):
        return R.get((t, i), 0)

    peak = pulp.LpVariable("peak", lowBound=0) if minimize_peak else budget
    for i in cands:
        for t in range(1, last[i] + 1):
            if (t, i) in S:
                prob += S[t, i] <= s(t - 1, i) + r(t - 1, i)
    cand_users = {i: set() for i in cands}
    for i in cands:
        for j in graph.through_aliases(nodes[i].inputs) & cset:
            cand_users[j].add(i)
    for t in range(T):
        for i in reads[t]:
            prob += s(t, i) + r(t, i) >= 1
        # A recomputation is only worth it if something reads it in this stage or it is kept.
        for i in anc[t]:
            if (t, i) in R and i not in reads[t]:
                prob += R[t, i] <= s(t + 1, i) + pulp.lpSum(R[t, u] for u in cand_users[i] if (t, u) in R)
        for i in anc[t]:
            if (t, i) in R:
                for j in graph.through_aliases(nodes[i].inputs) & cset:
                    prob += R[t, i] <= s(t, j) + r(t, j)

    # Memory in the backward.
    profile, before = _backward_profile(graph)
    stage_of = {}
    t = 0
    for k in range(len(bwd)):
        while t < T and stages[t] < k:
            t += 1
        stage_of[k] = t
    for k in range(len(bwd)):
        t = stage_of[k]
        resident = [(mem_bytes(i), s(t, i)) for i in cands if t <= last[i]]
        if not (t < T and stages[t] == k):
            prob += pulp.lpSum(b * v for b, v in resident if b) + profile[k] <= peak
            continue
        # While stage t recomputes: at most everything it recomputes is alive.
        recomputing = [(mem_bytes(i) + nodes[i].workspace, R[t, i]) for i in anc[t] if (t, i) in R]
        prob += pulp.lpSum(b * v for b, v in resident + recomputing if b) + before[k] <= peak
        # While the stage's node runs: what it reads, and recomputed values kept for later
        # (K = R and S[t+1]); recomputation intermediates are dead by then.
        running = []
        for i in anc[t]:
            if (t, i) not in R or not mem_bytes(i):
                continue
            if i in reads[t]:
                running.append((mem_bytes(i), R[t, i]))
                continue
            if not isinstance(s(t + 1, i), pulp.LpVariable):
                continue  # not kept past this stage: freed before the stage's node runs
            kept = pulp.LpVariable(f"K_{t}_{i}", lowBound=0)
            prob += kept >= R[t, i] + S[t + 1, i] - 1
            running.append((mem_bytes(i), kept))
        prob += pulp.lpSum(b * v for b, v in resident + running if b) + profile[k] <= peak
    # Tangents and every saved value, as the backward starts.
    tangent_bytes = sum(nodes[i].bytes for i, n in enumerate(nodes) if n.tangent)
    resident_roots = {graph.roots[i] for i in graph.resident | graph.forward_outputs}
    prob += (
        pulp.lpSum(mem_bytes(i) * s(0, i) for i in cands if mem_bytes(i))
        + sum(nodes[x].bytes for x in resident_roots) + tangent_bytes
        <= peak
    )

    # Memory in the forward.
    order = sorted(graph.forward_required | (saveable & graph.backward_only))
    fprofile, interval = _forward_profile(graph, [i for i in order if i in graph.forward_required])
    fpos = {i: k for k, i in enumerate(o for o in order if o in graph.forward_required)}
    steps = sorted(fpos.values())
    for k in steps:
        terms = []
        for i in cands:
            b = mem_bytes(i)
            v = s(0, i)
            if not b or isinstance(v, int) and v == 0:
                continue
            if i in fpos:
                lo, hi = interval[i]
                if lo <= k and k > hi:
                    terms.append((b, s(0, i)))
            else:  # backward-only value computed in the forward if saved: alive from its inputs on
                born = max((fpos[j] for j in nodes[i].inputs if j in fpos), default=0)
                if born <= k:
                    terms.append((b, s(0, i)))
        prob += pulp.lpSum(b * v for b, v in terms) + fprofile[k] <= peak

    cost = pulp.lpSum(nodes[i].cost * v for (t, i), v in R.items())
    cost += pulp.lpSum(nodes[i].cost * s(0, i) for i in cands if i in graph.backward_only)
    if minimize_peak:
        prob += peak + 1e-9 * cost
    else:
        prob += cost

    nvars = len(R) + sum(isinstance(v, pulp.LpVariable) for v in S.values())
    if warm_start is not None:
        r_start, s_start = _stage_values(graph, warm_start, stages, cset)
        for key, var in R.items():
            var.setInitialValue(1 if key in r_start else 0)
        for key, var in S.items():
            if isinstance(var, pulp.LpVariable):
                var.setInitialValue(1 if key in s_start else 0)
    backend = backend or default_backend()
    if backend == "highs":
        solver = pulp.HiGHS(msg=verbose, timeLimit=time_limit, warmStart=warm_start is not None,
                            threads=threads)
    elif backend == "cbc":
        solver = pulp.PULP_CBC_CMD(msg=verbose, timeLimit=max(1, int(time_limit)), threads=threads,
                                   warmStart=warm_start is not None)
    else:
        raise ValueError(f"unknown ILP backend {backend!r}; use 'highs' or 'cbc'")
    # HiGHS prints a banner from C++ whatever its options say.
    with contextlib.nullcontext() if verbose else silenced(1):
        prob.solve(solver)
    seconds = time.perf_counter() - t0
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        status = "infeasible" if prob.status == pulp.LpStatusInfeasible else "timeout"
        return IlpResult(None, status, None, None, seconds, nvars)

    def val(v) -> int:
        return int(round(pulp.value(v))) if isinstance(v, pulp.LpVariable) else int(v)

    saved = {i for i in cands if val(s(0, i))} | (graph.needed_by_backward & graph.free)
    events: list[int] = []
    done = 0
    for t, k in enumerate(stages):
        events.extend(bwd[done:k])
        events.extend(sorted(i for i in anc[t] if (t, i) in R and val(R[t, i])))
        events.append(bwd[k])
        done = k + 1
    events.extend(bwd[done:])
    status = "optimal" if prob.sol_status == pulp.LpSolutionOptimal else "feasible"
    events = with_fresh_aliases(graph, events)
    saved = (saved & read_before_recompute(graph, events)) | (graph.needed_by_backward & graph.free)
    return IlpResult(
        Schedule(frozenset(saved), events),
        status,
        pulp.value(prob.objective),
        pulp.value(peak) if minimize_peak else None,
        seconds,
        nvars,
    )
