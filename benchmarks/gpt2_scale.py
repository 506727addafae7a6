"""GPT-2 small shapes at half the eager peak: plan the 12-layer step, run the 4-layer one for real.

    python -m benchmarks.gpt2_scale [--skip-run] [--out benchmarks/results]

Model: `fxopt.models.gpt2` (GPT-2's architecture: pre-LN blocks, width 768, 12 heads, learned
positions, tied embeddings, dropout 0.1, vocabulary 50,257), sequence 512, batch 8, fp32, loss
returned by the model.

1. 12 layers: wall time of ``fxopt.plan(model, 0.5, inputs)`` (capture + analysis + solve), the
   plan's predicted peak, recompute cost and FLOPs, solver, status and the gap to the proven lower
   bound (and, untimed, which bound it is: the instant program's, valid for every schedule the
   simulator accepts, or the ILP's, valid within its model). When 50% is below the smallest peak
   fxopt reaches, the error's minimum is recorded and the plan is made at that minimum instead;
   `fxopt.solvers.instant.peak_lower_bound` gives the peak no schedule can go below.
2. 4 layers, the same way, then one real training step on CPU through ``fxopt.optimize`` at that
   budget: measured peak (`fxopt.measure_peak`), gradients against eager
   (``torch.testing.assert_close``), step times.

Plans are made with fxopt's disk cache off (``FXOPT_CACHE=0``), so the wall time is a fresh
solve. Writes ``<out>/gpt2_scale.md`` and ``gpt2_scale.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import meta_line, run_meta, write_results
from fxopt.models import gpt2, loss_of
from fxopt.solvers import SolverTimeoutWarning
from fxopt.solvers.instant import instant_solve, peak_lower_bound
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

GiB = 2**30


def step(model, inputs):
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss.detach()


def plan_at_half(layers: int, time_limit: float) -> tuple[dict, fxopt.Plan, tuple]:
    torch.manual_seed(0)
    model, inputs = gpt2(layers)
    row: dict = {"layers": layers, "fraction": 0.5}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        try:
            plan = fxopt.plan(model, 0.5, inputs, time_limit=time_limit)
        except fxopt.InfeasibleBudgetError as err:
            row["infeasible_at_half"] = True
            row["min_budget"] = err.min_budget
            row["seconds_to_error"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            plan = fxopt.plan(model, err.min_budget, inputs, time_limit=time_limit)
    row.update(
        plan_seconds=time.perf_counter() - t0,
        solve_seconds=plan.solve_seconds,
        nodes=len(plan.graph),
        budget=plan.budget_bytes,
        eager_peak=plan.eager_peak_bytes,
        predicted_peak=plan.peak_bytes,
        recompute_cost=plan.recompute_cost,
        recompute_flops=plan.recompute_flops,
        solver=plan.solver,
        status=plan.status,
        lower_bound_cost=plan.lower_bound_cost,
        gap=plan.gap,
    )
    # Untimed: which bound the plan's gap is to, and the peak no schedule can go below.
    inst = instant_solve(plan.graph, plan.budget_bytes, time_limit=time_limit)
    row["instant_bound"] = inst.bound
    row["bound_source"] = (None if plan.lower_bound_cost is None else
                           "instant" if inst.bound is not None and inst.bound >= plan.lower_bound_cost - 1e-9 else "ilp")
    row["peak_lower_bound"], row["peak_lower_bound_at"] = peak_lower_bound(plan.graph)
    print(json.dumps(row), flush=True)
    return row, plan, (model, inputs)


def run_for_real(row: dict, plan: fxopt.Plan, model, inputs) -> None:
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, plan=plan)
    times = {"eager": [], "fxopt": []}
    for name, m in (("eager", eager), ("fxopt", optimized)):
        torch.manual_seed(1)
        t0 = time.perf_counter()
        step(m, inputs)  # compiles fxopt's step on its first call
        times[name].append(time.perf_counter() - t0)
    torch.testing.assert_close([p.grad for p in optimized.parameters()], [p.grad for p in eager.parameters()])
    row["grads_equal"] = True
    for name, m in (("eager", eager), ("fxopt", optimized)):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        t0 = time.perf_counter()
        row[f"{name}_measured_peak"] = fxopt.measure_peak(step, m, inputs, resident=[m, inputs]).peak_bytes
        times[name].append(time.perf_counter() - t0)
    row["step_seconds"] = times
    row["measured_within_budget"] = row["fxopt_measured_peak"] <= plan.budget_bytes
    print(json.dumps({k: row[k] for k in ("eager_measured_peak", "fxopt_measured_peak", "measured_within_budget")}),
          flush=True)


def write(rows: list[dict], out: Path, meta: dict) -> None:
    g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    lines = ["# GPT-2 small shapes (width 768, 12 heads, seq 512, batch 8) at half the eager peak", "",
             f"{meta_line(meta)} · {meta['torch_threads']} CPU threads.",
             "Lower bound: proven, on the recompute cost of any plan within the budget (instant: valid for every "
             "schedule the simulator accepts; ilp: within the ILP's model). No schedule peaks below the proven "
             "minimum peak (`peak_lower_bound`).",
             "", "| layers | nodes | eager peak (pred.) GiB | 50% GiB | proven minimum peak GiB | smallest fxopt reaches GiB | "
             "budget used GiB | predicted peak GiB | measured peak GiB (eager) | plan wall s | solver (status) | +GFLOP | "
             "recompute cost s | lower bound s | gap |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        measured = (f"{g(r['fxopt_measured_peak'])} ({g(r['eager_measured_peak'])})"
                    if "fxopt_measured_peak" in r else "not run")
        lb = "—" if r["lower_bound_cost"] is None else f"{r['lower_bound_cost']:.3f} ({r.get('bound_source')})"
        gap = "—" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
        lines.append(
            f"| {r['layers']} | {r['nodes']} | {g(r['eager_peak'])} | {g(r['eager_peak'] / 2)} | "
            f"{g(r['peak_lower_bound'])} | "
            f"{g(r['min_budget']) if r.get('infeasible_at_half') else '≤ 50%'} | {g(r['budget'])} | "
            f"{g(r['predicted_peak'])} | {measured} | {r['plan_seconds']:.0f} | {r['solver']} ({r['status']}) | "
            f"{r['recompute_flops'] / 1e9:.0f} | {r['recompute_cost']:.3f} | {lb} | {gap} |")
    write_results(out / "gpt2_scale", {"meta": meta, "rows": rows}, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    parser.add_argument("--layers", type=int, nargs="*", default=[12, 4])
    parser.add_argument("--run-layers", type=int, default=4, help="run this depth for real (0: none)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    os.environ["FXOPT_CACHE"] = "0"  # time a fresh plan, never one from the disk cache
    meta = run_meta(" ".join(["python -m benchmarks.gpt2_scale", *(argv if argv is not None else sys.argv[1:])]))
    rows = []
    for layers in args.layers:
        row, plan, (model, inputs) = plan_at_half(layers, args.time_limit)
        rows.append(row)
        write(rows, args.out, meta)
        if layers == args.run_layers:
            run_for_real(row, plan, model, inputs)
            write(rows, args.out, meta)
        del plan, model, inputs
    return 0


if __name__ == "__main__":
    sys.exit(main())
