"""A lower bound on the recompute cost from the memory at a few instants of the backward, and the
plans it suggests.

While backward node k runs, every schedule holds (as the simulator counts it)

    fixed_k        resident values, forward outputs, tangents, the backward values alive at k and
                   node k's workspace: the same for every schedule, since the backward nodes run
                   once, in order, and are freed after their last use;
  + A_k            the storage of the forward values alive at that instant.

The modelled instants k_1 < ... < k_m cut the backward into intervals: t = 0 before k_1, t
between k_t and k_(t+1), m after k_m. A value a backward node reads, or a recomputation reads, in
an interval was there as the interval began (SAVEd, for the first; alive at the instant that opens
it, for the others) or was computed in it; what is alive at an instant was there as its interval
began or computed in it. Every backward computation of a forward value is in one interval and
costs its recompute cost (the first computation of a value only the backward needs is free, as in
the simulator). So, for one or more instants, the mixed-integer program

    s_i      SAVE i (saveable values only)              shared by all instants
    c_it     i computed in the backward in interval t
    n_i      backward computations of i, cost c_i       n_i >= sum_t c_it
             (a value only the backward needs: m_i >= n_i + s_i - 1 at cost c_i instead)
    a_ik     i alive while node k runs                  a_(i,k_1) <= s_i + c_i0,  a_(i,k_t+1) <= a_(i,k_t) + c_it
    there    there_i0 = s_i, there_it = a_(i,k_t)
    inputs   c_it <= there_jt + c_jt                    (j an input of i)
    needs    read by node k: a_ik = 1; by a node in interval t: there_it + c_it >= 1
    views    a_ik <= a_(root of i),k                    (a view keeps its base's storage alive)
    memory   fixed_k + sum_i bytes_i a_ik - sum_i (bytes_i - compressed_i) w_ik <= budget
    COMPRESS z_i <= s_i at its codec's cost; w_ik <= a_ik, w_ik <= z_i: a compressed value may
             count its compressed size where it is alive and may still be encoded, i.e. not yet
             read: w_ik = 0 if a backward node up to k reads i, w_ik + c_jt <= 1 for j made
             from i in an interval before k (the simulator decodes it at its first read, so this allows no less)

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

import bisect
import dataclasses
import math
import time

from fxopt.solvers.effort import Deadline, Effort, check_weight, effort_of
from fxopt.solvers.gap import proven
from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import compress_to_fit, offload_to_fit
from fxopt.solvers.liveness import fixed_backward_bytes, forward_profile, last_uses
from fxopt.solvers.mip import Mip, byte_unit, cost_scale_for, solve_mip
from fxopt.solvers.schedule import (InvalidScheduleError, OnDemand, Schedule, Timeline, as_generated, backward_steps,
                                    must_save, on_demand, read_before_recompute, save_all_set, simulate, simulated)

__all__ = ["InstantResult", "bound_where_tight", "fixed_backward_bytes", "instant_solve"]


@dataclasses.dataclass(frozen=True)
class InstantResult:
    bound: float | None  # proven lower bound on the recompute cost (None: nothing proven)
    plans: tuple[tuple[Schedule, Timeline], ...]  # simulated plans, fitting or not
    instants: tuple[int, ...]  # backward positions modelled in the last round
    seconds: float
    infeasible: bool = False  # proven: no schedule fits the budget


# Without a budget (`lowest_peak`), the weight of all recomputation in the objective, in memory
# units (`byte_unit`): the peak comes first.
PEAK_COST_WEIGHT = 0.001


class _MemoryRows:
    """The rows of `_Program` over memory in the forward and the device-to-host channel."""

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
                self.copied[k, i] = (c, seconds, saved_by_codec)
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
        # A SAVEd backward-only value is computed in the forward, after the forward's nodes that
        # precede it, and held from there on.
        made_at: dict[int, int] = {}
        for i, col in s.items():
            r = graph.roots[i]
            if i not in graph.backward_only or r in self.interval or r in graph.resident or not nodes[r].bytes:
                continue
            if r not in kept:
                kept[r] = m.var(f"kept_{nodes[r].name}", upper=1.0)
            m.row([(kept[r], 1.0), (col, -1.0)], lower=0.0)
            made_at[r] = min(made_at.get(r, len(self.order)), bisect.bisect_left(self.order, i))
        self.kept = kept
        for f in forward_steps:
            terms = [(col, nodes[r].bytes / self.unit) for r, col in kept.items()
                     if (self.interval[r][1] < f if r in self.interval else made_at[r] <= f)]
            terms += [(away[r], -nodes[r].bytes / self.unit) for r in away
                      if (self.interval[r][1] < f if r in self.interval else made_at[r] <= f)]
            self._within(m, terms, self.fprofile[f])


class _Reading:
    """Reading a solution of `_Program`'s latest `build` (its SAVE set, what it keeps alive at each
    instant, what it compresses and offloads), and a schedule as a solution (a warm start)."""

    def saved(self, s: dict[int, int], alive: dict[tuple[int, int], int], x, *, used: bool = False) -> frozenset[int]:
        """The SAVE set of a solution, for `on_demand` (which keeps what it saves until its last
        read): what is saved and alive at the earliest instant, and what is saved and read only
        before it. (A saved value that is not alive at an instant was dropped before it; a saved
        value that only served to compute others before the instant is not worth saving.) With
        ``used``, also what is saved and read before that instant by the backward or by what the
        solution computes there (through views), even if read again later (then made again: the
        saved copy dies first)."""
        k0 = min(self.instants)
        early = {j for kk in range(k0) for j in self.reads[kk]}
        if used:
            made = [i for i, col in self.c[0].items() if x[col] > 0.5]
            early = self.graph.through_aliases(early | {j for i in made for j in self.graph.nodes[i].inputs})
        else:
            early -= self._after[k0]
        return frozenset(i for i, col in s.items()
                         if x[col] > 0.5 and (x[alive[k0, i]] > 0.5 or i in early))

    def compressed(self, x) -> frozenset[int]:
        """The values a solution COMPRESSes (columns of the latest `build`)."""
        return frozenset(i for i, col in self.z.items() if x[col] > 0.5)

    def offloaded(self, x) -> frozenset[int]:
        """The values a solution OFFLOADs (columns of the latest `build`)."""
        return frozenset(i for i, col in self.o.items() if x[col] > 0.5)

    def values_of(self, schedule: Schedule) -> list[float]:
        """Column values (of the latest `build`) describing ``schedule``, a warm start: what it
        SAVEs, COMPRESSes and OFFLOADs, what it keeps alive at each modelled instant (a view's
        base with it) and computes in each interval. (Compressed values count full size here.) A
        schedule that fits the budget gives a solution of the program, which is a relaxation."""
        graph, nodes = self.graph, self.graph.nodes
        x = [0.0] * self.mip.num_vars
        # As the simulator runs it: a SAVEd value the backward never reads before recomputing it
        # dies at its last forward use (it is not kept, so the forward's rows must not count it).
        schedule = as_generated(graph, schedule)
        saved = schedule.saved
        steps = backward_steps(graph, schedule)
        last = last_uses(args for _, _, args in steps)
        bwd_step = [e for e, (i, _, _) in enumerate(steps) if nodes[i].kind == "backward"]
        born = {copy: e for e, (_, copy, _) in enumerate(steps)}
        at = [bwd_step[k] for k in self.instants]
        interval = {}
        for e, (i, _, _) in enumerate(steps):
            if nodes[i].kind == "forward" and i in self.n:
                t = bisect.bisect_left(at, e)
                interval[i, t] = 1.0
        for i, col in self.s.items():
            x[col] = float(i in saved)
        for (i, t), v in interval.items():
            x[self.c[t][i]] = v
        for i, col in self.n.items():
            x[col] = sum(interval.get((i, t), 0.0) for t in range(len(self.c)))
        for i, col in self.extra.items():
            x[col] = max(0.0, x[self.n[i]] + (x[self.s[i]] if i in self.s else 0.0) - 1.0)
        for i, col in self.z.items():
            x[col] = float(i in schedule.compressed)
        for i, col in self.o.items():
            x[col] = float(i in schedule.offloaded)
        for k, e in zip(self.instants, at):
            held = {copy[0] for copy, end in last.items() if end >= e and born.get(copy, -1) < e
                    and (copy in born or copy[0] in saved)}
            held |= {graph.roots[i] for i in held}
            for i in self.values:
                x[self.alive[k, i]] = float(i in held)
        for (k, i), col in self.w.items():
            # As little of it as the rows allow: off the device if it may be, until a computation
            # in an interval before k reads it.
            t = self.instants.index(k)
            read = any(x[ct[u]] > 0.5 for u in graph.users[i] for ct in self.c[:t + 1] if u in ct)
            away = x[self.o[i]] if i in self.o else 0.0
            if i in self.z:
                away += x[self.z[i]] * (nodes[i].bytes - nodes[i].compressed_bytes) / nodes[i].bytes
            x[col] = 0.0 if read else min(x[self.alive[k, i]], away, 1.0)
        for r, col in self.kept.items():
            x[col] = float(any(graph.roots[i] == r for i in saved))
        for (k, i), (col, seconds, saved_by_codec) in self.copied.items():
            x[col] = max(0.0, seconds * x[self.w[k, i]] - saved_by_codec * x[self.z[i]])
        timeline = simulate(graph, schedule) if self.peak is not None or self.exposed is not None else None
        if self.exposed is not None:
            x[self.exposed] = timeline.exposed_transfer_seconds
        if self.peak is not None:
            x[self.peak] = timeline.peak_bytes / self.unit
        return x

    def made_sets(self, x) -> dict[int, frozenset[int]]:
        """For each modelled instant, the forward values the solution computes in the interval
        that ends there (columns of the latest `build`)."""
        return {k: frozenset(i for i, col in self.c[t].items() if x[col] > 0.5) for t, k in enumerate(self.instants)}

    def alive_sets(self, alive: dict[tuple[int, int], int], x) -> dict[int, frozenset[int]]:
        """For each modelled instant, the forward values the solution keeps alive there."""
        out: dict[int, set[int]] = {k: set() for k in self.instants}
        for (k, i), col in alive.items():
            if x[col] > 0.5:
                out[k].add(i)
        return {k: frozenset(v) for k, v in out.items()}


class _Program(_MemoryRows, _Reading):
    """The program above for a growing set of instants: what every round shares (the values it
    decides on, what each backward node reads, the fixed memory), and `build`, one round's MIP
    (its decisions, intervals and instants; the memory rows of the forward and of the OFFLOAD
    channel are `_MemoryRows`'; reading a solution, and writing a warm start, `_Reading`'s)."""

    def __init__(self, graph: Graph, budget: int | None, unit: int):
        """``budget`` None: the lowest peak instead (see `lowest_peak`)."""
        nodes = graph.nodes
        self.graph, self.budget, self.unit = graph, budget, unit
        self.peak: int | None = None  # the peak's column, without a budget
        bwd = graph.backward_nodes
        self.avail = graph.resident | graph.free | graph.forward_outputs
        self.reads = [[j for j in dict.fromkeys(nodes[b].inputs) if nodes[j].kind == "forward" and j not in self.avail]
                      for b in bwd]
        needs = {j for r in self.reads for j in r}
        self.values = sorted(graph.ancestors(needs) - self.avail)
        self.fixed = fixed_backward_bytes(graph)
        # Multi-output ops (tuples) and the outputs taken out of them.
        self.items = {i: [u for u in graph.users[i] if nodes[u].kind == "forward"] for i in self.values
                      if not nodes[i].tensor and nodes[i].kind == "forward"}
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
        self.instants = sorted(set(instants))
        self._after: dict[int, set[int]] = {}
        self.extra: dict[int, int] = {}  # m_i (backward-only values' paid computations)
        self.kept: dict[int, int] = {}  # the forward rows' kept roots
        self.w: dict[tuple[int, int], int] = {}  # (instant, value): the share of it not on the device
        self.copied: dict[tuple[int, int], tuple[int, float, float]] = {}  # the channel rows' copies
        s, z, n = self._add_decisions(m)
        self.s, self.z, self.n = s, z, n
        if self.budget is None:
            # The peak first; among the lowest-peak plans the cheapest: all recomputation together
            # weighs at most `PEAK_COST_WEIGHT` of a memory unit.
            scale = PEAK_COST_WEIGHT / max(sum(m.cost) * (len(self.instants) + 1), 1e-300)
            m.cost = [c * scale for c in m.cost]
            self.peak = m.var("peak", cost=1.0)
        c = self._add_intervals(m, n)
        self.c = c
        alive: dict[tuple[int, int], int] = {}
        for t, k in enumerate(self.instants):
            self._add_instant(m, t, k, s, z, c, alive)
        self._add_interval_rows(m, s, c, alive)
        if forward_steps:
            self._add_forward_rows(m, s, z, forward_steps)
        self.alive, self.mip = alive, m
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
        n = {i: m.var(f"n_{nodes[i].name}", cost=self.cost(i) * self.cost_scale)
             for i in vals if self.computable(i)}
        # A backward-only value is made once for free (in the forward if SAVEd, else at its first
        # backward computation, as the simulator counts): every computation beyond that is paid,
        # m_i >= n_i + s_i - 1.
        for i in vals:
            if i in graph.backward_only and i in n and nodes[i].recomputable and nodes[i].cost > 0:
                extra = self.extra[i] = m.var(f"m_{nodes[i].name}", cost=nodes[i].cost * self.cost_scale)
                m.row([(extra, 1.0), (n[i], -1.0)] + ([(s[i], -1.0)] if i in s else []), lower=-1.0)
        # E: the exposed transfer time, which every plan's cost counts (see `_add_d2h_row`).
        self.exposed = m.var("exposed", cost=self.cost_scale) if o else None
        return s, z, n

    def _add_intervals(self, m: Mip, n) -> list[dict[int, int]]:
        """c_it: value i is computed in the backward in interval t (t = 0 before the first instant,
        t between instants t - 1 and t, the last after the last instant); each computation is in
        one interval, so n_i >= sum_t c_it."""
        nodes = self.graph.nodes
        c = [{i: m.binary(f"c{t}_{nodes[i].name}") for i in n} for t in range(len(self.instants) + 1)]
        for i, col in n.items():
            m.row([(col, 1.0)] + [(ct[i], -1.0) for ct in c], lower=0.0)
        # A multi-output op recomputed has all its outputs taken out right after it (the simulator
        # accepts nothing else): in the same interval.
        for ct in c:
            for i, out in self.items.items():
                if i in ct:
                    for u in out:
                        if u in ct:
                            m.row([(ct[u], 1.0), (ct[i], -1.0)], lower=0.0)
        return c

    def _add_instant(self, m: Mip, t: int, k: int, s, z, c, alive) -> None:
        """Instant k's (the t-th) variables a (alive while backward node k runs), its reads and its
        memory row; its a columns go into ``alive``."""
        graph, nodes, vals = self.graph, self.graph.nodes, self.values
        vset = set(vals)
        a = {i: m.binary(f"a{k}_{nodes[i].name}") for i in vals}
        before = {j for kk in range(k) for j in self.reads[kk]}
        now = set(self.reads[k])
        after = {j for kk in range(k + 1, len(self.reads)) for j in self.reads[kk]}
        self._after[k] = after | now
        for i in vals:
            alive[k, i] = a[i]
            if i in now:
                m.row([(a[i], 1.0)], lower=1.0)
            if i in self.items:
                m.row([(a[i], 1.0)], upper=0.0)  # a tuple dies as its outputs are taken out
            root = graph.roots[i]
            if root != i and root in vset:
                m.row([(a[i], 1.0), (a[root], -1.0)], upper=0.0)
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
            w = self.w[k, i] = away[i] = m.var(f"w{k}_{nodes[i].name}", upper=1.0)
            m.row([(w, 1.0), (a[i], -1.0)], upper=0.0)
            m.row([(w, 1.0)] + self._away(i, z), upper=0.0)
            for u in graph.users[i]:
                for ct in c[:t + 1]:
                    if u in ct:
                        m.row([(w, 1.0), (ct[u], 1.0)], upper=1.0)
            mem.append((w, -nodes[i].bytes / self.unit))
        self._within(m, mem, self.fixed[k])
        self._add_d2h_row(m, k, away, z)

    def _add_interval_rows(self, m: Mip, s, c, alive) -> None:
        """What links the instants: a value alive at the first instant was SAVEd or computed
        before it, and one alive at a later instant was alive at the previous one or computed in
        between; a value a backward node reads in an interval was there as it began (SAVEd, for
        the first; alive at the instant that opens it, for the others) or computed in it, and so
        was every input of a value computed in it."""
        nodes, vals, instants = self.graph.nodes, self.values, self.instants
        vset = set(vals)

        def there(t: int, i: int) -> list[tuple[int, float]]:  # i is there as interval t begins
            col = s.get(i) if t == 0 else alive[instants[t - 1], i]
            return [] if col is None else [(col, 1.0)]

        def made(t: int, i: int) -> list[tuple[int, float]]:
            return [(c[t][i], 1.0)] if i in c[t] else []

        bounds = [0] + [k + 1 for k in instants]
        ends = instants + [len(self.reads)]
        for t in range(len(instants) + 1):
            if t < len(instants):
                k = instants[t]
                for i in vals:
                    m.row([(alive[k, i], 1.0)] + [(col, -a) for col, a in there(t, i) + made(t, i)], upper=0.0)
            read = {j for kk in range(bounds[t], ends[t]) for j in self.reads[kk]}
            for i in read:
                m.row(there(t, i) + made(t, i), lower=1.0)
            for i, col in c[t].items():
                for j in dict.fromkeys(nodes[i].inputs):
                    if j in vset:
                        m.row([(col, 1.0)] + [(cc, -a) for cc, a in there(t, j) + made(t, j)], upper=0.0)

    def _within(self, m: Mip, terms: list[tuple[int, float]], fixed_bytes: int) -> None:
        """fixed + sum(terms) <= the budget, or <= the peak without one."""
        if self.peak is None:
            m.row(terms, upper=(self.budget - fixed_bytes) / self.unit)
        else:
            m.row(terms + [(self.peak, -1.0)], upper=-fixed_bytes / self.unit)


def schedule_for(graph: Graph, saved, alive_at: dict[int, frozenset[int]],
                 made_before: dict[int, frozenset[int]] | None = None) -> Schedule:
    """`on_demand` for a SAVE set, except that at each backward position k in ``alive_at``, just
    before what k needs is recomputed and again right after k runs, every forward value not in
    ``alive_at[k]`` is forgotten (recomputed later if needed again), so that what is alive at k is
    what the solution said. ``made_before[k]``: values the solution computes in the interval that
    ends at k; those it keeps alive at k are computed by then (not later, on demand, when what
    they are made from may have been forgotten)."""
    nodes = graph.nodes
    builder = OnDemand(graph, saved)
    keep = graph.resident | graph.forward_outputs | graph.free

    def forget(k: int) -> None:
        builder.forget([i for i in builder.available if nodes[i].kind == "forward" and i not in keep
                        and i not in alive_at[k] and nodes[i].recomputable])

    for k, b in enumerate(graph.backward_nodes):
        if k in alive_at:
            if made_before is not None:
                wanted = made_before[k] & alive_at[k]
                builder.recompute(wanted, keep=wanted)
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
    spots = _tight_spots(graph, timeline, budget)
    return spots[0] if spots else None


def _tight_spots(graph: Graph, timeline: Timeline, budget: int) -> list[tuple[str, int]]:
    """`_tightest`, then (for a plan over the budget) its highest backward event above it: the
    instants to model next, best first."""
    nodes = graph.nodes
    by_name = {n.name: i for i, n in enumerate(nodes)}
    bwd_pos = {b: k for k, b in enumerate(graph.backward_nodes)}
    events = timeline.events
    back = [e for e, ev in enumerate(events) if ev[0] == "backward" and ev[1] in by_name]

    def where(e: int) -> tuple[str, int] | None:
        phase, name, _ = events[e]
        if phase == "forward":  # a node, or the encoding of a value ("compress <value>")
            return ("forward", by_name[name.removeprefix("compress ")])
        for ph, nm, _ in events[e:]:
            i = by_name.get(nm)
            if i in bwd_pos:
                return ("backward", bwd_pos[i])
        return None

    over = next((e for e, ev in enumerate(events) if ev[2] > budget), None)
    if over is None:
        picks = [max(back, key=lambda e: events[e][2])] if back else []
    else:
        worst = [e for e in back if events[e][2] > budget]
        picks = [over] + ([max(worst, key=lambda e: events[e][2])] if worst else [])
    return [w for w in dict.fromkeys(where(e) for e in picks) if w is not None]


# How many new instants (or the forward's steps) a round of `instant_solve` and `lowest_peak` adds.
SPOTS_PER_ROUND = 1


def _next_spots(graph: Graph, new, budget: int, instants: list[int], forward_steps: list[int],
                most: int) -> list[tuple[str, int]]:
    """Where to model next: where the latest plans are worst (above the budget, or tightest), the
    lowest-peak plan's first; past what is modelled already, another plan's (the one compressing
    what the solution compresses may be worst elsewhere). At most ``most``."""
    out: list[tuple[str, int]] = []
    for _, t in sorted(new, key=lambda p: p[1].peak_bytes):
        spots = _tight_spots(graph, t, budget)
        # A plan worst at an instant modelled already is worst while recomputing for it (the
        # program does not see that moment): the instant before may make it let go of more.
        spots += [("backward", k - 1) for phase, k in spots if phase == "backward" and k in instants and k > 0]
        for w in spots:
            fresh = w[1] not in instants if w[0] == "backward" else not forward_steps
            if fresh and w not in out and (w[0] == "backward" or all(o[0] == "backward" for o in out)):
                out.append(w)
            if len(out) == most:
                return out
    return out


def _with_spots(prog: _Program, instants: list[int], forward_steps: list[int],
                 spots: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """The instants and forward steps to model next: with the backward ``spots`` (`_next_spots`)
    added, and, for a forward one, every forward step (the forward's rows are over the SAVE
    decisions only and cheap: all of them, once)."""
    instants = instants + [k for phase, k in spots if phase == "backward"]
    if any(phase == "forward" for phase, _ in spots):
        forward_steps = list(range(len(prog.order)))
    return instants, forward_steps


def _suggested_plans(prog: _Program, s, alive, x, tried: set[tuple], budget: int | None = None
                     ) -> list[tuple[Schedule, Timeline]]:
    """The plans a solution ``x`` suggests, simulated (those in ``tried`` skipped, the others added
    to it): its SAVE set recomputed on demand, and keeping alive at each modelled instant what the
    solution keeps there; over the budget (the program's, or ``budget``), each also COMPRESSing and
    OFFLOADing what the solution does, and completed by `compress_to_fit` and `offload_to_fit`."""
    graph, budget = prog.graph, prog.budget if budget is None else budget
    saves = [prog.saved(s, alive, x, used=used) | must_save(graph) for used in (False, True)]
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

    made = prog.made_sets(x)
    schedules = [on_demand(graph, saves[0])] + [schedule_for(graph, saved, alive_at, guide)
                                                  for saved in dict.fromkeys(saves) for guide in (None, made)]
    for schedule in schedules:
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


def instant_solve(graph: Graph, budget: int, *, effort: Effort | float | None = None,
                  time_limit: Deadline | float | None = None, mip_solver: str | None = None, rel_gap: float = 1e-4,
                  target_gap: float = 0.005, start: Schedule | None = None) -> InstantResult:
    """Solve the program for the instant with the most fixed memory (and the one where the eager
    schedule is worst), simulate the plan it suggests, add the instant where that plan is worst
    (its first event above the budget, in the backward or the forward; if it fits, its highest
    backward event), and so on, until a plan is proven within ``target_gap`` of the bound, an
    instant repeats, or the effort's `instant_rounds` solves or its `instant_work` are spent (``time_limit``: the safety stop, seconds or a `Deadline`). Returns the best proven
    bound and every plan tried, simulated. Each round starts from the cheapest plan within the
    budget so far (``start``, a schedule found elsewhere, to begin with): it is the MIP's first
    incumbent."""
    effort, deadline = effort_of(effort), Deadline.of(time_limit)
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
    work = effort.instant_work
    for _ in range(effort.instant_rounds):
        if work <= 0 or deadline.check("instant"):
            break
        m, s, alive = prog.build(instants, forward_steps)
        fits = [(t.cost, sch) for sch, t in plans if t.peak_bytes <= budget and not t.over_host_budget]
        incumbent = min(fits, key=lambda f: f[0])[1] if fits else start
        res = solve_mip(m, limits=effort.mip(deadline, work, m.num_integer), mip_solver=mip_solver, rel_gap=rel_gap,
                        warm_start=prog.values_of(incumbent) if incumbent is not None else None)
        work -= max(1, res.checks) * check_weight(m.num_integer)
        if res.limit == "time":
            deadline.stop("instant")
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
        spots = _next_spots(graph, new, budget, instants, forward_steps, SPOTS_PER_ROUND)
        if not spots:
            break
        instants, forward_steps = _with_spots(prog, instants, forward_steps, spots)
    return InstantResult(bound, tuple(plans), tuple(instants), time.perf_counter() - t0, infeasible)


def bound_where_tight(graph: Graph, budget: int, plan: tuple[Schedule, Timeline], *,
                      effort: Effort | float | None = None, time_limit: Deadline | float | None = None,
                      mip_solver: str | None = None, memo=None) -> float | None:
    """A lower bound on the recompute cost of every schedule within ``budget``, for a plan found
    elsewhere (`fxopt.solvers.block_plan`'s): one round of the program, at the instants where
    ``plan`` and (in its backward) the eager schedule are tightest, started from ``plan`` (its rows are those of
    `instant_solve`'s rounds, so the bound holds for every schedule the simulator accepts).
    None where nothing is proven within the effort's `instant_work`. ``memo``: the planner's
    (`fxopt.solvers.minimum.Memo`), where eager's timeline may be kept already."""
    effort, deadline = effort_of(effort), Deadline.of(time_limit)
    if not graph.backward_nodes:
        return None
    prog = _Program(graph, budget, byte_unit(graph))
    eager = simulated(graph, on_demand(graph, save_all_set(graph)), memo)
    # (Eager's only in the backward: modelling the forward's steps costs seconds on a deep step.)
    worst = [w for w in _tight_spots(graph, eager, budget)[:1] if w[0] == "backward"]
    spots = list(dict.fromkeys([*_tight_spots(graph, plan[1], budget), *worst]))
    instants, forward_steps = _with_spots(prog, [], [], spots)
    if not instants:
        fixed = prog.fixed
        instants = [max(range(len(fixed)), key=lambda k: (fixed[k], -k))]
    m, _, _ = prog.build(sorted(set(instants)), forward_steps)
    res = solve_mip(m, limits=effort.mip(deadline, effort.instant_work, m.num_integer), mip_solver=mip_solver,
                    rel_gap=1e-4, warm_start=prog.values_of(plan[0]))
    if res.limit == "time":
        deadline.stop("bound")
    return None if res.bound is None else max(0.0, res.bound / prog.cost_scale)


@dataclasses.dataclass(frozen=True)
class LowestPeak:
    floor: int  # proven: no schedule the simulator accepts peaks below it
    plans: tuple[tuple[Schedule, Timeline], ...]  # simulated
    instants: tuple[int, ...]
    seconds: float

    @property
    def proven(self) -> bool:
        """Whether a plan reaches the floor (its peak is the lowest there is)."""
        return any(t.peak_bytes <= self.floor for _, t in self.plans)


def lowest_peak(graph: Graph, *, effort: Effort | float | None = None, time_limit: Deadline | float | None = None,
                mip_solver: str | None = None, rel_gap: float = 1e-6) -> LowestPeak:
    """The program without a budget: the least peak P over the modelled instants (and forward
    steps), then the least recomputation. It is a relaxation, so its proven bound on P is a floor
    for every schedule (at least `peak_lower_bound`'s). Rounds as in `instant_solve`: the plans a
    solution suggests are simulated, the instant where the lowest-peak one is worst is added, until
    a plan reaches the floor (proven the lowest), an instant repeats, or the effort's
    `instant_rounds` solves or its `lowest_peak_work` are spent."""
    effort, deadline = effort_of(effort), Deadline.of(time_limit)
    t0 = time.perf_counter()
    floor, _ = peak_lower_bound(graph)
    if not graph.backward_nodes:
        return LowestPeak(floor, (), (), 0.0)
    prog = _Program(graph, None, byte_unit(graph))
    fixed = prog.fixed
    instants = [max(range(len(fixed)), key=lambda k: (fixed[k], -k))]
    forward_steps: list[int] = []
    plans: list[tuple[Schedule, Timeline]] = []
    tried: set[tuple] = set()
    work = effort.lowest_peak_work
    for _ in range(effort.instant_rounds):
        if work <= 0 or deadline.check("lowest peak"):
            break
        m, s, alive = prog.build(instants, forward_steps)
        res = solve_mip(m, limits=effort.mip(deadline, work, m.num_integer), mip_solver=mip_solver, rel_gap=rel_gap)
        work -= max(1, res.checks) * check_weight(m.num_integer)
        if res.limit == "time":
            deadline.stop("lowest peak")
        if res.bound is not None:
            # P = objective - recomputation's share (at most PEAK_COST_WEIGHT), less the solver's
            # tolerance on the rows.
            proven_units = res.bound - PEAK_COST_WEIGHT - 1e-6 * max(1.0, abs(res.bound))
            floor = max(floor, math.floor(proven_units * prog.unit))
        if res.x is None:
            break
        target = math.ceil(res.x[prog.peak] * prog.unit)
        new = _suggested_plans(prog, s, alive, res.x, tried, budget=target)
        plans += new
        if not new or min(t.peak_bytes for _, t in plans) <= floor:
            break
        spots = _next_spots(graph, new, target, instants, forward_steps, SPOTS_PER_ROUND)
        if not spots:
            break
        instants, forward_steps = _with_spots(prog, instants, forward_steps, spots)
    return LowestPeak(floor, tuple(plans), tuple(instants), time.perf_counter() - t0)


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
