"""Pipeline stage cuts: fxopt's cuts and per-stage plans against equal-layer and
parameter-balanced cuts (DeepSpeed's default), at the same per-device budget.

    python -m benchmarks.pipeline [--part runs,scale] [--vocab 256] [--quick] [--out benchmarks/results]
                                  [--name pipeline]

**runs** (CPU processes, gloo, one per stage): an 8-layer GPT-2-style model (width 64, 4 heads,
64 tokens, vocabulary 256 by default, ``--vocab``) in 4 stages, 8 microbatches, torch's
`Schedule1F1B`. The budget is the
largest per-rank peak equal-layer cuts need at 4 sequences per microbatch, run eagerly (as people
run torch's pipelining today), measured. For each method, the largest microbatch (sequences)
that fits: eager methods by running at growing sizes until a rank's measured peak is over the
budget; fxopt's by planning at growing sizes until `fxopt.pipeline` says no split fits, then
running the largest, measured, and the one at 1.5x equal layers' largest (the goal's point). Each run: one step to compile, then one measured step per rank
(`fxopt.measure_peak`, the stage module, its receive buffers and the batch resident), with the
CPU time each rank spends in its stage's forwards and backwards (``time.thread_time``; torch uses
one thread per process), the slowest/mean stage time, and the bubble of the schedule replayed
with those measured stage times (`fxopt.solvers.stages.pipeline_timing`; 2 shared cores make the
wall time of 4 processes meaningless, so it is reported but not compared).

**scale** (simulated, no processes): a 48-layer GPT-2-style step captured once (its capture
time is reported), cut into 8, 16, 32 and 64 stages by the DP at a budget of 75% of what
equal-layer cuts need eagerly (the model's eager memory), beside equal-layer and
parameter-balanced cuts at the same budget, each stage at the remat level the model needs to fit
(`fxopt.solvers.stages.split_at`): per-stage peaks, slowest/mean time and bubble as the cut
solver's model predicts them, the DP's planning time, and for 8 and 16 stages every stage of the
DP's split planned exactly by `solve_stage` on its part of the graph (its peak and the time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import commit_of, load_average, log, mib, run_meta, write_results
from fxopt.models import gpt2_lm, lm_loss
from fxopt.solvers import stages as st

MiB = 2**20
RUN = dict(layers=8, dim=64, heads=4, seq=64, vocab=256)
STAGES, MICROBATCHES = 4, 8
EQUAL = [("h.2", "BEGINNING"), ("h.4", "BEGINNING"), ("h.6", "BEGINNING")]
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
BASE_SIZE = 4
SCALE = dict(layers=48, dim=64, heads=4, seq=64, vocab=256)
SCALE_STAGES = (8, 16, 32, 64)
SCALE_BUDGET = 0.75
EXACT_UP_TO = 16


def workload(sequences: int, spec: dict | None = None, microbatches: int = MICROBATCHES):
    spec = spec or RUN
    torch.manual_seed(0)
    model, (idx,) = gpt2_lm(spec["layers"], spec["dim"], spec["heads"], spec["seq"], sequences * microbatches,
                            spec["vocab"])
    return model, (idx,), torch.roll(idx, -1, 1)


def parameter_balanced(model) -> list[tuple[str, str]]:
    """DeepSpeed's ``partition_method="parameters"``: contiguous layers (embeddings, each block,
    the head) with their parameter counts balanced, as split points."""
    units = [["wte", "wpe"]] + [[f"h.{k}"] for k in range(len(model.h))] + [["ln_f", "lm_head"]]
    counts = [sum(p.numel() for n in unit for p in model.get_submodule(n).parameters()) for unit in units]
    cuts = st.balanced_cuts(counts, STAGES)
    return [(units[c + 1][0], "BEGINNING") for c in cuts]


# ---------------------------------------------------------------- one rank

def _rank(rank: int, world: int, config_path: str, out: str, init: str) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    from fxopt.distributed.pipeline import build_schedule, resident, split_model

    config = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{init}")
    try:
        model, inputs, target = workload(config["sequences"], config["spec"])
        if config["plan"]:
            schedule = build_schedule(fxopt.PipelinePlan.from_json(config["plan"]), model, lm_loss)
        else:
            mb = tuple(t.chunk(MICROBATCHES)[0] for t in inputs)
            stage = split_model(model, mb, [tuple(p) for p in config["split_points"]], True)[rank]
            runner = pipelining.PipelineStage(stage, rank, world, torch.device("cpu"))
            schedule = pipelining.Schedule1F1B(runner, MICROBATCHES, loss_fn=lm_loss)
        result = _measure(schedule, model, inputs, target, rank, world)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _measure(schedule, model, inputs, target, rank: int, world: int) -> dict:
    from fxopt.distributed.pipeline import resident

    first, last = rank == 0, rank == world - 1
    stage = schedule._stage
    spent = {"forward": 0.0, "backward": 0.0}
    for kind in spent:
        original = getattr(stage, f"{kind}_one_chunk")

        def timed(*args, _original=original, _kind=kind, **kwargs):
            t0 = time.thread_time()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_kind] += time.thread_time() - t0
        setattr(stage, f"{kind}_one_chunk", timed)

    def step():
        schedule.step(*(inputs if first else ()), **({"target": target, "losses": []} if last else {}),
                      return_outputs=False)

    step()  # compiles
    model.zero_grad(set_to_none=True)
    spent.update(forward=0.0, backward=0.0)
    t0 = time.perf_counter()
    peak = fxopt.measure_peak(step, resident=[resident(schedule), inputs if first else (), target if last else ()])
    return {"rank": rank, "peak": peak.peak_bytes, "wall": time.perf_counter() - t0,
            "forward": spent["forward"] / MICROBATCHES, "backward": spent["backward"] / MICROBATCHES}


def run_ranks(sequences: int, *, plan: fxopt.PipelinePlan | None = None, split_points=None) -> list[dict]:
    """One measured step on `STAGES` processes (fxopt's plan, or eager stages at split points)."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.export", "torch.distributed.pipelining", "torch._dynamo", "fxopt",
         "fxopt.distributed.pipeline", "benchmarks.pipeline"])
    with tempfile.TemporaryDirectory() as tmp:
        config = {"sequences": sequences, "plan": None, "split_points": split_points}
        if plan is not None:
            config["plan"] = str(Path(tmp, "plan.json"))
            plan.to_json(config["plan"])
        config["spec"] = RUN
        Path(tmp, "config.json").write_text(json.dumps(config))
        mp.start_processes(_rank, args=(STAGES, str(Path(tmp, "config.json")), tmp, str(Path(tmp, "init"))),
                           nprocs=STAGES, join=True, start_method="forkserver")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(STAGES)]


