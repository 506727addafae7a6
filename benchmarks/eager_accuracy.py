"""The eager peak fxopt predicts against the one measured, and fxopt at 100% against eager, on
library models (issue 24, items 11 and 3).

    python -m benchmarks.eager_accuracy [--suites hf_zoo,issue,breadth,library] [--models NAMES]
                                        [--out benchmarks/results/eager_accuracy]

A fractional budget is a share of the eager peak fxopt predicts (`fxopt.Plan.eager_peak_bytes`),
and every "% below eager" it prints is against it, so that prediction must be the peak eager
measures: never below it, and within `AIM` above. Per model (random weights, dropout 0, one
torch thread):

- eager measured: one eager step's measured peak (`fxopt.measure_peak`: parameters, buffers,
  inputs and gradients counted; gradients freed before it);
- eager predicted: the eager peak of the plan fxopt makes at ``budget=1.0`` (its first call);
  ratio: predicted / measured;
- fxopt at 100%: the measured peak of that module's second step; it must not be above eager's.

Suites: ``hf_zoo`` (`benchmarks.hf_zoo` at its "bench" size: 2 layers, hidden 128, 4×128 tokens
or 8 64-pixel images), ``issue`` (the Gemma and OPT issue 24 names, at that size), ``breadth``
(`benchmarks.hf_breadth`'s 45 architectures, smaller), ``library`` (the ``"library"`` set of the one
zoo, `benchmarks.library_zoo` at its "bench" size: diffusers, timm where it imports, torchtitan). Writes ``<out>.json`` after every row and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import fxopt
from benchmarks.harness import meta_line, mib, run_rows

AIM = 0.03  # predicted eager peak at most this share above the measured one, never below

Builder = Callable[[], tuple[nn.Module, tuple]]


def _hf_zoo() -> dict[str, Builder]:
    from benchmarks.hf_zoo import HF_NAMES  # (importing it registers the ``hf-<name>`` models)
    from fxopt.models import MODELS

    return {name: (lambda name=name: MODELS[f"hf-{name}"]("bench")) for name in HF_NAMES}


def _issue() -> dict[str, Builder]:
    """Gemma and OPT as issue 24 measured them: 2 layers, width 128, 4×128 tokens."""
    from benchmarks import hf_zoo

    def gemma():
        hf, named = hf_zoo._llama_like("GemmaConfig", "GemmaForCausalLM", "bench", 0.0)
        return hf_zoo.HFLoss(hf, tuple(named)).train(), tuple(named.values())

    def opt():
        t, c = hf_zoo._transformers(), hf_zoo.TEXT["bench"]
        cfg = t.OPTConfig(num_hidden_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"],
                          ffn_dim=c["ffn"], vocab_size=c["vocab"], max_position_embeddings=c["seq"],
                          word_embed_proj_dim=c["hidden"], use_cache=False, dropout=0.0, attention_dropout=0.0)
        inputs = hf_zoo._text_inputs(c)
        named = {**inputs, "labels": hf_zoo._lm_labels(inputs)}
        return hf_zoo.HFLoss(t.OPTForCausalLM(cfg), tuple(named)).train(), tuple(named.values())

    return {"gemma_bench": gemma, "opt_bench": opt}


def _breadth() -> dict[str, Builder]:
    from benchmarks.hf_breadth import ARCHITECTURES
    from benchmarks.hf_zoo import HFLoss

    def wrapped(build):
        def make():
            hf, batch = build()
            return HFLoss(hf, tuple(batch)).train(), tuple(batch.values())
        return make

    return {f"breadth_{name}": wrapped(build) for name, build in ARCHITECTURES.items()}


def _library() -> dict[str, Builder]:
    import benchmarks.library_zoo  # noqa: F401 - registers the "library" set
    from fxopt.models import MODELS, zoo

    return {name: (lambda name=name: MODELS[name]("bench")) for name in zoo("library")}


SUITES: dict[str, Callable[[], dict[str, Builder]]] = {
    "hf_zoo": _hf_zoo, "issue": _issue, "breadth": _breadth, "library": _library,
}


def _step(model: nn.Module, inputs: tuple) -> torch.Tensor:
    loss = model(*inputs)
    loss.backward()
    return loss


def _measured(model: nn.Module, inputs: tuple) -> int:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    return fxopt.measure_peak(_step, model, inputs, resident=[model, inputs]).peak_bytes


def bench(name: str, build: Builder) -> dict[str, Any]:
    torch.manual_seed(0)
    model, inputs = build()
    _step(model, inputs)  # once first: HF's classifiers set config.problem_type at their first call
    eager = _measured(copy.deepcopy(model), inputs)
    optimized = fxopt.optimize(copy.deepcopy(model), 1.0)
    _measured(optimized, inputs)  # the first call plans
    at_full = _measured(optimized, inputs)
    plans = optimized.plans
    if len(plans) != 1:  # a step in pieces: each piece's eager peak is of that piece alone
        return {"model": name, "error": f"captured in {len(plans)} pieces: no eager peak of the whole step"}
    predicted = plans[0].eager_peak_bytes
    ratio = predicted / eager
    return {"model": name, "eager_measured": eager, "eager_predicted": predicted, "ratio": ratio,
            "fxopt_at_full": at_full, "within_aim": 1.0 <= ratio <= 1.0 + AIM, "not_above_eager": at_full <= eager,
            "nodes": len(plans[0].graph.nodes)}


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    done = [r for r in rows if "error" not in r]
    within = sum(r["within_aim"] for r in done)
    held = sum(r["not_above_eager"] for r in done)
    worst = max(done, key=lambda r: abs(r["ratio"] - 1), default=None)
    lines = ["# Predicted against measured eager peak, and fxopt at 100% against eager", "",
             meta_line(result["meta"]), "",
             f"**{within} of {len(done)} models predicted within [1, {1 + AIM:g}]× of the measured eager peak**; "
             f"fxopt at 100% measured at or below eager on {held} of {len(done)}"
             + (f"; furthest: {worst['model']} at {worst['ratio']:.3f}×" if worst else "")
             + (f"; {len(rows) - len(done)} not run (below)" if len(done) < len(rows) else "") + ". Peaks in MiB.", "",
             "| model | eager measured | eager predicted | predicted / measured | fxopt at 100% measured | ≤ eager | nodes |",
             "|---|---:|---:|---:|---:|:---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | | | | | {r['error']} |")
            continue
        flag = "" if r["within_aim"] else " **(outside)**"
        lines.append(f"| {r['model']} | {mib(r['eager_measured'])} | {mib(r['eager_predicted'])} | {r['ratio']:.3f}{flag} | "
                     f"{mib(r['fxopt_at_full'])} | {'yes' if r['not_above_eager'] else '**NO**'} | {r['nodes']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, of {', '.join(SUITES)}")
    parser.add_argument("--models", help="comma-separated names within the suites (default: all)")
    parser.add_argument("--out", default="benchmarks/results/eager_accuracy")
    args = parser.parse_args(argv)
    unknown = set(args.suites.split(",")) - set(SUITES)
    if unknown:
        parser.error(f"unknown suites {sorted(unknown)}; choose from {', '.join(SUITES)}")
    builders = {k: v for s in args.suites.split(",") for k, v in SUITES[s]().items()}
    names = args.models.split(",") if args.models else list(builders)
    if set(names) - set(builders):
        parser.error(f"unknown models {sorted(set(names) - set(builders))}; choose from {', '.join(builders)}")
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_rows("python -m benchmarks.eager_accuracy " + shlex.join(argv or sys.argv[1:]), names,
             lambda name: bench(name, builders[name]), out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
