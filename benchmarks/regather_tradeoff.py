"""How a sharded step's plan trades recomputed FLOPs for re-gathered bytes as communication is priced.

    python -m benchmarks.data_parallel --model llama --settings fsdp --forms fsdp2 --world 4 \\
        --no-nccl-priced --plans /tmp/plans ...                    # writes each fxopt row's plan
    python -m benchmarks.regather_tradeoff benchmarks/results/plans/llama_w4_fsdp2_checkpoint_e642e69.json.gz \\
        --rates 1e9,1.2e9,1.5e9,1e11 --efforts 1,4 --out benchmarks/results/regather_tradeoff_llama_w4

(that plan file: rank 0's plan of the FSDP2 Llama at checkpointing's peak on 4 gloo ranks, written
by the first command at commit e642e69, gzipped).

A plan of a step with collectives inside (`fxopt.distributed.fsdp2`) decides per gathered
parameter whether to keep it for the backward (SAVE) or gather it again there (RECOMPUTE, a
re-gather), beside every activation's decision, at the least estimated seconds (`Timeline.cost`):
FLOPs, memory traffic and per-op overhead of what is recomputed, plus the bytes re-gathered at the
process group's rate (`fxopt.analysis.costs.CostModel.comm_bytes_per_second`: gloo 1 GB/s, NCCL
100 GB/s). FLOPs alone (the data-parallel benchmark's ratio to checkpointing) do not decide it.

This reads the plan's own solver graph (the plan file holds it) and solves it again in one
process, at the plan's budget, with each node's communication priced at each of ``--rates`` in
turn (its cost less its bytes at ``--priced-at``, the rate the plan was made with, plus its bytes
at the new rate; nothing else changes), with each of ``--efforts``. Per solve: the recomputed
FLOPs, the bytes re-gathered, the simulated peak, the solver and its status, the cost the solve
minimised and its proven lower bound, and the plan's cost at the graph's own rate, so that plans
found under other prices compare with the one the step got in its own objective. The first row
is the plan as the file holds it. A plan of the same FLOPs and re-gathers at a lower cost is one
the solvers' effort did not reach; a plan of fewer FLOPs at about the same cost is a tie that the
rate decides. Also the floor: the least peak any schedule of the graph may have
(`fxopt.solvers.instant.peak_lower_bound`).
"""

from __future__ import annotations

import argparse
import gzip
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import log, report_head, run_meta, write_results
from fxopt.analysis.costs import COMM_BYTES_PER_SECOND
from fxopt.solvers import solve
from fxopt.solvers.graph import Graph
from fxopt.solvers.instant import peak_lower_bound
from fxopt.solvers.minimum import Memo
from fxopt.solvers.plan import Plan
from fxopt.solvers.prefetch import priced
from fxopt.solvers.schedule import Schedule, simulate


def repriced(graph: Graph, priced_at: float, rate: float) -> Graph:
    """``graph`` with every node's communication (``comm_bytes``) at ``rate`` bytes per second
    instead of ``priced_at``; its other costs as they are."""
    if rate == priced_at:
        return graph

    def at_rate(n):
        if n.comm_seconds:  # (a re-gather priced by its exposed time: its communication at the rate, priced again)
            return n.replaced(cost=n.cost - n.comm_exposed + n.comm_bytes / rate, comm_seconds=n.comm_bytes / rate,
                              comm_exposed=n.comm_bytes / rate)
        return n.replaced(cost=n.cost - n.comm_bytes / priced_at + n.comm_bytes / rate)

    return priced(Graph(tuple(at_rate(n) if n.comm_bytes else n for n in graph.nodes), graph.transfers))


def row_of(graph: Graph, schedule: Schedule, **fields: Any) -> dict[str, Any]:
    """One row: what ``schedule`` recomputes and re-gathers, its peak and its cost on ``graph``."""
    own = simulate(graph, schedule)
    return {**fields, "extra_flops": own.recompute_flops, "regathered_bytes": own.recompute_comm_bytes,
            "peak_bytes": own.peak_bytes, "cost_s": own.cost}


