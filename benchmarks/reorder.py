"""Operator order as a decision (issue 28): the smallest budget with and without ``reorder=True``.

    python -m benchmarks.reorder [--models sd3,unet,dit,swin,gpt2@bench,llama@bench,residual_mlp,...] [--size test]
        [--time-limit 60] [--out benchmarks/results/reorder]
    python -m benchmarks.reorder --report [--out ...]   # Markdown from the JSON

Per model of the one zoo (`fxopt.models.MODELS`: the library models of `benchmarks.library_zoo`
and the transformers models of `benchmarks.hf_zoo`, named without their ``lib-``/``hf-`` prefix,
and fxopt's own test zoo; ``name@size`` for another size than ``--size``), measured the same way
(`benchmarks.harness.Measurer`):

- ``min``: ``fxopt.plan(model, "min", inputs)`` and with ``reorder=True``: the smallest budget
  fxopt plans in each order, and whether the plan kept is reordered (`Plan.reordered`); each plan
  replayed and measured: peak (measured <= predicted <= budget) and gradients against eager's
  (``grads_bit_equal``: the largest difference is 0);
- ``library`` (a library's model only): its own checkpointing (transformers'
  ``gradient_checkpointing_enable()``, diffusers' ``enable_gradient_checkpointing()``),
  measured; then fxopt at that measured peak, with and without ``reorder``: the predicted
  recompute cost (`Plan.cost`, what the solvers minimise) and extra FLOPs, which reordering must
  never raise (the planner keeps the better plan).

On CPU the run uses 1 torch thread and turns fxopt's plan cache off. Step times are not the point
here (one timed step per row).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

import fxopt
from benchmarks.harness import (Measurer, error_line, load_average, log, plan_fields, report_head,
                                restore_settings, run_meta, run_to_end, saved_settings, write_results)
from benchmarks.library_checkpointing import NAMES
from benchmarks.library_zoo import SIZES
from fxopt.models import MODELS, ZOO, ZooModel, loss_of
from fxopt.solvers.auto import SolverTimeoutWarning

DEFAULT_MODELS = ("sd3", "unet", "dit", "swin", "gpt2@bench", "llama@bench", "residual_mlp", "transformer_block",
                  "inplace_net")
DEFAULT_OUT = "benchmarks/results/reorder"


def entry_and_size(text: str, size: str) -> tuple[ZooModel, str]:
    """The zoo's entry of ``name`` or ``name@size`` (``"unet"``: ``lib-unet``, ``"gpt2"``:
    ``hf-gpt2``, else fxopt's own model of that name), and its size: the one given, else ``size``
    where the model has it, else its first."""
    name, _, given = text.partition("@")
    entry = MODELS.get(f"lib-{name}") or MODELS.get(f"hf-{name}") or MODELS.get(name)
    if entry is None:
        raise SystemExit(f"unknown model {name}; choose from {', '.join(NAMES)} or fxopt's own ({', '.join(ZOO)})")
    chosen = given or (size if size in entry.sizes else entry.sizes[0])
    if chosen not in entry.sizes:
        raise SystemExit(f"{entry.name} has the sizes {', '.join(entry.sizes)}, not {chosen}")
    return entry, chosen


class LossOf(torch.nn.Module):
    """fxopt's own models return their outputs; the harness trains a model that returns its loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: Any) -> torch.Tensor:
        return loss_of(self.model(*inputs))


