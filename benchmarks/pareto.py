"""Memory vs recompute Pareto fronts: fxopt against what users would pick instead, on five models.

    python -m benchmarks.pareto [--quick] [--models gpt2,bert] [--out benchmarks/results/pareto]

Methods, each at budgets from 100% down to the smallest it reaches, all sharing one model and its
inputs and measured the same way (`benchmarks.harness`):

- ``eager``;
- ``checkpoint``: ``torch.utils.checkpoint`` (``use_reentrant=False``) around every block/layer;
- ``compile``: ``torch.compile(backend="aot_eager_decomp_partition")`` (AOTAutograd's min-cut
  partitioner without Inductor's fusion, so its FLOPs are counted exactly) with
  ``torch._functorch.config.activation_memory_budget`` at several values, for each knapsack
  solver (``activation_memory_budget_solver``: ``dp``, ``greedy``, ``ilp``; at 1.0 and 0.0 the
  solver is not consulted, so those rows are shared by every solver's line);
- ``inductor``: ``torch.compile`` with Inductor, ``activation_memory_budget`` at a few values
  (solver ``dp``, the default);
- ``fxopt``: ``fxopt.optimize(model, budget, solver=...)`` for every solver in
  ``fxopt.solvers.SOLVERS``, at 100% (the float 1.0: fxopt's predicted eager peak, nothing to
  rewrite), at fractions of *eager's measured peak* (bytes) above the solver's minimum, and at
  exactly that minimum (``InfeasibleBudgetError.min_budget`` from planning at a 1-byte budget);
- ``fxopt-inductor``: ``torch.compile(model, backend=fxopt.backend(budget=..., compiler="inductor"))``
  when this fxopt has ``fxopt.backend``; recorded as not available otherwise.

Per point: measured peak, fxopt's predicted peak and budget, extra FLOPs over eager's, step time
(median of interleaved steps, as a ratio to eager's), first-call time (compile + plan + first
step), fxopt's solve time, and whether the gradients equal eager's.

Presets: ``--quick`` (sizes "quick", ILP time limit 10 s, budgets 100% / 50% / minimum, Inductor
only at budget 1.0, fxopt's backend at one budget) took 16-18 minutes on the project's shared 2-core
CPU, most of it Inductor compiles (20-100 s each when Inductor's on-disk cache is cold) and fxopt's
ILP (the minimum-budget search can run it twice to its time limit). The default full set (sizes
"full", ILP time limit 30 s, more budgets) has not been run yet; expect well over 30 minutes.
``--size tiny`` is for tests. On CPU the run uses 1 torch thread (``--threads``) and turns
fxopt's on-disk plan cache off (``FXOPT_CACHE=0`` unless set), so planning times are real.

On CUDA (``--device cuda``, the default when a GPU is present) peaks come from
``torch.cuda.max_memory_allocated`` through `fxopt.measure_peak`; `benchmarks/gpu_run.sh` runs a
reduced set within a deadline.

Writes ``<out>/<model>.md`` / ``.json`` / ``.png`` and ``<out>/summary.md`` / ``.json``, rewritten
after every row, so an interrupted run leaves what it has measured (marked incomplete).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import shlex
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
from benchmarks.harness import (Measurer, checkpoint_blocks, choose, error_line, log, mib, plan_fields, run_meta,
                                restore_settings, run_to_end, saved_settings)
from fxopt.models import Workload, zoo
from fxopt.solvers import SOLVERS

MODELS = zoo("benchmark")  # the zoo's benchmark models (`fxopt.models.MODELS`)
SIZES = ("tiny", "quick", "full")

METHODS = ("eager", "checkpoint", "compile", "inductor", "fxopt", "fxopt-inductor")
COMPILE_SOLVERS = ("dp", "greedy", "ilp")


@dataclasses.dataclass(frozen=True)
class Preset:
    size: str
    compile_budgets: tuple[float, ...]  # activation_memory_budget values, aot_eager backend
    inductor_budgets: tuple[float, ...]
    fractions: tuple[float, ...]  # fxopt budgets: 1.0, then fractions of eager's measured peak
    backend_fractions: tuple[float, ...]  # the same for fxopt's torch.compile backend
    backend_min: bool  # also run the backend at its minimum (else only when no fraction fits)
    time_limit: float  # fxopt's ILP time limit, seconds
    timed_steps: int


PRESETS = {
    "quick": Preset("quick", compile_budgets=(1.0, 0.5, 0.0), inductor_budgets=(1.0,),
                    fractions=(1.0, 0.5), backend_fractions=(0.5,), backend_min=False, time_limit=10.0,
                    timed_steps=5),
    "full": Preset("full", compile_budgets=(1.0, 0.75, 0.5, 0.25, 0.0), inductor_budgets=(1.0, 0.5, 0.0),
                   fractions=(1.0, 0.75, 0.5, 0.35), backend_fractions=(1.0, 0.5), backend_min=True,
                   time_limit=30.0, timed_steps=7),
}


class Deadline(Exception):
    """The run's deadline passed: stop starting rows, keep what is measured."""


