"""A lower bound on the recompute cost from the memory at a few instants of the backward, and the
plans it suggests.

While backward node k runs, every schedule holds (as the simulator counts it)

    fixed_k        resident values, forward outputs, tangents, the backward values alive at k and
                   node k's workspace: the same for every schedule, since the backward nodes run
                   once, in order, and are freed after their last use;
  + A_k            the storage of the forward values alive at that instant.

What is alive at k must let the rest of the backward run: every forward value a later backward
node reads is alive at k or computed after k, and what is computed after k is computed from values
alive at k or computed after k. What is alive at k was SAVEd or computed in the backward before k.
Every backward computation of a forward value costs its recompute cost (the first computation of
a value only the backward needs is free, as in the simulator). So, for one or more instants k, the
mixed-integer program

    s_i      SAVE i (saveable values only)              shared by all instants
    n_i      backward computations of i, cost c_i       shared: n_i >= p_ik + r_ik
    a_ik     i alive while node k runs                  a_ik <= s_i + p_ik
    p_ik     i computed in the backward before k        p_ik <= s_j + p_jk   (j an input of i)
    r_ik     i computed after k                         r_ik <= a_jk + r_jk
    k < k'   a_ik' <= a_ik + r_ik,  p_ik <= p_ik' <= p_ik + r_ik,  r_ik' <= r_ik
    needs    read by node k: a_ik = 1; by a node before k: s_i + p_ik >= 1; after k: a_ik + r_ik >= 1
    views    a_ik <= a_(root of i),k                    (a view keeps its base's storage alive)
    memory   fixed_k + sum_i bytes_i a_ik - sum_i (bytes_i - compressed_i) w_ik <= budget
    COMPRESS z_i <= s_i at its codec's cost; w_ik <= a_ik, w_ik <= z_i: a compressed value may
             count its compressed size where it is alive and may still be encoded, i.e. not yet
             read: w_ik = 0 if a backward node up to k reads i, w_ik + p_jk <= 1 for j made
             from i (the simulator decodes it at its first read, so this allows no less)

    OFFLOAD  o_i <= s_i at no cost; v_ik <= a_ik, v_ik <= o_i + z_i (bytes_i - compressed_i) / bytes_i
             for a value that may be OFFLOADed (v replaces w): it may count nothing where it is alive
             and not yet read, like an encoding. At each instant, what OFFLOAD took off the device
             was copied out by then, at the device-to-host bandwidth, within the step's clock so
             far (its compute, recomputations, codecs and the exposed time E; `_add_d2h_row`).
             Otherwise copies are free: the forward's rows free an offloaded value at once, and
             reloads take no time (the simulator frees a value when its copy completes, reloads
             it before the first read and counts the exposed copy time: it allows no less)

    minimise sum_i c_i n_i + sum_i codec_i z_i + E

is a relaxation of the simulator's problem: any schedule within the budget gives a solution of
the same or lower cost (its SAVE set, what is alive at each k, what it computes before and after).
(A value with a codec counts its compressed size, the least it can occupy if SAVEd and
COMPRESSed; codec costs are not counted: both keep it a relaxation where graphs carry codecs.)
With OFFLOAD offered (`Graph.offloadable`) it stays one: a plan's cost is its recompute cost plus
the exposed transfer time, which is never negative, so the bound holds for OFFLOADed plans too, and
so does a proof that no plan fits.
Its optimum, or the branch-and-bound's proven bound, is therefore a lower bound on the recompute
cost of every schedule the simulator accepts within the budget: no window, no conservative memory
accounting, unlike the Checkmate ILP (`fxopt.solvers.ilp`), whose bound holds only in its model.

The same solution suggests a plan: SAVE the s_i, recompute on demand (`on_demand`). Its cost is
the program's when the simulated peak fits; when it does not, the instant where it peaks is added
to the program and the program solved again (a few rounds). Where memory is tight at one instant
(the start of a language model's backward, with the logits and their gradients alive), one or two
instants already give a plan within a fraction of a percent of the bound.
"""

