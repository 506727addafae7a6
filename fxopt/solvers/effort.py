"""How much a solve may work, counted, so that its answer does not depend on the machine.

Every phase of `fxopt.solvers.solve` is bounded by work it counts, never by the clock:

  - a MIP solve (a round of the instant program, the ILP, the lowest-peak ILP): HiGHS's
    branch-and-bound nodes (its ``mip_max_nodes``) and its progress checks, the calls of its
    interrupt callback (HiGHS calls it after each node, each round of root cuts, each heuristic:
    the root's work is counted too, where a node limit alone would let it run for minutes),
    each weighted by the model's size (`Effort`);
    CBC, the fallback solver, counts nodes only;
  - an LP relaxation: simplex iterations;
  - a search of fxopt's own: the rounds it runs, the schedules it simulates, the solves of a
    repeated block's graph (`fxopt.solvers.block_plan`). A simulated schedule is weighted by
    the graph's size: one try up to `SIMULATION_NODES` nodes, nodes / `SIMULATION_NODES` tries
    above (`simulation_weight`), so that `save_more_tries`, `exchange_tries` and `greedy_steps`
    buy about as much time on a 7,600-node step as on the suite's graphs (`lower_peak_work`
    counts simulated steps, so it is weighted by size already).

HiGHS runs on one thread: with more, its parallel symmetry detection ends at another moment on
another run, and the progress checks land elsewhere. With one, the same model and limits give the
same checks, the same incumbents and the same answer on a quiet machine and a busy one.

Time is only a safety stop (`Deadline`): a solve that reaches its time limit keeps the best plan
found so far and says so (`fxopt.solvers.Solution.stopped`, a `SolverTimeoutWarning`); only such
an answer may differ from one run to the next. The default effort takes a few seconds on the
graphs of the test suite and the planning-time benchmark, far inside the default limit. The stop
reads the CPU time of the thread that plans (`now`), not the wall clock: a loaded machine gives
that thread fewer seconds of CPU per second, so on the wall clock the same work reached the stop
sooner there, and the plan depended on the load (issue 24: the bench diffusers UNet, 20 CPU
seconds of solving at 50% of eager's peak, was cut at 2-core load 7-10 and answered 1.473 GFLOP
where the counted effort's plan recomputes 0.435). HiGHS runs in that thread, so its work counts.
"""

from __future__ import annotations

import dataclasses
import time

from fxopt.solvers.mip import Limits

# Seconds for the whole of one `solve` unless the caller gives another limit: a safety stop, far
# above what the default effort takes (a few seconds on the suite's graphs), so that a plan does
# not depend on how busy the machine is. A solve that reaches it says so.
DEFAULT_TIME_LIMIT = 60.0


# A MIP's progress check is weighted by its integer columns plus this many (a small model's
# check costs more per column: the solver's own work per check does not shrink with it).
CHECK_COLUMNS = 500


# A schedule simulated on a graph of up to this many nodes counts as one try of a search of
# fxopt's own (`save_more`, `exchange`, `greedy`'s steps); on a larger graph as its nodes over
# this many (`simulation_weight`): a simulation's cost grows with the graph, so a count of
# schedules alone bought a 32-layer Llama's 7,593-node step minutes, and the safety stop decided
# its plan. About the largest graph of the test suite and the benchmarks' models (the 12-layer
# GPT-2's 2,226 nodes), whose plans this leaves as they were.
SIMULATION_NODES = 2500