# --------------------------------------------------------------------------------------------
# one model


class ModelBench:
    def __init__(self, workload: Workload, run: Run):
        self.w = workload
        self.run = run
        self.cfg = run.cfg
        self.rows: list[dict[str, Any]] = []
        torch.manual_seed(0)
        self.m = Measurer(workload.model, workload.inputs, timed_steps=self.cfg.timed_steps)
        model = workload.model
        self.info: dict[str, Any] = {
            "name": workload.name,
            "description": workload.description,
            "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "inputs_bytes": sum(x.numel() * x.element_size() for x in workload.inputs),
            "blocks_checkpointed": len(workload.blocks),
            "complete": False,
        }
        self.t0 = time.perf_counter()

    # ---- rows -----------------------------------------------------------------------------

    def row(self, method: str, line: str, budget: str, **fields: Any) -> dict[str, Any]:
        return {"model": self.w.name, "method": method, "line": line, "budget": budget, **fields}

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        peak = row.get("measured_peak_bytes")
        if peak is not None:
            log(f"    {row['line']} @ {row['budget']}: measured {mib(peak)} MiB, extra "
                f"{row.get('extra_flops', 0) / 1e9:.3f} GFLOP, step x{row['step_ratio']:.2f}, "
                f"grads {'ok' if row.get('grads_equal', True) else 'DIFFER'}, first call {row['first_call_s']:.1f} s")
        else:
            log(f"    {row['line']} @ {row['budget']}: "
                + (f"infeasible (min_budget {mib(row.get('min_budget_bytes'))} MiB)" if row.get("infeasible")
                   else row.get("error") or "not available"))
        self.run.write()

    def attempt(self, row: dict[str, Any], build: Callable[[], Any], *, ctx: Callable[[], Any] | None = None,
                after_warmup: Callable[[Any, dict], None] | None = None) -> dict[str, Any]:
        """Measure one row; record an error instead of raising (except a deadline)."""
        self.run.check_deadline()
        log(f"--- {self.w.name}: {row['line']} @ {row['budget']}")
        self.add(self.m.attempt(row, build, ctx=ctx, after_warmup=after_warmup))
        return row

    # ---- methods --------------------------------------------------------------------------

    def run_all(self) -> None:
        methods = self.run.methods
        log(f"=== {self.w.name}: {self.w.description}; params {mib(self.info['params_bytes'])} MiB, "
            f"inputs {mib(self.info['inputs_bytes'])} MiB")
        self.run.check_deadline()
        eager = self.row("eager", "eager", "–")
        self.m.measure_eager(eager)
        self.info["eager_measured_peak_bytes"] = self.m.eager_peak
        self.info["eager_flops"] = self.m.eager_flops
        self.add(eager)
        if "checkpoint" in methods:
            self.attempt(self.row("checkpoint", "torch.utils.checkpoint per block", "–"),
                         lambda: checkpoint_blocks(self.w.model, self.w.blocks))
        if "compile" in methods:
            self.run_compile("aot_eager_decomp_partition", "compile", self.cfg.compile_budgets, COMPILE_SOLVERS)
        if "inductor" in methods:
            self.run_compile("inductor", "inductor", self.cfg.inductor_budgets, ("dp",))
        if "fxopt" in methods:
            for solver in self.run.fxopt_solvers:
                self.run_fxopt(solver)
            if "auto" in self.run.fxopt_solvers:
                self.run_fxopt_at_peer_peaks("auto")
        if "fxopt-inductor" in methods:
            self.run_fxopt_backend()
        self.info["complete"] = True

    def note_inductor_flops(self, fn: Any, row: dict[str, Any]) -> None:
        row["notes"].append("FLOPs inside Inductor's kernels are not counted (only the matrix products "
                            "and convolutions it calls through the dispatcher)")

    def run_compile(self, backend: str, method: str, budgets: tuple[float, ...], solvers: tuple[str, ...]) -> None:
        label = "aot_eager" if backend.startswith("aot_eager") else backend
        for amb in budgets:
            # The knapsack solver is consulted only strictly between 0 and 1.
            for solver in (solvers if 0.0 < amb < 1.0 else (None,)):
                def ctx(amb=amb, solver=solver):
                    patch = {"activation_memory_budget": amb}
                    if solver is not None:
                        patch["activation_memory_budget_solver"] = solver
                    return torch._functorch.config.patch(**patch)

                line = f"torch.compile {label}" + (f" ({solver})" if solver else "")
                row = self.row(method, line, f"amb {amb:g}", backend=backend, activation_memory_budget=amb,
                               solver=solver)
                self.attempt(row, lambda: torch.compile(self.w.model, backend=backend), ctx=ctx,
                             after_warmup=self.note_inductor_flops if backend == "inductor" else None)

    def fxopt_budgets(self, fractions: tuple[float, ...], min_budget: int | None) -> list[tuple[int | float, str]]:
        eager = self.m.eager_peak
        budgets: list[tuple[int | float, str]] = []
        for f in fractions:
            if f >= 1.0:
                budgets.append((1.0, "100%"))
            elif min_budget is None or int(f * eager) > min_budget:
                budgets.append((int(f * eager), f"{f:.0%}"))
        if min_budget is not None and min_budget < self.info.get("predicted_eager_peak_bytes", min_budget + 1):
            budgets.append((int(min_budget), "min"))
        return budgets

    def find_min_budget(self, solver: str) -> int | None:
        """The smallest peak ``solver`` reaches (``InfeasibleBudgetError.min_budget`` of a 1-byte
        budget); also fxopt's predicted eager peak."""
        self.run.check_deadline()
        t0 = time.perf_counter()
        log(f"--- {self.w.name}: fxopt {solver}: searching the smallest budget")
        found = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if "graph_nodes" not in self.info:
                    plan = fxopt.plan(self.w.model, 1.0, self.w.inputs, solver="save_all")
                    self.info["predicted_eager_peak_bytes"] = plan.eager_peak_bytes
                    self.info["graph_nodes"] = len(plan.graph)
                fxopt.plan(self.w.model, 1, self.w.inputs, solver=solver, time_limit=self.run.time_limit)
        except fxopt.InfeasibleBudgetError as err:
            found = err.min_budget
        except Exception as err:  # noqa: BLE001
            log(f"    min-budget search failed: {error_line(err)}")
        torch._dynamo.reset()
        self.info.setdefault("min_budget_search_s", {})[solver] = round(time.perf_counter() - t0, 2)
        self.info.setdefault("min_budget_bytes", {})[solver] = found
        log(f"    min budget {mib(found)} MiB ({time.perf_counter() - t0:.1f} s)")
        return found

    def run_fxopt(self, solver: str) -> None:
        if solver == "save_all":  # eager's choice: only 100% fits
            budgets: list[tuple[int | float, str]] = [(1.0, "100%")]
        else:
            budgets = self.fxopt_budgets(self.cfg.fractions, self.find_min_budget(solver))
        for budget, label in budgets:
            row = self.row("fxopt", f"fxopt {solver}", label, solver=solver, budget_arg=budget)
            if label == "min":
                row["min_budget_search_s"] = self.info["min_budget_search_s"].get(solver)
            self.attempt(row, lambda: fxopt.optimize(self.w.model, budget, solver=solver, time_limit=self.run.time_limit),
                         after_warmup=self.record_plan)
            self.check_fxopt_row(row)

    def run_fxopt_at_peer_peaks(self, solver: str) -> None:
        """fxopt at exactly each peer's measured peak (as a byte budget) that no fxopt point yet
        reaches with no more extra FLOPs: the fractions above need not fall on the peers' peaks."""
        from benchmarks.pareto_report import PEAK_TOLERANCE, dominance

        min_budget = self.info.get("min_budget_bytes", {}).get(solver)
        slack = PEAK_TOLERANCE * self.m.eager_peak
        tried: list[int] = []
        while True:
            open_points = [d for d in dominance(self.rows) if d["verdict"] != "yes"
                           and all(abs(d["peer_peak_bytes"] - t) > slack for t in tried)
                           and (min_budget is None or d["peer_peak_bytes"] >= min_budget)]
            if not open_points:
                return
            d = max(open_points, key=lambda d: d["peer_peak_bytes"])
            budget = d["peer_peak_bytes"]
            tried.append(budget)
            row = self.row("fxopt", f"fxopt {solver}", "peer peak", solver=solver, budget_arg=budget,
                           peer=f"{d['peer']} @ {d['peer_budget']}")
            row["notes"] = [f"budget = measured peak of {d['peer']} @ {d['peer_budget']}"]
            self.attempt(row, lambda: fxopt.optimize(self.w.model, budget, solver=solver, time_limit=self.run.time_limit),
                         after_warmup=self.record_plan)
            self.check_fxopt_row(row)
            if row.get("error"):
                return  # the same error would recur at every other peer's peak

    def run_fxopt_backend(self, solver: str = "auto") -> None:
        line = f"fxopt backend + inductor ({solver})"
        if not hasattr(fxopt, "backend"):
            self.add(self.row("fxopt-inductor", line, "–", not_available=True,
                              notes=["fxopt.backend does not exist in this fxopt"]))
            return
        min_budget = self.info.get("min_budget_bytes", {}).get(solver)
        if min_budget is None and solver not in self.info.get("min_budget_bytes", {}):
            min_budget = self.find_min_budget(solver)
        params = inspect.signature(fxopt.backend).parameters
        budgets = self.fxopt_budgets(self.cfg.backend_fractions, min_budget)
        if not self.cfg.backend_min and any(label not in ("100%", "min") for _, label in budgets):
            budgets = [(b, label) for b, label in budgets if label != "min"]
        for budget, label in budgets:
            kwargs: dict[str, Any] = {"budget": budget, "compiler": "inductor"}
            if "solver" in params:
                kwargs["solver"] = solver
            if "time_limit" in params:
                kwargs["time_limit"] = self.run.time_limit
            backend_holder: list[Any] = []

            def build(kwargs=kwargs):
                backend = fxopt.backend(**kwargs)
                backend_holder.append(backend)
                return torch.compile(self.w.model, backend=backend)

            def after_warmup(fn, row):
                self.note_inductor_flops(fn, row)
                plan = _plan_of(backend_holder[-1] if backend_holder else None, fn)
                if plan is None:
                    row["notes"].append("the backend does not expose its plan: no prediction recorded")
                else:
                    self.record_plan(plan, row)

            row = self.row("fxopt-inductor", line, label, solver=solver, budget_arg=budget, backend="fxopt+inductor")
            self.attempt(row, build, after_warmup=after_warmup)
            self.check_fxopt_row(row)

    def record_plan(self, fn_or_plan: Any, row: dict[str, Any]) -> None:
        plan = fn_or_plan if isinstance(fn_or_plan, fxopt.Plan) else fn_or_plan.plan
        row.update(plan_fields(plan))
        if getattr(fn_or_plan, "plans", None) is not None and len(fn_or_plan.plans) != 1:
            row["notes"].append(f"{len(fn_or_plan.plans)} plans were made")
        self.info.setdefault("predicted_eager_peak_bytes", plan.eager_peak_bytes)

    def check_fxopt_row(self, row: dict[str, Any]) -> None:
        if "measured_peak_bytes" not in row:
            if row.get("infeasible") and row["min_budget_bytes"] <= row["budget_bytes"]:
                row["notes"].append("InfeasibleBudgetError although min_budget <= budget")
            return
        if row.get("within_budget") is False:
            row["notes"].append("MEASURED PEAK EXCEEDS BUDGET")
        pred = row.get("predicted_extra_flops")
        if pred is not None and row.get("extra_flops") is not None and pred != row["extra_flops"] \
                and row["method"] == "fxopt":
            row["notes"].append(f"counted extra FLOPs {row['extra_flops']} != plan.recompute_flops {pred}")
        self.run.write()


