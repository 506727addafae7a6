"""Memory of a pipeline stage on its device, beside one microbatch's step, and the stage's plan.

Stage s of torch's 1F1B runs ``k_s = min(M, S - s)`` forwards before its first backward, so it
holds the SAVEd values of k_s microbatches at once (GPipe: all M). `InFlight.device_peak` is one
microbatch's step as planned (``Timeline.peak_bytes``), plus, for each of the k_s - 1 other
microbatches in flight, its SAVEd values (``Timeline.saved_bytes``) and its output (held for its
backward), plus what torch's runtime holds whatever the plan (`runtime_fixed`: receive buffers per
microbatch, sends in flight), the gradients accumulated from earlier microbatches, and on the
last stage the loss after its forward. `solve_stage` finds the cheapest schedule for which that
is within the budget, with `solve` at step budgets it searches, each solve with a safety stop of
its own (`SolveStops`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable

from fxopt.solvers.auto import Solution, SolverTimeoutWarning, solve
from fxopt.solvers.chain import chain_candidates
from fxopt.solvers.effort import Deadline, Effort, effort_of
from fxopt.solvers.graph import Graph
from fxopt.solvers.heuristics import HEURISTICS
from fxopt.solvers.minimum import Memo, infeasible, lowest_plan, memo_key
from fxopt.solvers.schedule import Schedule, Timeline, as_generated, simulate
from fxopt.errors import InfeasibleBudgetError

SCHEDULES = ("1F1B", "GPipe")

# `solve_stage`: solves at most per stage, and the share of the budget within which the search
# between a budget that fits and one that does not stops.
STAGE_SOLVES = 6
STAGE_TOLERANCE = 0.01


def in_flight_count(schedule: str, stages: int, microbatches: int, s: int) -> int:
    """Microbatches whose SAVEd values stage ``s`` holds at once: torch's 1F1B runs
    ``min(M, S - s)`` forwards before its first backward; GPipe runs all M."""
    return microbatches if schedule == "GPipe" else min(microbatches, stages - s)




@dataclasses.dataclass(frozen=True)
class InFlight:
    """What a pipeline stage's device holds beside one microbatch's step: ``microbatches`` in
    flight at once (this one included), each of the others with its SAVEd values and
    ``held_bytes`` (its output, kept for its backward); ``fixed_bytes`` whatever the plan;
    ``accumulated_bytes`` of gradients from earlier microbatches once the first backward is
    done, when ``accumulating`` microbatches are in flight at most (`accumulation`); and
    ``after_forward_bytes`` that run beside the state the forward ends in (the loss, which
    torch's schedules compute outside the last stage's module, between its forward and backward)."""

    microbatches: int = 1
    held_bytes: int = 0
    fixed_bytes: int = 0
    accumulated_bytes: int = 0
    accumulating: int = 1
    after_forward_bytes: int = 0

    def device_peak(self, graph: Graph, schedule: Schedule, timeline: Timeline | None = None) -> int:
        """The device's peak with ``schedule`` for each microbatch (its output counted once where
        it is SAVEd too)."""
        timeline = timeline or simulate(graph, schedule)
        per = timeline.saved_bytes + self.held_bytes - _saved_outputs(graph, schedule)
        others = max((self.microbatches - 1) * per, (self.accumulating - 1) * per + self.accumulated_bytes)
        step = timeline.peak_bytes
        if self.after_forward_bytes:
            forward_end = next((b for phase, _, b in reversed(timeline.events) if phase == "forward"), 0)
            step = max(step, forward_end + self.after_forward_bytes)
        return step + others + self.fixed_bytes

    def key(self) -> str:
        return (f"{self.microbatches}x{self.held_bytes}+{self.fixed_bytes}+{self.accumulating}x"
                f"{self.accumulated_bytes}+{self.after_forward_bytes}")


def _saved_outputs(graph: Graph, schedule: Schedule) -> int:
    """Bytes of the forward's outputs that are also SAVEd on the device (counted in both), as the
    generated code SAVEs (`as_generated`, as `Timeline.saved_bytes` counts): a SAVE the backward
    does not read before it recomputes the value is dropped there, and an output it was is held
    as the output only."""
    schedule = as_generated(graph, schedule)
    on_device = schedule.saved - schedule.compressed - schedule.offloaded - graph.free
    roots = {graph.roots[i] for i in on_device} & {graph.roots[i] for i in graph.forward_outputs}
    return sum(graph.nodes[r].bytes for r in roots)


def accumulation(schedule: str, stages: int, microbatches: int, s: int) -> int:
    """Microbatches in flight on stage ``s`` at most once a backward has accumulated gradients:
    on 1F1B with more microbatches than it warms up with, all of them (its second backward comes
    after another forward); else one fewer (each backward only lowers the count); none with one
    microbatch (nothing accumulates)."""
    k = in_flight_count(schedule, stages, microbatches, s)
    if microbatches == 1:
        return 0
    return k if schedule == "1F1B" and microbatches > k else k - 1


def runtime_fixed(schedule: str, stages: int, microbatches: int, s: int, received, sent, extra=0):
    """What torch's runtime holds on stage ``s``'s device beside one microbatch's step, whatever
    the plan (``received``, ``sent``: bytes of one microbatch's stage input and output; ``grads``:
    of its parameters' gradients), as torch 2.13's `PipelineStage` and schedules hold it:

      - the inputs of the other microbatches: on the first stage the caller's batch, later the
        receive buffers the stage allocates per microbatch;
      - input gradients sent: 1F1B keeps one send in flight; GPipe keeps every send's work (and
        with it the gradient) until its backward loop ends;
      - but on the last stage, a receive buffer per microbatch for the output gradient, and, on
        1F1B with two or more microbatches in flight, the output of the warm-up's last fired
        send, whose work object stays referenced through the steady state;
    (The gradients accumulated from earlier microbatches are `InFlight.accumulated_bytes`.)
    Works on numbers and on numpy arrays alike (the DP calls it on vectors)."""
    m, k = microbatches, in_flight_count(schedule, stages, microbatches, s)
    last = s == stages - 1
    if s == 0:
        inputs = (m - 1) * received
    else:
        inputs = (m - 1) * received + (m - 1 if schedule == "GPipe" else 1) * received
    outputs = 0 if last else (m - 1) * sent + (sent if schedule != "GPipe" and k >= 2 else 0)
    return inputs + outputs + extra


def stage_in_flight(schedule: str, stages: int, microbatches: int, s: int, received: int, sent: int, grads: int,
                    *, held: int | None = None, extra: int = 0, after_forward: int = 0) -> InFlight:
    """What stage ``s`` of ``stages`` holds beside one microbatch, from the bytes one microbatch's
    stage receives and sends and its parameters' gradients: the other microbatches in flight, each
    holding ``held`` (its output by default), what torch's runtime holds (`runtime_fixed`, with
    ``extra``), the gradients once accumulating (`accumulation`) and ``after_forward`` (the loss).
    (The simulated pipeline and the captured one both describe a stage by it.)"""
    fixed = runtime_fixed(schedule, stages, microbatches, s, received, sent, extra)
    return InFlight(in_flight_count(schedule, stages, microbatches, s), sent if held is None else held, fixed, grads,
                    accumulation(schedule, stages, microbatches, s), after_forward)


class SolveStops:
    """The safety stops of a search made of several solves (`solve_stage`'s, an atom's): each
    solve gets one of its own, as long as the time limit (``time_limit``'s length where it is a
    `Deadline` already running). A solve's work is counted (`fxopt.solvers.effort`) and its time
    limit sized for one solve: one stop shared by all of a search's solves would cut the later
    ones on a busy machine, and the plan would depend on the machine's load. The phases any of
    them stopped are kept (`stopped`), so that the search's answer says so (`warn`)."""

    def __init__(self, time_limit: Deadline | float | None):
        self.seconds = Deadline.of(time_limit).seconds
        self.deadlines: list[Deadline] = []

    def next(self) -> Deadline:
        """The safety stop of the next solve, from now."""
        self.deadlines.append(Deadline(self.seconds))
        return self.deadlines[-1]

    @property
    def stopped(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(phase for d in self.deadlines for phase in d.stopped))

    def warn(self, what: str) -> None:
        """A `SolverTimeoutWarning`, once, if any solve was stopped."""
        if self.stopped:
            warnings.warn(f"the solvers stopped at the time limit ({self.seconds:.1f} s per solve) in: "
                          f"{', '.join(self.stopped)}; {what} is the best found by then, and another run may find "
                          "another (raise time_limit, or lower the effort)", SolverTimeoutWarning, stacklevel=3)


