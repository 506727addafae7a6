"""The promise on every route: measured peak within the budget, recompute no more than the best
simple policy's, the same plan on a quiet machine and a busy one (issue 24, "Done when").

    python -m benchmarks.budget_holds [--models hf-gpt2,lib-unet,...] [--routes optimize,inductor,...]
        [--budgets 1.0,0.5,min] [--size test] [--load] [--compare OTHER.json]
        [--out benchmarks/results/budget_holds]

Per model of the one zoo (`fxopt.models.MODELS`: the transformers models of `benchmarks.hf_zoo`
and the diffusers, timm and torchtitan models of `benchmarks.library_zoo`, built from configs at
``--size``), per route, per budget (a share of the eager peak, or ``"min"``: the smallest budget
fxopt meets), one row:

- routes: ``optimize`` (`fxopt.optimize`, the eager compiler), ``inductor`` (the same with
  ``compiler="inductor"``), ``backend`` (``torch.compile(model, backend=fxopt.backend(budget))``,
  Inductor), ``pieces`` (`fxopt.optimize` of the model with a graph break in its middle module:
  a forward hook calling ``torch._dynamo.graph_break()``, so the step is planned in pieces; a
  share is of eager's measured peak, given in bytes, as such a step needs),
  ``dynamic`` (`fxopt.optimize` with ``dynamic={"batch": (2, 2 * batch)}``, run at the batch);
  ``pipeline`` (`fxopt.pipeline` of `benchmarks.pipeline`'s GPT-2 in 4 stages, each rank's
  measured peak against the per-device budget: its own model, the ``--models`` do not apply);
- measured: `fxopt.measure_peak` of the second step (the first plans), parameters, inputs and
  gradients resident; ``within`` is measured <= budget (the budget the plan resolved to, bytes);
- gradients against eager's (``torch.testing.assert_close``, its default tolerances); where they
  differ, the row is run again in float64, model and inputs, against eager in float64
  (`float64_check`). Equal there, the float32 difference is rounding (Inductor's fused kernels
  sum in another order), which a ReLU can turn into a gradient difference far above the
  tolerance: an element of its input within rounding of 0 takes the other side, its mask
  flips, and a batch norm before it spreads that one gradient over every element of the
  layers below (the bench ResNet: 0.0066 on its stem's weight, as eager itself in channels-last
  differs from eager). Different there too, the rewrite is wrong;
- recompute: the plan's cost (the cost model's seconds, what the solvers minimise: FLOPs, per-op
  overhead, exposed transfers) and extra FLOPs against the cheapest simple policy within the same
  budget on the same graph (`benchmarks.harness.best_policy`), by that cost; ``not_worse`` where
  none fits is "–";
- an infeasible budget: the minimum fxopt names is planned and measured in turn (it must hold);
- the safety stop: every `SolverTimeoutWarning` of the row, on every route (``stopped``); a row
  the time limit cut is marked "(cut by the time limit)" and named under the table (its plan, or
  the minimum named, is the best found by then, not the counted effort's: another run may differ);
- the plan's decisions digest (SAVE/RECOMPUTE/COMPRESS/OFFLOAD of every value, its solver; on the
  pipeline route also its cuts, each stage's; never the seconds planning took): two
  runs, one with ``--load`` (another fxopt planning job runs beside it for the whole run), compared
  with ``--compare`` (the other run's JSON), must give the same digests.

One torch thread; fxopt's plan cache off (a cached plan would not be this run's answer).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import shlex
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn

import fxopt
import benchmarks.library_zoo  # noqa: F401 - registers the "library" and "hf" sets
from benchmarks.harness import (best_policy, choose, compare_grads, error_line, log, mib, report_head, restore_settings,
                                run_meta, saved_settings, train_step, write_results)
from fxopt.capture.dynamo import unwrap_compile_error
from fxopt.models import MODELS, zoo
from fxopt.solvers import DEFAULT_TIME_LIMIT, SolverTimeoutWarning

ROUTES = ("optimize", "inductor", "backend", "pieces", "dynamic", "pipeline")
BUDGETS = ("1.0", "0.5", "min")
DEFAULT_MODELS = ("hf-gpt2", "hf-llama", "hf-bert", "hf-vit", "hf-resnet", "lib-unet", "lib-vae", "lib-dit",
                  "lib-sd3", "lib-titan-llama3", "lib-titan-qwen3", "lib-timm-vit", "lib-timm-convnext")
DEFAULT_OUT = "benchmarks/results/budget_holds"


def budget_of(text: str) -> float | str:
    """A budget as the command line names it: a share of the eager peak, or "min"."""
    return text if text == "min" else float(text)


def decisions_digest(plan: fxopt.Plan) -> str:
    """What the plan decided (not how long it took): a short hash of its JSON without the timing."""
    record = plan.to_dict()
    record.pop("solve_seconds", None)
    return _digest(record)


def pipeline_digest(plan: fxopt.PipelinePlan) -> str:
    """`decisions_digest` of a pipeline's plan: its cuts, budget and every stage's plan and
    memory, without the seconds planning took (the whole plan's and each stage plan's)."""
    record = plan.to_dict()
    record.pop("solve_seconds", None)
    for stage in record["stages"]:
        stage["plan"].pop("solve_seconds", None)
    return _digest(record)


def _digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:12]


@contextlib.contextmanager
def graph_break_in_the_middle(model: nn.Module) -> Iterator[str]:
    """A graph break after the middle module with parameters of its own that no container holds
    (the step in pieces). A module of a ``ModuleList``, ``ModuleDict`` or ``Sequential`` runs in a
    loop, and a break inside a loop makes Dynamo run the looping frame eagerly, a step fxopt
    refuses (`docs/real-models.md`): for a transformer, the break falls after its last norm."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    held = {name for name, m in model.named_modules() if isinstance(m, containers)}
    leaves = [name for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))
              and not any(name.startswith(c + ".") for c in held)]
    name = leaves[len(leaves) // 2]
    handle = model.get_submodule(name).register_forward_hook(lambda *_: torch._dynamo.graph_break())
    try:
        yield name
    finally:
        handle.remove()


def build_route(route: str, model: nn.Module, budget: float | str, batch: int,
                time_limit: float) -> tuple[Callable, Callable]:
    """The callable a user steps, and a function giving the plans it made."""
    if route == "backend":
        backend = fxopt.backend(budget, time_limit=time_limit)
        return torch.compile(model, backend=backend), lambda: backend.plans
    options: dict[str, Any] = {"time_limit": time_limit}
    if route == "inductor":
        options["compiler"] = "inductor"
    if route == "dynamic":
        options["dynamic"] = {"batch": (2, 2 * max(batch, 2))}  # (sizes 0 and 1 specialize in Dynamo)
    optimized = fxopt.optimize(model, budget, **options)
    # (a step in pieces is planned again after its first call: the plans its measured call ran with)
    return optimized, lambda: optimized.step_plans or optimized.plans


class Eager:
    """One model's eager reference: its measured peak, loss and gradients."""

    def __init__(self, model: nn.Module, inputs: tuple):
        model.zero_grad(set_to_none=True)
        train_step(model, inputs)  # once first: lazy state (HF's problem_type) settles
        model.zero_grad(set_to_none=True)
        peak = fxopt.measure_peak(lambda *i: train_step(model, i), *inputs, resident=[model])
        self.peak_bytes, self.loss = peak.peak_bytes, float(peak.result)
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)


