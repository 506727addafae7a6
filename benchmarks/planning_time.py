"""How long every answer takes: plans at 100% and 50% of the eager peak, the answer "infeasible,
here is the smallest budget" for a 1-byte budget, and a plan at that smallest budget, for the
built-in zoo and the `transformers` models of `benchmarks.hf_zoo`.

    python -m benchmarks.planning_time [--models zoo,hf] [--only gpt2_tiny,bert] [--time-limit 10]
                                       [--device cpu] [--out benchmarks/results]
    python -m benchmarks.planning_time --depth 8,16,32 [--whole 8,16] [--measure 8] [--whole-capture 32]
    python -m benchmarks.planning_time --symbolic 32
    python -m benchmarks.planning_time --pipeline 16,32,48 [--stages 8] [--alone 48] [--budget 0.75]

``--depth``: issue 27's Llama (transformers ``LlamaConfig``: hidden 256, FFN 1024, 4 heads, 2
key-value heads, vocabulary 32000; one sequence of 512 tokens, real tensors) at each number of
layers: the answer at 50% of its eager peak (infeasible here: the smallest budget, found through
its repeated layers, `fxopt.solvers.block_plan`), the plan at that smallest budget (run and
measured at the depths in ``--measure``), and how planning time grows with depth (a line fitted
through the depths). At the depths in ``--whole``, the step's solver graph is also solved at 90%
and 80% of its eager peak and at the smallest budget by the blocks and by the whole-graph
solvers alone (the blocks switched off), in this process: costs, bounds and seconds side by side.
At the depths in ``--whole-capture``, both answers are also made with every block captured
(``stamp=False``; by default a run of identical blocks is captured as 3 and 4 blocks and stamped
out, `fxopt.capture.repeat`): CPU seconds, traced nodes, and whether the answer is the same.
Written to ``planning_time_depth.{md,json}`` (``planning_time_depth_stamp.{md,json}`` with ``--whole-capture``).

``--pipeline 16,32,48``: `fxopt.pipeline` planning (only) issue 27's GPT-2 (`fxopt.models.gpt2_lm`,
width 128, 4 heads, 64 tokens, vocabulary 256) at each number of layers, cut into ``--stages``
(8) stages, twice as many microbatches of one sequence, 1F1B, at ``--budget`` (75%) of its eager
peak: CPU and wall seconds, each phase's CPU seconds (exclusive: the whole step's stamped capture, torch's
split, the stage modules' eager forwards, the stage captures, the stages' analyses and solves),
the counted work (stage parts captured, planned from an earlier capture, plans reused), and a
digest of the plan (timings left out). At the depths in ``--alone`` the same plan is also made
with every stage captured (no reuse): the digests must be equal. Each row from a fresh scratch
and plan cache; the process's first capture and export are made beforehand on a 4-layer model,
untimed. Written to ``planning_time_pipeline.{md,json}`` (``planning_time_pipeline_at<budget>`` at
another budget).

``--symbolic 32``: `fxopt.max_batch`'s capture of that Llama (the batch symbolic, 1 to 64, at a
batch of 2), its run stamped and captured whole: CPU seconds, traced nodes, the same graphs;
written to ``planning_time_symbolic.{md,json}``.

Each row is one call of `fxopt.plan` in this process, with the plan cache off (a cold plan cache:
every answer is solved) and the scratch-memory cache in a fresh directory per model (so each
model's first row measures its ops, later rows read them, as a user's second call would). Wall
time is split into capture (Dynamo and AOTAutograd tracing, and the rewrite), analysis
(`fxopt.analysis.analyze`, scratch measurements included) and solve (`fxopt.solvers.solve`); the
split is taken by timing those functions as the planner calls them (its own search for the
smallest budget, without the ReLU masks, counted as solve). Plan cost is the
solver's estimated recompute seconds; bound and gap are the plan's (`Plan.lower_bound_cost`,
`Plan.gap`). The minimum row is also run: its measured peak must be within that minimum.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import fxopt
import fxopt.analysis.scratch as scratch
import fxopt.cache
import fxopt.capture.dynamic as dynamic
import fxopt.capture.dynamo as dynamo
import fxopt.plan_ahead as plan_ahead
import fxopt.planner as planner
import fxopt.solvers.blocks as blocks
from benchmarks.harness import log, meta_line, mib, run_meta, write_results
from fxopt.models import MODELS, ZOO, loss_of
from fxopt.solvers import DEFAULT_TIME_LIMIT, Memo, SolverTimeoutWarning, eager_timeline, solve

TARGET_SECONDS = {"small": 5.0, "gpt2-12": 15.0}  # issue 13: <= 1,000 nodes / the 12-layer GPT-2 at 50%


class Timers:
    """Seconds spent in the planner's `analyze` and `solve` during one `fxopt.plan` call; the
    nodes of every joint graph traced (Dynamo and AOTAutograd: what a capture's work grows with)
    and the seconds spent stamping a run of blocks out (`fxopt.capture.repeat.stamped_joint`)."""

    def __init__(self):
        self.analysis = self.solve = self.stamp = 0.0
        self.traced_nodes = self.traced_graphs = 0

    @contextlib.contextmanager
    def installed(self):
        # the names `fxopt.planner` calls them by (its fallbacks, and their searches for the
        # smallest budget, are solves too)
        real = {name: getattr(planner, name) for name in ("analyze_step", "solve")}
        for name, fn in real.items():
            setattr(planner, name, self._timed(fn, "analysis" if name == "analyze_step" else "solve"))
        stamped_joint, step_backend = plan_ahead.stamped_joint, dynamo.step_backend  # (dynamic's is dynamo's)
        plan_ahead.stamped_joint = self._timed(stamped_joint, "stamp")

        def counted_backend(partition, *args, **kwargs):
            def counted(joint, *a, **k):
                self.traced_nodes += len(joint.graph.nodes)
                self.traced_graphs += 1
                return partition(joint, *a, **k)

            return step_backend(counted, *args, **kwargs)

        dynamo.step_backend = dynamic.step_backend = counted_backend
        try:
            yield self
        finally:
            for name, fn in real.items():
                setattr(planner, name, fn)
            plan_ahead.stamped_joint, dynamo.step_backend, dynamic.step_backend = stamped_joint, step_backend, step_backend

    def _timed(self, fn, field: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)

        return timed


def models(which: list[str], only: set[str] | None):
    """(name, builder) pairs; each builder returns (model, inputs)."""
    out = []
    if "zoo" in which:
        out += [(name, build) for name, build in sorted(ZOO.items())]
    if "hf" in which:
        from benchmarks.hf_zoo import HF_NAMES

        out += [(f"hf-{name}", lambda m=MODELS[f"hf-{name}"]: m("bench")) for name in HF_NAMES]
    if "gpt2-12" in which:
        from benchmarks.gpt2_scale import gpt2

        out.append(("gpt2-12", lambda: gpt2(12)))
    return [(n, b) for n, b in out if only is None or n in only or n.removeprefix("hf-") in only]


def one_answer(model, inputs, budget, time_limit: float, device: str | None = None, **options) -> dict:
    timers = Timers()
    row: dict = {"budget_asked": budget}
    t0, cpu0 = time.perf_counter(), time.process_time()
    with timers.installed(), warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        try:
            plan = fxopt.plan(model, budget, inputs, time_limit=time_limit,
                              **({} if device is None else {"device": device}), **options)
        except fxopt.InfeasibleBudgetError as err:
            plan, row["infeasible_min_budget"], row["floor"] = None, err.min_budget, err.lower_bound
    row["wall_s"], row["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
    row["load1"] = os.getloadavg()[0]  # the machine is shared: how busy it was as the answer came
    row["analysis_s"], row["solve_s"] = timers.analysis, timers.solve
    row["stamp_s"], row["traced_nodes"], row["traced_graphs"] = timers.stamp, timers.traced_nodes, timers.traced_graphs
    row["capture_s"] = row["wall_s"] - timers.analysis - timers.solve
    if plan is not None:
        row.update(nodes=len(plan.graph), budget=plan.budget_bytes, eager_peak=plan.eager_peak_bytes,
                   peak=plan.peak_bytes, solver=plan.solver, status=plan.status, cost=plan.recompute_cost,
                   bound=plan.lower_bound_cost, gap=plan.gap)
    return row, plan


def measured_peak(model, inputs, plan) -> int:
    optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, plan=plan)

    def step():
        loss = loss_of(optimized(**inputs) if isinstance(inputs, dict) else optimized(*inputs))
        loss.backward()
        return loss.detach()

    step()  # compiles
    optimized.zero_grad(set_to_none=True)
    return fxopt.measure_peak(step, resident=[optimized, inputs]).peak_bytes


def run_model(name: str, build, time_limit: float, device: str | None = None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["FXOPT_CACHE_DIR"] = cache_dir
        torch.manual_seed(0)
        model, inputs = build()
        for label, budget in (("100%", 1.0), ("50%", 0.5), ("infeasible", 1)):
            for old in Path(cache_dir).glob("*.json"):
                old.unlink()  # a cold plan cache for every answer; scratch/ stays
            row, plan = one_answer(model, inputs, budget, time_limit, device)
            row.update(model=name, row=label)
            rows.append(row)
            log(json.dumps(row))
            if label == "infeasible" and "infeasible_min_budget" in row:
                for old in Path(cache_dir).glob("*.json"):
                    old.unlink()
                minimum, plan = one_answer(model, inputs, row["infeasible_min_budget"], time_limit, device)
                minimum.update(model=name, row="min")
                if plan is not None:
                    minimum["measured_peak"] = measured_peak(model, inputs, plan)
                rows.append(minimum)
                log(json.dumps(minimum))
    return rows


def write(rows: list[dict], out: Path, meta: dict, device: str | None = None) -> None:
    s = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [
        "# Planning time: every answer, split into capture, analysis and solve", "",
        f"{meta_line(meta)} · "
        f"{meta['cpu_count']} CPUs, {meta['torch_threads']} torch threads · load average (1 min) "
        f"{min(r['load1'] for r in rows):.1f}–{max(r['load1'] for r in rows):.1f} "
        "as the answers came (a shared machine: more than the 2 cores' worth slows every row)", "",
        "Plan cache off for every row; the scratch-memory cache starts empty per model (its first row "
        "measures every op). `infeasible`: a 1-byte budget, answered with the smallest budget fxopt "
        "finds, and the floor no schedule goes below; `min`: a plan at that budget, then run and "
        "measured. Targets (issue 13): ≤ 5 s for graphs up to 1,000 nodes, ≤ 15 s for the 12-layer "
        "GPT-2 at 50%." + ("" if device is None else f" Planned on fake tensors for device={device!r} (the "
        "measured row replays the plan on the real model)."), "",
        "| model | row | nodes | wall s | capture s | analysis s | solve s | budget MiB | peak MiB | measured MiB "
        "| solver (status) | cost s | bound s | gap |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        budget = r.get("budget", r.get("infeasible_min_budget"))
        note = mib(budget)
        if "infeasible_min_budget" in r:
            note = f"min {mib(budget)}" + ("" if r.get("floor") is None else f" (floor {mib(r['floor'])})")
        solver = f"{r['solver']} ({r['status']})" if "solver" in r else "infeasible"
        gap = "–" if r.get("gap") is None else f"{100 * r['gap']:.1f}%"
        cost = "–" if r.get("cost") is None else f"{r['cost']:.2e}"
        bound = "–" if r.get("bound") is None else f"{r['bound']:.2e}"
        lines.append(f"| {r['model']} | {r['row']} | {r.get('nodes', '–')} | {s(r['wall_s'])} | {s(r['capture_s'])} | "
                     f"{s(r['analysis_s'])} | {s(r['solve_s'])} | {note} | {mib(r.get('peak'))} | "
                     f"{mib(r.get('measured_peak'))} | {solver} | {cost} | {bound} | {gap} |")
    write_results(out / ("planning_time" if device is None else f"planning_time_fake_{device}"), {"meta": meta, "rows": rows}, "\n".join(lines))


# ---------------------------------------------------------------- planning time against depth

DEPTH_TARGET_SECONDS = 10.0  # issue 27: the 32-layer Llama, answer at 50% and plan at the smallest budget


def llama(layers: int):
    """Issue 27's Llama: hidden 256, FFN 1024, vocabulary 32000, one sequence of 512 tokens."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=256, intermediate_size=1024,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=32000,
                                      max_position_embeddings=512, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def whole_graph():
    """The solvers without the repeated blocks' plans (`fxopt.solvers.blocks.MIN_COPIES` out of
    reach): the whole graph's phases, as before them."""
    saved = blocks.MIN_COPIES
    blocks.MIN_COPIES = 1 << 30
    try:
        yield
    finally:
        blocks.MIN_COPIES = saved


def compare(graph, budget: int, time_limit: float) -> dict:
    """One solver graph at one budget, by "auto" with its blocks and without them."""
    out = {"budget": budget}
    for label, context in (("blocks", contextlib.nullcontext), ("whole", whole_graph)):
        t0 = time.perf_counter()
        with context(), warnings.catch_warnings():
            warnings.simplefilter("ignore", SolverTimeoutWarning)
            try:
                found = solve(graph, budget, time_limit=time_limit, memo=Memo())
            except fxopt.InfeasibleBudgetError as err:
                out[label] = {"seconds": time.perf_counter() - t0, "infeasible": err.min_budget}
                continue
        out[label] = {"seconds": time.perf_counter() - t0, "solver": found.solver, "status": found.status,
                      "cost": found.timeline.cost, "bound": found.lower_bound_cost, "peak": found.timeline.peak_bytes,
                      "stopped": list(found.stopped)}
    b, w = out["blocks"].get("cost"), out["whole"].get("cost")
    out["cost_ratio"] = None if b is None or not w else b / w
    return out


def same_answer(a: dict, b: dict, plans: tuple) -> bool:
    """Whether two answers are the same: the same smallest budget and floor, or the same plan
    (budget, peak, cost, and every value's decision)."""
    keys = ("infeasible_min_budget", "floor", "budget", "peak", "cost", "nodes")
    if any(a.get(k) != b.get(k) for k in keys):
        return False
    x, y = plans
    if x is None or y is None:
        return x is None and y is None
    return (x.saved, x.recomputed, x.compressed, x.offloaded) == (y.saved, y.recomputed, y.compressed, y.offloaded)


def fresh_caches() -> None:
    """Forget this process's lowest-peak schedules (`fxopt.cache.lowest_peaks`) and measured
    scratch (`fxopt.analysis.scratch`), so two answers compared start alike (not the second
    from the first's)."""
    fxopt.cache.lowest_peaks.clear()
    scratch._cache.clear()


def whole_capture_rows(model, inputs, name: str, layers: int, answers: list[tuple[dict, object]],
                       time_limit: float) -> list[dict]:
    """The 50% and smallest-budget answers again with every block captured (``stamp=False``), from
    fresh caches as the stamped answers were: the same answer, and what stamping saves."""
    rows = []
    fresh_caches()
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["FXOPT_CACHE_DIR"] = cache_dir
        for stamped, stamped_plan in answers:
            for old in Path(cache_dir).glob("*.json"):
                old.unlink()
            row, plan = one_answer(model, inputs, stamped["budget_asked"], time_limit, stamp=False)
            row.update(model=name, layers=layers, row=f"{stamped['row']} whole capture",
                       same_as_stamped=same_answer(row, stamped, (plan, stamped_plan)))
            rows.append(row)
            log(json.dumps(row))
    return rows


def run_depth(layers: int, time_limit: float, whole: bool, measure: bool, whole_capture: bool = False) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["FXOPT_CACHE_DIR"] = cache_dir
        torch.manual_seed(0)
        model, inputs = llama(layers)
        name = f"llama-{layers}"
        if whole_capture:
            fresh_caches()  # as the answers captured whole will start
        row, plan = one_answer(model, inputs, 0.5, time_limit)
        row.update(model=name, layers=layers, row="50%")
        rows.append(row)
        log(json.dumps(row))
        least = row.get("infeasible_min_budget", row.get("budget"))
        for old in Path(cache_dir).glob("*.json"):
            old.unlink()
        minimum, plan = one_answer(model, inputs, least, time_limit)
        minimum.update(model=name, layers=layers, row="min")
        if plan is not None:
            from benchmarks.budget_holds import decisions_digest  # (the plan's decisions, not its seconds)

            minimum["digest"] = decisions_digest(plan)
        if plan is not None and measure:
            minimum["measured_peak"] = measured_peak(model, inputs, plan)
        rows.append(minimum)
        log(json.dumps(minimum))
        if whole_capture:
            rows += whole_capture_rows(model, inputs, name, layers, [(row, None), (minimum, plan)], time_limit)
            os.environ["FXOPT_CACHE_DIR"] = cache_dir
        if plan is not None:  # the same two answers from the solver graph alone, in a fresh memo
            alone = {"model": name, "layers": layers, "row": "solver graph alone"}
            memo, t0 = Memo(), time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SolverTimeoutWarning)
                try:
                    solve(plan.graph, 1, time_limit=time_limit, memo=memo)
                except fxopt.InfeasibleBudgetError as err:
                    alone["min_budget"] = err.min_budget
                alone["infeasible_s"], t0 = time.perf_counter() - t0, time.perf_counter()
                alone["min_solver"] = solve(plan.graph, least, time_limit=time_limit, memo=memo).solver
            alone["min_s"], alone["load1"] = time.perf_counter() - t0, os.getloadavg()[0]
            rows.append(alone)
            log(json.dumps(alone))
        if whole and plan is not None:
            eager = eager_timeline(plan.graph).peak_bytes
            for label, budget in (("90%", int(0.9 * eager)), ("80%", int(0.8 * eager)), ("min", least)):
                found = compare(plan.graph, budget, time_limit)
                found.update(model=name, layers=layers, row=f"solver graph at {label}")
                rows.append(found)
                log(json.dumps(found))
    return rows


