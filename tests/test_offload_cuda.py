"""OFFLOAD on a CUDA device: the copies' streams, events and pinned arena; the budget measured.
Skipped without CUDA (the CPU side of the same code: tests/test_offload_runtime.py)."""

import copy

import pytest
import torch

import fxopt
from fxopt.models import ZOO
from fxopt.ops.offload import HostCopies, extent_bytes
from helpers import step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_copies_round_trip_on_side_streams_into_one_pinned_arena():
    x = torch.randn(256, 129, device="cuda").t()  # non-contiguous: strides kept
    copies = HostCopies([extent_bytes(x.shape, x.stride(), x.element_size())])
    for _ in range(3):
        host = copies.offload(x, 0)
        assert host.device.type == "cpu" and host.is_pinned()
        back = copies.wait(copies.reload(host, 0, x.device), 0)
        assert back.stride() == x.stride() and torch.equal(back, x)
    assert len(copies.arenas) == 1
    streams = {key[0] for key in copies.streams}
    assert streams == {"d2h", "h2d"}


def _plan_at_half_or_smallest(model, inputs):
    """The plan with OFFLOAD at half the eager peak, or at the smallest budget fxopt can keep
    where half is below it: feasible by construction, so the test always runs the step."""
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, 1, inputs, offload=True)  # one byte: below anything, names the smallest
    smallest = fxopt.plan(model, info.value.min_budget, inputs, offload=True)
    half = smallest.eager_peak_bytes // 2
    return smallest if half <= smallest.budget_bytes else fxopt.plan(model, half, inputs, offload=True)


def test_offloaded_step_is_exact_and_within_budget_on_cuda():
    torch.manual_seed(0)
    model, inputs = ZOO["gpt2_tiny"]()
    model, inputs = model.cuda(), tuple(t.cuda() for t in inputs)
    eager = copy.deepcopy(model)
    plan = _plan_at_half_or_smallest(model, inputs)
    assert plan.offloaded, "the plan offloads nothing: the test would check no copy"
    optimized = fxopt.optimize(copy.deepcopy(model), plan.budget_bytes, plan=plan)
    torch.manual_seed(1)
    step(optimized, inputs)  # warm-up: allocates the arena
    optimized.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss_e = step(eager, inputs)
    torch.manual_seed(1)
    peak = fxopt.measure_peak(step, optimized, inputs)
    torch.testing.assert_close(peak.result, loss_e)
    for p_e, p_o in zip(eager.parameters(), optimized.parameters()):
        torch.testing.assert_close(p_o.grad, p_e.grad)
    assert peak.peak_bytes <= plan.budget_bytes
