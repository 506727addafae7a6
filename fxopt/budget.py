"""Budgets as users give them, parsed once into a `Budget`.

    Budget.parse(2_000_000)   Budget(bytes=2000000)        bytes
    Budget.parse("3GiB")      Budget(bytes=3221225472)     a size: KiB/MiB/GiB are powers of 1024,
                                                           KB/MB/GB of 1000, a bare K/M/G is KiB/MiB/GiB
    Budget.parse(0.5)         Budget(fraction=0.5)         a share of the eager peak: a float in (0, 1]
    Budget.parse("50%")       Budget(fraction=0.5)         or a percentage in (0%, 100%]
    Budget.parse("min")       Budget(minimum=True)         the smallest budget fxopt can meet

A share is of eager's predicted peak, or, with ``compiler="inductor"``, of Inductor's own step's
measured peak (`fxopt.capture.inductor`).

`fxopt.Options` parses its ``budget`` when it is made, so a budget that cannot be read fails at
the call that gives it; everything after reads the parsed value (`Budget.bytes`,
`Budget.resolve`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Union

from fxopt.errors import BudgetError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_NUMBER = r"[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_FORMS = "bytes (1000000), a size ('3GiB', '500MB'), a share of the eager peak (0.5 or '50%') or 'min'"


@dataclasses.dataclass(frozen=True, repr=False)
class Budget:
    """A parsed budget: exactly one of ``bytes`` (a size), ``fraction`` (a share of the step's
    eager peak, in (0, 1]) and ``minimum`` (the smallest budget fxopt can meet, found when the
    step is planned). ``text``: the budget as the user gave it, for messages."""

    bytes: int | None = None
    fraction: float | None = None
    minimum: bool = False
    text: str = dataclasses.field(default="", compare=False)

    def __post_init__(self):
        if (self.bytes is not None) + (self.fraction is not None) + self.minimum != 1:
            raise BudgetError(f"a Budget is exactly one of bytes=, fraction= or minimum=True; got bytes={self.bytes!r}, "
                              f"fraction={self.fraction!r}, minimum={self.minimum!r}")
        if not self.text:
            text = "min" if self.minimum else str(self.bytes) if self.bytes is not None else f"{self.fraction:.4g}"
            object.__setattr__(self, "text", text)

    @classmethod
    def parse(cls, value: BudgetLike) -> Budget:
        """``value`` (see the module) as a `Budget`; `BudgetError` saying what is wrong with it."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise BudgetError(f"budget must be {_FORMS}, not {value!r}")
        if isinstance(value, str):
            return _parse_text(value)
        if isinstance(value, float):
            if not math.isfinite(value) or not 0 < value <= 1:
                raise BudgetError(f"a float budget is a share of the eager peak and must be in (0, 1], got {value!r}; "
                                  "give bytes as an int or a size such as '3GiB'")
            return cls(fraction=value, text=repr(value))
        if value <= 0:
            raise BudgetError(f"budget must be positive, got {value} bytes")
        return cls(bytes=value, text=str(value))

    def resolve(self, eager_peak_bytes: int) -> int:
        """The budget in bytes for a step whose eager peak is ``eager_peak_bytes``."""
        if self.minimum:
            raise BudgetError("budget 'min' has no size until the step is planned (fxopt.planner.make_plan)")
        if self.fraction is not None:
            return int(self.fraction * eager_peak_bytes)
        return self.bytes

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Budget({self.text!r})"


BudgetLike = Union[Budget, int, float, str]


def _parse_text(text: str) -> Budget:
    given = text.strip()
    if given.lower() == "min":
        return Budget(minimum=True, text=given)
    percent = re.fullmatch(rf"({_NUMBER})\s*%", given)
    sized = re.fullmatch(rf"({_NUMBER})\s*([A-Za-z]*)", given)
    if percent is None and (sized is None or sized.group(2).lower() not in _UNITS):
        raise BudgetError(f"cannot read budget {text!r}: write {_FORMS}")
    number = float((percent or sized).group(1))
    if not number > 0:
        raise BudgetError(f"budget must be positive, got {text!r}")
    if not math.isfinite(number):
        raise BudgetError(f"budget must be finite, got {text!r}")
    if percent is not None:
        if number > 100:
            raise BudgetError(f"budget {text!r} is more than the eager peak: a share of the eager peak is at most "
                              "100%; give bytes or a size ('3GiB') for more")
        return Budget(fraction=number / 100, text=given)
    size = int(number * _UNITS[sized.group(2).lower()])
    if size <= 0:
        raise BudgetError(f"budget {text!r} is less than one byte")
    return Budget(bytes=size, text=given)
