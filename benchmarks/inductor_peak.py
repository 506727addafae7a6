"""fxopt + Inductor at transformers' own gradient checkpointing's measured peak: the peak the
plan predicts against the one the compiled step measures (issue 24, item 2).

    python -m benchmarks.inductor_peak [--models hf-llama,hf-gpt2] [--seq 256] [--batch 8]
                                       [--out benchmarks/results/inductor_peak]

Per model (`benchmarks.hf_zoo` at its "bench" size, sequence length and batch as given, random
weights, dropout 0, one torch thread): eager's measured peak; HF checkpointing's (every layer
under `torch.utils.checkpoint`); then `fxopt.optimize(..., budget=<HF's peak>,
compiler="inductor")`: the plan's predicted peak and the compiled step's measured peak (its
second call; the first compiles). The budget holds when measured <= predicted <= budget.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys

import torch

import fxopt
from benchmarks import hf_zoo
from benchmarks.harness import meta_line, mib, run_rows
from fxopt.models import MODELS

DEFAULT_MODELS = ("hf-llama", "hf-gpt2")


def _step(model, inputs):
    loss = model(*inputs)
    loss.backward()
    return loss


def _peak(model, inputs) -> int:
    model.zero_grad(set_to_none=True)
    return fxopt.measure_peak(_step, model, inputs, resident=[model, inputs]).peak_bytes


def row(name: str) -> dict:
    torch.manual_seed(0)
    model, inputs = MODELS[name]("bench")
    checkpointed = copy.deepcopy(model)
    MODELS[name].checkpointing(checkpointed, True)
    budget = _peak(checkpointed, inputs)
    optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, compiler="inductor")
    _step(optimized, inputs)  # compiles
    measured = _peak(optimized, inputs)
    plan = optimized.plan
    return {"model": name, "eager": _peak(copy.deepcopy(model), inputs), "budget": budget,
            "predicted": plan.peak_bytes, "measured": measured, "solver": plan.solver, "status": plan.status,
            "holds": measured <= plan.peak_bytes <= budget}


def markdown(result: dict) -> str:
    lines = ["# fxopt + Inductor at HF checkpointing's measured peak", "", meta_line(result["meta"]), "",
             "| model | eager | HF checkpointing = budget | fxopt + Inductor predicted | measured | holds |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} | | | | |")
        else:
            lines.append(f"| {r['model']} | {mib(r['eager'])} | {mib(r['budget'])} | {mib(r['predicted'])} | "
                         f"{mib(r['measured'])} | {'yes' if r['holds'] else '**no**'} |")
    return "\n".join(lines + ["", "Peaks in MiB (`fxopt.measure_peak`)."])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo names")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--out", default="benchmarks/results/inductor_peak", help="results path, without suffix")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    hf_zoo.TEXT["bench"] = dict(hf_zoo.TEXT["bench"], seq=args.seq, batch=args.batch)
    command = "python -m benchmarks.inductor_peak " + shlex.join(sys.argv[1:] if argv is None else argv)
    return run_rows(command.strip(), [n.strip() for n in args.models.split(",")], row, args.out, markdown)


if __name__ == "__main__":
    main()
