"""fxopt's exceptions. Torch-free, so the solvers can raise them."""

from __future__ import annotations

from fxopt.units import format_bytes


class FxoptError(Exception):
    """Base class of fxopt's errors."""


class InfeasibleBudgetError(FxoptError, ValueError):
    """No schedule fxopt can build stays within the budget. ``min_budget`` (bytes) is the smallest
    peak that fxopt found achievable for this step: planning at it succeeds (unless ``exact`` is
    False: then it is only a bound fxopt knows the step needs, and the message says "at least").
    ``lower_bound`` (bytes, or None): a peak no schedule of this step can go below (proven), so
    that a budget under it is out of reach whatever the solver; between it and ``min_budget`` more
    solver effort may find a plan."""

    def __init__(self, budget: int, min_budget: int, detail: str = "", lower_bound: int | None = None,
                 exact: bool = True):
        self.budget = budget
        self.min_budget = min_budget
        self.lower_bound = lower_bound
        self.exact = exact
        msg = f"no schedule of this training step fits in {format_bytes(budget)}; "
        if exact:
            msg += f"the smallest feasible budget fxopt found is {format_bytes(min_budget)} ({min_budget} bytes)"
        else:
            msg += f"fxopt needs at least {format_bytes(min_budget)} ({min_budget} bytes)"
        if lower_bound is not None and lower_bound >= min_budget:
            msg += ", the least any schedule of this step can peak at"
        elif lower_bound is not None:
            msg += f" (no schedule can peak below {format_bytes(lower_bound)})"
        msg += ". Raise the budget to at least that, or reduce the batch size."
        self.detail = detail
        super().__init__(msg + (f" {detail}" if detail else ""))

    def __reduce__(self):
        return (type(self), (self.budget, self.min_budget, self.detail, self.lower_bound, self.exact))

    def with_detail(self, detail: str) -> InfeasibleBudgetError:
        """This error saying ``detail`` too (its figures, and whether its minimum is exact, kept)."""
        return InfeasibleBudgetError(self.budget, self.min_budget, " ".join(filter(None, [self.detail, detail])),
                                     self.lower_bound, self.exact)


class CaptureError(FxoptError, RuntimeError):
    """The model's training step could not be captured as one graph."""


class GraphBreakError(CaptureError):
    """The step could not be captured as one graph where one graph is required."""


class BudgetError(FxoptError, ValueError):
    """The budget could not be understood."""


def check_choice(what: str, value, choices) -> None:
    """Refuse ``value`` unless it is one of ``choices``, naming them (every option that takes one
    of a few names is checked here)."""
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(map(str, choices))}")
