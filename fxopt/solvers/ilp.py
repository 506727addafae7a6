"""Checkmate's rematerialization ILP, specialised to a training step and pruned to scale.

Checkmate (Jain et al., MLSys 2020) decides for every stage t and node i whether i is computed in
t (R[t,i]) and whether it is resident entering t (S[t,i]). Here the forward runs once, in order,
and the backward nodes run once, in order; what is decided is which forward values survive the
forward (S0[i], the SAVE set) and which are recomputed before each backward stage (R[t,i]), as
many times as pays. Stages are the backward nodes that read a forward value; the other backward
nodes only see the residency between stages.

Constraints (i, j forward values; t a stage; D_t the forward values stage t reads):
    S[t+1,i] <= S[t,i] + R[t,i]                 a value is resident only if kept or just computed
    S[t,i] + R[t,i] >= 1            i in D_t    what a stage reads is there
    R[t,i] <= S[t,j] + R[t,j]       j input of i
    R[t,i] <= S[t+1,i] + sum_u R[t,u]           a recomputation is read (u: users of i) or kept
    mem(t) = C_t + sum_i bytes_i (S[t,i] + R[t,i]) <= budget
    forward: F_k + sum_{i saved, no longer needed by the forward at step k} bytes_i <= budget
    Z[i] <= S0[i]                               COMPRESS only what is SAVEd (and no value a
                                                backward-only value reads: see add_variables)
A compressed value (Z[i] = 1) counts its compressed size instead of its own from the step after
its last forward use until its first possible backward stage (and both while being encoded or
decoded); until then no stage reads it or makes it again (a recomputed copy would replace the
encoded one, at full size). Encoding plus decoding cost is added to the objective.

OFFLOAD (on a graph with transfers): O[i] <= S0[i], not with Z[i], for a value whose copies fit
in a fixed window (`_offload_windows`: out after its last forward use and done by a release step;
back from a reload stage, done before the first stage that reads it). Between release and reload
it counts no bytes; before its first reading stage nothing reads it or makes it again. Each
channel serves one copy at a time in issue order, so i's copy is done by its deadline when, for
every OFFLOADed j issued no later than i, the copies from j's to i's fit between j's issue and i's
deadline (`add_channel_rows`; a big-M term lifts the rows of a value not offloaded). The clocks
count every node once and nothing else, less than any plan takes, so no copy of a plan the ILP
returns stalls, and OFFLOAD costs nothing in the objective.

What keeps it small enough to solve in seconds for thousands of nodes:
  - Views are not variables: a schedule makes a fresh view from its base right before each use.
  - R[t,i] exists only where i is needed to make what stage t reads, through recomputable values
    (a random op's output is SAVEd, so recomputation never reaches behind it).
  - S[t,i] is a variable only between the first and last stage that can use i. Before its first
    use, a value is resident exactly when it was SAVEd: dropping a saved value before its first
    use only to recompute it later is never better than not saving it.
  - Memory sums share terms through running totals (continuous variables) instead of repeating
    every saved value in every stage's row, and backward nodes between two stages share a row.
  - Bytes are counted in units of a power of two and costs are normalised, so the coefficients
    stay within a few orders of magnitude (HiGHS calls a budget of 4e9 bytes "badly scaled" and
    may then declare feasible problems infeasible).
C_t and F_k are the fixed parts (backward values, tangents; forward values in use), counted by
`fxopt.solvers.liveness`'s backward and forward profiles, as the simulator counts. While stage t
recomputes, everything resident and everything it recomputes is counted alive at once (the code
frees recomputation intermediates earlier); while its node runs, only what it reads and what stays
resident for stage t + 1. Both over-approximate the generated code, so a plan that fits here fits
when simulated.

Objective: minimise the cost of recomputation (plus that of computing backward-only values in
the forward when they are saved). With ``minimize_peak`` the budget becomes a variable and the
solve returns the smallest budget this model can reach.

The lower bounds it proves (LP relaxation, branch-and-bound) hold within this model only: the
window and the conservative memory accounting exclude schedules the simulator accepts, which may
be cheaper. `fxopt.solvers.instant` proves bounds valid for every schedule. The LP relaxation is
weak on deep models: a value may be rebuilt a fraction at a time, stage after stage, from the
same fractionally saved input (on a 12-layer GPT-2 at half its eager peak: LP bound 0.90 s,
HiGHS's branch-and-bound 2.47 s after 420 s, best plan 3.74 s).
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable

from fxopt.solvers.effort import Deadline, Effort, effort_of
from fxopt.solvers.gap import gap
from fxopt.solvers.graph import Graph
from fxopt.solvers.liveness import Profile, backward_profile, forward_profile
from fxopt.solvers.mip import Mip, Progress, byte_unit, cost_scale_for, default_mip_solver, solve_mip
from fxopt.solvers.schedule import OnDemand, Schedule, prune, read_before_recompute, with_fresh_aliases

__all__ = ["IlpResult", "RematIlp", "build_ilp", "solve_ilp", "default_mip_solver"]


@dataclasses.dataclass(frozen=True)
class IlpResult:
    schedule: Schedule | None
    status: str  # "optimal", "feasible", "infeasible", "stopped" (no solution within the limits)
    objective: float | None  # recompute cost of the solution in the ILP's model
    peak_bound: float | None  # with minimize_peak: the smallest budget found
    seconds: float
    variables: int
    lower_bound: float | None = None  # proven lower bound on the recompute cost (this model)
    interrupted: bool = False
    limit: str | None = None  # what stopped it short of its gap: "work" or "time" (`MipResult.limit`)


@dataclasses.dataclass
class RematIlp:
    """The ILP of one (graph, budget) and where each decision lives in it."""

    graph: Graph
    mip: Mip
    cands: list[int]
    stages: list[int]  # backward positions of the stages
    anc: list[set[int]]  # values that may be recomputed in each stage
    first: dict[int, int]
    last: dict[int, int]
    S0: dict[int, int]  # value -> column
    S: dict[tuple[int, int], int]  # (stage, value) -> column, for first < stage <= last
    Z: dict[int, int]  # value -> column: COMPRESSed
    R: dict[tuple[int, int], int]
    aux: list[tuple[int, list[tuple[int, float]]]]  # running totals: column = sum of terms
    peak: int | None  # column of the peak with minimize_peak
    unit: int
    cost_scale: float
    cost_offset: float  # cost of backward-only values, paid once whatever the plan
    window: int = 0  # how many values back from a stage's reads recomputation may reach
    O: dict[int, int] = dataclasses.field(default_factory=dict)  # value -> column: OFFLOADed
    reload_stage: dict[int, int] = dataclasses.field(default_factory=dict)  # OFFLOADed value -> stage reloaded at

    def resident(self, t: int, i: int) -> int | None:
        """The column of "i is resident entering stage t" (S0 up to its first stage; None where
        it cannot be)."""
        if i not in self.first or t > self.last[i]:
            return None
        if t <= self.first[i]:
            return self.S0.get(i)
        return self.S.get((t, i))

    def recompute_cost(self, objective: float) -> float:
        """The model's objective in the cost model's seconds (what any plan pays, ``cost_offset``,
        is taken out of it as the MIP's constant offset, so that the solver's relative gap is on
        the recompute cost alone)."""
        return objective / self.cost_scale

    def values_of(self, schedule: Schedule, budget: int | None) -> list[float]:
        """Column values describing `schedule` (a warm start)."""
        r_on, s_on = _stage_values(self.graph, schedule, self.stages, set(self.cands))
        read = read_before_recompute(self.graph, schedule.backward)  # the rest dies as the backward starts
        x = [0.0] * self.mip.num_vars
        for i, col in self.S0.items():
            x[col] = 1.0 if i in read and ((0, i) in s_on or i in schedule.saved) else 0.0
        for key, col in self.S.items():
            x[col] = 1.0 if key in s_on else 0.0
        for key, col in self.R.items():
            x[col] = 1.0 if key in r_on else 0.0
        for i, col in self.Z.items():
            x[col] = 1.0 if i in schedule.compressed and x[self.S0[i]] > 0.5 else 0.0
        for col, terms in self.aux:
            x[col] = sum(a * x[j] for j, a in terms)
        if self.peak is not None and budget is not None:
            x[self.peak] = budget / self.unit
        return x

    def schedule_of(self, x) -> Schedule:
        graph = self.graph
        bwd = graph.backward_nodes
        on = lambda col: col is not None and x[col] > 0.5  # noqa: E731
        saved = {i for i, col in self.S0.items() if on(col)} | (graph.needed_by_backward & graph.free)
        events: list[int] = []
        done = 0
        for t, k in enumerate(self.stages):
            events.extend(bwd[done:k])
            events.extend(sorted(i for i in self.anc[t] if on(self.R.get((t, i)))))
            events.append(bwd[k])
            done = k + 1
        events.extend(bwd[done:])
        events = with_fresh_aliases(graph, events)
        saved = (saved & read_before_recompute(graph, events)) | (graph.needed_by_backward & graph.free)
        compressed = frozenset(i for i, col in self.Z.items() if on(col)) & saved
        schedule = prune(graph, Schedule(frozenset(saved), events, compressed))
        offloaded = frozenset(i for i, col in self.O.items() if on(col)) & schedule.saved
        return dataclasses.replace(schedule, offloaded=offloaded,
                                   reload_at=self.reload_points(schedule.backward, offloaded))

    def reload_points(self, events: tuple[int, ...], offloaded) -> tuple[tuple[int, int], ...]:
        """Where the model reloads each OFFLOADed value: as stage ``reload_stage`` begins, right
        after the previous stage's node (the backward's start for stage 0)."""
        bwd = self.graph.backward_nodes
        position = {i: e for e, i in enumerate(events)}
        return tuple(sorted((i, 0 if (p := self.reload_stage[i]) == 0 else position[bwd[self.stages[p - 1]]] + 1)
                            for i in offloaded))


# Recomputation variables the ILP may have before its window narrows (see `build_ilp`).
MAX_RECOMPUTE_VARS = 8_000


def build_ilp(graph: Graph, budget: int | None, *, minimize_peak: bool = False,
              max_recompute_vars: int = MAX_RECOMPUTE_VARS) -> RematIlp:
    """The ILP of the module docstring for ``graph`` within ``budget`` bytes (with
    ``minimize_peak``, the smallest budget instead)."""
    builder = _Builder(graph, _Scope.of(graph, max_recompute_vars), budget, minimize_peak)
    builder.add_variables()
    builder.add_residency_rows()
    builder.add_backward_memory_rows()
    builder.add_forward_memory_rows()
    builder.add_channel_rows()
    return builder.ilp


# How much longer than its own copy a value's window must be for the ILP to offer OFFLOAD (the
# rest is room for the copies queued before it on the same channel).
WINDOW_SLACK = 2.0


@dataclasses.dataclass(frozen=True)
class _Window:
    """When an OFFLOADed value travels, in the ILP's model: issued after its last forward use
    (``issued``, forward seconds), off the device from forward step ``release`` (its copy done by
    then: ``release_at`` seconds; ``release`` = the number of forward steps: by the backward's
    start), reloaded as backward stage ``reload`` begins (``reload_issued`` backward seconds), back
    before stage ``first`` can read it (``needed``)."""

    issued: float
    release: int
    release_at: float
    d2h: float  # seconds of its copy out
    reload: int
    reload_issued: float
    needed: float
    h2d: float  # seconds of its copy back


def _first_reads(scope: _Scope, values) -> dict[int, int]:
    """The first stage that reads each value itself (not through a recomputation)."""
    return {i: next((t for t in range(scope.first[i], len(scope.stages)) if i in scope.reads[t]), scope.first[i])
            for i in values}


def _offload_windows(graph: Graph, scope: _Scope, order: list[int], lifetimes: dict[int, tuple[int, int]],
                     values) -> dict[int, _Window]:
    """The window of each value in ``values`` that has one: the earliest forward step by which
    its copy out has had `WINDOW_SLACK` times its own time (by the backward's start at the
    latest), and the latest stage whose start leaves as much before the first stage that reads
    it (`_first_reads`) for its copy back; nothing may read it or make it again before then. The clocks count each forward node once and the backward's own nodes only: every plan
    takes at least that long (recomputation only adds time), so copies that fit them fit."""
    nodes, transfers = graph.nodes, graph.transfers
    clock = [0.0]
    for i in order:
        clock.append(clock[-1] + nodes[i].cost)
    bclock = [0.0]
    for b in graph.backward_nodes:
        bclock.append(bclock[-1] + nodes[b].cost)
    starts = [0.0] + [bclock[k + 1] for k in scope.stages]  # stage t begins after stage t - 1's node
    fpos = {i: k for k, i in enumerate(order)}
    values = [i for i in values if i in fpos and i in scope.first and lifetimes[i][1] < len(order)]
    first_read = _first_reads(scope, values)
    out: dict[int, _Window] = {}
    for i in values:
        d2h, h2d = transfers.d2h_seconds(nodes[i].bytes), transfers.h2d_seconds(nodes[i].bytes)
        issued = clock[lifetimes[i][1] + 1]
        release = next((f for f in range(lifetimes[i][1] + 1, len(order) + 1)
                        if clock[f] - issued >= WINDOW_SLACK * d2h), len(order))
        first = first_read[i]
        needed = bclock[scope.stages[first]]
        reload = max((p for p in range(first + 1) if needed - starts[p] >= WINDOW_SLACK * h2d), default=0)
        if clock[release] - issued < d2h or needed - starts[reload] < h2d:
            continue  # its copies cannot hide even alone
        out[i] = _Window(issued, release, clock[release], d2h, reload, starts[reload], needed, h2d)
    return out


@dataclasses.dataclass
class _Scope:
    """What the ILP decides on: the candidates (forward values the backward needs, less free values
    and views), the stages, and which values each stage may recompute."""

    cands: list[int]
    deps: dict[int, frozenset[int]]  # candidate -> the candidates it is made from
    stages: list[int]  # backward positions of the stages
    reads: list[list[int]]  # candidates each stage reads
    anc: list[set[int]]  # candidates each stage may recompute (or read)
    lowest: list[int]  # each stage's window starts at this rank
    window: int
    first: dict[int, int]  # candidate -> first stage that may use it
    last: dict[int, int]

    @classmethod
    def of(cls, graph: Graph, max_recompute_vars: int) -> _Scope:
        nodes = graph.nodes
        cands = sorted(graph.needed_by_backward - graph.free - graph.aliases)
        cset = set(cands)
        bwd = graph.backward_nodes
        deps = {i: graph.through_aliases(nodes[i].inputs) & cset for i in cands}
        stages = [k for k, b in enumerate(bwd) if graph.through_aliases(nodes[b].inputs) & cset]
        reads = [sorted(graph.through_aliases(nodes[bwd[k]].inputs) & cset) for k in stages]
        rank = {i: k for k, i in enumerate(cands)}

        def needed_for(seeds, lowest: int) -> set[int]:
            # What must be there to make `seeds`: recomputation stops at values it cannot recompute
            # and at values more than `window` values before the earliest seed.
            out: set[int] = set()
            stack = list(seeds)
            while stack:
                i = stack.pop()
                if i in out:
                    continue
                out.add(i)
                if nodes[i].recomputable and rank[i] >= lowest:
                    stack.extend(deps[i])
            return out

        def with_siblings(values: set[int]) -> set[int]:
            # A multi-output op makes all its outputs at once: recomputing it for one output also
            # recomputes the others, which may then be kept for later stages.
            out = set(values)
            for i in values:
                if not nodes[i].tensor and nodes[i].recomputable:
                    out.update(u for u in graph.users[i] if u in cset)
            return out

        def ancestors(window: int) -> list[set[int]]:
            return [with_siblings(needed_for(d, min(rank[i] for i in d) - window)) for d in reads]

        # Recomputing a value far upstream of where the backward reads (another transformer layer's
        # internals, say) is rarely worth its cost; letting the ILP consider every such chain makes it
        # quadratic in the depth of the model. Narrow the window until the problem has at most
        # `max_recompute_vars` recomputation variables; the window is part of the model (and so of
        # the bound the solve proves).
        window = len(cands)
        anc = ancestors(window)
        while sum(len(a) for a in anc) > max_recompute_vars and window > 8:
            window = int(window * 0.7)
            anc = ancestors(window)
        lowest = [min(rank[i] for i in d) - window for d in reads]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for t in range(len(stages)):
            for i in anc[t]:
                first.setdefault(i, t)
                last[i] = t
        return cls(cands, deps, stages, reads, anc, lowest, window, first, last)


class _MemoryRows:
    """`_Builder`'s memory rows: between stages, while each stage recomputes and while its node
    runs, as the backward starts, and in the forward (running totals share their terms)."""

    def running_total(self, name: str, parts: list[tuple[int, float]], previous: int | None) -> int:
        """A continuous column equal to sum(parts) + previous (shared terms for later rows)."""
        col = self.m.var(name)
        parts = parts + ([(previous, 1.0)] if previous is not None else [])
        self.m.row([(col, 1.0)] + [(j, -a) for j, a in parts], lower=0.0, upper=0.0)
        self.ilp.aux.append((col, parts))
        return col

    def add_backward_memory_rows(self) -> None:
        """Memory between stages, while each stage recomputes, while its node runs, and as the
        backward starts."""
        graph, ilp, sc, mb, zb = self.graph, self.ilp, self.scope, self.mb, self.zb
        T, fr = self.T, self.fr
        # P[t]: SAVEd values not yet used by stage t (running total).
        waiting: list[int | None] = [None] * (T + 1)
        for t in range(T - 1, -1, -1):
            fresh = [(ilp.S0[i], mb[i]) for i in sc.cands if sc.first.get(i) == t and i in ilp.S0 and mb[i]]
            # Compressed until decoded for stage first[i]: smaller in every earlier total.
            fresh += [(col, zb[i] - mb[i]) for i, col in ilp.Z.items() if min(sc.first[i], fr[i] - 1) == t]
            # OFFLOADed: off the device until the stage its reload is issued at.
            fresh += [(col, -mb[i]) for i, col in ilp.O.items()
                      if ilp.reload_stage[i] >= 1 and min(sc.first[i], ilp.reload_stage[i] - 1) == t and mb[i]]
            if waiting[t + 1] is not None or fresh:
                waiting[t] = self.running_total(f"P_{t}", fresh, waiting[t + 1])
        in_window: list[list[tuple[int, float]]] = [[] for _ in range(T + 1)]
        for (t, i), col in ilp.S.items():
            if mb[i]:
                in_window[t].append((col, mb[i]))
                if i in ilp.Z and t < fr[i]:
                    in_window[t].append((ilp.Z[i], zb[i] - mb[i]))
                if i in ilp.O and t < ilp.reload_stage[i]:
                    in_window[t].append((ilp.O[i], -mb[i]))

        def resident(t: int) -> list[tuple[int, float]]:
            return in_window[t] + ([(waiting[t], 1.0)] if waiting[t] is not None else [])

        fixed = backward_profile(graph)
        bounds = [-1] + sc.stages + [len(graph.backward_nodes)]
        for t in range(T + 1):
            between = range(bounds[t] + 1, bounds[t + 1])
            if between:
                self.within(max(fixed.during[k] for k in between), resident(t) if t < T else [])
            if t < T:
                self.add_stage_rows(t, fixed, resident)
        # Tangents and every saved value, as the backward starts.
        self.within(fixed.start, [(waiting[0], 1.0)] if waiting[0] is not None else [])

    def add_stage_rows(self, t: int, fixed: Profile, resident) -> None:
        nodes, ilp, sc, mb, zb, zw, fr = self.nodes, self.ilp, self.scope, self.mb, self.zb, self.zw, self.fr
        k = sc.stages[t]

        def outputs_of(i: int) -> float:
            if nodes[i].tensor:
                return 0.0
            return sum(mb[g] for g in self.graph.users[i] if g in self.cset and nodes[g].kind == "forward")

        # While stage t recomputes: at most everything it recomputes is alive.
        # A multi-output op allocates all its outputs at once (the schedule takes them all out
        # right after it), needed here or not: count them with the op, on top of their own R.
        recomputing = [(ilp.R[t, i], mb[i] + nodes[i].workspace / self.unit + outputs_of(i)) for i in sc.anc[t]
                       if (t, i) in ilp.R]
        recomputing += [(col, zb[i] + zw[i]) for i, col in ilp.Z.items() if fr[i] == t]  # decoding
        self.within(fixed.before[k], resident(t) + [(c, a) for c, a in recomputing if a])
        # While the stage's node runs: what it reads, and what is kept for later stages (resident
        # entering stage t + 1, whether it was kept from before or recomputed here); everything
        # else was last used by a recomputation in this stage, or earlier, and is freed by then.
        running = list(resident(t + 1))
        running += [(col, zb[i] - mb[i]) for i, col in ilp.Z.items() if fr[i] == t + 1]  # not decoded yet
        for i in sc.reads[t]:
            if not mb[i]:
                continue
            running += [(c, a) for c, a in ((self.resident(t, i), mb[i]), (self.recomputed(t, i), mb[i]))
                        if c is not None]
            if (t + 1, i) in ilp.S:  # read here and kept: counted once
                running.append((ilp.S[t + 1, i], -mb[i]))
        self.within(fixed.during[k], running)

    def add_forward_memory_rows(self) -> None:
        """Memory in the forward: a SAVEd value stays alive from the end of its forward life (or, if
        only the backward needs it, from when it is computed, keeping its inputs alive until then);
        an OFFLOADed one until its window's release step."""
        order, fixed = self.order, self.forward
        from_step, spans = self.saved_in_forward(order, fixed.lifetimes)
        for i, col in self.ilp.O.items():
            if self.windows[i].release < len(order) and self.mb[i]:
                from_step.setdefault(self.windows[i].release, []).append((col, -self.mb[i]))
        n_steps = len(order)
        cuts = sorted({0} | set(from_step) | {a for a, _, _, _ in spans} | {b + 1 for _, b, _, _ in spans})
        cuts = [c for c in cuts if c < n_steps] + [n_steps]
        total: int | None = None
        for g in range(len(cuts) - 1):
            lo, hi = cuts[g], cuts[g + 1]
            fresh = from_step.get(lo, [])  # every key of from_step is a cut point
            if fresh:
                total = self.running_total(f"E_{lo}", fresh, total)
            extra = [(c, a) for a_lo, a_hi, c, a in spans if a_lo <= lo and hi - 1 <= a_hi]
            self.within(max(fixed.during[lo:hi]), ([(total, 1.0)] if total is not None else []) + extra)

    def saved_in_forward(self, order: list[int], interval: dict[int, tuple[int, int]]):
        """The SAVE decisions' bytes in the forward: terms alive from a step to the end
        (``from_step``), and terms alive over a span of steps (first, last, column, units)."""
        graph, nodes, ilp, mb, zb, zw = self.graph, self.nodes, self.ilp, self.mb, self.zb, self.zw
        fpos = {i: k for k, i in enumerate(order)}
        n_steps = len(order)
        from_step: dict[int, list[tuple[int, float]]] = {}
        spans: list[tuple[int, int, int, float]] = []
        for i, col in ilp.S0.items():
            if not mb[i]:
                continue
            if i in fpos:
                start = interval[i][1] + 1
                if i in ilp.Z:  # encoded at its last forward step: from then on, compressed instead
                    from_step.setdefault(interval[i][1], []).append((ilp.Z[i], zb[i]))
                    spans.append((interval[i][1], interval[i][1], ilp.Z[i], zw[i]))
                    if start < n_steps:
                        from_step.setdefault(start, []).append((ilp.Z[i], -mb[i]))
            else:  # backward-only: computed in the forward after every forward_required node before it
                start = sum(1 for j in order if j < i)
                if i in ilp.Z:  # encoded as soon as it is made (both alive for that step)
                    at = min(start, n_steps - 1)
                    spans.append((at, at, ilp.Z[i], mb[i] + zw[i]))
                    if start < n_steps:
                        from_step.setdefault(start, []).append((ilp.Z[i], zb[i] - mb[i]))
                for j in graph.through_aliases(nodes[i].inputs):
                    rj = graph.roots[j]
                    if rj in interval and interval[rj][1] < start and rj not in graph.resident:
                        spans.append((interval[rj][1] + 1, min(start, n_steps - 1), col, nodes[rj].bytes / self.unit))
            if start < n_steps:
                from_step.setdefault(start, []).append((col, mb[i]))
        return from_step, spans