# ---------------------------------------------------------------- part (a): runs

def _row(method: str, sequences: int, ranks: list[dict], budget: int, plan=None, split_points=None) -> dict:
    times = [r["forward"] + r["backward"] for r in ranks]
    timing = st.pipeline_timing([r["forward"] for r in ranks], [r["backward"] for r in ranks], MICROBATCHES)
    row = {"method": method, "sequences": sequences, "peaks": [r["peak"] for r in ranks],
           "max_peak": max(r["peak"] for r in ranks), "fits": max(r["peak"] for r in ranks) <= budget,
           "stage_seconds": times, "slowest_seconds": max(times), "balance": max(times) / statistics.mean(times),
           "bubble_measured_times": timing.bubble, "wall_seconds": max(r["wall"] for r in ranks),
           "split": [f"{m} {k}" for m, k in (split_points or [])]}
    if plan is not None:
        row.update(split=[c.label for c in plan.cuts], predicted_peaks=[s.peak_bytes for s in plan.stages],
                   predicted_bubble=plan.bubble, predicted_balance=plan.balance, plan_seconds=plan.solve_seconds)
    return row


def largest_eager(method: str, split_points, budget: int, start: int) -> list[dict]:
    """Eager stages at growing sizes from ``start`` until a rank is over the budget (measured)."""
    rows = []
    for sequences in [s for s in SIZES if s >= start]:
        ranks = run_ranks(sequences, split_points=split_points)
        rows.append(_row(method, sequences, ranks, budget, split_points=split_points))
        log(f"{method} at {sequences}: max peak {mib(rows[-1]['max_peak'])} MiB (budget {mib(budget)})")
        if not rows[-1]["fits"]:
            break
    return rows


