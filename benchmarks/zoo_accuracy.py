"""Predicted vs measured peak of every zoo model at 100%, 60% and 40% of its eager peak (or at the
smallest budget fxopt reaches, when that is higher), with gradient parity against eager.

    python -m benchmarks.zoo_accuracy [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import platform
import time
import warnings

import torch

import fxopt
from benchmarks.harness import meta_line, run_meta, write_results
from fxopt.models import ZOO, loss_of


def step(model, inputs):
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss


def run(name: str, fraction: float) -> dict:
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    eager = copy.deepcopy(model)
    budget: float | int = fraction
    note = ""
    t0 = time.perf_counter()
    try:
        optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, time_limit=20)
    except fxopt.InfeasibleBudgetError as err:
        budget, note = err.min_budget, f"{fraction:.0%} infeasible; at the minimum fxopt reaches"
        optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, time_limit=20)
    planning = time.perf_counter() - t0
    plan = optimized.plan
    torch.manual_seed(1)
    loss_e = step(eager, inputs)
    torch.manual_seed(1)
    loss_o = step(optimized, inputs)
    same = torch.allclose(loss_e, loss_o) and all(
        torch.allclose(a.grad, b.grad, rtol=1.3e-6, atol=1e-5)
        for a, b in zip(eager.parameters(), optimized.parameters()) if a.grad is not None
    )
    peaks = {}
    for label, m in (("eager", eager), ("fxopt", optimized)):
        m.zero_grad(set_to_none=True)
        peaks[label] = fxopt.measure_peak(step, m, inputs, resident=[m, inputs]).peak_bytes
    tangents = sum(n.bytes for n in plan.graph.nodes if n.tangent)
    return {
        "model": name, "fraction": fraction, "budget_bytes": plan.budget_bytes, "note": note,
        "eager_measured": peaks["eager"], "eager_predicted": plan.eager_peak_bytes,
        "measured": peaks["fxopt"], "predicted": plan.peak_bytes, "tangent_bytes": tangents,
        "within_budget": peaks["fxopt"] <= plan.budget_bytes, "grads_equal": bool(same),
        "recompute_flops": plan.recompute_flops, "solver": plan.solver, "status": plan.status,
        "planning_seconds": planning, "nodes": len(plan.graph),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    meta = run_meta("python -m benchmarks.zoo_accuracy", machine=platform.machine())
    rows = [run(name, f) for name in sorted(ZOO) for f in (1.0, 0.6, 0.4)]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = [
        "# Predicted vs measured peak, zoo models",
        "",
        f"{meta_line(meta)} · {meta['machine']} · CPU",
        "",
        "Peaks in MiB, everything live during one forward+backward (parameters, inputs, gradients "
        "included). 'error' is (predicted − measured) / measured; 'error w/o tangents' leaves out the "
        "incoming gradients, which fxopt counts at full size while `output.sum()` hands the backward "
        "a stride-0 view of a scalar.",
        "",
        "| model | budget | eager measured | predicted | measured | ≤ budget | error | error w/o tangents | grads equal | extra GFLOP | solver | nodes | planning s |",
        "|---|---|---:|---:|---:|:---:|---:|---:|:---:|---:|---|---:|---:|",
    ]
    for r in rows:
        err = (r["predicted"] - r["measured"]) / r["measured"]
        err_t = (r["predicted"] - r["tangent_bytes"] - r["measured"]) / r["measured"]
        budget = f"{r['fraction']:.0%}" if not r["note"] else f"min {mib(r['budget_bytes'])} ({r['note'].split(';')[0]})"
        lines.append(
            f"| {r['model']} | {budget} | {mib(r['eager_measured'])} | {mib(r['predicted'])} | {mib(r['measured'])} | "
            f"{'yes' if r['within_budget'] else '**NO**'} | {err:+.1%} | {err_t:+.1%} | {'yes' if r['grads_equal'] else '**NO**'} | "
            f"{r['recompute_flops'] / 1e9:.3f} | {r['solver']} ({r['status']}) | {r['nodes']} | {r['planning_seconds']:.1f} |"
        )
    write_results(pathlib.Path(args.out) / "zoo_accuracy", {"meta": meta, "rows": rows}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
