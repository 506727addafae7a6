"""Measured vs predicted vs budget at the smallest budget fxopt names, for a small vision
transformer from `transformers` (random weights, no download) or fxopt's residual MLP.

    python -m benchmarks.budget_edge deit --solvers instant,auto --hidden 128 --layers 2 \
        --image 64 --patch 8 --batch 4

Prints one row per solver: status, measured, predicted and budget (bytes), measured - predicted.
Issue 11 reported a plan measured above its prediction at such a budget.
"""

from __future__ import annotations

import argparse
import copy

import torch

import fxopt
from fxopt.models import loss_of
from fxopt.solvers.effort import DEFAULT_TIME_LIMIT

VISION = {
    "deit": ("DeiTConfig", "DeiTForImageClassification"),
    "vit": ("ViTConfig", "ViTForImageClassification"),
    "beit": ("BeitConfig", "BeitForImageClassification"),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification"),
    "data2vec": ("Data2VecVisionConfig", "Data2VecVisionForImageClassification"),
}


class _Loss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixels, labels):
        return self.model(pixel_values=pixels, labels=labels).loss


def build(name: str, args) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    if name == "residual_mlp":
        from fxopt.models import residual_mlp

        return residual_mlp(blocks=3, width=32, batch=64)
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in VISION[name])
    config = config_cls(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=2,
                        intermediate_size=2 * args.hidden, image_size=args.image, patch_size=args.patch,
                        num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="eager")
    pixels = torch.randn(args.batch, 3, args.image, args.image)
    return _Loss(model_cls(config)).train(), (pixels, torch.randint(0, 10, (args.batch,)))


def _step(model, inputs):
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", choices=["residual_mlp", *VISION])
    p.add_argument("--solvers", default="instant")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--compiler", default="eager", choices=["eager", "inductor"])
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help="fxopt's time_limit, a safety stop in seconds (default fxopt's): counted effort decides the plan")
    args = p.parse_args()
    model, inputs = build(args.model, args)
    for solver in args.solvers.split(","):
        try:
            fxopt.plan(model, 1, inputs, solver=solver, compiler=args.compiler, time_limit=args.time_limit)
            raise SystemExit("a 1-byte budget planned")
        except fxopt.InfeasibleBudgetError as err:
            budget = err.min_budget
        optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs, solver=solver,
                                   compiler=args.compiler, time_limit=args.time_limit)
        plan = optimized.plan
        # The first call compiles, and Dynamo keeps a few bytes from compiling (two 8-byte tensors
        # on the HF vision models): not the step's memory, so measure a compiled step.
        _step(optimized, inputs)
        optimized.zero_grad(set_to_none=True)
        measured = fxopt.measure_peak(_step, optimized, inputs, resident=[optimized, inputs]).peak_bytes
        print(f"{args.model} {solver} ({plan.status}): measured {measured} predicted {plan.peak_bytes} "
              f"budget {plan.budget_bytes} measured-predicted {measured - plan.peak_bytes:+d}", flush=True)


if __name__ == "__main__":
    main()
