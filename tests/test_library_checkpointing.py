"""fxopt against the checkpointing a library's users already have (issue 24, item 4): at the
peak the library's own checkpointing measures, fxopt's plan measures within that budget, its
gradients are eager's, and it recomputes no more FLOPs (counted by
``torch.utils.flop_counter.FlopCounterMode``) than the library's checkpointing does.

On a diffusers UNet (long skip connections: no value cuts the forward in two) fxopt's plans at
diffusers' checkpointing peak recomputed more than diffusers does (here 0.598 GFLOP against
0.420, Chen's segments; about four times as much on a larger UNet), or found none;
`fxopt.solvers.policies` offers the library's own policy (checkpoint each repeated block) as a
candidate.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxopt.models import MODELS
from helpers import assert_same_step, measured_peak, run_pair, step


def _flops(module, inputs) -> int:
    module.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        step(module, inputs)
    module.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.slow
@pytest.mark.parametrize("name,library", [("lib-unet", "diffusers"), ("hf-llama", "transformers")])
def test_no_more_recomputation_than_the_librarys_checkpointing(name, library):
    pytest.importorskip(library)
    import benchmarks.library_zoo  # noqa: F401 - registers the library models (and the transformers ones)

    entry = MODELS[name]
    torch.manual_seed(0)
    model, inputs = entry("test")
    eager_flops = _flops(model, inputs)
    checkpointed = copy.deepcopy(model)
    entry.checkpointing(checkpointed, True)
    budget = measured_peak(checkpointed, inputs)
    library_extra = _flops(checkpointed, inputs) - eager_flops
    assert library_extra > 0

    eager, optimized, loss_e, loss_o = run_pair(model, inputs, budget)
    assert_same_step(eager, optimized, loss_e, loss_o)
    assert optimized.plan.peak_bytes <= budget
    measured = measured_peak(optimized, inputs)
    fxopt_extra = _flops(optimized, inputs) - eager_flops
    assert fxopt_extra == optimized.plan.recompute_flops
    assert fxopt_extra <= library_extra, (
        f"fxopt's plan ({optimized.plan.solver}) recomputes {fxopt_extra / 1e9:.3f} GFLOP at "
        f"{library}'s checkpointing peak, which recomputes {library_extra / 1e9:.3f}")
    assert measured <= budget
