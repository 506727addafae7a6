"""fxopt at the peak of a library's own activation checkpointing (issue 24, item 4).

    python -m benchmarks.library_checkpointing [--models unet,vae,dit,sd3,gpt2,llama,vit] [--size bench]
        [--time-limit 4] [--before benchmarks/results/library_checkpointing_main.json]
        [--out benchmarks/results/library_checkpointing]
    python -m benchmarks.library_checkpointing --report [--before ...] [--out ...]   # Markdown from the JSON

Per model of `benchmarks.library_zoo` (diffusers, transformers, timm; small configs), measured the
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
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch._dynamo

import fxopt
from fxopt.solvers import DEFAULT_TIME_LIMIT
from benchmarks.harness import Measurer, error_line, log, mib, plan_fields, run_meta
from benchmarks.hf_models import flop_counter_mode_flops
from benchmarks.library_zoo import LIBRARY_ZOO

DEFAULT_MODELS = ("unet", "vae", "dit", "sd3", "gpt2", "llama", "vit")
DEFAULT_OUT = "benchmarks/results/library_checkpointing"


def best_policy(plan: fxopt.Plan) -> dict[str, Any]:
    """The cheapest simple policy within the plan's budget on its graph (none before they existed)."""
    try:
        from fxopt.solvers.policies import named_policy_candidates
    except ImportError:
        return {}
    fitting = [(timeline.cost, name, timeline) for name, (_, timeline) in named_policy_candidates(plan.graph)
               if timeline.peak_bytes <= plan.budget_bytes]
    if not fitting:
        return {"best_policy": None}
    _, name, timeline = min(fitting, key=lambda f: (f[0], f[1]))
    return {"best_policy": name, "best_policy_peak_bytes": timeline.peak_bytes,
            "best_policy_extra_flops": timeline.recompute_flops}


def counted(fn: Any, inputs: tuple, model: torch.nn.Module, row: dict[str, Any]) -> None:
    model.zero_grad(set_to_none=True)
    try:
        row["fcm_flops"] = flop_counter_mode_flops(fn, inputs)
    except Exception as err:  # noqa: BLE001 - recorded in the row
        row["fcm_error"] = error_line(err)
    model.zero_grad(set_to_none=True)


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    entry = LIBRARY_ZOO[name]
    model, inputs = entry.build(args.size)
    m = Measurer(model, inputs, timed_steps=args.timed_steps)
    info: dict[str, Any] = {"name": name, "library": entry.library, "class": entry.model_class,
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every model of ``args.models``, with the process's torch threads and plan cache as they were after."""
    threads, cache = torch.get_num_threads(), os.environ.get("FXOPT_CACHE")
    torch.set_num_threads(args.threads)
    os.environ["FXOPT_CACHE"] = "0"  # a cached plan would not be this commit's answer
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)
        if cache is None:
            os.environ.pop("FXOPT_CACHE", None)
        else:
            os.environ["FXOPT_CACHE"] = cache


def _run(args: argparse.Namespace) -> dict[str, Any]:
    meta = run_meta(" ".join(["python -m benchmarks.library_checkpointing", *map(shlex.quote, args.argv)]))
    for lib in ("diffusers", "transformers", "timm"):
        try:
            meta[lib] = __import__(lib).__version__
        except ImportError:
            meta[lib] = None
    meta.update({"size": args.size, "time_limit_s": args.time_limit, "load_average_start": os.getloadavg()})
    data: dict[str, Any] = {"meta": meta, "models": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for name in args.models.split(","):
        log(f"=== {name}")
        try:
            data["models"].append(bench_model(name, args))
        except Exception as err:  # noqa: BLE001 - go on with the next model
            data["models"].append({"info": {"name": name, "error": error_line(err)}, "rows": []})
            log(traceback.format_exc(limit=4))
        meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
        meta["load_average_end"] = os.getloadavg()
        out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str))
    return data


def _gflop(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e9:.3f}"


def report(data: dict[str, Any], before: dict[str, Any] | None) -> str:
    meta = data["meta"]
    old = {e["info"]["name"]: {r["method"]: r for r in e["rows"]} for e in (before or {}).get("models", [])}
    versions = " · ".join(f"{lib} {meta.get(lib)}" for lib in ("diffusers", "transformers", "timm") if meta.get(lib))
    lines = [
        "# fxopt at the peak of the library's own checkpointing",
        "",
        f"`{meta['command']}` · {meta['date']} · commit {meta['git']} · torch {meta['torch']} · {versions} · "
        f"{meta['cpu_count']} CPUs ({meta['torch_threads']} torch thread) · load average "
        f"{meta['load_average_start'][0]:.1f} → {meta.get('load_average_end', [0])[0]:.1f} · size \"{meta['size']}\" · "
        f"time limit {meta['time_limit_s']:g} s · {meta.get('elapsed_s', 0):.0f} s",
        "",
        "Peaks in MiB (measured, one step, parameters, inputs and gradients resident); extra GFLOP counted by "
        "`FlopCounterMode` over one step minus eager's. fxopt's budget is the library row's measured peak. "
        "Best policy: the cheapest simple policy (`fxopt/solvers/policies.py`) within that budget on the plan's "
        "graph, with its predicted extra GFLOP. Ratio: fxopt's extra FLOPs / the library's."
        + (f" Before: the fxopt row of `{meta.get('before_path')}` (commit {before['meta']['git']})." if before else ""),
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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, of {sorted(LIBRARY_ZOO)}")
    p.add_argument("--size", default="bench", choices=("test", "bench"))
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, help="fxopt's, in seconds")
    p.add_argument("--timed-steps", type=int, default=1, help="timed steps per row (timing is not reported)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", help="the JSON of a run at an earlier commit, shown beside this one")
    p.add_argument("--out", default=DEFAULT_OUT, help="path without suffix: writes .json and .md")
    p.add_argument("--report", action="store_true", help="only rewrite the Markdown from the JSON")
    args = p.parse_args(argv)
    args.argv = argv
    out = Path(args.out)
    data = json.loads(out.with_suffix(".json").read_text()) if args.report else run(args)
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if before is not None:
        data["meta"]["before_path"] = args.before
    out.with_suffix(".md").write_text(report(data, before))
    log(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
