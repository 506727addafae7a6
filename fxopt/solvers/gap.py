"""How far a plan may be from optimal: the gap between its cost and a proven lower bound.

One definition for every solver, progress report and `Plan`:

    gap(cost, bound) = (cost - bound) / cost        0 when cost - bound <= COST_TOLERANCE

so 0 means proven optimal and 0.05 means at most 5 % of the cost could still be saved. A plan is
proven (good enough to stop searching) when its gap is at most the solver's relative target.
The tolerance only absorbs floating-point rounding: a cost and a bound computed in different
orders, or scaled back from a MIP's units, may differ in their last digits. It is not a saving
too small to matter: a plan whose cost is a few ops above a bound of zero is 100 % from it.
"""

from __future__ import annotations

COST_TOLERANCE = 1e-12  # in the units of the costs (the cost model's seconds, or a MIP objective)


def gap(cost: float | None, bound: float | None) -> float | None:
    """(cost - bound) / cost, 0 within `COST_TOLERANCE`; None when either is unknown, or the cost is
    not positive while the bound is below it (no relative gap to speak of)."""
    if cost is None or bound is None:
        return None
    if cost - bound <= COST_TOLERANCE:
        return 0.0
    if cost <= 0:
        return None
    return (cost - bound) / cost


def proven(cost: float | None, bound: float | None, rel_gap: float) -> bool:
    """Whether ``cost`` is proven within ``rel_gap`` of the optimum by ``bound``."""
    found = gap(cost, bound)
    return found is not None and found <= rel_gap