def _plan_of(backend: Any, compiled: Any) -> Any:
    """The latest plan a backend made, wherever this fxopt keeps it."""
    for holder in (backend, compiled):
        for attr in ("plans", "plan"):
            value = getattr(holder, attr, None)
            if isinstance(value, (list, tuple)) and value:
                value = value[-1]
            if isinstance(value, fxopt.Plan):
                return value
    return None


# --------------------------------------------------------------------------------------------
# the run


class Run:
    def __init__(self, args: argparse.Namespace):
        self.cfg = PRESETS["quick" if args.quick else "full"]
        if args.size:
            self.cfg = dataclasses.replace(self.cfg, size=args.size)
        if args.timed_steps:
            self.cfg = dataclasses.replace(self.cfg, timed_steps=args.timed_steps)
        for key in ("compile_budgets", "inductor_budgets", "fractions"):
            if getattr(args, key):
                self.cfg = dataclasses.replace(self.cfg, **{key: _floats(getattr(args, key))})
        self.time_limit = args.time_limit if args.time_limit is not None else self.cfg.time_limit
        self.models = choose(args.models, tuple(MODELS))
        self.methods = choose(args.methods, METHODS)
        self.fxopt_solvers = choose(args.fxopt_solvers, SOLVERS)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # Process-wide settings for the run, restored at its end (the harness also runs inside tests).
        self._restore = saved_settings()
        if self.device.type == "cpu":
            # On a CPU shared with other jobs, 2 threads wait on each other's stragglers: steps
            # measured 2-8x slower and far noisier than with 1 thread.
            torch.set_num_threads(args.threads)
        self.deadline = args.deadline
        # fxopt caches plans on disk by default; a cached plan would report another run's planning
        # time and skip the solve whose cost this benchmark measures.
        os.environ.setdefault("FXOPT_CACHE", "0")
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.benches: list[ModelBench] = []
        self.meta = run_meta(" ".join(["python -m benchmarks.pareto", *(shlex.quote(a) for a in (args.argv or []))]))
        self.meta.update({
            "preset": "quick" if args.quick else "full", "size": self.cfg.size, "device": str(self.device),
            "ilp_time_limit_s": self.time_limit, "timed_steps": self.cfg.timed_steps,
            "methods": list(self.methods), "fxopt_solvers": list(self.fxopt_solvers),
            "compile_budgets": list(self.cfg.compile_budgets), "inductor_budgets": list(self.cfg.inductor_budgets),
            "fxopt_fractions": list(self.cfg.fractions), "backend_fractions": list(self.cfg.backend_fractions),
            "fxopt_backend_available": hasattr(fxopt, "backend"), "dtype": "float32",
            "fxopt_plan_cache": os.environ.get("FXOPT_CACHE"),
        })
        self.complete = False

    def check_deadline(self) -> None:
        if self.deadline is not None and time.perf_counter() - self.t0 > self.deadline:
            raise Deadline

    def execute(self) -> None:
        log(f"device {self.device}, size {self.cfg.size}, ILP time limit {self.time_limit:g} s, "
            f"models {', '.join(self.models)}; methods {', '.join(self.methods)}")
        try:
            for name in self.models:
                torch.manual_seed(0)
                try:
                    workload = MODELS[name].workload(self.cfg.size).to(self.device)
                except Exception as err:  # noqa: BLE001 - e.g. no such device: go on with the next model
                    self.meta.setdefault("model_errors", {})[name] = error_line(err)
                    log(f"=== {name}: could not be built on {self.device}: {error_line(err)}")
                    continue
                bench = ModelBench(workload, self)
                self.benches.append(bench)
                try:
                    bench.run_all()
                except Deadline:
                    raise
                except Exception as err:  # noqa: BLE001 - go on with the next model
                    bench.info["error"] = error_line(err)
                    log(traceback.format_exc())
                finally:
                    bench.info["elapsed_s"] = round(time.perf_counter() - bench.t0, 1)
                    self.write(plots=True)
                    del bench.w.model, bench.m
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
            self.complete = True
        except Deadline:
            log(f"deadline of {self.deadline} s reached: stopping, results so far are written")
        finally:
            self.write(final=True)
            restore_settings(self._restore)

    # ---- output -------------------------------------------------------------------------------

    def write(self, *, plots: bool = False, final: bool = False) -> None:
        """The current model's table and JSON and the summary (after every row); the current
        model's plot too with ``plots`` (when a model ends: plotting after every row of every
        model would take minutes); every model's files with ``final``."""
        from benchmarks import pareto_report

        self.meta["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.meta["complete"] = self.complete
        models = [(b.info, b.rows) for b in self.benches]
        pareto_report.write_all(self.out, self.meta, models, current=None if final else models[-1:],
                                plots=plots or final)


def _floats(text: str) -> tuple[float, ...]:
    values = tuple(sorted((float(v) for v in text.split(",") if v.strip()), reverse=True))
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise SystemExit(f"budgets must be comma-separated numbers in [0, 1], got {text!r}")
    return values


def main(argv: list[str] | None = None) -> Run:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, fewer budgets, ILP time limit 10 s (a few minutes on 2 CPU cores)")
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--methods", help=f"comma-separated, from {', '.join(METHODS)} (default: all)")
    parser.add_argument("--fxopt-solvers", help=f"comma-separated, from {', '.join(SOLVERS)} (default: all)")
    parser.add_argument("--size", choices=SIZES, help="model sizes (default: the preset's)")
    parser.add_argument("--time-limit", type=float, help="fxopt's ILP time limit, s (default 30; 10 with --quick)")
    parser.add_argument("--timed-steps", type=int, help="interleaved timed steps per point (default 7; 5 with --quick)")
    parser.add_argument("--compile-budgets", help="activation_memory_budget values for torch.compile aot_eager, "
                        "e.g. 1,0.5,0 (default: the preset's)")
    parser.add_argument("--inductor-budgets", help="activation_memory_budget values with Inductor (default: the preset's)")
    parser.add_argument("--fractions", help="fxopt budgets as shares of eager's measured peak, e.g. 1,0.75,0.5 "
                        "(the minimum is always added; default: the preset's)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable timings "
                        "on a shared CPU)")
    parser.add_argument("--deadline", type=float, help="seconds after which no new row starts; partial results are kept")
    parser.add_argument("--out", default="benchmarks/results/pareto", help="output folder")
    args = parser.parse_args(argv)
    return run_to_end(Run, args, argv, f"{args.out}/summary.md")


if __name__ == "__main__":
    main()