from __future__ import annotations

import dataclasses
import time

from fxopt.solvers.gap import proven
from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import compress_to_fit, offload_to_fit
from fxopt.solvers.liveness import fixed_backward_bytes, forward_profile
from fxopt.solvers.mip import Mip, byte_unit, cost_scale_for, solve_mip
from fxopt.solvers.schedule import (InvalidScheduleError, OnDemand, Schedule, Timeline, must_save, on_demand,
                                    read_before_recompute, save_all_set, simulate)

__all__ = ["InstantResult", "fixed_backward_bytes", "instant_solve"]


@dataclasses.dataclass(frozen=True)
class InstantResult:
    bound: float | None  # proven lower bound on the recompute cost (None: nothing proven)
    plans: tuple[tuple[Schedule, Timeline], ...]  # simulated plans, fitting or not
    instants: tuple[int, ...]  # backward positions modelled in the last round
    seconds: float
    infeasible: bool = False  # proven: no schedule fits the budget


class _Program:
    """The program above for a growing set of instants."""

    def __init__(self, graph: Graph, budget: int, unit: int):
        nodes = graph.nodes
        self.graph, self.budget, self.unit = graph, budget, unit
        bwd = graph.backward_nodes
        self.avail = graph.resident | graph.free | graph.forward_outputs
        self.reads = [[j for j in dict.fromkeys(nodes[b].inputs) if nodes[j].kind == "forward" and j not in self.avail]
                      for b in bwd]
        needs = {j for r in self.reads for j in r}
        self.values = sorted(graph.ancestors(needs) - self.avail)
        self.fixed = fixed_backward_bytes(graph)
        self.cost_scale = cost_scale_for(nodes[i].cost for i in self.values if i not in graph.backward_only)
        self.instants: list[int] = []
        self.order = sorted(graph.forward_required)
        forward_bytes = forward_profile(graph, self.order)
        self.fprofile, self.interval = forward_bytes.during, forward_bytes.lifetimes
        # At most the forward's compute: every forward node once (a backward-only value runs in the
        # forward when SAVEd); with the backward's, the unit of the channel rows.
        self.forward_seconds = sum(n.cost for n in nodes if n.kind == "forward")
        self.step_seconds = self.forward_seconds + sum(nodes[b].cost for b in bwd)

    def cost(self, i: int) -> float:
        return 0.0 if i in self.graph.backward_only else self.graph.nodes[i].cost

    def true_cost(self, i: int) -> float:
        """Seconds one computation of i takes (`cost` is what it adds to a plan's cost)."""
        return self.graph.nodes[i].cost

    def computable(self, i: int) -> bool:
        # A value that cannot be recomputed (random, mutating) is made once, in the forward; only
        # the backward-only ones (made in the backward unless saved) may be computed there.
        n = self.graph.nodes[i]
        return n.recomputable or i in self.graph.backward_only

    def build(self, instants: list[int], forward_steps: list[int] = ()
              ) -> tuple[Mip, dict[int, int], dict[tuple[int, int], int]]:
        """The program for backward positions ``instants`` (and forward steps ``forward_steps``):
        the MIP, the columns of s, and those of a (by (instant, value))."""
        m = Mip()
        self.instants = list(instants)
        self._after: dict[int, set[int]] = {}
        s, z, n = self._add_decisions(m)
        self.z = z
        alive: dict[tuple[int, int], int] = {}
        per_instant = {k: self._add_instant(m, k, s, z, n, alive) for k in instants}
        self._link_instants(m, per_instant)
        if forward_steps:
            self._add_forward_rows(m, s, z, forward_steps)
        return m, s, alive

    def _add_decisions(self, m: Mip) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        """The variables all instants share: s (SAVE), z (COMPRESS), n (backward computations)."""
        graph, nodes, vals = self.graph, self.graph.nodes, self.values
        s = {i: m.binary(f"s_{nodes[i].name}") for i in vals if i in graph.saveable}
        # COMPRESS: z_i, only for SAVEd values, at its codec's cost; a compressed value may count
        # its compressed size wherever it is alive (w: alive and compressed), a relaxation of the
        # simulator, where it counts that only while encoded.
        z = {i: m.binary(f"z_{nodes[i].name}", cost=nodes[i].codec_cost * self.cost_scale)
             for i in vals if i in graph.compressible and i in s}
        for i, col in z.items():
            m.row([(col, 1.0), (s[i], -1.0)], upper=0.0)
        # OFFLOAD: o_i, only for SAVEd values, at no cost (its exposed copy time is never negative).
        o = {i: m.binary(f"o_{nodes[i].name}") for i in vals if i in graph.offloadable and i in s}
        for i, col in o.items():
            m.row([(col, 1.0), (s[i], -1.0)], upper=0.0)
        self.o = o
        # With OFFLOAD, n_i counts every computation (the channel rows read it as time); else 2
        # bounds it, as that many already satisfy every row.
        n = {i: m.var(f"n_{nodes[i].name}", cost=self.cost(i) * self.cost_scale, upper=float("inf") if o else 2.0)
             for i in vals if self.computable(i)}
        self.n = n
        # E: the exposed transfer time, which every plan's cost counts (see `_add_d2h_row`).
        self.exposed = m.var("exposed", cost=self.cost_scale) if o else None
        return s, z, n

    def _add_instant(self, m: Mip, k: int, s, z, n, alive) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        """Instant k's variables a, p, r and rows (see the module); its a columns go into ``alive``."""
        graph, nodes, vals = self.graph, self.graph.nodes, self.values
        vset = set(vals)
        a = {i: m.binary(f"a{k}_{nodes[i].name}") for i in vals}
        p = {i: m.binary(f"p{k}_{nodes[i].name}") for i in vals if self.computable(i)}
        r = {i: m.binary(f"r{k}_{nodes[i].name}") for i in vals if self.computable(i)}
        before = {j for kk in range(k) for j in self.reads[kk]}
        now = set(self.reads[k])
        after = {j for kk in range(k + 1, len(self.reads)) for j in self.reads[kk]}
        self._after[k] = after | now
        for i in vals:
            alive[k, i] = a[i]
            m.row([(a[i], 1.0)] + [(c, -1.0) for c in (s.get(i), p.get(i)) if c is not None], upper=0.0)
            if i in now:
                m.row([(a[i], 1.0)], lower=1.0)
            if i in before:
                m.row([(c, 1.0) for c in (s.get(i), p.get(i)) if c is not None], lower=1.0)
            if i in after:
                m.row([(a[i], 1.0)] + ([(r[i], 1.0)] if i in r else []), lower=1.0)
            root = graph.roots[i]
            if root != i and root in vset:
                m.row([(a[i], 1.0), (a[root], -1.0)], upper=0.0)
            if i in p:
                for j in dict.fromkeys(nodes[i].inputs):
                    if j in vset:
                        m.row([(p[i], 1.0)] + [(c, -1.0) for c in (s.get(j), p.get(j)) if c is not None],
                              upper=0.0)
                        m.row([(r[i], 1.0), (a[j], -1.0)] + ([(r[j], -1.0)] if j in r else []), upper=0.0)
                m.row([(n[i], 1.0), (p[i], -1.0), (r[i], -1.0)], lower=0.0)
        mem = [(a[i], nodes[i].bytes / self.unit) for i in vals if graph.roots[i] == i and nodes[i].bytes]
        # A compressed value is decoded at its first backward read: once a backward node up to k
        # (directly or through a view) or a computation before k has read it, what is alive of it
        # at k is full size.
        decoded = graph.through_aliases(before | now)
        # The same for a value OFFLOADed (off the device until reloaded for its first read) or
        # COMPRESSed: w is the share of its bytes it does not hold at k.
        away: dict[int, int] = {}
        for i in z.keys() | self.o.keys():
            if i in decoded:
                continue
            w = away[i] = m.var(f"w{k}_{nodes[i].name}", upper=1.0)
            m.row([(w, 1.0), (a[i], -1.0)], upper=0.0)
            m.row([(w, 1.0)] + self._away(i, z), upper=0.0)
            for u in graph.users[i]:
                if u in p:
                    m.row([(w, 1.0), (p[u], 1.0)], upper=1.0)
            mem.append((w, -nodes[i].bytes / self.unit))
        m.row(mem, upper=(self.budget - self.fixed[k]) / self.unit)
        self._add_d2h_row(m, k, away, z)
        return a, p, r

    def _add_d2h_row(self, m: Mip, k: int, away: dict[int, int], z: dict[int, int]) -> None:
        """The device-to-host channel at instant k: what is off the device at k because it was
        OFFLOADed has been copied out by then, one copy at a time at the channel's bandwidth, so

            sum_i copied_i / d2h  <=  wall_k
            copied_i >= bytes_i w_ik - (bytes_i - compressed_i) z_i     (what OFFLOAD took away)
            wall_k   <= base_k + sum_i cost_i n_i + sum_i codec_i z_i + E

        where base_k is the compute of every forward node (once; backward-only values included,
        wherever they run) and of the backward nodes before k, and E the exposed transfer time: the clock
        at k can be no later than that, as every stall before k is exposed, every recomputation
        is counted in n and every encoding and decoding in z. (The host-to-device channel is not modelled: a reload
        may be skipped where its value is recomputed instead, and the forward's rows give each
        value one "away" for the whole forward, so they keep copies free.)"""
        off = [i for i in away if i in self.o]
        if not off:
            return
        graph, nodes = self.graph, self.graph.nodes
        d2h = graph.transfers.d2h_bytes_per_s
        base = self.forward_seconds + sum(nodes[b].cost for b in graph.backward_nodes[:k])
        scale = 1.0 / max(self.step_seconds, 1e-12)  # the row in units of the step's compute
        copied = []
        for i in off:
            seconds = nodes[i].bytes / d2h * scale
            if i in z:  # COMPRESSed and OFFLOADed: only the encoding travels
                c = m.var(f"copied{k}_{nodes[i].name}")
                saved_by_codec = (nodes[i].bytes - nodes[i].compressed_bytes) / d2h * scale
                m.row([(c, 1.0), (away[i], -seconds), (z[i], saved_by_codec)], lower=0.0)
                copied.append((c, 1.0))
            else:
                copied.append((away[i], seconds))
        clock = [(col, -self.true_cost(i) * scale) for i, col in self.n.items()] + [(self.exposed, -scale)]
        clock += [(col, -nodes[i].codec_cost * scale) for i, col in z.items()]
        m.row(copied + clock, upper=base * scale)

    def _away(self, i: int, z) -> list[tuple[int, float]]:
        """Terms of -(the share of value i's bytes its decisions can take off the device): all of
        them if OFFLOADed, all but its encoding's if COMPRESSed."""
        nodes = self.graph.nodes
        terms = [(self.o[i], -1.0)] if i in self.o else []
        if i in z:
            terms.append((z[i], -(nodes[i].bytes - nodes[i].compressed_bytes) / nodes[i].bytes))
        return terms

    def _link_instants(self, m: Mip, per_instant) -> None:
        """Instants in order, k < k2: alive at k2 means alive at k or computed after k; computed
        before k means computed before k2; computed before k2 means before k or after k;
        computed after k2 means computed after k."""
        ordered = sorted(per_instant)
        for k, k2 in zip(ordered, ordered[1:]):
            a, p, r = per_instant[k]
            a2, p2, r2 = per_instant[k2]
            for i in self.values:
                m.row([(a2[i], 1.0), (a[i], -1.0)] + ([(r[i], -1.0)] if i in r else []), upper=0.0)
                if i in p:
                    m.row([(p[i], 1.0), (p2[i], -1.0)], upper=0.0)
                    m.row([(p2[i], 1.0), (p[i], -1.0), (r[i], -1.0)], upper=0.0)
                    m.row([(r2[i], 1.0), (r[i], -1.0)], upper=0.0)

    def _add_forward_rows(self, m: Mip, s, z, forward_steps: list[int]) -> None:
        """In the forward, a SAVEd value outlives its last forward use: at step f, the storage of
        every saved value whose forward life ended before f is alive on top of what the forward
        holds anyway (`forward_profile`, a lower bound whatever else it computes)."""
        graph, nodes = self.graph, self.graph.nodes
        kept: dict[int, int] = {}
        for i, col in s.items():
            r = graph.roots[i]
            if r not in self.interval or r in graph.resident or not nodes[r].bytes:
                continue
            if r not in kept:
                kept[r] = m.var(f"kept_{nodes[r].name}", upper=1.0)
            m.row([(kept[r], 1.0), (col, -1.0)], lower=0.0)
        # A kept value COMPRESSed or OFFLOADed holds less: the share `away` of its bytes.
        away: dict[int, int] = {}
        for r in kept:
            if r in z or r in self.o:
                away[r] = m.var(f"away_{nodes[r].name}", upper=1.0)
                m.row([(away[r], 1.0), (kept[r], -1.0)], upper=0.0)
                m.row([(away[r], 1.0)] + self._away(r, z), upper=0.0)
        for f in forward_steps:
            terms = [(col, nodes[r].bytes / self.unit) for r, col in kept.items() if self.interval[r][1] < f]
            terms += [(away[r], -nodes[r].bytes / self.unit) for r in away if self.interval[r][1] < f]
            m.row(terms, upper=(self.budget - self.fprofile[f]) / self.unit)

    def saved(self, s: dict[int, int], alive: dict[tuple[int, int], int], x) -> frozenset[int]:
        """The SAVE set of a solution, for `on_demand` (which keeps what it saves until its last
        read): what is saved and alive at the earliest instant, and what is saved and read only
        before it. (A saved value that is not alive at an instant was dropped before it; a saved
        value that only served to compute others before the instant is not worth saving.)"""
        k0 = min(self.instants)
        early = {j for kk in range(k0) for j in self.reads[kk]} - self._after[k0]
        return frozenset(i for i, col in s.items()
                         if x[col] > 0.5 and (x[alive[k0, i]] > 0.5 or i in early))

    def compressed(self, x) -> frozenset[int]:
        """The values a solution COMPRESSes (columns of the latest `build`)."""
        return frozenset(i for i, col in self.z.items() if x[col] > 0.5)

    def offloaded(self, x) -> frozenset[int]:
        """The values a solution OFFLOADs (columns of the latest `build`)."""
        return frozenset(i for i, col in self.o.items() if x[col] > 0.5)

    def alive_sets(self, alive: dict[tuple[int, int], int], x) -> dict[int, frozenset[int]]:
        """For each modelled instant, the forward values the solution keeps alive there."""
        out: dict[int, set[int]] = {k: set() for k in self.instants}
        for (k, i), col in alive.items():
            if x[col] > 0.5:
                out[k].add(i)
        return {k: frozenset(v) for k, v in out.items()}