def fit(rows: list[dict], which: str, field: str) -> dict | None:
    """A least-squares line through (layers, ``field``) of the ``which`` rows, and the exponent k
    of layers^k between the shallowest and deepest (1: linear)."""
    import math

    points = sorted((r["layers"], r[field]) for r in rows if r.get("row") == which and field in r)
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    (x0, y0), (x1, y1) = points[0], points[-1]
    exponent = math.log(y1 / y0) / math.log(x1 / x0) if y0 > 0 and y1 > 0 else None
    return {"row": which, "field": field, "per_layer_s": slope, "at_zero_s": my - slope * mx, "exponent": exponent}


def write_depth(rows: list[dict], out: Path, meta: dict, name: str = "planning_time_depth") -> None:
    s = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
    e = lambda v: "–" if v is None else f"{v:.3e}"  # noqa: E731
    answers = [r for r in rows if r["row"] in ("50%", "min")]
    fits = [f for which, field in (("50%", "wall_s"), ("50%", "solve_s"), ("min", "wall_s"), ("min", "solve_s"),
                                   ("solver graph alone", "infeasible_s"), ("solver graph alone", "min_s"))
            if (f := fit(rows, which, field))]
    lines = [
        "# Planning time against depth: a repeated block solved once", "",
        f"{meta_line(meta)} · {meta['cpu_count']} CPUs, {meta['torch_threads']} torch threads · load average "
        f"(1 min) {min(r['load1'] for r in answers):.1f}–{max(r['load1'] for r in answers):.1f} as the answers came "
        "(a shared machine: more than the 2 cores' worth slows every row)", "",
        "Issue 27's Llama (hidden 256, FFN 1024, vocabulary 32000, one sequence of 512 tokens, real tensors), "
        "plan cache off. `50%`: the answer at 50% of the eager peak (infeasible: the smallest budget fxopt finds, "
        "and the floor no schedule goes below); `min`: the plan at that budget. Target (issue 27): each "
        f"≤ {DEPTH_TARGET_SECONDS:.0f} s at 32 layers, time at most linear in depth.", "",
        "| layers | row | nodes | wall s | capture s | analysis s | solve s | budget MiB | peak MiB | measured MiB "
        "| solver (status) | cost s | bound s | gap |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in answers:
        budget = r.get("budget", r.get("infeasible_min_budget"))
        note = mib(budget)
        if "infeasible_min_budget" in r:
            note = f"min {mib(budget)}" + ("" if r.get("floor") is None else f" (floor {mib(r['floor'])})")
        solver = f"{r['solver']} ({r['status']})" if "solver" in r else "infeasible"
        gap = "–" if r.get("gap") is None else f"{100 * r['gap']:.1f}%"
        lines.append(f"| {r['layers']} | {r['row']} | {r.get('nodes', '–')} | {s(r['wall_s'])} | {s(r['capture_s'])} | "
                     f"{s(r['analysis_s'])} | {s(r['solve_s'])} | {note} | {mib(r.get('peak'))} | "
                     f"{mib(r.get('measured_peak'))} | {solver} | {e(r.get('cost'))} | {e(r.get('bound'))} | {gap} |")
    lines += ["", "CPU seconds of each answer (the process's, `time.process_time`: what the target is checked "
              "on, the machine being shared) and the plan's digest (its decisions, `benchmarks.budget_holds."
              "decisions_digest`: equal digests, the same plan):", "",
              "| layers | row | CPU s | load | digest |", "|---:|---|---:|---:|---|"]
    lines += [f"| {r['layers']} | {r['row']} | {s(r.get('cpu_s'))} | {r['load1']:.1f} | "
              f"{'`' + r['digest'] + '`' if r.get('digest') else '–'} |" for r in answers]
    captured = [r for r in rows if r["row"].endswith("whole capture")]
    if captured:
        lines += ["", "Stamped against captured whole: each answer again with every block captured (`stamp=False`), "
                  "both from fresh caches (no scratch measured, no lowest peak known in the process). CPU s: the process's CPU time for the answer "
                  "(`time.process_time`); traced nodes: the nodes of every joint graph Dynamo and AOTAutograd traced "
                  "for it (the capture's counted work: the 3- and 4-block captures when stamped); stamp s: "
                  "making the whole run's graph from them.", "",
                  "| layers | answer | capture | traced nodes in graphs | stamp s | CPU s | wall s | capture s | analysis s | "
                  "solve s | load | same answer |",
                  "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        by_key = {(r["layers"], r["row"]): r for r in rows}
        for w in captured:
            answer = w["row"].removesuffix(" whole capture")
            for label, r in (("stamped", by_key.get((w["layers"], answer))), ("whole", w)):
                if r is None:
                    continue
                same = ("yes" if w["same_as_stamped"] else "**no**") if label == "whole" else ""
                lines.append(f"| {r['layers']} | {answer} | {label} | {r.get('traced_nodes', 0):,} in {r.get('traced_graphs', 0)} | "
                             f"{r.get('stamp_s', 0.0):.1f} | {s(r.get('cpu_s'))} | {s(r['wall_s'])} | "
                             f"{s(r['capture_s'])} | {s(r['analysis_s'])} | {s(r['solve_s'])} | {r['load1']:.1f} | {same} |")
    alone = [r for r in rows if r["row"] == "solver graph alone"]
    lines += ["", "The same two answers from the step's solver graph alone (`fxopt.solvers.solve` at 1 byte, then at "
              "the smallest budget, a fresh lowest-peak memo; no capture in between), in the same process:", "",
              "| layers | smallest budget MiB | 1 byte s | at the smallest s | its solver | load |",
              "|---:|---:|---:|---:|---|---:|"]
    for r in alone:
        lines.append(f"| {r['layers']} | {mib(r.get('min_budget'))} | {r['infeasible_s']:.1f} | {r['min_s']:.1f} | "
                     f"{r['min_solver']} | {r['load1']:.1f} |")
    lines += ["", "Time against depth: a line through the rows' seconds (least squares), and k in layers^k from the "
              "shallowest to the deepest (1 is linear).", "",
              "| row | seconds | per layer s | at 0 layers s | k |", "|---|---|---:|---:|---:|"]
    for f in fits:
        k = "–" if f["exponent"] is None else f"{f['exponent']:.2f}"
        field = {"infeasible_s": "1 byte", "min_s": "at the smallest"}.get(f["field"], f["field"].removesuffix("_s"))
        lines.append(f"| {f['row']} | {field} | {f['per_layer_s']:.3f} | {f['at_zero_s']:.1f} | {k} |")
    compared = [r for r in rows if r["row"].startswith("solver graph at")]
    if compared:
        lines += ["", "The same solver graph by the blocks and by the whole-graph solvers alone (the blocks switched "
                  "off), in this process. Target (issue 27): the blocks' cost within 2% of the whole graph's.", "",
                  "| layers | budget | MiB | blocks: solver (status) | cost s | bound s | s | whole: solver (status) | "
                  "cost s | bound s | s | blocks / whole |",
                  "|---:|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for r in compared:
            cells = []
            for label in ("blocks", "whole"):
                x = r[label]
                name = (f"infeasible (min {mib(x['infeasible'])})" if "infeasible" in x else
                        f"{x['solver']} ({x['status']}{', stopped' if x['stopped'] else ''})")
                cells.append(f"{name} | {e(x.get('cost'))} | {e(x.get('bound'))} | {x['seconds']:.1f}")
            ratio = "–" if r["cost_ratio"] is None else f"{r['cost_ratio']:.4f}"
            lines.append(f"| {r['layers']} | {r['row'].removeprefix('solver graph at ')} | {mib(r['budget'])} | "
                         f"{cells[0]} | {cells[1]} | {ratio} |")
    write_results(out / name, {"meta": meta, "rows": rows, "fits": fits}, "\n".join(lines))


def symbolic_capture(layers: int, batch: int = 2, limit: int = 64) -> dict:
    """`fxopt.max_batch`'s capture (`fxopt.plan_ahead.capture_symbolic`, the batch symbolic from 1
    to ``limit``, analysed at ``batch``) of issue 27's Llama, its run stamped and captured whole,
    from fresh caches: CPU s, the nodes of the joint graphs traced, and whether the two give the
    same graphs (the solver graph at the batch, at the range's ends and between)."""
    from fxopt.capture.shapes import DynamicDims
    from fxopt.options import Options

    torch.manual_seed(0)
    model, inputs = llama(layers)
    ids = inputs["input_ids"].expand(batch, -1).contiguous()
    inputs = {"input_ids": ids, "labels": ids}
    dims = DynamicDims.parse({"batch": (1, limit)})
    name = dims.ranges.names[0]
    row, graphs = {"layers": layers, "batch": batch, "limit": limit}, {}
    for label, stamp in (("stamped", True), ("whole", False)):
        fresh_caches()
        torch._dynamo.reset()
        timers = Timers()
        t0, cpu0 = time.perf_counter(), time.process_time()
        with timers.installed():
            graphs[label] = plan_ahead.capture_symbolic(model, inputs, dims, {name: batch}, Options(budget=1, stamp=stamp))
        row[label] = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0,
                      "analysis_s": timers.analysis, "stamp_s": timers.stamp, "traced_nodes": timers.traced_nodes,
                      "traced_graphs": timers.traced_graphs, "nodes": len(graphs[label][1].graph.nodes),
                      "load1": os.getloadavg()[0]}
        log(json.dumps({label: row[label]}))
    (_, stamped), (_, whole) = graphs["stamped"], graphs["whole"]
    lo, hi = whole.symbolic.ranges.bounds[name]
    row["range"] = [lo, hi]
    row["same_graphs"] = stamped.symbolic.ranges == whole.symbolic.ranges and all(
        stamped.symbolic.at({name: b}).nodes == whole.symbolic.at({name: b}).nodes for b in sorted({lo, batch, 17, hi}))
    return row


def write_symbolic(rows: list[dict], out: Path, meta: dict) -> None:
    lines = ["# fxopt.max_batch's capture (symbolic batch): a run of blocks stamped against captured whole", "",
             f"{meta_line(meta)} · {meta['cpu_count']} CPUs, {meta['torch_threads']} torch threads", "",
             "Issue 27's Llama (hidden 256, FFN 1024, vocabulary 32000, sequences of 512 tokens, real tensors) "
             "captured by `fxopt.plan_ahead.capture_symbolic` with the batch symbolic (1 to the limit) and analysed "
             "at the batch, from fresh caches: stamped (the run cut to 3 and 4 blocks, `fxopt.capture.repeat`) and "
             "whole (`stamp=False`). CPU s: the process's CPU time (`time.process_time`); traced nodes: the nodes of "
             "every joint graph Dynamo and AOTAutograd traced; same graphs: the solver graphs equal node for node at "
             "the range's ends, the batch and 17.", "",
             "| layers | batch (range) | capture | traced nodes in graphs | stamp s | analysis s | CPU s | wall s | "
             "load | same graphs |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        for label in ("stamped", "whole"):
            x = r[label]
            same = ("yes" if r["same_graphs"] else "**no**") if label == "whole" else ""
            lines.append(f"| {r['layers']} | {r['batch']} ({r['range'][0]}-{r['range'][1]}) | {label} | "
                         f"{x['traced_nodes']:,} in {x['traced_graphs']} | {x['stamp_s']:.1f} | {x['analysis_s']:.1f} | "
                         f"{x['cpu_s']:.1f} | {x['wall_s']:.1f} | {x['load1']:.1f} | {same} |")
    write_results(out / "planning_time_symbolic", {"meta": meta, "rows": rows}, "\n".join(lines))


# ---------------------------------------------------------------- fxopt.pipeline against depth

PIPELINE_TARGET_SECONDS = 10.0  # issue 27: 48 layers in 8 stages, fxopt.pipeline planning only
PIPELINE = dict(dim=128, heads=4, seq=64, vocab=256, budget=0.75)


class Phases:
    """CPU seconds (`time.process_time`) spent in each of `fxopt.pipeline`'s phases, exclusive
    (a phase called inside another counts in its own only), by wrapping the functions
    `fxopt.distributed.pipeline` calls them by; and the stage planner (its counted work)."""

    NAMES = {"plan_and_rewrite": None, "split_model": "split (torch.export)", "plan_each": "stage captures",
             "cut_model": "cut model"}

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.planners: list = []
        self._children = [0.0]

    @contextlib.contextmanager
    def installed(self):
        import fxopt.distributed.pipeline as pl

        # (a name an older fxopt lacks is not timed: the same command measures the commit before)
        saved = {name: getattr(pl, name) for name in self.NAMES if hasattr(pl, name)}
        classes = {("_StagePlanner", "modules"): "stage forwards (eager)", ("_StagePlanner", "plan_stage"):
                   "stage analyses and solves", ("_LastStage", "of"): "model output and loss (eager)"}
        saved_methods = {key: getattr(getattr(pl, key[0]), key[1]) for key in classes}
        init = pl._StagePlanner.__init__
        for name, fn in saved.items():
            setattr(pl, name, self._timed(fn, self.NAMES[name]))
        for (cls, name), phase in classes.items():
            fn = saved_methods[(cls, name)]
            setattr(getattr(pl, cls), name, self._timed(fn.__func__ if hasattr(fn, "__func__") else fn, phase,
                                                        classmethod if hasattr(fn, "__func__") else None))

        def made(planner, *args, **kwargs):
            self.planners.append(planner)
            init(planner, *args, **kwargs)

        pl._StagePlanner.__init__ = made
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(pl, name, fn)
            for (cls, name), fn in saved_methods.items():
                setattr(getattr(pl, cls), name, classmethod(fn.__func__) if hasattr(fn, "__func__") else fn)
            pl._StagePlanner.__init__ = init

    def _timed(self, fn, phase: str | None, wrap=None):
        def timed(*args, **kwargs):
            label = phase
            if label is None:  # plan_and_rewrite: the whole step, the loss, or a stage captured alone
                kind = type(args[0]).__name__
                label = {"_WithLoss": "whole step (stamped capture, analysis)", "_Loss": "loss"}.get(
                    kind, "stage captures")
            self._children.append(0.0)
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - t0
                inner = self._children.pop()
                self.seconds[label] = self.seconds.get(label, 0.0) + spent - inner
                self._children[-1] += spent

        return wrap(timed) if wrap is not None else timed


def pipeline_answer(layers: int, stages: int, reuse: bool = True, budget: float = PIPELINE["budget"]) -> dict:
    import fxopt.distributed.pipeline as pl
    from benchmarks.budget_holds import pipeline_digest  # (the plan's decisions: budget_holds' digest)
    from fxopt.models import gpt2_lm, lm_loss

    spec = PIPELINE
    microbatches = 2 * stages
    fresh_caches()
    torch.manual_seed(0)
    model, (idx,) = gpt2_lm(layers, spec["dim"], spec["heads"], spec["seq"], microbatches, spec["vocab"])
    phases = Phases()
    saved = getattr(pl._StagePlanner, "reuse_same_stages", None)  # (None: an fxopt from before it)
    if saved is not None:
        pl._StagePlanner.reuse_same_stages = reuse
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["FXOPT_CACHE_DIR"] = cache_dir  # (no plan and no scratch known)
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            with phases.installed(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = fxopt.pipeline(model, (idx,), target=torch.roll(idx, -1, 1), loss_fn=lm_loss, stages=stages,
                                      microbatches=microbatches, budget=budget)
        finally:
            if saved is not None:
                pl._StagePlanner.reuse_same_stages = saved
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    phases.seconds["other"] = cpu - sum(phases.seconds.values())
    return {"layers": layers, "stages": stages, "microbatches": microbatches, "budget_share": budget,
            "reuse": reuse and saved is not None, "wall_s": wall,
            "cpu_s": cpu, "load1": os.getloadavg()[0], "phases": phases.seconds, "work": getattr(phases.planners[0], "work", {}),
            "digest": pipeline_digest(plan), "budget": plan.budget_bytes, "peak": plan.peak_bytes,
            "solvers": [s.plan.solver for s in plan.stages], "cuts": [f"{c.module} {c.split_point}" for c in plan.cuts],
            "recomputed": sum(sum(s.plan.recomputed.values()) for s in plan.stages)}


def pipeline_warm_up() -> None:
    """The process's first Dynamo capture and torch.export (imports, caches), untimed."""
    from fxopt.models import gpt2_lm, lm_loss

    torch.manual_seed(0)
    model, (idx,) = gpt2_lm(4, 16, 2, 8, 4, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxopt.pipeline(model, (idx,), target=torch.roll(idx, -1, 1), loss_fn=lm_loss, stages=2, microbatches=4,
                       budget=0.9)


def write_pipeline(rows: list[dict], out: Path, meta: dict, suffix: str = "") -> None:
    reused = [r for r in rows if r["reuse"]]
    fits = [f for field in ("cpu_s", "wall_s") if (f := fit([{**r, "row": "pipeline"} for r in reused], "pipeline", field))]
    names = sorted({k for r in rows for k in r["phases"]}, key=lambda k: -max(r["phases"].get(k, 0) for r in rows))
    lines = [
        "# fxopt.pipeline planning time against depth: stages of one structure captured once", "",
        f"{meta_line(meta)} · {meta['cpu_count']} CPUs, {meta['torch_threads']} torch threads", "",
        f"Issue 27's GPT-2 (`fxopt.models.gpt2_lm`, width {PIPELINE['dim']}, {PIPELINE['heads']} heads, "
        f"{PIPELINE['seq']} tokens, vocabulary {PIPELINE['vocab']}) planned by `fxopt.pipeline` (planning only) "
        f"in the stages shown, twice as many microbatches of one sequence, 1F1B, at {rows[0]['budget_share']:.0%} of "
        "its eager peak; each row from a fresh scratch and plan cache (the process's first capture and export "
        "made before, on a 4-layer model). CPU s: `time.process_time`; phases exclusive, CPU s. Reuse: a stage "
        "whose part has the structure of one captured before is planned from that capture (`stage_structure`), "
        "and torch splits the model with its run of blocks cut to those the distinct stages need (`ShortSplit`; "
        "blocks torch split: the run's blocks in the models it traced); "
        "`alone`: every stage captured (its analysis and solve then counted in its capture). Digest: the plan without its timings. Target (issue 27): 48 layers × 8 "
        f"stages ≤ {PIPELINE_TARGET_SECONDS:.0f} s, time at most linear in depth. Load: the 1-minute average as "
        "the row ended (a shared machine; torch's 2 threads spin on its eager ops when it is busy).", "",
        "| layers | stages | stages planned | CPU s | wall s | load | " + " | ".join(names) +
        " | captured / from an earlier capture / plans reused | blocks torch split | largest stage MiB | budget MiB "
        "| digest |",
        "|---:|---:|---|---:|---:|---:|" + "---:|" * len(names) + "---|---:|---:|---:|---|",
    ]
    for r in rows:
        w = {"captures": "–", "planned from an earlier capture": "–", "plans reused": "–", "blocks split": "–",
             **r["work"]}
        lines.append(f"| {r['layers']} | {r['stages']} | {'reuse' if r['reuse'] else 'alone'} | {r['cpu_s']:.1f} | "
                     f"{r['wall_s']:.1f} | {r['load1']:.1f} | "
                     + " | ".join(f"{r['phases'].get(k, 0.0):.1f}" for k in names)
                     + f" | {w['captures']} / {w['planned from an earlier capture']} / {w['plans reused']} | "
                     f"{w['blocks split']} | {mib(r['peak'])} | {mib(r['budget'])} | `{r['digest']}` |")
    alone = {(r["layers"], r["stages"]): r for r in rows if not r["reuse"]}
    for r in reused:
        other = alone.get((r["layers"], r["stages"]))
        if other is not None:
            same = "the same plan" if other["digest"] == r["digest"] else "**a different plan**"
            lines += ["", f"{r['layers']} layers, {r['stages']} stages: reuse and alone give {same} (digest "
                      f"`{r['digest']}` / `{other['digest']}`); CPU {r['cpu_s']:.1f} s against {other['cpu_s']:.1f} s."]
    if fits:
        lines += ["", "Time against depth (the reuse rows): a line through CPU and wall seconds (least squares), and k "
                  "in layers^k from the shallowest to the deepest (1 is linear).", "",
                  "| seconds | per layer s | at 0 layers s | k |", "|---|---:|---:|---:|"]
        for f in fits:
            k = "–" if f["exponent"] is None else f"{f['exponent']:.2f}"
            lines.append(f"| {f['field'].removesuffix('_s')} | {f['per_layer_s']:.3f} | {f['at_zero_s']:.1f} | {k} |")
    write_results(out / f"planning_time_pipeline{suffix}", {"meta": meta, "rows": rows, "fits": fits}, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="zoo,hf", help="comma-separated from zoo, hf, gpt2-12 (default zoo,hf)")
    parser.add_argument("--only", help="comma-separated model names to keep")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help=f"the planner's time limit, s (default {DEFAULT_TIME_LIMIT:g}, fxopt's)")
    parser.add_argument("--device", help="plan on fake tensors for this device profile (fxopt.devices.names())")
    parser.add_argument("--depth", help="comma-separated numbers of layers of issue 27's Llama (instead of --models)")
    parser.add_argument("--whole", default="", help="of those, the depths also solved by the whole-graph solvers")
    parser.add_argument("--whole-capture", default="",
                        help="of those, the depths also answered with every block captured (stamp=False), CPU s side by side")
    parser.add_argument("--symbolic", help="comma-separated numbers of layers of issue 27's Llama: max_batch's "
                        "symbolic capture, stamped and whole (instead of --models)")
    parser.add_argument("--pipeline", help="comma-separated numbers of layers of issue 27's GPT-2: fxopt.pipeline "
                        "planning time (instead of --models)")
    parser.add_argument("--stages", type=int, default=8, help="with --pipeline: the stages (default 8)")
    parser.add_argument("--budget", type=float, default=PIPELINE["budget"],
                        help=f"with --pipeline: the per-device budget, a share of the eager peak (default {PIPELINE['budget']:g})")
    parser.add_argument("--alone", default="", help="with --pipeline: the depths also planned with every stage captured")
    parser.add_argument("--measure", default="", help="of those, the depths whose smallest-budget plan is run and measured")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    os.environ["FXOPT_CACHE"] = "1"
    meta = run_meta("python -m benchmarks.planning_time " + " ".join(sys.argv[1:] if argv is None else argv))
    if args.pipeline:
        pipeline_warm_up()
        rows = []
        alone = {int(x) for x in args.alone.split(",") if x}
        for layers in sorted(int(x) for x in args.pipeline.split(",") if x):
            for reuse in (True, False) if layers in alone else (True,):
                log(f"== gpt2_lm-{layers}, {args.stages} stages, {'reuse' if reuse else 'alone'}")
                rows.append(pipeline_answer(layers, args.stages, reuse, args.budget))
                log(json.dumps(rows[-1]))
                write_pipeline(rows, Path(args.out), meta, "" if args.budget == PIPELINE["budget"] else f"_at{args.budget:g}")
        return 0
    if args.symbolic:
        rows = []
        for layers in sorted(int(x) for x in args.symbolic.split(",") if x):
            log(f"== llama-{layers}, symbolic batch")
            rows.append(symbolic_capture(layers))
            write_symbolic(rows, Path(args.out), meta)
        return 0
    if args.depth:
        depths = lambda text: {int(x) for x in text.split(",") if x}  # noqa: E731
        whole, measure, whole_capture = depths(args.whole), depths(args.measure), depths(args.whole_capture)
        rows = []
        for layers in sorted(depths(args.depth)):
            log(f"== llama-{layers}")
            rows += run_depth(layers, args.time_limit, layers in whole, layers in measure, layers in whole_capture)
            write_depth(rows, Path(args.out), meta, "planning_time_depth_stamp" if whole_capture else "planning_time_depth")
        return 0
    rows: list[dict] = []
    only = set(args.only.split(",")) if args.only else None
    for name, build in models(args.models.split(","), only):
        log(f"== {name}")
        rows += run_model(name, build, args.time_limit, args.device)
        write(rows, Path(args.out), meta, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
