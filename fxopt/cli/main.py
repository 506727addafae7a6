"""The ``fxopt`` command line (also ``python -m fxopt``).

    fxopt demo [--budget 50%] [--solver auto]     eager vs fxopt on the built-in residual MLP
    fxopt inspect MODEL [--budget 50%] [--code] [--dot FILE] [--json FILE] [--plot FILE.png] [--run]
    fxopt inspect MODEL --stages 4 --microbatches 8 [--schedule 1F1B] [--json FILE] [--plot FILE.png]
    fxopt inspect MODEL --budget 24GiB --max-batch  the largest batch that fits
    fxopt fit MODEL --device H100-80GB [--budget 70GiB]  does it fit that GPU, planned here

MODEL is ``path/to/file.py:factory`` or ``package.module:factory``; ``factory()`` returns
``(model, example_inputs)`` (see `load_model`). Exit codes: 0 ok, 1 error (or, with ``--run``, the
measured peak above the budget), 2 usage (a bad MODEL or budget), 3 infeasible budget.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import json
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3


def _given_options(args: argparse.Namespace) -> dict:
    """The fields of `fxopt.Options` the command line gave (the budget always: it has a default
    there), by name."""
    from fxopt.options import public_fields

    return {f.name: getattr(args, f.name) for f in public_fields() if hasattr(args, f.name)}


def _options(args: argparse.Namespace):
    """The `fxopt.Options` the command line gave."""
    from fxopt.options import Options

    given = _given_options(args)
    return Options.of(given.pop("budget"), **given)


def _step(model, inputs):
    from fxopt.models import loss_of

    loss = loss_of(model(*inputs))
    loss.backward()
    return loss


def _time_steps(model, inputs, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _step(model, inputs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def demo(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    import fxopt
    from fxopt.measure import count_flops
    from fxopt.models import residual_mlp

    console = Console(quiet=args.quiet)
    torch.manual_seed(0)
    model, inputs = residual_mlp(args.blocks, args.width, args.batch)
    options = _options(args)
    console.print(
        f"[bold]fxopt demo[/]: residual MLP, {args.blocks} blocks, width {args.width}, batch {args.batch}, "
        f"fp32, torch {torch.__version__}, budget {options.budget}"
    )
    eager = model
    optimized_src = copy.deepcopy(model)
    t0 = time.perf_counter()
    with console.status("capturing and planning the training step…"):
        try:
            optimized = fxopt.optimize(optimized_src, options, example_inputs=inputs)
        except fxopt.InfeasibleBudgetError as err:
            console.print(f"[red]infeasible budget:[/] {err}")
            return EXIT_INFEASIBLE
    plan = optimized.plan or optimized._options.plan
    planning = time.perf_counter() - t0

    rows = {}
    for name, m in (("eager", eager), ("fxopt", optimized)):
        with console.status(f"measuring {name}…"):
            _step(m, inputs)  # warm up
            m.zero_grad(set_to_none=True)
            peak = fxopt.measure_peak(_step, m, inputs, resident=[m, inputs]).peak_bytes
            m.zero_grad(set_to_none=True)
            flops = count_flops(_step, m, inputs)
        rows[name] = {"measured_peak_bytes": peak, "flops": flops, "step_times": []}
    with console.status("timing steps…"):
        for _ in range(args.repeats):  # interleaved, so both see the same machine load
            for name, m in (("eager", eager), ("fxopt", optimized)):
                rows[name]["step_times"].append(_time_steps(m, inputs, 1))
    for row in rows.values():
        row["step_seconds"] = statistics.median(row["step_times"])
    eager_grads = [p.grad for p in eager.parameters()]
    fx_grads = [p.grad for p in optimized_src.parameters()]
    grads_equal = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(eager_grads, fx_grads))

    e, f = rows["eager"], rows["fxopt"]
    table = Table(
        title="one training step (forward + backward)",
        caption=f"fxopt plan: solver {plan.solver} ({plan.status}), planned in {planning:.1f} s; "
        "peaks in MiB, measured unless marked predicted",
    )
    for col in ("", "peak", "predicted", "budget", "GFLOP", "step time"):
        table.add_column(col, justify="right")
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    table.add_row("eager", mib(e["measured_peak_bytes"]), mib(plan.eager_peak_bytes), "",
                  f"{e['flops'] / 1e9:.2f}", f"{e['step_seconds'] * 1e3:.0f} ms")
    table.add_row("fxopt", mib(f["measured_peak_bytes"]), mib(plan.peak_bytes), mib(plan.budget_bytes),
                  f"{f['flops'] / 1e9:.2f} (+{(f['flops'] - e['flops']) / 1e9:.2f})",
                  f"{f['step_seconds'] * 1e3:.0f} ms ({f['step_seconds'] / e['step_seconds']:.2f}x)")
    console.print(table)
    within = f["measured_peak_bytes"] <= plan.budget_bytes
    console.print(
        f"measured peak {'within' if within else '[red]ABOVE[/]'} the budget; "
        f"{100 * (1 - f['measured_peak_bytes'] / e['measured_peak_bytes']):.0f}% less memory than eager; "
        f"gradients {'equal to' if grads_equal else '[red]DIFFERENT from[/]'} eager's; "
        f"{len(plan.saved)} values saved, {sum(plan.recomputed.values())} recomputations"
    )
    if args.json:
        result = {"budget": str(options.budget), "plan": {k: getattr(plan, k) for k in (
            "budget_bytes", "peak_bytes", "eager_peak_bytes", "recompute_flops", "solver", "status", "solve_seconds")},
            "planning_seconds": planning, "grads_equal": grads_equal, **rows}
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return EXIT_OK if within and grads_equal else EXIT_ERROR



class ModelSpecError(ValueError):
    """MODEL does not name a factory returning (model, example_inputs)."""


def load_model(spec: str):
    """Call the factory ``spec`` names and return ``(model, example_inputs)``.

    ``spec`` is ``path/to/file.py:factory`` (the file is run as a module, its folder first on
    ``sys.path`` so it can import its neighbours) or ``package.module:factory`` (imported). The
    factory takes no arguments and returns an ``nn.Module`` and its example inputs: a tuple or
    list of positional arguments, a dict of keyword arguments, or a single tensor; one call
    ``model(*inputs)`` is one forward pass, and fxopt plans the forward and the backward of the
    sum of its floating-point outputs (`fxopt.models.loss_of`).
    """
    import torch

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ModelSpecError(f"MODEL must be 'path/to/file.py:factory' or 'package.module:factory', not {spec!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ModelSpecError(f"no such file: {where}")
        module_name = f"_fxopt_model_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        sys.path.insert(0, str(path.resolve().parent))
        try:
            loader_spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as err:
            if err.name and where.startswith(err.name):
                raise ModelSpecError(f"no module named {err.name!r} (MODEL {spec!r}); is it installed, "
                                     "or did you mean a file path?") from None
            raise
    factory = getattr(module, name, None)
    if factory is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ModelSpecError(f"{where} has no {name!r}" + (f"; it has {', '.join(found[:12])}" if found else ""))
    if not callable(factory):
        raise ModelSpecError(f"{spec} is a {type(factory).__name__}, not a factory function")
    result = factory()
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ModelSpecError(f"{spec}() must return (model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"{spec}() returned a {type(model).__name__} as its model, not an nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list, dict)):
        raise ModelSpecError(f"{spec}() must return example inputs as a tuple, list, dict or tensor, "
                             f"not {type(inputs).__name__}")
    return model, inputs


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _train_step(model, inputs):
    from fxopt.models import loss_of

    loss = loss_of(_call(model, inputs))
    loss.backward()
    return loss


def _describe_inputs(inputs) -> str:
    import torch

    values = inputs.items() if isinstance(inputs, dict) else enumerate(inputs)
    parts = []
    for key, v in values:
        text = f"{tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor) else type(v).__name__
        parts.append(f"{key}={text}" if isinstance(key, str) else text)
    return ", ".join(parts)


class _StatusHandler(logging.Handler):
    """Shows fxopt's log messages as the progress line of a rich status."""

    def __init__(self, status, prefix: str):
        super().__init__(logging.INFO)
        self.status, self.prefix = status, prefix

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().removeprefix("fxopt: ").splitlines()[0]
        self.status.update(f"{self.prefix}: {message[:100]}")


