"""Quality of lossy activation compression (``quantize=``): gradient SQNR and convergence.

    python -m benchmarks.quantize_quality [--steps 300] [--out benchmarks/results]

1. Gradient SQNR. For each test model (`fxopt.models.ZOO`) and each format (int8, fp8, int4):
   a budget where the solver quantizes (of the first three shares of the eager peak above the
   smallest feasible budget at which ``plan.lossy`` is not empty, the one quantizing the most
   bytes), then ``--sqnr-steps`` training steps along an eager AdamW trajectory on the model's
   example inputs: at each step the
   quantized module gets the eager model's parameters and buffers, both take one step with the
   same seed (same dropout masks), and `fxopt.gradient_sqnr` compares every parameter gradient.
   A lossless row (``quantize=None`` at the same budget) checks the harness: its SQNR must be inf.
   Also: the measured peak of one step (`fxopt.measure_peak`) against the plan's budget and
   predicted peak.
2. Convergence. A 2-layer GPT (dim 64, dropout 0.1) trained ``--steps`` steps with AdamW on a
   synthetic next-token task (first half of each sequence from a sparse random Markov chain,
   second half a copy of the first: learnable both as bigrams and by attending back), eager fp32
   and once per format through ``fxopt.optimize(..., quantize=fmt)``; same initial weights, data
   order and seeds. Final loss: the mean of the last 20 steps.

Writes ``<out>/quantize_quality.md``, ``.json`` and ``.png`` (the loss curves).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import fxopt
from benchmarks.harness import meta_line, run_meta, write_results
from fxopt.models import ZOO, gpt2, loss_of
from fxopt.solvers import SolverTimeoutWarning
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

MiB = 2**20
FORMATS = ("int8", "fp8", "int4")
SQNR_MODELS = ("transformer_block", "gpt2_tiny", "residual_mlp", "cnn_bn")
# Shares of the eager peak tried, lowest first, from the smallest feasible budget up (see
# `choose_budget`).
BUDGET_SHARES = (0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9)
FINAL_WINDOW = 20  # final loss: mean of the last this many steps
INT8_TARGET = 0.02  # issue 6: int8 ends within 2% of the fp32 loss
SQNR_TARGET_DB = 30.0  # issue 6: int8 on the transformer block, every parameter gradient
# A gradient whose norm is below this share of the median parameter's is rounding noise around an
# exact zero (a conv bias followed by BatchNorm: the normalization cancels it). SQNR against noise
# says nothing, so these parameters are also left out of a second minimum.
ZERO_GRAD = 1e-4


class SolverLog(logging.Handler):
    """Keeps fxopt's log warnings (e.g. an ILP plan discarded for missing its budget when
    simulated), each with what was being planned, for the report."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.model = ""
        self.context = ""
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{self.context}: {record.getMessage()}")


SOLVER_LOG = SolverLog()


def step(model, inputs):
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss.detach()


def min_budget(model, inputs, quantize, time_limit: float) -> int:
    SOLVER_LOG.context = f"{SOLVER_LOG.model}, quantize={quantize}, smallest-budget search"
    try:
        fxopt.plan(model, 1, inputs, quantize=quantize, time_limit=time_limit)
    except fxopt.InfeasibleBudgetError as err:
        return err.min_budget
    raise AssertionError("a 1-byte budget was met")


def lossy_bytes(plan: fxopt.Plan) -> tuple[int, int]:
    """(bytes of the quantized values as saved in fp32, bytes they take quantized)."""
    by_name = {n.name: n for n in plan.graph.nodes}
    nodes = [by_name[name] for name in plan.lossy]
    return sum(n.bytes for n in nodes), sum(n.compressed_bytes for n in nodes)


