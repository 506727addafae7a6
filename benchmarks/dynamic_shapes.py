"""Dynamic shapes: one plan per bucket of shapes against re-planning every shape, and the largest
batch that fits (docs/dynamic-shapes.md).

    python -m benchmarks.dynamic_shapes [--steps 20] [--max-seq 512] [--out benchmarks/results]

Part 1, a GPT-2-style model (`fxopt.models.GPT`, small widths so it runs on a CPU, dropout 0.1)
trained for ``--steps`` steps on batches of as many distinct sequence lengths up to ``--max-seq``:

  - ``fxopt.optimize(model, budget, dynamic={"batch": ..., "seq": ...})``: one capture per bucket;
  - ``fxopt.optimize(model, budget)``: today's static planning, a capture and a plan per shape.

The budget is in bytes: half the eager peak at the longest sequence. Each method's wall time
over the steps (first calls, which capture and plan, included) and the plans it made; then, for
the dynamic module, every length again with the step's peak measured (`fxopt.measure_peak`) and
its gradients against eager's (same seeds: the same dropout masks).

Part 3, `transformers` decoders (GPT-2, Llama from `benchmarks.hf_zoo`) called with a padding
mask and labels on five lengths: captures, plans; then each length again, measured, gradients
against eager's.

Part 2, `fxopt.max_batch` on the residual MLP, a GPT-2-style transformer and a CNN: fxopt's
largest batch, eager's and per-block checkpointing's (predicted), the proven bound and the time;
then measured: fxopt's plan at its batch (`MaxBatch.optimize`), eager at its batch and the next,
per-block ``torch.utils.checkpoint`` at its batch and the next.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import (checkpoint_blocks, commit_of, compare_grads, load_average, log, mib, run_meta,
                                write_results)
from fxopt.models import GPT, ResidualMLP, SmallCNN, loss_of
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT


def _step(model, inputs):
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss


def _lm_batch(batch: int, length: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def _gpt(max_seq: int) -> GPT:
    torch.manual_seed(0)
    return GPT(layers=2, dim=64, heads=4, vocab=512, max_seq=max_seq, dropout=0.1).train()


def _train(module, shapes: list[tuple[int, int]], vocab: int) -> float:
    t0 = time.perf_counter()
    for k, (b, t) in enumerate(shapes):
        module.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        _step(module, _lm_batch(b, t, vocab, k))
    return time.perf_counter() - t0


def part_one(steps: int, max_seq: int, batch: int, time_limit: float) -> dict:
    vocab = 512
    rng = random.Random(0)
    lengths = sorted(rng.sample(range(16, max_seq), steps - 1)) + [max_seq]
    rng.shuffle(lengths)
    shapes = [(batch, t) for t in lengths]
    model = _gpt(max_seq)
    eager_plan = fxopt.plan(copy.deepcopy(model), 1.0, _lm_batch(batch, max_seq, vocab, 0), time_limit=time_limit)
    budget = eager_plan.eager_peak_bytes // 2
    log(f"part 1: {steps} lengths {sorted(lengths)}; budget {mib(budget)} MiB (half the eager peak at {max_seq})")
    dynamic = fxopt.optimize(copy.deepcopy(model), budget, dynamic={"batch": (1, batch), "seq": (2, max_seq)},
                             time_limit=time_limit)
    dynamic_s = _train(dynamic, shapes, vocab)
    state = dynamic._dynamic.state
    log(f"dynamic: {dynamic_s:.1f} s, {state.captures} captures, {state.plans} plans, buckets "
        f"{[b.ranges.bounds['seq'] for b in dynamic.buckets]}")
    static = fxopt.optimize(copy.deepcopy(model), budget, time_limit=time_limit)
    static_s = _train(static, shapes, vocab)
    log(f"re-plan per shape: {static_s:.1f} s, {len(static.plans)} plans")
    rows = []
    eager = copy.deepcopy(model)
    for k, (b, t) in enumerate(shapes):
        inputs = _lm_batch(b, t, vocab, 100 + k)
        eager.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        _step(eager, inputs)
        ref = {n: p.grad.detach().clone() for n, p in eager.named_parameters()}
        dynamic.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        peak = fxopt.measure_peak(_step, dynamic, inputs, resident=[dynamic, inputs]).peak_bytes
        bucket = dynamic.buckets[fxopt.buckets.bucket_of(dynamic.buckets, {"batch": b, "seq": t})]
        rows.append({"batch": b, "seq": t, "measured_peak_bytes": peak, "within_budget": peak <= budget,
                     "bucket": list(bucket.ranges.bounds["seq"]), "plan_solver": bucket.plan.solver,
                     **compare_grads(dynamic, ref)})
    return {
        "model": "GPT(layers=2, dim=64, heads=4, vocab=512, dropout=0.1)", "batch": batch, "lengths": lengths,
        "budget_bytes": budget, "eager_peak_bytes_at_max": eager_plan.eager_peak_bytes,
        "dynamic": {"seconds": dynamic_s, "captures": state.captures, "plans": state.plans,
                    "buckets": [b.to_dict() for b in dynamic.buckets]},
        "replan_per_shape": {"seconds": static_s, "plans": len(static.plans),
                             "max_predicted_peak_bytes": max(p.peak_bytes for p in static.plans)},
        "rows": rows,
    }


def _hf_inputs(batch: int, length: int, vocab: int, seed: int):
    """Token ids, a padding mask (the last sequence right-padded by a quarter) and -100 labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, length - length // 4:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def part_three(names: list[str], lengths: list[int], batch: int, time_limit: float) -> list[dict]:
    """`transformers` decoders from `benchmarks.hf_zoo` (their "bench" configs: 2 layers, width
    128, 128 positions), called with a padding mask and labels, on several lengths."""
    from benchmarks.hf_zoo import TEXT
    from fxopt.models import MODELS

    out = []
    for name in names:
        torch.manual_seed(0)
        model, _ = MODELS[f"hf-{name}"]("bench", dropout=0.1)
        vocab, top = TEXT["bench"]["vocab"], max(lengths)
        eager_peak = fxopt.plan(copy.deepcopy(model), 1.0, _hf_inputs(batch, top, vocab, 0),
                                time_limit=time_limit).eager_peak_bytes
        budget = int(0.6 * eager_peak)
        optimized = fxopt.optimize(copy.deepcopy(model), budget, dynamic={"batch": (2, batch), "seq": (2, top)},
                                   time_limit=time_limit)
        eager = copy.deepcopy(model)
        rows = []
        t0 = time.perf_counter()
        for k, length in enumerate(lengths):  # first calls, which capture and plan, not measured
            optimized.zero_grad(set_to_none=True)
            _step(optimized, _hf_inputs(batch, length, vocab, k))
        for k, length in enumerate(lengths):
            inputs = _hf_inputs(batch, length, vocab, k)
            eager.zero_grad(set_to_none=True)
            torch.manual_seed(k)
            _step(eager, inputs)
            ref = {n: p.grad.detach().clone() for n, p in eager.named_parameters() if p.grad is not None}
            optimized.zero_grad(set_to_none=True)
            torch.manual_seed(k)
            peak = fxopt.measure_peak(_step, optimized, inputs, resident=[optimized, inputs]).peak_bytes
            rows.append({"seq": length, "measured_peak_bytes": peak, "within_budget": peak <= budget,
                         **compare_grads(optimized, ref)})
        state = optimized._dynamic.state
        out.append({"model": name, "hf_class": MODELS[f"hf-{name}"].source.removeprefix("transformers."), "batch": batch, "budget_bytes": budget,
                    "eager_peak_bytes_at_max": eager_peak, "seconds": time.perf_counter() - t0,
                    "captures": state.captures, "plans": state.plans,
                    "buckets": [b.to_dict() for b in optimized.buckets], "rows": rows})
        log(f"{name}: {state.captures} captures, {state.plans} plans, all within budget: "
            f"{all(r['within_budget'] for r in rows)}, gradients equal: {all(r['grads_equal'] for r in rows)}")
    return out