class _ChannelRows:
    """`_Builder`'s rows for OFFLOAD's copy channels, and the host memory they fill."""

    def add_channel_rows(self) -> None:
        """Each channel serves its copies one at a time, in the order issued: the copy of OFFLOADed
        value i completes by its window's deadline if, for every OFFLOADed j issued no later than
        i, the copies from j's to i's fit between j's issue and i's deadline,

            sum_{m from j to i} seconds_m O[m]  <=  deadline_i - issued_j + M (1 - O[i])

        (only the rows that can bind are written); and, with a host budget, everything OFFLOADed
        fits in host memory at once."""
        ilp, windows, m = self.ilp, self.windows, self.m
        if not windows:
            return
        d2h = sorted(windows, key=lambda i: (windows[i].issued, i))
        self.queue_rows(d2h, lambda w: w.issued, lambda w: w.release_at, lambda w: w.d2h)
        h2d = sorted(windows, key=lambda i: (windows[i].reload_issued, i))
        self.queue_rows(h2d, lambda w: w.reload_issued, lambda w: w.needed, lambda w: w.h2d)
        host_budget = self.graph.transfers.host_budget
        if host_budget is not None:
            m.row([(col, self.graph.nodes[i].bytes / self.unit) for i, col in ilp.O.items()],
                  upper=host_budget / self.unit)

    def queue_rows(self, queue: list[int], issued, deadline, seconds) -> None:
        """The rows of one channel; ``queue`` in issue order. Copies issued at the same time may
        be served in any order, so each row takes all of them."""
        windows, O = self.windows, self.ilp.O
        total = sum(seconds(windows[i]) for i in queue) or 1.0
        times = [issued(windows[i]) for i in queue]
        cumulative = [0.0]
        for i in queue:
            cumulative.append(cumulative[-1] + seconds(windows[i]))
        starts = sorted({bisect.bisect_left(times, t) for t in times})  # first copy issued at each time
        for i in queue:
            last = bisect.bisect_right(times, issued(windows[i]))  # everything issued no later than i
            for start in starts[:bisect.bisect_right(starts, last - 1)]:
                room = deadline(windows[i]) - times[start]
                if cumulative[last] - cumulative[start] > room:
                    terms = [(O[q], seconds(windows[q]) / total) for q in queue[start:last]]
                    self.m.row(terms + [(O[i], 1.0)], upper=room / total + 1.0)


