"""fxopt at the peak of a library's own activation checkpointing (issue 24, item 4).

    python -m benchmarks.library_checkpointing [--models unet,vae,dit,sd3,gpt2,llama,vit] [--size bench]
        [--time-limit 4] [--before benchmarks/results/library_checkpointing_main.json]
        [--out benchmarks/results/library_checkpointing]
    python -m benchmarks.library_checkpointing --report [--before ...] [--out ...]   # Markdown from the JSON

Per model of the one zoo with a library's own checkpointing (`fxopt.models.MODELS`: the
``"library"`` set of `benchmarks.library_zoo`, diffusers and timm, and the transformers models of
`benchmarks.hf_zoo`, small configs; named here without their ``lib-``/``hf-`` prefix), measured the
same way (`benchmarks.harness.Measurer`: one model and its inputs, peak of one step with parameters,
inputs and gradients resident, gradients against eager's):

- ``eager``;
- ``library``: the library's own checkpointing switched on (diffusers'
  ``enable_gradient_checkpointing()``, transformers' ``gradient_checkpointing_enable()``, timm's
  ``set_grad_checkpointing(True)``);
- ``fxopt``: ``fxopt.optimize(model, budget)`` with the library row's *measured* peak as the
  budget, in bytes; with the plan's solver, predicted peak and ``recompute_flops``, and the best
  simple policy within that budget on the plan's graph (`fxopt.solvers.policies`: the cheapest
  that fits, its predicted extra FLOPs; "–" where fxopt has none, as before them).

Extra FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one more step (for
fxopt, of a fresh module replaying the plan: see `benchmarks.hf_models`), minus eager's.
``--before``: the JSON of a run at an earlier commit, whose fxopt rows the report shows beside
these. On CPU the run uses 1 torch thread and turns fxopt's plan cache off.
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
from fxopt.models import MODELS, ZooModel, zoo
from fxopt.solvers import DEFAULT_TIME_LIMIT
from benchmarks.harness import (Measurer, best_policy, choose, commit_of, error_line, load_average, log, mib, plan_fields,
                                report_head, restore_settings, run_meta, run_to_end, saved_settings, write_results)
from benchmarks.hf_models import flop_counter_mode_flops
from benchmarks.hf_zoo import HF_NAMES
from benchmarks.library_zoo import SIZES

# The models this benchmark knows, by short name: "unet" is MODELS["lib-unet"], "gpt2" MODELS["hf-gpt2"].
NAMES = (*(n.removeprefix("lib-") for n in zoo("library")), *HF_NAMES)
DEFAULT_MODELS = ("unet", "vae", "dit", "sd3", "gpt2", "llama", "vit")
DEFAULT_OUT = "benchmarks/results/library_checkpointing"
LIBRARIES = ("diffusers", "transformers", "timm", "torchtitan")


def entry_of(name: str) -> ZooModel:
    """The zoo's entry of a model named here (``"unet"`` -> ``MODELS["lib-unet"]``)."""
    return MODELS.get(f"lib-{name}") or MODELS[f"hf-{name}"]


