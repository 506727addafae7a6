"""Pipeline stage cuts: where to split a training step into stages, and each stage's plan.

A pipeline runs a step as S stages on S devices, each on M microbatches in turn. Stage s of
torch's 1F1B runs ``k_s = min(M, S - s)`` forwards before its first backward, so it holds the
SAVEd values of k_s microbatches at once (GPipe: all M); stage 0 holds S of them, the last one.
Equal layers per stage give unequal memory, and the stage that runs out decides the batch size.
This package chooses the cuts and, with fxopt's own `solve`, each stage's rematerialization, in
five modules, one per job:

  - `in_flight`: a stage's memory on its device beside one microbatch's step (`InFlight`,
    `runtime_fixed`), and `solve_stage`, the cheapest plan of one stage within a device budget;
  - `cuts`: where the forward can be cut (`cut_points`, `choose_points`), and each stage's part
    of the graph (`assign_stages`, `stage_graph`);
  - `atoms`: the forward between consecutive cut points, each with its remat options, planned
    once per structure (`atom_options`);
  - `dp`: the dynamic program over cut points (`best_split`), minimizing the slowest stage's time
    with every stage's modelled memory within the budget;
  - `plans`: from the DP's split to exact stage plans (`cut_and_plan`, the DP run again with a
    margin where a stage's exact plan is over; `plan_at_minimum`, for ``budget="min"``: the split
    of lowest modelled memory at the smallest budget its stages meet), and the schedule's
    predicted timing
    (`pipeline_timing`, `replay`).

What is approximate: inside the DP a stage's plan is not solved (the atoms' options are composed,
not simulated). What is exact: every stage of the chosen cuts is then planned by `solve_stage` on
its own graph (the real stage module's, when `fxopt.pipeline` captures it) and its memory checked.

Every solve here (an atom's, a stage search's) has counted effort and a safety stop of its own
(`SolveStops`), so that the cuts and plans are the same on a busy machine as on a quiet one.
"""

from fxopt.solvers.auto import eager_schedule
from fxopt.solvers.stages.atoms import ATOM_LEVELS, SAVED_LEVELS, Atom, atom_of, atom_options
from fxopt.solvers.stages.cuts import (MAX_CROSSING, MAX_POINTS, POINTS_PER_STAGE, CutPoint, assign_stages,
                                       choose_points, cut_points, forward_order, input_spans, stage_graph)
from fxopt.solvers.stages.dp import (CutModel, Split, StageEstimate, balanced_cuts, best_split, cut_model,
                                     min_peak_split, split_at)
from fxopt.solvers.stages.in_flight import (SCHEDULES, STAGE_SOLVES, STAGE_TOLERANCE, InFlight, SolveStops,
                                            accumulation, in_flight_count, runtime_fixed, solve_stage,
                                            stage_in_flight, stage_min_budget)
from fxopt.solvers.stages.plans import (FEEDBACK_ROUNDS, StageResult, Timing, cut_and_plan, graph_in_flight,
                                        pipeline_timing, plan_at_minimum, plan_simulated, plan_split,
                                        plan_split_graph, replay, schedule_order, stage_result, timing_of)

__all__ = ["eager_schedule", "ATOM_LEVELS", "SAVED_LEVELS", "Atom", "atom_of", "atom_options", "MAX_CROSSING", "MAX_POINTS",
           "POINTS_PER_STAGE", "CutPoint", "assign_stages", "choose_points", "cut_points", "forward_order",
           "input_spans", "stage_graph", "CutModel", "Split", "StageEstimate", "balanced_cuts", "best_split",
           "cut_model", "min_peak_split", "split_at", "SCHEDULES", "STAGE_SOLVES", "STAGE_TOLERANCE", "InFlight", "SolveStops",
           "accumulation", "in_flight_count", "runtime_fixed", "solve_stage", "stage_in_flight", "stage_min_budget",
           "FEEDBACK_ROUNDS", "StageResult", "Timing", "cut_and_plan", "graph_in_flight", "pipeline_timing",
           "plan_at_minimum", "plan_simulated", "plan_split", "plan_split_graph", "replay", "schedule_order",
           "stage_result", "timing_of"]