def choose_budget(model, inputs, quantize, eager_peak: int, floor: int, time_limit: float,
                  shares=BUDGET_SHARES, tries: int = 3):
    """A budget where the solver quantizes: of the first ``tries`` shares of the eager peak (of
    ``shares``, at or above ``floor``) at which the plan quantizes something, the one at which it
    quantizes the most bytes (the lowest budget is not always it: there the solver may recompute
    instead). Returns (share, plan), or (None, None) when no share quantizes anything."""
    found = []
    for share in shares:
        if share * eager_peak < floor:
            continue
        SOLVER_LOG.context = f"{SOLVER_LOG.model}, quantize={quantize}, budget {share:.0%} of eager"
        try:
            plan = fxopt.plan(model, share, inputs, quantize=quantize, time_limit=time_limit)
        except fxopt.InfeasibleBudgetError:
            continue
        if plan.lossy:
            found.append((lossy_bytes(plan)[0], -share, plan))
            if len(found) == tries:
                break
    if not found:
        return None, None
    _, share, plan = max(found, key=lambda f: f[:2])
    return -share, plan


def sqnr_trajectory(model, inputs, plan, quantize, steps: int, lr: float = 1e-3) -> list[dict]:
    """Per step, `fxopt.gradient_sqnr` of the planned module against eager (``sqnr``), both from
    the eager model's current parameters, along ``steps`` AdamW steps of the eager model; and the
    parameters whose eager gradient is rounding noise (``zero_grad``, see `ZERO_GRAD`)."""
    reference = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, plan=plan, quantize=quantize)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=lr)
    out = []
    for i in range(steps):
        optimized.load_state_dict(reference.state_dict())
        reference.zero_grad(set_to_none=True)
        optimized.zero_grad(set_to_none=True)
        torch.manual_seed(100 + i)
        step(reference, inputs)
        torch.manual_seed(100 + i)
        step(optimized, inputs)
        sqnr = fxopt.gradient_sqnr(reference, optimized)
        norms = {n: p.grad.norm().item() for n, p in reference.named_parameters() if n in sqnr}
        scale = statistics.median(norms.values())
        out.append({"sqnr": sqnr, "zero_grad": sorted(n for n, v in norms.items() if v < ZERO_GRAD * scale)})
        optimizer.step()
    return out


def measured_peak(model, inputs, plan, quantize) -> int:
    optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, plan=plan, quantize=quantize)
    optimized.zero_grad(set_to_none=True)
    step(optimized, inputs)  # compile outside the measurement
    optimized.zero_grad(set_to_none=True)
    return fxopt.measure_peak(step, optimized, inputs, resident=[optimized, inputs]).peak_bytes


def sqnr_rows(name: str, formats, sqnr_steps: int, time_limit: float) -> list[dict]:
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    SOLVER_LOG.model = name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        eager_peak = fxopt.plan(model, 1.0, inputs, time_limit=time_limit).eager_peak_bytes
        lossless_min = min_budget(model, inputs, None, time_limit)
        rows = []
        controls: dict[int, float | None] = {}  # budget -> min SQNR of the lossless plan
        for fmt in formats:
            t0 = time.perf_counter()
            quant_min = min_budget(model, inputs, fmt, time_limit)
            share, plan = choose_budget(model, inputs, fmt, eager_peak, max(quant_min, lossless_min) * 1.01, time_limit)
            row = {"model": name, "format": fmt, "eager_peak": eager_peak, "min_budget_lossless": lossless_min,
                   "min_budget_quantize": quant_min}
            if plan is None:
                row.update(share=None, quantized=0, note="the solver quantizes nothing at any budget tried")
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            fp32_bytes, q_bytes = lossy_bytes(plan)
            per_step = sqnr_trajectory(model, inputs, plan, fmt, sqnr_steps)
            values = [v for s in per_step for v in s["sqnr"].values()]
            kept = [v for s in per_step for n, v in s["sqnr"].items() if n not in s["zero_grad"]]
            zero_grad = sorted({n for s in per_step for n in s["zero_grad"]})
            first = per_step[0]["sqnr"]
            row.update(
                share=share, budget=plan.budget_bytes, predicted_peak=plan.peak_bytes, solver=f"{plan.solver} ({plan.status})",
                recompute_flops=plan.recompute_flops, quantized=len(plan.lossy), lossy=plan.lossy,
                compressed=len(plan.compressed), quantized_fp32_bytes=fp32_bytes, quantized_bytes=q_bytes,
                sqnr_min=min(values), sqnr_median=statistics.median(values),
                sqnr_min_nonzero=min(kept), zero_grad_params=zero_grad,
                sqnr_min_per_step=[min(s["sqnr"].values()) for s in per_step],
                sqnr_median_per_step=[statistics.median(s["sqnr"].values()) for s in per_step],
                worst_param=min(first, key=first.get),
                worst_param_nonzero=min((n for n in first if n not in per_step[0]["zero_grad"]), key=first.get),
                n_params=len(first), sqnr_first_step=first,
                nan=any(math.isnan(v) for v in values),
                measured_peak=measured_peak(model, inputs, plan, fmt),
            )
            # The harness check: the same budget without quantization must give eager's gradients.
            if plan.budget_bytes not in controls:
                SOLVER_LOG.context = f"{name}, quantize=None, lossless control at {plan.budget_bytes} bytes"
                try:
                    plain = fxopt.plan(model, plan.budget_bytes, inputs, time_limit=time_limit)
                    controls[plan.budget_bytes] = min(sqnr_trajectory(model, inputs, plain, None, 1)[0]["sqnr"].values())
                except fxopt.InfeasibleBudgetError:
                    controls[plan.budget_bytes] = None  # only reachable with quantization
            row["lossless_control_sqnr_min"] = controls[plan.budget_bytes]
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "lossy"}), flush=True)
    return rows