def largest_fxopt(method: str, split_points, budget: int, start: int, time_limit: float,
                  also: int | None = None) -> list[dict]:
    """fxopt's plans at growing sizes until none fits, then the largest one run and measured
    (and the one at ``also`` sequences, if it fits)."""
    best, plans = None, {}
    for sequences in [s for s in SIZES if s >= start]:
        model, inputs, target = workload(sequences)
        try:
            plan = fxopt.pipeline(model, inputs, target=target, loss_fn=lm_loss, stages=STAGES,
                                  microbatches=MICROBATCHES, budget=budget, time_limit=time_limit,
                                  split_points=split_points)
        except fxopt.InfeasibleBudgetError as err:
            log(f"{method} at {sequences}: no split fits (needs {mib(err.min_budget)} MiB)")
            break
        log(f"{method} at {sequences}: planned, largest stage {mib(plan.peak_bytes)} MiB")
        best, plans[sequences] = (sequences, plan), plan
    rows = []
    for sequences in sorted({also, best[0] if best else None} & set(plans)):
        ranks = run_ranks(sequences, plan=plans[sequences])
        rows.append(_row(method, sequences, ranks, budget, plan=plans[sequences], split_points=split_points))
    return rows


def part_runs(quick: bool, time_limit: float) -> dict:
    model, _, _ = workload(BASE_SIZE)
    balanced = parameter_balanced(model)
    base = run_ranks(BASE_SIZE, split_points=EQUAL)
    budget = max(r["peak"] for r in base)
    log(f"budget: equal layers, eager, at {BASE_SIZE} sequences per microbatch: {mib(budget)} MiB")
    rows = [_row("equal layers, eager", BASE_SIZE, base, budget, split_points=EQUAL)]
    rows += largest_eager("equal layers, eager", EQUAL, budget, BASE_SIZE + 1)
    rows += largest_eager("parameter-balanced, eager", balanced, budget, BASE_SIZE - 1 if not quick else BASE_SIZE)
    methods = [("fxopt cuts and plans", None)] if quick else [
        ("equal layers, fxopt plans", EQUAL), ("parameter-balanced, fxopt plans", balanced),
        ("fxopt cuts and plans", None)]
    eager_best = max(r["sequences"] for r in rows if r["method"] == "equal layers, eager" and r["fits"])
    for name, points in methods:
        rows += largest_fxopt(name, points, budget, BASE_SIZE, time_limit, also=int(1.5 * eager_best))
    return {"budget": budget, "rows": rows, "workload": RUN, "stages": STAGES, "microbatches": MICROBATCHES}


# ---------------------------------------------------------------- part (b): scale

def scale_graph():
    """The 48-layer step's solver graph, its split points at module boundaries, and the capture time."""
    from fxopt.plan_ahead import plan_and_rewrite
    from fxopt.distributed.pipeline import SplitPoints, _UNBOUNDED, _WithLoss

    model, inputs, target = workload(1, SCALE, 1)
    t0 = time.perf_counter()
    ready = plan_and_rewrite(_WithLoss(model, lm_loss), _UNBOUNDED, (*inputs, target), solver="save_all")
    seconds = time.perf_counter() - t0
    fx_nodes = {n.name: n for n in ready.joint.module.graph.nodes}
    origins = [fx_nodes[n].meta.get("seq_nr") if n in fx_nodes else None for n in ready.joint.names]
    return ready.plan, SplitPoints(model, ready.plan.graph, ready.plan.module_paths), origins, seconds


