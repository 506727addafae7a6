"""Every zoo model at 100%, 60% and 40% of its eager peak: the measured peak stays within the
budget and the step (loss, every gradient, BatchNorm statistics, dropout masks) equals eager's;
or the budget is below the smallest fxopt can reach, and that smallest budget works."""

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


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_budget_and_parity(name, fraction):
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    try:
        eager, optimized, loss_e, loss_o = run_pair(model, inputs, fraction, time_limit=TIME_LIMIT)
    except fxopt.InfeasibleBudgetError as err:
        plan = fxopt.plan(model, 1.0, inputs)
        budget = int(fraction * plan.eager_peak_bytes)
        assert err.budget == budget
        assert err.min_budget > budget
        assert str(err.min_budget) in str(err)
        # The smallest budget fxopt names is one it can keep.
        eager, optimized, loss_e, loss_o = run_pair(model, inputs, err.min_budget, time_limit=TIME_LIMIT)
    plan = optimized.plan
    assert plan.peak_bytes <= plan.budget_bytes
    assert_same_step(eager, optimized, loss_e, loss_o)
    measured = measured_peak(optimized, inputs)
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
    torch.manual_seed(0)
    model, inputs = ZOO[name]()
    with pytest.raises(fxopt.InfeasibleBudgetError) as info:
        fxopt.plan(model, 100, inputs, time_limit=TIME_LIMIT)
    eager, optimized, loss_e, loss_o = run_pair(model, inputs, info.value.min_budget, time_limit=TIME_LIMIT)
    assert_same_step(eager, optimized, loss_e, loss_o)
    assert optimized.plan.recomputed, "a minimal-memory plan must recompute something"
    assert measured_peak(optimized, inputs) < measured_peak(eager, inputs)
