"""The ``fxopt`` command line.

    fxopt demo [--budget 50%] [--solver auto]    eager vs fxopt on the built-in residual MLP
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
import warnings

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3


def _parse_budget(text: str):
    """"50%", "0.5" (a fraction), "3GiB", "500MB" or plain bytes."""
    from fxopt.budget import resolve_budget

    try:
        value: int | float | str = float(text) if "." in text and text.replace(".", "", 1).isdigit() else text
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        resolve_budget(value, 1)
        return value
    except Exception as err:  # noqa: BLE001 - argparse turns this into a usage error
        raise argparse.ArgumentTypeError(str(err)) from None


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
    console.print(
        f"[bold]fxopt demo[/]: residual MLP, {args.blocks} blocks, width {args.width}, batch {args.batch}, "
        f"fp32, torch {torch.__version__}, budget {args.budget}"
    )
    eager = model
    optimized_src = copy.deepcopy(model)
    t0 = time.perf_counter()
    with console.status("capturing and planning the training step…"):
        try:
            optimized = fxopt.optimize(optimized_src, args.budget, example_inputs=inputs,
                                       solver=args.solver, time_limit=args.time_limit)
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
        result = {"budget": args.budget, "plan": {k: getattr(plan, k) for k in (
            "budget_bytes", "peak_bytes", "eager_peak_bytes", "recompute_flops", "solver", "status", "solve_seconds")},
            "planning_seconds": planning, "grads_equal": grads_equal, **rows}
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return EXIT_OK if within and grads_equal else EXIT_ERROR


def build_parser() -> argparse.ArgumentParser:
    from fxopt.solvers import SOLVERS

    parser = argparse.ArgumentParser(prog="fxopt", description="Budgeted rematerialization of PyTorch training steps.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what fxopt does")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="eager vs fxopt on a built-in residual MLP, measured")
    d.add_argument("--budget", type=_parse_budget, default="50%",
                   help="bytes, '3GiB', '500MB', or a share of the eager peak: '50%%' or 0.5 (default 50%%)")
    d.add_argument("--solver", choices=SOLVERS, default="auto")
    d.add_argument("--time-limit", type=float, default=30.0, help="seconds for the ILP (default 30)")
    d.add_argument("--blocks", type=int, default=8)
    d.add_argument("--width", type=int, default=512)
    d.add_argument("--batch", type=int, default=4096)
    d.add_argument("--repeats", type=int, default=3, help="timed steps per method (median)")
    d.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    d.add_argument("-q", "--quiet", action="store_true", help="print nothing; the exit code tells")
    d.set_defaults(func=demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if not args.verbose:
        from fxopt.solvers import SolverTimeoutWarning

        warnings.simplefilter("ignore", SolverTimeoutWarning)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - a clean message, not a traceback
        from fxopt.errors import FxoptError

        if isinstance(err, FxoptError):
            print(f"fxopt: {err}", file=sys.stderr)
            return EXIT_ERROR
        raise


if __name__ == "__main__":
    sys.exit(main())