def _describe(model: st.CutModel, split: st.Split) -> dict:
    times = [e.seconds for e in split.estimates]
    timing = st.pipeline_timing([e.forward_seconds for e in split.estimates],
                                [e.backward_seconds + e.recompute_seconds for e in split.estimates],
                                model.microbatches, model.schedule)
    return {"peaks": [e.device_bytes for e in split.estimates], "max_peak": max(e.device_bytes for e in split.estimates),
            "levels": [e.level for e in split.estimates], "slowest_seconds": max(times),
            "balance": max(times) / statistics.mean(times), "bubble": timing.bubble, "step_seconds": timing.step_seconds}


def part_scale(quick: bool, time_limit: float) -> dict:
    whole, points, origins, capture_seconds = scale_graph()
    log(f"48 layers: captured {len(whole.graph)} nodes in {capture_seconds:.1f} s")
    out = {"capture_seconds": capture_seconds, "nodes": len(whole.graph), "rows": []}
    for stages in SCALE_STAGES[:2] if quick else SCALE_STAGES:
        m = 2 * stages
        t0 = time.perf_counter()
        model = st.cut_model(whole.graph, stages, m, allowed=points.allowed, time_limit=1.0, origins=origins)
        equal_cuts = st.balanced_cuts(_layer_weights(model, points), stages)
        param_cuts = st.balanced_cuts([a.param_bytes for a in model.atoms], stages)
        eager_equal = st.split_at(model, equal_cuts, 2**62)  # every stage at level 0: eager
        budget = int(SCALE_BUDGET * max(e.device_bytes for e in eager_equal.estimates))
        split = st.best_split(model, budget) or st.min_peak_split(model)
        seconds = time.perf_counter() - t0
        row = {"stages": stages, "microbatches": m, "points": len(model.points), "budget": budget,
               "plan_seconds": seconds, "fxopt": _describe(model, split),
               "equal_layers": _describe(model, st.split_at(model, equal_cuts, budget)),
               "parameter_balanced": _describe(model, st.split_at(model, param_cuts, budget)),
               "equal_layers_eager": _describe(model, eager_equal)}
        if stages <= EXACT_UP_TO:
            t1 = time.perf_counter()
            results = [st.plan_split_graph(whole.graph, model, budget, split, s, time_limit=time_limit)
                       for s in range(stages)]
            row["exact"] = {"seconds": time.perf_counter() - t1, "peaks": [r.device_bytes for r in results],
                            "max_peak": max(r.device_bytes for r in results),
                            "bubble": st.timing_of(results, m, "1F1B").bubble}
        log(f"{stages} stages: planned in {seconds:.2f} s; largest stage {mib(row['fxopt']['max_peak'])} MiB "
            f"of {mib(budget)}, bubble {100 * row['fxopt']['bubble']:.1f}%")
        out["rows"].append(row)
    return out


def _layer_weights(model: st.CutModel, points) -> list[float]:
    """Per atom, the share of a transformer block it holds: its forward nodes' share of the
    block's (equal-layer cuts balance these)."""
    per_block: dict[str, int] = {}
    for path in points.paths:
        if path and path.startswith("h."):
            block = ".".join(path.split(".")[:2])
            per_block[block] = per_block.get(block, 0) + 1
    bounds = [-1] + [p.position for p in model.points] + [len(points.paths) - 1]
    weights = []
    for a, b in zip(bounds, bounds[1:]):
        share = 0.0
        for path in points.paths[a + 1:b + 1]:
            if path and path.startswith("h."):
                share += 1 / per_block[".".join(path.split(".")[:2])]
        weights.append(share)
    return weights


# ---------------------------------------------------------------- the report

