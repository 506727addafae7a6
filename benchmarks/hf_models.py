"""fxopt against what Hugging Face users do today, on transformers models (`benchmarks.hf_zoo`).

    python -m benchmarks.hf_models [--models bert,vit] [--size bench|test] [--out benchmarks/results/hf_models]
    python -m benchmarks.hf_models --report [--out ...]     # rewrite the Markdown from the JSON

Per model, all methods sharing one model and its inputs and measured the same way
(`benchmarks.harness.Measurer`: measured peak of one step with parameters, inputs and gradients
resident; FLOPs counted by a dispatch mode; step time interleaved with eager's; gradients against
eager's with ``torch.testing.assert_close``):

- ``eager``: the HF model as is;
- ``hf-checkpointing``: HF's gradient checkpointing (``activation_checkpointing_enable()``, the
  new name of ``gradient_checkpointing_enable()``, default ``use_reentrant=False``) in eager mode;
  models that do not support it (ResNet, ConvNeXt) get a row saying so;
- ``compile-amb``: ``torch.compile(backend="aot_eager_decomp_partition")`` with
  ``torch._functorch.config.activation_memory_budget = 0.5`` (AOTAutograd's min-cut partitioner
  and knapsack, without Inductor's fusion, so FLOPs are counted exactly). The budget is a share of
  the activations the partitioner saves, not of the peak, and nothing bounds the peak: the row
  shows what the step measured;
- ``fxopt``: ``fxopt.optimize(model, budget, example_inputs=...)`` at (a) HF checkpointing's
  *measured* peak in bytes, (b) the resident bytes plus half of the activations (eager's measured peak minus parameters, buffers and inputs), (c) fxopt's minimum
  (``InfeasibleBudgetError.min_budget`` of planning at a 1-byte budget). Each row has the budget,
  the plan's predicted peak and ``recompute_flops``, the measured peak, the counted extra FLOPs,
  step time, plan time (the ``fxopt.optimize`` call: capture + solve) and gradient parity.

Every row is also counted with ``torch.utils.flop_counter.FlopCounterMode`` (one extra step) as a
cross-check of the dispatch-mode count; where FlopCounterMode fails the row says so.

A model fxopt cannot capture gets its fxopt rows with the error (``CaptureError: ...``) and the
run goes on. Writes ``<out>.json`` after every row and ``<out>.md`` (commit and command at the
top). On CPU the run uses 1 torch thread and turns fxopt's plan cache off (``FXOPT_CACHE=0``).
"""

from __future__ import annotations

import argparse
import json
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
from benchmarks.harness import (Measurer, choose, error_line, log, mib, plan_fields, report_head, run_meta,
                                restore_settings, run_to_end, saved_settings, train_step, write_results)
from benchmarks.hf_zoo import HF_NAMES, SIZES, hf_checkpointing
from fxopt.models import MODELS
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

METHODS = ("eager", "hf-checkpointing", "compile-amb", "fxopt")
FXOPT_HALF = "half-act"  # resident bytes + half of the activations (eager's measured peak)
FXOPT_BUDGETS = ("hf-peak", FXOPT_HALF, "min")
COMPILE_BACKEND = "aot_eager_decomp_partition"
COMPILE_BUDGET = 0.5
# The target of issue 11: fxopt's extra FLOPs at HF checkpointing's peak at most half of HF's.
TARGET_RATIO = 0.5


