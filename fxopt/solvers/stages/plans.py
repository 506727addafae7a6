"""From the DP to exact plans, and the pipeline's predicted timing.

Every stage of the chosen cuts is planned by `solve_stage` on its own graph (the real stage
module's, when `fxopt.pipeline` captures it) and its memory checked; a stage that does not fit
raises that stage's margin in the DP by its excess, and the DP runs again (`cut_and_plan`,
`FEEDBACK_ROUNDS` times at most). The predicted step time and bubble (`pipeline_timing`) replay
the schedule's order of forwards and backwards per stage with each stage's planned times,
communication not counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from fxopt.errors import InfeasibleBudgetError
from fxopt.solvers.auto import Solution
from fxopt.solvers.effort import Deadline, Effort, effort_of
from fxopt.solvers.graph import Graph
from fxopt.solvers.minimum import infeasible
from fxopt.solvers.stages.cuts import assign_stages, stage_graph
from fxopt.solvers.stages.dp import CutModel, Split, best_split, min_peak_split, split_at, cut_model
from fxopt.solvers.stages.in_flight import InFlight, in_flight_count, solve_stage, stage_in_flight

# Times the DP runs again with a stage's margin raised by what its exact plan was over.
FEEDBACK_ROUNDS = 4


@dataclasses.dataclass(frozen=True)
class Timing:
    """A pipeline step as the schedule runs it: its length and the share of device time idle."""

    step_seconds: float
    bubble: float


def schedule_order(schedule: str, stages: int, microbatches: int, s: int) -> list[tuple[str, int]]:
    """The order stage ``s`` runs its forwards ("F", microbatch) and backwards ("B", microbatch)
    in, as torch's `ScheduleGPipe` and `Schedule1F1B` do."""
    m = microbatches
    if schedule == "GPipe":
        return [("F", b) for b in range(m)] + [("B", b) for b in range(m)]
    warmup = in_flight_count(schedule, stages, microbatches, s)
    order = [("F", b) for b in range(warmup)]
    for b in range(m):
        order.append(("B", b))
        if warmup + b < m:
            order.append(("F", warmup + b))
    return order


def pipeline_timing(forward: Sequence[float], backward: Sequence[float], microbatches: int,
                    schedule: str = "1F1B") -> Timing:
    """The schedule replayed with each stage's forward and backward seconds per microbatch
    (`replay`): the step's length and the share of device time idle."""
    actions = replay(forward, backward, microbatches, schedule)
    step = max((a[4] for a in actions), default=0.0)
    busy = microbatches * (sum(forward) + sum(backward))
    return Timing(step, 1.0 - busy / (len(forward) * step) if step > 0 else 0.0)