def solve_stage(graph: Graph, budget: int, in_flight: InFlight, solver: str = "auto", *,
                effort: Effort | float | None = None, time_limit: Deadline | float | None = None,
                on_progress: Callable[[str], None] | None = None, mip_solver: str | None = None,
                memo: Memo | None = None) -> Solution:
    """The cheapest schedule of one microbatch's step whose memory on the device with
    ``in_flight`` (`InFlight.device_peak`) is within ``budget``. `solve` bounds the step's peak,
    not what it SAVEs, so: first at the budget less what the other microbatches would hold if
    nothing were SAVEd; if that plan's device memory is over, the step's lowest-peak schedule
    and the heuristics' schedules (`_candidates`) are checked, and the step budget is bisected
    between the cheapest fitting one's peak and the first (`STAGE_SOLVES` solves in all, each
    with ``effort`` and ``time_limit``, its own safety stop: `SolveStops`; the lowest-peak search
    done once, kept for them all, and in ``memo`` for later calls on the same graph: the planner's,
    so that ``budget="min"``'s second plan of a stage does not search again); the cheapest plan
    that fits wins. A stop is said once (a `SolverTimeoutWarning`, the phases in
    `Solution.stopped`). Raises `InfeasibleBudgetError` naming the least device memory of those
    schedules."""
    effort, stops, memo, t0 = effort_of(effort), SolveStops(time_limit), Memo() if memo is None else memo, time.perf_counter()
    k, ka = in_flight.microbatches, in_flight.accumulating
    held = in_flight.held_bytes
    high = budget - in_flight.fixed_bytes - max((k - 1) * held, (ka - 1) * held + in_flight.accumulated_bytes)

    def attempt(target: int) -> tuple[Solution | None, bool]:
        sol = _solve_quietly(graph, target, solver, effort, stops, mip_solver, on_progress, memo)
        return sol, sol is not None and in_flight.device_peak(graph, sol.schedule, sol.timeline) <= budget

    def answer(found: Solution) -> Solution:
        stops.warn("this pipeline stage's plan")
        return dataclasses.replace(found, solve_seconds=time.perf_counter() - t0, stopped=stops.stopped)

    found, fits = attempt(high)  # most often it fits
    if fits:
        return answer(found)
    # The step's budget bounds its peak, not what it SAVEs. The heuristics' schedules (greedy's
    # whole curve of fewer SAVEd values) give a plan that fits, if one does; then the step budget
    # is bisected between its peak and the first one's.
    candidates = _candidates(graph, in_flight, solver, effort, stops.next(), mip_solver, memo)
    fitting = [sol for sol, device in candidates if device <= budget]
    if not fitting:
        stops.warn("the smallest budget this pipeline stage names")
        raise infeasible(budget, min(device for _, device in candidates), None,
                         f"(A pipeline stage holding {k} microbatches.)")
    found = min(fitting, key=lambda sol: sol.timeline.cost)
    low = found.timeline.peak_bytes
    for _ in range(STAGE_SOLVES - 1):
        if high - low <= STAGE_TOLERANCE * budget:
            break
        target = (low + high) // 2
        sol, fits = attempt(target)
        if fits:
            low = target
            if sol.timeline.cost < found.timeline.cost:
                found = sol
        else:
            high = target
    return answer(found)