# ---------------------------------------------------------------- convergence
def synthetic_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0, successors: int = 4):
    """``steps`` batches (tokens, targets) of a next-token task: the first half of every sequence
    walks a fixed sparse random Markov chain (``successors`` possible next tokens per token), the
    second half repeats the first. Only the last position's target is ignored (-100). The loss
    cannot go below about (half - 1) ln(successors) + ln(vocab), over seq - 1 targets (the walk's
    steps, and the copy's first token)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.stack([torch.randperm(vocab, generator=g)[:successors] for _ in range(vocab)])
    half = seq // 2
    out = []
    for _ in range(steps):
        walk = torch.empty(batch, half, dtype=torch.long)
        walk[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for t in range(1, half):
            pick = torch.randint(0, successors, (batch,), generator=g)
            walk[:, t] = table[walk[:, t - 1], pick]
        tokens = torch.cat([walk, walk], dim=1)[:, :seq]
        targets = torch.roll(tokens, -1, dims=1)
        targets[:, -1] = -100  # nothing follows the last token
        out.append((tokens, targets))
    return out


def convergence_model(vocab: int, seq: int, batch: int):
    torch.manual_seed(0)
    model, _ = gpt2(layers=2, dim=64, heads=4, seq=seq, batch=batch, vocab=vocab)
    # GPT-2's initialisation: torch's default N(0, 1) embeddings, tied to the output layer, start
    # the loss near 20 instead of ln(vocab).
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    return model


def train(model, batches, lr: float, seed: int = 1234) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for i, batch in enumerate(batches):
        torch.manual_seed(seed + i)  # same dropout masks for every run
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model(*batch))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def convergence(steps: int, formats, *, vocab: int = 128, seq: int = 64, batch: int = 16, lr: float = 3e-3,
                time_limit: float = 20.0) -> dict:
    base = convergence_model(vocab, seq, batch)
    SOLVER_LOG.model = "convergence GPT"
    batches = synthetic_batches(steps, batch, seq, vocab)
    example = batches[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SolverTimeoutWarning)
        eager_peak = fxopt.plan(base, 1.0, example, time_limit=time_limit).eager_peak_bytes
        lossless_min = min_budget(base, example, None, time_limit)
    runs = {}
    t0 = time.perf_counter()
    runs["fp32 (eager)"] = {"losses": train(copy.deepcopy(base), batches, lr), "seconds": time.perf_counter() - t0}
    common = None  # the share chosen for the first format, tried first for the others
    for fmt in formats:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SolverTimeoutWarning)
            share, plan = None, None
            if common is not None:
                share, plan = choose_budget(base, example, fmt, eager_peak, 0, time_limit, shares=(common,), tries=1)
            if plan is None:
                share, plan = choose_budget(base, example, fmt, eager_peak, lossless_min * 1.01, time_limit)
                common = common or share
        if plan is None:
            runs[fmt] = {"losses": None, "note": "the solver quantizes nothing at any budget tried"}
            continue
        model = fxopt.optimize(copy.deepcopy(base), plan.budget_bytes, plan=plan, quantize=fmt)
        losses = train(model, batches, lr)
        fp32_bytes, q_bytes = lossy_bytes(plan)
        runs[fmt] = {"losses": losses, "share": share, "budget": plan.budget_bytes, "predicted_peak": plan.peak_bytes,
                     "quantized": len(plan.lossy), "quantized_fp32_bytes": fp32_bytes, "quantized_bytes": q_bytes,
                     "lossy": plan.lossy, "seconds": time.perf_counter() - t0}
    reference = statistics.fmean(runs["fp32 (eager)"]["losses"][-FINAL_WINDOW:])
    for run in runs.values():
        if run["losses"] is not None:
            run["final_loss"] = statistics.fmean(run["losses"][-FINAL_WINDOW:])
            run["rel_diff"] = (run["final_loss"] - reference) / reference
            run["nan"] = any(math.isnan(v) for v in run["losses"])
    return {"steps": steps, "vocab": vocab, "seq": seq, "batch": batch, "lr": lr, "eager_peak": eager_peak,
            "min_budget_lossless": lossless_min, "runs": runs}


# ---------------------------------------------------------------- report
def plot(conv: dict, path: Path) -> None:
    """Loss curves (top) and each quantized run's loss minus fp32's (bottom), both smoothed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 10

    def smooth(values):
        return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    reference = conv["runs"]["fp32 (eager)"]["losses"]
    for label, run in conv["runs"].items():
        losses = run["losses"]
        if losses is None:
            continue
        steps = range(1, len(losses) + 1)
        fp32 = label.startswith("fp32")
        name = label if fp32 else f"{label} (budget {100 * run['share']:.0f}% of eager)"
        top.plot(steps, smooth(losses), label=name, linewidth=2.5 if fp32 else 1.0, color="black" if fp32 else None)
        if not fp32:
            bottom.plot(steps, smooth([q - r for q, r in zip(losses, reference)]), label=name, linewidth=1.0)
    top.set_ylabel(f"training loss ({window}-step mean)")
    top.set_title(f"2-layer GPT, synthetic Markov + copy task, {conv['steps']} AdamW steps:\n"
                  "fp32 eager vs fxopt with quantized activations", fontsize=11)
    top.legend()
    top.grid(alpha=0.3)
    bottom.axhline(0, color="black", linewidth=1)
    bottom.set_xlabel("training step")
    bottom.set_ylabel(f"loss − fp32 loss ({window}-step mean)")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _db(v) -> str:
    return "inf" if v == math.inf else f"{v:.1f}"