def model_row(name: str, route: str, budget: float | int | str, size: str, time_limit: float,
              dtype: torch.dtype | None = None) -> dict[str, Any]:
    """One measured step of ``name`` on ``route`` at ``budget`` (a share, bytes, or "min"); with
    ``dtype``, the model's floating-point parameters, buffers and inputs in it. Gradients that
    differ from eager's are checked again in float64 (`float64_check`)."""
    row: dict[str, Any] = {"model": name, "route": route, "budget": str(budget)}
    requested = budget
    torch.manual_seed(0)
    model, inputs = MODELS[name](size)
    if dtype is not None:
        model.to(dtype)
        inputs = tuple(x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
    eager = Eager(model, inputs)
    row["eager_peak_bytes"] = eager.peak_bytes
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if route == "pieces":
            row["graph_break_after"] = stack.enter_context(graph_break_in_the_middle(model))
            if isinstance(budget, float):  # (a step in pieces takes bytes: its eager peak is known only after)
                budget = int(budget * eager.peak_bytes)
        fn, plans_of = build_route(route, model, budget, inputs[0].shape[0], time_limit)
        train_step(fn, inputs)  # plans (and compiles)
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        model.zero_grad(set_to_none=True)
        peak = fxopt.measure_peak(lambda *i: train_step(fn, i), *inputs, resident=[model])
        plans = plans_of()
        # A step in pieces: each plan's budget is what the rest of the step left it; the step's is the user's
        # (at "min": the bound fxopt names for the step, `FxoptModule.peak_bound_bytes`).
        step_budget = (fn.peak_bound_bytes if budget == "min" else budget) if route == "pieces" else None
        row.update(plan_columns(plans, peak.peak_bytes, step_budget))
        row.update(compare_grads(model, eager.grads))
        row["loss_abs_diff"] = abs(float(peak.result) - eager.loss)
    if not row["grads_equal"] and dtype is None:
        row.update(float64_check(name, route, requested, size, time_limit))
    return row


def float64_check(name: str, route: str, budget: float | int | str, size: str, time_limit: float) -> dict[str, Any]:
    """The row's gradients against eager's, both in float64 (model, inputs, the plan made for
    them): whether a float32 difference is rounding (equal here: float64 rounds some 10^9 times
    finer, so a ReLU input within float32's rounding of 0 keeps its side) or the rewrite's
    (different here too). A share budget is a share of float64's eager peak; "min" float64's
    smallest."""
    torch._dynamo.reset()  # (a fresh process's Dynamo, as for every row)
    try:
        again = model_row(name, route, budget, size, time_limit, dtype=torch.float64)
    except Exception as err:  # noqa: BLE001 - the float32 row stands; the check says why it could not run
        inner = unwrap_compile_error(err) or err
        return {"grads_equal_float64": None, "float64_error": error_line(inner)}
    if "grads_equal" not in again:
        return {"grads_equal_float64": None, "float64_error": again.get("error", "no gradients compared")}
    return {"grads_equal_float64": again["grads_equal"], "grad_max_abs_diff_float64": again["grad_max_abs_diff"],
            "grad_error_float64": again["grad_error"], "loss_abs_diff_float64": again["loss_abs_diff"]}


def plan_columns(plans: list[fxopt.Plan], measured: int, step_budget: int | None = None) -> dict[str, Any]:
    """The row's plan figures: budget (``step_budget``, bytes, for a step in pieces; else the one
    the plan resolved), predicted and measured peaks, recompute against the best simple policy, the
    decisions' digest (one per piece)."""
    if not plans:
        return {"error": "no plan was made (the step ran unplanned)"}
    budget = step_budget if step_budget is not None else max(p.budget_bytes for p in plans)
    flops, cost = sum(p.recompute_flops for p in plans), sum(p.cost for p in plans)
    policies = [best_policy(p) for p in plans]
    unmet = any(p.get("best_policy") is None for p in policies)
    policy_cost = None if unmet else sum(p["best_policy_cost"] for p in policies)
    policy_flops = None if unmet else sum(p["best_policy_extra_flops"] for p in policies)
    return {"pieces": len(plans), "budget_bytes": budget, "predicted_peak_bytes": max(p.peak_bytes for p in plans),
            "measured_peak_bytes": measured, "within": measured <= budget,
            "solver": ",".join(sorted({p.solver for p in plans})), "status": ",".join(sorted({p.status for p in plans})),
            "extra_flops": flops, "cost": cost, "best_policy": ",".join(str(p.get("best_policy")) for p in policies),
            "best_policy_cost": policy_cost, "best_policy_flops": policy_flops,
            "not_worse": None if policy_cost is None else cost <= policy_cost * (1 + 1e-9),
            "digest": "+".join(decisions_digest(p) for p in plans)}


def pipeline_row(budget: float | int | str, time_limit: float) -> dict[str, Any]:
    """`fxopt.pipeline` of `benchmarks.pipeline`'s GPT-2, 4 stages, 1F1B, each rank measured."""
    from benchmarks import pipeline as bp

    row: dict[str, Any] = {"model": "pipeline-gpt2", "route": "pipeline", "budget": str(budget)}
    model, inputs, target = bp.workload(4)
    plan = fxopt.pipeline(model, inputs, stages=bp.STAGES, microbatches=bp.MICROBATCHES, budget=budget,
                          loss_fn=bp.lm_loss, target=target, time_limit=time_limit)
    ranks = bp.run_ranks(4, plan=plan)
    budget = plan.budget_bytes
    measured = max(r["peak"] for r in ranks)
    row.update({"pieces": len(plan.stages), "budget_bytes": budget, "measured_peak_bytes": measured,
                "within": measured <= budget, "predicted_peak_bytes": max(s.peak_bytes for s in plan.stages),
                "predicted_peaks": [s.peak_bytes for s in plan.stages], "measured_peaks": [r["peak"] for r in ranks],
                "solver": ",".join(s.plan.solver for s in plan.stages),
                "status": ",".join(s.plan.status for s in plan.stages), "digest": pipeline_digest(plan)})
    return row


@contextlib.contextmanager
def safety_stops() -> Iterator[list[str]]:
    """The messages of every `SolverTimeoutWarning` raised inside (a solve the safety stop,
    ``time_limit``, cut short: its plan, or the smallest budget it named, may differ on another
    run); every other warning silenced."""
    stopped: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")
        warnings.simplefilter("always", SolverTimeoutWarning)
        yield stopped
    stopped += [str(w.message) for w in caught if issubclass(w.category, SolverTimeoutWarning)]


def _busy(stop: Any, plans: Any) -> None:
    """Another fxopt planning job: plans a residual MLP at its smallest budget (``"min"``, which
    always plans) over and over, until ``stop``, counting its plans in ``plans``."""
    torch.set_num_threads(1)
    os.environ["FXOPT_CACHE"] = "0"
    from fxopt.models import ResidualMLP

    model, x = ResidualMLP(blocks=8, width=256), torch.randn(512, 256)
    while not stop.is_set():
        fxopt.plan(model, "min", (x,), time_limit=60)
        with plans.get_lock():
            plans.value += 1


@contextlib.contextmanager
def load_beside(on: bool, job: Callable[[Any, Any], None] = _busy) -> Iterator[dict[str, Any]]:
    """Runs ``job`` (by default `_busy`) in another process for the whole block, when ``on``. The
    block gets a dict whose ``"made"`` reads the plans the job has made so far, ``"alive"`` whether
    it runs, and ``"plans"`` is set at the end to the plans it made in all. A job that
    died before the block's end is an error: the run was not made under load as it would say
    (before, the job planned at 50%, which is infeasible for it, and died at once, unseen)."""
    seen: dict[str, Any] = {"plans": None}
    if not on:
        yield seen
        return
    ctx = multiprocessing.get_context("spawn")
    stop, plans = ctx.Event(), ctx.Value("i", 0)
    seen["made"] = lambda: plans.value
    process = ctx.Process(target=job, args=(stop, plans), daemon=True)
    process.start()
    seen["alive"] = process.is_alive
    try:
        yield seen
    finally:
        died = not process.is_alive()
        stop.set()
        process.join(timeout=120)
        if process.is_alive():
            process.terminate()
        seen["plans"] = plans.value
    if died:
        raise RuntimeError(f"the planning job beside the run died (exit code {process.exitcode}) after "
                           f"{plans.value} plans: the run was not under load; see its traceback above")


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.models = choose(args.models, tuple(zoo("hf")) + tuple(zoo("library")), "model")
        self.routes = choose(args.routes, ROUTES, "route")
        self.budgets = choose(args.budgets, BUDGETS, "budget")
        self.other = Path(args.compare) if args.compare else None
        command = "python -m benchmarks.budget_holds " + shlex.join(args.argv)
        self.result: dict[str, Any] = {"meta": run_meta(command, size=args.size, load_beside=args.load,
                                                        time_limit=args.time_limit), "rows": []}

    def cases(self) -> Iterator[tuple[str, str, str]]:
        for route in self.routes:
            for name in (("pipeline-gpt2",) if route == "pipeline" else self.models):
                for budget in self.budgets:
                    yield name, route, budget

    def execute(self) -> None:
        with load_beside(self.args.load) as beside:
            for name, route, budget in self.cases():
                log(f"budget_holds: {name} {route} {budget}")
                t0 = time.perf_counter()
                row = self.attempt(name, route, budget_of(budget))
                row["budget"] = budget
                if row.get("infeasible") and row.get("min_budget_bytes"):
                    # The minimum the error names must plan, and measure within itself (item 8).
                    at_min = self.attempt(name, route, row["min_budget_bytes"])
                    row["named_min"] = {k: at_min.get(k) for k in ("within", "measured_peak_bytes", "error",
                                                                   "infeasible", "min_budget_bytes", "stopped")}
                row["row_s"] = round(time.perf_counter() - t0, 1)
                self.mark_same(row)
                log(f"  {row.get('within')} {mib(row.get('measured_peak_bytes'))} / {mib(row.get('budget_bytes'))} "
                    f"{row.get('error', '')}")
                self.result["rows"].append(row)
                write_results(self.args.out, self.result, report(self.result))
        if self.args.load:
            self.result["meta"]["load_beside_plans"] = beside["plans"]
            write_results(self.args.out, self.result, report(self.result))

    def attempt(self, name: str, route: str, budget: float | int | str) -> dict[str, Any]:
        """The row, or what stopped it: infeasible (with the minimum fxopt names), or the error;
        on every route, what the safety stop said (``stopped``; see `safety_stops`)."""
        with safety_stops() as stopped:
            row = self._attempt(name, route, budget)
        row["stopped"] = stopped
        return row

    def _attempt(self, name: str, route: str, budget: float | int | str) -> dict[str, Any]:
        try:
            if route == "pipeline":
                return pipeline_row(budget, self.args.time_limit)
            return model_row(name, route, budget, self.args.size, self.args.time_limit)
        except Exception as err:  # noqa: BLE001 - one failing row must not stop the others
            # (torch.compile wraps what the backend route's planner raises: BackendCompilerFailed)
            inner = unwrap_compile_error(err)
            if isinstance(inner, fxopt.InfeasibleBudgetError):
                return {"model": name, "route": route, "infeasible": True, "budget_bytes": inner.budget,
                        "min_budget_bytes": inner.min_budget}
            log(traceback.format_exc(limit=6))
            return {"model": name, "route": route, "error": error_line(err)}
        finally:
            torch._dynamo.reset()  # each row starts from a process that compiled nothing (a failed one too)

    def mark_same(self, row: dict[str, Any]) -> None:
        if self.other is None or not self.other.exists():
            return
        other = json.loads(self.other.read_text())  # (read again each row: the other run may still be going)
        twin = next((r for r in other["rows"] if (r["model"], r["route"], r["budget"]) ==
                     (row["model"], row["route"], row["budget"])), None)
        if twin is not None and "digest" in twin and "digest" in row:
            row["same_plan_as_other_run"] = twin["digest"] == row["digest"]


def _yes(value: Any) -> str:
    return "–" if value is None else ("yes" if value else "**NO**")


def _grads(row: dict[str, Any]) -> str:
    """The row's gradients: equal; float32 rounding (different in float32, equal in float64);
    or **NO** (different in float64 too, or not checked there: the reason follows)."""
    if row.get("grads_equal") is not False:
        return _yes(row.get("grads_equal"))
    if row.get("grads_equal_float64"):
        return "rounding (yes in float64)"
    if row.get("grads_equal_float64") is None and row.get("float64_error"):
        return f"**NO** (float64 not checked: {row['float64_error']})"
    return "**NO** (in float64 too)"


def report(result: dict[str, Any]) -> str:
    meta, rows = result["meta"], result["rows"]
    lines = report_head("Budget holds on every route (issue 24)", meta,
                        f"size {meta['size']} · another planning job beside it: {meta['load_beside']}"
                        + (f" ({meta['load_beside_plans']} plans made)" if meta.get("load_beside_plans") is not None
                           else ""))
    lines += ["| model | route | budget | budget MiB | predicted | measured | within | grads equal | extra GFLOP | "
              "best simple policy (GFLOP) | cost / policy's | not worse | plan digest | same plan as other run |",
              "|---|---|---|---:|---:|---:|---|---|---:|---|---:|---|---|---|"]
    for r in rows:
        if "error" in r or r.get("infeasible"):
            what = r.get("error") or f"infeasible; fxopt's minimum {mib(r.get('min_budget_bytes'))} MiB"
            named = r.get("named_min")
            if named:
                what += (f", which measures {mib(named['measured_peak_bytes'])}: within {_yes(named['within'])}"
                         if named.get("within") is not None else
                         f", which does not plan: {named.get('error') or 'infeasible, ' + mib(named.get('min_budget_bytes'))}")
            lines.append(f"| {r['model']} | {r['route']} | {r['budget']} | {mib(r.get('budget_bytes'))} | "
                         f"{what}{_cut(r)} ||||||||||")
            continue
        policy = "–" if r.get("best_policy_flops") is None else f"{r['best_policy']} ({r['best_policy_flops'] / 1e9:.3f})"
        flops = "–" if r.get("extra_flops") is None else f"{r['extra_flops'] / 1e9:.3f}"
        ratio = ("–" if not r.get("best_policy_cost") else f"{r['cost'] / r['best_policy_cost']:.2f}")
        lines.append(f"| {r['model']} | {r['route']} | {r['budget']} | {mib(r['budget_bytes'])} | "
                     f"{mib(r.get('predicted_peak_bytes'))} | {mib(r['measured_peak_bytes'])} | {_yes(r['within'])} | "
                     f"{_grads(r)} | {flops} | {policy} | {ratio} | {_yes(r.get('not_worse'))} | "
                     f"`{r['digest']}`{_cut(r)} | {_yes(r.get('same_plan_as_other_run'))} |")
    held = [r for r in rows if "within" in r]
    named = [r["named_min"] for r in rows if r.get("named_min")]
    lines += ["", f"{sum(r['within'] for r in held)} of {len(held)} planned rows measured within their budget; "
              f"{sum(1 for r in rows if r.get('grads_equal') is False and not r.get('grads_equal_float64'))} rows' "
              f"gradients differ from eager's ({sum(1 for r in rows if r.get('grads_equal_float64'))} more differ in "
              "float32 only, equal in float64: rounding); "
              f"{sum(1 for r in rows if r.get('not_worse') is False)} rows recompute more than the best simple "
              f"policy; {sum(1 for r in rows if 'error' in r)} rows failed to run; of the minimums the infeasible rows "
              f"named, {sum(1 for n in named if n.get('within'))} of {len(named)} planned and measured within themselves; "
              f"{_stops(rows, meta.get('time_limit'))}."]
    return "\n".join(lines) + "\n"


def _cut(row: dict[str, Any]) -> str:
    return " (cut by the time limit)" if row.get("stopped") or (row.get("named_min") or {}).get("stopped") else ""


def _stops(rows: list[dict[str, Any]], time_limit: float | None) -> str:
    """How many rows the safety stop cut (their plans, or the minimum named, may differ on another
    run: not the counted effort's answer), and which."""
    cut = [f"{r['model']} {r['route']} {r['budget']}" for r in rows if _cut(r)]
    limit = f" (time_limit {time_limit:g} s)" if time_limit else ""
    return (f"{len(cut)} rows cut by the safety stop{limit}: {', '.join(cut)}" if cut
            else "no row reached the safety stop")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--budgets", default=",".join(BUDGETS))
    parser.add_argument("--size", default="test", choices=("test", "bench"))
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT)
    parser.add_argument("--load", action="store_true", help="run another fxopt planning job beside this one")
    parser.add_argument("--compare", help="another run's JSON (it may still be running): mark whether each row's "
                        "plan is the same")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    saved = saved_settings()
    torch.set_num_threads(1)
    os.environ["FXOPT_CACHE"] = "0"
    try:
        Run(args).execute()
    finally:
        restore_settings(saved)
    log(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()
