"""Every zoo model at 100%, 60% and 40% of its eager peak: the measured peak stays within the
budget and the step (loss, every gradient, BatchNorm statistics, dropout masks) equals eager's;
or the budget is below the smallest fxopt can reach, and that smallest budget works.

A model's step at a budget its tests share (`_run`: at the smallest budget, which 60%, 40% and
the smallest a 100-byte budget names often are, it is planned, run and measured once), and so
is its plan at 100% (`_eager_peak`)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from fxopt.solvers import DEFAULT_TIME_LIMIT
import fxopt
from fxopt.models import ZOO
from helpers import assert_same_step, measured_peak, run_pair

FRACTIONS = [1.0, 0.6, 0.4]
# The solvers' safety stop, the default: their effort is counted, so the plans here (and the
# budgets fxopt names) are the same on a busy machine as on a quiet one.
TIME_LIMIT = DEFAULT_TIME_LIMIT


@pytest.fixture(autouse=True, scope="module")
def _release_shared_runs():
    """The shared plans and steps live as long as this module's tests."""
    yield
    for cached in (_run, _eager_peak):
        cached.cache_clear()


def _model(name: str):
    torch.manual_seed(0)
    return ZOO[name]()


@dataclasses.dataclass
class Run:
    """One step of a zoo model through fxopt at a budget, next to eager's (`run_pair`)."""

    plan: fxopt.Plan
    parity_error: str | None  # assert_same_step's message, None when the steps are equal
    measured: int  # fxopt's step's measured peak
    eager_measured: int  # eager's


@functools.cache
def _run(name: str, budget: float | int) -> Run:
    """``name``'s step through fxopt at ``budget`` (raises `fxopt.InfeasibleBudgetError` where
    nothing fits: not kept), checked against eager's and measured."""
    model, inputs = _model(name)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, budget, time_limit=TIME_LIMIT)
    try:
        assert_same_step(eager, optimized, loss_e, loss_o)
        parity_error = None
    except AssertionError as e:
        parity_error = str(e)
    return Run(optimized.plan, parity_error, measured_peak(optimized, inputs), measured_peak(eager, inputs))


@functools.cache
def _eager_peak(name: str) -> int:
    model, inputs = _model(name)
    return fxopt.plan(model, 1.0, inputs).eager_peak_bytes


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_budget_and_parity(name, fraction):
    try:
        run = _run(name, fraction)
    except fxopt.InfeasibleBudgetError as err:
        budget = int(fraction * _eager_peak(name))
        assert err.budget == budget
        assert err.min_budget > budget
        assert str(err.min_budget) in str(err)
        # The smallest budget fxopt names is one it can keep.
        run = _run(name, err.min_budget)
    plan = run.plan
    assert plan.peak_bytes <= plan.budget_bytes
    assert run.parity_error is None, run.parity_error
    measured = run.measured
    assert measured <= plan.budget_bytes, (measured, plan.budget_bytes)
    # The simulator predicts the generated code: never below what is measured, and within 5% of
    # it once the incoming gradients are set aside: they are counted at full size, but a loss
    # taken outside the model (output.sum()) hands the backward a stride-0 expand of a scalar.
    tangent_bytes = sum(n.bytes for n in plan.graph.nodes if n.tangent)
    assert measured <= plan.peak_bytes
    assert plan.peak_bytes - tangent_bytes - measured <= 0.05 * measured, (plan.peak_bytes, measured)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_recompute_lowers_peak(name):
    """At the smallest budget each model reaches, the plan recomputes and the measured peak is
    below eager's measured peak."""
    model, inputs = _model(name)
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, 100, inputs, time_limit=TIME_LIMIT)
    run = _run(name, info.value.min_budget)
    assert run.parity_error is None, run.parity_error
    assert run.plan.recomputed, "a minimal-memory plan must recompute something"
    assert run.measured < run.eager_measured