def planned(*args: Any, **options: Any) -> tuple[fxopt.Plan, bool]:
    """``fxopt.plan(*args, **options)``, and whether its solvers stopped at the time limit (a
    `SolverTimeoutWarning`: only such an answer may differ from one run to the next, so two of them
    say nothing about what reordering does). An infeasible budget raises, its error marked the same
    way (``stopped``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SolverTimeoutWarning)
        try:
            plan = fxopt.plan(*args, **options)
        except fxopt.InfeasibleBudgetError as err:
            err.stopped = any(issubclass(w.category, SolverTimeoutWarning) for w in caught)
            raise
    for w in caught:  # (the others as they would have been shown)
        if not issubclass(w.category, SolverTimeoutWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return plan, any(issubclass(w.category, SolverTimeoutWarning) for w in caught)


def planned_row(m: Measurer, method: str, plan: fxopt.Plan) -> dict[str, Any]:
    """The plan replayed and measured (peak, gradients), with what it predicted."""
    row: dict[str, Any] = {"method": method, **plan_fields(plan), "reordered": plan.reordered,
                           "predicted_cost": plan.cost}
    try:
        m.measure(row, lambda: fxopt.optimize(m.model, plan.budget_bytes, plan=plan))
        row["grads_bit_equal"] = row.get("grad_max_abs_diff") == 0.0
        row["measured_le_predicted"] = row["measured_peak_bytes"] <= plan.peak_bytes
    except Exception as err:  # noqa: BLE001 - one failing row must not stop the others
        row["error"] = error_line(err)
        log(traceback.format_exc(limit=4))
    for key in ("step_times_s", "eager_step_times_s"):
        row.pop(key, None)
    return row


def bench_model(text: str, args: argparse.Namespace) -> dict[str, Any]:
    entry, size = entry_and_size(text, args.size)
    torch.manual_seed(0)
    model, inputs = entry(size)
    if entry.checkpointing is None:
        model = LossOf(model)
    m = Measurer(model, inputs, timed_steps=1)
    info: dict[str, Any] = {"name": text.partition("@")[0], "zoo": entry.name, "size": size, "source": entry.source}
    rows: list[dict[str, Any]] = [m.measure_eager({"method": "eager"})]
    for reorder in (False, True):
        t0 = time.perf_counter()
        plan, stopped = planned(model, "min", inputs, reorder=reorder, time_limit=args.time_limit)
        row = planned_row(m, f"min{' reorder' if reorder else ''}", plan)
        row["plan_s"] = round(time.perf_counter() - t0, 2)
        row["stopped"] = stopped
        rows.append(row)
    if entry.checkpointing is None:  # (fxopt's own models: no library checkpointing to compare with)
        torch._dynamo.reset()
        return {"info": info, "rows": rows}
    library: dict[str, Any] = {"method": "library"}

    def switched_on() -> torch.nn.Module:
        entry.checkpointing(model, True)
        return model

    try:
        m.measure(library, switched_on)
    finally:
        entry.checkpointing(model, False)
    rows.append(library)
    for reorder in (False, True):
        method = f"at library's peak{' reorder' if reorder else ''}"
        try:
            plan, stopped = planned(model, library["measured_peak_bytes"], inputs, reorder=reorder,
                                    time_limit=args.time_limit)
        except fxopt.InfeasibleBudgetError as err:
            rows.append({"method": method, "infeasible": True, "budget_bytes": err.budget,
                         "min_budget_bytes": err.min_budget, "stopped": err.stopped})
            continue
        rows.append({**planned_row(m, method, plan), "stopped": stopped})
    for r in rows:
        for key in ("step_times_s", "eager_step_times_s"):
            r.pop(key, None)
    torch._dynamo.reset()
    return {"info": info, "rows": rows}


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.models = [s.strip() for s in args.models.split(",") if s.strip()]
        self.out = Path(args.out)
        self._restore = saved_settings()
        torch.set_num_threads(1)
        os.environ["FXOPT_CACHE"] = "0"  # a cached plan would not be this commit's answer
        self.t0 = time.perf_counter()
        self.data: dict[str, Any] = {"meta": run_meta(
            " ".join(["python -m benchmarks.reorder", *map(shlex.quote, args.argv)]), size=args.size,
            time_limit_s=args.time_limit), "models": []}

    def execute(self) -> None:
        try:
            for text in self.models:
                log(f"=== {text}")
                try:
                    self.data["models"].append(bench_model(text, self.args))
                except Exception as err:  # noqa: BLE001 - go on with the next model
                    self.data["models"].append({"info": {"name": text, "error": error_line(err)}, "rows": []})
                    log(traceback.format_exc(limit=4))
                self.data["meta"].update(elapsed_s=round(time.perf_counter() - self.t0, 1), load_end=load_average())
                write_results(self.out, self.data, report(self.data))
        finally:
            restore_settings(self._restore)


def _row(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    return next((r for r in rows if r.get("method") == method), {})


def _mib3(n: int) -> str:
    return f"{n / 2**20:.3f}"


def _yes(value: Any) -> str:
    return "–" if value is None else ("yes" if value else "**no**")


def report(data: dict[str, Any]) -> str:
    lines = report_head("Operator reordering: the smallest budget with and without `reorder=True`", data["meta"])
    lines += ["Smallest budget (`fxopt.plan(model, \"min\", inputs)`), MiB (2^20 bytes); each plan replayed and measured "
              "(peak, gradients against eager's, bit for bit).", "",
              "| model | size | captured order | with reorder | decrease | order kept | measured <= predicted <= budget "
              "| gradients bit-equal | planning s (captured / reorder) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for model in data["models"]:
        info, rows = model["info"], model["rows"]
        if "error" in info:
            lines.append(f"| {info['name']} | | {info['error']} | | | | | | |")
            continue
        a, b = _row(rows, "min"), _row(rows, "min reorder")
        if not a or not b:
            continue
        if "error" in a or "error" in b:
            lines.append(f"| {info['name']} | {info['size']} | {a.get('error', '')} | {b.get('error', '')} | | | | | |")
            continue
        drop = (a["budget_bytes"] - b["budget_bytes"]) / a["budget_bytes"]
        holds = all(r["measured_peak_bytes"] <= r["predicted_peak_bytes"] <= r["budget_bytes"] for r in (a, b))
        stopped = "; ".join(what for what, r in (("captured", a), ("reorder", b)) if r.get("stopped"))
        lines.append(f"| {info['name']} | {info['size']} | {_mib3(a['budget_bytes'])} | {_mib3(b['budget_bytes'])} "
                     f"| {100 * drop:.2f}%{f' (time limit reached: {stopped})' if stopped else ''} | {'reordered' if b['reordered'] else 'captured'} | {_yes(holds)} "
                     f"| {_yes(a['grads_bit_equal'] and b['grads_bit_equal'])} | {a['plan_s']} / {b['plan_s']} |")
    lines += ["", "At the library's own checkpointing's measured peak: fxopt's predicted cost (`Plan.cost`, "
              "the solvers' seconds) and extra MFLOP, captured order and with `reorder=True`.", "",
              "| model | library peak MiB | cost captured | cost reorder | extra MFLOP captured | extra MFLOP reorder "
              "| order kept | never higher |", "|---|---|---|---|---|---|---|---|"]
    for model in data["models"]:
        info, rows = model["info"], model["rows"]
        lib, a, b = _row(rows, "library"), _row(rows, "at library's peak"), _row(rows, "at library's peak reorder")
        if not lib or not a or not b or "error" in a or "error" in b:
            continue
        cost = [("infeasible (min " + _mib3(r["min_budget_bytes"]) + " MiB)") if r.get("infeasible")
                else f"{r['predicted_cost'] * 1e3:.4f} ms" for r in (a, b)]
        flops = ["–" if r.get("infeasible") else f"{r['predicted_extra_flops'] / 1e6:.2f}" for r in (a, b)]
        never_higher = b.get("infeasible") is None and (a.get("infeasible") or b["predicted_cost"] <= a["predicted_cost"])
        kept = "–" if b.get("infeasible") else ("reordered" if b["reordered"] else "captured")
        stopped = [what for what, r in (("captured", a), ("reorder", b)) if r.get("stopped")]
        verdict = _yes(never_higher) + (f" (the {' and '.join(stopped)} solve stopped at the time limit: not "
                                         "comparable)" if stopped else "")
        lines.append(f"| {info['name']} | {_mib3(lib['measured_peak_bytes'])} | {cost[0]} | {cost[1]} | {flops[0]} "
                     f"| {flops[1]} | {kept} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--size", default="test", choices=SIZES)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--report", action="store_true", help="only write the Markdown from the JSON")
    args = parser.parse_args(argv)
    if args.report:
        out = Path(args.out)
        out.with_suffix(".md").write_text(report(json.loads(out.with_suffix(".json").read_text())) + "\n")
        return
    run_to_end(Run, args, argv, f"{args.out}.md")


if __name__ == "__main__":
    main()