def markdown(rows: list[dict], conv: dict, meta: dict) -> str:
    lines = [
        "# Lossy activation compression: gradient SQNR and convergence",
        "",
        f"{meta_line(meta)} · 1 thread, {meta['seconds']:.0f} s in all.",
        "",
        "## Gradient SQNR against fp32 eager",
        "",
        f"Budget: of the shares {', '.join(f'{100 * s:.0f}%' for s in BUDGET_SHARES)} of the eager peak above the "
        "smallest feasible budget, the first three at which the plan quantizes something are planned, and the one "
        "quantizing the most bytes is used. SQNR: "
        f"`fxopt.gradient_sqnr` over every parameter gradient, at each of {meta['sqnr_steps']} AdamW steps of the "
        "eager model (the quantized module is given the eager parameters before each step; same seed, so the "
        "same dropout masks); min and median over all parameters and steps. Quantized: values the plan keeps "
        "quantized (`plan.lossy`), their fp32 size → quantized size. Measured: one real step, "
        "`fxopt.measure_peak`, gradients freed first. Lossless control: the same budget planned without "
        "`quantize`, one step; inf means bit-identical gradients (the harness compares like with like).",
        "",
        "| model | format | eager MiB | min budget MiB (lossless / quantize) | budget | quantized | MiB fp32 → quantized | "
        "predicted MiB | measured MiB | ≤ budget | SQNR min dB | SQNR min dB, zero-gradient params left out | "
        "SQNR median dB | worst parameter (left out) | lossless control |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        head = (f"| {r['model']} | {r['format']} | {r['eager_peak'] / MiB:.2f} | "
                f"{r['min_budget_lossless'] / MiB:.2f} / {r['min_budget_quantize'] / MiB:.2f} | ")
        if r["share"] is None:
            lines.append(head + f"— | **0: {r['note']}** | | | | | | | | | |")
            continue
        control = r["lossless_control_sqnr_min"]
        worst = r["worst_param_nonzero"] + (f" ({r['worst_param']})" if r["worst_param"] != r["worst_param_nonzero"] else "")
        lines.append(
            head + f"{r['budget'] / MiB:.2f} ({100 * r['share']:.0f}%) | {r['quantized']} of {r['compressed']} compressed | "
            f"{r['quantized_fp32_bytes'] / MiB:.2f} → {r['quantized_bytes'] / MiB:.2f} | {r['predicted_peak'] / MiB:.2f} | "
            f"{r['measured_peak'] / MiB:.2f} | {'yes' if r['measured_peak'] <= r['budget'] else '**NO**'} | "
            f"{_db(r['sqnr_min'])} | {_db(r['sqnr_min_nonzero'])} | {_db(r['sqnr_median'])} | {worst} | "
            + ("not feasible" if control is None else _db(control)) + " |")
    nans = [f"{r['model']} / {r['format']}" for r in rows if r.get("nan")]
    lines += ["", "NaN in a gradient: " + (", ".join(nans) if nans else "none") + "."]
    zero = sorted({(r["model"], p) for r in rows if r["share"] is not None for p in r["zero_grad_params"]})
    if zero:
        lines += ["", f"Zero-gradient parameters (eager gradient norm < {ZERO_GRAD:g} × the median parameter's; their "
                  "gradient is rounding noise around an exact zero, so its SQNR is meaningless): "
                  + ", ".join(f"{m}: `{p}`" for m, p in zero) + "."]
    lines += ["", "Quantized values per row:", ""]
    for r in rows:
        if r["share"] is not None:
            lines.append(f"- {r['model']} / {r['format']}: " + ", ".join(f"`{k}`" for k in r["lossy"]))
    lines += ["", "SQNR min per step (dB, all parameters):", ""]
    for r in rows:
        if r["share"] is not None:
            lines.append(f"- {r['model']} / {r['format']}: " + ", ".join(_db(v) for v in r["sqnr_min_per_step"]))
    low = [r for r in rows if r["share"] is not None and r["sqnr_min_nonzero"] < SQNR_TARGET_DB]
    if low:
        lines += ["", f"Below {SQNR_TARGET_DB:.0f} dB (zero-gradient parameters left out): "
                  + "; ".join(f"{r['model']} / {r['format']} {_db(r['sqnr_min_nonzero'])} dB (`{r['worst_param_nonzero']}`)"
                              for r in low) + "."]
    tb = [r for r in rows if r["model"] == "transformer_block" and r["format"] == "int8" and r["share"] is not None]
    if tb:
        ok = tb[0]["sqnr_min"] >= SQNR_TARGET_DB and not tb[0]["nan"]
        lines += ["", f"Issue 6 target, int8 on the transformer block, every parameter gradient ≥ {SQNR_TARGET_DB:.0f} dB: "
                  f"{'met' if ok else '**not met**'} (min {_db(tb[0]['sqnr_min'])} dB)."]
    runs = conv["runs"]
    lines += [
        "",
        "## Convergence",
        "",
        f"`gpt2(layers=2, dim=64, heads=4, vocab={conv['vocab']}, seq={conv['seq']}, batch={conv['batch']})`, dropout 0.1, "
        f"AdamW (lr {conv['lr']:g}, weight decay 0.01), {conv['steps']} steps, a fresh batch each step. Task: the first "
        "half of each sequence walks a fixed random Markov chain (4 successors per token, uniform), the second half "
        "repeats the first; the loss counts every target but the last, and cannot go below "
        f"{((conv['seq'] // 2 - 1) * math.log(4) + math.log(conv['vocab'])) / (conv['seq'] - 1):.2f} (the walk's "
        "entropy; the copy is deterministic but for its first token). Every run starts from the same weights "
        "(deepcopy) with the same batches and the same seed per step. Final loss: mean of the last "
        f"{FINAL_WINDOW} steps. Budget: chosen as above for the first format, the same share for the others where "
        f"they quantize there (eager peak {conv['eager_peak'] / MiB:.2f} MiB, smallest "
        f"lossless budget {conv['min_budget_lossless'] / MiB:.2f} MiB).",
        "",
        "| run | budget | quantized | MiB fp32 → quantized | final loss | vs fp32 | within 2% | time s |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label, run in runs.items():
        if run["losses"] is None:
            lines.append(f"| {label} | — | **0: {run['note']}** | | | | | |")
            continue
        if label.startswith("fp32"):
            lines.append(f"| {label} | | | | {run['final_loss']:.4f} | | | {run['seconds']:.0f} |")
            continue
        lines.append(
            f"| {label} | {run['budget'] / MiB:.2f} MiB ({100 * run['share']:.0f}%) | {run['quantized']} | "
            f"{run['quantized_fp32_bytes'] / MiB:.2f} → {run['quantized_bytes'] / MiB:.2f} | {run['final_loss']:.4f} | "
            f"{100 * run['rel_diff']:+.2f}% | {'yes' if abs(run['rel_diff']) <= INT8_TARGET else 'no'} | {run['seconds']:.0f} |")
    int8 = runs.get("int8")
    if int8 and int8["losses"] is not None:
        ok = abs(int8["rel_diff"]) <= INT8_TARGET
        lines += ["", f"Issue 6 target, int8 within 2% of the fp32 loss: {'met' if ok else '**not met**'} "
                  f"({100 * int8['rel_diff']:+.2f}%)."]
    lines += ["", "![loss curves](quantize_quality.png)", ""]
    if meta.get("solver_log"):
        lines += ["## fxopt warnings during the run", ""] + [f"- {r}" for r in meta["solver_log"]] + [""]
    return "\n".join(lines)


def _strict(value):
    """``value`` with infinite and NaN floats as strings, so the file is standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="convergence training steps")
    parser.add_argument("--sqnr-steps", type=int, default=3, help="steps of the SQNR trajectory per model and format")
    parser.add_argument("--models", nargs="*", default=list(SQNR_MODELS))
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    meta = run_meta(" ".join(["python -m benchmarks.quantize_quality", *(sys.argv[1:] if argv is None else argv)]),
                    sqnr_steps=args.sqnr_steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("fxopt").addHandler(SOLVER_LOG)
    t0 = time.perf_counter()
    try:
        rows = [r for name in args.models for r in sqnr_rows(name, args.formats, args.sqnr_steps, args.time_limit)]
        conv = convergence(args.steps, args.formats, time_limit=2 * args.time_limit)
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("fxopt").removeHandler(SOLVER_LOG)
    for label, run in conv["runs"].items():
        print(label, {k: v for k, v in run.items() if k not in ("losses", "lossy")}, flush=True)
    meta.update(solver_log=SOLVER_LOG.records, seconds=time.perf_counter() - t0)
    write_results(args.out / "quantize_quality", _strict({"meta": meta, "sqnr": rows, "convergence": conv}),
                  markdown(rows, conv, meta))
    plot(conv, args.out / "quantize_quality.png")


if __name__ == "__main__":
    main()
