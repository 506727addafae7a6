"""Shared by the end-to-end tests: run a training step eagerly and through fxopt, compare."""

from __future__ import annotations

import copy

import torch

import fxopt
from fxopt.models import loss_of


def step(model, inputs):
    loss = loss_of(model(*inputs))
    loss.backward()
    return loss


def run_pair(model, inputs, budget, seed=1, plan_now=True, **kwargs):
    """Eager and fxopt copies of `model`, one step each under the same seed.
    Returns (eager_model, fxopt_module, eager_loss, fxopt_loss). ``plan_now=False``: plan at the
    first call rather than from example inputs (the step is captured once instead of twice)."""
    eager = copy.deepcopy(model)
    optimized = fxopt.optimize(copy.deepcopy(model), budget, example_inputs=inputs if plan_now else None, **kwargs)
    torch.manual_seed(seed)
    loss_e = step(eager, inputs)
    torch.manual_seed(seed)
    loss_o = step(optimized, inputs)
    return eager, optimized, loss_e, loss_o


def assert_same_step(eager, optimized, loss_e, loss_o):
    torch.testing.assert_close(loss_o, loss_e)
    for (name, p_e), (_, p_o) in zip(eager.named_parameters(), optimized.named_parameters()):
        assert (p_e.grad is None) == (p_o.grad is None), name
        if p_e.grad is not None:
            torch.testing.assert_close(p_o.grad, p_e.grad, msg=lambda m: f"grad of {name}: {m}")
    for (name, b_e), (_, b_o) in zip(eager.named_buffers(), optimized.named_buffers()):
        torch.testing.assert_close(b_o, b_e, msg=lambda m: f"buffer {name}: {m}")


def measured_peak(module, inputs, step_fn=step) -> int:
    """Measured peak of one step (``step_fn(module, inputs)``), gradients freed before it (see
    fxopt.measure_peak)."""
    module.zero_grad(set_to_none=True)
    return fxopt.measure_peak(step_fn, module, inputs, resident=[module, inputs]).peak_bytes


def masked_mlp(relu: bool):
    """(model, inputs): a 3-layer MLP whose activations' outputs only their own backward reads
    (each is scaled before the next layer): with ``relu`` ReLUs, which `fxopt.passes.masks`
    masks under compression; else GELUs, which it leaves alone."""
    import torch.nn as nn

    class Scaled(nn.Module):
        def forward(self, x):
            return 2.0 * x

    torch.manual_seed(0)
    act = nn.ReLU if relu else nn.GELU
    model = nn.Sequential(nn.Linear(64, 256), act(), Scaled(), nn.Linear(256, 256), act(), Scaled(), nn.Linear(256, 8))
    return model, (torch.randn(256, 64),)


def count_analyses(monkeypatch) -> list:
    """A list that grows by one at each analysis the planner runs (`fxopt.planner.analyze_step`)."""
    import fxopt.planner as planner

    calls = []
    analyze = planner.analyze_step
    monkeypatch.setattr(planner, "analyze_step", lambda *a, **k: calls.append(1) or analyze(*a, **k))
    return calls