def replay(forward: Sequence[float], backward: Sequence[float], microbatches: int, schedule: str = "1F1B"
           ) -> list[tuple[int, str, int, float, float]]:
    """Every action of the schedule as (stage, "F" or "B", microbatch, start, end): an action
    starts when its stage is free and its input is there (a forward: the previous stage's
    forward of that microbatch; a backward: the next stage's backward, or on the last stage its
    own forward). Communication takes no time."""
    stages = len(forward)
    orders = [schedule_order(schedule, stages, microbatches, s) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free, nxt, out = [0.0] * stages, [0] * stages, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for s in range(stages):
            while nxt[s] < len(orders[s]):
                kind, b = orders[s][nxt[s]]
                dep = (("F", s - 1, b) if s else None) if kind == "F" else \
                    (("B", s + 1, b) if s < stages - 1 else ("F", s, b))
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = done[(kind, s, b)] = start + (forward[s] if kind == "F" else backward[s])
                out.append((s, kind, b, start, free[s]))
                nxt[s] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise AssertionError("the schedule's orders deadlock")
    return out


@dataclasses.dataclass(frozen=True)
class StageResult:
    """A stage planned exactly: its solution, its memory on the device (`InFlight.device_peak`)
    and its time per microbatch (forward; backward, its recomputation aside)."""

    solution: Solution
    device_bytes: int
    in_flight: InFlight
    forward_seconds: float
    backward_seconds: float

    @property
    def recompute_seconds(self) -> float:
        return self.solution.timeline.cost


def cut_and_plan(model: CutModel, budget: int, plan_stage: Callable[[int, Split, int], StageResult], *,
                 rounds: int = FEEDBACK_ROUNDS) -> tuple[Split, list[StageResult]]:
    """The DP's split, each stage planned exactly by ``plan_stage(s, split, budget)`` (which
    raises `InfeasibleBudgetError` naming the stage's smallest device budget when it does not
    fit); a stage over the budget raises its margin in the DP by the excess, and the DP runs
    again. If no round fits, the split with the lowest modelled memory is planned. Raises
    `InfeasibleBudgetError` with the smallest device budget that split needs, planned exactly."""
    margins = [0] * model.stages
    for _ in range(rounds):
        split = best_split(model, budget, margins)
        if split is None:
            break
        results, over = [], False
        for s in range(model.stages):
            try:
                results.append(_within(plan_stage(s, split, budget), budget))
            except InfeasibleBudgetError as err:
                # The model was short by at least what the exact plan is over.
                margins[s] += max(1, err.min_budget - budget) + max(0, budget - split.estimates[s].device_bytes)
                over = True
        if not over:
            return split, results
    split = min_peak_split(model)
    try:
        return split, [_within(plan_stage(s, split, budget), budget) for s in range(model.stages)]
    except InfeasibleBudgetError:
        pass
    need = max(_smallest(plan_stage, s, split) for s in range(model.stages))
    raise infeasible(budget, need, None, f"(Split into {model.stages} pipeline stages, {model.microbatches} "
                     f"microbatches, {model.schedule}; the budget is per device.)")


def plan_at_minimum(model: CutModel, plan_stage: Callable[[int, Split, int], StageResult], split: Split | None = None,
                    *, rounds: int = FEEDBACK_ROUNDS) -> tuple[Split, list[StageResult], int]:
    """``split`` (by default the one with the lowest modelled memory) planned at the smallest
    per-device budget its stages meet (``budget="min"``): each stage asked for its own smallest
    device budget (planned at 1 byte, the error names it), then every stage planned at the
    largest of them. Where a stage's named minimum is only a bound and the stage does not fit at
    it, the budget rises to what that stage then names, ``rounds`` times at most; returns the
    split, its stages' results and that budget."""
    split = split or min_peak_split(model)
    need = max(_smallest(plan_stage, s, split) for s in range(model.stages))
    for _ in range(rounds):
        try:
            return split, plan_split(model, split, need, plan_stage), need
        except InfeasibleBudgetError as err:
            if err.min_budget <= need:
                raise
            need = err.min_budget
    return split, plan_split(model, split, need, plan_stage), need


def _smallest(plan_stage: Callable[[int, Split, int], StageResult], s: int, split: Split) -> int:
    """Stage ``s``'s smallest device budget: what planning it at 1 byte names."""
    try:
        return plan_stage(s, split, 1).device_bytes
    except InfeasibleBudgetError as err:
        return err.min_budget


def _within(result: StageResult, budget: int) -> StageResult:
    """A stage's result, refused if its device memory is over the budget (never used over it)."""
    if result.device_bytes > budget:
        raise infeasible(budget, result.device_bytes, None)
    return result


def plan_split(model: CutModel, split: Split, budget: int, plan_stage: Callable[[int, Split, int], StageResult]
               ) -> list[StageResult]:
    """A given split's stages planned exactly (as for `cut_and_plan`); raises
    `InfeasibleBudgetError` with the largest smallest budget of the stages that do not fit."""
    results, need = [], 0
    for s in range(model.stages):
        try:
            results.append(_within(plan_stage(s, split, budget), budget))
        except InfeasibleBudgetError as err:
            need = max(need, err.min_budget)
    if need:
        raise infeasible(budget, need, None, f"(These {model.stages} pipeline stages, {model.microbatches} "
                         f"microbatches, {model.schedule}; the budget is per device.)")
    return results


def graph_in_flight(model: CutModel, graph: Graph, sub: Graph, s: int) -> InFlight:
    """What stage ``s`` (its graph ``sub``, part of ``graph``) holds beside one microbatch: the
    other in-flight microbatches' SAVEd values and outputs, what torch's runtime holds
    (`runtime_fixed`), and ``extra_fixed`` (`stage_in_flight`)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    received = sum(n.bytes for n in sub.nodes if n.kind == "input" and not n.tangent
                   and graph.nodes[index[n.name]].kind == "forward")
    sent = sum(sub.nodes[r].bytes for r in {sub.roots[i] for i in sub.forward_outputs})
    last = s == model.stages - 1
    held = model.last_held if last and model.last_held is not None else sent
    extra = model.extra_fixed[s] if s < len(model.extra_fixed) else 0
    grads = sum(n.bytes for n in sub.nodes if n.kind == "backward" and n.output and graph.nodes[index[n.name]].output)
    return stage_in_flight(model.schedule, model.stages, model.microbatches, s, received, sent, grads, held=held,
                           extra=extra)


def plan_split_graph(graph: Graph, model: CutModel, budget: int, split: Split, s: int, *, solver: str = "auto",
                     effort: Effort | float | None = None, time_limit: Deadline | float | None = None) -> StageResult:
    """Stage ``s`` of ``split`` planned by `solve_stage` on its part of ``graph`` (the simulated
    pipeline: no stage module is captured)."""
    stage, _ = assign_stages(graph, [model.points[c].position for c in split.cuts], model.origins)
    sub = stage_graph(graph, stage, s)
    in_flight = graph_in_flight(model, graph, sub, s)
    sol = solve_stage(sub, budget, in_flight, solver, effort=effort, time_limit=time_limit)
    return stage_result(sub, sol, in_flight)


def stage_result(sub: Graph, sol: Solution, in_flight: InFlight) -> StageResult:
    fwd = sum(sub.nodes[i].cost for i in sub.forward_required)
    bwd = sum(sub.nodes[i].cost for i in sub.backward_nodes)
    return StageResult(sol, in_flight.device_peak(sub, sol.schedule, sol.timeline), in_flight, fwd, bwd)


def plan_simulated(graph: Graph, stages: int, microbatches: int, budget: int, *, schedule: str = "1F1B",
                   solver: str = "auto", effort: Effort | float | None = None,
                   time_limit: Deadline | float | None = None,
                   cuts: Sequence[int] | None = None) -> tuple[CutModel, Split, list[StageResult], Timing]:
    """Cuts and exact stage plans for ``graph`` without processes or capture, each stage planned on
    its part of the graph with ``effort`` (each solve with ``time_limit``, its own safety stop:
    `SolveStops`); ``cuts`` (indices into the cut points): plan this split instead of the DP's.
    Returns the model, the split, the stages' results and the predicted timing."""
    effort = effort_of(effort)
    model = cut_model(graph, stages, microbatches, schedule, solver=solver, effort=effort, time_limit=time_limit)

    def plan_stage(s: int, split: Split, budget: int) -> StageResult:
        return plan_split_graph(graph, model, budget, split, s, solver=solver, effort=effort, time_limit=time_limit)

    if cuts is not None:
        split = split_at(model, cuts, budget)
        results = plan_split(model, split, budget, plan_stage)
    else:
        split, results = cut_and_plan(model, budget, plan_stage)
    return model, split, results, timing_of(results, microbatches, schedule)


def timing_of(results: Sequence[StageResult], microbatches: int, schedule: str) -> Timing:
    """`pipeline_timing` with each stage's planned forward and backward (its recomputation in it)."""
    return pipeline_timing([r.forward_seconds for r in results],
                           [r.backward_seconds + r.recompute_seconds for r in results], microbatches, schedule)