MAX_BATCH_MODELS = {
    "residual_mlp": (lambda: ResidualMLP(4, 128), lambda b: (torch.randn(b, 128),), "8MiB",
                     "ResidualMLP(blocks=4, width=128)", lambda m: list(m.blocks)),
    "transformer": (lambda: GPT(2, 64, 4, 512, 128, dropout=0.0),
                    lambda b: (torch.randint(0, 512, (b, 128)), torch.randint(0, 512, (b, 128))), "12MiB",
                    "GPT(layers=2, dim=64, heads=4, vocab=512), 128 tokens", lambda m: list(m.h)),
    "cnn": (lambda: SmallCNN(16), lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))), "8MiB",
            "SmallCNN(channels=16), 32x32 images", lambda m: None),
}


def _measured(step_fn, model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    return fxopt.measure_peak(lambda: _step(step_fn, inputs), resident=[model, inputs]).peak_bytes


def part_two(names: list[str], time_limit: float) -> list[dict]:
    rows = []
    for name in names:
        build, make_inputs, budget, description, blocks_of = MAX_BATCH_MODELS[name]
        torch.manual_seed(0)
        model = build()
        found = fxopt.max_batch(model, budget, make_inputs, time_limit=time_limit)
        log(f"{name}: {found.summary()}")
        row = {"model": name, "description": description, "budget_bytes": found.budget_bytes,
               "fxopt_batch": found.batch, "eager_batch": found.eager_batch,
               "checkpoint_batch": found.checkpoint_batch, "proven_max": found.proven_max,
               "seconds": found.seconds, "stopped": list(found.stopped), "plan_solver": found.plan.solver,
               "plan_peak_bytes": found.plan.peak_bytes,
               "next_lowest_peak_bytes": None if found.next_plan is None else found.next_plan.peak_bytes}
        row["fxopt_measured_bytes"] = _measured(found.optimize(model), model, make_inputs(found.batch))
        for b in (found.eager_batch, found.eager_batch + 1):
            row[f"eager_measured_bytes_at_{'batch' if b == found.eager_batch else 'next'}"] = _measured(
                model, model, make_inputs(b))
        blocks = blocks_of(model)
        if blocks and found.checkpoint_batch:
            run = checkpoint_blocks(model, blocks)
            for b, key in ((found.checkpoint_batch, "batch"), (found.checkpoint_batch + 1, "next")):
                row[f"checkpoint_measured_bytes_at_{key}"] = _measured(run, model, make_inputs(b))
        rows.append(row)
    return rows


def write(result: dict, out: Path) -> None:
    p1, meta = result["part_one"], result["meta"]
    lines = [
        "# Dynamic shapes: one plan per bucket vs re-planning every shape; the largest batch that fits", "",
        f"`{meta['command']}` at commit `{commit_of(meta)}`, {meta['date']}, torch {meta['torch']}, "
        f"{meta['cpu_count']} CPUs; load average before/after: {meta.get('load', meta.get('load_before'))} / "
        f"{meta['load_after']} "
        "(the machine is shared: times are noisy, counts are not).", "",
        f"## Training on {len(p1['lengths'])} sequence lengths", "",
        f"{p1['model']}, batch {p1['batch']}, lengths {sorted(p1['lengths'])}, in the order "
        f"{p1['lengths']}; budget {mib(p1['budget_bytes'])} MiB (half the eager peak at the longest, "
        f"{mib(p1['eager_peak_bytes_at_max'])} MiB).", "",
        "| method | wall time, all steps | captures | plans solved |", "|---|---:|---:|---:|",
        f"| `dynamic=` (one plan per bucket) | {p1['dynamic']['seconds']:.1f} s | {p1['dynamic']['captures']} | "
        f"{p1['dynamic']['plans']} |",
        f"| re-plan per shape (static) | {p1['replan_per_shape']['seconds']:.1f} s | "
        f"{p1['replan_per_shape']['plans']} | {p1['replan_per_shape']['plans']} |", "",
        "Buckets (seq range: plan): " + "; ".join(
            f"{b['ranges']['seq']}: {b['solver']}, predicted peak {mib(b['plan_peak_bytes'])} MiB at its top"
            for b in p1["dynamic"]["buckets"]) + ".", "",
        "Every length again, measured with the dynamic module:", "",
        "| seq | bucket | measured peak (MiB) | within budget | gradients equal to eager's |",
        "|---:|---|---:|---|---|",
    ]
    for r in sorted(p1["rows"], key=lambda r: r["seq"]):
        lines.append(f"| {r['seq']} | {r['bucket']} | {mib(r['measured_peak_bytes'])} | {r['within_budget']} | "
                     f"{r['grads_equal']} |")
    lines += ["", "## The largest batch that fits (`fxopt.max_batch`)", "",
              "Batches predicted by the simulator (fxopt's plan, eager, per-block checkpointing: block inputs "
              "saved, the rest recomputed); the bound is proven (peak lower bound, scratch counted as zero). "
              "Then measured: fxopt's plan at its batch, eager and per-block `torch.utils.checkpoint` at theirs "
              "and the next.", "",
              "| model | budget | fxopt | eager | per-block ckpt | no schedule above | time | fxopt measured | "
              "eager measured (batch / next) | ckpt measured (batch / next) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["part_two"]:
        def fits(key: str, r=r) -> str:
            return "–" if r.get(key) is None else f"{mib(r[key])} {'✓' if r[key] <= r['budget_bytes'] else '✗'}"

        ck = (f"{fits('checkpoint_measured_bytes_at_batch')} / {fits('checkpoint_measured_bytes_at_next')}"
              if "checkpoint_measured_bytes_at_batch" in r else "–")
        lines.append(
            f"| {r['model']}: {r['description']} | {mib(r['budget_bytes'])} | {r['fxopt_batch']} | {r['eager_batch']} | "
            f"{r['checkpoint_batch'] if r['checkpoint_batch'] is not None else '–'} | {r['proven_max']} | "
            f"{r['seconds']:.1f} s{' (cut by the time limit)' if r.get('stopped') else ''} | {fits('fxopt_measured_bytes')} | "
            f"{fits('eager_measured_bytes_at_batch')} / {fits('eager_measured_bytes_at_next')} | {ck} |")
    lines += ["", "✓: measured within the budget, ✗: over it. Eager's and per-block checkpointing's batches are "
              "fxopt's simulation of those methods; their measured peaks show how close that is."]
    lines += ["", "## `transformers` decoders, with a padding mask and labels", "",
              "From `benchmarks/hf_zoo.py` (the \"bench\" configs, dropout 0.1), called as "
              "`model(input_ids, attention_mask, labels)` with the last sequence right-padded; "
              "`dynamic={\"batch\": (2, B), \"seq\": (2, 128)}` (their loss sets a batch of 1 apart); budget 60% "
              "of the eager peak at the longest length. Each length measured, gradients against eager's.", "",
              "| model | budget (MiB) | captures | plans solved | buckets (seq) | lengths: measured peak (MiB), "
              "within budget, gradients equal |", "|---|---:|---:|---:|---|---|"]
    for m in result["part_three"]:
        cells = ", ".join(f"{r['seq']}: {mib(r['measured_peak_bytes'])} {'✓' if r['within_budget'] else '✗'}"
                          f"{'' if r['grads_equal'] else ' (gradients differ)'}" for r in m["rows"])
        lines.append(f"| {m['model']} ({m['hf_class']}), batch {m['batch']} | {mib(m['budget_bytes'])} | "
                     f"{m['captures']} | {m['plans']} | {[b['ranges']['seq'] for b in m['buckets']]} | {cells} |")
    write_results(out / "dynamic_shapes", result, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    p.add_argument("--max-batch-models", default=",".join(MAX_BATCH_MODELS))
    p.add_argument("--hf", default="gpt2,llama", help="transformers decoders of benchmarks.hf_zoo ('' for none)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    command = "python -m benchmarks.dynamic_shapes" + ("" if argv is None else " " + " ".join(argv))
    meta = run_meta(command)
    result = {"meta": meta,
              "part_one": part_one(args.steps, args.max_seq, args.batch, args.time_limit),
              "part_two": part_two([n for n in args.max_batch_models.split(",") if n], args.time_limit),
              "part_three": part_three([n for n in args.hf.split(",") if n], [128, 97, 64, 33, 8], 4,
                                       args.time_limit)}
    meta["load_after"] = load_average()
    write(result, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