class _Builder(_MemoryRows, _ChannelRows):
    """`build_ilp`'s phases: the variables, then the rows (residency and recomputation, memory in
    the backward, memory in the forward). Memory is in units of `byte_unit` bytes."""

    def __init__(self, graph: Graph, scope: _Scope, budget: int | None, minimize_peak: bool):
        nodes = graph.nodes
        self.graph, self.nodes, self.scope = graph, nodes, scope
        self.cset = set(scope.cands)
        self.rank = {i: k for k, i in enumerate(scope.cands)}
        self.T = len(scope.stages)
        self.unit = unit = byte_unit(graph)
        self.mb = {i: self.mem_bytes(i) / unit for i in scope.cands}
        self.minimize_peak = minimize_peak
        self.cap = float("inf") if minimize_peak else budget / unit
        self.m = Mip()
        self.ilp = RematIlp(graph, self.m, scope.cands, scope.stages, scope.anc, scope.first, scope.last,
                            {}, {}, {}, {}, [], None, unit, cost_scale_for(nodes[i].cost for i in scope.cands),
                            cost_offset=sum(nodes[i].cost for i in scope.cands if i in graph.backward_only),
                            window=scope.window)
        self.m.offset = -self.ilp.cost_offset * self.ilp.cost_scale
        self.order = sorted(graph.forward_required)
        self.forward = forward_profile(graph, self.order)

    def mem_bytes(self, i: int) -> int:
        graph, nodes = self.graph, self.nodes
        if graph.roots[i] != i:
            return 0
        if not nodes[i].tensor:  # its outputs nobody needs are allocated too
            return nodes[i].bytes + sum(nodes[g].bytes for g in graph.users[i] if g not in self.cset)
        return nodes[i].bytes

    def resident(self, t: int, i: int) -> int | None:
        return self.ilp.resident(t, i)

    def recomputed(self, t: int, i: int) -> int | None:
        """The column of "i is recomputed in stage t" (None where it cannot be)."""
        return self.ilp.R.get((t, i))

    def within(self, fixed_bytes: float, var_terms: list[tuple[int, float]]) -> None:
        """sum(var_terms) + fixed <= budget (or <= peak)."""
        fixed = fixed_bytes / self.unit
        if self.ilp.peak is not None:
            self.m.row(var_terms + [(self.ilp.peak, -1.0)], upper=-fixed)
        else:
            self.m.row(var_terms, upper=self.cap - fixed)

    def add_variables(self) -> None:
        """S0 (SAVE), S (kept into a stage), R (recomputed in a stage), Z (COMPRESS); the peak."""
        graph, nodes, m, ilp, sc = self.graph, self.nodes, self.m, self.ilp, self.scope
        for i in sc.cands:
            if i not in sc.first:
                continue  # needed only through values that are saved anyway
            if i in graph.saveable and nodes[i].tensor:
                cost = nodes[i].cost * ilp.cost_scale if i in graph.backward_only else 0.0
                # A value that cannot be recomputed (random) is SAVEd exactly when something needs it:
                # the constraints below see to that, as it has no R variables.
                ilp.S0[i] = m.binary(f"S0_{nodes[i].name}", cost=cost)
            if nodes[i].tensor:
                for t in range(sc.first[i] + 1, sc.last[i] + 1):
                    ilp.S[t, i] = m.binary(f"S_{t}_{nodes[i].name}")
        for t in range(self.T):
            for i in sorted(sc.anc[t]):
                if nodes[i].recomputable and (self.rank[i] >= sc.lowest[t] or i in sc.reads[t]):
                    ilp.R[t, i] = m.binary(f"R_{t}_{nodes[i].name}", cost=nodes[i].cost * ilp.cost_scale)
        # COMPRESS, where the model knows when the value is encoded: after its last forward use
        # among the nodes every forward runs. A value a backward-only one reads is read later in
        # the forward when that one is SAVEd, and encoded only then (the simulator's order).
        for i in ilp.S0:
            if i in graph.compressible and not any(u in graph.backward_only for u in graph.users[i]):
                ilp.Z[i] = m.binary(f"Z_{nodes[i].name}", cost=nodes[i].codec_cost * ilp.cost_scale)
        # OFFLOAD: O[i] <= S0[i], not with Z[i] (the heuristics combine them), only where the
        # value's copies fit in its window (`_offload_windows`); no cost: the channel rows keep
        # every copy hidden.
        self.windows = _offload_windows(graph, sc, self.order, self.forward.lifetimes,
                                        [i for i in ilp.S0 if i in graph.offloadable]) if graph.offloadable else {}
        for i, window in self.windows.items():
            ilp.O[i] = m.binary(f"O_{nodes[i].name}")
            ilp.reload_stage[i] = window.reload
            m.row([(ilp.O[i], 1.0), (ilp.S0[i], -1.0)] + ([(ilp.Z[i], 1.0)] if i in ilp.Z else []), upper=0.0)
        self.zb = {i: nodes[i].compressed_bytes / self.unit for i in ilp.Z}  # compressed size, in units
        self.zw = {i: nodes[i].codec_workspace / self.unit for i in ilp.Z}  # scratch while encoding or decoding
        # A compressed value is decoded for the first stage that reads it (fr); before that no
        # recomputation may read it (it is still encoded), and it counts its compressed size.
        self.fr = {i: next((t for t in range(sc.first[i], self.T) if i in sc.reads[t]), sc.first[i]) for i in ilp.Z}
        if self.minimize_peak:
            # The peak first; among the lowest-peak plans the cheapest: all recomputation together
            # weighs less than a hundredth of a memory unit.
            total = sum(m.cost) or 1.0
            m.cost = [c * 0.01 / total for c in m.cost]
            ilp.cost_scale *= 0.01 / total
            ilp.peak = m.var("peak", cost=1.0)

    def add_residency_rows(self) -> None:
        """What is resident was kept or just computed; what a stage reads is there; a recomputation
        has its inputs and is read or kept; COMPRESS only what is SAVEd, encoded until first read."""
        m, ilp, sc, s, r = self.m, self.ilp, self.scope, self.resident, self.recomputed
        for i, col in ilp.Z.items():
            m.row([(col, 1.0), (ilp.S0[i], -1.0)], upper=0.0)
            for t in range(sc.first[i] + 1, self.fr[i] + 1):
                if (t, i) in ilp.S:
                    m.row([(col, 1.0), (ilp.S[t, i], -1.0)], upper=0.0)  # kept, encoded, until read
            # Until it is decoded, nothing reads it (it is encoded), and it is not made again: a
            # schedule uses the latest copy of a value, so a recomputed one (or one a recomputed
            # multi-output op takes out with its other outputs) would live uncompressed, where
            # this model counts the encoding.
            makers = {i} | {p for p in self.nodes[i].inputs if not self.nodes[p].tensor}
            for t in range(sc.first[i], self.fr[i]):
                for u in sc.anc[t]:
                    if (t, u) in ilp.R and (i in sc.deps[u] or u in makers):
                        m.row([(col, 1.0), (ilp.R[t, u], 1.0)], upper=1.0)
        first_read = _first_reads(sc, ilp.O)
        for i, col in ilp.O.items():
            # OFFLOADed: kept (on the host, then reloaded) until the first stage that reads it, and
            # until then neither read by a recomputation nor made again (its window's copy back
            # is timed to that stage; a recomputed copy would be where the model counts nothing).
            for t in range(sc.first[i] + 1, first_read[i] + 1):
                if (t, i) in ilp.S:
                    m.row([(col, 1.0), (ilp.S[t, i], -1.0)], upper=0.0)
            makers = {i} | {q for q in self.nodes[i].inputs if not self.nodes[q].tensor}
            for t in range(sc.first[i], first_read[i]):
                for u in sc.anc[t]:
                    if (t, u) in ilp.R and (i in sc.deps[u] or u in makers):
                        m.row([(col, 1.0), (ilp.R[t, u], 1.0)], upper=1.0)
        for (t, i), col in ilp.S.items():
            m.row(_terms((col, 1.0), (s(t - 1, i), -1.0), (r(t - 1, i), -1.0)), upper=0.0)
        users: dict[int, list[int]] = {i: [] for i in sc.cands}
        for i in sc.cands:
            for j in sc.deps[i]:
                users[j].append(i)
        for t in range(self.T):
            for i in sc.reads[t]:
                m.row(_terms((s(t, i), 1.0), (r(t, i), 1.0)), lower=1.0)
            for i in sc.anc[t]:
                col = r(t, i)
                if col is None:
                    continue
                for j in sc.deps[i]:
                    m.row(_terms((col, 1.0), (s(t, j), -1.0), (r(t, j), -1.0)), upper=0.0)
                if i not in sc.reads[t]:
                    m.row(_terms((col, 1.0), (s(t + 1, i), -1.0), *[(r(t, u), -1.0) for u in users[i] if u in sc.anc[t]]),
                          upper=0.0)