def flop_counter_mode_flops(fn: Callable[..., Any], inputs: tuple) -> int:
    """FLOPs of one step under ``torch.utils.flop_counter.FlopCounterMode``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        train_step(fn, inputs)
    return counter.get_total_flops()


class ModelBench:
    def __init__(self, name: str, run: Run):
        self.name = name
        self.run = run
        self.rows: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        torch.manual_seed(0)
        entry = MODELS[f"hf-{name}"]
        self.model, self.inputs = entry(run.size)
        self.hf = self.model.hf
        self.m = Measurer(self.model, self.inputs, timed_steps=run.timed_steps)
        self.info: dict[str, Any] = {
            "name": name, "hf_class": entry.source.removeprefix("transformers."), "description": entry.description,
            "config": {k: v for k, v in self.hf.config.to_diff_dict().items()
                       if isinstance(v, (int, float, str, bool, list)) and k not in ("architectures", "id2label", "label2id")},
            "input_shapes": {n: list(x.shape) for n, x in zip(self.model.names, self.inputs)},
            "params_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
            "inputs_bytes": sum(x.numel() * x.element_size() for x in self.inputs),
            "complete": False,
        }

    def row(self, method: str, budget: str, **fields: Any) -> dict[str, Any]:
        return {"model": self.name, "method": method, "budget": budget, "notes": [], **fields}

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if row.get("measured_peak_bytes") is not None:
            log(f"    {row['method']} @ {row['budget']}: measured {mib(row['measured_peak_bytes'])} MiB"
                + (f" (budget {mib(row['budget_bytes'])}, predicted {mib(row.get('predicted_peak_bytes'))})"
                   if row.get("budget_bytes") else "")
                + f", extra {(row.get('extra_flops') or 0) / 1e9:.3f} GFLOP, step x{row['step_ratio']:.2f}, "
                f"grads {'ok' if row.get('grads_equal') else 'DIFFER'}")
        else:
            log(f"    {row['method']} @ {row['budget']}: "
                + (f"infeasible (min_budget {mib(row.get('min_budget_bytes'))} MiB)" if row.get("infeasible")
                   else row.get("error", "?")))
        self.run.write()

    def attempt(self, row: dict[str, Any], build: Callable[[], Any], *, ctx: Callable[[], Any] | None = None,
                after_warmup: Callable[[Any, dict], None] | None = None, flop_counter_mode: bool = True,
                cleanup: Callable[[], None] | None = None) -> dict[str, Any]:
        """Measure one row; record an error instead of raising."""
        log(f"--- {self.name}: {row['method']} @ {row['budget']}")

        def warmed(fn: Any, row: dict[str, Any]) -> None:
            if after_warmup is not None:
                after_warmup(fn, row)
            if flop_counter_mode:
                self.count_with_flop_counter_mode(fn, row)

        try:
            self.m.attempt(row, build, ctx=ctx, after_warmup=warmed)
        finally:
            if cleanup is not None:
                cleanup()
        if row.get("measured_peak_bytes") is not None:
            row["loss_equal"] = _loss_equal(row.get("loss"), self.m.ref_loss)
        self.add(row)
        return row

    def count_with_flop_counter_mode(self, fn: Any, row: dict[str, Any]) -> None:
        self.model.zero_grad(set_to_none=True)
        try:
            row["flop_counter_mode_flops"] = flop_counter_mode_flops(fn, self.inputs)
        except Exception as err:  # noqa: BLE001 - recorded: the dispatch-mode count still runs
            row["flop_counter_mode_error"] = error_line(err)
        self.model.zero_grad(set_to_none=True)

    # ---- methods ------------------------------------------------------------------------------

    def run_all(self) -> None:
        log(f"=== {self.name} ({self.info['hf_class']}, size {self.run.size}): params "
            f"{mib(self.info['params_bytes'])} MiB, inputs {self.info['input_shapes']}")
        eager = self.row("eager", "–")
        self.m.set_reference()
        self.attempt(eager, lambda: self.model)
        self.m.eager_flops, self.m.eager_peak = eager.get("flops"), eager.get("measured_peak_bytes")
        eager["extra_flops"] = 0
        self.info["eager_measured_peak_bytes"] = self.m.eager_peak
        self.info["eager_flops"] = self.m.eager_flops
        methods = self.run.methods
        hf = self.run_hf_checkpointing() if "hf-checkpointing" in methods else {}
        if "compile-amb" in methods:
            self.run_compile()
        if "fxopt" in methods:
            self.run_fxopt(hf)
        self.info["complete"] = True

    def run_hf_checkpointing(self) -> dict[str, Any]:
        row = self.row("hf-checkpointing", "–")
        if not self.hf.supports_gradient_checkpointing:
            row["error"] = f"not supported: {type(self.hf).__name__}.supports_gradient_checkpointing is False"
            self.add(row)
            return row

        def build():
            hf_checkpointing(self.model, True)
            return self.model

        return self.attempt(row, build, cleanup=lambda: hf_checkpointing(self.model, False))

    def run_compile(self) -> None:
        row = self.row("compile-amb", f"amb {COMPILE_BUDGET:g}", backend=COMPILE_BACKEND,
                       activation_memory_budget=COMPILE_BUDGET)
        # FlopCounterMode's module hooks would make Dynamo recompile or skip the frame (REFERENCE §8):
        # the dispatch-mode count is the one for compiled code.
        self.attempt(row, lambda: torch.compile(self.model, backend=COMPILE_BACKEND),
                     ctx=lambda: torch._functorch.config.patch(activation_memory_budget=COMPILE_BUDGET),
                     flop_counter_mode=False)

    def find_min_budget(self) -> tuple[int | None, str | None]:
        """fxopt's smallest budget (and fxopt's predicted eager peak into ``info``), or the error
        that stopped planning (a capture failure recurs at every budget)."""
        log(f"--- {self.name}: fxopt: searching the smallest budget")
        t0 = time.perf_counter()
        found, error = None, None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fxopt.plan(self.model, 1, self.inputs, time_limit=self.run.time_limit)
            error = "a 1-byte budget was feasible?"
        except fxopt.InfeasibleBudgetError as err:
            found = err.min_budget
        except Exception as err:  # noqa: BLE001
            error = error_line(err)
            log(traceback.format_exc(limit=3))
        torch._dynamo.reset()
        self.info["min_budget_bytes"] = found
        self.info["min_budget_search_s"] = round(time.perf_counter() - t0, 2)
        log(f"    min budget {mib(found)} MiB ({self.info['min_budget_search_s']} s)" + (f": {error}" if error else ""))
        return found, error

    def half_of_activations(self) -> int | None:
        """The resident bytes (parameters, buffers, inputs) plus half of what eager's measured
        peak adds to them: half of the step's activations and temporaries."""
        if self.m.eager_peak is None:
            return None
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*self.model.parameters(), *self.model.buffers(), *self.inputs]
                    if isinstance(t, torch.Tensor)}
        resident = sum(storages.values())
        return resident + (self.m.eager_peak - resident) // 2

    def run_fxopt(self, hf: dict[str, Any]) -> None:
        wanted = self.run.fxopt_budgets
        min_budget, error = self.find_min_budget() if "min" in wanted else (None, None)
        hf_peak = hf.get("measured_peak_bytes")
        half = self.half_of_activations()
        budgets: list[tuple[str, int | float | None, str | None]] = [
            ("hf-peak", hf_peak, None if hf_peak is not None else "no HF checkpointing peak to match"),
            (FXOPT_HALF, half, None if half is not None else "no eager peak measured"),
            ("min", min_budget, None if min_budget is not None else "no minimum found"),
        ]
        for label, budget, skip in budgets:
            if label not in wanted:
                continue
            row = self.row("fxopt", label, budget_arg=budget)
            if label == "min":
                row["min_budget_search_s"] = self.info["min_budget_search_s"]
            if error is not None and min_budget is None:
                row["error"] = error  # planning already failed at a 1-byte budget: it fails the same here
                self.add(row)
                continue
            if skip is not None:
                row["error"] = skip
                self.add(row)
                continue

            def build(budget=budget, row=row):
                t0 = time.perf_counter()
                fn = fxopt.optimize(self.model, budget, example_inputs=self.inputs, time_limit=self.run.time_limit)
                row["plan_s"] = round(time.perf_counter() - t0, 3)
                return fn

            plans: list[fxopt.Plan] = []

            def record_plan(fn: Any, row: dict[str, Any], plans=plans) -> None:
                plans.append(fn.plan)
                row.update(plan_fields(fn.plan))
                row["plan_gap"] = fn.plan.gap
                self.info.setdefault("predicted_eager_peak_bytes", fn.plan.eager_peak_bytes)

            self.attempt(row, build, after_warmup=record_plan, flop_counter_mode=False)
            if plans and row.get("measured_peak_bytes") is not None:
                self.count_replayed_plan_with_flop_counter_mode(plans[-1], row)
            check_fxopt_row(row)
            self.run.write()

    def count_replayed_plan_with_flop_counter_mode(self, plan: fxopt.Plan, row: dict[str, Any]) -> None:
        """FlopCounterMode over a step of a fresh module replaying ``plan``, after the row is
        measured: where FlopCounterMode fails on an fxopt module, the frame it leaves skipped
        makes every later call of that module fail too."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn = fxopt.optimize(self.model, plan.budget_bytes, example_inputs=self.inputs, plan=plan)
            self.count_with_flop_counter_mode(fn, row)
        except Exception as err:  # noqa: BLE001
            row["flop_counter_mode_error"] = error_line(err)
        torch._dynamo.reset()
        self.model.zero_grad(set_to_none=True)


def check_fxopt_row(row: dict[str, Any]) -> None:
    if row.get("measured_peak_bytes") is None:
        return
    if row.get("within_budget") is False:
        row["notes"].append("MEASURED PEAK EXCEEDS BUDGET")
    pred, counted = row.get("predicted_extra_flops"), row.get("extra_flops")
    if pred is not None and counted is not None and pred != counted:
        row["notes"].append(f"counted extra FLOPs {counted} != plan.recompute_flops {pred}")


def _loss_equal(loss: float | None, ref: float | None) -> bool | None:
    if loss is None or ref is None:
        return None
    try:
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(ref))
    except AssertionError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# the run


class Run:
    def __init__(self, args: argparse.Namespace):
        self.size = args.size
        self.time_limit = args.time_limit
        self.timed_steps = args.timed_steps
        self.models = choose(args.models, HF_NAMES)
        self.methods = ("eager", *(m for m in choose(args.methods, METHODS) if m != "eager"))
        self.fxopt_budgets = choose(args.fxopt_budgets, FXOPT_BUDGETS)
        self.out = Path(args.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._restore = saved_settings()
        torch.set_num_threads(args.threads)
        # A cached plan would report another run's planning time.
        os.environ.setdefault("FXOPT_CACHE", "0")
        self.t0 = time.perf_counter()
        self.benches: list[ModelBench] = []
        self.model_errors: dict[str, str] = {}
        self.meta = run_meta(" ".join(["python -m benchmarks.hf_models", *(shlex.quote(a) for a in args.argv)]))
        import transformers

        self.meta.update({"transformers": transformers.__version__, "size": self.size,
                          "ilp_time_limit_s": self.time_limit, "timed_steps": self.timed_steps,
                          "compile_backend": COMPILE_BACKEND, "compile_activation_memory_budget": COMPILE_BUDGET,
                          "fxopt_half": FXOPT_HALF, "fxopt_plan_cache": os.environ.get("FXOPT_CACHE"),
                          "methods": list(self.methods), "fxopt_budgets": list(self.fxopt_budgets),
                          "dtype": "float32", "models": list(self.models)})
        self.complete = False

    def execute(self) -> None:
        try:
            for name in self.models:
                try:
                    bench = ModelBench(name, self)
                except Exception as err:  # noqa: BLE001
                    self.model_errors[name] = error_line(err)
                    log(f"=== {name}: could not be built: {error_line(err)}")
                    continue
                self.benches.append(bench)
                try:
                    bench.run_all()
                except Exception as err:  # noqa: BLE001 - go on with the next model
                    bench.info["error"] = error_line(err)
                    log(traceback.format_exc())
                finally:
                    bench.info["elapsed_s"] = round(time.perf_counter() - bench.t0, 1)
                    self.write()
                    del bench.model, bench.hf, bench.m
                    torch._dynamo.reset()
            self.complete = True
        finally:
            self.write()
            restore_settings(self._restore)

    def write(self) -> None:
        self.meta["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.meta["complete"] = self.complete
        if self.model_errors:
            self.meta["model_errors"] = self.model_errors
        data = {"meta": self.meta, "models": [{"info": b.info, "rows": b.rows} for b in self.benches]}
        write_results(self.out, data, report(data))


# --------------------------------------------------------------------------------------------
# the report


def summarize(info: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's headline numbers: HF checkpointing against fxopt at its peak and at fxopt's minimum."""
    by = {(r["method"], r["budget"]): r for r in rows}
    hf = by.get(("hf-checkpointing", "–"), {})
    at_hf = by.get(("fxopt", "hf-peak"), {})
    at_min = by.get(("fxopt", "min"), {})
    s: dict[str, Any] = {"ratio": None, "min_below_hf": None}
    hf_extra = hf.get("extra_flops")
    fx_extra, source = extra_flops_of(at_hf)
    if hf_extra and fx_extra is not None and at_hf.get("measured_peak_bytes") is not None:
        s["ratio"], s["ratio_source"] = fx_extra / hf_extra, source
    if hf.get("measured_peak_bytes") is not None and info.get("min_budget_bytes") is not None:
        s["min_below_hf"] = info["min_budget_bytes"] < hf["measured_peak_bytes"]
        if at_min.get("measured_peak_bytes") is not None:
            s["min_measured_below_hf"] = at_min["measured_peak_bytes"] < hf["measured_peak_bytes"]
    return s


