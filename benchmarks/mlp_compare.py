"""Peak memory, extra FLOPs and step time of one training step of REFERENCE.md §2's MLP under
eager, per-block torch.utils.checkpoint, torch.compile's activation_memory_budget and fxopt.

    python -m benchmarks.mlp_compare [--quick] [--out benchmarks/results]

Model: 8 residual blocks ``relu(l2(relu(l1(x)))) + x``, fp32, loss = output.sum() (inside the
model). Full: width 512, batch 4096. ``--quick``: width 256, batch 1024 and, unless
``--time-limit`` is given, a 5 s ILP time limit instead of 60 s (fxopt's infeasible-budget path
alone runs the ILP to its time limit, which would make the quick run take ~15 minutes).

Every method shares the same parameters and input and is measured the same way, by
`benchmarks.harness.Measurer` (also used by `benchmarks.pareto`; see its docstring): peak with
`fxopt.measure_peak` after a warm-up step, gradients against eager's, FLOPs with
`fxopt.measure.count_flops` (a dispatch mode that lets compiled code run under it), and the median
of 5 steps interleaved with eager steps.

Results go to ``<out>/mlp_compare.md`` and ``<out>/mlp_compare.json``, rewritten after every
row, so an interrupted run leaves what it has measured.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config

import fxopt
from benchmarks.harness import (Measurer, checkpoint_blocks, error_line, log, meta_line, mib, plan_fields, run_meta,
                                write_results)
from fxopt.models import mlp_workload as mlp

DEPTH = 8
TIMED_STEPS = 5
COMPILE_BUDGETS = (1.0, 0.5, 0.1, 0.0)
FXOPT_SOLVERS = ("checkpoint", "greedy", "ilp", "auto")
FXOPT_FRACTIONS = (1.0, 0.75, 0.5, 0.4)


# --------------------------------------------------------------------------------------------
# the benchmark


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.quick = args.quick
        workload = mlp(dict(blocks=DEPTH, width=256, batch=1024) if args.quick else dict(blocks=DEPTH, width=512, batch=4096))
        self.width, self.batch = workload.inputs[0].shape[1], workload.inputs[0].shape[0]
        self.time_limit = args.time_limit if args.time_limit is not None else (5.0 if args.quick else 60.0)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        self.workload = workload
        self.model = workload.model
        self.x = workload.inputs[0]
        self.m = Measurer(self.model, (self.x,), timed_steps=TIMED_STEPS)
        self.params_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.input_bytes = self.x.numel() * self.x.element_size()
        self.rows: list[dict[str, Any]] = []
        self.t_start = time.perf_counter()
        self.meta = run_meta(" ".join(["python -m benchmarks.mlp_compare", *(shlex.quote(a) for a in sys.argv[1:])]))
        self.meta.update({
            "width": self.width,
            "batch": self.batch,
            "depth": DEPTH,
            "dtype": "float32",
            "ilp_time_limit_s": self.time_limit,
            "params_bytes": self.params_bytes,
            "input_bytes": self.input_bytes,
        })

    @property
    def eager_peak(self) -> int | None:
        return self.m.eager_peak

    # ---- one method ------------------------------------------------------------------------

    def measure(self, row: dict[str, Any], build: Callable[[], Any], *, warmup_ctx=None,
                after_warmup: Callable[[Any, dict], None] | None = None) -> dict[str, Any]:
        """`benchmarks.harness.Measurer.measure`, logged. InfeasibleBudgetError propagates."""
        log(f"--- {row['method']} @ {row['budget']}")
        self.m.measure(row, build, warmup_ctx=warmup_ctx, after_warmup=after_warmup)
        log(f"    measured {mib(row['measured_peak_bytes'])} MiB, extra "
            f"{row.get('extra_flops', 0) / 1e9:.3f} GFLOP, ratio {row['step_ratio']:.2f}, "
            f"grads {'ok' if row.get('grads_equal', True) else 'MISMATCH'}")
        return row

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.write(final=False)

    # ---- methods ---------------------------------------------------------------------------

    def run_eager(self) -> None:
        # reference gradients (one warm-up step, then the reference step), then eager's row
        row = self.m.measure_eager({"method": "eager", "budget": "–"})
        log(f"--- eager: measured {mib(row['measured_peak_bytes'])} MiB")
        self.add(row)

    def run_checkpoint(self) -> None:
        row = self.measure({"method": "eager + torch.utils.checkpoint per block", "budget": "–"},
                           lambda: checkpoint_blocks(self.model, self.workload.blocks))
        self.add(row)

    def run_compile(self, amb: float) -> None:
        def ctx():
            return torch._functorch.config.patch(activation_memory_budget=amb)

        row = {"method": "torch.compile aot_eager_decomp_partition", "budget": f"activation_memory_budget={amb}",
               "activation_memory_budget": amb}
        try:
            self.measure(row, lambda: torch.compile(self.model, backend="aot_eager_decomp_partition"), warmup_ctx=ctx)
        except Exception as err:  # noqa: BLE001 - record, go on
            row["error"] = error_line(err)
            log(traceback.format_exc())
        self.add(row)

    def run_fxopt(self, solver: str, budget: int | float, label: str) -> int | None:
        """One fxopt row; returns err.min_budget when the budget was infeasible."""
        row: dict[str, Any] = {"method": f"fxopt {solver}", "solver_requested": solver, "budget": label,
                               "budget_arg": budget}

        plans = []

        def after_warmup(fn, row):
            plan = fn.plan
            plans.append(plan)
            row.update(plan_fields(plan))
            row.update({"saved": list(plan.saved), "recomputed": dict(plan.recomputed)})
            if len(fn.plans) != 1:
                row["notes"].append(f"{len(fn.plans)} plans were made")

        try:
            self.measure(row, lambda: fxopt.optimize(self.model, budget, solver=solver, time_limit=self.time_limit),
                         after_warmup=after_warmup)
        except fxopt.InfeasibleBudgetError as err:
            row.update({"infeasible": True, "budget_bytes": err.budget, "min_budget_bytes": err.min_budget})
            if err.min_budget <= err.budget:
                row.setdefault("notes", []).append(
                    f"InfeasibleBudgetError although min_budget {err.min_budget} <= budget {err.budget}")
            log(f"    infeasible: budget {mib(err.budget)} MiB, min_budget {mib(err.min_budget)} MiB "
                f"({err.min_budget} B) after {row['first_call_s']:.1f} s")
            self.add(row)
            return err.min_budget
        except Exception as err:  # noqa: BLE001 - record, go on
            row["error"] = error_line(err)
            log(traceback.format_exc())
        else:
            if row.get("extra_flops") is not None and row["extra_flops"] != row["predicted_extra_flops"]:
                row["notes"].append(
                    f"measured extra FLOPs {row['extra_flops']} != plan.recompute_flops {row['predicted_extra_flops']}")
            if not row["within_budget"] or row["measured_peak_bytes"] != row["predicted_peak_bytes"]:
                # keep the plan so the run can be replayed: fxopt.optimize(model, budget, plan=Plan.from_json(path))
                path = self.out / "plans" / f"{solver}_{row['budget_bytes']}_{len(self.rows)}.json"
                path.parent.mkdir(exist_ok=True)
                plans[-1].to_json(path)
                row["plan_json"] = str(path)
                row["notes"].append(f"measured - predicted = {row['measured_peak_bytes'] - row['predicted_peak_bytes']} B; plan saved to {path}")
            if not row["within_budget"]:
                row["notes"].append("MEASURED PEAK EXCEEDS BUDGET")
        self.add(row)
        return None

    def run(self) -> None:
        log(f"width {self.width}, batch {self.batch}, depth {DEPTH}; params {mib(self.params_bytes)} MiB, "
            f"input {mib(self.input_bytes)} MiB; ILP time limit {self.time_limit} s")
        self.run_eager()
        self.run_checkpoint()
        for amb in COMPILE_BUDGETS:
            self.run_compile(amb)
        assert self.eager_peak is not None
        half = self.params_bytes + (self.eager_peak - self.params_bytes) // 2
        self.meta["half_non_param_budget_bytes"] = half
        budgets: list[tuple[int | float, str]] = [(f, f"{f:g} of eager") for f in FXOPT_FRACTIONS]
        budgets.append((half, f"½ non-param ({half} B)"))
        for solver in FXOPT_SOLVERS:
            done_min: set[int] = set()
            for budget, label in budgets:
                min_budget = self.run_fxopt(solver, budget, label)
                if min_budget is not None and min_budget not in done_min:
                    done_min.add(min_budget)
                    again = self.run_fxopt(solver, int(min_budget), f"min_budget ({min_budget} B)")
                    if again is not None:
                        log(f"    still infeasible at its own min_budget: new min_budget {again}")
        self.write(final=True)

    # ---- output ----------------------------------------------------------------------------

    def write(self, *, final: bool) -> None:
        self.meta["elapsed_s"] = round(time.perf_counter() - self.t_start, 1)
        self.meta["complete"] = final
        self.meta["eager_measured_peak_bytes"] = self.eager_peak
        pred_eager = next((r["predicted_eager_peak_bytes"] for r in self.rows if "predicted_eager_peak_bytes" in r), None)
        self.meta["fxopt_predicted_eager_peak_bytes"] = pred_eager
        rows = [{k: v for k, v in r.items()} for r in self.rows]
        write_results(self.out / "mlp_compare", {"meta": self.meta, "rows": rows}, self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = [
            "# fxopt vs eager / checkpoint / torch.compile on the residual MLP",
            "",
            f"{meta_line(m)} · fxopt {m['fxopt']} · Python {m['python']} · "
            f"{m['cpu_count']} CPUs ({m['torch_threads']} torch threads) · "
            f"{'complete' if m['complete'] else 'INCOMPLETE (partial results)'}, {m['elapsed_s']:.0f} s",
            "",
            f"Model: {DEPTH} residual blocks `relu(l2(relu(l1(x)))) + x`, width {self.width}, batch {self.batch}, "
            f"fp32, loss = output.sum(). Parameters {mib(self.params_bytes)} MiB (gradients the same), "
            f"input {mib(self.input_bytes)} MiB. fxopt ILP time limit {self.time_limit:g} s.",
            "",
            "Measured peak = `fxopt.measure_peak` of one forward+backward after a warm-up step: parameters + "
            "input + everything allocated during the step (gradients included). Fractional fxopt budgets are "
            "fractions of fxopt's *predicted* eager peak "
            + (f"({mib(m['fxopt_predicted_eager_peak_bytes'])} MiB; measured eager: {mib(self.eager_peak)} MiB)"
               if m.get("fxopt_predicted_eager_peak_bytes") and self.eager_peak else "")
            + ". Extra GFLOP: FLOP-counting dispatch mode's count of the step minus eager's (fxopt's prediction in brackets "
            "where it differs). Step time ratio: median of 5 steps over the median of 5 eager steps interleaved "
            "with them (in brackets: fastest over fastest, less sensitive to other load) (this machine is shared with other jobs, so ratios are noisy; raw times are in the JSON). Planning s: fxopt's `plan.solve_seconds`; first call s: compile + plan + first step "
            "(for an infeasible budget: until the error, including fxopt's min_budget search).",
            "",
            "| method | budget | predicted peak MiB | measured peak MiB | measured ≤ budget? | extra GFLOP "
            "| step time ratio vs eager (min) | planning s | first call s | grads equal? | plan (solver, status) | notes |",
            "|---|---|---:|---:|:---:|---:|---:|---:|---:|:---:|---|---|",
        ]
        for r in self.rows:
            lines.append("| " + " | ".join(self.cells(r)) + " |")
        lines += ["", *self.findings()]
        return "\n".join(lines) + "\n"

    def cells(self, r: dict[str, Any]) -> list[str]:
        budget = r["budget"]
        if r.get("budget_bytes") is not None:
            budget += f" = {mib(r['budget_bytes'])} MiB"
        if r.get("infeasible"):
            return [r["method"], budget, f"infeasible: min_budget {mib(r['min_budget_bytes'])} MiB", "–", "–", "–",
                    "–", "–", f"{r['first_call_s']:.1f}", "–", "–", "; ".join(r.get("notes", []))]
        if r.get("error"):
            return [r["method"], budget, "–", "–", "–", "–", "–", "–", f"{r.get('first_call_s', 0):.1f}", "–", "–",
                    "ERROR: " + r["error"]]
        extra = r.get("extra_flops")
        extra_s = "–" if extra is None else f"{extra / 1e9:.3f}"
        pred_extra = r.get("predicted_extra_flops")
        if pred_extra is not None and pred_extra != extra:
            extra_s += f" ({pred_extra / 1e9:.3f})"
        if r["method"] == "eager" and self.meta.get("fxopt_predicted_eager_peak_bytes"):
            pred = f"({mib(self.meta['fxopt_predicted_eager_peak_bytes'])})"
        else:
            pred = mib(r["predicted_peak_bytes"]) if r.get("predicted_peak_bytes") is not None else "–"
        within = "–" if r.get("within_budget") is None else ("yes" if r["within_budget"] else "**NO**")
        grads = "–" if "grads_equal" not in r else ("yes" if r["grads_equal"] else
                                                     f"**NO** (max abs diff {r['grad_max_abs_diff']:.2e})")
        plan = f"{r['plan_solver']}, {r['plan_status']}" if r.get("plan_solver") else "–"
        solve = f"{r['solve_seconds']:.2f}" if r.get("solve_seconds") is not None else "–"
        return [r["method"], budget, pred, mib(r["measured_peak_bytes"]), within, extra_s, f"{r['step_ratio']:.2f} ({r['step_ratio_min']:.2f})",
                solve, f"{r['first_call_s']:.1f}", grads, plan, "; ".join(r.get("notes", []))]

    def findings(self) -> list[str]:
        out = ["Automatic checks:"]
        fx = [r for r in self.rows if r["method"].startswith("fxopt") and "measured_peak_bytes" in r]
        over = [r for r in fx if r.get("within_budget") is False]
        out.append(f"- fxopt rows whose measured peak exceeds the budget: {len(over)}"
                   + "".join(f"\n  - {r['method']} @ {r['budget']}: measured {mib(r['measured_peak_bytes'])} MiB > "
                             f"budget {mib(r['budget_bytes'])} MiB (predicted {mib(r['predicted_peak_bytes'])} MiB)"
                             for r in over))
        bad = [r for r in self.rows if r.get("grads_equal") is False]
        out.append(f"- rows whose gradients differ from eager: {len(bad)}"
                   + "".join(f"\n  - {r['method']} @ {r['budget']}: {r.get('grad_error')}" for r in bad))
        errs = [r for r in self.rows if r.get("error")]
        out.append(f"- rows that raised an error: {len(errs)}"
                   + "".join(f"\n  - {r['method']} @ {r['budget']}: {r['error']}" for r in errs))
        odd = [r for r in self.rows if r.get("infeasible") and r["min_budget_bytes"] <= r["budget_bytes"]]
        out.append(f"- InfeasibleBudgetError with min_budget <= budget: {len(odd)}"
                   + "".join(f"\n  - {r['method']} @ {r['budget']}: min_budget {r['min_budget_bytes']} B <= "
                             f"budget {r['budget_bytes']} B" for r in odd))
        ck = next((r for r in self.rows if "checkpoint per block" in r["method"] and "measured_peak_bytes" in r), None)
        if ck and fx:
            best = min(fx, key=lambda r: r["measured_peak_bytes"])
            cmp = "lower than" if ck["measured_peak_bytes"] < best["measured_peak_bytes"] else "not lower than"
            out.append(f"- per-block torch.utils.checkpoint measured {mib(ck['measured_peak_bytes'])} MiB, "
                       f"{cmp} fxopt's lowest measured peak {mib(best['measured_peak_bytes'])} MiB "
                       f"({best['method']} @ {best['budget']})")
        return out


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width 256, batch 1024 (and a 5 s ILP time limit)")
    parser.add_argument("--out", default="benchmarks/results", help="output folder (default benchmarks/results)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="fxopt ILP time limit in seconds (default 60; 5 with --quick)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    bench = Bench(args)
    bench.run()
    log(f"done in {time.perf_counter() - bench.t_start:.0f} s; wrote {bench.out}/mlp_compare.md and .json")


if __name__ == "__main__":
    main()