def _candidates(graph: Graph, in_flight: InFlight, solver: str, effort: Effort, deadline: Deadline,
                mip_solver: str | None = None, memo: Memo | None = None) -> list[tuple[Solution, int]]:
    """Schedules to start a stage's search from, with their device memory: every heuristic's
    (greedy's whole curve of fewer SAVEd values among them), the chain solver's, and the lowest-
    peak schedule `lowest_plan` finds."""
    def starts() -> list:
        lowest = lowest_plan(graph, solver, effort=effort, time_limit=deadline, memo=memo, mip_solver=mip_solver)
        found = [(name, *c) for name in HEURISTICS for c in HEURISTICS[name](graph, 0, effort=effort)]
        found += [("chain", *c) for c in chain_candidates(graph, 0)]
        found.append((lowest.name, lowest.schedule, simulate(graph, lowest.schedule)))
        return found

    # (none depends on what the device holds beside: kept in the memo for the stages of one graph)
    found = starts() if memo is None else memo.stage_starts(graph, memo_key(solver, effort, True, mip_solver), starts)
    return [(Solution(schedule, timeline, name, "heuristic", 0.0), in_flight.device_peak(graph, schedule, timeline))
            for name, schedule, timeline in found if not timeline.over_host_budget]


def _solve_quietly(graph: Graph, budget: int, solver: str, effort: Effort, stops: SolveStops, mip_solver,
                   on_progress, memo: Memo | None = None) -> Solution | None:
    """`solve` with the next of ``stops``, None where nothing fits; the search reports a time
    limit once (`SolveStops.warn`), not each of its solves."""
    if budget <= 0:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SolverTimeoutWarning)
            return solve(graph, budget, solver, effort=effort, time_limit=stops.next(), memo=memo,
                         mip_solver=mip_solver, on_progress=on_progress)
    except InfeasibleBudgetError:
        return None


def stage_min_budget(graph: Graph, in_flight: InFlight, solver: str = "auto", *,
                     effort: Effort | float | None = None) -> int:
    """The least device memory with ``in_flight`` of the schedules `solve_stage` starts from."""
    return min(device for _, device in _candidates(graph, in_flight, solver, effort_of(effort), Deadline.of(None)))