@dataclasses.dataclass(frozen=True)
class Effort:
    """The work one `solve` may do. `scaled` multiplies every count (the ``effort`` option).

    MIP work is counted in progress checks, each weighted by the model's integer columns (plus
    `CHECK_COLUMNS`): a check on a larger model re-solves larger LPs, so that a budget of work
    takes about as long on a small model as on a large one. The defaults give each phase about
    what a 4-second time limit gave it on a quiet 2-core machine before effort was counted."""

    instant_work: int = 300_000  # the instant program's rounds together
    lowest_peak_work: int = 200_000  # all rounds of its lowest-peak search
    ilp_work: int = 40_000  # the ILP's exact solve (and its lowest-peak solve)
    mip_nodes: int = 500  # branch-and-bound nodes of one MIP solve (HiGHS and CBC)
    lp_iterations: int = 200_000  # simplex iterations of one LP relaxation
    instant_rounds: int = 6  # rounds of the instant program (`fxopt.solvers.instant`)
    greedy_steps: int = 64  # values `greedy` drops one at a time before it bisects the rest
    save_more_tries: int = 60  # schedules `save_more` simulates
    exchange_tries: int = 100  # schedules `exchange` simulates
    keep_recomputed_tries: int = 100  # schedules `keep_recomputed` simulates
    lower_peak_work: int = 600_000  # steps `lower_peak` simulates (each schedule's forward and backward)
    block_refinements: int = 24  # solves of a repeated block's graph beyond its first curve (`block_plan`)

    def scaled(self, factor: float) -> Effort:
        """Every count times ``factor`` (at least 1 each)."""
        if not factor > 0:
            raise ValueError(f"effort must be a positive number, got {factor!r}")
        return Effort(**{f.name: max(1, round(getattr(self, f.name) * factor)) for f in dataclasses.fields(self)})

    def mip(self, deadline: Deadline, work: int, columns: int, *, sub_mips: bool = True) -> Limits:
        """The limits of one MIP solve of ``columns`` integer columns given ``work``: `mip_nodes`,
        as many progress checks as the work buys (at least one), what is left of ``deadline``.
        ``sub_mips`` False: without HiGHS's RINS and RENS, whose sub-MIPs run for seconds between
        two checks."""
        return Limits(deadline.left(), now, nodes=self.mip_nodes, checks=max(1, work // check_weight(columns)),
                      sub_mips=sub_mips)

    def lp(self, deadline: Deadline) -> Limits:
        """The limits of one LP relaxation."""
        return Limits(deadline.left(), now, lp_iterations=self.lp_iterations)

    def key(self) -> str:
        """The counts as a string, for the plan cache's key."""
        return ",".join(str(getattr(self, f.name)) for f in dataclasses.fields(self))


DEFAULT_EFFORT = Effort()


def check_weight(columns: int) -> int:
    """The work one progress check of a MIP of ``columns`` integer columns counts for."""
    return columns + CHECK_COLUMNS


def simulation_weight(graph) -> float:
    """The tries one simulated schedule of ``graph`` counts for: 1 up to `SIMULATION_NODES`
    nodes, its nodes over that many above (work proportional to the graph's size)."""
    return max(1.0, len(graph) / SIMULATION_NODES)


def effort_of(effort: Effort | float | None) -> Effort:
    """An `Effort` from what a caller gives: one, a multiple of the default, or None (the default)."""
    if effort is None:
        return DEFAULT_EFFORT
    if isinstance(effort, Effort):
        return effort
    if isinstance(effort, bool) or not isinstance(effort, (int, float)):
        raise TypeError(f"effort must be a positive number (a multiple of the default) or an Effort, got {effort!r}")
    return DEFAULT_EFFORT.scaled(float(effort))


def now() -> float:
    """The clock the safety stop reads: the CPU seconds of the calling thread, which a busy
    machine does not speed up (one place, so that a test can make it run fast)."""
    return time.thread_time()


class Deadline:
    """The safety stop of one solve: ``seconds`` of the planning thread's CPU time (`now`) from
    now. Phases that reach it stop and are named in `stopped`; a phase that finds it passed does
    not start (`passed`)."""

    @classmethod
    def of(cls, deadline: Deadline | float | None) -> Deadline:
        """``deadline`` itself, or one that many seconds from now (`DEFAULT_TIME_LIMIT` for None)."""
        if isinstance(deadline, Deadline):
            return deadline
        return cls(DEFAULT_TIME_LIMIT if deadline is None else float(deadline))

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = now() + seconds
        self.stopped: list[str] = []

    def left(self) -> float:
        return self.at - now()

    @property
    def passed(self) -> bool:
        return self.left() <= 0

    def stop(self, phase: str) -> None:
        """``phase`` stopped at the time limit (or was skipped past it)."""
        if phase not in self.stopped:
            self.stopped.append(phase)

    def check(self, phase: str) -> bool:
        """Whether the limit has passed; if so, ``phase`` is named as stopped by it."""
        if self.passed:
            self.stop(phase)
            return True
        return False