def write_report(data: dict, out: Path, name: str = "pipeline") -> None:
    lines = ["# Pipeline stage cuts", "", f"`{data['meta']['command']}` at commit `{commit_of(data['meta'])}`, "
             f"{data['meta']['date']}, load average {data['meta'].get('load', '?')} on {data['meta']['cpu_count']} cores.",
             ""]
    if "runs" in data:
        lines += _runs_table(data["runs"])
    if "scale" in data:
        lines += _scale_table(data["scale"])
    write_results(out / name, data, "\n".join(lines))


def _runs_table(runs: dict) -> list[str]:
    lines = [f"## Runs: 8-layer GPT-2-style (width {runs['workload']['dim']}, vocabulary "
             f"{runs['workload']['vocab']}), {runs['stages']} stages, {runs['microbatches']} microbatches, 1F1B, "
             "4 CPU processes (gloo)", "",
             f"Budget per device: {mib(runs['budget'])} MiB (equal layers, eager, at {BASE_SIZE} sequences per "
             "microbatch, measured).", "",
             "| method | sequences per microbatch | cuts | measured peaks per rank (MiB) | fits | slowest stage (ms) "
             "| slowest/mean | bubble (measured stage times) |", "|---|---:|---|---|---|---:|---:|---:|"]
    for r in runs["rows"]:
        lines.append(f"| {r['method']} | {r['sequences']} | {', '.join(r['split'])} | "
                     f"{' / '.join(mib(p) for p in r['peaks'])} | {'yes' if r['fits'] else '**no**'} | "
                     f"{r['slowest_seconds'] * 1e3:.2f} | {r['balance']:.2f} | {100 * r['bubble_measured_times']:.1f}% |")
    return lines + [""]


def _scale_table(scale: dict) -> list[str]:
    lines = [f"## Planning at scale: 48 layers ({scale['nodes']} nodes, captured in {scale['capture_seconds']:.1f} s), "
             "simulated", "",
             "| stages | microbatches | cut points | budget (MiB) | DP plan (s) | method | largest stage (MiB) "
             "| slowest stage (ms) | slowest/mean | bubble |", "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in scale["rows"]:
        for key, name in (("fxopt", "fxopt cuts"), ("equal_layers", "equal layers"),
                          ("parameter_balanced", "parameter-balanced"), ("equal_layers_eager", "equal layers, eager")):
            d = r[key]
            lines.append(f"| {r['stages']} | {r['microbatches']} | {r['points']} | {mib(r['budget'])} | "
                         f"{r['plan_seconds']:.2f} | {name} | {mib(d['max_peak'])} | {d['slowest_seconds'] * 1e3:.2f} "
                         f"| {d['balance']:.2f} | {100 * d['bubble']:.1f}% |")
        if "exact" in r:
            e = r["exact"]
            lines.append(f"| {r['stages']} | | | | {e['seconds']:.1f} | fxopt cuts, every stage planned by solve "
                         f"| {mib(e['max_peak'])} | | | {100 * e['bubble']:.1f}% |")
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    import os
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="runs,scale")
    parser.add_argument("--quick", action="store_true", help="fewer methods and stage counts")
    parser.add_argument("--time-limit", type=float, default=2.0, help="seconds per stage plan")
    parser.add_argument("--vocab", type=int, default=RUN["vocab"], help="the runs' vocabulary (default 256)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default="pipeline", help="results file name (default pipeline: .md, .json)")
    args = parser.parse_args(argv)
    RUN["vocab"] = args.vocab
    os.environ.setdefault("FXOPT_CACHE", "0")
    data = {"meta": run_meta("python -m benchmarks.pipeline " + " ".join(argv if argv is not None else sys.argv[1:]))}
    parts = args.part.split(",")
    if "scale" in parts:
        data["scale"] = part_scale(args.quick, args.time_limit)
    if "runs" in parts:
        data["runs"] = part_runs(args.quick, args.time_limit)
    data["meta"]["load_after"] = load_average()
    write_report(data, Path(args.out), args.name)


if __name__ == "__main__":
    main()