def tradeoff(graph: Graph, budget: int, rates: list[float], efforts: list[float], priced_at: float,
             solver: str = "auto") -> list[dict[str, Any]]:
    """A row per (rate, effort): ``graph`` repriced (`repriced`) and solved within ``budget``."""
    rows = []
    for rate in rates:
        priced = repriced(graph, priced_at, rate)
        for effort in efforts:
            t0 = time.process_time()
            s = solve(priced, budget, solver, effort=effort, time_limit=3600, memo=Memo())
            rows.append(row_of(graph, s.schedule, rate=rate, effort=effort, solver=s.solver, status=s.status,
                               solved_cost_s=s.timeline.cost, lower_bound_s=s.lower_bound_cost, gap=s.gap,
                               stopped=list(s.stopped), cpu_s=round(time.process_time() - t0, 1)))
            log(f"rate {rate:g}, effort {effort:g}: {rows[-1]}")
    return rows


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.3f}"


def report(data: dict[str, Any]) -> str:
    meta = data["meta"]
    out = report_head(
        "Recomputed FLOPs against re-gathered bytes, as communication is priced", meta,
        f"plan file `{meta['plan']}` · solver graph of {meta['nodes']} nodes · budget {meta['budget_bytes']:,} B · "
        f"priced at {meta['priced_at']:g} B/s in the file · floor {meta['floor_bytes']:,} B ({meta['floor_at']})",
    ) + [
        "Each row: the plan's solver graph solved again at the plan's budget, its communication priced at `rate` "
        "bytes/s (`benchmarks.regather_tradeoff`), with counted `effort` (a multiple of the default). Extra GFLOP: "
        "recomputed FLOPs; re-gathered: bytes received again; cost: the plan's estimated seconds at the file's "
        "rate (what the step's own plan minimised); solved cost and bound: at the row's rate (the cost that solve "
        "minimised and its proven lower bound); gap: (solved cost - bound) / solved cost.",
        "",
        "| rate B/s | effort | solver | extra GFLOP | re-gathered MB | peak B | cost ms (file's rate) | "
        "solved cost ms | bound ms | gap |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        gap = "–" if r.get("gap") is None else f"{r['gap']:.1%}"
        rate = "plan file" if r.get("rate") is None else f"{r['rate']:g}"
        effort = "–" if r.get("effort") is None else f"{r['effort']:g}"
        out.append(f"| {rate} | {effort} | {r['solver']} {r['status']} | +{r['extra_flops'] / 1e9:.3f} | "
                   f"{r['regathered_bytes'] / 1e6:.2f} | {r['peak_bytes']:,} | {_ms(r['cost_s'])} | "
                   f"{_ms(r.get('solved_cost_s'))} | {_ms(r.get('lower_bound_s'))} | {gap} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.regather_tradeoff", description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="a plan file (JSON, or gzipped JSON: .gz) of a step with collectives inside: "
                                     "benchmarks.data_parallel --plans")
    parser.add_argument("--rates", default=f"{COMM_BYTES_PER_SECOND['gloo']:g},{COMM_BYTES_PER_SECOND['nccl']:g}",
                        help="comma-separated communication rates, bytes per second, to solve the graph at")
    parser.add_argument("--efforts", default="1", help="comma-separated counted efforts (multiples of the default)")
    parser.add_argument("--priced-at", type=float, default=COMM_BYTES_PER_SECOND["gloo"],
                        help="the rate the plan's graph was priced at (default gloo's; an NCCL-priced row's: 1e11)")
    parser.add_argument("--solver", default="auto")
    parser.add_argument("--out", default="benchmarks/results/regather_tradeoff")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    path = Path(args.plan)
    plan = Plan.from_json(gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path)
    graph = plan.graph
    floor, where = peak_lower_bound(graph)
    meta = run_meta(" ".join(["python -m benchmarks.regather_tradeoff", *(shlex.quote(a) for a in argv)]),
                    plan=args.plan, nodes=len(graph), budget_bytes=plan.budget_bytes, priced_at=args.priced_at,
                    floor_bytes=floor, floor_at=where)
    rows = [row_of(graph, plan.schedule, rate=None, effort=None, solver=plan.solver, status=plan.status,
                   solved_cost_s=plan.cost, lower_bound_s=plan.lower_bound_cost, gap=plan.gap)]
    rows += tradeoff(graph, plan.budget_bytes, [float(x) for x in args.rates.split(",")],
                     [float(x) for x in args.efforts.split(",")], args.priced_at, args.solver)
    data = {"meta": meta, "rows": rows}
    md = write_results(args.out, data, report(data))
    log(report(data))
    log(f"wrote {md}")


if __name__ == "__main__":
    main()