def extra_flops_of(row: dict[str, Any]) -> tuple[int | None, str]:
    """Counted extra FLOPs, else the plan's ``recompute_flops``."""
    if row.get("extra_flops") is not None:
        return row["extra_flops"], "counted"
    return row.get("predicted_extra_flops"), "plan"


def report(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = report_head(
        "fxopt against Hugging Face gradient checkpointing and torch.compile's activation budget", meta,
        f"transformers {meta.get('transformers')} · Python {meta['python']} · {meta['cpu_count']} CPUs ({meta['torch_threads']} "
        f"torch thread{'s' if meta['torch_threads'] != 1 else ''}) · size \"{meta['size']}\", fp32 · fxopt ILP time "
        f"limit {meta['ilp_time_limit_s']:g} s · {meta['timed_steps']} timed steps per row · "
        f"{'complete' if meta.get('complete') else 'INCOMPLETE'}, {meta.get('elapsed_s', 0):.0f} s") + [
        "Models from `benchmarks/hf_zoo.py` (transformers classes, random weights, dropout 0, loss from `labels=`). "
        "Peaks in MiB, measured by `fxopt.measure_peak` over one forward+backward with parameters, inputs and "
        "gradients resident. HF ckpt: `activation_checkpointing_enable()` (= `gradient_checkpointing_enable()`), "
        f"eager. compile amb {COMPILE_BUDGET:g}: `torch.compile(backend=\"{COMPILE_BACKEND}\")` with "
        f"`activation_memory_budget = {COMPILE_BUDGET:g}` (a share of saved activations; it does not bound the "
        "peak). fxopt @ HF peak: HF checkpointing's measured peak as fxopt's budget, in bytes. Ratio: fxopt's "
        f"extra FLOPs there / HF checkpointing's (issue 11's target: ≤ {TARGET_RATIO:g}). fxopt min: the smallest "
        "budget fxopt plans (`InfeasibleBudgetError.min_budget`); \"< HF\": whether it is below HF checkpointing's "
        "measured peak.",
        "",
        "## Summary",
        "",
        "| model | eager MiB | HF ckpt MiB (+GFLOP) | compile amb 0.5 MiB (+GFLOP) | fxopt @ HF peak: measured MiB (+GFLOP) "
        "| ratio fxopt/HF | fxopt @ 50% of activations: budget / measured MiB (+GFLOP) | fxopt min: budget / measured MiB (+GFLOP) | min < HF | all grads equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    for entry in data["models"]:
        info, rows = entry["info"], entry["rows"]
        by = {(r["method"], r["budget"]): r for r in rows}
        s = summarize(info, rows)

        def cell(row: dict[str, Any] | None, budget: bool = False) -> str:
            if not row:
                return "–"
            if row.get("infeasible"):
                return f"infeasible (min {mib(row.get('min_budget_bytes'))})"
            if row.get("error"):
                return _short_error(row["error"])
            extra, source = extra_flops_of(row)
            text = f"{mib(row.get('measured_peak_bytes'))} ({_gflop(extra)}{'' if source == 'counted' else ' plan'})"
            if budget:
                text = f"{mib(row.get('budget_bytes'))} / " + text
            if row.get("within_budget") is False:
                text += " **over budget**"
            return text

        fx_rows = [r for r in rows if r.get("measured_peak_bytes") is not None]
        grads = "–" if not fx_rows else ("yes" if all(r.get("grads_equal") and r.get("loss_equal") is not False
                                                      for r in fx_rows) else "**no**")
        ratio = "–" if s["ratio"] is None else (f"{s['ratio']:.2f}" + ("" if s["ratio"] <= TARGET_RATIO else " (> target)"))
        below = {None: "–", True: "yes", False: "no"}[s["min_below_hf"]]
        lines.append(
            f"| {info['name']} | {mib(info.get('eager_measured_peak_bytes'))} | {cell(by.get(('hf-checkpointing', '–')))} "
            f"| {cell(by.get(('compile-amb', f'amb {COMPILE_BUDGET:g}')))} | {cell(by.get(('fxopt', 'hf-peak')))} | {ratio} "
            f"| {cell(by.get(('fxopt', FXOPT_HALF)), budget=True)} | {cell(by.get(('fxopt', 'min')), budget=True)} | {below} | {grads} |")
    over = [(entry["info"]["name"], r) for entry in data["models"] for r in entry["rows"]
            if r["method"] == "fxopt" and r.get("within_budget") is False]
    if over:
        lines += ["", "**fxopt measured above its budget** (bytes): " + "; ".join(
            f"{name} @ {r['budget']}: budget {r['budget_bytes']}, measured {r['measured_peak_bytes']} "
            f"(+{r['measured_peak_bytes'] - r['budget_bytes']}), predicted {r.get('predicted_peak_bytes')}"
            for name, r in over) + "."]
    lines += [
        "",
        "## Every row",
        "",
        "Budget / predicted: fxopt's budget in bytes and its plan's predicted peak. GFLOP: counted over one step by "
        "fxopt's dispatch-mode counter (`fxopt.measure.count_flops`); in brackets `FlopCounterMode`'s count where it "
        "differs (\"FCM failed\" where it raised). Extra GFLOP: counted minus eager's; \"plan\": fxopt's "
        "`plan.recompute_flops`. Step ms: median of interleaved steps (× eager's paired median; the CPU is shared, "
        "so noisy). Plan s: the `fxopt.optimize` call (capture + solve; solve in brackets). Grads equal: loss and every "
        "parameter gradient `torch.testing.assert_close` to eager's. Plan: the solver that made the plan, its status and "
        "the proven gap to optimal where an ILP ran (\"heuristic\": the ILP found no plan in its time limit).",
        "",
        "| model | method | budget | budget MiB | predicted MiB | measured MiB | ≤ budget | GFLOP | extra GFLOP | plan extra GFLOP "
        "| step ms (× eager) | plan s | plan | grads equal | notes |",
        "|---|---|---|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---|:---:|---|",
    ]
    for entry in data["models"]:
        info, rows = entry["info"], entry["rows"]
        for r in rows:
            notes = list(r.get("notes") or [])
            if r.get("infeasible"):
                notes.insert(0, f"infeasible: min budget {mib(r.get('min_budget_bytes'))} MiB")
            if r.get("error"):
                notes.insert(0, r["error"])
            if r.get("flop_counter_mode_error"):
                notes.append(f"FlopCounterMode failed: {r['flop_counter_mode_error'][:100]}")
            gflop = _gflop(r.get("flops"), signed=False)
            fcm = r.get("flop_counter_mode_flops")
            if fcm is not None and r.get("flops") is not None and fcm != r["flops"]:
                gflop += f" ({_gflop(fcm, signed=False)})"
            elif r.get("flop_counter_mode_error"):
                gflop += " (FCM failed)"
            measured = r.get("measured_peak_bytes")
            within = {None: "–", True: "yes", False: "**NO**"}[r.get("within_budget")]
            step = "–" if r.get("step_s") is None else f"{r['step_s'] * 1e3:.0f} ({r['step_ratio']:.2f})"
            plan_s = "–" if r.get("plan_s") is None else f"{r['plan_s']:.1f} ({r.get('solve_seconds') or 0:.1f})"
            grads = "–" if measured is None else (
                "yes" if r.get("grads_equal") and r.get("loss_equal") is not False else f"**no** ({r.get('grad_error')})")
            lines.append(
                f"| {info['name']} | {r['method']} | {r['budget']} | {mib(r.get('budget_bytes'))} "
                f"| {mib(r.get('predicted_peak_bytes'))} | {mib(measured)} | {within} | {gflop} "
                f"| {_gflop(r.get('extra_flops'))} | {_gflop(r.get('predicted_extra_flops'))} | {step} | {plan_s} | {_plan(r)} | {grads} "
                f"| {'; '.join(n.replace('|', '/') for n in notes)} |")
    lines += ["", "## Models", ""]
    for entry in data["models"]:
        info = entry["info"]
        lines.append(
            f"- **{info['name']}** ({info['hf_class']}): {info['description']}; inputs {info['input_shapes']}; "
            f"parameters {mib(info['params_bytes'])} MiB; eager peak measured {mib(info.get('eager_measured_peak_bytes'))} "
            f"MiB, fxopt's prediction {mib(info.get('predicted_eager_peak_bytes'))} MiB; fxopt min-budget search "
            f"{info.get('min_budget_search_s', '–')} s; model done in {info.get('elapsed_s', '–')} s"
            + (f"; **error**: {info['error']}" if info.get("error") else "") + ".")
    for name, err in (meta.get("model_errors") or {}).items():
        lines.append(f"- **{name}**: could not be built: {err}")
    return "\n".join(lines) + "\n"


def _plan(row: dict[str, Any]) -> str:
    if row.get("plan_solver") is None:
        return "–"
    gap = row.get("plan_gap")
    return f"{row['plan_solver']} ({row['plan_status']}" + ("" if gap is None else f", gap {gap:.0%}") + ")"


def _gflop(flops: int | float | None, signed: bool = True) -> str:
    if flops is None:
        return "–"
    return f"{flops / 1e9:+.3f}" if signed else f"{flops / 1e9:.3f}"


def _short_error(error: str) -> str:
    return error.replace("|", "/")[:90] + ("…" if len(error) > 90 else "")


def main(argv: list[str] | None = None) -> Run | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(HF_NAMES)} (default: all)")
    parser.add_argument("--methods", help=f"comma-separated, from {', '.join(METHODS)} (default: all; eager always)")
    parser.add_argument("--fxopt-budgets", help=f"comma-separated, from {', '.join(FXOPT_BUDGETS)} (default: all)")
    parser.add_argument("--size", choices=SIZES, default="bench", help="model sizes (default: bench)")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    parser.add_argument("--timed-steps", type=int, default=3, help="interleaved timed steps per row (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: stable timings "
                        "on a shared CPU)")
    parser.add_argument("--out", default="benchmarks/results/hf_models",
                        help="output path without suffix: writes <out>.json and <out>.md")
    parser.add_argument("--report", "--replot", dest="report", action="store_true",
                        help="only rewrite <out>.md from <out>.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.report:
        out.with_suffix(".md").write_text(report(json.loads(out.with_suffix(".json").read_text())))
        log(f"wrote {out.with_suffix('.md')}")
        return None
    return run_to_end(Run, args, argv, str(out.with_suffix(".md")))


if __name__ == "__main__":
    main()