@contextlib.contextmanager
def _progress(console, text: str):
    """A spinner with ``text``, updated with what fxopt logs meanwhile."""
    logger = logging.getLogger("fxopt")
    # One live display at a time: the planner's own status line (FXOPT_PROGRESS) stays off.
    with console.status(text + "…") as status, _environ(FXOPT_PROGRESS="0"):
        handler = _StatusHandler(status, text)
        logger.addHandler(handler)
        level = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        try:
            yield status
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)


@contextlib.contextmanager
def _environ(**values: str):
    import os

    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def inspect(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    import fxopt
    from fxopt.plan_ahead import plan_and_rewrite
    from fxopt.units import format_bytes

    out = Console(quiet=args.quiet, highlight=False, soft_wrap=True)
    err = Console(stderr=True, quiet=args.quiet)
    try:
        with _progress(err, f"loading {args.model}"):
            torch.manual_seed(args.seed)
            model, inputs = load_model(args.model)
    except ModelSpecError as e:
        print(f"fxopt inspect: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.stages is not None:
        return inspect_pipeline(args, model, inputs, out, err)
    n_params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    options = _options(args)
    out.print(f"[bold]fxopt inspect[/] {args.model}: {type(model).__name__}, {n_params / 1e6:.2f} M parameters "
              f"({format_bytes(param_bytes)}), inputs {_describe_inputs(inputs)}; budget {options.budget}, "
              f"solver {options.solver}, compiler {options.compiler}, torch {torch.__version__}")
    if args.max_batch:
        return _max_batch(model, inputs, args, out, err)
    if args.run and options.device is not None and options.device.kind != "cpu":
        print(f"fxopt inspect: error: --run measures the plan on this machine, and a plan for {options.device.name} "
              "counts that device's memory: leave --run out (or plan for --device cpu)", file=sys.stderr)
        return EXIT_USAGE
    t0 = time.perf_counter()
    try:
        with _progress(err, "capturing and planning the training step"):
            ready = plan_and_rewrite(model, options, inputs, plan_only=not args.run)
    except fxopt.InfeasibleBudgetError as e:
        out.print(f"[red]infeasible budget:[/] {e}")
        out.print(f"try: fxopt inspect {args.model} --budget {e.min_budget} (or --budget min)")
        return EXIT_INFEASIBLE
    plan = ready.plan
    planning = time.perf_counter() - t0

    measured, grads_equal = _measure(model, inputs, plan, options, args, err) if args.run else ({}, None)
    _write_files(plan, args, measured)
    _print_summary(out, plan, args, planning, measured, grads_equal)
    _print_tensors(out, plan, args.top)
    if args.code:
        _print_code(out, ready, options.compiler)
    for flag, path in (("json", args.json), ("dot", args.dot), ("plot", args.plot)):
        if path:
            out.print(f"wrote {path} (--{flag})")
    if measured and not (_measured_peak(measured["fxopt"]) <= plan.budget_bytes and grads_equal):
        return EXIT_ERROR
    return EXIT_OK


def inspect_pipeline(args: argparse.Namespace, model, inputs, out, err) -> int:
    """``fxopt inspect MODEL --stages N``: the cuts fxopt chooses, each stage's time, memory and
    plan, the bubble (`fxopt.pipeline`, the loss the sum of the outputs as for one step)."""
    import fxopt

    if args.run or args.code or args.dot or args.max_batch:
        print("fxopt inspect: error: --run, --code, --dot and --max-batch are for one step; a pipeline runs on one "
              "process per stage (docs/pipeline.md)", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(inputs, dict):
        print("fxopt inspect: error: a pipeline takes positional inputs (torch's schedules split them into "
              "microbatches); the factory returned keyword inputs", file=sys.stderr)
        return EXIT_USAGE
    microbatches = args.microbatches or args.stages
    try:
        with _progress(err, f"cutting the step into {args.stages} stages and planning each"):
            plan = fxopt.pipeline(model, inputs, stages=args.stages, microbatches=microbatches,
                                  schedule=args.schedule, budget=_options(args))
    except fxopt.InfeasibleBudgetError as e:
        out.print(f"[red]infeasible budget:[/] {e}")
        out.print(f"try: fxopt inspect {args.model} --stages {args.stages} --microbatches {microbatches} "
                  f"--budget {e.min_budget}")
        return EXIT_INFEASIBLE
    except ValueError as e:
        print(f"fxopt inspect: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    from fxopt.cli.report import pipeline_table

    out.print(f"[bold]fxopt inspect[/] {args.model}: {type(model).__name__}, inputs {_describe_inputs(inputs)}")
    out.print(plan.summary().splitlines()[0])
    out.print(pipeline_table(plan))
    for flag, path in (("json", args.json), ("plot", args.plot)):
        if path:
            if flag == "json":
                plan.to_json(path)
            else:
                from fxopt.cli.report import plot_pipeline

                plot_pipeline(plan, path, title=f"{args.model}: {args.stages} stages")
            out.print(f"wrote {path} (--{flag})")
    return EXIT_OK


def _max_batch(model, inputs, args: argparse.Namespace, out, err) -> int:
    """``--max-batch``: the largest batch that fits the budget (`fxopt.max_batch`), the factory's
    inputs repeated or cut along dim 0 to each batch tried."""
    import fxopt
    from fxopt.fitting import at_batch

    given = _given_options(args)
    budget = given.pop("budget")
    if budget.bytes is None:
        print(f"fxopt inspect: error: --max-batch needs the budget in bytes or as a size ('24GiB'), not "
              f"{str(budget)!r}", file=sys.stderr)
        return EXIT_USAGE
    try:
        with _progress(err, "finding the largest batch that fits"):
            found = fxopt.max_batch(model, budget, lambda b: at_batch(inputs, b), **given)
    except fxopt.InfeasibleBudgetError as e:
        out.print(f"[red]infeasible budget:[/] {e}")
        return EXIT_INFEASIBLE
    from rich.table import Table

    table = Table(title=f"the largest batch within {budget}")
    table.add_column("")
    table.add_column("batch", justify="right")
    table.add_column("how", justify="left")
    table.add_row("fxopt", str(found.batch), f"plan: {found.plan.solver} ({found.plan.status}), "
                  f"+{found.plan.recompute_flops / 1e9:.3f} GFLOP")
    table.add_row("eager", str(found.eager_batch), "nothing recomputed")
    table.add_row("per-block checkpointing", "-" if found.checkpoint_batch is None else str(found.checkpoint_batch),
                  f"{found.blocks} blocks" if found.blocks else "no repeated blocks")
    table.add_row("no schedule above", str(found.proven_max), "proven (peak lower bound)")
    out.print(table)
    out.print(f"found in {found.seconds:.1f} s (one capture with the batch symbolic); predicted peaks, "
              f"fxopt's plan at {found.batch}: {fxopt.units.format_bytes(found.plan.peak_bytes)}")
    if found.stopped:
        out.print(f"[yellow]stopped at the time limit[/] ({found.options.time_limit:g} s) in: {', '.join(found.stopped)}; "
                  "the best answer found by then (another run may find another): raise --time-limit")
    return EXIT_OK


def fit_command(args: argparse.Namespace) -> int:
    """``fxopt fit MODEL --device PROFILE``: does the step fit the device (`fxopt.fit`), planned on
    fake tensors here. Exit code 3 where it does not fit."""
    from rich.console import Console

    import fxopt
    from fxopt.devices import names

    out = Console(quiet=args.quiet, highlight=False, soft_wrap=True)
    given = _given_options(args)
    budget, device = given.pop("budget"), given.pop("device", None)
    if device is None:
        print(f"fxopt fit: error: --device is required: a profile's name ({', '.join(names())}) or "
              "the path of a profile's JSON", file=sys.stderr)
        return EXIT_USAGE
    if budget is not None and budget.bytes is None:
        print(f"fxopt fit: error: --budget is bytes or a size ('70GiB'), not {str(budget)!r} (leave it out for the "
              "device's memory)", file=sys.stderr)
        return EXIT_USAGE
    try:
        model, inputs = load_model(args.model)
    except ModelSpecError as e:
        print(f"fxopt fit: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    with _progress(Console(stderr=True, quiet=args.quiet), f"planning {args.model} for {device.name}"):
        found = fxopt.fit(model, inputs, device=device, budget=None if budget is None else budget.bytes,
                          limit=args.limit, **given)
    out.print(str(found), markup=False, highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(found.to_dict(), indent=1))
        out.print(f"wrote {args.json} (--json)")
    return EXIT_OK if found.fits else EXIT_INFEASIBLE


def _measured_peak(timeline) -> int:
    return max(timeline.live_bytes, default=timeline.start_bytes)


def _write_files(plan, args: argparse.Namespace, measured: dict) -> None:
    if args.json:
        plan.to_json(args.json)
    if args.dot:
        from fxopt.cli.report import write_dot

        write_dot(plan, args.dot)
    if args.plot:
        from fxopt.cli.report import plot_timeline

        plot_timeline(plan, args.plot, measured or None, title=f"{args.model}: one training step")


def _print_summary(out, plan, args: argparse.Namespace, planning: float, measured: dict, grads_equal) -> None:
    """Peaks (predicted, and measured with --run) against the budget, extra compute, decisions."""
    from rich.table import Table

    from fxopt.solvers.plan import communication_waits
    from fxopt.units import format_bytes

    summary = Table(title="one training step (forward + backward)", show_header=True)
    summary.add_column("")
    summary.add_column("peak (predicted)", justify="right")
    if measured:
        summary.add_column("peak (measured)", justify="right")
    summary.add_column("", justify="left")
    rows = [("eager", plan.eager_peak_bytes, measured.get("eager"), ""),
            ("fxopt plan", plan.peak_bytes, measured.get("fxopt"),
             f"{100 * (1 - plan.peak_bytes / plan.eager_peak_bytes):.0f}% below eager's predicted peak "
             "(what a fraction is of)")]
    for label, predicted, real, note in rows:
        cells = [label, format_bytes(predicted)]
        if measured:
            cells.append(format_bytes(_measured_peak(real)))
        summary.add_row(*cells, note)
    budget_cells = ["budget", format_bytes(plan.budget_bytes)] + ([""] if measured else [])
    summary.add_row(*budget_cells, str(args.budget))
    out.print(summary)
    total_flops = sum(n.flops for n in plan.graph.nodes)
    extra = plan.recompute_flops
    share = f" ({100 * extra / total_flops:.1f}% of the step's {total_flops / 1e9:.3f} GFLOP)" if total_flops else ""
    recomputations = sum(plan.recomputed.values())
    saved_bytes = plan.timeline().saved_bytes
    out.print(f"extra compute: +{extra / 1e9:.3f} GFLOP{share}")
    out.print(f"solver: {plan.solver} ({plan.status}), solved in {plan.solve_seconds:.1f} s; "
              f"captured and planned in {planning:.1f} s")
    out.print(f"decisions: {len(plan.saved)} values saved ({format_bytes(saved_bytes)} kept after the forward), "
              f"{len(plan.compressed)} of them compressed ({len(plan.lossy)} lossy), "
              f"{recomputations} recomputations of {len(plan.recomputed)} values")
    if plan.planned_for:
        out.print(plan.planned_for)
    waits = communication_waits(plan)
    if waits:
        out.print(waits.removeprefix("; "))
    if plan.offloaded:
        out.print(f"offloaded: {len(plan.offloaded)} values, {format_bytes(plan.host_bytes)} in host memory at "
                  f"most; the backward is predicted to wait {plan.exposed_transfer_seconds * 1e3:.3f} ms for "
                  f"reloads")
    if measured:
        within = _measured_peak(measured["fxopt"]) <= plan.budget_bytes
        out.print(f"measured: fxopt's peak {'within' if within else '[red]ABOVE[/]'} the budget; gradients "
                  f"{'equal to' if grads_equal else '[red]DIFFERENT from[/]'} eager's")


def _print_tensors(out, plan, top: int) -> None:
    """The saved and recomputed tensors, largest first (``top`` of them)."""
    from rich.table import Table

    from fxopt.cli.report import tensor_rows
    from fxopt.units import format_bytes

    rows = tensor_rows(plan)
    table = Table(title="saved and recomputed tensors, largest first")
    for col, justify in (("tensor", "left"), ("decision", "left"), ("size", "right"), ("module", "left"),
                         ("extra GFLOP", "right")):
        table.add_column(col, justify=justify)
    for r in rows[:top]:
        decision = f"RECOMPUTE x{r.times}" if r.decision == "RECOMPUTE" else r.decision
        table.add_row(r.name, decision, format_bytes(r.bytes), r.module or "-",
                      f"{r.flops / 1e9:.4f}" if r.decision == "RECOMPUTE" else "")
    if len(rows) > top:
        table.caption = f"{len(rows) - top} more not shown (--top N shows more)"
    out.print(table)


def _print_code(out, ready, compiler: str) -> None:
    from rich.syntax import Syntax

    note = " (as fxopt rewrote them; Inductor then compiles these)" if compiler == "inductor" else ""
    for title, gm in (("forward", ready.forward), ("backward", ready.backward)):
        out.print(f"[bold]# rewritten {title}{note}[/]")
        code = gm.code.strip()
        if out.is_terminal:
            out.print(Syntax(code, "python", theme="ansi_dark", word_wrap=True))
        else:
            out.print(code, markup=False)


def _measure(model, inputs, plan, options, args, err):
    """Run one step eagerly and one through fxopt (the plan replayed with ``args.compiler``),
    each from no gradients and the same seed; their measured timelines and whether the
    gradients agree."""
    import torch

    import fxopt
    from fxopt.measure import measure_timeline

    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), dataclasses.replace(options, budget=plan.budget_bytes, plan=plan, device=None))
    timelines = {}
    for name, m in (("eager", eager), ("fxopt", optimized)):
        text = "compiling and measuring fxopt's step" if name == "fxopt" else "measuring eager's step"
        with _progress(err, text):
            torch.manual_seed(args.seed)
            _train_step(m, inputs)  # warm up (and compile)
            m.zero_grad(set_to_none=True)
            torch.manual_seed(args.seed)
            timelines[name] = measure_timeline(_train_step, m, inputs, resident=[m, inputs])
    tol = {"rtol": 1e-4, "atol": 1e-5} if options.compiler == "inductor" else {"rtol": 1e-5, "atol": 1e-6}
    grads_equal = all(
        (a.grad is None) == (b.grad is None) and (a.grad is None or torch.allclose(a.grad, b.grad, **tol))
        for a, b in zip(eager.parameters(), optimized.parameters())
    )
    return timelines, grads_equal


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing; the exit code tells")
    p.add_argument("-v", "--verbose", action="count", default=0, dest="sub_verbose",
                   help="log what fxopt does (-vv: more)")


def _add_options(p: argparse.ArgumentParser) -> None:
    """A flag for each field of `fxopt.Options` that has one (`fxopt.options.Flag`), its help
    the first sentence of the field's doc; a value is read and checked as the field reads it (a
    bad one is a usage error). A flag not given leaves the field's default."""
    from fxopt.options import public_fields

    for field in public_fields():
        flag = field.metadata["flag"]
        if flag is None:
            continue
        name = field.name.replace("_", "-")
        text = flag.help or _first_sentence(field.metadata["doc"])
        if flag.negate:
            p.add_argument(f"--no-{name}", dest=field.name, action="store_false", default=argparse.SUPPRESS,
                           help=text.replace("%", "%%"))
            continue
        default = flag.default if flag.default is not None else field.default
        if flag.help is None and default is not None:
            text += f" (default {default})"
        metavar = flag.metavar or (f"{{{','.join(flag.choices)}}}" if flag.choices else None)
        p.add_argument(f"--{name}", dest=field.name, type=_reader(field, flag), metavar=metavar,
                       default=argparse.SUPPRESS if flag.default is None else flag.default,
                       help=text.replace("%", "%%"))


def _first_sentence(doc: str) -> str:
    text = doc.replace("`", "").split(". ")[0].removesuffix(".")
    return text[0].lower() + text[1:]


def _reader(field, flag):
    """The field's value from a flag's text: one of ``flag.choices``, read by ``flag.parse``, then
    the field's check (argparse would check choices against the value read)."""
    check = field.metadata["check"] or (lambda value: value)
    parse = flag.parse or (lambda text: text)

    def read(text: str):
        if flag.choices and text not in flag.choices:
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(flag.choices)})")
        try:
            return check(parse(text))
        except Exception as err:  # noqa: BLE001 - argparse turns this into a usage error
            raise argparse.ArgumentTypeError(str(err)) from None

    read.__name__ = field.name  # argparse names the type in its "invalid value" message
    return read


# The subcommands that take a MODEL factory: their help line and description.
MODEL_COMMANDS = {
    "inspect": ("plan a model's training step and show what fxopt would do",
                "Plan the training step of MODEL and show eager vs planned peak, extra FLOPs, and which tensors "
                "are saved or recomputed. MODEL is 'path/to/file.py:factory' or 'package.module:factory'; "
                "factory() returns (model, example_inputs)."),
    "fit": ("does a model's training step fit a device (planned here, on fake tensors)",
            "Whether the training step of MODEL fits the device PROFILE with fxopt, planned on fake tensors on this "
            "machine: eager's peak, the smallest budget fxopt reaches, the recompute cost at the device's memory "
            "(or --budget), the largest batch. MODEL is 'path/to/file.py:factory' or 'package.module:factory'."),
}


def _model_command(sub, name: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` of `MODEL_COMMANDS`: a MODEL factory and the option flags."""
    help, description = MODEL_COMMANDS[name]
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("model", metavar="MODEL", help="path/to/file.py:factory or package.module:factory")
    _add_options(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxopt", description="Budgeted rematerialization of PyTorch training steps.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log what fxopt does (-vv: more)")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="eager vs fxopt on a built-in residual MLP, measured")
    _add_options(d)
    d.add_argument("--blocks", type=int, default=8, help="residual blocks of the MLP (default 8)")
    d.add_argument("--width", type=int, default=512, help="its hidden width (default 512)")
    d.add_argument("--batch", type=int, default=4096, help="rows of its input batch (default 4096)")
    d.add_argument("--repeats", type=int, default=3, help="timed steps per method (median; default 3)")
    d.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    _add_common(d)
    d.set_defaults(func=demo)

    i = _model_command(sub, "inspect")
    i.add_argument("--code", action="store_true", help="print the rewritten forward and backward graphs")
    i.add_argument("--dot", metavar="FILE", help="write the step's graph with the decisions as graphviz DOT")
    i.add_argument("--json", metavar="FILE", help="write the plan as JSON (replay with fxopt.Plan.from_json)")
    i.add_argument("--plot", metavar="FILE.png", help="draw the memory timeline, eager vs planned (needs matplotlib)")
    i.add_argument("--run", action="store_true", help="also run one step eagerly and one with the plan, measured")
    i.add_argument("--max-batch", action="store_true",
                   help="find the largest batch whose step fits the budget (in bytes), against eager's and "
                        "per-block checkpointing's")
    i.add_argument("--top", type=int, default=20, help="rows of the tensor table (default 20)")
    i.add_argument("--seed", type=int, default=0, help="torch.manual_seed before the factory and each run")
    i.add_argument("--stages", type=int, metavar="N",
                   help="cut the step into N pipeline stages instead: the cuts, each stage's plan, the bubble")
    i.add_argument("--microbatches", type=int, metavar="M", help="with --stages: microbatches (default N)")
    i.add_argument("--schedule", choices=("1F1B", "GPipe"), default="1F1B", help="with --stages (default 1F1B)")
    _add_common(i)
    i.set_defaults(func=inspect)

    f = _model_command(sub, "fit")
    budget = next(a for a in f._actions if a.dest == "budget")
    budget.default, budget.help = None, "the memory the step may use: bytes or a size ('70GiB') (default: the device's)"
    f.add_argument("--limit", type=int, default=2**16, help="the largest batch searched (default 65536)")
    f.add_argument("--json", metavar="FILE", help="write the answer's numbers as JSON")
    _add_common(f)
    f.set_defaults(func=fit_command)
    return parser


@contextlib.contextmanager
def _logging(verbosity: int, quiet: bool):
    """fxopt's log records on stderr: warnings by default, INFO with -v, DEBUG with -vv."""
    from rich.logging import RichHandler

    logger = logging.getLogger("fxopt")
    level = logging.DEBUG if verbosity >= 2 else logging.INFO if verbosity == 1 else logging.WARNING
    from rich.console import Console

    handler = RichHandler(console=Console(stderr=True, quiet=quiet), show_path=False, show_time=verbosity >= 2)
    handler.setLevel(level)
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    verbosity = args.verbose + getattr(args, "sub_verbose", 0)
    from fxopt.solvers import SolverTimeoutWarning

    with _logging(verbosity, args.quiet), warnings.catch_warnings():
        if not verbosity:
            warnings.simplefilter("ignore", SolverTimeoutWarning)
        try:
            return args.func(args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except Exception as err:  # noqa: BLE001 - a clean message, not a traceback
            from fxopt.errors import FxoptError

            if isinstance(err, FxoptError) and verbosity < 2:
                print(f"fxopt: {err}", file=sys.stderr)
                return EXIT_ERROR
            raise


if __name__ == "__main__":
    sys.exit(main())