def _terms(*pairs):
    return [(col, a) for col, a in pairs if col is not None]


def _with_fixed(mip: Mip, values: dict[int, float]) -> Mip:
    """`mip` with the given columns fixed to the given values (rows shared, not copied)."""
    out = Mip()
    out.__dict__.update(mip.__dict__)
    out.lower = [values.get(j, v) for j, v in enumerate(mip.lower)]
    out.upper = [values.get(j, v) for j, v in enumerate(mip.upper)]
    return out


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
    effort: Effort | float | None = None,
    time_limit: Deadline | float | None = None,
    minimize_peak: bool = False,
    mip_solver: str | None = None,
    warm_start: Schedule | None = None,
    rel_gap: float = 1e-4,
    on_progress: Callable[[Progress], None] | None = None,
    verbose: bool = False,
    model: RematIlp | None = None,
    peak_target: int | None = None,
) -> IlpResult:
    """Solve the ILP within the effort's `ilp_work` and `mip_nodes` nodes
    (``time_limit``: the safety stop, seconds or a `Deadline`). ``mip_solver``: "highs" (default
    when ``highspy`` is installed) or "cbc". ``warm_start``: a schedule to start from (ignored by
    the solver if it breaks a constraint). ``on_progress`` receives `Progress` about once a second
    (HiGHS only), costs in the cost model's seconds of recomputation. ``peak_target`` (with
    ``minimize_peak``, HiGHS): stop once a solution peaks at most this many bytes (known to be
    within reach of the lowest peak)."""
    effort, deadline = effort_of(effort), Deadline.of(time_limit)
    t0 = time.perf_counter()
    ilp = model or build_ilp(graph, budget, minimize_peak=minimize_peak)
    nvars = ilp.mip.num_vars
    start = None
    if warm_start is not None:
        start = ilp.values_of(warm_start, budget)
        if ilp.mip.violations(start):
            # The schedule does something this model cannot say (recomputing beyond the window, or
            # keeping a tuple): fix its SAVE set, complete the rest in a short solve of its own,
            # and start from that. (Handing HiGHS the partial solution instead lets it complete it
            # with a sub-MIP of its own, unbounded: 16 s on a 4-layer GPT-2.)
            saved = warm_start.saved
            fixed = {col: 1.0 if i in saved else 0.0 for i, col in ilp.S0.items()}
            sub = solve_mip(_with_fixed(ilp.mip, fixed), mip_solver=mip_solver, rel_gap=0.05,
                            limits=effort.mip(deadline, effort.ilp_work // 4, ilp.mip.num_integer, sub_mips=False))
            start = list(sub.x) if sub.x is not None else None

    def report(p: Progress) -> None:
        if on_progress is None or minimize_peak:
            return
        incumbent = None if p.incumbent is None else ilp.recompute_cost(p.incumbent)
        bound = None if p.bound is None else max(0.0, ilp.recompute_cost(p.bound))
        on_progress(Progress(incumbent, bound, gap(incumbent, bound), p.seconds))

    target = peak_target / ilp.unit if minimize_peak and peak_target is not None else None
    res = solve_mip(ilp.mip, limits=effort.mip(deadline, effort.ilp_work, ilp.mip.num_integer, sub_mips=False),
                    mip_solver=mip_solver,
                    warm_start=start, rel_gap=rel_gap, on_progress=report, verbose=verbose, target=target)
    if res.limit == "time":
        deadline.stop("ILP")
    seconds = time.perf_counter() - t0
    bound = None if res.bound is None or minimize_peak else max(0.0, ilp.recompute_cost(res.bound))
    if res.x is None:
        return IlpResult(None, res.status, None, None, seconds, nvars, lower_bound=bound,
                         interrupted=res.interrupted, limit=res.limit)
    peak = res.x[ilp.peak] * ilp.unit if minimize_peak else None
    objective = ilp.recompute_cost(res.objective - (res.x[ilp.peak] if minimize_peak else 0.0))
    return IlpResult(ilp.schedule_of(res.x), res.status, objective, peak, seconds, nvars,
                     lower_bound=bound, interrupted=res.interrupted, limit=res.limit)


def lp_bound_and_roundings(graph: Graph, budget: int | None, *, effort: Effort | float | None = None,
                           time_limit: Deadline | float | None = None, mip_solver: str | None = None,
                           model: RematIlp | None = None) -> tuple[float | None, list[Schedule]]:
    """The LP relaxation's lower bound on the recompute cost (None with ``budget=None``, which
    relaxes the lowest-peak problem instead), and schedules rounded from its solution (Checkmate's
    two-phase rounding, with the relaxation's residency as a guide): SAVE what the relaxation
    saves at least a threshold of; before each backward node recompute what is missing; after
    each stage, forget recomputed values the relaxation keeps less than the threshold of."""
    effort, deadline = effort_of(effort), Deadline.of(time_limit)
    ilp = model or build_ilp(graph, budget, minimize_peak=budget is None)
    res = solve_mip(ilp.mip, limits=effort.lp(deadline), mip_solver=mip_solver, relax=True)
    if res.limit == "time":
        deadline.stop("LP relaxation")
    if res.x is None:
        return None, []
    bound = None
    if res.status == "optimal" and budget is not None:
        bound = max(0.0, ilp.recompute_cost(res.objective))
    schedules, seen = [], set()
    # The thresholds, then the least memory of all: save nothing that can be recomputed, and
    # recompute what each stage needs right before it (the plan at the bottom of the trade-off).
    nothing = [0.0] * ilp.mip.num_vars
    for x, threshold in [(res.x, t) for t in (0.5, 0.25, 0.75, 0.1, 0.9, 0.99)] + [(nothing, 0.5)]:
        try:
            schedule = _rounded(ilp, x, threshold)
        except ValueError:
            continue
        key = (schedule.saved, schedule.backward)
        if key not in seen:
            seen.add(key)
            schedules.append(schedule)
    return bound, schedules


def _rounded(ilp: RematIlp, x, threshold: float) -> Schedule:
    graph = ilp.graph
    builder = OnDemand(graph, (i for i, col in ilp.S0.items() if x[col] >= threshold - 1e-9))
    stage_of = {k: t for t, k in enumerate(ilp.stages)}
    for k, b in enumerate(graph.backward_nodes):
        builder.run(b)
        t = stage_of.get(k)
        if t is not None:
            builder.forget([i for i in builder.recomputed
                            if (col := ilp.S.get((t + 1, i))) is None or x[col] < threshold - 1e-9])
    events = builder.backward()
    compressed = frozenset(i for i, col in ilp.Z.items() if i in builder.saved and x[col] >= threshold - 1e-9)
    return prune(graph, Schedule(builder.saved, events, compressed & read_before_recompute(graph, events)))