def schedule_for(graph: Graph, saved, alive_at: dict[int, frozenset[int]]) -> Schedule:
    """`on_demand` for a SAVE set, except that at each backward position k in ``alive_at``, just
    before what k needs is recomputed and again right after k runs, every forward value not in
    ``alive_at[k]`` is forgotten (recomputed later if needed again), so that what is alive at k is
    what the solution said."""
    nodes = graph.nodes
    builder = OnDemand(graph, saved)
    keep = graph.resident | graph.forward_outputs | graph.free

    def forget(k: int) -> None:
        builder.forget([i for i in builder.available if nodes[i].kind == "forward" and i not in keep
                        and i not in alive_at[k] and nodes[i].recomputable])

    for k, b in enumerate(graph.backward_nodes):
        if k in alive_at:
            forget(k)
        builder.run(b)
        if k in alive_at:
            forget(k)
    events = builder.backward()
    saved = (builder.saved & read_before_recompute(graph, events)) | (graph.needed_by_backward & graph.free)
    return Schedule(saved | must_save(graph), events)


def _tightest(graph: Graph, timeline: Timeline, budget: int) -> tuple[str, int] | None:
    """Where a plan's memory is worst: the first event above the budget or, if it fits, the
    highest backward event. ("backward", position of that backward node, or of the first one
    after a recomputation) or ("forward", node index); None if nothing can be named."""
    nodes = graph.nodes
    by_name = {n.name: i for i, n in enumerate(nodes)}
    bwd_pos = {b: k for k, b in enumerate(graph.backward_nodes)}
    events = timeline.events
    over = next((e for e, ev in enumerate(events) if ev[2] > budget), None)
    if over is None:
        back = [e for e, ev in enumerate(events) if ev[0] == "backward" and ev[1] in by_name]
        if not back:
            return None
        over = max(back, key=lambda e: events[e][2])
    phase, name, _ = events[over]
    if phase == "forward":  # a node, or the encoding of a value ("compress <value>")
        return ("forward", by_name[name.removeprefix("compress ")])
    for ph, nm, _ in events[over:]:
        i = by_name.get(nm)
        if i in bwd_pos:
            return ("backward", bwd_pos[i])
    return None