def counted(fn: Any, inputs: tuple, model: torch.nn.Module, row: dict[str, Any]) -> None:
    model.zero_grad(set_to_none=True)
    try:
        row["fcm_flops"] = flop_counter_mode_flops(fn, inputs)
    except Exception as err:  # noqa: BLE001 - recorded in the row
        row["fcm_error"] = error_line(err)
    model.zero_grad(set_to_none=True)


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    entry = entry_of(name)
    torch.manual_seed(0)
    model, inputs = entry(args.size)
    m = Measurer(model, inputs, timed_steps=args.timed_steps)
    library_name, model_class = entry.source.split(".", 1)
    info: dict[str, Any] = {"name": name, "zoo": entry.name, "library": library_name, "class": model_class,
                            "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                            "input_shapes": [list(x.shape) for x in inputs]}
    rows: list[dict[str, Any]] = []
    eager = m.measure_eager({"method": "eager"})
    counted(model, inputs, model, eager)
    rows.append(eager)
    library = {"method": "library"}

    def switched_on() -> torch.nn.Module:
        entry.checkpointing(model, True)
        return model

    try:
        m.measure(library, switched_on)
        counted(model, inputs, model, library)
    finally:
        entry.checkpointing(model, False)
    rows.append(library)
    budget = library["measured_peak_bytes"]
    row: dict[str, Any] = {"method": "fxopt", "budget_bytes": budget}
    plans: list[fxopt.Plan] = []
    try:
        m.measure(row, lambda: fxopt.optimize(model, budget, example_inputs=inputs, time_limit=args.time_limit),
                  after_warmup=lambda fn, r: plans.append(fn.plan))
        row.update(plan_fields(plans[-1]))
        row.update(best_policy(plans[-1]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            replay = fxopt.optimize(model, budget, example_inputs=inputs, plan=plans[-1])
        counted(replay, inputs, model, row)
    except Exception as err:  # noqa: BLE001 - one failing row must not stop the others
        row["error"] = error_line(err)
        log(traceback.format_exc(limit=4))
    torch._dynamo.reset()
    rows.append(row)
    for r in rows:
        if r.get("fcm_flops") is not None and eager.get("fcm_flops") is not None:
            r["fcm_extra_flops"] = r["fcm_flops"] - eager["fcm_flops"]
        for key in ("step_times_s", "eager_step_times_s"):
            r.pop(key, None)
    return {"info": info, "rows": rows}


class Run:
    """Every model of ``args.models``, written after each; the process's torch threads and plan
    cache as they were after."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.models = choose(args.models, NAMES, "model")
        self.out = Path(args.out)
        self.before = read_before(args.before)
        self._restore = saved_settings()
        torch.set_num_threads(args.threads)
        os.environ["FXOPT_CACHE"] = "0"  # a cached plan would not be this commit's answer
        self.t0 = time.perf_counter()
        versions = {lib: _version(lib) for lib in LIBRARIES}
        self.data: dict[str, Any] = {"meta": run_meta(
            " ".join(["python -m benchmarks.library_checkpointing", *map(shlex.quote, args.argv)]), **versions,
            size=args.size, time_limit_s=args.time_limit, before_path=args.before), "models": []}

    def execute(self) -> None:
        try:
            for name in self.models:
                log(f"=== {name}")
                try:
                    self.data["models"].append(bench_model(name, self.args))
                except Exception as err:  # noqa: BLE001 - go on with the next model
                    self.data["models"].append({"info": {"name": name, "error": error_line(err)}, "rows": []})
                    log(traceback.format_exc(limit=4))
                self.data["meta"].update(elapsed_s=round(time.perf_counter() - self.t0, 1), load_end=load_average())
                write_results(self.out, self.data, report(self.data, self.before))
        finally:
            restore_settings(self._restore)


def read_before(path: str | None) -> dict[str, Any] | None:
    """The results of a run at an earlier commit (``--before``), with the ``path`` they were read from."""
    return None if path is None else {**json.loads(Path(path).read_text()), "path": path}


def _version(library: str) -> str | None:
    try:
        return __import__(library).__version__
    except ImportError:
        return None


def _gflop(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e9:.3f}"


def report(data: dict[str, Any], before: dict[str, Any] | None) -> str:
    meta = data["meta"]
    old = {e["info"]["name"]: {r["method"]: r for r in e["rows"]} for e in (before or {}).get("models", [])}
    lines = report_head(
        "fxopt at the peak of the library's own checkpointing", meta,
        *(f"{lib} {meta[lib]}" for lib in LIBRARIES if meta.get(lib)),
        f"{meta['cpu_count']} CPUs ({meta['torch_threads']} torch thread) · {_load(meta)} · size \"{meta['size']}\"",
        f"time limit {meta['time_limit_s']:g} s · {meta.get('elapsed_s', 0):.0f} s") + [
        "Peaks in MiB (measured, one step, parameters, inputs and gradients resident); extra GFLOP counted by "
        "`FlopCounterMode` over one step minus eager's. fxopt's budget is the library row's measured peak. "
        "Best policy: the cheapest simple policy (`fxopt/solvers/policies.py`) within that budget on the plan's "
        "graph, with its predicted extra GFLOP. Ratio: fxopt's extra FLOPs / the library's."
        + (f" Before: the fxopt row of `{before['path']}` (commit {commit_of(before['meta'])})." if before else ""),
        "",
        "| model | library | eager MiB | library ckpt MiB (+GFLOP) | fxopt measured MiB (+GFLOP) | ≤ budget | ratio "
        "| plan | best policy (+GFLOP) | grads equal |" + (" before: fxopt MiB (+GFLOP), ratio, plan |" if before else ""),
        "|---|---|---:|---:|---:|:---:|---:|---|---|:---:|" + ("---|" if before else ""),
    ]
    for entry in data["models"]:
        info = entry["info"]
        by = {r["method"]: r for r in entry["rows"]}
        if info.get("error") or "fxopt" not in by:
            lines.append(f"| {info['name']} | {info.get('library', '')} | {info.get('error', '?')} |")
            continue
        eager, lib, fx = by["eager"], by["library"], by["fxopt"]
        lines.append(f"| {info['name']} | {info['library']} | {mib(eager['measured_peak_bytes'])} "
                     f"| {mib(lib['measured_peak_bytes'])} (+{_gflop(lib.get('fcm_extra_flops'))}) | {_fxopt_cells(fx, lib)} "
                     f"| {_policy(fx)} | {_grads(by.values())} |"
                     + (f" {_before(old.get(info['name'], {}), lib)} |" if before else ""))
    return "\n".join(lines) + "\n"


def _load(meta: dict[str, Any]) -> str:
    """The load average as the run started and ended (files before the one harness: the 1-minute
    averages, as lists)."""
    if "load_average_start" in meta:
        return (f"load average {meta['load_average_start'][0]:.1f} → "
                f"{meta.get('load_average_end', [0])[0]:.1f}")
    return f"load at the end {meta.get('load_end', '?')}"


def _fxopt_cells(fx: dict[str, Any], lib: dict[str, Any]) -> str:
    if fx.get("error"):
        return f"{fx['error'][:80]} | – | – | –"
    extra, lib_extra = fx.get("fcm_extra_flops"), lib.get("fcm_extra_flops")
    ratio = "–" if extra is None or not lib_extra else f"{extra / lib_extra:.2f}"
    within = "yes" if fx.get("within_budget") else "**NO**"
    return (f"{mib(fx['measured_peak_bytes'])} (+{_gflop(extra)}) | {within} | {ratio} "
            f"| {fx.get('plan_solver')} ({fx.get('plan_status')})")


def _grads(rows) -> str:
    """Whether every row that ran a step had eager's gradients."""
    ran = [r for r in rows if r.get("measured_peak_bytes") is not None]
    return "yes" if all(r.get("grads_equal") for r in ran) else "**no**"


def _policy(fx: dict[str, Any]) -> str:
    if "best_policy" not in fx:
        return "–"
    if fx["best_policy"] is None:
        return "none fits"
    return f"{fx['best_policy']} (+{_gflop(fx['best_policy_extra_flops'])})"


def _before(rows: dict[str, Any], lib: dict[str, Any]) -> str:
    fx = rows.get("fxopt")
    if fx is None:
        return "–"
    if fx.get("error"):
        return fx["error"][:80]
    extra, lib_extra = fx.get("fcm_extra_flops"), lib.get("fcm_extra_flops")
    ratio = "–" if extra is None or not lib_extra else f"{extra / lib_extra:.2f}"
    return f"{mib(fx['measured_peak_bytes'])} (+{_gflop(extra)}), {ratio}, {fx.get('plan_solver')}"


def main(argv: list[str] | None = None) -> Run | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {', '.join(NAMES)}")
    p.add_argument("--size", default="bench", choices=SIZES)
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, help="fxopt's, in seconds")
    p.add_argument("--timed-steps", type=int, default=1, help="timed steps per row (timing is not reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", help="the JSON of a run at an earlier commit, shown beside this one")
    p.add_argument("--out", default=DEFAULT_OUT, help="path without suffix: writes .json and .md")
    p.add_argument("--report", action="store_true", help="only rewrite the Markdown from the JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.report:
        out.with_suffix(".md").write_text(report(json.loads(out.with_suffix(".json").read_text()), read_before(args.before)))
        log(f"wrote {out.with_suffix('.md')}")
        return None
    return run_to_end(Run, args, argv, str(out.with_suffix(".md")))


if __name__ == "__main__":
    main()
