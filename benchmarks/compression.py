"""Lossless compression against recompute alone, on the test zoo.

    python -m benchmarks.compression [--models residual_mlp cnn_bn ...] [--out benchmarks/results]

For each model of `fxopt.models.ZOO`:
  1. the smallest budget fxopt reaches with ``compress=False`` (recompute only) and with
     ``compress=True`` (the default: the solver may also keep masks as packed bits, max-pooling
     indices as int32), from `InfeasibleBudgetError.min_budget`;
  2. at a common budget (the larger of the two minima, and 60% of the eager peak when that is
     above it), the extra FLOPs and estimated cost of each plan;
  3. one real step of the ``compress=True`` plan at the common budget: measured peak
     (`fxopt.measure_peak`), and whether the loss and every gradient equal eager's bit for bit.

Writes ``<out>/compression.md`` and ``compression.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import warnings
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import meta_line, run_meta, write_results
from fxopt.models import ZOO, loss_of
from fxopt.solvers import SolverTimeoutWarning
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

MiB = 2**20


def step(model, inputs):
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss.detach()


def min_budget(model, inputs, compress: bool, time_limit: float) -> int:
    try:
        fxopt.plan(model, 1, inputs, compress=compress, time_limit=time_limit)
    except fxopt.InfeasibleBudgetError as err:
        return err.min_budget
    raise AssertionError("a 1-byte budget was met")


def run_model(name: str, time_limit: float) -> dict:
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    row: dict = {"model": name}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        for compress in (False, True):
            row[f"min_budget_{compress}"] = min_budget(model, inputs, compress, time_limit)
        eager_peak = fxopt.plan(model, 1.0, inputs, compress=False).eager_peak_bytes
        common = max(row["min_budget_False"], row["min_budget_True"], int(0.6 * eager_peak))
        row.update(eager_peak=eager_peak, budget=common)
        plans = {}
        for compress in (False, True):
            plan = fxopt.plan(model, common, inputs, compress=compress, time_limit=time_limit)
            plans[compress] = plan
            row[f"flops_{compress}"] = plan.recompute_flops
            row[f"cost_{compress}"] = plan.recompute_cost
            row[f"peak_{compress}"] = plan.peak_bytes
            row[f"solver_{compress}"] = f"{plan.solver} ({plan.status})"
        row["compressed"] = plans[True].compressed
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), common, plan=plans[True])
    torch.manual_seed(1)
    loss_e = step(eager, inputs)
    torch.manual_seed(1)
    optimized.zero_grad(set_to_none=True)
    loss_o = step(optimized, inputs)
    same = torch.equal(loss_e, loss_o) and all(
        (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
        for a, b in zip(eager.parameters(), optimized.parameters()))
    same = same and all(torch.equal(a, b) for a, b in zip(eager.buffers(), optimized.buffers()))
    optimized.zero_grad(set_to_none=True)
    row["measured_peak"] = fxopt.measure_peak(step, optimized, inputs, resident=[optimized, inputs]).peak_bytes
    row["bit_identical"] = same
    print(json.dumps(row), flush=True)
    return row


def write(rows: list[dict], out: Path, meta: dict) -> None:
    lines = [
        "# Lossless compression (default) against recompute alone",
        "",
        meta_line(meta) + ".",
        "",
        "Smallest budget: the lowest peak fxopt reaches (`InfeasibleBudgetError.min_budget`). At the common "
        "budget both plans run the same model; measured: one real step of the compress plan.",
        "",
        "| model | eager MiB | smallest, recompute only | smallest, compress | common budget MiB | +GFLOP recompute only | +GFLOP compress | measured MiB (compress) | bit-identical | compressed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        codecs: dict[str, int] = {}
        for codec in r["compressed"].values():
            codecs[codec] = codecs.get(codec, 0) + 1
        lines.append(
            f"| {r['model']} | {r['eager_peak'] / MiB:.2f} | {r['min_budget_False'] / MiB:.2f} | "
            f"{r['min_budget_True'] / MiB:.2f} | {r['budget'] / MiB:.2f} | {r['flops_False'] / 1e9:.3f} | "
            f"{r['flops_True'] / 1e9:.3f} | {r['measured_peak'] / MiB:.2f} | {'yes' if r['bit_identical'] else 'NO'} | "
            + (", ".join(f"{n}× {c}" for c, n in sorted(codecs.items())) or "none") + " |")
    write_results(out / "compression", {"meta": meta, "rows": rows}, "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    meta = run_meta(shlex.join(["python -m benchmarks.compression", *sys.argv[1:]]), time_limit=args.time_limit)
    rows = [run_model(name, args.time_limit) for name in args.models]
    write(rows, args.out, meta)


if __name__ == "__main__":
    main()