def _suggested_plans(prog: _Program, s, alive, x, tried: set[tuple]) -> list[tuple[Schedule, Timeline]]:
    """The plans a solution ``x`` suggests, simulated (those in ``tried`` skipped, the others added
    to it): its SAVE set recomputed on demand, and keeping alive at each modelled instant what the
    solution keeps there; over the budget, each also COMPRESSing and OFFLOADing what the solution
    does, and completed by `compress_to_fit` and `offload_to_fit`."""
    graph, budget = prog.graph, prog.budget
    saved = prog.saved(s, alive, x) | must_save(graph)
    alive_at = prog.alive_sets(alive, x)
    chosen = prog.compressed(x) & graph.compressible
    chosen_off = prog.offloaded(x) & graph.offloadable
    new: list[tuple[Schedule, Timeline]] = []

    def add(schedule: Schedule) -> Timeline | None:
        try:
            timeline = simulate(graph, schedule)
        except InvalidScheduleError:
            return None
        new.append((schedule, timeline))
        return timeline

    for schedule in (on_demand(graph, saved), schedule_for(graph, saved, alive_at)):
        key = (schedule.saved, schedule.backward)
        if key in tried:
            continue
        tried.add(key)
        timeline = add(schedule)
        if timeline is None or timeline.peak_bytes <= budget:
            continue
        # Where the plan compressing and offloading what the solution does is worst is an
        # instant the program missed (a value it counted encoded, decoded there; one it counted
        # off the device, still there while its copy runs): the next one to model.
        if (chosen | chosen_off) & schedule.saved:
            add(dataclasses.replace(schedule, compressed=chosen & schedule.saved,
                                    offloaded=chosen_off & schedule.saved))
        for complete in (compress_to_fit if graph.compressible else None,
                         offload_to_fit if graph.offloadable else None):
            done = complete(graph, schedule, budget) if complete else None
            if done is not None:
                new.append(done)
    return new


