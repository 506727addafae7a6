"""Solve time and optimality gap of each fxopt solver against the size of the training graph.

    python -m benchmarks.solvers [--quick] [--time-limit 30] [--out benchmarks/results] [--replot]

Graphs are captured from real models (no run: `fxopt.plan` stops after capture), from ~100 to
~2,000 nodes: residual MLP chains, a ResNet-like CNN and GPT-2-style transformers. Each graph is
solved at 50% of its eager peak (or, when that is below the smallest peak any heuristic reaches,
at that smallest peak) by every solver side by side: the heuristics (checkpoint, greedy, segments), the
instant program (`fxopt.solvers.instant.instant_solve`: a plan and a lower bound valid for every
schedule the simulator accepts), the ILP alone with HiGHS and with CBC
(`fxopt.solvers.ilp.solve_ilp`, no warm start), and "auto" (heuristics, the instant program, then,
unless its plan is proven within 0.5%, LP relaxation + rounding and the ILP warm-started). For
each: seconds, recompute cost of the plan (estimated seconds), the simulated peak, and the gap to
the best lower bound known for that graph: the instant program's, or the ILP's (LP relaxation or
branch-and-bound) if higher, which holds only within the ILP's model (recomputation window,
conservative memory); the table says which.

Writes ``<out>/solvers.md``, ``solvers.json`` and ``solvers.png`` (solve time and gap vs graph
size), rewritten after every graph.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import warnings
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import commit_of, meta_line, run_meta, write_results
from fxopt import models
from fxopt.solvers import SolverTimeoutWarning, solve
from fxopt.solvers.heuristics import HEURISTICS
from fxopt.solvers.ilp import build_ilp, lp_bound_and_roundings, solve_ilp
from fxopt.solvers.instant import instant_solve, peak_lower_bound
from fxopt.solvers.schedule import simulate

GRAPHS = {
    # name: (factory, quick?)
    "mlp-4": (lambda: models.residual_mlp(4, 256, 1024), True),
    "mlp-16": (lambda: models.residual_mlp(16, 256, 1024), True),
    "mlp-48": (lambda: models.residual_mlp(48, 128, 512), False),
    "cnn-bn": (lambda: models.ZOO["cnn_bn"](), True),
    "gpt2-2x256": (lambda: models.gpt2(2, 256, 4, 256, 4, vocab=2048), True),
    "gpt2-4x256": (lambda: models.gpt2(4, 256, 4, 256, 4, vocab=2048), False),
    "gpt2-12x768": (lambda: models.gpt2(12, 768, 12, 512, 8), False),
}
FRACTION = 0.5


def capture_graph(make):
    """The solver graph of one training step (planned with save_all: nothing is solved)."""
    torch.manual_seed(0)
    model, inputs = make()
    return fxopt.plan(model, 1.0, inputs, solver="save_all").graph


def run_graph(name: str, graph, time_limit: float) -> dict:
    eager = simulate(graph, fxopt.solvers.eager_schedule(graph)).peak_bytes
    budget = int(FRACTION * eager)
    lowest = min(t.peak_bytes for h in ("checkpoint", "greedy", "segments") for _, t in HEURISTICS[h](graph, 0))
    ilp = build_ilp(graph, budget)
    row = {"graph": name, "nodes": len(graph), "eager_peak": eager, "ilp_integer_vars": ilp.mip.num_integer,
           "ilp_rows": ilp.mip.num_rows, "ilp_window": ilp.window, "results": {}}
    t0 = time.perf_counter()
    lp, _ = lp_bound_and_roundings(graph, budget, time_limit=time_limit, model=ilp)
    row["lp_seconds"] = time.perf_counter() - t0
    if lp is None and lowest > budget:
        budget = lowest  # 50% is out of reach: solve at the smallest peak the heuristics reach
        ilp = build_ilp(graph, budget)
        lp, _ = lp_bound_and_roundings(graph, budget, time_limit=time_limit, model=ilp)
    row["budget"] = budget
    row["lp_bound"] = lp
    row["peak_lower_bound"] = peak_lower_bound(graph)[0]
    bounds = [(lp, "ilp")] if lp is not None else []

    def record(solver: str, seconds: float, schedule, status: str, bound=None, source="ilp") -> None:
        entry = {"seconds": seconds, "status": status}
        if schedule is not None:
            tl = simulate(graph, schedule)
            entry.update(cost=tl.recompute_cost, peak=tl.peak_bytes, fits=tl.peak_bytes <= budget)
        if bound is not None:
            entry["bound"] = bound
            bounds.append((bound, source))
        row["results"][solver] = entry

    for h in ("checkpoint", "greedy", "segments"):
        t0 = time.perf_counter()
        fitting = [(tl.recompute_cost, s) for s, tl in HEURISTICS[h](graph, budget) if tl.peak_bytes <= budget]
        best = min(fitting, key=lambda f: f[0])[1] if fitting else None
        record(h, time.perf_counter() - t0, best, "heuristic" if best else "no plan")
    inst = instant_solve(graph, budget, time_limit=time_limit)
    fitting = [(tl.recompute_cost, s) for s, tl in inst.plans if tl.peak_bytes <= budget]
    best = min(fitting, key=lambda f: f[0])[1] if fitting else None
    record("instant", inst.seconds, best, "heuristic" if best else "no plan", inst.bound, "instant")
    row["instant_bound"] = inst.bound
    for mip_solver in ("highs", "cbc"):
        res = solve_ilp(graph, budget, time_limit=time_limit, mip_solver=mip_solver, model=build_ilp(graph, budget))
        record(f"ilp-{mip_solver}", res.seconds, res.schedule, res.status, res.lower_bound)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        try:
            sol = solve(graph, budget, "auto", time_limit=time_limit)
            record("auto", time.perf_counter() - t0, sol.schedule, f"{sol.solver} ({sol.status})", sol.lower_bound_cost,
                   sol.bound_source)
        except fxopt.InfeasibleBudgetError:
            record("auto", time.perf_counter() - t0, None, "no plan")
    best_bound, source = max(bounds, key=lambda b: (b[0], b[1] == "instant")) if bounds else (None, None)
    row["best_bound"] = best_bound
    row["best_bound_source"] = source
    for entry in row["results"].values():
        if "cost" in entry and entry["fits"] and best_bound is not None:
            entry["gap"] = 0.0 if entry["cost"] <= 1e-15 else max(0.0, (entry["cost"] - best_bound) / entry["cost"])
    return row


SOLVER_ORDER = ("checkpoint", "greedy", "segments", "instant", "ilp-highs", "ilp-cbc", "auto")


def write(rows: list[dict], out: Path, meta: dict) -> None:
    time_limit = meta["time_limit"]
    lines = [
        "# Solver time and optimality gap vs graph size",
        "",
        f"{meta_line(meta)} · {meta['torch_threads']} CPU threads, "
        f"ILP time limit {time_limit:.0f} s. Budget: 50% of the eager peak, or the lowest peak the heuristics "
        "reach when 50% is out of reach. Cost: estimated seconds of recomputation (fxopt's cost model). "
        "Gap: (cost − best lower bound) / cost. Bounds: the instant program's (valid for every schedule the "
        "simulator accepts) and the ILP's (LP relaxation or branch-and-bound: valid only within the ILP's model, "
        "which restricts recomputation to a window and counts memory conservatively); the best bound column "
        "names the one used. `—`: no plan within the budget.",
        "",
        "| graph | nodes | ILP int. vars | budget | LP bound | instant bound | best bound | "
        + " | ".join(SOLVER_ORDER) + " |",
        "|---|---:|---:|---:|---:|---:|---:|" + "---|" * len(SOLVER_ORDER),
    ]
    for row in rows:
        cells = []
        for solver in SOLVER_ORDER:
            e = row["results"].get(solver)
            if e is None or "cost" not in e or not e.get("fits"):
                cells.append(f"— ({e['seconds']:.1f} s)" if e else "")
                continue
            gap = "" if "gap" not in e else f", gap {100 * e['gap']:.1f}%"
            cells.append(f"{e['seconds']:.1f} s, cost {e['cost'] * 1e3:.1f} ms{gap}")
        ms = lambda v: "—" if v is None else f"{v * 1e3:.1f} ms"  # noqa: E731
        best = "—" if row["best_bound"] is None else f"{ms(row['best_bound'])} ({row['best_bound_source']})"
        lines.append(f"| {row['graph']} | {row['nodes']} | {row['ilp_integer_vars']} | "
                     f"{row['budget'] / 2**20:.0f} MiB ({100 * row['budget'] / row['eager_peak']:.0f}%) | "
                     f"{ms(row['lp_bound'])} | {ms(row.get('instant_bound'))} | {best} | "
                     + " | ".join(cells) + " |")
    write_results(out / "solvers", {"meta": meta, "rows": rows}, "\n".join(lines))
    plot(rows, out, meta)


def plot(rows: list[dict], out: Path, meta: dict) -> None:
    """``<out>/solvers.png``: solve time and gap against graph size, one line per solver."""
    commit, time_limit = commit_of(meta), meta["time_limit"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax_t, ax_g) = plt.subplots(1, 2, figsize=(11, 4))
    for solver in SOLVER_ORDER:
        pts = sorted(((r["nodes"], r["results"][solver]) for r in rows if solver in r["results"]),
                     key=lambda p: p[0])
        xs = [n for n, e in pts]
        ax_t.plot(xs, [e["seconds"] for _, e in pts], marker="o", label=solver)
        g = [(n, 100 * e["gap"]) for n, e in pts if "gap" in e]
        if g:
            ax_g.plot([n for n, _ in g], [v for _, v in g], marker="o", label=solver)
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_xlabel("nodes in the training graph")
    ax_t.set_ylabel("solve time (s)")
    ax_t.axhline(time_limit, color="grey", linestyle=":", label="ILP time limit")
    ax_g.set_xscale("log")
    ax_g.set_xlabel("nodes in the training graph")
    ax_g.set_ylabel("gap to the best lower bound (%)")
    for ax in (ax_t, ax_g):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"fxopt solvers at 50% of the eager peak ({meta['date']}, {commit})")
    fig.tight_layout()
    fig.savefig(out / "solvers.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small graphs only")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per ILP solve (default 30)")
    parser.add_argument("--graphs", nargs="*", help=f"a subset of: {', '.join(GRAPHS)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--replot", action="store_true", help="only redraw solvers.png from solvers.json")
    args = parser.parse_args(argv)
    if args.replot:
        saved = json.loads((args.out / "solvers.json").read_text())
        plot(saved["rows"], args.out, saved["meta"])
        return 0
    meta = run_meta("python -m benchmarks.solvers " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
                    time_limit=args.time_limit)
    names = args.graphs or [n for n, (_, quick) in GRAPHS.items() if quick or not args.quick]
    rows = []
    for name in names:
        print(f"{name}: capturing…", flush=True)
        graph = capture_graph(GRAPHS[name][0])
        print(f"{name}: {len(graph)} nodes; solving", flush=True)
        rows.append(run_graph(name, graph, args.time_limit))
        write(rows, args.out, meta)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "results"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
