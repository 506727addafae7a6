"""Budgets: bytes, human strings ("3GiB", "500MB", "50%") or fractions of the eager peak."""

from __future__ import annotations

import math
import re

from fxopt.errors import BudgetError


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}

Budget = int | float | str


def resolve_budget(budget: Budget, eager_peak_bytes: int | None = None) -> int:
    """Turn a user budget into bytes.

    - ``int``: bytes.
    - ``float`` in (0, 1] or ``"NN%"``: that fraction of the un-rewritten step's peak
      (``eager_peak_bytes``).
    - ``str`` with a unit: ``"3GiB"``, ``"500MB"``, ``"1.5 GB"`` (KiB/MiB/GiB are powers of 1024,
      KB/MB/GB of 1000; a bare K/M/G means KiB/MiB/GiB).
    """
    if isinstance(budget, bool):
        raise BudgetError(f"budget must be bytes, a string like '3GiB' or a fraction in (0, 1], not {budget!r}")
    if isinstance(budget, str):
        text = budget.strip()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*%", text)
        if m:
            return resolve_budget(float(m.group(1)) / 100, eager_peak_bytes)
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise BudgetError(
                f"cannot read budget {budget!r}: write bytes (1000000), a size with a unit "
                "('3GiB', '500MB', '512MiB') or a percentage of the eager peak ('50%')"
            )
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
        return resolve_budget(int(value), eager_peak_bytes)
    if isinstance(budget, float):
        if not math.isfinite(budget) or not 0 < budget <= 1:
            raise BudgetError(
                f"a float budget is a fraction of the eager peak and must be in (0, 1], got {budget!r}; "
                "give bytes as an int or a string like '3GiB'"
            )
        if eager_peak_bytes is None:
            raise BudgetError("a fractional budget needs the eager peak, which is not known here")
        return int(budget * eager_peak_bytes)
    if isinstance(budget, int):
        if budget <= 0:
            raise BudgetError(f"budget must be positive, got {budget} bytes")
        return budget
    raise BudgetError(f"budget must be an int (bytes), a str ('3GiB', '50%') or a float in (0, 1], not {type(budget).__name__}")