def instant_solve(graph: Graph, budget: int, *, time_limit: float = 30.0, mip_solver: str | None = None,
                  max_rounds: int = 6, rel_gap: float = 1e-4, target_gap: float = 0.005) -> InstantResult:
    """Solve the program for the instant with the most fixed memory (and the one where the eager
    schedule is worst), simulate the plan it suggests, add the instant where that plan is worst
    (its first event above the budget, in the backward or the forward; if it fits, its highest
    backward event), and so on, until a plan is proven within ``target_gap`` of the bound, an
    instant repeats, or ``max_rounds`` solves or ``time_limit`` seconds are spent. Returns the
    best proven bound and every plan tried, simulated."""
    t0 = time.perf_counter()
    if not graph.backward_nodes:
        return InstantResult(None, (), (), 0.0)
    prog = _Program(graph, budget, byte_unit(graph))
    fixed = prog.fixed
    # Instants where the fixed part alone is over the budget make every plan infeasible.
    if max(fixed) > budget:
        return InstantResult(None, (), (max(range(len(fixed)), key=fixed.__getitem__),), time.perf_counter() - t0,
                             infeasible=True)
    instants = [max(range(len(fixed)), key=lambda k: (fixed[k], -k))]
    # ... and the instant where the eager schedule is worst, where saving less matters most.
    eager = simulate(graph, on_demand(graph, save_all_set(graph)))
    worst = _tightest(graph, eager, budget)
    if worst is not None and worst[0] == "backward" and worst[1] not in instants:
        instants.append(worst[1])
    # ... and, where OFFLOAD is offered, the backward's start, where every SAVEd value is still
    # alive and the copies out have had the least time (the channel row binds most there).
    if graph.offloadable and 0 not in instants:
        instants.append(0)
    forward_steps: list[int] = []
    bound: float | None = None
    plans: list[tuple[Schedule, Timeline]] = []
    tried: set[tuple] = set()
    infeasible = False
    for _ in range(max_rounds):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.5:
            break
        m, s, alive = prog.build(instants, forward_steps)
        res = solve_mip(m, time_limit=left, mip_solver=mip_solver, rel_gap=rel_gap)
        if res.status == "infeasible":
            infeasible = True
            break
        if res.bound is not None:
            bound = max(bound or 0.0, max(0.0, res.bound / prog.cost_scale))
        if res.x is None:
            break
        new = _suggested_plans(prog, s, alive, res.x, tried)
        if not new:
            break
        plans += new
        fitting = [t.recompute_cost for _, t in plans if t.peak_bytes <= budget]
        if fitting and proven(min(fitting), bound, target_gap):
            break
        # Model the instant where the latest plans are worst (above the budget, or tightest), the
        # lowest-peak plan's first; where that instant is modelled already, another plan's (the one
        # compressing what the solution compresses may be worst elsewhere).
        wheres = (_tightest(graph, t, budget) for _, t in sorted(new, key=lambda p: p[1].peak_bytes))
        where = next((w for w in wheres if w is not None and (w[1] not in instants if w[0] == "backward"
                                                             else not forward_steps)), None)
        if where is None:
            break
        if where[0] == "backward":
            instants.append(where[1])
        else:
            # The forward's rows are over the SAVE decisions only and cheap: add every step once.
            forward_steps = list(range(len(prog.order)))
    return InstantResult(bound, tuple(plans), tuple(instants), time.perf_counter() - t0, infeasible)


def peak_lower_bound(graph: Graph) -> tuple[int, str]:
    """A peak no schedule can go below, and where: while backward node k runs, its fixed part
    (`fixed_backward_bytes`) and the forward values it reads are alive; while the forward runs,
    what it holds with nothing saved. (The budget in between and the smallest peak fxopt reaches
    is what recomputation could still win, at most.)"""
    nodes = graph.nodes
    fixed = fixed_backward_bytes(graph)
    avail = graph.resident | graph.free | graph.forward_outputs
    best, where = 0, "nowhere"
    for k, b in enumerate(graph.backward_nodes):
        roots = {graph.roots[j] for j in nodes[b].inputs if nodes[j].kind == "forward" and j not in avail}
        peak = fixed[k] + sum(nodes[r].bytes for r in roots)
        if peak > best:
            best, where = peak, f"backward node {nodes[b].name}"
    order = sorted(graph.forward_required)
    if order:
        fprofile = forward_profile(graph, order).during
        f = max(range(len(order)), key=fprofile.__getitem__)
        if fprofile[f] > best:
            best, where = fprofile[f], f"forward node {nodes[order[f]].name}"
    return best, where
